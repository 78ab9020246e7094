// Scalar helpers written so that loops calling them vectorise (no branches, no
// libm calls): exp, tanh, bf16 rounding, the dropout hash.
//
// Everything here has internal linkage (unnamed namespace): the header is compiled
// into translation units built for different instruction sets (kernels_*.cpp), and
// an out-of-line copy of an `inline` function from an AVX-512 unit must never be
// picked by the linker for the baseline code.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <loom/loom_abi.h>  // loom_mix64

namespace loom::cpu {
namespace {

inline uint32_t f32_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// exp(x) to ~1 ulp over the float range (Cephes' expf polynomial): x = n ln2 + r,
// |r| <= ln2/2, e^r by a degree-7 polynomial, 2^n assembled in the exponent bits.
// exp(-inf) = 0, large negative x flushes to 0, NaN propagates; x is expected <= 88.
inline float fast_exp(float x) {
  float xc = x < -87.0f ? -87.0f : x;  // ternaries map to minps/maxps and vectorise
  xc = xc > 88.0f ? 88.0f : xc;
  // Round x*log2(e) to nearest with the 1.5*2^23 trick (no SSE4.1 round needed).
  const float shifter = 12582912.0f;
  const float nf = (xc * 1.44269504088896341f + shifter) - shifter;
  const float r = (xc - nf * 0.693359375f) + nf * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t n = static_cast<int32_t>(nf);
  const float scale = bits_f32(static_cast<uint32_t>(n + 127) << 23);
  float y = p * scale;
  y = x < -87.0f ? 0.0f : y;
  y = x != x ? x : y;
  return y;
}

// tanh(u) = sign(u) (1 - e) / (1 + e), e = exp(-2|u|) <= 1 (no overflow).
inline float fast_tanh(float u) {
  const float e = fast_exp(-2.0f * __builtin_fabsf(u));
  const float t = (1.0f - e) / (1.0f + e);
  return __builtin_copysignf(t, u);
}

// fp32 -> bf16, round to nearest even; NaN stays a (quiet) NaN. Written as a select
// (no branch) so that conversion loops vectorise.
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x0040u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}
inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// splitmix64's finaliser: a strong 64-bit mix (one definition, in the ABI header).
inline uint64_t mix64(uint64_t z) { return loom_mix64(z); }
// murmur3's 32-bit finaliser: a bijection with full avalanche, in 32-bit integer
// ops only, so loops over it vectorise on every x86 level.
inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}
// Dropout's random 24 bits for element `index` of the stream keyed by (k0, k1) =
// the halves of mix64(seed): a pure function of (seed, index), independent of
// threads, chunking, instruction set and replay. index = (hi << 32) | lo.
inline uint32_t dropout_bits(uint32_t k0, uint32_t hi_k1, uint32_t lo) { return fmix32(fmix32(lo ^ k0) ^ hi_k1) >> 8; }

}  // namespace
}  // namespace loom::cpu
