// The device op table's argument contract, the same for every device plugin:
// what makes a loom_gemm_args, loom_xent_args, ... valid (sizes, strides, NULL
// pointers, op codes, f32/bf16 storage). Each device calls check() first and then
// adds only its own limits (32-bit sizes for BLAS, one CUDA block per row, ...).
// Errors are loom::Error with one line naming the op; `device` ("device/cpu")
// names the plugin in unsupported-dtype messages.
#pragma once

#include <loom/cpp/core.hpp>

namespace loom::op_contract {

const char* dtype_name(int32_t dtype);  // "f32", "bf16", ...
const char* ew_name(int32_t op);        // "elementwise(ADD)", ...

// Throw UNSUPPORTED naming the op, the field and the dtype unless it is f32
// (require_f32) or f32/bf16 storage (require_float).
void require_f32(const char* device, const char* op, const char* what, int32_t dtype);
void require_float(const char* device, const char* op, const char* what, int32_t dtype);

// The dtype of the parameter gradients a layernorm_bwd / embedding_bwd accumulates:
// fp32 when the caller set grad_fp32 (ABI 1.2), else the op's dtype. A caller built
// for 1.1 passes a struct without the member: its gradients are of dtype.
int32_t grad_dtype(const loom_layernorm_bwd_args& a);
int32_t grad_dtype(const loom_embedding_args& a);
int32_t grad_dtype(const loom_rmsnorm_bwd_args& a);

// The attention args with ABI 1.6's query window resolved: kv_seq = 0 (a caller
// before 1.6, or no window) becomes kv_seq = seq, q_offset = 0 and k, v with the
// qkv strides. Devices run the resolved form; check() validates it.
loom_attention_args resolved(const loom_attention_args& a);

// ABI 1.8's multi-tensor calls: the number of segments, 0 for a single tensor (or a
// caller before 1.8, whose struct ends before the member).
int64_t num_segments(const loom_reduce_args& a);
// The reduction a gemm's BIAS_GRAD epilogue adds to aux: COLUMN_SUM of B ([k, n], ldb)
// into fp32; out and accumulate are the caller's.
loom_reduce_args bias_grad_sums(const loom_gemm_args& g);
int64_t num_segments(const loom_adamw_args& a);

void check(const char* device, const loom_gemm_args& g);
void check(const char* device, const loom_layernorm_fwd_args& a);
void check(const char* device, const loom_layernorm_bwd_args& a);
void check(const char* device, const loom_gelu_args& a, bool backward);
void check(const char* device, const loom_attention_args& a, bool backward);
void check(const char* device, const loom_xent_args& a);
void check(const char* device, const loom_embedding_args& a, bool backward);
void check(const char* device, const loom_elementwise_args& a);
void check(const char* device, const loom_reduce_args& a);
void check(const char* device, const loom_adamw_args& a);
void check(const char* device, const loom_rmsnorm_fwd_args& a);
void check(const char* device, const loom_rmsnorm_bwd_args& a);
void check(const char* device, const loom_swiglu_args& a, bool backward);
void check(const char* device, const loom_rope_args& a, bool backward);
void check(const char* device, const loom_activation_args& a, const char* op, bool backward);

}  // namespace loom::op_contract
