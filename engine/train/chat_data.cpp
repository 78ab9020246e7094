#include "engine/train/chat_data.hpp"

#include "engine/files/json_lines.hpp"
#include "engine/files/read.hpp"
#include "engine/train/shuffle.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>

namespace loom::train {
namespace {

// Megatron-LM's _split_conversations: a system message starts a conversation.
std::vector<text::Conversation> conversations_of(const text::Conversation& messages) {
  std::vector<text::Conversation> out;
  for (const text::ChatMessage& m : messages) {
    if (out.empty() || (m.role == "system" && !out.back().empty())) out.emplace_back();
    out.back().push_back(m);
  }
  return out;
}

// Every line's tokens, on a few threads; the first failing line (in file order) is
// the error, and lines after a failure are not tokenized.
std::vector<text::ChatTokens> tokenize_lines(const std::vector<files::JsonLine>& lines, const text::ChatTemplate& chat,
                                             const text::Tokenizer& tokenizer, int32_t eod, const std::string& path,
                                             size_t& unanswered) {
  std::vector<text::ChatTokens> out(lines.size());
  std::atomic<size_t> without_assistant{0};
  std::mutex mu;
  std::atomic<size_t> next{0}, failed_at{lines.size()};
  std::string failure;  // the error of line failed_at
  auto fail = [&](size_t i, std::string why) {
    std::lock_guard<std::mutex> lock(mu);
    if (i >= failed_at.load()) return;
    failed_at.store(i);
    failure = std::move(why);
  };
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < lines.size() && i < failed_at.load();) {
      const auto where = [&] { return path + ":" + std::to_string(lines[i].number) + ": "; };  // on failure only
      try {
        const text::Conversation messages = text::conversation_from_json(files::parse_json_line(lines[i], path));
        if (std::none_of(messages.begin(), messages.end(),
                         [](const text::ChatMessage& m) { return m.role == "assistant"; }))
          without_assistant.fetch_add(1);
        out[i] = line_tokens(chat, tokenizer, messages, eod);
      } catch (const files::JsonLineError& e) {
        fail(i, e.what());
      } catch (const std::exception& e) {
        fail(i, where() + e.what());
      } catch (...) {
        fail(i, where() + "an unknown error");
      }
    }
  };
  {
    std::vector<std::jthread> pool;  // joined when the scope ends, also when starting one throws
    const size_t threads = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 8);
    for (size_t t = 1; t < std::min(threads, lines.size()); ++t) pool.emplace_back(work);
    work();
  }
  if (failed_at.load() < lines.size()) throw DataError("data.path: " + failure);
  unanswered = without_assistant.load();
  return out;
}

}  // namespace

text::ChatTokens line_tokens(const text::ChatTemplate& chat, const text::Tokenizer& tokenizer,
                             const text::Conversation& messages, int32_t end_of_document) {
  text::ChatTokens line;
  for (const text::Conversation& c : conversations_of(messages)) {
    text::ChatTokens t = chat.encode(tokenizer, c, false);
    if (t.ids.empty() || t.ids.back() != end_of_document) {
      t.ids.push_back(end_of_document);
      t.target.push_back(1);
    }
    line.ids.insert(line.ids.end(), t.ids.begin(), t.ids.end());
    line.target.insert(line.target.end(), t.target.begin(), t.target.end());
  }
  return line;
}

ChatSource::ChatSource(std::vector<text::ChatTokens> lines, int64_t vocab, double val_fraction, uint64_t seed,
                       int32_t pad, std::string what, ChatLayout layout)
    : lines_(std::move(lines)), vocab_(vocab), seed_(seed), pad_(pad), what_(std::move(what)), layout_(std::move(layout)) {
  if (lines_.empty()) throw DataError(what_ + ": holds no conversations");
  const size_t n = lines_.size();
  if (layout_.evaluation) {
    for (size_t i = 0; i < n; ++i) validation_.push_back(static_cast<uint32_t>(i));
    return;
  }
  const size_t val = val_fraction > 0 ? std::max<size_t>(1, static_cast<size_t>(std::lround(val_fraction * static_cast<double>(n)))) : 0;
  for (size_t i = 0; i < n; ++i)
    (i < n - std::min(val, n - 1) ? train_ : validation_).push_back(static_cast<uint32_t>(i));
}

std::string ChatSource::describe() const {
  size_t tokens = 0, targets = 0, longest = 0;
  for (const text::ChatTokens& l : lines_) {
    tokens += l.ids.size();
    targets += static_cast<size_t>(std::count(l.target.begin(), l.target.end(), 1));
    longest = std::max(longest, l.ids.size());
  }
  return what_ + ": " + std::to_string(lines_.size()) + " lines of conversations (" + std::to_string(train_.size()) +
         " train, " + std::to_string(validation_.size()) + " validation), " + std::to_string(tokens) + " tokens, " +
         std::to_string(targets) + " of them targets, the longest line " + std::to_string(longest) + " tokens, " +
         (layout_.pack ? "packed, " : "") + "vocab " + std::to_string(vocab_);
}

std::string ChatSource::warning(int64_t seq) const {
  std::string said;
  const auto say = [&said](const std::string& s) { said += (said.empty() ? "" : "; ") + s; };
  if (layout_.pack && !layout_.isolated)
    say("data.chat_packing puts several conversations in a sample, where each attends to those before it; "
        "data.reset_attention_mask = true (and reset_position_ids) keeps them apart");
  if (layout_.unanswered > 0)
    say(std::to_string(layout_.unanswered) + " of " + std::to_string(lines_.size()) + " lines have no assistant "
        "turn: they train only where a conversation ends");
  size_t cut = 0, lost = 0;
  for (const text::ChatTokens& l : lines_) {
    if (static_cast<int64_t>(l.ids.size()) <= seq + 1) continue;
    ++cut;
    const auto kept_end = l.target.begin() + seq + 1;
    if (std::find(l.target.begin() + 1, kept_end, 1) == kept_end) ++lost;
  }
  if (cut == 0) return said;
  return said + (said.empty() ? "" : "; ") + std::to_string(cut) + " of " + std::to_string(lines_.size()) +
         " lines of conversations are longer than seq_length + 1 = " + std::to_string(seq + 1) +
         " tokens and are cut there (what follows does not train)" +
         (lost > 0 ? "; " + std::to_string(lost) + " of them keep no assistant token to learn" : std::string()) +
         "; a longer model.seq_length keeps them whole";
}

std::shared_ptr<const ChatSource::Packs> ChatSource::packs(Split split, int64_t seq) const {
  const std::pair<int, int64_t> key{split == Split::Train ? 0 : 1, layout_.pack ? seq : 0};
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = packs_.find(key); it != packs_.end()) return it->second;
  auto p = std::make_shared<Packs>();
  p->order = lines_of(split);
  if (layout_.pack) seeded_shuffle(p->order, stream_seed(seed_, split, 0, 4));  // once: lines of all parts together
  p->first.push_back(0);
  int64_t used = 0;  // tokens of the sample being filled
  for (uint32_t j = 0; j < p->order.size(); ++j) {
    const int64_t length = static_cast<int64_t>(lines_[p->order[j]].ids.size());
    if (j > p->first.back() && (!layout_.pack || used + length > seq + 1)) {
      p->first.push_back(j);
      used = 0;
    }
    used += length;
  }
  p->first.push_back(static_cast<uint32_t>(p->order.size()));
  packs_[key] = p;
  return p;
}

std::shared_ptr<const std::vector<uint32_t>> ChatSource::visit(Split split, uint64_t e, size_t count) const {
  const std::pair<int, uint64_t> key{split == Split::Train ? 0 : 1, e};
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = visits_.find(key); it != visits_.end() && it->second->size() == count) return it->second;
  auto v = std::make_shared<std::vector<uint32_t>>(count);
  for (size_t k = 0; k < count; ++k) (*v)[k] = static_cast<uint32_t>(k);
  seeded_shuffle(*v, stream_seed(seed_, split, e, 3));
  if (visits_.size() >= 4) visits_.erase(visits_.begin());  // ranks read nearby epochs
  visits_[key] = v;
  return v;
}

uint64_t ChatSource::samples_per_epoch(Split split, int64_t seq) const {
  if (lines_of(split).empty()) check_split(split, seq);  // says why
  return packs(split, seq)->first.size() - 1;
}

std::vector<uint32_t> ChatSource::lines_in_sample(Split split, uint64_t index, int64_t seq) const {
  if (lines_of(split).empty()) check_split(split, seq);  // says why
  if (layout_.evaluation)  // each line once, in file order, then padding
    return index < validation_.size() ? std::vector<uint32_t>{validation_[static_cast<size_t>(index)]}
                                      : std::vector<uint32_t>{};
  const std::shared_ptr<const Packs> p = packs(split, seq);
  const uint64_t count = p->first.size() - 1;
  const uint32_t k = (*visit(split, index / count, count))[index % count];
  return {p->order.begin() + p->first[k], p->order.begin() + p->first[k + 1]};
}

std::vector<int32_t> ChatSource::sample_prompt(Split split, uint64_t index, int64_t seq) const {
  std::vector<int32_t> tokens(static_cast<size_t>(seq)), targets(tokens.size());
  sample(split, index, seq, tokens.data(), targets.data());
  const auto first = std::find_if(targets.begin(), targets.end(), [](int32_t t) { return t >= 0; });
  if (first == targets.end()) return DataSource::sample_prompt(split, index, seq);
  tokens.resize(static_cast<size_t>(first - targets.begin()) + 1);  // through the header's last token
  return tokens;
}

std::string ChatSource::render(const int32_t* tokens, int64_t n) const {
  if (!layout_.tokenizer) return DataSource::render(tokens, n);
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < n; ++i)
    if (tokens[i] >= 0 && tokens[i] < layout_.tokenizer->vocab_size()) ids.push_back(tokens[i]);
  return layout_.tokenizer->decode(ids);
}

std::vector<int32_t> ChatSource::encode(const std::string& text) const {
  if (!layout_.tokenizer) return DataSource::encode(text);
  return layout_.tokenizer->encode(text);
}

void ChatSource::check_split(Split split, int64_t seq) const {
  const std::string name = split == Split::Train ? "training" : "validation";
  const size_t n = lines_of(split).size();
  if (n == 0)
    throw DataError(what_ + ": no line of conversations is left for " + name + " (" + std::to_string(lines_.size()) +
                    (lines_.size() == 1 ? " line" : " lines") + ")" +
                    (split == Split::Train ? "" : "; set run.eval_every = 0 and run.sample_every = 0") +
                    ", use more lines, or another data.val_fraction");
  // A split whose every line is cut before its first target trains (or measures) nothing.
  for (uint32_t l : lines_of(split)) {
    const std::vector<uint8_t>& target = lines_[l].target;
    const auto kept_end = target.begin() + std::min<int64_t>(seq + 1, static_cast<int64_t>(target.size()));
    if (target.size() > 1 && std::find(target.begin() + 1, kept_end, 1) != kept_end) return;
  }
  throw DataError(what_ + ": none of the " + std::to_string(n) + " " + name + " lines keeps a token to learn in "
                  "seq_length + 1 = " + std::to_string(seq + 1) + " tokens (each is cut before its first assistant "
                  "token); a longer model.seq_length keeps them");
}

void ChatSource::sample(Split split, uint64_t index, int64_t seq, int32_t* tokens, int32_t* targets) const {
  // The sample's lines back to back, cut after seq + 1 tokens, then padding.
  std::vector<int32_t> ids;
  std::vector<uint8_t> counted;
  for (uint32_t l : lines_in_sample(split, index, seq)) {
    const text::ChatTokens& line = lines_[l];
    const size_t take = std::min(line.ids.size(), static_cast<size_t>(seq + 1) - ids.size());
    ids.insert(ids.end(), line.ids.begin(), line.ids.begin() + static_cast<std::ptrdiff_t>(take));
    counted.insert(counted.end(), line.target.begin(), line.target.begin() + static_cast<std::ptrdiff_t>(take));
  }
  const int64_t length = static_cast<int64_t>(ids.size());
  for (int64_t t = 0; t < seq; ++t) {
    tokens[t] = t < length ? ids[static_cast<size_t>(t)] : pad_;
    targets[t] = t + 1 < length && counted[static_cast<size_t>(t + 1)] ? ids[static_cast<size_t>(t + 1)] : -1;
  }
}

text::ChatTemplate chat_template_of(const manifest::RunConfig& config) {
  try {
    return text::resolve_chat_template(config.data.chat_template, config.data.tokenizer,
                                       "set data.chat_template (\"chatml\" or \"llama3\")");
  } catch (const text::TokenizerError& e) {
    throw DataError(std::string("data.chat_template: ") + e.what());
  }
}

std::unique_ptr<DataSource> chat_source(const manifest::RunConfig& config, int64_t vocab, bool evaluation) {
  const std::string& path = config.data.path;
  const std::string what = "data.path = \"" + path + "\"";
  std::shared_ptr<const text::Tokenizer> tokenizer;
  try {
    tokenizer = text::load_tokenizer(config.data.tokenizer);
  } catch (const text::TokenizerError& e) {
    throw DataError(std::string("data.tokenizer: ") + e.what());
  }
  const text::ChatTemplate chat = chat_template_of(config);
  try {
    chat.require_special_tokens(*tokenizer);
  } catch (const text::TokenizerError& e) {
    throw DataError(std::string("data.chat_template: ") + e.what());
  }
  const int32_t eod = end_of_document_token(config, vocab > 0 ? vocab : tokenizer->vocab_size());
  if (eod == chat.end_of_turn(*tokenizer))
    throw DataError("data.eod_token = " + std::to_string(eod) + " is " + tokenizer->piece(eod) + ", which ends every "
                    "turn of chat template " + chat.name() + ": the conversations would have no end of their own, "
                    "and data.reset_attention_mask would cut each turn off the ones before it; name the token that "
                    "ends a document (" + tokenizer->describe() + ")");
  std::string why;
  const std::optional<std::string> content = files::read_whole_file(path, &why);
  if (!content) throw DataError(what + ": cannot read the file (" + why + ")");
  size_t unanswered = 0;
  std::vector<text::ChatTokens> lines = tokenize_lines(files::json_lines(*content), chat, *tokenizer, eod, path, unanswered);
  if (!lines.empty() && unanswered == lines.size())
    throw DataError(what + ": no line has an assistant turn, the turns the model learns to write");
  const int64_t model_vocab = vocab > 0 ? vocab : tokenizer->vocab_size();
  return std::make_unique<ChatSource>(
      std::move(lines), model_vocab, config.data.val_fraction, static_cast<uint64_t>(config.run.seed), eod,
      path + " (chat template " + chat.describe() + ")",
      ChatLayout{config.data.chat_packing && !evaluation, config.data.reset_attention_mask, unanswered,
                 std::move(tokenizer), evaluation});
}

}  // namespace loom::train
