// A loom manifest of a Hugging Face model directory's model: config.json read the way
// hugging_face.cpp's read_hf checks it, written as the [model] section and layer
// options that compute the same model (the inverse of to_hf's config).
#include "engine/interop/hf_config.hpp"

#include "engine/files/read.hpp"
#include "engine/manifest/manifest.hpp"
#include "engine/text/tokenizer.hpp"

#include <boost/filesystem.hpp>

#include <algorithm>
#include <cmath>
#include <set>
#include <stdexcept>
#include <utility>
#include <vector>

namespace loom::interop {

namespace {

struct ModelType {
  const char* type;
  const char* architecture;
};
constexpr ModelType kModelTypes[] = {
    {"gpt2", "GPT2LMHeadModel"},          {"llama", "LlamaForCausalLM"},
    {"mistral", "MistralForCausalLM"},    {"mixtral", "MixtralForCausalLM"},
    {"qwen2", "Qwen2ForCausalLM"},        {"qwen2_moe", "Qwen2MoeForCausalLM"},
    {"qwen3", "Qwen3ForCausalLM"},        {"qwen3_moe", "Qwen3MoeForCausalLM"},
    {"deepseek_v2", "DeepseekV2ForCausalLM"}, {"deepseek_v3", "DeepseekV3ForCausalLM"}};

// One TOML section, its keys in the order they are set.
struct Section {
  std::string name, comment;
  std::vector<std::pair<std::string, std::string>> keys;
  void set(const std::string& key, const toml::node& value) {
    keys.emplace_back(key, manifest::to_toml_text(value));
  }
  void text(const std::string& key, const std::string& v) { set(key, toml::value<std::string>(v)); }
  void integer(const std::string& key, int64_t v) { set(key, toml::value<int64_t>(v)); }
  void real(const std::string& key, double v) { set(key, toml::value<double>(v)); }
  void flag(const std::string& key, bool v) { set(key, toml::value<bool>(v)); }
  void texts(const std::string& key, const std::vector<std::string>& v) {
    toml::array a;
    for (const std::string& s : v) a.push_back(s);
    set(key, a);
  }
};

// config.json's keys, each read once, with the file named in every refusal.
class Config {
 public:
  Config(nlohmann::json c, std::string where) : c_(std::move(c)), where_(std::move(where)) {}
  const std::string& where() const { return where_; }
  bool has(const char* k) const { return c_.contains(k) && !c_[k].is_null(); }
  const nlohmann::json& at(const char* k) const { return c_[k]; }
  int64_t integer(const char* k) const {
    if (!has(k) || !c_[k].is_number_integer() || c_[k].get<int64_t>() <= 0) fail(std::string("has no positive integer ") + k);
    return c_[k].get<int64_t>();
  }
  int64_t integer_or(const char* k, int64_t fallback) const { return has(k) ? integer(k) : fallback; }
  int64_t count_or(const char* k, int64_t fallback) const {  // >= 0
    if (!has(k)) return fallback;
    if (!c_[k].is_number_integer() || c_[k].get<int64_t>() < 0) fail(std::string(k) + " = " + c_[k].dump() + " is not a count");
    return c_[k].get<int64_t>();
  }
  double number_or(const char* k, double fallback) const {
    if (!has(k)) return fallback;
    if (!c_[k].is_number()) fail(std::string(k) + " = " + c_[k].dump() + " is not a number");
    return c_[k].get<double>();
  }
  bool flag_or(const char* k, bool fallback) const {
    if (!has(k)) return fallback;
    if (!c_[k].is_boolean()) fail(std::string(k) + " = " + c_[k].dump() + " is not true or false");
    return c_[k].get<bool>();
  }
  std::string text_or(const char* k, const std::string& fallback) const {
    if (!has(k)) return fallback;
    if (!c_[k].is_string()) fail(std::string(k) + " = " + c_[k].dump() + " is not a string");
    return c_[k].get<std::string>();
  }
  [[noreturn]] void fail(const std::string& what) const { throw std::runtime_error(where_ + ": " + what); }

 private:
  nlohmann::json c_;
  std::string where_;
};


// The rotary settings: rope_theta (at the top or in rope_parameters / rope_scaling) and
// a llama3 or yarn scaling, as attention options.
void rope_options(const Config& c, const HfConfigDefaults& d, Section& att) {
  double theta = c.number_or("rope_theta", 0.0);
  nlohmann::json scaling;
  for (const char* k : {"rope_parameters", "rope_scaling"}) {
    if (!c.has(k)) continue;
    const nlohmann::json& r = c.at(k);
    if (!r.is_object()) c.fail(std::string(k) + " = " + r.dump() + " is not an object");
    if (r.contains("rope_theta") && !r["rope_theta"].is_null()) {
      if (!r["rope_theta"].is_number()) c.fail(std::string(k) + ".rope_theta = " + r["rope_theta"].dump() + " is not a number");
      if (theta > 0.0 && r["rope_theta"].get<double>() != theta)
        c.fail(std::string(k) + ".rope_theta = " + r["rope_theta"].dump() + " differs from rope_theta = " + std::to_string(theta));
      theta = r["rope_theta"].get<double>();
    }
    const nlohmann::json named = r.contains("rope_type") ? r["rope_type"] : r.contains("type") ? r["type"] : nlohmann::json("default");
    if (!named.is_string()) c.fail(std::string(k) + ": rope_type " + named.dump() + " is not a string");
    const std::string type = named.get<std::string>();
    if (type == "llama3" || type == "yarn") scaling = r;
    else if (type != "default") c.fail(std::string(k) + " = " + r.dump() + " (scaled rotary frequencies) has no loom counterpart");
    if (r.contains("partial_rotary_factor") && r["partial_rotary_factor"] != 1.0)
      c.fail(std::string(k) + " = " + r.dump() + " rotates part of each head only, which loom's import does not map");
  }
  if (c.has("rope_theta") && theta <= 0.0) c.fail("rope_theta = " + c.at("rope_theta").dump() + " is not positive");
  att.real("rotary_base", theta > 0.0 ? theta : d.rope_theta);
  if (scaling.is_null()) return;
  const std::string type = (scaling.contains("rope_type") ? scaling["rope_type"] : scaling["type"]).get<std::string>();
  const auto number = [&](const char* k) {
    if (!scaling.contains(k) || !scaling[k].is_number() || !(scaling[k].get<double>() > 0.0))
      c.fail("rope_scaling " + scaling.dump() + " has no positive number " + k);
    return scaling[k].get<double>();
  };
  const auto position = [&](const char* k) {
    if (!scaling.contains(k) || !scaling[k].is_number_integer() || scaling[k].get<int64_t>() < 1)
      c.fail("rope_scaling " + scaling.dump() + " has no positive integer " + k);
    return scaling[k].get<int64_t>();
  };
  att.text("rope_scaling", type);
  att.real("rope_scaling_factor", number("factor"));
  if (type == "llama3") {
    att.real("rope_low_freq_factor", number("low_freq_factor"));
    att.real("rope_high_freq_factor", number("high_freq_factor"));
    att.integer("rope_original_max_position", position("original_max_position_embeddings"));
    return;
  }
  const double f = number("factor");
  att.integer("rope_original_max_position", scaling.contains("original_max_position_embeddings")
                                                ? position("original_max_position_embeddings")
                                                : c.integer("max_position_embeddings"));
  att.real("rope_beta_fast", rope_number(scaling, "beta_fast", 32.0));
  att.real("rope_beta_slow", rope_number(scaling, "beta_slow", 1.0));
  if (scaling.contains("truncate") && scaling["truncate"] == false)
    c.fail("rope_scaling.truncate = false (correction dimensions not rounded) has no loom counterpart");
  // transformers' factor on cos and sin, and loom's (Megatron-Core's ratio) from the
  // same mscale keys; the factor itself where they differ.
  const double m = rope_number(scaling, "mscale", 0.0), all = rope_number(scaling, "mscale_all_dim", 0.0);
  const double hf = hf_yarn_attention_factor(scaling);
  const double loom_m = m != 0.0 && all != 0.0 ? m : 1.0;
  att.real("rope_mscale", loom_m);
  att.real("rope_mscale_all_dim", all);
  if (std::fabs(yarn_mscale(f, loom_m) / yarn_mscale(f, all) - hf) > 1e-12 * hf) att.real("rope_attention_factor", hf);
}

// Each layer's kind (true: MoE) as transformers builds the model.
std::vector<bool> sparse_layers(const Config& c, const std::string& type, int64_t layers) {
  std::vector<bool> sparse(static_cast<size_t>(layers), true);
  if (type == "qwen2_moe" || type == "qwen3_moe") {
    const int64_t step = c.integer_or("decoder_sparse_step", 1);
    std::set<int64_t> dense;
    if (c.has("mlp_only_layers")) {
      if (!c.at("mlp_only_layers").is_array()) c.fail("mlp_only_layers is not a list of layer indices");
      for (const nlohmann::json& i : c.at("mlp_only_layers"))
        if (i.is_number_integer()) dense.insert(i.get<int64_t>());
    }
    for (int64_t l = 0; l < layers; ++l) sparse[static_cast<size_t>(l)] = !dense.count(l) && (l + 1) % step == 0;
  } else if (type == "deepseek_v2" || type == "deepseek_v3") {
    if (c.has("moe_layer_freq") && c.at("moe_layer_freq") != 1)
      c.fail("moe_layer_freq = " + c.at("moe_layer_freq").dump() + " leaves MoE layers dense, which transformers' "
             "DeepseekV2 and V3 do not");
    const int64_t first = c.count_or("first_k_dense_replace", type == "deepseek_v2" ? 0 : 3);
    for (int64_t l = 0; l < layers; ++l) sparse[static_cast<size_t>(l)] = l >= first;
  }
  return sparse;
}

// "dense*3", "block*58": runs of the two kinds (model.block_pattern).
std::vector<std::string> block_pattern(const std::vector<bool>& sparse) {
  std::vector<std::string> out;
  for (size_t i = 0; i < sparse.size();) {
    size_t j = i;
    while (j < sparse.size() && sparse[j] == sparse[i]) ++j;
    out.push_back(std::string(sparse[i] ? "block" : "dense") + "*" + std::to_string(j - i));
    i = j;
  }
  return out;
}

// The sliding window every layer's attention slides (0: none); mixed layers are refused.
int64_t sliding_window(const Config& c, const std::string& type, const HfConfigDefaults& d, int64_t layers) {
  const bool qwen = type.rfind("qwen", 0) == 0;
  if (type == "llama" || type == "gpt2" || type.rfind("deepseek", 0) == 0) return 0;
  if (qwen && !c.flag_or("use_sliding_window", false)) return 0;
  const nlohmann::json w = c.has("sliding_window") ? c.at("sliding_window") : d.sliding_window;
  if (w.is_null()) return 0;
  if (!w.is_number_integer() || w.get<int64_t>() <= 0) c.fail("sliding_window = " + w.dump() + " is not a positive integer");
  if (qwen) {
    int64_t windowed = 0;
    if (c.has("layer_types") && c.at("layer_types").is_array()) {
      for (const nlohmann::json& t : c.at("layer_types")) windowed += t != "full_attention" ? 1 : 0;
    } else {  // layers from max_window_layers on slide (0: every one)
      windowed = layers - std::clamp<int64_t>(c.count_or("max_window_layers", 28), 0, layers);
    }
    if (windowed == 0) return 0;
    if (windowed < layers)
      c.fail(std::to_string(windowed) + " of the " + std::to_string(layers) + " layers slide a window and the others "
             "see every earlier token; loom's import maps one attention for every layer");
  }
  return w.get<int64_t>();
}

void moe_options(const Config& c, const nlohmann::json& json, const std::string& type, Section& moe) {
  const HfConfigDefaults d = hf_config_defaults(type);
  moe.text("norm", "rmsnorm");
  moe.text("activation", "swiglu");
  moe.flag("bias", false);
  if (type == "mixtral") {
    moe.integer("num_experts", c.integer_or("num_local_experts", d.experts));
    moe.integer("top_k", c.integer_or("num_experts_per_tok", d.experts_per_token));
    moe.real("aux_loss_coeff", c.number_or("router_aux_loss_coef", 0.001));
    return;
  }
  if (type == "qwen2_moe" || type == "qwen3_moe") {
    moe.integer("num_experts", c.integer_or("num_experts", d.experts));
    moe.integer("top_k", c.integer_or("num_experts_per_tok", d.experts_per_token));
    moe.integer("ffn_hidden_size", c.integer_or("moe_intermediate_size", d.expert_ffn));
    moe.flag("pre_softmax", !c.flag_or("norm_topk_prob", false));
    moe.real("aux_loss_coeff", c.number_or("router_aux_loss_coef", 0.001));
    if (type == "qwen2_moe") {
      moe.integer("shared_expert_ffn_hidden_size", c.integer_or("shared_expert_intermediate_size", d.shared_expert_ffn));
      moe.flag("shared_expert_gate", true);
    }
    return;
  }
  const bool v2 = type == "deepseek_v2";
  const int64_t expert_ffn = c.integer_or("moe_intermediate_size", d.expert_ffn);
  moe.integer("num_experts", c.integer_or("n_routed_experts", d.experts));
  if (!c.has("num_experts_per_tok") && d.experts_per_token == 0)
    c.fail("has no num_experts_per_tok (DeepseekV2Config has no default)");
  moe.integer("top_k", c.integer_or("num_experts_per_tok", d.experts_per_token));
  moe.integer("ffn_hidden_size", expert_ffn);
  if (json.contains("n_shared_experts") && json["n_shared_experts"].is_null())
    c.fail("n_shared_experts = null: DeepSeek's MoE layers without shared experts are not mapped");
  moe.integer("shared_expert_ffn_hidden_size", c.integer_or("n_shared_experts", d.shared_experts) * expert_ffn);
  moe.real("topk_scaling_factor", c.number_or("routed_scaling_factor", d.routed_scaling));
  moe.real("aux_loss_coeff", 0.0);  // DeepSeek's balance is the expert bias (V3) or its own losses
  const std::string method = c.text_or("topk_method", v2 ? "greedy" : "noaux_tc");
  const std::string scoring = c.text_or("scoring_func", v2 ? "softmax" : "sigmoid");
  if (scoring != (v2 ? "softmax" : "sigmoid"))
    c.fail("scoring_func = \"" + scoring + "\"; transformers' " + (v2 ? "DeepseekV2 routes by softmax" : "DeepseekV3 by sigmoid"));
  if (v2 ? method != "greedy" && method != "group_limited_greedy" : method != "noaux_tc")
    c.fail("topk_method = \"" + method + "\" is not " + (v2 ? "greedy or group_limited_greedy" : "noaux_tc"));
  if (!v2 && !c.flag_or("norm_topk_prob", true))
    c.fail("norm_topk_prob = false: loom's sigmoid router renormalises the chosen experts' gates");
  if (v2) {
    moe.flag("pre_softmax", true);
    if (method == "group_limited_greedy") {
      moe.integer("num_groups", c.integer("n_group"));
      moe.integer("group_topk", c.integer("topk_group"));
      moe.text("group_score", "best");
    }
    return;
  }
  moe.text("score_function", "sigmoid");
  moe.integer("num_groups", c.integer_or("n_group", d.expert_groups));
  moe.integer("group_topk", c.integer_or("topk_group", d.group_topk));
  moe.flag("expert_bias", true);
}

// Text for a comment line: control characters (a newline in a path) as '?'.
std::string comment_text(std::string s) {
  for (char& ch : s)
    if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f) ch = '?';
  return s;
}

void write_section(std::string& out, const Section& s) {
  out += "\n";
  if (!s.comment.empty()) out += s.comment;
  out += "[" + s.name + "]\n";
  for (const auto& [k, v] : s.keys) out += k + " = " + v + "\n";
}

}  // namespace

double yarn_mscale(double scale, double m) { return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; }

double rope_number(const nlohmann::json& r, const char* key, double fallback) {
  return r.contains(key) && r[key].is_number() && r[key].get<double>() != 0.0 ? r[key].get<double>() : fallback;
}

double hf_yarn_attention_factor(const nlohmann::json& r) {
  if (r.contains("attention_factor") && r["attention_factor"].is_number()) return r["attention_factor"].get<double>();
  const double f = r["factor"].get<double>(), m = rope_number(r, "mscale", 0.0), all = rope_number(r, "mscale_all_dim", 0.0);
  return m != 0.0 && all != 0.0 ? yarn_mscale(f, m) / yarn_mscale(f, all) : yarn_mscale(f, 1.0);
}

HfConfigDefaults hf_config_defaults(const std::string& type) {
  if (!hf_architecture_of(type)) throw std::runtime_error("model_type \"" + type + "\" is not one loom maps");
  HfConfigDefaults d;
  d.tie_word_embeddings = type == "gpt2";
  d.rms_norm_eps = type == "mixtral" ? 1e-5 : 1e-6;
  d.rope_theta = type == "mixtral" ? 1e6 : 1e4;
  if (type == "deepseek_v3") d.kv_heads = 128;
  if (type == "qwen2") d.kv_heads = 32;
  if (type == "qwen2_moe") d.kv_heads = 16;
  if (type == "mistral" || type == "mixtral") d.kv_heads = 8;
  if (type == "qwen3") d.kv_heads = 32, d.head_dim = 128;
  if (type == "qwen3_moe") d.kv_heads = 4;
  if (type == "mistral" || type == "qwen2" || type == "qwen2_moe" || type == "qwen3" || type == "qwen3_moe")
    d.sliding_window = 4096;
  // MixtralConfig's, Qwen2MoeConfig's, Qwen3MoeConfig's, DeepseekV2Config's, DeepseekV3Config's.
  if (type == "mixtral") d.experts = 8, d.experts_per_token = 2;
  if (type == "qwen2_moe") d.experts = 60, d.experts_per_token = 4, d.expert_ffn = 1408, d.shared_expert_ffn = 5632;
  if (type == "qwen3_moe") d.experts = 128, d.experts_per_token = 8, d.expert_ffn = 768;
  if (type == "deepseek_v2") d.experts = 64, d.expert_ffn = 1407, d.shared_experts = 2, d.dense_ffn = 11008;
  if (type == "deepseek_v3") {
    d.experts = 256, d.experts_per_token = 8, d.expert_ffn = 2048, d.shared_experts = 1, d.dense_ffn = 18432;
    d.expert_groups = 8, d.group_topk = 4, d.routed_scaling = 2.5;
  }
  return d;
}

const char* hf_architecture_of(const std::string& type) {
  for (const ModelType& m : kModelTypes)
    if (type == m.type) return m.architecture;
  return nullptr;
}

std::string manifest_for_hf(const std::string& dir, int64_t seq_length) {
  namespace fs = boost::filesystem;
  const std::string where = (fs::path(dir) / "config.json").string();
  std::string why;
  const std::optional<std::string> text = files::read_whole_file(where, &why);
  if (!text) throw std::runtime_error(where + ": cannot read the file (" + why + "; a Hugging Face model directory "
                                      "holds config.json and model.safetensors)");
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(*text);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(where + " is not JSON: " + e.what());
  }
  if (!json.is_object()) throw std::runtime_error(where + " is not a JSON object");
  const Config c(json, where);
  const std::string type = c.has("model_type") && c.at("model_type").is_string() ? c.text_or("model_type", "") : "";
  const char* arch = hf_architecture_of(type);
  if (!arch) {
    std::string known;
    for (const ModelType& m : kModelTypes) known += std::string(known.empty() ? "" : ", ") + m.type;
    c.fail("model_type = " + (c.has("model_type") ? c.at("model_type").dump() : std::string("(none)")) +
           " is not one loom maps (" + known + ")");
  }
  if (c.has("architectures") && (!c.at("architectures").is_array() || c.at("architectures").size() != 1 ||
                                 c.at("architectures")[0] != arch))
    c.fail("architectures = " + c.at("architectures").dump() + ", but model_type \"" + type + "\" is " + arch + "'s");
  const HfConfigDefaults d = hf_config_defaults(type);
  const bool gpt2 = type == "gpt2", deepseek = type.rfind("deepseek", 0) == 0;
  const bool moe_type = type == "mixtral" || type == "qwen2_moe" || type == "qwen3_moe" || deepseek;

  Section model{"model", "", {}};
  const int64_t hidden = c.integer(gpt2 ? "n_embd" : "hidden_size"), heads = c.integer(gpt2 ? "n_head" : "num_attention_heads");
  const int64_t layers = c.integer(gpt2 ? "n_layer" : "num_hidden_layers");
  const int64_t context = gpt2 ? c.integer("n_positions") : c.integer_or("max_position_embeddings", 4096);
  if (seq_length > (int64_t{1} << 24)) c.fail("--seq-length " + std::to_string(seq_length) + " is above 16777216");
  if (gpt2 && seq_length > context)
    c.fail("--seq-length " + std::to_string(seq_length) + " is longer than n_positions = " + std::to_string(context) +
           ", GPT-2's position table");
  const int64_t seq = seq_length > 0 ? seq_length : std::min<int64_t>(context, 4096);
  model.integer("hidden_size", hidden);
  model.integer("num_heads", heads);
  model.integer("num_layers", layers);
  // The dense MLPs' width (Mixtral's experts' too, whose option then defaults to it).
  model.integer("ffn_hidden_size", gpt2               ? (c.has("n_inner") ? c.integer("n_inner") : 4 * hidden)
                                   : d.dense_ffn > 0 ? c.integer_or("intermediate_size", d.dense_ffn)
                                                     : c.integer("intermediate_size"));
  model.integer("seq_length", seq);
  model.integer("vocab_size", c.integer("vocab_size"));
  model.flag("tie_embeddings", c.flag_or("tie_word_embeddings", d.tie_word_embeddings));

  std::vector<Section> layer_sections;
  if (gpt2) {
    if (c.text_or("activation_function", "gelu_new") != "gelu_new")
      c.fail("activation_function = \"" + c.text_or("activation_function", "") + "\"; loom's GPT-2 MLP is gelu_new's");
    const double eps = c.number_or("layer_norm_epsilon", 1e-5);
    for (const char* l : {"attention", "mlp", "lm_head"}) {
      Section s{std::string("model.layer.") + l, "", {}};
      if (eps != 1e-5) s.real("norm_epsilon", eps);
      if (!s.keys.empty()) layer_sections.push_back(std::move(s));
    }
  } else {
    const int64_t head_dim = c.integer_or("head_dim", d.head_dim > 0 ? d.head_dim : hidden / heads);
    const double eps = c.number_or("rms_norm_eps", d.rms_norm_eps);
    if (c.has("hidden_act") && c.text_or("hidden_act", "") != "silu")
      c.fail("hidden_act = " + c.at("hidden_act").dump() + "; loom's SwiGLU gates with silu");
    if (c.flag_or("mlp_bias", false)) c.fail("mlp_bias = true; loom maps bias-free MLPs");
    if (c.flag_or("attention_bias", false)) c.fail("attention_bias = true; loom maps bias-free projections (Qwen2: q, k, v)");
    Section emb{"model.layer.embedding", "", {}};
    emb.text("position_embedding", "rope");
    Section att{"model.layer.attention", "", {}};
    att.text("norm", "rmsnorm");
    att.real("norm_epsilon", eps);
    att.flag("bias", false);
    att.text("position_embedding", "rope");
    rope_options(c, d, att);
    if (deepseek) {
      if (eps != 1e-6)
        c.fail("rms_norm_eps = " + std::to_string(eps) + "; DeepSeek's latent norms use 1e-6, and loom's layers one "
               "epsilon");
      att.flag("multi_latent_attention", true);
      // null: q projected directly (DeepSeek-V2-Lite); absent: the config classes' 1536.
      const bool direct = json.contains("q_lora_rank") && json["q_lora_rank"].is_null();
      att.integer("q_lora_rank", direct ? 0 : c.integer_or("q_lora_rank", 1536));
      att.integer("kv_lora_rank", c.integer_or("kv_lora_rank", 512));
      att.integer("qk_head_dim", c.integer_or("qk_nope_head_dim", 128));
      att.integer("qk_pos_emb_head_dim", c.integer_or("qk_rope_head_dim", 64));
      att.integer("v_head_dim", c.integer_or("v_head_dim", 128));
    } else {
      if (hidden % heads != 0 || head_dim != hidden / heads)
        c.fail("head_dim = " + std::to_string(head_dim) + ", not hidden_size / num_attention_heads = " +
               std::to_string(hidden / heads) + ": loom's attention heads split the hidden size");
      const int64_t kv = c.integer_or("num_key_value_heads", d.kv_heads > 0 ? d.kv_heads : heads);
      if (kv != heads) att.integer("num_query_groups", kv);
      if (type == "qwen3" || type == "qwen3_moe") att.flag("qk_norm", true);
      if (type == "qwen2" || type == "qwen2_moe") att.flag("add_qkv_bias", true);
      if (const int64_t w = sliding_window(c, type, d, layers); w > 0) att.integer("sliding_window", w);
    }
    Section mlp{"model.layer.mlp", "", {}};
    mlp.text("norm", "rmsnorm");
    mlp.real("norm_epsilon", eps);
    mlp.text("activation", "swiglu");
    mlp.flag("bias", false);
    Section head{"model.layer.lm_head", "", {}};
    head.text("norm", "rmsnorm");
    head.real("norm_epsilon", eps);
    layer_sections = {emb, att, mlp};
    // DeepSeek's n_routed_experts = null is a dense model.
    const bool no_experts = deepseek && json.contains("n_routed_experts") && json["n_routed_experts"].is_null();
    bool patterned = false;
    if (moe_type && !no_experts) {
      const std::vector<bool> sparse = sparse_layers(c, type, layers);
      const bool any_sparse = std::find(sparse.begin(), sparse.end(), true) != sparse.end();
      const bool any_dense = std::find(sparse.begin(), sparse.end(), false) != sparse.end();
      if (any_sparse) {
        Section moe{"model.layer.moe", "", {}};
        moe.real("norm_epsilon", eps);
        moe_options(c, json, type, moe);
        model.texts("block", {"attention", "moe"});
        if (any_dense) model.texts("block_pattern", block_pattern(sparse)), patterned = true;
        else layer_sections.pop_back();  // no dense MLP: its section would configure nothing
        layer_sections.push_back(std::move(moe));
      }
    }
    if (const int64_t mtp = c.count_or("num_nextn_predict_layers", 0); mtp > 0)
      model.comment = "# DeepSeek-V3's multi-token prediction (num_nextn_predict_layers = " + std::to_string(mtp) +
                      ") is not mapped: its layers'\n# weights (model.layers." + std::to_string(layers) +
                      ".*) are left unread by the import.\n";
    layer_sections.push_back(std::move(head));
    if (patterned) {
      // The dense blocks' kind, before the pattern naming it.
      Section blocks{"model.blocks", "", {}};
      blocks.texts("dense", {"attention", "mlp"});
      layer_sections.insert(layer_sections.begin(), std::move(blocks));
    }
  }

  // The tokenizer beside the weights, when loom reads it.
  std::string tokenizer, no_tokenizer;
  const bool has_files = fs::exists(fs::path(dir) / "encoder.json") || fs::exists(fs::path(dir) / "tokenizer.json") ||
                         fs::exists(fs::path(dir) / "tokenizer.model");
  try {
    if (!has_files) throw std::runtime_error("no tokenizer files beside the model (tokenizer.json, tokenizer.model)");
    text::load_tokenizer(dir);
    tokenizer = fs::absolute(dir).lexically_normal().string();
  } catch (const std::exception& e) {
    no_tokenizer = e.what();
  }
  const std::string name = fs::absolute(dir).lexically_normal().filename().string();
  std::string out = "# " + comment_text(name) + " (" + arch + ") as a loom model, from " + comment_text(where) + "\n"
                    "# (loom import --write-manifest). [model] and [model.*] compute the model the\n"
                    "# config describes; `loom import " + comment_text(dir) + " THIS_FILE OUTDIR` checks them against it\n"
                    "# again and writes the checkpoint. The rest is a fine-tuning run to edit: layout,\n"
                    "# device, batch, optimizer and the data, token files of the model's tokenizer.\n";
  Section run{"run", "", {}};
  run.text("name", name + "-finetune");
  run.integer("steps", 1000);
  run.integer("log_every", 10);
  run.integer("eval_every", 0);
  write_section(out, run);
  write_section(out, model);
  for (const Section& s : layer_sections) write_section(out, s);
  Section parallel{"parallel", "", {}};
  parallel.integer("tp", 1);
  parallel.integer("pp", 1);
  parallel.integer("dp", 1);
  write_section(out, parallel);
  Section batch{"batch", "", {}};
  batch.integer("micro_batch_size", 1);
  batch.integer("global_batch_size", 8);
  write_section(out, batch);
  Section opt{"optimizer", "", {}};
  opt.real("lr", 1e-5);
  opt.real("min_lr", 1e-6);
  opt.integer("warmup_steps", 50);
  opt.real("weight_decay", 0.1);
  opt.real("clip_grad", 1.0);
  write_section(out, opt);
  Section device{"device", "", {}};
  device.text("kind", "cpu");
  // A bf16 checkpoint imports as it is (fp32 master weights in the optimizer).
  if (c.text_or("torch_dtype", c.text_or("dtype", "")) == "bfloat16") device.text("param_dtype", "bf16");
  write_section(out, device);
  Section data{"data",
               "# Token files of your text in the model's tokenizer, e.g.\n"
               "#   loom preprocess --tokenizer " + (tokenizer.empty() ? std::string("TOKENIZER") : comment_text(tokenizer)) +
                   " --input corpus.jsonl --output-prefix corpus --append-eod\n"
                   "# or conversations to fine-tune on (one {\"messages\": [...]} a line): kind = \"chat\",\n"
                   "# path = \"chats.jsonl\", and checkpoint.init_weights = the model's directory\n",
               {}};
  if (!no_tokenizer.empty()) {
    std::string first_line = no_tokenizer.substr(0, no_tokenizer.find('\n'));
    data.comment += "# (no data.tokenizer: " + comment_text(first_line) + ")\n";
  }
  data.text("kind", "indexed");
  data.text("path", "corpus");
  if (!tokenizer.empty()) data.text("tokenizer", tokenizer);
  write_section(out, data);
  return out;
}

}  // namespace loom::interop
