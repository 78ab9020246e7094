// device/cpu: the C tables (loom_device_api, loom_device_ops) and the parts of a
// device that are not math: memory with accounting, streams and events (the CPU
// runs every launch synchronously), and graphs that record launches.
//
// Graph semantics (as a CUDA graph): between capture_begin(stream) and
// capture_end(stream) every op and copy launched on that stream is recorded, not
// run: its argument struct is copied by value (pointers stay addresses) into a
// closure. graph_replay runs the closures in order over the same addresses; host
// code that ran during capture does not run again, but a plugin's host task
// (ABI 1.12) is a launch like an op: recorded with a copy of its args, run by each
// replay.
#include <cstdlib>
#include <cstring>
#include <sys/resource.h>
#include <unistd.h>
#include <loom/cpp/plugin.hpp>

#include "cpu_device.hpp"

// The test device cpu_staged (tests/staged_device) is this file built with
// LOOM_CPU_PLUGIN_NAME "cpu_staged" and LOOM_CPU_OWN_MEMORY: the same host memory,
// declared as the device's own, so the engine treats it as a GPU's.
#ifndef LOOM_CPU_PLUGIN_NAME
#define LOOM_CPU_PLUGIN_NAME "cpu"
#endif
#ifdef LOOM_CPU_OWN_MEMORY
#define LOOM_CPU_MEMORY_FEATURE 0ull
#else
#define LOOM_CPU_MEMORY_FEATURE LOOM_DEVICE_HOST_MEMORY
#endif

namespace loom::cpu {
namespace {

// ---------------------------------------------------------------------------
// Handles
// ---------------------------------------------------------------------------

Device& device_of(loom_device* d) {
  auto* dev = reinterpret_cast<Device*>(d);
  LOOM_REQUIRE(dev != nullptr, "device/cpu: device handle is NULL");
  LOOM_REQUIRE(dev->magic == kDeviceMagic,
               "device/cpu: not a device/cpu device handle (destroyed, or another plugin's)");
  return *dev;
}

Stream& stream_of(Device& dev, loom_stream* s) {
  if (s == nullptr) return dev.default_stream;
  auto* st = reinterpret_cast<Stream*>(s);
  LOOM_REQUIRE(st->magic == kStreamMagic, "device/cpu: invalid stream handle (destroyed, or not a device/cpu stream)");
  LOOM_REQUIRE(st->dev == &dev, "device/cpu: stream belongs to another device");
  return *st;
}

Event& event_of(Device& dev, loom_event* e) {
  auto* ev = reinterpret_cast<Event*>(e);
  LOOM_REQUIRE(ev != nullptr, "device/cpu: event handle is NULL");
  LOOM_REQUIRE(ev->magic == kEventMagic, "device/cpu: invalid event handle (destroyed, or not a device/cpu event)");
  LOOM_REQUIRE(ev->dev == &dev, "device/cpu: event belongs to another device");
  return *ev;
}

Graph& graph_of(Device& dev, loom_graph* g) {
  auto* gr = reinterpret_cast<Graph*>(g);
  LOOM_REQUIRE(gr != nullptr, "device/cpu: graph handle is NULL");
  LOOM_REQUIRE(gr->magic == kGraphMagic, "device/cpu: invalid graph handle (destroyed, or not a device/cpu graph)");
  LOOM_REQUIRE(gr->dev == &dev, "device/cpu: graph belongs to another device");
  return *gr;
}

// Runs fn now, or records it when the stream is under capture.
template <typename Fn>
void launch(Stream& st, const char* name, Fn&& fn) {
  if (st.capturing) {
    st.recorded.push_back(Launch{name, std::function<void()>(std::forward<Fn>(fn))});
  } else {
    fn();
  }
}

// The caller's argument struct, copied and zero-extended to this build's layout
// (a caller built against an older minor has a smaller struct_size).
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

// ---------------------------------------------------------------------------
// Device lifetime and memory
// ---------------------------------------------------------------------------

loom_status create(const loom_options* options, const loom_device_create_args* args, loom_device** out) {
  return guard([&] {
    LOOM_REQUIRE(out != nullptr, "device/cpu create: out is NULL");
    *out = nullptr;
    Options opts(options);
    const std::string blas = opts.get_string("blas", "openblas");
    auto dev = std::make_unique<Device>();
    dev->default_stream.dev = dev.get();
    dev->verbose = opts.get_bool("verbose", false);
    int64_t threads = 1;
    if (args != nullptr && LOOM_HAS_SLOT(args, loom_device_create_args, num_threads) && args->num_threads > 0)
      threads = args->num_threads;
    if (const int64_t forced = opts.get_int("threads", 0); forced > 0) threads = forced;
    if (args != nullptr && LOOM_HAS_SLOT(args, loom_device_create_args, local_rank)) {
      dev->global_rank = args->global_rank;
      dev->local_rank = args->local_rank;
    }
    // The ranks of this process share the host's memory.
    const long pages = ::sysconf(_SC_PHYS_PAGES), page_size = ::sysconf(_SC_PAGESIZE);
    const int32_t sharing = args != nullptr && LOOM_HAS_SLOT(args, loom_device_create_args, ranks_in_process)
                                ? std::max(1, args->ranks_in_process)
                                : 1;
    if (pages > 0 && page_size > 0) {
      uint64_t bytes = static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
      // A virtual-memory limit (ulimit -v) below the RAM is what allocations hit first.
      struct rlimit as {};
      if (::getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY)
        bytes = std::min<uint64_t>(bytes, static_cast<uint64_t>(as.rlim_cur));
      dev->capacity_bytes = bytes / sharing;
    }
    // A rank's own memory, as a GPU's: what plans are checked against and allocations stop at.
    if (const int64_t mb = opts.get_int("memory_mb", 0); mb > 0)
      dev->capacity_bytes = dev->memory_limit = static_cast<uint64_t>(mb) << 20;
    if (blas == "openblas") {
      const OpenBlas& ob = openblas();
      if (ob.loaded) {
        dev->sgemm = ob.sgemm;
        dev->blas_name = "OpenBLAS (" + ob.corename + ")";
        static std::once_flag warned;
        if (ob.avx512_but_not_used)
          std::call_once(warned, [&] {
            LOOM_LOG(WARNING) << "device/cpu: the CPU has AVX-512 but OpenBLAS chose its " << ob.corename
                              << " kernels (" << ob.why_not
                              << "); set OPENBLAS_CORETYPE=SkylakeX in the environment for ~2x GEMM speed";
          });
      } else {
        static std::once_flag warned;
        std::call_once(warned, [&] {
          LOOM_LOG(WARNING) << "device/cpu: " << ob.error
                            << "; using the builtin GEMM (correct but much slower): install libopenblas0";
        });
        dev->blas_name = "builtin";
      }
    } else {
      dev->blas_name = "builtin";
    }
    dev->k = select_kernels(opts.get_string("simd", "auto").c_str());
    dev->pool = std::make_unique<ThreadPool>(static_cast<int>(std::min<int64_t>(threads, 1024)));
    static std::once_flag announced;
    std::call_once(announced, [&] {
      LOOM_LOG(INFO) << "device/cpu: GEMM by " << dev->blas_name << ", " << dev->k->name << " kernels";
    });
    if (dev->verbose)
      LOOM_LOG(INFO) << "device/cpu rank " << dev->global_rank << ": " << dev->pool->size() << " thread(s), GEMM by "
                     << dev->blas_name << ", " << dev->k->name << " kernels";
    *out = reinterpret_cast<loom_device*>(dev.release());
  });
}

void destroy(loom_device* d) {
  (void)guard([&] {
    if (d == nullptr) return;
    Device& dev = device_of(d);
    if (!dev.allocations.empty()) {
      LOOM_LOG(WARNING) << "device/cpu rank " << dev.global_rank << ": destroyed with " << dev.allocations.size()
                        << " allocation(s) (" << dev.current_bytes << " bytes) not freed; freeing them";
      for (auto& [ptr, sizes] : dev.allocations) std::free(ptr);
      dev.allocations.clear();
    }
    for (auto& [size, ptr] : dev.graph_free) std::free(ptr);  // no graph can replay any more
    dev.graph_free.clear();
    dev.magic = 0;
    dev.default_stream.magic = 0;
    delete &dev;
  });
}

loom_status alloc(loom_device* d, size_t bytes, void** out) {
  return guard([&] {
    Device& dev = device_of(d);
    LOOM_REQUIRE(out != nullptr, "device/cpu alloc: out is NULL");
    *out = nullptr;
    if (bytes == 0) return;
    constexpr size_t kAlign = 256;
    LOOM_REQUIRE(bytes <= SIZE_MAX - kAlign, "device/cpu alloc: " << bytes << " bytes is too large");
    const size_t reserved = (bytes + kAlign - 1) / kAlign * kAlign;
    {
      // Counted in use from here on, checked against the limit under the same lock so
      // that two threads cannot both pass it. The limit is on memory in use, what the
      // memory plan counts (not graph-pool blocks a graph keeps for its replays).
      std::lock_guard<std::mutex> lock(dev.mem_mu);
      if (dev.memory_limit > 0 && (dev.current_bytes > dev.memory_limit || bytes > dev.memory_limit - dev.current_bytes)) {
        std::ostringstream os;
        os << "device/cpu rank " << dev.global_rank << ": out of memory allocating " << bytes << " bytes ("
           << dev.current_bytes << " bytes in use of the " << (dev.memory_limit >> 20)
           << " MiB device.options.memory_mb gives a rank)";
        throw Error(os.str(), LOOM_CODE_OUT_OF_MEMORY);
      }
      dev.current_bytes += bytes;
      dev.num_allocs += 1;
    }
    const bool capturing = dev.capturing != nullptr;
    if (capturing) {  // reuse a pooled graph block of at most twice the size
      std::lock_guard<std::mutex> lock(dev.mem_mu);
      auto it = dev.graph_free.lower_bound(reserved);
      if (it != dev.graph_free.end() && it->first <= 2 * reserved) {
        void* p = it->second;
        dev.allocations.emplace(p, std::make_pair(bytes, it->first));
        dev.graph_free.erase(it);
        dev.peak_bytes = std::max(dev.peak_bytes, dev.current_bytes);
        *out = p;
        return;
      }
    }
    void* p = nullptr;
    if (posix_memalign(&p, kAlign, reserved) != 0 || p == nullptr) {
      std::lock_guard<std::mutex> lock(dev.mem_mu);
      dev.current_bytes -= bytes;
      dev.num_allocs -= 1;
      std::ostringstream os;
      os << "device/cpu rank " << dev.global_rank << ": out of memory allocating " << bytes << " bytes ("
         << dev.current_bytes << " bytes in use)";
      throw Error(os.str(), LOOM_CODE_OUT_OF_MEMORY);
    }
    std::lock_guard<std::mutex> lock(dev.mem_mu);
    dev.allocations.emplace(p, std::make_pair(bytes, reserved));
    if (capturing) dev.graph_blocks.insert(p);
    dev.reserved_bytes += reserved;
    dev.peak_bytes = std::max(dev.peak_bytes, dev.current_bytes);
    *out = p;
  });
}

void free_(loom_device* d, void* ptr) {
  (void)guard([&] {
    if (ptr == nullptr) return;
    Device& dev = device_of(d);
    {
      std::lock_guard<std::mutex> lock(dev.mem_mu);
      auto it = dev.allocations.find(ptr);
      if (it == dev.allocations.end()) {
        LOOM_LOG(ERROR) << "device/cpu rank " << dev.global_rank << ": free of " << ptr
                        << ", which this device did not allocate (or already freed); ignored";
        return;
      }
      const size_t reserved = it->second.second;
      dev.current_bytes -= it->second.first;
      dev.allocations.erase(it);
      if (dev.graph_blocks.count(ptr) != 0) {
        if (dev.graphs_alive > 0 || dev.capturing != nullptr) {
          dev.graph_free.emplace(reserved, ptr);  // a replay may still write it
          return;
        }
        dev.graph_blocks.erase(ptr);
      }
      dev.reserved_bytes -= reserved;
    }
    std::free(ptr);
  });
}

loom_status memory_stats(loom_device* d, loom_memory_stats* out) {
  return guard([&] {
    Device& dev = device_of(d);
    LOOM_REQUIRE(out != nullptr, "device/cpu memory_stats: out is NULL");
    std::lock_guard<std::mutex> lock(dev.mem_mu);
    if (LOOM_HAS_SLOT(out, loom_memory_stats, current_bytes)) out->current_bytes = dev.current_bytes;
    if (LOOM_HAS_SLOT(out, loom_memory_stats, peak_bytes)) out->peak_bytes = dev.peak_bytes;
    if (LOOM_HAS_SLOT(out, loom_memory_stats, reserved_bytes)) out->reserved_bytes = dev.reserved_bytes;
    if (LOOM_HAS_SLOT(out, loom_memory_stats, num_allocs)) out->num_allocs = dev.num_allocs;
    if (LOOM_HAS_SLOT(out, loom_memory_stats, capacity_bytes)) out->capacity_bytes = dev.capacity_bytes;
  });
}

loom_status copy(loom_device* d, loom_stream* s, void* dst, const void* src, size_t bytes, int32_t kind) {
  return guard([&] {
    Device& dev = device_of(d);
    Stream& st = stream_of(dev, s);
    LOOM_REQUIRE(
        kind == LOOM_COPY_HOST_TO_DEVICE || kind == LOOM_COPY_DEVICE_TO_HOST || kind == LOOM_COPY_DEVICE_TO_DEVICE,
        "device/cpu copy: unknown kind " << kind);
    if (bytes == 0) return;
    LOOM_REQUIRE(dst != nullptr && src != nullptr, "device/cpu copy: dst or src is NULL");
    // CPU memory is host memory: every kind is a memmove (overlap tolerated).
    launch(st, "copy", [dst, src, bytes] { std::memmove(dst, src, bytes); });
  });
}

loom_status copy_2d(loom_device* d, loom_stream* s, void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                    size_t width, size_t rows, int32_t kind) {
  return guard([&] {
    Device& dev = device_of(d);
    Stream& st = stream_of(dev, s);
    LOOM_REQUIRE(
        kind == LOOM_COPY_HOST_TO_DEVICE || kind == LOOM_COPY_DEVICE_TO_HOST || kind == LOOM_COPY_DEVICE_TO_DEVICE,
        "device/cpu copy_2d: unknown kind " << kind);
    if (width == 0 || rows == 0) return;
    LOOM_REQUIRE(dst != nullptr && src != nullptr, "device/cpu copy_2d: dst or src is NULL");
    LOOM_REQUIRE(dst_pitch >= width && src_pitch >= width, "device/cpu copy_2d: dst_pitch " << dst_pitch
                                                               << " and src_pitch " << src_pitch
                                                               << " must be >= width " << width);
    launch(st, "copy_2d", [=] {
      for (size_t r = 0; r < rows; ++r)
        std::memcpy(static_cast<char*>(dst) + r * dst_pitch, static_cast<const char*>(src) + r * src_pitch, width);
    });
  });
}

// ---------------------------------------------------------------------------
// Streams and events (synchronous: record/wait/synchronize validate and return)
// ---------------------------------------------------------------------------

loom_status stream_create(loom_device* d, loom_stream** out) {
  return guard([&] {
    Device& dev = device_of(d);
    LOOM_REQUIRE(out != nullptr, "device/cpu stream_create: out is NULL");
    auto st = std::make_unique<Stream>();
    st->dev = &dev;
    *out = reinterpret_cast<loom_stream*>(st.release());
  });
}

void stream_destroy(loom_device* d, loom_stream* s) {
  (void)guard([&] {
    if (s == nullptr) return;  // the default stream lives with the device
    Device& dev = device_of(d);
    Stream& st = stream_of(dev, s);
    if (dev.capturing == &st) {
      LOOM_LOG(WARNING) << "device/cpu: stream destroyed during graph capture; the capture is discarded";
      dev.capturing = nullptr;
      std::lock_guard<std::mutex> lock(dev.mem_mu);
      dev.release_graph_pool_locked();
    }
    st.magic = 0;
    delete &st;
  });
}

loom_status stream_synchronize(loom_device* d, loom_stream* s) {
  return guard([&] {
    Device& dev = device_of(d);
    Stream& st = stream_of(dev, s);
    // As with CUDA, a host sync inside a captured region breaks the graph rules.
    if (st.capturing)
      throw Error(
          "device/cpu: stream_synchronize on a stream under graph capture (no host sync is allowed "
          "inside a captured region)",
          LOOM_CODE_INVALID_ARGUMENT);
  });
}

loom_status event_create(loom_device* d, loom_event** out) {
  return guard([&] {
    Device& dev = device_of(d);
    LOOM_REQUIRE(out != nullptr, "device/cpu event_create: out is NULL");
    auto ev = std::make_unique<Event>();
    ev->dev = &dev;
    *out = reinterpret_cast<loom_event*>(ev.release());
  });
}

void event_destroy(loom_device* d, loom_event* e) {
  (void)guard([&] {
    if (e == nullptr) return;
    Device& dev = device_of(d);
    Event& ev = event_of(dev, e);
    ev.magic = 0;
    delete &ev;
  });
}

loom_status event_record(loom_device* d, loom_event* e, loom_stream* s) {
  return guard([&] {
    Device& dev = device_of(d);
    Event& ev = event_of(dev, e);
    (void)stream_of(dev, s);
    ev.recorded = true;  // everything before it has already run
  });
}

loom_status stream_wait_event(loom_device* d, loom_stream* s, loom_event* e) {
  return guard([&] {
    Device& dev = device_of(d);
    (void)event_of(dev, e);
    (void)stream_of(dev, s);
  });
}

loom_status event_synchronize(loom_device* d, loom_event* e) {
  return guard([&] {
    Device& dev = device_of(d);
    (void)event_of(dev, e);
  });
}

// ---------------------------------------------------------------------------
// Graphs
// ---------------------------------------------------------------------------

}  // namespace

void Device::release_graph_pool_locked() {
  if (graphs_alive > 0 || capturing != nullptr) return;
  for (auto& [size, ptr] : graph_free) {
    graph_blocks.erase(ptr);
    reserved_bytes -= size;
    std::free(ptr);
  }
  graph_free.clear();
}

namespace {

loom_status capture_begin(loom_device* d, loom_stream* s) {
  return guard([&] {
    Device& dev = device_of(d);
    Stream& st = stream_of(dev, s);
    LOOM_REQUIRE(dev.capturing == nullptr,
                 "device/cpu capture_begin: a capture is already in progress on this device "
                 "(nested capture is not supported; end it with capture_end first)");
    st.capturing = true;
    st.recorded.clear();
    dev.capturing = &st;
  });
}

loom_status capture_end(loom_device* d, loom_stream* s, loom_graph** out) {
  return guard([&] {
    Device& dev = device_of(d);
    Stream& st = stream_of(dev, s);
    LOOM_REQUIRE(out != nullptr, "device/cpu capture_end: out is NULL");
    *out = nullptr;
    LOOM_REQUIRE(st.capturing, "device/cpu capture_end: this stream is not under capture (capture_begin it first)");
    auto g = std::make_unique<Graph>();
    g->dev = &dev;
    g->launches = std::move(st.recorded);
    st.recorded.clear();
    st.capturing = false;
    dev.capturing = nullptr;
    std::lock_guard<std::mutex> lock(dev.mem_mu);
    dev.graphs_alive += 1;
    *out = reinterpret_cast<loom_graph*>(g.release());
  });
}

void replay_launches(const std::vector<Launch>& launches) {
  for (size_t i = 0; i < launches.size(); ++i) {
    try {
      launches[i].fn();
    } catch (const Error& e) {
      std::ostringstream os;
      os << "graph replay, launch " << i << " (" << launches[i].name << "): " << e.what();
      throw Error(os.str(), e.code());
    }
  }
}

loom_status graph_replay(loom_device* d, loom_graph* g, loom_stream* s) {
  return guard([&] {
    Device& dev = device_of(d);
    Graph& gr = graph_of(dev, g);
    Stream& st = stream_of(dev, s);
    if (st.capturing) {
      // Replaying into a capture nests the graph: record a copy of its launches.
      launch(st, "graph", [launches = gr.launches] { replay_launches(launches); });
      return;
    }
    replay_launches(gr.launches);
  });
}

void graph_destroy(loom_device* d, loom_graph* g) {
  (void)guard([&] {
    if (g == nullptr) return;
    Device& dev = device_of(d);
    Graph& gr = graph_of(dev, g);
    gr.magic = 0;
    delete &gr;
    std::lock_guard<std::mutex> lock(dev.mem_mu);
    dev.graphs_alive -= 1;
    dev.release_graph_pool_locked();
  });
}

void* native_stream(loom_device*, loom_stream*) { return nullptr; }

// ---------------------------------------------------------------------------
// Op trampolines: normalise, validate (also at capture time, so errors point at
// the launch), then run or record.
// ---------------------------------------------------------------------------

#define LOOM_CPU_OP(fn, Args, VALIDATE, RUN)                       \
  loom_status fn(loom_device* d, loom_stream* s, const Args* in) { \
    return guard([&] {                                             \
      Device& dev = device_of(d);                                  \
      Stream& st = stream_of(dev, s);                              \
      const Args a = normalize(in, #fn);                           \
      VALIDATE;                                                    \
      Device* dp = &dev;                                           \
      launch(st, #fn, [dp, a] { RUN(*dp, a); });                   \
    });                                                            \
  }

LOOM_CPU_OP(op_gemm, loom_gemm_args, validate(a), run_gemm)
LOOM_CPU_OP(op_layernorm_fwd, loom_layernorm_fwd_args, validate(a), run_layernorm_fwd)
LOOM_CPU_OP(op_layernorm_bwd, loom_layernorm_bwd_args, validate(a), run_layernorm_bwd)
LOOM_CPU_OP(op_gelu_fwd, loom_gelu_args, validate_gelu(a, false), run_gelu_fwd)
LOOM_CPU_OP(op_gelu_bwd, loom_gelu_args, validate_gelu(a, true), run_gelu_bwd)
LOOM_CPU_OP(op_attention_fwd, loom_attention_args, validate_attention(a, false), run_attention_fwd)
LOOM_CPU_OP(op_attention_bwd, loom_attention_args, validate_attention(a, true), run_attention_bwd)
LOOM_CPU_OP(op_xent, loom_xent_args, validate(a), run_xent)
LOOM_CPU_OP(op_embedding_fwd, loom_embedding_args, validate_embedding(a, false), run_embedding_fwd)
LOOM_CPU_OP(op_embedding_bwd, loom_embedding_args, validate_embedding(a, true), run_embedding_bwd)
LOOM_CPU_OP(op_elementwise, loom_elementwise_args, validate(a), run_elementwise)
LOOM_CPU_OP(op_reduce, loom_reduce_args, validate(a), run_reduce)
LOOM_CPU_OP(op_adamw, loom_adamw_args, validate(a), run_adamw)
LOOM_CPU_OP(op_rmsnorm_fwd, loom_rmsnorm_fwd_args, validate(a), run_rmsnorm_fwd)
LOOM_CPU_OP(op_rmsnorm_bwd, loom_rmsnorm_bwd_args, validate(a), run_rmsnorm_bwd)
LOOM_CPU_OP(op_swiglu_fwd, loom_swiglu_args, validate_swiglu(a, false), run_swiglu_fwd)
LOOM_CPU_OP(op_swiglu_bwd, loom_swiglu_args, validate_swiglu(a, true), run_swiglu_bwd)
LOOM_CPU_OP(op_rope_fwd, loom_rope_args, validate_rope(a, false), run_rope_fwd)
LOOM_CPU_OP(op_rope_bwd, loom_rope_args, validate_rope(a, true), run_rope_bwd)
LOOM_CPU_OP(op_sigmoid_fwd, loom_activation_args, validate_sigmoid(a, false), run_sigmoid_fwd)
LOOM_CPU_OP(op_sigmoid_bwd, loom_activation_args, validate_sigmoid(a, true), run_sigmoid_bwd)
#undef LOOM_CPU_OP

// A plugin's host task: its args copied into storage of the launch's own (malloc's
// alignment, max_align_t units), so the caller's struct may change or go as soon as
// the call returns; a recorded launch shares the copy with its graph (and with the
// graphs a replay nests it into), and every replay passes it to fn again.
void check_host_task(const loom_host_task_args& a) {
  LOOM_REQUIRE(a.fn != nullptr, "host_task: fn is NULL (the task to run)");
  LOOM_REQUIRE(a.args != nullptr || a.args_bytes == 0,
               "host_task: args is NULL but args_bytes is " << a.args_bytes);
  LOOM_REQUIRE(a.args_bytes <= LOOM_HOST_TASK_MAX_ARGS_BYTES,
               "host_task: args_bytes is " << a.args_bytes << ", more than the " << LOOM_HOST_TASK_MAX_ARGS_BYTES
                                           << " a launch copies (LOOM_HOST_TASK_MAX_ARGS_BYTES); pass a pointer "
                                              "to the rest in device memory");
}

loom_status op_host_task(loom_device* d, loom_stream* s, const loom_host_task_args* in) {
  return guard([&] {
    Device& dev = device_of(d);
    Stream& st = stream_of(dev, s);
    const loom_host_task_args a = normalize(in, "host_task");
    check_host_task(a);
    const size_t units = (a.args_bytes + sizeof(std::max_align_t) - 1) / sizeof(std::max_align_t);
    auto copy = std::make_shared<std::vector<std::max_align_t>>(units);
    if (a.args_bytes > 0) std::memcpy(copy->data(), a.args, a.args_bytes);
    launch(st, "host_task", [fn = a.fn, copy] { fn(copy->empty() ? nullptr : copy->data()); });
  });
}

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
    o.host_task = op_host_task;
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
    a.dl_device_type = kDLCPU;
    a.ops = &ops;
    a.copy_2d = copy_2d;
    a.features = LOOM_DEVICE_GRAD_FP32 | LOOM_DEVICE_GRAPH_POOL | LOOM_DEVICE_SEED_DEVICE | LOOM_DEVICE_ATTENTION_WINDOW |
                 LOOM_DEVICE_MULTI_TENSOR | LOOM_CPU_MEMORY_FEATURE | LOOM_DEVICE_GEMM_EPILOGUE |
                 LOOM_DEVICE_XENT_IN_PLACE |  // its XENT_BACKWARD reads and writes each element in one pass
                 LOOM_DEVICE_ROPE_FREQUENCIES | LOOM_DEVICE_ATTENTION_SLIDING_WINDOW | LOOM_DEVICE_ATTENTION_KEY_START;
    return a;
  }();
  return &api;
}

}  // namespace
}  // namespace loom::cpu

LOOM_PLUGIN_LIBRARY(loom::raw_plugin(
    "device", LOOM_CPU_PLUGIN_NAME, "1.1.0",
    "CPU backend (fp32 math, f32 or bf16 storage): OpenBLAS GEMM, vectorised kernels, recorded graphs", LOOM_API_DEVICE,
    loom::cpu::device_api(),
    {loom::opt_string(
         "blas", "openblas",
         "GEMM backend: \"openblas\" (loaded at run time; falls back to builtin if absent) or \"builtin\"")
         .one_of("openblas|builtin"),
     loom::opt_string(
         "simd", "auto",
         "instruction set of the non-GEMM loops: \"auto\" (best the CPU runs), \"avx512\", \"avx2\", \"base\"")
         .one_of("auto|avx512|avx2|base"),
     loom::opt_int("threads", 0, "threads per rank for math; 0 = what the engine grants the rank (num_threads)")
         .in("[0, 4096]"),
     loom::opt_bool("verbose", false, "log the thread count and GEMM backend of each device at creation"),
     loom::opt_int("memory_mb", 0,
                   "MiB of memory each rank may allocate, as on a GPU of that size: plans are checked against it and "
                   "allocations beyond it fail (0 = no limit; the host's RAM, or ulimit -v, shared by the "
                   "process's ranks is what plans are checked against)")
         .in("[0, 1073741824]")}))
