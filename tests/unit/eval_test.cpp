// `loom eval` (engine/train/eval_data.hpp, train::evaluate). The sliding windows predict
// every token after the first exactly once, from the true tokens before it; the
// perplexity equals the one computed from the logits of the generation path (another
// forward: key/value-cache layers, one row at a time) for each target with its
// window's context, at every layout; LAMBADA accuracy is the share of examples whose
// last word greedy generation writes.
#include "support/rank_trace.hpp"

#include "engine/train/eval_data.hpp"
#include "engine/train/evaluator.hpp"
#include "engine/train/gather.hpp"
#include "engine/train/generation.hpp"
#include "engine/train/trainer.hpp"

#include <boost/filesystem.hpp>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>

namespace {

namespace fs = boost::filesystem;
using loom::train::Split;

// Every target is counted once, in order, as the token after its context.
TEST(EvalData, SlidingWindowsPredictEachTokenOnceFromItsTruePrefix) {
  std::vector<int32_t> stream(101);
  for (size_t i = 0; i < stream.size(); ++i) stream[i] = static_cast<int32_t>((i * 7 + 3) % 50);
  for (int64_t stride : {1, 5, 8, 16}) {
    const loom::train::SlidingWindows w(stream, 16, stride, 50, "stream");
    std::map<int64_t, int> counted;  // token index -> times predicted
    std::vector<int32_t> tokens(16), targets(16);
    for (int64_t i = 0; i < w.windows() + 2; ++i) {  // two padding windows past the end
      w.sample(Split::Validation, static_cast<uint64_t>(i), 16, tokens.data(), targets.data());
      for (int64_t t = 0; t < 16; ++t) {
        if (targets[t] < 0) continue;
        ASSERT_LT(i, w.windows()) << "a padding window has a target";
        const int64_t at = i * stride + t + 1;  // the predicted token's index in the stream
        EXPECT_EQ(targets[t], stream[static_cast<size_t>(at)]);
        for (int64_t k = 0; k <= t; ++k) EXPECT_EQ(tokens[k], stream[static_cast<size_t>(i * stride + k)]);
        ++counted[at];
      }
    }
    EXPECT_EQ(counted.size(), stream.size() - 1) << "stride " << stride;
    for (const auto& [at, n] : counted) EXPECT_EQ(n, 1) << "token " << at << ", stride " << stride;
    EXPECT_EQ(counted.begin()->first, 1);
  }
  EXPECT_THROW(loom::train::SlidingWindows(stream, 16, 17, 50, "s"), loom::train::DataError);
  EXPECT_THROW(loom::train::SlidingWindows({1}, 16, 8, 50, "s"), loom::train::DataError);
}

struct Trained {
  std::string manifest_toml;
  loom::train::InitialWeights weights;
  int64_t vocab = 0;
};

Trained train_and_gather(std::vector<std::string> overrides) {
  const fs::path dir = fs::temp_directory_path() / fs::unique_path("loom-eval-%%%%%%");
  overrides.insert(overrides.end(), {"run.steps=6", "checkpoint.every=6", "checkpoint.dir=\"" + dir.string() + "\""});
  const loom::testing::RankTrace t = loom::testing::run_all_ranks(loom::testing::tiny_manifest(), overrides);
  loom::train::WholeCheckpoint ck = loom::train::gather_checkpoint(t.result.checkpoint, loom::plugins::registry());
  Trained out{ck.manifest_toml, {t.result.checkpoint, std::move(ck.tensors), ck.vocab}, ck.vocab};
  fs::remove_all(dir);
  return out;
}

loom::train::Evaluation evaluate(const Trained& m, const loom::train::DataSource& data, int64_t samples,
                                 std::vector<std::string> layout) {
  layout.insert(layout.end(), {"checkpoint.dir=\"\"", "run.eval_every=0"});
  const loom::train::RunPlan plan = loom::testing::plan_from(m.manifest_toml, layout);
  return loom::train::evaluate(plan, m.weights, m.vocab, data, samples);
}

// -log softmax(logits)[target], in double.
double nll(const std::vector<float>& logits, int32_t target) {
  double mx = -INFINITY, z = 0;
  for (float x : logits) mx = std::max(mx, static_cast<double>(x));
  for (float x : logits) z += std::exp(static_cast<double>(x) - mx);
  return std::log(z) + mx - logits[static_cast<size_t>(target)];
}

// The reference loss of every counted target: the logits of its window's context
// through the generation forward (kv_cache layers, one rank), in double.
double reference_loss_sum(const Trained& m, const loom::train::SlidingWindows& windows, int64_t seq, int64_t* count) {
  const loom::train::RunPlan plan =
      loom::train::generation_plan(m.manifest_toml, "saved.toml", {"parallel.tp=1"}, loom::plugins::registry());
  double sum = 0;
  *count = 0;
  loom::testing::on_one_rank(plan, [&](loom::runtime::RankRuntime& rt, const loom::train::DataSource&, const loom_model_dims&) {
    std::unique_ptr<loom::model::Model> model = loom::train::create_rank_model(plan, rt, m.vocab, &m.weights);
    std::vector<int32_t> tokens(static_cast<size_t>(seq)), targets(tokens.size());
    std::vector<float> logits(static_cast<size_t>(m.vocab));
    for (int64_t i = 0; i < windows.windows(); ++i) {
      windows.sample(Split::Validation, static_cast<uint64_t>(i), seq, tokens.data(), targets.data());
      for (int64_t t = 0; t < seq; ++t) {
        if (targets[static_cast<size_t>(t)] < 0) continue;
        model->forward_cached(0, t + 1, 1, 0, tokens.data(), nullptr, logits.data());  // CPU: host memory
        sum += nll(logits, targets[static_cast<size_t>(t)]);
        ++*count;
      }
    }
  });
  return sum;
}

TEST(Eval, PerplexityEqualsTheGenerationForwardsAtEveryLayout) {
  const Trained m = train_and_gather({"parallel.tp=2", "parallel.dp=2", "model.num_layers=4"});
  std::vector<int32_t> stream(40);
  for (size_t i = 0; i < stream.size(); ++i) stream[i] = static_cast<int32_t>((i * 5 + 1) % 13);
  const int64_t seq = 16;
  for (int64_t stride : {6, 16}) {
    const loom::train::SlidingWindows windows(stream, seq, stride, m.vocab, "stream");
    int64_t count = 0;
    const double want = reference_loss_sum(m, windows, seq, &count);
    ASSERT_EQ(count, static_cast<int64_t>(stream.size()) - 1);
    for (const std::vector<std::string>& layout :
         std::vector<std::vector<std::string>>{{},
                                               {"parallel.tp=1", "parallel.dp=1"},
                                               {"parallel.tp=1", "parallel.dp=1", "parallel.pp=2"},
                                               {"parallel.tp=2", "parallel.dp=1", "parallel.pp=2", "parallel.vpp=2",
                                                "pipeline.schedule=\"interleaved\"", "batch.global_batch_size=4"},
                                               {"parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=2",
                                                "parallel.dp=1"}}) {
      std::string what = "stride " + std::to_string(stride) + ": ";
      for (const std::string& s : layout) what += s + " ";
      const loom::train::Evaluation e = evaluate(m, windows, windows.windows(), layout);
      EXPECT_EQ(e.tokens, count) << what;
      EXPECT_NEAR(e.loss_sum, want, 1e-5 * want) << what;
    }
  }
}

// LAMBADA: an example is right exactly when greedy generation from its context writes
// its last word's tokens.
TEST(Eval, LastWordAccuracyIsWhatGreedyGenerationWrites) {
  const Trained m = train_and_gather({});
  std::vector<loom::train::LastWordExample> examples;
  for (int k = 0; k < 24; ++k) {
    loom::train::LastWordExample e;
    for (int i = 0; i < 3 + k % 9; ++i) e.context.push_back((k * 3 + i * 5) % 13);
    for (int i = 0; i < 1 + k % 3; ++i) e.target.push_back((k + i * 7) % 13);
    examples.push_back(std::move(e));
  }
  // Make some of them right: the model's own greedy continuation as the last word.
  const loom::train::RunPlan gen = loom::train::generation_plan(m.manifest_toml, "saved.toml", {}, loom::plugins::registry());
  for (size_t k = 0; k < examples.size(); k += 3) {
    loom::train::GenerationRequest r;
    r.prompt = examples[k].context;
    r.max_new_tokens = static_cast<int64_t>(examples[k].target.size());
    r.sampling.temperature = 0;
    examples[k].target = loom::train::generate(gen, m.weights, m.vocab, r).tokens;
  }
  int64_t right = 0;
  for (const auto& e : examples) {
    loom::train::GenerationRequest r;
    r.prompt = e.context;
    r.max_new_tokens = static_cast<int64_t>(e.target.size());
    r.sampling.temperature = 0;
    right += loom::train::generate(gen, m.weights, m.vocab, r).tokens == e.target ? 1 : 0;
  }
  ASSERT_GE(right, 8);
  const loom::train::LastWordTask task(examples, 16, m.vocab, "examples");
  for (const std::vector<std::string>& layout :
       std::vector<std::vector<std::string>>{{}, {"parallel.dp=1"}, {"parallel.dp=1", "parallel.tp=2", "parallel.pp=2"}}) {
    const loom::train::Evaluation e = evaluate(m, task, task.size(), layout);
    EXPECT_EQ(e.samples, 24) << layout.size();
    EXPECT_DOUBLE_EQ(e.exact_match, static_cast<double>(right) / 24.0) << layout.size();
  }
}

TEST(EvalData, LastWordExamplesFromJsonl) {
  const fs::path file = fs::temp_directory_path() / fs::unique_path("loom-lambada-%%%%%%.jsonl");
  {
    std::ofstream out(file.string());
    out << R"({"text": "the cat sat on the mat"})" << "\n\n" << R"({"text": "  a b  "})" << "\n";
  }
  const auto bytes = [](const std::string& s) { return std::vector<int32_t>(s.begin(), s.end()); };
  const auto ex = loom::train::read_last_word_examples(file.string(), bytes);
  ASSERT_EQ(ex.size(), 2u);
  EXPECT_EQ(ex[0].context, bytes("the cat sat on the"));
  EXPECT_EQ(ex[0].target, bytes(" mat"));
  EXPECT_EQ(ex[1].context, bytes("  a"));
  EXPECT_EQ(ex[1].target, bytes(" b"));
  // A tokenizer that marks the start of a text (SentencePiece's dummy prefix, here 999):
  // the word's tokens are what follows the context's in the whole text's encoding, not
  // the encoding of " mat" alone (which would start with the marker). The separator is
  // the text's own.
  const auto marked = [&](const std::string& s) {
    std::vector<int32_t> ids = {999};
    for (int32_t b : bytes(s)) ids.push_back(b);
    return ids;
  };
  {
    std::ofstream out(file.string());
    out << R"({"text": "the cat sat on the\tmat"})" << "\n";
  }
  const auto sp = loom::train::read_last_word_examples(file.string(), marked);
  ASSERT_EQ(sp.size(), 1u);
  EXPECT_EQ(sp[0].context, marked("the cat sat on the"));
  EXPECT_EQ(sp[0].target, bytes("\tmat"));
  {
    std::ofstream out(file.string());
    out << R"({"text": "one"})" << "\n";
  }
  try {
    loom::train::read_last_word_examples(file.string(), bytes);
    ADD_FAILURE() << "a one-word text was accepted";
  } catch (const loom::train::DataError& e) {
    EXPECT_NE(std::string(e.what()).find(":1: the text needs a context and a last word"), std::string::npos) << e.what();
  }
  {
    std::ofstream out(file.string());
    out << R"({"txt": "a b"})" << "\n";
  }
  EXPECT_THROW(loom::train::read_last_word_examples(file.string(), bytes), loom::train::DataError);
  // A last word with no room for context is refused naming its line.
  {
    std::ofstream out(file.string());
    out << R"({"text": "a bb"})" << "\n" << R"({"text": "a abcdefgh"})" << "\n";
  }
  try {
    loom::train::LastWordTask(loom::train::read_last_word_examples(file.string(), bytes), 8, 256, "f");
    ADD_FAILURE() << "a last word longer than the sequence was accepted";
  } catch (const loom::train::DataError& e) {
    EXPECT_NE(std::string(e.what()).find("f:2: the last word is 9 tokens"), std::string::npos) << e.what();
  }
  fs::remove(file);
}

// HellaSwag's JSONL: each ending after the context, as the whole text's encoding
// continues the context's; malformed lines are refused naming the line.
TEST(EvalData, ChoiceExamplesFromJsonl) {
  const fs::path file = fs::temp_directory_path() / fs::unique_path("loom-choice-%%%%%%.jsonl");
  const auto bytes = [](const std::string& s) { return std::vector<int32_t>(s.begin(), s.end()); };
  const auto write = [&](const std::string& text) { std::ofstream(file.string()) << text; };
  write(R"({"ctx": "the cat", "endings": ["sat", "ran away", "slept"], "label": 1, "ind": 4})" "\n\n");
  const std::vector<loom::train::ChoiceExample> ex = loom::train::read_choice_examples(file.string(), bytes);
  ASSERT_EQ(ex.size(), 1u);
  EXPECT_EQ(ex[0].label, 1);
  EXPECT_EQ(ex[0].line, 1);
  ASSERT_EQ(ex[0].endings.size(), 3u);
  for (const auto& e : ex[0].endings) EXPECT_EQ(e.context, bytes("the cat"));
  EXPECT_EQ(ex[0].endings[0].target, bytes(" sat"));
  EXPECT_EQ(ex[0].endings[1].target, bytes(" ran away"));
  const auto refusal = [&](const std::string& text) {
    write(text);
    try {
      loom::train::read_choice_examples(file.string(), bytes);
    } catch (const loom::train::DataError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(refusal(R"({"ctx": "a", "endings": ["b", "c"], "label": 2})").find(
                ":1: \"label\" = 2 is not the index of one of its 2 endings"),
            std::string::npos);
  EXPECT_NE(refusal(R"({"ctx": "a", "endings": ["b"], "label": 0})").find("holds 1 ending(s); multiple choice needs two"),
            std::string::npos);
  EXPECT_NE(refusal("{}\n" R"({"ctx": "a"})").find(":1: expected an object with HellaSwag's fields"),
            std::string::npos);
  EXPECT_NE(refusal(R"({"ctx": "a", "endings": ["b", 3], "label": 0})").find("ending 1 is not a string"),
            std::string::npos);
  EXPECT_NE(refusal("not json").find(":1: not JSON"), std::string::npos);
  write(R"({"ctx": "a", "endings": ["b", "c"], "label": "1"})");  // Hugging Face's hellaswag: a string
  EXPECT_EQ(loom::train::read_choice_examples(file.string(), bytes)[0].label, 1);
  EXPECT_NE(refusal(R"({"ctx": "a", "endings": ["b", "c"], "label": "2"})").find("\"label\" = \"2\" is not the index"),
            std::string::npos);
  EXPECT_NE(refusal(R"({"ctx": "a", "endings": ["b", "c"], "label": "x"})").find("expected an object"),
            std::string::npos);
  EXPECT_NE(refusal(R"({"ctx": "a", "endings": ["b", "c"], "label": 18446744073709551615})")
                .find("\"label\" = 18446744073709551615 is not the index"),
            std::string::npos);
  // Only the context's last keep_context tokens are kept (a sequence reads no more).
  write(R"({"ctx": "the cat", "endings": ["sat", "ran"], "label": 0})");
  const std::vector<loom::train::ChoiceExample> kept = loom::train::read_choice_examples(file.string(), bytes, 3);
  for (const auto& e : kept[0].endings) EXPECT_EQ(e.context, bytes("cat"));
  // A codec that cannot encode a text is refused naming the line and the ending.
  const auto no_space = [&](const std::string& s) {
    if (s.find(' ') != std::string::npos) throw std::runtime_error("no token for ' '");
    return bytes(s);
  };
  write(R"({"ctx": "cat", "endings": ["sat", "ran"], "label": 0})");
  try {
    loom::train::read_choice_examples(file.string(), no_space);
    ADD_FAILURE() << "a text the codec cannot encode was accepted";
  } catch (const loom::train::DataError& e) {
    EXPECT_NE(std::string(e.what()).find(":1: the context and ending 0 (after the context and a space): no token"),
              std::string::npos)
        << e.what();
  }
  fs::remove(file);
}

// A target as long as the sequence fits: one context token and the target's first
// seq - 1 tokens are the inputs, every target token predicted; one token more is refused.
TEST(EvalData, ATargetAsLongAsTheSequenceFits) {
  loom::train::LastWordExample e{{5, 6}, {1, 2, 3, 4}, 1};
  const loom::train::LastWordTask task({e}, 4, 13, "f");
  std::vector<int32_t> tokens(4), targets(4);
  task.sample(loom::train::Split::Validation, 0, 4, tokens.data(), targets.data());
  EXPECT_EQ(tokens, (std::vector<int32_t>{6, 1, 2, 3}));
  EXPECT_EQ(targets, (std::vector<int32_t>{1, 2, 3, 4}));
  e.target.push_back(7);
  EXPECT_THROW(loom::train::LastWordTask({e}, 4, 13, "f"), loom::train::DataError);
}

// An example is right when its labelled ending has the least summed loss (accuracy),
// or the least loss per token (accuracy_norm); ties go to the earlier ending.
TEST(EvalData, ChoiceScoresPickTheEndingOfLeastLoss) {
  std::vector<loom::train::ChoiceExample> ex(3);
  for (auto& e : ex) e.endings.resize(2);
  ex[0].label = 0;  // sums 2 < 3; per token 2 > 0.5: right by the sum only
  ex[1].label = 1;  // the same losses: right per token only
  ex[2].label = 0;  // a tie (1, 1 and 1 per token): the earlier ending
  const std::vector<double> sums = {2.0, 3.0, 2.0, 3.0, 1.0, 1.0};
  const std::vector<int64_t> tokens = {1, 6, 1, 6, 1, 1};
  const loom::train::ChoiceScores s = loom::train::score_choices(ex, sums, tokens);
  EXPECT_EQ(s.examples, 3);
  EXPECT_DOUBLE_EQ(s.accuracy, 2.0 / 3.0);
  EXPECT_DOUBLE_EQ(s.accuracy_norm, 2.0 / 3.0);
  ex[2].label = 1;
  const loom::train::ChoiceScores t = loom::train::score_choices(ex, sums, tokens);
  EXPECT_DOUBLE_EQ(t.accuracy, 1.0 / 3.0);
  EXPECT_DOUBLE_EQ(t.accuracy_norm, 1.0 / 3.0);
}

// Each candidate's summed loss and tokens, evaluated one per microbatch, are those of
// evaluating it alone, at any layout (the losses gathered from the last stage and
// every dp rank).
TEST(Eval, ChoiceCandidatesLossesAreEachOnesOwnAtEveryLayout) {
  const Trained m = train_and_gather({});
  std::vector<loom::train::LastWordExample> candidates;
  for (int k = 0; k < 10; ++k) {
    loom::train::LastWordExample e;
    for (int i = 0; i < 3 + k % 5; ++i) e.context.push_back((k * 3 + i * 5) % 13);
    for (int i = 0; i < 1 + k % 4; ++i) e.target.push_back((k + i * 7) % 13);
    candidates.push_back(std::move(e));
  }
  std::vector<double> alone;
  for (const auto& c : candidates) {
    const loom::train::LastWordTask one({c}, 16, m.vocab, "one");
    alone.push_back(evaluate(m, one, 1, {"batch.micro_batch_size=1"}).loss_sum);
  }
  const loom::train::LastWordTask all(candidates, 16, m.vocab, "candidates");
  for (const std::vector<std::string>& layout :
       std::vector<std::vector<std::string>>{{"parallel.dp=1"},
                                             {"parallel.dp=2"},
                                             {"parallel.dp=1", "parallel.tp=2", "parallel.pp=2"}}) {
    std::vector<std::string> one_each = layout;
    one_each.insert(one_each.end(), {"batch.micro_batch_size=1", "batch.global_batch_size=4"});
    const loom::train::RunPlan plan =
        loom::testing::plan_from(m.manifest_toml, loom::testing::with_overrides(one_each, {"checkpoint.dir=\"\"",
                                                                                           "run.eval_every=0"}));
    const loom::train::Evaluation e = loom::train::evaluate(plan, m.weights, m.vocab, all, all.size(), true);
    ASSERT_EQ(e.sample_loss_sums.size(), candidates.size()) << layout.back();
    for (size_t i = 0; i < candidates.size(); ++i) {
      EXPECT_NEAR(e.sample_loss_sums[i], alone[i], 1e-5 * alone[i]) << layout.back() << " candidate " << i;
      EXPECT_EQ(e.sample_tokens[i], static_cast<int64_t>(candidates[i].target.size())) << layout.back();
    }
  }
}

}  // namespace
