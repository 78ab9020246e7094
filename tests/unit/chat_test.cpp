// Conversations as training samples (data.kind = "chat"): a line's tokens and the
// assistant turns' targets, several conversations of a line each ended, padding and
// cutting at the sequence length, the splits and the epochs' orders; refusals.
// (tests/text/chat_test.sh checks the templates against the models' Jinja templates and
// fine-tunes end to end.)
#include "support/byte_level_vocab.hpp"
#include "support/train_fixture.hpp"

#include "engine/manifest/run_config.hpp"
#include "engine/text/chat_template.hpp"
#include "engine/train/chat_data.hpp"

#include <boost/filesystem.hpp>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <set>
#include <string>
#include <vector>

namespace {

using loom::train::Split;
using I = std::vector<int32_t>;

constexpr int32_t kStart = 256, kEnd = 257, kEod = 258;  // <|im_start|>, <|im_end|>, <|endoftext|>

// A byte-level tokenizer.json without merges and ChatML's special tokens.
std::string write_tokenizer(const std::string& dir) {
  nlohmann::json vocab = loom::testing::byte_level_vocab();
  nlohmann::json added = nlohmann::json::array();
  for (const auto& [id, text] : {std::pair<int, const char*>{kStart, "<|im_start|>"}, {kEnd, "<|im_end|>"},
                                 {kEod, "<|endoftext|>"}}) {
    vocab[text] = id;
    added.push_back({{"id", id}, {"content", text}, {"special", true}});
  }
  const nlohmann::json j = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}},
                            {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
                            {"decoder", {{"type", "ByteLevel"}}},
                            {"added_tokens", added}};
  boost::filesystem::create_directories(dir);
  std::ofstream(dir + "/tokenizer.json") << j.dump();
  std::ofstream(dir + "/tokenizer_config.json") << nlohmann::json({{"eos_token", "<|endoftext|>"}}).dump();
  return dir;
}

// Byte ids of text with ChatML's markers as their tokens (this tokenizer has no merges).
I ids_of(const std::string& text) {
  I out;
  for (size_t i = 0; i < text.size();) {
    if (text.compare(i, 12, "<|im_start|>") == 0) out.push_back(kStart), i += 12;
    else if (text.compare(i, 10, "<|im_end|>") == 0) out.push_back(kEnd), i += 10;
    else out.push_back(static_cast<unsigned char>(text[i++]));
  }
  return out;
}

struct ChatData {
  std::string dir = loom::testing::scratch_dir("chat");
  loom::manifest::RunConfig config;
  ChatData() {
    config.data.kind = "chat";
    config.data.tokenizer = write_tokenizer(dir + "/tok");
    config.data.chat_template = "chatml";
    config.data.path = dir + "/data.jsonl";
    config.data.val_fraction = 0;
    config.run.seed = 7;
  }
  ~ChatData() { boost::filesystem::remove_all(dir); }
  std::unique_ptr<loom::train::DataSource> source(const std::vector<nlohmann::json>& lines) {
    std::ofstream out(config.data.path);
    for (const nlohmann::json& l : lines) out << l.dump() << "\n\n";  // blank lines are skipped
    out.close();
    return loom::train::chat_source(config, 0);
  }
};

nlohmann::json line(std::initializer_list<std::pair<const char*, std::string>> messages) {
  nlohmann::json m = nlohmann::json::array();
  for (const auto& [role, content] : messages) m.push_back({{"role", role}, {"content", content}});
  return {{"messages", m}};
}

TEST(Chat, ASampleIsItsLinesTokensWithTheAssistantsTurnsAsTargets) {
  ChatData d;
  const auto src = d.source({line({{"user", "hi"}, {"assistant", "yo"}})});
  const std::string prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
  I want = ids_of(prompt + "yo<|im_end|>\n");
  want.push_back(kEod);  // each conversation ends with the end-of-document token, a target
  const int64_t seq = static_cast<int64_t>(want.size()) + 3;
  I tokens(seq), targets(seq);
  src->sample(Split::Train, 0, seq, tokens.data(), targets.data());
  const size_t answer = ids_of(prompt).size();  // the first target: "y"
  for (int64_t t = 0; t < seq; ++t) {
    const size_t at = static_cast<size_t>(t);
    EXPECT_EQ(tokens[at], at < want.size() ? want[at] : kEod) << "position " << t << " (padding: eod)";
    const bool counted = at + 1 >= answer && at + 1 < want.size();
    EXPECT_EQ(targets[at], counted ? want[at + 1] : -1) << "position " << t;
  }
  // Cut at seq + 1 tokens: the targets up to the last token kept.
  const int64_t short_seq = static_cast<int64_t>(answer) + 1;
  I t2(short_seq), g2(short_seq);
  src->sample(Split::Train, 0, short_seq, t2.data(), g2.data());
  EXPECT_EQ(I(t2.begin(), t2.end()), I(want.begin(), want.begin() + short_seq));
  EXPECT_EQ(g2[answer - 1], want[answer]);
  EXPECT_EQ(g2[answer], want[answer + 1]);
  EXPECT_NE(src->warning(short_seq).find("1 of 1 lines of conversations are longer than seq_length + 1"),
            std::string::npos);
  EXPECT_EQ(src->warning(short_seq).find("keep no assistant token"), std::string::npos);
  EXPECT_NE(src->warning(static_cast<int64_t>(answer) - 2).find("1 of them keep no assistant token"), std::string::npos);
  EXPECT_EQ(src->warning(seq), "");
  EXPECT_NE(src->describe().find("(chat template chatml)"), std::string::npos) << src->describe();
}

TEST(Chat, ASystemMessageStartsAnotherConversationOfTheLine) {
  ChatData d;
  const auto src = d.source({line({{"system", "s"}, {"user", "a"}, {"assistant", "b"}, {"system", "t"},
                                   {"user", "c"}, {"assistant", "d"}})});
  I want;
  for (const char* conv : {"<|im_start|>system\ns<|im_end|>\n<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n"
                           "b<|im_end|>\n",
                           "<|im_start|>system\nt<|im_end|>\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n"
                           "d<|im_end|>\n"}) {
    const I ids = ids_of(conv);
    want.insert(want.end(), ids.begin(), ids.end());
    want.push_back(kEod);
  }
  const int64_t seq = static_cast<int64_t>(want.size()) - 1;
  I tokens(seq), targets(seq);
  src->sample(Split::Train, 0, seq, tokens.data(), targets.data());
  EXPECT_EQ(tokens, I(want.begin(), want.end() - 1));
  // Targets: "b<|im_end|>\n<eod>" and "d<|im_end|>\n<eod>", nothing else.
  I counted;
  for (int32_t t : targets)
    if (t >= 0) counted.push_back(t);
  EXPECT_EQ(counted, (I{'b', kEnd, '\n', kEod, 'd', kEnd, '\n', kEod}));
}

TEST(Chat, EachEpochVisitsTheTrainingLinesOnceInItsOwnOrderAndValidationLinesApart) {
  ChatData d;
  d.config.data.val_fraction = 0.25;
  std::vector<nlohmann::json> lines;
  for (int i = 0; i < 8; ++i) lines.push_back(line({{"user", std::string(1, static_cast<char>('a' + i))}, {"assistant", "x"}}));
  const auto src = d.source(lines);
  const auto& chat = dynamic_cast<const loom::train::ChatSource&>(*src);
  EXPECT_EQ(chat.lines_of(Split::Train), (std::vector<uint32_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(chat.lines_of(Split::Validation), (std::vector<uint32_t>{6, 7}));
  // The line a sample is: its user message's letter, after "<|im_start|>user\n".
  const auto letter_of = [&](Split split, uint64_t i) {
    I tokens(8), targets(8);
    src->sample(split, i, 8, tokens.data(), targets.data());
    return tokens[6] - 'a';
  };
  std::vector<int> epoch0, epoch1;
  for (uint64_t i = 0; i < 6; ++i) epoch0.push_back(letter_of(Split::Train, i));
  for (uint64_t i = 6; i < 12; ++i) epoch1.push_back(letter_of(Split::Train, i));
  EXPECT_EQ(std::set<int>(epoch0.begin(), epoch0.end()), (std::set<int>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(std::set<int>(epoch1.begin(), epoch1.end()), (std::set<int>{0, 1, 2, 3, 4, 5}));
  EXPECT_NE(epoch0, epoch1) << "every epoch shuffles anew";
  EXPECT_EQ(std::set<int>({letter_of(Split::Validation, 0), letter_of(Split::Validation, 1)}), (std::set<int>{6, 7}));
  // A pure function of (seed, split, index): another source of the same file agrees
  // (a resumed run), another seed does not.
  const auto again = d.source(lines);
  I a(8), b(8), ta(8), tb(8);
  for (uint64_t i : {0u, 5u, 11u, 100u}) {
    src->sample(Split::Train, i, 8, a.data(), ta.data());
    again->sample(Split::Train, i, 8, b.data(), tb.data());
    EXPECT_EQ(a, b);
  }
  d.config.run.seed = 8;
  const auto reseeded = d.source(lines);
  std::vector<int> other;
  for (uint64_t i = 0; i < 6; ++i) {
    reseeded->sample(Split::Train, i, 8, a.data(), ta.data());
    other.push_back(a[6] - 'a');
  }
  EXPECT_NE(other, epoch0);
}

TEST(Chat, BadConversationsAreRefusedWithTheirLine) {
  ChatData d;
  const auto error = [&](const std::vector<nlohmann::json>& lines) {
    try {
      d.source(lines);
    } catch (const loom::train::DataError& e) {
      return std::string(e.what());
    }
    return std::string("(read)");
  };
  const nlohmann::json ok = line({{"user", "a"}, {"assistant", "b"}});
  EXPECT_NE(error({ok, line({{"tool", "x"}})}).find("line 3: message 1: role \"tool\""), std::string::npos)
      << error({ok, line({{"tool", "x"}})});
  EXPECT_NE(error({ok, {{"messages", {{{"role", "user"}, {"content", 3}}}}}}).find("\"content\" is not a string"),
            std::string::npos);
  EXPECT_NE(error({{{"text", "x"}}}).find("has no \"messages\""), std::string::npos);
  EXPECT_NE(error({{{"messages", nlohmann::json::array()}}}).find("no messages"), std::string::npos);
  EXPECT_NE(error({}).find("holds no conversations"), std::string::npos);
  d.config.data.chat_template = "llama3";
  EXPECT_NE(error({ok}).find("<|begin_of_text|>, which is not one token"), std::string::npos) << error({ok});
  d.config.data.chat_template = "";
  EXPECT_NE(error({ok}).find("declares none"), std::string::npos) << error({ok});
  d.config.data.chat_template = "vicuna";
  EXPECT_NE(error({ok}).find("\"vicuna\" is unknown"), std::string::npos) << error({ok});
  // One line, none left for validation.
  d.config.data.chat_template = "chatml";
  d.config.data.val_fraction = 0.1;
  const auto one = d.source({ok});
  EXPECT_THROW(one->check_split(Split::Validation, 8), loom::train::DataError);
  EXPECT_NO_THROW(one->check_split(Split::Train, 8));
}

}  // namespace
