#include "engine/runtime/comm_stats.hpp"

#include "engine/plugins/registry.hpp"
#include "engine/runtime/json.hpp"

#include <loom/cpp/core.hpp>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <map>
#include <memory>
#include <sstream>
#include <utility>
#include <vector>

namespace loom::runtime {

void CommStatsRecorder::add(const std::string& kind, const char* op, const CommCounter& c) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_[kind][op] += c;
}

CommStats CommStatsRecorder::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void CommStatsRecorder::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.clear();
}

namespace {

// The shim communicator behind a counted group's loom_comm*.
struct ShimRequest;
struct Shim {
  const loom_comm_api* api;
  loom_comm* comm;
  int32_t size;
  std::string kind;
  CommStatsRecorder* recorder;
  const DeviceStaging* staging;  // null: buffers go to the plugin as they are
  // Started receives the plugin did not start (ABI 1.17), per (peer, tag) in posting
  // order: each is received at its wait, or earlier when a later receive of its
  // pair needs the messages before it.
  std::map<std::pair<int32_t, int32_t>, std::deque<ShimRequest*>> deferred{};
};
Shim* shim(loom_comm* c) { return reinterpret_cast<Shim*>(c); }

std::atomic<uint64_t> g_staged_bytes{0};

// One call's buffers as the comm plugin sees them: device memory replaced by host
// copies (send copied in; recv copied out by finish), host memory as it is. An
// in-place call (send and recv overlapping) gets one host copy of both.
class Staged {
 public:
  // keep_recv: the call writes only parts of recv (all_to_all_v's segments), so the
  // host copy starts as the device's, and what the call leaves goes back unchanged.
  Staged(const DeviceStaging* st, const void* send, size_t send_bytes, void* recv, size_t recv_bytes,
         bool keep_recv = false)
      : st_(st), send_(send), recv_(recv), recv_bytes_(recv_bytes) {
    if (st_ == nullptr) return;
    const bool send_dev = send_bytes > 0 && send != nullptr && on_device(send, send_bytes, "send");
    const bool recv_dev = recv_bytes > 0 && recv != nullptr && on_device(recv, recv_bytes, "receive");
    const auto* s = static_cast<const char*>(send);
    auto* r = static_cast<char*>(recv);
    if (send_dev && recv_dev && s < r + recv_bytes && r < s + send_bytes) {  // in place: one copy of both
      const char* base = std::min<const char*>(s, r);
      const size_t bytes = static_cast<size_t>(std::max<const char*>(s + send_bytes, r + recv_bytes) - base);
      in_.resize(bytes);
      copy(in_.data(), base, bytes, LOOM_COPY_DEVICE_TO_HOST);
      send_ = in_.data() + (s - base);
      recv_host_ = in_.data() + (r - base);
    } else {
      if (send_dev) {
        in_.resize(send_bytes);
        copy(in_.data(), send, send_bytes, LOOM_COPY_DEVICE_TO_HOST);
        send_ = in_.data();
      }
      if (recv_dev) {
        out_.resize(recv_bytes);
        if (keep_recv) copy(out_.data(), recv, recv_bytes, LOOM_COPY_DEVICE_TO_HOST);
        recv_host_ = out_.data();
      }
    }
    if (recv_host_ == nullptr) recv_host_ = recv;
  }
  const void* send() const { return send_; }
  void* recv() const { return recv_host_ != nullptr ? recv_host_ : recv_; }
  // After a successful call: what it wrote goes back to the device.
  void finish() {
    if (recv_host_ != nullptr && recv_host_ != recv_) copy(recv_, recv_host_, recv_bytes_, LOOM_COPY_HOST_TO_DEVICE);
  }

 private:
  bool on_device(const void* p, size_t bytes, const char* which) const {
    const DeviceStaging::Where w = st_->where(p, bytes);
    if (w == DeviceStaging::Where::Partly)
      throw loom::Error(std::string("the ") + which + " buffer (" + std::to_string(bytes) +
                            " bytes) runs past the end of the device allocation it starts in, or into one",
                        LOOM_CODE_INVALID_ARGUMENT);
    return w == DeviceStaging::Where::Device;
  }
  void copy(void* dst, const void* src, size_t bytes, int32_t kind) {
    st_->copy(dst, src, bytes, kind);
    g_staged_bytes += bytes;
  }
  const DeviceStaging* st_;
  const void* send_;
  void* recv_;
  size_t recv_bytes_;
  void* recv_host_ = nullptr;
  std::vector<char> in_, out_;
};

// Runs call(send, recv) on the staged buffers and copies the result back.
template <typename Call>
loom_status staged(const Shim* s, const void* send, size_t send_bytes, void* recv, size_t recv_bytes, Call&& call,
                   bool keep_recv = false) {
  auto failed = [&](int32_t code, const std::string& why) {
    return plugins::host_api()->status_create(
        code, (s->kind + ": staging device buffers through host memory: " + why).c_str());
  };
  try {
    Staged st(s->staging, send, send_bytes, recv, recv_bytes, keep_recv);
    loom_status status = call(st.send(), st.recv());
    if (status == nullptr) st.finish();
    return status;
  } catch (const loom::Error& e) {
    return failed(e.code(), e.what());
  } catch (const std::exception& e) {
    return failed(LOOM_CODE_INTERNAL, e.what());
  } catch (...) {
    return failed(LOOM_CODE_INTERNAL, "an unknown exception");
  }
}

// Bytes of `times` x `count` elements; saturates (the staging then refuses a buffer
// that large) where the product overflows.
size_t bytes_of(size_t count, int32_t dtype, size_t times = 1) {
  const size_t es = loom::dtype_size(dtype);
  if (es != 0 && times != 0 && count > SIZE_MAX / es / times) return SIZE_MAX;
  return count * es * times;
}

// factor: bus bytes per byte of the logical tensor (see comm_stats.hpp).
// Counts the call, runs it, and tells the observer (if any) how long it took.
// Counts one call; returns its logical bytes.
uint64_t count_call(Shim* s, const char* op, uint64_t elements, int32_t dtype, double factor) {
  CommCounter c;
  c.calls = 1;
  c.elements = elements;
  c.bytes = elements * loom::dtype_size(dtype);  // 0 for a bad dtype: the comm plugin reports it
  c.bus_bytes = static_cast<double>(c.bytes) * factor;
  s->recorder->add(s->kind, op, c);
  return c.bytes;
}

template <typename Call>
loom_status counted(Shim* s, const char* op, uint64_t elements, int32_t dtype, double factor, Call&& call) {
  const uint64_t bytes = count_call(s, op, elements, dtype, factor);
  const CommObserver& observer = s->recorder->observer();
  if (!observer) return call();
  const auto start = std::chrono::steady_clock::now();
  loom_status status = call();
  observer(s->kind, op, bytes, start, false);
  return status;
}
double ring(const Shim* s) { return s->size > 1 ? static_cast<double>(s->size - 1) / s->size : 0.0; }

loom_status missing(const char* op) {
  return plugins::host_api()->status_create(
      LOOM_CODE_UNSUPPORTED, (std::string("the comm plugin does not implement ") + op).c_str());
}
#define LOOM_SHIM_SLOT(s, op) \
  if (!LOOM_HAS_SLOT((s)->api, loom_comm_api, op) || (s)->api->op == nullptr) return missing(#op)

void s_group_destroy(loom_comm* c) {
  Shim* s = shim(c);
  if (s->api && s->comm) s->api->group_destroy(s->comm);
  delete s;
}
loom_status s_all_reduce(loom_comm* c, void* stream, const void* send, void* recv, size_t n, int32_t dtype,
                         int32_t op) {
  Shim* s = shim(c);
  LOOM_SHIM_SLOT(s, all_reduce);
  return counted(s, "all_reduce", n, dtype, 2.0 * ring(s), [&] {
    return staged(s, send, bytes_of(n, dtype), recv, bytes_of(n, dtype), [&](const void* sb, void* rb) {
      return s->api->all_reduce(s->comm, stream, sb, rb, n, dtype, op);
    });
  });
}
loom_status s_all_gather(loom_comm* c, void* stream, const void* send, void* recv, size_t n, int32_t dtype) {
  Shim* s = shim(c);
  LOOM_SHIM_SLOT(s, all_gather);
  return counted(s, "all_gather", n * static_cast<uint64_t>(s->size), dtype, ring(s), [&] {
    return staged(s, send, bytes_of(n, dtype), recv, bytes_of(n, dtype, s->size), [&](const void* sb, void* rb) {
      return s->api->all_gather(s->comm, stream, sb, rb, n, dtype);
    });
  });
}
loom_status s_reduce_scatter(loom_comm* c, void* stream, const void* send, void* recv, size_t n, int32_t dtype,
                             int32_t op) {
  Shim* s = shim(c);
  LOOM_SHIM_SLOT(s, reduce_scatter);
  return counted(s, "reduce_scatter", n * static_cast<uint64_t>(s->size), dtype, ring(s), [&] {
    return staged(s, send, bytes_of(n, dtype, s->size), recv, bytes_of(n, dtype), [&](const void* sb, void* rb) {
      return s->api->reduce_scatter(s->comm, stream, sb, rb, n, dtype, op);
    });
  });
}
loom_status s_all_to_all(loom_comm* c, void* stream, const void* send, void* recv, size_t n, int32_t dtype) {
  Shim* s = shim(c);
  LOOM_SHIM_SLOT(s, all_to_all);
  return counted(s, "all_to_all", n * static_cast<uint64_t>(s->size), dtype, ring(s), [&] {
    return staged(s, send, bytes_of(n, dtype, s->size), recv, bytes_of(n, dtype, s->size), [&](const void* sb, void* rb) {
      return s->api->all_to_all(s->comm, stream, sb, rb, n, dtype);
    });
  });
}
loom_status s_all_to_all_v(loom_comm* c, void* stream, const void* send, const size_t* send_counts,
                           const size_t* send_displs, void* recv, const size_t* recv_counts,
                           const size_t* recv_displs, int32_t dtype) {
  Shim* s = shim(c);
  LOOM_SHIM_SLOT(s, all_to_all_v);
  uint64_t sent = 0;
  for (int32_t i = 0; send_counts != nullptr && i < s->size; ++i) sent += send_counts[i];
  // The extent of each side: its furthest segment end (empty segments do not count,
  // as the plugins check them); the plugin reports arguments that overflow.
  auto extent = [&](const size_t* counts, const size_t* displs) {
    size_t e = 0;
    for (int32_t i = 0; counts != nullptr && displs != nullptr && i < s->size; ++i)
      if (counts[i] > 0 && displs[i] <= SIZE_MAX - counts[i]) e = std::max(e, counts[i] + displs[i]);
    return e;
  };
  return counted(s, "all_to_all_v", sent, dtype, ring(s), [&] {
    return staged(
        s, send, bytes_of(extent(send_counts, send_displs), dtype), recv, bytes_of(extent(recv_counts, recv_displs), dtype),
        [&](const void* sb, void* rb) {
          return s->api->all_to_all_v(s->comm, stream, sb, send_counts, send_displs, rb, recv_counts, recv_displs,
                                      dtype);
        },
        /*keep_recv=*/true);
  });
}
loom_status s_broadcast(loom_comm* c, void* stream, void* buf, size_t n, int32_t dtype, int32_t root) {
  Shim* s = shim(c);
  LOOM_SHIM_SLOT(s, broadcast);
  return counted(s, "broadcast", n, dtype, s->size > 1 ? 1.0 : 0.0, [&] {
    return staged(s, buf, bytes_of(n, dtype), buf, bytes_of(n, dtype), [&](const void*, void* rb) {
      return s->api->broadcast(s->comm, stream, rb, n, dtype, root);
    });
  });
}
loom_status s_barrier(loom_comm* c) {
  Shim* s = shim(c);
  LOOM_SHIM_SLOT(s, barrier);
  return counted(s, "barrier", 0, LOOM_DTYPE_U8, 0.0, [&] { return s->api->barrier(s->comm); });
}
// The plugin's send and recv, staged, not counted (blocking calls and the
// started ones the plugin cannot start).
loom_status send_now(Shim* s, void* stream, const void* buf, size_t n, int32_t dtype, int32_t peer, int32_t tag) {
  return staged(s, buf, bytes_of(n, dtype), nullptr, 0, [&](const void* sb, void*) {
    return s->api->send(s->comm, stream, sb, n, dtype, peer, tag);
  });
}
loom_status recv_now(Shim* s, void* stream, void* buf, size_t n, int32_t dtype, int32_t peer, int32_t tag) {
  return staged(s, nullptr, 0, buf, bytes_of(n, dtype), [&](const void*, void* rb) {
    return s->api->recv(s->comm, stream, rb, n, dtype, peer, tag);
  });
}
loom_status s_send(loom_comm* c, void* stream, const void* buf, size_t n, int32_t dtype, int32_t peer, int32_t tag) {
  Shim* s = shim(c);
  LOOM_SHIM_SLOT(s, send);
  return counted(s, "send", n, dtype, 1.0, [&] { return send_now(s, stream, buf, n, dtype, peer, tag); });
}
void receive_deferred(Shim* s, std::pair<int32_t, int32_t> key, const ShimRequest* last, void* stream);
loom_status s_recv(loom_comm* c, void* stream, void* buf, size_t n, int32_t dtype, int32_t peer, int32_t tag) {
  Shim* s = shim(c);
  LOOM_SHIM_SLOT(s, recv);
  receive_deferred(s, {peer, tag}, nullptr, stream);  // posted before this one: their messages come first
  return counted(s, "recv", n, dtype, 1.0, [&] { return recv_now(s, stream, buf, n, dtype, peer, tag); });
}

// A started collective (ABI 1.15) as the shim hands it out: the real plugin's
// request, or none when the plugin has no start and the shim ran it in line, or a
// started receive the plugin did not start (deferred).
struct ShimRequest {
  loom_comm_request* real = nullptr;
  const char* op = "";
  uint64_t bytes = 0;
  std::chrono::steady_clock::time_point start;
  bool deferred = false;
  loom_collective recv{};        // the deferred receive
  bool received = false;         // ... done, before its wait
  loom_status outcome = nullptr;  // ... and what it returned
};

bool starts_p2p(const Shim* s) {
  return s->staging == nullptr && LOOM_HAS_SLOT(s->api, loom_comm_api, wait) && s->api->start != nullptr &&
         s->api->wait != nullptr && (s->api->features & LOOM_COMM_START_P2P) != 0;
}

// Receives the deferred receives of (peer, tag) in posting order, through `last`
// (null: all of them).
void receive_deferred(Shim* s, std::pair<int32_t, int32_t> key, const ShimRequest* last, void* stream) {
  auto it = s->deferred.find(key);
  while (it != s->deferred.end() && !it->second.empty()) {
    ShimRequest* r = it->second.front();
    it->second.pop_front();
    const loom_collective& c = r->recv;
    r->outcome = recv_now(s, stream, c.recv, c.count, c.dtype, c.peer, c.tag);
    r->received = true;
    if (r == last) break;
  }
  if (it != s->deferred.end() && it->second.empty()) s->deferred.erase(it);
}

// A started send or receive (ABI 1.17): the plugin's own when it can start one;
// else the send runs now (sends never wait for the receiver) and the receive is
// deferred, so posting early is always safe and overlaps where the plugin can. A
// receive also waits its turn behind deferred ones of its pair, and the plugin may
// refuse one it cannot post early (LOOM_CODE_UNSUPPORTED): deferred too.
loom_status start_p2p(Shim* s, void* stream, const loom_collective* theirs, loom_comm_request** req) {
  if (!LOOM_HAS_SLOT(theirs, loom_collective, tag))
    return plugins::host_api()->status_create(LOOM_CODE_INVALID_ARGUMENT,
                                              "start: a send or receive needs a loom_collective of ABI 1.17 or later");
  const loom_collective col = loom::copy_of(*theirs);
  const bool send = col.kind == LOOM_COLLECTIVE_SEND;
  if (send ? s->api->send == nullptr : s->api->recv == nullptr) return missing(send ? "send" : "recv");
  auto r = std::make_unique<ShimRequest>();
  r->op = send ? "send" : "recv";
  r->bytes = count_call(s, r->op, col.count, col.dtype, 1.0);
  r->start = std::chrono::steady_clock::now();
  const std::pair<int32_t, int32_t> key{col.peer, col.tag};
  loom_status status = nullptr;
  if (send) {
    status = starts_p2p(s) ? s->api->start(s->comm, stream, &col, &r->real)
                           : send_now(s, stream, col.send, col.count, col.dtype, col.peer, col.tag);
  } else {
    const bool behind = s->deferred.count(key) != 0;
    if (starts_p2p(s) && !behind) {
      status = s->api->start(s->comm, stream, &col, &r->real);
      if (status != nullptr && plugins::host_api()->status_code(status) == LOOM_CODE_UNSUPPORTED) {
        plugins::host_api()->status_destroy(status);
        status = nullptr;
        r->real = nullptr;
      }
    }
    if (status == nullptr && r->real == nullptr) {
      r->deferred = true;
      r->recv = col;
      s->deferred[key].push_back(r.get());
    }
  }
  if (status != nullptr) return status;
  *req = reinterpret_cast<loom_comm_request*>(r.release());
  return nullptr;
}

// Counted as the blocking call of its kind (same op name), so the accounting does
// not depend on whether a strategy overlaps; the observer sees it at its wait,
// spanning start to completion.
loom_status s_start(loom_comm* c, void* stream, const loom_collective* col, loom_comm_request** req) {
  Shim* s = shim(c);
  if (col == nullptr || req == nullptr || !LOOM_HAS_SLOT(col, loom_collective, op))
    return plugins::host_api()->status_create(LOOM_CODE_INVALID_ARGUMENT,
                                              "start: needs a loom_collective (of ABI 1.15 or later) and a request");
  if (col->kind == LOOM_COLLECTIVE_SEND || col->kind == LOOM_COLLECTIVE_RECV) return start_p2p(s, stream, col, req);
  const bool reduces = col->kind != LOOM_COLLECTIVE_ALL_GATHER;
  const char* op = col->kind == LOOM_COLLECTIVE_ALL_REDUCE       ? "all_reduce"
                   : col->kind == LOOM_COLLECTIVE_ALL_GATHER     ? "all_gather"
                   : col->kind == LOOM_COLLECTIVE_REDUCE_SCATTER ? "reduce_scatter"
                                                                 : nullptr;
  if (op == nullptr)
    return plugins::host_api()->status_create(
        LOOM_CODE_INVALID_ARGUMENT, ("start: unknown collective kind " + std::to_string(col->kind)).c_str());
  const uint64_t elements =
      col->kind == LOOM_COLLECTIVE_ALL_REDUCE ? col->count : col->count * static_cast<uint64_t>(s->size);
  const double factor = col->kind == LOOM_COLLECTIVE_ALL_REDUCE ? 2.0 * ring(s) : ring(s);
  auto r = std::make_unique<ShimRequest>();
  r->op = op;
  r->bytes = count_call(s, op, elements, col->dtype, factor);
  r->start = std::chrono::steady_clock::now();
  // Staged buffers are copied on the rank's own thread, so a staged group runs the
  // collective in line, as for a plugin without start.
  const bool has_start = s->staging == nullptr && LOOM_HAS_SLOT(s->api, loom_comm_api, wait) &&
                         s->api->start != nullptr && s->api->wait != nullptr;
  const size_t one = bytes_of(col->count, col->dtype), all = bytes_of(col->count, col->dtype, s->size);
  loom_status status = nullptr;
  if (has_start) {
    status = s->api->start(s->comm, stream, col, &r->real);
  } else if (col->kind == LOOM_COLLECTIVE_ALL_REDUCE) {
    if (s->api->all_reduce == nullptr) return missing("all_reduce");
    status = staged(s, col->send, one, col->recv, one, [&](const void* sb, void* rb) {
      return s->api->all_reduce(s->comm, stream, sb, rb, col->count, col->dtype, col->op);
    });
  } else if (reduces) {
    if (s->api->reduce_scatter == nullptr) return missing("reduce_scatter");
    status = staged(s, col->send, all, col->recv, one, [&](const void* sb, void* rb) {
      return s->api->reduce_scatter(s->comm, stream, sb, rb, col->count, col->dtype, col->op);
    });
  } else {
    if (s->api->all_gather == nullptr) return missing("all_gather");
    status = staged(s, col->send, one, col->recv, all, [&](const void* sb, void* rb) {
      return s->api->all_gather(s->comm, stream, sb, rb, col->count, col->dtype);
    });
  }
  if (status != nullptr) return status;
  *req = reinterpret_cast<loom_comm_request*>(r.release());
  return nullptr;
}

loom_status s_wait(loom_comm* c, loom_comm_request* req, void* stream) {
  Shim* s = shim(c);
  std::unique_ptr<ShimRequest> r(reinterpret_cast<ShimRequest*>(req));
  if (!r) return plugins::host_api()->status_create(LOOM_CODE_INVALID_ARGUMENT, "wait: no request");
  if (r->deferred && !r->received) receive_deferred(s, {r->recv.peer, r->recv.tag}, r.get(), stream);
  loom_status status = r->real != nullptr ? s->api->wait(s->comm, r->real, stream) : r->outcome;
  const CommObserver& observer = s->recorder->observer();
  // A deferred receive did not run beside the caller: not drawn as started.
  if (observer) observer(s->kind, r->op, r->bytes, r->start, !r->deferred);
  return status;
}
#undef LOOM_SHIM_SLOT

// World-level slots stay NULL: the engine calls those on the real comm plugin.
const loom_comm_api* shim_api() {
  static const loom_comm_api api = [] {
    loom_comm_api a{};
    a.struct_size = sizeof(loom_comm_api);
    a.group_destroy = s_group_destroy;
    a.all_reduce = s_all_reduce;
    a.all_gather = s_all_gather;
    a.reduce_scatter = s_reduce_scatter;
    a.all_to_all = s_all_to_all;
    a.all_to_all_v = s_all_to_all_v;
    a.broadcast = s_broadcast;
    a.barrier = s_barrier;
    a.send = s_send;
    a.recv = s_recv;
    a.start = s_start;
    a.wait = s_wait;
    a.features = LOOM_COMM_START_P2P;  // any plugin: what it cannot start is received at the wait
    return a;
  }();
  return &api;
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024.0 && u < 4) {
    b /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", b, units[u]);
  return buf;
}

}  // namespace

loom_group counting_group(const loom_group& real, const std::string& kind, CommStatsRecorder* recorder,
                          const DeviceStaging* staging) {
  if (real.api == nullptr || real.comm == nullptr || recorder == nullptr) return real;
  loom_group g = real;
  g.api = shim_api();
  g.comm = reinterpret_cast<loom_comm*>(new Shim{real.api, real.comm, real.size, kind, recorder, staging});
  return g;
}

uint64_t DeviceStaging::staged_bytes() { return g_staged_bytes.load(); }

CommStats& operator+=(CommStats& a, const CommStats& b) {
  for (const auto& [kind, ops] : b)
    for (const auto& [op, c] : ops) a[kind][op] += c;
  return a;
}

CommCounter total(const CommStats& s, const std::string& kind) {
  CommCounter t;
  auto it = s.find(kind);
  if (it != s.end())
    for (const auto& [op, c] : it->second) t += c;
  return t;
}

nlohmann::ordered_json comm_stats_to_json(const CommStats& s) {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for (const auto& [kind, ops] : s) {
    if (total(s, kind).calls == 0) continue;
    nlohmann::ordered_json& by_op = out[kind];
    for (const auto& [op, c] : ops)
      if (c.calls != 0)
        by_op[op] = {{"calls", c.calls}, {"elements", c.elements}, {"bytes", c.bytes}, {"bus_bytes", c.bus_bytes}};
  }
  return out;
}

std::string comm_stats_summary(const CommStats& s, const std::string& label) {
  std::ostringstream os;
  os << label << ":";
  bool any = false;
  for (const auto& [kind, ops] : s) {
    if (total(s, kind).calls == 0) continue;
    os << (any ? ";" : "") << " " << kind;
    bool first_op = true;
    for (const auto& [op, c] : ops) {
      if (c.calls == 0) continue;
      os << (first_op ? " " : ", ") << c.calls << " " << op << " " << human_bytes(static_cast<double>(c.bytes));
      first_op = false;
    }
    any = true;
  }
  if (!any) os << " none";
  return os.str();
}

}  // namespace loom::runtime
