#include "engine/train/documents.hpp"

#include "engine/train/shuffle.hpp"

#include <algorithm>
#include <numeric>

namespace loom::train {

DocumentSource::DocumentSource(std::vector<std::vector<int32_t>> documents, int64_t vocab, double val_fraction,
                               uint64_t seed, std::string what)
    : docs_(std::move(documents)), vocab_(vocab), seed_(seed), what_(std::move(what)) {
  std::erase_if(docs_, [](const std::vector<int32_t>& d) { return d.empty(); });
  if (docs_.empty()) throw DataError(what_ + ": the dataset holds no tokens");
  if (docs_.size() == 1 && val_fraction > 0) {  // one document: its tail validates
    std::vector<int32_t>& d = docs_[0];
    const size_t cut = static_cast<size_t>(static_cast<double>(d.size()) * (1.0 - val_fraction));
    docs_.emplace_back(d.begin() + static_cast<std::ptrdiff_t>(cut), d.end());
    docs_[0].resize(cut);
  }
  const size_t n = docs_.size();
  const size_t val = val_fraction > 0 ? std::max<size_t>(1, static_cast<size_t>(std::lround(val_fraction * static_cast<double>(n)))) : 0;
  for (uint32_t i = 0; i < n; ++i) (i < n - std::min(val, n - 1) ? train_ : validation_).push_back(i);
}

std::string DocumentSource::describe() const {
  return what_ + ": " + std::to_string(train_.size()) + " training documents (" + std::to_string(tokens_in(Split::Train)) +
         " tokens), " + std::to_string(validation_.size()) + " validation (" + std::to_string(tokens_in(Split::Validation)) +
         "), vocab " + std::to_string(vocab_);
}

int64_t DocumentSource::tokens_in(Split split) const {
  int64_t n = 0;
  for (uint32_t d : documents_of(split)) n += static_cast<int64_t>(docs_[d].size());
  return n;
}

std::vector<uint32_t> DocumentSource::document_order(Split split, uint64_t epoch) const {
  std::vector<uint32_t> order = documents_of(split);
  seeded_shuffle(order, stream_seed(seed_, split, epoch, 1));
  return order;
}

std::shared_ptr<const DocumentSource::Epoch> DocumentSource::epoch(Split split, uint64_t e, int64_t seq) const {
  const auto key = std::make_tuple(split == Split::Train ? 0 : 1, e, seq);
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = epochs_.find(key); it != epochs_.end()) return it->second;
  auto ep = std::make_shared<Epoch>();
  ep->order = document_order(split, e);
  ep->starts.reserve(ep->order.size() + 1);
  int64_t at = 0;
  for (uint32_t d : ep->order) {
    ep->starts.push_back(at);
    at += static_cast<int64_t>(docs_[d].size());
  }
  ep->starts.push_back(at);
  ep->visit.resize(static_cast<size_t>((at - 1) / seq));
  std::iota(ep->visit.begin(), ep->visit.end(), 0u);
  seeded_shuffle(ep->visit, stream_seed(seed_, split, e, 2));
  if (epochs_.size() >= 4) epochs_.erase(epochs_.begin());  // ranks read nearby epochs: a few suffice
  epochs_[key] = ep;
  return ep;
}

void DocumentSource::sample(Split split, uint64_t index, int64_t seq, int32_t* tokens, int32_t* targets) const {
  const int64_t total = tokens_in(split);
  if (total < seq + 1)
    throw DataError(what_ + ": the " + std::string(split == Split::Train ? "training" : "validation") + " documents hold " +
                    std::to_string(total) + " tokens, fewer than seq_length + 1 = " + std::to_string(seq + 1) +
                    "; use more data, a shorter model.seq_length or another data.val_fraction");
  const uint64_t per_epoch = static_cast<uint64_t>((total - 1) / seq);
  const std::shared_ptr<const Epoch> ep = epoch(split, index / per_epoch, seq);
  int64_t at = static_cast<int64_t>(ep->visit[index % per_epoch]) * seq;  // the sample's first token in the stream
  // The document holding it, then seq + 1 tokens across as many documents as it takes.
  size_t d = static_cast<size_t>(std::upper_bound(ep->starts.begin(), ep->starts.end(), at) - ep->starts.begin()) - 1;
  for (int64_t t = 0; t <= seq; ++t, ++at) {
    while (at >= ep->starts[d + 1]) ++d;
    const int32_t token = docs_[ep->order[d]][static_cast<size_t>(at - ep->starts[d])];
    if (t < seq) tokens[t] = token;
    if (t > 0) targets[t - 1] = token;
  }
}

}  // namespace loom::train
