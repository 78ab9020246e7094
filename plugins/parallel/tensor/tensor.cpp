// parallel/tensor: the tensor-parallel services TP-aware layers call (ABI 1.1,
// loom_tensor_parallel_api; 1.2: grad_fp32, LOOM_TP_GRAD_FP32). Megatron-LM's building blocks over a layer's tp group:
//
//  - f (entering a TP region): identity forward, all-reduce backward; under
//    sequence parallelism all-gather along the sequence forward, reduce-scatter
//    backward;
//  - g (leaving it): all-reduce forward, identity backward; under sequence
//    parallelism reduce-scatter forward, all-gather backward;
//  - column-parallel linear = f then the local GEMM (optionally gathering the
//    output columns); row-parallel linear = the local GEMM then g, bias after it;
//  - vocab-parallel embedding (ids outside the slice look up zeros, then g) and
//    the output logits fused with vocab-parallel cross-entropy (per token the max,
//    the sum of exponentials and the target logit cross ranks, never the logits);
//  - vocabulary padding, and dropout under the model-parallel RNG: one stream on
//    every tp rank outside TP regions (each rank drawing its shard's part under
//    sequence parallelism), a stream per tp rank inside them. Under context
//    parallelism an element draws the number of its place in the whole sequence
//    (loom::ContextSlice), so every cp layout masks the serial run's elements.
//
// A column-parallel forward may end in a GeLU and a row-parallel backward begin
// with its gradient (ABI 1.11, activation): on a device with GEMM epilogues both are
// in the GEMM (bias + GeLU forward, GeLU' on dx backward), as is every bias added
// before g (column-parallel, and row-parallel when g is the identity), and every bias
// gradient taken from the dy that the weight-gradient GEMM reads (all but row-parallel
// under SP, whose bias gradient is this rank's shard).
//
// With tp = 1 every collective is skipped: the calls are the local math. With
// grad_fp32 the parameter gradients of bf16 layers go straight into fp32 buffers
// (the GEMMs accumulate in fp32 into an fp32 C): no bf16 rounding, no shadow.
// Temporaries are allocated per call and freed before it returns, so a layer's
// device memory between forward and backward is only what it saves itself.
#include <loom/layers/layer_math.hpp>

#include <algorithm>
#include <limits>
#include <vector>

namespace {

using namespace loom::layers;

class Tp {
 public:
  Tp(loom_rank* rank, const loom_tp_create_args& a)
      : rank_(rank), group_(a.tp), name_(a.instance_name ? a.instance_name : "layer") {
    size_ = a.tp.size > 0 ? a.tp.size : 1;
    tp_rank_ = a.tp.rank;
    LOOM_REQUIRE(tp_rank_ >= 0 && tp_rank_ < size_,
                 "parallel/tensor: rank " << tp_rank_ << " is outside a tp group of " << size_);
    // A group without a communicator is fine for planning (loom plan creates layers
    // to ask their sizes); a collective on it is an error (see comm()).
    has_comm_ = a.tp.api != nullptr && a.tp.comm != nullptr;
    sp_ = a.sequence_parallel != 0 && size_ > 1;
    dev_ = loom::Rank(rank).device();
    cp_ = loom::Rank(rank).group_or_single("cp");
  }

  // ----- f and g -----------------------------------------------------------

  int64_t local_rows(int64_t rows) const {
    if (!sp_) return rows;
    LOOM_REQUIRE(rows % size_ == 0, name_ << ": " << rows << " rows (seq * micro_batch) cannot be split into "
                                          << size_ << " sequence shards");
    return rows / size_;
  }

  // f forward: [local rows] -> [rows].
  void enter_fwd(int64_t rows, int64_t cols, const void* x, void* out, int32_t dt) const {
    if (sp_) comm().all_gather(stream(), x, out, static_cast<size_t>(local_rows(rows) * cols), dt);
    else copy_d2d(dev_, out, x, static_cast<size_t>(rows * cols) * loom::dtype_size(dt));
  }
  // f backward: [rows] summed over tp -> [local rows]. x may be out without SP.
  void enter_bwd(int64_t rows, int64_t cols, const void* x, void* out, int32_t dt) const {
    if (sp_) comm().reduce_scatter(stream(), x, out, static_cast<size_t>(local_rows(rows) * cols), dt);
    else all_reduce(x, out, rows * cols, dt);
  }
  // g forward: [rows] partial sums -> [local rows] reduced.
  void exit_fwd(int64_t rows, int64_t cols, const void* x, void* out, int32_t dt) const {
    enter_bwd(rows, cols, x, out, dt);
  }
  // g backward: [local rows] -> [rows].
  void exit_bwd(int64_t rows, int64_t cols, const void* x, void* out, int32_t dt) const {
    enter_fwd(rows, cols, x, out, dt);
  }

  void region(const loom_tp_region_args& a, int which) const {
    const int32_t dt = require_float(a.dtype);
    const void* x = a.x;
    void* out = a.out;
    LOOM_REQUIRE(x && out, name_ << ": region call needs x and out");
    switch (which) {
      case 0: enter_fwd(a.rows, a.cols, x, out, dt); break;
      case 1: enter_bwd(a.rows, a.cols, x, out, dt); break;
      case 2: exit_fwd(a.rows, a.cols, x, out, dt); break;
      default: exit_bwd(a.rows, a.cols, x, out, dt); break;
    }
  }

  // ----- linear layers -----------------------------------------------------

  void column_fwd(const loom_tp_linear_args& a) const {
    const int32_t dt = require_float(a.dtype);
    const bool with_gelu = gelu(a);  // checked before any collective
    LOOM_REQUIRE(!with_gelu || !a.gather_output || size_ == 1,
                 name_ << ": a column-parallel linear with an activation cannot gather its output");
    const int64_t R = a.rows, in = a.in, out = a.out;
    const void* x = a.x;
    if (sp_) {
      LOOM_REQUIRE(a.x_full != nullptr, name_ << ": column-parallel linear under sequence parallelism needs x_full");
      enter_fwd(R, in, x, a.x_full, dt);
      x = a.x_full;
    }
    const void* w = a.weight;
    const void* b = a.bias;
    if (with_gelu) {
      linear_gelu_fwd(dev_, x, w, b, a.pre_activation, a.y, R, in, out, dt);
      return;
    }
    if (!a.gather_output || size_ == 1) {
      linear_fwd(dev_, x, w, b, a.y, R, in, out, dt);
      return;
    }
    // The local columns, gathered to [tp, R, out], then interleaved into [R, tp * out].
    Arena tmp;
    const size_t local = tmp.elems(R * out, dt), all = tmp.elems(size_ * R * out, dt);
    tmp.allocate(rank_);
    linear_fwd(dev_, x, w, b, tmp.at<void>(local), R, in, out, dt);
    comm().all_gather(stream(), tmp.at<void>(local), tmp.at<void>(all), static_cast<size_t>(R * out), dt);
    const size_t row = static_cast<size_t>(out) * loom::dtype_size(dt);
    for (int r = 0; r < size_; ++r)
      dev_.copy_2d(advance(a.y, r * out, dt), size_ * row, advance(tmp.at<const void>(all), r * R * out, dt), row,
                   row, static_cast<size_t>(R), LOOM_COPY_DEVICE_TO_DEVICE);
  }

  void column_bwd(const loom_tp_linear_args& a) const {
    const int32_t dt = require_float(a.dtype);
    const int64_t R = a.rows, in = a.in, out = a.out;
    const void* x = a.x;  // the full input
    const void* w = a.weight;
    const void* dy = a.dy;
    const int32_t gt = grad_dtype(a.grad_fp32, dt);
    Arena tmp;
    const bool gathered = a.gather_output && size_ > 1;
    const size_t dyl = tmp.elems(gathered ? R * out : 0, dt);
    const bool direct = !sp_ && !a.accumulate_dx;  // dx can hold the full sum itself
    const size_t dfull = tmp.elems(a.dx && !direct ? R * in : 0, dt);
    const size_t dred = tmp.elems(a.dx && a.accumulate_dx ? local_rows(R) * in : 0, dt);
    tmp.allocate(rank_);
    if (gathered) {  // this rank's columns of the whole output's gradient
      const size_t row = static_cast<size_t>(out) * loom::dtype_size(dt);
      dev_.copy_2d(tmp.at<void>(dyl), row, advance(dy, tp_rank_ * out, dt), size_ * row, row, static_cast<size_t>(R),
                   LOOM_COPY_DEVICE_TO_DEVICE);
      dy = tmp.at<const void>(dyl);
    }
    weight_and_bias_grad(x, dy, a.dweight, a.dbias, R, in, out, dt, gt);
    if (!a.dx) return;
    void* dx = a.dx;
    void* full = direct ? dx : tmp.at<void>(dfull);
    gemm(dev_, false, true, R, in, out, dy, w, full, 0.0f, dt, dt);
    if (direct) {
      all_reduce(full, dx, R * in, dt);
    } else if (!a.accumulate_dx) {
      enter_bwd(R, in, full, dx, dt);
    } else {
      enter_bwd(R, in, full, tmp.at<void>(dred), dt);
      add(dev_, dx, tmp.at<void>(dred), dx, local_rows(R) * in, dt);
    }
  }

  void row_fwd(const loom_tp_linear_args& a) const {
    const int32_t dt = require_float(a.dtype);
    const int64_t R = a.rows, in = a.in, out = a.out;
    void* y = a.y;
    Arena tmp;
    const size_t partial = tmp.elems(sp_ ? R * out : 0, dt);
    tmp.allocate(rank_);
    void* p = sp_ ? tmp.at<void>(partial) : y;
    if (size_ == 1 && !sp_) {  // g is the identity: the bias may go into the GEMM's epilogue
      linear_fwd(dev_, a.x, a.weight, a.bias, y, R, in, out, dt);
      return;
    }
    gemm(dev_, false, false, R, out, in, a.x, a.weight, p, 0.0f, dt, dt);
    exit_fwd(R, out, p, y, dt);
    if (a.bias) add_bias(dev_, y, a.bias, y, local_rows(R), out, dt);
  }

  void row_bwd(const loom_tp_linear_args& a) const {
    const int32_t dt = require_float(a.dtype), gt = grad_dtype(a.grad_fp32, dt);
    const bool with_gelu = gelu(a);  // checked before any gradient is touched
    LOOM_REQUIRE(!with_gelu || !a.accumulate_dx,
                 name_ << ": a row-parallel backward through an activation cannot accumulate dx");
    const int64_t R = a.rows, in = a.in, out = a.out;
    const void* dy = a.dy;
    Arena tmp;
    const size_t full = tmp.elems(sp_ ? R * out : 0, dt);
    tmp.allocate(rank_);
    // The bias came after the reduction: its gradient is dy as held (the shard under SP,
    // where the weight's GEMM reads the gathered dy instead).
    const void* d = dy;
    if (sp_) {
      if (a.dbias) column_sum_acc(rank_, dev_, dy, a.dbias, local_rows(R), out, dt, gt);
      exit_bwd(R, out, dy, tmp.at<void>(full), dt);
      d = tmp.at<const void>(full);
      gemm(dev_, true, false, in, out, R, a.x, d, a.dweight, 1.0f, dt, gt);
    } else {
      weight_and_bias_grad(a.x, dy, a.dweight, a.dbias, R, in, out, dt, gt);
    }
    if (!a.dx) return;
    if (with_gelu) {  // dx is the gradient of the activation's input
      linear_dgelu_dx(dev_, d, a.weight, a.pre_activation, a.dx, R, in, out, dt);
      return;
    }
    gemm(dev_, false, true, R, in, out, d, a.weight, a.dx, a.accumulate_dx ? 1.0f : 0.0f, dt, dt);
  }

  // dweight += x^T dy and dbias += the column sums of dy (when asked): the sums in the
  // weight GEMM's epilogue where the device fuses it.
  void weight_and_bias_grad(const void* x, const void* dy, void* dweight, void* dbias, int64_t R, int64_t in,
                            int64_t out, int32_t dt, int32_t gt) const {
    if (dbias && fused_gemm_epilogues(dev_)) {
      gemm(dev_, true, false, in, out, R, x, dy, dweight, 1.0f, dt, gt, 1.0f,
           {.kind = LOOM_GEMM_EPILOGUE_BIAS_GRAD, .aux = dbias});
      return;
    }
    gemm(dev_, true, false, in, out, R, x, dy, dweight, 1.0f, dt, gt);
    if (dbias) column_sum_acc(rank_, dev_, dy, dbias, R, out, dt, gt);
  }

  // ABI 1.11's activation of a linear call (0 from an older caller).
  bool gelu(const loom_tp_linear_args& a) const {
    LOOM_REQUIRE(a.activation == LOOM_TP_ACTIVATION_NONE || a.activation == LOOM_TP_ACTIVATION_GELU,
                 name_ << ": activation " << a.activation << " is not a LOOM_TP_ACTIVATION_* value");
    if (a.activation == LOOM_TP_ACTIVATION_NONE) return false;
    LOOM_REQUIRE(a.pre_activation != nullptr, name_ << ": a linear call with an activation needs pre_activation");
    return true;
  }

  // ----- vocabulary ----------------------------------------------------------

  loom_tp_vocab_range vocab_range(int64_t vocab, int64_t padded) const {
    LOOM_REQUIRE(padded >= vocab && padded % size_ == 0,
                 name_ << ": padded vocabulary " << padded << " must be >= the vocabulary (" << vocab
                       << ") and divisible by the tensor-parallel size (" << size_ << ")");
    loom_tp_vocab_range r = loom::make<loom_tp_vocab_range>();
    r.rows = padded / size_;
    r.start = static_cast<int64_t>(tp_rank_) * r.rows;
    // Padded rows (and whole slices past the real vocabulary) never take part.
    r.valid = std::clamp<int64_t>(vocab - r.start, 0, r.rows);
    return r;
  }

  void embedding_fwd(const loom_tp_embedding_args& a) const {
    const int32_t dt = require_float(a.dtype);
    const loom_tp_vocab_range v = vocab_range(a.padded_vocab, a.padded_vocab);
    Arena tmp;
    const size_t full = tmp.elems(sp_ ? a.rows * a.dim : 0, dt);
    tmp.allocate(rank_);
    void* out = a.out;
    void* y = sp_ ? tmp.at<void>(full) : out;
    dev_.embedding_fwd({.n = a.rows, .dim = a.dim, .vocab_rows = v.rows, .vocab_start = v.start, .ids = a.ids,
                        .table = a.table, .out = y, .accumulate = 0, .dtype = dt});
    exit_fwd(a.rows, a.dim, y, out, dt);  // g: the other slices' rows
  }

  void embedding_bwd(const loom_tp_embedding_args& a) const {
    const int32_t dt = require_float(a.dtype);
    const bool fp32_table = grad_dtype(a.grad_fp32, dt) != dt;
    LOOM_REQUIRE(!fp32_table || (dev_.features() & LOOM_DEVICE_GRAD_FP32),
                 name_ << ": grad_fp32 needs a device with LOOM_DEVICE_GRAD_FP32 (an ABI 1.2 device plugin)");
    const loom_tp_vocab_range v = vocab_range(a.padded_vocab, a.padded_vocab);
    Arena tmp;
    const size_t full = tmp.elems(sp_ ? a.rows * a.dim : 0, dt);
    tmp.allocate(rank_);
    const void* d = a.dout;
    if (sp_) {
      exit_bwd(a.rows, a.dim, d, tmp.at<void>(full), dt);
      d = tmp.at<const void>(full);
    }
    // Each rank scatters every token's gradient into its own vocab slice.
    dev_.embedding_bwd({.n = a.rows, .dim = a.dim, .vocab_rows = v.rows, .vocab_start = v.start, .ids = a.ids,
                        .dout = d, .dtable = a.dtable, .dtype = dt, .grad_fp32 = fp32_table ? 1 : 0});
  }

  // ----- logits fused with cross-entropy -----------------------------------

  loom_xent_args xent_args(const loom_tp_xent_args& a, const loom_tp_vocab_range& v) const {
    loom_xent_args xa = loom::make<loom_xent_args>();
    xa.rows = a.rows;
    xa.cols = v.rows;
    xa.ld = v.rows;
    xa.valid_cols = v.valid;
    xa.vocab_start = v.start;
    xa.logits = a.logits;
    xa.targets = a.targets;
    xa.row_max = a.stats;
    xa.row_sumexp = a.stats + a.rows;
    xa.target_logit = a.stats + 2 * a.rows;
    xa.loss = a.loss;
    xa.scale = 1.0f;
    xa.dtype = a.dtype;
    return xa;
  }

  void xent_fwd(const loom_tp_xent_args& a) const {
    const int32_t dt = require_float(a.dtype);
    const int64_t T = a.rows, H = a.hidden;
    const loom_tp_vocab_range v = vocab_range(a.vocab, a.padded_vocab);
    const int64_t Vl = v.rows;
    const void* x = a.x;
    if (sp_) {
      LOOM_REQUIRE(a.x_full != nullptr, name_ << ": cross-entropy under sequence parallelism needs x_full");
      enter_fwd(T, H, x, a.x_full, dt);
      x = a.x_full;
    }
    void* logits = a.logits;
    gemm(dev_, false, true, T, Vl, H, x, a.weight, logits, 0.0f, dt, dt);

    float* row_max = a.stats;
    float* sums = a.stats + T;  // sum-exp then target logit: one all-reduce
    loom_xent_args xa = xent_args(a, v);
    xa.step = LOOM_XENT_ROW_MAX;
    dev_.xent(xa);
    // Predictions: this rank's argmax over its real columns and its local max,
    // taken before row_max becomes the global max.
    std::vector<int32_t> local_arg;
    std::vector<float> local_max;
    if (a.predictions) {
      local_arg.assign(static_cast<size_t>(T), 0);
      local_max.assign(static_cast<size_t>(T), -std::numeric_limits<float>::infinity());
      if (v.valid > 0) {
        Arena am;
        const size_t idx = am.add(T * sizeof(int32_t));
        am.allocate(rank_);
        dev_.reduce({.op = LOOM_RED_ROW_ARGMAX, .n = T * v.valid, .cols = v.valid, .x = logits,
                     .out = am.at<int32_t>(idx), .dtype = dt, .out_dtype = LOOM_DTYPE_I32, .ld = Vl});
        dev_.copy(local_arg.data(), am.at<int32_t>(idx), T * sizeof(int32_t), LOOM_COPY_DEVICE_TO_HOST);
        dev_.copy(local_max.data(), row_max, T * sizeof(float), LOOM_COPY_DEVICE_TO_HOST);
        dev_.synchronize();
      }
    }
    comm().all_reduce(stream(), row_max, row_max, static_cast<size_t>(T), LOOM_DTYPE_F32, LOOM_REDUCE_MAX);
    if (a.predictions) {
      // The winner is the lowest vocab id whose logit equals the global max.
      std::vector<float> global_max(static_cast<size_t>(T));
      dev_.copy(global_max.data(), row_max, T * sizeof(float), LOOM_COPY_DEVICE_TO_HOST);
      dev_.synchronize();
      for (int64_t r = 0; r < T; ++r)
        a.predictions[r] = (v.valid > 0 && local_max[r] == global_max[r])
                               ? static_cast<int32_t>(v.start + local_arg[r])
                               : std::numeric_limits<int32_t>::max();
      comm().all_reduce(nullptr, a.predictions, a.predictions, static_cast<size_t>(T), LOOM_DTYPE_I32,
                        LOOM_REDUCE_MIN);
    }
    xa.step = LOOM_XENT_SUMEXP;
    dev_.xent(xa);
    comm().all_reduce(stream(), sums, sums, static_cast<size_t>(2 * T), LOOM_DTYPE_F32, LOOM_REDUCE_SUM);
    xa.step = LOOM_XENT_LOSS;
    dev_.xent(xa);
  }

  void xent_bwd(const loom_tp_xent_args& a) const {
    const int32_t dt = require_float(a.dtype), gt = grad_dtype(a.grad_fp32, dt);
    const int64_t T = a.rows, H = a.hidden;
    const loom_tp_vocab_range v = vocab_range(a.vocab, a.padded_vocab);
    const int64_t Vl = v.rows;
    const void* x = a.x;  // the full input
    const void* w = a.weight;
    // The gradient of the logits over the logits themselves when the caller drops them
    // after this call and the device can (Megatron's in-place backward): no [T, V/tp]
    // buffer, the largest of a step with a real vocabulary.
    const bool in_place = a.logits_scratch != 0 && (dev_.features() & LOOM_DEVICE_XENT_IN_PLACE) != 0;
    Arena tmp;
    const size_t dlogits = tmp.elems(in_place ? 0 : T * Vl, dt), dfull = tmp.elems(T * H, dt);
    const size_t dred = tmp.elems(a.dx && a.accumulate_dx ? local_rows(T) * H : 0, dt);
    tmp.allocate(rank_);
    void* g = in_place ? a.logits : tmp.at<void>(dlogits);
    // dlogits = scale * (softmax - onehot) on the local slice.
    loom_xent_args xa = xent_args(a, v);
    xa.step = LOOM_XENT_BACKWARD;
    xa.dlogits = g;
    xa.scale = a.scale;
    dev_.xent(xa);
    gemm(dev_, true, false, Vl, H, T, g, x, a.dweight, 1.0f, dt, gt);
    if (!a.dx) return;
    void* dx = a.dx;
    gemm(dev_, false, false, T, H, Vl, g, w, tmp.at<void>(dfull), 0.0f, dt, dt);
    if (a.accumulate_dx) {
      enter_bwd(T, H, tmp.at<void>(dfull), tmp.at<void>(dred), dt);
      add(dev_, dx, tmp.at<void>(dred), dx, local_rows(T) * H, dt);
    } else {
      enter_bwd(T, H, tmp.at<void>(dfull), dx, dt);
    }
  }

  // ----- the model-parallel RNG ----------------------------------------------

  void dropout_fwd(const loom_tp_dropout_args& a) const {
    const int32_t dt = require_float(a.dtype);
    uint64_t seed = dropout_key(name_);  // a.microbatch is not mixed in: a.seed names the samples
    if (a.stream != 0) seed = mix64(seed ^ mix64(0x5bd1e995ull + static_cast<uint64_t>(a.stream)));
    // The a.n elements are rows [first, first + a.n) of this cp rank's slice of
    // `slice` elements (position-major, so its two context chunks are halves).
    int64_t first = 0, slice = a.n;
    if (a.region == LOOM_TP_RNG_PARALLEL) {
      // A stream of this tp rank's own (Megatron: the model-parallel tracker).
      seed = mix64(seed ^ mix64(0x2718281828459045ull + static_cast<uint64_t>(tp_rank_)));
    } else {
      LOOM_REQUIRE(a.region == LOOM_TP_RNG_DUPLICATED, name_ << ": unknown dropout region " << a.region);
      // One stream on every tp rank; under SP this rank holds block tp_rank of it.
      if (sp_) {
        first = tp_rank_ * a.n;
        slice = size_ * a.n;
      }
    }
    // The step's seed last: by address when the device reads it at run time (a
    // captured dropout then draws a new mask every step), else here; same mask.
    const bool on_device = a.seed_device != nullptr && (dev_.features() & LOOM_DEVICE_SEED_DEVICE) != 0;
    // Each run of consecutive elements draws from its offset in the whole sequence
    // (one run without context parallelism: offset = first).
    const loom::ContextSlice context(slice * cp_.size(), cp_.size(), cp_.rank());
    for (const loom::ContextSlice::Run& run : context.runs(first, first + a.n)) {
      const int64_t at = run.local - first;
      dev_.elementwise({.op = LOOM_EW_DROPOUT, .n = run.length, .x = advance(a.x, at, dt),
                        .y = static_cast<uint8_t*>(a.mask) + at, .out = advance(a.out, at, dt), .p = a.p,
                        .seed = on_device ? seed : loom_mix64(seed ^ loom_mix64(a.seed)),
                        .offset = static_cast<uint64_t>(run.position), .dtype = dt, .out_dtype = dt,
                        .seed_device = on_device ? a.seed_device : nullptr});
    }
  }

 private:
  void* stream() const { return dev_.native_stream(); }
  const loom::Group& comm() const {
    LOOM_REQUIRE(size_ == 1 || has_comm_,
                 name_ << ": the tp group of " << size_ << " ranks has no communicator");
    return group_;
  }
  // Activations (and the weights and weight gradients handed in) are fp32 or bf16;
  // the statistics (xent stats, loss) are fp32 either way.
  int32_t require_float(int32_t dtype) const {
    LOOM_REQUIRE(dtype == LOOM_DTYPE_F32 || dtype == LOOM_DTYPE_BF16,
                 name_ << ": parallel/tensor supports float32 and bfloat16 activations, got dtype " << dtype);
    return dtype;
  }
  // out = the sum over tp of x (a copy on one rank; in place when x == out).
  void all_reduce(const void* x, void* out, int64_t n, int32_t dt) const {
    if (size_ == 1) copy_d2d(dev_, out, x, static_cast<size_t>(n) * loom::dtype_size(dt));
    else comm().all_reduce(stream(), x, out, static_cast<size_t>(n), dt);
  }
  // The dtype of the parameter gradients of a backward: fp32 with grad_fp32 (1.2),
  // else the activations'.
  int32_t grad_dtype(int32_t grad_fp32, int32_t dt) const {
    LOOM_REQUIRE(grad_fp32 == 0 || grad_fp32 == 1, name_ << ": grad_fp32 must be 0 or 1 (got " << grad_fp32 << ")");
    return grad_fp32 ? LOOM_DTYPE_F32 : dt;
  }

  loom_rank* rank_;
  loom::Group group_;
  std::string name_;
  int size_ = 1, tp_rank_ = 0;
  loom::Group cp_;  // context parallelism: where this rank's rows sit in the sequence
  bool sp_ = false, has_comm_ = false;
  loom::Device dev_;
};

Tp* tp(loom_tp* h) { return reinterpret_cast<Tp*>(h); }

template <typename Args, typename Fn>
loom_status call(loom_tp* h, const Args* a, Fn&& fn) {
  return loom::guard([&] {
    LOOM_REQUIRE(h != nullptr && a != nullptr, "parallel/tensor: handle and arguments are required");
    LOOM_REQUIRE(a->struct_size >= sizeof(uint32_t), "parallel/tensor: arguments without struct_size");
    if (a->struct_size >= sizeof(Args)) {
      fn(*tp(h), *a);
    } else {  // an older caller: the members it lacks are zero
      Args full = loom::make<Args>();
      std::memcpy(&full, a, a->struct_size);
      full.struct_size = sizeof(Args);
      fn(*tp(h), full);
    }
  });
}

const loom_tensor_parallel_api* tensor_parallel_api() {
  static const loom_tensor_parallel_api api = [] {
    loom_tensor_parallel_api t = loom::make<loom_tensor_parallel_api>();
    t.create = [](loom_rank* rank, const loom_tp_create_args* args, loom_tp** out) -> loom_status {
      return loom::guard([&] {
        LOOM_REQUIRE(args != nullptr && out != nullptr, "parallel/tensor: create needs args and out");
        *out = reinterpret_cast<loom_tp*>(new Tp(rank, *args));
      });
    };
    t.destroy = [](loom_tp* h) { delete tp(h); };
    t.padded_vocab = [](int64_t vocab, int64_t divisor, int32_t tp_size) -> int64_t {
      const int64_t m = std::max<int64_t>(1, divisor) * std::max<int32_t>(1, tp_size);
      return (vocab + m - 1) / m * m;
    };
    t.vocab_range = [](loom_tp* h, int64_t vocab, int64_t padded, loom_tp_vocab_range* out) -> loom_status {
      return loom::guard([&] {
        LOOM_REQUIRE(h != nullptr && out != nullptr, "parallel/tensor: vocab_range needs a handle and out");
        const loom_tp_vocab_range r = tp(h)->vocab_range(vocab, padded);
        const uint32_t size = out->struct_size;
        std::memcpy(out, &r, std::min<size_t>(size, sizeof(r)));
        out->struct_size = size;
      });
    };
    using R = loom_tp_region_args;
    t.enter_forward = [](loom_tp* h, const R* a) { return call(h, a, [](Tp& t, const R& r) { t.region(r, 0); }); };
    t.enter_backward = [](loom_tp* h, const R* a) { return call(h, a, [](Tp& t, const R& r) { t.region(r, 1); }); };
    t.exit_forward = [](loom_tp* h, const R* a) { return call(h, a, [](Tp& t, const R& r) { t.region(r, 2); }); };
    t.exit_backward = [](loom_tp* h, const R* a) { return call(h, a, [](Tp& t, const R& r) { t.region(r, 3); }); };
    using L = loom_tp_linear_args;
    t.column_linear_forward = [](loom_tp* h, const L* a) {
      return call(h, a, [](Tp& t, const L& r) { t.column_fwd(r); });
    };
    t.column_linear_backward = [](loom_tp* h, const L* a) {
      return call(h, a, [](Tp& t, const L& r) { t.column_bwd(r); });
    };
    t.row_linear_forward = [](loom_tp* h, const L* a) { return call(h, a, [](Tp& t, const L& r) { t.row_fwd(r); }); };
    t.row_linear_backward = [](loom_tp* h, const L* a) { return call(h, a, [](Tp& t, const L& r) { t.row_bwd(r); }); };
    using E = loom_tp_embedding_args;
    t.embedding_forward = [](loom_tp* h, const E* a) {
      return call(h, a, [](Tp& t, const E& r) { t.embedding_fwd(r); });
    };
    t.embedding_backward = [](loom_tp* h, const E* a) {
      return call(h, a, [](Tp& t, const E& r) { t.embedding_bwd(r); });
    };
    using X = loom_tp_xent_args;
    t.xent_forward = [](loom_tp* h, const X* a) { return call(h, a, [](Tp& t, const X& r) { t.xent_fwd(r); }); };
    t.xent_backward = [](loom_tp* h, const X* a) { return call(h, a, [](Tp& t, const X& r) { t.xent_bwd(r); }); };
    using D = loom_tp_dropout_args;
    t.dropout_forward = [](loom_tp* h, const D* a) {
      return call(h, a, [](Tp& t, const D& r) { t.dropout_fwd(r); });
    };
    t.features = LOOM_TP_GRAD_FP32 | LOOM_TP_SEED_DEVICE | LOOM_TP_ACTIVATION;
    return t;
  }();
  return &api;
}

}  // namespace

LOOM_PLUGIN_LIBRARY(loom::raw_plugin("parallel", "tensor", "1.0.0",
                                     "tensor-parallel services: column/row-parallel linear (f/g), vocab-parallel "
                                     "embedding and cross-entropy, vocab padding, model-parallel RNG, sequence "
                                     "parallelism",
                                     LOOM_API_TENSOR_PARALLEL, tensor_parallel_api()))
