// The training loop of every rank: microbatches through the model, gradient
// sync and update through the optimizer strategy, LR schedule, evaluation,
// metrics and checkpoints.
#pragma once

#include "engine/model/model.hpp"
#include "engine/train/run_plan.hpp"

#include <atomic>
#include <functional>
#include <iosfwd>
#include <map>
#include <string>
#include <vector>

namespace loom::train {

struct StepRecord {
  int64_t step = 0;       // 1-based: the step just completed
  double loss = 0;        // mean over the global batch
  double aux_loss = 0;    // the layers' weighted auxiliary losses (MoE load balancing), same mean; 0 = none
  double lr = 0;
  double grad_norm = 0;
  double ms = 0;
  double tokens_per_s = 0;
  double flops_per_s = 0;
  double mfu = 0;         // 0 when the peak is unknown
  uint64_t mem_current = 0, mem_peak = 0;  // rank 0's device memory
  int in_flight = 0;            // rank 0's most microbatch-chunks awaiting backward at once
  uint64_t activation_bytes = 0;  // rank 0's device memory held by them at the peak
  runtime::CommStats comm;      // rank 0's collectives and p2p of the step (evaluation excluded)
  bool evaluated = false;
  double val_loss = 0;
  double exact_match = -1;  // fraction of validation samples fully right; -1 when not applicable
  double token_accuracy = -1;  // fraction of validation target tokens predicted (argmax); -1 when not computed
};

struct TrainOptions {
  bool resume = false;
  std::string metrics_file;                  // JSON lines, one per step
  std::ostream* log = nullptr;               // progress lines (rank 0); null = quiet
  const std::atomic<int>* stop_signal = nullptr;  // set by SIGINT/SIGTERM handlers
  std::string trace_file;                    // Chrome trace of every rank's real timeline
  // Called on every rank after each step (tests compare parameters step by step).
  std::function<void(int64_t step, int rank, const model::Model&)> on_step;
};

struct TrainResult {
  std::vector<StepRecord> steps;   // this invocation's steps
  int64_t start_step = 0;          // > 0 when resumed
  int64_t final_step = 0;
  bool interrupted = false;        // stopped by a signal (after checkpointing)
  std::string checkpoint;          // the last checkpoint written, if any
  // Per global rank hosted here: the most (chunk, microbatch) forwards awaiting
  // their backward at once, over all steps, and the activation bytes at that peak.
  std::map<int, int> peak_in_flight;
  std::map<int, uint64_t> peak_activation_bytes;
  // Per global rank: what the execution mode did (graphs captured, steps replayed,
  // steps run directly), when its plugin reports it (ABI 1.3 loom_exec_api.stats).
  std::map<int, loom_exec_stats> exec_stats;
};

// The LR at (1-based) step: linear warmup, then cosine decay to min_lr.
double learning_rate(const manifest::Manifest& m, int64_t step);

TrainResult train(const RunPlan& plan, const TrainOptions& options);

}  // namespace loom::train
