// The gradients of a training step become final layer by layer. Once the last
// microbatch's backward of every layer holding a parameter has run, the engine's own
// reduction of it is applied — under sequence parallelism a tp-duplicated parameter
// is summed over tp — and it is announced to a listener (the optimizer strategy's
// grads_ready, ABI 1.15), which may then start reducing it over dp while the
// backward goes on (Megatron-LM's overlap_grad_reduce). A word embedding tied across
// pipeline stages is final only once both copies are summed over the embedding
// group, after the whole backward (finish).
#pragma once

#include "engine/model/param_buffers.hpp"
#include "engine/runtime/rank_runtime.hpp"

#include <functional>
#include <vector>

namespace loom::model {

class GradFinalizer {
 public:
  // Told of entries (indices into buffers.entries()) whose gradients are final.
  using Listener = std::function<void(const std::vector<size_t>& entries)>;

  // sequence_parallel: the run shards hidden states over tp (and tp > 1).
  GradFinalizer(const runtime::RankRuntime& rank, const ParamBuffers& buffers, size_t num_layers,
                bool sequence_parallel);

  void set_listener(Listener listener) { listener_ = std::move(listener); }
  // A training step begins: every entry is pending again.
  void begin_step();
  // The last microbatch's backward of `layer` has run.
  void layer_done(size_t layer);
  // After the step's backward: the tied copies' sums, then every entry not yet announced.
  void finish();

 private:
  void sum_over_tp(const std::vector<size_t>& entries) const;  // sequence parallelism's sums
  void announce(const std::vector<size_t>& entries);

  const runtime::RankRuntime& rank_;
  const ParamBuffers& buffers_;
  bool sequence_parallel_;
  std::vector<int> users_;      // by entry: the layers declaring it
  std::vector<int> remaining_;  // by entry: those whose last backward is still to come
  std::vector<char> announced_;
  Listener listener_;
};

}  // namespace loom::model
