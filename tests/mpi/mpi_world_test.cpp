// The MPI world shared by comm/mpi and comm/nccl (plugins/comm/common/mpi_world),
// run under mpirun -np 4: share_from_first — how comm/nccl's processes agree on
// their NCCL unique ids — delivers to every member exactly what the group's first
// member made, for overlapping groups created in the engine's order and for the
// point-to-point channels of every ordered pair; the n-th creation of a group
// meets the n-th on the other members; a member whose first member never shares
// fails after the timeout naming that rank; and an abort in one process reaches
// failure() in the others (how comm/nccl's watchdog learns of it).
#include "plugins/comm/common/mpi_world.hpp"

#include <gtest/gtest.h>

#include "tests/support/mpi_rank_printer.hpp"
#include <loom/cpp/core.hpp>
#include <mpi.h>

#include <chrono>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace {

using loom::comm_common::Settings;
using loom::comm_common::World;

int g_rank = 0;
int g_size = 1;

std::unique_ptr<World> make_world(int64_t timeout_ms) {
  Settings s;
  s.plugin = "test";
  s.timeout_ms = timeout_ms;
  s.abort_on_failure = false;  // the test decides how the job ends
  return std::make_unique<World>(s, g_size, g_rank);
}

std::string text(const std::vector<unsigned char>& v) { return std::string(v.begin(), v.end()); }
std::vector<unsigned char> bytes(const std::string& s) { return std::vector<unsigned char>(s.begin(), s.end()); }

// Groups as the engine creates them on a grid of `g_size` ranks with tp = 2: every
// process walks the kinds in one order and creates the groups it belongs to.
std::vector<std::pair<std::string, std::vector<int32_t>>> my_groups() {
  std::vector<std::pair<std::string, std::vector<int32_t>>> out;
  const int tp = g_size % 2 == 0 ? 2 : 1;
  const int dp = g_size / tp;
  std::vector<int32_t> tp_group, dp_group, world;
  for (int i = 0; i < tp; ++i) tp_group.push_back(g_rank / tp * tp + i);
  for (int i = 0; i < dp; ++i) dp_group.push_back(g_rank % tp + i * tp);
  for (int i = 0; i < g_size; ++i) world.push_back(i);
  out.emplace_back("world", world);
  out.emplace_back("tp", tp_group);
  out.emplace_back("dp", dp_group);
  return out;
}

TEST(MpiWorld, EveryMemberGetsWhatTheFirstMemberMade) {
  auto w = make_world(30000);
  int made = 0;
  for (const auto& [kind, ranks] : my_groups()) {
    const std::string expect = kind + " made by " + std::to_string(ranks[0]);
    const auto got = w->share_from_first(kind, ranks, [&] {
      ++made;
      return bytes(kind + " made by " + std::to_string(g_rank));
    });
    EXPECT_EQ(text(got), expect) << "group " << kind << " on rank " << g_rank;
    // Point-to-point channels as comm/nccl makes them: each ordered pair of the
    // group's members, the sender first, created in (src, dst) order.
    for (size_t src = 0; src < ranks.size(); ++src)
      for (size_t dst = 0; dst < ranks.size(); ++dst) {
        if (src == dst || (ranks[src] != g_rank && ranks[dst] != g_rank)) continue;
        const std::string label = kind + " p2p " + std::to_string(src) + ">" + std::to_string(dst);
        const auto c = w->share_from_first(label, {ranks[src], ranks[dst]}, [&] {
          ++made;
          return bytes(label + " from " + std::to_string(g_rank));
        });
        EXPECT_EQ(text(c), label + " from " + std::to_string(ranks[src])) << "on rank " << g_rank;
      }
  }
  // make() runs on first members only: once per group led here, once per channel sent from here.
  int led = 0;
  for (const auto& [kind, ranks] : my_groups()) led += (ranks[0] == g_rank) + static_cast<int>(ranks.size()) - 1;
  EXPECT_EQ(made, led);
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(MpiWorld, NthCreationMeetsTheNth) {
  auto w = make_world(30000);
  const std::vector<int32_t> pair{0, 1};
  if (g_rank > 1) return;
  for (int n = 0; n < 5; ++n) {
    const auto got = w->share_from_first("again", pair, [&] { return bytes("call " + std::to_string(n)); });
    EXPECT_EQ(text(got), "call " + std::to_string(n));
  }
  // An empty id is carried as such.
  EXPECT_TRUE(w->share_from_first("empty", pair, [] { return std::vector<unsigned char>{}; }).empty());
}

TEST(MpiWorld, MissingFirstMemberTimesOutNamingIt) {
  auto w = make_world(500);
  if (g_rank == 1) {
    const auto start = std::chrono::steady_clock::now();
    try {
      w->share_from_first("never", {0, 1}, [] { return bytes("unused"); });
      ADD_FAILURE() << "share_from_first returned without the first member";
    } catch (const loom::Error& e) {
      const std::string msg = e.what();
      EXPECT_EQ(e.code(), LOOM_CODE_TIMEOUT) << msg;
      EXPECT_NE(msg.find("group 'never'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("global rank 0"), std::string::npos) << msg;
      EXPECT_NE(msg.find("after 500 ms"), std::string::npos) << msg;
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_GE(s, 0.45);
    EXPECT_LT(s, 10.0);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(MpiWorld, NotAMemberIsRefused) {
  auto w = make_world(30000);
  const int other = (g_rank + 1) % g_size;
  try {
    w->share_from_first("elsewhere", {other}, [] { return bytes("x"); });
    ADD_FAILURE() << "a non-member was not refused";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("not one of its members"), std::string::npos) << e.what();
  }
}

TEST(MpiWorld, AbortReachesFailureInEveryProcess) {
  auto w = make_world(30000);
  EXPECT_EQ(w->failure(), "");
  MPI_Barrier(MPI_COMM_WORLD);
  if (g_rank == g_size - 1) w->abort("rank " + std::to_string(g_rank) + " failed: out of patience");
  const std::string expect = "rank " + std::to_string(g_size - 1) + " failed: out of patience";
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  std::string seen;
  while ((seen = w->failure()).empty() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(seen, expect) << "on rank " << g_rank;
  // A later share fails at once with the reason instead of waiting.
  if (g_size > 1 && g_rank <= 1) {
    try {
      w->share_from_first("after abort", {0, 1}, [] { return bytes("x"); });
      ADD_FAILURE() << "share_from_first after an abort did not fail";
    } catch (const loom::Error& e) {
      EXPECT_NE(std::string(e.what()).find("out of patience"), std::string::npos) << e.what();
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}


}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  loom::testing::print_failures_with_rank(g_rank);
  const int rc = RUN_ALL_TESTS();
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
