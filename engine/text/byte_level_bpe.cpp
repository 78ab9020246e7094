#include "engine/text/byte_level_bpe.hpp"

#include "engine/text/unicode_classes.hpp"

#include <atomic>
#include <functional>
#include <queue>
#include <climits>

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

}  // namespace

ByteLevelBpe::ByteLevelBpe() {
  static std::atomic<uint64_t> made{0};
  vocabulary_id_ = ++made;
  int next = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
    byte_char_[b] = utf8(printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + next++));
    char_byte_[byte_char_[b]] = static_cast<unsigned char>(b);
  }
}

bool ByteLevelBpe::add_token(const std::string& token, int32_t id) {
  if (id < 0) return false;
  const auto i = static_cast<size_t>(id);
  if (i >= tokens_.size()) tokens_.resize(i + 1), given_.resize(i + 1, false);
  if (given_[i] || !ids_.emplace(token, id).second) return false;
  tokens_[i] = token;
  given_[i] = true;
  return true;
}

void ByteLevelBpe::add_merge(const std::string& left, const std::string& right) {
  ranks_.emplace(left + ' ' + right, static_cast<int32_t>(ranks_.size()));
}

int32_t ByteLevelBpe::first_missing_id() const {
  for (size_t i = 0; i < given_.size(); ++i)
    if (!given_[i]) return static_cast<int32_t>(i);
  return -1;
}

int ByteLevelBpe::first_byte_without_token() const {
  for (int b = 0; b < 256; ++b)
    if (!ids_.count(byte_char_[b])) return b;
  return -1;
}

int32_t ByteLevelBpe::id_of(const std::string& token) const {
  const auto it = ids_.find(token);
  return it == ids_.end() ? -1 : it->second;
}

void ByteLevelBpe::encode_piece(std::string_view piece, std::vector<int32_t>& out, const std::string& source) const {
  // Words repeat (Zipf): each thread keeps the ids of the pieces it has merged, per
  // vocabulary, up to a bound. Keyed by the vocabulary, not the object's address,
  // which a later one may reuse.
  thread_local std::unordered_map<uint64_t, std::unordered_map<std::string, std::vector<int32_t>>> caches;
  std::unordered_map<std::string, std::vector<int32_t>>& cache = caches[vocabulary_id_];
  if (const auto hit = cache.find(std::string(piece)); hit != cache.end()) {
    out.insert(out.end(), hit->second.begin(), hit->second.end());
    return;
  }
  if (cache.size() > 200000) cache.clear();
  const size_t first = out.size();
  merge_piece(piece, out, source);
  cache.emplace(std::string(piece), std::vector<int32_t>(out.begin() + static_cast<std::ptrdiff_t>(first), out.end()));
}

void ByteLevelBpe::merge_piece(std::string_view piece, std::vector<int32_t>& out, const std::string& source) const {
  std::vector<std::string> word;
  for (unsigned char b : piece) word.push_back(byte_char_[b]);
  if (ignore_merges_ && word.size() > 1) {
    std::string whole;
    for (const std::string& s : word) whole += s;
    if (const int32_t id = id_of(whole); id >= 0) {
      out.push_back(id);
      return;
    }
  }
  // The pair of lowest rank first, leftmost among equals (a heap of candidate pairs,
  // each checked when taken: its symbols may have merged since). Merging every
  // occurrence of the best pair left to right, GPT-2's loop, gives the same symbols
  // (a merge cannot make another occurrence of its own pair), in n log n, not n^2.
  const size_t n = word.size();
  std::vector<size_t> next(n), prev(n);
  std::vector<bool> alive(n, true);
  for (size_t i = 0; i < n; ++i) next[i] = i + 1, prev[i] = i - 1;  // prev[0] wraps: never read
  using Candidate = std::pair<int32_t, size_t>;  // (rank, left symbol)
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  const auto rank_of = [&](size_t left) {
    const auto it = ranks_.find(word[left] + ' ' + word[next[left]]);
    return it == ranks_.end() ? INT32_MAX : it->second;
  };
  const auto consider = [&](size_t left) {
    if (left < n && alive[left] && next[left] < n)
      if (const int32_t r = rank_of(left); r != INT32_MAX) heap.emplace(r, left);
  };
  for (size_t i = 0; i + 1 < n; ++i) consider(i);
  while (!heap.empty()) {
    const auto [r, left] = heap.top();
    heap.pop();
    if (!alive[left] || next[left] >= n || rank_of(left) != r) continue;  // stale
    const size_t right = next[left];
    word[left] += word[right];
    alive[right] = false;
    next[left] = next[right];
    if (next[left] < n) prev[next[left]] = left;
    if (left > 0) consider(prev[left]);
    consider(left);
  }
  std::vector<std::string> merged;
  for (size_t i = 0; i < n; i = next[i]) merged.push_back(std::move(word[i]));
  word = std::move(merged);
  for (const std::string& symbol : word) {
    const int32_t id = id_of(symbol);
    if (id < 0) throw TokenizerError(source + ": merge result '" + symbol + "' has no id in the vocabulary");
    out.push_back(id);
  }
}

void ByteLevelBpe::append_bytes(const std::string& token, std::string& out) const {
  for (size_t i = 0; i < token.size();) {
    const CodePoint c = decode_utf8(token, i);
    const auto it = char_byte_.find(token.substr(i, c.bytes));
    if (it != char_byte_.end()) out += static_cast<char>(it->second);
    else out += token.substr(i, c.bytes);  // <|endoftext|> and other literal tokens
    i += c.bytes;
  }
}

}  // namespace loom::text
