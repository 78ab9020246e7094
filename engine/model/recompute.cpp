#include "engine/model/recompute.hpp"

#include <algorithm>

namespace loom::model {

std::vector<int> recompute_groups(const manifest::RunConfig& config, const std::vector<LayerSpec>& chunk) {
  std::vector<int> groups(chunk.size(), -1);
  if (config.model.recompute_granularity != "full") return groups;
  const int64_t n = config.model.recompute_num_layers;
  const bool uniform = config.model.recompute_method == "uniform";
  int first_block = -1;
  for (const LayerSpec& l : chunk)
    if (l.block_index >= 0 && (first_block < 0 || l.block_index < first_block)) first_block = l.block_index;
  for (size_t k = 0; k < chunk.size(); ++k) {
    if (chunk[k].block_index < 0) continue;
    const int64_t b = chunk[k].block_index - first_block;  // the chunk's b-th block
    if (uniform)
      groups[k] = static_cast<int>(b / std::max<int64_t>(n, 1));
    else if (n == 0 || b < n)
      groups[k] = static_cast<int>(b);
  }
  return groups;
}

size_t kept_hidden_states(const std::vector<int>& groups) {
  size_t kept = groups.size();
  for (size_t k = 0; k + 1 < groups.size(); ++k)
    if (groups[k] >= 0 && groups[k + 1] == groups[k]) --kept;
  return kept;
}

}  // namespace loom::model
