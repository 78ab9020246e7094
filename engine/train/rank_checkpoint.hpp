// Each rank's part of a checkpoint: its parameters and optimizer state written
// into the step's temporary directory and committed by rank 0 once every rank
// has written (checkpoint.hpp has the files and the atomic commit), and read back
// on resume, in the same layout or resharded to another dp.
#pragma once

#include "engine/train/init_weights.hpp"

#include "engine/model/model.hpp"
#include "engine/train/checkpoint.hpp"
#include "engine/train/optimizer_binding.hpp"
#include "engine/train/run_plan.hpp"

#include <cstdint>
#include <string>

namespace loom::train {

// Every rank of the world calls it (barriers inside) when checkpoint.dir is set.
// `consumed_samples`: the training samples the run has read by `step`;
// `evaluation_pending`: a stop signal came before step's evaluation ended (a resume
// runs it first). Returns the committed directory on rank 0, "" on the others.
std::string save_checkpoint(const RunPlan& plan, runtime::RankRuntime& rank, const model::Model& model,
                            const OptimizerBinding& optimizer, int64_t step, uint64_t consumed_samples,
                            bool evaluation_pending, const std::string& manifest_toml);

// Loads `from` into this rank's parameters and optimizer state, after checking the
// parameter layout and the model the checkpoint kept.
// `regathered`: with from.regather, the checkpoint's whole tensors and their optimizer
// state (gather_checkpoint with the state, read once for every rank), cut for this rank.
void restore_checkpoint(const RunPlan& plan, const ResumePoint& from, runtime::RankRuntime& rank,
                        model::Model& model, OptimizerBinding& optimizer, const std::string& manifest_toml,
                        const InitialWeights* regathered = nullptr);

}  // namespace loom::train
