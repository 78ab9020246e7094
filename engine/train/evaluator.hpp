// Validation: the loss over run.eval_batches microbatches of the validation split
// per dp rank and, for data with one right answer per sample (the synthetic
// tasks), exact-match and token accuracy. Forward only, through the pipeline.
#pragma once

#include "engine/pipeline/executor.hpp"
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
};

class Evaluator {
 public:
  // `last_stage`: this rank holds the model's last layer (the loss and predictions).
  Evaluator(runtime::RankRuntime& rank, pipeline::Executor& executor, Microbatches& batches, const DataSource& data,
            int64_t batches_per_rank, int64_t micro_batch, bool last_stage);

  // Every rank of the world calls it; nullopt when `stop_requested` (asked between
  // batches, the same answer on every rank) ended it early.
  std::optional<Evaluation> run(const std::function<bool()>& stop_requested);

 private:
  runtime::RankRuntime& rank_;
  pipeline::Executor& executor_;
  Microbatches& batches_;
  const DataSource& data_;
  int64_t batches_per_rank_, micro_batch_;
  bool last_stage_;
  std::vector<int32_t> predictions_;
};

}  // namespace loom::train
