// Hugging Face interoperability. `loom export --format hf`: a checkpoint written at tp 2 x
// pp 2 (and dp 2), gathered and exported, is read back from model.safetensors and config.json by forwards written
// here from transformers' model definitions (modeling_gpt2.py: Conv1D [in, out], fused
// c_attn [q | k | v], gelu_new; modeling_llama.py: nn.Linear [out, in], RMSNorm,
// rotate-half RoPE, grouped KV heads shared by consecutive query heads, SwiGLU), in
// double precision. Their loss on a batch equals loom's serial model's loss with the
// checkpoint's gathered parameters: the shards were put together right and the names,
// transposes and QKV cuts mean what transformers means by them. checkpoint.init_weights
// reads such a directory back bit for bit, and runs of any layout start from it with the
// same loss. And the safetensors reader refuses malformed headers.
#include "support/byte_level_vocab.hpp"
#include "support/train_fixture.hpp"

#include "engine/interop/hf_config.hpp"
#include "engine/interop/hugging_face.hpp"
#include "engine/interop/safetensors.hpp"
#include "engine/text/tokenizer.hpp"
#include "engine/runtime/launcher.hpp"
#include "engine/train/checkpoint.hpp"
#include "engine/train/data.hpp"
#include "engine/train/gather.hpp"

#include <boost/filesystem.hpp>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <set>
#include <sstream>

namespace {

namespace fs = boost::filesystem;
using Vec = std::vector<double>;

// ---- the reference: tensors of model.safetensors as doubles -----------------------

struct HfWeights {
  nlohmann::json config;
  std::map<std::string, std::pair<std::vector<int64_t>, Vec>> t;
  const Vec& at(const std::string& name) const {
    auto it = t.find(name);
    if (it == t.end()) throw std::runtime_error("model.safetensors has no " + name);
    return it->second.second;
  }
  std::vector<int64_t> shape(const std::string& name) const { return t.at(name).first; }
  bool has(const std::string& name) const { return t.count(name) > 0; }
};

HfWeights read_hf(const std::string& dir) {
  HfWeights w;
  std::ifstream(dir + "/config.json") >> w.config;
  for (const auto& nt : loom::interop::read_safetensors(dir + "/model.safetensors").tensors) {
    Vec v;
    const size_t n = nt.data.size() / (nt.dtype == "BF16" ? 2 : 4);
    for (size_t i = 0; i < n; ++i) {
      float f = 0;
      if (nt.dtype == "BF16") {
        uint32_t bits = 0;
        std::memcpy(reinterpret_cast<char*>(&bits) + 2, nt.data.data() + 2 * i, 2);
        std::memcpy(&f, &bits, 4);
      } else {
        std::memcpy(&f, nt.data.data() + 4 * i, 4);
      }
      v.push_back(f);
    }
    w.t[nt.name] = {nt.shape, std::move(v)};
  }
  return w;
}

// y[T, out] = x[T, in] W (+ b): W [in, out] (Conv1D), or W^T with W [out, in] (nn.Linear).
Vec linear(const Vec& x, int64_t T, int64_t in, const Vec& W, int64_t out, bool w_out_in, const Vec* b = nullptr) {
  Vec y(static_cast<size_t>(T * out), 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < out; ++o) {
      double s = b ? (*b)[o] : 0.0;
      for (int64_t i = 0; i < in; ++i) s += x[t * in + i] * (w_out_in ? W[o * in + i] : W[i * out + o]);
      y[t * out + o] = s;
    }
  return y;
}

Vec layer_norm(const Vec& x, int64_t T, int64_t C, const Vec& g, const Vec* b, double eps, bool rms) {
  Vec y(x.size());
  for (int64_t t = 0; t < T; ++t) {
    double mean = 0, var = 0;
    if (!rms) {
      for (int64_t c = 0; c < C; ++c) mean += x[t * C + c];
      mean /= C;
    }
    for (int64_t c = 0; c < C; ++c) var += (x[t * C + c] - mean) * (x[t * C + c] - mean);
    var /= C;
    for (int64_t c = 0; c < C; ++c) y[t * C + c] = (x[t * C + c] - mean) / std::sqrt(var + eps) * g[c] + (b ? (*b)[c] : 0.0);
  }
  return y;
}

// Causal attention of q [T, H*D] over k, v [T, G*D]; query head h reads kv head h / (H / G).
// With a sliding window W > 0 (masking_utils.py's sliding_window_overlay: kv_idx >
// q_idx - W) query i sees keys i - W + 1 .. i.
Vec attention(const Vec& q, const Vec& k, const Vec& v, int64_t T, int64_t H, int64_t G, int64_t D,
              int64_t window = 0) {
  Vec y(static_cast<size_t>(T * H * D), 0.0);
  for (int64_t h = 0; h < H; ++h) {
    const int64_t kh = h / (H / G);
    for (int64_t i = 0; i < T; ++i) {
      const int64_t first = window > 0 ? std::max<int64_t>(0, i - window + 1) : 0;
      Vec s(static_cast<size_t>(i + 1 - first));
      double mx = -1e300;
      for (int64_t j = first; j <= i; ++j) {
        double d = 0;
        for (int64_t e = 0; e < D; ++e) d += q[i * H * D + h * D + e] * k[j * G * D + kh * D + e];
        s[j - first] = d / std::sqrt(static_cast<double>(D));
        mx = std::max(mx, s[j - first]);
      }
      double z = 0;
      for (double& e : s) z += (e = std::exp(e - mx));
      for (int64_t j = first; j <= i; ++j)
        for (int64_t e = 0; e < D; ++e) y[i * H * D + h * D + e] += s[j - first] / z * v[j * G * D + kh * D + e];
    }
  }
  return y;
}

// The sliding window layer l's attention uses (0: none): Mistral's and Mixtral's
// sliding_window; Qwen3's and Qwen3-MoE's with use_sliding_window, in the layers
// layer_types marks sliding_attention.
int64_t hf_window(const nlohmann::json& c, int64_t l) {
  const std::string type = c["model_type"];
  if (type == "mistral" || type == "mixtral")
    return c.contains("sliding_window") && !c["sliding_window"].is_null() ? c["sliding_window"].get<int64_t>() : 0;
  if ((type == "qwen2" || type == "qwen3" || type == "qwen3_moe") && c.value("use_sliding_window", false) &&
      c["layer_types"][static_cast<size_t>(l)] == "sliding_attention")
    return c["sliding_window"];
  return 0;
}

// YaRN's get_mscale (modeling_rope_utils.py).
double get_mscale(double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; }

// The number a rope_scaling object gives, or `fallback` (absent, null or 0).
double rope_value(const nlohmann::json& r, const char* key, double fallback) {
  return r.contains(key) && r[key].is_number() && r[key].get<double>() != 0 ? r[key].get<double>() : fallback;
}

// What transformers multiplies cos and sin by: _compute_yarn_parameters' attention_factor
// for rope_type "yarn", else 1.
double rope_attention_scaling(const nlohmann::json& c) {
  if (!c.contains("rope_scaling") || c["rope_scaling"].is_null() || c["rope_scaling"]["rope_type"] != "yarn") return 1.0;
  const nlohmann::json& r = c["rope_scaling"];
  if (r.contains("attention_factor")) return r["attention_factor"];
  const double f = r["factor"], m = rope_value(r, "mscale", 0), all = rope_value(r, "mscale_all_dim", 0);
  return m != 0 && all != 0 ? get_mscale(f, m) / get_mscale(f, all) : get_mscale(f, 1);
}

// The inverse frequencies of modeling_rope_utils.py: theta^(-2i/D), or with rope_scaling
// of rope_type "llama3" those of _compute_llama3_parameters, of "yarn" those of
// _compute_yarn_parameters (transformers 5: the factor as written).
Vec rope_frequencies(const nlohmann::json& c, int64_t D) {
  const double theta = c["rope_theta"].get<double>();
  Vec f;
  for (int64_t i = 0; i < D / 2; ++i) f.push_back(std::pow(theta, -2.0 * i / D));
  if (!c.contains("rope_scaling") || c["rope_scaling"].is_null()) return f;
  const nlohmann::json& r = c["rope_scaling"];
  if (r["rope_type"] == "yarn") {
    const double factor = r["factor"], original = r["original_max_position_embeddings"];
    const double fast = rope_value(r, "beta_fast", 32), slow = rope_value(r, "beta_slow", 1);
    auto correction_dim = [&](double rotations) {
      return (D * std::log(original / (rotations * 2 * M_PI))) / (2 * std::log(theta));
    };
    const double low = std::max(std::floor(correction_dim(fast)), 0.0);
    double high = std::min(std::ceil(correction_dim(slow)), static_cast<double>(D - 1));
    if (low == high) high += 0.001;
    for (int64_t i = 0; i < D / 2; ++i) {
      const double extrapolation = std::clamp((i - low) / (high - low), 0.0, 1.0);
      const double extrapolation_factor = 1 - extrapolation;
      f[i] = f[i] / factor * (1 - extrapolation_factor) + f[i] * extrapolation_factor;
    }
    return f;
  }
  EXPECT_EQ(r["rope_type"], "llama3");
  const double factor = r["factor"], low = r["low_freq_factor"], high = r["high_freq_factor"];
  const double old_len = r["original_max_position_embeddings"];
  for (double& inv : f) {
    const double wavelen = 2 * M_PI / inv;
    if (wavelen > old_len / low) {
      inv /= factor;
    } else if (wavelen >= old_len / high) {
      const double smooth = (old_len / wavelen - low) / (high - low);
      inv = (1 - smooth) * inv / factor + smooth * inv;
    }
  }
  return f;
}

// Rotate-half RoPE (modeling_llama.py's rotate_half / apply_rotary_pos_emb) on [T, heads*D],
// cos and sin times `scaling` (the rotary embedding's attention_scaling).
void rope(Vec& x, int64_t T, int64_t heads, int64_t D, const Vec& freqs, double scaling = 1.0) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < D / 2; ++i) {
        const double a = t * freqs[static_cast<size_t>(i)], cos = scaling * std::cos(a), sin = scaling * std::sin(a);
        double& x1 = x[t * heads * D + h * D + i];
        double& x2 = x[t * heads * D + h * D + i + D / 2];
        const double r1 = x1 * cos - x2 * sin, r2 = x2 * cos + x1 * sin;
        x1 = r1;
        x2 = r2;
      }
}

// modeling_deepseek_v3.py's DeepseekV3Attention on the normalised input a [T, C] of
// layer prefix p ("model.layers.<i>.self_attn."); with rope_interleave (its default)
// each rotary vector is reordered evens first before rotate_half, as
// apply_rotary_pos_emb_interleave does: q
// through its latent (or q_proj), the key/value latent and one rotary key shared by the
// heads, per head [nope | rope] scores over sqrt(nope + rope), values of v_head_dim.
Vec deepseek_attention(const HfWeights& w, const nlohmann::json& c, const std::string& p, const Vec& a, int64_t T) {
  const double kLatentEps = 1e-6;  // q_a_layernorm's and kv_a_layernorm's: DeepseekV3RMSNorm's default
  const int64_t C = c["hidden_size"], H = c["num_attention_heads"], nope = c["qk_nope_head_dim"],
                rd = c["qk_rope_head_dim"], vd = c["v_head_dim"], kv = c["kv_lora_rank"], qk = nope + rd;
  Vec q;
  if (c["q_lora_rank"].is_null()) {
    q = linear(a, T, C, w.at(p + "q_proj.weight"), H * qk, true);
  } else {
    const int64_t qr = c["q_lora_rank"];
    const Vec latent = layer_norm(linear(a, T, C, w.at(p + "q_a_proj.weight"), qr, true), T, qr,
                                  w.at(p + "q_a_layernorm.weight"), nullptr, kLatentEps, true);
    q = linear(latent, T, qr, w.at(p + "q_b_proj.weight"), H * qk, true);
  }
  const Vec compressed = linear(a, T, C, w.at(p + "kv_a_proj_with_mqa.weight"), kv + rd, true);
  Vec latent(static_cast<size_t>(T * kv)), k_rot(static_cast<size_t>(T * rd)), q_rot(static_cast<size_t>(T * H * rd));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < kv; ++e) latent[t * kv + e] = compressed[t * (kv + rd) + e];
    for (int64_t e = 0; e < rd; ++e) k_rot[t * rd + e] = compressed[t * (kv + rd) + kv + e];
    for (int64_t h = 0; h < H; ++h)
      for (int64_t e = 0; e < rd; ++e) q_rot[(t * H + h) * rd + e] = q[t * H * qk + h * qk + nope + e];
  }
  const Vec kvb = linear(layer_norm(latent, T, kv, w.at(p + "kv_a_layernorm.weight"), nullptr, kLatentEps, true), T, kv,
                         w.at(p + "kv_b_proj.weight"), H * (nope + vd), true);
  if (c.value("rope_interleave", true))
    for (Vec* v : {&q_rot, &k_rot})
      for (size_t r0 = 0; r0 < v->size(); r0 += static_cast<size_t>(rd)) {
        const Vec was(v->begin() + r0, v->begin() + r0 + rd);
        for (int64_t i = 0; i < rd; ++i) (*v)[r0 + i] = was[i < rd / 2 ? 2 * i : 2 * (i - rd / 2) + 1];
      }
  rope(q_rot, T, H, rd, rope_frequencies(c, rd), rope_attention_scaling(c));
  rope(k_rot, T, 1, rd, rope_frequencies(c, rd), rope_attention_scaling(c));
  // DeepseekV3Attention's scaling with YaRN: times get_mscale(factor, mscale_all_dim)^2.
  double softmax_scale = 1.0 / std::sqrt(static_cast<double>(qk));
  if (c.contains("rope_scaling") && c["rope_scaling"].is_object() && rope_value(c["rope_scaling"], "mscale_all_dim", 0)) {
    const double m = get_mscale(c["rope_scaling"]["factor"], rope_value(c["rope_scaling"], "mscale_all_dim", 0));
    softmax_scale *= m * m;
  }
  Vec y(static_cast<size_t>(T * H * vd), 0.0);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < T; ++i) {
      Vec sc(static_cast<size_t>(i + 1));
      double mx = -1e300, z = 0;
      for (int64_t j = 0; j <= i; ++j) {
        double d = 0;
        for (int64_t e = 0; e < nope; ++e) d += q[i * H * qk + h * qk + e] * kvb[j * H * (nope + vd) + h * (nope + vd) + e];
        for (int64_t e = 0; e < rd; ++e) d += q_rot[(i * H + h) * rd + e] * k_rot[j * rd + e];
        sc[j] = d * softmax_scale;
        mx = std::max(mx, sc[j]);
      }
      for (double& e : sc) z += (e = std::exp(e - mx));
      for (int64_t j = 0; j <= i; ++j)
        for (int64_t e = 0; e < vd; ++e)
          y[i * H * vd + h * vd + e] += sc[j] / z * kvb[j * H * (nope + vd) + h * (nope + vd) + nope + e];
    }
  return linear(y, T, H * vd, w.at(p + "o_proj.weight"), C, true);
}

// modeling_deepseek_v3.py's DeepseekV3MoE.route_tokens_to_experts for one token: the
// sigmoid scores plus e_score_correction_bias choose (groups ranked by their 2 best,
// the others masked to 0), the chosen sigmoids are the gates (renormalised with
// norm_topk_prob), times routed_scaling_factor. Returns (expert, gate) pairs.
std::vector<std::pair<int64_t, double>> deepseek_route(const nlohmann::json& c, const double* logits, const Vec& bias) {
  const int64_t E = c["n_routed_experts"], K = c["num_experts_per_tok"], G = c["n_group"], TG = c["topk_group"];
  Vec score(static_cast<size_t>(E)), choice(score.size());
  for (int64_t e = 0; e < E; ++e) {
    score[e] = 1.0 / (1.0 + std::exp(-logits[e]));
    choice[e] = score[e] + bias[e];
  }
  std::vector<std::pair<double, int64_t>> groups;
  for (int64_t g = 0; g < G; ++g) {
    Vec members(choice.begin() + g * (E / G), choice.begin() + (g + 1) * (E / G));
    std::sort(members.begin(), members.end(), std::greater<double>());
    groups.push_back({members[0] + members[1], g});
  }
  std::stable_sort(groups.begin(), groups.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<bool> kept(static_cast<size_t>(E), false);
  for (int64_t i = 0; i < TG; ++i)
    for (int64_t e = 0; e < E / G; ++e) kept[groups[i].second * (E / G) + e] = true;
  std::vector<std::pair<double, int64_t>> ranked;
  for (int64_t e = 0; e < E; ++e) ranked.push_back({kept[e] ? choice[e] : 0.0, e});
  std::stable_sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  double sum = 0;
  for (int64_t k = 0; k < K; ++k) sum += score[ranked[k].second];
  std::vector<std::pair<int64_t, double>> out;
  for (int64_t k = 0; k < K; ++k) {
    double gate = score[ranked[k].second];
    if (c["norm_topk_prob"].get<bool>()) gate /= sum + 1e-20;
    out.push_back({ranked[k].second, gate * c["routed_scaling_factor"].get<double>()});
  }
  return out;
}

// modeling_deepseek_v2.py's DeepseekV2Moe.route_tokens_to_experts for one token: the
// softmax over every expert; greedy: its top_k values; group_limited_greedy: from the
// topk_group groups of the best single value (the others masked to 0); the chosen
// values are the gates, times routed_scaling_factor. Returns (expert, gate) pairs.
std::vector<std::pair<int64_t, double>> deepseek_v2_route(const nlohmann::json& c, const double* logits) {
  const int64_t E = c["n_routed_experts"], K = c["num_experts_per_tok"];
  Vec prob(static_cast<size_t>(E));
  double mx = -1e300, z = 0;
  for (int64_t e = 0; e < E; ++e) mx = std::max(mx, logits[e]);
  for (int64_t e = 0; e < E; ++e) z += (prob[e] = std::exp(logits[e] - mx));
  for (double& p : prob) p /= z;
  std::vector<bool> kept(static_cast<size_t>(E), true);
  if (c.value("topk_method", std::string("greedy")) == "group_limited_greedy") {
    const int64_t G = c["n_group"], TG = c["topk_group"];
    std::vector<std::pair<double, int64_t>> groups;
    for (int64_t g = 0; g < G; ++g)
      groups.push_back({*std::max_element(prob.begin() + g * (E / G), prob.begin() + (g + 1) * (E / G)), g});
    std::stable_sort(groups.begin(), groups.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    std::fill(kept.begin(), kept.end(), false);
    for (int64_t i = 0; i < TG; ++i)
      for (int64_t e = 0; e < E / G; ++e) kept[groups[i].second * (E / G) + e] = true;
  }
  std::vector<std::pair<double, int64_t>> ranked;
  for (int64_t e = 0; e < E; ++e) ranked.push_back({kept[e] ? prob[e] : 0.0, e});
  std::stable_sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<std::pair<int64_t, double>> out;
  for (int64_t k = 0; k < K; ++k)
    out.push_back({ranked[k].second, ranked[k].first * c["routed_scaling_factor"].get<double>()});
  return out;
}

// Mean cross-entropy of one sequence's next tokens (targets < 0 skipped) under the HF model.
double hf_loss(const HfWeights& w, const std::vector<int32_t>& tok, const std::vector<int32_t>& tgt, int64_t* count) {
  const nlohmann::json& c = w.config;
  // Qwen3 (modeling_qwen3.py) is Llama with each head's q and k RMSNorm-ed before the
  // rotation; Qwen3-MoE (modeling_qwen3_moe.py) Mixtral's with it, other names, and the
  // chosen gates renormalised only with norm_topk_prob.
  const bool qwen3_moe = c["model_type"] == "qwen3_moe", qwen = c["model_type"] == "qwen3" || qwen3_moe;
  // modeling_qwen2_moe.py: Qwen3-MoE's experts and router, q, k and v biased, and a
  // shared expert gated by sigmoid(shared_expert_gate(x)).
  const bool qwen2_moe = c["model_type"] == "qwen2_moe", qwen_moe = qwen3_moe || qwen2_moe;
  const bool deepseek_v2 = c["model_type"] == "deepseek_v2", deepseek = c["model_type"] == "deepseek_v3" || deepseek_v2;
  const bool mixtral = c["model_type"] == "mixtral" || qwen_moe,
             llama = c["model_type"] == "llama" || c["model_type"] == "mistral" || c["model_type"] == "qwen3" ||
                     c["model_type"] == "qwen2" ||
                     mixtral || deepseek;
  const int64_t T = static_cast<int64_t>(tok.size()), V = c["vocab_size"];
  const int64_t C = llama ? c["hidden_size"].get<int64_t>() : c["n_embd"].get<int64_t>();
  const int64_t H = llama ? c["num_attention_heads"].get<int64_t>() : c["n_head"].get<int64_t>();
  const int64_t L = llama ? c["num_hidden_layers"].get<int64_t>() : c["n_layer"].get<int64_t>();
  const int64_t G = llama ? c["num_key_value_heads"].get<int64_t>() : H, D = C / H;
  int64_t F = llama ? c["intermediate_size"].get<int64_t>() : c["n_inner"].get<int64_t>();
  const double eps = llama ? c["rms_norm_eps"].get<double>() : c["layer_norm_epsilon"].get<double>();
  const std::string emb = llama ? "model.embed_tokens.weight" : "transformer.wte.weight";
  Vec x(static_cast<size_t>(T * C));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t e = 0; e < C; ++e)
      x[t * C + e] = w.at(emb)[tok[t] * C + e] + (llama ? 0.0 : w.at("transformer.wpe.weight")[t * C + e]);
  auto add = [](Vec& a, const Vec& b) {
    for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
  };
  for (int64_t l = 0; l < L; ++l) {
    if (llama) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      const Vec a = layer_norm(x, T, C, w.at(p + "input_layernorm.weight"), nullptr, eps, true);
      if (deepseek) {
        add(x, deepseek_attention(w, c, p + "self_attn.", a, T));
      } else {
      // modeling_qwen2.py: q, k and v with biases (and o_proj without).
      auto bias = [&](const char* n) { return w.has(p + n) ? &w.at(p + n) : nullptr; };
      Vec q = linear(a, T, C, w.at(p + "self_attn.q_proj.weight"), H * D, true, bias("self_attn.q_proj.bias"));
      Vec k = linear(a, T, C, w.at(p + "self_attn.k_proj.weight"), G * D, true, bias("self_attn.k_proj.bias"));
      const Vec v = linear(a, T, C, w.at(p + "self_attn.v_proj.weight"), G * D, true, bias("self_attn.v_proj.bias"));
      if (qwen) {  // [T, heads, D] rows of D
        q = layer_norm(q, T * H, D, w.at(p + "self_attn.q_norm.weight"), nullptr, eps, true);
        k = layer_norm(k, T * G, D, w.at(p + "self_attn.k_norm.weight"), nullptr, eps, true);
      }
      rope(q, T, H, D, rope_frequencies(c, D), rope_attention_scaling(c));
      rope(k, T, G, D, rope_frequencies(c, D), rope_attention_scaling(c));
      add(x, linear(attention(q, k, v, T, H, G, D, hf_window(c, l)), T, C, w.at(p + "self_attn.o_proj.weight"), C,
                    true));
      }
      const Vec m = layer_norm(x, T, C, w.at(p + "post_attention_layernorm.weight"), nullptr, eps, true);
      auto swiglu_mlp = [&](const Vec& in, const std::string& gate, const std::string& up, const std::string& down) {
        const Vec g = linear(in, T, C, w.at(gate), F, true);
        Vec u = linear(in, T, C, w.at(up), F, true);
        for (size_t i = 0; i < u.size(); ++i) u[i] *= g[i] / (1.0 + std::exp(-g[i]));  // silu(gate) * up
        return linear(u, T, F, w.at(down), C, true);
      };
      if (deepseek && l >= c["first_k_dense_replace"].get<int64_t>()) {  // DeepseekV3MoE
        const int64_t E = c["n_routed_experts"], Fe = c["moe_intermediate_size"], shared = c["n_shared_experts"];
        const Vec logits = linear(m, T, C, w.at(p + "mlp.gate.weight"), E, true);
        const Vec none;
        const Vec& bias = deepseek_v2 ? none : w.at(p + "mlp.gate.e_score_correction_bias");
        const int64_t dense_F = F;
        F = Fe;
        std::vector<Vec> expert_out;
        for (int64_t j = 0; j < E; ++j) {
          const std::string e = p + "mlp.experts." + std::to_string(j) + ".";
          expert_out.push_back(swiglu_mlp(m, e + "gate_proj.weight", e + "up_proj.weight", e + "down_proj.weight"));
        }
        for (int64_t t = 0; t < T; ++t)
          for (const auto& [e, gate] : deepseek_v2 ? deepseek_v2_route(c, &logits[t * E]) : deepseek_route(c, &logits[t * E], bias))
            for (int64_t d = 0; d < C; ++d) x[t * C + d] += gate * expert_out[e][t * C + d];
        F = Fe * shared;
        if (shared > 0)
          add(x, swiglu_mlp(m, p + "mlp.shared_experts.gate_proj.weight", p + "mlp.shared_experts.up_proj.weight",
                            p + "mlp.shared_experts.down_proj.weight"));
        F = dense_F;
        continue;
      }
      // modeling_qwen3_moe.py: a dense MLP of intermediate_size at the layers of
      // mlp_only_layers and those decoder_sparse_step passes over.
      auto qwen_dense = [&] {
        const nlohmann::json listed = c.value("mlp_only_layers", nlohmann::json::array());
        return std::find(listed.begin(), listed.end(), nlohmann::json(l)) != listed.end() ||
               (l + 1) % c.value("decoder_sparse_step", int64_t{1}) != 0;
      };
      if (!mixtral || (qwen_moe && qwen_dense())) {
        add(x, swiglu_mlp(m, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", p + "mlp.down_proj.weight"));
        continue;
      }
      // modeling_mixtral.py: softmax over the experts, the top k, renormalised; the chosen experts' sum.
      const int64_t E = c[qwen_moe ? "num_experts" : "num_local_experts"], K = c["num_experts_per_tok"];
      const bool renormalise = !qwen_moe || c["norm_topk_prob"].get<bool>();
      const std::string moe = p + (qwen_moe ? "mlp." : "block_sparse_moe.");
      const Vec logits = linear(m, T, C, w.at(moe + "gate.weight"), E, true);
      std::vector<Vec> expert_out;
      const int64_t dense_F = F;
      if (qwen_moe) F = c["moe_intermediate_size"];
      for (int64_t j = 0; j < E; ++j) {
        const std::string e = moe + "experts." + std::to_string(j) + ".";
        expert_out.push_back(qwen_moe ? swiglu_mlp(m, e + "gate_proj.weight", e + "up_proj.weight", e + "down_proj.weight")
                                       : swiglu_mlp(m, e + "w1.weight", e + "w3.weight", e + "w2.weight"));
      }
      F = dense_F;
      for (int64_t t = 0; t < T; ++t) {
        std::vector<std::pair<double, int64_t>> prob;
        double mx = -1e300, z = 0;
        for (int64_t j = 0; j < E; ++j) mx = std::max(mx, logits[t * E + j]);
        for (int64_t j = 0; j < E; ++j) z += std::exp(logits[t * E + j] - mx);
        for (int64_t j = 0; j < E; ++j) prob.push_back({std::exp(logits[t * E + j] - mx) / z, j});
        std::partial_sort(prob.begin(), prob.begin() + K, prob.end(),
                          [](const auto& a, const auto& b) { return a.first > b.first; });
        double chosen = 0;
        for (int64_t k = 0; k < K; ++k) chosen += prob[k].first;
        if (!renormalise) chosen = 1.0;
        for (int64_t k = 0; k < K; ++k)
          for (int64_t e = 0; e < C; ++e) x[t * C + e] += prob[k].first / chosen * expert_out[prob[k].second][t * C + e];
      }
      if (qwen2_moe) {
        F = c["shared_expert_intermediate_size"];
        const Vec shared = swiglu_mlp(m, moe + "shared_expert.gate_proj.weight", moe + "shared_expert.up_proj.weight",
                                      moe + "shared_expert.down_proj.weight");
        const Vec gate = linear(m, T, C, w.at(moe + "shared_expert_gate.weight"), 1, true);
        for (int64_t t = 0; t < T; ++t)
          for (int64_t e = 0; e < C; ++e) x[t * C + e] += shared[t * C + e] / (1.0 + std::exp(-gate[t]));
        F = dense_F;
      }
    } else {
      const std::string p = "transformer.h." + std::to_string(l) + ".";
      const Vec a = layer_norm(x, T, C, w.at(p + "ln_1.weight"), &w.at(p + "ln_1.bias"), eps, false);
      const Vec qkv = linear(a, T, C, w.at(p + "attn.c_attn.weight"), 3 * C, false, &w.at(p + "attn.c_attn.bias"));
      Vec q(static_cast<size_t>(T * C)), k(q.size()), v(q.size());
      for (int64_t t = 0; t < T; ++t)
        for (int64_t e = 0; e < C; ++e) {
          q[t * C + e] = qkv[t * 3 * C + e];
          k[t * C + e] = qkv[t * 3 * C + C + e];
          v[t * C + e] = qkv[t * 3 * C + 2 * C + e];
        }
      add(x, linear(attention(q, k, v, T, H, H, D), T, C, w.at(p + "attn.c_proj.weight"), C, false,
                    &w.at(p + "attn.c_proj.bias")));
      const Vec m = layer_norm(x, T, C, w.at(p + "ln_2.weight"), &w.at(p + "ln_2.bias"), eps, false);
      Vec h = linear(m, T, C, w.at(p + "mlp.c_fc.weight"), F, false, &w.at(p + "mlp.c_fc.bias"));
      for (double& e : h) e = 0.5 * e * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (e + 0.044715 * e * e * e)));
      add(x, linear(h, T, F, w.at(p + "mlp.c_proj.weight"), C, false, &w.at(p + "mlp.c_proj.bias")));
    }
  }
  const Vec f = llama ? layer_norm(x, T, C, w.at("model.norm.weight"), nullptr, eps, true)
                      : layer_norm(x, T, C, w.at("transformer.ln_f.weight"), &w.at("transformer.ln_f.bias"), eps, false);
  const Vec& head = w.has("lm_head.weight") ? w.at("lm_head.weight") : w.at(emb);
  const Vec logits = linear(f, T, C, head, V, true);
  double loss = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (tgt[t] < 0) continue;
    double mx = -1e300, z = 0;
    for (int64_t o = 0; o < V; ++o) mx = std::max(mx, logits[t * V + o]);
    for (int64_t o = 0; o < V; ++o) z += std::exp(logits[t * V + o] - mx);
    loss += mx + std::log(z) - logits[t * V + tgt[t]];
    ++*count;
  }
  return loss;
}

// ---- loom's side ------------------------------------------------------------------

std::string scratch(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / fs::unique_path("loom-hf-" + name + "-%%%%%%");
  fs::create_directories(p);
  return p.string();
}

// Trains the tiny model `overrides` describe at tp 2 x pp 2 x dp 2 for 40 steps (its weights far from their initial values) and
// returns its checkpoint's step directory.
std::string parallel_checkpoint(std::vector<std::string> overrides, const std::string& dir) {
  overrides.insert(overrides.end(), {"parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "run.steps=40",
                                     "checkpoint.every=40", "checkpoint.dir=\"" + dir + "\"", "model.num_layers=4"});
  const auto plan = loom::testing::plan_from(loom::testing::tiny_manifest(), overrides);
  return loom::train::train(plan, {}).checkpoint;
}

// The serial model (tp 1, pp 1) with the checkpoint's gathered parameters: the mean
// loss over one microbatch of the training data, and that microbatch.
// The model's settings without its parallel layout (the serial run's).
std::vector<std::string> serial(std::vector<std::string> overrides) {
  std::erase_if(overrides, [](const std::string& o) { return o.rfind("parallel.", 0) == 0; });
  overrides.push_back("model.num_layers=4");
  return overrides;
}

// Why reading a Hugging Face model into `model` (4 blocks) is refused before any file
// is read: what the model itself cannot be ("cannot read /nonexistent" when it can).
std::string shape_refusal(std::vector<std::string> model) {
  model.push_back("model.num_layers=4");
  try {
    loom::interop::read_hf("/nonexistent", loom::testing::plan_from(loom::testing::tiny_manifest(), serial(model)), 13);
  } catch (const std::exception& e) {
    return std::string(e.what());
  }
  return std::string();
}

double loom_loss(const std::vector<std::string>& model, const loom::train::WholeCheckpoint& ck,
                 std::vector<int32_t>& tokens, std::vector<int32_t>& targets, int64_t& seq, int64_t& mbs) {
  using namespace loom;
  const std::vector<std::string> overrides = serial(model);
  const train::RunPlan plan = loom::testing::plan_from(loom::testing::tiny_manifest(), overrides);
  double loss = 0;
  loom::testing::on_one_rank(plan, [&](runtime::RankRuntime& rt, const train::DataSource& data,
                                      const loom_model_dims& dims) {
    model::Model model(plan.config, *plan.registry, rt, dims, plan.layers, 11);
    seq = dims.seq_len;
    mbs = dims.micro_batch;
    tokens.assign(seq * mbs, 0);
    targets.assign(seq * mbs, 0);
    train::fill_microbatch(data, train::Split::Train, 3, mbs, seq, tokens.data(), targets.data());
    for (int64_t s = 0; s + 1 < seq; ++s)  // every next token, so every position counts
      for (int64_t b = 0; b < mbs; ++b) targets[s * mbs + b] = tokens[(s + 1) * mbs + b];
    for (int64_t b = 0; b < mbs; ++b) targets[(seq - 1) * mbs + b] = -1;
    float* params = static_cast<float*>(model.params());
    for (const model::ParamEntry& e : model.param_entries()) {
      const train::WholeTensor* t = ck.find(e.name);
      ASSERT_NE(t, nullptr) << e.name;
      ASSERT_EQ(t->dtype, LOOM_DTYPE_F32);
      const size_t n = std::min<size_t>(e.numel, static_cast<size_t>(t->numel()));  // padded vocab rows differ
      std::fill(params + e.offset, params + e.offset + e.numel, 0.0f);
      std::memcpy(params + e.offset, t->data.data(), n * sizeof(float));
    }
    model.layer_states().assign(ck.states, "the checkpoint");  // e.g. the routers' expert biases
    float sum = 0;
    int64_t count = 0;
    model.forward(0, tokens.data(), targets.data(), false, 0, &sum, &count);
    loss = static_cast<double>(sum) / static_cast<double>(count);
  });
  return loss;
}

void check_export(const std::vector<std::string>& model, const std::string& architecture) {
  const std::string dir = scratch("ckpt"), out = scratch("out");
  const std::string step = parallel_checkpoint(model, dir);
  ASSERT_FALSE(step.empty());
  const loom::train::WholeCheckpoint ck = loom::train::gather_checkpoint(step, loom::plugins::registry());
  const loom::interop::HfModel hf = loom::interop::export_hf(step, out, loom::plugins::registry());
  EXPECT_EQ(hf.architecture, architecture);

  std::vector<int32_t> tokens, targets;
  int64_t seq = 0, mbs = 0;
  const double want = loom_loss(model, ck, tokens, targets, seq, mbs);
  const HfWeights w = read_hf(out);
  EXPECT_EQ(w.config["architectures"][0], architecture);
  double sum = 0;
  int64_t count = 0;
  for (int64_t b = 0; b < mbs; ++b) {  // each sequence of the [seq, mbs] microbatch
    std::vector<int32_t> tok, tgt;
    for (int64_t s = 0; s < seq; ++s) {
      tok.push_back(tokens[s * mbs + b]);
      tgt.push_back(targets[s * mbs + b]);
    }
    sum += hf_loss(w, tok, tgt, &count);
  }
  const double got = sum / static_cast<double>(count);
  EXPECT_GT(want, 0.5);  // not a degenerate model
  EXPECT_NEAR(got, want, 1e-5 * want) << "the exported model's loss differs from loom's";
  std::cout << "[ loss ] loom " << want << ", transformers-style reference " << got << "\n";
  fs::remove_all(dir);
  fs::remove_all(out);
}

TEST(HfExport, Gpt2FromTp2Pp2Dp2MatchesLoomsLoss) { check_export({}, "GPT2LMHeadModel"); }

TEST(HfExport, LlamaWithGroupedQueriesAndUntiedHeadMatchesLoomsLoss) {
  check_export({"model.tie_embeddings=false", "model.num_heads=4", "model.ffn_hidden_size=48",
                "model.layer.embedding.position_embedding=\"rope\"", "model.layer.attention.position_embedding=\"rope\"",
                "model.layer.attention.num_query_groups=2", "model.layer.attention.norm=\"rmsnorm\"",
                "model.layer.attention.bias=false", "model.layer.attention.rotary_base=500000.0",
                "model.layer.mlp.norm=\"rmsnorm\"", "model.layer.mlp.activation=\"swiglu\"", "model.layer.mlp.bias=false",
                "model.layer.lm_head.norm=\"rmsnorm\""},
               "LlamaForCausalLM");
}

const std::vector<std::string>& mixtral() {
  static const std::vector<std::string> o = {
      "model.block=[\"attention\", \"moe\"]", "model.num_heads=4", "model.layer.moe.num_experts=4",
      "model.layer.moe.top_k=2", "model.layer.moe.ffn_hidden_size=24", "model.layer.moe.norm=\"rmsnorm\"",
      "model.layer.moe.activation=\"swiglu\"", "model.layer.moe.bias=false",
      "model.layer.embedding.position_embedding=\"rope\"", "model.layer.attention.position_embedding=\"rope\"",
      "model.layer.attention.num_query_groups=2", "model.layer.attention.norm=\"rmsnorm\"",
      "model.layer.attention.bias=false", "model.layer.lm_head.norm=\"rmsnorm\"", "parallel.ep=2",
      "parallel.sequence_parallel=true"};
  return o;
}

TEST(HfExport, MixtralFromTp2Pp2Dp2Ep2MatchesLoomsLoss) { check_export(mixtral(), "MixtralForCausalLM"); }

// Qwen3: Llama's blocks with qk_norm (q_norm, k_norm); Qwen3-MoE: Mixtral's with it, with
// either gate (norm_topk_prob).
const std::vector<std::string>& qwen3() {
  static const std::vector<std::string> o = [] {
    std::vector<std::string> v = {"model.tie_embeddings=false", "model.num_heads=4", "model.ffn_hidden_size=48",
                                  "model.layer.embedding.position_embedding=\"rope\"",
                                  "model.layer.attention.position_embedding=\"rope\"",
                                  "model.layer.attention.num_query_groups=2", "model.layer.attention.norm=\"rmsnorm\"",
                                  "model.layer.attention.bias=false", "model.layer.attention.qk_norm=true",
                                  "model.layer.mlp.norm=\"rmsnorm\"", "model.layer.mlp.activation=\"swiglu\"",
                                  "model.layer.mlp.bias=false", "model.layer.lm_head.norm=\"rmsnorm\""};
    return v;
  }();
  return o;
}
std::vector<std::string> qwen3_moe(bool pre_softmax) {
  std::vector<std::string> v = mixtral();
  v.push_back("model.layer.attention.qk_norm=true");
  v.push_back(std::string("model.layer.moe.pre_softmax=") + (pre_softmax ? "true" : "false"));
  return v;
}
TEST(HfExport, Qwen3FromTp2Pp2Dp2MatchesLoomsLoss) { check_export(qwen3(), "Qwen3ForCausalLM"); }

// Qwen2: Llama's blocks with biases on q, k and v (add_qkv_bias), a base of 1e6.
std::vector<std::string> qwen2() {
  std::vector<std::string> v = qwen3();
  std::erase(v, std::string("model.layer.attention.qk_norm=true"));
  v.push_back("model.layer.attention.add_qkv_bias=true");
  v.push_back("model.layer.attention.rotary_base=1000000.0");
  return v;
}
TEST(HfExport, Qwen2FromTp2Pp2Dp2MatchesLoomsLoss) { check_export(qwen2(), "Qwen2ForCausalLM"); }


TEST(HfExport, Qwen3MoeWithEitherGateMatchesLoomsLoss) {
  check_export(qwen3_moe(false), "Qwen3MoeForCausalLM");
  check_export(qwen3_moe(true), "Qwen3MoeForCausalLM");
}

// DeepSeek-V3's blocks: multi-latent attention (q through a latent, or directly) before
// dense SwiGLU MLPs, or before DeepSeek-V3's MoE: sigmoid scores in groups, the expert
// bias trained (40 steps at 0.005 move it by up to 0.2: it changes some choices), gates
// scaled by 2.5, a shared expert two experts wide.
std::vector<std::string> deepseek_v3(bool moe, bool query_latent = true) {
  std::vector<std::string> v = {"model.layer.embedding.position_embedding=\"rope\"",
                                "model.layer.attention.position_embedding=\"rope\"",
                                "model.layer.attention.norm=\"rmsnorm\"",
                                "model.layer.attention.bias=false",
                                "model.layer.attention.multi_latent_attention=true",
                                std::string("model.layer.attention.q_lora_rank=") + (query_latent ? "12" : "0"),
                                "model.layer.attention.kv_lora_rank=10",
                                "model.layer.attention.qk_head_dim=6",
                                "model.layer.attention.qk_pos_emb_head_dim=4",
                                "model.layer.attention.v_head_dim=5",
                                "model.layer.lm_head.norm=\"rmsnorm\"",
                                "model.layer.attention.norm_epsilon=1e-6",
                                "model.layer.lm_head.norm_epsilon=1e-6"};
  const std::string ffn = moe ? "moe" : "mlp";
  for (const std::string& o : {ffn + ".norm=\"rmsnorm\"", ffn + ".activation=\"swiglu\"", ffn + ".bias=false",
                               ffn + ".norm_epsilon=1e-6"})
    v.push_back("model.layer." + o);
  if (moe)
    for (const char* o : {"model.block=[\"attention\", \"moe\"]", "model.layer.moe.num_experts=8",
                          "model.layer.moe.top_k=4", "model.layer.moe.ffn_hidden_size=16",
                          "model.layer.moe.score_function=\"sigmoid\"", "model.layer.moe.num_groups=4",
                          "model.layer.moe.group_topk=2", "model.layer.moe.topk_scaling_factor=2.5",
                          "model.layer.moe.expert_bias=true", "model.layer.moe.expert_bias_update_rate=0.005",
                          "model.layer.moe.shared_expert_ffn_hidden_size=32"})
      v.push_back(o);
  return v;
}
TEST(HfExport, DeepSeekV3FromTp2Pp2Dp2MatchesLoomsLoss) {
  check_export(deepseek_v3(/*moe=*/false), "DeepseekV3ForCausalLM");
  check_export(deepseek_v3(/*moe=*/false, /*query_latent=*/false), "DeepseekV3ForCausalLM");
  check_export(deepseek_v3(/*moe=*/true), "DeepseekV3ForCausalLM");
}

TEST(HfExport, ABlockWithoutACounterpartIsRefusedNamingWhy) {
  const std::string dir = scratch("moe");
  const std::string step = parallel_checkpoint({"model.layer.mlp.activation=\"swiglu\""}, dir);
  try {
    loom::interop::export_hf(step, dir + "/out", loom::plugins::registry());
    ADD_FAILURE() << "a GPT-2 model with SwiGLU MLPs was exported";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("neither GPT-2's"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
  // GPT-2's attention has no sliding window, unless it reaches over every sequence.
  const std::string windowed = scratch("gpt2-window");
  try {
    loom::interop::export_hf(parallel_checkpoint({"model.layer.attention.sliding_window=5"}, windowed), windowed + "/out",
                             loom::plugins::registry());
    ADD_FAILURE() << "a GPT-2 model with a sliding window was exported";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("GPT-2's attention has no sliding window (sliding_window = 5, shorter than "
                                         "model.seq_length = 16)"),
              std::string::npos)
        << e.what();
  }
  fs::remove_all(windowed);
  check_export({"model.layer.attention.sliding_window=16"}, "GPT2LMHeadModel");
  // Mixtral's router is the softmax's top-k over all experts.
  const std::string sigmoid = scratch("mixtral-sigmoid");
  std::vector<std::string> deepseek = mixtral();
  deepseek.push_back("model.layer.moe.score_function=\"sigmoid\"");
  try {
    loom::interop::export_hf(parallel_checkpoint(deepseek, sigmoid), sigmoid + "/out", loom::plugins::registry());
    ADD_FAILURE() << "a Mixtral model with sigmoid router scores was exported";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("router is the softmax's top-k over all experts: score_function, "
                                         "topk_scaling_factor and num_groups have no counterpart"),
              std::string::npos)
        << e.what();
  }
  fs::remove_all(sigmoid);
  // DeepSeek-V3's router ranks a group by its 2 best scores: loom's top_k / group_topk must be 2.
  const std::string latent = scratch("deepseek-groups");
  std::vector<std::string> ranked = deepseek_v3(true);
  ranked.push_back("model.layer.moe.top_k=2");
  try {
    loom::interop::export_hf(parallel_checkpoint(ranked, latent), latent + "/out", loom::plugins::registry());
    ADD_FAILURE() << "a DeepSeek-V3 model ranking groups by their best score was exported";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("DeepSeek-V3 ranks a group of experts by the sum of its 2 best scores, loom "
                                         "by the sum of its top_k / group_topk = 1 best"),
              std::string::npos)
        << e.what();
  }
  fs::remove_all(latent);
  // transformers normalises DeepSeek-V3's latents with epsilon 1e-6 whatever rms_norm_eps says.
  const std::string eps = scratch("deepseek-eps");
  std::vector<std::string> other_eps = deepseek_v3(false);
  for (const char* layer : {"attention", "mlp", "lm_head"})
    other_eps.push_back(std::string("model.layer.") + layer + ".norm_epsilon=1e-5");
  try {
    loom::interop::export_hf(parallel_checkpoint(other_eps, eps), eps + "/out", loom::plugins::registry());
    ADD_FAILURE() << "a DeepSeek-V3 model with latent norms of epsilon 1e-5 was exported";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("DeepSeek-V2/V3 normalise their latents with epsilon 1e-6"), std::string::npos)
        << e.what();
  }
  fs::remove_all(eps);
}

// A block of two attention + MLP pairs (4 blocks) is an 8-layer Hugging Face model, and
// reads back bit for bit.
const std::vector<std::string>& two_pairs() {
  static const std::vector<std::string> o = {"model.block=[\"attention\", \"mlp\", \"att2\", \"mlp2\"]",
                                             "model.layer.att2.plugin=\"attention\"",
                                             "model.layer.mlp2.plugin=\"mlp\""};
  return o;
}
TEST(HfExport, ABlockOfTwoPairsExportsAsTwiceTheLayers) { check_export(two_pairs(), "GPT2LMHeadModel"); }

// What one Hugging Face config cannot say is refused, on export and import alike:
// pairs of a block configured differently, and normalization epsilons that differ.
TEST(HfExport, PairsConfiguredUnlikeAndEpsilonsThatDifferAreRefused) {
  const auto refusal = shape_refusal;
  std::vector<std::string> unlike = two_pairs();
  unlike.push_back("model.layer.mlp2.activation=\"swiglu\"");
  EXPECT_NE(refusal(unlike).find("layer blocks.0.mlp2 is configured unlike blocks.0.mlp"), std::string::npos)
      << refusal(unlike);
  EXPECT_NE(refusal({"model.layer.lm_head.norm_epsilon=0.5"}).find("a Hugging Face model has one normalization epsilon"),
            std::string::npos);
  EXPECT_NE(refusal({"model.layer.mlp.norm_epsilon=0.01"}).find("[model.layer.mlp] norm_epsilon"), std::string::npos);
  EXPECT_NE(refusal({}).find("cannot read /nonexistent"), std::string::npos);  // a consistent model gets as far as the files
  std::vector<std::string> dropout_only = two_pairs();  // training-only options may differ
  dropout_only.push_back("model.layer.mlp2.dropout=0.2");
  EXPECT_NE(refusal(dropout_only).find("cannot read /nonexistent"), std::string::npos) << refusal(dropout_only);
}

// ---- checkpoint.init_weights ---------------------------------------------------------

const std::vector<std::string>& llama() {
  static const std::vector<std::string> o = {
      "model.tie_embeddings=false", "model.num_heads=4", "model.ffn_hidden_size=48",
      "model.layer.embedding.position_embedding=\"rope\"", "model.layer.attention.position_embedding=\"rope\"",
      "model.layer.attention.num_query_groups=2", "model.layer.attention.norm=\"rmsnorm\"",
      "model.layer.attention.bias=false", "model.layer.attention.rotary_base=500000.0", "model.layer.mlp.norm=\"rmsnorm\"",
      "model.layer.mlp.activation=\"swiglu\"", "model.layer.mlp.bias=false", "model.layer.lm_head.norm=\"rmsnorm\""};
  return o;
}

// The run of `overrides` (4 blocks) starting from `weights`: its losses.
std::vector<double> losses_from(std::vector<std::string> overrides, const std::string& weights, int steps = 2) {
  overrides.insert(overrides.end(), {"model.num_layers=4", "run.steps=" + std::to_string(steps)});
  if (!weights.empty()) overrides.push_back("checkpoint.init_weights=\"" + weights + "\"");
  const loom::train::RunPlan plan = loom::testing::plan_from(loom::testing::tiny_manifest(), overrides);
  loom::train::TrainOptions opts;
  opts.read_init_weights = [&](int64_t vocab) {
    return loom::interop::read_initial_weights(weights, plan, vocab, loom::plugins::registry());
  };
  std::vector<double> out;
  for (const auto& s : loom::train::train(plan, opts).steps) out.push_back(s.loss);
  return out;
}

// Reads the export in `out` back for `model` with its config.json `c` edited: why it
// was refused, or "" (the tiny model's vocabulary of 13).
std::string read_edited_config(const std::string& out, const nlohmann::json& c, const std::vector<std::string>& model,
                               const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json e = c;
  edit(e);
  std::ofstream(out + "/config.json") << e.dump();
  try {
    loom::interop::read_hf(out, loom::testing::plan_from(loom::testing::tiny_manifest(), serial(model)), 13);
  } catch (const std::exception& ex) {
    return std::string(ex.what());
  }
  return std::string();
}

// Export, then read back: the same tensors, bit for bit (the vocabulary tables' real rows).
void check_round_trip(const std::vector<std::string>& model) {
  const std::string dir = scratch("rt"), out = scratch("rt-out");
  const std::string step = parallel_checkpoint(model, dir);
  loom::interop::export_hf(step, out, loom::plugins::registry());
  const loom::train::WholeCheckpoint ck = loom::train::gather_checkpoint(step, loom::plugins::registry());
  const loom::train::RunPlan plan = loom::testing::plan_from(loom::testing::tiny_manifest(), serial(model));
  const loom::train::InitialWeights back = loom::interop::read_hf(out, plan, ck.vocab);
  size_t compared = 0;
  for (const loom::train::WholeTensor& t : back.tensors) {
    const loom::train::WholeTensor* want = ck.find(t.name);
    ASSERT_NE(want, nullptr) << t.name;
    ASSERT_LE(t.data.size(), want->data.size()) << t.name;
    EXPECT_EQ(0, std::memcmp(t.data.data(), want->data.data(), t.data.size())) << t.name << " differs after the round trip";
    EXPECT_EQ(t.shape[0] == want->shape[0], t.data.size() == want->data.size()) << t.name;
    ++compared;
  }
  for (const auto& [name, values] : ck.states)  // DeepSeek-V3's router biases (not the optional last load)
    if (name.ends_with("expert_bias")) {
      ASSERT_TRUE(back.states.count(name)) << name << " was not read back";
      EXPECT_EQ(back.states.at(name), values) << name;
    }
  std::set<std::string> ties;  // a tied copy another stage holds is one tensor of the export
  size_t distinct = 0;
  for (const loom::train::WholeTensor& t : ck.tensors) distinct += t.tie_key.empty() || ties.insert(t.tie_key).second;
  EXPECT_EQ(compared, distinct);
  fs::remove_all(dir);
  fs::remove_all(out);
}

TEST(HfImport, Gpt2RoundTripIsBitExact) { check_round_trip({}); }
TEST(HfImport, DeepSeekV3RoundTripIsBitExact) {
  check_round_trip(deepseek_v3(/*moe=*/false, /*query_latent=*/false));
  check_round_trip(deepseek_v3(/*moe=*/true));
  // bf16 weights, the router biases in F32 beside them (as transformers keeps them).
  std::vector<std::string> bf16 = deepseek_v3(/*moe=*/true);
  bf16.push_back("device.param_dtype=\"bf16\"");
  check_round_trip(bf16);
}

// DeepSeek's own checkpoints pair the rotary elements (2i, 2i + 1) (rope_interleave, the
// config's default): the export with its q_b_proj and kv_a_proj_with_mqa rotary rows
// interleaved so computes the same loss under transformers' interleaved rotation, and
// reads back as the original weights.
TEST(HfImport, DeepSeekV3InterleavedRotaryRowsReadAsLoomsHalves) {
  const std::vector<std::string> model = deepseek_v3(/*moe=*/true);
  const std::string dir = scratch("ds-il"), out = scratch("ds-il-out");
  const std::string step = parallel_checkpoint(model, dir);
  loom::interop::export_hf(step, out, loom::plugins::registry());
  const std::string st = out + "/model.safetensors";
  loom::interop::SafetensorsFile f = loom::interop::read_safetensors(st);
  const int64_t qk = 10, rope = 4, kv = 10;
  size_t changed = 0;
  for (loom::interop::NamedTensor& t : f.tensors) {
    const bool q = t.name.ends_with("q_b_proj.weight"), down = t.name.ends_with("kv_a_proj_with_mqa.weight");
    if (!q && !down) continue;
    const size_t row = static_cast<size_t>(t.shape[1]) * 4;
    const std::vector<char> was = t.data;
    for (int64_t r0 = q ? qk - rope : kv; r0 < t.shape[0]; r0 += q ? qk : kv + rope)
      for (int64_t i = 0; i < rope / 2; ++i) {  // halves (i, i + rope/2) to pairs (2i, 2i + 1)
        std::memcpy(t.data.data() + (r0 + 2 * i) * row, was.data() + (r0 + i) * row, row);
        std::memcpy(t.data.data() + (r0 + 2 * i + 1) * row, was.data() + (r0 + rope / 2 + i) * row, row);
      }
    changed += t.data != was;
  }
  EXPECT_EQ(changed, 8u);  // 4 layers' q_b_proj and kv_a_proj_with_mqa
  loom::interop::write_safetensors(st, f.tensors, f.metadata);
  nlohmann::json config = nlohmann::json::parse(std::ifstream(out + "/config.json"));
  config["rope_interleave"] = true;
  std::ofstream(out + "/config.json") << config.dump(2);

  const loom::train::WholeCheckpoint ck = loom::train::gather_checkpoint(step, loom::plugins::registry());
  std::vector<int32_t> tokens, targets;
  int64_t seq = 0, mbs = 0;
  const double want = loom_loss(model, ck, tokens, targets, seq, mbs);
  const HfWeights w = read_hf(out);
  double sum = 0;
  int64_t count = 0;
  for (int64_t b = 0; b < mbs; ++b) {
    std::vector<int32_t> tok, tgt;
    for (int64_t s = 0; s < seq; ++s) {
      tok.push_back(tokens[s * mbs + b]);
      tgt.push_back(targets[s * mbs + b]);
    }
    sum += hf_loss(w, tok, tgt, &count);
  }
  EXPECT_NEAR(sum / static_cast<double>(count), want, 1e-5 * want) << "interleaved rows under the interleaved rotation";
  const loom::train::RunPlan plan = loom::testing::plan_from(loom::testing::tiny_manifest(), serial(model));
  const loom::train::InitialWeights back = loom::interop::read_hf(out, plan, ck.vocab);
  for (const loom::train::WholeTensor& t : back.tensors) {
    const loom::train::WholeTensor* orig = ck.find(t.name);
    ASSERT_NE(orig, nullptr) << t.name;
    EXPECT_EQ(0, std::memcmp(t.data.data(), orig->data.data(), t.data.size())) << t.name;
  }
  fs::remove_all(dir);
  fs::remove_all(out);
}
TEST(HfImport, TwoPairsABlockRoundTripIsBitExact) { check_round_trip(two_pairs()); }
TEST(HfImport, LlamaRoundTripIsBitExact) { check_round_trip(llama()); }
TEST(HfImport, MixtralRoundTripIsBitExact) { check_round_trip(mixtral()); }

// sliding_window: Llama's blocks with a window are Mistral's (MistralForCausalLM);
// Mixtral, Qwen3 and Qwen3-MoE carry theirs (Qwen3's in every layer: max_window_layers
// 0, layer_types all sliding_attention). A window of 5 over sequences of 16: the
// transformers-style forward masks as masking_utils.py does.
std::vector<std::string> windowed(std::vector<std::string> model) {
  model.push_back("model.layer.attention.sliding_window=5");
  return model;
}
TEST(HfExport, SlidingWindowsMatchLoomsLoss) {
  check_export(windowed(llama()), "MistralForCausalLM");
  check_export(windowed(mixtral()), "MixtralForCausalLM");
  check_export(windowed(qwen3()), "Qwen3ForCausalLM");
  check_export(windowed(qwen3_moe(false)), "Qwen3MoeForCausalLM");
  check_export(windowed(qwen2()), "Qwen2ForCausalLM");
}

// Read back bit for bit; a config whose window acts otherwise on model.seq_length
// tokens is refused naming the setting; a Mistral without a window there (none, the
// default 4096, or one as long as the sequence) is Llama's blocks.
TEST(HfImport, SlidingWindowsRoundTripAndMustMatch) {
  check_round_trip(windowed(llama()));
  check_round_trip(windowed(qwen3()));
  const std::string dir = scratch("sw"), out = scratch("sw-out");
  loom::interop::export_hf(parallel_checkpoint(windowed(llama()), dir), out, loom::plugins::registry());
  nlohmann::json c;
  std::ifstream(out + "/config.json") >> c;
  EXPECT_EQ(c["sliding_window"], 5);
  auto read = [&](const std::vector<std::string>& model, const std::function<void(nlohmann::json&)>& edit) {
    return read_edited_config(out, c, model, edit);
  };
  const auto same = [](nlohmann::json&) {};
  EXPECT_EQ(read(windowed(llama()), same), "");
  EXPECT_NE(read(llama(), same).find("attention slides a window of 5 tokens (sliding_window), and the model's every "
                                     "earlier one; set model.layer.attention.sliding_window = 5"),
            std::string::npos)
      << read(llama(), same);
  EXPECT_NE(read(windowed(llama()), [](nlohmann::json& e) { e["sliding_window"] = 7; })
                .find("set model.layer.attention.sliding_window = 7"),
            std::string::npos);
  for (const nlohmann::json& none : {nlohmann::json(), nlohmann::json(16), nlohmann::json(4096)}) {
    EXPECT_EQ(read(llama(), [&](nlohmann::json& e) { e["sliding_window"] = none; }), "") << none.dump();
    EXPECT_NE(read(windowed(llama()), [&](nlohmann::json& e) { e["sliding_window"] = none; })
                  .find("attention sees every earlier token of model.seq_length = 16, and the model's a window of 5"),
              std::string::npos)
        << none.dump();
  }
  EXPECT_EQ(read(llama(), [](nlohmann::json& e) { e.erase("sliding_window"); }), "") << "MistralConfig's 4096";
  EXPECT_NE(read(windowed(llama()), [](nlohmann::json& e) { e["sliding_window"] = 0; })
                .find("sliding_window = 0 is not a positive integer or null"),
            std::string::npos);
  // A Llama config has no window: the manifest's is refused.
  EXPECT_NE(read(windowed(llama()),
                 [](nlohmann::json& e) {
                   e["architectures"] = {"LlamaForCausalLM"};
                   e["model_type"] = "llama";
                 })
                .find("set model.layer.attention.sliding_window = 0"),
            std::string::npos);
  fs::remove_all(dir);
  fs::remove_all(out);
  // Qwen3 with windows in some layers only (max_window_layers, or layer_types).
  const std::string qdir = scratch("swq"), qout = scratch("swq-out");
  loom::interop::export_hf(parallel_checkpoint(windowed(qwen3()), qdir), qout, loom::plugins::registry());
  std::ifstream(qout + "/config.json") >> c;
  EXPECT_EQ(c["max_window_layers"], 0);
  EXPECT_EQ(c["layer_types"].size(), 4u);
  c.erase("layer_types");
  c["max_window_layers"] = 2;
  std::ofstream(qout + "/config.json") << c.dump();
  try {
    loom::interop::read_hf(qout, loom::testing::plan_from(loom::testing::tiny_manifest(), serial(windowed(qwen3()))), 13);
    ADD_FAILURE() << "windows in 2 of 4 layers must be refused";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("2 of the 4 layers slide a window of 5 tokens"), std::string::npos) << e.what();
  }
  fs::remove_all(qdir);
  fs::remove_all(qout);
}
// Llama 3.1's scaled rotary embedding (rope_scaling of rope_type "llama3"): with theta
// 100, original_max_position 64, low 1, high 4 the head's 4 pairs are kept, blended twice
// and slowed.
std::vector<std::string> llama3_rope() {
  std::vector<std::string> v;
  for (const std::string& o : llama())
    if (o.rfind("model.layer.attention.rotary_base", 0) != 0) v.push_back(o);
  v.insert(v.end(), {"model.layer.attention.rotary_base=100.0", "model.layer.attention.rope_scaling=\"llama3\"",
                     "model.layer.attention.rope_scaling_factor=8.0", "model.layer.attention.rope_low_freq_factor=1.0",
                     "model.layer.attention.rope_high_freq_factor=4.0",
                     "model.layer.attention.rope_original_max_position=64"});
  return v;
}
TEST(HfExport, LlamaWithLlama3RopeScalingMatchesLoomsLoss) { check_export(llama3_rope(), "LlamaForCausalLM"); }
TEST(HfImport, Llama3RopeScalingRoundTripsAndMustMatch) {
  check_round_trip(llama3_rope());
  const std::string dir = scratch("l3"), out = scratch("l3-out");
  loom::interop::export_hf(parallel_checkpoint(llama3_rope(), dir), out, loom::plugins::registry());
  nlohmann::json c;
  std::ifstream(out + "/config.json") >> c;
  EXPECT_EQ(c["rope_scaling"]["rope_type"], "llama3");
  auto refusal = [&](const std::vector<std::string>& model, const std::function<void(nlohmann::json&)>& edit) {
    return read_edited_config(out, c, model, edit);
  };
  EXPECT_NE(refusal(llama3_rope(), [](nlohmann::json& e) { e["rope_scaling"]["factor"] = 32.0; })
                .find("rope_scaling.factor = 32.0 but the model's is 8.0"),
            std::string::npos);
  EXPECT_NE(refusal(llama3_rope(), [](nlohmann::json& e) { e.erase("rope_scaling"); }).find("has no rope_scaling"),
            std::string::npos);
  // transformers 5's form: rope_parameters with rope_theta inside; both keys must agree.
  EXPECT_EQ(refusal(llama3_rope(),
                    [](nlohmann::json& e) {
                      e["rope_parameters"] = e["rope_scaling"];
                      e["rope_parameters"]["rope_theta"] = e["rope_theta"];
                      e.erase("rope_scaling");
                      e.erase("rope_theta");
                    }),
            "");
  EXPECT_NE(refusal(llama3_rope(),
                    [](nlohmann::json& e) {
                      e["rope_parameters"] = e["rope_scaling"];
                      e["rope_scaling"] = {{"rope_type", "default"}};
                    })
                .find("leaves the frequencies unscaled"),
            std::string::npos);
  EXPECT_NE(refusal(llama3_rope(), [](nlohmann::json& e) { e["rope_scaling"]["rope_theta"] = 500000.0; })
                .find("rope_scaling.rope_theta = 500000.0 differs from rope_theta = 100.0"),
            std::string::npos);
  std::vector<std::string> unscaled;
  for (const std::string& o : llama3_rope())
    if (o.find("rope_scaling=") == std::string::npos) unscaled.push_back(o);
  EXPECT_NE(refusal(unscaled, [](nlohmann::json&) {}).find("set model.layer.attention.rope_scaling = \"llama3\""),
            std::string::npos);
  fs::remove_all(dir);
  fs::remove_all(out);
}
// YaRN (rope_type "yarn"): Qwen2 with a factor of 4 over an original context of 64 at
// theta 100 (its head's 4 pairs kept, blended twice, slowed; cos and sin times 0.1 ln 4
// + 1), and DeepSeek-V3 with DeepSeek's mscale = mscale_all_dim (cos and sin unscaled,
// the softmax scale times get_mscale(40, 0.8)^2).
std::vector<std::string> with_yarn(std::vector<std::string> v, const std::vector<std::string>& extra) {
  std::erase_if(v, [](const std::string& o) { return o.rfind("model.layer.attention.rotary_base", 0) == 0; });
  v.push_back("model.layer.attention.rope_scaling=\"yarn\"");
  v.push_back("model.layer.attention.rope_original_max_position=64");
  for (const std::string& o : extra) v.push_back("model.layer.attention." + o);
  return v;
}
std::vector<std::string> qwen2_yarn() { return with_yarn(qwen2(), {"rotary_base=100.0", "rope_scaling_factor=4.0"}); }
std::vector<std::string> deepseek_v3_yarn() {
  return with_yarn(deepseek_v3(/*moe=*/true),
                   {"rope_scaling_factor=40.0", "rope_mscale=0.8", "rope_mscale_all_dim=0.8"});
}
TEST(HfExport, YarnRopeScalingMatchesLoomsLoss) {
  check_export(qwen2_yarn(), "Qwen2ForCausalLM");
  check_export(deepseek_v3_yarn(), "DeepseekV3ForCausalLM");
}
TEST(HfImport, YarnRopeScalingRoundTripsAndMustMatch) {
  check_round_trip(qwen2_yarn());
  check_round_trip(deepseek_v3_yarn());
  const std::string dir = scratch("yarn"), out = scratch("yarn-out");
  loom::interop::export_hf(parallel_checkpoint(qwen2_yarn(), dir), out, loom::plugins::registry());
  nlohmann::json c;
  std::ifstream(out + "/config.json") >> c;
  EXPECT_EQ(c["rope_scaling"]["rope_type"], "yarn");
  EXPECT_FALSE(c["rope_scaling"].contains("attention_factor")) << "transformers derives loom's from mscale";
  EXPECT_EQ(c["max_position_embeddings"], 256) << "factor x original: transformers 4 derives the factor from it";
  auto refusal = [&](const std::vector<std::string>& model, const std::function<void(nlohmann::json&)>& edit) {
    return read_edited_config(out, c, model, edit);
  };
  // Qwen's own form ({"type": "yarn", factor, original_max_position_embeddings}) is the same scaling.
  EXPECT_EQ(refusal(qwen2_yarn(),
                    [](nlohmann::json& e) {
                      e["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 64}};
                    }),
            "");
  EXPECT_NE(refusal(qwen2_yarn(), [](nlohmann::json& e) { e["rope_scaling"]["factor"] = 8.0; })
                .find("rope_scaling.factor = 8.0 but the model's is 4.0"),
            std::string::npos);
  EXPECT_NE(refusal(qwen2_yarn(), [](nlohmann::json& e) { e["rope_scaling"]["beta_fast"] = 16; })
                .find("beta_fast = 16.000000 but the model's is 32.0 (model.layer.attention.rope_beta_fast)"),
            std::string::npos);
  EXPECT_NE(refusal(qwen2_yarn(), [](nlohmann::json& e) { e["rope_scaling"]["attention_factor"] = 1.0; })
                .find("rope_scaling.attention_factor = 1.000000 (on cos and sin"),
            std::string::npos);
  EXPECT_NE(refusal(qwen2_yarn(), [](nlohmann::json& e) { e["rope_scaling"]["truncate"] = false; })
                .find("truncate = false"),
            std::string::npos);
  EXPECT_NE(refusal(qwen2_yarn(), [](nlohmann::json& e) { e["rope_scaling"]["rope_type"] = "llama3"; })
                .find("set model.layer.attention.rope_scaling = \"llama3\" with its factors (it is \"yarn\")"),
            std::string::npos);
  std::vector<std::string> unscaled = qwen2_yarn();
  std::erase(unscaled, std::string("model.layer.attention.rope_scaling=\"yarn\""));
  EXPECT_NE(refusal(unscaled, [](nlohmann::json&) {}).find("set model.layer.attention.rope_scaling = \"yarn\""),
            std::string::npos);
  // A rope_attention_factor transformers would not derive is written out.
  std::vector<std::string> given = qwen2_yarn();
  given.push_back("model.layer.attention.rope_attention_factor=1.25");
  const std::string dir2 = scratch("yarn-given"), out2 = scratch("yarn-given-out");
  loom::interop::export_hf(parallel_checkpoint(given, dir2), out2, loom::plugins::registry());
  nlohmann::json c2;
  std::ifstream(out2 + "/config.json") >> c2;
  EXPECT_EQ(c2["rope_scaling"]["attention_factor"], 1.25);
  EXPECT_NE(read_edited_config(out2, c2, qwen2_yarn(), [](nlohmann::json&) {}).find("attention_factor"),
            std::string::npos);
  // A factor whose context is no whole number of positions cannot be written for
  // transformers 4 (which derives the factor from max_position_embeddings).
  std::vector<std::string> fractional = qwen2_yarn();
  fractional.push_back("model.layer.attention.rope_scaling_factor=4.01");
  const std::string dir4 = scratch("yarn-frac");
  try {
    loom::interop::export_hf(parallel_checkpoint(fractional, dir4), dir4 + "/out", loom::plugins::registry());
    ADD_FAILURE() << "a factor of 4.01 over 64 positions was exported";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("is not a whole number of positions"), std::string::npos) << e.what();
  }
  fs::remove_all(dir4);
  // DeepSeek's softmax scale: mscale_all_dim must be the model's.
  const std::string dir3 = scratch("yarn-ds"), out3 = scratch("yarn-ds-out");
  loom::interop::export_hf(parallel_checkpoint(deepseek_v3_yarn(), dir3), out3, loom::plugins::registry());
  nlohmann::json c3;
  std::ifstream(out3 + "/config.json") >> c3;
  EXPECT_NE(read_edited_config(out3, c3, deepseek_v3_yarn(),
                               [](nlohmann::json& e) {
                                 e["rope_scaling"]["mscale"] = 1.0;
                                 e["rope_scaling"]["mscale_all_dim"] = 1.0;
                               })
                .find("mscale_all_dim = 1.000000 (the softmax scale's) but the model's is 0.8"),
            std::string::npos);
  for (const std::string& d : {dir, out, dir2, out2, dir3, out3}) fs::remove_all(d);
}
TEST(HfImport, Qwen3RoundTripIsBitExact) { check_round_trip(qwen3()); }

// Qwen2: its q, k and v biases read back into the fused bias bit for bit (grouped
// queries: each group's columns), with a window too; what it cannot be is refused.
TEST(HfImport, Qwen2RoundTripsAndMustMatch) {
  check_round_trip(qwen2());
  check_round_trip(windowed(qwen2()));
  std::vector<std::string> bf16 = qwen2();
  bf16.push_back("device.param_dtype=\"bf16\"");
  check_round_trip(bf16);
  const std::string dir = scratch("qwen2"), out = scratch("qwen2-out");
  loom::interop::export_hf(parallel_checkpoint(qwen2(), dir), out, loom::plugins::registry());
  nlohmann::json c;
  std::ifstream(out + "/config.json") >> c;
  EXPECT_EQ(c["model_type"], "qwen2");
  EXPECT_FALSE(c.contains("attention_bias")) << "Qwen2Config has none: its q, k and v are biased";
  EXPECT_EQ(c["use_sliding_window"], false);
  EXPECT_EQ(read_edited_config(out, c, qwen2(), [](nlohmann::json&) {}), "");
  // Absent: Qwen2Config's 32 key/value heads, more than the 4 query heads (no model).
  EXPECT_NE(read_edited_config(out, c, qwen2(), [](nlohmann::json& e) { e.erase("num_key_value_heads"); })
                .find("has no num_key_value_heads, and Qwen2ForCausalLM's default of 32 key/value heads does not "
                      "divide num_attention_heads = 4: give num_key_value_heads in config.json"),
            std::string::npos);
  fs::remove_all(dir);
  fs::remove_all(out);
  std::vector<std::string> with_qk_norm = qwen2();
  with_qk_norm.push_back("model.layer.attention.qk_norm=true");
  EXPECT_NE(shape_refusal(with_qk_norm).find("add_qkv_bias (biases on q, k and v alone) is Qwen2's and Qwen2-MoE's attention"),
            std::string::npos)
      << shape_refusal(with_qk_norm);
  // Before MoE layers q, k and v biases are Qwen2-MoE's, whose shared expert is gated.
  std::vector<std::string> moe = mixtral();
  moe.push_back("model.layer.attention.add_qkv_bias=true");
  EXPECT_NE(shape_refusal(moe).find("Qwen2-MoE's MoE blocks are dropless top-k beside a shared expert"),
            std::string::npos)
      << shape_refusal(moe);
}
TEST(HfImport, Qwen3MoeRoundTripIsBitExact) { check_round_trip(qwen3_moe(true)); }

// Dense MLPs among MoE layers (model.block_pattern): DeepSeek-V3's first
// first_k_dense_replace layers, Qwen3-MoE's mlp_only_layers.
std::vector<std::string> with_dense_blocks(std::vector<std::string> v, const std::string& pattern, const char* eps) {
  for (const std::string& o : std::vector<std::string>{"model.layer.mlp.norm=\"rmsnorm\"", "model.layer.mlp.activation=\"swiglu\"",
                              "model.layer.mlp.bias=false", "model.ffn_hidden_size=40",
                              "model.blocks.dense=[\"attention\", \"mlp\"]", "model.block_pattern=" + pattern})
    v.push_back(o);
  if (eps != nullptr) v.push_back(std::string("model.layer.mlp.norm_epsilon=") + eps);
  return v;
}
std::vector<std::string> deepseek_v3_dense_first() {
  return with_dense_blocks(deepseek_v3(/*moe=*/true), "[\"dense\", \"block*3\"]", "1e-6");
}
std::vector<std::string> qwen3_moe_with_dense(const std::string& pattern = "[\"block\", \"dense\", \"block*2\"]") {
  return with_dense_blocks(qwen3_moe(false), pattern, nullptr);
}

// DeepSeek-V2's MoE (softmax router, the softmax's values as gates, scaled, shared
// experts, no bias) after a dense first block, as DeepSeek-V2-Lite; greedy or with
// groups of experts ranked by their best score (group_score = "best"), as DeepSeek-V2.
std::vector<std::string> deepseek_v2(bool groups) {
  std::vector<std::string> v = with_dense_blocks(deepseek_v3(/*moe=*/true), "[\"dense\", \"block*3\"]", "1e-6");
  std::erase_if(v, [](const std::string& o) {
    return o.rfind("model.layer.moe.score_function", 0) == 0 || o.rfind("model.layer.moe.expert_bias", 0) == 0 ||
           o.rfind("model.layer.moe.num_groups", 0) == 0 || o.rfind("model.layer.moe.group_topk", 0) == 0 ||
           o.rfind("model.layer.moe.top_k", 0) == 0 || o.rfind("model.layer.moe.topk_scaling_factor", 0) == 0;
  });
  for (const char* o : {"model.layer.moe.pre_softmax=true", "model.layer.moe.topk_scaling_factor=1.5"})
    v.push_back(o);
  if (groups)  // 4 groups of 2, each token's 4 experts from its 2 groups of the best single score (not the best sum)
    for (const char* o : {"model.layer.moe.top_k=4", "model.layer.moe.num_groups=4", "model.layer.moe.group_topk=2",
                          "model.layer.moe.group_score=\"best\""})
      v.push_back(o);
  else
    v.push_back("model.layer.moe.top_k=3");
  return v;
}

TEST(HfExport, DeepSeekV2MatchesLoomsLoss) {
  check_export(deepseek_v2(/*groups=*/false), "DeepseekV2ForCausalLM");
  check_export(deepseek_v2(/*groups=*/true), "DeepseekV2ForCausalLM");
}

TEST(HfImport, DeepSeekV2RoundTripsAndMustMatch) {
  check_round_trip(deepseek_v2(/*groups=*/false));
  check_round_trip(deepseek_v2(/*groups=*/true));
  const std::vector<std::string> model = deepseek_v2(/*groups=*/false);
  const std::string dir = scratch("deepseek-v2"), out = scratch("deepseek-v2-out");
  loom::interop::export_hf(parallel_checkpoint(model, dir), out, loom::plugins::registry());
  nlohmann::json c;
  std::ifstream(out + "/config.json") >> c;
  EXPECT_EQ(c["architectures"][0], "DeepseekV2ForCausalLM");
  EXPECT_EQ(c["topk_method"], "greedy");
  EXPECT_EQ(c["first_k_dense_replace"], 1);
  EXPECT_EQ(c["norm_topk_prob"], false);
  EXPECT_FALSE(c.contains("rope_interleave"));
  EXPECT_EQ(read_edited_config(out, c, model, [](nlohmann::json&) {}), "");
  EXPECT_NE(read_edited_config(out, c, model, [](nlohmann::json& e) { e["norm_topk_prob"] = true; })
                .find("norm_topk_prob = true"),
            std::string::npos);
  EXPECT_NE(read_edited_config(out, c, model, [](nlohmann::json& e) { e["routed_scaling_factor"] = 1.0; })
                .find("routed_scaling_factor = 1.0"),
            std::string::npos);
  EXPECT_NE(read_edited_config(out, c, model, [](nlohmann::json& e) { e.erase("num_experts_per_tok"); })
                .find("has no num_experts_per_tok"),
            std::string::npos);
  EXPECT_NE(read_edited_config(out, c, model, [](nlohmann::json& e) { e["n_shared_experts"] = nullptr; })
                .find("n_shared_experts = null has no shared experts; the model's MoE layers have 2"),
            std::string::npos);
  EXPECT_NE(read_edited_config(out, c, model, [](nlohmann::json& e) { e["q_lora_rank"] = nullptr; })
                .find("q_lora_rank = null projects q directly"),
            std::string::npos);
  EXPECT_NE(read_edited_config(out, c, model, [](nlohmann::json& e) { e["scoring_func"] = "sigmoid"; })
                .find("scoring_func = \"sigmoid\""),
            std::string::npos);
  // DeepseekV2Config's first_k_dense_replace is 0 when absent: every layer MoE.
  EXPECT_NE(read_edited_config(out, c, model, [](nlohmann::json& e) { e.erase("first_k_dense_replace"); })
                .find("first_k_dense_replace = 0 (transformers' default)"),
            std::string::npos);
  fs::remove_all(dir);
  fs::remove_all(out);
  // What DeepSeek-V2's router does not compute is refused before any file is read.
  std::vector<std::string> renormalised = deepseek_v2(false);
  renormalised.push_back("model.layer.moe.pre_softmax=false");
  EXPECT_NE(shape_refusal(renormalised).find("set pre_softmax = true"), std::string::npos) << shape_refusal(renormalised);
  std::vector<std::string> two_best = deepseek_v2(true);
  two_best.push_back("model.layer.moe.group_score=\"top_sum\"");
  two_best.push_back("model.layer.moe.top_k=4");
  EXPECT_NE(shape_refusal(two_best).find("DeepSeek-V2 ranks a group of experts by its best score"), std::string::npos)
      << shape_refusal(two_best);
  std::vector<std::string> unshared = deepseek_v2(false);
  unshared.push_back("model.layer.moe.shared_expert_ffn_hidden_size=0");
  EXPECT_NE(shape_refusal(unshared).find("have n_shared_experts shared experts"), std::string::npos) << shape_refusal(unshared);
  EXPECT_NE(shape_refusal(deepseek_v2(false)).find("cannot read /nonexistent"), std::string::npos);
}

TEST(HfExport, DenseLayersAmongMoeLayersMatchLoomsLoss) {
  check_export(deepseek_v3_dense_first(), "DeepseekV3ForCausalLM");
  check_export(qwen3_moe_with_dense(), "Qwen3MoeForCausalLM");
}

TEST(HfExport, DenseLayersWithoutACounterpartAreRefused) {
  const std::string mixtral_dense = shape_refusal(with_dense_blocks(mixtral(), "[\"dense\", \"block*3\"]", nullptr));
  EXPECT_NE(mixtral_dense.find("Mixtral's layers are all sparse MoE, and this model has dense MLPs among them"),
            std::string::npos)
      << mixtral_dense;
  const std::string late = shape_refusal(with_dense_blocks(deepseek_v3(true), "[\"block\", \"dense\", \"block*2\"]", "1e-6"));
  EXPECT_NE(late.find("DeepSeek-V3's dense MLPs are its first first_k_dense_replace layers, but blocks.1.mlp is dense "
                      "after the MoE blocks.0.moe"),
            std::string::npos)
      << late;
  // The dense MLPs are Llama's too, with the model's one epsilon.
  EXPECT_NE(shape_refusal(with_dense_blocks(deepseek_v3(true), "[\"dense\", \"block*3\"]", "1e-5"))
                .find("[model.layer.mlp] norm_epsilon"),
            std::string::npos);
  std::vector<std::string> gelu = deepseek_v3_dense_first();
  gelu.push_back("model.layer.mlp.activation=\"gelu\"");
  EXPECT_NE(shape_refusal(gelu).find("no Hugging Face architecture matches them"), std::string::npos) << shape_refusal(gelu);
  EXPECT_NE(shape_refusal(deepseek_v3_dense_first()).find("cannot read /nonexistent"), std::string::npos);
}

TEST(HfImport, DenseLayersAmongMoeLayersRoundTripAndMustMatch) {
  check_round_trip(deepseek_v3_dense_first());
  check_round_trip(qwen3_moe_with_dense());
  // The config says which layers are dense as transformers reads it.
  const std::vector<std::string> qwen = qwen3_moe_with_dense();
  const std::string dir = scratch("dense-moe"), out = scratch("dense-moe-out");
  loom::interop::export_hf(parallel_checkpoint(qwen, dir), out, loom::plugins::registry());
  nlohmann::json c;
  std::ifstream(out + "/config.json") >> c;
  EXPECT_EQ(c["mlp_only_layers"], nlohmann::json::array({1}));
  EXPECT_EQ(c["decoder_sparse_step"], 1);
  EXPECT_EQ(c["intermediate_size"], 40);
  EXPECT_EQ(read_edited_config(out, c, qwen, [](nlohmann::json&) {}), "");
  const std::string none = read_edited_config(out, c, qwen, [](nlohmann::json& e) { e["mlp_only_layers"] = nlohmann::json::array(); });
  EXPECT_NE(none.find("layer 1 has an MoE (mlp_only_layers = [], decoder_sparse_step = 1), but the model's "
                      "blocks.1.mlp is a dense MLP"),
            std::string::npos)
      << none;
  EXPECT_NE(read_edited_config(out, c, qwen, [](nlohmann::json& e) { e["decoder_sparse_step"] = 0; })
                .find("decoder_sparse_step = 0 is not positive"),
            std::string::npos);
  EXPECT_NE(read_edited_config(out, c, qwen, [](nlohmann::json& e) { e["mlp_only_layers"] = "1"; })
                .find("is not a list of layer indices"),
            std::string::npos);
  EXPECT_NE(read_edited_config(out, c, qwen, [](nlohmann::json& e) { e["intermediate_size"] = 39; })
                .find("intermediate_size"),
            std::string::npos);
  fs::remove_all(dir);
  fs::remove_all(out);
  // decoder_sparse_step 2: layers 0 and 2 dense, as mlp_only_layers [0, 2] says.
  const std::vector<std::string> alternate = qwen3_moe_with_dense("[\"dense\", \"block\", \"dense\", \"block\"]");
  loom::interop::export_hf(parallel_checkpoint(alternate, dir), out, loom::plugins::registry());
  std::ifstream(out + "/config.json") >> c;
  EXPECT_EQ(c["mlp_only_layers"], nlohmann::json::array({0, 2}));
  EXPECT_EQ(read_edited_config(out, c, alternate,
                               [](nlohmann::json& e) {
                                 e["mlp_only_layers"] = nlohmann::json::array();
                                 e["decoder_sparse_step"] = 2;
                               }),
            "");
  fs::remove_all(dir);
  fs::remove_all(out);
  // DeepSeek-V3: first_k_dense_replace is the dense layers' count (3 when absent), every
  // layer after it MoE.
  const std::vector<std::string> deepseek = deepseek_v3_dense_first();
  loom::interop::export_hf(parallel_checkpoint(deepseek, dir), out, loom::plugins::registry());
  std::ifstream(out + "/config.json") >> c;
  EXPECT_EQ(c["first_k_dense_replace"], 1);
  EXPECT_EQ(c["intermediate_size"], 40);
  EXPECT_EQ(c["moe_intermediate_size"], 16);
  const std::string two = read_edited_config(out, c, deepseek, [](nlohmann::json& e) { e["first_k_dense_replace"] = 2; });
  EXPECT_NE(two.find("first_k_dense_replace = 2 of 4 layers, but the model's first 1 block(s) are dense, then MoE"),
            std::string::npos)
      << two;
  EXPECT_NE(read_edited_config(out, c, deepseek, [](nlohmann::json& e) { e.erase("first_k_dense_replace"); })
                .find("first_k_dense_replace = 3 (transformers' default)"),
            std::string::npos);
  EXPECT_NE(read_edited_config(out, c, deepseek, [](nlohmann::json& e) { e["moe_intermediate_size"] = 40; })
                .find("moe_intermediate_size"),
            std::string::npos);
  const std::string freq = read_edited_config(out, c, deepseek, [](nlohmann::json& e) { e["moe_layer_freq"] = 2; });
  EXPECT_NE(freq.find("moe_layer_freq = 2 leaves MoE layers dense"), std::string::npos) << freq;
  EXPECT_EQ(read_edited_config(out, c, deepseek, [](nlohmann::json& e) { e["moe_layer_freq"] = 1; }), "");
  fs::remove_all(dir);
  fs::remove_all(out);
}

// Qwen2-MoE: Mixtral's blocks with q, k and v biased, either gate, and a shared expert
// gated by a sigmoid; with dense layers among them (mlp_only_layers).
std::vector<std::string> qwen2_moe(bool pre_softmax) {
  std::vector<std::string> v = mixtral();
  for (const std::string& o : std::vector<std::string>{"model.layer.attention.add_qkv_bias=true", "model.layer.moe.shared_expert_ffn_hidden_size=40",
                              "model.layer.moe.shared_expert_gate=true",
                              std::string("model.layer.moe.pre_softmax=") + (pre_softmax ? "true" : "false")})
    v.push_back(o);
  return v;
}
TEST(HfExport, Qwen2MoeWithEitherGateAndDenseLayersMatchesLoomsLoss) {
  check_export(qwen2_moe(true), "Qwen2MoeForCausalLM");
  check_export(qwen2_moe(false), "Qwen2MoeForCausalLM");
  check_export(with_dense_blocks(qwen2_moe(true), "[\"block\", \"dense\", \"block*2\"]", nullptr),
               "Qwen2MoeForCausalLM");
}

TEST(HfImport, Qwen2MoeRoundTripsAndMustMatch) {
  check_round_trip(qwen2_moe(true));
  check_round_trip(with_dense_blocks(qwen2_moe(false), "[\"block\", \"dense\", \"block*2\"]", nullptr));
  const std::vector<std::string> model = qwen2_moe(true);
  const std::string dir = scratch("qwen2-moe"), out = scratch("qwen2-moe-out");
  loom::interop::export_hf(parallel_checkpoint(model, dir), out, loom::plugins::registry());
  nlohmann::json c;
  std::ifstream(out + "/config.json") >> c;
  EXPECT_EQ(c["model_type"], "qwen2_moe");
  EXPECT_EQ(c["shared_expert_intermediate_size"], 40);
  EXPECT_EQ(c["norm_topk_prob"], false);
  EXPECT_EQ(read_edited_config(out, c, model, [](nlohmann::json&) {}), "");
  EXPECT_NE(read_edited_config(out, c, model, [](nlohmann::json& e) { e.erase("shared_expert_intermediate_size"); })
                .find("shared_expert_intermediate_size = 5632 (transformers' default)"),
            std::string::npos);
  const std::string slides = read_edited_config(out, c, model, [](nlohmann::json& e) {
    e["use_sliding_window"] = true;
    e["sliding_window"] = 5;
  });
  EXPECT_NE(slides.find("attention slides a window of 5 tokens"), std::string::npos) << slides;
  fs::remove_all(dir);
  fs::remove_all(out);
  std::vector<std::string> ungated = qwen2_moe(true);
  ungated.push_back("model.layer.moe.shared_expert_gate=false");
  EXPECT_NE(shape_refusal(ungated).find("shared expert gated by a sigmoid"), std::string::npos) << shape_refusal(ungated);
  std::vector<std::string> windowed_moe = qwen2_moe(true);
  windowed_moe.push_back("model.layer.attention.sliding_window=5");
  EXPECT_NE(shape_refusal(windowed_moe).find("Qwen2-MoE's sliding windows alternate by layer"), std::string::npos)
      << shape_refusal(windowed_moe);
}

// A run of another layout (serial; tp 2 with SP; pp 2 x dp 2) started from the export of a
// tp 2 x pp 2 x dp 2 checkpoint, or from the checkpoint itself, has the same first loss,
// not the random initialisation's.
TEST(HfImport, RunsOfAnyLayoutStartFromTheExportedWeights) {
  for (const std::vector<std::string>& model : {std::vector<std::string>{}, llama()}) {
    const std::string dir = scratch("ft"), out = scratch("ft-out");
    const std::string step = parallel_checkpoint(model, dir);
    loom::interop::export_hf(step, out, loom::plugins::registry());
    const double random = losses_from(model, "")[0];
    const double serial = losses_from(model, out)[0];
    EXPECT_GT(std::fabs(serial - random), 1e-3) << "the run did not start from the given weights";
    std::vector<std::string> tp_sp = model, pp_dp = model;
    tp_sp.insert(tp_sp.end(), {"parallel.tp=2", "parallel.sequence_parallel=true"});
    pp_dp.insert(pp_dp.end(), {"parallel.pp=2", "parallel.dp=2"});
    EXPECT_NEAR(losses_from(tp_sp, out)[0], serial, 1e-5 * serial);
    EXPECT_NEAR(losses_from(pp_dp, out)[0], serial, 1e-5 * serial);
    EXPECT_EQ(losses_from(model, step)[0], serial) << "the loom checkpoint and its export differ";
    fs::remove_all(dir);
    fs::remove_all(out);
  }
}

// One command line for every launch of a fine-tuning run: --resume with nothing saved yet
// starts from checkpoint.init_weights, and once a checkpoint exists continues from it.
TEST(HfImport, ResumeBeforeTheFirstCheckpointStartsFromTheGivenWeights) {
  const std::string dir = scratch("pre"), out = scratch("pre-out"), run_dir = scratch("pre-run");
  loom::interop::export_hf(parallel_checkpoint({}, dir), out, loom::plugins::registry());
  const double from_weights = losses_from({}, out, 1)[0];
  auto launch = [&](int steps) {
    const std::vector<std::string> o = {"model.num_layers=4", "run.steps=" + std::to_string(steps),
                                        "checkpoint.init_weights=\"" + out + "\"", "checkpoint.dir=\"" + run_dir + "\""};
    const loom::train::RunPlan plan = loom::testing::plan_from(loom::testing::tiny_manifest(), o);
    loom::train::TrainOptions opts;
    opts.resume = true;
    opts.read_init_weights = [&](int64_t vocab) {
      return loom::interop::read_initial_weights(out, plan, vocab, loom::plugins::registry());
    };
    return loom::train::train(plan, opts);
  };
  const loom::train::TrainResult first = launch(2);
  ASSERT_EQ(first.start_step, 0);
  EXPECT_EQ(first.steps.front().loss, from_weights);
  const loom::train::TrainResult second = launch(3);  // a checkpoint exists now: resumed, not restarted
  EXPECT_EQ(second.start_step, 2);
  fs::remove_all(dir);
  fs::remove_all(out);
  fs::remove_all(run_dir);
}

// loom import: the given weights saved as step 0 of a checkpoint at the manifest's layout
// (tp 2 with SP here), holding the source's tensors bit for bit; a resume from it trains
// as a run started with checkpoint.init_weights = the source does, loss for loss.
TEST(HfImport, AnImportedCheckpointTrainsOnAsInitWeightsDoes) {
  const std::string dir = scratch("imp"), out = scratch("imp-hf"), imported = scratch("imp-ck");
  loom::interop::export_hf(parallel_checkpoint(llama(), dir), out, loom::plugins::registry());
  std::vector<std::string> layout = llama();
  layout.insert(layout.end(), {"parallel.tp=2", "parallel.sequence_parallel=true"});
  const std::vector<double> reference = losses_from(layout, out, 3);
  std::vector<std::string> o = layout;
  o.insert(o.end(), {"model.num_layers=4", "run.steps=3", "checkpoint.init_weights=\"" + out + "\"",
                     "checkpoint.dir=\"" + imported + "\""});
  const loom::train::RunPlan plan = loom::testing::plan_from(loom::testing::tiny_manifest(), o);
  loom::train::TrainOptions import;
  import.save_start_only = true;
  import.read_init_weights = [&](int64_t vocab) {
    return loom::interop::read_initial_weights(out, plan, vocab, loom::plugins::registry());
  };
  const loom::train::TrainResult saved = loom::train::train(plan, import);
  EXPECT_TRUE(saved.steps.empty()) << "an import trains no step";
  ASSERT_EQ(saved.checkpoint, loom::train::checkpoint_path(imported, 0));
  const loom::train::WholeCheckpoint ck = loom::train::gather_checkpoint(saved.checkpoint, loom::plugins::registry());
  const loom::train::InitialWeights source = loom::interop::read_initial_weights(out, plan, ck.vocab, loom::plugins::registry());
  for (const loom::train::WholeTensor& t : source.tensors) {
    const loom::train::WholeTensor* got = ck.find(t.name);
    ASSERT_NE(got, nullptr) << t.name;
    ASSERT_GE(got->data.size(), t.data.size()) << t.name;  // the vocabulary tables' padded rows beyond
    EXPECT_EQ(0, std::memcmp(got->data.data(), t.data.data(), t.data.size())) << t.name;
  }
  loom::train::TrainOptions resume;
  resume.resume = true;
  const loom::train::TrainResult trained = loom::train::train(plan, resume);
  EXPECT_EQ(trained.start_step, 0);
  ASSERT_EQ(trained.steps.size(), reference.size());
  for (size_t i = 0; i < reference.size(); ++i) EXPECT_EQ(trained.steps[i].loss, reference[i]) << "step " << i + 1;
  fs::remove_all(dir);
  fs::remove_all(out);
  fs::remove_all(imported);
}

// checkpoint.init_weights = a checkpoint.dir reads its newest complete step under the
// name a save gives it and says which: a newer step_N spelled otherwise (step_41 for
// step_00000041, read back as the latter, which is not there) is passed over and said,
// as --resume says it.
TEST(HfImport, InitWeightsSaysWhichStepItReadsAndWhatItPassedOver) {
  const std::string dir = scratch("which");
  const std::string step = parallel_checkpoint({}, dir);
  fs::create_directories(fs::path(dir) / "step_41");
  boost::system::error_code ec;
  fs::copy_file(fs::path(step) / "meta.toml", fs::path(dir) / "step_41" / "meta.toml", ec);
  ASSERT_FALSE(ec) << ec.message();
  std::vector<std::string> skipped;
  EXPECT_EQ(loom::train::named_checkpoint(dir, &skipped), step);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_NE(skipped[0].find("step_41 (not the name a save gives step 41: step_00000041)"), std::string::npos)
      << skipped[0];
  EXPECT_EQ(loom::train::named_checkpoint(step), step);
  EXPECT_EQ(loom::train::named_checkpoint(dir + "/nothing"), "");

  const std::vector<std::string> o = {"model.num_layers=4", "run.steps=1", "checkpoint.init_weights=\"" + dir + "\""};
  const loom::train::RunPlan plan = loom::testing::plan_from(loom::testing::tiny_manifest(), o);
  loom::train::TrainOptions opts;
  std::ostringstream log;
  opts.log = &log;
  opts.read_init_weights = [&](int64_t vocab) {
    return loom::interop::read_initial_weights(dir, plan, vocab, loom::plugins::registry());
  };
  loom::train::train(plan, opts);
  EXPECT_NE(log.str().find("init_weights: skipped " + dir + "/step_41 (not the name"), std::string::npos) << log.str();
  EXPECT_NE(log.str().find(" tensors from " + step + "\n"), std::string::npos) << log.str();
  fs::remove_all(dir);
}

TEST(HfImport, AModelThatDoesNotMatchIsRefusedNamingTheSetting) {
  const std::string dir = scratch("bad"), out = scratch("bad-out");
  loom::interop::export_hf(parallel_checkpoint({}, dir), out, loom::plugins::registry());
  auto refusal = [&](std::vector<std::string> o) {
    try {
      losses_from(o, out, 1);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(refusal(llama()).find("architecture GPT2LMHeadModel, but the manifest's blocks are LlamaForCausalLM's"),
            std::string::npos);
  EXPECT_NE(refusal({"model.hidden_size=64"}).find("n_embd = 32 but the model's model.hidden_size is 64"),
            std::string::npos);
  EXPECT_NE(refusal({"model.vocab_size=20"}).find("set model.vocab_size = "), std::string::npos);
  EXPECT_EQ(refusal({}), "");  // and the matching model starts
  // A config.json key loom's model does not compute.
  {
    nlohmann::json c;
    std::ifstream(out + "/config.json") >> c;
    c["activation_function"] = "relu";
    std::ofstream(out + "/config.json") << c.dump();
  }
  EXPECT_NE(refusal({}).find("activation_function = \"relu\", which loom's model does not compute"), std::string::npos);
  // From a loom checkpoint: the same tensors as another model (other heads, fewer layers) are refused.
  std::string step;
  for (const auto& e : fs::directory_iterator(dir)) step = e.path().string();
  auto from_checkpoint = [&](std::vector<std::string> o) {
    try {
      losses_from(o, step, 1);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(from_checkpoint({"model.num_heads=8"}).find("model.num_heads = 4, this run has 8"), std::string::npos);
  EXPECT_NE(from_checkpoint({"model.layer.attention.norm=\"rmsnorm\""}).find("model.layer.attention.norm"),
            std::string::npos);
  EXPECT_EQ(from_checkpoint({"model.layer.attention.dropout=0.1"}), "");  // training-only options may differ
  // Fine-tuning may change how far attention reaches (context extension), and is told;
  // another use of the checkpoint (generate, eval) may not.
  EXPECT_EQ(from_checkpoint({"model.layer.attention.sliding_window=8"}), "");
  {
    const loom::train::WholeCheckpoint ck = loom::train::gather_checkpoint(step, loom::plugins::registry());
    const loom::train::RunPlan windowed = loom::testing::plan_from(
        loom::testing::tiny_manifest(), {"model.num_layers=4", "model.layer.attention.sliding_window=8"});
    std::vector<std::string> changed;
    loom::train::require_same_architecture(ck.manifest_toml, windowed, step, "checkpoint.init_weights", &changed);
    ASSERT_EQ(changed.size(), 1u);
    EXPECT_EQ(changed[0], "model.layer.attention.sliding_window: 0 -> 8");
    try {
      loom::train::require_same_architecture(ck.manifest_toml, windowed, step, "the checkpoint");
      ADD_FAILURE() << "a use other than fine-tuning must refuse another window";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("model.layer.attention.sliding_window = 0, this run has 8"), std::string::npos)
          << e.what();
    }
  }
  fs::remove_all(dir);
  fs::remove_all(out);
}

// An absent config.json key means transformers' default for the architecture (Llama:
// untied head, rope_theta 10000, rms_norm_eps 1e-6), and weights must be finite.
TEST(HfImport, AbsentKeysAreTransformersDefaultsAndWeightsMustBeFinite) {
  const std::string dir = scratch("dflt"), out = scratch("dflt-out");
  const std::string step = parallel_checkpoint(llama(), dir);
  loom::interop::export_hf(step, out, loom::plugins::registry());
  const loom::train::WholeCheckpoint ck = loom::train::gather_checkpoint(step, loom::plugins::registry());
  const loom::train::RunPlan plan = loom::testing::plan_from(loom::testing::tiny_manifest(), serial(llama()));
  nlohmann::json exported;
  std::ifstream(out + "/config.json") >> exported;
  auto with_config = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json c = exported;
    edit(c);
    std::ofstream(out + "/config.json") << c.dump();
    try {
      return std::make_pair(loom::interop::read_hf(out, plan, ck.vocab), std::string());
    } catch (const std::exception& e) {
      return std::make_pair(loom::train::InitialWeights{}, std::string(e.what()));
    }
  };
  // No tie_word_embeddings: LlamaConfig's false, so the file's own lm_head.weight is read.
  const auto untied = with_config([](nlohmann::json& c) { c.erase("tie_word_embeddings"); });
  ASSERT_EQ(untied.second, "");
  const loom::train::WholeTensor* head = ck.find("lm_head.word.weight");
  ASSERT_NE(head, nullptr);
  bool found = false;
  for (const loom::train::WholeTensor& t : untied.first.tensors)
    if (t.name == "lm_head.word.weight") {
      found = true;
      EXPECT_EQ(0, std::memcmp(t.data.data(), head->data.data(), t.data.size())) << "the head is not lm_head.weight";
    }
  EXPECT_TRUE(found);
  // No rope_theta (10000) and no rms_norm_eps (1e-6): not the model's 500000 and 1e-5.
  EXPECT_NE(with_config([](nlohmann::json& c) { c.erase("rope_theta"); })
                .second.find("rope_theta = 10000.0 (transformers' default) but the model's rotary_base is 500000"),
            std::string::npos);
  EXPECT_NE(with_config([](nlohmann::json& c) { c.erase("rms_norm_eps"); })
                .second.find("rms_norm_eps = 1e-06 (transformers' default)"),
            std::string::npos);
  EXPECT_NE(with_config([](nlohmann::json& c) { c["rope_theta"] = "500000"; }).second.find("rope_theta = \"500000\""),
            std::string::npos);
  EXPECT_NE(with_config([](nlohmann::json& c) { c["tie_word_embeddings"] = "false"; })
                .second.find("tie_word_embeddings = \"false\" is not true or false"),
            std::string::npos);
  // LlamaForCausalLM reads no sliding_window (transformers' Llama attention has none).
  EXPECT_EQ(with_config([](nlohmann::json& c) { c["sliding_window"] = 4; }).second, "");
  // transformers 5 keeps rope_theta in rope_parameters, some 4.x saves in rope_scaling
  // with the type "default"; any other type scales the frequencies.
  EXPECT_EQ(with_config([](nlohmann::json& c) {
              c.erase("rope_theta");
              c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 500000.0}};
            }).second,
            "");
  EXPECT_EQ(with_config([](nlohmann::json& c) {
              c["rope_scaling"] = {{"rope_type", "default"}, {"rope_theta", 500000.0}};
            }).second,
            "");
  EXPECT_NE(with_config([](nlohmann::json& c) {
              c.erase("rope_theta");
              c["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 500000.0}, {"factor", 8.0}};
            }).second.find("rope_parameters = {"),
            std::string::npos);
  // A NaN in the final norm's weight.
  with_config([](nlohmann::json&) {});
  auto file = loom::interop::read_safetensors(out + "/model.safetensors");
  for (auto& t : file.tensors)
    if (t.name == "model.norm.weight") {
      const float nan = std::nanf("");
      std::memcpy(t.data.data() + 4, &nan, 4);
    }
  loom::interop::write_safetensors(out + "/model.safetensors", file.tensors, file.metadata);
  EXPECT_NE(with_config([](nlohmann::json&) {}).second.find("model.norm.weight holds nan at element 1"),
            std::string::npos);
  fs::remove_all(dir);
  fs::remove_all(out);
}

// Qwen3's and Qwen3-MoE's config keys: an absent head_dim is Qwen3Config's 128 (not
// this model's 8), a sliding window counts only with use_sliding_window, norm_topk_prob
// must say the model's gate (absent: Qwen3MoeConfig's false), every layer sparse; a
// GPT-2 block with qk_norm has no counterpart.
TEST(HfImport, Qwen3KeysAreReadAsTransformersReadsThem) {
  // Each model trained and exported once; each case edits a copy of its config.json.
  struct Exported {
    std::vector<std::string> model;
    std::string dir, out;
    nlohmann::json config;
    int64_t vocab = 0;
  };
  auto exported = [](const std::vector<std::string>& model) {
    Exported e{model, scratch("qwen"), scratch("qwen-out"), {}, 0};
    const std::string step = parallel_checkpoint(model, e.dir);
    loom::interop::export_hf(step, e.out, loom::plugins::registry());
    e.vocab = loom::train::gather_checkpoint(step, loom::plugins::registry()).vocab;
    std::ifstream(e.out + "/config.json") >> e.config;
    return e;
  };
  const Exported dense = exported(qwen3()), moe = exported(qwen3_moe(false));
  auto config_refusal = [&](const std::vector<std::string>& model, const std::function<void(nlohmann::json&)>& edit) {
    const Exported& e = model == dense.model ? dense : moe;
    nlohmann::json c = e.config;
    edit(c);
    std::ofstream(e.out + "/config.json") << c.dump();
    std::string why;
    try {
      loom::interop::read_hf(e.out, loom::testing::plan_from(loom::testing::tiny_manifest(), serial(model)), e.vocab);
    } catch (const std::exception& ex) {
      why = ex.what();
    }
    return why;
  };
  EXPECT_NE(config_refusal(qwen3(), [](nlohmann::json& c) { c.erase("head_dim"); })
                .find("head_dim = 128 (transformers' default)"),
            std::string::npos);
  EXPECT_EQ(config_refusal(qwen3_moe(false), [](nlohmann::json& c) { c.erase("head_dim"); }), "")
      << "Qwen3MoeConfig has no head_dim: hidden / heads";
  EXPECT_NE(config_refusal(qwen3(), [](nlohmann::json& c) { c.erase("num_key_value_heads"); })
                .find("has no num_key_value_heads, and Qwen3ForCausalLM's default of 32"),
            std::string::npos);
  EXPECT_NE(config_refusal(qwen3(), [](nlohmann::json& c) { c["num_key_value_heads"] = nullptr; })
                .find("num_key_value_heads = 4"),
            std::string::npos)
      << "null is num_attention_heads";
  EXPECT_NE(config_refusal(qwen3_moe(false), [](nlohmann::json& c) { c.erase("num_key_value_heads"); })
                .find("num_key_value_heads (absent: transformers' default) = 4 but the model's "
                      "model.layer.attention.num_query_groups is 2"),
            std::string::npos);
  EXPECT_EQ(config_refusal(qwen3_moe(false),
                           [](nlohmann::json& c) {
                             c["num_local_experts"] = c["num_experts"];  // as transformers 5 saves it
                             c.erase("num_experts");
                           }),
            "");
  // The window: of no layer while use_sliding_window is false, or while the model's 4
  // layers are below max_window_layers (28 by default) and layer_types names none.
  EXPECT_EQ(config_refusal(qwen3(), [](nlohmann::json& c) { c["sliding_window"] = 4; }), "");
  EXPECT_EQ(config_refusal(qwen3(),
                           [](nlohmann::json& c) {
                             c["sliding_window"] = 4;
                             c["use_sliding_window"] = true;
                           }),
            "");
  EXPECT_NE(config_refusal(qwen3(),
                           [](nlohmann::json& c) {
                             c["sliding_window"] = 4;
                             c["use_sliding_window"] = true;
                             c["max_window_layers"] = 2;
                             c.erase("layer_types");  // which would say instead
                           })
                .find("2 of the 4 layers slide a window of 4 tokens"),
            std::string::npos);
  EXPECT_NE(config_refusal(qwen3(),
                           [](nlohmann::json& c) {
                             c["sliding_window"] = 4;
                             c["use_sliding_window"] = true;
                             c["layer_types"] = {"full_attention", "sliding_attention", "full_attention",
                                                 "full_attention"};
                           })
                .find("1 of the 4 layers slide a window of 4 tokens"),
            std::string::npos);
  EXPECT_NE(config_refusal(qwen3_moe(false),
                           [](nlohmann::json& c) {
                             c["sliding_window"] = 4;
                             c["use_sliding_window"] = true;
                           })
                .find("sliding_window = 4"),
            std::string::npos);
  EXPECT_NE(config_refusal(qwen3_moe(false), [](nlohmann::json& c) { c.erase("norm_topk_prob"); })
                .find("norm_topk_prob = false (transformers' default)"),
            std::string::npos);
  EXPECT_NE(config_refusal(qwen3_moe(false), [](nlohmann::json& c) { c["mlp_only_layers"] = {1}; })
                .find("mlp_only_layers = [1]"),
            std::string::npos);
  EXPECT_EQ(config_refusal(qwen3_moe(false), [](nlohmann::json& c) { c["mlp_only_layers"] = {9}; }), "")
      << "the model has 4 layers: 9 names none";
  EXPECT_NE(config_refusal(qwen3(), [](nlohmann::json& c) { c["partial_rotary_factor"] = 0.5; })
                .find("partial_rotary_factor = 0.5"),
            std::string::npos);
  EXPECT_NE(config_refusal(qwen3_moe(false), [](nlohmann::json& c) { c["model_type"] = "mixtral"; })
                .find("model_type = \"mixtral\""),
            std::string::npos);
  const loom::train::RunPlan gpt2_qk = loom::testing::plan_from(
      loom::testing::tiny_manifest(), {"model.num_layers=4", "model.layer.attention.qk_norm=true"});
  try {
    loom::interop::read_hf("/nonexistent", gpt2_qk, 13);
    ADD_FAILURE() << "GPT-2 blocks with qk_norm were taken for GPT-2's";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("no qk_norm"), std::string::npos) << e.what();
  }
  // Tensors the model has no use for are named (transformers warns of unexpected keys
  // too), but for the buffers transformers saves beside the weights.
  {
    std::ofstream(dense.out + "/config.json") << dense.config.dump();
    auto file = loom::interop::read_safetensors(dense.out + "/model.safetensors");
    for (const char* extra : {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.rotary_emb.inv_freq"})
      file.tensors.push_back({extra, "F32", {4}, std::vector<char>(16, 0)});
    loom::interop::write_safetensors(dense.out + "/model.safetensors", file.tensors, file.metadata);
    const loom::train::InitialWeights w = loom::interop::read_hf(
        dense.out, loom::testing::plan_from(loom::testing::tiny_manifest(), serial(qwen3())), dense.vocab);
    EXPECT_EQ(w.unread, std::vector<std::string>{"model.layers.0.self_attn.q_proj.bias"});
  }
  for (const Exported* e : {&dense, &moe}) {
    fs::remove_all(e->dir);
    fs::remove_all(e->out);
  }
}

TEST(HfExport, OutputThatCannotBeWrittenLeavesNothingHalfWritten) {
  const std::string dir = scratch("badout");
  const std::string step = parallel_checkpoint({}, dir);
  auto refusal = [&](const std::string& out) {
    try {
      loom::interop::export_hf(step, out, loom::plugins::registry());
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(refusal(dir).find("holds a loom checkpoint"), std::string::npos);  // exports stay apart from checkpoints
  std::ofstream(dir + "/a-file") << "x";
  EXPECT_NE(refusal(dir + "/a-file").find("is a file"), std::string::npos);
  fs::create_directories(dir + "/out/config.json");  // a directory where config.json goes
  EXPECT_NE(refusal(dir + "/out").find("is a directory"), std::string::npos);
  for (const char* f : {"model.safetensors", "model.safetensors.tmp", "config.json.tmp"})
    EXPECT_FALSE(fs::exists(dir + "/out/" + f)) << f << " was left behind";
  fs::remove_all(dir);
}

// --tokenizer: a SentencePiece model the data could have been encoded with goes beside
// the weights as LlamaTokenizer reads it (the file byte for byte, its special tokens by
// piece and id), replacing an earlier export's tokenizer files; one larger than the
// model's vocabulary is refused and nothing written.
TEST(HfExport, TokenizerFilesGoBesideTheModel) {
  const std::string dir = scratch("tok");
  {
    std::ofstream text(dir + "/corpus.txt");
    for (int i = 0; i < 200; ++i) text << "the cat " << i << " sat on the mat and looked at the dog number " << i * 7 << "\n";
  }
  loom::text::SentencePieceTraining how;
  how.inputs = {dir + "/corpus.txt"};
  how.model_prefix = dir + "/spm";
  how.vocab_size = 300;
  loom::text::train_sentencepiece(how);
  const std::string step = parallel_checkpoint({"model.block=[\"attention\", \"mlp\"]", "model.vocab_size=320"}, dir + "/ck");
  // An earlier export's GPT-2 files and a fast tokenizer AutoTokenizer would prefer.
  fs::create_directories(dir + "/out");
  for (const char* f : {"vocab.json", "merges.txt", "tokenizer.json", "generation_config.json"})
    std::ofstream(dir + "/out/" + f) << "{}";
  const loom::interop::HfModel hf = loom::interop::export_hf(step, dir + "/out", loom::plugins::registry(), dir + "/spm.model");
  EXPECT_EQ(hf.files, (std::vector<std::string>{"tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"}));
  EXPECT_EQ(hf.removed, (std::vector<std::string>{"vocab.json", "merges.txt", "tokenizer.json"}));
  for (const char* f : {"vocab.json", "merges.txt", "tokenizer.json"})
    EXPECT_FALSE(fs::exists(dir + "/out/" + f)) << f << ", another tokenizer's, was left beside the exported one";
  EXPECT_TRUE(fs::exists(dir + "/out/generation_config.json")) << "not a tokenizer file: not the export's to remove";
  std::ifstream a(dir + "/spm.model", std::ios::binary), b(dir + "/out/tokenizer.model", std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(a), {}), std::string(std::istreambuf_iterator<char>(b), {}));
  const auto tok = loom::text::load_tokenizer(dir + "/spm.model");
  const nlohmann::json cfg = nlohmann::json::parse(std::ifstream(dir + "/out/tokenizer_config.json"));
  EXPECT_EQ(cfg["tokenizer_class"], "LlamaTokenizer");
  EXPECT_EQ(cfg["eos_token"], tok->piece(tok->eod()));
  EXPECT_EQ(cfg["add_bos_token"], false);
  const nlohmann::json model = nlohmann::json::parse(std::ifstream(dir + "/out/config.json"));
  EXPECT_EQ(model["eos_token_id"], tok->eod());
  EXPECT_EQ(model["bos_token_id"], tok->bos());
  EXPECT_TRUE(fs::exists(dir + "/out/special_tokens_map.json"));
  // Exported again without a tokenizer: the files are kept, and named.
  EXPECT_EQ(loom::interop::export_hf(step, dir + "/out", loom::plugins::registry()).kept,
            (std::vector<std::string>{"tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"}));
  // A Hugging Face tokenizer.json goes as it is (PreTrainedTokenizerFast), the
  // SentencePiece files of the export before removed; its eos from tokenizer_config.json.
  fs::create_directories(dir + "/fast");
  // Its post-processor (here one that would prepend <|end|>) is dropped: loom adds no token.
  nlohmann::json fast_json = {
      {"model", {{"type", "BPE"}, {"vocab", loom::testing::byte_level_vocab()}, {"merges", nlohmann::json::array()}}},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"use_regex", true}}},
      {"post_processor", {{"type", "TemplateProcessing"}, {"single", {{{"SpecialToken", {{"id", "<|end|>"}}}}}}}},
      {"added_tokens", {{{"id", 256}, {"content", "<|end|>"}, {"special", true}}}}};
  std::ofstream(dir + "/fast/tokenizer.json") << fast_json.dump();
  std::ofstream(dir + "/fast/tokenizer_config.json") << R"({"eos_token": "<|end|>"})";
  const loom::interop::HfModel fast = loom::interop::export_hf(step, dir + "/out", loom::plugins::registry(), dir + "/fast");
  EXPECT_EQ(fast.files, (std::vector<std::string>{"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}));
  EXPECT_EQ(fast.removed, (std::vector<std::string>{"tokenizer.model"}));
  fast_json["post_processor"] = nullptr;
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(dir + "/out/tokenizer.json")), fast_json);
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(dir + "/out/tokenizer_config.json"))["tokenizer_class"],
            "PreTrainedTokenizerFast");
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(dir + "/out/config.json"))["eos_token_id"], 256);
  EXPECT_EQ(loom::text::load_tokenizer(dir + "/out")->encode("hi<|end|>"), (std::vector<int32_t>{'h', 'i', 256}));

  const std::string small = parallel_checkpoint({}, dir + "/ck13");  // vocabulary 13
  try {
    loom::interop::export_hf(small, dir + "/out13", loom::plugins::registry(), dir + "/spm.model");
    ADD_FAILURE() << "a tokenizer larger than the model was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("more than the model's vocabulary of 13"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir + "/out13/model.safetensors"));
  fs::remove_all(dir);
}

// A model saved in shards (save_pretrained above max_shard_size: the index's
// weight_map, model-0000i-of-0000N.safetensors) reads back as the one file did, bit for
// bit; an index that does not describe its shards is refused naming the tensor.
TEST(HfImport, AModelInShardsReadsAsOneFile) {
  const std::vector<std::string> model = qwen3_moe(false);
  const std::string dir = scratch("shards"), out = scratch("shards-out");
  const std::string step = parallel_checkpoint(model, dir);
  loom::interop::export_hf(step, out, loom::plugins::registry());
  const auto plan = loom::testing::plan_from(loom::testing::tiny_manifest(), serial(model));
  const loom::train::InitialWeights whole = loom::interop::read_hf(out, plan, 13);
  // Three shards of the file's tensors, in turn, and the index naming each one's.
  std::vector<loom::interop::NamedTensor> tensors = loom::interop::read_safetensors(out + "/model.safetensors").tensors;
  std::vector<std::vector<loom::interop::NamedTensor>> shards(3);
  nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json::object()}};
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string file = "model-0000" + std::to_string(i % 3 + 1) + "-of-00003.safetensors";
    index["weight_map"][tensors[i].name] = file;
    shards[i % 3].push_back(tensors[i]);
  }
  for (size_t k = 0; k < 3; ++k)
    loom::interop::write_safetensors(out + "/model-0000" + std::to_string(k + 1) + "-of-00003.safetensors", shards[k]);
  fs::remove(out + "/model.safetensors");
  std::ofstream(out + "/model.safetensors.index.json") << index.dump();
  const loom::train::InitialWeights sharded = loom::interop::read_hf(out, plan, 13);
  ASSERT_EQ(sharded.tensors.size(), whole.tensors.size());
  for (size_t i = 0; i < whole.tensors.size(); ++i) {
    EXPECT_EQ(sharded.tensors[i].name, whole.tensors[i].name);
    EXPECT_EQ(sharded.tensors[i].data, whole.tensors[i].data) << whole.tensors[i].name;
  }
  EXPECT_EQ(losses_from(serial(model), out, 1), losses_from(serial(model), step, 1));
  const auto refusal = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json e = index;
    edit(e);
    std::ofstream(out + "/model.safetensors.index.json") << e.dump();
    try {
      loom::interop::read_hf(out, plan, 13);
    } catch (const std::exception& ex) {
      return std::string(ex.what());
    }
    return std::string("(read)");
  };
  const std::string first = tensors[0].name;
  EXPECT_NE(refusal([&](nlohmann::json& e) { e["weight_map"][first] = "model-00002-of-00003.safetensors"; })
                .find("model-00001-of-00003.safetensors holds " + first + ", which " + out +
                      "/model.safetensors.index.json puts in model-00002-of-00003.safetensors"),
            std::string::npos);
  EXPECT_NE(refusal([&](nlohmann::json& e) { e["weight_map"]["extra.weight"] = "model-00001-of-00003.safetensors"; })
                .find("puts extra.weight in model-00001-of-00003.safetensors, which does not hold it"),
            std::string::npos);
  EXPECT_NE(refusal([&](nlohmann::json& e) { e["weight_map"].erase(first); })
                .find("holds " + first + ", which " + out + "/model.safetensors.index.json's weight_map does not list"),
            std::string::npos);
  EXPECT_NE(refusal([&](nlohmann::json& e) { e["weight_map"][first] = "../model-00001-of-00003.safetensors"; })
                .find("is not a file name in the model's directory"),
            std::string::npos);
  EXPECT_NE(refusal([&](nlohmann::json& e) { e["weight_map"][first] = "model-00009-of-00009.safetensors"; })
                .find("cannot read " + out + "/model-00009-of-00009.safetensors"),
            std::string::npos);
  EXPECT_NE(refusal([](nlohmann::json& e) { e.erase("weight_map"); }).find("has no weight_map"), std::string::npos);
  // An export into the directory replaces the shards and their index with its one file;
  // a file the index lists that is no safetensors file stays.
  std::ofstream(out + "/notes.safetensors") << "keep";
  index["weight_map"]["notes"] = "notes.safetensors";
  std::ofstream(out + "/model.safetensors.index.json") << index.dump();
  const loom::interop::HfModel again = loom::interop::export_hf(step, out, loom::plugins::registry());
  EXPECT_EQ(again.removed, (std::vector<std::string>{"model.safetensors.index.json", "model-00001-of-00003.safetensors",
                                                     "model-00002-of-00003.safetensors",
                                                     "model-00003-of-00003.safetensors"}));
  EXPECT_TRUE(fs::exists(out + "/model.safetensors"));
  EXPECT_FALSE(fs::exists(out + "/model-00001-of-00003.safetensors"));
  EXPECT_TRUE(fs::exists(out + "/notes.safetensors"));
  // Without weights: what a model directory needs.
  fs::remove(out + "/model.safetensors");
  try {
    loom::interop::read_hf(out, plan, 13);
    ADD_FAILURE() << "a directory without weights was read";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("has neither model.safetensors nor model.safetensors.index.json"),
              std::string::npos) << e.what();
  }
  // Inside a checkpoint's step (which checkpoint.keep_last may delete) an export is refused.
  try {
    loom::interop::export_hf(step, step + "/hf", loom::plugins::registry());
    ADD_FAILURE() << "an export inside a checkpoint step";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("is inside the checkpoint"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(step + "/hf"));
  fs::remove_all(dir);
  fs::remove_all(out);
}

// An export above the largest shard writes shards and their index as save_pretrained
// does (greedy in tensor order, none above the size unless one tensor is), which read
// back as the one-file export does; the earlier export's model.safetensors goes.
TEST(HfExport, AModelAboveTheShardSizeIsWrittenInShards) {
  const std::vector<std::string> model = qwen3_moe(false);
  const std::string dir = scratch("exp-shards"), out = scratch("exp-shards-out");
  const std::string step = parallel_checkpoint(model, dir);
  const auto plan = loom::testing::plan_from(loom::testing::tiny_manifest(), serial(model));
  loom::interop::export_hf(step, out, loom::plugins::registry());
  const loom::train::InitialWeights whole = loom::interop::read_hf(out, plan, 13);
  const loom::interop::HfModel hf = loom::interop::export_hf(step, out, loom::plugins::registry(), "", 8192);
  EXPECT_EQ(hf.removed, (std::vector<std::string>{"model.safetensors"}));
  EXPECT_FALSE(fs::exists(out + "/model.safetensors"));
  const nlohmann::json index = nlohmann::json::parse(std::ifstream(out + "/model.safetensors.index.json"));
  std::set<std::string> files;
  uint64_t total = 0;
  for (const auto& [name, file] : index["weight_map"].items()) files.insert(file.get<std::string>());
  for (const loom::interop::NamedTensor& t : hf.tensors) total += t.data.size();
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);
  EXPECT_EQ(index["weight_map"].size(), hf.tensors.size());
  ASSERT_GT(files.size(), 2u);
  const std::string n = std::to_string(files.size());
  EXPECT_TRUE(files.count("model-00001-of-" + std::string(5 - n.size(), '0') + n + ".safetensors"));
  for (const std::string& f : files) {
    uint64_t bytes = 0;
    const auto shard = loom::interop::read_safetensors(out + "/" + f).tensors;
    for (const auto& t : shard) bytes += t.data.size();
    EXPECT_TRUE(bytes <= 8192 || shard.size() == 1) << f << " holds " << bytes << " bytes";
  }
  const loom::train::InitialWeights sharded = loom::interop::read_hf(out, plan, 13);
  ASSERT_EQ(sharded.tensors.size(), whole.tensors.size());
  for (size_t i = 0; i < whole.tensors.size(); ++i)
    EXPECT_EQ(sharded.tensors[i].data, whole.tensors[i].data) << whole.tensors[i].name;
  // Fewer, larger shards the next time: the ones beyond the new count go.
  const loom::interop::HfModel fewer = loom::interop::export_hf(step, out, loom::plugins::registry(), "", 1 << 20);
  EXPECT_EQ(fewer.removed.size(), files.size() + 1) << "the earlier index and shards";
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(out)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"config.json", "model.safetensors"}));
  fs::remove_all(dir);
  fs::remove_all(out);
}

// ---- the manifest of a Hugging Face model (loom import --write-manifest) ----------

// The [model] sections manifest_for_hf writes for the model in `hf_dir`, as overrides
// of the tiny manifest (its run, batch, data and optimizer kept).
std::vector<std::string> written_model(const std::string& hf_dir) {
  const std::string text = loom::interop::manifest_for_hf(hf_dir, 16);
  const toml::table t = toml::parse(text);
  std::vector<std::string> out;
  std::function<void(const toml::table&, const std::string&)> walk = [&](const toml::table& tab,
                                                                        const std::string& prefix) {
    for (const auto& [k, v] : tab) {
      const std::string key = prefix + std::string(k.str());
      if (v.is_table()) walk(*v.as_table(), key + ".");
      else out.push_back(key + "=" + loom::manifest::to_toml_text(v));
    }
  };
  walk(*t["model"].as_table(), "model.");
  EXPECT_NE(text.find("[data]\n"), std::string::npos);
  return out;
}

// An export of `model` (trained at tp 2 x pp 2 x dp 2), read back through the manifest
// written from its config.json alone: the first step's loss is the original model's,
// bit for bit (the same serial computation).
void check_written_manifest(const std::vector<std::string>& model, const std::string& architecture) {
  SCOPED_TRACE(architecture);
  const std::string dir = scratch("wm"), out = scratch("wm-out");
  loom::interop::export_hf(parallel_checkpoint(model, dir), out, loom::plugins::registry());
  const std::vector<std::string> written = written_model(out);
  const double want = losses_from(serial(model), out, 1).at(0), got = losses_from(written, out, 1).at(0);
  EXPECT_EQ(got, want) << "the written manifest computes another model";
  std::string listed;
  for (const std::string& w : written) listed += w + "\n";
  SCOPED_TRACE(listed);
  fs::remove_all(dir);
  fs::remove_all(out);
}

TEST(HfImport, AWrittenManifestComputesTheModelItsConfigDescribes) {
  check_written_manifest({}, "GPT2LMHeadModel");
  check_written_manifest(llama3_rope(), "LlamaForCausalLM");
  check_written_manifest(windowed(llama()), "MistralForCausalLM");
  check_written_manifest(mixtral(), "MixtralForCausalLM");
  check_written_manifest(qwen2_yarn(), "Qwen2ForCausalLM");
  check_written_manifest(windowed(qwen2()), "Qwen2ForCausalLM");  // every layer slides: max_window_layers = 0
  check_written_manifest(qwen2_moe(false), "Qwen2MoeForCausalLM");
  check_written_manifest(qwen3(), "Qwen3ForCausalLM");
  check_written_manifest(qwen3_moe_with_dense(), "Qwen3MoeForCausalLM");
  check_written_manifest(deepseek_v3_dense_first(), "DeepseekV3ForCausalLM");
  check_written_manifest(deepseek_v3_yarn(), "DeepseekV3ForCausalLM");
  check_written_manifest(deepseek_v3(/*moe=*/false, /*query_latent=*/false), "DeepseekV3ForCausalLM");
  check_written_manifest(deepseek_v2(/*groups=*/true), "DeepseekV2ForCausalLM");
}

// What the written manifest cannot say is refused naming the key; a directory name with
// a newline stays inside the manifest's comments.
TEST(HfImport, AWrittenManifestRefusesWhatLoomDoesNotMap) {
  const std::string dir = scratch("wm-bad");
  const nlohmann::json llama = {{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}, {"hidden_size", 32},
                                {"num_attention_heads", 4}, {"num_hidden_layers", 2}, {"intermediate_size", 48},
                                {"vocab_size", 13}, {"max_position_embeddings", 64}};
  const auto refusal = [&](const nlohmann::json& config, const std::string& sub = "c") {
    fs::create_directories(dir + "/" + sub);
    std::ofstream(dir + "/" + sub + "/config.json") << config.dump();
    try {
      return loom::interop::manifest_for_hf(dir + "/" + sub);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
  };
  const auto edited = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json c = llama;
    edit(c);
    return refusal(c);
  };
  EXPECT_NE(refusal(llama).find("[model.layer.attention]"), std::string::npos);
  EXPECT_NE(edited([](nlohmann::json& c) { c["model_type"] = "gemma"; }).find("model_type = \"gemma\" is not one loom maps"),
            std::string::npos);
  EXPECT_NE(edited([](nlohmann::json& c) { c["model_type"] = 5; }).find("model_type = 5 is not one loom maps"),
            std::string::npos);
  EXPECT_NE(edited([](nlohmann::json& c) { c["architectures"] = {"MistralForCausalLM"}; })
                .find("but model_type \"llama\" is LlamaForCausalLM's"),
            std::string::npos);
  EXPECT_NE(edited([](nlohmann::json& c) { c["head_dim"] = 16; }).find("head_dim = 16, not hidden_size / num_attention_heads = 8"),
            std::string::npos);
  EXPECT_NE(edited([](nlohmann::json& c) { c["rope_theta"] = 0; }).find("rope_theta = 0 is not positive"), std::string::npos);
  EXPECT_NE(edited([](nlohmann::json& c) { c["rope_scaling"] = {{"rope_type", "longrope"}}; })
                .find("(scaled rotary frequencies) has no loom counterpart"),
            std::string::npos);
  EXPECT_NE(edited([](nlohmann::json& c) { c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", -2}}; })
                .find("has no positive number factor"),
            std::string::npos);
  EXPECT_NE(edited([](nlohmann::json& c) {
              c["model_type"] = "qwen2", c["architectures"] = {"Qwen2ForCausalLM"}, c["num_key_value_heads"] = 4;
              c["use_sliding_window"] = true, c["sliding_window"] = 8, c["max_window_layers"] = 1;
            }).find("1 of the 2 layers slide a window"),
            std::string::npos);
  EXPECT_NE(edited([](nlohmann::json& c) {
              c["model_type"] = "deepseek_v2", c["architectures"] = {"DeepseekV2ForCausalLM"};
              c["num_experts_per_tok"] = 2, c["topk_method"] = "noaux_tc";
            }).find("topk_method = \"noaux_tc\" is not greedy or group_limited_greedy"),
            std::string::npos);
  EXPECT_NE(edited([](nlohmann::json& c) {
              c["model_type"] = "deepseek_v3", c["architectures"] = {"DeepseekV3ForCausalLM"};
              c["first_k_dense_replace"] = "1";
            }).find("first_k_dense_replace = \"1\" is not a count"),
            std::string::npos);
  const std::string odd = "nl\n[run]\nsteps = 7";
  const toml::table parsed = toml::parse(refusal(llama, odd));
  EXPECT_EQ(parsed["run"]["steps"].value_or(int64_t{0}), 1000) << "the directory's name made a section";
  fs::remove_all(dir);
}

// ---- safetensors ------------------------------------------------------------------

std::vector<char> file_with_header(const std::string& header, size_t data_bytes) {
  std::vector<char> bytes(8);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(n >> (8 * i));
  bytes.insert(bytes.end(), header.begin(), header.end());
  bytes.resize(bytes.size() + data_bytes, 0);
  return bytes;
}

TEST(Safetensors, WriteThenReadIsExact) {
  const std::string dir = scratch("st");
  std::vector<loom::interop::NamedTensor> in = {{"b", "F32", {2, 3}, std::vector<char>(24, 7)},
                                                {"a", "BF16", {5}, std::vector<char>(10, 3)}};
  loom::interop::write_safetensors(dir + "/x.safetensors", in, {{"format", "pt"}});
  const auto f = loom::interop::read_safetensors(dir + "/x.safetensors");
  ASSERT_EQ(f.tensors.size(), 2u);
  EXPECT_EQ(f.tensors[0].name, "b");  // data order is write order
  EXPECT_EQ(f.tensors[0].data, in[0].data);
  EXPECT_EQ(f.tensors[1].shape, in[1].shape);
  EXPECT_EQ(f.metadata.at("format"), "pt");
  // Read from the file (tensor by tensor) as from its bytes; a file cut short is refused
  // by its header's offsets, not read past its end.
  std::ifstream whole(dir + "/x.safetensors", std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(whole)), std::istreambuf_iterator<char>());
  const auto parsed = loom::interop::parse_safetensors(bytes, "x");
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(parsed.tensors[i].data, f.tensors[i].data);
  fs::resize_file(dir + "/x.safetensors", bytes.size() - 1);
  try {
    loom::interop::read_safetensors(dir + "/x.safetensors");
    ADD_FAILURE() << "a file cut short was read";
  } catch (const loom::interop::SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("lie outside the 33 bytes of data"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(Safetensors, MalformedHeadersAreRefusedNamingTheProblem) {
  const std::vector<std::pair<std::vector<char>, std::string>> cases = {
      {{'\x05', 0, 0}, "shorter than the 8-byte header length"},
      {file_with_header("{", 0), "not JSON"},
      {file_with_header(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", 8), "lie outside"},
      {file_with_header(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "shape x dtype"},
      {file_with_header(R"({"w":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", 8), "unknown dtype Q4"},
      {file_with_header(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8), "non-negative"},
      {file_with_header(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                        R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                        12),
       "overlaps"},
      {file_with_header(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8), "belong to no tensor"},
      {file_with_header(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8), "belong to no tensor"},
      {file_with_header(R"({"a":{"dtype":"F32","shape":[1]}})", 4), "needs dtype, shape and data_offsets"},
      {file_with_header(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                        R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                        8),
       "the header names a twice"},
      {file_with_header(std::string(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})") + '\0', 4),
       "NUL bytes"},
  };
  for (const auto& [bytes, why] : cases) {
    try {
      loom::interop::parse_safetensors(bytes, "case");
      ADD_FAILURE() << "accepted; expected: " << why;
    } catch (const loom::interop::SafetensorsError& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  }
  // A header length beyond the file.
  std::vector<char> huge = file_with_header("{}", 0);
  huge[3] = 1;
  EXPECT_THROW(loom::interop::parse_safetensors(huge, "huge"), loom::interop::SafetensorsError);
  // A directory, and a model saved in shards, are named as such.
  const std::string dir = scratch("st-files");
  fs::create_directories(dir + "/model.safetensors");
  try {
    loom::interop::read_safetensors(dir + "/model.safetensors");
    ADD_FAILURE() << "a directory was read";
  } catch (const loom::interop::SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("not a regular file"), std::string::npos) << e.what();
  }
  fs::remove_all(dir + "/model.safetensors");
  std::ofstream(dir + "/model.safetensors.index.json") << "{}";
  try {
    loom::interop::read_safetensors(dir + "/model.safetensors");
    ADD_FAILURE() << "a sharded model was read as one file";
  } catch (const loom::interop::SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("is split into shards"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

}  // namespace
