// The composed model (embedding -> blocks -> lm_head, tied embeddings) against
// finite differences of its loss, through the engine's flat buffers: catches
// mistakes in how layers are wired together, which per-layer checks cannot.
#include "support/train_fixture.hpp"

#include "engine/runtime/launcher.hpp"
#include "engine/train/data.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

namespace {

void check_model_gradients(const std::vector<std::string>& overrides) {
  using namespace loom;
  train::RunPlan plan = loom::testing::plan_from(loom::testing::tiny_manifest(), overrides);
  const manifest::RunConfig& m = plan.config;
  loom::testing::on_one_rank(plan, [&](runtime::RankRuntime& rt, const train::DataSource& data,
                                      const loom_model_dims& dims) {
    model::Model model(m, *plan.registry, rt, dims, plan.layers, 11);
    const int64_t seq = dims.seq_len, mbs = dims.micro_batch;
    std::vector<int32_t> tokens(seq * mbs), targets(seq * mbs);
    train::fill_microbatch(data, train::Split::Train, 5, mbs, seq, tokens.data(), targets.data());
    // Predict every next token (not only answers) so every weight gets a gradient.
    for (int64_t s = 0; s + 1 < seq; ++s)
      for (int64_t b = 0; b < mbs; ++b) targets[s * mbs + b] = tokens[(s + 1) * mbs + b];
    for (int64_t b = 0; b < mbs; ++b) targets[(seq - 1) * mbs + b] = -1;

    auto loss = [&](bool with_backward) {
      float sum = 0;
      int64_t count = 0;
      model.zero_grads();
      model.forward(0, tokens.data(), targets.data(), with_backward, 0, &sum, &count);
      if (with_backward) model.backward(0, 1.0f / count, 1.0f);  // one microbatch
      return static_cast<double>(sum) / count;
    };
    loss(true);
    const float* grads = static_cast<const float*>(model.grads());
    std::vector<float> analytic(grads, grads + model.numel());
    float* params = static_cast<float*>(model.params());
    std::mt19937 rng(3);
    for (const model::ParamEntry& e : model.param_entries()) {
      double worst = 0, gmax = 0;
      for (size_t i = 0; i < e.numel; ++i) gmax = std::max(gmax, std::fabs(double(analytic[e.offset + i])));
      std::uniform_int_distribution<size_t> pick(0, e.numel - 1);
      for (int k = 0; k < 12; ++k) {
        const size_t i = e.offset + pick(rng);
        const float saved = params[i];
        const float h = 2e-3f;
        params[i] = saved + h;
        const double up = loss(false);
        params[i] = saved - h;
        const double down = loss(false);
        params[i] = saved;
        const double numeric = (up - down) / (2.0 * h);
        worst = std::max(worst, std::fabs(numeric - analytic[i]));
      }
      // Relative to the tensor's largest gradient: fp32 forward differences are noisy.
      EXPECT_LT(worst, 2e-2 * gmax + 2e-4) << e.name << " (max |grad| " << gmax << ")";
      EXPECT_GT(gmax, 0.0) << e.name << " received no gradient";
    }
  });
}

TEST(ModelGradients, TiedEmbeddingsMatchFiniteDifferences) { check_model_gradients({}); }
TEST(ModelGradients, UntiedEmbeddingsMatchFiniteDifferences) {
  check_model_gradients({"model.tie_embeddings=false"});
}

// MoE blocks. Every token takes every expert (top_k = num_experts): with fewer, a
// difference step could move a token across a routing decision, where the loss
// jumps; the gates (a softmax over the router's logits) still carry the router's
// gradient. aux_loss_coeff = 0: the objective is then the cross-entropy alone, what
// the differences measure.
std::vector<std::string> moe_blocks(std::vector<std::string> options) {
  options.insert(options.begin(), {"model.block=[\"attention\", \"moe\"]", "model.layer.moe.num_experts=4",
                                   "model.layer.moe.top_k=4", "model.layer.moe.ffn_hidden_size=32",
                                   "model.layer.moe.aux_loss_coeff=0.0"});
  return options;
}

// Mixtral's: RMSNorm before the router, SwiGLU experts, no biases.
TEST(ModelGradients, MixtralMoeBlocksMatchFiniteDifferences) {
  check_model_gradients(moe_blocks(
      {"model.layer.moe.norm=rmsnorm", "model.layer.moe.activation=swiglu", "model.layer.moe.bias=false"}));
}

// SwiGLU experts with biases, and a SwiGLU shared expert with its sigmoid gate.
TEST(ModelGradients, SwigluMoeWithGatedSharedExpertMatchesFiniteDifferences) {
  check_model_gradients(moe_blocks({"model.layer.moe.activation=swiglu",
                                    "model.layer.moe.shared_expert_ffn_hidden_size=32",
                                    "model.layer.moe.shared_expert_gate=true"}));
}

}  // namespace
