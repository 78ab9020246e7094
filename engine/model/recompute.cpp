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

size_t kept_hidden_states(const std::vector<int>& groups, bool last_global_chunk) {
  size_t kept = groups.size();
  for (size_t k = 0; k + 1 < groups.size(); ++k)
    if (groups[k] >= 0 && groups[k + 1] == groups[k]) --kept;
  return last_global_chunk && kept > 0 ? kept - 1 : kept;
}

Recomputation::Recomputation(const Layers& layers, HiddenStates& hidden) : layers_(layers), hidden_(hidden) {}

bool Recomputation::ends_group(size_t i) const {
  const LocalChunk& chunk = layers_.chunk(layers_[i].chunk);
  return layers_[i].recompute && (i + 1 == chunk.end_layer || group_of(i + 1) != group_of(i));
}

bool Recomputation::begins_group(size_t i) const {
  const LocalChunk& chunk = layers_.chunk(layers_[i].chunk);
  return layers_[i].recompute && (i == chunk.first_layer || group_of(i - 1) != group_of(i));
}

void Recomputation::drop_after_forward(int c, int mb, size_t i) {
  const Layer& l = layers_[i];
  l.api->release(l.handle, mb);
  if (!begins_group(i)) hidden_.drop(c, mb, layers_.chunk(c).output_position(i - 1));
}

void Recomputation::keep_inputs(int c, int mb, const ForwardInputs& in) { inputs_[{c, mb}] = in; }

void Recomputation::forget(int c, int mb) { inputs_.erase({c, mb}); }

// Bit for bit the first forward (the same inputs and dropout seeds); the group's
// last output goes into the buffer it had (already consumed by the next layer's
// backward).
void Recomputation::run_group_again(int c, int mb, size_t last, const LayerForward& forward) {
  const LocalChunk& chunk = layers_.chunk(c);
  size_t first = last;
  while (first > chunk.first_layer && group_of(first - 1) == group_of(last)) --first;
  const bool first_global = chunk.is_first_global();
  for (size_t j = first; j <= last; ++j) {
    const size_t lj = j - chunk.first_layer, out_at = chunk.output_position(j);
    DLTensor input{}, output{};
    const bool has_input = lj > 0 || !first_global, has_output = out_at < hidden_.count(c, mb);
    // The previous layer's output, or the chunk's received input.
    if (has_input) input = hidden_.view(hidden_.at(c, mb, lj > 0 ? out_at - 1 : 0));
    if (has_output) output = hidden_.view(hidden_.refill(c, mb, out_at));
    forward(j, has_input ? &input : nullptr, has_output ? &output : nullptr, inputs_.at({c, mb}));
  }
}

void Recomputation::drop_group_states(int c, int mb, size_t first) {
  const LocalChunk& chunk = layers_.chunk(c);
  size_t last = first;
  while (!ends_group(last)) ++last;
  for (size_t j = first; j < last; ++j) hidden_.drop(c, mb, chunk.output_position(j));
}

size_t Recomputation::kept_hidden_states() const {
  size_t kept = 0;
  for (const LocalChunk& chunk : layers_.chunks()) {
    std::vector<int> groups;
    for (size_t i = chunk.first_layer; i < chunk.end_layer; ++i) groups.push_back(group_of(i));
    kept += model::kept_hidden_states(groups, chunk.is_last_global());
  }
  return kept;
}

}  // namespace loom::model
