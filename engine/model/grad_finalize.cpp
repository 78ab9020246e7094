#include "engine/model/grad_finalize.hpp"

namespace loom::model {

GradFinalizer::GradFinalizer(const runtime::RankRuntime& rank, const ParamBuffers& buffers, size_t num_layers,
                             bool sequence_parallel)
    : rank_(rank), buffers_(buffers), sequence_parallel_(sequence_parallel), users_(buffers.entries().size(), 0) {
  for (size_t layer = 0; layer < num_layers; ++layer)
    for (size_t e : buffers.layer_entries(layer)) ++users_[e];
  begin_step();
}

void GradFinalizer::begin_step() {
  remaining_ = users_;
  announced_.assign(users_.size(), 0);
}

void GradFinalizer::layer_done(size_t layer) {
  std::vector<size_t> ready;
  for (size_t e : buffers_.layer_entries(layer))
    if (--remaining_[e] == 0 && !buffers_.entries()[e].shared_across_stages) ready.push_back(e);
  if (ready.empty()) return;
  sum_over_tp(ready);
  announce(ready);
}

void GradFinalizer::finish() {
  std::vector<size_t> rest;
  for (size_t e = 0; e < announced_.size(); ++e)
    if (!announced_[e]) rest.push_back(e);
  sum_over_tp(rest);
  // A word embedding tied across pipeline stages: the first stage's copy got the
  // lookup's gradient, the last stage's the output layer's; both need the sum.
  const loom::Group emb = rank_.group_or_self("embedding");
  const size_t gsize = loom::dtype_size(buffers_.grad_dtype());
  char* g = static_cast<char*>(buffers_.grads());
  if (emb.size() > 1)
    for (size_t i : rest) {
      const ParamEntry& e = buffers_.entries()[i];
      if (e.shared_across_stages)
        emb.all_reduce(rank_.dev().native_stream(), g + e.offset * gsize, g + e.offset * gsize, e.numel,
                       buffers_.grad_dtype());
    }
  if (!rest.empty()) announce(rest);
}

void GradFinalizer::sum_over_tp(const std::vector<size_t>& entries) const {
  if (!sequence_parallel_) return;
  void* stream = rank_.dev().native_stream();
  char* g = static_cast<char*>(buffers_.grads());
  const int32_t dtype = buffers_.grad_dtype();
  const size_t gsize = loom::dtype_size(dtype);
  // Under sequence parallelism a tp-duplicated parameter (layernorm, the bias
  // after a reduce-scatter, position embeddings) has seen only this rank's
  // sequence shard: its full gradient is the sum over the tp group.
  // Expert parameters split over an etp other than tp (MoE folding) hold other
  // experts on each tp rank, their tokens gathered by the ep exchange: no tp sum.
  const loom::Group tp = rank_.group_or_self("tp");
  const bool experts_fold_tp = rank_.group_or_self("etp").size() != tp.size();
  for (size_t i : entries) {
    const ParamEntry& e = buffers_.entries()[i];
    if (e.duplicated && !(e.expert && experts_fold_tp))
      tp.all_reduce(stream, g + e.offset * gsize, g + e.offset * gsize, e.numel, dtype);
  }
}

void GradFinalizer::announce(const std::vector<size_t>& entries) {
  for (size_t i : entries) announced_[i] = 1;
  if (listener_) listener_(entries);
}

}  // namespace loom::model
