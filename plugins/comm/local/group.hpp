// comm/local: the state one rank group shares among its member threads.
//
// Collectives: every member publishes a description of its call (op, count,
// dtype, buffers) in its slot, then all meet at a barrier; each member checks
// that all descriptions agree, does its share of the work reading every member's
// buffers directly (in group-rank order, so results are bit-reproducible), and
// all meet at a second barrier before anyone returns and may reuse its buffers.
//
// Point to point: every member owns an inbox of channels keyed by (source
// member, tag). send numbers its message in sending order, copies the data into
// the buffer of the receive posted for that number if there is one, else into the
// channel, and returns at once; a receive is posted (numbered in posting order: a
// blocking recv, or one started without waiting, ABI 1.17) and takes the message
// of its own number, so receives match sends in order however their waits
// interleave.
//
// Waits end after the world's timeout with LOOM_CODE_TIMEOUT; the group is then
// poisoned and every later call on it fails at once with the same story.
//
// Thread model: each member's calls come from one thread at a time (its rank
// thread, or the member's worker for collectives started without waiting, ABI 1.15,
// which the plugin drains before a blocking collective); different members call
// concurrently. send/recv are safe from any thread.
//
// With a modelled link (comm.options.links, link_model.hpp) a collective returns no
// earlier than the link's time for it after the call began, and a message's transfer
// starts once it is sent and its receive is posted (the rendezvous of NCCL's and
// MPI's large messages) and takes the link's time: a receive posted early hides it.
#pragma once

#include "../common/link_model.hpp"
#include "../common/timeout_text.hpp"

#include <loom/loom_abi.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace loom::comm_local {

enum class Op : int32_t { Barrier, AllReduce, AllGather, ReduceScatter, AllToAll, AllToAllV, Broadcast };
const char* op_name(Op op);
// "after 200 ms", "after 2.0 s": how long a wait lasted before it gave up.
using comm_common::after_text;

// One member's view of a collective call, as published to the others.
struct Call {
  Op op = Op::Barrier;
  size_t count = 0;
  int32_t dtype = 0;
  int32_t reduce = 0;  // all_reduce, reduce_scatter
  int32_t root = 0;    // broadcast
  const void* send = nullptr;
  void* recv = nullptr;
  const size_t* send_counts = nullptr;  // all_to_all_v
  const size_t* send_displs = nullptr;
  const size_t* recv_counts = nullptr;
  const size_t* recv_displs = nullptr;
  std::string invalid;  // non-empty: this member's arguments are wrong (reported by all)
};

class Group {
 public:
  // `ranks`: global ranks in group order. timeout_ms <= 0 waits forever. `link`:
  // the modelled network between the members (ideal: no modelled time).
  Group(std::string kind, std::vector<int32_t> ranks, int64_t timeout_ms, comm_common::Link link = {});
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  int size() const { return static_cast<int>(ranks_.size()); }
  const std::vector<int32_t>& ranks() const { return ranks_; }
  // "group 'dp' (ranks [0,1,2,3])"
  const std::string& label() const { return label_; }

  // Collectives; `me` is the caller's rank in the group. Throw loom::Error.
  void all_reduce(int me, const void* send, void* recv, size_t count, int32_t dtype, int32_t op);
  void all_gather(int me, const void* send, void* recv, size_t count, int32_t dtype);
  void reduce_scatter(int me, const void* send, void* recv, size_t count, int32_t dtype, int32_t op);
  void all_to_all(int me, const void* send, void* recv, size_t count, int32_t dtype);
  void all_to_all_v(int me, const void* send, const size_t* send_counts, const size_t* send_displs,
                    void* recv, const size_t* recv_counts, const size_t* recv_displs, int32_t dtype);
  void broadcast(int me, void* buf, size_t count, int32_t dtype, int32_t root);
  void barrier(int me);

  // Point to point; `peer` is a rank in the group.
  void send(int me, const void* buf, size_t count, int32_t dtype, int32_t peer, int32_t tag);
  void recv(int me, void* buf, size_t count, int32_t dtype, int32_t peer, int32_t tag);
  // A receive posted now and completed later (a started recv): post_recv checks the
  // arguments and takes the next number of (peer, tag); complete_recv waits for that
  // message and copies it into buf.
  struct PostedRecv {
    void* buf = nullptr;
    size_t count = 0;
    int32_t dtype = 0, peer = 0, tag = 0;
    uint64_t number = 0;
    std::chrono::steady_clock::time_point posted_at{};
  };
  PostedRecv post_recv(int me, void* buf, size_t count, int32_t dtype, int32_t peer, int32_t tag);
  void complete_recv(int me, const PostedRecv& r);

  // Fails every pending and future call of the group with `message` (world_abort).
  void abort(const std::string& message);

 private:
  struct Message {
    int32_t dtype = LOOM_DTYPE_F32;
    size_t count = 0;
    std::vector<unsigned char> data;  // empty once delivered into a posted receive's buffer
    std::chrono::steady_clock::time_point sent_at{};
    size_t bytes = 0;
  };
  // The messages of one (source member, tag) not yet received, by sending number,
  // and the receives posted for messages not sent yet: a send whose receive is
  // posted writes straight into its buffer, as a network would (so a receiver
  // touching a posted buffer before its wait sees it change).
  struct Channel {
    std::map<uint64_t, Message> arrived;
    std::map<uint64_t, PostedRecv> waiting;
    uint64_t sent = 0, posted = 0;  // numbers handed to sends and to receives so far
  };
  struct Inbox {
    std::mutex mu;
    std::condition_variable cv;
    std::map<std::pair<int, int32_t>, Channel> channels;  // (source member, tag)
  };

  // Publishes `call` for member `me`, meets the others, checks agreement, runs
  // `work` (this member's share), meets again; throws on any failure.
  template <typename Work>
  void collective(int me, Call call, Work&& work);
  // Waits until every member arrived at this phase (0: start, 1: done).
  void arrive(int me, Op op, int phase);
  // The error every member reports when the published calls disagree ("" if none).
  std::string disagreement() const;
  std::string describe(const Call& c) const;
  std::string member(int m) const;  // "rank 5" or "rank 5 (group rank 1)"
  [[noreturn]] void fail_fast(const char* op) const;  // the group is poisoned
  // Waits out the rest of the link's time for collective `kind` of `bytes` begun at `start`.
  void model_time(std::chrono::steady_clock::time_point start, comm_common::CollectiveKind kind, double bytes) const;
  void poison(int32_t code, const std::string& message);  // call with mu_ held
  void wake_inboxes();

  const std::string kind_;
  const std::vector<int32_t> ranks_;
  const int64_t timeout_ms_;
  const std::string label_;
  const comm_common::Link link_;

  // Collective state, guarded by mu_ (slots_[m] is written by member m before it
  // arrives and read by the others between the two barriers).
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t generation_ = 0;
  int arrived_ = 0;
  std::vector<char> here_;
  std::vector<Call> slots_;

  // Poison: set once, under mu_; the flag is also read without it (fast paths, inbox waits).
  std::atomic<bool> poisoned_{false};
  int32_t poison_code_ = 0;
  std::string poison_message_;

  std::vector<std::unique_ptr<Inbox>> inboxes_;
};

}  // namespace loom::comm_local
