// parallel/ddp: data-parallel gradient averaging plus AdamW on every rank.
//
// Gradients are all-reduced over the dp group (averaged) bucket by bucket, as the
// engine laid the buffers out: in step, or, when the engine announces final
// gradients during the backward (ABI 1.15 grads_ready, optimizer.overlap_grad_reduce),
// each bucket as soon as it is complete, on the comm plugin's own thread or stream,
// waited for in step (Megatron-LM's overlap_grad_reduce). Either way each bucket is
// the same collective, so results do not depend on the overlap. Then take the
// global gradient norm (summed over this
// rank's parameters, counting tp-duplicated ones on tp rank 0 only and tied
// pipeline copies on their owning stage only, then reduced over tp and pp), clip, and step AdamW on fp32 master weights.
// Expert parallelism (ABI 1.4): the expert parameters, the buffers' tail, differ
// across the ep group; their gradients already hold the contributions of every
// dp rank of that group (the tokens came to them by all-to-all), so they are
// summed over edp and scaled by 1 / dp, and their norm is summed over ep too.
// MoE folding (ABI 1.5, etp != tp): the experts are split over etp, not tp, and
// the ep group spans tp ranks, so their norm is summed over ep and etp and the
// dense part's over tp.
#include <loom/cpp/plugin.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

class Ddp : public loom::OptimizerStrategy {
 public:
  static constexpr uint64_t kFeatures = LOOM_OPTIMIZER_EXPERT_PARALLEL | LOOM_OPTIMIZER_EXPERT_FOLDING;
  Ddp(const loom::Options&, loom::Rank& rank, const loom_optimizer_create_args& a)
      : rank_(rank.raw()), params_(a.params), grads_(a.grads), numel_(a.numel),
        param_dtype_(a.param_dtype), grad_dtype_(a.grad_dtype), dp_(a.dp), tp_(a.tp), pp_(a.pp) {
    if (loom::expert_parallel(a)) {
      ep_ = a.ep;
      edp_ = a.edp;
      expert_start_ = loom::expert_tail_start(a);
      if (loom::experts_fold_tp(a)) etp_ = loom::expert_tp_group(a);
    }
    LOOM_REQUIRE(grad_dtype_ == LOOM_DTYPE_F32 || grad_dtype_ == LOOM_DTYPE_BF16,
                 "parallel/ddp: gradient dtype " << grad_dtype_ << " is not supported");
    for (size_t i = 0; i < a.num_params; ++i) {
      const loom_param_info& p = a.infos[i];
      infos_.push_back(
          {p.offset, p.numel, p.no_weight_decay != 0, loom::counted_elsewhere(a, i), p.offset >= expert_start_});
    }
    buckets_ = loom::bucket_ranges(a);
    for (const auto& [start, end] : buckets_)
      LOOM_REQUIRE(end <= expert_start_ || start >= expert_start_,
                   "parallel/ddp: bucket [" << start << ", " << end << ") holds dense and expert parameters");
    ready_ = loom::BucketReadiness(a, buckets_);
    requests_.resize(buckets_.size());
    loom::Device dev = rank.device();
    multi_ = multi_tensor_step(dev);
    m_ = loom::Buffer(rank_, numel_ * sizeof(float));
    v_ = loom::Buffer(rank_, numel_ * sizeof(float));
    norm_parts_ = loom::Buffer(rank_, std::max<size_t>(1, infos_.size()) * sizeof(float));
    norm_total_ = loom::Buffer(rank_, sizeof(double));
    zero(dev, m_.get(), numel_);
    zero(dev, v_.get(), numel_);
    if (param_dtype_ != LOOM_DTYPE_F32) {  // master weights in fp32, model weights a cast copy
      main_ = loom::Buffer(rank_, numel_ * sizeof(float));
      dev.elementwise({.op = LOOM_EW_CAST, .n = static_cast<int64_t>(numel_), .x = params_, .out = main_.get(),
                       .dtype = param_dtype_, .out_dtype = LOOM_DTYPE_F32});
    }
  }

  // The buckets these parameters complete start their all-reduce now.
  void grads_ready(loom::Rank& rank, const size_t* params, size_t n) override {
    for (size_t b : ready_.announce(params, n)) requests_[b] = reduce_bucket(rank.device().native_stream(), b, true);
  }

  float step(loom::Rank& rank, const loom_optimizer_step_args& a) override {
    loom::Device dev = rank.device();
    void* stream = dev.native_stream();
    loom::Group dp(dp_);
    // 1. average gradients over data-parallel replicas, bucket by bucket (those
    // started during the backward are waited for); an expert bucket is summed over
    // edp, then scaled as the average over dp.
    for (size_t b = 0; b < buckets_.size(); ++b) {
      if (requests_[b].pending()) requests_[b].wait();
      else reduce_bucket(stream, b, false);
      if (is_expert_bucket(b) && dp.size() > 1) {
        const size_t n = buckets_[b].second - buckets_[b].first;
        char* g = static_cast<char*>(grads_) + buckets_[b].first * elem(grad_dtype_);
        dev.elementwise({.op = LOOM_EW_SCALE, .n = static_cast<int64_t>(n), .x = g, .out = g,
                         .alpha = 1.f / static_cast<float>(dp.size()), .dtype = grad_dtype_,
                         .out_dtype = grad_dtype_});
      }
    }
    ready_.reset();

    // 2. global norm: this rank's share (one fp32 partial per parameter, copied to
    // the host at once and summed in double), then the model-parallel sum on a
    // device scalar, so a GPU communicator gets device memory on the stream.
    std::vector<bool> expert_part;
    for (const Info& p : infos_) {
      if (p.counted_elsewhere) continue;
      if (!multi_.enabled())
        dev.reduce({.op = LOOM_RED_SUM_SQUARES, .n = static_cast<int64_t>(p.numel),
                    .x = static_cast<char*>(grads_) + p.offset * elem(grad_dtype_),
                    .out = norm_parts_.get<float>() + expert_part.size(), .dtype = grad_dtype_,
                    .out_dtype = LOOM_DTYPE_F32});
      expert_part.push_back(p.expert);
    }
    if (multi_.enabled()) multi_.norm_parts(dev, grads_, grad_dtype_, norm_parts_.get<float>());
    const size_t k = expert_part.size();
    std::vector<float> parts(k);
    if (k > 0) dev.copy(parts.data(), norm_parts_.get(), k * sizeof(float), LOOM_COPY_DEVICE_TO_HOST);
    dev.synchronize();
    double total = 0, experts = 0;
    for (size_t i = 0; i < k; ++i) (expert_part[i] ? experts : total) += parts[i];
    void* scratch = norm_total_.get();
    if (etp_.size > 0) {  // folded: each part over its own model-parallel ranks
      total = loom::all_reduce_sum(dev, scratch, total, {tp_, pp_}) +
              loom::all_reduce_sum(dev, scratch, experts, {ep_, etp_, pp_});
    } else {
      if (expert_start_ < numel_)  // every ep rank holds other experts
        total += loom::all_reduce_sum(dev, scratch, experts, {ep_});
      total = loom::all_reduce_sum(dev, scratch, total, {tp_, pp_});
    }
    const float norm = static_cast<float>(std::sqrt(total));
    float scale = 1.f;
    if (a.clip_grad > 0 && norm > a.clip_grad) scale = a.clip_grad / (norm + 1e-6f);

    // 3. AdamW on each parameter (weight decay only where the layer allows it)
    if (multi_.enabled()) {
      multi_.adamw(dev, {.param = static_cast<float*>(main_ ? main_.get() : params_), .grad = grads_,
                         .m = m_.get<float>(), .v = v_.get<float>(), .grad_dtype = grad_dtype_, .lr = a.lr,
                         .beta1 = a.beta1, .beta2 = a.beta2, .eps = a.eps, .weight_decay = a.weight_decay,
                         .grad_scale = scale, .step = a.step, .param_copy = main_ ? params_ : nullptr,
                         .copy_dtype = param_dtype_});
      return norm;
    }
    for (const Info& p : infos_) {
      float* master = static_cast<float*>(main_ ? main_.get() : params_) + p.offset;
      dev.adamw({.n = static_cast<int64_t>(p.numel), .param = master,
                 .grad = static_cast<char*>(grads_) + p.offset * elem(grad_dtype_),
                 .m = m_.get<float>() + p.offset, .v = v_.get<float>() + p.offset, .grad_dtype = grad_dtype_,
                 .lr = a.lr, .beta1 = a.beta1, .beta2 = a.beta2, .eps = a.eps,
                 .weight_decay = p.no_weight_decay ? 0.f : a.weight_decay, .grad_scale = scale, .step = a.step,
                 .param_copy = main_ ? static_cast<char*>(params_) + p.offset * elem(param_dtype_) : nullptr,
                 .copy_dtype = param_dtype_});
    }
    return norm;
  }

  // State: m and v (and the fp32 master weights when the model weights are not fp32).
  size_t state_size() override { return numel_ * sizeof(float) * (main_ ? 3 : 2); }
  void state_save(void* buf, size_t bytes) override {
    LOOM_REQUIRE(bytes == state_size(), "parallel/ddp: state buffer of " << bytes << " bytes, expected " << state_size());
    transfer(buf, LOOM_COPY_DEVICE_TO_HOST);
  }
  void state_load(const void* buf, size_t bytes) override {
    LOOM_REQUIRE(bytes == state_size(), "parallel/ddp: checkpointed optimizer state has " << bytes
                                            << " bytes but this model needs " << state_size()
                                            << " (was it saved with another model or parallel layout?)");
    transfer(const_cast<void*>(buf), LOOM_COPY_HOST_TO_DEVICE);
  }
  // ABI 1.14: a blob is m, v (and master weights) over the whole buffer, every
  // element held (each dp replica saved the same).
  static void state_decode(const void* buf, size_t bytes, loom_optimizer_elements& out) {
    const size_t per_array = out.numel * sizeof(float);
    LOOM_REQUIRE(per_array > 0 && bytes % per_array == 0 && (bytes / per_array == 2 || bytes / per_array == 3),
                 "parallel/ddp: the checkpointed optimizer state has " << bytes << " bytes, not 2 or 3 arrays over its "
                                                                       << out.numel << "-element buffer");
    out.num_arrays = static_cast<uint32_t>(bytes / per_array);
    if (out.arrays == nullptr) return;
    for (uint32_t k = 0; k < out.num_arrays; ++k)
      std::memcpy(out.arrays[k], static_cast<const char*>(buf) + k * per_array, per_array);
    if (out.held != nullptr) std::fill(out.held, out.held + out.numel, uint8_t{1});
  }

  void state_import(const loom_optimizer_elements& in) override {
    const size_t arrays = main_ ? 3 : 2;
    LOOM_REQUIRE(in.numel == numel_ && in.num_arrays == arrays,
                 "parallel/ddp: state of " << in.num_arrays << " arrays over " << in.numel << " elements for a buffer of "
                                           << numel_ << " that keeps " << arrays
                                           << " (m, v, and master weights when parameters are not fp32)");
    std::vector<float> host(arrays * numel_);
    for (size_t k = 0; k < arrays; ++k) std::memcpy(host.data() + k * numel_, in.arrays[k], numel_ * sizeof(float));
    transfer(host.data(), LOOM_COPY_HOST_TO_DEVICE);
  }

  // Another dp size pads the buffers differently, so each parameter moves: its
  // m, v (and master weights) go from its old offset to its new one; padding gets
  // zeros. Every dp replica saved the same state; old dp rank 0's copy is used.
  void state_load_resharded(const loom_optimizer_reshard_args& a) override {
    const size_t arrays = main_ ? 3 : 2;
    LOOM_REQUIRE(a.old_dp >= 1 && a.states != nullptr && a.state_bytes != nullptr && a.states[0] != nullptr,
                 "parallel/ddp: resharding needs the saved state of old dp rank 0 (old dp = " << a.old_dp << ")");
    LOOM_REQUIRE(a.state_bytes[0] == a.old_numel * sizeof(float) * arrays,
                 "parallel/ddp: the checkpointed optimizer state has " << a.state_bytes[0] << " bytes but "
                     << arrays << " arrays over the checkpoint's " << a.old_numel << "-element buffer need "
                     << a.old_numel * sizeof(float) * arrays
                     << " (was it saved with another optimizer.strategy or device.param_dtype?)");
    LOOM_REQUIRE(a.num_params == infos_.size() && a.old_offsets != nullptr && a.old_numels != nullptr,
                 "parallel/ddp: the checkpoint's layout lists " << a.num_params << " parameters but this model has "
                                                                << infos_.size()
                                                                << " on this rank; the model differs from the "
                                                                   "checkpoint's");
    const float* old = static_cast<const float*>(a.states[0]);
    std::vector<float> host(numel_ * arrays, 0.f);
    for (size_t i = 0; i < infos_.size(); ++i) {
      LOOM_REQUIRE(a.old_numels[i] == infos_[i].numel && a.old_offsets[i] + a.old_numels[i] <= a.old_numel,
                   "parallel/ddp: parameter " << i << " held " << a.old_numels[i] << " elements at offset "
                                              << a.old_offsets[i] << " in the checkpoint but has " << infos_[i].numel
                                              << " here; the model differs from the checkpoint's");
      for (size_t k = 0; k < arrays; ++k)
        std::memcpy(host.data() + k * numel_ + infos_[i].offset, old + k * a.old_numel + a.old_offsets[i],
                    infos_[i].numel * sizeof(float));
    }
    transfer(host.data(), LOOM_COPY_HOST_TO_DEVICE);
  }

 private:
  struct Info {
    size_t offset, numel;
    bool no_weight_decay, counted_elsewhere, expert;
  };

  static size_t elem(int32_t dtype) { return loom::dtype_size(dtype); }
  bool is_expert_bucket(size_t b) const { return buckets_[b].first >= expert_start_; }

  // Bucket b's all-reduce: a dense one averaged over dp, an expert one summed over
  // edp; started (the request returned) or in line.
  loom::CommRequest reduce_bucket(void* stream, size_t b, bool start) const {
    char* g = static_cast<char*>(grads_) + buckets_[b].first * elem(grad_dtype_);
    const size_t n = buckets_[b].second - buckets_[b].first;
    const int32_t op = is_expert_bucket(b) ? LOOM_REDUCE_SUM : LOOM_REDUCE_AVG;
    const loom::Group group(is_expert_bucket(b) ? edp_ : dp_);
    if (start) return group.start_all_reduce(stream, g, g, n, grad_dtype_, op);
    group.all_reduce(stream, g, g, n, grad_dtype_, op);
    return {};
  }

  // The step's tables: the norm's segments (the parameters counted here, in the order
  // of the per-tensor loop) and every parameter's AdamW segment (all buffers share
  // the parameter's offset).
  loom::MultiTensorStep multi_tensor_step(const loom::Device& dev) const {
    std::vector<loom_reduce_segment> norm;
    std::vector<loom_adamw_segment> adamw;
    std::vector<bool> decayed;
    for (const Info& p : infos_) {
      const auto offset = static_cast<int64_t>(p.offset), numel = static_cast<int64_t>(p.numel);
      if (!p.counted_elsewhere) norm.push_back({offset, numel});
      adamw.push_back({offset, offset, offset, offset, numel, 0.0f, 0});
      decayed.push_back(!p.no_weight_decay);
    }
    return loom::MultiTensorStep(rank_, dev, norm, std::move(adamw), std::move(decayed));
  }
  static void zero(const loom::Device& dev, void* p, size_t n) {
    dev.elementwise({.op = LOOM_EW_FILL, .n = static_cast<int64_t>(n), .out = p, .alpha = 0.f,
                     .dtype = LOOM_DTYPE_F32, .out_dtype = LOOM_DTYPE_F32});
  }
  void transfer(void* host, int32_t kind) {
    loom::Device dev = loom::Rank(rank_).device();
    const size_t bytes = numel_ * sizeof(float);
    std::vector<void*> dev_bufs = {m_.get(), v_.get()};
    if (main_) dev_bufs.push_back(main_.get());
    for (size_t i = 0; i < dev_bufs.size(); ++i) {
      char* h = static_cast<char*>(host) + i * bytes;
      if (kind == LOOM_COPY_DEVICE_TO_HOST) dev.copy(h, dev_bufs[i], bytes, kind);
      else dev.copy(dev_bufs[i], h, bytes, kind);
    }
    dev.synchronize();
  }

  loom_rank* rank_;
  void* params_;
  void* grads_;
  size_t numel_;
  int32_t param_dtype_, grad_dtype_;
  loom_group dp_, tp_, pp_;
  loom_group ep_ = loom::make<loom_group>(), edp_ = loom::make<loom_group>();
  loom_group etp_ = loom::make<loom_group>();  // size 0 unless the run folds MoE parallelism (etp != tp)
  size_t expert_start_ = numel_;  // the expert tail [expert_start_, numel_), when expert-parallel
  std::vector<Info> infos_;
  std::vector<std::pair<size_t, size_t>> buckets_;  // [start, end), as the engine laid them out
  loom::BucketReadiness ready_;
  std::vector<loom::CommRequest> requests_;  // by bucket: started during the backward, until step
  loom::Buffer m_, v_, main_, norm_parts_, norm_total_;
  loom::MultiTensorStep multi_;
};

}  // namespace

LOOM_PLUGIN_LIBRARY(loom::optimizer_plugin<Ddp>(
    "ddp", "1.1.0", "data-parallel gradient all-reduce (averaged), global-norm clipping, AdamW"))
