// What a run is checked for before any rank starts. `loom validate` and `loom plan`
// report it, and train() refuses it, so a manifest validate accepts does not fail
// later for a reason known in advance.
#pragma once

#include "engine/train/data.hpp"
#include "engine/train/memory_plan.hpp"
#include "engine/train/run_plan.hpp"

#include <cstdint>
#include <memory>
#include <string>

namespace loom::train {

struct Preflight {
  std::unique_ptr<DataSource> data;  // opened once, for the run to read from
  int64_t vocab = 0;           // the model's vocabulary: model.vocab_size, or the data's
  MemoryPlan memory;           // every rank's plan, from the layers the ranks create
  std::string memory_problem;  // "" or why a rank does not fit what its device offers
};

// Opens the data (its vocabulary must fit model.vocab_size; a training sequence, and a
// validation one when run.eval_every > 0, must be readable), asks each layer's plugin
// whether it can run this configuration (its validate slot), creates every rank's
// layers on a CPU device (the checks each plugin makes in create, and expert
// parameters when parallel.ep > 1), checks the optimizer strategy can take the model
// (tied copies across stages, expert parameters, MoE folding) and plans memory against
// the device's capacity for a process that runs `ranks_in_process` ranks. Throws
// DataError or loom::Error.
Preflight preflight(const RunPlan& plan, int ranks_in_process);

}  // namespace loom::train
