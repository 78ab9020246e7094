// GEMM: OpenBLAS loaded at run time (so OPENBLAS_CORETYPE can be arranged before it
// initialises), a portable blocked fallback, and the batched/parallel driver.
//
// Threads: OpenBLAS runs single-threaded per call (openblas_set_num_threads(1),
// process-wide, set once, and OPENBLAS_NUM_THREADS=1 before it loads so its thread
// server never starts), and the device's own pool (num_threads of the rank)
// parallelises everything: GEMMs are cut into panels of C (and batch elements),
// each one single-threaded sgemm. So there is exactly one pool per rank, whose
// idle workers sleep in futex waits: no OpenBLAS threads spin against ours, ranks
// sharing a process do not queue on OpenBLAS's global server lock, and results
// do not depend on the thread count (see Device::gemm). Measured on a 2-core
// AMD EPYC dev VM (AVX2 only, OpenBLAS core "Zen"), sgemm 512x512x512: 1 thread
// 76 GFLOP/s; 2 threads 143 GFLOP/s through this pool vs 145 with OpenBLAS's own
// 2-thread server, i.e. nothing is lost by keeping a single pool.
#include <dlfcn.h>

#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "cpu_device.hpp"
#include "cpu_math.hpp"

namespace loom::cpu {
namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

OpenBlas load_openblas() {
  OpenBlas r;
  const char* const names[] = {"libopenblas.so.0", "libopenblas.so"};
  bool already_loaded = false;
  for (const char* name : names) {
    if (void* h = dlopen(name, RTLD_NOW | RTLD_NOLOAD)) {
      already_loaded = true;
      dlclose(h);
    }
  }
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f");
#else
  const bool avx512 = false;
#endif
  const char* user_coretype = std::getenv("OPENBLAS_CORETYPE");  // respected: the user chose it
  if (!already_loaded) {
    // Debian's OpenBLAS 0.3.21 takes Zen 4/5 for Haswell (AVX2 kernels at half the
    // speed) unless told otherwise before it initialises.
    if (avx512 && std::getenv("OPENBLAS_CORETYPE") == nullptr) setenv("OPENBLAS_CORETYPE", "SkylakeX", 0);
    // We never use OpenBLAS's own thread server (see above): do not even start it.
    if (std::getenv("OPENBLAS_NUM_THREADS") == nullptr) setenv("OPENBLAS_NUM_THREADS", "1", 0);
  }
  void* handle = nullptr;
  std::string errors;
  for (const char* name : names) {
    handle = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (handle) break;
    const char* e = dlerror();
    errors += std::string(errors.empty() ? "" : "; ") + (e ? e : name);
  }
  if (handle == nullptr) {
    r.error = "cannot load OpenBLAS (" + errors + ")";
    return r;
  }
  r.sgemm = reinterpret_cast<SgemmFn>(dlsym(handle, "cblas_sgemm"));
  if (r.sgemm == nullptr) {
    r.error = "libopenblas has no cblas_sgemm";
    return r;
  }
  if (auto set_threads = reinterpret_cast<void (*)(int)>(dlsym(handle, "openblas_set_num_threads"))) set_threads(1);
  if (auto corename = reinterpret_cast<char* (*)()>(dlsym(handle, "openblas_get_corename"))) {
    const char* c = corename();
    r.corename = c ? c : "?";
  }
  r.avx512_but_not_used = avx512 && r.corename.find("Skylake") == std::string::npos && r.corename != "Cooperlake" &&
                          r.corename != "SapphireRapids";
  if (already_loaded) r.why_not = "it was loaded before device/cpu could set OPENBLAS_CORETYPE";
  else if (user_coretype != nullptr) r.why_not = "the environment sets OPENBLAS_CORETYPE=" + std::string(user_coretype);
  else r.why_not = "its CPU detection chose them";
  r.loaded = true;
  return r;
}

}  // namespace

const OpenBlas& openblas() {
  static OpenBlas* ob = nullptr;
  static std::once_flag once;
  std::call_once(once, [] { ob = new OpenBlas(load_openblas()); });
  return *ob;
}

// Blocked kernel: for each block of 256 columns of C, an accumulator for all rows;
// op(B) is packed per (k-block, column block) and op(A) per (row block, k-block),
// so the inner loop is a contiguous axpy the compiler vectorises.
void builtin_sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                   int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  constexpr int64_t MB = 64, NB = 256, KB = 128;
  thread_local std::vector<float> apack, bpack, acc;
  apack.resize(MB * KB);
  bpack.resize(KB * NB);
  for (int64_t j0 = 0; j0 < n; j0 += NB) {
    const int64_t nb = std::min(NB, n - j0);
    acc.assign(static_cast<size_t>(m * nb), 0.0f);
    for (int64_t p0 = 0; p0 < k; p0 += KB) {
      const int64_t kb = std::min(KB, k - p0);
      for (int64_t p = 0; p < kb; ++p)
        for (int64_t j = 0; j < nb; ++j)
          bpack[p * nb + j] = trans_b ? b[(j0 + j) * ldb + (p0 + p)] : b[(p0 + p) * ldb + (j0 + j)];
      for (int64_t i0 = 0; i0 < m; i0 += MB) {
        const int64_t mb = std::min(MB, m - i0);
        for (int64_t i = 0; i < mb; ++i)
          for (int64_t p = 0; p < kb; ++p)
            apack[i * kb + p] = trans_a ? a[(p0 + p) * lda + (i0 + i)] : a[(i0 + i) * lda + (p0 + p)];
        for (int64_t i = 0; i < mb; ++i) {
          float* ci = acc.data() + (i0 + i) * nb;
          for (int64_t p = 0; p < kb; ++p) {
            const float av = apack[i * kb + p];
            const float* bp = bpack.data() + p * nb;
            for (int64_t j = 0; j < nb; ++j) ci[j] += av * bp[j];
          }
        }
      }
    }
    for (int64_t i = 0; i < m; ++i) {
      float* ci = c + i * ldc + j0;
      const float* acci = acc.data() + i * nb;
      if (beta == 0.0f) {
        for (int64_t j = 0; j < nb; ++j) ci[j] = alpha * acci[j];
      } else {
        for (int64_t j = 0; j < nb; ++j) ci[j] = alpha * acci[j] + beta * ci[j];
      }
    }
  }
}

void Device::gemm1(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                   int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) const {
  if (m <= 0 || n <= 0) return;
  if (k <= 0 || alpha == 0.0f) {  // C = beta * C; beta == 0 ignores what C held (NaN included)
    for (int64_t i = 0; i < m; ++i) {
      float* ci = c + i * ldc;
      if (beta == 0.0f) {
        for (int64_t j = 0; j < n; ++j) ci[j] = 0.0f;
      } else if (beta != 1.0f) {
        for (int64_t j = 0; j < n; ++j) ci[j] *= beta;
      }
    }
    return;
  }
  if (sgemm) {
    sgemm(kRowMajor, trans_a ? kTrans : kNoTrans, trans_b ? kTrans : kNoTrans, static_cast<int>(m), static_cast<int>(n),
          static_cast<int>(k), alpha, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta, c,
          static_cast<int>(ldc));
  } else {
    builtin_sgemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

void Device::gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                  int64_t stride_a, const float* b, int64_t ldb, int64_t stride_b, float beta, float* c, int64_t ldc,
                  int64_t stride_c, int64_t batch, bool parallel) {
  if (m <= 0 || n <= 0 || batch <= 0) return;
  auto one = [&](int64_t bi, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    const float* ab = a + bi * stride_a + (trans_a ? i0 : i0 * lda);
    const float* bb = b + bi * stride_b + (trans_b ? j0 * ldb : j0);
    float* cb = c + bi * stride_c + i0 * ldc + j0;
    gemm1(trans_a, trans_b, i1 - i0, j1 - j0, k, alpha, ab, lda, bb, ldb, beta, cb, ldc);
  };
  // OpenBLAS's summation order depends on the shape of each call, so the way a
  // GEMM is cut into calls depends on its shape only, never on the thread count:
  // every thread count gives the same bits. Small GEMMs (< 4 MFLOP, where a pool
  // wake-up costs more than it saves) are one call per batch element; larger ones
  // are cut into panels of 128 or 256 rows (or columns, when C is wide) and the
  // panels of all batch elements are spread over the pool.
  constexpr double kSplitFlops = 4.0e6;
  const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) *
                       static_cast<double>(std::max<int64_t>(k, 1)) * static_cast<double>(batch);
  const bool split_rows = m >= n;
  const int64_t extent = split_rows ? m : n;
  const int64_t panel = flops < kSplitFlops ? extent : extent >= 1024 ? 256 : extent >= 256 ? 128 : extent;
  const int64_t panels = (extent + panel - 1) / panel;
  auto run_panel = [&](int64_t bi, int64_t p) {
    const int64_t lo = p * panel, hi = std::min(extent, lo + panel);
    if (split_rows)
      one(bi, lo, hi, 0, n);
    else
      one(bi, 0, m, lo, hi);
  };
  // Batch elements whose C blocks overlap (e.g. stride_c = 0: a sum over the
  // batch) must run one after the other, in order.
  const bool disjoint_c = batch == 1 || stride_c >= (m - 1) * ldc + n;
  const int64_t tasks = disjoint_c ? batch * panels : panels;
  if (!parallel || tasks == 1) {
    for (int64_t bi = 0; bi < batch; ++bi)
      for (int64_t p = 0; p < panels; ++p) run_panel(bi, p);
    return;
  }
  if (disjoint_c) {
    pool->run_chunks(tasks, [&](int64_t t) { run_panel(t / panels, t % panels); });
  } else {
    pool->run_chunks(tasks, [&](int64_t p) {
      for (int64_t bi = 0; bi < batch; ++bi) run_panel(bi, p);
    });
  }
}

void validate(const loom_gemm_args& g) {
  op_contract::check("device/cpu", g);
  constexpr int64_t kMax = INT_MAX;
  LOOM_REQUIRE(g.m <= kMax && g.n <= kMax && g.k <= kMax && g.lda <= kMax && g.ldb <= kMax && g.ldc <= kMax,
               "gemm: dimensions and leading dimensions must fit in 32 bits (BLAS interface)");
}

namespace {

// A stored operand (A or B) in fp32: `batch` blocks of rows x cols, packed tight
// (ld = cols; stride 0 stays 0, so a broadcast operand is widened once).
struct Widened {
  F32Buffer buf;
  int64_t ld, stride;
  Widened(Device& d, const void* src, int64_t ld_src, int64_t stride_src, int64_t batch, int64_t rows, int64_t cols)
      : buf(static_cast<size_t>((stride_src == 0 ? 1 : batch) * rows * cols)),
        ld(std::max<int64_t>(cols, 1)),
        stride(stride_src == 0 ? 0 : rows * cols) {
    widen_matrix(d, static_cast<const uint16_t*>(src), ld_src, stride_src, buf.get(), ld, stride,
                 stride_src == 0 ? 1 : batch, rows, cols, true);
  }
};

// GEMM with a bf16 operand: A and B (dtype) and C (c_dtype) widened to fp32, the
// fp32 driver (same panels, same sgemm calls, as the F32 path on these values),
// C rounded back. beta is applied in fp32 to the widened C.
void run_gemm_mixed(Device& d, const loom_gemm_args& g) {
  if (g.m <= 0 || g.n <= 0) return;
  const bool ta = g.trans_a != 0, tb = g.trans_b != 0;
  const bool reads_ab = g.k > 0 && g.alpha != 0.0f;  // else C = beta C, A and B unread
  const float* a = static_cast<const float*>(g.a);
  const float* b = static_cast<const float*>(g.b);
  int64_t lda = g.lda, sa = g.stride_a, ldb = g.ldb, sb = g.stride_b;
  std::unique_ptr<Widened> wa, wb;
  if (is_bf16(g.dtype) && reads_ab) {
    wa = std::make_unique<Widened>(d, g.a, g.lda, g.stride_a, g.batch, ta ? g.k : g.m, ta ? g.m : g.k);
    wb = std::make_unique<Widened>(d, g.b, g.ldb, g.stride_b, g.batch, tb ? g.n : g.k, tb ? g.k : g.n);
    a = wa->buf.get();
    b = wb->buf.get();
    lda = wa->ld;
    sa = wa->stride;
    ldb = wb->ld;
    sb = wb->stride;
  }
  if (!is_bf16(g.c_dtype)) {
    d.gemm(ta, tb, g.m, g.n, g.k, g.alpha, a, lda, sa, b, ldb, sb, g.beta, static_cast<float*>(g.c), g.ldc, g.stride_c,
           g.batch, true);
    return;
  }
  // C: blocks that do not share elements are packed tight; otherwise (stride_c = 0:
  // a sum over the batch, or a partial overlap) C keeps its layout, so the batch
  // elements accumulate into the same fp32 elements, in order, as on the F32 path.
  uint16_t* c = static_cast<uint16_t*>(g.c);
  const bool disjoint = g.batch == 1 || g.stride_c >= (g.m - 1) * g.ldc + g.n;
  const int64_t ldc = disjoint ? g.n : g.ldc, sc = disjoint ? g.m * g.n : g.stride_c;
  F32Buffer cbuf(static_cast<size_t>((g.batch - 1) * sc + (g.m - 1) * ldc + g.n));
  // beta = 0 ignores what C held (NaN included): C is not read.
  if (g.beta != 0.0f) widen_matrix(d, c, g.ldc, g.stride_c, cbuf.get(), ldc, sc, g.batch, g.m, g.n, disjoint);
  d.gemm(ta, tb, g.m, g.n, g.k, g.alpha, a, lda, sa, b, ldb, sb, g.beta, cbuf.get(), ldc, sc, g.batch, true);
  round_matrix(d, cbuf.get(), ldc, sc, c, g.ldc, g.stride_c, g.batch, g.m, g.n, disjoint);
}

// ABI 1.11's epilogue on one row of r = alpha AB + beta C (fp32, in place), then
// stored: C's row (and aux's for GELU_AUX) in c_dtype. bias: the widened bias or
// NULL. The fp32 steps are those of the unfused ops (elementwise ADD_BIAS, gelu_fwd,
// gelu_bwd), so with fp32 C the results are theirs bit for bit.
void epilogue_row(Device& d, const loom_gemm_args& g, int64_t i, float* r, const float* bias, float* tmp) {
  const int64_t n = g.n;
  const bool bf16 = is_bf16(g.c_dtype);
  const int64_t ai = i * g.ldaux;
  if (bias != nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) r[j] = r[j] + bias[j];
  }
  if (g.epilogue == LOOM_GEMM_EPILOGUE_GELU_AUX) {
    if (bf16)
      d.k->f32_to_bf16(r, static_cast<uint16_t*>(g.aux) + ai, n);
    else
      std::memcpy(static_cast<float*>(g.aux) + ai, r, static_cast<size_t>(n) * sizeof(float));
    d.k->gelu_fwd(r, r, n);
  } else if (g.epilogue == LOOM_GEMM_EPILOGUE_DGELU) {
    const float* x = static_cast<const float*>(g.aux) + ai;
    if (bf16) {
      d.k->bf16_to_f32(static_cast<const uint16_t*>(g.aux) + ai, tmp, n);
      x = tmp;
    }
    d.k->gelu_bwd(x, r, r, n);
  }
  if (bf16) d.k->f32_to_bf16(r, static_cast<uint16_t*>(g.c) + i * g.ldc, n);
}

// BIAS_GRAD's aux[j] += the column sums of B, as reduce COLUMN_SUM (then, for a bf16
// aux, widened, added in fp32 and rounded once).
void bias_grad(Device& d, const loom_gemm_args& g) {
  loom_reduce_args r = op_contract::bias_grad_sums(g);
  if (!is_bf16(g.c_dtype)) {
    r.out = g.aux;
    r.accumulate = 1;
    run_reduce(d, r);
    return;
  }
  F32Buffer sum(static_cast<size_t>(g.n));
  r.out = sum.get();
  run_reduce(d, r);
  uint16_t* aux = static_cast<uint16_t*>(g.aux);
  for (int64_t j = 0; j < g.n; ++j) aux[j] = f32_to_bf16(bf16_to_f32(aux[j]) + sum.get()[j]);
}

// A GEMM with an epilogue: r into fp32 (C itself when it is fp32, else packed
// scratch with C widened when beta reads it), then the epilogue row by row.
void run_gemm_epilogue(Device& d, const loom_gemm_args& g) {
  if (g.epilogue == LOOM_GEMM_EPILOGUE_BIAS_GRAD) {
    loom_gemm_args plain = g;
    plain.epilogue = LOOM_GEMM_EPILOGUE_NONE;
    plain.aux = nullptr;
    run_gemm(d, plain);
    if (g.n > 0) bias_grad(d, g);
    return;
  }
  if (g.m <= 0 || g.n <= 0) return;
  const bool bf16 = is_bf16(g.c_dtype);
  loom_gemm_args plain = g;
  plain.epilogue = LOOM_GEMM_EPILOGUE_NONE;
  plain.bias = nullptr;
  plain.aux = nullptr;
  F32Buffer r(bf16 ? static_cast<size_t>(g.m * g.n) : 0);
  if (bf16) {
    if (g.beta != 0.0f)
      widen_matrix(d, static_cast<const uint16_t*>(g.c), g.ldc, 0, r.get(), g.n, 0, 1, g.m, g.n, true);
    plain.c = r.get();
    plain.ldc = g.n;
    plain.stride_c = g.m * g.n;
    plain.c_dtype = LOOM_DTYPE_F32;
  }
  run_gemm(d, plain);
  F32Buffer bias(g.bias ? static_cast<size_t>(g.n) : 0);
  if (g.bias != nullptr) {
    if (bf16)
      d.k->bf16_to_f32(static_cast<const uint16_t*>(g.bias), bias.get(), g.n);
    else
      std::memcpy(bias.get(), g.bias, static_cast<size_t>(g.n) * sizeof(float));
  }
  float* rows = bf16 ? r.get() : static_cast<float*>(g.c);
  const int64_t ld = bf16 ? g.n : g.ldc;
  d.pool->parallel_for(g.m, std::max<int64_t>(1, 16384 / g.n), [&](int64_t i0, int64_t i1) {
    float* tmp = scratch(0, static_cast<size_t>(g.n));
    for (int64_t i = i0; i < i1; ++i) epilogue_row(d, g, i, rows + i * ld, bias.get(), tmp);
  });
}

}  // namespace

void run_gemm(Device& d, const loom_gemm_args& g) {
  if (g.epilogue != LOOM_GEMM_EPILOGUE_NONE) {
    run_gemm_epilogue(d, g);
    return;
  }
  if (is_bf16(g.dtype) || is_bf16(g.c_dtype)) {
    run_gemm_mixed(d, g);
    return;
  }
  d.gemm(g.trans_a != 0, g.trans_b != 0, g.m, g.n, g.k, g.alpha, static_cast<const float*>(g.a), g.lda, g.stride_a,
         static_cast<const float*>(g.b), g.ldb, g.stride_b, g.beta, static_cast<float*>(g.c), g.ldc, g.stride_c,
         g.batch, true);
}

}  // namespace loom::cpu
