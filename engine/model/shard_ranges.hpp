// Which part of each parameter a data-parallel rank owns under the distributed
// optimizer (Megatron-LM's `distrib_optimizer.py`): rank r of dp owns shard r of every bucket, and for each
// parameter overlapping that shard there are four views of the same elements —
// where they sit in the whole buffer (world), in their bucket, in the rank's
// shard (local) and in the flattened parameter (param). All ranges are half-open,
// in elements. The layout itself comes from layout_buffer(); this only reads it.
#pragma once

#include "engine/model/buffer_layout.hpp"

#include <cstddef>
#include <vector>

namespace loom::model {

struct ParamShard {
  size_t index = 0;  // the parameter's position in model order
  Range world;       // in the buffer
  Range bucket;      // relative to the bucket's start
  Range local;       // relative to the shard's start
  Range param;       // within the flattened parameter, inside [0, numel)
};

struct RankShard {
  size_t bucket = 0;               // bucket index (buffer order)
  Range range;                     // the shard, in the buffer
  std::vector<ParamShard> params;  // in buffer order; empty when the shard holds only padding
};

// Rank `rank` of `dp`: one entry per bucket. Throws std::invalid_argument when
// rank is outside [0, dp) or a bucket does not split into dp equal shards.
std::vector<RankShard> shard_ranges(const BufferLayout& layout, int dp, int rank);

}  // namespace loom::model
