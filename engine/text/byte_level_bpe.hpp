// Byte-level BPE (GPT-2's, and the byte-level models of Hugging Face's tokenizer.json):
// a piece of text is taken as bytes, each byte mapped to a printable character
// (GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the others
// for 256, 257, ... in byte order), and adjacent symbols are merged pair by pair, the
// pair of lowest merge rank first, every occurrence of it left to right.
#pragma once

#include "engine/text/tokenizer.hpp"

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace loom::text {

class ByteLevelBpe {
 public:
  ByteLevelBpe();  // the byte map; an empty vocabulary

  // Token `token` (mapped characters, UTF-8) has id `id`; false when the token or the id
  // is given twice.
  bool add_token(const std::string& token, int32_t id);
  // The next merge rank: `left` + `right` (mapped characters) merge into one symbol.
  // False when one of the three is not a token (add the tokens first).
  bool add_merge(const std::string& left, const std::string& right);
  // With ignore_merges (Hugging Face's BPE option, Llama 3's tokenizer) a piece that
  // is a token whole is that token, whatever the merges would make of it.
  void set_ignore_merges(bool ignore) { ignore_merges_ = ignore; }

  // Tokens with ids 0..size()-1, all present; else the first missing id.
  int32_t size() const { return static_cast<int32_t>(tokens_.size()); }
  int32_t first_missing_id() const;
  size_t merges() const { return merges_.size(); }
  // The first byte with no single-byte token, or -1.
  int first_byte_without_token() const;
  // The id of a token as the vocabulary spells it, or -1.
  int32_t id_of(const std::string& token) const;
  // The token of an id; TokenizerError (naming `source`) outside the vocabulary.
  const std::string& token(int32_t id, const std::string& source) const;

  // Appends the ids of one piece's bytes; `source` names the vocabulary in errors.
  // Safe to call from several threads at once.
  void encode_piece(std::string_view piece, std::vector<int32_t>& out, const std::string& source) const;
  // Appends a token's bytes (mapped characters back to bytes; others as written).
  void append_bytes(const std::string& token, std::string& out) const;

 private:
  void merge_piece(std::string_view piece, std::vector<int32_t>& out, const std::string& source) const;

  std::unordered_map<std::string, int32_t> ids_;    // token -> id
  std::vector<std::string> tokens_;                 // id -> token ("" until given)
  std::vector<bool> given_;
  struct Merge {
    int32_t rank, id;  // its rank, and the token it makes
  };
  std::unordered_map<uint64_t, Merge> merges_;     // (left id << 32 | right id) -> the merge
  int32_t next_rank_ = 0;
  std::string byte_char_[256];                      // byte -> its printable character, UTF-8
  std::vector<int32_t> byte_id_ = std::vector<int32_t>(256, -1);  // byte -> its token (-1: none yet)
  std::unordered_map<std::string, unsigned char> char_byte_;
  bool ignore_merges_ = false;
  uint64_t vocabulary_id_ = 0;  // one per object: the key of the threads' merge caches
};

}  // namespace loom::text
