// Scaled dot-product attention, fp32, flash-attention math on blocks of 64 query rows
// (bf16 storage: widened per batch element into fp32 scratch, see Bf16Attention).
//
// For one (batch, head) the strided layout makes Q, K, V, O plain row-major
// matrices [seq, head_dim] with leading dimension stride_s, so every product is
// one sgemm on the tensors in place (packed QKV included). A causal block of query
// rows [i0, i1) only needs keys [0, i1), so causal attention costs about half.
// With ABI 1.6's query window (context parallelism) the queries sit at positions
// q_offset.. of a longer key sequence: the block then needs keys [0, q_offset + i1).
// With ABI 1.21's sliding window, row i sees keys (q_offset + i - window, q_offset + i],
// and with ABI 1.22's key_start (documents) keys from key_start[i] on: the later bound,
// non-decreasing in i, so the block starts at the first key its first row sees, the
// rows' products cover keys [k0, k1), and each row's columns before its own first key
// are masked.
//
// Forward:  S = scale Q K^T, P = softmax(S) (masked), O = P V, lse = max + log(sum).
// Backward: P = exp(scale Q K^T - lse) recomputed; D = rowsum(dO o O);
//           dV = P^T dO, dP = dO V^T, dS = P o (dP - D), dQ = scale dS K, dK = scale dS^T Q.
#include <climits>
#include <cmath>
#include <limits>

#include "cpu_device.hpp"

namespace loom::cpu {
namespace {

constexpr int64_t kBlockRows = 64;

struct Layout {
  int64_t seq, kv, q_off, heads, hd;
  int64_t qs_b, qs_s, ks_b, ks_s, os_b, os_s;
  int64_t blocks;  // query row blocks per (batch, head)
  bool causal;
  int64_t window;             // 0: every earlier key
  const int32_t* key_start;   // [batch, seq], or NULL: 0
  // The first key query i of batch element b sees (causal: the later of the window's
  // and its document's start; non-decreasing in i).
  int64_t first_seen(int64_t b, int64_t i) const {
    if (!causal) return 0;
    const int64_t w = window > 0 ? std::max<int64_t>(0, q_off + i - window + 1) : 0;
    return key_start ? std::max<int64_t>(w, key_start[b * seq + i]) : w;
  }
  // Keys [first_key(b, i0), end_key(i1)) cover query block [i0, i1); row i (0-based in
  // the block) sees [row_start, row_end) of them, counted from first_key(b, i0).
  int64_t end_key(int64_t i1) const { return causal ? q_off + i1 : kv; }
  int64_t first_key(int64_t b, int64_t i0) const { return first_seen(b, i0); }
  int64_t row_end(int64_t b, int64_t i0, int64_t i) const {
    return (causal ? q_off + i0 + i + 1 : kv) - first_key(b, i0);
  }
  int64_t row_start(int64_t b, int64_t i0, int64_t i) const { return first_seen(b, i0 + i) - first_key(b, i0); }
};

// `a` resolved (op_contract::resolved): kv_seq, q_offset and the kv strides are set.
Layout layout_of(const loom_attention_args& a) {
  return Layout{a.seq,          a.kv_seq,       a.q_offset,     a.heads,        a.head_dim,
                a.qkv_stride_b, a.qkv_stride_s, a.kv_stride_b,  a.kv_stride_s,  a.out_stride_b,
                a.out_stride_s, (a.seq + kBlockRows - 1) / kBlockRows, a.causal != 0, a.window, a.key_start};
}

// Row i's probabilities over the columns [start, end) of a block's nk; the columns
// before start are zero (a sliding window's keys that slid out).
float softmax_columns(const Device& d, float* row, int64_t start, int64_t end, int64_t nk) {
  for (int64_t j = 0; j < start; ++j) row[j] = 0.0f;
  return d.k->softmax_row(row + start, end - start, nk - start);
}

inline const float* F(const void* p) { return static_cast<const float*>(p); }
inline float* F(void* p) { return static_cast<float*>(p); }

// One block of query rows of one (batch, head): writes O rows and lse.
void forward_block(const Device& d, const loom_attention_args& a, const Layout& L, int64_t b, int64_t h, int64_t blk) {
  const int64_t S = L.seq, D = L.hd;
  const int64_t i0 = blk * kBlockRows, i1 = std::min(S, i0 + kBlockRows), nr = i1 - i0;
  const int64_t k0 = L.first_key(b, i0), nk = L.end_key(i1) - k0;
  const float* q = F(a.q) + b * L.qs_b + h * D;
  const float* k = F(a.k) + b * L.ks_b + h * D + k0 * L.ks_s;
  const float* v = F(a.v) + b * L.ks_b + h * D + k0 * L.ks_s;
  float* o = F(a.out) + b * L.os_b + h * D;
  float* lse = a.lse ? a.lse + (b * L.heads + h) * S : nullptr;

  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(nr * nk));
  float* P = scratch.data();
  d.gemm1(false, true, nr, nk, D, a.scale, q + i0 * L.qs_s, L.qs_s, k, L.ks_s, 0.0f, P, nk);
  for (int64_t i = 0; i < nr; ++i) {
    const float l = softmax_columns(d, P + i * nk, L.row_start(b, i0, i), L.row_end(b, i0, i), nk);
    if (lse) lse[i0 + i] = l;
  }
  d.gemm1(false, false, nr, D, nk, 1.0f, P, nk, v, L.ks_s, 0.0f, o + i0 * L.os_s, L.os_s);
}

// All query blocks of one (batch, head): dQ rows, and dK, dV accumulated over blocks.
void backward_head(Device& d, const loom_attention_args& a, const Layout& L, int64_t b, int64_t h, bool parallel_gemm) {
  const int64_t S = L.seq, D = L.hd, ld = L.qs_s, lk = L.ks_s, lo = L.os_s;
  const int64_t qbase = b * L.qs_b + h * D, kbase = b * L.ks_b + h * D, obase = b * L.os_b + h * D;
  const float* q = F(a.q) + qbase;
  const float* k = F(a.k) + kbase;
  const float* v = F(a.v) + kbase;
  const float* o = F(a.out) + obase;
  const float* dout = F(a.dout) + obase;
  float* dq = F(a.dq) + qbase;
  float* dk = F(a.dk) + kbase;
  float* dv = F(a.dv) + kbase;
  const float* lse = a.lse + (b * L.heads + h) * S;

  if (!a.accumulate_dkv)
    for (int64_t s = 0; s < L.kv; ++s)
      for (int64_t c = 0; c < D; ++c) dk[s * lk + c] = dv[s * lk + c] = 0.0f;

  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(2 * kBlockRows * L.kv + kBlockRows));
  for (int64_t blk = 0; blk < L.blocks; ++blk) {
    const int64_t i0 = blk * kBlockRows, i1 = std::min(S, i0 + kBlockRows), nr = i1 - i0;
    const int64_t k0 = L.first_key(b, i0), nk = L.end_key(i1) - k0;
    const float* kb = k + k0 * lk;
    const float* vb = v + k0 * lk;
    float* P = scratch.data();
    float* dP = P + nr * nk;
    float* Dv = dP + nr * nk;
    const float* qb = q + i0 * ld;
    const float* dob = dout + i0 * lo;
    d.gemm(false, true, nr, nk, D, a.scale, qb, ld, 0, kb, lk, 0, 0.0f, P, nk, 0, 1, parallel_gemm);
    for (int64_t i = 0; i < nr; ++i) {
      float* row = P + i * nk;
      const int64_t start = L.row_start(b, i0, i);
      for (int64_t j = 0; j < start; ++j) row[j] = 0.0f;
      d.k->exp_shift_row(row + start, L.row_end(b, i0, i) - start, nk - start, lse[i0 + i]);
      Dv[i] = d.k->dot(o + (i0 + i) * lo, dob + i * lo, D);
    }
    // dV[k0:k0+nk] += P^T dO
    d.gemm(true, false, nk, D, nr, 1.0f, P, nk, 0, dob, lo, 0, 1.0f, dv + k0 * lk, lk, 0, 1, parallel_gemm);
    // dP = dO V^T
    d.gemm(false, true, nr, nk, D, 1.0f, dob, lo, 0, vb, lk, 0, 0.0f, dP, nk, 0, 1, parallel_gemm);
    // dS = P o (dP - D)
    for (int64_t i = 0; i < nr; ++i) d.k->softmax_grad_row(P + i * nk, dP + i * nk, nk, Dv[i]);
    // dQ = scale dS K ; dK[k0:k0+nk] += scale dS^T Q
    d.gemm(false, false, nr, D, nk, a.scale, dP, nk, 0, kb, lk, 0, 0.0f, dq + i0 * ld, ld, 0, 1, parallel_gemm);
    d.gemm(true, false, nk, D, nr, a.scale, dP, nk, 0, qb, ld, 0, 1.0f, dk + k0 * lk, lk, 0, 1, parallel_gemm);
  }
}

}  // namespace

void validate_attention(const loom_attention_args& a, bool backward) {
  op_contract::check("device/cpu", a, backward);
  if (a.batch == 0 || a.seq == 0 || a.heads == 0 || a.head_dim == 0) return;
  const loom_attention_args r = op_contract::resolved(a);
  LOOM_REQUIRE(r.qkv_stride_s <= INT_MAX && r.kv_stride_s <= INT_MAX && r.out_stride_s <= INT_MAX && r.kv_seq <= INT_MAX,
               (backward ? "attention_bwd" : "attention_fwd") << ": strides must fit in 32 bits (BLAS interface)");
}

namespace {

// key_start is host memory here, read when the op runs (under capture, the ops before
// it write it): each query's first key must be its own or earlier and never move back
// (what lets a block start at its first row's).
void check_key_start(const loom_attention_args& a, bool backward) {
  for (int64_t b = 0; a.key_start != nullptr && b < a.batch; ++b)
    for (int64_t i = 0; i < a.seq; ++i) {
      const int32_t k = a.key_start[b * a.seq + i];
      LOOM_REQUIRE(k >= 0 && k <= a.q_offset + i && (i == 0 || k >= a.key_start[b * a.seq + i - 1]),
                   (backward ? "attention_bwd" : "attention_fwd")
                       << ": key_start[" << b << " * seq + " << i << "] = " << k
                       << " must lie in [key_start of the query before, q_offset + " << i << " = " << a.q_offset + i
                       << "] (non-decreasing, each query seeing itself)");
    }
}

}  // namespace

namespace {

// bf16 attention, one batch element at a time: its q (and out, dout) widened into
// fp32 [seq, heads*head_dim] scratch, k and v into [kv_seq, heads*head_dim], the
// fp32 attention run on them (batch 1; every (head, query block) of the F32 path is
// computed the same way, whatever the batch), out (dq, dk, dv) rounded back into
// their strided places (dk, dv widened first when accumulated). lse stays fp32.
// The probabilities P and dS stay fp32 between the GEMMs (device/cuda rounds them to
// bf16 for its bf16 GEMMs: the two differ by about bf16 precision).
struct Bf16Attention {
  Device& d;
  const loom_attention_args& a;  // resolved
  int64_t S, KV, W;
  Bf16Attention(Device& dev, const loom_attention_args& args)
      : d(dev), a(args), S(args.seq), KV(args.kv_seq), W(args.heads * args.head_dim) {}

  void widen(const void* src, int64_t stride_b, int64_t stride_s, int64_t b, int64_t rows, float* dst) const {
    widen_matrix(d, static_cast<const uint16_t*>(src) + b * stride_b, stride_s, 0, dst, W, 0, 1, rows, W, true);
  }
  void round(const float* src, void* dst, int64_t stride_b, int64_t stride_s, int64_t b, int64_t rows) const {
    round_matrix(d, src, W, 0, static_cast<uint16_t*>(dst) + b * stride_b, stride_s, 0, 1, rows, W, true);
  }
  void widen_q(const void* src, int64_t b, float* dst) const { widen(src, a.qkv_stride_b, a.qkv_stride_s, b, S, dst); }
  void widen_kv(const void* src, int64_t b, float* dst) const { widen(src, a.kv_stride_b, a.kv_stride_s, b, KV, dst); }
  void widen_out(const void* src, int64_t b, float* dst) const { widen(src, a.out_stride_b, a.out_stride_s, b, S, dst); }
  // The fp32 arguments of batch element b over scratch tensors q, out [S, W] and k, v [KV, W].
  loom_attention_args f32_args(int64_t b, float* q, float* k, float* v, float* out) const {
    loom_attention_args f = a;
    f.dtype = LOOM_DTYPE_F32;
    f.batch = 1;
    f.qkv_stride_b = f.out_stride_b = S * W;
    f.qkv_stride_s = f.out_stride_s = W;
    f.kv_stride_b = KV * W;
    f.kv_stride_s = W;
    f.q = q;
    f.k = k;
    f.v = v;
    f.out = out;
    f.lse = a.lse ? a.lse + b * a.heads * S : nullptr;
    f.key_start = a.key_start ? a.key_start + b * S : nullptr;
    return f;
  }
};

void attention_fwd(Device& d, const loom_attention_args& a) {
  if (is_bf16(a.dtype)) {
    const Bf16Attention x(d, a);
    const size_t t = static_cast<size_t>(x.S * x.W), kt = static_cast<size_t>(x.KV * x.W);
    F32Buffer buf(2 * t + 2 * kt);
    float *q = buf.get(), *o = q + t, *k = o + t, *v = k + kt;
    for (int64_t b = 0; b < a.batch; ++b) {
      x.widen_q(a.q, b, q);
      x.widen_kv(a.k, b, k);
      x.widen_kv(a.v, b, v);
      attention_fwd(d, x.f32_args(b, q, k, v, o));
      x.round(o, a.out, a.out_stride_b, a.out_stride_s, b, x.S);
    }
    return;
  }
  const Layout L = layout_of(a);
  // Every (batch, head, query block) is independent: one chunk each.
  const int64_t per_batch = a.heads * L.blocks;
  d.pool->run_chunks(a.batch * per_batch, [&](int64_t t) {
    const int64_t b = t / per_batch, rem = t % per_batch;
    forward_block(d, a, L, b, rem / L.blocks, rem % L.blocks);
  });
}

void attention_bwd(Device& d, const loom_attention_args& a) {
  if (is_bf16(a.dtype)) {
    const Bf16Attention x(d, a);
    const size_t t = static_cast<size_t>(x.S * x.W), kt = static_cast<size_t>(x.KV * x.W);
    F32Buffer buf(4 * t + 4 * kt);
    float *q = buf.get(), *o = q + t, *dout = o + t, *dq = dout + t;
    float *k = dq + t, *v = k + kt, *dk = v + kt, *dv = dk + kt;
    for (int64_t b = 0; b < a.batch; ++b) {
      x.widen_q(a.q, b, q);
      x.widen_kv(a.k, b, k);
      x.widen_kv(a.v, b, v);
      x.widen_out(a.out, b, o);
      x.widen_out(a.dout, b, dout);
      if (a.accumulate_dkv) {
        x.widen_kv(a.dk, b, dk);
        x.widen_kv(a.dv, b, dv);
      }
      loom_attention_args f = x.f32_args(b, q, k, v, o);
      f.dout = dout;
      f.dq = dq;
      f.dk = dk;
      f.dv = dv;
      attention_bwd(d, f);
      x.round(dq, a.dq, a.qkv_stride_b, a.qkv_stride_s, b, x.S);
      x.round(dk, a.dk, a.kv_stride_b, a.kv_stride_s, b, x.KV);
      x.round(dv, a.dv, a.kv_stride_b, a.kv_stride_s, b, x.KV);
    }
    return;
  }
  const Layout L = layout_of(a);
  const int64_t tasks = a.batch * a.heads;
  if (tasks >= d.pool->size()) {
    d.pool->run_chunks(tasks, [&](int64_t t) { backward_head(d, a, L, t / a.heads, t % a.heads, false); });
  } else {  // few heads: one at a time, each GEMM spread over the pool
    for (int64_t t = 0; t < tasks; ++t) backward_head(d, a, L, t / a.heads, t % a.heads, true);
  }
}

}  // namespace

void run_attention_fwd(Device& d, const loom_attention_args& a) {
  if (a.batch == 0 || a.seq == 0 || a.heads == 0 || a.head_dim == 0) return;
  const loom_attention_args r = op_contract::resolved(a);
  check_key_start(r, false);
  attention_fwd(d, r);
}

void run_attention_bwd(Device& d, const loom_attention_args& a) {
  if (a.batch == 0 || a.seq == 0 || a.heads == 0 || a.head_dim == 0) return;
  const loom_attention_args r = op_contract::resolved(a);
  check_key_start(r, true);
  attention_bwd(d, r);
}

}  // namespace loom::cpu
