// The text module without tokenizer files: GPT-2's pre-tokenizer on cases worked
// out from its pattern, pieces that always rebuild the input (any bytes), and the
// token files' writer and reader (round trip, refusals, no half-written files).
// tests/text/preprocess_test.sh checks the tokenizer against a reference encoder.
#include "engine/text/gpt2_tokenizer.hpp"
#include "engine/text/token_files.hpp"
#include "engine/text/tokenizer.hpp"
#include "support/train_fixture.hpp"

#include <gtest/gtest.h>

#include <boost/filesystem.hpp>

#include <fstream>
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
