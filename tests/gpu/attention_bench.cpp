// loom_attention_bench: times device/cuda's attention op, fused kernels against the
// GEMM path (fused_attention = false), on packed QKV [B, S, 3, H, D] in bf16, causal.
// A benchmark program, not a test: it prints numbers (and the largest difference
// between the two paths' outputs, as a sanity check).
//
//   loom_attention_bench [B S H D]...     default: 16 1024 12 64  4 2048 16 128
//
// FLOPs: forward 4 B H S^2 D, halved for causal masking; backward 2.5x the forward
// (the five products of FlashAttention-2's accounting). Plugins are found as the
// GPU tests find them (LOOM_PLUGIN_PATH, else next to the binary).
#include <toml++/toml.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <loom/cpp/core.hpp>
#include <random>
#include <string>
#include <vector>

#include "engine/plugins/registry.hpp"
#include "tests/gpu/plugin_dir.hpp"

namespace {

struct Shape {
  int64_t B, S, H, D;
};

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

class Bench {
 public:
  Bench(const loom::plugins::LoadedPlugin& plugin, bool fused) : api_(plugin.device()) {
    toml::table section{{"fused_attention", fused}};
    loom::plugins::OptionValues opts(&section, plugin.options);
    loom_device_create_args args = loom::make<loom_device_create_args>();
    args.num_threads = 1;
    args.ranks_in_process = 1;
    loom::check(api_->create(opts.raw(), &args, &dev_));
  }
  ~Bench() {
    for (void* p : owned_) api_->free(dev_, p);
    api_->destroy(dev_);
  }
  Bench(const Bench&) = delete;
  Bench& operator=(const Bench&) = delete;

  void* upload(const std::vector<uint16_t>& h) {
    void* p = alloc(h.size() * 2);
    loom::check(api_->copy(dev_, nullptr, p, h.data(), h.size() * 2, LOOM_COPY_HOST_TO_DEVICE));
    return p;
  }
  void* alloc(size_t bytes) {
    void* p = nullptr;
    loom::check(api_->alloc(dev_, bytes, &p));
    owned_.push_back(p);
    return p;
  }
  std::vector<uint16_t> download(const void* p, size_t n) {
    std::vector<uint16_t> h(n);
    sync();
    loom::check(api_->copy(dev_, nullptr, h.data(), p, n * 2, LOOM_COPY_DEVICE_TO_HOST));
    sync();
    return h;
  }
  void sync() { loom::check(api_->stream_synchronize(dev_, nullptr)); }
  loom::Device ops() const { return loom::Device(api_, dev_, nullptr); }

 private:
  const loom_device_api* api_;
  loom_device* dev_ = nullptr;
  std::vector<void*> owned_;
};

template <typename F>
double ms_per_call(Bench& b, F&& f, int iters) {
  for (int i = 0; i < 3; ++i) f();  // warm-up: kernels loaded, cuBLAS heuristics, allocator
  b.sync();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) f();
  b.sync();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / iters;
}

void run(const loom::plugins::LoadedPlugin& plugin, const Shape& s) {
  const int64_t W = s.H * s.D, n_qkv = s.B * s.S * 3 * W, n_out = s.B * s.S * W;
  std::mt19937 gen(7);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<uint16_t> qkv(n_qkv), dout(n_out);
  for (auto& x : qkv) x = to_bf16(dist(gen));
  for (auto& x : dout) x = to_bf16(0.1f * dist(gen));
  const double fwd_flops = 4.0 * s.B * s.H * s.S * s.S * s.D * 0.5;
  std::vector<uint16_t> outs[2];
  std::printf("B %lld S %lld H %lld D %lld (bf16, causal, packed QKV)\n", static_cast<long long>(s.B),
              static_cast<long long>(s.S), static_cast<long long>(s.H), static_cast<long long>(s.D));
  for (int fused = 1; fused >= 0; --fused) {
    Bench b(plugin, fused != 0);
    char* q = static_cast<char*>(b.upload(qkv));
    void* dqkv = b.alloc(n_qkv * 2);
    void* out = b.alloc(n_out * 2);
    void* go = b.upload(dout);
    void* lse = b.alloc(s.B * s.H * s.S * 4);
    loom_attention_args a = loom::make<loom_attention_args>();
    a.batch = s.B;
    a.seq = s.S;
    a.heads = s.H;
    a.head_dim = s.D;
    a.qkv_stride_b = s.S * 3 * W;
    a.qkv_stride_s = 3 * W;
    a.out_stride_b = s.S * W;
    a.out_stride_s = W;
    a.q = q;
    a.k = q + W * 2;
    a.v = q + 2 * W * 2;
    a.out = out;
    a.lse = static_cast<float*>(lse);
    a.dout = go;
    a.dq = dqkv;
    a.dk = static_cast<char*>(dqkv) + W * 2;
    a.dv = static_cast<char*>(dqkv) + 2 * W * 2;
    a.scale = 1.0f / std::sqrt(static_cast<float>(s.D));
    a.causal = 1;
    a.dtype = LOOM_DTYPE_BF16;
    const loom::Device d = b.ops();
    const double f_ms = ms_per_call(b, [&] { d.attention_fwd(a); }, 20);
    const double fb_ms = ms_per_call(b, [&] { d.attention_fwd(a); d.attention_bwd(a); }, 20);
    std::printf("  %-8s forward %8.3f ms (%6.1f TFLOP/s) | forward+backward %8.3f ms (%6.1f TFLOP/s)\n",
                fused ? "fused" : "unfused", f_ms, fwd_flops / (f_ms * 1e9), fb_ms, 3.5 * fwd_flops / (fb_ms * 1e9));
    outs[fused] = b.download(out, n_out);
    const std::vector<uint16_t> g = b.download(dqkv, n_qkv);
    outs[fused].insert(outs[fused].end(), g.begin(), g.end());
  }
  double worst = 0, scale = 0;
  for (size_t i = 0; i < outs[0].size(); ++i) {
    scale = std::max(scale, std::fabs(static_cast<double>(from_bf16(outs[0][i]))));
    worst = std::max(worst, std::fabs(static_cast<double>(from_bf16(outs[1][i])) - from_bf16(outs[0][i])));
  }
  std::printf("  fused vs unfused: largest difference of out, dq, dk, dv %.3g (of max |x| %.3g)\n", worst, scale);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<Shape> shapes;
  for (int i = 1; i + 3 < argc; i += 4)
    shapes.push_back({std::atoll(argv[i]), std::atoll(argv[i + 1]), std::atoll(argv[i + 2]), std::atoll(argv[i + 3])});
  if (shapes.empty()) shapes = {{16, 1024, 12, 64}, {4, 2048, 16, 128}};
  try {
    loom::plugins::Registry reg;
    reg.load_file(loom_test::plugin_file("loom_device_cuda.so"));
    loom::host_slot() = loom::plugins::host_api();
    const loom::plugins::LoadedPlugin& plugin = reg.get("device", "cuda");
    for (const Shape& s : shapes) run(plugin, s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom_attention_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
