#include "engine/train/eval_data.hpp"

#include "engine/files/json_lines.hpp"
#include "engine/files/read.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <optional>

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

LastWordTask::LastWordTask(std::vector<LastWordExample> examples, int64_t seq_len, int64_t vocab, std::string what,
                           const std::string& target_name)
    : examples_(std::move(examples)), vocab_(vocab), what_(std::move(what)) {
  if (examples_.empty()) throw DataError(what_ + " holds no examples");
  for (size_t i = 0; i < examples_.size(); ++i)
    if (static_cast<int64_t>(examples_[i].target.size()) > seq_len)
      throw DataError(what_ + ":" + std::to_string(examples_[i].line > 0 ? examples_[i].line : static_cast<int64_t>(i) + 1) +
                      ": " + target_name + " is " + std::to_string(examples_[i].target.size()) +
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

namespace {

// A continuation's tokens, as lm-evaluation-harness splits one: those the encoding of
// the whole text adds to its context's (encoding the continuation alone would add a
// tokenizer's text-start prefix, SentencePiece's dummy "▁", that running text never has
// there). A tokenizer that merges across the boundary changes the context's last
// tokens: the model then reads the whole text's own tokens up to the split.
using Encode = std::function<std::vector<int32_t>(const std::string&)>;

// `text` encoded, a codec that cannot encode it refused at `where`.
std::vector<int32_t> encode_at(const Encode& encode, const std::string& text, const std::string& where,
                               const std::string& what) {
  try {
    return encode(text);
  } catch (const std::exception& e) {
    throw DataError(where + ": " + what + ": " + e.what());
  }
}

LastWordExample split_continuation(std::vector<int32_t> ctx, const std::string& whole_text, int64_t line,
                                   const Encode& encode, const std::string& where, const std::string& what) {
  const std::vector<int32_t> whole = encode_at(encode, whole_text, where, "the context and " + what);
  if (whole.size() <= ctx.size()) throw DataError(where + ": " + what + " adds no tokens to the encoding of its context");
  if (!std::equal(ctx.begin(), ctx.end(), whole.begin()))
    ctx.assign(whole.begin(), whole.begin() + static_cast<std::ptrdiff_t>(ctx.size()));
  LastWordExample e{std::move(ctx), {}, line};
  e.target.assign(whole.begin() + static_cast<std::ptrdiff_t>(e.context.size()), whole.end());
  if (e.context.empty()) throw DataError(where + ": the context encodes to no tokens");
  return e;
}

// Calls fn(object, line number, "path:line") for each non-blank line of a JSONL file;
// a file that cannot be read, or a line that is not JSON, is a DataError naming it.
void for_each_jsonl_object(const std::string& path,
                           const std::function<void(const nlohmann::json&, int64_t, const std::string&)>& fn) {
  std::string why;
  const std::optional<std::string> content = files::read_whole_file(path, &why, files::Pipes::Allow);
  if (!content) throw DataError(path + ": cannot open the file (" + why + ")");
  for (const files::JsonLine& line : files::json_lines(*content)) {
    nlohmann::json j;
    try {
      j = files::parse_json_line(line, path);
    } catch (const files::JsonLineError& e) {
      throw DataError(e.what());
    }
    fn(j, line.number, path + ":" + std::to_string(line.number));
  }
}

}  // namespace

std::vector<ChoiceExample> read_choice_examples(const std::string& path,
                                                const std::function<std::vector<int32_t>(const std::string&)>& encode,
                                                int64_t keep_context) {
  std::vector<ChoiceExample> out;
  for_each_jsonl_object(path, [&](const nlohmann::json& j, int64_t n, const std::string& where) {
    // The label: an integer, or its digits as a string (Hugging Face's hellaswag dataset).
    const bool has_label = j.is_object() && j.contains("label") &&
                           (j["label"].is_number_integer() ||
                            (j["label"].is_string() && !j["label"].get<std::string>().empty() &&
                             j["label"].get<std::string>().size() <= 18 &&
                             j["label"].get<std::string>().find_first_not_of("0123456789") == std::string::npos));
    if (!j.is_object() || !j.contains("ctx") || !j["ctx"].is_string() || !j.contains("endings") ||
        !j["endings"].is_array() || !has_label)
      throw DataError(where + ": expected an object with HellaSwag's fields: \"ctx\" (a string), \"endings\" (an "
                      "array of strings) and \"label\" (an integer, or its digits as a string)");
    const nlohmann::json& endings = j["endings"];
    if (endings.size() < 2) throw DataError(where + ": \"endings\" holds " + std::to_string(endings.size()) +
                                            " ending(s); multiple choice needs two or more");
    const nlohmann::json& label = j["label"];
    const bool index = label.is_string() || label.is_number_unsigned();
    const uint64_t value = label.is_string() ? std::stoull(label.get<std::string>()) : index ? label.get<uint64_t>() : 0;
    if (!index || value >= endings.size())
      throw DataError(where + ": \"label\" = " + label.dump() + " is not the index of one of its " +
                      std::to_string(endings.size()) + " endings");
    const std::string ctx = j["ctx"].get<std::string>();
    const std::vector<int32_t> context_tokens = encode_at(encode, ctx, where, "the context");  // once for every ending
    ChoiceExample ex;
    ex.label = static_cast<int64_t>(value);
    ex.line = n;
    for (size_t k = 0; k < endings.size(); ++k) {
      if (!endings[k].is_string()) throw DataError(where + ": ending " + std::to_string(k) + " is not a string");
      ex.endings.push_back(split_continuation(context_tokens, ctx + " " + endings[k].get<std::string>(), n, encode,
                                              where, "ending " + std::to_string(k) + " (after the context and a space)"));
      // Only the context's last keep_context tokens can be read (a sequence holds them).
      std::vector<int32_t>& context = ex.endings.back().context;
      if (keep_context > 0 && static_cast<int64_t>(context.size()) > keep_context)
        context.erase(context.begin(), context.end() - keep_context);
    }
    out.push_back(std::move(ex));
  });
  return out;
}

ChoiceScores score_choices(const std::vector<ChoiceExample>& examples, const std::vector<double>& loss_sums,
                           const std::vector<int64_t>& tokens) {
  ChoiceScores s;
  size_t at = 0;
  int64_t right = 0, right_norm = 0;
  for (const ChoiceExample& ex : examples) {
    size_t best = 0, best_norm = 0;
    for (size_t k = 0; k < ex.endings.size(); ++k) {
      const double sum = loss_sums.at(at + k), mean = sum / static_cast<double>(std::max<int64_t>(1, tokens.at(at + k)));
      if (sum < loss_sums.at(at + best)) best = k;
      if (mean < loss_sums.at(at + best_norm) / static_cast<double>(std::max<int64_t>(1, tokens.at(at + best_norm))))
        best_norm = k;
    }
    right += static_cast<int64_t>(best) == ex.label;
    right_norm += static_cast<int64_t>(best_norm) == ex.label;
    at += ex.endings.size();
  }
  s.examples = static_cast<int64_t>(examples.size());
  if (s.examples > 0) {
    s.accuracy = static_cast<double>(right) / static_cast<double>(s.examples);
    s.accuracy_norm = static_cast<double>(right_norm) / static_cast<double>(s.examples);
  }
  return s;
}

std::vector<LastWordExample> read_last_word_examples(const std::string& path,
                                                     const std::function<std::vector<int32_t>(const std::string&)>& encode) {
  std::vector<LastWordExample> out;
  for_each_jsonl_object(path, [&](const nlohmann::json& j, int64_t n, const std::string& where) {
    if (!j.is_object() || !j.contains("text") || !j["text"].is_string())
      throw DataError(where + ": expected an object with a string field \"text\"");
    const std::string text = j["text"].get<std::string>();
    const size_t end = text.find_last_not_of(" \t\r\n");
    const size_t begin = end == std::string::npos ? end : text.find_last_of(" \t\r\n", end);
    if (end == std::string::npos || begin == std::string::npos)
      throw DataError(where + ": the text needs a context and a last word");
    const size_t context_end = text.find_last_not_of(" \t\r\n", begin);
    if (context_end == std::string::npos) throw DataError(where + ": the text needs a context and a last word");
    out.push_back(split_continuation(encode_at(encode, text.substr(0, context_end + 1), where, "the context"),
                                     text.substr(0, end + 1), n, encode, where, "the last word"));
  });
  return out;
}

}  // namespace loom::train
