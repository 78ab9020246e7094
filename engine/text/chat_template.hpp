// Conversations as text and tokens, for supervised fine-tuning (data.kind = "chat") and
// chat generation (`loom generate --chat`). A chat template writes each message as a
// turn: a header naming the role, the content, and a marker that ends the turn; the
// model learns to write the assistant's turns, so those (after their header, up to the
// end of the turn) are the targets and everything else is context, as Megatron-LM's
// SFT dataset (tokenize_conversation) counts them.
//
// Two templates, written as the models' own Jinja chat templates write these messages
// (tokenizer_config.json's chat_template, rendered by transformers'
// apply_chat_template; tests/text/chat_test.sh renders them with Hugging Face's Jinja):
//   chatml   "<|im_start|>ROLE\nCONTENT<|im_end|>\n" per turn (Qwen 1.5 to 3, and others)
//   llama3   "<|begin_of_text|>" then "<|start_header_id|>ROLE<|end_header_id|>\n\n"
//            CONTENT (whitespace trimmed) "<|eot_id|>" per turn (Llama 3, 3.1, 3.2, 3.3)
// A ChatML template a directory declares may add a default system message when the
// first is not one (Qwen2's "You are a helpful assistant.", Qwen2.5's "You are Qwen,
// ..."): that message is read from its Jinja text and written alike. What else those
// templates add is not written: Llama 3.1's knowledge-cutoff system lines, tools,
// Qwen3's thinking sections; give a system message in the conversation instead.
#pragma once

#include "engine/text/tokenizer.hpp"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace loom::text {

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};
using Conversation = std::vector<ChatMessage>;

// A conversation's tokens and, for each, whether the model learns to write it.
struct ChatTokens {
  std::vector<int32_t> ids;
  std::vector<uint8_t> target;  // 1: a token of an assistant turn after its header
};

class ChatTemplate {
 public:
  // "chatml" or "llama3"; throws TokenizerError naming the known ones otherwise.
  static ChatTemplate named(std::string_view name);
  static const std::vector<std::string>& names();

  const std::string& name() const { return name_; }
  // The template with a system message written first when a conversation starts with
  // another role (a declared template's default); "" = none.
  ChatTemplate with_default_system(std::string message) const;
  // "chatml", or with its default system message.
  std::string describe() const;
  // The Jinja chat template that renders as this one does, for a tokenizer_config.json
  // (Llama-3-Instruct's own for llama3, the plain ChatML one for chatml).
  std::string jinja() const;
  // The text of a conversation, and with `generation_prompt` the header of the
  // assistant's turn that follows (apply_chat_template's add_generation_prompt).
  std::string render(const Conversation& conversation, bool generation_prompt) const;
  // The tokens of render(conversation, generation_prompt), encoded turn by turn (as
  // Megatron-LM's tokenize_conversation does: each turn ends in a special token, so the
  // turns' tokens are those of the whole text) with the assistant turns' targets.
  ChatTokens encode(const Tokenizer& tokenizer, const Conversation& conversation, bool generation_prompt) const;
  // Throws TokenizerError naming the first special token of the template that is not
  // one token of `tokenizer` (a tokenizer made for another family of models).
  void require_special_tokens(const Tokenizer& tokenizer) const;
  // The token that ends a turn (<|im_end|>, <|eot_id|>): where a reply stops.
  int32_t end_of_turn(const Tokenizer& tokenizer) const;
  // The token that ends a conversation in training data, which must not be one the
  // template writes inside it (an Instruct tokenizer's eos is its end of turn): the
  // family's end of text (<|endoftext|> for ChatML as Qwen has it, <|end_of_text|> for
  // Llama 3) when it is one token, else the tokenizer's eod when the template does not
  // write it; -1 when neither.
  int32_t end_of_conversation(const Tokenizer& tokenizer) const;

 private:
  std::string header(const std::string& role) const;
  std::string content(const std::string& text) const;
  std::string turn(const ChatMessage& message, bool first) const;
  Conversation with_default(const Conversation& conversation) const;

  std::string name_;
  std::string begin_;        // before the first turn
  std::string role_before_;  // header: role_before_ + ROLE + role_after_
  std::string role_after_;
  std::string turn_end_;     // the special token that ends a turn
  std::string after_turn_;   // what follows it
  std::string end_of_text_;  // the family's token that ends a document
  bool trim_content_ = false;
  std::string default_system_;
};

// The Jinja chat template a tokenizer's directory declares, as transformers looks for
// it: chat_template.jinja, else chat_template.json's "chat_template", else
// tokenizer_config.json's "chat_template" (a string, or the entry named "default" of a
// list); "" when none does. Throws TokenizerError for a file it cannot read.
std::string declared_chat_template_text(const std::string& tokenizer_path);

// The named template loom writes as a declared one does, recognised by its turn
// markers; "" when the directory declares none. Throws TokenizerError for a declared
// template loom does not write.
std::string declared_chat_template(const std::string& tokenizer_path);

// The system message a ChatML Jinja template writes when the conversation has none:
// the text of its "<|im_start|>system\n...<|im_end|>" literal; "" when it has none.
std::string default_system_message(const std::string& jinja);

// `name`, else the template the tokenizer at `tokenizer_path` declares (with its
// default system message). Throws
// TokenizerError for an unknown name, a declared template loom does not write, or none
// at all (the message ends with `how_to_name`, e.g. "set data.chat_template").
ChatTemplate resolve_chat_template(const std::string& name, const std::string& tokenizer_path,
                                   const std::string& how_to_name);

// Megatron-LM's SFT format: {"messages": [{"role": "system"|"user"|"assistant",
// "content": "..."}, ...]} (or the list alone). Throws TokenizerError naming what is
// wrong: another role (tool calls are not written), content that is not a string,
// no messages.
Conversation conversation_from_json(const nlohmann::json& json);

}  // namespace loom::text
