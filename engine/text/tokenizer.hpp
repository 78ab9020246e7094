// A tokenizer: text to token ids and back. Three kinds, chosen by what the path
// names (tokenizer_source): GPT-2's byte-level BPE from encoder.json and vocab.bpe
// (gpt2_tokenizer.hpp); Hugging Face's tokenizer.json with a byte-level BPE model, as
// Llama 3 and Qwen ship theirs (hf_tokenizer.hpp); a SentencePiece .model file (Kudo and
// Richardson, 2018), read by Debian's libsentencepiece, as Llama 2 ships its own.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace loom::text {

class TokenizerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Safe to call from several threads at once.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Throws TokenizerError for an id outside the vocabulary.
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  virtual int32_t vocab_size() const = 0;
  // The end-of-document token (GPT-2's <|endoftext|>, SentencePiece's </s>); -1 when none.
  virtual int32_t eod() const = 0;
  // The beginning-of-document and unknown tokens (GPT-2: <|endoftext|> for both, as its
  // Hugging Face tokenizer says); -1 when none.
  virtual int32_t bos() const = 0;
  virtual int32_t unk() const = 0;
  // The vocabulary's entry for an id, as the tokenizer file spells it ("<|endoftext|>",
  // "▁the"); throws TokenizerError outside the vocabulary.
  virtual std::string piece(int32_t id) const = 0;
  // "GPT-2 BPE (50257 tokens) from DIR".
  virtual std::string describe() const = 0;
};

// What a tokenizer path names, by what it holds: a directory with encoder.json (GPT-2's
// BPE files), else with tokenizer.model (SentencePiece's, as Hugging Face's Llama 2 and
// Mistral directories ship it, beside a tokenizer.json of it), else with tokenizer.json
// (Hugging Face's: Llama 3's, Qwen's); a file
// named *.json is a tokenizer.json, any other file a SentencePiece model. `file`: the
// file to read (the directory itself for GPT-2's pair).
enum class TokenizerFormat { Gpt2Bpe, HuggingFaceJson, SentencePiece };
struct TokenizerSource {
  TokenizerFormat format;
  std::string file;
};
// Throws TokenizerError naming what would be.
TokenizerSource tokenizer_source(const std::string& path);

// Throws TokenizerError naming the path and what is wrong.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path);

// The same ids for the same pieces (wherever the two were loaded from).
bool same_vocabulary(const Tokenizer& a, const Tokenizer& b);

// Trains a SentencePiece model on text files (one sentence per line, as
// SentencePiece reads them) into PREFIX.model and PREFIX.vocab. `model_type`:
// "bpe" or "unigram". Throws TokenizerError with SentencePiece's message.
struct SentencePieceTraining {
  std::vector<std::string> inputs;
  std::string model_prefix;
  int32_t vocab_size = 32000;
  std::string model_type = "bpe";
  double character_coverage = 0.9995;
  int threads = 1;
};
void train_sentencepiece(const SentencePieceTraining& how);

}  // namespace loom::text
