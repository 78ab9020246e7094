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

#include <algorithm>
#include <fstream>
#include <set>
#include <string>
#include <vector>

namespace {

using loom::train::Split;
using I = std::vector<int32_t>;

constexpr int32_t kStart = 256, kEnd = 257, kEod = 258;  // <|im_start|>, <|im_end|>, <|endoftext|>

// A byte-level tokenizer.json without merges, with `specials` as ids 256, 257, ... and
// tokenizer_config.json `config`.
std::string write_tokenizer(const std::string& dir, const std::vector<std::string>& specials,
                            const nlohmann::json& config) {
  nlohmann::json vocab = loom::testing::byte_level_vocab();
  nlohmann::json added = nlohmann::json::array();
  for (size_t k = 0; k < specials.size(); ++k) {
    vocab[specials[k]] = 256 + k;
    added.push_back({{"id", 256 + k}, {"content", specials[k]}, {"special", true}});
  }
  const nlohmann::json j = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}},
                            {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
                            {"decoder", {{"type", "ByteLevel"}}},
                            {"added_tokens", added}};
  boost::filesystem::create_directories(dir);
  std::ofstream(dir + "/tokenizer.json") << j.dump();
  if (!config.is_null()) std::ofstream(dir + "/tokenizer_config.json") << config.dump();
  return dir;
}

// ChatML's special tokens as kStart, kEnd, kEod.
std::string write_tokenizer(const std::string& dir) {
  return write_tokenizer(dir, {"<|im_start|>", "<|im_end|>", "<|endoftext|>"}, {{"eos_token", "<|endoftext|>"}});
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
  EXPECT_NE(error({ok, line({{"tool", "x"}})}).find("data.jsonl:3: message 1: role \"tool\""), std::string::npos)
      << error({ok, line({{"tool", "x"}})});
  // The first bad line in file order, whichever thread meets it first.
  std::vector<nlohmann::json> many(100, ok);
  many[36] = line({{"user", "a"}, {"assistant", "b"}, {"tool", "c"}});
  many[79] = {{"text", "x"}};
  EXPECT_NE(error(many).find("data.jsonl:73: message 3"), std::string::npos) << error(many);  // blank lines between
  EXPECT_NE(error({ok, {{"messages", {{{"role", "user"}, {"content", 3}}}}}}).find("\"content\" is not a string"),
            std::string::npos);
  EXPECT_NE(error({ok, 7}).find("this line is 7"), std::string::npos) << error({ok, 7});
  EXPECT_NE(error({line({{"user", "a"}}), line({{"system", "s"}, {"user", "b"}})}).find("no line has an assistant turn"),
            std::string::npos);
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
  EXPECT_THROW(one->check_split(Split::Validation, 32), loom::train::DataError);
  EXPECT_NO_THROW(one->check_split(Split::Train, 32));
  // Cut before its first assistant token (20 tokens of context), the line trains nothing.
  try {
    one->check_split(Split::Train, 19);
    ADD_FAILURE() << "a split without a target left passes";
  } catch (const loom::train::DataError& e) {
    EXPECT_NE(std::string(e.what()).find("none of the 1 training lines keeps a token to learn"), std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(one->check_split(Split::Train, 20));  // "b" is the 21st token: the target of position 19
}

}  // namespace

namespace {

// Packing (data.chat_packing): the lines are packed once, each sample as many whole
// lines as fit in seq + 1 tokens (a longer line alone); every epoch visits those packs,
// each once, in its own order; the tokens are the lines' back to back; sample indices
// run on across epochs.
TEST(Chat, PackedSamplesHoldWholeLinesPackedOnceAndVisitedEachEpoch) {
  ChatData d;
  d.config.data.chat_packing = true;
  std::vector<nlohmann::json> lines;
  for (int i = 0; i < 12; ++i)  // user messages of 1 to 40 letters: lines of 40 to 80 tokens
    lines.push_back(line({{"user", std::string(static_cast<size_t>(1 + (i * 7) % 40), static_cast<char>('a' + i))},
                          {"assistant", "x"}}));
  const auto src = d.source(lines);
  const auto& chat = dynamic_cast<const loom::train::ChatSource&>(*src);
  const auto tokenizer = loom::text::load_tokenizer(d.config.data.tokenizer);
  const auto ids_of_line = [&](uint32_t l) {
    return loom::train::line_tokens(loom::text::ChatTemplate::named("chatml"), *tokenizer,
                                    loom::text::conversation_from_json(lines[l]), kEod)
        .ids;
  };
  const int64_t seq = 150;
  const uint64_t per_epoch = chat.samples_per_epoch(Split::Train, seq);
  ASSERT_GT(per_epoch, 0u);
  ASSERT_LT(per_epoch, chat.lines_of(Split::Train).size()) << "nothing was packed";
  std::vector<std::set<std::vector<uint32_t>>> epochs(3);
  std::vector<std::vector<std::vector<uint32_t>>> visited(3);
  size_t most = 0;  // lines in a sample
  for (uint64_t index = 0; index < 3 * per_epoch; ++index) {
    const std::vector<uint32_t> in = chat.lines_in_sample(Split::Train, index, seq);
    ASSERT_FALSE(in.empty());
    most = std::max(most, in.size());
    I want;
    for (uint32_t l : in) {
      const I ids = ids_of_line(l);
      want.insert(want.end(), ids.begin(), ids.end());
    }
    EXPECT_TRUE(static_cast<int64_t>(want.size()) <= seq + 1 || in.size() == 1) << want.size();
    I tokens(seq), targets(seq);
    src->sample(Split::Train, index, seq, tokens.data(), targets.data());
    want.resize(static_cast<size_t>(seq), kEod);
    EXPECT_EQ(tokens, want) << "sample " << index;
    epochs[index / per_epoch].insert(in);
    visited[index / per_epoch].push_back(in);
  }
  EXPECT_GE(most, 3u);
  for (size_t e = 0; e < 3; ++e) {
    EXPECT_EQ(epochs[e].size(), per_epoch) << "a pack visited twice in epoch " << e;
    EXPECT_EQ(epochs[e], epochs[0]) << "the packs are made once";
    std::multiset<uint32_t> seen;
    for (const auto& in : epochs[e]) seen.insert(in.begin(), in.end());
    EXPECT_EQ(seen, std::multiset<uint32_t>(chat.lines_of(Split::Train).begin(), chat.lines_of(Split::Train).end()));
  }
  EXPECT_NE(visited[0], visited[1]) << "every epoch shuffles the packs anew";
  EXPECT_NE(src->warning(seq).find("data.reset_attention_mask = true"), std::string::npos) << src->warning(seq);
  d.config.data.reset_attention_mask = true;
  EXPECT_EQ(d.source(lines)->warning(seq), "");
}

}  // namespace

namespace {

std::string utf8(uint32_t cp) {
  std::string u;
  if (cp < 0x80) {
    u += static_cast<char>(cp);
  } else if (cp < 0x800) {
    u += static_cast<char>(0xc0 | (cp >> 6));
    u += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    u += static_cast<char>(0xe0 | (cp >> 12));
    u += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    u += static_cast<char>(0x80 | (cp & 0x3f));
  }
  return u;
}

// Llama 3's template trims content with Jinja's trim, Python's str.strip() under
// transformers: exactly the characters str.isspace() names, and nothing else.
TEST(ChatTemplate, Llama3TrimsTheWhiteSpacePythonsStripRemoves) {
  const loom::text::ChatTemplate t = loom::text::ChatTemplate::named("llama3");
  const auto content_of = [&](const std::string& c) {
    const std::string r = t.render({{"user", c}}, false);
    const std::string head = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n";
    return r.substr(head.size(), r.size() - head.size() - std::string("<|eot_id|>").size());
  };
  const std::vector<uint32_t> space = {0x09, 0x0a, 0x0b, 0x0c, 0x0d, 0x1c, 0x1d, 0x1e, 0x1f, 0x20, 0x85, 0xa0, 0x1680,
                                       0x2000, 0x2001, 0x2005, 0x200a, 0x2028, 0x2029, 0x202f, 0x205f, 0x3000};
  for (uint32_t cp : space)
    EXPECT_EQ(content_of(utf8(cp) + "x" + utf8(cp) + "y" + utf8(cp) + utf8(cp)), "x" + utf8(cp) + "y") << std::hex << cp;
  for (uint32_t cp : {0x200bu, 0xfeffu, 0x180eu, 0x2060u, 0x00u, 0x2bu})  // not white space to Python
    EXPECT_EQ(content_of(utf8(cp) + "x" + utf8(cp)), utf8(cp) + "x" + utf8(cp)) << std::hex << cp;
  // Bytes that are not UTF-8 stand alone: a lead byte does not swallow the spaces after it.
  EXPECT_EQ(content_of(" abc\xe2 \n"), "abc\xe2");
  EXPECT_EQ(content_of("\xe2\x80"), "\xe2\x80");
  EXPECT_EQ(content_of(" \t "), "");
  EXPECT_EQ(loom::text::ChatTemplate::named("chatml").render({{"user", " a "}}, false), "<|im_start|>user\n a <|im_end|>\n");
}

// Llama 3's turns: the assistant's content and <|eot_id|> are its targets; the
// generation prompt is the header alone; a conversation ends with <|end_of_text|>, or
// the tokenizer's eos when the template does not write it, else with nothing known.
TEST(ChatTemplate, Llama3TurnsTargetsAndTheConversationsEnd) {
  const std::string dir = loom::testing::scratch_dir("chat_llama3");
  const std::vector<std::string> specials = {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                             "<|eot_id|>", "<|end_of_text|>"};
  const auto tok = loom::text::load_tokenizer(write_tokenizer(dir + "/a", specials, {{"eos_token", "<|eot_id|>"}}));
  const loom::text::ChatTemplate t = loom::text::ChatTemplate::named("llama3");
  EXPECT_NO_THROW(t.require_special_tokens(*tok));
  const loom::text::ChatTokens c = t.encode(*tok, {{"user", "hi"}, {"assistant", " yo\n"}}, false);
  I answer;
  for (size_t k = 0; k < c.ids.size(); ++k)
    if (c.target[k]) answer.push_back(c.ids[k]);
  EXPECT_EQ(answer, (I{'y', 'o', 259}));  // trimmed, then <|eot_id|>
  EXPECT_EQ(tok->decode(c.ids), t.render({{"user", "hi"}, {"assistant", " yo\n"}}, false));
  const loom::text::ChatTokens p = t.encode(*tok, {{"user", "hi"}}, true);
  EXPECT_EQ(tok->decode(p.ids), t.render({{"user", "hi"}}, true));
  EXPECT_TRUE(std::all_of(p.target.begin(), p.target.end(), [](uint8_t f) { return f == 0; }));
  EXPECT_EQ(t.end_of_turn(*tok), 259);
  EXPECT_EQ(t.end_of_conversation(*tok), 260);  // <|end_of_text|>, not the eos <|eot_id|>
  const std::vector<std::string> without_end(specials.begin(), specials.end() - 1);
  EXPECT_EQ(t.end_of_conversation(
                *loom::text::load_tokenizer(write_tokenizer(dir + "/b", without_end, {{"eos_token", "<|eot_id|>"}}))),
            -1);
  std::vector<std::string> other_eos = without_end;
  other_eos.push_back("</s>");
  EXPECT_EQ(t.end_of_conversation(
                *loom::text::load_tokenizer(write_tokenizer(dir + "/c", other_eos, {{"eos_token", "</s>"}}))),
            260);
  // ChatML on a Llama 3 tokenizer: named.
  try {
    loom::text::ChatTemplate::named("chatml").require_special_tokens(*tok);
    ADD_FAILURE() << "chatml accepted a tokenizer without <|im_start|>";
  } catch (const loom::text::TokenizerError& e) {
    EXPECT_NE(std::string(e.what()).find("<|im_start|>, which is not one token"), std::string::npos) << e.what();
  }
  boost::filesystem::remove_all(dir);
}

// What a model directory declares, where transformers looks: chat_template.jinja, then
// tokenizer_config.json's chat_template (a string, or the "default" of a list); a
// family recognised only when its markers are all the template writes.
TEST(ChatTemplate, TheTemplateADirectoryDeclares) {
  const std::string dir = loom::testing::scratch_dir("chat_declared");
  int n = 0;
  const auto declared = [&](const nlohmann::json& config, const std::string& jinja = "") {
    const std::string d = write_tokenizer(dir + "/" + std::to_string(n++), {"<|im_start|>", "<|im_end|>"}, config);
    if (!jinja.empty()) std::ofstream(d + "/chat_template.jinja") << jinja;
    try {
      return loom::text::declared_chat_template(d);
    } catch (const loom::text::TokenizerError& e) {
      return std::string("error: ") + e.what();
    }
  };
  const std::string chatml = loom::text::ChatTemplate::named("chatml").jinja();
  const std::string llama3 = loom::text::ChatTemplate::named("llama3").jinja();
  EXPECT_EQ(declared({{"chat_template", chatml}}), "chatml");
  EXPECT_EQ(declared({{"chat_template", llama3}}), "llama3");
  EXPECT_EQ(declared({{"eos_token", "<|im_end|>"}}), "");
  EXPECT_EQ(declared(nullptr), "");
  EXPECT_EQ(declared({{"chat_template", nullptr}}), "");
  EXPECT_EQ(declared({{"chat_template", {{{"name", "tool_use"}, {"template", llama3}},
                                         {{"name", "default"}, {"template", chatml}}}}}),
            "chatml");
  EXPECT_EQ(declared({{"chat_template", llama3}}, chatml), "chatml") << "chat_template.jinja comes first";
  EXPECT_NE(declared({{"chat_template", {{{"name", 5}, {"template", "x"}}}}}).find("neither a string nor a list"),
            std::string::npos);
  EXPECT_NE(declared({{"chat_template", 3}}).find("neither a string nor a list"), std::string::npos);
  // Phi-4's turns look like ChatML's but add <|im_sep|>: refused, naming it.
  const std::string phi4 = "{% for m in messages %}{{'<|im_start|>' + m['role'] + '<|im_sep|>' + m['content'] + "
                           "'<|im_end|>'}}{% endfor %}";
  EXPECT_NE(declared({{"chat_template", phi4}}).find("<|im_sep|>"), std::string::npos) << declared({{"chat_template", phi4}});
  EXPECT_NE(declared({{"chat_template", "{{ messages[0]['content'] }}"}}).find("markers: none"), std::string::npos);
  // A declared ChatML template's default system message, written where a conversation
  // starts with another role (Qwen2's; Qwen2.5's after a system branch of its own).
  const std::string qwen2 = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                            "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
                            "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
                            "'\\n'}}{% endfor %}";
  EXPECT_EQ(loom::text::default_system_message(qwen2), "You are a helpful assistant.");
  EXPECT_EQ(loom::text::default_system_message("{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + "
                                               "messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- "
                                               "'<|im_start|>system\\nYou are Q.\\nBe brief.<|im_end|>\\n' }}"),
            "You are Q.\nBe brief.");
  EXPECT_EQ(loom::text::default_system_message(chatml), "");
  {
    const std::string d = write_tokenizer(dir + "/q", {"<|im_start|>", "<|im_end|>"}, {{"chat_template", qwen2}});
    const loom::text::ChatTemplate t = loom::text::resolve_chat_template("", d, "");
    EXPECT_EQ(t.render({{"user", "hi"}}, false),
              "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n");
    EXPECT_EQ(t.render({{"system", "S"}, {"user", "hi"}}, false),
              "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n");
    EXPECT_EQ(loom::text::resolve_chat_template("chatml", d, "").render({{"user", "hi"}}, false),
              "<|im_start|>user\nhi<|im_end|>\n")
        << "a template named by the run is loom's own, without the directory's default";
  }
  // A conversation given as the list alone reads as {"messages": list}.
  const nlohmann::json list = nlohmann::json::parse(R"([{"role": "user", "content": "a"}])");
  EXPECT_EQ(loom::text::conversation_from_json(list).size(), 1u);
  boost::filesystem::remove_all(dir);
}

}  // namespace
