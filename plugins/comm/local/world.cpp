#include "world.hpp"

#include <loom/cpp/core.hpp>

#include <algorithm>
#include <chrono>
#include <sstream>

namespace loom::comm_local {

World::World(int32_t world_size, std::vector<int32_t> local_ranks, int64_t timeout_ms, comm_common::LinkModel links)
    : world_size_(world_size),
      local_ranks_(std::move(local_ranks)),
      // <= 0 waits forever; so does anything past ~100 days (keeps deadlines from overflowing).
      timeout_ms_(timeout_ms > 0 && timeout_ms < kForeverMs ? timeout_ms : 0),
      links_(std::move(links)) {}

std::shared_ptr<Group> World::join(const std::string& kind, const std::vector<int32_t>& ranks, int32_t my_rank,
                                   int* index) {
  std::ostringstream list;
  list << "[";
  for (size_t i = 0; i < ranks.size(); ++i) list << (i ? "," : "") << ranks[i];
  list << "]";
  const std::string where = "comm/local: group_create of group '" + kind + "' (ranks " + list.str() + ")";

  LOOM_REQUIRE(!ranks.empty(), where << ": the group has no ranks");
  for (size_t i = 0; i < ranks.size(); ++i) {
    LOOM_REQUIRE(ranks[i] >= 0 && ranks[i] < world_size_,
                 where << ": rank " << ranks[i] << " is outside the world of " << world_size_ << " ranks");
    LOOM_REQUIRE(std::find(ranks.begin(), ranks.begin() + static_cast<std::ptrdiff_t>(i), ranks[i]) ==
                     ranks.begin() + static_cast<std::ptrdiff_t>(i),
                 where << ": rank " << ranks[i] << " is listed twice");
    if (std::find(local_ranks_.begin(), local_ranks_.end(), ranks[i]) == local_ranks_.end()) {
      std::ostringstream os;
      os << where << ": rank " << ranks[i]
         << " is not hosted by this process; comm/local runs every rank as a thread of one process"
            " (use comm/mpi for ranks in several processes)";
      throw Error(os.str(), LOOM_CODE_UNSUPPORTED);
    }
  }
  const auto self = std::find(ranks.begin(), ranks.end(), my_rank);
  LOOM_REQUIRE(self != ranks.end(), where << ": the caller, rank " << my_rank << ", is not a member");
  const int me = static_cast<int>(self - ranks.begin());
  const size_t ume = static_cast<size_t>(me);
  const int size = static_cast<int>(ranks.size());

  std::string key = kind;
  key += '\x1f';
  key += list.str();

  std::unique_lock<std::mutex> lk(mu_);
  if (aborted_) throw Error(where + " refused: the run was aborted: " + abort_reason_, LOOM_CODE_INTERNAL);
  auto& queue = pending_[key];
  std::shared_ptr<Pending> p;
  for (const auto& q : queue) {  // the oldest instance this member has not joined yet
    if (!q->joined[ume]) {
      p = q;
      break;
    }
  }
  if (!p) {
    p = std::make_shared<Pending>();
    p->group = std::make_shared<Group>(kind, ranks, timeout_ms_, links_.link(kind));
    groups_.push_back(p->group);
    p->joined.assign(ranks.size(), 0);
    queue.push_back(p);
  }
  p->joined[ume] = 1;
  ++p->count;
  auto retire = [&] {  // every member has come: nobody will look for it again
    auto& q = pending_[key];
    q.erase(std::find(q.begin(), q.end(), p));
    if (q.empty()) pending_.erase(key);
  };
  if (p->failed) {
    if (p->count == size) retire();
    throw Error(where + " refused: the other members gave up waiting earlier: " + p->error, LOOM_CODE_TIMEOUT);
  }
  if (p->count == size) {
    retire();
    lk.unlock();
    cv_.notify_all();
    *index = me;
    return p->group;
  }

  auto settled = [&] { return p->count == size || p->failed; };
  bool woke = true;
  if (timeout_ms_ <= 0) {
    cv_.wait(lk, settled);
  } else {
    woke = cv_.wait_until(lk, std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms_), settled);
  }
  if (p->count == size && !p->failed) {
    *index = me;
    return p->group;
  }
  if (woke) throw Error(p->error, LOOM_CODE_TIMEOUT);  // another member gave up first

  std::ostringstream os;
  os << "comm/local: group_create on " << p->group->label() << " timed out " << after_text(timeout_ms_) << "; ";
  std::vector<int32_t> missing;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (!p->joined[i]) missing.push_back(ranks[i]);
  }
  os << (missing.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < missing.size(); ++i) os << (i ? ", " : "") << missing[i];
  os << " never joined";
  const std::string message = os.str();
  p->failed = true;
  p->error = message;
  lk.unlock();
  cv_.notify_all();
  throw Error(message, LOOM_CODE_TIMEOUT);
}

void World::abort(const std::string& reason) {
  std::vector<std::shared_ptr<Group>> live;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (aborted_) return;
    aborted_ = true;
    abort_reason_ = reason;
    for (auto& [key, queue] : pending_)
      for (auto& p : queue)
        if (!p->failed) {
          p->failed = true;
          p->error = "comm/local: group_create aborted: " + reason;
        }
    for (const auto& w : groups_)
      if (auto g = w.lock()) live.push_back(std::move(g));
  }
  cv_.notify_all();
  for (auto& g : live) g->abort("comm/local: aborted: " + reason);
}

}  // namespace loom::comm_local
