// loom C++ layer: write a plugin as an ordinary class plus one registration line.
//
//   struct MyMlp : loom::Layer { ... };
//   LOOM_PLUGIN_LIBRARY(loom::layer_plugin<MyMlp>("mlp2", "1.0.0", "my MLP", {options...}))
//
// LOOM_PLUGIN_LIBRARY defines the library's single exported entry symbol,
// loom_plugin_init_v1; the descriptors are built inside that call (never in
// static constructors), and every trampoline catches exceptions into statuses.
#pragma once

#include <loom/cpp/core.hpp>
#include <loom/cpp/expert_parallel.hpp>
#include <loom/cpp/tensor_parallel.hpp>

#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(_WIN32)
#define LOOM_PLUGIN_EXPORT __declspec(dllexport)
#else
#define LOOM_PLUGIN_EXPORT __attribute__((visibility("default")))
#endif

namespace loom {

// One option of a plugin's manifest section. The engine checks a manifest's value
// against `range` / `choices` before the plugin is created, so create() may rely on
// them:  opt_float("dropout", 0.0, "...").in("[0, 1)"),
//        opt_string("policy", "probs", "...").one_of("probs|position").
struct OptionSpec {
  int32_t type;
  std::string name;
  std::string default_value;  // TOML literal; empty together with required = true
  std::string doc;
  bool required = false;
  std::string range;    // integer and float options: "[0, 1)", "[1, inf)"; empty = any
  std::string choices;  // string options: "a|b|c"; empty = any

  OptionSpec in(std::string interval) && {
    range = std::move(interval);
    return std::move(*this);
  }
  OptionSpec one_of(std::string values) && {
    choices = std::move(values);
    return std::move(*this);
  }
};
inline OptionSpec opt_int(std::string name, int64_t dflt, std::string doc) {
  return {LOOM_OPTION_INT, std::move(name), std::to_string(dflt), std::move(doc)};
}
inline OptionSpec opt_float(std::string name, double dflt, std::string doc) {
  // The shortest text that reads back as the same double (1e-05, not 1.0000000000000001e-05).
  std::string s;
  for (int precision = 1; precision <= 17; ++precision) {
    std::ostringstream os;
    os.precision(precision);
    os << dflt;
    s = os.str();
    if (std::strtod(s.c_str(), nullptr) == dflt) break;
  }
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";  // keep it a TOML float
  return {LOOM_OPTION_FLOAT, std::move(name), s, std::move(doc)};
}
inline OptionSpec opt_bool(std::string name, bool dflt, std::string doc) {
  return {LOOM_OPTION_BOOL, std::move(name), dflt ? "true" : "false", std::move(doc)};
}
inline OptionSpec opt_string(std::string name, const std::string& dflt, std::string doc) {
  return {LOOM_OPTION_STRING, std::move(name), "\"" + dflt + "\"", std::move(doc)};
}

// A plugin descriptor under construction; owns the strings the C structs point to.
class PluginDef {
 public:
  PluginDef(std::string kind, std::string name, std::string version, std::string description,
            int32_t api_type, const void* api, std::vector<OptionSpec> options)
      : kind_(std::move(kind)), name_(std::move(name)), version_(std::move(version)),
        description_(std::move(description)), options_(std::move(options)) {
    for (const OptionSpec& o : options_) {
      loom_option_decl d = make<loom_option_decl>();
      d.type = o.type;
      d.name = o.name.c_str();
      d.default_value = o.required ? nullptr : o.default_value.c_str();
      d.doc = o.doc.c_str();
      d.range = o.range.empty() ? nullptr : o.range.c_str();
      d.choices = o.choices.empty() ? nullptr : o.choices.c_str();
      decls_.push_back(d);
    }
    info_ = make<loom_plugin_info>();
    info_.kind = kind_.c_str();
    info_.name = name_.c_str();
    info_.version = version_.c_str();
    info_.description = description_.c_str();
    info_.api_type = api_type;
    info_.api = api;
    info_.options = decls_.empty() ? nullptr : decls_.data();
    info_.num_options = decls_.size();
  }
  PluginDef(const PluginDef&) = delete;
  PluginDef& operator=(const PluginDef&) = delete;
  const loom_plugin_info* info() const { return &info_; }

 private:
  std::string kind_, name_, version_, description_;
  std::vector<OptionSpec> options_;
  std::vector<loom_option_decl> decls_;
  loom_plugin_info info_;
};
using PluginDefPtr = std::shared_ptr<PluginDef>;

// ---------------------------------------------------------------------------
// Layers
// ---------------------------------------------------------------------------

// A parameter as a layer declares it (full shape; the engine slices for tp).
struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  int32_t partition_dim = -1;
  int32_t partition_stride = 1;
  int32_t init = LOOM_INIT_NORMAL;
  float init_std = 0.02f;
  bool no_weight_decay = false;
  std::string tie_key;
  // ABI 1.4: dim 0 holds one block per expert, split over the expert-parallel
  // group (loom_param_decl.expert).
  bool expert = false;
};

// ABI 1.23: an array of a layer's state (loom_layer_state_decl): host fp32 values the
// layer updates itself (in end_step) and keeps identical on every rank holding it; the
// engine checkpoints and restores them. `data` is the layer's, valid while it lives.
struct StateSpec {
  std::string name;
  float* data = nullptr;
  int64_t count = 0;
  // LOOM_LAYER_STATE_OPTIONAL: a checkpoint without it loads (values the next step
  // recomputes, not what the model computes with).
  bool optional = false;
};

class Layer {
 public:
  virtual ~Layer() = default;
  virtual std::vector<ParamSpec> params() = 0;
  // Views of this rank's parameter slices and gradient slices, in params() order.
  virtual void bind(std::span<const DLTensor> params, std::span<const DLTensor> grads) = 0;
  virtual void forward(Rank& rank, const loom_layer_fwd_args& args) = 0;
  virtual void backward(Rank& rank, const loom_layer_bwd_args& args) = 0;
  virtual void release(int32_t /*microbatch*/) {}
  virtual uint64_t activation_bytes() { return 0; }
  // ABI 1.19: the most a forward or backward allocates for itself and frees before
  // returning (loom_layer_api.workspace_bytes), for the memory plan.
  virtual uint64_t workspace_bytes() { return 0; }
  virtual double forward_flops() { return 0; }
  // ABI 1.3: true when the training forward and backward obey the graph rules
  // (loom_layer_api.capturable): device work only, no host sync, nothing that
  // changes between steps passed by value. The engine may then capture them.
  virtual bool capturable() { return false; }
  // ABI 1.7: true when the layer's steps are not capturable as a whole but run
  // graph-safe parts of themselves through Rank::run_substep (capturable() == 2).
  virtual bool captures_parts() { return false; }
  // ABI 1.23: the layer's state (loom_layer_api.state), asked after bind.
  virtual std::vector<StateSpec> state() { return {}; }
  // ABI 1.23: once per training step after its last backward, before the optimizer
  // (loom_layer_api.end_step): update the state from what the step saw.
  virtual void end_step(Rank& /*rank*/, const loom_layer_step_end_args& /*args*/) {}
};

// What a layer's validate sees of the run (loom_layer_validate_args, ABI 1.12): the
// run's device (its memory type, features and ops), dtypes and parallel layout.
//   static void validate(const loom::Options& o, const loom::LayerValidation& v) {
//     LOOM_REQUIRE(v.device_type() == kDLCPU, "layer/mine has CPU kernels only: set device.kind = \"cpu\"");
//   }
class LayerValidation {
 public:
  explicit LayerValidation(const loom_layer_validate_args& a) : a_(a) {}
  const loom_model_dims& dims() const { return *a_.dims; }
  std::string instance_name() const { return a_.instance_name ? a_.instance_name : ""; }
  int32_t device_type() const { return a_.device_type; }
  int32_t act_dtype() const { return a_.act_dtype; }
  int32_t param_dtype() const { return a_.param_dtype; }
  int32_t grad_dtype() const { return a_.grad_dtype; }
  int tp() const { return a_.tp; }
  int cp() const { return a_.cp; }
  int ep() const { return a_.ep; }
  int etp() const { return a_.etp; }
  int pp() const { return a_.pp; }
  int dp() const { return a_.dp; }
  bool sequence_parallel() const { return a_.sequence_parallel != 0; }
  uint64_t device_features() const { return a_.device_features; }
  // has_gemm() ... has_host_task(): whether the run's device implements the op, as
  // loom::Device's has_* says on a rank.
#define LOOM_VALIDATION_HAS_OP(fn, argtype) \
  bool has_##fn() const { return LOOM_DEVICE_HAS_OP(a_.device_ops, fn); }
  LOOM_DEVICE_OP_LIST(LOOM_VALIDATION_HAS_OP)
#undef LOOM_VALIDATION_HAS_OP
  const loom_layer_validate_args& raw() const { return a_; }

 private:
  loom_layer_validate_args a_;
};

namespace detail {
struct LayerBox {
  std::unique_ptr<Layer> layer;
  std::vector<ParamSpec> specs;
  std::vector<loom_param_decl> decls;
  std::vector<StateSpec> state_specs;
  std::vector<loom_layer_state_decl> state_decls;
};
inline LayerBox* box(loom_layer* l) { return reinterpret_cast<LayerBox*>(l); }
// A copy of the caller's argument struct in this build's layout: at most the
// caller's struct_size bytes are read, and the members past it are zero (an older
// caller's struct ends before the members appended since its minor).
template <typename T>
T widened(const T* in, const char* what) {
  if (in == nullptr || in->struct_size < sizeof(uint32_t))
    throw Error(std::string(what) + ": args is NULL or has no struct_size", LOOM_CODE_INVALID_ARGUMENT);
  T out = make<T>();
  std::memcpy(&out, in, in->struct_size < sizeof(T) ? in->struct_size : sizeof(T));
  out.struct_size = static_cast<uint32_t>(sizeof(T));
  return out;
}
}  // namespace detail

// T must be constructible from (const Options&, Rank&, const loom_layer_create_args&).
template <typename T>
const loom_layer_api* layer_api() {
  static const loom_layer_api api = [] {
    loom_layer_api a = make<loom_layer_api>();
    a.create = [](const loom_options* o, loom_rank* r, const loom_layer_create_args* args,
                  loom_layer** out) -> loom_status {
      return guard([&] {
        auto b = std::make_unique<detail::LayerBox>();
        Options opts(o);
        Rank rank(r);
        b->layer = std::make_unique<T>(opts, rank, *args);
        *out = reinterpret_cast<loom_layer*>(b.release());
      });
    };
    a.destroy = [](loom_layer* l) { delete detail::box(l); };
    a.params = [](loom_layer* l, const loom_param_decl** out, size_t* count) -> loom_status {
      return guard([&] {
        detail::LayerBox* b = detail::box(l);
        b->specs = b->layer->params();
        b->decls.clear();
        for (const ParamSpec& s : b->specs) {
          LOOM_REQUIRE(!s.shape.empty() && s.shape.size() <= 4,
                       "parameter '" << s.name << "' must have 1 to 4 dimensions");
          loom_param_decl d = make<loom_param_decl>();
          d.name = s.name.c_str();
          d.ndim = static_cast<int32_t>(s.shape.size());
          for (size_t i = 0; i < s.shape.size(); ++i) d.shape[i] = s.shape[i];
          d.partition_dim = s.partition_dim;
          d.partition_stride = s.partition_stride;
          d.init = s.init;
          d.init_std = s.init_std;
          d.no_weight_decay = s.no_weight_decay ? 1 : 0;
          d.tie_key = s.tie_key.empty() ? nullptr : s.tie_key.c_str();
          d.expert = s.expert ? 1 : 0;
          b->decls.push_back(d);
        }
        *out = b->decls.data();
        *count = b->decls.size();
      });
    };
    a.bind = [](loom_layer* l, const DLTensor* p, const DLTensor* g, size_t n) -> loom_status {
      return guard([&] { detail::box(l)->layer->bind({p, n}, {g, n}); });
    };
    // The caller's args in this build's layout, read no further than their
    // struct_size. The engine's cover every member of this build's header (the
    // loader refuses a library newer than the engine).
    a.forward = [](loom_layer* l, loom_rank* r, const loom_layer_fwd_args* args) -> loom_status {
      return guard([&] {
        Rank rank(r);
        detail::box(l)->layer->forward(rank, detail::widened(args, "layer forward"));
      });
    };
    a.backward = [](loom_layer* l, loom_rank* r, const loom_layer_bwd_args* args) -> loom_status {
      return guard([&] {
        Rank rank(r);
        detail::box(l)->layer->backward(rank, detail::widened(args, "layer backward"));
      });
    };
    a.release = [](loom_layer* l, int32_t mb) {
      (void)guard([&] { detail::box(l)->layer->release(mb); });
    };
    a.activation_bytes = [](loom_layer* l) -> uint64_t {
      uint64_t v = 0;
      (void)guard([&] { v = detail::box(l)->layer->activation_bytes(); });
      return v;
    };
    a.workspace_bytes = [](loom_layer* l) -> uint64_t {
      uint64_t v = 0;
      (void)guard([&] { v = detail::box(l)->layer->workspace_bytes(); });
      return v;
    };
    a.capturable = [](loom_layer* l) -> int32_t {
      int32_t v = 0;
      (void)guard([&] {
        Layer& layer = *detail::box(l)->layer;
        v = layer.capturable() ? 1 : layer.captures_parts() ? 2 : 0;
      });
      return v;
    };
    a.state = [](loom_layer* l, const loom_layer_state_decl** out, size_t* count) -> loom_status {
      return guard([&] {
        detail::LayerBox* b = detail::box(l);
        b->state_specs = b->layer->state();
        b->state_decls.clear();
        for (const StateSpec& s : b->state_specs) {
          loom_layer_state_decl d = make<loom_layer_state_decl>();
          d.name = s.name.c_str();
          d.count = s.count;
          d.data = s.data;
          d.flags = s.optional ? LOOM_LAYER_STATE_OPTIONAL : 0u;
          b->state_decls.push_back(d);
        }
        *out = b->state_decls.empty() ? nullptr : b->state_decls.data();
        *count = b->state_decls.size();
      });
    };
    a.end_step = [](loom_layer* l, loom_rank* r, const loom_layer_step_end_args* args) -> loom_status {
      return guard([&] {
        Rank rank(r);
        detail::box(l)->layer->end_step(rank, detail::widened(args, "layer end_step"));
      });
    };
    a.forward_flops = [](loom_layer* l) -> double {
      double v = 0;
      (void)guard([&] { v = detail::box(l)->layer->forward_flops(); });
      return v;
    };
    // A static constexpr uint64_t kFeatures in T sets loom_layer_api.features
    // (LOOM_LAYER_*, ABI 1.6).
    if constexpr (requires { T::kFeatures; }) a.features = T::kFeatures;
    // A static validate(const Options&, const LayerValidation&) in T sets
    // loom_layer_api.validate (ABI 1.12); a LOOM_REQUIRE in it becomes the refusal.
    if constexpr (requires(const Options& o, const LayerValidation& v) { T::validate(o, v); }) {
      a.validate = [](const loom_options* o, const loom_layer_validate_args* args) -> loom_status {
        return guard([&] { T::validate(Options(o), LayerValidation(detail::widened(args, "layer validate"))); });
      };
    }
    return a;
  }();
  return &api;
}

template <typename T>
PluginDefPtr layer_plugin(std::string name, std::string version, std::string description,
                          std::vector<OptionSpec> options = {}) {
  return std::make_shared<PluginDef>("layer", std::move(name), std::move(version),
                                     std::move(description), LOOM_API_LAYER, layer_api<T>(),
                                     std::move(options));
}

// ---------------------------------------------------------------------------
// Optimizer strategies
// ---------------------------------------------------------------------------

class OptimizerStrategy {
 public:
  virtual ~OptimizerStrategy() = default;
  // Returns the gradient norm before clipping.
  virtual float step(Rank& rank, const loom_optimizer_step_args& args) = 0;
  virtual size_t state_size() = 0;
  virtual void state_save(void* buf, size_t bytes) = 0;
  virtual void state_load(const void* buf, size_t bytes) = 0;
  // ABI 1.1: state saved at another data-parallel size (same tp and pp), remapped
  // by parameter index and range within the parameter. Strategies that cannot
  // reshard keep this default, which the slot reports as LOOM_CODE_UNSUPPORTED.
  virtual void state_load_resharded(const loom_optimizer_reshard_args& args) {
    throw Error("this optimizer strategy cannot load state saved at another data-parallel size (dp=" +
                    std::to_string(args.old_dp) + "): it does not implement state_load_resharded",
                LOOM_CODE_UNSUPPORTED);
  }
  // ABI 1.14: state for every element of this rank's flat buffer (a resume at another
  // tp, pp, cp or ep; loom_optimizer_elements). A strategy that implements it also
  // gives `static void state_decode(const void* state, size_t bytes,
  // loom_optimizer_elements& out)`, which fills both slots; without it both stay NULL.
  virtual void state_import(const loom_optimizer_elements& in) {
    throw Error("this optimizer strategy cannot load state by element (" + std::to_string(in.num_arrays) +
                    " arrays): it does not implement state_import",
                LOOM_CODE_UNSUPPORTED);
  }
  // ABI 1.15: the gradients of these parameters (indices into the create args'
  // infos) are final; a strategy may start reducing the buckets they complete. A
  // strategy that does not override it leaves the slot NULL (the engine then refuses
  // optimizer.overlap_grad_reduce).
  virtual void grads_ready(Rank& /*rank*/, const size_t* /*params*/, size_t /*num_params*/) {}
  // ABI 1.16: the engine is about to read these parameters; a strategy that left its
  // all-gather running after step (LOOM_OPTIMIZER_OVERLAP_PARAM_GATHER) waits for
  // theirs. Without an override the slot stays NULL.
  virtual void params_needed(Rank& /*rank*/, const size_t* /*params*/, size_t /*num_params*/) {}
};

// The group expert parameters are split over: etp (since 1.5), or tp when the engine
// gave none (a strategy without LOOM_OPTIMIZER_EXPERT_FOLDING, where etp is tp).
inline const loom_group& expert_tp_group(const loom_optimizer_create_args& a) {
  const bool has_slot = a.struct_size >= offsetof(loom_optimizer_create_args, etp) + sizeof(a.etp);
  return has_slot && a.etp.size > 0 ? a.etp : a.tp;
}

// Whether parameter i is an expert parameter (since 1.4).
inline bool is_expert(const loom_optimizer_create_args& a, size_t i) {
  const bool has_slot = a.struct_size >= offsetof(loom_optimizer_create_args, expert) + sizeof(a.expert);
  return has_slot && a.expert != nullptr && a.expert[i] != 0;
}

// Whether parameter i's gradient is counted in global norms by another rank: a
// tp-duplicated copy (counted on tp rank 0; an expert one on etp rank 0) or a tied copy on another pipeline
// stage (ABI 1.1, counted on the owning stage).
inline bool counted_elsewhere(const loom_optimizer_create_args& a, size_t i) {
  const loom_group& tp = is_expert(a, i) ? expert_tp_group(a) : a.tp;
  if (a.infos[i].duplicated && tp.rank != 0) return true;
  const bool has_slot = a.struct_size >= offsetof(loom_optimizer_create_args, counted_elsewhere) +
                                            sizeof(a.counted_elsewhere);
  return has_slot && a.counted_elsewhere != nullptr && a.counted_elsewhere[i] != 0;
}

// Whether the run folds MoE parallelism (ABI 1.5): expert parameters split over an
// etp group other than tp, the ep group spanning tp ranks. Then global norms sum
// the expert part over ep and etp, the dense part over tp.
inline bool experts_fold_tp(const loom_optimizer_create_args& a) {
  return a.expert != nullptr && expert_tp_group(a).size != a.tp.size;
}

// Whether the engine gave expert flags and expert groups other than the dense ones
// (ABI 1.4: ep > 1; 1.5: or folded): then expert gradients are reduced over a.edp,
// not a.dp.
inline bool expert_parallel(const loom_optimizer_create_args& a) {
  const bool has_slot = a.struct_size >= offsetof(loom_optimizer_create_args, edp) + sizeof(a.edp);
  return has_slot && a.expert != nullptr && (a.ep.size > 1 || experts_fold_tp(a));
}

// Where the expert parameters begin in the buffers (ABI 1.4: the engine places
// them after all others, from a bucket boundary on); a.numel when there are none.
// Throws when a dense parameter lies past an expert one.
inline size_t expert_tail_start(const loom_optimizer_create_args& a) {
  size_t start = a.numel, dense_end = 0;
  for (size_t i = 0; i < a.num_params; ++i) {
    const loom_param_info& p = a.infos[i];
    if (is_expert(a, i)) start = std::min(start, p.offset);
    else dense_end = std::max(dense_end, p.offset + p.numel);
  }
  LOOM_REQUIRE(start == a.numel || dense_end <= start,
               "the expert parameters do not form the tail of the buffers (they start at "
                   << start << ", a dense parameter ends at " << dense_end << ")");
  return start;
}

// The buckets the engine laid the buffers out in, as [start, end) element ranges
// (one over everything when it gave none).
inline std::vector<std::pair<size_t, size_t>> bucket_ranges(const loom_optimizer_create_args& a) {
  std::vector<std::pair<size_t, size_t>> out;
  const bool has_slot = a.struct_size >= offsetof(loom_optimizer_create_args, num_buckets) + sizeof(a.num_buckets);
  if (has_slot && a.bucket_offsets != nullptr && a.num_buckets > 0)
    for (size_t b = 0; b < a.num_buckets; ++b) out.emplace_back(a.bucket_offsets[b], a.bucket_offsets[b + 1]);
  else
    out.emplace_back(0, a.numel);
  return out;
}

// Which buckets are complete as grads_ready (ABI 1.15) announces parameters: the
// engine never splits a parameter between buckets, so each belongs to the one
// holding its first element, and a bucket is complete once all of its parameters
// were announced. A bucket holding none is never complete (reduce it in step).
class BucketReadiness {
 public:
  BucketReadiness() = default;
  BucketReadiness(const loom_optimizer_create_args& a, const std::vector<std::pair<size_t, size_t>>& buckets)
      : params_in_(buckets.size(), 0) {
    for (size_t i = 0; i < a.num_params; ++i) {
      const size_t offset = a.infos[i].offset;
      size_t b = 0;
      while (b < buckets.size() && !(offset >= buckets[b].first && offset < buckets[b].second)) ++b;
      LOOM_REQUIRE(b < buckets.size() && a.infos[i].offset + a.infos[i].numel <= buckets[b].second,
                   "parameter " << i << " [" << offset << ", " << offset + a.infos[i].numel
                                << ") does not lie inside one bucket");
      bucket_of_.push_back(b);
      ++params_in_[b];
    }
    reset();
  }
  // Marks the parameters announced; returns the buckets they completed, in
  // ascending order (the same on every member that announced the same).
  std::vector<size_t> announce(const size_t* params, size_t n) {
    std::vector<size_t> complete;
    for (size_t k = 0; k < n; ++k) {
      LOOM_REQUIRE(params[k] < bucket_of_.size() && !announced_[params[k]],
                   "grads_ready: parameter " << params[k] << " is unknown or was announced twice this step");
      announced_[params[k]] = 1;
      const size_t b = bucket_of_[params[k]];
      if (--remaining_[b] == 0) complete.push_back(b);
    }
    std::sort(complete.begin(), complete.end());
    return complete;
  }
  // The bucket holding parameter i.
  size_t bucket_of(size_t i) const { return bucket_of_.at(i); }
  // A new step: nothing announced.
  void reset() {
    remaining_ = params_in_;
    announced_.assign(bucket_of_.size(), 0);
  }

 private:
  std::vector<size_t> bucket_of_;   // by parameter
  std::vector<size_t> params_in_;   // by bucket
  std::vector<size_t> remaining_;   // by bucket, this step
  std::vector<char> announced_;     // by parameter, this step
};

// A global-norm partial v summed over each group in turn, through `scratch` (one
// double of device memory, so a GPU communicator gets device memory on the stream).
inline double all_reduce_sum(const Device& dev, void* scratch, double v, std::initializer_list<loom_group> groups) {
  dev.copy(scratch, &v, sizeof(double), LOOM_COPY_HOST_TO_DEVICE);
  for (const loom_group& g : groups) Group(g).all_reduce(dev.native_stream(), scratch, scratch, 1, LOOM_DTYPE_F64);
  dev.copy(&v, scratch, sizeof(double), LOOM_COPY_DEVICE_TO_HOST);
  dev.synchronize();
  return v;
}

// An optimizer step's multi-tensor calls (ABI 1.8, devices with LOOM_DEVICE_MULTI_TENSOR):
// the segments of its gradient norm and of its AdamW as tables in device memory, so
// each is one device call instead of one per tensor, with the same values. On an older
// device enabled() is false and the strategy calls the ops tensor by tensor.
class MultiTensorStep {
 public:
  MultiTensorStep() = default;
  // `decayed[i]`: whether AdamW segment i takes the step's weight decay (else 0).
  MultiTensorStep(loom_rank* rank, const Device& dev, const std::vector<loom_reduce_segment>& norm,
                  std::vector<loom_adamw_segment> adamw, std::vector<bool> decayed)
      : adamw_(std::move(adamw)), decayed_(std::move(decayed)), num_norm_(norm.size()) {
    if ((dev.features() & LOOM_DEVICE_MULTI_TENSOR) == 0) return;
    enabled_ = true;
    norm_dev_ = Buffer(rank, std::max<size_t>(1, norm.size()) * sizeof(loom_reduce_segment));
    adamw_dev_ = Buffer(rank, std::max<size_t>(1, adamw_.size()) * sizeof(loom_adamw_segment));
    if (!norm.empty())
      dev.copy(norm_dev_.get(), norm.data(), norm.size() * sizeof(loom_reduce_segment), LOOM_COPY_HOST_TO_DEVICE);
  }
  bool enabled() const { return enabled_; }

  // out[i] = the sum of squares of norm segment i of `grads`, in one call.
  void norm_parts(const Device& dev, const void* grads, int32_t grad_dtype, float* out) const {
    if (num_norm_ == 0) return;
    loom_reduce_args r = make<loom_reduce_args>();
    r.op = LOOM_RED_SUM_SQUARES;
    r.x = grads;
    r.out = out;
    r.dtype = grad_dtype;
    r.out_dtype = LOOM_DTYPE_F32;
    r.num_segments = static_cast<int64_t>(num_norm_);
    r.segments = norm_dev_.get<loom_reduce_segment>();
    dev.reduce(r);
  }

  // AdamW over every segment in one call: `a` as for one tensor (buffers at offset 0;
  // n and weight_decay are taken from the segments). The table is rewritten when the
  // weight decay changes.
  void adamw(const Device& dev, loom_adamw_args a) {
    if (adamw_.empty()) return;
    if (!uploaded_ || a.weight_decay != weight_decay_) {
      for (size_t i = 0; i < adamw_.size(); ++i) adamw_[i].weight_decay = decayed_[i] ? a.weight_decay : 0.0f;
      dev.copy(adamw_dev_.get(), adamw_.data(), adamw_.size() * sizeof(loom_adamw_segment), LOOM_COPY_HOST_TO_DEVICE);
      weight_decay_ = a.weight_decay;
      uploaded_ = true;
    }
    a.num_segments = static_cast<int64_t>(adamw_.size());
    a.segments = adamw_dev_.get<loom_adamw_segment>();
    dev.adamw(a);
  }

 private:
  bool enabled_ = false, uploaded_ = false;
  float weight_decay_ = 0.0f;
  std::vector<loom_adamw_segment> adamw_;
  std::vector<bool> decayed_;
  size_t num_norm_ = 0;
  Buffer norm_dev_, adamw_dev_;
};

// T must be constructible from (const Options&, Rank&, const loom_optimizer_create_args&).
// A static constexpr uint64_t kFeatures in T sets loom_optimizer_api.features.
template <typename T>
const loom_optimizer_api* optimizer_api() {
  static const loom_optimizer_api api = [] {
    loom_optimizer_api a = make<loom_optimizer_api>();
    a.create = [](const loom_options* o, loom_rank* r, const loom_optimizer_create_args* args,
                  loom_optimizer** out) -> loom_status {
      return guard([&] {
        Options opts(o);
        Rank rank(r);
        *out = reinterpret_cast<loom_optimizer*>(
            static_cast<OptimizerStrategy*>(new T(opts, rank, *args)));
      });
    };
    a.destroy = [](loom_optimizer* p) { delete reinterpret_cast<OptimizerStrategy*>(p); };
    a.step = [](loom_optimizer* p, loom_rank* r, const loom_optimizer_step_args* args,
                loom_optimizer_step_result* res) -> loom_status {
      return guard([&] {
        Rank rank(r);
        float norm = reinterpret_cast<OptimizerStrategy*>(p)->step(rank, *args);
        if (LOOM_HAS_SLOT(res, loom_optimizer_step_result, grad_norm)) res->grad_norm = norm;
      });
    };
    a.state_size = [](loom_optimizer* p, size_t* bytes) -> loom_status {
      return guard([&] { *bytes = reinterpret_cast<OptimizerStrategy*>(p)->state_size(); });
    };
    a.state_save = [](loom_optimizer* p, void* buf, size_t bytes) -> loom_status {
      return guard([&] { reinterpret_cast<OptimizerStrategy*>(p)->state_save(buf, bytes); });
    };
    a.state_load = [](loom_optimizer* p, const void* buf, size_t bytes) -> loom_status {
      return guard([&] { reinterpret_cast<OptimizerStrategy*>(p)->state_load(buf, bytes); });
    };
    a.state_load_resharded = [](loom_optimizer* p, const loom_optimizer_reshard_args* args) -> loom_status {
      return guard([&] {
        LOOM_REQUIRE(args != nullptr && args->struct_size >= sizeof(loom_optimizer_reshard_args),
                     "state_load_resharded: got a loom_optimizer_reshard_args of "
                         << (args ? args->struct_size : 0) << " bytes, fewer than the " << sizeof(loom_optimizer_reshard_args)
                         << " this plugin reads");
        reinterpret_cast<OptimizerStrategy*>(p)->state_load_resharded(*args);
      });
    };
    if constexpr (requires { T::kFeatures; }) a.features = T::kFeatures;
    // Filled only when T overrides them, so the engine can refuse the overlap options
    // for a strategy that would silently overlap nothing.
    if constexpr (!std::is_same_v<decltype(&T::grads_ready), decltype(&OptimizerStrategy::grads_ready)>)
      a.grads_ready = [](loom_optimizer* p, loom_rank* r, const size_t* params, size_t n) -> loom_status {
        return guard([&] {
          LOOM_REQUIRE(params != nullptr || n == 0, "grads_ready: " << n << " parameters and no array of them");
          Rank rank(r);
          reinterpret_cast<OptimizerStrategy*>(p)->grads_ready(rank, params, n);
        });
      };
    if constexpr (!std::is_same_v<decltype(&T::params_needed), decltype(&OptimizerStrategy::params_needed)>)
      a.params_needed = [](loom_optimizer* p, loom_rank* r, const size_t* params, size_t n) -> loom_status {
        return guard([&] {
          LOOM_REQUIRE(params != nullptr || n == 0, "params_needed: " << n << " parameters and no array of them");
          Rank rank(r);
          reinterpret_cast<OptimizerStrategy*>(p)->params_needed(rank, params, n);
        });
      };
    if constexpr (requires(const void* s, size_t n, loom_optimizer_elements& e) { T::state_decode(s, n, e); }) {
      a.state_decode = [](const void* state, size_t bytes, loom_optimizer_elements* out) -> loom_status {
        return guard([&] {
          LOOM_REQUIRE(out != nullptr && out->struct_size >= sizeof(loom_optimizer_elements),
                       "state_decode: got a loom_optimizer_elements of " << (out ? out->struct_size : 0)
                                                                         << " bytes, fewer than this plugin reads");
          T::state_decode(state, bytes, *out);
        });
      };
      a.state_import = [](loom_optimizer* p, const loom_optimizer_elements* in) -> loom_status {
        return guard([&] {
          LOOM_REQUIRE(in != nullptr && in->struct_size >= sizeof(loom_optimizer_elements) && in->arrays != nullptr,
                       "state_import: got no arrays, or a loom_optimizer_elements shorter than this plugin reads");
          reinterpret_cast<OptimizerStrategy*>(p)->state_import(*in);
        });
      };
    }
    return a;
  }();
  return &api;
}

template <typename T>
PluginDefPtr optimizer_plugin(std::string name, std::string version, std::string description,
                              std::vector<OptionSpec> options = {}) {
  return std::make_shared<PluginDef>("parallel", std::move(name), std::move(version),
                                     std::move(description), LOOM_API_OPTIMIZER,
                                     optimizer_api<T>(), std::move(options));
}

// ---------------------------------------------------------------------------
// Pipeline schedules: a function from (pp, vpp, M, N, rank) to a signed order.
// ---------------------------------------------------------------------------

struct ScheduleOrder {
  std::vector<int32_t> order;
  int32_t warmup = 0;
};
using ScheduleFn = ScheduleOrder (*)(const Options&, const loom_schedule_args&);

template <ScheduleFn Fn>
const loom_schedule_api* schedule_api() {
  static const loom_schedule_api api = [] {
    loom_schedule_api a = make<loom_schedule_api>();
    a.order = [](const loom_options* o, const loom_schedule_args* args, int32_t* order,
                 size_t capacity, size_t* length, int32_t* warmup) -> loom_status {
      return guard([&] {
        ScheduleOrder s = Fn(Options(o), *args);
        LOOM_REQUIRE(s.order.size() <= capacity, "schedule order of " << s.order.size()
                                                     << " entries exceeds capacity " << capacity);
        std::copy(s.order.begin(), s.order.end(), order);
        *length = s.order.size();
        *warmup = s.warmup;
      });
    };
    return a;
  }();
  return &api;
}

template <ScheduleFn Fn>
PluginDefPtr schedule_plugin(std::string name, std::string version, std::string description,
                             std::vector<OptionSpec> options = {}) {
  return std::make_shared<PluginDef>("parallel", std::move(name), std::move(version),
                                     std::move(description), LOOM_API_SCHEDULE, schedule_api<Fn>(),
                                     std::move(options));
}

// ---------------------------------------------------------------------------
// Plugins whose C table is written by hand (device, comm, exec).
// ---------------------------------------------------------------------------

inline PluginDefPtr raw_plugin(std::string kind, std::string name, std::string version,
                               std::string description, int32_t api_type, const void* api,
                               std::vector<OptionSpec> options = {}) {
  return std::make_shared<PluginDef>(std::move(kind), std::move(name), std::move(version),
                                     std::move(description), api_type, api, std::move(options));
}

namespace detail {
struct Library {
  std::vector<PluginDefPtr> defs;
  std::vector<const loom_plugin_info*> infos;
  loom_plugin_library lib;
};
inline loom_status init_library(const loom_host_api* host, const loom_plugin_library** out,
                                std::vector<PluginDefPtr> (*build)()) noexcept {
  if (host == nullptr || out == nullptr) return nullptr;  // nothing to report through
  host_slot() = host;
  return guard([&] {
    static Library library;  // built on first call, inside the entry point
    if (library.defs.empty()) {
      library.defs = build();
      for (const PluginDefPtr& d : library.defs) library.infos.push_back(d->info());
      library.lib = make<loom_plugin_library>();
      library.lib.abi_major = LOOM_ABI_MAJOR;
      library.lib.abi_minor = LOOM_ABI_MINOR;
      library.lib.plugins = library.infos.data();
      library.lib.num_plugins = library.infos.size();
    }
    *out = &library.lib;
  });
}
}  // namespace detail
}  // namespace loom

// Defines the library's entry point from a list of PluginDefPtr expressions.
#define LOOM_PLUGIN_LIBRARY(...)                                                             \
  extern "C" LOOM_PLUGIN_EXPORT loom_status loom_plugin_init_v1(const loom_host_api* host,   \
                                                                const loom_plugin_library** out) { \
    return ::loom::detail::init_library(host, out, []() -> std::vector<::loom::PluginDefPtr> { \
      return {__VA_ARGS__};                                                                  \
    });                                                                                      \
  }
