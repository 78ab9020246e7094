// The reductions that make each gradient whole after the last microbatch's
// backward, before the optimizer: the tp sum of duplicated parameters under
// sequence parallelism, and the sum of tied copies over the embedding group.
#pragma once

#include "engine/model/param_buffers.hpp"
#include "engine/runtime/rank_runtime.hpp"

namespace loom::model {

// sequence_parallel: the run shards hidden states over tp (and tp > 1).
void finalize_grads(const runtime::RankRuntime& rank, const ParamBuffers& buffers, bool sequence_parallel);

}  // namespace loom::model
