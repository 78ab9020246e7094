// loom C++ layer: the tensor-parallel service (ABI 1.1+, plugin parallel/tensor)
// as a layer uses it. One TensorParallel per layer instance:
//
//   tp_ = loom::TensorParallel(rank.raw(), args.tp, args.sequence_parallel, args.instance_name);
//   tp_.column_parallel_linear_forward({.rows = T, .in = H, .out = F / tp_.size(), .x = ln,
//                                       .x_full = ln_full, .weight = w1, .bias = b1, .y = h});
//   ...
//   tp_.row_parallel_linear_forward({.rows = T, .in = F / tp_.size(), .out = H, .x = act,
//                                    .weight = w2, .bias = b2, .y = out});
//
// The argument structs are the C ones of loom_tp.h (struct_size is filled in
// here); every failure throws loom::Error. With tp = 1 the calls are the plain
// local math. Under sequence parallelism activations outside TP regions are this
// rank's sequence shard: local_rows(rows) of them.
#pragma once

#include <loom/cpp/core.hpp>
#include <loom/loom_tp.h>

#include <string>
#include <utility>

namespace loom {

class TensorParallel {
 public:
  TensorParallel() = default;
  // Opens a handle on the service the run configured (manifest parallel.tensor).
  TensorParallel(loom_rank* rank, const loom_group& tp, bool sequence_parallel, const std::string& instance) {
    const loom_host_api& h = host();
    if (!LOOM_HAS_SLOT(&h, loom_host_api, service) || h.service == nullptr)
      throw Error("the host table has no service slot (loom_host_api.service)", LOOM_CODE_UNSUPPORTED);
    api_ = static_cast<const loom_tensor_parallel_api*>(h.service(rank, LOOM_API_TENSOR_PARALLEL, nullptr));
    if (api_ == nullptr)
      throw Error("no tensor-parallel service is loaded (plugin parallel/tensor, manifest key parallel.tensor)",
                  LOOM_CODE_NOT_FOUND);
    loom_tp_create_args a = make<loom_tp_create_args>();
    a.tp = tp;
    if (a.tp.size <= 0) a.tp.size = 1;
    a.sequence_parallel = sequence_parallel ? 1 : 0;
    a.instance_name = instance.c_str();
    check(api_->create(rank, &a, &handle_));
    size_ = a.tp.size;
    rank_ = a.tp.rank;
    sp_ = sequence_parallel && size_ > 1;
  }
  ~TensorParallel() { reset(); }
  TensorParallel(const TensorParallel&) = delete;
  TensorParallel& operator=(const TensorParallel&) = delete;
  TensorParallel(TensorParallel&& o) noexcept { *this = std::move(o); }
  TensorParallel& operator=(TensorParallel&& o) noexcept {
    if (this != &o) {
      reset();
      std::swap(api_, o.api_);
      std::swap(handle_, o.handle_);
      size_ = o.size_;
      rank_ = o.rank_;
      sp_ = o.sp_;
    }
    return *this;
  }
  void reset() {
    if (api_ && handle_) api_->destroy(handle_);
    handle_ = nullptr;
  }

  int size() const { return size_; }
  int rank() const { return rank_; }
  bool sequence_parallel() const { return sp_; }
  // Rows of an activation outside TP regions (the sequence shard under SP).
  int64_t local_rows(int64_t rows) const { return sp_ ? rows / size_ : rows; }

  // LOOM_TP_* capability bits of the service (none for a 1.1 service).
  uint64_t features() const {
    return LOOM_HAS_SLOT(api_, loom_tensor_parallel_api, features) ? api_->features : 0;
  }

  int64_t padded_vocab(int64_t vocab, int64_t divisor) const { return api_->padded_vocab(vocab, divisor, size_); }
  loom_tp_vocab_range vocab_range(int64_t vocab, int64_t padded_vocab) const {
    loom_tp_vocab_range r = make<loom_tp_vocab_range>();
    check(api_->vocab_range(handle_, vocab, padded_vocab, &r));
    return r;
  }

#define LOOM_TP_CALL(method, slot, argtype)                                                 \
  void method(argtype a) const {                                                            \
    a.struct_size = sizeof(a);                                                              \
    if (!LOOM_HAS_SLOT(api_, loom_tensor_parallel_api, slot) || api_->slot == nullptr)      \
      throw Error("the tensor-parallel service does not implement '" #slot "'",             \
                  LOOM_CODE_UNSUPPORTED);                                                   \
    check(api_->slot(handle_, &a));                                                         \
  }
  // f and g on their own (see loom_tp_region_args).
  LOOM_TP_CALL(enter_forward, enter_forward, loom_tp_region_args)
  LOOM_TP_CALL(enter_backward, enter_backward, loom_tp_region_args)
  LOOM_TP_CALL(exit_forward, exit_forward, loom_tp_region_args)
  LOOM_TP_CALL(exit_backward, exit_backward, loom_tp_region_args)
  LOOM_TP_CALL(column_parallel_linear_forward, column_linear_forward, loom_tp_linear_args)
  LOOM_TP_CALL(column_parallel_linear_backward, column_linear_backward, loom_tp_linear_args)
  LOOM_TP_CALL(row_parallel_linear_forward, row_linear_forward, loom_tp_linear_args)
  LOOM_TP_CALL(row_parallel_linear_backward, row_linear_backward, loom_tp_linear_args)
  LOOM_TP_CALL(vocab_parallel_embedding_forward, embedding_forward, loom_tp_embedding_args)
  LOOM_TP_CALL(vocab_parallel_embedding_backward, embedding_backward, loom_tp_embedding_args)
  LOOM_TP_CALL(vocab_parallel_cross_entropy_forward, xent_forward, loom_tp_xent_args)
  LOOM_TP_CALL(vocab_parallel_cross_entropy_backward, xent_backward, loom_tp_xent_args)
  LOOM_TP_CALL(dropout_forward, dropout_forward, loom_tp_dropout_args)
#undef LOOM_TP_CALL

 private:
  const loom_tensor_parallel_api* api_ = nullptr;
  loom_tp* handle_ = nullptr;
  int size_ = 1, rank_ = 0;
  bool sp_ = false;
};

}  // namespace loom
