// Token files a training run reads: Megatron-LM's indexed dataset (PREFIX.bin, the
// tokens of every document back to back, and PREFIX.idx, where each document
// starts: megatron/core/datasets/indexed_dataset.py's MMIDIDX format, version 1,
// one sequence per document) and llm.c's .bin (a 256-int32 header, magic
// 20240520, version 1, token count, then uint16 tokens).
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace loom::files {
class Temporary;
}

namespace loom::text {

class TokenFileError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Element type of the tokens: uint16 when the vocabulary has fewer than 65500
// tokens (Megatron's rule), int32 otherwise.
enum class TokenType { U16, I32 };
TokenType token_type_for(int64_t vocab_size);

// Writes PREFIX.bin and PREFIX.idx document by document. The files appear only when
// finish() succeeds: they are written as PREFIX.*.tmp, flushed and renamed, so a
// failed or interrupted run leaves no half-written dataset under the final names.
class IndexedDatasetWriter {
 public:
  IndexedDatasetWriter(const std::string& prefix, TokenType type);
  ~IndexedDatasetWriter();  // the temporary files are removed unless finish() renamed them
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;

  // Throws TokenFileError when a token does not fit the type or a write fails. A
  // document is one sequence; an empty one has none (as Megatron's builder writes it:
  // its document index entry repeats the sequence count).
  void add_document(const std::vector<int32_t>& tokens);
  void finish();
  int64_t documents() const { return static_cast<int64_t>(doc_ends_.size()); }
  int64_t tokens() const { return tokens_; }

 private:
  std::string prefix_;
  TokenType type_;
  std::unique_ptr<files::Temporary> bin_tmp_;  // PREFIX.bin.tmp, removed unless finish() renamed it
  std::FILE* bin_ = nullptr;
  std::vector<int32_t> lengths_;     // per sequence
  std::vector<uint64_t> doc_ends_;   // per document: the sequences written after it
  int64_t tokens_ = 0;
};

// For an indexed dataset named with its .bin (PREFIX.bin.idx does not exist): what to
// give instead, " (an indexed dataset is named by its prefix, without .bin: PREFIX)";
// "" otherwise.
std::string indexed_prefix_hint(const std::string& prefix);

// A dataset IndexedDatasetWriter wrote (or Megatron-LM's preprocess_data.py did),
// read whole. Throws TokenFileError naming the file and what is wrong.
struct IndexedDataset {
  TokenType type = TokenType::U16;
  std::vector<std::vector<int32_t>> documents;
  static IndexedDataset read(const std::string& prefix);
};

// llm.c's token file: every token of every document, in order. Written as PATH.tmp
// and renamed. Throws TokenFileError when a token is outside uint16.
void write_llmc_tokens(const std::string& path, const std::vector<int32_t>& tokens);

}  // namespace loom::text
