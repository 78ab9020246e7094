// layer/moe: per-row gates on the device, shared by the dispatch (the router's
// gates), the experts' backward and the shared expert's sigmoid gate. The router's
// gates are decided on the host and uploaded in the activation dtype; the shared
// expert's are computed on the device (sigmoid_fwd, ABI 1.10). Either is broadcast
// across a row's columns by a k = 1 GEMM so that rows can be scaled elementwise.
#pragma once

#include <loom/layers/layer_math.hpp>

#include <vector>

namespace loom::layers::moe {

// Host values to the device in the activation dtype `act`.
inline void upload_values(loom_rank* rank, const loom::Device& dev, const std::vector<float>& v, void* out,
                          int32_t act) {
  const int64_t n = static_cast<int64_t>(v.size());
  if (act == LOOM_DTYPE_F32) {
    dev.copy(out, v.data(), v.size() * sizeof(float), LOOM_COPY_HOST_TO_DEVICE);
    return;
  }
  Arena wide;
  const size_t g = wide.floats(n);
  wide.allocate(rank);
  dev.copy(wide.at(g), v.data(), v.size() * sizeof(float), LOOM_COPY_HOST_TO_DEVICE);
  dev.elementwise({.op = LOOM_EW_CAST, .n = n, .x = wide.at(g), .out = out, .dtype = LOOM_DTYPE_F32,
                   .out_dtype = act});
}

// out [N, width] = gate [N, 1] x ones [1, width]: each row's gate across its columns.
inline void expand_gates(const loom::Device& dev, const void* gate, void* ones, void* out, int64_t N, int64_t width,
                         int32_t act) {
  dev.elementwise({.op = LOOM_EW_FILL, .n = width, .out = ones, .alpha = 1.f, .dtype = act, .out_dtype = act});
  gemm(dev, false, false, N, width, 1, gate, ones, out, 0.0f, act, act);
}

}  // namespace loom::layers::moe
