#include "engine/model/model.hpp"

#include "engine/model/grad_finalize.hpp"
#include "engine/model/tensor_view.hpp"
#include "engine/plugins/registry.hpp"

#include <algorithm>

namespace loom::model {

namespace {
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
      layers_(config, registry, rank, dims, chunks),
      buffers_(rank, layers_, dims.num_layers, static_cast<size_t>(config.optimizer.bucket_size),
               model_dtype(config.device.param_dtype), model_dtype(config.device.grad_dtype), seed,
               static_cast<float>(config.model.init_method_std)),
      states_(layers_),
      sequence_parallel_(config.parallel.sequence_parallel && tp_size(rank) > 1),
      finalizer_(rank, buffers_, layers_.size(), sequence_parallel_),
      context_rows_(dims.seq_len / rank.group_or_self("cp").size()),
      capture_(rank, layers_, tp_size(rank)),
      hidden_(rank, hidden_shape(dims, context_rows_, sequence_parallel_, tp_size(rank)),
              buffers_.param_dtype(), capture_.replays_steps()),
      seeds_(rank, capture_.replays_steps()),
      recompute_(layers_, hidden_),
      grad_a_(&rank, hidden_.bytes()),
      grad_b_(&rank, hidden_.bytes()),
      grad_recv_{loom::Buffer(), loom::Buffer()} {
  // A recomputed forward runs inside the backward, between a layer's captured
  // forward and backward, on hidden states it re-creates (the schema refuses
  // exec.mode = "partial_graph"; this covers any exec plugin that replays).
  const bool any_recompute = std::any_of(layers_.begin(), layers_.end(), [](const Layer& l) { return l.recompute; });
  LOOM_REQUIRE(!(capture_.replays_steps() && any_recompute),
               "activation recomputation (model.recompute_granularity) cannot run under an exec plugin that replays "
               "captured steps (LOOM_EXEC_REPLAYS); set model.recompute_granularity = \"none\" or exec.mode = "
               "\"eager\"");
}

// The hidden states go first, then the layers, while the parameter buffers they
// view still exist.
Model::~Model() {
  hidden_.clear();
  layers_.destroy();
}

void* Model::chunk_grad_output(int slot) {
  LOOM_REQUIRE(slot == 0 || slot == 1, "chunk_grad_output: slot " << slot << " (0 or 1)");
  loom::Buffer& b = grad_recv_[slot];
  if (!b) b = loom::Buffer(&rank_, hidden_.bytes());
  return b.get();
}

uint64_t Model::gradient_buffer_bytes() const {
  return grad_a_.bytes() + grad_b_.bytes() + grad_recv_[0].bytes() + grad_recv_[1].bytes();
}

void* Model::chunk_input(int c, int mb) {
  LOOM_REQUIRE(!is_first_global(c), "chunk " << chunk_global_index(c) << " is the first: it takes tokens, not a hidden state");
  if (hidden_.count(c, mb) != 0) return hidden_.at(c, mb, 0);
  return hidden_.push(c, mb);
}

const void* Model::forward_chunk(int c, int mb, const int32_t* tokens, const int32_t* targets, bool training,
                                 uint64_t dropout_seed, float* loss_sum, int64_t* loss_count, int32_t* predictions,
                                 float* aux_loss, const int32_t* document_start, const int32_t* position_ids) {
  const LocalChunk& chunk = layers_.chunk(c);
  const bool first = chunk.is_first_global(), last = chunk.is_last_global();
  const size_t held_count = hidden_.count(c, mb);
  LOOM_REQUIRE(first ? held_count == 0 : held_count == 1,
               "forward of chunk " << chunk.global_index << ", microbatch " << mb
                                   << (first ? " ran twice" : ": its input was not received (chunk_input) or it ran twice"));
  const ForwardInputs in{tokens, targets, dropout_seed, document_start, position_ids};
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
    if (params_needed_ && mb == 0) params_needed_(buffers_.layer_entries(i));
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
  DLTensor tok = ids_view(rank_, in.tokens, tok_shape), tgt = ids_view(rank_, in.targets, tok_shape);
  const uint64_t* seed_device = training ? seeds_.slot(mb, in.dropout_seed) : nullptr;
  const Layer& l = layers_[i];
  loom_layer_fwd_args a = loom::make<loom_layer_fwd_args>();
  a.microbatch = mb;
  a.training = training ? 1 : 0;
  a.input = input;
  a.output = output;
  a.tokens = &tok;
  a.targets = &tgt;
  // Documents packed in the sequences (data.reset_*), laid out as the tokens; every
  // layer has LOOM_LAYER_DOCUMENTS (run_plan checks).
  DLTensor doc = ids_view(rank_, in.document_start, tok_shape), pos = ids_view(rank_, in.position_ids, tok_shape);
  a.document_start = in.document_start ? &doc : nullptr;
  a.position_ids = in.position_ids ? &pos : nullptr;
  a.loss_sum = loss_sum;
  a.loss_count = loss_count;
  a.dropout_seed = in.dropout_seed;
  a.dropout_seed_device = seed_device;
  a.predictions = predictions;
  a.aux_loss = training ? aux_loss : nullptr;
  // A recomputing layer's forward is not captured: its backward pair runs it again.
  const bool capture_ok = training && seed_device != nullptr && !l.recompute && steps_capturable_;
  a.step_key = capture_.step_key(i, mb, false);
  a.substeps_capturable = capture_.may_capture_parts(i, capture_ok) ? 1 : 0;
  capture_.run_step(i, mb, false, capture_ok,
                    [&] { check_layer_call(l.api->forward(l.handle, &rank_, &a), l, "forward"); });
}

const void* Model::backward_chunk(int c, int mb, float loss_scale, float aux_loss_scale, bool last_microbatch,
                                  int grad_slot) {
  const LocalChunk& chunk = layers_.chunk(c);
  LOOM_REQUIRE(hidden_.count(c, mb) != 0,
               "backward of chunk " << chunk.global_index << ", microbatch " << mb << " without its forward");
  const bool first = chunk.is_first_global();
  if (!chunk.is_last_global()) chunk_grad_output(grad_slot);  // checks the slot, allocates it once
  loom::Buffer* grad_out = chunk.is_last_global() ? nullptr : &grad_recv_[grad_slot];
  loom::Buffer* grad_in = &grad_a_;
  // A recomputed layer's loss and aux outputs were counted by its first forward.
  const Recomputation::LayerForward forward_again = [&](size_t j, const DLTensor* input, DLTensor* output,
                                                        const ForwardInputs& in) {
    float loss_sum = 0;
    int64_t loss_count = 0;
    run_forward(j, mb, input, output, in, &loss_sum, &loss_count, nullptr, nullptr, true);
  };
  for (size_t i = chunk.end_layer; i-- > chunk.first_layer;) {
    if (recompute_.ends_group(i)) recompute_.run_group_again(c, mb, i, forward_again);
    const bool has_grad_input = !(first && i == chunk.first_layer);
    DLTensor gout{}, gin{};
    if (grad_out) gout = hidden_.view(grad_out->get());
    if (has_grad_input) gin = hidden_.view(grad_in->get());
    run_backward(i, mb, grad_out ? &gout : nullptr, has_grad_input ? &gin : nullptr, loss_scale, aux_loss_scale);
    if (last_microbatch) finalizer_.layer_done(i);
    grad_out = grad_in;
    grad_in = grad_in == &grad_a_ ? &grad_b_ : &grad_a_;
    if (recompute_.begins_group(i)) recompute_.drop_group_states(c, mb, i);
  }
  recompute_.forget(c, mb);
  hidden_.give_back(c, mb);
  return first ? nullptr : grad_out->get();
}

void Model::run_backward(size_t i, int mb, const DLTensor* grad_output, DLTensor* grad_input, float loss_scale,
                         float aux_loss_scale) {
  const Layer& l = layers_[i];
  loom_layer_bwd_args a = loom::make<loom_layer_bwd_args>();
  a.microbatch = mb;
  a.grad_output = grad_output;
  a.grad_input = grad_input;
  a.loss_scale = loss_scale;
  a.aux_loss_scale = aux_loss_scale;
  // Captured exactly when its forward could be (a replayed backward needs the
  // activations of a replayed forward): the microbatch's seed slot exists.
  const bool capture_ok = seeds_.has_slot(mb) && !l.recompute && steps_capturable_;
  a.step_key = capture_.step_key(i, mb, true);
  a.substeps_capturable = capture_.may_capture_parts(i, capture_ok) ? 1 : 0;
  capture_.run_step(i, mb, true, capture_ok,
                    [&] { check_layer_call(l.api->backward(l.handle, &rank_, &a), l, "backward"); });
}

size_t Model::hidden_bytes(int64_t rows, int64_t batch) const {
  return static_cast<size_t>(rows * batch * dims_.hidden) * dtype_size(act_dtype());
}

const void* Model::forward_cached(int c, int64_t rows, int64_t batch, int64_t position_offset, const int32_t* tokens,
                                  const void* input, float* logits, const int32_t* document_start,
                                  const int32_t* position_ids) {
  const LocalChunk& chunk = layers_.chunk(c);
  LOOM_REQUIRE(chunk.is_first_global() == (input == nullptr),
               "generation: chunk " << chunk.global_index << (input ? " takes tokens, not a hidden state" : " needs its input"));
  const size_t bytes = hidden_bytes(rows, batch);
  for (loom::Buffer& b : generated_)
    if (b.bytes() < bytes) b = loom::Buffer(&rank_, bytes);
  const std::vector<int64_t> shape = {rows, batch, dims_.hidden}, tok_shape = {rows, batch};
  DLTensor tok = ids_view(rank_, tokens, tok_shape), doc = ids_view(rank_, document_start, tok_shape),
           pos = ids_view(rank_, position_ids, tok_shape);
  const void* held = input;
  int turn = held == generated_[0].get() ? 1 : 0;  // never write over the input before it is read
  for (size_t i = chunk.first_layer; i < chunk.end_layer; ++i) {
    const bool has_output = !(chunk.is_last_global() && i + 1 == chunk.end_layer);
    DLTensor in{}, out{};
    if (held) in = device_view(rank_, const_cast<void*>(held), shape, act_dtype());
    void* next = has_output ? generated_[turn].get() : nullptr;
    if (has_output) out = device_view(rank_, next, shape, act_dtype());
    loom_layer_fwd_args a = loom::make<loom_layer_fwd_args>();
    a.training = 0;
    a.input = held ? &in : nullptr;
    a.output = has_output ? &out : nullptr;
    a.tokens = &tok;
    a.kv_cache = 1;
    a.position_offset = position_offset;
    a.document_start = document_start ? &doc : nullptr;
    a.position_ids = position_ids ? &pos : nullptr;
    a.logits = has_output ? nullptr : logits;
    const Layer& l = layers_[i];
    check_layer_call(l.api->forward(l.handle, &rank_, &a), l, "forward with the key/value cache");
    held = next;
    turn ^= 1;
  }
  return held;
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
