// A device that keeps its memory apart from the host's, with a comm plugin that takes
// host buffers only (comm/local): the engine copies each collective's device buffers
// through host memory (runtime::DeviceStaging). device/cpu_staged (tests/staged_device)
// is device/cpu declaring its memory as its own, so the staging runs here as it would
// for device/cuda on one GPU:
//   - every layout trains bit-identically to device/cpu (the same reductions in the
//     same order): dp with ddp and with the distributed optimizer and both overlaps
//     (started collectives, run in line when staged), tp 2 + SP, cp 2, pp 2 with the
//     tied embedding, ep 2 (MoE all-to-all-v);
//   - bytes were staged (the path ran), and the plan says the run stages;
//   - the shim itself, op by op, with a fake comm plugin that fails any device pointer
//     it is given: extents, in-place calls, all_to_all_v's untouched gaps, host buffers
//     passed as they are, a buffer running past its allocation refused, a failed call
//     copying nothing back.
#include "support/rank_trace.hpp"
#include "support/train_fixture.hpp"

#include "engine/plugins/registry.hpp"
#include "engine/runtime/comm_stats.hpp"
#include "engine/runtime/rank_runtime.hpp"

#include <loom/cpp/core.hpp>

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

namespace {

using loom::testing::RankTrace;
using loom::testing::run_all_ranks;
using loom::testing::tiny_manifest;
using loom::testing::tiny_moe_manifest;
using loom::testing::with_overrides;

const std::string kStaged = std::string("plugins.search_paths=[\"") + LOOM_TEST_BUILD_DIR +
                            "/tests/staged_device/plugins\"]";

void expect_same_training(const std::string& manifest, const std::vector<std::string>& layout) {
  const std::vector<std::string> base = with_overrides({"run.steps=3", kStaged}, layout);
  const uint64_t before = loom::runtime::DeviceStaging::staged_bytes();
  const RankTrace host = run_all_ranks(manifest, base);
  EXPECT_EQ(loom::runtime::DeviceStaging::staged_bytes(), before) << "device/cpu's memory is the host's: no staging";
  const RankTrace staged = run_all_ranks(manifest, with_overrides(base, {"device.kind=\"cpu_staged\""}));
  EXPECT_GT(loom::runtime::DeviceStaging::staged_bytes(), before) << "no collective was staged";
  ASSERT_EQ(staged.loss.size(), host.loss.size());
  for (size_t s = 0; s < host.loss.size(); ++s) {
    EXPECT_EQ(staged.loss[s], host.loss[s]) << "loss at step " << s + 1;
    EXPECT_EQ(staged.result.steps[s].grad_norm, host.result.steps[s].grad_norm) << "gradient norm at step " << s + 1;
  }
  ASSERT_EQ(staged.params.size(), host.params.size());
  for (const auto& [rank, steps] : host.params)
    for (size_t s = 0; s < steps.size(); ++s)
      EXPECT_TRUE(staged.params.at(rank)[s] == steps[s]) << "rank " << rank << " parameters at step " << s + 1;
}

TEST(DeviceStaging, DataParallelTrainsAsOnTheHost) {
  expect_same_training(tiny_manifest(), {"parallel.dp=2"});
}

TEST(DeviceStaging, TheDistributedOptimizerWithBothOverlapsTrainsAsOnTheHost) {
  expect_same_training(tiny_manifest(), {"parallel.dp=2", "optimizer.strategy=\"distributed\"",
                                         "optimizer.bucket_size=1500", "optimizer.overlap_grad_reduce=true",
                                         "optimizer.overlap_param_gather=true"});
}

TEST(DeviceStaging, TensorAndSequenceParallelTrainAsOnTheHost) {
  expect_same_training(tiny_manifest(), {"parallel.tp=2", "parallel.sequence_parallel=true"});
}

TEST(DeviceStaging, ContextParallelTrainsAsOnTheHost) {
  expect_same_training(tiny_manifest(), {"parallel.cp=2"});
}

TEST(DeviceStaging, APipelineWithATiedEmbeddingTrainsAsOnTheHost) {
  expect_same_training(tiny_manifest(), {"parallel.pp=2"});
}

TEST(DeviceStaging, ExpertParallelAllToAllTrainsAsOnTheHost) {
  expect_same_training(tiny_moe_manifest(), {"model.block=[\"attention\", \"moe\"]", "parallel.dp=2", "parallel.ep=2"});
}

TEST(DeviceStaging, ThePlanSaysTheRunStages) {
  auto staging_warning = [](const std::vector<std::string>& overrides) {
    for (const std::string& w : loom::testing::plan_from(tiny_manifest(), overrides).warnings)
      if (w.find("each collective copies its device buffers through host memory") != std::string::npos) return true;
    return false;
  };
  EXPECT_TRUE(staging_warning({kStaged, "device.kind=\"cpu_staged\"", "parallel.dp=2"}));
  EXPECT_FALSE(staging_warning({kStaged, "device.kind=\"cpu_staged\"", "parallel.dp=1"})) << "one rank: nothing to stage";
  EXPECT_FALSE(staging_warning({kStaged, "parallel.dp=2"})) << "device/cpu: host memory";
}

// ---- the shim, op by op ----------------------------------------------------------------
// A fake comm plugin of two members, this one member 0: it refuses device memory (as a
// host-only plugin would crash on it), writes what the op would, and fails on demand.
loom::runtime::RankRuntime* g_rt = nullptr;  // whose allocations are device memory
bool g_fail = false;

loom_status refuse_device(const void* p, size_t bytes) {
  if (p != nullptr && bytes > 0 && g_rt->where_for_tests(p, bytes) != loom::runtime::DeviceStaging::Where::Host)
    return loom::make_status(LOOM_CODE_INTERNAL, "the fake host-only comm plugin got device memory");
  return nullptr;
}
#define LOOM_FAKE_HOST(p, bytes) \
  if (loom_status st = refuse_device(p, bytes)) return st
#define LOOM_FAKE_FAIL \
  if (g_fail) return loom::make_status(LOOM_CODE_INTERNAL, "the fake call failed")

// Member 0 of 2: all_reduce adds 1 (the other member's zeros plus one), all_gather
// puts the send block at 0 and 100 + it at 1, reduce_scatter adds block 0 and block 1.
loom_status f_all_reduce(loom_comm*, void*, const void* send, void* recv, size_t n, int32_t, int32_t) {
  LOOM_FAKE_HOST(send, n * 4);
  LOOM_FAKE_HOST(recv, n * 4);
  LOOM_FAKE_FAIL;
  std::vector<float> in(static_cast<const float*>(send), static_cast<const float*>(send) + n);
  for (size_t i = 0; i < n; ++i) static_cast<float*>(recv)[i] = in[i] + 1;
  return nullptr;
}
loom_status f_all_gather(loom_comm*, void*, const void* send, void* recv, size_t n, int32_t) {
  LOOM_FAKE_HOST(send, n * 4);
  LOOM_FAKE_HOST(recv, 2 * n * 4);
  LOOM_FAKE_FAIL;
  std::vector<float> in(static_cast<const float*>(send), static_cast<const float*>(send) + n);
  for (size_t i = 0; i < n; ++i) {
    static_cast<float*>(recv)[i] = in[i];
    static_cast<float*>(recv)[n + i] = 100 + in[i];
  }
  return nullptr;
}
loom_status f_reduce_scatter(loom_comm*, void*, const void* send, void* recv, size_t n, int32_t, int32_t) {
  LOOM_FAKE_HOST(send, 2 * n * 4);
  LOOM_FAKE_HOST(recv, n * 4);
  LOOM_FAKE_FAIL;
  std::vector<float> in(static_cast<const float*>(send), static_cast<const float*>(send) + 2 * n);
  for (size_t i = 0; i < n; ++i) static_cast<float*>(recv)[i] = in[i] + in[n + i];
  return nullptr;
}
// Writes 50 + j into each received segment j; reads nothing else.
loom_status f_all_to_all_v(loom_comm*, void*, const void* send, const size_t* sc, const size_t* sd, void* recv,
                           const size_t* rc, const size_t* rd, int32_t) {
  LOOM_FAKE_HOST(send, (sd[1] + sc[1]) * 4);
  LOOM_FAKE_HOST(recv, (rd[1] + rc[1]) * 4);
  LOOM_FAKE_FAIL;
  for (size_t j = 0; j < 2; ++j)
    for (size_t i = 0; i < rc[j]; ++i) static_cast<float*>(recv)[rd[j] + i] = 50.f + static_cast<float>(j);
  return nullptr;
}
loom_status f_broadcast(loom_comm*, void*, void* buf, size_t n, int32_t, int32_t) {
  LOOM_FAKE_HOST(buf, n * 4);
  LOOM_FAKE_FAIL;
  for (size_t i = 0; i < n; ++i) static_cast<float*>(buf)[i] = 7;
  return nullptr;
}
std::vector<float> g_sent;
loom_status f_send(loom_comm*, void*, const void* buf, size_t n, int32_t, int32_t, int32_t) {
  LOOM_FAKE_HOST(buf, n * 4);
  g_sent.assign(static_cast<const float*>(buf), static_cast<const float*>(buf) + n);
  return nullptr;
}
loom_status f_recv(loom_comm*, void*, void* buf, size_t n, int32_t, int32_t, int32_t) {
  LOOM_FAKE_HOST(buf, n * 4);
  for (size_t i = 0; i < n; ++i) static_cast<float*>(buf)[i] = 9;
  return nullptr;
}
void f_destroy(loom_comm*) {}

TEST(DeviceStaging, TheShimStagesEachOpAsItsArgumentsSay) {
  (void)loom::testing::plan_from(tiny_manifest(), {});  // loads the plugins
  const loom_device_api* api = loom::plugins::registry().get("device", "cpu").device();
  loom_device_create_args args = loom::make<loom_device_create_args>();
  loom_device* dev = nullptr;
  loom::check(api->create(nullptr, &args, &dev));
  loom::runtime::RankRuntime rt(0, api, dev);
  rt.stage_device_buffers();
  g_rt = &rt;
  loom_comm_api fake{};
  fake.struct_size = sizeof(fake);
  fake.group_destroy = f_destroy;
  fake.all_reduce = f_all_reduce;
  fake.all_gather = f_all_gather;
  fake.reduce_scatter = f_reduce_scatter;
  fake.all_to_all_v = f_all_to_all_v;
  fake.broadcast = f_broadcast;
  fake.send = f_send;
  fake.recv = f_recv;
  loom_group g = loom::make<loom_group>();
  g.api = &fake;
  g.comm = reinterpret_cast<loom_comm*>(&fake);  // any non-null handle
  g.size = 2;
  g.rank = 0;
  rt.add_group("tp", g);
  const loom::Group tp = rt.group_or_self("tp");

  // "Device" buffers: allocated through the rank, so tracked.
  auto device_floats = [&](std::vector<float> init) {
    void* p = nullptr;
    loom::check(rt.alloc(init.size() * 4, &p));
    std::memcpy(p, init.data(), init.size() * 4);
    return static_cast<float*>(p);
  };
  auto values = [](const float* p, size_t n) { return std::vector<float>(p, p + n); };
  const uint64_t staged_before = loom::runtime::DeviceStaging::staged_bytes();

  float* a = device_floats({1, 2, 3});
  tp.all_reduce(nullptr, a, a, 3, LOOM_DTYPE_F32);  // in place
  EXPECT_EQ(values(a, 3), (std::vector<float>{2, 3, 4}));

  float* gathered = device_floats({5, 6, 0, 0});
  tp.all_gather(nullptr, gathered, gathered, 2, LOOM_DTYPE_F32);  // in place: send = recv + rank * count
  EXPECT_EQ(values(gathered, 4), (std::vector<float>{5, 6, 105, 106}));

  float* scattered = device_floats({1, 2, 10, 20});
  tp.reduce_scatter(nullptr, scattered, scattered, 2, LOOM_DTYPE_F32);  // in place: recv = send + rank * count
  EXPECT_EQ(values(scattered, 2), (std::vector<float>{11, 22}));

  // all_to_all_v writes its segments only: the gap between them keeps its values.
  float* to_send = device_floats({1, 2, 3, 4});
  float* received = device_floats({-1, -1, -1, -1, -1, -1});
  const size_t sc[2] = {2, 2}, sd[2] = {0, 2}, rc[2] = {2, 2}, rd[2] = {0, 4};
  tp.all_to_all_v(nullptr, to_send, sc, sd, received, rc, rd, LOOM_DTYPE_F32);
  EXPECT_EQ(values(received, 6), (std::vector<float>{50, 50, -1, -1, 51, 51}));

  float* b = device_floats({0, 0});
  tp.broadcast(nullptr, b, 2, LOOM_DTYPE_F32, 1);
  EXPECT_EQ(values(b, 2), (std::vector<float>{7, 7}));

  float* msg = device_floats({3, 1, 4});
  tp.send(nullptr, msg, 3, LOOM_DTYPE_F32, 1, 0);
  EXPECT_EQ(g_sent, (std::vector<float>{3, 1, 4}));
  tp.recv(nullptr, msg, 3, LOOM_DTYPE_F32, 1, 0);
  EXPECT_EQ(values(msg, 3), (std::vector<float>{9, 9, 9}));
  EXPECT_GT(loom::runtime::DeviceStaging::staged_bytes(), staged_before);

  // Host memory goes to the plugin as it is (it refuses device memory only).
  std::vector<float> host = {1, 1};
  const uint64_t before_host = loom::runtime::DeviceStaging::staged_bytes();
  tp.all_reduce(nullptr, host.data(), host.data(), 2, LOOM_DTYPE_F32);
  EXPECT_EQ(host, (std::vector<float>{2, 2}));
  EXPECT_EQ(loom::runtime::DeviceStaging::staged_bytes(), before_host) << "host buffers are not copied";

  // A buffer that runs past its allocation is refused, naming it.
  float* small = device_floats({1, 2});
  try {
    tp.all_reduce(nullptr, small, small, 4, LOOM_DTYPE_F32);
    ADD_FAILURE() << "a buffer past its allocation's end was staged";
  } catch (const loom::Error& e) {
    EXPECT_EQ(e.code(), LOOM_CODE_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("runs past the end of the device allocation"), std::string::npos) << e.what();
  }
  EXPECT_EQ(values(small, 2), (std::vector<float>{1, 2}));

  // A failed call copies nothing back.
  float* kept = device_floats({4, 5});
  g_fail = true;
  EXPECT_THROW(tp.all_reduce(nullptr, kept, kept, 2, LOOM_DTYPE_F32), loom::Error);
  g_fail = false;
  EXPECT_EQ(values(kept, 2), (std::vector<float>{4, 5}));

  for (float* p : {a, gathered, scattered, to_send, received, b, msg, small, kept}) rt.free(p);
  g_rt = nullptr;
}

}  // namespace
