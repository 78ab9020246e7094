#include "engine/text/chat_template.hpp"

#include <boost/filesystem.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>

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

std::string trim(std::string_view s) {
  size_t begin = 0;
  while (begin < s.size()) {
    const size_t n = whitespace_at(s, begin);
    if (n == 0) break;
    begin += n;
  }
  // The end: the last non-space character's end, scanning forward (UTF-8 is not
  // read backwards safely).
  size_t end = begin;
  for (size_t i = begin; i < s.size();) {
    const size_t n = whitespace_at(s, i);
    if (n > 0) {
      i += n;
      continue;
    }
    const auto c = static_cast<unsigned char>(s[i]);
    i += c < 0x80 ? 1 : c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
    end = std::min(i, s.size());
  }
  return std::string(s.substr(begin, end - begin));
}

// The one id `text` encodes to, or -1.
int32_t single_token(const Tokenizer& tokenizer, const std::string& text) {
  const std::vector<int32_t> ids = tokenizer.encode(text);
  return ids.size() == 1 && tokenizer.piece(ids[0]) == text ? ids[0] : -1;
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path.string(), std::ios::binary);
  if (!in) throw TokenizerError(path.string() + ": cannot open the file");
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw TokenizerError(path.string() + ": not JSON (" + e.what() + ")");
  }
}

// tokenizer_config.json's chat_template: a string, or [{"name", "template"}, ...] whose
// "default" entry is the one apply_chat_template takes.
std::string chat_template_text(const nlohmann::json& cfg, const std::string& where) {
  if (!cfg.is_object() || !cfg.contains("chat_template") || cfg["chat_template"].is_null()) return "";
  const nlohmann::json& t = cfg["chat_template"];
  if (t.is_string()) return t.get<std::string>();
  if (t.is_array())
    for (const nlohmann::json& entry : t)
      if (entry.is_object() && entry.value("name", "") == "default" && entry.contains("template") &&
          entry["template"].is_string())
        return entry["template"].get<std::string>();
  throw TokenizerError(where + ": chat_template is neither a string nor a list with a \"default\" template");
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
  } else if (name == "llama3") {
    t.begin_ = "<|begin_of_text|>";
    t.role_before_ = "<|start_header_id|>";
    t.role_after_ = "<|end_header_id|>\n\n";
    t.turn_end_ = "<|eot_id|>";
    t.trim_content_ = true;
  } else {
    throw TokenizerError("chat template \"" + std::string(name) + "\" is unknown; loom writes \"chatml\" (Qwen) and "
                         "\"llama3\" (Llama 3)");
  }
  return t;
}

std::string ChatTemplate::header(const std::string& role) const { return role_before_ + role + role_after_; }

std::string ChatTemplate::content(const std::string& text) const { return trim_content_ ? trim(text) : text; }

std::string ChatTemplate::turn(const ChatMessage& message, bool first) const {
  return (first ? begin_ : "") + header(message.role) + content(message.content) + turn_end_ + after_turn_;
}

std::string ChatTemplate::render(const Conversation& conversation, bool generation_prompt) const {
  std::string text;
  for (size_t i = 0; i < conversation.size(); ++i) text += turn(conversation[i], i == 0);
  if (generation_prompt) text += (conversation.empty() ? begin_ : "") + header("assistant");
  return text;
}

ChatTokens ChatTemplate::encode(const Tokenizer& tokenizer, const Conversation& conversation,
                                bool generation_prompt) const {
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

std::string declared_chat_template(const std::string& tokenizer_path) {
  const TokenizerSource source = tokenizer_source(tokenizer_path);
  const fs::path dir = source.format == TokenizerFormat::Gpt2Bpe ? fs::path(source.file) : fs::path(source.file).parent_path();
  const fs::path cfg_path = dir / "tokenizer_config.json";
  if (!fs::is_regular_file(cfg_path)) return "";
  const std::string text = chat_template_text(read_json(cfg_path), cfg_path.string());
  if (text.empty()) return "";
  if (text.find("<|im_start|>") != std::string::npos) return "chatml";
  if (text.find("<|start_header_id|>") != std::string::npos) return "llama3";
  throw TokenizerError(cfg_path.string() + ": its chat_template is not one loom writes (it knows ChatML's "
                       "<|im_start|> turns and Llama 3's <|start_header_id|> turns); name one with data.chat_template "
                       "or --chat-template if the model was trained with it");
}

Conversation conversation_from_json(const nlohmann::json& json) {
  const nlohmann::json* messages = &json;
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
