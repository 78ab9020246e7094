// Generation (engine/train/generation.hpp, `loom generate`). The key/value cache is
// checked against running the whole sequence again for every token (the same tokens,
// logits equal to rounding), for GPT-2 blocks, Llama blocks (RoPE, grouped-query
// attention, RMSNorm, SwiGLU) and MoE; a checkpoint written at one layout generates
// the same text at tp 2, pp 2 and interleaved pp 2 x vpp 2 as at one rank; sampling is
// checked against the distribution it draws from; bad requests are refused by name.
#include "support/rank_trace.hpp"

#include "engine/train/data.hpp"
#include "engine/train/gather.hpp"
#include "engine/train/generation.hpp"
#include "engine/train/init_weights.hpp"

#include <boost/filesystem.hpp>
#include <gtest/gtest.h>

#include <fstream>
#include <thread>

#include <cmath>
#include <sstream>
#include <map>

namespace {

namespace fs = boost::filesystem;
using loom::train::GenerationRequest;
using loom::train::GenerationResult;

const std::vector<std::string> kLlama = {
    "model.layer.embedding.position_embedding=rope", "model.layer.attention.position_embedding=rope",
    "model.layer.attention.num_query_groups=2",      "model.layer.attention.norm=rmsnorm",
    "model.layer.attention.bias=false",              "model.layer.mlp.norm=rmsnorm",
    "model.layer.mlp.activation=swiglu",             "model.layer.mlp.bias=false",
    "model.layer.lm_head.norm=rmsnorm",              "model.tie_embeddings=false"};

const std::vector<std::string> kMoe = {"model.block=[\"attention\", \"moe\"]", "model.layer.moe.num_experts=4",
                                       "model.layer.moe.top_k=2", "model.layer.moe.ffn_hidden_size=64"};

// A model trained a few steps (so its weights are not the initial ones) and saved.
struct Trained {
  std::string manifest_toml;
  loom::train::InitialWeights weights;
  int64_t vocab = 0;
};

Trained train_and_gather(std::vector<std::string> overrides) {
  const fs::path dir = fs::temp_directory_path() / fs::unique_path("loom-generate-%%%%%%");
  overrides.insert(overrides.end(), {"run.steps=4", "checkpoint.every=4", "checkpoint.dir=\"" + dir.string() + "\""});
  const loom::testing::RankTrace t = loom::testing::run_all_ranks(loom::testing::tiny_manifest(), overrides);
  loom::train::WholeCheckpoint ck = loom::train::gather_checkpoint(t.result.checkpoint, loom::plugins::registry());
  Trained out{ck.manifest_toml, {t.result.checkpoint, std::move(ck.tensors), ck.vocab}, ck.vocab};
  fs::remove_all(dir);
  return out;
}

GenerationResult generate(const Trained& m, const std::vector<std::string>& layout, GenerationRequest req) {
  const loom::train::RunPlan plan =
      loom::train::generation_plan(m.manifest_toml, "saved.toml", layout, loom::plugins::registry());
  return loom::train::generate(plan, m.weights, m.vocab, req);
}

GenerationRequest greedy(int64_t new_tokens, bool cache) {
  GenerationRequest r;
  r.prompt = {1, 2, 10, 3, 4, 11};  // "12+34="
  r.max_new_tokens = new_tokens;
  r.sampling.temperature = 0;
  r.use_cache = cache;
  r.keep_logits = true;
  return r;
}

// The same tokens, and every step's logits equal within `tol` (relative to their spread).
void expect_same(const GenerationResult& a, const GenerationResult& b, double tol, const std::string& what) {
  ASSERT_EQ(a.tokens, b.tokens) << what;
  ASSERT_EQ(a.logits.size(), b.logits.size()) << what;
  for (size_t s = 0; s < a.logits.size(); ++s) {
    ASSERT_EQ(a.logits[s].size(), b.logits[s].size());
    double spread = 0;
    for (float x : a.logits[s]) spread = std::max(spread, std::fabs(static_cast<double>(x)));
    for (size_t v = 0; v < a.logits[s].size(); ++v)
      ASSERT_NEAR(a.logits[s][v], b.logits[s][v], tol * std::max(1.0, spread)) << what << ": step " << s << ", token " << v;
  }
}

// Greedy decoding with the cache equals recomputing the whole sequence each step, up
// to the model's seq_length (16: the prompt's 6 tokens and 10 new ones).
void check_cache_equals_recompute(const std::vector<std::string>& model, const std::vector<std::string>& layout) {
  const Trained m = train_and_gather(model);
  const GenerationResult cached = generate(m, layout, greedy(20, true));
  const GenerationResult again = generate(m, layout, greedy(20, false));
  EXPECT_EQ(cached.tokens.size(), 10u);
  EXPECT_TRUE(cached.reached_seq_len);
  expect_same(cached, again, 1e-5, "kv cache vs recompute");
}

TEST(Generation, CacheEqualsRecomputeGpt2Blocks) { check_cache_equals_recompute({}, {}); }

// The generation path against the evaluation forward (another code path in every
// layer): run over the whole generated sequence, the model's argmax at each position
// is the token greedy decoding chose after it.
TEST(Generation, GreedyTokensAreTheEvaluationForwardsArgmax) {
  std::vector<std::string> windowed = kLlama;
  windowed.push_back("model.layer.attention.sliding_window=3");
  for (const std::vector<std::string>& model : {std::vector<std::string>{}, kLlama, windowed}) {
    const Trained m = train_and_gather(model);
    const GenerationRequest req = greedy(20, true);
    const GenerationResult got = generate(m, {}, req);
    std::vector<int32_t> seq = req.prompt;
    seq.insert(seq.end(), got.tokens.begin(), got.tokens.end());
    ASSERT_EQ(seq.size(), 16u);
    const loom::train::RunPlan plan = loom::testing::plan_from(m.manifest_toml, {});
    loom::testing::on_one_rank(plan, [&](loom::runtime::RankRuntime& rt, const loom::train::DataSource&,
                                         const loom_model_dims& dims) {
      loom::model::Model model(plan.config, *plan.registry, rt, dims, plan.layers, 1);
      loom::train::load_initial_weights(m.weights, m.vocab, model);
      const int64_t S = dims.seq_len, B = dims.micro_batch;
      std::vector<int32_t> tokens(static_cast<size_t>(S * B)), targets(tokens.size(), 0), predictions(tokens.size());
      for (int64_t t = 0; t < S; ++t)
        for (int64_t b = 0; b < B; ++b) tokens[static_cast<size_t>(t * B + b)] = seq[static_cast<size_t>(t)];
      float loss = 0;
      int64_t count = 0;
      model.forward(0, tokens.data(), targets.data(), false, 0, &loss, &count, predictions.data());
      for (size_t p = req.prompt.size() - 1; p + 1 < seq.size(); ++p)
        for (int64_t b = 0; b < B; ++b)
          EXPECT_EQ(predictions[p * static_cast<size_t>(B) + static_cast<size_t>(b)], seq[p + 1]) << "position " << p;
    });
  }
}
TEST(Generation, CacheEqualsRecomputeLlamaBlocksAtTp2) { check_cache_equals_recompute(kLlama, {"parallel.tp=2"}); }
TEST(Generation, CacheEqualsRecomputeMoe) { check_cache_equals_recompute(kMoe, {}); }
TEST(Generation, CacheEqualsRecomputeWithQkNormAtTp2) {
  std::vector<std::string> qwen3 = kLlama;
  qwen3.push_back("model.layer.attention.qk_norm=true");
  check_cache_equals_recompute(qwen3, {"parallel.tp=2"});
}

// Multi-latent attention (DeepSeek-V2/V3): the cache holds each head's packed k and v
// (the shared rotary key rotated at its position), at tp 2, and tp 2 x pp 2 generates
// what one rank does.
TEST(Generation, MultiLatentAttentionCacheEqualsRecomputeAndLayoutsAgree) {
  std::vector<std::string> deepseek = kLlama;
  for (const char* o : {"model.layer.attention.multi_latent_attention=true", "model.layer.attention.num_query_groups=0",
                        "model.layer.attention.q_lora_rank=12", "model.layer.attention.kv_lora_rank=10",
                        "model.layer.attention.qk_head_dim=6", "model.layer.attention.qk_pos_emb_head_dim=4",
                        "model.layer.attention.v_head_dim=5"})
    deepseek.push_back(o);
  check_cache_equals_recompute(deepseek, {"parallel.tp=2"});
  const Trained m = train_and_gather(deepseek);
  const GenerationResult one = generate(m, {}, greedy(8, true));
  expect_same(one, generate(m, {"parallel.tp=2", "parallel.pp=2"}, greedy(8, true)), 1e-5, "tp 2 x pp 2");
}

// A sliding window shorter than the prompt: the cached keys it slid past are masked
// as the whole sequence's forward masks them.
TEST(Generation, CacheEqualsRecomputeWithASlidingWindowAtTp2) {
  std::vector<std::string> mistral = kLlama;
  mistral.push_back("model.layer.attention.sliding_window=4");
  check_cache_equals_recompute(mistral, {"parallel.tp=2"});
}

// A model trained with documents packed in its sequences (data.reset_attention_mask
// and reset_position_ids; lines of text, the newline ending each) generates after a
// prompt's last document what it generates from that document alone, with the cache
// and without, with learned and with rotary positions.
TEST(Generation, AfterAnEndOfDocumentTheModelSeesItsDocumentOnly) {
  const std::string dir = loom::testing::scratch_dir("generate-documents");
  {
    std::ofstream text(dir + "/lines.txt");
    for (int line = 0; line < 400; ++line) text << std::string(static_cast<size_t>(2 + line % 9), 'a' + line % 7) << "\n";
  }
  for (const std::vector<std::string>& model : {std::vector<std::string>{}, kLlama}) {
    std::vector<std::string> o = model;
    o.insert(o.end(), {"data.kind=\"text\"", "data.path=\"" + dir + "/lines.txt\"", "data.eod_token=10",
                       "data.reset_attention_mask=true", "data.reset_position_ids=true"});
    const Trained m = train_and_gather(o);
    GenerationRequest alone = greedy(5, true), packed = greedy(5, true);
    alone.prompt = {98, 99, 100};
    packed.prompt = {120, 121, 10, 122, 10, 98, 99, 100};
    for (const bool cache : {true, false}) {
      alone.use_cache = packed.use_cache = cache;
      const GenerationResult a = generate(m, {}, alone), p = generate(m, {}, packed);
      expect_same(a, p, 1e-5, cache ? "with the cache" : "recomputed");
    }
  }
  fs::remove_all(dir);
}

// A checkpoint trained at tp 2 x dp 2 with SP generates at its own tensor layout and at
// others (the shards regathered) what one rank generates.
TEST(Generation, EveryLayoutGeneratesWhatOneRankDoes) {
  const Trained m = train_and_gather({"parallel.tp=2", "parallel.dp=2", "parallel.sequence_parallel=true",
                                      "model.num_layers=4"});
  const GenerationResult one = generate(m, {"parallel.tp=1"}, greedy(8, true));
  ASSERT_EQ(one.tokens.size(), 8u);
  for (const std::vector<std::string>& layout :
       std::vector<std::vector<std::string>>{{}, {"parallel.tp=1", "parallel.pp=2"},
                                             {"parallel.tp=2", "parallel.pp=2", "parallel.vpp=2"}}) {
    std::string what;
    for (const std::string& s : layout) what += s + " ";
    expect_same(one, generate(m, layout, greedy(8, true)), 1e-5, what);
  }
}

TEST(Generation, LlamaBlocksAtPipelineAndTensorParallel) {
  const Trained m = train_and_gather(kLlama);
  const GenerationResult one = generate(m, {}, greedy(8, true));
  expect_same(one, generate(m, {"parallel.tp=2", "parallel.pp=2"}, greedy(8, true)), 1e-5, "tp 2 x pp 2");
}

// run.sample_every: the sample printed during training (at the training layout, tp 2
// x pp 2 x dp 2) is what `loom generate` writes from the checkpoint of that step, at
// one rank, for the same prompt (a quarter of validation sequence 0).
TEST(Generation, TrainingSamplesAreWhatGenerateWritesFromTheCheckpoint) {
  const fs::path dir = fs::temp_directory_path() / fs::unique_path("loom-sample-%%%%%%");
  std::ostringstream log;
  loom::train::TrainOptions opts;
  opts.log = &log;
  const loom::testing::RankTrace t = loom::testing::run_all_ranks(
      loom::testing::tiny_manifest(),
      {"parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "batch.global_batch_size=8", "model.num_layers=4",
       "run.steps=4", "run.sample_every=4", "run.sample_tokens=5", "checkpoint.dir=\"" + dir.string() + "\""},
      opts);
  const size_t at = log.str().find("sample at step 4: ");
  ASSERT_NE(at, std::string::npos) << log.str();
  const std::string line = log.str().substr(at, log.str().find('\n', at) - at);

  loom::train::WholeCheckpoint ck = loom::train::gather_checkpoint(t.result.checkpoint, loom::plugins::registry());
  const Trained m{ck.manifest_toml, {t.result.checkpoint, std::move(ck.tensors), ck.vocab}, ck.vocab};
  const loom::train::RunPlan plan = loom::testing::plan_from(m.manifest_toml, {});
  const auto data = loom::train::make_data_source(plan.config);
  std::vector<int32_t> tokens(16), targets(16);
  data->sample(loom::train::Split::Validation, 0, 16, tokens.data(), targets.data());
  GenerationRequest r = greedy(5, true);
  r.prompt.assign(tokens.begin(), tokens.begin() + 4);
  const GenerationResult g = generate(m, {"parallel.tp=1", "parallel.pp=1"}, r);
  ASSERT_EQ(g.tokens.size(), 5u);
  EXPECT_EQ(line, "sample at step 4: " + data->render(r.prompt.data(), 4) + " -> " + data->render(g.tokens.data(), 5));
  fs::remove_all(dir);
}

// Sampling: the same seed draws the same tokens; top_k 1 is greedy; at temperature 1
// the tokens follow softmax(logits).
TEST(Generation, SampledTokensFollowTheSeed) {
  const Trained m = train_and_gather({});
  GenerationRequest r = greedy(8, true);
  r.sampling = {.temperature = 1.5, .top_k = 0, .top_p = 1.0, .seed = 11};
  const GenerationResult a = generate(m, {}, r), b = generate(m, {}, r);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(generate(m, {"parallel.tp=2"}, r).tokens, a.tokens);  // every tp rank draws the same
  r.sampling.top_k = 1;
  EXPECT_EQ(generate(m, {}, r).tokens, generate(m, {}, greedy(8, true)).tokens);
}

TEST(SampleToken, GreedyTopKAndTopP) {
  std::mt19937_64 rng(3);
  const std::vector<float> logits = {0.5f, 2.0f, 2.0f, -1.0f, 1.0f};
  EXPECT_EQ(loom::train::sample_token(logits, {.temperature = 0}, rng), 1);  // the first of equal maxima
  EXPECT_EQ(loom::train::sample_token(logits, {.temperature = 2, .top_k = 1}, rng), 1);
  std::map<int32_t, int> seen;
  for (int i = 0; i < 2000; ++i) ++seen[loom::train::sample_token(logits, {.temperature = 1, .top_k = 2}, rng)];
  EXPECT_EQ(seen.size(), 2u);  // only ids 1 and 2
  EXPECT_GT(seen[1], 800);
  EXPECT_GT(seen[2], 800);
  // top_p 0.5: p(1) = p(2) ~ 0.35 each, so the nucleus is {1, 2}; 0.3 keeps {1} only.
  seen.clear();
  for (int i = 0; i < 500; ++i) ++seen[loom::train::sample_token(logits, {.temperature = 1, .top_p = 0.5}, rng)];
  EXPECT_EQ(seen.size(), 2u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(loom::train::sample_token(logits, {.temperature = 1, .top_p = 0.3}, rng), 1);
}

// At temperature 1 with no cut, frequencies over 40000 draws are within 4 standard
// deviations of softmax(logits) for every token.
TEST(SampleToken, DrawsFollowTheSoftmax) {
  std::mt19937_64 rng(5);
  const std::vector<float> logits = {1.0f, 0.0f, -0.5f, 2.0f, 0.3f, -2.0f};
  std::vector<double> p(logits.size());
  double z = 0;
  for (size_t i = 0; i < p.size(); ++i) z += p[i] = std::exp(logits[i]);
  const int n = 40000;
  std::vector<int> count(logits.size(), 0);
  for (int i = 0; i < n; ++i) ++count[static_cast<size_t>(loom::train::sample_token(logits, {.temperature = 1}, rng))];
  for (size_t i = 0; i < p.size(); ++i) {
    const double q = p[i] / z, sd = std::sqrt(n * q * (1 - q));
    EXPECT_NEAR(count[i], n * q, 4 * sd) << "token " << i;
  }
}

// A Generator keeps its ranks between requests (loom serve): at tp 2 x pp 2, requests
// in a row, and from two threads at once, give what a fresh generate() gives each; a
// refused request leaves it working.
TEST(Generator, RequestsInTurnEqualFreshRuns) {
  const Trained m = train_and_gather(kLlama);
  const std::vector<std::string> layout = {"parallel.tp=2", "parallel.pp=2"};
  const loom::train::RunPlan plan =
      loom::train::generation_plan(m.manifest_toml, "saved.toml", layout, loom::plugins::registry());
  std::vector<GenerationRequest> requests = {greedy(8, true), greedy(5, true), greedy(6, false)};
  requests[1].prompt = {7, 8, 11};
  requests[1].sampling.temperature = 0.8;
  requests[1].sampling.seed = 5;
  requests[2].prompt = {3, 3, 12};
  std::vector<GenerationResult> fresh;
  for (const GenerationRequest& r : requests) fresh.push_back(generate(m, layout, r));
  EXPECT_NE(fresh[0].tokens, fresh[1].tokens);

  loom::train::Generator gen(plan, m.weights, m.vocab);
  for (size_t i = 0; i < requests.size(); ++i) expect_same(fresh[i], gen.generate(requests[i]), 0, "request " + std::to_string(i));
  GenerationRequest bad = greedy(4, true);
  bad.prompt = {1, 99};
  EXPECT_THROW(gen.generate(bad), std::exception);
  std::vector<GenerationResult> concurrent(requests.size());
  {
    std::vector<std::jthread> clients;
    for (size_t i = 0; i < requests.size(); ++i)
      clients.emplace_back([&, i] { concurrent[i] = gen.generate(requests[i]); });
  }
  for (size_t i = 0; i < requests.size(); ++i) expect_same(fresh[i], concurrent[i], 0, "concurrent " + std::to_string(i));
}

// A conversation's next turn starts with the sequence before: its prompt's forward
// starts after what the caches hold of it, and it generates what a fresh run does (the
// same tokens, logits to rounding), at tp 2 x pp 2; a prompt that is a prefix of the
// cached sequence still forwards its last position; without the cache nothing is reused.
TEST(Generator, ANextTurnReusesTheCachedPrefix) {
  const Trained m = train_and_gather(kLlama);
  const std::vector<std::string> layout = {"parallel.tp=2", "parallel.pp=2"};
  const loom::train::RunPlan plan =
      loom::train::generation_plan(m.manifest_toml, "saved.toml", layout, loom::plugins::registry());
  loom::train::Generator gen(plan, m.weights, m.vocab);
  const GenerationRequest first = greedy(3, true);
  const GenerationResult a = gen.generate(first);
  EXPECT_EQ(a.reused, 0);
  EXPECT_EQ(a.forwarded, 6 + 3 - 1);  // the last token drawn was never run
  GenerationRequest next = greedy(5, true);
  next.prompt = first.prompt;
  next.prompt.insert(next.prompt.end(), a.tokens.begin(), a.tokens.end());
  next.prompt.insert(next.prompt.end(), {5, 10});
  const GenerationResult b = gen.generate(next);
  EXPECT_EQ(b.reused, 8);
  expect_same(generate(m, layout, next), b, 1e-5, "next turn");
  const GenerationResult again = gen.generate(first);
  EXPECT_EQ(again.reused, 5);
  expect_same(a, again, 1e-5, "the first prompt again");
  GenerationRequest uncached = greedy(3, false);
  const GenerationResult c = gen.generate(uncached);
  EXPECT_EQ(c.reused, 0);
  expect_same(a, c, 1e-5, "without the cache");
}

// A rank that fails (a NaN in the weights makes the logits NaN) fails that request with
// the run's error and every later one; the other ranks do not hang.
TEST(Generator, ARankFailureFailsThisAndLaterRequests) {
  Trained m = train_and_gather({});
  for (loom::train::WholeTensor& t : m.weights.tensors)
    if (t.name.find("lm_head") != std::string::npos || t.name.find("embedding") != std::string::npos) {
      ASSERT_EQ(t.dtype, LOOM_DTYPE_F32);
      std::fill(reinterpret_cast<float*>(t.data.data()), reinterpret_cast<float*>(t.data.data() + t.data.size()), NAN);
    }
  const loom::train::RunPlan plan = loom::train::generation_plan(m.manifest_toml, "saved.toml", {"parallel.pp=2"},
                                                                 loom::plugins::registry());
  loom::train::Generator gen(plan, m.weights, m.vocab);
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      gen.generate(greedy(4, true));
      ADD_FAILURE() << "NaN logits generated tokens";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("NaN or an infinity"), std::string::npos) << attempt << ": " << e.what();
    }
  }
}

TEST(Generation, BadRequestsAreRefused) {
  const Trained m = train_and_gather({});
  auto refusal = [&](GenerationRequest r) {
    try {
      generate(m, {}, r);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  GenerationRequest r = greedy(4, true);
  r.prompt.clear();
  EXPECT_NE(refusal(r).find("the prompt is empty"), std::string::npos);
  r.prompt = {1, 99};
  EXPECT_NE(refusal(r).find("prompt token 99 is outside the vocabulary [0, 13)"), std::string::npos);
  r.prompt.assign(16, 1);
  EXPECT_NE(refusal(r).find("the model's seq_length is 16"), std::string::npos);
  r = greedy(4, true);
  r.sampling.top_p = 0;
  EXPECT_NE(refusal(r).find("top_p 0 is outside (0, 1]"), std::string::npos);
}

}  // namespace
