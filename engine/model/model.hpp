// A rank's share of the model: its layers (created from layer plugins), their
// parameters and gradients in flat per-rank buffers, and forward/backward of one
// microbatch through them. Activations between layers are kept per microbatch
// until that microbatch's backward, so a pipeline can hold several in flight.
#pragma once

#include "engine/manifest/manifest.hpp"
#include "engine/model/buffer_layout.hpp"
#include "engine/plugins/registry.hpp"
#include "engine/runtime/rank_runtime.hpp"

#include <loom/cpp/core.hpp>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace loom::model {

// One layer of the composed model, as the manifest describes it.
struct LayerSpec {
  std::string instance;    // "embedding", "blocks.3.attention", "lm_head"
  std::string config;      // the name used in model.pre/block/post (a [model.layer.NAME] table, or a plugin)
  std::string plugin;      // layer plugin name
  int block_index = -1;    // -1 outside the repeated blocks
};

// pre + block × num_layers + post, in model order.
std::vector<LayerSpec> model_layers(const manifest::Manifest& m);

// The model dimensions given the vocabulary and the tensor-parallel size.
loom_model_dims model_dims(const manifest::Manifest& m, int64_t vocab, int tp);

// A parameter of this rank as the optimizer sees it; tied parameters appear once.
struct ParamEntry {
  std::string name;                // "blocks.0.attention.qkv.weight" (entries are in model order)
  std::vector<int64_t> full_shape, local_shape;
  size_t offset = 0, numel = 0;    // in elements, in the flat buffers
  int layer = 0;                   // index into layers() of the owner
  loom_param_decl decl{};          // as declared (pointers valid while the layer lives)
  bool duplicated = false;         // identical on every tp rank
  std::string tie_key;
};

class Model {
 public:
  Model(const manifest::Manifest& m, const plugins::Registry& registry, runtime::RankRuntime& rank,
        const loom_model_dims& dims, std::vector<LayerSpec> layers, uint64_t seed);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  // One microbatch. tokens/targets: device buffers [seq, micro_batch]. The last
  // layer (if on this rank) writes loss_sum/loss_count and, when non-null, the
  // argmax predictions (host, [seq, micro_batch]).
  void forward(int mb, const int32_t* tokens, const int32_t* targets, bool training, uint64_t dropout_seed,
               float* loss_sum, int64_t* loss_count, int32_t* predictions = nullptr);
  void backward(int mb, float loss_scale);
  void release(int mb);
  void zero_grads();
  // After the last microbatch's backward, before the optimizer: the reductions
  // that make each gradient whole (tp sum of duplicated parameters under
  // sequence parallelism).
  void finalize_grads();
  // Bytes of the hidden state between two layers of one microbatch.
  size_t hidden_bytes() const;

  void* params() const { return params_.get(); }
  void* grads() const { return grads_.get(); }
  size_t numel() const { return numel_; }
  // Where each entry (param_entries() order = model order) and bucket lives.
  const BufferLayout& layout() const { return layout_; }
  const std::vector<ParamEntry>& param_entries() const { return entries_; }
  std::vector<loom_param_info> param_infos() const;
  size_t layer_count() const { return layers_.size(); }
  const LayerSpec& layer_spec(size_t i) const { return layers_[i].spec; }
  double forward_flops() const;       // one microbatch through this rank's layers
  uint64_t activation_bytes() const;  // saved per microbatch by this rank's layers
  int64_t tokens_per_microbatch() const { return dims_.seq_len * dims_.micro_batch; }

 private:
  struct Layer {
    LayerSpec spec;
    const loom_layer_api* api = nullptr;
    loom_layer* handle = nullptr;
    std::vector<std::vector<int64_t>> shapes;  // local shapes, alive for the DLTensor views
    std::vector<DLTensor> param_views, grad_views;
  };
  void build_buffers(uint64_t seed);
  void run_step(const char* scope, int64_t key, const std::function<void()>& fn);

  runtime::RankRuntime& rank_;
  loom_model_dims dims_;
  size_t bucket_size_ = 0;
  BufferLayout layout_;
  std::vector<Layer> layers_;
  std::vector<ParamEntry> entries_;
  size_t numel_ = 0;
  loom::Buffer params_, grads_;
  bool sequence_parallel_ = false;
  int64_t hidden_shape_[3];
  // Per microbatch in flight: the hidden states at each layer boundary.
  std::map<int, std::vector<loom::Buffer>> acts_;
  loom::Buffer grad_a_, grad_b_;
};

}  // namespace loom::model
