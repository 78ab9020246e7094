#include "engine/train/preflight.hpp"

#include "engine/train/data.hpp"

#include <loom/cpp/core.hpp>

#include <vector>

namespace loom::train {
namespace {

// One sequence of a split, read as the trainer would: a file too short for it fails here.
void read_one(const DataSource& data, Split split, int64_t seq) {
  std::vector<int32_t> tokens(static_cast<size_t>(seq)), targets(static_cast<size_t>(seq));
  data.sample(split, 0, seq, tokens.data(), targets.data());
}

// Expert parallelism splits expert parameters: a model without any would only get ep
// times the ranks to do the same work.
void check_experts(const RunPlan& plan, const MemoryPlan& memory) {
  if (plan.sizes.ep <= 1) return;
  for (const RankMemory& r : memory.ranks)
    if (r.expert_start < r.buffer_numel) return;
  throw loom::Error("parallel.ep = " + std::to_string(plan.sizes.ep) +
                    " but no layer of the model has expert parameters (a dense model); set parallel.ep = 1 "
                    "or use a layer with experts (e.g. model.block = [\"attention\", \"moe\"])");
}

}  // namespace

Preflight preflight(const RunPlan& plan, int ranks_in_process) {
  const manifest::Manifest& m = plan.manifest;
  Preflight out;
  out.data = make_data_source(m);
  const DataSource* data = out.data.get();
  out.vocab = m.get_int("model.vocab_size") > 0 ? m.get_int("model.vocab_size") : data->vocab_size();
  if (out.vocab < data->vocab_size())
    throw DataError("model.vocab_size = " + std::to_string(out.vocab) + " is smaller than the vocabulary of the data (" +
                    data->describe() + ")");
  const int64_t seq = m.get_int("model.seq_length");
  read_one(*data, Split::Train, seq);
  if (m.get_int("run.eval_every") > 0) read_one(*data, Split::Validation, seq);

  out.memory = plan_memory(plan, out.vocab);
  check_experts(plan, out.memory);
  out.memory_problem = memory_problem(out.memory, device_capacity(plan, ranks_in_process),
                                             plan.device->key(), ranks_in_process);
  return out;
}

}  // namespace loom::train
