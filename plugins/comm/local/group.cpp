#include "group.hpp"

#include "../common/reduce.hpp"

#include <loom/cpp/core.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <sstream>
#include <thread>

namespace loom::comm_local {
using comm_common::dtype_name;
using comm_common::reduce_into;
using comm_common::reduce_name;
using comm_common::reducible;

namespace {

using Clock = std::chrono::steady_clock;
using Bytes = unsigned char;

constexpr size_t kChunk = 8192;  // elements reduced per pass (bounded scratch)

const Bytes* at(const void* p, size_t elements, size_t es) {
  return static_cast<const Bytes*>(p) + elements * es;
}
Bytes* at(void* p, size_t elements, size_t es) { return static_cast<Bytes*>(p) + elements * es; }

bool overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  if (a_bytes == 0 || b_bytes == 0) return false;
  auto x = reinterpret_cast<uintptr_t>(a);
  auto y = reinterpret_cast<uintptr_t>(b);
  return x < y + b_bytes && y < x + a_bytes;
}

// a * b, or false on overflow.
bool product(size_t a, size_t b, size_t* out) { return !__builtin_mul_overflow(a, b, out); }

// Half-open range [lo, hi) of elements member `me` of `n` reduces for all_reduce;
// boundaries fall on 64-byte multiples so members do not share cache lines.
std::pair<size_t, size_t> share(int me, int n, size_t count, size_t es) {
  const size_t unit = es >= 64 ? 1 : 64 / es;
  const size_t blocks = (count + unit - 1) / unit;
  const auto un = static_cast<size_t>(n);
  auto start = [&](size_t m) { return m * (blocks / un) + std::min(m, blocks % un); };
  const size_t lo = std::min(count, start(static_cast<size_t>(me)) * unit);
  const size_t hi = std::min(count, start(static_cast<size_t>(me) + 1) * unit);
  return {lo, hi};
}

}  // namespace

const char* op_name(Op op) {
  switch (op) {
    case Op::Barrier: return "barrier";
    case Op::AllReduce: return "all_reduce";
    case Op::AllGather: return "all_gather";
    case Op::ReduceScatter: return "reduce_scatter";
    case Op::AllToAll: return "all_to_all";
    case Op::AllToAllV: return "all_to_all_v";
    case Op::Broadcast: return "broadcast";
  }
  return "collective";
}

Group::Group(std::string kind, std::vector<int32_t> ranks, int64_t timeout_ms, comm_common::Link link)
    : kind_(std::move(kind)), ranks_(std::move(ranks)), timeout_ms_(timeout_ms),
      label_([this] {
        std::ostringstream os;
        os << "group '" << kind_ << "' (ranks [";
        for (size_t i = 0; i < ranks_.size(); ++i) os << (i ? "," : "") << ranks_[i];
        os << "])";
        return os.str();
      }()),
      link_(link),
      here_(ranks_.size(), 0),
      slots_(ranks_.size()) {
  for (size_t i = 0; i < ranks_.size(); ++i) inboxes_.push_back(std::make_unique<Inbox>());
}

std::string Group::member(int m) const { return "rank " + std::to_string(ranks_[static_cast<size_t>(m)]); }

void Group::fail_fast(const char* op) const {
  // poison_message_ is written before poisoned_ is set and never changes after.
  throw Error("comm/local: " + std::string(op) + " on " + label_ +
                  " refused: the group is unusable after an earlier failure: " + poison_message_,
              poison_code_);
}

void Group::poison(int32_t code, const std::string& message) {
  if (poisoned_.load()) return;
  poison_code_ = code;
  poison_message_ = message;
  poisoned_.store(true);
}

void Group::abort(const std::string& message) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    poison(LOOM_CODE_INTERNAL, message);
  }
  cv_.notify_all();
  wake_inboxes();
}

void Group::wake_inboxes() {
  for (auto& ib : inboxes_) {
    { std::lock_guard<std::mutex> lk(ib->mu); }  // a waiter is either before its check or asleep
    ib->cv.notify_all();
  }
}

// ---------------------------------------------------------------------------
// The two-barrier protocol
// ---------------------------------------------------------------------------

void Group::arrive(int me, Op op, int phase) {
  std::unique_lock<std::mutex> lk(mu_);
  if (poisoned_.load()) {
    lk.unlock();
    fail_fast(op_name(op));
  }
  here_[static_cast<size_t>(me)] = 1;
  if (++arrived_ == size()) {  // the last one in opens the barrier
    arrived_ = 0;
    std::fill(here_.begin(), here_.end(), 0);
    ++generation_;
    lk.unlock();
    cv_.notify_all();
    return;
  }
  const uint64_t gen = generation_;
  auto released = [&] { return generation_ != gen || poisoned_.load(); };
  bool woke = true;
  if (timeout_ms_ <= 0) {
    cv_.wait(lk, released);
  } else {
    woke = cv_.wait_until(lk, Clock::now() + std::chrono::milliseconds(timeout_ms_), released);
  }
  if (generation_ != gen) return;
  if (woke) throw Error(poison_message_, poison_code_);  // another member gave up first

  std::vector<int32_t> missing;
  for (int m = 0; m < size(); ++m) {
    if (!here_[static_cast<size_t>(m)]) missing.push_back(ranks_[static_cast<size_t>(m)]);
  }
  std::ostringstream os;
  os << "comm/local: " << op_name(op) << " on " << label_ << " timed out " << after_text(timeout_ms_) << "; "
     << (missing.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < missing.size(); ++i) os << (i ? ", " : "") << missing[i];
  os << (phase == 0 ? " never joined" : " never finished");
  const std::string message = os.str();
  poison(LOOM_CODE_TIMEOUT, message);
  lk.unlock();
  cv_.notify_all();
  wake_inboxes();
  throw Error(message, LOOM_CODE_TIMEOUT);
}

std::string Group::describe(const Call& c) const {
  std::ostringstream os;
  os << op_name(c.op) << "(";
  switch (c.op) {
    case Op::Barrier: break;
    case Op::AllToAllV: os << dtype_name(c.dtype); break;
    case Op::AllReduce:
    case Op::ReduceScatter:
      os << "count=" << c.count << ", " << dtype_name(c.dtype) << ", " << reduce_name(c.reduce);
      break;
    case Op::Broadcast: os << "count=" << c.count << ", " << dtype_name(c.dtype) << ", root=" << c.root; break;
    default: os << "count=" << c.count << ", " << dtype_name(c.dtype); break;
  }
  os << ")";
  return os.str();
}

std::string Group::disagreement() const {
  const Call& ref = slots_[0];
  for (int m = 0; m < size(); ++m) {
    const Call& c = slots_[static_cast<size_t>(m)];
    if (!c.invalid.empty()) {
      return "comm/local: " + std::string(op_name(c.op)) + " on " + label_ + ": " + member(m) +
             " passed invalid arguments: " + c.invalid;
    }
  }
  for (int m = 1; m < size(); ++m) {
    const Call& c = slots_[static_cast<size_t>(m)];
    bool same = c.op == ref.op;
    if (same && c.op != Op::Barrier) same = c.dtype == ref.dtype;
    if (same && c.op != Op::Barrier && c.op != Op::AllToAllV) same = c.count == ref.count;
    if (same && (c.op == Op::AllReduce || c.op == Op::ReduceScatter)) same = c.reduce == ref.reduce;
    if (same && c.op == Op::Broadcast) same = c.root == ref.root;
    if (!same) {
      return "comm/local: mismatched calls on " + label_ + ": " + member(0) + " called " + describe(ref) +
             " but " + member(m) + " called " + describe(c) +
             "; every member must make the same collective calls in the same order";
    }
  }
  if (ref.op == Op::AllToAllV) {
    for (int i = 0; i < size(); ++i) {
      for (int j = 0; j < size(); ++j) {
        const size_t sent = slots_[static_cast<size_t>(i)].send_counts[j];
        const size_t expected = slots_[static_cast<size_t>(j)].recv_counts[i];
        if (sent != expected) {
          std::ostringstream os;
          os << "comm/local: all_to_all_v on " << label_ << ": " << member(i) << " sends " << sent
             << " elements to " << member(j) << " but " << member(j) << " expects " << expected
             << " from " << member(i) << " (send_counts and recv_counts must match)";
          return os.str();
        }
      }
    }
  }
  return {};
}

namespace {

// The link model's view of a call: its algorithm and the bytes that set its cost
// (the buffer for all-reduce and broadcast, one member's piece otherwise).
std::pair<comm_common::CollectiveKind, double> modelled(const Call& c, int me, int members) {
  using K = comm_common::CollectiveKind;
  const double es = static_cast<double>(loom::dtype_size(c.dtype));
  const double bytes = static_cast<double>(c.count) * es;
  switch (c.op) {
    case Op::AllReduce: return {K::AllReduce, bytes};
    case Op::AllGather: return {K::AllGather, bytes};
    case Op::ReduceScatter: return {K::ReduceScatter, bytes};
    case Op::AllToAll: return {K::AllToAll, bytes};
    case Op::AllToAllV: {  // the mean piece this member sends to the others
      double sent = 0;
      for (int j = 0; c.send_counts != nullptr && j < members; ++j)
        if (j != me) sent += static_cast<double>(c.send_counts[j]) * es;
      return {K::AllToAll, members > 1 ? sent / (members - 1) : 0};
    }
    case Op::Broadcast: return {K::Broadcast, bytes};
    case Op::Barrier: return {K::Barrier, 0};
  }
  return {K::Barrier, 0};
}

}  // namespace

template <typename Work>
void Group::collective(int me, Call call, Work&& work) {
  const Op op = call.op;
  if (poisoned_.load()) fail_fast(op_name(op));
  const Clock::time_point start = Clock::now();
  const auto [kind, bytes] = modelled(call, me, size());
  slots_[static_cast<size_t>(me)] = std::move(call);  // read by the others between the barriers
  arrive(me, op, 0);
  const std::string problem = disagreement();  // the same verdict on every member
  std::exception_ptr failure;
  if (problem.empty()) {
    try {
      work();
    } catch (...) {
      failure = std::current_exception();  // still meet the others, then report
    }
  }
  arrive(me, op, 1);  // nobody returns (and reuses buffers) while another may still read them
  if (!problem.empty()) throw Error(problem, LOOM_CODE_INVALID_ARGUMENT);
  if (failure) std::rethrow_exception(failure);
  model_time(start, kind, bytes);
}

// ---------------------------------------------------------------------------
// Collectives
// ---------------------------------------------------------------------------

void Group::all_reduce(int me, const void* send, void* recv, size_t count, int32_t dtype, int32_t op) {
  Call c;
  c.op = Op::AllReduce;
  c.count = count;
  c.dtype = dtype;
  c.reduce = op;
  c.send = send;
  c.recv = recv;
  const size_t es = loom::dtype_size(dtype);
  size_t bytes = 0;
  if (!reducible(dtype, op)) {
    c.invalid = "reduction " + reduce_name(op) + " on " + dtype_name(dtype) + " is not supported";
  } else if (!product(count, es, &bytes)) {
    c.invalid = "count " + std::to_string(count) + " overflows";
  } else if (count > 0 && (send == nullptr || recv == nullptr)) {
    c.invalid = "null buffer with count " + std::to_string(count);
  } else if (send != recv && overlaps(send, bytes, recv, bytes)) {
    c.invalid = "send and recv partially overlap (in-place needs send == recv)";
  }
  collective(me, std::move(c), [&] {
    const int n = size();
    if (n == 1) {
      if (send != recv && bytes) std::memcpy(recv, send, bytes);
      return;
    }
    // This member reduces its slice of the elements for everybody: it reads every
    // member's send slice in group order and writes the result into every member's
    // recv slice. Slices are disjoint, so in-place (send == recv) is safe.
    const auto [lo, hi] = share(me, n, count, es);
    std::vector<Bytes> tmp(std::min(hi - lo, kChunk) * es);
    std::vector<const void*> in(static_cast<size_t>(n));
    for (size_t base = lo; base < hi; base += kChunk) {
      const size_t m = std::min(hi - base, kChunk);
      for (int j = 0; j < n; ++j) in[static_cast<size_t>(j)] = at(slots_[static_cast<size_t>(j)].send, base, es);
      reduce_into(tmp.data(), in.data(), n, m, dtype, op);
      for (int j = 0; j < n; ++j) std::memcpy(at(slots_[static_cast<size_t>(j)].recv, base, es), tmp.data(), m * es);
    }
  });
}

void Group::reduce_scatter(int me, const void* send, void* recv, size_t count, int32_t dtype, int32_t op) {
  Call c;
  c.op = Op::ReduceScatter;
  c.count = count;
  c.dtype = dtype;
  c.reduce = op;
  c.send = send;
  c.recv = recv;
  const size_t es = loom::dtype_size(dtype);
  const auto n = static_cast<size_t>(size());
  size_t bytes = 0, total = 0;
  if (!reducible(dtype, op)) {
    c.invalid = "reduction " + reduce_name(op) + " on " + dtype_name(dtype) + " is not supported";
  } else if (!product(count, es, &bytes) || !product(bytes, n, &total)) {
    c.invalid = "count " + std::to_string(count) + " overflows";
  } else if (count > 0 && (send == nullptr || recv == nullptr)) {
    c.invalid = "null buffer with count " + std::to_string(count);
  } else if (overlaps(send, total, recv, bytes) && recv != at(send, static_cast<size_t>(me) * count, es)) {
    c.invalid = "recv overlaps send but is not block " + std::to_string(me) +
                " of it (in-place needs recv == send + rank * count)";
  }
  collective(me, std::move(c), [&] {
    // This member reduces its own block: block `me` of every member's send, in group order.
    std::vector<Bytes> tmp(std::min(count, kChunk) * es);
    std::vector<const void*> in(n);
    const size_t first = static_cast<size_t>(me) * count;
    for (size_t base = 0; base < count; base += kChunk) {
      const size_t m = std::min(count - base, kChunk);
      for (size_t j = 0; j < n; ++j) in[j] = at(slots_[j].send, first + base, es);
      reduce_into(tmp.data(), in.data(), static_cast<int>(n), m, dtype, op);
      std::memcpy(at(recv, base, es), tmp.data(), m * es);
    }
  });
}

void Group::all_gather(int me, const void* send, void* recv, size_t count, int32_t dtype) {
  Call c;
  c.op = Op::AllGather;
  c.count = count;
  c.dtype = dtype;
  c.send = send;
  c.recv = recv;
  const size_t es = loom::dtype_size(dtype);
  const auto n = static_cast<size_t>(size());
  size_t bytes = 0, total = 0;
  if (es == 0) {
    c.invalid = "unknown dtype " + std::to_string(dtype);
  } else if (!product(count, es, &bytes) || !product(bytes, n, &total)) {
    c.invalid = "count " + std::to_string(count) + " overflows";
  } else if (count > 0 && (send == nullptr || recv == nullptr)) {
    c.invalid = "null buffer with count " + std::to_string(count);
  } else if (overlaps(send, bytes, recv, total) && send != at(recv, static_cast<size_t>(me) * count, es)) {
    c.invalid = "send overlaps recv but is not block " + std::to_string(me) +
                " of it (in-place needs send == recv + rank * count)";
  }
  collective(me, std::move(c), [&] {
    // This member fills its own recv, block j from member j.
    for (size_t j = 0; j < n; ++j) {
      Bytes* dst = at(recv, j * count, es);
      const void* src = slots_[j].send;
      if (bytes && dst != src) std::memcpy(dst, src, bytes);
    }
  });
}

void Group::all_to_all(int me, const void* send, void* recv, size_t count, int32_t dtype) {
  Call c;
  c.op = Op::AllToAll;
  c.count = count;
  c.dtype = dtype;
  c.send = send;
  c.recv = recv;
  const size_t es = loom::dtype_size(dtype);
  const auto n = static_cast<size_t>(size());
  size_t bytes = 0, total = 0;
  std::vector<Bytes> staging;  // in-place: the others read a copy of this member's send
  if (es == 0) {
    c.invalid = "unknown dtype " + std::to_string(dtype);
  } else if (!product(count, es, &bytes) || !product(bytes, n, &total)) {
    c.invalid = "count " + std::to_string(count) + " overflows";
  } else if (count > 0 && (send == nullptr || recv == nullptr)) {
    c.invalid = "null buffer with count " + std::to_string(count);
  } else if (overlaps(send, total, recv, total)) {
    staging.assign(static_cast<const Bytes*>(send), static_cast<const Bytes*>(send) + total);
    c.send = staging.data();
  }
  collective(me, std::move(c), [&] {
    for (size_t j = 0; j < n; ++j) {
      if (bytes) std::memcpy(at(recv, j * count, es), at(slots_[j].send, static_cast<size_t>(me) * count, es), bytes);
    }
  });
}

void Group::all_to_all_v(int me, const void* send, const size_t* send_counts, const size_t* send_displs,
                         void* recv, const size_t* recv_counts, const size_t* recv_displs, int32_t dtype) {
  Call c;
  c.op = Op::AllToAllV;
  c.dtype = dtype;
  c.send = send;
  c.recv = recv;
  c.send_counts = send_counts;
  c.send_displs = send_displs;
  c.recv_counts = recv_counts;
  c.recv_displs = recv_displs;
  const size_t es = loom::dtype_size(dtype);
  const auto n = static_cast<size_t>(size());
  std::vector<Bytes> staging;
  // Extent in elements of each side, from its counts and displacements.
  auto extent = [&](const size_t* counts, const size_t* displs, size_t* out) {
    size_t end = 0;
    for (size_t j = 0; j < n; ++j) {
      size_t e = 0;
      if (__builtin_add_overflow(displs[j], counts[j], &e)) return false;
      if (counts[j] > 0) end = std::max(end, e);
    }
    return product(end, es, out);
  };
  size_t send_bytes = 0, recv_bytes = 0;
  if (es == 0) {
    c.invalid = "unknown dtype " + std::to_string(dtype);
  } else if (!send_counts || !send_displs || !recv_counts || !recv_displs) {
    c.invalid = "null counts or displacements (each needs one entry per group member)";
    c.send_counts = c.recv_counts = nullptr;
  } else if (!extent(send_counts, send_displs, &send_bytes) || !extent(recv_counts, recv_displs, &recv_bytes)) {
    c.invalid = "counts and displacements overflow";
  } else if ((send_bytes && !send) || (recv_bytes && !recv)) {
    c.invalid = "null buffer with non-zero counts";
  } else if (overlaps(send, send_bytes, recv, recv_bytes)) {
    staging.assign(static_cast<const Bytes*>(send), static_cast<const Bytes*>(send) + send_bytes);
    c.send = staging.data();
  }
  collective(me, std::move(c), [&] {
    const auto um = static_cast<size_t>(me);
    for (size_t j = 0; j < n; ++j) {
      const Call& from = slots_[j];
      const size_t k = recv_counts[j];  // == from.send_counts[me], checked by disagreement()
      if (k) std::memcpy(at(recv, recv_displs[j], es), at(from.send, from.send_displs[um], es), k * es);
    }
  });
}

void Group::broadcast(int me, void* buf, size_t count, int32_t dtype, int32_t root) {
  Call c;
  c.op = Op::Broadcast;
  c.count = count;
  c.dtype = dtype;
  c.root = root;
  c.send = buf;
  c.recv = buf;
  const size_t es = loom::dtype_size(dtype);
  size_t bytes = 0;
  if (es == 0) {
    c.invalid = "unknown dtype " + std::to_string(dtype);
  } else if (root < 0 || root >= size()) {
    c.invalid = "root " + std::to_string(root) + " is not a rank of the group (size " + std::to_string(size()) + ")";
  } else if (!product(count, es, &bytes)) {
    c.invalid = "count " + std::to_string(count) + " overflows";
  } else if (count > 0 && buf == nullptr) {
    c.invalid = "null buffer with count " + std::to_string(count);
  }
  collective(me, std::move(c), [&] {
    const void* src = slots_[static_cast<size_t>(root)].send;
    if (me != root && bytes && src != buf) std::memcpy(buf, src, bytes);
  });
}

void Group::barrier(int me) {
  Call c;
  c.op = Op::Barrier;
  collective(me, std::move(c), [] {});
}

// ---------------------------------------------------------------------------
// Point to point
// ---------------------------------------------------------------------------

void Group::send(int me, const void* buf, size_t count, int32_t dtype, int32_t peer, int32_t tag) {
  if (poisoned_.load()) fail_fast("send");
  const size_t es = loom::dtype_size(dtype);
  size_t bytes = 0;
  LOOM_REQUIRE(es != 0, "comm/local: send on " << label_ << ": unknown dtype " << dtype);
  LOOM_REQUIRE(peer >= 0 && peer < size(), "comm/local: send on " << label_ << " from " << member(me)
                                                << ": peer " << peer << " is not a rank of the group (size "
                                                << size() << "; peers are ranks within the group)");
  LOOM_REQUIRE(product(count, es, &bytes), "comm/local: send on " << label_ << ": count " << count << " overflows");
  LOOM_REQUIRE(bytes == 0 || buf != nullptr, "comm/local: send on " << label_ << ": null buffer with count " << count);
  Message msg{dtype, count, {}, Clock::now(), bytes};
  Inbox& ib = *inboxes_[static_cast<size_t>(peer)];
  {
    std::lock_guard<std::mutex> lk(ib.mu);
    Channel& ch = ib.channels[{me, tag}];
    const uint64_t number = ch.sent++;
    const auto posted = ch.waiting.find(number);
    if (posted != ch.waiting.end() && posted->second.dtype == dtype && posted->second.count == count) {
      if (bytes) std::memcpy(posted->second.buf, buf, bytes);  // delivered; a mismatch is reported at the wait
    } else {
      msg.data.assign(static_cast<const Bytes*>(buf), static_cast<const Bytes*>(buf) + bytes);
    }
    if (posted != ch.waiting.end()) ch.waiting.erase(posted);
    ch.arrived.emplace(number, std::move(msg));
  }
  ib.cv.notify_all();
}

Group::PostedRecv Group::post_recv(int me, void* buf, size_t count, int32_t dtype, int32_t peer, int32_t tag) {
  if (poisoned_.load()) fail_fast("recv");
  const size_t es = loom::dtype_size(dtype);
  size_t bytes = 0;
  LOOM_REQUIRE(es != 0, "comm/local: recv on " << label_ << ": unknown dtype " << dtype);
  LOOM_REQUIRE(peer >= 0 && peer < size(), "comm/local: recv on " << label_ << " at " << member(me)
                                                << ": peer " << peer << " is not a rank of the group (size "
                                                << size() << "; peers are ranks within the group)");
  LOOM_REQUIRE(product(count, es, &bytes), "comm/local: recv on " << label_ << ": count " << count << " overflows");
  LOOM_REQUIRE(bytes == 0 || buf != nullptr, "comm/local: recv on " << label_ << ": null buffer with count " << count);
  PostedRecv r{buf, count, dtype, peer, tag, 0, Clock::now()};
  Inbox& ib = *inboxes_[static_cast<size_t>(me)];
  std::lock_guard<std::mutex> lk(ib.mu);
  Channel& ch = ib.channels[{peer, tag}];
  r.number = ch.posted++;
  if (ch.arrived.count(r.number) == 0) ch.waiting.emplace(r.number, r);
  return r;
}

void Group::complete_recv(int me, const PostedRecv& r) {
  Inbox& ib = *inboxes_[static_cast<size_t>(me)];
  const std::pair<int, int32_t> key{r.peer, r.tag};
  Message msg;
  bool got = false;
  bool woke = true;
  {
    std::unique_lock<std::mutex> lk(ib.mu);
    Channel& ch = ib.channels[key];  // the map's nodes stay put while others are added
    auto ready = [&] { return ch.arrived.count(r.number) != 0 || poisoned_.load(); };
    if (timeout_ms_ <= 0) {
      ib.cv.wait(lk, ready);
    } else {
      woke = ib.cv.wait_until(lk, Clock::now() + std::chrono::milliseconds(timeout_ms_), ready);
    }
    auto it = ch.arrived.find(r.number);
    if (it != ch.arrived.end()) {
      msg = std::move(it->second);
      ch.arrived.erase(it);
      got = true;
    }
    if (!got) ch.waiting.erase(r.number);  // failing: no send may write into buf any more
  }
  if (!got && woke) fail_fast("recv");  // poisoned while waiting
  if (!got) {
    std::ostringstream os;
    os << "comm/local: recv on " << label_ << " timed out " << after_text(timeout_ms_) << "; " << member(me)
       << " waited for tag " << r.tag << " from peer " << r.peer << " (rank " << ranks_[static_cast<size_t>(r.peer)]
       << "), which never sent it";
    const std::string message = os.str();
    {
      std::lock_guard<std::mutex> lk(mu_);
      poison(LOOM_CODE_TIMEOUT, message);
    }
    cv_.notify_all();
    wake_inboxes();
    throw Error(message, LOOM_CODE_TIMEOUT);
  }
  if (msg.dtype != r.dtype || msg.count != r.count) {
    std::ostringstream os;
    os << "comm/local: recv on " << label_ << ": " << member(me) << " expects " << r.count << " "
       << dtype_name(r.dtype) << " elements with tag " << r.tag << " from peer " << r.peer << " (rank "
       << ranks_[static_cast<size_t>(r.peer)] << ") but it sent " << msg.count << " " << dtype_name(msg.dtype);
    throw Error(os.str(), LOOM_CODE_INVALID_ARGUMENT);
  }
  if (!msg.data.empty()) std::memcpy(r.buf, msg.data.data(), msg.data.size());
  // The transfer starts once both sides are there and takes the link's time.
  if (!link_.ideal())
    comm_common::wait_until(std::max(msg.sent_at, r.posted_at), link_.transfer_s(static_cast<double>(msg.bytes)));
}

void Group::recv(int me, void* buf, size_t count, int32_t dtype, int32_t peer, int32_t tag) {
  complete_recv(me, post_recv(me, buf, count, dtype, peer, tag));
}

void Group::model_time(Clock::time_point start, comm_common::CollectiveKind kind, double bytes) const {
  if (!link_.ideal()) comm_common::wait_until(start, comm_common::collective_seconds(link_, kind, size(), bytes));
}

}  // namespace loom::comm_local
