// The evaluation sets of `loom eval`, as data sources whose validation split holds
// them in order: sample i is window or example i; samples past the last are padding
// without targets (so every data-parallel rank can run whole microbatches).
#pragma once

#include "engine/train/data.hpp"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace loom::train {

// Perplexity over a token stream with overlapping windows, as the Megatron-LM paper
// evaluates WikiText-103 (Shoeybi et al., 2019; Megatron-LM's tasks/zeroshot_gpt):
// window i holds tokens [i * stride, i * stride + seq_len] and predicts each next
// one; window 0 counts every target, a later window only its last `stride`, so each
// token after the first is predicted once, with up to seq_len - stride tokens of
// context before the counted ones.
class SlidingWindows : public DataSource {
 public:
  SlidingWindows(std::vector<int32_t> tokens, int64_t seq_len, int64_t stride, int64_t vocab, std::string what);
  int64_t windows() const { return windows_; }
  int64_t targets() const { return static_cast<int64_t>(tokens_.size()) - 1; }  // each counted once
  int64_t vocab_size() const override { return vocab_; }
  std::string describe() const override;
  void sample(Split split, uint64_t index, int64_t seq, int32_t* tokens, int32_t* targets) const override;

 private:
  std::vector<int32_t> tokens_;
  int64_t seq_len_, stride_, vocab_, windows_;
  std::string what_;
};

// Last-word prediction (LAMBADA, Paperno et al., 2016, read as Megatron-LM's
// --strict-lambada reads it): the context is the text before its last
// whitespace-separated word, the target the tokens of " " + that word. Only the target
// tokens carry a loss; a sample is right when the argmax predicts all of them.
struct LastWordExample {
  std::vector<int32_t> context, target;
  int64_t line = 0;  // of the JSONL file it came from (0: not from a file)
};

class LastWordTask : public DataSource {
 public:
  // Examples longer than seq_len + 1 tokens lose the start of their context; one whose
  // last word alone takes more than seq_len tokens (no context left) is a DataError
  // naming its line.
  LastWordTask(std::vector<LastWordExample> examples, int64_t seq_len, int64_t vocab, std::string what,
               const std::string& target_name = "the last word");  // what the refusal calls a target
  int64_t size() const { return static_cast<int64_t>(examples_.size()); }
  int64_t vocab_size() const override { return vocab_; }
  std::string describe() const override { return what_ + ": " + std::to_string(examples_.size()) + " examples"; }
  bool has_exact_match() const override { return true; }
  void sample(Split split, uint64_t index, int64_t seq, int32_t* tokens, int32_t* targets) const override;

 private:
  std::vector<LastWordExample> examples_;
  int64_t vocab_;
  std::string what_;
};

// Multiple choice (HellaSwag, Zellers et al., 2019, as llm.c and lm-evaluation-harness
// score it): a context and its candidate endings, each ending a LastWordExample (the
// context's tokens, then the ending's as the targets), `label` the right one.
struct ChoiceExample {
  std::vector<LastWordExample> endings;
  int64_t label = 0;
  int64_t line = 0;
};

// One example per line of a JSONL file with HellaSwag's fields: "ctx" (the context),
// "endings" (an array of strings) and "label" (the right ending's index). An ending's
// tokens are those the encoding of ctx + " " + ending adds to the context's; only the
// context's last `keep_context` tokens are kept (0: all; a sequence of seq_length
// reads no more). Throws DataError naming the file and line of a line that is not
// such an object, or that the codec cannot encode.
std::vector<ChoiceExample> read_choice_examples(const std::string& path,
                                                const std::function<std::vector<int32_t>(const std::string&)>& encode,
                                                int64_t keep_context = 0);

// The scores of multiple choice from each candidate's summed loss and target tokens
// (in the order of the examples' endings): the fraction of examples whose right ending
// has the least summed loss (accuracy) and the least loss per token (accuracy_norm,
// llm.c's HellaSwag number); ties go to the earlier ending.
struct ChoiceScores {
  double accuracy = 0, accuracy_norm = 0;
  int64_t examples = 0;
};
ChoiceScores score_choices(const std::vector<ChoiceExample>& examples, const std::vector<double>& loss_sums,
                           const std::vector<int64_t>& tokens);

// One example per line of a JSONL file with a "text" field, split and encoded as
// LastWordTask takes them. Throws DataError naming the file and line of a line that is
// not such an object or has fewer than two words.
std::vector<LastWordExample> read_last_word_examples(const std::string& path,
                                                     const std::function<std::vector<int32_t>(const std::string&)>& encode);

}  // namespace loom::train
