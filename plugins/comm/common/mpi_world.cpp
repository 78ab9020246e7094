#include "mpi_world.hpp"

#include <loom/cpp/core.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>

namespace loom::comm_common {
namespace {

constexpr int kAbortTag = 1;
constexpr size_t kAbortBytes = 4096;  // longest abort reason carried to the others

// Process-wide MPI state, guarded by mpi_mutex().
int g_worlds = 0;                // live worlds
bool g_we_initialized = false;   // this plugin called MPI_Init_thread
bool g_abort_registered = false;

void abort_at_exit() {
  // The process is ending after a failed run (its error is already printed):
  // make sure no other process of the job keeps waiting for this one.
  std::fflush(nullptr);
  MPI_Abort(MPI_COMM_WORLD, 1);
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

std::mutex& mpi_mutex() {
  static std::mutex mu;
  return mu;
}

std::string mpi_error_text(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(buf, static_cast<size_t>(len));
}

World::World(const Settings& settings, int32_t world_size, int32_t my_rank) : settings_(settings) {
  std::lock_guard<std::mutex> lk(mpi_mutex());
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized)
    throw Error(settings_.plugin + ": MPI was already finalized in this process; a process can create " +
                    settings_.plugin + " worlds only while MPI is up (create the next world before destroying the last one)",
                LOOM_CODE_UNSUPPORTED);
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    if (rc != MPI_SUCCESS) throw Error(settings_.plugin + ": MPI_Init_thread failed: " + mpi_error_text(rc));
    g_we_initialized = true;
    if (provided < MPI_THREAD_SERIALIZED)
      throw Error(settings_.plugin + ": the MPI library provides thread level " + std::to_string(provided) +
                      " but " + settings_.plugin + " needs MPI_THREAD_SERIALIZED; use an MPI built with thread support",
                  LOOM_CODE_UNSUPPORTED);
  }
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  if (size_ != world_size || rank_ != my_rank) {
    std::ostringstream os;
    os << settings_.plugin << ": the run has " << world_size << " rank(s) and asks this process to host rank " << my_rank
       << ", but MPI started " << size_ << " process(es) and this one is MPI rank " << rank_
       << "; " << settings_.plugin << " hosts exactly one rank per process: start the run with mpirun -np " << world_size
       << " (or srun -n " << world_size << ")";
    if (g_worlds == 0 && g_we_initialized) {
      MPI_Finalize();
      g_we_initialized = false;
    }
    throw Error(os.str(), LOOM_CODE_INVALID_ARGUMENT);
  }
  void* ub = nullptr;
  int found = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &found);
  if (found && ub != nullptr) tag_ub_ = *static_cast<int*>(ub);
  // Collective over all processes (every process creates its world at start-up).
  for (MPI_Comm* c : {&coll_, &p2p_, &abort_}) {
    MPI_Comm_dup(MPI_COMM_WORLD, c);
    MPI_Comm_set_errhandler(*c, MPI_ERRORS_RETURN);
  }
  abort_buf_.assign(kAbortBytes, 0);
  MPI_Irecv(abort_buf_.data(), static_cast<int>(kAbortBytes), MPI_CHAR, MPI_ANY_SOURCE, kAbortTag, abort_, &abort_req_);
  ++g_worlds;
}

World::~World() {
  std::unique_lock<std::mutex> lk(mpi_mutex());
  --g_worlds;
  if (failed_.load() && settings_.abort_on_failure) {
    // Give the abort notices a moment to leave, then leave MPI as it is: other
    // operations may never complete, so MPI_Finalize could hang.
    const auto until = Clock::now() + std::chrono::seconds(1);
    while (!outgoing_.empty() && Clock::now() < until) {
      reap_sends_locked();
      lk.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      lk.lock();
    }
    if (!g_abort_registered) {
      g_abort_registered = true;
      std::atexit(abort_at_exit);
    }
    return;
  }
  // Sends still in flight (p2p messages nobody received yet) get the timeout to finish.
  const auto until = failed_.load() ? Clock::now() + std::chrono::seconds(1) : deadline();
  while (!outgoing_.empty() && Clock::now() < until) {
    reap_sends_locked();
    if (outgoing_.empty()) break;
    lk.unlock();
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    lk.lock();
  }
  for (Outgoing& o : outgoing_) MPI_Request_free(&o.req);
  outgoing_.clear();
  if (abort_req_ != MPI_REQUEST_NULL) {
    MPI_Cancel(&abort_req_);
    MPI_Wait(&abort_req_, MPI_STATUS_IGNORE);
  }
  for (MPI_Comm* c : {&coll_, &p2p_, &abort_}) MPI_Comm_free(c);
  if (g_worlds == 0 && g_we_initialized) {
    MPI_Finalize();
    g_we_initialized = false;
  }
}

Clock::time_point World::deadline() const {
  const int64_t t = settings_.timeout_ms;
  if (t <= 0 || t > int64_t{100} * 24 * 3600 * 1000) return Clock::time_point::max();
  return Clock::now() + std::chrono::milliseconds(t);
}

void World::throw_aborted(const std::string& what) const {
  throw Error(what + " aborted: " + failure_, LOOM_CODE_INTERNAL);
}

void World::check_abort_locked(const std::string& what) {
  if (failed_.load()) throw_aborted(what);
  if (abort_req_ == MPI_REQUEST_NULL) return;
  int done = 0;
  MPI_Status st;
  MPI_Test(&abort_req_, &done, &st);
  if (!done) return;
  int len = 0;
  MPI_Get_count(&st, MPI_CHAR, &len);
  failure_ = std::string(abort_buf_.data(), static_cast<size_t>(std::max(len, 0)));
  if (failure_.empty()) failure_ = "rank " + std::to_string(st.MPI_SOURCE) + " aborted the run";
  failed_.store(true);
  throw_aborted(what);
}

void World::reap_sends_locked() {
  for (size_t i = 0; i < outgoing_.size();) {
    int done = 0;
    MPI_Test(&outgoing_[i].req, &done, MPI_STATUS_IGNORE);
    if (done) {
      outgoing_[i] = std::move(outgoing_.back());
      outgoing_.pop_back();
    } else {
      ++i;
    }
  }
}

bool World::poll(Clock::time_point deadline, const std::string& what, const std::function<bool()>& step) {
  const auto start = Clock::now();
  int64_t sleep_us = 10;
  for (;;) {
    {
      std::lock_guard<std::mutex> lk(mpi_mutex());
      check_abort_locked(what);
      if (step()) return true;
    }
    const auto now = Clock::now();
    if (now >= deadline) return false;
    if (now - start < std::chrono::microseconds(settings_.spin_us)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
      sleep_us = std::min<int64_t>(sleep_us * 2, std::max<int64_t>(settings_.max_sleep_us, 1));
    }
  }
}

bool World::wait(std::vector<MPI_Request>& reqs, std::vector<MPI_Status>* statuses, Clock::time_point deadline,
                 const std::string& what) {
  const int n = static_cast<int>(reqs.size());
  std::vector<int> idx(reqs.size());
  std::vector<MPI_Status> st(reqs.size());
  if (statuses) statuses->resize(reqs.size());
  return poll(deadline, what, [&] {
    if (std::all_of(reqs.begin(), reqs.end(), [](MPI_Request r) { return r == MPI_REQUEST_NULL; })) return true;
    int out = 0;
    const int rc = MPI_Testsome(n, reqs.data(), &out, idx.data(), st.data());
    if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) throw Error(what + ": MPI_Testsome failed: " + mpi_error_text(rc));
    if (out == MPI_UNDEFINED) return true;
    for (int k = 0; k < out; ++k) {
      if (rc == MPI_ERR_IN_STATUS && st[static_cast<size_t>(k)].MPI_ERROR != MPI_SUCCESS)
        throw Error(what + ": " + mpi_error_text(st[static_cast<size_t>(k)].MPI_ERROR));
      if (statuses) (*statuses)[static_cast<size_t>(idx[static_cast<size_t>(k)])] = st[static_cast<size_t>(k)];
    }
    return std::all_of(reqs.begin(), reqs.end(), [](MPI_Request r) { return r == MPI_REQUEST_NULL; });
  });
}

void World::discard(std::vector<MPI_Request>& reqs) {
  std::lock_guard<std::mutex> lk(mpi_mutex());
  for (MPI_Request& r : reqs) {
    if (r == MPI_REQUEST_NULL) continue;
    MPI_Cancel(&r);  // a receive is withdrawn; a send may still complete later
    MPI_Request_free(&r);
  }
}

void World::keep_send(MPI_Request req, std::shared_ptr<std::vector<unsigned char>> buf) {
  // mpi_mutex() is held by the caller (inside poll or a locked section).
  outgoing_.push_back({req, std::move(buf)});
  if (outgoing_.size() > 64) reap_sends_locked();
}

int World::claim_tag(const std::string& kind, const std::vector<int32_t>& ranks) {
  std::ostringstream key;
  key << kind << '\x1f';
  for (int32_t r : ranks) key << r << ',';
  std::lock_guard<std::mutex> lk(mpi_mutex());
  const int n = created_[key.str()]++;
  key << '\x1f' << n;
  const int tag = 1 + static_cast<int>(fnv1a(key.str()) % static_cast<uint64_t>(std::max(tag_ub_ - 1, 1)));
  if (!live_tags_.insert(tag).second)
    throw Error(settings_.plugin + ": group_create of group '" + kind + "': its message tag " + std::to_string(tag) +
                    " clashes with another live group of this process (a hash collision); create the groups in "
                    "another order",
                LOOM_CODE_INTERNAL);
  return tag;
}

void World::release_tag(int tag) {
  std::lock_guard<std::mutex> lk(mpi_mutex());
  live_tags_.erase(tag);
}

std::vector<unsigned char> World::share_from_first(const std::string& kind, const std::vector<int32_t>& ranks,
                                                   const std::function<std::vector<unsigned char>()>& make) {
  const auto me = std::find(ranks.begin(), ranks.end(), rank_);
  if (me == ranks.end())
    throw Error(settings_.plugin + ": rank " + std::to_string(rank_) + " shares an id of group '" + kind +
                    "' but is not one of its members",
                LOOM_CODE_INVALID_ARGUMENT);
  const int tag = claim_tag(kind, ranks);
  struct Release {
    World* w;
    int tag;
    ~Release() { w->release_tag(tag); }
  } release{this, tag};
  // The message starts with a fingerprint of the tag's key, so that a tag shared by
  // two keys (a hash collision) is a clear error instead of a wrong id.
  std::string key = kind + '\x1f';
  for (int32_t r : ranks) key += std::to_string(r) + ',';
  const uint64_t fingerprint = fnv1a(key);
  if (me == ranks.begin()) {
    std::vector<unsigned char> blob = make();
    auto msg = std::make_shared<std::vector<unsigned char>>(sizeof fingerprint + blob.size());
    std::memcpy(msg->data(), &fingerprint, sizeof fingerprint);
    if (!blob.empty()) std::memcpy(msg->data() + sizeof fingerprint, blob.data(), blob.size());
    std::lock_guard<std::mutex> lk(mpi_mutex());
    check_abort_locked(settings_.plugin + " group_create of group '" + kind + "'");
    for (size_t i = 1; i < ranks.size(); ++i) {
      MPI_Request req = MPI_REQUEST_NULL;
      const int rc = MPI_Isend(msg->data(), static_cast<int>(msg->size()), MPI_BYTE, ranks[i], tag, p2p_, &req);
      if (rc != MPI_SUCCESS)
        throw Error(settings_.plugin + " group_create of group '" + kind + "': sending its id to global rank " +
                    std::to_string(ranks[i]) + " failed: " + mpi_error_text(rc));
      keep_send(req, msg);
    }
    return blob;
  }
  const std::string what = settings_.plugin + " group_create of group '" + kind + "' (global rank " +
                           std::to_string(rank_) + ")";
  std::vector<unsigned char> msg;
  const bool got = poll(deadline(), what, [&] {
    int flag = 0;
    MPI_Status st;
    int rc = MPI_Iprobe(ranks[0], tag, p2p_, &flag, &st);
    if (rc != MPI_SUCCESS) throw Error(what + ": MPI_Iprobe failed: " + mpi_error_text(rc));
    if (!flag) return false;
    int n = 0;
    MPI_Get_count(&st, MPI_BYTE, &n);
    msg.resize(static_cast<size_t>(std::max(n, 0)));
    rc = MPI_Recv(msg.data(), n, MPI_BYTE, ranks[0], tag, p2p_, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) throw Error(what + ": MPI_Recv failed: " + mpi_error_text(rc));
    return true;
  });
  if (!got)
    throw Error(what + ": no id from global rank " + std::to_string(ranks[0]) + ", the group's first member, " +
                    after_text(settings_.timeout_ms) + ": that process did not create the group (it failed, or creates "
                    "its groups in another order)",
                LOOM_CODE_TIMEOUT);
  uint64_t seen = 0;
  if (msg.size() >= sizeof seen) std::memcpy(&seen, msg.data(), sizeof seen);
  if (msg.size() < sizeof seen || seen != fingerprint)
    throw Error(what + ": the message from global rank " + std::to_string(ranks[0]) +
                    " belongs to another group (a tag collision); create the groups in another order",
                LOOM_CODE_INTERNAL);
  return std::vector<unsigned char>(msg.begin() + sizeof seen, msg.end());
}

std::string World::failure() {
  std::lock_guard<std::mutex> lk(mpi_mutex());
  if (!failed_.load() && abort_req_ != MPI_REQUEST_NULL) {
    try {
      check_abort_locked("");
    } catch (const Error&) {
      // failure_ now holds the other process's reason
    }
  }
  return failed_.load() ? failure_ : std::string();
}

void World::abort(const std::string& reason) {
  std::lock_guard<std::mutex> lk(mpi_mutex());
  if (failed_.load()) return;
  // Another process may have aborted first: then its reason is the root cause.
  if (abort_req_ != MPI_REQUEST_NULL) {
    try {
      check_abort_locked("");
    } catch (const Error&) {
      return;
    }
  }
  failure_ = reason.substr(0, kAbortBytes);
  failed_.store(true);
  auto msg = std::make_shared<std::vector<unsigned char>>(failure_.begin(), failure_.end());
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    MPI_Request req = MPI_REQUEST_NULL;
    if (MPI_Isend(msg->data(), static_cast<int>(msg->size()), MPI_CHAR, r, kAbortTag, abort_, &req) == MPI_SUCCESS)
      outgoing_.push_back({req, msg});
  }
}

}  // namespace loom::comm_common
