// Text to the token ids a model was trained on, and back, for the commands that take
// or print text (`loom generate`, `loom eval`): a tokenizer file (GPT-2 BPE or
// SentencePiece), or what the run's data defines without one — a synthetic task's
// symbols, or bytes for data.kind = "text".
#pragma once

#include "engine/manifest/run_config.hpp"
#include "engine/text/tokenizer.hpp"
#include "engine/train/data.hpp"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace loom::train {

class TextCodec {
 public:
  // `tokenizer`: a path, or "" for data.tokenizer, else the data's own symbols; token
  // files without a tokenizer have no text (has_text(): ids in, ids out). Throws
  // text::TokenizerError for a tokenizer that does not load.
  // A `tokenizer` other than a data.tokenizer that loads (another vocabulary) is a DataError.
  TextCodec(const std::string& tokenizer, const manifest::RunConfig& config);
  // Throws DataError when the codec has more tokens than the model's vocabulary (what
  // sampling needs: every id the codec gives or stops at is one of the model's).
  void require_fits(int64_t model_vocab) const;
  // Throws DataError (or TokenizerError) for text it cannot encode (any, without text).
  std::vector<int32_t> encode(const std::string& text) const;
  // Ids outside what the codec knows print as the data source renders them; without
  // text, the ids themselves, space-separated.
  std::string decode(const std::vector<int32_t>& ids) const;
  bool has_text() const { return no_text_.empty(); }
  int32_t eod() const { return tokenizer_ ? tokenizer_->eod() : -1; }  // -1: none
  int64_t vocab() const { return tokenizer_ ? tokenizer_->vocab_size() : 0; }  // 0: the model's
  const text::Tokenizer* tokenizer() const { return tokenizer_.get(); }        // null: the data's own symbols
  std::string describe() const;

 private:
  void require_trained_vocabulary(const std::string& trained) const;

  std::unique_ptr<text::Tokenizer> tokenizer_;
  std::unique_ptr<DataSource> symbols_;  // a synthetic task
  std::string no_text_;                  // why there is no text ("": there is)
};

}  // namespace loom::train
