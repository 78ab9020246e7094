// device/cuda: the op table. Validation mirrors device/cpu (same messages, same
// codes), extended to bf16 storage; GEMMs go to cuBLAS, everything else to the
// kernels in kernels.cu. Attention on bf16 with head size 64 or 128 is the fused
// kernels of flash_attention.cu (no [H, S, S] tensor, causal tiles skipped); any other
// case (fp32, other head sizes, unaligned tensors, or the device option
// fused_attention = false) is batched GEMMs around a masked softmax: per batch
// element, the H heads are one strided-batched GEMM each way, with the scores
// [H, S, S] in fp32 scratch (causal rows are masked, not skipped).
#include <algorithm>
#include <climits>
#include <cstddef>
#include <cmath>
#include <cstring>

#include "cuda_device.hpp"
#include "flash_attention.hpp"
#include "../common/op_contract.hpp"

namespace loom::cuda {

using op_contract::dtype_name;
using op_contract::ew_name;

namespace {

// The storage type of a float tensor: f32 or bf16, anything else is UNSUPPORTED.
Dt float_dt(const char* op, const char* what, int32_t dtype) {
  op_contract::require_float("device/cuda", op, what, dtype);
  return dtype == LOOM_DTYPE_BF16 ? Dt::BF16 : Dt::F32;
}

size_t dt_size(Dt dt) { return dt == Dt::F32 ? 4 : 2; }

const char* at(const void* p, int64_t elements, Dt dt) {
  return static_cast<const char*>(p) + elements * static_cast<int64_t>(dt_size(dt));
}
char* at(void* p, int64_t elements, Dt dt) { return static_cast<char*>(p) + elements * static_cast<int64_t>(dt_size(dt)); }

cudaDataType_t cuda_type(Dt dt) { return dt == Dt::F32 ? CUDA_R_32F : CUDA_R_16BF; }

void check_launch(Device& d, const char* op, const char* kernel, cudaError_t err) {
  if (err != cudaSuccess) throw_cuda(&d, op, kernel, err);
}

// The stream's cuBLAS workspace, allocated on first use (outside the caching
// allocator: it lives as long as the stream).
void* workspace(Device& d, Stream& st, const char* op) {
  if (st.workspace == nullptr && d.workspace_bytes > 0) {
    RelaxedCaptureMode relaxed;
    LOOM_CUDA(&d, op, cudaMalloc(&st.workspace, d.workspace_bytes));
    st.workspace_bytes = d.workspace_bytes;
  }
  return st.workspace;
}

// Row-major C = alpha op(A) op(B) + beta C over a batch, as column-major
// C^T = op(B)^T op(A)^T: cuBLAS gets (B, A) swapped and (n, m).
void gemm_impl(Device& d, Stream& st, const char* op, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
               const void* a, int64_t lda, int64_t sa, const void* b, int64_t ldb, int64_t sb, float beta, void* c,
               int64_t ldc, int64_t sc, int64_t batch, Dt ab, Dt cd) {
  if (m <= 0 || n <= 0 || batch <= 0) return;
  // C blocks of a batch that share elements (stride_c = 0: a sum over the batch)
  // run one after the other, in order, as on device/cpu.
  const bool stacked = sc >= (m - 1) * ldc + n;
  const bool side_by_side = sc >= n && (batch - 1) * sc + n <= ldc;
  if (batch > 1 && !stacked && !side_by_side && cd == Dt::BF16) {
    // As on device/cpu, the batch elements accumulate into fp32 copies of the C
    // elements they share, in order, and C is rounded once (op_contract: sc >= 0).
    const int64_t span = (batch - 1) * sc + (m - 1) * ldc + n;
    Scratch cf(d, st, static_cast<size_t>(span) * sizeof(float), op);
    for (int64_t i = 0; i < batch && beta != 0.0f; ++i)  // shared elements are written the same value again
      check_launch(d, op, "copy_matrix kernel",
                   k_copy_matrix(st.s, Dt::BF16, Dt::F32, m, n, 1, at(c, i * sc, Dt::BF16), ldc, 0,
                                 at(cf.get(), i * sc, Dt::F32), ldc, 0));
    gemm_impl(d, st, op, ta, tb, m, n, k, alpha, a, lda, sa, b, ldb, sb, beta, cf.get(), ldc, sc, batch, ab, Dt::F32);
    for (int64_t i = 0; i < batch; ++i)
      check_launch(d, op, "copy_matrix kernel",
                   k_copy_matrix(st.s, Dt::F32, Dt::BF16, m, n, 1, at(cf.get(), i * sc, Dt::F32), ldc, 0,
                                 at(c, i * sc, Dt::BF16), ldc, 0));
    return;
  }
  if (batch > 1 && !stacked && !side_by_side) {
    for (int64_t i = 0; i < batch; ++i)
      gemm_impl(d, st, op, ta, tb, m, n, k, alpha, at(a, i * sa, ab), lda, 0, at(b, i * sb, ab), ldb, 0, beta,
                at(c, i * sc, cd), ldc, 0, 1, ab, cd);
    return;
  }
  if (k <= 0 || alpha == 0.0f) {  // C = beta C; beta = 0 ignores what C held (NaN included)
    if (beta != 1.0f) check_launch(d, op, "scale_matrix kernel", k_scale_matrix(st.s, cd, m, n, ldc, sc, batch, beta, c));
    return;
  }
  if (ab == Dt::F32 && cd == Dt::BF16) {
    // cuBLAS has no fp32 x fp32 -> bf16 GEMM (CUBLAS_STATUS_NOT_SUPPORTED): C goes
    // through packed fp32 scratch (the blocks are disjoint here) and is rounded once,
    // as on device/cpu; beta = 0 does not read C.
    Scratch cf(d, st, static_cast<size_t>(batch * m * n) * sizeof(float), op);
    if (beta != 0.0f)
      check_launch(d, op, "copy_matrix kernel",
                   k_copy_matrix(st.s, Dt::BF16, Dt::F32, m, n, batch, c, ldc, sc, cf.get(), n, m * n));
    gemm_impl(d, st, op, ta, tb, m, n, k, alpha, a, lda, sa, b, ldb, sb, beta, cf.get(), n, m * n, batch, ab,
              Dt::F32);
    check_launch(d, op, "copy_matrix kernel",
                 k_copy_matrix(st.s, Dt::F32, Dt::BF16, m, n, batch, cf.get(), n, m * n, c, ldc, sc));
    return;
  }
  const cublasComputeType_t compute =
      ab == Dt::F32 ? (d.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F) : CUBLAS_COMPUTE_32F;
  std::lock_guard<std::mutex> lock(d.cublas_mu);
  void* ws = workspace(d, st, op);
  LOOM_CUBLAS(&d, op, cublasSetStream(d.cublas, st.s));
  LOOM_CUBLAS(&d, op, cublasSetWorkspace(d.cublas, ws, st.workspace_bytes));
  LOOM_CUBLAS(&d, op,
              cublasGemmStridedBatchedEx(d.cublas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N,
                                         static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b,
                                         cuda_type(ab), static_cast<int>(ldb), sb, a, cuda_type(ab),
                                         static_cast<int>(lda), sa, &beta, c, cuda_type(cd), static_cast<int>(ldc), sc,
                                         static_cast<int>(batch), compute, CUBLAS_GEMM_DEFAULT));
}

constexpr int64_t kMax32 = INT_MAX;

}  // namespace

// ---------------------------------------------------------------------------
// GEMM
// ---------------------------------------------------------------------------

void validate(const loom_gemm_args& g) {
  op_contract::check("device/cuda", g);
  LOOM_REQUIRE(g.m <= kMax32 && g.n <= kMax32 && g.k <= kMax32 && g.lda <= kMax32 && g.ldb <= kMax32 &&
                   g.ldc <= kMax32 && g.batch <= kMax32,
               "gemm: dimensions, leading dimensions and batch must fit in 32 bits (cuBLAS interface)");
}

namespace {

// The epilogue by the unfused ops, where cuBLASLt cannot take the GEMM: the GEMM
// into C (or packed scratch when ldc != n), then ADD_BIAS, the copy to aux and
// gelu_fwd, or gelu_bwd; the result is the fused one up to the roundings between
// the steps.
void gemm_epilogue_unfused(Device& d, Stream& st, const loom_gemm_args& g, Dt ab, Dt cd) {
  const int64_t m = g.m, n = g.n;
  const bool packed = g.ldc == n;
  Scratch cs(d, st, packed ? 0 : static_cast<size_t>(m * n) * dt_size(cd), "gemm");
  void* c = packed ? g.c : cs.get();
  if (!packed && g.beta != 0.0f)
    check_launch(d, "gemm", "copy_matrix kernel", k_copy_matrix(st.s, cd, cd, m, n, 1, g.c, g.ldc, 0, c, n, 0));
  gemm_impl(d, st, "gemm", g.trans_a != 0, g.trans_b != 0, m, n, g.k, g.alpha, g.a, g.lda, g.stride_a, g.b, g.ldb,
            g.stride_b, g.beta, c, n, m * n, 1, ab, cd);
  const int32_t dtype = cd == Dt::BF16 ? LOOM_DTYPE_BF16 : LOOM_DTYPE_F32;
  if (g.bias) {
    loom_elementwise_args e = loom::make<loom_elementwise_args>();
    e.op = LOOM_EW_ADD_BIAS;
    e.n = m * n;
    e.cols = n;
    e.x = c;
    e.y = const_cast<void*>(g.bias);
    e.out = c;
    e.dtype = e.out_dtype = dtype;
    run_elementwise(d, st, e);
  }
  if (g.epilogue != LOOM_GEMM_EPILOGUE_BIAS) {
    // aux packed: in place when ldaux = n, else through scratch.
    const bool aux_packed = g.ldaux == n;
    Scratch xs(d, st, aux_packed ? 0 : static_cast<size_t>(m * n) * dt_size(cd), "gemm");
    void* x = aux_packed ? g.aux : xs.get();
    loom_gelu_args ga = loom::make<loom_gelu_args>();
    ga.n = m * n;
    ga.x = x;
    ga.out = c;
    ga.dtype = dtype;
    if (g.epilogue == LOOM_GEMM_EPILOGUE_GELU_AUX) {
      check_launch(d, "gemm", "copy_matrix kernel", k_copy_matrix(st.s, cd, cd, m, n, 1, c, n, 0, x, n, 0));
      run_gelu_fwd(d, st, ga);
      if (!aux_packed)
        check_launch(d, "gemm", "copy_matrix kernel", k_copy_matrix(st.s, cd, cd, m, n, 1, x, n, 0, g.aux, g.ldaux, 0));
    } else {  // DGELU
      if (!aux_packed)
        check_launch(d, "gemm", "copy_matrix kernel", k_copy_matrix(st.s, cd, cd, m, n, 1, g.aux, g.ldaux, 0, x, n, 0));
      ga.dy = c;
      run_gelu_bwd(d, st, ga);
    }
  }
  if (!packed)
    check_launch(d, "gemm", "copy_matrix kernel", k_copy_matrix(st.s, cd, cd, m, n, 1, c, n, 0, g.c, g.ldc, 0));
}

// BIAS_GRAD: the GEMM, and aux (+)= the column sums of B. cuBLASLt writes the sums
// (fp32 C only) to scratch, added to aux; else reduce COLUMN_SUM, through fp32 scratch
// for a bf16 aux (widened, added, rounded once, as device/cpu).
void gemm_bias_grad(Device& d, Stream& st, const loom_gemm_args& g, Dt ab, Dt cd) {
  Scratch sum(d, st, static_cast<size_t>(g.n) * sizeof(float), "gemm");
  loom_elementwise_args add = loom::make<loom_elementwise_args>();
  add.op = LOOM_EW_ADD;
  add.n = g.n;
  add.dtype = add.out_dtype = LOOM_DTYPE_F32;
  if (cd == Dt::F32 && g.m > 0) {
    loom_gemm_args lt = g;
    lt.bias = sum.get();
    std::lock_guard<std::mutex> lock(d.cublas_mu);
    void* ws = workspace(d, st, "gemm");
    if (lt_gemm_epilogue(d, st, lt, ab, cd, ws, st.workspace_bytes)) {
      add.x = g.aux;
      add.y = sum.get();
      add.out = g.aux;
      run_elementwise(d, st, add);
      return;
    }
  }
  gemm_impl(d, st, "gemm", g.trans_a != 0, false, g.m, g.n, g.k, g.alpha, g.a, g.lda, g.stride_a, g.b, g.ldb,
            g.stride_b, g.beta, g.c, g.ldc, g.stride_c, 1, ab, cd);
  loom_reduce_args r = op_contract::bias_grad_sums(g);
  r.out = cd == Dt::F32 ? g.aux : sum.get();
  r.accumulate = cd == Dt::F32 ? 1 : 0;
  run_reduce(d, st, r);
  if (cd == Dt::F32) return;
  Scratch wide(d, st, static_cast<size_t>(g.n) * sizeof(float), "gemm");
  check_launch(d, "gemm", "cast kernel", k_cast(st.s, Dt::BF16, Dt::F32, g.n, g.aux, wide.get()));
  add.x = wide.get();
  add.y = sum.get();
  add.out = wide.get();
  run_elementwise(d, st, add);
  check_launch(d, "gemm", "cast kernel", k_cast(st.s, Dt::F32, Dt::BF16, g.n, wide.get(), g.aux));
}

void run_gemm_epilogue(Device& d, Stream& st, const loom_gemm_args& g) {
  const Dt ab = float_dt("gemm", "dtype", g.dtype), cd = float_dt("gemm", "c_dtype", g.c_dtype);
  if (g.epilogue == LOOM_GEMM_EPILOGUE_BIAS_GRAD) {
    if (g.n > 0) gemm_bias_grad(d, st, g, ab, cd);
    return;
  }
  if (g.m <= 0 || g.n <= 0) return;
  {
    std::lock_guard<std::mutex> lock(d.cublas_mu);
    void* ws = workspace(d, st, "gemm");
    if (lt_gemm_epilogue(d, st, g, ab, cd, ws, st.workspace_bytes)) return;
  }
  gemm_epilogue_unfused(d, st, g, ab, cd);
}

}  // namespace

void run_gemm(Device& d, Stream& s, const loom_gemm_args& g) {
  if (g.epilogue != LOOM_GEMM_EPILOGUE_NONE) {
    run_gemm_epilogue(d, s, g);
    return;
  }
  gemm_impl(d, s, "gemm", g.trans_a != 0, g.trans_b != 0, g.m, g.n, g.k, g.alpha, g.a, g.lda, g.stride_a, g.b, g.ldb,
            g.stride_b, g.beta, g.c, g.ldc, g.stride_c, g.batch, float_dt("gemm", "dtype", g.dtype),
            float_dt("gemm", "c_dtype", g.c_dtype));
}

// ---------------------------------------------------------------------------
// LayerNorm
// ---------------------------------------------------------------------------

void validate(const loom_layernorm_fwd_args& a) {
  op_contract::check("device/cuda", a);
  LOOM_REQUIRE(a.rows <= kMax32, "layernorm_fwd: rows must fit in 32 bits (one CUDA block per row)");
}

void run_layernorm_fwd(Device& d, Stream& s, const loom_layernorm_fwd_args& a) {
  check_launch(d, "layernorm_fwd", "layernorm_fwd kernel",
               k_layernorm_fwd(s.s, float_dt("layernorm_fwd", "dtype", a.dtype), a.rows, a.cols, a.x, a.gamma, a.beta,
                               a.y, a.mean, a.rstd, a.eps));
}

void validate(const loom_layernorm_bwd_args& a) {
  op_contract::check("device/cuda", a);
  LOOM_REQUIRE(a.rows <= kMax32, "layernorm_bwd: rows must fit in 32 bits (one CUDA block per row)");
}

void run_layernorm_bwd(Device& d, Stream& s, const loom_layernorm_bwd_args& a) {
  const Dt dt = float_dt("layernorm_bwd", "dtype", a.dtype);
  // dgamma/dbeta: fp32 main gradients under bf16 with grad_fp32 (1.2), else dtype.
  const Dt gdt = float_dt("layernorm_bwd", "dgamma/dbeta dtype", op_contract::grad_dtype(a));
  if (a.rows == 0) return;
  // dgamma/dbeta first: dx may overwrite dy in place.
  if (a.dgamma || a.dbeta) {
    const int64_t chunks = column_chunks(a.rows);
    Scratch partial(d, s, static_cast<size_t>(2 * chunks * a.cols) * sizeof(double), "layernorm_bwd");
    check_launch(d, "layernorm_bwd", "layernorm_bwd params kernels",
                 k_layernorm_bwd_params(s.s, dt, gdt, a.rows, a.cols, a.dy, a.x, a.mean, a.rstd,
                                        partial.get<double>(), chunks, a.dgamma, a.dbeta));
  }
  if (a.dx == nullptr) return;
  check_launch(d, "layernorm_bwd", "layernorm_bwd dx kernel",
               k_layernorm_bwd_dx(s.s, dt, a.rows, a.cols, a.dy, a.x, a.gamma, a.mean, a.rstd, a.dx, a.accumulate_dx));
}

// ---------------------------------------------------------------------------
// GeLU
// ---------------------------------------------------------------------------

void validate_gelu(const loom_gelu_args& a, bool backward) {
  op_contract::check("device/cuda", a, backward);
}

void run_gelu_fwd(Device& d, Stream& s, const loom_gelu_args& a) {
  check_launch(d, "gelu_fwd", "gelu kernel",
               k_gelu(s.s, float_dt("gelu_fwd", "dtype", a.dtype), false, a.n, a.x, nullptr, a.out));
}

void run_gelu_bwd(Device& d, Stream& s, const loom_gelu_args& a) {
  check_launch(d, "gelu_bwd", "gelu kernel",
               k_gelu(s.s, float_dt("gelu_bwd", "dtype", a.dtype), true, a.n, a.x, a.dy, a.out));
}

// ---------------------------------------------------------------------------
// ABI 1.10: RMSNorm, SwiGLU, rotary embedding, sigmoid
// ---------------------------------------------------------------------------

void validate(const loom_rmsnorm_fwd_args& a) {
  op_contract::check("device/cuda", a);
  LOOM_REQUIRE(a.rows <= kMax32, "rmsnorm_fwd: rows must fit in 32 bits (one CUDA block per row)");
}
void validate(const loom_rmsnorm_bwd_args& a) {
  op_contract::check("device/cuda", a);
  LOOM_REQUIRE(a.rows <= kMax32, "rmsnorm_bwd: rows must fit in 32 bits (one CUDA block per row)");
}
void validate_swiglu(const loom_swiglu_args& a, bool backward) { op_contract::check("device/cuda", a, backward); }
void validate_rope(const loom_rope_args& a, bool backward) { op_contract::check("device/cuda", a, backward); }
void validate_sigmoid(const loom_activation_args& a, bool backward) {
  op_contract::check("device/cuda", a, backward ? "sigmoid_bwd" : "sigmoid_fwd", backward);
}

void run_rmsnorm_fwd(Device& d, Stream& s, const loom_rmsnorm_fwd_args& a) {
  check_launch(d, "rmsnorm_fwd", "rmsnorm kernel",
               k_rmsnorm_fwd(s.s, float_dt("rmsnorm_fwd", "dtype", a.dtype), a.rows, a.cols, a.x, a.gamma, a.y,
                             a.rstd, a.eps));
}

void run_rmsnorm_bwd(Device& d, Stream& s, const loom_rmsnorm_bwd_args& a) {
  const Dt dt = float_dt("rmsnorm_bwd", "dtype", a.dtype);
  const Dt gdt = float_dt("rmsnorm_bwd", "dgamma dtype", op_contract::grad_dtype(a));
  if (a.rows == 0) return;
  if (a.dgamma) {  // first: dx may overwrite dy in place
    const int64_t chunks = column_chunks(a.rows);
    Scratch partial(d, s, static_cast<size_t>(chunks * a.cols) * sizeof(double), "rmsnorm_bwd");
    check_launch(d, "rmsnorm_bwd", "rmsnorm_bwd dgamma kernels",
                 k_rmsnorm_bwd_dgamma(s.s, dt, gdt, a.rows, a.cols, a.dy, a.x, a.rstd, partial.get<double>(), chunks,
                                      a.dgamma));
  }
  if (a.dx == nullptr) return;
  check_launch(d, "rmsnorm_bwd", "rmsnorm_bwd dx kernel",
               k_rmsnorm_bwd_dx(s.s, dt, a.rows, a.cols, a.dy, a.x, a.gamma, a.rstd, a.dx, a.accumulate_dx));
}

void run_swiglu_fwd(Device& d, Stream& s, const loom_swiglu_args& a) {
  check_launch(d, "swiglu_fwd", "swiglu kernel",
               k_swiglu(s.s, float_dt("swiglu_fwd", "dtype", a.dtype), false, a.rows, a.cols, a.x, nullptr, a.out));
}

void run_swiglu_bwd(Device& d, Stream& s, const loom_swiglu_args& a) {
  check_launch(d, "swiglu_bwd", "swiglu kernel",
               k_swiglu(s.s, float_dt("swiglu_bwd", "dtype", a.dtype), true, a.rows, a.cols, a.x, a.dy, a.out));
}

void run_rope_fwd(Device& d, Stream& s, const loom_rope_args& a) {
  check_launch(d, "rope_fwd", "rope kernels",
               k_rope(s.s, float_dt("rope_fwd", "dtype", a.dtype), a.tokens, a.heads, a.head_dim, a.rotary_dim,
                      a.stride_t, a.x, a.out, a.positions, a.theta, a.inv_freq, 1.0f));
}

void run_rope_bwd(Device& d, Stream& s, const loom_rope_args& a) {
  check_launch(d, "rope_bwd", "rope kernels",
               k_rope(s.s, float_dt("rope_bwd", "dtype", a.dtype), a.tokens, a.heads, a.head_dim, a.rotary_dim,
                      a.stride_t, a.x, a.out, a.positions, a.theta, a.inv_freq, -1.0f));
}

void run_sigmoid_fwd(Device& d, Stream& s, const loom_activation_args& a) {
  check_launch(d, "sigmoid_fwd", "sigmoid kernel",
               k_sigmoid(s.s, float_dt("sigmoid_fwd", "dtype", a.dtype), false, a.n, a.x, nullptr, a.out));
}

void run_sigmoid_bwd(Device& d, Stream& s, const loom_activation_args& a) {
  check_launch(d, "sigmoid_bwd", "sigmoid kernel",
               k_sigmoid(s.s, float_dt("sigmoid_bwd", "dtype", a.dtype), true, a.n, a.x, a.dy, a.out));
}

// ---------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------

void validate_attention(const loom_attention_args& a, bool backward) {
  op_contract::check("device/cuda", a, backward);
  if (a.batch == 0 || a.seq == 0 || a.heads == 0 || a.head_dim == 0) return;
  const loom_attention_args r = op_contract::resolved(a);
  LOOM_REQUIRE(r.qkv_stride_s <= kMax32 && r.kv_stride_s <= kMax32 && r.out_stride_s <= kMax32 &&
                   r.kv_seq <= kMax32 && r.q_offset <= kMax32,
               (backward ? "attention_bwd" : "attention_fwd") << ": strides and kv_seq must fit in 32 bits");
}

namespace {

// The GEMM path's limits (cuBLAS takes 32-bit sizes; the scores are [heads, seq, kv_seq]).
void require_unfused_fits(const loom_attention_args& a, const char* op) {
  LOOM_REQUIRE(a.heads * a.seq <= kMax32 && a.seq * a.kv_seq <= kMax32,
               op << ": heads*seq and seq*kv_seq must fit in 32 bits (cuBLAS interface) unless the fused kernels "
                     "take the call (bf16, head size 64 or 128)");
}

}  // namespace

namespace {

bool aligned16(const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Whether the fused kernels take this call: bf16, a head size they are built for,
// 16-byte aligned rows (their copies move 16 bytes at a time), a grid that fits.
bool use_flash(const Device& d, const loom_attention_args& a, bool backward) {
  if (!d.fused_attention || a.dtype != LOOM_DTYPE_BF16 || !flash_head_dim_supported(a.head_dim)) return false;
  if (a.batch * a.heads > 65535) return false;
  for (int64_t stride : {a.qkv_stride_b, a.qkv_stride_s, a.kv_stride_b, a.kv_stride_s, a.out_stride_b, a.out_stride_s})
    if (stride % 8 != 0) return false;
  const void* ptrs[] = {a.q, a.k, a.v, a.out, backward ? a.dout : nullptr, backward ? a.dq : nullptr,
                        backward ? a.dk : nullptr, backward ? a.dv : nullptr};
  for (const void* p : ptrs)
    if (!aligned16(p)) return false;
  return true;
}

FlashArgs flash_args(const loom_attention_args& a) {  // `a` resolved
  FlashArgs f{};
  f.q = static_cast<const uint16_t*>(a.q);
  f.k = static_cast<const uint16_t*>(a.k);
  f.v = static_cast<const uint16_t*>(a.v);
  f.out = static_cast<const uint16_t*>(a.out);
  f.out_w = static_cast<uint16_t*>(a.out);
  f.lse = a.lse;
  f.dout = static_cast<const uint16_t*>(a.dout);
  f.dq = static_cast<uint16_t*>(a.dq);
  f.dk = static_cast<uint16_t*>(a.dk);
  f.dv = static_cast<uint16_t*>(a.dv);
  f.q_sb = a.qkv_stride_b;
  f.q_ss = a.qkv_stride_s;
  f.kv_sb = a.kv_stride_b;
  f.kv_ss = a.kv_stride_s;
  f.o_sb = a.out_stride_b;
  f.o_ss = a.out_stride_s;
  f.batch = static_cast<int>(a.batch);
  f.heads = static_cast<int>(a.heads);
  f.seq = static_cast<int>(a.seq);
  f.kv_seq = static_cast<int>(a.kv_seq);
  f.q_offset = static_cast<int>(a.q_offset);
  f.scale = a.scale;
  f.causal = a.causal != 0;
  f.accumulate_dkv = a.accumulate_dkv != 0;
  // A window reaching past the first key changes nothing (every query sits before kv_seq).
  f.window = a.window < a.kv_seq ? static_cast<int>(a.window) : 0;
  f.key_start = a.causal ? a.key_start : nullptr;
  return f;
}

}  // namespace

// Scores are [heads, Sq, Skv] per batch element: the Sq queries (ABI 1.6: a window at
// q_offset of the Skv keys; without one Skv = Sq) against every key, masked past the
// causal limit by the softmax kernels.
void run_attention_fwd(Device& d, Stream& s, const loom_attention_args& args) {
  const char* op = "attention_fwd";
  const Dt dt = float_dt(op, "dtype", args.dtype);
  if (args.batch == 0 || args.seq == 0 || args.heads == 0 || args.head_dim == 0) return;
  const loom_attention_args a = op_contract::resolved(args);
  if (use_flash(d, a, false)) {
    check_launch(d, op, "flash attention forward kernel",
                 k_flash_fwd(s.s, static_cast<int>(a.head_dim), flash_args(a)));
    return;
  }
  require_unfused_fits(a, op);
  const int64_t Sq = a.seq, Skv = a.kv_seq, H = a.heads, D = a.head_dim;
  const int64_t qs = a.qkv_stride_s, ks = a.kv_stride_s, os = a.out_stride_s;
  const bool bf16 = dt == Dt::BF16;
  const size_t sq = static_cast<size_t>(H * Sq * Skv);
  Scratch scores(d, s, sq * sizeof(float), op);
  Scratch pb(d, s, bf16 ? sq * 2 : 0, op);
  for (int64_t b = 0; b < a.batch; ++b) {
    const char* q = at(a.q, b * a.qkv_stride_b, dt);
    const char* k = at(a.k, b * a.kv_stride_b, dt);
    const char* v = at(a.v, b * a.kv_stride_b, dt);
    char* o = at(a.out, b * a.out_stride_b, dt);
    // scores[h] = scale Q_h K_h^T (fp32)
    gemm_impl(d, s, op, false, true, Sq, Skv, D, a.scale, q, qs, D, k, ks, D, 0.0f, scores.get(), Skv, Sq * Skv, H,
              dt, Dt::F32);
    check_launch(d, op, "softmax kernel",
                 k_softmax_fwd(s.s, H * Sq, Sq, Skv, a.q_offset, a.causal != 0, a.window,
                               a.key_start ? a.key_start + b * Sq : nullptr, scores.get<float>(),
                               bf16 ? pb.get<uint16_t>() : nullptr, a.lse ? a.lse + b * H * Sq : nullptr));
    // O_h = P_h V_h
    gemm_impl(d, s, op, false, false, Sq, D, Skv, 1.0f, bf16 ? pb.get() : scores.get(), Skv, Sq * Skv, v, ks, D, 0.0f,
              o, os, D, H, dt, dt);
  }
}

void run_attention_bwd(Device& d, Stream& s, const loom_attention_args& args) {
  const char* op = "attention_bwd";
  const Dt dt = float_dt(op, "dtype", args.dtype);
  if (args.batch == 0 || args.seq == 0 || args.heads == 0 || args.head_dim == 0) return;
  const loom_attention_args a = op_contract::resolved(args);
  if (use_flash(d, a, true)) {
    Scratch dvec(d, s, static_cast<size_t>(a.batch * a.heads * a.seq) * sizeof(float), op);
    FlashArgs f = flash_args(a);
    f.dvec = dvec.get<float>();
    check_launch(d, op, "flash attention backward kernels", k_flash_bwd(s.s, static_cast<int>(a.head_dim), f));
    return;
  }
  require_unfused_fits(a, op);
  const int64_t Sq = a.seq, Skv = a.kv_seq, H = a.heads, D = a.head_dim;
  const int64_t qs = a.qkv_stride_s, ks = a.kv_stride_s, os = a.out_stride_s;
  const bool bf16 = dt == Dt::BF16;
  const float beta_kv = a.accumulate_dkv ? 1.0f : 0.0f;
  const size_t sq = static_cast<size_t>(H * Sq * Skv);
  Scratch p(d, s, sq * sizeof(float), op), dp(d, s, sq * sizeof(float), op);
  Scratch pb(d, s, bf16 ? sq * 2 : 0, op), dsb(d, s, bf16 ? sq * 2 : 0, op);
  Scratch dvec(d, s, static_cast<size_t>(H * Sq) * sizeof(float), op);
  for (int64_t b = 0; b < a.batch; ++b) {
    const char* q = at(a.q, b * a.qkv_stride_b, dt);
    const char* k = at(a.k, b * a.kv_stride_b, dt);
    const char* v = at(a.v, b * a.kv_stride_b, dt);
    const char* o = at(a.out, b * a.out_stride_b, dt);
    const char* dout = at(a.dout, b * a.out_stride_b, dt);
    char* dq = at(a.dq, b * a.qkv_stride_b, dt);
    char* dk = at(a.dk, b * a.kv_stride_b, dt);
    char* dv = at(a.dv, b * a.kv_stride_b, dt);
    // P = exp(scale Q K^T - lse), recomputed.
    gemm_impl(d, s, op, false, true, Sq, Skv, D, a.scale, q, qs, D, k, ks, D, 0.0f, p.get(), Skv, Sq * Skv, H, dt,
              Dt::F32);
    check_launch(d, op, "softmax recompute kernel",
                 k_softmax_p(s.s, H * Sq, Sq, Skv, a.q_offset, a.causal != 0, a.window,
                             a.key_start ? a.key_start + b * Sq : nullptr, p.get<float>(),
                             bf16 ? pb.get<uint16_t>() : nullptr, a.lse + b * H * Sq));
    // D_i = rowsum(dO o O)
    check_launch(d, op, "rowdot kernel", k_rowdot(s.s, dt, H, Sq, D, os, o, dout, dvec.get<float>()));
    // dV (+)= P^T dO
    gemm_impl(d, s, op, true, false, Skv, D, Sq, 1.0f, bf16 ? pb.get() : p.get(), Skv, Sq * Skv, dout, os, D, beta_kv,
              dv, ks, D, H, dt, dt);
    // dP = dO V^T (fp32), then dS = P o (dP - D) in place
    gemm_impl(d, s, op, false, true, Sq, Skv, D, 1.0f, dout, os, D, v, ks, D, 0.0f, dp.get(), Skv, Sq * Skv, H, dt,
              Dt::F32);
    check_launch(d, op, "softmax backward kernel",
                 k_dsoftmax(s.s, H * Sq, Skv, p.get<float>(), dp.get<float>(), dvec.get<float>(),
                            bf16 ? dsb.get<uint16_t>() : nullptr));
    const void* ds = bf16 ? dsb.get() : dp.get();
    // dQ = scale dS K ; dK (+)= scale dS^T Q
    gemm_impl(d, s, op, false, false, Sq, D, Skv, a.scale, ds, Skv, Sq * Skv, k, ks, D, 0.0f, dq, qs, D, H, dt, dt);
    gemm_impl(d, s, op, true, false, Skv, D, Sq, a.scale, ds, Skv, Sq * Skv, q, qs, D, beta_kv, dk, ks, D, H, dt, dt);
  }
}

// ---------------------------------------------------------------------------
// Cross-entropy
// ---------------------------------------------------------------------------

void validate(const loom_xent_args& a) {
  op_contract::check("device/cuda", a);
  LOOM_REQUIRE(a.rows <= kMax32, "xent: rows must fit in 32 bits (one CUDA block per row)");
}

// Unlike device/cpu, a target inside the vocab padding is not reported (the
// targets live on the GPU; checking them would need a host sync): its row counts
// target_logit 0 and gets no -scale in the gradient.
void run_xent(Device& d, Stream& s, const loom_xent_args& a) {
  const int64_t valid = std::clamp<int64_t>(a.valid_cols, 0, a.cols);
  check_launch(d, "xent", "xent kernel",
               k_xent(s.s, float_dt("xent", "dtype", a.dtype), a.step, a.rows, a.cols, a.ld, valid, a.vocab_start,
                      a.logits, a.targets, a.row_max, a.row_sumexp, a.target_logit, a.loss, a.dlogits, a.scale));
}

// ---------------------------------------------------------------------------
// Embedding
// ---------------------------------------------------------------------------

void validate_embedding(const loom_embedding_args& a, bool backward) {
  op_contract::check("device/cuda", a, backward);
  LOOM_REQUIRE(a.n <= kMax32, (backward ? "embedding_bwd" : "embedding_fwd")
                                  << ": n must fit in 32 bits (one CUDA block per row)");
}

void run_embedding_fwd(Device& d, Stream& s, const loom_embedding_args& a) {
  check_launch(d, "embedding_fwd", "embedding_fwd kernel",
               k_embedding_fwd(s.s, float_dt("embedding_fwd", "dtype", a.dtype), a.n, a.dim, a.vocab_rows,
                               a.vocab_start, a.ids, a.table, a.out, a.accumulate));
}

void run_embedding_bwd(Device& d, Stream& s, const loom_embedding_args& a) {
  // dtable: fp32 main gradients under bf16 with grad_fp32 (1.2), else dtype.
  const Dt dt = float_dt("embedding_bwd", "dtype", a.dtype);
  const Dt gdt = float_dt("embedding_bwd", "dtable dtype", op_contract::grad_dtype(a));
  if (gdt == Dt::F32) {
    check_launch(d, "embedding_bwd", "embedding_bwd kernel",
                 k_embedding_bwd(s.s, dt, a.n, a.dim, a.vocab_rows, a.vocab_start, a.ids, a.dout,
                                 static_cast<float*>(a.dtable)));
    return;
  }
  if (a.n == 0 || a.vocab_rows == 0) return;
  // A bf16 table: sum in an fp32 copy and round once, as device/cpu does (bf16
  // atomics would round after every add: a token seen k times loses ~log2(k) bits).
  const int64_t elems = a.vocab_rows * a.dim;
  Scratch wide(d, s, static_cast<size_t>(elems) * sizeof(float), "embedding_bwd");
  check_launch(d, "embedding_bwd", "widening cast", k_cast(s.s, Dt::BF16, Dt::F32, elems, a.dtable, wide.get()));
  check_launch(d, "embedding_bwd", "embedding_bwd kernel",
               k_embedding_bwd(s.s, dt, a.n, a.dim, a.vocab_rows, a.vocab_start, a.ids, a.dout, wide.get<float>()));
  check_launch(d, "embedding_bwd", "rounding cast", k_cast(s.s, Dt::F32, Dt::BF16, elems, wide.get(), a.dtable));
}


// ---------------------------------------------------------------------------
// Element-wise
// ---------------------------------------------------------------------------

void validate(const loom_elementwise_args& a) {
  op_contract::check("device/cuda", a);
}

void run_elementwise(Device& d, Stream& s, const loom_elementwise_args& a) {
  const char* op = ew_name(a.op);
  if (a.op == LOOM_EW_CAST) {
    const Dt from = float_dt(op, "dtype", a.dtype), to = float_dt(op, "out_dtype", a.out_dtype);
    if (from == to) {
      if (a.out != a.x && a.n > 0)
        LOOM_CUDA(&d, op,
                  cudaMemcpyAsync(a.out, a.x, static_cast<size_t>(a.n) * dt_size(from), cudaMemcpyDeviceToDevice, s.s));
      return;
    }
    check_launch(d, op, "cast kernel", k_cast(s.s, from, to, a.n, a.x, a.out));
    return;
  }
  EwParams p{};
  p.op = a.op;
  p.n = a.n;
  p.cols = a.cols;
  p.x = a.x;
  p.y = a.y;
  p.out = a.out;
  p.alpha = a.alpha;
  p.beta = a.beta;
  if (a.op == LOOM_EW_DROPOUT || a.op == LOOM_EW_DROPOUT_BWD) {
    // Dropout keeps with probability 1 - p and scales kept values by 1 / (1 - p).
    p.keep_scale = a.p < 1.0f ? 1.0f / (1.0f - a.p) : 0.0f;
    p.threshold = static_cast<uint32_t>(std::min(16777216.0, std::ceil(static_cast<double>(a.p) * 16777216.0)));
    const uint64_t key = loom_mix64(a.seed);  // the dropout key, as device/cpu derives it
    p.key0 = static_cast<uint32_t>(key);
    p.key1 = static_cast<uint32_t>(key >> 32);
    p.offset = a.offset;
    p.seed_device = a.seed_device;  // read by the kernel when it runs (a graph replay too)
    p.seed = a.seed;
  }
  check_launch(d, op, "elementwise kernel", k_elementwise(s.s, float_dt(op, "dtype", a.dtype), p));
}

// ---------------------------------------------------------------------------
// Reductions
// ---------------------------------------------------------------------------

void validate(const loom_reduce_args& a) {
  op_contract::check("device/cuda", a);
  if (a.op == LOOM_RED_ROW_ARGMAX)
    LOOM_REQUIRE(a.n / a.cols <= kMax32, "reduce(ROW_ARGMAX): rows must fit in 32 bits (one CUDA block per row)");
}

// The kernels' mirrors of ABI 1.8's segment structs.
static_assert(sizeof(AdamwSegment) == sizeof(loom_adamw_segment) &&
              offsetof(loom_adamw_segment, param_offset) == offsetof(AdamwSegment, param_offset) &&
              offsetof(loom_adamw_segment, state_offset) == offsetof(AdamwSegment, state_offset) &&
              offsetof(loom_adamw_segment, grad_offset) == offsetof(AdamwSegment, grad_offset) &&
              offsetof(loom_adamw_segment, copy_offset) == offsetof(AdamwSegment, copy_offset) &&
              offsetof(loom_adamw_segment, numel) == offsetof(AdamwSegment, numel) &&
              offsetof(loom_adamw_segment, weight_decay) == offsetof(AdamwSegment, weight_decay));
static_assert(sizeof(ReduceSegment) == sizeof(loom_reduce_segment) &&
              offsetof(loom_reduce_segment, offset) == offsetof(ReduceSegment, offset) &&
              offsetof(loom_reduce_segment, numel) == offsetof(ReduceSegment, numel));

void run_reduce(Device& d, Stream& s, const loom_reduce_args& a) {
  const Dt dt = float_dt("reduce", "dtype", a.dtype);
  if (const int64_t count = op_contract::num_segments(a); count > 0) {
    Scratch partial(d, s, static_cast<size_t>(count * multi_reduce_blocks()) * sizeof(double), "reduce(segments)");
    check_launch(d, "reduce(segments)", "multi-tensor reduce kernels",
                 k_reduce_multi(s.s, dt, a.op, count, reinterpret_cast<const ReduceSegment*>(a.segments), a.x,
                                partial.get<double>(), static_cast<float*>(a.out), a.accumulate));
    return;
  }
  if (a.op == LOOM_RED_ROW_ARGMAX) {
    const int64_t rows = a.n / a.cols, ld = a.ld > 0 ? a.ld : a.cols;
    check_launch(d, "reduce(ROW_ARGMAX)", "row_argmax kernel",
                 k_row_argmax(s.s, dt, rows, a.cols, ld, a.x, static_cast<int32_t*>(a.out)));
    return;
  }
  if (a.op == LOOM_RED_COLUMN_SUM) {
    const int64_t rows = a.n / a.cols, ld = a.ld > 0 ? a.ld : a.cols;
    Scratch partial(d, s, static_cast<size_t>(column_chunks(rows) * a.cols) * sizeof(double), "reduce(COLUMN_SUM)");
    check_launch(d, "reduce(COLUMN_SUM)", "column_sum kernels",
                 k_column_sum(s.s, dt, rows, a.cols, ld, a.x, partial.get<double>(), static_cast<float*>(a.out),
                              a.accumulate));
    return;
  }
  Scratch partial(d, s, static_cast<size_t>(reduce_blocks(a.n)) * sizeof(double), "reduce");
  check_launch(d, "reduce", "reduce kernels",
               k_reduce_scalar(s.s, dt, a.op, a.n, a.x, partial.get<double>(), static_cast<float*>(a.out),
                               a.accumulate));
}

// ---------------------------------------------------------------------------
// AdamW
// ---------------------------------------------------------------------------

void validate(const loom_adamw_args& a) {
  op_contract::check("device/cuda", a);
}

void run_adamw(Device& d, Stream& s, const loom_adamw_args& a) {
  AdamwParams p{};
  p.lr = a.lr;
  p.beta1 = a.beta1;
  p.beta2 = a.beta2;
  p.eps = a.eps;
  p.weight_decay = a.weight_decay;
  p.grad_scale = a.grad_scale;
  p.bias_correction1 = static_cast<float>(1.0 - std::pow(static_cast<double>(a.beta1), static_cast<double>(a.step)));
  p.bias_correction2 = static_cast<float>(1.0 - std::pow(static_cast<double>(a.beta2), static_cast<double>(a.step)));
  const Dt gdt = a.grad_dtype == LOOM_DTYPE_BF16 ? Dt::BF16 : Dt::F32;
  const Dt cdt = a.copy_dtype == LOOM_DTYPE_BF16 ? Dt::BF16 : Dt::F32;
  if (const int64_t count = op_contract::num_segments(a); count > 0) {
    check_launch(d, "adamw(segments)", "multi-tensor adamw kernel",
                 k_adamw_multi(s.s, count, reinterpret_cast<const AdamwSegment*>(a.segments), a.param, a.grad, gdt,
                               a.m, a.v, p, a.param_copy, cdt));
    return;
  }
  void* copy = a.param_copy == a.param && cdt == Dt::F32 ? nullptr : a.param_copy;  // in place: nothing to copy
  check_launch(d, "adamw", "adamw kernel", k_adamw(s.s, a.n, a.param, a.grad, gdt, a.m, a.v, p, copy, cdt));
}

}  // namespace loom::cuda
