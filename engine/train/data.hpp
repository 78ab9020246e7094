// Training data. A source turns a sample index into one sequence of tokens and
// its targets; which samples a rank reads is a pure function of (step, dp rank,
// microbatch), so a resumed run reads exactly what the uninterrupted one would.
#pragma once

#include "engine/manifest/run_config.hpp"

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace loom::train {

enum class Split { Train, Validation };

class DataError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class DataSource {
 public:
  virtual ~DataSource() = default;
  virtual int64_t vocab_size() const = 0;
  virtual std::string describe() const = 0;
  // One sequence: tokens[seq] and targets[seq] (target -1 = no loss at that position).
  virtual void sample(Split split, uint64_t index, int64_t seq, int32_t* tokens, int32_t* targets) const = 0;
  // Throws DataError when the split cannot give a sequence of seq tokens (a file too
  // short for it): reads one, as the trainer would; a blend checks each dataset.
  virtual void check_split(Split split, int64_t seq) const;
  // The prompt run.sample_every shows the model: the start of sample `index` of
  // `split` (a quarter of seq, at least one token).
  virtual std::vector<int32_t> sample_prompt(Split split, uint64_t index, int64_t seq) const;
  // What a run at sequence length `seq` should be told about the data ("" = nothing):
  // conversations cut short, for example.
  virtual std::string warning(int64_t seq) const;
  // True when exact-match accuracy (every target position predicted) is meaningful.
  virtual bool has_exact_match() const { return false; }
  // Token id -> printable text for samples shown to the user.
  virtual std::string render(const int32_t* tokens, int64_t n) const;
  // Text -> token ids, for sources whose tokens are symbols of their own (a synthetic
  // task; `loom generate` prompts). Throws DataError for a source without one or a
  // character it has no token for.
  virtual std::vector<int32_t> encode(const std::string& text) const;
};

// kind = data.kind: "synthetic" (data.task, data.digits), "text" (bytes of data.path),
// "tokens" (llm.c .bin at data.path), "indexed" (Megatron's indexed dataset
// data.path.bin/.idx: its documents back to back, as Megatron's GPT dataset samples
// across document boundaries). Throws DataError naming the file and the problem.
std::unique_ptr<DataSource> make_data_source(const manifest::RunConfig& config);

// The token that ends a document: data.eod_token, else data.tokenizer's; it must be in
// the vocabulary. Throws DataError when there is none.
int32_t end_of_document_token(const manifest::RunConfig& config, int64_t vocab);

// What the microbatches' document starts look for: the end-of-document token when
// data.reset_attention_mask or data.reset_position_ids is set, else -1 (none).
int32_t document_end_for(const manifest::RunConfig& config, int64_t vocab);

// Documents packed in the sequences (data.reset_attention_mask, reset_position_ids):
// what the microbatches hand the layers besides the tokens.
struct DocumentInputs {
  int32_t end_of_document = -1;  // the token that ends one; -1: none handed
  bool starts = false;           // document_start (reset_attention_mask)
  bool positions = false;        // position_ids (reset_position_ids)
};
DocumentInputs document_inputs(const manifest::RunConfig& config, int64_t vocab);
// "; documents end at token N: ..." for a run's log line, or "" without documents.
std::string documents_text(const DocumentInputs& docs);
// Why the end-of-document settings (data.eod_mask_loss, data.reset_*) would change
// nothing: their token occurs in none of the first training sequences; "" when it
// does, or when none is set.
std::string end_token_unseen(const DataSource& data, const manifest::RunConfig& config, int64_t vocab);

// Where each token's document begins, for sequences laid out [seq, micro_batch]:
// the position after the last end_of_document token before it (Megatron-LM's
// get_ltor_masks_and_position_ids: an end-of-document token belongs to the document it
// ends), or 0. A token's position in its document is its position minus that.
std::vector<int32_t> document_starts(const std::vector<int32_t>& tokens, int64_t seq, int64_t micro_batch,
                                     int32_t end_of_document);
// Each token's position in its document, from document_starts' result.
std::vector<int32_t> document_positions(const std::vector<int32_t>& starts, int64_t micro_batch);

// llm.c's token file: a header of 256 int32 (magic 20240520, version 1, token count),
// then uint16 tokens. Throws DataError naming `key` (what named the file: "path" for
// data.path, or an option such as "--data") and what is wrong.
std::vector<int32_t> read_llmc_tokens(const std::string& path, const std::string& key = "path");

// A microbatch laid out [seq, micro_batch] (sequence-major, as the model wants).
void fill_microbatch(const DataSource& src, Split split, uint64_t first_sample, int64_t micro_batch, int64_t seq,
                     int32_t* tokens, int32_t* targets);

// The samples a run has consumed before `step`: those of the checkpoint it resumed from
// (`start_samples` at `start_step`; Megatron-LM's consumed_train_samples) and a global
// batch for each step since, so a resume with another global batch neither repeats nor
// skips data.
inline uint64_t samples_before(int64_t step, int64_t start_step, uint64_t start_samples, int64_t global_batch) {
  return start_samples + static_cast<uint64_t>(step - start_step) * static_cast<uint64_t>(global_batch);
}

// The first sample index of microbatch `mb` of data-parallel rank `dp_rank` in a step
// whose first sample is `step_first`: step_first + (dp_rank·microbatches + mb)·micro_batch.
// With dp = 1 the same samples are read in the same order as dp ranks read them together.
inline uint64_t sample_index(uint64_t step_first, int dp_rank, int64_t microbatches, int mb, int64_t micro_batch) {
  return step_first + (static_cast<uint64_t>(dp_rank) * microbatches + mb) * micro_batch;
}

}  // namespace loom::train
