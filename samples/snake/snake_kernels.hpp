// The Snake activation's kernels (Ziyin, Hartwig and Ueda, "Neural Networks Fail to
// Learn Periodic Functions and How to Fix It", NeurIPS 2020; BigVGAN uses it with a
// learned frequency per channel):
//   y = x + sin(a x)^2 / a                              a = alpha[c], per channel
//   dx = dy (1 + sin(2 a x))
//   dalpha = sum over rows of dy (x sin(2 a x) / a - sin(a x)^2 / a^2)
// One version for the CPU (a host task, snake_cpu.cpp) and one for CUDA
// (snake_cuda.cu), fp32, on [rows, cols] row-major tensors.
#pragma once

#include <cstdint>

struct SnakeArgs {
  int64_t rows = 0, cols = 0;
  const float* x = nullptr;       // [rows, cols]
  const float* alpha = nullptr;   // [cols]
  const float* dy = nullptr;      // [rows, cols] (backward)
  float* y = nullptr;             // [rows, cols] (forward)
  float* dx = nullptr;            // [rows, cols] (backward)
  float* dalpha_rows = nullptr;   // [rows, cols] (backward): each row's part of dalpha
};

// CPU: called as host tasks (loom::Device::host_task), so a capture records them.
void snake_forward_cpu(SnakeArgs* a);
void snake_backward_cpu(SnakeArgs* a);

#ifdef SNAKE_WITH_CUDA
// CUDA: launched on `stream` (a cudaStream_t: the device's native stream).
void snake_forward_cuda(void* stream, const SnakeArgs& a);
void snake_backward_cuda(void* stream, const SnakeArgs& a);
#endif
