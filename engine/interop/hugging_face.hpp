// loom models as Hugging Face transformers models and back. `loom export CHECKPOINT
// --format hf OUTDIR` writes model.safetensors and config.json that transformers' GPT2LMHeadModel
// (blocks of layer/attention + layer/mlp with LayerNorm, GeLU, biases and learned
// positions: GPT-2) or LlamaForCausalLM (RMSNorm, SwiGLU, no biases, rotary embeddings,
// grouped-query attention: Llama) or MixtralForCausalLM (the same with blocks of
// attention + layer/moe: top-k SwiGLU experts, dropless) or, with the attention's
// qk_norm, Qwen3ForCausalLM and Qwen3MoeForCausalLM (q_norm, k_norm; Qwen3-MoE's
// experts under mlp.experts.j.{gate,up,down}_proj) loads, from any parallel layout (the shards are
// gathered by engine/train/gather.hpp); checkpoint.init_weights = "DIR" starts a run of
// the same architecture from such a directory (read_hf, the same mapping backwards).
//
// Names and layouts (transformers' modeling_gpt2.py and modeling_llama.py):
//   GPT-2  transformer.wte.weight [V, C] (the padded vocabulary's rows dropped),
//          transformer.wpe.weight [T, C], transformer.h.i.{ln_1, attn.c_attn, attn.c_proj,
//          ln_2, mlp.c_fc, mlp.c_proj}, transformer.ln_f; Conv1D weights are [in, out],
//          loom's own layout, and c_attn's columns are [q | k | v], loom's qkv.weight;
//          lm_head.weight only when the embeddings are not tied.
//   Llama  model.embed_tokens.weight [V, C], model.layers.i.{input_layernorm,
//          self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj},
//          model.norm.weight, lm_head.weight when untied; nn.Linear weights are [out, in]
//          (loom's transposed); q/k/v are cut out of loom's grouped QKV columns (per
//          query group: its query heads, then its key and value head, Megatron-LM's layout)
//          and gate/up out of fc1's [gate | up].
//   Mixtral as Llama, the MLP replaced by model.layers.i.block_sparse_moe.{gate [E, C],
//          experts.j.{w1, w3, w2}}: loom's router.weight transposed, expert j's fc1
//          [gate | up] and fc2 cut out of experts.fc1/fc2.weight [E, ...] and transposed;
//          the routing (softmax over the chosen logits = the top-k probabilities
//          renormalised) is the same. loom's rotary embedding rotates halves
//          (Megatron-LM's and transformers' convention), so q and k need no permutation.
//   Qwen3  as Llama, with self_attn.{q,k}_norm.weight [head_dim] (loom's q_norm, k_norm:
//          each head's q and k RMSNorm-ed before the rotation, modeling_qwen3.py);
//          Qwen3-MoE as Mixtral with them, the experts named mlp.gate and
//          mlp.experts.j.{gate,up,down}_proj, and norm_topk_prob = !pre_softmax.
#pragma once

#include "engine/interop/safetensors.hpp"
#include "engine/plugins/registry.hpp"
#include "engine/train/gather.hpp"
#include "engine/train/init_weights.hpp"
#include "engine/train/run_plan.hpp"

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace loom::interop {

struct HfModel {
  std::string architecture;          // "GPT2LMHeadModel", "LlamaForCausalLM", "MixtralForCausalLM", "Qwen3..."
  nlohmann::ordered_json config;     // config.json
  std::vector<NamedTensor> tensors;  // model.safetensors, in model order
  std::vector<std::string> files;    // the other files written beside config.json (tokenizer)
  std::vector<std::string> removed;  // an earlier model's files removed: tokenizer files (with a tokenizer),
                                     // weight files not written again
  std::vector<std::string> kept;     // tokenizer files left there (without one): they may not match
};

// The checkpoint's model in transformers' names and layouts; throws std::runtime_error
// naming the option that has no counterpart (e.g. rotary_percent < 1, MoE blocks).
HfModel to_hf(const train::WholeCheckpoint& ckpt, plugins::Registry& registry);

// Gathers step_dir and writes out_dir/{model.safetensors, config.json} (out_dir is
// created; existing files there are replaced), and with `tokenizer` (a loom tokenizer
// path) the files transformers' AutoTokenizer reads beside them: GPT-2 BPE as
// vocab.json + merges.txt (GPT2Tokenizer), SentencePiece as tokenizer.model
// (LlamaTokenizer), each with tokenizer_config.json and special_tokens_map.json, and the
// special token ids in config.json. Every file is complete before any replaces what is
// there. With a tokenizer the export owns out_dir's tokenizer files: those it did not
// write (an earlier export's other kind, a tokenizer.json AutoTokenizer would prefer)
// are removed (hf.removed); without one they are left and named (hf.kept). Returns what
// it wrote (hf.files: the tokenizer files' names). Weights above `max_shard_bytes` go in
// shards as save_pretrained writes them (model-0000i-of-0000N.safetensors, each at most
// that size unless one tensor is larger, and model.safetensors.index.json). The weight
// files of a model already in out_dir (model.safetensors, or an index and its shards)
// that this export does not write again go once it has written its own (hf.removed).
constexpr uint64_t kHfMaxShardBytes = 5'000'000'000;  // save_pretrained's default "5GB"
HfModel export_hf(const std::string& step_dir, const std::string& out_dir, plugins::Registry& registry,
                  const std::string& tokenizer = "", uint64_t max_shard_bytes = kHfMaxShardBytes);

// A Hugging Face model directory (config.json, model.safetensors: F32 or BF16; names with
// or without GPT-2's "transformer." prefix) as the whole tensors of `plan`'s model, in
// loom's names and layouts. Throws std::runtime_error naming what does not match the
// plan (architecture, sizes, vocabulary: model.vocab_size must be the model's).
train::InitialWeights read_hf(const std::string& dir, const train::RunPlan& plan, int64_t vocab);

// checkpoint.init_weights: a Hugging Face directory (it has config.json), else a loom
// checkpoint (a step_N directory, or a checkpoint.dir: its newest step) gathered.
// named_by: what gave the path, first in messages (default: the manifest key).
train::InitialWeights read_initial_weights(const std::string& path, const train::RunPlan& plan, int64_t vocab,
                                           plugins::Registry& registry, const std::string& named_by = "");

}  // namespace loom::interop
