// comm/local: the world (every rank is a thread of this process) and the
// rendezvous that turns the members' group_create calls into one shared Group.
//
// Rendezvous: pending groups are keyed by (kind, rank list). A member joins the
// oldest pending group of its key that it has not joined yet (so the n-th
// group_create of a key on every member meets the n-th on the others, however
// calls of different groups interleave). The last member to join completes it;
// the others wait for that, up to the timeout.
#pragma once

#include "group.hpp"

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace loom::comm_local {

class World {
 public:
  static constexpr int64_t kForeverMs = int64_t{100} * 24 * 3600 * 1000;
  // timeout_ms <= 0 (or absurdly large): every wait waits forever.
  // `links`: the modelled network per group kind (empty: ideal links).
  World(int32_t world_size, std::vector<int32_t> local_ranks, int64_t timeout_ms,
        comm_common::LinkModel links = {});
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  // Waits until every member of `ranks` has called join with the same kind and
  // list, then returns the group; *index is the caller's rank in the group.
  std::shared_ptr<Group> join(const std::string& kind, const std::vector<int32_t>& ranks, int32_t my_rank,
                              int* index);

  int64_t timeout_ms() const { return timeout_ms_; }

  // Makes every pending rendezvous and every call on any group of this world fail
  // at once with `reason` (the engine calls it when a rank has failed).
  void abort(const std::string& reason);

 private:
  struct Pending {
    std::shared_ptr<Group> group;
    std::vector<char> joined;
    int count = 0;          // members joined
    bool failed = false;    // a member gave up waiting; error says why
    std::string error;
  };

  const int32_t world_size_;
  const std::vector<int32_t> local_ranks_;
  const int64_t timeout_ms_;
  const comm_common::LinkModel links_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::deque<std::shared_ptr<Pending>>> pending_;
  std::vector<std::weak_ptr<Group>> groups_;  // every group created, for abort
  bool aborted_ = false;
  std::string abort_reason_;
};

}  // namespace loom::comm_local
