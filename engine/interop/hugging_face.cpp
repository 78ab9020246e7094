#include "engine/interop/hugging_face.hpp"

#include "engine/interop/hf_config.hpp"

#include "engine/files/read.hpp"
#include "engine/files/temporaries.hpp"

#include "engine/text/chat_template.hpp"
#include "engine/text/tokenizer.hpp"

#include "engine/train/checkpoint.hpp"
#include "engine/train/init_weights.hpp"
#include "engine/train/run_plan.hpp"

#include <algorithm>
#include <boost/filesystem.hpp>

#include <map>
#include <set>
#include <memory>

#include <cerrno>
#include <cstdio>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <tuple>

namespace loom::interop {

namespace {

using train::WholeTensor;

// A [rows, cols] matrix of `elem`-byte elements.
struct Matrix {
  int64_t rows = 0, cols = 0;
  size_t elem = 4;
  std::vector<char> data;
};

Matrix matrix_of(const WholeTensor& t) {
  Matrix m;
  m.elem = t.dtype == LOOM_DTYPE_BF16 ? 2 : 4;
  m.rows = t.shape.size() > 1 ? t.shape[0] : 1;  // a vector is one row
  m.cols = t.numel() / std::max<int64_t>(1, m.rows);
  m.data = t.data;
  return m;
}

// Columns [c0, c0 + n) of m.
Matrix columns(const Matrix& m, int64_t c0, int64_t n) {
  Matrix out{m.rows, n, m.elem, std::vector<char>(static_cast<size_t>(m.rows * n) * m.elem)};
  for (int64_t r = 0; r < m.rows; ++r)
    std::memcpy(out.data.data() + r * n * m.elem, m.data.data() + (r * m.cols + c0) * m.elem,
                static_cast<size_t>(n) * m.elem);
  return out;
}

// Columns of m taken in `pieces`: (first column, count) each, side by side.
Matrix gather_columns(const Matrix& m, const std::vector<std::pair<int64_t, int64_t>>& pieces) {
  int64_t n = 0;
  for (const auto& p : pieces) n += p.second;
  Matrix out{m.rows, n, m.elem, std::vector<char>(static_cast<size_t>(m.rows * n) * m.elem)};
  int64_t at = 0;
  for (const auto& [c0, count] : pieces) {
    const Matrix part = columns(m, c0, count);
    for (int64_t r = 0; r < m.rows; ++r)
      std::memcpy(out.data.data() + (r * n + at) * m.elem, part.data.data() + r * count * m.elem,
                  static_cast<size_t>(count) * m.elem);
    at += count;
  }
  return out;
}

Matrix transposed(const Matrix& m) {
  Matrix out{m.cols, m.rows, m.elem, std::vector<char>(m.data.size())};
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c)
      std::memcpy(out.data.data() + (c * m.rows + r) * m.elem, m.data.data() + (r * m.cols + c) * m.elem, m.elem);
  return out;
}

class Builder {
 public:
  Builder(const train::WholeCheckpoint& ck) : ck_(ck) {}

  const WholeTensor& get(const std::string& name) const {
    const WholeTensor* t = ck_.find(name);
    if (t == nullptr) throw std::runtime_error("the checkpoint has no parameter " + name);
    return *t;
  }
  std::string dtype() const { return ck_.meta.param_dtype == "bf16" ? "BF16" : "F32"; }

  // A tensor as it is (vectors, Conv1D weights).
  void as_is(const std::string& to, const std::string& from) {
    const WholeTensor& t = get(from);
    out_.push_back({to, dtype(), t.shape, t.data});
  }
  void matrix(const std::string& to, const Matrix& m) {
    out_.push_back({to, dtype(), {m.rows, m.cols}, m.data});
  }
  void vector(const std::string& to, const Matrix& row) { out_.push_back({to, dtype(), {row.cols}, row.data}); }
  // A vector of fp32 values (a layer's state) as F32 whatever the parameters' dtype, as
  // transformers keeps DeepSeek-V3's e_score_correction_bias.
  void values(const std::string& to, const std::vector<float>& v) {
    std::vector<char> data(v.size() * sizeof(float));
    std::memcpy(data.data(), v.data(), data.size());
    out_.push_back({to, "F32", {static_cast<int64_t>(v.size())}, std::move(data)});
  }
  // An embedding table without the padded vocabulary's rows.
  void vocab_rows(const std::string& to, const std::string& from, int64_t vocab) {
    const WholeTensor& t = get(from);
    const size_t row = static_cast<size_t>(t.shape[1]) * (t.dtype == LOOM_DTYPE_BF16 ? 2 : 4);
    out_.push_back({to, dtype(), {vocab, t.shape[1]}, std::vector<char>(t.data.begin(), t.data.begin() + vocab * row)});
  }
  std::vector<NamedTensor> take() { return std::move(out_); }

 private:
  const train::WholeCheckpoint& ck_;
  std::vector<NamedTensor> out_;
};

std::string option_string(const toml::table& t, const char* key, const std::string& fallback) {
  return t[key].value_or(fallback);
}

// rope_scaling = "yarn" as a rope_scaling object: its keys always written, and
// attention_factor when loom's (rope_attention_factor, or Megatron-Core's mscale ratio,
// which keeps rope_mscale without rope_mscale_all_dim) is not what transformers derives.
nlohmann::json yarn_rope(const toml::table& att) {
  const double f = att["rope_scaling_factor"].value_or(8.0), m = att["rope_mscale"].value_or(1.0),
               all = att["rope_mscale_all_dim"].value_or(0.0), given = att["rope_attention_factor"].value_or(0.0);
  nlohmann::json r = {{"rope_type", "yarn"},
                      {"factor", f},
                      {"original_max_position_embeddings", att["rope_original_max_position"].value_or(int64_t{8192})},
                      {"beta_fast", att["rope_beta_fast"].value_or(32.0)},
                      {"beta_slow", att["rope_beta_slow"].value_or(1.0)},
                      {"mscale", m},
                      {"mscale_all_dim", all}};
  const double loom = given > 0.0 ? given : yarn_mscale(f, m) / yarn_mscale(f, all);
  if (std::fabs(loom - hf_yarn_attention_factor(r)) > 1e-12 * loom) r["attention_factor"] = loom;
  return r;
}

// What the blocks are, from the layer options (defaults as the plugins declare them).
struct Shape {
  bool gpt2 = false, llama = false, mixtral = false;
  // Multi-latent attention in Llama's blocks, before dense MLPs or DeepSeek-V3's MoE:
  // DeepSeek-V3's (DeepseekV3ForCausalLM; `moe` says which of the two).
  bool deepseek = false, moe = false;  // moe: some layers are MoE (sparse)
  // DeepSeek-V2's router (DeepseekV2ForCausalLM): the softmax's top-k over all experts
  // (in groups with group_limited_greedy), gates its values times
  // routed_scaling_factor, no bias; else DeepSeek-V3's (sigmoid, expert bias).
  bool deepseek_v2 = false;
  std::vector<bool> sparse;  // by layer: an MoE (else a dense MLP)
  // The layers a dense MLP: the first_k_dense_replace of DeepSeek-V3, mlp_only_layers of Qwen3-MoE.
  int64_t first_sparse() const { return std::find(sparse.begin(), sparse.end(), true) - sparse.begin(); }
  std::vector<int64_t> dense_layers() const {
    std::vector<int64_t> out;
    for (size_t i = 0; i < sparse.size(); ++i)
      if (!sparse[i]) out.push_back(static_cast<int64_t>(i));
    return out;
  }
  struct Latent {
    int64_t q_rank = 0, kv_rank = 0, nope = 0, rope = 0, v = 0;
  } latent;
  // DeepSeek-V3's router: groups of experts (0: none), the groups each token picks, the
  // gates' scale, the shared expert's width, whether the router keeps a bias (state).
  int64_t groups_of_experts = 0, group_topk = 0, shared_ffn = 0;
  bool groups_by_best = false;  // a group ranked by its best score (group_score = "best"; DeepSeek-V2's)
  double routed_scaling = 1.0;
  bool expert_bias = false;
  // Whether the groups limit a token's experts (not when every group is picked).
  bool limits_groups() const { return groups_of_experts > 1 && group_topk < groups_of_experts; }
  // Llama's or Mixtral's blocks with each head's q and k RMSNorm-ed (qk_norm): Qwen3's
  // and Qwen3-MoE's; with biases on q, k and v (add_qkv_bias): Qwen2's and Qwen2-MoE's
  // (whose MoE blocks have a shared expert, gated).
  bool qk_norm = false, qkv_bias = false;
  // The attention's sliding_window (0: none). Llama's blocks with one are Mistral's;
  // an imported Mistral's config says which of the two it is (Mistral's window may be
  // none, or longer than the sequences).
  int64_t window = 0;
  bool mistral = false;
  int64_t groups = 0;
  double theta = 10000.0, eps = 1e-5;
  int64_t experts = 0, top_k = 0, expert_ffn = 0;  // the sparse MoE blocks
  double aux = 0.0;
  bool pre_softmax = false;  // the gates: softmax over all experts (Qwen3-MoE's norm_topk_prob = false)
  // The attention's rope_scaling ("llama3" or "yarn": transformers' rope_type of the
  // same name), as the config's rope_scaling object says it; null without.
  nlohmann::json scaled_rope;
  std::string rope_type() const { return scaled_rope.is_null() ? "default" : scaled_rope["rope_type"].get<std::string>(); }
  // The layers' instance names with a trailing '.': the embedding, each block's
  // attention and its MLP or MoE, the head.
  std::string embedding, head;
  std::vector<std::string> attention, ffn;
  std::string architecture() const {
    if (gpt2) return "GPT2LMHeadModel";
    if (deepseek) return deepseek_v2 ? "DeepseekV2ForCausalLM" : "DeepseekV3ForCausalLM";
    if (llama)
      return qkv_bias ? "Qwen2ForCausalLM" : qk_norm ? "Qwen3ForCausalLM" : mistral ? "MistralForCausalLM" : "LlamaForCausalLM";
    return qkv_bias ? "Qwen2MoeForCausalLM" : qk_norm ? "Qwen3MoeForCausalLM" : "MixtralForCausalLM";
  }
  std::string model_type() const {
    if (deepseek) return deepseek_v2 ? "deepseek_v2" : "deepseek_v3";
    return gpt2    ? "gpt2"
           : llama ? (qkv_bias ? "qwen2" : qk_norm ? "qwen3" : mistral ? "mistral" : "llama")
                   : (qkv_bias ? "qwen2_moe" : qk_norm ? "qwen3_moe" : "mixtral");
  }
  // Qwen2's and Qwen3's keys (use_sliding_window, max_window_layers, layer_types).
  bool qwen() const { return qk_norm || qkv_bias; }
  // Per-expert tensors named as Qwen3-MoE's (mlp.gate, mlp.experts.<j>.gate_proj, ...).
  bool qwen_style_experts() const { return qk_norm || qkv_bias || deepseek; }
  // transformers' defaults, for a key a config.json leaves out (hf_config.hpp).
  double default_eps() const { return hf_config_defaults(model_type()).rms_norm_eps; }
  int64_t default_kv_heads(int64_t heads) const {
    const int64_t kv = hf_config_defaults(model_type()).kv_heads;
    return kv > 0 ? kv : heads;
  }
  int64_t default_head_dim(int64_t hidden, int64_t heads) const {
    const int64_t d = hf_config_defaults(model_type()).head_dim;
    return d > 0 ? d : hidden / heads;
  }
  double default_theta() const { return hf_config_defaults(model_type()).rope_theta; }
  nlohmann::json default_window() const { return hf_config_defaults(model_type()).sliding_window; }
};

// A window reaching back over a whole sequence of seq_len tokens is no window there.
int64_t effective_window(int64_t window, int64_t seq_len) { return window > 0 && window < seq_len ? window : 0; }

// The epsilon of transformers' DeepseekV3 latent norms (DeepseekV3RMSNorm's default).
constexpr double kDeepSeekLatentEps = 1e-6;

// Qwen2-MoE's blocks (transformers' Qwen2MoeSparseMoeBlock): the softmax's top-k with
// either gate (norm_topk_prob), beside a shared expert gated by the sigmoid of one
// weight row (shared_expert_gate), which every MoE layer has; no sliding window (its
// layer_types alternate).
void qwen2_moe_shape(const toml::table& e, const manifest::RunConfig& c, Shape& s) {
  s.shared_ffn = e["shared_expert_ffn_hidden_size"].value_or(int64_t{0});
  if (s.shared_ffn <= 0 || !e["shared_expert_gate"].value_or(false) || e["capacity_factor"].value_or(0.0) != 0.0)
    throw std::runtime_error("Qwen2-MoE's MoE blocks are dropless top-k beside a shared expert gated by a sigmoid: set "
                             "shared_expert_ffn_hidden_size > 0 and shared_expert_gate = true, and leave "
                             "capacity_factor out");
  if (effective_window(s.window, c.model.seq_length) > 0)
    throw std::runtime_error("Qwen2-MoE's sliding windows alternate by layer (its layer_types), which these blocks "
                             "(sliding_window = " + std::to_string(s.window) + " on every layer) are not");
}

// DeepSeek-V2's router (transformers' DeepseekV2Moe): the softmax over every expert,
// the top_k of its values (greedy; group_limited_greedy: from the topk_group groups of
// the best single value), which are the gates, times routed_scaling_factor, and
// n_shared_experts experts beside. loom's softmax router with pre_softmax computes
// that; a group ranked by its top_k / group_topk best is DeepSeek-V2's only at 1.
void deepseek_v2_router(const toml::table& ffn, Shape& s) {
  s.deepseek_v2 = true;
  if (!ffn["pre_softmax"].value_or(false))
    throw std::runtime_error("DeepSeek-V2's gates are the softmax over every expert (not renormalised over the chosen "
                             "ones): set pre_softmax = true (or score_function = \"sigmoid\" for DeepSeek-V3's router)");
  if (s.expert_bias)
    throw std::runtime_error("DeepSeek-V2's router has no expert bias (DeepSeek-V3's sigmoid router has): set "
                             "expert_bias = false");
  if (s.limits_groups() && !s.groups_by_best && s.top_k != s.group_topk)
    throw std::runtime_error("DeepSeek-V2 ranks a group of experts by its best score, loom by the sum of its top_k / "
                             "group_topk = " + std::to_string(s.top_k / s.group_topk) +
                             " best: set group_score = \"best\"");
  if (s.shared_ffn <= 0 || s.shared_ffn % s.expert_ffn != 0)
    throw std::runtime_error("DeepSeek-V2's MoE layers have n_shared_experts shared experts of the routed ones' width: "
                             "shared_expert_ffn_hidden_size = " + std::to_string(s.shared_ffn) +
                             " must be a positive multiple of the experts' ffn_hidden_size = " +
                             std::to_string(s.expert_ffn));
  if (ffn["shared_expert_gate"].value_or(false) || ffn["capacity_factor"].value_or(0.0) != 0.0)
    throw std::runtime_error("DeepSeek-V2's MoE blocks are dropless with an ungated shared expert: shared_expert_gate "
                             "and capacity_factor have no counterpart");
}

// DeepSeek-V2/V3's settings from the attention's and the MoE's options (their defaults as
// the plugins declare them), refusing what transformers' DeepseekV2/V3 compute otherwise.
void deepseek_shape(const toml::table& att, const toml::table& ffn, const manifest::RunConfig& c, Shape& s) {
  const int64_t head = c.model.hidden_size / c.model.num_heads;
  const auto size = [&](const char* key, int64_t fallback) {
    const int64_t v = att[key].value_or(int64_t{0});
    return v > 0 ? v : fallback;
  };
  s.latent = {.q_rank = att["q_lora_rank"].value_or(int64_t{0}), .kv_rank = att["kv_lora_rank"].value_or(int64_t{0}),
              .nope = size("qk_head_dim", head), .rope = size("qk_pos_emb_head_dim", head / 2 / 2 * 2),
              .v = size("v_head_dim", head)};
  if (effective_window(s.window, c.model.seq_length) > 0)
    throw std::runtime_error("DeepSeek-V2/V3's attention has no sliding window (sliding_window = " +
                             std::to_string(s.window) + ")");
  if (s.rope_type() == "llama3")
    throw std::runtime_error("rope_scaling = \"llama3\" has no DeepSeek-V2/V3 counterpart (their long-context scaling "
                             "is YaRN's: rope_scaling = \"yarn\")");
  // transformers' q_a_layernorm and kv_a_layernorm keep RMSNorm's default epsilon
  // whatever rms_norm_eps says; loom's latents use the layer's norm_epsilon.
  if (s.eps != kDeepSeekLatentEps)
    throw std::runtime_error("DeepSeek-V2/V3 normalise their latents with epsilon 1e-6 whatever rms_norm_eps says, and "
                             "these layers use norm_epsilon = " + std::to_string(s.eps) +
                             ": set norm_epsilon = 1e-6 on every layer");
  if (!s.moe) return;
  s.experts = ffn["num_experts"].value_or(int64_t{8});
  s.top_k = ffn["top_k"].value_or(int64_t{2});
  s.expert_ffn = ffn["ffn_hidden_size"].value_or(int64_t{0});
  if (s.expert_ffn == 0) s.expert_ffn = c.model.ffn_hidden_size;
  s.groups_of_experts = ffn["num_groups"].value_or(int64_t{0});
  s.group_topk = ffn["group_topk"].value_or(int64_t{0});
  s.groups_by_best = ffn["group_score"].value_or(std::string("top_sum")) == "best";
  const double scaling = ffn["topk_scaling_factor"].value_or(0.0);
  s.routed_scaling = scaling > 0 ? scaling : 1.0;
  s.shared_ffn = ffn["shared_expert_ffn_hidden_size"].value_or(int64_t{0});
  s.expert_bias = ffn["expert_bias"].value_or(false);
  if (ffn["score_function"].value_or(std::string("softmax")) == "softmax") return deepseek_v2_router(ffn, s);
  if (ffn["score_function"].value_or(std::string("softmax")) != "sigmoid")
    throw std::runtime_error("DeepSeek-V3's router scores each expert by its sigmoid: set score_function = \"sigmoid\"");
  // transformers ranks a group by the sum of its 2 best scores, loom by its top_k / group_topk best.
  if (s.limits_groups() && (s.groups_by_best || s.top_k != 2 * s.group_topk))
    throw std::runtime_error("DeepSeek-V3 ranks a group of experts by the sum of its 2 best scores, loom by " +
                             (s.groups_by_best ? std::string("its best (group_score = \"best\")")
                                               : "the sum of its top_k / group_topk = " +
                                                     std::to_string(s.top_k / s.group_topk) + " best") +
                             ": set top_k = 2 * group_topk (group_score \"top_sum\"), or group_topk = num_groups");
  if (s.limits_groups() && s.experts / s.groups_of_experts < 2)
    throw std::runtime_error("DeepSeek-V3 ranks a group of experts by its 2 best scores: groups of " +
                             std::to_string(s.experts / s.groups_of_experts) + " expert have none to rank by");
  if (s.shared_ffn % s.expert_ffn != 0)
    throw std::runtime_error("DeepSeek-V3's shared experts are n_shared_experts experts wide: "
                             "shared_expert_ffn_hidden_size = " + std::to_string(s.shared_ffn) +
                             " must be a multiple of the experts' ffn_hidden_size = " + std::to_string(s.expert_ffn));
  if (ffn["shared_expert_gate"].value_or(false) || ffn["capacity_factor"].value_or(0.0) != 0.0)
    throw std::runtime_error("DeepSeek-V3's MoE blocks are dropless with an ungated shared expert: shared_expert_gate "
                             "and capacity_factor have no counterpart");
}

// Dense MLPs among MoE layers: Qwen2-MoE and Qwen3-MoE list them (mlp_only_layers),
// DeepSeek-V2/V3 have their first first_k_dense_replace layers dense; Mixtral has none.
void require_dense_layers_placeable(const Shape& s, const std::vector<model::LayerSpec>& L) {
  if (s.mixtral && !s.qwen())
    throw std::runtime_error("Mixtral's layers are all sparse MoE, and this model has dense MLPs among them "
                             "(model.block_pattern): with qk_norm on the attention they are Qwen3-MoE's "
                             "(mlp_only_layers), with multi_latent_attention DeepSeek-V3's (its first layers dense)");
  if (!s.deepseek) return;
  const auto first_moe = std::find(s.sparse.begin(), s.sparse.end(), true);
  const auto dense_after = std::find(first_moe, s.sparse.end(), false);
  if (dense_after != s.sparse.end())
    throw std::runtime_error("DeepSeek-V3's dense MLPs are its first first_k_dense_replace layers, but " +
                             L[2 + 2 * static_cast<size_t>(dense_after - s.sparse.begin())].instance +
                             " is dense after the MoE " +
                             L[2 + 2 * static_cast<size_t>(first_moe - s.sparse.begin())].instance +
                             " (model.block_pattern: the dense blocks first)");
}

Shape shape_of(const train::RunPlan& plan) {
  const manifest::RunConfig& c = plan.config;
  const std::vector<model::LayerSpec>& L = plan.layers;
  std::string layers;
  for (const auto& s : L) layers += (layers.empty() ? "" : ", ") + s.plugin;
  // Attention + MLP (or + MoE) pairs between the embedding and the head; dense and MoE
  // pairs may mix (model.block_pattern).
  bool blocks_ok = L.size() >= 4 && L.front().plugin == "embedding" && L.back().plugin == "lm_head" &&
                   (L.size() - 2) % 2 == 0;
  for (size_t i = 1; blocks_ok && i + 1 < L.size(); ++i)
    blocks_ok = i % 2 == 1 ? L[i].plugin == "attention" : L[i].plugin == "mlp" || L[i].plugin == "moe";
  if (!blocks_ok)
    throw std::runtime_error("only models of embedding, blocks of attention + mlp (or + moe), and lm_head have a "
                             "Hugging Face counterpart here; this one's layers are: " + layers);
  // The first attention, the first dense MLP and the first MoE: the ones every other
  // of its plugin must compute alike.
  const model::LayerSpec* first_of_plugin[2] = {nullptr, nullptr};  // mlp, moe
  for (size_t i = 2; i + 1 < L.size(); i += 2) {
    const model::LayerSpec*& first = first_of_plugin[L[i].plugin == "moe" ? 1 : 0];
    if (first == nullptr) first = &L[i];
  }
  const bool moe = first_of_plugin[1] != nullptr, dense = first_of_plugin[0] != nullptr;
  const model::LayerSpec& ffn_spec = dense ? *first_of_plugin[0] : *first_of_plugin[1];
  const toml::table &emb = c.model.layer_section(L[0].config), &att = c.model.layer_section(L[1].config),
                    &mlp = c.model.layer_section(ffn_spec.config), &head = c.model.layer_section(L.back().config);
  const toml::table& experts = moe ? c.model.layer_section(first_of_plugin[1]->config) : mlp;
  // A Hugging Face model repeats one layer; a block of several attention + MLP pairs
  // exports as that many layers, when the pairs compute alike (each option as set or
  // by its default; training-only ones such as dropout may differ).
  auto computed_options = [&](const model::LayerSpec& spec) {
    std::string out;
    const toml::table& section = c.model.layer_section(spec.config);
    for (const manifest::OptionDecl& d : plan.registry->get("layer", spec.plugin).options)
      if (!train::training_only_option(d.name)) out += d.name + "=" + train::layer_option_text(section, d) + "; ";
    return out;
  };
  for (size_t i = 3; i + 1 < L.size(); ++i) {
    const model::LayerSpec& first = i % 2 == 1 ? L[1] : *first_of_plugin[L[i].plugin == "moe" ? 1 : 0];
    if (L[i].config != first.config && computed_options(L[i]) != computed_options(first))
      throw std::runtime_error("layer " + L[i].instance + " is configured unlike " + first.instance +
                               " ([model.layer." + L[i].config + "] vs [model.layer." + first.config +
                               "]): a Hugging Face model repeats one layer");
  }
  Shape s;
  s.embedding = L.front().instance + ".";
  s.head = L.back().instance + ".";
  for (size_t i = 1; i + 1 < L.size(); i += 2) {
    s.attention.push_back(L[i].instance + ".");
    s.ffn.push_back(L[i + 1].instance + ".");
    s.sparse.push_back(L[i + 1].plugin == "moe");
  }
  const bool rope = option_string(att, "position_embedding", "learned_absolute") == "rope";
  const bool rms = option_string(att, "norm", "layernorm") == "rmsnorm";
  const bool att_bias = att["bias"].value_or(true);
  // The dense MLPs' and the experts' activation, norm and bias: Llama's in both.
  bool mlp_bias = false, swiglu = true, mlp_rms = true;
  for (const toml::table* ffn : {&mlp, &experts}) {
    mlp_bias = mlp_bias || (*ffn)["bias"].value_or(true);
    swiglu = swiglu && option_string(*ffn, "activation", "gelu") == "swiglu";
    mlp_rms = mlp_rms && option_string(*ffn, "norm", "layernorm") == "rmsnorm";
  }
  const bool head_rms = option_string(head, "norm", "layernorm") == "rmsnorm";
  const bool emb_rope = option_string(emb, "position_embedding", "learned_absolute") == "rope";
  const bool latent = att["multi_latent_attention"].value_or(false);
  s.qk_norm = att["qk_norm"].value_or(false);
  const bool qkv_bias = !att_bias && att["add_qkv_bias"].value_or(false);
  s.window = att["sliding_window"].value_or(int64_t{0});
  s.groups = att["num_query_groups"].value_or(int64_t{0});
  s.theta = att["rotary_base"].value_or(10000.0);
  if (option_string(att, "rope_scaling", "none") == "yarn") s.scaled_rope = yarn_rope(att);
  if (option_string(att, "rope_scaling", "none") == "llama3")
    s.scaled_rope = {{"rope_type", "llama3"},
                     {"factor", att["rope_scaling_factor"].value_or(8.0)},
                     {"low_freq_factor", att["rope_low_freq_factor"].value_or(1.0)},
                     {"high_freq_factor", att["rope_high_freq_factor"].value_or(4.0)},
                     {"original_max_position_embeddings", att["rope_original_max_position"].value_or(int64_t{8192})}};
  s.eps = att["norm_epsilon"].value_or(1e-5);
  for (const auto& [name, section] : {std::pair<std::string, const toml::table*>{ffn_spec.config, &mlp},
                                      {moe ? first_of_plugin[1]->config : ffn_spec.config, &experts},
                                      {L.back().config, &head}})
    if ((*section)["norm_epsilon"].value_or(1e-5) != s.eps)
      throw std::runtime_error("[model.layer." + name + "] norm_epsilon = " +
                               std::to_string((*section)["norm_epsilon"].value_or(1e-5)) + " but [model.layer." +
                               L[1].config + "] has " + std::to_string(s.eps) +
                               ": a Hugging Face model has one normalization epsilon");
  const bool llama_blocks = rope && emb_rope && rms && mlp_rms && head_rms && swiglu && !att_bias && !mlp_bias;
  if (!moe && !rope && !rms && att_bias && mlp_bias && !swiglu && !mlp_rms && !head_rms && !emb_rope &&
      !s.qk_norm && (s.groups == 0 || s.groups == c.model.num_heads))
    s.gpt2 = true;
  else if (latent && llama_blocks)
    s.deepseek = true;
  else if (!moe && llama_blocks)
    s.llama = true, s.qkv_bias = qkv_bias;
  else if (moe && llama_blocks)
    s.mixtral = true, s.qkv_bias = qkv_bias;
  else
    throw std::runtime_error(
        "the blocks are neither GPT-2's (layernorm, gelu, biases, learned positions, one key/value head per query "
        "head, no qk_norm) nor Llama's or Mixtral's (rmsnorm, swiglu, bias = false, rope in the embedding and "
        "attention; with qk_norm Qwen3's and Qwen3-MoE's; with multi_latent_attention DeepSeek-V3's): no Hugging "
        "Face architecture matches them" +
        std::string(s.groups != 0 && s.groups != c.model.num_heads && !rope
                        ? " (GPT-2 has no grouped-query attention: num_query_groups = " + std::to_string(s.groups) +
                              " of " + std::to_string(c.model.num_heads) + " heads)"
                        : ""));
  s.mistral = s.llama && !s.qk_norm && !s.qkv_bias && s.window > 0;
  if (qkv_bias && (!(s.llama || s.mixtral) || s.qk_norm))
    throw std::runtime_error("add_qkv_bias (biases on q, k and v alone) is Qwen2's and Qwen2-MoE's attention, without "
                             "qk_norm: no Hugging Face architecture here has it " +
                             std::string(s.qk_norm ? "with qk_norm" : "in these blocks"));
  if (s.gpt2 && effective_window(s.window, c.model.seq_length) > 0)
    throw std::runtime_error("GPT-2's attention has no sliding window (sliding_window = " + std::to_string(s.window) +
                             ", shorter than model.seq_length = " + std::to_string(c.model.seq_length) +
                             "); Llama's blocks with one are Mistral's");
  if (!s.scaled_rope.is_null() && (s.gpt2 || !rope))
    throw std::runtime_error("rope_scaling = \"" + s.rope_type() + "\" scales rotary embeddings, which these blocks do not use");
  if (!s.gpt2 && att["rotary_percent"].value_or(1.0) != 1.0)
    throw std::runtime_error("rotary_percent < 1 (partial rotary embeddings) has no " + s.architecture() +
                             " counterpart");
  s.moe = moe;
  if (moe && dense) require_dense_layers_placeable(s, L);
  if (s.deepseek) deepseek_shape(att, experts, c, s);
  if (s.mixtral) {
    const toml::table& e = experts;
    s.experts = e["num_experts"].value_or(int64_t{8});
    s.top_k = e["top_k"].value_or(int64_t{2});
    s.expert_ffn = e["ffn_hidden_size"].value_or(int64_t{0});
    if (s.expert_ffn == 0) s.expert_ffn = c.model.ffn_hidden_size;
    s.aux = e["aux_loss_coeff"].value_or(0.01);
    s.pre_softmax = e["pre_softmax"].value_or(false);
    // Mixtral's and Qwen3-MoE's routers: the softmax's top-k over all experts, unscaled gates.
    const double scaling = e["topk_scaling_factor"].value_or(0.0);
    if (e["score_function"].value_or(std::string("softmax")) != "softmax" || (scaling != 0.0 && scaling != 1.0) ||
        e["num_groups"].value_or(int64_t{0}) != 0)
      throw std::runtime_error(s.architecture() + "'s router is the softmax's top-k over all experts: score_function, "
                               "topk_scaling_factor and num_groups have no counterpart");
    if (s.qkv_bias) {
      qwen2_moe_shape(e, c, s);
      return s;
    }
    // Qwen3-MoE has both gates (norm_topk_prob); Mixtral renormalises the chosen ones.
    if (e["shared_expert_ffn_hidden_size"].value_or(int64_t{0}) != 0 || e["capacity_factor"].value_or(0.0) != 0.0 ||
        (s.pre_softmax && !s.qk_norm))
      throw std::runtime_error(s.architecture() + "'s MoE blocks are dropless top-k" +
                               (s.qk_norm ? "" : " over the chosen logits") +
                               " without a shared expert: shared_expert_ffn_hidden_size, capacity_factor" +
                               (s.qk_norm ? "" : " and pre_softmax") + " have no counterpart");
  }
  return s;
}

// The tensor names of a sparse MoE block, after "model.layers.<i>.": the router, and
// after "<experts><j>." expert j's gate and up projections (fc1's two halves) and its
// down projection.
struct MoeNames {
  std::string gate, experts, up_gate, up, down;
};
MoeNames moe_names(const Shape& s) {
  if (s.qwen_style_experts()) return {"mlp.gate.weight", "mlp.experts.", "gate_proj.weight", "up_proj.weight", "down_proj.weight"};
  return {"block_sparse_moe.gate.weight", "block_sparse_moe.experts.", "w1.weight", "w3.weight", "w2.weight"};
}

// Expert j's [rows, cols] matrix of a whole [E, rows, cols] tensor.
Matrix expert_matrix(const WholeTensor& t, int64_t j) {
  Matrix m;
  m.elem = t.dtype == LOOM_DTYPE_BF16 ? 2 : 4;
  m.rows = t.shape[1];
  m.cols = t.shape[2];
  const size_t bytes = static_cast<size_t>(m.rows * m.cols) * m.elem;
  m.data.assign(t.data.begin() + static_cast<std::ptrdiff_t>(bytes * j),
                t.data.begin() + static_cast<std::ptrdiff_t>(bytes * (j + 1)));
  return m;
}

}  // namespace

// Multi-latent attention's weights under transformers' DeepseekV3Attention names (at:
// the attention's instance prefix, to: "model.layers.<i>.self_attn."). Every loom
// weight is [in, out], transformers' [out, in]; the column orders are the same
// ([nope | rope] per query head, [kv | rope] down, [k_nope | v] per head up).
void latent_attention_to_hf(Builder& b, const std::string& at, const std::string& to, const Shape::Latent& l,
                            bool interleave) {
  auto linear = [&](const std::string& hf, const std::string& loom) {
    b.matrix(to + hf, transposed(matrix_of(b.get(at + loom))));
  };
  // DeepSeek-V2 rotates pairs (2i, 2i + 1) (complex rotary embeddings), loom halves
  // (i, i + rope/2): each rotary block of `every` rows from `first` on is interleaved.
  auto rotary_rows = [&](const std::string& hf, const std::string& loom, int64_t every, int64_t first) {
    Matrix m = transposed(matrix_of(b.get(at + loom)));  // [out, in]
    if (interleave) {
      const Matrix was = m;
      const size_t row = static_cast<size_t>(m.cols) * m.elem;
      for (int64_t r0 = first; r0 < m.rows; r0 += every)
        for (int64_t i = 0; i < l.rope; ++i) {
          const int64_t dst = r0 + (i < l.rope / 2 ? 2 * i : 2 * (i - l.rope / 2) + 1);
          std::memcpy(m.data.data() + dst * row, was.data.data() + (r0 + i) * row, row);
        }
    }
    b.matrix(to + hf, std::move(m));
  };
  const int64_t qk = l.nope + l.rope;
  if (l.q_rank > 0) {
    linear("q_a_proj.weight", "q_down.weight");
    b.as_is(to + "q_a_layernorm.weight", at + "q_latent_norm.weight");
    rotary_rows("q_b_proj.weight", "q_up.weight", qk, l.nope);
  } else {
    rotary_rows("q_proj.weight", "q.weight", qk, l.nope);
  }
  rotary_rows("kv_a_proj_with_mqa.weight", "kv_down.weight", l.kv_rank + l.rope, l.kv_rank);
  b.as_is(to + "kv_a_layernorm.weight", at + "kv_latent_norm.weight");
  linear("kv_b_proj.weight", "kv_up.weight");
  linear("o_proj.weight", "proj.weight");
}

// DeepseekV3Config's keys beyond Llama's: the latent attention's sizes, its rotation of
// the halves (rope_interleave false: rotate_half, as loom pairs elements i and i +
// rope/2), and the MoE layers (from first_k_dense_replace on, the dense ones first).
void deepseek_config(const Shape& s, int64_t dense_ffn, int64_t layers, nlohmann::ordered_json& c) {
  c["q_lora_rank"] = s.latent.q_rank > 0 ? nlohmann::ordered_json(s.latent.q_rank) : nlohmann::ordered_json();
  c["kv_lora_rank"] = s.latent.kv_rank;
  c["qk_nope_head_dim"] = s.latent.nope;
  c["qk_rope_head_dim"] = s.latent.rope;
  c["v_head_dim"] = s.latent.v;
  c.erase("head_dim");  // DeepseekV2Config's and DeepseekV3Config's is their qk_rope_head_dim
  if (!s.deepseek_v2) c["rope_interleave"] = false;  // DeepSeek-V2's pairs are interleaved: its rows are
  c["intermediate_size"] = dense_ffn;
  c["first_k_dense_replace"] = std::min(s.first_sparse(), layers);
  if (!s.moe) return;
  c["n_routed_experts"] = s.experts;
  c["num_experts_per_tok"] = s.top_k;
  c["moe_intermediate_size"] = s.expert_ffn;
  c["n_shared_experts"] = s.shared_ffn / s.expert_ffn;
  c["n_group"] = s.limits_groups() ? s.groups_of_experts : 1;  // every group picked: no groups
  c["topk_group"] = s.limits_groups() ? s.group_topk : 1;
  c["norm_topk_prob"] = !s.deepseek_v2 && s.top_k > 1;  // loom renormalises the chosen sigmoids when there are several
  c["routed_scaling_factor"] = s.routed_scaling;
  if (s.deepseek_v2) c["topk_method"] = s.limits_groups() ? "group_limited_greedy" : "greedy";
}

HfModel to_hf(const train::WholeCheckpoint& ck, plugins::Registry& registry) {
  const train::RunPlan plan =
      train::make_plan(manifest::Manifest::parse(ck.manifest_toml, "the checkpoint's manifest.toml", {},
                                                 manifest::Manifest::Launch::Other),
                       registry,
                       train::PlanUse::CheckpointLayout);
  const manifest::RunConfig& c = plan.config;
  const Shape s = shape_of(plan);
  const int64_t C = c.model.hidden_size, H = c.model.num_heads, F = c.model.ffn_hidden_size, V = ck.vocab;
  const int64_t Lyr = static_cast<int64_t>(s.attention.size()), D = C / H, T = c.model.seq_length;
  const bool tied = c.model.tie_embeddings;
  Builder b(ck);
  HfModel hf;
  const std::string torch_dtype = ck.meta.param_dtype == "bf16" ? "bfloat16" : "float32";
  hf.architecture = s.architecture();
  const std::string& E = s.embedding;
  if (s.gpt2) {
    b.vocab_rows("transformer.wte.weight", E + "word.weight", V);
    b.as_is("transformer.wpe.weight", E + "pos.weight");
    for (int64_t i = 0; i < Lyr; ++i) {
      const std::string &at = s.attention[i], &ml = s.ffn[i], h = "transformer.h." + std::to_string(i) + ".";
      b.as_is(h + "ln_1.weight", at + "ln.weight");
      b.as_is(h + "ln_1.bias", at + "ln.bias");
      b.as_is(h + "attn.c_attn.weight", at + "qkv.weight");  // [C, 3C], columns [q | k | v]
      b.as_is(h + "attn.c_attn.bias", at + "qkv.bias");
      b.as_is(h + "attn.c_proj.weight", at + "proj.weight");
      b.as_is(h + "attn.c_proj.bias", at + "proj.bias");
      b.as_is(h + "ln_2.weight", ml + "ln.weight");
      b.as_is(h + "ln_2.bias", ml + "ln.bias");
      b.as_is(h + "mlp.c_fc.weight", ml + "fc1.weight");
      b.as_is(h + "mlp.c_fc.bias", ml + "fc1.bias");
      b.as_is(h + "mlp.c_proj.weight", ml + "fc2.weight");
      b.as_is(h + "mlp.c_proj.bias", ml + "fc2.bias");
    }
    b.as_is("transformer.ln_f.weight", s.head + "ln.weight");
    b.as_is("transformer.ln_f.bias", s.head + "ln.bias");
    if (!tied) b.vocab_rows("lm_head.weight", s.head + "word.weight", V);
    hf.config = {{"architectures", {hf.architecture}}, {"model_type", "gpt2"}, {"vocab_size", V},
                 {"n_positions", T}, {"n_embd", C}, {"n_layer", Lyr}, {"n_head", H},
                 {"n_inner", F}, {"activation_function", "gelu_new"}, {"layer_norm_epsilon", s.eps},
                 {"resid_pdrop", 0.0}, {"embd_pdrop", 0.0}, {"attn_pdrop", 0.0},
                 {"tie_word_embeddings", tied}, {"torch_dtype", torch_dtype}};
  } else {
    const int64_t G = s.groups > 0 ? s.groups : H, hg = H / G, Fe = s.expert_ffn;
    b.vocab_rows("model.embed_tokens.weight", E + "word.weight", V);
    for (int64_t i = 0; i < Lyr; ++i) {
      const std::string &at = s.attention[i], &ml = s.ffn[i], h = "model.layers." + std::to_string(i) + ".";
      b.as_is(h + "input_layernorm.weight", at + "ln.weight");
      if (s.deepseek) {
        latent_attention_to_hf(b, at, h + "self_attn.", s.latent, /*interleave=*/s.deepseek_v2);
      } else {
        const Matrix qkv = matrix_of(b.get(at + "qkv.weight"));  // [C, cols]
        std::vector<std::pair<int64_t, int64_t>> q, k, v;
        if (G < H) {  // per group: its hg query heads, its key head, its value head
          for (int64_t g = 0; g < G; ++g) {
            const int64_t g0 = g * (hg + 2) * D;
            q.push_back({g0, hg * D});
            k.push_back({g0 + hg * D, D});
            v.push_back({g0 + (hg + 1) * D, D});
          }
        } else {  // [q | k | v]
          q.push_back({0, C});
          k.push_back({C, C});
          v.push_back({2 * C, C});
        }
        b.matrix(h + "self_attn.q_proj.weight", transposed(gather_columns(qkv, q)));
        b.matrix(h + "self_attn.k_proj.weight", transposed(gather_columns(qkv, k)));
        b.matrix(h + "self_attn.v_proj.weight", transposed(gather_columns(qkv, v)));
        b.matrix(h + "self_attn.o_proj.weight", transposed(matrix_of(b.get(at + "proj.weight"))));
        if (s.qkv_bias) {  // Qwen2's, cut as the weight's columns
          const Matrix bias = matrix_of(b.get(at + "qkv.bias"));
          b.vector(h + "self_attn.q_proj.bias", gather_columns(bias, q));
          b.vector(h + "self_attn.k_proj.bias", gather_columns(bias, k));
          b.vector(h + "self_attn.v_proj.bias", gather_columns(bias, v));
        }
        if (s.qk_norm) {
          b.as_is(h + "self_attn.q_norm.weight", at + "q_norm.weight");
          b.as_is(h + "self_attn.k_norm.weight", at + "k_norm.weight");
        }
      }
      b.as_is(h + "post_attention_layernorm.weight", ml + "ln.weight");
      if (!s.sparse[static_cast<size_t>(i)]) {
        const Matrix fc1 = matrix_of(b.get(ml + "fc1.weight"));  // [C, 2F]: [gate | up]
        b.matrix(h + "mlp.gate_proj.weight", transposed(columns(fc1, 0, F)));
        b.matrix(h + "mlp.up_proj.weight", transposed(columns(fc1, F, F)));
        b.matrix(h + "mlp.down_proj.weight", transposed(matrix_of(b.get(ml + "fc2.weight"))));
        continue;
      }
      // The router [C, E] is gate [E, C]; expert j's fc1 [C, 2Fe] = [gate | up]^T (Mixtral's w1 | w3),
      // fc2 [Fe, C] = down^T (w2).
      const MoeNames n = moe_names(s);
      b.matrix(h + n.gate, transposed(matrix_of(b.get(ml + "router.weight"))));
      for (int64_t j = 0; j < s.experts; ++j) {
        const std::string x = h + n.experts + std::to_string(j) + ".";
        const Matrix fc1 = expert_matrix(b.get(ml + "experts.fc1.weight"), j);
        b.matrix(x + n.up_gate, transposed(columns(fc1, 0, Fe)));
        b.matrix(x + n.up, transposed(columns(fc1, Fe, Fe)));
        b.matrix(x + n.down, transposed(expert_matrix(b.get(ml + "experts.fc2.weight"), j)));
      }
      if (s.qkv_bias) {  // Qwen2-MoE's gated shared expert: the gate's [H] row is shared_expert_gate [1, C]
        const int64_t Fs = s.shared_ffn;
        const Matrix fc1 = matrix_of(b.get(ml + "shared.fc1.weight"));  // [C, 2Fs]: [gate | up]
        b.matrix(h + "mlp.shared_expert.gate_proj.weight", transposed(columns(fc1, 0, Fs)));
        b.matrix(h + "mlp.shared_expert.up_proj.weight", transposed(columns(fc1, Fs, Fs)));
        b.matrix(h + "mlp.shared_expert.down_proj.weight", transposed(matrix_of(b.get(ml + "shared.fc2.weight"))));
        b.matrix(h + "mlp.shared_expert_gate.weight", matrix_of(b.get(ml + "shared.gate.weight")));
      }
      if (!s.deepseek) continue;
      // DeepSeek-V3's router bias (the layer's state; zeros without expert_bias) and
      // DeepSeek-V2/V3's shared experts, [gate | up]^T and down^T of loom's shared expert.
      if (!s.deepseek_v2) {
        std::vector<float> bias(static_cast<size_t>(s.experts), 0.0f);
        if (s.expert_bias) {
          const auto it = ck.states.find(ml + "router.expert_bias");
          if (it == ck.states.end() || it->second.size() != bias.size())
            throw std::runtime_error("the checkpoint has no layer state " + ml + "router.expert_bias");
          bias = it->second;
        }
        b.values(h + "mlp.gate.e_score_correction_bias", bias);
      }
      const int64_t Fs = s.shared_ffn;
      if (Fs > 0) {
        const Matrix fc1 = matrix_of(b.get(ml + "shared.fc1.weight"));  // [C, 2Fs]: [gate | up]
        b.matrix(h + "mlp.shared_experts.gate_proj.weight", transposed(columns(fc1, 0, Fs)));
        b.matrix(h + "mlp.shared_experts.up_proj.weight", transposed(columns(fc1, Fs, Fs)));
        b.matrix(h + "mlp.shared_experts.down_proj.weight", transposed(matrix_of(b.get(ml + "shared.fc2.weight"))));
      }
    }
    b.as_is("model.norm.weight", s.head + "ln.weight");
    if (!tied) b.vocab_rows("lm_head.weight", s.head + "word.weight", V);
    hf.config = {{"architectures", {hf.architecture}}, {"model_type", s.model_type()},
                 {"vocab_size", V}, {"hidden_size", C}, {"intermediate_size", s.llama || s.qwen() ? F : Fe},
                 {"num_hidden_layers", Lyr}, {"num_attention_heads", H}, {"num_key_value_heads", G},
                 {"head_dim", D}, {"hidden_act", "silu"}, {"max_position_embeddings", T},
                 {"rms_norm_eps", s.eps}, {"rope_theta", s.theta}, {"tie_word_embeddings", tied},
                 {"torch_dtype", torch_dtype}};
    if (!s.qkv_bias) hf.config["attention_bias"] = false;
    if (s.deepseek) deepseek_config(s, F, Lyr, hf.config);
    if (!s.scaled_rope.is_null()) hf.config["rope_scaling"] = s.scaled_rope;
    // transformers 4 derives YaRN's factor from max_position_embeddings /
    // original_max_position_embeddings: written so, both versions read the same factor.
    if (s.rope_type() == "yarn") {
      const double longest = s.scaled_rope["factor"].get<double>() *
                             s.scaled_rope["original_max_position_embeddings"].get<double>();
      if (longest != std::floor(longest) || longest >= 1e15)
        throw std::runtime_error("rope_scaling = \"yarn\": rope_scaling_factor x rope_original_max_position = " +
                                 std::to_string(longest) + " is not a whole number of positions, and transformers 4 "
                                 "derives the factor from max_position_embeddings / original_max_position_embeddings: "
                                 "no config.json gives both transformers versions loom's frequencies");
      hf.config["max_position_embeddings"] = static_cast<int64_t>(longest);
    }
    if (s.llama && !s.qwen() && !s.mistral) hf.config["mlp_bias"] = false;
    if (s.mistral || s.mixtral)
      hf.config["sliding_window"] = s.window > 0 ? nlohmann::ordered_json(s.window) : nlohmann::ordered_json();
    if (s.qwen()) {
      // Every layer slides the window: from layer max_window_layers = 0 on.
      hf.config["use_sliding_window"] = s.window > 0;
      hf.config["sliding_window"] = s.window > 0 ? nlohmann::ordered_json(s.window) : nlohmann::ordered_json();
      hf.config["max_window_layers"] = s.window > 0 ? 0 : Lyr;
      hf.config["layer_types"] = nlohmann::ordered_json::array();
      for (int64_t l = 0; l < Lyr; ++l) hf.config["layer_types"].push_back(s.window > 0 ? "sliding_attention" : "full_attention");
    }
    if (s.mixtral) {
      hf.config[s.qwen() ? "num_experts" : "num_local_experts"] = s.experts;
      hf.config["num_experts_per_tok"] = s.top_k;
      hf.config["router_aux_loss_coef"] = s.aux;
      hf.config["output_router_logits"] = false;
      if (s.qwen()) {
        hf.config["moe_intermediate_size"] = Fe;
        hf.config["norm_topk_prob"] = !s.pre_softmax;
        hf.config["decoder_sparse_step"] = 1;
        hf.config["mlp_only_layers"] = s.dense_layers();
      }
      if (s.qkv_bias) {
        hf.config["shared_expert_intermediate_size"] = s.shared_ffn;
        hf.config["qkv_bias"] = true;
      }
    }
  }
  hf.tensors = b.take();
  return hf;
}

namespace {

// A config's rope_scaling of rope_type "llama3" against the model's (`what` names it).
void require_llama3_rope(const nlohmann::json& r, const nlohmann::json& model, const std::string& what) {
  for (const char* f : {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
    if (!r.contains(f) || !r[f].is_number() || r[f].get<double>() != model[f].get<double>())
      throw std::runtime_error(what + "." + f + " = " + (r.contains(f) ? r[f].dump() : "(none)") +
                               " but the model's is " + model[f].dump() +
                               " (model.layer.attention.rope_scaling_factor, rope_low_freq_factor, "
                               "rope_high_freq_factor, rope_original_max_position)");
}

// A config's rope_scaling of rope_type "yarn" against the model's, as transformers 5
// reads it: `factor` as written (transformers 4 derives it from max_position_embeddings
// / original_max_position_embeddings instead; DeepSeek's configs make the two agree),
// original_max_position_embeddings (transformers 4: max_position_embeddings when
// absent), beta_fast and beta_slow (32 and 1 when absent), the factor on cos and sin
// however the config gives it, and for DeepSeek's attention mscale_all_dim's softmax
// scale (transformers' DeepseekV3Attention, DeepSeek's own modeling code; transformers'
// DeepseekV2Attention leaves it out).
void require_yarn_rope(const nlohmann::json& r, const nlohmann::json& c, const Shape& s, const std::string& what) {
  const nlohmann::json& m = s.scaled_rope;
  const auto differs = [&](const std::string& key, const std::string& got, const std::string& want,
                           const char* option) {
    throw std::runtime_error(what + "." + key + " = " + got + " but the model's is " + want +
                             " (model.layer.attention." + option + ")");
  };
  if (!r.contains("factor") || !r["factor"].is_number())
    throw std::runtime_error(what + " = " + r.dump() + " has no factor");
  if (r["factor"].get<double>() != m["factor"].get<double>())
    differs("factor", r["factor"].dump(), m["factor"].dump(), "rope_scaling_factor");
  const nlohmann::json original = r.contains("original_max_position_embeddings") ? r["original_max_position_embeddings"]
                                                                                  : c.value("max_position_embeddings",
                                                                                            nlohmann::json());
  if (!original.is_number() || original.get<double>() != m["original_max_position_embeddings"].get<double>())
    differs("original_max_position_embeddings", original.dump(), m["original_max_position_embeddings"].dump(),
            "rope_original_max_position");
  for (const auto& [key, fallback, option] : {std::tuple<const char*, double, const char*>{"beta_fast", 32.0, "rope_beta_fast"},
                                              {"beta_slow", 1.0, "rope_beta_slow"}})
    if (rope_number(r, key, fallback) != m[key].get<double>())
      differs(key, std::to_string(rope_number(r, key, fallback)), m[key].dump(), option);
  if (r.contains("truncate") && r["truncate"] == false)
    throw std::runtime_error(what + ".truncate = false (correction dimensions not rounded) has no loom counterpart");
  const double got = hf_yarn_attention_factor(r), want = hf_yarn_attention_factor(m);
  if (std::fabs(got - want) > 1e-12 * want)
    differs("attention_factor", std::to_string(got) + " (on cos and sin: attention_factor, or mscale's ratio)",
            std::to_string(want), "rope_mscale, rope_mscale_all_dim, rope_attention_factor");
  const double f = m["factor"].get<double>();
  if (s.deepseek && yarn_mscale(f, rope_number(r, "mscale_all_dim", 0.0)) !=
                        yarn_mscale(f, m["mscale_all_dim"].get<double>()))
    differs("mscale_all_dim", std::to_string(rope_number(r, "mscale_all_dim", 0.0)) + " (the softmax scale's)",
            m["mscale_all_dim"].dump(), "rope_mscale_all_dim");
}

// The config's sliding window against the attention's sliding_window, as they act
// on sequences of T tokens (a window of T or more is none): Mistral's and Mixtral's
// whenever set; Qwen3-MoE's with use_sliding_window; Qwen3's with it, in the layers
// layer_types says (by default those from max_window_layers on), which must be all
// of them or none where it acts (loom's blocks repeat one attention).
void require_window(const nlohmann::json& c, const Shape& s, int64_t layers, int64_t T, const std::string& where) {
  if (s.qwen() && c.contains("use_sliding_window") && !c["use_sliding_window"].is_boolean())
    throw std::runtime_error(where + ": use_sliding_window = " + c["use_sliding_window"].dump() +
                             " is not true or false");
  int64_t windowed = (s.llama && !s.mistral && !s.qwen()) || s.deepseek ? 0 : layers;  // Llama and DeepSeek-V3 have none
  if (s.qwen() && !c.value("use_sliding_window", false)) windowed = 0;
  if (windowed > 0 && s.qwen() && s.llama) {
    if (c.contains("layer_types") && c["layer_types"].is_array()) {
      windowed = 0;
      for (const nlohmann::json& t : c["layer_types"]) windowed += t != "full_attention" ? 1 : 0;
    } else {
      const nlohmann::json first = c.value("max_window_layers", nlohmann::json(28));
      if (!first.is_number_integer())
        throw std::runtime_error(where + ": max_window_layers = " + first.dump() + " is not an integer");
      windowed = std::clamp<int64_t>(layers - first.get<int64_t>(), 0, layers);
    }
  }
  int64_t hf = 0;
  if (windowed > 0) {
    const nlohmann::json w = c.contains("sliding_window") ? c["sliding_window"] : s.default_window();
    if (!w.is_null() && (!w.is_number_integer() || w.get<int64_t>() <= 0))
      throw std::runtime_error(where + ": sliding_window = " + w.dump() + " is not a positive integer or null");
    if (!w.is_null()) hf = effective_window(w.get<int64_t>(), T);
    if (hf > 0 && windowed < layers)
      throw std::runtime_error(where + ": " + std::to_string(windowed) + " of the " + std::to_string(layers) +
                               " layers slide a window of " + std::to_string(hf) + " tokens and the others see "
                               "every earlier token; loom's blocks repeat one attention (both kinds need two "
                               "attention instances in model.block, which no Hugging Face import lays out)");
  }
  const int64_t own = effective_window(s.window, T);
  if (hf != own)
    throw std::runtime_error(
        where + ": " +
        (hf > 0 ? "attention slides a window of " + std::to_string(hf) + " tokens (sliding_window)"
                : "attention sees every earlier token of model.seq_length = " + std::to_string(T)) +
        ", and the model's " +
        (own > 0 ? "a window of " + std::to_string(own) : std::string("every earlier one")) +
        "; set model.layer.attention.sliding_window = " + std::to_string(hf));
}

std::string read_whole(const std::string& path) {
  std::string why;
  std::optional<std::string> bytes = files::read_whole_file(path, &why);
  if (!bytes) throw std::runtime_error("cannot read " + path + " (" + why + ")");
  return std::move(*bytes);
}

// The tokenizer files transformers reads beside a model (name -> content), from a loom
// tokenizer path; the special token ids go into the model's config. The chat template:
// the one the run named (`chat_template`, data.chat_template) as Jinja, else the one the
// tokenizer's directory declares, as it is.
std::vector<std::pair<std::string, std::string>> tokenizer_files(const std::string& path, int64_t vocab,
                                                                 int64_t seq_len, const std::string& chat_template,
                                                                 nlohmann::ordered_json& config) {
  namespace fs = boost::filesystem;
  const std::unique_ptr<text::Tokenizer> tok = text::load_tokenizer(path);  // checks the files
  if (tok->vocab_size() > vocab)
    throw std::runtime_error("the tokenizer " + path + " has " + std::to_string(tok->vocab_size()) +
                             " tokens, more than the model's vocabulary of " + std::to_string(vocab));
  const text::TokenizerSource source = text::tokenizer_source(path);
  const bool gpt2 = source.format == text::TokenizerFormat::Gpt2Bpe;
  const bool fast = source.format == text::TokenizerFormat::HuggingFaceJson;
  nlohmann::ordered_json special, cfg;
  cfg["tokenizer_class"] = gpt2 ? "GPT2Tokenizer" : fast ? "PreTrainedTokenizerFast" : "LlamaTokenizer";
  cfg["model_max_length"] = seq_len;
  for (const auto& [name, id] : {std::pair<const char*, int32_t>{"bos", tok->bos()}, {"eos", tok->eod()}, {"unk", tok->unk()}}) {
    if (id < 0) continue;
    special[std::string(name) + "_token"] = tok->piece(id);
    config[std::string(name) + "_token_id"] = id;
  }
  config.erase("unk_token_id");  // not a model config key
  for (const auto& [k, v] : special.items()) cfg[k] = v;
  const std::string chat =
      chat_template.empty() ? text::declared_chat_template_text(path) : text::ChatTemplate::named(chat_template).jinja();
  if (!chat.empty()) cfg["chat_template"] = chat;
  if (gpt2) {
    cfg["add_prefix_space"] = false;
  } else if (!fast) {
    cfg["add_bos_token"] = false;  // loom preprocess adds none: the model saw text as it was encoded
    cfg["add_eos_token"] = false;
    cfg["legacy"] = false;
  }
  std::vector<std::pair<std::string, std::string>> files;
  if (gpt2) {
    files.emplace_back("vocab.json", read_whole((fs::path(path) / "encoder.json").string()));
    files.emplace_back("merges.txt", read_whole((fs::path(path) / "vocab.bpe").string()));
  } else if (fast) {
    // As it is (transformers reads its pre-tokenizer and added tokens itself), less its
    // post-processor (Llama 3's prepends <|begin_of_text|>): loom preprocess adds no
    // token of its own, so AutoTokenizer should not either.
    nlohmann::ordered_json tj = nlohmann::ordered_json::parse(read_whole(source.file));
    if (tj.contains("post_processor")) tj["post_processor"] = nullptr;
    files.emplace_back("tokenizer.json", tj.dump(2) + "\n");
  } else {
    files.emplace_back("tokenizer.model", read_whole(source.file));
  }
  files.emplace_back("tokenizer_config.json", cfg.dump(2) + "\n");
  files.emplace_back("special_tokens_map.json", special.dump(2) + "\n");
  return files;
}

// Files transformers' AutoTokenizer reads from a model directory; tokenizer.json (a fast
// tokenizer) and added_tokens.json take precedence over the ones an export writes.
constexpr const char* kTokenizerFileNames[] = {"vocab.json",     "merges.txt",  "tokenizer.model",
                                               "tokenizer.json", "added_tokens.json",
                                               "tokenizer_config.json", "special_tokens_map.json",
                                               "chat_template.jinja", "chat_template.json"};

// Tokenizer files in out_dir that this export did not write: removed when it wrote a
// tokenizer (they belong to an earlier one and would mislead AutoTokenizer), else named.
void settle_tokenizer_files(const std::string& out_dir, bool wrote_tokenizer, HfModel& hf) {
  namespace fs = boost::filesystem;
  for (const char* name : kTokenizerFileNames) {
    if (std::find(hf.files.begin(), hf.files.end(), name) != hf.files.end()) continue;
    const fs::path path = fs::path(out_dir) / name;
    boost::system::error_code ec;
    if (!fs::is_regular_file(path, ec)) continue;
    if (!wrote_tokenizer) {
      hf.kept.push_back(name);
    } else if (fs::remove(path, ec); ec) {
      throw std::runtime_error("export to " + out_dir + ": cannot remove " + path.string() +
                               " (a tokenizer file the exported tokenizer does not have): " + ec.message());
    } else {
      hf.removed.push_back(name);
    }
  }
}

// save_pretrained's split: tensors in order, a new shard when the next would take this
// one past `max_bytes` (a tensor larger than that alone in its own).
// Each shard's tensors by index.
std::vector<std::vector<size_t>> shard_tensors(const std::vector<NamedTensor>& tensors, uint64_t max_bytes) {
  std::vector<std::vector<size_t>> shards(1);
  uint64_t size = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!shards.back().empty() && size + tensors[i].data.size() > max_bytes) shards.emplace_back(), size = 0;
    shards.back().push_back(i);
    size += tensors[i].data.size();
  }
  return shards;
}

// The weight files an earlier export left in `dir`: model.safetensors, the index and
// the shards it lists (plain .safetensors names in the directory that are safetensors
// files, not links; an index that is not one lists none).
std::vector<std::string> earlier_weight_files(const std::string& dir) {
  namespace fs = boost::filesystem;
  std::vector<std::string> out;
  if (fs::is_regular_file(fs::path(dir) / "model.safetensors")) out.push_back("model.safetensors");
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (!fs::is_regular_file(index)) return out;
  out.push_back("model.safetensors.index.json");
  try {
    const nlohmann::json j = nlohmann::json::parse(read_whole(index.string()));
    if (!j.contains("weight_map") || !j["weight_map"].is_object()) return out;
    for (const auto& [name, file] : j["weight_map"].items())
      if (file.is_string() && fs::path(file.get<std::string>()).filename().string() == file.get<std::string>() &&
          file.get<std::string>().ends_with(".safetensors") &&
          std::find(out.begin(), out.end(), file.get<std::string>()) == out.end() &&
          !fs::is_symlink(fs::path(dir) / file.get<std::string>()) &&
          looks_like_safetensors((fs::path(dir) / file.get<std::string>()).string()))
        out.push_back(file.get<std::string>());
  } catch (const std::exception&) {
  }
  return out;
}

// "model-00002-of-00004.safetensors"
std::string shard_name(size_t i, size_t n) {
  char name[64];
  std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, n);
  return name;
}

}  // namespace

HfModel export_hf(const std::string& step_dir, const std::string& out_dir, plugins::Registry& registry,
                  const std::string& tokenizer, uint64_t max_shard_bytes) {
  if (max_shard_bytes == 0) throw std::runtime_error("the largest shard must be at least 1 byte");
  namespace fs = boost::filesystem;
  if (out_dir.empty()) throw std::runtime_error("the output directory is empty");
  boost::system::error_code ec;
  if (fs::exists(out_dir, ec) && !fs::is_directory(out_dir, ec))
    throw std::runtime_error(out_dir + " is a file; give a directory to write the model into");
  if (fs::exists(fs::path(out_dir) / "meta.toml") || train::latest_checkpoint(out_dir))
    throw std::runtime_error(out_dir + " holds a loom checkpoint; write the export into a directory of its own");
  // Inside a checkpoint's step, a run's checkpoint.keep_last would delete it with the step.
  for (fs::path p = fs::absolute(out_dir).lexically_normal().parent_path(); !p.empty() && p != p.root_path();
       p = p.parent_path())
    if (fs::exists(p / "meta.toml"))
      throw std::runtime_error(out_dir + " is inside the checkpoint " + p.string() +
                               ", which a run may delete (checkpoint.keep_last); write the export elsewhere");
  // An earlier export's weights (one file, or shards and their index) are this one's to
  // replace: what it does not write again goes once it has written its own.
  const std::vector<std::string> earlier_shards = earlier_weight_files(out_dir);
  const train::WholeCheckpoint ck = train::gather_checkpoint(step_dir, registry);
  HfModel hf = to_hf(ck, registry);
  std::vector<std::pair<std::string, std::string>> extra;
  if (!tokenizer.empty()) {
    const int64_t seq = hf.config.contains("n_positions") ? hf.config["n_positions"].get<int64_t>()
                                                          : hf.config["max_position_embeddings"].get<int64_t>();
    const std::string chat_template =
        manifest::Manifest::parse(ck.manifest_toml, "the checkpoint's manifest.toml", {}, manifest::Manifest::Launch::Other)
            .get_string("data.chat_template");
    extra = tokenizer_files(tokenizer, ck.vocab, seq, chat_template, hf.config);
  }
  // The directories this export makes (OUTDIR and any missing parents) go again if the
  // export does not finish (failed, or ended by a signal) and they are left empty.
  struct Made {
    std::vector<std::string> dirs;  // deepest first
    bool done = false;
    ~Made() {
      boost::system::error_code ignored;
      for (const std::string& d : dirs) {
        files::forget_temporary(d);
        if (!done && fs::is_empty(d, ignored)) fs::remove(d, ignored);
      }
    }
  } made_dir;
  for (fs::path p = fs::path(out_dir).lexically_normal(); !p.empty() && !fs::exists(p, ec); p = p.parent_path())
    made_dir.dirs.push_back(p.string());
  fs::create_directories(out_dir, ec);
  if (ec) throw std::runtime_error("cannot create " + out_dir + ": " + ec.message());
  for (const std::string& d : made_dir.dirs) files::add_temporary_directory(d);
  // Every file complete (as NAME.tmp) before any replaces what is there.
  std::vector<std::unique_ptr<files::Temporary>> written;
  const auto temporary = [&](const std::string& name) {
    const std::string final_path = (fs::path(out_dir) / name).string();
    written.push_back(std::make_unique<files::Temporary>(final_path + ".tmp"));
    return written.back()->path();
  };
  const auto final_path = [](const files::Temporary& t) { return t.path().substr(0, t.path().size() - 4); };
  try {
    const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"loom_checkpoint", step_dir}};
    const std::vector<std::vector<size_t>> shards = shard_tensors(hf.tensors, max_shard_bytes);
    if (shards.size() == 1) {
      write_safetensors(temporary("model.safetensors"), hf.tensors, metadata, /*direct=*/true);
    } else {
      nlohmann::ordered_json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::ordered_json::object()}};
      uint64_t total = 0;
      for (size_t i = 0; i < shards.size(); ++i) {
        const std::string name = shard_name(i, shards.size());
        std::vector<NamedTensor> shard;  // one shard's copy at a time
        for (size_t k : shards[i]) shard.push_back(hf.tensors[k]);
        write_safetensors(temporary(name), shard, metadata, /*direct=*/true);
        for (const NamedTensor& t : shard) index["weight_map"][t.name] = name, total += t.data.size();
      }
      index["metadata"]["total_size"] = total;
      extra.emplace(extra.begin(), "model.safetensors.index.json", index.dump(2) + "\n");
    }
    extra.emplace(extra.begin(), "config.json", hf.config.dump(2) + "\n");
    for (const auto& [name, content] : extra) {
      const std::string tmp = temporary(name);
      std::ofstream out(tmp, std::ios::binary);
      out << content;
      out.close();
      if (!out) throw std::runtime_error("cannot write " + tmp);
      if (name != "config.json" && name != "model.safetensors.index.json") hf.files.push_back(name);
    }
    for (const auto& t : written)
      if (fs::is_directory(final_path(*t), ec))
        throw std::runtime_error(final_path(*t) + " is a directory; remove it or write elsewhere");
    std::vector<std::pair<files::Temporary*, std::string>> renames;
    for (const auto& t : written) renames.emplace_back(t.get(), final_path(*t));
    if (const std::string why = files::commit_together(renames); !why.empty()) throw std::runtime_error(why);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("export to ") + out_dir + ": " + e.what());
  }  // the temporaries not renamed are removed with `written`
  made_dir.done = true;
  // The earlier weight files this export did not write again (a single file beside new
  // shards would be read in their place; shards beyond the new count, an index beside a
  // new single file, would mislead).
  for (const std::string& name : earlier_shards) {
    bool rewritten = false;
    for (const auto& t : written) rewritten = rewritten || fs::path(final_path(*t)).filename() == name;
    if (rewritten) continue;
    if (fs::remove(fs::path(out_dir) / name, ec); ec)
      throw std::runtime_error("export to " + out_dir + ": cannot remove the earlier " + name + ": " + ec.message());
    hf.removed.push_back(name);
  }
  settle_tokenizer_files(out_dir, !tokenizer.empty(), hf);
  return hf;
}


namespace {

// model.safetensors' tensors by name; "transformer." is optional (GPT-2's files on the
// Hub carry GPT2Model's names).
class HfTensors {
 public:
  explicit HfTensors(const std::string& dir) {
    for (NamedTensor& t : read_safetensors_model(dir, &source_)) {
      std::string name = t.name;
      by_name_[name] = std::move(t);
    }
    // The model's dtype is its embedding's; tensors it does not use (buffers such as
    // rotary inverse frequencies) may have another.
    for (const char* emb : {"transformer.wte.weight", "model.embed_tokens.weight"})
      if (const NamedTensor* t = find(emb); t != nullptr && dtype_.empty()) dtype_ = t->dtype;
  }
  int32_t dtype() const { return dtype_ == "BF16" ? LOOM_DTYPE_BF16 : LOOM_DTYPE_F32; }
  const NamedTensor& get(const std::string& name, const std::vector<int64_t>& shape) const {
    const NamedTensor* t = find(name);
    if (t == nullptr) throw std::runtime_error(source_ + " has no " + name);
    if (t->dtype != "F32" && t->dtype != "BF16")
      throw std::runtime_error(source_ + ": tensor " + name + " is " + t->dtype +
                               "; F32 and BF16 are read");
    if (t->dtype != dtype_)
      throw std::runtime_error(source_ + " mixes " + dtype_ + " and " + t->dtype + " tensors (" +
                               name + "); one dtype is read");
    if (t->shape != shape) {
      std::string want, got;
      for (int64_t d : shape) want += (want.empty() ? "" : ", ") + std::to_string(d);
      for (int64_t d : t->shape) got += (got.empty() ? "" : ", ") + std::to_string(d);
      throw std::runtime_error(source_ + ": " + name + " is [" + got + "], the model needs [" + want + "]");
    }
    require_finite(*t, name);
    read_.insert(t->name);
    return *t;
  }
  // A vector of n values in F32 or BF16 whatever the model's dtype (DeepSeek-V3's
  // checkpoints keep the routers' e_score_correction_bias in F32 beside BF16 weights).
  std::vector<float> floats(const std::string& name, int64_t n) const {
    const NamedTensor* t = find(name);
    if (t == nullptr) throw std::runtime_error(source_ + " has no " + name);
    if ((t->dtype != "F32" && t->dtype != "BF16") || t->shape != std::vector<int64_t>{n}) {
      std::string shape;
      for (int64_t d : t->shape) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
      throw std::runtime_error(source_ + ": " + name + " is " + t->dtype + " [" + shape +
                               "]; F32 or BF16 [" + std::to_string(n) + "] is read");
    }
    require_finite(*t, name);
    read_.insert(t->name);
    std::vector<float> out(static_cast<size_t>(n));
    for (size_t i = 0; i < out.size(); ++i) {
      uint32_t bits = 0;
      if (t->dtype == "BF16")
        std::memcpy(reinterpret_cast<char*>(&bits) + 2, t->data.data() + 2 * i, 2);
      else
        std::memcpy(&bits, t->data.data() + 4 * i, 4);
      std::memcpy(&out[i], &bits, 4);
    }
    return out;
  }
  // The file's tensors no get() asked for, but the buffers transformers saves beside
  // the weights (rotary frequencies, GPT-2's causal masks).
  std::vector<std::string> unread() const {
    std::vector<std::string> out;
    for (const auto& [name, t] : by_name_) {
      const bool buffer = name.ends_with("rotary_emb.inv_freq") || name.ends_with(".attn.bias") ||
                          name.ends_with(".attn.masked_bias");
      if (!buffer && !read_.count(name)) out.push_back(name);
    }
    return out;
  }

 private:
  const NamedTensor* find(const std::string& name) const {
    auto it = by_name_.find(name);
    if (it == by_name_.end() && name.rfind("transformer.", 0) == 0) it = by_name_.find(name.substr(12));
    return it == by_name_.end() ? nullptr : &it->second;
  }
  // A NaN or infinity would train (or evaluate) as nonsense without a word.
  void require_finite(const NamedTensor& t, const std::string& name) const {
    const size_t elem = t.dtype == "BF16" ? 2 : 4, n = t.data.size() / elem;
    for (size_t i = 0; i < n; ++i) {
      uint32_t bits = 0;
      if (elem == 2) {
        uint16_t h = 0;
        std::memcpy(&h, t.data.data() + 2 * i, 2);
        bits = static_cast<uint32_t>(h) << 16;
      } else {
        std::memcpy(&bits, t.data.data() + 4 * i, 4);
      }
      float x = 0;
      std::memcpy(&x, &bits, 4);
      if (!std::isfinite(x))
        throw std::runtime_error(source_ + ": " + name + " holds " + std::to_string(x) +
                                 " at element " + std::to_string(i) + "; the weights must be finite");
    }
  }
  std::string dtype_;
  std::string source_;  // model.safetensors, or the index of its shards
  std::map<std::string, NamedTensor> by_name_;
  mutable std::set<std::string> read_;  // the names get() returned
};

Matrix matrix_of(const NamedTensor& t) {
  Matrix m;
  m.elem = t.dtype == "BF16" ? 2 : 4;
  m.rows = t.shape.size() > 1 ? t.shape[0] : 1;
  m.cols = t.shape.size() > 1 ? t.shape[1] : t.shape[0];
  m.data = t.data;
  return m;
}

// Side by side: the columns of each matrix in turn (all of one row count).
Matrix concat_columns(const std::vector<Matrix>& parts) {
  Matrix out{parts.front().rows, 0, parts.front().elem, {}};
  for (const Matrix& p : parts) out.cols += p.cols;
  out.data.resize(static_cast<size_t>(out.rows * out.cols) * out.elem);
  int64_t at = 0;
  for (const Matrix& p : parts) {
    for (int64_t r = 0; r < p.rows; ++r)
      std::memcpy(out.data.data() + (r * out.cols + at) * out.elem, p.data.data() + r * p.cols * p.elem,
                  static_cast<size_t>(p.cols) * p.elem);
    at += p.cols;
  }
  return out;
}

class Collector {
 public:
  explicit Collector(int32_t dtype) : dtype_(dtype) {}
  void add(const std::string& name, const std::vector<int64_t>& shape, std::vector<char> data,
           const std::string& tie_key = "") {
    train::WholeTensor t;
    t.name = name;
    t.shape = shape;
    t.dtype = dtype_;
    t.data = std::move(data);
    t.tie_key = tie_key;
    out_.push_back(std::move(t));
  }
  void add(const std::string& name, const Matrix& m) { add(name, {m.rows, m.cols}, m.data); }
  void add(const std::string& name, const NamedTensor& t, const std::string& tie_key = "") {
    add(name, t.shape, t.data, tie_key);
  }
  std::vector<train::WholeTensor> take() { return std::move(out_); }

 private:
  int32_t dtype_;
  std::vector<train::WholeTensor> out_;
};

int64_t config_int(const nlohmann::json& c, const char* key, const std::string& where) {
  if (!c.contains(key) || !c[key].is_number_integer())
    throw std::runtime_error(where + " has no integer " + key);
  return c[key].get<int64_t>();
}

void require_equal(int64_t hf, int64_t loom, const std::string& hf_key, const std::string& loom_key,
                   const std::string& where) {
  if (hf != loom)
    throw std::runtime_error(where + ": " + hf_key + " = " + std::to_string(hf) + " but the model's " + loom_key +
                             " is " + std::to_string(loom) + "; set " + loom_key + " = " + std::to_string(hf));
}

// A key that would make transformers compute another model than loom's is refused. An
// absent key is transformers' default for the architecture (null: required).
void require_config_value(const nlohmann::json& c, const std::string& where, const char* k, const nlohmann::json& want,
                          const nlohmann::json& hf_default) {
  const bool given = c.contains(k) && !c[k].is_null();
  if (!given && hf_default.is_null()) throw std::runtime_error(where + " has no " + k + " (loom's is " + want.dump() + ")");
  const nlohmann::json& v = given ? c[k] : hf_default;
  const bool same = v.is_number() && want.is_number() ? std::fabs(v.get<double>() - want.get<double>()) <=
                                                             1e-12 * std::fabs(want.get<double>())
                                                      : v == want;
  if (!same)
    throw std::runtime_error(where + ": " + k + " = " + v.dump() + (given ? "" : " (transformers' default)") +
                             ", which loom's model does not compute (it has " + want.dump() + ")");
}

// DeepseekV2Config or DeepseekV3Config against the manifest's blocks (their defaults
// for absent keys): the latent attention's sizes, the dense layers first, and the
// router as loom's computes it.
void require_deepseek_config(const nlohmann::json& c, const Shape& s, int64_t dense_ffn, int64_t layers,
                             const std::string& where) {
  auto value = [&](const char* k, const nlohmann::json& want, const nlohmann::json& hf_default) {
    require_config_value(c, where, k, want, hf_default);
  };
  const Shape::Latent& l = s.latent;
  if (l.q_rank > 0 && c.contains("q_lora_rank") && c["q_lora_rank"].is_null())
    throw std::runtime_error(where + ": q_lora_rank = null projects q directly; the model projects it through a "
                             "latent of q_lora_rank = " + std::to_string(l.q_rank));
  if (l.q_rank > 0)
    value("q_lora_rank", l.q_rank, 1536);
  else if (!(c.contains("q_lora_rank") && c["q_lora_rank"].is_null()))
    throw std::runtime_error(where + ": q_lora_rank = " + c.value("q_lora_rank", nlohmann::json(1536)).dump() +
                             (c.contains("q_lora_rank") ? "" : " (transformers' default)") +
                             " projects q through a latent; the model's q_lora_rank is 0 (null there)");
  value("kv_lora_rank", l.kv_rank, 512);
  value("qk_nope_head_dim", l.nope, 128);
  value("qk_rope_head_dim", l.rope, 64);
  value("v_head_dim", l.v, 128);
  if (c.contains("rope_interleave") && !c["rope_interleave"].is_boolean())
    throw std::runtime_error(where + ": rope_interleave = " + c["rope_interleave"].dump() + " is not true or false");
  const bool v2 = s.deepseek_v2;
  // Layers from first_k_dense_replace on are MoE layers (DeepSeek's moe_layer_freq of 1).
  const int64_t first_moe =
      c.contains("first_k_dense_replace") ? config_int(c, "first_k_dense_replace", where) : v2 ? 0 : 3;
  const int64_t want = s.first_sparse();
  if (s.moe ? first_moe != want : first_moe < layers)
    throw std::runtime_error(where + ": first_k_dense_replace = " + std::to_string(first_moe) +
                             (c.contains("first_k_dense_replace") ? "" : " (transformers' default)") + " of " +
                             std::to_string(layers) + " layers, but the model's " +
                             (!s.moe     ? std::string("blocks are all dense")
                              : want == 0 ? std::string("blocks are all MoE")
                                          : "first " + std::to_string(want) + " block(s) are dense, then MoE") +
                             " (model.block, model.blocks and model.block_pattern)");
  if (c.contains("moe_layer_freq") && !(c["moe_layer_freq"].is_number_integer() && c["moe_layer_freq"] == 1))
    throw std::runtime_error(where + ": moe_layer_freq = " + c["moe_layer_freq"].dump() +
                             " leaves MoE layers dense, which transformers' DeepseekV2 and V3 do not (every layer "
                             "from first_k_dense_replace on is MoE)");
  const HfConfigDefaults d = hf_config_defaults(v2 ? "deepseek_v2" : "deepseek_v3");
  const auto or_null = [](int64_t v) { return v > 0 ? nlohmann::json(v) : nlohmann::json(); };
  if (want > 0) value("intermediate_size", dense_ffn, d.dense_ffn);
  if (!s.moe) return;
  // null builds no shared experts (DeepseekV2Moe), unlike an absent key (the default).
  if (c.contains("n_shared_experts") && c["n_shared_experts"].is_null())
    throw std::runtime_error(where + ": n_shared_experts = null has no shared experts; the model's MoE layers have " +
                             std::to_string(s.shared_ffn / s.expert_ffn));
  if (c.contains("scoring_func")) value("scoring_func", v2 ? "softmax" : "sigmoid", v2 ? "softmax" : "sigmoid");
  value("n_routed_experts", s.experts, d.experts);
  value("num_experts_per_tok", s.top_k, or_null(d.experts_per_token));
  value("moe_intermediate_size", s.expert_ffn, d.expert_ffn);
  value("n_shared_experts", s.shared_ffn / s.expert_ffn, d.shared_experts);
  value("routed_scaling_factor", s.routed_scaling, d.routed_scaling);
  if (v2) {  // DeepseekV2Config's router reads neither norm_topk_prob nor a bias
    value("topk_method", s.limits_groups() ? "group_limited_greedy" : "greedy", "greedy");
    if (s.limits_groups()) {
      value("n_group", s.groups_of_experts, nullptr);
      value("topk_group", s.group_topk, nullptr);
    }
    value("norm_topk_prob", false, false);  // DeepSeek's own code renormalises with it
    return;
  }
  // (scoring_func above, and topk_method: the DeepSeek-V3 repository's keys)
  if (c.contains("topk_method")) value("topk_method", "noaux_tc", "noaux_tc");
  value("n_group", s.limits_groups() ? s.groups_of_experts : 1, d.expert_groups);
  value("topk_group", s.limits_groups() ? s.group_topk : 1, d.group_topk);
  value("norm_topk_prob", s.top_k > 1, true);
}

// Qwen3-MoE's dense layers against the model's: transformers' Qwen3MoeDecoderLayer has
// an MoE at layer i when i is not in mlp_only_layers and (i + 1) is a multiple of
// decoder_sparse_step, else a dense MLP of intermediate_size.
void require_qwen_sparse_layers(const nlohmann::json& c, const Shape& s, int64_t dense_ffn, const std::string& where) {
  const int64_t step = c.contains("decoder_sparse_step") ? config_int(c, "decoder_sparse_step", where) : 1;
  if (step < 1) throw std::runtime_error(where + ": decoder_sparse_step = " + std::to_string(step) + " is not positive");
  std::set<int64_t> listed;
  if (c.contains("mlp_only_layers") && !c["mlp_only_layers"].is_null()) {
    const nlohmann::json& dense = c["mlp_only_layers"];
    if (!dense.is_array())
      throw std::runtime_error(where + ": mlp_only_layers = " + dense.dump() + " is not a list of layer indices");
    for (const nlohmann::json& i : dense) {
      if (!i.is_number_integer())
        throw std::runtime_error(where + ": mlp_only_layers = " + dense.dump() + " is not a list of layer indices");
      listed.insert(i.get<int64_t>());
    }
  }
  for (size_t i = 0; i < s.sparse.size(); ++i) {
    const int64_t layer = static_cast<int64_t>(i);
    const bool hf_sparse = listed.count(layer) == 0 && (layer + 1) % step == 0;
    if (hf_sparse != s.sparse[i])
      throw std::runtime_error(where + ": layer " + std::to_string(layer) + " has " +
                               (hf_sparse ? "an MoE" : "a dense MLP") + " (mlp_only_layers = " +
                               c.value("mlp_only_layers", nlohmann::json::array()).dump() + ", decoder_sparse_step = " +
                               std::to_string(step) + "), but the model's " + s.ffn[i].substr(0, s.ffn[i].size() - 1) +
                               " is " + (s.sparse[i] ? "an MoE" : "a dense MLP") +
                               " (model.block, model.blocks and model.block_pattern)");
  }
  if (!s.dense_layers().empty())
    require_equal(config_int(c, "intermediate_size", where), dense_ffn, "intermediate_size", "model.ffn_hidden_size",
                  where);
}

// transformers' DeepseekV3Attention weights into multi-latent attention's (see
// latent_attention_to_hf). With rope_interleave (DeepSeek's own checkpoints) the rotary
// rows of q and of the shared key are pairs (2i, 2i + 1); loom rotates halves (i, i +
// rope/2), so those rows are reordered evens first, as transformers does to the vectors.
void latent_attention_from_hf(const HfTensors& hf, Collector& out, const Shape& s, int64_t C, int64_t H,
                              const std::string& at, const std::string& from, bool interleaved) {
  const Shape::Latent& l = s.latent;
  const int64_t qk = l.nope + l.rope;
  auto halves = [&](Matrix m, int64_t every, int64_t first) {  // HF [out, in]: the rows of each rotary block
    if (!interleaved) return m;
    const Matrix was = m;
    const size_t row = static_cast<size_t>(m.cols) * m.elem;
    for (int64_t r0 = first; r0 < m.rows; r0 += every)
      for (int64_t i = 0; i < l.rope; ++i) {
        const int64_t src = r0 + (i < l.rope / 2 ? 2 * i : 2 * (i - l.rope / 2) + 1);
        std::memcpy(m.data.data() + (r0 + i) * row, was.data.data() + src * row, row);
      }
    return m;
  };
  if (l.q_rank > 0) {
    out.add(at + "q_down.weight", transposed(matrix_of(hf.get(from + "q_a_proj.weight", {l.q_rank, C}))));
    out.add(at + "q_latent_norm.weight", hf.get(from + "q_a_layernorm.weight", {l.q_rank}));
    out.add(at + "q_up.weight", transposed(halves(matrix_of(hf.get(from + "q_b_proj.weight", {H * qk, l.q_rank})), qk, l.nope)));
  } else {
    out.add(at + "q.weight", transposed(halves(matrix_of(hf.get(from + "q_proj.weight", {H * qk, C})), qk, l.nope)));
  }
  const int64_t down = l.kv_rank + l.rope;
  out.add(at + "kv_down.weight",
          transposed(halves(matrix_of(hf.get(from + "kv_a_proj_with_mqa.weight", {down, C})), down, l.kv_rank)));
  out.add(at + "kv_latent_norm.weight", hf.get(from + "kv_a_layernorm.weight", {l.kv_rank}));
  out.add(at + "kv_up.weight",
          transposed(matrix_of(hf.get(from + "kv_b_proj.weight", {H * (l.nope + l.v), l.kv_rank}))));
  out.add(at + "proj.weight", transposed(matrix_of(hf.get(from + "o_proj.weight", {C, H * l.v}))));
}

}  // namespace

train::InitialWeights read_hf(const std::string& dir, const train::RunPlan& plan, int64_t vocab) {
  Shape s = shape_of(plan);  // what the model cannot be first: it needs no files
  const std::string where = (boost::filesystem::path(dir) / "config.json").string();
  nlohmann::json c;
  try {
    c = nlohmann::json::parse(read_whole(where));
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(where + " is not JSON: " + e.what());
  }
  const manifest::RunConfig& m = plan.config;
  if (!c.is_object() || !c.contains("architectures") || !c["architectures"].is_array() ||
      c["architectures"].size() != 1 || !c["architectures"][0].is_string())
    throw std::runtime_error(where + ": \"architectures\" must be a list of one class name");
  const std::string arch = c["architectures"][0].get<std::string>();
  // Llama's blocks are Mistral's (its window, if any, is checked below).
  if (s.llama && !s.qwen()) s.mistral = arch == "MistralForCausalLM";
  const std::string want_arch = s.architecture();
  if (arch != want_arch)
    throw std::runtime_error(where + ": architecture " + arch + ", but the manifest's blocks are " + want_arch + "'s");
  const int64_t C = m.model.hidden_size, H = m.model.num_heads, F = m.model.ffn_hidden_size;
  const int64_t L = static_cast<int64_t>(s.attention.size()), pairs = L / std::max<int64_t>(1, m.model.num_layers);
  const int64_t T = m.model.seq_length, D = C / H;
  const bool tied = m.model.tie_embeddings;
  // transformers' default: GPT2Config ties the head to the embedding, LlamaConfig and
  // MixtralConfig do not.
  if (c.contains("tie_word_embeddings") && !c["tie_word_embeddings"].is_boolean())
    throw std::runtime_error(where + ": tie_word_embeddings = " + c["tie_word_embeddings"].dump() +
                             " is not true or false");
  const bool hf_tied = c.value("tie_word_embeddings", hf_config_defaults(s.model_type()).tie_word_embeddings);
  // The layer count: model.num_layers blocks of `pairs` attention + MLP pairs.
  auto require_layers = [&](const char* key) {
    const int64_t n = config_int(c, key, where);
    if (pairs == 1 && L == m.model.num_layers) return require_equal(n, L, key, "model.num_layers", where);
    if (n != L)
      throw std::runtime_error(where + ": " + key + " = " + std::to_string(n) + " but the model has " +
                               std::to_string(L) + " attention + MLP pairs (model.num_layers = " +
                               std::to_string(m.model.num_layers) + " blocks of " + std::to_string(pairs) + ")");
  };
  HfTensors hf(dir);
  Collector out(hf.dtype());
  model::StateValues states;  // DeepSeek-V3's router biases
  require_equal(config_int(c, "vocab_size", where), vocab, "vocab_size", "model.vocab_size", where);
  if (!hf_tied && tied)
    throw std::runtime_error(where + ": the model has its own lm_head.weight (tie_word_embeddings false); set "
                             "model.tie_embeddings = false");
  const std::string tie = tied ? "word_embedding" : "";
  auto require_value = [&](const char* k, const nlohmann::json& want, const nlohmann::json& hf_default) {
    require_config_value(c, where, k, want, hf_default);
  };
  require_value("model_type", s.model_type(), nullptr);
  if (s.gpt2) {
    require_value("activation_function", "gelu_new", "gelu_new");
    require_value("layer_norm_epsilon", s.eps, 1e-5);
    require_value("scale_attn_weights", true, true);
    require_value("scale_attn_by_inverse_layer_idx", false, false);
    if (c.contains("n_inner") && !c["n_inner"].is_null() && !c["n_inner"].is_number_integer())
      throw std::runtime_error(where + ": n_inner = " + c["n_inner"].dump() + " is not an integer");
  } else {
    require_value("hidden_act", "silu", "silu");
    require_value("rms_norm_eps", s.eps, s.default_eps());
    // DeepseekV3Config saves its head_dim as the rotary part's size.
    if (s.deepseek)
      require_value("head_dim", s.latent.rope, s.latent.rope);
    else
      require_value("head_dim", C / H, s.default_head_dim(C, H));
    if (!s.qkv_bias) require_value("attention_bias", false, false);  // Qwen2Config has none: q, k, v biased
    // A rotary embedding over part of each head (loom's rotary_percent) has no
    // counterpart in these architectures' attention (export refuses it too).
    require_value("partial_rotary_factor", 1.0, 1.0);
    require_value("mlp_bias", false, false);
    // The rotary settings: rope_theta at the top (transformers 4), or inside
    // rope_parameters (transformers 5) or rope_scaling (transformers 4); the rope type
    // "default", or "llama3" or "yarn" with the attention's rope_scaling settings; any
    // other scales the frequencies in a way loom's rotary embedding does not.
    nlohmann::json theta = c.contains("rope_theta") && !c["rope_theta"].is_null() ? c["rope_theta"] : nlohmann::json();
    bool scaled_seen = false;
    for (const char* k : {"rope_parameters", "rope_scaling"}) {
      if (!c.contains(k) || c[k].is_null()) continue;
      const nlohmann::json& r = c[k];
      const nlohmann::json type = r.is_object() ? r.value("rope_type", r.value("type", nlohmann::json("default")))
                                                : nlohmann::json();
      if (r.is_object() && (type == "llama3" || type == "yarn")) {
        const std::string t = type.get<std::string>();
        if (s.rope_type() != t)
          throw std::runtime_error(
              where + ": " + k + " = " + r.dump() +
              (t == "llama3" ? " slows the low rotary frequencies (Llama 3.1's)" : " scales the rotary frequencies as "
                                                                                    "YaRN does") +
              "; set model.layer.attention.rope_scaling = \"" + t + "\" with its factors" +
              (s.scaled_rope.is_null() ? "" : " (it is \"" + s.rope_type() + "\")"));
        if (t == "llama3")
          require_llama3_rope(r, s.scaled_rope, where + ": " + k);
        else
          require_yarn_rope(r, c, s, where + ": " + k);
        scaled_seen = true;
      } else if (!r.is_object() || type != "default") {
        throw std::runtime_error(where + ": " + k + " = " + r.dump() +
                                 " (scaled rotary frequencies) has no loom counterpart");
      } else if (!s.scaled_rope.is_null()) {
        // Both keys are read (transformers 4 the one, 5 the other): each must say it.
        throw std::runtime_error(where + ": " + k + " = " + r.dump() + " leaves the frequencies unscaled, but "
                                 "the model's rope_scaling is \"" + s.rope_type() + "\"");
      }
      if (r.contains("partial_rotary_factor") && r["partial_rotary_factor"] != 1.0)
        throw std::runtime_error(where + ": " + k + " = " + r.dump() + " rotates part of each head only");
      if (r.contains("rope_theta")) {
        if (!theta.is_null() && r["rope_theta"] != theta)
          throw std::runtime_error(where + ": " + k + ".rope_theta = " + r["rope_theta"].dump() +
                                   " differs from rope_theta = " + theta.dump());
        theta = r["rope_theta"];
      }
    }
    if (!s.scaled_rope.is_null() && !scaled_seen)
      throw std::runtime_error(where + " has no rope_scaling of type " + s.rope_type() +
                               ", which the model's rope_scaling = \"" + s.rope_type() + "\" computes");
    const bool given = !theta.is_null();
    if (!given) theta = s.default_theta();
    if (!theta.is_number() || theta.get<double>() != s.theta)
      throw std::runtime_error(where + ": rope_theta = " + theta.dump() + (given ? "" : " (transformers' default)") +
                               " but the model's rotary_base is " + std::to_string(s.theta) +
                               "; set model.layer.attention.rotary_base to it");
    require_window(c, s, L, T, where);
  }
  for (const char* k : {"n_embd", "n_layer", "n_head", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "intermediate_size", "vocab_size", "n_positions"})
    if (c.contains(k) && (!c[k].is_number_integer() || c[k].get<int64_t>() <= 0))
      throw std::runtime_error(where + ": " + k + " = " + c[k].dump() + " is not a positive integer");
  if (s.gpt2) {
    require_equal(config_int(c, "n_embd", where), C, "n_embd", "model.hidden_size", where);
    require_layers("n_layer");
    require_equal(config_int(c, "n_head", where), H, "n_head", "model.num_heads", where);
    const int64_t inner = c.contains("n_inner") && c["n_inner"].is_number_integer() ? c["n_inner"].get<int64_t>() : 4 * C;
    require_equal(inner, F, "n_inner", "model.ffn_hidden_size", where);
    const int64_t positions = config_int(c, "n_positions", where);
    if (positions < T)
      throw std::runtime_error(where + ": n_positions = " + std::to_string(positions) + " is shorter than model.seq_length = " +
                               std::to_string(T));
    out.add(s.embedding + "word.weight", hf.get("transformer.wte.weight", {vocab, C}), tie);
    const NamedTensor& wpe = hf.get("transformer.wpe.weight", {positions, C});
    out.add(s.embedding + "pos.weight", {T, C},
            std::vector<char>(wpe.data.begin(), wpe.data.begin() + static_cast<std::ptrdiff_t>(T * C * matrix_of(wpe).elem)));
    for (int64_t i = 0; i < L; ++i) {
      const std::string &at = s.attention[i], &ml = s.ffn[i], h = "transformer.h." + std::to_string(i) + ".";
      out.add(at + "ln.weight", hf.get(h + "ln_1.weight", {C}));
      out.add(at + "ln.bias", hf.get(h + "ln_1.bias", {C}));
      out.add(at + "qkv.weight", hf.get(h + "attn.c_attn.weight", {C, 3 * C}));
      out.add(at + "qkv.bias", hf.get(h + "attn.c_attn.bias", {3 * C}));
      out.add(at + "proj.weight", hf.get(h + "attn.c_proj.weight", {C, C}));
      out.add(at + "proj.bias", hf.get(h + "attn.c_proj.bias", {C}));
      out.add(ml + "ln.weight", hf.get(h + "ln_2.weight", {C}));
      out.add(ml + "ln.bias", hf.get(h + "ln_2.bias", {C}));
      out.add(ml + "fc1.weight", hf.get(h + "mlp.c_fc.weight", {C, F}));
      out.add(ml + "fc1.bias", hf.get(h + "mlp.c_fc.bias", {F}));
      out.add(ml + "fc2.weight", hf.get(h + "mlp.c_proj.weight", {F, C}));
      out.add(ml + "fc2.bias", hf.get(h + "mlp.c_proj.bias", {C}));
    }
    out.add(s.head + "ln.weight", hf.get("transformer.ln_f.weight", {C}));
    out.add(s.head + "ln.bias", hf.get("transformer.ln_f.bias", {C}));
    if (!tied) out.add(s.head + "word.weight", hf.get(hf_tied ? "transformer.wte.weight" : "lm_head.weight", {vocab, C}));
  } else {
    const int64_t G = s.groups > 0 ? s.groups : H, hg = H / G;
    require_equal(config_int(c, "hidden_size", where), C, "hidden_size", "model.hidden_size", where);
    require_layers("num_hidden_layers");
    require_equal(config_int(c, "num_attention_heads", where), H, "num_attention_heads", "model.num_heads", where);
    if (s.deepseek) {
      require_deepseek_config(c, s, F, L, where);
    } else if (s.llama) {
      require_equal(config_int(c, "intermediate_size", where), F, "intermediate_size", "model.ffn_hidden_size", where);
    } else {
      const char* expert_ffn = s.qwen() ? "moe_intermediate_size" : "intermediate_size";
      // Qwen3-MoE's num_experts is saved as num_local_experts by transformers 5 (its
      // attribute_map), as num_experts by earlier versions.
      const char* experts = s.qwen() && !c.contains("num_local_experts") ? "num_experts" : "num_local_experts";
      require_equal(config_int(c, expert_ffn, where), s.expert_ffn, expert_ffn, "the experts' ffn_hidden_size", where);
      require_equal(config_int(c, experts, where), s.experts, experts, "model.layer.moe.num_experts", where);
      require_equal(config_int(c, "num_experts_per_tok", where), s.top_k, "num_experts_per_tok",
                    "model.layer.moe.top_k", where);
      if (s.qwen()) {
        // Qwen3MoeConfig's and Qwen2MoeConfig's defaults: the chosen gates not
        // renormalised, every layer sparse.
        require_value("norm_topk_prob", !s.pre_softmax, false);
        require_qwen_sparse_layers(c, s, F, where);
      }
      if (s.qkv_bias) {  // Qwen2MoeConfig's
        require_value("shared_expert_intermediate_size", s.shared_ffn, hf_config_defaults("qwen2_moe").shared_expert_ffn);
        require_value("qkv_bias", true, true);
      }
    }
    // Absent: transformers' default (LlamaConfig's num_attention_heads; MixtralConfig's 8,
    // Qwen3Config's 32, Qwen3MoeConfig's 4); null: num_attention_heads.
    const bool kv_given = c.contains("num_key_value_heads");
    const int64_t kv = !kv_given                          ? s.default_kv_heads(H)
                       : c["num_key_value_heads"].is_null() ? H
                                                            : config_int(c, "num_key_value_heads", where);
    if (s.deepseek && kv != H)  // its attention is multi-head: a key and a value per query head
      throw std::runtime_error(where + ": num_key_value_heads = " + std::to_string(kv) +
                               (kv_given ? "" : " (transformers' default)") +
                               ", but DeepSeek-V3's attention has one per query head (num_attention_heads = " +
                               std::to_string(H) + ")");
    if (!kv_given && (kv > H || H % kv != 0))  // transformers could not build it either
      throw std::runtime_error(where + " has no num_key_value_heads, and " + s.architecture() + "'s default of " +
                               std::to_string(kv) + " key/value heads does not divide num_attention_heads = " +
                               std::to_string(H) + ": give num_key_value_heads in config.json");
    require_equal(kv, G, kv_given ? "num_key_value_heads" : "num_key_value_heads (absent: transformers' default)",
                  "model.layer.attention.num_query_groups", where);
    out.add(s.embedding + "word.weight", hf.get("model.embed_tokens.weight", {vocab, C}), tie);
    const int64_t Fe = s.expert_ffn;
    for (int64_t i = 0; i < L; ++i) {
      const std::string &at = s.attention[i], &ml = s.ffn[i], h = "model.layers." + std::to_string(i) + ".";
      out.add(at + "ln.weight", hf.get(h + "input_layernorm.weight", {C}));
      if (s.deepseek) {
        // DeepSeek-V2's rotary pairs are always interleaved (no rope_interleave key).
        latent_attention_from_hf(hf, out, s, C, H, at, h + "self_attn.",
                                 s.deepseek_v2 || c.value("rope_interleave", true));
      } else {
        // Per group: its hg query heads, its key head, its value head; or [q | k | v].
        auto fused = [&](const Matrix& q, const Matrix& k, const Matrix& v) {
          if (G == H) return concat_columns({q, k, v});
          std::vector<Matrix> parts;
          for (int64_t g = 0; g < G; ++g) {
            parts.push_back(columns(q, g * hg * D, hg * D));
            parts.push_back(columns(k, g * D, D));
            parts.push_back(columns(v, g * D, D));
          }
          return concat_columns(parts);
        };
        out.add(at + "qkv.weight", fused(transposed(matrix_of(hf.get(h + "self_attn.q_proj.weight", {H * D, C}))),
                                         transposed(matrix_of(hf.get(h + "self_attn.k_proj.weight", {G * D, C}))),
                                         transposed(matrix_of(hf.get(h + "self_attn.v_proj.weight", {G * D, C})))));
        if (s.qkv_bias) {  // Qwen2's, as one row of the fused columns
          const Matrix bias = fused(matrix_of(hf.get(h + "self_attn.q_proj.bias", {H * D})),
                                    matrix_of(hf.get(h + "self_attn.k_proj.bias", {G * D})),
                                    matrix_of(hf.get(h + "self_attn.v_proj.bias", {G * D})));
          out.add(at + "qkv.bias", {bias.cols}, bias.data);
        }
        out.add(at + "proj.weight", transposed(matrix_of(hf.get(h + "self_attn.o_proj.weight", {C, C}))));
        if (s.qk_norm) {
          out.add(at + "q_norm.weight", hf.get(h + "self_attn.q_norm.weight", {D}));
          out.add(at + "k_norm.weight", hf.get(h + "self_attn.k_norm.weight", {D}));
        }
      }
      out.add(ml + "ln.weight", hf.get(h + "post_attention_layernorm.weight", {C}));
      if (!s.sparse[static_cast<size_t>(i)]) {
        out.add(ml + "fc1.weight", concat_columns({transposed(matrix_of(hf.get(h + "mlp.gate_proj.weight", {F, C}))),
                                                    transposed(matrix_of(hf.get(h + "mlp.up_proj.weight", {F, C})))}));
        out.add(ml + "fc2.weight", transposed(matrix_of(hf.get(h + "mlp.down_proj.weight", {C, F}))));
        continue;
      }
      // The router, then each expert's [gate | up]^T and down^T stacked by expert.
      const MoeNames n = moe_names(s);
      out.add(ml + "router.weight", transposed(matrix_of(hf.get(h + n.gate, {s.experts, C}))));
      std::vector<char> fc1, fc2;
      for (int64_t j = 0; j < s.experts; ++j) {
        const std::string x = h + n.experts + std::to_string(j) + ".";
        const Matrix up = concat_columns({transposed(matrix_of(hf.get(x + n.up_gate, {Fe, C}))),
                                          transposed(matrix_of(hf.get(x + n.up, {Fe, C})))});
        const Matrix down = transposed(matrix_of(hf.get(x + n.down, {C, Fe})));
        fc1.insert(fc1.end(), up.data.begin(), up.data.end());
        fc2.insert(fc2.end(), down.data.begin(), down.data.end());
      }
      out.add(ml + "experts.fc1.weight", {s.experts, C, 2 * Fe}, std::move(fc1));
      out.add(ml + "experts.fc2.weight", {s.experts, Fe, C}, std::move(fc2));
      if (s.qkv_bias) {  // Qwen2-MoE's gated shared expert
        const int64_t Fs = s.shared_ffn;
        out.add(ml + "shared.fc1.weight",
                concat_columns({transposed(matrix_of(hf.get(h + "mlp.shared_expert.gate_proj.weight", {Fs, C}))),
                                transposed(matrix_of(hf.get(h + "mlp.shared_expert.up_proj.weight", {Fs, C})))}));
        out.add(ml + "shared.fc2.weight", transposed(matrix_of(hf.get(h + "mlp.shared_expert.down_proj.weight", {C, Fs}))));
        const NamedTensor& gate = hf.get(h + "mlp.shared_expert_gate.weight", {1, C});
        out.add(ml + "shared.gate.weight", {C}, gate.data);
      }
      if (!s.deepseek) continue;
      // DeepSeek-V3's router bias: the layer's state with expert_bias; without, it must be zero.
      if (!s.deepseek_v2) {
        std::vector<float> bias = hf.floats(h + "mlp.gate.e_score_correction_bias", s.experts);
        if (s.expert_bias)
          states[ml + "router.expert_bias"] = std::move(bias);
        else if (std::any_of(bias.begin(), bias.end(), [](float b) { return b != 0.0f; }))
          throw std::runtime_error(where + ": the routers choose with a bias (mlp.gate.e_score_correction_bias); set "
                                   "model.layer.moe.expert_bias = true");
      }
      if (const int64_t Fs = s.shared_ffn; Fs > 0) {
        out.add(ml + "shared.fc1.weight",
                concat_columns({transposed(matrix_of(hf.get(h + "mlp.shared_experts.gate_proj.weight", {Fs, C}))),
                                transposed(matrix_of(hf.get(h + "mlp.shared_experts.up_proj.weight", {Fs, C})))}));
        out.add(ml + "shared.fc2.weight", transposed(matrix_of(hf.get(h + "mlp.shared_experts.down_proj.weight", {C, Fs}))));
      }
    }
    out.add(s.head + "ln.weight", hf.get("model.norm.weight", {C}));
    if (!tied) out.add(s.head + "word.weight", hf.get(hf_tied ? "model.embed_tokens.weight" : "lm_head.weight", {vocab, C}));
  }
  train::InitialWeights w{dir, out.take(), vocab};
  w.unread = hf.unread();
  w.states = std::move(states);
  return w;
}

train::InitialWeights read_initial_weights(const std::string& path, const train::RunPlan& plan, int64_t vocab,
                                           plugins::Registry& registry, const std::string& named_by) {
  namespace fs = boost::filesystem;
  const std::string key = named_by.empty() ? "checkpoint.init_weights = \"" + path + "\"" : named_by;
  if (!fs::exists(path)) throw std::runtime_error(key + ": no such directory");
  if (!fs::is_directory(path))
    throw std::runtime_error(key + " is a file; give a Hugging Face model directory or a loom checkpoint directory");
  const bool hf = fs::exists(fs::path(path) / "config.json");
  std::vector<std::string> skipped;
  const std::string step = train::named_checkpoint(path, &skipped);
  if (hf && !step.empty())
    throw std::runtime_error(key + " holds both a Hugging Face model (config.json) and a loom checkpoint; keep "
                             "exports apart from checkpoints, or name the one to use");
  if (hf) return read_hf(path, plan, vocab);
  if (step.empty())
    throw std::runtime_error(key + " is neither a Hugging Face model directory (config.json) nor a loom checkpoint");
  train::WholeCheckpoint ck = train::gather_checkpoint(step, registry);
  std::vector<std::string> changed;
  train::require_same_architecture(ck.manifest_toml, plan, step, "checkpoint.init_weights", &changed);
  train::InitialWeights w{step, std::move(ck.tensors), ck.vocab};
  w.states = std::move(ck.states);
  w.skipped = std::move(skipped);
  w.changed = std::move(changed);
  return w;
}

}  // namespace loom::interop
