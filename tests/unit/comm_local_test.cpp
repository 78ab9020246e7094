// comm/local: every collective against a serial reference, determinism, several
// groups at once, p2p without deadlock, timeouts that name the culprit, and
// mismatched calls reported instead of corrupting memory. Ranks are std::threads.
#include "engine/plugins/registry.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

const loom::plugins::LoadedPlugin& plugin() {
  static loom::plugins::Registry registry;
  static const loom::plugins::LoadedPlugin* p = [] {
    registry.load_file(std::string(LOOM_TEST_PLUGIN_DIR) + "/loom_comm_local.so");
    return &registry.get("comm", "local");
  }();
  return *p;
}
const loom_comm_api* api() { return plugin().comm(); }

// A status turned into (code, message); frees it.
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

class World {
 public:
  // `links`: the plugin's option of that name ("" = ideal links).
  explicit World(int size, int64_t timeout_ms = 20000, const std::string& links = "")
      : table_{{"links", links}}, options_(&table_, plugin().options) {
    std::vector<int32_t> local(static_cast<size_t>(size));
    for (int i = 0; i < size; ++i) local[static_cast<size_t>(i)] = i;
    loom_comm_world_args args{};
    args.struct_size = sizeof args;
    args.world_size = size;
    args.num_local_ranks = size;
    args.local_ranks = local.data();
    args.timeout_ms = timeout_ms;
    Result r = take(api()->world_create(options_.raw(), &args, &world_));
    if (!r.ok()) throw std::runtime_error("world_create failed: " + r.message);
  }
  ~World() { api()->world_destroy(world_); }
  World(const World&) = delete;
  World& operator=(const World&) = delete;
  loom_comm_world* raw() const { return world_; }

 private:
  toml::table table_;
  loom::plugins::OptionValues options_;
  loom_comm_world* world_ = nullptr;
};

// One member's communicator, destroyed with the object.
class Comm {
 public:
  Comm() = default;
  Comm(const World& w, const char* kind, const std::vector<int32_t>& ranks, int32_t my_rank) {
    result_ = create(w, kind, ranks, my_rank, &comm_);
  }
  ~Comm() {
    if (comm_) api()->group_destroy(comm_);
  }
  Comm(Comm&& o) noexcept : comm_(o.comm_), result_(o.result_) { o.comm_ = nullptr; }
  Comm& operator=(Comm&& o) noexcept {
    std::swap(comm_, o.comm_);
    std::swap(result_, o.result_);
    return *this;
  }
  static Result create(const World& w, const char* kind, const std::vector<int32_t>& ranks, int32_t my_rank,
                       loom_comm** out) {
    loom_group_desc d{};
    d.struct_size = sizeof d;
    d.kind = kind;
    d.ranks = ranks.data();
    d.size = static_cast<int32_t>(ranks.size());
    d.my_rank = my_rank;
    return take(api()->group_create(w.raw(), &d, out));
  }
  loom_comm* get() const { return comm_; }
  const Result& created() const { return result_; }

 private:
  loom_comm* comm_ = nullptr;
  Result result_;
};

// Runs fn(rank) on n threads and joins them.
void run_ranks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

std::vector<int32_t> iota_ranks(int n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = i;
  return v;
}

template <typename T>
constexpr int32_t dtype_of() {
  if constexpr (std::is_same_v<T, float>) return LOOM_DTYPE_F32;
  if constexpr (std::is_same_v<T, double>) return LOOM_DTYPE_F64;
  if constexpr (std::is_same_v<T, int32_t>) return LOOM_DTYPE_I32;
  if constexpr (std::is_same_v<T, int64_t>) return LOOM_DTYPE_I64;
  return -1;
}

// Deterministic inputs per (seed, rank): floats spread over many exponents so the
// order of additions matters; integers large enough to exercise wrap-around.
template <typename T>
std::vector<T> inputs(uint32_t seed, int rank, size_t count) {
  std::mt19937_64 gen(seed * 7919u + static_cast<uint32_t>(rank) * 104729u + count);
  std::vector<T> v(count);
  for (T& x : v) {
    if constexpr (std::is_floating_point_v<T>) {
      std::uniform_real_distribution<double> mant(-1.0, 1.0);
      std::uniform_int_distribution<int> expo(-12, 12);
      x = static_cast<T>(std::ldexp(mant(gen), expo(gen)));
    } else if constexpr (sizeof(T) == 8) {
      x = static_cast<T>(gen());  // full range: sums wrap
    } else {
      x = static_cast<T>(static_cast<int64_t>(gen() % 2000001) - 1000000);
    }
  }
  return v;
}

// The serial reference: rank 0 (op) rank 1 (op) ... in group order, per element.
template <typename T>
T combine(T a, T b, int32_t op) {
  switch (op) {
    case LOOM_REDUCE_MAX: return b > a ? b : a;
    case LOOM_REDUCE_MIN: return b < a ? b : a;
    default:
      if constexpr (std::is_integral_v<T>) {
        using U = std::make_unsigned_t<T>;
        return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
      } else {
        return a + b;
      }
  }
}
template <typename T>
std::vector<T> reference_reduce(const std::vector<std::vector<T>>& in, size_t offset, size_t count, int32_t op) {
  std::vector<T> out(count);
  const int n = static_cast<int>(in.size());
  for (size_t i = 0; i < count; ++i) {
    T acc = in[0][offset + i];
    for (int j = 1; j < n; ++j) acc = combine(acc, in[static_cast<size_t>(j)][offset + i], op);
    if (op == LOOM_REDUCE_AVG) acc = static_cast<T>(acc / static_cast<T>(n));
    out[i] = acc;
  }
  return out;
}

template <typename T>
bool same_bits(const std::vector<T>& a, const T* b, size_t n) {
  return a.size() == n && (n == 0 || std::memcmp(a.data(), b, n * sizeof(T)) == 0);
}

const std::vector<size_t> kCounts = {0, 1, 7, 64, 1001, 20011};  // 20011 > one internal chunk
const std::vector<int32_t> kOps = {LOOM_REDUCE_SUM, LOOM_REDUCE_MAX, LOOM_REDUCE_MIN, LOOM_REDUCE_AVG};

// ---------------------------------------------------------------------------
// Collectives against serial references, group sizes 1..4
// ---------------------------------------------------------------------------

// Every rank's input for each count (shared read-only by the rank threads).
template <typename T>
std::vector<std::vector<std::vector<T>>> inputs_per_count(uint32_t seed, int n, size_t per_rank_factor) {
  std::vector<std::vector<std::vector<T>>> out;
  for (size_t count : kCounts) {
    std::vector<std::vector<T>> all;
    for (int r = 0; r < n; ++r) all.push_back(inputs<T>(seed, r, count * per_rank_factor));
    out.push_back(std::move(all));
  }
  return out;
}

template <typename T>
void check_all_reduce(int n) {
  const auto data = inputs_per_count<T>(1u, n, 1);
  World world(n);
  run_ranks(n, [&](int rank) {
    Comm comm(world, "dp", iota_ranks(n), rank);
    ASSERT_TRUE(comm.created().ok()) << comm.created().message;
    for (size_t c = 0; c < kCounts.size(); ++c) {
      const size_t count = kCounts[c];
      for (int32_t op : kOps) {
        const std::vector<T> want = reference_reduce(data[c], 0, count, op);
        for (bool in_place : {false, true}) {
          std::vector<T> send = data[c][static_cast<size_t>(rank)];
          std::vector<T> recv(count, T(-3));
          void* out = in_place ? static_cast<void*>(send.data()) : static_cast<void*>(recv.data());
          EXPECT_OK(api()->all_reduce(comm.get(), nullptr, send.data(), out, count, dtype_of<T>(), op));
          EXPECT_TRUE(same_bits(want, static_cast<const T*>(out), count))
              << "n=" << n << " count=" << count << " op=" << op << " in_place=" << in_place << " rank=" << rank;
        }
      }
    }
  });
}
TEST(CommLocal, AllReduceF32) { for (int n = 1; n <= 4; ++n) check_all_reduce<float>(n); }
TEST(CommLocal, AllReduceF64) { for (int n = 1; n <= 4; ++n) check_all_reduce<double>(n); }
TEST(CommLocal, AllReduceI32) { for (int n = 1; n <= 4; ++n) check_all_reduce<int32_t>(n); }
TEST(CommLocal, AllReduceI64) { for (int n = 1; n <= 4; ++n) check_all_reduce<int64_t>(n); }

template <typename T>
void check_reduce_scatter(int n) {
  const auto data = inputs_per_count<T>(2u, n, static_cast<size_t>(n));
  World world(n);
  run_ranks(n, [&](int rank) {
    Comm comm(world, "dp", iota_ranks(n), rank);
    ASSERT_TRUE(comm.created().ok()) << comm.created().message;
    for (size_t c = 0; c < kCounts.size(); ++c) {
      const size_t count = kCounts[c];
      for (int32_t op : kOps) {
        const std::vector<T> want = reference_reduce(data[c], static_cast<size_t>(rank) * count, count, op);
        for (bool in_place : {false, true}) {
          std::vector<T> send = data[c][static_cast<size_t>(rank)];
          std::vector<T> recv(count, T(-3));
          T* out = in_place ? send.data() + static_cast<size_t>(rank) * count : recv.data();
          EXPECT_OK(api()->reduce_scatter(comm.get(), nullptr, send.data(), out, count, dtype_of<T>(), op));
          EXPECT_TRUE(same_bits(want, out, count))
              << "n=" << n << " count=" << count << " op=" << op << " in_place=" << in_place << " rank=" << rank;
        }
      }
    }
  });
}
TEST(CommLocal, ReduceScatter) {
  for (int n = 1; n <= 4; ++n) {
    check_reduce_scatter<float>(n);
    check_reduce_scatter<double>(n);
    check_reduce_scatter<int32_t>(n);
    check_reduce_scatter<int64_t>(n);
  }
}

template <typename T>
void check_all_gather(int n) {
  const auto data = inputs_per_count<T>(3u, n, 1);
  World world(n);
  run_ranks(n, [&](int rank) {
    Comm comm(world, "tp", iota_ranks(n), rank);
    ASSERT_TRUE(comm.created().ok()) << comm.created().message;
    for (size_t c = 0; c < kCounts.size(); ++c) {
      const size_t count = kCounts[c];
      std::vector<T> want;
      for (const auto& v : data[c]) want.insert(want.end(), v.begin(), v.end());
      const std::vector<T>& mine = data[c][static_cast<size_t>(rank)];
      for (bool in_place : {false, true}) {
        std::vector<T> recv(count * static_cast<size_t>(n), T(-3));
        const T* send = mine.data();
        if (in_place) {  // send is this rank's block of recv
          std::copy(mine.begin(), mine.end(), recv.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(rank) * count));
          send = recv.data() + static_cast<size_t>(rank) * count;
        }
        EXPECT_OK(api()->all_gather(comm.get(), nullptr, send, recv.data(), count, dtype_of<T>()));
        EXPECT_TRUE(same_bits(want, recv.data(), recv.size()))
            << "n=" << n << " count=" << count << " in_place=" << in_place << " rank=" << rank;
      }
    }
  });
}
TEST(CommLocal, AllGather) {
  for (int n = 1; n <= 4; ++n) {
    check_all_gather<float>(n);
    check_all_gather<int64_t>(n);
  }
}

template <typename T>
void check_all_to_all(int n) {
  const auto un = static_cast<size_t>(n);
  const auto data = inputs_per_count<T>(4u, n, un);
  World world(n);
  run_ranks(n, [&](int rank) {
    Comm comm(world, "ep", iota_ranks(n), rank);
    ASSERT_TRUE(comm.created().ok()) << comm.created().message;
    const auto ur = static_cast<size_t>(rank);
    for (size_t c = 0; c < kCounts.size(); ++c) {
      const size_t count = kCounts[c];
      std::vector<T> want;  // block j of recv = block `rank` of rank j's send
      for (const auto& v : data[c]) {
        want.insert(want.end(), v.begin() + static_cast<std::ptrdiff_t>(ur * count),
                    v.begin() + static_cast<std::ptrdiff_t>((ur + 1) * count));
      }
      for (bool in_place : {false, true}) {
        std::vector<T> send = data[c][ur];
        std::vector<T> recv(count * un, T(-3));
        T* out = in_place ? send.data() : recv.data();
        EXPECT_OK(api()->all_to_all(comm.get(), nullptr, send.data(), out, count, dtype_of<T>()));
        EXPECT_TRUE(same_bits(want, out, count * un))
            << "n=" << n << " count=" << count << " in_place=" << in_place << " rank=" << rank;
      }
    }
  });
}
TEST(CommLocal, AllToAll) {
  for (int n = 1; n <= 4; ++n) {
    check_all_to_all<float>(n);
    check_all_to_all<int32_t>(n);
  }
}

// Rank i sends (i + 2*j + salt) % 5 elements to rank j, packed with gaps of 3.
size_t v_count(int from, int to, size_t salt) { return (static_cast<size_t>(from) + 2 * static_cast<size_t>(to) + salt) % 5; }

TEST(CommLocal, AllToAllV) {
  for (int n = 1; n <= 4; ++n) {
    World world(n);
    run_ranks(n, [&](int rank) {
      Comm comm(world, "ep", iota_ranks(n), rank);
      ASSERT_TRUE(comm.created().ok()) << comm.created().message;
      const auto un = static_cast<size_t>(n);
      for (size_t salt = 0; salt < 5; ++salt) {
        std::vector<size_t> sc(un), sd(un), rc(un), rd(un);
        size_t s_end = 0, r_end = 0;
        for (int j = 0; j < n; ++j) {
          const auto uj = static_cast<size_t>(j);
          sc[uj] = v_count(rank, j, salt);
          sd[uj] = s_end;
          s_end += sc[uj] + 3;
          rc[uj] = v_count(j, rank, salt);
          rd[uj] = r_end;
          r_end += rc[uj] + 3;
        }
        std::vector<double> send(s_end);
        for (size_t i = 0; i < s_end; ++i) send[i] = rank * 1000.0 + static_cast<double>(i) + 0.5;
        std::vector<double> recv(r_end, -1.0);
        std::vector<double> want(r_end, -1.0);
        for (int j = 0; j < n; ++j) {  // rank j's send displacement towards `rank`
          size_t displ = 0;
          for (int k = 0; k < rank; ++k) displ += v_count(j, k, salt) + 3;
          for (size_t e = 0; e < rc[static_cast<size_t>(j)]; ++e)
            want[rd[static_cast<size_t>(j)] + e] = j * 1000.0 + static_cast<double>(displ + e) + 0.5;
        }
        EXPECT_OK(api()->all_to_all_v(comm.get(), nullptr, send.data(), sc.data(), sd.data(), recv.data(), rc.data(),
                                      rd.data(), LOOM_DTYPE_F64));
        EXPECT_EQ(want, recv) << "n=" << n << " salt=" << salt << " rank=" << rank;
      }
    });
  }
}

TEST(CommLocal, Broadcast) {
  for (int n = 1; n <= 4; ++n) {
    World world(n);
    run_ranks(n, [&](int rank) {
      Comm comm(world, "tp", iota_ranks(n), rank);
      ASSERT_TRUE(comm.created().ok()) << comm.created().message;
      for (size_t count : kCounts) {
        for (int root = 0; root < n; ++root) {
          std::vector<int64_t> buf = inputs<int64_t>(41u, rank, count);
          const std::vector<int64_t> want = inputs<int64_t>(41u, root, count);
          EXPECT_OK(api()->broadcast(comm.get(), nullptr, buf.data(), count, LOOM_DTYPE_I64, root));
          EXPECT_EQ(want, buf) << "n=" << n << " count=" << count << " root=" << root << " rank=" << rank;
        }
      }
    });
  }
}

TEST(CommLocal, Bf16SumRoundsOnceFromFloat) {
  auto to_float = [](uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  auto to_bf16 = [](float f) {  // round to nearest even (no NaNs here)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  };
  const int n = 3;
  const size_t count = 333;
  std::vector<std::vector<uint16_t>> all(n, std::vector<uint16_t>(count));
  for (int r = 0; r < n; ++r) {
    auto f = inputs<float>(51u, r, count);
    for (size_t i = 0; i < count; ++i) all[static_cast<size_t>(r)][i] = to_bf16(f[i]);
  }
  std::vector<uint16_t> want(count);
  for (size_t i = 0; i < count; ++i) {
    float acc = to_float(all[0][i]);
    for (int r = 1; r < n; ++r) acc += to_float(all[static_cast<size_t>(r)][i]);
    want[i] = to_bf16(acc);
  }
  World world(n);
  run_ranks(n, [&](int rank) {
    Comm comm(world, "dp", iota_ranks(n), rank);
    std::vector<uint16_t> recv(count);
    EXPECT_OK(api()->all_reduce(comm.get(), nullptr, all[static_cast<size_t>(rank)].data(), recv.data(), count,
                                LOOM_DTYPE_BF16, LOOM_REDUCE_SUM));
    EXPECT_EQ(want, recv) << "rank " << rank;
  });
}

#if defined(__FLT16_MAX__)
TEST(CommLocal, F16AvgAccumulatesInFloat) {
  const int n = 4;
  const size_t count = 257;
  std::vector<std::vector<_Float16>> all(n, std::vector<_Float16>(count));
  for (int r = 0; r < n; ++r) {
    auto f = inputs<float>(52u, r, count);
    for (size_t i = 0; i < count; ++i) all[static_cast<size_t>(r)][i] = static_cast<_Float16>(f[i] * 1000.f);
  }
  std::vector<_Float16> want(count);
  for (size_t i = 0; i < count; ++i) {
    float acc = static_cast<float>(all[0][i]);
    for (int r = 1; r < n; ++r) acc += static_cast<float>(all[static_cast<size_t>(r)][i]);
    want[i] = static_cast<_Float16>(acc / static_cast<float>(n));
  }
  World world(n);
  run_ranks(n, [&](int rank) {
    Comm comm(world, "dp", iota_ranks(n), rank);
    std::vector<_Float16> buf = all[static_cast<size_t>(rank)];
    EXPECT_OK(api()->all_reduce(comm.get(), nullptr, buf.data(), buf.data(), count, LOOM_DTYPE_F16,
                                LOOM_REDUCE_AVG));
    EXPECT_TRUE(same_bits(want, buf.data(), count)) << "rank " << rank;
  });
}
#endif

// ---------------------------------------------------------------------------
// Determinism
// ---------------------------------------------------------------------------

TEST(CommLocal, FloatSumIsBitIdenticalAcrossRunsAndEqualsInOrderSum) {
  const int n = 4;
  const size_t count = 30011;
  std::vector<std::vector<float>> all;
  for (int r = 0; r < n; ++r) all.push_back(inputs<float>(61u, r, count));
  const std::vector<float> want = reference_reduce(all, 0, count, LOOM_REDUCE_SUM);
  // The inputs are order-sensitive: adding in reverse order differs somewhere, so a
  // backend that reduced in arrival order would be caught.
  size_t order_sensitive = 0;
  for (size_t i = 0; i < count; ++i) {
    float rev = all[3][i];
    for (int j = 2; j >= 0; --j) rev += all[static_cast<size_t>(j)][i];
    if (std::memcmp(&rev, &want[i], sizeof rev) != 0) ++order_sensitive;
  }
  ASSERT_GT(order_sensitive, count / 100);

  World world(n);
  std::vector<std::vector<float>> first(n);
  run_ranks(n, [&](int rank) {
    Comm comm(world, "dp", iota_ranks(n), rank);
    std::mt19937 jitter(static_cast<uint32_t>(rank));
    for (int run = 0; run < 20; ++run) {
      // Vary who arrives first.
      std::this_thread::sleep_for(std::chrono::microseconds(jitter() % 300));
      std::vector<float> recv(count);
      EXPECT_OK(api()->all_reduce(comm.get(), nullptr, all[static_cast<size_t>(rank)].data(), recv.data(), count,
                                  LOOM_DTYPE_F32, LOOM_REDUCE_SUM));
      if (run == 0) first[static_cast<size_t>(rank)] = recv;
      EXPECT_TRUE(same_bits(first[static_cast<size_t>(rank)], recv.data(), count)) << "run " << run << " rank " << rank;
      EXPECT_TRUE(same_bits(want, recv.data(), count)) << "run " << run << " rank " << rank;
    }
  });
}

// ---------------------------------------------------------------------------
// Several groups at once
// ---------------------------------------------------------------------------

TEST(CommLocal, SeveralGroupsConcurrently) {
  // 4 ranks, tp = {0,1} {2,3}, dp = {0,2} {1,3}, plus "edp" with the same ranks as dp.
  const int n = 4;
  World world(n);
  run_ranks(n, [&](int rank) {
    const int32_t tp_base = rank / 2 * 2;
    const std::vector<int32_t> tp_ranks = {tp_base, tp_base + 1};
    const std::vector<int32_t> dp_ranks = {rank % 2, rank % 2 + 2};
    // Create in a rank-dependent order so group_create calls of different groups interleave.
    Comm tp, dp, edp;
    if (rank % 2 == 0) {
      tp = Comm(world, "tp", tp_ranks, rank);
      dp = Comm(world, "dp", dp_ranks, rank);
      edp = Comm(world, "edp", dp_ranks, rank);
    } else {
      edp = Comm(world, "edp", dp_ranks, rank);
      dp = Comm(world, "dp", dp_ranks, rank);
      tp = Comm(world, "tp", tp_ranks, rank);
    }
    ASSERT_TRUE(tp.created().ok()) << tp.created().message;
    ASSERT_TRUE(dp.created().ok()) << dp.created().message;
    ASSERT_TRUE(edp.created().ok()) << edp.created().message;
    for (int it = 0; it < 50; ++it) {
      int64_t v = 1000 * it + rank;
      int64_t out = 0;
      EXPECT_OK(api()->all_reduce(tp.get(), nullptr, &v, &out, 1, LOOM_DTYPE_I64, LOOM_REDUCE_SUM));
      EXPECT_EQ(out, 2000 * it + tp_ranks[0] + tp_ranks[1]);
      EXPECT_OK(api()->all_reduce(dp.get(), nullptr, &v, &out, 1, LOOM_DTYPE_I64, LOOM_REDUCE_MAX));
      EXPECT_EQ(out, 1000 * it + dp_ranks[1]);
      EXPECT_OK(api()->all_reduce(edp.get(), nullptr, &v, &out, 1, LOOM_DTYPE_I64, LOOM_REDUCE_MIN));
      EXPECT_EQ(out, 1000 * it + dp_ranks[0]);
      int32_t gathered[2] = {-1, -1};
      const int32_t me = rank;
      EXPECT_OK(api()->all_gather(tp.get(), nullptr, &me, gathered, 1, LOOM_DTYPE_I32));
      EXPECT_EQ(gathered[0], tp_ranks[0]);
      EXPECT_EQ(gathered[1], tp_ranks[1]);
    }
  });
}

TEST(CommLocal, SameGroupCreatedTwiceGivesTwoCommunicators) {
  World world(2);
  run_ranks(2, [&](int rank) {
    Comm a(world, "pp", {0, 1}, rank);
    Comm b(world, "pp", {0, 1}, rank);
    ASSERT_TRUE(a.created().ok() && b.created().ok());
    const int32_t peer = 1 - rank;
    int32_t x = 10 + rank, y = 20 + rank, got_a = -1, got_b = -1;
    EXPECT_OK(api()->send(b.get(), nullptr, &y, 1, LOOM_DTYPE_I32, peer, 0));
    EXPECT_OK(api()->send(a.get(), nullptr, &x, 1, LOOM_DTYPE_I32, peer, 0));
    EXPECT_OK(api()->recv(a.get(), nullptr, &got_a, 1, LOOM_DTYPE_I32, peer, 0));
    EXPECT_OK(api()->recv(b.get(), nullptr, &got_b, 1, LOOM_DTYPE_I32, peer, 0));
    EXPECT_EQ(got_a, 10 + peer);
    EXPECT_EQ(got_b, 20 + peer);
  });
}

TEST(CommLocal, SizeOneGroupsCopyAndInPlaceIsANoOp) {
  World world(2);
  run_ranks(2, [&](int rank) {
    Comm self(world, "tp", {rank}, rank);
    ASSERT_TRUE(self.created().ok()) << self.created().message;
    std::vector<float> a = {1.5f, -2.0f, 3.25f}, b(3, 0.f);
    EXPECT_OK(api()->all_reduce(self.get(), nullptr, a.data(), b.data(), 3, LOOM_DTYPE_F32, LOOM_REDUCE_AVG));
    EXPECT_EQ(a, b);
    EXPECT_OK(api()->all_reduce(self.get(), nullptr, a.data(), a.data(), 3, LOOM_DTYPE_F32, LOOM_REDUCE_SUM));
    EXPECT_EQ(a, b);
    std::fill(b.begin(), b.end(), 0.f);
    EXPECT_OK(api()->all_gather(self.get(), nullptr, a.data(), b.data(), 3, LOOM_DTYPE_F32));
    EXPECT_EQ(a, b);
    EXPECT_OK(api()->broadcast(self.get(), nullptr, a.data(), 3, LOOM_DTYPE_F32, 0));
    EXPECT_OK(api()->barrier(self.get()));
    std::vector<float> c(3);
    EXPECT_OK(api()->send(self.get(), nullptr, a.data(), 3, LOOM_DTYPE_F32, 0, 9));
    EXPECT_OK(api()->recv(self.get(), nullptr, c.data(), 3, LOOM_DTYPE_F32, 0, 9));
    EXPECT_EQ(a, c);
  });
}

// ---------------------------------------------------------------------------
// Point to point
// ---------------------------------------------------------------------------

TEST(CommLocal, RingWhereEveryRankSendsFirstCompletes) {
  const int n = 4;
  World world(n, 5000);
  run_ranks(n, [&](int rank) {
    Comm pp(world, "pp", iota_ranks(n), rank);
    ASSERT_TRUE(pp.created().ok()) << pp.created().message;
    const int32_t next = (rank + 1) % n, prev = (rank + n - 1) % n;
    for (int step = 0; step < 20; ++step) {
      std::vector<float> out(4096, static_cast<float>(rank * 100 + step));
      std::vector<float> in(4096, -1.f);
      // Blocking sends would deadlock here: everyone sends before anyone receives.
      EXPECT_OK(api()->send(pp.get(), nullptr, out.data(), out.size(), LOOM_DTYPE_F32, next, step));
      std::fill(out.begin(), out.end(), -7.f);  // send copied the data: reuse is safe
      EXPECT_OK(api()->recv(pp.get(), nullptr, in.data(), in.size(), LOOM_DTYPE_F32, prev, step));
      EXPECT_EQ(in, std::vector<float>(4096, static_cast<float>(prev * 100 + step)));
    }
  });
}

TEST(CommLocal, MessagesWithTheSameTagArriveInOrder) {
  World world(2, 5000);
  run_ranks(2, [&](int rank) {
    Comm pp(world, "pp", {0, 1}, rank);
    if (rank == 0) {
      for (int32_t v : {1, 2}) EXPECT_OK(api()->send(pp.get(), nullptr, &v, 1, LOOM_DTYPE_I32, 1, 7));
      int32_t other = 99;
      EXPECT_OK(api()->send(pp.get(), nullptr, &other, 1, LOOM_DTYPE_I32, 1, 8));
      int32_t three = 3;
      EXPECT_OK(api()->send(pp.get(), nullptr, &three, 1, LOOM_DTYPE_I32, 1, 7));
    } else {
      int32_t v = -1;
      EXPECT_OK(api()->recv(pp.get(), nullptr, &v, 1, LOOM_DTYPE_I32, 0, 8));  // tag 8 first
      EXPECT_EQ(v, 99);
      for (int32_t want : {1, 2, 3}) {
        EXPECT_OK(api()->recv(pp.get(), nullptr, &v, 1, LOOM_DTYPE_I32, 0, 7));
        EXPECT_EQ(v, want);
      }
    }
  });
}

TEST(CommLocal, RecvWithoutSenderTimesOutNamingOpGroupAndPeer) {
  World world(2, 200);
  Result got;
  double seconds = 0;
  run_ranks(2, [&](int rank) {
    Comm pp(world, "pp", {0, 1}, rank);
    ASSERT_TRUE(pp.created().ok()) << pp.created().message;
    if (rank != 1) return;
    int32_t v = 0;
    const auto t0 = Clock::now();
    got = take(api()->recv(pp.get(), nullptr, &v, 1, LOOM_DTYPE_I32, 0, 5));
    seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    // The group is poisoned now: later calls fail at once.
    Result again = take(api()->send(pp.get(), nullptr, &v, 1, LOOM_DTYPE_I32, 0, 5));
    EXPECT_EQ(again.code, LOOM_CODE_TIMEOUT);
    EXPECT_NE(again.message.find("earlier"), std::string::npos) << again.message;
  });
  EXPECT_EQ(got.code, LOOM_CODE_TIMEOUT) << got.message;
  EXPECT_NE(got.message.find("recv"), std::string::npos) << got.message;
  EXPECT_NE(got.message.find("'pp'"), std::string::npos) << got.message;
  EXPECT_NE(got.message.find("peer 0"), std::string::npos) << got.message;
  EXPECT_NE(got.message.find("tag 5"), std::string::npos) << got.message;
  EXPECT_GE(seconds, 0.15);
  EXPECT_LT(seconds, 1.5);
}

TEST(CommLocal, RecvCountMismatchIsReported) {
  World world(2, 5000);
  run_ranks(2, [&](int rank) {
    Comm pp(world, "pp", {0, 1}, rank);
    std::vector<float> buf(12, 1.f);
    if (rank == 0) {
      EXPECT_OK(api()->send(pp.get(), nullptr, buf.data(), 10, LOOM_DTYPE_F32, 1, 0));
    } else {
      Result r = take(api()->recv(pp.get(), nullptr, buf.data(), 12, LOOM_DTYPE_F32, 0, 0));
      EXPECT_EQ(r.code, LOOM_CODE_INVALID_ARGUMENT) << r.message;
      EXPECT_NE(r.message.find("12"), std::string::npos) << r.message;
      EXPECT_NE(r.message.find("sent 10"), std::string::npos) << r.message;
    }
  });
}

// ---------------------------------------------------------------------------
// Timeouts and mismatched calls
// ---------------------------------------------------------------------------

void check_collective_timeout(bool use_barrier) {
  World world(3, 200);
  std::vector<Result> results(3);
  std::vector<double> seconds(3, 0);
  std::atomic<int> done{0};
  const auto t0 = Clock::now();
  run_ranks(3, [&](int rank) {
    Comm dp(world, "dp", {0, 1, 2}, rank);
    ASSERT_TRUE(dp.created().ok()) << dp.created().message;
    if (rank == 2) {  // never joins; afterwards its call must fail fast
      while (done.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      const auto t1 = Clock::now();
      results[2] = take(api()->barrier(dp.get()));
      seconds[2] = std::chrono::duration<double>(Clock::now() - t1).count();
      return;
    }
    float x = 1.f, y = 0.f;
    results[static_cast<size_t>(rank)] = take(use_barrier ? api()->barrier(dp.get())
                                                          : api()->all_reduce(dp.get(), nullptr, &x, &y, 1,
                                                                              LOOM_DTYPE_F32, LOOM_REDUCE_SUM));
    seconds[static_cast<size_t>(rank)] = std::chrono::duration<double>(Clock::now() - t0).count();
    ++done;
    // Fails fast too, instead of waiting another 200 ms.
    const auto t1 = Clock::now();
    Result again = take(api()->all_reduce(dp.get(), nullptr, &x, &y, 1, LOOM_DTYPE_F32, LOOM_REDUCE_SUM));
    EXPECT_NE(again.code, LOOM_CODE_OK);
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - t1).count(), 0.15);
    EXPECT_NE(again.message.find("earlier"), std::string::npos) << again.message;
  });
  const char* op = use_barrier ? "barrier" : "all_reduce";
  for (int rank = 0; rank < 2; ++rank) {
    const Result& r = results[static_cast<size_t>(rank)];
    EXPECT_EQ(r.code, LOOM_CODE_TIMEOUT) << r.message;
    EXPECT_NE(r.message.find(op), std::string::npos) << r.message;
    EXPECT_NE(r.message.find("'dp'"), std::string::npos) << r.message;
    EXPECT_NE(r.message.find("rank 2 never joined"), std::string::npos) << r.message;
    EXPECT_EQ(r.message.find('\n'), std::string::npos) << r.message;
    EXPECT_LT(seconds[static_cast<size_t>(rank)], 1.5);
  }
  EXPECT_EQ(results[2].code, LOOM_CODE_TIMEOUT) << results[2].message;
  EXPECT_NE(results[2].message.find("barrier"), std::string::npos) << results[2].message;
  EXPECT_NE(results[2].message.find("earlier"), std::string::npos) << results[2].message;
  EXPECT_LT(seconds[2], 0.15);
}
TEST(CommLocal, AllReduceTimesOutNamingTheMissingRank) { check_collective_timeout(false); }
TEST(CommLocal, BarrierTimesOutNamingTheMissingRank) { check_collective_timeout(true); }

TEST(CommLocal, GroupCreateTimesOutNamingTheMissingRank) {
  World world(3, 200);
  std::vector<Result> results(3);
  run_ranks(2, [&](int rank) {  // rank 2 never calls group_create
    Comm tp(world, "tp", {0, 1, 2}, rank);
    results[static_cast<size_t>(rank)] = tp.created();
  });
  for (int rank = 0; rank < 2; ++rank) {
    const Result& r = results[static_cast<size_t>(rank)];
    EXPECT_EQ(r.code, LOOM_CODE_TIMEOUT) << r.message;
    EXPECT_NE(r.message.find("group_create"), std::string::npos) << r.message;
    EXPECT_NE(r.message.find("'tp'"), std::string::npos) << r.message;
    EXPECT_NE(r.message.find("rank 2 never joined"), std::string::npos) << r.message;
  }
}

TEST(CommLocal, CountMismatchIsReportedOnEveryMember) {
  World world(2, 5000);
  std::vector<Result> results(2);
  run_ranks(2, [&](int rank) {
    Comm dp(world, "dp", {0, 1}, rank);
    std::vector<float> send(12, 1.f), recv(12, 0.f);
    const size_t count = rank == 0 ? 10 : 12;
    results[static_cast<size_t>(rank)] =
        take(api()->all_reduce(dp.get(), nullptr, send.data(), recv.data(), count, LOOM_DTYPE_F32, LOOM_REDUCE_SUM));
    // The group stays usable after a reported mismatch.
    EXPECT_OK(api()->all_reduce(dp.get(), nullptr, send.data(), recv.data(), 12, LOOM_DTYPE_F32, LOOM_REDUCE_SUM));
    EXPECT_EQ(recv, std::vector<float>(12, 2.f));
  });
  for (const Result& r : results) {
    EXPECT_EQ(r.code, LOOM_CODE_INVALID_ARGUMENT) << r.message;
    EXPECT_NE(r.message.find("count=10"), std::string::npos) << r.message;
    EXPECT_NE(r.message.find("count=12"), std::string::npos) << r.message;
  }
}

TEST(CommLocal, OpMismatchIsReportedOnEveryMember) {
  World world(2, 5000);
  std::vector<Result> results(2);
  run_ranks(2, [&](int rank) {
    Comm dp(world, "dp", {0, 1}, rank);
    std::vector<float> send(4, 1.f), recv(8, 0.f);
    results[static_cast<size_t>(rank)] =
        rank == 0 ? take(api()->all_reduce(dp.get(), nullptr, send.data(), recv.data(), 4, LOOM_DTYPE_F32,
                                           LOOM_REDUCE_SUM))
                  : take(api()->all_gather(dp.get(), nullptr, send.data(), recv.data(), 4, LOOM_DTYPE_F32));
  });
  for (const Result& r : results) {
    EXPECT_EQ(r.code, LOOM_CODE_INVALID_ARGUMENT) << r.message;
    EXPECT_NE(r.message.find("all_reduce"), std::string::npos) << r.message;
    EXPECT_NE(r.message.find("all_gather"), std::string::npos) << r.message;
  }
}

TEST(CommLocal, AllToAllVCountMismatchIsReported) {
  World world(2, 5000);
  std::vector<Result> results(2);
  run_ranks(2, [&](int rank) {
    Comm ep(world, "ep", {0, 1}, rank);
    std::vector<float> send(8, 1.f), recv(8, 0.f);
    std::vector<size_t> sc = {2, 2}, sd = {0, 2}, rc = {2, static_cast<size_t>(rank == 0 ? 3 : 2)}, rd = {0, 4};
    results[static_cast<size_t>(rank)] = take(api()->all_to_all_v(ep.get(), nullptr, send.data(), sc.data(),
                                                                  sd.data(), recv.data(), rc.data(), rd.data(),
                                                                  LOOM_DTYPE_F32));
  });
  for (const Result& r : results) {
    EXPECT_EQ(r.code, LOOM_CODE_INVALID_ARGUMENT) << r.message;
    EXPECT_NE(r.message.find("expects 3"), std::string::npos) << r.message;
  }
}

TEST(CommLocal, InvalidArgumentsOnOneMemberAreReportedOnAll) {
  World world(2, 5000);
  std::vector<Result> results(2);
  run_ranks(2, [&](int rank) {
    Comm dp(world, "dp", {0, 1}, rank);
    float x = 1.f, y = 0.f;
    results[static_cast<size_t>(rank)] =
        take(api()->all_reduce(dp.get(), nullptr, &x, &y, 1, LOOM_DTYPE_F32, rank == 1 ? 42 : LOOM_REDUCE_SUM));
  });
  for (const Result& r : results) {
    EXPECT_EQ(r.code, LOOM_CODE_INVALID_ARGUMENT) << r.message;
    EXPECT_NE(r.message.find("rank 1"), std::string::npos) << r.message;
  }
}

TEST(CommLocal, WorldWithRanksInOtherProcessesIsRefused) {
  loom::plugins::OptionValues options(nullptr, plugin().options);
  const int32_t local[] = {0, 1};
  loom_comm_world_args args{};
  args.struct_size = sizeof args;
  args.world_size = 4;
  args.num_local_ranks = 2;
  args.local_ranks = local;
  args.timeout_ms = 1000;
  loom_comm_world* w = nullptr;
  Result r = take(api()->world_create(options.raw(), &args, &w));
  EXPECT_EQ(r.code, LOOM_CODE_UNSUPPORTED) << r.message;
  EXPECT_NE(r.message.find("comm/mpi"), std::string::npos) << r.message;
}

}  // namespace

namespace {

// world_abort: a rank that failed stops the others at once, long before the
// (here 60 s) timeout, and the reason reaches every waiter and later caller.
TEST(CommLocal, WorldAbortReleasesWaitersPromptly) {
  World world(3, 60000);
  std::vector<Result> results(3);
  std::atomic<int> joined{0};
  const auto t0 = Clock::now();
  run_ranks(3, [&](int rank) {
    Comm dp(world, "dp", {0, 1, 2}, rank);
    ASSERT_TRUE(dp.created().ok()) << dp.created().message;
    if (rank == 2) {  // plays the engine: this rank failed; abort the world
      while (joined.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      api()->world_abort(world.raw(), "rank 2 failed: out of memory");
      return;
    }
    float x = 1.f, y = 0.f;
    ++joined;
    results[static_cast<size_t>(rank)] =
        take(api()->all_reduce(dp.get(), nullptr, &x, &y, 1, LOOM_DTYPE_F32, LOOM_REDUCE_SUM));
  });
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 5.0);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(results[static_cast<size_t>(rank)].code, LOOM_CODE_OK);
    EXPECT_NE(results[static_cast<size_t>(rank)].message.find("rank 2 failed: out of memory"), std::string::npos)
        << results[static_cast<size_t>(rank)].message;
  }
  // A group created after the abort is refused with the same reason.
  loom_comm* late = nullptr;
  Result r = Comm::create(world, "tp", {0}, 0, &late);
  EXPECT_NE(r.message.find("aborted"), std::string::npos) << r.message;
  EXPECT_EQ(late, nullptr);
}


// --- The link model (option links): lower bounds only, so no test depends on
// the machine being fast; the ideal link is what every other test here uses.

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

TEST(CommLocalLinks, AnAllReduceTakesTheRingTimeOfItsGroupKindsLink) {
  // dp: 1 GB/s and 20 ms; 2 ranks reduce 1 MB: 2 (p-1) (a + n/(p b)) = 2 (20 ms + 0.5 ms) = 41 ms,
  // well above the reduction's own time even under ASan on a loaded machine (~6 ms).
  World w(2, 20000, "dp=1GB/s,20ms; tp=1000GB/s");
  std::vector<double> took(2), took_tp(2);
  run_ranks(2, [&](int r) {
    Comm dp(w, "dp", {0, 1}, r), tp(w, "tp", {0, 1}, r);
    std::vector<float> x(250000, 1.0f);
    const Clock::time_point t0 = Clock::now();
    EXPECT_OK(api()->all_reduce(dp.get(), nullptr, x.data(), x.data(), x.size(), LOOM_DTYPE_F32, LOOM_REDUCE_SUM));
    took[static_cast<size_t>(r)] = seconds_since(t0);
    EXPECT_EQ(x[0], 2.0f);  // the model changes the time, not the result
    const Clock::time_point t1 = Clock::now();
    EXPECT_OK(api()->all_reduce(tp.get(), nullptr, x.data(), x.data(), x.size(), LOOM_DTYPE_F32, LOOM_REDUCE_SUM));
    took_tp[static_cast<size_t>(r)] = seconds_since(t1);
    EXPECT_EQ(x[0], 4.0f);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_GE(took[static_cast<size_t>(r)], 0.041) << "rank " << r;
    // tp's link moves the 1 MB in 1 us: far less than dp's (a generous bound, not a timing).
    EXPECT_LT(took_tp[static_cast<size_t>(r)], took[static_cast<size_t>(r)]) << "rank " << r;
  }
}

TEST(CommLocalLinks, AMessageArrivesNoEarlierThanItsTransferTime) {
  // Any kind ("*"): 0.5 GB/s and 3 ms; 1 MB takes 3 ms + 2 ms after the send began
  // (measured from the sender's clock: the receiver may start waiting later). The
  // send returns at once.
  World w(2, 20000, "*=0.5GB/s,3ms");
  std::atomic<int64_t> send_began{0};
  double sending = 0, in_flight = 0;
  run_ranks(2, [&](int r) {
    Comm pp(w, "pp", {0, 1}, r);
    std::vector<float> x(250000, static_cast<float>(r + 1));
    if (r == 0) {
      const Clock::time_point t0 = Clock::now();
      send_began = t0.time_since_epoch().count();
      EXPECT_OK(api()->send(pp.get(), nullptr, x.data(), x.size(), LOOM_DTYPE_F32, 1, 7));
      sending = seconds_since(t0);
    } else {
      EXPECT_OK(api()->recv(pp.get(), nullptr, x.data(), x.size(), LOOM_DTYPE_F32, 0, 7));
      const Clock::time_point arrived = Clock::now();
      in_flight = std::chrono::duration<double>(arrived - Clock::time_point(Clock::duration(send_began.load())))
                      .count();
      EXPECT_EQ(x[0], 1.0f);
    }
  });
  EXPECT_GE(in_flight, 0.005);
  EXPECT_LT(sending, in_flight);
}

TEST(CommLocalLinks, AMalformedLinkIsRefusedWithWhatWouldBeValid) {
  for (const auto& [spec, want] :
       {std::pair<std::string, std::string>{"dp=25", "must be a positive number with a unit: GB/s"},
        {"dp=25GB/s,10", "must be a number >= 0 with a unit: ns, us, ms or s"},
        {"dp 25GB/s", "must be KIND=BANDWIDTH[,LATENCY]"},
        {"dp=25GB/s; dp=1GB/s", "given twice"},
        {"=1GB/s", "names no group kind"},
        {"DP=1GB/s", "'DP' is not a group kind; valid: tp"},
        {"dp=1GB/s,2s", "above the 1s this model takes"},
        {"dp=0.5MB/s", "below the 1MB/s this model takes"},
        {"dp=0x10GB/s", "must be a positive number with a unit"}}) {
    try {
      World w(1, 1000, spec);
      ADD_FAILURE() << spec << " was accepted";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("option links"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << spec << ": " << e.what();
    }
  }
}



// ---------------------------------------------------------------------------
// Started collectives (ABI 1.15: start / wait)
// ---------------------------------------------------------------------------

loom_collective collective(int32_t kind, const void* send, void* recv, size_t count, int32_t op) {
  loom_collective c{};
  c.struct_size = sizeof c;
  c.kind = kind;
  c.send = send;
  c.recv = recv;
  c.count = count;
  c.dtype = LOOM_DTYPE_F32;
  c.op = op;
  return c;
}

// A member's started collectives run in the order it started them and before its
// later blocking ones: rank 1 starts its two in the other order than it waits for
// them, and each result is that of the call at the same place in every member's
// sequence; the results equal the blocking calls'.
TEST(CommLocalStart, StartedCollectivesKeepTheMembersCallOrder) {
  World w(3);
  std::vector<std::vector<float>> a(3), b(3), gathered(3), blocking(3);
  run_ranks(3, [&](int r) {
    Comm dp(w, "dp", {0, 1, 2}, r);
    a[r].assign(1000, static_cast<float>(r + 1));
    b[r].assign(600, static_cast<float>(10 * (r + 1)));
    gathered[r].assign(3 * 5, -1.f);
    blocking[r].assign(8, static_cast<float>(r));
    std::vector<float> mine(5, static_cast<float>(100 + r));
    loom_comm_request *ra = nullptr, *rb = nullptr, *rg = nullptr;
    const loom_collective ca = collective(LOOM_COLLECTIVE_ALL_REDUCE, a[r].data(), a[r].data(), 1000, LOOM_REDUCE_SUM);
    const loom_collective cb =
        collective(LOOM_COLLECTIVE_REDUCE_SCATTER, b[r].data(), b[r].data() + 200 * r, 200, LOOM_REDUCE_AVG);
    const loom_collective cg = collective(LOOM_COLLECTIVE_ALL_GATHER, mine.data(), gathered[r].data(), 5, 0);
    EXPECT_OK(api()->start(dp.get(), nullptr, &ca, &ra));
    EXPECT_OK(api()->start(dp.get(), nullptr, &cb, &rb));
    EXPECT_OK(api()->start(dp.get(), nullptr, &cg, &rg));
    // A blocking call after them runs after them (same member, same order everywhere).
    EXPECT_OK(api()->all_reduce(dp.get(), nullptr, blocking[r].data(), blocking[r].data(), 8, LOOM_DTYPE_F32,
                                LOOM_REDUCE_MAX));
    if (r == 1) {
      EXPECT_OK(api()->wait(dp.get(), rg, nullptr));
      EXPECT_OK(api()->wait(dp.get(), rb, nullptr));
      EXPECT_OK(api()->wait(dp.get(), ra, nullptr));
    } else {
      EXPECT_OK(api()->wait(dp.get(), ra, nullptr));
      EXPECT_OK(api()->wait(dp.get(), rb, nullptr));
      EXPECT_OK(api()->wait(dp.get(), rg, nullptr));
    }
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(a[r], std::vector<float>(1000, 6.f)) << "rank " << r;
    for (int i = 0; i < 200; ++i) EXPECT_EQ(b[r][200 * r + i], 20.f) << "rank " << r;  // (10 + 20 + 30) / 3
    for (int j = 0; j < 3; ++j)
      for (int i = 0; i < 5; ++i) EXPECT_EQ(gathered[r][5 * j + i], static_cast<float>(100 + j)) << "rank " << r;
    EXPECT_EQ(blocking[r], std::vector<float>(8, 2.f)) << "rank " << r;
  }
}

// The caller's thread goes on while a started collective waits out its modelled
// link time, and the failure of a started collective (a member that never joins)
// comes back at its wait, naming the group and the missing rank.
TEST(CommLocalStart, StartReturnsAtOnceAndFailuresComeBackAtWait) {
  {
    World w(2, 20000, "dp=1GB/s,20ms");  // 2 (a + n / (p b)) >= 40 ms
    std::vector<double> start_took(2), wait_took(2);
    run_ranks(2, [&](int r) {
      Comm dp(w, "dp", {0, 1}, r);
      std::vector<float> x(1000, 1.f);
      const loom_collective c = collective(LOOM_COLLECTIVE_ALL_REDUCE, x.data(), x.data(), x.size(), LOOM_REDUCE_SUM);
      loom_comm_request* req = nullptr;
      const Clock::time_point t0 = Clock::now();
      EXPECT_OK(api()->start(dp.get(), nullptr, &c, &req));
      start_took[r] = seconds_since(t0);
      EXPECT_OK(api()->wait(dp.get(), req, nullptr));
      wait_took[r] = seconds_since(t0);
      EXPECT_EQ(x[0], 2.f);
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_GE(wait_took[r], 0.04) << "rank " << r;
      EXPECT_LT(start_took[r], wait_took[r] / 2) << "rank " << r << ": start waited for the collective";
    }
  }
  World w(2, 300);
  run_ranks(2, [&](int r) {
    Comm dp(w, "dp", {0, 1}, r);
    if (r == 1) return;  // never calls
    std::vector<float> x(10, 1.f);
    const loom_collective c = collective(LOOM_COLLECTIVE_ALL_REDUCE, x.data(), x.data(), x.size(), LOOM_REDUCE_SUM);
    loom_comm_request* req = nullptr;
    EXPECT_OK(api()->start(dp.get(), nullptr, &c, &req));
    const Result res = take(api()->wait(dp.get(), req, nullptr));
    EXPECT_EQ(res.code, LOOM_CODE_TIMEOUT) << res.message;
    EXPECT_NE(res.message.find("'dp'"), std::string::npos) << res.message;
    EXPECT_NE(res.message.find("rank 1"), std::string::npos) << res.message;
  });
}

// --- Point to point started without waiting (ABI 1.17: LOOM_COLLECTIVE_SEND / _RECV)

loom_collective p2p(int32_t kind, void* buf, size_t count, int32_t peer, int32_t tag) {
  loom_collective c = collective(kind, kind == LOOM_COLLECTIVE_SEND ? buf : nullptr,
                                 kind == LOOM_COLLECTIVE_RECV ? buf : nullptr, count, LOOM_REDUCE_SUM);
  c.dtype = LOOM_DTYPE_I32;
  c.peer = peer;
  c.tag = tag;
  return c;
}

// Receives of one (peer, tag) take the messages in the order they were posted,
// however started and blocking receives and their waits interleave; a pending
// started receive does not hold back a collective on the same communicator (the
// barrier would never end if it did: the message is sent after it).
TEST(CommLocalStart, ReceivesTakeMessagesInTheOrderTheyWerePosted) {
  World w(2, 5000);
  std::vector<int32_t> got(4, -1);
  run_ranks(2, [&](int r) {
    Comm pp(w, "pp", {0, 1}, r);
    if (r == 0) {
      int32_t one = 1, two = 2, three = 3;
      loom_comm_request* req = nullptr;
      const loom_collective c = p2p(LOOM_COLLECTIVE_SEND, &one, 1, 1, 7);
      EXPECT_OK(api()->start(pp.get(), nullptr, &c, &req));
      one = -1;  // a started send copied its data too
      EXPECT_OK(api()->wait(pp.get(), req, nullptr));
      EXPECT_OK(api()->send(pp.get(), nullptr, &two, 1, LOOM_DTYPE_I32, 1, 7));
      EXPECT_OK(api()->barrier(pp.get()));
      EXPECT_OK(api()->send(pp.get(), nullptr, &three, 1, LOOM_DTYPE_I32, 1, 7));
      int32_t late = 4;
      EXPECT_OK(api()->send(pp.get(), nullptr, &late, 1, LOOM_DTYPE_I32, 1, 9));
    } else {
      loom_comm_request *first = nullptr, *third = nullptr, *fourth = nullptr;
      const loom_collective c1 = p2p(LOOM_COLLECTIVE_RECV, &got[0], 1, 0, 7);
      const loom_collective c4 = p2p(LOOM_COLLECTIVE_RECV, &got[3], 1, 0, 9);
      EXPECT_OK(api()->start(pp.get(), nullptr, &c1, &first));
      EXPECT_OK(api()->start(pp.get(), nullptr, &c4, &fourth));
      EXPECT_OK(api()->recv(pp.get(), nullptr, &got[1], 1, LOOM_DTYPE_I32, 0, 7));  // posted second
      const loom_collective c3 = p2p(LOOM_COLLECTIVE_RECV, &got[2], 1, 0, 7);
      EXPECT_OK(api()->start(pp.get(), nullptr, &c3, &third));
      EXPECT_OK(api()->barrier(pp.get()));
      EXPECT_OK(api()->wait(pp.get(), third, nullptr));
      EXPECT_OK(api()->wait(pp.get(), fourth, nullptr));
      EXPECT_OK(api()->wait(pp.get(), first, nullptr));
    }
  });
  EXPECT_EQ(got, (std::vector<int32_t>{1, 2, 3, 4}));
}

// With a modelled link a transfer starts once the message is sent and its receive
// posted: a receive posted before the receiver's other work finds the data there
// when it waits, one called after that work waits the whole transfer out.
TEST(CommLocalLinks, AReceivePostedEarlyHidesTheTransfer) {
  World w(2, 20000, "pp=1GB/s,25ms");  // a 4 KB message: 25 ms
  double early_wait = 0, blocking_wait = 0;
  run_ranks(2, [&](int r) {
    Comm pp(w, "pp", {0, 1}, r);
    std::vector<int32_t> x(1024, r == 0 ? 5 : 0);
    for (const bool early : {true, false}) {
      loom_comm_request* req = nullptr;
      const loom_collective c = p2p(LOOM_COLLECTIVE_RECV, x.data(), x.size(), 0, early ? 1 : 2);
      if (r == 1 && early) EXPECT_OK(api()->start(pp.get(), nullptr, &c, &req));
      EXPECT_OK(api()->barrier(pp.get()));
      if (r == 0) {
        EXPECT_OK(api()->send(pp.get(), nullptr, x.data(), x.size(), LOOM_DTYPE_I32, 1, early ? 1 : 2));
        continue;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(40));  // the receiver's other work
      const Clock::time_point t0 = Clock::now();
      if (early) EXPECT_OK(api()->wait(pp.get(), req, nullptr));
      else EXPECT_OK(api()->recv(pp.get(), nullptr, x.data(), x.size(), LOOM_DTYPE_I32, 0, 2));
      (early ? early_wait : blocking_wait) = seconds_since(t0);
      EXPECT_EQ(x[0], 5);
      x.assign(x.size(), 0);
    }
  });
  EXPECT_GE(blocking_wait, 0.025);
  EXPECT_LT(early_wait, blocking_wait / 2);
}

}  // namespace
