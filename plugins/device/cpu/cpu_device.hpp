// device/cpu: the reference backend (fp32 math; f32 or bf16 storage). Internal header
// shared by the plugin's translation units (nothing here crosses the ABI; plugin.cpp
// builds the C tables).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <loom/cpp/core.hpp>

#include "../common/op_contract.hpp"
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <map>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kernels.hpp"

namespace loom::cpu {

// ---------------------------------------------------------------------------
// Thread pool: `threads - 1` workers plus the calling thread. Workers wait
// passively (futex via std::atomic::wait), never spin, so they do not fight
// OpenBLAS or other ranks' threads for the cores. One parallel region at a time;
// a second caller (or a nested call) simply runs its loop serially.
// ---------------------------------------------------------------------------
class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return threads_; }

  // Calls fn(chunk) for chunk in [0, chunks), spread over the pool. Exceptions
  // from any chunk are rethrown in the caller (the first one wins).
  template <typename Fn>
  void run_chunks(int64_t chunks, Fn&& fn) {
    if (chunks <= 0) return;
    if (chunks == 1 || threads_ <= 1) {
      for (int64_t i = 0; i < chunks; ++i) fn(i);
      return;
    }
    run_impl(chunks, &fn, [](void* f, int64_t i) { (*static_cast<std::remove_reference_t<Fn>*>(f))(i); });
  }

  // fn(begin, end) over [0, n) in at most size() contiguous ranges of at least
  // `grain` elements; serial when the work is small.
  template <typename Fn>
  void parallel_for(int64_t n, int64_t grain, Fn&& fn) {
    if (n <= 0) return;
    int64_t chunks = std::min<int64_t>(threads_, std::max<int64_t>(1, n / std::max<int64_t>(1, grain)));
    if (chunks <= 1) {
      fn(int64_t{0}, n);
      return;
    }
    run_chunks(chunks, [&](int64_t c) { fn(n * c / chunks, n * (c + 1) / chunks); });
  }

 private:
  using Thunk = void (*)(void*, int64_t);
  void run_impl(int64_t chunks, void* ctx, Thunk thunk);
  void worker_loop();
  void run_task_chunks();

  int threads_;
  std::vector<std::thread> workers_;
  std::atomic<bool> busy_{false};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<int64_t> next_chunk_{0};
  std::atomic<bool> stop_{false};
  // The current task (written by the caller before bumping generation_).
  void* ctx_ = nullptr;
  Thunk thunk_ = nullptr;
  int64_t chunks_ = 0;
  std::mutex error_mu_;
  std::exception_ptr error_;
};

// ---------------------------------------------------------------------------
// GEMM backends.
// ---------------------------------------------------------------------------

// cblas_sgemm's signature with the enums as ints (CblasRowMajor = 101,
// CblasNoTrans = 111, CblasTrans = 112); blasint is 32-bit in Debian's OpenBLAS.
using SgemmFn = void (*)(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a, int lda,
                         const float* b, int ldb, float beta, float* c, int ldc);

struct OpenBlas {
  bool loaded = false;
  SgemmFn sgemm = nullptr;
  std::string corename;              // "SkylakeX", "Haswell", "Zen", ...
  std::string error;                 // why it is not loaded
  bool avx512_but_not_used = false;  // AVX-512 CPU, yet OpenBLAS picked an AVX2 core
  std::string why_not;               // why: the environment's OPENBLAS_CORETYPE, or loaded before us
};
// Loads libopenblas once per process (thread-safe), after arranging
// OPENBLAS_CORETYPE for AVX-512 machines; pins OpenBLAS to one thread per call.
const OpenBlas& openblas();

// One row-major C = alpha*op(A)*op(B) + beta*C with the portable blocked kernel.
void builtin_sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                   int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// ---------------------------------------------------------------------------
// Streams, events, graphs.
// ---------------------------------------------------------------------------

constexpr uint32_t kDeviceMagic = 0x4c435055;  // "LCPU"
constexpr uint32_t kStreamMagic = 0x4c535452;
constexpr uint32_t kEventMagic = 0x4c455654;
constexpr uint32_t kGraphMagic = 0x4c475248;

struct Launch {
  const char* name;          // op name, for replay errors
  std::function<void()> fn;  // the op with its argument struct copied by value
};

struct Device;

struct Stream {
  uint32_t magic = kStreamMagic;
  Device* dev = nullptr;
  bool capturing = false;
  std::vector<Launch> recorded;
};

struct Event {
  uint32_t magic = kEventMagic;
  Device* dev = nullptr;
  bool recorded = false;
};

struct Graph {
  uint32_t magic = kGraphMagic;
  Device* dev = nullptr;
  std::vector<Launch> launches;
};

// ---------------------------------------------------------------------------
// The device instance of one rank.
// ---------------------------------------------------------------------------
struct Device {
  uint32_t magic = kDeviceMagic;
  int32_t global_rank = 0;
  int32_t local_rank = 0;
  bool verbose = false;
  SgemmFn sgemm = nullptr;     // OpenBLAS, or nullptr for the builtin kernel
  const Kernels* k = nullptr;  // inner loops for this CPU's instruction set
  std::string blas_name;       // for logs
  std::unique_ptr<ThreadPool> pool;
  Stream default_stream;
  Stream* capturing = nullptr;  // the stream under capture (one per device)

  // Memory accounting.
  std::mutex mem_mu;
  std::unordered_map<void*, std::pair<size_t, size_t>> allocations;  // ptr -> (bytes, reserved)
  uint64_t current_bytes = 0, peak_bytes = 0, reserved_bytes = 0, num_allocs = 0;
  uint64_t capacity_bytes = 0;  // this rank's share of the host's RAM, or memory_limit; 0 = unknown
  uint64_t memory_limit = 0;    // device.options.memory_mb: allocations beyond it fail; 0 = none

  // The graph pool, with device/cuda's rules: memory allocated during a capture is
  // written again by every replay, so freeing it returns it here instead of to the
  // system, and only later allocations during a capture reuse it (graphs sharing
  // the pool are replayed in the order they were captured, so a block freed before
  // a capture is dead when that graph replays). When no graph is alive and no
  // capture runs, the pool is released.
  std::unordered_set<void*> graph_blocks;   // allocated during a capture: live or pooled
  std::multimap<size_t, void*> graph_free;  // pooled: reserved size -> block
  int64_t graphs_alive = 0;
  // Frees the pooled blocks when no graph can replay any more (mem_mu held).
  void release_graph_pool_locked();

  // Any GEMM of this device: picks OpenBLAS or the builtin kernel.
  void gemm1(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
             const float* b, int64_t ldb, float beta, float* c, int64_t ldc) const;
  // Batched/strided GEMM, cut into shape-determined panels; the panels are spread
  // over the pool when `parallel` (same bits either way).
  void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
            int64_t stride_a, const float* b, int64_t ldb, int64_t stride_b, float beta, float* c, int64_t ldc,
            int64_t stride_c, int64_t batch, bool parallel);
};

// ---------------------------------------------------------------------------
// Op kernels (args are already normalised and validated; see ops.cpp).
// ---------------------------------------------------------------------------
void validate(const loom_gemm_args& a);
void validate(const loom_layernorm_fwd_args& a);
void validate(const loom_layernorm_bwd_args& a);
void validate_gelu(const loom_gelu_args& a, bool backward);
void validate_attention(const loom_attention_args& a, bool backward);
void validate(const loom_xent_args& a);
void validate_embedding(const loom_embedding_args& a, bool backward);
void validate(const loom_elementwise_args& a);
void validate(const loom_reduce_args& a);
void validate(const loom_adamw_args& a);
void validate(const loom_rmsnorm_fwd_args& a);
void validate(const loom_rmsnorm_bwd_args& a);
void validate_swiglu(const loom_swiglu_args& a, bool backward);
void validate_rope(const loom_rope_args& a, bool backward);
void validate_sigmoid(const loom_activation_args& a, bool backward);

void run_gemm(Device& d, const loom_gemm_args& a);
void run_layernorm_fwd(Device& d, const loom_layernorm_fwd_args& a);
void run_layernorm_bwd(Device& d, const loom_layernorm_bwd_args& a);
void run_gelu_fwd(Device& d, const loom_gelu_args& a);
void run_gelu_bwd(Device& d, const loom_gelu_args& a);
void run_attention_fwd(Device& d, const loom_attention_args& a);
void run_attention_bwd(Device& d, const loom_attention_args& a);
void run_xent(Device& d, const loom_xent_args& a);
void run_embedding_fwd(Device& d, const loom_embedding_args& a);
void run_embedding_bwd(Device& d, const loom_embedding_args& a);
void run_elementwise(Device& d, const loom_elementwise_args& a);
void run_reduce(Device& d, const loom_reduce_args& a);
void run_adamw(Device& d, const loom_adamw_args& a);
// llama_ops.cpp (ABI 1.10)
void run_rmsnorm_fwd(Device& d, const loom_rmsnorm_fwd_args& a);
void run_rmsnorm_bwd(Device& d, const loom_rmsnorm_bwd_args& a);
void run_swiglu_fwd(Device& d, const loom_swiglu_args& a);
void run_swiglu_bwd(Device& d, const loom_swiglu_args& a);
void run_rope_fwd(Device& d, const loom_rope_args& a);
void run_rope_bwd(Device& d, const loom_rope_args& a);
void run_sigmoid_fwd(Device& d, const loom_activation_args& a);
void run_sigmoid_bwd(Device& d, const loom_activation_args& a);

// Argument validation (validate above) is plugins/device/common/op_contract's,
// plus this device's own limits.

// ---------------------------------------------------------------------------
// bf16 storage. An op whose dtype is BF16 reads bf16 tensors, widens them (rows,
// blocks or whole operands) into fp32 scratch, runs the very fp32 code of the F32
// path on the scratch, and rounds to nearest even where a result is stored as
// bf16. So it equals the fp32 op on the bf16 values, rounded, bit for bit.
// ---------------------------------------------------------------------------
inline bool is_bf16(int32_t dtype) { return dtype == LOOM_DTYPE_BF16; }

// Thread-local fp32 scratch of the calling thread: slot `slot` (0 <= slot < kScratchSlots),
// at least n floats, contents unspecified. One op uses distinct slots for its
// buffers; no op's bf16 path calls another one's, so slots are never shared.
constexpr int kScratchSlots = 6;
float* scratch(int slot, size_t n);

// An uninitialised fp32 buffer for one call (operands too large for a row scratch).
class F32Buffer {
 public:
  explicit F32Buffer(size_t n) : p_(n > 0 ? new float[n] : nullptr) {}
  float* get() const { return p_.get(); }

 private:
  std::unique_ptr<float[]> p_;
};

// `batch` blocks of rows x cols: dst[b*dstride + r*dld + c] = src[b*stride + r*ld + c],
// widened (bf16 -> f32) or rounded (f32 -> bf16); rows spread over the pool when
// `parallel`. Rounding writes each element once per block it belongs to, so blocks
// that share elements (stride < the block's extent) must not be rounded in parallel.
void widen_matrix(Device& d, const uint16_t* src, int64_t ld, int64_t stride, float* dst, int64_t dld, int64_t dstride,
                  int64_t batch, int64_t rows, int64_t cols, bool parallel);
void round_matrix(Device& d, const float* src, int64_t ld, int64_t stride, uint16_t* dst, int64_t dld, int64_t dstride,
                  int64_t batch, int64_t rows, int64_t cols, bool parallel);

}  // namespace loom::cpu
