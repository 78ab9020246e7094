// Conversations for supervised fine-tuning (data.kind = "chat"), as Megatron-LM's SFT
// dataset makes its samples: each line of a JSONL file holds {"messages": [...]}, one
// or more conversations (a system message after the first starts another), written
// with a chat template (engine/text/chat_template.hpp) and tokenized when the run
// starts; every conversation ends with the end-of-document token. A line is one
// sample: its tokens cut after seq_length + 1 or padded with the end-of-document token,
// the targets those of the assistant's turns (the end-of-document token after a
// conversation too, so the model learns where one ends), -1 elsewhere and on padding.
// The last val_fraction of the lines validate; each epoch visits a split's lines in a
// seeded shuffled order, so sample i is a pure function of (seed, split, i).
#pragma once

#include "engine/text/chat_template.hpp"
#include "engine/train/data.hpp"

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace loom::train {

// One line's conversations as tokens: split at each system message after the first,
// each ending with `end_of_document` (a target) unless its last token is that already.
text::ChatTokens line_tokens(const text::ChatTemplate& chat, const text::Tokenizer& tokenizer,
                             const text::Conversation& messages, int32_t end_of_document);

class ChatSource : public DataSource {
 public:
  // `lines`: line_tokens of each line; `pad` fills a sample past a line's end.
  ChatSource(std::vector<text::ChatTokens> lines, int64_t vocab, double val_fraction, uint64_t seed, int32_t pad,
             std::string what);
  int64_t vocab_size() const override { return vocab_; }
  std::string describe() const override;
  void sample(Split split, uint64_t index, int64_t seq, int32_t* tokens, int32_t* targets) const override;
  void check_split(Split split, int64_t seq) const override;
  // How many lines are cut at seq + 1 tokens, and how many of those lose every target.
  std::string warning(int64_t seq) const override;
  // The lines of a split, by index, and epoch e's visiting order of them.
  const std::vector<uint32_t>& lines_of(Split split) const { return split == Split::Train ? train_ : validation_; }
  std::vector<uint32_t> line_order(Split split, uint64_t epoch) const;

 private:
  std::shared_ptr<const std::vector<uint32_t>> order(Split split, uint64_t epoch) const;

  std::vector<text::ChatTokens> lines_;
  std::vector<uint32_t> train_, validation_;
  int64_t vocab_;
  uint64_t seed_;
  int32_t pad_;
  std::string what_;
  mutable std::mutex mu_;
  mutable std::map<std::pair<int, uint64_t>, std::shared_ptr<const std::vector<uint32_t>>> orders_;  // a few recent
};

// data.path's conversations with data.tokenizer and data.chat_template (else the one
// the tokenizer's directory declares); `vocab` is the model's (0: the tokenizer's).
// Throws DataError naming the file, the line and what is wrong.
std::unique_ptr<DataSource> chat_source(const manifest::RunConfig& config, int64_t vocab);

// The chat template of a run: data.chat_template, else the one data.tokenizer's
// directory declares. Throws DataError when neither names one.
text::ChatTemplate chat_template_of(const manifest::RunConfig& config);

}  // namespace loom::train
