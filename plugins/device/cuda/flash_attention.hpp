// device/cuda: fused ("flash") attention for bf16 storage (flash_attention.cu).
// Plain C++ declarations, like kernels.hpp: the host translation units never see
// device code.
//
// The algorithm is FlashAttention-2's (Dao, "FlashAttention-2: Faster Attention with
// Better Parallelism and Work Partitioning", 2023): tiles of 64 queries and 64 keys
// in shared memory, the scores of a tile only in registers, an online softmax, and
// only the log-sum-exp of each row kept for the backward pass. Causal tiles past the
// diagonal are skipped. The backward pass is two kernels without atomics (one over
// key tiles for dK and dV, one over query tiles for dQ), so results are the same
// run to run. The matrix products are mma.sync bf16 x bf16 -> fp32 (sm_80 and newer).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace loom::cuda {

// One attention call, in elements; the layout of loom_attention_args (resolved:
// kv_seq, q_offset and the kv strides are set). All tensors are bf16.
struct FlashArgs {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  const uint16_t* out;  // forward: written (through out_w); backward: read
  uint16_t* out_w;
  float* lse;           // [batch, heads, seq], natural log
  const uint16_t* dout;
  uint16_t* dq;
  uint16_t* dk;
  uint16_t* dv;
  float* dvec;          // backward scratch [batch, heads, seq]: rowsum(dout o out)
  int64_t q_sb, q_ss;   // q, dq
  int64_t kv_sb, kv_ss; // k, v, dk, dv
  int64_t o_sb, o_ss;   // out, dout
  int batch, heads, seq, kv_seq, q_offset;
  float scale;
  int causal;
  int accumulate_dkv;
  int window;           // causal: keys (p - window, p] for the query at position p; 0: every earlier key
  const int32_t* key_start;  // causal, [batch, seq] or NULL: each query's document's first key
};

// Whether the fused kernels take this head size (64 and 128).
bool flash_head_dim_supported(int64_t head_dim);
// Raises the kernels' shared-memory limits on the current GPU (once per device,
// before the first launch; not a stream operation).
cudaError_t flash_prepare();
cudaError_t k_flash_fwd(cudaStream_t s, int head_dim, const FlashArgs& a);
// dvec must hold batch * heads * seq floats.
cudaError_t k_flash_bwd(cudaStream_t s, int head_dim, const FlashArgs& a);

}  // namespace loom::cuda
