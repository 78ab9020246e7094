// The layer plugin test harness (see layer_harness.hpp).
#include "engine/testing/layer_harness.hpp"

#include "engine/model/param_plan.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <numeric>
#include <set>
#include <sstream>
#include <thread>

namespace loom::harness {

namespace {

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

DLTensor view(void* data, std::vector<int64_t>& shape, uint8_t code, uint8_t bits) {
  DLTensor t{};
  t.data = data;
  t.device = {kDLCPU, 0};
  t.ndim = static_cast<int32_t>(shape.size());
  t.dtype = {code, bits, 1};
  t.shape = shape.data();
  return t;
}

double max_abs(const std::vector<float>& v) {
  double m = 0.0;
  for (float x : v) m = std::max(m, static_cast<double>(std::fabs(x)));
  return m;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0.0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    m = std::max(m, static_cast<double>(std::fabs(a[i] - b[i])));
  return m;
}

// got == want within tol * (1 + max |want|), recorded in `out` under `what`.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, double tol, const std::string& what,
                  Findings& out) {
  if (got.size() != want.size()) {
    out.fail(what + ": " + std::to_string(got.size()) + " values where the serial run has " +
             std::to_string(want.size()));
    return;
  }
  out.compared += static_cast<int64_t>(got.size());
  const double d = max_abs_diff(got, want), bound = tol * (1.0 + max_abs(want));
  if (!(d <= bound)) {
    std::ostringstream s;
    s << what << ": differs from the serial run by up to " << d << " (allowed " << bound << ")";
    out.fail(s.str());
  }
}

void expect_close(double got, double want, double tol, const std::string& what, Findings& out) {
  ++out.compared;
  const double bound = tol * (1.0 + std::fabs(want));
  if (!(std::fabs(got - want) <= bound)) {
    std::ostringstream s;
    s << what << ": " << got << " where the serial run has " << want << " (allowed difference " << bound << ")";
    out.fail(s.str());
  }
}

void ok(loom_status s) { loom::check(s); }

bool ends_with(const std::string& n, const std::string& tail) {
  return n.size() >= tail.size() && n.compare(n.size() - tail.size(), tail.size(), tail) == 0;
}
bool is_bias(const std::string& n) { return ends_with(n, "bias"); }
// A norm's gain (LayerNorm's or RMSNorm's weight), by the built-in layers' names.
bool is_norm_gain(const std::string& n) { return ends_with(n, "ln.weight") || ends_with(n, "norm.weight"); }

}  // namespace

// ---------------------------------------------------------------------------
// Ranks and layers
// ---------------------------------------------------------------------------

HarnessRank::HarnessRank(const plugins::Registry& registry, int global_rank, const loom_group* tp,
                         const loom_device_api* device_api, const loom_group* holders)
    : registry_(registry) {
  const plugins::LoadedPlugin& p = registry.get("device", "cpu");
  plugins::OptionValues opts(nullptr, p.options);
  loom_device_create_args args = loom::make<loom_device_create_args>();
  args.num_threads = 1;
  args.ranks_in_process = 1;
  loom_device* dev = nullptr;
  ok(p.device()->create(opts.raw(), &args, &dev));
  rt_ = std::make_unique<runtime::RankRuntime>(global_rank, device_api ? device_api : p.device(), dev);
  loom_group alone = loom::make<loom_group>();
  alone.size = 1;
  alone.rank = 0;
  rt_->add_group("tp", tp ? *tp : alone);
  rt_->add_group("ep", alone);  // layer/moe asks for it (expert parallelism: 1)
  // The other groups inside a stage a layer may reduce over (one rank each here), and
  // the ranks holding the layer: tp's ranks, with a communicator of their own.
  for (const char* kind : {"dp", "cp", "dp-cp", "edp"}) rt_->add_group(kind, alone);
  if (holders != nullptr || tp == nullptr) rt_->add_group("tp-dp-cp", holders ? *holders : alone);
  // ... and for etp, to check that its experts split over tp: tp's size, no
  // communicator (the runtime owns and destroys each group's, tp's already).
  loom_group etp = tp ? *tp : alone;
  etp.api = nullptr;
  etp.comm = nullptr;
  rt_->add_group("etp", etp);
  rt_->set_service(LOOM_API_TENSOR_PARALLEL, registry.get("parallel", "tensor").api);
}

Batch make_batch(const loom_model_dims& d, std::mt19937& rng) {
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(d.vocab) - 1);
  const int64_t T = d.seq_len * d.micro_batch;
  Batch b;
  b.x.resize(static_cast<size_t>(T * d.hidden));
  b.r.resize(b.x.size());
  for (float& v : b.x) v = n01(rng);
  for (float& v : b.r) v = n01(rng);
  b.tokens.resize(static_cast<size_t>(T));
  b.targets.resize(static_cast<size_t>(T));
  for (int32_t& t : b.tokens) t = tok(rng);
  for (int32_t& t : b.targets) t = tok(rng);
  return b;
}

Batch sequence_shard(const Batch& b, const loom_model_dims& d, int tp, int r) {
  const size_t rows = static_cast<size_t>(d.seq_len / tp * d.micro_batch * d.hidden), r0 = rows * r;
  Batch s = b;
  s.x.assign(b.x.begin() + r0, b.x.begin() + r0 + rows);
  s.r.assign(b.r.begin() + r0, b.r.begin() + r0 + rows);
  return s;
}

namespace {
// A signalling NaN with a payload: no arithmetic result has these bits.
constexpr uint32_t kCanaryBits = 0x7fa5c0deu;
float canary() {
  float f;
  std::memcpy(&f, &kCanaryBits, sizeof f);
  return f;
}
bool is_canary(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits == kCanaryBits;
}
}  // namespace

GuardedFloats::GuardedFloats(size_t n) : all_(n + 2 * kGuard, canary()), n_(n) {}

std::string GuardedFloats::overrun() const {
  size_t before = 0, after = 0;
  for (size_t i = 0; i < kGuard; ++i) {
    before += is_canary(all_[i]) ? 0 : 1;
    after += is_canary(all_[kGuard + n_ + i]) ? 0 : 1;
  }
  if (before + after == 0) return "";
  std::ostringstream os;
  if (after > 0) os << after << " of the " << kGuard << " values after the end of";
  if (before > 0 && after > 0) os << ", and ";
  if (before > 0) os << before << " of the " << kGuard << " values before";
  return os.str();
}

HarnessLayer::HarnessLayer(HarnessRank& rank, const std::string& name, const loom_model_dims& dims,
                           const toml::table* options, const std::string& instance, bool sequence_parallel)
    : rank_(rank),
      name_(name),
      instance_(instance),
      dims_(dims),
      plugin_(rank.registry().get("layer", name)),
      options_(options, plugin_.options) {
  const loom_layer_api* a = api();
  const uint64_t features = LOOM_HAS_SLOT(a, loom_layer_api, features) ? a->features : 0;
  reads_tokens_ = (features & LOOM_LAYER_READS_TOKENS) != 0;
  writes_loss_ = (features & LOOM_LAYER_WRITES_LOSS) != 0;
  loom_layer_create_args args = loom::make<loom_layer_create_args>();
  args.dims = &dims_;
  args.instance_name = instance_.c_str();
  args.tp = rank_.rt().group_or_self("tp").raw();
  args.sequence_parallel = sequence_parallel ? 1 : 0;
  const int tp = std::max(1, args.tp.size);
  local_seq_ = sequence_parallel ? dims_.seq_len / tp : dims_.seq_len;
  ok(a->create(options_.raw(), &rank_.rt(), &args, &layer_));
  const loom_param_decl* decls = nullptr;
  size_t count = 0;
  ok(a->params(layer_, &decls, &count));
  for (const loom_param_decl& d : model::checked_param_decls(decls, count, instance_)) {
    Param p;
    p.name = d.name;
    p.shape.assign(d.shape, d.shape + d.ndim);
    p.partition_dim = d.partition_dim;
    p.partition_stride = d.partition_stride;
    p.init = d.init;
    p.no_weight_decay = d.no_weight_decay;
    p.tie_key = d.tie_key ? d.tie_key : "";
    // This rank's slice, as the engine allocates it.
    p.local_shape = p.shape;
    if (p.partition_dim >= 0) p.local_shape[static_cast<size_t>(p.partition_dim)] /= tp;
    p.value.assign(static_cast<size_t>(numel(p.local_shape)), 0.0f);
    p.grad.assign(p.value.size(), 0.0f);
    params_.push_back(std::move(p));
  }
  std::vector<DLTensor> pv, gv;
  for (Param& p : params_) {
    bound_values_.emplace_back(p.value.size());
    bound_grads_.emplace_back(p.grad.size());
    pv.push_back(view(bound_values_.back().data(), p.local_shape, kDLFloat, 32));
    gv.push_back(view(bound_grads_.back().data(), p.local_shape, kDLFloat, 32));
  }
  ok(a->bind(layer_, pv.data(), gv.data(), params_.size()));
}

void HarnessLayer::load_params() {
  for (size_t i = 0; i < params_.size(); ++i) {
    LOOM_REQUIRE(params_[i].value.size() == bound_values_[i].size() && params_[i].grad.size() == bound_grads_[i].size(),
                 "the harness's parameter " << params_[i].name << " was resized");
    std::copy(params_[i].value.begin(), params_[i].value.end(), bound_values_[i].data());
    std::copy(params_[i].grad.begin(), params_[i].grad.end(), bound_grads_[i].data());
  }
}

void HarnessLayer::check_inputs(const HeldInputs& h, const Batch& b, const char* call) const {
  if (const std::string o = h.x.overrun(); !o.empty())
    throw std::runtime_error(name_ + " " + call + ": wrote " + o + " its input");
  if (!std::equal(h.x.data(), h.x.data() + h.x.size(), b.x.begin()))
    throw std::runtime_error(name_ + " " + call + ": changed its input (a layer reads its input only)");
  if (h.tokens != b.tokens || h.targets != b.targets)
    throw std::runtime_error(name_ + " " + call + ": changed the tokens or targets (a layer reads them only)");
}

void HarnessLayer::finish_call(const char* call, bool store_grads) {
  for (size_t i = 0; i < params_.size(); ++i) {
    const Param& p = params_[i];
    const std::string where = name_ + " " + call + ": ";
    if (const std::string o = bound_values_[i].overrun(); !o.empty())
      throw std::runtime_error(where + "wrote " + o + " parameter " + p.name);
    if (const std::string o = bound_grads_[i].overrun(); !o.empty())
      throw std::runtime_error(where + "wrote " + o + " the gradient of " + p.name);
    if (!std::equal(p.value.begin(), p.value.end(), bound_values_[i].data()))
      throw std::runtime_error(where + "changed parameter " + p.name + " (a layer reads its parameters only)");
    if (!store_grads && !std::equal(p.grad.begin(), p.grad.end(), bound_grads_[i].data()))
      throw std::runtime_error(where + "changed the gradient of " + p.name + " (only a backward adds to it)");
  }
  if (store_grads)
    for (size_t i = 0; i < params_.size(); ++i)
      std::copy(bound_grads_[i].data(), bound_grads_[i].data() + bound_grads_[i].size(), params_[i].grad.begin());
}

HarnessLayer::~HarnessLayer() {
  if (layer_) api()->destroy(layer_);
}

Param& HarnessLayer::param(const std::string& n) {
  for (Param& p : params_)
    if (p.name == n) return p;
  throw std::runtime_error(name_ + " has no parameter " + n);
}

bool HarnessLayer::has_param(const std::string& n) const {
  return std::any_of(params_.begin(), params_.end(), [&](const Param& p) { return p.name == n; });
}

void HarnessLayer::randomize(std::mt19937& rng, float weight_std) {
  std::normal_distribution<float> n01(0.0f, 1.0f);
  for (Param& p : params_) {
    const bool gain = is_norm_gain(p.name), bias = is_bias(p.name);
    for (float& v : p.value) v = gain ? 1.0f + 0.2f * n01(rng) : bias ? 0.2f * n01(rng) : weight_std * n01(rng);
  }
}

void HarnessLayer::zero_grads() {
  for (Param& p : params_) std::fill(p.grad.begin(), p.grad.end(), 0.0f);
}

double HarnessLayer::forward(const Batch& b, int32_t mb, bool training, uint64_t seed, std::vector<float>* out,
                             int64_t* loss_count, const uint64_t* seed_device) {
  const int64_t B = dims_.micro_batch, H = dims_.hidden, rows = local_seq_ * B;
  GuardedFloats y(has_output() ? static_cast<size_t>(rows * H) : 0);
  std::fill(y.data(), y.data() + y.size(), -7.0f);
  auto held = std::make_unique<HeldInputs>();
  held->x = GuardedFloats(has_input() ? b.x.size() : 0);
  std::copy(b.x.begin(), b.x.begin() + static_cast<std::ptrdiff_t>(held->x.size()), held->x.data());
  held->tokens = b.tokens;
  held->targets = b.targets;
  std::vector<int64_t> hshape{local_seq_, B, H}, tshape{dims_.seq_len, B};
  DLTensor in = view(held->x.data(), hshape, kDLFloat, 32);
  DLTensor o = view(y.data(), hshape, kDLFloat, 32);
  DLTensor tok = view(held->tokens.data(), tshape, kDLInt, 32);
  DLTensor tgt = view(held->targets.data(), tshape, kDLInt, 32);
  float loss_sum = -1.0f;
  int64_t count = -1;
  loom_layer_fwd_args a = loom::make<loom_layer_fwd_args>();
  a.microbatch = mb;
  a.training = training ? 1 : 0;
  a.input = has_input() ? &in : nullptr;
  a.output = has_output() ? &o : nullptr;
  a.tokens = &tok;
  a.targets = &tgt;
  a.loss_sum = &loss_sum;
  a.loss_count = &count;
  a.dropout_seed = seed;
  a.dropout_seed_device = seed_device;
  float aux = 0.0f;
  a.aux_loss = &aux;
  load_params();
  ok(api()->forward(layer_, &rank_.rt(), &a));
  rank_.rt().dev().synchronize();
  finish_call("forward", false);
  if (const std::string o = y.overrun(); !o.empty()) throw std::runtime_error(name_ + " forward: wrote " + o + " its output");
  check_inputs(*held, b, "forward");
  if (training) held_[mb] = std::move(held);
  last_aux = aux;
  if (loss_count) *loss_count = count;
  if (out) out->assign(y.data(), y.data() + y.size());
  if (!has_output()) return loss_sum;
  double l = aux_weight * aux;
  for (size_t i = 0; i < y.size(); ++i) l += static_cast<double>(y.data()[i]) * b.r[i];
  return l;
}

bool HarnessLayer::takes_kv_cache() const {
  const loom_layer_api* a = api();
  return plugin_.abi_minor >= 13 && LOOM_HAS_SLOT(a, loom_layer_api, features) && (a->features & LOOM_LAYER_KV_CACHE) != 0;
}

std::vector<model::LayerState> HarnessLayer::state() const {
  return model::declared_states(api(), layer_, instance_, [](loom_status st) { ok(st); });
}

void HarnessLayer::end_step(int64_t step, int32_t microbatches) {
  const loom_layer_api* a = api();
  if (!LOOM_HAS_SLOT(a, loom_layer_api, end_step) || a->end_step == nullptr) return;
  loom_layer_step_end_args args = loom::make<loom_layer_step_end_args>();
  args.step = step;
  args.microbatches = microbatches;
  ok(a->end_step(layer_, &rank_.rt(), &args));
}

std::vector<float> HarnessLayer::forward_cached(const Batch& b, int64_t first, int64_t rows) {
  const int64_t B = dims_.micro_batch, H = dims_.hidden;
  GuardedFloats y(has_output() ? static_cast<size_t>(rows * B * H) : static_cast<size_t>(B * dims_.vocab));
  std::fill(y.data(), y.data() + y.size(), -7.0f);
  GuardedFloats x(has_input() ? static_cast<size_t>(rows * B * H) : 0);
  std::copy_n(b.x.begin() + first * B * H, x.size(), x.data());
  std::vector<int64_t> hshape{rows, B, H}, tshape{rows, B};
  DLTensor in = view(x.data(), hshape, kDLFloat, 32);
  DLTensor o = view(y.data(), hshape, kDLFloat, 32);
  DLTensor tok = view(const_cast<int32_t*>(b.tokens.data()) + first * B, tshape, kDLInt, 32);
  loom_layer_fwd_args a = loom::make<loom_layer_fwd_args>();
  a.training = 0;
  a.input = has_input() ? &in : nullptr;
  a.output = has_output() ? &o : nullptr;
  a.tokens = &tok;
  a.kv_cache = 1;
  a.position_offset = first;
  a.logits = has_output() ? nullptr : y.data();
  load_params();
  ok(api()->forward(layer_, &rank_.rt(), &a));
  rank_.rt().dev().synchronize();
  finish_call("kv_cache forward", false);
  if (const std::string o = y.overrun(); !o.empty())
    throw std::runtime_error(name_ + " kv_cache forward: wrote " + o + (has_output() ? " its output" : " the logits"));
  if (!std::equal(x.data(), x.data() + x.size(), b.x.begin() + first * B * H))
    throw std::runtime_error(name_ + " kv_cache forward: changed its input (a layer reads its input only)");
  return std::vector<float>(y.data(), y.data() + y.size());
}

std::vector<float> HarnessLayer::backward(const Batch& b, int32_t mb, float loss_scale, float garbage) {
  const int64_t B = dims_.micro_batch, H = dims_.hidden;
  GuardedFloats dx(has_input() ? static_cast<size_t>(local_seq_ * B * H) : 0), r(has_output() ? b.r.size() : 0);
  std::fill(dx.data(), dx.data() + dx.size(), garbage);
  std::copy(b.r.begin(), b.r.begin() + static_cast<std::ptrdiff_t>(r.size()), r.data());
  std::vector<int64_t> hshape{local_seq_, B, H};
  DLTensor dy = view(r.data(), hshape, kDLFloat, 32);
  DLTensor di = view(dx.data(), hshape, kDLFloat, 32);
  loom_layer_bwd_args a = loom::make<loom_layer_bwd_args>();
  a.microbatch = mb;
  a.grad_output = has_output() ? &dy : nullptr;
  a.grad_input = has_input() ? &di : nullptr;
  a.loss_scale = loss_scale;
  a.aux_loss_scale = static_cast<float>(aux_weight);
  load_params();
  ok(api()->backward(layer_, &rank_.rt(), &a));
  rank_.rt().dev().synchronize();
  finish_call("backward", true);
  if (auto it = held_.find(mb); it != held_.end()) {
    const std::unique_ptr<HeldInputs> held = std::move(it->second);
    held_.erase(it);
    check_inputs(*held, b, "backward");
  }
  if (const std::string o = dx.overrun(); !o.empty())
    throw std::runtime_error(name_ + " backward: wrote " + o + " grad_input");
  if (const std::string o = r.overrun(); !o.empty())
    throw std::runtime_error(name_ + " backward: wrote " + o + " grad_output");
  if (!std::equal(r.data(), r.data() + r.size(), b.r.begin()))
    throw std::runtime_error(name_ + " backward: changed grad_output (a layer reads it only)");
  return std::vector<float>(dx.data(), dx.data() + dx.size());
}

double HarnessLayer::objective(const Batch& b, uint64_t seed, int32_t mb) {
  const double l = forward(b, mb, true, seed);
  release(mb);
  return l;
}

void HarnessLayer::release(int32_t mb) {
  if (api()->release) api()->release(layer_, mb);
  held_.erase(mb);
}

// ---------------------------------------------------------------------------
// Checks
// ---------------------------------------------------------------------------

std::string Findings::text() const {
  if (failures.empty() && compared == 0) return "nothing was compared";
  std::string s;
  for (const std::string& f : failures) s += (s.empty() ? "" : "\n") + f;
  return s;
}

void fd_check(std::vector<float>& v, const std::vector<float>& analytic, const std::function<double()>& objective,
              const std::string& what, std::mt19937& rng, Findings& out, FdTolerance tol) {
  if (v.size() != analytic.size() || v.empty()) {
    out.fail(what + ": " + std::to_string(analytic.size()) + " gradient values for " + std::to_string(v.size()) +
             " values");
    return;
  }
  std::set<size_t> coords;
  std::uniform_int_distribution<size_t> pick(0, v.size() - 1);
  if (v.size() <= kFdEveryCoordinateUpTo)
    for (size_t j = 0; j < v.size(); ++j) coords.insert(j);
  for (int i = 0; i < 32 && coords.size() < v.size(); ++i) coords.insert(pick(rng));
  std::vector<size_t> order(v.size());
  std::iota(order.begin(), order.end(), size_t{0});
  const size_t top = std::min<size_t>(8, order.size());
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(top), order.end(),
                    [&](size_t a, size_t b) { return std::fabs(analytic[a]) > std::fabs(analytic[b]); });
  coords.insert(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(top));

  // Central differences with step h are off by c h^2 (the third derivative), which a norm
  // over a few values (a head's q under qk_norm) makes large at the default step, and by
  // float rounding of the objective / h at tiny steps. Where h disagrees, the step h / 3
  // and Richardson's extrapolation of the two, (9 D(h/3) - D(h)) / 8, which cancels the
  // h^2 term, are tried: a coordinate fails only when all three disagree.
  auto central = [&](size_t j, float h) {
    const float saved = v[j];
    v[j] = saved + h;
    const double lp = objective();
    v[j] = saved - h;
    const double lm = objective();
    v[j] = saved;
    return (lp - lm) / (2.0 * static_cast<double>(h));
  };
  for (size_t j : coords) {
    const double ana = analytic[j];
    auto within = [&](double num) {
      return std::fabs(ana - num) <= tol.rtol * std::max(std::fabs(num), std::fabs(ana)) + tol.atol;
    };
    double num = central(j, tol.h);
    if (!within(num)) {
      const double third = central(j, tol.h / 3.0f), extrapolated = (9.0 * third - num) / 8.0;
      num = within(third) ? third : extrapolated;
    }
    const double bound = tol.rtol * std::max(std::fabs(num), std::fabs(ana)) + tol.atol;
    ++out.compared;
    if (!within(num)) {
      std::ostringstream s;
      s << what << "[" << j << "]: analytic " << ana << ", finite differences " << num << " (allowed difference "
        << bound << ")";
      out.fail(s.str());
    }
  }
}

Findings check_gradients(HarnessLayer& layer, std::mt19937& rng, uint64_t seed, FdTolerance tol) {
  Findings f;
  Batch b = make_batch(layer.dims(), rng);
  layer.zero_grads();
  layer.forward(b, 0, true, seed);
  std::vector<float> dx = layer.backward(b, 0);
  auto objective = [&] { return layer.objective(b, seed); };
  for (Param& p : layer.params()) {
    const std::vector<float> analytic = p.grad;
    fd_check(p.value, analytic, objective, p.name, rng, f, tol);
  }
  if (layer.has_input()) fd_check(b.x, dx, objective, "input", rng, f, tol);
  return f;
}

Findings check_accumulation(HarnessLayer& layer, std::mt19937& rng) {
  Findings f;
  Batch b = make_batch(layer.dims(), rng);
  layer.zero_grads();
  layer.forward(b, 0);
  const std::vector<float> dx1 = layer.backward(b, 0);
  std::vector<std::vector<float>> once;
  for (Param& p : layer.params()) once.push_back(p.grad);
  layer.forward(b, 0);
  const std::vector<float> dx2 = layer.backward(b, 0, 1.0f, -77.0f);  // other garbage in grad_input
  for (size_t i = 0; i < layer.params().size(); ++i) {
    const Param& p = layer.params()[i];
    std::vector<float> twice(once[i]);
    for (float& g : twice) g *= 2.0f;
    expect_close(p.grad, twice, 1e-5, p.name + " after two backwards (must be twice one backward's)", f);
  }
  if (dx1 != dx2 || std::find(dx1.begin(), dx1.end(), 123.0f) != dx1.end())
    f.fail("grad_input depends on what it held before the backward (it must be overwritten, not accumulated into)");
  f.compared += static_cast<int64_t>(dx1.size());
  return f;
}

MemoryUse measure_memory(HarnessLayer& layer, std::mt19937& rng) {
  const loom_layer_api* api = layer.api();
  MemoryUse m;
  m.declared_activation = api->activation_bytes ? api->activation_bytes(layer.raw()) : 0;
  m.declares_workspace = LOOM_HAS_SLOT(api, loom_layer_api, workspace_bytes) && api->workspace_bytes != nullptr;
  if (m.declares_workspace) m.declared_workspace = api->workspace_bytes(layer.raw());
  const Batch b = make_batch(layer.dims(), rng);
  HarnessRank& rank = layer.rank();
  layer.forward(b, 0);  // constants made on first use stay; the high-water mark is set here
  layer.backward(b, 0);
  const uint64_t base = rank.device_bytes(), peak_before = rank.device_peak_bytes();
  layer.forward(b, 1);
  m.kept = rank.device_bytes() - base;
  layer.backward(b, 1);
  m.left_after_backward = rank.device_bytes() - base;
  // The calls repeat the first ones, so the high-water mark is theirs (minus the
  // constants made meanwhile, which only makes this smaller).
  const uint64_t peak = std::max(peak_before, rank.device_peak_bytes()) - base;
  m.temporaries = peak > m.kept ? peak - m.kept : 0;
  layer.forward(b, 2);
  layer.release(2);
  m.left_after_release = rank.device_bytes() - base;
  layer.forward(b, 3, /*training=*/false);
  m.left_after_evaluation = rank.device_bytes() - base;
  return m;
}

Findings check_memory(HarnessLayer& layer, std::mt19937& rng) {
  constexpr uint64_t kRounding = 4096;
  const MemoryUse m = measure_memory(layer, rng);
  Findings f;
  auto bytes = [](uint64_t n) { return std::to_string(n) + " B"; };
  if (m.kept > m.declared_activation + kRounding)
    f.fail("a training forward keeps " + bytes(m.kept) + " for its backward, more than activation_bytes (" +
           bytes(m.declared_activation) + ")");
  if (m.declares_workspace && m.temporaries > m.declared_workspace + kRounding)
    f.fail("forward and backward allocate up to " + bytes(m.temporaries) +
           " of temporaries beside what the forward keeps, more than workspace_bytes (" +
           bytes(m.declared_workspace) + "): loom plan would promise memory the run does not have");
  if (m.left_after_backward > 0) f.fail("backward leaves " + bytes(m.left_after_backward) + " of the forward's allocated");
  if (m.left_after_release > 0) f.fail("release leaves " + bytes(m.left_after_release) + " of the forward's allocated");
  if (m.left_after_evaluation > 0)
    f.fail("an evaluation forward (training = 0) leaves " + bytes(m.left_after_evaluation) + " allocated");
  f.compared += 5;
  return f;
}

Findings check_kv_cache(HarnessLayer& layer, std::mt19937& rng) {
  Findings out;
  const loom_model_dims& d = layer.dims();
  const int64_t S = d.seq_len, B = d.micro_batch, H = d.hidden, half = std::max<int64_t>(1, S / 2);
  const Batch b = make_batch(d, rng);
  auto compare = [&](const std::vector<float>& got, const float* want, size_t n, const std::string& what) {
    double scale = 1;
    for (size_t i = 0; i < n; ++i) scale = std::max(scale, std::fabs(static_cast<double>(want[i])));
    for (size_t i = 0; i < n; ++i)
      if (++out.compared; !(std::fabs(static_cast<double>(got[i]) - want[i]) <= 1e-5 * scale)) {
        out.fail(what + ", value " + std::to_string(i) + ": " + std::to_string(got[i]) + ", expected " +
                 std::to_string(want[i]) + " (bound 1e-5 of the largest, " + std::to_string(scale) + ")");
        return;
      }
  };
  if (layer.has_output()) {  // each call's rows are the whole-sequence forward's rows
    std::vector<float> whole;
    layer.forward(b, 0, /*training=*/false, 1234, &whole);
    for (int64_t first = 0; first < S; first = first == 0 ? half : first + 1) {
      const int64_t rows = first == 0 ? half : 1;
      compare(layer.forward_cached(b, first, rows), whole.data() + first * B * H, static_cast<size_t>(rows * B * H),
              "kv_cache forward of positions [" + std::to_string(first) + ", " + std::to_string(first + rows) +
                  ") against the whole-sequence forward");
    }
  } else {  // the logits after each call are those of one call over the whole prefix
    std::vector<std::vector<float>> stepwise;
    for (int64_t first = 0; first < S; first = first == 0 ? half : first + 1)
      stepwise.push_back(layer.forward_cached(b, first, first == 0 ? half : 1));
    size_t k = 0;
    for (int64_t end = half; end <= S; ++end, ++k) {
      const std::vector<float> prefix = layer.forward_cached(b, 0, end);
      compare(stepwise[k], prefix.data(), prefix.size(),
              "logits after position " + std::to_string(end - 1) + " one position at a time against the whole prefix");
    }
  }
  return out;
}

Findings check_microbatches_in_flight(HarnessLayer& layer, std::mt19937& rng) {
  Findings f;
  Batch m0 = make_batch(layer.dims(), rng), m1 = make_batch(layer.dims(), rng);
  layer.zero_grads();
  const double l0 = layer.forward(m0, 0);
  const std::vector<float> a0 = layer.backward(m0, 0);
  const double l1 = layer.forward(m1, 1);
  const std::vector<float> a1 = layer.backward(m1, 1);
  std::vector<std::vector<float>> sequential;
  for (Param& p : layer.params()) sequential.push_back(p.grad);

  layer.zero_grads();
  const double k0 = layer.forward(m0, 0), k1 = layer.forward(m1, 1);
  const std::vector<float> b1 = layer.backward(m1, 1), b0 = layer.backward(m0, 0);
  f.compared += 2;
  if (k0 != l0 || k1 != l1) f.fail("a forward's objective depends on another microbatch in flight");
  expect_close(b0, a0, 0.0, "microbatch 0's input gradient with microbatch 1 in flight", f);
  expect_close(b1, a1, 0.0, "microbatch 1's input gradient, backwarded first", f);
  for (size_t i = 0; i < sequential.size(); ++i)
    expect_close(layer.params()[i].grad, sequential[i], 1e-6,
                 layer.params()[i].name + " gradient, microbatches in flight", f);
  return f;
}

std::vector<std::string> run_tp_ranks(const plugins::Registry& registry, int tp,
                                      const std::function<void(int, HarnessRank&)>& fn) {
  const plugins::LoadedPlugin* comm = registry.find("comm", "local");
  if (comm == nullptr) return std::vector<std::string>(static_cast<size_t>(tp), "comm/local is not loaded");
  plugins::OptionValues copts(nullptr, comm->options);
  std::vector<int32_t> ranks(static_cast<size_t>(tp));
  std::iota(ranks.begin(), ranks.end(), 0);
  loom_comm_world_args wa = loom::make<loom_comm_world_args>();
  wa.world_size = tp;
  wa.num_local_ranks = tp;
  wa.local_ranks = ranks.data();
  wa.timeout_ms = 60000;
  loom_comm_world* world = nullptr;
  ok(comm->comm()->world_create(copts.raw(), &wa, &world));
  std::vector<std::string> errors(static_cast<size_t>(tp));
  std::vector<std::thread> threads;
  for (int r = 0; r < tp; ++r) {
    threads.emplace_back([&, r] {
      try {
        loom_group_desc desc = loom::make<loom_group_desc>();
        desc.kind = "tp";
        desc.ranks = ranks.data();
        desc.size = tp;
        desc.my_rank = r;
        loom_group g = loom::make<loom_group>();
        g.api = comm->comm();
        g.size = tp;
        g.rank = r;
        ok(comm->comm()->group_create(world, &desc, &g.comm));
        // The ranks holding the layer (dp = cp = 1): the same ranks, a group of their own.
        desc.kind = "tp-dp-cp";
        loom_group holders = g;
        ok(comm->comm()->group_create(world, &desc, &holders.comm));
        HarnessRank rank(registry, r, &g, nullptr, &holders);  // owns the communicators from here on
        fn(r, rank);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
        comm->comm()->world_abort(world, e.what());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  comm->comm()->world_destroy(world);
  return errors;
}

namespace {

struct RankResult {
  double objective = 0.0;  // of the output only (Σ out∘R, or the loss), without the auxiliary loss
  float aux = 0.0f;
  int64_t count = 0;
  std::vector<float> out, dx;
  std::vector<std::vector<float>> grads;
  std::vector<std::vector<float>> state;  // after end_step (ABI 1.23)
};

std::vector<std::vector<float>> state_values(const HarnessLayer& l) {
  std::vector<std::vector<float>> v;
  for (const model::LayerState& s : l.state()) v.emplace_back(s.data, s.data + s.count);
  return v;
}

}  // namespace

Findings check_tensor_parallel(const plugins::Registry& registry, const std::string& name,
                               const loom_model_dims& dims, const toml::table* options, std::mt19937& rng,
                               const TensorParallelCase& tc) {
  Findings f;
  const int tp = tc.tp;
  const bool sp = tc.sequence_parallel;
  // The serial run.
  HarnessRank serial(registry);
  HarnessLayer full(serial, name, dims, options);
  full.randomize(rng);
  Batch b = make_batch(dims, rng);
  // A token and a target in the last rank's slice of a vocabulary split over tp.
  b.tokens[1] = static_cast<int32_t>(std::min(dims.padded_vocab / tp * (tp - 1), dims.vocab - 1));
  b.targets[2] = static_cast<int32_t>(dims.vocab) - 1;
  std::vector<float> want_out;
  int64_t want_count = 0;
  full.zero_grads();
  full.aux_weight = tc.aux_weight;
  const double want_obj = full.forward(b, 0, true, tc.dropout_seed, &want_out, &want_count) -
                          tc.aux_weight * full.last_aux;
  const float want_aux = full.last_aux;
  const std::vector<float> want_dx = full.backward(b, 0);
  full.end_step(1, 1);
  const std::vector<std::vector<float>> want_state = state_values(full);

  std::vector<RankResult> res(static_cast<size_t>(tp));
  const std::vector<std::string> errors = run_tp_ranks(registry, tp, [&](int r, HarnessRank& rank) {
    HarnessLayer layer(rank, name, dims, options, "blocks.0.layer", sp);
    for (size_t i = 0; i < layer.params().size(); ++i) {
      Param& p = layer.params()[i];
      const std::vector<float> mine = slice(p, full.params()[i].value, tp, r);
      if (mine.size() != p.value.size())
        throw std::runtime_error(name + ": parameter " + p.name + " holds " + std::to_string(p.value.size()) +
                                 " values on a tp rank, where its declaration cut over tp gives " +
                                 std::to_string(mine.size()));
      std::copy(mine.begin(), mine.end(), p.value.begin());
    }
    layer.zero_grads();
    layer.aux_weight = tc.aux_weight;
    const Batch mb = sp ? sequence_shard(b, dims, tp, r) : b;
    RankResult& out = res[static_cast<size_t>(r)];
    out.objective = layer.forward(mb, 0, true, tc.dropout_seed, &out.out, &out.count) -
                    tc.aux_weight * layer.last_aux;
    out.aux = layer.last_aux;
    out.dx = layer.backward(mb, 0);
    for (Param& p : layer.params()) out.grads.push_back(p.grad);
    layer.end_step(1, 1);
    out.state = state_values(layer);
  });
  for (int r = 0; r < tp; ++r)  // one line per distinct error (ranks refusing a layout say the same)
    if (!errors[static_cast<size_t>(r)].empty() &&
        std::find(errors.begin(), errors.begin() + r, errors[static_cast<size_t>(r)]) == errors.begin() + r)
      f.fail("tp rank " + std::to_string(r) + ": " + errors[static_cast<size_t>(r)]);
  if (!f.failures.empty()) return f;

  const bool writes_loss = !full.has_output();
  const size_t shard = sp ? want_out.size() / static_cast<size_t>(tp) : want_out.size();
  const size_t dx_shard = sp ? want_dx.size() / static_cast<size_t>(tp) : want_dx.size();
  double obj_sum = 0.0;
  for (int r = 0; r < tp; ++r) {
    const RankResult& got = res[static_cast<size_t>(r)];
    const std::string who = "tp rank " + std::to_string(r) + ": ";
    obj_sum += got.objective;
    if (writes_loss || !sp) expect_close(got.objective, want_obj, tc.tol, who + "objective", f);
    if (tc.aux_weight != 0.0) expect_close(got.aux, want_aux, tc.tol, who + "auxiliary loss", f);
    if (writes_loss && got.count != want_count)
      f.fail(who + "loss_count " + std::to_string(got.count) + ", serial " + std::to_string(want_count));
    const auto part = [&](const std::vector<float>& v, size_t n) {
      return std::vector<float>(v.begin() + static_cast<std::ptrdiff_t>(sp ? n * r : 0),
                                v.begin() + static_cast<std::ptrdiff_t>(sp ? n * (r + 1) : n));
    };
    expect_close(got.out, part(want_out, shard), tc.tol, who + "output", f);
    expect_close(got.dx, part(want_dx, dx_shard), tc.tol, who + "input gradient", f);
    for (size_t i = 0; i < full.params().size(); ++i) {
      const Param& p = full.params()[i];
      if (p.partition_dim < 0 && sp) continue;  // summed over the ranks below
      expect_close(got.grads[i], slice(p, p.grad, tp, r), tc.tol, who + p.name + " gradient", f);
    }
    // The layer's state after the step: the serial one's, on every rank (ABI 1.23).
    if (got.state.size() != want_state.size()) {
      f.fail(who + std::to_string(got.state.size()) + " state arrays, serial " + std::to_string(want_state.size()));
    } else {
      for (size_t i = 0; i < want_state.size(); ++i)
        expect_close(got.state[i], want_state[i], tc.tol, who + "state array " + std::to_string(i) + " after end_step",
                     f);
    }
  }
  if (sp && !writes_loss) expect_close(obj_sum, want_obj, tc.tol, "the objective summed over the tp ranks", f);
  // Under sequence parallelism each rank's gradient of a duplicated parameter is its
  // shard's part; the engine all-reduces them over tp.
  for (size_t i = 0; sp && i < full.params().size(); ++i) {
    const Param& p = full.params()[i];
    if (p.partition_dim >= 0) continue;
    std::vector<float> sum(p.grad.size(), 0.0f);
    for (const RankResult& got : res)
      for (size_t j = 0; j < sum.size() && j < got.grads[i].size(); ++j) sum[j] += got.grads[i][j];
    expect_close(sum, p.grad, tc.tol, p.name + " gradient summed over the tp ranks", f);
  }
  return f;
}

Findings check_state(const plugins::Registry& registry, const std::string& name, const loom_model_dims& dims,
                     const toml::table* options, std::mt19937& rng) {
  Findings f;
  const uint32_t seed = static_cast<uint32_t>(rng());
  HarnessRank rank_a(registry), rank_b(registry);
  HarnessLayer alone(rank_a, name, dims, options), released(rank_b, name, dims, options);
  std::mt19937 ra(seed), rb(seed);
  alone.randomize(ra);
  released.randomize(rb);
  const Batch b = make_batch(dims, rng);
  // An evaluation forward, and a training forward released without its backward (a
  // recomputed layer's first): a layer without release is never recomputed.
  released.forward(b, 0, /*training=*/false);
  if (released.api()->release != nullptr) {
    released.forward(b, 0);
    released.release(0);
  }
  alone.end_step(1, 1);
  released.end_step(1, 1);
  const std::vector<std::vector<float>> want = state_values(alone), got = state_values(released);
  bool same = want.size() == got.size();
  for (size_t i = 0; same && i < want.size(); ++i)  // bit for bit: a NaN is the same NaN
    same = want[i].size() == got[i].size() &&
           std::memcmp(want[i].data(), got[i].data(), want[i].size() * sizeof(float)) == 0;
  for (const auto& v : want) f.compared += static_cast<int64_t>(v.size());
  if (!same)
    f.fail("end_step after an evaluation forward and a training forward released without its backward left other "
           "state than end_step alone: a step's state must count what its backwards saw (recomputation runs a "
           "forward twice, and evaluation forwards train nothing)");
  released.forward(b, 0);
  released.backward(b, 0);
  released.end_step(2, 1);
  const std::vector<model::LayerState> states = released.state();
  for (const model::LayerState& s : states)
    for (int64_t i = 0; i < s.count; ++i)
      if (!std::isfinite(s.data[i])) {
        f.fail(s.name + "[" + std::to_string(i) + "] is " + std::to_string(s.data[i]) +
               " after a trained microbatch and end_step");
        break;
      }
  return f;
}

loom_model_dims default_dims() {
  loom_model_dims d = loom::make<loom_model_dims>();
  d.hidden = 16;
  d.heads = 4;
  d.ffn_hidden = 32;
  d.seq_len = 8;
  d.vocab = 37;
  d.padded_vocab = 40;
  d.micro_batch = 2;
  d.num_layers = 2;
  d.block_index = 0;
  return d;
}

std::vector<CheckRun> check_layer_plugin(const plugins::Registry& registry, const std::string& name,
                                         const toml::table* options, const SuiteOptions& so) {
  std::vector<CheckRun> runs;
  std::mt19937 rng(static_cast<uint32_t>(so.seed));
  auto run = [&](const std::string& check, const std::function<Findings()>& fn) {
    if (std::find(so.skip.begin(), so.skip.end(), check) != so.skip.end()) return;
    CheckRun c;
    c.check = check;
    try {
      c.findings = fn();
    } catch (const std::exception& e) {
      c.error = e.what();
    }
    runs.push_back(std::move(c));
  };
  auto on_one_rank = [&](const std::function<Findings(HarnessLayer&)>& fn) {
    return [&, fn] {
      HarnessRank rank(registry);
      HarnessLayer layer(rank, name, so.dims, options);
      layer.randomize(rng);
      return fn(layer);
    };
  };
  // A layer its options do not allow is one refusal, not one per check.
  try {
    HarnessRank rank(registry);
    HarnessLayer layer(rank, name, so.dims, options);
  } catch (const std::exception& e) {
    runs.push_back({.check = "create", .findings = {}, .error = e.what()});
    return runs;
  }
  run("gradients", on_one_rank([&](HarnessLayer& l) { return check_gradients(l, rng); }));
  run("accumulation", on_one_rank([&](HarnessLayer& l) { return check_accumulation(l, rng); }));
  run("microbatches", on_one_rank([&](HarnessLayer& l) { return check_microbatches_in_flight(l, rng); }));
  bool kv = false;
  {
    HarnessRank rank(registry);
    kv = HarnessLayer(rank, name, so.dims, options).takes_kv_cache();
  }
  if (kv) run("kv_cache", on_one_rank([&](HarnessLayer& l) { return check_kv_cache(l, rng); }));
  run("memory", on_one_rank([&](HarnessLayer& l) { return check_memory(l, rng); }));
  bool has_state = false;
  try {  // declarations the engine would refuse fail this check, not the others
    HarnessRank rank(registry);
    has_state = !HarnessLayer(rank, name, so.dims, options).state().empty();
  } catch (const std::exception& e) {
    runs.push_back({.check = "state", .findings = {}, .error = e.what()});
  }
  if (has_state) run("state", [&] { return check_state(registry, name, so.dims, options, rng); });
  if (so.tp > 1) {
    const std::string tp = "tp" + std::to_string(so.tp);
    run(tp, [&] { return check_tensor_parallel(registry, name, so.dims, options, rng, {.tp = so.tp}); });
    if (so.sequence_parallel)
      run(tp + "+sp", [&] {
        return check_tensor_parallel(registry, name, so.dims, options, rng,
                                     {.tp = so.tp, .sequence_parallel = true});
      });
  }
  return runs;
}

}  // namespace loom::harness
