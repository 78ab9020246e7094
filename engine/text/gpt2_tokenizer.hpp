// GPT-2's byte-level BPE tokenizer (Radford et al., "Language Models are
// Unsupervised Multitask Learners", 2019), from the standard encoder.json (token ->
// id) and vocab.bpe (merges by rank) files: text is split by GPT-2's pre-tokenizer
// pattern (contractions, letters, numbers, other symbols, white space, each run
// with an optional leading space), each piece's bytes are mapped to printable
// characters and merged pair by pair, lowest rank first.
#pragma once

#include "engine/text/byte_level_bpe.hpp"
#include "engine/text/tokenizer.hpp"

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace loom::text {

// The pieces GPT-2's pattern splits `text` into, in order; their concatenation is `text`.
std::vector<std::string_view> gpt2_pretokenize(std::string_view text);

class Gpt2Tokenizer : public Tokenizer {
 public:
  // Reads DIR/encoder.json and DIR/vocab.bpe. Throws TokenizerError naming the file
  // and what is wrong with it.
  static Gpt2Tokenizer load(const std::string& dir);

  // Encodes any bytes (valid UTF-8 or not); decode(encode(s)) == s.
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int32_t vocab_size() const override { return bpe_.size(); }
  int32_t eod() const override { return eod_; }  // <|endoftext|>
  int32_t bos() const override { return eod_; }
  int32_t unk() const override { return eod_; }
  std::string piece(int32_t id) const override;
  std::string describe() const override;

 private:
  ByteLevelBpe bpe_;
  int32_t eod_ = -1;
  std::string dir_;
};

}  // namespace loom::text
