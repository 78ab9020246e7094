#include "engine/train/chat_data.hpp"

#include "engine/files/read.hpp"
#include "engine/train/shuffle.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
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

// The non-blank lines of a JSONL file, with their line numbers.
struct JsonLine {
  size_t number;
  std::string_view text;
};
std::vector<JsonLine> json_lines(const std::string& content) {
  std::vector<JsonLine> lines;
  size_t number = 0;
  for (size_t at = 0; at < content.size();) {
    size_t end = content.find('\n', at);
    if (end == std::string::npos) end = content.size();
    ++number;
    const std::string_view line(content.data() + at, end - at);
    if (line.find_first_not_of(" \t\r") != std::string_view::npos) lines.push_back({number, line});
    at = end + 1;
  }
  return lines;
}

// Every line's tokens, on a few threads; the first failing line (in file order) is
// the error.
std::vector<text::ChatTokens> tokenize_lines(const std::vector<JsonLine>& lines, const text::ChatTemplate& chat,
                                             const text::Tokenizer& tokenizer, int32_t eod, const std::string& what) {
  std::vector<text::ChatTokens> out(lines.size());
  std::vector<std::string> errors(lines.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < lines.size();) {
      try {
        const nlohmann::json j = nlohmann::json::parse(lines[i].text);
        out[i] = line_tokens(chat, tokenizer, text::conversation_from_json(j), eod);
      } catch (const nlohmann::json::exception& e) {
        errors[i] = std::string("not JSON (") + e.what() + ")";
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    }
  };
  const size_t threads = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 8);
  std::vector<std::thread> pool;
  for (size_t t = 1; t < std::min(threads, lines.size()); ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  for (size_t i = 0; i < lines.size(); ++i)
    if (!errors[i].empty()) throw DataError(what + ", line " + std::to_string(lines[i].number) + ": " + errors[i]);
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
                       int32_t pad, std::string what)
    : lines_(std::move(lines)), vocab_(vocab), seed_(seed), pad_(pad), what_(std::move(what)) {
  if (lines_.empty()) throw DataError(what_ + ": holds no conversations");
  const size_t n = lines_.size();
  const size_t val = val_fraction > 0 ? std::max<size_t>(1, static_cast<size_t>(std::lround(val_fraction * static_cast<double>(n)))) : 0;
  for (uint32_t i = 0; i < n; ++i) (i < n - std::min(val, n - 1) ? train_ : validation_).push_back(i);
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
         std::to_string(targets) + " of them targets, the longest line " + std::to_string(longest) + " tokens, vocab " +
         std::to_string(vocab_);
}

std::string ChatSource::warning(int64_t seq) const {
  size_t cut = 0, lost = 0;
  for (const text::ChatTokens& l : lines_) {
    if (static_cast<int64_t>(l.ids.size()) <= seq + 1) continue;
    ++cut;
    const auto kept_end = l.target.begin() + seq + 1;
    if (std::find(l.target.begin() + 1, kept_end, 1) == kept_end) ++lost;
  }
  if (cut == 0) return "";
  return std::to_string(cut) + " of " + std::to_string(lines_.size()) + " lines of conversations are longer than "
         "seq_length + 1 = " + std::to_string(seq + 1) + " tokens and are cut there (what follows does not train)" +
         (lost > 0 ? "; " + std::to_string(lost) + " of them keep no assistant token to learn" : std::string()) +
         "; a longer model.seq_length keeps them whole";
}

std::vector<uint32_t> ChatSource::line_order(Split split, uint64_t epoch) const {
  std::vector<uint32_t> order = lines_of(split);
  seeded_shuffle(order, stream_seed(seed_, split, epoch, 3));
  return order;
}

std::shared_ptr<const std::vector<uint32_t>> ChatSource::order(Split split, uint64_t epoch) const {
  const auto key = std::make_pair(split == Split::Train ? 0 : 1, epoch);
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = orders_.find(key); it != orders_.end()) return it->second;
  auto o = std::make_shared<const std::vector<uint32_t>>(line_order(split, epoch));
  if (orders_.size() >= 4) orders_.erase(orders_.begin());  // ranks read nearby epochs
  orders_[key] = o;
  return o;
}

void ChatSource::check_split(Split split, int64_t) const {
  if (lines_of(split).empty())
    throw DataError(what_ + ": no line of conversations is left for " +
                    (split == Split::Train ? std::string("training") : "validation") + " (" +
                    std::to_string(lines_.size()) + " lines); use more, or another data.val_fraction");
}

void ChatSource::sample(Split split, uint64_t index, int64_t seq, int32_t* tokens, int32_t* targets) const {
  check_split(split, seq);
  const uint64_t n = lines_of(split).size();
  const text::ChatTokens& line = lines_[(*order(split, index / n))[index % n]];
  const int64_t length = static_cast<int64_t>(line.ids.size());
  for (int64_t t = 0; t < seq; ++t) {
    tokens[t] = t < length ? line.ids[static_cast<size_t>(t)] : pad_;
    targets[t] = t + 1 < length && line.target[static_cast<size_t>(t + 1)] ? line.ids[static_cast<size_t>(t + 1)] : -1;
  }
}

text::ChatTemplate chat_template_of(const manifest::RunConfig& config) {
  std::string name = config.data.chat_template;
  try {
    if (name.empty() && !config.data.tokenizer.empty()) name = text::declared_chat_template(config.data.tokenizer);
    if (name.empty())
      throw DataError("no chat template: data.tokenizer (" +
                      (config.data.tokenizer.empty() ? std::string("none") : config.data.tokenizer) +
                      ") declares none in a tokenizer_config.json; set data.chat_template (\"chatml\" or \"llama3\"; "
                      "loom generate --chat-template)");
    return text::ChatTemplate::named(name);
  } catch (const text::TokenizerError& e) {
    throw DataError(std::string("data.chat_template: ") + e.what());
  }
}

std::unique_ptr<DataSource> chat_source(const manifest::RunConfig& config, int64_t vocab) {
  const std::string& path = config.data.path;
  const std::string what = "data.path = \"" + path + "\"";
  std::unique_ptr<text::Tokenizer> tokenizer;
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
  std::string why;
  const std::optional<std::string> content = files::read_whole_file(path, &why);
  if (!content) throw DataError(what + ": cannot read the file (" + why + ")");
  std::vector<text::ChatTokens> lines = tokenize_lines(json_lines(*content), chat, *tokenizer, eod, what);
  return std::make_unique<ChatSource>(std::move(lines), vocab > 0 ? vocab : tokenizer->vocab_size(),
                                      config.data.val_fraction, static_cast<uint64_t>(config.run.seed), eod,
                                      path + " (chat template " + chat.name() + ")");
}

}  // namespace loom::train
