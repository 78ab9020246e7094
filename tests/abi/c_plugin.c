/* A loom plugin written in plain C99 (no C++ layer), built twice by the tests:
 * against the current SDK header and against the frozen ABI 1.0 header.
 * It provides:
 *   exec/c_repeat   - runs each step `repeat` times (an option read through the host)
 *   layer/c_scale   - y = alpha * x on host memory, with a deliberately SHORT layer
 *                     table (no activation_bytes / forward_flops slots), as a plugin
 *                     built before those slots were appended would have. */
#include <loom/loom_abi.h>

#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__)
#define EXPORT __attribute__((visibility("default")))
#else
#define EXPORT
#endif

static const loom_host_api* g_host = NULL;

/* ---- exec/c_repeat ---- */
typedef struct c_exec {
  int64_t repeat;
} c_exec;

static loom_status exec_create(const loom_options* options, loom_rank* rank, loom_exec** out) {
  c_exec* e = (c_exec*)malloc(sizeof(c_exec));
  (void)rank;
  if (e == NULL) return g_host->status_create(LOOM_CODE_OUT_OF_MEMORY, "c_repeat: out of memory");
  e->repeat = 1;
  g_host->option_int(options, "repeat", &e->repeat);
  if (e->repeat < 1) {
    free(e);
    return g_host->status_create(LOOM_CODE_INVALID_ARGUMENT, "c_repeat: option repeat must be >= 1");
  }
  g_host->log(LOOM_LOG_INFO, __FILE__, __LINE__, "c_repeat exec created");
  *out = (loom_exec*)e;
  return NULL;
}
static void exec_destroy(loom_exec* e) { free(e); }
static loom_status exec_run(loom_exec* exec, loom_rank* rank, const loom_exec_step* step) {
  const c_exec* e = (const c_exec*)exec;
  int64_t i;
  (void)rank;
  for (i = 0; i < e->repeat; ++i) {
    loom_status s = step->fn(step->ctx);
    if (s != NULL) return s;
  }
  return NULL;
}

static const loom_exec_api k_exec_api = {
    sizeof(loom_exec_api), exec_create, exec_destroy, exec_run,
};
/* Two options, so the host's walk over the array shows whether it uses the stride of
 * the header the plugin was built with (1.0's element is smaller than 1.9's). */
#if LOOM_ABI_MINOR >= 9
#define ALLOWED(range, choices) , range, choices
#else
#define ALLOWED(range, choices)
#endif
static const loom_option_decl k_exec_options[] = {
    {sizeof(loom_option_decl), LOOM_OPTION_INT, "repeat", "1", "how many times each step runs"
     ALLOWED("[1, 100]", NULL)},
    {sizeof(loom_option_decl), LOOM_OPTION_STRING, "label", "\"c\"", "a name for the log (declared only)"
     ALLOWED(NULL, "c|test")},
};
static const loom_plugin_info k_exec_info = {
    sizeof(loom_plugin_info), "exec", "c_repeat", "1.0.0", "runs every step N times (C test plugin)",
    LOOM_API_EXEC, &k_exec_api, k_exec_options, 2,
};

/* ---- layer/c_scale ---- */
typedef struct c_layer {
  float alpha;
  loom_param_decl decl;
  float* weight; /* bound parameter: a single scalar multiplied into alpha */
} c_layer;

static loom_status layer_create(const loom_options* options, loom_rank* rank,
                                const loom_layer_create_args* args, loom_layer** out) {
  c_layer* l = (c_layer*)calloc(1, sizeof(c_layer));
  double alpha = 2.0;
  (void)rank;
  (void)args;
  if (l == NULL) return g_host->status_create(LOOM_CODE_OUT_OF_MEMORY, "c_scale: out of memory");
  g_host->option_float(options, "alpha", &alpha);
  l->alpha = (float)alpha;
  l->decl.struct_size = sizeof(loom_param_decl);
  l->decl.name = "weight";
  l->decl.ndim = 1;
  l->decl.shape[0] = 1;
  l->decl.partition_dim = -1;
  l->decl.partition_stride = 1;
  l->decl.init = LOOM_INIT_ONES;
  *out = (loom_layer*)l;
  return NULL;
}
static void layer_destroy(loom_layer* l) { free(l); }
static loom_status layer_params(loom_layer* layer, const loom_param_decl** out, size_t* count) {
  c_layer* l = (c_layer*)layer;
  *out = &l->decl;
  *count = 1;
  return NULL;
}
static loom_status layer_bind(loom_layer* layer, const DLTensor* params, const DLTensor* grads, size_t n) {
  c_layer* l = (c_layer*)layer;
  (void)grads;
  if (n != 1) return g_host->status_create(LOOM_CODE_INVALID_ARGUMENT, "c_scale: expected one parameter");
  l->weight = (float*)params[0].data;
  return NULL;
}
static loom_status layer_forward(loom_layer* layer, loom_rank* rank, const loom_layer_fwd_args* args) {
  const c_layer* l = (const c_layer*)layer;
  int64_t n = 1, i;
  int d;
  (void)rank;
  if (args->input == NULL || args->output == NULL)
    return g_host->status_create(LOOM_CODE_INVALID_ARGUMENT, "c_scale: needs input and output");
  for (d = 0; d < args->input->ndim; ++d) n *= args->input->shape[d];
  for (i = 0; i < n; ++i)
    ((float*)args->output->data)[i] = l->alpha * l->weight[0] * ((const float*)args->input->data)[i];
  return NULL;
}
static loom_status layer_backward(loom_layer* layer, loom_rank* rank, const loom_layer_bwd_args* args) {
  (void)layer;
  (void)rank;
  (void)args;
  return g_host->status_create(LOOM_CODE_UNSUPPORTED, "c_scale: backward is not part of this test plugin");
}
static void layer_release(loom_layer* layer, int32_t microbatch) {
  (void)layer;
  (void)microbatch;
}

/* The table ends after `release`: struct_size says so, and the host must not touch
 * the later slots (activation_bytes, forward_flops). */
static const loom_layer_api k_layer_api = {
    offsetof(loom_layer_api, activation_bytes),
    layer_create, layer_destroy, layer_params, layer_bind, layer_forward, layer_backward, layer_release,
    NULL, NULL,
};
static const loom_option_decl k_layer_options[] = {
    {sizeof(loom_option_decl), LOOM_OPTION_FLOAT, "alpha", "2.0", "the scale factor"},
};
static const loom_plugin_info k_layer_info = {
    sizeof(loom_plugin_info), "layer", "c_scale", "1.0.0", "y = alpha * w * x (C test plugin)",
    LOOM_API_LAYER, &k_layer_api, k_layer_options, 1,
};

static const loom_plugin_info* const k_plugins[] = {&k_exec_info, &k_layer_info};
static const loom_plugin_library k_library = {
    sizeof(loom_plugin_library), LOOM_ABI_MAJOR, LOOM_ABI_MINOR, k_plugins, 2,
};

EXPORT loom_status loom_plugin_init_v1(const loom_host_api* host, const loom_plugin_library** out) {
  if (host == NULL || out == NULL) return NULL;
  g_host = host;
  *out = &k_library;
  return NULL;
}
