#include "engine/train/microbatches.hpp"

#include <algorithm>

namespace loom::train {

Microbatches::Microbatches(runtime::RankRuntime& rank, const DataSource& data, int64_t seq, int64_t micro_batch,
                           int64_t slots, DocumentInputs docs)
    : rank_(rank),
      data_(data),
      seq_(seq),
      micro_batch_(micro_batch),
      docs_(docs),
      context_(seq, rank.group_or_self("cp").size(), rank.group_or_self("cp").rank()) {
  const size_t whole = static_cast<size_t>(seq * micro_batch), local = static_cast<size_t>(context_.local_length() * micro_batch);
  for (Rows* r : {&tokens_, &targets_, &starts_, &positions_}) {
    const bool used = (r != &starts_ || docs_.starts) && (r != &positions_ || docs_.positions);
    if (!used) continue;
    r->whole.resize(whole);
    r->local.resize(local);
    for (int64_t s = 0; s < slots; ++s) r->dev.emplace_back(&rank_, local * sizeof(int32_t));
  }
}

void Microbatches::cut_and_copy(Rows& rows, int64_t slot) {
  for (const loom::ContextSlice::Run& run : context_.runs())
    std::copy_n(rows.whole.begin() + run.position * micro_batch_, run.length * micro_batch_,
                rows.local.begin() + run.local * micro_batch_);
  rank_.dev().copy(rows.dev[static_cast<size_t>(slot)].get(), rows.local.data(), rows.local.size() * sizeof(int32_t),
                   LOOM_COPY_HOST_TO_DEVICE);
}

pipeline::MicrobatchInput Microbatches::load(Split split, uint64_t first_sample, int64_t slot) {
  fill_microbatch(data_, split, first_sample, micro_batch_, seq_, tokens_.whole.data(), targets_.whole.data());
  pipeline::MicrobatchInput in;
  cut_and_copy(tokens_, slot);
  cut_and_copy(targets_, slot);
  in.tokens = tokens_.dev[static_cast<size_t>(slot)].get<int32_t>();
  in.targets = targets_.dev[static_cast<size_t>(slot)].get<int32_t>();
  if (docs_.starts || docs_.positions) {
    const std::vector<int32_t> starts = document_starts(tokens_.whole, seq_, micro_batch_, docs_.end_of_document);
    if (docs_.starts) {
      starts_.whole = starts;
      cut_and_copy(starts_, slot);
      in.document_start = starts_.dev[static_cast<size_t>(slot)].get<int32_t>();
    }
    if (docs_.positions) {
      positions_.whole = document_positions(starts, micro_batch_);
      cut_and_copy(positions_, slot);
      in.position_ids = positions_.dev[static_cast<size_t>(slot)].get<int32_t>();
    }
  }
  return in;
}

int64_t Microbatches::whole_targets() const {
  return std::count_if(targets_.whole.begin(), targets_.whole.end(), [](int32_t t) { return t >= 0; });
}

}  // namespace loom::train
