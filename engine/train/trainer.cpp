#include "engine/train/trainer.hpp"

#include "engine/files/temporaries.hpp"
#include "engine/manifest/batches.hpp"
#include "engine/model/param_init.hpp"
#include "engine/pipeline/executor.hpp"
#include "engine/pipeline/partition.hpp"
#include "engine/pipeline/schedule.hpp"
#include "engine/runtime/launcher.hpp"
#include "engine/train/batch_ramp.hpp"
#include "engine/train/checkpoint.hpp"
#include "engine/train/evaluator.hpp"
#include "engine/train/generation.hpp"
#include "engine/train/microbatches.hpp"
#include "engine/train/optimizer_binding.hpp"
#include "engine/train/preflight.hpp"
#include "engine/train/rank_checkpoint.hpp"

#include <chrono>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <sstream>
#include <stdexcept>

namespace loom::train {

namespace {

uint64_t dropout_seed(uint64_t seed, int64_t step, uint64_t sample) {
  uint64_t parts[3] = {seed, static_cast<uint64_t>(step), sample};
  return model::fnv1a(parts, sizeof(parts));
}

// What the ranks of one train() call share: the plan, where they start, and what
// they report (under `mu`).
struct Run {
  const RunPlan& plan;
  const TrainOptions& options;
  const DataSource& data;
  int64_t vocab = 0;
  int64_t start_step = 0;
  uint64_t start_samples = 0;  // the training samples consumed before start_step
  std::optional<ResumePoint> resume;
  std::string manifest_toml;
  MetricsSink& metrics;  // rank 0's
  std::chrono::steady_clock::time_point trace_origin;
  std::mutex mu;
  TrainResult result;
  std::vector<pipeline::TraceEvent> trace_events;
  std::shared_ptr<const InitialWeights> init_weights;  // checkpoint.init_weights, read once for every rank
  std::shared_ptr<const InitialWeights> regathered;    // a resume at another layout: tensors and their state
  std::unique_ptr<CheckpointPruner> pruner;            // checkpoint.keep_last, used by rank 0
  DocumentInputs documents;  // data.reset_*: worked out once (the tokenizer's end token) for every rank
  // When train() was called: run.exit_duration_minutes counts from it.
  std::chrono::steady_clock::time_point started;

  double minutes_trained() const {
    return std::chrono::duration<double, std::ratio<60>>(std::chrono::steady_clock::now() - started).count();
  }

  BatchRamp ramp;  // each step's global batch (batch.rampup_batch_size)
  int64_t steps = 0;  // the step the run ends at: run.steps, or a resume's (ResumePoint::steps)

  uint64_t samples_before(int64_t step) const { return ramp.samples_before(step, start_step, start_samples); }
};

// The "a non-finite loss stops the run" error, as Megatron-LM's check for NaN in
// the loss and gradients does.
[[noreturn]] void throw_not_finite(const Run& run, const StepRecord& rec, const std::string& also = "") {
  const manifest::RunConfig& config = run.plan.config;
  std::ostringstream os;
  os << "step " << rec.step << ": the loss is " << rec.loss << " and the gradient norm " << rec.grad_norm
     << "; training stops without saving this step's weights"
     << (!config.checkpoint.dir.empty() ? " (the last checkpoint in " + config.checkpoint.dir + " holds finite ones)"
                                        : std::string())
     << ". Usual causes: a learning rate too high (optimizer.lr = " << config.optimizer.lr
     << "), no gradient clipping (optimizer.clip_grad), or data the model cannot represent" << also;
  throw loom::Error(os.str());
}

// One rank's training: its chunks of the model, its optimizer strategy, its
// microbatches, then the step loop.
class RankTraining {
 public:
  RankTraining(Run& run, runtime::RankRuntime& rt)
      : run_(run),
        config_(run.plan.config),
        schedule_(manifest::schedule_marks(run.plan.config.optimizer, run.plan.config.batch, run.steps,
                                           run.plan.config.run.train_samples)),
        rt_(rt),
        rank_(rt.global_rank()),
        leader_(rank_ == 0),
        world_(rt.group_or_self("world")),
        dp_(rt.group_or_self("dp")),
        pp_(rt.group_or_self("pp")),
        model_(create_model(run, rt)),
        optimizer_(run.plan, rt, *model_),
        batches_(rt, run.data, config_.model.seq_length, config_.batch.micro_batch_size, run.plan.microbatches,
                 run.documents),
        saver_(run.plan, rt, run.manifest_toml, [this](const CheckpointSaver::Committed& c) { committed(c); },
               run.options.before_checkpoint_write) {
    if (run_.resume)
      restore_checkpoint(run_.plan, *run_.resume, rt_, *model_, optimizer_, run_.manifest_toml, run_.regathered.get());
    // overlap_grad_reduce: gradients final during the backward go to the strategy
    // at once, so it can start their reduction while the backward goes on.
    if (config_.optimizer.overlap_grad_reduce)
      model_->set_grads_ready_listener([this](const std::vector<size_t>& params) { optimizer_.grads_ready(params); });
    // overlap_param_gather: each layer's first forward of a step waits for its
    // parameters' all-gather only (anything else reading them waits for all first).
    if (config_.optimizer.overlap_param_gather)
      model_->set_params_needed_listener([this](const std::vector<size_t>& params) { optimizer_.params_needed(params); });
    // The steps of a ramp have fewer microbatches than the last: room for the most.
    model_->reserve_dropout_seeds(static_cast<size_t>(run_.plan.microbatches));
    if (!run_.options.trace_file.empty() || run_.options.keep_trace) start_trace();
    executor_.emplace(*model_, rt_, run_.plan.orders.order[static_cast<size_t>(pp_.rank())],
                      static_cast<int>(run_.plan.microbatches), trace_.get(), config_.pipeline.overlap_p2p_comm);
    const bool last_stage = model_->is_last_global(static_cast<int>(model_->chunk_count()) - 1);
    evaluator_.emplace(rt_, *executor_, batches_, run_.data, config_.run.eval_batches, config_.batch.micro_batch_size,
                       last_stage);
  }
  ~RankTraining() { publish(); }
  RankTraining(const RankTraining&) = delete;
  RankTraining& operator=(const RankTraining&) = delete;

  // The steps, then the commit of a checkpoint still being written beside training.
  void run() {
    try {
      run_steps();
    } catch (const std::exception& e) {
      // Unwinding joins a write still running (~CheckpointSaver), which a slow file
      // system can make long: the other ranks stop first rather than wait in a collective.
      if (saver_.pending()) rt_.abort_world(e.what());
      throw;
    }
    saver_.commit_pending();
  }

 private:
  // What the training loop asks every rank after each step, in one reduction.
  struct StepPoll {
    bool stop = false;         // a stop signal reached some rank
    bool written = false;      // a checkpoint written beside training is on disk on every rank
    bool out_of_time = false;  // some rank is past run.exit_duration_minutes
    double minutes = 0;        // the most minutes any rank has trained
  };
  void run_steps();
  StepPoll poll() const;
  static std::unique_ptr<model::Model> create_model(const Run& run, runtime::RankRuntime& rt);
  void start_trace();
  StepRecord train_step(int64_t step);
  double per_token_scale(double targets);
  // The executor of steps of `m` microbatches per rank (ramp steps have fewer).
  pipeline::Executor& executor_for(int64_t m);
  bool stop_requested() const;
  // This rank's own signal flag (stop_requested and poll agree on it over the world).
  bool stop_signalled() const { return run_.options.stop_signal && run_.options.stop_signal->load(); }
  bool evaluates_at(int64_t step) const;
  bool evaluate(StepRecord& rec);
  void sample(int64_t step);
  // Saves `step` (checkpoint.async_save: in the background, unless `in_line`).
  void checkpoint(int64_t step, bool in_line, bool evaluation_pending = false);
  // A checkpoint is in place (CheckpointSaver's OnCommit).
  void committed(const CheckpointSaver::Committed& c);
  void mark_interrupted();
  void mark_exited(const std::string& reason);
  void publish();

  Run& run_;
  const manifest::RunConfig& config_;
  const manifest::ScheduleMarks schedule_;  // the schedule's marks, at the run's end step (Run::steps)
  runtime::RankRuntime& rt_;
  const int rank_;
  const bool leader_;
  const loom::Group world_, dp_, pp_;
  std::unique_ptr<model::Model> model_;
  OptimizerBinding optimizer_;
  Microbatches batches_;
  CheckpointSaver saver_;
  std::unique_ptr<pipeline::TraceRecorder> trace_;
  std::optional<pipeline::Executor> executor_;
  std::optional<pipeline::Executor> ramp_executor_;  // batch.rampup_batch_size's current smaller steps
  int64_t ramp_executor_count_ = 0;                  // their microbatches
  std::optional<Evaluator> evaluator_;
  double flops_per_sample_ = 0;  // forward + backward of one training sample, over the whole world
  int peak_in_flight_ = 0;
  uint64_t peak_activation_bytes_ = 0;
};

// Given weights replace the random ones before the optimizer takes its master copy.
std::unique_ptr<model::Model> RankTraining::create_model(const Run& run, runtime::RankRuntime& rt) {
  return create_rank_model(run.plan, rt, run.vocab, run.init_weights.get());
}

// The rank's real timeline: the executor's steps and p2p, and its collectives.
void RankTraining::start_trace() {
  trace_ = std::make_unique<pipeline::TraceRecorder>(run_.trace_origin);
  rt_.set_comm_observer([this](const std::string& kind, const char* op, uint64_t bytes,
                               std::chrono::steady_clock::time_point start, bool started) {
    const std::string name = op;
    if ((name == "send" || name == "recv") && !started) return;  // the executor records the waits
    // A started collective, or a receive posted early, runs beside the rank's work:
    // on the rank's comm track, from its start to its wait.
    trace_->add(rank_, kind + " " + name, "collective", start, {{"bytes", static_cast<long long>(bytes)}},
                started ? pipeline::TraceLane::Comm : pipeline::TraceLane::Rank);
  });
}

// Whether a stop signal reached any rank (every rank gets the same answer).
bool RankTraining::stop_requested() const {
  double flag = stop_signalled() ? 1 : 0;
  world_.all_reduce(nullptr, &flag, &flag, 1, LOOM_DTYPE_F64, LOOM_REDUCE_MAX);
  return flag > 0;
}

RankTraining::StepPoll RankTraining::poll() const {
  const double limit = config_.run.exit_duration_minutes;
  double flags[3] = {stop_signalled() ? 1.0 : 0.0, saver_.writing() ? 1.0 : 0.0, run_.minutes_trained()};
  world_.all_reduce(nullptr, flags, flags, 3, LOOM_DTYPE_F64, LOOM_REDUCE_MAX);
  return {flags[0] > 0, saver_.pending() && flags[1] == 0, limit > 0 && flags[2] > limit, flags[2]};
}

pipeline::Executor& RankTraining::executor_for(int64_t m) {
  if (m == run_.plan.microbatches) return *executor_;
  if (ramp_executor_count_ != m) {  // the ramp's batch grew: this count's orders (one at a time)
    ramp_executor_.reset();
    ramp_executor_.emplace(*model_, rt_, run_.plan.orders_for(m).order[static_cast<size_t>(pp_.rank())],
                           static_cast<int>(m), trace_.get(), config_.pipeline.overlap_p2p_comm);
    ramp_executor_count_ = m;
  }
  return *ramp_executor_;
}

// run.calculate_per_token_loss: dp / the global batch's targets (every rank reads its
// microbatches whole, so a dp all-reduce of its count gives them; the dp average of the
// gradients then divides the batch's summed loss by that number); 0 otherwise.
double RankTraining::per_token_scale(double targets) {
  if (!config_.run.calculate_per_token_loss) return 0;
  dp_.all_reduce(nullptr, &targets, &targets, 1, LOOM_DTYPE_F64);
  return static_cast<double>(dp_.size()) / std::max(targets, 1.0);
}

// One step from `step` (the steps done) to step + 1, without evaluation.
StepRecord RankTraining::train_step(int64_t step) {
  const auto t0 = std::chrono::steady_clock::now();
  const uint64_t consumed = run_.samples_before(step);
  const int64_t M = run_.ramp.microbatches_at(consumed), mbs = config_.batch.micro_batch_size;
  const int64_t global_batch = run_.ramp.global_batch_at(consumed);
  rt_.reset_comm_stats();
  model_->zero_grads();
  std::vector<pipeline::MicrobatchInput> inputs;
  double targets = 0;  // this dp rank's, for run.calculate_per_token_loss
  for (int64_t mb = 0; mb < M; ++mb) {
    const uint64_t first = sample_index(consumed, dp_.rank(), M, static_cast<int>(mb), mbs);
    inputs.push_back(batches_.load(Split::Train, first, mb));
    inputs.back().dropout_seed = dropout_seed(static_cast<uint64_t>(config_.run.seed), step, first);
    targets += static_cast<double>(batches_.whole_targets());
  }
  // Graphs are of the whole global batch's steps, which replay in one fixed order.
  model_->set_steps_capturable(M == run_.plan.microbatches);
  const pipeline::StepStats stats = executor_for(M).train_step(inputs, per_token_scale(targets));
  peak_in_flight_ = std::max(peak_in_flight_, stats.peak_in_flight);
  peak_activation_bytes_ = std::max(peak_activation_bytes_, stats.peak_activation_bytes);
  // The loss: mean over microbatches (from the last stage) and the auxiliary losses
  // (summed over the stages' layers), averaged over dp. Before the optimizer step:
  // a dp collective after it would wait behind the parameter all-gathers that
  // overlap_param_gather leaves running into the next forward. Bookkeeping, so not
  // counted as the step's communication.
  runtime::CommStats step_comm = rt_.comm_stats();
  double reduced[2] = {stats.loss, stats.aux_loss};
  pp_.all_reduce(nullptr, reduced, reduced, 2, LOOM_DTYPE_F64);
  dp_.all_reduce(nullptr, reduced, reduced, 2, LOOM_DTYPE_F64, LOOM_REDUCE_AVG);
  rt_.reset_comm_stats();
  const auto t_opt = std::chrono::steady_clock::now();
  model_->finalize_grads();
  model_->end_step(step + 1, static_cast<int32_t>(M));
  const SchedulePoint at{step + 1, consumed + static_cast<uint64_t>(global_batch)};
  const double lr = learning_rate(config_.optimizer, schedule_, at);
  const double decay = weight_decay(config_.optimizer, schedule_, at);
  const loom_optimizer_step_result sr = optimizer_.step(step + 1, lr, decay);
  rt_.dev().synchronize();
  if (trace_) trace_->add(rank_, "optimizer step " + std::to_string(step + 1), "optimizer", t_opt);

  StepRecord rec;
  rec.step = step + 1;
  rec.global_batch = global_batch;
  rec.consumed_samples = at.samples;
  // The step's communication: the pipeline's p2p, the model's and the optimizer's
  // collectives (not the bookkeeping, nor evaluation).
  rec.comm = std::move(step_comm);
  rec.comm += rt_.comm_stats();
  rec.loss = reduced[0];
  rec.aux_loss = reduced[1];
  rec.lr = static_cast<float>(lr);
  rec.weight_decay = static_cast<float>(decay);
  rec.grad_norm = sr.grad_norm;
  rec.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const loom_memory_stats mem = rt_.memory();
  rec.mem_current = mem.current_bytes;
  rec.mem_peak = mem.peak_bytes;
  rec.in_flight = stats.peak_in_flight;
  rec.activation_bytes = stats.peak_activation_bytes;
  return rec;
}

void RankTraining::checkpoint(int64_t step, bool in_line, bool evaluation_pending) {
  if (config_.checkpoint.dir.empty()) return;
  optimizer_.params_needed_all();
  saver_.save(*model_, optimizer_, step, run_.samples_before(step), evaluation_pending,
              in_line || !config_.checkpoint.async_save);
}

// A checkpoint is in place: said, the old ones pruned (checkpoint.keep_last).
void RankTraining::committed(const CheckpointSaver::Committed& c) {
  if (!leader_) return;
  std::vector<std::string> failed;
  const std::vector<std::string> removed = run_.pruner->prune(c.step, &failed);
  if (run_.options.log) {
    std::ostringstream os;
    os << std::fixed << std::setprecision(1) << "checkpoint: step " << c.step << " saved in " << c.dir << " ("
       << static_cast<double>(c.bytes) / (1 << 20) << " MiB";
    if (c.background) os << ", written beside training in " << c.written_ms << " ms by the slowest rank";
    os << "; training waited " << c.waited_ms << " ms)";
    *run_.options.log << os.str() << std::endl;
    for (const std::string& p : removed)
      *run_.options.log << "checkpoint.keep_last = " << config_.checkpoint.keep_last << ": removing " << p << std::endl;
    for (const std::string& f : failed)
      *run_.options.log << "warning: checkpoint.keep_last = " << config_.checkpoint.keep_last << ": could not remove "
                        << f << std::endl;
  }
  std::lock_guard<std::mutex> lock(run_.mu);
  run_.result.checkpoint = c.dir;
}

void RankTraining::mark_interrupted() {
  if (!leader_) return;
  std::lock_guard<std::mutex> lock(run_.mu);
  run_.result.interrupted = true;
}

void RankTraining::mark_exited(const std::string& reason) {
  if (!leader_) return;
  std::lock_guard<std::mutex> lock(run_.mu);
  run_.result.exit_reason = reason;
}

// This rank's pipeline peaks, execution statistics and timeline, however the loop ends.
void RankTraining::publish() {
  rt_.set_comm_observer(nullptr);
  std::lock_guard<std::mutex> lock(run_.mu);
  run_.result.peak_in_flight[rank_] = peak_in_flight_;
  run_.result.peak_activation_bytes[rank_] = peak_activation_bytes_;
  const loom_exec_api* exec_api = rt_.exec_api();
  loom_exec_stats es = loom::make<loom_exec_stats>();
  if (LOOM_HAS_SLOT(exec_api, loom_exec_api, stats) && exec_api->stats) {
    if (loom_status st = exec_api->stats(rt_.exec_handle(), &es)) plugins::host_api()->status_destroy(st);
    else run_.result.exec_stats[rank_] = es;
  }
  if (trace_) run_.trace_events.insert(run_.trace_events.end(), trace_->events().begin(), trace_->events().end());
}

void RankTraining::run_steps() {
  const RunPlan& plan = run_.plan;
  const int64_t steps = run_.steps, seq = config_.model.seq_length, mbs = config_.batch.micro_batch_size;
  // One microbatch per dp rank's worth of samples: micro_batch * dp of them.
  flops_per_sample_ = model_->forward_flops() * 3.0 / static_cast<double>(mbs * plan.dp);
  world_.all_reduce(nullptr, &flops_per_sample_, &flops_per_sample_, 1, LOOM_DTYPE_F64);
  if (leader_) {
    run_.metrics.set_rates({static_cast<double>(seq), flops_per_sample_, config_.device.peak_tflops, plan.sizes.world,
                            config_.batch.global_batch_size});
    if (run_.options.log)
      *run_.options.log << "loom: " << plan.sizes.world << " rank(s) (tp " << plan.sizes.tp
                        << (plan.sizes.cp > 1 ? ", cp " + std::to_string(plan.sizes.cp) : std::string()) << ", pp "
                        << plan.sizes.pp << ", dp " << plan.dp << "), " << model_->numel()
                        << " parameter elements on rank 0, " << plan.microbatches << " microbatch(es) of " << mbs
                        << " x " << seq << " per rank per step"
                        << (run_.ramp.microbatches_at(run_.start_samples) < plan.microbatches
                                ? " (from " + std::to_string(run_.ramp.microbatches_at(run_.start_samples)) +
                                      " as batch.rampup_batch_size ramps the global batch)"
                                : std::string())
                        << "; data: " << run_.data.describe()
                        << documents_text(run_.documents) << std::endl;
  }

  if (run_.options.save_start_only) {
    checkpoint(run_.start_step, /*in_line=*/true);
    return;
  }
  int64_t step = run_.start_step;
  // The evaluation of the checkpoint's step that a stop signal cut short comes first
  // (a second stop leaves it pending in the same checkpoint).
  if (run_.resume && run_.resume->evaluation_pending && evaluates_at(step)) {
    StepRecord rec;
    rec.step = step;
    if (!evaluate(rec)) {
      mark_interrupted();
      return;
    }
    if (leader_) {
      run_.metrics.write_evaluation(rec);
      try {
        clear_evaluation_pending(run_.resume->dir);
      } catch (const CheckpointError& e) {  // the run goes on; only a later resume is affected
        if (run_.options.log)
          *run_.options.log << "warning: " << e.what() << " (a later --resume runs this evaluation again)" << std::endl;
      }
    }
  }
  while (step < steps) {
    StepRecord rec = train_step(step);
    ++step;
    if (run_.options.stepped) run_.options.stepped->store(true);
    const StepPoll polled = poll();
    // Out of time before the last step, the run stops as at a signal: the step saved,
    // its evaluation left to the resumed run.
    const bool out_of_time = polled.out_of_time && step < steps;
    bool stop = polled.stop || out_of_time;
    if (polled.written) saver_.commit_pending();
    run_.metrics.complete(rec);
    // A stop before or during this step's evaluation leaves it to the resumed run.
    bool evaluation_pending = stop && evaluates_at(step);
    // What reads the parameters outside a training forward (evaluation, on_step, and
    // checkpoint() and sample() below) finds them in place.
    if (run_.options.on_step) optimizer_.params_needed_all();
    if (!stop && evaluates_at(step) && !evaluate(rec)) stop = evaluation_pending = true;
    if (run_.options.on_step) run_.options.on_step(step, rank_, *model_);
    const int64_t exit_interval = config_.run.exit_interval;
    const bool exit_here = exit_interval > 0 && step % exit_interval == 0 && step < steps;
    if (leader_) {
      run_.metrics.write(rec, stop || exit_here);
      std::lock_guard<std::mutex> lock(run_.mu);
      run_.result.steps.push_back(rec);
      run_.result.final_step = step;
    }
    // Both are reduced, so every rank stops here alike, before this step's weights are saved.
    if (!std::isfinite(rec.loss) || !std::isfinite(rec.grad_norm)) {
      try {
        saver_.commit_pending();  // an earlier step's weights, finite
      } catch (const std::exception& e) {
        throw_not_finite(run_, rec, std::string("; and ") + e.what());
      }
      throw_not_finite(run_, rec);
    }
    const int64_t sample_every = config_.run.sample_every;
    if (!stop && sample_every > 0 && (step % sample_every == 0 || step == steps)) sample(step);
    if (stop) {
      checkpoint(step, /*in_line=*/true, evaluation_pending);
      if (out_of_time && !polled.stop) {
        std::ostringstream why;
        why << "run.exit_duration_minutes = " << config_.run.exit_duration_minutes << " (" << std::setprecision(3)
            << polled.minutes << " minutes since training started)";
        mark_exited(why.str());
      } else {
        mark_interrupted();  // a signal, before or during the evaluation
      }
      return;
    }
    if (exit_here) {
      checkpoint(step, /*in_line=*/true);
      mark_exited("run.exit_interval = " + std::to_string(exit_interval));
      return;
    }
    if (config_.checkpoint.every > 0 && step % config_.checkpoint.every == 0 && step < steps) {
      checkpoint(step, /*in_line=*/false);
      if (stop_requested()) {  // a signal that came while the checkpoint was saved: this step is saved
        mark_interrupted();
        return;
      }
    }
  }
  if (step > run_.start_step) checkpoint(step, /*in_line=*/true);
  optimizer_.params_needed_all();
}

bool RankTraining::evaluates_at(int64_t step) const {
  const int64_t every = config_.run.eval_every;
  return every > 0 && (step % every == 0 || step == run_.steps);
}

// The validation loss (and accuracies) into `rec`; false when a stop signal ended it.
bool RankTraining::evaluate(StepRecord& rec) {
  optimizer_.params_needed_all();
  const std::optional<Evaluation> e = evaluator_->run([this] { return stop_requested(); });
  if (!e) return false;
  rec.evaluated = true;
  rec.val_loss = e->loss;
  rec.exact_match = e->exact_match;
  rec.token_accuracy = e->token_accuracy;
  return true;
}

// run.sample_every: the start of validation sequence 0 (DataSource::sample_prompt: a
// quarter of seq_length, or a conversation's first question) and what the model writes
// after it, greedy, through the key/value cache; every rank generates alike (expert and
// pipeline collectives need them all), rank 0 prints.
void RankTraining::sample(int64_t step) {
  optimizer_.params_needed_all();
  GenerationRequest req;
  req.prompt = run_.data.sample_prompt(Split::Validation, 0, config_.model.seq_length);
  req.max_new_tokens = config_.run.sample_tokens;
  req.sampling.temperature = 0;
  const bool reports = pp_.rank() == pp_.size() - 1 && rt_.group_or_self("tp").rank() == 0 && dp_.rank() == 0;
  const GenerationResult r = generate_on_rank(*model_, rt_, run_.vocab, req, reports, run_.documents);
  if (leader_ && run_.options.log)
    *run_.options.log << "sample at step " << step << ": " << run_.data.render(req.prompt.data(), static_cast<int64_t>(req.prompt.size()))
                      << " -> " << run_.data.render(r.tokens.data(), static_cast<int64_t>(r.tokens.size())) << std::endl;
}

}  // namespace

std::unique_ptr<model::Model> create_rank_model(const RunPlan& plan, runtime::RankRuntime& rt, int64_t vocab,
                                                const InitialWeights* weights) {
  plugins::OptionValues exec_options(&plan.config.exec.options, plan.exec->options);
  loom_exec* exec = nullptr;
  loom::check(plan.exec->exec()->create(exec_options.raw(), &rt, &exec));
  rt.set_exec(plan.exec->exec(), exec);
  const loom_model_dims dims = model::model_dims(plan.config, vocab, plan.sizes.tp);
  auto model = std::make_unique<model::Model>(
      plan.config, *plan.registry, rt, dims,
      pipeline::local_chunks(plan.chunks, plan.sizes.pp, rt.group_or_self("pp").rank()),
      static_cast<uint64_t>(plan.config.run.seed));
  if (weights) load_initial_weights(*weights, vocab, *model);
  return model;
}

TrainResult train(const RunPlan& plan, const TrainOptions& options) {
  const auto started = std::chrono::steady_clock::now();
  const manifest::RunConfig& config = plan.config;
  // Everything known before launch is refused before launch (loom validate reports the same).
  const runtime::ProcessLaunch launch = runtime::detect_process_launch();
  Preflight checked = preflight(plan, launch.multi_process ? 1 : plan.sizes.world);
  if (!checked.memory_problem.empty())
    throw loom::Error(checked.memory_problem + "; make the model or the micro-batch smaller, split it over more ranks" +
                      (checked.memory_problem.find("shared by") != std::string::npos
                           ? std::string(", or run fewer ranks per process")
                           : std::string()) +
                      " (loom plan shows each rank's share)");
  if (options.log && (!launch.multi_process || launch.rank == 0))
    for (const std::string& w : {end_token_unseen(*checked.data, config, checked.vocab),
                                 checked.data->warning(config.model.seq_length)})
      if (!w.empty()) *options.log << "data: warning: " << w << std::endl;

  // The trace is written after training: a path it cannot be written to fails now,
  // before anything is written (the metrics file, a checkpoint directory).
  if (!options.trace_file.empty())
    if (const std::string why = files::cannot_write(options.trace_file); !why.empty())
      throw std::runtime_error("--trace " + options.trace_file + ": " + why);

  const std::string& ckpt_dir = config.checkpoint.dir;
  if (options.save_start_only && (options.resume || ckpt_dir.empty()))
    throw std::logic_error("TrainOptions::save_start_only saves a new run's starting point into checkpoint.dir");
  std::optional<CheckpointDirLock> ckpt_lock;
  if (!ckpt_dir.empty()) {
    for (const std::string& w :
         prepare_checkpoint_dir(ckpt_dir, !launch.multi_process || launch.rank == 0 ? &ckpt_lock : nullptr))
      if (options.log) *options.log << "warning: " << w << std::endl;
  }
  // A new run into another run's checkpoints would overwrite the steps they share and
  // leave the rest, which a later --resume (the highest step) would take for its own.
  if (!options.resume && !ckpt_dir.empty())
    if (const std::optional<int64_t> step = latest_checkpoint(ckpt_dir))
      throw CheckpointError("checkpoint.dir " + ckpt_dir + " holds the checkpoints of an earlier run (the newest " +
                            checkpoint_path(ckpt_dir, *step) + "): --resume to continue it, or give this run a "
                            "checkpoint.dir of its own (or remove that one)");
  std::optional<ResumePoint> resume;
  // --resume of a fine-tuning run (checkpoint.init_weights) that has saved nothing yet
  // starts from the given weights, and --resume-if-any of any run from its start: one
  // command line serves every launch of a run that may be preempted or stop early.
  const bool first_launch = options.resume &&
                            (!config.checkpoint.init_weights.empty() || options.start_without_checkpoint) &&
                            !ckpt_dir.empty() && !latest_checkpoint(ckpt_dir);
  if (first_launch && options.log)
    *options.log << "resume: no checkpoint in " << ckpt_dir << " yet; starting "
                 << (config.checkpoint.init_weights.empty()
                         ? std::string("the run")
                         : "from checkpoint.init_weights = " + config.checkpoint.init_weights)
                 << std::endl;
  if (options.resume && !first_launch) {
    resume = plan_resume(plan, ckpt_dir, checked.vocab, options.log);
    if (options.log) *options.log << "resume: from " << resume->dir << " (step " << resume->step << ")" << std::endl;
  }

  const int64_t steps = resume ? resume->steps : config.run.steps;
  MetricsSink metrics(options.metrics_file, resume ? resume->step : -1, options.log, steps, config.run.log_every);
  if (!options.tensorboard_dir.empty())
    metrics.write_tensorboard(options.tensorboard_dir, (resume ? resume->step : 0) + 1);

  Run run{plan, options, *checked.data, checked.vocab, resume ? resume->step : 0, resume ? resume->consumed_samples : 0,
          resume, saved_manifest(plan),
          metrics, std::chrono::steady_clock::now(), {}, {}, {}};
  run.started = started;
  run.steps = steps;
  run.ramp = BatchRamp(config.batch, plan.dp);
  run.documents = document_inputs(config, checked.vocab);
  if (resume && options.log) {
    for (const std::string& change : data_order_changes(resume->dir, run.manifest_toml))
      *options.log << "resume: warning: " << change << " since the checkpoint: the data after it (samples, loss mask or "
                   << "documents) is not what the interrupted run would have read" << std::endl;
    manifest::RunConfig ending = config;  // a resumed run.train_samples run's own end step
    ending.run.steps = steps;
    if (const std::vector<std::string> changes =
            schedule_changes(resume->dir, ending, resume->step, resume->consumed_samples);
        !changes.empty()) {
      *options.log << "resume: warning: the learning-rate or weight-decay schedule differs from the checkpoint's: "
                   << changes.front() << std::endl;
      for (size_t i = 1; i < changes.size(); ++i) *options.log << "resume:   " << changes[i] << std::endl;
    }
  }
  run.pruner = std::make_unique<CheckpointPruner>(ckpt_dir, config.checkpoint.keep_last);
  run.result.start_step = run.start_step;
  run.result.end_step = steps;
  run.result.final_step = run.start_step;  // a stop before any step trained
  if (!resume && !config.checkpoint.init_weights.empty()) {
    if (!options.read_init_weights)
      throw loom::Error("checkpoint.init_weights = \"" + config.checkpoint.init_weights +
                        "\": this caller of train() reads no weights (TrainOptions::read_init_weights; `loom run` does)");
    run.init_weights = std::make_shared<const InitialWeights>(options.read_init_weights(checked.vocab));
    if (options.log) {
      for (const std::string& s : run.init_weights->skipped)
        *options.log << "init_weights: skipped " << s << "; reading " << run.init_weights->source << std::endl;
      *options.log << "init_weights: " << run.init_weights->tensors.size() << " tensors from "
                   << run.init_weights->source << std::endl;
      if (const std::vector<std::string>& unread = run.init_weights->unread; !unread.empty()) {
        *options.log << "init_weights: warning: " << unread.size() << " tensor(s) of " << run.init_weights->source
                     << " the model does not read:";
        for (size_t i = 0; i < unread.size() && i < 8; ++i) *options.log << (i ? ", " : " ") << unread[i];
        *options.log << (unread.size() > 8 ? ", ..." : "") << std::endl;
      }
      for (const std::string& c : run.init_weights->changed)
        *options.log << "init_weights: " << c << " (attention reaches otherwise than the weights were trained to)"
                     << std::endl;
    }
    check_initial_weights(*run.init_weights, checked.memory, checked.vocab,
                          model::model_dims(config, checked.vocab, plan.sizes.tp).padded_vocab);
  }

  if (resume && resume->regather) {  // read once, cut by every rank of this process
    // The checkpoint's manifest names this run's plugins (require_same_model): the
    // registry only looks them up again. Only what this process's ranks hold is
    // gathered (under mpirun: its rank's pipeline stage and experts).
    const std::vector<int32_t> mine = runtime::process_ranks(plan.sizes.world);
    WholeCheckpoint ck = gather_checkpoint(resume->dir, const_cast<plugins::Registry&>(*plan.registry),
                                           /*with_state=*/true, tensors_held_by(checked.memory, mine));
    if (options.log && ck.tensors.size() < ck.declared)
      *options.log << "resume: gathered " << ck.tensors.size() << " of the checkpoint's " << ck.declared
                   << " parameters (those of this process's ranks) with their optimizer state" << std::endl;
    auto w = std::make_shared<InitialWeights>(InitialWeights{resume->dir, std::move(ck.tensors), ck.vocab, "--resume"});
    w->states = std::move(ck.states);
    check_initial_weights(*w, checked.memory, checked.vocab,
                          model::model_dims(config, checked.vocab, plan.sizes.tp).padded_vocab, mine);
    run.regathered = std::move(w);
  }
  const runtime::LaunchConfig lc = launch_config(plan);
  try {
    runtime::launch(lc, [&run](runtime::RankRuntime& rt) { RankTraining(run, rt).run(); });
  } catch (...) {
    // A save the failure cut short is never committed: its space goes back now, as far
    // as this process can (under mpirun another process may still write into it, or the
    // job end this one first).
    if (ckpt_lock) {
      try {
        for (const std::string& f : remove_unfinished_saves_of_this_run(ckpt_dir))
          if (options.log) *options.log << "warning: could not remove the unfinished save " << f << std::endl;
      } catch (const std::exception&) {  // the run's own error is the one to report
      }
    }
    throw;
  }
  for (const std::string& f : run.pruner->finish())  // the last pruning's files gone before the run ends
    if (options.log)
      *options.log << "warning: checkpoint.keep_last = " << config.checkpoint.keep_last << ": could not remove " << f
                   << "; the next run on this checkpoint.dir tries again" << std::endl;
  if (!options.trace_file.empty()) pipeline::write_chrome_trace(options.trace_file, run.trace_events);
  if (options.keep_trace) run.result.trace = std::move(run.trace_events);
  return std::move(run.result);
}

}  // namespace loom::train
