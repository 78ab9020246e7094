#include "engine/pipeline/partition.hpp"

#include <stdexcept>
#include <string>

namespace loom::pipeline {

std::vector<std::vector<model::LayerSpec>> partition_layers(const std::vector<model::LayerSpec>& layers,
                                                            const std::vector<int>& blocks) {
  std::vector<std::vector<model::LayerSpec>> chunks(blocks.size());
  // The first block of each chunk: prefix sums of the counts.
  std::vector<int> first_block(blocks.size() + 1, 0);
  for (size_t g = 0; g < blocks.size(); ++g) first_block[g + 1] = first_block[g] + blocks[g];
  bool after_blocks = false;
  for (const model::LayerSpec& l : layers) {
    if (l.block_index < 0) {
      chunks[after_blocks ? chunks.size() - 1 : 0].push_back(l);
      continue;
    }
    after_blocks = true;
    size_t g = 0;
    while (g + 1 < blocks.size() && l.block_index >= first_block[g + 1]) ++g;
    chunks[g].push_back(l);
  }
  return chunks;
}

std::vector<model::ModelChunk> local_chunks(const std::vector<std::vector<model::LayerSpec>>& global_chunks, int pp,
                                            int pp_rank) {
  std::vector<model::ModelChunk> out;
  for (size_t g = static_cast<size_t>(pp_rank); g < global_chunks.size(); g += static_cast<size_t>(pp))
    out.push_back({static_cast<int>(g), static_cast<int>(global_chunks.size()), global_chunks[g]});
  return out;
}

}  // namespace loom::pipeline
