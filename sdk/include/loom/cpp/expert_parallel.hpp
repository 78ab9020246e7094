// loom C++ layer: the expert-parallel dispatch service (ABI 1.4, plugins
// parallel/expert and parallel/expert.allgather) as a MoE layer uses it. One
// ExpertParallel per layer instance, opened when the ep group has more than one
// rank:
//
//   ep_ = loom::ExpertParallel(rank.raw(), rank.group("ep").raw(), num_experts, name);
//   std::vector<int64_t> local = ep_.plan(stream, mb, expert_rows);  // collective
//   ep_.dispatch(stream, mb, rows, at_experts, hidden, dtype);        // [N, w] -> [R, w]
//   ...                                                                // the local experts
//   ep_.combine(stream, mb, outputs, rows_back, hidden, dtype);        // [R, w] -> [N, w]
//   ep_.release(mb);
//
// The argument structs are the C ones of loom_ep.h; every failure throws
// loom::Error. See loom_expert_parallel_api for the row orders.
#pragma once

#include <loom/cpp/core.hpp>
#include <loom/loom_ep.h>

#include <string>
#include <utility>
#include <vector>

namespace loom {

class ExpertParallel {
 public:
  ExpertParallel() = default;
  // Opens a handle on the service the run configured (manifest parallel.expert).
  ExpertParallel(loom_rank* rank, const loom_group& ep, int64_t num_experts, const std::string& instance) {
    const loom_host_api& h = host();
    if (!LOOM_HAS_SLOT(&h, loom_host_api, service) || h.service == nullptr)
      throw Error("the host table has no service slot (loom_host_api.service)", LOOM_CODE_UNSUPPORTED);
    api_ = static_cast<const loom_expert_parallel_api*>(h.service(rank, LOOM_API_EXPERT_PARALLEL, nullptr));
    if (api_ == nullptr)
      throw Error("no expert-parallel service is loaded (plugin parallel/expert, manifest key parallel.expert)",
                  LOOM_CODE_NOT_FOUND);
    if (!LOOM_HAS_SLOT(api_, loom_expert_parallel_api, release) || !api_->create || !api_->destroy || !api_->plan ||
        !api_->dispatch || !api_->combine || !api_->release)
      throw Error("the expert-parallel service's table is incomplete (every slot of loom_expert_parallel_api is "
                  "required)",
                  LOOM_CODE_UNSUPPORTED);
    loom_ep_create_args a = make<loom_ep_create_args>();
    a.ep = ep;
    a.num_experts = num_experts;
    a.instance_name = instance.c_str();
    check(api_->create(rank, &a, &handle_));
    local_experts_ = num_experts / (ep.size > 0 ? ep.size : 1);
  }
  ~ExpertParallel() { reset(); }
  ExpertParallel(const ExpertParallel&) = delete;
  ExpertParallel& operator=(const ExpertParallel&) = delete;
  ExpertParallel(ExpertParallel&& o) noexcept { *this = std::move(o); }
  ExpertParallel& operator=(ExpertParallel&& o) noexcept {
    if (this != &o) {
      reset();
      std::swap(api_, o.api_);
      std::swap(handle_, o.handle_);
      local_experts_ = o.local_experts_;
    }
    return *this;
  }
  void reset() {
    if (api_ && handle_) api_->destroy(handle_);
    handle_ = nullptr;
  }
  bool open() const { return handle_ != nullptr; }

  // The first row of each local expert among the rows dispatched here ([E/ep + 1],
  // the last = R), from this rank's expert_rows [E + 1]. Collective.
  std::vector<int64_t> plan(void* stream, int32_t slot, const std::vector<int64_t>& expert_rows) const {
    std::vector<int64_t> local(static_cast<size_t>(local_experts_ + 1), 0);
    loom_ep_plan_args a = make<loom_ep_plan_args>();
    a.stream = stream;
    a.slot = slot;
    a.expert_rows = expert_rows.data();
    a.local_rows = local.data();
    check(api_->plan(handle_, &a));
    return local;
  }
  void dispatch(void* stream, int32_t slot, const void* x, void* out, int64_t width, int32_t dtype) const {
    const loom_ep_move_args a = move_args(stream, slot, x, out, width, dtype);
    check(api_->dispatch(handle_, &a));
  }
  void combine(void* stream, int32_t slot, const void* x, void* out, int64_t width, int32_t dtype) const {
    const loom_ep_move_args a = move_args(stream, slot, x, out, width, dtype);
    check(api_->combine(handle_, &a));
  }
  void release(int32_t slot) const {
    if (api_ && handle_) api_->release(handle_, slot);
  }

 private:
  static loom_ep_move_args move_args(void* stream, int32_t slot, const void* x, void* out, int64_t width,
                                     int32_t dtype) {
    loom_ep_move_args a = make<loom_ep_move_args>();
    a.stream = stream;
    a.slot = slot;
    a.x = x;
    a.out = out;
    a.width = width;
    a.dtype = dtype;
    return a;
  }

  const loom_expert_parallel_api* api_ = nullptr;
  loom_ep* handle_ = nullptr;
  int64_t local_experts_ = 0;
};

}  // namespace loom
