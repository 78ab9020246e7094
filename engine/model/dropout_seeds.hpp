// The step's dropout seed of every microbatch in device memory, one uint64 per
// microbatch at a fixed address: layers read them there (ABI 1.3
// dropout_seed_device), so dropouts captured in a graph draw new masks every step.
#pragma once

#include "engine/runtime/rank_runtime.hpp"

#include <loom/cpp/core.hpp>

#include <cstdint>
#include <vector>

namespace loom::model {

class DropoutSeeds {
 public:
  // replays_steps: graphs read the seeds at the addresses of their capture, so
  // the buffer must never move (see stage).
  DropoutSeeds(runtime::RankRuntime& rank, bool replays_steps);
  DropoutSeeds(const DropoutSeeds&) = delete;
  DropoutSeeds& operator=(const DropoutSeeds&) = delete;

  // Makes room for `microbatches` seeds before any step: a run whose steps have
  // different counts (batch.rampup_batch_size) reserves the most, so the buffer
  // never moves under captured graphs.
  void reserve(size_t microbatches);
  // Copies the step's seeds (index = microbatch) to device memory in one go.
  void stage(const std::vector<uint64_t>& seeds);
  // What the device buffer holds now (read back; for tests and diagnostics).
  std::vector<uint64_t> staged() const;
  // Whether microbatch mb has a slot (a seed was staged for it).
  bool has_slot(int mb) const;
  // The device memory of microbatch mb's seed, set to `value` (written when it
  // differs from what is there), or nullptr when mb has no slot.
  const uint64_t* slot(int mb, uint64_t value);

 private:
  runtime::RankRuntime& rank_;
  bool replays_steps_;
  loom::Buffer device_;         // one uint64 per microbatch
  std::vector<uint64_t> host_;  // what device_ holds
};

}  // namespace loom::model
