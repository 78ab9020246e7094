// parallel/distributed: Megatron-LM's distributed optimizer (ZeRO-1; `distrib_optimizer.py`).
//
// The engine lays the flat parameter/gradient buffers out in buckets whose sizes
// divide by dp (loom_optimizer_create_args.bucket_offsets); data-parallel rank r
// owns shard r of every bucket and keeps fp32 master weights and Adam moments for
// that shard only, so optimizer memory falls as 1/dp. One step:
//   1. reduce-scatter each bucket's gradients over dp (averaged, as DDP's
//      all-reduce) — started during the backward as soon as the bucket is complete
//      when the engine announces final gradients (ABI 1.15 grads_ready,
//      optimizer.overlap_grad_reduce; Megatron-LM's overlap_grad_reduce), and
//      waited for here: the rank's shard of the buffer now holds the reduced gradient;
//      that slice is the fp32 main gradient (no copy: adamw reads it in place, and
//      upcasts when the gradients are bf16);
//   2. global gradient norm: sum of squares over the owned pieces (tp-duplicated
//      parameters on tp rank 0 only, tied pipeline copies on their owning stage), summed over dp, tp and pp; clip;
//   3. AdamW on each owned piece of each parameter (weight decay off where the
//      layer says so), writing the updated slice back into the parameter buffer;
//   4. all-gather each bucket's parameters so every rank has all of them — with
//      optimizer.overlap_param_gather (ABI 1.16) left running after the step and
//      waited for bucket by bucket as the next forward reaches each layer
//      (params_needed), Megatron-LM's overlap_param_gather.
// Padding never takes part in a step: its gradients are zero and the pieces skip it.
// Expert parallelism (ABI 1.4): the expert parameters, the buffers' tail, differ
// across the ep group and already hold the contributions of its dp ranks (their
// tokens came by all-to-all); their buckets are sharded over edp instead of dp,
// reduce-scattered as a sum over edp scaled by 1 / dp, all-gathered over edp, and
// their norm is summed over edp and ep. MoE folding (ABI 1.5, etp != tp): the
// experts are split over etp and the ep group spans tp ranks, so the expert part of
// the norm is summed over edp, ep and etp, the dense part over dp and tp.
// Checkpoints: each rank saves its shard with a header describing the layout; a
// resume at another dp size (state_load_resharded) finds each element of the new
// shard by (parameter, element within it) in whichever old rank's shard held it.
//
// The shard arithmetic is the same as the engine's shard_ranges(); the layout
// itself is decided by the engine alone and arrives here as bucket offsets.
#include <loom/cpp/plugin.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <initializer_list>
#include <sstream>
#include <string>
#include <vector>

namespace {

// Checkpoint blob: a header a resharder can read without this plugin's code,
// then the shard's Adam moments and master weights.
//   magic "LOOMDOPT", then in host byte order:
//   u32 version, u32 header_bytes (everything before the arrays),
//   u32 dp, u32 rank, u64 buffer_numel, u64 shard_numel (elements per array),
//   u32 num_buckets, u32 num_params, u32 num_arrays (2, or 3 with master weights), u32 reserved (0),
//   num_buckets x {u64 bucket_start, bucket_end, shard_start, shard_end},
//   num_params  x {u64 offset, numel}   (model order),
//   then num_arrays fp32 arrays of shard_numel elements: m, v (and master weights
//   when the model's weights are not fp32: fp32 weights are saved by the engine), each
//   the concatenation of this rank's bucket shards in bucket order.
constexpr char kMagic[8] = {'L', 'O', 'O', 'M', 'D', 'O', 'P', 'T'};
constexpr uint32_t kStateVersion = 1;
constexpr size_t kFixedHeader = 8 + 4 * 4 + 8 * 2 + 4 * 4;

struct Span {
  size_t start = 0, end = 0;
  size_t size() const { return end - start; }
  bool operator==(const Span&) const = default;
};

struct ParamRef {
  size_t offset, numel;
  bool no_weight_decay, counted_elsewhere;  // in gradient norms: by another tp rank or stage
};

// One owned piece of one parameter.
struct Piece {
  size_t param;  // index into params_ (model order)
  size_t world;  // first element in the buffers
  size_t local;  // first element in the shard state arrays
  size_t numel;
};

class Writer {
 public:
  explicit Writer(char* p) : p_(p) {}
  template <typename T>
  void put(T v) {
    std::memcpy(p_ + n_, &v, sizeof(T));
    n_ += sizeof(T);
  }
  void raw(const void* s, size_t bytes) {
    std::memcpy(p_ + n_, s, bytes);
    n_ += bytes;
  }
  size_t size() const { return n_; }

 private:
  char* p_;
  size_t n_ = 0;
};

class Reader {
 public:
  Reader(const char* p, size_t bytes) : p_(p), bytes_(bytes) {}
  template <typename T>
  T get() {
    LOOM_REQUIRE(n_ + sizeof(T) <= bytes_, "parallel/distributed: the checkpointed optimizer state is truncated ("
                                               << bytes_ << " bytes)");
    T v;
    std::memcpy(&v, p_ + n_, sizeof(T));
    n_ += sizeof(T);
    return v;
  }
  size_t pos() const { return n_; }

 private:
  const char* p_;
  size_t bytes_;
  size_t n_ = 0;
};

// A saved blob's header, checked for magic, version and size; arrays follow at header_bytes.
struct Saved {
  uint32_t header_bytes = 0, dp = 0, rank = 0, arrays = 0;
  uint64_t numel = 0, shard_numel = 0;
  std::vector<Span> buckets, shards, params;  // params: [offset, offset + numel) in model order
};

Saved parse(const void* buf, size_t bytes) {
  const char* c = static_cast<const char*>(buf);
  LOOM_REQUIRE(c != nullptr && bytes >= sizeof(kMagic) && std::memcmp(c, kMagic, sizeof(kMagic)) == 0,
               "parallel/distributed: the checkpointed optimizer state was not written by parallel/distributed (no "
               "distributed-optimizer header; was it saved with another optimizer.strategy?)");
  Reader r(c + sizeof(kMagic), bytes - sizeof(kMagic));
  Saved s;
  const uint32_t version = r.get<uint32_t>();
  LOOM_REQUIRE(version == kStateVersion, "parallel/distributed: optimizer state format "
                                             << version << " is not supported (this plugin reads format "
                                             << kStateVersion << ")");
  s.header_bytes = r.get<uint32_t>();
  s.dp = r.get<uint32_t>();
  s.rank = r.get<uint32_t>();
  s.numel = r.get<uint64_t>();
  s.shard_numel = r.get<uint64_t>();
  const uint32_t nb = r.get<uint32_t>(), np = r.get<uint32_t>();
  s.arrays = r.get<uint32_t>();
  (void)r.get<uint32_t>();
  for (uint32_t b = 0; b < nb; ++b) {
    const uint64_t b0 = r.get<uint64_t>(), b1 = r.get<uint64_t>(), s0 = r.get<uint64_t>(), s1 = r.get<uint64_t>();
    s.buckets.push_back({b0, b1});
    s.shards.push_back({s0, s1});
  }
  for (uint32_t i = 0; i < np; ++i) {
    const uint64_t off = r.get<uint64_t>(), n = r.get<uint64_t>();
    s.params.push_back({off, off + n});
  }
  LOOM_REQUIRE(s.header_bytes == r.pos() + sizeof(kMagic) && s.arrays >= 2 && s.arrays <= 3 &&
                   bytes == s.header_bytes + s.arrays * s.shard_numel * sizeof(float),
               "parallel/distributed: the checkpointed optimizer state is malformed ("
                   << bytes << " bytes; its header describes " << s.arrays << " arrays of " << s.shard_numel
                   << " elements after " << s.header_bytes << " header bytes)");
  return s;
}

class DistOpt : public loom::OptimizerStrategy {
 public:
  static constexpr uint64_t kFeatures = LOOM_OPTIMIZER_EXPERT_PARALLEL | LOOM_OPTIMIZER_EXPERT_FOLDING |
                                        LOOM_OPTIMIZER_SHARDED_STATE | LOOM_OPTIMIZER_OVERLAP_PARAM_GATHER;

  DistOpt(const loom::Options&, loom::Rank& rank, const loom_optimizer_create_args& a)
      : rank_(rank.raw()), params_(a.params), grads_(a.grads), numel_(a.numel), param_dtype_(a.param_dtype),
        grad_dtype_(a.grad_dtype), dp_(a.dp), tp_(a.tp), pp_(a.pp) {
    if (loom::expert_parallel(a)) {
      ep_ = a.ep;
      edp_ = a.edp;
      expert_start_ = loom::expert_tail_start(a);
      if (loom::experts_fold_tp(a)) etp_ = loom::expert_tp_group(a);
    } else {
      expert_start_ = numel_;
    }
    LOOM_REQUIRE(grad_dtype_ == LOOM_DTYPE_F32 || grad_dtype_ == LOOM_DTYPE_BF16,
                 "parallel/distributed: gradient dtype " << grad_dtype_ << " is not supported (f32, bf16)");
    LOOM_REQUIRE(param_dtype_ == LOOM_DTYPE_F32 || param_dtype_ == LOOM_DTYPE_BF16,
                 "parallel/distributed: parameter dtype " << param_dtype_ << " is not supported (f32, bf16)");

    // Buckets as the engine laid them out (one bucket over everything if it gave none).
    const bool has_buckets =
        a.struct_size >= offsetof(loom_optimizer_create_args, num_buckets) + sizeof(a.num_buckets) &&
        a.bucket_offsets != nullptr && a.num_buckets > 0;
    if (has_buckets) {
      for (size_t b = 0; b < a.num_buckets; ++b) buckets_.push_back({a.bucket_offsets[b], a.bucket_offsets[b + 1]});
    } else {
      buckets_.push_back({0, numel_});
    }
    LOOM_REQUIRE(buckets_.front().start == 0 && buckets_.back().end == numel_,
                 "parallel/distributed: the buckets cover [" << buckets_.front().start << ", " << buckets_.back().end
                                                         << ") but the buffers hold " << numel_ << " elements");
    for (size_t b = 0; b < buckets_.size(); ++b) {
      const Span& k = buckets_[b];
      LOOM_REQUIRE(k.end > k.start && (b == 0 || k.start == buckets_[b - 1].end),
                   "parallel/distributed: bucket " << b << " [" << k.start << ", " << k.end
                                               << ") is empty or does not follow the previous one");
      LOOM_REQUIRE(k.end <= expert_start_ || k.start >= expert_start_,
                   "parallel/distributed: bucket " << b << " [" << k.start << ", " << k.end
                                               << ") holds dense and expert parameters (the expert region starts at "
                                               << expert_start_ << ")");
      const loom_group& g = group_of(b);
      const size_t d = static_cast<size_t>(std::max(1, g.size)), r = static_cast<size_t>(std::max(0, g.rank));
      LOOM_REQUIRE(k.size() % d == 0, "parallel/distributed: bucket " << b << " holds " << k.size()
                                          << " elements, which do not split into " << d
                                          << " equal shards (the engine pads buckets to lcm(dp, 128))");
      const size_t size = k.size() / d;
      shards_.push_back({k.start + r * size, k.start + (r + 1) * size});
    }

    std::vector<std::pair<size_t, size_t>> ranges;
    for (const Span& k : buckets_) ranges.emplace_back(k.start, k.end);
    ready_ = loom::BucketReadiness(a, ranges);
    requests_.resize(buckets_.size());
    gathers_.resize(buckets_.size());
    for (size_t i = 0; i < a.num_params; ++i) {
      const loom_param_info& p = a.infos[i];
      LOOM_REQUIRE(p.offset + p.numel <= numel_, "parallel/distributed: parameter '" << (p.name ? p.name : "?")
                                                     << "' [" << p.offset << ", " << p.offset + p.numel
                                                     << ") lies outside the buffers of " << numel_ << " elements");
      params_info_.push_back({p.offset, p.numel, p.no_weight_decay != 0, loom::counted_elsewhere(a, i)});
    }

    // The owned pieces: each parameter cut by each shard; the state arrays are
    // the shards concatenated in bucket order.
    for (const Span& s : shards_) {
      for (size_t i = 0; i < params_info_.size(); ++i) {
        const ParamRef& p = params_info_[i];
        const size_t lo = std::max(p.offset, s.start), hi = std::min(p.offset + p.numel, s.end);
        if (lo < hi) pieces_.push_back({i, lo, shard_numel_ + (lo - s.start), hi - lo});
      }
      shard_numel_ += s.size();
    }

    // State for the shard only: Adam moments, and fp32 master weights when the
    // model's weights are not fp32 (fp32 weights are their own master copy, which
    // gives the 8 + 8/d bytes of Megatron-LM's distributed-optimizer guide per parameter).
    loom::Device dev = rank.device();
    const size_t bytes = shard_numel_ * sizeof(float);
    separate_master_ = param_dtype_ != LOOM_DTYPE_F32;
    m_ = loom::Buffer(rank_, bytes);
    v_ = loom::Buffer(rank_, bytes);
    if (separate_master_) master_ = loom::Buffer(rank_, bytes);
    norm_parts_ = loom::Buffer(rank_, std::max<size_t>(1, pieces_.size()) * sizeof(float));
    norm_total_ = loom::Buffer(rank_, sizeof(double));
    multi_ = multi_tensor_step(dev);
    fill_zero(dev, m_.get(), shard_numel_);
    fill_zero(dev, v_.get(), shard_numel_);
    size_t local = 0;
    for (const Span& s : shards_) {
      if (!separate_master_) break;
      const char* src = static_cast<const char*>(params_) + s.start * elem(param_dtype_);
      dev.elementwise({.op = LOOM_EW_CAST, .n = static_cast<int64_t>(s.size()), .x = src,
                       .out = master_.get<float>() + local, .dtype = param_dtype_, .out_dtype = LOOM_DTYPE_F32});
      local += s.size();
    }
    dev.synchronize();
  }

  // The buckets these parameters complete start their reduce-scatter now.
  void grads_ready(loom::Rank& rank, const size_t* params, size_t n) override {
    for (size_t b : ready_.announce(params, n)) requests_[b] = reduce_bucket(rank.device().native_stream(), b, true);
  }

  float step(loom::Rank& rank, const loom_optimizer_step_args& a) override {
    for (loom::CommRequest& g : gathers_) g.wait();  // the last step's, if the engine read none
    loom::Device dev = rank.device();
    void* stream = dev.native_stream();
    const loom::Group dp(dp_);
    const size_t ge = elem(grad_dtype_), pe = elem(param_dtype_);

    // 1. Reduce-scatter: this rank's shard of each bucket gets the dp-averaged
    // gradient (an expert bucket: the sum over edp, scaled by 1 / dp); buckets
    // started during the backward are waited for.
    for (size_t b = 0; b < buckets_.size(); ++b) {
      if (requests_[b].pending()) requests_[b].wait();
      else reduce_bucket(stream, b, false);
      if (is_expert_bucket(b) && dp.size() > 1) {
        char* shard = static_cast<char*>(grads_) + shards_[b].start * ge;
        dev.elementwise({.op = LOOM_EW_SCALE, .n = static_cast<int64_t>(shards_[b].size()), .x = shard, .out = shard,
                         .alpha = 1.f / static_cast<float>(dp.size()), .dtype = grad_dtype_,
                         .out_dtype = grad_dtype_});
      }
    }
    ready_.reset();

    // 2. Global norm over all shards of all model-parallel ranks: dense shards
    // summed over dp, expert shards over edp and ep.
    std::vector<bool> expert_part;
    for (size_t i = 0; i < pieces_.size(); ++i) {
      const Piece& p = pieces_[i];
      if (params_info_[p.param].counted_elsewhere) continue;
      if (!multi_.enabled())
        dev.reduce({.op = LOOM_RED_SUM_SQUARES, .n = static_cast<int64_t>(p.numel),
                    .x = static_cast<char*>(grads_) + p.world * ge,
                    .out = norm_parts_.get<float>() + expert_part.size(), .dtype = grad_dtype_,
                    .out_dtype = LOOM_DTYPE_F32});
      expert_part.push_back(p.world >= expert_start_);
    }
    if (multi_.enabled()) multi_.norm_parts(dev, grads_, grad_dtype_, norm_parts_.get<float>());
    const size_t k = expert_part.size();
    std::vector<float> parts(k);
    if (k > 0) dev.copy(parts.data(), norm_parts_.get(), k * sizeof(float), LOOM_COPY_DEVICE_TO_HOST);
    dev.synchronize();
    double total = 0, experts = 0;
    for (size_t i = 0; i < k; ++i) (expert_part[i] ? experts : total) += parts[i];
    void* scratch = norm_total_.get();
    if (etp_.size > 0) {  // folded: each part over its own data- and model-parallel ranks, then pp
      total = loom::all_reduce_sum(dev, scratch, total, {dp_, tp_}) +
              loom::all_reduce_sum(dev, scratch, experts, {edp_, ep_, etp_});
      total = loom::all_reduce_sum(dev, scratch, total, {pp_});
    } else if (expert_start_ < numel_) {  // the two parts over their own groups, then together
      total = loom::all_reduce_sum(dev, scratch, total, {dp_}) +
              loom::all_reduce_sum(dev, scratch, experts, {edp_, ep_});
      total = loom::all_reduce_sum(dev, scratch, total, {tp_, pp_});
    } else {
      total = loom::all_reduce_sum(dev, scratch, total, {dp_, tp_, pp_});
    }
    const float norm = static_cast<float>(std::sqrt(total));
    float scale = 1.f;
    if (a.clip_grad > 0 && norm > a.clip_grad) scale = a.clip_grad / (norm + 1e-6f);

    // 3. AdamW on the owned pieces; the updated values go back into the parameter buffer.
    if (multi_.enabled()) {
      multi_.adamw(dev, {.param = separate_master_ ? master_.get<float>() : static_cast<float*>(params_),
                         .grad = grads_, .m = m_.get<float>(), .v = v_.get<float>(), .grad_dtype = grad_dtype_,
                         .lr = a.lr, .beta1 = a.beta1, .beta2 = a.beta2, .eps = a.eps,
                         .weight_decay = a.weight_decay, .grad_scale = scale, .step = a.step,
                         .param_copy = separate_master_ ? params_ : nullptr, .copy_dtype = param_dtype_});
    } else {
      for (const Piece& p : pieces_) {
        const ParamRef& info = params_info_[p.param];
        float* master = separate_master_ ? master_.get<float>() + p.local
                                         : reinterpret_cast<float*>(static_cast<char*>(params_) + p.world * pe);
        dev.adamw({.n = static_cast<int64_t>(p.numel), .param = master,
                   .grad = static_cast<char*>(grads_) + p.world * ge, .m = m_.get<float>() + p.local,
                   .v = v_.get<float>() + p.local, .grad_dtype = grad_dtype_, .lr = a.lr, .beta1 = a.beta1,
                   .beta2 = a.beta2, .eps = a.eps, .weight_decay = info.no_weight_decay ? 0.f : a.weight_decay,
                   .grad_scale = scale, .step = a.step,
                   .param_copy = separate_master_ ? static_cast<char*>(params_) + p.world * pe : nullptr,
                   .copy_dtype = param_dtype_});
      }
    }

    // 4. All-gather: every rank gets every shard's updated parameters. Started in
    // the order the next forward reads them (the buffer holds the model in reverse,
    // so the last bucket first); with overlap_param_gather left running until the
    // engine asks for them (params_needed), else waited for here.
    const bool overlap = a.struct_size >= offsetof(loom_optimizer_step_args, overlap_param_gather) + sizeof(int32_t) &&
                         a.overlap_param_gather != 0;
    for (size_t b = buckets_.size(); b-- > 0;) {
      char* bucket = static_cast<char*>(params_) + buckets_[b].start * pe;
      char* shard = static_cast<char*>(params_) + shards_[b].start * pe;
      const loom::Group g(group_of(b));
      if (overlap) gathers_[b] = g.start_all_gather(stream, shard, bucket, shards_[b].size(), param_dtype_);
      else g.all_gather(stream, shard, bucket, shards_[b].size(), param_dtype_);
    }
    return norm;
  }

  // The parameters' buckets' all-gathers, if still running.
  void params_needed(loom::Rank&, const size_t* params, size_t n) override {
    for (size_t k = 0; k < n; ++k) gathers_[ready_.bucket_of(params[k])].wait();
  }

  uint32_t num_arrays() const { return separate_master_ ? 3u : 2u; }  // m, v (, master)

  // The step's tables: the norm's segments (the pieces counted here, in the order of the
  // per-tensor loop) and every owned piece's AdamW segment: master weights (or the fp32
  // parameters), m and v at the piece's shard offset, gradients and the parameter copy
  // at its buffer offset.
  loom::MultiTensorStep multi_tensor_step(const loom::Device& dev) const {
    std::vector<loom_reduce_segment> norm;
    std::vector<loom_adamw_segment> adamw;
    std::vector<bool> decayed;
    for (const Piece& p : pieces_) {
      const auto world = static_cast<int64_t>(p.world), local = static_cast<int64_t>(p.local);
      const auto numel = static_cast<int64_t>(p.numel);
      if (!params_info_[p.param].counted_elsewhere) norm.push_back({world, numel});
      adamw.push_back({separate_master_ ? local : world, local, world, world, numel, 0.0f, 0});
      decayed.push_back(!params_info_[p.param].no_weight_decay);
    }
    return loom::MultiTensorStep(rank_, dev, norm, std::move(adamw), std::move(decayed));
  }
  size_t state_size() override { return header_bytes() + num_arrays() * shard_numel_ * sizeof(float); }

  void state_save(void* buf, size_t bytes) override {
    LOOM_REQUIRE(bytes == state_size(),
                 "parallel/distributed: state buffer of " << bytes << " bytes, expected " << state_size());
    Writer w(static_cast<char*>(buf));
    w.raw(kMagic, sizeof(kMagic));
    w.put<uint32_t>(kStateVersion);
    w.put<uint32_t>(static_cast<uint32_t>(header_bytes()));
    w.put<uint32_t>(static_cast<uint32_t>(dp_size()));
    w.put<uint32_t>(static_cast<uint32_t>(dp_rank()));
    w.put<uint64_t>(numel_);
    w.put<uint64_t>(shard_numel_);
    w.put<uint32_t>(static_cast<uint32_t>(buckets_.size()));
    w.put<uint32_t>(static_cast<uint32_t>(params_info_.size()));
    w.put<uint32_t>(num_arrays());
    w.put<uint32_t>(0);
    for (size_t b = 0; b < buckets_.size(); ++b) {
      w.put<uint64_t>(buckets_[b].start);
      w.put<uint64_t>(buckets_[b].end);
      w.put<uint64_t>(shards_[b].start);
      w.put<uint64_t>(shards_[b].end);
    }
    for (const ParamRef& p : params_info_) {
      w.put<uint64_t>(p.offset);
      w.put<uint64_t>(p.numel);
    }
    transfer(static_cast<char*>(buf) + w.size(), LOOM_COPY_DEVICE_TO_HOST);
  }

  void state_load(const void* buf, size_t bytes) override {
    const Saved old = parse(buf, bytes);
    LOOM_REQUIRE(old.dp == static_cast<uint32_t>(dp_size()),
                 "parallel/distributed: the optimizer state was saved by rank " << old.rank << " of dp=" << old.dp
                     << " but this run has dp=" << dp_size()
                     << "; distributed-optimizer shards of another data-parallel size need resharding "
                        "(state_load_resharded, which the engine uses on resume), not state_load");
    LOOM_REQUIRE(old.rank == static_cast<uint32_t>(dp_rank()), "parallel/distributed: the optimizer state belongs to dp rank "
                                                                   << old.rank << " but was given to dp rank "
                                                                   << dp_rank());
    std::vector<Span> mine;
    for (const ParamRef& p : params_info_) mine.push_back({p.offset, p.offset + p.numel});
    LOOM_REQUIRE(old.numel == numel_ && old.buckets == buckets_ && old.shards == shards_ && old.params == mine &&
                     old.shard_numel == shard_numel_,
                 "parallel/distributed: the optimizer state was saved for another buffer layout ("
                     << old.numel << " elements, " << old.buckets.size() << " bucket(s), " << old.params.size()
                     << " parameters; this run: " << numel_ << " elements, " << buckets_.size() << " bucket(s), "
                     << params_info_.size()
                     << " parameters); the model, parallel layout or optimizer.bucket_size differ from the checkpoint's");
    LOOM_REQUIRE(old.arrays == num_arrays() && old.header_bytes == header_bytes() && bytes == state_size(),
                 "parallel/distributed: the checkpointed optimizer state is malformed (" << bytes << " bytes, expected "
                                                                                     << state_size() << ")");
    transfer(const_cast<char*>(static_cast<const char*>(buf)) + old.header_bytes, LOOM_COPY_HOST_TO_DEVICE);
  }

  // ABI 1.14: the elements a blob holds (this rank's shard of each bucket), by their
  // place in the saver's buffer; the engine regathers them by parameter.
  static void state_decode(const void* buf, size_t bytes, loom_optimizer_elements& out) {
    const Saved s = parse(buf, bytes);
    LOOM_REQUIRE(s.numel == out.numel, "parallel/distributed: the optimizer state describes a buffer of "
                                           << s.numel << " elements; its rank's checkpoint has " << out.numel);
    out.num_arrays = s.arrays;
    if (out.arrays == nullptr) return;
    const float* src = reinterpret_cast<const float*>(static_cast<const char*>(buf) + s.header_bytes);
    size_t local = 0;
    for (const Span& sh : s.shards) {
      LOOM_REQUIRE(sh.end <= s.numel && local + sh.size() <= s.shard_numel,
                   "parallel/distributed: the checkpointed optimizer state is malformed (a shard past its buffer)");
      for (uint32_t k = 0; k < s.arrays; ++k)
        std::memcpy(out.arrays[k] + sh.start, src + k * s.shard_numel + local, sh.size() * sizeof(float));
      if (out.held != nullptr) std::fill(out.held + sh.start, out.held + sh.end, uint8_t{1});
      local += sh.size();
    }
  }

  // ABI 1.14: state for every element of the buffer; this rank keeps its shards.
  void state_import(const loom_optimizer_elements& in) override {
    LOOM_REQUIRE(in.numel == numel_ && in.num_arrays == num_arrays(),
                 "parallel/distributed: state of " << in.num_arrays << " arrays over " << in.numel
                     << " elements for a buffer of " << numel_ << " that keeps " << num_arrays()
                     << " (m, v, and master weights when parameters are not fp32)");
    std::vector<float> host(static_cast<size_t>(num_arrays()) * shard_numel_, 0.f);
    size_t local = 0;
    for (const Span& sh : shards_) {
      for (uint32_t k = 0; k < num_arrays(); ++k)
        std::memcpy(host.data() + k * shard_numel_ + local, in.arrays[k] + sh.start, sh.size() * sizeof(float));
      local += sh.size();
    }
    transfer(reinterpret_cast<char*>(host.data()), LOOM_COPY_HOST_TO_DEVICE);
  }

  // Resharding: the old ranks' blobs describe their own layout (buckets, shards and
  // each parameter's old offset); every element of every piece this rank now owns
  // is found by (parameter index, element within the parameter) in whichever old
  // shard held it. Padding keeps zeros (m, v, and master weights, which are zero
  // there in a fresh run too).
  void state_load_resharded(const loom_optimizer_reshard_args& a) override {
    LOOM_REQUIRE(a.old_dp >= 1 && a.states != nullptr && a.state_bytes != nullptr,
                 "parallel/distributed: resharding needs the saved state of every old dp rank (old dp = " << a.old_dp
                                                                                                      << ")");
    LOOM_REQUIRE(a.num_params == params_info_.size() && a.old_offsets != nullptr && a.old_numels != nullptr,
                 "parallel/distributed: the checkpoint's layout lists " << a.num_params << " parameters but this model has "
                                                                    << params_info_.size()
                                                                    << " on this rank; the model differs from the "
                                                                       "checkpoint's");
    std::vector<Span> old_params;
    for (size_t i = 0; i < a.num_params; ++i) {
      LOOM_REQUIRE(a.old_numels[i] == params_info_[i].numel,
                   "parallel/distributed: parameter " << i << " held " << a.old_numels[i]
                                                  << " elements in the checkpoint but has " << params_info_[i].numel
                                                  << " here; the model differs from the checkpoint's");
      old_params.push_back({a.old_offsets[i], a.old_offsets[i] + a.old_numels[i]});
    }
    std::vector<Span> old_buckets;
    for (size_t b = 0; a.old_bucket_offsets != nullptr && b < a.old_num_buckets; ++b)
      old_buckets.push_back({a.old_bucket_offsets[b], a.old_bucket_offsets[b + 1]});

    // Every old piece, grouped by parameter: {range within the parameter, old rank, first element in its arrays}.
    struct OldPiece {
      size_t begin, end, rank, local;
    };
    const size_t old_dp = static_cast<size_t>(a.old_dp);
    std::vector<Saved> old(old_dp);
    std::vector<std::vector<OldPiece>> by_param(params_info_.size());
    for (size_t r = 0; r < old_dp; ++r) {
      Saved& o = old[r];
      o = parse(a.states[r], a.state_bytes[r]);
      LOOM_REQUIRE(o.dp == old_dp && o.rank == r,
                   "parallel/distributed: the state given as old dp rank " << r << " of " << old_dp
                                                                       << " was saved by rank " << o.rank << " of dp="
                                                                       << o.dp);
      LOOM_REQUIRE(o.numel == a.old_numel && o.params == old_params && o.buckets == old_buckets,
                   "parallel/distributed: the state of old dp rank "
                       << r << " describes another buffer layout than the checkpoint's (" << o.numel << " elements, "
                       << o.buckets.size() << " bucket(s); the engine computed " << a.old_numel << " elements, "
                       << old_buckets.size() << " bucket(s)); the model or optimizer.bucket_size differ");
      LOOM_REQUIRE(o.arrays == num_arrays(),
                   "parallel/distributed: the state of old dp rank " << r << " holds " << o.arrays
                       << " arrays but this run needs " << num_arrays()
                       << " (m, v, and master weights when parameters are not fp32); device.param_dtype differs "
                          "from the checkpoint's");
      size_t local = 0;
      for (size_t b = 0; b < o.shards.size(); ++b) {
        const Span& sh = o.shards[b];
        const size_t size = o.buckets[b].size() / old_dp;
        LOOM_REQUIRE(o.buckets[b].size() % old_dp == 0 && sh.start == o.buckets[b].start + r * size &&
                         sh.end == sh.start + size,
                     "parallel/distributed: the state of old dp rank " << r << " has a malformed shard of bucket " << b);
        for (size_t i = 0; i < old_params.size(); ++i) {
          const size_t lo = std::max(old_params[i].start, sh.start), hi = std::min(old_params[i].end, sh.end);
          if (lo < hi)
            by_param[i].push_back({lo - old_params[i].start, hi - old_params[i].start, r, local + (lo - sh.start)});
        }
        local += sh.size();
      }
      LOOM_REQUIRE(local == o.shard_numel, "parallel/distributed: the state of old dp rank " << r << " is malformed");
    }

    // This rank's new state on the host, zero where nothing maps (padding).
    const uint32_t arrays = num_arrays();
    std::vector<float> host(static_cast<size_t>(arrays) * shard_numel_, 0.f);
    for (const Piece& p : pieces_) {
      const size_t begin = p.world - params_info_[p.param].offset, end = begin + p.numel;
      size_t covered = 0;
      for (const OldPiece& q : by_param[p.param]) {
        const size_t lo = std::max(begin, q.begin), hi = std::min(end, q.end);
        if (lo >= hi) continue;
        const Saved& o = old[q.rank];
        const float* src = reinterpret_cast<const float*>(static_cast<const char*>(a.states[q.rank]) + o.header_bytes);
        for (uint32_t k = 0; k < arrays; ++k)
          std::memcpy(host.data() + k * shard_numel_ + p.local + (lo - begin),
                      src + k * o.shard_numel + q.local + (lo - q.begin), (hi - lo) * sizeof(float));
        covered += hi - lo;
      }
      LOOM_REQUIRE(covered == p.numel, "parallel/distributed: the old shards hold " << covered << " of the " << p.numel
                                                                                << " elements [" << begin << ", " << end
                                                                                << ") of parameter " << p.param
                                                                                << "; the checkpoint is incomplete");
    }
    transfer(reinterpret_cast<char*>(host.data()), LOOM_COPY_HOST_TO_DEVICE);
  }

 private:
  static size_t elem(int32_t dtype) { return loom::dtype_size(dtype); }
  static void fill_zero(const loom::Device& dev, void* p, size_t n) {
    if (n == 0) return;
    dev.elementwise({.op = LOOM_EW_FILL, .n = static_cast<int64_t>(n), .out = p, .alpha = 0.f,
                     .dtype = LOOM_DTYPE_F32, .out_dtype = LOOM_DTYPE_F32});
  }
  // Expert buckets (the tail) are sharded over edp, the others over dp.
  bool is_expert_bucket(size_t b) const { return buckets_[b].start >= expert_start_; }
  const loom_group& group_of(size_t b) const { return is_expert_bucket(b) ? edp_ : dp_; }

  // Bucket b's reduce-scatter into this rank's shard: a dense one averaged over
  // dp, an expert one summed over edp; started (the request returned) or in line.
  loom::CommRequest reduce_bucket(void* stream, size_t b, bool start) const {
    const size_t ge = elem(grad_dtype_);
    char* bucket = static_cast<char*>(grads_) + buckets_[b].start * ge;
    char* shard = static_cast<char*>(grads_) + shards_[b].start * ge;
    const int32_t op = is_expert_bucket(b) ? LOOM_REDUCE_SUM : LOOM_REDUCE_AVG;
    const loom::Group g(group_of(b));
    if (start) return g.start_reduce_scatter(stream, bucket, shard, shards_[b].size(), grad_dtype_, op);
    g.reduce_scatter(stream, bucket, shard, shards_[b].size(), grad_dtype_, op);
    return {};
  }
  int dp_size() const { return std::max(1, dp_.size); }
  int dp_rank() const { return std::max(0, dp_.rank); }
  size_t header_bytes() const { return kFixedHeader + buckets_.size() * 4 * 8 + params_info_.size() * 2 * 8; }

  void transfer(char* host, int32_t kind) {
    loom::Device dev = loom::Rank(rank_).device();
    const size_t bytes = shard_numel_ * sizeof(float);
    void* arrays[3] = {m_.get(), v_.get(), master_.get()};
    for (uint32_t i = 0; i < num_arrays() && bytes > 0; ++i) {
      char* h = host + i * bytes;
      if (kind == LOOM_COPY_DEVICE_TO_HOST) dev.copy(h, arrays[i], bytes, kind);
      else dev.copy(arrays[i], h, bytes, kind);
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
  size_t expert_start_ = 0;  // the expert tail [expert_start_, numel_) when expert-parallel; else numel_
  std::vector<Span> buckets_, shards_;  // shards_[b]: this rank's part of bucket b
  loom::BucketReadiness ready_;
  std::vector<loom::CommRequest> requests_;  // by bucket: started during the backward, until step
  std::vector<loom::CommRequest> gathers_;   // by bucket: the parameter all-gather left running after step
  std::vector<ParamRef> params_info_;
  std::vector<Piece> pieces_;
  size_t shard_numel_ = 0;
  bool separate_master_ = false;
  loom::Buffer m_, v_, master_, norm_parts_, norm_total_;
  loom::MultiTensorStep multi_;
};

}  // namespace

LOOM_PLUGIN_LIBRARY(loom::optimizer_plugin<DistOpt>(
    "distributed", "1.1.0",
    "distributed optimizer (ZeRO-1): reduce-scatter, fp32 AdamW on this rank's 1/dp shard, all-gather"))
