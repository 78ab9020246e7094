// Element types and the in-order reduction kernel shared by the CPU comm plugins
// (comm/local and comm/mpi), so both reduce bit-identically.
//
// Determinism contract: for every element i, the result is
//   acc = in[0][i]; acc = acc (op) in[1][i]; ...; acc = acc (op) in[n-1][i]
// in exactly that order (group-rank order), then AVG divides by n. So a
// floating-point SUM equals a serial loop that adds the ranks in order.
//   - F32 and F64 accumulate in their own type (no widening, no reassociation).
//   - BF16 and F16 accumulate in float and round once at the end.
//   - Integers (I32, I64, U8) wrap on overflow (two's complement); AVG truncates
//     toward zero.
//   - MAX and MIN propagate NaN: once an input is NaN the result is NaN.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace loom::comm_common {

// "f32", "bf16", ... or "dtype#<n>".
std::string dtype_name(int32_t dtype);
// "sum", "max", ... or "op#<n>".
std::string reduce_name(int32_t op);
// True when `dtype` and `op` are supported by reduce_into.
bool reducible(int32_t dtype, int32_t op);

// out[i] = in[0][i] (op) in[1][i] (op) ... (op) in[n-1][i], i in [0, len), in that
// order. `out` must not alias any input. Requires reducible(dtype, op) and n >= 1.
void reduce_into(void* out, const void* const* in, int n, size_t len, int32_t dtype, int32_t op);

}  // namespace loom::comm_common
