// The ops of Llama-style blocks (ABI 1.10): RMSNorm, SwiGLU, rotary embedding and
// sigmoid. fp32 math; bf16 tensors are widened a row (or a head) at a time into
// thread-local scratch and the results rounded once, as the other ops do. Rows are
// spread over the pool; every sum runs in a fixed order (per row, or per column
// over the rows in order), so results do not depend on the number of threads.
#include <cmath>
#include <vector>

#include "cpu_device.hpp"
#include "cpu_math.hpp"

namespace loom::cpu {

namespace {

constexpr int64_t kGrain = 1 << 15;  // elements per parallel chunk, at least

int64_t row_grain(int64_t cols) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(1, cols)); }

// A row of a tensor of either dtype as fp32: the tensor's own memory for f32, a
// widened copy in scratch slot `slot` for bf16.
const float* row_in(const Device& d, const void* base, int64_t offset, int64_t n, bool bf16, int slot) {
  if (!bf16) return static_cast<const float*>(base) + offset;
  float* s = scratch(slot, static_cast<size_t>(n));
  d.k->bf16_to_f32(static_cast<const uint16_t*>(base) + offset, s, n);
  return s;
}

// Where a row's fp32 results go: the tensor itself for f32, scratch for bf16 (then
// row_out_done rounds them into the tensor).
float* row_out(void* base, int64_t offset, int64_t n, bool bf16, int slot) {
  if (!bf16) return static_cast<float*>(base) + offset;
  return scratch(slot, static_cast<size_t>(n));
}
void row_out_done(const Device& d, const float* row, void* base, int64_t offset, int64_t n, bool bf16) {
  if (bf16) d.k->f32_to_bf16(row, static_cast<uint16_t*>(base) + offset, n);
}

// In double, rounded once to fp32 (devices agree to within that rounding).
float sigmoid(float v) { return static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(v)))); }

}  // namespace

// ---------------------------------------------------------------------------
// RMSNorm
// ---------------------------------------------------------------------------

void validate(const loom_rmsnorm_fwd_args& a) { op_contract::check("device/cpu", a); }
void validate(const loom_rmsnorm_bwd_args& a) { op_contract::check("device/cpu", a); }

void run_rmsnorm_fwd(Device& d, const loom_rmsnorm_fwd_args& a) {
  const int64_t cols = a.cols;
  const bool bf16 = is_bf16(a.dtype);
  d.pool->parallel_for(a.rows, row_grain(cols), [&](int64_t r0, int64_t r1) {
    const float* gamma = row_in(d, a.gamma, 0, cols, bf16, 0);
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = row_in(d, a.x, r * cols, cols, bf16, 1);
      double ss = 0.0;
      for (int64_t c = 0; c < cols; ++c) ss += static_cast<double>(x[c]) * x[c];
      const float rstd = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(cols) + a.eps));
      float* y = row_out(a.y, r * cols, cols, bf16, 2);
      for (int64_t c = 0; c < cols; ++c) y[c] = x[c] * rstd * gamma[c];
      row_out_done(d, y, a.y, r * cols, cols, bf16);
      if (a.rstd) a.rstd[r] = rstd;
    }
  });
}

void run_rmsnorm_bwd(Device& d, const loom_rmsnorm_bwd_args& a) {
  const int64_t rows = a.rows, cols = a.cols;
  const bool bf16 = is_bf16(a.dtype);
  // dgamma first (dx may overwrite dy in place): columns over the pool, each
  // column summed over the rows in order, in double.
  if (a.dgamma) {
    const bool grad_f32 = op_contract::grad_dtype(a) == LOOM_DTYPE_F32;
    const int64_t col_grain = std::max<int64_t>(64, kGrain / std::max<int64_t>(1, rows));
    d.pool->parallel_for(cols, col_grain, [&](int64_t c0, int64_t c1) {
      const int64_t w = c1 - c0;
      std::vector<double> acc(static_cast<size_t>(w), 0.0);
      for (int64_t r = 0; r < rows; ++r) {
        const float* x = row_in(d, a.x, r * cols + c0, w, bf16, 0);
        const float* dy = row_in(d, a.dy, r * cols + c0, w, bf16, 1);
        for (int64_t c = 0; c < w; ++c) acc[static_cast<size_t>(c)] += static_cast<double>(dy[c] * (x[c] * a.rstd[r]));
      }
      for (int64_t c = 0; c < w; ++c) {
        const float sum = static_cast<float>(acc[static_cast<size_t>(c)]);
        if (grad_f32) static_cast<float*>(a.dgamma)[c0 + c] += sum;
        else if (bf16) {
          uint16_t& g = static_cast<uint16_t*>(a.dgamma)[c0 + c];
          g = f32_to_bf16(bf16_to_f32(g) + sum);
        } else {
          static_cast<float*>(a.dgamma)[c0 + c] += sum;
        }
      }
    });
  }
  if (a.dx == nullptr) return;
  // dx = rstd * (g*dy - xhat * mean(g*dy * xhat)), xhat = x * rstd.
  d.pool->parallel_for(rows, row_grain(cols), [&](int64_t r0, int64_t r1) {
    const float* gamma = row_in(d, a.gamma, 0, cols, bf16, 0);
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = row_in(d, a.x, r * cols, cols, bf16, 1);
      const float* dy = row_in(d, a.dy, r * cols, cols, bf16, 2);
      const float rstd = a.rstd[r];
      double dot = 0.0;
      for (int64_t c = 0; c < cols; ++c) dot += static_cast<double>(gamma[c] * dy[c]) * (x[c] * rstd);
      const float mean = static_cast<float>(dot / static_cast<double>(cols));
      float* dx = row_out(a.dx, r * cols, cols, bf16, 3);
      if (bf16 && a.accumulate_dx) d.k->bf16_to_f32(static_cast<const uint16_t*>(a.dx) + r * cols, dx, cols);
      for (int64_t c = 0; c < cols; ++c) {
        const float v = rstd * (gamma[c] * dy[c] - x[c] * rstd * mean);
        dx[c] = a.accumulate_dx ? dx[c] + v : v;
      }
      row_out_done(d, dx, a.dx, r * cols, cols, bf16);
    }
  });
}

// ---------------------------------------------------------------------------
// SwiGLU
// ---------------------------------------------------------------------------

void validate_swiglu(const loom_swiglu_args& a, bool backward) { op_contract::check("device/cpu", a, backward); }

void run_swiglu_fwd(Device& d, const loom_swiglu_args& a) {
  const int64_t cols = a.cols;
  const bool bf16 = is_bf16(a.dtype);
  d.pool->parallel_for(a.rows, row_grain(2 * cols), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = row_in(d, a.x, r * 2 * cols, 2 * cols, bf16, 0);
      float* out = row_out(a.out, r * cols, cols, bf16, 1);
      for (int64_t c = 0; c < cols; ++c) {
        const float g = x[c], u = x[cols + c];
        out[c] = g * sigmoid(g) * u;
      }
      row_out_done(d, out, a.out, r * cols, cols, bf16);
    }
  });
}

void run_swiglu_bwd(Device& d, const loom_swiglu_args& a) {
  const int64_t cols = a.cols;
  const bool bf16 = is_bf16(a.dtype);
  d.pool->parallel_for(a.rows, row_grain(2 * cols), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = row_in(d, a.x, r * 2 * cols, 2 * cols, bf16, 0);
      const float* dy = row_in(d, a.dy, r * cols, cols, bf16, 1);
      float* dx = row_out(a.out, r * 2 * cols, 2 * cols, bf16, 2);
      for (int64_t c = 0; c < cols; ++c) {
        const float g = x[c], u = x[cols + c], s = sigmoid(g);
        const float dsilu = s * (1.0f + g * (1.0f - s));  // d(g * sigmoid(g)) / dg
        const float dgate = dy[c] * u * dsilu, dup = dy[c] * g * s;
        dx[c] = dgate;
        dx[cols + c] = dup;
      }
      row_out_done(d, dx, a.out, r * 2 * cols, 2 * cols, bf16);
    }
  });
}

// ---------------------------------------------------------------------------
// Rotary position embedding
// ---------------------------------------------------------------------------

void validate_rope(const loom_rope_args& a, bool backward) { op_contract::check("device/cpu", a, backward); }

namespace {

// inv_freq[i] = theta^(-2i / rotary_dim), i < rotary_dim / 2, computed in double and
// rounded once (the same table on every device); or the caller's (ABI 1.20).
std::vector<float> rope_frequencies(const loom_rope_args& a) {
  std::vector<float> f(static_cast<size_t>(a.rotary_dim / 2));
  if (a.inv_freq != nullptr) return std::vector<float>(a.inv_freq, a.inv_freq + f.size());
  for (size_t i = 0; i < f.size(); ++i)
    f[i] = static_cast<float>(std::pow(static_cast<double>(a.theta),
                                       -2.0 * static_cast<double>(i) / static_cast<double>(a.rotary_dim)));
  return f;
}

void run_rope(Device& d, const loom_rope_args& a, float sign) {
  const bool bf16 = is_bf16(a.dtype);
  const int64_t half = a.rotary_dim / 2, D = a.head_dim;
  const std::vector<float> inv_freq = rope_frequencies(a);
  d.pool->parallel_for(a.tokens, row_grain(a.heads * D), [&](int64_t t0, int64_t t1) {
    float* cs = scratch(3, static_cast<size_t>(2 * half));  // cos | sin of this token's angles
    for (int64_t t = t0; t < t1; ++t) {
      const float p = static_cast<float>(a.positions[t]);
      for (int64_t i = 0; i < half; ++i) {
        const double angle = static_cast<double>(p * inv_freq[static_cast<size_t>(i)]);  // fp32 angle, as Megatron's
        cs[i] = static_cast<float>(std::cos(angle));
        cs[half + i] = sign * static_cast<float>(std::sin(angle));
      }
      for (int64_t h = 0; h < a.heads; ++h) {
        const int64_t off = t * a.stride_t + h * D;
        const float* x = row_in(d, a.x, off, D, bf16, 0);
        float* y = row_out(a.out, off, D, bf16, 1);
        for (int64_t i = 0; i < half; ++i) {
          const float u = x[i], v = x[half + i], c = cs[i], s = cs[half + i];
          y[i] = u * c - v * s;
          y[half + i] = v * c + u * s;
        }
        if (y != x)
          for (int64_t k = a.rotary_dim; k < D; ++k) y[k] = x[k];
        row_out_done(d, y, a.out, off, D, bf16);
      }
    }
  });
}

}  // namespace

void run_rope_fwd(Device& d, const loom_rope_args& a) { run_rope(d, a, 1.0f); }
void run_rope_bwd(Device& d, const loom_rope_args& a) { run_rope(d, a, -1.0f); }

// ---------------------------------------------------------------------------
// Sigmoid
// ---------------------------------------------------------------------------

void validate_sigmoid(const loom_activation_args& a, bool backward) {
  op_contract::check("device/cpu", a, backward ? "sigmoid_bwd" : "sigmoid_fwd", backward);
}

namespace {
void run_sigmoid(Device& d, const loom_activation_args& a, bool backward) {
  const bool bf16 = is_bf16(a.dtype);
  constexpr int64_t kBlock = 4096;
  const int64_t blocks = (a.n + kBlock - 1) / kBlock;
  d.pool->parallel_for(blocks, std::max<int64_t>(1, kGrain / kBlock), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t i0 = b * kBlock, n = std::min(kBlock, a.n - i0);
      const float* x = row_in(d, a.x, i0, n, bf16, 0);
      const float* dy = backward ? row_in(d, a.dy, i0, n, bf16, 1) : nullptr;
      float* out = row_out(a.out, i0, n, bf16, 2);
      for (int64_t i = 0; i < n; ++i) {
        const float s = sigmoid(x[i]);
        out[i] = backward ? dy[i] * (s * (1.0f - s)) : s;
      }
      row_out_done(d, out, a.out, i0, n, bf16);
    }
  });
}
}  // namespace

void run_sigmoid_fwd(Device& d, const loom_activation_args& a) { run_sigmoid(d, a, false); }
void run_sigmoid_bwd(Device& d, const loom_activation_args& a) { run_sigmoid(d, a, true); }

}  // namespace loom::cpu
