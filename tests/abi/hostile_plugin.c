/* Hostile libraries for the loader tests: each would crash an engine that called
 * or used what it exports without checking. The variant is chosen by a compile
 * definition (see CMakeLists.txt); each must be refused with a one-line message
 * naming the file and the reason.
 *   HOSTILE_DATA_ENTRY    loom_plugin_init_v1 is an int, not a function
 *   HOSTILE_NULL_DEVICE   device/cpu whose table is all NULL (it would shadow the built-in)
 *   HOSTILE_SHORT_DEVICE  a device table whose struct_size ends before copy
 *   HOSTILE_NULL_OPS      a device table without its op table
 *   HOSTILE_NULL_LAYER    a layer table without forward
 */
#include <loom/loom_abi.h>

#include <stddef.h>

#if defined(__GNUC__)
#define EXPORT __attribute__((visibility("default")))
#else
#define EXPORT
#endif

#if defined(HOSTILE_DATA_ENTRY)

EXPORT int loom_plugin_init_v1 = 5;

#else

static loom_status dev_create(const loom_options* o, const loom_device_create_args* a, loom_device** out) {
  (void)o;
  (void)a;
  *out = NULL;
  return NULL;
}
static void dev_destroy(loom_device* d) { (void)d; }
static loom_status dev_alloc(loom_device* d, size_t bytes, void** out) {
  (void)d;
  (void)bytes;
  *out = NULL;
  return NULL;
}
static void dev_free(loom_device* d, void* p) {
  (void)d;
  (void)p;
}
static loom_status dev_copy(loom_device* d, loom_stream* s, void* dst, const void* src, size_t n, int32_t kind) {
  (void)d;
  (void)s;
  (void)dst;
  (void)src;
  (void)n;
  (void)kind;
  return NULL;
}
static loom_status dev_sync(loom_device* d, loom_stream* s) {
  (void)d;
  (void)s;
  return NULL;
}

#if defined(HOSTILE_NULL_DEVICE)
static const loom_device_api k_api = {sizeof(loom_device_api)}; /* every slot NULL */
#define KIND "device"
#define NAME "cpu"
#define API_TYPE LOOM_API_DEVICE
#elif defined(HOSTILE_SHORT_DEVICE)
/* Its struct_size stops after free: copy and the rest lie outside the table. */
static const loom_device_api k_api = {offsetof(loom_device_api, memory_stats), dev_create, dev_destroy, dev_alloc,
                                      dev_free};
#define KIND "device"
#define NAME "short"
#define API_TYPE LOOM_API_DEVICE
#elif defined(HOSTILE_NULL_OPS)
static const loom_device_api k_api = {sizeof(loom_device_api), dev_create, dev_destroy, dev_alloc, dev_free, NULL,
                                      dev_copy, NULL, NULL, dev_sync};
#define KIND "device"
#define NAME "no_ops"
#define API_TYPE LOOM_API_DEVICE
#elif defined(HOSTILE_NULL_LAYER)
static loom_status layer_create(const loom_options* o, loom_rank* r, const loom_layer_create_args* a, loom_layer** out) {
  (void)o;
  (void)r;
  (void)a;
  *out = NULL;
  return NULL;
}
static void layer_destroy(loom_layer* l) { (void)l; }
static loom_status layer_params(loom_layer* l, const loom_param_decl** out, size_t* n) {
  (void)l;
  *out = NULL;
  *n = 0;
  return NULL;
}
static loom_status layer_bind(loom_layer* l, const DLTensor* p, const DLTensor* g, size_t n) {
  (void)l;
  (void)p;
  (void)g;
  (void)n;
  return NULL;
}
/* forward and backward left NULL. */
static const loom_layer_api k_api = {sizeof(loom_layer_api), layer_create, layer_destroy, layer_params, layer_bind};
#define KIND "layer"
#define NAME "no_forward"
#define API_TYPE LOOM_API_LAYER
#endif

/* A complete device table, referenced from every variant so no build leaves a stub unused. */
static const loom_device_api k_full = {sizeof(loom_device_api), dev_create, dev_destroy, dev_alloc, dev_free, NULL,
                                       dev_copy, NULL, NULL, dev_sync};
const loom_device_api* hostile_full_device(void);
const loom_device_api* hostile_full_device(void) { return &k_full; }

static const loom_plugin_info k_info = {sizeof(loom_plugin_info), KIND, NAME, "0.0.1", "hostile test plugin",
                                        API_TYPE, &k_api, NULL, 0};
static const loom_plugin_info* const k_plugins[] = {&k_info};
static const loom_plugin_library k_lib = {sizeof(loom_plugin_library), LOOM_ABI_MAJOR, LOOM_ABI_MINOR, k_plugins, 1};

EXPORT loom_status loom_plugin_init_v1(const loom_host_api* host, const loom_plugin_library** out) {
  (void)host;
  *out = &k_lib;
  return NULL;
}

#endif
