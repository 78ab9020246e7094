// How many transformer blocks each pipeline chunk gets (see partition.hpp); on
// its own so the manifest check can apply the same rule.
#pragma once

#include <vector>

namespace loom::pipeline {

// Transformer blocks per global chunk (pp * vpp of them): even, or with the first
// and/or last chunk given its own count (> 0). Throws std::invalid_argument
// naming the numbers when they do not add up.
std::vector<int> blocks_per_chunk(int num_blocks, int pp, int vpp, int first_chunk_blocks, int last_chunk_blocks);

}  // namespace loom::pipeline
