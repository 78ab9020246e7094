#include "engine/model/shard_ranges.hpp"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

namespace loom::model {

std::vector<RankShard> shard_ranges(const BufferLayout& layout, int dp, int rank) {
  if (dp < 1) throw std::invalid_argument("shard_ranges: dp must be >= 1, got " + std::to_string(dp));
  if (rank < 0 || rank >= dp)
    throw std::invalid_argument("shard_ranges: rank " + std::to_string(rank) + " is outside [0, " +
                                std::to_string(dp) + ")");
  // Parameters in buffer order, so each shard lists its pieces front to back.
  std::vector<size_t> order(layout.params.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return layout.params[a].start < layout.params[b].start; });

  std::vector<RankShard> out;
  for (size_t b = 0; b < layout.buckets.size(); ++b) {
    const Range& bucket = layout.buckets[b];
    if (bucket.size() % static_cast<size_t>(dp) != 0)
      throw std::invalid_argument("shard_ranges: bucket " + std::to_string(b) + " of " +
                                  std::to_string(bucket.size()) + " elements does not split into " +
                                  std::to_string(dp) + " equal shards");
    RankShard s;
    s.bucket = b;
    s.range = shard_of(bucket, dp, rank);
    for (size_t i : order) {
      const Range& p = layout.params[i];
      const size_t lo = std::max(p.start, s.range.start), hi = std::min(p.end, s.range.end);
      if (lo >= hi) continue;
      ParamShard ps;
      ps.index = i;
      ps.world = {lo, hi};
      ps.bucket = {lo - bucket.start, hi - bucket.start};
      ps.local = {lo - s.range.start, hi - s.range.start};
      ps.param = {lo - p.start, hi - p.start};
      s.params.push_back(ps);
    }
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace loom::model
