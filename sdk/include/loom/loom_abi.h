/*
 * loom_abi.h — the loom plugin ABI. C99; with the service headers it includes
 * (loom_tp.h, loom_ep.h), the only normative interface between the engine and its
 * plugins. Including any one of the three gives all of them.
 *
 * Rules (see docs/abi.md):
 *  - Only fixed-width integers, size_t, UTF-8 const char*, POD structs, function
 *    pointers and opaque handles cross this boundary.
 *  - One exported entry symbol per ABI major: loom_plugin_init_v1.
 *  - Every table and every growing argument struct begins with uint32_t
 *    struct_size; new members are appended only (a minor version bump), after
 *    the old struct's tail padding (an old caller's struct_size covers it). A NULL
 *    function slot means "not implemented" where the slot's comment says it is
 *    optional; the loader refuses a table that leaves a required slot NULL. Each
 *    side reads only what the other side's struct_size covers (LOOM_HAS_SLOT below).
 *  - Errors are loom_status objects created by the host (NULL = success).
 *    Nothing throws across the boundary, and a plugin never aborts the process.
 *  - Whoever allocates frees. Borrowed pointers live for the duration of a call.
 *  - Tensors crossing the layer interface are DLPack DLTensor views.
 *
 * Names. Device ops are <op>_fwd and <op>_bwd (layernorm_fwd, attention_bwd), or one
 * name for an op without a backward of its own (gemm, xent, elementwise, reduce,
 * adamw); their argument structs are loom_<op>_args. Layer and service methods are
 * verbs: forward and backward (loom_layer_api), enter_forward, column_linear_backward,
 * dropout_forward (loom_tensor_parallel_api), plan, dispatch, combine
 * (loom_expert_parallel_api), step, run, order. The layer's argument structs keep the
 * device ops' short form: loom_layer_fwd_args, loom_layer_bwd_args.
 *
 * Versions. The loader accepts a library built for this major and a minor no newer
 * than the engine's (LOOM_ABI_MINOR), and refuses a newer one. A plugin therefore
 * always runs on an engine at least as new as the header it was built against: the
 * host table and every struct the engine fills cover all the members that plugin
 * knows. What each side must handle is an OLDER peer: the engine reads the shorter
 * tables and structs of a plugin built for an earlier minor (a slot or member past
 * their struct_size is absent), and a plugin called by another plugin (a layer
 * calling a device op or a service) may get an older caller's shorter argument
 * struct, whose missing members it reads as zero. Members with no marker date from
 * 1.0; a comment line "--- since 1.N ---" precedes the members appended in minor N,
 * and prose says "(since 1.N)" of anything else that minor N added.
 *
 * Reserved and padding members. A member named `reserved` (reserved1, ... where a
 * struct has more than one) holds no value: whoever
 * fills the struct sets it to 0, whoever reads the struct ignores it. A member named
 * pad0, pad1, ... is the same, and the bytes it names were tail padding of the
 * struct in an earlier minor: that minor's sizeof, the struct_size its callers pass,
 * covers them, so a caller built for it may leave anything there. A member appended
 * directly into those bytes would be read from such a caller as garbage; the padding
 * member fills them, and the appended member starts past the old sizeof. A struct
 * whose last member would leave tail padding ends with a `reserved` member, so the
 * next appended member starts past its sizeof too. Some of these members also
 * answer to a second name, through an anonymous union of two members of one type
 * (LOOM_EXTENSION below): the same bytes, so that sources which use that name
 * (allow_tf32, pad_1_1, reserved_1_7, ...) keep compiling.
 *
 * Ownership. Pointers passed to a call (arguments, the members of argument structs,
 * option strings) are borrowed for that call unless their comment says otherwise;
 * keep a copy, not the pointer. A handle a create call returns is the plugin's
 * object, valid until the matching destroy. A status a call returns belongs to the
 * receiver, which destroys it (host->status_destroy). Descriptors, tables and option
 * declarations are the library's and must stay valid while it is loaded (libraries
 * are never unloaded, so static data does).
 *
 * Threads. The engine runs each rank on a thread of its own: every rank of the run
 * in one process under comm/local, one rank per process under mpirun or srun. Unless
 * a slot says otherwise, the calls on one handle (device, communicator, layer,
 * optimizer, exec, tensor- or expert-parallel handle) come from the thread of the
 * rank that created it, one at a time; handles of different ranks are called
 * concurrently, so state a plugin shares among its handles (statics, caches, a
 * process-wide world) must be thread-safe. Host functions that take no loom_rank
 * may be called from any thread.
 */
#ifndef LOOM_ABI_H
#define LOOM_ABI_H

#include <stddef.h>
#include <stdint.h>

#include <dlpack/dlpack.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The ABI version this header describes; a library records the one it was built
 * against in loom_plugin_library and the engine's is in loom_host_api. */
#define LOOM_ABI_MAJOR 1
#define LOOM_ABI_MINOR 23

/* Precedes the anonymous unions that give a member a second name (C11; GCC and
 * Clang also accept them in C99 with this keyword, -pedantic included). */
#if defined(__GNUC__)
#define LOOM_EXTENSION __extension__
#else
#define LOOM_EXTENSION
#endif

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

/* loom_status codes (host->status_code). */
#define LOOM_CODE_OK 0
#define LOOM_CODE_INVALID_ARGUMENT 1
#define LOOM_CODE_UNSUPPORTED 2
#define LOOM_CODE_OUT_OF_MEMORY 3
#define LOOM_CODE_INTERNAL 4
#define LOOM_CODE_TIMEOUT 5
#define LOOM_CODE_IO 6
#define LOOM_CODE_NOT_FOUND 7

/* Severities of host->log. */
#define LOOM_LOG_INFO 0
#define LOOM_LOG_WARNING 1
#define LOOM_LOG_ERROR 2

/* ------------------------------------------------------------------------- */
/* Data types, element-wise and reduction ops                                 */
/* ------------------------------------------------------------------------- */

/* Element types (the dtype members of argument structs, the comm calls' dtype). */
#define LOOM_DTYPE_F32 0
#define LOOM_DTYPE_BF16 1
#define LOOM_DTYPE_F16 2
#define LOOM_DTYPE_I32 3
#define LOOM_DTYPE_I64 4
#define LOOM_DTYPE_U8 5
#define LOOM_DTYPE_F64 6

/* Reduction operators of the comm calls (all_reduce, reduce_scatter). */
#define LOOM_REDUCE_SUM 0
#define LOOM_REDUCE_MAX 1
#define LOOM_REDUCE_MIN 2
#define LOOM_REDUCE_AVG 3

/* ------------------------------------------------------------------------- */
/* Options: each plugin declares a schema; the engine validates the manifest  */
/* section against it and hands the resolved values back through the host.   */
/* ------------------------------------------------------------------------- */

/* loom_option_decl.type. */
#define LOOM_OPTION_BOOL 1
#define LOOM_OPTION_INT 2
#define LOOM_OPTION_FLOAT 3
#define LOOM_OPTION_STRING 4

/* One option of a plugin (loom_plugin_info.options). The array and its strings are
 * the library's, read at load and copied; they must stay valid while the library is
 * loaded (static data). An array of these is read with a stride of
 * options[0].struct_size, and every element must carry the same struct_size, so a
 * library built against an older header (a smaller struct) is read correctly. The
 * engine checks each value of the manifest against `range` and `choices` before any
 * plugin is created (`loom validate` reports it with the file and line), and refuses
 * at load a library whose default lies outside them or whose range does not parse. */
typedef struct loom_option_decl {
  uint32_t struct_size;        /* sizeof(loom_option_decl) of the library's header */
  int32_t type;                /* LOOM_OPTION_* */
  const char* name;            /* key inside the plugin's manifest section */
  const char* default_value;   /* TOML literal ("4", "true", "\"gelu\""); NULL = required */
  const char* doc;             /* one line */
  /* --- since 1.9 --- */
  const char* range;           /* INT and FLOAT: the allowed interval, "[0, 1)", "[1, inf)",
                                  "(0, 10]" ('[' ']' include the bound, '(' ')' exclude it;
                                  "inf" or nothing = unbounded); NULL = any finite value.
                                  A range on a STRING option is refused at load. */
  const char* choices;         /* STRING: the allowed values separated by '|', e.g.
                                  "probs|position"; NULL = any string */
} loom_option_decl;

/* Resolved options of one plugin instance (opaque, owned by the host): the
 * manifest's values with the declared defaults applied. Borrowed: valid only during
 * the call that receives it (create, order); read what you need there and copy it. */
typedef struct loom_options_s loom_options;

/* ------------------------------------------------------------------------- */
/* Opaque handles                                                             */
/* ------------------------------------------------------------------------- */

typedef struct loom_rank_s loom_rank;        /* a rank's runtime, owned by the host; valid
                                                until the object created with it is destroyed */
typedef struct loom_device_s loom_device;    /* a device instance, owned by its plugin */
typedef struct loom_stream_s loom_stream;    /* a device's stream, owned by the device plugin
                                                (NULL = the device's default stream) */
typedef struct loom_event_s loom_event;      /* a device's event, owned by the device plugin */
typedef struct loom_graph_s loom_graph;      /* a captured graph, owned by the device plugin */
typedef struct loom_comm_world_s loom_comm_world; /* the comm plugin's per-process state */
typedef struct loom_comm_s loom_comm;        /* one member of a rank group, owned by the comm plugin */
typedef struct loom_comm_request_s loom_comm_request; /* a started collective (since 1.15), the comm plugin's */
typedef struct loom_layer_s loom_layer;      /* a layer instance, owned by its plugin */
typedef struct loom_optimizer_s loom_optimizer; /* a rank's optimizer strategy, owned by its plugin */
typedef struct loom_exec_s loom_exec;        /* a rank's execution mode, owned by its plugin */

/* ------------------------------------------------------------------------- */
/* Device plugins: memory, streams, events, graphs and the op table.          */
/* All op arguments are device pointers of the device that runs the op.       */
/* Matrices are row-major; ld* are leading dimensions in elements.            */
/* ------------------------------------------------------------------------- */

/* loom_device_api.copy and copy_2d: where src and dst live. */
#define LOOM_COPY_HOST_TO_DEVICE 0
#define LOOM_COPY_DEVICE_TO_HOST 1
#define LOOM_COPY_DEVICE_TO_DEVICE 2

/* Filled by loom_device_api.memory_stats. The caller sets struct_size and zeroes the
 * rest (loom::make); the device writes the members that struct_size covers, so a
 * member it does not know keeps the caller's 0. Counts are bytes of this device
 * instance's allocations. */
typedef struct loom_memory_stats {
  uint32_t struct_size;     /* set by the caller */
  uint64_t current_bytes;   /* live allocations */
  uint64_t peak_bytes;      /* high-water mark of current_bytes */
  uint64_t reserved_bytes;  /* held by the allocator (>= current) */
  uint64_t num_allocs;      /* allocations made so far */
  /* --- since 1.9 --- */
  uint64_t capacity_bytes;  /* what this rank may plan to hold: the memory the device allocates
                               from (the GPU's; the host's RAM for a CPU device) divided among
                               the ranks of this process that share it (create args'
                               ranks_in_process); 0 = unknown (also what a device built before
                               1.9 leaves). The engine compares its memory plan with it before
                               a run allocates anything. */
} loom_memory_stats;

/* loom_device_api.create's arguments (borrowed for the call). */
typedef struct loom_device_create_args {
  uint32_t struct_size;
  int32_t global_rank;      /* the rank this instance serves (for messages) */
  int32_t local_rank;       /* rank within this process/node: picks the GPU */
  int32_t num_threads;      /* host threads this rank may use (CPU math) */
  int32_t ranks_in_process; /* how many ranks share this process */
} loom_device_create_args;

/* C = alpha * op(A) * op(B) + beta * C, batched with element strides.
 * op(A) is m x k, op(B) is k x n, C is m x n; all row-major. */
typedef struct loom_gemm_args {
  uint32_t struct_size;
  int32_t trans_a, trans_b;      /* 0 or 1 */
  int64_t m, n, k;               /* the shapes of op(A), op(B) and C above */
  /* Each operand: its device pointer, its leading dimension (elements between rows
   * as stored) and the elements between consecutive matrices of the batch. */
  const void* a; int64_t lda; int64_t stride_a;
  const void* b; int64_t ldb; int64_t stride_b;
  void* c; int64_t ldc; int64_t stride_c;
  int64_t batch;                 /* >= 1 */
  float alpha, beta;             /* the scales of the formula above */
  int32_t dtype;                 /* of a and b */
  int32_t c_dtype;               /* of c */
  /* reserved: 0, never read (second name allow_tf32). Whether fp32 GEMMs may use TF32
   * is the device's own option, e.g. device/cuda's tf32 (manifest device.options.tf32). */
  LOOM_EXTENSION union { int32_t reserved; int32_t allow_tf32; };
  /* --- since 1.11 --- */
  int32_t pad0;                  /* padding: 1.10's struct ended after reserved; 0 */
  /* An epilogue applied to C in the GEMM (LOOM_GEMM_EPILOGUE_* below; only devices with
   * LOOM_DEVICE_GEMM_EPILOGUE, and batch 1). bias: [n] in c_dtype, added to every row;
   * aux: [m, n] in c_dtype, ldaux elements between rows (>= n), or for BIAS_GRAD [n]. */
  const void* bias;
  void* aux;
  int64_t ldaux;
  int32_t epilogue;              /* LOOM_GEMM_EPILOGUE_*; 0 (none) from an older caller */
  int32_t reserved1;             /* 0 */
} loom_gemm_args;

/* loom_gemm_args.epilogue (since 1.11). With r = alpha op(A) op(B) + beta C for one
 * element C[i, j], computed in fp32, each stores once, rounded to c_dtype:
 *  NONE      C = r.
 *  BIAS      C = r + bias[j].
 *  GELU_AUX  aux[i, j] = r (+ bias[j] when bias is not NULL); C = gelu(that sum)
 *            (tanh approximation, of the unrounded sum): a linear layer's bias and
 *            activation, keeping the activation's input for its backward.
 *  DGELU     C = r * gelu'(aux[i, j]) (beta 0, no bias): the activation's backward in
 *            the GEMM that makes its output gradient.
 *  BIAS_GRAD C = r, and aux[j] += the sum over k of B[k, j] (trans_b 0, no bias; aux
 *            [n] in c_dtype, the sum in fp32, added and rounded once): a linear layer's
 *            bias gradient from the output gradient its weight-gradient GEMM reads.
 * The same as the unfused ops (gemm, elementwise ADD_BIAS, gelu_fwd / gelu_bwd, reduce
 * COLUMN_SUM) up to the one rounding: with fp32 C they agree bit for bit on device/cpu. */
#define LOOM_GEMM_EPILOGUE_NONE 0
#define LOOM_GEMM_EPILOGUE_BIAS 1
#define LOOM_GEMM_EPILOGUE_GELU_AUX 2
#define LOOM_GEMM_EPILOGUE_DGELU 3
#define LOOM_GEMM_EPILOGUE_BIAS_GRAD 4

/* y = (x - mean) * rstd * gamma + beta over the last dim; saves mean and rstd. */
typedef struct loom_layernorm_fwd_args {
  uint32_t struct_size;
  int64_t rows, cols;            /* x and y are [rows, cols]; gamma and beta [cols] */
  const void* x; const void* gamma; const void* beta;   /* inputs: [rows, cols], [cols], [cols] */
  void* y; float* mean; float* rstd;   /* y written; mean and rstd: [rows] fp32, kept for backward */
  float eps;                     /* added to the variance */
  int32_t dtype;                 /* of x, gamma, beta and y */
} loom_layernorm_fwd_args;

/* dx = (or +=, when accumulate_dx) the input gradient; dgamma, dbeta are accumulated.
 * With grad_fp32 = 1 (since 1.2), dgamma and dbeta are fp32 whatever dtype is (bf16
 * parameters with fp32 main gradients, accumulated without a bf16 rounding);
 * only devices whose loom_device_api.features has LOOM_DEVICE_GRAD_FP32. */
typedef struct loom_layernorm_bwd_args {
  uint32_t struct_size;
  int64_t rows, cols;            /* as in the forward */
  const void* dy; const void* x; const void* gamma;   /* [rows, cols], [rows, cols], [cols] */
  const float* mean; const float* rstd;               /* the forward's, [rows] */
  void* dx; void* dgamma; void* dbeta;                /* [rows, cols], [cols], [cols] */
  int32_t accumulate_dx;         /* 1: dx += (else dx is overwritten) */
  int32_t dtype;                 /* of dy, x, gamma, dx (and dgamma, dbeta unless grad_fp32) */
  /* --- since 1.2 --- */
  int32_t grad_fp32;             /* 1: dgamma and dbeta are fp32 (see above); 0 from an older caller */
} loom_layernorm_bwd_args;

/* GeLU, tanh approximation. Forward y = gelu(x); backward dx = dy * gelu'(x). */
typedef struct loom_gelu_args {
  uint32_t struct_size;
  int64_t n;        /* elements */
  const void* x;    /* input (both directions) */
  const void* dy;   /* backward only */
  void* out;        /* y (forward) or dx (backward) */
  int32_t dtype;    /* of x, dy and out */
} loom_gelu_args;

/* Scaled dot-product attention. Element (b, s, head, d) of q lives at
 * q[b*stride_b + s*stride_s + head*head_dim + d]; same for k, v, out and their
 * gradients (which share the strides of their tensors). lse[(b*heads + head)*seq + s]
 * holds the log-sum-exp of each softmax row, written by forward, read by backward. */
typedef struct loom_attention_args {
  uint32_t struct_size;
  int64_t batch, seq, heads, head_dim;   /* seq: query rows (see the window below) */
  int64_t qkv_stride_b, qkv_stride_s;  /* strides of q, k and v (and dq, dk, dv) */
  int64_t out_stride_b, out_stride_s;  /* strides of out (and dout) */
  const void* q; const void* k; const void* v;   /* inputs (both directions) */
  void* out;                           /* forward: written */
  float* lse;                          /* [batch * heads * seq] fp32: forward writes, backward reads */
  const void* dout;                    /* backward */
  void* dq; void* dk; void* dv;        /* backward: overwritten (dk, dv: see accumulate_dkv) */
  float scale;                         /* multiplies q . k before the softmax (usually 1/sqrt(head_dim)) */
  int32_t causal;                      /* 1: query i sees keys j <= i (see the window below) */
  int32_t dtype;                       /* of q, k, v, out and the gradients */
  /* --- since 1.6 --- */
  /* Context parallelism: the queries are a window of `seq` rows
   * inside a key/value sequence of kv_seq rows: query row i sits at position
   * q_offset + i of it, so causal attention lets it see keys j <= q_offset + i
   * (q_offset + seq <= kv_seq). k, v, dk and dv then have kv_seq rows and the strides
   * kv_stride_b / kv_stride_s; q, dq, out, dout and lse keep `seq` rows and their
   * strides. kv_seq = 0 (what a caller built before 1.6 passes, its struct ending
   * before these members) is the op without a window: kv_seq = seq, q_offset = 0, k
   * and v with the qkv strides. Honoured by devices with LOOM_DEVICE_ATTENTION_WINDOW. */
  int64_t kv_seq, q_offset;
  int64_t kv_stride_b, kv_stride_s;
  int32_t accumulate_dkv;              /* backward: dk, dv += (else overwritten) */
  /* --- since 1.21 (devices with LOOM_DEVICE_ATTENTION_SLIDING_WINDOW) --- */
  int32_t pad0;                        /* 0 (1.20's tail padding) */
  /* Sliding-window attention (Mistral's sliding_window; Megatron-LM's window_size =
   * (window - 1, 0)): with causal, the query at position p = q_offset + i sees the
   * keys j with p - window < j <= p, itself and the window - 1 before it. 0 (what a
   * caller built before 1.21 passes) = every earlier key. Must be >= 0; > 0 only
   * with causal. */
  int64_t window;
  /* --- since 1.22 (devices with LOOM_DEVICE_ATTENTION_KEY_START) --- */
  /* Documents packed in a sequence (Megatron-LM's reset_attention_mask): with causal,
   * key_start[b * seq + i] (int32, device memory) is the first key position query i
   * of batch element b sees, the keys before it being earlier documents'; with a
   * window too, the later of both bounds holds. Non-decreasing in i and at most
   * q_offset + i (each query sees itself). NULL (what a caller built before 1.22
   * passes): 0. */
  const int32_t* key_start;
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
 * past valid_cols (vocab padding) are treated as -inf in every step. On a device with
 * LOOM_DEVICE_XENT_IN_PLACE, dlogits may be logits itself (since 1.18). */
#define LOOM_XENT_ROW_MAX 0
#define LOOM_XENT_SUMEXP 1
#define LOOM_XENT_LOSS 2
#define LOOM_XENT_BACKWARD 3
typedef struct loom_xent_args {
  uint32_t struct_size;
  int32_t step;                     /* LOOM_XENT_* */
  int64_t rows, cols, ld;           /* logits (and dlogits) [rows, cols], row stride ld elements */
  int64_t valid_cols;               /* columns < valid_cols are real vocab entries */
  int64_t vocab_start;              /* the vocabulary id of column 0 */
  const void* logits;               /* [rows, cols], row stride ld */
  const int32_t* targets;           /* [rows] vocabulary ids; negative = ignored */
  /* [rows] fp32 each: the partials the steps write and read (see above) */
  float* row_max; float* row_sumexp; float* target_logit; float* loss;
  void* dlogits;                    /* XENT_BACKWARD: written, [rows, cols] with row stride ld */
  float scale;                      /* XENT_BACKWARD: dL / d loss[r] */
  int32_t dtype;                    /* of logits and dlogits */
} loom_xent_args;

/* Embedding rows [vocab_start, vocab_start + vocab_rows) of a table [vocab_rows, dim].
 * Forward: out[i] = table[ids[i] - vocab_start], or 0 when outside the slice.
 * Backward: dtable[ids[i] - vocab_start] += dout[i] for ids inside the slice;
 * with grad_fp32 = 1 (since 1.2), dtable is fp32 whatever dtype is (as layernorm_bwd). */
typedef struct loom_embedding_args {
  uint32_t struct_size;
  int64_t n, dim, vocab_rows, vocab_start;   /* n ids; rows of dim elements */
  const int32_t* ids;                  /* [n] */
  const void* table; void* out;        /* forward */
  const void* dout; void* dtable;      /* backward */
  int32_t accumulate;                  /* forward: out += instead of = */
  int32_t dtype;                       /* of table, out, dout (and dtable unless grad_fp32) */
  /* --- since 1.2 --- */
  int32_t grad_fp32;                   /* backward: 1 = dtable is fp32; 0 from an older caller */
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
  int32_t op;                    /* LOOM_EW_* */
  int64_t n;                     /* elements of out */
  int64_t cols;                  /* ADD_BIAS, MUL_COLS: the row length */
  const void* x; void* y; void* out;   /* operands, as each op above uses them */
  float alpha, beta;             /* AXPBY, SCALE, FILL */
  float p;                       /* DROPOUT, DROPOUT_BWD: drop probability in [0, 1] */
  uint64_t seed, offset;         /* DROPOUT: element i's draw is keyed by (seed, offset + i) */
  int32_t dtype;                 /* of x, y (not a dropout mask) and out */
  int32_t out_dtype;             /* CAST: of out; ignored by the other ops */
  /* --- since 1.3 --- */
  /* DROPOUT, devices with LOOM_DEVICE_SEED_DEVICE: when non-NULL, the stream's
   * seed is loom_mix64(seed ^ loom_mix64(*seed_device)), *seed_device read from device
   * memory when the launch runs, so a captured launch draws a new mask when the value
   * there changes between replays. */
  const uint64_t* seed_device;
} loom_elementwise_args;

/* splitmix64's finaliser, the mix of loom_elementwise_args.seed_device (callers
 * that compute a seed_device stream's seed on the host use the same function)
 * (since 1.3). */
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
/* One tensor of a multi-tensor reduction: elements [offset, offset + numel) of x
 * (since 1.8). It has no struct_size: its layout can never grow. */
typedef struct loom_reduce_segment {
  int64_t offset;          /* in elements of x */
  int64_t numel;           /* elements of the segment */
} loom_reduce_segment;

typedef struct loom_reduce_args {
  uint32_t struct_size;
  int32_t op;              /* LOOM_RED_* */
  int64_t n;               /* elements of x (rows * cols for COLUMN_SUM and ROW_ARGMAX) */
  int64_t cols;            /* COLUMN_SUM, ROW_ARGMAX: the row length */
  const void* x;           /* the input */
  void* out;               /* fp32 (ROW_ARGMAX: int32), device memory */
  int32_t accumulate;      /* out += result */
  int32_t dtype;           /* of x */
  int32_t out_dtype;       /* LOOM_DTYPE_F32, or LOOM_DTYPE_I32 for ROW_ARGMAX */
  int64_t ld;              /* COLUMN_SUM, ROW_ARGMAX: row stride of x (0 = cols) */
  /* --- since 1.8 --- */
  /* Devices with LOOM_DEVICE_MULTI_TENSOR: SUM, SUM_SQUARES and MAX_ABS of
   * many tensors in one call: with num_segments > 0, out[i] (fp32) is the reduction of
   * segment i of x (accumulate applies to each out[i]); n is ignored. `segments` is an
   * array of num_segments in the device's memory, unchanged while the op may run (a
   * graph replay reads it again). Each out[i] is what the op gives for that segment
   * alone up to the order of its fp64 sums. 0 (and an older caller's struct) = one
   * tensor of n elements. */
  int64_t num_segments;
  const loom_reduce_segment* segments;
} loom_reduce_args;

/* One tensor of a multi-tensor AdamW: numel elements at these offsets (in
 * elements) of param (and its m and v: state_offset), grad and param_copy
 * (since 1.8). It has no struct_size: its layout can never grow. */
typedef struct loom_adamw_segment {
  int64_t param_offset;  /* of param */
  int64_t state_offset;  /* of m and v */
  int64_t grad_offset;   /* of grad */
  int64_t copy_offset;   /* of param_copy, when set */
  int64_t numel;         /* elements of the tensor */
  float weight_decay;    /* this tensor's (0: not decayed) */
  int32_t reserved;      /* 0 (see "Reserved and padding members" above) */
} loom_adamw_segment;

/* AdamW on fp32 master weights. param -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * param),
 * with grad scaled by grad_scale first and bias corrections 1 - beta^step. When
 * param_copy is set, the updated value is also written there in copy_dtype. */
typedef struct loom_adamw_args {
  uint32_t struct_size;
  int64_t n;                     /* elements (without segments) */
  /* fp32 master weights, the gradient (grad_dtype) and the fp32 moments, all [n] */
  float* param; const void* grad; float* m; float* v;
  int32_t grad_dtype;            /* LOOM_DTYPE_F32 or LOOM_DTYPE_BF16 */
  float lr, beta1, beta2, eps, weight_decay, grad_scale;   /* see the formula above */
  int64_t step;                  /* 1-based, for the bias corrections */
  void* param_copy; int32_t copy_dtype;   /* NULL = none; else also written, in copy_dtype */
  /* --- since 1.8 --- */
  LOOM_EXTENSION union { int32_t pad0; int32_t pad_1_7; };  /* padding: 1.7's struct ended after
                                                               copy_dtype; 0 */
  /* Devices with LOOM_DEVICE_MULTI_TENSOR: many tensors in one call: with
   * num_segments > 0, every segment is updated as a call with its offsets, numel and
   * weight_decay would update it (the same values); n and weight_decay are ignored.
   * `segments` is an array of num_segments in the device's memory, unchanged while the
   * op may run. Segments must not overlap. 0 (and an older caller's struct) = one
   * tensor of n elements. */
  int64_t num_segments;
  const loom_adamw_segment* segments;
} loom_adamw_args;

/* RMSNorm (since 1.10; Zhang and Sennrich, "Root Mean Square Layer Normalization",
 * 2019), as Megatron-Core applies it: y = x * rstd * gamma over the last dim,
 * rstd = 1 / sqrt(mean(x^2) + eps), in fp32 and rounded once (Llama's reference code
 * rounds x * rstd to the storage dtype before the gamma); saves rstd. */
typedef struct loom_rmsnorm_fwd_args {
  uint32_t struct_size;
  int64_t rows, cols;            /* x and y are [rows, cols]; gamma [cols] */
  const void* x; const void* gamma;   /* inputs */
  void* y; float* rstd;          /* y written; rstd: [rows] fp32, kept for backward (NULL = not kept) */
  float eps;                     /* added to the mean square */
  int32_t dtype;                 /* of x, gamma and y */
} loom_rmsnorm_fwd_args;

/* dx = (or +=, when accumulate_dx) the input gradient; dgamma is accumulated (fp32
 * with grad_fp32 = 1, on devices with LOOM_DEVICE_GRAD_FP32, as layernorm_bwd). */
typedef struct loom_rmsnorm_bwd_args {
  uint32_t struct_size;
  int64_t rows, cols;            /* as in the forward */
  const void* dy; const void* x; const void* gamma;   /* [rows, cols], [rows, cols], [cols] */
  const float* rstd;             /* the forward's, [rows] */
  void* dx; void* dgamma;        /* [rows, cols] (NULL = not wanted), [cols] (NULL = not wanted) */
  int32_t accumulate_dx;         /* 1: dx += (else dx is overwritten) */
  int32_t dtype;                 /* of dy, x, gamma, dx (and dgamma unless grad_fp32) */
  int32_t grad_fp32;             /* 1: dgamma is fp32 */
  int32_t reserved;              /* 0 */
} loom_rmsnorm_bwd_args;

/* SwiGLU (since 1.10; Shazeer, "GLU Variants Improve Transformer", 2020), as Megatron's
 * swiglu: each row of x holds the gate's cols values, then the up projection's;
 * forward out[r, c] = silu(gate[r, c]) * up[r, c], silu(g) = g * sigmoid(g); backward
 * out = dx, [rows, 2 * cols]: dgate = dy * up * silu'(gate), dup = dy * silu(gate). */
typedef struct loom_swiglu_args {
  uint32_t struct_size;
  int64_t rows, cols;            /* cols: the output's width (the input has 2 * cols) */
  const void* x;                 /* [rows, 2 * cols] (both directions) */
  const void* dy;                /* [rows, cols], backward only */
  void* out;                     /* forward: [rows, cols]; backward: dx [rows, 2 * cols] */
  int32_t dtype;                 /* of x, dy and out */
  int32_t reserved;              /* 0 */
} loom_swiglu_args;

/* Rotary position embedding (since 1.10; Su et al., "RoFormer", 2021) as Megatron-LM
 * and Hugging Face's Llama apply it (not interleaved): in each head, element i < rotary_dim / 2 pairs
 * with element i + rotary_dim / 2; for a token at position p the pair (a, b) becomes
 * (a cos t - b sin t, b cos t + a sin t), t = p * theta^(-2i / rotary_dim), in fp32;
 * elements from rotary_dim on pass through. Backward rotates by -t (the transpose).
 * out may be x (in place). */
typedef struct loom_rope_args {
  uint32_t struct_size;
  int64_t tokens, heads, head_dim;   /* element (t, h, d) at x[t * stride_t + h * head_dim + d] */
  int64_t rotary_dim;            /* even, <= head_dim */
  int64_t stride_t;              /* elements between tokens (>= heads * head_dim), of x and out */
  const void* x; void* out;
  const int32_t* positions;      /* [tokens], device memory: each token's position */
  float theta;                   /* the base, e.g. 10000 (Llama 2) or 500000 (Llama 3) */
  int32_t dtype;                 /* of x and out */
  /* --- since 1.20 (devices with LOOM_DEVICE_ROPE_FREQUENCIES) --- */
  const float* inv_freq;         /* [rotary_dim / 2] fp32, device memory: pair i's frequency in
                                    place of theta^(-2i / rotary_dim) (scaled rotary embeddings:
                                    Llama 3.1's); NULL: theta's */
} loom_rope_args;

/* An element-wise activation (since 1.10): forward out = f(x), backward out = dy * f'(x). */
typedef struct loom_activation_args {
  uint32_t struct_size;
  int64_t n;        /* elements */
  const void* x;    /* input (both directions) */
  const void* dy;   /* backward only */
  void* out;        /* y (forward) or dx (backward) */
  int32_t dtype;    /* of x, dy and out */
  int32_t reserved; /* 0 */
} loom_activation_args;

/* A host task (since 1.12): a plugin's own CPU kernel, launched on a stream like an op.
 * fn(args) runs on the host in the stream's order: after the work launched on the
 * stream before it, before the work launched after it. `args` (args_bytes bytes, at
 * most LOOM_HOST_TASK_MAX_ARGS_BYTES) is copied at the call, as a kernel's parameters
 * are; fn receives the device's copy (aligned as malloc's memory; NULL when args_bytes
 * is 0), which stays valid while the launch may run and, for a launch recorded under a
 * capture, as long as its graph lives: each replay passes the same copy again. So a
 * host task is captured and replayed as a kernel is; pointers inside args stay
 * addresses (the memory they point to must outlive the launch, or the graph).
 * fn must not call back into the device (no op, copy or synchronisation) and must not
 * block; it may run on a thread other than the caller's. On a device whose memory is
 * not host memory (no LOOM_DEVICE_HOST_MEMORY) fn can read and write host memory only,
 * never the device's allocations. */
typedef struct loom_host_task_args {
  uint32_t struct_size;
  void (*fn)(void* args);   /* required */
  const void* args;         /* copied at the call; may be NULL when args_bytes is 0 */
  size_t args_bytes;        /* <= LOOM_HOST_TASK_MAX_ARGS_BYTES */
} loom_host_task_args;

/* The most bytes of loom_host_task_args.args a device copies (a CUDA kernel's
 * parameter limit); more is LOOM_CODE_INVALID_ARGUMENT (since 1.12). */
#define LOOM_HOST_TASK_MAX_ARGS_BYTES 4096

/* The op table (loom_device_api.ops). Every op enqueues its work on `stream` (NULL =
 * the device's default stream) and returns; under a capture of that stream it is
 * recorded instead (capture_begin). The argument struct is borrowed for the call (a
 * device copies it); the buffers it points to must stay valid until the launch has
 * run, and for a recorded launch as long as its graph may replay. An argument struct
 * from a caller built for an older minor is shorter: the device reads the members
 * past its struct_size as zero. Each op may be NULL (not implemented: loom::Device
 * reports it when called); an op past the table's struct_size is absent. Ops of one
 * device come from its rank's thread. */
typedef struct loom_device_ops {
  uint32_t struct_size;
  /* loom_gemm_args. */
  loom_status (*gemm)(loom_device*, loom_stream*, const loom_gemm_args*);
  /* LayerNorm forward (loom_layernorm_fwd_args): y, mean and rstd. */
  loom_status (*layernorm_fwd)(loom_device*, loom_stream*, const loom_layernorm_fwd_args*);
  /* LayerNorm backward (loom_layernorm_bwd_args): dx, dgamma and dbeta. */
  loom_status (*layernorm_bwd)(loom_device*, loom_stream*, const loom_layernorm_bwd_args*);
  /* GeLU forward (loom_gelu_args): out = gelu(x). */
  loom_status (*gelu_fwd)(loom_device*, loom_stream*, const loom_gelu_args*);
  /* GeLU backward (loom_gelu_args): out = dy * gelu'(x). */
  loom_status (*gelu_bwd)(loom_device*, loom_stream*, const loom_gelu_args*);
  /* Attention forward (loom_attention_args): writes out and lse. */
  loom_status (*attention_fwd)(loom_device*, loom_stream*, const loom_attention_args*);
  /* Attention backward (loom_attention_args): reads lse, writes dq, dk and dv. */
  loom_status (*attention_bwd)(loom_device*, loom_stream*, const loom_attention_args*);
  /* One step of the softmax cross-entropy (loom_xent_args.step). */
  loom_status (*xent)(loom_device*, loom_stream*, const loom_xent_args*);
  /* Embedding lookup (loom_embedding_args, forward members). */
  loom_status (*embedding_fwd)(loom_device*, loom_stream*, const loom_embedding_args*);
  /* Embedding gradient (loom_embedding_args, backward members): dtable +=. */
  loom_status (*embedding_bwd)(loom_device*, loom_stream*, const loom_embedding_args*);
  /* One LOOM_EW_* kernel (loom_elementwise_args). */
  loom_status (*elementwise)(loom_device*, loom_stream*, const loom_elementwise_args*);
  /* One LOOM_RED_* reduction (loom_reduce_args). */
  loom_status (*reduce)(loom_device*, loom_stream*, const loom_reduce_args*);
  /* An AdamW update (loom_adamw_args). */
  loom_status (*adamw)(loom_device*, loom_stream*, const loom_adamw_args*);
  /* --- since 1.10 --- (the ops of Llama-style blocks) */
  /* RMSNorm forward (loom_rmsnorm_fwd_args): y and rstd. */
  loom_status (*rmsnorm_fwd)(loom_device*, loom_stream*, const loom_rmsnorm_fwd_args*);
  /* RMSNorm backward (loom_rmsnorm_bwd_args): dx and dgamma. */
  loom_status (*rmsnorm_bwd)(loom_device*, loom_stream*, const loom_rmsnorm_bwd_args*);
  /* SwiGLU forward (loom_swiglu_args): out = silu(gate) * up. */
  loom_status (*swiglu_fwd)(loom_device*, loom_stream*, const loom_swiglu_args*);
  /* SwiGLU backward (loom_swiglu_args): out = d[gate | up]. */
  loom_status (*swiglu_bwd)(loom_device*, loom_stream*, const loom_swiglu_args*);
  /* Rotary embedding forward (loom_rope_args): rotate by +t. */
  loom_status (*rope_fwd)(loom_device*, loom_stream*, const loom_rope_args*);
  /* Rotary embedding backward (loom_rope_args): rotate by -t. */
  loom_status (*rope_bwd)(loom_device*, loom_stream*, const loom_rope_args*);
  /* Sigmoid forward (loom_activation_args): out = s = 1 / (1 + exp(-x)), computed in
   * double and rounded once to fp32 (devices agree to within that rounding). */
  loom_status (*sigmoid_fwd)(loom_device*, loom_stream*, const loom_activation_args*);
  /* Sigmoid backward (loom_activation_args): out = dy * (s * (1 - s)), s as the forward's. */
  loom_status (*sigmoid_bwd)(loom_device*, loom_stream*, const loom_activation_args*);
  /* --- since 1.12 --- */
  /* Runs a plugin's host task (loom_host_task_args) in the stream's order, or records
   * it under a capture (its args copied with it). LOOM_CODE_INVALID_ARGUMENT when fn is
   * NULL, args is NULL with args_bytes > 0, or args_bytes exceeds
   * LOOM_HOST_TASK_MAX_ARGS_BYTES. Optional: NULL = no host tasks. device/cuda leaves
   * it NULL: a plugin brings CUDA kernels of its own and launches them on the stream's
   * native_stream, with memory from the device's alloc (host->alloc), and a capture of
   * that stream records them as it records the ops. */
  loom_status (*host_task)(loom_device*, loom_stream*, const loom_host_task_args*);
} loom_device_ops;

/* A device plugin's table. Each rank creates its own instance; the calls on one
 * instance come from that rank's thread, while the instances of the ranks of one
 * process run concurrently (state they share must be thread-safe). The engine may
 * also create short-lived instances from its main thread (the memory check of `loom
 * plan`, `validate` and `run`; device/cpu for planning). */
typedef struct loom_device_api {
  uint32_t struct_size;
  /* Creates the instance of one rank. options and args are borrowed for the call;
   * *out is the plugin's object, valid until destroy. May fail (e.g. no GPU): the
   * memory check then treats the capacity as unknown. Required. */
  loom_status (*create)(const loom_options* options, const loom_device_create_args* args,
                        loom_device** out);
  /* Destroys the instance, after every other call on it has returned and after the
   * streams, events and graphs made from it are destroyed; memory still allocated
   * is freed with it. Required. */
  void (*destroy)(loom_device* dev);
  /* Memory. Allocations are at least 256-byte aligned.
   *
   * Allocates `bytes` of device memory into *out (NULL for 0 bytes), owned by the
   * caller until free on the same instance; LOOM_CODE_OUT_OF_MEMORY when it cannot.
   * During a capture on a device with LOOM_DEVICE_GRAPH_POOL it comes from the graph
   * pool. Plugins allocate through host->alloc, which calls this slot. Required. */
  loom_status (*alloc)(loom_device* dev, size_t bytes, void** out);
  /* Frees memory from alloc of this instance; NULL is a no-op. Memory freed during a
   * capture (LOOM_DEVICE_GRAPH_POOL) stays with the graphs. Required. */
  void (*free)(loom_device* dev, void* ptr);
  /* Fills *out (loom_memory_stats: the caller sets struct_size). Optional: NULL = no
   * statistics (the engine reports none and cannot check its memory plan). */
  loom_status (*memory_stats)(loom_device* dev, loom_memory_stats* out);
  /* Copies `bytes` from src to dst, stream-ordered on `stream`; kind LOOM_COPY_*
   * says which side is host memory. It may return before the copy has run: host
   * memory passed must stay valid, and a DEVICE_TO_HOST result is readable, only
   * after stream_synchronize. Recorded under a capture. Required. */
  loom_status (*copy)(loom_device* dev, loom_stream* stream, void* dst, const void* src,
                      size_t bytes, int32_t kind);
  /* Streams and events. stream NULL = the device's default stream. The stream, event
   * and graph slots are optional (NULL = not implemented), but stream_synchronize is
   * required.
   *
   * Creates a stream; *out is the plugin's, valid until stream_destroy. */
  loom_status (*stream_create)(loom_device* dev, loom_stream** out);
  /* Destroys a stream from stream_create; NULL (the default stream) is a no-op. */
  void (*stream_destroy)(loom_device* dev, loom_stream* stream);
  /* Blocks the calling thread until the work launched on the stream so far has run.
   * Fails with LOOM_CODE_INVALID_ARGUMENT on a stream under capture (no host sync in
   * a captured region). Required. */
  loom_status (*stream_synchronize)(loom_device* dev, loom_stream* stream);
  /* Creates an event; *out is the plugin's, valid until event_destroy. */
  loom_status (*event_create)(loom_device* dev, loom_event** out);
  /* Destroys an event; NULL is a no-op. */
  void (*event_destroy)(loom_device* dev, loom_event* event);
  /* Records the event after the work launched on the stream so far. */
  loom_status (*event_record)(loom_device* dev, loom_event* event, loom_stream* stream);
  /* Makes later work on the stream wait for the event's last record (the host does
   * not wait). */
  loom_status (*stream_wait_event)(loom_device* dev, loom_stream* stream, loom_event* event);
  /* Blocks the calling thread until the event's last record has been reached. */
  loom_status (*event_synchronize)(loom_device* dev, loom_event* event);
  /* Graphs: between capture_begin and capture_end, work launched on the stream is
   * recorded, not run; replay runs it again on the same addresses. One capture at a
   * time per instance.
   *
   * Starts recording the stream (a nested capture on the same instance is refused). */
  loom_status (*capture_begin)(loom_device* dev, loom_stream* stream);
  /* Ends the capture of the stream; *out is the recorded graph, the plugin's, valid
   * until graph_destroy. */
  loom_status (*capture_end)(loom_device* dev, loom_stream* stream, loom_graph** out);
  /* Runs the graph's work on the stream (stream-ordered); on a stream under capture
   * the graph is recorded into the outer capture. */
  loom_status (*graph_replay)(loom_device* dev, loom_graph* graph, loom_stream* stream);
  /* Destroys a graph; NULL is a no-op. With LOOM_DEVICE_GRAPH_POOL the pool is
   * released with the last graph. */
  void (*graph_destroy)(loom_device* dev, loom_graph* graph);
  /* The backend's native stream (cudaStream_t for CUDA; NULL on CPU), for comm plugins.
   * Owned by the device, valid while the stream lives. Optional: NULL = callers pass
   * NULL. */
  void* (*native_stream)(loom_device* dev, loom_stream* stream);
  /* DLPack device type of this device's memory (kDLCPU, kDLCUDA). */
  int32_t dl_device_type;
  /* The op table, the library's (static), valid while it is loaded. Required. */
  const loom_device_ops* ops;
  /* --- since 1.2 --- */
  /* A stream-ordered 2-D copy (cudaMemcpy2DAsync's semantics): `rows` rows of
   * `width` bytes, row r from src + r * src_pitch to dst + r * dst_pitch (pitches in
   * bytes, >= width). The regions must not overlap. Host memory as for copy.
   * Optional: NULL (and a table built before 1.2) = loom::Device::copy_2d issues one
   * copy per row. */
  loom_status (*copy_2d)(loom_device* dev, loom_stream* stream, void* dst, size_t dst_pitch, const void* src,
                         size_t src_pitch, size_t width, size_t rows, int32_t kind);
  /* LOOM_DEVICE_* capability bits (a table built before 1.2, which lacks the member,
   * has none). */
  uint64_t features;
} loom_device_api;

/* loom_device_api.features: layernorm_bwd and embedding_bwd honour grad_fp32 (gemm's
 * bf16 A/B with an fp32 C and reduce's fp32 out of bf16 x are required of every
 * device). */
#define LOOM_DEVICE_GRAD_FP32 (1ull << 0)
/* Memory allocated during a capture and freed stays with the device's graphs
 * (a graph pool shared by all its graphs, reused only by later captures, released
 * with the last graph), as replays write it again. exec plugins that replay
 * captured steps need it (since 1.3). */
#define LOOM_DEVICE_GRAPH_POOL (1ull << 1)
/* elementwise DROPOUT honours seed_device (since 1.3). */
#define LOOM_DEVICE_SEED_DEVICE (1ull << 2)
/* attention_fwd / attention_bwd honour kv_seq, q_offset, the kv strides and
 * accumulate_dkv (a query window inside a longer key sequence: context parallelism)
 * (since 1.6). */
#define LOOM_DEVICE_ATTENTION_WINDOW (1ull << 3)
/* adamw and reduce (SUM, SUM_SQUARES, MAX_ABS) honour num_segments / segments:
 * one call for many tensors of a flat buffer (an optimizer step in two launches)
 * (since 1.8). */
#define LOOM_DEVICE_MULTI_TENSOR (1ull << 4)
/* The device's memory is the host's: its allocations are ordinary host pointers, which
 * any comm plugin can read and write (since 1.9). */
#define LOOM_DEVICE_HOST_MEMORY (1ull << 5)
/* gemm honours epilogue, bias, aux and ldaux (since 1.11). */
#define LOOM_DEVICE_GEMM_EPILOGUE (1ull << 6)
/* XENT_BACKWARD may write dlogits over logits (dlogits == logits, the same ld): the
 * gradient of the logits then takes no memory of its own (since 1.18). */
#define LOOM_DEVICE_XENT_IN_PLACE (1ull << 7)
/* rope_fwd / rope_bwd honour inv_freq (since 1.20). */
#define LOOM_DEVICE_ROPE_FREQUENCIES (1ull << 8)
/* attention_fwd / attention_bwd honour loom_attention_args.window (since 1.21). */
#define LOOM_DEVICE_ATTENTION_SLIDING_WINDOW (1ull << 9)
/* attention_fwd / attention_bwd honour loom_attention_args.key_start (since 1.22). */
#define LOOM_DEVICE_ATTENTION_KEY_START (1ull << 10)

/* ------------------------------------------------------------------------- */
/* Comm plugins: one communicator per rank group.                             */
/* Buffers are device memory of the calling rank; `stream` is the device's    */
/* native stream (NULL on CPU). Counts are in elements.                       */
/* ------------------------------------------------------------------------- */

/* loom_comm_api.world_create's arguments (borrowed for the call). */
typedef struct loom_comm_world_args {
  uint32_t struct_size;
  int32_t world_size;            /* ranks of the whole run */
  int32_t num_local_ranks;       /* ranks hosted by this process */
  const int32_t* local_ranks;    /* their global ranks */
  int64_t timeout_ms;            /* a collective that waits longer fails (<= 0: wait forever) */
} loom_comm_world_args;

/* loom_comm_api.group_create's arguments (borrowed for the call). */
typedef struct loom_group_desc {
  uint32_t struct_size;
  const char* kind;              /* "tp", "dp", "pp", ... (for messages) */
  const int32_t* ranks;          /* global ranks, in rank-in-group order */
  int32_t size;                  /* entries of ranks */
  int32_t my_rank;               /* the caller's global rank */
} loom_group_desc;

/* loom_collective.kind (since 1.15). */
#define LOOM_COLLECTIVE_ALL_REDUCE 0
#define LOOM_COLLECTIVE_ALL_GATHER 1
#define LOOM_COLLECTIVE_REDUCE_SCATTER 2
/* Point to point (since 1.17; start takes them on a comm with LOOM_COMM_START_P2P):
 * SEND sends count elements of `send` to `peer` under `tag`, as loom_comm_api.send;
 * RECV receives into `recv` the message of (peer, tag) that a blocking recv posted at
 * the same moment would get. A started send or receive keeps no order with the comm's
 * collectives (it neither waits behind started ones nor holds later calls back); the
 * receives of one (peer, tag), started or blocking, take that peer's messages in the
 * order they were posted. A started receive lets the transfer happen before its wait
 * (Megatron-LM's overlap_p2p_comm): a pipeline posts the next step's receive before
 * computing the current one. */
#define LOOM_COLLECTIVE_SEND 3
#define LOOM_COLLECTIVE_RECV 4

/* A collective to start without waiting (loom_comm_api.start, since 1.15): the
 * arguments of the blocking call of that kind (borrowed for the start call; the
 * buffers are the collective's until its wait). */
typedef struct loom_collective {
  uint32_t struct_size;
  int32_t kind;                  /* LOOM_COLLECTIVE_* */
  const void* send;
  void* recv;
  size_t count;                  /* as the blocking call's count */
  int32_t dtype;
  int32_t op;                    /* LOOM_REDUCE_* (all-reduce, reduce-scatter) */
  /* --- since 1.17 --- */
  int32_t peer;                  /* SEND, RECV: the other rank, within the group */
  int32_t tag;                   /* SEND, RECV: as send's and recv's tag */
} loom_collective;

/* A comm plugin's table. A collective is called by every member of the group, each
 * from its own rank's thread (or process), with matching arguments and in the same
 * order as the group's other collectives; it returns a status on this member only.
 * The calls on one loom_comm come from one thread at a time; different members call
 * concurrently. Where the backend has streams (comm/nccl) the work is ordered on
 * `stream` and the caller synchronises before reading a result on the host; the
 * others complete before returning. In place: all_reduce and broadcast with send ==
 * recv, all_gather with send == recv + rank * count, reduce_scatter with recv ==
 * send + rank * count; other overlaps are refused. The collectives are optional
 * (NULL: the engine's shim and loom::Group report the missing one when called). */
typedef struct loom_comm_api {
  uint32_t struct_size;
  /* Once per process.
   *
   * Called by the engine's launching thread before any rank starts. options and args
   * are borrowed for the call; *out is the plugin's, valid until world_destroy.
   * Required. */
  loom_status (*world_create)(const loom_options* options, const loom_comm_world_args* args,
                              loom_comm_world** out);
  /* Called by the launching thread after every rank's thread has ended (their
   * groups destroyed). Required. */
  void (*world_destroy)(loom_comm_world* world);
  /* Called by every member of a group (from its own rank thread or process).
   *
   * Joins the group `desc` describes; returns once every member has joined (or
   * fails after the world's timeout). *out is this member's handle, the plugin's,
   * valid until group_destroy; a group of one rank gets one too. Members create the
   * groups of one rank list in the same order. Required. */
  loom_status (*group_create)(loom_comm_world* world, const loom_group_desc* desc, loom_comm** out);
  /* Releases this member's handle, from its rank's thread after its last call on it
   * (the engine: when the rank ends). No collective. Required. */
  void (*group_destroy)(loom_comm* comm);
  /* recv = the elementwise reduction (op: LOOM_REDUCE_*) of every member's send,
   * count elements of dtype each. */
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
  /* As all_to_all with a count and a displacement (in elements) per rank: send_counts[i]
   * elements from send + send_displs[i] go to rank i, recv_counts[j] elements from rank
   * j land at recv + recv_displs[j]. Each array has one entry per member (borrowed for
   * the call); recv_counts[j] must equal what rank j sends here. */
  loom_status (*all_to_all_v)(loom_comm* comm, void* stream, const void* send,
                              const size_t* send_counts, const size_t* send_displs, void* recv,
                              const size_t* recv_counts, const size_t* recv_displs, int32_t dtype);
  /* buf of the member `root` (a rank in the group) is copied into every member's buf. */
  loom_status (*broadcast)(loom_comm* comm, void* stream, void* buf, size_t count, int32_t dtype,
                           int32_t root);
  /* Returns once every member has called it (host-synchronous; no stream). */
  loom_status (*barrier)(loom_comm* comm);
  /* Point to point; peers are ranks within the group. send never blocks on the receiver.
   *
   * Sends count elements to peer under tag; buf may be reused once it returns (stream
   * backends: once the stream reaches it). */
  loom_status (*send)(loom_comm* comm, void* stream, const void* buf, size_t count, int32_t dtype,
                      int32_t peer, int32_t tag);
  /* Receives the oldest unreceived message of (peer, tag) into buf; count and dtype
   * must match the send's. Waits for it up to the world's timeout. */
  loom_status (*recv)(loom_comm* comm, void* stream, void* buf, size_t count, int32_t dtype,
                      int32_t peer, int32_t tag);
  /* Makes every pending and future wait of this world fail at once with `reason`
   * (the engine calls it when a rank fails, so the others stop instead of waiting
   * for their timeout). Called from any thread (the failing rank's), concurrently
   * with the other ranks' calls; reason is borrowed for the call. Optional: NULL =
   * the others wait for their timeout. */
  void (*world_abort)(loom_comm_world* world, const char* reason);
  /* --- since 1.9 --- */
  /* LOOM_COMM_* bits: where the ranks of a world may live and what buffers the
   * collectives take. The engine checks a run against them before launch; a table
   * built before 1.9 ends before this member and is not checked. */
  uint64_t features;
  /* --- since 1.15 --- */
  /* Starts collective *c and returns without waiting for it; *req is the plugin's
   * until wait. It runs on the plugin's own thread (or stream) concurrently with
   * the caller, after every collective this member called or started on comm
   * before it and before every one after it (a blocking call on comm while requests
   * are pending waits behind them), so members still call in one order. Stream
   * backends order it after the work already on `stream`. The buffers are the
   * collective's until its wait returns. Other members may call start or the
   * blocking collective for the same operation. NULL: the engine runs it at start,
   * in line (no overlap). Kinds SEND and RECV (since 1.17) only on a comm with
   * LOOM_COMM_START_P2P, with their own order (see LOOM_COLLECTIVE_SEND); such a
   * plugin may refuse a receive it cannot post early with LOOM_CODE_UNSUPPORTED.
   * Without the bit, or for a refused receive, the engine runs a started send at
   * start and a started receive at its wait (or at a later receive of its pair),
   * keeping the posting order. */
  loom_status (*start)(loom_comm* comm, void* stream, const loom_collective* c, loom_comm_request** req);
  /* Waits for a started collective and releases req, whatever its outcome, which is
   * returned: thread backends return once it finished; stream backends order
   * `stream` after it (the host may return earlier). Every request is waited for
   * exactly once, from the thread that calls this member's collectives, before
   * group_destroy. Required when start is given. */
  loom_status (*wait)(loom_comm* comm, loom_comm_request* req, void* stream);
} loom_comm_api;

/* loom_comm_api.features (since 1.9). LOOM_COMM_THREADS: every rank of a world may be
 * a thread of one process. LOOM_COMM_PROCESSES: one process per rank (mpirun, srun).
 * LOOM_COMM_DEVICE_BUFFERS: send and receive buffers may be device memory (a device
 * without LOOM_DEVICE_HOST_MEMORY); without it, buffers are host memory: on such a
 * device the engine copies a collective's device buffers through host memory around
 * the call (a plugin built before 1.9 gets them as they are). */
#define LOOM_COMM_THREADS (1ull << 0)
#define LOOM_COMM_PROCESSES (1ull << 1)
#define LOOM_COMM_DEVICE_BUFFERS (1ull << 2)
/* start takes LOOM_COLLECTIVE_SEND and LOOM_COLLECTIVE_RECV (since 1.17). */
#define LOOM_COMM_START_P2P (1ull << 3)

/* A rank group as the host hands it to plugins (a copy; the host owns the
 * communicator, which stays valid until the rank ends). */
typedef struct loom_group {
  uint32_t struct_size;
  const loom_comm_api* api;      /* the comm table (the engine's shim, counting calls) */
  loom_comm* comm;               /* valid for every group, size 1 included, in a run; NULL, as
                                    api, in the groups of layers created only to plan memory */
  int32_t size;                  /* members */
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

/* One parameter a layer declares (loom_layer_api.params). The engine reads a
 * layer's array with the stride of its first element's struct_size (every element
 * must carry the same), so the shorter elements of a layer built for an older minor
 * read right; a struct_size no 1.x declaration has is refused naming the layer. */
typedef struct loom_param_decl {
  uint32_t struct_size;      /* sizeof(loom_param_decl) of the layer's header */
  const char* name;          /* unique within the layer, e.g. "qkv.weight" */
  int32_t ndim;              /* 1..4 */
  int64_t shape[4];          /* full (unpartitioned) shape */
  int32_t partition_dim;     /* dim split across tp (-1 = duplicated on every tp rank) */
  int32_t partition_stride;  /* >1: that dim is `stride` concatenated blocks, each split */
  int32_t init;              /* LOOM_INIT_* */
  float init_std;            /* the standard deviation of the NORMAL inits */
  int32_t no_weight_decay;   /* 1 for norms and biases */
  const char* tie_key;       /* params with the same tie_key share storage (weight tying);
                                NULL = not tied */
  /* --- since 1.4 --- */
  /* 1 = dim 0 holds one block per expert (a MoE layer's experts) and is split
   * over the expert-parallel group: ep rank i holds experts [i * n / ep, (i + 1) * n
   * / ep) of the n in dim 0 (partition_dim, which must not be 0, then splits over tp
   * as usual). Its gradient is reduced over the expert data-parallel group (edp), not
   * dp. The elements of a layer built before 1.4 end before it: expert 0. */
  int32_t expert;
} loom_param_decl;

/* The model's dimensions, as the manifest sets them (not divided by tp or cp). */
typedef struct loom_model_dims {
  uint32_t struct_size;
  int64_t hidden, heads, ffn_hidden, seq_len;   /* hidden size, attention heads, MLP width,
                                                   tokens per sample */
  int64_t vocab;             /* real vocabulary size */
  int64_t padded_vocab;      /* multiple of the padding divisor (and of tp) */
  int64_t micro_batch;       /* samples per microbatch */
  int32_t num_layers;        /* transformer blocks in the whole model */
  int32_t block_index;       /* which block this layer belongs to (-1 outside blocks) */
  int32_t tie_embeddings;    /* 1: the output layer shares the word embedding (tie_key "word_embedding") */
} loom_model_dims;

/* loom_layer_api.create's arguments (borrowed for the call: copy what you keep). */
typedef struct loom_layer_create_args {
  uint32_t struct_size;
  const loom_model_dims* dims;   /* the model's dimensions (block_index: this layer's) */
  const char* instance_name; /* e.g. "blocks.3.attention" */
  loom_group tp;             /* tensor-parallel group of this rank (its communicator stays
                                valid until the layer is destroyed) */
  int32_t sequence_parallel; /* 1: hidden states outside TP regions are 1/tp sequence shards */
  /* --- since 1.2 --- */
  LOOM_EXTENSION union { int32_t pad0; int32_t pad_1_1; };  /* padding: 1.1's struct ended after
                                                           sequence_parallel; 0 */
  /* bf16 parameters with fp32 gradients may be accumulated by the ops straight
   * into the fp32 gradients (grad_fp32; manifest device.grad_accumulation_fusion). */
  int32_t grad_accumulation_fusion;
} loom_layer_create_args;

/* Hidden states are [seq, micro_batch, hidden] (sequence-major, as in Megatron),
 * fp32 or the run's activation dtype. tokens and targets are [seq, micro_batch] int32.
 *
 * Context parallelism (since 1.6), where the rank group "cp" has cp > 1 ranks (only
 * layers with LOOM_LAYER_CONTEXT_PARALLEL are given such a run): the sequence of seq_len
 * positions is cut into 2*cp chunks of seq_len / (2*cp); cp rank r holds chunks r
 * and 2*cp - 1 - r, in that order (each rank gets an early and a late chunk, so
 * causal attention costs the same on every rank). tokens, targets and hidden states
 * hold these seq_len / cp rows (hidden states: their 1/tp shard under sequence
 * parallelism); a layer computes the serial model's values for them. The loss
 * scale and the gradients follow Megatron: the engine sums loss_sum and loss_count
 * over cp, gives every cp rank loss_scale = cp / (tokens * microbatches) (and
 * aux_loss_scale = cp / microbatches) and the optimizer strategy averages
 * gradients over the "dp-cp" group (its `dp`).
 *
 * loom_layer_api.forward's arguments, borrowed for the call: the DLTensor views and
 * host pointers are valid during the call only; the device memory the views point
 * to holds the data until the step's backward. */
typedef struct loom_layer_fwd_args {
  uint32_t struct_size;
  int32_t microbatch;        /* activations are saved per microbatch */
  int32_t training;          /* 0: no activations need be saved */
  const DLTensor* input;     /* NULL for the first layer */
  DLTensor* output;          /* NULL for the last layer */
  const DLTensor* tokens;    /* this microbatch's input ids */
  const DLTensor* targets;   /* and the ids each position predicts (negative = ignored) */
  float* loss_sum;           /* host: the last layer writes the summed loss of the microbatch */
  int64_t* loss_count;       /* host: and how many tokens it covers */
  uint64_t dropout_seed;     /* identical on all tp ranks; layers derive per-rank seeds */
  int32_t* predictions;      /* host, optional: the last layer writes argmax tokens [seq, micro_batch] */
  /* --- since 1.3 --- */
  /* Device memory holding dropout_seed (the same value, at the same address
   * for the same microbatch every step): what a captured dropout reads. */
  const uint64_t* dropout_seed_device;
  /* --- since 1.4 --- */
  /* Host, training forwards: a layer with an auxiliary loss (MoE load
   * balancing) adds this microbatch's value, already weighted by its coefficient,
   * for reporting; NULL = not reported. */
  float* aux_loss;
  /* --- since 1.7 --- */
  /* Sub-steps: a layer that captures parts of its step (capturable() == 2)
   * runs each part through the rank's exec plugin (host->exec) as a
   * loom_exec_step with this key, its own substep >= 1 and capturable =
   * substeps_capturable. step_key is the engine's key of this layer step (the
   * same for the same layer and microbatch every step); substeps_capturable is 1
   * when parts may be captured now: a training step whose dropout seed is in
   * device memory, a tp group of one rank and an exec plugin with
   * LOOM_EXEC_SUBSTEPS, else 0. The engine always sets both. */
  int64_t step_key;
  int32_t substeps_capturable;
  LOOM_EXTENSION union { int32_t reserved; int32_t reserved_1_7; };  /* 0 */
  /* --- since 1.13 --- */
  /* Generation with a key/value cache (`loom generate`), only for a layer with
   * LOOM_LAYER_KV_CACHE and always with training = 0. 1: the rows are sequence
   * positions [position_offset, position_offset + rows) of micro_batch sequences
   * (hidden states [rows, micro_batch, hidden], tokens [rows, micro_batch]; never
   * sequence- or context-parallel, no targets: `targets` is NULL). A layer that mixes
   * positions keeps what later positions need of these rows (attention: their keys
   * and values, up to the model's seq_len positions) and attends to what earlier
   * calls kept of positions [0, position_offset); position_offset 0 starts new
   * sequences. 0: a training or evaluation forward of whole sequences. */
  int32_t kv_cache;
  int32_t reserved_1_13;   /* 0 */
  int64_t position_offset; /* kv_cache: the sequence position of the first row; else 0 */
  /* Host, kv_cache forwards of the last layer, optional: it writes the fp32 logits
   * of every sequence's last row here, [micro_batch, vocab] (the unpadded vocabulary,
   * all of it on every tensor-parallel rank). NULL: not asked. */
  float* logits;
  /* --- since 1.22 --- */
  /* Documents packed in a sequence, ended by end-of-document tokens (given only to
   * layers with LOOM_LAYER_DOCUMENTS). Both [rows, micro_batch] int32 in device
   * memory, laid out as tokens (the rows of this rank's context-parallel slice),
   * holding the data until the step's backward like the other views:
   *   document_start (Megatron-LM's reset_attention_mask): where each row's document
   *     begins, as a position in the whole sequence (the position after the last
   *     end-of-document token before the row, or 0); a position attends to its
   *     document's positions only. NULL: each sequence is one document.
   *   position_ids (Megatron-LM's reset_position_ids): each row's position counted from
   *     its document's start, what rotary and learned position embeddings use. NULL:
   *     the row's position in the whole sequence. */
  const DLTensor* document_start;
  const DLTensor* position_ids;
} loom_layer_fwd_args;

/* loom_layer_api.backward's arguments, borrowed for the call as the forward's. */
typedef struct loom_layer_bwd_args {
  uint32_t struct_size;
  int32_t microbatch;          /* the forward's */
  const DLTensor* grad_output; /* NULL for the last layer */
  DLTensor* grad_input;        /* NULL for the first layer */
  float loss_scale;            /* last layer: dL/d(loss_sum) */
  /* --- since 1.4 --- */
  LOOM_EXTENSION union { int32_t pad0; int32_t pad_1_3; };  /* padding: 1.3's struct ended after
                                                             loss_scale; 0 */
  /* d(objective)/d(aux_loss) for this microbatch: 1 / microbatches per step
   * (auxiliary losses are averaged over microbatches like the main loss, and over
   * data-parallel ranks by the gradient reduction), on every pipeline stage.
   * Under context parallelism (since 1.6) cp / microbatches, as loss_scale carries
   * the factor cp: a layer whose auxiliary loss covers the whole microbatch (MoE
   * routing) backpropagates, on each cp rank, its own tokens' part of it, and the
   * dp-cp average sums those. */
  float aux_loss_scale;
  /* --- since 1.7 --- */
  LOOM_EXTENSION union { int32_t pad1; int32_t pad_1_6; };  /* padding: 1.6's struct ended after
                                                             aux_loss_scale; 0 */
  /* As in loom_layer_fwd_args (the key of this backward step). */
  int64_t step_key;
  int32_t substeps_capturable;
  LOOM_EXTENSION union { int32_t reserved; int32_t reserved_1_7; };  /* 0 */
} loom_layer_bwd_args;

/* loom_layer_api.validate's arguments (since 1.12), borrowed for the call: the run as
 * the engine has planned it, before any rank starts. Sizes are the parallel layout's
 * (parallel.tp, cp, ep, pp, dp; etp as resolved: tp when the manifest leaves it 0). */
typedef struct loom_layer_validate_args {
  uint32_t struct_size;
  int32_t device_type;            /* DLPack type of the run's device memory (kDLCPU, kDLCUDA) */
  const loom_model_dims* dims;    /* the model's dimensions (block_index: this layer's) */
  const char* instance_name;      /* e.g. "blocks.3.attention" */
  int32_t act_dtype;              /* LOOM_DTYPE_* of hidden states and activations */
  int32_t param_dtype;            /* of the parameters (device.param_dtype) */
  int32_t grad_dtype;             /* of the gradients (device.grad_dtype) */
  int32_t tp, cp, ep, etp, pp, dp;
  int32_t sequence_parallel;      /* 1: parallel.sequence_parallel */
  uint64_t device_features;       /* LOOM_DEVICE_* of the run's device plugin */
  const loom_device_ops* device_ops;  /* the run's device plugin's op table (check an op with
                                         LOOM_HAS_SLOT and non-NULL); never call it */
} loom_layer_validate_args;

/* One array of a layer's state (loom_layer_api.state, since 1.23): values outside
 * the parameters that the layer updates itself, not the optimizer (DeepSeek-V3's
 * per-expert routing bias, moved by the experts' load), and that the engine
 * checkpoints with the parameters. The engine reads the stride of the first
 * element's struct_size, as for loom_param_decl. */
typedef struct loom_layer_state_decl {
  uint32_t struct_size;      /* sizeof(loom_layer_state_decl) of the layer's header */
  uint32_t pad0;             /* 0 (the padding before name, named) */
  const char* name;          /* unique among the layer's states, e.g. "router.expert_bias" */
  int64_t count;             /* fp32 elements, >= 1 */
  float* data;               /* host memory, the layer's, valid until destroy */
  uint32_t flags;            /* LOOM_LAYER_STATE_* */
  uint32_t reserved_1_23;    /* 0 */
} loom_layer_state_decl;

/* loom_layer_state_decl.flags: a checkpoint without this array (one written before
 * the layer kept it) still loads, the array keeping the layer's own values; for
 * values the next step recomputes, never for what the model computes with. Without
 * the bit, a checkpoint that lacks the array is refused. */
#define LOOM_LAYER_STATE_OPTIONAL (1u << 0)

/* loom_layer_api.end_step's arguments (since 1.23), borrowed for the call. */
typedef struct loom_layer_step_end_args {
  uint32_t struct_size;
  int32_t microbatches;      /* training microbatches this rank ran in the step */
  int64_t step;              /* the step ending, 1-based (the optimizer's) */
} loom_layer_step_end_args;

/* A layer plugin's table. Each rank creates its own instances (one per layer of
 * the model it holds) and calls them from its thread. The engine also creates
 * instances only to plan memory (`loom plan`, `validate`, the check before a run):
 * their groups have NULL api and comm, bind gets views whose data is NULL, and only
 * params, bind, activation_bytes and destroy are called; create must not
 * communicate, and memory a run needs beyond the parameters (tables sized by the
 * tokens of a microbatch) is best allocated in a bind with data: a manifest of any
 * size is planned, and planning instances never run. */
typedef struct loom_layer_api {
  uint32_t struct_size;
  /* Creates one layer instance. options and args are borrowed for the call; rank
   * stays valid until destroy; *out is the plugin's, valid until destroy. Required. */
  loom_status (*create)(const loom_options* options, loom_rank* rank,
                        const loom_layer_create_args* args, loom_layer** out);
  /* Destroys the instance and what it allocated. Required. */
  void (*destroy)(loom_layer* layer);
  /* The layer's parameters; the array stays valid while the layer lives.
   *
   * *out: *count declarations, owned by the layer (read with the stride of
   * (*out)[0].struct_size). Required. */
  loom_status (*params)(loom_layer* layer, const loom_param_decl** out, size_t* count);
  /* Views of this rank's slice of each parameter and its gradient, in declaration
   * order, living in the engine's flat buffers. Gradients are accumulated (+=).
   *
   * Called once, before the first forward. The two arrays of `count` DLTensors (and
   * their shapes) are borrowed for the call; the memory they point to stays valid
   * until destroy. Required. */
  loom_status (*bind)(loom_layer* layer, const DLTensor* params, const DLTensor* grads,
                      size_t count);
  /* Runs the forward of one microbatch (loom_layer_fwd_args), enqueuing its work on
   * the rank's device; rank is the one of create. A training forward saves what the
   * backward of args->microbatch needs; several microbatches may be in flight
   * (pipeline schedules). Required. */
  loom_status (*forward)(loom_layer* layer, loom_rank* rank, const loom_layer_fwd_args* args);
  /* Runs the backward of a microbatch whose training forward ran (loom_layer_bwd_args),
   * accumulates the parameter gradients and frees what that forward saved. Required. */
  loom_status (*backward)(loom_layer* layer, loom_rank* rank, const loom_layer_bwd_args* args);
  /* Frees what forward saved for `microbatch` (also done by backward).
   *
   * Optional, but the engine refuses activation recomputation
   * (model.recompute_granularity) for a layer without it. */
  void (*release)(loom_layer* layer, int32_t microbatch);
  /* Bytes of activations saved per microbatch (for planning).
   *
   * Called after bind. Optional: NULL = 0. */
  uint64_t (*activation_bytes)(loom_layer* layer);
  /* Multiply-adds x2 of one forward over one microbatch (for MFU).
   *
   * Optional: NULL = 0. */
  double (*forward_flops)(loom_layer* layer);
  /* --- since 1.3 --- */
  /* 1 when this layer's training forward and backward obey the graph rules,
   * so an exec plugin with LOOM_EXEC_REPLAYS may capture them once and replay:
   * every launch on the rank's device (default stream); no host synchronisation,
   * device-to-host read or host decision on device data; no value that changes
   * from step to step passed to a launch by value (a dropout seed, the backward's
   * loss_scale) and no write through the forward's host pointers (loss_sum,
   * loss_count, predictions); no collective (the engine captures only layers whose
   * tp group has one rank). Its host code runs once, at capture: per-microbatch
   * state must live in device memory allocated inside the step (from the device's
   * graph pool while captured). NULL or 0: always run directly.
   * 2 (since 1.7) = "captures parts of its step": the whole step runs directly and
   * the layer runs its graph-safe parts as sub-steps (loom_layer_fwd_args.step_key);
   * the engine keeps the hidden states at fixed addresses as for 1. The engine
   * treats 2 from a layer built before 1.7 as 0. Called once, after create. */
  int32_t (*capturable)(loom_layer* layer);
  /* --- since 1.6 --- */
  /* LOOM_LAYER_* capability bits (a table built before 1.6, which lacks the member,
   * has none). */
  uint64_t features;
  /* --- since 1.12 --- */
  /* Checks that the layer can run this configuration, before any rank starts:
   * called by `loom validate`, `loom plan` and `loom run`'s check before launch, once
   * per layer instance of the model, from the engine's main thread, with the options
   * create would get and the run's device plugin (not the CPU device the engine plans
   * memory on). Returns NULL, or a status with LOOM_CODE_INVALID_ARGUMENT whose message
   * names the setting to change (a manifest key, an option: `device.param_dtype =
   * "fp32"`); the engine reports it as it reports create's refusals. No device work,
   * no allocation that outlives the call. Optional: NULL (and a table built before
   * 1.12) = create's checks only. */
  loom_status (*validate)(const loom_options* options, const loom_layer_validate_args* args);
  /* --- since 1.19 --- */
  /* Bytes of device memory one forward or one backward of a microbatch holds at its
   * peak beyond what forwards save (activation_bytes) and the hidden states and
   * gradients the engine passes in and out: the temporaries it allocates and frees
   * before returning (norm outputs, recomputed activations, gradients of its inner
   * tensors, buffers for its collectives), at the shapes of create. For planning: the
   * engine adds the largest over a rank's layers to the rank's plan (`loom plan`, the
   * check before a run). Called after bind. Optional: NULL (and a table built before
   * 1.19) = 0. */
  uint64_t (*workspace_bytes)(loom_layer* layer);
  /* --- since 1.23 --- */
  /* The layer's state (loom_layer_state_decl): *count arrays, owned by the layer,
   * valid while it lives. Called after bind, on instances that run (never on planning
   * ones). The layer keeps the values equal on every rank holding it (tp, cp, dp and ep
   * replicas alike; e.g. from sums over "tp-dp-cp" in end_step), and a save refuses
   * copies that differ; the engine saves one copy per pipeline stage with each
   * checkpoint and writes it into every rank's arrays when a run resumes or starts
   * from the checkpoint (checkpoint.init_weights, `loom generate`, `loom eval`), at
   * any parallel layout. It touches `data` only between steps. Optional: NULL (and a
   * table built before 1.23) = no state. */
  loom_status (*state)(loom_layer* layer, const loom_layer_state_decl** out, size_t* count);
  /* Ends a training step (Megatron-Core's finalize_model_grads): called once per
   * step on every rank, for each of its layers in model order, after the step's last
   * backward and before the optimizer step; a layer updates its state from what the
   * step's training microbatches saw (counted once each, in backward: a recomputed
   * forward runs twice). It may run collectives over the groups inside its pipeline
   * stage (tp, cp, dp, ep, etp, edp and their products such as "tp-dp-cp", the ranks
   * that hold the layer), whose ranks all call it at the same point; never over pp,
   * embedding or world, whose other stages call it for other layers. Optional: NULL
   * (and a table built before 1.23) = nothing. */
  loom_status (*end_step)(loom_layer* layer, loom_rank* rank, const loom_layer_step_end_args* args);
} loom_layer_api;

/* loom_layer_api.features: the layer takes a context-parallel slice of the
 * sequence (see loom_layer_fwd_args); the engine refuses parallel.cp > 1 for a model
 * with a layer that lacks it (since 1.6). */
#define LOOM_LAYER_CONTEXT_PARALLEL (1ull << 0)
/* The layer's place in the model (since 1.9). LOOM_LAYER_READS_TOKENS: it reads the
 * batch's tokens and takes no input hidden state (an embedding), so it can only be
 * the model's first layer. LOOM_LAYER_WRITES_LOSS: it writes the loss and no output
 * hidden state (an output head), so it can only be the last. The engine refuses a
 * model whose first or last layer, built for 1.9 or later, does not have the bit, or
 * whose other layers do; a layer built before 1.9 declares neither and is not checked. */
#define LOOM_LAYER_READS_TOKENS (1ull << 1)
#define LOOM_LAYER_WRITES_LOSS (1ull << 2)
/* The layer takes loom_layer_fwd_args.kv_cache forwards (since 1.13; the last layer
 * also writes `logits`): `loom generate` refuses a model with a layer, built for 1.13
 * or later, that lacks the bit, and every layer built before 1.13. */
#define LOOM_LAYER_KV_CACHE (1ull << 3)
/* The layer honours loom_layer_fwd_args.document_start and position_ids (since 1.22),
 * or mixes and embeds no positions (an MLP): the engine refuses
 * data.reset_attention_mask and data.reset_position_ids for a model with a layer that
 * lacks the bit. */
#define LOOM_LAYER_DOCUMENTS (1ull << 4)

/* ------------------------------------------------------------------------- */
/* Optimizer strategy plugins (parallel/ddp, parallel/distributed)                */
/* ------------------------------------------------------------------------- */

/* One parameter of the model as the optimizer sees it (loom_optimizer_create_args.infos). */
typedef struct loom_param_info {
  uint32_t struct_size;
  const char* name;          /* global, e.g. "blocks.3.attention.qkv.weight" */
  size_t offset;             /* element offset in the flat buffers */
  size_t numel;              /* local elements */
  int32_t no_weight_decay;   /* 1: weight_decay does not apply (loom_param_decl's) */
  int32_t duplicated;        /* 1: identical copy on every tp rank (count once in norms);
                              * for an expert parameter under MoE folding (since 1.5),
                              * on every etp rank */
} loom_param_info;

/* loom_optimizer_api.create's arguments. The arrays and the struct are borrowed for
 * the call (copy what you keep); the flat buffers and the groups' communicators stay
 * valid until destroy. */
typedef struct loom_optimizer_create_args {
  uint32_t struct_size;
  void* params;              /* flat parameter buffer (device) */
  void* grads;               /* flat gradient buffer (device) */
  size_t numel;              /* elements of each buffer, padding included */
  int32_t param_dtype, grad_dtype;   /* LOOM_DTYPE_F32 or LOOM_DTYPE_BF16 */
  const loom_param_info* infos;      /* num_params entries, in model order */
  size_t num_params;                 /* entries of infos (and of the flag arrays below) */
  /* Groups for grad sync and norm reductions. dp is the group gradients are averaged
   * over: the "dp-cp" group under context parallelism. */
  loom_group dp, tp, pp;
  /* Buckets of the buffers (Megatron's layout: reverse model order, 64-element
   * aligned starts, each bucket a multiple of lcm(dp, 128) elements): bucket b is
   * [bucket_offsets[b], bucket_offsets[b + 1]); num_buckets + 1 entries. */
  const size_t* bucket_offsets;
  size_t num_buckets;          /* buckets (bucket_offsets has one entry more) */
  /* --- since 1.1 --- */
  /* NULL, or num_params flags: 1 = this rank's copy of the parameter is also held
   * on another pipeline stage (the tied word embedding on the last stage). Its
   * gradient arrives already summed over the copies; gradient norms count it on
   * the owning stage only, so skip it here. The engine refuses to run a strategy
   * built for 1.0 when a flag would be 1. */
  const int32_t* counted_elsewhere;
  /* --- since 1.4 --- */
  /* NULL, or num_params flags: 1 = an expert parameter (loom_param_decl.expert),
   * different on each rank of the ep group. Its gradient is summed over the edp
   * group instead of averaged over dp, then scaled by 1 / dp: its tokens came from
   * every dp rank of the ep group. Global norms sum it over ep as well. The engine
   * places expert parameters after all others, so they form the tail of the
   * buffers. Only strategies with LOOM_OPTIMIZER_EXPERT_PARALLEL are given any;
   * the others get NULL here and zeroed ep and edp. */
  const int32_t* expert;
  loom_group ep, edp;          /* the expert-parallel and expert data-parallel groups */
  /* --- since 1.5 --- */
  /* The expert tensor-parallel group (parallel.etp), over which expert parameters
   * are split instead of tp. It is the tp group unless the run folds MoE
   * parallelism (Megatron-Core's "MoE Parallel Folding": etp = 1 under tp > 1 with sequence
   * parallelism, the ep group then spanning tp ranks): then global norms sum the
   * expert part over ep and etp but not over tp, and an expert parameter's
   * `duplicated` means identical on every etp rank. Given (and a.expert then set
   * even at ep = 1) only to strategies with LOOM_OPTIMIZER_EXPERT_FOLDING; zeroed
   * (size 0, NULL comm) for the others, which use tp. */
  loom_group etp;
} loom_optimizer_create_args;

/* loom_optimizer_api.step's arguments (borrowed for the call). */
typedef struct loom_optimizer_step_args {
  uint32_t struct_size;
  int64_t step;              /* 1-based */
  float lr;                  /* this step's learning rate (the schedule applied) */
  float beta1, beta2, eps, weight_decay;   /* AdamW's */
  float clip_grad;           /* 0 = no clipping */
  /* --- since 1.16 --- */
  /* 1 (optimizer.overlap_param_gather, only for a strategy with
   * LOOM_OPTIMIZER_OVERLAP_PARAM_GATHER): step may return with the all-gather of
   * the updated parameters still running; the engine calls params_needed before it
   * reads them, as Megatron-LM's overlap_param_gather. */
  int32_t overlap_param_gather;
  int32_t reserved_1_16;     /* 0 */
} loom_optimizer_step_args;

/* Filled by loom_optimizer_api.step (the caller sets struct_size). */
typedef struct loom_optimizer_step_result {
  uint32_t struct_size;
  float grad_norm;           /* before clipping */
} loom_optimizer_step_result;

/* Resuming at another data-parallel size (same tp and pp): the states that every
 * old dp rank of this rank's (tp, pp) position saved, and the old buffer layout
 * (since 1.1). A parameter is identified by its index in model order, the same list
 * as loom_optimizer_create_args.infos; its numel is unchanged, but its offset may
 * differ, since the padding depends on dp. Borrowed for the call, blobs included. */
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
  size_t old_num_buckets;              /* buckets of the old layout */
} loom_optimizer_reshard_args;

/* Optimizer state by element (since 1.14), what resuming at another tensor, pipeline,
 * context or expert layout moves: `num_arrays` fp32 arrays over the elements of one
 * rank's flat parameter buffer (AdamW: m and v, and the master weights when the
 * parameters are not fp32), element e of each array belonging to buffer element e.
 * The engine regathers every parameter's state from the old ranks by name and global
 * index (as it does the parameters) and cuts it for the new ones. */
typedef struct loom_optimizer_elements {
  uint32_t struct_size;
  uint32_t num_arrays;      /* state_decode: the count it found; state_import: given */
  size_t numel;             /* elements of the flat buffer, padding included */
  float* const* arrays;     /* num_arrays arrays of numel elements (NULL: state_decode only counts) */
  uint8_t* held;            /* state_decode: numel flags it sets to 1 for each element the state holds
                               (a dp shard holds part of the buffer); state_import: NULL */
} loom_optimizer_elements;

/* An optimizer strategy's table. Each rank creates one instance and calls it from
 * its thread; step (and what it reduces) is collective over the groups it was
 * given, so every rank calls it for every training step. */
typedef struct loom_optimizer_api {
  uint32_t struct_size;
  /* Creates the rank's strategy (loom_optimizer_create_args for what is borrowed).
   * options are borrowed for the call; rank stays valid until destroy; *out is the
   * plugin's, valid until destroy. Required. */
  loom_status (*create)(const loom_options* options, loom_rank* rank,
                        const loom_optimizer_create_args* args, loom_optimizer** out);
  /* Destroys the strategy and the state it allocated. Required. */
  void (*destroy)(loom_optimizer* opt);
  /* Synchronise gradients, clip, update parameters.
   *
   * Called after the backwards of every microbatch of the step; args are borrowed,
   * *result is filled (the caller sets struct_size). Required. */
  loom_status (*step)(loom_optimizer* opt, loom_rank* rank, const loom_optimizer_step_args* args,
                      loom_optimizer_step_result* result);
  /* Optimizer state for checkpoints: a byte blob this rank owns.
   *
   * *bytes = the size of this rank's blob, fixed for the life of opt. Required. */
  loom_status (*state_size)(loom_optimizer* opt, size_t* bytes);
  /* Writes the blob into host_buf, host memory of `bytes` (= state_size) borrowed for
   * the call. Required. */
  loom_status (*state_save)(loom_optimizer* opt, void* host_buf, size_t bytes);
  /* Restores a blob state_save wrote at the same layout (borrowed for the call);
   * refuses one whose size does not match. Required. */
  loom_status (*state_load)(loom_optimizer* opt, const void* host_buf, size_t bytes);
  /* --- since 1.1 --- */
  /* Loads state saved at another dp size: each element of this rank's state takes
   * its value from whichever old rank held that element of that parameter (mapped
   * by parameter index and range within the parameter, never by old buffer offset);
   * padding gets zeros. NULL = the strategy cannot reshard (the engine refuses). */
  loom_status (*state_load_resharded)(loom_optimizer* opt, const loom_optimizer_reshard_args* args);
  /* --- since 1.4 --- */
  /* LOOM_OPTIMIZER_* capability bits (a table built before 1.4, which lacks the
   * member, has none). */
  uint64_t features;
  /* --- since 1.14 --- */
  /* Reads a blob this plugin's state_save wrote (`bytes` bytes, borrowed; the saver's
   * flat buffer had out->numel elements), without an instance: sets out->num_arrays,
   * and when out->arrays is not NULL writes the elements the blob holds into them and
   * sets their out->held flags (others are left as they are). Refuses a blob that is
   * not its own or does not fit numel. NULL: the state cannot be regathered (a resume
   * at another tp, pp, cp or ep is refused). */
  loom_status (*state_decode)(const void* state, size_t bytes, loom_optimizer_elements* out);
  /* Loads state given for every element of this rank's flat buffer (in->numel =
   * loom_optimizer_create_args' buffer numel; padding zero); the strategy keeps what it
   * owns (its dp shard). Refuses another num_arrays than its own. NULL: as for
   * state_decode. */
  loom_status (*state_import)(loom_optimizer* opt, const loom_optimizer_elements* in);
  /* --- since 1.15 --- */
  /* Called during a training step's backward whenever the gradients of some
   * parameters are final: the last microbatch's backward of every layer holding
   * them has run, and the engine's own sums of them are done (over tp under
   * sequence parallelism, of tied copies over the embedding group). params holds
   * num_params indices into loom_optimizer_create_args.infos (borrowed for the
   * call). Every parameter of the rank is announced once per training step, before
   * step, in an order the members of each of its data-parallel groups share. A
   * strategy may start a bucket's reduction (loom_comm_api.start) once all of its
   * parameters are announced, as Megatron-LM's overlap_grad_reduce, and wait for
   * it in step. NULL: gradients are reduced in step. */
  loom_status (*grads_ready)(loom_optimizer* opt, loom_rank* rank, const size_t* params, size_t num_params);
  /* --- since 1.16 --- */
  /* Returns once the values the last step gave these parameters (indices into
   * loom_optimizer_create_args.infos, borrowed) are in the parameter buffer. The
   * engine calls it before a training step's first forward of each layer (that
   * layer's parameters) and, with every parameter, before anything else reads them
   * (evaluation, checkpoints, generation, the end of the run), whenever the last
   * step ran with overlap_param_gather. NULL: step leaves them in place. */
  loom_status (*params_needed)(loom_optimizer* opt, loom_rank* rank, const size_t* params, size_t num_params);
} loom_optimizer_api;

/* loom_optimizer_api.features: the strategy reduces expert parameters over edp
 * (loom_optimizer_create_args.expert, .ep, .edp); the engine refuses expert
 * parallelism (parallel.ep > 1) with a strategy that lacks it (since 1.4). */
#define LOOM_OPTIMIZER_EXPERT_PARALLEL (1ull << 0)
/* The strategy reads loom_optimizer_create_args.etp (MoE folding, etp != tp);
 * the engine refuses a folded run with a strategy that lacks it (since 1.5). */
#define LOOM_OPTIMIZER_EXPERT_FOLDING (1ull << 1)
/* The strategy keeps the optimizer state (moments, fp32 master weights) of its shard of
 * each dp (x cp) group's buckets only, as Megatron-LM's distributed optimizer does; the
 * engine's memory plan divides that state by the group size (since 1.9). */
#define LOOM_OPTIMIZER_SHARDED_STATE (1ull << 2)
/* The strategy can leave its parameter all-gather running after step
 * (loom_optimizer_step_args.overlap_param_gather) and completes it in params_needed;
 * the engine refuses optimizer.overlap_param_gather without it (since 1.16). */
#define LOOM_OPTIMIZER_OVERLAP_PARAM_GATHER (1ull << 3)

/* ------------------------------------------------------------------------- */
/* Pipeline schedule plugins (parallel/pipeline.*)                            */
/* ------------------------------------------------------------------------- */

/* loom_schedule_api.order's arguments (borrowed for the call). */
typedef struct loom_schedule_args {
  uint32_t struct_size;
  /* pipeline stages, model chunks per stage (virtual stages), microbatches per step,
   * microbatches per group of the interleaved schedule (pipeline.microbatch_group_size;
   * 0 = pp), and the pipeline rank (0..pp-1) whose order is asked for */
  int32_t pp, vpp, microbatches, group_size, rank;
} loom_schedule_args;

/* A pipeline schedule's table. */
typedef struct loom_schedule_api {
  uint32_t struct_size;
  /* Writes the rank's signed order (+c forward of local chunk c, -c backward),
   * 2 * vpp * microbatches entries, into order[capacity].
   *
   * c runs 1..vpp; the n-th +c (or -c) is microbatch n - 1 of chunk c. *length = the
   * entries written; *warmup = the warm-up forwards, Megatron-LM's
   * num_warmup_microbatches (1F1B: min(pp - rank - 1, microbatches), the forwards
   * before the steady one-forward-one-backward phase; an all-forwards-first schedule:
   * all of them). It is reported (`loom schedule`) and checked to lie in
   * 0..vpp * microbatches; the run follows the order alone. The engine
   * asks from one thread for every pipeline rank in turn (before a run and for `loom
   * schedule`), so the answer must depend on options and args only. options (the
   * manifest's, or the defaults) and the host buffer order are borrowed for the call.
   * Required. */
  loom_status (*order)(const loom_options* options, const loom_schedule_args* args, int32_t* order,
                       size_t capacity, size_t* length, int32_t* warmup);
} loom_schedule_api;

/* ------------------------------------------------------------------------- */
/* Execution-mode plugins (exec/eager, exec/partial_graph)                    */
/* ------------------------------------------------------------------------- */

/* The work of a step (loom_exec_step.fn), called with loom_exec_step.ctx. */
typedef loom_status (*loom_step_fn)(void* ctx);

/* One step handed to loom_exec_api.run (borrowed for the call, scope included). */
typedef struct loom_exec_step {
  uint32_t struct_size;
  const char* scope;         /* the layer plugin's name: "attention", "mlp", ... */
  int64_t key;               /* identifies (microbatch, layer, direction) within a step */
  int32_t capturable;        /* 1 when fn obeys the graph rules (loom_layer_api.capturable) */
  loom_step_fn fn;           /* runs the step; run calls it (or replays its graph) */
  void* ctx;                 /* fn's argument, valid during run */
  /* --- since 1.7 --- */
  /* 0 = the engine's whole layer step; >= 1 = a part a layer runs from
   * inside its step under the same key (loom_layer_fwd_args.step_key). An exec
   * plugin with LOOM_EXEC_SUBSTEPS keys its graphs by (key, substep); the layer
   * marks a part capturable only when the engine said the plugin has the bit.
   * The part's scope names it ("moe_router"). */
  int32_t substep;
  LOOM_EXTENSION union { int32_t reserved; int32_t reserved_1_7; };  /* 0 */
} loom_exec_step;

/* What an exec plugin did so far (loom_exec_api.stats) (since 1.3). Filled by the
 * plugin; the caller sets struct_size. */
typedef struct loom_exec_stats {
  uint32_t struct_size;
  uint64_t graphs;           /* graphs captured (and alive) */
  uint64_t replays;          /* steps run by replaying a graph (the capturing run included) */
  uint64_t direct;           /* steps run by calling fn: not capturable, out of scope, warm-up */
} loom_exec_stats;

/* An execution mode's table. Each rank creates one instance (before its layers) and
 * calls it from its thread. */
typedef struct loom_exec_api {
  uint32_t struct_size;
  /* Creates the rank's instance. options are borrowed for the call; rank stays valid
   * until destroy. *out is the plugin's, valid until destroy; it may stay NULL for a
   * stateless plugin (exec/eager), which destroy is then not called for. Required. */
  loom_status (*create)(const loom_options* options, loom_rank* rank, loom_exec** out);
  /* Destroys the instance and its graphs, before the rank's device. Required. */
  void (*destroy)(loom_exec* exec);
  /* Runs one step: calls step->fn(step->ctx), or replays a graph captured from an
   * earlier run of the same key (LOOM_EXEC_REPLAYS), and returns its status. Called
   * from the rank's thread; re-entered from inside fn (sub-steps) only for a plugin
   * with LOOM_EXEC_SUBSTEPS. Required. */
  loom_status (*run)(loom_exec* exec, loom_rank* rank, const loom_exec_step* step);
  /* --- since 1.3 --- */
  /* LOOM_EXEC_* capability bits (a table built before 1.3, which lacks the member,
   * has none). */
  uint64_t features;
  /* Counters since create; NULL = none.
   *
   * Fills *out (loom_exec_stats). Optional. */
  loom_status (*stats)(loom_exec* exec, loom_exec_stats* out);
} loom_exec_api;

/* loom_exec_api.features: steps with the same key may be replayed from a graph
 * captured on an earlier run, over the addresses of that run. The engine then
 * keeps every buffer it passes to a capturable step (hidden states, their
 * gradients) at the same address for the same key in every training step
 * (since 1.3). */
#define LOOM_EXEC_REPLAYS (1ull << 0)
/* loom_exec_step.substep is read (graphs keyed by (key, substep)), and a
 * step may run sub-steps from inside its fn (run is re-entered) (since 1.7). */
#define LOOM_EXEC_SUBSTEPS (1ull << 1)

/* ------------------------------------------------------------------------- */
/* Parallel services: tables a parallel plugin offers to layers, which get    */
/* them from host->service (below). Each has a header of its own, part of     */
/* this ABI and versioned with it: loom_tp.h, the tensor-parallel service    */
/* (LOOM_API_TENSOR_PARALLEL, since 1.1); loom_ep.h, the expert-parallel     */
/* token dispatch (LOOM_API_EXPERT_PARALLEL, since 1.4).                      */
/* ------------------------------------------------------------------------- */

#include "loom_tp.h"
#include "loom_ep.h"

/* ------------------------------------------------------------------------- */
/* The host API: what the engine offers every plugin.                         */
/* ------------------------------------------------------------------------- */

/* The engine's table, handed to the entry point; valid, unchanged, for the life of
 * the process. Its struct_size covers every member of the plugin's header (the
 * engine is at least as new). The functions that take a loom_rank are called from
 * that rank's thread; the others from any thread. */
typedef struct loom_host_api {
  uint32_t struct_size;
  uint32_t abi_major, abi_minor;   /* the engine's ABI (a minor >= the plugin's) */
  const char* engine_version;      /* the engine's version string; static */
  /* Logging into the engine's log, with the plugin's file and line.
   *
   * severity: LOOM_LOG_*; file may be NULL; message is borrowed for the call. */
  void (*log)(int32_t severity, const char* file, int32_t line, const char* message);
  /* Status objects; the message is copied.
   *
   * A new error status, owned by whoever receives it. code LOOM_CODE_OK is turned
   * into LOOM_CODE_INTERNAL (a status is never a success). Returns NULL only when
   * host memory is exhausted. */
  loom_status (*status_create)(int32_t code, const char* message);
  /* The status's code; LOOM_CODE_OK for NULL. */
  int32_t (*status_code)(loom_status status);
  /* Its message, owned by the status (valid until status_destroy); "" for NULL. */
  const char* (*status_message)(loom_status status);
  /* Frees a status, once, by its receiver; NULL is a no-op. */
  void (*status_destroy)(loom_status status);
  /* Options (defaults already applied). Return 1 when the option exists, 0 if not.
   *
   * *out is written only when 1 is returned. option_int takes an integer value only;
   * option_float an integer or a float; option_bool a boolean (1 or 0). */
  int32_t (*option_int)(const loom_options* options, const char* name, int64_t* out);
  /* A float option (an integer value converts). */
  int32_t (*option_float)(const loom_options* options, const char* name, double* out);
  /* A boolean option, as 1 or 0. */
  int32_t (*option_bool)(const loom_options* options, const char* name, int32_t* out);
  /* NULL when absent; valid while the options live.
   *
   * (Absent also when the value is not a string.) The options live for the call
   * that received them: copy the string to keep it. */
  const char* (*option_string)(const loom_options* options, const char* name);
  /* Device memory of a rank (through its device plugin, which accounts it).
   *
   * alloc: `bytes` from the rank's device (its alloc slot), owned by the caller
   * until free with the same rank; counted in the device's memory_stats. */
  loom_status (*alloc)(loom_rank* rank, size_t bytes, void** out);
  /* Frees memory from host->alloc with the same rank; NULL is a no-op. */
  void (*free)(loom_rank* rank, void* ptr);
  /* The rank's device and its compute stream.
   *
   * Borrowed, owned by the engine for the rank's life (never destroy them): the
   * device table, the instance, and the stream (NULL: the device's default stream). */
  loom_status (*device)(loom_rank* rank, const loom_device_api** api, loom_device** dev,
                        loom_stream** stream);
  /* A rank group by kind ("tp", "dp", "pp", "ep", ...); see `loom groups`.
   *
   * *out is a copy; its communicator is the engine's, valid for the rank's life.
   * LOOM_CODE_NOT_FOUND when the rank has no group of that kind. */
  loom_status (*group)(loom_rank* rank, const char* kind, loom_group* out);
  /* The rank's execution mode, for layers that split themselves into steps.
   *
   * Borrowed, the engine's for the rank's life; LOOM_CODE_NOT_FOUND while the rank
   * has none (layers created only to plan memory). */
  loom_status (*exec)(loom_rank* rank, const loom_exec_api** api, loom_exec** exec);
  /* The rank's global rank; -1 for NULL. */
  int32_t (*global_rank)(loom_rank* rank);
  /* --- since 1.1 --- */
  /* A service table offered by a plugin: api_type LOOM_API_TENSOR_PARALLEL gives a
   * loom_tensor_parallel_api, LOOM_API_EXPERT_PARALLEL a loom_expert_parallel_api
   * (since 1.4). name NULL = the one the run configured
   * (manifest key parallel.tensor, parallel.expert); otherwise the parallel
   * plugin of that name. NULL when none is loaded. The table is its library's,
   * valid for the life of the process; it may be built for an older minor than the
   * caller (check its struct_size). */
  const void* (*service)(loom_rank* rank, int32_t api_type, const char* name);
} loom_host_api;

/* ------------------------------------------------------------------------- */
/* Plugin descriptors and the entry point                                     */
/* ------------------------------------------------------------------------- */

/* loom_plugin_info.api_type: which table a plugin's `api` points to. */
#define LOOM_API_DEVICE 1
#define LOOM_API_COMM 2
#define LOOM_API_LAYER 3
#define LOOM_API_OPTIMIZER 4
#define LOOM_API_SCHEDULE 5
#define LOOM_API_EXEC 6
#define LOOM_API_TENSOR_PARALLEL 7 /* loom_tensor_parallel_api (parallel/tensor) (since 1.1) */
#define LOOM_API_EXPERT_PARALLEL 8 /* loom_expert_parallel_api (parallel/expert, parallel/expert.allgather)
                                      (since 1.4) */

/* One plugin of a library (loom_plugin_library.plugins). It, its strings, its table
 * and its options are the library's, valid while it is loaded (static data). */
typedef struct loom_plugin_info {
  uint32_t struct_size;
  const char* kind;          /* "device", "comm", "layer", "parallel", "exec" */
  const char* name;          /* "cpu", "attention", "pipeline.1f1b", ... */
  const char* version;       /* the plugin's own version, e.g. "1.0.0" */
  const char* description;   /* one line */
  int32_t api_type;          /* LOOM_API_*: which table `api` points to */
  const void* api;           /* begins with uint32_t struct_size */
  const loom_option_decl* options;   /* num_options declarations (NULL when 0) */
  size_t num_options;        /* entries of options */
} loom_plugin_info;

/* What the entry point returns: the library's, valid while it is loaded. */
typedef struct loom_plugin_library {
  uint32_t struct_size;
  uint32_t abi_major;        /* the ABI the library was built against */
  uint32_t abi_minor;        /* (LOOM_ABI_MINOR of its header; a newer one than the engine's is refused) */
  const loom_plugin_info* const* plugins;   /* num_plugins descriptors */
  size_t num_plugins;        /* entries of plugins */
} loom_plugin_library;

/* The entry point. `host` stays valid for the life of the process. On success
 * *out points to a descriptor owned by the library, valid while it is loaded.
 * The loader calls it once per library, from the engine's main thread, before any
 * other call into the library; a library registers its plugins here (never in
 * static constructors). */
typedef loom_status (*loom_plugin_init_v1_fn)(const loom_host_api* host,
                                              const loom_plugin_library** out);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* LOOM_ABI_H */
