// comm/mpi: the receives a member started without waiting (loom_comm_api.start
// with LOOM_COLLECTIVE_RECV, ABI 1.17). A thread of the member's own polls MPI for
// them, so a message moves into its buffer while the caller computes, as a pipeline
// stage's next input does under Megatron-LM's overlap_p2p_comm.
//
// Order: the receives of one (peer, tag) take that peer's messages in the order
// they were posted; receives of different pairs never wait for each other. Once a
// member has started a receive, its blocking receives are posted here too (and
// waited for at once), so they keep their place in that order.
//
// Every posted receive ends: with its message, with the group's receive timeout
// (the world's timeout from its wait, as comm/local's, and a blocking receive's from
// its call; the group is then poisoned), with the failure of another call that
// poisoned the group, with the world's abort, or, if the member is destroyed with it
// pending, with an error.
#pragma once

#include "group.hpp"

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <future>
#include <mutex>
#include <thread>

namespace loom::comm_mpi {

class Receiver {
 public:
  explicit Receiver(Group& group) : group_(group), world_(group.world()) {}
  ~Receiver();  // fails what is still pending, then joins the thread
  Receiver(const Receiver&) = delete;
  Receiver& operator=(const Receiver&) = delete;

  // Posts a receive (the thread starts on first use); the future holds its outcome.
  // The arguments are checked before (Group::check_recv).
  struct Ticket {
    std::future<void> done;
    uint64_t id = 0;
  };
  Ticket post(void* buf, size_t count, int32_t dtype, int32_t peer, int32_t tag);
  // The caller now waits for receive `id`: its timeout counts from here.
  void waiting(uint64_t id);

 private:
  struct Posted {
    uint64_t id;
    void* buf;
    size_t count;
    int32_t dtype;
    int32_t peer;
    int32_t tag;
    Clock::time_point deadline;
    std::promise<void> done;
  };

  void run();
  // With mpi_mutex() held: completes what it can, keeping each pair's order. true
  // when it completed one, when a wait gave a receive an earlier deadline than the
  // running poll's (the poll must take it up), or when it must stop.
  bool serve_locked();
  void fail_all(const std::exception_ptr& e);  // mu_ held

  Group& group_;
  World& world_;
  std::mutex mu_;  // taken inside mpi_mutex(), never around it
  std::condition_variable cv_;
  std::deque<Posted> pending_;  // posting order
  Clock::time_point polling_until_ = Clock::time_point::max();  // the deadline the running poll has
  uint64_t next_id_ = 0;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace loom::comm_mpi
