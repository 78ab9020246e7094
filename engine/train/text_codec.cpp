#include "engine/train/text_codec.hpp"

namespace loom::train {

TextCodec::TextCodec(const std::string& tokenizer, const manifest::RunConfig& config) {
  if (!tokenizer.empty()) {
    tokenizer_ = text::load_tokenizer(tokenizer);
  } else if (!config.data.tokenizer.empty()) {  // the one the model was trained with
    try {
      tokenizer_ = text::load_tokenizer(config.data.tokenizer);
    } catch (const text::TokenizerError& e) {
      throw text::TokenizerError("the model was trained with data.tokenizer = " + config.data.tokenizer +
                                 ", which does not load here (" + e.what() + "); give it with --tokenizer");
    }
  } else if (config.data.kind == "synthetic") {
    symbols_ = make_data_source(config);
  } else if (config.data.kind != "text") {
    throw DataError("the model was trained on data.kind = \"" + config.data.kind +
                    "\" tokens: give their tokenizer (--tokenizer), or token ids");
  }
}

std::vector<int32_t> TextCodec::encode(const std::string& s) const {
  if (tokenizer_) return tokenizer_->encode(s);
  if (symbols_) return symbols_->encode(s);
  std::vector<int32_t> bytes;  // data.kind = "text": the bytes are the tokens
  for (unsigned char c : s) bytes.push_back(c);
  return bytes;
}

std::string TextCodec::decode(const std::vector<int32_t>& ids) const {
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
