/* layer/checked: y = x, a layer that brings its own CPU kernel and says before launch
 * what it cannot run. Plain C99, built twice by the tests:
 *   against the current SDK (layer/checked): the copy is a host task (ABI 1.12), so a
 *     captured step replays it; validate refuses bf16 and a device without host tasks
 *     on host memory, naming the manifest key to change;
 *   against the frozen 1.11 header (layer/checked_v1_11): no validate member and a
 *     device copy instead of the host task. Its table is followed, where 1.12's
 *     validate would be, by a function that refuses every run: an engine that read past
 *     the table's struct_size would call it. */
#include <loom/loom_abi.h>

#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__)
#define EXPORT __attribute__((visibility("default")))
#else
#define EXPORT
#endif

static const loom_host_api* g_host = NULL;

typedef struct checked_layer {
  int unused;
} checked_layer;

/* Bytes of a tensor (dense, as the engine passes hidden states). */
static size_t tensor_bytes(const DLTensor* t) {
  size_t n = (size_t)(t->dtype.bits * t->dtype.lanes / 8);
  int d;
  for (d = 0; d < t->ndim; ++d) n *= (size_t)t->shape[d];
  return n;
}

#if LOOM_ABI_MINOR >= 12
/* The layer's kernel: what its host task runs, on the device's copy of these args. */
typedef struct copy_task {
  void* dst;
  const void* src;
  size_t bytes;
} copy_task;

static void run_copy(void* args) {
  const copy_task* t = (const copy_task*)args;
  memcpy(t->dst, t->src, t->bytes);
}
#endif

/* dst = src on the rank's device, in its stream's order. */
static loom_status copy_on_device(loom_rank* rank, void* dst, const void* src, size_t bytes) {
  const loom_device_api* api = NULL;
  loom_device* dev = NULL;
  loom_stream* stream = NULL;
  loom_status st = g_host->device(rank, &api, &dev, &stream);
  if (st != NULL) return st;
#if LOOM_ABI_MINOR >= 12
  {
    loom_host_task_args a;
    copy_task t; /* the device copies it: it may go when the call returns */
    memset(&a, 0, sizeof(a));
    a.struct_size = sizeof(a);
    t.dst = dst;
    t.src = src;
    t.bytes = bytes;
    a.fn = run_copy;
    a.args = &t;
    a.args_bytes = sizeof(t);
    return api->ops->host_task(dev, stream, &a);
  }
#else
  return api->copy(dev, stream, dst, src, bytes, LOOM_COPY_DEVICE_TO_DEVICE);
#endif
}

static loom_status layer_create(const loom_options* options, loom_rank* rank, const loom_layer_create_args* args,
                                loom_layer** out) {
  checked_layer* l = (checked_layer*)calloc(1, sizeof(checked_layer));
  (void)options;
  (void)rank;
  (void)args;
  if (l == NULL) return g_host->status_create(LOOM_CODE_OUT_OF_MEMORY, "checked: out of memory");
  *out = (loom_layer*)l;
  return NULL;
}
static void layer_destroy(loom_layer* l) { free(l); }
static loom_status layer_params(loom_layer* layer, const loom_param_decl** out, size_t* count) {
  (void)layer;
  *out = NULL;
  *count = 0;
  return NULL;
}
static loom_status layer_bind(loom_layer* layer, const DLTensor* params, const DLTensor* grads, size_t n) {
  (void)layer;
  (void)params;
  (void)grads;
  (void)n;
  return NULL;
}
static loom_status layer_forward(loom_layer* layer, loom_rank* rank, const loom_layer_fwd_args* args) {
  (void)layer;
  if (args->input == NULL || args->output == NULL)
    return g_host->status_create(LOOM_CODE_INVALID_ARGUMENT, "checked: needs an input and an output (a middle layer)");
  return copy_on_device(rank, args->output->data, args->input->data, tensor_bytes(args->input));
}
static loom_status layer_backward(loom_layer* layer, loom_rank* rank, const loom_layer_bwd_args* args) {
  (void)layer;
  if (args->grad_input == NULL || args->grad_output == NULL) return NULL;
  return copy_on_device(rank, args->grad_input->data, args->grad_output->data, tensor_bytes(args->grad_output));
}
static void layer_release(loom_layer* layer, int32_t microbatch) {
  (void)layer;
  (void)microbatch;
}
/* Its steps are device work only, at the addresses it is given. */
static int32_t layer_capturable(loom_layer* layer) {
  (void)layer;
  return 1;
}

#if LOOM_ABI_MINOR >= 12
static loom_status layer_validate(const loom_options* options, const loom_layer_validate_args* args) {
  const loom_device_ops* ops = args->device_ops;
  (void)options;
  if (args->param_dtype == LOOM_DTYPE_BF16)
    return g_host->status_create(LOOM_CODE_INVALID_ARGUMENT,
                                 "layer/checked has no bf16 kernel; set device.param_dtype = \"fp32\"");
  if (!LOOM_HAS_SLOT(ops, loom_device_ops, host_task) || ops->host_task == NULL ||
      (args->device_features & LOOM_DEVICE_HOST_MEMORY) == 0)
    return g_host->status_create(LOOM_CODE_INVALID_ARGUMENT,
                                 "layer/checked copies with a host task on host memory; set device.kind = \"cpu\"");
  return NULL;
}

static const loom_layer_api k_layer_api = {
    sizeof(loom_layer_api), layer_create, layer_destroy, layer_params, layer_bind, layer_forward, layer_backward,
    layer_release, NULL, NULL, layer_capturable, 0, layer_validate,
};
#define LAYER_API (&k_layer_api)
#define LAYER_NAME "checked"
#else
static loom_status refuse_every_run(const loom_options* options, const void* args) {
  (void)options;
  (void)args;
  return g_host->status_create(LOOM_CODE_INTERNAL, "checked_v1_11: the engine read past the layer table");
}

/* The 1.11 table, then what an engine ignoring struct_size would take for validate. */
static const struct {
  loom_layer_api api;
  loom_status (*past_the_table)(const loom_options*, const void*);
} k_layer_table = {
    {sizeof(loom_layer_api), layer_create, layer_destroy, layer_params, layer_bind, layer_forward, layer_backward,
     layer_release, NULL, NULL, layer_capturable, 0},
    refuse_every_run,
};
#define LAYER_API (&k_layer_table.api)
#define LAYER_NAME "checked_v1_11"
#endif

static const loom_plugin_info k_layer_info = {
    sizeof(loom_plugin_info), "layer", LAYER_NAME, "1.0.0", "y = x by the layer's own kernel (C test plugin)",
    LOOM_API_LAYER, LAYER_API, NULL, 0,
};
static const loom_plugin_info* const k_plugins[] = {&k_layer_info};
static const loom_plugin_library k_library = {
    sizeof(loom_plugin_library), LOOM_ABI_MAJOR, LOOM_ABI_MINOR, k_plugins, 1,
};

EXPORT loom_status loom_plugin_init_v1(const loom_host_api* host, const loom_plugin_library** out) {
  if (host == NULL || out == NULL) return NULL;
  g_host = host;
  *out = &k_library;
  return NULL;
}
