#include "engine/train/preflight.hpp"

#include <boost/filesystem.hpp>

#include "engine/model/layers.hpp"
#include "engine/model/param_buffers.hpp"
#include "engine/train/data.hpp"
#include "engine/train/generation.hpp"

#include <loom/cpp/core.hpp>

#include <vector>

namespace loom::train {
namespace {

// Expert parallelism splits expert parameters: a model without any would only get ep
// times the ranks to do the same work.
void check_experts(const RunPlan& plan, const MemoryPlan& memory) {
  if (plan.sizes.ep <= 1) return;
  for (const RankMemory& r : memory.ranks)
    if (r.expert_start < r.buffer_numel) return;
  throw loom::Error("parallel.ep = " + std::to_string(plan.sizes.ep) +
                    " but no layer of the model has expert parameters (a dense model); set parallel.ep = 1 "
                    "or use a layer with experts (e.g. model.block = [\"attention\", \"moe\"])");
}

// The optimizer strategy can take this model: what its ABI version and feature bits
// say about tied copies on the last pipeline stage and about expert parameters.
void check_optimizer(const RunPlan& plan, const MemoryPlan& memory) {
  const plugins::LoadedPlugin& p = *plan.optimizer;
  bool counted_elsewhere = false, experts = false;
  for (const RankMemory& r : memory.ranks) {
    counted_elsewhere |= r.counted_elsewhere;
    experts |= r.expert_start < r.buffer_numel;
  }
  if (p.abi_minor < 1 && counted_elsewhere)
    throw loom::Error("optimizer plugin parallel/" + p.name +
                      " was built for plugin ABI 1.0, which cannot tell it that the tied word embedding on the last "
                      "pipeline stage is a copy (it would count its gradient twice); rebuild it against ABI 1.1 or "
                      "set model.tie_embeddings = false");
  const loom_optimizer_api* api = p.optimizer();
  const uint64_t features = LOOM_HAS_SLOT(api, loom_optimizer_api, features) ? api->features : 0;
  // With ep = 1, edp is dp and any strategy reduces expert parameters right.
  const bool expert_parallel = (features & LOOM_OPTIMIZER_EXPERT_PARALLEL) != 0;
  if (plan.sizes.ep > 1 && experts && !expert_parallel)
    throw loom::Error("optimizer plugin parallel/" + p.name +
                      " cannot reduce expert parameters over the expert data-parallel group (it does not "
                      "advertise LOOM_OPTIMIZER_EXPERT_PARALLEL, ABI 1.4); use optimizer.strategy = \"ddp\" or "
                      "\"distributed\", or parallel.ep = 1");
  // Overlap (ABI 1.15): the strategy must take the announcements that drive it.
  if (plan.config.optimizer.overlap_grad_reduce &&
      (!LOOM_HAS_SLOT(api, loom_optimizer_api, grads_ready) || api->grads_ready == nullptr))
    throw loom::Error("optimizer plugin parallel/" + p.name +
                      " cannot overlap gradient reduction with the backward (it has no grads_ready, ABI 1.15); "
                      "set optimizer.overlap_grad_reduce = false or use optimizer.strategy = \"ddp\" or "
                      "\"distributed\"");
  const bool gathers_later = (features & LOOM_OPTIMIZER_OVERLAP_PARAM_GATHER) != 0 &&
                            LOOM_HAS_SLOT(api, loom_optimizer_api, params_needed) && api->params_needed != nullptr;
  if (plan.config.optimizer.overlap_param_gather && !gathers_later)
    throw loom::Error("optimizer plugin parallel/" + p.name +
                      " cannot leave its parameter all-gather running after the step (it does not advertise "
                      "LOOM_OPTIMIZER_OVERLAP_PARAM_GATHER, ABI 1.16; ddp updates every parameter in place and "
                      "gathers nothing); set optimizer.overlap_param_gather = false or use optimizer.strategy = "
                      "\"distributed\"");
  // MoE folding (etp != tp, ABI 1.5): only a strategy that reads etp gets such a run.
  const bool folding = expert_parallel && (features & LOOM_OPTIMIZER_EXPERT_FOLDING) != 0;
  if (experts && plan.sizes.experts_fold_tp() && !folding)
    throw loom::Error("optimizer plugin parallel/" + p.name + " cannot take expert parameters split "
                      "over parallel.etp = " + std::to_string(plan.sizes.expert_tp()) +
                      " rather than parallel.tp = " + std::to_string(plan.sizes.tp) +
                      " (it does not advertise LOOM_OPTIMIZER_EXPERT_FOLDING, ABI 1.5); use optimizer.strategy = "
                      "\"ddp\" or \"distributed\", or parallel.etp = 0 (same as tp)");
}

// What every layer's validate is told of the run: the run's device plugin (its
// memory type, features and ops, not the CPU device memory is planned on), the
// dtypes and the parallel layout.
loom_layer_validate_args validate_args(const RunPlan& plan, const loom_model_dims& dims) {
  const manifest::RunConfig& config = plan.config;
  const loom_device_api* dev = plan.device->device();
  loom_layer_validate_args a = loom::make<loom_layer_validate_args>();
  a.device_type = dev->dl_device_type;
  a.dims = &dims;
  a.param_dtype = model::model_dtype(config.device.param_dtype);
  a.act_dtype = a.param_dtype;  // hidden states and activations are in the parameters' dtype
  a.grad_dtype = model::model_dtype(config.device.grad_dtype);
  a.tp = plan.sizes.tp;
  a.cp = plan.sizes.cp;
  a.ep = plan.sizes.ep;
  a.etp = static_cast<int32_t>(plan.sizes.expert_tp());
  a.pp = plan.sizes.pp;
  a.dp = plan.dp;
  a.sequence_parallel = config.parallel.sequence_parallel ? 1 : 0;
  a.device_features = LOOM_HAS_SLOT(dev, loom_device_api, features) ? dev->features : 0;
  a.device_ops = dev->ops;
  return a;
}

// Each layer's own check of the configuration (loom_layer_api.validate, ABI 1.12),
// before any is created: a plugin's constraint is reported here, not at its first step.
void validate_layers(const RunPlan& plan, int64_t vocab) {
  const loom_model_dims dims = model::model_dims(plan.config, vocab, plan.sizes.tp);
  const loom_layer_validate_args run = validate_args(plan, dims);
  for (const model::LayerSpec& spec : plan.layers) model::validate_layer(plan.config, *plan.registry, spec, run);
}

// checkpoint.init_weights names a directory (its contents are read and checked when a
// run that does not resume starts: loom run).
void check_init_weights_path(const std::string& path) {
  if (path.empty()) return;
  boost::system::error_code ec;
  if (!boost::filesystem::is_directory(path, ec))
    throw loom::Error("checkpoint.init_weights = \"" + path + "\" is not a directory (a Hugging Face model directory "
                      "or a loom checkpoint)");
}

}  // namespace

Preflight preflight(const RunPlan& plan, int ranks_in_process) {
  const manifest::RunConfig& config = plan.config;
  Preflight out;
  out.data = make_data_source(config);
  const DataSource* data = out.data.get();
  out.vocab = config.model.vocab_size > 0 ? config.model.vocab_size : data->vocab_size();
  if (out.vocab < data->vocab_size())
    throw DataError("model.vocab_size = " + std::to_string(out.vocab) + " is smaller than the vocabulary of the data (" +
                    data->describe() + ")");
  document_end_for(config, out.vocab);  // the document resets' token exists, before launch
  const int64_t seq = config.model.seq_length;
  // A file too short for a sequence fails here, before launch.
  data->check_split(Split::Train, seq);
  if (config.run.eval_every > 0 || config.run.sample_every > 0) data->check_split(Split::Validation, seq);

  validate_layers(plan, out.vocab);
  if (config.run.sample_every > 0) require_kv_cache_layers(plan);  // samples are generated
  check_init_weights_path(plan.config.checkpoint.init_weights);
  out.memory = plan_memory(plan, out.vocab);
  check_experts(plan, out.memory);
  check_optimizer(plan, out.memory);
  // The ranks share the device's memory when it offers each less as more share it.
  const uint64_t capacity = device_capacity(plan, ranks_in_process);
  const bool shared = ranks_in_process > 1 && capacity != device_capacity(plan, 1);
  out.memory_problem = memory_problem(out.memory, capacity, plan.device->key(), shared ? ranks_in_process : 1);
  return out;
}

}  // namespace loom::train
