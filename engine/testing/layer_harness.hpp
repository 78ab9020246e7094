// The layer plugin test harness: a layer plugin driven through its C table on ranks
// of the real device/cpu, comm/local and parallel/tensor, and the checks every layer
// must pass — gradients against central finite differences, parameter gradients
// that accumulate (and an input gradient that is overwritten), microbatches in
// flight in any order, and tensor parallelism (tp ranks, with and without sequence
// parallelism) equal to one rank. `loom plugins test` runs them on a plugin author's
// library; the built-in layers' own tests (tests/unit/layers_test.cpp) use the same
// classes and checks.
#pragma once

#include "engine/model/layer_states.hpp"
#include "engine/plugins/registry.hpp"
#include "engine/runtime/rank_runtime.hpp"

#include <toml++/toml.h>

#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace loom::harness {

// One rank: device/cpu with one thread, a tp group (alone by default: size 1, no
// communicator), the ep and etp groups layer/moe asks for, and the parallel/tensor
// service. `device_api`: a table to use instead of device/cpu's (e.g. one cut to an
// older ABI size); it must outlive the rank.
class HarnessRank {
 public:
  // tp: the tensor-parallel group (NULL: alone); holders: the group of the ranks holding
  // a layer, "tp-dp-cp" (NULL: alone, or none beside a tp group). The runtime owns their
  // communicators.
  explicit HarnessRank(const plugins::Registry& registry, int global_rank = 0, const loom_group* tp = nullptr,
                       const loom_device_api* device_api = nullptr, const loom_group* holders = nullptr);
  runtime::RankRuntime& rt() { return *rt_; }
  const plugins::Registry& registry() const { return registry_; }
  uint64_t device_bytes() const { return rt_->memory().current_bytes; }
  uint64_t device_peak_bytes() const { return rt_->memory().peak_bytes; }

 private:
  const plugins::Registry& registry_;
  std::unique_ptr<runtime::RankRuntime> rt_;
};

// One parameter as the layer declares it, with this rank's slice in host vectors
// (device/cpu memory is host memory).
struct Param {
  std::string name;
  std::vector<int64_t> shape;        // full
  std::vector<int64_t> local_shape;  // this tp rank's slice
  int32_t partition_dim, partition_stride, init, no_weight_decay;
  std::string tie_key;
  std::vector<float> value, grad;
};

// The inputs of one microbatch, and the fixed random R of the objective L = Σ out∘R
// (a layer that writes the loss has L = its loss_sum).
struct Batch {
  std::vector<float> x;          // [S, B, H] hidden states in
  std::vector<int32_t> tokens;   // [S, B] (a layer that reads the tokens)
  std::vector<int32_t> targets;  // [S, B] (a layer that writes the loss)
  std::vector<float> r;          // [S, B, H] (= grad_output)
};

// Normal hidden states and R, uniform tokens and targets in [0, vocab).
Batch make_batch(const loom_model_dims& dims, std::mt19937& rng);
// Tp rank r's sequence shard of x and r under sequence parallelism (rows
// [r S/tp, (r+1) S/tp) of the sequence); tokens and targets stay whole.
Batch sequence_shard(const Batch& b, const loom_model_dims& dims, int tp, int r);

// Rank r's slice of a full parameter tensor (of any element type), the way the engine
// cuts it: partition_dim is `partition_stride` concatenated blocks, each split into tp parts.
template <typename T>
std::vector<T> slice(const Param& p, const std::vector<T>& full, int tp, int r) {
  if (p.partition_dim < 0) return full;
  const size_t d = static_cast<size_t>(p.partition_dim);
  int64_t outer = 1, inner = 1;
  for (size_t i = 0; i < d; ++i) outer *= p.shape[i];
  for (size_t i = d + 1; i < p.shape.size(); ++i) inner *= p.shape[i];
  const int64_t stride = p.partition_stride > 1 ? p.partition_stride : 1, dim = p.shape[d];
  const int64_t block = dim / stride, part = block / tp;
  std::vector<T> out;
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t k = 0; k < stride; ++k) {
      const T* src = &full[static_cast<size_t>((o * dim + k * block + r * part) * inner)];
      out.insert(out.end(), src, src + part * inner);
    }
  return out;
}

// Host memory of n floats with canaries on both sides (a NaN bit pattern no arithmetic
// produces): a layer that writes outside a tensor it was given is found by the call
// that did it, instead of corrupting the next parameter's gradient (the engine's flat
// buffer) or the heap.
class GuardedFloats {
 public:
  static constexpr size_t kGuard = 64;  // floats on each side
  explicit GuardedFloats(size_t n = 0);
  float* data() { return all_.data() + kGuard; }
  const float* data() const { return all_.data() + kGuard; }
  size_t size() const { return n_; }
  // "" when both guards are whole; else which side and how many values were written.
  std::string overrun() const;

 private:
  std::vector<float> all_;
  size_t n_;
};

// A layer created through its plugin's C table on a HarnessRank. The layer is bound to
// guarded copies of its parameters and gradients: each call loads them from the
// Params' host vectors and stores the gradients back after a backward, and fails,
// naming the tensor, when the layer wrote outside one it was given, changed its
// parameters or its input, or wrote into grad_output.
class HarnessLayer {
 public:
  HarnessLayer(HarnessRank& rank, const std::string& name, const loom_model_dims& dims,
               const toml::table* options = nullptr, const std::string& instance = "blocks.0.layer",
               bool sequence_parallel = false);
  ~HarnessLayer();
  HarnessLayer(const HarnessLayer&) = delete;
  HarnessLayer& operator=(const HarnessLayer&) = delete;

  const loom_layer_api* api() const { return plugin_.layer(); }
  loom_layer* raw() const { return layer_; }
  const std::string& name() const { return name_; }
  const loom_model_dims& dims() const { return dims_; }
  HarnessRank& rank() const { return rank_; }
  std::vector<Param>& params() { return params_; }
  Param& param(const std::string& n);
  bool has_param(const std::string& n) const;
  // ABI 1.9 places: reads the tokens and takes no hidden state in (an embedding);
  // writes the loss and no hidden state out (an output head).
  bool has_input() const { return !reads_tokens_; }
  bool has_output() const { return !writes_loss_; }
  // Rows of the sequence this rank's hidden states hold (its shard under sequence parallelism).
  int64_t local_seq() const { return local_seq_; }

  // The weight of the layer's auxiliary loss in the objective (ABI 1.4
  // aux_loss_scale); 0 leaves it out.
  double aux_weight = 0.0;
  float last_aux = 0.0f;  // what the last training forward reported

  // Random values that exercise every path: norm gains around 1, non-zero biases.
  void randomize(std::mt19937& rng, float weight_std = 0.3f);
  void zero_grads();

  // One forward of microbatch `mb`; returns L (Σ out∘R, or the loss_sum).
  double forward(const Batch& b, int32_t mb = 0, bool training = true, uint64_t seed = 1234,
                 std::vector<float>* out = nullptr, int64_t* loss_count = nullptr,
                 const uint64_t* seed_device = nullptr);
  // Backward of microbatch `mb` with grad_output = R (or loss_scale for a layer that
  // writes the loss); returns grad_input (empty without an input). grad_input starts
  // as `garbage`: a layer must overwrite it, not accumulate into it.
  std::vector<float> backward(const Batch& b, int32_t mb = 0, float loss_scale = 1.0f, float garbage = 123.0f);
  // A training forward whose saved activations are dropped right away (for finite
  // differences; the microbatch is part of the dropout seed, so use the same one).
  double objective(const Batch& b, uint64_t seed = 1234, int32_t mb = 0);
  // Drops what a training forward of `mb` saved, without its backward (the layer's
  // release, when it has one).
  void release(int32_t mb);
  // ABI 1.13: the layer declares LOOM_LAYER_KV_CACHE.
  bool takes_kv_cache() const;
  // ABI 1.23: the layer's state arrays, checked as the engine checks them (none
  // without the slot), and the end of a training step (nothing without the slot).
  std::vector<model::LayerState> state() const;
  void end_step(int64_t step, int32_t microbatches);
  // A kv_cache forward of rows [first, first + rows) of b (whole sequences, no SP):
  // the output rows (with an output), or the fp32 logits of each sequence's last row
  // [micro_batch, vocab] (a layer that writes the loss).
  std::vector<float> forward_cached(const Batch& b, int64_t first, int64_t rows);

 private:
  HarnessRank& rank_;
  std::string name_, instance_;
  loom_model_dims dims_;
  const plugins::LoadedPlugin& plugin_;
  plugins::OptionValues options_;
  loom_layer* layer_ = nullptr;
  std::vector<Param> params_;
  std::vector<GuardedFloats> bound_values_, bound_grads_;  // what the layer is bound to, per parameter
  // A training forward's input, tokens and targets, kept until the microbatch's
  // backward or release (the ABI: the memory holds the data until the backward).
  struct HeldInputs {
    GuardedFloats x;
    std::vector<int32_t> tokens, targets;
  };
  std::map<int32_t, std::unique_ptr<HeldInputs>> held_;
  // Throws when the layer wrote outside or into what `h` holds (`call` names when).
  void check_inputs(const HeldInputs& h, const Batch& b, const char* call) const;

  // Copies the Params' values and gradients into the bound memory.
  void load_params();
  // After `call`: throws when a guard was overwritten or a parameter changed; after a
  // backward, stores the gradients back into the Params.
  void finish_call(const char* call, bool store_grads);
  bool reads_tokens_ = false, writes_loss_ = false;
  int64_t local_seq_ = 0;
};

// What a check found: one line per failure; `compared` counts the values compared,
// so a check that compared nothing can be told from one that passed.
struct Findings {
  std::vector<std::string> failures;
  int64_t compared = 0;
  bool ok() const { return failures.empty() && compared > 0; }
  void fail(std::string what) { failures.push_back(std::move(what)); }
  // The failures, one per line (or why nothing was compared).
  std::string text() const;
};

// Central differences (step h; where h disagrees, h / 3 and the Richardson extrapolation
// of the two, for the curvature of a norm over a few values) of an fp32 forward: analytic
// and numeric agree within rtol * max(|a|, |n|) + atol.
struct FdTolerance {
  float h = 1e-2f;
  double rtol = 2e-2, atol = 3e-3;
};

// Compares `analytic` with central differences of `objective` in `v`: at every
// coordinate of a tensor of at most kFdEveryCoordinateUpTo values (a layer's input at
// the default dims: one wrong row or element is found), else at 32 random ones and the
// 8 of largest |analytic|.
constexpr size_t kFdEveryCoordinateUpTo = 512;
void fd_check(std::vector<float>& v, const std::vector<float>& analytic, const std::function<double()>& objective,
              const std::string& what, std::mt19937& rng, Findings& out, FdTolerance tol = {});

// Every parameter and (with an input) the input, against finite differences.
Findings check_gradients(HarnessLayer& layer, std::mt19937& rng, uint64_t seed = 1234, FdTolerance tol = {});
// Two backwards add up the parameter gradients (2x one backward) and each overwrites
// the input gradient; every parameter gets a gradient.
Findings check_accumulation(HarnessLayer& layer, std::mt19937& rng);
// ABI 1.13 generation, for a layer with LOOM_LAYER_KV_CACHE: kv_cache forwards of the
// first half of the sequence and then one position at a time give the rows of one
// whole-sequence evaluation forward (the last layer: the logits of one kv_cache forward
// of the whole prefix), so what the layer keeps between calls and its positions are right.
Findings check_kv_cache(HarnessLayer& layer, std::mt19937& rng);
// Two microbatches forwarded before either is backwarded, backwarded in reverse (as a
// pipeline schedule does), give the losses, input gradients and (up to rounding) the
// parameter gradients of running them one after the other.
Findings check_microbatches_in_flight(HarnessLayer& layer, std::mt19937& rng);

// What one microbatch's training forward and backward hold on the device (on a rank
// whose high-water mark is the layer's own: a fresh one), beside what the layer
// declares. kept: what the forward leaves allocated for its backward; temporaries:
// the most either call holds beyond that. Constants a layer builds on first use are
// made by a forward and backward before the measured ones.
struct MemoryUse {
  uint64_t declared_activation = 0, declared_workspace = 0;  // activation_bytes, workspace_bytes (0: no slot)
  bool declares_workspace = false;                           // the layer has the ABI 1.19 slot
  uint64_t kept = 0, temporaries = 0;
  uint64_t left_after_backward = 0, left_after_release = 0, left_after_evaluation = 0;  // beyond the start
};
MemoryUse measure_memory(HarnessLayer& layer, std::mt19937& rng);
// What `loom plan` relies on: a training forward keeps at most activation_bytes, each
// call's temporaries fit in workspace_bytes (ABI 1.19), and backward, release and an
// evaluation forward leave nothing behind. (Allowance: 4 KiB for the allocator's rounding.)
Findings check_memory(HarnessLayer& layer, std::mt19937& rng);

// A layer with state (ABI 1.23): end_step after a training forward released without
// its backward (what recomputation's first forward and an evaluation are) leaves the
// state as end_step alone does, on two layers built alike: a step's state counts what
// its backwards saw; after trained microbatches and end_step every value is finite.
Findings check_state(const plugins::Registry& registry, const std::string& name, const loom_model_dims& dims,
                     const toml::table* options, std::mt19937& rng);

// What a tensor-parallel check compares (see check_tensor_parallel).
struct TensorParallelCase {
  int tp = 2;
  bool sequence_parallel = false;
  double aux_weight = 0.0;  // the auxiliary loss's weight in the objective (HarnessLayer::aux_weight)
  uint64_t dropout_seed = 5;
  double tol = 1e-5;  // relative to 1 + the largest value compared
};
// The layer on case.tp ranks (threads over comm/local) against the same layer on one
// rank with the full parameters: each rank's output (its shard under SP), loss,
// auxiliary loss, input gradient and parameter gradient slices equal the serial ones; duplicated
// parameters' gradients equal the serial ones on every rank, or, under sequence
// parallelism, summed over the ranks (the engine all-reduces them over tp); a layer's
// state after end_step (ABI 1.23) equals the serial one's on every rank.
Findings check_tensor_parallel(const plugins::Registry& registry, const std::string& name,
                               const loom_model_dims& dims, const toml::table* options, std::mt19937& rng,
                               const TensorParallelCase& tc = {});

// Runs fn(r, rank) on `tp` ranks (threads) of one tp group over comm/local; returns
// each rank's error ("" = none). A rank that fails aborts the group's collectives.
std::vector<std::string> run_tp_ranks(const plugins::Registry& registry, int tp,
                                      const std::function<void(int, HarnessRank&)>& fn);

// The small model the harness uses unless told otherwise: hidden 16 in 4 heads, ffn
// 32, sequence 8, micro-batch 2, vocabulary 37 padded to 40.
loom_model_dims default_dims();

// Every check above for one layer plugin, as `loom plugins test` runs them; when the
// layer cannot be created with these options at all, one "create" run with the error.
struct CheckRun {
  std::string check;  // "create" (when the layer refuses its options), "gradients", "accumulation",
                      // "microbatches", "kv_cache" (layers with LOOM_LAYER_KV_CACHE), "memory", "state"
                      // (layers with state), "tp2", "tp2+sp"
  Findings findings;
  std::string error;  // an exception the check threw ("" = none)
};
struct SuiteOptions {
  loom_model_dims dims = default_dims();
  int tp = 2;             // 1 = no tensor-parallel checks
  bool sequence_parallel = true;  // also check tp with sequence parallelism
  uint64_t seed = 1;
  // Checks not to run, by name: e.g. "gradients" for a layer whose forward is not
  // differentiable at the step the finite differences take (a router's top-k or
  // capacity decision that flips).
  std::vector<std::string> skip;
};
std::vector<CheckRun> check_layer_plugin(const plugins::Registry& registry, const std::string& name,
                                         const toml::table* options, const SuiteOptions& so = {});

}  // namespace loom::harness
