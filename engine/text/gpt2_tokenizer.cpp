#include "engine/text/gpt2_tokenizer.hpp"

#include "engine/files/read.hpp"
#include "engine/text/unicode_classes.hpp"

#include <nlohmann/json.hpp>

#include <boost/filesystem.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <sstream>

namespace loom::text {

namespace {

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
  Gpt2Tokenizer t;
  t.dir_ = dir;
  const std::string encoder_path = dir + "/encoder.json";
  nlohmann::json encoder;
  try {
    encoder = nlohmann::json::parse(read_all(encoder_path));
  } catch (const nlohmann::json::exception& e) {
    throw TokenizerError(encoder_path + ": not valid JSON (" + e.what() + ")");
  }
  if (!encoder.is_object() || encoder.empty())
    throw TokenizerError(encoder_path + ": expected an object of token -> id");
  for (const auto& [token, id] : encoder.items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= static_cast<int64_t>(encoder.size()))
      throw TokenizerError(encoder_path + ": token " + nlohmann::json(token).dump() + " has id " + id.dump() +
                           ", not one of 0.." + std::to_string(encoder.size() - 1));
    if (!t.bpe_.add_token(token, static_cast<int32_t>(id.get<int64_t>())))
      throw TokenizerError(encoder_path + ": id " + id.dump() + " is given twice");
  }
  t.eod_ = t.bpe_.id_of("<|endoftext|>");
  if (t.eod_ < 0) throw TokenizerError(encoder_path + ": has no <|endoftext|> token");
  if (const int b = t.bpe_.first_byte_without_token(); b >= 0)
    throw TokenizerError(encoder_path + ": has no token for byte " + std::to_string(b) + " (not a byte-level BPE)");

  const std::string merges_path = dir + "/vocab.bpe";
  std::istringstream merges(read_all(merges_path));
  std::string line;
  int32_t line_no = 0;
  while (std::getline(merges, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();  // a file with CRLF line ends
    if (line.empty() || (line_no == 1 && line.rfind("#version", 0) == 0)) continue;
    const size_t space = line.find(' ');
    if (space == std::string::npos || space == 0 || space + 1 == line.size() ||
        line.find(' ', space + 1) != std::string::npos)
      throw TokenizerError(merges_path + ":" + std::to_string(line_no) + ": expected two symbols separated by a space");
    if (!t.bpe_.add_merge(line.substr(0, space), line.substr(space + 1)))
      throw TokenizerError(merges_path + ":" + std::to_string(line_no) + ": the merge '" + line +
                           "' needs a token encoder.json lacks (both symbols and what they make)");
  }
  if (t.bpe_.merges() == 0) throw TokenizerError(merges_path + ": holds no merges (a GPT-2 vocab.bpe has 50000)");
  return t;
}

std::vector<int32_t> Gpt2Tokenizer::encode(std::string_view text) const {
  std::vector<int32_t> out;
  for (std::string_view piece : gpt2_pretokenize(text)) bpe_.encode_piece(piece, out, dir_);
  return out;
}

std::string Gpt2Tokenizer::piece(int32_t id) const { return bpe_.token(id, dir_); }

std::string Gpt2Tokenizer::describe() const {
  return "GPT-2 byte-level BPE (" + std::to_string(vocab_size()) + " tokens) from " + dir_;
}

std::string Gpt2Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) bpe_.append_bytes(bpe_.token(id, dir_), out);
  return out;
}

}  // namespace loom::text
