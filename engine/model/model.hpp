// A rank's share of the model: its pipeline chunks' layers (created from layer
// plugins), their parameters and gradients in flat per-rank buffers (one region
// per chunk, Megatron's layout), and forward/backward of one microbatch through a
// chunk. Activations are kept per (chunk, microbatch) until that backward, so a
// pipeline schedule can hold several in flight. The Model composes the parts that
// do each job: Layers, ParamBuffers, HiddenStates, Recomputation, DropoutSeeds,
// CapturePolicy, GradFinalizer and LayerStates.
#pragma once

#include "engine/manifest/run_config.hpp"
#include "engine/model/buffer_layout.hpp"
#include "engine/model/capture_policy.hpp"
#include "engine/model/dropout_seeds.hpp"
#include "engine/model/grad_finalize.hpp"
#include "engine/model/hidden_states.hpp"
#include "engine/model/layer_states.hpp"
#include "engine/model/layers.hpp"
#include "engine/model/param_buffers.hpp"
#include "engine/model/recompute.hpp"
#include "engine/plugins/registry.hpp"
#include "engine/runtime/rank_runtime.hpp"

#include <loom/cpp/core.hpp>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace loom::model {

class Model {
 public:
  Model(const manifest::RunConfig& config, const plugins::Registry& registry, runtime::RankRuntime& rank,
        const loom_model_dims& dims, std::vector<ModelChunk> chunks, uint64_t seed);
  // The whole model in one chunk (no pipeline parallelism).
  Model(const manifest::RunConfig& config, const plugins::Registry& registry, runtime::RankRuntime& rank,
        const loom_model_dims& dims, std::vector<LayerSpec> layers, uint64_t seed)
      : Model(config, registry, rank, dims, std::vector<ModelChunk>{{0, 1, std::move(layers)}}, seed) {}
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  // --- Pipeline steps on local chunk c (0-based), microbatch mb ---
  // The buffer the chunk's input hidden state is received into (not for the first
  // global chunk); held until the chunk's backward of mb (or release).
  void* chunk_input(int c, int mb);
  // Runs the chunk's layers. tokens/targets: device buffers [seq, micro_batch],
  // alive until the backward of mb. Returns the output hidden state (held until
  // the backward), or nullptr for the last global chunk, which writes
  // loss_sum/loss_count and, when non-null, the argmax predictions (host).
  // aux_loss (host, optional): training forwards add the layers' weighted
  // auxiliary losses (MoE load balancing) of the microbatch.
  const void* forward_chunk(int c, int mb, const int32_t* tokens, const int32_t* targets, bool training,
                            uint64_t dropout_seed, float* loss_sum, int64_t* loss_count,
                            int32_t* predictions = nullptr, float* aux_loss = nullptr,
                            const int32_t* document_start = nullptr, const int32_t* position_ids = nullptr);
  // The buffer the gradient of a chunk's output is received into before its
  // backward (not for the last global chunk). Two slots, so that the next
  // backward's gradient can arrive while this one reads its own (a receive posted
  // early); a pipeline gives each (chunk, microbatch) the same slot every step, as
  // captured graphs hold its address.
  void* chunk_grad_output(int slot = 0);
  // Backward of the chunk; frees what its forward saved. Returns the gradient of
  // the chunk's input (valid until the next backward_chunk), or nullptr for the
  // first global chunk. aux_loss_scale: d(objective)/d(auxiliary loss) of the
  // microbatch, 1 / microbatches per step (ABI 1.4, every layer). last_microbatch:
  // the step's last backward of this chunk, after which each layer's gradients are
  // final (GradFinalizer: the tp sums, then the grads-ready listener).
  // grad_slot: the chunk_grad_output slot its output gradient was received into.
  const void* backward_chunk(int c, int mb, float loss_scale, float aux_loss_scale, bool last_microbatch = false,
                             int grad_slot = 0);
  // Drops what the forward of (c, mb) saved, without a backward (evaluation).
  void release_chunk(int c, int mb);
  // The step's dropout seed of every microbatch (index = mb), copied to device
  // memory in one go before the step: layers read them there (ABI 1.3
  // dropout_seed_device), so captured dropouts draw new masks every step.
  void stage_dropout_seeds(const std::vector<uint64_t>& seeds) { seeds_.stage(seeds); }
  // Room for the seeds of a step of `microbatches`, reserved before the first step.
  void reserve_dropout_seeds(size_t microbatches) { seeds_.reserve(microbatches); }
  // Whether the next training steps' layer steps may be captured and replayed (the
  // exec plugin's LOOM_EXEC_REPLAYS): a batch ramp's smaller steps run them directly,
  // since their pipeline orders would replay captures out of their capture order.
  void set_steps_capturable(bool on) { steps_capturable_ = on; }
  // What the device buffer holds now (read back; for tests and diagnostics).
  std::vector<uint64_t> staged_dropout_seeds() const { return seeds_.staged(); }

  // --- Generation: kv_cache forwards (ABI 1.13), nothing saved for a backward ---
  // Runs local chunk c on `rows` new positions, from position_offset, of `batch`
  // sequences (position_offset 0 starts new ones): `tokens` (device, [rows, batch])
  // feed the first global chunk, `input` (a device hidden state [rows, batch, hidden])
  // the others. Returns the output hidden state, valid until the next call, or nullptr
  // for the last global chunk, which writes the fp32 logits of every sequence's last
  // row to `logits` (host, [batch, vocab]). document_start and position_ids (device,
  // laid out as the tokens, or null): the rows' documents (ABI 1.22).
  const void* forward_cached(int c, int64_t rows, int64_t batch, int64_t position_offset, const int32_t* tokens,
                             const void* input, float* logits, const int32_t* document_start = nullptr,
                             const int32_t* position_ids = nullptr);
  // Bytes of a hidden state of `rows` positions of `batch` sequences.
  size_t hidden_bytes(int64_t rows, int64_t batch) const;

  // --- The whole local model at once (every chunk on this rank, in order) ---
  // One microbatch: forward through all chunks, handing each output to the next.
  void forward(int mb, const int32_t* tokens, const int32_t* targets, bool training, uint64_t dropout_seed,
               float* loss_sum, int64_t* loss_count, int32_t* predictions = nullptr, float* aux_loss = nullptr);
  void backward(int mb, float loss_scale, float aux_loss_scale);
  void release(int mb);
  // A training step begins: gradients zero, every parameter's pending again.
  void zero_grads() {
    buffers_.zero_grads();
    finalizer_.begin_step();
  }
  // Told, during a step's backward, of the parameters (entry indices, as the
  // optimizer's infos) whose gradients are final (GradFinalizer).
  void set_grads_ready_listener(GradFinalizer::Listener listener) { finalizer_.set_listener(std::move(listener)); }
  // Told, before the first forward (microbatch 0) of each layer, of the parameters it
  // reads (entry indices), so that an all-gather still running from the last
  // optimizer step can complete first (overlap_param_gather).
  void set_params_needed_listener(std::function<void(const std::vector<size_t>&)> listener) {
    params_needed_ = std::move(listener);
  }
  // Every parameter from its whole tensor (ParamBuffers::assign): starting from given weights.
  void assign_params(const ParamBuffers::FullTensorOf& full_of) { buffers_.assign(full_of); }
  // This rank's slice of a parameter's whole tensor (ParamBuffers::local_part).
  std::vector<float> local_part(const ParamEntry& e, std::vector<float> full) const {
    return buffers_.local_part(e, std::move(full));
  }
  // After the last microbatch's backward, before the optimizer: the reductions
  // that make each gradient whole not yet done (tp sum of duplicated parameters under
  // sequence parallelism; sum of tied copies over the embedding group).
  void finalize_grads() { finalizer_.finish(); }
  // After finalize_grads, before the optimizer: the layers update their state from
  // the step's `microbatches` (ABI 1.23 end_step; `step` 1-based).
  void end_step(int64_t step, int32_t microbatches) { states_.end_step(rank_, step, microbatches); }
  // The layers' state outside the parameters (checkpointed beside them).
  const LayerStates& layer_states() const { return states_; }
  // Bytes of the hidden state between two layers of one microbatch.
  size_t hidden_bytes() const { return hidden_.bytes(); }
  // Elements of that hidden state (the p2p message count, in act_dtype()).
  size_t hidden_numel() const { return hidden_.numel(); }
  // LOOM_DTYPE_* of the parameters (device.param_dtype; also the activations:
  // hidden states, layer-internal activations, their gradients) and of the
  // gradient buffer (device.grad_dtype).
  int32_t param_dtype() const { return buffers_.param_dtype(); }
  const loom_model_dims& dims() const { return dims_; }
  int32_t act_dtype() const { return buffers_.param_dtype(); }
  int32_t grad_dtype() const { return buffers_.grad_dtype(); }

  void* params() const { return buffers_.params(); }
  void* grads() const { return buffers_.grads(); }
  size_t numel() const { return buffers_.numel(); }
  // Where each entry (param_entries() order = model order) and bucket lives.
  const BufferLayout& layout() const { return buffers_.layout(); }
  const std::vector<ParamEntry>& param_entries() const { return buffers_.entries(); }
  std::vector<loom_param_info> param_infos() const { return buffers_.param_infos(); }
  // Per entry: 1 when its gradient norm is counted on another stage (the optimizer's counted_elsewhere).
  std::vector<int32_t> counted_elsewhere() const { return buffers_.counted_elsewhere(); }
  // Per entry: 1 for an expert parameter (the optimizer's expert flags, ABI 1.4).
  std::vector<int32_t> expert_flags() const { return buffers_.expert_flags(); }
  bool has_expert_params() const { return buffers_.has_expert_params(); }
  // The rank this model runs on (its device's memory statistics, for example).
  const runtime::RankRuntime& runtime() const { return rank_; }
  size_t layer_count() const { return layers_.size(); }
  const LayerSpec& layer_spec(size_t i) const { return layers_[i].spec; }
  size_t chunk_count() const { return layers_.chunk_count(); }
  int chunk_global_index(int c) const { return layers_.chunk(c).global_index; }
  bool is_first_global(int c) const { return layers_.chunk(c).is_first_global(); }
  bool is_last_global(int c) const { return layers_.chunk(c).is_last_global(); }
  double forward_flops() const { return layers_.forward_flops(); }  // one microbatch through this rank's layers
  uint64_t activation_bytes() const;  // saved per microbatch by this rank's layers (all chunks)
  // The backward's hidden-state gradient buffers allocated so far (the memory
  // plan's work_bytes).
  uint64_t gradient_buffer_bytes() const;
  int64_t tokens_per_microbatch() const { return dims_.seq_len * dims_.micro_batch; }
  // Whether layer steps may be replayed from graphs (the exec mode replays and some
  // layer is capturable): then hidden states stay allocated across steps.
  bool replays_steps() const { return capture_.replays_steps(); }

 private:
  // Layer i's forward of microbatch mb over the chunk's hidden states (input,
  // output), with the given loss and aux outputs.
  void run_forward(size_t i, int mb, const DLTensor* input, DLTensor* output, const ForwardInputs& in,
                   float* loss_sum, int64_t* loss_count, int32_t* predictions, float* aux_loss, bool training);
  // Layer i's backward of microbatch mb: the gradient of its output in (none
  // after the last global chunk's last layer), of its input out (none before the
  // first global chunk's first layer).
  void run_backward(size_t i, int mb, const DLTensor* grad_output, DLTensor* grad_input, float loss_scale,
                    float aux_loss_scale);

  runtime::RankRuntime& rank_;
  loom_model_dims dims_;
  Layers layers_;
  ParamBuffers buffers_;
  LayerStates states_;  // asked after the parameters are bound
  bool sequence_parallel_ = false;  // hidden states are sharded over tp
  GradFinalizer finalizer_;
  std::function<void(const std::vector<size_t>&)> params_needed_;  // entries a layer's first forward reads
  int64_t context_rows_ = 0;        // sequence rows this rank holds: seq_len, or its cp slice
  CapturePolicy capture_;
  HiddenStates hidden_;
  DropoutSeeds seeds_;
  bool steps_capturable_ = true;  // set_steps_capturable
  Recomputation recompute_;
  // Gradients of hidden states in backward: each layer's input gradient, in
  // grad_a_ and grad_b_ by turns, and the chunk's output gradient as received
  // (each slot allocated on first use: a pipeline's executor asks for the ones it
  // uses before its first step; a last stage uses none).
  loom::Buffer grad_a_, grad_b_, grad_recv_[2];
  // Generation's hidden states, each layer's output in one of the two by turns.
  loom::Buffer generated_[2];
};

}  // namespace loom::model
