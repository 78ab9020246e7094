#include "engine/train/trainer.hpp"

#include "engine/model/param_init.hpp"
#include "engine/pipeline/executor.hpp"
#include "engine/pipeline/partition.hpp"
#include "engine/pipeline/schedule.hpp"
#include "engine/runtime/launcher.hpp"
#include "engine/train/checkpoint.hpp"
#include "engine/train/data.hpp"
#include "engine/train/preflight.hpp"

#include <glog/logging.h>

#include <chrono>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <mutex>
#include <optional>
#include <ostream>
#include <sstream>

namespace loom::train {

double learning_rate(const manifest::Manifest& m, int64_t step) {
  const double lr = m.get_float("optimizer.lr"), min_lr = m.get_float("optimizer.min_lr");
  const int64_t warmup = m.get_int("optimizer.warmup_steps");
  int64_t decay = m.get_int("optimizer.decay_steps");
  if (decay <= 0) decay = m.get_int("run.steps");
  if (warmup > 0 && step <= warmup) return lr * static_cast<double>(step) / warmup;
  if (step >= decay) return min_lr;
  const double progress = static_cast<double>(step - warmup) / std::max<int64_t>(1, decay - warmup);
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

namespace {

std::string human(double v) {
  const char* units[] = {"", "k", "M", "G", "T"};
  int u = 0;
  while (std::fabs(v) >= 1000 && u < 4) {
    v /= 1000;
    ++u;
  }
  std::ostringstream os;
  os << std::fixed << std::setprecision(v < 10 ? 2 : 1) << v << units[u];
  return os.str();
}

std::string mib(uint64_t b) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(1) << b / (1024.0 * 1024.0) << " MiB";
  return os.str();
}

// A JSON number; null for inf and nan, which JSON cannot spell (every line stays JSON).
struct JsonNumber {
  double v;
};
std::ostream& operator<<(std::ostream& os, JsonNumber n) {
  if (std::isfinite(n.v)) return os << n.v;
  return os << "null";
}

std::string step_json(const StepRecord& r) {
  using N = JsonNumber;
  std::ostringstream os;
  os.precision(9);
  os << "{\"step\": " << r.step << ", \"loss\": " << N{r.loss} << ", \"aux_loss\": " << N{r.aux_loss}
     << ", \"lr\": " << N{r.lr} << ", \"grad_norm\": " << N{r.grad_norm} << ", \"tokens_per_s\": " << N{r.tokens_per_s}
     << ", \"ms\": " << N{r.ms} << ", \"flops_per_s\": " << N{r.flops_per_s} << ", \"mfu\": " << N{r.mfu}
     << ", \"mem_bytes\": " << r.mem_current << ", \"mem_peak_bytes\": " << r.mem_peak
     << ", \"in_flight\": " << r.in_flight << ", \"activation_bytes\": " << r.activation_bytes
     << ", \"comm\": " << runtime::comm_stats_json(r.comm);
  if (r.evaluated) {
    os << ", \"val_loss\": " << N{r.val_loss};
    if (r.exact_match >= 0) os << ", \"val_exact_match\": " << N{r.exact_match};
    if (r.token_accuracy >= 0) os << ", \"val_token_accuracy\": " << N{r.token_accuracy};
  }
  os << "}";
  return os.str();
}

uint64_t dropout_seed(uint64_t seed, int64_t step, uint64_t sample) {
  uint64_t parts[3] = {seed, static_cast<uint64_t>(step), sample};
  return model::fnv1a(parts, sizeof(parts));
}

}  // namespace

TrainResult train(const RunPlan& plan, const TrainOptions& options) {
  const manifest::Manifest& m = plan.manifest;
  // Everything known before launch is refused before launch (loom validate reports the same).
  const runtime::ProcessLaunch launch = runtime::detect_process_launch();
  Preflight checked = preflight(plan, launch.multi_process ? 1 : plan.sizes.world);
  if (!checked.memory_problem.empty())
    throw loom::Error(checked.memory_problem + "; make the model, the micro-batch or the ranks per process smaller "
                                               "(loom plan shows each rank's share)");
  const std::unique_ptr<DataSource> data = std::move(checked.data);
  const int64_t vocab = checked.vocab;

  const int64_t steps = m.get_int("run.steps");
  const int64_t seq = m.get_int("model.seq_length");
  const int64_t mbs = m.get_int("batch.micro_batch_size");
  const int64_t global_batch = m.get_int("batch.global_batch_size");
  const int64_t M = plan.microbatches;
  const uint64_t seed = static_cast<uint64_t>(m.get_int("run.seed"));
  const int64_t log_every = m.get_int("run.log_every");
  const int64_t eval_every = m.get_int("run.eval_every");
  const int64_t eval_batches = m.get_int("run.eval_batches");
  const std::string ckpt_dir = m.get_string("checkpoint.dir");
  const int64_t ckpt_every = m.get_int("checkpoint.every");
  const double peak_tflops = m.get_float("device.peak_tflops");
  const std::string manifest_toml = m.to_toml();

  TrainResult result;
  int64_t start_step = 0;
  std::string resume_dir;
  int resume_old_dp = 0, resume_old_world = 0;  // set when the checkpoint's dp differs: reshard
  int64_t resume_old_bucket_size = m.get_int("optimizer.bucket_size");
  std::optional<CheckpointDirLock> ckpt_lock;
  if (!ckpt_dir.empty()) {
    prepare_checkpoint_dir(ckpt_dir);
    if (!launch.multi_process || launch.rank == 0) ckpt_lock.emplace(ckpt_dir);
  }
  if (options.resume) {
    const ResumePoint from = plan_resume(plan, ckpt_dir, options.log);
    resume_dir = from.dir;
    resume_old_dp = from.old_dp;
    resume_old_world = from.old_world;
    if (from.old_bucket_size >= 0) resume_old_bucket_size = from.old_bucket_size;
    start_step = from.step;
  }
  result.start_step = start_step;

  std::ofstream metrics;
  if (!options.metrics_file.empty()) {
    metrics.open(options.metrics_file, options.resume ? std::ios::app : std::ios::trunc);
    if (!metrics) throw std::runtime_error("metrics file " + options.metrics_file + ": cannot open the file for writing");
  }
  // The trace is written after training: a path it cannot be written to fails now.
  if (!options.trace_file.empty() && !std::ofstream(options.trace_file, std::ios::app))
    throw std::runtime_error("--trace " + options.trace_file + ": cannot open the file for writing");

  // The pipeline: every rank's order from the schedule plugin, proven free of
  // deadlock before any rank starts, and the layers of each global chunk.
  const int pp = plan.sizes.pp;
  const int vpp = static_cast<int>(m.get_int("parallel.vpp"));
  const pipeline::PipelineOrders& orders = plan.orders;  // computed and simulated by make_plan
  const std::vector<std::vector<model::LayerSpec>> global_chunks = pipeline::partition_layers(
      plan.layers, pipeline::blocks_per_chunk(static_cast<int>(m.get_int("model.num_layers")), pp, vpp,
                                              static_cast<int>(m.get_int("pipeline.first_chunk_layers")),
                                              static_cast<int>(m.get_int("pipeline.last_chunk_layers"))));
  const auto trace_origin = std::chrono::steady_clock::now();
  std::vector<pipeline::TraceEvent> trace_events;

  runtime::LaunchConfig lc;
  lc.device_plugin = plan.device;
  lc.device_options = m.get_table("device.options");
  lc.comm_plugin = plan.comm;
  lc.comm_options = m.get_table("comm.options");
  lc.sizes = plan.sizes;
  lc.timeout_ms = static_cast<int64_t>(m.get_float("comm.timeout_s") * 1000);
  lc.threads = static_cast<int>(m.get_int("device.threads"));
  lc.services = plan.services();

  std::mutex result_mu;
  runtime::launch(lc, [&](runtime::RankRuntime& rt) {
    const int rank = rt.global_rank();
    const bool leader = rank == 0;
    loom::Device dev = rt.dev();
    const loom::Group dp = rt.group_or_self("dp");
    const loom::Group world = rt.group_or_self("world");
    const loom::Group ppg = rt.group_or_self("pp");

    // Execution mode and model.
    plugins::OptionValues exec_opts(m.get_table("exec.options"), plan.exec->options);
    loom_exec* exec = nullptr;
    loom::check(plan.exec->exec()->create(exec_opts.raw(), &rt, &exec));
    rt.set_exec(plan.exec->exec(), exec);
    const loom_model_dims dims = model::model_dims(m, vocab, plan.sizes.tp);
    model::Model model(m, *plan.registry, rt, dims, pipeline::local_chunks(global_chunks, pp, ppg.rank()), seed);
    const bool last_stage = model.is_last_global(static_cast<int>(model.chunk_count()) - 1);

    // Optimizer strategy over the flat buffers.
    std::vector<loom_param_info> infos = model.param_infos();
    loom_optimizer_create_args oa = loom::make<loom_optimizer_create_args>();
    oa.params = model.params();
    oa.grads = model.grads();
    oa.numel = model.numel();
    oa.param_dtype = model.param_dtype();
    oa.grad_dtype = model.grad_dtype();
    oa.infos = infos.data();
    oa.num_params = infos.size();
    // Parameters are replicated over dp (and cp): the strategy averages over both.
    const loom::Group grad_group = rt.group_or_self(topology::gradient_group_kind(plan.sizes.cp));
    oa.dp = grad_group.raw();
    oa.tp = rt.group_or_self("tp").raw();
    oa.pp = rt.group_or_self("pp").raw();
    std::vector<size_t> bucket_offsets;
    for (const model::Range& b : model.layout().buckets) bucket_offsets.push_back(b.start);
    bucket_offsets.push_back(model.layout().numel);
    oa.bucket_offsets = bucket_offsets.data();
    oa.num_buckets = model.layout().buckets.size();
    const std::vector<int32_t> counted_elsewhere = model.counted_elsewhere();
    oa.counted_elsewhere = counted_elsewhere.data();
    if (plan.optimizer->abi_minor < 1 &&
        std::find(counted_elsewhere.begin(), counted_elsewhere.end(), 1) != counted_elsewhere.end())
      throw loom::Error("optimizer plugin parallel/" + plan.optimizer->name +
                        " was built for plugin ABI 1.0, which cannot tell it that the tied word embedding on the last "
                        "pipeline stage is a copy (it would count its gradient twice); rebuild it against ABI 1.1 or "
                        "set model.tie_embeddings = false");
    // Expert parameters (ABI 1.4) are reduced over edp by a strategy that says it
    // can; with ep = 1, edp is dp and any strategy reduces them right.
    const std::vector<int32_t> expert = model.expert_flags();
    const bool expert_parallel_strategy =
        LOOM_HAS_SLOT(plan.optimizer->optimizer(), loom_optimizer_api, features) &&
        (plan.optimizer->optimizer()->features & LOOM_OPTIMIZER_EXPERT_PARALLEL) != 0;
    if (plan.sizes.ep > 1 && model.has_expert_params() && !expert_parallel_strategy)
      throw loom::Error("optimizer plugin parallel/" + plan.optimizer->name +
                        " cannot reduce expert parameters over the expert data-parallel group (it does not "
                        "advertise LOOM_OPTIMIZER_EXPERT_PARALLEL, ABI 1.4); use optimizer.strategy = \"ddp\" or "
                        "\"distributed\", or parallel.ep = 1");
    // MoE folding (etp != tp, ABI 1.5): expert parameters split over etp, ep
    // spanning tp ranks; only a strategy that reads etp gets such a run.
    const bool experts_fold_tp = model.has_expert_params() && plan.sizes.experts_fold_tp();
    const bool folding_strategy = expert_parallel_strategy &&
                                  (plan.optimizer->optimizer()->features & LOOM_OPTIMIZER_EXPERT_FOLDING) != 0;
    if (experts_fold_tp && !folding_strategy)
      throw loom::Error("optimizer plugin parallel/" + plan.optimizer->name + " cannot take expert parameters split "
                        "over parallel.etp = " + std::to_string(plan.sizes.expert_tp()) +
                        " rather than parallel.tp = " + std::to_string(plan.sizes.tp) +
                        " (it does not advertise LOOM_OPTIMIZER_EXPERT_FOLDING, ABI 1.5); use optimizer.strategy = "
                        "\"ddp\" or \"distributed\", or parallel.etp = 0 (same as tp)");
    if (expert_parallel_strategy) {
      oa.expert = expert.data();
      oa.ep = rt.group_or_self("ep").raw();
      oa.edp = rt.group_or_self("edp").raw();
      if (folding_strategy) oa.etp = rt.group_or_self("etp").raw();
    }
    plugins::OptionValues opt_opts(m.get_table("optimizer.options"), plan.optimizer->options);
    const loom_optimizer_api* opt_api = plan.optimizer->optimizer();
    loom_optimizer* opt = nullptr;
    loom::check(opt_api->create(opt_opts.raw(), &rt, &oa, &opt));
    std::unique_ptr<loom_optimizer, void (*)(loom_optimizer*)> opt_guard(opt, opt_api->destroy);

    if (!resume_dir.empty() && resume_old_dp == 0) {
      check_param_layout(resume_dir, rank, param_layout_of(model));
      require_same_model(resume_dir, manifest_toml);  // what the shapes cannot tell
      RankState s = read_rank_file(resume_dir, rank, static_cast<int64_t>(model.numel()),
                                   loom::dtype_size(model.param_dtype()));
      dev.copy(model.params(), s.params.data(), s.params.size(), LOOM_COPY_HOST_TO_DEVICE);
      loom::check(opt_api->state_load(opt, s.optimizer.data(), s.optimizer.size()));
      dev.synchronize();
    } else if (!resume_dir.empty()) {
      load_resharded(resume_dir, resume_old_dp, resume_old_world, plan.sizes, rank, model, dev,
                     static_cast<size_t>(resume_old_bucket_size), opt_api, opt, "parallel/" + plan.optimizer->name);
      require_same_model(resume_dir, manifest_toml);  // after the shapes, which load_resharded compares
    }

    // FLOPs of one step over the whole world: forward + backward (2x) per microbatch.
    double flops_rank = model.forward_flops() * 3.0 * M;
    double flops_step = flops_rank;
    world.all_reduce(nullptr, &flops_step, &flops_step, 1, LOOM_DTYPE_F64);
    const double tokens_step = static_cast<double>(global_batch * seq);

    // This rank's rows of each sequence: all of them, or its context-parallel slice.
    const loom::Group cpg = rt.group_or_self("cp");
    const loom::ContextSlice context(seq, cpg.size(), cpg.rank());
    const int64_t rows = context.local_length();
    std::vector<int32_t> tokens(seq * mbs), targets(seq * mbs), predictions(rows * mbs);
    std::vector<int32_t> tokens_local(static_cast<size_t>(rows * mbs)), targets_local(tokens_local.size());
    // Fills tokens_local / targets_local from the whole-sequence tokens / targets.
    auto take_context_rows = [&] {
      for (const loom::ContextSlice::Run& run : context.runs()) {
        const size_t n = static_cast<size_t>(run.length * mbs);
        std::copy_n(tokens.begin() + run.position * mbs, n, tokens_local.begin() + run.local * mbs);
        std::copy_n(targets.begin() + run.position * mbs, n, targets_local.begin() + run.local * mbs);
      }
    };
    const size_t tok_bytes = static_cast<size_t>(rows * mbs) * sizeof(int32_t);
    // Every microbatch of a step has its own token buffers: a pipeline keeps
    // several in flight, and the embedding's backward reads its tokens.
    std::vector<loom::Buffer> tokens_dev, targets_dev;
    for (int64_t mb = 0; mb < M; ++mb) {
      tokens_dev.emplace_back(&rt, tok_bytes);
      targets_dev.emplace_back(&rt, tok_bytes);
    }
    std::unique_ptr<pipeline::TraceRecorder> trace;
    if (!options.trace_file.empty()) {
      trace = std::make_unique<pipeline::TraceRecorder>(trace_origin);
      // Collectives into the timeline too (p2p is already there, from the executor).
      rt.set_comm_observer([&, rank](const std::string& kind, const char* op, uint64_t bytes,
                                     std::chrono::steady_clock::time_point start) {
        const std::string name = op;
        if (name == "send" || name == "recv") return;
        trace->add(rank, kind + " " + name, "collective", start, {{"bytes", static_cast<long long>(bytes)}});
      });
    }
    pipeline::Executor executor(model, rt, orders.order[static_cast<size_t>(ppg.rank())], static_cast<int>(M),
                                trace.get());
    int peak_in_flight = 0;
    uint64_t peak_activation_bytes = 0;
    // Publishes this rank's pipeline peaks and timeline however the loop ends.
    struct OnExit {
      std::function<void()> fn;
      ~OnExit() { fn(); }
    } publish{[&] {
      rt.set_comm_observer(nullptr);
      std::lock_guard<std::mutex> lock(result_mu);
      result.peak_in_flight[rank] = peak_in_flight;
      result.peak_activation_bytes[rank] = peak_activation_bytes;
      const loom_exec_api* exec_api = rt.exec_api();
      loom_exec_stats es = loom::make<loom_exec_stats>();
      if (LOOM_HAS_SLOT(exec_api, loom_exec_api, stats) && exec_api->stats) {
        if (loom_status st = exec_api->stats(rt.exec_handle(), &es)) plugins::host_api()->status_destroy(st);
        else result.exec_stats[rank] = es;
      }
      if (trace) trace_events.insert(trace_events.end(), trace->events().begin(), trace->events().end());
    }};

    auto save = [&](int64_t step) {
      if (ckpt_dir.empty()) return;
      const std::string tmp = temp_checkpoint_path(ckpt_dir, step);
      if (leader) prepare_temp_dir(tmp);
      world.barrier();
      RankState s;
      s.elem_size = loom::dtype_size(model.param_dtype());
      s.params.resize(model.numel() * s.elem_size);
      dev.copy(s.params.data(), model.params(), s.params.size(), LOOM_COPY_DEVICE_TO_HOST);
      size_t bytes = 0;
      loom::check(opt_api->state_size(opt, &bytes));
      s.optimizer.resize(bytes);
      loom::check(opt_api->state_save(opt, s.optimizer.data(), bytes));
      write_rank_file(tmp, rank, step, s);
      write_param_layout(tmp, rank, param_layout_of(model));
      world.barrier();
      if (leader) {
        CheckpointMeta meta{step, plan.sizes.world, plan.sizes.tp, plan.sizes.pp, plan.dp,
                            m.get_string("optimizer.strategy"), m.get_int("optimizer.bucket_size"),
                            m.get_string("device.param_dtype"), plan.sizes.ep, plan.sizes.order,
                            plan.sizes.expert_tp()};
        meta.cp = plan.sizes.cp;
        commit_checkpoint(ckpt_dir, tmp, meta, manifest_toml);
        std::lock_guard<std::mutex> lock(result_mu);
        result.checkpoint = checkpoint_path(ckpt_dir, step);
      }
      world.barrier();
    };

    // Whether a stop signal reached any rank (every rank gets the same answer).
    auto stop_requested = [&] {
      double flag = (options.stop_signal && options.stop_signal->load()) ? 1 : 0;
      world.all_reduce(nullptr, &flag, &flag, 1, LOOM_DTYPE_F64, LOOM_REDUCE_MAX);
      return flag > 0;
    };

    // Returns false when a stop signal ended it early (then nothing is recorded).
    auto evaluate = [&](StepRecord& rec) {
      double sums[4] = {0, 0, 0, 0};  // loss sum, token count, exact-match samples, right tokens
      // Per batch: loss sum, token count, right tokens, then each sample's wrong
      // tokens (a sample matches exactly when none of its cp slices has one).
      std::vector<double> batch(static_cast<size_t>(3 + mbs));
      for (int64_t b = 0; b < eval_batches; ++b) {
        if (stop_requested()) return false;  // a signal is honoured between batches, not after all of them
        const uint64_t first = static_cast<uint64_t>((b * dp.size() + dp.rank()) * mbs);
        fill_microbatch(*data, Split::Validation, first, mbs, seq, tokens.data(), targets.data());
        take_context_rows();
        dev.copy(tokens_dev[0].get(), tokens_local.data(), tok_bytes, LOOM_COPY_HOST_TO_DEVICE);
        dev.copy(targets_dev[0].get(), targets_local.data(), tok_bytes, LOOM_COPY_HOST_TO_DEVICE);
        double loss_sum = 0;
        int64_t count = 0;
        pipeline::MicrobatchInput in;
        in.tokens = tokens_dev[0].get<int32_t>();
        in.targets = targets_dev[0].get<int32_t>();
        in.predictions = data->has_exact_match() ? predictions.data() : nullptr;
        executor.forward_only(static_cast<int>(b), in, &loss_sum, &count);
        if (!last_stage) continue;  // the loss and predictions live on the last stage (on all its cp ranks)
        std::fill(batch.begin(), batch.end(), 0.0);
        batch[0] = loss_sum;
        batch[1] = static_cast<double>(count);
        if (data->has_exact_match())
          for (int64_t t = 0; t < rows; ++t)
            for (int64_t s = 0; s < mbs; ++s) {
              const int64_t i = t * mbs + s;
              if (targets_local[i] < 0) continue;
              if (predictions[i] != targets_local[i]) batch[static_cast<size_t>(3 + s)] += 1;
              else batch[2] += 1;
            }
        if (cpg.size() > 1) cpg.all_reduce(nullptr, batch.data(), batch.data(), batch.size(), LOOM_DTYPE_F64);
        sums[0] += batch[0];
        sums[1] += batch[1];
        sums[3] += batch[2];
        if (data->has_exact_match())
          for (int64_t s = 0; s < mbs; ++s) sums[2] += batch[static_cast<size_t>(3 + s)] == 0 ? 1 : 0;
      }
      ppg.all_reduce(nullptr, sums, sums, 4, LOOM_DTYPE_F64);
      dp.all_reduce(nullptr, sums, sums, 4, LOOM_DTYPE_F64);
      rec.evaluated = true;
      rec.val_loss = sums[1] > 0 ? sums[0] / sums[1] : 0;
      rec.exact_match = data->has_exact_match() ? sums[2] / (eval_batches * mbs * dp.size()) : -1;
      rec.token_accuracy = data->has_exact_match() && sums[1] > 0 ? sums[3] / sums[1] : -1;
      return true;
    };

    if (leader && options.log)
      *options.log << "loom: " << plan.sizes.world << " rank(s) (tp " << plan.sizes.tp
                   << (plan.sizes.cp > 1 ? ", cp " + std::to_string(plan.sizes.cp) : std::string()) << ", pp "
                   << plan.sizes.pp << ", dp " << plan.dp << "), " << model.numel() << " parameter elements on rank 0, "
                   << M << " microbatch(es) of " << mbs << " x " << seq << " per rank per step; data: " << data->describe()
                   << std::endl;

    int64_t step = start_step;
    double window_ms = 0;
    int64_t window_steps = 0;
    while (step < steps) {
      const auto t0 = std::chrono::steady_clock::now();
      rt.reset_comm_stats();
      model.zero_grads();
      std::vector<pipeline::MicrobatchInput> inputs(static_cast<size_t>(M));
      for (int mb = 0; mb < M; ++mb) {
        const uint64_t first = sample_index(step, global_batch, dp.rank(), M, mb, mbs);
        fill_microbatch(*data, Split::Train, first, mbs, seq, tokens.data(), targets.data());
        take_context_rows();
        dev.copy(tokens_dev[mb].get(), tokens_local.data(), tok_bytes, LOOM_COPY_HOST_TO_DEVICE);
        dev.copy(targets_dev[mb].get(), targets_local.data(), tok_bytes, LOOM_COPY_HOST_TO_DEVICE);
        inputs[mb].tokens = tokens_dev[mb].get<int32_t>();
        inputs[mb].targets = targets_dev[mb].get<int32_t>();
        inputs[mb].dropout_seed = dropout_seed(seed, step, first);
      }
      const pipeline::StepStats stats = executor.train_step(inputs);
      peak_in_flight = std::max(peak_in_flight, stats.peak_in_flight);
      peak_activation_bytes = std::max(peak_activation_bytes, stats.peak_activation_bytes);
      const auto t_opt = std::chrono::steady_clock::now();
      model.finalize_grads();
      ++step;
      loom_optimizer_step_args sa = loom::make<loom_optimizer_step_args>();
      sa.step = step;
      sa.lr = static_cast<float>(learning_rate(m, step));
      sa.beta1 = static_cast<float>(m.get_float("optimizer.beta1"));
      sa.beta2 = static_cast<float>(m.get_float("optimizer.beta2"));
      sa.eps = static_cast<float>(m.get_float("optimizer.eps"));
      sa.weight_decay = static_cast<float>(m.get_float("optimizer.weight_decay"));
      sa.clip_grad = static_cast<float>(m.get_float("optimizer.clip_grad"));
      loom_optimizer_step_result sr = loom::make<loom_optimizer_step_result>();
      loom::check(opt_api->step(opt, &rt, &sa, &sr));
      dev.synchronize();
      if (trace) trace->add(rank, "optimizer step " + std::to_string(step), "optimizer", t_opt);
      // The step's communication: the pipeline's p2p, the model's and the
      // optimizer's collectives (not the bookkeeping below, nor evaluation).
      runtime::CommStats step_comm = rt.comm_stats();

      // The step's loss: mean over microbatches (from the last stage) and the
      // auxiliary losses (summed over the stages' layers), averaged over dp;
      // then the stop flag.
      double reduced[2] = {stats.loss, stats.aux_loss};
      ppg.all_reduce(nullptr, reduced, reduced, 2, LOOM_DTYPE_F64);
      dp.all_reduce(nullptr, reduced, reduced, 2, LOOM_DTYPE_F64, LOOM_REDUCE_AVG);
      bool stop = stop_requested();
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

      StepRecord rec;
      rec.step = step;
      rec.loss = reduced[0];
      rec.aux_loss = reduced[1];
      rec.lr = sa.lr;
      rec.grad_norm = sr.grad_norm;
      rec.ms = ms;
      rec.tokens_per_s = tokens_step / (ms / 1000.0);
      rec.flops_per_s = flops_step / (ms / 1000.0);
      rec.mfu = peak_tflops > 0 ? rec.flops_per_s / (peak_tflops * 1e12 * plan.sizes.world) : 0;
      loom_memory_stats mem = rt.memory();
      rec.mem_current = mem.current_bytes;
      rec.mem_peak = mem.peak_bytes;
      rec.in_flight = stats.peak_in_flight;
      rec.comm = std::move(step_comm);
      rec.activation_bytes = stats.peak_activation_bytes;
      if (!stop && eval_every > 0 && (step % eval_every == 0 || step == steps) && !evaluate(rec)) stop = true;
      if (options.on_step) options.on_step(step, rank, model);

      if (leader) {
        window_ms += ms;
        ++window_steps;
        if (options.log && (step % log_every == 0 || step == steps || rec.evaluated || stop)) {
          const double avg_ms = window_ms / window_steps;
          std::ostream& os = *options.log;
          os << "step " << std::setw(5) << step << "/" << steps << " | loss " << std::fixed << std::setprecision(4)
             << rec.loss;
          if (rec.aux_loss != 0) os << " | aux loss " << std::setprecision(4) << rec.aux_loss;
          os << " | lr " << std::scientific << std::setprecision(2) << rec.lr << std::fixed
             << " | grad norm " << std::setprecision(3) << rec.grad_norm << " | " << human(tokens_step / (avg_ms / 1000))
             << " tok/s | " << std::setprecision(1) << avg_ms << " ms/step | " << human(flops_step / (avg_ms / 1000))
             << "FLOP/s";
          if (peak_tflops > 0) os << " (MFU " << std::setprecision(1) << 100 * rec.mfu << "%)";
          os << " | mem " << mib(rec.mem_current) << " (peak " << mib(rec.mem_peak) << ")";
          if (rec.evaluated) {
            os << " | val loss " << std::setprecision(4) << rec.val_loss;
            if (rec.exact_match >= 0) os << " | val exact-match " << std::setprecision(1) << 100 * rec.exact_match << "%";
          }
          os << std::endl;
          window_ms = 0;
          window_steps = 0;
        }
        if (metrics.is_open()) {  // a failed write (a full disk, /dev/full) stops the run
          metrics << step_json(rec) << "\n" << std::flush;
          if (!metrics)
            throw std::runtime_error("metrics file " + options.metrics_file + ": writing step " + std::to_string(step) +
                                     " failed (" + std::strerror(errno) + ")");
        }
        std::lock_guard<std::mutex> lock(result_mu);
        result.steps.push_back(rec);
        result.final_step = step;
      }
      // A non-finite loss or gradient norm (the same on every rank: both are reduced)
      // stops the run before this step's weights are saved, as Megatron-LM's
      // check for NaN in the loss and gradients does.
      if (!std::isfinite(rec.loss) || !std::isfinite(rec.grad_norm)) {
        std::ostringstream os;
        os << "step " << step << ": the loss is " << rec.loss << " and the gradient norm " << rec.grad_norm
           << "; training stops without saving this step's weights"
           << (!ckpt_dir.empty() ? " (the last checkpoint in " + ckpt_dir + " holds finite ones)" : std::string())
           << ". Usual causes: a learning rate too high (optimizer.lr = " << m.get_float("optimizer.lr")
           << "), no gradient clipping (optimizer.clip_grad), or data the model cannot represent";
        throw loom::Error(os.str());
      }
      auto interrupted = [&] {
        if (!leader) return;
        std::lock_guard<std::mutex> lock(result_mu);
        result.interrupted = true;
      };
      if (stop) {
        save(step);
        interrupted();
        return;
      }
      if (ckpt_every > 0 && step % ckpt_every == 0 && step < steps) {
        save(step);
        // A signal that came while the checkpoint was written: this step is saved, stop now.
        if (stop_requested()) {
          interrupted();
          return;
        }
      }
    }
    if (step > start_step) save(step);
  });
  if (!options.trace_file.empty()) pipeline::write_chrome_trace(options.trace_file, trace_events);
  return result;
}

}  // namespace loom::train
