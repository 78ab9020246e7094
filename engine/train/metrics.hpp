// What each step reports: the record rank 0 keeps, the progress line it prints
// every run.log_every steps (averaged over the steps since the last line) and the
// JSON line per step of the metrics file.
#pragma once

#include "engine/runtime/comm_stats.hpp"
#include "engine/train/tensorboard.hpp"

#include <sys/types.h>

#include <cstdint>
#include <fstream>
#include <iosfwd>
#include <optional>
#include <string>

namespace loom::train {

struct StepRecord {
  int64_t step = 0;       // 1-based: the step just completed
  double loss = 0;        // mean over the global batch
  double aux_loss = 0;    // the layers' weighted auxiliary losses (MoE load balancing), same mean; 0 = none
  // The step's rates as the optimizer plugin took them (single precision; float-typed so
  // the value cannot hold more than was applied). weight_decay follows
  // optimizer.weight_decay_incr_style.
  float lr = 0;
  float weight_decay = 0;
  double grad_norm = 0;
  double ms = 0;
  int64_t global_batch = 0;  // the step's global batch (sequences; batch.rampup_batch_size ramps it)
  uint64_t consumed_samples = 0;  // training samples consumed through the step (Megatron-LM's consumed_train_samples)
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

// One line of the metrics file: compact JSON (inf and nan, which JSON cannot spell, as null).
std::string step_json(const StepRecord& r);

class MetricsSink {
 public:
  // Per training sample (a step's global batch of them: StepRecord::samples).
  struct Rates {
    double tokens_per_sample = 0, flops_per_sample = 0;  // over the whole world
    double peak_tflops = 0;                          // per rank; 0 = unknown (no MFU)
    int world = 1;
    int64_t global_batch = 0;  // batch.global_batch_size: a smaller step's (a ramp's) is shown
  };
  // `metrics_file` "" = none; appended to when resuming from step `resumed_step` (-1: a
  // new run, the file started anew), after dropping the lines of later steps. `log`
  // null = quiet. Throws std::runtime_error when the file cannot be written.
  MetricsSink(const std::string& metrics_file, int64_t resumed_step, std::ostream* log, int64_t steps,
              int64_t log_every);
  // What a step computes, known once the model is built.
  void set_rates(const Rates& rates) { rates_ = rates; }
  // Also writes each step's scalars to a new TensorBoard event file in `dir` (Megatron-LM's
  // --tensorboard-dir tags where it has them), whose first step is `first_step` (a
  // resumed run's steps after its checkpoint replace what an earlier launch wrote of
  // them). Throws std::runtime_error when the directory cannot be made.
  void write_tensorboard(const std::string& dir, int64_t first_step);

  // Fills the record's rates from its ms.
  void complete(StepRecord& r) const;
  // Rank 0, after each step: the progress line when due (every log_every steps, the
  // last step, an evaluation, a stop) and the metrics line. A failed write (a full
  // disk) cuts the file back to its whole lines and throws std::runtime_error.
  void write(const StepRecord& r, bool stopping);
  // Rank 0, on resuming: the evaluation of step r.step (its val_* fields) that a stop
  // signal cut short, the progress line and a metrics line of the step and those fields.
  void write_evaluation(const StepRecord& r);

 private:
  void append(const std::string& line, int64_t step);
  void tensorboard_evaluation(const StepRecord& r, Scalars& values) const;
  void tensorboard_write(int64_t step, const Scalars& values);

  std::string file_;
  std::ofstream out_;
  off_t whole_bytes_ = -1;  // the file's bytes of whole lines (-1: not a regular file)
  std::ostream* log_;
  int64_t steps_, log_every_;
  Rates rates_;
  double window_ms_ = 0;
  double window_samples_ = 0;  // the window's training samples (their tokens and FLOPs per second)
  int64_t window_steps_ = 0;
  std::optional<TensorBoardWriter> tensorboard_;
};

}  // namespace loom::train
