// The Snake kernels on the CPU (see snake_kernels.hpp).
#include "snake_kernels.hpp"

#include <cmath>

void snake_forward_cpu(SnakeArgs* a) {
  for (int64_t r = 0; r < a->rows; ++r)
    for (int64_t c = 0; c < a->cols; ++c) {
      const int64_t i = r * a->cols + c;
      const float al = a->alpha[c], s = std::sin(al * a->x[i]);
      a->y[i] = a->x[i] + s * s / al;
    }
}

void snake_backward_cpu(SnakeArgs* a) {
  for (int64_t r = 0; r < a->rows; ++r)
    for (int64_t c = 0; c < a->cols; ++c) {
      const int64_t i = r * a->cols + c;
      const float al = a->alpha[c], x = a->x[i], dy = a->dy[i];
      const float s = std::sin(al * x), s2 = std::sin(2.0f * al * x);
      a->dx[i] = dy * (1.0f + s2);
      a->dalpha_rows[i] = dy * (x * s2 / al - s * s / (al * al));
    }
}
