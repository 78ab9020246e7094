// Activation recomputation (model.recompute_*, Megatron's --recompute-*): which
// layers of a chunk form recompute groups.
#pragma once

#include "engine/manifest/run_config.hpp"
#include "engine/model/layers.hpp"

#include <cstddef>
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
// layer, less the outputs its groups drop (those their own next layer consumes).
size_t kept_hidden_states(const std::vector<int>& groups);

}  // namespace loom::model
