#include "engine/model/hidden_states.hpp"

#include "engine/model/tensor_view.hpp"

namespace loom::model {

HiddenStates::HiddenStates(runtime::RankRuntime& rank, std::vector<int64_t> shape, int32_t dtype, bool keep_buffers)
    : rank_(rank), shape_(std::move(shape)), dtype_(dtype), keep_buffers_(keep_buffers) {}

size_t HiddenStates::numel() const { return static_cast<size_t>(shape_[0] * shape_[1] * shape_[2]); }

size_t HiddenStates::bytes() const { return numel() * loom::dtype_size(dtype_); }

DLTensor HiddenStates::view(void* data) const { return device_view(rank_, data, shape_, dtype_); }

size_t HiddenStates::count(int c, int mb) const {
  auto it = held_.find({c, mb});
  return it == held_.end() ? 0 : it->second.size();
}

void* HiddenStates::push(int c, int mb) {
  const size_t k = take_slot();
  held_[{c, mb}].push_back(k);
  return pool_[k].buffer.get();
}

void* HiddenStates::at(int c, int mb, size_t position) const {
  return pool_[held_.at({c, mb})[position]].buffer.get();
}

void HiddenStates::drop(int c, int mb, size_t position) {
  size_t& k = held_.at({c, mb})[position];
  drop_slot(k);
  k = kDropped;
}

void* HiddenStates::refill(int c, int mb, size_t position) {
  size_t& k = held_.at({c, mb})[position];
  if (k == kDropped) k = take_slot();
  return pool_[k].buffer.get();
}

void HiddenStates::give_back(int c, int mb) {
  auto it = held_.find({c, mb});
  if (it == held_.end()) return;
  for (size_t k : it->second)
    if (k != kDropped) drop_slot(k);
  held_.erase(it);
}

void HiddenStates::clear() {
  held_.clear();
  pool_.clear();
}

size_t HiddenStates::take_slot() {
  size_t k = 0;
  while (k < pool_.size() && pool_[k].in_use) ++k;  // the lowest free slot
  if (k == pool_.size()) pool_.emplace_back();
  Slot& slot = pool_[k];
  if (!slot.buffer) slot.buffer = loom::Buffer(&rank_, bytes());
  slot.in_use = true;
  return k;
}

void HiddenStates::drop_slot(size_t k) {
  pool_[k].in_use = false;
  if (!keep_buffers_) pool_[k].buffer.reset();
}

}  // namespace loom::model
