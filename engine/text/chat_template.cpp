#include "engine/text/chat_template.hpp"

#include "engine/files/read.hpp"

#include <boost/filesystem.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <optional>

namespace loom::text {
namespace {

namespace fs = boost::filesystem;

// Python's str.isspace() characters (what Jinja's trim filter strips under
// transformers) at the start of `s`: their byte length, or 0.
size_t whitespace_at(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (c == ' ' || (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x1f)) return 1;
  auto starts = [&](std::string_view w) { return s.substr(i, w.size()) == w; };
  if (starts("\xc2\x85") || starts("\xc2\xa0")) return 2;
  if (starts("\xe1\x9a\x80") || starts("\xe2\x80\xa8") || starts("\xe2\x80\xa9") || starts("\xe2\x80\xaf") ||
      starts("\xe2\x81\x9f") || starts("\xe3\x80\x80"))
    return 3;
  if (starts("\xe2\x80") && i + 2 < s.size()) {  // U+2000..U+200A
    const auto last = static_cast<unsigned char>(s[i + 2]);
    if (last >= 0x80 && last <= 0x8a) return 3;
  }
  return 0;
}

// The byte length of the UTF-8 character at s[i]: its lead byte's count when the
// continuation bytes follow, else 1 (a byte that is not UTF-8 stands alone).
size_t character_at(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  const size_t n = c < 0xc0 ? 1 : c < 0xe0 ? 2 : c < 0xf0 ? 3 : c < 0xf8 ? 4 : 1;
  if (i + n > s.size()) return 1;
  for (size_t k = 1; k < n; ++k)
    if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return 1;
  return n;
}

std::string trim(std::string_view s) {
  size_t begin = 0;
  while (begin < s.size()) {
    const size_t n = whitespace_at(s, begin);
    if (n == 0) break;
    begin += n;
  }
  // The end: after the last character that is not white space, scanning forward
  // (UTF-8 is not read backwards safely).
  size_t end = begin;
  for (size_t i = begin; i < s.size();) {
    if (const size_t n = whitespace_at(s, i); n > 0) {
      i += n;
      continue;
    }
    i += character_at(s, i);
    end = i;
  }
  return std::string(s.substr(begin, end - begin));
}

// The one id `text` encodes to, or -1.
int32_t single_token(const Tokenizer& tokenizer, const std::string& text) {
  const std::vector<int32_t> ids = tokenizer.encode(text);
  return ids.size() == 1 && tokenizer.piece(ids[0]) == text ? ids[0] : -1;
}

std::string read_text(const fs::path& path) {
  std::string why;
  std::optional<std::string> text = files::read_whole_file(path.string(), &why);
  if (!text) throw TokenizerError(path.string() + ": cannot read the file (" + why + ")");
  return std::move(*text);
}

nlohmann::json read_json(const fs::path& path) {
  try {
    return nlohmann::json::parse(read_text(path));
  } catch (const nlohmann::json::exception& e) {
    throw TokenizerError(path.string() + ": not JSON (" + e.what() + ")");
  }
}

// A config's "chat_template": a string, or [{"name", "template"}, ...] whose "default"
// entry is the one apply_chat_template takes; "" when absent.
std::string chat_template_member(const nlohmann::json& cfg, const std::string& where) {
  if (!cfg.is_object() || !cfg.contains("chat_template") || cfg["chat_template"].is_null()) return "";
  const nlohmann::json& t = cfg["chat_template"];
  if (t.is_string()) return t.get<std::string>();
  if (t.is_array())
    for (const nlohmann::json& entry : t)
      if (entry.is_object() && entry.contains("name") && entry["name"] == "default" && entry.contains("template") &&
          entry["template"].is_string())
        return entry["template"].get<std::string>();
  throw TokenizerError(where + ": chat_template is neither a string nor a list with a \"default\" template");
}

// The distinct "<|...|>" markers a Jinja template's text holds, in order of appearance.
std::vector<std::string> special_markers(const std::string& text) {
  std::vector<std::string> out;
  for (size_t at = text.find("<|"); at != std::string::npos; at = text.find("<|", at + 2)) {
    const size_t end = text.find("|>", at + 2);
    if (end == std::string::npos || end - at > 64) continue;
    std::string m = text.substr(at, end + 2 - at);
    if (std::find(out.begin(), out.end(), m) == out.end()) out.push_back(std::move(m));
  }
  return out;
}

}  // namespace

const std::vector<std::string>& ChatTemplate::names() {
  static const std::vector<std::string> kNames{"chatml", "llama3"};
  return kNames;
}

ChatTemplate ChatTemplate::named(std::string_view name) {
  ChatTemplate t;
  t.name_ = std::string(name);
  if (name == "chatml") {
    t.role_before_ = "<|im_start|>";
    t.role_after_ = "\n";
    t.turn_end_ = "<|im_end|>";
    t.after_turn_ = "\n";
    t.end_of_text_ = "<|endoftext|>";
  } else if (name == "llama3") {
    t.begin_ = "<|begin_of_text|>";
    t.role_before_ = "<|start_header_id|>";
    t.role_after_ = "<|end_header_id|>\n\n";
    t.turn_end_ = "<|eot_id|>";
    t.end_of_text_ = "<|end_of_text|>";
    t.trim_content_ = true;
  } else {
  {
    std::string known;
    for (const std::string& n : names()) known += (known.empty() ? "\"" : ", \"") + n + "\"";
    throw TokenizerError("chat template \"" + std::string(name) + "\" is unknown; loom writes " + known);
  }
  }
  return t;
}

std::string ChatTemplate::header(const std::string& role) const { return role_before_ + role + role_after_; }

std::string ChatTemplate::content(const std::string& text) const { return trim_content_ ? trim(text) : text; }

std::string ChatTemplate::turn(const ChatMessage& message, bool first) const {
  return (first ? begin_ : "") + header(message.role) + content(message.content) + turn_end_ + after_turn_;
}

ChatTemplate ChatTemplate::with_default_system(std::string message) const {
  ChatTemplate t = *this;
  t.default_system_ = std::move(message);
  return t;
}

std::string ChatTemplate::describe() const {
  return default_system_.empty() ? name_ : name_ + " (a default system message: \"" + default_system_ + "\")";
}

Conversation ChatTemplate::with_default(const Conversation& conversation) const {
  if (default_system_.empty() || conversation.empty() || conversation.front().role == "system") return conversation;
  Conversation out{{"system", default_system_}};
  out.insert(out.end(), conversation.begin(), conversation.end());
  return out;
}

std::string ChatTemplate::render(const Conversation& given, bool generation_prompt) const {
  const Conversation conversation = with_default(given);
  std::string text;
  for (size_t i = 0; i < conversation.size(); ++i) text += turn(conversation[i], i == 0);
  if (generation_prompt) text += (conversation.empty() ? begin_ : "") + header("assistant");
  return text;
}

ChatTokens ChatTemplate::encode(const Tokenizer& tokenizer, const Conversation& given,
                                bool generation_prompt) const {
  const Conversation conversation = with_default(given);
  ChatTokens out;
  auto append = [&out](const std::vector<int32_t>& ids, size_t context) {
    out.ids.insert(out.ids.end(), ids.begin(), ids.end());
    for (size_t k = 0; k < ids.size(); ++k) out.target.push_back(k >= context ? 1 : 0);
  };
  for (size_t i = 0; i < conversation.size(); ++i) {
    const ChatMessage& m = conversation[i];
    const std::vector<int32_t> ids = tokenizer.encode(turn(m, i == 0));
    if (m.role != "assistant") {
      append(ids, ids.size());
      continue;
    }
    // The targets start after the tokens the header alone has; where the header's last
    // token merges with the content's first (a header ending in "\n", content starting
    // with one), that token is a target.
    const std::vector<int32_t> head = tokenizer.encode((i == 0 ? begin_ : "") + header(m.role));
    const size_t context = static_cast<size_t>(
        std::mismatch(head.begin(), head.end(), ids.begin(), ids.end()).first - head.begin());
    append(ids, context);
  }
  if (generation_prompt) {
    const std::vector<int32_t> head = tokenizer.encode((conversation.empty() ? begin_ : "") + header("assistant"));
    append(head, head.size());
  }
  return out;
}

void ChatTemplate::require_special_tokens(const Tokenizer& tokenizer) const {
  for (const std::string& special : {begin_, role_before_, turn_end_}) {
    if (special.empty()) continue;
    if (single_token(tokenizer, special) < 0)
      throw TokenizerError("chat template " + name_ + " writes " + special + ", which is not one token of " +
                           tokenizer.describe() + " (a tokenizer of another family of models?)");
  }
  if (name_ == "llama3" && single_token(tokenizer, "<|end_header_id|>") < 0)
    throw TokenizerError("chat template llama3 writes <|end_header_id|>, which is not one token of " +
                         tokenizer.describe());
}

int32_t ChatTemplate::end_of_turn(const Tokenizer& tokenizer) const {
  const int32_t id = single_token(tokenizer, turn_end_);
  if (id < 0) require_special_tokens(tokenizer);  // says which
  return id;
}

int32_t ChatTemplate::end_of_conversation(const Tokenizer& tokenizer) const {
  if (const int32_t id = single_token(tokenizer, end_of_text_); id >= 0) return id;
  const int32_t eod = tokenizer.eod();
  if (eod < 0) return -1;
  const std::string piece = tokenizer.piece(eod);
  for (const std::string& special : {begin_, role_before_, role_after_, turn_end_})
    if (!special.empty() && special.find(piece) != std::string::npos) return -1;
  return eod;
}

std::string ChatTemplate::jinja() const {
  if (name_ == "llama3")  // Meta-Llama-3-8B-Instruct's tokenizer_config.json, with its bos written out
    return "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
           "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
           "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = '<|begin_of_text|>' + content %}{% endif %}"
           "{{ content }}{% endfor %}{% if add_generation_prompt %}"
           "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";
  return "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
         "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
         "{% endif %}";
}

std::string declared_chat_template_text(const std::string& tokenizer_path) {
  const TokenizerSource source = tokenizer_source(tokenizer_path);
  const fs::path dir =
      source.format == TokenizerFormat::Gpt2Bpe ? fs::path(source.file) : fs::path(source.file).parent_path();
  if (fs::is_regular_file(dir / "chat_template.jinja")) return read_text(dir / "chat_template.jinja");
  for (const char* file : {"chat_template.json", "tokenizer_config.json"}) {
    const fs::path path = dir / file;
    if (!fs::is_regular_file(path)) continue;
    const std::string text = chat_template_member(read_json(path), path.string());
    if (!text.empty() || std::string(file) == "chat_template.json") return text;
  }
  return "";
}

std::string declared_chat_template(const std::string& tokenizer_path) {
  const std::string text = declared_chat_template_text(tokenizer_path);
  if (text.empty()) return "";
  // A family is recognised by its turn markers, and only when the template writes no
  // marker the family does not have (Phi-4's ChatML-like turns add <|im_sep|>).
  const std::vector<std::string> markers = special_markers(text);
  const auto only = [&](std::initializer_list<std::string_view> known) {
    return std::all_of(markers.begin(), markers.end(), [&](const std::string& m) {
      return std::find(known.begin(), known.end(), m) != known.end();
    });
  };
  const auto has = [&](std::string_view m) { return std::find(markers.begin(), markers.end(), m) != markers.end(); };
  if (has("<|im_start|>") && has("<|im_end|>") && only({"<|im_start|>", "<|im_end|>", "<|endoftext|>"}))
    return "chatml";
  if (has("<|start_header_id|>") && has("<|eot_id|>") &&
      only({"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
            "<|python_tag|>", "<|end_of_text|>"}))
    return "llama3";
  std::string seen;
  for (const std::string& m : markers) seen += (seen.empty() ? "" : " ") + m;
  throw TokenizerError(tokenizer_path + " declares a chat template loom does not write (it writes ChatML's "
                       "<|im_start|> ... <|im_end|> turns and Llama 3's <|start_header_id|> ... <|eot_id|> turns; "
                       "this one's markers: " + (seen.empty() ? std::string("none") : seen) +
                       "); name one (data.chat_template, --chat-template) if the model was trained with it");
}

std::string default_system_message(const std::string& jinja) {
  const std::string head = "<|im_start|>system\\n";  // as the Jinja source spells it: a backslash, n
  for (size_t at = jinja.find(head); at != std::string::npos; at = jinja.find(head, at + 1)) {
    const size_t from = at + head.size(), end = jinja.find("<|im_end|>", from);
    if (end == std::string::npos) break;
    const std::string message = jinja.substr(from, end - from);
    // Text alone: not the end of a quoted string joined to an expression.
    if (message.empty() || message.find_first_of("'\"{}%+") != std::string::npos) continue;
    std::string text;
    for (size_t i = 0; i < message.size(); ++i)
      if (message[i] == '\\' && i + 1 < message.size() && message[i + 1] == 'n') text += '\n', ++i;
      else text += message[i];
    return text;
  }
  return "";
}

ChatTemplate resolve_chat_template(const std::string& name, const std::string& tokenizer_path,
                                   const std::string& how_to_name) {
  if (!name.empty()) return ChatTemplate::named(name);
  const std::string declared = tokenizer_path.empty() ? "" : declared_chat_template(tokenizer_path);
  if (declared.empty())
    throw TokenizerError("no chat template: the tokenizer (" + (tokenizer_path.empty() ? "none" : tokenizer_path) +
                         ") declares none (chat_template.jinja, or tokenizer_config.json's chat_template); " +
                         how_to_name);
  const ChatTemplate t = ChatTemplate::named(declared);
  return declared == "chatml" ? t.with_default_system(default_system_message(declared_chat_template_text(tokenizer_path)))
                              : t;
}

Conversation conversation_from_json(const nlohmann::json& json) {
  const nlohmann::json* messages = &json;
  if (!json.is_object() && !json.is_array())
    throw TokenizerError("a conversation is {\"messages\": [...]}; this line is " + json.dump().substr(0, 60));
  if (json.is_object()) {
    if (!json.contains("messages"))
      throw TokenizerError("a conversation is {\"messages\": [...]}; this object has no \"messages\"");
    messages = &json["messages"];
  }
  if (!messages->is_array()) throw TokenizerError("\"messages\" is not a list of {\"role\", \"content\"} objects");
  if (messages->empty()) throw TokenizerError("the conversation has no messages");
  Conversation conversation;
  for (size_t i = 0; i < messages->size(); ++i) {
    const nlohmann::json& m = (*messages)[i];
    const std::string where = "message " + std::to_string(i + 1);
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      throw TokenizerError(where + " is not an object with a \"role\" string");
    const std::string role = m["role"].get<std::string>();
    if (role != "system" && role != "user" && role != "assistant")
      throw TokenizerError(where + ": role \"" + role + "\" is not system, user or assistant (loom writes no tool "
                           "calls)");
    if (!m.contains("content") || !m["content"].is_string())
      throw TokenizerError(where + " (" + role + "): \"content\" is not a string");
    conversation.push_back({role, m["content"].get<std::string>()});
  }
  return conversation;
}

}  // namespace loom::text
