// device/cuda: internal header shared by the plugin's host translation units
// (nothing here crosses the ABI; plugin.cpp builds the C tables).
//
// Errors: every CUDA and cuBLAS call goes through LOOM_CUDA / LOOM_CUBLAS, which
// throw a loom::Error naming the call, the op and the rank ("device/cuda rank 3
// (GPU 1) attention_fwd: cublasGemmStridedBatchedEx failed: ..."); loom::guard turns
// it into a status at the ABI edge. Nothing aborts the process.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <loom/cpp/core.hpp>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels.hpp"

namespace loom::cuda {

struct Device;

[[noreturn]] void throw_cuda(const Device* dev, const char* op, const char* call, cudaError_t err);
[[noreturn]] void throw_cublas(const Device* dev, const char* op, const char* call, cublasStatus_t st);

#define LOOM_CUDA(dev, op, expr)                                                   \
  do {                                                                             \
    const cudaError_t loom_cuda_err_ = (expr);                                     \
    if (loom_cuda_err_ != cudaSuccess) ::loom::cuda::throw_cuda(dev, op, #expr, loom_cuda_err_); \
  } while (0)
#define LOOM_CUBLAS(dev, op, expr)                                                       \
  do {                                                                                   \
    const cublasStatus_t loom_cublas_st_ = (expr);                                       \
    if (loom_cublas_st_ != CUBLAS_STATUS_SUCCESS) ::loom::cuda::throw_cublas(dev, op, #expr, loom_cublas_st_); \
  } while (0)

// Makes the device's GPU current on the calling thread for the scope (ranks are
// threads; a thread may also drive several devices), restoring the previous one.
class GpuScope {
 public:
  GpuScope(const Device* dev, int ordinal, const char* op);
  ~GpuScope();
  GpuScope(const GpuScope&) = delete;
  GpuScope& operator=(const GpuScope&) = delete;

 private:
  int previous_ = -1;
  int ordinal_ = -1;
};

// Lets cudaMalloc/cudaFree run on a thread that is capturing a graph in
// thread-local mode (they are not stream operations and are not recorded).
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode();
  ~RelaxedCaptureMode();
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_;
};

// ---------------------------------------------------------------------------
// Caching allocator.
//
// Blocks come from cudaMalloc (sizes rounded to 512 B below 1 MiB, to 2 MiB
// above) and are cached on free, never returned to CUDA until the device is
// destroyed or an allocation fails (then every cached block of the general
// pool is released and the allocation retried).
//
// Stream order: a block belongs to the stream it was allocated for (the device's
// default stream for the ABI's alloc, the op's stream for an op's scratch). Its
// free records an event on that stream; the block is handed out again at once to
// the same stream (stream order makes that safe) and to another stream only once
// the event has completed. Work on other streams that uses an ABI allocation must
// be joined back to the default stream (stream_wait_event) before it is freed, as
// with any stream-ordered allocator.
//
// Graphs: while a capture is in progress, allocations come from the graph pool,
// one pool shared by all graphs of the device. Its blocks are never handed to
// eager work (a replay may still write them) and are reused only by later
// allocations during a capture on the same stream: graphs that share the pool
// must be replayed in the order they were captured, on that stream (CUDA graph
// pools have the same rule). When the last graph is destroyed and no capture is
// running, the graph pool's free blocks rejoin the general pool.
// ---------------------------------------------------------------------------
class Allocator {
 public:
  struct Stats {
    uint64_t current = 0, peak = 0, reserved = 0, num_allocs = 0;
  };

  explicit Allocator(Device* dev) : dev_(dev) {}
  ~Allocator();
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  void set_caching(bool on) { caching_ = on; }
  // `count` = true for the ABI's alloc (num_allocs counts those only).
  void* allocate(size_t bytes, cudaStream_t stream, bool graph_pool, bool count, const char* op);
  // Returns false when ptr is not a live block of this allocator.
  bool release(void* ptr);
  Stats stats();
  // Capture bookkeeping (see above).
  void graph_created();
  void graph_destroyed();
  void capture_began();
  void capture_ended();
  // Frees the cached blocks when no graph exists yet and no capture runs.
  void release_cached_before_first_capture();
  // Frees every cached block (the device is idle; not during a capture).
  void release_cached();
  size_t live_count();
  // No graph alive and none being captured (nothing can replay device memory).
  bool graphs_idle();

 private:
  struct Block {
    void* ptr = nullptr;
    size_t size = 0;       // bytes held (rounded)
    size_t requested = 0;  // bytes asked for (current_bytes counts these)
    cudaStream_t stream = nullptr;
    cudaEvent_t freed = nullptr;  // recorded on `stream` at free (general pool only)
    bool graph = false;
  };
  static size_t round_size(size_t bytes);
  bool take_cached(size_t rounded, cudaStream_t stream, bool graph_pool, Block* out);
  void release_cached_locked();
  cudaEvent_t event_locked();

  Device* dev_;
  bool caching_ = true;
  std::mutex mu_;
  std::unordered_map<void*, Block> live_;
  std::multimap<size_t, Block> free_general_, free_graph_;
  std::vector<cudaEvent_t> spare_events_;
  std::vector<Block> deferred_frees_;  // uncached blocks freed during a capture
  int graphs_alive_ = 0;
  int captures_ = 0;
  Stats stats_;
};

// ---------------------------------------------------------------------------
// Streams, events, graphs.
// ---------------------------------------------------------------------------

constexpr uint32_t kDeviceMagic = 0x4c435544;  // "LCUD"
constexpr uint32_t kStreamMagic = 0x4c435354;
constexpr uint32_t kEventMagic = 0x4c434556;
constexpr uint32_t kGraphMagic = 0x4c434752;

struct Stream {
  uint32_t magic = kStreamMagic;
  Device* dev = nullptr;
  cudaStream_t s = nullptr;
  bool capturing = false;
  // cuBLAS workspace of this stream (cuBLAS must not allocate during a capture,
  // and two streams must not share one workspace).
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

struct Event {
  uint32_t magic = kEventMagic;
  Device* dev = nullptr;
  cudaEvent_t e = nullptr;
  bool in_capture = false;  // last recorded into a capture: it cannot be waited on from the host
};

struct Graph {
  uint32_t magic = kGraphMagic;
  Device* dev = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
};

// A cuBLASLt problem (shape, leading dimensions, transposes, types, epilogue,
// operand alignment, workspace) and the algorithm its heuristic chose.
using LtKey = std::array<int64_t, 12>;
struct LtAlgo {
  bool found = false;  // false: cuBLASLt has no kernel for it (the unfused ops run)
  cublasLtMatmulAlgo_t algo{};
};

// ---------------------------------------------------------------------------
// The device instance of one rank.
// ---------------------------------------------------------------------------
struct Device {
  uint32_t magic = kDeviceMagic;
  int32_t global_rank = 0;
  int32_t local_rank = 0;
  int ordinal = 0;  // the GPU
  std::string gpu_name;
  bool verbose = false;
  bool tf32 = false;  // fp32 GEMMs may use TF32 (manifest opt-in)
  bool fused_attention = true;  // bf16 attention on the kernels of flash_attention.cu
  size_t workspace_bytes = 32u << 20;
  uint64_t capacity_bytes = 0;  // this rank's share of the GPU's memory
  Stream default_stream;
  Stream* capturing = nullptr;  // the stream under capture (one per device)
  std::vector<std::unique_ptr<Stream>> streams;  // created streams, for cleanup
  std::mutex streams_mu;
  // cuBLAS workspaces of destroyed streams while graphs were alive: a graph
  // captured on such a stream has the workspace's address baked in, so it is
  // freed with the device.
  std::vector<void*> retired_workspaces;

  cublasHandle_t cublas = nullptr;
  std::mutex cublas_mu;  // the handle's stream/workspace are set per call; guards lt_algos too

  // GEMMs with an epilogue (ABI 1.11) on cuBLASLt (gemm_lt.cpp); false (option
  // gemm_epilogues): the unfused kernels do the epilogue.
  bool gemm_epilogues = true;
  cublasLtHandle_t cublaslt = nullptr;
  std::map<LtKey, LtAlgo> lt_algos;  // the heuristic's choice per problem

  std::unique_ptr<Allocator> alloc;

  Device() : alloc(std::make_unique<Allocator>(this)) {}

  // "device/cuda rank 3 (GPU 1)"
  std::string who() const;
};

// Whether work launched on the stream is recorded: the stream that began a capture,
// or a side stream joined into one (it waited on an event recorded inside it).
bool in_capture(const Stream& st);

// Scratch memory of an op: allocated for the op's stream, freed (stream-ordered)
// when the op has enqueued its work.
class Scratch {
 public:
  Scratch(Device& dev, Stream& st, size_t bytes, const char* op);
  ~Scratch();
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <typename T = void>
  T* get() const {
    return static_cast<T*>(ptr_);
  }

 private:
  Device& dev_;
  void* ptr_ = nullptr;
};

// ---------------------------------------------------------------------------
// Ops (args normalised; see ops.cpp). validate_* throw loom::Error; run_* enqueue.
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

void run_gemm(Device& d, Stream& s, const loom_gemm_args& a);
// A GEMM with an epilogue on cuBLASLt (gemm_lt.cpp); false, having done nothing, when
// cuBLASLt cannot take it (alignment, types, no kernel) or the option is off. The
// caller holds cublas_mu.
bool lt_gemm_epilogue(Device& d, Stream& st, const loom_gemm_args& g, Dt ab, Dt cd, void* workspace,
                      size_t workspace_bytes);
void run_layernorm_fwd(Device& d, Stream& s, const loom_layernorm_fwd_args& a);
void run_layernorm_bwd(Device& d, Stream& s, const loom_layernorm_bwd_args& a);
void run_gelu_fwd(Device& d, Stream& s, const loom_gelu_args& a);
void run_gelu_bwd(Device& d, Stream& s, const loom_gelu_args& a);
void run_attention_fwd(Device& d, Stream& s, const loom_attention_args& a);
void run_attention_bwd(Device& d, Stream& s, const loom_attention_args& a);
void run_xent(Device& d, Stream& s, const loom_xent_args& a);
void run_embedding_fwd(Device& d, Stream& s, const loom_embedding_args& a);
void run_embedding_bwd(Device& d, Stream& s, const loom_embedding_args& a);
void run_elementwise(Device& d, Stream& s, const loom_elementwise_args& a);
void run_reduce(Device& d, Stream& s, const loom_reduce_args& a);
void run_adamw(Device& d, Stream& s, const loom_adamw_args& a);
void run_rmsnorm_fwd(Device& d, Stream& s, const loom_rmsnorm_fwd_args& a);
void run_rmsnorm_bwd(Device& d, Stream& s, const loom_rmsnorm_bwd_args& a);
void run_swiglu_fwd(Device& d, Stream& s, const loom_swiglu_args& a);
void run_swiglu_bwd(Device& d, Stream& s, const loom_swiglu_args& a);
void run_rope_fwd(Device& d, Stream& s, const loom_rope_args& a);
void run_rope_bwd(Device& d, Stream& s, const loom_rope_args& a);
void run_sigmoid_fwd(Device& d, Stream& s, const loom_activation_args& a);
void run_sigmoid_bwd(Device& d, Stream& s, const loom_activation_args& a);

}  // namespace loom::cuda
