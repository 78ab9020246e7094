// The text module without tokenizer files: GPT-2's pre-tokenizer on cases worked
// out from its pattern, pieces that always rebuild the input (any bytes), and the
// token files' writer and reader (round trip, refusals, no half-written files).
// tests/text/preprocess_test.sh checks the tokenizer against a reference encoder.
#include "engine/text/gpt2_tokenizer.hpp"
#include "engine/text/hf_tokenizer.hpp"
#include "engine/text/token_files.hpp"
#include "engine/text/tokenizer.hpp"
#include "support/byte_level_vocab.hpp"
#include "support/train_fixture.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <boost/filesystem.hpp>

#include <fstream>
#include <functional>
#include <iterator>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

namespace fs = boost::filesystem;
using loom::text::gpt2_pretokenize;

std::vector<std::string> pieces(const std::string& text) {
  std::vector<std::string> out;
  for (std::string_view p : gpt2_pretokenize(text)) out.emplace_back(p);
  return out;
}

TEST(Text, Gpt2PretokenizerSplitsAsItsPattern) {
  using V = std::vector<std::string>;
  EXPECT_EQ(pieces("Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(pieces("it's they'll"), (V{"it", "'s", " they", "'ll"}));
  // A white-space run leaves its last space to lead the next word.
  EXPECT_EQ(pieces("a   b"), (V{"a", "  ", " b"}));
  EXPECT_EQ(pieces("x\n\ny"), (V{"x", "\n", "\n", "y"}));
  EXPECT_EQ(pieces("end  "), (V{"end", "  "}));
  EXPECT_EQ(pieces("2026 items!!"), (V{"2026", " items", "!!"}));
  EXPECT_EQ(pieces("naïve café"), (V{"naïve", " café"}));  // letters beyond ASCII
  EXPECT_EQ(pieces("٣٤ ½"), (V{"٣٤", " ½"}));              // numbers beyond ASCII
}

TEST(Text, PretokenizedPiecesRebuildAnyBytes) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::string s(static_cast<size_t>(rng() % 64), '\0');
    for (char& c : s) c = static_cast<char>(rng() % 256);  // invalid UTF-8 included
    std::string joined;
    for (std::string_view p : gpt2_pretokenize(s)) {
      EXPECT_FALSE(p.empty());
      joined += p;
    }
    EXPECT_EQ(joined, s);
  }
}

TEST(Text, ATokenizerPathThatIsNoneSaysWhatWouldBe) {
  const std::string dir = loom::testing::scratch_dir("text_tok");
  auto message = [](const std::string& path) {
    try {
      loom::text::load_tokenizer(path);
    } catch (const loom::text::TokenizerError& e) {
      return std::string(e.what());
    }
    return std::string("(loaded)");
  };
  EXPECT_NE(message(dir + "/none").find("no such tokenizer"), std::string::npos) << message(dir + "/none");
  std::ofstream(dir + "/x.model") << "not a model";
  EXPECT_NE(message(dir + "/x.model").find("not a SentencePiece model"), std::string::npos) << message(dir + "/x.model");
  // A directory without GPT-2's files names the missing one and the script that fetches it.
  const std::string m = message(dir);
  EXPECT_NE(m.find("encoder.json"), std::string::npos) << m;
  EXPECT_NE(m.find("fetch-gpt2-tokenizer.sh"), std::string::npos) << m;
  std::ofstream(dir + "/encoder.json") << "{\"a\": 0, \"b\": 0}";
  EXPECT_NE(message(dir).find("id 0 is given twice"), std::string::npos) << message(dir);
  boost::filesystem::create_directory(dir + "/d");
  boost::filesystem::create_directory(dir + "/d/encoder.json");
  EXPECT_NE(message(dir + "/d").find("encoder.json: is a directory"), std::string::npos) << message(dir + "/d");
  fs::remove_all(dir);
}

// Llama 3's and Qwen2's pre-tokenizer patterns (hf_tokenizer.hpp), on cases whose
// splits Python's regex module gives for the patterns as written.
TEST(Text, SplitPretokenizerSplitsAsLlama3AndQwen2Patterns) {
  using V = std::vector<std::string>;
  const auto split = [](const std::string& text, int digits) {
    V out;
    for (std::string_view p : loom::text::split_pretokenize(text, digits)) out.emplace_back(p);
    return out;
  };
  EXPECT_EQ(split("Hello world", 3), (V{"Hello", " world"}));
  EXPECT_EQ(split("I'M HE'LL", 3), (V{"I", "'M", " HE", "'LL"}));  // contractions of either case
  EXPECT_EQ(split("x'\xc5\xbf" "a", 3), (V{"x", "'\xc5\xbf", "a"}));  // U+017F folds to s
  EXPECT_EQ(split("1234567", 3), (V{"123", "456", "7"}));
  EXPECT_EQ(split("1234567", 1), (V{"1", "2", "3", "4", "5", "6", "7"}));
  EXPECT_EQ(split("x\nBefore", 3), (V{"x", "\n", "Before"}));  // no newline before a word
  EXPECT_EQ(split("(hello) ((y", 3), (V{"(hello", ")", " ((", "y"}));
  EXPECT_EQ(split("a  \n\n  b", 3), (V{"a", "  \n\n", " ", " b"}));  // white space up to its last newline
  EXPECT_EQ(split("end!!\n\nnext", 3), (V{"end", "!!\n\n", "next"}));  // symbols take the newlines after them
  EXPECT_EQ(split("\tend", 3), (V{"\tend"}));
  EXPECT_EQ(split("a \n b", 3), (V{"a", " \n", " b"}));
  EXPECT_EQ(split("x  ", 3), (V{"x", "  "}));
  EXPECT_EQ(split("٣٤5 ½", 3), (V{"٣٤5", " ", "½"}));
  EXPECT_EQ(split("٣٤5 ½", 1), (V{"٣", "٤", "5", " ", "½"}));
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    std::string s(static_cast<size_t>(rng() % 64), '\0');
    for (char& c : s) c = static_cast<char>(rng() % 256);  // invalid UTF-8 included
    std::string joined;
    for (std::string_view p : loom::text::split_pretokenize(s, 1 + static_cast<int>(trial % 3))) {
      EXPECT_FALSE(p.empty());
      joined += p;
    }
    EXPECT_EQ(joined, s);
  }
}

// A tokenizer.json of the 256 byte tokens and a few merges, as a test writes it.
struct TinyHfTokenizer {
  nlohmann::json j;
  nlohmann::json config;
  TinyHfTokenizer() {
    nlohmann::json vocab = loom::testing::byte_level_vocab();
    vocab["ab"] = 256;    // a + b
    vocab["abc"] = 257;   // ab + c
    vocab["xyz"] = 258;   // a whole piece, made by no merge (ignore_merges takes it)
    j = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"a b", {"ab", "c"}}}}},
         {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
         {"decoder", {{"type", "ByteLevel"}}},
         {"added_tokens", {{{"id", 259}, {"content", "<s\xc3\xa9>"}, {"special", true}}}}};
  }
  std::string write(const std::string& dir) const {
    boost::filesystem::create_directories(dir);
    std::ofstream(dir + "/tokenizer.json") << j.dump();
    if (!config.is_null()) std::ofstream(dir + "/tokenizer_config.json") << config.dump();
    return dir;
  }
};

TEST(Text, HuggingFaceTokenizerJsonEncodesItsVocabulary) {
  const std::string dir = loom::testing::scratch_dir("text_hf");
  TinyHfTokenizer t;
  t.config = {{"bos_token", {{"content", "<s\xc3\xa9>"}}}, {"eos_token", "abc"}};
  const std::unique_ptr<loom::text::Tokenizer> tok = loom::text::load_tokenizer(t.write(dir + "/a"));
  EXPECT_EQ(tok->vocab_size(), 260);
  using I = std::vector<int32_t>;
  // Merges by rank, the added token matched in the text (not its bytes), decoded as written.
  EXPECT_EQ(tok->encode("abc ab"), (I{257, ' ', 256}));
  EXPECT_EQ(tok->encode("x<s\xc3\xa9>abc"), (I{'x', 259, 257}));
  EXPECT_EQ(tok->decode(tok->encode("x<s\xc3\xa9>abc xyz")), "x<s\xc3\xa9>abc xyz");
  EXPECT_EQ(tok->encode("xyz"), (I{'x', 'y', 'z'}));
  EXPECT_EQ(tok->bos(), 259);
  EXPECT_EQ(tok->eod(), 257);
  EXPECT_EQ(tok->unk(), -1);
  EXPECT_NE(tok->describe().find("Hugging Face byte-level BPE (260 tokens)"), std::string::npos) << tok->describe();
  // ignore_merges (Llama 3's): a piece in the vocabulary is its token, whatever the merges.
  TinyHfTokenizer ignoring;
  ignoring.j["model"]["ignore_merges"] = true;
  EXPECT_EQ(loom::text::load_tokenizer(ignoring.write(dir + "/b"))->encode("xyz abc"), (I{258, ' ', 257}));
  // add_prefix_space: every stretch between added tokens starts with a space.
  TinyHfTokenizer prefixed;
  prefixed.j["pre_tokenizer"]["add_prefix_space"] = true;
  EXPECT_EQ(loom::text::load_tokenizer(prefixed.write(dir + "/c"))->encode("ab<s\xc3\xa9>ab"), (I{' ', 256, 259, ' ', 256}));
  // NFC (Qwen2's normaliser): e + combining acute is é's token, also beside a byte that
  // is not UTF-8 (kept as its own byte).
  TinyHfTokenizer nfc;
  nfc.j["normalizer"] = {{"type", "NFC"}};
  const std::unique_ptr<loom::text::Tokenizer> n = loom::text::load_tokenizer(nfc.write(dir + "/n"));
  EXPECT_EQ(n->encode("e\xcc\x81"), (I{0xc3, 0xa9}));  // é's two bytes
  EXPECT_EQ(tok->encode("e\xcc\x81"), (I{'e', 0xcc, 0x81})) << "without the normaliser";
  EXPECT_EQ(n->encode("e\xcc\x81 \xff"), (I{0xc3, 0xa9, ' ', 0xff}));
  // The file itself, or a directory with a SentencePiece model only, by what they are.
  EXPECT_EQ(loom::text::tokenizer_source(dir + "/a/tokenizer.json").format, loom::text::TokenizerFormat::HuggingFaceJson);
  boost::filesystem::create_directories(dir + "/sp");
  std::ofstream(dir + "/sp/tokenizer.model") << "x";
  std::ofstream(dir + "/sp/tokenizer.json") << "{}";  // Llama 2's: the same model, as byte-fallback BPE
  EXPECT_EQ(loom::text::tokenizer_source(dir + "/sp").format, loom::text::TokenizerFormat::SentencePiece);
  EXPECT_EQ(loom::text::tokenizer_source(dir + "/sp").file, dir + "/sp/tokenizer.model");
  fs::remove_all(dir);
}

TEST(Text, HuggingFaceTokenizerJsonRefusesWhatLoomDoesNotRead) {
  const std::string dir = loom::testing::scratch_dir("text_hf_bad");
  int n = 0;
  const auto refusal = [&](const std::function<void(TinyHfTokenizer&)>& edit) {
    TinyHfTokenizer t;
    edit(t);
    try {
      loom::text::load_tokenizer(t.write(dir + "/" + std::to_string(n++)));
    } catch (const loom::text::TokenizerError& e) {
      return std::string(e.what());
    }
    return std::string("(loaded)");
  };
  const auto expect = [](const std::string& got, const char* want) {
    EXPECT_NE(got.find(want), std::string::npos) << got;
  };
  expect(refusal([](TinyHfTokenizer& t) { t.j["model"]["type"] = "WordPiece"; }), "a WordPiece model; loom reads");
  expect(refusal([](TinyHfTokenizer& t) { t.j["model"]["byte_fallback"] = true; }), "give the tokenizer.model beside it");
  expect(refusal([](TinyHfTokenizer& t) {
           t.j["pre_tokenizer"] = {{"type", "Sequence"},
                                   {"pretokenizers",
                                    {{{"type", "Split"}, {"pattern", {{"Regex", "\\p{N}{1,3}"}}}, {"behavior", "Isolated"}},
                                     {{"type", "ByteLevel"}, {"use_regex", false}}}}};
         }),
         "Split pattern {\"Regex\":\"\\\\p{N}{1,3}\"}: loom knows Llama 3's and Qwen2's");
  expect(refusal([](TinyHfTokenizer& t) { t.j["pre_tokenizer"] = {{"type", "Metaspace"}}; }),
         "loom reads ByteLevel, or a Split");
  expect(refusal([](TinyHfTokenizer& t) { t.j["normalizer"] = {{"type", "NFKC"}}; }), "loom applies none or NFC only");
  expect(refusal([](TinyHfTokenizer& t) { t.j["added_tokens"][0]["lstrip"] = true; }), "has lstrip = true");
  expect(refusal([](TinyHfTokenizer& t) { t.j["added_tokens"][0]["id"] = 300; }), "has no id of 0..259 and content");
  expect(refusal([](TinyHfTokenizer& t) { t.j["added_tokens"][0]["id"] = 256; }), "has id 256, which is \"ab\"'s");
  expect(refusal([](TinyHfTokenizer& t) { t.j["added_tokens"][0]["content"] = "ab"; }),
         "added token \"ab\" has id 259, and the vocabulary gives it id 256");
  // Ids past the entries (2^32 + 256 would wrap to 256) are refused before anything is sized by them.
  expect(refusal([](TinyHfTokenizer& t) { t.j["model"]["vocab"]["ab"] = 4294967552ull; }),
         "token \"ab\" has id 4294967552, not one of 0..259");
  expect(refusal([](TinyHfTokenizer& t) { t.j["model"]["vocab"]["ab"] = -1; }), "has id -1, not one of 0..259");
  expect(refusal([](TinyHfTokenizer& t) { t.j["model"]["vocab"]["xyz"] = 256; }), "has id 256, which another token has");
  expect(refusal([](TinyHfTokenizer& t) { t.j["model"]["vocab"].erase("b"); }),
         "model.merges: \"a b\" needs \"b\", which is not in model.vocab");
  expect(refusal([](TinyHfTokenizer& t) { t.j["model"]["merges"].push_back("x y"); }),
         "model.merges: \"x y\" needs \"xy\", which is not in model.vocab");
  expect(refusal([](TinyHfTokenizer& t) { t.j["model"]["ignore_merges"] = "yes"; }),
         "ignore_merges = \"yes\" is not true or false");
  expect(refusal([](TinyHfTokenizer& t) {
           t.j["pre_tokenizer"] = {{"type", "Sequence"},
                                   {"pretokenizers",
                                    {{{"type", "Split"},
                                      {"pattern", {{"Regex", "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
                                                            "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
                                                            "\\s+(?!\\S)|\\s+"}}},
                                      {"behavior", "Isolated"}},
                                     {{"type", "ByteLevel"}, {"use_regex", false}, {"add_prefix_space", true}}}}};
         }),
         "ByteLevel's add_prefix_space after a Split");
  expect(refusal([](TinyHfTokenizer& t) { t.config = {{"bos_token", 5}}; }), "bos_token = 5 is not a token");
  expect(refusal([](TinyHfTokenizer& t) { t.j["model"]["merges"].push_back(42); }), "model.merges: 42 is not a pair");
  expect(refusal([](TinyHfTokenizer& t) { t.config = {{"eos_token", "</s>"}}; }),
         "eos_token \"</s>\" is not a token of");
  fs::remove_all(dir);
}

TEST(Text, IndexedDatasetRoundTripsAndRefusesWhatDoesNotFit) {
  const std::string dir = loom::testing::scratch_dir("text_ds");
  const std::vector<std::vector<int32_t>> docs = {{1, 2, 3}, {}, {65535, 0}};
  {
    loom::text::IndexedDatasetWriter w(dir + "/a", loom::text::TokenType::U16);
    for (const auto& d : docs) w.add_document(d);
    EXPECT_FALSE(fs::exists(dir + "/a.bin"));  // not under the final name before finish()
    w.finish();
  }
  const loom::text::IndexedDataset back = loom::text::IndexedDataset::read(dir + "/a");
  EXPECT_EQ(back.documents, docs);
  EXPECT_EQ(fs::file_size(dir + "/a.bin"), 10u);  // five uint16 tokens

  {
    loom::text::IndexedDatasetWriter w(dir + "/b", loom::text::TokenType::U16);
    EXPECT_THROW(w.add_document({70000}), loom::text::TokenFileError);
  }  // abandoned: nothing left behind
  EXPECT_FALSE(fs::exists(dir + "/b.bin"));
  EXPECT_FALSE(fs::exists(dir + "/b.bin.tmp"));
  EXPECT_EQ(loom::text::token_type_for(50257), loom::text::TokenType::U16);
  EXPECT_EQ(loom::text::token_type_for(128256), loom::text::TokenType::I32);

  // The empty document is no sequence (Megatron's builder): two sequences, the
  // document index [0, 1, 1, 2].
  const std::string idx = dir + "/a.idx";
  {
    std::ifstream in(idx, std::ios::binary);
    const std::string bytes(std::istreambuf_iterator<char>(in), {});
    uint64_t counts[2];
    std::memcpy(counts, bytes.data() + 18, 16);
    EXPECT_EQ(counts[0], 2u);
    EXPECT_EQ(counts[1], 4u);
    int64_t doc_index[4];
    std::memcpy(doc_index, bytes.data() + bytes.size() - 32, 32);
    EXPECT_EQ(std::vector<int64_t>(doc_index, doc_index + 4), (std::vector<int64_t>{0, 1, 1, 2}));
  }
  // An index whose sequences do not lie back to back (a damaged pointer) is refused.
  {
    std::fstream f(idx, std::ios::in | std::ios::out | std::ios::binary);
    // Header 9 + 8 + 1 + 8 + 8 bytes, two int32 lengths, then the pointers: the second += 2.
    const std::streamoff third_pointer = 34 + 2 * 4 + 1 * 8;
    int64_t p = 0;
    f.seekg(third_pointer);
    f.read(reinterpret_cast<char*>(&p), 8);
    p += 2;
    f.seekp(third_pointer);
    f.write(reinterpret_cast<const char*>(&p), 8);
  }
  try {
    loom::text::IndexedDataset::read(dir + "/a");
    ADD_FAILURE() << "a damaged pointer was read";
  } catch (const loom::text::TokenFileError& e) {
    EXPECT_NE(std::string(e.what()).find("sequence 1 has length 2 at byte 8, expected a length >= 0 at byte 6"),
              std::string::npos)
        << e.what();
  }
  // An index that does not describe the whole .bin: bytes after it, a document index
  // that starts past sequence 0, a .bin longer than the sequences.
  auto refusal = [&]() -> std::string {
    try {
      loom::text::IndexedDataset::read(dir + "/a");
    } catch (const loom::text::TokenFileError& e) {
      return e.what();
    }
    return "";
  };
  {
    loom::text::IndexedDatasetWriter w(dir + "/a", loom::text::TokenType::U16);
    for (const auto& d : docs) w.add_document(d);
    w.finish();
  }
  ASSERT_EQ(refusal(), "");
  const std::string good_idx = [&] {
    std::ifstream in(idx, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  std::ofstream(idx, std::ios::app | std::ios::binary) << "xy";
  EXPECT_NE(refusal().find("2 bytes follow the document index"), std::string::npos) << refusal();
  {
    std::string first_doc_at_1 = good_idx;
    const int64_t one = 1;
    std::memcpy(first_doc_at_1.data() + first_doc_at_1.size() - 4 * 8, &one, 8);  // docs [0, 1, 1, 2] -> [1, ...]
    std::ofstream(idx, std::ios::trunc | std::ios::binary) << first_doc_at_1;
  }
  EXPECT_NE(refusal().find("the document index runs from sequence 1 to 2, not from 0"), std::string::npos) << refusal();
  std::ofstream(idx, std::ios::trunc | std::ios::binary) << good_idx;
  std::ofstream(dir + "/a.bin", std::ios::app | std::ios::binary) << "zz";
  EXPECT_NE(refusal().find("a.bin holds 12 bytes but"), std::string::npos) << refusal();
  std::ofstream(idx, std::ios::trunc | std::ios::binary) << good_idx;
  fs::resize_file(dir + "/a.bin", 10);
  ASSERT_EQ(refusal(), "");

  // A truncated index, and one that is not an index, are refused by name.
  const auto size = fs::file_size(idx);
  fs::resize_file(idx, size - 5);
  try {
    loom::text::IndexedDataset::read(dir + "/a");
    ADD_FAILURE() << "a truncated index was read";
  } catch (const loom::text::TokenFileError& e) {
    EXPECT_NE(std::string(e.what()).find("a.idx: truncated"), std::string::npos) << e.what();
  }
  std::ofstream(idx, std::ios::trunc) << "not an index";
  try {
    loom::text::IndexedDataset::read(dir + "/a");
    ADD_FAILURE() << "a non-index was read";
  } catch (const loom::text::TokenFileError& e) {
    EXPECT_NE(std::string(e.what()).find("no MMIDIDX header"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

}  // namespace
