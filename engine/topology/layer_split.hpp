// How many transformer blocks each pipeline chunk gets: a pure rule over the
// pipeline's shape, applied by the manifest check and by the partition of the
// model's layers (pipeline/partition.hpp).
#pragma once

#include <vector>

namespace loom::topology {

// Transformer blocks per global chunk (pp * vpp of them, in model order): even, or
// with the first and/or last chunk given its own count (> 0), or `each` (one count
// per chunk; the first and last may have none, as they hold the embedding and the
// output layer). One chunk holds every block whatever the counts say. Throws
// std::invalid_argument naming the numbers when they do not add up.
std::vector<int> blocks_per_chunk(int num_blocks, int pp, int vpp, int first_chunk_blocks, int last_chunk_blocks,
                                  const std::vector<int>& each = {});

}  // namespace loom::topology
