// The inner loops of the non-GEMM ops, compiled three times (kernels_base.cpp,
// kernels_avx2.cpp with -march=x86-64-v3, kernels_avx512.cpp with
// -march=x86-64-v4) and picked at run time from the CPU's features, the way
// OpenBLAS dispatches its GEMM kernels. The plugin itself is built without -march.
// Each variant is deterministic; variants may differ in the last bits (FMA).
#pragma once

#include <cstdint>

namespace loom::cpu {

struct AdamwParams {
  float beta1, beta2, lr, eps, weight_decay, grad_scale;
  float bias_correction1, bias_correction2;  // 1 - beta^step
};

struct Kernels {
  const char* name;  // "avx512", "avx2", "base"
  // y = gelu(x); dx = dy * gelu'(x) (tanh approximation). In place is fine.
  void (*gelu_fwd)(const float* x, float* y, int64_t n);
  void (*gelu_bwd)(const float* x, const float* dy, float* dx, int64_t n);
  // Softmax of row[0, valid) in place, row[valid, n) = 0; returns the log-sum-exp.
  float (*softmax_row)(float* row, int64_t valid, int64_t n);
  // row[j] = exp(row[j] - shift) for j < valid, 0 for valid <= j < n.
  void (*exp_shift_row)(float* row, int64_t valid, int64_t n, float shift);
  // dp[j] = p[j] * (dp[j] - d).
  void (*softmax_grad_row)(const float* p, float* dp, int64_t n, float d);
  float (*dot)(const float* a, const float* b, int64_t n);
  // max_j x[j] (-inf when n == 0); sum_j exp(x[j] - shift) in double;
  // g[j] = k * exp(x[j] - shift).
  float (*row_max)(const float* x, int64_t n);
  double (*sum_exp)(const float* x, int64_t n, float shift);
  void (*scaled_exp)(const float* x, float* g, int64_t n, float shift, float k);
  // One layernorm row; gamma/beta may be NULL (1 and 0).
  void (*layernorm_row)(const float* x, const float* gamma, const float* beta, float* y, int64_t n, float eps,
                        float* mean, float* rstd);
  // dx (or +=) of one row.
  void (*layernorm_bwd_row)(const float* x, const float* dy, const float* gamma, float* dx, int64_t n, float mean,
                            float rstd, int32_t accumulate);
  // ag[c] += dy[c] * xhat[c], ab[c] += dy[c] over one row's column range.
  void (*layernorm_bwd_cols)(const float* x, const float* dy, int64_t n, float mean, float rstd, double* ag,
                             double* ab);
  // Dropout over indices lo0 + i (i < n, no wrap of the low 32 bits) of the stream
  // (k0, hi_k1 = index_hi ^ k1): mask[i] = keep, out[i] = keep ? x[i] * scale : 0.
  void (*dropout)(const float* x, uint8_t* mask, float* out, int64_t n, uint32_t lo0, uint32_t k0, uint32_t hi_k1,
                  uint32_t threshold, float scale);
  // One AdamW chunk; grad is f32 or (grad_bf16) bf16 bits.
  void (*adamw)(float* param, const void* grad, int32_t grad_bf16, float* m, float* v, int64_t n, const AdamwParams* p);
  // bf16 storage: y[i] = x[i] widened (exact), and y[i] = x[i] rounded to nearest even.
  void (*bf16_to_f32)(const uint16_t* x, float* y, int64_t n);
  void (*f32_to_bf16)(const float* x, uint16_t* y, int64_t n);
};

const Kernels* kernels_base();
const Kernels* kernels_avx2();    // needs x86-64-v3 (AVX2, FMA, BMI2, F16C, ...)
const Kernels* kernels_avx512();  // needs x86-64-v4 (AVX-512 F/BW/CD/DQ/VL)

// "auto" (the best this CPU runs), "avx512", "avx2" or "base"; throws loom::Error
// when the CPU cannot run the one asked for.
const Kernels* select_kernels(const char* simd);

}  // namespace loom::cpu
