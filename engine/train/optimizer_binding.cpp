#include "engine/train/optimizer_binding.hpp"

#include "engine/plugins/registry.hpp"
#include "engine/topology/rank_groups.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace loom::train {

namespace {

// How far from min_lr (0) to lr (1) a decay `shape` is when `ratio` of it is done,
// as Megatron-LM's OptimizerParamScheduler computes it.
double decay_coefficient(const std::string& shape, double ratio) {
  if (shape == "linear") return 1.0 - ratio;
  if (shape == "cosine") return 0.5 * (1.0 + std::cos(M_PI * ratio));
  if (shape == "exponential") return 2.0 * std::pow(0.5, ratio) - 1.0;
  if (shape == "minus_sqrt") return 1.0 - std::sqrt(ratio);
  throw std::logic_error("no learning-rate decay shape '" + shape + "' (the manifest schema lists them)");
}

}  // namespace

double learning_rate(const manifest::RunConfig& config, SchedulePoint at) {
  return learning_rate(config.optimizer, manifest::schedule_marks(config), at);
}

double learning_rate(const manifest::RunConfig::Optimizer& o, const manifest::ScheduleMarks& marks, SchedulePoint at) {
  const int64_t now = marks.position(at.step, at.samples);
  const double warmup = marks.warmup, position = static_cast<double>(now);
  const int64_t decay = marks.decay_end;
  if (warmup > 0 && position <= warmup) return o.lr * position / warmup;
  if (o.decay_style == "constant") return o.lr;
  if (now > decay) return o.min_lr;
  if (o.decay_style == "inverse-square-root")
    return std::max(o.min_lr, o.lr * std::sqrt(std::max(warmup, 1.0) / std::max(position, 1.0)));
  double coefficient = 1.0;
  if (o.decay_style == "wsd") {
    const int64_t anneal_start = decay - marks.wsd_decay;
    if (now > anneal_start)
      coefficient = decay_coefficient(o.wsd_decay_style,
                                      static_cast<double>(now - anneal_start) / static_cast<double>(marks.wsd_decay));
  } else {  // warmup < now <= decay here, so the decay is longer than the warmup
    coefficient = decay_coefficient(o.decay_style, (position - warmup) / (static_cast<double>(decay) - warmup));
  }
  return o.min_lr + coefficient * (o.lr - o.min_lr);
}

double weight_decay(const manifest::RunConfig::Optimizer& o, const manifest::ScheduleMarks& marks, SchedulePoint at) {
  if (o.weight_decay_incr_style == "constant") return o.weight_decay;
  const int64_t now = marks.position(at.step, at.samples);
  if (now > marks.run_length) return o.end_weight_decay;
  const double ratio = static_cast<double>(now) / static_cast<double>(std::max<int64_t>(1, marks.run_length));
  const double coefficient =
      o.weight_decay_incr_style == "linear" ? ratio : 0.5 * (std::cos(M_PI * (1.0 - ratio)) + 1.0);
  return o.start_weight_decay + coefficient * (o.end_weight_decay - o.start_weight_decay);
}

OptimizerBinding::OptimizerBinding(const RunPlan& plan, runtime::RankRuntime& rank, model::Model& model)
    : config_(plan.config), rank_(rank), api_(plan.optimizer->optimizer()) {
  const std::vector<loom_param_info> infos = model.param_infos();
  loom_optimizer_create_args args = loom::make<loom_optimizer_create_args>();
  args.params = model.params();
  args.grads = model.grads();
  args.numel = model.numel();
  args.param_dtype = model.param_dtype();
  args.grad_dtype = model.grad_dtype();
  args.infos = infos.data();
  args.num_params = infos.size();
  // Parameters are replicated over dp (and cp): the strategy averages over both.
  args.dp = rank.group_or_self(topology::gradient_group_kind(plan.sizes.cp)).raw();
  args.tp = rank.group_or_self("tp").raw();
  args.pp = rank.group_or_self("pp").raw();
  std::vector<size_t> bucket_offsets;
  for (const model::Range& b : model.layout().buckets) bucket_offsets.push_back(b.start);
  bucket_offsets.push_back(model.layout().numel);
  args.bucket_offsets = bucket_offsets.data();
  args.num_buckets = model.layout().buckets.size();
  const std::vector<int32_t> counted_elsewhere = model.counted_elsewhere();
  args.counted_elsewhere = counted_elsewhere.data();
  // Expert parameters (ABI 1.4) go to a strategy that reduces them over edp (and
  // etp, when the run folds MoE parallelism); with ep = 1, edp is dp and any
  // strategy reduces them right.
  const uint64_t features =
      LOOM_HAS_SLOT(api_, loom_optimizer_api, features) ? api_->features : 0;
  const std::vector<int32_t> expert = model.expert_flags();
  if ((features & LOOM_OPTIMIZER_EXPERT_PARALLEL) != 0) {
    args.expert = expert.data();
    args.ep = rank.group_or_self("ep").raw();
    args.edp = rank.group_or_self("edp").raw();
    if ((features & LOOM_OPTIMIZER_EXPERT_FOLDING) != 0) args.etp = rank.group_or_self("etp").raw();
  }
  plugins::OptionValues options(&plan.config.optimizer.options, plan.optimizer->options);
  loom::check(api_->create(options.raw(), &rank, &args, &handle_));
  all_params_.resize(infos.size());
  for (size_t i = 0; i < all_params_.size(); ++i) all_params_[i] = i;
}

OptimizerBinding::~OptimizerBinding() {
  if (handle_ != nullptr) api_->destroy(handle_);
}

void OptimizerBinding::grads_ready(const std::vector<size_t>& params) {
  if (!LOOM_HAS_SLOT(api_, loom_optimizer_api, grads_ready) || api_->grads_ready == nullptr) return;
  loom::check(api_->grads_ready(handle_, &rank_, params.data(), params.size()));
}

void OptimizerBinding::params_needed(const std::vector<size_t>& params) {
  if (!gather_running_) return;
  loom::check(api_->params_needed(handle_, &rank_, params.data(), params.size()));
}

void OptimizerBinding::params_needed_all() {
  params_needed(all_params_);
  gather_running_ = false;
}

loom_optimizer_step_result OptimizerBinding::step(int64_t step, double lr, double weight_decay) {
  const manifest::RunConfig::Optimizer& o = config_.optimizer;
  loom_optimizer_step_args args = loom::make<loom_optimizer_step_args>();
  args.step = step;
  args.lr = static_cast<float>(lr);
  args.beta1 = static_cast<float>(o.beta1);
  args.beta2 = static_cast<float>(o.beta2);
  args.eps = static_cast<float>(o.eps);
  args.weight_decay = static_cast<float>(weight_decay);
  args.clip_grad = static_cast<float>(o.clip_grad);
  // Checked before launch: only a strategy with LOOM_OPTIMIZER_OVERLAP_PARAM_GATHER.
  args.overlap_param_gather = o.overlap_param_gather ? 1 : 0;
  loom_optimizer_step_result result = loom::make<loom_optimizer_step_result>();
  loom::check(api_->step(handle_, &rank_, &args, &result));
  gather_running_ = o.overlap_param_gather;
  return result;
}

std::vector<char> OptimizerBinding::save_state() const {
  size_t bytes = 0;
  loom::check(api_->state_size(handle_, &bytes));
  std::vector<char> state(bytes);
  loom::check(api_->state_save(handle_, state.data(), bytes));
  return state;
}

void OptimizerBinding::load_state(const std::vector<char>& state) {
  loom::check(api_->state_load(handle_, state.data(), state.size()));
}

}  // namespace loom::train
