#include "engine/train/microbatches.hpp"

#include <algorithm>

namespace loom::train {

Microbatches::Microbatches(runtime::RankRuntime& rank, const DataSource& data, int64_t seq, int64_t micro_batch,
                           int64_t slots)
    : rank_(rank),
      data_(data),
      seq_(seq),
      micro_batch_(micro_batch),
      context_(seq, rank.group_or_self("cp").size(), rank.group_or_self("cp").rank()),
      tokens_(static_cast<size_t>(seq * micro_batch)),
      targets_(tokens_.size()),
      tokens_local_(static_cast<size_t>(context_.local_length() * micro_batch)),
      targets_local_(tokens_local_.size()) {
  const size_t bytes = tokens_local_.size() * sizeof(int32_t);
  for (int64_t s = 0; s < slots; ++s) {
    tokens_dev_.emplace_back(&rank_, bytes);
    targets_dev_.emplace_back(&rank_, bytes);
  }
}

pipeline::MicrobatchInput Microbatches::load(Split split, uint64_t first_sample, int64_t slot) {
  fill_microbatch(data_, split, first_sample, micro_batch_, seq_, tokens_.data(), targets_.data());
  for (const loom::ContextSlice::Run& run : context_.runs()) {
    const size_t n = static_cast<size_t>(run.length * micro_batch_);
    std::copy_n(tokens_.begin() + run.position * micro_batch_, n, tokens_local_.begin() + run.local * micro_batch_);
    std::copy_n(targets_.begin() + run.position * micro_batch_, n, targets_local_.begin() + run.local * micro_batch_);
  }
  const size_t bytes = tokens_local_.size() * sizeof(int32_t);
  loom::Buffer& tokens = tokens_dev_[static_cast<size_t>(slot)];
  loom::Buffer& targets = targets_dev_[static_cast<size_t>(slot)];
  const loom::Device dev = rank_.dev();
  dev.copy(tokens.get(), tokens_local_.data(), bytes, LOOM_COPY_HOST_TO_DEVICE);
  dev.copy(targets.get(), targets_local_.data(), bytes, LOOM_COPY_HOST_TO_DEVICE);
  pipeline::MicrobatchInput in;
  in.tokens = tokens.get<int32_t>();
  in.targets = targets.get<int32_t>();
  return in;
}

}  // namespace loom::train
