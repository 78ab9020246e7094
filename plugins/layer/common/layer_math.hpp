// Helpers shared by the built-in layer plugins (embedding, attention, mlp, lm_head).
// Header-only and compiled into each plugin; every piece of math goes through the
// rank's loom::Device, so the same code runs on any device plugin.
//
// Conventions: activations are fp32 [T, cols] row-major (T = seq * micro_batch,
// sequence-major rows r = s * B + b); weights are stored [in, out] so y = x W + b.
#pragma once

#include <loom/cpp/plugin.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace loom::layers {

// ---------------------------------------------------------------------------
// Tensors
// ---------------------------------------------------------------------------

inline int64_t numel(const DLTensor& t) {
  int64_t n = 1;
  for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
  return n;
}

// The first element of a view (data + byte_offset).
template <typename T = float>
T* data_of(const DLTensor& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data) + t.byte_offset);
}

inline bool is_compact(const DLTensor& t) {
  if (t.strides == nullptr) return true;
  int64_t expect = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    if (t.shape[i] != 1 && t.strides[i] != expect) return false;
    expect *= t.shape[i];
  }
  return true;
}

inline std::string shape_str(const DLTensor& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

// Checks a layer-interface tensor: present, compact, of the dtype, with
// shape.size() dims, each equal to shape[i] where shape[i] >= 0.
inline void require_tensor(const DLTensor* t, const char* what, const std::string& layer,
                           uint8_t code, int bits, std::vector<int64_t> shape) {
  LOOM_REQUIRE(t != nullptr, layer << ": " << what << " is required");
  LOOM_REQUIRE(t->data != nullptr, layer << ": " << what << " has no data");
  LOOM_REQUIRE(t->dtype.code == code && t->dtype.bits == bits && t->dtype.lanes == 1,
               layer << ": " << what << " must be " << (code == kDLFloat ? "float" : "int")
                     << bits);
  bool ok = t->ndim == static_cast<int>(shape.size());
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = shape[i] < 0 || t->shape[i] == shape[i];
  if (!ok) {
    std::string want = "[";
    for (size_t i = 0; i < shape.size(); ++i)
      want += (i ? ", " : "") + (shape[i] < 0 ? std::string("*") : std::to_string(shape[i]));
    LOOM_REQUIRE(false, layer << ": " << what << " has shape " << shape_str(*t) << ", expected "
                              << want + "]");
  }
  LOOM_REQUIRE(is_compact(*t), layer << ": " << what << " must be a compact (row-major) view");
}

// A bound parameter or gradient: its local view, checked against the expected
// local element count.
inline float* bound(const DLTensor& t, int64_t expect_numel, const std::string& layer,
                    const std::string& name) {
  LOOM_REQUIRE(t.dtype.code == kDLFloat && t.dtype.bits == 32,
               layer << ": parameter '" << name << "' must be float32");
  LOOM_REQUIRE(numel(t) == expect_numel, layer << ": parameter '" << name << "' is bound with "
                                               << numel(t) << " elements " << shape_str(t)
                                               << ", expected " << expect_numel);
  LOOM_REQUIRE(is_compact(t), layer << ": parameter '" << name << "' must be compact");
  return data_of<float>(t);
}

// ---------------------------------------------------------------------------
// One device allocation carved into aligned pieces (saved activations or the
// temporaries of one step): fewer allocations, fixed relative addresses.
// ---------------------------------------------------------------------------
class Arena {
 public:
  // Reserves `bytes` and returns the piece's index.
  size_t add(size_t bytes) {
    offsets_.push_back(total_);
    total_ += (bytes + kAlign - 1) / kAlign * kAlign;
    return offsets_.size() - 1;
  }
  size_t floats(int64_t n) { return add(static_cast<size_t>(n) * sizeof(float)); }
  size_t bytes() const { return total_; }
  void allocate(loom_rank* rank) { buf_ = loom::Buffer(rank, total_); }
  template <typename T = float>
  T* at(size_t piece) const {
    return reinterpret_cast<T*>(buf_.get<char>() + offsets_[piece]);
  }

 private:
  static constexpr size_t kAlign = 256;
  std::vector<size_t> offsets_;
  size_t total_ = 0;
  loom::Buffer buf_;
};

// ---------------------------------------------------------------------------
// Device math on fp32
// ---------------------------------------------------------------------------

inline void copy_d2d(const loom::Device& dev, void* dst, const void* src, size_t bytes) {
  if (dst != src && bytes) dev.copy(dst, src, bytes, LOOM_COPY_DEVICE_TO_DEVICE);
}

// C[m, n] = alpha * op(A) op(B) + beta * C, all compact row-major fp32.
inline void gemm(const loom::Device& dev, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                 const float* a, const float* b, float* c, float beta, float alpha = 1.0f) {
  loom_gemm_args g = loom::make<loom_gemm_args>();
  g.trans_a = ta ? 1 : 0;
  g.trans_b = tb ? 1 : 0;
  g.m = m;
  g.n = n;
  g.k = k;
  g.a = a;
  g.lda = ta ? m : k;
  g.b = b;
  g.ldb = tb ? k : n;
  g.c = c;
  g.ldc = n;
  g.batch = 1;
  g.alpha = alpha;
  g.beta = beta;
  g.dtype = LOOM_DTYPE_F32;
  g.c_dtype = LOOM_DTYPE_F32;
  dev.gemm(g);
}

// out[r, c] = x[r, c] + bias[c]  (out may be x).
inline void add_bias(const loom::Device& dev, const float* x, const float* bias, float* out,
                     int64_t rows, int64_t cols) {
  dev.elementwise({.op = LOOM_EW_ADD_BIAS, .n = rows * cols, .cols = cols, .x = x,
                   .y = const_cast<float*>(bias), .out = out, .dtype = LOOM_DTYPE_F32,
                   .out_dtype = LOOM_DTYPE_F32});
}

// out = x + y  (out may alias either).
inline void add(const loom::Device& dev, const float* x, const float* y, float* out, int64_t n) {
  dev.elementwise({.op = LOOM_EW_ADD, .n = n, .x = x, .y = const_cast<float*>(y), .out = out,
                   .dtype = LOOM_DTYPE_F32, .out_dtype = LOOM_DTYPE_F32});
}

// out[c] = sum_r x[r, c]
inline void column_sum(const loom::Device& dev, const float* x, float* out, int64_t rows, int64_t cols) {
  dev.reduce({.op = LOOM_RED_COLUMN_SUM, .n = rows * cols, .cols = cols, .x = x, .out = out,
              .accumulate = 0, .dtype = LOOM_DTYPE_F32, .out_dtype = LOOM_DTYPE_F32});
}

// out[c] += sum_r x[r, c]
inline void column_sum_acc(const loom::Device& dev, const float* x, float* out, int64_t rows,
                           int64_t cols) {
  dev.reduce({.op = LOOM_RED_COLUMN_SUM, .n = rows * cols, .cols = cols, .x = x, .out = out,
              .accumulate = 1, .dtype = LOOM_DTYPE_F32, .out_dtype = LOOM_DTYPE_F32});
}

// Linear y[T, out] = x[T, in] W[in, out] (+ b[out]).
inline void linear_fwd(const loom::Device& dev, const float* x, const float* w, const float* b,
                       float* y, int64_t rows, int64_t in, int64_t out) {
  gemm(dev, false, false, rows, out, in, x, w, y, 0.0f);
  if (b) add_bias(dev, y, b, y, rows, out);
}

// Its backward: dW += x^T dy, db += sum_r dy (when db), dx (+)= dy W^T (when dx).
inline void linear_bwd(const loom::Device& dev, const float* x, const float* w, const float* dy,
                       float* dx, float* dw, float* db, int64_t rows, int64_t in, int64_t out,
                       bool accumulate_dx = false) {
  gemm(dev, true, false, in, out, rows, x, dy, dw, 1.0f);
  if (db) column_sum_acc(dev, dy, db, rows, out);
  if (dx) gemm(dev, false, true, rows, in, out, dy, w, dx, accumulate_dx ? 1.0f : 0.0f);
}

// LayerNorm over the last dim; mean/rstd [rows].
inline void layernorm_fwd(const loom::Device& dev, const float* x, const float* gamma,
                          const float* beta, float* y, float* mean, float* rstd, int64_t rows,
                          int64_t cols, float eps) {
  dev.layernorm_fwd({.rows = rows, .cols = cols, .x = x, .gamma = gamma, .beta = beta, .y = y,
                     .mean = mean, .rstd = rstd, .eps = eps, .dtype = LOOM_DTYPE_F32});
}

inline void layernorm_bwd(const loom::Device& dev, const float* dy, const float* x,
                          const float* gamma, const float* mean, const float* rstd, float* dx,
                          float* dgamma, float* dbeta, int64_t rows, int64_t cols,
                          bool accumulate_dx) {
  dev.layernorm_bwd({.rows = rows, .cols = cols, .dy = dy, .x = x, .gamma = gamma, .mean = mean,
                     .rstd = rstd, .dx = dx, .dgamma = dgamma, .dbeta = dbeta,
                     .accumulate_dx = accumulate_dx ? 1 : 0, .dtype = LOOM_DTYPE_F32});
}

// ---------------------------------------------------------------------------
// Dropout outside the tensor-parallel region: the same seed on every tp rank.
// ---------------------------------------------------------------------------

inline uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// seed = hash(run's dropout seed, the layer's instance name, microbatch).
inline uint64_t dropout_seed(uint64_t base, const std::string& instance, int32_t microbatch) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a of the name
  for (unsigned char ch : instance) h = (h ^ ch) * 0x100000001b3ull;
  return mix64(mix64(base ^ mix64(h)) ^ static_cast<uint64_t>(static_cast<uint32_t>(microbatch)));
}

// out = x * mask / (1 - p); mask [n] u8 written.
inline void dropout_fwd(const loom::Device& dev, const float* x, float* out, uint8_t* mask,
                        int64_t n, float p, uint64_t seed) {
  dev.elementwise({.op = LOOM_EW_DROPOUT, .n = n, .x = x, .y = mask, .out = out, .p = p,
                   .seed = seed, .offset = 0, .dtype = LOOM_DTYPE_F32,
                   .out_dtype = LOOM_DTYPE_F32});
}

// dx = dy * mask / (1 - p) with the saved mask.
inline void dropout_bwd(const loom::Device& dev, const float* dy, float* dx, const uint8_t* mask,
                        int64_t n, float p) {
  dev.elementwise({.op = LOOM_EW_DROPOUT_BWD, .n = n, .x = dy, .y = const_cast<uint8_t*>(mask),
                   .out = dx, .p = p, .dtype = LOOM_DTYPE_F32, .out_dtype = LOOM_DTYPE_F32});
}

inline float dropout_option(const loom::Options& options, const std::string& layer) {
  const double p = options.get_float("dropout", 0.0);
  LOOM_REQUIRE(p >= 0.0 && p < 1.0,
               layer << ": option dropout = " << p << " must be in [0, 1)");
  return static_cast<float>(p);
}

inline loom::OptionSpec dropout_option_spec(const char* where) {
  return loom::opt_float("dropout", 0.0,
                         std::string("dropout probability on ") + where + " (training only)");
}

constexpr float kLayerNormEps = 1e-5f;

}  // namespace loom::layers
