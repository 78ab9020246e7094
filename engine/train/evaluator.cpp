#include "engine/train/evaluator.hpp"

#include <algorithm>

namespace loom::train {

Evaluator::Evaluator(runtime::RankRuntime& rank, pipeline::Executor& executor, Microbatches& batches,
                     const DataSource& data, int64_t batches_per_rank, int64_t micro_batch, bool last_stage)
    : rank_(rank),
      executor_(executor),
      batches_(batches),
      data_(data),
      batches_per_rank_(batches_per_rank),
      micro_batch_(micro_batch),
      last_stage_(last_stage),
      predictions_(static_cast<size_t>(batches.rows() * micro_batch)) {}

std::optional<Evaluation> Evaluator::run(const std::function<bool()>& stop_requested) {
  const loom::Group dp = rank_.group_or_self("dp"), pp = rank_.group_or_self("pp"), cp = rank_.group_or_self("cp");
  const bool exact = data_.has_exact_match();
  const int64_t mbs = micro_batch_, rows = batches_.rows();
  double sums[4] = {0, 0, 0, 0};  // loss sum, token count, exact-match samples, right tokens
  // Per batch: loss sum, token count, right tokens, then each sample's wrong
  // tokens (a sample matches exactly when none of its cp slices has one).
  std::vector<double> batch(static_cast<size_t>(3 + mbs));
  for (int64_t b = 0; b < batches_per_rank_; ++b) {
    if (stop_requested()) return std::nullopt;  // a signal is honoured between batches
    const uint64_t first = static_cast<uint64_t>((b * dp.size() + dp.rank()) * mbs);
    pipeline::MicrobatchInput in = batches_.load(Split::Validation, first, 0);
    in.predictions = exact ? predictions_.data() : nullptr;
    double loss_sum = 0;
    int64_t count = 0;
    executor_.forward_only(static_cast<int>(b), in, &loss_sum, &count);
    if (!last_stage_) continue;  // the loss and predictions live on the last stage (on all its cp ranks)
    std::fill(batch.begin(), batch.end(), 0.0);
    batch[0] = loss_sum;
    batch[1] = static_cast<double>(count);
    const std::vector<int32_t>& targets = batches_.targets();
    if (exact)
      for (int64_t t = 0; t < rows; ++t)
        for (int64_t s = 0; s < mbs; ++s) {
          const size_t i = static_cast<size_t>(t * mbs + s);
          if (targets[i] < 0) continue;
          if (predictions_[i] != targets[i]) batch[static_cast<size_t>(3 + s)] += 1;
          else batch[2] += 1;
        }
    if (cp.size() > 1) cp.all_reduce(nullptr, batch.data(), batch.data(), batch.size(), LOOM_DTYPE_F64);
    sums[0] += batch[0];
    sums[1] += batch[1];
    sums[3] += batch[2];
    if (exact)
      for (int64_t s = 0; s < mbs; ++s) sums[2] += batch[static_cast<size_t>(3 + s)] == 0 ? 1 : 0;
  }
  pp.all_reduce(nullptr, sums, sums, 4, LOOM_DTYPE_F64);
  dp.all_reduce(nullptr, sums, sums, 4, LOOM_DTYPE_F64);
  Evaluation out;
  out.loss = sums[1] > 0 ? sums[0] / sums[1] : 0;
  if (exact) {
    out.exact_match = sums[2] / static_cast<double>(batches_per_rank_ * mbs * dp.size());
    out.token_accuracy = sums[1] > 0 ? sums[3] / sums[1] : -1;
  }
  return out;
}

}  // namespace loom::train
