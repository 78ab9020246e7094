// device/cuda: the caching allocator (see cuda_device.hpp for the rules).
#include <algorithm>
#include <sstream>

#include "cuda_device.hpp"

namespace loom::cuda {

namespace {
constexpr size_t kSmall = size_t{1} << 20;      // below: round to 512 B
constexpr size_t kLargeRound = size_t{2} << 20;  // above: round to 2 MiB
}  // namespace

size_t Allocator::round_size(size_t bytes) {
  if (bytes < kSmall) return std::max<size_t>(512, (bytes + 511) / 512 * 512);
  return (bytes + kLargeRound - 1) / kLargeRound * kLargeRound;
}

Allocator::~Allocator() {
  // The device destroys the allocator after synchronising; leaked live blocks are
  // reported by the device and freed here with the cache.
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [p, b] : live_) {
    if (b.freed) cudaEventDestroy(b.freed);
    cudaFree(p);
  }
  cudaGetLastError();  // a failure while tearing down is not a later op's
  live_.clear();
  for (const Block& b : deferred_frees_) cudaFree(b.ptr);
  deferred_frees_.clear();
  graphs_alive_ = 0;
  captures_ = 0;
  release_cached_locked();
  for (cudaEvent_t e : spare_events_) cudaEventDestroy(e);
  spare_events_.clear();
}

// nullptr when no event can be made. Never throws: release() runs in Scratch's
// destructor, also while an exception unwinds (a throw there would terminate).
cudaEvent_t Allocator::event_locked() {
  if (!spare_events_.empty()) {
    cudaEvent_t e = spare_events_.back();
    spare_events_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return e;
}

// Best fit among cached blocks no more than 1/4 (small: 2x) larger than asked.
bool Allocator::take_cached(size_t rounded, cudaStream_t stream, bool graph_pool, Block* out) {
  auto& pool = graph_pool ? free_graph_ : free_general_;
  const size_t limit = rounded < kSmall ? 2 * rounded : rounded + rounded / 4;
  for (auto it = pool.lower_bound(rounded); it != pool.end() && it->first <= limit; ++it) {
    Block& b = it->second;
    bool ok = b.stream == stream || b.stream == nullptr;
    // Another stream's block once its free has completed on the GPU; never from
    // the graph pool, and not while this device captures (no event queries then).
    if (!ok && !graph_pool && captures_ == 0 && b.freed != nullptr) ok = cudaEventQuery(b.freed) == cudaSuccess;
    if (!ok) continue;
    *out = b;
    pool.erase(it);
    if (out->freed) {
      spare_events_.push_back(out->freed);
      out->freed = nullptr;
    }
    return true;
  }
  return false;
}

void* Allocator::allocate(size_t bytes, cudaStream_t stream, bool graph_pool, bool count, const char* op) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t rounded = round_size(bytes);
  Block b;
  if (!caching_ || !take_cached(rounded, stream, graph_pool, &b)) {
    void* p = nullptr;
    cudaError_t err;
    {
      RelaxedCaptureMode relaxed;
      err = cudaMalloc(&p, rounded);
    }
    // Cached blocks can be given back: the general ones, and the graph pool's once
    // no graph is alive.
    const bool cached = !free_general_.empty() || (graphs_alive_ == 0 && !free_graph_.empty());
    if (err == cudaErrorMemoryAllocation && captures_ == 0 && cached) {
      cudaGetLastError();  // clear it, give the cache back, try once more
      release_cached_locked();
      RelaxedCaptureMode relaxed;
      err = cudaMalloc(&p, rounded);
    }
    if (err != cudaSuccess) {
      cudaGetLastError();
      std::ostringstream os;
      os << dev_->who() << " " << op << ": cudaMalloc of " << bytes << " bytes failed: " << cudaGetErrorName(err)
         << " (" << cudaGetErrorString(err) << "); " << stats_.current << " bytes in use, " << stats_.reserved
         << " reserved by loom on this GPU";
      size_t free_b = 0, total_b = 0;
      if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
        os << ", " << free_b << " of " << total_b << " bytes free on the GPU";
      else
        cudaGetLastError();
      throw Error(os.str(), err == cudaErrorMemoryAllocation ? LOOM_CODE_OUT_OF_MEMORY : LOOM_CODE_INTERNAL);
    }
    b.ptr = p;
    b.size = rounded;
    stats_.reserved += rounded;
  }
  b.requested = bytes;
  b.stream = stream;
  b.graph = graph_pool;
  live_.emplace(b.ptr, b);
  stats_.current += bytes;
  stats_.peak = std::max(stats_.peak, stats_.current);
  if (count) stats_.num_allocs += 1;
  return b.ptr;
}

bool Allocator::release(void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(ptr);
  if (it == live_.end()) return false;
  Block b = it->second;
  live_.erase(it);
  stats_.current -= b.requested;
  // A graph-pool block freed while no graph is alive and none is being captured
  // can never be replayed into again: an ordinary block (as device/cpu frees it).
  if (b.graph && graphs_alive_ == 0 && captures_ == 0) b.graph = false;
  if (!caching_ && !b.graph) {
    // Not cached: cudaFree waits for the device, so nothing can still use it.
    // (A graph-pool block is still used by the graph that captured it: it stays in
    // the graph pool, freed with the cache.) Not during a capture, which a
    // device-wide wait would break: then at the capture's end.
    if (captures_ > 0) {
      deferred_frees_.push_back(b);
      return true;
    }
    RelaxedCaptureMode relaxed;
    if (cudaFree(b.ptr) != cudaSuccess) cudaGetLastError();  // not reported against a later op
    stats_.reserved -= b.size;
    return true;
  }
  if (b.graph) {
    free_graph_.emplace(b.size, b);
  } else {
    // Stream-ordered reuse (see the header); no event inside a capture (a record
    // there would become part of the graph) — then only the same stream reuses it.
    if (captures_ == 0 && b.stream != nullptr) {
      b.freed = event_locked();
      if (b.freed != nullptr && cudaEventRecord(b.freed, b.stream) != cudaSuccess) {
        cudaGetLastError();
        spare_events_.push_back(b.freed);
        b.freed = nullptr;
      }
    }
    free_general_.emplace(b.size, b);
  }
  return true;
}

Allocator::Stats Allocator::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

size_t Allocator::live_count() {
  std::lock_guard<std::mutex> lock(mu_);
  return live_.size();
}

void Allocator::graph_created() {
  std::lock_guard<std::mutex> lock(mu_);
  ++graphs_alive_;
}

void Allocator::capture_began() {
  std::lock_guard<std::mutex> lock(mu_);
  ++captures_;
}

void Allocator::capture_ended() {
  std::lock_guard<std::mutex> lock(mu_);
  if (captures_ > 0) --captures_;
  if (captures_ > 0) return;
  for (const Block& b : deferred_frees_) {  // what caching off freed during the capture
    if (cudaFree(b.ptr) != cudaSuccess) cudaGetLastError();
    stats_.reserved -= b.size;
  }
  deferred_frees_.clear();
}

void Allocator::graph_destroyed() {
  std::lock_guard<std::mutex> lock(mu_);
  if (graphs_alive_ > 0) --graphs_alive_;
  if (graphs_alive_ > 0 || captures_ > 0 || free_graph_.empty()) return;
  // No graph can replay any more once the device is idle: the pool's free blocks
  // become ordinary blocks usable by any stream.
  if (cudaDeviceSynchronize() != cudaSuccess) {
    cudaGetLastError();
    return;  // keep them in the graph pool; merged at the next chance
  }
  for (auto& [size, b] : free_graph_) {
    if (!caching_) {  // kept only while a graph could use them (see release)
      RelaxedCaptureMode relaxed;
      if (cudaFree(b.ptr) != cudaSuccess) cudaGetLastError();
      stats_.reserved -= b.size;
      continue;
    }
    Block nb = b;
    nb.graph = false;
    nb.stream = nullptr;
    free_general_.emplace(size, nb);
  }
  free_graph_.clear();
}

void Allocator::release_cached_locked() {
  if (free_general_.empty() && free_graph_.empty()) return;
  cudaDeviceSynchronize();  // cudaFree waits anyway; events may still be pending
  cudaGetLastError();
  // The graph pool's free blocks are still used by the graphs that captured them.
  const bool graphs_idle = graphs_alive_ == 0 && captures_ == 0;
  for (auto* pool : {&free_general_, &free_graph_}) {
    if (pool == &free_graph_ && !graphs_idle) continue;
    for (auto& [size, b] : *pool) {
      if (b.freed) spare_events_.push_back(b.freed);
      cudaFree(b.ptr);
      stats_.reserved -= b.size;
    }
    pool->clear();
  }
  cudaGetLastError();  // a failed free is not reported against a later op
}

bool Allocator::graphs_idle() {
  std::lock_guard<std::mutex> lock(mu_);
  return graphs_alive_ == 0 && captures_ == 0;
}

void Allocator::release_cached_before_first_capture() {
  std::lock_guard<std::mutex> lock(mu_);
  if (graphs_alive_ == 0 && captures_ == 0) release_cached_locked();
}

void Allocator::release_cached() {
  std::lock_guard<std::mutex> lock(mu_);
  if (captures_ > 0) return;
  release_cached_locked();
}

}  // namespace loom::cuda
