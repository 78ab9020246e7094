// device/cuda against device/cpu: every op on fresh random inputs, on both
// devices, loaded through the engine's plugin registry as a run loads them.
// Tolerances, relative to the largest magnitude of the reference tensor: fp32
// 1e-5, TF32 1e-3, bf16 1e-2 (inputs are rounded to bf16 first, so the CPU's fp32
// reference sees the same values); NaN never passes. Also: allocator statistics,
// streams and events, graph capture/replay, error reporting.
//
// Without a visible GPU (cudaGetDeviceCount reports none) every test that needs
// one is skipped with that reason; the plugin's descriptor and its refusal to
// create a device are still checked.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <toml++/toml.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <loom/cpp/core.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "engine/plugins/registry.hpp"
#include "tests/gpu/plugin_dir.hpp"

namespace {

// ---------------------------------------------------------------------------
// GPU presence, plugins, devices
// ---------------------------------------------------------------------------

struct GpuInfo {
  int count = 0;
  std::string why;  // when count == 0
};
const GpuInfo& gpu_info() {
  static const GpuInfo info = [] {
    GpuInfo g;
    const cudaError_t err = cudaGetDeviceCount(&g.count);
    if (err != cudaSuccess) {
      g.count = 0;
      g.why = std::string("no CUDA GPU visible: cudaGetDeviceCount returned ") + cudaGetErrorName(err) + " (" +
              cudaGetErrorString(err) + ")";
      cudaGetLastError();
    } else if (g.count == 0) {
      g.why = "no CUDA GPU visible: cudaGetDeviceCount reports 0 devices";
    }
    return g;
  }();
  return info;
}
#define REQUIRE_GPU()                                                  \
  do {                                                                 \
    if (gpu_info().count == 0) GTEST_SKIP() << gpu_info().why;         \
  } while (0)

loom::plugins::Registry& registry() {
  static loom::plugins::Registry* r = [] {
    auto* reg = new loom::plugins::Registry();  // plugins are never unloaded
    reg->load_file(loom_test::plugin_file("loom_device_cpu.so"));
    reg->load_file(loom_test::plugin_file("loom_device_cuda.so"));
    loom::host_slot() = loom::plugins::host_api();
    return reg;
  }();
  return *r;
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

class Dev {
 public:
  explicit Dev(const std::string& name, toml::table section = {}) {
    const loom::plugins::LoadedPlugin& p = registry().get("device", name);
    api_ = p.device();
    loom::plugins::OptionValues opts(&section, p.options);
    loom_device_create_args args = loom::make<loom_device_create_args>();
    args.num_threads = 2;
    args.ranks_in_process = 1;
    loom::check(api_->create(opts.raw(), &args, &dev_));
  }
  ~Dev() { api_->destroy(dev_); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  const loom_device_api* api() const { return api_; }
  loom_device* raw() const { return dev_; }
  loom::Device ops(loom_stream* s = nullptr) const { return loom::Device(api_, dev_, s); }
  void* alloc(size_t bytes) const {
    void* p = nullptr;
    loom::check(api_->alloc(dev_, std::max<size_t>(bytes, 1), &p));
    return p;
  }
  void free(void* p) const { api_->free(dev_, p); }
  void upload(void* dst, const void* src, size_t bytes) const {
    loom::check(api_->copy(dev_, nullptr, dst, src, bytes, LOOM_COPY_HOST_TO_DEVICE));
    sync();
  }
  void download(void* dst, const void* src, size_t bytes) const {
    loom::check(api_->copy(dev_, nullptr, dst, src, bytes, LOOM_COPY_DEVICE_TO_HOST));
    sync();
  }
  void sync() const { loom::check(api_->stream_synchronize(dev_, nullptr)); }
  loom_memory_stats stats() const {
    loom_memory_stats m = loom::make<loom_memory_stats>();
    loom::check(api_->memory_stats(dev_, &m));
    return m;
  }

 private:
  const loom_device_api* api_ = nullptr;
  loom_device* dev_ = nullptr;
};

// ---------------------------------------------------------------------------
// Numbers
// ---------------------------------------------------------------------------

uint16_t bf16_bits(float f) {  // round to nearest even (the tests' own copy)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float bf16_value(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
float round_bf16(float f) { return bf16_value(bf16_bits(f)); }

std::vector<float> randu(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

// max |got - want| <= tol * max |want|; NaN in got never passes.
void expect_rel(const std::vector<float>& got, const std::vector<float>& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  // The scale is over finite reference values only: one inf would make every error 0.
  double scale = 0;
  for (float w : want)
    if (std::isfinite(w)) scale = std::max(scale, std::fabs(static_cast<double>(w)));
  scale = std::max(scale, 1e-30);
  int reported = 0;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]) / scale;
    // A non-finite reference must be matched exactly (inf by inf; NaN never matches).
    const bool ok = std::isfinite(want[i]) ? !std::isnan(got[i]) && err <= tol : got[i] == want[i];
    if (!ok) {
      if (reported++ < 5)
        ADD_FAILURE() << what << "[" << i << "]: cuda " << got[i] << ", cpu " << want[i] << " (error " << err
                      << " of max |cpu| " << scale << ", tolerance " << tol << ")";
    }
    if (!std::isnan(err)) worst = std::max(worst, err);
  }
  ::testing::Test::RecordProperty(what, std::to_string(worst));
}

constexpr int32_t F32 = LOOM_DTYPE_F32, BF16 = LOOM_DTYPE_BF16;
double tol_of(int32_t dt) { return dt == BF16 ? 1e-2 : 1e-5; }

// The CPU reference device and the GPU under test.
struct Env {
  Dev cpu{"cpu"};
  Dev gpu;
  explicit Env(toml::table gpu_options = {}) : gpu("cuda", std::move(gpu_options)) {}
};

// A float tensor on both devices with the same values: fp32 on the CPU, `dtype`
// (fp32 or bf16) on the GPU; bf16 values are rounded first so both see them.
class Tensor {
 public:
  Tensor(Env& env, std::vector<float> values, int32_t dtype = F32) : env_(env), dtype_(dtype), n_(values.size()) {
    if (dtype == BF16)
      for (float& v : values) v = round_bf16(v);
    c_ = env.cpu.alloc(n_ * 4);
    g_ = env.gpu.alloc(n_ * esize());
    set(values);
  }
  Tensor(Env& env, size_t n, int32_t dtype = F32) : Tensor(env, std::vector<float>(n, 0.0f), dtype) {}
  ~Tensor() {
    env_.cpu.free(c_);
    env_.gpu.free(g_);
  }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  size_t esize() const { return dtype_ == BF16 ? 2 : 4; }
  void set(const std::vector<float>& v) {
    env_.cpu.upload(c_, v.data(), n_ * 4);
    if (dtype_ == BF16) {
      std::vector<uint16_t> h(n_);
      for (size_t i = 0; i < n_; ++i) h[i] = bf16_bits(v[i]);
      env_.gpu.upload(g_, h.data(), n_ * 2);
    } else {
      env_.gpu.upload(g_, v.data(), n_ * 4);
    }
  }
  float* c() const { return static_cast<float*>(c_); }
  void* g() const { return g_; }
  std::vector<float> cpu() const {
    std::vector<float> v(n_);
    env_.cpu.download(v.data(), c_, n_ * 4);
    return v;
  }
  std::vector<float> gpu() const {
    std::vector<float> v(n_);
    if (dtype_ == BF16) {
      std::vector<uint16_t> h(n_);
      env_.gpu.download(h.data(), g_, n_ * 2);
      for (size_t i = 0; i < n_; ++i) v[i] = bf16_value(h[i]);
    } else {
      env_.gpu.download(v.data(), g_, n_ * 4);
    }
    return v;
  }
  void expect_match(const std::string& what, double tol = -1) const {
    expect_rel(gpu(), cpu(), tol >= 0 ? tol : tol_of(dtype_), what);
  }

 private:
  Env& env_;
  int32_t dtype_;
  size_t n_;
  void* c_ = nullptr;
  void* g_ = nullptr;
};

// Raw bytes on both devices (ids, targets, masks, argmax results).
template <typename T>
class Raw {
 public:
  Raw(Env& env, const std::vector<T>& v) : env_(env), n_(v.size()) {
    c_ = env.cpu.alloc(n_ * sizeof(T));
    g_ = env.gpu.alloc(n_ * sizeof(T));
    env.cpu.upload(c_, v.data(), n_ * sizeof(T));
    env.gpu.upload(g_, v.data(), n_ * sizeof(T));
  }
  ~Raw() {
    env_.cpu.free(c_);
    env_.gpu.free(g_);
  }
  Raw(const Raw&) = delete;
  Raw& operator=(const Raw&) = delete;
  T* c() const { return static_cast<T*>(c_); }
  T* g() const { return static_cast<T*>(g_); }
  std::vector<T> cpu() const {
    std::vector<T> v(n_);
    env_.cpu.download(v.data(), c_, n_ * sizeof(T));
    return v;
  }
  std::vector<T> gpu() const {
    std::vector<T> v(n_);
    env_.gpu.download(v.data(), g_, n_ * sizeof(T));
    return v;
  }

 private:
  Env& env_;
  size_t n_;
  void* c_;
  void* g_;
};

// Runs `build(on_gpu)` on both devices: build returns the args with the pointers
// of that device; the CPU always gets dtype f32.
template <typename Args>
void both(Env& env, void (loom::Device::*op)(Args) const, const std::function<Args(bool)>& build) {
  Args c = build(false);
  (env.cpu.ops().*op)(c);
  Args g = build(true);
  (env.gpu.ops().*op)(g);
  env.cpu.sync();
  env.gpu.sync();
}

// ---------------------------------------------------------------------------
// Descriptor (runs without a GPU too)
// ---------------------------------------------------------------------------

TEST(DeviceCuda, DescribesItselfAndFillsEverySlot) {
  const loom::plugins::LoadedPlugin& p = registry().get("device", "cuda");
  const loom_device_api* api = p.device();
  ASSERT_NE(api, nullptr);
  EXPECT_EQ(api->dl_device_type, kDLCUDA);
  const void* slots[] = {(void*)api->create,          (void*)api->destroy,          (void*)api->alloc,
                         (void*)api->free,            (void*)api->memory_stats,     (void*)api->copy,
                         (void*)api->stream_create,   (void*)api->stream_destroy,   (void*)api->stream_synchronize,
                         (void*)api->event_create,    (void*)api->event_destroy,    (void*)api->event_record,
                         (void*)api->stream_wait_event, (void*)api->event_synchronize, (void*)api->capture_begin,
                         (void*)api->capture_end,     (void*)api->graph_replay,     (void*)api->graph_destroy,
                         (void*)api->native_stream};
  for (const void* s : slots) EXPECT_NE(s, nullptr);
  // ABI 1.2: the table reaches copy_2d and features, and honours grad_fp32.
  ASSERT_TRUE(LOOM_HAS_SLOT(api, loom_device_api, features)) << "struct_size " << api->struct_size;
  EXPECT_NE((void*)api->copy_2d, nullptr);
  EXPECT_NE(api->features & LOOM_DEVICE_GRAD_FP32, 0ull);
  const loom_device_ops* ops = api->ops;
  ASSERT_NE(ops, nullptr);
  const void* op_slots[] = {(void*)ops->gemm,          (void*)ops->layernorm_fwd, (void*)ops->layernorm_bwd,
                            (void*)ops->gelu_fwd,      (void*)ops->gelu_bwd,      (void*)ops->attention_fwd,
                            (void*)ops->attention_bwd, (void*)ops->xent,          (void*)ops->embedding_fwd,
                            (void*)ops->embedding_bwd, (void*)ops->elementwise,   (void*)ops->reduce,
                            (void*)ops->adamw,         (void*)ops->rmsnorm_fwd,   (void*)ops->rmsnorm_bwd,
                            (void*)ops->swiglu_fwd,    (void*)ops->swiglu_bwd,    (void*)ops->rope_fwd,
                            (void*)ops->rope_bwd,      (void*)ops->sigmoid_fwd,   (void*)ops->sigmoid_bwd};
  for (const void* s : op_slots) EXPECT_NE(s, nullptr);
  std::vector<std::string> names;
  for (const auto& o : p.options) names.push_back(o.name);
  for (const char* want : {"tf32", "gpu", "caching_allocator", "workspace_mb"})
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << want;
}

TEST(DeviceCuda, WithoutAGpuCreateFailsWithUnsupported) {
  if (gpu_info().count > 0) GTEST_SKIP() << "a GPU is visible";
  const loom::plugins::LoadedPlugin& p = registry().get("device", "cuda");
  loom::plugins::OptionValues opts(nullptr, p.options);
  loom_device_create_args args = loom::make<loom_device_create_args>();
  args.global_rank = 3;
  loom_device* dev = nullptr;
  const StatusInfo s = take(p.device()->create(opts.raw(), &args, &dev));
  EXPECT_EQ(dev, nullptr);
  EXPECT_EQ(s.code, LOOM_CODE_UNSUPPORTED);
  EXPECT_NE(s.message.find("rank 3"), std::string::npos) << s.message;
  EXPECT_NE(s.message.find("no CUDA GPU"), std::string::npos) << s.message;
}

// ---------------------------------------------------------------------------
// GEMM
// ---------------------------------------------------------------------------

struct GemmCase {
  int ta, tb;
  int64_t m, n, k, batch;
  float alpha, beta;
};

void check_gemm(Env& env, const GemmCase& g, int32_t ab, int32_t cd, uint32_t seed, double tol) {
  const int64_t a_rows = g.ta ? g.k : g.m, a_cols = g.ta ? g.m : g.k;
  const int64_t b_rows = g.tb ? g.n : g.k, b_cols = g.tb ? g.k : g.n;
  const int64_t lda = a_cols + 3, ldb = b_cols + 2, ldc = g.n + 5;
  const int64_t sa = a_rows * lda + 7, sb = b_rows * ldb + 1, sc = g.m * ldc + 3;
  Tensor A(env, randu(static_cast<size_t>(sa * g.batch), seed), ab);
  Tensor B(env, randu(static_cast<size_t>(sb * g.batch), seed + 1), ab);
  Tensor C(env, randu(static_cast<size_t>(sc * g.batch), seed + 2), cd);
  both<loom_gemm_args>(env, &loom::Device::gemm, [&](bool gpu) {
    loom_gemm_args a = loom::make<loom_gemm_args>();
    a.trans_a = g.ta;
    a.trans_b = g.tb;
    a.m = g.m;
    a.n = g.n;
    a.k = g.k;
    a.a = gpu ? A.g() : A.c();
    a.lda = lda;
    a.stride_a = sa;
    a.b = gpu ? B.g() : B.c();
    a.ldb = ldb;
    a.stride_b = sb;
    a.c = gpu ? C.g() : C.c();
    a.ldc = ldc;
    a.stride_c = sc;
    a.batch = g.batch;
    a.alpha = g.alpha;
    a.beta = g.beta;
    a.dtype = gpu ? ab : F32;
    a.c_dtype = gpu ? cd : F32;
    return a;
  });
  std::ostringstream what;
  what << "gemm ta=" << g.ta << " tb=" << g.tb << " m=" << g.m << " n=" << g.n << " k=" << g.k << " batch=" << g.batch
       << " beta=" << g.beta << " ab=" << ab << " c=" << cd;
  C.expect_match(what.str(), tol);
}

void gemm_sweep(Env& env, int32_t ab, int32_t cd, double tol) {
  uint32_t seed = 10;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      check_gemm(env, {ta, tb, 5, 7, 3, 1, 1.0f, 0.0f}, ab, cd, seed++, tol);
      check_gemm(env, {ta, tb, 13, 9, 17, 3, 0.75f, 0.0f}, ab, cd, seed++, tol);
      check_gemm(env, {ta, tb, 13, 9, 17, 3, -1.5f, 1.0f}, ab, cd, seed++, tol);
      check_gemm(env, {ta, tb, 300, 100, 80, 1, 1.0f, 0.5f}, ab, cd, seed++, tol);
      check_gemm(env, {ta, tb, 64, 600, 256, 2, 1.0f, 0.0f}, ab, cd, seed++, tol);
    }
  check_gemm(env, {0, 0, 6, 4, 0, 2, 1.0f, 0.0f}, ab, cd, seed++, tol);  // k = 0: C = beta C
  check_gemm(env, {0, 1, 6, 4, 5, 2, 0.0f, 2.0f}, ab, cd, seed++, tol);  // alpha = 0
}

TEST(DeviceCuda, GemmFp32MatchesCpu) {
  REQUIRE_GPU();
  Env env;
  gemm_sweep(env, F32, F32, 1e-5);
}

TEST(DeviceCuda, GemmTf32WhenTheOptionAllowsIt) {
  REQUIRE_GPU();
  Env env(toml::table{{"tf32", true}});
  gemm_sweep(env, F32, F32, 1e-3);
}

TEST(DeviceCuda, GemmBf16InputsWithFp32AndBf16Output) {
  REQUIRE_GPU();
  Env env;
  gemm_sweep(env, BF16, F32, 1e-2);
  gemm_sweep(env, BF16, BF16, 1e-2);
  gemm_sweep(env, F32, BF16, 1e-2);  // fp32 inputs, bf16 output (not a cuBLAS type combination)
}

// A bf16 C accumulates the batch in fp32 and is rounded once, as on device/cpu.
TEST(DeviceCuda, GemmSumsOverBatchWhenCStrideIsZero) {
  REQUIRE_GPU();
  Env env;
  const int64_t m = 8, n = 6, k = 5, batch = 4;
  for (const int32_t c_dt : {F32, BF16}) {
    Tensor A(env, randu(m * k * batch, 30)), B(env, randu(k * n * batch, 31)), C(env, randu(m * n, 32), c_dt);
    both<loom_gemm_args>(env, &loom::Device::gemm, [&](bool gpu) {
      loom_gemm_args a = loom::make<loom_gemm_args>();
      a.m = m;
      a.n = n;
      a.k = k;
      a.a = gpu ? A.g() : A.c();
      a.lda = k;
      a.stride_a = m * k;
      a.b = gpu ? B.g() : B.c();
      a.ldb = n;
      a.stride_b = k * n;
      a.c = gpu ? C.g() : C.c();
      a.ldc = n;
      a.stride_c = 0;
      a.batch = batch;
      a.alpha = 1.0f;
      a.beta = 1.0f;
      a.c_dtype = gpu ? c_dt : F32;  // the reference keeps C in fp32
      return a;
    });
    // bf16 C: one rounding of the fp32 sum (half an ulp, 2^-9 relative); rounding
    // after every batch element would drift up to four times that.
    if (c_dt == BF16) C.expect_match("gemm stride_c = 0, bf16 C", 2.5e-3);
    else C.expect_match("gemm stride_c = 0");
  }
}

// ABI 1.11 GEMM epilogues (bias, bias + GeLU keeping its input, GeLU's backward)
// against device/cpu, whose epilogue is the unfused ops' fp32 math. Shapes whose
// rows are whole 16-byte groups take cuBLASLt's fused epilogues; odd n (ldaux not a
// multiple of 8) the unfused kernels; both must agree with the CPU.
struct EpilogueCase {
  int ta, tb;
  int64_t m, n, k;
  int32_t epilogue;
  bool bias;
  float beta;
};

// c_dt: C's type (and bias's, aux's), dt that of A and B unless given.
void check_gemm_epilogue(Env& env, const EpilogueCase& e, int32_t dt, uint32_t seed, int32_t c_dt = -1) {
  if (c_dt < 0) c_dt = dt;
  const int64_t a_size = e.m * e.k, b_size = e.k * e.n, c_size = e.m * e.n;
  Tensor A(env, randu(static_cast<size_t>(a_size), seed, -1, 1), dt);
  Tensor B(env, randu(static_cast<size_t>(b_size), seed + 1, -1, 1), dt);
  Tensor C(env, randu(static_cast<size_t>(c_size), seed + 2), c_dt);
  Tensor bias(env, randu(static_cast<size_t>(e.n), seed + 3), c_dt);
  const bool vector_aux = e.epilogue == LOOM_GEMM_EPILOGUE_BIAS_GRAD;
  Tensor aux(env, randu(static_cast<size_t>(vector_aux ? e.n : c_size), seed + 4, -4, 4), c_dt);
  both<loom_gemm_args>(env, &loom::Device::gemm, [&](bool gpu) {
    loom_gemm_args a = loom::make<loom_gemm_args>();
    a.trans_a = e.ta;
    a.trans_b = e.tb;
    a.m = e.m;
    a.n = e.n;
    a.k = e.k;
    a.a = gpu ? A.g() : A.c();
    a.lda = e.ta ? e.m : e.k;
    a.b = gpu ? B.g() : B.c();
    a.ldb = e.tb ? e.k : e.n;
    a.c = gpu ? C.g() : C.c();
    a.ldc = e.n;
    a.batch = 1;
    a.alpha = 1.0f;
    a.beta = e.beta;
    a.dtype = gpu ? dt : F32;
    a.c_dtype = gpu ? c_dt : F32;
    a.epilogue = e.epilogue;
    a.bias = e.bias ? (gpu ? bias.g() : bias.c()) : nullptr;
    if (e.epilogue != LOOM_GEMM_EPILOGUE_BIAS) {
      a.aux = gpu ? aux.g() : aux.c();
      a.ldaux = vector_aux ? 0 : e.n;
    }
    return a;
  });
  std::ostringstream what;
  what << "gemm epilogue " << e.epilogue << (e.bias ? " with bias" : "") << " ta=" << e.ta << " tb=" << e.tb
       << " m=" << e.m << " n=" << e.n << " k=" << e.k << " beta=" << e.beta << (dt == BF16 ? " bf16" : " f32")
       << (c_dt == BF16 ? " C bf16" : " C f32");
  // cuBLASLt's GeLU derivative differs from device/cpu's (both approximate tanh) by up to
  // 1.2e-5 of the largest fp32 result (measured on an H100): fp32 DGELU gets 3e-5.
  const double tol = std::max(tol_of(dt), tol_of(c_dt));
  C.expect_match(what.str(), dt == F32 && e.epilogue == LOOM_GEMM_EPILOGUE_DGELU ? 3e-5 : tol);
  if (e.epilogue == LOOM_GEMM_EPILOGUE_GELU_AUX || vector_aux) aux.expect_match(what.str() + " (aux)", tol);
}

void gemm_epilogue_sweep(Env& env, int32_t dt) {
  uint32_t seed = 900;
  for (int64_t n : {int64_t{384}, int64_t{45}})  // cuBLASLt; the unfused kernels (ldaux % 8 != 0)
    for (int t = 0; t < 4; ++t) {
      const int ta = t & 1, tb = t >> 1;
      check_gemm_epilogue(env, {ta, tb, 96, n, 64, LOOM_GEMM_EPILOGUE_BIAS, true, 0.0f}, dt, seed++);
      check_gemm_epilogue(env, {ta, tb, 96, n, 64, LOOM_GEMM_EPILOGUE_BIAS, true, 1.0f}, dt, seed++);
      check_gemm_epilogue(env, {ta, tb, 96, n, 64, LOOM_GEMM_EPILOGUE_GELU_AUX, true, 0.0f}, dt, seed++);
      check_gemm_epilogue(env, {ta, tb, 96, n, 64, LOOM_GEMM_EPILOGUE_GELU_AUX, false, 0.0f}, dt, seed++);
      check_gemm_epilogue(env, {ta, tb, 96, n, 64, LOOM_GEMM_EPILOGUE_DGELU, false, 0.0f}, dt, seed++);
    }
  // Bias gradients in the weight-gradient GEMM (dW = x^T dy, dbias += column sums of dy):
  // fp32, and bf16 inputs with fp32 C (gradient-accumulation fusion) or bf16 C.
  for (int64_t n : {int64_t{384}, int64_t{45}}) {
    check_gemm_epilogue(env, {1, 0, 64, n, 96, LOOM_GEMM_EPILOGUE_BIAS_GRAD, false, 1.0f}, dt, seed++);
    check_gemm_epilogue(env, {0, 0, 64, n, 96, LOOM_GEMM_EPILOGUE_BIAS_GRAD, false, 0.0f}, dt, seed++);
    if (dt == BF16) check_gemm_epilogue(env, {1, 0, 64, n, 96, LOOM_GEMM_EPILOGUE_BIAS_GRAD, false, 1.0f}, dt, seed++, F32);
  }
  check_gemm_epilogue(env, {1, 0, 768, 3072, 512, LOOM_GEMM_EPILOGUE_BIAS_GRAD, false, 1.0f}, dt, seed++,
                      dt == BF16 ? F32 : dt);
  // A linear layer's shapes (GPT-2 small MLP, 512 tokens).
  check_gemm_epilogue(env, {0, 0, 512, 3072, 768, LOOM_GEMM_EPILOGUE_GELU_AUX, true, 0.0f}, dt, seed++);
  check_gemm_epilogue(env, {0, 1, 512, 3072, 768, LOOM_GEMM_EPILOGUE_DGELU, false, 0.0f}, dt, seed++);
  check_gemm_epilogue(env, {0, 0, 512, 2304, 768, LOOM_GEMM_EPILOGUE_BIAS, true, 0.0f}, dt, seed++);
}

TEST(DeviceCuda, GemmEpiloguesMatchCpu) {
  REQUIRE_GPU();
  Env env;
  gemm_epilogue_sweep(env, F32);
  gemm_epilogue_sweep(env, BF16);
}

TEST(DeviceCuda, GemmEpiloguesWithoutCublasLtMatchCpu) {
  REQUIRE_GPU();
  Env env(toml::table{{"gemm_epilogues", false}});
  gemm_epilogue_sweep(env, F32);
  gemm_epilogue_sweep(env, BF16);
}

// ---------------------------------------------------------------------------
// LayerNorm, GeLU
// ---------------------------------------------------------------------------

// cols % 8 == 0 takes device/cuda's warp-a-row kernels (16-byte accesses), others the
// block-a-row ones.
void check_layernorm(int32_t dt, int64_t cols) {
  Env env;
  const int64_t rows = 37;
  for (int variant = 0; variant < 3; ++variant) {  // gamma+beta, gamma only, neither
    const std::string tag =
        std::string(dt == BF16 ? "bf16 " : "f32 ") + std::to_string(variant) + " cols " + std::to_string(cols);
    Tensor x(env, randu(rows * cols, 40 + variant, -2, 3), dt), y(env, rows * cols, dt);
    Tensor gamma(env, randu(cols, 41, 0.5f, 1.5f), dt), beta(env, randu(cols, 42), dt);
    Tensor mean(env, rows), rstd(env, rows);
    auto fwd = [&](bool gpu) {
      loom_layernorm_fwd_args a = loom::make<loom_layernorm_fwd_args>();
      a.rows = rows;
      a.cols = cols;
      a.x = gpu ? x.g() : x.c();
      a.gamma = variant < 2 ? (gpu ? gamma.g() : gamma.c()) : nullptr;
      a.beta = variant < 1 ? (gpu ? beta.g() : beta.c()) : nullptr;
      a.y = gpu ? y.g() : y.c();
      a.mean = static_cast<float*>(gpu ? mean.g() : mean.c());
      a.rstd = static_cast<float*>(gpu ? rstd.g() : rstd.c());
      a.eps = 1e-5f;
      a.dtype = gpu ? dt : F32;
      return a;
    };
    both<loom_layernorm_fwd_args>(env, &loom::Device::layernorm_fwd, fwd);
    y.expect_match("layernorm_fwd y " + tag);
    mean.expect_match("layernorm_fwd mean " + tag, tol_of(dt));
    rstd.expect_match("layernorm_fwd rstd " + tag, tol_of(dt));
    // Backward: dgamma/dbeta accumulate; dx overwritten, accumulated, and in place over dy.
    for (int mode = 0; mode < 3; ++mode) {
      Tensor dy(env, randu(rows * cols, 43 + mode), dt), dx(env, randu(rows * cols, 44), dt);
      Tensor dgamma(env, randu(cols, 45), dt), dbeta(env, randu(cols, 46), dt);
      both<loom_layernorm_bwd_args>(env, &loom::Device::layernorm_bwd, [&](bool gpu) {
        loom_layernorm_bwd_args a = loom::make<loom_layernorm_bwd_args>();
        a.rows = rows;
        a.cols = cols;
        a.dy = gpu ? dy.g() : dy.c();
        a.x = gpu ? x.g() : x.c();
        a.gamma = variant < 2 ? (gpu ? gamma.g() : gamma.c()) : nullptr;
        a.mean = static_cast<const float*>(gpu ? mean.g() : mean.c());
        a.rstd = static_cast<const float*>(gpu ? rstd.g() : rstd.c());
        a.dx = mode == 2 ? (gpu ? dy.g() : dy.c()) : (gpu ? dx.g() : dx.c());
        a.dgamma = gpu ? dgamma.g() : dgamma.c();
        a.dbeta = gpu ? dbeta.g() : dbeta.c();
        a.accumulate_dx = mode == 1;
        a.dtype = gpu ? dt : F32;
        return a;
      });
      const std::string t = tag + " mode " + std::to_string(mode);
      (mode == 2 ? dy : dx).expect_match("layernorm_bwd dx " + t);
      dgamma.expect_match("layernorm_bwd dgamma " + t);
      dbeta.expect_match("layernorm_bwd dbeta " + t);
    }
  }
}

TEST(DeviceCuda, LayerNormFp32MatchesCpu) {
  REQUIRE_GPU();
  for (int64_t cols : {300, 768}) check_layernorm(F32, cols);
}
TEST(DeviceCuda, LayerNormBf16MatchesCpu) {
  REQUIRE_GPU();
  for (int64_t cols : {300, 768}) check_layernorm(BF16, cols);
}

// grad_fp32 (ABI 1.2): dgamma/dbeta are fp32 buffers whatever dtype is, accumulated
// without a bf16 rounding, so they must match the CPU at the fp32 tolerance (bf16
// storage misses it by 1e-4 and more). Fixed mean/rstd so only the backward is
// compared; several row chunks and column blocks; the second call leaves dbeta out.
TEST(DeviceCuda, LayerNormBwdGradFp32AccumulatesIntoFp32Buffers) {
  REQUIRE_GPU();
  Env env;
  const int64_t rows = 200, cols = 333;
  for (int32_t dt : {BF16, F32}) {
    const std::string tag = dt == BF16 ? "bf16" : "f32";
    Tensor x(env, randu(rows * cols, 130, -2, 3), dt), dy(env, randu(rows * cols, 131), dt);
    Tensor gamma(env, randu(cols, 132, 0.5f, 1.5f), dt), dx(env, randu(rows * cols, 133), dt);
    Tensor mean(env, randu(rows, 134, -0.5f, 0.5f)), rstd(env, randu(rows, 135, 0.5f, 2.0f));
    Tensor dgamma(env, randu(cols, 136)), dbeta(env, randu(cols, 137));  // fp32, nonzero
    for (int call = 0; call < 2; ++call) {
      both<loom_layernorm_bwd_args>(env, &loom::Device::layernorm_bwd, [&](bool gpu) {
        loom_layernorm_bwd_args a = loom::make<loom_layernorm_bwd_args>();
        a.rows = rows;
        a.cols = cols;
        a.dy = gpu ? dy.g() : dy.c();
        a.x = gpu ? x.g() : x.c();
        a.gamma = gpu ? gamma.g() : gamma.c();
        a.mean = static_cast<const float*>(gpu ? mean.g() : mean.c());
        a.rstd = static_cast<const float*>(gpu ? rstd.g() : rstd.c());
        a.dx = gpu ? dx.g() : dx.c();
        a.dgamma = gpu ? dgamma.g() : dgamma.c();
        a.dbeta = call == 0 ? (gpu ? dbeta.g() : dbeta.c()) : nullptr;
        a.dtype = gpu ? dt : F32;
        a.grad_fp32 = 1;
        return a;
      });
    }
    dgamma.expect_match("layernorm_bwd grad_fp32 dgamma " + tag);  // fp32 tensors: 1e-5
    dbeta.expect_match("layernorm_bwd grad_fp32 dbeta " + tag);
    dx.expect_match("layernorm_bwd grad_fp32 dx " + tag);  // dx stays of dtype
  }
}

TEST(DeviceCuda, GeluMatchesCpu) {
  REQUIRE_GPU();
  Env env;
  for (int32_t dt : {F32, BF16}) {
    const int64_t n = 100003;
    Tensor x(env, randu(n, 50, -6, 6), dt), dy(env, randu(n, 51), dt), y(env, n, dt), dx(env, n, dt);
    both<loom_gelu_args>(env, &loom::Device::gelu_fwd, [&](bool gpu) {
      loom_gelu_args a = loom::make<loom_gelu_args>();
      a.n = n;
      a.x = gpu ? x.g() : x.c();
      a.out = gpu ? y.g() : y.c();
      a.dtype = gpu ? dt : F32;
      return a;
    });
    both<loom_gelu_args>(env, &loom::Device::gelu_bwd, [&](bool gpu) {
      loom_gelu_args a = loom::make<loom_gelu_args>();
      a.n = n;
      a.x = gpu ? x.g() : x.c();
      a.dy = gpu ? dy.g() : dy.c();
      a.out = gpu ? dx.g() : dx.c();
      a.dtype = gpu ? dt : F32;
      return a;
    });
    y.expect_match(std::string("gelu_fwd ") + (dt == BF16 ? "bf16" : "f32"));
    dx.expect_match(std::string("gelu_bwd ") + (dt == BF16 ? "bf16" : "f32"));
  }
}

// ---------------------------------------------------------------------------
// ABI 1.10: RMSNorm, SwiGLU, rotary embedding, sigmoid against device/cpu
// ---------------------------------------------------------------------------

TEST(DeviceCuda, RmsNormMatchesCpu) {
  REQUIRE_GPU();
  Env env;
  const int64_t rows = 200, cols = 333;  // several row chunks and column blocks
  for (int32_t dt : {F32, BF16}) {
    const std::string tag = dt == BF16 ? " bf16" : " f32";
    Tensor x(env, randu(rows * cols, 140, -2, 2), dt), gamma(env, randu(cols, 141, 0.5f, 1.5f), dt);
    Tensor y(env, rows * cols, dt), rstd(env, rows), dy(env, randu(rows * cols, 142), dt);
    Tensor dx(env, randu(rows * cols, 143), dt), dgamma(env, randu(cols, 144));  // fp32 main gradients
    both<loom_rmsnorm_fwd_args>(env, &loom::Device::rmsnorm_fwd, [&](bool gpu) {
      loom_rmsnorm_fwd_args a = loom::make<loom_rmsnorm_fwd_args>();
      a.rows = rows, a.cols = cols, a.eps = 1e-5f, a.dtype = gpu ? dt : F32;
      a.x = gpu ? x.g() : x.c(), a.gamma = gpu ? gamma.g() : gamma.c(), a.y = gpu ? y.g() : y.c();
      a.rstd = static_cast<float*>(gpu ? rstd.g() : rstd.c());
      return a;
    });
    y.expect_match("rmsnorm_fwd y" + tag);
    rstd.expect_match("rmsnorm_fwd rstd" + tag, 1e-5);
    both<loom_rmsnorm_bwd_args>(env, &loom::Device::rmsnorm_bwd, [&](bool gpu) {
      loom_rmsnorm_bwd_args a = loom::make<loom_rmsnorm_bwd_args>();
      a.rows = rows, a.cols = cols, a.dtype = gpu ? dt : F32, a.grad_fp32 = 1, a.accumulate_dx = 1;
      a.dy = gpu ? dy.g() : dy.c(), a.x = gpu ? x.g() : x.c(), a.gamma = gpu ? gamma.g() : gamma.c();
      a.rstd = static_cast<const float*>(gpu ? rstd.g() : rstd.c());
      a.dx = gpu ? dx.g() : dx.c(), a.dgamma = gpu ? dgamma.g() : dgamma.c();
      return a;
    });
    dx.expect_match("rmsnorm_bwd dx" + tag);
    dgamma.expect_match("rmsnorm_bwd dgamma" + tag, 1e-5);  // fp32 sums of the same (bf16-rounded) inputs
  }
}

TEST(DeviceCuda, SwigluAndSigmoidMatchCpu) {
  REQUIRE_GPU();
  Env env;
  const int64_t rows = 97, cols = 1000;
  for (int32_t dt : {F32, BF16}) {
    const std::string tag = dt == BF16 ? " bf16" : " f32";
    Tensor x(env, randu(rows * 2 * cols, 150, -6, 6), dt), dy(env, randu(rows * cols, 151), dt);
    Tensor y(env, rows * cols, dt), dx(env, rows * 2 * cols, dt);
    for (bool backward : {false, true})
      both<loom_swiglu_args>(env, backward ? &loom::Device::swiglu_bwd : &loom::Device::swiglu_fwd, [&](bool gpu) {
        loom_swiglu_args a = loom::make<loom_swiglu_args>();
        a.rows = rows, a.cols = cols, a.dtype = gpu ? dt : F32, a.x = gpu ? x.g() : x.c();
        a.dy = backward ? (gpu ? dy.g() : dy.c()) : nullptr;
        a.out = backward ? (gpu ? dx.g() : dx.c()) : (gpu ? y.g() : y.c());
        return a;
      });
    y.expect_match("swiglu_fwd" + tag);
    dx.expect_match("swiglu_bwd" + tag);
    // Sigmoid over [-20, 20] (saturated ends included), fresh inputs on both devices.
    Tensor sx(env, randu(rows * cols, 152, -20, 20), dt), sdy(env, randu(rows * cols, 153), dt);
    Tensor s(env, rows * cols, dt), ds(env, rows * cols, dt);
    for (bool backward : {false, true})
      both<loom_activation_args>(env, backward ? &loom::Device::sigmoid_bwd : &loom::Device::sigmoid_fwd,
                                 [&](bool gpu) {
                                   loom_activation_args a = loom::make<loom_activation_args>();
                                   a.n = rows * cols, a.dtype = gpu ? dt : F32, a.x = gpu ? sx.g() : sx.c();
                                   a.dy = backward ? (gpu ? sdy.g() : sdy.c()) : nullptr;
                                   a.out = backward ? (gpu ? ds.g() : ds.c()) : (gpu ? s.g() : s.c());
                                   return a;
                                 });
    s.expect_match("sigmoid_fwd" + tag);
    ds.expect_match("sigmoid_bwd" + tag);
  }
}

// Rotary embedding on q and k inside a packed qkv (stride_t = 3 heads' widths), partial
// rotary dims, positions past 4096 (the fp32 angle), in place and out of place.
TEST(DeviceCuda, RopeMatchesCpu) {
  REQUIRE_GPU();
  Env env;
  const int64_t T = 300, H = 4, D = 64, R = 48, st = 3 * H * D;
  std::vector<int32_t> pos(T);
  for (int64_t t = 0; t < T; ++t) pos[static_cast<size_t>(t)] = static_cast<int32_t>((t * 131) % 8192);
  Raw<int32_t> positions(env, pos);
  // ABI 1.20: a caller's frequency table (a scaled rotary embedding) in place of theta's.
  std::vector<float> table(static_cast<size_t>(R / 2));
  for (size_t i = 0; i < table.size(); ++i) table[i] = 0.9f / static_cast<float>(1 + 7 * i * i);
  Raw<float> freqs(env, table);
  for (const bool scaled : {false, true})
  for (int32_t dt : {F32, BF16}) {
    const std::string tag = std::string(dt == BF16 ? " bf16" : " f32") + (scaled ? ", the caller's frequencies" : "");
    Tensor qkv(env, randu(T * st, 160), dt), out(env, T * st, dt), back(env, T * st, dt);
    for (int pass = 0; pass < 3; ++pass)  // forward out of place, backward out of place, forward in place
      both<loom_rope_args>(env, pass == 1 ? &loom::Device::rope_bwd : &loom::Device::rope_fwd, [&](bool gpu) {
        loom_rope_args a = loom::make<loom_rope_args>();
        a.tokens = T, a.heads = 2 * H, a.head_dim = D, a.rotary_dim = R, a.stride_t = st, a.theta = 500000.0f;
        a.dtype = gpu ? dt : F32, a.positions = gpu ? positions.g() : positions.c();
        if (scaled) a.inv_freq = gpu ? freqs.g() : freqs.c();
        const Tensor& src = pass == 1 ? out : qkv;
        const Tensor& dst = pass == 0 ? out : pass == 1 ? back : qkv;
        a.x = gpu ? src.g() : static_cast<const void*>(src.c());
        a.out = gpu ? dst.g() : static_cast<void*>(dst.c());
        return a;
      });
    out.expect_match("rope_fwd" + tag);
    back.expect_match("rope_bwd" + tag);
    qkv.expect_match("rope_fwd in place" + tag);
  }
}

// ---------------------------------------------------------------------------
// Attention: packed QKV [S, B, 3, H, D] (Megatron's sequence-major layout) and a
// plain [B, S, H, D] one; causal and not.
// ---------------------------------------------------------------------------

// key_start: documents, ABI 1.22 ([B * S] query rows' first keys; empty: none).
void check_attention(int32_t dt, bool packed, bool causal, int64_t B, int64_t S, int64_t H, int64_t D, uint32_t seed,
                     toml::table gpu_options = {}, int64_t window = 0, const std::vector<int32_t>& key_start = {}) {
  Env env(std::move(gpu_options));
  Raw<int32_t> starts(env, key_start.empty() ? std::vector<int32_t>(1, 0) : key_start);
  const int64_t W = H * D;
  const int64_t qs_s = packed ? B * 3 * W : W, qs_b = packed ? 3 * W : S * W;
  const int64_t os_s = packed ? B * W : W, os_b = packed ? W : S * W;
  const int64_t qkv_n = packed ? S * B * 3 * W : 3 * B * S * W;
  const int64_t k_off = packed ? W : B * S * W, v_off = 2 * k_off;
  Tensor qkv(env, randu(qkv_n, seed, -2, 2), dt), out(env, B * S * W, dt), lse(env, B * H * S);
  Tensor dout(env, randu(B * S * W, seed + 1), dt), dqkv(env, randu(qkv_n, seed + 2), dt);
  const size_t es = dt == BF16 ? 2 : 4;
  auto build = [&](bool gpu) {
    loom_attention_args a = loom::make<loom_attention_args>();
    a.batch = B;
    a.seq = S;
    a.heads = H;
    a.head_dim = D;
    a.qkv_stride_b = qs_b;
    a.qkv_stride_s = qs_s;
    a.out_stride_b = os_b;
    a.out_stride_s = os_s;
    const size_t e = gpu ? es : 4;
    char* base = static_cast<char*>(gpu ? qkv.g() : static_cast<void*>(qkv.c()));
    char* dbase = static_cast<char*>(gpu ? dqkv.g() : static_cast<void*>(dqkv.c()));
    a.q = base;
    a.k = base + k_off * e;
    a.v = base + v_off * e;
    a.out = gpu ? out.g() : out.c();
    a.lse = static_cast<float*>(gpu ? lse.g() : lse.c());
    a.dout = gpu ? dout.g() : dout.c();
    a.dq = dbase;
    a.dk = dbase + k_off * e;
    a.dv = dbase + v_off * e;
    a.scale = 1.0f / std::sqrt(static_cast<float>(D));
    a.causal = causal ? 1 : 0;
    a.window = window;
    a.key_start = key_start.empty() ? nullptr : gpu ? starts.g() : starts.c();
    a.dtype = gpu ? dt : F32;
    return a;
  };
  both<loom_attention_args>(env, &loom::Device::attention_fwd, build);
  std::ostringstream tag;
  tag << (dt == BF16 ? "bf16" : "f32") << (packed ? " packed" : " plain") << (causal ? " causal" : "") << " B=" << B
      << " S=" << S << " H=" << H << " D=" << D;
  if (window > 0) tag << " sliding window " << window;
  if (!key_start.empty()) tag << " documents";
  out.expect_match("attention_fwd out " + tag.str());
  lse.expect_match("attention_fwd lse " + tag.str(), tol_of(dt));
  both<loom_attention_args>(env, &loom::Device::attention_bwd, build);
  dqkv.expect_match("attention_bwd dq|dk|dv " + tag.str());
}

// ABI 1.6's query window (context parallelism): Sq queries [b, s, h, d] at
// q_offset of Skv keys packed [s, b, k|v], dk and dv accumulated into what they hold.
void check_attention_window(int32_t dt, bool causal, int64_t B, int64_t Sq, int64_t Skv, int64_t q_offset, int64_t H,
                            int64_t D, uint32_t seed, toml::table gpu_options = {}, int64_t window = 0,
                            const std::vector<int32_t>& key_start = {}, bool accumulate_dkv = true) {
  Env env(std::move(gpu_options));
  Raw<int32_t> starts(env, key_start.empty() ? std::vector<int32_t>(1, 0) : key_start);
  const int64_t W = H * D;
  Tensor q(env, randu(B * Sq * W, seed, -2, 2), dt), kv(env, randu(Skv * B * 2 * W, seed + 1, -2, 2), dt);
  Tensor out(env, B * Sq * W, dt), lse(env, B * H * Sq), dout(env, randu(B * Sq * W, seed + 2), dt);
  Tensor dq(env, randu(B * Sq * W, seed + 3), dt), dkv(env, randu(Skv * B * 2 * W, seed + 4), dt);
  const size_t es = dt == BF16 ? 2 : 4;
  auto build = [&](bool gpu) {
    loom_attention_args a = loom::make<loom_attention_args>();
    a.batch = B;
    a.seq = Sq;
    a.heads = H;
    a.head_dim = D;
    a.qkv_stride_b = a.out_stride_b = Sq * W;
    a.qkv_stride_s = a.out_stride_s = W;
    a.kv_seq = Skv;
    a.q_offset = q_offset;
    a.kv_stride_b = 2 * W;
    a.kv_stride_s = B * 2 * W;
    const size_t e = gpu ? es : 4;
    char* kvb = static_cast<char*>(gpu ? kv.g() : static_cast<void*>(kv.c()));
    char* dkvb = static_cast<char*>(gpu ? dkv.g() : static_cast<void*>(dkv.c()));
    a.q = gpu ? q.g() : q.c();
    a.k = kvb;
    a.v = kvb + W * e;
    a.out = gpu ? out.g() : out.c();
    a.lse = static_cast<float*>(gpu ? lse.g() : lse.c());
    a.dout = gpu ? dout.g() : dout.c();
    a.dq = gpu ? dq.g() : dq.c();
    a.dk = dkvb;
    a.dv = dkvb + W * e;
    a.accumulate_dkv = accumulate_dkv ? 1 : 0;
    a.scale = 1.0f / std::sqrt(static_cast<float>(D));
    a.causal = causal ? 1 : 0;
    a.window = window;
    a.key_start = key_start.empty() ? nullptr : gpu ? starts.g() : starts.c();
    a.dtype = gpu ? dt : F32;
    return a;
  };
  both<loom_attention_args>(env, &loom::Device::attention_fwd, build);
  std::ostringstream tag;
  tag << (dt == BF16 ? "bf16" : "f32") << (causal ? " causal" : "") << " window B=" << B << " Sq=" << Sq
      << " Skv=" << Skv << " q_offset=" << q_offset << " H=" << H << " D=" << D;
  if (window > 0) tag << " sliding window " << window;
  if (!key_start.empty()) tag << " documents";
  if (!accumulate_dkv) tag << " dk|dv overwritten";
  out.expect_match("attention_fwd out " + tag.str());
  lse.expect_match("attention_fwd lse " + tag.str(), tol_of(dt));
  both<loom_attention_args>(env, &loom::Device::attention_bwd, build);
  dq.expect_match("attention_bwd dq " + tag.str());
  dkv.expect_match("attention_bwd dk|dv " + tag.str());
}

TEST(DeviceCuda, AttentionWindowMatchesCpu) {
  REQUIRE_GPU();
  check_attention_window(F32, true, 2, 35, 140, 70, 3, 16, 80);   // cp 2: rank 1's early chunk
  check_attention_window(F32, true, 1, 64, 256, 192, 4, 32, 81);  // the last chunk of 4
  check_attention_window(F32, false, 2, 17, 40, 0, 2, 8, 82);
  check_attention_window(BF16, true, 2, 35, 140, 105, 3, 16, 83);
}

TEST(DeviceCuda, AttentionFp32MatchesCpu) {
  REQUIRE_GPU();
  check_attention(F32, true, true, 2, 70, 3, 16, 60);
  check_attention(F32, true, false, 2, 33, 2, 8, 61);
  check_attention(F32, false, true, 3, 128, 4, 32, 62);
  check_attention(F32, false, false, 1, 5, 1, 4, 63);
}

TEST(DeviceCuda, AttentionBf16MatchesCpu) {
  REQUIRE_GPU();
  check_attention(BF16, true, true, 2, 70, 3, 16, 64);
  check_attention(BF16, false, false, 2, 64, 2, 64, 65);
  // The GEMM path that fused_attention = false selects for the fused kernels' shapes.
  const toml::table unfused{{"fused_attention", false}};
  check_attention(BF16, true, true, 2, 70, 3, 64, 66, unfused);
  check_attention_window(BF16, true, 2, 35, 140, 105, 3, 128, 67, unfused);
}

// The fused kernels (bf16, head sizes 64 and 128): sequences that are not multiples
// of their 64-row tiles, both layouts, causal and not, and query windows (causal tiles
// past the diagonal skipped, dk and dv accumulated).
TEST(DeviceCuda, AttentionFusedBf16MatchesCpu) {
  REQUIRE_GPU();
  for (int64_t D : {64, 128}) {
    check_attention(BF16, true, true, 2, 200, 3, D, 70);
    check_attention(BF16, false, true, 1, 130, 2, D, 71);
    check_attention(BF16, true, false, 2, 77, 2, D, 72);
    check_attention(BF16, false, false, 1, 1, 1, D, 73);
    check_attention(BF16, false, true, 1, 256, 1, D, 74);
    check_attention_window(BF16, true, 2, 100, 300, 150, 2, D, 75);
    check_attention_window(BF16, false, 1, 50, 170, 0, 2, D, 76);
    check_attention_window(BF16, true, 1, 64, 256, 192, 2, D, 77);
    check_attention_window(BF16, true, 1, 64, 256, 0, 1, D, 78);  // keys past every query: dk, dv += 0
  }
}

// ABI 1.21 sliding windows: the fused kernels (key tiles before a query tile's first
// key skipped, dK/dV stopping after the last query tile that sees their keys, the
// window's edge masked inside a tile: windows of 1, within, at and across the 64-row
// tiles, and one past every key), the unfused softmax kernels (fp32; bf16 with
// fused_attention = false), and both under a query window at an offset (context
// parallelism, dk and dv accumulated; keys no query's window reaches get += 0).
TEST(DeviceCuda, SlidingWindowAttentionMatchesCpu) {
  REQUIRE_GPU();
  for (int64_t D : {64, 128})
    for (int64_t window : {1, 17, 63, 64, 65, 150, 199, 200, 1000}) {
      check_attention(BF16, true, true, 2, 200, 3, D, 100, {}, window);
      check_attention(BF16, false, true, 1, 130, 2, D, 101, {}, window);
    }
  for (int64_t D : {64, 128}) {
    check_attention_window(BF16, true, 2, 100, 300, 150, 2, D, 102, {}, 40);
    check_attention_window(BF16, true, 1, 64, 256, 192, 2, D, 103, {}, 100);
    check_attention_window(BF16, true, 1, 64, 256, 0, 1, D, 104, {}, 30);
    check_attention_window(BF16, true, 1, 100, 300, 150, 2, D, 110, {}, 40, {}, false);  // skipped keys: dk, dv = 0
    check_attention_window(BF16, true, 2, 100, 300, 150, 2, D, 111, {}, 249);           // the largest kept window
  }
  check_attention(F32, true, true, 2, 70, 3, 16, 105, {}, 9);
  check_attention(F32, false, true, 1, 130, 2, 32, 106, {}, 64);
  check_attention_window(F32, true, 2, 35, 140, 70, 3, 16, 107, {}, 20);
  const toml::table unfused{{"fused_attention", false}};
  check_attention(BF16, true, true, 2, 70, 3, 64, 108, unfused, 33);
  check_attention_window(BF16, true, 2, 35, 140, 105, 3, 128, 109, unfused, 50);
}

// The first key of each query's document, for B sequences of S positions whose
// documents end at `ends` (per batch element).
std::vector<int32_t> document_starts(int64_t B, int64_t S, const std::vector<std::vector<int64_t>>& ends,
                                     int64_t q_offset = 0, int64_t rows = -1) {
  std::vector<int32_t> out;
  for (int64_t b = 0; b < B; ++b) {
    int32_t start = 0;
    for (int64_t i = 0; i < S; ++i) {
      if (i >= q_offset && (rows < 0 || i < q_offset + rows)) out.push_back(start);
      for (int64_t e : ends[static_cast<size_t>(b)]) start = e == i ? static_cast<int32_t>(i + 1) : start;
    }
  }
  return out;
}

// ABI 1.22 documents (key_start): the fused kernels (documents of one token, ending
// inside, at and across the 64-row tiles; a sequence of one document; with a sliding
// window too, the later bound holding), under query windows at an offset (dk and dv
// accumulated, and overwritten where no query reaches the keys), and the unfused
// softmax kernels.
TEST(DeviceCuda, DocumentMaskedAttentionMatchesCpu) {
  REQUIRE_GPU();
  const std::vector<std::vector<int64_t>> ends = {{0, 1, 40, 63, 64, 127, 128, 170}, {}};
  for (int64_t D : {64, 128}) {
    check_attention(BF16, true, true, 2, 200, 3, D, 120, {}, 0, document_starts(2, 200, ends));
    check_attention(BF16, false, true, 2, 200, 2, D, 121, {}, 30, document_starts(2, 200, ends));
    check_attention_window(BF16, true, 2, 100, 300, 150, 2, D, 122, {}, 0,
                           document_starts(2, 300, {{10, 149, 160, 200}, {260}}, 150, 100));
    check_attention_window(BF16, true, 1, 100, 300, 150, 2, D, 123, {}, 0, document_starts(1, 300, {{149}}, 150, 100),
                           false);
  }
  check_attention(F32, true, true, 2, 200, 3, 16, 124, {}, 0, document_starts(2, 200, ends));
  check_attention_window(F32, true, 2, 35, 140, 70, 3, 16, 125, {}, 9,
                         document_starts(2, 140, {{69, 80}, {100}}, 70, 35));
  const toml::table unfused{{"fused_attention", false}};
  check_attention(BF16, true, true, 2, 200, 3, 64, 126, unfused, 0, document_starts(2, 200, ends));
}

// No atomics in the fused backward: the same inputs give the same bits.
TEST(DeviceCuda, AttentionFusedIsDeterministic) {
  REQUIRE_GPU();
  Env env;
  const int64_t B = 2, S = 300, H = 4, D = 64, W = H * D, n = B * S * W;
  Tensor q(env, randu(n, 90, -2, 2), BF16), k(env, randu(n, 91, -2, 2), BF16), v(env, randu(n, 92, -2, 2), BF16);
  Tensor out(env, n, BF16), lse(env, B * H * S), dout(env, randu(n, 93), BF16);
  Tensor dq(env, n, BF16), dk(env, n, BF16), dv(env, n, BF16);
  loom_attention_args a = loom::make<loom_attention_args>();
  a.batch = B;
  a.seq = S;
  a.heads = H;
  a.head_dim = D;
  a.qkv_stride_b = a.out_stride_b = S * W;
  a.qkv_stride_s = a.out_stride_s = W;
  a.q = q.g();
  a.k = k.g();
  a.v = v.g();
  a.out = out.g();
  a.lse = static_cast<float*>(lse.g());
  a.dout = dout.g();
  a.dq = dq.g();
  a.dk = dk.g();
  a.dv = dv.g();
  a.scale = 0.125f;
  a.causal = 1;
  a.dtype = BF16;
  std::vector<float> first;
  for (int run = 0; run < 2; ++run) {
    env.gpu.ops().attention_fwd(a);
    env.gpu.ops().attention_bwd(a);
    env.gpu.sync();
    std::vector<float> all = out.gpu();
    for (const Tensor* t : {&lse, &dq, &dk, &dv}) {
      const std::vector<float> x = t->gpu();
      all.insert(all.end(), x.begin(), x.end());
    }
    if (run == 0) first = all;
    else EXPECT_TRUE(std::memcmp(first.data(), all.data(), all.size() * sizeof(float)) == 0)
        << "two runs of the fused attention differ";
  }
}

// ---------------------------------------------------------------------------
// Cross-entropy: the four steps, a padded vocab, ignored rows, and two vocab
// slices combined as a tensor-parallel run combines them (max, then sums).
// ---------------------------------------------------------------------------

// cols (and the slice's columns) multiples of 8 take device/cuda's 8-element row kernels.
void check_xent(int32_t dt, int64_t cols, int64_t slice_cols) {
  Env env;
  const int64_t rows = 23, ld = 520, valid = 500;
  std::vector<int32_t> t(rows);
  std::mt19937 gen(70);
  for (int64_t r = 0; r < rows; ++r) t[r] = r % 7 == 3 ? -1 : static_cast<int32_t>(gen() % valid);
  for (int64_t vocab_start : {int64_t{0}, int64_t{250}}) {
    Tensor logits(env, randu(rows * ld, 71, -8, 8), dt), dlogits(env, randu(rows * ld, 72), dt);
    Tensor row_max(env, rows), sumexp(env, rows), target(env, rows), loss(env, rows);
    Raw<int32_t> targets(env, t);
    for (int step = LOOM_XENT_ROW_MAX; step <= LOOM_XENT_BACKWARD; ++step) {
      both<loom_xent_args>(env, &loom::Device::xent, [&](bool gpu) {
        loom_xent_args a = loom::make<loom_xent_args>();
        a.step = step;
        a.rows = rows;
        a.cols = vocab_start == 0 ? cols : slice_cols;  // a slice: columns [250, 250 + slice_cols) of the vocab
        a.ld = ld;
        a.valid_cols = vocab_start == 0 ? valid : slice_cols;
        a.vocab_start = vocab_start;
        a.logits = gpu ? logits.g() : logits.c();
        a.targets = gpu ? targets.g() : targets.c();
        a.row_max = static_cast<float*>(gpu ? row_max.g() : row_max.c());
        a.row_sumexp = static_cast<float*>(gpu ? sumexp.g() : sumexp.c());
        a.target_logit = static_cast<float*>(gpu ? target.g() : target.c());
        a.loss = static_cast<float*>(gpu ? loss.g() : loss.c());
        a.dlogits = gpu ? dlogits.g() : dlogits.c();
        a.scale = 0.25f;
        a.dtype = gpu ? dt : F32;
        return a;
      });
    }
    const std::string tag = std::string(dt == BF16 ? "bf16" : "f32") + " vocab_start " + std::to_string(vocab_start) +
                            " cols " + std::to_string(vocab_start == 0 ? cols : slice_cols);
    row_max.expect_match("xent row_max " + tag, tol_of(dt));
    sumexp.expect_match("xent row_sumexp " + tag, tol_of(dt));
    target.expect_match("xent target_logit " + tag, tol_of(dt));
    loss.expect_match("xent loss " + tag, tol_of(dt));
    dlogits.expect_match("xent dlogits " + tag);
  }
}

TEST(DeviceCuda, XentFp32MatchesCpu) {
  REQUIRE_GPU();
  check_xent(F32, 517, 250);
  check_xent(F32, 512, 248);
}
TEST(DeviceCuda, XentBf16MatchesCpu) {
  REQUIRE_GPU();
  check_xent(BF16, 517, 250);
  check_xent(BF16, 512, 248);
}

// ---------------------------------------------------------------------------
// Embedding
// ---------------------------------------------------------------------------

TEST(DeviceCuda, EmbeddingSlicesMatchCpu) {
  REQUIRE_GPU();
  Env env;
  for (int32_t dt : {F32, BF16}) {
    const int64_t n = 300, dim = 96, vocab_rows = 40, vocab_start = 20;
    std::vector<int32_t> ids(n);
    std::mt19937 gen(80);
    for (int32_t& i : ids) i = static_cast<int32_t>(gen() % 80);  // some outside [20, 60)
    Raw<int32_t> rid(env, ids);
    Tensor table(env, randu(vocab_rows * dim, 81), dt), out(env, randu(n * dim, 82), dt);
    Tensor dout(env, randu(n * dim, 83), dt), dtable(env, randu(vocab_rows * dim, 84), dt);
    for (int acc = 0; acc < 2; ++acc) {
      both<loom_embedding_args>(env, &loom::Device::embedding_fwd, [&](bool gpu) {
        loom_embedding_args a = loom::make<loom_embedding_args>();
        a.n = n;
        a.dim = dim;
        a.vocab_rows = vocab_rows;
        a.vocab_start = vocab_start;
        a.ids = gpu ? rid.g() : rid.c();
        a.table = gpu ? table.g() : table.c();
        a.out = gpu ? out.g() : out.c();
        a.accumulate = acc;
        a.dtype = gpu ? dt : F32;
        return a;
      });
      out.expect_match("embedding_fwd accumulate=" + std::to_string(acc));
    }
    both<loom_embedding_args>(env, &loom::Device::embedding_bwd, [&](bool gpu) {
      loom_embedding_args a = loom::make<loom_embedding_args>();
      a.n = n;
      a.dim = dim;
      a.vocab_rows = vocab_rows;
      a.vocab_start = vocab_start;
      a.ids = gpu ? rid.g() : rid.c();
      a.dout = gpu ? dout.g() : dout.c();
      a.dtable = gpu ? dtable.g() : dtable.c();
      a.dtype = gpu ? dt : F32;
      return a;
    });
    // bf16: summed in fp32 and rounded once, as the CPU does (the order of the
    // atomics differs: one bf16 ulp at most, within the bf16 tolerance).
    dtable.expect_match("embedding_bwd");
  }
}

// grad_fp32 (ABI 1.2): bf16 dout scattered into an fp32 dtable with fp32 atomics.
// ~12 ids per table row: the order of the sum differs from the CPU's, but every
// partial sum is fp32, so the fp32 tolerance holds (a bf16 table would miss it).
TEST(DeviceCuda, EmbeddingBwdGradFp32AccumulatesIntoAnFp32Table) {
  REQUIRE_GPU();
  Env env;
  const int64_t n = 1000, dim = 200, vocab_rows = 40, vocab_start = 20;
  std::vector<int32_t> ids(n);
  std::mt19937 gen(140);
  for (int32_t& i : ids) i = static_cast<int32_t>(gen() % 80);  // about half outside [20, 60)
  Raw<int32_t> rid(env, ids);
  for (int32_t dt : {BF16, F32}) {
    Tensor dout(env, randu(n * dim, 141), dt), dtable(env, randu(vocab_rows * dim, 142));  // dtable fp32
    both<loom_embedding_args>(env, &loom::Device::embedding_bwd, [&](bool gpu) {
      loom_embedding_args a = loom::make<loom_embedding_args>();
      a.n = n;
      a.dim = dim;
      a.vocab_rows = vocab_rows;
      a.vocab_start = vocab_start;
      a.ids = gpu ? rid.g() : rid.c();
      a.dout = gpu ? dout.g() : dout.c();
      a.dtable = gpu ? dtable.g() : dtable.c();
      a.dtype = gpu ? dt : F32;
      a.grad_fp32 = 1;
      return a;
    });
    dtable.expect_match(std::string("embedding_bwd grad_fp32 ") + (dt == BF16 ? "bf16" : "f32"), 1e-5);
  }
}

// ---------------------------------------------------------------------------
// Element-wise, reductions, AdamW
// ---------------------------------------------------------------------------

loom_elementwise_args ew(int32_t op, int64_t n, const void* x, void* y, void* out, int32_t dt) {
  loom_elementwise_args a = loom::make<loom_elementwise_args>();
  a.op = op;
  a.n = n;
  a.x = x;
  a.y = y;
  a.out = out;
  a.dtype = a.out_dtype = dt;
  return a;
}

TEST(DeviceCuda, ElementwiseMatchesCpu) {
  REQUIRE_GPU();
  Env env;
  // cols 96: rows of whole 8-element groups (ADD_BIAS and MUL_COLS take device/cuda's
  // 8-element kernel too); n odd: the last elements one by one.
  for (const auto& [dt, cols] : std::vector<std::pair<int32_t, int64_t>>{{F32, 77}, {BF16, 77}, {F32, 96}, {BF16, 96}}) {
    const int64_t rows = 301, n = rows * cols;
    for (int32_t op : {LOOM_EW_AXPBY, LOOM_EW_ADD, LOOM_EW_MUL, LOOM_EW_SCALE, LOOM_EW_FILL, LOOM_EW_ADD_BIAS,
                       LOOM_EW_MUL_COLS}) {
      const bool per_col = op == LOOM_EW_ADD_BIAS || op == LOOM_EW_MUL_COLS;
      Tensor x(env, randu(n, 90 + op), dt), y(env, randu(per_col ? cols : n, 91 + op), dt);
      Tensor out(env, randu(n, 92), dt);
      for (float beta : {0.0f, 0.5f}) {
        both<loom_elementwise_args>(env, &loom::Device::elementwise, [&](bool gpu) {
          loom_elementwise_args a = ew(op, n, gpu ? x.g() : x.c(), gpu ? y.g() : y.c(), gpu ? out.g() : out.c(),
                                       gpu ? dt : F32);
          a.cols = cols;
          a.alpha = 1.75f;
          a.beta = beta;
          return a;
        });
        const std::string tag = "elementwise op " + std::to_string(op) + (dt == BF16 ? " bf16" : " f32") + " cols " +
                                std::to_string(cols);
        (op == LOOM_EW_AXPBY ? y : out).expect_match(tag);
      }
    }
  }
}

TEST(DeviceCuda, CastRoundsLikeTheCpu) {
  REQUIRE_GPU();
  Env env;
  std::vector<float> v = randu(4099, 95, -1e3f, 1e3f);
  v[0] = std::numeric_limits<float>::quiet_NaN();
  v[1] = std::numeric_limits<float>::infinity();
  v[2] = 3.3895314e38f;  // rounds up past the largest bf16: +inf
  v[3] = 1.00390625f;    // a tie: to even
  const int64_t n = static_cast<int64_t>(v.size());
  void* gx = env.gpu.alloc(n * 4);
  void* gb = env.gpu.alloc(n * 2);
  void* gy = env.gpu.alloc(n * 4);
  env.gpu.upload(gx, v.data(), n * 4);
  env.gpu.ops().elementwise([&] {
    auto a = ew(LOOM_EW_CAST, n, gx, nullptr, gb, F32);
    a.out_dtype = BF16;
    return a;
  }());
  env.gpu.ops().elementwise([&] {
    auto a = ew(LOOM_EW_CAST, n, gb, nullptr, gy, BF16);
    a.out_dtype = F32;
    return a;
  }());
  std::vector<uint16_t> bits(n);
  std::vector<float> back(n);
  env.gpu.download(bits.data(), gb, n * 2);
  env.gpu.download(back.data(), gy, n * 4);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(bits[i], bf16_bits(v[i])) << "element " << i << " = " << v[i];
    if (i > 0) {
      ASSERT_EQ(back[i], round_bf16(v[i])) << i;
    }
  }
  EXPECT_TRUE(std::isnan(back[0]));
  env.gpu.free(gx);
  env.gpu.free(gb);
  env.gpu.free(gy);
}

TEST(DeviceCuda, DropoutMaskIsBitIdenticalToTheCpu) {
  REQUIRE_GPU();
  Env env;
  const int64_t n = 100000;
  for (float p : {0.0f, 0.1f, 0.5f, 1.0f}) {
    Tensor x(env, randu(n, 100)), out(env, n), dx(env, n);
    Raw<uint8_t> mask(env, std::vector<uint8_t>(n, 7));
    for (int32_t op : {LOOM_EW_DROPOUT, LOOM_EW_DROPOUT_BWD}) {
      both<loom_elementwise_args>(env, &loom::Device::elementwise, [&](bool gpu) {
        loom_elementwise_args a = ew(op, n, gpu ? x.g() : x.c(), gpu ? static_cast<void*>(mask.g()) : mask.c(),
                                     op == LOOM_EW_DROPOUT ? (gpu ? out.g() : out.c()) : (gpu ? dx.g() : dx.c()),
                                     F32);
        a.p = p;
        a.seed = 0x1234567890abcdefull;
        a.offset = (uint64_t{1} << 32) - 5000;  // crosses a 32-bit boundary of the index
        return a;
      });
    }
    EXPECT_EQ(mask.gpu(), mask.cpu()) << "p = " << p;
    EXPECT_EQ(out.gpu(), out.cpu()) << "p = " << p;
    EXPECT_EQ(dx.gpu(), dx.cpu()) << "p = " << p;
  }
}

// ABI 1.3 seed_device: read by the kernel when it runs. Eager launches with it
// equal the CPU's; a captured one replayed after the value changed draws the new
// value's mask (what exec/partial_graph relies on for dropout).
TEST(DeviceCuda, DropoutReadsSeedDeviceWhenItRunsAlsoOnReplay) {
  REQUIRE_GPU();
  Env env;
  EXPECT_NE(env.gpu.api()->features & LOOM_DEVICE_SEED_DEVICE, 0u);
  const int64_t n = 100000;
  Tensor x(env, randu(n, 101)), out(env, n);
  Raw<uint8_t> mask(env, std::vector<uint8_t>(n, 7));
  Raw<uint64_t> seed(env, std::vector<uint64_t>{5});
  auto launch = [&](bool gpu) {
    loom_elementwise_args a = ew(LOOM_EW_DROPOUT, n, gpu ? x.g() : x.c(), gpu ? static_cast<void*>(mask.g()) : mask.c(),
                                 gpu ? out.g() : out.c(), F32);
    a.p = 0.5f;
    a.seed = 0x1234;
    a.seed_device = gpu ? seed.g() : seed.c();
    return a;
  };
  both<loom_elementwise_args>(env, &loom::Device::elementwise, launch);
  EXPECT_EQ(mask.gpu(), mask.cpu()) << "seed_device 5";
  const std::vector<uint8_t> m5 = mask.gpu();

  const loom_device_api* api = env.gpu.api();
  loom::check(api->capture_begin(env.gpu.raw(), nullptr));
  const loom_elementwise_args a = launch(true);
  loom::check(api->ops->elementwise(env.gpu.raw(), nullptr, &a));
  loom_graph* g = nullptr;
  loom::check(api->capture_end(env.gpu.raw(), nullptr, &g));
  const uint64_t six = 6;
  env.gpu.upload(seed.g(), &six, sizeof(six));
  env.cpu.upload(seed.c(), &six, sizeof(six));
  loom::check(api->graph_replay(env.gpu.raw(), g, nullptr));
  env.gpu.sync();
  const loom_elementwise_args c = launch(false);
  loom::check(env.cpu.api()->ops->elementwise(env.cpu.raw(), nullptr, &c));
  EXPECT_EQ(mask.gpu(), mask.cpu()) << "replayed with seed_device 6";
  EXPECT_NE(mask.gpu(), m5) << "the replay must read the new value";
  api->graph_destroy(env.gpu.raw(), g);
}

TEST(DeviceCuda, ReductionsMatchCpu) {
  REQUIRE_GPU();
  Env env;
  for (int32_t dt : {F32, BF16}) {
    for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{3000001}}) {
      Tensor x(env, randu(n, 110, -3, 2), dt);
      for (int32_t op : {LOOM_RED_SUM, LOOM_RED_SUM_SQUARES, LOOM_RED_MAX_ABS}) {
        for (int acc = 0; acc < 2; ++acc) {
          Tensor out(env, std::vector<float>{0.5f});
          both<loom_reduce_args>(env, &loom::Device::reduce, [&](bool gpu) {
            loom_reduce_args a = loom::make<loom_reduce_args>();
            a.op = op;
            a.n = n;
            a.x = gpu ? x.g() : x.c();
            a.out = gpu ? out.g() : out.c();
            a.accumulate = acc;
            a.dtype = gpu ? dt : F32;
            a.out_dtype = F32;
            return a;
          });
          // The sum of a bf16 tensor is exact in fp64 on both sides: fp32 tolerance.
          out.expect_match("reduce op " + std::to_string(op) + " n " + std::to_string(n), 1e-5);
        }
      }
    }
    const int64_t rows = 1000, cols = 37, ld = 40;
    Tensor m(env, randu(rows * ld, 111), dt), sums(env, randu(cols, 112));
    for (int acc = 0; acc < 2; ++acc) {
      both<loom_reduce_args>(env, &loom::Device::reduce, [&](bool gpu) {
        loom_reduce_args a = loom::make<loom_reduce_args>();
        a.op = LOOM_RED_COLUMN_SUM;
        a.n = rows * cols;
        a.cols = cols;
        a.ld = ld;
        a.x = gpu ? m.g() : m.c();
        a.out = gpu ? sums.g() : sums.c();
        a.accumulate = acc;
        a.dtype = gpu ? dt : F32;
        a.out_dtype = F32;
        return a;
      });
      sums.expect_match("column sum", 1e-5);
    }
    std::vector<float> xv = randu(rows * ld, 113);
    xv[5 * ld + 3] = xv[5 * ld + 9] = 5.0f;                  // a tie: the first wins
    xv[7 * ld + 2] = std::numeric_limits<float>::quiet_NaN();  // NaN never wins
    Tensor am(env, xv, dt);
    Raw<int32_t> idx(env, std::vector<int32_t>(rows, -1));
    both<loom_reduce_args>(env, &loom::Device::reduce, [&](bool gpu) {
      loom_reduce_args a = loom::make<loom_reduce_args>();
      a.op = LOOM_RED_ROW_ARGMAX;
      a.n = rows * cols;
      a.cols = cols;
      a.ld = ld;
      a.x = gpu ? am.g() : am.c();
      a.out = gpu ? static_cast<void*>(idx.g()) : idx.c();
      a.dtype = gpu ? dt : F32;
      a.out_dtype = LOOM_DTYPE_I32;
      return a;
    });
    EXPECT_EQ(idx.gpu(), idx.cpu());  // both see the same (rounded) values: the same first maximum
  }
}

// ABI 1.8 multi-tensor calls: one adamw over segments at different offsets of each
// buffer (16-byte aligned ones take the 8-element path, the others one by one) and one
// SUM_SQUARES with an out per segment, against device/cpu's (one call per segment).
TEST(DeviceCuda, MultiTensorAdamwAndReduceMatchCpu) {
  REQUIRE_GPU();
  Env env;
  ASSERT_NE(env.gpu.api()->features & LOOM_DEVICE_MULTI_TENSOR, 0u);
  const int64_t n = 120000;
  const std::vector<loom_adamw_segment> table = {{0, 64, 8, 16, 50000, 0.1f, 0},
                                                 {50003, 50064, 50001, 50016, 997, 0.0f, 0},
                                                 {51000, 60000, 70000, 80000, 33333, 0.1f, 0}};
  Raw<loom_adamw_segment> segs(env, table);
  for (int32_t gdt : {F32, BF16}) {
    Tensor param(env, randu(n, 180)), grad(env, randu(n, 181, -1e-3f, 1e-3f), gdt);
    Tensor m(env, randu(n, 182, -1e-4f, 1e-4f)), v(env, randu(n, 183, 0, 1e-6f)), copy(env, n, BF16);
    for (int64_t step = 1; step <= 2; ++step) {
      both<loom_adamw_args>(env, &loom::Device::adamw, [&](bool gpu) {
        loom_adamw_args a = loom::make<loom_adamw_args>();
        a.param = static_cast<float*>(gpu ? param.g() : param.c());
        a.grad = gpu ? grad.g() : grad.c();
        a.m = static_cast<float*>(gpu ? m.g() : m.c());
        a.v = static_cast<float*>(gpu ? v.g() : v.c());
        a.grad_dtype = gpu ? gdt : F32;
        a.lr = 1e-3f;
        a.beta1 = 0.9f;
        a.beta2 = 0.95f;
        a.eps = 1e-8f;
        a.grad_scale = 0.5f;
        a.step = step;
        a.param_copy = gpu ? copy.g() : nullptr;
        a.copy_dtype = BF16;
        a.num_segments = static_cast<int64_t>(table.size());
        a.segments = gpu ? segs.g() : segs.c();
        return a;
      });
    }
    const std::string tag = gdt == BF16 ? " (bf16 gradients)" : " (fp32 gradients)";
    param.expect_match("multi-tensor adamw param" + tag);
    m.expect_match("multi-tensor adamw m" + tag);
    v.expect_match("multi-tensor adamw v" + tag);
    const std::vector<float> p = param.gpu(), c = copy.gpu();
    for (const loom_adamw_segment& sg : table)
      for (int64_t i = 0; i < sg.numel; ++i)
        ASSERT_EQ(c[sg.copy_offset + i], round_bf16(p[sg.param_offset + i])) << "param_copy" << tag;
  }
  const std::vector<loom_reduce_segment> rtable = {{0, 70000}, {3, 5}, {70001, 0}, {70001, 49999}};
  Raw<loom_reduce_segment> rsegs(env, rtable);
  for (int32_t dt : {F32, BF16}) {
    Tensor x(env, randu(n, 190), dt), out(env, randu(rtable.size(), 191));
    for (int32_t op : {LOOM_RED_SUM, LOOM_RED_SUM_SQUARES, LOOM_RED_MAX_ABS}) {
      both<loom_reduce_args>(env, &loom::Device::reduce, [&](bool gpu) {
        loom_reduce_args a = loom::make<loom_reduce_args>();
        a.op = op;
        a.x = gpu ? x.g() : x.c();
        a.out = gpu ? out.g() : out.c();
        a.accumulate = 1;
        a.dtype = gpu ? dt : F32;
        a.out_dtype = F32;
        a.num_segments = static_cast<int64_t>(rtable.size());
        a.segments = gpu ? rsegs.g() : rsegs.c();
        return a;
      });
      out.expect_match("multi-tensor reduce op " + std::to_string(op) + (dt == BF16 ? " bf16" : " f32"), 1e-5);
    }
  }
}

TEST(DeviceCuda, AdamwMatchesCpu) {
  REQUIRE_GPU();
  Env env;
  for (int32_t gdt : {F32, BF16}) {
    const int64_t n = 50001;
    Tensor param(env, randu(n, 120)), grad(env, randu(n, 121, -1e-3f, 1e-3f), gdt);
    Tensor m(env, randu(n, 122, -1e-4f, 1e-4f)), v(env, randu(n, 123, 0, 1e-6f)), copy(env, n, BF16);
    for (int64_t step = 1; step <= 3; ++step) {
      both<loom_adamw_args>(env, &loom::Device::adamw, [&](bool gpu) {
        loom_adamw_args a = loom::make<loom_adamw_args>();
        a.n = n;
        a.param = static_cast<float*>(gpu ? param.g() : param.c());
        a.grad = gpu ? grad.g() : grad.c();
        a.m = static_cast<float*>(gpu ? m.g() : m.c());
        a.v = static_cast<float*>(gpu ? v.g() : v.c());
        a.grad_dtype = gpu ? gdt : F32;
        a.lr = 1e-3f;
        a.beta1 = 0.9f;
        a.beta2 = 0.95f;
        a.eps = 1e-8f;
        a.weight_decay = 0.1f;
        a.grad_scale = 0.5f;
        a.step = step;
        a.param_copy = gpu ? copy.g() : nullptr;  // the CPU check of the copy is round_bf16(param)
        a.copy_dtype = BF16;
        return a;
      });
    }
    param.expect_match("adamw param");
    m.expect_match("adamw m");
    v.expect_match("adamw v");
    std::vector<float> want = param.gpu();
    for (float& w : want) w = round_bf16(w);
    EXPECT_EQ(copy.gpu(), want);
  }
}

// ---------------------------------------------------------------------------
// Memory, streams and events
// ---------------------------------------------------------------------------

TEST(DeviceCuda, AllocatorStatisticsTrackCurrentPeakAndReserved) {
  REQUIRE_GPU();
  Dev d("cuda");
  const loom_memory_stats s0 = d.stats();
  EXPECT_EQ(s0.current_bytes, 0u);
  // ABI 1.9: what one rank may plan to hold, the whole GPU for a lone rank.
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  EXPECT_EQ(s0.capacity_bytes, static_cast<uint64_t>(total_bytes));
  void* a = d.alloc(1000);
  void* b = d.alloc(5 << 20);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 256, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b) % 256, 0u);
  loom_memory_stats s1 = d.stats();
  EXPECT_EQ(s1.current_bytes, 1000u + (5u << 20));
  EXPECT_EQ(s1.peak_bytes, s1.current_bytes);
  EXPECT_GE(s1.reserved_bytes, s1.current_bytes);
  EXPECT_EQ(s1.num_allocs, s0.num_allocs + 2);
  d.free(a);
  d.free(b);
  const loom_memory_stats s2 = d.stats();
  EXPECT_EQ(s2.current_bytes, 0u);
  EXPECT_EQ(s2.peak_bytes, s1.peak_bytes);
  EXPECT_EQ(s2.reserved_bytes, s1.reserved_bytes) << "freed blocks stay cached";
  // The same sizes again come from the cache: nothing new is reserved.
  void* c = d.alloc(5 << 20);
  void* e = d.alloc(1000);
  EXPECT_EQ(d.stats().reserved_bytes, s1.reserved_bytes);
  d.free(c);
  d.free(e);
  // Freeing what the device did not allocate is logged, not a crash.
  int local = 0;
  d.free(&local);
  EXPECT_EQ(d.stats().current_bytes, 0u);
}

// Memory allocated inside a capture belongs to the graph pool while a graph could
// replay into it; freed once no graph is alive, it is an ordinary block again, so
// the next eager allocation of its size reuses it instead of reserving more.
TEST(DeviceCuda, AGraphBlockFreedWhenNoGraphLivesServesEagerAllocations) {
  REQUIRE_GPU();
  Dev d("cuda");
  const loom_device_api* api = d.api();
  const int64_t n = int64_t{1} << 20;  // 4 MiB of fp32
  loom::check(api->capture_begin(d.raw(), nullptr));
  void* p = d.alloc(static_cast<size_t>(n) * 4);  // from the graph pool
  loom_elementwise_args fill = ew(LOOM_EW_FILL, n, nullptr, nullptr, p, F32);
  fill.alpha = 3.0f;
  loom::check(api->ops->elementwise(d.raw(), nullptr, &fill));
  loom_graph* g = nullptr;
  loom::check(api->capture_end(d.raw(), nullptr, &g));
  loom::check(api->graph_replay(d.raw(), g, nullptr));
  loom::check(api->stream_synchronize(d.raw(), nullptr));
  api->graph_destroy(d.raw(), g);
  d.free(p);
  const uint64_t reserved = d.stats().reserved_bytes;
  void* q = d.alloc(static_cast<size_t>(n) * 4);
  EXPECT_EQ(d.stats().reserved_bytes, reserved) << "the idle graph block was not reused";
  EXPECT_EQ(q, p);
  d.free(q);
}

TEST(DeviceCuda, StreamsAreOrderedByEvents) {
  REQUIRE_GPU();
  Dev d("cuda");
  const loom_device_api* api = d.api();
  const int64_t n = 1 << 22;
  void* x = d.alloc(n * 4);
  void* total = d.alloc(4);
  loom_stream* side = nullptr;
  loom_event* ev = nullptr;
  loom::check(api->stream_create(d.raw(), &side));
  loom::check(api->event_create(d.raw(), &ev));
  EXPECT_NE(api->native_stream(d.raw(), nullptr), nullptr);
  EXPECT_NE(api->native_stream(d.raw(), side), api->native_stream(d.raw(), nullptr));
  // x = 1 on the default stream; the side stream waits for it, then sums x.
  d.ops().elementwise([&] {
    auto a = ew(LOOM_EW_FILL, n, nullptr, nullptr, x, F32);
    a.alpha = 1.0f;
    return a;
  }());
  loom::check(api->event_record(d.raw(), ev, nullptr));
  loom::check(api->stream_wait_event(d.raw(), side, ev));
  loom_reduce_args r = loom::make<loom_reduce_args>();
  r.op = LOOM_RED_SUM;
  r.n = n;
  r.x = x;
  r.out = total;
  d.ops(side).reduce(r);
  loom::check(api->stream_synchronize(d.raw(), side));
  float got = 0;
  d.download(&got, total, 4);
  EXPECT_EQ(got, static_cast<float>(n));
  loom::check(api->event_synchronize(d.raw(), ev));
  api->event_destroy(d.raw(), ev);
  api->stream_destroy(d.raw(), side);
  d.free(x);
  d.free(total);
}

// rows x width bytes from src (pitch sp) to dst (pitch dp): the host reference of copy_2d.
void copy_2d_ref(std::vector<uint8_t>& dst, size_t dp, const uint8_t* src, size_t sp, size_t width, size_t rows) {
  for (size_t r = 0; r < rows; ++r) std::memcpy(dst.data() + r * dp, src + r * sp, width);
}

// H2D gathers every 3rd 40-byte block of a host buffer into pitched device rows,
// D2D moves them to other pitches, D2H scatters them into pitched host rows; the
// bytes between rows (prefilled) must stay as they were.
TEST(DeviceCuda, Copy2dMovesRowsAtPitchesAndLeavesTheGapsAlone) {
  REQUIRE_GPU();
  Dev d("cuda");
  const loom_device_api* api = d.api();
  const size_t width = 40, rows = 7, a_pitch = 56, b_pitch = 72, h_pitch = 64;
  std::vector<uint8_t> host(3 * width * rows);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<uint8_t>(i * 7 + 1);
  std::vector<uint8_t> a_want(a_pitch * rows, 0xab), b_want(b_pitch * rows, 0xcd), h_want(h_pitch * rows, 0xef);
  void* a = d.alloc(a_want.size());
  void* b = d.alloc(b_want.size());
  d.upload(a, a_want.data(), a_want.size());
  d.upload(b, b_want.data(), b_want.size());
  std::vector<uint8_t> h = h_want;

  loom::check(api->copy_2d(d.raw(), nullptr, a, a_pitch, host.data(), 3 * width, width, rows,
                           LOOM_COPY_HOST_TO_DEVICE));
  d.ops().copy_2d(b, b_pitch, a, a_pitch, width, rows, LOOM_COPY_DEVICE_TO_DEVICE);  // through the C++ layer
  loom::check(api->copy_2d(d.raw(), nullptr, h.data(), h_pitch, b, b_pitch, width, rows, LOOM_COPY_DEVICE_TO_HOST));
  d.sync();
  copy_2d_ref(a_want, a_pitch, host.data(), 3 * width, width, rows);
  copy_2d_ref(b_want, b_pitch, a_want.data(), a_pitch, width, rows);
  copy_2d_ref(h_want, h_pitch, b_want.data(), b_pitch, width, rows);
  std::vector<uint8_t> got(a_want.size());
  d.download(got.data(), a, got.size());
  EXPECT_EQ(got, a_want) << "H2D";
  got.resize(b_want.size());
  d.download(got.data(), b, got.size());
  EXPECT_EQ(got, b_want) << "D2D";
  EXPECT_EQ(h, h_want) << "D2H";

  // Zero rows or width: nothing to do, whatever the pointers.
  loom::check(api->copy_2d(d.raw(), nullptr, nullptr, 0, nullptr, 0, 0, rows, LOOM_COPY_DEVICE_TO_DEVICE));
  loom::check(api->copy_2d(d.raw(), nullptr, nullptr, 0, nullptr, 0, width, 0, LOOM_COPY_DEVICE_TO_DEVICE));
  // Refusals name the call.
  StatusInfo s = take(api->copy_2d(d.raw(), nullptr, b, width - 1, a, a_pitch, width, rows,
                                   LOOM_COPY_DEVICE_TO_DEVICE));
  EXPECT_EQ(s.code, LOOM_CODE_INVALID_ARGUMENT);
  EXPECT_NE(s.message.find("device/cuda copy_2d"), std::string::npos) << s.message;
  s = take(api->copy_2d(d.raw(), nullptr, b, b_pitch, nullptr, a_pitch, width, rows, LOOM_COPY_DEVICE_TO_DEVICE));
  EXPECT_EQ(s.code, LOOM_CODE_INVALID_ARGUMENT);
  EXPECT_NE(s.message.find("device/cuda copy_2d"), std::string::npos) << s.message;
  s = take(api->copy_2d(d.raw(), nullptr, b, b_pitch, a, a_pitch, width, rows, 9));
  EXPECT_EQ(s.code, LOOM_CODE_INVALID_ARGUMENT);
  EXPECT_NE(s.message.find("device/cuda copy_2d"), std::string::npos) << s.message;
  got.resize(b_want.size());
  d.download(got.data(), b, got.size());
  EXPECT_EQ(got, b_want) << "a refused copy_2d wrote nothing";
  d.free(a);
  d.free(b);
}

// ---------------------------------------------------------------------------
// Graphs
// ---------------------------------------------------------------------------

TEST(DeviceCuda, GraphRecordsCopy2d) {
  REQUIRE_GPU();
  Dev d("cuda");
  const loom_device_api* api = d.api();
  const size_t width = 24, rows = 5, src_pitch = 32, dst_pitch = 40;
  std::vector<uint8_t> src(src_pitch * rows), dst_want(dst_pitch * rows, 0x11);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 3 + 5);
  void* s = d.alloc(src.size());
  void* t = d.alloc(dst_want.size());
  d.upload(s, src.data(), src.size());
  d.upload(t, dst_want.data(), dst_want.size());
  loom::check(api->capture_begin(d.raw(), nullptr));
  loom::check(api->copy_2d(d.raw(), nullptr, t, dst_pitch, s, src_pitch, width, rows, LOOM_COPY_DEVICE_TO_DEVICE));
  loom_graph* g = nullptr;
  loom::check(api->capture_end(d.raw(), nullptr, &g));
  ASSERT_NE(g, nullptr);
  std::vector<uint8_t> got(dst_want.size());
  d.download(got.data(), t, got.size());
  EXPECT_EQ(got, dst_want) << "nothing runs during capture";
  loom::check(api->graph_replay(d.raw(), g, nullptr));
  d.sync();
  copy_2d_ref(dst_want, dst_pitch, src.data(), src_pitch, width, rows);
  d.download(got.data(), t, got.size());
  EXPECT_EQ(got, dst_want) << "replay";
  api->graph_destroy(d.raw(), g);
  d.free(s);
  d.free(t);
}

TEST(DeviceCuda, GraphRecordsLaunchesAndReplaysThemOnTheSameAddresses) {
  REQUIRE_GPU();
  Dev d("cuda");
  const loom_device_api* api = d.api();
  const int64_t n = 64;
  float* x = static_cast<float*>(d.alloc(n * 4));
  float* w = static_cast<float*>(d.alloc(n * n * 4));
  float* y = static_cast<float*>(d.alloc(n * 4));
  float* z = static_cast<float*>(d.alloc(n * 4));
  float* total = static_cast<float*>(d.alloc(4));
  std::vector<float> xv = randu(n, 150);
  const std::vector<float> wv = randu(n * n, 151);
  const std::vector<float> minus(n, -1.0f);
  d.upload(x, xv.data(), n * 4);
  d.upload(w, wv.data(), n * n * 4);
  d.upload(y, minus.data(), n * 4);
  d.upload(z, minus.data(), n * 4);
  d.upload(total, minus.data(), 4);
  const loom_memory_stats before = d.stats();
  int host_counter = 0;

  loom::check(api->capture_begin(d.raw(), nullptr));
  loom_gemm_args g = loom::make<loom_gemm_args>();
  g.m = n;
  g.n = 1;
  g.k = n;
  g.a = w;
  g.lda = n;
  g.b = x;
  g.ldb = 1;
  g.c = y;
  g.ldc = 1;
  g.batch = 1;
  g.alpha = 1.0f;
  loom::check(api->ops->gemm(d.raw(), nullptr, &g));
  host_counter++;
  loom_elementwise_args s = ew(LOOM_EW_SCALE, n, y, nullptr, y, F32);
  s.alpha = 2.0f;
  loom::check(api->ops->elementwise(d.raw(), nullptr, &s));
  s.alpha = 1000.0f;  // changed after the launch: the graph holds its own copy
  loom::check(api->copy(d.raw(), nullptr, z, y, n * 4, LOOM_COPY_DEVICE_TO_DEVICE));
  // An allocation inside the capture (graph pool), used and freed there.
  float* tmp = static_cast<float*>(d.alloc(n * 4));
  loom::check(api->copy(d.raw(), nullptr, tmp, z, n * 4, LOOM_COPY_DEVICE_TO_DEVICE));
  loom_reduce_args r = loom::make<loom_reduce_args>();
  r.op = LOOM_RED_SUM;
  r.n = n;
  r.x = tmp;
  r.out = total;
  loom::check(api->ops->reduce(d.raw(), nullptr, &r));
  d.free(tmp);
  host_counter++;
  // No host sync inside a capture.
  EXPECT_EQ(take(api->stream_synchronize(d.raw(), nullptr)).code, LOOM_CODE_INVALID_ARGUMENT);
  EXPECT_EQ(take(api->capture_begin(d.raw(), nullptr)).code, LOOM_CODE_INVALID_ARGUMENT);
  loom_graph* graph = nullptr;
  loom::check(api->capture_end(d.raw(), nullptr, &graph));
  ASSERT_NE(graph, nullptr);

  std::vector<float> yv(n), zv(n);
  float t = 0;
  d.download(yv.data(), y, n * 4);
  d.download(zv.data(), z, n * 4);
  d.download(&t, total, 4);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(yv[i], -1.0f) << "nothing runs during capture";
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(zv[i], -1.0f);
  EXPECT_EQ(t, -1.0f);

  auto expect_result = [&](const std::vector<float>& xs, const std::string& what) {
    std::vector<float> want(n);
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      double acc = 0;
      for (int64_t k = 0; k < n; ++k) acc += double(wv[i * n + k]) * xs[k];
      want[i] = static_cast<float>(2 * acc);
      sum += 2 * acc;
    }
    d.download(yv.data(), y, n * 4);
    d.download(zv.data(), z, n * 4);
    d.download(&t, total, 4);
    expect_rel(yv, want, 1e-5, what + " y");
    expect_rel(zv, want, 1e-5, what + " z");
    EXPECT_NEAR(t, sum, 1e-3) << what;
  };
  loom::check(api->graph_replay(d.raw(), graph, nullptr));
  expect_result(xv, "replay 1");
  EXPECT_EQ(host_counter, 2);
  xv = randu(n, 152);
  d.upload(x, xv.data(), n * 4);
  loom::check(api->graph_replay(d.raw(), graph, nullptr));
  expect_result(xv, "replay 2");

  // Nested: replaying into another capture adds the graph; the outer one keeps a copy.
  d.upload(y, minus.data(), n * 4);
  loom::check(api->capture_begin(d.raw(), nullptr));
  loom::check(api->graph_replay(d.raw(), graph, nullptr));
  loom_graph* outer = nullptr;
  loom::check(api->capture_end(d.raw(), nullptr, &outer));
  api->graph_destroy(d.raw(), graph);
  loom_stream* side = nullptr;
  loom::check(api->stream_create(d.raw(), &side));
  loom::check(api->graph_replay(d.raw(), outer, side));
  loom::check(api->stream_synchronize(d.raw(), side));
  expect_result(xv, "nested replay on another stream");
  api->graph_destroy(d.raw(), outer);
  api->stream_destroy(d.raw(), side);
  EXPECT_EQ(d.stats().current_bytes, before.current_bytes);
  for (void* p : {static_cast<void*>(x), static_cast<void*>(w), static_cast<void*>(y), static_cast<void*>(z),
                  static_cast<void*>(total)})
    d.free(p);
}

TEST(DeviceCuda, CaptureOnASideStreamLeavesOtherStreamsEager) {
  REQUIRE_GPU();
  Dev d("cuda");
  const loom_device_api* api = d.api();
  loom_stream* side = nullptr;
  loom::check(api->stream_create(d.raw(), &side));
  float* a = static_cast<float*>(d.alloc(64));
  float* b = static_cast<float*>(d.alloc(64));
  const std::vector<float> zeros(16, 0.0f);
  d.upload(a, zeros.data(), 64);
  d.upload(b, zeros.data(), 64);
  loom::check(api->capture_begin(d.raw(), side));
  auto fill = ew(LOOM_EW_FILL, 16, nullptr, nullptr, a, F32);
  fill.alpha = 3.0f;
  loom::check(api->ops->elementwise(d.raw(), nullptr, &fill));  // the default stream: runs now
  auto fill_b = ew(LOOM_EW_FILL, 16, nullptr, nullptr, b, F32);
  fill_b.alpha = 4.0f;
  loom::check(api->ops->elementwise(d.raw(), side, &fill_b));  // recorded
  auto bad = ew(LOOM_EW_FILL, 16, nullptr, nullptr, nullptr, F32);
  EXPECT_EQ(take(api->ops->elementwise(d.raw(), side, &bad)).code, LOOM_CODE_INVALID_ARGUMENT);
  loom_graph* wrong = nullptr;
  EXPECT_EQ(take(api->capture_end(d.raw(), nullptr, &wrong)).code, LOOM_CODE_INVALID_ARGUMENT);
  loom_graph* g = nullptr;
  loom::check(api->capture_end(d.raw(), side, &g));
  std::vector<float> av(16), bv(16);
  d.download(av.data(), a, 64);
  d.download(bv.data(), b, 64);
  EXPECT_EQ(av[5], 3.0f);
  EXPECT_EQ(bv[5], 0.0f);
  loom::check(api->graph_replay(d.raw(), g, nullptr));
  d.download(bv.data(), b, 64);
  EXPECT_EQ(bv[5], 4.0f);
  api->graph_destroy(d.raw(), g);
  api->stream_destroy(d.raw(), side);
  d.free(a);
  d.free(b);
}

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

TEST(DeviceCuda, ErrorsNameTheOpAndAreStatuses) {
  REQUIRE_GPU();
  Dev d("cuda");
  void* buf = d.alloc(256);
  loom_layernorm_fwd_args ln = loom::make<loom_layernorm_fwd_args>();
  ln.rows = 2;
  ln.cols = 4;
  ln.x = buf;
  ln.y = buf;
  ln.dtype = LOOM_DTYPE_F16;
  StatusInfo s = take(d.api()->ops->layernorm_fwd(d.raw(), nullptr, &ln));
  EXPECT_EQ(s.code, LOOM_CODE_UNSUPPORTED);
  EXPECT_NE(s.message.find("layernorm_fwd"), std::string::npos) << s.message;
  EXPECT_NE(s.message.find("f16"), std::string::npos) << s.message;
  // A CUDA failure names the call, the op and the rank.
  void* huge = nullptr;
  s = take(d.api()->alloc(d.raw(), size_t{1} << 50, &huge));
  EXPECT_EQ(s.code, LOOM_CODE_OUT_OF_MEMORY);
  EXPECT_NE(s.message.find("cudaMalloc"), std::string::npos) << s.message;
  EXPECT_NE(s.message.find("rank 0"), std::string::npos) << s.message;
  loom_xent_args zero_size{};
  EXPECT_EQ(take(d.api()->ops->xent(d.raw(), nullptr, &zero_size)).code, LOOM_CODE_INVALID_ARGUMENT);
  d.free(buf);
}

}  // namespace
