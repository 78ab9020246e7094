#include "engine/train/blend.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>

namespace loom::train {

BlendedSource::BlendedSource(std::vector<std::unique_ptr<DataSource>> parts, std::vector<double> weights)
    : parts_(std::move(parts)), weights_(std::move(weights)) {
  if (parts_.empty() || parts_.size() != weights_.size())
    throw DataError("a blend needs one weight per dataset (" + std::to_string(weights_.size()) + " weights, " +
                    std::to_string(parts_.size()) + " datasets)");
  const double sum = std::accumulate(weights_.begin(), weights_.end(), 0.0);
  if (!std::isfinite(sum)) throw DataError("a blend's weights sum to " + std::to_string(sum) + "; give weights whose sum is finite (they are normalised)");
  for (double& w : weights_) {
    if (!(w > 0)) throw DataError("a blend's weights must be positive");
    w /= sum;
  }
  for (auto& t : taken_before_) t.push_back(std::vector<uint64_t>(parts_.size(), 0));
}

int64_t BlendedSource::vocab_size() const {
  int64_t v = 0;
  for (const auto& p : parts_) v = std::max(v, p->vocab_size());
  return v;
}

std::string BlendedSource::describe() const {
  std::ostringstream os;
  os << "blend of " << parts_.size() << ":";
  for (size_t d = 0; d < parts_.size(); ++d)
    os << (d ? ";" : "") << " " << static_cast<int>(weights_[d] * 1000 + 0.5) / 10.0 << "% " << parts_[d]->describe();
  return os.str();
}

// Block k's samples from each dataset's counts before it (`taken`, advanced past it).
BlendedSource::Block BlendedSource::walk(uint64_t k, std::vector<uint64_t>& taken) const {
  Block assigned(kBlock);
  for (uint64_t j = 0; j < kBlock; ++j) {
    const double at = static_cast<double>(std::max<uint64_t>(k * kBlock + j, 1));
    size_t pick = 0;
    double behind = -1e300;
    for (size_t d = 0; d < parts_.size(); ++d) {
      const double e = weights_[d] * at - static_cast<double>(taken[d]);
      if (e > behind) behind = e, pick = d;
    }
    assigned[j] = {static_cast<uint32_t>(pick), taken[pick]++};
  }
  return assigned;
}

std::shared_ptr<const BlendedSource::Block> BlendedSource::block(int split, uint64_t b) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = blocks_.find({split, b}); it != blocks_.end()) return it->second;
  std::vector<std::vector<uint64_t>>& before = taken_before_[split];
  while (before.size() <= b) {  // every earlier block is walked once, for its counts
    std::vector<uint64_t> taken = before.back();
    walk(before.size() - 1, taken);
    before.push_back(std::move(taken));
  }
  std::vector<uint64_t> taken = before[b];
  auto out = std::make_shared<const Block>(walk(b, taken));
  if (blocks_.size() >= 16) blocks_.erase(blocks_.begin());
  blocks_[{split, b}] = out;
  return out;
}

std::pair<size_t, uint64_t> BlendedSource::source_of(Split split, uint64_t index) const {
  const std::shared_ptr<const Block> b = block(split == Split::Train ? 0 : 1, index / kBlock);
  return (*b)[index % kBlock];
}

void BlendedSource::sample(Split split, uint64_t index, int64_t seq, int32_t* tokens, int32_t* targets) const {
  const auto [d, k] = source_of(split, index);
  parts_[d]->sample(split, k, seq, tokens, targets);
}

}  // namespace loom::train
