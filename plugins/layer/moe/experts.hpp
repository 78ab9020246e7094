// layer/moe's routed experts (Megatron-Core's experts.py, SequentialMLP): MLPs
// fc2(act(fc1 x)), each with its own weights, run per expert on its contiguous rows
// (dispatch.hpp's ExpertRows); act is GeLU, or SwiGLU (Mixtral), where fc1 makes
// the gate and the up projection (activation.hpp), and the biases are optional.
// Under expert tensor parallelism (etp = tp) each expert's fc1 is split by output
// columns (of the gate and of the up projection under SwiGLU) and fc2 by input
// rows, so the outputs are partial sums over tp and fc2's bias is added by tp rank
// 0 only; folded (etp = 1) every rank runs its experts at full width.
#pragma once

#include <loom/layers/layer_math.hpp>
#include "activation.hpp"
#include "dispatch.hpp"

#include <cstdint>

namespace loom::layers::moe {

// This rank's part of the experts' parameters (or of their gradients):
// fc1 [El, H, F1], its bias [El, F1], fc2 [El, Fl, H], its bias [El, H], where
// F1 = Fl, or 2 Fl under SwiGLU; the biases null where the layer has none.
template <typename Ptr>
struct ExpertTensors {
  Ptr fc1_w = nullptr, fc1_b = nullptr, fc2_w = nullptr, fc2_b = nullptr;
};
using ExpertWeights = ExpertTensors<const void*>;
using ExpertGrads = ExpertTensors<void*>;

class Experts {
 public:
  Experts() = default;
  // fold: etp = 1 (whole experts); else the gate gradients are summed over `tp`.
  Experts(loom_rank* rank, int64_t local_experts, int64_t hidden, int64_t ffn_local, ExpertActivation activation,
          bool fold, int tp_rank, const loom::Group& tp);

  void bind(const ExpertWeights& w, int32_t act) {
    w_ = w;
    act_ = act;
  }

  // x [R, H] -> y [R, H] per expert; h [R, F1] keeps fc1's output (before the
  // activation) for the backward, a [R, Fl] is the activation's.
  void forward(const loom::Device& dev, const void* x, void* h, void* a, void* y, const ExpertRows& rows) const;

  // The gate gradients of the rows, <dy_row, fc2 output row>, into dgate [R]
  // (fp32), whole on every tp rank; recomputes the activation's output a from h
  // and leaves da = dy W2^T (fc2's input gradient before the gate) for backward().
  // ones, prod: scratch [max(H, Fl)], [R, Fl] (or more).
  void gate_gradients(const loom::Device& dev, const void* dy, const void* h, void* a, void* da, void* prod,
                      void* ones, float* dgate, const ExpertRows& rows) const;

  // The experts' backward on the gated gradients: dy [R, H] and da [R, Fl] are
  // scaled by the gates [R] in place, the parameters' gradients accumulate into g
  // (fc2's bias when count_bias), and dx [R, H] gets the input gradients. gexp,
  // prod, ones: scratch [R, H], [R, F1], [max(H, Fl)]; dx may be gexp.
  void backward(const loom::Device& dev, const ExpertGrads& g, int32_t grad_dtype, const void* x, void* dy,
                const void* gate, const void* h, const void* a, void* da, void* gexp, void* prod, void* ones,
                void* dx, const ExpertRows& rows, bool count_bias) const;

 private:
  // Whether this rank adds fc2's bias: tp rank 0 when the outputs are partial
  // sums over tp; every rank when the experts are folded (whole width); none
  // without biases.
  bool bias_here() const { return w_.fc2_b != nullptr && (fold_ || tp_rank_ == 0); }
  // fc1's columns on this rank: Fl, or the gate's and the up projection's 2 Fl.
  int64_t fc1_cols() const { return activation_.parts() * ffn_local_; }

  loom_rank* rank_ = nullptr;
  int64_t local_experts_ = 0, hidden_ = 0, ffn_local_ = 0;
  ExpertActivation activation_;
  bool fold_ = false;
  int tp_rank_ = 0;
  loom::Group tp_group_;
  ExpertWeights w_;
  int32_t act_ = LOOM_DTYPE_F32;
};

}  // namespace loom::layers::moe
