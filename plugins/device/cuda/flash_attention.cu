// device/cuda: fused attention kernels for bf16 storage (see flash_attention.hpp).
//
// Every kernel runs 4 warps; a warp owns 16 rows of its tile (queries in the forward
// and dQ kernels, keys in the dK/dV kernel). Tiles are copied global -> shared with
// cp.async (16 bytes a thread, rows past the end zero-filled), the next K/V (or Q/dO)
// tile while the current one is used. Shared-memory rows are padded by 16 bytes so
// that the 8 rows one ldmatrix reads fall in distinct banks.
//
// Causal rows may also start later than key 0: a sliding window (FlashArgs.window > 0:
// the query at position p sees keys (p - window, p]) and documents (key_start: the
// first key of each query's document), the later bound holding. That first key is
// non-decreasing over the rows, so the forward and dQ kernels start at the first key
// tile the tile's first row sees, the dK/dV kernel stops after the last query tile
// that sees its keys, and the tiles that lower edge crosses are masked like the
// causal diagonal.
//
// Fragment layouts are those of mma.m16n8k16 (PTX ISA, "Matrix fragments for
// mma.m16n8k16"): lane = 4 * g + t; an accumulator tile 16x8 holds (g, 2t..2t+1) in
// c0,c1 and (g+8, 2t..2t+1) in c2,c3; the A operand 16x16 holds (g, 2t..) (g+8, 2t..)
// (g, 8+2t..) (g+8, 8+2t..). Two accumulator tiles side by side are therefore one A
// operand once rounded to bf16, which is how probabilities feed the next product
// without leaving registers.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "flash_attention.hpp"

namespace loom::cuda {
namespace {

constexpr int kThreads = 128;  // 4 warps
constexpr int kTile = 64;      // rows of a tile that 4 warps share (16 each)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kInf = __builtin_huge_valf();

using bf16_t = uint16_t;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; `valid` false writes zeros (nothing is read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 bf16 matrices; lane l gives the address of row (l & 7) of matrix l >> 3.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p))
               : "memory");
}
// The same, each matrix transposed.
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const bf16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p))
               : "memory");
}

// c (16x8, fp32) += a (16x16, bf16) * b (16x8, bf16).
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as bf16 (round to nearest even), `lo` in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ float bf16_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }

// Accumulator tiles n and n+1 (columns 16kk..16kk+15) as the A operand of the next product.
__device__ __forceinline__ void as_a_operand(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack_bf16(lo[0], lo[1]);
  a[1] = pack_bf16(lo[2], lo[3]);
  a[2] = pack_bf16(hi[0], hi[1]);
  a[3] = pack_bf16(hi[2], hi[3]);
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Rows [r0, r0 + ROWS) of a strided [rows, D] matrix (row r at base + r * ld) into a
// shared tile of pitch D + 8; rows at or past `limit` are zeros.
template <int D, int ROWS>
__device__ __forceinline__ void load_tile(bf16_t* tile, const bf16_t* base, int64_t ld, int r0, int limit) {
  constexpr int kChunks = D / 8;  // 16-byte pieces of a row
  for (int c = threadIdx.x; c < ROWS * kChunks; c += kThreads) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    const bool valid = r0 + r < limit;
    cp_async16(tile + r * (D + 8) + col, valid ? base + static_cast<int64_t>(r0 + r) * ld + col : base, valid);
  }
}

// Where this lane's ldmatrix row starts for an A operand (16 rows from `row0`,
// 16 columns from `col0`) and for a non-transposed B operand pair (16 rows = two
// n-tiles of 8, 16 columns of k). `pitch` in elements.
__device__ __forceinline__ int a_offset(int row0, int col0, int pitch) {
  const int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
  return (row0 + (m & 1) * 8 + r) * pitch + col0 + (m >> 1) * 8;
}
__device__ __forceinline__ int b_offset(int row0, int col0, int pitch) {
  const int lane = threadIdx.x & 31, m = lane >> 3, r = lane & 7;
  return (row0 + (m >> 1) * 8 + r) * pitch + col0 + (m & 1) * 8;
}
// A transposed B operand pair: k runs over 16 rows from row0, n over two tiles of 8
// columns from col0. (Same addresses as the A operand; the transposition does the rest.)
__device__ __forceinline__ int bt_offset(int row0, int col0, int pitch) { return a_offset(row0, col0, pitch); }

// acc[NT][4] (16 x 8*NT) += A (16 x 16*KT, shared, rows from a_row) * B^T where B is
// NT*8 rows of 16*KT columns in shared memory (rows from b_row): S = Q K^T and friends.
template <int KT, int NT>
__device__ __forceinline__ void mma_abt(float (&acc)[NT][4], const bf16_t* a, int a_row, const bf16_t* b, int b_row,
                                        int pitch) {
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) {
    uint32_t af[4];
    ldsm_x4(af, a + a_offset(a_row, kk * 16, pitch));
#pragma unroll
    for (int jj = 0; jj < NT / 2; ++jj) {
      uint32_t bf[4];
      ldsm_x4(bf, b + b_offset(b_row + jj * 16, kk * 16, pitch));
      mma(acc[2 * jj], af, bf[0], bf[1]);
      mma(acc[2 * jj + 1], af, bf[2], bf[3]);
    }
  }
}

// acc[DT][4] (16 x 8*DT) += P (16 x 16*KT, registers: accumulator tiles) * B, B being
// 16*KT rows of 8*DT columns in shared memory (from row 0): O = P V and friends.
template <int KT, int DT>
__device__ __forceinline__ void mma_pb(float (&acc)[DT][4], const float (&p)[2 * KT][4], const bf16_t* b, int pitch) {
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) {
    uint32_t pa[4];
    as_a_operand(pa, p[2 * kk], p[2 * kk + 1]);
#pragma unroll
    for (int dj = 0; dj < DT / 2; ++dj) {
      uint32_t bf[4];
      ldsm_x4_t(bf, b + bt_offset(kk * 16, dj * 16, pitch));
      mma(acc[2 * dj], pa, bf[0], bf[1]);
      mma(acc[2 * dj + 1], pa, bf[2], bf[3]);
    }
  }
}

// Elements of one K or V tile in shared memory (64 rows of pitch D + 8).
template <int D>
constexpr int kKvTileElems = kTile * (D + 8);

// The forward and dQ kernels' walk over key tiles t_begin..n_kt - 1 (tile t_begin in
// buffer 0 first): makes tile t's K and V ready in buffer (t - t_begin) & 1 (complete
// and visible to every thread after the barrier) while the copies of tile t + 1 go
// into the other buffer; returns that buffer. The caller's barrier at the end of each
// step keeps a buffer from being refilled while it is read.
template <int D>
__device__ __forceinline__ int kv_tile_ready(bf16_t* sK, bf16_t* sV, const bf16_t* k, const bf16_t* v,
                                             const FlashArgs& p, int t, int t_begin, int n_kt) {
  const int buf = (t - t_begin) & 1;
  if (t + 1 < n_kt) {
    load_tile<D, kTile>(sK + (buf ^ 1) * kKvTileElems<D>, k, p.kv_ss, (t + 1) * kTile, p.kv_seq);
    load_tile<D, kTile>(sV + (buf ^ 1) * kKvTileElems<D>, v, p.kv_ss, (t + 1) * kTile, p.kv_seq);
    cp_async_commit();
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
  __syncthreads();
  return buf;
}

// The first key query row `row` of batch element b sees (causal: the later of its
// window's and its document's start; 0 otherwise). Rows past seq (a tile's padding)
// take the last row's.
__device__ __forceinline__ int first_seen(const FlashArgs& p, int b, int row) {
  if (!p.causal) return 0;
  row = min(row, p.seq - 1);
  int first = p.window > 0 ? max(0, p.q_offset + row - p.window + 1) : 0;
  if (p.key_start != nullptr) first = max(first, p.key_start[static_cast<int64_t>(b) * p.seq + row]);
  return first;
}
// Whether query row `row`, whose first key is `first`, sees key `key`.
__device__ __forceinline__ bool key_visible(const FlashArgs& p, int key, int row, int first) {
  if (key >= p.kv_seq) return false;
  return !p.causal || (key <= p.q_offset + row && key >= first);
}
// Whether some key of the tile from k0 is hidden from some of the 16 query rows from
// r0 (the last of which sees from `last_first` on): a tile past the keys' end, on the
// causal diagonal, or on the rows' lower edge.
__device__ __forceinline__ bool key_tile_is_edge(const FlashArgs& p, int k0, int r0, int last_first) {
  if (k0 + kTile > p.kv_seq) return true;
  if (!p.causal) return false;
  return k0 + kTile - 1 > p.q_offset + r0 || k0 < last_first;
}

template <int D>
struct FwdSmem {
  static constexpr int kPitch = D + 8;
  static constexpr int kTileElems = kTile * kPitch;
  static constexpr int kBytes = 5 * kTileElems * 2;  // Q, K x 2, V x 2
};

// ---- forward ------------------------------------------------------------------------

template <int D>
__global__ void __launch_bounds__(kThreads) flash_fwd_kernel(FlashArgs p) {
  using S = FwdSmem<D>;
  constexpr int P = S::kPitch;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16_t* sQ = reinterpret_cast<bf16_t*>(smem_raw);
  bf16_t* sK = sQ + S::kTileElems;      // two buffers
  bf16_t* sV = sK + 2 * S::kTileElems;  // two buffers

  const int n_qt = (p.seq + kTile - 1) / kTile;
  const int q0 = (n_qt - 1 - static_cast<int>(blockIdx.x)) * kTile;  // the longest causal tiles first
  const int b = static_cast<int>(blockIdx.y) / p.heads, h = static_cast<int>(blockIdx.y) % p.heads;
  const bf16_t* q = p.q + b * p.q_sb + h * D;
  const bf16_t* k = p.k + b * p.kv_sb + h * D;
  const bf16_t* v = p.v + b * p.kv_sb + h * D;
  // Keys the tile's last row may see, and the first key tile its first row sees.
  const int kv_end = p.causal ? min(p.kv_seq, p.q_offset + q0 + kTile) : p.kv_seq;
  const int n_kt = (kv_end + kTile - 1) / kTile;
  const int t_begin = first_seen(p, b, q0) / kTile;

  load_tile<D, kTile>(sQ, q, p.q_ss, q0, p.seq);
  load_tile<D, kTile>(sK, k, p.kv_ss, t_begin * kTile, p.kv_seq);
  load_tile<D, kTile>(sV, v, p.kv_ss, t_begin * kTile, p.kv_seq);
  cp_async_commit();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  const int first[2] = {first_seen(p, b, row[0]), first_seen(p, b, row[1])};
  const int last_first = first_seen(p, b, q0 + warp * 16 + 15);
  const float scale2 = p.scale * kLog2e;  // scores in log2 units
  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m_run[2] = {-kInf, -kInf}, l_run[2] = {0.0f, 0.0f};

  for (int t = t_begin; t < n_kt; ++t) {
    const int buf = kv_tile_ready<D>(sK, sV, k, v, p, t, t_begin, n_kt);
    const bf16_t* tk = sK + buf * kKvTileElems<D>;
    const bf16_t* tv = sV + buf * kKvTileElems<D>;

    float s[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    mma_abt<D / 16, 8>(s, sQ, warp * 16, tk, 0, P);

    const int k0 = t * kTile;
    const bool edge = key_tile_is_edge(p, k0, q0 + warp * 16, last_first);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float x = s[j][c] * scale2;
        if (edge && !key_visible(p, k0 + 8 * j + 2 * t4 + (c & 1), row[c >> 1], first[c >> 1])) x = -kInf;
        s[j][c] = x;
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = m_run[r];
#pragma unroll
      for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
      mx = quad_max(mx);
      const float m_use = mx == -kInf ? 0.0f : mx;  // a row with nothing visible yet
      const float alpha = exp2f(m_run[r] - m_use);
      m_run[r] = mx;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        s[j][2 * r] = exp2f(s[j][2 * r] - m_use);
        s[j][2 * r + 1] = exp2f(s[j][2 * r + 1] - m_use);
        sum += s[j][2 * r] + s[j][2 * r + 1];
      }
      l_run[r] = l_run[r] * alpha + sum;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        o[j][2 * r] *= alpha;
        o[j][2 * r + 1] *= alpha;
      }
    }
    mma_pb<4, D / 8>(o, s, tv, P);
    __syncthreads();  // every warp is done with `buf` before it is refilled
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(l_run[r]);
    if (row[r] >= p.seq) continue;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    bf16_t* out = p.out_w + b * p.o_sb + static_cast<int64_t>(row[r]) * p.o_ss + h * D + 2 * t4;
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
      *reinterpret_cast<uint32_t*>(out + 8 * j) = pack_bf16(o[j][2 * r] * inv, o[j][2 * r + 1] * inv);
    if (p.lse != nullptr && t4 == 0)
      p.lse[(static_cast<int64_t>(b) * p.heads + h) * p.seq + row[r]] = (m_run[r] + log2f(l)) * kLn2;
  }
}

// ---- backward ---------------------------------------------------------------------

// dvec[(b * heads + h) * seq + i] = sum_d out[b, i, h, d] * dout[b, i, h, d]; a warp a row.
template <int D>
__global__ void __launch_bounds__(kThreads) flash_dvec_kernel(FlashArgs p) {
  const int64_t rows = static_cast<int64_t>(p.batch) * p.heads * p.seq;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5);
  if (r >= rows) return;
  const int lane = threadIdx.x & 31;
  const int i = static_cast<int>(r % p.seq);
  const int bh = static_cast<int>(r / p.seq), b = bh / p.heads, h = bh % p.heads;
  const int64_t off = b * p.o_sb + static_cast<int64_t>(i) * p.o_ss + h * D;
  const uint32_t* o = reinterpret_cast<const uint32_t*>(p.out + off);
  const uint32_t* d = reinterpret_cast<const uint32_t*>(p.dout + off);
  float acc = 0.0f;
#pragma unroll
  for (int c = lane; c < D / 2; c += 32) {
    const uint32_t x = o[c], y = d[c];
    acc += bf16_lo(x) * bf16_lo(y) + bf16_hi(x) * bf16_hi(y);
  }
  for (int m = 16; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  if (lane == 0) p.dvec[r] = acc;
}

// Query rows per step of the dK/dV kernel: fewer for the wider head, whose dK and dV
// accumulators take 128 registers.
template <int D>
struct DkvShape {
  static constexpr int kQRows = D <= 64 ? 64 : 32;
  static constexpr int kPitch = D + 8;
  static constexpr int kKvElems = kTile * kPitch;
  static constexpr int kQElems = kQRows * kPitch;
  // K, V; Q x 2, dO x 2; then lse x 2, dvec x 2 (fp32) and the rows' first keys x 2 (int)
  static constexpr int kBytes = (2 * kKvElems + 4 * kQElems) * 2 + 6 * kQRows * 4;
};

// A CTA owns 64 keys (16 a warp) and walks the query tiles that see them:
// S^T = K Q^T, P^T = exp(scale S^T - lse), dP^T = V dO^T, dS^T = P^T o (dP^T - dvec),
// dV += P^T dO, dK += scale dS^T Q.
template <int D>
__global__ void __launch_bounds__(kThreads) flash_bwd_dkv_kernel(FlashArgs p) {
  using S = DkvShape<D>;
  constexpr int P = S::kPitch, BQ = S::kQRows;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16_t* sK = reinterpret_cast<bf16_t*>(smem_raw);
  bf16_t* sV = sK + S::kKvElems;
  bf16_t* sQ = sV + S::kKvElems;    // two buffers
  bf16_t* sO = sQ + 2 * S::kQElems;  // dO, two buffers
  float* sL = reinterpret_cast<float*>(sO + 2 * S::kQElems);  // lse in log2 units, two buffers
  float* sD = sL + 2 * BQ;                                     // dvec, two buffers
  int* sF = reinterpret_cast<int*>(sD + 2 * BQ);               // first_seen, two buffers

  const int k0 = static_cast<int>(blockIdx.x) * kTile;
  const int b = static_cast<int>(blockIdx.y) / p.heads, h = static_cast<int>(blockIdx.y) % p.heads;
  const bf16_t* q = p.q + b * p.q_sb + h * D;
  const bf16_t* k = p.k + b * p.kv_sb + h * D;
  const bf16_t* v = p.v + b * p.kv_sb + h * D;
  const bf16_t* dout = p.dout + b * p.o_sb + h * D;
  const float* lse = p.lse + static_cast<int64_t>(blockIdx.y) * p.seq;
  const float* dvec = p.dvec + static_cast<int64_t>(blockIdx.y) * p.seq;
  // The first query row that sees key k0 (causal) and the last one whose first key is
  // at most k0 + kTile - 1 (first_seen is non-decreasing: a binary search); the query
  // tiles outside contribute nothing.
  const int first_q = p.causal ? max(0, k0 - p.q_offset) : 0;
  int last_q = p.seq - 1;
  if (p.causal && (p.window > 0 || p.key_start != nullptr)) {
    int lo = first_q - 1, hi = p.seq - 1;  // first_seen(lo) <= k0 + kTile - 1 (lo = first_q - 1: none yet)
    while (lo < hi) {
      const int mid = lo + (hi - lo + 1) / 2;
      if (first_seen(p, b, mid) <= k0 + kTile - 1) lo = mid;
      else hi = mid - 1;
    }
    last_q = lo;
  }
  const int qt_begin = first_q / BQ, qt_end = last_q < first_q ? qt_begin : last_q / BQ + 1;

  auto load_q_tile = [&](int qt, int buf) {
    const int r0 = qt * BQ;
    load_tile<D, BQ>(sQ + buf * S::kQElems, q, p.q_ss, r0, p.seq);
    load_tile<D, BQ>(sO + buf * S::kQElems, dout, p.o_ss, r0, p.seq);
    for (int r = threadIdx.x; r < BQ; r += kThreads) {
      const bool valid = r0 + r < p.seq;  // padding rows: P = 0 and dvec = 0
      sL[buf * BQ + r] = valid ? lse[r0 + r] * kLog2e : kInf;
      sD[buf * BQ + r] = valid ? dvec[r0 + r] : 0.0f;
      sF[buf * BQ + r] = first_seen(p, b, r0 + r);
    }
  };

  load_tile<D, kTile>(sK, k, p.kv_ss, k0, p.kv_seq);
  load_tile<D, kTile>(sV, v, p.kv_ss, k0, p.kv_seq);
  if (qt_begin < qt_end) load_q_tile(qt_begin, 0);
  cp_async_commit();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int key[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};
  const float scale2 = p.scale * kLog2e;
  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) dk[j][c] = dv[j][c] = 0.0f;

  for (int qt = qt_begin; qt < qt_end; ++qt) {
    const int buf = (qt - qt_begin) & 1;
    if (qt + 1 < qt_end) {
      load_q_tile(qt + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16_t* tq = sQ + buf * S::kQElems;
    const bf16_t* to = sO + buf * S::kQElems;
    const float* tl = sL + buf * BQ;
    const float* td = sD + buf * BQ;
    const int* tf = sF + buf * BQ;

    float st[BQ / 8][4], dpt[BQ / 8][4];
#pragma unroll
    for (int j = 0; j < BQ / 8; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) st[j][c] = dpt[j][c] = 0.0f;
    mma_abt<D / 16, BQ / 8>(st, sK, warp * 16, tq, 0, P);   // S^T (16 keys x BQ queries)
    mma_abt<D / 16, BQ / 8>(dpt, sV, warp * 16, to, 0, P);  // dP^T

    const int i0 = qt * BQ;
    // Some of the warp's 16 keys after the tile's first query (the causal diagonal) or
    // before the last query's first key (the rows' lower edge).
    const bool edge = p.causal && (k0 + warp * 16 + 15 > p.q_offset + i0 || k0 + warp * 16 < tf[BQ - 1]);
#pragma unroll
    for (int j = 0; j < BQ / 8; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int col = 8 * j + 2 * t4 + (c & 1);
        float pt = exp2f(st[j][c] * scale2 - tl[col]);
        if (edge && !key_visible(p, key[c >> 1], i0 + col, tf[col])) pt = 0.0f;
        st[j][c] = pt;
        dpt[j][c] = pt * (dpt[j][c] - td[col]);
      }
    mma_pb<BQ / 16, D / 8>(dv, st, to, P);   // dV += P^T dO
    mma_pb<BQ / 16, D / 8>(dk, dpt, tq, P);  // dK += dS^T Q (scaled at the end)
    __syncthreads();
  }
  cp_async_wait<0>();  // no query tile sees these keys: K and V were loaded for nothing

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (key[r] >= p.kv_seq) continue;
    const int64_t off = b * p.kv_sb + static_cast<int64_t>(key[r]) * p.kv_ss + h * D + 2 * t4;
    uint32_t* gk = reinterpret_cast<uint32_t*>(p.dk + off);
    uint32_t* gv = reinterpret_cast<uint32_t*>(p.dv + off);
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      float k_lo = dk[j][2 * r] * p.scale, k_hi = dk[j][2 * r + 1] * p.scale;
      float v_lo = dv[j][2 * r], v_hi = dv[j][2 * r + 1];
      if (p.accumulate_dkv) {
        const uint32_t ok = gk[4 * j], ov = gv[4 * j];
        k_lo += bf16_lo(ok);
        k_hi += bf16_hi(ok);
        v_lo += bf16_lo(ov);
        v_hi += bf16_hi(ov);
      }
      gk[4 * j] = pack_bf16(k_lo, k_hi);
      gv[4 * j] = pack_bf16(v_lo, v_hi);
    }
  }
}

template <int D>
struct DqShape {
  static constexpr int kPitch = D + 8;
  static constexpr int kTileElems = kTile * kPitch;
  static constexpr int kBytes = 6 * kTileElems * 2;  // Q, dO, K x 2, V x 2
};

// A CTA owns 64 queries (16 a warp) and walks the keys they see:
// S = Q K^T, P = exp(scale S - lse), dP = dO V^T, dS = P o (dP - dvec), dQ = scale dS K.
template <int D>
__global__ void __launch_bounds__(kThreads) flash_bwd_dq_kernel(FlashArgs p) {
  using S = DqShape<D>;
  constexpr int P = S::kPitch;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16_t* sQ = reinterpret_cast<bf16_t*>(smem_raw);
  bf16_t* sO = sQ + S::kTileElems;      // dO
  bf16_t* sK = sO + S::kTileElems;      // two buffers
  bf16_t* sV = sK + 2 * S::kTileElems;  // two buffers

  const int n_qt = (p.seq + kTile - 1) / kTile;
  const int q0 = (n_qt - 1 - static_cast<int>(blockIdx.x)) * kTile;
  const int b = static_cast<int>(blockIdx.y) / p.heads, h = static_cast<int>(blockIdx.y) % p.heads;
  const bf16_t* q = p.q + b * p.q_sb + h * D;
  const bf16_t* k = p.k + b * p.kv_sb + h * D;
  const bf16_t* v = p.v + b * p.kv_sb + h * D;
  const bf16_t* dout = p.dout + b * p.o_sb + h * D;
  const int kv_end = p.causal ? min(p.kv_seq, p.q_offset + q0 + kTile) : p.kv_seq;
  const int n_kt = (kv_end + kTile - 1) / kTile;
  const int t_begin = first_seen(p, b, q0) / kTile;

  load_tile<D, kTile>(sQ, q, p.q_ss, q0, p.seq);
  load_tile<D, kTile>(sO, dout, p.o_ss, q0, p.seq);
  load_tile<D, kTile>(sK, k, p.kv_ss, t_begin * kTile, p.kv_seq);
  load_tile<D, kTile>(sV, v, p.kv_ss, t_begin * kTile, p.kv_seq);
  cp_async_commit();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  const int first[2] = {first_seen(p, b, row[0]), first_seen(p, b, row[1])};
  const int last_first = first_seen(p, b, q0 + warp * 16 + 15);
  const float scale2 = p.scale * kLog2e;
  float lse2[2], dvec[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const bool valid = row[r] < p.seq;
    const int64_t at = static_cast<int64_t>(blockIdx.y) * p.seq + row[r];
    lse2[r] = valid ? p.lse[at] * kLog2e : kInf;
    dvec[r] = valid ? p.dvec[at] : 0.0f;
  }
  float dq[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) dq[j][0] = dq[j][1] = dq[j][2] = dq[j][3] = 0.0f;

  for (int t = t_begin; t < n_kt; ++t) {
    const int buf = kv_tile_ready<D>(sK, sV, k, v, p, t, t_begin, n_kt);
    const bf16_t* tk = sK + buf * kKvTileElems<D>;
    const bf16_t* tv = sV + buf * kKvTileElems<D>;

    float s[8][4], dp[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) s[j][c] = dp[j][c] = 0.0f;
    mma_abt<D / 16, 8>(s, sQ, warp * 16, tk, 0, P);
    mma_abt<D / 16, 8>(dp, sO, warp * 16, tv, 0, P);

    const int k0 = t * kTile;
    const bool edge = key_tile_is_edge(p, k0, q0 + warp * 16, last_first);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float pr = exp2f(s[j][c] * scale2 - lse2[c >> 1]);
        if (edge && !key_visible(p, k0 + 8 * j + 2 * t4 + (c & 1), row[c >> 1], first[c >> 1])) pr = 0.0f;
        dp[j][c] = pr * (dp[j][c] - dvec[c >> 1]);
      }
    mma_pb<4, D / 8>(dq, dp, tk, P);  // dQ += dS K (scaled at the end)
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row[r] >= p.seq) continue;
    bf16_t* out = p.dq + b * p.q_sb + static_cast<int64_t>(row[r]) * p.q_ss + h * D + 2 * t4;
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
      *reinterpret_cast<uint32_t*>(out + 8 * j) = pack_bf16(dq[j][2 * r] * p.scale, dq[j][2 * r + 1] * p.scale);
  }
}

template <int D>
cudaError_t prepare() {
  cudaError_t e = cudaFuncSetAttribute(flash_fwd_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       FwdSmem<D>::kBytes);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(flash_bwd_dkv_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             DkvShape<D>::kBytes);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(flash_bwd_dq_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             DqShape<D>::kBytes);
  return e;
}

template <int D>
cudaError_t fwd(cudaStream_t s, const FlashArgs& a) {
  const dim3 grid((a.seq + kTile - 1) / kTile, a.batch * a.heads);
  flash_fwd_kernel<D><<<grid, kThreads, FwdSmem<D>::kBytes, s>>>(a);
  return cudaGetLastError();
}

template <int D>
cudaError_t bwd(cudaStream_t s, const FlashArgs& a) {
  const int64_t rows = static_cast<int64_t>(a.batch) * a.heads * a.seq;
  flash_dvec_kernel<D><<<static_cast<unsigned>((rows + 3) / 4), kThreads, 0, s>>>(a);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  const dim3 kv_grid((a.kv_seq + kTile - 1) / kTile, a.batch * a.heads);
  flash_bwd_dkv_kernel<D><<<kv_grid, kThreads, DkvShape<D>::kBytes, s>>>(a);
  e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  const dim3 q_grid((a.seq + kTile - 1) / kTile, a.batch * a.heads);
  flash_bwd_dq_kernel<D><<<q_grid, kThreads, DqShape<D>::kBytes, s>>>(a);
  return cudaGetLastError();
}

}  // namespace

bool flash_head_dim_supported(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }

cudaError_t flash_prepare() {
  const cudaError_t e = prepare<64>();
  return e == cudaSuccess ? prepare<128>() : e;
}

cudaError_t k_flash_fwd(cudaStream_t s, int head_dim, const FlashArgs& a) {
  switch (head_dim) {
    case 64: return fwd<64>(s, a);
    case 128: return fwd<128>(s, a);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t k_flash_bwd(cudaStream_t s, int head_dim, const FlashArgs& a) {
  switch (head_dim) {
    case 64: return bwd<64>(s, a);
    case 128: return bwd<128>(s, a);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace loom::cuda
