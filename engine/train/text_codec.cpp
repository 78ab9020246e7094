#include "engine/train/text_codec.hpp"

namespace loom::train {

TextCodec::TextCodec(const std::string& tokenizer, const manifest::RunConfig& config) {
  if (!tokenizer.empty()) {
    tokenizer_ = text::load_tokenizer(tokenizer);
    require_trained_vocabulary(config.data.tokenizer);
  } else if (!config.data.tokenizer.empty()) {  // the one the model was trained with
    try {
      tokenizer_ = text::load_tokenizer(config.data.tokenizer);
    } catch (const text::TokenizerError& e) {
      throw text::TokenizerError("the model was trained with data.tokenizer = " + config.data.tokenizer +
                                 ", which does not load here (" + e.what() + "); give it with --tokenizer");
    }
  } else if (config.data.kind == "synthetic") {
    symbols_ = make_data_source(config);
  } else if (config.data.kind != "text") {  // ids only: text is refused when it comes
    no_text_ = "the model reads token ids of no tokenizer loom knows (data.kind = \"" + config.data.kind +
               "\" without data.tokenizer): give the tokenizer (--tokenizer), or ids in place of text";
  }
}

// A tokenizer given in place of data.tokenizer must spell the same vocabulary (when
// data.tokenizer still loads: else it stands in for it).
void TextCodec::require_trained_vocabulary(const std::string& trained) const {
  if (trained.empty()) return;
  std::unique_ptr<text::Tokenizer> was;
  try {
    was = text::load_tokenizer(trained);
  } catch (const text::TokenizerError&) {
    return;
  }
  if (!text::same_vocabulary(*was, *tokenizer_))
    throw DataError("the tokenizer " + tokenizer_->describe() + " is not the one the model was trained with (" +
                    was->describe() + ", data.tokenizer): its ids would be read as another vocabulary's");
}

void TextCodec::require_fits(int64_t model_vocab) const {
  if (vocab() > model_vocab)
    throw DataError("the tokenizer's " + std::to_string(vocab()) + " tokens (" + describe() +
                    ") are more than the model's vocabulary of " + std::to_string(model_vocab) +
                    " (a model trained on token files without data.tokenizer has the largest id in them + 1): it "
                    "could not take every id the tokenizer gives; train with data.tokenizer set");
}

std::vector<int32_t> TextCodec::encode(const std::string& s) const {
  if (!no_text_.empty()) throw DataError(no_text_);
  if (tokenizer_) return tokenizer_->encode(s);
  if (symbols_) return symbols_->encode(s);
  std::vector<int32_t> bytes;  // data.kind = "text": the bytes are the tokens
  for (unsigned char c : s) bytes.push_back(c);
  return bytes;
}

std::string TextCodec::decode(const std::vector<int32_t>& ids) const {
  if (!no_text_.empty()) {  // the ids themselves
    std::string s;
    for (size_t i = 0; i < ids.size(); ++i) s += (i ? " " : "") + std::to_string(ids[i]);
    return s;
  }
  if (tokenizer_) return tokenizer_->decode(ids);
  if (symbols_) return symbols_->render(ids.data(), static_cast<int64_t>(ids.size()));
  std::string s;
  for (int32_t t : ids) s += static_cast<char>(t);
  return s;
}

std::string TextCodec::describe() const {
  if (tokenizer_) return tokenizer_->describe();
  if (symbols_) return symbols_->describe();
  return "bytes";
}

}  // namespace loom::train
