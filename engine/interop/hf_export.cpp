#include "engine/interop/hf_export.hpp"

#include "engine/train/run_plan.hpp"

#include <boost/filesystem.hpp>

#include <cstring>
#include <fstream>
#include <stdexcept>

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

// What the blocks are, from the layer options (defaults as the plugins declare them).
struct Shape {
  bool gpt2 = false, llama = false;
  int64_t groups = 0;
  double theta = 10000.0, eps = 1e-5;
};

Shape shape_of(const train::RunPlan& plan) {
  const manifest::RunConfig& c = plan.config;
  const std::vector<model::LayerSpec>& L = plan.layers;
  std::string layers;
  for (const auto& s : L) layers += (layers.empty() ? "" : ", ") + s.plugin;
  bool blocks_ok = L.size() >= 4 && L.front().plugin == "embedding" && L.back().plugin == "lm_head" &&
                   (L.size() - 2) % 2 == 0;
  for (size_t i = 1; blocks_ok && i + 1 < L.size(); ++i)
    blocks_ok = L[i].plugin == ((i % 2 == 1) ? "attention" : "mlp");
  if (!blocks_ok)
    throw std::runtime_error("only models of embedding, blocks of attention + mlp, and lm_head have a Hugging Face "
                             "counterpart here; this one's layers are: " + layers);
  const toml::table &emb = c.model.layer_section(L[0].config), &att = c.model.layer_section(L[1].config),
                    &mlp = c.model.layer_section(L[2].config), &head = c.model.layer_section(L.back().config);
  Shape s;
  const bool rope = option_string(att, "position_embedding", "learned_absolute") == "rope";
  const bool rms = option_string(att, "norm", "layernorm") == "rmsnorm";
  const bool att_bias = att["bias"].value_or(true), mlp_bias = mlp["bias"].value_or(true);
  const bool swiglu = option_string(mlp, "activation", "gelu") == "swiglu";
  const bool mlp_rms = option_string(mlp, "norm", "layernorm") == "rmsnorm";
  const bool head_rms = option_string(head, "norm", "layernorm") == "rmsnorm";
  const bool emb_rope = option_string(emb, "position_embedding", "learned_absolute") == "rope";
  s.groups = att["num_query_groups"].value_or(int64_t{0});
  s.theta = att["rotary_base"].value_or(10000.0);
  s.eps = att["norm_epsilon"].value_or(1e-5);
  if (!rope && !rms && att_bias && mlp_bias && !swiglu && !mlp_rms && !head_rms && !emb_rope &&
      (s.groups == 0 || s.groups == c.model.num_heads))
    s.gpt2 = true;
  else if (rope && emb_rope && rms && mlp_rms && head_rms && swiglu && !att_bias && !mlp_bias)
    s.llama = true;
  else
    throw std::runtime_error(
        "the blocks are neither GPT-2's (layernorm, gelu, biases, learned positions) nor Llama's (rmsnorm, swiglu, "
        "bias = false, rope in the embedding and attention): no Hugging Face architecture matches them");
  if (s.llama && att["rotary_percent"].value_or(1.0) != 1.0)
    throw std::runtime_error("rotary_percent < 1 (partial rotary embeddings) has no LlamaForCausalLM counterpart");
  return s;
}

}  // namespace

HfModel to_hf(const train::WholeCheckpoint& ck, plugins::Registry& registry) {
  const train::RunPlan plan =
      train::make_plan(manifest::Manifest::parse(ck.manifest_toml, "the checkpoint's manifest.toml"), registry);
  const manifest::RunConfig& c = plan.config;
  const Shape s = shape_of(plan);
  const int64_t C = c.model.hidden_size, H = c.model.num_heads, F = c.model.ffn_hidden_size, V = ck.vocab;
  const int64_t Lyr = c.model.num_layers, D = C / H, T = c.model.seq_length;
  const bool tied = c.model.tie_embeddings;
  Builder b(ck);
  HfModel hf;
  const std::string torch_dtype = ck.meta.param_dtype == "bf16" ? "bfloat16" : "float32";
  if (s.gpt2) {
    hf.architecture = "GPT2LMHeadModel";
    b.vocab_rows("transformer.wte.weight", "embedding.word.weight", V);
    b.as_is("transformer.wpe.weight", "embedding.pos.weight");
    for (int64_t i = 0; i < Lyr; ++i) {
      const std::string at = "blocks." + std::to_string(i) + ".attention.", ml = "blocks." + std::to_string(i) + ".mlp.";
      const std::string h = "transformer.h." + std::to_string(i) + ".";
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
    b.as_is("transformer.ln_f.weight", "lm_head.ln.weight");
    b.as_is("transformer.ln_f.bias", "lm_head.ln.bias");
    if (!tied) b.vocab_rows("lm_head.weight", "lm_head.word.weight", V);
    hf.config = {{"architectures", {hf.architecture}}, {"model_type", "gpt2"}, {"vocab_size", V},
                 {"n_positions", T}, {"n_embd", C}, {"n_layer", Lyr}, {"n_head", H},
                 {"n_inner", F}, {"activation_function", "gelu_new"}, {"layer_norm_epsilon", s.eps},
                 {"resid_pdrop", 0.0}, {"embd_pdrop", 0.0}, {"attn_pdrop", 0.0},
                 {"tie_word_embeddings", tied}, {"torch_dtype", torch_dtype}};
  } else {
    hf.architecture = "LlamaForCausalLM";
    const int64_t G = s.groups > 0 ? s.groups : H, hg = H / G;
    b.vocab_rows("model.embed_tokens.weight", "embedding.word.weight", V);
    for (int64_t i = 0; i < Lyr; ++i) {
      const std::string at = "blocks." + std::to_string(i) + ".attention.", ml = "blocks." + std::to_string(i) + ".mlp.";
      const std::string h = "model.layers." + std::to_string(i) + ".";
      b.as_is(h + "input_layernorm.weight", at + "ln.weight");
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
      b.as_is(h + "post_attention_layernorm.weight", ml + "ln.weight");
      const Matrix fc1 = matrix_of(b.get(ml + "fc1.weight"));  // [C, 2F]: [gate | up]
      b.matrix(h + "mlp.gate_proj.weight", transposed(columns(fc1, 0, F)));
      b.matrix(h + "mlp.up_proj.weight", transposed(columns(fc1, F, F)));
      b.matrix(h + "mlp.down_proj.weight", transposed(matrix_of(b.get(ml + "fc2.weight"))));
    }
    b.as_is("model.norm.weight", "lm_head.ln.weight");
    if (!tied) b.vocab_rows("lm_head.weight", "lm_head.word.weight", V);
    hf.config = {{"architectures", {hf.architecture}}, {"model_type", "llama"}, {"vocab_size", V},
                 {"hidden_size", C}, {"intermediate_size", F}, {"num_hidden_layers", Lyr},
                 {"num_attention_heads", H}, {"num_key_value_heads", G}, {"head_dim", D},
                 {"hidden_act", "silu"}, {"max_position_embeddings", T}, {"rms_norm_eps", s.eps},
                 {"rope_theta", s.theta}, {"attention_bias", false}, {"mlp_bias", false},
                 {"tie_word_embeddings", tied}, {"torch_dtype", torch_dtype}};
  }
  hf.tensors = b.take();
  return hf;
}

HfModel export_hf(const std::string& step_dir, const std::string& out_dir, plugins::Registry& registry) {
  const train::WholeCheckpoint ck = train::gather_checkpoint(step_dir, registry);
  HfModel hf = to_hf(ck, registry);
  boost::filesystem::create_directories(out_dir);
  write_safetensors((boost::filesystem::path(out_dir) / "model.safetensors").string(), hf.tensors,
                    {{"format", "pt"}, {"loom_checkpoint", step_dir}});
  const std::string config = (boost::filesystem::path(out_dir) / "config.json").string();
  std::ofstream out(config + ".tmp");
  out << hf.config.dump(2) << "\n";
  out.close();
  if (!out) throw std::runtime_error("cannot write " + config);
  boost::filesystem::rename(config + ".tmp", config);
  return hf;
}

}  // namespace loom::interop
