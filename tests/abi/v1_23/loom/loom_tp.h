/*
 * loom_tp.h — the tensor-parallel service table of the loom plugin ABI
 * (loom_tensor_parallel_api) and its argument structs. Part of the ABI that
 * loom_abi.h describes, under its rules and its version; loom_abi.h includes this
 * header, and this header includes loom_abi.h, so either include gives both.
 */
#ifndef LOOM_TP_H
#define LOOM_TP_H

#include "loom_abi.h" /* loom_status, loom_rank, loom_group */

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------- */
/* Tensor-parallel services (the parallel/tensor plugin) (since 1.1).         */
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

/* loom_tensor_parallel_api.create's arguments (borrowed for the call). */
typedef struct loom_tp_create_args {
  uint32_t struct_size;
  loom_group tp;                 /* the layer's tensor-parallel group (valid until destroy) */
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
  int64_t rows, cols;            /* rows: the full count (see above) */
  const void* x;                 /* the input */
  void* out;                     /* the output (may be x when no shape changes) */
  int32_t dtype;                 /* of x and out */
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
  const void* x;                 /* the input (see above) */
  void* x_full;                  /* column-parallel under SP: the gathered input */
  const void* weight;            /* [in, out] */
  const void* bias;              /* NULL = none */
  void* y;                       /* forward: the output */
  const void* dy;                /* backward: the output's gradient */
  void* dx;                      /* NULL = not needed */
  void* dweight;                 /* backward: accumulated (+=) */
  void* dbias;                   /* NULL = none */
  int32_t gather_output;         /* column-parallel only */
  int32_t accumulate_dx;         /* 1: dx += (else overwritten) */
  int32_t dtype;                 /* of every buffer (dweight, dbias: unless grad_fp32) */
  /* --- since 1.2 --- */
  LOOM_EXTENSION union { int32_t pad0; int32_t pad_1_1; };  /* padding: 1.1's struct ended after
                                                               dtype; 0 (see loom_abi.h) */
  int32_t grad_fp32;             /* dweight, dbias are fp32 (see LOOM_TP_GRAD_FP32) */
  /* --- since 1.11 --- */
  int32_t pad1;                  /* padding: 1.10's struct ended after grad_fp32; 0 */
  /* With activation (only services with LOOM_TP_ACTIVATION; 0 from an older caller):
   *  column-parallel forward: pre_activation [rows, out] receives x_full W + bias and
   *            y = act(pre_activation) (not with gather_output);
   *  row-parallel backward: the activation made this linear's input from
   *            pre_activation [rows, in]; dx = (dy W^T) * act'(pre_activation), the
   *            gradient of the activation's input (not with accumulate_dx).
   * A device with LOOM_DEVICE_GEMM_EPILOGUE does either in the GEMM's epilogue. */
  void* pre_activation;
  int32_t activation;            /* LOOM_TP_ACTIVATION_*: 0 none, 1 GeLU (tanh approximation) */
  int32_t reserved;              /* 0 */
} loom_tp_linear_args;

#define LOOM_TP_ACTIVATION_NONE 0
#define LOOM_TP_ACTIVATION_GELU 1

/* Vocab-parallel embedding: the table [padded_vocab / tp, dim] is this rank's
 * slice of the padded vocabulary; ids outside it look up zeros and the reduction
 * over tp completes every row.
 *  forward:  out [rows, dim] (all-reduce), or this rank's shard [rows / tp, dim]
 *            (reduce-scatter) under SP.
 *  backward: dout shaped like out (all-gathered under SP); dtable += the rows of
 *            this rank's slice. */
typedef struct loom_tp_embedding_args {
  uint32_t struct_size;
  int64_t rows, dim;             /* rows: every token of the microbatch; dim: the hidden size */
  int64_t padded_vocab;          /* the whole padded vocabulary */
  const int32_t* ids;            /* [rows]: every token of the microbatch */
  const void* table;             /* this rank's slice */
  void* out;                     /* forward: written */
  const void* dout;              /* backward */
  void* dtable;                  /* backward: accumulated (+=) */
  int32_t dtype;                 /* of table, out, dout (and dtable unless grad_fp32) */
  /* --- since 1.2 --- */
  LOOM_EXTENSION union { int32_t pad0; int32_t pad_1_1; };  /* padding: 1.1's struct ended after
                                                               dtype; 0 (see loom_abi.h) */
  int32_t grad_fp32;             /* dtable is fp32 (see LOOM_TP_GRAD_FP32) */
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
  int64_t rows, hidden;          /* rows: the full count; hidden: the input's width */
  int64_t vocab;                 /* real vocabulary */
  int64_t padded_vocab;          /* the whole padded vocabulary */
  const void* x;                 /* the input as held (see above) */
  void* x_full;                  /* under SP: the gathered input (keep from forward to backward) */
  const void* weight;            /* [padded_vocab / tp, hidden] */
  void* logits;                  /* [rows, padded_vocab / tp]: keep from forward to backward */
  float* stats;                  /* [3 * rows]: row max | sum of exp | target logit; keep */
  const int32_t* targets;        /* [rows]; negative = ignored (loss 0, no gradient) */
  float* loss;                   /* forward: [rows] per-token loss */
  int32_t* predictions;          /* forward, optional, HOST memory: [rows] argmax token
                                    over the real vocabulary (lowest id among ties) */
  float scale;                   /* backward: dL / d loss[r] */
  void* dx;                      /* backward: the input's gradient */
  void* dweight;                 /* backward: accumulated (+=) */
  int32_t accumulate_dx;         /* 1: dx += (else overwritten) */
  int32_t dtype;                 /* of x, weight, logits, dx (and dweight unless grad_fp32) */
  /* --- since 1.2 --- */
  int32_t grad_fp32;             /* dweight is fp32 (see LOOM_TP_GRAD_FP32) */
  /* --- since 1.18 --- */
  int32_t pad0;                  /* padding: 1.17's struct ended after grad_fp32; 0 */
  int32_t logits_scratch;        /* backward: 1 = the caller drops logits after this call, so
                                    the service may form their gradient over them (on a device
                                    with LOOM_DEVICE_XENT_IN_PLACE: no [rows, vocab / tp]
                                    buffer of its own, Megatron's in-place vocab-parallel
                                    cross-entropy backward); 0 (an older caller's) = keep them */
  int32_t reserved;              /* 0 (see "Reserved and padding members" in loom_abi.h) */
} loom_tp_xent_args;

/* Dropout under the model-parallel RNG (Megatron's tracker): region
 * DUPLICATED (outside TP regions) draws from one stream identical on every tp rank
 * (under SP each rank draws its shard's part of it, so the mask equals the serial
 * run's); PARALLEL (inside a TP region) from a stream of its own per tp rank.
 * out = x * mask / (1 - p); mask [n] u8 is written for the backward.
 * Context parallelism (since 1.6): x is hidden-state shaped, this rank's rows of its
 * cp slice position-major (see loom_layer_fwd_args), so the slice's two halves are
 * its two context chunks; the service draws each element by its place in the
 * whole sequence, so every cp layout masks the serial run's elements (the engine
 * refuses parallel.cp > 1 with a service built before 1.6). */
#define LOOM_TP_RNG_DUPLICATED 0
#define LOOM_TP_RNG_PARALLEL 1
typedef struct loom_tp_dropout_args {
  uint32_t struct_size;
  int32_t region;                /* LOOM_TP_RNG_* */
  int64_t n;                     /* elements of x on this rank */
  const void* x;                 /* [n] */
  void* out;                     /* [n] */
  uint8_t* mask;                 /* [n] device memory: written, for the backward */
  float p;                       /* drop probability */
  uint64_t seed;                 /* the forward's dropout_seed (equal on every rank) */
  int32_t microbatch;            /* the layer's microbatch (parallel/tensor's masks follow seed, which
                                  * names the samples, not this index, so they do not depend on dp) */
  int32_t stream;                /* tells several dropouts of one layer apart: 0, 1, ... */
  int32_t dtype;                 /* of x and out */
  /* --- since 1.3 --- */
  /* Services with LOOM_TP_SEED_DEVICE: device memory holding `seed` (the
   * forward's dropout_seed_device), read when the dropout runs; NULL = use seed. */
  const uint64_t* seed_device;
} loom_tp_dropout_args;

/* This rank's slice of the padded vocabulary: ids [start, start + rows), the first
 * `valid` of them real (the rest padding). Filled by vocab_range (the caller sets
 * struct_size). */
typedef struct loom_tp_vocab_range {
  uint32_t struct_size;
  int64_t start, rows, valid;    /* see above */
} loom_tp_vocab_range;

/* The tensor-parallel service's table. A handle is used by its layer, from its rank's
 * thread. The operations other than vocab_range are collective over the handle's tp
 * group: every member calls the same operation with matching shapes, in the same
 * order. They enqueue their device work on the rank's compute stream (the default
 * stream of its device); the args are borrowed for the call and the buffers must stay
 * valid until that work has run. The operations past vocab_range are optional (NULL:
 * loom::TensorParallel reports the missing one when called). */
typedef struct loom_tensor_parallel_api {
  uint32_t struct_size;
  /* Opens a handle for one layer instance (from its create). args are borrowed for
   * the call; *out is the service's, valid until destroy. Required. */
  loom_status (*create)(loom_rank* rank, const loom_tp_create_args* args, loom_tp** out);
  /* Closes the handle (from the layer's destroy). Required. */
  void (*destroy)(loom_tp* tp);
  /* The vocabulary padded to the next multiple of divisor * tp_size.
   *
   * A pure function of its arguments, callable from any thread. Required. */
  int64_t (*padded_vocab)(int64_t vocab, int64_t divisor, int32_t tp_size);
  /* Fills *out with this rank's slice of padded_vocab (no collective). Required. */
  loom_status (*vocab_range)(loom_tp* tp, int64_t vocab, int64_t padded_vocab, loom_tp_vocab_range* out);
  /* Megatron's f, forward (loom_tp_region_args): identity, or all-gather under SP. */
  loom_status (*enter_forward)(loom_tp* tp, const loom_tp_region_args* args);
  /* f, backward: all-reduce, or reduce-scatter under SP. */
  loom_status (*enter_backward)(loom_tp* tp, const loom_tp_region_args* args);
  /* Megatron's g, forward: all-reduce, or reduce-scatter under SP. */
  loom_status (*exit_forward)(loom_tp* tp, const loom_tp_region_args* args);
  /* g, backward: identity, or all-gather under SP. */
  loom_status (*exit_backward)(loom_tp* tp, const loom_tp_region_args* args);
  /* Column-parallel linear, forward (loom_tp_linear_args). */
  loom_status (*column_linear_forward)(loom_tp* tp, const loom_tp_linear_args* args);
  /* Column-parallel linear, backward: dweight, dbias +=; dx reduced over tp. */
  loom_status (*column_linear_backward)(loom_tp* tp, const loom_tp_linear_args* args);
  /* Row-parallel linear, forward: y reduced over tp. */
  loom_status (*row_linear_forward)(loom_tp* tp, const loom_tp_linear_args* args);
  /* Row-parallel linear, backward: dweight, dbias +=; dx local. */
  loom_status (*row_linear_backward)(loom_tp* tp, const loom_tp_linear_args* args);
  /* Vocab-parallel embedding, forward (loom_tp_embedding_args). */
  loom_status (*embedding_forward)(loom_tp* tp, const loom_tp_embedding_args* args);
  /* Vocab-parallel embedding, backward: dtable += this rank's rows. */
  loom_status (*embedding_backward)(loom_tp* tp, const loom_tp_embedding_args* args);
  /* Logits and vocab-parallel cross-entropy, forward (loom_tp_xent_args). */
  loom_status (*xent_forward)(loom_tp* tp, const loom_tp_xent_args* args);
  /* Its backward: dweight +=; dx reduced over tp. */
  loom_status (*xent_backward)(loom_tp* tp, const loom_tp_xent_args* args);
  /* Dropout under the model-parallel RNG (loom_tp_dropout_args); no collective. */
  loom_status (*dropout_forward)(loom_tp* tp, const loom_tp_dropout_args* args);
  /* --- since 1.2 --- */
  /* LOOM_TP_* capability bits (a table built before 1.2, which lacks the member, has
   * none). */
  uint64_t features;
} loom_tensor_parallel_api;

/* loom_tensor_parallel_api.features: the linear, embedding and xent backwards honour
 * grad_fp32 (when the rank's device has LOOM_DEVICE_GRAD_FP32): the parameter
 * gradients of bf16 layers are accumulated straight into fp32 main gradients
 * (Megatron's gradient-accumulation fusion) (since 1.2). */
#define LOOM_TP_GRAD_FP32 (1ull << 0)
/* dropout_forward honours seed_device (when the device has LOOM_DEVICE_SEED_DEVICE;
 * else it reads the seed on the host: not capturable). The mask is the same either
 * way (since 1.3). */
#define LOOM_TP_SEED_DEVICE (1ull << 1)
/* The linear calls honour activation and pre_activation (since 1.11). */
#define LOOM_TP_ACTIVATION (1ull << 2)

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* LOOM_TP_H */
