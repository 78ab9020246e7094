// A rank's runtime: its device instance and stream, its communicators by group
// kind, and its execution mode. This is what plugins reach through loom_rank.
#pragma once

#include "engine/runtime/comm_stats.hpp"
#include "engine/plugins/rank_context.hpp"

#include <loom/cpp/core.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace loom::runtime {

class RankRuntime : public loom_rank_s {
 public:
  RankRuntime(int global_rank, const loom_device_api* device_api, loom_device* device);
  ~RankRuntime() override;
  RankRuntime(const RankRuntime&) = delete;
  RankRuntime& operator=(const RankRuntime&) = delete;

  // The runtime takes ownership of the communicator (destroyed with the rank).
  // Plugins and the engine get the group behind a counting shim (comm_stats.hpp).
  void add_group(const std::string& kind, const loom_group& group);
  // Before the groups are added: their collectives get this rank's device memory as
  // host copies (DeviceStaging), for a comm plugin that takes host buffers only on a
  // device whose memory is its own. From then on the rank's allocations are tracked.
  void stage_device_buffers();
  // Where a buffer lies among this rank's allocations (with staging on; tests).
  DeviceStaging::Where where_for_tests(const void* p, size_t bytes) const { return where(p, bytes); }
  // Collectives called through this rank's groups since the last reset.
  CommStats comm_stats() const { return comm_stats_.snapshot(); }
  void reset_comm_stats() { comm_stats_.reset(); }
  void set_comm_observer(CommObserver observer) { comm_stats_.set_observer(std::move(observer)); }
  // ABI 1.1: the table host->service(rank, api_type, NULL) returns for this rank
  // (the launcher sets the run plan's; without one, plugins::find_service's default).
  void set_service(int32_t api_type, const void* table) { services_[api_type] = table; }
  void set_exec(const loom_exec_api* api, loom_exec* exec);  // owned
  // Stops every rank's communication at once because this one failed (the comm
  // plugin's world_abort, through the launcher). For code that holds started
  // requests whose completion may need this rank's own later work: called before
  // unwinding, their waits then fail instead of waiting out the timeout.
  void set_abort_world(std::function<void(const std::string& why)> abort) { abort_world_ = std::move(abort); }
  void abort_world(const std::string& why) const {
    if (abort_world_) abort_world_(why);
  }

  loom::Device dev() const { return loom::Device(device_api_, device_, nullptr); }
  // DLPack device type of this rank's memory (kDLCPU, kDLCUDA), for tensor views.
  int32_t dl_device_type() const { return device_api_->dl_device_type; }
  loom::Group group_or_self(const std::string& kind) const;
  bool has_group(const std::string& kind) const { return groups_.count(kind) > 0; }
  const loom_exec_api* exec_api() const { return exec_api_; }
  loom_exec* exec_handle() const { return exec_; }
  loom_memory_stats memory() const;

  // loom_rank_s
  int32_t global_rank() const override { return rank_; }
  loom_status alloc(size_t bytes, void** out) override;
  void free(void* ptr) override;
  loom_status device(const loom_device_api** api, loom_device** dev, loom_stream** stream) override;
  loom_status group(const std::string& kind, loom_group* out) override;
  loom_status exec(const loom_exec_api** api, loom_exec** exec) override;
  const void* service(int32_t api_type, const char* name) override;

 private:
  int rank_;
  const loom_device_api* device_api_;
  loom_device* device_;
  std::map<std::string, loom_group> groups_;
  const loom_exec_api* exec_api_ = nullptr;
  loom_exec* exec_ = nullptr;
  CommStatsRecorder comm_stats_;
  std::map<int32_t, const void*> services_;
  std::function<void(const std::string&)> abort_world_;
  // With stage_device_buffers: the rank's live allocations (start -> bytes), which
  // the staging asks whether a buffer is device memory.
  std::unique_ptr<DeviceStaging> staging_;
  mutable std::mutex allocations_mu_;
  std::map<uintptr_t, size_t> allocations_;
  DeviceStaging::Where where(const void* p, size_t bytes) const;
};

}  // namespace loom::runtime
