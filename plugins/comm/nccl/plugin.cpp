// comm/nccl: GPU collectives through NCCL, one communicator per rank group.
//
// Launch modes, one GPU per rank:
// - threads of one process (the engine's launcher): a group's NCCL unique id is
//   made by the first member to arrive at group_create and handed to the others
//   through the world object (a rendezvous keyed by the group's kind and rank
//   list, as comm/local's); the rank's GPU is its index in the process modulo the
//   GPU count, as device/cuda picks it.
// - one process per rank under mpirun/srun (built with MPI): the group's first
//   member makes the id and sends it to the others over MPI
//   (comm_common::World::share_from_first, with the timeout); the rank's GPU is
//   the calling thread's current device, which device/cuda set when it created the
//   rank's device. A failure in one process reaches the others through MPI too
//   (their watchdog aborts their communicators), and a failed process ends the job
//   with MPI_Abort when it exits.
// Each member then calls ncclCommInitRankConfig.
//
// Streams: each communicator has its own CUDA stream. A call on the caller's
// stream S records an event on S, makes the comm stream wait for it, enqueues the
// NCCL operation on the comm stream, and makes S wait for its completion: the
// operation is stream-ordered for the caller (and capturable into a CUDA graph: the
// comm stream forks from and joins back into the capture), while compute and
// communication run on separate streams.
//
// Host memory: the engine also calls collectives on host buffers with stream
// NULL (loss and flag reductions). Such calls are staged through device memory
// and wait for completion on the host (with the watchdog's timeout). With stream
// NULL and device buffers, the call first waits for the whole GPU (there is no
// stream to order after) and also completes before returning.
//
// Watchdog: a thread per world follows every enqueued operation (an event after
// it on the comm stream) and polls ncclCommGetAsyncError. An operation that has
// not completed after comm.timeout_s, or an asynchronous NCCL error, is reported
// with the op, the group, the rank and the GPU; every communicator of the world
// is then aborted (ncclCommAbort) so that the kernels of every rank return, and
// every later call fails at once with that reason. world_abort does the same.
//
// Communicators are non-blocking (config.blocking = 0): a call that returns
// ncclInProgress is polled to completion with the same timeout, so a group whose
// members never all arrive fails instead of hanging.
//
// NCCL version: the library loaded at run time (libnccl.so.2, wherever the dynamic
// loader finds it) must be at least the one of the nccl.h this was compiled with;
// an older one is refused when the plugin library loads, naming both versions.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>

// Functions newer than what an older libnccl.so.2 exports are weak references, so that
// loading against such a library reaches the version check of the library's entry point
// (which names both versions) instead of failing in the dynamic loader with "undefined
// symbol"; the check refuses before anything could call them.
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 7)
extern "C" ncclResult_t ncclCommRevoke(ncclComm_t comm, int revokeFlags) __attribute__((weak));
#endif

#ifdef LOOM_NCCL_WITH_MPI
#include "../common/mpi_world.hpp"
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <loom/cpp/plugin.hpp>
#include <map>
#include <set>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace loom::comm_nccl {
namespace {

using Clock = std::chrono::steady_clock;

struct World;

// One in-flight operation, for the watchdog.
struct InFlight {
  cudaEvent_t done = nullptr;
  std::string what;  // "all_reduce of 4096 f32"
  Clock::time_point start;
};

// A one-way point-to-point channel to or from one neighbour: a 2-rank
// communicator (rank 0 sends, rank 1 receives) with its own stream. NCCL
// serialises the operations of a communicator, so a send and a recv between the
// same two ranks in opposite directions must not share one, and messages of one
// channel are matched in order, whatever their tags: each ordered pair of
// neighbours gets two channels, one for even tags and one for odd (the executor's
// activations 2g and gradients 2g + 1, which a pipeline with interleaving sends
// and receives in different relative orders). Sends go out of a stream-ordered
// copy (cudaMallocAsync, freed after the send), so the caller never waits for the
// receiver and may reuse its buffer at once.
struct Channel {
  ncclComm_t nccl = nullptr;  // under the owning Comm's handle_mu; NULL once aborted or destroyed
  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr, done = nullptr;
  bool sender = false;
  std::string name;  // NCCL keeps the pointer of config.commName
};

struct Comm {
  World* world = nullptr;
  std::string kind;
  std::vector<int32_t> ranks;
  int32_t index = 0;        // rank in the group
  int32_t global_rank = 0;  // the caller's global rank
  int gpu = 0;
  // The group's communicator and its channels' are used under handle_mu (one NCCL
  // call at a time, never held while waiting) so that an abort from another thread
  // cannot free them in the middle of a call; NULL once aborted or destroyed.
  std::mutex handle_mu;
  ncclComm_t nccl = nullptr;
  // Handles whose last call has not been polled to ncclSuccess (an init or an
  // operation in progress, or one that failed): NCCL still holds a group job for
  // them, which ncclCommRevoke would free under the later abort (NCCL 2.28), so
  // aborts skip the revoke for these. Under handle_mu.
  std::set<ncclComm_t> unsettled;
  std::string name;                       // NCCL keeps the pointer of config.commName
  cudaStream_t stream = nullptr;          // the communication stream
  cudaEvent_t ready = nullptr, done = nullptr;  // caller -> comm stream, comm stream -> caller
  std::mutex call_mu;                     // one call at a time (staging, events)
  void* staging = nullptr;
  size_t staging_bytes = 0;
  std::mutex flight_mu;
  std::deque<InFlight> inflight;
  std::vector<cudaEvent_t> spare;
  std::atomic<bool> aborted{false};
  bool destroyed = false;
  // By (peer rank in the group, tag parity).
  std::map<std::pair<int32_t, int>, std::unique_ptr<Channel>> to, from;

  // Every NCCL handle of the group (the communicator, then its channels').
  std::vector<ncclComm_t*> handles() {
    std::vector<ncclComm_t*> out{&nccl};
    for (auto* chans : {&to, &from})
      for (auto& [key, ch] : *chans) out.push_back(&ch->nccl);
    return out;
  }

  std::string where() const {
    std::ostringstream os;
    os << "group '" << kind << "' (rank " << index << " of " << ranks.size() << ", global rank " << global_rank
       << ", GPU " << gpu << ")";
    return os.str();
  }
};

struct Rendezvous {
  ncclUniqueId id{};
  std::vector<char> joined;
  int count = 0;
};

struct World {
  int32_t world_size = 0;
  std::vector<int32_t> local_ranks;
#ifdef LOOM_NCCL_WITH_MPI
  std::shared_ptr<comm_common::World> mpi;  // ranks in several processes: ids and aborts over MPI
#endif
  bool multi_process() const {
#ifdef LOOM_NCCL_WITH_MPI
    return mpi != nullptr;
#else
    return false;
#endif
  }
  int64_t timeout_ms = 0;
  std::vector<std::string> p2p_kinds;  // groups that get point-to-point channels

  std::mutex mu;
  std::map<std::string, std::deque<std::shared_ptr<Rendezvous>>> pending;
  std::vector<Comm*> comms;
  std::atomic<bool> aborted{false};
  std::string reason;  // under mu

  std::thread watchdog;
  std::mutex wd_mu;
  std::condition_variable wd_cv;
  bool stop = false;

  std::string abort_reason() {
    std::lock_guard<std::mutex> lock(mu);
    return reason;
  }
  void abort(const std::string& why);
  void watch();
};

// ---------------------------------------------------------------------------
// Errors and waiting
// ---------------------------------------------------------------------------

void check_cuda(const Comm* c, const char* op, const char* call, cudaError_t err) {
  if (err == cudaSuccess) return;
  cudaGetLastError();
  std::ostringstream os;
  os << "comm/nccl " << op << " on " << (c ? c->where() : std::string("?")) << ": " << call
     << " failed: " << cudaGetErrorName(err) << " (" << cudaGetErrorString(err) << ")";
  throw Error(os.str(), err == cudaErrorMemoryAllocation ? LOOM_CODE_OUT_OF_MEMORY : LOOM_CODE_INTERNAL);
}
#define LOOM_NCCL_CUDA(c, op, expr) check_cuda(c, op, #expr, (expr))

[[noreturn]] void fail_aborted(Comm& c, const char* op) {
  const std::string why = c.world->abort_reason();
  throw Error("comm/nccl " + std::string(op) + " on " + c.where() + ": the communicators were aborted: " +
                  (why.empty() ? std::string("aborted") : why),
              LOOM_CODE_TIMEOUT);
}

void check_alive(Comm& c, const char* op) {
  if (c.aborted.load() || c.world->aborted.load()) fail_aborted(c, op);
}

bool timed_out(const World& w, Clock::time_point start) {
  return w.timeout_ms > 0 &&
         std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count() > w.timeout_ms;
}

// Sleeps between polls: yields for the first ~100 us (most NCCL calls on a
// non-blocking communicator complete in microseconds), then backs off to 200 us.
class Backoff {
 public:
  void pause() {
    if (Clock::now() - start_ < std::chrono::microseconds(100)) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us_));
    sleep_us_ = std::min(sleep_us_ * 2, 200);
  }

 private:
  Clock::time_point start_ = Clock::now();
  int sleep_us_ = 5;
};

// Runs `fn()` (one NCCL call on handle h) with the group's handle lock held;
// fails at once when the communicators were aborted. The lock is released before
// failing (fail_aborted takes the world's lock, which abort holds while it takes
// handle locks).
template <typename Fn>
ncclResult_t locked(Comm& c, ncclComm_t& h, const char* op, Fn&& fn) {
  {
    std::lock_guard<std::mutex> lock(c.handle_mu);
    if (h != nullptr && !c.aborted.load()) {
      const ncclResult_t r = fn();
      if (r != ncclSuccess) c.unsettled.insert(h);
      return r;
    }
  }
  fail_aborted(c, op);
}

// ncclCommGetAsyncError under the handle lock (on success NCCL 2.28 releases the
// handle's group job: two threads polling at once would release it twice).
ncclResult_t poll_handle(Comm& c, ncclComm_t h, ncclResult_t* state) {
  const ncclResult_t q = ncclCommGetAsyncError(h, state);
  if (q == ncclSuccess && *state == ncclSuccess) c.unsettled.erase(h);
  return q;
}

// Polls a non-blocking communicator (the group's, or one of its channels) until
// its last call has completed.
void wait_on(Comm& c, ncclComm_t& h, const char* op, const char* call, ncclResult_t r) {
  const Clock::time_point start = Clock::now();
  Backoff backoff;
  while (r == ncclInProgress) {
    if (c.world->aborted.load()) fail_aborted(c, op);
    if (timed_out(*c.world, start)) {
      std::ostringstream os;
      os << "comm/nccl " << op << " on " << c.where() << ": " << call << " did not complete within "
         << c.world->timeout_ms / 1000.0 << " s (comm.timeout_s); aborting every communicator of the world";
      c.world->abort(os.str());
      throw Error(os.str(), LOOM_CODE_TIMEOUT);
    }
    backoff.pause();
    const ncclResult_t q = locked(c, h, op, [&] { return poll_handle(c, h, &r); });
    if (q != ncclSuccess) r = q;
  }
  if (r != ncclSuccess) {
    std::ostringstream os;
    os << "comm/nccl " << op << " on " << c.where() << ": " << call << " failed: " << ncclGetErrorString(r);
    {
      std::lock_guard<std::mutex> lock(c.handle_mu);
      const char* last = h ? ncclGetLastError(h) : nullptr;
      if (last && *last) os << " (" << last << ")";
    }
    throw Error(os.str(), LOOM_CODE_INTERNAL);
  }
}
// One NCCL call on handle h (an expression using h), under the handle lock, then
// polled to completion.
#define LOOM_NCCL_ON(c, h, op, expr) wait_on(c, h, op, #expr, locked(c, h, op, [&] { return (expr); }))
#define LOOM_NCCL(c, op, expr) LOOM_NCCL_ON(c, (c).nccl, op, expr)

// Aborting is two passes over every handle concerned: first each is revoked
// (NCCL 2.28: its kernels return at once, nothing is freed), then each is aborted
// (freed). Freeing a communicator waits for NCCL's internal stream, which can be
// chained after kernels of another communicator (through the compute stream):
// stopped by the first pass, they cannot hold up the second.
void revoke_handles(Comm& c) {
  std::lock_guard<std::mutex> lock(c.handle_mu);
  c.aborted.store(true);  // rank threads make no new NCCL call on it
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 7)
  int prev = -1;
  cudaGetDevice(&prev);
  cudaSetDevice(c.gpu);
  for (ncclComm_t* h : c.handles())
    if (*h && !c.unsettled.count(*h)) ncclCommRevoke(*h, NCCL_REVOKE_DEFAULT);
  cudaGetLastError();
  if (prev >= 0) cudaSetDevice(prev);
#endif
}
void free_handles(Comm& c) {
  std::lock_guard<std::mutex> lock(c.handle_mu);
  int prev = -1;
  cudaGetDevice(&prev);
  cudaSetDevice(c.gpu);
  for (ncclComm_t* h : c.handles())
    if (*h) {
      ncclCommAbort(*h);
      c.unsettled.erase(*h);
      *h = nullptr;
    }
  cudaGetLastError();
  if (prev >= 0) cudaSetDevice(prev);
}
void abort_handles(Comm& c) {
  revoke_handles(c);
  free_handles(c);
}

// Waits on the host for an event of the comm stream (staged calls, barrier).
void host_wait(Comm& c, const char* op, cudaEvent_t ev) {
  const Clock::time_point start = Clock::now();
  Backoff backoff;
  for (;;) {
    const cudaError_t q = cudaEventQuery(ev);
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) check_cuda(&c, op, "cudaEventQuery", q);
    if (c.world->aborted.load()) fail_aborted(c, op);
    if (timed_out(*c.world, start)) {
      std::ostringstream os;
      os << "comm/nccl " << op << " on " << c.where() << " did not complete within " << c.world->timeout_ms / 1000.0
         << " s (comm.timeout_s); aborting every communicator of the world";
      c.world->abort(os.str());
      throw Error(os.str(), LOOM_CODE_TIMEOUT);
    }
    backoff.pause();
  }
}

class GpuScope {
 public:
  GpuScope(const Comm& c, const char* op) : c_(c) {
    check_cuda(&c, op, "cudaGetDevice", cudaGetDevice(&prev_));
    if (prev_ != c.gpu) check_cuda(&c, op, "cudaSetDevice", cudaSetDevice(c.gpu));
  }
  ~GpuScope() {
    if (prev_ >= 0 && prev_ != c_.gpu) cudaSetDevice(prev_);
  }

 private:
  const Comm& c_;
  int prev_ = -1;
};

// ---------------------------------------------------------------------------
// World: abort and watchdog
// ---------------------------------------------------------------------------

void World::abort(const std::string& why) {
  // Held throughout: group_destroy cannot free a Comm of the list meanwhile.
  std::lock_guard<std::mutex> lock(mu);
  if (aborted.load()) return;
  reason = why;
  aborted.store(true);
  LOOM_LOG(ERROR) << why;
#ifdef LOOM_NCCL_WITH_MPI
  if (mpi) mpi->abort(why);  // the other processes' watchdogs abort theirs
#endif
  // Every communicator of the world, revoked first, then freed (see revoke_handles);
  // the rank threads see `aborted` and fail their calls.
  for (Comm* c : comms) revoke_handles(*c);
  for (Comm* c : comms) free_handles(*c);
  wd_cv.notify_all();
}

void World::watch() {
  const auto period = std::chrono::milliseconds(timeout_ms > 0 ? std::clamp<int64_t>(timeout_ms / 20, 10, 200) : 200);
  std::unique_lock<std::mutex> wl(wd_mu);
  while (!stop) {
    wd_cv.wait_for(wl, period);
    if (stop || aborted.load()) continue;
    std::string failure;
#ifdef LOOM_NCCL_WITH_MPI
    if (mpi) failure = mpi->failure();  // another process failed (or aborted the run)
#endif
    if (failure.empty()) {
      std::lock_guard<std::mutex> lock(mu);
      for (Comm* c : comms) {
        if (c->aborted.load() || c->nccl == nullptr) continue;
        if (cudaSetDevice(c->gpu) != cudaSuccess) {
          cudaGetLastError();
          continue;
        }
        // Under `mu` no abort or group_destroy frees these meanwhile; each poll
        // under the handle lock (see poll_handle).
        for (ncclComm_t* hp : c->handles()) {
          ncclResult_t async = ncclSuccess;
          ncclResult_t q = ncclSuccess;
          {
            std::lock_guard<std::mutex> hl(c->handle_mu);
            if (*hp == nullptr) continue;
            q = poll_handle(*c, *hp, &async);
          }
          if (q == ncclSuccess && async != ncclSuccess && async != ncclInProgress) {
            failure = "comm/nccl: NCCL reported an asynchronous error on " + c->where() + ": " +
                      ncclGetErrorString(async) + "; aborting every communicator of the world";
            break;
          }
        }
        if (!failure.empty()) break;
        std::lock_guard<std::mutex> fl(c->flight_mu);
        while (!c->inflight.empty()) {
          InFlight& f = c->inflight.front();
          const cudaError_t q = cudaEventQuery(f.done);
          if (q == cudaErrorNotReady) break;
          if (q != cudaSuccess) cudaGetLastError();  // reported by the rank's next sync
          c->spare.push_back(f.done);
          c->inflight.pop_front();
        }
        if (!c->inflight.empty() && timed_out(*this, c->inflight.front().start)) {
          std::ostringstream os;
          os << "comm/nccl watchdog: " << c->inflight.front().what << " on " << c->where()
             << " did not complete within " << timeout_ms / 1000.0
             << " s (comm.timeout_s); a rank is missing from the collective or stuck; aborting every "
                "communicator of the world (ncclCommAbort)";
          failure = os.str();
          break;
        }
      }
    }
    if (!failure.empty()) {
      wl.unlock();
      abort(failure);
      wl.lock();
    }
  }
}

// ---------------------------------------------------------------------------
// Types and enqueueing
// ---------------------------------------------------------------------------

ncclDataType_t nccl_type(int32_t dtype, const char* op) {
  switch (dtype) {
    case LOOM_DTYPE_F32:
      return ncclFloat32;
    case LOOM_DTYPE_BF16:
      return ncclBfloat16;
    case LOOM_DTYPE_F16:
      return ncclFloat16;
    case LOOM_DTYPE_I32:
      return ncclInt32;
    case LOOM_DTYPE_I64:
      return ncclInt64;
    case LOOM_DTYPE_U8:
      return ncclUint8;
    case LOOM_DTYPE_F64:
      return ncclFloat64;
    default:
      throw Error(std::string("comm/nccl ") + op + ": unknown dtype " + std::to_string(dtype),
                  LOOM_CODE_INVALID_ARGUMENT);
  }
}

const char* dtype_name(int32_t dtype) {
  switch (dtype) {
    case LOOM_DTYPE_F32:
      return "f32";
    case LOOM_DTYPE_BF16:
      return "bf16";
    case LOOM_DTYPE_F16:
      return "f16";
    case LOOM_DTYPE_I32:
      return "i32";
    case LOOM_DTYPE_I64:
      return "i64";
    case LOOM_DTYPE_U8:
      return "u8";
    case LOOM_DTYPE_F64:
      return "f64";
    default:
      return "?";
  }
}

ncclRedOp_t nccl_op(int32_t op, const char* what) {
  switch (op) {
    case LOOM_REDUCE_SUM:
      return ncclSum;
    case LOOM_REDUCE_MAX:
      return ncclMax;
    case LOOM_REDUCE_MIN:
      return ncclMin;
    case LOOM_REDUCE_AVG:
      return ncclAvg;
    default:
      throw Error(std::string("comm/nccl ") + what + ": unknown reduction " + std::to_string(op),
                  LOOM_CODE_INVALID_ARGUMENT);
  }
}

bool is_host_memory(const void* p) {
  if (p == nullptr) return false;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    return true;  // unknown to CUDA: pageable host memory
  }
  return attr.type == cudaMemoryTypeUnregistered || attr.type == cudaMemoryTypeHost;
}

Comm& comm_of(loom_comm* comm) {
  LOOM_REQUIRE(comm != nullptr, "comm/nccl: null communicator (was group_create successful?)");
  Comm& c = *reinterpret_cast<Comm*>(comm);
  LOOM_REQUIRE(!c.destroyed, "comm/nccl: communicator used after group_destroy");
  return c;
}

// One call: where the NCCL operation reads and writes, and how to run it.
struct Call {
  const char* op;
  std::string what;
  const void* send = nullptr;
  size_t send_bytes = 0;
  void* recv = nullptr;
  size_t recv_bytes = 0;
  bool in_place_ok = true;  // send == recv is allowed as is
};

void track(Comm& c, const char* op, const std::string& what, cudaStream_t on) {
  cudaEvent_t ev = nullptr;
  {
    std::lock_guard<std::mutex> fl(c.flight_mu);
    if (!c.spare.empty()) {
      ev = c.spare.back();
      c.spare.pop_back();
    }
  }
  if (ev == nullptr) LOOM_NCCL_CUDA(&c, op, cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  LOOM_NCCL_CUDA(&c, op, cudaEventRecord(ev, on));
  std::lock_guard<std::mutex> fl(c.flight_mu);
  c.inflight.push_back({ev, what, Clock::now()});
}

// Runs `enqueue(send, recv)` on the comm stream, ordered after `stream` and
// before later work on it; stages host buffers (see the top of the file).
// started (ABI 1.15, start): recorded on the comm stream after the operation instead
// of making `stream` wait for it; wait() orders the caller's stream after it.
template <typename Fn>
void run(Comm& c, void* stream, const Call& call, Fn&& enqueue, cudaEvent_t started = nullptr) {
  std::lock_guard<std::mutex> lock(c.call_mu);
  check_alive(c, call.op);
  GpuScope gpu(c, call.op);
  const cudaStream_t caller = static_cast<cudaStream_t>(stream);
  const bool send_host = call.send_bytes > 0 && is_host_memory(call.send);
  const bool recv_host = call.recv_bytes > 0 && is_host_memory(call.recv);
  const bool sync = caller == nullptr || send_host || recv_host;

  bool capturing = false;
  if (caller != nullptr) {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    LOOM_NCCL_CUDA(&c, call.op, cudaStreamIsCapturing(caller, &st));
    capturing = st != cudaStreamCaptureStatusNone;
    LOOM_REQUIRE(!(capturing && sync), "comm/nccl " << call.op << " on " << c.where()
                                                    << ": host buffers cannot be used inside a graph capture");
    LOOM_NCCL_CUDA(&c, call.op, cudaEventRecord(c.ready, caller));
    LOOM_NCCL_CUDA(&c, call.op, cudaStreamWaitEvent(c.stream, c.ready, 0));
  } else if ((call.send_bytes > 0 && !send_host) || (call.recv_bytes > 0 && !recv_host)) {
    // Device buffers without a stream: whatever wrote them must be done.
    LOOM_NCCL_CUDA(&c, call.op, cudaDeviceSynchronize());
  }

  const void* send = call.send;
  void* recv = call.recv;
  if (send_host || recv_host) {
    // The staging buffer is reused: wait (with the timeout) for the comm stream's
    // earlier work. Recorded afresh: c.done may last have been recorded in a capture,
    // and such an event cannot be queried.
    LOOM_NCCL_CUDA(&c, call.op, cudaEventRecord(c.done, c.stream));
    host_wait(c, call.op, c.done);
    const size_t need = (send_host ? call.send_bytes : 0) + (recv_host ? call.recv_bytes : 0) + 256;
    if (c.staging_bytes < need) {
      if (c.staging) {
        cudaFree(c.staging);
        c.staging = nullptr;
        c.staging_bytes = 0;
      }
      const size_t bytes = std::max<size_t>(need, 1 << 16);
      LOOM_NCCL_CUDA(&c, call.op, cudaMalloc(&c.staging, bytes));
      c.staging_bytes = bytes;
    }
    char* base = static_cast<char*>(c.staging);
    if (send_host) {
      LOOM_NCCL_CUDA(&c, call.op,
                     cudaMemcpyAsync(base, call.send, call.send_bytes, cudaMemcpyHostToDevice, c.stream));
      send = base;
    }
    if (recv_host) {
      char* r = base + (send_host ? (call.send_bytes + 255) / 256 * 256 : 0);
      // An in-place call on the host stays in place in the staging buffer.
      if (send_host && call.send == call.recv && call.in_place_ok) r = base;
      recv = r;
    }
  }

  enqueue(send, recv);

  if (!capturing) track(c, call.op, call.what, c.stream);
  LOOM_NCCL_CUDA(&c, call.op, cudaEventRecord(c.done, c.stream));
  if (started != nullptr && !sync) {
    LOOM_NCCL_CUDA(&c, call.op, cudaEventRecord(started, c.stream));
  } else if (caller != nullptr) {
    LOOM_NCCL_CUDA(&c, call.op, cudaStreamWaitEvent(caller, c.done, 0));
  }
  if (sync) host_wait(c, call.op, c.done);  // the watchdog's timeout applies
  // Only now, with the operation complete: a copy into pageable memory returns when
  // it is done, so issued earlier it would wait for the collective without a timeout.
  if (recv_host)
    LOOM_NCCL_CUDA(&c, call.op,
                   cudaMemcpyAsync(call.recv, recv, call.recv_bytes, cudaMemcpyDeviceToHost, c.stream));
}

std::string describe(const char* op, size_t count, int32_t dtype) {
  std::ostringstream os;
  os << op << " of " << count << " " << dtype_name(dtype);
  return os.str();
}

// ---------------------------------------------------------------------------
// World and groups
// ---------------------------------------------------------------------------

loom_status world_create(const loom_options* options, const loom_comm_world_args* args, loom_comm_world** out) {
  return guard([&] {
    LOOM_REQUIRE(args != nullptr && out != nullptr, "comm/nccl: world_create needs args and out");
    LOOM_REQUIRE(LOOM_HAS_SLOT(args, loom_comm_world_args, timeout_ms),
                 "comm/nccl: world_create args are too small (struct_size " << args->struct_size << ")");
    LOOM_REQUIRE(args->world_size >= 1, "comm/nccl: world_size must be at least 1, got " << args->world_size);
    LOOM_REQUIRE(args->num_local_ranks >= 0 && (args->num_local_ranks == 0 || args->local_ranks != nullptr),
                 "comm/nccl: world_create got " << args->num_local_ranks << " local ranks and no list of them");
    const bool several_processes = args->num_local_ranks != args->world_size;
    if (several_processes && args->num_local_ranks != 1)
      throw Error("comm/nccl: this process hosts " + std::to_string(args->num_local_ranks) + " of " +
                      std::to_string(args->world_size) +
                      " ranks; comm/nccl runs either every rank as a thread of one process or one rank per process "
                      "(mpirun -np " + std::to_string(args->world_size) + ")",
                  LOOM_CODE_UNSUPPORTED);
#ifndef LOOM_NCCL_WITH_MPI
    if (several_processes)
      throw Error("comm/nccl: this process hosts 1 of " + std::to_string(args->world_size) +
                      " ranks, and ranks in several processes exchange their NCCL ids over MPI, but this comm/nccl "
                      "was built without MPI; rebuild loom with MPI found (OpenMPI), or run every rank as a thread "
                      "of one process (without mpirun)",
                  LOOM_CODE_UNSUPPORTED);
#endif
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
      cudaGetLastError();
      throw Error(std::string("comm/nccl: no CUDA GPU is visible (") +
                      (err != cudaSuccess ? cudaGetErrorName(err) : "cudaGetDeviceCount reports 0 devices") +
                      "); use comm.backend = \"local\"",
                  LOOM_CODE_UNSUPPORTED);
    }
    if (!several_processes && args->world_size > count)
      throw Error("comm/nccl: " + std::to_string(args->world_size) + " ranks need one GPU each, but " +
                      std::to_string(count) +
                      " are visible (NCCL cannot put two ranks of a communicator on one GPU); use fewer ranks or "
                      "comm.backend = \"local\"",
                  LOOM_CODE_UNSUPPORTED);
    auto w = std::make_unique<World>();
    w->world_size = args->world_size;
    w->local_ranks.assign(args->local_ranks, args->local_ranks + args->num_local_ranks);
    w->timeout_ms = args->timeout_ms;
#ifdef LOOM_NCCL_WITH_MPI
    if (several_processes) {
      comm_common::Settings s;
      s.plugin = "comm/nccl";
      s.timeout_ms = args->timeout_ms;
      s.abort_on_failure = Options(options).get_bool("abort_on_failure", true);
      w->mpi = std::make_shared<comm_common::World>(s, args->world_size, args->local_ranks[0]);
    }
#endif
    std::stringstream kinds(Options(options).get_string("p2p_groups", "pp"));
    for (std::string k; std::getline(kinds, k, ',');)
      if (!k.empty()) w->p2p_kinds.push_back(k);
    World* wp = w.get();
    w->watchdog = std::thread([wp] { wp->watch(); });
    *out = reinterpret_cast<loom_comm_world*>(w.release());
  });
}

void world_destroy(loom_comm_world* world) {
  if (world == nullptr) return;
  World* w = reinterpret_cast<World*>(world);
  {
    std::lock_guard<std::mutex> lock(w->wd_mu);
    w->stop = true;
  }
  w->wd_cv.notify_all();
  if (w->watchdog.joinable()) w->watchdog.join();
  delete w;
}

void world_abort(loom_comm_world* world, const char* reason) {
  (void)guard([&] {
    if (world) reinterpret_cast<World*>(world)->abort(reason ? reason : "aborted");
  });
}

ncclUniqueId new_unique_id(const Comm& c) {
  ncclUniqueId id{};
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess)
    throw Error("comm/nccl group_create on " + c.where() + ": ncclGetUniqueId failed: " + ncclGetErrorString(r),
                LOOM_CODE_INTERNAL);
  return id;
}

// The id of a communicator: made by the first member to arrive, taken by the
// others (the n-th communicator of a key on every member meets the n-th on the
// others, however calls of different groups interleave).
ncclUniqueId rendezvous(World& w, const Comm& c, const std::string& key, int members, int slot) {
  std::lock_guard<std::mutex> lock(w.mu);
  auto& q = w.pending[key];
  std::shared_ptr<Rendezvous> rv;
  for (auto& p : q)
    if (!p->joined[slot]) {
      rv = p;
      break;
    }
  if (!rv) {
    rv = std::make_shared<Rendezvous>();
    rv->joined.assign(members, 0);
    rv->id = new_unique_id(c);
    q.push_back(rv);
  }
  rv->joined[slot] = 1;
  const ncclUniqueId id = rv->id;
  if (++rv->count == members) {
    q.erase(std::find(q.begin(), q.end(), rv));
    if (q.empty()) w.pending.erase(key);
  }
  return id;
}


// The unique id of a communicator whose members are `members` (global ranks; the
// caller is members[slot]): through the world object when every rank is a thread
// of this process, over MPI when ranks are processes. `label` names it in messages.
ncclUniqueId shared_id(World& w, const Comm& c, const std::string& label, const std::vector<int32_t>& members,
                       int slot) {
#ifdef LOOM_NCCL_WITH_MPI
  if (w.mpi) {
    const std::vector<unsigned char> bytes = w.mpi->share_from_first(label, members, [&] {
      const ncclUniqueId id = new_unique_id(c);
      const auto* p = reinterpret_cast<const unsigned char*>(&id);
      return std::vector<unsigned char>(p, p + sizeof id);
    });
    if (bytes.size() != sizeof(ncclUniqueId))
      throw Error("comm/nccl group_create on " + c.where() + ": the NCCL id of '" + label + "' from global rank " +
                      std::to_string(members[0]) + " has " + std::to_string(bytes.size()) + " bytes, not " +
                      std::to_string(sizeof(ncclUniqueId)) + " (a different NCCL on that node?)",
                  LOOM_CODE_INTERNAL);
    ncclUniqueId id{};
    std::memcpy(&id, bytes.data(), sizeof id);
    return id;
  }
#endif
  std::string key = label;
  for (int32_t r : members) key += "," + std::to_string(r);
  return rendezvous(w, c, key, static_cast<int>(members.size()), slot);
}

void destroy_channel(Channel& ch) {
  if (ch.stream) cudaStreamSynchronize(ch.stream);
  cudaGetLastError();
  if (ch.ready) cudaEventDestroy(ch.ready);
  if (ch.done) cudaEventDestroy(ch.done);
  if (ch.stream) cudaStreamDestroy(ch.stream);
  cudaGetLastError();
}

// Frees what a Comm holds besides its NCCL handles (those are aborted or
// destroyed first); the caller has made its GPU current.
void destroy_comm_resources(Comm& c) {
  for (auto* chans : {&c.to, &c.from})
    for (auto& [key, ch] : *chans) destroy_channel(*ch);
  if (c.stream) cudaStreamSynchronize(c.stream);
  cudaGetLastError();
  {
    std::lock_guard<std::mutex> fl(c.flight_mu);
    for (InFlight& f : c.inflight) cudaEventDestroy(f.done);
    for (cudaEvent_t e : c.spare) cudaEventDestroy(e);
    c.inflight.clear();
    c.spare.clear();
  }
  if (c.staging) cudaFree(c.staging);
  if (c.ready) cudaEventDestroy(c.ready);
  if (c.done) cudaEventDestroy(c.done);
  if (c.stream) cudaStreamDestroy(c.stream);
  cudaGetLastError();
}

ncclConfig_t comm_config(const std::string& name) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns at once; waits are ours, with the timeout
  config.commName = name.c_str();
  return config;
}

// Connects every channel of the group (one element each way, in one NCCL group)
// and waits for it: NCCL connects a pair at its first send/recv and both sides
// take part, so without this the first send would wait for the peer's first recv
// (the ABI promises it never does) and a first connection could fall inside a
// graph capture. The group's communicator is connected by a one-element
// all-reduce for the same reasons.
void connect(Comm& c) {
  const int n = static_cast<int>(c.ranks.size());
  std::vector<Channel*> chans;
  for (auto* m : {&c.to, &c.from})
    for (auto& [key, ch] : *m) chans.push_back(ch.get());
  const size_t bytes = 256 * (chans.size() + 1);
  c.staging_bytes = std::max<size_t>(bytes, 1 << 16);
  LOOM_NCCL_CUDA(&c, "group_create", cudaMalloc(&c.staging, c.staging_bytes));
  LOOM_NCCL_CUDA(&c, "group_create", cudaMemsetAsync(c.staging, 0, bytes, c.stream));
  LOOM_NCCL_CUDA(&c, "group_create", cudaStreamSynchronize(c.stream));
  char* base = static_cast<char*>(c.staging);
  if (n > 1)
    LOOM_NCCL(c, "group_create", ncclAllReduce(base, base, 1, ncclFloat32, ncclSum, c.nccl, c.stream));
  if (!chans.empty()) {
    ncclResult_t r = ncclSuccess;
    bool aborted = false;
    {
      std::lock_guard<std::mutex> lock(c.handle_mu);
      aborted = c.aborted.load();
      if (!aborted) r = ncclGroupStart();
      if (!aborted && r == ncclSuccess) {
        for (size_t i = 0; r == ncclSuccess && i < chans.size(); ++i) {
          Channel& ch = *chans[i];
          char* slot = base + 256 * (i + 1);
          r = ch.sender ? ncclSend(slot, 1, ncclInt8, 1, ch.nccl, ch.stream)
                        : ncclRecv(slot, 1, ncclInt8, 0, ch.nccl, ch.stream);
        }
        // End the group whatever happened: an open group would queue every later call.
        const ncclResult_t e = ncclGroupEnd();
        if (r == ncclSuccess) r = e;
        if (r != ncclSuccess)
          for (Channel* ch : chans) c.unsettled.insert(ch->nccl);
      }
    }
    if (aborted) fail_aborted(c, "group_create");
    for (Channel* ch : chans) wait_on(c, ch->nccl, "group_create", "connecting the point-to-point channels", r);
  }
  LOOM_NCCL_CUDA(&c, "group_create", cudaEventRecord(c.done, c.stream));
  host_wait(c, "group_create", c.done);
  for (Channel* ch : chans) {
    LOOM_NCCL_CUDA(&c, "group_create", cudaEventRecord(ch->done, ch->stream));
    host_wait(c, "group_create", ch->done);
  }
}

loom_status group_create(loom_comm_world* world, const loom_group_desc* desc, loom_comm** out) {
  return guard([&] {
    LOOM_REQUIRE(world != nullptr && desc != nullptr && out != nullptr,
                 "comm/nccl: group_create needs a world, a description and out");
    LOOM_REQUIRE(LOOM_HAS_SLOT(desc, loom_group_desc, my_rank),
                 "comm/nccl: group_create description is too small (struct_size " << desc->struct_size << ")");
    World& w = *reinterpret_cast<World*>(world);
    const std::string kind = desc->kind ? desc->kind : "?";
    LOOM_REQUIRE(desc->size >= 1 && desc->ranks != nullptr,
                 "comm/nccl: group_create of group '" << kind << "' needs at least one rank, got size " << desc->size);
    auto c = std::make_unique<Comm>();
    c->world = &w;
    c->kind = kind;
    c->ranks.assign(desc->ranks, desc->ranks + desc->size);
    c->global_rank = desc->my_rank;
    const auto me = std::find(c->ranks.begin(), c->ranks.end(), desc->my_rank);
    LOOM_REQUIRE(me != c->ranks.end(), "comm/nccl: rank " << desc->my_rank << " creates group '" << kind
                                                          << "' but is not one of its members");
    c->index = static_cast<int32_t>(me - c->ranks.begin());
    LOOM_REQUIRE(std::find(w.local_ranks.begin(), w.local_ranks.end(), desc->my_rank) != w.local_ranks.end(),
                 "comm/nccl: rank " << desc->my_rank << " is not hosted by this process");
    // The rank's GPU is the calling thread's current device: device/cuda made it
    // current when it created the rank's device on this thread (from the local
    // rank, or its option gpu), so buffers, streams and communicators agree.
    LOOM_NCCL_CUDA(c.get(), "group_create", cudaGetDevice(&c->gpu));
    if (w.aborted.load()) fail_aborted(*c, "group_create");

    const int n = static_cast<int>(c->ranks.size());
    const bool p2p = n > 1 && std::find(w.p2p_kinds.begin(), w.p2p_kinds.end(), kind) != w.p2p_kinds.end();
    // Everything created below is released by the catch: NCCL handles aborted (also
    // those still initialising), streams and events destroyed.
    try {
      const ncclUniqueId id = shared_id(w, *c, kind, c->ranks, c->index);
      GpuScope gpu(*c, "group_create");
      LOOM_NCCL_CUDA(c.get(), "group_create", cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
      LOOM_NCCL_CUDA(c.get(), "group_create", cudaEventCreateWithFlags(&c->ready, cudaEventDisableTiming));
      LOOM_NCCL_CUDA(c.get(), "group_create", cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming));
      c->name = "loom:" + kind;
      ncclConfig_t config = comm_config(c->name);
      const ncclResult_t r = ncclCommInitRankConfig(&c->nccl, n, id, c->index, &config);
      if (c->nccl != nullptr && r != ncclSuccess) {
        std::lock_guard<std::mutex> lock(c->handle_mu);
        c->unsettled.insert(c->nccl);
      }
      if (c->nccl == nullptr)
        throw Error("comm/nccl group_create on " + c->where() + ": ncclCommInitRankConfig failed: " +
                        ncclGetErrorString(r),
                    LOOM_CODE_INTERNAL);
      // Channels for point to point (groups named in the option p2p_groups): to and
      // from each ring neighbour (the members before and after this one: pipeline
      // stages talk to those only), one per tag parity. Other peers use the
      // group's communicator. All inits are issued before any is waited for, so
      // members may create them in any order.
      std::vector<std::pair<Channel*, ncclResult_t>> channel_inits;
      if (p2p) {
        // The send copies come from the GPU's default pool: keep what it has
        // reserved instead of returning it at every synchronisation.
        cudaMemPool_t pool = nullptr;
        uint64_t keep = UINT64_MAX;
        if (cudaDeviceGetDefaultMemPool(&pool, c->gpu) == cudaSuccess)
          cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
        cudaGetLastError();
      }
      for (int src = 0; p2p && src < n; ++src)
        for (int dst = 0; dst < n; ++dst) {
          if (src == dst || (c->index != src && c->index != dst)) continue;
          if (dst != (src + 1) % n && src != (dst + 1) % n) continue;  // not neighbours
          for (int parity = 0; parity < 2; ++parity) {
            auto ch = std::make_unique<Channel>();
            Channel* chp = ch.get();
            ch->sender = c->index == src;
            const int slot = ch->sender ? 0 : 1;
            const int peer = ch->sender ? dst : src;
            // Owned by the Comm from here on, so the catch below releases it.
            (ch->sender ? c->to : c->from)[{peer, parity}] = std::move(ch);
            const std::string label = kind + " p2p " + std::to_string(src) + ">" + std::to_string(dst) +
                                      (parity ? " odd" : " even");
            const ncclUniqueId cid = shared_id(w, *c, label, {c->ranks[src], c->ranks[dst]}, slot);
            LOOM_NCCL_CUDA(c.get(), "group_create", cudaStreamCreateWithFlags(&chp->stream, cudaStreamNonBlocking));
            LOOM_NCCL_CUDA(c.get(), "group_create", cudaEventCreateWithFlags(&chp->ready, cudaEventDisableTiming));
            LOOM_NCCL_CUDA(c.get(), "group_create", cudaEventCreateWithFlags(&chp->done, cudaEventDisableTiming));
            chp->name = "loom:" + label;
            ncclConfig_t cc = comm_config(chp->name);
            const ncclResult_t cr = ncclCommInitRankConfig(&chp->nccl, 2, cid, slot, &cc);
            if (chp->nccl != nullptr && cr != ncclSuccess) {
              std::lock_guard<std::mutex> lock(c->handle_mu);
              c->unsettled.insert(chp->nccl);
            }
            if (chp->nccl == nullptr)
              throw Error("comm/nccl group_create on " + c->where() + ": ncclCommInitRankConfig (" + label +
                              ") failed: " + ncclGetErrorString(cr),
                          LOOM_CODE_INTERNAL);
            channel_inits.emplace_back(chp, cr);
          }
        }
      {
        std::lock_guard<std::mutex> lock(w.mu);
        if (w.aborted.load()) {
          // abort() has run without this Comm: fail like the others.
        } else {
          w.comms.push_back(c.get());  // from here on, abort reaches it
        }
      }
      if (w.aborted.load()) fail_aborted(*c, "group_create");
      wait_on(*c, c->nccl, "group_create", "ncclCommInitRankConfig", r);
      for (auto& [ch, cr] : channel_inits)
        wait_on(*c, ch->nccl, "group_create", "ncclCommInitRankConfig (p2p channel)", cr);
      connect(*c);
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(w.mu);
        auto it = std::find(w.comms.begin(), w.comms.end(), c.get());
        if (it != w.comms.end()) w.comms.erase(it);
      }
      abort_handles(*c);
      GpuScope gpu(*c, "group_create");
      destroy_comm_resources(*c);
      throw;
    }
    *out = reinterpret_cast<loom_comm*>(c.release());
  });
}

void group_destroy(loom_comm* comm) {
  (void)guard([&] {
    if (comm == nullptr) return;
    Comm* c = reinterpret_cast<Comm*>(comm);
    World& w = *c->world;
    {
      std::lock_guard<std::mutex> lock(w.mu);  // neither the watchdog nor abort() sees it after this
      auto it = std::find(w.comms.begin(), w.comms.end(), c);
      if (it != w.comms.end()) w.comms.erase(it);
    }
    int prev = -1;
    cudaGetDevice(&prev);
    cudaSetDevice(c->gpu);
    if (!c->aborted.load() && !w.aborted.load()) {
      // Flush (collective over the group), then free; a group whose other members
      // are gone is aborted after the timeout instead.
      // Every finalize is issued before any is waited for: members may take their
      // handles in different orders (a sender's channel first on one side, the
      // receiver's on the other), and a finalize may wait for its peers.
      try {
        std::vector<std::pair<ncclComm_t*, ncclResult_t>> finalizing;
        for (ncclComm_t* h : c->handles())
          if (*h) finalizing.emplace_back(h, locked(*c, *h, "group_destroy", [&] { return ncclCommFinalize(*h); }));
        for (auto& [h, r] : finalizing) wait_on(*c, *h, "group_destroy", "ncclCommFinalize", r);
        for (auto& [h, r] : finalizing) {
          LOOM_NCCL_ON(*c, *h, "group_destroy", ncclCommDestroy(*h));
          std::lock_guard<std::mutex> lock(c->handle_mu);
          c->unsettled.erase(*h);
          *h = nullptr;  // destroyed: never aborted below
        }
      } catch (const std::exception& e) {
        LOOM_LOG(WARNING) << e.what();
      }
    }
    abort_handles(*c);  // whatever is still live (after an abort or a failed flush)
    destroy_comm_resources(*c);
    if (prev >= 0) cudaSetDevice(prev);
    c->destroyed = true;
    delete c;
  });
}

// ---------------------------------------------------------------------------
// Collectives and point to point
// ---------------------------------------------------------------------------

size_t bytes_of(size_t count, int32_t dtype) { return count * loom::dtype_size(dtype); }

void do_all_reduce(Comm& c, void* stream, const void* send, void* recv, size_t count, int32_t dtype, int32_t op,
                   cudaEvent_t started = nullptr) {
  const ncclDataType_t t = nccl_type(dtype, "all_reduce");
  const ncclRedOp_t o = nccl_op(op, "all_reduce");
  if (count == 0) return;
  Call call{"all_reduce", describe("all_reduce", count, dtype), send, bytes_of(count, dtype), recv,
            bytes_of(count, dtype)};
  run(c, stream, call, [&](const void* s, void* r) {
    LOOM_NCCL(c, "all_reduce", ncclAllReduce(s, r, count, t, o, c.nccl, c.stream));
  }, started);
}

void do_all_gather(Comm& c, void* stream, const void* send, void* recv, size_t count, int32_t dtype,
                   cudaEvent_t started = nullptr) {
  const ncclDataType_t t = nccl_type(dtype, "all_gather");
  if (count == 0) return;
  Call call{"all_gather", describe("all_gather", count, dtype), send, bytes_of(count, dtype), recv,
            bytes_of(count * c.ranks.size(), dtype), false};
  run(c, stream, call, [&](const void* s, void* r) {
    LOOM_NCCL(c, "all_gather", ncclAllGather(s, r, count, t, c.nccl, c.stream));
  }, started);
}

void do_reduce_scatter(Comm& c, void* stream, const void* send, void* recv, size_t count, int32_t dtype,
                       int32_t op, cudaEvent_t started = nullptr) {
  const ncclDataType_t t = nccl_type(dtype, "reduce_scatter");
  const ncclRedOp_t o = nccl_op(op, "reduce_scatter");
  if (count == 0) return;
  Call call{"reduce_scatter", describe("reduce_scatter", count, dtype), send,
            bytes_of(count * c.ranks.size(), dtype), recv, bytes_of(count, dtype), false};
  run(c, stream, call, [&](const void* s, void* r) {
    LOOM_NCCL(c, "reduce_scatter", ncclReduceScatter(s, r, count, t, o, c.nccl, c.stream));
  }, started);
}

loom_status all_reduce(loom_comm* comm, void* stream, const void* send, void* recv, size_t count, int32_t dtype,
                       int32_t op) {
  return guard([&] { do_all_reduce(comm_of(comm), stream, send, recv, count, dtype, op); });
}

loom_status all_gather(loom_comm* comm, void* stream, const void* send, void* recv, size_t count, int32_t dtype) {
  return guard([&] { do_all_gather(comm_of(comm), stream, send, recv, count, dtype); });
}

loom_status reduce_scatter(loom_comm* comm, void* stream, const void* send, void* recv, size_t count, int32_t dtype,
                           int32_t op) {
  return guard([&] { do_reduce_scatter(comm_of(comm), stream, send, recv, count, dtype, op); });
}

// Point to point (defined below).
Channel* channel(Comm& c, bool to, int32_t peer, int32_t tag);
void refuse_capture(Comm& c, const char* op, cudaStream_t caller);
void post_channel_recv(Comm& c, Channel& ch, cudaStream_t caller, void* target, size_t count, ncclDataType_t t,
                       const std::string& what, cudaEvent_t done);
loom_status send(loom_comm* comm, void* stream, const void* buf, size_t count, int32_t dtype, int32_t peer,
                 int32_t tag);

// ABI 1.15: the collective is enqueued on the comm stream (after the caller's
// stream, as any call) and the caller's stream goes on; its event is the request.
// NCCL already runs every operation on the comm stream, so the blocking calls differ
// only in making the caller's stream wait at once. Host buffers complete in start.
// ABI 1.17: a started send is sent at start (sends never wait for the receiver);
// a started receive of device memory from a channel peer, on a stream, is enqueued
// on the channel at start, so NCCL moves the data while the caller's stream
// computes, and the wait orders the caller's stream after it. Other receives (host
// memory, peers without a channel, no stream) are refused with
// LOOM_CODE_UNSUPPORTED: the engine receives them at their wait, in posting order.
struct Started {
  cudaEvent_t done = nullptr;
};

void start_channel_recv(Comm& c, void* stream, const loom_collective& col, cudaEvent_t done) {
  LOOM_REQUIRE(col.peer >= 0 && col.peer < static_cast<int32_t>(c.ranks.size()) && col.peer != c.index,
               "comm/nccl recv: peer " << col.peer << " is not another rank of the group of " << c.ranks.size());
  const ncclDataType_t t = nccl_type(col.dtype, "recv");
  LOOM_REQUIRE(col.count == 0 || col.recv != nullptr, "comm/nccl recv: buffer is NULL for " << col.count << " elements");
  Channel* ch = channel(c, false, col.peer, col.tag);
  if (ch == nullptr || col.count == 0 || is_host_memory(col.recv) || stream == nullptr)
    throw Error("comm/nccl: a receive " +
                    std::string(ch == nullptr ? "from a peer without a channel"
                                : col.count == 0 ? "of nothing"
                                : stream == nullptr ? "without a stream"
                                                    : "into host memory") +
                    " is not posted early (received at its wait)",
                LOOM_CODE_UNSUPPORTED);
  std::lock_guard<std::mutex> lock(c.call_mu);
  check_alive(c, "recv");
  GpuScope gpu(c, "recv");
  const cudaStream_t caller = static_cast<cudaStream_t>(stream);
  refuse_capture(c, "recv", caller);
  post_channel_recv(c, *ch, caller, col.recv, col.count, t,
                    describe("recv", col.count, col.dtype) + " from " + std::to_string(col.peer), done);
}

loom_status start(loom_comm* comm, void* stream, const loom_collective* col, loom_comm_request** req) {
  return guard([&] {
    LOOM_REQUIRE(col != nullptr && req != nullptr && LOOM_HAS_SLOT(col, loom_collective, op),
                 "comm/nccl: start needs a loom_collective and a request");
    Comm& c = comm_of(comm);
    auto r = std::make_unique<Started>();
    {
      GpuScope gpu(c, "start");
      // Recorded only where the request's work is enqueued: an event never recorded
      // is complete to cudaEventQuery and cudaStreamWaitEvent, so a request that
      // finished in start (host buffers, count 0, a send without a stream) waits for
      // nothing, not for the comm stream's unrelated started collectives.
      LOOM_NCCL_CUDA(&c, "start", cudaEventCreateWithFlags(&r->done, cudaEventDisableTiming));
    }
    struct Destroy {
      Started* s;
      ~Destroy() {
        if (s && s->done) cudaEventDestroy(s->done);
      }
    } on_failure{r.get()};
    switch (col->kind) {
      case LOOM_COLLECTIVE_ALL_REDUCE:
        do_all_reduce(c, stream, col->send, col->recv, col->count, col->dtype, col->op, r->done);
        break;
      case LOOM_COLLECTIVE_ALL_GATHER:
        do_all_gather(c, stream, col->send, col->recv, col->count, col->dtype, r->done);
        break;
      case LOOM_COLLECTIVE_REDUCE_SCATTER:
        do_reduce_scatter(c, stream, col->send, col->recv, col->count, col->dtype, col->op, r->done);
        break;
      case LOOM_COLLECTIVE_SEND:
      case LOOM_COLLECTIVE_RECV: {
        LOOM_REQUIRE(LOOM_HAS_SLOT(col, loom_collective, tag),
                     "comm/nccl: a started send or receive needs a loom_collective of ABI 1.17 or later");
        const loom_collective p2p = copy_of(*col);
        if (p2p.kind == LOOM_COLLECTIVE_RECV) {
          start_channel_recv(c, stream, p2p, r->done);
          break;
        }
        loom::check(send(comm, stream, p2p.send, p2p.count, p2p.dtype, p2p.peer, p2p.tag));
        // The wait orders the caller's stream after what the send enqueued on it.
        if (stream != nullptr) {
          GpuScope gpu(c, "send");
          LOOM_NCCL_CUDA(&c, "send", cudaEventRecord(r->done, static_cast<cudaStream_t>(stream)));
        }
        break;
      }
      default:
        LOOM_REQUIRE(false, "comm/nccl: start of an unknown collective kind " << col->kind);
    }
    on_failure.s = nullptr;
    *req = reinterpret_cast<loom_comm_request*>(r.release());
  });
}

loom_status wait(loom_comm* comm, loom_comm_request* req, void* stream) {
  return guard([&] {
    LOOM_REQUIRE(req != nullptr, "comm/nccl: wait without a request");
    std::unique_ptr<Started> r(reinterpret_cast<Started*>(req));
    struct Destroy {
      cudaEvent_t e;
      ~Destroy() { cudaEventDestroy(e); }
    } destroy{r->done};
    Comm& c = comm_of(comm);
    GpuScope gpu(c, "wait");
    if (stream != nullptr)
      LOOM_NCCL_CUDA(&c, "wait", cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), r->done, 0));
    else
      host_wait(c, "wait", r->done);  // the watchdog's timeout applies
  });
}

// All-to-all as grouped send/recv pairs (block i to rank i, block j from rank j).
loom_status all_to_all_v(loom_comm* comm, void* stream, const void* send, const size_t* send_counts,
                         const size_t* send_displs, void* recv, const size_t* recv_counts, const size_t* recv_displs,
                         int32_t dtype) {
  return guard([&] {
    Comm& c = comm_of(comm);
    const ncclDataType_t t = nccl_type(dtype, "all_to_all_v");
    const size_t n = c.ranks.size(), es = loom::dtype_size(dtype);
    LOOM_REQUIRE(send_counts && send_displs && recv_counts && recv_displs,
                 "comm/nccl all_to_all_v: counts and displacements must not be NULL");
    size_t send_end = 0, recv_end = 0;
    for (size_t i = 0; i < n; ++i) {
      send_end = std::max(send_end, send_displs[i] + send_counts[i]);
      recv_end = std::max(recv_end, recv_displs[i] + recv_counts[i]);
    }
    Call call{"all_to_all_v", describe("all_to_all_v", send_end, dtype), send, send_end * es, recv, recv_end * es,
              false};
    run(c, stream, call, [&](const void* s, void* r) {
      // The whole NCCL group under the handle lock, and always closed: a group left
      // open would queue every later NCCL call of this thread.
      ncclResult_t res = ncclSuccess;
      bool aborted = false;
      {
        std::lock_guard<std::mutex> lock(c.handle_mu);
        aborted = c.aborted.load() || c.nccl == nullptr;
        if (!aborted) res = ncclGroupStart();
        if (!aborted && res == ncclSuccess) {
          for (size_t i = 0; i < n && res == ncclSuccess; ++i) {
            if (send_counts[i] > 0)
              res = ncclSend(static_cast<const char*>(s) + send_displs[i] * es, send_counts[i], t,
                             static_cast<int>(i), c.nccl, c.stream);
            if (res == ncclSuccess && recv_counts[i] > 0)
              res = ncclRecv(static_cast<char*>(r) + recv_displs[i] * es, recv_counts[i], t, static_cast<int>(i),
                             c.nccl, c.stream);
          }
          const ncclResult_t e = ncclGroupEnd();
          if (res == ncclSuccess) res = e;
          if (res != ncclSuccess) c.unsettled.insert(c.nccl);
        }
      }
      if (aborted) fail_aborted(c, "all_to_all_v");
      wait_on(c, c.nccl, "all_to_all_v", "ncclSend/ncclRecv group", res);
    });
  });
}

loom_status all_to_all(loom_comm* comm, void* stream, const void* send, void* recv, size_t count, int32_t dtype) {
  return guard([&] {
    Comm& c = comm_of(comm);
    const size_t n = c.ranks.size();
    std::vector<size_t> counts(n, count), displs(n);
    for (size_t i = 0; i < n; ++i) displs[i] = i * count;
    check(all_to_all_v(comm, stream, send, counts.data(), displs.data(), recv, counts.data(), displs.data(), dtype));
  });
}

loom_status broadcast(loom_comm* comm, void* stream, void* buf, size_t count, int32_t dtype, int32_t root) {
  return guard([&] {
    Comm& c = comm_of(comm);
    const ncclDataType_t t = nccl_type(dtype, "broadcast");
    LOOM_REQUIRE(root >= 0 && root < static_cast<int32_t>(c.ranks.size()),
                 "comm/nccl broadcast: root " << root << " is outside the group of " << c.ranks.size());
    if (count == 0) return;
    Call call{"broadcast", describe("broadcast", count, dtype), buf, bytes_of(count, dtype), buf,
              bytes_of(count, dtype)};
    run(c, stream, call, [&](const void* s, void* r) {
      LOOM_NCCL(c, "broadcast", ncclBroadcast(s, r, count, t, root, c.nccl, c.stream));
    });
  });
}

// A one-element all-reduce, waited for on the host.
loom_status barrier(loom_comm* comm) {
  return guard([&] {
    Comm& c = comm_of(comm);
    if (c.ranks.size() == 1) return;
    float token = 0.0f;
    Call call{"barrier", "barrier", &token, sizeof(float), &token, sizeof(float)};
    run(c, nullptr, call, [&](const void* s, void* r) {
      LOOM_NCCL(c, "barrier", ncclAllReduce(s, r, 1, ncclFloat32, ncclSum, c.nccl, c.stream));
    });
  });
}

// Point to point. On a group with channels (option p2p_groups, "pp" by default)
// a send to a ring neighbour copies the buffer on the caller's stream into a
// stream-ordered allocation and returns; the channel's stream sends it when the
// peer receives and frees it, so the caller's stream never waits for the receiver
// (the ABI's "send never blocks") and may reuse the buffer at once. A recv is
// ordered after the caller's stream and before its later work. Messages of one
// (peer, tag parity) are matched in the order they are sent.
// Other peers and groups: NCCL's own semantics on the group's communicator (the
// send blocks the caller's stream until the peer receives).
Channel* channel(Comm& c, bool to, int32_t peer, int32_t tag) {
  auto& m = to ? c.to : c.from;
  const auto it = m.find({peer, tag & 1});
  return it == m.end() ? nullptr : it->second.get();
}

void refuse_capture(Comm& c, const char* op, cudaStream_t caller) {
  if (caller == nullptr) return;
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  LOOM_NCCL_CUDA(&c, op, cudaStreamIsCapturing(caller, &st));
  if (st != cudaStreamCaptureStatusNone)
    throw Error(std::string("comm/nccl ") + op + " on " + c.where() +
                    ": point to point inside a graph capture is not supported (channels stage their messages)",
                LOOM_CODE_UNSUPPORTED);
}

loom_status send(loom_comm* comm, void* stream, const void* buf, size_t count, int32_t dtype, int32_t peer,
                 int32_t tag) {
  return guard([&] {
    Comm& c = comm_of(comm);
    const ncclDataType_t t = nccl_type(dtype, "send");
    LOOM_REQUIRE(peer >= 0 && peer < static_cast<int32_t>(c.ranks.size()) && peer != c.index,
                 "comm/nccl send: peer " << peer << " is not another rank of the group of " << c.ranks.size());
    if (count == 0) return;
    LOOM_REQUIRE(buf != nullptr, "comm/nccl send: buffer is NULL for " << count << " elements");
    const std::string what = describe("send", count, dtype) + " to " + std::to_string(peer);
    Channel* ch = channel(c, true, peer, tag);
    if (ch == nullptr) {
      Call call{"send", what, buf, bytes_of(count, dtype), nullptr, 0};
      run(c, stream, call,
          [&](const void* s, void*) { LOOM_NCCL(c, "send", ncclSend(s, count, t, peer, c.nccl, c.stream)); });
      return;
    }
    std::lock_guard<std::mutex> lock(c.call_mu);
    check_alive(c, "send");
    GpuScope gpu(c, "send");
    const cudaStream_t caller = static_cast<cudaStream_t>(stream);
    refuse_capture(c, "send", caller);
    const size_t bytes = bytes_of(count, dtype);
    // The copy lives from the caller's stream (or the channel's) until the send has
    // left: stream-ordered allocation, so the pipeline's in-flight sends bound it.
    void* copy = nullptr;
    if (is_host_memory(buf)) {
      LOOM_NCCL_CUDA(&c, "send", cudaMallocAsync(&copy, bytes, ch->stream));
      LOOM_NCCL_CUDA(&c, "send", cudaMemcpyAsync(copy, buf, bytes, cudaMemcpyHostToDevice, ch->stream));
    } else if (caller != nullptr) {
      LOOM_NCCL_CUDA(&c, "send", cudaMallocAsync(&copy, bytes, caller));
      LOOM_NCCL_CUDA(&c, "send", cudaMemcpyAsync(copy, buf, bytes, cudaMemcpyDeviceToDevice, caller));
      LOOM_NCCL_CUDA(&c, "send", cudaEventRecord(ch->ready, caller));
      LOOM_NCCL_CUDA(&c, "send", cudaStreamWaitEvent(ch->stream, ch->ready, 0));
    } else {
      // No stream: the buffer may be reused once this returns, so the copy must have
      // run (the device is idle after the synchronize, so this waits for the copy only).
      LOOM_NCCL_CUDA(&c, "send", cudaDeviceSynchronize());
      LOOM_NCCL_CUDA(&c, "send", cudaMallocAsync(&copy, bytes, ch->stream));
      LOOM_NCCL_CUDA(&c, "send", cudaMemcpyAsync(copy, buf, bytes, cudaMemcpyDeviceToDevice, ch->stream));
      LOOM_NCCL_CUDA(&c, "send", cudaEventRecord(ch->done, ch->stream));
      host_wait(c, "send", ch->done);
    }
    try {
      LOOM_NCCL_ON(c, ch->nccl, "send", ncclSend(copy, count, t, 1, ch->nccl, ch->stream));
    } catch (...) {
      cudaFreeAsync(copy, ch->stream);
      throw;
    }
    LOOM_NCCL_CUDA(&c, "send", cudaFreeAsync(copy, ch->stream));
    track(c, "send", what, ch->stream);
  });
}

// Enqueues a receive on the channel's stream after the work already on `caller`
// (if any) and records `done` after it; the caller holds call_mu.
void post_channel_recv(Comm& c, Channel& ch, cudaStream_t caller, void* target, size_t count, ncclDataType_t t,
                       const std::string& what, cudaEvent_t done) {
  if (caller != nullptr) {
    LOOM_NCCL_CUDA(&c, "recv", cudaEventRecord(ch.ready, caller));
    LOOM_NCCL_CUDA(&c, "recv", cudaStreamWaitEvent(ch.stream, ch.ready, 0));
  }
  LOOM_NCCL_ON(c, ch.nccl, "recv", ncclRecv(target, count, t, 0, ch.nccl, ch.stream));
  track(c, "recv", what, ch.stream);
  LOOM_NCCL_CUDA(&c, "recv", cudaEventRecord(done, ch.stream));
}

loom_status recv(loom_comm* comm, void* stream, void* buf, size_t count, int32_t dtype, int32_t peer,
                 int32_t tag) {
  return guard([&] {
    Comm& c = comm_of(comm);
    const ncclDataType_t t = nccl_type(dtype, "recv");
    LOOM_REQUIRE(peer >= 0 && peer < static_cast<int32_t>(c.ranks.size()) && peer != c.index,
                 "comm/nccl recv: peer " << peer << " is not another rank of the group of " << c.ranks.size());
    if (count == 0) return;
    LOOM_REQUIRE(buf != nullptr, "comm/nccl recv: buffer is NULL for " << count << " elements");
    const std::string what = describe("recv", count, dtype) + " from " + std::to_string(peer);
    Channel* ch = channel(c, false, peer, tag);
    if (ch == nullptr) {
      Call call{"recv", what, nullptr, 0, buf, bytes_of(count, dtype)};
      run(c, stream, call,
          [&](const void*, void* r) { LOOM_NCCL(c, "recv", ncclRecv(r, count, t, peer, c.nccl, c.stream)); });
      return;
    }
    std::lock_guard<std::mutex> lock(c.call_mu);
    check_alive(c, "recv");
    GpuScope gpu(c, "recv");
    const cudaStream_t caller = static_cast<cudaStream_t>(stream);
    refuse_capture(c, "recv", caller);
    const size_t bytes = bytes_of(count, dtype);
    const bool host = is_host_memory(buf);
    void* target = buf;
    if (host) {
      if (c.staging_bytes < bytes) {
        // The comm stream's last use of the staging buffer (recorded afresh, see run()).
        LOOM_NCCL_CUDA(&c, "recv", cudaEventRecord(c.done, c.stream));
        host_wait(c, "recv", c.done);
        if (c.staging) cudaFree(c.staging);
        c.staging = nullptr;
        c.staging_bytes = 0;
        LOOM_NCCL_CUDA(&c, "recv", cudaMalloc(&c.staging, std::max<size_t>(bytes, 1 << 16)));
        c.staging_bytes = std::max<size_t>(bytes, 1 << 16);
      }
      target = c.staging;
    }
    if (caller == nullptr && !host) LOOM_NCCL_CUDA(&c, "recv", cudaDeviceSynchronize());
    post_channel_recv(c, *ch, caller, target, count, t, what, ch->done);
    if (caller != nullptr) LOOM_NCCL_CUDA(&c, "recv", cudaStreamWaitEvent(caller, ch->done, 0));
    if (caller == nullptr || host) host_wait(c, "recv", ch->done);  // with the timeout
    // Into pageable memory only once received (such a copy returns when done).
    if (host) LOOM_NCCL_CUDA(&c, "recv", cudaMemcpyAsync(buf, target, bytes, cudaMemcpyDeviceToHost, ch->stream));
  });
}

// "2.28.9" from an NCCL_VERSION_CODE: X*10000 + Y*100 + Z since 2.9, X*1000 + Y*100 + Z before.
std::string nccl_version_name(int code) {
  const int base = code >= 10000 ? 10000 : 1000;
  return std::to_string(code / base) + "." + std::to_string(code % base / 100) + "." + std::to_string(code % 100);
}

// Refuses an NCCL library older than the header this was compiled with (functions the
// header declares may be missing, structs may be smaller, behaviour differs): the
// header of one install and the library of another is how "undefined reference to
// ncclCommRevoke" happened at link time; at run time it is LD_LIBRARY_PATH or the
// system's libnccl.so.2 winning over the rpath. A newer library is fine (NCCL keeps its
// ABI within major version 2).
void require_runtime_nccl() {
  int runtime = 0;
  const ncclResult_t r = ncclGetVersion(&runtime);
  if (r != ncclSuccess)
    throw Error(std::string("comm/nccl: ncclGetVersion failed: ") + ncclGetErrorString(r), LOOM_CODE_INTERNAL);
  if (runtime >= NCCL_VERSION_CODE) return;
  Dl_info info{};
  const std::string where = dladdr(reinterpret_cast<void*>(&ncclGetVersion), &info) && info.dli_fname
                                ? std::string(info.dli_fname)
                                : std::string("libnccl.so.2");
  throw Error("comm/nccl: the NCCL library loaded at run time (" + where + ") is NCCL " +
                  nccl_version_name(runtime) + ", older than NCCL " + nccl_version_name(NCCL_VERSION_CODE) +
                  " whose nccl.h this plugin was compiled with; put an NCCL >= " +
                  nccl_version_name(NCCL_VERSION_CODE) +
                  " first on LD_LIBRARY_PATH (PyTorch's nvidia-nccl wheel: site-packages/nvidia/nccl/lib), or "
                  "rebuild loom against the NCCL it is to run with (-DLOOM_NCCL_ROOT=<its prefix>)",
              LOOM_CODE_UNSUPPORTED);
}

const loom_comm_api* comm_api() {
  static const loom_comm_api api = [] {
    loom_comm_api a = make<loom_comm_api>();
    a.world_create = world_create;
    a.world_destroy = world_destroy;
    a.group_create = group_create;
    a.group_destroy = group_destroy;
    a.all_reduce = all_reduce;
    a.all_gather = all_gather;
    a.reduce_scatter = reduce_scatter;
    a.all_to_all = all_to_all;
    a.all_to_all_v = all_to_all_v;
    a.broadcast = broadcast;
    a.barrier = barrier;
    a.send = send;
    a.recv = recv;
    a.start = start;
    a.wait = wait;
    a.world_abort = world_abort;
    a.features = LOOM_COMM_THREADS | LOOM_COMM_PROCESSES | LOOM_COMM_DEVICE_BUFFERS | LOOM_COMM_START_P2P;
    return a;
  }();
  return &api;
}

// The library's plugin, once the NCCL found at run time passed the version check (a
// refusal fails the library's load: "loom_comm_nccl.so: plugin initialisation failed:
// ...", which a run asking for comm.backend = "nccl" shows as its note).
PluginDefPtr plugin_def() {
  require_runtime_nccl();
  return raw_plugin("comm", "nccl", "1.2.0",
                    "NCCL collectives on GPUs, one GPU per rank (ranks as threads of one process, or "
                    "one process per rank under mpirun/srun with the NCCL ids over MPI); "
                    "stream-ordered, with a watchdog that aborts a hung collective",
                    LOOM_API_COMM, comm_api(),
                    {opt_string("p2p_groups", "pp",
                                "comma-separated group kinds whose send/recv get one channel "
                                "per ordered pair of ranks (a send never waits for the "
                                "receiver); other groups use NCCL's blocking send/recv"),
                     opt_bool("abort_on_failure", true,
                              "one process per rank: after a failed run, call MPI_Abort at "
                              "process exit so no process of the job keeps waiting")});
}

}  // namespace
}  // namespace loom::comm_nccl

LOOM_PLUGIN_LIBRARY(loom::comm_nccl::plugin_def())
