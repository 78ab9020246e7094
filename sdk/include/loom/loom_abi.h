/*
 * loom_abi.h — the loom plugin ABI. C99; the only normative interface between
 * the engine and its plugins.
 *
 * Rules (see docs/abi.md):
 *  - Only fixed-width integers, size_t, UTF-8 const char*, POD structs, function
 *    pointers and opaque handles cross this boundary.
 *  - One exported entry symbol per ABI major: loom_plugin_init_v1.
 *  - Every table and every growing argument struct begins with uint32_t
 *    struct_size; new members are appended only (a minor version bump), after
 *    the old struct's tail padding (an old caller's struct_size covers it). A NULL
 *    function slot means "not implemented". Each side reads only what the other
 *    side's struct_size covers (LOOM_HAS_SLOT below).
 *  - Errors are loom_status objects created by the host (NULL = success).
 *    Nothing throws across the boundary, and a plugin never aborts the process.
 *  - Whoever allocates frees. Borrowed pointers live for the duration of a call.
 *  - Tensors crossing the layer interface are DLPack DLTensor views.
 */
#ifndef LOOM_ABI_H
#define LOOM_ABI_H

#include <stddef.h>
#include <stdint.h>

#include <dlpack/dlpack.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LOOM_ABI_MAJOR 1
#define LOOM_ABI_MINOR 9

/* The one symbol a plugin library exports for ABI major 1. */
#define LOOM_PLUGIN_ENTRY_V1 "loom_plugin_init_v1"

/* True when a table of `struct_size` bytes covers member `slot` of `type`. */
#define LOOM_HAS_SLOT(table_ptr, type, slot) \
  ((table_ptr) != NULL &&                    \
   (table_ptr)->struct_size >= offsetof(type, slot) + sizeof(((type*)0)->slot))

/* ------------------------------------------------------------------------- */
/* Status                                                                     */
/* ------------------------------------------------------------------------- */

/* Opaque error object, created and freed by the host. NULL means success. */
typedef struct loom_status_s* loom_status;

#define LOOM_CODE_OK 0
#define LOOM_CODE_INVALID_ARGUMENT 1
#define LOOM_CODE_UNSUPPORTED 2
#define LOOM_CODE_OUT_OF_MEMORY 3
#define LOOM_CODE_INTERNAL 4
#define LOOM_CODE_TIMEOUT 5
#define LOOM_CODE_IO 6
#define LOOM_CODE_NOT_FOUND 7

#define LOOM_LOG_INFO 0
#define LOOM_LOG_WARNING 1
#define LOOM_LOG_ERROR 2

/* ------------------------------------------------------------------------- */
/* Data types, element-wise and reduction ops                                 */
/* ------------------------------------------------------------------------- */

#define LOOM_DTYPE_F32 0
#define LOOM_DTYPE_BF16 1
#define LOOM_DTYPE_F16 2
#define LOOM_DTYPE_I32 3
#define LOOM_DTYPE_I64 4
#define LOOM_DTYPE_U8 5
#define LOOM_DTYPE_F64 6

#define LOOM_REDUCE_SUM 0
#define LOOM_REDUCE_MAX 1
#define LOOM_REDUCE_MIN 2
#define LOOM_REDUCE_AVG 3

/* ------------------------------------------------------------------------- */
/* Options: each plugin declares a schema; the engine validates the manifest  */
/* section against it and hands the resolved values back through the host.   */
/* ------------------------------------------------------------------------- */

#define LOOM_OPTION_BOOL 1
#define LOOM_OPTION_INT 2
#define LOOM_OPTION_FLOAT 3
#define LOOM_OPTION_STRING 4

/* An array of these is read with a stride of options[0].struct_size, and every
 * element must carry the same struct_size, so a library built against an older
 * header (a smaller struct) is read correctly. The engine checks each value of the
 * manifest against `range` and `choices` before any plugin is created (`loom
 * validate` reports it with the file and line), and refuses at load a library
 * whose default lies outside them or whose range does not parse. */
typedef struct loom_option_decl {
  uint32_t struct_size;
  int32_t type;                /* LOOM_OPTION_* */
  const char* name;            /* key inside the plugin's manifest section */
  const char* default_value;   /* TOML literal ("4", "true", "\"gelu\""); NULL = required */
  const char* doc;             /* one line */
  /* --- 1.9 --- */
  const char* range;           /* INT and FLOAT: the allowed interval, "[0, 1)", "[1, inf)",
                                  "(0, 10]" ('[' ']' include the bound, '(' ')' exclude it;
                                  "inf" or nothing = unbounded); NULL = any finite value */
  const char* choices;         /* STRING: the allowed values separated by '|', e.g.
                                  "probs|position"; NULL = any string */
} loom_option_decl;

/* Resolved options of one plugin instance (opaque, owned by the host). */
typedef struct loom_options_s loom_options;

/* ------------------------------------------------------------------------- */
/* Opaque handles                                                             */
/* ------------------------------------------------------------------------- */

typedef struct loom_rank_s loom_rank;        /* a rank's runtime, owned by the host */
typedef struct loom_device_s loom_device;    /* a device instance, owned by its plugin */
typedef struct loom_stream_s loom_stream;
typedef struct loom_event_s loom_event;
typedef struct loom_graph_s loom_graph;
typedef struct loom_comm_world_s loom_comm_world;
typedef struct loom_comm_s loom_comm;
typedef struct loom_layer_s loom_layer;
typedef struct loom_optimizer_s loom_optimizer;
typedef struct loom_exec_s loom_exec;

/* ------------------------------------------------------------------------- */
/* Device plugins: memory, streams, events, graphs and the op table.          */
/* All op arguments are device pointers of the device that runs the op.       */
/* Matrices are row-major; ld* are leading dimensions in elements.            */
/* ------------------------------------------------------------------------- */

#define LOOM_COPY_HOST_TO_DEVICE 0
#define LOOM_COPY_DEVICE_TO_HOST 1
#define LOOM_COPY_DEVICE_TO_DEVICE 2

typedef struct loom_memory_stats {
  uint32_t struct_size;
  uint64_t current_bytes;   /* live allocations */
  uint64_t peak_bytes;      /* high-water mark of current_bytes */
  uint64_t reserved_bytes;  /* held by the allocator (>= current) */
  uint64_t num_allocs;      /* allocations made so far */
  /* --- 1.9 --- */
  uint64_t capacity_bytes;  /* what this rank may plan to hold: the memory the device allocates
                               from (the GPU's; the host's RAM for a CPU device) divided among
                               the ranks of this process that share it (create args'
                               ranks_in_process); 0 = unknown. The engine compares its memory
                               plan with it before a run allocates anything. */
} loom_memory_stats;

typedef struct loom_device_create_args {
  uint32_t struct_size;
  int32_t global_rank;
  int32_t local_rank;       /* rank within this process/node: picks the GPU */
  int32_t num_threads;      /* host threads this rank may use (CPU math) */
  int32_t ranks_in_process; /* how many ranks share this process */
} loom_device_create_args;

/* C = alpha * op(A) * op(B) + beta * C, batched with element strides.
 * op(A) is m x k, op(B) is k x n, C is m x n; all row-major. */
typedef struct loom_gemm_args {
  uint32_t struct_size;
  int32_t trans_a, trans_b;      /* 0 or 1 */
  int64_t m, n, k;
  const void* a; int64_t lda; int64_t stride_a;
  const void* b; int64_t ldb; int64_t stride_b;
  void* c; int64_t ldc; int64_t stride_c;
  int64_t batch;                 /* >= 1 */
  float alpha, beta;
  int32_t dtype;                 /* of a and b */
  int32_t c_dtype;               /* of c */
  int32_t allow_tf32;            /* unused (set 0): the device's own option decides TF32, e.g.
                                    device/cuda's tf32 (manifest device.options.tf32) */
} loom_gemm_args;

/* y = (x - mean) * rstd * gamma + beta over the last dim; saves mean and rstd. */
typedef struct loom_layernorm_fwd_args {
  uint32_t struct_size;
  int64_t rows, cols;
  const void* x; const void* gamma; const void* beta;
  void* y; float* mean; float* rstd;
  float eps;
  int32_t dtype;
} loom_layernorm_fwd_args;

/* dx = (or +=, when accumulate_dx) the input gradient; dgamma, dbeta are accumulated.
 * 1.2: with grad_fp32 = 1, dgamma and dbeta are fp32 whatever dtype is (bf16
 * parameters with fp32 main gradients, accumulated without a bf16 rounding);
 * only devices whose loom_device_api.features has LOOM_DEVICE_GRAD_FP32. */
typedef struct loom_layernorm_bwd_args {
  uint32_t struct_size;
  int64_t rows, cols;
  const void* dy; const void* x; const void* gamma;
  const float* mean; const float* rstd;
  void* dx; void* dgamma; void* dbeta;
  int32_t accumulate_dx;
  int32_t dtype;
  int32_t grad_fp32;                   /* 1.2 */
} loom_layernorm_bwd_args;

/* GeLU, tanh approximation. Forward y = gelu(x); backward dx = dy * gelu'(x). */
typedef struct loom_gelu_args {
  uint32_t struct_size;
  int64_t n;
  const void* x;
  const void* dy;   /* backward only */
  void* out;        /* y (forward) or dx (backward) */
  int32_t dtype;
} loom_gelu_args;

/* Scaled dot-product attention. Element (b, s, head, d) of q lives at
 * q[b*stride_b + s*stride_s + head*head_dim + d]; same for k, v, out and their
 * gradients (which share the strides of their tensors). lse[(b*heads + head)*seq + s]
 * holds the log-sum-exp of each softmax row, written by forward, read by backward. */
typedef struct loom_attention_args {
  uint32_t struct_size;
  int64_t batch, seq, heads, head_dim;
  int64_t qkv_stride_b, qkv_stride_s;  /* strides of q, k and v (and dq, dk, dv) */
  int64_t out_stride_b, out_stride_s;  /* strides of out (and dout) */
  const void* q; const void* k; const void* v;
  void* out;
  float* lse;
  const void* dout;                    /* backward */
  void* dq; void* dk; void* dv;        /* backward: overwritten */
  float scale;
  int32_t causal;
  int32_t dtype;
  /* --- 1.6 (context parallelism) --- The queries are a window of `seq` rows inside
   * a key/value sequence of kv_seq rows: query row i sits at position q_offset + i of
   * it, so causal attention lets it see keys j <= q_offset + i (q_offset + seq <=
   * kv_seq). k, v, dk and dv then have kv_seq rows and the strides kv_stride_b /
   * kv_stride_s; q, dq, out, dout and lse keep `seq` rows and their strides.
   * kv_seq = 0 (a caller before 1.6) means the 1.5 op: kv_seq = seq, q_offset = 0,
   * k and v with the qkv strides. Honoured by devices with LOOM_DEVICE_ATTENTION_WINDOW. */
  int64_t kv_seq, q_offset;
  int64_t kv_stride_b, kv_stride_s;
  int32_t accumulate_dkv;              /* backward: dk, dv += (else overwritten) */
} loom_attention_args;

/* Softmax cross-entropy over vocab slices, in three steps so a vocab-split run
 * can all-reduce the per-row partials between them:
 *   XENT_ROW_MAX:    row_max[r] = max_c logits[r, c]
 *   XENT_SUMEXP:     row_sumexp[r] = sum_c exp(logits[r,c] - row_max[r]);
 *                    target_logit[r] = logits[r, t - vocab_start] if the target t is in
 *                    [vocab_start, vocab_start + cols), else 0
 *   XENT_LOSS:       loss[r] = log(row_sumexp[r]) + row_max[r] - target_logit[r]
 *   XENT_BACKWARD:   dlogits[r,c] = scale * (exp(logits - row_max)/row_sumexp - [c == t - vocab_start])
 * Rows whose target is negative are ignored (loss 0, gradient 0). Columns at or
 * past valid_cols (vocab padding) are treated as -inf in every step. */
#define LOOM_XENT_ROW_MAX 0
#define LOOM_XENT_SUMEXP 1
#define LOOM_XENT_LOSS 2
#define LOOM_XENT_BACKWARD 3
typedef struct loom_xent_args {
  uint32_t struct_size;
  int32_t step;                     /* LOOM_XENT_* */
  int64_t rows, cols, ld;
  int64_t valid_cols;               /* columns < valid_cols are real vocab entries */
  int64_t vocab_start;
  const void* logits;
  const int32_t* targets;
  float* row_max; float* row_sumexp; float* target_logit; float* loss;
  void* dlogits;
  float scale;
  int32_t dtype;
} loom_xent_args;

/* Embedding rows [vocab_start, vocab_start + vocab_rows) of a table [vocab_rows, dim].
 * Forward: out[i] = table[ids[i] - vocab_start], or 0 when outside the slice.
 * Backward: dtable[ids[i] - vocab_start] += dout[i] for ids inside the slice;
 * 1.2: with grad_fp32 = 1, dtable is fp32 whatever dtype is (as layernorm_bwd). */
typedef struct loom_embedding_args {
  uint32_t struct_size;
  int64_t n, dim, vocab_rows, vocab_start;
  const int32_t* ids;
  const void* table; void* out;        /* forward */
  const void* dout; void* dtable;      /* backward */
  int32_t accumulate;                  /* forward: out += instead of = */
  int32_t dtype;
  int32_t grad_fp32;                   /* 1.2, backward */
} loom_embedding_args;

/* Element-wise kernels. */
#define LOOM_EW_AXPBY 0      /* y = alpha * x + beta * y */
#define LOOM_EW_ADD 1        /* out = x + y */
#define LOOM_EW_MUL 2        /* out = x * y */
#define LOOM_EW_SCALE 3      /* out = alpha * x */
#define LOOM_EW_FILL 4       /* out = alpha */
#define LOOM_EW_CAST 5       /* out (out_dtype) = x (dtype) */
#define LOOM_EW_ADD_BIAS 6   /* out[r, c] = x[r, c] + y[c]; n = rows * cols, cols given */
#define LOOM_EW_DROPOUT 7    /* out = x * mask / (1-p); mask from (seed, offset+i); y: u8 mask out/in */
#define LOOM_EW_DROPOUT_BWD 8 /* out = x * mask / (1-p) using the saved mask in y */
#define LOOM_EW_MUL_COLS 9   /* out[r, c] = x[r, c] * y[c]; n = rows * cols, cols given */
typedef struct loom_elementwise_args {
  uint32_t struct_size;
  int32_t op;
  int64_t n;
  int64_t cols;
  const void* x; void* y; void* out;
  float alpha, beta;
  float p;
  uint64_t seed, offset;
  int32_t dtype;
  int32_t out_dtype;
  /* 1.3, DROPOUT, devices with LOOM_DEVICE_SEED_DEVICE: when non-NULL, the stream's
   * seed is loom_mix64(seed ^ loom_mix64(*seed_device)), *seed_device read from device
   * memory when the launch runs, so a captured launch draws a new mask when the value
   * there changes between replays. */
  const uint64_t* seed_device;
} loom_elementwise_args;

/* 1.3: splitmix64's finaliser, the mix of loom_elementwise_args.seed_device (callers
 * that compute a seed_device stream's seed on the host use the same function). */
static inline uint64_t loom_mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* Reductions to one fp32 scalar on the device (out[0]), or column sums. */
#define LOOM_RED_SUM 0
#define LOOM_RED_SUM_SQUARES 1
#define LOOM_RED_MAX_ABS 2
#define LOOM_RED_COLUMN_SUM 3   /* out[c] (+)= sum_r x[r, c]; n = rows*cols */
#define LOOM_RED_ROW_ARGMAX 4   /* out[r] (int32) = first argmax_c x[r, c]; n = rows*cols */
/* 1.8: one tensor of a multi-tensor reduction: elements [offset, offset + numel) of x. */
typedef struct loom_reduce_segment {
  int64_t offset;
  int64_t numel;
} loom_reduce_segment;

typedef struct loom_reduce_args {
  uint32_t struct_size;
  int32_t op;
  int64_t n;
  int64_t cols;
  const void* x;
  void* out;
  int32_t accumulate;      /* out += result */
  int32_t dtype;           /* of x */
  int32_t out_dtype;
  int64_t ld;              /* COLUMN_SUM, ROW_ARGMAX: row stride of x (0 = cols) */
  /* --- 1.8, devices with LOOM_DEVICE_MULTI_TENSOR --- SUM, SUM_SQUARES and MAX_ABS of
   * many tensors in one call: with num_segments > 0, out[i] (fp32) is the reduction of
   * segment i of x (accumulate applies to each out[i]); n is ignored. `segments` is an
   * array of num_segments in the device's memory, unchanged while the op may run (a
   * graph replay reads it again). Each out[i] is what the op gives for that segment
   * alone up to the order of its fp64 sums. */
  int64_t num_segments;
  const loom_reduce_segment* segments;
} loom_reduce_args;

/* AdamW on fp32 master weights. param -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * param),
 * with grad scaled by grad_scale first and bias corrections 1 - beta^step. When
 * param_copy is set, the updated value is also written there in copy_dtype. */
/* 1.8: one tensor of a multi-tensor AdamW: numel elements at these offsets (in
 * elements) of param (and its m and v: state_offset), grad and param_copy. */
typedef struct loom_adamw_segment {
  int64_t param_offset;
  int64_t state_offset;  /* of m and v */
  int64_t grad_offset;
  int64_t copy_offset;   /* of param_copy, when set */
  int64_t numel;
  float weight_decay;    /* this tensor's (0: not decayed) */
  int32_t reserved;      /* 0 */
} loom_adamw_segment;

typedef struct loom_adamw_args {
  uint32_t struct_size;
  int64_t n;
  float* param; const void* grad; float* m; float* v;
  int32_t grad_dtype;
  float lr, beta1, beta2, eps, weight_decay, grad_scale;
  int64_t step;
  void* param_copy; int32_t copy_dtype;
  int32_t pad_1_7;                     /* 1.8: the tail padding of 1.7's struct, named */
  /* --- 1.8, devices with LOOM_DEVICE_MULTI_TENSOR --- many tensors in one call: with
   * num_segments > 0, every segment is updated as a call with its offsets, numel and
   * weight_decay would update it (the same values); n and weight_decay are ignored.
   * `segments` is an array of num_segments in the device's memory, unchanged while the
   * op may run. Segments must not overlap. */
  int64_t num_segments;
  const loom_adamw_segment* segments;
} loom_adamw_args;

typedef struct loom_device_ops {
  uint32_t struct_size;
  loom_status (*gemm)(loom_device*, loom_stream*, const loom_gemm_args*);
  loom_status (*layernorm_fwd)(loom_device*, loom_stream*, const loom_layernorm_fwd_args*);
  loom_status (*layernorm_bwd)(loom_device*, loom_stream*, const loom_layernorm_bwd_args*);
  loom_status (*gelu_fwd)(loom_device*, loom_stream*, const loom_gelu_args*);
  loom_status (*gelu_bwd)(loom_device*, loom_stream*, const loom_gelu_args*);
  loom_status (*attention_fwd)(loom_device*, loom_stream*, const loom_attention_args*);
  loom_status (*attention_bwd)(loom_device*, loom_stream*, const loom_attention_args*);
  loom_status (*xent)(loom_device*, loom_stream*, const loom_xent_args*);
  loom_status (*embedding_fwd)(loom_device*, loom_stream*, const loom_embedding_args*);
  loom_status (*embedding_bwd)(loom_device*, loom_stream*, const loom_embedding_args*);
  loom_status (*elementwise)(loom_device*, loom_stream*, const loom_elementwise_args*);
  loom_status (*reduce)(loom_device*, loom_stream*, const loom_reduce_args*);
  loom_status (*adamw)(loom_device*, loom_stream*, const loom_adamw_args*);
} loom_device_ops;

typedef struct loom_device_api {
  uint32_t struct_size;
  loom_status (*create)(const loom_options* options, const loom_device_create_args* args,
                        loom_device** out);
  void (*destroy)(loom_device* dev);
  /* Memory. Allocations are at least 256-byte aligned. */
  loom_status (*alloc)(loom_device* dev, size_t bytes, void** out);
  void (*free)(loom_device* dev, void* ptr);
  loom_status (*memory_stats)(loom_device* dev, loom_memory_stats* out);
  loom_status (*copy)(loom_device* dev, loom_stream* stream, void* dst, const void* src,
                      size_t bytes, int32_t kind);
  /* Streams and events. stream NULL = the device's default stream. */
  loom_status (*stream_create)(loom_device* dev, loom_stream** out);
  void (*stream_destroy)(loom_device* dev, loom_stream* stream);
  loom_status (*stream_synchronize)(loom_device* dev, loom_stream* stream);
  loom_status (*event_create)(loom_device* dev, loom_event** out);
  void (*event_destroy)(loom_device* dev, loom_event* event);
  loom_status (*event_record)(loom_device* dev, loom_event* event, loom_stream* stream);
  loom_status (*stream_wait_event)(loom_device* dev, loom_stream* stream, loom_event* event);
  loom_status (*event_synchronize)(loom_device* dev, loom_event* event);
  /* Graphs: between capture_begin and capture_end, work launched on the stream is
   * recorded, not run; replay runs it again on the same addresses. */
  loom_status (*capture_begin)(loom_device* dev, loom_stream* stream);
  loom_status (*capture_end)(loom_device* dev, loom_stream* stream, loom_graph** out);
  loom_status (*graph_replay)(loom_device* dev, loom_graph* graph, loom_stream* stream);
  void (*graph_destroy)(loom_device* dev, loom_graph* graph);
  /* The backend's native stream (cudaStream_t for CUDA; NULL on CPU), for comm plugins. */
  void* (*native_stream)(loom_device* dev, loom_stream* stream);
  /* DLPack device type of this device's memory (kDLCPU, kDLCUDA). */
  int32_t dl_device_type;
  const loom_device_ops* ops;
  /* 1.2. A stream-ordered 2-D copy (cudaMemcpy2DAsync's semantics): `rows` rows of
   * `width` bytes, row r from src + r * src_pitch to dst + r * dst_pitch (pitches in
   * bytes, >= width). The regions must not overlap. */
  loom_status (*copy_2d)(loom_device* dev, loom_stream* stream, void* dst, size_t dst_pitch, const void* src,
                         size_t src_pitch, size_t width, size_t rows, int32_t kind);
  /* 1.2. LOOM_DEVICE_* capability bits (a 1.1 table, which lacks the member, has none). */
  uint64_t features;
} loom_device_api;

/* loom_device_api.features: layernorm_bwd and embedding_bwd honour grad_fp32 (gemm's
 * bf16 A/B with an fp32 C and reduce's fp32 out of bf16 x are 1.0 contract). */
#define LOOM_DEVICE_GRAD_FP32 (1ull << 0)
/* 1.3: memory allocated during a capture and freed stays with the device's graphs
 * (a graph pool shared by all its graphs, reused only by later captures, released
 * with the last graph), as replays write it again. exec plugins that replay
 * captured steps need it. */
#define LOOM_DEVICE_GRAPH_POOL (1ull << 1)
/* 1.3: elementwise DROPOUT honours seed_device. */
#define LOOM_DEVICE_SEED_DEVICE (1ull << 2)
/* 1.6: attention_fwd / attention_bwd honour kv_seq, q_offset, the kv strides and
 * accumulate_dkv (a query window inside a longer key sequence: context parallelism). */
#define LOOM_DEVICE_ATTENTION_WINDOW (1ull << 3)
/* 1.8: adamw and reduce (SUM, SUM_SQUARES, MAX_ABS) honour num_segments / segments:
 * one call for many tensors of a flat buffer (an optimizer step in two launches). */
#define LOOM_DEVICE_MULTI_TENSOR (1ull << 4)

/* ------------------------------------------------------------------------- */
/* Comm plugins: one communicator per rank group.                             */
/* Buffers are device memory of the calling rank; `stream` is the device's    */
/* native stream (NULL on CPU). Counts are in elements.                       */
/* ------------------------------------------------------------------------- */

typedef struct loom_comm_world_args {
  uint32_t struct_size;
  int32_t world_size;
  int32_t num_local_ranks;       /* ranks hosted by this process */
  const int32_t* local_ranks;    /* their global ranks */
  int64_t timeout_ms;            /* a collective that waits longer fails */
} loom_comm_world_args;

typedef struct loom_group_desc {
  uint32_t struct_size;
  const char* kind;              /* "tp", "dp", "pp", ... (for messages) */
  const int32_t* ranks;          /* global ranks, in rank-in-group order */
  int32_t size;
  int32_t my_rank;               /* the caller's global rank */
} loom_group_desc;

typedef struct loom_comm_api {
  uint32_t struct_size;
  /* Once per process. */
  loom_status (*world_create)(const loom_options* options, const loom_comm_world_args* args,
                              loom_comm_world** out);
  void (*world_destroy)(loom_comm_world* world);
  /* Called by every member of a group (from its own rank thread or process). */
  loom_status (*group_create)(loom_comm_world* world, const loom_group_desc* desc, loom_comm** out);
  void (*group_destroy)(loom_comm* comm);
  loom_status (*all_reduce)(loom_comm* comm, void* stream, const void* send, void* recv,
                            size_t count, int32_t dtype, int32_t op);
  /* recv holds size * count elements, rank i's contribution at i * count. */
  loom_status (*all_gather)(loom_comm* comm, void* stream, const void* send, void* recv,
                            size_t count, int32_t dtype);
  /* send holds size * count elements; rank i receives the reduction of block i. */
  loom_status (*reduce_scatter)(loom_comm* comm, void* stream, const void* send, void* recv,
                                size_t count, int32_t dtype, int32_t op);
  /* Block i of send (count elements) goes to rank i; block j of recv came from rank j. */
  loom_status (*all_to_all)(loom_comm* comm, void* stream, const void* send, void* recv,
                            size_t count, int32_t dtype);
  loom_status (*all_to_all_v)(loom_comm* comm, void* stream, const void* send,
                              const size_t* send_counts, const size_t* send_displs, void* recv,
                              const size_t* recv_counts, const size_t* recv_displs, int32_t dtype);
  loom_status (*broadcast)(loom_comm* comm, void* stream, void* buf, size_t count, int32_t dtype,
                           int32_t root);
  loom_status (*barrier)(loom_comm* comm);
  /* Point to point; peers are ranks within the group. send never blocks on the receiver. */
  loom_status (*send)(loom_comm* comm, void* stream, const void* buf, size_t count, int32_t dtype,
                      int32_t peer, int32_t tag);
  loom_status (*recv)(loom_comm* comm, void* stream, void* buf, size_t count, int32_t dtype,
                      int32_t peer, int32_t tag);
  /* Makes every pending and future wait of this world fail at once with `reason`
   * (the engine calls it when a rank fails, so the others stop instead of waiting
   * for their timeout). */
  void (*world_abort)(loom_comm_world* world, const char* reason);
} loom_comm_api;

/* A rank group as the host hands it to plugins. */
typedef struct loom_group {
  uint32_t struct_size;
  const loom_comm_api* api;
  loom_comm* comm;               /* valid for every group, size 1 included */
  int32_t size;
  int32_t rank;                  /* the caller's rank in the group */
} loom_group;

/* ------------------------------------------------------------------------- */
/* Layer plugins                                                              */
/* ------------------------------------------------------------------------- */

/* Initialisation of a parameter. The engine draws the full (unpartitioned)
 * tensor from a stream seeded by (run seed, parameter name) and keeps this rank's
 * slice, so any parallel layout starts from the serial run's values. */
#define LOOM_INIT_ZEROS 0
#define LOOM_INIT_ONES 1
#define LOOM_INIT_NORMAL 2          /* N(0, init_std) */
#define LOOM_INIT_NORMAL_SCALED 3   /* N(0, init_std / sqrt(2 * num_layers)) */

typedef struct loom_param_decl {
  uint32_t struct_size;
  const char* name;          /* unique within the layer, e.g. "qkv.weight" */
  int32_t ndim;              /* 1..4 */
  int64_t shape[4];          /* full (unpartitioned) shape */
  int32_t partition_dim;     /* dim split across tp (-1 = duplicated on every tp rank) */
  int32_t partition_stride;  /* >1: that dim is `stride` concatenated blocks, each split */
  int32_t init;              /* LOOM_INIT_* */
  float init_std;
  int32_t no_weight_decay;   /* 1 for norms and biases */
  const char* tie_key;       /* params with the same tie_key share storage (weight tying) */
  /* 1.4: 1 = dim 0 holds one block per expert (a MoE layer's experts) and is split
   * over the expert-parallel group: ep rank i holds experts [i * n / ep, (i + 1) * n
   * / ep) of the n in dim 0 (partition_dim then splits over tp as usual). Its
   * gradient is reduced over the expert data-parallel group (edp), not dp. The
   * engine reads a layer's array of loom_param_decl with the stride of its first
   * element's struct_size, so an older layer's shorter elements read as expert 0. */
  int32_t expert;
} loom_param_decl;

typedef struct loom_model_dims {
  uint32_t struct_size;
  int64_t hidden, heads, ffn_hidden, seq_len;
  int64_t vocab;             /* real vocabulary size */
  int64_t padded_vocab;      /* multiple of the padding divisor (and of tp) */
  int64_t micro_batch;
  int32_t num_layers;        /* transformer blocks in the whole model */
  int32_t block_index;       /* which block this layer belongs to (-1 outside blocks) */
  int32_t tie_embeddings;    /* 1: the output layer shares the word embedding (tie_key "word_embedding") */
} loom_model_dims;

typedef struct loom_layer_create_args {
  uint32_t struct_size;
  const loom_model_dims* dims;
  const char* instance_name; /* e.g. "blocks.3.attention" */
  loom_group tp;             /* tensor-parallel group of this rank */
  int32_t sequence_parallel;
  int32_t pad_1_1;           /* 1.1's tail padding (covered by its sizeof): unused, 0 */
  /* 1.2: bf16 parameters with fp32 gradients may be accumulated by the ops straight
   * into the fp32 gradients (grad_fp32; manifest device.grad_accumulation_fusion). */
  int32_t grad_accumulation_fusion;
} loom_layer_create_args;

/* Hidden states are [seq, micro_batch, hidden] (sequence-major, as in Megatron),
 * fp32 or the run's activation dtype. tokens and targets are [seq, micro_batch] int32.
 *
 * 1.6, context parallelism (the rank group "cp" has cp > 1 ranks; only layers with
 * LOOM_LAYER_CONTEXT_PARALLEL are given such a run): the sequence of seq_len
 * positions is cut into 2*cp chunks of seq_len / (2*cp); cp rank r holds chunks r
 * and 2*cp - 1 - r, in that order (each rank gets an early and a late chunk, so
 * causal attention costs the same on every rank). tokens, targets and hidden states
 * hold these seq_len / cp rows (hidden states: their 1/tp shard under sequence
 * parallelism); a layer computes the serial model's values for them. The loss
 * scale and the gradients follow Megatron: the engine sums loss_sum and loss_count
 * over cp, gives every cp rank loss_scale = cp / (tokens * microbatches) (and
 * aux_loss_scale = cp / microbatches) and the optimizer strategy averages
 * gradients over the "dp-cp" group (its `dp`). */
typedef struct loom_layer_fwd_args {
  uint32_t struct_size;
  int32_t microbatch;        /* activations are saved per microbatch */
  int32_t training;          /* 0: no activations need be saved */
  const DLTensor* input;     /* NULL for the first layer */
  DLTensor* output;          /* NULL for the last layer */
  const DLTensor* tokens;
  const DLTensor* targets;
  float* loss_sum;           /* host: the last layer writes the summed loss of the microbatch */
  int64_t* loss_count;       /* host: and how many tokens it covers */
  uint64_t dropout_seed;     /* identical on all tp ranks; layers derive per-rank seeds */
  int32_t* predictions;      /* host, optional: the last layer writes argmax tokens [seq, micro_batch] */
  /* 1.3: device memory holding dropout_seed (the same value, at the same address
   * for the same microbatch every step): what a captured dropout reads. */
  const uint64_t* dropout_seed_device;
  /* 1.4, host, training forwards: a layer with an auxiliary loss (MoE load
   * balancing) adds this microbatch's value, already weighted by its coefficient,
   * for reporting; NULL = not reported. */
  float* aux_loss;
  /* 1.7, sub-steps: a layer that captures parts of its step (capturable() == 2)
   * runs each part through the rank's exec plugin (host->exec) as a
   * loom_exec_step with this key, its own substep >= 1 and capturable =
   * substeps_capturable. step_key is the engine's key of this layer step (the
   * same for the same layer and microbatch every step); substeps_capturable is 1
   * when parts may be captured now: a training step whose dropout seed is in
   * device memory, a tp group of one rank and an exec plugin with
   * LOOM_EXEC_SUBSTEPS. Both read 0 from an engine before 1.7. */
  int64_t step_key;
  int32_t substeps_capturable;
  int32_t reserved_1_7;      /* 0 */
} loom_layer_fwd_args;

typedef struct loom_layer_bwd_args {
  uint32_t struct_size;
  int32_t microbatch;
  const DLTensor* grad_output; /* NULL for the last layer */
  DLTensor* grad_input;        /* NULL for the first layer */
  float loss_scale;            /* last layer: dL/d(loss_sum) */
  /* 1.4: d(objective)/d(aux_loss) for this microbatch: 1 / microbatches per step
   * (auxiliary losses are averaged over microbatches like the main loss, and over
   * data-parallel ranks by the gradient reduction), on every pipeline stage.
   * Reads 0 from an engine before 1.4. 1.6: cp / microbatches under context
   * parallelism, as loss_scale carries the factor cp: a layer whose auxiliary
   * loss covers the whole microbatch (MoE routing) backpropagates, on each cp
   * rank, its own tokens' part of it, and the dp-cp average sums those. */
  int32_t pad_1_3;             /* 1.3's tail padding (covered by its sizeof): unused, 0 */
  float aux_loss_scale;
  int32_t pad_1_6;             /* 1.6's tail padding (covered by its sizeof): unused, 0 */
  /* 1.7: as in loom_layer_fwd_args (the key of this backward step). */
  int64_t step_key;
  int32_t substeps_capturable;
  int32_t reserved_1_7;        /* 0 */
} loom_layer_bwd_args;

typedef struct loom_layer_api {
  uint32_t struct_size;
  loom_status (*create)(const loom_options* options, loom_rank* rank,
                        const loom_layer_create_args* args, loom_layer** out);
  void (*destroy)(loom_layer* layer);
  /* The layer's parameters; the array stays valid while the layer lives. */
  loom_status (*params)(loom_layer* layer, const loom_param_decl** out, size_t* count);
  /* Views of this rank's slice of each parameter and its gradient, in declaration
   * order, living in the engine's flat buffers. Gradients are accumulated (+=). */
  loom_status (*bind)(loom_layer* layer, const DLTensor* params, const DLTensor* grads,
                      size_t count);
  loom_status (*forward)(loom_layer* layer, loom_rank* rank, const loom_layer_fwd_args* args);
  loom_status (*backward)(loom_layer* layer, loom_rank* rank, const loom_layer_bwd_args* args);
  /* Frees what forward saved for `microbatch` (also done by backward). */
  void (*release)(loom_layer* layer, int32_t microbatch);
  /* Bytes of activations saved per microbatch (for planning). */
  uint64_t (*activation_bytes)(loom_layer* layer);
  /* Multiply-adds x2 of one forward over one microbatch (for MFU). */
  double (*forward_flops)(loom_layer* layer);
  /* 1.3. 1 when this layer's training forward and backward obey the graph rules,
   * so an exec plugin with LOOM_EXEC_REPLAYS may capture them once and replay:
   * every launch on the rank's device (default stream); no host synchronisation,
   * device-to-host read or host decision on device data; no value that changes
   * from step to step passed to a launch by value (a dropout seed, the backward's
   * loss_scale) and no write through the forward's host pointers (loss_sum,
   * loss_count, predictions); no collective (the engine captures only layers whose
   * tp group has one rank). Its host code runs once, at capture: per-microbatch
   * state must live in device memory allocated inside the step (from the device's
   * graph pool while captured). NULL or 0: always run directly.
   * 1.7: 2 = "captures parts of its step": the whole step runs directly and the
   * layer runs its graph-safe parts as sub-steps (loom_layer_fwd_args.step_key);
   * the engine keeps the hidden states at fixed addresses as for 1. An engine
   * before 1.7 reads 2 as 0. */
  int32_t (*capturable)(loom_layer* layer);
  /* 1.6. LOOM_LAYER_* capability bits (a 1.0-1.5 table, which lacks them, has none). */
  uint64_t features;
} loom_layer_api;

/* loom_layer_api.features: 1.6, the layer takes a context-parallel slice of the
 * sequence (see loom_layer_fwd_args); the engine refuses parallel.cp > 1 for a model
 * with a layer that lacks it. */
#define LOOM_LAYER_CONTEXT_PARALLEL (1ull << 0)

/* ------------------------------------------------------------------------- */
/* Optimizer strategy plugins (parallel/ddp, parallel/distopt)                */
/* ------------------------------------------------------------------------- */

typedef struct loom_param_info {
  uint32_t struct_size;
  const char* name;          /* global, e.g. "blocks.3.attention.qkv.weight" */
  size_t offset;             /* element offset in the flat buffers */
  size_t numel;              /* local elements */
  int32_t no_weight_decay;
  int32_t duplicated;        /* 1: identical copy on every tp rank (count once in norms);
                              * 1.5: for an expert parameter, on every etp rank */
} loom_param_info;

typedef struct loom_optimizer_create_args {
  uint32_t struct_size;
  void* params;              /* flat parameter buffer (device) */
  void* grads;               /* flat gradient buffer (device) */
  size_t numel;
  int32_t param_dtype, grad_dtype;
  const loom_param_info* infos;
  size_t num_params;
  loom_group dp, tp, pp;     /* groups for grad sync and norm reductions */
  /* Buckets of the buffers (Megatron's layout: reverse model order, 64-element
   * aligned starts, each bucket a multiple of lcm(dp, 128) elements): bucket b is
   * [bucket_offsets[b], bucket_offsets[b + 1]); num_buckets + 1 entries. */
  const size_t* bucket_offsets;
  size_t num_buckets;
  /* --- 1.1 --- */
  /* NULL, or num_params flags: 1 = this rank's copy of the parameter is also held
   * on another pipeline stage (the tied word embedding on the last stage). Its
   * gradient arrives already summed over the copies; gradient norms count it on
   * the owning stage only, so skip it here. */
  const int32_t* counted_elsewhere;
  /* --- 1.4 --- */
  /* NULL, or num_params flags: 1 = an expert parameter (loom_param_decl.expert),
   * different on each rank of the ep group. Its gradient is summed over the edp
   * group instead of averaged over dp, then scaled by 1 / dp: its tokens came from
   * every dp rank of the ep group. Global norms sum it over ep as well. The engine
   * places expert parameters after all others, so they form the tail of the
   * buffers. Only strategies with LOOM_OPTIMIZER_EXPERT_PARALLEL are given any. */
  const int32_t* expert;
  loom_group ep, edp;          /* the expert-parallel and expert data-parallel groups */
  /* --- 1.5 --- */
  /* The expert tensor-parallel group (parallel.etp), over which expert parameters
   * are split instead of tp. It is the tp group unless the run folds MoE
   * parallelism (Megatron-Core's "MoE Parallel Folding": etp = 1 under tp > 1 with sequence
   * parallelism, the ep group then spanning tp ranks): then global norms sum the
   * expert part over ep and etp but not over tp, and an expert parameter's
   * `duplicated` means identical on every etp rank. Given (and a.expert then set
   * even at ep = 1) only to strategies with LOOM_OPTIMIZER_EXPERT_FOLDING. */
  loom_group etp;
} loom_optimizer_create_args;

typedef struct loom_optimizer_step_args {
  uint32_t struct_size;
  int64_t step;              /* 1-based */
  float lr;
  float beta1, beta2, eps, weight_decay;
  float clip_grad;           /* 0 = no clipping */
} loom_optimizer_step_args;

typedef struct loom_optimizer_step_result {
  uint32_t struct_size;
  float grad_norm;           /* before clipping */
} loom_optimizer_step_result;

/* --- 1.1 --- */
/* Resuming at another data-parallel size (same tp and pp): the states that every
 * old dp rank of this rank's (tp, pp) position saved, and the old buffer layout.
 * A parameter is identified by its index in model order, the same list as
 * loom_optimizer_create_args.infos; its numel is unchanged, but its offset may
 * differ, since the padding depends on dp. */
typedef struct loom_optimizer_reshard_args {
  uint32_t struct_size;
  int32_t old_dp;                      /* the dp size the states were saved at */
  const void* const* states;           /* old_dp host blobs from state_save, old dp-rank order */
  const size_t* state_bytes;           /* their sizes, old_dp entries */
  size_t old_numel;                    /* elements of the old flat buffers, padding included */
  const size_t* old_offsets;           /* num_params old element offsets (model order) */
  const size_t* old_numels;            /* num_params element counts (model order) */
  size_t num_params;                   /* == loom_optimizer_create_args.num_params */
  const size_t* old_bucket_offsets;    /* old_num_buckets + 1 entries, as bucket_offsets */
  size_t old_num_buckets;
} loom_optimizer_reshard_args;

typedef struct loom_optimizer_api {
  uint32_t struct_size;
  loom_status (*create)(const loom_options* options, loom_rank* rank,
                        const loom_optimizer_create_args* args, loom_optimizer** out);
  void (*destroy)(loom_optimizer* opt);
  /* Synchronise gradients, clip, update parameters. */
  loom_status (*step)(loom_optimizer* opt, loom_rank* rank, const loom_optimizer_step_args* args,
                      loom_optimizer_step_result* result);
  /* Optimizer state for checkpoints: a byte blob this rank owns. */
  loom_status (*state_size)(loom_optimizer* opt, size_t* bytes);
  loom_status (*state_save)(loom_optimizer* opt, void* host_buf, size_t bytes);
  loom_status (*state_load)(loom_optimizer* opt, const void* host_buf, size_t bytes);
  /* --- 1.1 --- */
  /* Loads state saved at another dp size: each element of this rank's state takes
   * its value from whichever old rank held that element of that parameter (mapped
   * by parameter index and range within the parameter, never by old buffer offset);
   * padding gets zeros. NULL = the strategy cannot reshard (the engine refuses). */
  loom_status (*state_load_resharded)(loom_optimizer* opt, const loom_optimizer_reshard_args* args);
  /* 1.4. LOOM_OPTIMIZER_* capability bits (a 1.0-1.3 table, which lacks them, has none). */
  uint64_t features;
} loom_optimizer_api;

/* loom_optimizer_api.features: 1.4, the strategy reduces expert parameters over edp
 * (loom_optimizer_create_args.expert, .ep, .edp); the engine refuses expert
 * parallelism (parallel.ep > 1) with a strategy that lacks it. */
#define LOOM_OPTIMIZER_EXPERT_PARALLEL (1ull << 0)
/* 1.5: the strategy reads loom_optimizer_create_args.etp (MoE folding, etp != tp);
 * the engine refuses a folded run with a strategy that lacks it. */
#define LOOM_OPTIMIZER_EXPERT_FOLDING (1ull << 1)

/* ------------------------------------------------------------------------- */
/* Pipeline schedule plugins (parallel/pipeline.*)                            */
/* ------------------------------------------------------------------------- */

typedef struct loom_schedule_args {
  uint32_t struct_size;
  int32_t pp, vpp, microbatches, group_size, rank;
} loom_schedule_args;

typedef struct loom_schedule_api {
  uint32_t struct_size;
  /* Writes the rank's signed order (+c forward of local chunk c, -c backward),
   * 2 * vpp * microbatches entries, into order[capacity]. */
  loom_status (*order)(const loom_options* options, const loom_schedule_args* args, int32_t* order,
                       size_t capacity, size_t* length, int32_t* warmup);
} loom_schedule_api;

/* ------------------------------------------------------------------------- */
/* Execution-mode plugins (exec/eager, exec/partial_graph)                    */
/* ------------------------------------------------------------------------- */

typedef loom_status (*loom_step_fn)(void* ctx);

typedef struct loom_exec_step {
  uint32_t struct_size;
  const char* scope;         /* the layer plugin's name: "attention", "mlp", ... */
  int64_t key;               /* identifies (microbatch, layer, direction) within a step */
  int32_t capturable;        /* 1 when fn obeys the graph rules (loom_layer_api.capturable) */
  loom_step_fn fn;
  void* ctx;
  /* 1.7: 0 = the engine's whole layer step; >= 1 = a part a layer runs from
   * inside its step under the same key (loom_layer_fwd_args.step_key). An exec
   * plugin with LOOM_EXEC_SUBSTEPS keys its graphs by (key, substep); the layer
   * marks a part capturable only when the engine said the plugin has the bit.
   * The part's scope names it ("moe_router"). */
  int32_t substep;
  int32_t reserved_1_7;      /* 0 */
} loom_exec_step;

/* 1.3. What an exec plugin did so far (loom_exec_api.stats). */
typedef struct loom_exec_stats {
  uint32_t struct_size;
  uint64_t graphs;           /* graphs captured (and alive) */
  uint64_t replays;          /* steps run by replaying a graph (the capturing run included) */
  uint64_t direct;           /* steps run by calling fn: not capturable, out of scope, warm-up */
} loom_exec_stats;

typedef struct loom_exec_api {
  uint32_t struct_size;
  loom_status (*create)(const loom_options* options, loom_rank* rank, loom_exec** out);
  void (*destroy)(loom_exec* exec);
  loom_status (*run)(loom_exec* exec, loom_rank* rank, const loom_exec_step* step);
  /* 1.3. LOOM_EXEC_* capability bits (a 1.0-1.2 table, which lacks them, has none). */
  uint64_t features;
  /* 1.3. Counters since create; NULL = none. */
  loom_status (*stats)(loom_exec* exec, loom_exec_stats* out);
} loom_exec_api;

/* loom_exec_api.features: steps with the same key may be replayed from a graph
 * captured on an earlier run, over the addresses of that run. The engine then
 * keeps every buffer it passes to a capturable step (hidden states, their
 * gradients) at the same address for the same key in every training step. */
#define LOOM_EXEC_REPLAYS (1ull << 0)
/* 1.7: loom_exec_step.substep is read (graphs keyed by (key, substep)), and a
 * step may run sub-steps from inside its fn (run is re-entered). */
#define LOOM_EXEC_SUBSTEPS (1ull << 1)

/* ------------------------------------------------------------------------- */
/* --- 1.1 --- Tensor-parallel services (the parallel/tensor plugin).         */
/* A TP-aware layer gets the table from host->service(rank,                   */
/* LOOM_API_TENSOR_PARALLEL, NULL) and opens one handle per layer instance.   */
/* With tp = 1 every call is the plain local math (collectives are identities)*/
/*                                                                            */
/* Activations are row-major [rows, cols] with rows = seq * micro_batch in    */
/* sequence-major order (row s * micro_batch + b); `rows` below is always the */
/* FULL count. Under sequence parallelism the activations outside TP regions  */
/* are this rank's shard: the rows / tp consecutive rows of positions         */
/* [r * seq / tp, (r + 1) * seq / tp). Entering a TP region (Megatron's f) is */
/* then an all-gather along the rows instead of the identity (backward: a     */
/* reduce-scatter instead of an all-reduce); leaving it (g) a reduce-scatter  */
/* instead of an all-reduce (backward: an all-gather instead of the identity).*/
/* Weights are [in, out] with y = x W (+ bias). Buffers are device memory.    */
/* ------------------------------------------------------------------------- */

typedef struct loom_tp_s loom_tp;  /* one layer's handle, owned by the service */

typedef struct loom_tp_create_args {
  uint32_t struct_size;
  loom_group tp;                 /* the layer's tensor-parallel group */
  int32_t sequence_parallel;     /* 1: activations outside TP regions are sequence shards */
  const char* instance_name;     /* keys the layer's dropout streams ("blocks.3.mlp") */
} loom_tp_create_args;

/* f or g on its own: x [rows or rows/tp, cols] -> out [rows or rows/tp, cols].
 * enter_forward: identity, or all-gather (SP: shard -> full);
 * enter_backward: all-reduce, or reduce-scatter (SP: full -> shard);
 * exit_forward: all-reduce, or reduce-scatter (SP); exit_backward: identity, or
 * all-gather (SP). x and out may be the same buffer when no shape changes. */
typedef struct loom_tp_region_args {
  uint32_t struct_size;
  int64_t rows, cols;
  const void* x;
  void* out;
  int32_t dtype;
} loom_tp_region_args;

/* Column-parallel linear (weight [in, out_local], split by output columns):
 *  forward:  x = the input as held ([rows, in], or the shard under SP); x_full
 *            receives the gathered input [rows, in] under SP (keep it for backward;
 *            unused without SP); y [rows, out] = x_full W + bias, or with
 *            gather_output the whole output [rows, out * tp] (rank blocks in order).
 *  backward: x = the full input (x_full under SP); dy [rows, out] (or [rows, out * tp]
 *            with gather_output); dweight += x^T dy; dbias += column sums of dy;
 *            dx = (or += with accumulate_dx) dy W^T summed over tp (all-reduce), or
 *            reduce-scattered to the shard [rows / tp, in] under SP.
 * Row-parallel linear (weight [in_local, out], split by input rows):
 *  forward:  x [rows, in] (inside the TP region); y = sum over tp of x W, then + bias:
 *            all-reduced [rows, out], or reduce-scattered [rows / tp, out] under SP.
 *  backward: x as in forward; dy [rows, out] (or the shard under SP, all-gathered
 *            here); dweight += x^T dy; dbias += column sums of dy as held (under SP
 *            this rank's shard: the engine sums duplicated gradients over tp);
 *            dx [rows, in] = (or +=) dy W^T. */
typedef struct loom_tp_linear_args {
  uint32_t struct_size;
  int64_t rows;                  /* full rows: seq * micro_batch */
  int64_t in, out;               /* this rank's weight is [in, out] */
  const void* x;
  void* x_full;
  const void* weight;
  const void* bias;              /* NULL = none */
  void* y;
  const void* dy;
  void* dx;                      /* NULL = not needed */
  void* dweight;
  void* dbias;                   /* NULL = none */
  int32_t gather_output;         /* column-parallel only */
  int32_t accumulate_dx;
  int32_t dtype;
  int32_t pad_1_1;               /* 1.1's tail padding (covered by its sizeof): unused, 0 */
  int32_t grad_fp32;             /* 1.2: dweight, dbias are fp32 (see LOOM_TP_GRAD_FP32) */
} loom_tp_linear_args;

/* Vocab-parallel embedding: the table [padded_vocab / tp, dim] is this rank's
 * slice of the padded vocabulary; ids outside it look up zeros and the reduction
 * over tp completes every row.
 *  forward:  out [rows, dim] (all-reduce), or this rank's shard [rows / tp, dim]
 *            (reduce-scatter) under SP.
 *  backward: dout shaped like out (all-gathered under SP); dtable += the rows of
 *            this rank's slice. */
typedef struct loom_tp_embedding_args {
  uint32_t struct_size;
  int64_t rows, dim;
  int64_t padded_vocab;          /* the whole padded vocabulary */
  const int32_t* ids;            /* [rows]: every token of the microbatch */
  const void* table;
  void* out;
  const void* dout;
  void* dtable;
  int32_t dtype;
  int32_t pad_1_1;               /* 1.1's tail padding (covered by its sizeof): unused, 0 */
  int32_t grad_fp32;             /* 1.2: dtable is fp32 (see LOOM_TP_GRAD_FP32) */
} loom_tp_embedding_args;

/* Output logits fused with vocab-parallel softmax cross-entropy. The logits stay
 * split ([rows, padded_vocab / tp] on each rank, logits = x_full weight^T);
 * per token the max, the sum of exponentials and the target logit are reduced
 * over tp (3 * rows floats in two all-reduces), never the logits. Padded columns
 * never win.
 *  forward:  x / x_full as for a column-parallel linear; writes logits, stats and
 *            loss (identical on every tp rank), and predictions when non-NULL.
 *  backward: x = the full input; reads logits and stats; dweight += dlogits^T x;
 *            dx = (or +=) dlogits weight summed over tp (all-reduce), or
 *            reduce-scattered to the shard under SP. */
typedef struct loom_tp_xent_args {
  uint32_t struct_size;
  int64_t rows, hidden;
  int64_t vocab;                 /* real vocabulary */
  int64_t padded_vocab;
  const void* x;
  void* x_full;
  const void* weight;            /* [padded_vocab / tp, hidden] */
  void* logits;                  /* [rows, padded_vocab / tp]: keep from forward to backward */
  float* stats;                  /* [3 * rows]: row max | sum of exp | target logit; keep */
  const int32_t* targets;        /* [rows]; negative = ignored (loss 0, no gradient) */
  float* loss;                   /* forward: [rows] per-token loss */
  int32_t* predictions;          /* forward, optional, HOST memory: [rows] argmax token
                                    over the real vocabulary (lowest id among ties) */
  float scale;                   /* backward: dL / d loss[r] */
  void* dx;
  void* dweight;
  int32_t accumulate_dx;
  int32_t dtype;
  int32_t grad_fp32;             /* 1.2: dweight is fp32 (see LOOM_TP_GRAD_FP32) */
} loom_tp_xent_args;

/* Dropout under the model-parallel RNG (Megatron's tracker): region
 * DUPLICATED (outside TP regions) draws from one stream identical on every tp rank
 * (under SP each rank draws its shard's part of it, so the mask equals the serial
 * run's); PARALLEL (inside a TP region) from a stream of its own per tp rank.
 * out = x * mask / (1 - p); mask [n] u8 is written for the backward.
 * 1.6, context parallelism: x is hidden-state shaped, this rank's rows of its cp
 * slice position-major (see loom_layer_fwd_args), so the slice's two halves are
 * its two context chunks; a 1.6 service draws each element by its place in the
 * whole sequence, so every cp layout masks the serial run's elements (the engine
 * refuses parallel.cp > 1 with a service built before 1.6). */
#define LOOM_TP_RNG_DUPLICATED 0
#define LOOM_TP_RNG_PARALLEL 1
typedef struct loom_tp_dropout_args {
  uint32_t struct_size;
  int32_t region;                /* LOOM_TP_RNG_* */
  int64_t n;                     /* elements of x on this rank */
  const void* x;
  void* out;
  uint8_t* mask;
  float p;
  uint64_t seed;                 /* the forward's dropout_seed (equal on every rank) */
  int32_t microbatch;            /* the layer's microbatch (parallel/tensor's masks follow seed, which
                                  * names the samples, not this index, so they do not depend on dp) */
  int32_t stream;                /* tells several dropouts of one layer apart: 0, 1, ... */
  int32_t dtype;
  /* 1.3, services with LOOM_TP_SEED_DEVICE: device memory holding `seed` (the
   * forward's dropout_seed_device), read when the dropout runs; NULL = use seed. */
  const uint64_t* seed_device;
} loom_tp_dropout_args;

/* This rank's slice of the padded vocabulary: ids [start, start + rows), the first
 * `valid` of them real (the rest padding). */
typedef struct loom_tp_vocab_range {
  uint32_t struct_size;
  int64_t start, rows, valid;
} loom_tp_vocab_range;

typedef struct loom_tensor_parallel_api {
  uint32_t struct_size;
  loom_status (*create)(loom_rank* rank, const loom_tp_create_args* args, loom_tp** out);
  void (*destroy)(loom_tp* tp);
  /* The vocabulary padded to the next multiple of divisor * tp_size. */
  int64_t (*padded_vocab)(int64_t vocab, int64_t divisor, int32_t tp_size);
  loom_status (*vocab_range)(loom_tp* tp, int64_t vocab, int64_t padded_vocab, loom_tp_vocab_range* out);
  loom_status (*enter_forward)(loom_tp* tp, const loom_tp_region_args* args);
  loom_status (*enter_backward)(loom_tp* tp, const loom_tp_region_args* args);
  loom_status (*exit_forward)(loom_tp* tp, const loom_tp_region_args* args);
  loom_status (*exit_backward)(loom_tp* tp, const loom_tp_region_args* args);
  loom_status (*column_linear_forward)(loom_tp* tp, const loom_tp_linear_args* args);
  loom_status (*column_linear_backward)(loom_tp* tp, const loom_tp_linear_args* args);
  loom_status (*row_linear_forward)(loom_tp* tp, const loom_tp_linear_args* args);
  loom_status (*row_linear_backward)(loom_tp* tp, const loom_tp_linear_args* args);
  loom_status (*embedding_forward)(loom_tp* tp, const loom_tp_embedding_args* args);
  loom_status (*embedding_backward)(loom_tp* tp, const loom_tp_embedding_args* args);
  loom_status (*xent_forward)(loom_tp* tp, const loom_tp_xent_args* args);
  loom_status (*xent_backward)(loom_tp* tp, const loom_tp_xent_args* args);
  loom_status (*dropout_forward)(loom_tp* tp, const loom_tp_dropout_args* args);
  /* 1.2. LOOM_TP_* capability bits (a 1.1 table, which lacks the member, has none). */
  uint64_t features;
} loom_tensor_parallel_api;

/* loom_tensor_parallel_api.features: the linear, embedding and xent backwards honour
 * grad_fp32 (when the rank's device has LOOM_DEVICE_GRAD_FP32): the parameter
 * gradients of bf16 layers are accumulated straight into fp32 main gradients
 * (Megatron's gradient-accumulation fusion). */
#define LOOM_TP_GRAD_FP32 (1ull << 0)
/* 1.3: dropout_forward honours seed_device (when the device has LOOM_DEVICE_SEED_DEVICE;
 * else it reads the seed on the host: not capturable). The mask is the same either way. */
#define LOOM_TP_SEED_DEVICE (1ull << 1)

/* ------------------------------------------------------------------------- */
/* --- 1.4 --- Expert-parallel token dispatch (the parallel/expert plugins).  */
/* A MoE layer gets the table from host->service(rank,                        */
/* LOOM_API_EXPERT_PARALLEL, NULL) (manifest key parallel.expert) and opens   */
/* one handle per layer instance. ep rank q holds experts                     */
/* [q * E / ep, (q + 1) * E / ep) of the E in the layer.                      */
/*                                                                            */
/* A microbatch's dispatch rows are [N, width], expert-major over the E       */
/* experts: the rows this rank routed to expert e are                         */
/* [expert_rows[e], expert_rows[e + 1]). dispatch moves every rank's rows to  */
/* the rank holding their expert: [R, width] here, expert-major over the      */
/* local experts, the rows of one expert ordered by source ep rank, then by   */
/* their row at the source. combine is its inverse ([R, width] back to        */
/* [N, width] at the sources). plan, dispatch and combine are collective     */
/* over the ep group; buffers are device memory. `stream` is the rank's      */
/* compute stream (its device's native stream): the service's own device    */
/* work runs there too.                                                       */
/* ------------------------------------------------------------------------- */

typedef struct loom_ep_s loom_ep;  /* one layer's handle, owned by the service */

typedef struct loom_ep_create_args {
  uint32_t struct_size;
  loom_group ep;                 /* the layer's expert-parallel group */
  int64_t num_experts;           /* E, a multiple of the group's size */
  const char* instance_name;     /* for messages ("blocks.3.moe") */
} loom_ep_create_args;

/* Learns where every rank's rows go (the counts are exchanged: collective) and
 * keeps that plan under `slot` (the layer's key, e.g. its microbatch) until
 * release. expert_rows: host [E + 1], non-decreasing from expert_rows[0] = 0 to
 * N; local_rows: host, filled [E / ep + 1] with the first row of each local
 * expert in the dispatched rows (local_rows[E / ep] = R). */
typedef struct loom_ep_plan_args {
  uint32_t struct_size;
  void* stream;
  int32_t slot;
  const int64_t* expert_rows;
  int64_t* local_rows;
} loom_ep_plan_args;

/* dispatch: x [N, width] -> out [R, width]; combine: x [R, width] -> out [N,
 * width], under the plan of `slot`. width counts elements of dtype. */
typedef struct loom_ep_move_args {
  uint32_t struct_size;
  void* stream;
  int32_t slot;
  const void* x;
  void* out;
  int64_t width;
  int32_t dtype;
  int32_t reserved;              /* 0: fills the tail, so a later member starts past sizeof */
} loom_ep_move_args;

typedef struct loom_expert_parallel_api {
  uint32_t struct_size;
  loom_status (*create)(loom_rank* rank, const loom_ep_create_args* args, loom_ep** out);
  void (*destroy)(loom_ep* ep);
  loom_status (*plan)(loom_ep* ep, const loom_ep_plan_args* args);
  loom_status (*dispatch)(loom_ep* ep, const loom_ep_move_args* args);
  loom_status (*combine)(loom_ep* ep, const loom_ep_move_args* args);
  /* Forgets the plan of `slot` (no collective). */
  void (*release)(loom_ep* ep, int32_t slot);
} loom_expert_parallel_api;

/* ------------------------------------------------------------------------- */
/* The host API: what the engine offers every plugin.                         */
/* ------------------------------------------------------------------------- */

typedef struct loom_host_api {
  uint32_t struct_size;
  uint32_t abi_major, abi_minor;
  const char* engine_version;
  /* Logging into the engine's log, with the plugin's file and line. */
  void (*log)(int32_t severity, const char* file, int32_t line, const char* message);
  /* Status objects; the message is copied. */
  loom_status (*status_create)(int32_t code, const char* message);
  int32_t (*status_code)(loom_status status);
  const char* (*status_message)(loom_status status);
  void (*status_destroy)(loom_status status);
  /* Options (defaults already applied). Return 1 when the option exists, 0 if not. */
  int32_t (*option_int)(const loom_options* options, const char* name, int64_t* out);
  int32_t (*option_float)(const loom_options* options, const char* name, double* out);
  int32_t (*option_bool)(const loom_options* options, const char* name, int32_t* out);
  /* NULL when absent; valid while the options live. */
  const char* (*option_string)(const loom_options* options, const char* name);
  /* Device memory of a rank (through its device plugin, accounted by the engine). */
  loom_status (*alloc)(loom_rank* rank, size_t bytes, void** out);
  void (*free)(loom_rank* rank, void* ptr);
  /* The rank's device and its compute stream. */
  loom_status (*device)(loom_rank* rank, const loom_device_api** api, loom_device** dev,
                        loom_stream** stream);
  /* A rank group by kind ("tp", "dp", "pp", "ep", ...); see `loom groups`. */
  loom_status (*group)(loom_rank* rank, const char* kind, loom_group* out);
  /* The rank's execution mode, for layers that split themselves into steps. */
  loom_status (*exec)(loom_rank* rank, const loom_exec_api** api, loom_exec** exec);
  int32_t (*global_rank)(loom_rank* rank);
  /* --- 1.1 --- */
  /* A service table offered by a plugin: api_type LOOM_API_TENSOR_PARALLEL gives a
   * loom_tensor_parallel_api (1.4: LOOM_API_EXPERT_PARALLEL a
   * loom_expert_parallel_api). name NULL = the one the run configured
   * (manifest key parallel.tensor, parallel.expert); otherwise the parallel
   * plugin of that name. NULL when none is loaded. */
  const void* (*service)(loom_rank* rank, int32_t api_type, const char* name);
} loom_host_api;

/* ------------------------------------------------------------------------- */
/* Plugin descriptors and the entry point                                     */
/* ------------------------------------------------------------------------- */

#define LOOM_API_DEVICE 1
#define LOOM_API_COMM 2
#define LOOM_API_LAYER 3
#define LOOM_API_OPTIMIZER 4
#define LOOM_API_SCHEDULE 5
#define LOOM_API_EXEC 6
/* --- 1.1 --- */
#define LOOM_API_TENSOR_PARALLEL 7 /* loom_tensor_parallel_api (parallel/tensor) */
/* --- 1.4 --- */
#define LOOM_API_EXPERT_PARALLEL 8 /* loom_expert_parallel_api (parallel/expert, parallel/expert.allgather) */

typedef struct loom_plugin_info {
  uint32_t struct_size;
  const char* kind;          /* "device", "comm", "layer", "parallel", "exec" */
  const char* name;          /* "cpu", "attention", "pipeline.1f1b", ... */
  const char* version;       /* the plugin's own version, e.g. "1.0.0" */
  const char* description;   /* one line */
  int32_t api_type;          /* LOOM_API_*: which table `api` points to */
  const void* api;           /* begins with uint32_t struct_size */
  const loom_option_decl* options;
  size_t num_options;
} loom_plugin_info;

typedef struct loom_plugin_library {
  uint32_t struct_size;
  uint32_t abi_major;        /* the ABI the library was built against */
  uint32_t abi_minor;
  const loom_plugin_info* const* plugins;
  size_t num_plugins;
} loom_plugin_library;

/* The entry point. `host` stays valid for the life of the process. On success
 * *out points to a descriptor owned by the library, valid while it is loaded. */
typedef loom_status (*loom_plugin_init_v1_fn)(const loom_host_api* host,
                                              const loom_plugin_library** out);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* LOOM_ABI_H */
