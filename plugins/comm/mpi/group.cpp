#include "group.hpp"

#include "../common/reduce.hpp"

#include <loom/cpp/core.hpp>

#include <algorithm>
#include <climits>
#include <cstring>
#include <sstream>

namespace loom::comm_mpi {
using comm_common::dtype_name;
using comm_common::reduce_into;
using comm_common::reduce_name;
using comm_common::reducible;

namespace {

using Bytes = unsigned char;

constexpr size_t kMaxMessage = size_t{1} << 30;  // larger transfers travel as several messages
constexpr int64_t kP2PMagic = 0x6c6f6f6d70327021;  // "loomp2p!"
constexpr size_t kHeaderWords = 8;                 // op, count, dtype, reduce, root, seq, invalid, ncounts

const Bytes* at(const void* p, size_t elements, size_t es) { return static_cast<const Bytes*>(p) + elements * es; }
Bytes* at(void* p, size_t elements, size_t es) { return static_cast<Bytes*>(p) + elements * es; }

bool overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  if (a_bytes == 0 || b_bytes == 0) return false;
  auto x = reinterpret_cast<uintptr_t>(a);
  auto y = reinterpret_cast<uintptr_t>(b);
  return x < y + b_bytes && y < x + a_bytes;
}

bool product(size_t a, size_t b, size_t* out) { return !__builtin_mul_overflow(a, b, out); }

// The elements [lo, hi) member `me` of `n` reduces in all_reduce (comm/local's split:
// boundaries on 64-byte multiples). Any split gives the same result; this one keeps
// the two backends' work alike.
std::pair<size_t, size_t> share(int me, int n, size_t count, size_t es) {
  const size_t unit = es >= 64 ? 1 : 64 / es;
  const size_t blocks = (count + unit - 1) / unit;
  const auto un = static_cast<size_t>(n);
  auto start = [&](size_t m) { return m * (blocks / un) + std::min(m, blocks % un); };
  const size_t lo = std::min(count, start(static_cast<size_t>(me)) * unit);
  const size_t hi = std::min(count, start(static_cast<size_t>(me) + 1) * unit);
  return {lo, hi};
}

std::string rank_list(const std::vector<int32_t>& ranks) {
  std::ostringstream os;
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
  return os.str();
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
    case Op::GroupCreate: return "group_create";
  }
  return "collective";
}

Group::Group(std::shared_ptr<World> world, std::string kind, std::vector<int32_t> ranks, int me)
    : world_(std::move(world)), kind_(std::move(kind)), ranks_(std::move(ranks)), me_(me),
      label_([this] {
        std::ostringstream os;
        os << "group '" << kind_ << "' (ranks [";
        for (size_t i = 0; i < ranks_.size(); ++i) os << (i ? "," : "") << ranks_[i];
        os << "])";
        return os.str();
      }()) {
  tag_ = world_->claim_tag(kind_, ranks_);
}

Group::~Group() { world_->release_tag(tag_); }

std::string Group::member(int m) const { return "rank " + std::to_string(ranks_[static_cast<size_t>(m)]); }

std::string Group::where(Op op) const { return std::string("comm/mpi: ") + op_name(op) + " on " + label_; }

std::exception_ptr Group::poisoned(const char* op) const {
  if (!poisoned_) return nullptr;
  std::string story;
  {
    std::lock_guard<std::mutex> lk(poison_mu_);
    story = poison_message_;
  }
  return std::make_exception_ptr(Error(std::string("comm/mpi: ") + op + " on " + label_ +
                                           " refused: the group is unusable after an earlier failure: " + story,
                                       LOOM_CODE_TIMEOUT));
}

void Group::fail_fast(const char* op) const { std::rethrow_exception(poisoned(op)); }

void Group::poison(const std::string& message) {
  std::lock_guard<std::mutex> lk(poison_mu_);
  if (poisoned_) return;
  poison_message_ = message;
  poisoned_ = true;
}

std::string Group::describe(const Header& h) const {
  const Op op = static_cast<Op>(h.op);
  std::ostringstream os;
  os << op_name(op) << "(";
  switch (op) {
    case Op::Barrier:
    case Op::GroupCreate: break;
    case Op::AllToAllV: os << dtype_name(static_cast<int32_t>(h.dtype)); break;
    case Op::AllReduce:
    case Op::ReduceScatter:
      os << "count=" << h.count << ", " << dtype_name(static_cast<int32_t>(h.dtype)) << ", "
         << reduce_name(static_cast<int32_t>(h.reduce));
      break;
    case Op::Broadcast:
      os << "count=" << h.count << ", " << dtype_name(static_cast<int32_t>(h.dtype)) << ", root=" << h.root;
      break;
    default: os << "count=" << h.count << ", " << dtype_name(static_cast<int32_t>(h.dtype)); break;
  }
  os << ") as call #" << h.seq + 1 << " on the group";
  return os.str();
}

std::string Group::disagreement(const std::vector<Header>& all) const {
  const Header& ref = all[0];
  for (int m = 1; m < size(); ++m) {
    const Header& c = all[static_cast<size_t>(m)];
    const Op op = static_cast<Op>(c.op);
    bool same = c.op == ref.op && c.seq == ref.seq;
    if (same && op != Op::Barrier && op != Op::GroupCreate) same = c.dtype == ref.dtype;
    if (same && op != Op::Barrier && op != Op::GroupCreate && op != Op::AllToAllV) same = c.count == ref.count;
    if (same && (op == Op::AllReduce || op == Op::ReduceScatter)) same = c.reduce == ref.reduce;
    if (same && op == Op::Broadcast) same = c.root == ref.root;
    if (!same) {
      return "comm/mpi: mismatched calls on " + label_ + ": " + member(0) + " called " + describe(ref) + " but " +
             member(m) + " called " + describe(c) +
             "; every member must make the same collective calls in the same order";
    }
  }
  if (static_cast<Op>(ref.op) == Op::AllToAllV) {
    for (int i = 0; i < size(); ++i) {
      for (int j = 0; j < size(); ++j) {
        const int64_t sent = all[static_cast<size_t>(i)].send_counts[static_cast<size_t>(j)];
        const int64_t expected = all[static_cast<size_t>(j)].recv_counts[static_cast<size_t>(i)];
        if (sent != expected) {
          std::ostringstream os;
          os << "comm/mpi: all_to_all_v on " << label_ << ": " << member(i) << " sends " << sent << " elements to "
             << member(j) << " but " << member(j) << " expects " << expected << " from " << member(i)
             << " (send_counts and recv_counts must match)";
          return os.str();
        }
      }
    }
  }
  return {};
}

void Group::handshake(Op op, Header mine, const std::string& invalid) {
  if (poisoned_) fail_fast(op_name(op));
  mine.op = static_cast<int64_t>(op);
  mine.seq = seq_++;
  mine.invalid = invalid.empty() ? 0 : 1;
  const int n = size();
  if (n == 1) {
    if (!invalid.empty()) throw Error(where(op) + ": " + invalid, LOOM_CODE_INVALID_ARGUMENT);
    return;
  }
  const size_t un = static_cast<size_t>(n);
  const size_t words = kHeaderWords + 2 * un;
  std::vector<int64_t> out(words, 0);
  out[0] = mine.op, out[1] = mine.count, out[2] = mine.dtype, out[3] = mine.reduce;
  out[4] = mine.root, out[5] = mine.seq, out[6] = mine.invalid;
  out[7] = static_cast<int64_t>(mine.send_counts.size());
  for (size_t j = 0; j < mine.send_counts.size() && j < un; ++j) {
    out[kHeaderWords + j] = mine.send_counts[j];
    out[kHeaderWords + un + j] = mine.recv_counts[j];
  }
  std::vector<std::vector<int64_t>> in(un, std::vector<int64_t>(words, 0));
  std::vector<MPI_Request> reqs;
  std::vector<int> recv_of;  // request index -> member whose header it receives (-1: a send)
  {
    std::lock_guard<std::mutex> lk(mpi_mutex());
    const int bytes = static_cast<int>(words * sizeof(int64_t));
    for (int p = 0; p < n; ++p) {
      if (p == me_) continue;
      MPI_Request r;
      MPI_Irecv(in[static_cast<size_t>(p)].data(), bytes, MPI_BYTE, ranks_[static_cast<size_t>(p)], tag_,
                world_->coll(), &r);
      reqs.push_back(r);
      recv_of.push_back(p);
    }
    for (int p = 0; p < n; ++p) {
      if (p == me_) continue;
      MPI_Request r;
      MPI_Isend(out.data(), bytes, MPI_BYTE, ranks_[static_cast<size_t>(p)], tag_, world_->coll(), &r);
      reqs.push_back(r);
      recv_of.push_back(-1);
    }
  }
  bool done = false;
  try {
    done = world_->wait(reqs, nullptr, world_->deadline(), where(op));
  } catch (...) {
    world_->discard(reqs);
    throw;
  }
  if (!done) {
    std::vector<int32_t> missing;
    for (size_t i = 0; i < reqs.size(); ++i)
      if (reqs[i] != MPI_REQUEST_NULL && recv_of[i] >= 0) missing.push_back(ranks_[static_cast<size_t>(recv_of[i])]);
    std::ostringstream os;
    os << where(op) << " timed out " << after_text(world_->settings().timeout_ms) << "; ";
    if (missing.empty()) {
      os << "the other members never received this member's call";
    } else {
      os << (missing.size() == 1 ? "rank " : "ranks ") << rank_list(missing) << " never joined";
    }
    poison(os.str());
    world_->discard(reqs);
    throw Error(os.str(), LOOM_CODE_TIMEOUT);
  }

  std::vector<Header> all(un);
  for (size_t p = 0; p < un; ++p) {
    if (static_cast<int>(p) == me_) {
      all[p] = mine;
      all[p].send_counts.resize(un, 0);
      all[p].recv_counts.resize(un, 0);
      continue;
    }
    const std::vector<int64_t>& w = in[p];
    Header& h = all[p];
    h.op = w[0], h.count = w[1], h.dtype = w[2], h.reduce = w[3], h.root = w[4], h.seq = w[5], h.invalid = w[6];
    h.send_counts.assign(w.begin() + kHeaderWords, w.begin() + static_cast<std::ptrdiff_t>(kHeaderWords + un));
    h.recv_counts.assign(w.begin() + static_cast<std::ptrdiff_t>(kHeaderWords + un), w.end());
  }
  // Invalid arguments first (the same verdict everywhere), then disagreements.
  for (int m = 0; m < n; ++m) {
    if (!all[static_cast<size_t>(m)].invalid) continue;
    if (m == me_) throw Error(where(op) + ": " + member(m) + " passed invalid arguments: " + invalid,
                              LOOM_CODE_INVALID_ARGUMENT);
    throw Error(where(op) + ": " + member(m) + " passed invalid arguments (its own error says which)",
                LOOM_CODE_INVALID_ARGUMENT);
  }
  if (const std::string problem = disagreement(all); !problem.empty())
    throw Error(problem, LOOM_CODE_INVALID_ARGUMENT);
}

void Group::move(Op op, const std::vector<Xfer>& sends, const std::vector<Xfer>& recvs) {
  std::vector<MPI_Request> reqs;
  std::vector<int> peer_of;  // request index -> member; >= 0 receive from, < 0: -(member+1) send to
  {
    std::lock_guard<std::mutex> lk(mpi_mutex());
    for (const Xfer& x : recvs) {
      for (size_t off = 0; off < x.bytes; off += kMaxMessage) {
        MPI_Request r;
        MPI_Irecv(static_cast<Bytes*>(x.dst) + off, static_cast<int>(std::min(kMaxMessage, x.bytes - off)), MPI_BYTE,
                  ranks_[static_cast<size_t>(x.peer)], tag_, world_->coll(), &r);
        reqs.push_back(r);
        peer_of.push_back(x.peer);
      }
    }
    for (const Xfer& x : sends) {
      for (size_t off = 0; off < x.bytes; off += kMaxMessage) {
        MPI_Request r;
        MPI_Isend(static_cast<const Bytes*>(x.src) + off, static_cast<int>(std::min(kMaxMessage, x.bytes - off)),
                  MPI_BYTE, ranks_[static_cast<size_t>(x.peer)], tag_, world_->coll(), &r);
        reqs.push_back(r);
        peer_of.push_back(-(x.peer + 1));
      }
    }
  }
  bool done = false;
  try {
    done = world_->wait(reqs, nullptr, world_->deadline(), where(op));
  } catch (const Error& e) {
    poison(e.what());  // data may be half moved: the group cannot go on
    world_->discard(reqs);
    throw;
  }
  if (done) return;
  std::vector<int32_t> silent, deaf;
  for (size_t i = 0; i < reqs.size(); ++i) {
    if (reqs[i] == MPI_REQUEST_NULL) continue;
    if (peer_of[i] >= 0) {
      silent.push_back(ranks_[static_cast<size_t>(peer_of[i])]);
    } else {
      deaf.push_back(ranks_[static_cast<size_t>(-peer_of[i] - 1)]);
    }
  }
  auto unique = [](std::vector<int32_t>& v) {
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
  };
  unique(silent);
  unique(deaf);
  std::ostringstream os;
  os << where(op) << " timed out " << after_text(world_->settings().timeout_ms) << "; ";
  const std::vector<int32_t>& who = silent.empty() ? deaf : silent;
  os << (who.size() == 1 ? "rank " : "ranks ") << rank_list(who) << " joined but never "
     << (silent.empty() ? "received this member's data" : "sent its data");
  poison(os.str());
  world_->discard(reqs);
  throw Error(os.str(), LOOM_CODE_TIMEOUT);
}

void Group::join() {
  Header h;
  handshake(Op::GroupCreate, h, "");
}

// ---------------------------------------------------------------------------
// Collectives
// ---------------------------------------------------------------------------

void Group::all_reduce(const void* send, void* recv, size_t count, int32_t dtype, int32_t op) {
  const size_t es = loom::dtype_size(dtype);
  size_t bytes = 0;
  std::string invalid;
  if (!reducible(dtype, op)) {
    invalid = "reduction " + reduce_name(op) + " on " + dtype_name(dtype) + " is not supported";
  } else if (!product(count, es, &bytes)) {
    invalid = "count " + std::to_string(count) + " overflows";
  } else if (count > 0 && (send == nullptr || recv == nullptr)) {
    invalid = "null buffer with count " + std::to_string(count);
  } else if (send != recv && overlaps(send, bytes, recv, bytes)) {
    invalid = "send and recv partially overlap (in-place needs send == recv)";
  }
  Header h;
  h.count = static_cast<int64_t>(count);
  h.dtype = dtype;
  h.reduce = op;
  handshake(Op::AllReduce, h, invalid);
  const int n = size();
  if (n == 1) {
    if (send != recv && bytes) std::memcpy(recv, send, bytes);
    return;
  }
  const auto [lo, hi] = share(me_, n, count, es);
  const size_t mine = hi - lo;
  std::vector<Bytes> scratch(mine * es * static_cast<size_t>(n));
  std::vector<Xfer> sends, recvs;
  for (int p = 0; p < n; ++p) {
    if (p == me_) continue;
    const auto [plo, phi] = share(p, n, count, es);
    if (phi > plo) sends.push_back({p, at(send, plo, es), nullptr, (phi - plo) * es});
    if (mine) recvs.push_back({p, nullptr, scratch.data() + static_cast<size_t>(p) * mine * es, mine * es});
  }
  move(Op::AllReduce, sends, recvs);
  // Member j's contribution to this slice, in group order: the in-order kernel of comm/local.
  std::vector<const void*> in(static_cast<size_t>(n));
  for (int j = 0; j < n; ++j)
    in[static_cast<size_t>(j)] = j == me_ ? static_cast<const void*>(at(send, lo, es))
                                          : scratch.data() + static_cast<size_t>(j) * mine * es;
  std::vector<Bytes> reduced(mine * es);
  reduce_into(reduced.data(), in.data(), n, mine, dtype, op);
  sends.clear();
  recvs.clear();
  for (int p = 0; p < n; ++p) {
    if (p == me_) continue;
    const auto [plo, phi] = share(p, n, count, es);
    if (mine) sends.push_back({p, reduced.data(), nullptr, mine * es});
    if (phi > plo) recvs.push_back({p, nullptr, at(recv, plo, es), (phi - plo) * es});
  }
  move(Op::AllReduce, sends, recvs);
  if (mine) std::memcpy(at(recv, lo, es), reduced.data(), mine * es);
}

void Group::reduce_scatter(const void* send, void* recv, size_t count, int32_t dtype, int32_t op) {
  const size_t es = loom::dtype_size(dtype);
  const auto n = static_cast<size_t>(size());
  const auto me = static_cast<size_t>(me_);
  size_t bytes = 0, total = 0;
  std::string invalid;
  if (!reducible(dtype, op)) {
    invalid = "reduction " + reduce_name(op) + " on " + dtype_name(dtype) + " is not supported";
  } else if (!product(count, es, &bytes) || !product(bytes, n, &total)) {
    invalid = "count " + std::to_string(count) + " overflows";
  } else if (count > 0 && (send == nullptr || recv == nullptr)) {
    invalid = "null buffer with count " + std::to_string(count);
  } else if (overlaps(send, total, recv, bytes) && recv != at(send, me * count, es)) {
    invalid = "recv overlaps send but is not block " + std::to_string(me) +
              " of it (in-place needs recv == send + rank * count)";
  }
  Header h;
  h.count = static_cast<int64_t>(count);
  h.dtype = dtype;
  h.reduce = op;
  handshake(Op::ReduceScatter, h, invalid);
  std::vector<Bytes> scratch(bytes * n);
  std::vector<Xfer> sends, recvs;
  for (size_t p = 0; p < n && bytes; ++p) {
    if (p == me) continue;
    sends.push_back({static_cast<int>(p), at(send, p * count, es), nullptr, bytes});
    recvs.push_back({static_cast<int>(p), nullptr, scratch.data() + p * bytes, bytes});
  }
  move(Op::ReduceScatter, sends, recvs);
  std::vector<const void*> in(n);
  for (size_t j = 0; j < n; ++j)
    in[j] = j == me ? static_cast<const void*>(at(send, me * count, es)) : scratch.data() + j * bytes;
  std::vector<Bytes> reduced(bytes);
  reduce_into(reduced.data(), in.data(), static_cast<int>(n), count, dtype, op);
  if (bytes) std::memcpy(recv, reduced.data(), bytes);
}

void Group::all_gather(const void* send, void* recv, size_t count, int32_t dtype) {
  const size_t es = loom::dtype_size(dtype);
  const auto n = static_cast<size_t>(size());
  const auto me = static_cast<size_t>(me_);
  size_t bytes = 0, total = 0;
  std::string invalid;
  if (es == 0) {
    invalid = "unknown dtype " + std::to_string(dtype);
  } else if (!product(count, es, &bytes) || !product(bytes, n, &total)) {
    invalid = "count " + std::to_string(count) + " overflows";
  } else if (count > 0 && (send == nullptr || recv == nullptr)) {
    invalid = "null buffer with count " + std::to_string(count);
  } else if (overlaps(send, bytes, recv, total) && send != at(recv, me * count, es)) {
    invalid = "send overlaps recv but is not block " + std::to_string(me) +
              " of it (in-place needs send == recv + rank * count)";
  }
  Header h;
  h.count = static_cast<int64_t>(count);
  h.dtype = dtype;
  handshake(Op::AllGather, h, invalid);
  std::vector<Xfer> sends, recvs;
  for (size_t p = 0; p < n && bytes; ++p) {
    if (p == me) continue;
    sends.push_back({static_cast<int>(p), send, nullptr, bytes});
    recvs.push_back({static_cast<int>(p), nullptr, at(recv, p * count, es), bytes});
  }
  move(Op::AllGather, sends, recvs);
  Bytes* dst = at(recv, me * count, es);
  if (bytes && dst != send) std::memcpy(dst, send, bytes);
}

void Group::all_to_all(const void* send, void* recv, size_t count, int32_t dtype) {
  const size_t es = loom::dtype_size(dtype);
  const auto n = static_cast<size_t>(size());
  const auto me = static_cast<size_t>(me_);
  size_t bytes = 0, total = 0;
  std::string invalid;
  std::vector<Bytes> staging;  // in-place: send from a copy
  if (es == 0) {
    invalid = "unknown dtype " + std::to_string(dtype);
  } else if (!product(count, es, &bytes) || !product(bytes, n, &total)) {
    invalid = "count " + std::to_string(count) + " overflows";
  } else if (count > 0 && (send == nullptr || recv == nullptr)) {
    invalid = "null buffer with count " + std::to_string(count);
  } else if (overlaps(send, total, recv, total)) {
    staging.assign(static_cast<const Bytes*>(send), static_cast<const Bytes*>(send) + total);
    send = staging.data();
  }
  Header h;
  h.count = static_cast<int64_t>(count);
  h.dtype = dtype;
  handshake(Op::AllToAll, h, invalid);
  std::vector<Xfer> sends, recvs;
  for (size_t p = 0; p < n && bytes; ++p) {
    if (p == me) continue;
    sends.push_back({static_cast<int>(p), at(send, p * count, es), nullptr, bytes});
    recvs.push_back({static_cast<int>(p), nullptr, at(recv, p * count, es), bytes});
  }
  move(Op::AllToAll, sends, recvs);
  if (bytes) std::memcpy(at(recv, me * count, es), at(send, me * count, es), bytes);
}

void Group::all_to_all_v(const void* send, const size_t* send_counts, const size_t* send_displs, void* recv,
                         const size_t* recv_counts, const size_t* recv_displs, int32_t dtype) {
  const size_t es = loom::dtype_size(dtype);
  const auto n = static_cast<size_t>(size());
  const auto me = static_cast<size_t>(me_);
  std::vector<Bytes> staging;
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
  std::string invalid;
  const bool have_counts = send_counts && send_displs && recv_counts && recv_displs;
  if (es == 0) {
    invalid = "unknown dtype " + std::to_string(dtype);
  } else if (!have_counts) {
    invalid = "null counts or displacements (each needs one entry per group member)";
  } else if (!extent(send_counts, send_displs, &send_bytes) || !extent(recv_counts, recv_displs, &recv_bytes)) {
    invalid = "counts and displacements overflow";
  } else if ((send_bytes && !send) || (recv_bytes && !recv)) {
    invalid = "null buffer with non-zero counts";
  } else if (overlaps(send, send_bytes, recv, recv_bytes)) {
    staging.assign(static_cast<const Bytes*>(send), static_cast<const Bytes*>(send) + send_bytes);
    send = staging.data();
  }
  Header h;
  h.dtype = dtype;
  if (have_counts) {
    h.send_counts.assign(send_counts, send_counts + n);
    h.recv_counts.assign(recv_counts, recv_counts + n);
  } else {
    h.send_counts.assign(n, 0);
    h.recv_counts.assign(n, 0);
  }
  handshake(Op::AllToAllV, h, invalid);
  std::vector<Xfer> sends, recvs;
  for (size_t p = 0; p < n; ++p) {
    if (p == me) continue;
    if (send_counts[p]) sends.push_back({static_cast<int>(p), at(send, send_displs[p], es), nullptr, send_counts[p] * es});
    if (recv_counts[p]) recvs.push_back({static_cast<int>(p), nullptr, at(recv, recv_displs[p], es), recv_counts[p] * es});
  }
  move(Op::AllToAllV, sends, recvs);
  if (recv_counts[me]) std::memcpy(at(recv, recv_displs[me], es), at(send, send_displs[me], es), recv_counts[me] * es);
}

void Group::broadcast(void* buf, size_t count, int32_t dtype, int32_t root) {
  const size_t es = loom::dtype_size(dtype);
  size_t bytes = 0;
  std::string invalid;
  if (es == 0) {
    invalid = "unknown dtype " + std::to_string(dtype);
  } else if (root < 0 || root >= size()) {
    invalid = "root " + std::to_string(root) + " is not a rank of the group (size " + std::to_string(size()) + ")";
  } else if (!product(count, es, &bytes)) {
    invalid = "count " + std::to_string(count) + " overflows";
  } else if (count > 0 && buf == nullptr) {
    invalid = "null buffer with count " + std::to_string(count);
  }
  Header h;
  h.count = static_cast<int64_t>(count);
  h.dtype = dtype;
  h.root = root;
  handshake(Op::Broadcast, h, invalid);
  std::vector<Xfer> sends, recvs;
  if (bytes && size() > 1) {
    if (me_ == root) {
      for (int p = 0; p < size(); ++p)
        if (p != me_) sends.push_back({p, buf, nullptr, bytes});
    } else {
      recvs.push_back({root, nullptr, buf, bytes});
    }
  }
  move(Op::Broadcast, sends, recvs);
}

void Group::barrier() { handshake(Op::Barrier, Header{}, ""); }

// ---------------------------------------------------------------------------
// Point to point
// ---------------------------------------------------------------------------

void Group::send(const void* buf, size_t count, int32_t dtype, int32_t peer, int32_t tag) {
  if (poisoned_) fail_fast("send");
  if (world_->failed()) throw Error("comm/mpi: send on " + label_ + " refused: the run was aborted", LOOM_CODE_INTERNAL);
  const size_t es = loom::dtype_size(dtype);
  size_t bytes = 0;
  LOOM_REQUIRE(es != 0, "comm/mpi: send on " << label_ << ": unknown dtype " << dtype);
  LOOM_REQUIRE(peer >= 0 && peer < size(), "comm/mpi: send on " << label_ << " from " << member(me_) << ": peer "
                                               << peer << " is not a rank of the group (size " << size()
                                               << "; peers are ranks within the group)");
  LOOM_REQUIRE(product(count, es, &bytes) && bytes <= static_cast<size_t>(INT_MAX) - 64,
               "comm/mpi: send on " << label_ << ": " << count << " elements of " << dtype_name(dtype)
                                    << " exceed comm/mpi's 2 GiB limit per message; send it in parts");
  LOOM_REQUIRE(bytes == 0 || buf != nullptr, "comm/mpi: send on " << label_ << ": null buffer with count " << count);
  const int64_t head[4] = {kP2PMagic, tag, dtype, static_cast<int64_t>(count)};
  auto msg = std::make_shared<std::vector<Bytes>>(sizeof head + bytes);
  std::memcpy(msg->data(), head, sizeof head);
  if (bytes) std::memcpy(msg->data() + sizeof head, buf, bytes);
  std::lock_guard<std::mutex> lk(mpi_mutex());
  MPI_Request r;
  const int rc = MPI_Isend(msg->data(), static_cast<int>(msg->size()), MPI_BYTE, ranks_[static_cast<size_t>(peer)],
                           tag_, world_->p2p(), &r);
  if (rc != MPI_SUCCESS) throw Error("comm/mpi: send on " + label_ + ": " + mpi_error_text(rc));
  world_->keep_send(r, std::move(msg));
}

void Group::check_recv(const void* buf, size_t count, int32_t dtype, int32_t peer) const {
  if (poisoned_) fail_fast("recv");
  const size_t es = loom::dtype_size(dtype);
  size_t bytes = 0;
  LOOM_REQUIRE(es != 0, "comm/mpi: recv on " << label_ << ": unknown dtype " << dtype);
  LOOM_REQUIRE(peer >= 0 && peer < size(), "comm/mpi: recv on " << label_ << " at " << member(me_) << ": peer "
                                               << peer << " is not a rank of the group (size " << size()
                                               << "; peers are ranks within the group)");
  LOOM_REQUIRE(product(count, es, &bytes), "comm/mpi: recv on " << label_ << ": count " << count << " overflows");
  LOOM_REQUIRE(bytes == 0 || buf != nullptr, "comm/mpi: recv on " << label_ << ": null buffer with count " << count);
}

bool Group::take_locked(void* buf, size_t count, int32_t dtype, int32_t peer, int32_t tag) {
  const std::string what = "comm/mpi: recv on " + label_;
  const std::pair<int, int32_t> key{peer, tag};
  auto it = inbox_.find(key);
  while (it == inbox_.end()) {  // file what has arrived from the peer until one of (peer, tag) is there
    int flag = 0;
    MPI_Message handle;
    MPI_Status st;
    MPI_Improbe(ranks_[static_cast<size_t>(peer)], tag_, world_->p2p(), &flag, &handle, &st);
    if (!flag) return false;
    int len = 0;
    MPI_Get_count(&st, MPI_BYTE, &len);
    std::vector<Bytes> data(static_cast<size_t>(std::max(len, 0)));
    const int rc = MPI_Mrecv(data.data(), len, MPI_BYTE, &handle, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) throw Error(what + ": " + mpi_error_text(rc));
    int64_t head[4] = {0, 0, 0, 0};
    if (data.size() < sizeof head) throw Error(what + ": a malformed message arrived from peer " + std::to_string(peer));
    std::memcpy(head, data.data(), sizeof head);
    if (head[0] != kP2PMagic) throw Error(what + ": a malformed message arrived from peer " + std::to_string(peer));
    Message m{static_cast<int32_t>(head[2]), static_cast<size_t>(head[3]),
              std::vector<Bytes>(data.begin() + sizeof head, data.end())};
    inbox_[{peer, static_cast<int32_t>(head[1])}].push_back(std::move(m));
    it = inbox_.find(key);
  }
  Message msg = std::move(it->second.front());
  it->second.pop_front();
  if (it->second.empty()) inbox_.erase(it);
  if (msg.dtype != dtype || msg.count != count) {
    std::ostringstream os;
    os << what << ": " << member(me_) << " expects " << count << " " << dtype_name(dtype) << " elements with tag "
       << tag << " from peer " << peer << " (rank " << ranks_[static_cast<size_t>(peer)] << ") but it sent "
       << msg.count << " " << dtype_name(msg.dtype);
    throw Error(os.str(), LOOM_CODE_INVALID_ARGUMENT);
  }
  if (msg.data.size() != count * loom::dtype_size(dtype))
    throw Error(what + ": a malformed message arrived from peer " + std::to_string(peer));
  if (!msg.data.empty()) std::memcpy(buf, msg.data.data(), msg.data.size());
  return true;
}

Error Group::recv_timeout(int32_t peer, int32_t tag) {
  std::ostringstream os;
  os << "comm/mpi: recv on " << label_ << " timed out " << after_text(world_->settings().timeout_ms) << "; "
     << member(me_) << " waited for tag " << tag << " from peer " << peer << " (rank "
     << ranks_[static_cast<size_t>(peer)] << "), which never sent it";
  poison(os.str());
  return Error(os.str(), LOOM_CODE_TIMEOUT);
}

void Group::recv(void* buf, size_t count, int32_t dtype, int32_t peer, int32_t tag) {
  check_recv(buf, count, dtype, peer);
  const bool got = world_->poll(world_->deadline(), "comm/mpi: recv on " + label_,
                                [&] { return take_locked(buf, count, dtype, peer, tag); });
  if (!got) throw recv_timeout(peer, tag);
}

}  // namespace loom::comm_mpi
