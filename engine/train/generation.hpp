// Text generation from a trained model (`loom generate`): the prompt runs through the
// model once (prefill), then one token per step through every pipeline stage, each
// attention layer keeping the keys and values of the positions seen so far (ABI 1.13
// kv_cache forwards), so a step costs one position, not the whole prefix. Runs at the
// tensor and pipeline layout of the plan, without data, context or sequence
// parallelism (generation_plan makes such a plan from a training manifest); the last
// stage picks each token from the logits (greedy, or sampled with temperature, top-k
// and top-p) and every rank learns it by one all-reduce of two numbers.
#pragma once

#include "engine/model/model.hpp"
#include "engine/plugins/registry.hpp"
#include "engine/runtime/rank_runtime.hpp"
#include "engine/train/data.hpp"
#include "engine/train/init_weights.hpp"
#include "engine/train/run_plan.hpp"

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace loom::train {

struct Sampling {
  double temperature = 1.0;  // 0: greedy (the most likely token)
  int64_t top_k = 0;         // keep the k most likely tokens (0: all)
  double top_p = 1.0;        // then the fewest whose probabilities sum to at least p (nucleus)
  uint64_t seed = 0;
};

// One token from the logits of a vocabulary: argmax for temperature 0 or top_k 1 (the
// first of equal maxima), else a draw from softmax(logits / temperature) cut to top_k
// and top_p. Pure given rng's state: every rank that calls it with the same state
// picks the same token. Throws loom::Error for a logit that is NaN or infinite.
int32_t sample_token(std::span<const float> logits, const Sampling& sampling, std::mt19937_64& rng);

struct GenerationRequest {
  std::vector<int32_t> prompt;   // at least one token
  int64_t max_new_tokens = 64;   // fewer when the model's seq_len is reached first
  Sampling sampling;
  std::vector<int32_t> stop_tokens;  // any ends generation (and is kept) when drawn
  // Tokens at or above it are never drawn: a tokenizer's vocabulary below the model's
  // (padded to a multiple, e.g. 50304 for GPT-2's 50257). 0: the model's vocabulary.
  int64_t token_limit = 0;
  // false: every step runs the whole sequence again from position 0 (what the cache
  // saves; tests compare the two).
  bool use_cache = true;
  bool keep_logits = false;      // GenerationResult::logits (tests)
  // Called as each token is chosen, on the rank that reports (last stage, tp rank 0).
  std::function<void(int32_t token)> on_token;
  const std::atomic<int>* stop_signal = nullptr;  // non-zero: stop after the current token
};

struct GenerationResult {
  std::vector<int32_t> tokens;               // the new tokens
  std::vector<std::vector<float>> logits;    // the logits each was chosen from (keep_logits)
  double prefill_ms = 0, decode_ms = 0;      // the prompt's forward; the later steps together
  bool reached_seq_len = false;              // stopped at the model's seq_len
  bool interrupted = false;                  // stopped by stop_signal
  int64_t reused = 0;     // the prompt's first positions whose keys and values were cached already
  int64_t forwarded = 0;  // the positions of prompt + tokens the cache holds after it
};

// A plan for generation from a training manifest: its model, device and comm, at
// the tensor and pipeline sizes it names (after `overrides`, e.g. parallel.tp=1),
// with one sequence, no data, context or sequence parallelism, eager execution and no
// recomputation. Throws manifest::ManifestError as make_plan does, and loom::Error
// naming a layer that cannot generate with a key/value cache.
RunPlan generation_plan(const std::string& manifest_toml, const std::string& name, std::vector<std::string> overrides,
                        plugins::Registry& registry);

// Every layer of the plan takes kv_cache forwards (ABI 1.13 LOOM_LAYER_KV_CACHE, a
// layer built for 1.13 or later); throws loom::Error naming the first that does not.
void require_kv_cache_layers(const RunPlan& plan);

// The generation loop on one rank of a model that is already built (a run's, between
// steps): every rank of the world calls it alike. The model must run without context
// or sequence parallelism. `reports`: this rank picks the tokens, calls on_token and
// keeps the logits (one rank of the world: the last pipeline stage's first tp rank of
// dp rank 0); every rank's result has the tokens and timings.
// docs: the documents the model was trained with (data.reset_*), found in the sequence
// as it grows. cached: the prompt's first positions whose keys and values the model's
// cache holds from the rank's last generation (with request.use_cache; less than the
// prompt's length): the prompt's forward starts after them.
GenerationResult generate_on_rank(model::Model& model, runtime::RankRuntime& rt, int64_t vocab,
                                  const GenerationRequest& request, bool reports, DocumentInputs docs = {},
                                  int64_t cached = 0);

// Throws loom::Error for a request `plan`'s model (of `vocab` tokens) cannot run: a
// prompt that is empty, has an id outside the vocabulary or fills seq_len; sampling
// settings out of range; a token limit above the vocabulary.
void check_generation_request(const RunPlan& plan, int64_t vocab, const GenerationRequest& request);

// A model kept on its ranks between requests (`loom serve`; `loom generate` makes one
// for its one request): the ranks of `plan` (generation_plan's) start and build the
// model once, its parameters from `weights` (whole tensors, checked by
// check_initial_weights; not needed once the constructor has returned), then each
// generate() runs one request on every rank. Requests take turns: a call from another
// thread waits for the one running. `plan` must outlive the Generator.
// A request whose prompt starts with the sequence of the one before (a conversation's
// next turn: the earlier turns, the reply, the new message) reuses the keys and values
// the model's cache holds of it: its prompt's forward starts after the common part
// (GenerationResult::reused). After a rank fails (a NaN logit, a device error), that
// generate() and every later one throw the run's error (runtime::RunError); the ranks
// are gone.
class Generator {
 public:
  Generator(const RunPlan& plan, const InitialWeights& weights, int64_t vocab);
  ~Generator();  // the ranks stop (a request in flight first ends)
  Generator(const Generator&) = delete;
  Generator& operator=(const Generator&) = delete;

  // Throws loom::Error for a request check_generation_request refuses, before any rank
  // sees it.
  GenerationResult generate(const GenerationRequest& request);
  int64_t vocab() const { return vocab_; }
  int64_t seq_len() const { return plan_.config.model.seq_length; }

 private:
  struct Ranks;
  const RunPlan& plan_;
  std::vector<int32_t> in_cache_;  // the sequence whose keys and values the ranks' caches hold
  const int64_t vocab_;
  std::unique_ptr<Ranks> ranks_;
};

// Generates on every rank of `plan` (generation_plan's), the model's parameters from
// `weights`: one request of a Generator, the request checked before the model is built.
GenerationResult generate(const RunPlan& plan, const InitialWeights& weights, int64_t vocab,
                          const GenerationRequest& request);

}  // namespace loom::train
