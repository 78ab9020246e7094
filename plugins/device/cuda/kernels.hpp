// device/cuda: the launchers of the CUDA kernels (kernels.cu). Plain C++
// declarations so the host translation units (compiled by the host compiler with
// the project's warnings) never include device code. Every launcher enqueues on
// `stream` and returns cudaGetLastError() after its launches; the caller turns a
// failure into a status naming the op and the rank.
//
// Float tensors are stored as fp32 or bf16 (`Dt`); every kernel computes in fp32
// (sums in fp64 where the CPU reference does) and rounds to bf16 on store, to
// nearest even, exactly as device/cpu's cast does.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace loom::cuda {

enum class Dt : int { F32 = 0, BF16 = 1 };

// Rows of partial column sums used by the deterministic two-pass column reductions.
int64_t column_chunks(int64_t rows);
// Blocks of the deterministic two-pass scalar reductions (depends on n only).
int64_t reduce_blocks(int64_t n);

cudaError_t k_layernorm_fwd(cudaStream_t s, Dt dt, int64_t rows, int64_t cols, const void* x, const void* gamma,
                            const void* beta, void* y, float* mean, float* rstd, float eps);
// dx (or +=) per row; in place over dy is fine.
cudaError_t k_layernorm_bwd_dx(cudaStream_t s, Dt dt, int64_t rows, int64_t cols, const void* dy, const void* x,
                               const void* gamma, const float* mean, const float* rstd, void* dx, int accumulate);
// partial[2 * chunks * cols] (fp64): dgamma partials then dbeta partials; then
// dgamma/dbeta (either may be null) += the sums over chunks, in chunk order.
// dy, x are of `dt`; dgamma, dbeta of `grad_dt` (op_contract::grad_dtype: dt, or
// fp32 under bf16 with grad_fp32; fp32 dt with bf16 grad_dt is cudaErrorInvalidValue).
cudaError_t k_layernorm_bwd_params(cudaStream_t s, Dt dt, Dt grad_dt, int64_t rows, int64_t cols, const void* dy,
                                   const void* x, const float* mean, const float* rstd, double* partial,
                                   int64_t chunks, void* dgamma, void* dbeta);

cudaError_t k_gelu(cudaStream_t s, Dt dt, bool backward, int64_t n, const void* x, const void* dy, void* out);

// ABI 1.10. RMSNorm: forward y and rstd; dx (or +=) per row, in
// place over dy is fine; dgamma += the column sums of dy * x * rstd through
// partial[chunks * cols] (fp64), chunk by chunk in order (as layernorm_bwd_params).
cudaError_t k_rmsnorm_fwd(cudaStream_t s, Dt dt, int64_t rows, int64_t cols, const void* x, const void* gamma, void* y,
                          float* rstd, float eps);
cudaError_t k_rmsnorm_bwd_dx(cudaStream_t s, Dt dt, int64_t rows, int64_t cols, const void* dy, const void* x,
                             const void* gamma, const float* rstd, void* dx, int accumulate);
cudaError_t k_rmsnorm_bwd_dgamma(cudaStream_t s, Dt dt, Dt grad_dt, int64_t rows, int64_t cols, const void* dy,
                                 const void* x, const float* rstd, double* partial, int64_t chunks, void* dgamma);
// SwiGLU over x = [rows, gate | up]; backward writes dx [rows, 2 * cols].
cudaError_t k_swiglu(cudaStream_t s, Dt dt, bool backward, int64_t rows, int64_t cols, const void* x, const void* dy,
                     void* out);
// Rotary embedding; sign +1 forward, -1 backward; inv_freq (device, [rotary_dim / 2]) or
// NULL for theta's frequencies.
cudaError_t k_rope(cudaStream_t s, Dt dt, int64_t tokens, int64_t heads, int64_t head_dim, int64_t rotary_dim,
                   int64_t stride_t, const void* x, void* out, const int32_t* positions, float theta,
                   const float* inv_freq, float sign);
cudaError_t k_sigmoid(cudaStream_t s, Dt dt, bool backward, int64_t n, const void* x, const void* dy, void* out);

// Attention pieces over one batch element: `rows` = heads * q_rows rows of `cols`
// scores each (row r = h * q_rows + i is query i of head h, at key position
// q_offset + i: ABI 1.6's query window; q_offset = 0 and cols = q_rows without one).
//  softmax_fwd: p = softmax(scores) in place (masked j > q_offset + i when causal, and
//               j <= q_offset + i - window with a sliding window > 0, j < key_start[i]
//               with documents: key_start [q_rows] or NULL; 0 there),
//               lse[r] = max + log(sum); pb (optional) gets p in bf16.
//  softmax_p:   p = exp(scores - lse[r]) in place (masked), pb optional.
//  rowdot:      dvec[r] = sum_d out[i, h, d] * dout[i, h, d] (strided layout; seq = q_rows).
//  dsoftmax:    dp = p * (dp - dvec[r]) in place; dsb (optional) gets it in bf16.
cudaError_t k_softmax_fwd(cudaStream_t s, int64_t rows, int64_t q_rows, int64_t cols, int64_t q_offset, bool causal,
                          int64_t window, const int32_t* key_start, float* scores, uint16_t* pb, float* lse);
cudaError_t k_softmax_p(cudaStream_t s, int64_t rows, int64_t q_rows, int64_t cols, int64_t q_offset, bool causal,
                        int64_t window, const int32_t* key_start, float* scores, uint16_t* pb, const float* lse);
cudaError_t k_rowdot(cudaStream_t s, Dt dt, int64_t heads, int64_t seq, int64_t head_dim, int64_t stride_s,
                     const void* out, const void* dout, float* dvec);
cudaError_t k_dsoftmax(cudaStream_t s, int64_t rows, int64_t cols, const float* p, float* dp, const float* dvec,
                       uint16_t* dsb);

// One step of the cross-entropy (LOOM_XENT_*); see loom_xent_args.
cudaError_t k_xent(cudaStream_t s, Dt dt, int step, int64_t rows, int64_t cols, int64_t ld, int64_t valid,
                   int64_t vocab_start, const void* logits, const int32_t* targets, float* row_max,
                   float* row_sumexp, float* target_logit, float* loss, void* dlogits, float scale);

cudaError_t k_embedding_fwd(cudaStream_t s, Dt dt, int64_t n, int64_t dim, int64_t vocab_rows, int64_t vocab_start,
                            const int32_t* ids, const void* table, void* out, int accumulate);
// dout of `dt` scattered into an fp32 table with float atomics.
cudaError_t k_embedding_bwd(cudaStream_t s, Dt dt, int64_t n, int64_t dim, int64_t vocab_rows, int64_t vocab_start,
                            const int32_t* ids, const void* dout, float* dtable);

struct EwParams {
  int op;  // LOOM_EW_* except CAST
  int64_t n, cols;
  const void* x;
  void* y;
  void* out;
  float alpha, beta;
  float keep_scale;     // dropout: 1 / (1 - p), or 0 when p = 1
  uint32_t threshold;   // dropout: drop when the 24 random bits are below it
  uint32_t key0, key1;  // dropout: the halves of mix64(seed)
  uint64_t offset;      // dropout: index of element 0 in the stream
  // dropout with loom_elementwise_args.seed_device: the key is derived in the kernel
  // from loom_mix64(seed ^ loom_mix64(*seed_device)) instead of key0/key1.
  const uint64_t* seed_device;
  uint64_t seed;
};
cudaError_t k_elementwise(cudaStream_t s, Dt dt, const EwParams& p);
cudaError_t k_cast(cudaStream_t s, Dt from, Dt to, int64_t n, const void* x, void* out);

// SUM / SUM_SQUARES / MAX_ABS into out[0] (fp32), through partial[reduce_blocks(n)].
cudaError_t k_reduce_scalar(cudaStream_t s, Dt dt, int op, int64_t n, const void* x, double* partial, float* out,
                            int accumulate);
// out[c] (+)= sum_r x[r * ld + c], through partial[column_chunks(rows) * cols].
cudaError_t k_column_sum(cudaStream_t s, Dt dt, int64_t rows, int64_t cols, int64_t ld, const void* x,
                         double* partial, float* out, int accumulate);
cudaError_t k_row_argmax(cudaStream_t s, Dt dt, int64_t rows, int64_t cols, int64_t ld, const void* x, int32_t* out);

struct AdamwParams {
  float lr, beta1, beta2, eps, weight_decay, grad_scale;
  float bias_correction1, bias_correction2;  // 1 - beta^step, computed in double on the host
};
cudaError_t k_adamw(cudaStream_t s, int64_t n, float* param, const void* grad, Dt grad_dt, float* m, float* v,
                    const AdamwParams& p, void* param_copy, Dt copy_dt);

// ABI 1.8's multi-tensor segments, mirrored (ops.cpp checks the layouts match
// loom_adamw_segment and loom_reduce_segment).
struct AdamwSegment {
  int64_t param_offset, state_offset, grad_offset, copy_offset, numel;
  float weight_decay;
  int32_t reserved;
};
struct ReduceSegment {
  int64_t offset, numel;
};
// Every segment of a device-resident table in one launch: AdamW as k_adamw would run
// each (the same values), and SUM / SUM_SQUARES / MAX_ABS of each into out[i] through
// partial[count * multi_reduce_blocks()] (fixed blocks: the same sums every run).
int64_t multi_reduce_blocks();
cudaError_t k_adamw_multi(cudaStream_t s, int64_t count, const AdamwSegment* segments, float* param, const void* grad,
                          Dt grad_dt, float* m, float* v, const AdamwParams& p, void* param_copy, Dt copy_dt);
cudaError_t k_reduce_multi(cudaStream_t s, Dt dt, int op, int64_t count, const ReduceSegment* segments,
                           const void* x, double* partial, float* out, int accumulate);

// C = beta * C over a batch of m x n blocks (beta = 0 writes zeros whatever C held):
// GEMMs with k = 0 or alpha = 0.
cudaError_t k_scale_matrix(cudaStream_t s, Dt dt, int64_t m, int64_t n, int64_t ldc, int64_t stride_c, int64_t batch,
                           float beta, void* c);

// dst[b*sd + i*ldd + j] = src[b*ss + i*lds + j] over a batch of m x n blocks,
// converted between storage types (bf16 rounded to nearest even).
cudaError_t k_copy_matrix(cudaStream_t s, Dt from, Dt to, int64_t m, int64_t n, int64_t batch, const void* src,
                          int64_t lds, int64_t ss, void* dst, int64_t ldd, int64_t sd);

}  // namespace loom::cuda
