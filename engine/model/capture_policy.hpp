// How layer steps run through the rank's exec plugin (exec.mode): the key that
// names a step alike every step, and whether a step, or the sub-steps of a layer
// that captures parts of itself, may be captured in a graph and replayed.
#pragma once

#include "engine/model/layers.hpp"
#include "engine/runtime/rank_runtime.hpp"

#include <cstdint>
#include <functional>

namespace loom::model {

class CapturePolicy {
 public:
  // tp_size: a layer step with a tp collective inside is never captured (comm
  // plugins do not promise capture).
  CapturePolicy(runtime::RankRuntime& rank, const Layers& layers, int tp_size);
  CapturePolicy(const CapturePolicy&) = delete;
  CapturePolicy& operator=(const CapturePolicy&) = delete;

  // Whether layer steps may be replayed from graphs (the exec mode replays and some
  // layer is capturable): then hidden states and seeds keep their addresses.
  bool replays_steps() const { return replays_steps_; }
  // The exec key of layer i's forward or backward of microbatch mb: the same for
  // the same layer, microbatch and direction every step (graphs are found by it).
  int64_t step_key(size_t i, int mb, bool backward) const;
  // Whether layer i's step, or (captures_parts) parts of it, may be captured now.
  // capture_ok: a training step whose dropout seed is in device memory.
  bool may_capture(size_t i, bool capture_ok) const;
  bool may_capture_parts(size_t i, bool capture_ok) const;
  // Runs `fn`, layer i's step, through the exec plugin (directly without one),
  // captured or replayed when it may be.
  void run_step(size_t i, int mb, bool backward, bool capture_ok, const std::function<void()>& fn) const;

 private:
  runtime::RankRuntime& rank_;
  const Layers& layers_;
  bool tp_single_ = true;       // no collective inside a layer step (capture needs that)
  bool exec_substeps_ = false;  // the exec mode keys graphs by sub-step too (LOOM_EXEC_SUBSTEPS)
  bool replays_steps_ = false;
};

}  // namespace loom::model
