// comm/mpi: one rank group as seen by one member process.
//
// No MPI communicator is created per group (MPI_Comm_create_group blocks with no
// timeout): all traffic is point to point on the world's communicators, under the
// group's own message tag, so creating a group cannot hang and every wait has a
// deadline.
//
// A collective runs in two steps. First every member sends every other member a
// small header describing its call (op, count, dtype, reduction, root, sequence
// number; all_to_all_v adds its count vectors) and waits for theirs: a member whose
// header does not arrive in time "never joined". All members then hold the same
// headers and reach the same verdict: on a disagreement or invalid arguments every
// member reports it and no data moves. Otherwise the data moves as point-to-point
// messages, and reductions use comm/common's in-order kernel over the contributions
// in group-rank order, so results are bit-identical to comm/local's:
//   all_reduce      member j reduces slice j of every member's buffer (the slices of
//                   comm/local), then the reduced slices are gathered by all;
//   reduce_scatter  member j reduces block j of every member's buffer.
//
// Point to point: send copies the data (with a small header: tag, dtype, count)
// and returns at once; recv probes the group's messages from the peer and files
// those with other tags in a per-peer inbox, so tags may be received in any order
// and messages with the same tag arrive in order. The inbox is touched only with
// mpi_mutex() held, so started receives (receiver.hpp) may take messages from
// another thread.
//
// A timeout poisons the group: later calls on it fail at once with the same story.
#pragma once

#include "../common/mpi_world.hpp"

#include <loom/cpp/core.hpp>

#include <atomic>
#include <deque>
#include <map>
#include <mutex>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace loom::comm_mpi {

// The MPI world is shared with comm/nccl (plugins/comm/common/mpi_world.hpp).
using comm_common::after_text;
using comm_common::Clock;
using comm_common::mpi_error_text;
using comm_common::mpi_mutex;
using comm_common::Settings;
using comm_common::World;

enum class Op : int32_t { Barrier = 1, AllReduce, AllGather, ReduceScatter, AllToAll, AllToAllV, Broadcast, GroupCreate };
const char* op_name(Op op);

class Group {
 public:
  // ranks: global ranks in group order; me: the caller's index in it.
  Group(std::shared_ptr<World> world, std::string kind, std::vector<int32_t> ranks, int me);
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  int size() const { return static_cast<int>(ranks_.size()); }
  const std::string& label() const { return label_; }
  World& world() const { return *world_; }

  // Meets every member (part of group_create); throws on timeout naming who is missing.
  void join();

  void all_reduce(const void* send, void* recv, size_t count, int32_t dtype, int32_t op);
  void all_gather(const void* send, void* recv, size_t count, int32_t dtype);
  void reduce_scatter(const void* send, void* recv, size_t count, int32_t dtype, int32_t op);
  void all_to_all(const void* send, void* recv, size_t count, int32_t dtype);
  void all_to_all_v(const void* send, const size_t* send_counts, const size_t* send_displs, void* recv,
                    const size_t* recv_counts, const size_t* recv_displs, int32_t dtype);
  void broadcast(void* buf, size_t count, int32_t dtype, int32_t root);
  void barrier();

  void send(const void* buf, size_t count, int32_t dtype, int32_t peer, int32_t tag);
  void recv(void* buf, size_t count, int32_t dtype, int32_t peer, int32_t tag);

  // The steps of recv, for the receiver thread. check_recv throws when the group is
  // poisoned or the arguments are invalid. take_locked (mpi_mutex() held) files what
  // has arrived from `peer` and moves the oldest message of (peer, tag) into buf ->
  // true, or finds none -> false; it throws when that message's count or dtype
  // differs from the receive's. recv_timeout poisons the group with the story of a
  // receive that waited past the deadline and returns the error to throw.
  void check_recv(const void* buf, size_t count, int32_t dtype, int32_t peer) const;
  bool take_locked(void* buf, size_t count, int32_t dtype, int32_t peer, int32_t tag);
  Error recv_timeout(int32_t peer, int32_t tag);
  // After a failure poisoned the group: the error its calls now fail with; else null.
  std::exception_ptr poisoned(const char* op) const;

 private:
  // What one member says about its call.
  struct Header {
    int64_t op = 0, count = 0, dtype = 0, reduce = 0, root = 0, seq = 0, invalid = 0;
    std::vector<int64_t> send_counts, recv_counts;  // all_to_all_v only
  };
  // One point-to-point transfer of a collective's data phase.
  struct Xfer {
    int peer;      // group index
    const void* src;
    void* dst;
    size_t bytes;
  };
  struct Message {
    int32_t dtype;
    size_t count;
    std::vector<unsigned char> data;
  };

  // Exchanges headers with every member; throws when one never joined or the calls
  // disagree / are invalid (the same verdict on every member).
  void handshake(Op op, Header mine, const std::string& invalid);
  // Moves the data: every transfer in `sends` and `recvs`; throws on timeout.
  void move(Op op, const std::vector<Xfer>& sends, const std::vector<Xfer>& recvs);
  std::string describe(const Header& h) const;
  std::string disagreement(const std::vector<Header>& all) const;
  std::string member(int m) const;
  std::string where(Op op) const;  // "comm/mpi: all_reduce on group 'dp' (ranks [0,1])"
  [[noreturn]] void fail_fast(const char* op) const;
  void poison(const std::string& message);

  std::shared_ptr<World> world_;  // groups keep the world (and MPI) alive
  const std::string kind_;
  const std::vector<int32_t> ranks_;
  const int me_;
  const std::string label_;
  int tag_ = 0;
  int64_t seq_ = 0;
  std::atomic<bool> poisoned_{false};  // the receiver thread may poison too
  mutable std::mutex poison_mu_;
  std::string poison_message_;  // under poison_mu_, set before poisoned_
  std::map<std::pair<int, int32_t>, std::deque<Message>> inbox_;  // (peer, tag) -> messages; mpi_mutex()
};

}  // namespace loom::comm_mpi
