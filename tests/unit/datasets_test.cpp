// Training data from documents and blends (engine/train/documents.hpp, blend.hpp): a
// Megatron indexed dataset is split by document, each epoch visits a shuffled
// concatenation of its training documents with every token a target once, samples are
// pure functions of their index (exact on resume); a blend holds each dataset's share
// in every prefix of its samples to within one sample; the manifest names blends as
// Megatron-LM's --data-path does and refuses what does not fit.
#include "support/train_fixture.hpp"

#include "engine/text/token_files.hpp"
#include "engine/text/tokenizer.hpp"
#include "engine/train/text_codec.hpp"
#include "engine/train/blend.hpp"
#include "engine/train/documents.hpp"

#include <boost/filesystem.hpp>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <random>
#include <set>

namespace {

namespace fs = boost::filesystem;
using loom::train::Split;

// Document d holds tokens d * 100 .. d * 100 + 20 + 9 d - 1: every token names its place.
std::vector<std::vector<int32_t>> numbered_documents(int n) {
  std::vector<std::vector<int32_t>> docs(static_cast<size_t>(n));
  for (int d = 0; d < n; ++d)
    for (int i = 0; i < 20 + 9 * d; ++i) docs[static_cast<size_t>(d)].push_back(d * 100 + i);
  return docs;
}

TEST(Documents, EachEpochVisitsItsShuffledDocumentsWithEveryTokenATargetOnce) {
  const loom::train::DocumentSource src(numbered_documents(7), 1000, 0.3, 5, "docs");
  EXPECT_EQ(src.documents_of(Split::Train), (std::vector<uint32_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(src.documents_of(Split::Validation), (std::vector<uint32_t>{5, 6}));
  const int64_t seq = 16;
  for (uint64_t epoch : {0u, 1u}) {
    std::vector<int32_t> stream;  // the epoch's documents, in its order
    for (uint32_t d : src.document_order(Split::Train, epoch))
      for (int i = 0; i < 20 + 9 * static_cast<int>(d); ++i) stream.push_back(static_cast<int32_t>(d) * 100 + i);
    const uint64_t per_epoch = (stream.size() - 1) / seq;
    std::set<int64_t> starts;
    std::vector<int32_t> tokens(seq), targets(seq);
    for (uint64_t k = 0; k < per_epoch; ++k) {
      src.sample(Split::Train, epoch * per_epoch + k, seq, tokens.data(), targets.data());
      const int64_t at = std::find(stream.begin(), stream.end(), tokens[0]) - stream.begin();
      for (int64_t t = 0; t < seq; ++t) {
        ASSERT_EQ(tokens[t], stream[static_cast<size_t>(at + t)]) << "epoch " << epoch << ", sample " << k;
        ASSERT_EQ(targets[t], stream[static_cast<size_t>(at + t + 1)]);
      }
      starts.insert(at);
    }
    // The samples tile the stream: starts 0, seq, 2 seq, ... each once.
    ASSERT_EQ(starts.size(), per_epoch);
    EXPECT_EQ(*starts.rbegin(), static_cast<int64_t>((per_epoch - 1) * seq));
    for (int64_t s : starts) EXPECT_EQ(s % seq, 0);
  }
  EXPECT_NE(src.document_order(Split::Train, 0), src.document_order(Split::Train, 1));
  // Validation samples read validation documents only.
  std::vector<int32_t> tokens(seq), targets(seq);
  for (uint64_t i = 0; i < 20; ++i) {
    src.sample(Split::Validation, i, seq, tokens.data(), targets.data());
    for (int32_t t : tokens) EXPECT_GE(t, 500);
  }
}

TEST(Documents, SampleIIsAFunctionOfTheSeedAndI) {
  const loom::train::DocumentSource a(numbered_documents(9), 1000, 0.1, 5, "a"), b(numbered_documents(9), 1000, 0.1, 5, "b"),
      other(numbered_documents(9), 1000, 0.1, 6, "c");
  std::vector<int32_t> t1(16), g1(16), t2(16), g2(16);
  bool differs = false;
  for (uint64_t i = 60; i-- > 0;) {  // backwards: no state carried from the previous call
    a.sample(Split::Train, i, 16, t1.data(), g1.data());
    b.sample(Split::Train, i, 16, t2.data(), g2.data());
    EXPECT_EQ(t1, t2);
    EXPECT_EQ(g1, g2);
    other.sample(Split::Train, i, 16, t2.data(), g2.data());
    differs |= t1 != t2;
  }
  EXPECT_TRUE(differs) << "another run.seed read the same samples";
}

// A source whose sample says which dataset and index it is.
class Labelled : public loom::train::DataSource {
 public:
  explicit Labelled(int id) : id_(id) {}
  int64_t vocab_size() const override { return 10 + id_; }
  std::string describe() const override { return "labelled " + std::to_string(id_); }
  void sample(Split split, uint64_t index, int64_t seq, int32_t* tokens, int32_t* targets) const override {
    for (int64_t t = 0; t < seq; ++t) {
      tokens[t] = id_;
      targets[t] = static_cast<int32_t>(index) * 2 + (split == Split::Train ? 0 : 1);
    }
  }

 private:
  int id_;
};

TEST(Blend, EveryPrefixHoldsEachShareWithinOneSample) {
  std::vector<std::unique_ptr<loom::train::DataSource>> parts;
  for (int d = 0; d < 3; ++d) parts.push_back(std::make_unique<Labelled>(d));
  const loom::train::BlendedSource blend(std::move(parts), {5, 3, 2});  // normalised: 0.5, 0.3, 0.2
  EXPECT_EQ(blend.vocab_size(), 12);
  const double w[3] = {0.5, 0.3, 0.2};
  for (Split split : {Split::Train, Split::Validation}) {
    uint64_t taken[3] = {0, 0, 0};
    std::vector<int32_t> tokens(4), targets(4);
    for (uint64_t i = 0; i < 10000; ++i) {  // past two blocks of 4096
      blend.sample(split, i, 4, tokens.data(), targets.data());
      const int d = tokens[0];
      // Each dataset's samples in order: its next one.
      ASSERT_EQ(targets[0], static_cast<int32_t>(taken[d]) * 2 + (split == Split::Train ? 0 : 1)) << i;
      ++taken[d];
      for (int k = 0; k < 3; ++k)
        ASSERT_LE(std::fabs(static_cast<double>(taken[k]) - w[k] * static_cast<double>(i + 1)), 1.0) << "sample " << i;
    }
  }
  // A fresh blend asked out of order (a resumed run, another dp rank) assigns alike.
  std::vector<std::unique_ptr<loom::train::DataSource>> again;
  for (int d = 0; d < 3; ++d) again.push_back(std::make_unique<Labelled>(d));
  const loom::train::BlendedSource fresh(std::move(again), {5, 3, 2});
  for (uint64_t i : {9999u, 17u, 8191u, 4096u, 0u, 12345u})
    EXPECT_EQ(fresh.source_of(Split::Train, i), blend.source_of(Split::Train, i)) << i;
}

void write_indexed(const std::string& prefix, const std::vector<std::vector<int32_t>>& docs) {
  loom::text::IndexedDatasetWriter w(prefix, loom::text::TokenType::U16);
  for (const auto& doc : docs) w.add_document(doc);
  w.finish();
}

// The manifest's data.blend: two indexed datasets mixed 3:1 train a model; the
// samples come from both in that share; misuses are refused naming the key.
TEST(Blend, ManifestBlendsIndexedDatasets) {
  const std::string dir = loom::testing::scratch_dir("blend");
  std::vector<std::vector<int32_t>> a, b;
  for (int d = 0; d < 6; ++d) {
    a.emplace_back();
    b.emplace_back();
    for (int i = 0; i < 40; ++i) {
      a.back().push_back((d * 7 + i) % 20);        // tokens 0..19
      b.back().push_back(20 + (d * 3 + i) % 30);  // tokens 20..49
    }
  }
  write_indexed(dir + "/a", a);
  write_indexed(dir + "/b", b);
  const std::vector<std::string> blend = {"data.kind=\"indexed\"",
                                          "data.blend=[3, \"" + dir + "/a\", 1, \"" + dir + "/b\"]"};
  const auto plan = loom::testing::plan_from(loom::testing::tiny_manifest(), blend);
  const auto src = loom::train::make_data_source(plan.config);
  EXPECT_EQ(src->vocab_size(), 50);
  int from_a = 0;
  std::vector<int32_t> tokens(16), targets(16);
  for (uint64_t i = 0; i < 400; ++i) {
    src->sample(Split::Train, i, 16, tokens.data(), targets.data());
    from_a += tokens[0] < 20 ? 1 : 0;
  }
  EXPECT_EQ(from_a, 300);
  std::vector<std::string> run = blend;
  run.insert(run.end(), {"run.steps=3", "model.vocab_size=64"});
  const loom::train::TrainResult r = loom::train::train(loom::testing::plan_from(loom::testing::tiny_manifest(), run), {});
  ASSERT_EQ(r.steps.size(), 3u);
  EXPECT_TRUE(std::isfinite(r.steps.back().loss));

  auto refusal = [&](std::vector<std::string> o) {
    try {
      loom::testing::plan_from(loom::testing::tiny_manifest(), o);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(refusal({"data.blend=[3, \"a\"]"}).find("data.blend mixes token datasets: set data.kind"), std::string::npos);
  EXPECT_NE(refusal({"data.kind=\"indexed\"", "data.path=\"x\"", "data.blend=[3, \"a\"]"}).find("data.blend and data.path both"),
            std::string::npos);
  EXPECT_NE(refusal({"data.kind=\"indexed\"", "data.blend=[0, \"a\"]"}).find("positive weight at position 1"),
            std::string::npos);
  EXPECT_NE(refusal({"data.kind=\"indexed\"", "data.blend=[1, \"a\", 2]"}).find("be pairs of a weight and a path"),
            std::string::npos);
  fs::remove_all(dir);
}

// data.eod_mask_loss (Megatron-LM's --eod-mask-loss): a position whose input token ends a
// document has no loss (target -1); every other target is the unmasked one. Training
// reads the masked targets (its first loss, a forward of the same weights on the same
// tokens, differs), and what cannot be masked is refused before a run starts.
TEST(Data, EodMaskLossDropsTheTargetAfterEachDocumentsEnd) {
  const std::string dir = loom::testing::scratch_dir("eod_mask");
  constexpr int32_t kEod = 7;
  std::vector<std::vector<int32_t>> docs(12);
  for (size_t d = 0; d < docs.size(); ++d) {
    for (size_t i = 0; i < 5 + d; ++i) docs[d].push_back(static_cast<int32_t>(10 + (d * 3 + i) % 40));
    docs[d].push_back(kEod);
  }
  write_indexed(dir + "/ds", docs);
  const std::vector<std::string> data = {"data.kind=\"indexed\"", "data.path=\"" + dir + "/ds\"",
                                         "model.vocab_size=64", "run.steps=1"};
  std::vector<std::string> masked = data;
  masked.insert(masked.end(), {"data.eod_mask_loss=true", "data.eod_token=" + std::to_string(kEod)});
  const auto plain = loom::train::make_data_source(loom::testing::plan_from(loom::testing::tiny_manifest(), data).config);
  const auto mask = loom::train::make_data_source(loom::testing::plan_from(loom::testing::tiny_manifest(), masked).config);
  int eods = 0;
  for (Split split : {Split::Train, Split::Validation})
    for (uint64_t i = 0; i < 20; ++i) {
      std::vector<int32_t> t0(16), g0(16), t1(16), g1(16);
      plain->sample(split, i, 16, t0.data(), g0.data());
      mask->sample(split, i, 16, t1.data(), g1.data());
      ASSERT_EQ(t0, t1) << "the mask changes targets only";
      for (size_t s = 0; s < 16; ++s) {
        EXPECT_EQ(g1[s], t1[s] == kEod ? -1 : g0[s]) << "sample " << i << " position " << s;
        eods += t1[s] == kEod ? 1 : 0;
      }
    }
  EXPECT_GT(eods, 20) << "the samples must cross document ends for the test to mean anything";
  const auto first_loss = [&](const std::vector<std::string>& o) {
    return loom::train::train(loom::testing::plan_from(loom::testing::tiny_manifest(), o), {}).steps.at(0).loss;
  };
  EXPECT_NE(first_loss(data), first_loss(masked));

  const auto refusal = [&](std::vector<std::string> o) {
    try {
      o.insert(o.begin(), data.begin(), data.end());
      loom::train::make_data_source(loom::testing::plan_from(loom::testing::tiny_manifest(), o).config);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(refusal({"data.eod_mask_loss=true"}).find("set data.tokenizer (its <|endoftext|> or </s>) or data.eod_token"),
            std::string::npos);
  EXPECT_NE(refusal({"data.eod_mask_loss=true", "data.eod_token=64"})
                .find("data.eod_token = 64 is outside the vocabulary of 64 tokens"),
            std::string::npos);
  EXPECT_NE(refusal({"data.kind=\"synthetic\"", "data.eod_mask_loss=true", "data.eod_token=3"})
                .find("data.kind = \"synthetic\" has no documents"),
            std::string::npos);
  const loom::train::RunPlan unused =
      loom::testing::plan_from(loom::testing::tiny_manifest(), {"data.eod_token=3"});
  ASSERT_EQ(unused.warnings.size(), 1u);
  EXPECT_NE(unused.warnings[0].find("with all three false it changes nothing"), std::string::npos);
  fs::remove_all(dir);
}

// data.tokenizer: the vocabulary of token files is their tokenizer's, not the largest
// id a sample of data happens to hold (a model of that size could not be used with the
// tokenizer it was trained with); generate and eval take it without --tokenizer.
TEST(Data, TheTokenizersVocabularyIsTheModels) {
  const std::string dir = loom::testing::scratch_dir("data_tokenizer");
  {
    std::mt19937 rng(3);
    std::ofstream text(dir + "/corpus.txt");
    for (int line = 0; line < 3000; ++line) {
      for (int word = 0; word < 8; ++word) {
        const int letters = 2 + static_cast<int>(rng() % 6);
        for (int c = 0; c < letters; ++c) text << static_cast<char>('a' + rng() % 20);
        text << ' ';
      }
      text << "\n";
    }
  }
  loom::text::SentencePieceTraining how;
  how.inputs = {dir + "/corpus.txt"};
  how.model_prefix = dir + "/spm";
  how.vocab_size = 300;
  loom::text::train_sentencepiece(how);
  const std::string model = dir + "/spm.model";
  std::vector<std::vector<int32_t>> docs = numbered_documents(2);  // ids below 200
  write_indexed(dir + "/ds", docs);
  const std::vector<std::string> data = {"data.kind=\"indexed\"", "data.path=\"" + dir + "/ds\""};
  const auto vocab = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), data.begin(), data.end());
    return loom::train::make_data_source(loom::testing::plan_from(loom::testing::tiny_manifest(), extra).config)
        ->vocab_size();
  };
  EXPECT_EQ(vocab({}), 129) << "without a tokenizer: the data's largest id + 1";
  EXPECT_EQ(vocab({"data.tokenizer=\"" + model + "\""}), 300);
  EXPECT_EQ(vocab({"data.tokenizer=\"" + model + "\"", "model.vocab_size=320"}), 320) << "a larger one is the model's";
  // data.eod_mask_loss takes the tokenizer's end-of-document token when not given one.
  {
    std::vector<std::string> o = data;
    o.insert(o.end(), {"data.tokenizer=\"" + model + "\"", "data.eod_mask_loss=true"});
    const int32_t eod = loom::text::load_tokenizer(model)->eod();
    ASSERT_GE(eod, 0);
    EXPECT_NE(loom::train::make_data_source(loom::testing::plan_from(loom::testing::tiny_manifest(), o).config)
                  ->describe()
                  .find("no loss after end-of-document token " + std::to_string(eod)),
              std::string::npos);
  }
  try {
    vocab({"data.tokenizer=\"" + model + "\"", "model.vocab_size=200"});
    ADD_FAILURE() << "a vocabulary smaller than the tokenizer's must be refused";
  } catch (const loom::train::DataError& e) {
    EXPECT_NE(std::string(e.what()).find("model.vocab_size = 200 is smaller than data.tokenizer's 300"),
              std::string::npos)
        << e.what();
  }
  try {
    vocab({"data.tokenizer=\"" + dir + "/none.model\""});
    ADD_FAILURE() << "a tokenizer that does not load must be refused";
  } catch (const loom::train::DataError& e) {
    EXPECT_NE(std::string(e.what()).find("data.tokenizer: "), std::string::npos) << e.what();
  }
  try {
    loom::testing::plan_from(loom::testing::tiny_manifest(),
                             {"data.kind=\"text\"", "data.path=\"" + dir + "/corpus.txt\"",
                              "data.tokenizer=\"" + model + "\""});
    ADD_FAILURE() << "a tokenizer for text (bytes) must be refused";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("data.tokenizer names the tokenizer of token files"), std::string::npos)
        << e.what();
  }
  // A path relative to the manifest that names it: a copy of the plan (what plan --perf
  // measures) finds it, and the manifest a checkpoint keeps names it absolutely (for
  // generate, eval and export run from anywhere).
  fs::create_directories(dir + "/cfg");
  std::ofstream(dir + "/cfg/tiny.toml") << loom::testing::tiny_manifest();
  std::ofstream(dir + "/cfg/m.toml")
      << "extends = \"tiny.toml\"\n[data]\nkind = \"indexed\"\npath = \"../ds\"\ntokenizer = \"../spm.model\"\n";
  const loom::train::RunPlan from_file =
      loom::train::make_plan(loom::manifest::Manifest::load(dir + "/cfg/m.toml"), loom::plugins::registry());
  EXPECT_EQ(loom::train::make_data_source(loom::train::replan(from_file, {}).config)->vocab_size(), 300);
  const std::string saved = loom::train::saved_manifest(from_file);
  EXPECT_NE(saved.find("tokenizer = \"" + fs::absolute(model).lexically_normal().string() + "\""), std::string::npos)
      << saved;
  // What generate and eval read text with, given no --tokenizer.
  std::vector<std::string> with = data;
  with.push_back("data.tokenizer=\"" + model + "\"");
  const loom::train::TextCodec codec("", loom::testing::plan_from(loom::testing::tiny_manifest(), with).config);
  EXPECT_EQ(codec.vocab(), 300);
  EXPECT_EQ(codec.decode(codec.encode("abc de")), "abc de");
  fs::remove_all(dir);
}

}  // namespace
