// A run that starts from given weights (checkpoint.init_weights, fine-tuning): whole
// tensors by parameter name — a loom checkpoint of any layout gathered
// (train/gather.hpp), or a model of another project converted (interop/) — cut into each
// rank's slices by the same code as the random initialisation (Model::assign_params).
#pragma once

#include "engine/model/model.hpp"
#include "engine/train/gather.hpp"
#include "engine/train/memory_plan.hpp"
#include "engine/train/run_plan.hpp"

#include <string>
#include <vector>

namespace loom::train {

struct InitialWeights {
  std::string source;               // where they came from, for messages
  std::vector<WholeTensor> tensors;  // engine names and whole shapes; fp32 or bf16
  int64_t vocab = 0;                // the source model's vocabulary (0: not known)
  std::string role = "checkpoint.init_weights";  // what named them, first in messages ("--resume")
  std::vector<std::string> skipped;  // newer step directories of a checkpoint.dir passed over ("DIR (why)")
  std::vector<std::string> unread;   // tensors of the source the model has no use for (a Hugging Face file's)
  std::vector<std::string> changed;  // how far attention reaches, as the run changes it ("key: was -> now")
  model::StateValues states;         // the layers' state outside the parameters (a loom checkpoint's; ABI 1.23)
};

// Before launch: the weights fit the run's model — its vocabulary, every parameter some
// rank declares found with its whole shape (vocabulary tables may be padded otherwise),
// and every tensor of the weights used (a layer fewer, or another architecture with the
// same names, would otherwise load silently). Throws loom::Error naming the first misfit.
// ranks: the ranks whose parameters to check (this process's, when the weights were
// gathered for them only); empty = every rank.
void check_initial_weights(const InitialWeights& w, const MemoryPlan& plan, int64_t vocab, int64_t padded_vocab,
                           const std::vector<int32_t>& ranks = {});

// A loom checkpoint's model against the run's, by its manifest: the model keys and every
// layer option but the training-only ones (dropouts, loss coefficients, capacity), as set
// or as the plugin's default, must be equal, or the same tensors would mean another
// model (e.g. other heads, another norm).
// A layer option that changes training, not the model (dropout, auxiliary loss
// coefficients, MoE capacity): a run from given weights or a resume may change it.
bool training_only_option(const std::string& name);
// A layer option as the layer computes with it: its value in `section` ([model.layer.X])
// as TOML text, else the plugin's declared default ("(unset)" when it has none).
std::string layer_option_text(const toml::table& section, const manifest::OptionDecl& decl);
// The plugin's declared default printed as a manifest's value is ("" when it has none):
// what an option a manifest lacks (one written before the plugin declared it) meant.
std::string option_default_text(const manifest::OptionDecl& decl);

// The run's model is the one of a checkpoint's manifest: its shape and every layer
// option but those training alone reads. Fine-tuning (`changes` given) may also change
// how far attention reaches (a sliding window, the rotary base and scaling: context
// extension); those changes are listed there. Throws loom::Error naming the first
// other difference.
void require_same_architecture(const std::string& source_manifest_toml, const RunPlan& run, const std::string& source,
                               const std::string& role = "checkpoint.init_weights",
                               std::vector<std::string>* changes = nullptr);

// Each of the model's parameters from the tensor of its name, and each layer state
// the model keeps from w.states (refused, naming it, when the weights lack it) (a tied copy: of its tie
// key). A vocabulary table (dim 0 of at least `vocab` rows on both sides) may be padded
// differently: its rows up to `vocab` are taken, the padding is zero. Throws loom::Error
// naming a parameter that is missing or whose shape differs.
void load_initial_weights(const InitialWeights& w, int64_t vocab, model::Model& model);

// The optimizer state regathered with the weights (WholeTensor::state, from
// gather_checkpoint with the state), cut as the parameters are for this rank's model:
// arrays over its flat buffer (padding zero), what loom_optimizer_api.state_import takes.
std::vector<std::vector<float>> optimizer_state_for(const InitialWeights& w, int64_t vocab, const model::Model& model);

}  // namespace loom::train
