/*
 * loom_ep.h — the expert-parallel service table of the loom plugin ABI
 * (loom_expert_parallel_api) and its argument structs. Part of the ABI that
 * loom_abi.h describes, under its rules and its version; loom_abi.h includes this
 * header, and this header includes loom_abi.h, so either include gives both.
 */
#ifndef LOOM_EP_H
#define LOOM_EP_H

#include "loom_abi.h" /* loom_status, loom_rank, loom_group */

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------- */
/* Expert-parallel token dispatch (the parallel/expert plugins) (since 1.4).  */
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

/* loom_expert_parallel_api.create's arguments (borrowed for the call). */
typedef struct loom_ep_create_args {
  uint32_t struct_size;
  loom_group ep;                 /* the layer's expert-parallel group (valid until destroy) */
  int64_t num_experts;           /* E, a multiple of the group's size */
  const char* instance_name;     /* for messages ("blocks.3.moe") */
} loom_ep_create_args;

/* Learns where every rank's rows go (the counts are exchanged: collective) and
 * keeps that plan under `slot` (the layer's key, e.g. its microbatch) until
 * release. expert_rows: host [E + 1], non-decreasing from expert_rows[0] = 0 to
 * N; local_rows: host, filled [E / ep + 1] with the first row of each local
 * expert in the dispatched rows (local_rows[E / ep] = R). Both are borrowed for
 * the call. */
typedef struct loom_ep_plan_args {
  uint32_t struct_size;
  void* stream;                  /* the rank's native compute stream (NULL on CPU) */
  int32_t slot;                  /* the plan's key */
  const int64_t* expert_rows;    /* host [E + 1], read (see above) */
  int64_t* local_rows;           /* host [E / ep + 1], written (see above) */
} loom_ep_plan_args;

/* dispatch: x [N, width] -> out [R, width]; combine: x [R, width] -> out [N,
 * width], under the plan of `slot`. width counts elements of dtype. */
typedef struct loom_ep_move_args {
  uint32_t struct_size;
  void* stream;                  /* as in loom_ep_plan_args */
  int32_t slot;                  /* a plan made by plan and not yet released */
  const void* x;                 /* the rows to move */
  void* out;                     /* where they land */
  int64_t width;                 /* elements per row */
  int32_t dtype;                 /* of x and out */
  int32_t reserved;              /* 0 (see "Reserved and padding members" in loom_abi.h) */
} loom_ep_move_args;

/* The expert-parallel service's table; every slot is required. A handle is used by
 * its layer from its rank's thread; the args are borrowed for the call. */
typedef struct loom_expert_parallel_api {
  uint32_t struct_size;
  /* Opens a handle for one layer instance (from its create); *out is the
   * service's, valid until destroy. */
  loom_status (*create)(loom_rank* rank, const loom_ep_create_args* args, loom_ep** out);
  /* Closes the handle and forgets its plans. */
  void (*destroy)(loom_ep* ep);
  /* Makes the plan of args->slot (loom_ep_plan_args); collective over ep. */
  loom_status (*plan)(loom_ep* ep, const loom_ep_plan_args* args);
  /* Moves rows to their experts' ranks (loom_ep_move_args); collective over ep. */
  loom_status (*dispatch)(loom_ep* ep, const loom_ep_move_args* args);
  /* Moves them back to their sources; collective over ep. */
  loom_status (*combine)(loom_ep* ep, const loom_ep_move_args* args);
  /* Forgets the plan of `slot` (no collective). */
  void (*release)(loom_ep* ep, int32_t slot);
} loom_expert_parallel_api;

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* LOOM_EP_H */
