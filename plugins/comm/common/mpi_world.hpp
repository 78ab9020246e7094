// The MPI side of a comm plugin's world — one rank per process, OpenMPI
// underneath. comm/mpi moves its data through it; comm/nccl (ranks in several
// processes) exchanges its NCCL ids through it and relays aborts.
//
// Every MPI call of this plugin is made with mpi_mutex() held (MPI is initialised
// with MPI_THREAD_SERIALIZED), so world_abort from another thread is safe. Waits
// never block inside MPI: they post non-blocking operations and poll them (spinning
// briefly, then sleeping with back-off) until they complete, the deadline passes,
// or the world is aborted.
//
// Abort: each process keeps a receive posted on a private communicator; world_abort
// sends the reason to every other process, whose pending and future waits then fail
// at once naming it. After a failure the process cannot finalize MPI safely (other
// operations may never complete), so world_destroy skips MPI_Finalize and, with
// option abort_on_failure, calls MPI_Abort when the process exits: the last resort
// that keeps every other process of the job from waiting on this one.
#pragma once

#include <mpi.h>

#include "timeout_text.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace loom::comm_common {

using Clock = std::chrono::steady_clock;

// Held around every MPI call.
std::mutex& mpi_mutex();
// The text of an MPI error code.
std::string mpi_error_text(int code);

struct Settings {
  std::string plugin = "comm/mpi";  // names the plugin in messages
  int64_t timeout_ms = 0;       // <= 0: wait forever
  int64_t spin_us = 50;         // busy polling before a wait starts sleeping
  int64_t max_sleep_us = 500;   // longest sleep between polls
  bool abort_on_failure = true; // MPI_Abort at exit after a failed run
};

class World {
 public:
  World(const Settings& settings, int32_t world_size, int32_t my_rank);
  ~World();
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  MPI_Comm coll() const { return coll_; }
  MPI_Comm p2p() const { return p2p_; }
  const Settings& settings() const { return settings_; }

  // The deadline of a wait starting now.
  Clock::time_point deadline() const;

  // Calls step() with mpi_mutex() held until it returns true (-> true) or the
  // deadline passes (-> false). Throws loom::Error "<what> aborted: <reason>" when
  // the world is aborted, here or by another process.
  bool poll(Clock::time_point deadline, const std::string& what, const std::function<bool()>& step);

  // Waits until every request is complete (completed entries become
  // MPI_REQUEST_NULL; statuses, if given, receive theirs). false at the deadline.
  // Throws on abort, and on an MPI error (message names `what`).
  bool wait(std::vector<MPI_Request>& reqs, std::vector<MPI_Status>* statuses, Clock::time_point deadline,
            const std::string& what);

  // Cancels and releases the requests that are still pending after a failure.
  void discard(std::vector<MPI_Request>& reqs);

  // A send whose buffer the world keeps until it completes (p2p sends never block).
  void keep_send(MPI_Request req, std::shared_ptr<std::vector<unsigned char>> buf);

  // The MPI tag of the n-th group created with this kind and rank list (the same on
  // every member without talking to the others). Throws on a clash with a live group.
  int claim_tag(const std::string& kind, const std::vector<int32_t>& ranks);
  void release_tag(int tag);

  // The bytes the first member of a group (ranks in rank-in-group order) made with
  // `make`, on every member: the first member calls make() and sends the result to
  // the others, who wait for it (with the timeout, naming the first member). Called
  // by every member; the n-th call for a kind and rank list meets the n-th on the
  // others. Used for ids a group's members must share (NCCL unique ids).
  std::vector<unsigned char> share_from_first(const std::string& kind, const std::vector<int32_t>& ranks,
                                              const std::function<std::vector<unsigned char>()>& make);

  // Fails every pending and future wait here and in every other process with `reason`.
  void abort(const std::string& reason);
  bool failed() const { return failed_.load(); }
  // The reason of a failure here or in another process (checking for a notice that
  // arrived), or "" while there is none. For threads that do not wait in poll().
  std::string failure();

 private:
  void check_abort_locked(const std::string& what);  // mpi_mutex() held
  void reap_sends_locked();                          // mpi_mutex() held
  [[noreturn]] void throw_aborted(const std::string& what) const;

  Settings settings_;
  int size_ = 0;
  int rank_ = 0;
  int tag_ub_ = 32767;
  MPI_Comm coll_ = MPI_COMM_NULL;   // collectives
  MPI_Comm p2p_ = MPI_COMM_NULL;    // send / recv
  MPI_Comm abort_ = MPI_COMM_NULL;  // abort notices

  std::vector<char> abort_buf_;
  MPI_Request abort_req_ = MPI_REQUEST_NULL;

  std::atomic<bool> failed_{false};
  std::string failure_;  // set once, before failed_, under mpi_mutex()

  struct Outgoing {
    MPI_Request req;
    std::shared_ptr<std::vector<unsigned char>> buf;
  };
  std::vector<Outgoing> outgoing_;

  std::map<std::string, int> created_;  // key -> groups created so far
  std::set<int> live_tags_;
};

}  // namespace loom::comm_common
