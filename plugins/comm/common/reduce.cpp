#include "reduce.hpp"

#include <loom/cpp/core.hpp>

#include <cmath>
#include <cstring>
#include <type_traits>

namespace loom::comm_common {
namespace {

// ---- storage types and how they load into / store from the accumulator ----

template <typename T>
struct Native {  // accumulate in the storage type itself
  using Storage = T;
  using Acc = T;
  static Acc load(Storage v) { return v; }
  static Storage store(Acc a) { return a; }
};

struct BF16 {  // bfloat16 stored as its bit pattern, accumulated in float
  using Storage = uint16_t;
  using Acc = float;
  static Acc load(Storage h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  static Storage store(Acc f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    if (std::isnan(f)) return static_cast<Storage>((u >> 16) | 0x40u);  // stay a (quiet) NaN
    u += 0x7fffu + ((u >> 16) & 1u);                                      // round to nearest even
    return static_cast<Storage>(u >> 16);
  }
};

#if defined(__FLT16_MAX__)
#define LOOM_COMM_HAVE_F16 1
struct F16 {  // IEEE half, accumulated in float; the compiler does the rounding
  using Storage = uint16_t;
  using Acc = float;
  static Acc load(Storage h) {
    _Float16 v;
    std::memcpy(&v, &h, sizeof v);
    return static_cast<float>(v);
  }
  static Storage store(Acc f) {
    _Float16 v = static_cast<_Float16>(f);
    Storage h;
    std::memcpy(&h, &v, sizeof h);
    return h;
  }
};
#else
#define LOOM_COMM_HAVE_F16 0
#endif

// ---- the combining step, acc = acc (op) v ----

template <typename A>
A add(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;  // wrap instead of signed-overflow UB
    return static_cast<A>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}
template <typename A>
A max_of(A a, A b) {
  if constexpr (std::is_floating_point_v<A>) {
    if (std::isnan(a)) return a;
    if (std::isnan(b)) return b;
  }
  return b > a ? b : a;
}
template <typename A>
A min_of(A a, A b) {
  if constexpr (std::is_floating_point_v<A>) {
    if (std::isnan(a)) return a;
    if (std::isnan(b)) return b;
  }
  return b < a ? b : a;
}
template <typename A>
A divide(A a, int n) {
  if constexpr (std::is_integral_v<A>) {
    return static_cast<A>(static_cast<int64_t>(a) / static_cast<int64_t>(n));
  } else {
    return a / static_cast<A>(n);
  }
}

constexpr size_t kBlock = 2048;  // elements per pass; the accumulator lives on the stack

template <typename Tr, int32_t Op>
void reduce_typed(void* out_v, const void* const* in_v, int n, size_t len) {
  using S = typename Tr::Storage;
  using A = typename Tr::Acc;
  S* out = static_cast<S*>(out_v);
  A acc[kBlock];
  for (size_t base = 0; base < len; base += kBlock) {
    const size_t m = len - base < kBlock ? len - base : kBlock;
    const S* first = static_cast<const S*>(in_v[0]) + base;
    for (size_t i = 0; i < m; ++i) acc[i] = Tr::load(first[i]);
    for (int j = 1; j < n; ++j) {  // ranks in group order, for every element
      const S* src = static_cast<const S*>(in_v[j]) + base;
      for (size_t i = 0; i < m; ++i) {
        if constexpr (Op == LOOM_REDUCE_SUM || Op == LOOM_REDUCE_AVG) {
          acc[i] = add<A>(acc[i], Tr::load(src[i]));
        } else if constexpr (Op == LOOM_REDUCE_MAX) {
          acc[i] = max_of<A>(acc[i], Tr::load(src[i]));
        } else {
          acc[i] = min_of<A>(acc[i], Tr::load(src[i]));
        }
      }
    }
    if constexpr (Op == LOOM_REDUCE_AVG) {
      for (size_t i = 0; i < m; ++i) acc[i] = divide<A>(acc[i], n);
    }
    for (size_t i = 0; i < m; ++i) out[base + i] = Tr::store(acc[i]);
  }
}

template <typename Tr>
void reduce_op(void* out, const void* const* in, int n, size_t len, int32_t op) {
  switch (op) {
    case LOOM_REDUCE_SUM: return reduce_typed<Tr, LOOM_REDUCE_SUM>(out, in, n, len);
    case LOOM_REDUCE_MAX: return reduce_typed<Tr, LOOM_REDUCE_MAX>(out, in, n, len);
    case LOOM_REDUCE_MIN: return reduce_typed<Tr, LOOM_REDUCE_MIN>(out, in, n, len);
    case LOOM_REDUCE_AVG: return reduce_typed<Tr, LOOM_REDUCE_AVG>(out, in, n, len);
    default: return;
  }
}

}  // namespace

std::string dtype_name(int32_t dtype) {
  switch (dtype) {
    case LOOM_DTYPE_F32: return "f32";
    case LOOM_DTYPE_F64: return "f64";
    case LOOM_DTYPE_BF16: return "bf16";
    case LOOM_DTYPE_F16: return "f16";
    case LOOM_DTYPE_I32: return "i32";
    case LOOM_DTYPE_I64: return "i64";
    case LOOM_DTYPE_U8: return "u8";
    default: return "dtype#" + std::to_string(dtype);
  }
}

std::string reduce_name(int32_t op) {
  switch (op) {
    case LOOM_REDUCE_SUM: return "sum";
    case LOOM_REDUCE_MAX: return "max";
    case LOOM_REDUCE_MIN: return "min";
    case LOOM_REDUCE_AVG: return "avg";
    default: return "op#" + std::to_string(op);
  }
}

bool reducible(int32_t dtype, int32_t op) {
  if (op < LOOM_REDUCE_SUM || op > LOOM_REDUCE_AVG) return false;
  if (dtype == LOOM_DTYPE_F16) return LOOM_COMM_HAVE_F16 != 0;
  return loom::dtype_size(dtype) != 0;
}

void reduce_into(void* out, const void* const* in, int n, size_t len, int32_t dtype, int32_t op) {
  switch (dtype) {
    case LOOM_DTYPE_F32: return reduce_op<Native<float>>(out, in, n, len, op);
    case LOOM_DTYPE_F64: return reduce_op<Native<double>>(out, in, n, len, op);
    case LOOM_DTYPE_I32: return reduce_op<Native<int32_t>>(out, in, n, len, op);
    case LOOM_DTYPE_I64: return reduce_op<Native<int64_t>>(out, in, n, len, op);
    case LOOM_DTYPE_U8: return reduce_op<Native<uint8_t>>(out, in, n, len, op);
    case LOOM_DTYPE_BF16: return reduce_op<BF16>(out, in, n, len, op);
#if LOOM_COMM_HAVE_F16
    case LOOM_DTYPE_F16: return reduce_op<F16>(out, in, n, len, op);
#endif
    default: return;
  }
}

}  // namespace loom::comm_common
