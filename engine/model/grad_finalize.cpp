#include "engine/model/grad_finalize.hpp"

namespace loom::model {

void finalize_grads(const runtime::RankRuntime& rank, const ParamBuffers& buffers, bool sequence_parallel) {
  void* stream = rank.dev().native_stream();
  char* g = static_cast<char*>(buffers.grads());
  const int32_t dtype = buffers.grad_dtype();
  const size_t gsize = loom::dtype_size(dtype);
  // Under sequence parallelism a tp-duplicated parameter (layernorm, the bias
  // after a reduce-scatter, position embeddings) has seen only this rank's
  // sequence shard: its full gradient is the sum over the tp group.
  // Expert parameters split over an etp other than tp (MoE folding) hold other
  // experts on each tp rank, their tokens gathered by the ep exchange: no tp sum.
  const loom::Group tp = rank.group_or_self("tp");
  const bool experts_fold_tp = rank.group_or_self("etp").size() != tp.size();
  if (sequence_parallel)
    for (const ParamEntry& e : buffers.entries())
      if (e.duplicated && !(e.expert && experts_fold_tp))
        tp.all_reduce(stream, g + e.offset * gsize, g + e.offset * gsize, e.numel, dtype);
  // A word embedding tied across pipeline stages: the first stage's copy got the
  // lookup's gradient, the last stage's the output layer's; both need the sum.
  const loom::Group emb = rank.group_or_self("embedding");
  if (emb.size() > 1)
    for (const ParamEntry& e : buffers.entries())
      if (e.shared_across_stages)
        emb.all_reduce(stream, g + e.offset * gsize, g + e.offset * gsize, e.numel, dtype);
}

}  // namespace loom::model
