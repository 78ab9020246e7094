#include "engine/train/init_weights.hpp"

#include "engine/manifest/schema.hpp"

#include <algorithm>
#include <cstring>
#include <functional>
#include <set>
#include <sstream>

#include <toml++/toml.h>

namespace loom::train {

namespace {

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

float element(const WholeTensor& t, int64_t i) {
  float f = 0;
  if (t.dtype == LOOM_DTYPE_BF16) {
    uint32_t bits = 0;
    std::memcpy(reinterpret_cast<char*>(&bits) + 2, t.data.data() + 2 * i, 2);  // little-endian: the high half
    std::memcpy(&f, &bits, 4);
  } else {
    std::memcpy(&f, t.data.data() + 4 * i, 4);
  }
  return f;
}

const WholeTensor* source_of(const InitialWeights& w, const model::ParamEntry& e) {
  for (const WholeTensor& t : w.tensors)
    if (t.name == e.name) return &t;
  if (!e.tie_key.empty())
    for (const WholeTensor& t : w.tensors)
      if (t.tie_key == e.tie_key) return &t;
  return nullptr;
}

// Whether a tensor of `have` rows stands for a parameter of `want` rows: equal, or both a
// vocabulary table (the run's padded vocabulary on the model's side, at least the
// vocabulary on the other).
bool fits(const std::vector<int64_t>& have, const std::vector<int64_t>& want, int64_t vocab, int64_t padded_vocab) {
  if (have == want) return true;
  return have.size() == 2 && want.size() == 2 && have[1] == want[1] && want[0] == padded_vocab && have[0] >= vocab;
}

}  // namespace

void check_initial_weights(const InitialWeights& w, const MemoryPlan& plan, int64_t vocab, int64_t padded_vocab,
                           const std::vector<int32_t>& ranks) {
  if (w.vocab > 0 && w.vocab != vocab)
    throw loom::Error(w.role + ": " + w.source + " has a vocabulary of " + std::to_string(w.vocab) +
                      ", the run " + std::to_string(vocab) + " (model.vocab_size, data.tokenizer's, or the data's)");
  std::vector<bool> used(w.tensors.size(), false);
  for (const RankMemory& r : plan.ranks) {
    if (!ranks.empty() && std::find(ranks.begin(), ranks.end(), r.rank) == ranks.end()) continue;
    for (const PlannedParam& p : r.planned()) {
      size_t k = 0;
      while (k < w.tensors.size() && w.tensors[k].name != p.name) ++k;
      if (k == w.tensors.size() && !p.tie_key.empty())
        for (k = 0; k < w.tensors.size() && w.tensors[k].tie_key != p.tie_key;) ++k;
      if (k == w.tensors.size())
        throw loom::Error(w.role + ": " + w.source + " has no parameter " + p.name +
                          " (the model declares it; is it the same architecture?)");
      if (!fits(w.tensors[k].shape, p.full_shape, vocab, padded_vocab))
        throw loom::Error(w.role + ": " + w.source + "'s " + w.tensors[k].name + " is " +
                          shape_text(w.tensors[k].shape) + ", the model's " + p.name + " " + shape_text(p.full_shape));
      used[k] = true;
      // A tied parameter uses the copies of its key (another stage's) too.
      for (size_t j = 0; j < w.tensors.size(); ++j)
        if (!p.tie_key.empty() && w.tensors[j].tie_key == p.tie_key) used[j] = true;
    }
  }
  for (size_t k = 0; k < w.tensors.size(); ++k)
    if (!used[k])
      throw loom::Error(w.role + ": " + w.source + " has " + w.tensors[k].name +
                        ", which the model does not declare (a layer more, or another architecture)");
}

bool training_only_option(const std::string& name) {
  static const std::set<std::string> names = {"dropout", "activation_dropout", "aux_loss_coeff",
                                              "z_loss_coeff", "capacity_factor", "drop_policy",
                                              "expert_bias_update_rate"};
  return names.count(name) > 0;
}

namespace {
// Options of how far attention reaches: the same weights compute the same per token,
// over another span (what context extension changes).
bool reach_option(const std::string& name) {
  static const std::set<std::string> names = {"sliding_window",       "rotary_base",         "rope_scaling",
                                              "rope_scaling_factor",  "rope_low_freq_factor", "rope_high_freq_factor",
                                              "rope_original_max_position"};
  return names.count(name) > 0;
}
}  // namespace

void require_same_architecture(const std::string& source_manifest_toml, const RunPlan& run, const std::string& source,
                               const std::string& role, std::vector<std::string>* changes) {
  toml::table a, b;
  try {
    a = toml::parse(source_manifest_toml);
    b = toml::parse(run.manifest.to_toml());
  } catch (const toml::parse_error& e) {
    throw loom::Error(role + ": " + source + "'s manifest.toml: " + std::string(e.description()));
  }
  auto text = [](const toml::table& t, const std::string& key, const std::string& fallback) {
    std::ostringstream os;
    if (auto n = t.at_path(key)) os << n;
    return os.str().empty() ? fallback : os.str();
  };
  auto differ = [&](const std::string& key, const std::string& fallback) {
    const std::string x = text(a, key, fallback), y = text(b, key, fallback);
    if (x != y)
      throw loom::Error(role + ": " + source + " holds a model with " + key + " = " + x +
                        ", this run has " + y + ": the same tensors would be another model; set " + key +
                        " as it has it");
  };
  for (const char* key : {"model.hidden_size", "model.num_heads", "model.ffn_hidden_size", "model.num_layers",
                          "model.tie_embeddings", "model.pre", "model.post"})
    differ(key, "(unset)");
  if (const std::string x = manifest::schema::block_composition(a), y = manifest::schema::block_composition(b); x != y)
    throw loom::Error(role + ": " + source + " holds a model whose blocks are " + x + ", this run's are " + y +
                      ": the same tensors would be another model; set model.block, model.blocks and "
                      "model.block_pattern as it has them");
  // Each layer's options, as set or as its plugin declares them by default.
  const toml::table none;
  auto section = [&](const toml::table& t, const std::string& config) -> const toml::table& {
    const toml::table* s = t.at_path("model.layer." + config).as_table();
    return s != nullptr ? *s : none;
  };
  std::set<std::string> seen;
  for (const model::LayerSpec& spec : run.layers) {
    if (!seen.insert(spec.config).second) continue;
    const plugins::LoadedPlugin& p = run.registry->get("layer", spec.plugin);
    for (const manifest::OptionDecl& d : p.options) {
      if (training_only_option(d.name)) continue;
      const std::string key = "model.layer." + spec.config + "." + d.name;
      const std::string x = layer_option_text(section(a, spec.config), d), y = layer_option_text(section(b, spec.config), d);
      if (x != y && changes != nullptr && reach_option(d.name)) {
        changes->push_back(key + ": " + x + " -> " + y);
        continue;
      }
      if (x != y)
        throw loom::Error(role + ": " + source + " holds a model with " + key + " = " + x + ", this run has " + y +
                          ": the same tensors would be another model; set " + key + " as it has it");
    }
  }
}

std::string layer_option_text(const toml::table& section, const manifest::OptionDecl& decl) {
  std::ostringstream os;
  if (auto n = section[decl.name]) os << n;
  if (!os.str().empty()) return os.str();
  const std::string dflt = option_default_text(decl);
  return dflt.empty() ? "(unset)" : dflt;
}

std::string option_default_text(const manifest::OptionDecl& decl) {
  if (!decl.default_value) return "";
  try {
    const toml::table t = toml::parse("v = " + *decl.default_value);
    std::ostringstream os;
    os << t["v"];
    return os.str();
  } catch (const toml::parse_error&) {
    return *decl.default_value;
  }
}

namespace {

// Parameter e's whole tensor from its source in `w`, element i of the source given by
// value(t, i): the same shape, or a vocabulary table padded otherwise (its rows up to
// `vocab` taken, the padding zero).
std::vector<float> whole_of(const InitialWeights& w, int64_t vocab, const model::Model& model,
                            const model::ParamEntry& e, const std::function<float(const WholeTensor&, int64_t)>& value) {
  const WholeTensor* t = source_of(w, e);
  if (t == nullptr)
    throw loom::Error(w.role + ": " + w.source + " has no parameter " + e.name +
                      " (the model declares it; is it the same architecture?)");
  const std::vector<int64_t>& want = e.full_shape;
  if (!fits(t->shape, want, vocab, model.dims().padded_vocab))
    throw loom::Error(w.role + ": " + w.source + "'s " + t->name + " is " + shape_text(t->shape) +
                      ", the model's " + e.name + " " + shape_text(want));
  int64_t n = 1;
  for (int64_t d : want) n *= d;
  std::vector<float> full(static_cast<size_t>(n), 0.0f);
  const int64_t copy = t->shape == want ? n : vocab * want[1];
  for (int64_t i = 0; i < copy; ++i) full[static_cast<size_t>(i)] = value(*t, i);
  return full;
}

}  // namespace

void load_initial_weights(const InitialWeights& w, int64_t vocab, model::Model& model) {
  model.assign_params([&](const model::ParamEntry& e) { return whole_of(w, vocab, model, e, element); });
  model.layer_states().assign(w.states, w.role + " " + w.source);
}

std::vector<std::vector<float>> optimizer_state_for(const InitialWeights& w, int64_t vocab, const model::Model& model) {
  size_t arrays = 0;
  for (const WholeTensor& t : w.tensors) arrays = std::max(arrays, t.state.size());
  std::vector<std::vector<float>> out(arrays, std::vector<float>(model.numel(), 0.0f));
  for (const model::ParamEntry& e : model.param_entries())
    for (size_t k = 0; k < arrays; ++k) {
      const std::vector<float> local = model.local_part(e, whole_of(w, vocab, model, e, [&](const WholeTensor& t, int64_t i) {
        if (t.state.size() != arrays)
          throw loom::Error(w.source + ": no optimizer state for " + t.name + " (" + std::to_string(t.state.size()) +
                            " arrays, others have " + std::to_string(arrays) + ")");
        return t.state[k][static_cast<size_t>(i)];
      }));
      std::copy(local.begin(), local.end(), out[k].begin() + static_cast<std::ptrdiff_t>(e.offset));
    }
  return out;
}

}  // namespace loom::train
