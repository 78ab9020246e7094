#include "engine/runtime/rank_runtime.hpp"

#include "engine/plugins/registry.hpp"

#include <climits>
#include <cstdint>
#include <iterator>

namespace loom::runtime {

RankRuntime::RankRuntime(int global_rank, const loom_device_api* device_api, loom_device* device)
    : rank_(global_rank), device_api_(device_api), device_(device) {
  plugins::host_api();
}

RankRuntime::~RankRuntime() {
  if (exec_api_ && exec_) exec_api_->destroy(exec_);
  for (auto& [kind, g] : groups_)
    if (g.api && g.comm) g.api->group_destroy(g.comm);
  if (device_api_ && device_) device_api_->destroy(device_);
}

void RankRuntime::add_group(const std::string& kind, const loom_group& group) {
  groups_[kind] = counting_group(group, kind, &comm_stats_, staging_.get());
}

void RankRuntime::stage_device_buffers() {
  // Before anything is allocated through the rank (the launcher calls it right after
  // creating the device): an earlier allocation would be taken for host memory.
  LOOM_REQUIRE(groups_.empty(), "rank " << rank_ << ": device buffers must be staged before its groups are added");
  staging_ = std::make_unique<DeviceStaging>();
  staging_->where = [this](const void* p, size_t bytes) { return where(p, bytes); };
  staging_->copy = [this](void* dst, const void* src, size_t bytes, int32_t kind) {
    // On the default stream, which carries the rank's compute: after what it has
    // launched; synchronised so the host side is complete (or may be freed) after.
    loom::check(device_api_->copy(device_, nullptr, dst, src, bytes, kind));
    loom::check(device_api_->stream_synchronize(device_, nullptr));
  };
}

DeviceStaging::Where RankRuntime::where(const void* p, size_t bytes) const {
  using Where = DeviceStaging::Where;
  const auto a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t last = bytes > UINTPTR_MAX - a ? UINTPTR_MAX : a + bytes;  // one past the end
  std::lock_guard<std::mutex> lock(allocations_mu_);
  auto next = allocations_.upper_bound(a);  // the first allocation starting after p
  if (next != allocations_.begin()) {
    auto it = std::prev(next);
    const uintptr_t off = a - it->first;
    if (off < it->second) return bytes <= it->second - off ? Where::Device : Where::Partly;
  }
  // Starts outside every allocation: host memory unless it runs into the next one.
  return next != allocations_.end() && next->first < last ? Where::Partly : Where::Host;
}

const void* RankRuntime::service(int32_t api_type, const char* name) {
  if (name != nullptr && *name != '\0') return nullptr;  // by name: the registry's
  auto it = services_.find(api_type);
  return it == services_.end() ? nullptr : it->second;
}

void RankRuntime::set_exec(const loom_exec_api* api, loom_exec* exec) {
  if (exec_api_ && exec_) exec_api_->destroy(exec_);
  exec_api_ = api;
  exec_ = exec;
}

loom::Group RankRuntime::group_or_self(const std::string& kind) const {
  auto it = groups_.find(kind);
  return it == groups_.end() ? loom::Group() : loom::Group(it->second);
}

loom_memory_stats RankRuntime::memory() const {
  loom_memory_stats s = loom::make<loom_memory_stats>();
  if (device_api_ && device_api_->memory_stats) loom::check(device_api_->memory_stats(device_, &s));
  return s;
}

loom_status RankRuntime::alloc(size_t bytes, void** out) {
  loom_status st = device_api_->alloc(device_, bytes, out);
  if (st == nullptr && staging_ && *out != nullptr) {
    try {  // called through the C host API: nothing may escape
      std::lock_guard<std::mutex> lock(allocations_mu_);
      allocations_[reinterpret_cast<uintptr_t>(*out)] = bytes;
    } catch (const std::exception& e) {
      device_api_->free(device_, *out);
      *out = nullptr;
      return loom::make_status(LOOM_CODE_OUT_OF_MEMORY,
                               std::string("rank ") + std::to_string(rank_) + ": recording an allocation: " + e.what());
    }
  }
  return st;
}
void RankRuntime::free(void* ptr) {
  if (staging_ && ptr != nullptr) {
    std::lock_guard<std::mutex> lock(allocations_mu_);
    allocations_.erase(reinterpret_cast<uintptr_t>(ptr));
  }
  device_api_->free(device_, ptr);
}

loom_status RankRuntime::device(const loom_device_api** api, loom_device** dev, loom_stream** stream) {
  *api = device_api_;
  *dev = device_;
  *stream = nullptr;  // the device's default stream carries compute
  return nullptr;
}

loom_status RankRuntime::group(const std::string& kind, loom_group* out) {
  auto it = groups_.find(kind);
  if (it == groups_.end())
    return loom::make_status(LOOM_CODE_NOT_FOUND, "rank " + std::to_string(rank_) + " has no '" + kind +
                                                      "' group (see `loom groups` for the kinds)");
  *out = it->second;
  return nullptr;
}

loom_status RankRuntime::exec(const loom_exec_api** api, loom_exec** exec) {
  if (!exec_api_) return loom::make_status(LOOM_CODE_NOT_FOUND, "no execution mode is set for this rank");
  *api = exec_api_;
  *exec = exec_;
  return nullptr;
}

}  // namespace loom::runtime
