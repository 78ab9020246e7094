// The seeded orders data sources visit their samples in: the same on every platform,
// so a resumed run and every dp rank see the order the uninterrupted run would.
#pragma once

#include "engine/train/data.hpp"

#include <cstdint>
#include <random>
#include <vector>

namespace loom::train {

// A seed for one (split, epoch, purpose) of a run's seed (splitmix64 steps).
inline uint64_t stream_seed(uint64_t seed, Split split, uint64_t epoch, uint64_t what) {
  uint64_t z = seed ^ (split == Split::Train ? 0x747261696eull : 0x76616c6964ull);
  for (uint64_t x : {epoch, what}) {
    z += 0x9E3779B97F4A7C15ull + x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
  }
  return z;
}

// Fisher-Yates with a 64-bit Mersenne twister.
template <class T>
void seeded_shuffle(std::vector<T>& v, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[static_cast<size_t>(rng() % i)]);
}

}  // namespace loom::train
