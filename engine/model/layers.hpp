// The layers of a rank: which layers the manifest composes (pre + blocks + post),
// how one is created from its layer plugin, and the created layers of this rank's
// pipeline chunks, owned until the model goes.
#pragma once

#include "engine/manifest/run_config.hpp"
#include "engine/plugins/registry.hpp"
#include "engine/runtime/rank_runtime.hpp"

#include <loom/cpp/core.hpp>

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

// pre + the num_layers blocks (model.block, or model.block_pattern's kinds) + post, in model order.
std::vector<LayerSpec> model_layers(const manifest::RunConfig& config);

// The model dimensions given the vocabulary and the tensor-parallel size.
loom_model_dims model_dims(const manifest::RunConfig& config, int64_t vocab, int tp);

// Creates one layer from its plugin, with the manifest's [model.layer.NAME]
// options for it (what the Model and the memory planner both do). Returns the
// handle; *api is the plugin's table. Errors name the instance and the plugin.
loom_layer* create_layer(const manifest::RunConfig& config, const plugins::Registry& registry, loom_rank* rank,
                         const LayerSpec& spec, const loom_model_dims& dims, const loom_group& tp,
                         const loom_layer_api** api);

// Asks the layer's plugin whether it can run the configuration `run` describes
// (loom_layer_api.validate, ABI 1.12; `run` as for every layer, dims and
// instance_name set here for `spec`). Throws loom::Error naming the instance and
// the plugin when it refuses; a plugin without the slot is not asked.
void validate_layer(const manifest::RunConfig& config, const plugins::Registry& registry, const LayerSpec& spec,
                    const loom_layer_validate_args& run);

// What a layer says it holds (loom_layer_api.activation_bytes and workspace_bytes; 0
// without the slot), at most 2^50 bytes: more is a plugin's bug, refused (a loom::Error
// naming the layer) rather than summed into a count that wraps.
enum class LayerBytes { Activations, Workspace };
uint64_t layer_bytes(const loom_layer_api* api, loom_layer* handle, LayerBytes what, const std::string& instance);

struct Layer;
// A layer's failed call (a step, end_step, state) as an error that names the layer
// (its plugin's message may not), keeping the status code; nothing for NULL.
void check_layer_call(loom_status status, const Layer& l, const char* step);

// A pipeline chunk held by this rank: global chunk `global_index` of
// `num_global` (0-based), its layers in model order. A rank without pipeline
// parallelism holds one chunk, the whole model.
struct ModelChunk {
  int global_index = 0;
  int num_global = 1;
  std::vector<LayerSpec> layers;
};

// A layer of this rank, created.
struct Layer {
  LayerSpec spec;
  int chunk = 0;  // its local chunk
  const loom_layer_api* api = nullptr;
  loom_layer* handle = nullptr;
  bool capturable = false;  // its training steps may be captured (loom_layer_api.capturable == 1)
  // capturable() == 2 (ABI 1.7): its steps run directly and capture parts of
  // themselves as sub-steps (MoE: the router), when step args say they may.
  bool captures_parts = false;
  // In a recompute group (recompute_groups): what its training forward saved is
  // dropped at once (and its output, when the group's next layer consumed it),
  // and the group's forward runs again in backward.
  int recompute_group = -1;
  bool recompute = false;  // recompute_group >= 0
};

// A chunk as this rank holds it: its place among the global chunks, and its
// layers, [first_layer, end_layer) of Layers.
struct LocalChunk {
  int global_index = 0, num_global = 1;
  size_t first_layer = 0, end_layer = 0;
  bool is_first_global() const { return global_index == 0; }
  bool is_last_global() const { return global_index + 1 == num_global; }
  // Where the output of `layer` lies among a microbatch's hidden states of the
  // chunk (HiddenStates positions): after the received input, when there is one.
  size_t output_position(size_t layer) const { return (is_first_global() ? 0 : 1) + (layer - first_layer); }
};

// The layers of this rank's chunks in model order, created from their plugins
// with their capture kinds and recompute groups, and destroyed with this object.
class Layers {
 public:
  // Throws loom::Error, having destroyed the layers it created, when a layer
  // refuses its options or is to be recomputed but cannot drop its saved state.
  Layers(const manifest::RunConfig& config, const plugins::Registry& registry, runtime::RankRuntime& rank,
         const loom_model_dims& dims, const std::vector<ModelChunk>& chunks);
  ~Layers() { destroy(); }
  Layers(const Layers&) = delete;
  Layers& operator=(const Layers&) = delete;
  // Destroys every layer through its plugin, in model order; once.
  void destroy();

  size_t size() const { return layers_.size(); }
  const Layer& operator[](size_t i) const { return layers_[i]; }
  std::vector<Layer>::const_iterator begin() const { return layers_.begin(); }
  std::vector<Layer>::const_iterator end() const { return layers_.end(); }
  size_t chunk_count() const { return chunks_.size(); }
  const LocalChunk& chunk(int c) const { return chunks_[static_cast<size_t>(c)]; }
  const std::vector<LocalChunk>& chunks() const { return chunks_; }

  // One microbatch's forward through every layer.
  double forward_flops() const;
  // What the layers' training forwards save per microbatch until backward;
  // recomputing layers save nothing.
  uint64_t saved_activation_bytes() const;

 private:
  void add_chunk(const manifest::RunConfig& config, const plugins::Registry& registry, runtime::RankRuntime& rank,
                 const loom_model_dims& dims, const loom_group& tp, const ModelChunk& chunk);

  std::vector<Layer> layers_;
  std::vector<LocalChunk> chunks_;
};

}  // namespace loom::model
