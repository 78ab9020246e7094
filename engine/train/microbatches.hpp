// A rank's microbatches on its device: samples read from the data source,
// laid out [seq, micro_batch], cut to the rank's context-parallel slice of the
// sequence and copied into per-microbatch device buffers (a pipeline keeps
// several in flight, and the embedding's backward reads its tokens).
#pragma once

#include "engine/pipeline/executor.hpp"
#include "engine/runtime/rank_runtime.hpp"
#include "engine/train/data.hpp"

#include <loom/cpp/core.hpp>

#include <cstdint>
#include <vector>

namespace loom::train {

class Microbatches {
 public:
  // `slots` device buffers each of this rank's rows of seq x micro_batch tokens and
  // targets, and of the document inputs `docs` asks for.
  Microbatches(runtime::RankRuntime& rank, const DataSource& data, int64_t seq, int64_t micro_batch, int64_t slots,
               DocumentInputs docs = {});

  // Reads samples first_sample .. + micro_batch of `split` into slot `slot`; the
  // input's dropout seed is left 0.
  pipeline::MicrobatchInput load(Split split, uint64_t first_sample, int64_t slot);

  // This rank's rows of the sequence (seq, or seq / cp), and the host copy of the
  // targets of the last load, [rows, micro_batch] (-1 = no target).
  int64_t rows() const { return context_.local_length(); }
  const std::vector<int32_t>& targets() const { return targets_.local; }
  // The targets of the last load's whole sequences (every cp rank's part).
  int64_t whole_targets() const;

 private:
  // [rows, micro_batch] host rows of the whole sequences, this rank's part of them,
  // and a device buffer per slot.
  struct Rows {
    std::vector<int32_t> whole, local;
    std::vector<loom::Buffer> dev;
  };
  void cut_and_copy(Rows& rows, int64_t slot);

  runtime::RankRuntime& rank_;
  const DataSource& data_;
  int64_t seq_, micro_batch_;
  DocumentInputs docs_;
  loom::ContextSlice context_;
  Rows tokens_, targets_, starts_, positions_;
};

}  // namespace loom::train
