// layer/moe's routed experts (see experts.hpp).
#include "experts.hpp"

#include "gates.hpp"

#include <algorithm>

namespace loom::layers::moe {

namespace {

// fn(e, r0, n) for each local expert e with rows [r0, r0 + n), n > 0.
template <typename Fn>
void for_each_expert(int64_t local_experts, const ExpertRows& rows, Fn&& fn) {
  for (int64_t e = 0; e < local_experts; ++e) {
    const int64_t n = rows.count(e), r0 = rows.offset[static_cast<size_t>(e)];
    if (n == 0) continue;
    fn(e, r0, n);
  }
}

}  // namespace

Experts::Experts(loom_rank* rank, int64_t local_experts, int64_t hidden, int64_t ffn_local,
                 ExpertActivation activation, bool fold, int tp_rank, const loom::Group& tp)
    : rank_(rank),
      local_experts_(local_experts),
      hidden_(hidden),
      ffn_local_(ffn_local),
      activation_(activation),
      fold_(fold),
      tp_rank_(tp_rank),
      tp_group_(tp) {}

void Experts::forward(const loom::Device& dev, const void* x, void* h, void* a, void* y,
                      const ExpertRows& rows) const {
  const int64_t H = hidden_, Fl = ffn_local_, F1 = fc1_cols(), R = rows.rows;
  const int32_t act = act_;
  for_each_expert(local_experts_, rows, [&](int64_t e, int64_t r0, int64_t n) {
    void* he = advance(h, r0 * F1, act);
    gemm(dev, false, false, n, F1, H, advance(x, r0 * H, act), advance(w_.fc1_w, e * H * F1, act), he, 0.0f, act,
         act);
    if (w_.fc1_b) add_bias(dev, he, advance(w_.fc1_b, e * F1, act), he, n, F1, act);
  });
  activation_.forward(dev, h, a, R, Fl, act);
  // fc2 (+ its bias where this rank adds it: the outputs are partial sums over tp).
  for_each_expert(local_experts_, rows, [&](int64_t e, int64_t r0, int64_t n) {
    void* ye = advance(y, r0 * H, act);
    gemm(dev, false, false, n, H, Fl, advance(a, r0 * Fl, act), advance(w_.fc2_w, e * Fl * H, act), ye, 0.0f, act,
         act);
    if (bias_here()) add_bias(dev, ye, advance(w_.fc2_b, e * H, act), ye, n, H, act);
  });
}

// The gate's gradient is <dy_row, fc2 output row> = <da_u_row, act_row> + <dy_row,
// b2>, act the activation's output (GeLU's, or SwiGLU's silu(gate) * up): no second
// fc2 forward. Partial over tp (each rank holds Fl of the ffn, and the bias term is
// rank 0's), so summed over tp; whole where the experts are folded.
void Experts::gate_gradients(const loom::Device& dev, const void* dy, const void* h, void* a, void* da, void* prod,
                             void* ones, float* dgate, const ExpertRows& rows) const {
  const int64_t H = hidden_, Fl = ffn_local_, R = rows.rows;
  const int32_t act = act_;
  activation_.forward(dev, h, a, R, Fl, act);
  // fc2's input gradient before the gate, da_u = dy_row W2^T.
  for_each_expert(local_experts_, rows, [&](int64_t e, int64_t r0, int64_t n) {
    gemm(dev, false, true, n, Fl, H, advance(dy, r0 * H, act), advance(w_.fc2_w, e * Fl * H, act),
         advance(da, r0 * Fl, act), 0.0f, act, act);
  });
  dev.elementwise({.op = LOOM_EW_FILL, .n = std::max(H, Fl), .out = ones, .alpha = 1.f, .dtype = act,
                   .out_dtype = act});
  if (R > 0) {
    dev.elementwise({.op = LOOM_EW_MUL, .n = R * Fl, .x = da, .y = a, .out = prod, .dtype = act, .out_dtype = act});
    gemm(dev, false, false, R, 1, Fl, prod, ones, dgate, 0.0f, act, LOOM_DTYPE_F32);
  }
  if (bias_here())
    for_each_expert(local_experts_, rows, [&](int64_t e, int64_t r0, int64_t n) {
      gemm(dev, false, false, n, 1, H, advance(dy, r0 * H, act), advance(w_.fc2_b, e * H, act), dgate + r0, 1.0f,
           act, LOOM_DTYPE_F32);
    });
  // Every tp rank of the group has the same R (its ep peers route as its tp peers').
  if (R > 0 && !fold_)
    tp_group_.all_reduce(dev.native_stream(), dgate, dgate, static_cast<size_t>(R), LOOM_DTYPE_F32);
}

void Experts::backward(const loom::Device& dev, const ExpertGrads& g, int32_t grad_dtype, const void* x, void* dy,
                       const void* gate, const void* h, const void* a, void* da, void* gexp, void* prod, void* ones,
                       void* dx, const ExpertRows& rows, bool count_bias) const {
  const int64_t H = hidden_, Fl = ffn_local_, F1 = fc1_cols(), R = rows.rows;
  const int32_t act = act_, gdt = grad_dtype;
  // fc2's weight and bias gradients from gate * dy.
  if (R > 0) {
    expand_gates(dev, gate, ones, gexp, R, H, act);
    dev.elementwise({.op = LOOM_EW_MUL, .n = R * H, .x = dy, .y = gexp, .out = dy, .dtype = act, .out_dtype = act});
  }
  for_each_expert(local_experts_, rows, [&](int64_t e, int64_t r0, int64_t n) {
    const void* dy_e = advance(dy, r0 * H, act);
    gemm(dev, true, false, Fl, H, n, advance(a, r0 * Fl, act), dy_e, advance(g.fc2_w, e * Fl * H, gdt), 1.0f, act,
         gdt);
    if (count_bias && g.fc2_b) column_sum_acc(rank_, dev, dy_e, advance(g.fc2_b, e * H, gdt), n, H, act, gdt);
  });
  // fc1's output gradient dh from gate * da_u, through the activation: in place
  // under GeLU, into prod (free again) under SwiGLU, where it is twice as wide.
  void* dh = activation_.swiglu ? prod : da;
  if (R > 0) {
    expand_gates(dev, gate, ones, prod, R, Fl, act);
    dev.elementwise({.op = LOOM_EW_MUL, .n = R * Fl, .x = da, .y = prod, .out = da, .dtype = act, .out_dtype = act});
  }
  activation_.backward(dev, h, da, dh, R, Fl, act);
  for_each_expert(local_experts_, rows, [&](int64_t e, int64_t r0, int64_t n) {
    const void* dhe = advance(dh, r0 * F1, act);
    gemm(dev, true, false, H, F1, n, advance(x, r0 * H, act), dhe, advance(g.fc1_w, e * H * F1, gdt), 1.0f, act,
         gdt);
    if (g.fc1_b) column_sum_acc(rank_, dev, dhe, advance(g.fc1_b, e * F1, gdt), n, F1, act, gdt);
    gemm(dev, false, true, n, H, F1, dhe, advance(w_.fc1_w, e * H * F1, act), advance(dx, r0 * H, act), 0.0f, act,
         act);
  });
}

}  // namespace loom::layers::moe
