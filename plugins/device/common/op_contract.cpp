#include "op_contract.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <sstream>
#include <string>

namespace loom::op_contract {

const char* dtype_name(int32_t dtype) {
  switch (dtype) {
    case LOOM_DTYPE_F32: return "f32";
    case LOOM_DTYPE_BF16: return "bf16";
    case LOOM_DTYPE_F16: return "f16";
    case LOOM_DTYPE_I32: return "i32";
    case LOOM_DTYPE_I64: return "i64";
    case LOOM_DTYPE_U8: return "u8";
    case LOOM_DTYPE_F64: return "f64";
    default: return "unknown";
  }
}

const char* ew_name(int32_t op) {
  switch (op) {
    case LOOM_EW_AXPBY: return "elementwise(AXPBY)";
    case LOOM_EW_ADD: return "elementwise(ADD)";
    case LOOM_EW_MUL: return "elementwise(MUL)";
    case LOOM_EW_SCALE: return "elementwise(SCALE)";
    case LOOM_EW_FILL: return "elementwise(FILL)";
    case LOOM_EW_CAST: return "elementwise(CAST)";
    case LOOM_EW_ADD_BIAS: return "elementwise(ADD_BIAS)";
    case LOOM_EW_DROPOUT: return "elementwise(DROPOUT)";
    case LOOM_EW_DROPOUT_BWD: return "elementwise(DROPOUT_BWD)";
    case LOOM_EW_MUL_COLS: return "elementwise(MUL_COLS)";
    default: return "elementwise(?)";
  }
}

void require_f32(const char* device, const char* op, const char* what, int32_t dtype) {
  if (dtype == LOOM_DTYPE_F32) return;
  std::ostringstream os;
  os << op << ": " << what << " " << dtype_name(dtype) << " (" << dtype << ") is not supported by " << device
     << " (f32 only)";
  throw Error(os.str(), LOOM_CODE_UNSUPPORTED);
}

void require_float(const char* device, const char* op, const char* what, int32_t dtype) {
  if (dtype == LOOM_DTYPE_F32 || dtype == LOOM_DTYPE_BF16) return;
  std::ostringstream os;
  os << op << ": " << what << " " << dtype_name(dtype) << " (" << dtype << ") is not supported by " << device
     << " (f32 and bf16 storage, fp32 math)";
  throw Error(os.str(), LOOM_CODE_UNSUPPORTED);
}

namespace {
template <typename Args>
int32_t grad_dtype_of(const Args& a, const char* op) {
  if (a.struct_size < offsetof(Args, grad_fp32) + sizeof(a.grad_fp32)) return a.dtype;
  LOOM_REQUIRE(a.grad_fp32 == 0 || a.grad_fp32 == 1, op << ": grad_fp32 must be 0 or 1 (got " << a.grad_fp32 << ")");
  return a.grad_fp32 ? LOOM_DTYPE_F32 : a.dtype;
}
}  // namespace

int32_t grad_dtype(const loom_layernorm_bwd_args& a) { return grad_dtype_of(a, "layernorm_bwd"); }
int32_t grad_dtype(const loom_embedding_args& a) { return grad_dtype_of(a, "embedding_bwd"); }
int32_t grad_dtype(const loom_rmsnorm_bwd_args& a) { return grad_dtype_of(a, "rmsnorm_bwd"); }

namespace {

// ABI 1.11's epilogue members (all zero from an older caller).
void check_epilogue(const loom_gemm_args& g) {
  const int32_t e = g.epilogue;
  LOOM_REQUIRE(e >= LOOM_GEMM_EPILOGUE_NONE && e <= LOOM_GEMM_EPILOGUE_BIAS_GRAD,
               "gemm: epilogue " << e << " is not a LOOM_GEMM_EPILOGUE_* value");
  if (e == LOOM_GEMM_EPILOGUE_NONE) {
    LOOM_REQUIRE(g.bias == nullptr && g.aux == nullptr,
                 "gemm: bias and aux are read only with an epilogue (epilogue is NONE)");
    return;
  }
  LOOM_REQUIRE(g.batch == 1, "gemm: an epilogue needs batch 1 (got batch=" << g.batch << ")");
  if (e == LOOM_GEMM_EPILOGUE_BIAS) {
    LOOM_REQUIRE(g.bias != nullptr || g.n == 0 || g.m == 0, "gemm: epilogue BIAS needs a bias");
    LOOM_REQUIRE(g.aux == nullptr, "gemm: epilogue BIAS reads no aux");
  }
  if (e == LOOM_GEMM_EPILOGUE_GELU_AUX || e == LOOM_GEMM_EPILOGUE_DGELU) {
    LOOM_REQUIRE(g.aux != nullptr || g.m == 0 || g.n == 0,
                 "gemm: epilogue " << (e == LOOM_GEMM_EPILOGUE_DGELU ? "DGELU" : "GELU_AUX") << " needs aux");
    LOOM_REQUIRE(g.ldaux >= std::max<int64_t>(1, g.n), "gemm: ldaux=" << g.ldaux << " is smaller than n=" << g.n);
  }
  if (e == LOOM_GEMM_EPILOGUE_BIAS_GRAD)
    LOOM_REQUIRE(g.aux != nullptr && g.bias == nullptr && g.trans_b == 0,
                 "gemm: epilogue BIAS_GRAD needs aux (the bias gradient), no bias and trans_b 0");
  if (e == LOOM_GEMM_EPILOGUE_DGELU)
    LOOM_REQUIRE(g.beta == 0.0f && g.bias == nullptr, "gemm: epilogue DGELU takes no bias and beta 0 (got beta="
                                                          << g.beta << (g.bias ? ", a bias" : "") << ")");
}

}  // namespace

loom_reduce_args bias_grad_sums(const loom_gemm_args& g) {
  loom_reduce_args r = loom::make<loom_reduce_args>();
  r.op = LOOM_RED_COLUMN_SUM;
  r.n = g.k * g.n;
  r.cols = g.n;
  r.ld = g.ldb;
  r.x = g.b;
  r.dtype = g.dtype;
  r.out_dtype = LOOM_DTYPE_F32;
  return r;
}

void check(const char* device, const loom_gemm_args& g) {
  require_float(device, "gemm", "dtype", g.dtype);
  require_float(device, "gemm", "c_dtype", g.c_dtype);
  LOOM_REQUIRE((g.trans_a == 0 || g.trans_a == 1) && (g.trans_b == 0 || g.trans_b == 1),
               "gemm: trans_a/trans_b must be 0 or 1 (got " << g.trans_a << ", " << g.trans_b << ")");
  LOOM_REQUIRE(g.m >= 0 && g.n >= 0 && g.k >= 0 && g.batch >= 1,
               "gemm: m, n, k must be >= 0 and batch >= 1 (got m=" << g.m << " n=" << g.n << " k=" << g.k
                                                                   << " batch=" << g.batch << ")");
  const int64_t a_cols = g.trans_a ? g.m : g.k, b_cols = g.trans_b ? g.k : g.n;
  LOOM_REQUIRE(g.lda >= std::max<int64_t>(1, a_cols),
               "gemm: lda=" << g.lda << " is smaller than the " << a_cols << " columns of the stored A");
  LOOM_REQUIRE(g.ldb >= std::max<int64_t>(1, b_cols),
               "gemm: ldb=" << g.ldb << " is smaller than the " << b_cols << " columns of the stored B");
  LOOM_REQUIRE(g.ldc >= std::max<int64_t>(1, g.n), "gemm: ldc=" << g.ldc << " is smaller than n=" << g.n);
  // bf16 C accumulates through an fp32 copy of the region the batch spans.
  if (g.c_dtype == LOOM_DTYPE_BF16 && g.batch > 1)
    LOOM_REQUIRE(g.stride_c >= 0, "gemm: stride_c=" << g.stride_c << " must be >= 0 when c_dtype is bf16");
  if (g.m > 0 && g.n > 0) {
    LOOM_REQUIRE(g.c != nullptr, "gemm: c is NULL");
    LOOM_REQUIRE(g.k == 0 || (g.a != nullptr && g.b != nullptr), "gemm: a or b is NULL");
  }
  check_epilogue(g);
}

void check(const char* device, const loom_layernorm_fwd_args& a) {
  require_float(device, "layernorm_fwd", "dtype", a.dtype);
  LOOM_REQUIRE(a.rows >= 0 && a.cols > 0,
               "layernorm_fwd: rows must be >= 0 and cols > 0 (got rows=" << a.rows << " cols=" << a.cols << ")");
  LOOM_REQUIRE(a.rows == 0 || (a.x && a.y), "layernorm_fwd: x and y must not be NULL");
  LOOM_REQUIRE(a.eps >= 0.0f, "layernorm_fwd: eps must be >= 0 (got " << a.eps << ")");
}

void check(const char* device, const loom_layernorm_bwd_args& a) {
  require_float(device, "layernorm_bwd", "dtype", a.dtype);
  LOOM_REQUIRE(a.rows >= 0 && a.cols > 0,
               "layernorm_bwd: rows must be >= 0 and cols > 0 (got rows=" << a.rows << " cols=" << a.cols << ")");
  LOOM_REQUIRE(a.rows == 0 || (a.dy && a.x && a.mean && a.rstd),
               "layernorm_bwd: dy, x, mean and rstd must not be NULL");
  grad_dtype(a);  // validates grad_fp32
}

void check(const char* device, const loom_gelu_args& a, bool backward) {
  const char* op = backward ? "gelu_bwd" : "gelu_fwd";
  require_float(device, op, "dtype", a.dtype);
  LOOM_REQUIRE(a.n >= 0, op << ": n must be >= 0 (got " << a.n << ")");
  LOOM_REQUIRE(a.n == 0 || (a.x && a.out && (!backward || a.dy)),
               op << ": x, out" << (backward ? " and dy" : "") << " must not be NULL");
}

loom_attention_args resolved(const loom_attention_args& a) {
  loom_attention_args r = a;
  if (r.kv_seq == 0) {
    r.kv_seq = r.seq;
    r.q_offset = 0;
    r.kv_stride_b = r.qkv_stride_b;
    r.kv_stride_s = r.qkv_stride_s;
  }
  return r;
}

void check(const char* device, const loom_attention_args& args, bool backward) {
  const char* op = backward ? "attention_bwd" : "attention_fwd";
  const loom_attention_args a = resolved(args);
  require_float(device, op, "dtype", a.dtype);
  LOOM_REQUIRE(a.batch >= 0 && a.seq >= 0 && a.heads >= 0 && a.head_dim >= 0,
               op << ": batch, seq, heads, head_dim must be >= 0");
  LOOM_REQUIRE(a.kv_seq >= 0 && a.q_offset >= 0, op << ": kv_seq (" << a.kv_seq << ") and q_offset (" << a.q_offset
                                                     << ") must be >= 0");
  LOOM_REQUIRE(a.window >= 0, op << ": window must be >= 0 (got " << a.window << "; 0 = every earlier key)");
  LOOM_REQUIRE(a.window == 0 || a.causal,
               op << ": window = " << a.window << " slides over the earlier keys of causal attention; causal is 0");
  LOOM_REQUIRE(a.key_start == nullptr || a.causal,
               op << ": key_start bounds the earlier keys of causal attention (documents); causal is 0");
  if (a.batch == 0 || a.seq == 0 || a.heads == 0 || a.head_dim == 0) return;
  LOOM_REQUIRE(!a.causal || a.q_offset + a.seq <= a.kv_seq,
               op << ": the query window [q_offset, q_offset + seq) = [" << a.q_offset << ", " << a.q_offset + a.seq
                  << ") must lie inside the kv_seq = " << a.kv_seq << " keys of causal attention");
  const int64_t width = a.heads * a.head_dim;
  LOOM_REQUIRE(a.qkv_stride_s >= width && a.out_stride_s >= width && a.kv_stride_s >= width,
               op << ": qkv_stride_s (" << a.qkv_stride_s << "), kv_stride_s (" << a.kv_stride_s
                  << ") and out_stride_s (" << a.out_stride_s << ") must be >= heads*head_dim = " << width);
  LOOM_REQUIRE(a.batch == 1 || (a.qkv_stride_b >= width && a.out_stride_b >= width && a.kv_stride_b >= width),
               op << ": qkv_stride_b, kv_stride_b and out_stride_b must be >= heads*head_dim = " << width);
  LOOM_REQUIRE(a.q && a.k && a.v && a.out, op << ": q, k, v and out must not be NULL");
  if (backward)
    LOOM_REQUIRE(a.lse && a.dout && a.dq && a.dk && a.dv, op << ": lse, dout, dq, dk and dv must not be NULL");
}

void check(const char* device, const loom_xent_args& a) {
  require_float(device, "xent", "dtype", a.dtype);
  LOOM_REQUIRE(a.step >= LOOM_XENT_ROW_MAX && a.step <= LOOM_XENT_BACKWARD,
               "xent: unknown step " << a.step << " (expected LOOM_XENT_ROW_MAX..LOOM_XENT_BACKWARD)");
  LOOM_REQUIRE(a.rows >= 0 && a.cols >= 0, "xent: rows and cols must be >= 0");
  LOOM_REQUIRE(a.ld >= a.cols, "xent: ld=" << a.ld << " is smaller than cols=" << a.cols);
  LOOM_REQUIRE(a.vocab_start >= 0, "xent: vocab_start must be >= 0 (got " << a.vocab_start << ")");
  if (a.rows == 0) return;
  switch (a.step) {
    case LOOM_XENT_ROW_MAX:
      LOOM_REQUIRE(a.row_max && (a.cols == 0 || a.logits), "xent(ROW_MAX): logits and row_max must not be NULL");
      break;
    case LOOM_XENT_SUMEXP:
      LOOM_REQUIRE(a.row_max && a.row_sumexp && (a.cols == 0 || a.logits),
                   "xent(SUMEXP): logits, row_max and row_sumexp must not be NULL");
      LOOM_REQUIRE(a.target_logit == nullptr || a.targets,
                   "xent(SUMEXP): targets must not be NULL when target_logit is set");
      break;
    case LOOM_XENT_LOSS:
      LOOM_REQUIRE(a.targets && a.row_max && a.row_sumexp && a.target_logit && a.loss,
                   "xent(LOSS): targets, row_max, row_sumexp, target_logit and loss must not be NULL");
      break;
    case LOOM_XENT_BACKWARD:
      LOOM_REQUIRE(a.targets && a.row_max && a.row_sumexp && (a.cols == 0 || (a.logits && a.dlogits)),
                   "xent(BACKWARD): logits, targets, row_max, row_sumexp and dlogits must not be NULL");
      break;
  }
}

void check(const char* device, const loom_embedding_args& a, bool backward) {
  const char* op = backward ? "embedding_bwd" : "embedding_fwd";
  require_float(device, op, "dtype", a.dtype);
  LOOM_REQUIRE(a.n >= 0 && a.dim > 0 && a.vocab_rows >= 0 && a.vocab_start >= 0,
               op << ": n, vocab_rows, vocab_start must be >= 0 and dim > 0");
  if (a.n == 0) return;
  if (backward) {
    LOOM_REQUIRE(a.ids && a.dout && (a.vocab_rows == 0 || a.dtable), op << ": ids, dout and dtable must not be NULL");
    grad_dtype(a);  // validates grad_fp32
  } else {
    LOOM_REQUIRE(a.ids && a.out && (a.vocab_rows == 0 || a.table), op << ": ids, table and out must not be NULL");
  }
}

void check(const char* device, const loom_elementwise_args& a) {
  LOOM_REQUIRE(a.op >= LOOM_EW_AXPBY && a.op <= LOOM_EW_MUL_COLS,
               "elementwise: unknown op " << a.op << " (expected LOOM_EW_AXPBY..LOOM_EW_MUL_COLS)");
  const char* op = ew_name(a.op);
  LOOM_REQUIRE(a.n >= 0, op << ": n must be >= 0 (got " << a.n << ")");
  if (a.op == LOOM_EW_CAST) {
    const bool ok = (a.dtype == LOOM_DTYPE_F32 || a.dtype == LOOM_DTYPE_BF16) &&
                    (a.out_dtype == LOOM_DTYPE_F32 || a.out_dtype == LOOM_DTYPE_BF16);
    if (!ok)
      throw Error(std::string(op) + ": cast " + dtype_name(a.dtype) + " -> " + dtype_name(a.out_dtype) +
                      " is not supported by " + std::string(device) + " (f32 <-> bf16 only)",
                  LOOM_CODE_UNSUPPORTED);
  } else {
    require_float(device, op, "dtype", a.dtype);  // x, y (not the dropout mask) and out; out_dtype is CAST's only
  }
  if (a.n == 0) return;
  switch (a.op) {
    case LOOM_EW_AXPBY:
      LOOM_REQUIRE(a.x && a.y, op << ": x and y must not be NULL");
      break;
    case LOOM_EW_ADD:
    case LOOM_EW_MUL:
      LOOM_REQUIRE(a.x && a.y && a.out, op << ": x, y and out must not be NULL");
      break;
    case LOOM_EW_SCALE:
    case LOOM_EW_CAST:
      LOOM_REQUIRE(a.x && a.out, op << ": x and out must not be NULL");
      break;
    case LOOM_EW_FILL:
      LOOM_REQUIRE(a.out, op << ": out must not be NULL");
      break;
    case LOOM_EW_ADD_BIAS:
    case LOOM_EW_MUL_COLS:
      LOOM_REQUIRE(a.x && a.y && a.out, op << ": x, y (the per-column vector) and out must not be NULL");
      LOOM_REQUIRE(a.cols > 0 && a.n % a.cols == 0,
                   op << ": n=" << a.n << " must be a multiple of cols=" << a.cols << " (> 0)");
      break;
    case LOOM_EW_DROPOUT:
    case LOOM_EW_DROPOUT_BWD:
      LOOM_REQUIRE(a.x && a.y && a.out, op << ": x, y (the u8 mask) and out must not be NULL");
      LOOM_REQUIRE(a.p >= 0.0f && a.p <= 1.0f, op << ": p must be in [0, 1] (got " << a.p << ")");
      break;
  }
}

int64_t num_segments(const loom_reduce_args& a) {
  return a.struct_size >= offsetof(loom_reduce_args, segments) + sizeof(a.segments) ? a.num_segments : 0;
}

int64_t num_segments(const loom_adamw_args& a) {
  return a.struct_size >= offsetof(loom_adamw_args, segments) + sizeof(a.segments) ? a.num_segments : 0;
}

void check(const char* device, const loom_reduce_args& a) {
  LOOM_REQUIRE(a.op >= LOOM_RED_SUM && a.op <= LOOM_RED_ROW_ARGMAX,
               "reduce: unknown op " << a.op << " (expected LOOM_RED_SUM..LOOM_RED_ROW_ARGMAX)");
  const int64_t segments = num_segments(a);
  LOOM_REQUIRE(segments >= 0, "reduce: num_segments must be >= 0 (got " << segments << ")");
  if (segments > 0) {
    LOOM_REQUIRE(a.op == LOOM_RED_SUM || a.op == LOOM_RED_SUM_SQUARES || a.op == LOOM_RED_MAX_ABS,
                 "reduce: segments are for SUM, SUM_SQUARES and MAX_ABS (got op " << a.op << ")");
    LOOM_REQUIRE(a.segments && a.x && a.out, "reduce: with num_segments = " << segments
                                                  << ", segments, x and out must not be NULL");
    require_float(device, "reduce", "dtype", a.dtype);
    require_f32(device, "reduce", "out_dtype", a.out_dtype);
    return;
  }
  require_float(device, "reduce", "dtype", a.dtype);
  if (a.op == LOOM_RED_ROW_ARGMAX)
    LOOM_REQUIRE(a.out_dtype == LOOM_DTYPE_I32, "reduce(ROW_ARGMAX): out_dtype must be I32 (the column index)");
  else
    require_f32(device, "reduce", "out_dtype", a.out_dtype);
  if (a.op == LOOM_RED_COLUMN_SUM || a.op == LOOM_RED_ROW_ARGMAX)
    LOOM_REQUIRE(a.ld == 0 || a.ld >= a.cols, "reduce: ld=" << a.ld << " must be 0 or >= cols=" << a.cols);
  if (a.op == LOOM_RED_ROW_ARGMAX)
    LOOM_REQUIRE(a.cols > 0 && a.n % a.cols == 0,
                 "reduce(ROW_ARGMAX): n=" << a.n << " must be a multiple of cols=" << a.cols << " (> 0)");
  LOOM_REQUIRE(a.n >= 0, "reduce: n must be >= 0 (got " << a.n << ")");
  LOOM_REQUIRE(a.out, "reduce: out must not be NULL");
  LOOM_REQUIRE(a.n == 0 || a.x, "reduce: x must not be NULL");
  if (a.op == LOOM_RED_COLUMN_SUM)
    LOOM_REQUIRE(a.cols > 0 && a.n % a.cols == 0,
                 "reduce(COLUMN_SUM): n=" << a.n << " must be a multiple of cols=" << a.cols << " (> 0)");
}

void check(const char* device, const loom_adamw_args& a) {
  LOOM_REQUIRE(a.grad_dtype == LOOM_DTYPE_F32 || a.grad_dtype == LOOM_DTYPE_BF16,
               "adamw: grad_dtype " << dtype_name(a.grad_dtype) << " is not supported by " << device << " (f32, bf16)");
  const int64_t segments = num_segments(a);
  LOOM_REQUIRE(segments >= 0, "adamw: num_segments must be >= 0 (got " << segments << ")");
  if (segments > 0) {
    LOOM_REQUIRE(a.step >= 1, "adamw: step is 1-based (got " << a.step << ")");
    LOOM_REQUIRE(a.segments && a.param && a.grad && a.m && a.v,
                 "adamw: with num_segments = " << segments << ", segments, param, grad, m and v must not be NULL");
    if (a.param_copy)
      LOOM_REQUIRE(a.copy_dtype == LOOM_DTYPE_F32 || a.copy_dtype == LOOM_DTYPE_BF16,
                   "adamw: copy_dtype " << dtype_name(a.copy_dtype) << " is not supported by " << device
                                        << " (f32, bf16)");
    return;
  }
  LOOM_REQUIRE(a.n >= 0, "adamw: n must be >= 0 (got " << a.n << ")");
  LOOM_REQUIRE(a.step >= 1, "adamw: step is 1-based (got " << a.step << ")");
  LOOM_REQUIRE(a.n == 0 || (a.param && a.grad && a.m && a.v), "adamw: param, grad, m and v must not be NULL");
  if (a.param_copy)
    LOOM_REQUIRE(a.copy_dtype == LOOM_DTYPE_F32 || a.copy_dtype == LOOM_DTYPE_BF16,
                 "adamw: copy_dtype " << dtype_name(a.copy_dtype) << " is not supported by " << device << " (f32, bf16)");
}

void check(const char* device, const loom_rmsnorm_fwd_args& a) {
  require_float(device, "rmsnorm_fwd", "dtype", a.dtype);
  LOOM_REQUIRE(a.rows >= 0 && a.cols > 0,
               "rmsnorm_fwd: rows must be >= 0 and cols > 0 (got rows=" << a.rows << " cols=" << a.cols << ")");
  LOOM_REQUIRE(a.rows == 0 || (a.x && a.gamma && a.y), "rmsnorm_fwd: x, gamma and y must not be NULL");
  LOOM_REQUIRE(a.eps >= 0.0f, "rmsnorm_fwd: eps must be >= 0 (got " << a.eps << ")");
}

void check(const char* device, const loom_rmsnorm_bwd_args& a) {
  require_float(device, "rmsnorm_bwd", "dtype", a.dtype);
  LOOM_REQUIRE(a.rows >= 0 && a.cols > 0,
               "rmsnorm_bwd: rows must be >= 0 and cols > 0 (got rows=" << a.rows << " cols=" << a.cols << ")");
  LOOM_REQUIRE(a.rows == 0 || (a.dy && a.x && a.gamma && a.rstd),
               "rmsnorm_bwd: dy, x, gamma and rstd must not be NULL");
  LOOM_REQUIRE(a.accumulate_dx == 0 || a.accumulate_dx == 1,
               "rmsnorm_bwd: accumulate_dx must be 0 or 1 (got " << a.accumulate_dx << ")");
  grad_dtype(a);  // validates grad_fp32
}

void check(const char* device, const loom_swiglu_args& a, bool backward) {
  const char* op = backward ? "swiglu_bwd" : "swiglu_fwd";
  require_float(device, op, "dtype", a.dtype);
  LOOM_REQUIRE(a.rows >= 0 && a.cols >= 0, op << ": rows and cols must be >= 0 (got rows=" << a.rows << " cols="
                                              << a.cols << ")");
  LOOM_REQUIRE(a.rows == 0 || a.cols == 0 || (a.x && a.out && (!backward || a.dy)),
               op << ": x, out" << (backward ? " and dy" : "") << " must not be NULL");
}

void check(const char* device, const loom_rope_args& a, bool backward) {
  const char* op = backward ? "rope_bwd" : "rope_fwd";
  require_float(device, op, "dtype", a.dtype);
  LOOM_REQUIRE(a.tokens >= 0 && a.heads >= 0 && a.head_dim >= 0, op << ": tokens, heads and head_dim must be >= 0");
  LOOM_REQUIRE(a.rotary_dim >= 0 && a.rotary_dim % 2 == 0 && a.rotary_dim <= a.head_dim,
               op << ": rotary_dim (" << a.rotary_dim << ") must be even and at most head_dim (" << a.head_dim << ")");
  LOOM_REQUIRE(a.stride_t >= a.heads * a.head_dim,
               op << ": stride_t (" << a.stride_t << ") is smaller than heads * head_dim (" << a.heads * a.head_dim
                  << ")");
  LOOM_REQUIRE(std::isfinite(a.theta) && a.theta > 0.0f, op << ": theta must be positive (got " << a.theta << ")");
  LOOM_REQUIRE(a.tokens == 0 || a.heads == 0 || a.head_dim == 0 || (a.x && a.out && a.positions),
               op << ": x, out and positions must not be NULL");
}

void check(const char* device, const loom_activation_args& a, const char* op, bool backward) {
  require_float(device, op, "dtype", a.dtype);
  LOOM_REQUIRE(a.n >= 0, op << ": n must be >= 0 (got " << a.n << ")");
  LOOM_REQUIRE(a.n == 0 || (a.x && a.out && (!backward || a.dy)),
               op << ": x, out" << (backward ? " and dy" : "") << " must not be NULL");
}

}  // namespace loom::op_contract
