// The text of generated tokens as they come (`loom generate`'s printing, `loom serve`'s
// streamed answers): each new token's text once it is final. A token that decodes to
// a lone byte of a multi-byte character (U+FFFD) is held back until the character is
// whole, and so is text that may be the start of a stop string; at a stop string the
// text ends before it.
#pragma once

#include "engine/train/text_codec.hpp"

#include <cstdint>
#include <string>
#include <vector>

namespace loom::cli {

class ReplyText {
 public:
  // `context`: the tokens before the reply (the prompt), decoded with it so that a
  // tokenizer whose text depends on the token before (SentencePiece's leading space)
  // writes the reply as it would the whole. `stops`: strings that end the reply
  // (none empty).
  ReplyText(const train::TextCodec& codec, std::vector<int32_t> context, std::vector<std::string> stops = {});

  // Adds a token; returns the text that became final with it (often all of its text,
  // sometimes nothing). Nothing after a stop string.
  std::string add(int32_t token);
  // The text still held back (a character left incomplete, the start of a stop string
  // that never came): the reply ends here.
  std::string finish();

  bool stopped() const { return stopped_; }         // a stop string came
  const std::string& text() const { return given_; }  // the text given so far
  const std::string& context_text() const { return context_text_; }

 private:
  std::string reply_so_far() const;
  std::string give_up_to(size_t end);

  const train::TextCodec& codec_;
  std::vector<int32_t> ids_;  // the context, then the reply's tokens
  size_t context_size_;
  std::string context_text_;
  std::vector<std::string> stops_;
  std::string given_;
  bool stopped_ = false;
};

}  // namespace loom::cli
