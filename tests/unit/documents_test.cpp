// Documents packed in a sequence (data.reset_attention_mask, data.reset_position_ids;
// ABI 1.22 document_start and position_ids): with both, a document that follows
// another in a packed sequence computes what it computes alone at the start of a
// sequence (the model-level property Megatron-LM's flags are for), for GPT-2's learned
// positions and Llama's rotary ones, with grouped queries and a sliding window; every
// parallel layout trains as the serial run does; the settings are checked before a run.
#include "support/rank_trace.hpp"
#include "support/train_fixture.hpp"

#include "engine/model/model.hpp"
#include "engine/train/microbatches.hpp"
#include "engine/train/preflight.hpp"

#include <boost/filesystem.hpp>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = boost::filesystem;

constexpr int32_t kEnd = 12;  // the synthetic task's end marker, standing in for <|endoftext|>

const std::vector<std::string> kLlama = {
    "model.layer.embedding.position_embedding=rope", "model.layer.attention.position_embedding=rope",
    "model.layer.attention.num_query_groups=2",      "model.layer.attention.norm=rmsnorm",
    "model.layer.attention.bias=false",              "model.layer.mlp.norm=rmsnorm",
    "model.layer.mlp.activation=swiglu",             "model.layer.mlp.bias=false",
    "model.layer.lm_head.norm=rmsnorm"};

// One forward of the model's first microbatch slot: tokens [S, B], targets (-1: no
// loss), the document inputs (empty: none); returns the summed loss and its count.
struct Forward {
  double loss = 0;
  int64_t count = 0;
};

Forward forward(loom::runtime::RankRuntime& rt, loom::model::Model& model, const std::vector<int32_t>& tokens,
                const std::vector<int32_t>& targets, const std::vector<int32_t>& starts,
                const std::vector<int32_t>& positions) {
  const loom::Device dev = rt.dev();
  auto upload = [&](const std::vector<int32_t>& v) {
    loom::Buffer b(&rt, std::max<size_t>(1, v.size()) * sizeof(int32_t));
    if (!v.empty()) dev.copy(b.get(), v.data(), v.size() * sizeof(int32_t), LOOM_COPY_HOST_TO_DEVICE);
    return b;
  };
  const loom::Buffer t = upload(tokens), g = upload(targets), s = upload(starts), p = upload(positions);
  float sum = 0;
  int64_t count = 0;
  model.forward_chunk(0, 0, t.get<int32_t>(), g.get<int32_t>(), false, 0, &sum, &count, nullptr, nullptr,
                      starts.empty() ? nullptr : s.get<int32_t>(), positions.empty() ? nullptr : p.get<int32_t>());
  model.release(0);
  return {sum, count};
}

// Each batch element packs a document of `first` tokens (its last the end marker)
// and then document B; B alone starts a sequence (the rest after it is filler, which
// causal attention never reads). The loss over B's next tokens is compared.
void check_packed_equals_alone(const std::vector<std::string>& model_options, int64_t first) {
  const loom::train::RunPlan plan = loom::testing::plan_from(loom::testing::tiny_manifest(), model_options);
  loom::testing::on_one_rank(plan, [&](loom::runtime::RankRuntime& rt, const loom::train::DataSource&,
                                       const loom_model_dims& dims) {
    loom::model::Model model(plan.config, *plan.registry, rt, dims, plan.layers, 5);
    const int64_t S = dims.seq_len, B = dims.micro_batch;
    std::mt19937 rng(static_cast<unsigned>(first));
    std::vector<int32_t> packed(static_cast<size_t>(S * B)), alone(packed.size());
    for (int32_t& t : packed) t = static_cast<int32_t>(rng() % kEnd);  // no end marker by chance
    for (int32_t& t : alone) t = static_cast<int32_t>(rng() % kEnd);
    std::vector<int32_t> packed_targets(packed.size(), -1), alone_targets(packed.size(), -1);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t f = first + b;  // each element's first document ends elsewhere
      packed[static_cast<size_t>((f - 1) * B + b)] = kEnd;
      for (int64_t i = 0; f + i < S; ++i) alone[static_cast<size_t>(i * B + b)] = packed[static_cast<size_t>((f + i) * B + b)];
      for (int64_t i = 0; f + i + 1 < S; ++i) {
        packed_targets[static_cast<size_t>((f + i) * B + b)] = packed[static_cast<size_t>((f + i + 1) * B + b)];
        alone_targets[static_cast<size_t>(i * B + b)] = packed[static_cast<size_t>((f + i + 1) * B + b)];
      }
    }
    const std::vector<int32_t> starts = loom::train::document_starts(packed, S, B, kEnd);
    const std::vector<int32_t> positions = loom::train::document_positions(starts, B);
    const Forward want = forward(rt, model, alone, alone_targets, {}, {});
    const Forward got = forward(rt, model, packed, packed_targets, starts, positions);
    ASSERT_GT(want.count, 0);
    EXPECT_EQ(got.count, want.count);
    EXPECT_NEAR(got.loss, want.loss, 2e-6 * std::fabs(want.loss)) << "document B packed after another";
    // The test can fail: without the inputs B sees the document before it.
    const Forward mixed = forward(rt, model, packed, packed_targets, {}, {});
    EXPECT_GT(std::fabs(mixed.loss - want.loss), 1e-4 * std::fabs(want.loss)) << "the documents never met";
    // Rotary embeddings see relative positions only: the mask alone suffices there;
    // learned positions need the reset as well.
    const Forward masked_only = forward(rt, model, packed, packed_targets, starts, {});
    const bool rotary = model_options.size() > 0 && model_options[0] == kLlama[0];
    if (rotary)
      EXPECT_NEAR(masked_only.loss, want.loss, 2e-6 * std::fabs(want.loss)) << "rope with the mask alone";
    else
      EXPECT_GT(std::fabs(masked_only.loss - want.loss), 1e-4 * std::fabs(want.loss)) << "learned positions not reset";
  });
}

TEST(PackedDocuments, APackedDocumentComputesAsTheDocumentAlone) {
  for (int64_t first : {1, 5, 9}) {
    SCOPED_TRACE("first document of " + std::to_string(first) + " tokens");
    check_packed_equals_alone({}, first);  // GPT-2's blocks, learned positions
    check_packed_equals_alone(kLlama, first);
    check_packed_equals_alone(loom::testing::with_overrides(kLlama, {"model.layer.attention.sliding_window=4"}), first);
  }
}

TEST(PackedDocuments, StartsAndPositionsAreMegatronsMasksAndPositionIds) {
  // [S = 6, B = 2]: b 0 = a b EOD c EOD d, b 1 = EOD a b c d e.
  const std::vector<int32_t> tokens = {1, kEnd, 2, 1, kEnd, 2, 3, 3, kEnd, 4, 4, 5};
  const std::vector<int32_t> starts = loom::train::document_starts(tokens, 6, 2, kEnd);
  EXPECT_EQ(starts, (std::vector<int32_t>{0, 0, 0, 1, 0, 1, 3, 1, 3, 1, 5, 1}));
}

// Training on lines of text (each line a document, the newline its end) with both
// settings: every layout equals the serial run; the settings change training.
class PackedDocumentLayouts : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(loom::testing::scratch_dir("documents"));
    // Lines of 3 to 40 letters and spaces: a sequence of 32 holds one to several.
    std::mt19937 rng(11);
    std::ofstream out(*dir_ + "/lines.txt");
    for (int line = 0; line < 600; ++line) {
      const int n = 3 + static_cast<int>(rng() % 38);
      for (int c = 0; c < n; ++c) out << (rng() % 5 == 0 ? ' ' : static_cast<char>('a' + rng() % 12));
      out << '\n';
    }
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }
  static loom::testing::RankTrace run(std::vector<std::string> o, bool documents = true) {
    o.insert(o.begin(), {"model.seq_length=32", "data.kind=\"text\"", "data.path=\"" + *dir_ + "/lines.txt\"",
                         "data.eod_token=10", "optimizer.eps=1e-6"});
    if (documents) o.insert(o.end(), {"data.reset_attention_mask=true", "data.reset_position_ids=true"});
    return loom::testing::run_all_ranks(loom::testing::tiny_manifest() + "\n[parallel]\n", o);
  }
  static void expect_same(const loom::testing::RankTrace& serial, const loom::testing::RankTrace& par) {
    ASSERT_EQ(par.loss.size(), serial.loss.size());
    for (size_t s = 0; s < serial.loss.size(); ++s) {
      EXPECT_NEAR(par.loss[s], serial.loss[s], 1e-5 * std::fabs(serial.loss[s])) << "loss at step " << s + 1;
      EXPECT_NEAR(par.result.steps[s].grad_norm, serial.result.steps[s].grad_norm,
                  1e-5 * serial.result.steps[s].grad_norm)
          << "gradient norm at step " << s + 1;
    }
  }
  static std::string* dir_;
};
std::string* PackedDocumentLayouts::dir_ = nullptr;

TEST_F(PackedDocumentLayouts, EveryLayoutTrainsAsTheSerialRun) {
  for (const std::vector<std::string>& model :
       {std::vector<std::string>{}, loom::testing::with_overrides(kLlama, {"model.layer.attention.sliding_window=7"})}) {
    SCOPED_TRACE(model.empty() ? "GPT-2 blocks" : "Llama blocks with a sliding window");
    const loom::testing::RankTrace serial = run(model);
    EXPECT_GT(std::fabs(run(model, false).loss.back() - serial.loss.back()), 1e-4) << "the documents changed nothing";
    for (const std::vector<std::string>& layout :
         std::vector<std::vector<std::string>>{{"parallel.cp=2"},
                                               {"parallel.cp=4"},
                                               {"parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"},
                                               {"parallel.pp=2"},
                                               {"parallel.dp=2", "optimizer.strategy=\"distributed\""},
                                               {"exec.mode=\"partial_graph\""},
                                               {"model.recompute_granularity=\"full\""}}) {
      SCOPED_TRACE(layout.front() + (layout.size() > 1 ? " ..." : ""));
      expect_same(serial, run(loom::testing::with_overrides(model, layout)));
    }
  }
}

TEST(PackedDocuments, SettingsAreCheckedBeforeARun) {
  auto refusal = [](const std::vector<std::string>& o) {
    try {
      const loom::train::RunPlan plan = loom::testing::plan_from(loom::testing::tiny_manifest(), o);
      loom::train::preflight(plan, 1);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(refusal({"data.reset_attention_mask=true"}).find("data.reset_attention_mask looks for end-of-document tokens "
                                                             "in the data; data.kind = \"synthetic\" has no documents"),
            std::string::npos);
  const std::string dir = loom::testing::scratch_dir("documents-refusals");
  std::ofstream(dir + "/t.txt") << std::string(400, 'x');
  const std::vector<std::string> text = {"data.kind=\"text\"", "data.path=\"" + dir + "/t.txt\""};
  EXPECT_NE(refusal(loom::testing::with_overrides(text, {"data.reset_position_ids=true"}))
                .find("data.reset_position_ids needs the end-of-document token: set data.eod_token to the byte that "
                      "ends a document (e.g. 10, a newline)"),
            std::string::npos);
  EXPECT_NE(refusal(loom::testing::with_overrides(text, {"data.reset_position_ids=true", "data.eod_token=300"}))
                .find("data.eod_token = 300 is outside the vocabulary of 256 tokens"),
            std::string::npos);
  EXPECT_EQ(refusal(loom::testing::with_overrides(text, {"data.reset_position_ids=true", "data.eod_token=10"})), "");
  // An end token the data never holds makes the settings change nothing: the run says so.
  auto log_of = [&](const std::string& eod) {
    loom::train::TrainOptions opts;
    std::ostringstream log;
    opts.log = &log;
    loom::train::train(loom::testing::plan_from(loom::testing::tiny_manifest(),
                                                loom::testing::with_overrides(text, {"data.reset_attention_mask=true",
                                                                                     "data.eod_token=" + eod,
                                                                                     "run.steps=1"})),
                       opts);
    return log.str();
  };
  EXPECT_NE(log_of("10").find("data: warning: the end-of-document token 10 occurs in none of the first 64 training "
                              "sequences"),
            std::string::npos);
  EXPECT_EQ(log_of("120").find("data: warning"), std::string::npos) << "'x' is 120, in every sequence";
  fs::remove_all(dir);
}

}  // namespace
