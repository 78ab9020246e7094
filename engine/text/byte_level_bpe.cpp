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
  if (const auto b = char_byte_.find(token); b != char_byte_.end()) byte_id_[b->second] = id;
  return true;
}

bool ByteLevelBpe::add_merge(const std::string& left, const std::string& right) {
  const int32_t l = id_of(left), r = id_of(right), made = id_of(left + right);
  if (l < 0 || r < 0 || made < 0) return false;
  const uint64_t key = static_cast<uint64_t>(static_cast<uint32_t>(l)) << 32 | static_cast<uint32_t>(r);
  merges_.insert_or_assign(key, Merge{next_rank_++, made});  // a pair listed twice takes its last rank, as
                                                             // GPT-2's encoder.py and transformers read it
  return true;
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

const std::string& ByteLevelBpe::token(int32_t id, const std::string& source) const {
  if (id < 0 || id >= size())
    throw TokenizerError(source + ": id " + std::to_string(id) + " is outside the vocabulary of " + std::to_string(size()));
  return tokens_[static_cast<size_t>(id)];
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
  if (ignore_merges_ && piece.size() > 1) {
    std::string whole;
    for (unsigned char b : piece) whole += byte_char_[b];
    if (const int32_t id = id_of(whole); id >= 0) {
      out.push_back(id);
      return;
    }
  }
  // The pair of lowest rank first, leftmost among equals (a heap of candidate pairs,
  // each checked when taken: its symbols may have merged since). Merging every
  // occurrence of the best pair left to right, GPT-2's loop, gives the same symbols
  // (a merge cannot make another occurrence of its own pair), in n log n, not n^2.
  const size_t n = piece.size();
  std::vector<int32_t> word(n);
  for (size_t i = 0; i < n; ++i) {
    word[i] = byte_id_[static_cast<unsigned char>(piece[i])];
    if (word[i] < 0)  // loaders refuse such a vocabulary first
      throw TokenizerError(source + ": no token for byte " + std::to_string(static_cast<unsigned char>(piece[i])));
  }
  std::vector<size_t> next(n), prev(n);
  std::vector<bool> alive(n, true);
  for (size_t i = 0; i < n; ++i) next[i] = i + 1, prev[i] = i - 1;  // prev[0] wraps: never read
  const auto merge_of = [&](size_t left) -> const Merge* {
    const uint64_t key = static_cast<uint64_t>(static_cast<uint32_t>(word[left])) << 32 |
                         static_cast<uint32_t>(word[next[left]]);
    const auto it = merges_.find(key);
    return it == merges_.end() ? nullptr : &it->second;
  };
  using Candidate = std::pair<int32_t, size_t>;  // (rank, left symbol)
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  const auto consider = [&](size_t left) {
    if (left < n && alive[left] && next[left] < n)
      if (const Merge* m = merge_of(left)) heap.emplace(m->rank, left);
  };
  for (size_t i = 0; i + 1 < n; ++i) consider(i);
  while (!heap.empty()) {
    const auto [rank, left] = heap.top();
    heap.pop();
    if (!alive[left] || next[left] >= n) continue;
    const Merge* m = merge_of(left);
    if (m == nullptr || m->rank != rank) continue;  // stale: a symbol merged since
    const size_t right = next[left];
    word[left] = m->id;
    alive[right] = false;
    next[left] = next[right];
    if (next[left] < n) prev[next[left]] = left;
    if (left > 0) consider(prev[left]);
    consider(left);
  }
  for (size_t i = 0; i < n; i = next[i]) out.push_back(word[i]);
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
