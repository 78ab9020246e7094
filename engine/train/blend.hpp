// Several datasets mixed by weight (manifest data.blend, Megatron-LM's --data-path
// with weights): sample i of a split comes from the dataset furthest behind its share
// at that point, as its next sample (Megatron-LM's build_blending_indices), so every
// prefix of the samples holds each dataset's share to within one sample, and sample i
// is a pure function of i (exact on resume). Each dataset keeps its own split,
// shuffles and epochs.
#pragma once

#include "engine/train/data.hpp"

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace loom::train {

class BlendedSource : public DataSource {
 public:
  // weights > 0 (normalised here), one per part.
  BlendedSource(std::vector<std::unique_ptr<DataSource>> parts, std::vector<double> weights);
  int64_t vocab_size() const override;
  std::string describe() const override;
  void sample(Split split, uint64_t index, int64_t seq, int32_t* tokens, int32_t* targets) const override;
  std::string render(const int32_t* tokens, int64_t n) const override { return parts_[0]->render(tokens, n); }
  void check_split(Split split, int64_t seq) const override {
    for (const auto& p : parts_) p->check_split(split, seq);
  }
  // Sample `index` of `split`: (dataset, its sample index).
  std::pair<size_t, uint64_t> source_of(Split split, uint64_t index) const;

 private:
  static constexpr uint64_t kBlock = 4096;
  using Block = std::vector<std::pair<uint32_t, uint64_t>>;
  std::shared_ptr<const Block> block(int split, uint64_t b) const;
  Block walk(uint64_t k, std::vector<uint64_t>& taken) const;

  std::vector<std::unique_ptr<DataSource>> parts_;
  std::vector<double> weights_;
  mutable std::mutex mu_;
  // Per split: each dataset's samples taken before block b (extended as blocks are
  // asked for), and a few recent blocks' assignments.
  mutable std::vector<std::vector<uint64_t>> taken_before_[2];
  mutable std::map<std::pair<int, uint64_t>, std::shared_ptr<const Block>> blocks_;
};

}  // namespace loom::train
