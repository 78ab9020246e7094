// Training samples from a dataset of documents (Megatron's indexed dataset), as
// Megatron-LM's GPT dataset makes them: the documents are split into training and
// validation ones (the last val_fraction of them validate), every epoch concatenates a
// split's documents in a seeded shuffled order, cuts that stream into consecutive
// samples of seq_len + 1 tokens (one shared between neighbours: each token is a
// target once per epoch), and visits those samples in a seeded shuffled order. Sample
// i is a pure function of (seed, split, i), so a resumed run reads what the
// uninterrupted one would, and dp ranks read disjoint samples.
#pragma once

#include "engine/train/data.hpp"

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace loom::train {

class DocumentSource : public DataSource {
 public:
  // A single document is cut in two at (1 - val_fraction) of its tokens instead.
  DocumentSource(std::vector<std::vector<int32_t>> documents, int64_t vocab, double val_fraction, uint64_t seed,
                 std::string what);
  int64_t vocab_size() const override { return vocab_; }
  std::string describe() const override;
  void sample(Split split, uint64_t index, int64_t seq, int32_t* tokens, int32_t* targets) const override;
  // The documents of a split, by index (for tests and messages).
  const std::vector<uint32_t>& documents_of(Split split) const { return split == Split::Train ? train_ : validation_; }
  // Epoch e's document order of a split (a permutation of documents_of(split)).
  std::vector<uint32_t> document_order(Split split, uint64_t epoch) const;

 private:
  // One epoch of one split at one sequence length: the documents' starts in the
  // shuffled stream and the order its samples are visited in.
  struct Epoch {
    std::vector<uint32_t> order;   // documents, in stream order
    std::vector<int64_t> starts;   // their first token in the stream, and the stream's length last
    std::vector<uint32_t> visit;   // sample k of the epoch is stream sample visit[k]
  };
  std::shared_ptr<const Epoch> epoch(Split split, uint64_t e, int64_t seq) const;
  int64_t tokens_in(Split split) const;

  std::vector<std::vector<int32_t>> docs_;
  std::vector<uint32_t> train_, validation_;
  int64_t vocab_;
  uint64_t seed_;
  std::string what_;
  mutable std::mutex mu_;
  mutable std::map<std::tuple<int, uint64_t, int64_t>, std::shared_ptr<const Epoch>> epochs_;  // a few recent ones
};

}  // namespace loom::train
