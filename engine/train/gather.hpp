// A checkpoint's parameters as whole tensors, by name, whatever parallel layout wrote
// it: each rank's file is cut by the layout the engine gives that rank (the memory
// plan of the checkpoint's own manifest: the same layers, the same buffer layout),
// and each shard is put in its place in the whole tensor — tensor-parallel slices by
// their partition dim and stride (Megatron's partition_dim / partition_stride),
// expert slices by expert (ep) and then partition dim (expert tp), pipeline stages
// and virtual chunks by name. Data-parallel and context-parallel replicas hold the
// same values; each element is taken from the first rank that holds it.
#pragma once

#include "engine/plugins/registry.hpp"
#include "engine/train/checkpoint.hpp"
#include "engine/train/memory_plan.hpp"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace loom::train {

struct WholeTensor {
  std::string name;            // the engine's name, e.g. "blocks.3.attention.qkv.weight"
  std::vector<int64_t> shape;  // the whole tensor's (padded vocabularies included)
  int32_t dtype = LOOM_DTYPE_F32;  // the checkpoint's parameter dtype (fp32 or bf16)
  std::vector<char> data;      // row-major
  std::string tie_key;         // a tied parameter's key (loom_param_decl.tie_key), else ""
  // The optimizer state of its elements (gather_checkpoint with_state): fp32 arrays of
  // numel() elements (AdamW: m, v, and master weights when not fp32).
  std::vector<std::vector<float>> state;
  int64_t numel() const;
};

struct WholeCheckpoint {
  CheckpointMeta meta;
  std::string manifest_toml;        // the resolved manifest the run saved
  int64_t vocab = 0;                // the model's vocabulary, unpadded
  std::vector<WholeTensor> tensors;  // model order, each name once
  size_t declared = 0;               // the parameters the checkpoint holds (tensors: the wanted ones)
  model::StateValues states;         // the layers' state (ABI 1.23), by name, all of it
  const WholeTensor* find(const std::string& name) const;
};

// Where a rank's shard of a parameter sits in the whole tensor: the rank's tp rank, and
// for an expert parameter its ep and expert-tp ranks.
struct ShardCoords {
  int tp_rank = 0, ep_rank = 0, etp_rank = 0;
};
// Calls run(local, whole, count) for each contiguous run of the shard `p` describes
// (its local_shape, row-major): `count` elements at element `local` of the shard are
// elements [whole, whole + count) of the whole tensor (full_shape).
void for_each_shard_run(const PlannedParam& p, const ShardCoords& at,
                        const std::function<void(int64_t local, int64_t whole, int64_t count)>& run);

// Reads step_dir (a step_N directory) with the plugins of `registry` (the layer plugins
// the checkpoint's manifest names must be loaded). Throws CheckpointError naming what
// is missing or inconsistent (a rank file, a parameter the plan does not expect).
// with_state: also each tensor's optimizer state, decoded from every rank's blob by the
// checkpoint's optimizer strategy (ABI 1.14 state_decode; data-parallel ranks hold
// shards of it) — what a resume at another layout loads.
// wanted: which of the checkpoint's parameters to gather (its own plan's declaration);
// empty = all. A process that hosts some ranks of a run gathers what they hold only
// (tensors_held_by), so under mpirun no process reads the whole model and its state.
using TensorFilter = std::function<bool(const PlannedParam&)>;
WholeCheckpoint gather_checkpoint(const std::string& step_dir, plugins::Registry& registry, bool with_state = false,
                                  const TensorFilter& wanted = {});
// The parameters ranks `ranks` of `plan` hold, by name and by tie key (a tied copy is
// stored under its first holder's name).
TensorFilter tensors_held_by(const MemoryPlan& plan, const std::vector<int32_t>& ranks);

}  // namespace loom::train
