// Deterministic parameter initialisation independent of the parallel layout:
// the full tensor is drawn from a stream seeded by (run seed, parameter name),
// then this rank keeps its tensor-parallel slice. So tp=1 and tp=4 start equal.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace loom::model {

// 64-bit FNV-1a, for seeding and checksums.
uint64_t fnv1a(const void* data, size_t bytes, uint64_t h = 1469598103934665603ull);
inline uint64_t fnv1a(const std::string& s, uint64_t h = 1469598103934665603ull) {
  return fnv1a(s.data(), s.size(), h);
}

// The full tensor's values for an init kind (LOOM_INIT_*).
std::vector<float> init_full(int32_t init, float stddev, int num_layers, int64_t numel, uint64_t seed,
                             const std::string& name);

// Shape of this rank's slice; throws loom::Error when the dim does not split.
std::vector<int64_t> local_shape(const std::vector<int64_t>& full, int partition_dim, int partition_stride,
                                 int tp, const std::string& what);

// Copies rank `r`'s slice of `full` (row-major, shape `full_shape`) to `out`.
void take_slice(const std::vector<float>& full, const std::vector<int64_t>& full_shape, int partition_dim,
                int partition_stride, int tp, int r, float* out);

}  // namespace loom::model
