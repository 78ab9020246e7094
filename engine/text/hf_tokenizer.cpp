#include "engine/text/hf_tokenizer.hpp"

#include "engine/files/read.hpp"
#include "engine/text/gpt2_tokenizer.hpp"
#include "engine/text/unicode_classes.hpp"

#include <nlohmann/json.hpp>
#include <unicode/normalizer2.h>
#include <unicode/stringpiece.h>
#include <unicode/unistr.h>

#include <boost/filesystem.hpp>

#include <algorithm>
#include <cctype>

namespace loom::text {

namespace {

bool newline(uint32_t cp) { return cp == '\r' || cp == '\n'; }
bool other(uint32_t cp) { return !is_space(cp) && !is_letter(cp) && !is_number(cp); }

uint32_t cp_at(std::string_view text, size_t i) { return i < text.size() ? decode_utf8(text, i).cp : 0x110000u; }

// The end of the run of code points from text[i] that `in` accepts (at most `most`).
template <class In>
size_t run_end(std::string_view text, size_t i, In in, size_t most = SIZE_MAX) {
  for (size_t n = 0; i < text.size() && n < most; ++n) {
    const CodePoint c = decode_utf8(text, i);
    if (!in(c.cp)) break;
    i += c.bytes;
  }
  return i;
}

// (?i:'s|'t|'re|'ve|'m|'ll|'d) at text[i]: its length, or 0. Case-insensitive as
// Unicode folds case: 's' is also U+017F (long s).
size_t contraction(std::string_view text, size_t i) {
  if (text[i] != '\'') return 0;
  if (text.substr(i + 1, 2) == "\xc5\xbf") return 3;
  for (std::string_view c : {"s", "t", "re", "ve", "m", "ll", "d"}) {
    if (i + 1 + c.size() > text.size()) continue;
    bool same = true;
    for (size_t k = 0; k < c.size(); ++k)
      same = same && std::tolower(static_cast<unsigned char>(text[i + 1 + k])) == c[k];
    if (same) return 1 + c.size();
  }
  return 0;
}

// The end of the piece the pattern's alternatives, tried in order, match at text[i].
size_t piece_end(std::string_view text, size_t i, int max_digits) {
  if (const size_t n = contraction(text, i)) return i + n;
  const CodePoint c = decode_utf8(text, i);
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (is_letter(c.cp)) return run_end(text, i, is_letter);
  if (!newline(c.cp) && !is_number(c.cp) && is_letter(cp_at(text, i + c.bytes)))
    return run_end(text, i + c.bytes, is_letter);
  // \p{N}{1,max_digits}
  if (is_number(c.cp)) return run_end(text, i, is_number, static_cast<size_t>(max_digits));
  // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
  const size_t body = text[i] == ' ' ? i + 1 : i;
  if (body < text.size() && other(cp_at(text, body))) return run_end(text, run_end(text, body, other), newline);
  // Here text[i] is white space. \s*[\r\n]+: up to the run's last newline.
  const size_t run = run_end(text, i, is_space);
  size_t after_newline = 0, last = i;  // last: where the run's last code point starts
  for (size_t j = i; j < run;) {
    const CodePoint s = decode_utf8(text, j);
    last = j;
    j += s.bytes;
    if (newline(s.cp)) after_newline = j;
  }
  if (after_newline > 0) return after_newline;
  // \s+(?!\S): the run, less its last code point when a non-space follows; else \s+.
  if (run < text.size() && last > i) return last;
  return run;
}

const char* kLlama3Pattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
    "\\s+(?!\\S)|\\s+";
const char* kQwen2Pattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
    "\\s+(?!\\S)|\\s+";

std::string read_json_text(const std::string& path) {
  std::string why;
  std::optional<std::string> bytes = files::read_whole_file(path, &why);
  if (!bytes) throw TokenizerError(path + ": cannot read the file (" + why + ")");
  return std::move(*bytes);
}

nlohmann::json parse(const std::string& path) {
  try {
    return nlohmann::json::parse(read_json_text(path));
  } catch (const nlohmann::json::exception& e) {
    throw TokenizerError(path + ": not valid JSON (" + e.what() + ")");
  }
}

// A string member, or "" (absent or null); anything else is refused.
std::string string_member(const nlohmann::json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || j[key].is_null()) return "";
  if (!j[key].is_string()) throw TokenizerError(where + ": " + key + " = " + j[key].dump() + " is not a string");
  return j[key].get<std::string>();
}

// A true/false member, `fallback` when absent or null; anything else is refused.
bool bool_member(const nlohmann::json& j, const char* key, bool fallback, const std::string& where) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_boolean()) throw TokenizerError(where + ": " + key + " = " + j[key].dump() + " is not true or false");
  return j[key].get<bool>();
}

// tokenizer_config.json's bos_token / eos_token / unk_token: a string, or an object
// with the string as its content; "" when absent or null.
std::string special_token(const nlohmann::json& cfg, const char* key, const std::string& where) {
  if (!cfg.contains(key) || cfg[key].is_null()) return "";
  const nlohmann::json& v = cfg[key];
  if (v.is_string() && !v.get<std::string>().empty()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string() && !v["content"].get<std::string>().empty())
    return v["content"].get<std::string>();
  throw TokenizerError(where + ": " + key + " = " + v.dump() + " is not a token (a string, or {\"content\": ...})");
}

// NFC of one stretch of valid UTF-8.
std::string nfc_valid(std::string_view text) {
  UErrorCode err = U_ZERO_ERROR;
  const icu::Normalizer2* n = icu::Normalizer2::getNFCInstance(err);
  if (U_FAILURE(err)) throw TokenizerError(std::string("ICU has no NFC normaliser: ") + u_errorName(err));
  const icu::UnicodeString normal =
      n->normalize(icu::UnicodeString::fromUTF8(icu::StringPiece(text.data(), static_cast<int32_t>(text.size()))), err);
  if (U_FAILURE(err)) throw TokenizerError(std::string("NFC normalisation failed: ") + u_errorName(err));
  std::string out;
  normal.toUTF8String(out);
  return out;
}

// NFC of text: each stretch of valid UTF-8 normalised, bytes that are not UTF-8 kept as
// they are (they stay bytes of their own, as the byte-level model encodes them).
std::string nfc(std::string_view text) {
  std::string out;
  size_t start = 0;  // of the current valid stretch
  bool ascii = true;
  const auto flush = [&](size_t end) {
    const std::string_view stretch = text.substr(start, end - start);
    out += ascii ? std::string(stretch) : nfc_valid(stretch);
  };
  for (size_t i = 0; i < text.size();) {
    const CodePoint c = decode_utf8(text, i);
    if (c.cp >= 0x110000) {  // not UTF-8: the stretch ends before it
      flush(i);
      out += text[i];
      start = i + 1;
      ascii = true;
    } else {
      ascii = ascii && c.cp < 0x80;
    }
    i += c.bytes;
  }
  flush(text.size());
  return out;
}

}  // namespace

std::vector<std::string_view> split_pretokenize(std::string_view text, int max_digits) {
  std::vector<std::string_view> out;
  for (size_t i = 0; i < text.size();) {
    const size_t end = piece_end(text, i, max_digits);
    out.push_back(text.substr(i, end - i));
    i = end;
  }
  return out;
}

HfTokenizer HfTokenizer::load(const std::string& path) {
  namespace fs = boost::filesystem;
  const std::string file = fs::is_directory(path) ? (fs::path(path) / "tokenizer.json").string() : path;
  HfTokenizer t;
  t.path_ = file;
  const nlohmann::json j = parse(file);
  if (!j.is_object() || !j.contains("model") || !j["model"].is_object())
    throw TokenizerError(file + ": no \"model\" object (not a Hugging Face tokenizer.json)");
  const nlohmann::json& m = j["model"];
  const std::string type = string_member(m, "type", file);
  const auto refuse = [&](const std::string& what) { throw TokenizerError(file + ": " + what); };
  if (type != "BPE")
    refuse("a " + (type.empty() ? std::string("model without a type") : type + " model") +
           "; loom reads byte-level BPE tokenizer.json files (GPT-2's, Llama 3's, Qwen's), GPT-2's encoder.json + "
           "vocab.bpe and SentencePiece .model files");
  if (bool_member(m, "byte_fallback", false, file))
    refuse("a byte-fallback BPE (SentencePiece's, as Llama 2 and Mistral ship it): give the tokenizer.model beside it");
  if (m.contains("dropout") && !m["dropout"].is_null() && !(m["dropout"].is_number() && m["dropout"] == 0.0))
    refuse("model.dropout = " + m["dropout"].dump() + ": loom encodes without BPE dropout (null or 0)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (!string_member(m, key, file).empty()) refuse(std::string(key) + " has no byte-level counterpart");
  t.bpe_.set_ignore_merges(bool_member(m, "ignore_merges", false, file));

  // The vocabulary and the merges ("a b", or ["a", "b"] in newer files).
  if (!m.contains("vocab") || !m["vocab"].is_object() || m["vocab"].empty()) refuse("model.vocab is not a token -> id object");
  // Ids run 0..entries-1 (the vocabulary and the added tokens): any other is refused
  // before anything is sized by it.
  const int64_t entries = static_cast<int64_t>(m["vocab"].size()) +
                          (j.contains("added_tokens") && j["added_tokens"].is_array()
                               ? static_cast<int64_t>(j["added_tokens"].size()) : 0);
  const auto valid_id = [&](const nlohmann::json& id) {  // (2^63 and above read as negative)
    return id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < entries;
  };
  for (const auto& [token, id] : m["vocab"].items())
    if (!valid_id(id) || !t.bpe_.add_token(token, static_cast<int32_t>(id.get<int64_t>())))
      refuse("model.vocab: token " + nlohmann::json(token).dump() + " has id " + id.dump() +
             (valid_id(id) ? ", which another token has" : ", not one of 0.." + std::to_string(entries - 1)));
  if (!m.contains("merges") || !m["merges"].is_array()) refuse("model.merges is not a list");
  for (const nlohmann::json& merge : m["merges"]) {
    std::string left, right;
    if (merge.is_string()) {
      const std::string s = merge.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || space == 0 || space + 1 == s.size() || s.find(' ', space + 1) != std::string::npos)
        refuse("model.merges: " + merge.dump() + " is not two symbols separated by a space");
      left = s.substr(0, space), right = s.substr(space + 1);
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
      left = merge[0].get<std::string>(), right = merge[1].get<std::string>();
    } else {
      refuse("model.merges: " + merge.dump() + " is not a pair of symbols");
    }
    // Both symbols and what they make are tokens (transformers refuses such a file too).
    for (const std::string& symbol : {left, right, left + right})
      if (t.bpe_.id_of(symbol) < 0) refuse("model.merges: " + merge.dump() + " needs " + nlohmann::json(symbol).dump() +
                                           ", which is not in model.vocab");
    t.bpe_.add_merge(left, right);  // (the three are tokens: checked above)
  }

  // Added tokens: matched in the text before anything else, decoded as written.
  if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
    if (!j["added_tokens"].is_array()) refuse("added_tokens is not a list");
    for (const nlohmann::json& a : j["added_tokens"]) {
      if (!a.is_object() || !a.contains("id") || !valid_id(a["id"]) || !a.contains("content") ||
          !a["content"].is_string() || a["content"].get<std::string>().empty())
        refuse("added_tokens: " + a.dump() + " has no id of 0.." + std::to_string(entries - 1) + " and content");
      const std::string content = a["content"];
      const auto id = static_cast<int32_t>(a["id"].get<int64_t>());
      for (const char* key : {"single_word", "lstrip", "rstrip"})
        if (bool_member(a, key, false, file))
          refuse("added token " + nlohmann::json(content).dump() + " has " + key + " = true, which loom does not apply");
      if (const int32_t had = t.bpe_.id_of(content); had >= 0 && had != id)
        refuse("added token " + nlohmann::json(content).dump() + " has id " + std::to_string(id) +
               ", and the vocabulary gives it id " + std::to_string(had));
      if (t.bpe_.id_of(content) != id && !t.bpe_.add_token(content, id))
        refuse("added token " + nlohmann::json(content).dump() + " has id " + std::to_string(id) + ", which is " +
               nlohmann::json(t.bpe_.token(id, file)).dump() + "'s");
      if (t.added_.size() <= static_cast<size_t>(id)) t.added_.resize(static_cast<size_t>(id) + 1, false);
      t.added_[static_cast<size_t>(id)] = true;
      t.added_by_first_[static_cast<unsigned char>(content[0])].emplace_back(content, id);
    }
    for (auto& [first, list] : t.added_by_first_)
      std::stable_sort(list.begin(), list.end(), [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  }
  if (const int32_t missing = t.bpe_.first_missing_id(); missing >= 0)
    refuse("no token has id " + std::to_string(missing) + " (ids must run 0.." + std::to_string(t.bpe_.size() - 1) + ")");
  if (const int b = t.bpe_.first_byte_without_token(); b >= 0)
    refuse("no token for byte " + std::to_string(b) + " (not a byte-level BPE)");

  // The normaliser: none or NFC.
  if (j.contains("normalizer") && !j["normalizer"].is_null()) {
    const std::string n = string_member(j["normalizer"], "type", file);
    if (n != "NFC") refuse("normalizer " + j["normalizer"].dump() + ": loom applies none or NFC only");
    t.nfc_ = true;
  }
  // The pre-tokenizer: ByteLevel with GPT-2's pattern, or a known Split then ByteLevel.
  const nlohmann::json pre = j.value("pre_tokenizer", nlohmann::json());
  const auto byte_level = [&](const nlohmann::json& p, bool split_before) {
    if (!p.is_object() || string_member(p, "type", file) != "ByteLevel")
      refuse("pre_tokenizer " + pre.dump() + ": loom reads ByteLevel, or a Split by Llama 3's or Qwen2's pattern "
             "before ByteLevel");
    t.prefix_space_ = bool_member(p, "add_prefix_space", false, file);
    const bool regex = bool_member(p, "use_regex", true, file);
    if (split_before && regex) refuse("pre_tokenizer: a Split before ByteLevel with use_regex splits twice");
    // (ByteLevel would prefix every piece of the Split; no shipped tokenizer does.)
    if (split_before && t.prefix_space_) refuse("pre_tokenizer: ByteLevel's add_prefix_space after a Split");
    if (!split_before) t.split_ = regex ? Split::Gpt2 : Split::None;
  };
  if (pre.is_object() && string_member(pre, "type", file) == "Sequence") {
    const nlohmann::json& list = pre.value("pretokenizers", nlohmann::json());
    if (!list.is_array() || list.size() != 2 || !list[0].is_object() || string_member(list[0], "type", file) != "Split")
      refuse("pre_tokenizer " + pre.dump() + ": loom reads a Sequence of one Split and ByteLevel");
    const nlohmann::json& s = list[0];
    const std::string pattern =
        s.contains("pattern") && s["pattern"].is_object() ? string_member(s["pattern"], "Regex", file) : "";
    if (pattern == kLlama3Pattern) t.split_ = Split::Llama3;
    else if (pattern == kQwen2Pattern) t.split_ = Split::Qwen2;
    else refuse("pre_tokenizer Split pattern " + s.value("pattern", nlohmann::json()).dump() +
                ": loom knows Llama 3's and Qwen2's (hf_tokenizer.hpp)");
    if (string_member(s, "behavior", file) != "Isolated" || bool_member(s, "invert", false, file))
      refuse("pre_tokenizer Split " + s.dump() + ": loom reads behavior Isolated, invert false");
    byte_level(list[1], true);
  } else {
    byte_level(pre, false);
  }
  if (j.contains("decoder") && !j["decoder"].is_null() && string_member(j["decoder"], "type", file) != "ByteLevel")
    refuse("decoder " + j["decoder"].dump() + ": loom decodes byte-level tokens (ByteLevel)");

  // bos, eos and unk: tokenizer_config.json beside it.
  const fs::path cfg_path = fs::path(file).parent_path() / "tokenizer_config.json";
  if (fs::is_regular_file(cfg_path)) {
    const nlohmann::json cfg = parse(cfg_path.string());
    if (!cfg.is_object()) throw TokenizerError(cfg_path.string() + ": not a JSON object");
    for (const auto& [key, id] : {std::pair<const char*, int32_t*>{"bos_token", &t.bos_}, {"eos_token", &t.eos_},
                                  {"unk_token", &t.unk_}}) {
      const std::string token = special_token(cfg, key, cfg_path.string());
      if (token.empty()) continue;
      *id = t.bpe_.id_of(token);
      if (*id < 0) throw TokenizerError(cfg_path.string() + ": " + key + " " + nlohmann::json(token).dump() +
                                        " is not a token of " + file);
    }
  }
  return t;
}

int32_t HfTokenizer::added_at(std::string_view text, size_t i, size_t& length) const {
  const auto it = added_by_first_.find(static_cast<unsigned char>(text[i]));
  if (it == added_by_first_.end()) return -1;
  for (const auto& [content, id] : it->second)
    if (text.substr(i, content.size()) == content) {
      length = content.size();
      return id;
    }
  return -1;
}

void HfTokenizer::encode_text(std::string_view text, std::vector<int32_t>& out) const {
  if (text.empty()) return;
  std::string normal = nfc_ ? nfc(text) : std::string();
  std::string_view t = nfc_ ? std::string_view(normal) : text;
  if (prefix_space_ && t.front() != ' ') {
    normal = " " + std::string(t);
    t = normal;
  }
  std::vector<std::string_view> pieces;
  switch (split_) {
    case Split::Gpt2: pieces = gpt2_pretokenize(t); break;
    case Split::Llama3: pieces = split_pretokenize(t, 3); break;
    case Split::Qwen2: pieces = split_pretokenize(t, 1); break;
    case Split::None: pieces = {t}; break;
  }
  for (std::string_view p : pieces) bpe_.encode_piece(p, out, path_);
}

std::vector<int32_t> HfTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  size_t start = 0;  // of the text since the last added token
  for (size_t i = 0; i < text.size();) {
    size_t length = 0;
    const int32_t id = added_at(text, i, length);
    if (id < 0) {
      ++i;
      continue;
    }
    encode_text(text.substr(start, i - start), out);
    out.push_back(id);
    i += length;
    start = i;
  }
  encode_text(text.substr(start), out);
  return out;
}

std::string HfTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) {
    const std::string& token = bpe_.token(id, path_);
    if (static_cast<size_t>(id) < added_.size() && added_[static_cast<size_t>(id)]) out += token;
    else bpe_.append_bytes(token, out);
  }
  return out;
}

std::string HfTokenizer::piece(int32_t id) const { return bpe_.token(id, path_); }

std::string HfTokenizer::describe() const {
  const char* split = split_ == Split::Llama3 ? "Llama 3's split, " : split_ == Split::Qwen2 ? "Qwen2's split, " : "";
  return std::string("Hugging Face byte-level BPE (") + split + std::to_string(vocab_size()) + " tokens) from " + path_;
}

}  // namespace loom::text
