// comm/nccl with two ranks as threads, one GPU each (skipped with fewer than two
// GPUs): every collective on device buffers (stream-ordered on the rank's
// device/cuda stream) and on host buffers (staged), point to point, a collective
// captured into a graph, and the watchdog stopping a collective that one rank
// never joins. Without a GPU, world_create's refusal is checked.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <toml++/toml.h>

#include <functional>
#include <loom/cpp/core.hpp>
#include <string>
#include <thread>
#include <vector>

#include "engine/plugins/registry.hpp"
#include "tests/gpu/plugin_dir.hpp"

namespace {

int gpu_count() {
  static const int n = [] {
    int c = 0;
    if (cudaGetDeviceCount(&c) != cudaSuccess) {
      cudaGetLastError();
      c = 0;
    }
    return c;
  }();
  return n;
}

loom::plugins::Registry& registry() {
  static loom::plugins::Registry* r = [] {
    auto* reg = new loom::plugins::Registry();
    reg->load_file(loom_test::plugin_file("loom_comm_nccl.so"));
    reg->load_file(loom_test::plugin_file("loom_device_cuda.so"));
    loom::host_slot() = loom::plugins::host_api();
    return reg;
  }();
  return *r;
}

std::pair<int32_t, std::string> take(loom_status s) {
  if (s == nullptr) return {LOOM_CODE_OK, ""};
  const loom_host_api& h = loom::host();
  std::pair<int32_t, std::string> out{h.status_code(s), h.status_message(s)};
  h.status_destroy(s);
  return out;
}

struct World {
  const loom_comm_api* api = nullptr;
  loom_comm_world* world = nullptr;
  World(int size, int64_t timeout_ms) {
    const loom::plugins::LoadedPlugin& p = registry().get("comm", "nccl");
    api = p.comm();
    std::vector<int32_t> ranks(size);
    for (int i = 0; i < size; ++i) ranks[i] = i;
    loom::plugins::OptionValues opts(nullptr, p.options);
    loom_comm_world_args a = loom::make<loom_comm_world_args>();
    a.world_size = size;
    a.num_local_ranks = size;
    a.local_ranks = ranks.data();
    a.timeout_ms = timeout_ms;
    loom::check(api->world_create(opts.raw(), &a, &world));
  }
  ~World() { api->world_destroy(world); }
};

// One rank: its device/cuda device and its communicator over all ranks.
struct Rank {
  const loom_device_api* dev_api = nullptr;
  loom_device* dev = nullptr;
  loom_comm* comm = nullptr;
  const World* w = nullptr;
  Rank(const World& world, int rank, int size, const char* kind = "world") : w(&world) {
    const loom::plugins::LoadedPlugin& p = registry().get("device", "cuda");
    dev_api = p.device();
    loom::plugins::OptionValues opts(nullptr, p.options);
    loom_device_create_args a = loom::make<loom_device_create_args>();
    a.global_rank = a.local_rank = rank;
    a.ranks_in_process = size;
    loom::check(dev_api->create(opts.raw(), &a, &dev));
    std::vector<int32_t> members(size);
    for (int i = 0; i < size; ++i) members[i] = i;
    loom_group_desc d = loom::make<loom_group_desc>();
    d.kind = kind;
    d.ranks = members.data();
    d.size = size;
    d.my_rank = rank;
    loom::check(world.api->group_create(world.world, &d, &comm));
  }
  ~Rank() {
    w->api->group_destroy(comm);
    dev_api->destroy(dev);
  }
  void* stream() const { return dev_api->native_stream(dev, nullptr); }
  template <typename T>
  T* upload(const std::vector<T>& v) const {
    void* p = nullptr;
    loom::check(dev_api->alloc(dev, v.size() * sizeof(T), &p));
    loom::check(dev_api->copy(dev, nullptr, p, v.data(), v.size() * sizeof(T), LOOM_COPY_HOST_TO_DEVICE));
    return static_cast<T*>(p);
  }
  template <typename T>
  std::vector<T> download(const T* p, size_t n) const {
    std::vector<T> v(n);
    loom::check(dev_api->copy(dev, nullptr, v.data(), p, n * sizeof(T), LOOM_COPY_DEVICE_TO_HOST));
    loom::check(dev_api->stream_synchronize(dev, nullptr));
    return v;
  }
  void free(void* p) const { dev_api->free(dev, p); }
};

void on_ranks(int size, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

TEST(CommNccl, WithoutGpusWorldCreateIsUnsupported) {
  if (gpu_count() > 0) GTEST_SKIP() << "a GPU is visible";
  const loom::plugins::LoadedPlugin& p = registry().get("comm", "nccl");
  std::vector<int32_t> ranks{0, 1};
  loom_comm_world_args a = loom::make<loom_comm_world_args>();
  a.world_size = 2;
  a.num_local_ranks = 2;
  a.local_ranks = ranks.data();
  a.timeout_ms = 1000;
  loom_comm_world* w = nullptr;
  auto [code, message] = take(p.comm()->world_create(nullptr, &a, &w));
  EXPECT_EQ(code, LOOM_CODE_UNSUPPORTED);
  EXPECT_NE(message.find("GPU"), std::string::npos) << message;
}

TEST(CommNccl, CollectivesOnDeviceAndHostBuffers) {
  if (gpu_count() < 2) GTEST_SKIP() << "needs 2 GPUs, " << gpu_count() << " visible";
  const int size = 2;
  World world(size, 60000);
  on_ranks(size, [&](int r) {
    Rank rank(world, r, size);
    const loom_comm_api* api = world.api;
    void* s = rank.stream();
    const size_t n = 1000;
    // all_reduce (sum, max, avg) in place on the device.
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(i) + 1000.0f * static_cast<float>(r);
    float* x = rank.upload(v);
    loom::check(api->all_reduce(rank.comm, s, x, x, n, LOOM_DTYPE_F32, LOOM_REDUCE_SUM));
    std::vector<float> got = rank.download(x, n);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], 2.0f * static_cast<float>(i) + 1000.0f) << r;
    loom::check(api->all_reduce(rank.comm, s, x, x, n, LOOM_DTYPE_F32, LOOM_REDUCE_AVG));
    got = rank.download(x, n);
    EXPECT_EQ(got[3], 2.0f * 3 + 1000.0f);
    // all_gather and reduce_scatter.
    float* g = rank.upload(std::vector<float>(n * size, -1.0f));
    float* mine = rank.upload(std::vector<float>(n, static_cast<float>(r + 1)));
    loom::check(api->all_gather(rank.comm, s, mine, g, n, LOOM_DTYPE_F32));
    got = rank.download(g, n * size);
    EXPECT_EQ(got[0], 1.0f);
    EXPECT_EQ(got[n], 2.0f);
    loom::check(api->reduce_scatter(rank.comm, s, g, mine, n, LOOM_DTYPE_F32, LOOM_REDUCE_SUM));
    got = rank.download(mine, n);
    EXPECT_EQ(got[0], 2.0f * static_cast<float>(r + 1));
    // broadcast from rank 1.
    loom::check(api->broadcast(rank.comm, s, mine, n, LOOM_DTYPE_F32, 1));
    EXPECT_EQ(rank.download(mine, n)[7], 4.0f);
    // all_to_all: block i of rank r holds 10 r + i.
    std::vector<int32_t> blocks(size * 4);
    for (int i = 0; i < size; ++i)
      for (int j = 0; j < 4; ++j) blocks[i * 4 + j] = 10 * r + i;
    int32_t* send = rank.upload(blocks);
    int32_t* recv = rank.upload(std::vector<int32_t>(size * 4, -1));
    loom::check(api->all_to_all(rank.comm, s, send, recv, 4, LOOM_DTYPE_I32));
    const std::vector<int32_t> a2a = rank.download(recv, size * 4);
    for (int j = 0; j < size; ++j) EXPECT_EQ(a2a[j * 4], 10 * j + r) << "block " << j << " of rank " << r;
    // Point to point: rank 0 sends, rank 1 receives.
    if (r == 0) loom::check(api->send(rank.comm, s, x, n, LOOM_DTYPE_F32, 1, 0));
    else loom::check(api->recv(rank.comm, s, g, n, LOOM_DTYPE_F32, 0, 0));
    if (r == 1) {
      EXPECT_EQ(rank.download(g, n)[5], 2.0f * 5 + 1000.0f);
    }
    // Host buffers with stream NULL (the engine's loss and flag reductions).
    double host[2] = {1.0 + r, 10.0 * r};
    loom::check(api->all_reduce(rank.comm, nullptr, host, host, 2, LOOM_DTYPE_F64, LOOM_REDUCE_MAX));
    EXPECT_EQ(host[0], 2.0);
    EXPECT_EQ(host[1], 10.0);
    loom::check(api->barrier(rank.comm));
    for (void* p : {static_cast<void*>(x), static_cast<void*>(g), static_cast<void*>(mine), static_cast<void*>(send),
                    static_cast<void*>(recv)})
      rank.free(p);
  });
}

// Both ranks send first, then receive (a pipeline's steady state: activation
// forward, gradient back). On a "pp" group each ordered pair has its own channels,
// connected in group_create, and sends are staged, so this completes; the sender overwrites its buffer right
// after the send without changing what the peer receives.
TEST(CommNccl, PipelineSendsDoNotWaitForTheReceiver) {
  if (gpu_count() < 2) GTEST_SKIP() << "needs 2 GPUs, " << gpu_count() << " visible";
  const int size = 2;
  World world(size, 60000);
  on_ranks(size, [&](int r) {
    Rank rank(world, r, size, "pp");
    const size_t n = 1 << 22;  // 16 MiB: larger than NCCL's internal buffers
    float* out = rank.upload(std::vector<float>(n, static_cast<float>(r + 1)));
    float* in = rank.upload(std::vector<float>(n, -1.0f));
    void* s = rank.stream();
    for (int round = 0; round < 3; ++round) {
      loom::check(world.api->send(rank.comm, s, out, n, LOOM_DTYPE_F32, 1 - r, 0));
      loom_elementwise_args fill = loom::make<loom_elementwise_args>();
      fill.op = LOOM_EW_FILL;
      fill.n = static_cast<int64_t>(n);
      fill.out = out;
      fill.alpha = 100.0f;  // overwrite at once: the peer must still get the sent values
      fill.dtype = fill.out_dtype = LOOM_DTYPE_F32;
      loom::check(rank.dev_api->ops->elementwise(rank.dev, nullptr, &fill));
      loom::check(world.api->recv(rank.comm, s, in, n, LOOM_DTYPE_F32, 1 - r, 0));
      const std::vector<float> got = rank.download(in, n);
      const float want = round == 0 ? static_cast<float>(2 - r) : 100.0f;
      EXPECT_EQ(got[0], want) << "rank " << r << " round " << round;
      EXPECT_EQ(got[n - 1], want) << "rank " << r << " round " << round;
    }
    rank.free(out);
    rank.free(in);
  });
}

// ABI 1.17: started receives on a pipeline channel are enqueued at start and take
// the messages of their (peer, tag) in the order they were posted, started and
// blocking alike, whatever order their waits come in; a started send is a send.
TEST(CommNccl, StartedReceivesTakeMessagesInPostingOrder) {
  if (gpu_count() < 2) GTEST_SKIP() << "needs 2 GPUs, " << gpu_count() << " visible";
  const int size = 2;
  World world(size, 60000);
  ASSERT_TRUE(world.api->features & LOOM_COMM_START_P2P);
  on_ranks(size, [&](int r) {
    Rank rank(world, r, size, "pp");
    const size_t n = 1 << 20;
    void* s = rank.stream();
    auto p2p = [&](int32_t kind, float* buf) {
      loom_collective c = loom::make<loom_collective>();
      c.kind = kind;
      if (kind == LOOM_COLLECTIVE_SEND) c.send = buf;
      else c.recv = buf;
      c.count = n;
      c.dtype = LOOM_DTYPE_F32;
      c.peer = 1 - r;
      c.tag = 4;
      return c;
    };
    if (r == 0) {
      std::vector<float*> out;
      for (float v : {1.0f, 2.0f, 3.0f}) out.push_back(rank.upload(std::vector<float>(n, v)));
      loom_comm_request* req = nullptr;
      const loom_collective first = p2p(LOOM_COLLECTIVE_SEND, out[0]);
      loom::check(world.api->start(rank.comm, s, &first, &req));
      loom::check(world.api->wait(rank.comm, req, s));
      loom::check(world.api->send(rank.comm, s, out[1], n, LOOM_DTYPE_F32, 1, 4));
      loom::check(world.api->send(rank.comm, s, out[2], n, LOOM_DTYPE_F32, 1, 4));
      loom::check(rank.dev_api->stream_synchronize(rank.dev, nullptr));
      for (float* p : out) rank.free(p);
    } else {
      std::vector<float*> in;
      for (int i = 0; i < 3; ++i) in.push_back(rank.upload(std::vector<float>(n, -1.0f)));
      loom_comm_request *a = nullptr, *c = nullptr;
      const loom_collective ca = p2p(LOOM_COLLECTIVE_RECV, in[0]);
      loom::check(world.api->start(rank.comm, s, &ca, &a));
      loom::check(world.api->recv(rank.comm, s, in[1], n, LOOM_DTYPE_F32, 0, 4));  // posted second
      const loom_collective cc = p2p(LOOM_COLLECTIVE_RECV, in[2]);
      loom::check(world.api->start(rank.comm, s, &cc, &c));
      loom::check(world.api->wait(rank.comm, c, s));
      loom::check(world.api->wait(rank.comm, a, s));
      for (int i = 0; i < 3; ++i) {
        const std::vector<float> got = rank.download(in[static_cast<size_t>(i)], n);
        EXPECT_EQ(got[0], static_cast<float>(i + 1)) << "receive " << i;
        EXPECT_EQ(got[n - 1], static_cast<float>(i + 1)) << "receive " << i;
      }
      for (float* p : in) rank.free(p);
    }
  });
}

// Messages of one (peer, tag) stay in order, but tags of different parity may be
// received in another order than sent (an interleaved pipeline receives chunk
// 3's activation after chunk 1's gradient that was sent later): the executor's
// activations (even tags) and gradients (odd) go through separate channels.
TEST(CommNccl, TagsOfDifferentParityAreReceivedInAnyOrder) {
  if (gpu_count() < 2) GTEST_SKIP() << "needs 2 GPUs, " << gpu_count() << " visible";
  const int size = 2;
  World world(size, 60000);
  on_ranks(size, [&](int r) {
    Rank rank(world, r, size, "pp");
    const size_t n = 1024;
    void* s = rank.stream();
    if (r == 0) {
      float* act = rank.upload(std::vector<float>(n, 2.0f));
      float* grad = rank.upload(std::vector<float>(n, 3.0f));
      loom::check(world.api->send(rank.comm, s, act, n, LOOM_DTYPE_F32, 1, 2));   // sent first
      loom::check(world.api->send(rank.comm, s, grad, n, LOOM_DTYPE_F32, 1, 3));  // sent second
      loom::check(rank.dev_api->stream_synchronize(rank.dev, nullptr));
      rank.free(act);
      rank.free(grad);
    } else {
      float* a = rank.upload(std::vector<float>(n, -1.0f));
      float* b = rank.upload(std::vector<float>(n, -1.0f));
      loom::check(world.api->recv(rank.comm, s, b, n, LOOM_DTYPE_F32, 0, 3));  // received first
      loom::check(world.api->recv(rank.comm, s, a, n, LOOM_DTYPE_F32, 0, 2));
      EXPECT_EQ(rank.download(b, n)[7], 3.0f);
      EXPECT_EQ(rank.download(a, n)[7], 2.0f);
      rank.free(a);
      rank.free(b);
    }
  });
}

TEST(CommNccl, AllReduceCapturedIntoAGraphReplays) {
  if (gpu_count() < 2) GTEST_SKIP() << "needs 2 GPUs, " << gpu_count() << " visible";
  const int size = 2;
  World world(size, 60000);
  on_ranks(size, [&](int r) {
    Rank rank(world, r, size);
    const size_t n = 4096;
    float* x = rank.upload(std::vector<float>(n, 1.0f));
    loom::check(rank.dev_api->capture_begin(rank.dev, nullptr));
    loom::check(world.api->all_reduce(rank.comm, rank.stream(), x, x, n, LOOM_DTYPE_F32, LOOM_REDUCE_SUM));
    loom_graph* graph = nullptr;
    loom::check(rank.dev_api->capture_end(rank.dev, nullptr, &graph));
    EXPECT_EQ(rank.download(x, n)[0], 1.0f) << "nothing runs during capture";
    for (int i = 0; i < 3; ++i) loom::check(rank.dev_api->graph_replay(rank.dev, graph, nullptr));
    EXPECT_EQ(rank.download(x, n)[0], 8.0f);  // 1 -> 2 -> 4 -> 8
    rank.dev_api->graph_destroy(rank.dev, graph);
    rank.free(x);
  });
}

TEST(CommNccl, WatchdogStopsACollectiveThatARankNeverJoins) {
  if (gpu_count() < 2) GTEST_SKIP() << "needs 2 GPUs, " << gpu_count() << " visible";
  const int size = 2;
  World world(size, 2000);
  std::pair<int32_t, std::string> result;
  on_ranks(size, [&](int r) {
    Rank rank(world, r, size);
    if (r == 0) {
      double v = 1;
      result = take(world.api->all_reduce(rank.comm, nullptr, &v, &v, 1, LOOM_DTYPE_F64, LOOM_REDUCE_SUM));
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(4000));  // never joins
    }
  });
  EXPECT_EQ(result.first, LOOM_CODE_TIMEOUT) << result.second;
  EXPECT_NE(result.second.find("all_reduce"), std::string::npos) << result.second;
  EXPECT_NE(result.second.find("group 'world'"), std::string::npos) << result.second;
  EXPECT_NE(result.second.find("rank 0 of 2"), std::string::npos) << result.second;
}

}  // namespace
