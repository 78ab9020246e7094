// device/cuda: the C tables (loom_device_api, loom_device_ops) and the parts of a
// device that are not math: the GPU of a rank, the caching allocator, streams and
// events, and graphs by CUDA stream capture.
//
// Streams: the device's default stream (stream NULL in the ABI) is a non-blocking
// CUDA stream of its own, never the legacy NULL stream (which cannot be captured
// and would serialise against every other stream). native_stream returns the
// cudaStream_t, for comm plugins.
//
// Graphs: capture_begin starts a thread-local-mode capture of the stream (other
// ranks' threads are unaffected); work launched on it is recorded, not run;
// capture_end instantiates the graph; graph_replay launches it (on a stream under
// capture, it is added as a child graph node: the outer graph holds its own copy).
// Host syncs inside a capture are refused with INVALID_ARGUMENT, as on device/cpu.
//
// A plugin's own kernels: launched by the plugin on native_stream(), they are work
// on that stream like the ops here, captured into the same graphs; there is no
// host_task op (ABI 1.12), since fn could not read this device's memory.
#include <cstdlib>
#include <cstring>
#include <loom/cpp/plugin.hpp>
#include <sstream>

#include "cuda_device.hpp"
#include "flash_attention.hpp"

namespace loom::cuda {

// ---------------------------------------------------------------------------
// Errors, scopes, scratch
// ---------------------------------------------------------------------------

namespace {
std::string call_name(const char* call) {
  std::string s(call ? call : "?");
  const size_t paren = s.find('(');
  return paren == std::string::npos ? s : s.substr(0, paren);
}
}  // namespace

std::string Device::who() const {
  std::ostringstream os;
  os << "device/cuda rank " << global_rank << " (GPU " << ordinal << ")";
  return os.str();
}

void throw_cuda(const Device* dev, const char* op, const char* call, cudaError_t err) {
  cudaGetLastError();  // clear a non-sticky error so the next call starts clean
  std::ostringstream os;
  os << (dev ? dev->who() : std::string("device/cuda")) << " " << op << ": " << call_name(call)
     << " failed: " << cudaGetErrorName(err) << " (" << cudaGetErrorString(err) << ")";
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver)
    throw Error(os.str() + "; is a CUDA GPU visible (nvidia-smi, CUDA_VISIBLE_DEVICES)?", LOOM_CODE_UNSUPPORTED);
  throw Error(os.str(), err == cudaErrorMemoryAllocation ? LOOM_CODE_OUT_OF_MEMORY : LOOM_CODE_INTERNAL);
}

void throw_cublas(const Device* dev, const char* op, const char* call, cublasStatus_t st) {
  std::ostringstream os;
  os << (dev ? dev->who() : std::string("device/cuda")) << " " << op << ": " << call_name(call)
     << " failed: " << cublasGetStatusName(st) << " (" << cublasGetStatusString(st) << ")";
  throw Error(os.str(), st == CUBLAS_STATUS_ALLOC_FAILED ? LOOM_CODE_OUT_OF_MEMORY
                        : st == CUBLAS_STATUS_NOT_SUPPORTED ? LOOM_CODE_UNSUPPORTED
                                                            : LOOM_CODE_INTERNAL);
}

GpuScope::GpuScope(const Device* dev, int ordinal, const char* op) : ordinal_(ordinal) {
  LOOM_CUDA(dev, op, cudaGetDevice(&previous_));
  if (previous_ != ordinal_) LOOM_CUDA(dev, op, cudaSetDevice(ordinal_));
}
GpuScope::~GpuScope() {
  if (previous_ >= 0 && previous_ != ordinal_ && cudaSetDevice(previous_) != cudaSuccess) cudaGetLastError();
}

RelaxedCaptureMode::RelaxedCaptureMode() : mode_(cudaStreamCaptureModeRelaxed) {
  cudaThreadExchangeStreamCaptureMode(&mode_);
}
RelaxedCaptureMode::~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }

bool in_capture(const Stream& st) {
  if (st.capturing) return true;
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(st.s, &cs) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return cs != cudaStreamCaptureStatusNone;
}

Scratch::Scratch(Device& dev, Stream& st, size_t bytes, const char* op) : dev_(dev) {
  // A side stream joined into a capture records too: its scratch must come from the
  // graph pool (a general block would be handed to eager work the graph still uses).
  if (bytes > 0) ptr_ = dev.alloc->allocate(bytes, st.s, in_capture(st), false, op);
}
Scratch::~Scratch() {
  if (ptr_ == nullptr) return;
  try {
    dev_.alloc->release(ptr_);
  } catch (...) {  // a destructor, maybe during unwinding: never throw
  }
}

namespace {

// ---------------------------------------------------------------------------
// Handles
// ---------------------------------------------------------------------------

Device& device_of(loom_device* d) {
  auto* dev = reinterpret_cast<Device*>(d);
  LOOM_REQUIRE(dev != nullptr, "device/cuda: device handle is NULL");
  LOOM_REQUIRE(dev->magic == kDeviceMagic,
               "device/cuda: not a device/cuda device handle (destroyed, or another plugin's)");
  return *dev;
}

Stream& stream_of(Device& dev, loom_stream* s) {
  if (s == nullptr) return dev.default_stream;
  auto* st = reinterpret_cast<Stream*>(s);
  LOOM_REQUIRE(st->magic == kStreamMagic,
               "device/cuda: invalid stream handle (destroyed, or not a device/cuda stream)");
  LOOM_REQUIRE(st->dev == &dev, "device/cuda: stream belongs to another device");
  return *st;
}

Event& event_of(Device& dev, loom_event* e) {
  auto* ev = reinterpret_cast<Event*>(e);
  LOOM_REQUIRE(ev != nullptr, "device/cuda: event handle is NULL");
  LOOM_REQUIRE(ev->magic == kEventMagic, "device/cuda: invalid event handle (destroyed, or not a device/cuda event)");
  LOOM_REQUIRE(ev->dev == &dev, "device/cuda: event belongs to another device");
  return *ev;
}

Graph& graph_of(Device& dev, loom_graph* g) {
  auto* gr = reinterpret_cast<Graph*>(g);
  LOOM_REQUIRE(gr != nullptr, "device/cuda: graph handle is NULL");
  LOOM_REQUIRE(gr->magic == kGraphMagic, "device/cuda: invalid graph handle (destroyed, or not a device/cuda graph)");
  LOOM_REQUIRE(gr->dev == &dev, "device/cuda: graph belongs to another device");
  return *gr;
}

// The caller's argument struct, copied and zero-extended to this build's layout.
template <typename T>
T normalize(const T* in, const char* op) {
  LOOM_REQUIRE(in != nullptr, op << ": args is NULL");
  LOOM_REQUIRE(in->struct_size >= sizeof(uint32_t),
               op << ": args.struct_size is " << in->struct_size << " (build args with loom::make<T>())");
  T a = make<T>();
  std::memcpy(&a, in, std::min<size_t>(in->struct_size, sizeof(T)));
  a.struct_size = static_cast<uint32_t>(sizeof(T));
  return a;
}

// Ends a capture that is being abandoned (stream destroyed, device destroyed).
void discard_capture(Device& dev, Stream& st) {
  cudaGraph_t g = nullptr;
  if (cudaStreamEndCapture(st.s, &g) == cudaSuccess && g) cudaGraphDestroy(g);
  cudaGetLastError();
  st.capturing = false;
  if (dev.capturing == &st) dev.capturing = nullptr;
  dev.alloc->capture_ended();
}

void destroy_stream_resources(Stream& st) {
  if (st.workspace) cudaFree(st.workspace);
  st.workspace = nullptr;
  if (st.s) cudaStreamDestroy(st.s);
  st.s = nullptr;
  cudaGetLastError();  // a failure while tearing down is not a later op's
}

// ---------------------------------------------------------------------------
// Device lifetime and memory
// ---------------------------------------------------------------------------

loom_status create(const loom_options* options, const loom_device_create_args* args, loom_device** out) {
  return guard([&] {
    LOOM_REQUIRE(out != nullptr, "device/cuda create: out is NULL");
    *out = nullptr;
    Options opts(options);
    auto dev = std::make_unique<Device>();
    if (args != nullptr && LOOM_HAS_SLOT(args, loom_device_create_args, local_rank)) {
      dev->global_rank = args->global_rank;
      dev->local_rank = args->local_rank;
    }
    dev->verbose = opts.get_bool("verbose", false);
    dev->tf32 = opts.get_bool("tf32", false);
    dev->fused_attention = opts.get_bool("fused_attention", true);
    dev->gemm_epilogues = opts.get_bool("gemm_epilogues", true);
    const int64_t ws_mb = opts.get_int("workspace_mb", 32);
    dev->workspace_bytes = static_cast<size_t>(ws_mb) << 20;
    dev->alloc->set_caching(opts.get_bool("caching_allocator", true));

    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
      cudaGetLastError();
      std::ostringstream os;
      os << "device/cuda rank " << dev->global_rank << ": no CUDA GPU is visible ("
         << (err != cudaSuccess ? std::string("cudaGetDeviceCount: ") + cudaGetErrorName(err) + ", " +
                                      cudaGetErrorString(err)
                                : std::string("cudaGetDeviceCount reports 0 devices"))
         << "); use device.kind = \"cpu\", or check the driver and CUDA_VISIBLE_DEVICES";
      throw Error(os.str(), LOOM_CODE_UNSUPPORTED);
    }
    const int64_t forced = opts.get_int("gpu", -1);
    LOOM_REQUIRE(forced < count, "device/cuda: option gpu = " << forced << " but only " << count
                                                              << " GPU(s) are visible");
    dev->ordinal = forced >= 0 ? static_cast<int>(forced) : dev->local_rank % count;
    if (args != nullptr && LOOM_HAS_SLOT(args, loom_device_create_args, ranks_in_process) &&
        args->ranks_in_process > count && forced < 0) {
      static std::once_flag warned;
      std::call_once(warned, [&] {
        LOOM_LOG(WARNING) << "device/cuda: " << args->ranks_in_process << " ranks in this process share " << count
                          << " GPU(s); ranks on one GPU work with comm/local, but comm/nccl needs one GPU per rank";
      });
    }
    // The calling thread keeps this GPU current: the rank's thread runs on it.
    LOOM_CUDA(dev.get(), "create", cudaSetDevice(dev->ordinal));
    cudaDeviceProp prop{};
    LOOM_CUDA(dev.get(), "create", cudaGetDeviceProperties(&prop, dev->ordinal));
    dev->gpu_name = prop.name;
    // The ranks of this process on this GPU share its memory: all of them when the
    // manifest names the GPU, else those that local_rank % count places here.
    const int ranks_here =
        args != nullptr && LOOM_HAS_SLOT(args, loom_device_create_args, ranks_in_process) && args->ranks_in_process > 1
            ? (forced >= 0 ? args->ranks_in_process : (args->ranks_in_process + count - 1) / count)
            : 1;
    dev->capacity_bytes = static_cast<uint64_t>(prop.totalGlobalMem) / static_cast<uint64_t>(ranks_here);
    // The fused attention kernels use more than 48 KiB of shared memory a block.
    LOOM_CUDA(dev.get(), "create", flash_prepare());
    dev->default_stream.dev = dev.get();
    LOOM_CUDA(dev.get(), "create", cudaStreamCreateWithFlags(&dev->default_stream.s, cudaStreamNonBlocking));
    const cublasStatus_t cs = cublasCreate(&dev->cublas);
    if (cs != CUBLAS_STATUS_SUCCESS) {
      destroy_stream_resources(dev->default_stream);
      throw_cublas(dev.get(), "create", "cublasCreate", cs);
    }
    const cublasStatus_t ls = cublasLtCreate(&dev->cublaslt);
    if (ls != CUBLAS_STATUS_SUCCESS) {
      cublasDestroy(dev->cublas);
      destroy_stream_resources(dev->default_stream);
      throw_cublas(dev.get(), "create", "cublasLtCreate", ls);
    }
    static std::once_flag announced;
    std::call_once(announced, [&] {
      LOOM_LOG(INFO) << "device/cuda: " << count << " GPU(s) visible; rank " << dev->global_rank << " on GPU "
                     << dev->ordinal << " (" << dev->gpu_name << ", sm_" << prop.major << prop.minor
                     << "); fp32 GEMMs " << (dev->tf32 ? "may use TF32" : "in full fp32");
    });
    if (dev->verbose)
      LOOM_LOG(INFO) << dev->who() << ": " << dev->gpu_name << ", " << (prop.totalGlobalMem >> 20) << " MiB";
    *out = reinterpret_cast<loom_device*>(dev.release());
  });
}

void destroy(loom_device* d) {
  (void)guard([&] {
    if (d == nullptr) return;
    Device& dev = device_of(d);
    GpuScope gpu(&dev, dev.ordinal, "destroy");
    if (dev.capturing) {
      LOOM_LOG(WARNING) << dev.who() << ": destroyed during a graph capture; the capture is discarded";
      discard_capture(dev, *dev.capturing);
    }
    cudaDeviceSynchronize();
    cudaGetLastError();
    if (const size_t live = dev.alloc->live_count(); live > 0)
      LOOM_LOG(WARNING) << dev.who() << ": destroyed with " << live << " allocation(s) ("
                        << dev.alloc->stats().current << " bytes) not freed; freeing them";
    dev.alloc.reset();
    {
      std::lock_guard<std::mutex> lock(dev.streams_mu);
      for (auto& st : dev.streams) {
        destroy_stream_resources(*st);
        st->magic = 0;
      }
      dev.streams.clear();
      for (void* w : dev.retired_workspaces) cudaFree(w);
      dev.retired_workspaces.clear();
    }
    destroy_stream_resources(dev.default_stream);
    if (dev.cublaslt) cublasLtDestroy(dev.cublaslt);
    if (dev.cublas) cublasDestroy(dev.cublas);
    dev.magic = 0;
    dev.default_stream.magic = 0;
    delete &dev;
  });
}

loom_status alloc(loom_device* d, size_t bytes, void** out) {
  return guard([&] {
    Device& dev = device_of(d);
    LOOM_REQUIRE(out != nullptr, "device/cuda alloc: out is NULL");
    *out = nullptr;
    if (bytes == 0) return;
    GpuScope gpu(&dev, dev.ordinal, "alloc");
    // During a capture, memory comes from the graph pool, ordered on the capture.
    Stream* cap = dev.capturing;
    *out = dev.alloc->allocate(bytes, cap ? cap->s : dev.default_stream.s, cap != nullptr, true, "alloc");
  });
}

void free_(loom_device* d, void* ptr) {
  (void)guard([&] {
    if (ptr == nullptr) return;
    Device& dev = device_of(d);
    GpuScope gpu(&dev, dev.ordinal, "free");
    if (!dev.alloc->release(ptr))
      LOOM_LOG(ERROR) << dev.who() << ": free of " << ptr
                      << ", which this device did not allocate (or already freed); ignored";
  });
}

loom_status memory_stats(loom_device* d, loom_memory_stats* out) {
  return guard([&] {
    Device& dev = device_of(d);
    LOOM_REQUIRE(out != nullptr, "device/cuda memory_stats: out is NULL");
    const Allocator::Stats s = dev.alloc->stats();
    uint64_t workspaces = dev.default_stream.workspace_bytes;
    {
      std::lock_guard<std::mutex> lock(dev.streams_mu);
      for (const auto& st : dev.streams) workspaces += st->workspace_bytes;
    }
    if (LOOM_HAS_SLOT(out, loom_memory_stats, current_bytes)) out->current_bytes = s.current;
    if (LOOM_HAS_SLOT(out, loom_memory_stats, peak_bytes)) out->peak_bytes = s.peak;
    if (LOOM_HAS_SLOT(out, loom_memory_stats, reserved_bytes)) out->reserved_bytes = s.reserved + workspaces;
    if (LOOM_HAS_SLOT(out, loom_memory_stats, num_allocs)) out->num_allocs = s.num_allocs;
    if (LOOM_HAS_SLOT(out, loom_memory_stats, capacity_bytes)) out->capacity_bytes = dev.capacity_bytes;
  });
}

// LOOM_COPY_* as a cudaMemcpyKind (copy and copy_2d map kinds alike); `what`
// names the call in the error.
cudaMemcpyKind copy_kind(int32_t kind, const char* what) {
  switch (kind) {
    case LOOM_COPY_HOST_TO_DEVICE:
      return cudaMemcpyHostToDevice;
    case LOOM_COPY_DEVICE_TO_HOST:
      return cudaMemcpyDeviceToHost;
    case LOOM_COPY_DEVICE_TO_DEVICE:
      return cudaMemcpyDeviceToDevice;
    default:
      LOOM_REQUIRE(false, what << ": unknown kind " << kind);
  }
  return cudaMemcpyDefault;  // not reached
}

loom_status copy(loom_device* d, loom_stream* s, void* dst, const void* src, size_t bytes, int32_t kind) {
  return guard([&] {
    Device& dev = device_of(d);
    Stream& st = stream_of(dev, s);
    const cudaMemcpyKind k = copy_kind(kind, "device/cuda copy");
    if (bytes == 0) return;
    LOOM_REQUIRE(dst != nullptr && src != nullptr, "device/cuda copy: dst or src is NULL");
    GpuScope gpu(&dev, dev.ordinal, "copy");
    // Stream-ordered. From pageable host memory the call returns once the data is
    // staged (the host buffer may be reused); to pageable host memory it returns
    // when the copy is done.
    LOOM_CUDA(&dev, "copy", cudaMemcpyAsync(dst, src, bytes, k, st.s));
  });
}

// As copy, row by row in one call: `rows` rows of `width` bytes at the pitches.
loom_status copy_2d(loom_device* d, loom_stream* s, void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                    size_t width, size_t rows, int32_t kind) {
  return guard([&] {
    Device& dev = device_of(d);
    Stream& st = stream_of(dev, s);
    const cudaMemcpyKind k = copy_kind(kind, "device/cuda copy_2d");
    if (width == 0 || rows == 0) return;
    LOOM_REQUIRE(dst != nullptr && src != nullptr, "device/cuda copy_2d: dst or src is NULL");
    LOOM_REQUIRE(dst_pitch >= width && src_pitch >= width, "device/cuda copy_2d: dst_pitch "
                                                               << dst_pitch << " and src_pitch " << src_pitch
                                                               << " must be >= width " << width);
    GpuScope gpu(&dev, dev.ordinal, "copy_2d");
    // Stream-ordered like copy (one memcpy node under a capture). A pitch above the
    // device's limit (cudaDevAttrMaxPitch) is CUDA's error, named here.
    LOOM_CUDA(&dev, "copy_2d", cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, k, st.s));
  });
}

// ---------------------------------------------------------------------------
// Streams and events
// ---------------------------------------------------------------------------

loom_status stream_create(loom_device* d, loom_stream** out) {
  return guard([&] {
    Device& dev = device_of(d);
    LOOM_REQUIRE(out != nullptr, "device/cuda stream_create: out is NULL");
    GpuScope gpu(&dev, dev.ordinal, "stream_create");
    auto st = std::make_unique<Stream>();
    st->dev = &dev;
    LOOM_CUDA(&dev, "stream_create", cudaStreamCreateWithFlags(&st->s, cudaStreamNonBlocking));
    std::lock_guard<std::mutex> lock(dev.streams_mu);
    dev.streams.push_back(std::move(st));
    *out = reinterpret_cast<loom_stream*>(dev.streams.back().get());
  });
}

void stream_destroy(loom_device* d, loom_stream* s) {
  (void)guard([&] {
    if (s == nullptr) return;  // the default stream lives with the device
    Device& dev = device_of(d);
    Stream& st = stream_of(dev, s);
    GpuScope gpu(&dev, dev.ordinal, "stream_destroy");
    if (dev.capturing == &st) {
      LOOM_LOG(WARNING) << dev.who() << ": stream destroyed during graph capture; the capture is discarded";
      discard_capture(dev, st);
    }
    // Its workspace may still be read by queued GEMMs: wait for them. A graph
    // captured on this stream keeps using it: then it lives as long as the device.
    cudaStreamSynchronize(st.s);
    cudaGetLastError();
    if (st.workspace != nullptr && !dev.alloc->graphs_idle()) {
      std::lock_guard<std::mutex> lock(dev.streams_mu);
      dev.retired_workspaces.push_back(st.workspace);
      st.workspace = nullptr;
    }
    destroy_stream_resources(st);
    st.magic = 0;
    std::lock_guard<std::mutex> lock(dev.streams_mu);
    for (auto it = dev.streams.begin(); it != dev.streams.end(); ++it)
      if (it->get() == &st) {
        dev.streams.erase(it);
        break;
      }
  });
}

loom_status stream_synchronize(loom_device* d, loom_stream* s) {
  return guard([&] {
    Device& dev = device_of(d);
    Stream& st = stream_of(dev, s);
    GpuScope gpu(&dev, dev.ordinal, "stream_synchronize");
    // Checked before the call: cudaStreamSynchronize would invalidate the capture.
    if (in_capture(st))
      throw Error(dev.who() +
                      ": stream_synchronize on a stream under graph capture (no host sync is allowed inside a "
                      "captured region)",
                  LOOM_CODE_INVALID_ARGUMENT);
    const cudaError_t err = cudaStreamSynchronize(st.s);
    if (err != cudaSuccess)
      throw_cuda(&dev, "stream_synchronize (an error of work launched earlier on this stream shows here)",
                 "cudaStreamSynchronize", err);
  });
}

loom_status event_create(loom_device* d, loom_event** out) {
  return guard([&] {
    Device& dev = device_of(d);
    LOOM_REQUIRE(out != nullptr, "device/cuda event_create: out is NULL");
    GpuScope gpu(&dev, dev.ordinal, "event_create");
    auto ev = std::make_unique<Event>();
    ev->dev = &dev;
    LOOM_CUDA(&dev, "event_create", cudaEventCreateWithFlags(&ev->e, cudaEventDisableTiming));
    *out = reinterpret_cast<loom_event*>(ev.release());
  });
}

void event_destroy(loom_device* d, loom_event* e) {
  (void)guard([&] {
    if (e == nullptr) return;
    Device& dev = device_of(d);
    Event& ev = event_of(dev, e);
    GpuScope gpu(&dev, dev.ordinal, "event_destroy");
    // CUDA defers the release until recorded work is done; a failure is not a later op's.
    if (cudaEventDestroy(ev.e) != cudaSuccess) cudaGetLastError();
    ev.magic = 0;
    delete &ev;
  });
}

loom_status event_record(loom_device* d, loom_event* e, loom_stream* s) {
  return guard([&] {
    Device& dev = device_of(d);
    Event& ev = event_of(dev, e);
    Stream& st = stream_of(dev, s);
    GpuScope gpu(&dev, dev.ordinal, "event_record");
    LOOM_CUDA(&dev, "event_record", cudaEventRecord(ev.e, st.s));
    ev.in_capture = in_capture(st);
  });
}

loom_status stream_wait_event(loom_device* d, loom_stream* s, loom_event* e) {
  return guard([&] {
    Device& dev = device_of(d);
    Event& ev = event_of(dev, e);
    Stream& st = stream_of(dev, s);
    GpuScope gpu(&dev, dev.ordinal, "stream_wait_event");
    LOOM_CUDA(&dev, "stream_wait_event", cudaStreamWaitEvent(st.s, ev.e, 0));
  });
}

loom_status event_synchronize(loom_device* d, loom_event* e) {
  return guard([&] {
    Device& dev = device_of(d);
    Event& ev = event_of(dev, e);
    if (ev.in_capture)
      throw Error(dev.who() +
                      ": event_synchronize on an event recorded inside a graph capture (it marks recorded work, "
                      "which never runs before a replay)",
                  LOOM_CODE_INVALID_ARGUMENT);
    GpuScope gpu(&dev, dev.ordinal, "event_synchronize");
    LOOM_CUDA(&dev, "event_synchronize", cudaEventSynchronize(ev.e));
  });
}

// ---------------------------------------------------------------------------
// Graphs
// ---------------------------------------------------------------------------

loom_status capture_begin(loom_device* d, loom_stream* s) {
  return guard([&] {
    Device& dev = device_of(d);
    Stream& st = stream_of(dev, s);
    LOOM_REQUIRE(dev.capturing == nullptr,
                 "device/cuda capture_begin: a capture is already in progress on this device "
                 "(nested capture is not supported; end it with capture_end first)");
    GpuScope gpu(&dev, dev.ordinal, "capture_begin");
    // Before the first graph: the general cache (e.g. the activations of eager
    // warm-up steps) is never handed to a capture, so give it back to CUDA rather
    // than need the memory twice.
    dev.alloc->release_cached_before_first_capture();
    // Thread-local: other threads (other ranks) keep making any CUDA call.
    LOOM_CUDA(&dev, "capture_begin", cudaStreamBeginCapture(st.s, cudaStreamCaptureModeThreadLocal));
    st.capturing = true;
    dev.capturing = &st;
    dev.alloc->capture_began();
  });
}

loom_status capture_end(loom_device* d, loom_stream* s, loom_graph** out) {
  return guard([&] {
    Device& dev = device_of(d);
    Stream& st = stream_of(dev, s);
    LOOM_REQUIRE(out != nullptr, "device/cuda capture_end: out is NULL");
    *out = nullptr;
    LOOM_REQUIRE(st.capturing,
                 "device/cuda capture_end: this stream is not under capture (capture_begin it first)");
    GpuScope gpu(&dev, dev.ordinal, "capture_end");
    cudaGraph_t graph = nullptr;
    const cudaError_t err = cudaStreamEndCapture(st.s, &graph);
    st.capturing = false;
    dev.capturing = nullptr;
    dev.alloc->capture_ended();
    if (err != cudaSuccess) {
      if (graph) cudaGraphDestroy(graph);
      throw_cuda(&dev,
                 "capture_end (the capture was invalidated: a call inside it was not capturable, or work on "
                 "another stream was not joined back)",
                 "cudaStreamEndCapture", err);
    }
    auto g = std::make_unique<Graph>();
    g->dev = &dev;
    g->graph = graph;
    const cudaError_t ierr = cudaGraphInstantiate(&g->exec, graph, 0);
    if (ierr != cudaSuccess) {
      cudaGraphDestroy(graph);
      throw_cuda(&dev, "capture_end", "cudaGraphInstantiate", ierr);
    }
    dev.alloc->graph_created();
    *out = reinterpret_cast<loom_graph*>(g.release());
  });
}

loom_status graph_replay(loom_device* d, loom_graph* g, loom_stream* s) {
  return guard([&] {
    Device& dev = device_of(d);
    Graph& gr = graph_of(dev, g);
    Stream& st = stream_of(dev, s);
    GpuScope gpu(&dev, dev.ordinal, "graph_replay");
    if (!in_capture(st)) {
      LOOM_CUDA(&dev, "graph_replay", cudaGraphLaunch(gr.exec, st.s));
      return;
    }
    // Replaying into a capture nests the graph: a child node (a copy of the graph)
    // after the stream's current dependencies, which it then replaces.
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    cudaGraph_t outer = nullptr;
    const cudaGraphNode_t* deps = nullptr;
    size_t ndeps = 0;
    LOOM_CUDA(&dev, "graph_replay",
              cudaStreamGetCaptureInfo(st.s, &status, nullptr, &outer, &deps, nullptr, &ndeps));
    LOOM_REQUIRE(status == cudaStreamCaptureStatusActive && outer != nullptr,
                 dev.who() << " graph_replay: the stream's capture is no longer active");
    cudaGraphNode_t node = nullptr;
    LOOM_CUDA(&dev, "graph_replay", cudaGraphAddChildGraphNode(&node, outer, deps, ndeps, gr.graph));
    LOOM_CUDA(&dev, "graph_replay",
              cudaStreamUpdateCaptureDependencies(st.s, &node, nullptr, 1, cudaStreamSetCaptureDependencies));
  });
}

void graph_destroy(loom_device* d, loom_graph* g) {
  (void)guard([&] {
    if (g == nullptr) return;
    Device& dev = device_of(d);
    Graph& gr = graph_of(dev, g);
    GpuScope gpu(&dev, dev.ordinal, "graph_destroy");
    if (gr.exec) cudaGraphExecDestroy(gr.exec);
    if (gr.graph) cudaGraphDestroy(gr.graph);
    cudaGetLastError();  // a failure while tearing down is not a later op's
    gr.magic = 0;
    delete &gr;
    dev.alloc->graph_destroyed();
  });
}

void* native_stream(loom_device* d, loom_stream* s) {
  void* out = nullptr;
  (void)guard([&] {
    Device& dev = device_of(d);
    out = static_cast<void*>(stream_of(dev, s).s);
  });
  return out;
}

// ---------------------------------------------------------------------------
// Op trampolines: normalise, validate (also at capture time, so errors point at
// the launch), then enqueue on the stream with the device's GPU current.
// ---------------------------------------------------------------------------

#define LOOM_CUDA_OP(fn, Args, VALIDATE, RUN)                      \
  loom_status fn(loom_device* d, loom_stream* s, const Args* in) { \
    return guard([&] {                                             \
      Device& dev = device_of(d);                                  \
      Stream& st = stream_of(dev, s);                              \
      const Args a = normalize(in, #fn);                           \
      VALIDATE;                                                    \
      GpuScope gpu(&dev, dev.ordinal, #fn);                        \
      RUN(dev, st, a);                                             \
    });                                                            \
  }

LOOM_CUDA_OP(op_gemm, loom_gemm_args, validate(a), run_gemm)
LOOM_CUDA_OP(op_layernorm_fwd, loom_layernorm_fwd_args, validate(a), run_layernorm_fwd)
LOOM_CUDA_OP(op_layernorm_bwd, loom_layernorm_bwd_args, validate(a), run_layernorm_bwd)
LOOM_CUDA_OP(op_gelu_fwd, loom_gelu_args, validate_gelu(a, false), run_gelu_fwd)
LOOM_CUDA_OP(op_gelu_bwd, loom_gelu_args, validate_gelu(a, true), run_gelu_bwd)
LOOM_CUDA_OP(op_attention_fwd, loom_attention_args, validate_attention(a, false), run_attention_fwd)
LOOM_CUDA_OP(op_attention_bwd, loom_attention_args, validate_attention(a, true), run_attention_bwd)
LOOM_CUDA_OP(op_xent, loom_xent_args, validate(a), run_xent)
LOOM_CUDA_OP(op_embedding_fwd, loom_embedding_args, validate_embedding(a, false), run_embedding_fwd)
LOOM_CUDA_OP(op_embedding_bwd, loom_embedding_args, validate_embedding(a, true), run_embedding_bwd)
LOOM_CUDA_OP(op_elementwise, loom_elementwise_args, validate(a), run_elementwise)
LOOM_CUDA_OP(op_reduce, loom_reduce_args, validate(a), run_reduce)
LOOM_CUDA_OP(op_adamw, loom_adamw_args, validate(a), run_adamw)
LOOM_CUDA_OP(op_rmsnorm_fwd, loom_rmsnorm_fwd_args, validate(a), run_rmsnorm_fwd)
LOOM_CUDA_OP(op_rmsnorm_bwd, loom_rmsnorm_bwd_args, validate(a), run_rmsnorm_bwd)
LOOM_CUDA_OP(op_swiglu_fwd, loom_swiglu_args, validate_swiglu(a, false), run_swiglu_fwd)
LOOM_CUDA_OP(op_swiglu_bwd, loom_swiglu_args, validate_swiglu(a, true), run_swiglu_bwd)
LOOM_CUDA_OP(op_rope_fwd, loom_rope_args, validate_rope(a, false), run_rope_fwd)
LOOM_CUDA_OP(op_rope_bwd, loom_rope_args, validate_rope(a, true), run_rope_bwd)
LOOM_CUDA_OP(op_sigmoid_fwd, loom_activation_args, validate_sigmoid(a, false), run_sigmoid_fwd)
LOOM_CUDA_OP(op_sigmoid_bwd, loom_activation_args, validate_sigmoid(a, true), run_sigmoid_bwd)
#undef LOOM_CUDA_OP

const loom_device_api* device_api() {
  static const loom_device_ops ops = [] {
    loom_device_ops o = make<loom_device_ops>();
    o.gemm = op_gemm;
    o.layernorm_fwd = op_layernorm_fwd;
    o.layernorm_bwd = op_layernorm_bwd;
    o.gelu_fwd = op_gelu_fwd;
    o.gelu_bwd = op_gelu_bwd;
    o.attention_fwd = op_attention_fwd;
    o.attention_bwd = op_attention_bwd;
    o.xent = op_xent;
    o.embedding_fwd = op_embedding_fwd;
    o.embedding_bwd = op_embedding_bwd;
    o.elementwise = op_elementwise;
    o.reduce = op_reduce;
    o.adamw = op_adamw;
    o.rmsnorm_fwd = op_rmsnorm_fwd;
    o.rmsnorm_bwd = op_rmsnorm_bwd;
    o.swiglu_fwd = op_swiglu_fwd;
    o.swiglu_bwd = op_swiglu_bwd;
    o.rope_fwd = op_rope_fwd;
    o.rope_bwd = op_rope_bwd;
    o.sigmoid_fwd = op_sigmoid_fwd;
    o.sigmoid_bwd = op_sigmoid_bwd;
    // host_task (ABI 1.12) stays NULL: a plugin brings CUDA kernels of its own (a .cu
    // file of the plugin) and launches them itself on native_stream(stream), with
    // memory from this device's allocator (host->alloc); a capture of the stream
    // records them as it records these ops.
    return o;
  }();
  static const loom_device_api api = [] {
    loom_device_api a = make<loom_device_api>();
    a.create = create;
    a.destroy = destroy;
    a.alloc = alloc;
    a.free = free_;
    a.memory_stats = memory_stats;
    a.copy = copy;
    a.stream_create = stream_create;
    a.stream_destroy = stream_destroy;
    a.stream_synchronize = stream_synchronize;
    a.event_create = event_create;
    a.event_destroy = event_destroy;
    a.event_record = event_record;
    a.stream_wait_event = stream_wait_event;
    a.event_synchronize = event_synchronize;
    a.capture_begin = capture_begin;
    a.capture_end = capture_end;
    a.graph_replay = graph_replay;
    a.graph_destroy = graph_destroy;
    a.native_stream = native_stream;
    a.dl_device_type = kDLCUDA;
    a.ops = &ops;
    a.copy_2d = copy_2d;
    // layernorm_bwd / embedding_bwd honour grad_fp32; the allocator has a graph pool.
    // dropout reads seed_device in the kernel. GEMM epilogues on cuBLASLt (or, with
    // gemm_epilogues = false, by the unfused kernels). The xent backward kernels read and
    // write each element from one thread, so dlogits may be the logits.
    a.features = LOOM_DEVICE_GRAD_FP32 | LOOM_DEVICE_GRAPH_POOL | LOOM_DEVICE_SEED_DEVICE | LOOM_DEVICE_ATTENTION_WINDOW |
                 LOOM_DEVICE_MULTI_TENSOR | LOOM_DEVICE_GEMM_EPILOGUE | LOOM_DEVICE_XENT_IN_PLACE |
                 LOOM_DEVICE_ROPE_FREQUENCIES | LOOM_DEVICE_ATTENTION_SLIDING_WINDOW | LOOM_DEVICE_ATTENTION_KEY_START;
    return a;
  }();
  return &api;
}

}  // namespace
}  // namespace loom::cuda

LOOM_PLUGIN_LIBRARY(loom::raw_plugin(
    "device", "cuda", "1.0.0",
    "NVIDIA GPU backend: cuBLAS/cuBLASLt GEMMs, CUDA kernels, fp32 or bf16 storage with fp32 math, caching allocator, "
    "CUDA graphs",
    LOOM_API_DEVICE, loom::cuda::device_api(),
    {loom::opt_bool("tf32", false,
                    "fp32 GEMMs may use TF32 tensor cores (about 1e-3 relative error; off = full fp32)"),
     loom::opt_bool("fused_attention", true,
                    "bf16 attention with head size 64 or 128 runs on fused flash-attention kernels (false: "
                    "batched GEMMs around a materialised softmax, as for fp32 and other head sizes)"),
     loom::opt_bool("gemm_epilogues", true,
                    "a linear layer's bias and GeLU (and the GeLU's backward) in the GEMM's epilogue on cuBLASLt "
                    "(false: separate kernels after cuBLAS, as before ABI 1.11)"),
     loom::opt_int("gpu", -1, "GPU ordinal for every rank of this process; -1 = local rank modulo the GPU count")
         .in("[-1, inf)"),
     loom::opt_bool("caching_allocator", true,
                    "cache freed blocks (false: cudaMalloc/cudaFree on every alloc/free; slow, for debugging)"),
     loom::opt_int("workspace_mb", 32, "cuBLAS workspace per stream, MiB").in("[0, 4096]"),
     loom::opt_bool("verbose", false, "log each device's GPU at creation")}))
