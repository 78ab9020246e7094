// comm/local: every rank is a thread of this process; collectives and p2p go
// through shared memory. The embedded default backend and the test vehicle.
// See group.hpp (collective protocol, mailboxes) and world.hpp (rendezvous).
#include "../common/async_worker.hpp"
#include "group.hpp"
#include "world.hpp"

#include <loom/cpp/plugin.hpp>

#include <algorithm>
#include <future>
#include <memory>
#include <optional>
#include <vector>

namespace loom::comm_local {
namespace {

// What group_create hands each member: the shared group, the member's place in
// it, and the thread its started collectives run on (made on first start).
struct Handle {
  std::shared_ptr<Group> group;
  int index = 0;
  std::unique_ptr<comm_common::AsyncWorker> worker;
};

Handle& member(loom_comm* comm) {
  LOOM_REQUIRE(comm != nullptr, "comm/local: null communicator (was group_create successful?)");
  return *reinterpret_cast<Handle*>(comm);
}

// A member's handle for a blocking collective: the collectives it started run
// first. (Point to point keeps no order with collectives and does not wait.)
Handle& handle(loom_comm* comm) {
  Handle& h = member(comm);
  if (h.worker) h.worker->drain();
  return h;
}

// A started collective (done on the worker), or a posted receive (completed at
// its wait), or a send (done at start: sends never wait for the receiver).
struct Request {
  std::future<void> done;
  std::optional<Group::PostedRecv> recv;
};

loom_status world_create(const loom_options* options, const loom_comm_world_args* args,
                         loom_comm_world** out) {
  return guard([&] {
    LOOM_REQUIRE(args != nullptr && out != nullptr, "comm/local: world_create needs args and out");
    LOOM_REQUIRE(LOOM_HAS_SLOT(args, loom_comm_world_args, timeout_ms),
                 "comm/local: world_create args are too small (struct_size " << args->struct_size << ")");
    LOOM_REQUIRE(args->world_size >= 1, "comm/local: world_size must be at least 1, got " << args->world_size);
    LOOM_REQUIRE(args->num_local_ranks >= 0 && (args->num_local_ranks == 0 || args->local_ranks != nullptr),
                 "comm/local: world_create got " << args->num_local_ranks << " local ranks and no list of them");
    std::vector<int32_t> local(args->local_ranks, args->local_ranks + args->num_local_ranks);
    for (size_t i = 0; i < local.size(); ++i) {
      LOOM_REQUIRE(local[i] >= 0 && local[i] < args->world_size,
                   "comm/local: local rank " << local[i] << " is outside the world of " << args->world_size
                                             << " ranks");
      LOOM_REQUIRE(std::count(local.begin(), local.end(), local[i]) == 1,
                   "comm/local: local rank " << local[i] << " is listed twice");
    }
    if (static_cast<int32_t>(local.size()) != args->world_size) {
      throw Error("comm/local: this process hosts " + std::to_string(local.size()) + " of " +
                      std::to_string(args->world_size) +
                      " ranks, but comm/local runs every rank as a thread of one process; use comm/mpi "
                      "(or comm/nccl) for ranks in several processes",
                  LOOM_CODE_UNSUPPORTED);
    }
    comm_common::LinkModel links;
    try {
      links = comm_common::LinkModel::parse(Options(options).declared_string("links"));
    } catch (const std::invalid_argument& e) {
      throw Error(std::string("comm/local: option links: ") + e.what(), LOOM_CODE_INVALID_ARGUMENT);
    }
    *out = reinterpret_cast<loom_comm_world*>(
        new World(args->world_size, std::move(local), args->timeout_ms, std::move(links)));
  });
}

// Groups keep their own state alive, so communicators may outlive the world; no
// group_create may still be running on another thread.
void world_destroy(loom_comm_world* world) { delete reinterpret_cast<World*>(world); }
void world_abort(loom_comm_world* world, const char* reason) {
  (void)loom::guard([&] { reinterpret_cast<World*>(world)->abort(reason ? reason : "aborted"); });
}

loom_status group_create(loom_comm_world* world, const loom_group_desc* desc, loom_comm** out) {
  return guard([&] {
    LOOM_REQUIRE(world != nullptr && desc != nullptr && out != nullptr,
                 "comm/local: group_create needs a world, a description and out");
    LOOM_REQUIRE(LOOM_HAS_SLOT(desc, loom_group_desc, my_rank),
                 "comm/local: group_create description is too small (struct_size " << desc->struct_size << ")");
    const std::string kind = desc->kind ? desc->kind : "?";
    LOOM_REQUIRE(desc->size >= 1 && desc->ranks != nullptr,
                 "comm/local: group_create of group '" << kind << "' needs at least one rank, got size "
                                                       << desc->size);
    std::vector<int32_t> ranks(desc->ranks, desc->ranks + desc->size);
    auto h = std::make_unique<Handle>();
    h->group = reinterpret_cast<World*>(world)->join(kind, ranks, desc->my_rank, &h->index);
    *out = reinterpret_cast<loom_comm*>(h.release());
  });
}

void group_destroy(loom_comm* comm) { delete reinterpret_cast<Handle*>(comm); }

loom_status all_reduce(loom_comm* comm, void* /*stream*/, const void* send, void* recv, size_t count,
                       int32_t dtype, int32_t op) {
  return guard([&] {
    Handle& h = handle(comm);
    h.group->all_reduce(h.index, send, recv, count, dtype, op);
  });
}

loom_status all_gather(loom_comm* comm, void* /*stream*/, const void* send, void* recv, size_t count,
                       int32_t dtype) {
  return guard([&] {
    Handle& h = handle(comm);
    h.group->all_gather(h.index, send, recv, count, dtype);
  });
}

loom_status reduce_scatter(loom_comm* comm, void* /*stream*/, const void* send, void* recv, size_t count,
                           int32_t dtype, int32_t op) {
  return guard([&] {
    Handle& h = handle(comm);
    h.group->reduce_scatter(h.index, send, recv, count, dtype, op);
  });
}

loom_status all_to_all(loom_comm* comm, void* /*stream*/, const void* send, void* recv, size_t count,
                       int32_t dtype) {
  return guard([&] {
    Handle& h = handle(comm);
    h.group->all_to_all(h.index, send, recv, count, dtype);
  });
}

loom_status all_to_all_v(loom_comm* comm, void* /*stream*/, const void* send, const size_t* send_counts,
                         const size_t* send_displs, void* recv, const size_t* recv_counts,
                         const size_t* recv_displs, int32_t dtype) {
  return guard([&] {
    Handle& h = handle(comm);
    h.group->all_to_all_v(h.index, send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype);
  });
}

loom_status broadcast(loom_comm* comm, void* /*stream*/, void* buf, size_t count, int32_t dtype, int32_t root) {
  return guard([&] {
    Handle& h = handle(comm);
    h.group->broadcast(h.index, buf, count, dtype, root);
  });
}

loom_status barrier(loom_comm* comm) {
  return guard([&] {
    Handle& h = handle(comm);
    h.group->barrier(h.index);
  });
}

loom_status send(loom_comm* comm, void* /*stream*/, const void* buf, size_t count, int32_t dtype, int32_t peer,
                 int32_t tag) {
  return guard([&] {
    Handle& h = member(comm);
    h.group->send(h.index, buf, count, dtype, peer, tag);
  });
}

loom_status recv(loom_comm* comm, void* /*stream*/, void* buf, size_t count, int32_t dtype, int32_t peer,
                 int32_t tag) {
  return guard([&] {
    Handle& h = member(comm);
    h.group->recv(h.index, buf, count, dtype, peer, tag);
  });
}

// Started collectives run on the member's worker in call order; the caller's
// thread goes on (the modelled link's time passes on the worker too). A started
// send is sent at once; a started receive is posted now (its transfer may start)
// and completed at the wait.
loom_status start(loom_comm* comm, void* /*stream*/, const loom_collective* c, loom_comm_request** req) {
  return guard([&] {
    LOOM_REQUIRE(comm != nullptr && c != nullptr && req != nullptr && LOOM_HAS_SLOT(c, loom_collective, op),
                 "comm/local: start needs a communicator, a loom_collective and a request");
    Handle& h = member(comm);
    const bool p2p = c->kind == LOOM_COLLECTIVE_SEND || c->kind == LOOM_COLLECTIVE_RECV;
    LOOM_REQUIRE(!p2p || LOOM_HAS_SLOT(c, loom_collective, tag),
                 "comm/local: a started send or receive needs a loom_collective of ABI 1.17 or later");
    const loom_collective col = copy_of(*c);  // a 1.15 caller's is shorter
    auto r = std::make_unique<Request>();
    if (col.kind == LOOM_COLLECTIVE_SEND) {
      h.group->send(h.index, col.send, col.count, col.dtype, col.peer, col.tag);
      *req = reinterpret_cast<loom_comm_request*>(r.release());
      return;
    }
    if (col.kind == LOOM_COLLECTIVE_RECV) {
      r->recv = h.group->post_recv(h.index, col.recv, col.count, col.dtype, col.peer, col.tag);
      *req = reinterpret_cast<loom_comm_request*>(r.release());
      return;
    }
    LOOM_REQUIRE(col.kind == LOOM_COLLECTIVE_ALL_REDUCE || col.kind == LOOM_COLLECTIVE_ALL_GATHER ||
                     col.kind == LOOM_COLLECTIVE_REDUCE_SCATTER,
                 "comm/local: start of an unknown collective kind " << col.kind);
    if (!h.worker) h.worker = std::make_unique<comm_common::AsyncWorker>();
    std::shared_ptr<Group> group = h.group;
    const int me = h.index;
    r->done = h.worker->submit([group, me, col] {
      if (col.kind == LOOM_COLLECTIVE_ALL_REDUCE)
        group->all_reduce(me, col.send, col.recv, col.count, col.dtype, col.op);
      else if (col.kind == LOOM_COLLECTIVE_ALL_GATHER)
        group->all_gather(me, col.send, col.recv, col.count, col.dtype);
      else
        group->reduce_scatter(me, col.send, col.recv, col.count, col.dtype, col.op);
    });
    *req = reinterpret_cast<loom_comm_request*>(r.release());
  });
}

loom_status wait(loom_comm* comm, loom_comm_request* req, void* /*stream*/) {
  return guard([&] {
    LOOM_REQUIRE(req != nullptr, "comm/local: wait without a request");
    std::unique_ptr<Request> r(reinterpret_cast<Request*>(req));
    if (r->recv) {
      Handle& h = member(comm);
      h.group->complete_recv(h.index, *r->recv);
    } else if (r->done.valid()) {
      r->done.get();  // rethrows the collective's failure
    }
  });
}

const loom_comm_api* comm_api() {
  static const loom_comm_api api = [] {
    loom_comm_api a = make<loom_comm_api>();
    a.world_create = world_create;
    a.world_destroy = world_destroy;
    a.world_abort = world_abort;
    a.features = LOOM_COMM_THREADS | LOOM_COMM_START_P2P;  // host buffers, ranks as threads of one process
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
}  // namespace loom::comm_local

LOOM_PLUGIN_LIBRARY(loom::raw_plugin(
    "comm", "local", "1.3.0", "ranks as threads of one process; deterministic shared-memory collectives",
    LOOM_API_COMM, loom::comm_local::comm_api(),
    {loom::opt_string("links", "",
                      "a modelled network per group kind, e.g. \"tp=450GB/s,2us; dp=25GB/s,10us; *=12.5GB/s,10us\": "
                      "each collective and transfer takes at least the ring algorithm's time on that link "
                      "(\"\" = no modelled time)")}))
