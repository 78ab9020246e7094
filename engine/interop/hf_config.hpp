// Hugging Face config.json as loom reads it: transformers' defaults for the keys a
// config leaves out (by model_type), and a loom manifest of a model directory's model.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

namespace loom::interop {

// What transformers' config classes give a key config.json leaves out.
struct HfConfigDefaults {
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  int64_t kv_heads = 0;              // num_key_value_heads; 0: one per query head
  int64_t head_dim = 0;              // 0: hidden_size / num_attention_heads
  nlohmann::json sliding_window;     // where the config turns one on without a size; null: none
  bool tie_word_embeddings = false;
  // Mixture of experts (mixtral, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3); 0 where
  // the config class has no default (the key is then required).
  int64_t experts = 0;            // num_local_experts, num_experts or n_routed_experts
  int64_t experts_per_token = 0;  // num_experts_per_tok
  int64_t expert_ffn = 0;         // moe_intermediate_size
  int64_t shared_experts = 0;     // n_shared_experts (DeepSeek: experts of expert_ffn)
  int64_t shared_expert_ffn = 0;  // shared_expert_intermediate_size (Qwen2-MoE)
  int64_t expert_groups = 0;      // n_group (DeepSeek-V3)
  int64_t group_topk = 0;         // topk_group
  double routed_scaling = 1.0;    // routed_scaling_factor
  int64_t dense_ffn = 0;          // intermediate_size of DeepSeek's dense layers
};
// Throws std::runtime_error for a model_type loom does not map.
HfConfigDefaults hf_config_defaults(const std::string& model_type);

// YaRN's mscale(s, m) = 0.1 m ln s + 1 (1 for s <= 1): transformers' get_mscale,
// Megatron-Core's yarn_get_mscale.
double yarn_mscale(double scale, double m);
// A number of a rope_scaling object, `fallback` when absent, null or 0 (transformers
// reads beta_fast and beta_slow with `or`, mscale and mscale_all_dim by truth).
double rope_number(const nlohmann::json& rope_scaling, const char* key, double fallback);
// The factor transformers' _compute_yarn_parameters multiplies cos and sin by: the
// object's attention_factor, else mscale's ratio when mscale and mscale_all_dim are both
// given, else mscale(factor, 1).
double hf_yarn_attention_factor(const nlohmann::json& rope_scaling);

// The model types loom maps, with their architectures (LlamaForCausalLM, ...).
const char* hf_architecture_of(const std::string& model_type);  // nullptr: not mapped

// A manifest (TOML text) of DIR/config.json's model: [model] and its layers as loom
// computes that architecture (what `loom import DIR MANIFEST OUT` checks against the
// config again), and defaults for the rest of a fine-tuning run (one CPU rank, token
// files of the model's tokenizer) to edit. `seq_length`: the training sequence length
// (0: the model's context, at most 4096). Throws std::runtime_error naming what
// config.json holds that loom has no counterpart for.
std::string manifest_for_hf(const std::string& dir, int64_t seq_length = 0);

}  // namespace loom::interop
