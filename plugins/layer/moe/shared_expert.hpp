// layer/moe's shared expert (Megatron-Core's shared_experts.py,
// moe_shared_expert_intermediate_size): an MLP of width
// shared_expert_ffn_hidden_size with the routed experts' activation (GeLU, or
// SwiGLU as Qwen-MoE's) and biases (optional), on every token of the TP region,
// beside the routed experts on the same norm output, split over tp like the MLP
// (fc1 by columns, of the gate and of the up projection under SwiGLU; fc2 by rows;
// fc2's bias on tp rank 0), so its output is a partial sum over tp. Optionally gated (shared_expert_gate, Megatron's
// moe_shared_expert_gate, Qwen2-MoE): each token's row times sigmoid(x_t . w_gate),
// w_gate a [hidden] weight duplicated over tp.
#pragma once

#include <loom/layers/layer_math.hpp>
#include "activation.hpp"

#include <cstdint>
#include <vector>

namespace loom::layers::moe {

// This rank's part of the shared expert's parameters (or of their gradients):
// fc1 [H, F1], its bias [F1] (F1 = Fs/tp, or twice that under SwiGLU), fc2
// [Fs/tp, H], its bias [H], the gate [H]; what the layer's options leave out null.
template <typename Ptr>
struct SharedExpertTensors {
  Ptr fc1_w = nullptr, fc1_b = nullptr, fc2_w = nullptr, fc2_b = nullptr, gate_w = nullptr;
};
using SharedExpertWeights = SharedExpertTensors<const void*>;
using SharedExpertGrads = SharedExpertTensors<void*>;

class SharedExpert {
 public:
  SharedExpert() = default;
  // ffn_local: this tp rank's part of the width; gated: shared_expert_gate.
  SharedExpert(loom_rank* rank, int64_t hidden, int64_t ffn_local, ExpertActivation activation, bool gated,
               int tp_rank, int tp_size, const loom::Group& tp);

  void bind(const SharedExpertWeights& w, int32_t act) {
    w_ = w;
    act_ = act;
  }

  // out [T, H] (+= when accumulate) = the shared expert on xin [T, H], partial over
  // tp; gated, each row times its gate (the row scaling commutes with the tp sum).
  // saved_h (training) keeps fc1's output [T, F1] for the backward; saved_out
  // (training, gated) the ungated rows for the gate's gradient.
  void forward(const loom::Device& dev, const void* xin, void* saved_h, void* saved_out, void* out, int64_t T,
               bool accumulate) const;

  // The backward from the TP region's output gradient d [T, H]: the parameters'
  // gradients into g, and dxin [T, H] (+= when accumulate) its input gradient
  // (partial over tp, summed by the layer's f backward). count_bias: this rank
  // adds fc2's bias gradient. Gated, d reaches the expert scaled by the gates and
  // the result is the gate logits' gradients of the T tokens (device memory, fp32 [T];
  // the ungated rows are partial over tp, so their dot products are summed over tp);
  // empty when ungated.
  loom::Buffer backward(const loom::Device& dev, const SharedExpertGrads& g, int32_t grad_dtype,
                              const void* xin, const void* hs, const void* saved_out, const void* d, void* dxin,
                              int64_t T, bool count_bias, bool accumulate) const;

  // The gate's weight gradient and dl [n, H] += its input gradient, on the n rows
  // this rank holds (ln [n, H]: its shard under SP, where the engine sums the
  // duplicated weight's gradient over tp), from the gate logits' gradients of the
  // TP region's tokens (backward's result), this rank's from `first`.
  void gate_input_backward(const loom::Device& dev, const SharedExpertGrads& g, int32_t grad_dtype,
                           const float* gate_dlogits, int64_t first, int64_t n, const void* ln, void* dl) const;

 private:
  void expert_forward(const loom::Device& dev, const void* xin, void* saved_h, void* out, int64_t T,
                      bool accumulate) const;
  void expert_backward(const loom::Device& dev, const SharedExpertGrads& g, int32_t grad_dtype, const void* xin,
                       const void* hs, const void* d, void* dxin, int64_t T, bool count_bias, bool accumulate) const;
  // The gates of the T rows of xin, on the device: logit [T] = xin . w (fp32),
  // sig = sigmoid(logit) (fp32) and gate = sig in the activation dtype.
  void gates(const loom::Device& dev, const void* xin, int64_t T, float* logit, float* sig, void* gate) const;

  // fc1's columns on this rank (its part of the gate's and the up projection's under SwiGLU).
  int64_t fc1_cols() const { return activation_.parts() * ffn_local_; }

  loom_rank* rank_ = nullptr;
  int64_t hidden_ = 0, ffn_local_ = 0;
  ExpertActivation activation_;
  bool gated_ = false;
  int tp_rank_ = 0, tp_size_ = 1;
  loom::Group tp_group_;
  SharedExpertWeights w_;
  int32_t act_ = LOOM_DTYPE_F32;
};

}  // namespace loom::layers::moe
