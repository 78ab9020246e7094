// The layers' state outside their parameters (ABI 1.23 loom_layer_api.state and
// end_step): host fp32 arrays a layer updates itself once per training step (the MoE
// router's expert bias), identical on every rank holding the layer, checkpointed by
// name beside the parameters and restored at any parallel layout.
#pragma once

#include "engine/model/layers.hpp"
#include "engine/runtime/rank_runtime.hpp"

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace loom::model {

// One array, by its global name: the layer instance's and the state's
// ("blocks.1.moe.router.expert_bias").
struct LayerState {
  std::string name;
  float* data = nullptr;  // the layer's host memory
  int64_t count = 0;
  bool optional = false;  // LOOM_LAYER_STATE_OPTIONAL: a checkpoint may lack it
};

// A checkpoint's states by global name (what a restore writes into a model's).
using StateValues = std::map<std::string, std::vector<float>>;

// One layer's state arrays (ABI 1.23 loom_layer_api.state; none without the slot),
// named "<instance>.<state>", checked: a 1.x struct_size, unique non-empty names, 1 to
// 2^40 elements, memory. `check` turns the call's status into an error. Throws
// loom::Error naming the instance.
std::vector<LayerState> declared_states(const loom_layer_api* api, loom_layer* handle, const std::string& instance,
                                        const std::function<void(loom_status)>& check);

class LayerStates {
 public:
  // Asks each layer of `layers` with the slot for its state (after bind), checking
  // the declarations: a known struct_size, a unique name, at least one element and
  // memory. Throws loom::Error naming the layer.
  explicit LayerStates(const Layers& layers);

  const std::vector<LayerState>& states() const { return states_; }
  bool empty() const { return states_.empty(); }
  // A copy of every array (a checkpoint's snapshot).
  StateValues snapshot() const;
  // Writes each array from `values` by name. Throws loom::Error naming the first
  // array `values` lacks (but an optional one, which keeps its values), or holds with
  // another size or a value that is not finite; `source` names where they came from.
  void assign(const StateValues& values, const std::string& source) const;
  // Ends a training step of `microbatches` on this rank: each layer with the slot,
  // in model order (ABI 1.23 loom_layer_api.end_step).
  void end_step(runtime::RankRuntime& rank, int64_t step, int32_t microbatches) const;

 private:
  const Layers& layers_;
  std::vector<LayerState> states_;
};

}  // namespace loom::model
