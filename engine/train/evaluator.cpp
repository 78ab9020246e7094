#include "engine/train/evaluator.hpp"

#include "engine/runtime/launcher.hpp"
#include "engine/train/memory_plan.hpp"
#include "engine/train/trainer.hpp"

#include <algorithm>
#include <mutex>

namespace loom::train {

Evaluator::Evaluator(runtime::RankRuntime& rank, pipeline::Executor& executor, Microbatches& batches,
                     const DataSource& data, int64_t total_batches, int64_t micro_batch, bool last_stage)
    : rank_(rank),
      executor_(executor),
      batches_(batches),
      data_(data),
      total_batches_(total_batches),
      micro_batch_(micro_batch),
      last_stage_(last_stage),
      predictions_(static_cast<size_t>(batches.rows() * micro_batch)) {}

std::optional<Evaluation> Evaluator::run(const std::function<bool()>& stop_requested, bool per_sample) {
  const loom::Group dp = rank_.group_or_self("dp"), pp = rank_.group_or_self("pp"), cp = rank_.group_or_self("cp");
  const bool exact = data_.has_exact_match();
  const int64_t mbs = micro_batch_, rows = batches_.rows();
  LOOM_REQUIRE(!per_sample || mbs == 1, "per-sample losses need one sample per microbatch, not " << mbs);
  // Per sample (= batch) when asked: its loss sum and target tokens, each written by the
  // last stage's rank that ran it and summed over the others' zeros below.
  std::vector<double> each(per_sample ? static_cast<size_t>(2 * total_batches_) : 0, 0.0);
  double sums[5] = {0, 0, 0, 0, 0};  // loss sum, token count, exact-match samples, right tokens, samples with targets
  // Per batch: loss sum, token count, right tokens, then each sample's wrong tokens
  // (a sample matches exactly when none of its cp slices has one), then each
  // sample's target tokens.
  std::vector<double> batch(static_cast<size_t>(3 + 2 * mbs));
  // Batch g of the split goes to dp rank g mod dp, so the same batches are evaluated
  // at any dp. Every rank runs as many forwards (expert-parallel all-to-alls span dp
  // ranks): a rank's last one may lie past the total and is not counted.
  const int64_t per_rank = (total_batches_ + dp.size() - 1) / dp.size();
  for (int64_t b = 0; b < per_rank; ++b) {
    if (stop_requested()) return std::nullopt;  // a signal is honoured between batches
    const int64_t g = b * dp.size() + dp.rank();
    const uint64_t first = static_cast<uint64_t>(g * mbs);
    pipeline::MicrobatchInput in = batches_.load(Split::Validation, first, 0);
    in.predictions = exact ? predictions_.data() : nullptr;
    double loss_sum = 0;
    int64_t count = 0;
    executor_.forward_only(static_cast<int>(b), in, &loss_sum, &count);
    // The loss and predictions live on the last stage (on all its cp ranks).
    if (!last_stage_ || g >= total_batches_) continue;
    std::fill(batch.begin(), batch.end(), 0.0);
    batch[0] = loss_sum;
    batch[1] = static_cast<double>(count);
    const std::vector<int32_t>& targets = batches_.targets();
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t s = 0; s < mbs; ++s) {
        const size_t i = static_cast<size_t>(t * mbs + s);
        if (targets[i] < 0) continue;
        batch[static_cast<size_t>(3 + mbs + s)] += 1;
        if (!exact) continue;
        if (predictions_[i] != targets[i]) batch[static_cast<size_t>(3 + s)] += 1;
        else batch[2] += 1;
      }
    if (cp.size() > 1) cp.all_reduce(nullptr, batch.data(), batch.data(), batch.size(), LOOM_DTYPE_F64);
    if (per_sample) {
      each[static_cast<size_t>(2 * g)] = batch[0];
      each[static_cast<size_t>(2 * g + 1)] = batch[1];
    }
    sums[0] += batch[0];
    sums[1] += batch[1];
    sums[3] += batch[2];
    for (int64_t s = 0; s < mbs; ++s) {
      if (batch[static_cast<size_t>(3 + mbs + s)] == 0) continue;  // padding: nothing to predict
      sums[4] += 1;
      if (exact) sums[2] += batch[static_cast<size_t>(3 + s)] == 0 ? 1 : 0;
    }
  }
  pp.all_reduce(nullptr, sums, sums, 5, LOOM_DTYPE_F64);
  dp.all_reduce(nullptr, sums, sums, 5, LOOM_DTYPE_F64);
  Evaluation out;
  if (per_sample) {
    pp.all_reduce(nullptr, each.data(), each.data(), each.size(), LOOM_DTYPE_F64);
    dp.all_reduce(nullptr, each.data(), each.data(), each.size(), LOOM_DTYPE_F64);
    for (int64_t i = 0; i < total_batches_; ++i) {
      out.sample_loss_sums.push_back(each[static_cast<size_t>(2 * i)]);
      out.sample_tokens.push_back(static_cast<int64_t>(each[static_cast<size_t>(2 * i + 1)]));
    }
  }
  out.loss = sums[1] > 0 ? sums[0] / sums[1] : 0;
  out.loss_sum = sums[0];
  out.tokens = static_cast<int64_t>(sums[1]);
  out.samples = static_cast<int64_t>(sums[4]);
  if (exact) {
    out.exact_match = sums[4] > 0 ? sums[2] / sums[4] : 0;
    out.token_accuracy = sums[1] > 0 ? sums[3] / sums[1] : -1;
  }
  return out;
}

}  // namespace loom::train

namespace loom::train {

Evaluation evaluate(const RunPlan& plan, const InitialWeights& weights, int64_t vocab, const DataSource& data,
                    int64_t samples, bool per_sample) {
  check_initial_weights(weights, plan_memory(plan, vocab), vocab,
                        model::model_dims(plan.config, vocab, plan.sizes.tp).padded_vocab);
  const int64_t mbs = plan.config.batch.micro_batch_size;
  const int64_t total_batches = std::max<int64_t>(1, (samples + mbs - 1) / mbs);
  Evaluation result;
  std::mutex mu;
  const DocumentInputs documents = document_inputs(plan.config, vocab);  // once, not per rank
  const runtime::LaunchConfig lc = launch_config(plan);
  runtime::launch(lc, [&](runtime::RankRuntime& rt) {
    std::unique_ptr<model::Model> model = create_rank_model(plan, rt, vocab, &weights);
    const loom::Group pp = rt.group_or_self("pp");
    pipeline::Executor executor(*model, rt, plan.orders.order[static_cast<size_t>(pp.rank())],
                                static_cast<int>(plan.microbatches));
    Microbatches batches(rt, data, plan.config.model.seq_length, mbs, 1, documents);
    const bool last_stage = model->is_last_global(static_cast<int>(model->chunk_count()) - 1);
    Evaluator evaluator(rt, executor, batches, data, total_batches, mbs, last_stage);
    const std::optional<Evaluation> e = evaluator.run([] { return false; }, per_sample);
    if (rt.global_rank() == 0 && e) {
      std::lock_guard<std::mutex> lock(mu);
      result = *e;
    }
  });
  return result;
}

}  // namespace loom::train
