// A communicator member's own thread for collectives started without waiting
// (loom_comm_api.start, ABI 1.15): tasks run one at a time in the order they were
// submitted, so a member's collectives keep the order its caller made them in,
// while the caller's thread goes on computing. comm/local and comm/mpi share it.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <thread>

namespace loom::comm_common {

class AsyncWorker {
 public:
  AsyncWorker() = default;
  ~AsyncWorker();  // finishes the queued tasks, then joins the thread
  AsyncWorker(const AsyncWorker&) = delete;
  AsyncWorker& operator=(const AsyncWorker&) = delete;

  // Queues `task` behind the earlier ones (the thread starts on first use); the
  // future holds its outcome, an exception included.
  std::future<void> submit(std::function<void()> task);
  // Returns once every task submitted so far has run (before a blocking call on
  // the same member, which must come after them).
  void drain();

 private:
  void run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<void()>> queue_;
  bool busy_ = false, stopping_ = false;
  std::thread thread_;
};

}  // namespace loom::comm_common
