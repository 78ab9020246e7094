// The device's thread pool: passive waiting (futex-backed std::atomic::wait),
// dynamic chunk claiming, exceptions carried back to the caller.
#include "cpu_device.hpp"

namespace loom::cpu {

ThreadPool::ThreadPool(int threads) : threads_(std::max(1, threads)) {
  workers_.reserve(static_cast<size_t>(threads_ - 1));
  for (int i = 1; i < threads_; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_release);
  generation_.fetch_add(1, std::memory_order_acq_rel);
  generation_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::run_task_chunks() {
  for (;;) {
    int64_t i = next_chunk_.fetch_add(1, std::memory_order_acq_rel);
    if (i >= chunks_) return;
    try {
      thunk_(ctx_, i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mu_);
      if (!error_) error_ = std::current_exception();
    }
  }
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    generation_.wait(seen, std::memory_order_acquire);
    seen = generation_.load(std::memory_order_acquire);
    if (stop_.load(std::memory_order_acquire)) return;
    run_task_chunks();
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) pending_.notify_all();
  }
}

void ThreadPool::run_impl(int64_t chunks, void* ctx, Thunk thunk) {
  bool expected = false;
  if (!busy_.compare_exchange_strong(expected, true, std::memory_order_acq_rel)) {
    // Another region is running (another thread, or a nested call): run serially.
    for (int64_t i = 0; i < chunks; ++i) thunk(ctx, i);
    return;
  }
  ctx_ = ctx;
  thunk_ = thunk;
  chunks_ = chunks;
  error_ = nullptr;
  next_chunk_.store(0, std::memory_order_relaxed);
  pending_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_acq_rel);
  generation_.notify_all();
  run_task_chunks();
  for (int p = pending_.load(std::memory_order_acquire); p != 0; p = pending_.load(std::memory_order_acquire))
    pending_.wait(p, std::memory_order_acquire);
  std::exception_ptr err = error_;
  error_ = nullptr;
  busy_.store(false, std::memory_order_release);
  if (err) std::rethrow_exception(err);
}

}  // namespace loom::cpu
