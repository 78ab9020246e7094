// Helpers for layer plugins, installed with the SDK (<loom/layers/...>) and used by
// the built-in layers (embedding, attention, mlp, lm_head, moe) and parallel/tensor:
// linears with their GEMM epilogues, norms, dropout, gradient shadows for mixed
// precision (GradShadow), tensor-parallel recomputation. Header-only C++ compiled into
// each plugin: no part of the C ABI, so a plugin built against an older copy keeps its
// own. Every piece of math goes through the rank's loom::Device, so the same code runs
// on any device plugin.
//
// Conventions: activations are [T, cols] row-major in the parameters' dtype (T = seq * micro_batch,
// sequence-major rows r = s * B + b); weights are stored [in, out] so y = x W + b.
#pragma once

#include <loom/cpp/plugin.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
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

// ---------------------------------------------------------------------------
// Dtypes. A layer computes in the dtype of its bound parameters (fp32, or bf16
// under mixed precision): its inputs, outputs, saved activations and their
// gradients are in that dtype; layernorm mean/rstd, attention lse and the
// cross-entropy statistics stay fp32 (the device ops keep fp32 math inside).
// ---------------------------------------------------------------------------

inline const char* dtype_name(int32_t dtype) { return dtype == LOOM_DTYPE_BF16 ? "bfloat16" : "float32"; }

// LOOM_DTYPE_F32 or LOOM_DTYPE_BF16 of a view; anything else is an error.
inline int32_t float_dtype(const DLTensor& t, const std::string& what) {
  if (t.dtype.code == kDLFloat && t.dtype.bits == 32 && t.dtype.lanes == 1) return LOOM_DTYPE_F32;
  if (t.dtype.code == kDLBfloat && t.dtype.bits == 16 && t.dtype.lanes == 1) return LOOM_DTYPE_BF16;
  LOOM_REQUIRE(false, what << " must be float32 or bfloat16");
  return LOOM_DTYPE_F32;
}

// p + n elements of dtype.
inline void* advance(void* p, int64_t n, int32_t dtype) {
  return static_cast<char*>(p) + n * static_cast<int64_t>(dtype_size(dtype));
}
inline const void* advance(const void* p, int64_t n, int32_t dtype) {
  return static_cast<const char*>(p) + n * static_cast<int64_t>(dtype_size(dtype));
}

// Whether the engine allows gradient-accumulation fusion (ABI 1.2 create args).
inline bool grad_accumulation_fusion(const loom_layer_create_args& a) {
  return a.struct_size >= offsetof(loom_layer_create_args, grad_accumulation_fusion) + sizeof(int32_t) &&
         a.grad_accumulation_fusion != 0;
}

// The activation dtype (= the parameters') and the gradient dtype of a layer.
struct Dtypes {
  int32_t act = LOOM_DTYPE_F32;
  int32_t grad = LOOM_DTYPE_F32;
  size_t act_bytes() const { return dtype_size(act); }
};

// An activation of the layer interface: as require_tensor, of the layer's dtype.
inline void require_act(const DLTensor* t, const char* what, const std::string& layer, int32_t dtype,
                        std::vector<int64_t> shape) {
  LOOM_REQUIRE(t != nullptr, layer << ": " << what << " is required");
  if (dtype == LOOM_DTYPE_BF16)
    require_tensor(t, what, layer, kDLBfloat, 16, std::move(shape));
  else
    require_tensor(t, what, layer, kDLFloat, 32, std::move(shape));
}

// A bound parameter or gradient: its local view, checked against the expected
// local element count and dtype.
inline void* bound(const DLTensor& t, int64_t expect_numel, const std::string& layer, const std::string& name,
                   int32_t dtype) {
  const int32_t got = float_dtype(t, layer + ": parameter '" + name + "'");
  LOOM_REQUIRE(got == dtype, layer << ": parameter '" << name << "' is " << dtype_name(got) << ", expected "
                                   << dtype_name(dtype) << " (one dtype for all parameters, one for all gradients)");
  LOOM_REQUIRE(numel(t) == expect_numel, layer << ": parameter '" << name << "' is bound with "
                                               << numel(t) << " elements " << shape_str(t)
                                               << ", expected " << expect_numel);
  LOOM_REQUIRE(is_compact(t), layer << ": parameter '" << name << "' must be compact");
  return data_of<void>(t);
}

// The dtypes of a bind: the first parameter's and the first gradient's (bound()
// then checks that every other one agrees).
inline Dtypes bound_dtypes(std::span<const DLTensor> params, std::span<const DLTensor> grads,
                           const std::string& layer) {
  Dtypes d;
  if (!params.empty()) d.act = float_dtype(params[0], layer + ": parameters");
  if (!grads.empty()) d.grad = float_dtype(grads[0], layer + ": gradients");
  return d;
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
  // n elements of LOOM_DTYPE_* dtype.
  size_t elems(int64_t n, int32_t dtype) { return add(static_cast<size_t>(n) * dtype_size(dtype)); }
  size_t bytes() const { return total_; }
  void allocate(loom_rank* rank) { buf_ = loom::Buffer(rank, total_); }
  // The piece's address (float* by default: also for pieces of another dtype,
  // which are only handed to device ops, never indexed here).
  template <typename T = float>
  T* at(size_t piece) const {
    return reinterpret_cast<T*>(buf_.get<char>() + offsets_[piece]);
  }
  size_t offset(size_t piece) const { return offsets_[piece]; }
  size_t pieces() const { return offsets_.size(); }
  char* data() const { return buf_.get<char>(); }
  void free() { buf_.reset(); }

 private:
  static constexpr size_t kAlign = 256;
  std::vector<size_t> offsets_;
  size_t total_ = 0;
  loom::Buffer buf_;
};

// For a layer's workspace_bytes: under sequence parallelism parallel/tensor's linear
// calls hold one whole-sequence [T, H] buffer while they run (a partial sum before its
// reduce-scatter, a gathered gradient), one call at a time; nothing without it.
inline uint64_t sequence_parallel_service_bytes(const loom::TensorParallel& tp, int64_t T, int64_t H, int32_t dtype) {
  if (!tp.sequence_parallel()) return 0;
  Arena a;
  a.elems(T * H, dtype);
  return a.bytes();
}

// Memory a layer's sub-step allocates (loom::Rank::run_substep, ABI 1.7): an Arena
// that remembers where it was allocated. When the sub-step's host code runs
// (directly, or while it is captured) it allocates and owns the memory; when the
// sub-step is replayed its host code does not run, and the pieces are where the
// capture put them (the device's graph pool keeps that memory for the replays), so
// the code around the sub-step finds them through at() either way. Lay it out
// once with the same pieces, keep the StepArena across steps, and free() it where
// the eager code would free it.
class StepArena {
 public:
  Arena& layout() { return arena_; }
  bool laid_out() const { return arena_.pieces() > 0; }
  void allocate(loom_rank* rank) {
    arena_.allocate(rank);
    base_ = arena_.data();
  }
  void free() { arena_.free(); }  // the address stays known: a replay writes there again
  template <typename T = float>
  T* at(size_t piece) const {
    return reinterpret_cast<T*>(base_ + arena_.offset(piece));
  }

 private:
  Arena arena_;
  char* base_ = nullptr;
};

// ---------------------------------------------------------------------------
// Device math (dtype: the activations'; statistics fp32)
// ---------------------------------------------------------------------------

inline void copy_d2d(const loom::Device& dev, void* dst, const void* src, size_t bytes) {
  if (dst != src && bytes) dev.copy(dst, src, bytes, LOOM_COPY_DEVICE_TO_DEVICE);
}

inline void fill_zero(const loom::Device& dev, void* out, int64_t n, int32_t dtype) {
  dev.elementwise({.op = LOOM_EW_FILL, .n = n, .out = out, .alpha = 0.f, .dtype = dtype, .out_dtype = dtype});
}

// C[m, n] = alpha * op(A) op(B) + beta * C, compact row-major; A, B in dtype, C in c_dtype.
// A GEMM's epilogue (ABI 1.11, LOOM_GEMM_EPILOGUE_*): only for devices with
// LOOM_DEVICE_GEMM_EPILOGUE (fused_gemm_epilogues).
struct Epilogue {
  int32_t kind = LOOM_GEMM_EPILOGUE_NONE;
  const void* bias = nullptr;
  void* aux = nullptr;  // [m, n], packed (ldaux = n)
};

inline bool fused_gemm_epilogues(const loom::Device& dev) { return (dev.features() & LOOM_DEVICE_GEMM_EPILOGUE) != 0; }

// C[m, n] = op(A) op(B) + beta C, each operand with its own leading dimension (elements
// between its rows as stored): e.g. column blocks of wider rows.
inline void gemm_ld(const loom::Device& dev, bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* a,
                    int64_t lda, const void* b, int64_t ldb, void* c, int64_t ldc, float beta, int32_t dtype,
                    int32_t c_dtype, float alpha = 1.0f, Epilogue e = {}) {
  loom_gemm_args g = loom::make<loom_gemm_args>();
  g.epilogue = e.kind;
  g.bias = e.bias;
  g.aux = e.aux;
  g.ldaux = e.aux ? n : 0;
  g.trans_a = ta ? 1 : 0;
  g.trans_b = tb ? 1 : 0;
  g.m = m;
  g.n = n;
  g.k = k;
  g.a = a;
  g.lda = lda;
  g.b = b;
  g.ldb = ldb;
  g.c = c;
  g.ldc = ldc;
  g.batch = 1;
  g.alpha = alpha;
  g.beta = beta;
  g.dtype = dtype;
  g.c_dtype = c_dtype;
  dev.gemm(g);
}

// The same on compact operands.
inline void gemm(const loom::Device& dev, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                 const void* a, const void* b, void* c, float beta, int32_t dtype, int32_t c_dtype,
                 float alpha = 1.0f, Epilogue e = {}) {
  gemm_ld(dev, ta, tb, m, n, k, a, ta ? m : k, b, tb ? k : n, c, n, beta, dtype, c_dtype, alpha, e);
}

// out[r, c] = x[r, c] + bias[c]  (out may be x).
inline void add_bias(const loom::Device& dev, const void* x, const void* bias, void* out, int64_t rows,
                     int64_t cols, int32_t dtype) {
  dev.elementwise({.op = LOOM_EW_ADD_BIAS, .n = rows * cols, .cols = cols, .x = x, .y = const_cast<void*>(bias),
                   .out = out, .dtype = dtype, .out_dtype = dtype});
}

// out = x + y  (out may alias either).
inline void add(const loom::Device& dev, const void* x, const void* y, void* out, int64_t n, int32_t dtype) {
  dev.elementwise({.op = LOOM_EW_ADD, .n = n, .x = x, .y = const_cast<void*>(y), .out = out, .dtype = dtype,
                   .out_dtype = dtype});
}

// out[c] = sum_r x[r, c]  (x in dtype; out fp32: reductions write fp32)
inline void column_sum(const loom::Device& dev, const void* x, float* out, int64_t rows, int64_t cols,
                       int32_t dtype) {
  dev.reduce({.op = LOOM_RED_COLUMN_SUM, .n = rows * cols, .cols = cols, .x = x, .out = out, .accumulate = 0,
              .dtype = dtype, .out_dtype = LOOM_DTYPE_F32});
}

// dst (dst_dtype) += src (fp32), n elements, rounded once: an fp32 dst directly; a
// bf16 one widened into fp32 scratch, added, and rounded back (EW_CAST).
inline void accumulate_f32(loom_rank* rank, const loom::Device& dev, const float* src, void* dst, int64_t n,
                           int32_t dst_dtype) {
  if (dst_dtype == LOOM_DTYPE_F32) {
    add(dev, dst, src, dst, n, LOOM_DTYPE_F32);
    return;
  }
  Arena tmp;
  const size_t wide = tmp.floats(n);
  tmp.allocate(rank);
  dev.elementwise({.op = LOOM_EW_CAST, .n = n, .x = dst, .out = tmp.at(wide), .dtype = dst_dtype,
                   .out_dtype = LOOM_DTYPE_F32});
  add(dev, tmp.at(wide), src, tmp.at(wide), n, LOOM_DTYPE_F32);
  dev.elementwise({.op = LOOM_EW_CAST, .n = n, .x = tmp.at(wide), .out = dst, .dtype = LOOM_DTYPE_F32,
                   .out_dtype = dst_dtype});
}

// out[c] += sum_r x[r, c]  (x in dtype, out in out_dtype; the sum in fp32, a bf16
// out rounded once per call)
inline void column_sum_acc(loom_rank* rank, const loom::Device& dev, const void* x, void* out, int64_t rows,
                           int64_t cols, int32_t dtype, int32_t out_dtype) {
  if (out_dtype == LOOM_DTYPE_F32) {
    dev.reduce({.op = LOOM_RED_COLUMN_SUM, .n = rows * cols, .cols = cols, .x = x, .out = out, .accumulate = 1,
                .dtype = dtype, .out_dtype = LOOM_DTYPE_F32});
    return;
  }
  Arena tmp;
  const size_t sum = tmp.floats(cols);
  tmp.allocate(rank);
  column_sum(dev, x, tmp.at(sum), rows, cols, dtype);
  accumulate_f32(rank, dev, tmp.at(sum), out, cols, out_dtype);
}

// Linear y[T, out] = x[T, in] W[in, out] (+ b[out]), all in dtype; the bias in the
// GEMM's epilogue where the device fuses it.
inline void linear_fwd(const loom::Device& dev, const void* x, const void* w, const void* b, void* y,
                       int64_t rows, int64_t in, int64_t out, int32_t dtype) {
  if (b && fused_gemm_epilogues(dev)) {
    gemm(dev, false, false, rows, out, in, x, w, y, 0.0f, dtype, dtype, 1.0f, {.kind = LOOM_GEMM_EPILOGUE_BIAS, .bias = b});
    return;
  }
  gemm(dev, false, false, rows, out, in, x, w, y, 0.0f, dtype, dtype);
  if (b) add_bias(dev, y, b, y, rows, out, dtype);
}

// pre = x W (+ b), y = gelu(pre) [T, out]: one GEMM with the GELU_AUX epilogue where
// the device fuses it, else the linear and gelu_fwd.
inline void linear_gelu_fwd(const loom::Device& dev, const void* x, const void* w, const void* b, void* pre, void* y,
                            int64_t rows, int64_t in, int64_t out, int32_t dtype) {
  if (fused_gemm_epilogues(dev)) {
    gemm(dev, false, false, rows, out, in, x, w, y, 0.0f, dtype, dtype, 1.0f,
         {.kind = LOOM_GEMM_EPILOGUE_GELU_AUX, .bias = b, .aux = pre});
    return;
  }
  linear_fwd(dev, x, w, b, pre, rows, in, out, dtype);
  dev.gelu_fwd({.n = rows * out, .x = pre, .out = y, .dtype = dtype});
}

// dx[T, in] = (dy[T, out] W[in, out]^T) * gelu'(pre[T, in]): the gradient through the
// GeLU that made this linear's input; one GEMM with the DGELU epilogue where the device
// fuses it, else the GEMM and gelu_bwd.
inline void linear_dgelu_dx(const loom::Device& dev, const void* dy, const void* w, const void* pre, void* dx,
                            int64_t rows, int64_t in, int64_t out, int32_t dtype) {
  if (fused_gemm_epilogues(dev)) {
    gemm(dev, false, true, rows, in, out, dy, w, dx, 0.0f, dtype, dtype, 1.0f,
         {.kind = LOOM_GEMM_EPILOGUE_DGELU, .aux = const_cast<void*>(pre)});
    return;
  }
  gemm(dev, false, true, rows, in, out, dy, w, dx, 0.0f, dtype, dtype);
  dev.gelu_bwd({.n = rows * in, .x = pre, .dy = dx, .out = dx, .dtype = dtype});
}

// LayerNorm over the last dim; mean/rstd [rows] fp32; x, gamma, beta, y in dtype.
inline void layernorm_fwd(const loom::Device& dev, const void* x, const void* gamma, const void* beta, void* y,
                          float* mean, float* rstd, int64_t rows, int64_t cols, float eps, int32_t dtype) {
  dev.layernorm_fwd({.rows = rows, .cols = cols, .x = x, .gamma = gamma, .beta = beta, .y = y, .mean = mean,
                     .rstd = rstd, .eps = eps, .dtype = dtype});
}

// dgamma, dbeta (accumulated) in dtype, or fp32 with grad_fp32: pass a
// GradShadow's buffers and its grad_fp32().
inline void layernorm_bwd(const loom::Device& dev, const void* dy, const void* x, const void* gamma,
                          const float* mean, const float* rstd, void* dx, void* dgamma, void* dbeta, int64_t rows,
                          int64_t cols, bool accumulate_dx, int32_t dtype, int32_t grad_fp32) {
  dev.layernorm_bwd({.rows = rows, .cols = cols, .dy = dy, .x = x, .gamma = gamma, .mean = mean, .rstd = rstd,
                     .dx = dx, .dgamma = dgamma, .dbeta = dbeta, .accumulate_dx = accumulate_dx ? 1 : 0,
                     .dtype = dtype, .grad_fp32 = grad_fp32});
}

// ---------------------------------------------------------------------------
// Gradients in another dtype than the activations (bf16 parameters with fp32
// gradients). With an ABI 1.2 device and tensor-parallel service (features
// LOOM_DEVICE_GRAD_FP32 and LOOM_TP_GRAD_FP32) every op that accumulates a
// parameter gradient writes the fp32 gradient itself (grad_fp32 = 1): Megatron's
// gradient-accumulation fusion, no bf16 rounding of a microbatch's gradient and
// no temporary copy. Otherwise (a 1.1 plugin, or fp32 parameters with bf16
// gradients) the ops take one dtype, so a backward accumulates this microbatch's
// contributions into zeroed shadows in the activation dtype and commit() adds
// them to the real gradients (cast, then add in the gradient dtype): Megatron's
// unfused path (bf16 weight.grad added to the fp32 main_grad). With equal dtypes
// the gradients are used as they are.
// ---------------------------------------------------------------------------
class GradShadow {
 public:
  // tp_features: the layer's tensor-parallel service's (TensorParallel::features());
  // fusion: the run allows it (loom_layer_create_args.grad_accumulation_fusion).
  GradShadow(loom_rank* rank, const loom::Device& dev, Dtypes dt, std::vector<void*> grads,
             std::vector<int64_t> numels, uint64_t tp_features, bool fusion)
      : dev_(dev), dt_(dt), grads_(std::move(grads)), numels_(std::move(numels)), ptrs_(grads_) {
    fused_ = fuses(dev_, dt_, tp_features, fusion);
    if (dt_.act == dt_.grad || fused_) return;
    const std::vector<size_t> pieces = lay_out(mem_, dt_, numels_, &cast_);
    mem_.allocate(rank);
    for (size_t i = 0; i < grads_.size(); ++i) {
      ptrs_[i] = mem_.at<void>(pieces[i]);
      dev_.elementwise({.op = LOOM_EW_FILL, .n = numels_[i], .out = ptrs_[i], .alpha = 0.f, .dtype = dt_.act,
                        .out_dtype = dt_.act});
    }
  }
  // The bytes a GradShadow of these arguments allocates (for a layer's workspace_bytes).
  static uint64_t bytes(const loom::Device& dev, Dtypes dt, const std::vector<int64_t>& numels, uint64_t tp_features,
                        bool fusion) {
    if (dt.act == dt.grad || fuses(dev, dt, tp_features, fusion)) return 0;
    Arena a;
    size_t cast = 0;
    lay_out(a, dt, numels, &cast);
    return a.bytes();
  }
  // Where the backward accumulates gradient i, of grad_dtype().
  void* operator[](size_t i) const { return ptrs_[i]; }
  // The ops' grad_fp32 flag (1 when they accumulate into the fp32 gradients).
  int32_t grad_fp32() const { return fused_ ? 1 : 0; }
  // The dtype of the buffers operator[] returns.
  int32_t grad_dtype() const { return fused_ ? dt_.grad : dt_.act; }
  // grads[i] += shadow[i] for every i (nothing without shadows).
  void commit() {
    if (dt_.act == dt_.grad || fused_) return;
    for (size_t i = 0; i < grads_.size(); ++i) {
      if (numels_[i] == 0) continue;
      dev_.elementwise({.op = LOOM_EW_CAST, .n = numels_[i], .x = ptrs_[i], .out = mem_.at<void>(cast_),
                        .dtype = dt_.act, .out_dtype = dt_.grad});
      add(dev_, grads_[i], mem_.at<void>(cast_), grads_[i], numels_[i], dt_.grad);
    }
  }

 private:
  static bool fuses(const loom::Device& dev, Dtypes dt, uint64_t tp_features, bool fusion) {
    return fusion && dt.act == LOOM_DTYPE_BF16 && dt.grad == LOOM_DTYPE_F32 &&
           (dev.features() & LOOM_DEVICE_GRAD_FP32) != 0 && (tp_features & LOOM_TP_GRAD_FP32) != 0;
  }
  // A shadow per gradient in the activations' dtype, and one cast buffer of the largest.
  static std::vector<size_t> lay_out(Arena& a, Dtypes dt, const std::vector<int64_t>& numels, size_t* cast) {
    std::vector<size_t> pieces;
    int64_t largest = 0;
    for (int64_t n : numels) {
      pieces.push_back(a.elems(n, dt.act));
      largest = std::max(largest, n);
    }
    *cast = a.elems(largest, dt.grad);
    return pieces;
  }

  loom::Device dev_;
  Dtypes dt_;
  std::vector<void*> grads_;
  std::vector<int64_t> numels_;
  std::vector<void*> ptrs_;
  Arena mem_;
  size_t cast_ = 0;
  bool fused_ = false;
};

// ---------------------------------------------------------------------------
// Dropout outside the tensor-parallel region: the same seed on every tp rank.
// ---------------------------------------------------------------------------

inline uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A dropout stream's key before the step's seed: hash(the layer's instance name).
// The step's seed comes last, as loom_mix64(key ^ loom_mix64(seed)), which a
// device computes itself from seed_device (ABI 1.3) for captured launches. The
// microbatch index is not part of it: the engine's seed already names the
// microbatch's first sample, so masks follow the samples and are the same under
// any dp (the index of a microbatch is not).
inline uint64_t dropout_key(const std::string& instance) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a of the name
  for (unsigned char ch : instance) h = (h ^ ch) * 0x100000001b3ull;
  return mix64(h);
}

// Whether this layer's dropouts can be captured: the service passes the step's
// seed to the device by address, and the device reads it when the launch runs.
inline bool dropout_seed_on_device(const loom::Device& dev, const loom::TensorParallel& tp) {
  return (tp.features() & LOOM_TP_SEED_DEVICE) != 0 && (dev.features() & LOOM_DEVICE_SEED_DEVICE) != 0;
}

// out = x * mask / (1 - p); mask [n] u8 written.
inline void dropout_fwd(const loom::Device& dev, const void* x, void* out, uint8_t* mask, int64_t n, float p,
                        uint64_t seed, int32_t dtype) {
  dev.elementwise({.op = LOOM_EW_DROPOUT, .n = n, .x = x, .y = mask, .out = out, .p = p, .seed = seed,
                   .offset = 0, .dtype = dtype, .out_dtype = dtype});
}

// dx = dy * mask / (1 - p) with the saved mask.
inline void dropout_bwd(const loom::Device& dev, const void* dy, void* dx, const uint8_t* mask, int64_t n,
                        float p, int32_t dtype) {
  dev.elementwise({.op = LOOM_EW_DROPOUT_BWD, .n = n, .x = dy, .y = const_cast<uint8_t*>(mask), .out = dx,
                   .p = p, .dtype = dtype, .out_dtype = dtype});
}

// The range is declared (dropout_option_spec), so the engine has checked it.
inline float dropout_option(const loom::Options& options) {
  return static_cast<float>(options.declared_float("dropout"));
}

inline loom::OptionSpec dropout_option_spec(const char* where) {
  return loom::opt_float("dropout", 0.0,
                         std::string("dropout probability on ") + where + " (training only)")
      .in("[0, 1)");
}

constexpr float kLayerNormEps = 1e-5f;

// The normalisation in front of a block's sublayer, as its `norm` option chooses:
// LayerNorm (gamma and beta; saves mean and rstd) or RMSNorm (Zhang and Sennrich,
// 2019: gamma only, no mean subtracted; saves rstd), as Megatron-Core's
// normalization = "RMSNorm" applies it. `eps` is the norm_epsilon option.
// A layer option that needs device ops a device plugin may lack (those ABI 1.10
// appended): refused by the layer's validate (ABI 1.12: `loom validate` asks the run's
// device before launch) and again when it is created on a rank.
inline void require_device_ops(bool present, const std::string& layer, const std::string& option,
                               const char* ops) {
  if (!present)
    throw loom::Error(layer + ": " + option + " needs the device ops " + ops +
                          " (ABI 1.10), which the device plugin does not implement; use a device built "
                          "against ABI 1.10 or later, or another option",
                      LOOM_CODE_UNSUPPORTED);
}

struct Norm {
  bool rms = false;
  float eps = kLayerNormEps;

  // `dev`: a rank's loom::Device, or the run's device before launch (loom::LayerValidation).
  template <class Ops>
  void require_ops(const Ops& dev, const std::string& layer) const {
    if (rms)
      require_device_ops(dev.has_rmsnorm_fwd() && dev.has_rmsnorm_bwd(), layer, "norm = \"rmsnorm\"",
                         "rmsnorm_fwd and rmsnorm_bwd");
  }

  void forward(const loom::Device& dev, const void* x, const void* gamma, const void* beta, void* y, float* mean,
               float* rstd, int64_t rows, int64_t cols, int32_t dtype) const {
    if (!rms) {
      layernorm_fwd(dev, x, gamma, beta, y, mean, rstd, rows, cols, eps, dtype);
      return;
    }
    dev.rmsnorm_fwd({.rows = rows, .cols = cols, .x = x, .gamma = gamma, .y = y, .rstd = rstd, .eps = eps,
                     .dtype = dtype});
  }
  // dgamma (and dbeta, LayerNorm only) accumulated; dx written or added.
  void backward(const loom::Device& dev, const void* dy, const void* x, const void* gamma, const float* mean,
                const float* rstd, void* dx, void* dgamma, void* dbeta, int64_t rows, int64_t cols,
                bool accumulate_dx, int32_t dtype, int32_t grad_fp32) const {
    if (!rms) {
      layernorm_bwd(dev, dy, x, gamma, mean, rstd, dx, dgamma, dbeta, rows, cols, accumulate_dx, dtype, grad_fp32);
      return;
    }
    dev.rmsnorm_bwd({.rows = rows, .cols = cols, .dy = dy, .x = x, .gamma = gamma, .rstd = rstd, .dx = dx,
                     .dgamma = dgamma, .accumulate_dx = accumulate_dx ? 1 : 0, .dtype = dtype,
                     .grad_fp32 = grad_fp32});
  }
};

// The options that choose it, declared by the layers that offer the choice (layer/mlp).
inline Norm norm_option(const loom::Options& options) {
  return {.rms = options.declared_string("norm") == "rmsnorm",
          .eps = static_cast<float>(options.declared_float("norm_epsilon"))};
}
// The device ops a feed-forward block's `norm` and `activation` options need, of a rank's
// device (loom::Device, at create) or of the run's before launch (loom::LayerValidation).
template <class Ops>
void require_ffn_ops(const loom::Options& options, const Ops& dev, const std::string& layer) {
  norm_option(options).require_ops(dev, layer);
  if (options.declared_string("activation") == "swiglu")
    require_device_ops(dev.has_swiglu_fwd() && dev.has_swiglu_bwd(), layer, "activation = \"swiglu\"",
                       "swiglu_fwd and swiglu_bwd");
}
inline std::vector<loom::OptionSpec> norm_option_specs() {
  return {loom::opt_string("norm", "layernorm",
                           "the normalisation before the sublayer: layernorm (gamma and beta) or rmsnorm (gamma "
                           "only, as Llama)")
              .one_of("layernorm|rmsnorm"),
          loom::opt_float("norm_epsilon", 1e-5, "added to the variance (layernorm) or the mean square (rmsnorm)")
              .in("(0, 1)")};
}

// The input of a layer's first, column-parallel GEMM, for its weight gradient:
// LN(x) recomputed from the saved input x [local rows, cols] and its statistics
// into `ln` [local rows, cols], and under sequence parallelism all-gathered into
// `ln_full` [rows, cols] (unused without SP). Megatron's sequence parallelism: a
// layer saves only its shard and gathers again in backward, so what it keeps
// outside TP regions is 1/tp of the sequence; keeping the gathered LN output
// instead would hold more than tensor parallelism alone. Returns what to pass as
// the GEMM's x. The recomputed values equal the forward's bit for bit (same op,
// same input), so saving and recomputing train identically.
inline const void* recompute_ln_input(const loom::Device& dev, const loom::TensorParallel& tp, const void* x,
                                      const void* gamma, const void* beta, float* mean, float* rstd, void* ln,
                                      void* ln_full, int64_t local_rows, int64_t cols, int32_t dtype,
                                      const Norm& norm = {}) {
  norm.forward(dev, x, gamma, beta, ln, mean, rstd, local_rows, cols, dtype);
  if (!tp.sequence_parallel()) return ln;
  // f's forward (the all-gather entering the TP region), repeated.
  tp.enter_forward({.rows = local_rows * tp.size(), .cols = cols, .x = ln, .out = ln_full, .dtype = dtype});
  return ln_full;
}

}  // namespace loom::layers
