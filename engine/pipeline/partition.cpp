#include "engine/pipeline/partition.hpp"

#include <stdexcept>
#include <string>

namespace loom::pipeline {

std::vector<int> blocks_per_chunk(int num_blocks, int pp, int vpp, int first, int last) {
  const int chunks = pp * vpp;
  std::vector<int> out(static_cast<size_t>(chunks), 0);
  if (chunks == 1) {
    out[0] = num_blocks;
    return out;
  }
  int rest = num_blocks, rest_chunks = chunks;
  if (first > 0) rest -= first, --rest_chunks;
  if (last > 0) rest -= last, --rest_chunks;
  const auto fail = [&](const std::string& why) {
    throw std::invalid_argument("cannot divide " + std::to_string(num_blocks) + " transformer layers over pp * vpp = " +
                                std::to_string(chunks) + " pipeline chunks (first chunk " +
                                (first > 0 ? std::to_string(first) : std::string("even")) + ", last chunk " +
                                (last > 0 ? std::to_string(last) : std::string("even")) + "): " + why);
  };
  if (rest < 0) fail("the first and last chunks alone need more layers than the model has");
  if (rest_chunks == 0 && rest != 0) fail("no chunk is left for the remaining " + std::to_string(rest) + " layers");
  if (rest_chunks > 0 && (rest % rest_chunks != 0 || rest / rest_chunks == 0))
    fail("the other " + std::to_string(rest_chunks) + " chunks would share " + std::to_string(rest) +
         " layers, which is not a positive multiple of " + std::to_string(rest_chunks));
  for (int g = 0; g < chunks; ++g) out[static_cast<size_t>(g)] = rest_chunks > 0 ? rest / rest_chunks : 0;
  if (first > 0) out.front() = first;
  if (last > 0) out.back() = last;
  return out;
}

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
