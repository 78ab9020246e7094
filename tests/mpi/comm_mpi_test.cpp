// comm/mpi, run under mpirun (every process runs this binary; each hosts one rank).
// Reductions are compared bit for bit with comm/local running the same inputs as
// threads in this process (every dtype and op, in place and not, group sizes 1..n);
// data movement against the expected layout; p2p without deadlock and with tags
// out of order; timeouts that name the op, group and missing rank; mismatched and
// invalid calls reported on every member (the group stays usable); world_abort in
// one process releasing a wait in the others.
#include "engine/plugins/registry.hpp"

#include <gtest/gtest.h>

#include "tests/support/mpi_rank_printer.hpp"
#include <toml++/toml.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using loom::plugins::LoadedPlugin;

int g_rank = 0;
int g_size = 1;

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

loom::plugins::Registry& registry() {
  static loom::plugins::Registry r;
  return r;
}
const LoadedPlugin& plugin(const char* name) {
  static bool loaded = [] {
    registry().load_file(std::string(LOOM_TEST_PLUGIN_DIR) + "/loom_comm_mpi.so");
    registry().load_file(std::string(LOOM_TEST_PLUGIN_DIR) + "/loom_comm_local.so");
    return true;
  }();
  (void)loaded;
  return registry().get("comm", name);
}
const loom_comm_api* mpi() { return plugin("mpi").comm(); }
const loom_comm_api* local() { return plugin("local").comm(); }

struct Result {
  int32_t code = LOOM_CODE_OK;
  std::string message;
  bool ok() const { return code == LOOM_CODE_OK && message.empty(); }
};
Result take(loom_status s) {
  Result r;
  if (s == nullptr) return r;
  const loom_host_api* h = loom::plugins::host_api();
  r.code = h->status_code(s);
  r.message = h->status_message(s);
  if (r.message.empty()) r.message = "(empty message)";
  h->status_destroy(s);
  return r;
}
#define EXPECT_OK(expr)                                  \
  do {                                                   \
    Result r_ = take(expr);                              \
    EXPECT_TRUE(r_.ok()) << #expr << ": " << r_.message; \
  } while (0)

// A world of a comm plugin; for comm/mpi this process hosts rank g_rank.
class World {
 public:
  World(const loom_comm_api* api, const LoadedPlugin& p, int size, std::vector<int32_t> local, int64_t timeout_ms)
      : api_(api), table_(toml::table{{"abort_on_failure", false}}), options_(api == mpi() ? &table_ : nullptr, p.options) {
    loom_comm_world_args args{};
    args.struct_size = sizeof args;
    args.world_size = size;
    args.num_local_ranks = static_cast<int32_t>(local.size());
    args.local_ranks = local.data();
    args.timeout_ms = timeout_ms;
    Result r = take(api_->world_create(options_.raw(), &args, &world_));
    if (!r.ok()) throw std::runtime_error("world_create failed: " + r.message);
  }
  ~World() { api_->world_destroy(world_); }
  World(const World&) = delete;
  World& operator=(const World&) = delete;
  loom_comm_world* raw() const { return world_; }
  const loom_comm_api* api() const { return api_; }

 private:
  const loom_comm_api* api_;
  toml::table table_;
  loom::plugins::OptionValues options_;
  loom_comm_world* world_ = nullptr;
};

std::vector<int32_t> iota_ranks(int n, int first = 0) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = first + i;
  return v;
}

std::unique_ptr<World> g_long;   // generous timeout: everything that must succeed
std::unique_ptr<World> g_short;  // 1 s: the timeout tests

class Comm {
 public:
  Comm(const World& w, const char* kind, const std::vector<int32_t>& ranks, int32_t my_rank) : api_(w.api()) {
    loom_group_desc d{};
    d.struct_size = sizeof d;
    d.kind = kind;
    d.ranks = ranks.data();
    d.size = static_cast<int32_t>(ranks.size());
    d.my_rank = my_rank;
    result_ = take(api_->group_create(w.raw(), &d, &comm_));
  }
  ~Comm() {
    if (comm_) api_->group_destroy(comm_);
  }
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;
  loom_comm* get() const { return comm_; }
  loom_comm* release() { return std::exchange(comm_, nullptr); }
  const Result& created() const { return result_; }

 private:
  const loom_comm_api* api_;
  loom_comm* comm_ = nullptr;
  Result result_;
};

// Every process meets here (keeps the tests in step after ones where ranks diverge).
std::unique_ptr<Comm> g_sync;
void sync_all() {
  if (!g_sync) g_sync = std::make_unique<Comm>(*g_long, "sync", iota_ranks(g_size), g_rank);
  EXPECT_OK(mpi()->barrier(g_sync->get()));
}

// ---- inputs: raw bytes per (seed, global rank, dtype), identical in every process ----

size_t elem_size(int32_t dtype) {
  switch (dtype) {
    case LOOM_DTYPE_F32: case LOOM_DTYPE_I32: return 4;
    case LOOM_DTYPE_F64: case LOOM_DTYPE_I64: return 8;
    case LOOM_DTYPE_BF16: case LOOM_DTYPE_F16: return 2;
    default: return 1;
  }
}

std::vector<unsigned char> inputs(uint32_t seed, int rank, int32_t dtype, size_t count) {
  std::mt19937_64 gen(seed * 7919u + static_cast<uint32_t>(rank) * 104729u + count * 31u + static_cast<uint32_t>(dtype));
  std::vector<unsigned char> out(count * elem_size(dtype));
  std::uniform_real_distribution<double> mant(-1.0, 1.0);
  std::uniform_int_distribution<int> expo(-10, 10);
  for (size_t i = 0; i < count; ++i) {
    const double x = std::ldexp(mant(gen), expo(gen));  // many exponents: the order of additions matters
    unsigned char* p = out.data() + i * elem_size(dtype);
    switch (dtype) {
      case LOOM_DTYPE_F32: { float f = static_cast<float>(x); std::memcpy(p, &f, 4); break; }
      case LOOM_DTYPE_F64: std::memcpy(p, &x, 8); break;
      case LOOM_DTYPE_BF16: {
        float f = static_cast<float>(x);
        uint32_t u;
        std::memcpy(&u, &f, 4);
        uint16_t h = static_cast<uint16_t>(u >> 16);
        std::memcpy(p, &h, 2);
        break;
      }
#if defined(__FLT16_MAX__)
      case LOOM_DTYPE_F16: { _Float16 h = static_cast<_Float16>(x); std::memcpy(p, &h, 2); break; }
#endif
      case LOOM_DTYPE_I32: { int32_t v = static_cast<int32_t>(gen() % 2000001) - 1000000; std::memcpy(p, &v, 4); break; }
      case LOOM_DTYPE_I64: { uint64_t v = gen(); std::memcpy(p, &v, 8); break; }  // full range: sums wrap
      default: { unsigned char v = static_cast<unsigned char>(gen()); *p = v; break; }
    }
  }
  return out;
}

std::vector<int32_t> dtypes() {
  std::vector<int32_t> d = {LOOM_DTYPE_F32, LOOM_DTYPE_F64, LOOM_DTYPE_BF16, LOOM_DTYPE_I32, LOOM_DTYPE_I64,
                            LOOM_DTYPE_U8};
#if defined(__FLT16_MAX__)
  d.push_back(LOOM_DTYPE_F16);
#endif
  return d;
}
const std::vector<size_t> kCounts = {0, 1, 7, 1001, 20011};
const std::vector<int32_t> kOps = {LOOM_REDUCE_SUM, LOOM_REDUCE_MAX, LOOM_REDUCE_MIN, LOOM_REDUCE_AVG};

// The groups the reduction tests use: [first, first + n) for every size that fits.
struct Span {
  int first, n;
};
std::vector<Span> spans() {
  std::vector<Span> s;
  for (int n = 1; n <= g_size; ++n) s.push_back({g_size - n, n});  // ends at the last rank
  if (g_size >= 3) s.push_back({0, 2});
  return s;
}

// One collective on comm/local with n threads: fn(rank_in_group, comm).
void with_local_group(int n, const std::function<void(int, loom_comm*)>& fn) {
  World w(local(), plugin("local"), n, iota_ranks(n), 60000);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      Comm c(w, "g", iota_ranks(n), r);
      ASSERT_TRUE(c.created().ok()) << c.created().message;
      fn(r, c.get());
    });
  for (auto& t : threads) t.join();
}

// ---------------------------------------------------------------------------

TEST(CommMpi, AllReduceIsBitIdenticalToCommLocal) {
  for (const Span& sp : spans()) {
    const bool member = g_rank >= sp.first && g_rank < sp.first + sp.n;
    // Expected results from comm/local: every (dtype, op, count) on n threads.
    std::vector<std::vector<unsigned char>> want;
    with_local_group(sp.n, [&](int r, loom_comm* c) {
      std::vector<std::vector<unsigned char>> mine;
      for (int32_t dt : dtypes())
        for (int32_t op : kOps)
          for (size_t count : kCounts) {
            std::vector<unsigned char> send = inputs(1, sp.first + r, dt, count), recv(send.size());
            EXPECT_OK(local()->all_reduce(c, nullptr, send.data(), recv.data(), count, dt, op));
            mine.push_back(recv);
          }
      if (r == 0) want = std::move(mine);
    });
    if (!member) continue;
    Comm comm(*g_long, "dp", iota_ranks(sp.n, sp.first), g_rank);
    ASSERT_TRUE(comm.created().ok()) << comm.created().message;
    size_t k = 0;
    for (int32_t dt : dtypes())
      for (int32_t op : kOps)
        for (size_t count : kCounts) {
          for (bool in_place : {false, true}) {
            std::vector<unsigned char> send = inputs(1, g_rank, dt, count), recv(send.size(), 0xAB);
            void* out = in_place ? static_cast<void*>(send.data()) : static_cast<void*>(recv.data());
            EXPECT_OK(mpi()->all_reduce(comm.get(), nullptr, send.data(), out, count, dt, op));
            EXPECT_TRUE(want[k].empty() || std::memcmp(out, want[k].data(), want[k].size()) == 0)
                << "group [" << sp.first << ", " << sp.first + sp.n << ") dtype " << dt << " op " << op << " count "
                << count << " in_place " << in_place;
          }
          ++k;
        }
  }
  sync_all();
}

TEST(CommMpi, FloatSumEqualsTheSerialInOrderSum) {
  // Independent of comm/local: ((x0 + x1) + x2) + ... in group order, per element.
  const size_t count = 4099;
  Comm comm(*g_long, "dp", iota_ranks(g_size), g_rank);
  ASSERT_TRUE(comm.created().ok()) << comm.created().message;
  std::vector<float> want(count);
  for (int r = 0; r < g_size; ++r) {
    std::vector<unsigned char> b = inputs(2, r, LOOM_DTYPE_F32, count);
    const float* x = reinterpret_cast<const float*>(b.data());
    for (size_t i = 0; i < count; ++i) want[i] = r == 0 ? x[i] : want[i] + x[i];
  }
  std::vector<unsigned char> send = inputs(2, g_rank, LOOM_DTYPE_F32, count);
  std::vector<float> got(count);
  EXPECT_OK(mpi()->all_reduce(comm.get(), nullptr, send.data(), got.data(), count, LOOM_DTYPE_F32, LOOM_REDUCE_SUM));
  EXPECT_EQ(0, std::memcmp(want.data(), got.data(), count * sizeof(float)));
}

TEST(CommMpi, ReduceScatterIsBitIdenticalToCommLocal) {
  const int n = g_size;
  std::vector<std::vector<unsigned char>> want(static_cast<size_t>(n));  // per group rank
  const std::vector<int32_t> dts = {LOOM_DTYPE_F32, LOOM_DTYPE_BF16, LOOM_DTYPE_I64};
  const std::vector<size_t> counts = {0, 5, 3001};
  with_local_group(n, [&](int r, loom_comm* c) {
    std::vector<unsigned char> all;
    for (int32_t dt : dts)
      for (int32_t op : kOps)
        for (size_t count : counts) {
          std::vector<unsigned char> send = inputs(3, r, dt, count * static_cast<size_t>(n)),
                                     recv(count * elem_size(dt));
          EXPECT_OK(local()->reduce_scatter(c, nullptr, send.data(), recv.data(), count, dt, op));
          all.insert(all.end(), recv.begin(), recv.end());
        }
    want[static_cast<size_t>(r)] = std::move(all);
  });
  Comm comm(*g_long, "dp", iota_ranks(n), g_rank);
  ASSERT_TRUE(comm.created().ok()) << comm.created().message;
  std::vector<unsigned char> got;
  for (int32_t dt : dts)
    for (int32_t op : kOps)
      for (size_t count : counts) {
        const size_t es = elem_size(dt);
        std::vector<unsigned char> send = inputs(3, g_rank, dt, count * static_cast<size_t>(n)),
                                   recv(count * es, 0xCD);
        EXPECT_OK(mpi()->reduce_scatter(comm.get(), nullptr, send.data(), recv.data(), count, dt, op));
        // In place: recv is this rank's block of send.
        std::vector<unsigned char> inplace = send;
        unsigned char* block = inplace.data() + static_cast<size_t>(g_rank) * count * es;
        EXPECT_OK(mpi()->reduce_scatter(comm.get(), nullptr, inplace.data(), block, count, dt, op));
        EXPECT_TRUE(recv.empty() || std::memcmp(block, recv.data(), recv.size()) == 0) << "in place, dtype " << dt;
        got.insert(got.end(), recv.begin(), recv.end());
      }
  EXPECT_TRUE(got == want[static_cast<size_t>(g_rank)]);
}

TEST(CommMpi, AllGatherAllToAllAndBroadcastMoveTheRightBlocks) {
  const int n = g_size;
  Comm comm(*g_long, "tp", iota_ranks(n), g_rank);
  ASSERT_TRUE(comm.created().ok()) << comm.created().message;
  auto value = [](int from, int to, size_t i) { return from * 1000000 + to * 10000 + static_cast<int>(i); };
  for (size_t count : {size_t{0}, size_t{1}, size_t{777}}) {
    // all_gather: block j = rank j's send.
    std::vector<int32_t> send(count), recv(count * static_cast<size_t>(n), -1);
    for (size_t i = 0; i < count; ++i) send[i] = value(g_rank, 0, i);
    EXPECT_OK(mpi()->all_gather(comm.get(), nullptr, send.data(), recv.data(), count, LOOM_DTYPE_I32));
    for (int j = 0; j < n; ++j)
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(recv[static_cast<size_t>(j) * count + i], value(j, 0, i));
    // all_gather in place: send is this rank's block of recv.
    std::vector<int32_t> inplace(count * static_cast<size_t>(n), -1);
    std::copy(send.begin(), send.end(), inplace.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(g_rank) * count));
    EXPECT_OK(mpi()->all_gather(comm.get(), nullptr, inplace.data() + static_cast<size_t>(g_rank) * count,
                                inplace.data(), count, LOOM_DTYPE_I32));
    EXPECT_EQ(inplace, recv);

    // all_to_all: block j of my recv = block me of rank j's send.
    std::vector<int32_t> a2a_send(count * static_cast<size_t>(n)), a2a_recv(count * static_cast<size_t>(n), -1);
    for (int j = 0; j < n; ++j)
      for (size_t i = 0; i < count; ++i) a2a_send[static_cast<size_t>(j) * count + i] = value(g_rank, j, i);
    EXPECT_OK(mpi()->all_to_all(comm.get(), nullptr, a2a_send.data(), a2a_recv.data(), count, LOOM_DTYPE_I32));
    for (int j = 0; j < n; ++j)
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(a2a_recv[static_cast<size_t>(j) * count + i], value(j, g_rank, i));
    // ... and in place.
    EXPECT_OK(mpi()->all_to_all(comm.get(), nullptr, a2a_send.data(), a2a_send.data(), count, LOOM_DTYPE_I32));
    EXPECT_EQ(a2a_send, a2a_recv);

    // broadcast from every root.
    for (int root = 0; root < n; ++root) {
      std::vector<int32_t> buf(count, -1);
      if (g_rank == root)
        for (size_t i = 0; i < count; ++i) buf[i] = value(root, 7, i);
      EXPECT_OK(mpi()->broadcast(comm.get(), nullptr, buf.data(), count, LOOM_DTYPE_I32, root));
      for (size_t i = 0; i < count; ++i) ASSERT_EQ(buf[i], value(root, 7, i));
    }
  }
}

TEST(CommMpi, AllToAllVMovesVariableBlocks) {
  const int n = g_size;
  Comm comm(*g_long, "ep", iota_ranks(n), g_rank);
  ASSERT_TRUE(comm.created().ok()) << comm.created().message;
  auto cnt = [](int from, int to) { return static_cast<size_t>((from * 3 + to * 5) % 4); };  // some zero
  std::vector<size_t> sc(static_cast<size_t>(n)), sd(static_cast<size_t>(n)), rc(static_cast<size_t>(n)),
      rd(static_cast<size_t>(n));
  size_t stot = 0, rtot = 0;
  for (int j = 0; j < n; ++j) {
    sc[static_cast<size_t>(j)] = cnt(g_rank, j);
    sd[static_cast<size_t>(j)] = stot;
    stot += sc[static_cast<size_t>(j)];
    rc[static_cast<size_t>(j)] = cnt(j, g_rank);
    rd[static_cast<size_t>(j)] = rtot + 1;  // gaps between blocks stay untouched
    rtot += rc[static_cast<size_t>(j)] + 1;
  }
  std::vector<double> send(stot), recv(rtot + 1, -1.0);
  for (int j = 0; j < n; ++j)
    for (size_t i = 0; i < sc[static_cast<size_t>(j)]; ++i)
      send[sd[static_cast<size_t>(j)] + i] = g_rank * 100 + j * 10 + static_cast<double>(i);
  EXPECT_OK(mpi()->all_to_all_v(comm.get(), nullptr, send.data(), sc.data(), sd.data(), recv.data(), rc.data(),
                                rd.data(), LOOM_DTYPE_F64));
  for (int j = 0; j < n; ++j) {
    EXPECT_EQ(recv[rd[static_cast<size_t>(j)] - 1], -1.0);
    for (size_t i = 0; i < rc[static_cast<size_t>(j)]; ++i)
      EXPECT_EQ(recv[rd[static_cast<size_t>(j)] + i], j * 100 + g_rank * 10 + static_cast<double>(i));
  }
}

TEST(CommMpi, RingWhereEveryRankSendsFirstAndTagsArriveOutOfOrder) {
  const int n = g_size;
  Comm comm(*g_long, "pp", iota_ranks(n), g_rank);
  ASSERT_TRUE(comm.created().ok()) << comm.created().message;
  const int next = (g_rank + 1) % n, prev = (g_rank + n - 1) % n;
  // Tags 1, 2, 2 sent in that order; received as 2, 1, 2: same-tag messages keep their order.
  for (int k = 0; k < 3; ++k) {
    const int32_t tag = k == 0 ? 1 : 2;
    std::vector<float> msg(100 + static_cast<size_t>(k), static_cast<float>(g_rank * 10 + k));
    EXPECT_OK(mpi()->send(comm.get(), nullptr, msg.data(), msg.size(), LOOM_DTYPE_F32, next, tag));
  }
  std::vector<float> a(101), b(100), c(102);
  EXPECT_OK(mpi()->recv(comm.get(), nullptr, a.data(), a.size(), LOOM_DTYPE_F32, prev, 2));
  EXPECT_OK(mpi()->recv(comm.get(), nullptr, b.data(), b.size(), LOOM_DTYPE_F32, prev, 1));
  EXPECT_OK(mpi()->recv(comm.get(), nullptr, c.data(), c.size(), LOOM_DTYPE_F32, prev, 2));
  EXPECT_EQ(a[0], static_cast<float>(prev * 10 + 1));
  EXPECT_EQ(b[99], static_cast<float>(prev * 10 + 0));
  EXPECT_EQ(c[101], static_cast<float>(prev * 10 + 2));
  sync_all();
}

TEST(CommMpi, RecvCountMismatchIsReported) {
  if (g_size < 2) GTEST_SKIP() << "needs 2 processes";
  Comm comm(*g_long, "pp", iota_ranks(2), g_rank);
  if (g_rank < 2) {
    ASSERT_TRUE(comm.created().ok()) << comm.created().message;
    std::vector<float> buf(8, 1.0f);
    if (g_rank == 0) EXPECT_OK(mpi()->send(comm.get(), nullptr, buf.data(), 8, LOOM_DTYPE_F32, 1, 5));
    if (g_rank == 1) {
      Result r = take(mpi()->recv(comm.get(), nullptr, buf.data(), 4, LOOM_DTYPE_F32, 0, 5));
      EXPECT_EQ(r.code, LOOM_CODE_INVALID_ARGUMENT) << r.message;
      EXPECT_NE(r.message.find("expects 4 f32"), std::string::npos) << r.message;
      EXPECT_NE(r.message.find("sent 8 f32"), std::string::npos) << r.message;
    }
  }
  sync_all();
}

TEST(CommMpi, MismatchedAndInvalidCallsAreReportedOnEveryMemberAndTheGroupGoesOn) {
  if (g_size < 2) GTEST_SKIP() << "needs 2 processes";
  Comm comm(*g_long, "dp", iota_ranks(g_size), g_rank);
  ASSERT_TRUE(comm.created().ok()) << comm.created().message;
  std::vector<float> buf(16, 1.0f), out(16 * static_cast<size_t>(g_size));
  // Count mismatch.
  Result r = take(mpi()->all_reduce(comm.get(), nullptr, buf.data(), buf.data(), g_rank == 0 ? 5 : 6,
                                    LOOM_DTYPE_F32, LOOM_REDUCE_SUM));
  EXPECT_EQ(r.code, LOOM_CODE_INVALID_ARGUMENT);
  EXPECT_NE(r.message.find("mismatched calls on group 'dp'"), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("count=5"), std::string::npos) << r.message;
  // Op mismatch.
  r = take(g_rank == 0 ? mpi()->barrier(comm.get())
                       : mpi()->all_gather(comm.get(), nullptr, buf.data(), out.data(), 16, LOOM_DTYPE_F32));
  EXPECT_NE(r.message.find("rank 0 called barrier"), std::string::npos) << r.message;
  // Invalid arguments on rank 1 only.
  r = take(mpi()->all_reduce(comm.get(), nullptr, buf.data(), buf.data(), 16, LOOM_DTYPE_F32,
                             g_rank == 1 ? 99 : LOOM_REDUCE_SUM));
  EXPECT_EQ(r.code, LOOM_CODE_INVALID_ARGUMENT);
  EXPECT_NE(r.message.find("rank 1 passed invalid arguments"), std::string::npos) << r.message;
  // all_to_all_v counts that do not match.
  std::vector<size_t> ones(static_cast<size_t>(g_size), 1), displs(static_cast<size_t>(g_size));
  for (size_t j = 0; j < displs.size(); ++j) displs[j] = j;
  std::vector<size_t> rcounts = ones;
  if (g_rank == 0) rcounts[1] = 0;
  r = take(mpi()->all_to_all_v(comm.get(), nullptr, buf.data(), ones.data(), displs.data(), out.data(),
                               rcounts.data(), displs.data(), LOOM_DTYPE_F32));
  EXPECT_NE(r.message.find("rank 1 sends 1 elements to rank 0 but rank 0 expects 0"), std::string::npos) << r.message;
  // The group is still in step: a correct call works.
  std::fill(buf.begin(), buf.end(), 1.0f);
  EXPECT_OK(mpi()->all_reduce(comm.get(), nullptr, buf.data(), buf.data(), 16, LOOM_DTYPE_F32, LOOM_REDUCE_SUM));
  EXPECT_EQ(buf[15], static_cast<float>(g_size));
}

TEST(CommMpi, AllReduceTimesOutNamingTheMissingRank) {
  if (g_size < 2) GTEST_SKIP() << "needs 2 processes";
  const int late = g_size - 1;
  {
    Comm comm(*g_short, "late", iota_ranks(g_size), g_rank);
    ASSERT_TRUE(comm.created().ok()) << comm.created().message;
    if (g_rank != late) {
      float x = 1;
      const auto t0 = Clock::now();
      Result r = take(mpi()->all_reduce(comm.get(), nullptr, &x, &x, 1, LOOM_DTYPE_F32, LOOM_REDUCE_SUM));
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      EXPECT_EQ(r.code, LOOM_CODE_TIMEOUT) << r.message;
      EXPECT_NE(r.message.find("all_reduce on group 'late'"), std::string::npos) << r.message;
      EXPECT_NE(r.message.find("rank " + std::to_string(late) + " never joined"), std::string::npos) << r.message;
      EXPECT_GE(s, 0.9);
      EXPECT_LT(s, 20.0);
      // The group is poisoned: the next call fails at once.
      r = take(mpi()->barrier(comm.get()));
      EXPECT_NE(r.message.find("unusable after an earlier failure"), std::string::npos) << r.message;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));  // then wait for the others in sync_all
    }
  }
  sync_all();
}

TEST(CommMpi, RecvTimesOutNamingThePeer) {
  if (g_size < 2) GTEST_SKIP() << "needs 2 processes";
  if (g_rank < 2) {
    Comm comm(*g_short, "pp", iota_ranks(2), g_rank);
    ASSERT_TRUE(comm.created().ok()) << comm.created().message;
    if (g_rank == 0) {
      float x = 0;
      Result r = take(mpi()->recv(comm.get(), nullptr, &x, 1, LOOM_DTYPE_F32, 1, 77));
      EXPECT_EQ(r.code, LOOM_CODE_TIMEOUT) << r.message;
      EXPECT_NE(r.message.find("recv on group 'pp'"), std::string::npos) << r.message;
      EXPECT_NE(r.message.find("tag 77 from peer 1 (rank 1), which never sent it"), std::string::npos) << r.message;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
  }
  sync_all();
}

TEST(CommMpi, GroupCreateTimesOutNamingTheMissingRank) {
  if (g_size < 2) GTEST_SKIP() << "needs 2 processes";
  if (g_rank == 0) {
    Comm comm(*g_short, "lonely", iota_ranks(2), 0);
    EXPECT_EQ(comm.created().code, LOOM_CODE_TIMEOUT) << comm.created().message;
    EXPECT_NE(comm.created().message.find("group_create on group 'lonely' (ranks [0,1])"), std::string::npos)
        << comm.created().message;
    EXPECT_NE(comm.created().message.find("rank 1 never joined"), std::string::npos) << comm.created().message;
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  sync_all();
}

// ---- receives started without waiting (ABI 1.17, LOOM_COLLECTIVE_RECV) ----

Result start_p2p(loom_comm* comm, int32_t kind, void* buf, size_t count, int32_t peer, int32_t tag,
                 loom_comm_request** req) {
  loom_collective c{};
  c.struct_size = sizeof c;
  c.kind = kind;
  c.send = buf;
  c.recv = buf;
  c.count = count;
  c.dtype = LOOM_DTYPE_F32;
  c.peer = peer;
  c.tag = tag;
  return take(mpi()->start(comm, nullptr, &c, req));
}

TEST(CommMpi, StartsSendsAndReceives) {
  EXPECT_NE(mpi()->features & LOOM_COMM_START_P2P, 0u);
}

// start A, blocking B, start C (one pair), start D (another); waits C, D, A: A, B
// and C get the pair's messages in posting order.
void receive_in_posting_order(loom_comm* comm, float first) {
  std::vector<float> a(1000), b(1000), c(1000);
  float d = 0;
  loom_comm_request *ra = nullptr, *rc = nullptr, *rd = nullptr;
  ASSERT_TRUE(start_p2p(comm, LOOM_COLLECTIVE_RECV, a.data(), a.size(), 1, 5, &ra).ok());
  EXPECT_OK(mpi()->recv(comm, nullptr, b.data(), b.size(), LOOM_DTYPE_F32, 1, 5));
  ASSERT_TRUE(start_p2p(comm, LOOM_COLLECTIVE_RECV, c.data(), c.size(), 1, 5, &rc).ok());
  ASSERT_TRUE(start_p2p(comm, LOOM_COLLECTIVE_RECV, &d, 1, 1, 6, &rd).ok());
  EXPECT_OK(mpi()->wait(comm, rc, nullptr));
  EXPECT_OK(mpi()->wait(comm, rd, nullptr));
  EXPECT_OK(mpi()->wait(comm, ra, nullptr));
  EXPECT_EQ(a.front(), first);
  EXPECT_EQ(a.back(), first);
  EXPECT_EQ(b.back(), first + 1);
  EXPECT_EQ(c.back(), first + 2);
  EXPECT_EQ(d, first + 10);
}
void send_for_posting_order(loom_comm* comm, float first) {
  for (int k = 0; k < 3; ++k) {
    std::vector<float> msg(1000, first + static_cast<float>(k));
    EXPECT_OK(mpi()->send(comm, nullptr, msg.data(), msg.size(), LOOM_DTYPE_F32, 0, 5));
  }
  float other = first + 10;
  EXPECT_OK(mpi()->send(comm, nullptr, &other, 1, LOOM_DTYPE_F32, 0, 6));
}

TEST(CommMpi, StartedAndBlockingReceivesOfAPairTakeMessagesInPostingOrder) {
  if (g_size < 2) GTEST_SKIP() << "needs 2 processes";
  std::unique_ptr<Comm> comm;
  if (g_rank < 2) {
    comm = std::make_unique<Comm>(*g_long, "pp", iota_ranks(2), g_rank);
    ASSERT_TRUE(comm->created().ok()) << comm->created().message;
  }
  // The messages have arrived before the receives are posted...
  if (g_rank == 1) send_for_posting_order(comm->get(), 1);
  sync_all();
  if (g_rank == 0) receive_in_posting_order(comm->get(), 1);
  // ... and they arrive while the receives are pending.
  if (g_rank == 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    send_for_posting_order(comm->get(), 100);
  }
  if (g_rank == 0) receive_in_posting_order(comm->get(), 100);
  sync_all();
}

TEST(CommMpi, AStartedReceiveFillsItsBufferBeforeItsWait) {
  if (g_size < 2) GTEST_SKIP() << "needs 2 processes";
  if (g_rank < 2) {
    Comm comm(*g_long, "pp", iota_ranks(2), g_rank);
    ASSERT_TRUE(comm.created().ok()) << comm.created().message;
    const size_t n = 1 << 18;  // 1 MiB: past the eager limit of MPI's shared-memory transport
    if (g_rank == 1) {
      std::vector<float> msg(n, 7.0f);
      loom_comm_request* rs = nullptr;
      ASSERT_TRUE(start_p2p(comm.get(), LOOM_COLLECTIVE_SEND, msg.data(), n, 0, 3, &rs).ok());
      EXPECT_OK(mpi()->wait(comm.get(), rs, nullptr));
    } else {
      std::vector<float> buf(n, 0.0f);
      loom_comm_request* rr = nullptr;
      ASSERT_TRUE(start_p2p(comm.get(), LOOM_COLLECTIVE_RECV, buf.data(), n, 1, 3, &rr).ok());
      // This thread makes no comm call until the data is there: the member's receiver
      // thread moved it (the overlap a pipeline posts its receives early for).
      std::atomic_ref<float> last(buf.back());
      const auto give_up = Clock::now() + std::chrono::seconds(30);
      while (last.load() != 7.0f && Clock::now() < give_up) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      EXPECT_EQ(last.load(), 7.0f) << "the receive did not progress before its wait";
      EXPECT_OK(mpi()->wait(comm.get(), rr, nullptr));
      EXPECT_EQ(buf.front(), 7.0f);
    }
  }
  sync_all();
}

TEST(CommMpi, AStartedReceiveTimesOutNamingThePeerAndItsPairFollows) {
  if (g_size < 2) GTEST_SKIP() << "needs 2 processes";
  if (g_rank < 2) {
    Comm comm(*g_short, "pp", iota_ranks(2), g_rank);
    ASSERT_TRUE(comm.created().ok()) << comm.created().message;
    if (g_rank == 0) {
      float x = 0, y = 0;
      loom_comm_request *r1 = nullptr, *r2 = nullptr;
      ASSERT_TRUE(start_p2p(comm.get(), LOOM_COLLECTIVE_RECV, &x, 1, 1, 77, &r1).ok());
      ASSERT_TRUE(start_p2p(comm.get(), LOOM_COLLECTIVE_RECV, &y, 1, 1, 77, &r2).ok());
      // The receiver is polling (with no deadline: nobody waits yet) when the wait comes.
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      const auto t0 = Clock::now();
      Result r = take(mpi()->wait(comm.get(), r1, nullptr));
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      EXPECT_EQ(r.code, LOOM_CODE_TIMEOUT) << r.message;
      EXPECT_NE(r.message.find("recv on group 'pp'"), std::string::npos) << r.message;
      EXPECT_NE(r.message.find("tag 77 from peer 1 (rank 1), which never sent it"), std::string::npos) << r.message;
      EXPECT_LT(s, 20.0);
      r = take(mpi()->wait(comm.get(), r2, nullptr));  // behind it: the same story
      EXPECT_EQ(r.code, LOOM_CODE_TIMEOUT) << r.message;
      r = take(mpi()->recv(comm.get(), nullptr, &x, 1, LOOM_DTYPE_F32, 1, 78));  // the group is poisoned
      EXPECT_NE(r.message.find("unusable after an earlier failure"), std::string::npos) << r.message;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
  }
  sync_all();
}

// As comm/local's and a blocking receive's, a started receive's timeout counts from
// its wait: posted early, waited for after longer than the timeout, it still succeeds.
TEST(CommMpi, AStartedReceivesTimeoutCountsFromItsWait) {
  if (g_size < 2) GTEST_SKIP() << "needs 2 processes";
  if (g_rank < 2) {
    Comm comm(*g_short, "pp", iota_ranks(2), g_rank);  // 1 s
    ASSERT_TRUE(comm.created().ok()) << comm.created().message;
    if (g_rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1300));
      float x = 5;
      EXPECT_OK(mpi()->send(comm.get(), nullptr, &x, 1, LOOM_DTYPE_F32, 0, 21));
    } else {
      float x = 0;
      loom_comm_request* r = nullptr;
      ASSERT_TRUE(start_p2p(comm.get(), LOOM_COLLECTIVE_RECV, &x, 1, 1, 21, &r).ok());
      std::this_thread::sleep_for(std::chrono::milliseconds(1200));  // computing, past the timeout
      EXPECT_OK(mpi()->wait(comm.get(), r, nullptr));
      EXPECT_EQ(x, 5.0f);
    }
  }
  sync_all();
}

TEST(CommMpi, AMemberDestroyedWithAReceivePendingEndsCleanly) {
  if (g_size < 2) GTEST_SKIP() << "needs 2 processes";
  if (g_rank < 2) {
    Comm comm(*g_long, "pp", iota_ranks(2), g_rank);
    ASSERT_TRUE(comm.created().ok()) << comm.created().message;
    if (g_rank == 0) {  // against the ABI's rule (wait before group_destroy): no hang, no crash
      float x = 0;
      loom_comm_request* r = nullptr;
      ASSERT_TRUE(start_p2p(comm.get(), LOOM_COLLECTIVE_RECV, &x, 1, 1, 12, &r).ok());
      mpi()->group_destroy(comm.release());
      Result w = take(mpi()->wait(nullptr, r, nullptr));
      EXPECT_NE(w.message.find("destroyed before the receive's wait"), std::string::npos) << w.message;
    }
  }
  sync_all();
}

TEST(CommMpi, WorldWithSeveralRanksInOneProcessIsRefused) {
  std::vector<int32_t> two = {0, 1};
  loom::plugins::OptionValues opts(nullptr, plugin("mpi").options);
  loom_comm_world_args args{};
  args.struct_size = sizeof args;
  args.world_size = 2;
  args.num_local_ranks = 2;
  args.local_ranks = two.data();
  args.timeout_ms = 1000;
  loom_comm_world* w = nullptr;
  Result r = take(mpi()->world_create(opts.raw(), &args, &w));
  EXPECT_EQ(r.code, LOOM_CODE_UNSUPPORTED);
  EXPECT_NE(r.message.find("exactly one rank per process"), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("mpirun -np 2"), std::string::npos) << r.message;
}

TEST(CommMpi, WorldAbortInOneProcessReleasesWaitersInTheOthersPromptly) {
  if (g_size < 2) GTEST_SKIP() << "needs 2 processes";
  {
    World w(mpi(), plugin("mpi"), g_size, {g_rank}, 60000);  // a long timeout: only the abort can end the wait
    Comm comm(w, "pp", iota_ranks(g_size), g_rank);
    ASSERT_TRUE(comm.created().ok()) << comm.created().message;
    if (g_rank == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      mpi()->world_abort(w.raw(), "rank 0 failed: boom");
      Result r = take(mpi()->barrier(comm.get()));
      EXPECT_NE(r.message.find("aborted: rank 0 failed: boom"), std::string::npos) << r.message;
    } else {
      float x = 0, y = 0;
      loom_comm_request* started = nullptr;  // a started receive is released as well
      ASSERT_TRUE(start_p2p(comm.get(), LOOM_COLLECTIVE_RECV, &y, 1, 0, 2, &started).ok());
      const auto t0 = Clock::now();
      Result r = take(mpi()->recv(comm.get(), nullptr, &x, 1, LOOM_DTYPE_F32, 0, 1));
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      EXPECT_NE(r.message.find("recv on group 'pp'"), std::string::npos) << r.message;
      EXPECT_NE(r.message.find("aborted: rank 0 failed: boom"), std::string::npos) << r.message;
      EXPECT_LT(s, 10.0);
      r = take(mpi()->wait(comm.get(), started, nullptr));
      EXPECT_NE(r.message.find("aborted: rank 0 failed: boom"), std::string::npos) << r.message;
      r = take(mpi()->barrier(comm.get()));  // later calls fail at once too
      EXPECT_NE(r.message.find("aborted"), std::string::npos) << r.message;
    }
  }
  sync_all();
}


}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  g_size = env_int("OMPI_COMM_WORLD_SIZE", env_int("PMI_SIZE", 1));
  g_rank = env_int("OMPI_COMM_WORLD_RANK", env_int("PMI_RANK", 0));
  loom::testing::print_failures_with_rank(g_rank);
  int rc = 1;
  try {
    g_long = std::make_unique<World>(mpi(), plugin("mpi"), g_size, std::vector<int32_t>{g_rank}, 60000);
    g_short = std::make_unique<World>(mpi(), plugin("mpi"), g_size, std::vector<int32_t>{g_rank}, 1000);
    rc = RUN_ALL_TESTS();
    sync_all();
  } catch (const std::exception& e) {
    std::cerr << "[rank " << g_rank << "] " << e.what() << "\n";
    rc = 1;
  }
  // MPI is finalized when the last world and group are gone.
  g_sync.reset();
  g_short.reset();
  g_long.reset();
  return rc;
}
