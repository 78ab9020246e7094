// Conversations for supervised fine-tuning (data.kind = "chat"), after Megatron-LM's
// SFT dataset: each line of a JSONL file holds {"messages": [...]}, one or more
// conversations (a system message after the first starts another), written with a
// chat template (engine/text/chat_template.hpp) and tokenized when the run starts;
// every conversation ends with the end-of-document token (a target, so the model
// learns where one ends). A line is one sample: its tokens cut after seq_length + 1
// (Megatron keeps seq_length and a masked pad) or padded with the end-of-document
// token, the targets those of the assistant's turns, -1 elsewhere and on padding.
// Megatron keeps a line's conversations apart (its packed sequences' cu_seqlens) and
// counts positions from each one's start; here data.reset_attention_mask and
// reset_position_ids do that, else they attend to one another as packed documents do.
// With packing (data.chat_packing) the lines are packed once, as NeMo packs SFT data
// before training: in a seeded shuffled order, each sample as many whole lines as fit in
// seq_length + 1 tokens (a longer line alone, cut): less padding.
// The last val_fraction of the lines validate; each epoch visits a split's samples (its
// lines, or its packs) in a seeded shuffled order, so sample i is a pure function of
// (seed, split, i), and every epoch holds as many samples.
#pragma once

#include "engine/text/chat_template.hpp"
#include "engine/train/data.hpp"

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace loom::train {

// One line's conversations as tokens: split at each system message after the first,
// each ending with `end_of_document` (a target) unless its last token is that already.
text::ChatTokens line_tokens(const text::ChatTemplate& chat, const text::Tokenizer& tokenizer,
                             const text::Conversation& messages, int32_t end_of_document);

// How a ChatSource lays its lines out and what it says about them. `pack`: several
// lines a sample; `isolated`: the run keeps packed documents apart
// (data.reset_attention_mask), else ChatSource::warning says they attend to each other;
// `unanswered`: lines without an assistant turn (they train only a conversation's end);
// `tokenizer`: renders and encodes text (null: ids); `evaluation`: every line
// validates, in file order, one a sample (samples past the last are padding), and a
// sample matches exactly when every assistant token is predicted (`loom eval --task chat`).
struct ChatLayout {
  bool pack = false;
  bool isolated = false;
  size_t unanswered = 0;
  std::shared_ptr<const text::Tokenizer> tokenizer;
  bool evaluation = false;
};

class ChatSource : public DataSource {
 public:
  // `lines`: line_tokens of each line; `pad` fills a sample past its lines' end.
  ChatSource(std::vector<text::ChatTokens> lines, int64_t vocab, double val_fraction, uint64_t seed, int32_t pad,
             std::string what, ChatLayout layout = {});
  int64_t vocab_size() const override { return vocab_; }
  std::string describe() const override;
  void sample(Split split, uint64_t index, int64_t seq, int32_t* tokens, int32_t* targets) const override;
  void check_split(Split split, int64_t seq) const override;
  std::string render(const int32_t* tokens, int64_t n) const override;
  bool has_exact_match() const override { return layout_.evaluation; }
  // The sample up to its first assistant header: the question the model answers.
  std::vector<int32_t> sample_prompt(Split split, uint64_t index, int64_t seq) const override;
  std::vector<int32_t> encode(const std::string& text) const override;
  // How many lines are cut at seq + 1 tokens, and how many of those lose every target;
  // packed conversations that attend to each other; lines without an answer.
  std::string warning(int64_t seq) const override;
  // The lines of a split, by index, and epoch e's visiting order of them.
  const std::vector<uint32_t>& lines_of(Split split) const { return split == Split::Train ? train_ : validation_; }
  // The samples of one epoch of a split at sequence length `seq`, and the lines of
  // sample `index` in order.
  uint64_t samples_per_epoch(Split split, int64_t seq) const;
  std::vector<uint32_t> lines_in_sample(Split split, uint64_t index, int64_t seq) const;

 private:
  // A split's samples at one sequence length: sample k holds lines
  // order[first[k]] .. order[first[k + 1] - 1] (unpacked: one line each).
  struct Packs {
    std::vector<uint32_t> order;
    std::vector<uint32_t> first;
  };
  std::shared_ptr<const Packs> packs(Split split, int64_t seq) const;
  // Epoch e's visiting order of `count` samples.
  std::shared_ptr<const std::vector<uint32_t>> visit(Split split, uint64_t e, size_t count) const;

  std::vector<text::ChatTokens> lines_;
  std::vector<uint32_t> train_, validation_;
  int64_t vocab_;
  uint64_t seed_;
  int32_t pad_;
  std::string what_;
  ChatLayout layout_;
  mutable std::mutex mu_;
  mutable std::map<std::pair<int, int64_t>, std::shared_ptr<const Packs>> packs_;             // split, seq
  mutable std::map<std::pair<int, uint64_t>, std::shared_ptr<const std::vector<uint32_t>>> visits_;  // a few recent
};

// data.path's conversations with data.tokenizer and data.chat_template (else the one
// the tokenizer's directory declares); `vocab` is the model's (0: the tokenizer's);
// `evaluation`: ChatLayout::evaluation. Throws DataError naming the file, the line and
// what is wrong.
std::unique_ptr<DataSource> chat_source(const manifest::RunConfig& config, int64_t vocab, bool evaluation = false);

// The chat template of a run: data.chat_template, else the one data.tokenizer's
// directory declares. Throws DataError when neither names one.
text::ChatTemplate chat_template_of(const manifest::RunConfig& config);

}  // namespace loom::train
