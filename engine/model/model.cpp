#include "engine/model/model.hpp"

#include "engine/model/buffer_layout.hpp"
#include "engine/model/param_init.hpp"
#include "engine/model/param_plan.hpp"
#include "engine/model/tensor_view.hpp"
#include "engine/topology/rank_groups.hpp"

#include <glog/logging.h>

#include <algorithm>
#include <functional>
#include <numeric>

namespace loom::model {

int32_t model_dtype(const std::string& name) {
  if (name == "fp32") return LOOM_DTYPE_F32;
  if (name == "bf16") return LOOM_DTYPE_BF16;
  throw loom::Error("unsupported model dtype '" + name + "' (fp32 or bf16)", LOOM_CODE_INVALID_ARGUMENT);
}

namespace {
int64_t product(const std::vector<int64_t>& s) {
  return std::accumulate(s.begin(), s.end(), int64_t{1}, std::multiplies<int64_t>());
}

int tp_size(const runtime::RankRuntime& rank) { return rank.group_or_self("tp").size(); }

// Hidden states between layers: [seq, micro_batch, hidden] (this rank's slice of
// seq / cp rows under context parallelism), or its sequence shard [rows / tp,
// micro_batch, hidden] under sequence parallelism.
std::vector<int64_t> hidden_shape(const loom_model_dims& dims, int64_t context_rows, bool sequence_parallel, int tp) {
  return {sequence_parallel ? context_rows / tp : context_rows, dims.micro_batch, dims.hidden};
}
}  // namespace

Model::Model(const manifest::RunConfig& config, const plugins::Registry& registry, runtime::RankRuntime& rank,
             const loom_model_dims& dims, std::vector<ModelChunk> chunks, uint64_t seed)
    : rank_(rank),
      dims_(dims),
      bucket_size_(static_cast<size_t>(config.optimizer.bucket_size)),
      param_dtype_(model_dtype(config.device.param_dtype)),
      grad_dtype_(model_dtype(config.device.grad_dtype)),
      layers_(config, registry, rank, dims, chunks),
      capture_(rank, layers_, tp_size(rank)),
      sequence_parallel_(config.parallel.sequence_parallel && tp_size(rank) > 1),
      context_rows_(dims.seq_len / rank.group_or_self("cp").size()),
      hidden_(rank, hidden_shape(dims, context_rows_, sequence_parallel_, tp_size(rank)), param_dtype_,
              capture_.replays_steps()),
      seeds_(rank, capture_.replays_steps()),
      recompute_(layers_, hidden_) {
  build_buffers(seed);
  grad_a_ = loom::Buffer(&rank_, hidden_bytes());
  grad_b_ = loom::Buffer(&rank_, hidden_bytes());
  grad_recv_ = loom::Buffer(&rank_, hidden_bytes());
  // A recomputed forward runs inside the backward, between a layer's captured
  // forward and backward, on hidden states it re-creates (the schema refuses
  // exec.mode = "partial_graph"; this covers any exec plugin that replays).
  const bool any_recompute = std::any_of(layers_.begin(), layers_.end(), [](const Layer& l) { return l.recompute; });
  LOOM_REQUIRE(!(replays_steps() && any_recompute),
               "activation recomputation (model.recompute_granularity) cannot run under an exec plugin that replays "
               "captured steps (LOOM_EXEC_REPLAYS); set model.recompute_granularity = \"none\" or exec.mode = "
               "\"eager\"");
}

void Model::finalize_grads() {
  void* stream = rank_.dev().native_stream();
  char* g = grads_.get<char>();
  const size_t gsize = loom::dtype_size(grad_dtype_);
  // Under sequence parallelism a tp-duplicated parameter (layernorm, the bias
  // after a reduce-scatter, position embeddings) has seen only this rank's
  // sequence shard: its full gradient is the sum over the tp group.
  // Expert parameters split over an etp other than tp (MoE folding) hold other
  // experts on each tp rank, their tokens gathered by the ep exchange: no tp sum.
  const loom::Group tp = rank_.group_or_self("tp");
  const bool experts_fold_tp = rank_.group_or_self("etp").size() != tp.size();
  if (sequence_parallel_)
    for (const ParamEntry& e : entries_)
      if (e.duplicated && !(e.expert && experts_fold_tp))
        tp.all_reduce(stream, g + e.offset * gsize, g + e.offset * gsize, e.numel, grad_dtype_);
  // A word embedding tied across pipeline stages: the first stage's copy got the
  // lookup's gradient, the last stage's the output layer's; both need the sum.
  const loom::Group emb = rank_.group_or_self("embedding");
  if (emb.size() > 1)
    for (const ParamEntry& e : entries_)
      if (e.shared_across_stages)
        emb.all_reduce(stream, g + e.offset * gsize, g + e.offset * gsize, e.numel, grad_dtype_);
}

Model::~Model() {
  // The hidden states go first, then the layers, before the buffers they view.
  hidden_.clear();
  layers_.destroy();
}

void Model::build_buffers(uint64_t seed) {
  const loom::Group tp = rank_.group_or_self("tp");
  // The entries from the layers' declarations (tie dedupe, local shapes).
  std::vector<std::string> instances;
  std::vector<const loom_param_decl*> layer_decls;
  std::vector<size_t> counts;
  for (const Layer& l : layers_) {
    const loom_param_decl* d = nullptr;
    size_t n = 0;
    loom::check(l.api->params(l.handle, &d, &n));
    instances.push_back(l.spec.instance);
    layer_decls.push_back(d);
    counts.push_back(n);
  }
  const loom::Group ep = rank_.group_or_self("ep"), etp = rank_.group_or_self("etp");
  CollectedParams collected =
      collect_param_entries(instances, layer_decls, counts, tp.size(), ep.size(), etp.size());
  std::vector<int> chunk_of_layer, chunk_global_index;
  for (const Layer& l : layers_) chunk_of_layer.push_back(l.chunk);
  for (const LocalChunk& c : layers_.chunks()) chunk_global_index.push_back(c.global_index);
  place_entries_in_chunks(collected, chunk_of_layer, chunk_global_index, layers_.chunk(0).num_global);
  entries_ = std::move(collected.entries);
  const std::vector<DeclRef>& decls = collected.decls;
  const std::vector<size_t>& entry_of = collected.entry_of;
  // Placement: Megatron's layout (reverse order, aligned starts, dp-divisible
  // buckets), one buffer region per chunk and one for the expert parameters.
  const int cp = rank_.group_or_self("cp").size();
  layout_ = layout_entries(entries_, layers_.chunk_count(), rank_.group_or_self(topology::gradient_group_kind(cp)).size(),
                           bucket_size_);
  for (size_t i = 0; i < entries_.size(); ++i) entries_[i].offset = layout_.params[i].start;
  numel_ = layout_.numel;
  const size_t psize = loom::dtype_size(param_dtype_), gsize = loom::dtype_size(grad_dtype_);
  params_ = loom::Buffer(&rank_, numel_ * psize);
  grads_ = loom::Buffer(&rank_, numel_ * gsize);
  loom::Device dev = rank_.dev();
  dev.elementwise({.op = LOOM_EW_FILL, .n = static_cast<int64_t>(numel_), .out = params_.get(), .alpha = 0.f,
                   .dtype = param_dtype_, .out_dtype = param_dtype_});
  zero_grads();
  // A non-fp32 parameter is drawn in fp32 like every other and stored cast by the
  // device's EW_CAST (round to nearest even), through an fp32 staging buffer.
  size_t largest = 0;
  for (const ParamEntry& e : entries_) largest = std::max(largest, e.numel);
  loom::Buffer staging;
  if (param_dtype_ != LOOM_DTYPE_F32) staging = loom::Buffer(&rank_, largest * sizeof(float));

  // Initialise: the full tensor from (seed, name), this rank's slice of it: its
  // experts' block of dim 0 for an expert parameter, then its etp part (the tp
  // part of any other).
  for (const ParamEntry& e : entries_) {
    std::vector<float> full = init_full(e.decl.init, e.decl.init_std, dims_.num_layers, product(e.full_shape), seed,
                                        e.tie_key.empty() ? e.name : e.tie_key);
    std::vector<int64_t> shape = e.full_shape;
    if (e.expert && ep.size() > 1) {
      shape[0] /= ep.size();
      const size_t block = full.size() / static_cast<size_t>(ep.size());
      full = std::vector<float>(full.begin() + static_cast<std::ptrdiff_t>(block * static_cast<size_t>(ep.rank())),
                                full.begin() + static_cast<std::ptrdiff_t>(block * static_cast<size_t>(ep.rank() + 1)));
    }
    std::vector<float> local(e.numel);
    const loom::Group& split = e.expert ? etp : tp;
    take_slice(full, shape, e.decl.partition_dim, e.decl.partition_stride, split.size(), split.rank(), local.data());
    if (param_dtype_ == LOOM_DTYPE_F32) {
      dev.copy(params_.get<float>() + e.offset, local.data(), e.numel * sizeof(float), LOOM_COPY_HOST_TO_DEVICE);
    } else {
      dev.copy(staging.get(), local.data(), e.numel * sizeof(float), LOOM_COPY_HOST_TO_DEVICE);
      dev.elementwise({.op = LOOM_EW_CAST, .n = static_cast<int64_t>(e.numel), .x = staging.get(),
                       .out = params_.get<char>() + e.offset * psize, .dtype = LOOM_DTYPE_F32,
                       .out_dtype = param_dtype_});
      dev.synchronize();  // the staging buffer is reused by the next entry
    }
  }
  dev.synchronize();

  // Bind views in each layer's declaration order.
  views_.resize(layers_.size());
  for (size_t li = 0; li < layers_.size(); ++li) {
    const Layer& l = layers_[li];
    LayerViews& v = views_[li];
    for (size_t k = 0; k < decls.size(); ++k) {
      if (decls[k].layer != static_cast<int>(li)) continue;
      const ParamEntry& e = entries_[entry_of[k]];
      v.shapes.push_back(e.local_shape);
    }
    size_t j = 0;
    for (size_t k = 0; k < decls.size(); ++k) {
      if (decls[k].layer != static_cast<int>(li)) continue;
      const ParamEntry& e = entries_[entry_of[k]];
      v.params.push_back(device_view(rank_, params_.get<char>() + e.offset * psize, v.shapes[j], param_dtype_));
      v.grads.push_back(device_view(rank_, grads_.get<char>() + e.offset * gsize, v.shapes[j], grad_dtype_));
      ++j;
    }
    loom::check(l.api->bind(l.handle, v.params.data(), v.grads.data(), v.params.size()));
  }
}

std::vector<loom_param_info> Model::param_infos() const {
  std::vector<loom_param_info> out;
  for (const ParamEntry& e : entries_) {
    loom_param_info i = loom::make<loom_param_info>();
    i.name = e.name.c_str();
    i.offset = e.offset;
    i.numel = e.numel;
    i.no_weight_decay = e.decl.no_weight_decay;
    i.duplicated = e.duplicated ? 1 : 0;
    out.push_back(i);
  }
  return out;
}

void Model::zero_grads() {
  rank_.dev().elementwise({.op = LOOM_EW_FILL, .n = static_cast<int64_t>(numel_), .out = grads_.get(),
                           .alpha = 0.f, .dtype = grad_dtype_, .out_dtype = grad_dtype_});
}

std::vector<int32_t> Model::counted_elsewhere() const {
  std::vector<int32_t> out;
  for (const ParamEntry& e : entries_)
    out.push_back(e.shared_across_stages && layers_.chunk(e.chunk).global_index != 0 ? 1 : 0);
  return out;
}

std::vector<int32_t> Model::expert_flags() const {
  std::vector<int32_t> out;
  for (const ParamEntry& e : entries_) out.push_back(e.expert ? 1 : 0);
  return out;
}

bool Model::has_expert_params() const {
  return std::any_of(entries_.begin(), entries_.end(), [](const ParamEntry& e) { return e.expert; });
}

void* Model::chunk_input(int c, int mb) {
  LOOM_REQUIRE(!is_first_global(c), "chunk " << chunk_global_index(c) << " is the first: it takes tokens, not a hidden state");
  if (hidden_.count(c, mb) != 0) return hidden_.at(c, mb, 0);
  return hidden_.push(c, mb);
}

const void* Model::forward_chunk(int c, int mb, const int32_t* tokens, const int32_t* targets, bool training,
                                 uint64_t dropout_seed, float* loss_sum, int64_t* loss_count, int32_t* predictions,
                                 float* aux_loss) {
  const LocalChunk& chunk = layers_.chunk(c);
  const bool first = chunk.is_first_global(), last = chunk.is_last_global();
  const size_t held_count = hidden_.count(c, mb);
  LOOM_REQUIRE(first ? held_count == 0 : held_count == 1,
               "forward of chunk " << chunk.global_index << ", microbatch " << mb
                                   << (first ? " ran twice" : ": its input was not received (chunk_input) or it ran twice"));
  const ForwardInputs in{tokens, targets, dropout_seed};
  bool any_recomputed = false;
  void* held = first ? nullptr : hidden_.at(c, mb, 0);  // the latest hidden state
  for (size_t i = chunk.first_layer; i < chunk.end_layer; ++i) {
    const bool has_input = held != nullptr;
    const bool has_output = !(last && i + 1 == chunk.end_layer);
    DLTensor input{}, output{};
    if (has_input) input = hidden_.view(held);
    if (has_output) {
      held = hidden_.push(c, mb);
      output = hidden_.view(held);
    }
    run_forward(i, mb, has_input ? &input : nullptr, has_output ? &output : nullptr, in, loss_sum, loss_count,
                predictions, aux_loss, training);
    if (training && layers_[i].recompute) {  // keep only the group's input; backward runs the group's forward again
      recompute_.drop_after_forward(c, mb, i);
      any_recomputed = true;
    }
  }
  if (any_recomputed) recompute_.keep_inputs(c, mb, in);
  return last ? nullptr : held;
}

void Model::run_forward(size_t i, int mb, const DLTensor* input, DLTensor* output, const ForwardInputs& in,
                        float* loss_sum, int64_t* loss_count, int32_t* predictions, float* aux_loss, bool training) {
  std::vector<int64_t> tok_shape = {context_rows_, dims_.micro_batch};
  DLTensor tok = device_view(rank_, const_cast<int32_t*>(in.tokens), tok_shape);
  tok.dtype = {kDLInt, 32, 1};
  DLTensor tgt = device_view(rank_, const_cast<int32_t*>(in.targets), tok_shape);
  tgt.dtype = {kDLInt, 32, 1};
  const uint64_t* seed_device = training ? seeds_.slot(mb, in.dropout_seed) : nullptr;
  const Layer& l = layers_[i];
  loom_layer_fwd_args a = loom::make<loom_layer_fwd_args>();
  a.microbatch = mb;
  a.training = training ? 1 : 0;
  a.input = input;
  a.output = output;
  a.tokens = &tok;
  a.targets = &tgt;
  a.loss_sum = loss_sum;
  a.loss_count = loss_count;
  a.dropout_seed = in.dropout_seed;
  a.dropout_seed_device = seed_device;
  a.predictions = predictions;
  a.aux_loss = training ? aux_loss : nullptr;
  // A recomputing layer's forward is not captured: its backward pair runs it again.
  const bool capture_ok = training && seed_device != nullptr && !l.recompute;
  a.step_key = capture_.step_key(i, mb, false);
  a.substeps_capturable = capture_.may_capture_parts(i, capture_ok) ? 1 : 0;
  capture_.run_step(i, mb, false, capture_ok, [&] { loom::check(l.api->forward(l.handle, &rank_, &a)); });
}

const void* Model::backward_chunk(int c, int mb, float loss_scale, float aux_loss_scale) {
  const LocalChunk& chunk = layers_.chunk(c);
  LOOM_REQUIRE(hidden_.count(c, mb) != 0,
               "backward of chunk " << chunk.global_index << ", microbatch " << mb << " without its forward");
  const bool first = chunk.is_first_global();
  loom::Buffer* grad_out = chunk.is_last_global() ? nullptr : &grad_recv_;
  loom::Buffer* grad_in = &grad_a_;
  // A recomputed layer's loss and aux outputs were counted by its first forward.
  const Recomputation::LayerForward forward_again = [&](size_t j, const DLTensor* input, DLTensor* output,
                                                        const ForwardInputs& in) {
    float loss_sum = 0;
    int64_t loss_count = 0;
    run_forward(j, mb, input, output, in, &loss_sum, &loss_count, nullptr, nullptr, true);
  };
  for (size_t i = chunk.end_layer; i-- > chunk.first_layer;) {
    const Layer& l = layers_[i];
    if (recompute_.ends_group(i)) recompute_.run_group_again(c, mb, i, forward_again);
    const bool has_grad_input = !(first && i == chunk.first_layer);
    DLTensor gout{}, gin{};
    if (grad_out) gout = hidden_.view(grad_out->get());
    if (has_grad_input) gin = hidden_.view(grad_in->get());
    loom_layer_bwd_args a = loom::make<loom_layer_bwd_args>();
    a.microbatch = mb;
    a.grad_output = grad_out ? &gout : nullptr;
    a.grad_input = has_grad_input ? &gin : nullptr;
    a.loss_scale = loss_scale;
    a.aux_loss_scale = aux_loss_scale;
    // Captured exactly when its forward could be (a replayed backward needs the
    // activations of a replayed forward): the microbatch's seed slot exists.
    const bool capture_ok = seeds_.has_slot(mb) && !l.recompute;
    a.step_key = capture_.step_key(i, mb, true);
    a.substeps_capturable = capture_.may_capture_parts(i, capture_ok) ? 1 : 0;
    capture_.run_step(i, mb, true, capture_ok, [&] { loom::check(l.api->backward(l.handle, &rank_, &a)); });
    grad_out = grad_in;
    grad_in = grad_in == &grad_a_ ? &grad_b_ : &grad_a_;
    if (recompute_.begins_group(i)) recompute_.drop_group_states(c, mb, i);
  }
  recompute_.forget(c, mb);
  hidden_.give_back(c, mb);
  return first ? nullptr : grad_out->get();
}

void Model::release_chunk(int c, int mb) {
  const LocalChunk& chunk = layers_.chunk(c);
  for (size_t i = chunk.first_layer; i < chunk.end_layer; ++i)
    if (layers_[i].api->release) layers_[i].api->release(layers_[i].handle, mb);
  recompute_.forget(c, mb);
  hidden_.give_back(c, mb);
}

void Model::forward(int mb, const int32_t* tokens, const int32_t* targets, bool training, uint64_t dropout_seed,
                    float* loss_sum, int64_t* loss_count, int32_t* predictions, float* aux_loss) {
  const void* out = nullptr;
  for (int c = 0; c < static_cast<int>(chunk_count()); ++c) {
    if (c > 0) rank_.dev().copy(chunk_input(c, mb), out, hidden_bytes(), LOOM_COPY_DEVICE_TO_DEVICE);
    out = forward_chunk(c, mb, tokens, targets, training, dropout_seed, loss_sum, loss_count, predictions, aux_loss);
  }
  if (!training) release(mb);
}

void Model::backward(int mb, float loss_scale, float aux_loss_scale) {
  for (int c = static_cast<int>(chunk_count()); c-- > 0;) {
    const void* grad = backward_chunk(c, mb, loss_scale, aux_loss_scale);
    if (c > 0) rank_.dev().copy(chunk_grad_output(), grad, hidden_bytes(), LOOM_COPY_DEVICE_TO_DEVICE);
  }
}

void Model::release(int mb) {
  for (int c = 0; c < static_cast<int>(chunk_count()); ++c) release_chunk(c, mb);
}

// The hidden state after each layer, but those recompute groups drop.
uint64_t Model::activation_bytes() const {
  return layers_.saved_activation_bytes() + static_cast<uint64_t>(recompute_.kept_hidden_states()) * hidden_bytes();
}

}  // namespace loom::model
