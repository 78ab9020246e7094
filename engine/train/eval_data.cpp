#include "engine/train/eval_data.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

namespace loom::train {

namespace {

void require_validation(Split split, const std::string& what) {
  if (split != Split::Validation) throw DataError(what + " is an evaluation set: it has no training split");
}

}  // namespace

SlidingWindows::SlidingWindows(std::vector<int32_t> tokens, int64_t seq_len, int64_t stride, int64_t vocab,
                               std::string what)
    : tokens_(std::move(tokens)), seq_len_(seq_len), stride_(stride), vocab_(vocab), what_(std::move(what)) {
  if (tokens_.size() < 2) throw DataError(what_ + " holds " + std::to_string(tokens_.size()) + " token(s): nothing to predict");
  if (stride_ < 1 || stride_ > seq_len_)
    throw DataError("the window stride " + std::to_string(stride_) + " must be in [1, seq_length = " +
                    std::to_string(seq_len_) + "]");
  // Window 0 counts seq_len targets, each later one `stride` more.
  const int64_t rest = std::max<int64_t>(0, targets() - seq_len_);
  windows_ = 1 + (rest + stride_ - 1) / stride_;
}

std::string SlidingWindows::describe() const {
  return what_ + ": " + std::to_string(tokens_.size()) + " tokens in " + std::to_string(windows_) + " windows of " +
         std::to_string(seq_len_) + " (stride " + std::to_string(stride_) + ")";
}

void SlidingWindows::sample(Split split, uint64_t index, int64_t seq, int32_t* tokens, int32_t* targets) const {
  require_validation(split, what_);
  if (seq != seq_len_) throw DataError(what_ + ": windows of " + std::to_string(seq_len_) + ", asked for " + std::to_string(seq));
  const int64_t n = static_cast<int64_t>(tokens_.size());
  const int64_t start = static_cast<int64_t>(index) * stride_;
  // Window i > 0 counts its last `stride` targets: those windows 0 .. i-1 did not.
  const int64_t first_counted = index == 0 ? 0 : seq - stride_;
  for (int64_t t = 0; t < seq; ++t) {
    const int64_t at = start + t;
    const bool inside = static_cast<int64_t>(index) < windows_ && at + 1 < n;
    tokens[t] = at < n && static_cast<int64_t>(index) < windows_ ? tokens_[static_cast<size_t>(at)] : 0;
    targets[t] = inside && t >= first_counted ? tokens_[static_cast<size_t>(at + 1)] : -1;
  }
}

LastWordTask::LastWordTask(std::vector<LastWordExample> examples, int64_t seq_len, int64_t vocab, std::string what)
    : examples_(std::move(examples)), vocab_(vocab), what_(std::move(what)) {
  if (examples_.empty()) throw DataError(what_ + " holds no examples");
  for (size_t i = 0; i < examples_.size(); ++i)
    if (static_cast<int64_t>(examples_[i].target.size()) >= seq_len)
      throw DataError(what_ + ":" + std::to_string(examples_[i].line > 0 ? examples_[i].line : static_cast<int64_t>(i) + 1) +
                      ": the last word is " + std::to_string(examples_[i].target.size()) +
                      " tokens, leaving no context in a sequence of seq_length = " + std::to_string(seq_len));
}

void LastWordTask::sample(Split split, uint64_t index, int64_t seq, int32_t* tokens, int32_t* targets) const {
  require_validation(split, what_);
  std::fill(tokens, tokens + seq, 0);
  std::fill(targets, targets + seq, -1);
  if (index >= examples_.size()) return;  // padding
  const LastWordExample& e = examples_[index];
  // context + target, the context cut from the left to fit seq + 1 tokens.
  const int64_t tgt = static_cast<int64_t>(e.target.size());
  const int64_t ctx = std::min<int64_t>(static_cast<int64_t>(e.context.size()), seq + 1 - tgt);
  if (ctx < 1) throw DataError(what_ + ": example " + std::to_string(index) + "'s last word leaves no context");
  std::vector<int32_t> all(e.context.end() - ctx, e.context.end());
  all.insert(all.end(), e.target.begin(), e.target.end());
  for (int64_t t = 0; t + 1 < static_cast<int64_t>(all.size()); ++t) tokens[t] = all[static_cast<size_t>(t)];
  if (static_cast<int64_t>(all.size()) <= seq) tokens[all.size() - 1] = all.back();
  for (int64_t k = 0; k < tgt; ++k) targets[ctx - 1 + k] = e.target[static_cast<size_t>(k)];
}

std::vector<LastWordExample> read_last_word_examples(const std::string& path,
                                                     const std::function<std::vector<int32_t>(const std::string&)>& encode) {
  std::ifstream in(path);
  if (!in) throw DataError(path + ": cannot open the file (" + std::strerror(errno) + ")");
  std::vector<LastWordExample> out;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(n);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw DataError(where + ": not JSON (" + std::string(e.what()) + ")");
    }
    if (!j.is_object() || !j.contains("text") || !j["text"].is_string())
      throw DataError(where + ": expected an object with a string field \"text\"");
    const std::string text = j["text"].get<std::string>();
    const size_t end = text.find_last_not_of(" \t\r\n");
    const size_t begin = end == std::string::npos ? end : text.find_last_of(" \t\r\n", end);
    if (end == std::string::npos || begin == std::string::npos)
      throw DataError(where + ": the text needs a context and a last word");
    const size_t context_end = text.find_last_not_of(" \t\r\n", begin);
    if (context_end == std::string::npos) throw DataError(where + ": the text needs a context and a last word");
    // The word's tokens are those that follow the context's in the encoding of the whole
    // text (as lm-evaluation-harness splits a continuation): encoding " word" alone
    // would add a tokenizer's text-start prefix (SentencePiece's dummy "▁") that running
    // text never has there.
    std::vector<int32_t> context = encode(text.substr(0, context_end + 1)), whole = encode(text.substr(0, end + 1));
    if (whole.size() <= context.size())
      throw DataError(where + ": the last word adds no tokens to the encoding of its context");
    // A tokenizer that merges across the boundary changes the context's last tokens:
    // the model then reads the whole text's own tokens up to the split.
    if (!std::equal(context.begin(), context.end(), whole.begin()))
      context.assign(whole.begin(), whole.begin() + static_cast<std::ptrdiff_t>(context.size()));
    LastWordExample e{std::move(context), {}, n};
    e.target.assign(whole.begin() + static_cast<std::ptrdiff_t>(e.context.size()), whole.end());
    if (e.context.empty() || e.target.empty()) throw DataError(where + ": the context or the last word encodes to no tokens");
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace loom::train
