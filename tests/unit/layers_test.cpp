// The built-in layer plugins (layer/embedding, layer/attention, layer/mlp,
// layer/lm_head, layer/moe) driven through their C tables on a device/cpu rank with
// a size-1 tp group, by the layer harness plugin authors get (`loom plugins test`):
// gradients against central finite differences, gradient accumulation, microbatches
// in flight, tp 2 (with and without sequence parallelism) against one rank; and
// beyond it the forwards against double-precision references, the loss, vocab padding
// and ignored targets, weight tying, causality, dropout.
#include "engine/plugins/registry.hpp"
#include "engine/runtime/rank_runtime.hpp"
#include "engine/testing/layer_harness.hpp"
#include <loom/layers/layer_math.hpp>

#include <loom/cpp/tensor_parallel.hpp>

#include <gtest/gtest.h>
#include <toml++/toml.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <tuple>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

// Small dims: hidden 16, 2 heads of 8, seq 8, micro-batch 2, vocab 37 padded to 40.
constexpr int64_t kHidden = 16, kHeads = 4, kFfn = 32, kSeq = 8, kBatch = 2;
constexpr int64_t kVocab = 37, kPadded = 40, kT = kSeq * kBatch;

loom::plugins::Registry& registry() {
  static loom::plugins::Registry r;
  static const bool loaded = [] {
    loom::plugins::host_api();
    r.load_dirs({LOOM_TEST_PLUGIN_DIR});  // a broken unrelated library only yields an error line
    return true;
  }();
  (void)loaded;
  return r;
}

loom_model_dims make_dims(bool tie = false) {
  loom_model_dims d = loom::make<loom_model_dims>();
  d.hidden = kHidden;
  d.heads = kHeads;
  d.ffn_hidden = kFfn;
  d.seq_len = kSeq;
  d.vocab = kVocab;
  d.padded_vocab = kPadded;
  d.micro_batch = kBatch;
  d.num_layers = 2;
  d.block_index = 0;
  d.tie_embeddings = tie ? 1 : 0;
  return d;
}

// A status turned into an exception (gtest reports it as a failure with the message).
void ok(loom_status s) { loom::check(s); }

// The harness's rank and layer (engine/testing/layer_harness.hpp: what `loom plugins
// test` runs) over the test binary's plugins.
using loom::harness::Batch;
using loom::harness::HarnessRank;
using loom::harness::Param;

// One rank: device/cpu with one thread and a tp group (alone by default).
class Rank : public loom::harness::HarnessRank {
 public:
  explicit Rank(int global_rank = 0, const loom_group* tp = nullptr, const loom_device_api* device_api = nullptr)
      : HarnessRank(::registry(), global_rank, tp, device_api) {}
};

class TestLayer : public loom::harness::HarnessLayer {
 public:
  TestLayer(HarnessRank& rank, const std::string& name, const loom_model_dims& dims, const toml::table* options = nullptr,
            const std::string& instance = "blocks.0.layer")
      : HarnessLayer(rank, name, dims, options, instance) {}
};

Batch make_batch(std::mt19937& rng) { return loom::harness::make_batch(make_dims(), rng); }

toml::table dropout_options(double p) {
  toml::table t;
  t.insert("dropout", p);
  return t;
}

// FD checks of every parameter and (unless the embedding) of the input.
void check_gradients(Rank& rank, TestLayer& layer, std::mt19937& rng, uint64_t seed = 1234) {
  (void)rank;
  const loom::harness::Findings f = loom::harness::check_gradients(layer, rng, seed);
  EXPECT_TRUE(f.ok()) << f.text();
}

std::vector<std::string> all_layers() { return {"embedding", "attention", "mlp", "lm_head"}; }

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, static_cast<double>(std::fabs(a[i] - b[i])));
  return m;
}

// ---------------------------------------------------------------------------
// Gradients vs finite differences
// ---------------------------------------------------------------------------

TEST(Layers, EmbeddingGradientsMatchFiniteDifferences) {
  Rank rank;
  auto dims = make_dims();
  TestLayer layer(rank, "embedding", dims);
  std::mt19937 rng(1);
  layer.randomize(rng, 0.5f);
  check_gradients(rank, layer, rng);
}

TEST(Layers, AttentionGradientsMatchFiniteDifferences) {
  Rank rank;
  auto dims = make_dims();
  TestLayer layer(rank, "attention", dims);
  std::mt19937 rng(2);
  layer.randomize(rng);
  check_gradients(rank, layer, rng);

  // The k part of qkv.bias cannot change the output (softmax is invariant to one
  // vector added to every key), so its gradient is exactly zero, not rounding noise.
  Batch b = make_batch(rng);
  layer.zero_grads();
  const double l0 = layer.forward(b, 0);
  layer.backward(b, 0);
  std::vector<float>& bias = layer.param("qkv.bias").value;
  const std::vector<float>& gbias = layer.param("qkv.bias").grad;
  for (int64_t c = 0; c < 3 * kHidden; ++c) {
    if (c >= kHidden && c < 2 * kHidden) {
      EXPECT_EQ(gbias[c], 0.0f) << "k bias " << c;
    } else {
      EXPECT_NE(gbias[c], 0.0f) << "q/v bias " << c;
    }
  }
  for (int64_t c = kHidden; c < 2 * kHidden; ++c) bias[c] += 0.5f;
  EXPECT_NEAR(layer.objective(b), l0, 1e-5 * (1.0 + std::fabs(l0)));
}

TEST(Layers, MlpGradientsMatchFiniteDifferences) {
  Rank rank;
  auto dims = make_dims();
  TestLayer layer(rank, "mlp", dims);
  std::mt19937 rng(3);
  layer.randomize(rng);
  check_gradients(rank, layer, rng);
}

TEST(Layers, LmHeadGradientsMatchFiniteDifferences) {
  Rank rank;
  auto dims = make_dims();
  TestLayer layer(rank, "lm_head", dims);
  std::mt19937 rng(4);
  layer.randomize(rng, 0.5f);
  check_gradients(rank, layer, rng);
}

TEST(Layers, DropoutGradientsMatchFiniteDifferencesWithFixedSeed) {
  for (const std::string name : {"embedding", "attention", "mlp"}) {
    SCOPED_TRACE(name);
    Rank rank;
    auto dims = make_dims();
    toml::table opts = dropout_options(0.5);
    TestLayer layer(rank, name, dims, &opts);
    std::mt19937 rng(5);
    layer.randomize(rng);
    check_gradients(rank, layer, rng, /*seed=*/777);
  }
}

// ---------------------------------------------------------------------------
// Forwards against double-precision references (FD checks alone would accept a
// forward that is consistently wrong).
// ---------------------------------------------------------------------------

using Mat = std::vector<double>;  // row-major

Mat ref_layernorm(const std::vector<float>& x, const std::vector<float>& g, const std::vector<float>& b,
                  int64_t rows, int64_t cols) {
  Mat y(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0.0, var = 0.0;
    for (int64_t c = 0; c < cols; ++c) mean += x[r * cols + c];
    mean /= static_cast<double>(cols);
    for (int64_t c = 0; c < cols; ++c) var += (x[r * cols + c] - mean) * (x[r * cols + c] - mean);
    var /= static_cast<double>(cols);
    const double rstd = 1.0 / std::sqrt(var + 1e-5);
    for (int64_t c = 0; c < cols; ++c) y[r * cols + c] = (x[r * cols + c] - mean) * rstd * g[c] + b[c];
  }
  return y;
}

// y[rows, out] = x[rows, in] W[in, out] + b[out]
Mat ref_linear(const Mat& x, const std::vector<float>& w, const std::vector<float>& b, int64_t rows,
               int64_t in, int64_t out) {
  Mat y(static_cast<size_t>(rows * out));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double s = b[o];
      for (int64_t i = 0; i < in; ++i) s += x[r * in + i] * w[i * out + o];
      y[r * out + o] = s;
    }
  return y;
}

void expect_close(const std::vector<float>& got, const Mat& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], tol * (1.0 + std::fabs(want[i]))) << what << "[" << i << "]";
}

TEST(Layers, EmbeddingForwardMatchesReference) {
  Rank rank;
  auto dims = make_dims();
  TestLayer layer(rank, "embedding", dims);
  std::mt19937 rng(20);
  layer.randomize(rng);
  Batch b = make_batch(rng);
  b.tokens[5] = static_cast<int32_t>(kVocab) - 1;
  std::vector<float> y;
  layer.forward(b, 0, false, 0, &y);
  const std::vector<float>& word = layer.param("word.weight").value;
  const std::vector<float>& pos = layer.param("pos.weight").value;
  Mat want(static_cast<size_t>(kT * kHidden));
  for (int64_t s = 0; s < kSeq; ++s)
    for (int64_t bb = 0; bb < kBatch; ++bb)
      for (int64_t h = 0; h < kHidden; ++h) {
        const int64_t r = s * kBatch + bb;
        want[r * kHidden + h] = static_cast<double>(word[b.tokens[r] * kHidden + h]) + pos[s * kHidden + h];
      }
  expect_close(y, want, 1e-6, "embedding output");
}

// The attention layer against a double-precision reference; with rotary_dim > 0, q
// and k of each head rotated first (RoFormer's rotation, pairs (i, i + rotary_dim/2),
// the token at row s * B + b at position s); with groups > 0 (grouped-query attention)
// the QKV columns are Megatron's per group [its query heads | k | v] and head h reads
// group h / (heads / groups); with qk_norm, each head's q and k LayerNorm-ed over its
// dimensions (q_norm, k_norm) before the rotation; cos and sin times cos_sin_factor
// (YaRN's attention factor, as transformers applies it).
void check_attention_forward(const toml::table* opts, int64_t rotary_dim, double theta, int64_t groups = 0,
                             bool qk_norm = false, const std::vector<double>* freqs = nullptr, int64_t window = 0,
                             double cos_sin_factor = 1.0) {
  Rank rank;
  auto dims = make_dims();
  TestLayer layer(rank, "attention", dims, opts);
  std::mt19937 rng(21);
  layer.randomize(rng);
  Batch b = make_batch(rng);
  std::vector<float> y;
  layer.forward(b, 0, false, 0, &y);

  const int64_t H = kHidden, d = kHidden / kHeads, G = groups > 0 ? groups : kHeads, qpg = kHeads / G;
  const bool grouped = groups > 0 && groups < kHeads;
  const int64_t W = grouped ? G * (qpg + 2) * d : 3 * H;
  const std::vector<float> no_bias(static_cast<size_t>(W), 0.0f);
  Mat ln = ref_layernorm(b.x, layer.param("ln.weight").value, layer.param("ln.bias").value, kT, H);
  Mat qkv = ref_linear(ln, layer.param("qkv.weight").value,
                       layer.has_param("qkv.bias") ? layer.param("qkv.bias").value : no_bias, kT, H, W);
  // q, k, v of every query head: [kT, H] each.
  Mat q(static_cast<size_t>(kT * H)), k(static_cast<size_t>(kT * H)), v(static_cast<size_t>(kT * H));
  for (int64_t r = 0; r < kT; ++r)
    for (int64_t h = 0; h < kHeads; ++h)
      for (int64_t e = 0; e < d; ++e) {
        const int64_t g = h / qpg;
        const int64_t qc = grouped ? g * (qpg + 2) * d + (h % qpg) * d : h * d;
        const int64_t kc = grouped ? g * (qpg + 2) * d + qpg * d : H + h * d;
        const int64_t vc = grouped ? kc + d : 2 * H + h * d;
        q[r * H + h * d + e] = qkv[r * W + qc + e];
        k[r * H + h * d + e] = qkv[r * W + kc + e];
        v[r * H + h * d + e] = qkv[r * W + vc + e];
      }
  for (const auto& [m, name] : {std::pair<Mat*, std::string>{&q, "q_norm"}, {&k, "k_norm"}})
    for (int64_t row = 0; qk_norm && row < kT * kHeads; ++row) {
      double mean = 0, var = 0;
      for (int64_t e = 0; e < d; ++e) mean += (*m)[row * d + e] / static_cast<double>(d);
      for (int64_t e = 0; e < d; ++e) var += std::pow((*m)[row * d + e] - mean, 2) / static_cast<double>(d);
      for (int64_t e = 0; e < d; ++e)
        (*m)[row * d + e] = ((*m)[row * d + e] - mean) / std::sqrt(var + 1e-5) *
                                layer.param(name + ".weight").value[static_cast<size_t>(e)] +
                            layer.param(name + ".bias").value[static_cast<size_t>(e)];
    }
  const int64_t half = rotary_dim / 2;
  for (int64_t r = 0; r < kT && half > 0; ++r) {
    const double pos = static_cast<double>(r / kBatch);
    for (Mat* m : {&q, &k})
      for (int64_t h = 0; h < kHeads; ++h)
        for (int64_t i = 0; i < half; ++i) {
          const double angle =
              pos * (freqs ? (*freqs)[static_cast<size_t>(i)]
                           : std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(rotary_dim)));
          double& u = (*m)[r * H + h * d + i];
          double& w = (*m)[r * H + h * d + half + i];
          const double u0 = u, w0 = w;
          const double c = cos_sin_factor * std::cos(angle), sn = cos_sin_factor * std::sin(angle);
          u = u0 * c - w0 * sn;
          w = w0 * c + u0 * sn;
        }
  }
  Mat ctx(static_cast<size_t>(kT * H), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int64_t bb = 0; bb < kBatch; ++bb)
    for (int64_t h = 0; h < kHeads; ++h)
      for (int64_t s = 0; s < kSeq; ++s) {
        const int64_t rq = s * kBatch + bb;
        const int64_t first = window > 0 ? std::max<int64_t>(0, s - window + 1) : 0;  // the sliding window's
        std::vector<double> p(static_cast<size_t>(s + 1 - first));
        double mx = -1e300, sum = 0.0;
        for (int64_t t = first; t <= s; ++t) {  // causal
          const int64_t rk = t * kBatch + bb;
          double dot = 0.0;
          for (int64_t e = 0; e < d; ++e) dot += q[rq * H + h * d + e] * k[rk * H + h * d + e];
          p[t - first] = dot * scale;
          mx = std::max(mx, p[t - first]);
        }
        for (double& x : p) sum += (x = std::exp(x - mx));
        for (int64_t t = first; t <= s; ++t) {
          const int64_t rv = t * kBatch + bb;
          for (int64_t e = 0; e < d; ++e) ctx[rq * H + h * d + e] += p[t - first] / sum * v[rv * H + h * d + e];
        }
      }
  Mat out = ref_linear(ctx, layer.param("proj.weight").value,
                       layer.has_param("proj.bias") ? layer.param("proj.bias").value : std::vector<float>(H, 0.0f), kT, H, H);
  for (size_t i = 0; i < out.size(); ++i) out[i] += b.x[i];
  expect_close(y, out, 1e-5, "attention output");
}

TEST(Layers, AttentionForwardMatchesReference) { check_attention_forward(nullptr, 0, 0.0); }

// sliding_window: each token attends to itself and the window - 1 before it, with
// learned positions and with rope and grouped queries; finite differences through it;
// a window as long as the sequence is the layer without one, bit for bit.
TEST(Layers, SlidingWindowAttentionMatchesReferenceAndFiniteDifferences) {
  for (const int64_t window : {1, 3, 5}) {
    SCOPED_TRACE("sliding_window " + std::to_string(window));
    const toml::table plain{{"sliding_window", window}};
    check_attention_forward(&plain, 0, 0.0, 0, false, nullptr, window);
    const toml::table llama{{"sliding_window", window}, {"num_query_groups", 2}, {"position_embedding", "rope"}};
    check_attention_forward(&llama, kHidden / kHeads, 10000.0, 2, false, nullptr, window);
    Rank rank;
    auto dims = make_dims();
    TestLayer layer(rank, "attention", dims, &llama);
    std::mt19937 rng(40 + static_cast<int>(window));
    layer.randomize(rng);
    check_gradients(rank, layer, rng);
  }
  const auto output = [](const toml::table* opts) {
    Rank rank;
    auto dims = make_dims();
    TestLayer layer(rank, "attention", dims, opts);
    std::mt19937 rng(50);
    layer.randomize(rng);
    Batch b = make_batch(rng);
    std::vector<float> y;
    layer.forward(b, 0, false, 0, &y);
    return y;
  };
  const toml::table whole{{"sliding_window", kSeq}}, shorter{{"sliding_window", kSeq - 1}};
  EXPECT_EQ(output(&whole), output(nullptr));
  EXPECT_NE(output(&shorter), output(nullptr));
}

// Rotary embeddings on the whole head and on half of it (rotary_percent), with another
// base: each token's q and k turned by its own position.
TEST(Layers, RopeAttentionForwardMatchesReference) {
  const int64_t d = kHidden / kHeads;
  {
    const toml::table opts{{"position_embedding", "rope"}, {"rotary_base", 10000.0}};
    check_attention_forward(&opts, d, 10000.0);
  }
  {
    const toml::table opts{{"position_embedding", "rope"}, {"rotary_base", 500.0}, {"rotary_percent", 0.5}};
    check_attention_forward(&opts, d / 2, 500.0);
  }
}

// transformers' _compute_llama3_parameters (rope_type "llama3"), written again here:
// each pair's frequency theta^(-j/dim), j even, kept, slowed by `factor`, or blended.
std::vector<double> llama3_table(double theta, int64_t dim, double factor, double low, double high, double original) {
  std::vector<double> out;
  for (int64_t j = 0; j < dim; j += 2) {
    const double inv = 1.0 / std::pow(theta, static_cast<double>(j) / static_cast<double>(dim));
    const double wavelen = 2.0 * M_PI / inv, low_wavelen = original / low, high_wavelen = original / high;
    double v = wavelen > low_wavelen ? inv / factor : inv;
    const double smooth = (original / wavelen - low) / (high - low);
    if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) v = (1.0 - smooth) * v / factor + smooth * v;
    out.push_back(v);
  }
  return out;
}

// rope_scaling = "llama3": a head of 4 has two pairs; with original_max_position 64,
// low 1 and high 8 the wavelengths 6.3 (kept) and 63 (blended) at theta 100, 6.3 and 628
// (slowed by the factor) at theta 10000. Gradients against finite differences.
TEST(Layers, Llama3RopeScalingMatchesReferenceAndFiniteDifferences) {
  const int64_t d = kHidden / kHeads;
  for (const double theta : {100.0, 10000.0}) {
    SCOPED_TRACE(theta);
    const toml::table opts{{"position_embedding", "rope"},        {"rotary_base", theta},
                           {"rope_scaling", "llama3"},            {"rope_scaling_factor", 8.0},
                           {"rope_low_freq_factor", 1.0},         {"rope_high_freq_factor", 8.0},
                           {"rope_original_max_position", 64}};
    const std::vector<double> freqs = llama3_table(theta, d, 8.0, 1.0, 8.0, 64.0);
    ASSERT_NE(freqs.back(), std::pow(theta, -2.0 / static_cast<double>(d))) << "the case scales nothing";
    check_attention_forward(&opts, d, theta, 0, false, &freqs);
    Rank rank;
    auto dims = make_dims();
    TestLayer layer(rank, "attention", dims, &opts);
    std::mt19937 rng(31);
    layer.randomize(rng);
    check_gradients(rank, layer, rng);
  }
  Rank rank;
  auto dims = make_dims();
  const toml::table bad{{"position_embedding", "rope"}, {"rope_scaling", "llama3"}, {"rope_low_freq_factor", 4.0},
                        {"rope_high_freq_factor", 2.0}};
  try {
    TestLayer layer(rank, "attention", dims, &bad);
    ADD_FAILURE() << "a high frequency factor below the low one was taken";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("rope_high_freq_factor (2) must be above rope_low_freq_factor (4)"),
              std::string::npos)
        << e.what();
  }
  const toml::table learned{{"rope_scaling", "llama3"}};
  try {
    TestLayer layer(rank, "attention", dims, &learned);
    ADD_FAILURE() << "rope_scaling without rotary embeddings was taken";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("set position_embedding = \"rope\" or rope_scaling = \"none\""),
              std::string::npos)
        << e.what();
  }
}

// Every check `loom plugins test` runs on layer/attention with `opts` passes, and the
// named ones ran.
void expect_attention_harness_passes(const toml::table& opts, const std::vector<std::string>& must_run) {
  std::set<std::string> ran;
  for (const loom::harness::CheckRun& c : loom::harness::check_layer_plugin(registry(), "attention", &opts)) {
    EXPECT_TRUE(c.error.empty()) << c.check << ": " << c.error;
    EXPECT_TRUE(c.findings.ok()) << c.check << ": " << c.findings.text();
    ran.insert(c.check);
  }
  for (const std::string& check : must_run) EXPECT_TRUE(ran.count(check)) << check << " did not run";
}

// YaRN's frequencies (rope_scaling = "yarn"), written again here from the paper and
// transformers' _compute_yarn_parameters: pair i keeps theta^(-2i/dim) below the
// correction dimension of beta_fast rotations over the original context, takes it /
// factor above that of beta_slow, and blends linearly between (floor and ceil of each).
std::vector<double> yarn_table(double theta, int64_t dim, double factor, double fast, double slow, double original) {
  const auto dim_of = [&](double turns) {
    return static_cast<double>(dim) * std::log(original / (turns * 2.0 * M_PI)) / (2.0 * std::log(theta));
  };
  const double lo = std::max(0.0, std::floor(dim_of(fast)));
  double hi = std::min(static_cast<double>(dim - 1), std::ceil(dim_of(slow)));
  if (hi == lo) hi += 0.001;
  std::vector<double> out;
  for (int64_t i = 0; i < dim / 2; ++i) {
    const double extrapolated = 1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(dim));
    const double keep = 1.0 - std::min(1.0, std::max(0.0, (static_cast<double>(i) - lo) / (hi - lo)));
    out.push_back(extrapolated / factor * (1.0 - keep) + extrapolated * keep);
  }
  return out;
}

// rope_scaling = "yarn": a head of 4 has two pairs; theta 100 and an original context
// of 64 put the correction dimensions at 0 and 2, so pair 0 keeps its frequency and
// pair 1 is blended half way. cos and sin carry the attention factor 0.1 ln 4 + 1 (or
// rope_attention_factor's), which the layer folds into the softmax scale. Gradients
// against finite differences, and every harness check (the generation cache reads the
// same scale, tp 2).
TEST(Layers, YarnRopeScalingMatchesReferenceAndFiniteDifferences) {
  const int64_t d = kHidden / kHeads;
  const std::vector<double> freqs = yarn_table(100.0, d, 4.0, 32.0, 1.0, 64.0);
  ASSERT_EQ(freqs[0], 1.0);
  ASSERT_NE(freqs[1], std::pow(100.0, -0.5)) << "the case scales nothing";
  ASSERT_NE(freqs[1], std::pow(100.0, -0.5) / 4.0) << "the case blends nothing";
  toml::table opts{{"position_embedding", "rope"}, {"rotary_base", 100.0}, {"rope_scaling", "yarn"},
                   {"rope_scaling_factor", 4.0},    {"rope_original_max_position", 64}};
  check_attention_forward(&opts, d, 100.0, 0, false, &freqs, 0, 0.1 * std::log(4.0) + 1.0);
  opts.insert_or_assign("rope_attention_factor", 0.5);
  check_attention_forward(&opts, d, 100.0, 0, false, &freqs, 0, 0.5);
  // mscale / mscale_all_dim: 1.2 ln 4 / 0.7 ln 4 on the same table.
  toml::table ratio = opts;
  ratio.erase("rope_attention_factor");
  ratio.insert_or_assign("rope_mscale", 2.0);
  ratio.insert_or_assign("rope_mscale_all_dim", 3.0);
  check_attention_forward(&ratio, d, 100.0, 0, false, &freqs, 0,
                          (0.2 * std::log(4.0) + 1.0) / (0.3 * std::log(4.0) + 1.0));
  expect_attention_harness_passes(ratio, {"gradients", "accumulation", "kv_cache", "tp2", "tp2+sp"});
  // Half of each head rotating: a factor other than 1 cannot go into the softmax scale.
  Rank rank;
  auto dims = make_dims();
  toml::table half = opts;
  half.insert_or_assign("rotary_percent", 0.5);
  try {
    TestLayer layer(rank, "attention", dims, &half);
    ADD_FAILURE() << "an attention factor on part of each head was taken";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("only 2 of each head's 4 q/k elements"), std::string::npos) << e.what();
  }
  half.insert_or_assign("rope_attention_factor", 1.0);
  const std::vector<double> half_freqs = yarn_table(100.0, d / 2, 4.0, 32.0, 1.0, 64.0);
  check_attention_forward(&half, d / 2, 100.0, 0, false, &half_freqs);
  // A factor whose square overflows the scores is refused, not trained into NaN.
  toml::table huge = opts;
  huge.insert_or_assign("rope_attention_factor", 1e20);
  try {
    TestLayer layer(rank, "attention", dims, &huge);
    ADD_FAILURE() << "an attention factor of 1e20 was taken";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("scales the attention scores by 1e+40"), std::string::npos) << e.what();
  }
  toml::table betas = opts;
  betas.insert_or_assign("rope_beta_fast", 1.0);
  try {
    TestLayer layer(rank, "attention", dims, &betas);
    ADD_FAILURE() << "beta_fast at beta_slow was taken";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("rope_beta_fast (1) must be above rope_beta_slow (1)"), std::string::npos)
        << e.what();
  }
}

// Grouped-query attention: two groups of two heads, and multi-query (one key/value
// head for all four) with rope.
TEST(Layers, GroupedQueryAttentionForwardMatchesReference) {
  {
    const toml::table opts{{"num_query_groups", 2}};
    check_attention_forward(&opts, 0, 0.0, 2);
  }
  {
    const toml::table opts{{"num_query_groups", 1}, {"position_embedding", "rope"}, {"bias", false}};
    check_attention_forward(&opts, kHidden / kHeads, 10000.0, 1);
  }
}

// QK normalisation (Megatron-LM's --qk-layernorm): each head's q and k normalised
// before the rotation, with grouped-query attention and rope; the gradients of it and
// of its gammas (and betas, layernorm) against finite differences, for either norm.
// Scaling the q and k columns of the QKV weight leaves such a layer's output as it
// was (what the norm is for); it does change a layer without it.
TEST(Layers, QkNormAttentionMatchesReferenceAndFiniteDifferences) {
  {
    const toml::table opts{{"qk_norm", true}};
    check_attention_forward(&opts, 0, 0.0, 0, /*qk_norm=*/true);
  }
  {
    const toml::table opts{{"qk_norm", true}, {"num_query_groups", 2}, {"position_embedding", "rope"}};
    check_attention_forward(&opts, kHidden / kHeads, 10000.0, 2, /*qk_norm=*/true);
  }
  for (const char* norm : {"layernorm", "rmsnorm"}) {
    SCOPED_TRACE(norm);
    Rank rank;
    auto dims = make_dims();
    const toml::table opts{{"qk_norm", true}, {"norm", norm}, {"num_query_groups", 2}, {"position_embedding", "rope"}};
    TestLayer layer(rank, "attention", dims, &opts);
    EXPECT_EQ(layer.param("q_norm.weight").value.size(), static_cast<size_t>(kHidden / kHeads));
    EXPECT_EQ(layer.has_param("k_norm.bias"), std::string(norm) == "layernorm");
    // Normalising head rows of 4 values is strongly curved: central differences with
    // the default step (1e-2) are off by up to 30% at some weights (the harness then
    // takes a third of the step).
    for (const int seed : {1, 7, 29}) {
      std::mt19937 rng(seed);
      layer.randomize(rng);
      check_gradients(rank, layer, rng);
    }
  }
  for (const bool qk_norm : {true, false}) {
    Rank rank;
    auto dims = make_dims();
    const toml::table opts{{"qk_norm", qk_norm}, {"norm", "rmsnorm"}, {"bias", false}};
    TestLayer layer(rank, "attention", dims, &opts);
    std::mt19937 rng(30);
    layer.randomize(rng);
    Batch b = make_batch(rng);
    std::vector<float> before, after;
    layer.forward(b, 0, false, 0, &before);
    std::vector<float>& w = layer.param("qkv.weight").value;  // [H, 3H]: q | k | v columns
    for (int64_t r = 0; r < kHidden; ++r)
      for (int64_t c = 0; c < 2 * kHidden; ++c) w[static_cast<size_t>(r * 3 * kHidden + c)] *= 4.0f;
    layer.forward(b, 0, false, 0, &after);
    double diff = 0;
    for (size_t i = 0; i < before.size(); ++i) diff = std::max(diff, std::fabs(double(before[i]) - after[i]));
    if (qk_norm)
      EXPECT_LT(diff, 1e-4) << "scaled q and k changed the output of a layer that normalises them";
    else
      EXPECT_GT(diff, 1e-2) << "the check cannot tell: scaling q and k changed nothing without qk_norm";
  }
}

// Gradients through the grouping (the repeated key/value heads' gradients summed
// back), with biases: the key bias's gradient is exactly zero, as without groups.
TEST(Layers, GroupedQueryAttentionGradientsMatchFiniteDifferences) {
  for (const int64_t groups : {1, 2})
  for (const char* position : {"learned_absolute", "rope"}) {
    SCOPED_TRACE(std::string(position) + ", " + std::to_string(groups) + " group(s)");
    Rank rank;
    auto dims = make_dims();
    const toml::table opts{{"num_query_groups", groups}, {"position_embedding", position}};
    TestLayer layer(rank, "attention", dims, &opts);
    EXPECT_EQ(layer.param("qkv.weight").value.size(),
              static_cast<size_t>(kHidden * (kHidden + 2 * groups * kHidden / kHeads)));
    std::mt19937 rng(28);
    layer.randomize(rng);
    check_gradients(rank, layer, rng);
  }
}

// ---------------------------------------------------------------------------
// Multi-latent attention (DeepSeek-V2/V3)
// ---------------------------------------------------------------------------

// Two shapes over the 4 heads: a query latent with value heads narrower than q and k
// (the packed heads padded in v), and q projected directly with value heads wider
// than q and k (padded in q and k).
toml::table mla_options(int64_t q_rank, int64_t v_dim, const char* norm = "rmsnorm") {
  return toml::table{{"multi_latent_attention", true}, {"position_embedding", "rope"}, {"bias", false},
                     {"norm", norm},          {"q_lora_rank", q_rank},            {"kv_lora_rank", 5},
                     {"qk_head_dim", 4},      {"qk_pos_emb_head_dim", 2},          {"v_head_dim", v_dim},
                     {"rotary_base", 100.0}};
}

Mat ref_rmsnorm(const Mat& x, const std::vector<float>& g, int64_t rows, int64_t cols) {
  Mat y(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t c = 0; c < cols; ++c) ss += x[r * cols + c] * x[r * cols + c];
    const double rstd = 1.0 / std::sqrt(ss / static_cast<double>(cols) + 1e-5);
    for (int64_t c = 0; c < cols; ++c) y[r * cols + c] = x[r * cols + c] * rstd * g[c];
  }
  return y;
}

// The layer against DeepSeek-V2's equations in double precision: latents down,
// normalised, up; per head q = [q_nope | q_pe], k = [k_nope | k_pe] with one k_pe for
// every head, q_pe and k_pe rotated (pairs (i, i + rope/2), the token at row s * B + b
// at position s), scores over sqrt(nope + rope), values of their own width.
void check_mla_forward(int64_t q_rank, int64_t vd, const toml::table* scaling = nullptr, int64_t rope = 2,
                       const std::vector<double>* freqs = nullptr, double softmax_factor = 1.0,
                       float weight_std = 0.3f) {
  Rank rank;
  auto dims = make_dims();
  toml::table opts = mla_options(q_rank, vd);
  opts.insert_or_assign("qk_pos_emb_head_dim", rope);
  if (scaling)
    for (const auto& [k, v] : *scaling) opts.insert_or_assign(k, v);
  TestLayer layer(rank, "attention", dims, &opts);
  std::mt19937 rng(41);
  layer.randomize(rng, weight_std);
  Batch b = make_batch(rng);
  std::vector<float> y;
  layer.forward(b, 0, false, 0, &y);

  const int64_t H = kHidden, nope = 4, qk = nope + rope, kv = 5, kvh = nope + vd;
  auto p = [&](const char* name) -> const std::vector<float>& { return layer.param(name).value; };
  auto zeros = [](int64_t n) { return std::vector<float>(static_cast<size_t>(n), 0.0f); };
  const Mat x(b.x.begin(), b.x.end());
  const Mat ln = ref_rmsnorm(x, p("ln.weight"), kT, H);
  Mat q;
  if (q_rank > 0) {
    const Mat cq = ref_linear(ln, p("q_down.weight"), zeros(q_rank), kT, H, q_rank);
    q = ref_linear(ref_rmsnorm(cq, p("q_latent_norm.weight"), kT, q_rank), p("q_up.weight"), zeros(kHeads * qk), kT,
                   q_rank, kHeads * qk);
  } else {
    q = ref_linear(ln, p("q.weight"), zeros(kHeads * qk), kT, H, kHeads * qk);
  }
  const Mat down = ref_linear(ln, p("kv_down.weight"), zeros(kv + rope), kT, H, kv + rope);
  Mat ckv(static_cast<size_t>(kT * kv)), kpe(static_cast<size_t>(kT * rope));
  for (int64_t r = 0; r < kT; ++r) {
    for (int64_t c = 0; c < kv; ++c) ckv[r * kv + c] = down[r * (kv + rope) + c];
    for (int64_t c = 0; c < rope; ++c) kpe[r * rope + c] = down[r * (kv + rope) + kv + c];
  }
  const Mat kvu = ref_linear(ref_rmsnorm(ckv, p("kv_latent_norm.weight"), kT, kv), p("kv_up.weight"),
                             zeros(kHeads * kvh), kT, kv, kHeads * kvh);
  auto rotate = [&](double* e, int64_t row) {
    const double pos = static_cast<double>(row / kBatch);
    for (int64_t i = 0; i < rope / 2; ++i) {
      const double angle = pos * (freqs ? (*freqs)[static_cast<size_t>(i)]
                                        : std::pow(100.0, -2.0 * static_cast<double>(i) / static_cast<double>(rope)));
      const double u = e[i], w = e[rope / 2 + i];
      e[i] = u * std::cos(angle) - w * std::sin(angle);
      e[rope / 2 + i] = w * std::cos(angle) + u * std::sin(angle);
    }
  };
  for (int64_t r = 0; r < kT; ++r) {
    rotate(&kpe[r * rope], r);
    for (int64_t h = 0; h < kHeads; ++h) rotate(&q[r * kHeads * qk + h * qk + nope], r);
  }
  Mat ctx(static_cast<size_t>(kT * kHeads * vd), 0.0);
  for (int64_t bb = 0; bb < kBatch; ++bb)
    for (int64_t h = 0; h < kHeads; ++h)
      for (int64_t s = 0; s < kSeq; ++s) {
        const int64_t rq = s * kBatch + bb;
        std::vector<double> w(static_cast<size_t>(s + 1));
        double mx = -1e300, sum = 0;
        for (int64_t t = 0; t <= s; ++t) {
          const int64_t rk = t * kBatch + bb;
          double dot = 0;
          for (int64_t e = 0; e < nope; ++e) dot += q[rq * kHeads * qk + h * qk + e] * kvu[rk * kHeads * kvh + h * kvh + e];
          for (int64_t e = 0; e < rope; ++e) dot += q[rq * kHeads * qk + h * qk + nope + e] * kpe[rk * rope + e];
          w[t] = dot * softmax_factor / std::sqrt(static_cast<double>(qk));
          mx = std::max(mx, w[t]);
        }
        for (double& e : w) sum += (e = std::exp(e - mx));
        for (int64_t t = 0; t <= s; ++t)
          for (int64_t e = 0; e < vd; ++e)
            ctx[rq * kHeads * vd + h * vd + e] += w[t] / sum * kvu[(t * kBatch + bb) * kHeads * kvh + h * kvh + nope + e];
      }
  Mat out = ref_linear(ctx, p("proj.weight"), zeros(H), kT, kHeads * vd, H);
  for (size_t i = 0; i < out.size(); ++i) out[i] += x[i];
  expect_close(y, out, 1e-5, "multi-latent attention output");
}

TEST(Layers, MultiLatentAttentionForwardMatchesReference) {
  check_mla_forward(/*q_rank=*/6, /*v=*/3);
  check_mla_forward(/*q_rank=*/0, /*v=*/8);
}

// DeepSeek-V2-Lite's YaRN (factor 40, mscale = mscale_all_dim = 0.707, beta 32 / 1; an
// original context of 64 here): the rotary part's two pairs, one kept and one blended,
// cos and sin unscaled (the ratio is 1), the softmax scale times mscale(0.707)^2, as
// transformers' DeepseekV2/V3Attention and Megatron-Core's MLA scale it. An attention
// factor other than 1 is refused (only the decoupled part rotates).
TEST(Layers, MultiLatentAttentionWithYarnMatchesReference) {
  const toml::table yarn{{"rope_scaling", "yarn"},   {"rope_scaling_factor", 40.0}, {"rope_original_max_position", 64},
                         {"rope_mscale", 0.707},     {"rope_mscale_all_dim", 0.707}};
  const std::vector<double> freqs = yarn_table(100.0, 4, 40.0, 32.0, 1.0, 64.0);
  ASSERT_NE(freqs[1], std::pow(100.0, -0.5)) << "the case scales nothing";
  const double m = 0.1 * 0.707 * std::log(40.0) + 1.0;
  // Weights of std 1: scores large enough for their scale to show.
  check_mla_forward(6, 3, &yarn, 4, &freqs, m * m, 1.0f);
  check_mla_forward(0, 8, &yarn, 4, &freqs, m * m, 1.0f);
  Rank rank;
  auto dims = make_dims();
  toml::table unequal = mla_options(6, 3);
  for (const auto& [k, v] : yarn) unequal.insert_or_assign(k, v);
  unequal.insert_or_assign("rope_mscale", 1.0);
  try {
    TestLayer layer(rank, "attention", dims, &unequal);
    ADD_FAILURE() << "an attention factor on the decoupled rotary part was taken";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("multi-latent attention rotates only qk_pos_emb_head_dim"), std::string::npos)
        << e.what();
  }
}

// Every check `loom plugins test` runs (finite differences, accumulation, microbatches
// in flight, the generation cache against a whole forward, tp 2 with and without
// sequence parallelism against one rank), for both shapes and both norms, with dropout
// for the tp checks' random streams.
TEST(Layers, MultiLatentAttentionPassesTheHarness) {
  for (const auto& [q_rank, vd] : {std::pair<int64_t, int64_t>{6, 3}, {0, 8}})
    for (const char* norm : {"rmsnorm", "layernorm"}) {
      SCOPED_TRACE("q_lora_rank " + std::to_string(q_rank) + ", v_head_dim " + std::to_string(vd) + ", " + norm);
      toml::table opts = mla_options(q_rank, vd, norm);
      opts.insert_or_assign("dropout", 0.25);
      expect_attention_harness_passes(opts, {"gradients", "accumulation", "microbatches", "kv_cache", "tp2", "tp2+sp"});
    }
}

// Generation caches multi-latent attention's latent per position ([k_pe | kv]: 2 + 5
// elements here, DeepSeek-V3's 64 + 512), not every head's k and v (4 heads of 2 x 6
// here, 128 heads of 2 x 192 there: 85 times more); the cached forward still equals
// the whole sequence's (the harness's kv_cache check, above).
TEST(Layers, MultiLatentAttentionCachesOneLatentPerPosition) {
  Rank rank;
  const loom_model_dims dims = make_dims();
  const toml::table opts = mla_options(6, 3);
  TestLayer layer(rank, "attention", dims, &opts);
  std::mt19937 rng(3);
  layer.randomize(rng);
  const Batch b = make_batch(rng);
  const uint64_t before = rank.device_bytes();
  layer.forward_cached(b, 0, dims.seq_len);
  const uint64_t kept = rank.device_bytes() - before;
  const uint64_t rows = static_cast<uint64_t>(dims.seq_len * dims.micro_batch);
  EXPECT_EQ(kept, rows * (2 + 5) * sizeof(float) + rows * sizeof(int32_t)) << "the latents and the rotary positions";
  // Multi-head attention keeps each head's k and v.
  TestLayer heads(rank, "attention", dims);
  heads.randomize(rng);
  const uint64_t at = rank.device_bytes();
  heads.forward_cached(b, 0, dims.seq_len);
  EXPECT_EQ(rank.device_bytes() - at, rows * 2 * static_cast<uint64_t>(dims.hidden) * sizeof(float));
}

// Qwen2's attention (add_qkv_bias with bias = false, grouped queries, rope) passes every
// harness check: finite differences of the q, k and v biases, tp 2 with and without SP.
TEST(Layers, QkvBiasAttentionPassesTheHarness) {
  toml::table opts;
  for (const auto& [k, v] : std::vector<std::pair<const char*, bool>>{{"bias", false}, {"add_qkv_bias", true}})
    opts.insert(k, v);
  opts.insert("position_embedding", "rope");
  opts.insert("num_query_groups", 2);
  opts.insert("norm", "rmsnorm");
  expect_attention_harness_passes(opts, {"gradients", "accumulation", "kv_cache", "tp2", "tp2+sp"});
  Rank rank;
  const loom_model_dims dims = make_dims();
  TestLayer layer(rank, "attention", dims, &opts);
  EXPECT_TRUE(layer.has_param("qkv.bias"));
  EXPECT_FALSE(layer.has_param("proj.bias"));
  // With bias = true every projection has one: add_qkv_bias beside it is refused.
  opts.insert_or_assign("bias", true);
  try {
    TestLayer both(rank, "attention", dims, &opts);
    ADD_FAILURE() << "add_qkv_bias with bias = true was taken";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("set bias = false or leave add_qkv_bias out"), std::string::npos) << e.what();
  }
}

// The parameters Megatron-Core's MLA declares, by shape; a layernorm's latents have
// betas too.
TEST(Layers, MultiLatentAttentionDeclaresItsProjections) {
  Rank rank;
  auto dims = make_dims();
  const toml::table with_latent = mla_options(6, 3, "layernorm"), direct = mla_options(0, 8);
  TestLayer a(rank, "attention", dims, &with_latent);
  std::map<std::string, size_t> sizes;
  for (Param& p : a.params()) sizes[p.name] = p.value.size();
  const std::map<std::string, size_t> want = {
      {"ln.weight", 16}, {"ln.bias", 16}, {"q_down.weight", 16 * 6}, {"q_latent_norm.weight", 6},
      {"q_latent_norm.bias", 6}, {"q_up.weight", 6 * 4 * 6}, {"kv_down.weight", 16 * 7},
      {"kv_latent_norm.weight", 5}, {"kv_latent_norm.bias", 5}, {"kv_up.weight", 5 * 4 * 7},
      {"proj.weight", 4 * 3 * 16}};
  EXPECT_EQ(sizes, want);
  TestLayer b(rank, "attention", dims, &direct);
  sizes.clear();
  for (Param& p : b.params()) sizes[p.name] = p.value.size();
  const std::map<std::string, size_t> want_direct = {{"ln.weight", 16},          {"q.weight", 16 * 4 * 6},
                                                     {"kv_down.weight", 16 * 7}, {"kv_latent_norm.weight", 5},
                                                     {"kv_up.weight", 5 * 4 * 12}, {"proj.weight", 4 * 8 * 16}};
  EXPECT_EQ(sizes, want_direct);
}

// Options multi-latent attention replaces or needs, refused by name at create.
TEST(Layers, MultiLatentAttentionRefusesOptionsItCannotHonour) {
  auto refusal = [](const toml::table& opts) {
    try {
      Rank rank;
      auto dims = make_dims();
      TestLayer layer(rank, "attention", dims, &opts);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  auto with = [](const char* key, auto value) {
    toml::table t = mla_options(6, 3);
    t.insert_or_assign(key, value);
    return t;
  };
  EXPECT_NE(refusal(with("position_embedding", "learned_absolute")).find("set position_embedding = \"rope\""),
            std::string::npos);
  EXPECT_NE(refusal(with("bias", true)).find("has no biases"), std::string::npos);
  EXPECT_NE(refusal(with("num_query_groups", 2)).find("leave num_query_groups out"), std::string::npos);
  EXPECT_NE(refusal(with("qk_norm", true)).find("leave qk_norm out"), std::string::npos);
  EXPECT_NE(refusal(with("rotary_percent", 0.5)).find("leave rotary_percent out"), std::string::npos);
  EXPECT_NE(refusal(with("kv_lora_rank", 0)).find("needs kv_lora_rank"), std::string::npos);
  EXPECT_NE(refusal(with("qk_pos_emb_head_dim", 3)).find("must be even"), std::string::npos);
  {
    toml::table one = with("kv_lora_rank", 1);
    one.insert_or_assign("norm", "layernorm");
    EXPECT_NE(refusal(one).find("a LayerNorm over kv_lora_rank = 1 element is its bias alone"), std::string::npos)
        << refusal(one);
    one.insert_or_assign("norm", "rmsnorm");
    EXPECT_EQ(refusal(one), "");
  }
  const toml::table plain{{"kv_lora_rank", 8}};
  EXPECT_NE(refusal(plain).find("kv_lora_rank = 8 sizes multi-latent attention"), std::string::npos);
  EXPECT_EQ(refusal(mla_options(6, 3)), "");
}

TEST(Layers, RopeAttentionGradientsMatchFiniteDifferences) {
  Rank rank;
  auto dims = make_dims();
  const toml::table opts{{"position_embedding", "rope"}, {"rotary_base", 100.0}, {"norm", "rmsnorm"}, {"bias", false}};
  TestLayer layer(rank, "attention", dims, &opts);
  std::mt19937 rng(26);
  layer.randomize(rng);
  check_gradients(rank, layer, rng);
}

// position_embedding = rope leaves the embedding without a position table.
TEST(Layers, EmbeddingWithRopeHasNoPositionTable) {
  Rank rank;
  auto dims = make_dims();
  const toml::table opts{{"position_embedding", "rope"}};
  TestLayer layer(rank, "embedding", dims, &opts);
  ASSERT_EQ(layer.params().size(), 1u);
  EXPECT_EQ(layer.params()[0].name.find("pos."), std::string::npos) << layer.params()[0].name;
  std::mt19937 rng(27);
  layer.randomize(rng);
  check_gradients(rank, layer, rng);
}

TEST(Layers, MlpForwardMatchesReference) {
  Rank rank;
  auto dims = make_dims();
  TestLayer layer(rank, "mlp", dims);
  std::mt19937 rng(22);
  layer.randomize(rng);
  Batch b = make_batch(rng);
  std::vector<float> y;
  layer.forward(b, 0, false, 0, &y);
  Mat ln = ref_layernorm(b.x, layer.param("ln.weight").value, layer.param("ln.bias").value, kT, kHidden);
  Mat h = ref_linear(ln, layer.param("fc1.weight").value, layer.param("fc1.bias").value, kT, kHidden, kFfn);
  for (double& v : h)  // GeLU, tanh approximation
    v = 0.5 * v * (1.0 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
  Mat out = ref_linear(h, layer.param("fc2.weight").value, layer.param("fc2.bias").value, kT, kFfn, kHidden);
  for (size_t i = 0; i < out.size(); ++i) out[i] += b.x[i];
  expect_close(y, out, 1e-5, "mlp output");
}

// Llama's MLP: RMSNorm, SwiGLU (fc1 = [gate | up]), no biases.
toml::table llama_mlp_options() {
  return toml::table{{"activation", "swiglu"}, {"norm", "rmsnorm"}, {"bias", false}, {"norm_epsilon", 1e-6}};
}

TEST(Layers, LlamaMlpGradientsMatchFiniteDifferences) {
  Rank rank;
  auto dims = make_dims();
  const toml::table opts = llama_mlp_options();
  TestLayer layer(rank, "mlp", dims, &opts);
  std::vector<std::string> names;
  for (Param& p : layer.params()) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{"ln.weight", "fc1.weight", "fc2.weight"}));  // no biases, no beta
  std::mt19937 rng(23);
  layer.randomize(rng);
  check_gradients(rank, layer, rng);
}

// Attention without biases behind RMSNorm, and the head behind RMSNorm.
TEST(Layers, RmsNormAttentionAndHeadGradientsMatchFiniteDifferences) {
  for (const std::string name : {"attention", "lm_head"}) {
    SCOPED_TRACE(name);
    Rank rank;
    auto dims = make_dims();
    toml::table opts{{"norm", "rmsnorm"}};
    if (name == "attention") opts.insert_or_assign("bias", false);
    TestLayer layer(rank, name, dims, &opts);
    for (Param& p : layer.params()) {
      EXPECT_EQ(p.name.find(".bias"), std::string::npos) << p.name << " declared";
    }
    std::mt19937 rng(25);
    layer.randomize(rng, name == "lm_head" ? 0.5f : 1.0f);
    check_gradients(rank, layer, rng);
  }
}

TEST(Layers, LlamaMlpForwardMatchesReference) {
  Rank rank;
  auto dims = make_dims();
  const toml::table opts = llama_mlp_options();
  TestLayer layer(rank, "mlp", dims, &opts);
  std::mt19937 rng(24);
  layer.randomize(rng);
  Batch b = make_batch(rng);
  std::vector<float> y;
  layer.forward(b, 0, false, 0, &y);
  const std::vector<float>& g = layer.param("ln.weight").value;
  Mat n(static_cast<size_t>(kT * kHidden));
  for (int64_t r = 0; r < kT; ++r) {  // RMSNorm
    double ss = 0;
    for (int64_t c = 0; c < kHidden; ++c) ss += static_cast<double>(b.x[r * kHidden + c]) * b.x[r * kHidden + c];
    const double rstd = 1.0 / std::sqrt(ss / kHidden + 1e-6);
    for (int64_t c = 0; c < kHidden; ++c) n[r * kHidden + c] = b.x[r * kHidden + c] * rstd * g[c];
  }
  Mat h = ref_linear(n, layer.param("fc1.weight").value, std::vector<float>(2 * kFfn, 0.0f), kT, kHidden, 2 * kFfn);
  Mat act(static_cast<size_t>(kT * kFfn));
  for (int64_t r = 0; r < kT; ++r)  // silu(gate) * up, gate = columns [0, ffn), up = [ffn, 2 ffn)
    for (int64_t c = 0; c < kFfn; ++c) {
      const double gate = h[r * 2 * kFfn + c], up = h[r * 2 * kFfn + kFfn + c];
      act[r * kFfn + c] = gate / (1.0 + std::exp(-gate)) * up;
    }
  Mat out = ref_linear(act, layer.param("fc2.weight").value, std::vector<float>(kHidden, 0.0f), kT, kFfn, kHidden);
  for (size_t i = 0; i < out.size(); ++i) out[i] += b.x[i];
  expect_close(y, out, 1e-5, "llama mlp output");
}

// ---------------------------------------------------------------------------
// Accumulation: a second backward adds the same gradient again.
// ---------------------------------------------------------------------------

TEST(Layers, ParameterGradientsAccumulateAndInputGradientIsOverwritten) {
  for (const std::string& name : all_layers()) {
    SCOPED_TRACE(name);
    Rank rank;
    auto dims = make_dims();
    TestLayer layer(rank, name, dims);
    std::mt19937 rng(6);
    layer.randomize(rng);
    const loom::harness::Findings f = loom::harness::check_accumulation(layer, rng);
    EXPECT_TRUE(f.ok()) << f.text();
  }
}

// ---------------------------------------------------------------------------
// lm_head: the loss itself
// ---------------------------------------------------------------------------

// Σ over targets >= 0 of logsumexp(logits[t, :vocab]) - logits[t, target], in double.
double reference_loss(TestLayer& head, const Batch& b, int64_t* count) {
  const std::vector<float>& g = head.param("ln.weight").value;
  const std::vector<float>& be = head.param("ln.bias").value;
  const std::vector<float>& w = head.param("word.weight").value;
  double total = 0.0;
  *count = 0;
  for (int64_t t = 0; t < kT; ++t) {
    const float* x = &b.x[t * kHidden];
    double mean = 0.0, var = 0.0;
    for (int64_t c = 0; c < kHidden; ++c) mean += x[c];
    mean /= kHidden;
    for (int64_t c = 0; c < kHidden; ++c) var += (x[c] - mean) * (x[c] - mean);
    var /= kHidden;
    const double rstd = 1.0 / std::sqrt(var + 1e-5);
    std::vector<double> ln(kHidden);
    for (int64_t c = 0; c < kHidden; ++c) ln[c] = (x[c] - mean) * rstd * g[c] + be[c];
    std::vector<double> logits(kVocab);
    double mx = -1e300;
    for (int64_t v = 0; v < kVocab; ++v) {
      double s = 0.0;
      for (int64_t c = 0; c < kHidden; ++c) s += ln[c] * w[v * kHidden + c];
      logits[v] = s;
      mx = std::max(mx, s);
    }
    double se = 0.0;
    for (double l : logits) se += std::exp(l - mx);
    const int32_t target = b.targets[t];
    if (target < 0) continue;
    total += std::log(se) + mx - logits[target];
    ++*count;
  }
  return total;
}

TEST(Layers, LmHeadLossMatchesReference) {
  Rank rank;
  auto dims = make_dims();
  TestLayer head(rank, "lm_head", dims);
  std::mt19937 rng(7);
  head.randomize(rng, 0.5f);
  Batch b = make_batch(rng);
  int64_t count = 0, ref_count = 0;
  const double loss = head.forward(b, 0, false, 0, nullptr, &count);
  const double ref = reference_loss(head, b, &ref_count);
  EXPECT_EQ(count, kT);
  EXPECT_EQ(ref_count, kT);
  EXPECT_NEAR(loss, ref, 1e-5 * std::fabs(ref));
  EXPECT_GT(ref, 0.0);
}

TEST(Layers, LmHeadPaddedVocabNeverAffectsTheLoss) {
  Rank rank;
  auto dims = make_dims();
  TestLayer head(rank, "lm_head", dims);
  std::mt19937 rng(8);
  head.randomize(rng, 0.5f);
  Batch b = make_batch(rng);
  const double before = head.forward(b, 0);
  head.zero_grads();
  head.backward(b, 0);
  std::vector<float>& w = head.param("word.weight").value;
  // Padded rows: no gradient either.
  const std::vector<float>& gw = head.param("word.weight").grad;
  for (int64_t j = kVocab * kHidden; j < kPadded * kHidden; ++j) ASSERT_EQ(gw[j], 0.0f) << j;
  for (int64_t j = kVocab * kHidden; j < kPadded * kHidden; ++j) w[j] = 1000.0f;
  const double after = head.forward(b, 0, false);
  EXPECT_NEAR(after, before, 1e-6 * std::fabs(before));
  int64_t ref_count = 0;
  EXPECT_NEAR(after, reference_loss(head, b, &ref_count), 1e-5 * std::fabs(before));
}

TEST(Layers, LmHeadIgnoresNegativeTargets) {
  Rank rank;
  auto dims = make_dims();
  TestLayer head(rank, "lm_head", dims);
  std::mt19937 rng(9);
  head.randomize(rng, 0.5f);
  Batch b = make_batch(rng);
  const std::vector<int64_t> ignored = {0, 3, 4, 11, 15};
  for (int64_t t : ignored) b.targets[t] = -1;
  int64_t count = 0, ref_count = 0;
  const double loss = head.forward(b, 0, true, 0, nullptr, &count);
  const double ref = reference_loss(head, b, &ref_count);
  EXPECT_EQ(count, kT - static_cast<int64_t>(ignored.size()));
  EXPECT_EQ(ref_count, count);
  EXPECT_NEAR(loss, ref, 1e-5 * std::fabs(ref));
  // An ignored token's input gets exactly zero gradient; the others do not.
  std::vector<float> dx = head.backward(b, 0);
  for (int64_t t = 0; t < kT; ++t) {
    const bool ign = std::find(ignored.begin(), ignored.end(), t) != ignored.end();
    double m = 0.0;
    for (int64_t c = 0; c < kHidden; ++c) m = std::max(m, static_cast<double>(std::fabs(dx[t * kHidden + c])));
    if (ign) EXPECT_EQ(m, 0.0) << "token " << t;
    else EXPECT_GT(m, 0.0) << "token " << t;
  }
  // Changing an ignored target's row value changes nothing.
  b.targets[3] = -5;
  EXPECT_NEAR(head.forward(b, 0, false), loss, 1e-6 * std::fabs(loss));
}

// ---------------------------------------------------------------------------
// Declarations: tying, partitioning, init
// ---------------------------------------------------------------------------

TEST(Layers, TiedEmbeddingsShareTheWordWeight) {
  Rank rank;
  auto tied = make_dims(true);
  TestLayer emb(rank, "embedding", tied);
  TestLayer head(rank, "lm_head", tied);
  const Param& a = emb.param("word.weight");
  const Param& b = head.param("word.weight");
  EXPECT_EQ(a.tie_key, "word_embedding");
  EXPECT_EQ(b.tie_key, "word_embedding");
  EXPECT_EQ(a.shape, b.shape);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{kPadded, kHidden}));
  EXPECT_EQ(a.partition_dim, 0);
  EXPECT_EQ(b.partition_dim, 0);

  auto untied = make_dims(false);
  TestLayer emb2(rank, "embedding", untied);
  TestLayer head2(rank, "lm_head", untied);
  EXPECT_EQ(emb2.param("word.weight").tie_key, "");
  EXPECT_EQ(head2.param("word.weight").tie_key, "");
}

TEST(Layers, ParameterDeclarations) {
  Rank rank;
  auto dims = make_dims();
  struct Want {
    std::string name;
    std::vector<int64_t> shape;
    int32_t pdim, stride, init, nwd;
  };
  const std::map<std::string, std::vector<Want>> want = {
      {"embedding",
       {{"word.weight", {kPadded, kHidden}, 0, 1, LOOM_INIT_NORMAL, 0},
        {"pos.weight", {kSeq, kHidden}, -1, 1, LOOM_INIT_NORMAL, 0}}},
      {"attention",
       {{"ln.weight", {kHidden}, -1, 1, LOOM_INIT_ONES, 1},
        {"ln.bias", {kHidden}, -1, 1, LOOM_INIT_ZEROS, 1},
        {"qkv.weight", {kHidden, 3 * kHidden}, 1, 3, LOOM_INIT_NORMAL, 0},
        {"qkv.bias", {3 * kHidden}, 0, 3, LOOM_INIT_ZEROS, 1},
        {"proj.weight", {kHidden, kHidden}, 0, 1, LOOM_INIT_NORMAL_SCALED, 0},
        {"proj.bias", {kHidden}, -1, 1, LOOM_INIT_ZEROS, 1}}},
      {"mlp",
       {{"ln.weight", {kHidden}, -1, 1, LOOM_INIT_ONES, 1},
        {"ln.bias", {kHidden}, -1, 1, LOOM_INIT_ZEROS, 1},
        {"fc1.weight", {kHidden, kFfn}, 1, 1, LOOM_INIT_NORMAL, 0},
        {"fc1.bias", {kFfn}, 0, 1, LOOM_INIT_ZEROS, 1},
        {"fc2.weight", {kFfn, kHidden}, 0, 1, LOOM_INIT_NORMAL_SCALED, 0},
        {"fc2.bias", {kHidden}, -1, 1, LOOM_INIT_ZEROS, 1}}},
      {"lm_head",
       {{"ln.weight", {kHidden}, -1, 1, LOOM_INIT_ONES, 1},
        {"ln.bias", {kHidden}, -1, 1, LOOM_INIT_ZEROS, 1},
        {"word.weight", {kPadded, kHidden}, 0, 1, LOOM_INIT_NORMAL, 0}}},
  };
  for (const auto& [name, params] : want) {
    SCOPED_TRACE(name);
    TestLayer layer(rank, name, dims);
    ASSERT_EQ(layer.params().size(), params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const Param& p = layer.params()[i];
      EXPECT_EQ(p.name, params[i].name);
      EXPECT_EQ(p.shape, params[i].shape) << p.name;
      EXPECT_EQ(p.partition_dim, params[i].pdim) << p.name;
      EXPECT_EQ(std::max(1, p.partition_stride), params[i].stride) << p.name;
      EXPECT_EQ(p.init, params[i].init) << p.name;
      EXPECT_EQ(p.no_weight_decay, params[i].nwd) << p.name;
    }
  }
}

TEST(Layers, ActivationBytesAndForwardFlops) {
  Rank rank;
  auto dims = make_dims();
  const double T = kT, S = kSeq, H = kHidden, F = kFfn, V = kPadded;
  const std::map<std::string, double> flops = {
      {"embedding", 0.0},
      {"attention", 2 * T * H * 3 * H + 4 * T * S * H + 2 * T * H * H},
      {"mlp", 4 * T * H * F},
      {"lm_head", 2 * T * H * V},
  };
  for (const auto& [name, f] : flops) {
    SCOPED_TRACE(name);
    TestLayer layer(rank, name, dims);
    EXPECT_DOUBLE_EQ(layer.api()->forward_flops(layer.raw()), f);
    // What a training forward keeps is what activation_bytes says (within the
    // allocator's alignment), and backward gives it all back.
    std::mt19937 rng(10);
    layer.randomize(rng);
    Batch b = make_batch(rng);
    const uint64_t declared = layer.api()->activation_bytes(layer.raw());
    EXPECT_GT(declared, 0u);
    const uint64_t base = rank.device_bytes();
    layer.forward(b, 0);
    const uint64_t kept = rank.device_bytes() - base;
    EXPECT_GE(kept + 4096, declared);
    EXPECT_LE(kept, declared + 4096);
    layer.backward(b, 0);
    EXPECT_EQ(rank.device_bytes(), base);
    // release() frees a forward that never gets its backward; eval keeps nothing.
    layer.forward(b, 1);
    layer.api()->release(layer.raw(), 1);
    EXPECT_EQ(rank.device_bytes(), base);
    layer.forward(b, 2, /*training=*/false);
    EXPECT_EQ(rank.device_bytes(), base);
  }
  // Attention's saved set: x, mean, rstd, qkv, context, lse (+ the u8 mask with dropout).
  TestLayer att(rank, "attention", dims);
  const double expect = 4 * (T * H + 2 * T + 3 * T * H + T * H + kBatch * kHeads * S);
  EXPECT_GE(static_cast<double>(att.api()->activation_bytes(att.raw())), expect);
  EXPECT_LE(static_cast<double>(att.api()->activation_bytes(att.raw())), expect + 7 * 256);
}

// The harness's memory check (what `loom plan` relies on: kept <= activation_bytes,
// temporaries <= workspace_bytes, nothing left behind) for each built-in layer and the
// attention variants with temporaries of their own; and beyond it, the built-in layers
// declare no more than they use (within 10%): a temporary left out of the
// declaration, or one declared and never allocated, shows.
TEST(Layers, DeclaredMemoryIsWhatForwardAndBackwardUse) {
  std::vector<std::pair<std::string, toml::table>> cases = {
      {"embedding", {}}, {"attention", {}}, {"mlp", {}}, {"lm_head", {}},
      {"attention", toml::table{{"num_query_groups", 2}, {"position_embedding", "rope"}, {"qk_norm", true}}},
      {"attention", mla_options(6, 3)}, {"attention", mla_options(0, 8)}};
  for (const auto& [name, opts] : cases) {
    std::ostringstream what;
    what << name << " " << opts;
    SCOPED_TRACE(what.str());
    {
      Rank rank;
      TestLayer layer(rank, name, make_dims(), &opts);
      std::mt19937 rng(12);
      layer.randomize(rng);
      const loom::harness::Findings f = loom::harness::check_memory(layer, rng);
      EXPECT_TRUE(f.ok()) << f.text();
    }
    Rank rank;  // fresh: its high-water mark is this layer's
    TestLayer layer(rank, name, make_dims(), &opts);
    std::mt19937 rng(12);
    layer.randomize(rng);
    const loom::harness::MemoryUse m = loom::harness::measure_memory(layer, rng);
    EXPECT_GE(m.kept + 4096, m.declared_activation * 9 / 10);
    EXPECT_GE(m.temporaries + 4096, m.declared_workspace * 9 / 10)
        << "declared " << m.declared_workspace << " B, used " << m.temporaries << " B";
  }
}

TEST(Layers, BackwardWithoutTrainingForwardIsAnError) {
  Rank rank;
  auto dims = make_dims();
  for (const std::string& name : all_layers()) {
    SCOPED_TRACE(name);
    TestLayer layer(rank, name, dims);
    std::mt19937 rng(11);
    layer.randomize(rng);
    Batch b = make_batch(rng);
    layer.forward(b, 0, /*training=*/false);
    EXPECT_THROW(layer.backward(b, 0), loom::Error);
    EXPECT_THROW(layer.backward(b, 5), loom::Error);
  }
}

// ---------------------------------------------------------------------------
// Causality
// ---------------------------------------------------------------------------

TEST(Layers, AttentionIsCausalAndKeepsBatchElementsApart) {
  Rank rank;
  auto dims = make_dims();
  TestLayer layer(rank, "attention", dims);
  std::mt19937 rng(12);
  layer.randomize(rng);
  Batch b = make_batch(rng);
  std::vector<float> y0, y1;
  layer.forward(b, 0, false, 0, &y0);
  const int64_t s0 = 3, b0 = 1;
  Batch c = b;
  // A random change (a constant shift would vanish in the LayerNorm).
  std::normal_distribution<float> n01(0.0f, 1.0f);
  for (int64_t h = 0; h < kHidden; ++h) c.x[(s0 * kBatch + b0) * kHidden + h] += 0.5f * n01(rng);
  layer.forward(c, 0, false, 0, &y1);
  for (int64_t s = 0; s < kSeq; ++s) {
    for (int64_t bb = 0; bb < kBatch; ++bb) {
      // The attention branch (output minus the residual input) of this token.
      double diff = 0.0;
      for (int64_t h = 0; h < kHidden; ++h) {
        const int64_t i = (s * kBatch + bb) * kHidden + h;
        diff = std::max(diff, static_cast<double>(std::fabs((y1[i] - c.x[i]) - (y0[i] - b.x[i]))));
      }
      if (s < s0 || bb != b0)
        EXPECT_LE(diff, 1e-6) << "position " << s << " batch " << bb << " saw position " << s0;
      else
        EXPECT_GT(diff, 1e-4) << "position " << s << " batch " << bb << " ignores position " << s0;
    }
  }
}

// ---------------------------------------------------------------------------
// Microbatches in flight
// ---------------------------------------------------------------------------

TEST(Layers, MicrobatchesInFlightMatchSequentialOrder) {
  for (const std::string& name : all_layers()) {
    SCOPED_TRACE(name);
    Rank rank;
    auto dims = make_dims();
    toml::table opts = dropout_options(0.25);
    const bool drop = name != "lm_head";
    TestLayer layer(rank, name, dims, drop ? &opts : nullptr);
    std::mt19937 rng(13);
    layer.randomize(rng);
    const loom::harness::Findings f = loom::harness::check_microbatches_in_flight(layer, rng);
    EXPECT_TRUE(f.ok()) << f.text();
  }
}

// ---------------------------------------------------------------------------
// Dropout
// ---------------------------------------------------------------------------

// ABI 1.3: the step's seed by address (dropout_seed_device, what a captured
// forward reads) draws the masks the same seed by value draws, and follows the
// value at that address.
TEST(Layers, DropoutSeedByAddressEqualsTheSeedByValue) {
  for (const std::string name : {"embedding", "attention", "mlp"}) {
    SCOPED_TRACE(name);
    Rank rank;
    auto dims = make_dims();
    toml::table opts = dropout_options(0.5);
    opts.insert_or_assign("activation_dropout", 0.25);
    if (name != "mlp") opts.erase("activation_dropout");
    TestLayer layer(rank, name, dims, &opts);
    std::mt19937 rng(15);
    layer.randomize(rng);
    Batch b = make_batch(rng);
    loom::Buffer slot_memory(&rank.rt(), sizeof(uint64_t));
    uint64_t* slot = slot_memory.get<uint64_t>();  // CPU device: host memory
    std::vector<float> by_value, by_address, other_value, other_address;
    *slot = 42;
    layer.forward(b, 3, true, 42, &by_value);
    layer.forward(b, 3, true, 42, &by_address, nullptr, slot);
    layer.forward(b, 3, true, 43, &other_value);
    *slot = 43;  // the value at the address decides, not the one passed by value
    layer.forward(b, 3, true, 42, &other_address, nullptr, slot);
    layer.api()->release(layer.raw(), 3);
    EXPECT_EQ(by_address, by_value);
    EXPECT_EQ(other_address, other_value);
    EXPECT_GT(max_abs_diff(by_value, other_value), 1e-3);
  }
}

TEST(Layers, DropoutFollowsTheSeedAndOnlyInTraining) {
  for (const std::string name : {"embedding", "attention", "mlp"}) {
    SCOPED_TRACE(name);
    Rank rank;
    auto dims = make_dims();
    toml::table opts = dropout_options(0.5);
    TestLayer layer(rank, name, dims, &opts);
    TestLayer plain(rank, name, dims);
    std::mt19937 rng(14);
    layer.randomize(rng);
    for (size_t i = 0; i < layer.params().size(); ++i)  // the same values (each call copies them in)
      std::copy(layer.params()[i].value.begin(), layer.params()[i].value.end(), plain.params()[i].value.begin());
    Batch b = make_batch(rng);
    std::vector<float> y1, y2, y3, y4, eval, ref;
    layer.forward(b, 0, true, 42, &y1);
    layer.forward(b, 1, true, 42, &y2);   // another microbatch, same seed: the same mask (the engine's
                                          // seed names the samples; the index depends on dp)
    layer.forward(b, 0, true, 42, &y3);   // same seed, same microbatch: same mask
    layer.forward(b, 0, true, 43, &y4);   // another seed
    layer.forward(b, 0, false, 42, &eval);
    plain.forward(b, 0, false, 42, &ref);
    layer.api()->release(layer.raw(), 0);
    layer.api()->release(layer.raw(), 1);
    EXPECT_EQ(y1, y3);
    EXPECT_GT(max_abs_diff(y1, y4), 1e-3);
    EXPECT_EQ(y1, y2);
    EXPECT_EQ(eval, ref);  // no dropout outside training
    // About half of the branch is dropped: count elements equal to the residual
    // (attention, mlp) or to zero (embedding).
    int64_t dropped = 0;
    for (size_t i = 0; i < y1.size(); ++i) {
      const float base = name == "embedding" ? 0.0f : b.x[i];
      dropped += y1[i] == base ? 1 : 0;
    }
    const double frac = static_cast<double>(dropped) / static_cast<double>(y1.size());
    EXPECT_GT(frac, 0.3);
    EXPECT_LT(frac, 0.7);
  }
}

}  // namespace

namespace {

// ---------------------------------------------------------------------------
// Tensor parallelism: two ranks (threads, comm/local) hold slices of the serial
// layer's parameters and must compute the serial outputs, loss and gradients.
// ---------------------------------------------------------------------------

using loom::harness::slice;

// Each layer at tp 2, with and without sequence parallelism, against one rank (the
// harness's check); dropout outside the tp region draws the same mask on every rank.
TEST(Layers, TensorParallelTwoRanksMatchOneRank) {
  for (const std::string& name : all_layers())
    for (const bool sp : {false, true}) {
      SCOPED_TRACE(name + (sp ? " with sequence parallelism" : ""));
      toml::table opts = dropout_options(0.25);
      std::mt19937 rng(30);
      const loom::harness::Findings f = loom::harness::check_tensor_parallel(
          registry(), name, make_dims(), name != "lm_head" ? &opts : nullptr, rng, {.tp = 2, .sequence_parallel = sp});
      EXPECT_TRUE(f.ok()) << f.text();
    }
}

}  // namespace

namespace {

// ---------------------------------------------------------------------------
// The parallel/tensor service at tp = 2: finite differences through the
// vocab-parallel ends, the model-parallel RNG, column-parallel gather_output.
// ---------------------------------------------------------------------------

// Runs fn(r, rank) on two ranks (threads) of one tp group over comm/local;
// returns each rank's error ("" = none).
std::vector<std::string> run_two_ranks(const std::function<void(int, HarnessRank&)>& fn) {
  return loom::harness::run_tp_ranks(registry(), 2, fn);
}

// Central differences of the whole (two-rank) objective w.r.t. coordinates of the
// FULL parameters, against the analytic gradient of the rank holding each one.
// Both ranks perturb in lockstep (the objective has collectives): the owner of a
// partitioned coordinate perturbs its slice, a duplicated one is perturbed on both.
TEST(Layers, VocabParallelEmbeddingAndCrossEntropyMatchFiniteDifferencesAtTp2) {
  constexpr int kTp = 2;
  for (const std::string name : {"embedding", "lm_head"}) {
    SCOPED_TRACE(name);
    auto dims = make_dims();  // vocab 37 padded to 40: rank 1 holds ids 20..36 and 3 padded rows
    Rank serial;
    TestLayer full(serial, name, dims);
    std::mt19937 rng(40);
    full.randomize(rng, 0.5f);
    Batch b = make_batch(rng);
    b.tokens[0] = 3;
    b.tokens[1] = static_cast<int32_t>(kVocab) - 1;  // both slices are looked up
    b.targets[0] = 2;
    b.targets[1] = static_cast<int32_t>(kVocab) - 2;  // targets in both slices
    b.targets[2] = -1;                               // an ignored token
    // Coordinates of the full parameters: 10 random ones each, and for the word
    // table rows the batch touches (a random row is mostly untouched: zero gradient).
    std::vector<std::pair<size_t, size_t>> coords;
    for (size_t k = 0; k < full.params().size(); ++k) {
      const Param& p = full.params()[k];
      std::uniform_int_distribution<size_t> pick(0, p.value.size() - 1);
      for (int i = 0; i < 10; ++i) coords.emplace_back(k, pick(rng));
      if (p.name == "word.weight")
        for (int32_t row : {b.tokens[0], b.tokens[1], b.targets[0], b.targets[1]})
          coords.emplace_back(k, static_cast<size_t>(row) * kHidden + static_cast<size_t>(row % kHidden));
    }
    constexpr float h = 1e-2f;
    std::vector<std::vector<std::vector<float>>> grads(kTp);  // rank -> param -> local grad
    std::vector<std::vector<std::vector<size_t>>> index(kTp); // rank -> param -> full index of each local element
    std::vector<std::vector<double>> lp(kTp), lm(kTp);
    auto errors = run_two_ranks([&](int r, HarnessRank& rank) {
      TestLayer layer(rank, name, dims);
      auto& idx = index[static_cast<size_t>(r)];
      for (size_t i = 0; i < layer.params().size(); ++i) {
        Param& p = layer.params()[i];
        std::vector<size_t> iota(full.params()[i].value.size());
        for (size_t j = 0; j < iota.size(); ++j) iota[j] = j;
        idx.push_back(slice(p, iota, kTp, r));
        const std::vector<float> mine = slice(p, full.params()[i].value, kTp, r);
        std::copy(mine.begin(), mine.end(), p.value.begin());
      }
      layer.zero_grads();
      layer.forward(b, 0);
      layer.backward(b, 0);
      for (Param& p : layer.params()) grads[static_cast<size_t>(r)].push_back(p.grad);
      for (const auto& [k, j] : coords) {
        const auto& map = idx[k];
        const auto it = std::find(map.begin(), map.end(), j);
        float* v = it == map.end() ? nullptr : &layer.params()[k].value[static_cast<size_t>(it - map.begin())];
        const float saved = v ? *v : 0.0f;
        if (v) *v = saved + h;
        lp[static_cast<size_t>(r)].push_back(layer.objective(b));
        if (v) *v = saved - h;
        lm[static_cast<size_t>(r)].push_back(layer.objective(b));
        if (v) *v = saved;
      }
    });
    ASSERT_EQ(errors[0], "");
    ASSERT_EQ(errors[1], "");
    int owned_by_1 = 0;
    for (size_t c = 0; c < coords.size(); ++c) {
      const auto [k, j] = coords[c];
      const Param& p = full.params()[k];
      // Both ranks see the same objective (it is reduced over tp).
      EXPECT_NEAR(lp[0][c], lp[1][c], 1e-5 * (1.0 + std::fabs(lp[0][c])));
      const double num = (lp[0][c] - lm[0][c]) / (2.0 * static_cast<double>(h));
      for (int r = 0; r < kTp; ++r) {
        const auto& map = index[static_cast<size_t>(r)][k];
        const auto it = std::find(map.begin(), map.end(), j);
        if (it == map.end()) continue;
        if (p.partition_dim >= 0 && r == 1) ++owned_by_1;
        const double ana = grads[static_cast<size_t>(r)][k][static_cast<size_t>(it - map.begin())];
        EXPECT_NEAR(ana, num, 2e-2 * std::max(std::fabs(num), std::fabs(ana)) + 3e-3)
            << p.name << "[" << j << "] on tp rank " << r;
      }
    }
    EXPECT_GT(owned_by_1, 0);  // rank 1's slice was checked too
  }
}

// The model-parallel RNG: outside TP regions every tp rank draws the same mask
// (under sequence parallelism each rank its shard's block of the one stream, so
// the shards put together are the tp = 1 mask); inside a TP region each rank
// has a stream of its own.
TEST(Layers, ModelParallelRngDuplicatedRegionsAgreeParallelRegionsDiffer) {
  constexpr int64_t n = 4096;
  std::vector<float> ones(n, 1.0f);
  auto draw = [&](loom::TensorParallel& tp, int32_t region, int64_t count) {
    std::vector<uint8_t> mask(static_cast<size_t>(count), 7);
    std::vector<float> y(static_cast<size_t>(count));
    tp.dropout_forward({.region = region, .n = count, .x = ones.data(), .out = y.data(), .mask = mask.data(),
                        .p = 0.5f, .seed = 99, .microbatch = 3, .stream = 0});
    return mask;
  };
  std::vector<uint8_t> serial_dup, serial_par;
  {
    Rank one;
    loom::TensorParallel tp(&one.rt(), one.rt().group_or_self("tp").raw(), false, "blocks.0.mlp");
    serial_dup = draw(tp, LOOM_TP_RNG_DUPLICATED, n);
    serial_par = draw(tp, LOOM_TP_RNG_PARALLEL, n);
  }
  std::vector<std::vector<uint8_t>> dup(2), par(2), sp_dup(2);
  auto errors = run_two_ranks([&](int r, HarnessRank& rank) {
    loom::TensorParallel tp(&rank.rt(), rank.rt().group_or_self("tp").raw(), false, "blocks.0.mlp");
    dup[static_cast<size_t>(r)] = draw(tp, LOOM_TP_RNG_DUPLICATED, n);
    par[static_cast<size_t>(r)] = draw(tp, LOOM_TP_RNG_PARALLEL, n);
    loom::TensorParallel sp(&rank.rt(), rank.rt().group_or_self("tp").raw(), true, "blocks.0.mlp");
    sp_dup[static_cast<size_t>(r)] = draw(sp, LOOM_TP_RNG_DUPLICATED, n / 2);
  });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  int64_t kept = 0, differ = 0;
  for (int64_t i = 0; i < n; ++i) {
    kept += dup[0][i];
    differ += par[0][i] != par[1][i] ? 1 : 0;
  }
  EXPECT_GT(kept, n / 3);  // a real mask, about half kept
  EXPECT_LT(kept, 2 * n / 3);
  EXPECT_EQ(dup[0], dup[1]);
  EXPECT_EQ(dup[0], serial_dup);
  EXPECT_GT(differ, n / 4);  // independent streams: about half the positions differ
  EXPECT_NE(par[0], dup[0]);
  std::vector<uint8_t> joined = sp_dup[0];
  joined.insert(joined.end(), sp_dup[1].begin(), sp_dup[1].end());
  EXPECT_EQ(joined, serial_dup);
}

// Column-parallel linear with gather_output: each rank's output columns gathered
// in rank order equal the serial GEMM; backward takes this rank's columns of the
// whole output gradient.
TEST(Layers, ColumnParallelLinearGatherOutputMatchesSerial) {
  constexpr int64_t R = 6, in = 5, out = 8, local = out / 2;
  std::mt19937 rng(41);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::vector<float> x(R * in), w(in * out), bias(out), dy(R * out);
  for (auto* v : {&x, &w, &bias, &dy})
    for (float& e : *v) e = n01(rng);
  std::vector<std::vector<float>> y(2), dx(2), dw(2), db(2);
  auto errors = run_two_ranks([&](int r, HarnessRank& rank) {
    loom::TensorParallel tp(&rank.rt(), rank.rt().group_or_self("tp").raw(), false, "col");
    std::vector<float> wl(in * local), bl(bias.begin() + r * local, bias.begin() + (r + 1) * local);
    for (int64_t i = 0; i < in; ++i)
      for (int64_t c = 0; c < local; ++c) wl[i * local + c] = w[i * out + r * local + c];
    auto& yr = y[static_cast<size_t>(r)];
    yr.assign(R * out, -1.0f);
    tp.column_parallel_linear_forward({.rows = R, .in = in, .out = local, .x = x.data(), .weight = wl.data(),
                                       .bias = bl.data(), .y = yr.data(), .gather_output = 1});
    dx[r].assign(R * in, 5.0f);
    dw[r].assign(in * local, 0.0f);
    db[r].assign(local, 0.0f);
    tp.column_parallel_linear_backward({.rows = R, .in = in, .out = local, .x = x.data(), .weight = wl.data(),
                                        .dy = dy.data(), .dx = dx[r].data(), .dweight = dw[r].data(),
                                        .dbias = db[r].data(), .gather_output = 1});
  });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    for (int64_t i = 0; i < R; ++i)
      for (int64_t o = 0; o < out; ++o) {
        double want = bias[o];
        for (int64_t k = 0; k < in; ++k) want += double(x[i * in + k]) * w[k * out + o];
        EXPECT_NEAR(y[r][i * out + o], want, 1e-5) << i << "," << o;
      }
    for (int64_t i = 0; i < R; ++i)
      for (int64_t k = 0; k < in; ++k) {  // dx = dy W^T over all columns (summed over tp)
        double want = 0;
        for (int64_t o = 0; o < out; ++o) want += double(dy[i * out + o]) * w[k * out + o];
        EXPECT_NEAR(dx[r][i * in + k], want, 1e-5);
      }
    for (int64_t k = 0; k < in; ++k)
      for (int64_t c = 0; c < local; ++c) {
        double want = 0;
        for (int64_t i = 0; i < R; ++i) want += double(x[i * in + k]) * dy[i * out + r * local + c];
        EXPECT_NEAR(dw[r][k * local + c], want, 1e-5);
      }
    for (int64_t c = 0; c < local; ++c) {
      double want = 0;
      for (int64_t i = 0; i < R; ++i) want += dy[i * out + r * local + c];
      EXPECT_NEAR(db[r][c], want, 1e-5);
    }
  }
}

// ABI 1.11's activation on the linear calls: a column-parallel forward ends in a GeLU
// (pre_activation keeps its input) and a row-parallel backward begins with its
// gradient, on each rank's own columns / rows; the device fuses both into its GEMMs.
TEST(Layers, LinearCallsApplyTheGeluAndItsGradientOnEachRanksShard) {
  constexpr int64_t R = 5, in = 6, out = 8, local = out / 2;
  auto gelu = [](double v) { return 0.5 * v * (1.0 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v))); };
  auto dgelu = [](double v) {
    const double t = std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v));
    return 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * v * v);
  };
  std::mt19937 rng(43);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::vector<float> x(R * in), w(in * out), bias(out), w2(out * in), dy2(R * in);
  for (auto* v : {&x, &w, &bias, &w2, &dy2})
    for (float& e : *v) e = n01(rng);
  std::vector<std::vector<float>> y(2), pre(2), dh(2);
  std::vector<std::string> refusals(2);
  auto errors = run_two_ranks([&](int r, HarnessRank& rank) {
    loom::TensorParallel tp(&rank.rt(), rank.rt().group_or_self("tp").raw(), false, "mlp");
    ASSERT_NE(tp.features() & LOOM_TP_ACTIVATION, 0u);
    std::vector<float> wl(in * local), bl(bias.begin() + r * local, bias.begin() + (r + 1) * local), w2l(local * in);
    for (int64_t i = 0; i < in; ++i)
      for (int64_t c = 0; c < local; ++c) wl[i * local + c] = w[i * out + r * local + c];
    for (int64_t c = 0; c < local; ++c)
      for (int64_t i = 0; i < in; ++i) w2l[c * in + i] = w2[(r * local + c) * in + i];
    auto& yr = y[static_cast<size_t>(r)];
    auto& pr = pre[static_cast<size_t>(r)];
    yr.assign(R * local, -1.0f);
    pr.assign(R * local, -1.0f);
    tp.column_parallel_linear_forward({.rows = R, .in = in, .out = local, .x = x.data(), .weight = wl.data(),
                                       .bias = bl.data(), .y = yr.data(), .pre_activation = pr.data(),
                                       .activation = LOOM_TP_ACTIVATION_GELU});
    // fc2-like row-parallel backward from this rank's activation.
    std::vector<float> dw2(local * in, 0.0f);
    dh[r].assign(R * local, 7.0f);
    tp.row_parallel_linear_backward({.rows = R, .in = local, .out = in, .x = yr.data(), .weight = w2l.data(),
                                     .dy = dy2.data(), .dx = dh[r].data(), .dweight = dw2.data(),
                                     .pre_activation = pr.data(), .activation = LOOM_TP_ACTIVATION_GELU});
    try {
      tp.column_parallel_linear_forward({.rows = R, .in = in, .out = local, .x = x.data(), .weight = wl.data(),
                                         .y = yr.data(), .gather_output = 1, .pre_activation = pr.data(),
                                         .activation = LOOM_TP_ACTIVATION_GELU});
    } catch (const loom::Error& e) {
      refusals[static_cast<size_t>(r)] = e.what();
    }
  });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_NE(refusals[r].find("cannot gather its output"), std::string::npos) << refusals[r];
    for (int64_t i = 0; i < R; ++i)
      for (int64_t c = 0; c < local; ++c) {
        const int64_t o = r * local + c;
        double h = bias[o];
        for (int64_t k = 0; k < in; ++k) h += double(x[i * in + k]) * w[k * out + o];
        EXPECT_NEAR(pre[r][i * local + c], h, 1e-5) << i << "," << c;
        EXPECT_NEAR(y[r][i * local + c], gelu(h), 1e-5) << i << "," << c;
        double dact = 0;
        for (int64_t k = 0; k < in; ++k) dact += double(dy2[i * in + k]) * w2[o * in + k];
        EXPECT_NEAR(dh[r][i * local + c], dact * dgelu(pre[r][i * local + c]), 1e-5) << i << "," << c;
      }
  }
}

// Gradient-accumulation fusion (ABI 1.2) is used only when the run allows it and
// both the device and the tensor-parallel service say they honour grad_fp32; a
// 1.1 device or service (tables that end before `features`) gets the bf16 shadows
// and commit() adds them (cast to fp32) to the real gradients.
TEST(Layers, GradShadowFusesOnlyWithA12DeviceAndService) {
  using loom::layers::Dtypes;
  using loom::layers::GradShadow;
  Rank rank;
  const loom::Device dev = rank.rt().dev();
  loom_device_api v1_1 = *dev.api();
  v1_1.struct_size = static_cast<uint32_t>(offsetof(loom_device_api, copy_2d));
  const loom::Device old_dev(&v1_1, dev.raw(), nullptr);
  const Dtypes mixed{LOOM_DTYPE_BF16, LOOM_DTYPE_F32};
  std::vector<float> grad = {1.0f, 2.0f, 3.0f};
  const std::vector<void*> grads = {grad.data()};
  const uint64_t tp12 = LOOM_TP_GRAD_FP32;

  struct Case {
    const char* what;
    const loom::Device* device;
    uint64_t tp_features;
    bool fusion;
    Dtypes dt;
    bool fused;
  };
  for (const Case& c : {Case{"1.2 device and service", &dev, tp12, true, mixed, true},
                        Case{"fusion off in the manifest", &dev, tp12, false, mixed, false},
                        Case{"1.1 service", &dev, 0, true, mixed, false},
                        Case{"1.1 device", &old_dev, tp12, true, mixed, false},
                        Case{"fp32 parameters", &dev, tp12, true, Dtypes{}, false},
                        Case{"fp32 parameters, bf16 gradients", &dev, tp12, true,
                             Dtypes{LOOM_DTYPE_F32, LOOM_DTYPE_BF16}, false}}) {
    SCOPED_TRACE(c.what);
    GradShadow gs(&rank.rt(), *c.device, c.dt, grads, {3}, c.tp_features, c.fusion);
    EXPECT_EQ(gs.grad_fp32(), c.fused ? 1 : 0);
    const bool in_place = c.fused || c.dt.act == c.dt.grad;
    EXPECT_EQ(gs[0] == grad.data(), in_place);
    EXPECT_EQ(gs.grad_dtype(), in_place ? c.dt.grad : c.dt.act);
    if (in_place || c.dt.grad != LOOM_DTYPE_F32) continue;
    // The shadow starts at zero; 0.5 in bf16 added by commit(): grads += 0.5.
    const uint16_t half = 0x3f00;
    std::vector<uint16_t> bf(3, half);
    dev.copy(gs[0], bf.data(), sizeof(uint16_t) * 3, LOOM_COPY_HOST_TO_DEVICE);
    gs.commit();
    dev.synchronize();
    EXPECT_EQ(grad, (std::vector<float>{1.5f, 2.5f, 3.5f}));
    grad = {1.0f, 2.0f, 3.0f};
  }
}

// parallel/tensor asks for grad_fp32 only of a device that says it honours it: on a
// 1.1 device (its table ends before `features`) the embedding backward with
// grad_fp32 is refused with a message, not run as a bf16 scatter into fp32 memory.
TEST(Layers, TensorParallelRefusesGradFp32OnA11Device) {
  registry();
  loom_device_api v1_1 = *registry().get("device", "cpu").device();
  v1_1.struct_size = static_cast<uint32_t>(offsetof(loom_device_api, copy_2d));
  Rank rank(0, nullptr, &v1_1);
  loom_group alone = loom::make<loom_group>();
  alone.size = 1;
  loom::TensorParallel tp(&rank.rt(), alone, false, "old-device");
  EXPECT_NE(tp.features() & LOOM_TP_GRAD_FP32, 0u);  // the service could, the device cannot
  std::vector<int32_t> ids(4, 1);
  std::vector<uint16_t> dout(4 * 8, 0);
  std::vector<float> dtable(8 * 8, 0.0f);
  try {
    tp.vocab_parallel_embedding_backward({.rows = 4, .dim = 8, .padded_vocab = 8, .ids = ids.data(),
                                          .dout = dout.data(), .dtable = dtable.data(), .dtype = LOOM_DTYPE_BF16,
                                          .grad_fp32 = 1});
    ADD_FAILURE() << "grad_fp32 on a 1.1 device was accepted";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("LOOM_DEVICE_GRAD_FP32"), std::string::npos) << e.what();
  }
  EXPECT_EQ(dtable, std::vector<float>(8 * 8, 0.0f));
}

}  // namespace

namespace {

// ---------------------------------------------------------------------------
// layer/moe: a reference forward in double, finite differences (where the top-k
// choice is smooth, and across a routing that holds), one expert = the MLP, and
// tp = 2 = tp = 1.
// ---------------------------------------------------------------------------

// The router's score function, gate scaling and group-limited routing (their
// defaults left unset).
void set_router_options(toml::table& t, const std::string& score, double scaling, int64_t groups, int64_t group_topk) {
  if (score != "softmax") t.insert_or_assign("score_function", score);
  if (scaling > 0) t.insert_or_assign("topk_scaling_factor", scaling);
  if (groups > 0) {
    t.insert_or_assign("num_groups", groups);
    t.insert_or_assign("group_topk", group_topk);
  }
}

toml::table moe_options(int64_t experts, int64_t top_k, double aux_coeff = 0.01, bool pre_softmax = false,
                        double dropout = 0.0, double z_coeff = 0.0, double capacity_factor = 0.0,
                        const std::string& drop_policy = "probs", int64_t shared_ffn = 0, bool shared_gate = false) {
  toml::table t;
  if (shared_ffn > 0) t.insert("shared_expert_ffn_hidden_size", shared_ffn);
  if (shared_gate) t.insert("shared_expert_gate", true);
  if (z_coeff > 0) t.insert("z_loss_coeff", z_coeff);
  if (capacity_factor > 0) {
    t.insert("capacity_factor", capacity_factor);
    t.insert("drop_policy", drop_policy);
  }
  t.insert("num_experts", experts);
  t.insert("top_k", top_k);
  t.insert("aux_loss_coeff", aux_coeff);
  t.insert("pre_softmax", pre_softmax);
  if (dropout > 0) t.insert("dropout", dropout);
  return t;
}

// Central differences at h and h/2 of a piecewise-smooth objective (the top-k
// choice jumps): a coordinate whose two estimates disagree has a routing change
// within h and is skipped; the rest must match the analytic gradient, and at most
// a quarter may be skipped.
void fd_check_piecewise(std::vector<float>& v, const std::vector<float>& analytic,
                        const std::function<double()>& objective, const std::string& what, std::mt19937& rng) {
  ASSERT_EQ(v.size(), analytic.size()) << what;
  std::set<size_t> coords;
  std::uniform_int_distribution<size_t> pick(0, v.size() - 1);
  for (int i = 0; i < 16 && coords.size() < v.size(); ++i) coords.insert(pick(rng));
  double max_abs = 0.0;
  for (float g : analytic) max_abs = std::max(max_abs, static_cast<double>(std::fabs(g)));
  EXPECT_GT(max_abs, 1e-4) << what << ": the analytic gradient is all zeros";
  auto central = [&](size_t j, float h) {
    const float saved = v[j];
    v[j] = saved + h;
    const double lp = objective();
    v[j] = saved - h;
    const double lm = objective();
    v[j] = saved;
    return (lp - lm) / (2.0 * static_cast<double>(h));
  };
  size_t skipped = 0;
  for (size_t j : coords) {
    const double coarse = central(j, 2e-3f), fine = central(j, 1e-3f);
    const double tol = 2e-2 * std::max(std::fabs(fine), std::fabs(static_cast<double>(analytic[j]))) + 3e-3;
    if (std::fabs(coarse - fine) > tol) {
      ++skipped;
      continue;
    }
    EXPECT_NEAR(analytic[j], fine, tol) << what << "[" << j << "]";
  }
  EXPECT_LE(skipped * 4, coords.size()) << what << ": routing changed within h at too many coordinates";
}

// A MoE layer of `opts` with its auxiliary losses in the objective (weight 0.75):
// every parameter's and the input's gradient against piecewise finite differences.
void check_moe_gradients(toml::table opts, unsigned seed) {
  Rank rank;
  auto dims = make_dims();
  TestLayer layer(rank, "moe", dims, &opts);
  layer.aux_weight = 0.75;
  std::mt19937 rng(seed);
  layer.randomize(rng);
  Batch b = make_batch(rng);
  layer.zero_grads();
  layer.forward(b, 0, true, 9);
  const std::vector<float> dx = layer.backward(b, 0);
  for (Param& p : layer.params()) {
    const std::vector<float> analytic = p.grad;
    fd_check_piecewise(p.value, analytic, [&] { return layer.objective(b, 9); }, p.name, rng);
  }
  fd_check_piecewise(b.x, dx, [&] { return layer.objective(b, 9); }, "input", rng);
}

// The expert bias after end_step (ABI 1.23): a forward without its backward (an
// evaluation, recomputation's first forward) counts nothing; a trained microbatch
// moves each bias by the rate (0.05) towards the mean of the experts' kept slots
// (`kept`, the reference's: up under it, down over it, Megatron's
// get_updated_expert_bias).
template <class Slots>
void expect_expert_bias_update(TestLayer& layer, Rank& rank, const Batch& b, const std::vector<Slots>& kept,
                               bool capped) {
  const loom_layer_state_decl* decls = nullptr;
  size_t count = 0;
  ASSERT_EQ(layer.api()->state(layer.raw(), &decls, &count), nullptr);
  ASSERT_EQ(count, 2u);
  ASSERT_STREQ(decls[1].name, "router.expert_load");
  float* bias = decls[0].data;
  const float* load = decls[1].data;
  const std::vector<float> before(bias, bias + decls[0].count);
  loom_layer_step_end_args a = loom::make<loom_layer_step_end_args>();
  a.step = 1;
  a.microbatches = 1;
  auto end_step = [&] { ASSERT_EQ(layer.api()->end_step(layer.raw(), &rank.rt(), &a), nullptr); };
  layer.forward(b, 0, true, 0);
  layer.api()->release(layer.raw(), 0);
  end_step();
  EXPECT_EQ(std::vector<float>(bias, bias + decls[0].count), before) << "a forward without its backward counted";
  EXPECT_EQ(std::vector<float>(load, load + decls[1].count), std::vector<float>(kept.size(), 0.0f));
  layer.forward(b, 0, true, 0);
  layer.backward(b, 0);
  end_step();
  double mean = 0;
  for (const Slots& sl : kept) mean += static_cast<double>(sl.size()) / static_cast<double>(kept.size());
  int moved_up = 0, moved_down = 0;
  for (size_t e = 0; e < kept.size(); ++e) {
    const double n = static_cast<double>(kept[e].size());
    const float step = mean > n ? 0.05f : mean < n ? -0.05f : 0.0f;
    EXPECT_EQ(bias[e], before[e] + step) << "expert " << e << " kept " << n << " slots, the mean is " << mean;
    EXPECT_EQ(load[e], static_cast<float>(n)) << "expert " << e << "'s load";
    moved_up += step > 0;
    moved_down += step < 0;
  }
  if (!capped) {  // (with a capacity every expert may keep as many)
    EXPECT_GT(moved_up, 0) << "some expert is under the mean in this case";
    EXPECT_GT(moved_down, 0) << "some expert is over the mean in this case";
  }
}

// The reference also applies Megatron's expert capacity: ceil(T k / E * c) slots
// per expert, kept by largest gate (ties: lower token) or by position; dropped
// slots add nothing and the load-balancing term counts the routing before the drop.
TEST(Layers, MoeForwardMatchesReference) {
  struct Variant {
    bool pre_softmax;
    double capacity_factor;
    std::string policy;
    int64_t shared;  // the shared expert's width (0 = none)
    bool gate = false;  // the shared expert's output times sigmoid(ln . w) per token
    std::string score = "softmax";
    double scaling = 0.0;  // topk_scaling_factor
    int64_t experts = 4, top_k = 2, groups = 0, group_topk = 0;
    bool per_sequence = false;  // load_balancing_type = "seq_aux_loss"
    double bias = 0.0;  // expert_bias: expert e's routing bias is bias * ((e % 3) - 1) (0 = off)
  };
  for (const Variant& v :
       {Variant{false, 0.0, "probs", 0}, Variant{true, 0.0, "probs", 0}, Variant{false, 0.5, "probs", 0},
        Variant{true, 0.5, "position", 0}, Variant{false, 0.0, "probs", 12}, Variant{false, 0.5, "probs", 12},
        Variant{false, 0.0, "probs", 12, true}, Variant{false, 0.0, "probs", 0, false, "sigmoid", 2.5},
        Variant{false, 0.0, "probs", 0, false, "sigmoid", 0.0, 4, 1},
        Variant{false, 0.5, "probs", 0, false, "sigmoid", 1.5, 8, 4, 4, 2},
        Variant{false, 0.0, "probs", 0, false, "softmax", 0.0, 8, 2, 4, 1},
        Variant{true, 0.0, "probs", 0, false, "softmax", 2.0, 6, 4, 3, 2},
        // A group ranked by its best 2 of 4 (DeepSeek-V3's shape: the best 2 of 32), and
        // by its best 1 of 2 (top_k 3 over 2 groups: 3 / 2 floors).
        Variant{false, 0.0, "probs", 0, false, "sigmoid", 2.5, 16, 4, 4, 2},
        Variant{false, 0.0, "probs", 0, false, "softmax", 0.0, 8, 3, 4, 2},
        // The load-balancing term of each sequence (kBatch of them), averaged.
        Variant{false, 0.0, "probs", 0, false, "softmax", 0.0, 4, 2, 0, 0, true},
        Variant{false, 0.5, "probs", 0, false, "sigmoid", 2.5, 8, 4, 4, 2, true},
        // DeepSeek-V3's expert bias: in the choice (groups included), not in the gates
        // nor in the load-balancing term's top-k.
        Variant{false, 0.0, "probs", 0, false, "sigmoid", 0.0, 6, 2, 0, 0, false, 0.2},
        Variant{false, 0.5, "probs", 0, false, "sigmoid", 2.5, 8, 4, 4, 2, false, 0.2}}) {
    const bool pre_softmax = v.pre_softmax, sigmoid = v.score == "sigmoid";
    const int64_t kExperts = v.experts, kTopK = v.top_k;
    SCOPED_TRACE(std::string(pre_softmax ? "pre_softmax" : "softmax over the chosen") + ", capacity factor " +
                 std::to_string(v.capacity_factor) + " by " + v.policy + ", shared expert " +
                 std::to_string(v.shared) + (v.gate ? " gated" : "") + ", " + v.score + " scaled by " +
                 std::to_string(v.scaling) + ", top " + std::to_string(kTopK) + " of " + std::to_string(kExperts) +
                 " in " + std::to_string(v.groups) + " groups, " + std::to_string(v.group_topk) + " taken" +
                 (v.per_sequence ? ", balanced per sequence" : "") +
                 (v.bias > 0 ? ", expert bias " + std::to_string(v.bias) : ""));
    Rank rank;
    auto dims = make_dims();
    const double coeff = 0.3, z_coeff = 0.05;
    toml::table opts =
        moe_options(kExperts, kTopK, coeff, pre_softmax, 0.0, z_coeff, v.capacity_factor, v.policy, v.shared, v.gate);
    set_router_options(opts, v.score, v.scaling, v.groups, v.group_topk);
    if (v.per_sequence) opts.insert_or_assign("load_balancing_type", "seq_aux_loss");
    if (v.bias > 0) {
      opts.insert_or_assign("expert_bias", true);
      opts.insert_or_assign("expert_bias_update_rate", 0.05);
    }
    TestLayer layer(rank, "moe", dims, &opts);
    std::mt19937 rng(41);
    layer.randomize(rng);
    std::vector<double> expert_bias(static_cast<size_t>(kExperts), 0.0);
    if (v.bias > 0) {  // set through the layer's state (ABI 1.23), as a checkpoint restores it
      const loom_layer_state_decl* decls = nullptr;
      size_t count = 0;
      ASSERT_EQ(layer.api()->state(layer.raw(), &decls, &count), nullptr);
      ASSERT_EQ(count, 2u);
      ASSERT_STREQ(decls[0].name, "router.expert_bias");
      ASSERT_EQ(decls[0].count, kExperts);
      for (int64_t e = 0; e < kExperts; ++e)
        expert_bias[e] = decls[0].data[e] = static_cast<float>(v.bias * static_cast<double>((e % 3) - 1));
    }
    Batch b = make_batch(rng);
    std::vector<float> y;
    layer.forward(b, 0, true, 0, &y);
    layer.api()->release(layer.raw(), 0);

    const Mat ln = ref_layernorm(b.x, layer.param("ln.weight").value, layer.param("ln.bias").value, kT, kHidden);
    const std::vector<float> no_bias(kExperts, 0.0f);
    const Mat logits = ref_linear(ln, layer.param("router.weight").value, no_bias, kT, kHidden, kExperts);
    const auto& w1 = layer.param("experts.fc1.weight").value;
    const auto& b1 = layer.param("experts.fc1.bias").value;
    const auto& w2 = layer.param("experts.fc2.weight").value;
    const auto& b2 = layer.param("experts.fc2.bias").value;
    Mat out(b.x.begin(), b.x.end());  // the residual
    // Per load-balancing group: each sequence (token t's is t % kBatch), or the microbatch.
    const int64_t balance_groups = v.per_sequence ? kBatch : 1;
    std::vector<std::vector<double>> routed(balance_groups, std::vector<double>(kExperts, 0.0)),
        prob_sum(balance_groups, std::vector<double>(kExperts, 0.0));
    double z = 0;
    struct Slot {
      int64_t t, e;
      double gate;
    };
    // The top n of `among` by `key`, ties to the lower index.
    auto top = [](std::vector<int64_t> among, int64_t n, const std::vector<double>& key) {
      std::stable_sort(among.begin(), among.end(), [&](int64_t a, int64_t c) { return key[a] > key[c]; });
      among.resize(static_cast<size_t>(n));
      return among;
    };
    std::vector<int64_t> every(kExperts);
    std::iota(every.begin(), every.end(), 0);
    std::vector<std::vector<Slot>> slots_of(kExperts);  // in token order
    int64_t group_limited = 0;  // tokens whose top-k over all experts the groups changed
    int64_t biased = 0;         // tokens whose experts are not the top-k of their scores
    for (int64_t t = 0; t < kT; ++t) {
      std::vector<double> p(kExperts), lb(kExperts);
      double mx = -1e300, sum = 0;
      for (int64_t e = 0; e < kExperts; ++e) mx = std::max(mx, logits[t * kExperts + e]);
      for (int64_t e = 0; e < kExperts; ++e) sum += (p[e] = std::exp(logits[t * kExperts + e] - mx));
      z += std::pow(mx + std::log(sum), 2) / kT;
      for (int64_t e = 0; e < kExperts; ++e) p[e] /= sum;
      std::vector<double> score = p;
      if (sigmoid)
        for (int64_t e = 0; e < kExperts; ++e) score[e] = 1.0 / (1.0 + std::exp(-logits[t * kExperts + e]));
      const double score_sum = std::accumulate(score.begin(), score.end(), 0.0);
      const int64_t g = t % balance_groups;
      for (int64_t e = 0; e < kExperts; ++e) prob_sum[g][e] += (lb[e] = sigmoid ? score[e] / score_sum : p[e]);
      for (int64_t e : top(every, kTopK, lb)) routed[g][e] += 1;
      // What top-k compares (Megatron's topk_routing_with_score_function): the
      // sigmoids, the probs with pre_softmax, else the logits.
      std::vector<double> key = score;
      if (!sigmoid && !pre_softmax) key.assign(logits.begin() + t * kExperts, logits.begin() + (t + 1) * kExperts);
      for (int64_t e = 0; e < kExperts; ++e) key[e] += expert_bias[e];
      std::vector<int64_t> candidates = every;
      if (v.groups > 0) {  // the group_topk groups whose best top_k / group_topk keys sum highest
        const int64_t per = kExperts / v.groups;
        std::vector<double> group_score(v.groups);
        for (int64_t g = 0; g < v.groups; ++g) {
          std::vector<double> members(key.begin() + g * per, key.begin() + (g + 1) * per);
          std::sort(members.rbegin(), members.rend());
          group_score[g] = std::accumulate(members.begin(), members.begin() + kTopK / v.group_topk, 0.0);
        }
        std::vector<int64_t> groups(v.groups);
        std::iota(groups.begin(), groups.end(), 0);
        candidates.clear();
        for (int64_t g : top(groups, v.group_topk, group_score))
          for (int64_t e = g * per; e < (g + 1) * per; ++e) candidates.push_back(e);
        std::sort(candidates.begin(), candidates.end());
      }
      const std::vector<int64_t> chosen_experts = top(candidates, kTopK, key);
      std::vector<int64_t> a = chosen_experts, c = top(every, kTopK, key), unbiased = top(every, kTopK, score);
      std::sort(a.begin(), a.end());
      std::sort(c.begin(), c.end());
      std::sort(unbiased.begin(), unbiased.end());
      group_limited += a != c;
      biased += a != unbiased;
      double chosen = 0;
      for (int64_t e : chosen_experts) chosen += score[e];
      for (int64_t e : chosen_experts) {
        const bool renormalise = sigmoid ? kTopK > 1 : !pre_softmax;
        const double gate = (renormalise ? score[e] / chosen : score[e]) * (v.scaling > 0 ? v.scaling : 1.0);
        slots_of[e].push_back({t, e, gate});
      }
    }
    if (v.groups > 0) {
      EXPECT_GT(group_limited, 0) << "the groups change some token's experts in this case";
    }
    if (v.bias > 0) {
      EXPECT_GT(biased, 0) << "the bias changes some token's experts in this case";
    }
    const int64_t capacity =
        v.capacity_factor > 0 ? static_cast<int64_t>(std::ceil(double(kT * kTopK) / kExperts * v.capacity_factor)) : 0;
    int64_t dropped = 0;
    for (std::vector<Slot>& sl : slots_of) {
      if (capacity == 0 || static_cast<int64_t>(sl.size()) <= capacity) continue;
      if (v.policy == "probs")
        std::stable_sort(sl.begin(), sl.end(), [](const Slot& a, const Slot& c) { return a.gate > c.gate; });
      dropped += static_cast<int64_t>(sl.size()) - capacity;
      sl.resize(static_cast<size_t>(capacity));
    }
    if (v.capacity_factor > 0) {
      EXPECT_GT(dropped, 0) << "the capacity drops slots in this case";
    }
    for (const std::vector<Slot>& sl : slots_of)
      for (const Slot& slot : sl) {
        const int64_t t = slot.t, e = slot.e;
        // expert e on token t: fc2(gelu(fc1 ln_t))
        std::vector<double> h(kFfn);
        for (int64_t f = 0; f < kFfn; ++f) {
          double val = b1[e * kFfn + f];
          for (int64_t i = 0; i < kHidden; ++i) val += ln[t * kHidden + i] * w1[(e * kHidden + i) * kFfn + f];
          h[f] = 0.5 * val * (1.0 + std::tanh(0.7978845608028654 * (val + 0.044715 * val * val * val)));
        }
        for (int64_t o = 0; o < kHidden; ++o) {
          double val = b2[e * kHidden + o];
          for (int64_t f = 0; f < kFfn; ++f) val += h[f] * w2[(e * kFfn + f) * kHidden + o];
          out[t * kHidden + o] += slot.gate * val;
        }
      }
    if (v.shared > 0) {  // every token through the shared expert, gated by sigmoid(ln . w) or not
      const auto& s1 = layer.param("shared.fc1.weight").value;
      const auto& c1 = layer.param("shared.fc1.bias").value;
      const auto& s2 = layer.param("shared.fc2.weight").value;
      const auto& c2 = layer.param("shared.fc2.bias").value;
      for (int64_t t = 0; t < kT; ++t) {
        std::vector<double> h(static_cast<size_t>(v.shared));
        for (int64_t f = 0; f < v.shared; ++f) {
          double val = c1[f];
          for (int64_t i = 0; i < kHidden; ++i) val += ln[t * kHidden + i] * s1[i * v.shared + f];
          h[f] = 0.5 * val * (1.0 + std::tanh(0.7978845608028654 * (val + 0.044715 * val * val * val)));
        }
        double gate = 1.0;
        if (v.gate) {
          const auto& wg = layer.param("shared.gate.weight").value;
          double logit = 0;
          for (int64_t i = 0; i < kHidden; ++i) logit += ln[t * kHidden + i] * wg[i];
          gate = 1.0 / (1.0 + std::exp(-logit));
        }
        for (int64_t o = 0; o < kHidden; ++o) {
          double val = c2[o];
          for (int64_t f = 0; f < v.shared; ++f) val += h[f] * s2[f * kHidden + o];
          out[t * kHidden + o] += gate * val;
        }
      }
    }
    expect_close(y, out, 1e-5, "moe output");
    double aux = 0;
    const double n = static_cast<double>(kT / balance_groups);  // tokens of a group
    for (int64_t g = 0; g < balance_groups; ++g)
      for (int64_t e = 0; e < kExperts; ++e) aux += (routed[g][e] / (n * kTopK)) * (prob_sum[g][e] / n);
    aux *= coeff * kExperts / static_cast<double>(balance_groups);
    aux += z_coeff * z;
    EXPECT_NEAR(layer.last_aux, aux, 1e-5 * aux) << "the load-balancing loss and the z-loss";
    EXPECT_GT(z_coeff * z, 1e-3 * aux) << "the z-loss is part of what is compared";
    // A forward that is not training reports nothing.
    layer.forward(b, 0, false, 0);
    EXPECT_EQ(layer.last_aux, 0.0f);
    if (v.bias > 0) expect_expert_bias_update(layer, rank, b, slots_of, v.capacity_factor > 0);
  }
}

// With top_k = num_experts every expert sees every token: the objective is
// smooth and the gates are the router's softmax, so every parameter (the router
// included) and the input are checked exactly as the other layers'.
TEST(Layers, MoeGradientsMatchFiniteDifferencesWithEveryExpertChosen) {
  Rank rank;
  auto dims = make_dims();
  toml::table opts = moe_options(3, 3);
  TestLayer layer(rank, "moe", dims, &opts);
  std::mt19937 rng(42);
  layer.randomize(rng);
  check_gradients(rank, layer, rng);
}

// Top-2 of 4 with a heavy load-balancing loss and z-loss in the objective: the
// gates' renormalisation (or pre-softmax gates), the router's softmax and the
// auxiliary losses' gradients, all where the routing holds.
TEST(Layers, MoeTopKGradientsWithLoadBalancingMatchFiniteDifferences) {
  // Dropless, and with a capacity that drops slots (by gate; by position).
  // And with a shared expert beside the routed ones.
  for (const auto& [pre_softmax, capacity_factor, policy, shared] :
       {std::tuple<bool, double, std::string, int64_t>{false, 0.0, "probs", 0}, {true, 0.0, "probs", 0},
        {false, 0.5, "probs", 0}, {true, 0.5, "position", 0}, {false, 0.5, "probs", 12}, {false, 0.0, "probs", -12}}) {
    // A negative width: that shared expert, gated.
    SCOPED_TRACE(std::string(pre_softmax ? "pre_softmax" : "softmax over the chosen") + ", capacity factor " +
                 std::to_string(capacity_factor) + " by " + policy + ", shared expert " + std::to_string(shared));
    toml::table opts = moe_options(4, 2, /*aux_coeff=*/2.0, pre_softmax, /*dropout=*/0.2, /*z_coeff=*/0.5,
                                   capacity_factor, policy, std::abs(shared), shared < 0);
    check_moe_gradients(opts, 43);
  }
}

// DeepSeek-V3's router options: sigmoid scores (the gates the chosen ones over
// their sum, or as they are for top_k = 1; the load-balancing term through the
// normalised sigmoids), scaled gates, and group-limited routing (a group ranked by
// all its experts, or by its best 2 of 4), with the load-balancing and z-loss terms
// in the objective, dropless and with a capacity.
TEST(Layers, MoeSigmoidScoresAndGroupLimitedRoutingGradientsMatchFiniteDifferences) {
  struct Variant {
    std::string score;
    bool pre_softmax;
    double scaling, capacity_factor;
    int64_t experts, top_k, groups, group_topk;
    bool per_sequence = false;
  };
  for (const Variant& v : {Variant{"sigmoid", false, 2.5, 0.0, 4, 2, 0, 0}, Variant{"sigmoid", false, 0.0, 0.0, 4, 1, 0, 0},
                           Variant{"sigmoid", false, 1.5, 0.0, 8, 4, 4, 2}, Variant{"softmax", false, 0.0, 0.0, 8, 2, 4, 1},
                           Variant{"softmax", true, 2.0, 0.0, 6, 4, 3, 2}, Variant{"sigmoid", false, 2.5, 0.0, 16, 4, 4, 2},
                           Variant{"sigmoid", false, 1.5, 0.5, 8, 4, 4, 2},
                           Variant{"softmax", false, 0.0, 0.0, 4, 2, 0, 0, true},
                           Variant{"sigmoid", false, 2.5, 0.0, 8, 4, 4, 2, true}}) {
    SCOPED_TRACE(v.score + (v.pre_softmax ? " pre_softmax" : "") + " scaled by " + std::to_string(v.scaling) +
                 ", capacity factor " + std::to_string(v.capacity_factor) + ", top " + std::to_string(v.top_k) +
                 " of " + std::to_string(v.experts) + " in " + std::to_string(v.groups) + " groups" +
                 (v.per_sequence ? ", balanced per sequence" : ""));
    toml::table opts = moe_options(v.experts, v.top_k, /*aux_coeff=*/2.0, v.pre_softmax, /*dropout=*/0.0,
                                   /*z_coeff=*/0.5, v.capacity_factor);
    set_router_options(opts, v.score, v.scaling, v.groups, v.group_topk);
    if (v.per_sequence) opts.insert_or_assign("load_balancing_type", "seq_aux_loss");
    check_moe_gradients(opts, 47);
  }
}

// The auxiliary loss's gradient reaches the router only through aux_loss_scale:
// at 0 the router gradient is the gates' alone.
TEST(Layers, MoeAuxiliaryLossGradientFollowsAuxLossScale) {
  Rank rank;
  auto dims = make_dims();
  toml::table opts = moe_options(4, 2, /*aux_coeff=*/1.0);
  TestLayer layer(rank, "moe", dims, &opts);
  std::mt19937 rng(44);
  layer.randomize(rng);
  Batch b = make_batch(rng);
  std::vector<std::vector<float>> router_grad;
  for (const double w : {0.0, 1.0, 2.0}) {
    layer.aux_weight = w;
    layer.zero_grads();
    layer.forward(b, 0, true, 1);
    layer.backward(b, 0);
    router_grad.push_back(layer.param("router.weight").grad);
  }
  // Linear in the weight: g(2) - g(1) = g(1) - g(0) != 0.
  double diff = 0;
  for (size_t i = 0; i < router_grad[0].size(); ++i) {
    const double d1 = router_grad[1][i] - router_grad[0][i], d2 = router_grad[2][i] - router_grad[1][i];
    EXPECT_NEAR(d1, d2, 1e-5 * (1.0 + std::fabs(d1)));
    diff = std::max(diff, std::fabs(d1));
  }
  EXPECT_GT(diff, 1e-4);
}

// One expert chosen by every token with gate 1 is exactly layer/mlp.
TEST(Layers, MoeWithOneExpertIsTheMlp) {
  Rank rank;
  auto dims = make_dims();
  toml::table opts = moe_options(1, 1, /*aux_coeff=*/0.01);
  TestLayer moe(rank, "moe", dims, &opts);
  TestLayer mlp(rank, "mlp", dims);
  std::mt19937 rng(45);
  mlp.randomize(rng);
  moe.randomize(rng);  // the router: any values
  const std::map<std::string, std::string> same = {{"ln.weight", "ln.weight"},
                                                   {"ln.bias", "ln.bias"},
                                                   {"experts.fc1.weight", "fc1.weight"},
                                                   {"experts.fc1.bias", "fc1.bias"},
                                                   {"experts.fc2.weight", "fc2.weight"},
                                                   {"experts.fc2.bias", "fc2.bias"}};
  for (const auto& [m, l] : same) {
    ASSERT_EQ(moe.param(m).value.size(), mlp.param(l).value.size()) << m;
    std::copy(mlp.param(l).value.begin(), mlp.param(l).value.end(), moe.param(m).value.begin());  // bound storage
  }
  Batch b = make_batch(rng);
  std::vector<float> y_moe, y_mlp;
  moe.aux_weight = 1.0;
  moe.zero_grads();
  mlp.zero_grads();
  moe.forward(b, 0, true, 3, &y_moe);
  mlp.forward(b, 0, true, 3, &y_mlp);
  EXPECT_LE(max_abs_diff(y_moe, y_mlp), 1e-6);
  EXPECT_FLOAT_EQ(moe.last_aux, 0.01f);  // coeff * E * f * P = coeff * 1 * 1 * 1
  const std::vector<float> dx_moe = moe.backward(b, 0), dx_mlp = mlp.backward(b, 0);
  EXPECT_LE(max_abs_diff(dx_moe, dx_mlp), 1e-5);
  for (const auto& [m, l] : same) {
    double scale = 0;
    for (float v : mlp.param(l).grad) scale = std::max(scale, static_cast<double>(std::fabs(v)));
    EXPECT_LE(max_abs_diff(moe.param(m).grad, mlp.param(l).grad), 1e-5 * (1.0 + scale)) << m;
  }
  for (float g : moe.param("router.weight").grad) EXPECT_EQ(g, 0.0f);  // softmax over one expert is constant
}

void check_expert_dispatchers(const std::vector<std::vector<int64_t>>& counts);

// The expert-parallel dispatchers' contract (loom_abi.h), checked on both
// plugins with two ep ranks whose routings differ in size (6 and 5 rows) and
// leave experts empty: plan returns the local experts' first rows, dispatch
// delivers every source's rows for this rank's experts expert-major with the
// sources in order, combine brings [R, w] back to [N, w] at the sources.
TEST(Layers, ExpertDispatchersDeliverTheRowOrderTheAbiFixes) {
  // counts[source][expert]: unequal rows with empty experts; and a source with no
  // rows at all while the other's go to rank 0 only (rank 1 receives nothing).
  for (const std::vector<std::vector<int64_t>>& counts :
       {std::vector<std::vector<int64_t>>{{2, 0, 3, 1}, {0, 4, 1, 0}},
        std::vector<std::vector<int64_t>>{{3, 1, 0, 0}, {0, 0, 0, 0}}})
    check_expert_dispatchers(counts);
}

void check_expert_dispatchers(const std::vector<std::vector<int64_t>>& counts) {
  constexpr int64_t kExperts = 4, kLocal = 2, kWidth = 3;
  auto expert_rows = [&](int src) {
    std::vector<int64_t> rows(kExperts + 1, 0);
    for (int64_t e = 0; e < kExperts; ++e) rows[e + 1] = rows[e] + counts[src][e];
    return rows;
  };
  // Row i of source j carries 100 j + i (+ 0.1 c in column c).
  auto value = [](int src, int64_t row, int64_t col) { return float(100 * src + row) + 0.1f * float(col); };
  for (const std::string name : {"expert", "expert.allgather"}) {
    SCOPED_TRACE("parallel/" + name);
    const loom::plugins::LoadedPlugin* p = registry().find("parallel", name);
    ASSERT_NE(p, nullptr);
    ASSERT_EQ(p->api_type, LOOM_API_EXPERT_PARALLEL);
    const auto* api = static_cast<const loom_expert_parallel_api*>(p->api);
    std::vector<std::vector<int64_t>> local(2);
    std::vector<std::vector<float>> delivered(2), returned(2);
    const std::vector<std::string> errors = run_two_ranks([&](int r, HarnessRank& rank) {
      loom_ep_create_args ca = loom::make<loom_ep_create_args>();
      ca.ep = rank.rt().group_or_self("tp").raw();  // the two ranks' group, as the ep group
      ca.num_experts = kExperts;
      ca.instance_name = "test.moe";
      loom_ep* h = nullptr;
      ok(api->create(&rank.rt(), &ca, &h));
      const std::vector<int64_t> rows = expert_rows(r);
      local[r].assign(kLocal + 1, -1);
      loom_ep_plan_args pa = loom::make<loom_ep_plan_args>();
      pa.slot = 7;
      pa.expert_rows = rows.data();
      pa.local_rows = local[r].data();
      ok(api->plan(h, &pa));
      const int64_t n = rows.back(), received = local[r].back();
      loom::Buffer x(&rank.rt(), static_cast<size_t>(n * kWidth) * sizeof(float)),
          at_experts(&rank.rt(), static_cast<size_t>(received * kWidth) * sizeof(float)),
          back(&rank.rt(), static_cast<size_t>(n * kWidth) * sizeof(float));
      for (int64_t i = 0; i < n; ++i)
        for (int64_t c = 0; c < kWidth; ++c) x.get<float>()[i * kWidth + c] = value(r, i, c);
      loom_ep_move_args ma = loom::make<loom_ep_move_args>();
      ma.slot = 7;
      ma.x = x.get();
      ma.out = at_experts.get();
      ma.width = kWidth;
      ma.dtype = LOOM_DTYPE_F32;
      ok(api->dispatch(h, &ma));
      rank.rt().dev().synchronize();
      delivered[r].assign(at_experts.get<float>(), at_experts.get<float>() + received * kWidth);
      ma.x = at_experts.get();
      ma.out = back.get();
      ok(api->combine(h, &ma));
      rank.rt().dev().synchronize();
      returned[r].assign(back.get<float>(), back.get<float>() + n * kWidth);
      api->release(h, 7);
      api->destroy(h);
    });
    ASSERT_EQ(errors, std::vector<std::string>(2, ""));
    for (int r = 0; r < 2; ++r) {
      std::vector<int64_t> want_local = {0};
      std::vector<float> want;
      for (int64_t le = 0; le < kLocal; ++le) {
        const int64_t e = r * kLocal + le;
        for (int src = 0; src < 2; ++src) {
          const std::vector<int64_t> rows = expert_rows(src);
          for (int64_t i = rows[e]; i < rows[e + 1]; ++i)
            for (int64_t c = 0; c < kWidth; ++c) want.push_back(value(src, i, c));
        }
        want_local.push_back(static_cast<int64_t>(want.size()) / kWidth);
      }
      EXPECT_EQ(local[r], want_local) << "rank " << r;
      EXPECT_EQ(delivered[r], want) << "rank " << r << ": the rows at its experts";
      std::vector<float> x;
      for (int64_t i = 0; i < expert_rows(r).back(); ++i)
        for (int64_t c = 0; c < kWidth; ++c) x.push_back(value(r, i, c));
      EXPECT_EQ(returned[r], x) << "rank " << r << ": combine is dispatch's inverse";
    }
  }
}

// Expert tensor parallelism (etp = tp = 2): each rank holds half of every
// expert's ffn; the same output, input gradient and gradient slices as one rank.
TEST(Layers, MoeTensorParallelTwoRanksMatchOneRank) {
  for (const bool sp : {false, true})
    for (const bool deepseek : {false, true}) {
      SCOPED_TRACE(std::string(sp ? "with sequence parallelism" : "without sequence parallelism") +
                   (deepseek ? ", sigmoid scores in groups, balanced per sequence" : ""));
      toml::table opts = moe_options(deepseek ? 8 : 4, deepseek ? 4 : 2, /*aux_coeff=*/0.5, false, /*dropout=*/0.25);
      if (deepseek) {
        set_router_options(opts, "sigmoid", 2.5, 4, 2);
        opts.insert_or_assign("load_balancing_type", "seq_aux_loss");
      }
      std::mt19937 rng(46);
      const loom::harness::Findings f = loom::harness::check_tensor_parallel(
          registry(), "moe", make_dims(), &opts, rng, {.tp = 2, .sequence_parallel = sp, .aux_weight = 0.5});
      EXPECT_TRUE(f.ok()) << f.text();
    }
}

TEST(Layers, MoeRefusesBadOptions) {
  Rank rank;
  auto dims = make_dims();
  for (const auto& [experts, top_k, what] :
       std::vector<std::tuple<int64_t, int64_t, std::string>>{{4, 5, "top_k = 5"}, {0, 1, "num_experts = 0"}}) {
    toml::table opts = moe_options(experts, top_k);
    try {
      TestLayer layer(rank, "moe", dims, &opts);
      ADD_FAILURE() << what << " was accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  }
  {  // a gate without a shared expert to gate
    toml::table opts = moe_options(4, 2, 0.01, false, 0.0, 0.0, 0.0, "probs", 0, /*shared_gate=*/true);
    try {
      TestLayer layer(rank, "moe", dims, &opts);
      ADD_FAILURE() << "shared_expert_gate without a shared expert was accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("shared_expert_ffn_hidden_size > 0"), std::string::npos) << e.what();
    }
  }
  // The router's options that must agree.
  struct Router {
    std::string score;
    bool pre_softmax;
    int64_t experts, top_k, groups, group_topk;
    std::string what;
  };
  for (const Router& r : {Router{"sigmoid", true, 4, 2, 0, 0, "option pre_softmax = true chooses between the softmax's"},
                          Router{"softmax", false, 8, 2, 4, 0, "num_groups = 4 and group_topk = 0 go together"},
                          Router{"softmax", false, 8, 2, 3, 1, "option num_groups = 3 must divide num_experts = 8"},
                          Router{"softmax", false, 8, 4, 2, 3, "option group_topk = 3 must be at most num_groups = 2"},
                          Router{"sigmoid", false, 8, 1, 4, 2, "option group_topk = 2 must be at most top_k = 1"},
                          Router{"sigmoid", false, 8, 6, 4, 2, "option top_k = 6 is more than the 4 experts of "
                                                               "group_topk = 2 groups of 2"}}) {
    toml::table opts = moe_options(r.experts, r.top_k, 0.01, r.pre_softmax);
    if (r.score != "softmax") opts.insert_or_assign("score_function", r.score);
    if (r.groups > 0) opts.insert_or_assign("num_groups", r.groups);
    if (r.group_topk > 0) opts.insert_or_assign("group_topk", r.group_topk);
    try {
      TestLayer layer(rank, "moe", dims, &opts);
      ADD_FAILURE() << r.what << ": accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(r.what), std::string::npos) << e.what();
    }
  }
  {  // the expert bias biases sigmoid scores (Megatron-LM refuses it with the softmax too)
    toml::table opts = moe_options(4, 2);
    opts.insert_or_assign("expert_bias", true);
    try {
      TestLayer layer(rank, "moe", dims, &opts);
      ADD_FAILURE() << "expert_bias with the softmax: accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("option expert_bias = true (auxiliary-loss-free balancing) biases the "
                                           "sigmoid scores; set score_function = \"sigmoid\""),
                std::string::npos)
          << e.what();
    }
  }
  // Single-option limits are declared (ABI 1.9 range / choices): the manifest check
  // refuses them, with the key and what is allowed, before any layer exists.
  const loom::plugins::LoadedPlugin& moe = registry().get("layer", "moe");
  for (const auto& [kv, what] : std::vector<std::pair<std::string, std::string>>{
           {"capacity_factor = -1.0", "capacity_factor must be >= 0, got -1.0"},
           {"drop_policy = \"random\"", "drop_policy must be one of \"probs\", \"position\", got \"random\""},
           {"num_experts = 0", "num_experts must be between 1 and 65536, got 0"},
           {"aux_loss_coeff = -0.5", "aux_loss_coeff must be >= 0, got -0.5"},
           {"dropout = 1.0", "dropout must be >= 0 and < 1, got 1.0"},
           {"score_function = \"relu\"", "score_function must be one of \"softmax\", \"sigmoid\", got \"relu\""},
           {"expert_bias_update_rate = -0.001", "expert_bias_update_rate must be between 0 and 1, got -0.001"},
           {"expert_bias_update_rate = 3e38", "expert_bias_update_rate must be between 0 and 1, got 3e+38"},
           {"topk_scaling_factor = -1.0", "topk_scaling_factor must be >= 0, got -1.0"}}) {
    loom::manifest::Manifest m = loom::manifest::Manifest::parse("[model.layer.moe]\n" + kv + "\n", "m.toml");
    std::vector<loom::manifest::Diagnostic> diags;
    m.apply_plugin_options("model.layer.moe", "layer/moe", moe.options, diags, {"plugin"});
    ASSERT_EQ(diags.size(), 1u) << kv;
    EXPECT_NE(diags[0].message.find(what), std::string::npos) << diags[0].message;
  }
}

}  // namespace
