// layer/attention's scaled rotary embeddings (rope_scaling): each rotated pair's
// frequency, worked out once at create in double and handed to the device's rotary op
// (ABI 1.20 inv_freq), and what the scaling does to the attention scores.
//
//   "llama3" (Llama 3.1; transformers' rope_type "llama3"): wavelengths shorter than
//     original / high_freq_factor keep their frequency, longer than original /
//     low_freq_factor are slowed by `factor`, those between blend the two.
//   "yarn" (Peng et al., "YaRN: Efficient Context Window Extension of Large Language
//     Models", 2023; transformers' rope_type "yarn", Megatron-Core's
//     YarnRotaryEmbedding; DeepSeek-V2/V3, Qwen's long-context settings): pair i's
//     frequency ramps from theta's (pairs turning more than beta_fast times over the
//     original context) to theta's / factor (fewer than beta_slow times), linearly
//     between the two correction dimensions, floored and ceiled. cos and sin are
//     multiplied by the attention factor mscale(factor, rope_mscale) /
//     mscale(factor, rope_mscale_all_dim), mscale(s, m) = 0.1 m ln s + 1 (1 for s <= 1),
//     unless rope_attention_factor gives it. Multi-latent attention (DeepSeek's, and
//     Megatron-Core's MLA) also scales its softmax by mscale(factor, rope_mscale_all_dim)^2.
//
// Scaling cos and sin by a scales each rotated q and k element by a, so a score over
// heads whose every element rotates is a^2 times the unscaled one: the layer folds a^2
// into the softmax scale (the same numbers, no extra pass; the generation cache keeps the
// unscaled keys). Where only part of a head rotates (rotary_percent < 1, or multi-latent
// attention's decoupled part) an attention factor other than 1 would weigh the two parts
// differently, which the softmax scale cannot say: refused.
#pragma once

#include <loom/layers/layer_math.hpp>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace rope_scaling {

struct Scaling {
  std::vector<float> inv_freq;  // [rotary_dim / 2]; empty: theta's frequencies, unscaled
  double softmax_factor = 1.0;  // multiplies the softmax scale 1 / sqrt(qk head size)
};

constexpr double kPi = 3.14159265358979323846;

// theta^(-2i / dim): pair i's unscaled frequency.
inline double base_frequency(double theta, int64_t i, int64_t dim) {
  return std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(dim));
}

inline std::vector<float> llama3_frequencies(const loom::Options& o, double theta, int64_t dim,
                                             const std::string& name) {
  const double factor = o.declared_float("rope_scaling_factor");
  const double low = o.declared_float("rope_low_freq_factor"), high = o.declared_float("rope_high_freq_factor");
  const double original = static_cast<double>(o.declared_int("rope_original_max_position"));
  LOOM_REQUIRE(high > low, name << ": rope_high_freq_factor (" << high << ") must be above rope_low_freq_factor ("
                                << low << ")");
  std::vector<float> f(static_cast<size_t>(dim / 2));
  for (size_t i = 0; i < f.size(); ++i) {
    const double base = base_frequency(theta, static_cast<int64_t>(i), dim);
    const double wavelength = 2.0 * kPi / base;
    double scaled = base;
    if (wavelength > original / low) {
      scaled = base / factor;
    } else if (wavelength >= original / high) {
      const double smooth = (original / wavelength - low) / (high - low);
      scaled = (1.0 - smooth) * base / factor + smooth * base;
    }
    f[i] = static_cast<float>(scaled);
  }
  return f;
}

// YaRN's mscale(s, m): how much a context `s` times longer sharpens the attention.
inline double yarn_mscale(double s, double m) { return s <= 1.0 ? 1.0 : 0.1 * m * std::log(s) + 1.0; }

// The factor on cos and sin (rope_attention_factor when set, else mscale's ratio).
inline double yarn_attention_factor(const loom::Options& o) {
  const double given = o.declared_float("rope_attention_factor");
  if (given > 0.0) return given;
  const double s = o.declared_float("rope_scaling_factor");
  return yarn_mscale(s, o.declared_float("rope_mscale")) / yarn_mscale(s, o.declared_float("rope_mscale_all_dim"));
}

inline std::vector<float> yarn_frequencies(const loom::Options& o, double theta, int64_t dim, const std::string& name) {
  const double factor = o.declared_float("rope_scaling_factor");
  const double fast = o.declared_float("rope_beta_fast"), slow = o.declared_float("rope_beta_slow");
  const double original = static_cast<double>(o.declared_int("rope_original_max_position"));
  LOOM_REQUIRE(fast > slow, name << ": rope_beta_fast (" << fast << ") must be above rope_beta_slow (" << slow
                                 << "): pairs turning more often than beta_fast keep their frequency");
  // The pair index whose frequency turns `rotations` times over the original context.
  const auto correction = [&](double rotations) {
    return static_cast<double>(dim) * std::log(original / (rotations * 2.0 * kPi)) / (2.0 * std::log(theta));
  };
  const double low = std::max(std::floor(correction(fast)), 0.0);
  double high = std::min(std::ceil(correction(slow)), static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // as transformers: a ramp of one step
  std::vector<float> f(static_cast<size_t>(dim / 2));
  for (size_t i = 0; i < f.size(); ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);  // 1: interpolated
    const double base = base_frequency(theta, static_cast<int64_t>(i), dim);
    f[i] = static_cast<float>(base / factor * ramp + base * (1.0 - ramp));
  }
  return f;
}

// The layer's scaling. rotary_dim: the rotated elements of a q/k head of qk_dim;
// latent: multi-latent attention (its rotated part is decoupled from the rest).
inline Scaling scaling_of(const loom::Options& o, double theta, int64_t rotary_dim, int64_t qk_dim, bool latent,
                          const std::string& name) {
  const std::string kind = o.declared_string("rope_scaling");
  Scaling s;
  if (kind == "llama3") s.inv_freq = llama3_frequencies(o, theta, rotary_dim, name);
  if (kind != "yarn") return s;
  s.inv_freq = yarn_frequencies(o, theta, rotary_dim, name);
  const double a = yarn_attention_factor(o);
  if (a != 1.0)
    LOOM_REQUIRE(!latent && rotary_dim == qk_dim,
                 name << ": rope_scaling = \"yarn\" multiplies cos and sin by an attention factor of " << a
                      << ", which loom folds into the softmax scale, and "
                      << (latent ? std::string("multi-latent attention rotates only qk_pos_emb_head_dim of each head's ")
                                 : "only " + std::to_string(rotary_dim) + " of each head's ")
                      << qk_dim << " q/k elements, which no softmax scale can weigh apart (DeepSeek's configs "
                      << "give rope_mscale = rope_mscale_all_dim, a factor of 1)");
  s.softmax_factor = a * a;
  if (latent) {
    const double m = yarn_mscale(o.declared_float("rope_scaling_factor"), o.declared_float("rope_mscale_all_dim"));
    s.softmax_factor *= m * m;
  }
  // Scores scaled past this overflow fp32 softmax inputs (and no real model comes near).
  LOOM_REQUIRE(std::isfinite(s.softmax_factor) && s.softmax_factor > 0.0 && s.softmax_factor <= 1e4,
               name << ": rope_scaling = \"yarn\" scales the attention scores by " << s.softmax_factor
                    << " (the attention factor" << (latent ? " and mscale(rope_mscale_all_dim)" : "")
                    << " squared), outside (0, 1e4]: check rope_scaling_factor, rope_mscale, rope_mscale_all_dim and "
                    << "rope_attention_factor");
  for (const float f : s.inv_freq)
    LOOM_REQUIRE(std::isfinite(f) && f > 0.0f, name << ": rope_scaling = \"yarn\" gives a rotation frequency of " << f
                                                   << ": check rope_scaling_factor");
  return s;
}

}  // namespace rope_scaling
