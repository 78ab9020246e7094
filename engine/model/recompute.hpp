// Activation recomputation (model.recompute_*, Megatron's --recompute-*): which
// layers of a chunk form recompute groups, and, while steps run, the bookkeeping
// that lets a group keep only its input hidden state between its forward and its
// backward, which runs the group's forward again first.
#pragma once

#include "engine/manifest/run_config.hpp"
#include "engine/model/hidden_states.hpp"
#include "engine/model/layers.hpp"

#include <cstdint>
#include <functional>
#include <map>
#include <utility>
#include <vector>

namespace loom::model {

// Per layer of a chunk (a pipeline stage's, or virtual stage's), the recompute
// group it belongs to, or -1. A group is a run of whole consecutive blocks whose
// forward runs again in backward from the group's input, the only hidden state it
// keeps (and its layers keep nothing else). With model.recompute_granularity =
// "full": method "block" makes each of the chunk's first model.recompute_num_layers
// blocks a group (0: every block), "uniform" puts all its blocks in groups of
// recompute_num_layers (0: 1), Megatron's --recompute-method.
std::vector<int> recompute_groups(const manifest::RunConfig& config, const std::vector<LayerSpec>& chunk);

// Hidden states a chunk with these groups keeps per microbatch: one after each
// layer, less the outputs its groups drop (those their own next layer consumes),
// and less the last layer's on the model's last chunk (it computes the loss).
size_t kept_hidden_states(const std::vector<int>& groups, bool last_global_chunk);

// What a recomputed forward of (chunk, microbatch) needs again in backward.
struct ForwardInputs {
  const int32_t* tokens = nullptr;
  const int32_t* targets = nullptr;
  uint64_t dropout_seed = 0;
  const int32_t* document_start = nullptr;  // device, or null: one document a sequence
  const int32_t* position_ids = nullptr;    // device, or null: positions in the whole sequence
};

// The recompute groups of a rank's layers (Layer::recompute_group) at work on
// the hidden states of the (chunk, microbatch) forwards in flight.
class Recomputation {
 public:
  Recomputation(const Layers& layers, HiddenStates& hidden);
  Recomputation(const Recomputation&) = delete;
  Recomputation& operator=(const Recomputation&) = delete;

  // Whether layer i is the last, or the first, layer of its group (false outside groups).
  bool ends_group(size_t i) const;
  bool begins_group(size_t i) const;
  // After layer i's training forward of (c, mb), i recomputing: drops what it
  // saved, and its input when that was the output of the group's previous layer.
  void drop_after_forward(int c, int mb, size_t i);
  // The inputs of (c, mb)'s forward, kept until its backward (or release) forgets them.
  void keep_inputs(int c, int mb, const ForwardInputs& in);
  void forget(int c, int mb);
  // One layer's training forward of the microbatch over the given hidden states.
  using LayerForward =
      std::function<void(size_t layer, const DLTensor* input, DLTensor* output, const ForwardInputs& in)>;
  // Backward of (c, mb), before layer `last`'s, which ends a group: the group's
  // forward again, on its input, its inner hidden states into fresh slots.
  void run_group_again(int c, int mb, size_t last, const LayerForward& forward);
  // Backward of (c, mb), after layer `first`'s, which begins a group: the
  // group's recomputed inner hidden states go.
  void drop_group_states(int c, int mb, size_t first);
  // Hidden states this rank's chunks keep per microbatch (kept_hidden_states).
  size_t kept_hidden_states() const;

 private:
  int group_of(size_t i) const { return layers_[i].recompute_group; }

  const Layers& layers_;
  HiddenStates& hidden_;
  std::map<std::pair<int, int>, ForwardInputs> inputs_;  // (c, mb) of recomputing chunks, until backward
};

}  // namespace loom::model
