// comm/mpi: one rank per process over OpenMPI, CPU buffers. Collectives are
// deterministic and bit-identical to comm/local's (same in-order reduction kernel,
// plugins/comm/common/reduce.hpp); every wait has the world's timeout and names
// the op, the group and the ranks that did not arrive; world_abort reaches every
// process. See ../common/mpi_world.hpp (MPI set-up, polling, abort) and group.hpp (protocol).
#include "group.hpp"
#include "receiver.hpp"
#include "../common/async_worker.hpp"
#include "../common/mpi_world.hpp"

#include <loom/cpp/plugin.hpp>

#include <algorithm>
#include <chrono>
#include <future>
#include <memory>
#include <vector>

namespace loom::comm_mpi {
namespace {

struct WorldHandle {
  std::shared_ptr<World> world;
};

// A member: its group, the thread its started collectives run on (ABI 1.15) and
// the one its started receives are polled on (1.17), each made on first use; every
// MPI call is serialised by mpi_mutex(). Destroyed threads first, so queued
// collectives finish before the group goes.
struct Member {
  std::unique_ptr<Group> group;
  std::unique_ptr<comm_common::AsyncWorker> worker;
  std::unique_ptr<Receiver> receiver;
  ~Member() {
    worker.reset();
    receiver.reset();
  }
};

Member& member_of(loom_comm* comm) {
  LOOM_REQUIRE(comm != nullptr, "comm/mpi: null communicator (was group_create successful?)");
  return *reinterpret_cast<Member*>(comm);
}

// The group for a blocking call: the member's started collectives run first (point
// to point too: its messages travel on the group's tag, as the collectives' do).
Group& group_of(loom_comm* comm) {
  Member& m = member_of(comm);
  if (m.worker) m.worker->drain();
  return *m.group;
}

struct Request {
  std::future<void> done;
  Receiver* receiver = nullptr;  // a started receive's: told when its wait begins
  uint64_t id = 0;
};

loom_status world_create(const loom_options* options, const loom_comm_world_args* args, loom_comm_world** out) {
  return guard([&] {
    LOOM_REQUIRE(args != nullptr && out != nullptr, "comm/mpi: world_create needs args and out");
    LOOM_REQUIRE(LOOM_HAS_SLOT(args, loom_comm_world_args, timeout_ms),
                 "comm/mpi: world_create args are too small (struct_size " << args->struct_size << ")");
    LOOM_REQUIRE(args->world_size >= 1, "comm/mpi: world_size must be at least 1, got " << args->world_size);
    if (args->num_local_ranks != 1 || args->local_ranks == nullptr) {
      throw Error("comm/mpi: this process was asked to host " + std::to_string(args->num_local_ranks) + " of " +
                      std::to_string(args->world_size) +
                      " ranks, but comm/mpi hosts exactly one rank per process; start the run with mpirun -np " +
                      std::to_string(args->world_size) + " (or srun -n " + std::to_string(args->world_size) +
                      "), or use comm.backend = \"local\" for ranks as threads of one process",
                  LOOM_CODE_UNSUPPORTED);
    }
    const Options opts(options);
    Settings s;
    s.timeout_ms = args->timeout_ms;
    s.spin_us = opts.get_int("spin_us", s.spin_us);
    s.max_sleep_us = opts.get_int("max_sleep_us", s.max_sleep_us);
    s.abort_on_failure = opts.get_bool("abort_on_failure", s.abort_on_failure);
    auto h = std::make_unique<WorldHandle>();
    h->world = std::make_shared<World>(s, args->world_size, args->local_ranks[0]);
    *out = reinterpret_cast<loom_comm_world*>(h.release());
  });
}

// MPI is finalized when the world and every group made from it are gone.
void world_destroy(loom_comm_world* world) { delete reinterpret_cast<WorldHandle*>(world); }

void world_abort(loom_comm_world* world, const char* reason) {
  (void)loom::guard([&] {
    if (world) reinterpret_cast<WorldHandle*>(world)->world->abort(reason ? reason : "aborted");
  });
}

loom_status group_create(loom_comm_world* world, const loom_group_desc* desc, loom_comm** out) {
  return guard([&] {
    LOOM_REQUIRE(world != nullptr && desc != nullptr && out != nullptr,
                 "comm/mpi: group_create needs a world, a description and out");
    LOOM_REQUIRE(LOOM_HAS_SLOT(desc, loom_group_desc, my_rank),
                 "comm/mpi: group_create description is too small (struct_size " << desc->struct_size << ")");
    const std::string kind = desc->kind ? desc->kind : "?";
    LOOM_REQUIRE(desc->size >= 1 && desc->ranks != nullptr,
                 "comm/mpi: group_create of group '" << kind << "' needs at least one rank, got size " << desc->size);
    const std::shared_ptr<World>& w = reinterpret_cast<WorldHandle*>(world)->world;
    std::vector<int32_t> ranks(desc->ranks, desc->ranks + desc->size);
    for (size_t i = 0; i < ranks.size(); ++i) {
      LOOM_REQUIRE(ranks[i] >= 0 && ranks[i] < w->size(), "comm/mpi: group_create of group '"
                                                              << kind << "': rank " << ranks[i]
                                                              << " is outside the world of " << w->size() << " ranks");
      LOOM_REQUIRE(std::count(ranks.begin(), ranks.end(), ranks[i]) == 1,
                   "comm/mpi: group_create of group '" << kind << "': rank " << ranks[i] << " is listed twice");
    }
    LOOM_REQUIRE(desc->my_rank == w->rank(), "comm/mpi: group_create of group '"
                                                 << kind << "' for rank " << desc->my_rank
                                                 << ", but this process hosts rank " << w->rank());
    const auto self = std::find(ranks.begin(), ranks.end(), desc->my_rank);
    LOOM_REQUIRE(self != ranks.end(),
                 "comm/mpi: group_create of group '" << kind << "': the caller, rank " << desc->my_rank
                                                     << ", is not a member");
    const int index = static_cast<int>(self - ranks.begin());
    auto m = std::make_unique<Member>();
    m->group = std::make_unique<Group>(w, kind, std::move(ranks), index);
    m->group->join();
    *out = reinterpret_cast<loom_comm*>(m.release());
  });
}

void group_destroy(loom_comm* comm) { delete reinterpret_cast<Member*>(comm); }

loom_status all_reduce(loom_comm* comm, void* /*stream*/, const void* send, void* recv, size_t count, int32_t dtype,
                       int32_t op) {
  return guard([&] { group_of(comm).all_reduce(send, recv, count, dtype, op); });
}
loom_status all_gather(loom_comm* comm, void* /*stream*/, const void* send, void* recv, size_t count,
                       int32_t dtype) {
  return guard([&] { group_of(comm).all_gather(send, recv, count, dtype); });
}
loom_status reduce_scatter(loom_comm* comm, void* /*stream*/, const void* send, void* recv, size_t count,
                           int32_t dtype, int32_t op) {
  return guard([&] { group_of(comm).reduce_scatter(send, recv, count, dtype, op); });
}
loom_status all_to_all(loom_comm* comm, void* /*stream*/, const void* send, void* recv, size_t count,
                       int32_t dtype) {
  return guard([&] { group_of(comm).all_to_all(send, recv, count, dtype); });
}
loom_status all_to_all_v(loom_comm* comm, void* /*stream*/, const void* send, const size_t* send_counts,
                         const size_t* send_displs, void* recv, const size_t* recv_counts, const size_t* recv_displs,
                         int32_t dtype) {
  return guard([&] {
    group_of(comm).all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype);
  });
}
loom_status broadcast(loom_comm* comm, void* /*stream*/, void* buf, size_t count, int32_t dtype, int32_t root) {
  return guard([&] { group_of(comm).broadcast(buf, count, dtype, root); });
}
loom_status barrier(loom_comm* comm) {
  return guard([&] { group_of(comm).barrier(); });
}
loom_status send(loom_comm* comm, void* /*stream*/, const void* buf, size_t count, int32_t dtype, int32_t peer,
                 int32_t tag) {
  return guard([&] { group_of(comm).send(buf, count, dtype, peer, tag); });
}
// Once the member has started a receive, a blocking one queues behind the started
// receives of its (peer, tag) in the receiver.
loom_status recv(loom_comm* comm, void* /*stream*/, void* buf, size_t count, int32_t dtype, int32_t peer,
                 int32_t tag) {
  return guard([&] {
    Group& g = group_of(comm);
    Member& m = member_of(comm);
    if (!m.receiver) return g.recv(buf, count, dtype, peer, tag);
    g.check_recv(buf, count, dtype, peer);
    Receiver::Ticket t = m.receiver->post(buf, count, dtype, peer, tag);
    m.receiver->waiting(t.id);
    t.done.get();
  });
}

loom_status start(loom_comm* comm, void* /*stream*/, const loom_collective* c, loom_comm_request** req) {
  return guard([&] {
    LOOM_REQUIRE(c != nullptr && req != nullptr && LOOM_HAS_SLOT(c, loom_collective, op),
                 "comm/mpi: start needs a loom_collective and a request");
    Member& m = member_of(comm);
    const bool p2p = c->kind == LOOM_COLLECTIVE_SEND || c->kind == LOOM_COLLECTIVE_RECV;
    LOOM_REQUIRE(!p2p || LOOM_HAS_SLOT(c, loom_collective, tag),
                 "comm/mpi: a started send or receive needs a loom_collective of ABI 1.17 or later");
    const loom_collective col = copy_of(*c);  // a 1.15 caller's is shorter
    auto r = std::make_unique<Request>();
    if (col.kind == LOOM_COLLECTIVE_SEND) {  // sends never block: it is on its way when this returns
      m.group->send(col.send, col.count, col.dtype, col.peer, col.tag);
      std::promise<void> sent;
      sent.set_value();
      r->done = sent.get_future();
      *req = reinterpret_cast<loom_comm_request*>(r.release());
      return;
    }
    if (col.kind == LOOM_COLLECTIVE_RECV) {
      m.group->check_recv(col.recv, col.count, col.dtype, col.peer);
      if (!m.receiver) m.receiver = std::make_unique<Receiver>(*m.group);
      Receiver::Ticket t = m.receiver->post(col.recv, col.count, col.dtype, col.peer, col.tag);
      r->done = std::move(t.done);
      r->receiver = m.receiver.get();
      r->id = t.id;
      *req = reinterpret_cast<loom_comm_request*>(r.release());
      return;
    }
    LOOM_REQUIRE(col.kind == LOOM_COLLECTIVE_ALL_REDUCE || col.kind == LOOM_COLLECTIVE_ALL_GATHER ||
                     col.kind == LOOM_COLLECTIVE_REDUCE_SCATTER,
                 "comm/mpi: start of an unknown collective kind " << col.kind);
    if (!m.worker) m.worker = std::make_unique<comm_common::AsyncWorker>();
    Group* g = m.group.get();
    r->done = m.worker->submit([g, col] {
      if (col.kind == LOOM_COLLECTIVE_ALL_REDUCE)
        g->all_reduce(col.send, col.recv, col.count, col.dtype, col.op);
      else if (col.kind == LOOM_COLLECTIVE_ALL_GATHER)
        g->all_gather(col.send, col.recv, col.count, col.dtype);
      else
        g->reduce_scatter(col.send, col.recv, col.count, col.dtype, col.op);
    });
    *req = reinterpret_cast<loom_comm_request*>(r.release());
  });
}

loom_status wait(loom_comm* /*comm*/, loom_comm_request* req, void* /*stream*/) {
  return guard([&] {
    LOOM_REQUIRE(req != nullptr, "comm/mpi: wait without a request");
    std::unique_ptr<Request> r(reinterpret_cast<Request*>(req));
    // A started receive's timeout counts from its wait (as a blocking receive's).
    if (r->receiver && r->done.wait_for(std::chrono::seconds(0)) != std::future_status::ready)
      r->receiver->waiting(r->id);
    r->done.get();  // rethrows the collective's failure
  });
}

const loom_comm_api* comm_api() {
  static const loom_comm_api api = [] {
    loom_comm_api a = make<loom_comm_api>();
    a.world_create = world_create;
    a.world_destroy = world_destroy;
    a.world_abort = world_abort;
    a.features = LOOM_COMM_PROCESSES | LOOM_COMM_START_P2P;  // host buffers, one process per rank
    a.group_create = group_create;
    a.group_destroy = group_destroy;
    a.all_reduce = all_reduce;
    a.all_gather = all_gather;
    a.reduce_scatter = reduce_scatter;
    a.all_to_all = all_to_all;
    a.all_to_all_v = all_to_all_v;
    a.broadcast = broadcast;
    a.barrier = barrier;
    a.send = send;
    a.recv = recv;
    a.start = start;
    a.wait = wait;
    return a;
  }();
  return &api;
}

}  // namespace
}  // namespace loom::comm_mpi

LOOM_PLUGIN_LIBRARY(loom::raw_plugin(
    "comm", "mpi", "1.2.0",
    "one rank per process over MPI (start with mpirun/srun); CPU buffers; results bit-identical to comm/local",
    LOOM_API_COMM, loom::comm_mpi::comm_api(),
    {loom::opt_int("spin_us", 50, "microseconds a wait polls MPI without sleeping before it backs off")
         .in("[0, 1000000]"),
     loom::opt_int("max_sleep_us", 500, "longest sleep in microseconds between two polls of a waiting operation")
         .in("[1, 1000000]"),
     loom::opt_bool("abort_on_failure", true,
                    "after a failed run, call MPI_Abort at process exit so no process of the job keeps waiting")}))
