#include "engine/model/dropout_seeds.hpp"

#include <algorithm>

namespace loom::model {

DropoutSeeds::DropoutSeeds(runtime::RankRuntime& rank, bool replays_steps)
    : rank_(rank), replays_steps_(replays_steps) {}

void DropoutSeeds::reserve(size_t microbatches) {
  if (microbatches <= host_.size()) return;
  // Graphs read the seeds at the addresses of their capture: a step with more
  // microbatches than the first would need new ones.
  LOOM_REQUIRE(host_.empty() || !replays_steps_,
               "a step with " << microbatches << " microbatches after steps with " << host_.size()
                              << ": the number of microbatches must not grow under exec.mode = partial_graph");
  device_ = loom::Buffer(&rank_, microbatches * sizeof(uint64_t));
  host_.assign(microbatches, 0);
  rank_.dev().copy(device_.get(), host_.data(), microbatches * sizeof(uint64_t), LOOM_COPY_HOST_TO_DEVICE);
}

void DropoutSeeds::stage(const std::vector<uint64_t>& seeds) {
  if (seeds.empty()) return;
  reserve(seeds.size());
  std::copy(seeds.begin(), seeds.end(), host_.begin());
  rank_.dev().copy(device_.get(), host_.data(), seeds.size() * sizeof(uint64_t), LOOM_COPY_HOST_TO_DEVICE);
}

std::vector<uint64_t> DropoutSeeds::staged() const {
  std::vector<uint64_t> out(host_.size());
  if (out.empty()) return out;
  rank_.dev().copy(out.data(), device_.get(), out.size() * sizeof(uint64_t), LOOM_COPY_DEVICE_TO_HOST);
  rank_.dev().synchronize();
  return out;
}

bool DropoutSeeds::has_slot(int mb) const { return mb >= 0 && static_cast<size_t>(mb) < host_.size(); }

const uint64_t* DropoutSeeds::slot(int mb, uint64_t value) {
  if (!has_slot(mb)) return nullptr;
  uint64_t* slot = device_.get<uint64_t>() + mb;
  uint64_t& held = host_[static_cast<size_t>(mb)];
  if (held != value) {
    held = value;
    rank_.dev().copy(slot, &held, sizeof(uint64_t), LOOM_COPY_HOST_TO_DEVICE);
  }
  return slot;
}

}  // namespace loom::model
