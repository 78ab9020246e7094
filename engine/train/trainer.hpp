// Training: every rank of the plan launched, each building its part of the model
// and its optimizer strategy (optimizer_binding.hpp), restoring a checkpoint when
// resuming (rank_checkpoint.hpp), then stepping: microbatches through the pipeline,
// the optimizer step, evaluation (evaluator.hpp), metrics (metrics.hpp) and
// checkpoints, until run.steps or a stop signal.
#pragma once

#include "engine/model/model.hpp"
#include "engine/train/metrics.hpp"
#include "engine/train/init_weights.hpp"
#include "engine/train/run_plan.hpp"

#include <atomic>
#include <functional>
#include <memory>
#include <iosfwd>
#include <map>
#include <string>
#include <vector>

namespace loom::train {

struct TrainOptions {
  bool resume = false;
  // With resume: a checkpoint.dir that holds no checkpoint yet starts the run (one
  // command line for every job of a chain; `loom run --resume-if-any`).
  bool start_without_checkpoint = false;
  std::string metrics_file;                  // JSON lines, one per step
  std::string tensorboard_dir;               // TensorBoard event files ("" = none)
  std::ostream* log = nullptr;               // progress lines (rank 0); null = quiet
  const std::atomic<int>* stop_signal = nullptr;  // set by SIGINT/SIGTERM handlers
  std::atomic<bool>* stepped = nullptr;            // set once a step has finished here (before: nothing new to save)
  std::string trace_file;                    // Chrome trace of every rank's real timeline
  bool keep_trace = false;                   // the same events in TrainResult::trace (loom plan --perf)
  // Called on every rank after each step (tests compare parameters step by step).
  std::function<void(int64_t step, int rank, const model::Model&)> on_step;
  // checkpoint.init_weights: reads the weights a run that does not resume starts from,
  // given the run's vocabulary (the CLI reads loom checkpoints and Hugging Face
  // directories, engine/interop). Called once, before any rank starts.
  std::function<InitialWeights(int64_t vocab)> read_init_weights;
  // Saves the starting point (the initial or given weights, a fresh optimizer state) as
  // the checkpoint of step 0 into checkpoint.dir and trains no step (`loom import`).
  bool save_start_only = false;
  // Called on each rank's writing thread before it writes a checkpoint's files (tests
  // hold a write back to see training go on beside it).
  std::function<void(int64_t step, int rank)> before_checkpoint_write;
};

struct TrainResult {
  std::vector<StepRecord> steps;   // this invocation's steps
  int64_t start_step = 0;          // > 0 when resumed
  int64_t final_step = 0;
  int64_t end_step = 0;            // the step the run ends at (run.steps; a resumed run.train_samples run's own)
  bool interrupted = false;        // stopped by a signal (after checkpointing)
  // Non-empty: stopped as run.exit_duration_minutes or run.exit_interval asks (after
  // checkpointing), saying which.
  std::string exit_reason;
  std::string checkpoint;          // the last checkpoint written, if any
  // Per global rank hosted here: the most (chunk, microbatch) forwards awaiting
  // their backward at once, over all steps, and the activation bytes at that peak.
  std::map<int, int> peak_in_flight;
  std::map<int, uint64_t> peak_activation_bytes;
  // Per global rank: what the execution mode did (graphs captured, steps replayed,
  // steps run directly), when its plugin reports it (ABI 1.3 loom_exec_api.stats).
  std::map<int, loom_exec_stats> exec_stats;
  // With TrainOptions::keep_trace: every rank's timeline, as --trace writes it.
  std::vector<pipeline::TraceEvent> trace;
};

TrainResult train(const RunPlan& plan, const TrainOptions& options);

// A rank's part of the model as a run creates it: the plan's exec plugin set on the
// rank, the layers of its pipeline chunks, the parameters from `weights` when given
// (else the seeded random initialisation).
std::unique_ptr<model::Model> create_rank_model(const RunPlan& plan, runtime::RankRuntime& rt, int64_t vocab,
                                                const InitialWeights* weights);

}  // namespace loom::train
