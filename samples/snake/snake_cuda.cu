// The Snake kernels on CUDA (see snake_kernels.hpp), launched on the device's native
// stream: a capture of that stream (exec/partial_graph) records them.
#include "snake_kernels.hpp"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace {

__global__ void forward_kernel(SnakeArgs a) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= a.rows * a.cols) return;
  const float al = a.alpha[i % a.cols], s = sinf(al * a.x[i]);
  a.y[i] = a.x[i] + s * s / al;
}

__global__ void backward_kernel(SnakeArgs a) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= a.rows * a.cols) return;
  const float al = a.alpha[i % a.cols], x = a.x[i], dy = a.dy[i];
  const float s = sinf(al * x), s2 = sinf(2.0f * al * x);
  a.dx[i] = dy * (1.0f + s2);
  a.dalpha_rows[i] = dy * (x * s2 / al - s * s / (al * al));
}

constexpr int kThreads = 256;

void launched(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string("layer/snake: ") + what + ": " + cudaGetErrorString(e));
}

unsigned blocks(const SnakeArgs& a) { return static_cast<unsigned>((a.rows * a.cols + kThreads - 1) / kThreads); }

}  // namespace

void snake_forward_cuda(void* stream, const SnakeArgs& a) {
  if (a.rows * a.cols == 0) return;
  forward_kernel<<<blocks(a), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  launched("forward kernel");
}

void snake_backward_cuda(void* stream, const SnakeArgs& a) {
  if (a.rows * a.cols == 0) return;
  backward_kernel<<<blocks(a), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(a);
  launched("backward kernel");
}
