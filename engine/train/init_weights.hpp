// A run that starts from given weights (checkpoint.init_weights, fine-tuning): whole
// tensors by parameter name — a loom checkpoint of any layout gathered
// (train/gather.hpp), or a model of another project converted (interop/) — cut into each
// rank's slices by the same code as the random initialisation (Model::assign_params).
#pragma once

#include "engine/model/model.hpp"
#include "engine/train/gather.hpp"

#include <string>
#include <vector>

namespace loom::train {

struct InitialWeights {
  std::string source;               // where they came from, for messages
  std::vector<WholeTensor> tensors;  // engine names and whole shapes; fp32 or bf16
};

// Each of the model's parameters from the tensor of its name (a tied copy: of its tie
// key). A vocabulary table (dim 0 of at least `vocab` rows on both sides) may be padded
// differently: its rows up to `vocab` are taken, the padding is zero. Throws loom::Error
// naming a parameter that is missing or whose shape differs.
void load_initial_weights(const InitialWeights& w, int64_t vocab, model::Model& model);

}  // namespace loom::train
