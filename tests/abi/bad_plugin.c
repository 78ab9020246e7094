/* Deliberately broken plugins for the loader tests; the variant is chosen by a
 * compile definition (see CMakeLists.txt). Each must be refused with a clear,
 * one-line message naming the file and the reason — never a crash. */
#include <loom/loom_abi.h>

#include <stddef.h>

#if defined(__GNUC__)
#define EXPORT __attribute__((visibility("default")))
#else
#define EXPORT
#endif

static loom_status noop_run(loom_exec* e, loom_rank* r, const loom_exec_step* s) {
  (void)e;
  (void)r;
  return s->fn(s->ctx);
}
static loom_status noop_create(const loom_options* o, loom_rank* r, loom_exec** out) {
  (void)o;
  (void)r;
  *out = NULL;
  return NULL;
}
static void noop_destroy(loom_exec* e) { (void)e; }
static const loom_exec_api k_api = {sizeof(loom_exec_api), noop_create, noop_destroy, noop_run};

#ifndef BAD_NAME
#define BAD_NAME "bad"
#endif
#if defined(BAD_SERVICE_BEFORE_ITS_MINOR)
/* An expert-parallel service (ABI 1.4) in a library that says it was built for 1.3. */
static const loom_plugin_info k_info = {sizeof(loom_plugin_info), "parallel", "expert_old", "0.0.1",
                                        "test plugin", LOOM_API_EXPERT_PARALLEL, &k_api, NULL, 0};
#elif defined(BAD_DEFAULT_OUTSIDE_RANGE) || defined(BAD_RANGE_TEXT) || defined(BAD_MIXED_OPTION_SIZES) || \
    defined(BAD_DUPLICATE_OPTION) || defined(BAD_NAN_DEFAULT) || defined(BAD_TRAILING_DEFAULT) ||      \
    defined(BAD_EMPTY_CHOICE) || defined(BAD_OPTION_NAME)
/* Option declarations the loader must refuse: a default its own range excludes, a range
 * that is not an interval, elements of two different struct sizes, one name twice, a
 * default no value may be, a default with more after it, an empty choice, a name no
 * manifest key can be. */
static const loom_option_decl k_options[] = {
#if defined(BAD_DEFAULT_OUTSIDE_RANGE)
    {sizeof(loom_option_decl), LOOM_OPTION_FLOAT, "p", "1.5", "a probability", "[0, 1)", NULL},
#elif defined(BAD_RANGE_TEXT)
    {sizeof(loom_option_decl), LOOM_OPTION_INT, "n", "1", "a count", "1..8", NULL},
#elif defined(BAD_DUPLICATE_OPTION)
    {sizeof(loom_option_decl), LOOM_OPTION_INT, "n", "1", "a count", NULL, NULL},
    {sizeof(loom_option_decl), LOOM_OPTION_INT, "n", "2", "a count again", NULL, NULL},
#elif defined(BAD_NAN_DEFAULT)
    {sizeof(loom_option_decl), LOOM_OPTION_FLOAT, "p", "nan", "a scale", NULL, NULL},
#elif defined(BAD_TRAILING_DEFAULT)
    {sizeof(loom_option_decl), LOOM_OPTION_FLOAT, "p", "1.0\nevil = 3", "a scale", NULL, NULL},
#elif defined(BAD_EMPTY_CHOICE)
    {sizeof(loom_option_decl), LOOM_OPTION_STRING, "mode", "\"a\"", "a mode", NULL, "a||b"},
#elif defined(BAD_OPTION_NAME)
    {sizeof(loom_option_decl), LOOM_OPTION_INT, "n m.x", "1", "a count", NULL, NULL},
#else
    {sizeof(loom_option_decl), LOOM_OPTION_INT, "n", "1", "a count", NULL, NULL},
    {sizeof(loom_option_decl) - 2 * sizeof(const char*), LOOM_OPTION_INT, "m", "1", "a count", NULL, NULL},
#endif
};
static const loom_plugin_info k_info = {sizeof(loom_plugin_info), "exec", BAD_NAME, "0.0.1", "test plugin",
                                        LOOM_API_EXEC, &k_api, k_options, sizeof(k_options) / sizeof(k_options[0])};
#elif defined(BAD_CONTROL_TEXT)
/* Loads, but its text must not forge or recolour a line of a listing. */
static const loom_plugin_info k_info = {sizeof(loom_plugin_info), "exec", BAD_NAME, "0.0.1\n",
                                        "line\nFAKE  exec/evil\x1b[31m", LOOM_API_EXEC, &k_api, NULL, 0};
#else
static const loom_plugin_info k_info = {
    sizeof(loom_plugin_info), "exec", BAD_NAME, "0.0.1", "test plugin", LOOM_API_EXEC, &k_api, NULL, 0};
#endif
static const loom_plugin_info* const k_plugins[] = {&k_info};

#if defined(BAD_NEWER_MINOR)
static const loom_plugin_library k_lib = {sizeof(loom_plugin_library), LOOM_ABI_MAJOR, LOOM_ABI_MINOR + 1,
                                          k_plugins, 1};
#elif defined(BAD_SERVICE_BEFORE_ITS_MINOR)
static const loom_plugin_library k_lib = {sizeof(loom_plugin_library), LOOM_ABI_MAJOR, 3, k_plugins, 1};
#elif defined(BAD_NO_PLUGINS)
static const loom_plugin_library k_lib = {sizeof(loom_plugin_library), LOOM_ABI_MAJOR, LOOM_ABI_MINOR, k_plugins, 0};
#else
static const loom_plugin_library k_lib = {sizeof(loom_plugin_library), LOOM_ABI_MAJOR, LOOM_ABI_MINOR,
                                          k_plugins, 1};
#endif

/* Referenced from every variant so no build leaves k_lib unused. */
const loom_plugin_library* bad_plugin_library(void);
const loom_plugin_library* bad_plugin_library(void) { return &k_lib; }

#if defined(BAD_WRONG_MAJOR)
/* Only the entry point of a future ABI major. */
EXPORT loom_status loom_plugin_init_v2(const loom_host_api* host, const loom_plugin_library** out) {
  (void)host;
  *out = bad_plugin_library();
  return NULL;
}
#elif defined(BAD_NO_ENTRY)
EXPORT int not_a_loom_plugin(void) { return 42; }
#else
EXPORT loom_status loom_plugin_init_v1(const loom_host_api* host, const loom_plugin_library** out) {
#if defined(BAD_FAILING_INIT)
  (void)out;
  return host->status_create(LOOM_CODE_NOT_FOUND, "license file /etc/bad.lic not found");
#else
  (void)host;
  *out = &k_lib;
  return NULL;
#endif
}
#endif
