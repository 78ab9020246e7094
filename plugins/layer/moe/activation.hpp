// layer/moe: the experts' activation (the layer's `activation` option), shared by the
// routed experts and the shared expert. GeLU on fc1's output h [rows, ffn] (GPT), or
// SwiGLU on h = [gate | up] [rows, 2 ffn]: silu(gate) * up, as Mixtral's and
// Qwen-MoE's experts and Megatron-Core's gated_linear_unit. Either way the
// activation's output a is [rows, ffn], what fc2 reads.
#pragma once

#include <loom/layers/layer_math.hpp>

#include <cstdint>

namespace loom::layers::moe {

struct ExpertActivation {
  bool swiglu = false;

  // fc1's output columns per activation column: its gate and its up projection
  // under SwiGLU (each tp rank holds [its gate | its up], partition_stride 2).
  int64_t parts() const { return swiglu ? 2 : 1; }

  // a [rows, cols] from h [rows, parts() * cols].
  void forward(const loom::Device& dev, const void* h, void* a, int64_t rows, int64_t cols, int32_t dtype) const {
    if (rows == 0) return;
    if (swiglu)
      dev.swiglu_fwd({.rows = rows, .cols = cols, .x = h, .out = a, .dtype = dtype});
    else
      dev.gelu_fwd({.n = rows * cols, .x = h, .out = a, .dtype = dtype});
  }

  // dh [rows, parts() * cols], fc1's output gradient, from da [rows, cols]; dh may
  // be da under GeLU (not under SwiGLU, where it is twice as wide).
  void backward(const loom::Device& dev, const void* h, const void* da, void* dh, int64_t rows, int64_t cols,
                int32_t dtype) const {
    if (rows == 0) return;
    if (swiglu)
      dev.swiglu_bwd({.rows = rows, .cols = cols, .x = h, .dy = da, .out = dh, .dtype = dtype});
    else
      dev.gelu_bwd({.n = rows * cols, .x = h, .dy = da, .out = dh, .dtype = dtype});
  }
};

}  // namespace loom::layers::moe
