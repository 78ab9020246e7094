#include "engine/model/param_init.hpp"

#include <loom/cpp/core.hpp>

#include <cmath>
#include <cstring>

namespace loom::model {

uint64_t fnv1a(const void* data, size_t bytes, uint64_t h) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

namespace {
// splitmix64: a small, well-mixed counter-based generator (portable, unlike
// std::normal_distribution whose algorithm is implementation-defined).
uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
double uniform01(uint64_t& state) { return ((splitmix64(state) >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
}  // namespace

std::vector<float> init_full(int32_t init, float stddev, int num_layers, int64_t numel, uint64_t seed,
                             const std::string& name) {
  std::vector<float> v(static_cast<size_t>(numel), 0.f);
  switch (init) {
    case LOOM_INIT_ZEROS: break;
    case LOOM_INIT_ONES: std::fill(v.begin(), v.end(), 1.f); break;
    case LOOM_INIT_NORMAL:
    case LOOM_INIT_NORMAL_SCALED: {
      double sd = stddev;
      if (init == LOOM_INIT_NORMAL_SCALED) sd /= std::sqrt(2.0 * std::max(1, num_layers));
      uint64_t state = fnv1a(name, seed * 0x9E3779B97F4A7C15ull + 1);
      for (int64_t i = 0; i < numel; i += 2) {  // Box-Muller, two values per draw
        double u1 = uniform01(state), u2 = uniform01(state);
        double r = std::sqrt(-2.0 * std::log(u1));
        v[i] = static_cast<float>(sd * r * std::cos(2 * M_PI * u2));
        if (i + 1 < numel) v[i + 1] = static_cast<float>(sd * r * std::sin(2 * M_PI * u2));
      }
      break;
    }
    default: throw loom::Error("parameter " + name + ": unknown init kind " + std::to_string(init));
  }
  return v;
}

std::vector<int64_t> local_shape(const std::vector<int64_t>& full, int partition_dim, int partition_stride,
                                 int tp, const std::string& what) {
  std::vector<int64_t> s = full;
  if (partition_dim < 0 || tp == 1) return s;
  LOOM_REQUIRE(partition_dim < static_cast<int>(full.size()),
               what << ": partition_dim " << partition_dim << " is outside its " << full.size() << " dims");
  const int stride = std::max(1, partition_stride);
  LOOM_REQUIRE(full[partition_dim] % (int64_t(stride) * tp) == 0,
               what << ": dim " << partition_dim << " of size " << full[partition_dim] << " does not split into "
                    << stride << " blocks x tp " << tp);
  s[partition_dim] /= tp;
  return s;
}

void take_slice(const std::vector<float>& full, const std::vector<int64_t>& shape, int partition_dim,
                int partition_stride, int tp, int r, float* out) {
  if (partition_dim < 0 || tp == 1) {
    std::memcpy(out, full.data(), full.size() * sizeof(float));
    return;
  }
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < partition_dim; ++d) outer *= shape[d];
  for (size_t d = partition_dim + 1; d < shape.size(); ++d) inner *= shape[d];
  const int64_t dim = shape[partition_dim];
  const int stride = std::max(1, partition_stride);
  const int64_t block = dim / stride, part = block / tp;
  float* dst = out;
  for (int64_t o = 0; o < outer; ++o)
    for (int s = 0; s < stride; ++s) {
      const float* src = full.data() + (o * dim + s * block + r * part) * inner;
      std::memcpy(dst, src, part * inner * sizeof(float));
      dst += part * inner;
    }
}

}  // namespace loom::model
