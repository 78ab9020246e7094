#include "engine/model/capture_policy.hpp"

#include <algorithm>

namespace loom::model {

CapturePolicy::CapturePolicy(runtime::RankRuntime& rank, const Layers& layers, int tp_size)
    : rank_(rank), layers_(layers), tp_single_(tp_size == 1) {
  const loom_exec_api* exec = rank_.exec_api();
  const uint64_t exec_features = exec != nullptr && LOOM_HAS_SLOT(exec, loom_exec_api, features) ? exec->features : 0;
  exec_substeps_ = (exec_features & LOOM_EXEC_SUBSTEPS) != 0;
  // Hidden states stay put across steps only when some step can be captured.
  const bool any_capturable = std::any_of(layers_.begin(), layers_.end(), [&](const Layer& l) {
    return l.capturable || (l.captures_parts && exec_substeps_);
  });
  replays_steps_ = (exec_features & LOOM_EXEC_REPLAYS) != 0 && tp_single_ && any_capturable;
}

int64_t CapturePolicy::step_key(size_t i, int mb, bool backward) const {
  return (static_cast<int64_t>(mb) * static_cast<int64_t>(layers_.size()) + static_cast<int64_t>(i)) * 2 +
         (backward ? 1 : 0);
}

// capture_ok: a training step (evaluation forwards keep nothing and run directly)
// whose dropout seed is in device memory.
bool CapturePolicy::may_capture(size_t i, bool capture_ok) const {
  return capture_ok && layers_[i].capturable && tp_single_ && replays_steps_;
}

bool CapturePolicy::may_capture_parts(size_t i, bool capture_ok) const {
  return capture_ok && layers_[i].captures_parts && exec_substeps_ && tp_single_ && replays_steps_;
}

void CapturePolicy::run_step(size_t i, int mb, bool backward, bool capture_ok,
                             const std::function<void()>& fn) const {
  const loom_exec_api* api = rank_.exec_api();
  if (api == nullptr) {
    fn();
    return;
  }
  struct Ctx {
    const std::function<void()>* fn;
  } ctx{&fn};
  loom_exec_step step = loom::make<loom_exec_step>();
  step.scope = layers_[i].spec.plugin.c_str();
  step.key = step_key(i, mb, backward);
  step.capturable = may_capture(i, capture_ok) ? 1 : 0;
  step.ctx = &ctx;
  step.fn = [](void* c) -> loom_status { return loom::guard([&] { (*static_cast<Ctx*>(c)->fn)(); }); };
  loom::check(api->run(rank_.exec_handle(), &rank_, &step));
}

}  // namespace loom::model
