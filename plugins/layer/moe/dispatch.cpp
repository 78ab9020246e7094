// layer/moe's token dispatch (see dispatch.hpp).
#include "dispatch.hpp"

#include "gates.hpp"

namespace loom::layers::moe {

Dispatch dispatch_rows(const Routing& r) {
  const int64_t tokens = r.tokens, experts = r.experts, top_k = r.top_k;
  Dispatch d;
  d.tokens = tokens;
  d.experts = experts;
  d.top_k = top_k;
  d.offset.assign(static_cast<size_t>(experts + 1), 0);
  for (int64_t e = 0; e < experts; ++e) d.offset[e + 1] = d.offset[e] + r.kept_slots[static_cast<size_t>(e)];
  const int64_t n = d.rows();
  d.row_token.resize(static_cast<size_t>(n));
  d.row_slot.resize(static_cast<size_t>(n));
  d.row_gate.resize(static_cast<size_t>(n));
  d.slot_row.assign(static_cast<size_t>(tokens * top_k), static_cast<int32_t>(n));  // dropped: the zero row
  std::vector<int64_t> next(d.offset.begin(), d.offset.end() - 1);
  for (int64_t t = 0; t < tokens; ++t)  // tokens in order within each expert
    for (int64_t k = 0; k < top_k; ++k) {
      const int64_t slot = t * top_k + k;
      if (!r.kept[static_cast<size_t>(slot)]) continue;
      const int64_t row = next[static_cast<size_t>(r.chosen[static_cast<size_t>(slot)])]++;
      d.row_token[static_cast<size_t>(row)] = static_cast<int32_t>(t);
      d.row_slot[static_cast<size_t>(row)] = static_cast<int32_t>(slot);
      d.slot_row[static_cast<size_t>(k * tokens + t)] = static_cast<int32_t>(row);
      d.row_gate[static_cast<size_t>(row)] = r.slot_gate[static_cast<size_t>(slot)];
    }
  return d;
}

Dispatch shard_of(const Dispatch& d, const std::vector<int64_t>& mine) {
  const int64_t n = static_cast<int64_t>(mine.size()), top_k = d.top_k;
  std::vector<int64_t> local_of(static_cast<size_t>(d.tokens), -1);  // token of d -> this rank's, or -1
  for (int64_t i = 0; i < n; ++i) local_of[static_cast<size_t>(mine[static_cast<size_t>(i)])] = i;
  Dispatch s;
  s.tokens = n;
  s.experts = d.experts;
  s.top_k = top_k;
  s.offset.assign(static_cast<size_t>(d.experts + 1), 0);
  for (int64_t e = 0; e < d.experts; ++e)
    for (int64_t row = d.offset[static_cast<size_t>(e)]; row < d.offset[static_cast<size_t>(e) + 1]; ++row) {
      const int64_t t = local_of[static_cast<size_t>(d.row_token[static_cast<size_t>(row)])];
      if (t < 0) continue;
      const int32_t slot = d.row_slot[static_cast<size_t>(row)];
      ++s.offset[static_cast<size_t>(e) + 1];
      s.row_token.push_back(static_cast<int32_t>(t));
      s.row_slot.push_back(static_cast<int32_t>(t * top_k + slot % top_k));
      s.row_gate.push_back(d.row_gate[static_cast<size_t>(row)]);
    }
  for (int64_t e = 0; e < d.experts; ++e) s.offset[e + 1] += s.offset[e];
  const int64_t rows = s.rows();
  s.slot_row.assign(static_cast<size_t>(n * top_k), static_cast<int32_t>(rows));  // dropped: the zero row
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t slot = s.row_slot[static_cast<size_t>(i)];
    s.slot_row[static_cast<size_t>((slot % top_k) * n + slot / top_k)] = static_cast<int32_t>(i);
  }
  return s;
}

std::vector<double> slot_gate_gradients(const Dispatch& d, const std::vector<float>& row_dgate, int64_t first,
                                        int64_t tokens) {
  const int64_t K = d.top_k;
  std::vector<double> slot_dgate(static_cast<size_t>(tokens * K), 0.0);  // 0 for a dropped slot
  for (int64_t row = 0; row < d.rows(); ++row) {
    const int64_t t = d.row_token[static_cast<size_t>(row)] - first;
    if (t >= 0 && t < tokens)
      slot_dgate[static_cast<size_t>(t * K + d.row_slot[static_cast<size_t>(row)] % K)] =
          row_dgate[static_cast<size_t>(row)];
  }
  return slot_dgate;
}

TokenDispatcher::TokenDispatcher(loom_rank* rank, const loom::Group& ep, int64_t experts, const std::string& name)
    : ep_(std::max(1, ep.size())) {
  if (ep_ > 1) ep_service_ = loom::ExpertParallel(rank, ep.raw(), experts, name);
}

ExpertRows TokenDispatcher::plan(const loom::Device& dev, const Dispatch& d, int32_t microbatch) const {
  if (ep_ == 1) return {d.rows(), d.offset};
  std::vector<int64_t> local = ep_service_.plan(dev.native_stream(), microbatch, d.offset);
  return {local.back(), std::move(local)};
}

void TokenDispatcher::to_experts(const loom::Device& dev, int32_t microbatch, const void* rows, void* out, int64_t w,
                                 int32_t dtype) const {
  ep_service_.dispatch(dev.native_stream(), microbatch, rows, out, w, dtype);
}

void TokenDispatcher::from_experts(const loom::Device& dev, int32_t microbatch, const void* rows, void* out,
                                   int64_t w, int32_t dtype) const {
  ep_service_.combine(dev.native_stream(), microbatch, rows, out, w, dtype);
}

void upload_dispatch(loom_rank* rank, const loom::Device& dev, const Dispatch& d, int32_t* tok, int32_t* slot_row,
                     void* gate, int32_t act) {
  const int64_t N = d.rows();
  dev.copy(tok, d.row_token.data(), static_cast<size_t>(N) * sizeof(int32_t), LOOM_COPY_HOST_TO_DEVICE);
  dev.copy(slot_row, d.slot_row.data(), d.slot_row.size() * sizeof(int32_t), LOOM_COPY_HOST_TO_DEVICE);
  upload_values(rank, dev, d.row_gate, gate, act);
}

void gather_rows(const loom::Device& dev, const void* table, const int32_t* ids, void* out, int64_t rows,
                 int64_t table_rows, int64_t H, int32_t act) {
  dev.embedding_fwd({.n = rows, .dim = H, .vocab_rows = table_rows, .vocab_start = 0, .ids = ids, .table = table,
                     .out = out, .dtype = act});
}

void combine_rows(const loom::Device& dev, const void* rows_in, int64_t rows, const int32_t* slot_row, void* out,
                  int64_t T, int64_t H, int64_t top_k, int32_t act) {
  for (int64_t k = 0; k < top_k; ++k)
    dev.embedding_fwd({.n = T, .dim = H, .vocab_rows = rows, .vocab_start = 0, .ids = slot_row + k * T,
                       .table = rows_in, .out = out, .accumulate = k > 0 ? 1 : 0, .dtype = act});
}

void fill_zero_row(const loom::Device& dev, void* rows, int64_t row, int64_t H, int32_t act) {
  fill_zero(dev, advance(rows, row * H, act), H, act);
}

void combine_gated(const loom::Device& dev, void* y, const void* gate, void* ones, void* gexp, const Dispatch& d,
                   const int32_t* slot_row, void* out, int64_t T, int64_t H, int32_t act) {
  const int64_t N = d.rows(), zero_row = d.dropped_any() ? 1 : 0;
  expand_gates(dev, gate, ones, gexp, N, H, act);
  dev.elementwise({.op = LOOM_EW_MUL, .n = N * H, .x = y, .y = gexp, .out = y, .dtype = act, .out_dtype = act});
  if (zero_row) fill_zero_row(dev, y, N, H, act);
  combine_rows(dev, y, N + zero_row, slot_row, out, T, H, d.top_k, act);
}

}  // namespace loom::layers::moe
