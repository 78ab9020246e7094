// device/cpu: every op against a double-precision reference written here (whose
// own gradients are checked by central finite differences), every op with bf16
// storage against the fp32 op on the bf16 values, graphs, memory accounting,
// threads and error reporting. The plugin is loaded through the engine's
// registry, exactly as a run loads it.
#include <gtest/gtest.h>
#include <toml++/toml.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <loom/cpp/core.hpp>
#include <loom/cpp/plugin.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "engine/plugins/registry.hpp"

namespace {

using Vec = std::vector<double>;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---------------------------------------------------------------------------
// Plugin, device and buffers
// ---------------------------------------------------------------------------

const loom::plugins::LoadedPlugin& cpu_plugin() {
  static loom::plugins::Registry* registry = [] {
    auto* r = new loom::plugins::Registry();  // plugins are never unloaded
    r->load_file(std::string(LOOM_TEST_PLUGIN_DIR) + "/loom_device_cpu.so");
    loom::host_slot() = loom::plugins::host_api();
    return r;
  }();
  return registry->get("device", "cpu");
}

struct StatusInfo {
  int32_t code = LOOM_CODE_OK;
  std::string message;
};
StatusInfo take(loom_status s) {
  StatusInfo info;
  if (s == nullptr) return info;
  const loom_host_api& h = loom::host();
  info.code = h.status_code(s);
  info.message = h.status_message(s);
  h.status_destroy(s);
  return info;
}

class Dev;

template <typename T>
class Buf {
 public:
  Buf(const Dev& d, size_t n);
  Buf(const Dev& d, const std::vector<T>& init) : Buf(d, init.size()) { set(init); }
  ~Buf();
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  T* data() const { return p_; }
  size_t size() const { return n_; }
  T& operator[](size_t i) const { return p_[i]; }
  void set(const std::vector<T>& v) {
    ASSERT_EQ(v.size(), n_);
    std::memcpy(p_, v.data(), n_ * sizeof(T));
  }
  void fill(T v) {
    for (size_t i = 0; i < n_; ++i) p_[i] = v;
  }
  std::vector<T> get() const { return std::vector<T>(p_, p_ + n_); }

 private:
  const Dev* d_;
  T* p_ = nullptr;
  size_t n_;
};

// One device instance with the given thread count, GEMM backend and kernel variant.
class Dev {
 public:
  explicit Dev(int threads = 2, const std::string& blas = "openblas", const std::string& simd = "auto") {
    const loom::plugins::LoadedPlugin& plugin = cpu_plugin();
    api_ = plugin.device();
    toml::table section{{"blas", blas}, {"simd", simd}};
    loom::plugins::OptionValues opts(&section, plugin.options);
    loom_device_create_args args = loom::make<loom_device_create_args>();
    args.num_threads = threads;
    args.ranks_in_process = 1;
    loom::check(api_->create(opts.raw(), &args, &dev_));
  }
  ~Dev() { api_->destroy(dev_); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  const loom_device_api* api() const { return api_; }
  loom_device* raw() const { return dev_; }
  loom::Device ops(loom_stream* s = nullptr) const { return loom::Device(api_, dev_, s); }
  loom_memory_stats stats() const {
    loom_memory_stats m = loom::make<loom_memory_stats>();
    loom::check(api_->memory_stats(dev_, &m));
    return m;
  }

 private:
  const loom_device_api* api_ = nullptr;
  loom_device* dev_ = nullptr;
};

template <typename T>
Buf<T>::Buf(const Dev& d, size_t n) : d_(&d), n_(n) {
  void* p = nullptr;
  loom::check(d.api()->alloc(d.raw(), std::max<size_t>(n, 1) * sizeof(T), &p));
  p_ = static_cast<T*>(p);
}
template <typename T>
Buf<T>::~Buf() {
  d_->api()->free(d_->raw(), p_);
}

// The kernel variants this CPU runs ("base" always; "avx2", "avx512" when it can).
const std::vector<std::string>& simd_variants() {
  static const std::vector<std::string> variants = [] {
    std::vector<std::string> v;
    const loom::plugins::LoadedPlugin& plugin = cpu_plugin();
    for (const char* simd : {"base", "avx2", "avx512"}) {
      toml::table section{{"simd", simd}};
      loom::plugins::OptionValues opts(&section, plugin.options);
      loom_device_create_args args = loom::make<loom_device_create_args>();
      args.num_threads = 1;
      loom_device* dev = nullptr;
      StatusInfo s = take(plugin.device()->create(opts.raw(), &args, &dev));
      if (dev != nullptr) {
        plugin.device()->destroy(dev);
        v.push_back(simd);
      } else {
        EXPECT_EQ(s.code, LOOM_CODE_UNSUPPORTED) << s.message;
      }
    }
    return v;
  }();
  return variants;
}

// ---------------------------------------------------------------------------
// Numbers
// ---------------------------------------------------------------------------

std::vector<float> randn(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}
Vec to_d(const std::vector<float>& v) { return Vec(v.begin(), v.end()); }

// |got - want| <= atol + rtol |want| elementwise, with the first failures reported.
void expect_close(const std::vector<float>& got, const Vec& want, double atol, double rtol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int reported = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(err <= atol + rtol * std::fabs(want[i]))) {
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
      if (++reported == 5) return;
    }
  }
}

// Central differences of f in every coordinate of x against the analytic grad.
void expect_fd(Vec& x, const std::function<double()>& f, const Vec& grad, const std::string& what, double h = 1e-6,
               double tol = 1e-6) {
  ASSERT_EQ(x.size(), grad.size()) << what;
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double fp = f();
    x[i] = x0 - h;
    const double fm = f();
    x[i] = x0;
    const double fd = (fp - fm) / (2 * h);
    EXPECT_NEAR(grad[i], fd, tol * std::max(1.0, std::fabs(fd))) << what << "[" << i << "]";
  }
}

double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// bf16 rounding, written independently of the plugin: the nearer of the two bf16
// neighbours of |x| (ties to the even one), in double; past the largest bf16 the
// upper neighbour is 2^128, i.e. overflow to infinity.
float bf16_round_ref(float x) {
  if (std::isnan(x) || std::isinf(x)) return x;
  const float ax = std::fabs(x);
  uint32_t u;
  std::memcpy(&u, &ax, 4);
  const uint32_t lo_bits = u & 0xffff0000u, hi_bits = lo_bits + 0x10000u;
  float lo_f, hi_f;
  std::memcpy(&lo_f, &lo_bits, 4);
  std::memcpy(&hi_f, &hi_bits, 4);
  const double lo = lo_f, hi = std::isinf(hi_f) ? std::ldexp(1.0, 128) : double(hi_f);
  const double dl = ax - lo, dh = hi - ax;
  const bool up = dh < dl || (dh == dl && ((lo_bits >> 16) & 1u));
  const float r = up ? hi_f : lo_f;
  return std::copysign(r, x);
}

// ---------------------------------------------------------------------------
// Plugin descriptor, memory, streams
// ---------------------------------------------------------------------------

TEST(DeviceCpu, DescribesItselfAndFillsEverySlot) {
  const loom::plugins::LoadedPlugin& p = cpu_plugin();
  EXPECT_EQ(p.kind, "device");
  EXPECT_EQ(p.name, "cpu");
  const loom_device_api* api = p.device();
  ASSERT_NE(api, nullptr);
  EXPECT_GE(api->struct_size, sizeof(loom_device_api));
  EXPECT_EQ(api->dl_device_type, kDLCPU);
  const void* slots[] = {(void*)api->create,
                         (void*)api->destroy,
                         (void*)api->alloc,
                         (void*)api->free,
                         (void*)api->memory_stats,
                         (void*)api->copy,
                         (void*)api->stream_create,
                         (void*)api->stream_destroy,
                         (void*)api->stream_synchronize,
                         (void*)api->event_create,
                         (void*)api->event_destroy,
                         (void*)api->event_record,
                         (void*)api->stream_wait_event,
                         (void*)api->event_synchronize,
                         (void*)api->capture_begin,
                         (void*)api->capture_end,
                         (void*)api->graph_replay,
                         (void*)api->graph_destroy,
                         (void*)api->native_stream};
  for (const void* s : slots) EXPECT_NE(s, nullptr);
  const loom_device_ops* ops = api->ops;
  ASSERT_NE(ops, nullptr);
  EXPECT_GE(ops->struct_size, sizeof(loom_device_ops));
  const void* op_slots[] = {(void*)ops->gemm,          (void*)ops->layernorm_fwd, (void*)ops->layernorm_bwd,
                            (void*)ops->gelu_fwd,      (void*)ops->gelu_bwd,      (void*)ops->attention_fwd,
                            (void*)ops->attention_bwd, (void*)ops->xent,          (void*)ops->embedding_fwd,
                            (void*)ops->embedding_bwd, (void*)ops->elementwise,   (void*)ops->reduce,
                            (void*)ops->adamw,         (void*)ops->rmsnorm_fwd,   (void*)ops->rmsnorm_bwd,
                            (void*)ops->swiglu_fwd,    (void*)ops->swiglu_bwd,    (void*)ops->rope_fwd,
                            (void*)ops->rope_bwd,      (void*)ops->sigmoid_fwd,   (void*)ops->sigmoid_bwd,
                            (void*)ops->host_task};
  for (const void* s : op_slots) EXPECT_NE(s, nullptr);
  std::vector<std::string> names;
  for (const auto& o : p.options) names.push_back(o.name);
  EXPECT_NE(std::find(names.begin(), names.end(), "blas"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "threads"), names.end());
  Dev d;
  EXPECT_EQ(api->native_stream(d.raw(), nullptr), nullptr);
}

TEST(DeviceCpu, PicksAKernelVariantThisCpuRuns) {
  const std::vector<std::string>& v = simd_variants();
  ASSERT_FALSE(v.empty());
  EXPECT_EQ(v.front(), "base");
  const loom::plugins::LoadedPlugin& p = cpu_plugin();
  toml::table section{{"simd", "sse9"}};
  loom::plugins::OptionValues opts(&section, p.options);
  loom_device_create_args args = loom::make<loom_device_create_args>();
  loom_device* dev = nullptr;
  StatusInfo s = take(p.device()->create(opts.raw(), &args, &dev));
  EXPECT_EQ(s.code, LOOM_CODE_INVALID_ARGUMENT);
  EXPECT_NE(s.message.find("sse9"), std::string::npos) << s.message;
}

// The GEMM backends are the option's declared choices: the manifest check refuses
// another, naming those it allows, before a device is created.
TEST(DeviceCpu, RejectsAnUnknownBlasOption) {
  const loom::plugins::LoadedPlugin& p = cpu_plugin();
  loom::manifest::Manifest m = loom::manifest::Manifest::parse("[device.options]\nblas = \"mkl\"\n", "m.toml");
  std::vector<loom::manifest::Diagnostic> diags;
  m.apply_plugin_options("device.options", "device/cpu", p.options, diags);
  ASSERT_EQ(diags.size(), 1u);
  EXPECT_NE(diags[0].message.find("blas must be one of \"openblas\", \"builtin\", got \"mkl\""), std::string::npos)
      << diags[0].message;
}

TEST(DeviceCpu, MemoryStatsTrackCurrentPeakAndCount) {
  Dev d;
  const loom_device_api* api = d.api();
  const loom_memory_stats s0 = d.stats();
  EXPECT_EQ(s0.current_bytes, 0u);
  void* a = nullptr;
  void* b = nullptr;
  loom::check(api->alloc(d.raw(), 1000, &a));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 256, 0u);
  loom_memory_stats s1 = d.stats();
  EXPECT_EQ(s1.current_bytes, 1000u);
  EXPECT_EQ(s1.peak_bytes, 1000u);
  EXPECT_GE(s1.reserved_bytes, s1.current_bytes);
  EXPECT_EQ(s1.num_allocs, 1u);
  loom::check(api->alloc(d.raw(), 5000, &b));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b) % 256, 0u);
  std::memset(a, 1, 1000);  // the memory is really there
  std::memset(b, 2, 5000);
  EXPECT_EQ(d.stats().current_bytes, 6000u);
  api->free(d.raw(), a);
  loom_memory_stats s2 = d.stats();
  EXPECT_EQ(s2.current_bytes, 5000u);
  EXPECT_EQ(s2.peak_bytes, 6000u);
  EXPECT_EQ(s2.num_allocs, 2u);
  api->free(d.raw(), b);
  EXPECT_EQ(d.stats().current_bytes, 0u);
  EXPECT_EQ(d.stats().reserved_bytes, 0u);
  EXPECT_EQ(d.stats().peak_bytes, 6000u);
  // Freeing what the device did not allocate is reported (logged), not a crash.
  int local = 0;
  api->free(d.raw(), &local);
  api->free(d.raw(), nullptr);
  EXPECT_EQ(d.stats().current_bytes, 0u);
}

// memory_mb: a rank's own memory, as a GPU's. It is the capacity plans are checked
// against (not shared by the process's ranks), and allocations beyond it fail as a
// GPU's would, naming the option; what is freed can be allocated again.
TEST(DeviceCpu, MemoryMbIsARanksCapacityAndAllocationsStopThere) {
  const loom::plugins::LoadedPlugin& plugin = cpu_plugin();
  toml::table section{{"memory_mb", 1}};
  loom::plugins::OptionValues opts(&section, plugin.options);
  loom_device_create_args args = loom::make<loom_device_create_args>();
  args.num_threads = 1;
  args.ranks_in_process = 4;
  const loom_device_api* api = plugin.device();
  loom_device* dev = nullptr;
  loom::check(api->create(opts.raw(), &args, &dev));
  loom_memory_stats m = loom::make<loom_memory_stats>();
  loom::check(api->memory_stats(dev, &m));
  EXPECT_EQ(m.capacity_bytes, 1u << 20);
  void* a = nullptr;
  void* b = nullptr;
  loom::check(api->alloc(dev, 600 << 10, &a));
  const StatusInfo refused = take(api->alloc(dev, 600 << 10, &b));
  EXPECT_EQ(refused.code, LOOM_CODE_OUT_OF_MEMORY);
  EXPECT_NE(refused.message.find("device.options.memory_mb"), std::string::npos) << refused.message;
  EXPECT_EQ(b, nullptr);
  api->free(dev, a);
  loom::check(api->alloc(dev, 600 << 10, &b));
  api->free(dev, b);
  api->destroy(dev);
}

TEST(DeviceCpu, MemoryAccountingIsThreadSafe) {
  Dev d;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 500; ++i) {
        void* p = nullptr;
        loom::check(d.api()->alloc(d.raw(), 64 + static_cast<size_t>(t * 8 + i % 7), &p));
        d.api()->free(d.raw(), p);
      }
    });
  for (std::thread& t : threads) t.join();
  const loom_memory_stats s = d.stats();
  EXPECT_EQ(s.current_bytes, 0u);
  EXPECT_EQ(s.num_allocs, 2000u);
  EXPECT_GT(s.peak_bytes, 0u);
}

TEST(DeviceCpu, CopyAllKindsAndStreamsEvents) {
  Dev d;
  const loom_device_api* api = d.api();
  Buf<float> a(d, randn(100, 1)), b(d, 100);
  std::vector<float> host(100, 0.0f);
  loom::check(api->copy(d.raw(), nullptr, b.data(), a.data(), 400, LOOM_COPY_DEVICE_TO_DEVICE));
  loom::check(api->copy(d.raw(), nullptr, host.data(), b.data(), 400, LOOM_COPY_DEVICE_TO_HOST));
  EXPECT_EQ(host, a.get());
  host[3] = 42.0f;
  loom::check(api->copy(d.raw(), nullptr, a.data(), host.data(), 400, LOOM_COPY_HOST_TO_DEVICE));
  EXPECT_EQ(a[3], 42.0f);
  EXPECT_EQ(take(api->copy(d.raw(), nullptr, a.data(), host.data(), 4, 7)).code, LOOM_CODE_INVALID_ARGUMENT);

  loom_stream* s = nullptr;
  loom_event* e = nullptr;
  loom::check(api->stream_create(d.raw(), &s));
  loom::check(api->event_create(d.raw(), &e));
  loom::check(api->event_record(d.raw(), e, s));
  loom::check(api->stream_wait_event(d.raw(), nullptr, e));
  loom::check(api->event_synchronize(d.raw(), e));
  loom::check(api->stream_synchronize(d.raw(), s));
  loom::check(api->stream_synchronize(d.raw(), nullptr));
  // Handles are validated: a pointer that is no event is an error, not a crash.
  alignas(16) unsigned char junk[64] = {};
  EXPECT_EQ(take(api->event_synchronize(d.raw(), reinterpret_cast<loom_event*>(junk))).code,
            LOOM_CODE_INVALID_ARGUMENT);
  EXPECT_EQ(take(api->stream_synchronize(d.raw(), reinterpret_cast<loom_stream*>(junk))).code,
            LOOM_CODE_INVALID_ARGUMENT);
  api->event_destroy(d.raw(), e);
  api->stream_destroy(d.raw(), s);
}

// copy_2d (ABI 1.2): every third 12-byte block of a source gathered into rows of
// pitch 20, the gaps left alone; recorded by a capture and run on replay; refused
// with bad pitches. loom::Device::copy_2d gives the same bytes through a 1.1 table
// (no copy_2d slot: one copy per row).
TEST(DeviceCpu, Copy2dGathersRowsAndLeavesTheGapsAlone) {
  Dev d;
  const loom_device_api* api = d.api();
  ASSERT_TRUE(LOOM_HAS_SLOT(api, loom_device_api, copy_2d) && api->copy_2d != nullptr);
  EXPECT_NE(api->features & LOOM_DEVICE_GRAD_FP32, 0u);
  const size_t rows = 7, width = 12, src_pitch = 36, dst_pitch = 20;
  Buf<uint8_t> src(d, rows * src_pitch), dst(d, rows * dst_pitch);
  std::vector<uint8_t> sv(rows * src_pitch);
  for (size_t i = 0; i < sv.size(); ++i) sv[i] = static_cast<uint8_t>(i * 7 + 3);
  src.set(sv);
  std::vector<uint8_t> want(rows * dst_pitch, 0xEE);
  for (size_t r = 0; r < rows; ++r)
    for (size_t c = 0; c < width; ++c) want[r * dst_pitch + c] = sv[r * src_pitch + c];

  dst.fill(0xEE);
  loom::check(api->copy_2d(d.raw(), nullptr, dst.data(), dst_pitch, src.data(), src_pitch, width, rows,
                           LOOM_COPY_DEVICE_TO_DEVICE));
  EXPECT_EQ(dst.get(), want);

  dst.fill(0xEE);
  loom::check(api->capture_begin(d.raw(), nullptr));
  loom::check(api->copy_2d(d.raw(), nullptr, dst.data(), dst_pitch, src.data(), src_pitch, width, rows,
                           LOOM_COPY_DEVICE_TO_DEVICE));
  loom_graph* graph = nullptr;
  loom::check(api->capture_end(d.raw(), nullptr, &graph));
  EXPECT_EQ(dst.get(), std::vector<uint8_t>(rows * dst_pitch, 0xEE)) << "captured, not run";
  loom::check(api->graph_replay(d.raw(), graph, nullptr));
  loom::check(api->stream_synchronize(d.raw(), nullptr));
  EXPECT_EQ(dst.get(), want) << "replayed";
  api->graph_destroy(d.raw(), graph);

  loom_device_api v1_1 = *api;  // a device built for 1.1: the table ends before copy_2d
  v1_1.struct_size = static_cast<uint32_t>(offsetof(loom_device_api, copy_2d));
  dst.fill(0xEE);
  loom::Device(&v1_1, d.raw(), nullptr).copy_2d(dst.data(), dst_pitch, src.data(), src_pitch, width, rows,
                                                LOOM_COPY_DEVICE_TO_DEVICE);
  EXPECT_EQ(dst.get(), want) << "row by row through a 1.1 table";
  EXPECT_EQ(loom::Device(&v1_1, d.raw(), nullptr).features(), 0u);

  const StatusInfo bad = take(api->copy_2d(d.raw(), nullptr, dst.data(), 8, src.data(), src_pitch, width, rows,
                                       LOOM_COPY_DEVICE_TO_DEVICE));
  EXPECT_EQ(bad.code, LOOM_CODE_INVALID_ARGUMENT);
  EXPECT_NE(bad.message.find("copy_2d"), std::string::npos) << bad.message;
  EXPECT_NE(bad.message.find("width 12"), std::string::npos) << bad.message;
  loom::check(api->copy_2d(d.raw(), nullptr, nullptr, 0, nullptr, 0, 0, 5, LOOM_COPY_DEVICE_TO_DEVICE));
}

// grad_fp32 is a flag: anything but 0 or 1 is refused, naming the member.
TEST(DeviceCpu, GradFp32OtherThanZeroOrOneIsRefused) {
  Dev d;
  Buf<float> x(d, 8), dy(d, 8), g(d, 8), stats(d, 2);
  Buf<int32_t> ids(d, std::vector<int32_t>{0, 1});
  loom_layernorm_bwd_args ln = loom::make<loom_layernorm_bwd_args>();
  ln.rows = 2;
  ln.cols = 4;
  ln.dy = dy.data();
  ln.x = x.data();
  ln.mean = stats.data();
  ln.rstd = stats.data();
  ln.dgamma = g.data();
  ln.grad_fp32 = 2;
  const StatusInfo a = take(d.api()->ops->layernorm_bwd(d.raw(), nullptr, &ln));
  EXPECT_EQ(a.code, LOOM_CODE_INVALID_ARGUMENT);
  EXPECT_NE(a.message.find("grad_fp32"), std::string::npos) << a.message;
  loom_embedding_args em = loom::make<loom_embedding_args>();
  em.n = 2;
  em.dim = 4;
  em.vocab_rows = 2;
  em.ids = ids.data();
  em.dout = dy.data();
  em.dtable = g.data();
  em.grad_fp32 = -1;
  const StatusInfo b = take(d.api()->ops->embedding_bwd(d.raw(), nullptr, &em));
  EXPECT_EQ(b.code, LOOM_CODE_INVALID_ARGUMENT);
  EXPECT_NE(b.message.find("grad_fp32"), std::string::npos) << b.message;
}

// ---------------------------------------------------------------------------
// GEMM
// ---------------------------------------------------------------------------

struct GemmCase {
  int ta, tb;
  int64_t m, n, k, batch;
  float alpha, beta;
};

void check_gemm(const Dev& d, const GemmCase& g, uint32_t seed) {
  const int64_t a_rows = g.ta ? g.k : g.m, a_cols = g.ta ? g.m : g.k;
  const int64_t b_rows = g.tb ? g.n : g.k, b_cols = g.tb ? g.k : g.n;
  const int64_t lda = a_cols + 3, ldb = b_cols + 2, ldc = g.n + 5;  // nothing tight
  const int64_t sa = a_rows * lda + 7, sb = b_rows * ldb + 1, sc = g.m * ldc + 3;
  const std::vector<float> av = randn(static_cast<size_t>(sa * g.batch), seed);
  const std::vector<float> bv = randn(static_cast<size_t>(sb * g.batch), seed + 1);
  std::vector<float> cv = randn(static_cast<size_t>(sc * g.batch), seed + 2);
  if (g.beta == 0.0f)
    for (float& x : cv) x = kNaN;  // beta = 0 must ignore whatever C holds
  Buf<float> A(d, av), B(d, bv), C(d, cv);
  Vec want(cv.begin(), cv.end());
  for (int64_t bi = 0; bi < g.batch; ++bi)
    for (int64_t i = 0; i < g.m; ++i)
      for (int64_t j = 0; j < g.n; ++j) {
        double s = 0;
        for (int64_t p = 0; p < g.k; ++p) {
          const double x = g.ta ? av[bi * sa + p * lda + i] : av[bi * sa + i * lda + p];
          const double y = g.tb ? bv[bi * sb + j * ldb + p] : bv[bi * sb + p * ldb + j];
          s += x * y;
        }
        double& c = want[bi * sc + i * ldc + j];
        c = g.alpha * s + (g.beta == 0.0f ? 0.0 : g.beta * c);
      }
  loom_gemm_args a = loom::make<loom_gemm_args>();
  a.trans_a = g.ta;
  a.trans_b = g.tb;
  a.m = g.m;
  a.n = g.n;
  a.k = g.k;
  a.a = A.data();
  a.lda = lda;
  a.stride_a = sa;
  a.b = B.data();
  a.ldb = ldb;
  a.stride_b = sb;
  a.c = C.data();
  a.ldc = ldc;
  a.stride_c = sc;
  a.batch = g.batch;
  a.alpha = g.alpha;
  a.beta = g.beta;
  a.dtype = a.c_dtype = LOOM_DTYPE_F32;
  d.ops().gemm(a);
  std::vector<float> got = C.get();
  // Elements outside the m x n blocks (ld padding, batch gaps) stay as they were.
  for (size_t i = 0; i < got.size(); ++i)
    if (std::isnan(cv[i]) && std::isnan(got[i])) {
      const int64_t bi = static_cast<int64_t>(i) / sc, r = (static_cast<int64_t>(i) % sc) / ldc,
                    c = (static_cast<int64_t>(i) % sc) % ldc;
      ASSERT_FALSE(bi < g.batch && r < g.m && c < g.n) << "NaN from C leaked through beta = 0 at " << i;
      got[i] = 0.0f;
      want[i] = 0.0;
    }
  std::ostringstream what;
  what << "gemm ta=" << g.ta << " tb=" << g.tb << " m=" << g.m << " n=" << g.n << " k=" << g.k << " batch=" << g.batch
       << " beta=" << g.beta;
  expect_close(got, want, 1e-4 * std::sqrt(static_cast<double>(g.k) + 1), 1e-5, what.str());
}

class GemmBackends : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(GemmBackends, MatchesNaiveLoopForAllTransposesBatchesAndBetas) {
  Dev d(std::get<1>(GetParam()), std::get<0>(GetParam()));
  uint32_t seed = 10;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      check_gemm(d, {ta, tb, 5, 7, 3, 1, 1.0f, 0.0f}, seed++);
      check_gemm(d, {ta, tb, 13, 9, 17, 3, 0.75f, 0.0f}, seed++);
      check_gemm(d, {ta, tb, 13, 9, 17, 3, -1.5f, 1.0f}, seed++);
      check_gemm(d, {ta, tb, 70, 65, 300, 2, 1.0f, 0.5f}, seed++);   // batch-parallel sizes
      check_gemm(d, {ta, tb, 300, 100, 80, 1, 1.0f, 0.0f}, seed++);  // row panels
      check_gemm(d, {ta, tb, 40, 600, 100, 1, 1.0f, 1.0f}, seed++);  // column panels
    }
  check_gemm(d, {0, 0, 6, 4, 0, 2, 1.0f, 0.0f}, seed++);  // k = 0: C = beta C (0, NaN ignored)
  check_gemm(d, {0, 1, 6, 4, 5, 2, 0.0f, 2.0f}, seed++);  // alpha = 0
}

INSTANTIATE_TEST_SUITE_P(DeviceCpu, GemmBackends,
                         ::testing::Combine(::testing::Values("openblas", "builtin"), ::testing::Values(1, 2)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_threads" + std::to_string(std::get<1>(info.param));
                         });

// Ranks get different thread counts as the parallel layout changes (2 cores over
// 1, 2, 4 ranks): however a GEMM is spread over the pool, the bits are the same.
TEST(DeviceCpu, GemmResultsDoNotDependOnTheThreadCount) {
  Dev d1(1), d2(2);
  const GemmCase cases[] = {{0, 0, 300, 100, 80, 1, 1.0f, 0.0f}, {1, 0, 40, 600, 100, 1, 1.0f, 1.0f},
                            {0, 1, 128, 96, 256, 4, 0.5f, 0.0f}, {1, 1, 257, 255, 129, 1, 1.0f, 0.0f},
                            {0, 0, 1024, 64, 64, 1, 1.0f, 0.0f}, {0, 0, 16, 2048, 64, 1, 1.0f, 0.0f}};
  for (const GemmCase& g : cases) {
    const int64_t a_n = g.m * g.k * g.batch, b_n = g.k * g.n * g.batch, c_n = g.m * g.n * g.batch;
    const std::vector<float> av = randn(a_n, 160), bv = randn(b_n, 161), cv = randn(c_n, 162);
    std::vector<float> results[2];
    for (int t = 0; t < 2; ++t) {
      const Dev& d = t == 0 ? d1 : d2;
      Buf<float> A(d, av), B(d, bv), C(d, cv);
      loom_gemm_args a = loom::make<loom_gemm_args>();
      a.trans_a = g.ta;
      a.trans_b = g.tb;
      a.m = g.m;
      a.n = g.n;
      a.k = g.k;
      a.a = A.data();
      a.lda = g.ta ? g.m : g.k;
      a.stride_a = g.m * g.k;
      a.b = B.data();
      a.ldb = g.tb ? g.k : g.n;
      a.stride_b = g.k * g.n;
      a.c = C.data();
      a.ldc = g.n;
      a.stride_c = g.m * g.n;
      a.batch = g.batch;
      a.alpha = g.alpha;
      a.beta = g.beta;
      d.ops().gemm(a);
      results[t] = C.get();
    }
    EXPECT_EQ(results[0], results[1]) << "m=" << g.m << " n=" << g.n << " k=" << g.k << " batch=" << g.batch;
  }
}

// Ranks are threads of one process, each with its own device: concurrent GEMMs
// and kernels (OpenBLAS is shared) give what each computes alone.
TEST(DeviceCpu, DevicesOfConcurrentRanksDoNotInterfere) {
  const int64_t m = 192, n = 160, k = 96;
  const std::vector<float> av = randn(m * k, 170), bv = randn(k * n, 171);
  auto work = [&](const Dev& d, std::vector<float>& out) {
    Buf<float> A(d, av), B(d, bv), C(d, m * n), Y(d, m * n);
    loom_gemm_args g = loom::make<loom_gemm_args>();
    g.m = m;
    g.n = n;
    g.k = k;
    g.a = A.data();
    g.lda = k;
    g.b = B.data();
    g.ldb = n;
    g.c = C.data();
    g.ldc = n;
    g.batch = 1;
    g.alpha = 1.0f;
    loom_gelu_args ge = loom::make<loom_gelu_args>();
    ge.n = m * n;
    ge.x = C.data();
    ge.out = Y.data();
    for (int rep = 0; rep < 20; ++rep) {
      d.ops().gemm(g);
      d.ops().gelu_fwd(ge);
    }
    out = Y.get();
  };
  std::vector<float> alone;
  {
    Dev d(1);
    work(d, alone);
  }
  std::vector<std::vector<float>> results(4);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 4; ++r)
    ranks.emplace_back([&, r] {
      Dev d(r % 2 + 1);
      work(d, results[static_cast<size_t>(r)]);
    });
  for (std::thread& t : ranks) t.join();
  for (const std::vector<float>& res : results) EXPECT_EQ(res, alone);
}

TEST(DeviceCpu, GemmSumsOverBatchWhenCStrideIsZero) {
  Dev d(2);
  const int64_t m = 64, n = 64, k = 200, batch = 4;
  const std::vector<float> av = randn(static_cast<size_t>(m * k * batch), 3),
                           bv = randn(static_cast<size_t>(k * n * batch), 4);
  Buf<float> A(d, av), B(d, bv), C(d, static_cast<size_t>(m * n));
  C.fill(0.0f);
  loom_gemm_args a = loom::make<loom_gemm_args>();
  a.m = m;
  a.n = n;
  a.k = k;
  a.a = A.data();
  a.lda = k;
  a.stride_a = m * k;
  a.b = B.data();
  a.ldb = n;
  a.stride_b = k * n;
  a.c = C.data();
  a.ldc = n;
  a.stride_c = 0;
  a.batch = batch;
  a.alpha = 1.0f;
  a.beta = 1.0f;
  d.ops().gemm(a);
  Vec want(static_cast<size_t>(m * n), 0.0);
  for (int64_t bi = 0; bi < batch; ++bi)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j)
        for (int64_t p = 0; p < k; ++p)
          want[i * n + j] += double(av[bi * m * k + i * k + p]) * bv[bi * k * n + p * n + j];
  expect_close(C.get(), want, 1e-3, 1e-5, "gemm stride_c=0");
}

TEST(DeviceCpu, GemmReportsUnsupportedDtypesAndBadShapes) {
  Dev d;
  Buf<float> A(d, 16), B(d, 16), C(d, 16);
  loom_gemm_args a = loom::make<loom_gemm_args>();
  a.m = a.n = a.k = 4;
  a.a = A.data();
  a.b = B.data();
  a.c = C.data();
  a.lda = a.ldb = a.ldc = 4;
  a.batch = 1;
  a.alpha = 1.0f;
  a.dtype = LOOM_DTYPE_F16;
  a.c_dtype = LOOM_DTYPE_F32;
  StatusInfo s = take(d.api()->ops->gemm(d.raw(), nullptr, &a));
  EXPECT_EQ(s.code, LOOM_CODE_UNSUPPORTED);
  EXPECT_NE(s.message.find("gemm"), std::string::npos) << s.message;
  EXPECT_NE(s.message.find("f16"), std::string::npos) << s.message;
  a.dtype = LOOM_DTYPE_F32;
  a.lda = 3;
  s = take(d.api()->ops->gemm(d.raw(), nullptr, &a));
  EXPECT_EQ(s.code, LOOM_CODE_INVALID_ARGUMENT);
  EXPECT_NE(s.message.find("lda"), std::string::npos) << s.message;
  EXPECT_EQ(take(d.api()->ops->gemm(d.raw(), nullptr, nullptr)).code, LOOM_CODE_INVALID_ARGUMENT);
}

// ---------------------------------------------------------------------------
// GEMM epilogues (ABI 1.11)
// ---------------------------------------------------------------------------

loom_gemm_args epilogue_gemm(int ta, int tb, int64_t m, int64_t n, int64_t k, const void* a, const void* b, void* c,
                             int64_t ldc, float beta, int32_t dtype) {
  loom_gemm_args g = loom::make<loom_gemm_args>();
  g.trans_a = ta;
  g.trans_b = tb;
  g.m = m;
  g.n = n;
  g.k = k;
  g.a = a;
  g.lda = ta ? m : k;
  g.b = b;
  g.ldb = tb ? k : n;
  g.c = c;
  g.ldc = ldc;
  g.batch = 1;
  g.alpha = 1.0f;
  g.beta = beta;
  g.dtype = dtype;
  g.c_dtype = dtype;
  return g;
}

// In fp32 an epilogue is the unfused ops' very math: the same bits as gemm, then
// ADD_BIAS, gelu_fwd (aux = its input) or gelu_bwd, row by row at C's and aux's
// leading dimensions.
TEST(DeviceCpu, GemmEpiloguesEqualTheUnfusedOpsBitForBit) {
  Dev d(2);
  const int64_t m = 37, n = 45, k = 29, ldc = n + 3;
  for (int t = 0; t < 4; ++t) {
    const int ta = t & 1, tb = t >> 1;
    const std::vector<float> av = randn(static_cast<size_t>(m * k), 300 + t, -2, 2),
                             bv = randn(static_cast<size_t>(k * n), 310 + t, -2, 2),
                             cv = randn(static_cast<size_t>(m * ldc), 320 + t), biasv = randn(n, 330 + t),
                             auxv = randn(static_cast<size_t>(m * ldc), 340 + t, -4, 4);
    Buf<float> A(d, av), B(d, bv), bias(d, biasv);
    for (const int32_t e : {LOOM_GEMM_EPILOGUE_BIAS, LOOM_GEMM_EPILOGUE_GELU_AUX, LOOM_GEMM_EPILOGUE_DGELU}) {
      const float beta = e == LOOM_GEMM_EPILOGUE_BIAS ? 1.0f : 0.0f;
      const bool with_bias = e != LOOM_GEMM_EPILOGUE_DGELU;
      // Fused.
      Buf<float> C(d, cv), aux(d, auxv);
      loom_gemm_args g = epilogue_gemm(ta, tb, m, n, k, A.data(), B.data(), C.data(), ldc, beta, LOOM_DTYPE_F32);
      g.epilogue = e;
      g.bias = with_bias ? bias.data() : nullptr;
      if (e != LOOM_GEMM_EPILOGUE_BIAS) {
        g.aux = aux.data();
        g.ldaux = ldc;
      }
      d.ops().gemm(g);
      // Unfused, row by row (the ops take packed rows).
      Buf<float> U(d, cv), pre(d, auxv);
      d.ops().gemm(epilogue_gemm(ta, tb, m, n, k, A.data(), B.data(), U.data(), ldc, beta, LOOM_DTYPE_F32));
      for (int64_t i = 0; i < m; ++i) {
        float* row = U.data() + i * ldc;
        if (with_bias)
          d.ops().elementwise({.op = LOOM_EW_ADD_BIAS, .n = n, .cols = n, .x = row, .y = bias.data(), .out = row,
                               .dtype = LOOM_DTYPE_F32, .out_dtype = LOOM_DTYPE_F32});
        float* x = pre.data() + i * ldc;
        if (e == LOOM_GEMM_EPILOGUE_GELU_AUX) {
          std::memcpy(x, row, static_cast<size_t>(n) * sizeof(float));
          d.ops().gelu_fwd({.n = n, .x = x, .out = row, .dtype = LOOM_DTYPE_F32});
        } else if (e == LOOM_GEMM_EPILOGUE_DGELU) {
          d.ops().gelu_bwd({.n = n, .x = x, .dy = row, .out = row, .dtype = LOOM_DTYPE_F32});
        }
      }
      const std::string what = "epilogue " + std::to_string(e) + " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb);
      const std::vector<float> got = C.get(), want = U.get(), got_aux = aux.get(), want_aux = pre.get();
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_EQ(got[i], want[i]) << what << " C[" << i << "]";
      }
      for (size_t i = 0; i < got_aux.size(); ++i) {
        ASSERT_EQ(got_aux[i], want_aux[i]) << what << " aux[" << i << "]";
      }
      if (e != LOOM_GEMM_EPILOGUE_BIAS) {  // the epilogue changed something: the test can fail
        EXPECT_NE(got[0], cv[0]) << what;
      }
    }
  }
}

// BIAS_GRAD: the weight-gradient GEMM with the bias gradient accumulated from its B,
// bit for bit the GEMM then reduce COLUMN_SUM (fp32), and for a bf16 aux the fp32 sum
// added to the widened aux and rounded once.
TEST(DeviceCpu, GemmBiasGradEpilogueIsTheGemmAndTheColumnSums) {
  Dev d(2);
  const int64_t in = 23, out = 40, rows = 57;
  const std::vector<float> xv = randn(static_cast<size_t>(rows * in), 360, -2, 2),
                           dyv = randn(static_cast<size_t>(rows * out), 361, -2, 2),
                           wv = randn(static_cast<size_t>(in * out), 362), bv = randn(out, 363);
  Buf<float> X(d, xv), DY(d, dyv), W(d, wv), Bg(d, bv), W2(d, wv), Bg2(d, bv);
  loom_gemm_args g = epilogue_gemm(1, 0, in, out, rows, X.data(), DY.data(), W.data(), out, 1.0f, LOOM_DTYPE_F32);
  g.epilogue = LOOM_GEMM_EPILOGUE_BIAS_GRAD;
  g.aux = Bg.data();
  d.ops().gemm(g);
  d.ops().gemm(epilogue_gemm(1, 0, in, out, rows, X.data(), DY.data(), W2.data(), out, 1.0f, LOOM_DTYPE_F32));
  d.ops().reduce({.op = LOOM_RED_COLUMN_SUM, .n = rows * out, .cols = out, .x = DY.data(), .out = Bg2.data(),
                  .accumulate = 1, .dtype = LOOM_DTYPE_F32, .out_dtype = LOOM_DTYPE_F32});
  EXPECT_EQ(W.get(), W2.get());
  EXPECT_EQ(Bg.get(), Bg2.get());
  EXPECT_NE(Bg.get(), bv);
  // bf16 aux: aux + the fp32 sum, rounded once.
  auto bits = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<uint16_t>(u >> 16);
  };
  std::vector<float> dy16v(dyv), b16v(bv);
  for (float& v : dy16v) v = bf16_round_ref(v);
  for (float& v : b16v) v = bf16_round_ref(v);
  std::vector<uint16_t> dyh(dy16v.size()), bh(b16v.size()), xh(xv.size());
  for (size_t i = 0; i < dyh.size(); ++i) dyh[i] = bits(dy16v[i]);
  for (size_t i = 0; i < bh.size(); ++i) bh[i] = bits(b16v[i]);
  for (size_t i = 0; i < xh.size(); ++i) xh[i] = bits(bf16_round_ref(xv[i]));
  Buf<uint16_t> X16(d, xh), DY16(d, dyh), W16(d, static_cast<size_t>(in * out)), B16(d, bh);
  Buf<float> DYf(d, dy16v), S(d, static_cast<size_t>(out));
  loom_gemm_args h = epilogue_gemm(1, 0, in, out, rows, X16.data(), DY16.data(), W16.data(), out, 0.0f, LOOM_DTYPE_BF16);
  h.epilogue = LOOM_GEMM_EPILOGUE_BIAS_GRAD;
  h.aux = B16.data();
  d.ops().gemm(h);
  d.ops().reduce({.op = LOOM_RED_COLUMN_SUM, .n = rows * out, .cols = out, .x = DYf.data(), .out = S.data(),
                  .accumulate = 0, .dtype = LOOM_DTYPE_F32, .out_dtype = LOOM_DTYPE_F32});
  for (int64_t j = 0; j < out; ++j)
    ASSERT_EQ(B16[static_cast<size_t>(j)], bits(bf16_round_ref(b16v[static_cast<size_t>(j)] + S[static_cast<size_t>(j)])))
        << "bias gradient " << j;
}

// bf16 C: the fp32 epilogue on the same (bf16) values, rounded once to bf16.
TEST(DeviceCpu, GemmEpiloguesInBf16RoundOnce) {
  Dev d(2);
  const int64_t m = 19, n = 24, k = 33;
  auto bf16_values = [](std::vector<float> v) {
    for (float& x : v) x = bf16_round_ref(x);
    return v;
  };
  auto to_bits = [](const std::vector<float>& v) {
    std::vector<uint16_t> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      uint32_t u;
      std::memcpy(&u, &v[i], 4);
      h[i] = static_cast<uint16_t>(u >> 16);  // exact: the values are bf16 already
    }
    return h;
  };
  const std::vector<float> av = bf16_values(randn(static_cast<size_t>(m * k), 350, -2, 2)),
                           bv = bf16_values(randn(static_cast<size_t>(k * n), 351, -2, 2)),
                           biasv = bf16_values(randn(n, 352)), auxv = bf16_values(randn(static_cast<size_t>(m * n), 353, -4, 4));
  for (const int32_t e : {LOOM_GEMM_EPILOGUE_BIAS, LOOM_GEMM_EPILOGUE_GELU_AUX, LOOM_GEMM_EPILOGUE_DGELU}) {
    const bool with_bias = e != LOOM_GEMM_EPILOGUE_DGELU, with_aux = e != LOOM_GEMM_EPILOGUE_BIAS;
    Buf<float> A(d, av), B(d, bv), bias(d, biasv), C(d, static_cast<size_t>(m * n)), aux(d, auxv);
    loom_gemm_args g = epilogue_gemm(0, 0, m, n, k, A.data(), B.data(), C.data(), n, 0.0f, LOOM_DTYPE_F32);
    g.epilogue = e;
    g.bias = with_bias ? bias.data() : nullptr;
    g.aux = with_aux ? aux.data() : nullptr;
    g.ldaux = with_aux ? n : 0;
    d.ops().gemm(g);
    Buf<uint16_t> A16(d, to_bits(av)), B16(d, to_bits(bv)), bias16(d, to_bits(biasv)),
        C16(d, static_cast<size_t>(m * n)), aux16(d, to_bits(auxv));
    loom_gemm_args h = epilogue_gemm(0, 0, m, n, k, A16.data(), B16.data(), C16.data(), n, 0.0f, LOOM_DTYPE_BF16);
    h.epilogue = e;
    h.bias = with_bias ? bias16.data() : nullptr;
    h.aux = with_aux ? aux16.data() : nullptr;
    h.ldaux = with_aux ? n : 0;
    d.ops().gemm(h);
    const std::vector<float> want = C.get(), want_aux = aux.get();
    const std::vector<uint16_t> got = C16.get(), got_aux = aux16.get();
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i], to_bits({bf16_round_ref(want[i])})[0]) << "epilogue " << e << " C[" << i << "]";
    }
    if (e == LOOM_GEMM_EPILOGUE_GELU_AUX) {
      for (size_t i = 0; i < got_aux.size(); ++i) {
        ASSERT_EQ(got_aux[i], to_bits({bf16_round_ref(want_aux[i])})[0]) << "aux[" << i << "]";
      }
    }
  }
}

TEST(DeviceCpu, GemmEpilogueArgumentsAreChecked) {
  Dev d;
  Buf<float> A(d, 16), B(d, 16), C(d, 16), V(d, 16);
  auto refused = [&](const std::function<void(loom_gemm_args&)>& change, const std::string& words) {
    loom_gemm_args a = epilogue_gemm(0, 0, 4, 4, 4, A.data(), B.data(), C.data(), 4, 0.0f, LOOM_DTYPE_F32);
    a.epilogue = LOOM_GEMM_EPILOGUE_GELU_AUX;
    a.aux = V.data();
    a.ldaux = 4;
    change(a);
    const StatusInfo s = take(d.api()->ops->gemm(d.raw(), nullptr, &a));
    EXPECT_EQ(s.code, LOOM_CODE_INVALID_ARGUMENT) << words;
    EXPECT_NE(s.message.find(words), std::string::npos) << s.message;
  };
  refused([](loom_gemm_args& a) { a.epilogue = 7; }, "epilogue 7");
  refused([](loom_gemm_args& a) { a.batch = 2; }, "batch 1");
  refused([](loom_gemm_args& a) { a.aux = nullptr; }, "needs aux");
  refused([](loom_gemm_args& a) { a.ldaux = 3; }, "ldaux=3");
  refused([](loom_gemm_args& a) { a.epilogue = LOOM_GEMM_EPILOGUE_DGELU, a.beta = 1.0f; }, "beta 0");
  refused([&](loom_gemm_args& a) { a.epilogue = LOOM_GEMM_EPILOGUE_BIAS, a.aux = nullptr; }, "needs a bias");
  refused([&](loom_gemm_args& a) { a.epilogue = LOOM_GEMM_EPILOGUE_NONE, a.bias = V.data(), a.aux = nullptr; },
          "only with an epilogue");
  refused([](loom_gemm_args& a) { a.epilogue = LOOM_GEMM_EPILOGUE_BIAS_GRAD, a.trans_b = 1; }, "trans_b 0");
  refused([](loom_gemm_args& a) { a.epilogue = LOOM_GEMM_EPILOGUE_BIAS_GRAD, a.aux = nullptr; },
          "needs aux (the bias gradient)");
}

// ---------------------------------------------------------------------------
// LayerNorm
// ---------------------------------------------------------------------------

struct LnRef {
  int64_t rows, cols;
  double eps;
  void forward(const Vec& x, const Vec& g, const Vec& b, Vec& y, Vec& mean, Vec& rstd) const {
    y.assign(x.size(), 0);
    mean.assign(static_cast<size_t>(rows), 0);
    rstd.assign(static_cast<size_t>(rows), 0);
    for (int64_t r = 0; r < rows; ++r) {
      double m = 0, v = 0;
      for (int64_t c = 0; c < cols; ++c) m += x[r * cols + c];
      m /= cols;
      for (int64_t c = 0; c < cols; ++c) v += (x[r * cols + c] - m) * (x[r * cols + c] - m);
      const double rs = 1.0 / std::sqrt(v / cols + eps);
      for (int64_t c = 0; c < cols; ++c) y[r * cols + c] = (x[r * cols + c] - m) * rs * g[c] + b[c];
      mean[r] = m;
      rstd[r] = rs;
    }
  }
  void backward(const Vec& dy, const Vec& x, const Vec& g, Vec& dx, Vec& dg, Vec& db) const {
    Vec y, mean, rstd;
    forward(x, g, Vec(static_cast<size_t>(cols), 0.0), y, mean, rstd);
    dx.assign(x.size(), 0);
    dg.assign(static_cast<size_t>(cols), 0);
    db.assign(static_cast<size_t>(cols), 0);
    for (int64_t r = 0; r < rows; ++r) {
      double s1 = 0, s2 = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const double xh = (x[r * cols + c] - mean[r]) * rstd[r];
        const double gg = dy[r * cols + c] * g[c];
        s1 += gg;
        s2 += gg * xh;
        dg[c] += dy[r * cols + c] * xh;
        db[c] += dy[r * cols + c];
      }
      for (int64_t c = 0; c < cols; ++c) {
        const double xh = (x[r * cols + c] - mean[r]) * rstd[r];
        dx[r * cols + c] = rstd[r] * (dy[r * cols + c] * g[c] - s1 / cols - xh * s2 / cols);
      }
    }
  }
};

TEST(DeviceCpu, LayerNormReferenceGradientsMatchFiniteDifferences) {
  LnRef ref{3, 7, 1e-5};
  Vec x = to_d(randn(21, 1)), g = to_d(randn(7, 2, 0.5f, 1.5f)), b = to_d(randn(7, 3)), w = to_d(randn(21, 4));
  Vec dx, dg, db;
  ref.backward(w, x, g, dx, dg, db);
  auto loss = [&] {
    Vec y, m, r;
    ref.forward(x, g, b, y, m, r);
    return dot(y, w);
  };
  expect_fd(x, loss, dx, "layernorm dx");
  expect_fd(g, loss, dg, "layernorm dgamma");
  expect_fd(b, loss, db, "layernorm dbeta");
}

TEST(DeviceCpu, LayerNormMatchesReference) {
  for (const std::string& simd : simd_variants())
    for (int threads : {1, 2}) {
      SCOPED_TRACE("simd " + simd + ", threads " + std::to_string(threads));
      Dev d(threads, "openblas", simd);
      const int64_t rows = 37, cols = 300;  // rows * cols spans several parallel chunks at 2 threads
      LnRef ref{rows, cols, 1e-5};
      const std::vector<float> xv = randn(rows * cols, 5, -2.0f, 3.0f), gv = randn(cols, 6, 0.5f, 1.5f),
                               bv = randn(cols, 7), dyv = randn(rows * cols, 8), dx0 = randn(rows * cols, 9),
                               dg0 = randn(cols, 10), db0 = randn(cols, 11);
      Buf<float> x(d, xv), g(d, gv), b(d, bv), y(d, rows * cols), mean(d, rows), rstd(d, rows), dy(d, dyv), dx(d, dx0),
          dg(d, dg0), db(d, db0);
      loom_layernorm_fwd_args f = loom::make<loom_layernorm_fwd_args>();
      f.rows = rows;
      f.cols = cols;
      f.x = x.data();
      f.gamma = g.data();
      f.beta = b.data();
      f.y = y.data();
      f.mean = mean.data();
      f.rstd = rstd.data();
      f.eps = 1e-5f;
      d.ops().layernorm_fwd(f);
      Vec ry, rm, rr;
      ref.forward(to_d(xv), to_d(gv), to_d(bv), ry, rm, rr);
      expect_close(y.get(), ry, 1e-5, 1e-5, "layernorm y");
      expect_close(mean.get(), rm, 1e-6, 1e-6, "layernorm mean");
      expect_close(rstd.get(), rr, 1e-6, 1e-5, "layernorm rstd");

      Vec rdx, rdg, rdb;
      ref.backward(to_d(dyv), to_d(xv), to_d(gv), rdx, rdg, rdb);
      loom_layernorm_bwd_args bw = loom::make<loom_layernorm_bwd_args>();
      bw.rows = rows;
      bw.cols = cols;
      bw.dy = dy.data();
      bw.x = x.data();
      bw.gamma = g.data();
      bw.mean = mean.data();
      bw.rstd = rstd.data();
      bw.dx = dx.data();
      bw.dgamma = dg.data();
      bw.dbeta = db.data();
      d.ops().layernorm_bwd(bw);
      expect_close(dx.get(), rdx, 1e-5, 1e-4, "layernorm dx");
      Vec want_dg(static_cast<size_t>(cols)), want_db(static_cast<size_t>(cols));
      for (int64_t c = 0; c < cols; ++c) {  // dgamma, dbeta accumulate
        want_dg[c] = dg0[c] + rdg[c];
        want_db[c] = db0[c] + rdb[c];
      }
      expect_close(dg.get(), want_dg, 1e-4, 1e-5, "layernorm dgamma");
      expect_close(db.get(), want_db, 1e-4, 1e-5, "layernorm dbeta");
      // accumulate_dx adds onto dx.
      dx.set(dx0);
      bw.accumulate_dx = 1;
      bw.dgamma = bw.dbeta = nullptr;
      d.ops().layernorm_bwd(bw);
      Vec want_dx(rdx);
      for (size_t i = 0; i < want_dx.size(); ++i) want_dx[i] += dx0[i];
      expect_close(dx.get(), want_dx, 1e-5, 1e-4, "layernorm dx accumulated");
    }
}

// ---------------------------------------------------------------------------
// GeLU
// ---------------------------------------------------------------------------

double gelu_ref(double x) {
  const double c = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(c * (x + 0.044715 * x * x * x)));
}
double gelu_grad_ref(double x) {
  const double c = std::sqrt(2.0 / M_PI), u = c * (x + 0.044715 * x * x * x), t = std::tanh(u);
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x);
}

TEST(DeviceCpu, GeluMatchesReferenceAndFiniteDifferences) {
  Vec xs = to_d(randn(40, 12, -6.0f, 6.0f));
  for (double x : xs) {
    Vec p{x};
    expect_fd(
        p, [&] { return gelu_ref(p[0]); }, Vec{gelu_grad_ref(x)}, "gelu'", 1e-6, 1e-7);
  }
  for (const std::string& simd : simd_variants()) {
    SCOPED_TRACE("simd " + simd);
    Dev d(2, "openblas", simd);
    const size_t n = 100003;  // several chunks, odd tail
    std::vector<float> xv = randn(n, 13, -8.0f, 8.0f);
    xv[0] = 0.0f;
    xv[1] = -1e-4f;
    xv[2] = 30.0f;
    xv[3] = -30.0f;
    const std::vector<float> dyv = randn(n, 14);
    Buf<float> x(d, xv), dy(d, dyv), y(d, n), dx(d, n);
    loom_gelu_args a = loom::make<loom_gelu_args>();
    a.n = static_cast<int64_t>(n);
    a.x = x.data();
    a.out = y.data();
    d.ops().gelu_fwd(a);
    a.dy = dy.data();
    a.out = dx.data();
    d.ops().gelu_bwd(a);
    Vec want_y(n), want_dx(n);
    for (size_t i = 0; i < n; ++i) {
      want_y[i] = gelu_ref(xv[i]);
      want_dx[i] = dyv[i] * gelu_grad_ref(xv[i]);
    }
    expect_close(y.get(), want_y, 1e-6, 2e-6, "gelu y");
    expect_close(dx.get(), want_dx, 1e-6, 2e-6, "gelu dx");
    // In place.
    a.out = x.data();
    a.dy = nullptr;
    d.ops().gelu_fwd(a);
    expect_close(x.get(), want_y, 1e-6, 2e-6, "gelu y in place");
  }
}

// ---------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------

// Logical tensors [batch, seq, heads, hd] in double; the reference computes the
// textbook softmax derivative (not the flash formulation the plugin uses).
struct AttnRef {
  int64_t B, S, H, D;
  bool causal;
  double scale;
  int64_t window = 0;  // causal: query i sees keys (i - window, i]; 0: every earlier one
  std::vector<int32_t> key_start{};  // causal, [B * S] or empty: query (b, i) sees keys from key_start[b * S + i]
  const int32_t* key_start_or_null() const { return key_start.empty() ? nullptr : key_start.data(); }
  size_t idx(int64_t b, int64_t s, int64_t h, int64_t d) const {
    return static_cast<size_t>(((b * S + s) * H + h) * D + d);
  }
  Vec probs(const Vec& q, const Vec& k, int64_t b, int64_t h, int64_t i, double* lse) const {
    const int64_t valid = causal ? i + 1 : S;
    int64_t first = causal && window > 0 ? std::max<int64_t>(0, i - window + 1) : 0;
    if (causal && !key_start.empty()) first = std::max<int64_t>(first, key_start[static_cast<size_t>(b * S + i)]);
    Vec p(static_cast<size_t>(S), 0.0);
    double m = -1e300;
    for (int64_t j = first; j < valid; ++j) {
      double s = 0;
      for (int64_t d = 0; d < D; ++d) s += q[idx(b, i, h, d)] * k[idx(b, j, h, d)];
      p[j] = s * scale;
      m = std::max(m, p[j]);
    }
    double z = 0;
    for (int64_t j = first; j < valid; ++j) z += std::exp(p[j] - m);
    for (int64_t j = first; j < valid; ++j) p[j] = std::exp(p[j] - m) / z;
    if (lse) *lse = m + std::log(z);
    return p;
  }
  void forward(const Vec& q, const Vec& k, const Vec& v, Vec& out, Vec& lse) const {
    out.assign(q.size(), 0.0);
    lse.assign(static_cast<size_t>(B * H * S), 0.0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < S; ++i) {
          Vec p = probs(q, k, b, h, i, &lse[(b * H + h) * S + i]);
          for (int64_t j = 0; j < S; ++j)
            for (int64_t d = 0; d < D; ++d) out[idx(b, i, h, d)] += p[j] * v[idx(b, j, h, d)];
        }
  }
  void backward(const Vec& q, const Vec& k, const Vec& v, const Vec& dout, Vec& dq, Vec& dk, Vec& dv) const {
    dq.assign(q.size(), 0.0);
    dk.assign(q.size(), 0.0);
    dv.assign(q.size(), 0.0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < S; ++i) {
          Vec p = probs(q, k, b, h, i, nullptr);
          Vec dp(static_cast<size_t>(S), 0.0);
          double pdp = 0;
          for (int64_t j = 0; j < S; ++j) {
            for (int64_t d = 0; d < D; ++d) dp[j] += dout[idx(b, i, h, d)] * v[idx(b, j, h, d)];
            pdp += p[j] * dp[j];
          }
          for (int64_t j = 0; j < S; ++j) {
            const double ds = p[j] * (dp[j] - pdp) * scale;
            for (int64_t d = 0; d < D; ++d) {
              dq[idx(b, i, h, d)] += ds * k[idx(b, j, h, d)];
              dk[idx(b, j, h, d)] += ds * q[idx(b, i, h, d)];
              dv[idx(b, j, h, d)] += p[j] * dout[idx(b, i, h, d)];
            }
          }
        }
  }
};

// The reference's gradients of sum(out o w) against finite differences, on random
// inputs drawn from `seed`.
void expect_reference_gradients(const AttnRef& ref, uint32_t seed, const std::string& what) {
  const size_t n = static_cast<size_t>(ref.B * ref.S * ref.H * ref.D);
  Vec q = to_d(randn(n, seed)), k = to_d(randn(n, seed + 1)), v = to_d(randn(n, seed + 2)), w = to_d(randn(n, seed + 3));
  Vec dq, dk, dv;
  ref.backward(q, k, v, w, dq, dk, dv);
  auto loss = [&] {
    Vec out, lse;
    ref.forward(q, k, v, out, lse);
    return dot(out, w);
  };
  expect_fd(q, loss, dq, what + " dq");
  expect_fd(k, loss, dk, what + " dk");
  expect_fd(v, loss, dv, what + " dv");
}

TEST(DeviceCpu, AttentionReferenceGradientsMatchFiniteDifferences) {
  for (bool causal : {true, false})
    expect_reference_gradients(AttnRef{2, 5, 2, 3, causal, 0.7}, 20, causal ? "attention (causal)" : "attention (full)");
}

// Runs the device's attention on logical tensors laid out either as packed QKV
// [s, b, 3, heads, hd] with out [s, b, heads*hd + pad], or as [b, s, heads, hd].
struct AttnRun {
  std::vector<float> out, lse, dq, dk, dv, out_raw;
  int64_t out_pad_sentinels_changed = 0;
};

AttnRun run_attention(const Dev& d, const AttnRef& ref, bool packed, const Vec& q, const Vec& k, const Vec& v,
                      const Vec& dout) {
  const int64_t B = ref.B, S = ref.S, H = ref.H, D = ref.D, W = H * D;
  const int64_t pad = 5;
  int64_t qs_b, qs_s, os_b, os_s;
  size_t qkv_elems, out_elems;
  int64_t koff, voff;
  if (packed) {
    qs_b = 3 * W;
    qs_s = B * 3 * W;
    koff = W;
    voff = 2 * W;
    os_b = W + pad;
    os_s = B * (W + pad);
    qkv_elems = static_cast<size_t>(S * B * 3 * W);
    out_elems = static_cast<size_t>(S * B * (W + pad));
  } else {
    qs_b = S * W;
    qs_s = W;
    koff = B * S * W;
    voff = 2 * B * S * W;
    os_b = S * (W + pad);
    os_s = W + pad;
    qkv_elems = static_cast<size_t>(3 * B * S * W);
    out_elems = static_cast<size_t>(B * S * (W + pad));
  }
  auto at = [&](int64_t b, int64_t s, int64_t h, int64_t dd) {
    return static_cast<size_t>(b * qs_b + s * qs_s + h * D + dd);
  };
  auto oat = [&](int64_t b, int64_t s, int64_t h, int64_t dd) {
    return static_cast<size_t>(b * os_b + s * os_s + h * D + dd);
  };
  std::vector<float> qkv(qkv_elems, 0.0f), dov(out_elems, 0.0f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t dd = 0; dd < D; ++dd) {
          qkv[at(b, s, h, dd)] = static_cast<float>(q[ref.idx(b, s, h, dd)]);
          qkv[at(b, s, h, dd) + koff] = static_cast<float>(k[ref.idx(b, s, h, dd)]);
          qkv[at(b, s, h, dd) + voff] = static_cast<float>(v[ref.idx(b, s, h, dd)]);
          dov[oat(b, s, h, dd)] = static_cast<float>(dout[ref.idx(b, s, h, dd)]);
        }
  constexpr float kSentinel = 12345.0f;
  Buf<float> QKV(d, qkv), O(d, out_elems), dO(d, dov), LSE(d, static_cast<size_t>(B * H * S)), dQKV(d, qkv_elems);
  O.fill(kSentinel);
  dQKV.fill(kNaN);  // overwritten, never read
  loom_attention_args a = loom::make<loom_attention_args>();
  a.batch = B;
  a.seq = S;
  a.heads = H;
  a.head_dim = D;
  a.qkv_stride_b = qs_b;
  a.qkv_stride_s = qs_s;
  a.out_stride_b = os_b;
  a.out_stride_s = os_s;
  a.q = QKV.data();
  a.k = QKV.data() + koff;
  a.v = QKV.data() + voff;
  a.out = O.data();
  a.lse = LSE.data();
  a.scale = static_cast<float>(ref.scale);
  a.causal = ref.causal ? 1 : 0;
  a.window = ref.window;
  a.key_start = ref.key_start_or_null();
  d.ops().attention_fwd(a);
  a.dout = dO.data();
  a.dq = dQKV.data();
  a.dk = dQKV.data() + koff;
  a.dv = dQKV.data() + voff;
  d.ops().attention_bwd(a);

  AttnRun r;
  r.out.resize(q.size());
  r.dq.resize(q.size());
  r.dk.resize(q.size());
  r.dv.resize(q.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t dd = 0; dd < D; ++dd) {
          const size_t li = ref.idx(b, s, h, dd);
          r.out[li] = O[oat(b, s, h, dd)];
          r.dq[li] = dQKV[at(b, s, h, dd)];
          r.dk[li] = dQKV[at(b, s, h, dd) + koff];
          r.dv[li] = dQKV[at(b, s, h, dd) + voff];
        }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t p = 0; p < pad; ++p)
        if (O[static_cast<size_t>(b * os_b + s * os_s + W + p)] != kSentinel) ++r.out_pad_sentinels_changed;
  r.lse = LSE.get();
  r.out_raw = O.get();
  return r;
}

TEST(DeviceCpu, AttentionMatchesReferenceForStridedLayouts) {
  for (bool causal : {true, false})
    for (bool packed : {true, false}) {
      AttnRef ref{2, 70, 3, 8, causal, 1.0 / std::sqrt(8.0)};  // 70: two query blocks, one partial
      const size_t n = static_cast<size_t>(2 * 70 * 3 * 8);
      const Vec q = to_d(randn(n, 30, -2, 2)), k = to_d(randn(n, 31, -2, 2)), v = to_d(randn(n, 32)),
                dout = to_d(randn(n, 33));
      Vec out, lse, dq, dk, dv;
      ref.forward(q, k, v, out, lse);
      ref.backward(q, k, v, dout, dq, dk, dv);
      const std::string tag = std::string(causal ? " causal" : " full") + (packed ? " packed-qkv" : " bshd");
      for (const std::string& simd : simd_variants())
        for (int threads : {1, 2}) {
          SCOPED_TRACE("simd " + simd + ", threads " + std::to_string(threads));
          Dev d(threads, "openblas", simd);
          AttnRun r = run_attention(d, ref, packed, q, k, v, dout);
          expect_close(r.out, out, 1e-5, 1e-4, "attention out" + tag);
          expect_close(r.lse, lse, 1e-5, 1e-5, "attention lse" + tag);
          expect_close(r.dq, dq, 2e-5, 1e-4, "attention dq" + tag);
          expect_close(r.dk, dk, 2e-5, 1e-4, "attention dk" + tag);
          expect_close(r.dv, dv, 2e-5, 1e-4, "attention dv" + tag);
          EXPECT_EQ(r.out_pad_sentinels_changed, 0) << "attention wrote into out's row padding" << tag;
        }
    }
}

TEST(DeviceCpu, AttentionIsIndependentOfThreadCount) {
  AttnRef ref{1, 130, 4, 16, true, 0.25};
  const size_t n = static_cast<size_t>(130 * 4 * 16);
  const Vec q = to_d(randn(n, 40)), k = to_d(randn(n, 41)), v = to_d(randn(n, 42)), dout = to_d(randn(n, 43));
  Dev d1(1), d2(2);
  AttnRun a = run_attention(d1, ref, true, q, k, v, dout), b = run_attention(d2, ref, true, q, k, v, dout);
  EXPECT_EQ(a.out_raw, b.out_raw);
  EXPECT_EQ(a.lse, b.lse);
  EXPECT_EQ(a.dq, b.dq);
  EXPECT_EQ(a.dk, b.dk);
  EXPECT_EQ(a.dv, b.dv);
}

// ---------------------------------------------------------------------------
// Cross-entropy
// ---------------------------------------------------------------------------

// Full-vocab reference: loss per row and dlogits = scale * d(loss)/d(logits).
struct XentRef {
  int64_t rows, valid;
  double scale;
  void run(const Vec& logits, int64_t ld, const std::vector<int32_t>& t, Vec& loss, Vec& dlogits) const {
    loss.assign(static_cast<size_t>(rows), 0.0);
    dlogits.assign(logits.size(), 0.0);
    for (int64_t r = 0; r < rows; ++r) {
      if (t[r] < 0) continue;
      double m = -1e300, z = 0;
      for (int64_t c = 0; c < valid; ++c) m = std::max(m, logits[r * ld + c]);
      for (int64_t c = 0; c < valid; ++c) z += std::exp(logits[r * ld + c] - m);
      loss[r] = std::log(z) + m - logits[r * ld + t[r]];
      for (int64_t c = 0; c < valid; ++c)
        dlogits[r * ld + c] = scale * (std::exp(logits[r * ld + c] - m) / z - (c == t[r] ? 1.0 : 0.0));
    }
  }
};

struct XentBufs {
  Buf<float> row_max, sumexp, tlogit, loss;
  XentBufs(const Dev& d, int64_t rows) : row_max(d, rows), sumexp(d, rows), tlogit(d, rows), loss(d, rows) {}
};

loom_xent_args xent_args(int32_t step, int64_t rows, int64_t cols, int64_t ld, int64_t valid, int64_t vstart,
                         const float* logits, const int32_t* targets, XentBufs& b, float* dlogits, float scale) {
  loom_xent_args a = loom::make<loom_xent_args>();
  a.step = step;
  a.rows = rows;
  a.cols = cols;
  a.ld = ld;
  a.valid_cols = valid;
  a.vocab_start = vstart;
  a.logits = logits;
  a.targets = targets;
  a.row_max = b.row_max.data();
  a.row_sumexp = b.sumexp.data();
  a.target_logit = b.tlogit.data();
  a.loss = b.loss.data();
  a.dlogits = dlogits;
  a.scale = scale;
  return a;
}

TEST(DeviceCpu, XentReferenceGradientMatchesFiniteDifferences) {
  const int64_t rows = 4, valid = 6, ld = 8;  // two padding columns
  const std::vector<int32_t> t{2, -1, 5, 0};
  XentRef ref{rows, valid, 0.5};
  Vec logits = to_d(randn(rows * ld, 50, -3, 3));
  Vec loss, dl;
  ref.run(logits, ld, t, loss, dl);
  auto f = [&] {
    Vec l, g;
    ref.run(logits, ld, t, l, g);
    double s = 0;
    for (double x : l) s += x;
    return ref.scale * s;
  };
  expect_fd(logits, f, dl, "xent dlogits");
}

TEST(DeviceCpu, XentFullChainMatchesReferenceWithPaddingAndIgnoredRows) {
  for (const std::string& simd : simd_variants()) {
    SCOPED_TRACE("simd " + simd);
    Dev d(2, "openblas", simd);
    const int64_t rows = 9, cols = 12, valid = 10, ld = 13;
    const std::vector<int32_t> tv{3, -1, 9, 0, 7, -100, 1, 9, 4};
    std::vector<float> lv = randn(rows * ld, 60, -4, 4);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = valid; c < ld; ++c) lv[r * ld + c] = 1e4f;  // padding and gaps: must never count
    Buf<float> logits(d, lv), dlogits(d, rows * ld);
    Buf<int32_t> targets(d, tv);
    dlogits.fill(-7.0f);
    XentBufs b(d, rows);
    const float scale = 1.0f / 7.0f;
    for (int32_t step : {LOOM_XENT_ROW_MAX, LOOM_XENT_SUMEXP, LOOM_XENT_LOSS, LOOM_XENT_BACKWARD})
      d.ops().xent(xent_args(step, rows, cols, ld, valid, 0, logits.data(), targets.data(), b, dlogits.data(), scale));
    XentRef ref{rows, valid, scale};
    Vec loss, dl;
    ref.run(to_d(lv), ld, tv, loss, dl);
    expect_close(b.loss.get(), loss, 1e-5, 1e-5, "xent loss");
    std::vector<float> got = dlogits.get();
    for (int64_t r = 0; r < rows; ++r) {  // the ld gap (column 12) is not ours: untouched
      EXPECT_EQ(got[r * ld + 12], -7.0f);
      got[r * ld + 12] = 0.0f;
    }
    expect_close(got, dl, 1e-6, 1e-5, "xent dlogits");
    // In place: dlogits over the logits.
    for (int32_t step : {LOOM_XENT_ROW_MAX, LOOM_XENT_SUMEXP, LOOM_XENT_LOSS, LOOM_XENT_BACKWARD})
      d.ops().xent(xent_args(step, rows, cols, ld, valid, 0, logits.data(), targets.data(), b, logits.data(), scale));
    std::vector<float> inplace = logits.get();
    for (int64_t r = 0; r < rows; ++r) inplace[r * ld + 12] = 0.0f;
    expect_close(inplace, dl, 1e-6, 1e-5, "xent dlogits in place");
  }
}

TEST(DeviceCpu, XentVocabSplitHalvesCombineToTheFullResult) {
  Dev d(2);
  const int64_t rows = 8, cols = 12, valid = 10, half = 6, ld = 12;
  const std::vector<int32_t> tv{0, 5, 6, 9, -1, 3, 7, 8};
  const std::vector<float> lv = randn(rows * ld, 70, -5, 5);
  Buf<int32_t> targets(d, tv);
  const float scale = 0.25f;
  // The whole vocab at once.
  Buf<float> logits(d, lv), full_d(d, rows * ld);
  XentBufs full(d, rows);
  for (int32_t step : {LOOM_XENT_ROW_MAX, LOOM_XENT_SUMEXP, LOOM_XENT_LOSS, LOOM_XENT_BACKWARD})
    d.ops().xent(xent_args(step, rows, cols, ld, valid, 0, logits.data(), targets.data(), full, full_d.data(), scale));
  // Two slices, [0, 6) and [6, 12) of which 4 columns are real, each with local partials.
  Buf<float> split_d(d, rows * ld);
  XentBufs p0(d, rows), p1(d, rows);
  XentBufs* parts[2] = {&p0, &p1};
  const int64_t starts[2] = {0, half}, valids[2] = {half, valid - half};
  for (int s = 0; s < 2; ++s) {
    const float* l = logits.data() + starts[s];
    d.ops().xent(xent_args(LOOM_XENT_ROW_MAX, rows, half, ld, valids[s], starts[s], l, targets.data(), *parts[s],
                           nullptr, scale));
    d.ops().xent(xent_args(LOOM_XENT_SUMEXP, rows, half, ld, valids[s], starts[s], l, targets.data(), *parts[s],
                           nullptr, scale));
  }
  // Combine as a vocab-parallel all-reduce would: max of maxes, sumexp rescaled,
  // target logits summed (exactly one slice holds each target).
  XentBufs comb(d, rows);
  for (int64_t r = 0; r < rows; ++r) {
    const float m = std::max(p0.row_max[r], p1.row_max[r]);
    comb.row_max[r] = m;
    comb.sumexp[r] = static_cast<float>(p0.sumexp[r] * std::exp(double(p0.row_max[r]) - m) +
                                        p1.sumexp[r] * std::exp(double(p1.row_max[r]) - m));
    comb.tlogit[r] = p0.tlogit[r] + p1.tlogit[r];
  }
  d.ops().xent(xent_args(LOOM_XENT_LOSS, rows, half, ld, half, 0, logits.data(), targets.data(), comb, nullptr, scale));
  for (int s = 0; s < 2; ++s)
    d.ops().xent(xent_args(LOOM_XENT_BACKWARD, rows, half, ld, valids[s], starts[s], logits.data() + starts[s],
                           targets.data(), comb, split_d.data() + starts[s], scale));
  expect_close(comb.loss.get(), to_d(full.loss.get()), 1e-5, 1e-5, "split xent loss");
  expect_close(split_d.get(), to_d(full_d.get()), 1e-6, 1e-5, "split xent dlogits");
  for (int64_t r = 0; r < rows; ++r) {
    if (tv[r] < 0) {
      EXPECT_EQ(comb.loss[r], 0.0f);
    }
    for (int64_t c = valid; c < cols; ++c) EXPECT_EQ(split_d[r * ld + c], 0.0f) << "padding column got gradient";
  }
}

TEST(DeviceCpu, XentRejectsATargetInThePadding) {
  Dev d;
  Buf<float> logits(d, randn(8, 1));
  Buf<int32_t> targets(d, std::vector<int32_t>{1, 7});
  XentBufs b(d, 2);
  loom_xent_args a = xent_args(LOOM_XENT_SUMEXP, 2, 4, 4, 3, 4, logits.data(), targets.data(), b, nullptr, 1.0f);
  b.row_max.fill(0.0f);
  StatusInfo s = take(d.api()->ops->xent(d.raw(), nullptr, &a));
  EXPECT_EQ(s.code, LOOM_CODE_INVALID_ARGUMENT);
  EXPECT_NE(s.message.find("padding"), std::string::npos) << s.message;
}

// ---------------------------------------------------------------------------
// Embedding
// ---------------------------------------------------------------------------

TEST(DeviceCpu, EmbeddingSlicesMatchReferenceAndFiniteDifferences) {
  const int64_t vocab = 10, dim = 5, n = 12, split = 6;
  const std::vector<int32_t> ids{0, 3, 9, 3, 6, 5, 6, 6, 1, 9, 2, 7};
  const std::vector<float> tv = randn(vocab * dim, 80), wv = randn(n * dim, 81);
  // Reference: out = table[ids]; d(sum out o w)/d table = scatter-add of w, checked by FD.
  Vec table = to_d(tv);
  auto fwd = [&](const Vec& t) {
    Vec out(static_cast<size_t>(n * dim));
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < dim; ++c) out[i * dim + c] = t[ids[i] * dim + c];
    return out;
  };
  Vec dtable(static_cast<size_t>(vocab * dim), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < dim; ++c) dtable[ids[i] * dim + c] += wv[i * dim + c];
  expect_fd(
      table, [&] { return dot(fwd(table), to_d(wv)); }, dtable, "embedding dtable");

  Dev d(2);
  Buf<int32_t> I(d, ids);
  Buf<float> T(d, tv), out(d, n * dim), out0(d, n * dim), dout(d, wv), dT(d, vocab * dim);
  out0.fill(kNaN);
  auto args = [&](int64_t start, int64_t rows) {
    loom_embedding_args a = loom::make<loom_embedding_args>();
    a.n = n;
    a.dim = dim;
    a.vocab_rows = rows;
    a.vocab_start = start;
    a.ids = I.data();
    a.table = T.data() + start * dim;
    a.dout = dout.data();
    a.dtable = dT.data() + start * dim;
    return a;
  };
  // Slice 0 alone: ids outside it give zero rows.
  loom_embedding_args a0 = args(0, split);
  a0.out = out0.data();
  d.ops().embedding_fwd(a0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < dim; ++c) EXPECT_EQ(out0[i * dim + c], ids[i] < split ? tv[ids[i] * dim + c] : 0.0f) << i;
  // Slice 0 then slice 1 accumulated = the full lookup.
  a0.out = out.data();
  d.ops().embedding_fwd(a0);
  loom_embedding_args a1 = args(split, vocab - split);
  a1.out = out.data();
  a1.accumulate = 1;
  d.ops().embedding_fwd(a1);
  expect_close(out.get(), fwd(to_d(tv)), 0, 0, "embedding forward over two slices");
  // Backward per slice accumulates into its own rows; repeated ids add up.
  const std::vector<float> dt0 = randn(vocab * dim, 82);
  dT.set(dt0);
  d.ops().embedding_bwd(args(0, split));
  d.ops().embedding_bwd(args(split, vocab - split));
  Vec want(dtable);
  for (size_t i = 0; i < want.size(); ++i) want[i] += dt0[i];
  expect_close(dT.get(), want, 1e-6, 1e-6, "embedding backward over two slices");
}

// ---------------------------------------------------------------------------
// Element-wise
// ---------------------------------------------------------------------------

loom_elementwise_args ew(int32_t op, int64_t n, const void* x, void* y, void* out) {
  loom_elementwise_args a = loom::make<loom_elementwise_args>();
  a.op = op;
  a.n = n;
  a.x = x;
  a.y = y;
  a.out = out;
  return a;
}

TEST(DeviceCpu, ElementwiseArithmetic) {
  Dev d(2);
  const size_t n = 70001;
  const std::vector<float> xv = randn(n, 90), yv = randn(n, 91);
  Buf<float> x(d, xv), y(d, yv), out(d, n);
  auto a = ew(LOOM_EW_ADD, n, x.data(), y.data(), out.data());
  d.ops().elementwise(a);
  Vec want(n);
  for (size_t i = 0; i < n; ++i) want[i] = double(xv[i]) + yv[i];
  expect_close(out.get(), want, 1e-7, 1e-7, "add");
  a.op = LOOM_EW_MUL;
  d.ops().elementwise(a);
  for (size_t i = 0; i < n; ++i) want[i] = double(xv[i]) * yv[i];
  expect_close(out.get(), want, 1e-7, 1e-7, "mul");
  a.op = LOOM_EW_SCALE;
  a.alpha = -3.0f;
  d.ops().elementwise(a);
  for (size_t i = 0; i < n; ++i) want[i] = -3.0 * xv[i];
  expect_close(out.get(), want, 1e-7, 1e-7, "scale");
  a.op = LOOM_EW_FILL;
  a.alpha = 2.5f;
  d.ops().elementwise(a);
  expect_close(out.get(), Vec(n, 2.5), 0, 0, "fill");
  a.op = LOOM_EW_AXPBY;
  a.alpha = 2.0f;
  a.beta = 0.5f;
  d.ops().elementwise(a);
  for (size_t i = 0; i < n; ++i) want[i] = 2.0 * xv[i] + 0.5 * yv[i];
  expect_close(y.get(), want, 1e-6, 1e-6, "axpby");
  y.fill(kNaN);
  a.beta = 0.0f;  // beta = 0 ignores y
  d.ops().elementwise(a);
  for (size_t i = 0; i < n; ++i) want[i] = 2.0 * xv[i];
  expect_close(y.get(), want, 1e-7, 1e-7, "axpby beta=0");
  // ADD_BIAS over [rows, cols].
  const int64_t rows = 300, cols = 233;
  const std::vector<float> mv = randn(rows * cols, 92), bv = randn(cols, 93);
  Buf<float> m(d, mv), bias(d, bv), mo(d, rows * cols);
  auto ab = ew(LOOM_EW_ADD_BIAS, rows * cols, m.data(), bias.data(), mo.data());
  ab.cols = cols;
  d.ops().elementwise(ab);
  Vec wb(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) wb[r * cols + c] = double(mv[r * cols + c]) + bv[c];
  expect_close(mo.get(), wb, 1e-7, 1e-7, "add_bias");
  ab.cols = 7;  // n is no multiple of 7
  EXPECT_EQ(take(d.api()->ops->elementwise(d.raw(), nullptr, &ab)).code, LOOM_CODE_INVALID_ARGUMENT);
}

TEST(DeviceCpu, CastRoundTripsThroughBf16WithRoundToNearestEven) {
  Dev d(2);
  std::vector<float> xv = randn(50000, 100, -1000.0f, 1000.0f);
  const float specials[] = {0.0f,
                            -0.0f,
                            1.0f,
                            1.0f + 0x1p-8f,
                            1.0f + 3 * 0x1p-8f,
                            1.0f + 0x1p-9f,
                            -(1.0f + 0x1p-8f),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::max(),
                            1e-40f,
                            3.0e38f};
  for (size_t i = 0; i < std::size(specials); ++i) xv[i] = specials[i];
  xv[std::size(specials)] = kNaN;
  const size_t n = xv.size();
  Buf<float> x(d, xv), back(d, n);
  Buf<uint16_t> h(d, n);
  auto a = ew(LOOM_EW_CAST, static_cast<int64_t>(n), x.data(), nullptr, h.data());
  a.dtype = LOOM_DTYPE_F32;
  a.out_dtype = LOOM_DTYPE_BF16;
  d.ops().elementwise(a);
  a = ew(LOOM_EW_CAST, static_cast<int64_t>(n), h.data(), nullptr, back.data());
  a.dtype = LOOM_DTYPE_BF16;
  a.out_dtype = LOOM_DTYPE_F32;
  d.ops().elementwise(a);
  for (size_t i = 0; i < n; ++i) {
    const float want = bf16_round_ref(xv[i]);
    if (std::isnan(xv[i])) {
      EXPECT_TRUE(std::isnan(back[i]));
      continue;
    }
    ASSERT_EQ(std::memcmp(&back[i], &want, 4), 0) << "cast of " << xv[i] << " gave " << back[i] << ", want " << want;
  }
  EXPECT_EQ(back[3], 1.0f);                                    // tie 1 + 2^-8 rounds to even (down)
  EXPECT_EQ(back[4], 1.0f + 0x1p-6f);                          // tie 1 + 3*2^-8 rounds to even (up)
  EXPECT_EQ(back[9], std::numeric_limits<float>::infinity());  // FLT_MAX rounds up past the bf16 range
  // A bf16 value survives bf16 -> f32 -> bf16 exactly.
  Buf<uint16_t> h2(d, n);
  a = ew(LOOM_EW_CAST, static_cast<int64_t>(n), back.data(), nullptr, h2.data());
  a.dtype = LOOM_DTYPE_F32;
  a.out_dtype = LOOM_DTYPE_BF16;
  d.ops().elementwise(a);
  for (size_t i = 0; i < n; ++i)
    if (!std::isnan(xv[i])) {
      ASSERT_EQ(h2[i], h[i]) << i;
    }
  // Other casts are reported as unsupported, naming both types.
  a.out_dtype = LOOM_DTYPE_F16;
  StatusInfo s = take(d.api()->ops->elementwise(d.raw(), nullptr, &a));
  EXPECT_EQ(s.code, LOOM_CODE_UNSUPPORTED);
  EXPECT_NE(s.message.find("f16"), std::string::npos) << s.message;
}

TEST(DeviceCpu, DropoutMaskIsDeterministicSeededAndKeepsOneMinusP) {
  const size_t n = 200000;
  const float p = 0.3f;
  const std::vector<float> xv = randn(n, 110);
  auto run = [&](int threads, uint64_t seed, uint64_t offset, std::vector<float>* out_vals) {
    Dev d(threads);
    Buf<float> x(d, xv), out(d, n);
    Buf<uint8_t> mask(d, n);
    auto a = ew(LOOM_EW_DROPOUT, static_cast<int64_t>(n), x.data(), mask.data(), out.data());
    a.p = p;
    a.seed = seed;
    a.offset = offset;
    d.ops().elementwise(a);
    if (out_vals) *out_vals = out.get();
    return mask.get();
  };
  std::vector<float> out;
  const std::vector<uint8_t> m1 = run(2, 42, 0, &out);
  EXPECT_EQ(run(2, 42, 0, nullptr), m1) << "same seed, same mask";
  EXPECT_EQ(run(1, 42, 0, nullptr), m1) << "the mask must not depend on the thread count";
  const std::vector<uint8_t> m2 = run(2, 43, 0, nullptr);
  size_t differ = 0, kept = 0;
  for (size_t i = 0; i < n; ++i) {
    differ += m1[i] != m2[i];
    kept += m1[i];
    ASSERT_TRUE(m1[i] == 0 || m1[i] == 1);
    ASSERT_FLOAT_EQ(out[i], m1[i] ? xv[i] / (1.0f - p) : 0.0f) << i;
  }
  EXPECT_GT(differ, n / 5) << "a different seed must give a different mask";
  EXPECT_NEAR(static_cast<double>(kept) / n, 1.0 - p, 0.01);
  // The mask is a function of (seed, offset + i): an offset shifts it.
  const std::vector<uint8_t> m3 = run(2, 42, 1000, nullptr);
  for (size_t i = 0; i + 1000 < n; ++i) ASSERT_EQ(m3[i], m1[i + 1000]) << i;
  // Backward reuses the saved mask.
  Dev d(2);
  const std::vector<float> gv = randn(n, 111);
  Buf<float> g(d, gv), dx(d, n);
  Buf<uint8_t> mask(d, m1);
  auto a = ew(LOOM_EW_DROPOUT_BWD, static_cast<int64_t>(n), g.data(), mask.data(), dx.data());
  a.p = p;
  d.ops().elementwise(a);
  for (size_t i = 0; i < n; ++i) ASSERT_FLOAT_EQ(dx[i], m1[i] ? gv[i] / (1.0f - p) : 0.0f) << i;
}

// ABI 1.3 seed_device: the stream's seed is loom_mix64(seed ^ loom_mix64(*seed_device)),
// read when the launch runs: a captured dropout replayed after the value changed
// draws the mask of the new value, equal to the host-seeded launch of that seed.
TEST(DeviceCpu, DropoutReadsSeedDeviceWhenItRunsAlsoOnReplay) {
  Dev d(1);
  EXPECT_NE(d.api()->features & LOOM_DEVICE_SEED_DEVICE, 0u);
  const int64_t n = 4096;
  const float p = 0.5f;
  Buf<float> x(d, randn(n, 112)), out(d, n);
  Buf<uint8_t> mask(d, n);
  Buf<uint64_t> step_seed(d, 1);
  const uint64_t key = 0x1234;
  auto host_seeded = [&](uint64_t value) {
    auto a = ew(LOOM_EW_DROPOUT, n, x.data(), mask.data(), out.data());
    a.p = p;
    a.seed = loom_mix64(key ^ loom_mix64(value));
    d.ops().elementwise(a);
    return mask.get();
  };
  const std::vector<uint8_t> m5 = host_seeded(5), m6 = host_seeded(6);
  ASSERT_NE(m5, m6);

  auto a = ew(LOOM_EW_DROPOUT, n, x.data(), mask.data(), out.data());
  a.p = p;
  a.seed = key;
  a.seed_device = step_seed.data();
  loom::check(d.api()->capture_begin(d.raw(), nullptr));
  d.ops().elementwise(a);
  loom_graph* g = nullptr;
  loom::check(d.api()->capture_end(d.raw(), nullptr, &g));
  step_seed[0] = 5;
  loom::check(d.api()->graph_replay(d.raw(), g, nullptr));
  EXPECT_EQ(mask.get(), m5);
  step_seed[0] = 6;
  loom::check(d.api()->graph_replay(d.raw(), g, nullptr));
  EXPECT_EQ(mask.get(), m6);
  d.api()->graph_destroy(d.raw(), g);
}

// ---------------------------------------------------------------------------
// Reductions
// ---------------------------------------------------------------------------

float reduce1(const Dev& d, int32_t op, const Buf<float>& x, float start = 0.0f, int32_t accumulate = 0) {
  Buf<float> out(d, 1);
  out[0] = start;
  loom_reduce_args a = loom::make<loom_reduce_args>();
  a.op = op;
  a.n = static_cast<int64_t>(x.size());
  a.x = x.data();
  a.out = out.data();
  a.accumulate = accumulate;
  d.ops().reduce(a);
  return out[0];
}

TEST(DeviceCpu, ReductionsAreAccurateAndDeterministic) {
  const size_t n = 1000003;
  std::vector<float> xv = randn(n, 120, -1.0f, 1.0f);
  for (size_t i = 0; i < n; i += 97) xv[i] *= 1000.0f;  // a wide dynamic range
  double sum = 0, sq = 0, mx = 0;
  for (float v : xv) {
    sum += v;
    sq += double(v) * v;
    mx = std::max(mx, std::fabs(double(v)));
  }
  Dev d1(1), d2(2);
  Buf<float> x1(d1, xv), x2(d2, xv);
  for (int32_t op : {LOOM_RED_SUM, LOOM_RED_SUM_SQUARES, LOOM_RED_MAX_ABS}) {
    const float r = reduce1(d2, op, x2);
    const double want = op == LOOM_RED_SUM ? sum : op == LOOM_RED_SUM_SQUARES ? sq : mx;
    EXPECT_NEAR(r, want, 1e-6 * std::fabs(want) + 1e-6) << "op " << op;
    for (int rep = 0; rep < 3; ++rep) EXPECT_EQ(reduce1(d2, op, x2), r) << "op " << op << " is not deterministic";
    EXPECT_EQ(reduce1(d1, op, x1), r) << "op " << op << " depends on the thread count";
  }
  EXPECT_FLOAT_EQ(reduce1(d2, LOOM_RED_SUM, x2, 10.0f, 1), static_cast<float>(10.0f + static_cast<float>(sum)));
  EXPECT_EQ(reduce1(d2, LOOM_RED_MAX_ABS, x2, 1e9f, 1), 1e9f);  // a running maximum keeps the larger
  x2[12345] = kNaN;
  EXPECT_TRUE(std::isnan(reduce1(d2, LOOM_RED_MAX_ABS, x2))) << "NaN must reach overflow checks";
  EXPECT_TRUE(std::isnan(reduce1(d2, LOOM_RED_SUM_SQUARES, x2)));
}

TEST(DeviceCpu, ColumnSumAccumulates) {
  Dev d(2);
  const int64_t rows = 513, cols = 300;
  const std::vector<float> xv = randn(rows * cols, 130), o0 = randn(cols, 131);
  Buf<float> x(d, xv), out(d, o0);
  loom_reduce_args a = loom::make<loom_reduce_args>();
  a.op = LOOM_RED_COLUMN_SUM;
  a.n = rows * cols;
  a.cols = cols;
  a.x = x.data();
  a.out = out.data();
  a.accumulate = 1;
  d.ops().reduce(a);
  Vec want(o0.begin(), o0.end());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) want[c] += xv[r * cols + c];
  expect_close(out.get(), want, 1e-5, 1e-6, "column sum (accumulate)");
  a.accumulate = 0;
  d.ops().reduce(a);
  for (int64_t c = 0; c < cols; ++c) want[c] -= o0[c];
  expect_close(out.get(), want, 1e-5, 1e-6, "column sum");
}

// ---------------------------------------------------------------------------
// AdamW
// ---------------------------------------------------------------------------

TEST(DeviceCpu, AdamwStepMatchesTheFormula) {
  for (const std::string& simd : simd_variants()) {
    SCOPED_TRACE("simd " + simd);
    Dev d(2, "openblas", simd);
    const size_t n = 40000;
    const std::vector<float> pv = randn(n, 140), gv = randn(n, 141), mv = randn(n, 142, -0.1f, 0.1f),
                             vv = randn(n, 143, 0.0f, 0.01f);
    Buf<float> p(d, pv), g(d, gv), m(d, mv), v(d, vv);
    Buf<uint16_t> copy(d, n);
    loom_adamw_args a = loom::make<loom_adamw_args>();
    a.n = static_cast<int64_t>(n);
    a.param = p.data();
    a.grad = g.data();
    a.m = m.data();
    a.v = v.data();
    a.grad_dtype = LOOM_DTYPE_F32;
    a.lr = 1e-2f;
    a.beta1 = 0.9f;
    a.beta2 = 0.95f;
    a.eps = 1e-8f;
    a.weight_decay = 0.1f;
    a.grad_scale = 0.5f;
    a.step = 3;
    a.param_copy = copy.data();
    a.copy_dtype = LOOM_DTYPE_BF16;
    d.ops().adamw(a);
    Vec wp(n), wm(n), wv(n);
    const double b1 = 0.9f, b2 = 0.95f;
    for (size_t i = 0; i < n; ++i) {
      const double gr = double(gv[i]) * 0.5;
      wm[i] = b1 * mv[i] + (1 - b1) * gr;
      wv[i] = b2 * vv[i] + (1 - b2) * gr * gr;
      const double mh = wm[i] / (1 - std::pow(b1, 3)), vh = wv[i] / (1 - std::pow(b2, 3));
      wp[i] = pv[i] - double(1e-2f) * (mh / (std::sqrt(vh) + double(1e-8f)) + double(0.1f) * pv[i]);
    }
    expect_close(m.get(), wm, 1e-7, 1e-5, "adamw m");
    expect_close(v.get(), wv, 1e-9, 1e-5, "adamw v");
    expect_close(p.get(), wp, 1e-6, 1e-5, "adamw param");
    for (size_t i = 0; i < n; ++i) {
      const float want = bf16_round_ref(p[i]);
      uint32_t bits;
      std::memcpy(&bits, &want, 4);
      ASSERT_EQ(copy[i], bits >> 16) << "param_copy (bf16) of " << p[i];
    }
  }
}

// ABI 1.8 multi-tensor calls: one adamw over segments at different offsets of each
// buffer (master weights, moments, gradients, bf16 copy), and one SUM / SUM_SQUARES /
// MAX_ABS with an out per segment, give the bits of a call per segment; a segment with
// a negative numel is an error naming it.
TEST(DeviceCpu, MultiTensorCallsEqualOneCallPerSegment) {
  Dev d(2);
  ASSERT_NE(d.api()->features & LOOM_DEVICE_MULTI_TENSOR, 0u);
  const std::vector<loom_adamw_segment> segs = {
      {0, 100, 7, 30, 1000, 0.1f, 0}, {1000, 1100, 1500, 1040, 3, 0.0f, 0}, {1003, 0, 2000, 3000, 97, 0.1f, 0}};
  const size_t n = 4000;
  for (int32_t grad_dtype : {LOOM_DTYPE_F32, LOOM_DTYPE_BF16}) {
    SCOPED_TRACE(grad_dtype == LOOM_DTYPE_BF16 ? "bf16 gradients" : "fp32 gradients");
    const std::vector<float> pv = randn(n, 160), mv = randn(n, 162, -0.1f, 0.1f), vv = randn(n, 163, 0.0f, 0.01f);
    const std::vector<float> gv = randn(n, 161);
    std::vector<uint16_t> gb(n);
    for (size_t i = 0; i < n; ++i) {  // the gradients truncated to bf16
      uint32_t bits;
      std::memcpy(&bits, &gv[i], 4);
      gb[i] = static_cast<uint16_t>(bits >> 16);
    }
    Buf<float> g(d, gv);
    Buf<uint16_t> g16(d, gb);
    const void* grad = grad_dtype == LOOM_DTYPE_BF16 ? static_cast<const void*>(g16.data()) : g.data();
    auto args = [&](float* p, float* m, float* v, uint16_t* copy) {
      loom_adamw_args a = loom::make<loom_adamw_args>();
      a.param = p;
      a.grad = grad;
      a.m = m;
      a.v = v;
      a.grad_dtype = grad_dtype;
      a.lr = 1e-2f;
      a.beta1 = 0.9f;
      a.beta2 = 0.95f;
      a.eps = 1e-8f;
      a.grad_scale = 0.5f;
      a.step = 3;
      a.param_copy = copy;
      a.copy_dtype = LOOM_DTYPE_BF16;
      return a;
    };
    Buf<float> p1(d, pv), m1(d, mv), v1(d, vv), p2(d, pv), m2(d, mv), v2(d, vv);
    Buf<uint16_t> c1(d, n), c2(d, n);
    c1.fill(7);
    c2.fill(7);
    for (const loom_adamw_segment& sg : segs) {  // one call a segment
      loom_adamw_args a = args(p1.data() + sg.param_offset, m1.data() + sg.state_offset, v1.data() + sg.state_offset,
                               c1.data() + sg.copy_offset);
      a.grad = static_cast<const char*>(grad) + sg.grad_offset * (grad_dtype == LOOM_DTYPE_BF16 ? 2 : 4);
      a.n = sg.numel;
      a.weight_decay = sg.weight_decay;
      d.ops().adamw(a);
    }
    loom_adamw_args multi = args(p2.data(), m2.data(), v2.data(), c2.data());
    multi.n = 12345;              // ignored
    multi.weight_decay = 123.0f;  // ignored
    multi.num_segments = static_cast<int64_t>(segs.size());
    multi.segments = segs.data();
    d.ops().adamw(multi);
    EXPECT_TRUE(p1.get() == p2.get() && m1.get() == m2.get() && v1.get() == v2.get() && c1.get() == c2.get())
        << "the multi-tensor adamw differs from one call per segment";
  }

  const std::vector<float> xv = randn(n, 170);
  Buf<float> x(d, xv);
  const std::vector<loom_reduce_segment> rsegs = {{0, 1000}, {5, 0}, {1000, 3}, {2500, 1500}};
  for (int32_t op : {LOOM_RED_SUM, LOOM_RED_SUM_SQUARES, LOOM_RED_MAX_ABS}) {
    Buf<float> one(d, rsegs.size()), multi(d, rsegs.size());
    one.fill(2.0f);
    multi.fill(2.0f);
    for (size_t i = 0; i < rsegs.size(); ++i) {
      loom_reduce_args r = loom::make<loom_reduce_args>();
      r.op = op;
      r.n = rsegs[i].numel;
      r.x = x.data() + rsegs[i].offset;
      r.out = one.data() + i;
      r.accumulate = 1;
      r.dtype = r.out_dtype = LOOM_DTYPE_F32;
      d.ops().reduce(r);
    }
    loom_reduce_args r = loom::make<loom_reduce_args>();
    r.op = op;
    r.x = x.data();
    r.out = multi.data();
    r.accumulate = 1;
    r.dtype = r.out_dtype = LOOM_DTYPE_F32;
    r.num_segments = static_cast<int64_t>(rsegs.size());
    r.segments = rsegs.data();
    d.ops().reduce(r);
    EXPECT_EQ(one.get(), multi.get()) << "reduce op " << op;
  }

  const loom_reduce_segment bad[] = {{0, 10}, {10, -1}};
  Buf<float> out(d, 2);
  loom_reduce_args r = loom::make<loom_reduce_args>();
  r.op = LOOM_RED_SUM;
  r.x = x.data();
  r.out = out.data();
  r.dtype = r.out_dtype = LOOM_DTYPE_F32;
  r.num_segments = 2;
  r.segments = bad;
  const StatusInfo st = take(d.api()->ops->reduce(d.raw(), nullptr, &r));
  EXPECT_EQ(st.code, LOOM_CODE_INVALID_ARGUMENT) << st.message;
  EXPECT_NE(st.message.find("segment 1"), std::string::npos) << st.message;
  r.op = LOOM_RED_COLUMN_SUM;
  r.cols = 1;
  r.segments = bad;
  const StatusInfo col = take(d.api()->ops->reduce(d.raw(), nullptr, &r));
  EXPECT_NE(col.message.find("segments are for SUM"), std::string::npos) << col.message;
}

// An optimizer strategy's MultiTensorStep is off on a device without the 1.8 bit (an
// older device plugin), so ddp and distributed call the ops tensor by tensor there.
TEST(DeviceCpu, MultiTensorStepIsOffWithoutTheDeviceBit) {
  Dev d(2);
  loom_device_api old_table = *d.api();
  old_table.features &= ~LOOM_DEVICE_MULTI_TENSOR;
  const loom::MultiTensorStep off(nullptr, loom::Device(&old_table, d.raw(), nullptr), {{0, 4}},
                                  {{0, 0, 0, 0, 4, 0.0f, 0}}, {true});
  EXPECT_FALSE(off.enabled());
}

// ---------------------------------------------------------------------------
// Graphs
// ---------------------------------------------------------------------------

TEST(DeviceCpu, GraphRecordsLaunchesAndReplaysThemOnTheSameAddresses) {
  Dev d(2);
  const loom_device_api* api = d.api();
  const int64_t n = 64;
  Buf<float> x(d, n), w(d, n * n), y(d, n), z(d, n), total(d, 1);
  std::vector<float> xv = randn(n, 150);
  const std::vector<float> wv = randn(n * n, 151);
  x.set(xv);
  w.set(wv);
  y.fill(-1.0f);
  z.fill(-1.0f);
  total.fill(-1.0f);
  int host_counter = 0;

  loom::check(api->capture_begin(d.raw(), nullptr));
  // y = W x (gemm), then y *= 2 (the args struct is changed after the launch:
  // the graph must have copied it), z = y (copy), total = sum(z).
  loom_gemm_args g = loom::make<loom_gemm_args>();
  g.m = n;
  g.n = 1;
  g.k = n;
  g.a = w.data();
  g.lda = n;
  g.b = x.data();
  g.ldb = 1;
  g.c = y.data();
  g.ldc = 1;
  g.batch = 1;
  g.alpha = 1.0f;
  loom::check(api->ops->gemm(d.raw(), nullptr, &g));
  host_counter++;
  loom_elementwise_args s = ew(LOOM_EW_SCALE, n, y.data(), nullptr, y.data());
  s.alpha = 2.0f;
  loom::check(api->ops->elementwise(d.raw(), nullptr, &s));
  s.alpha = 1000.0f;
  loom::check(api->copy(d.raw(), nullptr, z.data(), y.data(), n * sizeof(float), LOOM_COPY_DEVICE_TO_DEVICE));
  loom_reduce_args r = loom::make<loom_reduce_args>();
  r.op = LOOM_RED_SUM;
  r.n = n;
  r.x = z.data();
  r.out = total.data();
  loom::check(api->ops->reduce(d.raw(), nullptr, &r));
  host_counter++;
  loom_graph* graph = nullptr;
  loom::check(api->capture_end(d.raw(), nullptr, &graph));
  ASSERT_NE(graph, nullptr);

  // Nothing ran during capture.
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(y[i], -1.0f);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(z[i], -1.0f);
  EXPECT_EQ(total[0], -1.0f);
  EXPECT_EQ(host_counter, 2);

  auto expect_result = [&](const std::vector<float>& xs, const std::string& what) {
    Vec want(static_cast<size_t>(n));
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      double acc = 0;
      for (int64_t k = 0; k < n; ++k) acc += double(wv[i * n + k]) * xs[k];
      want[i] = 2 * acc;
      sum += want[i];
    }
    expect_close(y.get(), want, 1e-4, 1e-5, what + " y");
    expect_close(z.get(), want, 1e-4, 1e-5, what + " z");
    EXPECT_NEAR(total[0], sum, 1e-3) << what;
  };
  loom::check(api->graph_replay(d.raw(), graph, nullptr));
  expect_result(xv, "replay 1");
  EXPECT_EQ(host_counter, 2) << "replay must not re-run host code";

  // New input contents, same addresses: replay computes with them.
  xv = randn(n, 152);
  x.set(xv);
  loom::check(api->graph_replay(d.raw(), graph, nullptr));
  expect_result(xv, "replay 2");
  EXPECT_EQ(host_counter, 2);
  api->graph_destroy(d.raw(), graph);
}

// memory_mb limits the memory in use, what the memory plan counts (a block a graph
// keeps for its replays is not in use), and two threads cannot both pass it.
TEST(DeviceCpu, MemoryMbLimitsMemoryInUseAcrossThreads) {
  const loom::plugins::LoadedPlugin& plugin = cpu_plugin();
  toml::table section{{"memory_mb", 1}};
  loom::plugins::OptionValues opts(&section, plugin.options);
  loom_device_create_args args = loom::make<loom_device_create_args>();
  args.num_threads = 1;
  const loom_device_api* api = plugin.device();
  loom_device* dev = nullptr;
  loom::check(api->create(opts.raw(), &args, &dev));
  // A block freed during a capture stays with the graph, not in use: 600 KiB more fits.
  loom::check(api->capture_begin(dev, nullptr));
  void* pooled = nullptr;
  loom::check(api->alloc(dev, 600 << 10, &pooled));
  auto fill = ew(LOOM_EW_FILL, (600 << 10) / 4, nullptr, nullptr, pooled);  // the replay writes it
  loom::check(api->ops->elementwise(dev, nullptr, &fill));
  api->free(dev, pooled);
  loom_graph* graph = nullptr;
  loom::check(api->capture_end(dev, nullptr, &graph));
  void* more = nullptr;
  const StatusInfo granted = take(api->alloc(dev, 600 << 10, &more));
  EXPECT_EQ(granted.code, LOOM_CODE_OK) << "a graph's pooled block was counted in use: " << granted.message;
  void* beyond = nullptr;
  const StatusInfo refused = take(api->alloc(dev, 600 << 10, &beyond));
  EXPECT_EQ(refused.code, LOOM_CODE_OUT_OF_MEMORY);
  EXPECT_NE(refused.message.find("device.options.memory_mb"), std::string::npos) << refused.message;
  api->free(dev, more);
  api->graph_destroy(dev, graph);  // the pool goes with the last graph
  // Threads asking at once: exactly one 600 KiB block fits in 1 MiB.
  for (int round = 0; round < 20; ++round) {
    std::atomic<int> ready{0};
    std::vector<void*> got(8, nullptr);
    std::vector<std::thread> threads;
    for (int t = 0; t < 8; ++t)
      threads.emplace_back([&, t] {
        ready.fetch_add(1);
        while (ready.load() < 8) {
        }
        (void)take(api->alloc(dev, 600 << 10, &got[t]));
      });
    for (std::thread& t : threads) t.join();
    int granted = 0;
    for (void* p : got) granted += p != nullptr ? 1 : 0;
    ASSERT_EQ(granted, 1) << "round " << round << ": allocations past memory_mb";
    for (void* p : got) api->free(dev, p);
  }
  api->destroy(dev);
}

// The graph pool (device/cuda's rules): memory allocated and freed during a
// capture stays the graph's, since every replay writes it again. It is not handed
// to eager allocations while a graph is alive, later captures reuse it, and it is
// released with the last graph. (Without the pool a replay writes freed memory:
// ASan reports it in the sanitizer build.)
TEST(DeviceCpu, MemoryFreedDuringCaptureStaysWithTheGraphs) {
  Dev d(1);
  const loom_device_api* api = d.api();
  const int64_t n = 1000;
  const size_t bytes = n * sizeof(float);
  Buf<float> out(d, n);
  out.fill(0.0f);

  // Graph 1: tmp = 2, out = out + tmp, with tmp freed before capture_end (as a
  // layer's temporaries are).
  loom::check(api->capture_begin(d.raw(), nullptr));
  void* tmp = nullptr;
  loom::check(api->alloc(d.raw(), bytes, &tmp));
  auto fill = ew(LOOM_EW_FILL, n, nullptr, nullptr, tmp);
  fill.alpha = 2.0f;
  loom::check(api->ops->elementwise(d.raw(), nullptr, &fill));
  auto acc = ew(LOOM_EW_ADD, n, out.data(), tmp, out.data());
  loom::check(api->ops->elementwise(d.raw(), nullptr, &acc));
  api->free(d.raw(), tmp);
  loom_graph* g1 = nullptr;
  loom::check(api->capture_end(d.raw(), nullptr, &g1));
  const uint64_t reserved_with_pool = d.stats().reserved_bytes;
  EXPECT_GE(reserved_with_pool, bytes + bytes);  // out + the pooled tmp

  // An eager allocation of the same size gets other memory.
  void* eager = nullptr;
  loom::check(api->alloc(d.raw(), bytes, &eager));
  EXPECT_NE(eager, tmp);
  std::memset(eager, 0xff, bytes);
  // A later capture reuses the pooled block.
  loom::check(api->capture_begin(d.raw(), nullptr));
  void* tmp2 = nullptr;
  loom::check(api->alloc(d.raw(), bytes, &tmp2));
  EXPECT_EQ(tmp2, tmp);
  api->free(d.raw(), tmp2);
  loom_graph* g2 = nullptr;
  loom::check(api->capture_end(d.raw(), nullptr, &g2));
  api->free(d.raw(), eager);

  // The replay writes the pooled block and computes with it.
  loom::check(api->graph_replay(d.raw(), g1, nullptr));
  loom::check(api->graph_replay(d.raw(), g1, nullptr));
  for (int64_t i = 0; i < n; i += 97) ASSERT_EQ(out[i], 4.0f) << i;
  EXPECT_EQ(d.stats().current_bytes, bytes);  // pooled blocks are not in use

  // Released with the last graph.
  api->graph_destroy(d.raw(), g1);
  EXPECT_EQ(d.stats().reserved_bytes, reserved_with_pool);
  api->graph_destroy(d.raw(), g2);
  EXPECT_EQ(d.stats().reserved_bytes, reserved_with_pool - (bytes + 255) / 256 * 256);  // 256-byte aligned
}

TEST(DeviceCpu, GraphCaptureRulesAndOtherStreams) {
  Dev d(1);
  const loom_device_api* api = d.api();
  loom_stream* side = nullptr;
  loom::check(api->stream_create(d.raw(), &side));
  Buf<float> a(d, 16), b(d, 16);
  a.fill(0.0f);
  b.fill(0.0f);

  loom::check(api->capture_begin(d.raw(), side));
  // Work on another stream (here the default one) is not captured: it runs now.
  auto fill = ew(LOOM_EW_FILL, 16, nullptr, nullptr, a.data());
  fill.alpha = 3.0f;
  loom::check(api->ops->elementwise(d.raw(), nullptr, &fill));
  EXPECT_EQ(a[5], 3.0f);
  // Work on the captured stream is recorded.
  auto fill_b = ew(LOOM_EW_FILL, 16, nullptr, nullptr, b.data());
  fill_b.alpha = 4.0f;
  loom::check(api->ops->elementwise(d.raw(), side, &fill_b));
  EXPECT_EQ(b[5], 0.0f);
  // Nested capture, a host sync inside the capture, and ending on the wrong stream are errors.
  EXPECT_EQ(take(api->capture_begin(d.raw(), nullptr)).code, LOOM_CODE_INVALID_ARGUMENT);
  EXPECT_EQ(take(api->capture_begin(d.raw(), side)).code, LOOM_CODE_INVALID_ARGUMENT);
  EXPECT_EQ(take(api->stream_synchronize(d.raw(), side)).code, LOOM_CODE_INVALID_ARGUMENT);
  loom_graph* wrong = nullptr;
  EXPECT_EQ(take(api->capture_end(d.raw(), nullptr, &wrong)).code, LOOM_CODE_INVALID_ARGUMENT);
  EXPECT_EQ(wrong, nullptr);
  // Invalid arguments are reported at launch time, not at replay.
  auto bad = ew(LOOM_EW_FILL, 16, nullptr, nullptr, nullptr);
  EXPECT_EQ(take(api->ops->elementwise(d.raw(), side, &bad)).code, LOOM_CODE_INVALID_ARGUMENT);
  loom_graph* g = nullptr;
  loom::check(api->capture_end(d.raw(), side, &g));
  EXPECT_EQ(b[5], 0.0f);
  // A graph replayed on any stream of the device runs its launches.
  loom::check(api->graph_replay(d.raw(), g, nullptr));
  EXPECT_EQ(b[5], 4.0f);
  // Replaying inside another capture nests it: recorded, run on the outer replay.
  b.fill(0.0f);
  loom::check(api->capture_begin(d.raw(), nullptr));
  loom::check(api->graph_replay(d.raw(), g, nullptr));
  loom_graph* outer = nullptr;
  loom::check(api->capture_end(d.raw(), nullptr, &outer));
  EXPECT_EQ(b[5], 0.0f);
  api->graph_destroy(d.raw(), g);  // the outer graph holds its own copy
  loom::check(api->graph_replay(d.raw(), outer, side));
  EXPECT_EQ(b[5], 4.0f);
  api->graph_destroy(d.raw(), outer);
  loom::check(api->stream_synchronize(d.raw(), side));  // capture over: syncing is fine again
  api->stream_destroy(d.raw(), side);
}

// ---------------------------------------------------------------------------
// Host tasks (ABI 1.12): a plugin's own CPU kernel, launched on a stream
// ---------------------------------------------------------------------------

// The args of the host tasks below: appends `value` to `log`, then, when out is set,
// out[0] = in[0] * scale (reading what the work before it wrote).
struct LogTask {
  std::vector<int>* log;
  int value;
  const float* in;
  float* out;
  float scale;
};
void run_log_task(LogTask* t) {
  t->log->push_back(t->value);
  if (t->out != nullptr) t->out[0] = t->in[0] * t->scale;
}
// The raw form: what the C ABI's fn receives.
void run_log_task_raw(void* p) { run_log_task(static_cast<LogTask*>(p)); }

loom_host_task_args raw_task(const LogTask* t) {
  loom_host_task_args a = loom::make<loom_host_task_args>();
  a.fn = run_log_task_raw;
  a.args = t;
  a.args_bytes = sizeof(LogTask);
  return a;
}

TEST(DeviceCpu, HostTaskRunsInStreamOrderBetweenOps) {
  Dev d(1);
  const loom::Device dev = d.ops();
  ASSERT_TRUE(dev.has_host_task());
  Buf<float> x(d, std::vector<float>{1.5f}), y(d, 1), z(d, 1);
  std::vector<int> log;
  auto twice = ew(LOOM_EW_SCALE, 1, x.data(), nullptr, y.data());
  twice.alpha = 2.0f;
  dev.elementwise(twice);                                              // y = 2x
  dev.host_task(&run_log_task, LogTask{&log, 1, y.data(), z.data(), 3.0f});  // z = 3y
  auto tenfold = ew(LOOM_EW_SCALE, 1, z.data(), nullptr, z.data());
  tenfold.alpha = 10.0f;
  dev.elementwise(tenfold);  // z *= 10
  dev.synchronize();
  EXPECT_EQ(log, std::vector<int>{1});
  EXPECT_EQ(z[0], 90.0f) << "the task read the op before it, the op after it read the task's result";
}

// Under capture a host task is recorded, not run; each replay runs it once with its
// args as they were at the call: changing the caller's struct afterwards, or freeing
// it, changes nothing (the device keeps its own copy as long as the graph lives).
TEST(DeviceCpu, HostTaskIsRecordedWithACopyOfItsArgsAndRunByEachReplay) {
  Dev d(1);
  const loom_device_api* api = d.api();
  Buf<float> in(d, std::vector<float>{2.0f}), out(d, 1);
  out.fill(0.0f);
  std::vector<int> log;
  loom::check(api->capture_begin(d.raw(), nullptr));
  LogTask on_stack{&log, 7, in.data(), out.data(), 5.0f};
  const loom_host_task_args a = raw_task(&on_stack);
  loom::check(api->ops->host_task(d.raw(), nullptr, &a));
  on_stack.value = 99;  // after the call: not what the graph runs
  on_stack.scale = 0.0f;
  auto on_heap = std::make_unique<LogTask>(LogTask{&log, 8, nullptr, nullptr, 0.0f});
  const loom_host_task_args b = raw_task(on_heap.get());
  loom::check(api->ops->host_task(d.raw(), nullptr, &b));
  std::memset(on_heap.get(), 0xAB, sizeof(LogTask));
  on_heap.reset();  // gone before the graph is even made
  loom_graph* graph = nullptr;
  loom::check(api->capture_end(d.raw(), nullptr, &graph));
  EXPECT_TRUE(log.empty()) << "a captured host task does not run at capture";
  EXPECT_EQ(out[0], 0.0f);

  loom::check(api->graph_replay(d.raw(), graph, nullptr));
  EXPECT_EQ(log, (std::vector<int>{7, 8}));
  EXPECT_EQ(out[0], 10.0f);
  in[0] = 3.0f;  // same address, new contents: the replay reads them
  loom::check(api->graph_replay(d.raw(), graph, nullptr));
  EXPECT_EQ(log, (std::vector<int>{7, 8, 7, 8}));
  EXPECT_EQ(out[0], 15.0f);
  api->graph_destroy(d.raw(), graph);
}

// fn gets the device's copy (not the caller's struct), aligned as malloc's memory,
// or NULL for a task without args.
TEST(DeviceCpu, HostTaskReceivesTheDevicesAlignedCopy) {
  Dev d(1);
  static std::vector<const void*> seen;
  seen.clear();
  const double caller[3] = {1.0, 2.0, 3.0};
  loom_host_task_args a = loom::make<loom_host_task_args>();
  a.fn = [](void* p) {
    seen.push_back(p);
    if (p != nullptr) {
      EXPECT_EQ(static_cast<const double*>(p)[2], 3.0);
    }
  };
  a.args = caller;
  a.args_bytes = sizeof(caller);
  loom::check(d.api()->ops->host_task(d.raw(), nullptr, &a));
  a.args = nullptr;
  a.args_bytes = 0;
  loom::check(d.api()->ops->host_task(d.raw(), nullptr, &a));
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_NE(seen[0], static_cast<const void*>(caller));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(seen[0]) % alignof(std::max_align_t), 0u);
  EXPECT_EQ(seen[1], nullptr);
}

TEST(DeviceCpu, HostTaskArgumentsAreChecked) {
  Dev d(1);
  const loom_device_api* api = d.api();
  std::vector<char> big(LOOM_HOST_TASK_MAX_ARGS_BYTES + 1, 0);
  loom_host_task_args a = loom::make<loom_host_task_args>();
  a.fn = [](void*) {};
  a.args = big.data();
  a.args_bytes = LOOM_HOST_TASK_MAX_ARGS_BYTES;
  EXPECT_EQ(take(api->ops->host_task(d.raw(), nullptr, &a)).code, LOOM_CODE_OK);  // the limit itself is fine
  a.args_bytes = LOOM_HOST_TASK_MAX_ARGS_BYTES + 1;
  StatusInfo too_big = take(api->ops->host_task(d.raw(), nullptr, &a));
  EXPECT_EQ(too_big.code, LOOM_CODE_INVALID_ARGUMENT);
  EXPECT_NE(too_big.message.find("args_bytes is 4097, more than the 4096"), std::string::npos) << too_big.message;
  a.args_bytes = 8;
  a.fn = nullptr;
  StatusInfo no_fn = take(api->ops->host_task(d.raw(), nullptr, &a));
  EXPECT_EQ(no_fn.code, LOOM_CODE_INVALID_ARGUMENT);
  EXPECT_NE(no_fn.message.find("host_task: fn is NULL"), std::string::npos) << no_fn.message;
  a.fn = [](void*) {};
  a.args = nullptr;
  StatusInfo no_args = take(api->ops->host_task(d.raw(), nullptr, &a));
  EXPECT_EQ(no_args.code, LOOM_CODE_INVALID_ARGUMENT);
  EXPECT_NE(no_args.message.find("args is NULL but args_bytes is 8"), std::string::npos) << no_args.message;
}

// A device whose op table ends before host_task (built before 1.12): loom::Device
// says it has none and refuses the call instead of reading past the table.
TEST(DeviceCpu, AnOlderOpTableHasNoHostTask) {
  Dev d(1);
  loom_device_ops ops = *d.api()->ops;
  ops.struct_size = offsetof(loom_device_ops, host_task);
  loom_device_api api = *d.api();
  api.ops = &ops;
  const loom::Device dev(&api, d.raw(), nullptr);
  EXPECT_TRUE(dev.has_sigmoid_bwd());
  EXPECT_FALSE(dev.has_host_task());
  std::vector<int> log;
  try {
    dev.host_task(&run_log_task, LogTask{&log, 1, nullptr, nullptr, 0.0f});
    ADD_FAILURE() << "a host task ran on a table without the slot";
  } catch (const loom::Error& e) {
    EXPECT_EQ(e.code(), LOOM_CODE_UNSUPPORTED);
    EXPECT_NE(std::string(e.what()).find("device op 'host_task' is not implemented"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(log.empty());
}

// ---------------------------------------------------------------------------
// bf16 storage: every op with dtype BF16 against the same op in fp32 on the
// bf16 values (inputs rounded with bf16_round_ref), its bf16 outputs rounded.
// device/cpu widens bf16 into fp32 and runs the fp32 code, so the two agree bit
// for bit; fp32 outputs (lse, mean/rstd, xent's row scalars, reductions) too.
// ---------------------------------------------------------------------------

uint16_t bf16_bits(float x) {  // x rounded to bf16, as its 16 bits
  const float r = bf16_round_ref(x);
  uint32_t u;
  std::memcpy(&u, &r, 4);
  return static_cast<uint16_t>(u >> 16);
}
float bf16_value(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
std::vector<float> rounded(std::vector<float> v) {
  for (float& x : v) x = bf16_round_ref(x);
  return v;
}
std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = bf16_bits(v[i]);
  return h;
}
std::vector<float> widen(const std::vector<uint16_t>& h) {
  std::vector<float> v(h.size());
  for (size_t i = 0; i < h.size(); ++i) v[i] = bf16_value(h[i]);
  return v;
}

// got (bf16) is the fp32 result rounded, bit for bit; NaN on either side fails.
void expect_bf16_eq(const std::vector<uint16_t>& got, const std::vector<float>& f32, const std::string& what) {
  ASSERT_EQ(got.size(), f32.size()) << what;
  int reported = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool ok = !std::isnan(f32[i]) && !std::isnan(bf16_value(got[i])) && got[i] == bf16_bits(f32[i]);
    if (!ok) {
      ADD_FAILURE() << what << "[" << i << "]: got bf16 " << bf16_value(got[i]) << " (0x" << std::hex << got[i]
                    << std::dec << "), want " << bf16_round_ref(f32[i]) << " (fp32 " << f32[i] << ")";
      if (++reported == 5) return;
    }
  }
}
// fp32 outputs of a bf16 op: the same bits as the fp32 op's; NaN fails.
void expect_f32_eq(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int reported = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool ok = !std::isnan(got[i]) && !std::isnan(want[i]) && std::memcmp(&got[i], &want[i], 4) == 0;
    if (!ok) {
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
      if (++reported == 5) return;
    }
  }
}

// A tensor on the device in either storage type, from fp32 values (rounded when bf16).
struct DTensor {
  int32_t dtype;
  Buf<float> f;
  Buf<uint16_t> h;
  DTensor(const Dev& d, int32_t dt, const std::vector<float>& v)
      : dtype(dt), f(d, dt == LOOM_DTYPE_F32 ? v.size() : 0), h(d, dt == LOOM_DTYPE_BF16 ? v.size() : 0) {
    if (dt == LOOM_DTYPE_F32)
      f.set(v);
    else
      h.set(to_bf16(v));
  }
  void* data() const { return dtype == LOOM_DTYPE_F32 ? static_cast<void*>(f.data()) : static_cast<void*>(h.data()); }
  // The stored values as fp32 (exact).
  std::vector<float> values() const { return dtype == LOOM_DTYPE_F32 ? f.get() : widen(h.get()); }
};

// C elements inside the m x n blocks of a strided batch.
std::vector<bool> c_blocks(size_t size, int64_t m, int64_t n, int64_t ldc, int64_t sc, int64_t batch) {
  std::vector<bool> in(size, false);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) in[static_cast<size_t>(b * sc + i * ldc + j)] = true;
  return in;
}

void check_gemm_bf16(const Dev& d, const GemmCase& g, int32_t ab_dt, int32_t c_dt, uint32_t seed,
                     bool c_sum_over_batch = false) {
  const int64_t a_rows = g.ta ? g.k : g.m, a_cols = g.ta ? g.m : g.k;
  const int64_t b_rows = g.tb ? g.n : g.k, b_cols = g.tb ? g.k : g.n;
  const int64_t lda = a_cols + 3, ldb = b_cols + 2, ldc = g.n + 5;
  const int64_t sa = a_rows * lda + 7, sb = b_rows * ldb + 1, sc = c_sum_over_batch ? 0 : g.m * ldc + 3;
  const size_t c_size = static_cast<size_t>(c_sum_over_batch ? g.m * ldc : sc * g.batch);
  std::vector<float> av = randn(static_cast<size_t>(sa * g.batch), seed, -2, 2);
  std::vector<float> bv = randn(static_cast<size_t>(sb * g.batch), seed + 1, -2, 2);
  std::vector<float> cv = randn(c_size, seed + 2, -2, 2);
  if (g.beta == 0.0f)
    for (float& x : cv) x = kNaN;  // beta = 0 must ignore whatever C holds
  if (ab_dt == LOOM_DTYPE_BF16) {
    av = rounded(av);
    bv = rounded(bv);
  }
  if (c_dt == LOOM_DTYPE_BF16) cv = rounded(cv);
  loom_gemm_args a = loom::make<loom_gemm_args>();
  a.trans_a = g.ta;
  a.trans_b = g.tb;
  a.m = g.m;
  a.n = g.n;
  a.k = g.k;
  a.lda = lda;
  a.stride_a = sa;
  a.ldb = ldb;
  a.stride_b = sb;
  a.ldc = ldc;
  a.stride_c = sc;
  a.batch = g.batch;
  a.alpha = g.alpha;
  a.beta = g.beta;
  // The fp32 op on the same values.
  Buf<float> A32(d, av), B32(d, bv), C32(d, cv);
  a.a = A32.data();
  a.b = B32.data();
  a.c = C32.data();
  a.dtype = a.c_dtype = LOOM_DTYPE_F32;
  d.ops().gemm(a);
  // The op under test.
  DTensor A(d, ab_dt, av), B(d, ab_dt, bv), C(d, c_dt, cv);
  a.a = A.data();
  a.b = B.data();
  a.c = C.data();
  a.dtype = ab_dt;
  a.c_dtype = c_dt;
  d.ops().gemm(a);
  std::ostringstream what;
  what << "gemm " << (ab_dt == LOOM_DTYPE_BF16 ? "bf16" : "f32") << " x " << (ab_dt == LOOM_DTYPE_BF16 ? "bf16" : "f32")
       << " -> " << (c_dt == LOOM_DTYPE_BF16 ? "bf16" : "f32") << " ta=" << g.ta << " tb=" << g.tb << " m=" << g.m
       << " n=" << g.n << " k=" << g.k << " batch=" << g.batch << " alpha=" << g.alpha << " beta=" << g.beta
       << (c_sum_over_batch ? " stride_c=0" : "");
  const std::vector<bool> in = c_blocks(c_size, g.m, g.n, ldc, sc, g.batch);
  const std::vector<float> want = C32.get();
  if (c_dt == LOOM_DTYPE_BF16) {
    const std::vector<uint16_t> got = C.h.get(), before = to_bf16(cv);
    std::vector<uint16_t> got_in, got_out, before_out;
    std::vector<float> want_in;
    for (size_t i = 0; i < c_size; ++i) {
      if (in[i]) {
        got_in.push_back(got[i]);
        want_in.push_back(want[i]);
      } else {
        got_out.push_back(got[i]);
        before_out.push_back(before[i]);
      }
    }
    expect_bf16_eq(got_in, want_in, what.str());
    EXPECT_EQ(got_out, before_out) << what.str() << ": C outside its m x n blocks changed";
  } else {
    const std::vector<float> got = C.f.get();
    std::vector<float> got_in, want_in;
    for (size_t i = 0; i < c_size; ++i) {
      if (in[i]) {
        got_in.push_back(got[i]);
        want_in.push_back(want[i]);
      } else {
        EXPECT_EQ(std::memcmp(&got[i], &cv[i], 4), 0) << what.str() << ": C outside its blocks changed at " << i;
      }
    }
    expect_f32_eq(got_in, want_in, what.str());
  }
}

class GemmBf16 : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(GemmBf16, EqualsTheFp32GemmOnTheBf16ValuesForEveryDtypeCombination) {
  Dev d(std::get<1>(GetParam()), std::get<0>(GetParam()));
  const int32_t F = LOOM_DTYPE_F32, H = LOOM_DTYPE_BF16;
  const std::pair<int32_t, int32_t> combos[] = {{H, H}, {H, F}, {F, H}};
  uint32_t seed = 700;
  for (auto [ab, c] : combos)
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        check_gemm_bf16(d, {ta, tb, 5, 7, 3, 1, 1.0f, 0.0f}, ab, c, seed++);
        check_gemm_bf16(d, {ta, tb, 13, 9, 17, 3, -1.5f, 1.0f}, ab, c, seed++);
        check_gemm_bf16(d, {ta, tb, 70, 65, 300, 2, 1.0f, 0.5f}, ab, c, seed++);   // batch-parallel sizes
        check_gemm_bf16(d, {ta, tb, 300, 100, 80, 1, 1.0f, 0.0f}, ab, c, seed++);  // row panels
        check_gemm_bf16(d, {ta, tb, 40, 600, 100, 1, 0.5f, 1.0f}, ab, c, seed++);  // column panels
      }
  for (auto [ab, c] : combos) {
    check_gemm_bf16(d, {0, 0, 6, 4, 0, 2, 1.0f, 0.0f}, ab, c, seed++);          // k = 0: C = beta C
    check_gemm_bf16(d, {0, 1, 6, 4, 5, 2, 0.0f, 2.0f}, ab, c, seed++);          // alpha = 0
    check_gemm_bf16(d, {0, 0, 9, 11, 20, 4, 1.0f, 1.0f}, ab, c, seed++, true);  // stride_c = 0: a sum
  }
}

INSTANTIATE_TEST_SUITE_P(DeviceCpu, GemmBf16,
                         ::testing::Combine(::testing::Values("openblas", "builtin"), ::testing::Values(1, 2)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_threads" + std::to_string(std::get<1>(info.param));
                         });

TEST(DeviceCpu, Bf16LayerNormEqualsFp32OnTheBf16Values) {
  for (const std::string& simd : simd_variants())
    for (int threads : {1, 2})
      for (bool affine : {true, false}) {
        SCOPED_TRACE("simd " + simd + ", threads " + std::to_string(threads) +
                     (affine ? ", affine" : ", no gamma/beta"));
        Dev d(threads, "openblas", simd);
        const int64_t rows = 37, cols = 300;
        const std::vector<float> xv = rounded(randn(rows * cols, 5, -2.0f, 3.0f)),
                                 gv = rounded(randn(cols, 6, 0.5f, 1.5f)), bv = rounded(randn(cols, 7)),
                                 dyv = rounded(randn(rows * cols, 8)), dx0 = rounded(randn(rows * cols, 9)),
                                 dg0 = rounded(randn(cols, 10)), db0 = rounded(randn(cols, 11));
        std::vector<float> want[7];  // y, mean, rstd, dx (=), dx (+=), dgamma, dbeta
        std::vector<uint16_t> got_h[6];
        std::vector<float> got_f[4];
        for (int32_t dt : {LOOM_DTYPE_F32, LOOM_DTYPE_BF16}) {
          DTensor x(d, dt, xv), g(d, dt, gv), b(d, dt, bv), y(d, dt, xv), dy(d, dt, dyv), dx(d, dt, dx0),
              dx2(d, dt, dx0), dg(d, dt, dg0), db(d, dt, db0);
          Buf<float> mean(d, rows), rstd(d, rows);
          loom_layernorm_fwd_args f = loom::make<loom_layernorm_fwd_args>();
          f.rows = rows;
          f.cols = cols;
          f.x = x.data();
          f.gamma = affine ? g.data() : nullptr;
          f.beta = affine ? b.data() : nullptr;
          f.y = y.data();
          f.mean = mean.data();
          f.rstd = rstd.data();
          f.eps = 1e-5f;
          f.dtype = dt;
          d.ops().layernorm_fwd(f);
          loom_layernorm_bwd_args bw = loom::make<loom_layernorm_bwd_args>();
          bw.rows = rows;
          bw.cols = cols;
          bw.dy = dy.data();
          bw.x = x.data();
          bw.gamma = affine ? g.data() : nullptr;
          bw.mean = mean.data();
          bw.rstd = rstd.data();
          bw.dx = dx.data();
          bw.dgamma = dg.data();
          bw.dbeta = db.data();
          bw.dtype = dt;
          d.ops().layernorm_bwd(bw);
          bw.dx = dx2.data();
          bw.dgamma = bw.dbeta = nullptr;
          bw.accumulate_dx = 1;
          d.ops().layernorm_bwd(bw);
          if (dt == LOOM_DTYPE_F32) {
            want[0] = y.values();
            want[1] = mean.get();
            want[2] = rstd.get();
            want[3] = dx.values();
            want[4] = dx2.values();
            want[5] = dg.values();
            want[6] = db.values();
          } else {
            got_h[0] = y.h.get();
            got_f[0] = mean.get();
            got_f[1] = rstd.get();
            got_h[1] = dx.h.get();
            got_h[2] = dx2.h.get();
            got_h[3] = dg.h.get();
            got_h[4] = db.h.get();
            // grad_fp32 (ABI 1.2): dgamma, dbeta accumulated into fp32 buffers.
            DTensor dx3(d, dt, dx0), dg32(d, LOOM_DTYPE_F32, dg0), db32(d, LOOM_DTYPE_F32, db0);
            bw.dx = dx3.data();
            bw.accumulate_dx = 0;
            bw.dgamma = dg32.data();
            bw.dbeta = db32.data();
            bw.grad_fp32 = 1;
            d.ops().layernorm_bwd(bw);
            got_h[5] = dx3.h.get();
            got_f[2] = dg32.values();
            got_f[3] = db32.values();
          }
        }
        expect_bf16_eq(got_h[0], want[0], "layernorm y");
        expect_f32_eq(got_f[0], want[1], "layernorm mean (fp32)");
        expect_f32_eq(got_f[1], want[2], "layernorm rstd (fp32)");
        expect_bf16_eq(got_h[1], want[3], "layernorm dx");
        expect_bf16_eq(got_h[2], want[4], "layernorm dx (accumulated)");
        expect_bf16_eq(got_h[3], want[5], "layernorm dgamma (accumulated)");
        expect_bf16_eq(got_h[4], want[6], "layernorm dbeta (accumulated)");
        // With grad_fp32 the fp32 op's gradients themselves: no bf16 rounding.
        expect_bf16_eq(got_h[5], want[3], "layernorm dx (grad_fp32 call)");
        expect_f32_eq(got_f[2], want[5], "layernorm dgamma (grad_fp32: accumulated in fp32)");
        expect_f32_eq(got_f[3], want[6], "layernorm dbeta (grad_fp32: accumulated in fp32)");
      }
}

TEST(DeviceCpu, Bf16LayerNormBackwardInPlaceOverDy) {
  Dev d(2);
  const int64_t rows = 5, cols = 64;
  const std::vector<float> xv = rounded(randn(rows * cols, 12, -2, 2)), gv = rounded(randn(cols, 13, 0.5f, 1.5f)),
                           dyv = rounded(randn(rows * cols, 14));
  std::vector<float> want;
  std::vector<uint16_t> got;
  for (int32_t dt : {LOOM_DTYPE_F32, LOOM_DTYPE_BF16}) {
    DTensor x(d, dt, xv), g(d, dt, gv), y(d, dt, xv), dy(d, dt, dyv), dg(d, dt, std::vector<float>(cols, 0.0f));
    Buf<float> mean(d, rows), rstd(d, rows);
    loom_layernorm_fwd_args f = loom::make<loom_layernorm_fwd_args>();
    f.rows = rows;
    f.cols = cols;
    f.x = x.data();
    f.gamma = g.data();
    f.y = y.data();
    f.mean = mean.data();
    f.rstd = rstd.data();
    f.eps = 1e-5f;
    f.dtype = dt;
    d.ops().layernorm_fwd(f);
    loom_layernorm_bwd_args bw = loom::make<loom_layernorm_bwd_args>();
    bw.rows = rows;
    bw.cols = cols;
    bw.dy = dy.data();
    bw.x = x.data();
    bw.gamma = g.data();
    bw.mean = mean.data();
    bw.rstd = rstd.data();
    bw.dx = dy.data();  // in place
    bw.dgamma = dg.data();
    bw.dtype = dt;
    d.ops().layernorm_bwd(bw);
    if (dt == LOOM_DTYPE_F32)
      want = dy.values();
    else
      got = dy.h.get();
  }
  expect_bf16_eq(got, want, "layernorm dx in place over dy");
}

TEST(DeviceCpu, Bf16GeluEqualsFp32OnTheBf16Values) {
  for (const std::string& simd : simd_variants())
    for (int threads : {1, 2}) {
      SCOPED_TRACE("simd " + simd + ", threads " + std::to_string(threads));
      Dev d(threads, "openblas", simd);
      const size_t n = 100003;  // several parallel chunks and widening blocks, a partial one last
      const std::vector<float> xv = rounded(randn(n, 12, -6, 6)), dyv = rounded(randn(n, 13));
      std::vector<float> want_y, want_dx;
      for (int32_t dt : {LOOM_DTYPE_F32, LOOM_DTYPE_BF16}) {
        DTensor x(d, dt, xv), dy(d, dt, dyv), y(d, dt, xv), dx(d, dt, xv);
        loom_gelu_args a = loom::make<loom_gelu_args>();
        a.n = static_cast<int64_t>(n);
        a.x = x.data();
        a.out = y.data();
        a.dtype = dt;
        d.ops().gelu_fwd(a);
        a.dy = dy.data();
        a.out = dx.data();
        d.ops().gelu_bwd(a);
        if (dt == LOOM_DTYPE_F32) {
          want_y = y.values();
          want_dx = dx.values();
          continue;
        }
        expect_bf16_eq(y.h.get(), want_y, "gelu y");
        expect_bf16_eq(dx.h.get(), want_dx, "gelu dx");
        a.out = x.data();  // in place
        a.dy = nullptr;
        d.ops().gelu_fwd(a);
        expect_bf16_eq(x.h.get(), want_y, "gelu y in place");
      }
    }
}

// Attention on logical [B, S, H, D] values in the layouts of run_attention (packed
// QKV with padded out rows, or [b, s, h, d]) in either storage type; backward takes
// the forward's stored out, as a training step does.
struct AttnIo {
  std::vector<float> out, lse, dq, dk, dv;  // logical [B, S, H, D] (as stored), lse fp32
  std::vector<uint16_t> out_h, dq_h, dk_h, dv_h;
  int64_t out_pad_changed = 0;
};

AttnIo run_attention_dt(const Dev& d, const AttnRef& ref, bool packed, int32_t dt, const std::vector<float>& q,
                        const std::vector<float>& k, const std::vector<float>& v, const std::vector<float>& dout,
                        const std::vector<float>* out_for_bwd) {
  const int64_t B = ref.B, S = ref.S, H = ref.H, D = ref.D, W = H * D, pad = 3;
  const int64_t qs_b = packed ? 3 * W : S * W, qs_s = packed ? B * 3 * W : W;
  const int64_t koff = packed ? W : B * S * W, voff = packed ? 2 * W : 2 * B * S * W;
  const int64_t os_b = packed ? W + pad : S * (W + pad), os_s = packed ? B * (W + pad) : W + pad;
  const size_t qkv_elems = static_cast<size_t>(3 * B * S * W), out_elems = static_cast<size_t>(B * S * (W + pad));
  auto at = [&](int64_t b, int64_t s, int64_t h, int64_t e) {
    return static_cast<size_t>(b * qs_b + s * qs_s + h * D + e);
  };
  auto oat = [&](int64_t b, int64_t s, int64_t h, int64_t e) {
    return static_cast<size_t>(b * os_b + s * os_s + h * D + e);
  };
  constexpr float kSentinel = 12288.0f;  // exact in bf16
  std::vector<float> qkv(qkv_elems, 0.0f), dov(out_elems, 0.0f), ov(out_elems, kSentinel);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t e = 0; e < D; ++e) {
          const size_t li = ref.idx(b, s, h, e);
          qkv[at(b, s, h, e)] = q[li];
          qkv[at(b, s, h, e) + koff] = k[li];
          qkv[at(b, s, h, e) + voff] = v[li];
          dov[oat(b, s, h, e)] = dout[li];
        }
  DTensor QKV(d, dt, qkv), O(d, dt, ov), dO(d, dt, dov), dQKV(d, dt, std::vector<float>(qkv_elems, kNaN));
  Buf<float> LSE(d, static_cast<size_t>(B * H * S));
  loom_attention_args a = loom::make<loom_attention_args>();
  a.batch = B;
  a.seq = S;
  a.heads = H;
  a.head_dim = D;
  a.qkv_stride_b = qs_b;
  a.qkv_stride_s = qs_s;
  a.out_stride_b = os_b;
  a.out_stride_s = os_s;
  const size_t es = dt == LOOM_DTYPE_F32 ? 4 : 2;
  auto off = [&](void* p, int64_t e) {
    return static_cast<void*>(static_cast<char*>(p) + e * static_cast<int64_t>(es));
  };
  a.q = QKV.data();
  a.k = off(QKV.data(), koff);
  a.v = off(QKV.data(), voff);
  a.out = O.data();
  a.lse = LSE.data();
  a.scale = static_cast<float>(ref.scale);
  a.causal = ref.causal ? 1 : 0;
  a.window = ref.window;
  a.key_start = ref.key_start_or_null();
  a.dtype = dt;
  d.ops().attention_fwd(a);
  AttnIo r;
  const std::vector<float> o_fwd = O.values();
  if (out_for_bwd) {  // backward reads the given out values (in the same layout)
    std::vector<float> ob = o_fwd;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t e = 0; e < D; ++e) ob[oat(b, s, h, e)] = (*out_for_bwd)[ref.idx(b, s, h, e)];
    if (dt == LOOM_DTYPE_F32)
      O.f.set(ob);
    else
      O.h.set(to_bf16(ob));
  }
  a.dout = dO.data();
  a.dq = dQKV.data();
  a.dk = off(dQKV.data(), koff);
  a.dv = off(dQKV.data(), voff);
  d.ops().attention_bwd(a);
  const std::vector<float> g = dQKV.values();
  const size_t n = q.size();
  r.out.resize(n);
  r.dq.resize(n);
  r.dk.resize(n);
  r.dv.resize(n);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t e = 0; e < D; ++e) {
          const size_t li = ref.idx(b, s, h, e);
          r.out[li] = o_fwd[oat(b, s, h, e)];
          r.dq[li] = g[at(b, s, h, e)];
          r.dk[li] = g[at(b, s, h, e) + koff];
          r.dv[li] = g[at(b, s, h, e) + voff];
        }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t p = 0; p < pad; ++p)
        if (o_fwd[static_cast<size_t>(b * os_b + s * os_s + W + p)] != kSentinel) ++r.out_pad_changed;
  r.lse = LSE.get();
  if (dt == LOOM_DTYPE_BF16) {
    r.out_h = to_bf16(r.out);  // exact: these are bf16 values
    r.dq_h = to_bf16(r.dq);
    r.dk_h = to_bf16(r.dk);
    r.dv_h = to_bf16(r.dv);
  }
  return r;
}

TEST(DeviceCpu, Bf16AttentionEqualsFp32OnTheBf16Values) {
  for (bool causal : {true, false})
    for (bool packed : {true, false}) {
      AttnRef ref{2, 70, 3, 8, causal, 1.0 / std::sqrt(8.0)};  // 70: two query blocks, one partial
      const size_t n = static_cast<size_t>(2 * 70 * 3 * 8);
      const std::vector<float> q = rounded(randn(n, 30, -2, 2)), k = rounded(randn(n, 31, -2, 2)),
                               v = rounded(randn(n, 32)), dout = rounded(randn(n, 33));
      const std::string tag = std::string(causal ? " causal" : " full") + (packed ? " packed-qkv" : " bshd");
      for (int threads : {1, 2}) {
        SCOPED_TRACE("threads " + std::to_string(threads) + tag);
        Dev d(threads);
        const AttnIo h = run_attention_dt(d, ref, packed, LOOM_DTYPE_BF16, q, k, v, dout, nullptr);
        // Reference: fp32 forward on the bf16 values; fp32 backward with the stored (bf16) out.
        const AttnIo f = run_attention_dt(d, ref, packed, LOOM_DTYPE_F32, q, k, v, dout, &h.out);
        expect_bf16_eq(h.out_h, f.out, "attention out" + tag);
        expect_f32_eq(h.lse, f.lse, "attention lse (fp32)" + tag);
        expect_bf16_eq(h.dq_h, f.dq, "attention dq" + tag);
        expect_bf16_eq(h.dk_h, f.dk, "attention dk" + tag);
        expect_bf16_eq(h.dv_h, f.dv, "attention dv" + tag);
        EXPECT_EQ(h.out_pad_changed, 0) << "attention wrote into out's row padding" << tag;
        // And bf16 is bf16-close to the double-precision reference.
        Vec out, lse;
        ref.forward(to_d(q), to_d(k), to_d(v), out, lse);
        expect_close(h.out, out, 1e-2, 1e-2, "attention out vs double" + tag);
      }
    }
}

// ABI 1.6's query window, as context parallelism calls it: the queries of each
// window (q and out [b, s, h, d]) attend to keys and values of the whole sequence in
// another layout (packed [s, b, k|v]) with q_offset at the window's start, and every
// call accumulates into the same dk, dv. Over windows that cover the sequence in
// any order this must equal one attention over the whole sequence.
struct AttnWindow {
  int64_t offset, length, kv_extra;  // kv_seq = offset + length + kv_extra (capped at S), causal
};

AttnIo run_attention_windows(const Dev& d, const AttnRef& ref, int32_t dt, const std::vector<float>& q,
                             const std::vector<float>& k, const std::vector<float>& v,
                             const std::vector<float>& dout, const std::vector<AttnWindow>& windows) {
  const int64_t B = ref.B, S = ref.S, H = ref.H, D = ref.D, W = H * D;
  auto kvat = [&](int64_t b, int64_t s, int64_t h, int64_t e) {  // k at +0, v at +W
    return static_cast<size_t>(s * B * 2 * W + b * 2 * W + h * D + e);
  };
  std::vector<float> kv(static_cast<size_t>(S * B * 2 * W), 0.0f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t e = 0; e < D; ++e) {
          kv[kvat(b, s, h, e)] = k[ref.idx(b, s, h, e)];
          kv[kvat(b, s, h, e) + W] = v[ref.idx(b, s, h, e)];
        }
  const size_t n = q.size();
  DTensor Q(d, dt, q), KV(d, dt, kv), dO(d, dt, dout), O(d, dt, std::vector<float>(n, kNaN)),
      dQ(d, dt, std::vector<float>(n, kNaN)), dKV(d, dt, std::vector<float>(kv.size(), 0.0f));
  const size_t es = dt == LOOM_DTYPE_F32 ? 4 : 2;
  auto off = [&](void* p, int64_t e) { return static_cast<void*>(static_cast<char*>(p) + e * static_cast<int64_t>(es)); };
  AttnIo r;
  r.lse.assign(static_cast<size_t>(B * H * S), kNaN);
  for (const AttnWindow& w : windows) {
    Buf<float> LSE(d, static_cast<size_t>(B * H * w.length));
    loom_attention_args a = loom::make<loom_attention_args>();
    a.batch = B;
    a.seq = w.length;
    a.heads = H;
    a.head_dim = D;
    a.qkv_stride_b = a.out_stride_b = S * W;  // q, out, their gradients: [b, s, h, d]
    a.qkv_stride_s = a.out_stride_s = W;
    a.kv_seq = ref.causal ? std::min(S, w.offset + w.length + w.kv_extra) : S;
    a.q_offset = w.offset;
    a.kv_stride_b = 2 * W;
    a.kv_stride_s = B * 2 * W;
    a.q = off(Q.data(), w.offset * W);
    a.k = KV.data();
    a.v = off(KV.data(), W);
    a.out = off(O.data(), w.offset * W);
    a.lse = LSE.data();
    a.scale = static_cast<float>(ref.scale);
    a.causal = ref.causal ? 1 : 0;
    a.window = ref.window;
    std::vector<int32_t> key_start;  // the window's queries' rows of the reference's [B, S]
    for (int64_t b = 0; b < B && !ref.key_start.empty(); ++b)
      for (int64_t i = 0; i < w.length; ++i) key_start.push_back(ref.key_start[static_cast<size_t>(b * S + w.offset + i)]);
    a.key_start = key_start.empty() ? nullptr : key_start.data();
    a.dtype = dt;
    d.ops().attention_fwd(a);
    a.dout = off(dO.data(), w.offset * W);
    a.dq = off(dQ.data(), w.offset * W);
    a.dk = dKV.data();
    a.dv = off(dKV.data(), W);
    a.accumulate_dkv = 1;
    d.ops().attention_bwd(a);
    const std::vector<float> l = LSE.get();
    for (int64_t bh = 0; bh < B * H; ++bh)
      for (int64_t i = 0; i < w.length; ++i) r.lse[bh * S + w.offset + i] = l[bh * w.length + i];
  }
  r.out = O.values();
  r.dq = dQ.values();
  const std::vector<float> g = dKV.values();
  r.dk.resize(n);
  r.dv.resize(n);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t e = 0; e < D; ++e) {
          r.dk[ref.idx(b, s, h, e)] = g[kvat(b, s, h, e)];
          r.dv[ref.idx(b, s, h, e)] = g[kvat(b, s, h, e) + W];
        }
  return r;
}

TEST(DeviceCpu, WindowedAttentionOverContextChunksEqualsTheWholeSequence) {
  // cp = 2 over S = 4 chunks of 35 (a partial query block each): rank 0 holds chunks
  // 0 and 3, rank 1 chunks 1 and 2; keys up to the causal limit, or a few past it
  // (masked), or all of them.
  const int64_t c = 35;
  const std::vector<AttnWindow> windows = {{0, c, 0}, {3 * c, c, 0}, {c, c, 7}, {2 * c, c, 4 * c}};
  Dev dev(2);
  ASSERT_NE(dev.api()->features & LOOM_DEVICE_ATTENTION_WINDOW, 0u) << "device/cpu must advertise the query window";
  for (bool causal : {true, false}) {
    AttnRef ref{2, 4 * c, 3, 8, causal, 1.0 / std::sqrt(8.0)};
    const size_t n = static_cast<size_t>(ref.B * ref.S * ref.H * ref.D);
    const std::vector<float> q = rounded(randn(n, 70, -2, 2)), k = rounded(randn(n, 71, -2, 2)),
                             v = rounded(randn(n, 72)), dout = rounded(randn(n, 73));
    const std::string tag = causal ? " causal" : " full";
    Vec out, lse, dq, dk, dv;
    ref.forward(to_d(q), to_d(k), to_d(v), out, lse);
    ref.backward(to_d(q), to_d(k), to_d(v), to_d(dout), dq, dk, dv);
    const AttnIo f = run_attention_windows(dev, ref, LOOM_DTYPE_F32, q, k, v, dout, windows);
    expect_close(f.out, out, 1e-5, 1e-4, "windowed out" + tag);
    expect_close(f.lse, lse, 1e-5, 1e-5, "windowed lse" + tag);
    expect_close(f.dq, dq, 2e-5, 1e-4, "windowed dq" + tag);
    expect_close(f.dk, dk, 2e-5, 1e-4, "windowed dk (accumulated over windows)" + tag);
    expect_close(f.dv, dv, 2e-5, 1e-4, "windowed dv (accumulated over windows)" + tag);
    // bf16 storage: windows equal the whole-sequence bf16 op to bf16 rounding (the
    // GEMM blocks differ; dk, dv are rounded between accumulating calls).
    const AttnIo hw = run_attention_windows(dev, ref, LOOM_DTYPE_BF16, q, k, v, dout, windows);
    const AttnIo h = run_attention_dt(dev, ref, false, LOOM_DTYPE_BF16, q, k, v, dout, nullptr);
    expect_close(hw.out, to_d(h.out), 1e-2, 1e-2, "bf16 windowed out" + tag);
    expect_close(hw.lse, to_d(h.lse), 1e-6, 1e-6, "bf16 windowed lse" + tag);
    expect_close(hw.dq, to_d(h.dq), 1e-2, 1e-2, "bf16 windowed dq" + tag);
    expect_close(hw.dk, to_d(h.dk), 1e-2, 1e-2, "bf16 windowed dk" + tag);
    expect_close(hw.dv, to_d(h.dv), 1e-2, 1e-2, "bf16 windowed dv" + tag);
  }
}

// A causal window must lie inside its keys; the op says which bounds it got.
TEST(DeviceCpu, WindowedAttentionRefusesAWindowPastItsKeys) {
  Dev d(1);
  Buf<float> x(d, 64), lse(d, 8);
  loom_attention_args a = loom::make<loom_attention_args>();
  a.batch = 1;
  a.seq = 4;
  a.heads = 1;
  a.head_dim = 2;
  a.qkv_stride_b = a.out_stride_b = a.kv_stride_b = 8;
  a.qkv_stride_s = a.out_stride_s = a.kv_stride_s = 2;
  a.q = a.k = a.v = x.data();
  a.out = x.data() + 32;
  a.lse = lse.data();
  a.scale = 1.0f;
  a.causal = 1;
  a.kv_seq = 6;
  a.q_offset = 3;  // [3, 7) reaches past the 6 keys
  const StatusInfo st = take(d.api()->ops->attention_fwd(d.raw(), nullptr, &a));
  EXPECT_EQ(st.code, LOOM_CODE_INVALID_ARGUMENT);
  const std::string& msg = st.message;
  EXPECT_NE(msg.find("[3, 7)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("kv_seq = 6"), std::string::npos) << msg;
}

// ABI 1.21 sliding windows: query i sees keys (i - window, i]. Windows of 1 (itself
// only), inside one 64-row query block, across its edge, across several, and one
// reaching past the first key (every earlier key: the op without a window) against the
// double-precision reference, for both layouts, thread counts and SIMD variants. The
// reference's gradients are checked by finite differences first.
TEST(DeviceCpu, SlidingWindowAttentionMatchesTheReference) {
  expect_reference_gradients(AttnRef{2, 7, 2, 3, true, 0.7, 3}, 80, "sliding-window reference");
  Dev plain(1);
  ASSERT_NE(plain.api()->features & LOOM_DEVICE_ATTENTION_SLIDING_WINDOW, 0u);
  const int64_t S = 150;  // query blocks of 64, 64 and 22
  const size_t n = static_cast<size_t>(2 * S * 3 * 8);
  const Vec q = to_d(randn(n, 84, -2, 2)), k = to_d(randn(n, 85, -2, 2)), v = to_d(randn(n, 86)),
            dout = to_d(randn(n, 87));
  AttnRef full{2, S, 3, 8, true, 1.0 / std::sqrt(8.0)};
  Vec full_out, full_lse, unused;
  full.forward(q, k, v, full_out, full_lse);
  for (int64_t window : std::vector<int64_t>{1, 5, 64, 70, 129, S, 1000}) {
    AttnRef ref = full;
    ref.window = window;
    Vec out, lse, dq, dk, dv;
    ref.forward(q, k, v, out, lse);
    ref.backward(q, k, v, dout, dq, dk, dv);
    if (window < S) {
      double differs = 0;
      for (size_t i = 0; i < out.size(); ++i) differs = std::max(differs, std::abs(out[i] - full_out[i]));
      EXPECT_GT(differs, 1e-2) << "window " << window << " must change the output";
    }
    for (bool packed : {true, false})
      for (const std::string& simd : simd_variants())
        for (int threads : {1, 2}) {
          const std::string tag = " window " + std::to_string(window) + (packed ? " packed" : " bshd") + " simd " +
                                  simd + " threads " + std::to_string(threads);
          Dev d(threads, "openblas", simd);
          const AttnRun r = run_attention(d, ref, packed, q, k, v, dout);
          expect_close(r.out, out, 1e-5, 1e-4, "out" + tag);
          expect_close(r.lse, lse, 1e-5, 1e-5, "lse" + tag);
          expect_close(r.dq, dq, 2e-5, 1e-4, "dq" + tag);
          expect_close(r.dk, dk, 2e-5, 1e-4, "dk" + tag);
          expect_close(r.dv, dv, 2e-5, 1e-4, "dv" + tag);
        }
  }
}

// ABI 1.22 documents: query i of batch element b sees keys from key_start[b * S + i]
// (its document's first position) on, alone and with a sliding window (the later
// bound), against the double-precision reference; documents of 1 token, ones ending
// inside and across 64-row blocks, a batch element of one document; over
// context-parallel query windows too; contents that break the contract are refused.
std::vector<int32_t> document_starts(int64_t B, int64_t S, const std::vector<std::vector<int64_t>>& ends) {
  std::vector<int32_t> ks;
  for (int64_t b = 0; b < B; ++b) {
    int32_t start = 0;
    for (int64_t i = 0; i < S; ++i) {
      ks.push_back(start);
      if (std::find(ends[b].begin(), ends[b].end(), i) != ends[b].end()) start = static_cast<int32_t>(i + 1);
    }
  }
  return ks;
}

TEST(DeviceCpu, DocumentMaskedAttentionMatchesTheReference) {
  const int64_t S = 150;
  // b 0: documents ending at 0 (one token), 1, 40, 63, 64 and 129; b 1: one document.
  const std::vector<int32_t> ks = document_starts(2, S, {{0, 1, 40, 63, 64, 129}, {}});
  expect_reference_gradients(AttnRef{2, 9, 2, 3, true, 0.7, 0, document_starts(2, 9, {{2, 3}, {5}})}, 94,
                             "document-masked reference");
  Dev plain(1);
  ASSERT_NE(plain.api()->features & LOOM_DEVICE_ATTENTION_KEY_START, 0u);
  const size_t n = static_cast<size_t>(2 * S * 3 * 8);
  const Vec q = to_d(randn(n, 98, -2, 2)), k = to_d(randn(n, 99, -2, 2)), v = to_d(randn(n, 100)),
            dout = to_d(randn(n, 101));
  for (int64_t window : {0, 20}) {
    AttnRef ref{2, S, 3, 8, true, 1.0 / std::sqrt(8.0), window, ks};
    Vec out, lse, dq, dk, dv;
    ref.forward(q, k, v, out, lse);
    ref.backward(q, k, v, dout, dq, dk, dv);
    for (bool packed : {true, false})
      for (int threads : {1, 2}) {
        const std::string tag = " window " + std::to_string(window) + (packed ? " packed" : " bshd") + " threads " +
                                std::to_string(threads);
        Dev d(threads);
        const AttnRun r = run_attention(d, ref, packed, q, k, v, dout);
        expect_close(r.out, out, 1e-5, 1e-4, "out" + tag);
        expect_close(r.lse, lse, 1e-5, 1e-5, "lse" + tag);
        expect_close(r.dq, dq, 2e-5, 1e-4, "dq" + tag);
        expect_close(r.dk, dk, 2e-5, 1e-4, "dk" + tag);
        expect_close(r.dv, dv, 2e-5, 1e-4, "dv" + tag);
      }
  }
  // Over cp windows (4 chunks of 35), fp32 and bf16.
  const int64_t c = 35;
  AttnRef cp{2, 4 * c, 3, 8, true, 1.0 / std::sqrt(8.0), 0, document_starts(2, 4 * c, {{10, 34, 35, 90}, {70}})};
  const size_t m = static_cast<size_t>(cp.B * cp.S * cp.H * cp.D);
  const std::vector<float> qf = rounded(randn(m, 102, -2, 2)), kf = rounded(randn(m, 103, -2, 2)),
                           vf = rounded(randn(m, 104)), df = rounded(randn(m, 105));
  Vec out, lse, dq, dk, dv;
  cp.forward(to_d(qf), to_d(kf), to_d(vf), out, lse);
  cp.backward(to_d(qf), to_d(kf), to_d(vf), to_d(df), dq, dk, dv);
  const std::vector<AttnWindow> windows = {{0, c, 0}, {3 * c, c, 0}, {c, c, 7}, {2 * c, c, 4 * c}};
  const AttnIo f = run_attention_windows(plain, cp, LOOM_DTYPE_F32, qf, kf, vf, df, windows);
  expect_close(f.out, out, 1e-5, 1e-4, "cp out");
  expect_close(f.dq, dq, 2e-5, 1e-4, "cp dq");
  expect_close(f.dk, dk, 2e-5, 1e-4, "cp dk");
  expect_close(f.dv, dv, 2e-5, 1e-4, "cp dv");
  const AttnIo hw = run_attention_windows(plain, cp, LOOM_DTYPE_BF16, qf, kf, vf, df, windows);
  const AttnIo h = run_attention_dt(plain, cp, false, LOOM_DTYPE_BF16, qf, kf, vf, df, nullptr);
  expect_close(hw.out, to_d(h.out), 1e-2, 1e-2, "bf16 cp out");
  expect_close(hw.dk, to_d(h.dk), 1e-2, 1e-2, "bf16 cp dk");
  // Starts that move back, or past the query itself, are refused naming the row.
  for (const std::pair<int64_t, int32_t>& bad : {std::pair<int64_t, int32_t>{42, 2}, {5, 6}}) {
    AttnRef ref{2, S, 3, 8, true, 1.0, 0, ks};
    ref.key_start[static_cast<size_t>(bad.first)] = bad.second;
    try {
      run_attention(plain, ref, true, q, k, v, dout);
      ADD_FAILURE() << "key_start[" << bad.first << "] = " << bad.second << " must be refused";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("key_start[0 * seq + " + std::to_string(bad.first) + "] = " +
                                           std::to_string(bad.second)),
                std::string::npos)
          << e.what();
    }
  }
}

// A sliding window over context-parallel query windows (the queries at their
// positions in the keys) equals the whole sequence's, in fp32 and bf16 storage; a
// window without causal is refused, naming both.
TEST(DeviceCpu, SlidingWindowOverContextChunksEqualsTheWholeSequence) {
  const int64_t c = 35;
  const std::vector<AttnWindow> windows = {{0, c, 0}, {3 * c, c, 0}, {c, c, 7}, {2 * c, c, 4 * c}};
  Dev dev(2);
  for (int64_t window : {20, 50}) {
    AttnRef ref{2, 4 * c, 3, 8, true, 1.0 / std::sqrt(8.0), window};
    const size_t n = static_cast<size_t>(ref.B * ref.S * ref.H * ref.D);
    const std::vector<float> q = rounded(randn(n, 90, -2, 2)), k = rounded(randn(n, 91, -2, 2)),
                             v = rounded(randn(n, 92)), dout = rounded(randn(n, 93));
    const std::string tag = " window " + std::to_string(window);
    Vec out, lse, dq, dk, dv;
    ref.forward(to_d(q), to_d(k), to_d(v), out, lse);
    ref.backward(to_d(q), to_d(k), to_d(v), to_d(dout), dq, dk, dv);
    const AttnIo f = run_attention_windows(dev, ref, LOOM_DTYPE_F32, q, k, v, dout, windows);
    expect_close(f.out, out, 1e-5, 1e-4, "out" + tag);
    expect_close(f.lse, lse, 1e-5, 1e-5, "lse" + tag);
    expect_close(f.dq, dq, 2e-5, 1e-4, "dq" + tag);
    expect_close(f.dk, dk, 2e-5, 1e-4, "dk" + tag);
    expect_close(f.dv, dv, 2e-5, 1e-4, "dv" + tag);
    const AttnIo hw = run_attention_windows(dev, ref, LOOM_DTYPE_BF16, q, k, v, dout, windows);
    const AttnIo h = run_attention_dt(dev, ref, false, LOOM_DTYPE_BF16, q, k, v, dout, nullptr);
    expect_close(hw.out, to_d(h.out), 1e-2, 1e-2, "bf16 out" + tag);
    expect_close(hw.dq, to_d(h.dq), 1e-2, 1e-2, "bf16 dq" + tag);
    expect_close(hw.dk, to_d(h.dk), 1e-2, 1e-2, "bf16 dk" + tag);
    expect_close(hw.dv, to_d(h.dv), 1e-2, 1e-2, "bf16 dv" + tag);
  }
  Buf<float> x(dev, 64), lse(dev, 8);
  loom_attention_args a = loom::make<loom_attention_args>();
  a.batch = 1;
  a.seq = 4;
  a.heads = 1;
  a.head_dim = 2;
  a.qkv_stride_b = a.out_stride_b = 8;
  a.qkv_stride_s = a.out_stride_s = 2;
  a.q = a.k = a.v = x.data();
  a.out = x.data() + 32;
  a.lse = lse.data();
  a.scale = 1.0f;
  a.window = 2;
  const StatusInfo st = take(dev.api()->ops->attention_fwd(dev.raw(), nullptr, &a));
  EXPECT_EQ(st.code, LOOM_CODE_INVALID_ARGUMENT);
  EXPECT_NE(st.message.find("window = 2 slides over the earlier keys of causal attention; causal is 0"),
            std::string::npos)
      << st.message;
  a.causal = 1;
  a.window = -1;
  const StatusInfo neg = take(dev.api()->ops->attention_fwd(dev.raw(), nullptr, &a));
  EXPECT_NE(neg.message.find("window must be >= 0"), std::string::npos) << neg.message;
}

TEST(DeviceCpu, Bf16XentEqualsFp32OnTheBf16Values) {
  for (const std::string& simd : simd_variants()) {
    SCOPED_TRACE("simd " + simd);
    Dev d(2, "openblas", simd);
    const int64_t rows = 9, cols = 12, valid = 10, ld = 13;
    const std::vector<int32_t> tv{3, -1, 9, 0, 7, -100, 1, 9, 4};
    std::vector<float> lv = rounded(randn(rows * ld, 60, -4, 4));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = valid; c < ld; ++c) lv[r * ld + c] = 1e4f;  // padding and gaps: must never count
    Buf<int32_t> targets(d, tv);
    const float scale = 1.0f / 7.0f;
    std::vector<float> want_dl, want_dl_inplace, want_scalars[4];
    for (int32_t dt : {LOOM_DTYPE_F32, LOOM_DTYPE_BF16}) {
      DTensor logits(d, dt, lv), dl(d, dt, std::vector<float>(rows * ld, -7.0f));
      XentBufs b(d, rows);
      for (int32_t step : {LOOM_XENT_ROW_MAX, LOOM_XENT_SUMEXP, LOOM_XENT_LOSS, LOOM_XENT_BACKWARD}) {
        loom_xent_args a = xent_args(step, rows, cols, ld, valid, 0, nullptr, targets.data(), b, nullptr, scale);
        a.logits = logits.data();
        a.dlogits = dl.data();
        a.dtype = dt;
        d.ops().xent(a);
      }
      std::vector<float> scalars[4] = {b.row_max.get(), b.sumexp.get(), b.tlogit.get(), b.loss.get()};
      // In place: dlogits over the logits.
      for (int32_t step : {LOOM_XENT_ROW_MAX, LOOM_XENT_SUMEXP, LOOM_XENT_LOSS, LOOM_XENT_BACKWARD}) {
        loom_xent_args a = xent_args(step, rows, cols, ld, valid, 0, nullptr, targets.data(), b, nullptr, scale);
        a.logits = logits.data();
        a.dlogits = logits.data();
        a.dtype = dt;
        d.ops().xent(a);
      }
      if (dt == LOOM_DTYPE_F32) {
        want_dl = dl.values();
        want_dl_inplace = logits.values();
        for (int i = 0; i < 4; ++i) want_scalars[i] = scalars[i];
        continue;
      }
      const char* names[4] = {"xent row_max", "xent row_sumexp", "xent target_logit", "xent loss"};
      for (int i = 0; i < 4; ++i) expect_f32_eq(scalars[i], want_scalars[i], names[i]);
      const std::vector<uint16_t> got = dl.h.get();
      for (int64_t r = 0; r < rows; ++r) EXPECT_EQ(got[r * ld + 12], bf16_bits(-7.0f)) << "the ld gap is not ours";
      expect_bf16_eq(got, want_dl, "xent dlogits");
      std::vector<uint16_t> inplace = logits.h.get();
      expect_bf16_eq(inplace, want_dl_inplace, "xent dlogits in place");
    }
  }
}

TEST(DeviceCpu, Bf16EmbeddingEqualsFp32OnTheBf16Values) {
  const int64_t vocab = 10, dim = 70, n = 12, split = 6;
  const std::vector<int32_t> ids{0, 3, 9, 3, 6, 5, 6, 6, 1, 9, 2, 7};
  const std::vector<float> tv = rounded(randn(vocab * dim, 80)), wv = rounded(randn(n * dim, 81)),
                           dt0 = rounded(randn(vocab * dim, 82));
  for (int threads : {1, 2}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    Dev d(threads);
    Buf<int32_t> I(d, ids);
    std::vector<float> want[3];
    for (int32_t dt : {LOOM_DTYPE_F32, LOOM_DTYPE_BF16}) {
      DTensor T(d, dt, tv), out0(d, dt, std::vector<float>(n * dim, kNaN)),
          out(d, dt, std::vector<float>(n * dim, kNaN)), dout(d, dt, wv), dT(d, dt, dt0);
      const size_t es = dt == LOOM_DTYPE_F32 ? 4 : 2;
      auto args = [&](int64_t start, int64_t rows) {
        loom_embedding_args a = loom::make<loom_embedding_args>();
        a.n = n;
        a.dim = dim;
        a.vocab_rows = rows;
        a.vocab_start = start;
        a.ids = I.data();
        a.table = static_cast<const char*>(T.data()) + start * dim * static_cast<int64_t>(es);
        a.dout = dout.data();
        a.dtable = static_cast<char*>(dT.data()) + start * dim * static_cast<int64_t>(es);
        a.dtype = dt;
        return a;
      };
      loom_embedding_args a0 = args(0, split);
      a0.out = out0.data();
      d.ops().embedding_fwd(a0);  // slice 0 alone: zero rows for ids outside it
      a0.out = out.data();
      d.ops().embedding_fwd(a0);
      loom_embedding_args a1 = args(split, vocab - split);
      a1.out = out.data();
      a1.accumulate = 1;
      d.ops().embedding_fwd(a1);  // + slice 1 = the full lookup
      d.ops().embedding_bwd(args(0, split));
      d.ops().embedding_bwd(args(split, vocab - split));
      if (dt == LOOM_DTYPE_F32) {
        want[0] = out0.values();
        want[1] = out.values();
        want[2] = dT.values();
        continue;
      }
      expect_bf16_eq(out0.h.get(), want[0], "embedding forward, one slice");
      expect_bf16_eq(out.h.get(), want[1], "embedding forward, two slices accumulated");
      expect_bf16_eq(dT.h.get(), want[2], "embedding backward (repeated ids summed in fp32, rounded once)");
      // grad_fp32 (ABI 1.2): bf16 dout into an fp32 table = the fp32 op's sums exactly.
      DTensor dT32(d, LOOM_DTYPE_F32, dt0);
      for (const auto& [start, rows] : {std::pair<int64_t, int64_t>{0, split}, {split, vocab - split}}) {
        loom_embedding_args b = args(start, rows);
        b.dtable = dT32.f.data() + start * dim;
        b.grad_fp32 = 1;
        d.ops().embedding_bwd(b);
      }
      expect_f32_eq(dT32.values(), want[2], "embedding backward into an fp32 table (grad_fp32)");
    }
  }
}

TEST(DeviceCpu, Bf16ElementwiseEqualsFp32OnTheBf16Values) {
  for (int threads : {1, 2}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    Dev d(threads);
    const int64_t rows = 301, cols = 233, n = rows * cols;  // several chunks and widening blocks
    const std::vector<float> xv = rounded(randn(n, 90, -3, 3)), yv = rounded(randn(n, 91, -3, 3)),
                             vv = rounded(randn(cols, 92, 0.5f, 2.0f));
    struct Case {
      int32_t op;
      float alpha, beta, p;
      const char* name;
    };
    const Case cases[] = {{LOOM_EW_AXPBY, 0.3f, 1.7f, 0, "axpby"}, {LOOM_EW_AXPBY, -2.1f, 0.0f, 0, "axpby beta=0"},
                          {LOOM_EW_ADD, 0, 0, 0, "add"},           {LOOM_EW_MUL, 0, 0, 0, "mul"},
                          {LOOM_EW_SCALE, 0.37f, 0, 0, "scale"},   {LOOM_EW_FILL, 2.71828f, 0, 0, "fill"},
                          {LOOM_EW_ADD_BIAS, 0, 0, 0, "add_bias"}, {LOOM_EW_MUL_COLS, 0, 0, 0, "mul_cols"},
                          {LOOM_EW_DROPOUT, 0, 0, 0.3f, "dropout"}};
    for (const Case& c : cases) {
      std::vector<float> want;
      std::vector<uint8_t> want_mask;
      for (int32_t dt : {LOOM_DTYPE_F32, LOOM_DTYPE_BF16}) {
        const bool per_col = c.op == LOOM_EW_ADD_BIAS || c.op == LOOM_EW_MUL_COLS;
        std::vector<float> y0 = c.beta == 0.0f && c.op == LOOM_EW_AXPBY ? std::vector<float>(n, kNaN) : yv;
        DTensor x(d, dt, xv), y(d, dt, per_col ? vv : y0), out(d, dt, std::vector<float>(n, kNaN));
        Buf<uint8_t> mask(d, n);
        auto a =
            ew(c.op, n, x.data(), c.op == LOOM_EW_DROPOUT ? static_cast<void*>(mask.data()) : y.data(), out.data());
        a.alpha = c.alpha;
        a.beta = c.beta;
        a.p = c.p;
        a.seed = 1234;
        a.offset = 77;
        a.cols = cols;
        a.dtype = a.out_dtype = dt;
        d.ops().elementwise(a);
        const DTensor& result = c.op == LOOM_EW_AXPBY ? y : out;
        if (dt == LOOM_DTYPE_F32) {
          want = result.values();
          want_mask = mask.get();
          continue;
        }
        expect_bf16_eq(result.h.get(), want, std::string("elementwise ") + c.name);
        if (c.op != LOOM_EW_DROPOUT) continue;
        EXPECT_EQ(mask.get(), want_mask) << "the dropout mask does not depend on the dtype";
        // Backward with the saved mask.
        DTensor g(d, dt, yv), dx(d, dt, std::vector<float>(n, kNaN));
        Buf<float> g32(d, yv), dx32(d, n);
        auto b = ew(LOOM_EW_DROPOUT_BWD, n, g32.data(), mask.data(), dx32.data());
        b.p = c.p;
        d.ops().elementwise(b);
        b.x = g.data();
        b.out = dx.data();
        b.dtype = b.out_dtype = dt;
        d.ops().elementwise(b);
        expect_bf16_eq(dx.h.get(), dx32.get(), "elementwise dropout_bwd");
      }
    }
  }
}

TEST(DeviceCpu, Bf16ReductionsEqualFp32OnTheBf16Values) {
  for (int threads : {1, 2}) {
    SCOPED_TRACE("threads " + std::to_string(threads));
    Dev d(threads);
    const int64_t rows = 513, cols = 300, ld = 307, n = rows * cols;
    std::vector<float> xv = randn(static_cast<size_t>(rows * ld), 120, -1.0f, 1.0f);
    for (size_t i = 0; i < xv.size(); i += 97) xv[i] *= 1000.0f;
    xv = rounded(xv);
    const std::vector<float> o0 = randn(cols, 121);  // fp32 out
    std::vector<float> want[5];
    std::vector<int32_t> want_idx;
    for (int32_t dt : {LOOM_DTYPE_F32, LOOM_DTYPE_BF16}) {
      DTensor x(d, dt, xv);
      std::vector<float> got[5];
      for (int32_t op : {LOOM_RED_SUM, LOOM_RED_SUM_SQUARES, LOOM_RED_MAX_ABS}) {
        Buf<float> out(d, std::vector<float>{0.5f});
        d.ops().reduce({.op = op,
                        .n = n,
                        .x = x.data(),
                        .out = out.data(),
                        .accumulate = 1,
                        .dtype = dt,
                        .out_dtype = LOOM_DTYPE_F32});
        got[op] = out.get();
      }
      Buf<float> cs(d, o0);
      d.ops().reduce({.op = LOOM_RED_COLUMN_SUM,
                      .n = n,
                      .cols = cols,
                      .x = x.data(),
                      .out = cs.data(),
                      .accumulate = 1,
                      .dtype = dt,
                      .out_dtype = LOOM_DTYPE_F32,
                      .ld = ld});
      got[3] = cs.get();
      Buf<int32_t> idx(d, rows);
      d.ops().reduce({.op = LOOM_RED_ROW_ARGMAX,
                      .n = n,
                      .cols = cols,
                      .x = x.data(),
                      .out = idx.data(),
                      .dtype = dt,
                      .out_dtype = LOOM_DTYPE_I32,
                      .ld = ld});
      if (dt == LOOM_DTYPE_F32) {
        for (int i = 0; i < 4; ++i) want[i] = got[i];
        want_idx = idx.get();
        continue;
      }
      expect_f32_eq(got[0], want[0], "reduce sum");
      expect_f32_eq(got[1], want[1], "reduce sum_squares");
      expect_f32_eq(got[2], want[2], "reduce max_abs");
      expect_f32_eq(got[3], want[3], "reduce column_sum");
      EXPECT_EQ(idx.get(), want_idx) << "row_argmax";
      // NaN reaches an overflow check through bf16 too.
      std::vector<float> with_nan = xv;
      with_nan[4321] = kNaN;
      DTensor xn(d, dt, with_nan);
      Buf<float> out(d, 1);
      d.ops().reduce({.op = LOOM_RED_MAX_ABS,
                      .n = n,
                      .x = xn.data(),
                      .out = out.data(),
                      .dtype = dt,
                      .out_dtype = LOOM_DTYPE_F32});
      EXPECT_TRUE(std::isnan(out[0]));
    }
  }
}

TEST(DeviceCpu, Bf16OpsRecordAndReplayInGraphs) {
  Dev d(2);
  const loom_device_api* api = d.api();
  const int64_t m = 48, k = 64, n = 40;
  std::vector<float> wv = rounded(randn(m * k, 160)), xv = rounded(randn(k * n, 161));
  Buf<uint16_t> W(d, to_bf16(wv)), X(d, to_bf16(xv)), Y(d, m * n), G(d, m * n);
  Buf<float> total(d, 1);
  Y.fill(0);
  G.fill(0);
  total.fill(-1.0f);
  loom_gemm_args g = loom::make<loom_gemm_args>();
  g.m = m;
  g.n = n;
  g.k = k;
  g.a = W.data();
  g.lda = k;
  g.b = X.data();
  g.ldb = n;
  g.c = Y.data();
  g.ldc = n;
  g.batch = 1;
  g.alpha = 1.0f;
  g.dtype = g.c_dtype = LOOM_DTYPE_BF16;
  loom_gelu_args ge = loom::make<loom_gelu_args>();
  ge.n = m * n;
  ge.x = Y.data();
  ge.out = G.data();
  ge.dtype = LOOM_DTYPE_BF16;
  loom_reduce_args r = loom::make<loom_reduce_args>();
  r.op = LOOM_RED_SUM_SQUARES;
  r.n = m * n;
  r.x = G.data();
  r.out = total.data();
  r.dtype = LOOM_DTYPE_BF16;
  r.out_dtype = LOOM_DTYPE_F32;
  // What the three ops give when run directly.
  auto direct = [&] {
    d.ops().gemm(g);
    d.ops().gelu_fwd(ge);
    d.ops().reduce(r);
    return std::make_tuple(Y.get(), G.get(), total[0]);
  };
  const auto want1 = direct();
  Y.fill(0);
  G.fill(0);
  total.fill(-1.0f);
  loom::check(api->capture_begin(d.raw(), nullptr));
  loom::check(api->ops->gemm(d.raw(), nullptr, &g));
  loom::check(api->ops->gelu_fwd(d.raw(), nullptr, &ge));
  loom::check(api->ops->reduce(d.raw(), nullptr, &r));
  loom_graph* graph = nullptr;
  loom::check(api->capture_end(d.raw(), nullptr, &graph));
  EXPECT_EQ(total[0], -1.0f) << "nothing runs during capture";
  EXPECT_EQ(Y[0], 0);
  loom::check(api->graph_replay(d.raw(), graph, nullptr));
  EXPECT_EQ(Y.get(), std::get<0>(want1));
  EXPECT_EQ(G.get(), std::get<1>(want1));
  EXPECT_EQ(total[0], std::get<2>(want1));
  EXPECT_GT(total[0], 0.0f);
  // New inputs at the same addresses: the replay computes with them.
  xv = rounded(randn(k * n, 162));
  X.set(to_bf16(xv));
  loom::check(api->graph_replay(d.raw(), graph, nullptr));
  const auto replayed = std::make_tuple(Y.get(), G.get(), total[0]);
  const auto want2 = direct();
  EXPECT_EQ(std::get<0>(replayed), std::get<0>(want2));
  EXPECT_EQ(std::get<1>(replayed), std::get<1>(want2));
  EXPECT_EQ(std::get<2>(replayed), std::get<2>(want2));
  EXPECT_NE(std::get<2>(want2), std::get<2>(want1));
  api->graph_destroy(d.raw(), graph);
}

// Every op names itself and the dtype when a storage type is not f32/bf16.
TEST(DeviceCpu, UnsupportedDtypesGiveAOneLineErrorNamingOpAndDtype) {
  Dev d;
  Buf<float> buf(d, 256);
  Buf<int32_t> ids(d, std::vector<int32_t>(8, 0));
  auto expect_unsupported = [](StatusInfo s, const std::string& op, const std::string& dtype) {
    EXPECT_EQ(s.code, LOOM_CODE_UNSUPPORTED) << s.message;
    EXPECT_NE(s.message.find(op), std::string::npos) << "'" << op << "' not named in: " << s.message;
    EXPECT_NE(s.message.find(dtype), std::string::npos) << "'" << dtype << "' not named in: " << s.message;
    EXPECT_EQ(s.message.find('\n'), std::string::npos) << "not one line: " << s.message;
  };
  const loom_device_ops* ops = d.api()->ops;
  loom_gemm_args g = loom::make<loom_gemm_args>();
  g.m = g.n = g.k = 4;
  g.a = g.b = g.c = buf.data();
  g.lda = g.ldb = g.ldc = 4;
  g.batch = 1;
  g.dtype = LOOM_DTYPE_F16;
  expect_unsupported(take(ops->gemm(d.raw(), nullptr, &g)), "gemm", "f16");
  g.dtype = LOOM_DTYPE_BF16;
  g.c_dtype = LOOM_DTYPE_I32;
  expect_unsupported(take(ops->gemm(d.raw(), nullptr, &g)), "gemm", "i32");
  loom_layernorm_fwd_args lf = loom::make<loom_layernorm_fwd_args>();
  lf.rows = 2;
  lf.cols = 4;
  lf.x = lf.y = buf.data();
  lf.dtype = LOOM_DTYPE_F64;
  expect_unsupported(take(ops->layernorm_fwd(d.raw(), nullptr, &lf)), "layernorm_fwd", "f64");
  loom_layernorm_bwd_args lb = loom::make<loom_layernorm_bwd_args>();
  lb.dtype = LOOM_DTYPE_F16;
  expect_unsupported(take(ops->layernorm_bwd(d.raw(), nullptr, &lb)), "layernorm_bwd", "f16");
  loom_gelu_args ge = loom::make<loom_gelu_args>();
  ge.dtype = LOOM_DTYPE_F16;
  expect_unsupported(take(ops->gelu_fwd(d.raw(), nullptr, &ge)), "gelu_fwd", "f16");
  expect_unsupported(take(ops->gelu_bwd(d.raw(), nullptr, &ge)), "gelu_bwd", "f16");
  loom_attention_args at = loom::make<loom_attention_args>();
  at.dtype = LOOM_DTYPE_F16;
  expect_unsupported(take(ops->attention_fwd(d.raw(), nullptr, &at)), "attention_fwd", "f16");
  expect_unsupported(take(ops->attention_bwd(d.raw(), nullptr, &at)), "attention_bwd", "f16");
  loom_xent_args x = loom::make<loom_xent_args>();
  x.dtype = LOOM_DTYPE_F16;
  expect_unsupported(take(ops->xent(d.raw(), nullptr, &x)), "xent", "f16");
  loom_embedding_args e = loom::make<loom_embedding_args>();
  e.dim = 4;
  e.dtype = LOOM_DTYPE_I64;
  expect_unsupported(take(ops->embedding_fwd(d.raw(), nullptr, &e)), "embedding_fwd", "i64");
  expect_unsupported(take(ops->embedding_bwd(d.raw(), nullptr, &e)), "embedding_bwd", "i64");
  loom_elementwise_args w = ew(LOOM_EW_ADD, 4, buf.data(), buf.data(), buf.data());
  w.dtype = LOOM_DTYPE_F16;
  expect_unsupported(take(ops->elementwise(d.raw(), nullptr, &w)), "elementwise(ADD)", "f16");
  loom_reduce_args rd = loom::make<loom_reduce_args>();
  rd.n = 4;
  rd.x = rd.out = buf.data();
  rd.dtype = LOOM_DTYPE_U8;
  expect_unsupported(take(ops->reduce(d.raw(), nullptr, &rd)), "reduce", "u8");
  rd.dtype = LOOM_DTYPE_BF16;
  rd.out_dtype = LOOM_DTYPE_BF16;  // results are fp32
  expect_unsupported(take(ops->reduce(d.raw(), nullptr, &rd)), "reduce", "bf16");
  loom_adamw_args ad = loom::make<loom_adamw_args>();
  ad.grad_dtype = LOOM_DTYPE_F16;
  ad.step = 1;
  StatusInfo s = take(ops->adamw(d.raw(), nullptr, &ad));
  EXPECT_NE(s.code, LOOM_CODE_OK);
  EXPECT_NE(s.message.find("adamw"), std::string::npos) << s.message;
  EXPECT_NE(s.message.find("f16"), std::string::npos) << s.message;
  // A graph capture refuses them at launch, not at replay.
  loom::check(d.api()->capture_begin(d.raw(), nullptr));
  expect_unsupported(take(ops->gelu_fwd(d.raw(), nullptr, &ge)), "gelu_fwd", "f16");
  loom_graph* graph = nullptr;
  loom::check(d.api()->capture_end(d.raw(), nullptr, &graph));
  d.api()->graph_destroy(d.raw(), graph);
}
// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

TEST(DeviceCpu, NonFloatDtypesAreUnsupportedWithTheOpNamed) {
  Dev d;
  Buf<float> buf(d, 64);
  loom_layernorm_fwd_args ln = loom::make<loom_layernorm_fwd_args>();
  ln.rows = 2;
  ln.cols = 4;
  ln.x = buf.data();
  ln.y = buf.data();
  ln.dtype = LOOM_DTYPE_F16;
  StatusInfo s = take(d.api()->ops->layernorm_fwd(d.raw(), nullptr, &ln));
  EXPECT_EQ(s.code, LOOM_CODE_UNSUPPORTED);
  EXPECT_NE(s.message.find("layernorm_fwd"), std::string::npos) << s.message;
  EXPECT_NE(s.message.find("f16"), std::string::npos) << s.message;
  loom_attention_args at = loom::make<loom_attention_args>();
  at.dtype = LOOM_DTYPE_F16;
  s = take(d.api()->ops->attention_fwd(d.raw(), nullptr, &at));
  EXPECT_EQ(s.code, LOOM_CODE_UNSUPPORTED);
  EXPECT_NE(s.message.find("attention_fwd"), std::string::npos) << s.message;
  loom_elementwise_args e = ew(LOOM_EW_ADD, 4, buf.data(), buf.data(), buf.data());
  e.dtype = LOOM_DTYPE_I32;
  s = take(d.api()->ops->elementwise(d.raw(), nullptr, &e));
  EXPECT_EQ(s.code, LOOM_CODE_UNSUPPORTED);
  EXPECT_NE(s.message.find("ADD"), std::string::npos) << s.message;
  loom_xent_args x = loom::make<loom_xent_args>();
  x.step = 9;
  EXPECT_EQ(take(d.api()->ops->xent(d.raw(), nullptr, &x)).code, LOOM_CODE_INVALID_ARGUMENT);
  loom_xent_args zero_size{};  // struct_size 0: caught, not read past
  EXPECT_EQ(take(d.api()->ops->xent(d.raw(), nullptr, &zero_size)).code, LOOM_CODE_INVALID_ARGUMENT);
}

}  // namespace

namespace {

// MUL_COLS scales each column by its own factor (a per-channel gain).
TEST(DeviceCpu, MulColsScalesEachColumn) {
  Dev d;
  const int64_t rows = 5, cols = 7;
  std::vector<float> x(rows * cols), g(cols);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0.25f * static_cast<float>(i) - 3.f;
  for (size_t c = 0; c < g.size(); ++c) g[c] = 1.5f - 0.5f * static_cast<float>(c);
  Buf<float> bx(d, x), bg(d, g), out(d, x.size());
  d.ops().elementwise({.op = LOOM_EW_MUL_COLS, .n = rows * cols, .cols = cols, .x = bx.data(), .y = bg.data(),
                       .out = out.data(), .dtype = LOOM_DTYPE_F32, .out_dtype = LOOM_DTYPE_F32});
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) EXPECT_EQ(out[r * cols + c], x[r * cols + c] * g[c]) << r << "," << c;
}

// ROW_ARGMAX: the first maximum of each row, looking only at the first `cols`
// columns of rows `ld` apart (so vocab padding never wins).
TEST(DeviceCpu, RowArgmaxFindsTheFirstMaximumWithinCols) {
  Dev d;
  const int64_t rows = 4, cols = 5, ld = 8;
  std::vector<float> x(rows * ld, 0.f);
  const int expect[rows] = {3, 0, 2, 4};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) x[r * ld + c] = -1.f - static_cast<float>(c);
    x[r * ld + expect[r]] = 2.f;
    x[r * ld + cols] = 100.f;  // padding column: must be ignored
  }
  x[2 * ld + 4] = 2.f;  // a tie in row 2: the first index wins
  Buf<float> bx(d, x);
  Buf<int32_t> out(d, rows);
  d.ops().reduce({.op = LOOM_RED_ROW_ARGMAX, .n = rows * cols, .cols = cols, .x = bx.data(), .out = out.data(),
                  .dtype = LOOM_DTYPE_F32, .out_dtype = LOOM_DTYPE_I32, .ld = ld});
  for (int64_t r = 0; r < rows; ++r) EXPECT_EQ(out[r], expect[r]) << "row " << r;
  // COLUMN_SUM honours ld the same way.
  Buf<float> sums(d, cols);
  d.ops().reduce({.op = LOOM_RED_COLUMN_SUM, .n = rows * cols, .cols = cols, .x = bx.data(), .out = sums.data(),
                  .dtype = LOOM_DTYPE_F32, .out_dtype = LOOM_DTYPE_F32, .ld = ld});
  for (int64_t c = 0; c < cols; ++c) {
    float want = 0;
    for (int64_t r = 0; r < rows; ++r) want += x[r * ld + c];
    EXPECT_FLOAT_EQ(sums[c], want) << "column " << c;
  }
}

// ---------------------------------------------------------------------------
// ABI 1.10: RMSNorm, SwiGLU, rotary embedding, sigmoid
// ---------------------------------------------------------------------------

// RMSNorm in double: y = x * rstd * g, and the gradients of sum(w * y) (w = dy).
struct RmsRef {
  int64_t R, C;
  double eps = 1e-5;
  Vec y(const Vec& x, const Vec& g) const {
    Vec out(x.size());
    for (int64_t r = 0; r < R; ++r) {
      const double rs = rstd(x, r);
      for (int64_t c = 0; c < C; ++c) out[r * C + c] = x[r * C + c] * rs * g[c];
    }
    return out;
  }
  double rstd(const Vec& x, int64_t r) const {
    double ss = 0;
    for (int64_t c = 0; c < C; ++c) ss += x[r * C + c] * x[r * C + c];
    return 1.0 / std::sqrt(ss / C + eps);
  }
  // dx and dg of sum(w * y).
  void grads(const Vec& x, const Vec& g, const Vec& w, Vec& dx, Vec& dg) const {
    dx.assign(x.size(), 0.0);
    dg.assign(g.size(), 0.0);
    for (int64_t r = 0; r < R; ++r) {
      const double rs = rstd(x, r);
      double dot = 0;  // sum_c w g xhat
      for (int64_t c = 0; c < C; ++c) dot += w[r * C + c] * g[c] * x[r * C + c] * rs;
      for (int64_t c = 0; c < C; ++c) {
        const double xh = x[r * C + c] * rs;
        dx[r * C + c] = rs * (w[r * C + c] * g[c] - xh * dot / C);
        dg[c] += w[r * C + c] * xh;
      }
    }
  }
};

TEST(DeviceCpu, RmsNormReferenceGradientsMatchFiniteDifferences) {
  const RmsRef ref{3, 5};
  Vec x = to_d(randn(15, 31)), g = to_d(randn(5, 32, 0.5f, 1.5f)), w = to_d(randn(15, 33));
  Vec dx, dg;
  ref.grads(x, g, w, dx, dg);
  auto loss = [&] { return dot(w, ref.y(x, g)); };
  expect_fd(x, loss, dx, "rmsnorm dx");
  expect_fd(g, loss, dg, "rmsnorm dgamma");
}

TEST(DeviceCpu, RmsNormMatchesReference) {
  const int64_t R = 37, C = 300;  // several chunks of rows and of columns
  const RmsRef ref{R, C};
  const std::vector<float> xv = randn(R * C, 34, -2.0f, 2.0f), gv = randn(C, 35, 0.5f, 1.5f), dyv = randn(R * C, 36),
                           dx0 = randn(R * C, 37), dg0 = randn(C, 38);
  Dev d(3);
  Buf<float> x(d, xv), g(d, gv), y(d, R * C), rstd(d, R), dy(d, dyv), dx(d, dx0), dgamma(d, dg0);
  loom_rmsnorm_fwd_args f = loom::make<loom_rmsnorm_fwd_args>();
  f.rows = R, f.cols = C, f.x = x.data(), f.gamma = g.data(), f.y = y.data(), f.rstd = rstd.data();
  f.eps = 1e-5f;
  d.ops().rmsnorm_fwd(f);
  expect_close(y.get(), ref.y(to_d(xv), to_d(gv)), 1e-5, 1e-5, "rmsnorm y");
  for (int64_t r = 0; r < R; ++r) EXPECT_NEAR(rstd[r], ref.rstd(to_d(xv), r), 1e-5 * ref.rstd(to_d(xv), r));
  Vec want_dx, want_dg;
  ref.grads(to_d(xv), to_d(gv), to_d(dyv), want_dx, want_dg);
  loom_rmsnorm_bwd_args b = loom::make<loom_rmsnorm_bwd_args>();
  b.rows = R, b.cols = C, b.dy = dy.data(), b.x = x.data(), b.gamma = g.data(), b.rstd = rstd.data();
  b.dx = dx.data(), b.dgamma = dgamma.data(), b.accumulate_dx = 1;
  d.ops().rmsnorm_bwd(b);
  for (size_t i = 0; i < want_dx.size(); ++i) want_dx[i] += dx0[i];  // accumulated
  for (size_t i = 0; i < want_dg.size(); ++i) want_dg[i] += dg0[i];
  expect_close(dx.get(), want_dx, 1e-5, 1e-5, "rmsnorm dx (+=)");
  expect_close(dgamma.get(), want_dg, 1e-4, 1e-5, "rmsnorm dgamma (+=)");
  // dx overwritten, in place over dy.
  b.accumulate_dx = 0, b.dgamma = nullptr, b.dx = dy.data();
  d.ops().rmsnorm_bwd(b);
  for (size_t i = 0; i < want_dx.size(); ++i) want_dx[i] -= dx0[i];
  expect_close(dy.get(), want_dx, 1e-5, 1e-5, "rmsnorm dx in place");
}

// bf16 storage: the fp32 op on the bf16 values, rounded once (bit for bit), and
// dgamma into fp32 with grad_fp32.
TEST(DeviceCpu, Bf16RmsNormEqualsFp32OnTheBf16Values) {
  const int64_t R = 9, C = 130;
  std::vector<float> xv = randn(R * C, 40, -3.0f, 3.0f), gv = randn(C, 41, 0.5f, 1.5f), dyv = randn(R * C, 42);
  for (std::vector<float>* v : {&xv, &gv, &dyv})
    for (float& e : *v) e = bf16_round_ref(e);
  auto to_bf16 = [](const std::vector<float>& v) {
    std::vector<uint16_t> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      uint32_t u;
      std::memcpy(&u, &v[i], 4);
      h[i] = static_cast<uint16_t>(u >> 16);  // exact: the values are bf16 already
    }
    return h;
  };
  auto from_bf16 = [](const std::vector<uint16_t>& h) {
    std::vector<float> v(h.size());
    for (size_t i = 0; i < h.size(); ++i) {
      const uint32_t u = static_cast<uint32_t>(h[i]) << 16;
      std::memcpy(&v[i], &u, 4);
    }
    return v;
  };
  Dev d(2);
  Buf<float> x32(d, xv), g32(d, gv), y32(d, R * C), r32(d, R), dy32(d, dyv), dx32(d, R * C), dg32(d, C);
  Buf<uint16_t> x16(d, to_bf16(xv)), g16(d, to_bf16(gv)), y16(d, R * C), dy16(d, to_bf16(dyv)), dx16(d, R * C);
  Buf<float> r16(d, R), dg16(d, C);
  dg32.fill(0.0f);
  dg16.fill(0.0f);
  loom_rmsnorm_fwd_args f = loom::make<loom_rmsnorm_fwd_args>();
  f.rows = R, f.cols = C, f.x = x32.data(), f.gamma = g32.data(), f.y = y32.data(), f.rstd = r32.data(), f.eps = 1e-6f;
  d.ops().rmsnorm_fwd(f);
  f.x = x16.data(), f.gamma = g16.data(), f.y = y16.data(), f.rstd = r16.data(), f.dtype = LOOM_DTYPE_BF16;
  d.ops().rmsnorm_fwd(f);
  const std::vector<float> y16v = from_bf16(y16.get()), y32v = y32.get();
  for (size_t i = 0; i < y32v.size(); ++i) ASSERT_EQ(y16v[i], bf16_round_ref(y32v[i])) << "y[" << i << "]";
  EXPECT_EQ(r16.get(), r32.get());
  loom_rmsnorm_bwd_args b = loom::make<loom_rmsnorm_bwd_args>();
  b.rows = R, b.cols = C, b.dy = dy32.data(), b.x = x32.data(), b.gamma = g32.data(), b.rstd = r32.data();
  b.dx = dx32.data(), b.dgamma = dg32.data();
  d.ops().rmsnorm_bwd(b);
  b.dy = dy16.data(), b.x = x16.data(), b.gamma = g16.data(), b.rstd = r16.data(), b.dx = dx16.data();
  b.dgamma = dg16.data(), b.dtype = LOOM_DTYPE_BF16, b.grad_fp32 = 1;
  d.ops().rmsnorm_bwd(b);
  const std::vector<float> dx16v = from_bf16(dx16.get()), dx32v = dx32.get();
  for (size_t i = 0; i < dx32v.size(); ++i) ASSERT_EQ(dx16v[i], bf16_round_ref(dx32v[i])) << "dx[" << i << "]";
  EXPECT_EQ(dg16.get(), dg32.get());  // fp32 main gradients: the same sums
}

double silu_ref(double g) { return g / (1.0 + std::exp(-g)); }

TEST(DeviceCpu, SwigluMatchesReferenceAndFiniteDifferences) {
  const int64_t R = 23, C = 77;
  Vec xs = to_d(randn(2 * 8, 50, -6.0f, 6.0f)), w = to_d(randn(8, 51));
  auto swiglu = [&](const Vec& x) {  // one row of 8 outputs
    Vec out(8);
    for (int c = 0; c < 8; ++c) out[c] = silu_ref(x[c]) * x[8 + c];
    return out;
  };
  Vec grad(16);
  for (int c = 0; c < 8; ++c) {
    const double g = xs[c], u = xs[8 + c], s = 1.0 / (1.0 + std::exp(-g));
    grad[c] = w[c] * u * (s + g * s * (1 - s));
    grad[8 + c] = w[c] * silu_ref(g);
  }
  expect_fd(xs, [&] { return dot(w, swiglu(xs)); }, grad, "swiglu reference");

  const std::vector<float> xv = randn(R * 2 * C, 52, -8.0f, 8.0f), dyv = randn(R * C, 53);
  Dev d(3);
  Buf<float> x(d, xv), dy(d, dyv), y(d, R * C), dx(d, R * 2 * C);
  loom_swiglu_args a = loom::make<loom_swiglu_args>();
  a.rows = R, a.cols = C, a.x = x.data(), a.out = y.data();
  d.ops().swiglu_fwd(a);
  a.dy = dy.data(), a.out = dx.data();
  d.ops().swiglu_bwd(a);
  Vec want_y(R * C), want_dx(R * 2 * C);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      const double g = xv[r * 2 * C + c], u = xv[r * 2 * C + C + c], s = 1.0 / (1.0 + std::exp(-g));
      want_y[r * C + c] = silu_ref(g) * u;
      want_dx[r * 2 * C + c] = dyv[r * C + c] * u * (s + g * s * (1 - s));
      want_dx[r * 2 * C + C + c] = dyv[r * C + c] * silu_ref(g);
    }
  expect_close(y.get(), want_y, 1e-6, 2e-6, "swiglu y");
  expect_close(dx.get(), want_dx, 1e-6, 2e-6, "swiglu dx");
}

// RoPE in double, rotate-half pairs (i, i + R/2) of each head; angle p * theta^(-2i/R),
// or p * freqs[i] when given, that product in fp32 as the op (and Megatron-LM) forms it.
Vec rope_ref(const Vec& x, const std::vector<int32_t>& pos, int64_t T, int64_t H, int64_t D, int64_t Rd, int64_t st,
             double theta, double sign, const std::vector<float>* freqs = nullptr) {
  Vec out = x;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < Rd / 2; ++i) {
        const double inv = freqs ? (*freqs)[static_cast<size_t>(i)] : std::pow(theta, -2.0 * i / Rd);
        const double ang = freqs ? static_cast<double>(static_cast<float>(pos[t]) * (*freqs)[static_cast<size_t>(i)])
                                 : pos[t] * inv;
        const double c = std::cos(ang), s = sign * std::sin(ang);
        const int64_t a = t * st + h * D + i, b = a + Rd / 2;
        out[a] = x[a] * c - x[b] * s;
        out[b] = x[b] * c + x[a] * s;
      }
  return out;
}

TEST(DeviceCpu, RopeRotatesPairsAndItsBackwardIsTheTranspose) {
  const int64_t T = 29, H = 3, D = 10, Rd = 6, st = H * D + 4;  // partial rotary dims, a gap between tokens
  std::vector<int32_t> pos(T);
  for (int64_t t = 0; t < T; ++t) pos[t] = static_cast<int32_t>((t * 37) % 200);
  const std::vector<float> xv = randn(T * st, 60), yv = randn(T * st, 61);
  Dev d(2);
  Buf<float> x(d, xv), y(d, yv), out(d, T * st), back(d, T * st);
  Buf<int32_t> p(d, pos);
  out.fill(7.0f);
  loom_rope_args a = loom::make<loom_rope_args>();
  a.tokens = T, a.heads = H, a.head_dim = D, a.rotary_dim = Rd, a.stride_t = st;
  a.x = x.data(), a.out = out.data(), a.positions = p.data(), a.theta = 10000.0f;
  d.ops().rope_fwd(a);
  Vec want = rope_ref(to_d(xv), pos, T, H, D, Rd, st, 10000.0, 1.0);
  std::vector<float> got = out.get();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = H * D; k < st; ++k) {
      EXPECT_EQ(got[t * st + k], 7.0f) << "the gap between tokens was written";
      got[t * st + k] = static_cast<float>(want[t * st + k]);
    }
  expect_close(got, want, 2e-6, 2e-6, "rope fwd");
  // Backward is the transpose: <rope(x), y> = <x, rope_bwd(y)> over the heads' elements.
  a.x = y.data(), a.out = back.data();
  d.ops().rope_bwd(a);
  double lhs = 0, rhs = 0;
  const std::vector<float> bv = back.get();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < H * D; ++k) {
      lhs += want[t * st + k] * yv[t * st + k];
      rhs += xv[t * st + k] * static_cast<double>(bv[t * st + k]);
    }
  EXPECT_NEAR(lhs, rhs, 1e-4 * std::max(1.0, std::fabs(lhs)));
  // In place equals out of place.
  a.x = x.data(), a.out = x.data();
  d.ops().rope_fwd(a);
  const std::vector<float> inplace = x.get();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < H * D; ++k) EXPECT_EQ(inplace[t * st + k], out[t * st + k]) << t << "," << k;
}

// ABI 1.20: the caller's frequencies (a scaled rotary embedding) in place of theta's,
// forward and backward; the device says it reads them.
TEST(DeviceCpu, RopeTakesTheCallersFrequencies) {
  const int64_t T = 13, H = 2, D = 8, Rd = 8, st = H * D;
  std::vector<int32_t> pos(T);
  for (int64_t t = 0; t < T; ++t) pos[t] = static_cast<int32_t>(t * 101 % 9000);
  const std::vector<float> freqs = {1.0f, 0.3f, 2.5e-3f, 1.7e-5f};  // any table, not theta's
  const std::vector<float> xv = randn(T * st, 62);
  Dev d(1);
  EXPECT_NE(d.api()->features & LOOM_DEVICE_ROPE_FREQUENCIES, 0u);
  Buf<float> x(d, xv), out(d, T * st), back(d, T * st), f(d, freqs);
  Buf<int32_t> p(d, pos);
  loom_rope_args a = loom::make<loom_rope_args>();
  a.tokens = T, a.heads = H, a.head_dim = D, a.rotary_dim = Rd, a.stride_t = st;
  a.x = x.data(), a.out = out.data(), a.positions = p.data(), a.theta = 10000.0f, a.inv_freq = f.data();
  d.ops().rope_fwd(a);
  expect_close(out.get(), rope_ref(to_d(xv), pos, T, H, D, Rd, st, 10000.0, 1.0, &freqs), 2e-6, 2e-6, "rope fwd");
  a.x = out.data(), a.out = back.data();
  d.ops().rope_bwd(a);
  expect_close(back.get(), to_d(xv), 2e-6, 2e-6, "rope bwd undoes it");
  // The theta table passed as frequencies is theta's rotation.
  std::vector<float> theta_table(Rd / 2);
  for (int64_t i = 0; i < Rd / 2; ++i)
    theta_table[static_cast<size_t>(i)] = static_cast<float>(std::pow(10000.0, -2.0 * static_cast<double>(i) / Rd));
  Buf<float> tf(d, theta_table), with(d, T * st), without(d, T * st);
  a.x = x.data(), a.out = with.data(), a.inv_freq = tf.data();
  d.ops().rope_fwd(a);
  a.out = without.data(), a.inv_freq = nullptr;
  d.ops().rope_fwd(a);
  EXPECT_EQ(with.get(), without.get());
}

TEST(DeviceCpu, SigmoidMatchesReference) {
  const size_t n = 50001;
  const std::vector<float> xv = randn(n, 70, -20.0f, 20.0f), dyv = randn(n, 71);
  Dev d(2);
  Buf<float> x(d, xv), dy(d, dyv), y(d, n), dx(d, n);
  loom_activation_args a = loom::make<loom_activation_args>();
  a.n = static_cast<int64_t>(n), a.x = x.data(), a.out = y.data();
  d.ops().sigmoid_fwd(a);
  a.dy = dy.data(), a.out = dx.data();
  d.ops().sigmoid_bwd(a);
  Vec wy(n), wdx(n);
  for (size_t i = 0; i < n; ++i) {
    const double s = 1.0 / (1.0 + std::exp(-static_cast<double>(xv[i])));
    wy[i] = s;
    wdx[i] = dyv[i] * s * (1 - s);
  }
  expect_close(y.get(), wy, 1e-7, 1e-6, "sigmoid y");
  expect_close(dx.get(), wdx, 1e-7, 1e-6, "sigmoid dx");
}

TEST(DeviceCpu, LlamaOpsRefuseBadArgumentsNamingTheOp) {
  Dev d(1);
  Buf<float> x(d, 64), y(d, 64);
  Buf<int32_t> p(d, 4);
  loom_rope_args r = loom::make<loom_rope_args>();
  r.tokens = 4, r.heads = 2, r.head_dim = 8, r.rotary_dim = 7, r.stride_t = 16, r.x = x.data(), r.out = y.data();
  r.positions = p.data(), r.theta = 10000.0f;
  try {
    d.ops().rope_fwd(r);
    ADD_FAILURE() << "an odd rotary_dim was accepted";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rope_fwd: rotary_dim (7) must be even"), std::string::npos) << e.what();
  }
  r.rotary_dim = 8, r.stride_t = 15;
  EXPECT_THROW(d.ops().rope_bwd(r), loom::Error);  // stride_t smaller than heads * head_dim
  loom_rmsnorm_fwd_args f = loom::make<loom_rmsnorm_fwd_args>();
  f.rows = 2, f.cols = 0, f.x = x.data(), f.gamma = x.data(), f.y = y.data();
  try {
    d.ops().rmsnorm_fwd(f);
    ADD_FAILURE() << "cols = 0 was accepted";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rmsnorm_fwd: rows must be >= 0 and cols > 0"), std::string::npos) << e.what();
  }
  loom_swiglu_args s = loom::make<loom_swiglu_args>();
  s.rows = 2, s.cols = 4, s.x = x.data(), s.out = y.data();
  try {
    d.ops().swiglu_bwd(s);  // no dy
    ADD_FAILURE() << "swiglu_bwd without dy was accepted";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("swiglu_bwd: x, out and dy must not be NULL"), std::string::npos) << e.what();
  }
}

}  // namespace
