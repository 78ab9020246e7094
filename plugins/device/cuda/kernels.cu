// device/cuda: the CUDA kernels of every op that is not a GEMM (see kernels.hpp).
//
// Conventions: 64-bit indices everywhere; grid-stride loops over a grid whose size
// depends on the problem size only, so every reduction sums in a fixed order and
// results are reproducible run to run (no float atomics except embedding_bwd's
// fp32 scatter-add, whose order is the one nondeterministic sum). Sums that the CPU
// reference takes in fp64 are taken in fp64 here too.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "kernels.hpp"

namespace loom::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535 * 8;
constexpr float kNegInf = -__builtin_huge_valf();

int grid_for(int64_t n, int threads = kThreads) {
  int64_t b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  if (b > kMaxBlocks) b = kMaxBlocks;
  return static_cast<int>(b);
}

// ---- storage types: fp32 as float, bf16 as its 16 bits -----------------------

__device__ __forceinline__ float bf16_to_f32(uint16_t h) { return __uint_as_float(static_cast<uint32_t>(h) << 16); }
// Round to nearest even; NaN stays a quiet NaN (the same bits as device/cpu).
__device__ __forceinline__ uint16_t f32_to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
__device__ __forceinline__ float ld(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float ld(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ void st(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void st(uint16_t* p, int64_t i, float v) { p[i] = f32_to_bf16(v); }

// ---- 16-byte accesses: 8 consecutive elements (bf16: one load; fp32: two) ---------------
// The memory-bound kernels move 16 bytes a thread per access when their pointers are
// 16-byte aligned (vec_ok on the host); the same rounding as st().

__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void load8(const uint16_t* p, float (&v)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    v[2 * j] = __uint_as_float(w[j] << 16);
    v[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
  }
}
// Four elements: 16 bytes of fp32, 8 of bf16. A warp's fp32 accesses of 4 a lane are one
// contiguous 512-byte span per instruction; 8 a lane (load8) would cover every 32-byte
// sector half per instruction and take two passes through the caches.
__device__ __forceinline__ void load4(const float* p, float (&v)[4]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
}
__device__ __forceinline__ void load4(const uint16_t* p, float (&v)[4]) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  v[0] = __uint_as_float(u.x << 16), v[1] = __uint_as_float(u.x & 0xffff0000u);
  v[2] = __uint_as_float(u.y << 16), v[3] = __uint_as_float(u.y & 0xffff0000u);
}
__device__ __forceinline__ void store4(float* p, const float (&v)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void store4(uint16_t* p, const float (&v)[4]) {
  *reinterpret_cast<uint2*>(p) =
      make_uint2(static_cast<uint32_t>(f32_to_bf16(v[0])) | (static_cast<uint32_t>(f32_to_bf16(v[1])) << 16),
                 static_cast<uint32_t>(f32_to_bf16(v[2])) | (static_cast<uint32_t>(f32_to_bf16(v[3])) << 16));
}
// 16 bytes a lane whatever the type: 4 fp32 or 8 bf16 elements.
template <typename T>
constexpr int kVec16 = 16 / static_cast<int>(sizeof(T));

__device__ __forceinline__ void store8(float* p, const float (&v)[8]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  *reinterpret_cast<float4*>(p + 4) = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void store8(uint16_t* p, const float (&v)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
    w[j] = static_cast<uint32_t>(f32_to_bf16(v[2 * j])) | (static_cast<uint32_t>(f32_to_bf16(v[2 * j + 1])) << 16);
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

#define LOOM_DISPATCH(dt, T, ...)  \
  do {                             \
    if ((dt) == Dt::F32) {         \
      using T = float;             \
      __VA_ARGS__;                 \
    } else {                       \
      using T = uint16_t;          \
      __VA_ARGS__;                 \
    }                              \
  } while (0)

// ---- block reductions ----------------------------------------------------------

struct SumOp {
  template <typename V>
  __device__ V operator()(V a, V b) const { return a + b; }
};
struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
// The larger, NaN winning (an overflow check must see it).
struct NanMaxOp {
  __device__ double operator()(double a, double b) const { return ((b > a || b != b) && a == a) ? b : a; }
};

template <typename V, typename Op>
__device__ V warp_reduce(V v, Op op) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Every thread of the block gets the reduction of `v` over the block. `sh` holds
// 32 values; the leading barrier lets callers reuse it back to back.
template <typename V, typename Op>
__device__ V block_reduce(V v, V* sh, Op op, V identity) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = warp_reduce(v, op);
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    V w = lane < warps ? sh[lane] : identity;
    w = warp_reduce(w, op);
    if (lane == 0) sh[0] = w;
  }
  __syncthreads();
  return sh[0];
}

// ---- layernorm -------------------------------------------------------------------

template <typename T>
__global__ void layernorm_fwd_kernel(int64_t cols, const T* x, const T* gamma, const T* beta, T* y, float* mean_out,
                                     float* rstd_out, float eps) {
  __shared__ double sh[32];
  const int64_t r = blockIdx.x;
  const T* xr = x + r * cols;
  T* yr = y + r * cols;
  double s = 0.0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += static_cast<double>(ld(xr, c));
  s = block_reduce(s, sh, SumOp{}, 0.0);
  const float mean = static_cast<float>(s / static_cast<double>(cols));
  double q = 0.0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float d = ld(xr, c) - mean;
    q += static_cast<double>(d * d);
  }
  q = block_reduce(q, sh, SumOp{}, 0.0);
  const float rstd = static_cast<float>(1.0 / sqrt(q / static_cast<double>(cols) + static_cast<double>(eps)));
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float v = (ld(xr, c) - mean) * rstd;
    if (gamma) v = v * ld(gamma, c);
    if (beta) v = v + ld(beta, c);
    st(yr, c, v);
  }
  if (threadIdx.x == 0) {
    if (mean_out) mean_out[r] = mean;
    if (rstd_out) rstd_out[r] = rstd;
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma. Each thread
// reads dy[c] and writes dx[c] for the same c after the block's sums: in place is fine.
template <typename T>
__global__ void layernorm_bwd_dx_kernel(int64_t cols, const T* dy, const T* x, const T* gamma, const float* mean,
                                        const float* rstd, T* dx, int accumulate) {
  __shared__ double sh[32];
  const int64_t r = blockIdx.x;
  const T* dyr = dy + r * cols;
  const T* xr = x + r * cols;
  T* dxr = dx + r * cols;
  const float mu = mean[r], rs = rstd[r];
  double sg = 0.0, sgx = 0.0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = gamma ? ld(dyr, c) * ld(gamma, c) : ld(dyr, c);
    sg += static_cast<double>(g);
    sgx += static_cast<double>(g * ((ld(xr, c) - mu) * rs));
  }
  sg = block_reduce(sg, sh, SumOp{}, 0.0);
  sgx = block_reduce(sgx, sh, SumOp{}, 0.0);
  const float mg = static_cast<float>(sg / static_cast<double>(cols));
  const float mgx = static_cast<float>(sgx / static_cast<double>(cols));
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = gamma ? ld(dyr, c) * ld(gamma, c) : ld(dyr, c);
    const float v = rs * (g - mg - (ld(xr, c) - mu) * rs * mgx);
    st(dxr, c, accumulate ? ld(dxr, c) + v : v);
  }
}

// The same two ops with a warp a row, for cols % 8 == 0 and 16-byte aligned tensors: 16-byte
// accesses, no block barriers (rows of a few thousand elements stay in L1 between the
// passes). Sums in fp64 as above; only their order differs.
template <typename T>
__global__ void layernorm_fwd_warp_kernel(int64_t rows, int64_t cols, const T* x, const T* gamma, const T* beta, T* y,
                                          float* mean_out, float* rstd_out, float eps) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= rows) return;
  const int lane = threadIdx.x & 31;
  const T* xr = x + r * cols;
  T* yr = y + r * cols;
  float v[8];
  double s = 0.0;
  for (int64_t c = lane * 8; c < cols; c += 256) {
    load8(xr + c, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) s += static_cast<double>(v[j]);
  }
  s = warp_reduce(s, SumOp{});
  const float mean = static_cast<float>(s / static_cast<double>(cols));
  double q = 0.0;
  for (int64_t c = lane * 8; c < cols; c += 256) {
    load8(xr + c, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float d = v[j] - mean;
      q += static_cast<double>(d * d);
    }
  }
  q = warp_reduce(q, SumOp{});
  const float rstd = static_cast<float>(1.0 / sqrt(q / static_cast<double>(cols) + static_cast<double>(eps)));
  for (int64_t c = lane * 8; c < cols; c += 256) {
    float g[8], b[8];
    load8(xr + c, v);
    if (gamma) load8(gamma + c, g);
    if (beta) load8(beta + c, b);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float o = (v[j] - mean) * rstd;
      if (gamma) o = o * g[j];
      if (beta) o = o + b[j];
      v[j] = o;
    }
    store8(yr + c, v);
  }
  if (lane == 0) {
    if (mean_out) mean_out[r] = mean;
    if (rstd_out) rstd_out[r] = rstd;
  }
}

// In place over dy is fine: a lane writes only the elements it read, after the warp's sums.
template <typename T>
__global__ void layernorm_bwd_dx_warp_kernel(int64_t rows, int64_t cols, const T* dy, const T* x, const T* gamma,
                                             const float* mean, const float* rstd, T* dx, int accumulate) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= rows) return;
  const int lane = threadIdx.x & 31;
  const T* dyr = dy + r * cols;
  const T* xr = x + r * cols;
  T* dxr = dx + r * cols;
  const float mu = mean[r], rs = rstd[r];
  float d[8], v[8], g[8];
  double sg = 0.0, sgx = 0.0;
  for (int64_t c = lane * 8; c < cols; c += 256) {
    load8(dyr + c, d);
    load8(xr + c, v);
    if (gamma) load8(gamma + c, g);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float gj = gamma ? d[j] * g[j] : d[j];
      sg += static_cast<double>(gj);
      sgx += static_cast<double>(gj * ((v[j] - mu) * rs));
    }
  }
  sg = warp_reduce(sg, SumOp{});
  sgx = warp_reduce(sgx, SumOp{});
  const float mg = static_cast<float>(sg / static_cast<double>(cols));
  const float mgx = static_cast<float>(sgx / static_cast<double>(cols));
  for (int64_t c = lane * 8; c < cols; c += 256) {
    float o[8];
    load8(dyr + c, d);
    load8(xr + c, v);
    if (gamma) load8(gamma + c, g);
    if (accumulate) load8(dxr + c, o);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float gj = gamma ? d[j] * g[j] : d[j];
      const float val = rs * (gj - mg - (v[j] - mu) * rs * mgx);
      o[j] = accumulate ? o[j] + val : val;
    }
    store8(dxr + c, o);
  }
}

// Partial sums of dgamma (dy * xhat) and dbeta (dy) over a chunk of rows, one
// thread per column (coalesced across the row).
template <typename T>
__global__ void layernorm_params_partial_kernel(int64_t rows, int64_t cols, int64_t chunks, const T* dy, const T* x,
                                                const float* mean, const float* rstd, double* partial) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  if (c >= cols) return;
  const int64_t per = (rows + chunks - 1) / chunks;
  const int64_t r0 = chunk * per, r1 = r0 + per < rows ? r0 + per : rows;
  double ag = 0.0, ab = 0.0;
  for (int64_t r = r0; r < r1; ++r) {
    const float d = ld(dy, r * cols + c);
    ag += static_cast<double>(d * ((ld(x, r * cols + c) - mean[r]) * rstd[r]));
    ab += static_cast<double>(d);
  }
  partial[chunk * cols + c] = ag;
  partial[(chunks + chunk) * cols + c] = ab;
}

// dgamma/dbeta += the chunk sums, in chunk order. G is the gradients' storage, not
// the activations' (fp32 with grad_fp32: one rounding, to fp32).
// A block of kFinishWarps warps per 32 columns: warp w sums chunks w, w + kFinishWarps, ...,
// then lane c of warp 0 adds the warps' sums in warp order (a fixed order: the same
// result every run).
constexpr int kFinishWarps = 32;

// The sum over `chunks` rows of partial[k * cols + c] for this thread's column (valid in
// warp 0 only); every thread of the block must call it.
__device__ __forceinline__ double finish_column(const double* partial, int64_t cols, int64_t chunks, int64_t c,
                                                double (*sh)[32]) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  double a = 0.0;
  if (c < cols)
    for (int64_t k = w; k < chunks; k += kFinishWarps) a += partial[k * cols + c];
  __syncthreads();  // sh may still be read by a previous call
  sh[w][lane] = a;
  __syncthreads();
  double total = 0.0;
  if (w == 0)
    for (int k = 0; k < kFinishWarps; ++k) total += sh[k][lane];
  return total;
}

template <typename G>
__global__ void layernorm_params_finish_kernel(int64_t cols, int64_t chunks, const double* partial, G* dgamma,
                                               G* dbeta) {
  __shared__ double sh[kFinishWarps][32];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + (threadIdx.x & 31);
  const double ag = finish_column(partial, cols, chunks, c, sh);
  const double ab = finish_column(partial + chunks * cols, cols, chunks, c, sh);
  if (threadIdx.x >= 32 || c >= cols) return;
  if (dgamma) st(dgamma, c, ld(dgamma, c) + static_cast<float>(ag));
  if (dbeta) st(dbeta, c, ld(dbeta, c) + static_cast<float>(ab));
}

// ---- GeLU (tanh approximation) ------------------------------------------------------

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluA = 0.044715f;

// gelu(v), or dy * gelu'(v) when backward.
__device__ __forceinline__ float gelu_at(float v, bool backward, float dy) {
  const float t = tanhf(kGeluC * (v + kGeluA * v * v * v));
  if (!backward) return 0.5f * v * (1.0f + t);
  const float du = kGeluC * (1.0f + 3.0f * kGeluA * v * v);
  return dy * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
}

template <typename T>
__global__ void gelu_kernel(int64_t n, bool backward, const T* x, const T* dy, T* out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    st(out, i, gelu_at(ld(x, i), backward, backward ? ld(dy, i) : 0.0f));
}

// Groups of 8 elements (16-byte aligned tensors), then the last n % 8 one by one.
template <typename T>
__global__ void gelu_vec_kernel(int64_t n, bool backward, const T* x, const T* dy, T* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t g = first; g < n / 8; g += stride) {
    float v[8], d[8] = {};
    load8(x + g * 8, v);
    if (backward) load8(dy + g * 8, d);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = gelu_at(v[j], backward, d[j]);
    store8(out + g * 8, v);
  }
  for (int64_t i = n / 8 * 8 + first; i < n; i += stride)
    st(out, i, gelu_at(ld(x, i), backward, backward ? ld(dy, i) : 0.0f));
}

// ---- attention pieces -----------------------------------------------------------------

// Row r = h * q_rows + i of the scores [heads * q_rows, cols]: query i sits at key
// position q_offset + i, so causal attention keeps columns j <= q_offset + i, and with
// a sliding window (window > 0) those after q_offset + i - window, with documents
// (key_start, [q_rows] of this batch element) those from key_start[i] on.
__device__ __forceinline__ int64_t first_visible(int64_t pos, int64_t window, const int32_t* key_start, int64_t i) {
  const int64_t w = window > 0 ? max(int64_t{0}, pos - window + 1) : 0;
  return key_start ? max(w, static_cast<int64_t>(key_start[i])) : w;
}

__global__ void softmax_fwd_kernel(int64_t q_rows, int64_t cols, int64_t q_offset, bool causal, int64_t window,
                                   const int32_t* key_start, float* scores, uint16_t* pb, float* lse) {
  __shared__ float shf[32];
  const int64_t r = blockIdx.x, i = r % q_rows;
  const int64_t valid = causal ? min(q_offset + i + 1, cols) : cols;
  const int64_t first = causal ? first_visible(q_offset + i, window, key_start, i) : 0;
  float* row = scores + r * cols;
  float m = kNegInf;
  for (int64_t j = first + threadIdx.x; j < valid; j += blockDim.x) m = fmaxf(m, row[j]);
  m = block_reduce(m, shf, MaxOp{}, kNegInf);
  float sum = 0.0f;
  for (int64_t j = first + threadIdx.x; j < valid; j += blockDim.x) {
    const float e = expf(row[j] - m);
    row[j] = e;
    sum += e;
  }
  sum = block_reduce(sum, shf, SumOp{}, 0.0f);
  const float inv = 1.0f / sum;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float p = j >= first && j < valid ? row[j] * inv : 0.0f;
    row[j] = p;
    if (pb) pb[r * cols + j] = f32_to_bf16(p);
  }
  if (threadIdx.x == 0 && lse) lse[r] = m + logf(sum);
}

__global__ void softmax_p_kernel(int64_t rows, int64_t q_rows, int64_t cols, int64_t q_offset, bool causal,
                                 int64_t window, const int32_t* key_start, float* scores, uint16_t* pb,
                                 const float* lse) {
  const int64_t total = rows * cols;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / cols, j = idx % cols, i = r % q_rows;
    const bool inside = !causal || (j <= q_offset + i && j >= first_visible(q_offset + i, window, key_start, i));
    const float p = inside ? expf(scores[idx] - lse[r]) : 0.0f;
    scores[idx] = p;
    if (pb) pb[idx] = f32_to_bf16(p);
  }
}

// One warp per row r = h * seq + i.
template <typename T>
__global__ void rowdot_kernel(int64_t heads, int64_t seq, int64_t head_dim, int64_t stride_s, const T* out,
                              const T* dout, float* dvec) {
  const int64_t warps_per_block = blockDim.x / 32;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * warps_per_block + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (r >= heads * seq) return;
  const int64_t h = r / seq, i = r % seq;
  const int64_t base = i * stride_s + h * head_dim;
  float s = 0.0f;
  for (int64_t d = lane; d < head_dim; d += 32) s += ld(out, base + d) * ld(dout, base + d);
  s = warp_reduce(s, SumOp{});
  if (lane == 0) dvec[r] = s;
}

__global__ void dsoftmax_kernel(int64_t rows, int64_t cols, const float* p, float* dp, const float* dvec,
                                uint16_t* dsb) {
  const int64_t total = rows * cols;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = p[idx] * (dp[idx] - dvec[idx / cols]);
    dp[idx] = v;
    if (dsb) dsb[idx] = f32_to_bf16(v);
  }
}

// ---- cross-entropy ----------------------------------------------------------------------

constexpr int kXentRowMax = 0, kXentSumexp = 1, kXentLoss = 2;  // else BACKWARD

template <typename T>
__global__ void xent_row_kernel(int step, int64_t cols, int64_t ld_, int64_t valid, int64_t vocab_start, const T* logits,
                                const int32_t* targets, float* row_max, float* row_sumexp, float* target_logit,
                                T* dlogits, float scale) {
  __shared__ float shf[32];
  __shared__ double shd[32];
  const int64_t r = blockIdx.x;
  const T* l = logits + r * ld_;
  if (step == kXentRowMax) {
    float m = kNegInf;
    for (int64_t c = threadIdx.x; c < valid; c += blockDim.x) m = fmaxf(m, ld(l, c));
    m = block_reduce(m, shf, MaxOp{}, kNegInf);
    if (threadIdx.x == 0) row_max[r] = m;
  } else if (step == kXentSumexp) {
    const float m = row_max[r];
    double s = 0.0;
    if (m != kNegInf)  // no real column in any slice: nothing to add
      for (int64_t c = threadIdx.x; c < valid; c += blockDim.x) s += static_cast<double>(expf(ld(l, c) - m));
    s = block_reduce(s, shd, SumOp{}, 0.0);
    if (threadIdx.x == 0) {
      row_sumexp[r] = static_cast<float>(s);
      if (target_logit) {
        const int64_t t = targets[r], c = t - vocab_start;
        target_logit[r] = (t >= 0 && c >= 0 && c < valid) ? ld(l, c) : 0.0f;
      }
    }
  } else {  // backward
    T* g = dlogits + r * ld_;
    const int64_t t = targets[r];
    if (t < 0) {
      for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) st(g, c, 0.0f);
      return;
    }
    const float m = row_max[r];
    const float k = scale / row_sumexp[r];
    const int64_t tc = t - vocab_start;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      float v = c < valid ? k * expf(ld(l, c) - m) : 0.0f;
      if (c == tc && c < valid) v -= scale;
      st(g, c, v);
    }
  }
}

// The same steps over rows whose elements come 8 at a time (cols and ld multiples of 8,
// 16-byte aligned logits and dlogits); columns at or past `valid` are masked as above.
template <typename T>
__global__ void xent_row_vec_kernel(int step, int64_t cols, int64_t ld_, int64_t valid, int64_t vocab_start,
                                    const T* logits, const int32_t* targets, float* row_max, float* row_sumexp,
                                    float* target_logit, T* dlogits, float scale) {
  __shared__ float shf[32];
  __shared__ double shd[32];
  const int64_t r = blockIdx.x;
  const T* l = logits + r * ld_;
  float v[8];
  if (step == kXentRowMax) {
    float m = kNegInf;
    for (int64_t c = threadIdx.x * 8; c < valid; c += blockDim.x * 8) {
      load8(l + c, v);
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (c + j < valid) m = fmaxf(m, v[j]);
    }
    m = block_reduce(m, shf, MaxOp{}, kNegInf);
    if (threadIdx.x == 0) row_max[r] = m;
  } else if (step == kXentSumexp) {
    const float m = row_max[r];
    double s = 0.0;
    if (m != kNegInf)
      for (int64_t c = threadIdx.x * 8; c < valid; c += blockDim.x * 8) {
        load8(l + c, v);
        float part = 0.0f;  // 8 terms in fp32, then one fp64 add
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (c + j < valid) part += expf(v[j] - m);
        s += static_cast<double>(part);
      }
    s = block_reduce(s, shd, SumOp{}, 0.0);
    if (threadIdx.x == 0) {
      row_sumexp[r] = static_cast<float>(s);
      if (target_logit) {
        const int64_t t = targets[r], c = t - vocab_start;
        target_logit[r] = (t >= 0 && c >= 0 && c < valid) ? ld(l, c) : 0.0f;
      }
    }
  } else {  // backward
    T* g = dlogits + r * ld_;
    const int64_t t = targets[r];
    const float m = row_max[r];
    const float k = t < 0 ? 0.0f : scale / row_sumexp[r];
    const int64_t tc = t < 0 ? -1 : t - vocab_start;
    for (int64_t c = threadIdx.x * 8; c < cols; c += blockDim.x * 8) {
      load8(l + c, v);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float o = c + j < valid && t >= 0 ? k * expf(v[j] - m) : 0.0f;
        if (c + j == tc && c + j < valid) o -= scale;
        v[j] = o;
      }
      store8(g + c, v);
    }
  }
}

__global__ void xent_loss_kernel(int64_t rows, const int32_t* targets, const float* row_max, const float* row_sumexp,
                                 const float* target_logit, float* loss) {
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x)
    loss[r] = targets[r] < 0 ? 0.0f
                             : static_cast<float>(log(static_cast<double>(row_sumexp[r])) +
                                                  static_cast<double>(row_max[r]) -
                                                  static_cast<double>(target_logit[r]));
}

// ---- embedding ------------------------------------------------------------------------------

template <typename T>
__global__ void embedding_fwd_kernel(int64_t dim, int64_t vocab_rows, int64_t vocab_start, const int32_t* ids,
                                     const T* table, T* out, int accumulate) {
  const int64_t i = blockIdx.x;
  const int64_t row = static_cast<int64_t>(ids[i]) - vocab_start;
  const bool inside = row >= 0 && row < vocab_rows;
  T* o = out + i * dim;
  if (!inside && accumulate) return;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
    const float v = inside ? ld(table, row * dim + c) : 0.0f;
    st(o, c, accumulate ? ld(o, c) + v : v);
  }
}

// dout of the activations' storage T into an fp32 table (the fp32 gradients, or
// the fp32 copy of a bf16 table that ops.cpp rounds once afterwards).
template <typename T>
__global__ void embedding_bwd_kernel(int64_t dim, int64_t vocab_rows, int64_t vocab_start, const int32_t* ids,
                                     const T* dout, float* dtable) {
  const int64_t i = blockIdx.x;
  const int64_t row = static_cast<int64_t>(ids[i]) - vocab_start;
  if (row < 0 || row >= vocab_rows) return;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) atomicAdd(dtable + row * dim + c, ld(dout, i * dim + c));
}

// ---- element-wise ----------------------------------------------------------------------------

constexpr int kEwAxpby = 0, kEwAdd = 1, kEwMul = 2, kEwScale = 3, kEwFill = 4, kEwAddBias = 6, kEwDropout = 7,
              kEwDropoutBwd = 8, kEwMulCols = 9;

// murmur3's finaliser, as device/cpu's dropout stream (a pure function of seed and index).
__device__ __forceinline__ uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

// loom_mix64 of loom_abi.h, on the device.
__device__ __forceinline__ uint64_t mix64_dev(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Whether dropout keeps element `index` of the stream (24 random bits against the threshold).
__device__ __forceinline__ bool dropout_keep(const EwParams& p, uint64_t index) {
  const uint32_t lo = static_cast<uint32_t>(index), hi = static_cast<uint32_t>(index >> 32);
  return (fmix32(fmix32(lo ^ p.key0) ^ (hi ^ p.key1)) >> 8) >= p.threshold;
}

// The step's seed, read when the launch runs (a graph replay too).
__device__ __forceinline__ void resolve_dropout_key(EwParams& p) {
  if (p.op == kEwDropout && p.seed_device != nullptr) {
    const uint64_t key = mix64_dev(mix64_dev(p.seed ^ mix64_dev(*p.seed_device)));
    p.key0 = static_cast<uint32_t>(key);
    p.key1 = static_cast<uint32_t>(key >> 32);
  }
}

// Element i of the op.
template <typename T>
__device__ __forceinline__ void ew_at(const EwParams& p, int64_t i) {
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  T* out = static_cast<T*>(p.out);
  switch (p.op) {
    case kEwAxpby:
      st(y, i, p.beta == 0.0f ? p.alpha * ld(x, i) : p.alpha * ld(x, i) + p.beta * ld(y, i));
      break;
    case kEwAdd:
      st(out, i, ld(x, i) + ld(y, i));
      break;
    case kEwMul:
      st(out, i, ld(x, i) * ld(y, i));
      break;
    case kEwScale:
      st(out, i, p.alpha * ld(x, i));
      break;
    case kEwFill:
      st(out, i, p.alpha);
      break;
    case kEwAddBias:
      st(out, i, ld(x, i) + ld(y, i % p.cols));
      break;
    case kEwMulCols:
      st(out, i, ld(x, i) * ld(y, i % p.cols));
      break;
    case kEwDropout: {
      const bool keep = dropout_keep(p, p.offset + static_cast<uint64_t>(i));
      static_cast<uint8_t*>(p.y)[i] = keep ? 1 : 0;
      st(out, i, keep ? ld(x, i) * p.keep_scale : 0.0f);
      break;
    }
    case kEwDropoutBwd:
      st(out, i, static_cast<const uint8_t*>(p.y)[i] ? ld(x, i) * p.keep_scale : 0.0f);
      break;
    default:
      break;
  }
}

template <typename T>
__global__ void elementwise_kernel(EwParams p) {
  resolve_dropout_key(p);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    ew_at<T>(p, i);
}

// Elements i .. i+7 (16-byte aligned tensors; ADD_BIAS and MUL_COLS with cols % 8 == 0,
// so the 8 share one row). The same arithmetic as ew_at.
template <typename T>
__device__ __forceinline__ void ew_at8(const EwParams& p, int64_t i) {
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  T* out = static_cast<T*>(p.out);
  float a[8], b[8];
  switch (p.op) {
    case kEwAxpby:
      load8(x + i, a);
      if (p.beta == 0.0f) {
#pragma unroll
        for (int j = 0; j < 8; ++j) a[j] = p.alpha * a[j];
      } else {
        load8(y + i, b);
#pragma unroll
        for (int j = 0; j < 8; ++j) a[j] = p.alpha * a[j] + p.beta * b[j];
      }
      store8(y + i, a);
      return;
    case kEwAdd:
    case kEwMul:
      load8(x + i, a);
      load8(y + i, b);
#pragma unroll
      for (int j = 0; j < 8; ++j) a[j] = p.op == kEwAdd ? a[j] + b[j] : a[j] * b[j];
      break;
    case kEwScale:
      load8(x + i, a);
#pragma unroll
      for (int j = 0; j < 8; ++j) a[j] = p.alpha * a[j];
      break;
    case kEwFill:
#pragma unroll
      for (int j = 0; j < 8; ++j) a[j] = p.alpha;
      break;
    case kEwAddBias:
    case kEwMulCols:
      load8(x + i, a);
      load8(y + i % p.cols, b);
#pragma unroll
      for (int j = 0; j < 8; ++j) a[j] = p.op == kEwAddBias ? a[j] + b[j] : a[j] * b[j];
      break;
    case kEwDropout: {
      load8(x + i, a);
      uint32_t mask[2] = {0, 0};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const bool keep = dropout_keep(p, p.offset + static_cast<uint64_t>(i + j));
        mask[j / 4] |= static_cast<uint32_t>(keep) << (8 * (j % 4));
        a[j] = keep ? a[j] * p.keep_scale : 0.0f;
      }
      *reinterpret_cast<uint2*>(static_cast<uint8_t*>(p.y) + i) = make_uint2(mask[0], mask[1]);
      break;
    }
    case kEwDropoutBwd: {
      load8(x + i, a);
      const uint2 m = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(p.y) + i);
      const uint32_t mask[2] = {m.x, m.y};
#pragma unroll
      for (int j = 0; j < 8; ++j) a[j] = (mask[j / 4] >> (8 * (j % 4))) & 0xffu ? a[j] * p.keep_scale : 0.0f;
      break;
    }
    default:
      return;
  }
  store8(out + i, a);
}

// Groups of 8, then the last n % 8 elements one by one.
template <typename T>
__global__ void elementwise_vec_kernel(EwParams p) {
  resolve_dropout_key(p);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t g = first; g < p.n / 8; g += stride) ew_at8<T>(p, g * 8);
  for (int64_t i = p.n / 8 * 8 + first; i < p.n; i += stride) ew_at<T>(p, i);
}

template <typename From, typename To>
__global__ void cast_kernel(int64_t n, const From* x, To* out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    st(out, i, ld(x, i));
}

// ---- reductions -----------------------------------------------------------------------------------

constexpr int kRedSum = 0, kRedSumSquares = 1, kRedMaxAbs = 2;

template <typename T>
__global__ void reduce_partial_kernel(int op, int64_t n, const T* x, double* partial) {
  __shared__ double sh[32];
  double acc = 0.0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double v = static_cast<double>(ld(x, i));
    if (op == kRedSum) acc += v;
    else if (op == kRedSumSquares) acc += v * v;
    else acc = NanMaxOp{}(acc, fabs(v));
  }
  acc = op == kRedMaxAbs ? block_reduce(acc, sh, NanMaxOp{}, 0.0) : block_reduce(acc, sh, SumOp{}, 0.0);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// SUM and SUM_SQUARES 8 elements at a time (16-byte aligned x); the same per-element fp64 sums.
template <typename T>
__global__ void reduce_partial_vec_kernel(int op, int64_t n, const T* x, double* partial) {
  __shared__ double sh[32];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  double acc = 0.0;
  for (int64_t g = first; g < n / 8; g += stride) {
    float v[8];
    load8(x + g * 8, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const double d = static_cast<double>(v[j]);
      acc += op == kRedSumSquares ? d * d : d;
    }
  }
  for (int64_t i = n / 8 * 8 + first; i < n; i += stride) {
    const double d = static_cast<double>(ld(x, i));
    acc += op == kRedSumSquares ? d * d : d;
  }
  acc = block_reduce(acc, sh, SumOp{}, 0.0);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void reduce_finish_kernel(int op, int64_t blocks, const double* partial, float* out, int accumulate) {
  __shared__ double sh[32];
  double acc = 0.0;
  for (int64_t b = threadIdx.x; b < blocks; b += blockDim.x)
    acc = op == kRedMaxAbs ? NanMaxOp{}(acc, partial[b]) : acc + partial[b];
  acc = op == kRedMaxAbs ? block_reduce(acc, sh, NanMaxOp{}, 0.0) : block_reduce(acc, sh, SumOp{}, 0.0);
  if (threadIdx.x != 0) return;
  if (op == kRedMaxAbs) {
    const float r = static_cast<float>(acc);
    out[0] = accumulate ? ((r > out[0] || r != r) ? r : out[0]) : r;
  } else {
    out[0] = accumulate ? static_cast<float>(static_cast<double>(out[0]) + acc) : static_cast<float>(acc);
  }
}

template <typename T>
__global__ void column_partial_kernel(int64_t rows, int64_t cols, int64_t ld_, int64_t chunks, const T* x,
                                      double* partial) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  if (c >= cols) return;
  const int64_t per = (rows + chunks - 1) / chunks;
  const int64_t r0 = chunk * per, r1 = r0 + per < rows ? r0 + per : rows;
  double s = 0.0;
  for (int64_t r = r0; r < r1; ++r) s += static_cast<double>(ld(x, r * ld_ + c));
  partial[chunk * cols + c] = s;
}

__global__ void column_finish_kernel(int64_t cols, int64_t chunks, const double* partial, float* out, int accumulate) {
  __shared__ double sh[kFinishWarps][32];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + (threadIdx.x & 31);
  const double s = finish_column(partial, cols, chunks, c, sh);
  if (threadIdx.x >= 32 || c >= cols) return;
  out[c] = accumulate ? static_cast<float>(static_cast<double>(out[c]) + s) : static_cast<float>(s);
}

// The first index of the row maximum, as a left-to-right scan with `>` finds it:
// NaN never wins, except that a NaN in column 0 is never replaced.
template <typename T>
__global__ void row_argmax_kernel(int64_t cols, int64_t ld_, const T* x, int32_t* out) {
  __shared__ float sv[32];
  __shared__ int64_t si[32];
  const int64_t r = blockIdx.x;
  const T* xr = x + r * ld_;
  float bv = kNegInf;
  int64_t bi = INT64_MAX;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = ld(xr, c);
    if (v == v && (v > bv || (v == bv && c < bi))) {
      bv = v;
      bi = c;
    }
  }
  // Warp then block: larger value wins, ties go to the smaller index.
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (oi != INT64_MAX && (bi == INT64_MAX || ov > bv || (ov == bv && oi < bi))) {
      bv = ov;
      bi = oi;
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  if (lane == 0) {
    sv[warp] = bv;
    si[warp] = bi;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < warps; ++w)
      if (si[w] != INT64_MAX && (bi == INT64_MAX || sv[w] > bv || (sv[w] == bv && si[w] < bi))) {
        bv = sv[w];
        bi = si[w];
      }
    const float x0 = ld(xr, 0);
    out[r] = (x0 != x0 || bi == INT64_MAX) ? 0 : static_cast<int32_t>(bi);
  }
}

// ---- AdamW ------------------------------------------------------------------------------------------

// One element: m, v updated in place; returns the new weight.
__device__ __forceinline__ float adamw_at(const AdamwParams& p, float w, float grad, float& m, float& v) {
  const float g = grad * p.grad_scale;
  m = p.beta1 * m + (1.0f - p.beta1) * g;
  v = p.beta2 * v + (1.0f - p.beta2) * g * g;
  const float mhat = m / p.bias_correction1, vhat = v / p.bias_correction2;
  return w - p.lr * (mhat / (sqrtf(vhat) + p.eps) + p.weight_decay * w);
}

// AdamW over n elements spread over the grid: groups of 4 when `vec` (16-byte aligned
// buffers; fp32 state, so 4 a lane keeps every access coalesced), then one by one
// whatever is left. The kernels below and the multi-tensor
// one (a span per segment) share it, so each element gets the same arithmetic.
template <typename G, typename C>
__device__ __forceinline__ void adamw_span(int64_t n, float* param, const G* grad, float* m, float* v,
                                           const AdamwParams& p, C* copy, bool vec) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t done = 0;
  if (vec) {
    for (int64_t g = first; g < n / 4; g += stride) {
      const int64_t i = g * 4;
      float w[4], gr[4], mi[4], vi[4];
      load4(param + i, w);
      load4(grad + i, gr);
      load4(m + i, mi);
      load4(v + i, vi);
#pragma unroll
      for (int j = 0; j < 4; ++j) w[j] = adamw_at(p, w[j], gr[j], mi[j], vi[j]);
      store4(m + i, mi);
      store4(v + i, vi);
      store4(param + i, w);
      if (copy) store4(copy + i, w);
    }
    done = n / 4 * 4;
  }
  for (int64_t i = done + first; i < n; i += stride) {
    float mi = m[i], vi = v[i];
    const float nw = adamw_at(p, param[i], ld(grad, i), mi, vi);
    m[i] = mi;
    v[i] = vi;
    param[i] = nw;
    if (copy) st(copy, i, nw);
  }
}

template <typename G, typename C>
__global__ void adamw_kernel(int64_t n, float* param, const G* grad, float* m, float* v, AdamwParams p, C* copy,
                             bool vec) {
  adamw_span(n, param, grad, m, v, p, copy, vec);
}

// ---- multi-tensor (ABI 1.8 segments) --------------------------------------------------------

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

constexpr int kMultiBlocks = 512;  // fixed: the partial sums do not depend on the problem

// A block-stride loop over every segment: each segment is spread over the whole grid.
template <typename G, typename C>
__global__ void adamw_multi_kernel(int64_t count, const AdamwSegment* segments, float* param, const G* grad, float* m,
                                   float* v, AdamwParams p, C* copy) {
  for (int64_t s = 0; s < count; ++s) {
    const AdamwSegment seg = segments[s];
    AdamwParams q = p;
    q.weight_decay = seg.weight_decay;
    float* pw = param + seg.param_offset;
    float* pm = m + seg.state_offset;
    float* pv = v + seg.state_offset;
    const G* pg = grad + seg.grad_offset;
    C* pc = copy ? copy + seg.copy_offset : nullptr;
    adamw_span(seg.numel, pw, pg, pm, pv, q, pc,
               aligned16(pw) && aligned16(pm) && aligned16(pv) && aligned16(pg) && aligned16(pc));
  }
}

// partial[s * gridDim.x + block] = this block's share of segment s; a block that holds no
// element of a segment writes the identity without a block reduction.
template <typename T>
__global__ void reduce_multi_partial_kernel(int op, int64_t count, const ReduceSegment* segments, const T* x,
                                            double* partial) {
  __shared__ double sh[32];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t s = 0; s < count; ++s) {
    const ReduceSegment seg = segments[s];
    const T* xs = x + seg.offset;
    const bool vec = op != kRedMaxAbs && aligned16(xs);
    constexpr int V = kVec16<T>;  // 16 bytes a lane
    const int64_t units = vec ? (seg.numel + V - 1) / V : seg.numel;  // what one thread index covers
    double* out = partial + s * gridDim.x + blockIdx.x;
    if (static_cast<int64_t>(blockIdx.x) * blockDim.x >= units) {  // the same for the whole block
      if (threadIdx.x == 0) *out = 0.0;
      continue;
    }
    double acc = 0.0;
    int64_t done = 0;
    if (vec) {
      for (int64_t g = first; g < seg.numel / V; g += stride) {
        float v[V];
        if constexpr (V == 4)
          load4(xs + g * V, v);
        else
          load8(xs + g * V, v);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const double d = static_cast<double>(v[j]);
          acc += op == kRedSumSquares ? d * d : d;
        }
      }
      done = seg.numel / V * V;
    }
    for (int64_t i = done + first; i < seg.numel; i += stride) {
      const double d = static_cast<double>(ld(xs, i));
      if (op == kRedSum) acc += d;
      else if (op == kRedSumSquares) acc += d * d;
      else acc = NanMaxOp{}(acc, fabs(d));
    }
    acc = op == kRedMaxAbs ? block_reduce(acc, sh, NanMaxOp{}, 0.0) : block_reduce(acc, sh, SumOp{}, 0.0);
    if (threadIdx.x == 0) *out = acc;
  }
}

// out[s] (+)= the sum (or NaN-winning maximum) of segment s's partials: a block a segment.
__global__ void reduce_multi_finish_kernel(int op, int64_t blocks, const double* partial, float* out, int accumulate) {
  __shared__ double sh[32];
  const int64_t s = blockIdx.x;
  const double* ps = partial + s * blocks;
  double acc = 0.0;
  for (int64_t b = threadIdx.x; b < blocks; b += blockDim.x) acc = op == kRedMaxAbs ? NanMaxOp{}(acc, ps[b]) : acc + ps[b];
  acc = op == kRedMaxAbs ? block_reduce(acc, sh, NanMaxOp{}, 0.0) : block_reduce(acc, sh, SumOp{}, 0.0);
  if (threadIdx.x != 0) return;
  if (op == kRedMaxAbs) {
    const float r = static_cast<float>(acc);
    out[s] = accumulate ? ((r > out[s] || r != r) ? r : out[s]) : r;
  } else {
    out[s] = accumulate ? static_cast<float>(static_cast<double>(out[s]) + acc) : static_cast<float>(acc);
  }
}

template <typename T>
__global__ void scale_matrix_kernel(int64_t m, int64_t n, int64_t ldc, int64_t stride_c, int64_t batch, float beta,
                                    T* c) {
  const int64_t total = batch * m * n;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = idx / (m * n), rem = idx % (m * n), i = rem / n, j = rem % n;
    const int64_t at = b * stride_c + i * ldc + j;
    st(c, at, beta == 0.0f ? 0.0f : beta * ld(c, at));
  }
}

template <typename From, typename To>
__global__ void copy_matrix_kernel(int64_t m, int64_t n, int64_t batch, const From* src, int64_t lds, int64_t ss,
                                   To* dst, int64_t ldd, int64_t sd) {
  const int64_t total = batch * m * n;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = idx / (m * n), rem = idx % (m * n), i = rem / n, j = rem % n;
    st(dst, b * sd + i * ldd + j, ld(src, b * ss + i * lds + j));
  }
}

// ---- ABI 1.10: RMSNorm, SwiGLU, rotary embedding, sigmoid ---------------------------
// One block a row for the row ops (sums in fp64, as device/cpu takes them), grid-stride
// loops for the element-wise ones; fp32 math, bf16 rounded on store.

template <typename T>
__global__ void rmsnorm_fwd_kernel(int64_t cols, const T* x, const T* gamma, T* y, float* rstd_out, float eps) {
  __shared__ double sh[32];
  const int64_t r = blockIdx.x;
  const T* xr = x + r * cols;
  T* yr = y + r * cols;
  double q = 0.0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = ld(xr, c);
    q += static_cast<double>(v) * static_cast<double>(v);
  }
  q = block_reduce(q, sh, SumOp{}, 0.0);
  const float rstd = static_cast<float>(1.0 / sqrt(q / static_cast<double>(cols) + static_cast<double>(eps)));
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) st(yr, c, ld(xr, c) * rstd * ld(gamma, c));
  if (threadIdx.x == 0 && rstd_out) rstd_out[r] = rstd;
}

// dx = rstd * (g - xhat * mean(g * xhat)), g = dy * gamma, xhat = x * rstd. Each thread
// reads dy[c] and writes dx[c] for the same c after the block's sum: in place is fine.
template <typename T>
__global__ void rmsnorm_bwd_dx_kernel(int64_t cols, const T* dy, const T* x, const T* gamma, const float* rstd, T* dx,
                                      int accumulate) {
  __shared__ double sh[32];
  const int64_t r = blockIdx.x;
  const T* dyr = dy + r * cols;
  const T* xr = x + r * cols;
  T* dxr = dx + r * cols;
  const float rs = rstd[r];
  double dot = 0.0;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    dot += static_cast<double>(ld(gamma, c) * ld(dyr, c)) * static_cast<double>(ld(xr, c) * rs);
  dot = block_reduce(dot, sh, SumOp{}, 0.0);
  const float mean = static_cast<float>(dot / static_cast<double>(cols));
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = rs * (ld(gamma, c) * ld(dyr, c) - ld(xr, c) * rs * mean);
    st(dxr, c, accumulate ? ld(dxr, c) + v : v);
  }
}

// Partial column sums of dy * x * rstd over a chunk of rows, one thread a column.
template <typename T>
__global__ void rmsnorm_dgamma_partial_kernel(int64_t rows, int64_t cols, int64_t chunks, const T* dy, const T* x,
                                              const float* rstd, double* partial) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  if (c >= cols) return;
  const int64_t per = (rows + chunks - 1) / chunks;
  const int64_t r0 = chunk * per, r1 = r0 + per < rows ? r0 + per : rows;
  double a = 0.0;
  for (int64_t r = r0; r < r1; ++r) a += static_cast<double>(ld(dy, r * cols + c) * (ld(x, r * cols + c) * rstd[r]));
  partial[chunk * cols + c] = a;
}

template <typename G>
__global__ void rmsnorm_dgamma_finish_kernel(int64_t cols, int64_t chunks, const double* partial, G* dgamma) {
  __shared__ double sh[kFinishWarps][32];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + (threadIdx.x & 31);
  const double a = finish_column(partial, cols, chunks, c, sh);
  if (threadIdx.x >= 32 || c >= cols) return;
  st(dgamma, c, ld(dgamma, c) + static_cast<float>(a));
}

// In double, rounded once to fp32, as device/cpu (they agree to within that rounding).
__device__ __forceinline__ float sigmoid_at(float v) {
  return static_cast<float>(1.0 / (1.0 + exp(-static_cast<double>(v))));
}

template <typename T>
__global__ void swiglu_kernel(int64_t rows, int64_t cols, bool backward, const T* x, const T* dy, T* out) {
  const int64_t total = rows * cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    const float g = ld(x, r * 2 * cols + c), u = ld(x, r * 2 * cols + cols + c), s = sigmoid_at(g);
    if (!backward) {
      st(out, i, g * s * u);
    } else {
      const float d = ld(dy, i);
      st(out, r * 2 * cols + c, d * u * (s * (1.0f + g * (1.0f - s))));
      st(out, r * 2 * cols + cols + c, d * g * s);
    }
  }
}

// One thread per (token, head, pair): reads both elements of its pair before writing.
// inv_freq = theta^(-2k / rotary_dim) in fp64, rounded once: device/cpu's table; or the
// caller's table (ABI 1.20).
template <typename T>
__global__ void rope_kernel(int64_t tokens, int64_t heads, int64_t head_dim, int64_t half, int64_t stride_t,
                            const T* x, T* out, const int32_t* positions, float theta, const float* freqs,
                            float sign) {
  const int64_t total = tokens * heads * half;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t k = i % half, th = i / half, h = th % heads, t = th / heads;
    const float inv_freq =
        freqs != nullptr
            ? freqs[k]
            : static_cast<float>(pow(static_cast<double>(theta), -2.0 * static_cast<double>(k) / static_cast<double>(2 * half)));
    const float angle = static_cast<float>(positions[t]) * inv_freq;  // fp32 angle, as Megatron's
    const float c = static_cast<float>(cos(static_cast<double>(angle)));
    const float s = sign * static_cast<float>(sin(static_cast<double>(angle)));
    const int64_t base = t * stride_t + h * head_dim;
    const float u = ld(x, base + k), v = ld(x, base + half + k);
    st(out, base + k, u * c - v * s);
    st(out, base + half + k, v * c + u * s);
  }
}

// The elements of each head past rotary_dim, copied when out is not x.
template <typename T>
__global__ void rope_pass_kernel(int64_t tokens, int64_t heads, int64_t head_dim, int64_t rotary_dim,
                                 int64_t stride_t, const T* x, T* out) {
  const int64_t rest = head_dim - rotary_dim, total = tokens * heads * rest;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t d = rotary_dim + i % rest, th = i / rest, h = th % heads, t = th / heads;
    const int64_t at = t * stride_t + h * head_dim + d;
    st(out, at, ld(x, at));
  }
}

template <typename T>
__global__ void sigmoid_kernel(int64_t n, bool backward, const T* x, const T* dy, T* out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float s = sigmoid_at(ld(x, i));
    st(out, i, backward ? ld(dy, i) * (s * (1.0f - s)) : s);
  }
}

// Threads for one block per row of `cols` elements.
int row_threads(int64_t cols) { return cols >= 1024 ? 512 : cols >= 256 ? 256 : 128; }

// Whether every pointer given (null ones aside) is 16-byte aligned: the 8-element kernels.
bool vec_ok(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// Rows of `cols` elements (a multiple of 8) for the warp-a-row kernels: 8 warps a block.
constexpr int kRowWarps = 8;
unsigned warp_row_blocks(int64_t rows) { return static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps); }

}  // namespace

// 16 rows a chunk (at most 1024 chunks): one thread a column walks only its chunk's rows,
// so enough threads are in flight for narrow rows (768 columns: 393k threads at 8192 rows).
int64_t column_chunks(int64_t rows) {
  int64_t c = (rows + 15) / 16;
  if (c < 1) c = 1;
  if (c > 1024) c = 1024;
  return c;
}

int64_t reduce_blocks(int64_t n) {
  int64_t b = (n + 4095) / 4096;
  if (b < 1) b = 1;
  if (b > 1024) b = 1024;
  return b;
}

cudaError_t k_layernorm_fwd(cudaStream_t s, Dt dt, int64_t rows, int64_t cols, const void* x, const void* gamma,
                            const void* beta, void* y, float* mean, float* rstd, float eps) {
  if (rows == 0) return cudaSuccess;
  if (cols % 8 == 0 && vec_ok({x, gamma, beta, y})) {
    LOOM_DISPATCH(dt, T,
                  layernorm_fwd_warp_kernel<T><<<warp_row_blocks(rows), kRowWarps * 32, 0, s>>>(
                      rows, cols, static_cast<const T*>(x), static_cast<const T*>(gamma),
                      static_cast<const T*>(beta), static_cast<T*>(y), mean, rstd, eps));
    return cudaGetLastError();
  }
  LOOM_DISPATCH(dt, T,
                layernorm_fwd_kernel<T><<<static_cast<unsigned>(rows), row_threads(cols), 0, s>>>(
                    cols, static_cast<const T*>(x), static_cast<const T*>(gamma), static_cast<const T*>(beta),
                    static_cast<T*>(y), mean, rstd, eps));
  return cudaGetLastError();
}

cudaError_t k_layernorm_bwd_dx(cudaStream_t s, Dt dt, int64_t rows, int64_t cols, const void* dy, const void* x,
                               const void* gamma, const float* mean, const float* rstd, void* dx, int accumulate) {
  if (rows == 0) return cudaSuccess;
  if (cols % 8 == 0 && vec_ok({dy, x, gamma, dx})) {
    LOOM_DISPATCH(dt, T,
                  layernorm_bwd_dx_warp_kernel<T><<<warp_row_blocks(rows), kRowWarps * 32, 0, s>>>(
                      rows, cols, static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(gamma),
                      mean, rstd, static_cast<T*>(dx), accumulate));
    return cudaGetLastError();
  }
  LOOM_DISPATCH(dt, T,
                layernorm_bwd_dx_kernel<T><<<static_cast<unsigned>(rows), row_threads(cols), 0, s>>>(
                    cols, static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(gamma), mean,
                    rstd, static_cast<T*>(dx), accumulate));
  return cudaGetLastError();
}

cudaError_t k_layernorm_bwd_params(cudaStream_t s, Dt dt, Dt grad_dt, int64_t rows, int64_t cols, const void* dy,
                                   const void* x, const float* mean, const float* rstd, double* partial,
                                   int64_t chunks, void* dgamma, void* dbeta) {
  if (dt == Dt::F32 && grad_dt != Dt::F32) return cudaErrorInvalidValue;  // not a pair grad_dtype gives
  if (rows == 0 || cols == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((cols + kThreads - 1) / kThreads), static_cast<unsigned>(chunks));
  // The partials are fp64 whatever the storage: only the finish sees the gradients.
  // (One column a thread: 8 columns a thread with 16-byte loads measured 2x slower on an
  // H200, too few threads in flight for rows of 768.)
  LOOM_DISPATCH(dt, T,
                layernorm_params_partial_kernel<T><<<grid, kThreads, 0, s>>>(
                    rows, cols, chunks, static_cast<const T*>(dy), static_cast<const T*>(x), mean, rstd, partial));
  const unsigned finish_blocks = static_cast<unsigned>((cols + 31) / 32);
  LOOM_DISPATCH(grad_dt, G,
                layernorm_params_finish_kernel<G><<<finish_blocks, kFinishWarps * 32, 0, s>>>(
                    cols, chunks, partial, static_cast<G*>(dgamma), static_cast<G*>(dbeta)));
  return cudaGetLastError();
}

cudaError_t k_gelu(cudaStream_t s, Dt dt, bool backward, int64_t n, const void* x, const void* dy, void* out) {
  if (n == 0) return cudaSuccess;
  if (vec_ok({x, dy, out})) {
    LOOM_DISPATCH(dt, T,
                  gelu_vec_kernel<T><<<grid_for(std::max<int64_t>(n / 8, 1)), kThreads, 0, s>>>(
                      n, backward, static_cast<const T*>(x), static_cast<const T*>(dy), static_cast<T*>(out)));
    return cudaGetLastError();
  }
  LOOM_DISPATCH(dt, T,
                gelu_kernel<T><<<grid_for(n), kThreads, 0, s>>>(n, backward, static_cast<const T*>(x),
                                                                static_cast<const T*>(dy), static_cast<T*>(out)));
  return cudaGetLastError();
}

cudaError_t k_softmax_fwd(cudaStream_t s, int64_t rows, int64_t q_rows, int64_t cols, int64_t q_offset, bool causal,
                          int64_t window, const int32_t* key_start, float* scores, uint16_t* pb, float* lse) {
  if (rows == 0) return cudaSuccess;
  softmax_fwd_kernel<<<static_cast<unsigned>(rows), row_threads(cols), 0, s>>>(q_rows, cols, q_offset, causal, window,
                                                                              key_start, scores, pb, lse);
  return cudaGetLastError();
}

cudaError_t k_softmax_p(cudaStream_t s, int64_t rows, int64_t q_rows, int64_t cols, int64_t q_offset, bool causal,
                        int64_t window, const int32_t* key_start, float* scores, uint16_t* pb, const float* lse) {
  if (rows == 0) return cudaSuccess;
  softmax_p_kernel<<<grid_for(rows * cols), kThreads, 0, s>>>(rows, q_rows, cols, q_offset, causal, window, key_start,
                                                              scores, pb, lse);
  return cudaGetLastError();
}

cudaError_t k_rowdot(cudaStream_t s, Dt dt, int64_t heads, int64_t seq, int64_t head_dim, int64_t stride_s,
                     const void* out, const void* dout, float* dvec) {
  const int64_t rows = heads * seq;
  if (rows == 0) return cudaSuccess;
  const int64_t per_block = kThreads / 32;
  const unsigned blocks = static_cast<unsigned>((rows + per_block - 1) / per_block);
  LOOM_DISPATCH(dt, T,
                rowdot_kernel<T><<<blocks, kThreads, 0, s>>>(heads, seq, head_dim, stride_s,
                                                             static_cast<const T*>(out), static_cast<const T*>(dout),
                                                             dvec));
  return cudaGetLastError();
}

cudaError_t k_dsoftmax(cudaStream_t s, int64_t rows, int64_t cols, const float* p, float* dp, const float* dvec,
                       uint16_t* dsb) {
  if (rows == 0) return cudaSuccess;
  dsoftmax_kernel<<<grid_for(rows * cols), kThreads, 0, s>>>(rows, cols, p, dp, dvec, dsb);
  return cudaGetLastError();
}

cudaError_t k_xent(cudaStream_t s, Dt dt, int step, int64_t rows, int64_t cols, int64_t ld_, int64_t valid,
                   int64_t vocab_start, const void* logits, const int32_t* targets, float* row_max, float* row_sumexp,
                   float* target_logit, float* loss, void* dlogits, float scale) {
  if (rows == 0) return cudaSuccess;
  if (step == kXentLoss) {
    xent_loss_kernel<<<grid_for(rows), kThreads, 0, s>>>(rows, targets, row_max, row_sumexp, target_logit, loss);
    return cudaGetLastError();
  }
  if (cols % 8 == 0 && ld_ % 8 == 0 && vec_ok({logits, dlogits})) {
    LOOM_DISPATCH(dt, T,
                  xent_row_vec_kernel<T><<<static_cast<unsigned>(rows), row_threads(cols / 8), 0, s>>>(
                      step, cols, ld_, valid, vocab_start, static_cast<const T*>(logits), targets, row_max,
                      row_sumexp, target_logit, static_cast<T*>(dlogits), scale));
    return cudaGetLastError();
  }
  LOOM_DISPATCH(dt, T,
                xent_row_kernel<T><<<static_cast<unsigned>(rows), row_threads(cols), 0, s>>>(
                    step, cols, ld_, valid, vocab_start, static_cast<const T*>(logits), targets, row_max, row_sumexp,
                    target_logit, static_cast<T*>(dlogits), scale));
  return cudaGetLastError();
}

cudaError_t k_embedding_fwd(cudaStream_t s, Dt dt, int64_t n, int64_t dim, int64_t vocab_rows, int64_t vocab_start,
                            const int32_t* ids, const void* table, void* out, int accumulate) {
  if (n == 0) return cudaSuccess;
  LOOM_DISPATCH(dt, T,
                embedding_fwd_kernel<T><<<static_cast<unsigned>(n), row_threads(dim), 0, s>>>(
                    dim, vocab_rows, vocab_start, ids, static_cast<const T*>(table), static_cast<T*>(out),
                    accumulate));
  return cudaGetLastError();
}

cudaError_t k_embedding_bwd(cudaStream_t s, Dt dt, int64_t n, int64_t dim, int64_t vocab_rows, int64_t vocab_start,
                            const int32_t* ids, const void* dout, float* dtable) {
  if (n == 0 || vocab_rows == 0) return cudaSuccess;
  LOOM_DISPATCH(dt, T,
                embedding_bwd_kernel<T><<<static_cast<unsigned>(n), row_threads(dim), 0, s>>>(
                    dim, vocab_rows, vocab_start, ids, static_cast<const T*>(dout), dtable));
  return cudaGetLastError();
}

cudaError_t k_elementwise(cudaStream_t s, Dt dt, const EwParams& p) {
  if (p.n == 0) return cudaSuccess;
  // 8 at a time: 16-byte aligned tensors (the dropout mask: 8 bytes), ADD_BIAS and
  // MUL_COLS with rows of whole groups.
  const bool mask = p.op == kEwDropout || p.op == kEwDropoutBwd;
  const bool rows_whole = (p.op != kEwAddBias && p.op != kEwMulCols) || p.cols % 8 == 0;
  const bool mask_ok = !mask || reinterpret_cast<uintptr_t>(p.y) % 8 == 0;
  if (rows_whole && mask_ok && vec_ok({p.x, mask ? nullptr : p.y, p.out})) {
    LOOM_DISPATCH(dt, T, elementwise_vec_kernel<T><<<grid_for(std::max<int64_t>(p.n / 8, 1)), kThreads, 0, s>>>(p));
    return cudaGetLastError();
  }
  LOOM_DISPATCH(dt, T, elementwise_kernel<T><<<grid_for(p.n), kThreads, 0, s>>>(p));
  return cudaGetLastError();
}

cudaError_t k_cast(cudaStream_t s, Dt from, Dt to, int64_t n, const void* x, void* out) {
  if (n == 0) return cudaSuccess;
  LOOM_DISPATCH(from, F, LOOM_DISPATCH(to, O,
                                       cast_kernel<F, O><<<grid_for(n), kThreads, 0, s>>>(
                                           n, static_cast<const F*>(x), static_cast<O*>(out))));
  return cudaGetLastError();
}

cudaError_t k_reduce_scalar(cudaStream_t s, Dt dt, int op, int64_t n, const void* x, double* partial, float* out,
                            int accumulate) {
  const int64_t blocks = reduce_blocks(n);
  if (n > 0 && op != kRedMaxAbs && vec_ok({x})) {
    LOOM_DISPATCH(dt, T,
                  reduce_partial_vec_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(
                      op, n, static_cast<const T*>(x), partial));
  } else if (n > 0) {
    LOOM_DISPATCH(dt, T,
                  reduce_partial_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(
                      op, n, static_cast<const T*>(x), partial));
  }
  reduce_finish_kernel<<<1, 1024, 0, s>>>(op, n > 0 ? blocks : 0, partial, out, accumulate);
  return cudaGetLastError();
}

cudaError_t k_column_sum(cudaStream_t s, Dt dt, int64_t rows, int64_t cols, int64_t ld_, const void* x,
                         double* partial, float* out, int accumulate) {
  if (cols == 0) return cudaSuccess;
  const int64_t chunks = column_chunks(rows);
  const dim3 grid(static_cast<unsigned>((cols + kThreads - 1) / kThreads), static_cast<unsigned>(chunks));
  if (rows > 0) {  // one column a thread, as for the LayerNorm parameters
    LOOM_DISPATCH(dt, T,
                  column_partial_kernel<T><<<grid, kThreads, 0, s>>>(rows, cols, ld_, chunks,
                                                                     static_cast<const T*>(x), partial));
  }
  column_finish_kernel<<<static_cast<unsigned>((cols + 31) / 32), kFinishWarps * 32, 0, s>>>(
      cols, rows > 0 ? chunks : 0, partial, out, accumulate);
  return cudaGetLastError();
}

cudaError_t k_row_argmax(cudaStream_t s, Dt dt, int64_t rows, int64_t cols, int64_t ld_, const void* x, int32_t* out) {
  if (rows == 0) return cudaSuccess;
  LOOM_DISPATCH(dt, T,
                row_argmax_kernel<T><<<static_cast<unsigned>(rows), row_threads(cols), 0, s>>>(
                    cols, ld_, static_cast<const T*>(x), out));
  return cudaGetLastError();
}

cudaError_t k_adamw(cudaStream_t s, int64_t n, float* param, const void* grad, Dt grad_dt, float* m, float* v,
                    const AdamwParams& p, void* param_copy, Dt copy_dt) {
  if (n == 0) return cudaSuccess;
  const bool vec = vec_ok({param, grad, m, v, param_copy});
  LOOM_DISPATCH(grad_dt, G, LOOM_DISPATCH(copy_dt, C,
                                          adamw_kernel<G, C><<<grid_for(vec ? std::max<int64_t>(n / 4, 1) : n),
                                                               kThreads, 0, s>>>(
                                              n, param, static_cast<const G*>(grad), m, v, p,
                                              static_cast<C*>(param_copy), vec)));
  return cudaGetLastError();
}

int64_t multi_reduce_blocks() { return kMultiBlocks; }

cudaError_t k_adamw_multi(cudaStream_t s, int64_t count, const AdamwSegment* segments, float* param, const void* grad,
                          Dt grad_dt, float* m, float* v, const AdamwParams& p, void* param_copy, Dt copy_dt) {
  if (count == 0) return cudaSuccess;
  LOOM_DISPATCH(grad_dt, G, LOOM_DISPATCH(copy_dt, C,
                                          adamw_multi_kernel<G, C><<<kMultiBlocks * 2, kThreads, 0, s>>>(
                                              count, segments, param, static_cast<const G*>(grad), m, v, p,
                                              static_cast<C*>(param_copy))));
  return cudaGetLastError();
}

cudaError_t k_reduce_multi(cudaStream_t s, Dt dt, int op, int64_t count, const ReduceSegment* segments,
                           const void* x, double* partial, float* out, int accumulate) {
  if (count == 0) return cudaSuccess;
  LOOM_DISPATCH(dt, T,
                reduce_multi_partial_kernel<T><<<kMultiBlocks, kThreads, 0, s>>>(op, count, segments,
                                                                                static_cast<const T*>(x), partial));
  reduce_multi_finish_kernel<<<static_cast<unsigned>(count), kThreads, 0, s>>>(op, kMultiBlocks, partial, out,
                                                                               accumulate);
  return cudaGetLastError();
}

cudaError_t k_rmsnorm_fwd(cudaStream_t s, Dt dt, int64_t rows, int64_t cols, const void* x, const void* gamma, void* y,
                          float* rstd, float eps) {
  if (rows == 0) return cudaSuccess;
  LOOM_DISPATCH(dt, T,
                rmsnorm_fwd_kernel<T><<<static_cast<unsigned>(rows), row_threads(cols), 0, s>>>(
                    cols, static_cast<const T*>(x), static_cast<const T*>(gamma), static_cast<T*>(y), rstd, eps));
  return cudaGetLastError();
}

cudaError_t k_rmsnorm_bwd_dx(cudaStream_t s, Dt dt, int64_t rows, int64_t cols, const void* dy, const void* x,
                             const void* gamma, const float* rstd, void* dx, int accumulate) {
  if (rows == 0) return cudaSuccess;
  LOOM_DISPATCH(dt, T,
                rmsnorm_bwd_dx_kernel<T><<<static_cast<unsigned>(rows), row_threads(cols), 0, s>>>(
                    cols, static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(gamma), rstd,
                    static_cast<T*>(dx), accumulate));
  return cudaGetLastError();
}

cudaError_t k_rmsnorm_bwd_dgamma(cudaStream_t s, Dt dt, Dt grad_dt, int64_t rows, int64_t cols, const void* dy,
                                 const void* x, const float* rstd, double* partial, int64_t chunks, void* dgamma) {
  if (dt == Dt::F32 && grad_dt != Dt::F32) return cudaErrorInvalidValue;  // not a pair grad_dtype gives
  if (rows == 0 || cols == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((cols + kThreads - 1) / kThreads), static_cast<unsigned>(chunks));
  LOOM_DISPATCH(dt, T,
                rmsnorm_dgamma_partial_kernel<T><<<grid, kThreads, 0, s>>>(
                    rows, cols, chunks, static_cast<const T*>(dy), static_cast<const T*>(x), rstd, partial));
  const unsigned finish_blocks = static_cast<unsigned>((cols + 31) / 32);
  LOOM_DISPATCH(grad_dt, G,
                rmsnorm_dgamma_finish_kernel<G><<<finish_blocks, kFinishWarps * 32, 0, s>>>(
                    cols, chunks, partial, static_cast<G*>(dgamma)));
  return cudaGetLastError();
}

cudaError_t k_swiglu(cudaStream_t s, Dt dt, bool backward, int64_t rows, int64_t cols, const void* x, const void* dy,
                     void* out) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  LOOM_DISPATCH(dt, T,
                swiglu_kernel<T><<<grid_for(rows * cols), kThreads, 0, s>>>(
                    rows, cols, backward, static_cast<const T*>(x), static_cast<const T*>(dy), static_cast<T*>(out)));
  return cudaGetLastError();
}

cudaError_t k_rope(cudaStream_t s, Dt dt, int64_t tokens, int64_t heads, int64_t head_dim, int64_t rotary_dim,
                   int64_t stride_t, const void* x, void* out, const int32_t* positions, float theta,
                   const float* inv_freq, float sign) {
  if (tokens == 0 || heads == 0 || head_dim == 0) return cudaSuccess;
  const int64_t half = rotary_dim / 2;
  if (half > 0)
    LOOM_DISPATCH(dt, T,
                  rope_kernel<T><<<grid_for(tokens * heads * half), kThreads, 0, s>>>(
                      tokens, heads, head_dim, half, stride_t, static_cast<const T*>(x), static_cast<T*>(out),
                      positions, theta, inv_freq, sign));
  if (rotary_dim < head_dim && out != x)
    LOOM_DISPATCH(dt, T,
                  rope_pass_kernel<T><<<grid_for(tokens * heads * (head_dim - rotary_dim)), kThreads, 0, s>>>(
                      tokens, heads, head_dim, rotary_dim, stride_t, static_cast<const T*>(x), static_cast<T*>(out)));
  return cudaGetLastError();
}

cudaError_t k_sigmoid(cudaStream_t s, Dt dt, bool backward, int64_t n, const void* x, const void* dy, void* out) {
  if (n == 0) return cudaSuccess;
  LOOM_DISPATCH(dt, T,
                sigmoid_kernel<T><<<grid_for(n), kThreads, 0, s>>>(n, backward, static_cast<const T*>(x),
                                                                    static_cast<const T*>(dy), static_cast<T*>(out)));
  return cudaGetLastError();
}

cudaError_t k_scale_matrix(cudaStream_t s, Dt dt, int64_t m, int64_t n, int64_t ldc, int64_t stride_c, int64_t batch,
                           float beta, void* c) {
  if (m == 0 || n == 0 || batch == 0) return cudaSuccess;
  LOOM_DISPATCH(dt, T,
                scale_matrix_kernel<T><<<grid_for(batch * m * n), kThreads, 0, s>>>(m, n, ldc, stride_c, batch, beta,
                                                                                   static_cast<T*>(c)));
  return cudaGetLastError();
}

cudaError_t k_copy_matrix(cudaStream_t s, Dt from, Dt to, int64_t m, int64_t n, int64_t batch, const void* src,
                          int64_t lds, int64_t ss, void* dst, int64_t ldd, int64_t sd) {
  if (m == 0 || n == 0 || batch == 0) return cudaSuccess;
  LOOM_DISPATCH(from, F, LOOM_DISPATCH(to, O,
                                       copy_matrix_kernel<F, O><<<grid_for(batch * m * n), kThreads, 0, s>>>(
                                           m, n, batch, static_cast<const F*>(src), lds, ss, static_cast<O*>(dst),
                                           ldd, sd)));
  return cudaGetLastError();
}

}  // namespace loom::cuda
