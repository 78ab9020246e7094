// layer/moe's shared expert and its sigmoid gate (see shared_expert.hpp).
#include "shared_expert.hpp"

#include "gates.hpp"

#include <cmath>

namespace loom::layers::moe {

SharedExpert::SharedExpert(loom_rank* rank, int64_t hidden, int64_t ffn_local, ExpertActivation activation,
                           bool gated, int tp_rank, int tp_size, const loom::Group& tp)
    : rank_(rank),
      hidden_(hidden),
      ffn_local_(ffn_local),
      activation_(activation),
      gated_(gated),
      tp_rank_(tp_rank),
      tp_size_(tp_size),
      tp_group_(tp) {}

void SharedExpert::forward(const loom::Device& dev, const void* xin, void* saved_h, void* saved_out, void* out,
                           int64_t T, bool accumulate) const {
  if (!gated_) {
    expert_forward(dev, xin, saved_h, out, T, accumulate);
    return;
  }
  const int64_t H = hidden_;
  const int32_t act = act_;
  Arena tmp;
  const size_t raw = tmp.elems(saved_out ? 0 : T * H, act), gated = tmp.elems(T * H, act), gate = tmp.elems(T, act),
               ones = tmp.elems(H, act);
  tmp.allocate(rank_);
  void* ungated = saved_out ? saved_out : tmp.at(raw);
  expert_forward(dev, xin, saved_h, ungated, T, /*accumulate=*/false);
  Arena gate_tmp;
  const size_t logit = gate_tmp.floats(T), sig = gate_tmp.floats(T);
  gate_tmp.allocate(rank_);
  gates(dev, xin, T, gate_tmp.at<float>(logit), gate_tmp.at<float>(sig), tmp.at(gate));
  expand_gates(dev, tmp.at(gate), tmp.at(ones), tmp.at(gated), T, H, act);
  dev.elementwise({.op = LOOM_EW_MUL, .n = T * H, .x = ungated, .y = tmp.at(gated), .out = tmp.at(gated),
                   .dtype = act, .out_dtype = act});
  if (accumulate)
    add(dev, tmp.at(gated), out, out, T * H, act);
  else
    copy_d2d(dev, out, tmp.at(gated), static_cast<size_t>(T * H) * loom::dtype_size(act));
}

loom::Buffer SharedExpert::backward(const loom::Device& dev, const SharedExpertGrads& g, int32_t grad_dtype,
                                    const void* xin, const void* hs, const void* saved_out, const void* d,
                                    void* dxin, int64_t T, bool count_bias, bool accumulate) const {
  if (!gated_) {
    expert_backward(dev, g, grad_dtype, xin, hs, d, dxin, T, count_bias, accumulate);
    return {};
  }
  const int64_t H = hidden_;
  const int32_t act = act_;
  Arena tmp;
  const size_t gate = tmp.elems(T, act), ones = tmp.elems(H, act), scaled = tmp.elems(T * H, act),
               prod = tmp.elems(T * H, act), dgate = tmp.floats(T), logit = tmp.floats(T), sig = tmp.floats(T);
  tmp.allocate(rank_);
  gates(dev, xin, T, tmp.at<float>(logit), tmp.at<float>(sig), tmp.at(gate));
  expand_gates(dev, tmp.at(gate), tmp.at(ones), tmp.at(scaled), T, H, act);
  dev.elementwise({.op = LOOM_EW_MUL, .n = T * H, .x = d, .y = tmp.at(scaled), .out = tmp.at(scaled), .dtype = act,
                   .out_dtype = act});
  expert_backward(dev, g, grad_dtype, xin, hs, tmp.at(scaled), dxin, T, count_bias, accumulate);
  // d gate_t = <d_t, ungated_t>, summed over tp.
  dev.elementwise({.op = LOOM_EW_MUL, .n = T * H, .x = d, .y = const_cast<void*>(saved_out), .out = tmp.at(prod),
                   .dtype = act, .out_dtype = act});
  gemm(dev, false, false, T, 1, H, tmp.at(prod), tmp.at(ones), tmp.at(dgate), 0.0f, act, LOOM_DTYPE_F32);
  if (tp_size_ > 1)
    tp_group_.all_reduce(dev.native_stream(), tmp.at(dgate), tmp.at(dgate), static_cast<size_t>(T), LOOM_DTYPE_F32);
  // d logit = d gate * s (1 - s), on the device (fp32).
  loom::Buffer dlogit(rank_, static_cast<size_t>(T) * sizeof(float));
  dev.sigmoid_bwd({.n = T, .x = tmp.at(logit), .dy = tmp.at(dgate), .out = dlogit.get(), .dtype = LOOM_DTYPE_F32});
  return dlogit;
}

void SharedExpert::gate_input_backward(const loom::Device& dev, const SharedExpertGrads& g, int32_t grad_dtype,
                                       const float* gate_dlogits, int64_t first, int64_t n, const void* ln,
                                       void* dl) const {
  const int64_t H = hidden_;
  const int32_t act = act_;
  Arena tmp;
  const size_t dlr = tmp.elems(n, act);
  tmp.allocate(rank_);
  dev.elementwise({.op = LOOM_EW_CAST, .n = n, .x = gate_dlogits + first, .out = tmp.at(dlr),
                   .dtype = LOOM_DTYPE_F32, .out_dtype = act});
  gemm(dev, true, false, H, 1, n, ln, tmp.at(dlr), g.gate_w, 1.0f, act, grad_dtype);
  gemm(dev, false, false, n, H, 1, tmp.at(dlr), w_.gate_w, dl, 1.0f, act, act);
}

void SharedExpert::expert_forward(const loom::Device& dev, const void* xin, void* saved_h, void* out, int64_t T,
                                  bool accumulate) const {
  const int64_t H = hidden_, Fs = ffn_local_, F1 = fc1_cols();
  const int32_t act = act_;
  Arena tmp;
  const size_t h = tmp.elems(saved_h ? 0 : T * F1, act), a = tmp.elems(T * Fs, act);
  tmp.allocate(rank_);
  void* hs = saved_h ? saved_h : tmp.at(h);
  gemm(dev, false, false, T, F1, H, xin, w_.fc1_w, hs, 0.0f, act, act);
  if (w_.fc1_b) add_bias(dev, hs, w_.fc1_b, hs, T, F1, act);
  activation_.forward(dev, hs, tmp.at(a), T, Fs, act);
  gemm(dev, false, false, T, H, Fs, tmp.at(a), w_.fc2_w, out, accumulate ? 1.0f : 0.0f, act, act);
  if (tp_rank_ == 0 && w_.fc2_b) add_bias(dev, out, w_.fc2_b, out, T, H, act);
}

void SharedExpert::expert_backward(const loom::Device& dev, const SharedExpertGrads& g, int32_t grad_dtype,
                                   const void* xin, const void* hs, const void* d, void* dxin, int64_t T,
                                   bool count_bias, bool accumulate) const {
  const int64_t H = hidden_, Fs = ffn_local_, F1 = fc1_cols();
  const int32_t act = act_, gdt = grad_dtype;
  Arena tmp;
  // dh, fc1's output gradient: da itself under GeLU, twice as wide under SwiGLU.
  const size_t a = tmp.elems(T * Fs, act), da = tmp.elems(T * Fs, act),
               dh_wide = tmp.elems(activation_.swiglu ? T * F1 : 0, act);
  tmp.allocate(rank_);
  void* dh = tmp.at(activation_.swiglu ? dh_wide : da);
  activation_.forward(dev, hs, tmp.at(a), T, Fs, act);
  gemm(dev, true, false, Fs, H, T, tmp.at(a), d, g.fc2_w, 1.0f, act, gdt);
  if (count_bias && g.fc2_b) column_sum_acc(rank_, dev, d, g.fc2_b, T, H, act, gdt);
  gemm(dev, false, true, T, Fs, H, d, w_.fc2_w, tmp.at(da), 0.0f, act, act);
  activation_.backward(dev, hs, tmp.at(da), dh, T, Fs, act);
  gemm(dev, true, false, H, F1, T, xin, dh, g.fc1_w, 1.0f, act, gdt);
  if (g.fc1_b) column_sum_acc(rank_, dev, dh, g.fc1_b, T, F1, act, gdt);
  gemm(dev, false, true, T, H, F1, dh, w_.fc1_w, dxin, accumulate ? 1.0f : 0.0f, act, act);
}

void SharedExpert::gates(const loom::Device& dev, const void* xin, int64_t T, float* logit, float* sig,
                         void* gate) const {
  gemm(dev, false, false, T, 1, hidden_, xin, w_.gate_w, logit, 0.0f, act_, LOOM_DTYPE_F32);
  dev.sigmoid_fwd({.n = T, .x = logit, .out = sig, .dtype = LOOM_DTYPE_F32});
  dev.elementwise({.op = LOOM_EW_CAST, .n = T, .x = sig, .out = gate, .dtype = LOOM_DTYPE_F32, .out_dtype = act_});
}

}  // namespace loom::layers::moe
