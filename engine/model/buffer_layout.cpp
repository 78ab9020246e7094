#include "engine/model/buffer_layout.hpp"

#include <numeric>
#include <stdexcept>

namespace loom::model {

namespace {
size_t round_up(size_t v, size_t m) { return (v + m - 1) / m * m; }
}  // namespace

BufferLayout layout_buffer(const std::vector<size_t>& numels, int dp, size_t bucket_size) {
  if (dp < 1) throw std::invalid_argument("layout_buffer: dp must be >= 1");
  const size_t bucket_align = std::lcm(static_cast<size_t>(dp), size_t{128});
  BufferLayout l;
  l.params.resize(numels.size());
  size_t cursor = 0, bucket_start = 0;
  bool open = false;
  for (size_t k = numels.size(); k-- > 0;) {
    const size_t start = round_up(cursor, kParamStartAlign);
    l.params[k] = {start, start + numels[k]};
    cursor = start + numels[k];
    open = true;
    if (bucket_size > 0 && cursor - bucket_start >= bucket_size) {
      const size_t end = round_up(cursor, bucket_align);
      l.buckets.push_back({bucket_start, end});
      bucket_start = cursor = end;
      open = false;
    }
  }
  if (open || l.buckets.empty()) {
    const size_t end = std::max(round_up(cursor, bucket_align), bucket_start + bucket_align);
    l.buckets.push_back({bucket_start, end});
    cursor = end;
  }
  l.numel = cursor;
  return l;
}

BufferLayout layout_chunked_buffer(const std::vector<std::vector<size_t>>& numels, int dp, size_t bucket_size) {
  if (numels.size() == 1) return layout_buffer(numels[0], dp, bucket_size);
  BufferLayout out;
  for (const std::vector<size_t>& chunk : numels) {
    const BufferLayout l = layout_buffer(chunk, dp, bucket_size);
    for (const Range& r : l.params) out.params.push_back({out.numel + r.start, out.numel + r.end});
    for (const Range& r : l.buckets) out.buckets.push_back({out.numel + r.start, out.numel + r.end});
    out.numel += l.numel;
  }
  return out;
}

BufferLayout layout_model_buffer(const std::vector<int>& chunk_of, const std::vector<size_t>& numels,
                                 const std::vector<bool>& expert, size_t chunks, int dp, size_t bucket_size) {
  if (chunk_of.size() != numels.size() || expert.size() != numels.size())
    throw std::invalid_argument("layout_model_buffer: one chunk, size and expert flag per parameter");
  std::vector<std::vector<size_t>> regions(chunks + 1);
  std::vector<std::pair<size_t, size_t>> where(numels.size());  // (region, index in it)
  for (size_t i = 0; i < numels.size(); ++i) {
    const size_t region = expert[i] ? chunks : static_cast<size_t>(chunk_of[i]);
    if (region > chunks) throw std::invalid_argument("layout_model_buffer: chunk out of range");
    where[i] = {region, regions[region].size()};
    regions[region].push_back(numels[i]);
  }
  if (regions.back().empty()) regions.pop_back();
  BufferLayout chunked = layout_chunked_buffer(regions, dp, bucket_size);
  std::vector<size_t> first(regions.size() + 1, 0);  // index of each region's first parameter in chunked.params
  for (size_t r = 0; r < regions.size(); ++r) first[r + 1] = first[r] + regions[r].size();
  BufferLayout out;
  out.numel = chunked.numel;
  out.buckets = std::move(chunked.buckets);
  for (const auto& [region, k] : where) out.params.push_back(chunked.params[first[region] + k]);
  return out;
}

}  // namespace loom::model
