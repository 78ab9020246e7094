// This rank's parameters and their gradients in two flat buffers: one entry per
// parameter from its layers' declarations (param_plan), placed by Megatron's layout
// one region per chunk, initialised from (seed, name) independently of the parallel
// layout, and bound to the layers as views in their declaration order.
#pragma once

#include "engine/model/buffer_layout.hpp"
#include "engine/model/layers.hpp"
#include "engine/model/param_plan.hpp"
#include "engine/runtime/rank_runtime.hpp"

#include <loom/cpp/core.hpp>

#include <cstdint>
#include <string>
#include <functional>
#include <vector>

namespace loom::model {

// LOOM_DTYPE_* of a device.param_dtype / grad_dtype value ("fp32", "bf16").
int32_t model_dtype(const std::string& name);

class ParamBuffers {
 public:
  // Binds every layer of `layers` to its views; the layers must not use them
  // after this object goes. init_std > 0 replaces the std every normally initialised
  // parameter declares (model.init_method_std).
  ParamBuffers(runtime::RankRuntime& rank, const Layers& layers, int num_layers, size_t bucket_size,
               int32_t param_dtype, int32_t grad_dtype, uint64_t seed, float init_std = 0.0f);
  ParamBuffers(const ParamBuffers&) = delete;
  ParamBuffers& operator=(const ParamBuffers&) = delete;

  void* params() const { return params_.get(); }
  void* grads() const { return grads_.get(); }
  size_t numel() const { return numel_; }
  int32_t param_dtype() const { return param_dtype_; }
  int32_t grad_dtype() const { return grad_dtype_; }
  const BufferLayout& layout() const { return layout_; }
  const std::vector<ParamEntry>& entries() const { return entries_; }
  // The entries layer i declares (a tied entry under each of its layers), by index.
  const std::vector<size_t>& layer_entries(size_t layer) const { return layer_entries_[layer]; }
  void zero_grads();
  // Every parameter from its whole tensor, full_of(entry) (fp32, entry.full_shape,
  // row-major): this rank's slice of it — its experts' block of dim 0 for an expert
  // parameter, then its etp part (the tp part of any other) — stored in the parameter
  // dtype (rounded to nearest even). The random initialisation is this with the init's
  // tensors; a run that starts from given weights passes those.
  using FullTensorOf = std::function<std::vector<float>(const ParamEntry&)>;
  void assign(const FullTensorOf& full_of);
  // This rank's slice of a parameter's whole tensor (fp32): its experts (ep), then its
  // part of the partition dim (tp, or etp for experts), as the engine cuts parameters.
  std::vector<float> local_part(const ParamEntry& e, std::vector<float> full) const;

  // Per entry, in entries() order, for the optimizer:
  std::vector<loom_param_info> param_infos() const;
  // 1 when its gradient norm is counted on another stage (a tied copy off the first chunk).
  std::vector<int32_t> counted_elsewhere() const;
  // 1 for an expert parameter (ABI 1.4).
  std::vector<int32_t> expert_flags() const;
  bool has_expert_params() const;

 private:
  // A layer's parameter and gradient views; bind() hands the layer their arrays.
  struct LayerViews {
    std::vector<std::vector<int64_t>> shapes;  // local shapes, alive for the views
    std::vector<DLTensor> params, grads;
  };
  CollectedParams collect(const Layers& layers) const;
  void lay_out(size_t chunks, size_t bucket_size);
  void allocate();
  void initialise(int num_layers, uint64_t seed, float init_std);
  void bind(const Layers& layers, const CollectedParams& collected);

  runtime::RankRuntime& rank_;
  int32_t param_dtype_, grad_dtype_;
  std::vector<int> chunk_global_index_;  // by local chunk
  std::vector<ParamEntry> entries_;
  std::vector<std::vector<size_t>> layer_entries_;  // by layer
  BufferLayout layout_;
  size_t numel_ = 0;
  loom::Buffer params_, grads_;
  std::vector<LayerViews> views_;  // by layer
};

}  // namespace loom::model
