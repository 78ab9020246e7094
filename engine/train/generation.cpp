#include "engine/train/generation.hpp"

#include "engine/manifest/batches.hpp"
#include "engine/model/model.hpp"
#include "engine/runtime/launcher.hpp"
#include "engine/train/memory_plan.hpp"
#include "engine/train/trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <numeric>

namespace loom::train {

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// A uniform draw in [0, 1) from 53 bits (the same on every platform, unlike
// std::uniform_real_distribution).
double uniform(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

}  // namespace

void require_kv_cache_layers(const RunPlan& plan) {
  for (const model::LayerSpec& l : plan.layers) {
    const plugins::LoadedPlugin& p = plan.registry->get("layer", l.plugin);
    const loom_layer_api* api = p.layer();
    const bool kv = p.abi_minor >= 13 && api != nullptr && LOOM_HAS_SLOT(api, loom_layer_api, features) &&
                    (api->features & LOOM_LAYER_KV_CACHE) != 0;
    if (!kv)
      throw loom::Error("layer " + l.instance + " (" + p.key() + ", ABI 1." + std::to_string(p.abi_minor) +
                        ") cannot generate: it does not take key/value-cache forwards (LOOM_LAYER_KV_CACHE, ABI 1.13)");
  }
}

namespace {

// The generation loop of one rank: its chunks of the model run in global chunk order
// (chunk k on pipeline rank k % pp, as its local chunk k / pp), the hidden states
// passed over the pipeline group (tag k), one step per new token.
class RankGeneration {
 public:
  RankGeneration(model::Model& model, runtime::RankRuntime& rt, int64_t vocab, bool reports, DocumentInputs docs,
                 int64_t cached)
      : model_(model), rt_(rt), world_(rt.group_or_self("world")), pp_(rt.group_or_self("pp")), vocab_(vocab),
        reports_(reports), docs_(docs), cached_(cached) {}

  GenerationResult run(const GenerationRequest& req) {
    const int64_t seq_len = model_.dims().seq_len;
    std::vector<int32_t> seq = req.prompt;
    std::mt19937_64 rng(req.sampling.seed);
    std::vector<float> logits(static_cast<size_t>(vocab_));
    const std::span<const float> drawable(logits.data(), static_cast<size_t>(req.token_limit > 0 ? req.token_limit : vocab_));
    GenerationResult out;
    loom::Buffer tokens(&rt_, static_cast<size_t>(seq_len) * sizeof(int32_t));
    loom::Buffer starts(&rt_, docs_.starts ? static_cast<size_t>(seq_len) * sizeof(int32_t) : 0);
    loom::Buffer positions(&rt_, docs_.positions ? static_cast<size_t>(seq_len) * sizeof(int32_t) : 0);
    loom::Buffer decided(&rt_, 2 * sizeof(float));
    LOOM_REQUIRE(cached_ >= 0 && cached_ < static_cast<int64_t>(seq.size()) && (cached_ == 0 || req.use_cache),
                 "generation: " << cached_ << " cached positions of a prompt of " << seq.size());
    out.reused = cached_;
    for (int64_t step = 0; step < req.max_new_tokens; ++step) {
      if (static_cast<int64_t>(seq.size()) >= seq_len) {
        out.reached_seq_len = true;
        break;
      }
      const Clock::time_point t0 = Clock::now();
      // With the cache: the prompt (after what the cache holds of it), then the newest
      // token at its position.
      const int64_t offset = !req.use_cache ? 0 : step > 0 ? static_cast<int64_t>(seq.size()) - 1 : cached_;
      const int64_t rows = static_cast<int64_t>(seq.size()) - offset;
      rt_.dev().copy(tokens.get(), seq.data() + offset, static_cast<size_t>(rows) * sizeof(int32_t),
                     LOOM_COPY_HOST_TO_DEVICE);
      // Documents (data.reset_*): the rows' starts and positions in the sequence so far,
      // as training saw them (a token after an end token starts another document).
      if (docs_.starts || docs_.positions) {
        const std::vector<int32_t> s = document_starts(seq, static_cast<int64_t>(seq.size()), 1, docs_.end_of_document);
        const std::vector<int32_t> p = document_positions(s, 1);
        const size_t bytes = static_cast<size_t>(rows) * sizeof(int32_t);
        if (docs_.starts) rt_.dev().copy(starts.get(), s.data() + offset, bytes, LOOM_COPY_HOST_TO_DEVICE);
        if (docs_.positions) rt_.dev().copy(positions.get(), p.data() + offset, bytes, LOOM_COPY_HOST_TO_DEVICE);
      }
      forward_all_chunks(rows, offset, tokens.get<int32_t>(), logits.data(),
                         docs_.starts ? starts.get<int32_t>() : nullptr,
                         docs_.positions ? positions.get<int32_t>() : nullptr);
      out.forwarded = offset + rows;
      // The reporting rank picks the token; every rank learns it and whether any saw a
      // stop signal, so all stop after the same token.
      float mine[2] = {0.0f, req.stop_signal && req.stop_signal->load() != 0 ? 1.0f : 0.0f};
      if (reports_) mine[0] = static_cast<float>(sample_token(drawable, req.sampling, rng) + 1);
      rt_.dev().copy(decided.get(), mine, sizeof mine, LOOM_COPY_HOST_TO_DEVICE);
      world_.all_reduce(rt_.dev().native_stream(), decided.get(), decided.get(), 2, LOOM_DTYPE_F32);
      float both[2] = {0, 0};
      rt_.dev().copy(both, decided.get(), sizeof both, LOOM_COPY_DEVICE_TO_HOST);
      rt_.dev().synchronize();
      const int32_t token = static_cast<int32_t>(both[0]) - 1;
      seq.push_back(token);
      (step == 0 ? out.prefill_ms : out.decode_ms) += ms_since(t0);
      out.tokens.push_back(token);
      if (reports_) {
        if (req.keep_logits) out.logits.push_back(logits);
        if (req.on_token) req.on_token(token);
      }
      if (std::find(req.stop_tokens.begin(), req.stop_tokens.end(), token) != req.stop_tokens.end()) break;
      if (both[1] > 0.0f) {
        out.interrupted = true;
        break;
      }
    }
    return out;
  }

 private:
  void forward_all_chunks(int64_t rows, int64_t offset, const int32_t* tokens, float* logits,
                          const int32_t* document_start, const int32_t* position_ids) {
    const int pp = pp_.size(), chunks = pp * static_cast<int>(model_.chunk_count());
    const size_t bytes = model_.hidden_bytes(rows, 1), numel = bytes / dtype_size(model_.act_dtype());
    const void* held = nullptr;
    for (int k = 0; k < chunks; ++k) {
      if (k % pp != pp_.rank()) continue;
      const void* input = held;
      if (k > 0 && pp > 1) {
        if (received_.bytes() < bytes) received_ = loom::Buffer(&rt_, bytes);
        pp_.recv(rt_.dev().native_stream(), received_.get(), numel, model_.act_dtype(), (k - 1) % pp, k);
        input = received_.get();
      }
      held = model_.forward_cached(k / pp, rows, 1, offset, tokens, input, logits, document_start, position_ids);
      if (k + 1 < chunks && pp > 1)
        pp_.send(rt_.dev().native_stream(), held, numel, model_.act_dtype(), (k + 1) % pp, k + 1);
    }
  }

  model::Model& model_;
  runtime::RankRuntime& rt_;
  const loom::Group world_, pp_;
  const int64_t vocab_;
  const bool reports_;
  const DocumentInputs docs_;
  const int64_t cached_;
  loom::Buffer received_;
};

}  // namespace

int32_t sample_token(std::span<const float> logits, const Sampling& s, std::mt19937_64& rng) {
  LOOM_REQUIRE(!logits.empty(), "sampling from an empty vocabulary");
  for (size_t i = 0; i < logits.size(); ++i)
    LOOM_REQUIRE(std::isfinite(logits[i]), "the model's logit of token " << i << " is " << logits[i]
                                                                        << ": its weights hold a NaN or an infinity, or "
                                                                           "overflow in this dtype");
  const auto best = std::max_element(logits.begin(), logits.end());  // the first of equal maxima
  if (s.temperature <= 0.0 || s.top_k == 1) return static_cast<int32_t>(best - logits.begin());
  // Candidates by decreasing logit (ties: lower id first), cut to top_k.
  std::vector<int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  const size_t k = s.top_k > 0 ? std::min(ids.size(), static_cast<size_t>(s.top_k)) : ids.size();
  const auto before = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k), ids.end(), before);
  ids.resize(k);
  // softmax(logits / T) over them, in double.
  std::vector<double> p(k);
  double sum = 0;
  for (size_t i = 0; i < k; ++i) sum += p[i] = std::exp((logits[ids[i]] - *best) / s.temperature);
  for (double& x : p) x /= sum;
  // Nucleus: the fewest most likely tokens whose probabilities reach top_p.
  size_t keep = k;
  if (s.top_p < 1.0) {
    double mass = 0;
    for (keep = 0; keep < k;) {
      mass += p[keep++];
      if (mass >= s.top_p) break;
    }
  }
  const double total = std::accumulate(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(keep), 0.0);
  double u = uniform(rng) * total;
  for (size_t i = 0; i < keep; ++i) {
    u -= p[i];
    if (u < 0) return ids[i];
  }
  return ids[keep - 1];  // rounding left u at the end
}

RunPlan generation_plan(const std::string& manifest_toml, const std::string& name, std::vector<std::string> overrides,
                        plugins::Registry& registry) {
  // One sequence: no data or context parallelism, no sequence sharding; eager layers
  // with nothing recomputed; a checkpoint's own paths are not this run's. A training
  // schedule is never run, but the plan checks one: GPipe takes any vpp (a saved
  // manifest names 1F1B, which does not) with as many microbatches as stages.
  const int64_t pp = manifest::int_as_overridden(manifest_toml, name, overrides, "parallel.pp");
  for (const std::string& o :
       {std::string("parallel.dp=1"), std::string("parallel.cp=1"), std::string("parallel.ep=1"),
        std::string("parallel.sequence_parallel=false"), std::string("batch.micro_batch_size=1"),
        "batch.global_batch_size=" + std::to_string(pp), std::string("pipeline.schedule=\"gpipe\""),
        std::string("exec.mode=\"eager\""),
        std::string("model.recompute_granularity=\"none\""), std::string("checkpoint.dir=\"\""),
        std::string("checkpoint.init_weights=\"\""), std::string("run.eval_every=0")})
    overrides.push_back(o);
  for (const std::string& o : manifest::untrained_schedule_overrides()) overrides.push_back(o);
  RunPlan plan = make_plan(manifest::Manifest::parse(manifest_toml, name, overrides), registry);
  require_kv_cache_layers(plan);
  return plan;
}

void check_generation_request(const RunPlan& plan, int64_t vocab, const GenerationRequest& request) {
  const int64_t seq_len = plan.config.model.seq_length;
  LOOM_REQUIRE(!request.prompt.empty(), "the prompt is empty (it needs at least one token)");
  LOOM_REQUIRE(static_cast<int64_t>(request.prompt.size()) < seq_len,
               "the prompt has " << request.prompt.size() << " tokens; the model's seq_length is "
                                           << seq_len << ", so nothing can follow it");
  for (int32_t t : request.prompt)
    LOOM_REQUIRE(t >= 0 && t < vocab, "prompt token " << t << " is outside the vocabulary [0, " << vocab << ")");
  LOOM_REQUIRE(request.sampling.top_p > 0.0 && request.sampling.top_p <= 1.0,
               "top_p " << request.sampling.top_p << " is outside (0, 1]");
  LOOM_REQUIRE(request.sampling.temperature >= 0.0 && std::isfinite(request.sampling.temperature),
               "temperature " << request.sampling.temperature << " must be finite and >= 0");
  LOOM_REQUIRE(request.sampling.top_k >= 0, "top_k " << request.sampling.top_k << " must be >= 0");
  LOOM_REQUIRE(request.token_limit >= 0 && request.token_limit <= vocab,
               "the tokenizer's " << request.token_limit << " tokens are more than the model's vocabulary of " << vocab);
}

// The ranks of a Generator: runtime::launch on a thread of its own; each rank builds
// its model, then waits for requests (a job number that moves on) until told to stop.
struct Generator::Ranks {
  std::mutex mu;
  std::condition_variable changed;
  int local_ranks = 0;
  int built = 0;
  bool stopping = false;
  bool failed = false;        // a rank threw: the others leave their wait, launch returns
  std::exception_ptr error;   // launch's (the root cause), once it has returned
  uint64_t job = 0;           // the request number; each rank runs each once
  const GenerationRequest* request = nullptr;
  int64_t cached = 0;         // the request's prompt positions the caches hold
  int finished = 0;           // ranks done with the current job
  bool have_result = false;
  GenerationResult result;
  std::mutex turn;            // one request at a time
  std::thread thread;

  // Waits (holding `lock`) until `done` or a failure; after a failure the launch
  // thread is joined and its error thrown.
  template <class Done>
  void wait_or_throw(std::unique_lock<std::mutex>& lock, Done done) {
    changed.wait(lock, [&] { return done() || error != nullptr; });
    if (error == nullptr) return;
    lock.unlock();
    if (thread.joinable()) thread.join();
    std::rethrow_exception(error);
  }
};

Generator::Generator(const RunPlan& plan, const InitialWeights& weights, int64_t vocab)
    : plan_(plan), vocab_(vocab), ranks_(std::make_unique<Ranks>()) {
  require_kv_cache_layers(plan);
  check_initial_weights(weights, plan_memory(plan, vocab), vocab,
                        model::model_dims(plan.config, vocab, plan.sizes.tp).padded_vocab);
  Ranks& r = *ranks_;
  r.local_ranks = static_cast<int>(runtime::process_ranks(plan.sizes.world).size());
  const DocumentInputs documents = document_inputs(plan.config, vocab);  // once, not per rank
  const runtime::LaunchConfig lc = launch_config(plan);
  auto rank_main = [this, &weights, documents](runtime::RankRuntime& rt) {
    Ranks& r = *ranks_;
    try {
      std::unique_ptr<model::Model> model = create_rank_model(plan_, rt, vocab_, &weights);
      const bool reports =
          rt.group_or_self("pp").rank() == plan_.sizes.pp - 1 && rt.group_or_self("tp").rank() == 0;
      uint64_t seen = 0;
      std::unique_lock<std::mutex> lock(r.mu);
      ++r.built;
      r.changed.notify_all();
      for (;;) {
        r.changed.wait(lock, [&] { return r.job != seen || r.stopping || r.failed; });
        if (r.stopping || r.failed) return;
        seen = r.job;
        const GenerationRequest& request = *r.request;
        const int64_t cached = r.cached;
        lock.unlock();
        GenerationResult mine = generate_on_rank(*model, rt, vocab_, request, reports, documents, cached);
        lock.lock();
        // Every rank knows the tokens and timings; the reporting one also the logits.
        if (reports || !r.have_result) r.result = std::move(mine);
        r.have_result = r.have_result || reports;
        ++r.finished;
        r.changed.notify_all();
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(r.mu);
      r.failed = true;
      r.changed.notify_all();
      throw;
    }
  };
  r.thread = std::thread([this, lc, rank_main] {
    std::exception_ptr error;
    try {
      runtime::launch(lc, rank_main);
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(ranks_->mu);
    if (!error && !ranks_->stopping)  // every rank returned without being told to
      error = std::make_exception_ptr(loom::Error("the model's ranks stopped"));
    ranks_->error = error;
    ranks_->changed.notify_all();
  });
  std::unique_lock<std::mutex> lock(r.mu);
  r.wait_or_throw(lock, [&] { return r.built == r.local_ranks; });
}

Generator::~Generator() {
  {
    std::lock_guard<std::mutex> lock(ranks_->mu);
    ranks_->stopping = true;
    ranks_->changed.notify_all();
  }
  if (ranks_->thread.joinable()) ranks_->thread.join();
}

GenerationResult Generator::generate(const GenerationRequest& request) {
  check_generation_request(plan_, vocab_, request);
  Ranks& r = *ranks_;
  std::lock_guard<std::mutex> turn(r.turn);
  std::unique_lock<std::mutex> lock(r.mu);
  if (r.error) {
    lock.unlock();
    if (r.thread.joinable()) r.thread.join();
    std::rethrow_exception(r.error);
  }
  // The common start of the prompt and the cached sequence, leaving at least the
  // prompt's last position to forward (its logits pick the first token).
  int64_t common = 0;
  if (request.use_cache) {
    const size_t most = std::min(in_cache_.size(), request.prompt.size() - 1);
    while (static_cast<size_t>(common) < most && in_cache_[common] == request.prompt[common]) ++common;
  }
  in_cache_.clear();  // until this request is done, the caches hold no sequence for sure
  r.request = &request;
  r.cached = common;
  r.finished = 0;
  r.have_result = false;
  ++r.job;
  r.changed.notify_all();
  r.wait_or_throw(lock, [&] { return r.finished == r.local_ranks; });
  r.request = nullptr;
  in_cache_ = request.prompt;
  in_cache_.insert(in_cache_.end(), r.result.tokens.begin(), r.result.tokens.end());
  in_cache_.resize(static_cast<size_t>(std::min<int64_t>(r.result.forwarded, static_cast<int64_t>(in_cache_.size()))));
  return std::move(r.result);
}

GenerationResult generate(const RunPlan& plan, const InitialWeights& weights, int64_t vocab,
                          const GenerationRequest& request) {
  check_generation_request(plan, vocab, request);
  return Generator(plan, weights, vocab).generate(request);
}

GenerationResult generate_on_rank(model::Model& model, runtime::RankRuntime& rt, int64_t vocab,
                                  const GenerationRequest& request, bool reports, DocumentInputs docs, int64_t cached) {
  return RankGeneration(model, rt, vocab, reports, docs, cached).run(request);
}

}  // namespace loom::train
