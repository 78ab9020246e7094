// Memory planning without running the model: what each rank's parameters, gradients,
// optimizer state and activations cost in bytes for the manifest's dtypes, optimizer
// strategy and pipeline schedule, from the layers each rank creates (on a CPU device,
// without parameter memory), and how that compares with what its device offers.
#pragma once

#include "engine/model/param_plan.hpp"
#include "engine/train/run_plan.hpp"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace loom::train {

// Optimizer-state bytes per buffer element (before sharding), as ddp and distributed
// allocate them: Adam m and v, and fp32 master params when params are not fp32.
size_t optimizer_bytes_per_element(const std::string& param_dtype);

// Whether the plan's optimizer strategy keeps only its dp shard of the state
// (LOOM_OPTIMIZER_SHARDED_STATE: Megatron's distributed optimizer).
bool shards_optimizer_state(const RunPlan& plan);

// A parameter as a rank holds it: what gathering its shards from a checkpoint needs.
struct PlannedParam {
  std::string name;
  std::vector<int64_t> full_shape, local_shape;
  int32_t partition_dim = -1, partition_stride = 1;  // split over tp (etp for an expert parameter)
  bool expert = false;                               // dim 0 split over ep
  std::string tie_key;                               // shared with another layer's parameter
};

// What every rank at one (tp, pp) position holds alike (its dp, cp and ep replicas
// share one copy: a world of a million ranks plans a handful of these).
struct RankShape {
  std::vector<PlannedParam> planned;  // its parameters in model order, as layout.params
  model::BufferLayout layout;
  // Per local pipeline chunk: its layers and their forward FLOPs over one microbatch
  // (loom_layer_api.forward_flops), for `loom plan --perf`.
  std::vector<int> chunk_layers;
  std::vector<double> chunk_forward_flops;
  std::vector<double> layer_forward_flops;  // each of its layers', in model order
};

struct RankMemory {
  int rank = 0, tp_rank = 0, cp_rank = 0, dp_rank = 0, pp_rank = 0;
  int ep_rank = 0, etp_rank = 0;
  std::shared_ptr<const RankShape> shape;
  const std::vector<PlannedParam>& planned() const { return shape->planned; }
  const model::BufferLayout& layout() const { return shape->layout; }
  const std::vector<int>& chunk_layers() const { return shape->chunk_layers; }
  const std::vector<double>& chunk_forward_flops() const { return shape->chunk_forward_flops; }
  const std::vector<double>& layer_forward_flops() const { return shape->layer_forward_flops; }
  size_t params = 0;        // the rank's real parameter count (tied once, no padding)
  size_t buffer_numel = 0;  // flat buffer elements, padding included
  size_t param_count = 0;   // number of parameter tensors
  size_t expert_start = 0;  // where the expert region (sharded over edp) begins; buffer_numel = none
  bool counted_elsewhere = false;  // holds a tied copy whose gradient norm another stage counts (Model::counted_elsewhere)
  uint64_t param_bytes = 0, grad_bytes = 0, optimizer_bytes = 0;
  uint64_t activation_bytes = 0;  // at the schedule's peak (estimate from the layers' saved bytes)
  int in_flight = 0;              // (chunk, microbatch) forwards awaiting backward at that peak
  // Activation recomputation: the most a rank holds while a recompute group's
  // forward runs again in backward (its layers' saved bytes and inner hidden
  // states alive at once, over what is held then), less activation_bytes; 0 without.
  uint64_t recompute_bytes = 0;
  // The backward's hidden-state gradient buffers, held for the whole run: two for
  // the layers' input gradients by turns, and one for a received output gradient,
  // two when receives are posted early (Model::gradient_buffer_bytes).
  uint64_t work_bytes = 0;
  // The step's inputs, held for the whole run: a token, a target and a dropout-seed
  // buffer per microbatch (train::Microbatches, model::DropoutSeeds).
  uint64_t input_bytes = 0;
  // The largest of its layers' temporaries within one forward or backward
  // (loom_layer_api.workspace_bytes, ABI 1.19; layers built before declare none).
  uint64_t workspace_bytes = 0;
  double bytes_per_param = 0;  // (param + grad + optimizer bytes) / params
  size_t tied_numel = 0;  // elements of parameters shared with another stage (summed over the embedding group)
};

struct MemoryPlan {
  std::string param_dtype, grad_dtype, strategy;
  int world = 1, tp = 1, cp = 1, dp = 1, pp = 1, ep = 1, edp = 1;
  int64_t vocab = 0;
  size_t bucket_size = 0;
  int64_t microbatches_in_flight = 1;  // the most any rank holds
  uint64_t hidden_state_bytes = 0;     // one microbatch's hidden state on a rank: what a pipeline stage sends
  std::vector<RankMemory> ranks;  // every rank of the world, by global rank
};

// Plans every rank of `plan` from the layer plugins' declarations alone (a
// device/cpu instance for create, no communicators, no parameter memory).
// vocab 0 = model.vocab_size, or the data source's vocabulary when that is 0.
MemoryPlan plan_memory(const RunPlan& plan, int64_t vocab = 0);

// Bytes the plan says rank `r` holds (parameters, gradients, optimizer state,
// activations at the schedule's peak, recomputation, gradient work buffers, the
// step's inputs, the largest layer workspace).
uint64_t rank_total_bytes(const RankMemory& r);
// The memory one rank may plan to hold, as the manifest's device reports it
// (loom_memory_stats.capacity_bytes, ABI 1.9) for a process that runs
// `ranks_in_process` ranks: the device is created once with the manifest's options to
// ask. 0 when unknown: a device older than 1.9, or one this machine cannot create
// (device/cuda without a GPU).
uint64_t device_capacity(const RunPlan& plan, int ranks_in_process);
// "" when every rank fits `capacity` (or it is 0: unknown); else the sentence to warn or
// refuse with, naming the rank that needs most and `device` ("device/cpu").
std::string memory_problem(const MemoryPlan& mp, uint64_t capacity, const std::string& device, int ranks_in_process);

}  // namespace loom::train
