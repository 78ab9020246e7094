#include "engine/text/gpt2_tokenizer.hpp"

#include "engine/files/read.hpp"
#include "engine/text/unicode_classes.hpp"

#include <nlohmann/json.hpp>

#include <boost/filesystem.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <sstream>

namespace loom::text {

namespace {

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xc0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    s += static_cast<char>(0xe0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    s += static_cast<char>(0x80 | (cp & 0x3f));
  }
  return s;
}

std::string read_all(const std::string& path) {
  if (boost::filesystem::is_directory(path)) throw TokenizerError(path + ": is a directory, not a file");
  std::string why;
  std::optional<std::string> bytes = files::read_whole_file(path, &why);
  if (!bytes) throw TokenizerError(path + ": cannot read the file (" + why + "; a GPT-2 tokenizer "
                                   "directory holds encoder.json and vocab.bpe; scripts/fetch-gpt2-tokenizer.sh fetches them)");
  return std::move(*bytes);
}

enum class Kind { Letter, Number, Space, Other };

Kind kind_of(uint32_t cp) {
  if (is_letter(cp)) return Kind::Letter;
  if (is_number(cp)) return Kind::Number;
  if (is_space(cp)) return Kind::Space;
  return Kind::Other;
}

// The length of the contraction ('s 't 're 've 'm 'll 'd) at text[i], or 0.
size_t contraction(std::string_view text, size_t i) {
  if (text[i] != '\'') return 0;
  for (std::string_view c : {"s", "t", "re", "ve", "m", "ll", "d"})
    if (text.substr(i + 1, c.size()) == c) return 1 + c.size();
  return 0;
}

// The end of the run of code points of kind `k` that starts at text[i].
size_t run_end(std::string_view text, size_t i, Kind k) {
  while (i < text.size()) {
    const CodePoint c = decode_utf8(text, i);
    if (kind_of(c.cp) != k) break;
    i += c.bytes;
  }
  return i;
}

}  // namespace

std::vector<std::string_view> gpt2_pretokenize(std::string_view text) {
  std::vector<std::string_view> out;
  size_t i = 0;
  while (i < text.size()) {
    size_t end = i;
    if (size_t n = contraction(text, i)) {
      end = i + n;
    } else {
      // " ?\p{L}+", " ?\p{N}+", " ?[^\s\p{L}\p{N}]+": an optional ASCII space, then a run.
      const size_t body = text[i] == ' ' && i + 1 < text.size() ? i + 1 : i;
      const Kind k = kind_of(decode_utf8(text, body).cp);
      if (k != Kind::Space) {
        end = run_end(text, body, k);
      } else {
        // "\s+(?!\S)|\s+": a white-space run; when a non-space follows, its last
        // character is left to lead the next piece (unless the run is that one).
        const size_t run = run_end(text, i, Kind::Space);
        end = run;
        if (run < text.size()) {
          size_t last = i;  // the start of the run's last code point
          for (size_t j = i; j < run; j += decode_utf8(text, j).bytes) last = j;
          if (last > i) end = last;
        }
      }
    }
    out.push_back(text.substr(i, end - i));
    i = end;
  }
  return out;
}

Gpt2Tokenizer Gpt2Tokenizer::load(const std::string& dir) {
  static std::atomic<uint64_t> loaded{0};
  Gpt2Tokenizer t;
  t.vocabulary_id_ = ++loaded;
  t.dir_ = dir;
  // GPT-2's byte -> character map: printable Latin-1 bytes stand for themselves,
  // the others for 256, 257, ... in byte order.
  int next = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
    t.byte_char_[b] = utf8(printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + next++));
    t.char_byte_[t.byte_char_[b]] = static_cast<unsigned char>(b);
  }

  const std::string encoder_path = dir + "/encoder.json";
  nlohmann::json encoder;
  try {
    encoder = nlohmann::json::parse(read_all(encoder_path));
  } catch (const nlohmann::json::exception& e) {
    throw TokenizerError(encoder_path + ": not valid JSON (" + e.what() + ")");
  }
  if (!encoder.is_object() || encoder.empty())
    throw TokenizerError(encoder_path + ": expected an object of token -> id");
  t.tokens_.resize(encoder.size());
  for (const auto& [token, id] : encoder.items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= static_cast<int64_t>(encoder.size()))
      throw TokenizerError(encoder_path + ": token " + nlohmann::json(token).dump() + " has id " + id.dump() +
                           ", not one of 0.." + std::to_string(encoder.size() - 1));
    const auto i = static_cast<size_t>(id.get<int64_t>());
    if (!t.tokens_[i].empty()) throw TokenizerError(encoder_path + ": id " + std::to_string(i) + " is given twice");
    t.tokens_[i] = token;
    t.ids_.emplace(token, static_cast<int32_t>(i));
  }
  const auto eod = t.ids_.find("<|endoftext|>");
  if (eod == t.ids_.end()) throw TokenizerError(encoder_path + ": has no <|endoftext|> token");
  t.eod_ = eod->second;
  for (int b = 0; b < 256; ++b)
    if (!t.ids_.count(t.byte_char_[b]))
      throw TokenizerError(encoder_path + ": has no token for byte " + std::to_string(b) + " (not a byte-level BPE)");

  const std::string merges_path = dir + "/vocab.bpe";
  std::istringstream merges(read_all(merges_path));
  std::string line;
  int32_t rank = 0, line_no = 0;
  while (std::getline(merges, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();  // a file with CRLF line ends
    if (line.empty() || (line_no == 1 && line.rfind("#version", 0) == 0)) continue;
    const size_t space = line.find(' ');
    if (space == std::string::npos || space == 0 || space + 1 == line.size() ||
        line.find(' ', space + 1) != std::string::npos)
      throw TokenizerError(merges_path + ":" + std::to_string(line_no) + ": expected two symbols separated by a space");
    t.ranks_.emplace(line, rank++);
  }
  if (t.ranks_.empty()) throw TokenizerError(merges_path + ": holds no merges (a GPT-2 vocab.bpe has 50000)");
  return t;
}

void Gpt2Tokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  // Words repeat (Zipf): each thread keeps the ids of the pieces it has merged, per
  // tokenizer, up to a bound.
  // Keyed by the loaded vocabulary, not the object's address, which a later one may reuse.
  thread_local std::unordered_map<uint64_t, std::unordered_map<std::string, std::vector<int32_t>>> caches;
  std::unordered_map<std::string, std::vector<int32_t>>& cache = caches[vocabulary_id_];
  if (const auto hit = cache.find(std::string(piece)); hit != cache.end()) {
    out.insert(out.end(), hit->second.begin(), hit->second.end());
    return;
  }
  if (cache.size() > 200000) cache.clear();
  const size_t first = out.size();
  merge_piece(piece, out);
  cache.emplace(std::string(piece), std::vector<int32_t>(out.begin() + static_cast<std::ptrdiff_t>(first), out.end()));
}

void Gpt2Tokenizer::merge_piece(std::string_view piece, std::vector<int32_t>& out) const {
  std::vector<std::string> word;
  for (unsigned char b : piece) word.push_back(byte_char_[b]);
  while (word.size() > 1) {
    // The adjacent pair of lowest rank; then every occurrence of it, left to right.
    int32_t best = INT32_MAX;
    size_t at = 0;
    for (size_t i = 0; i + 1 < word.size(); ++i) {
      const auto it = ranks_.find(word[i] + ' ' + word[i + 1]);
      if (it != ranks_.end() && it->second < best) best = it->second, at = i;
    }
    if (best == INT32_MAX) break;
    const std::string left = word[at], right = word[at + 1];
    std::vector<std::string> merged;
    for (size_t i = 0; i < word.size(); ++i) {
      if (i + 1 < word.size() && word[i] == left && word[i + 1] == right) {
        merged.push_back(left + right);
        ++i;
      } else {
        merged.push_back(word[i]);
      }
    }
    word = std::move(merged);
  }
  for (const std::string& symbol : word) {
    const auto it = ids_.find(symbol);
    if (it == ids_.end()) throw TokenizerError("GPT-2 tokenizer: merge result '" + symbol + "' has no id in encoder.json");
    out.push_back(it->second);
  }
}

std::vector<int32_t> Gpt2Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  for (std::string_view piece : gpt2_pretokenize(text)) encode_piece(piece, out);
  return out;
}

std::string Gpt2Tokenizer::piece(int32_t id) const {
  if (id < 0 || id >= vocab_size())
    throw TokenizerError(dir_ + ": id " + std::to_string(id) + " is outside the vocabulary of " +
                         std::to_string(vocab_size()));
  return tokens_[static_cast<size_t>(id)];
}

std::string Gpt2Tokenizer::describe() const {
  return "GPT-2 byte-level BPE (" + std::to_string(vocab_size()) + " tokens) from " + dir_;
}

std::string Gpt2Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size())
      throw TokenizerError("GPT-2 tokenizer: id " + std::to_string(id) + " is outside the vocabulary of " +
                           std::to_string(vocab_size()));
    const std::string& token = tokens_[static_cast<size_t>(id)];
    for (size_t i = 0; i < token.size();) {
      const CodePoint c = decode_utf8(token, i);
      const auto it = char_byte_.find(token.substr(i, c.bytes));
      if (it != char_byte_.end()) out += static_cast<char>(it->second);
      else out += token.substr(i, c.bytes);  // <|endoftext|> and other literal tokens
      i += c.bytes;
    }
  }
  return out;
}

}  // namespace loom::text
