// Hugging Face's tokenizer.json (the `tokenizers` library's file, which Llama 3, Qwen2,
// Qwen2.5, Qwen3 and GPT-2's Hugging Face repositories ship): a byte-level BPE model
// (vocab, merges, ignore_merges) behind a pre-tokenizer loom knows, with added
// (special) tokens matched in the text first and an optional NFC normaliser.
//
// Pre-tokenizers: ByteLevel with use_regex (GPT-2's pattern, gpt2_tokenizer.hpp), or a
// Split by one of the patterns below, Isolated, before ByteLevel without its regex:
//   Llama 3 (OpenAI's cl100k):  (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|
//                               \p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//   Qwen2 (and Qwen2.5, Qwen3): the same with single digits, \p{N} for \p{N}{1,3}.
// Other models (WordPiece, Unigram, byte-fallback BPE: Llama 2's and Mistral's, which ship
// tokenizer.model for SentencePiece beside it) and other patterns are refused by name.
// The special tokens (bos, eos, unk) are those tokenizer_config.json beside it names.
#pragma once

#include "engine/text/byte_level_bpe.hpp"
#include "engine/text/tokenizer.hpp"

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace loom::text {

// The pieces the Llama 3 pattern (max_digits 3) or the Qwen2 pattern (max_digits 1)
// splits `text` into, in order; their concatenation is `text`.
std::vector<std::string_view> split_pretokenize(std::string_view text, int max_digits);

class HfTokenizer : public Tokenizer {
 public:
  // `path`: a tokenizer.json file, or a directory holding one. Throws TokenizerError
  // naming the file and what loom cannot read in it.
  static HfTokenizer load(const std::string& path);

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int32_t vocab_size() const override { return bpe_.size(); }
  int32_t eod() const override { return eos_; }
  int32_t bos() const override { return bos_; }
  int32_t unk() const override { return unk_; }
  std::string piece(int32_t id) const override;
  std::string describe() const override;

 private:
  enum class Split { Gpt2, Llama3, Qwen2, None };
  // Appends the ids of a stretch of text without added tokens.
  void encode_text(std::string_view text, std::vector<int32_t>& out) const;
  // The added token starting at text[i] (the longest), or -1.
  int32_t added_at(std::string_view text, size_t i, size_t& length) const;

  ByteLevelBpe bpe_;
  Split split_ = Split::Gpt2;
  bool prefix_space_ = false;  // ByteLevel's add_prefix_space
  bool nfc_ = false;
  std::vector<bool> added_;    // by id: an added token (decoded as written)
  std::unordered_map<unsigned char, std::vector<std::pair<std::string, int32_t>>> added_by_first_;  // longest first
  int32_t bos_ = -1, eos_ = -1, unk_ = -1;
  std::string path_;
};

}  // namespace loom::text
