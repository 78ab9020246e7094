// layer/moe's token dispatch (Megatron-Core's token_dispatcher.py): a Routing's
// kept slots as dispatch rows in expert-major order, the device's row gather that
// permutes token rows into that order and combines them back per token, and the
// expert-parallel service (parallel.expert: all-to-all, or all-gather +
// reduce-scatter) that moves the rows to their experts' ep ranks and back.
#pragma once

#include <loom/layers/layer_math.hpp>
#include "router.hpp"

#include <loom/cpp/expert_parallel.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace loom::layers::moe {

// The dispatch rows of a routing: its kept slots, expert-major, tokens in order
// within each expert.
struct Dispatch {
  int64_t tokens = 0, experts = 0, top_k = 0;
  std::vector<int32_t> row_token;  // dispatch row -> token
  std::vector<int32_t> row_slot;   // dispatch row -> its slot (t * top_k + k)
  std::vector<int32_t> slot_row;   // [top_k, tokens]: the dispatch row of slot (t, k) at k * tokens + t
  std::vector<float> row_gate;     // dispatch row -> gate
  std::vector<int64_t> offset;     // [experts + 1]: first dispatch row of each expert
  // Dispatch rows (the kept slots): tokens * top_k without a capacity drop. A
  // dropped slot's slot_row is rows(), a zero row after the real ones.
  int64_t rows() const { return offset[static_cast<size_t>(experts)]; }
  int64_t slots() const { return tokens * top_k; }
  bool dropped_any() const { return rows() < slots(); }
};

Dispatch dispatch_rows(const Routing& r);

// The dispatch of this rank's tokens within a routing of more (a tp rank's
// sequence shard under MoE folding, a cp rank's chunks under context
// parallelism): token i of this rank is token mine[i] of `d`. Its rows in the
// same expert-major order, with token ids and slots local to this rank.
Dispatch shard_of(const Dispatch& d, const std::vector<int64_t>& mine);

// The gates' gradients [tokens, top_k] of the router's `tokens` tokens from the
// dispatch rows' (row_dgate), 0 for a dropped slot: router token i is dispatch
// token first + i (every router token is among the dispatched ones, whose slots
// it shares).
std::vector<double> slot_gate_gradients(const Dispatch& d, const std::vector<float>& row_dgate, int64_t first,
                                        int64_t tokens);

// The rows this rank's experts process, expert-major: the dispatch rows
// themselves (ep = 1), or what the expert-parallel service delivers (ep > 1).
struct ExpertRows {
  int64_t rows = 0;             // R
  std::vector<int64_t> offset;  // [local experts + 1]: first row of each
  int64_t count(int64_t le) const { return offset[le + 1] - offset[le]; }
};

// Moves dispatch rows to this rank's experts and back: in place with ep = 1,
// through the expert-parallel service with ep > 1, which keeps each
// microbatch's exchange plan until release.
class TokenDispatcher {
 public:
  TokenDispatcher() = default;
  TokenDispatcher(loom_rank* rank, const loom::Group& ep, int64_t experts, const std::string& name);

  // Whether rows leave this rank (ep > 1).
  bool moves_rows() const { return ep_ > 1; }
  // Where this rank's experts get their rows (the counts exchanged over ep).
  ExpertRows plan(const loom::Device& dev, const Dispatch& d, int32_t microbatch) const;
  // rows [N, w] in dispatch order -> out [R, w] at this rank's experts, expert-major.
  void to_experts(const loom::Device& dev, int32_t microbatch, const void* rows, void* out, int64_t w,
                  int32_t dtype) const;
  // The inverse: rows [R, w] at this rank's experts -> out [N, w] in dispatch order.
  void from_experts(const loom::Device& dev, int32_t microbatch, const void* rows, void* out, int64_t w,
                    int32_t dtype) const;
  void release(int32_t microbatch) { ep_service_.release(microbatch); }

 private:
  int64_t ep_ = 1;
  loom::ExpertParallel ep_service_;  // open when ep > 1
};

// The dispatch order's token ids (int32), each slot's row (int32) and the gates
// (activation dtype) to the device.
void upload_dispatch(loom_rank* rank, const loom::Device& dev, const Dispatch& d, int32_t* tok, int32_t* slot_row,
                     void* gate, int32_t act);

// out [rows, H] = table [table_rows, H] at ids (the device's embedding gather).
void gather_rows(const loom::Device& dev, const void* table, const int32_t* ids, void* out, int64_t rows,
                 int64_t table_rows, int64_t H, int32_t act);

// out [T, H] = sum over k of rows [N, H] at slot_row[k] (the device's gather with
// accumulate, slot 0 first): every token's top_k rows added in one fixed order,
// so the result does not depend on thread scheduling (a scatter-add by atomics
// would, from three rows per token on).
// rows_in has `rows` rows: the N dispatch rows, and a zero row after them when a
// capacity drop left slots without one.
void combine_rows(const loom::Device& dev, const void* rows_in, int64_t rows, const int32_t* slot_row, void* out,
                  int64_t T, int64_t H, int64_t top_k, int32_t act);

// Row `row` of rows [.., H] to zeros: what a dropped slot combines.
void fill_zero_row(const loom::Device& dev, void* rows, int64_t row, int64_t H, int32_t act);

// The experts' output rows y [N, H] (dispatch order, room for the zero row after
// them) times their gates [N] (ones, gexp: scratch [H], [N, H]), then combined
// per token into out [T, H].
void combine_gated(const loom::Device& dev, void* y, const void* gate, void* ones, void* gexp, const Dispatch& d,
                   const int32_t* slot_row, void* out, int64_t T, int64_t H, int32_t act);

}  // namespace loom::layers::moe
