// The non-GEMM, non-attention ops: layernorm, GeLU, cross-entropy, embedding,
// element-wise, reductions, AdamW. fp32 math throughout; tight loops the compiler
// vectorises (-fopenmp-simd reductions), rows or columns spread over the pool.
// Every result is independent of the number of threads: work is split so that
// no floating-point sum depends on where a chunk boundary falls.
//
// bf16 storage (dtype BF16): each op widens the rows (or blocks) it works on into
// thread-local fp32 scratch, runs the same fp32 inner loop as its F32 path, and
// rounds what it stores as bf16; per-row fp32 outputs (layernorm mean/rstd, xent's
// row scalars, reductions) stay fp32. The F32 paths are untouched by this.
#include <cmath>
#include <cstring>
#include <limits>

#include "cpu_device.hpp"
#include "cpu_math.hpp"

namespace loom::cpu {

namespace {

constexpr int64_t kGrain = 1 << 15;   // elements per parallel chunk, at least
constexpr int64_t kBf16Block = 4096;  // elements widened at a time by bf16 element-wise paths
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline const float* F(const void* p) { return static_cast<const float*>(p); }
inline float* F(void* p) { return static_cast<float*>(p); }
inline const uint16_t* H(const void* p) { return static_cast<const uint16_t*>(p); }
inline uint16_t* H(void* p) { return static_cast<uint16_t*>(p); }

// Rows per chunk so that one chunk holds at least kGrain elements.
inline int64_t row_grain(int64_t cols) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(1, cols)); }

// A small bf16 vector (gamma, beta, a bias) widened once per call; NULL stays NULL.
struct WidenedVec {
  F32Buffer buf;
  const float* p = nullptr;
  WidenedVec(const Device& d, const void* src, int64_t n) : buf(src ? static_cast<size_t>(n) : 0) {
    if (src == nullptr) return;
    d.k->bf16_to_f32(H(src), buf.get(), n);
    p = buf.get();
  }
};

}  // namespace

float* scratch(int slot, size_t n) {
  thread_local std::vector<float> bufs[kScratchSlots];
  std::vector<float>& b = bufs[slot];
  if (b.size() < n) b.resize(n);
  return b.data();
}

void widen_matrix(Device& d, const uint16_t* src, int64_t ld, int64_t stride, float* dst, int64_t dld, int64_t dstride,
                  int64_t batch, int64_t rows, int64_t cols, bool parallel) {
  if (batch <= 0 || rows <= 0 || cols <= 0) return;
  auto body = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / rows, r = t % rows;
      d.k->bf16_to_f32(src + b * stride + r * ld, dst + b * dstride + r * dld, cols);
    }
  };
  if (parallel)
    d.pool->parallel_for(batch * rows, row_grain(cols), body);
  else
    body(0, batch * rows);
}

void round_matrix(Device& d, const float* src, int64_t ld, int64_t stride, uint16_t* dst, int64_t dld, int64_t dstride,
                  int64_t batch, int64_t rows, int64_t cols, bool parallel) {
  if (batch <= 0 || rows <= 0 || cols <= 0) return;
  auto body = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / rows, r = t % rows;
      d.k->f32_to_bf16(src + b * stride + r * ld, dst + b * dstride + r * dld, cols);
    }
  };
  if (parallel)
    d.pool->parallel_for(batch * rows, row_grain(cols), body);
  else
    body(0, batch * rows);
}

// ---------------------------------------------------------------------------
// LayerNorm
// ---------------------------------------------------------------------------

void validate(const loom_layernorm_fwd_args& a) {
  op_contract::check("device/cpu", a);
}

void run_layernorm_fwd(Device& d, const loom_layernorm_fwd_args& a) {
  const int64_t cols = a.cols;
  if (is_bf16(a.dtype)) {  // x, gamma, beta, y bf16; mean, rstd fp32
    const WidenedVec gamma(d, a.gamma, cols), beta(d, a.beta, cols);
    d.pool->parallel_for(a.rows, row_grain(cols), [&](int64_t r0, int64_t r1) {
      float* x = scratch(0, static_cast<size_t>(cols));
      float* y = scratch(1, static_cast<size_t>(cols));
      for (int64_t r = r0; r < r1; ++r) {
        float mean, rstd;
        d.k->bf16_to_f32(H(a.x) + r * cols, x, cols);
        d.k->layernorm_row(x, gamma.p, beta.p, y, cols, a.eps, &mean, &rstd);
        d.k->f32_to_bf16(y, H(a.y) + r * cols, cols);
        if (a.mean) a.mean[r] = mean;
        if (a.rstd) a.rstd[r] = rstd;
      }
    });
    return;
  }
  d.pool->parallel_for(a.rows, row_grain(cols), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float mean, rstd;
      d.k->layernorm_row(F(a.x) + r * cols, F(a.gamma), F(a.beta), F(a.y) + r * cols, cols, a.eps, &mean, &rstd);
      if (a.mean) a.mean[r] = mean;
      if (a.rstd) a.rstd[r] = rstd;
    }
  });
}

void validate(const loom_layernorm_bwd_args& a) {
  op_contract::check("device/cpu", a);
}

namespace {

// dy, x, gamma, dx bf16; dgamma, dbeta bf16 (or fp32 with grad_fp32); mean, rstd
// fp32. The same sums as the F32 path (columns split over the pool, in double), on
// widened row segments.
void layernorm_bwd_bf16(Device& d, const loom_layernorm_bwd_args& a) {
  const int64_t rows = a.rows, cols = a.cols;
  const bool grads_f32 = op_contract::grad_dtype(a) == LOOM_DTYPE_F32;
  // Adds a column's sum to one gradient element of either dtype (rounded once).
  auto accumulate = [grads_f32](void* grad, int64_t c, double sum) {
    if (grads_f32) F(grad)[c] += static_cast<float>(sum);
    else H(grad)[c] = f32_to_bf16(bf16_to_f32(H(grad)[c]) + static_cast<float>(sum));
  };
  if (a.dgamma || a.dbeta) {
    const int64_t col_grain = std::max<int64_t>(64, kGrain / std::max<int64_t>(1, rows));
    d.pool->parallel_for(cols, col_grain, [&](int64_t c0, int64_t c1) {
      const int64_t w = c1 - c0;
      thread_local std::vector<double> acc;
      acc.assign(static_cast<size_t>(2 * w), 0.0);
      float* x = scratch(0, static_cast<size_t>(w));
      float* dy = scratch(1, static_cast<size_t>(w));
      for (int64_t r = 0; r < rows; ++r) {
        d.k->bf16_to_f32(H(a.x) + r * cols + c0, x, w);
        d.k->bf16_to_f32(H(a.dy) + r * cols + c0, dy, w);
        d.k->layernorm_bwd_cols(x, dy, w, a.mean[r], a.rstd[r], acc.data(), acc.data() + w);
      }
      if (a.dgamma)
        for (int64_t c = 0; c < w; ++c) accumulate(a.dgamma, c0 + c, acc[c]);
      if (a.dbeta)
        for (int64_t c = 0; c < w; ++c) accumulate(a.dbeta, c0 + c, acc[w + c]);
    });
  }
  if (a.dx == nullptr) return;
  const WidenedVec gamma(d, a.gamma, cols);
  d.pool->parallel_for(rows, row_grain(cols), [&](int64_t r0, int64_t r1) {
    float* x = scratch(0, static_cast<size_t>(cols));
    float* dy = scratch(1, static_cast<size_t>(cols));
    float* dx = scratch(2, static_cast<size_t>(cols));
    for (int64_t r = r0; r < r1; ++r) {
      d.k->bf16_to_f32(H(a.x) + r * cols, x, cols);
      d.k->bf16_to_f32(H(a.dy) + r * cols, dy, cols);
      if (a.accumulate_dx) d.k->bf16_to_f32(H(a.dx) + r * cols, dx, cols);
      d.k->layernorm_bwd_row(x, dy, gamma.p, dx, cols, a.mean[r], a.rstd[r], a.accumulate_dx);
      d.k->f32_to_bf16(dx, H(a.dx) + r * cols, cols);
    }
  });
}

}  // namespace

void run_layernorm_bwd(Device& d, const loom_layernorm_bwd_args& a) {
  if (is_bf16(a.dtype)) {
    layernorm_bwd_bf16(d, a);
    return;
  }
  const int64_t rows = a.rows, cols = a.cols;
  // dgamma/dbeta first (dx may overwrite dy in place): columns split over the pool,
  // each column summed over rows in order, in double.
  if (a.dgamma || a.dbeta) {
    float* dgamma = F(a.dgamma);
    float* dbeta = F(a.dbeta);
    const int64_t col_grain = std::max<int64_t>(64, kGrain / std::max<int64_t>(1, rows));
    d.pool->parallel_for(cols, col_grain, [&](int64_t c0, int64_t c1) {
      const int64_t w = c1 - c0;
      thread_local std::vector<double> acc;
      acc.assign(static_cast<size_t>(2 * w), 0.0);
      for (int64_t r = 0; r < rows; ++r)
        d.k->layernorm_bwd_cols(F(a.x) + r * cols + c0, F(a.dy) + r * cols + c0, w, a.mean[r], a.rstd[r], acc.data(),
                                acc.data() + w);
      if (dgamma)
        for (int64_t c = 0; c < w; ++c) dgamma[c0 + c] += static_cast<float>(acc[c]);
      if (dbeta)
        for (int64_t c = 0; c < w; ++c) dbeta[c0 + c] += static_cast<float>(acc[w + c]);
    });
  }
  if (a.dx == nullptr) return;
  d.pool->parallel_for(rows, row_grain(cols), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      d.k->layernorm_bwd_row(F(a.x) + r * cols, F(a.dy) + r * cols, F(a.gamma), F(a.dx) + r * cols, cols, a.mean[r],
                             a.rstd[r], a.accumulate_dx);
  });
}

// ---------------------------------------------------------------------------
// GeLU (tanh approximation)
// ---------------------------------------------------------------------------

void validate_gelu(const loom_gelu_args& a, bool backward) {
  op_contract::check("device/cpu", a, backward);
}

namespace {

// x, dy, out bf16: blocks widened, the same kernel, the result rounded.
void gelu_bf16(Device& d, const loom_gelu_args& a, bool backward) {
  d.pool->parallel_for(a.n, kGrain, [&](int64_t i0, int64_t i1) {
    float* x = scratch(0, kBf16Block);
    float* dy = scratch(1, kBf16Block);
    float* y = scratch(2, kBf16Block);
    for (int64_t j = i0; j < i1; j += kBf16Block) {
      const int64_t len = std::min(kBf16Block, i1 - j);
      d.k->bf16_to_f32(H(a.x) + j, x, len);
      if (backward) {
        d.k->bf16_to_f32(H(a.dy) + j, dy, len);
        d.k->gelu_bwd(x, dy, y, len);
      } else {
        d.k->gelu_fwd(x, y, len);
      }
      d.k->f32_to_bf16(y, H(a.out) + j, len);
    }
  });
}

}  // namespace

void run_gelu_fwd(Device& d, const loom_gelu_args& a) {
  if (is_bf16(a.dtype)) {
    gelu_bf16(d, a, false);
    return;
  }
  d.pool->parallel_for(a.n, kGrain,
                       [&](int64_t i0, int64_t i1) { d.k->gelu_fwd(F(a.x) + i0, F(a.out) + i0, i1 - i0); });
}

void run_gelu_bwd(Device& d, const loom_gelu_args& a) {
  if (is_bf16(a.dtype)) {
    gelu_bf16(d, a, true);
    return;
  }
  d.pool->parallel_for(
      a.n, kGrain, [&](int64_t i0, int64_t i1) { d.k->gelu_bwd(F(a.x) + i0, F(a.dy) + i0, F(a.out) + i0, i1 - i0); });
}

// ---------------------------------------------------------------------------
// Cross-entropy over a vocab slice
// ---------------------------------------------------------------------------

void validate(const loom_xent_args& a) {
  op_contract::check("device/cpu", a);
}

namespace {

// logits and dlogits bf16; row_max, row_sumexp, target_logit, loss fp32. Each row's
// real columns are widened into scratch and the F32 path's kernels run on them.
void xent_bf16(Device& d, const loom_xent_args& a, int64_t valid, int64_t grain) {
  const int64_t cols = a.cols, ld = a.ld;
  d.pool->parallel_for(a.rows, grain, [&](int64_t r0, int64_t r1) {
    float* l = scratch(0, static_cast<size_t>(std::max<int64_t>(cols, 1)));
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* lr = H(a.logits) + r * ld;
      switch (a.step) {
        case LOOM_XENT_ROW_MAX:
          d.k->bf16_to_f32(lr, l, valid);
          a.row_max[r] = d.k->row_max(l, valid);
          break;
        case LOOM_XENT_SUMEXP: {
          d.k->bf16_to_f32(lr, l, valid);
          const float m = a.row_max[r];
          a.row_sumexp[r] = m == kNegInf ? 0.0f : static_cast<float>(d.k->sum_exp(l, valid, m));
          if (a.target_logit) {
            const int64_t t = a.targets[r];
            const int64_t c = t - a.vocab_start;
            a.target_logit[r] = (t >= 0 && c >= 0 && c < valid) ? l[c] : 0.0f;
          }
          break;
        }
        default: {  // LOOM_XENT_BACKWARD
          uint16_t* g = H(a.dlogits) + r * ld;
          const int64_t t = a.targets[r];
          if (t < 0) {
            std::memset(g, 0, static_cast<size_t>(cols) * sizeof(uint16_t));
            continue;
          }
          d.k->bf16_to_f32(lr, l, valid);
          const float m = a.row_max[r];
          const float k = a.scale / a.row_sumexp[r];
          d.k->scaled_exp(l, l, valid, m, k);
          for (int64_t c = valid; c < cols; ++c) l[c] = 0.0f;
          const int64_t c = t - a.vocab_start;
          if (c >= 0 && c < valid) l[c] -= a.scale;
          d.k->f32_to_bf16(l, g, cols);
          break;
        }
      }
    }
  });
}

}  // namespace

void run_xent(Device& d, const loom_xent_args& a) {
  const int64_t cols = a.cols, ld = a.ld;
  const int64_t valid = std::clamp<int64_t>(a.valid_cols, 0, cols);
  if (a.targets && a.step != LOOM_XENT_ROW_MAX) {
    for (int64_t r = 0; r < a.rows; ++r) {
      const int64_t t = a.targets[r];
      if (t < 0) continue;
      const int64_t c = t - a.vocab_start;
      LOOM_REQUIRE(!(c >= valid && c < cols), "xent: target " << t << " of row " << r
                                                              << " is a vocab padding column (slice starts at "
                                                              << a.vocab_start << ", " << valid << " of its " << cols
                                                              << " columns are real vocab)");
    }
  }
  const int64_t grain = row_grain(cols);
  if (is_bf16(a.dtype) && a.step != LOOM_XENT_LOSS) {
    xent_bf16(d, a, valid, grain);
    return;
  }
  switch (a.step) {
    case LOOM_XENT_ROW_MAX:
      d.pool->parallel_for(a.rows, grain, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          a.row_max[r] = d.k->row_max(F(a.logits) + r * ld, valid);
        }
      });
      break;
    case LOOM_XENT_SUMEXP:
      d.pool->parallel_for(a.rows, grain, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const float* l = F(a.logits) + r * ld;
          const float m = a.row_max[r];
          // m = -inf: no real column in any slice, nothing to add.
          a.row_sumexp[r] = m == kNegInf ? 0.0f : static_cast<float>(d.k->sum_exp(l, valid, m));
          if (a.target_logit) {
            const int64_t t = a.targets[r];
            const int64_t c = t - a.vocab_start;
            a.target_logit[r] = (t >= 0 && c >= 0 && c < valid) ? l[c] : 0.0f;
          }
        }
      });
      break;
    case LOOM_XENT_LOSS:
      for (int64_t r = 0; r < a.rows; ++r)
        a.loss[r] =
            a.targets[r] < 0
                ? 0.0f
                : static_cast<float>(std::log(static_cast<double>(a.row_sumexp[r])) + a.row_max[r] - a.target_logit[r]);
      break;
    case LOOM_XENT_BACKWARD:
      d.pool->parallel_for(a.rows, grain, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const float* l = F(a.logits) + r * ld;
          float* g = F(a.dlogits) + r * ld;
          const int64_t t = a.targets[r];
          if (t < 0) {
            for (int64_t c = 0; c < cols; ++c) g[c] = 0.0f;
            continue;
          }
          const float m = a.row_max[r];
          const float k = a.scale / a.row_sumexp[r];
          d.k->scaled_exp(l, g, valid, m, k);
          for (int64_t c = valid; c < cols; ++c) g[c] = 0.0f;
          const int64_t c = t - a.vocab_start;
          if (c >= 0 && c < valid) g[c] -= a.scale;
        }
      });
      break;
  }
}

// ---------------------------------------------------------------------------
// Embedding over a vocab slice
// ---------------------------------------------------------------------------

void validate_embedding(const loom_embedding_args& a, bool backward) {
  op_contract::check("device/cpu", a, backward);
}

namespace {

// table, out, dout, dtable bf16 (ids int32).
void embedding_fwd_bf16(Device& d, const loom_embedding_args& a) {
  const int64_t dim = a.dim;
  d.pool->parallel_for(a.n, row_grain(dim), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = static_cast<int64_t>(a.ids[i]) - a.vocab_start;
      uint16_t* out = H(a.out) + i * dim;
      const bool inside = row >= 0 && row < a.vocab_rows;
      if (inside) {
        const uint16_t* src = H(a.table) + row * dim;
        if (a.accumulate) {
#pragma omp simd
          for (int64_t c = 0; c < dim; ++c) out[c] = f32_to_bf16(bf16_to_f32(out[c]) + bf16_to_f32(src[c]));
        } else {
          std::memcpy(out, src, static_cast<size_t>(dim) * sizeof(uint16_t));
        }
      } else if (!a.accumulate) {
        std::memset(out, 0, static_cast<size_t>(dim) * sizeof(uint16_t));
      }
    }
  });
}

// Each touched row of dtable is widened once, gets the rows of dout added in the
// order of ids (the F32 path's sums), and is rounded once: not a rounding per add.
void embedding_bwd_bf16(Device& d, const loom_embedding_args& a) {
  const int64_t dim = a.dim;
  std::vector<int32_t> slot_of_row(static_cast<size_t>(a.vocab_rows), -1);
  std::vector<int32_t> slot_of_id(static_cast<size_t>(a.n), -1);
  std::vector<int64_t> rows;  // touched rows, in first-seen order
  for (int64_t i = 0; i < a.n; ++i) {
    const int64_t row = static_cast<int64_t>(a.ids[i]) - a.vocab_start;
    if (row < 0 || row >= a.vocab_rows) continue;
    int32_t& s = slot_of_row[static_cast<size_t>(row)];
    if (s < 0) {
      s = static_cast<int32_t>(rows.size());
      rows.push_back(row);
    }
    slot_of_id[static_cast<size_t>(i)] = s;
  }
  if (rows.empty()) return;
  const int64_t touched = static_cast<int64_t>(rows.size());
  F32Buffer acc(static_cast<size_t>(touched * dim));
  const uint16_t* dout = H(a.dout);
  uint16_t* dtable = H(a.dtable);
  const int64_t grain = std::max<int64_t>(16, kGrain / std::max<int64_t>(1, a.n));
  d.pool->parallel_for(dim, grain, [&](int64_t c0, int64_t c1) {
    const int64_t w = c1 - c0;
    for (int64_t u = 0; u < touched; ++u) d.k->bf16_to_f32(dtable + rows[u] * dim + c0, acc.get() + u * dim + c0, w);
    float* g = scratch(0, static_cast<size_t>(w));
    for (int64_t i = 0; i < a.n; ++i) {
      const int32_t s = slot_of_id[static_cast<size_t>(i)];
      if (s < 0) continue;
      d.k->bf16_to_f32(dout + i * dim + c0, g, w);
      float* dst = acc.get() + s * dim + c0;
#pragma omp simd
      for (int64_t c = 0; c < w; ++c) dst[c] += g[c];
    }
    for (int64_t u = 0; u < touched; ++u) d.k->f32_to_bf16(acc.get() + u * dim + c0, dtable + rows[u] * dim + c0, w);
  });
}

// dout bf16, dtable fp32 (grad_fp32): the F32 path's sums on widened segments of dout.
void embedding_bwd_bf16_into_f32(Device& d, const loom_embedding_args& a) {
  const int64_t dim = a.dim;
  const int64_t grain = std::max<int64_t>(16, kGrain / std::max<int64_t>(1, a.n));
  d.pool->parallel_for(dim, grain, [&](int64_t c0, int64_t c1) {
    float* g = scratch(0, static_cast<size_t>(c1 - c0));
    for (int64_t i = 0; i < a.n; ++i) {
      const int64_t row = static_cast<int64_t>(a.ids[i]) - a.vocab_start;
      if (row < 0 || row >= a.vocab_rows) continue;
      d.k->bf16_to_f32(H(a.dout) + i * dim + c0, g, c1 - c0);
      float* dst = F(a.dtable) + row * dim;
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) dst[c] += g[c - c0];
    }
  });
}

}  // namespace

void run_embedding_fwd(Device& d, const loom_embedding_args& a) {
  if (is_bf16(a.dtype)) {
    embedding_fwd_bf16(d, a);
    return;
  }
  const int64_t dim = a.dim;
  d.pool->parallel_for(a.n, row_grain(dim), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = static_cast<int64_t>(a.ids[i]) - a.vocab_start;
      float* out = F(a.out) + i * dim;
      const bool inside = row >= 0 && row < a.vocab_rows;
      if (inside) {
        const float* src = F(a.table) + row * dim;
        if (a.accumulate) {
#pragma omp simd
          for (int64_t c = 0; c < dim; ++c) out[c] += src[c];
        } else {
          std::memcpy(out, src, static_cast<size_t>(dim) * sizeof(float));
        }
      } else if (!a.accumulate) {
        std::memset(out, 0, static_cast<size_t>(dim) * sizeof(float));
      }
    }
  });
}

void run_embedding_bwd(Device& d, const loom_embedding_args& a) {
  if (is_bf16(a.dtype)) {
    if (op_contract::grad_dtype(a) == LOOM_DTYPE_F32) embedding_bwd_bf16_into_f32(d, a);
    else embedding_bwd_bf16(d, a);
    return;
  }
  // Split over columns so repeated ids never race and sums keep the order of ids.
  const int64_t dim = a.dim;
  const int64_t grain = std::max<int64_t>(16, kGrain / std::max<int64_t>(1, a.n));
  d.pool->parallel_for(dim, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t i = 0; i < a.n; ++i) {
      const int64_t row = static_cast<int64_t>(a.ids[i]) - a.vocab_start;
      if (row < 0 || row >= a.vocab_rows) continue;
      const float* g = F(a.dout) + i * dim;
      float* dst = F(a.dtable) + row * dim;
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) dst[c] += g[c];
    }
  });
}

// ---------------------------------------------------------------------------
// Element-wise
// ---------------------------------------------------------------------------

namespace {
}  // namespace

void validate(const loom_elementwise_args& a) {
  op_contract::check("device/cpu", a);
}

namespace {

// Dropout keeps with probability 1 - p and scales kept values by 1 / (1 - p); its
// stream is keyed by the halves of mix64(seed).
struct EwConsts {
  float keep_scale;
  uint32_t threshold, key0, key1;
};
EwConsts ew_consts(const loom_elementwise_args& a) {
  EwConsts k;
  k.keep_scale = a.p < 1.0f ? 1.0f / (1.0f - a.p) : 0.0f;
  k.threshold = static_cast<uint32_t>(std::min(16777216.0, std::ceil(static_cast<double>(a.p) * 16777216.0)));
  // With seed_device the step's value is read now, when the launch runs (a replay too).
  const uint64_t seed = a.seed_device ? loom_mix64(a.seed ^ loom_mix64(*a.seed_device)) : a.seed;
  const uint64_t seed_key = mix64(seed);
  k.key0 = static_cast<uint32_t>(seed_key);
  k.key1 = static_cast<uint32_t>(seed_key >> 32);
  return k;
}

// Does the op read y as a float operand (not as the dropout mask)?
bool ew_reads_y(const loom_elementwise_args& a) {
  return a.op == LOOM_EW_ADD || a.op == LOOM_EW_MUL || (a.op == LOOM_EW_AXPBY && a.beta != 0.0f);
}

// Elements [i0, i0 + len) of an element-wise op (not CAST, not per-column) in fp32:
// x, y (AXPBY's in/out, ADD's and MUL's operand) and out point at element i0 of their
// tensors, or of fp32 copies of them; the dropout mask is always a.y's u8 array.
void ew_f32(const Device& d, const loom_elementwise_args& a, const EwConsts& k, int64_t i0, int64_t len, const float* x,
            float* y, float* out) {
  const float alpha = a.alpha, beta = a.beta;
  switch (a.op) {
    case LOOM_EW_AXPBY: {
      if (beta == 0.0f) {
#pragma omp simd
        for (int64_t i = 0; i < len; ++i) y[i] = alpha * x[i];
      } else {
#pragma omp simd
        for (int64_t i = 0; i < len; ++i) y[i] = alpha * x[i] + beta * y[i];
      }
      break;
    }
    case LOOM_EW_ADD: {
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) out[i] = x[i] + y[i];
      break;
    }
    case LOOM_EW_MUL: {
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) out[i] = x[i] * y[i];
      break;
    }
    case LOOM_EW_SCALE: {
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) out[i] = alpha * x[i];
      break;
    }
    case LOOM_EW_FILL: {
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) out[i] = alpha;
      break;
    }
    case LOOM_EW_DROPOUT: {
      uint8_t* mask = static_cast<uint8_t*>(a.y) + i0;
      // Index offset + i0 + i, cut where its low 32 bits wrap (the kernel counts in 32 bits).
      for (int64_t i = 0; i < len;) {
        const uint64_t index = a.offset + static_cast<uint64_t>(i0 + i);
        const uint32_t lo = static_cast<uint32_t>(index), hi = static_cast<uint32_t>(index >> 32);
        const int64_t n = std::min<int64_t>(len - i, static_cast<int64_t>((uint64_t{1} << 32) - lo));
        d.k->dropout(x + i, mask + i, out + i, n, lo, k.key0, hi ^ k.key1, k.threshold, k.keep_scale);
        i += n;
      }
      break;
    }
    case LOOM_EW_DROPOUT_BWD: {
      const uint8_t* mask = static_cast<const uint8_t*>(a.y) + i0;
      const float keep_scale = k.keep_scale;
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) out[i] = mask[i] ? x[i] * keep_scale : 0.0f;
      break;
    }
    default:
      break;
  }
}

// One row of ADD_BIAS (out = x + v) or MUL_COLS (out = x * v).
void ew_cols_f32(bool mul, const float* x, const float* v, float* out, int64_t cols) {
  if (mul) {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) out[c] = x[c] * v[c];
  } else {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) out[c] = x[c] + v[c];
  }
}

void ew_cast(const loom_elementwise_args& a, int64_t i0, int64_t i1) {
  if (a.dtype == a.out_dtype) {
    const size_t es = a.dtype == LOOM_DTYPE_F32 ? 4 : 2;
    if (a.out != a.x)
      std::memmove(static_cast<char*>(a.out) + i0 * es, static_cast<const char*>(a.x) + i0 * es,
                   static_cast<size_t>(i1 - i0) * es);
  } else if (a.dtype == LOOM_DTYPE_F32) {
    const float* x = F(a.x);
    uint16_t* out = H(a.out);
    for (int64_t i = i0; i < i1; ++i) out[i] = f32_to_bf16(x[i]);
  } else {
    const uint16_t* x = H(a.x);
    float* out = F(a.out);
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) out[i] = bf16_to_f32(x[i]);
  }
}

// x, y (and out) bf16, except the dropout mask (u8): blocks widened, ew_f32, rounded.
void elementwise_bf16(Device& d, const loom_elementwise_args& a) {
  if (a.op == LOOM_EW_ADD_BIAS || a.op == LOOM_EW_MUL_COLS) {
    const int64_t cols = a.cols, rows = a.n / a.cols;
    const WidenedVec v(d, a.y, cols);
    d.pool->parallel_for(rows, row_grain(cols), [&](int64_t r0, int64_t r1) {
      float* x = scratch(0, static_cast<size_t>(cols));
      float* out = scratch(1, static_cast<size_t>(cols));
      for (int64_t r = r0; r < r1; ++r) {
        d.k->bf16_to_f32(H(a.x) + r * cols, x, cols);
        ew_cols_f32(a.op == LOOM_EW_MUL_COLS, x, v.p, out, cols);
        d.k->f32_to_bf16(out, H(a.out) + r * cols, cols);
      }
    });
    return;
  }
  if (a.op == LOOM_EW_FILL) {
    const uint16_t h = f32_to_bf16(a.alpha);
    uint16_t* out = H(a.out);
    d.pool->parallel_for(a.n, kGrain, [&](int64_t i0, int64_t i1) { std::fill(out + i0, out + i1, h); });
    return;
  }
  const EwConsts k = ew_consts(a);
  const bool reads_y = ew_reads_y(a), axpby = a.op == LOOM_EW_AXPBY;
  d.pool->parallel_for(a.n, kGrain, [&](int64_t i0, int64_t i1) {
    float* x = scratch(0, kBf16Block);
    float* y = scratch(1, kBf16Block);
    float* out = scratch(2, kBf16Block);
    for (int64_t j = i0; j < i1; j += kBf16Block) {
      const int64_t len = std::min(kBf16Block, i1 - j);
      d.k->bf16_to_f32(H(a.x) + j, x, len);
      if (reads_y) d.k->bf16_to_f32(H(a.y) + j, y, len);
      ew_f32(d, a, k, j, len, x, y, out);
      d.k->f32_to_bf16(axpby ? y : out, H(axpby ? a.y : a.out) + j, len);
    }
  });
}

}  // namespace

void run_elementwise(Device& d, const loom_elementwise_args& a) {
  if (is_bf16(a.dtype) && a.op != LOOM_EW_CAST) {
    elementwise_bf16(d, a);
    return;
  }
  if (a.op == LOOM_EW_ADD_BIAS || a.op == LOOM_EW_MUL_COLS) {  // a per-column vector over rows
    const int64_t cols = a.cols, rows = a.n / a.cols;
    const bool mul = a.op == LOOM_EW_MUL_COLS;
    d.pool->parallel_for(rows, row_grain(cols), [&](int64_t r0, int64_t r1) {
      const float* v = F(a.y);
      for (int64_t r = r0; r < r1; ++r) ew_cols_f32(mul, F(a.x) + r * cols, v, F(a.out) + r * cols, cols);
    });
    return;
  }
  if (a.op == LOOM_EW_CAST) {
    d.pool->parallel_for(a.n, kGrain, [&](int64_t i0, int64_t i1) { ew_cast(a, i0, i1); });
    return;
  }
  const EwConsts k = ew_consts(a);
  const bool y_float = a.op == LOOM_EW_AXPBY || a.op == LOOM_EW_ADD || a.op == LOOM_EW_MUL;
  d.pool->parallel_for(a.n, kGrain, [&](int64_t i0, int64_t i1) {
    ew_f32(d, a, k, i0, i1 - i0, a.x ? F(a.x) + i0 : nullptr, y_float ? F(a.y) + i0 : nullptr,
           a.out ? F(a.out) + i0 : nullptr);
  });
}

// ---------------------------------------------------------------------------
// Reductions
// ---------------------------------------------------------------------------

void validate(const loom_reduce_args& a) {
  op_contract::check("device/cpu", a);
}

namespace {

constexpr int64_t kReduceBlock = 1 << 14;  // fixed blocks (independent of the thread count)

// The first index of the row maximum.
int64_t row_argmax(const float* xr, int64_t cols) {
  int64_t best = 0;
  for (int64_t c = 1; c < cols; ++c)
    if (xr[c] > xr[best]) best = c;
  return best;
}

void column_add(const float* xr, double* s, int64_t w) {
#pragma omp simd
  for (int64_t c = 0; c < w; ++c) s[c] += static_cast<double>(xr[c]);
}

// SUM, SUM_SQUARES or MAX_ABS of one block.
double reduce_block(int32_t op, const float* x, int64_t n) {
  double s = 0.0;
  if (op == LOOM_RED_SUM) {
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]);
  } else if (op == LOOM_RED_SUM_SQUARES) {
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  } else {  // MAX_ABS; NaN wins so that overflow checks see it
    float m = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      const float v = std::fabs(x[i]);
      m = (v > m || v != v) && m == m ? v : m;
    }
    s = m;
  }
  return s;
}

}  // namespace

void run_reduce(Device& d, const loom_reduce_args& a) {
  if (const int64_t count = op_contract::num_segments(a); count > 0) {  // 1.8: each segment as its own call
    for (int64_t i = 0; i < count; ++i) {
      const loom_reduce_segment& seg = a.segments[i];
      LOOM_REQUIRE(seg.offset >= 0 && seg.numel >= 0, "reduce: segment " << i << " has offset " << seg.offset
                                                                          << " and numel " << seg.numel
                                                                          << " (both must be >= 0)");
      loom_reduce_args one = a;
      one.num_segments = 0;
      one.n = seg.numel;
      one.x = static_cast<const char*>(a.x) + seg.offset * (is_bf16(a.dtype) ? 2 : 4);
      one.out = F(a.out) + i;
      run_reduce(d, one);
    }
    return;
  }
  // bf16 x: each row, row segment or block is widened into scratch first; out is fp32
  // (ROW_ARGMAX: int32) either way.
  const bool bf16 = is_bf16(a.dtype);
  const float* x = F(a.x);
  float* out = F(a.out);
  if (a.op == LOOM_RED_ROW_ARGMAX) {
    const int64_t cols = a.cols, rows = a.n / a.cols, ld = a.ld > 0 ? a.ld : a.cols;
    int32_t* idx = static_cast<int32_t*>(a.out);
    d.pool->parallel_for(rows, row_grain(cols), [&](int64_t r0, int64_t r1) {
      float* w = bf16 ? scratch(0, static_cast<size_t>(cols)) : nullptr;
      for (int64_t r = r0; r < r1; ++r) {
        const float* xr = bf16 ? w : x + r * ld;
        if (bf16) d.k->bf16_to_f32(H(a.x) + r * ld, w, cols);
        idx[r] = static_cast<int32_t>(row_argmax(xr, cols));
      }
    });
    return;
  }
  if (a.op == LOOM_RED_COLUMN_SUM) {
    const int64_t cols = a.cols, rows = a.n / a.cols, ld = a.ld > 0 ? a.ld : a.cols;
    const int64_t grain = std::max<int64_t>(64, kGrain / std::max<int64_t>(1, rows));
    d.pool->parallel_for(cols, grain, [&](int64_t c0, int64_t c1) {
      const int64_t w = c1 - c0;
      thread_local std::vector<double> acc;
      acc.assign(static_cast<size_t>(w), 0.0);
      double* s = acc.data();
      float* seg = bf16 ? scratch(0, static_cast<size_t>(w)) : nullptr;
      for (int64_t r = 0; r < rows; ++r) {
        if (bf16) {
          d.k->bf16_to_f32(H(a.x) + r * ld + c0, seg, w);
          column_add(seg, s, w);
        } else {
          column_add(x + r * ld + c0, s, w);
        }
      }
      for (int64_t c = 0; c < w; ++c)
        out[c0 + c] = a.accumulate ? static_cast<float>(out[c0 + c] + s[c]) : static_cast<float>(s[c]);
    });
    return;
  }
  // Fixed blocks (independent of the thread count), partials summed in order.
  const int64_t blocks = (a.n + kReduceBlock - 1) / kReduceBlock;
  std::vector<double> partial(static_cast<size_t>(std::max<int64_t>(blocks, 1)), 0.0);
  const int32_t op = a.op;
  d.pool->parallel_for(blocks, 4, [&](int64_t b0, int64_t b1) {
    float* w = bf16 ? scratch(0, kReduceBlock) : nullptr;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t i0 = b * kReduceBlock, i1 = std::min(a.n, i0 + kReduceBlock);
      if (bf16) d.k->bf16_to_f32(H(a.x) + i0, w, i1 - i0);
      partial[static_cast<size_t>(b)] = reduce_block(op, bf16 ? w : x + i0, i1 - i0);
    }
  });
  double result = 0.0;
  if (op == LOOM_RED_MAX_ABS) {
    for (double p : partial) result = (p > result || p != p) && result == result ? p : result;
    const float r = static_cast<float>(result);
    // Accumulating a running maximum means taking the larger one.
    out[0] = a.accumulate ? ((r > out[0] || r != r) ? r : out[0]) : r;
  } else {
    for (double p : partial) result += p;
    out[0] = a.accumulate ? static_cast<float>(out[0] + result) : static_cast<float>(result);
  }
}

// ---------------------------------------------------------------------------
// AdamW
// ---------------------------------------------------------------------------

void validate(const loom_adamw_args& a) {
  op_contract::check("device/cpu", a);
}

void run_adamw(Device& d, const loom_adamw_args& a) {
  if (const int64_t count = op_contract::num_segments(a); count > 0) {  // 1.8: each segment as its own call
    const size_t grad_size = a.grad_dtype == LOOM_DTYPE_BF16 ? 2 : 4, copy_size = is_bf16(a.copy_dtype) ? 2 : 4;
    for (int64_t i = 0; i < count; ++i) {
      const loom_adamw_segment& seg = a.segments[i];
      LOOM_REQUIRE(seg.numel >= 0 && seg.param_offset >= 0 && seg.state_offset >= 0 && seg.grad_offset >= 0 &&
                       (a.param_copy == nullptr || seg.copy_offset >= 0),
                   "adamw: segment " << i << " has a negative offset or numel");
      loom_adamw_args one = a;
      one.num_segments = 0;
      one.n = seg.numel;
      one.weight_decay = seg.weight_decay;
      one.param = a.param + seg.param_offset;
      one.m = a.m + seg.state_offset;
      one.v = a.v + seg.state_offset;
      one.grad = static_cast<const char*>(a.grad) + static_cast<size_t>(seg.grad_offset) * grad_size;
      if (a.param_copy) one.param_copy = static_cast<char*>(a.param_copy) + static_cast<size_t>(seg.copy_offset) * copy_size;
      run_adamw(d, one);
    }
    return;
  }
  AdamwParams p{a.beta1, a.beta2, a.lr, a.eps, a.weight_decay, a.grad_scale, 0.0f, 0.0f};
  p.bias_correction1 = static_cast<float>(1.0 - std::pow(static_cast<double>(a.beta1), static_cast<double>(a.step)));
  p.bias_correction2 = static_cast<float>(1.0 - std::pow(static_cast<double>(a.beta2), static_cast<double>(a.step)));
  const bool bf16_grad = a.grad_dtype == LOOM_DTYPE_BF16;
  const size_t grad_size = bf16_grad ? 2 : 4;
  d.pool->parallel_for(a.n, kGrain / 4, [&](int64_t i0, int64_t i1) {
    d.k->adamw(a.param + i0, static_cast<const char*>(a.grad) + static_cast<size_t>(i0) * grad_size, bf16_grad ? 1 : 0,
               a.m + i0, a.v + i0, i1 - i0, &p);
    if (a.param_copy) {
      if (a.copy_dtype == LOOM_DTYPE_F32) {
        if (a.param_copy != a.param)
          std::memcpy(F(a.param_copy) + i0, a.param + i0, static_cast<size_t>(i1 - i0) * sizeof(float));
      } else {
        uint16_t* c = static_cast<uint16_t*>(a.param_copy);
        for (int64_t i = i0; i < i1; ++i) c[i] = f32_to_bf16(a.param[i]);
      }
    }
  });
}

// ---------------------------------------------------------------------------
// Instruction-set dispatch of the inner loops
// ---------------------------------------------------------------------------

const Kernels* select_kernels(const char* simd) {
  const std::string want = simd ? simd : "auto";
#if LOOM_CPU_X86_KERNELS
  __builtin_cpu_init();
  const bool v4 = __builtin_cpu_supports("x86-64-v4"), v3 = __builtin_cpu_supports("x86-64-v3");
#else
  const bool v4 = false, v3 = false;
#endif
  if (want == "auto") {
#if LOOM_CPU_X86_KERNELS
    if (v4) return kernels_avx512();
    if (v3) return kernels_avx2();
#endif
    return kernels_base();
  }
  if (want == "base") return kernels_base();
  if (want == "avx2" || want == "avx512") {
    const bool ok = want == "avx2" ? v3 : v4;
    if (!ok)
      throw Error("device/cpu: option simd = \"" + want + "\" needs a CPU with " +
                      (want == "avx2" ? "x86-64-v3 (AVX2, FMA)" : "x86-64-v4 (AVX-512)") +
                      ", which this one is not (or the plugin was built without x86 kernels); use \"auto\"",
                  LOOM_CODE_UNSUPPORTED);
#if LOOM_CPU_X86_KERNELS
    return want == "avx2" ? kernels_avx2() : kernels_avx512();
#endif
  }
  throw Error("device/cpu: option simd = \"" + want + "\" is not one of \"auto\", \"avx512\", \"avx2\", \"base\"",
              LOOM_CODE_INVALID_ARGUMENT);
}

}  // namespace loom::cpu
