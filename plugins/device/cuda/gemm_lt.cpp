// device/cuda: GEMMs with an epilogue (ABI 1.11) on cuBLASLt. The row-major
// problem C[m, n] = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, as in
// ops.cpp's cuBLAS calls: cuBLASLt's "A" is loom's B, its "B" loom's A, and its D
// has n rows, so the bias (one value per row of D) is loom's per-column bias and
// the aux matrix is loom's [m, n] with ldaux. The epilogues used: BIAS,
// GELU_AUX(_BIAS) (the GeLU input stored to aux), DGELU (aux read), computed in fp32
// and stored once in C's type, and BGRADA (loom's BIAS_GRAD: the sums over k of
// loom's B written to the bias pointer, which the caller points at fp32 scratch).
//
// The algorithm cuBLASLt's heuristic picks for a shape is cached per device (the
// heuristic call costs far more than the matmul's launch). The heuristic sees no
// pointers: each operand's actual alignment goes to it as a preference (it assumes
// 256 bytes otherwise) and into the key.
#include <cublasLt.h>

#include <cstring>
#include <utility>

#include "cuda_device.hpp"

namespace loom::cuda {

namespace {

cudaDataType_t lt_type(Dt dt) { return dt == Dt::F32 ? CUDA_R_32F : CUDA_R_16BF; }

// Owns the cuBLASLt descriptors of one call.
struct LtCall {
  Device& d;
  const char* op;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  LtCall(Device& dev, const char* o) : d(dev), op(o) {}
  ~LtCall() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
  LtCall(const LtCall&) = delete;
  LtCall& operator=(const LtCall&) = delete;
  template <typename T>
  void set(cublasLtMatmulDescAttributes_t attr, const T& value) {
    LOOM_CUBLAS(&d, op, cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
  }
};

cublasLtEpilogue_t lt_epilogue(const loom_gemm_args& g) {
  switch (g.epilogue) {
    case LOOM_GEMM_EPILOGUE_BIAS: return CUBLASLT_EPILOGUE_BIAS;
    case LOOM_GEMM_EPILOGUE_GELU_AUX: return g.bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    case LOOM_GEMM_EPILOGUE_DGELU: return CUBLASLT_EPILOGUE_DGELU;
    // The reduction over k of cuBLASLt's A, which is loom's B (see above).
    case LOOM_GEMM_EPILOGUE_BIAS_GRAD: return CUBLASLT_EPILOGUE_BGRADA;
    default: return CUBLASLT_EPILOGUE_DEFAULT;
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// The largest power of two, at most 256, that divides the address.
uint32_t alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && (a & (align - 1)) != 0) align >>= 1;
  return align;
}

}  // namespace

bool lt_gemm_epilogue(Device& d, Stream& st, const loom_gemm_args& g, Dt ab, Dt cd, void* workspace,
                      size_t workspace_bytes) {
  if (d.cublaslt == nullptr || !d.gemm_epilogues) return false;
  if (g.batch != 1 || g.k <= 0 || g.alpha == 0.0f || (ab == Dt::F32 && cd == Dt::BF16)) return false;
  const bool has_aux = g.epilogue == LOOM_GEMM_EPILOGUE_GELU_AUX || g.epilogue == LOOM_GEMM_EPILOGUE_DGELU;
  // cuBLASLt's rules for the aux matrix; 16-byte operands keep the fast kernels.
  if (has_aux && (g.ldaux % 8 != 0 || !aligned16(g.aux))) return false;
  if ((g.bias && !aligned16(g.bias)) || !aligned16(g.c)) return false;
  const bool ta = g.trans_a != 0, tb = g.trans_b != 0;
  const int64_t m = g.m, n = g.n, k = g.k;
  const cublasComputeType_t compute =
      ab == Dt::F32 ? (d.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F) : CUBLAS_COMPUTE_32F;

  LtCall call(d, "gemm");
  LOOM_CUBLAS(&d, "gemm", cublasLtMatmulDescCreate(&call.desc, compute, CUDA_R_32F));
  const cublasOperation_t op_a = tb ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  call.set(CUBLASLT_MATMUL_DESC_TRANSA, op_a);
  call.set(CUBLASLT_MATMUL_DESC_TRANSB, op_b);
  call.set(CUBLASLT_MATMUL_DESC_EPILOGUE, lt_epilogue(g));
  if (g.bias) call.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
  if (has_aux) {
    call.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);
    call.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.ldaux);
  }
  // cuBLASLt's A = loom's B (n x k as op'd), its B = loom's A (k x m), D = C^T (n x m).
  LOOM_CUBLAS(&d, "gemm",
              cublasLtMatrixLayoutCreate(&call.a, lt_type(ab), tb ? k : n, tb ? n : k, g.ldb));
  LOOM_CUBLAS(&d, "gemm",
              cublasLtMatrixLayoutCreate(&call.b, lt_type(ab), ta ? m : k, ta ? k : m, g.lda));
  LOOM_CUBLAS(&d, "gemm", cublasLtMatrixLayoutCreate(&call.c, lt_type(cd), n, m, g.ldc));

  // cuBLASLt's A is loom's b, its B loom's a; C and D are loom's c.
  const uint32_t align_a = alignment(g.b), align_b = alignment(g.a), align_c = alignment(g.c);
  const LtKey key{m, n, k, g.lda, g.ldb, g.ldc, g.ldaux, static_cast<int32_t>(ta) | (static_cast<int32_t>(tb) << 1),
                  static_cast<int32_t>(ab) | (static_cast<int32_t>(cd) << 2) | (static_cast<int32_t>(d.tf32) << 4),
                  static_cast<int32_t>(lt_epilogue(g)),
                  static_cast<int64_t>(align_a) | (static_cast<int64_t>(align_b) << 16) |
                      (static_cast<int64_t>(align_c) << 32),
                  static_cast<int64_t>(workspace_bytes)};
  cublasLtMatmulAlgo_t algo;
  auto it = d.lt_algos.find(key);
  if (it != d.lt_algos.end()) {
    if (!it->second.found) return false;
    algo = it->second.algo;
  } else {
    LOOM_CUBLAS(&d, "gemm", cublasLtMatmulPreferenceCreate(&call.pref));
    const uint64_t ws = workspace_bytes;
    LOOM_CUBLAS(&d, "gemm", cublasLtMatmulPreferenceSetAttribute(call.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                                   &ws, sizeof(ws)));
    for (const auto& [attr, align] : {std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a},
                                      std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b},
                                      std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c},
                                      std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_c}})
      LOOM_CUBLAS(&d, "gemm", cublasLtMatmulPreferenceSetAttribute(call.pref, attr, &align, sizeof(align)));
    cublasLtMatmulHeuristicResult_t result;
    std::memset(&result, 0, sizeof(result));
    int found = 0;
    const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(d.cublaslt, call.desc, call.a, call.b, call.c, call.c,
                                                             call.pref, 1, &result, &found);
    LtAlgo entry;
    entry.found = hs == CUBLAS_STATUS_SUCCESS && found > 0;
    if (entry.found) entry.algo = result.algo;
    d.lt_algos.emplace(key, entry);
    if (!entry.found) {  // no kernel for this case: the unfused ops do it (said once per problem)
      LOOM_LOG(INFO) << d.who() << ": cuBLASLt has no kernel for GEMM epilogue " << g.epilogue << " (m " << m
                     << ", n " << n << ", k " << k << ", trans " << ta << tb << "): it runs unfused";
      return false;
    }
    algo = result.algo;
  }
  const float alpha = g.alpha, beta = g.beta;
  LOOM_CUBLAS(&d, "gemm",
              cublasLtMatmul(d.cublaslt, call.desc, &alpha, g.b, call.a, g.a, call.b, &beta, g.c, call.c, g.c, call.c,
                             &algo, workspace, workspace_bytes, st.s));
  return true;
}

}  // namespace loom::cuda
