// Validation: the loss over the first run.eval_batches microbatches of the
// validation split, shared among the dp ranks (the same samples at any layout)
// and, for data with one right answer per sample (the synthetic tasks),
// exact-match and token accuracy. Forward only, through the pipeline.
#pragma once

#include "engine/pipeline/executor.hpp"
#include "engine/train/init_weights.hpp"
#include "engine/train/run_plan.hpp"
#include "engine/train/microbatches.hpp"

#include <loom/cpp/core.hpp>

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

namespace loom::train {

struct Evaluation {
  double loss = 0;
  double exact_match = -1;     // fraction of samples fully right; -1 when the data has no single answer
  double token_accuracy = -1;  // fraction of target tokens predicted (argmax); -1 likewise
  double loss_sum = 0;         // the summed loss of every target token
  int64_t tokens = 0;          // target tokens (loss = loss_sum / tokens)
  int64_t samples = 0;         // samples with at least one target (what exact_match divides by)
  // With one sample per microbatch, when asked: each sample's summed loss and target
  // tokens, by sample index (multiple choice compares candidates by them).
  std::vector<double> sample_loss_sums;
  std::vector<int64_t> sample_tokens;
};

class Evaluator {
 public:
  // `last_stage`: this rank holds the model's last layer (the loss and predictions).
  Evaluator(runtime::RankRuntime& rank, pipeline::Executor& executor, Microbatches& batches, const DataSource& data,
            int64_t total_batches, int64_t micro_batch, bool last_stage);

  // Every rank of the world calls it; nullopt when `stop_requested` (asked between
  // batches, the same answer on every rank) ended it early. `per_sample` (one sample
  // per microbatch) fills Evaluation::sample_loss_sums and sample_tokens.
  std::optional<Evaluation> run(const std::function<bool()>& stop_requested, bool per_sample = false);

 private:
  runtime::RankRuntime& rank_;
  pipeline::Executor& executor_;
  Microbatches& batches_;
  const DataSource& data_;
  int64_t total_batches_, micro_batch_;
  bool last_stage_;
  std::vector<int32_t> predictions_;
};

// Forward-only evaluation of the model `weights` hold over validation samples
// [0, samples) of `data` (a source whose later samples may have no targets: padding),
// on every rank of `plan` (any layout; run.eval_batches is not read): the loss summed
// over target tokens and, when the data has single answers, exact matches.
Evaluation evaluate(const RunPlan& plan, const InitialWeights& weights, int64_t vocab, const DataSource& data,
                    int64_t samples, bool per_sample = false);

}  // namespace loom::train
