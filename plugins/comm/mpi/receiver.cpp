#include "receiver.hpp"

#include <algorithm>
#include <set>
#include <utility>

namespace loom::comm_mpi {

Receiver::~Receiver() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

Receiver::Ticket Receiver::post(void* buf, size_t count, int32_t dtype, int32_t peer, int32_t tag) {
  Ticket t;
  {
    std::lock_guard<std::mutex> lk(mu_);
    // The thread first: a receive queued without one would take a message later for
    // a caller that saw its post fail.
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
    Posted p{next_id_++, buf, count, dtype, peer, tag, Clock::time_point::max(), {}};  // no clock until its wait
    t.done = p.done.get_future();
    t.id = p.id;
    pending_.push_back(std::move(p));
  }
  cv_.notify_all();
  return t;
}

void Receiver::waiting(uint64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  for (Posted& p : pending_)
    if (p.id == id) p.deadline = world_.deadline();
}

void Receiver::fail_all(const std::exception_ptr& e) {
  for (Posted& p : pending_) p.done.set_exception(e);
  pending_.clear();
}

bool Receiver::serve_locked() {
  std::lock_guard<std::mutex> lk(mu_);
  if (stopping_ || pending_.empty()) return true;
  if (std::exception_ptr e = group_.poisoned("recv")) {  // another call failed: nothing more will arrive in order
    fail_all(e);
    return true;
  }
  std::set<std::pair<int32_t, int32_t>> waiting;  // pairs whose older receive is still pending
  bool served = false;
  for (auto it = pending_.begin(); it != pending_.end();) {
    const std::pair<int32_t, int32_t> key{it->peer, it->tag};
    bool got = false;
    if (!waiting.count(key)) {
      try {
        got = group_.take_locked(it->buf, it->count, it->dtype, it->peer, it->tag);
        if (got) it->done.set_value();
      } catch (...) {  // a count or dtype that differs from the send's: this receive fails
        it->done.set_exception(std::current_exception());
        got = true;
      }
    }
    if (got) {
      it = pending_.erase(it);
      served = true;
    } else {
      waiting.insert(key);
      ++it;
    }
  }
  const bool sooner = std::any_of(pending_.begin(), pending_.end(),
                                  [&](const Posted& p) { return p.deadline < polling_until_; });
  return served || sooner;
}

void Receiver::run() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return stopping_ || !pending_.empty(); });
    if (stopping_) {
      fail_all(std::make_exception_ptr(
          Error("comm/mpi: recv on " + group_.label() + ": the group was destroyed before the receive's wait")));
      return;
    }
    Clock::time_point deadline = Clock::time_point::max();
    for (const Posted& p : pending_) deadline = std::min(deadline, p.deadline);
    polling_until_ = deadline;
    lk.unlock();
    bool progressed = false;
    std::exception_ptr failure;
    try {
      progressed = world_.poll(deadline, "comm/mpi: recv on " + group_.label(), [&] { return serve_locked(); });
    } catch (...) {  // the world was aborted
      failure = std::current_exception();
    }
    lk.lock();
    if (!failure && !progressed) {
      // A receive waited past its deadline (unless its wait moved it meanwhile): the
      // group is poisoned, and the receives behind it fail with the same story.
      const auto late = std::find_if(pending_.begin(), pending_.end(),
                                     [&](const Posted& p) { return p.deadline <= Clock::now(); });
      if (late != pending_.end()) failure = std::make_exception_ptr(group_.recv_timeout(late->peer, late->tag));
    }
    if (failure) fail_all(failure);
  }
}

}  // namespace loom::comm_mpi
