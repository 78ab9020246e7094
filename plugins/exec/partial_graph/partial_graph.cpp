// exec/partial_graph: Megatron-LM's partial CUDA graphs. A capturable layer step
// (a layer's training forward or backward of one microbatch, see
// loom_layer_api.capturable) in one of the configured scopes runs directly for
// `warmup_steps` runs of its key, is then captured into a device graph once
// (capture records, it does not run, so the graph is replayed right away), and
// from then on replayed: one launch of recorded work instead of the layer's host
// code and its many kernel launches. Everything else (embedding, logits and loss,
// communication, optimizer) stays eager.
//
// Sub-steps (ABI 1.7, LOOM_EXEC_SUBSTEPS): a layer whose step as a whole is not
// capturable (MoE: routing is decided on the host) runs its graph-safe parts
// (the "moe_router" scope: LayerNorm and router GEMM, the router's backward)
// through this plugin from inside its directly run step. They are keyed by
// (key, substep) and captured and replayed like whole steps, so Megatron-LM's
// partial graphs for MoE: the graphs cover the static parts, the rest runs
// eagerly between their replays.
//
// The graph rules this relies on: the engine keeps the buffers it passes to a
// step at the same address for the same key (LOOM_EXEC_REPLAYS), the layer does
// no host synchronisation and passes nothing step-dependent by value, and the
// steps replay in the order they were captured (the schedule is fixed), which
// lets all graphs share the device's graph pool: memory a captured step frees is
// reused only by steps captured after it.
#include <loom/cpp/plugin.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <sstream>
#include <string>

namespace {

struct Exec {
  loom::Device dev;
  int global_rank = 0;
  std::set<std::string> scopes;  // empty: every capturable step
  int64_t warmup = 1;
  struct Key {
    int64_t runs = 0;  // direct runs so far (warm-up)
    loom_graph* graph = nullptr;
  };
  using StepId = std::pair<int64_t, int32_t>;  // (key, substep)
  std::map<StepId, Key> keys;
  std::set<std::string> seen_scopes;  // every layer step's scope, capturable or not
  std::set<std::string> capturable_scopes;  // those of steps that could be captured
  StepId first_step{-1, 0};           // seen again: a whole step has been seen
  bool scopes_checked = false;
  bool capturing = false;             // a capture is open: a nested step is recorded into it
  loom_exec_stats stats = loom::make<loom_exec_stats>();
};

std::set<std::string> parse_scopes(const std::string& list) {
  std::set<std::string> out;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const size_t b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    if (b != std::string::npos) out.insert(item.substr(b, e - b + 1));
  }
  return out;
}

loom_status create(const loom_options* options, loom_rank* rank, loom_exec** out) {
  return loom::guard([&] {
    LOOM_REQUIRE(out != nullptr, "exec/partial_graph: out is NULL");
    *out = nullptr;
    LOOM_REQUIRE(rank != nullptr, "exec/partial_graph: needs the rank (its device captures the graphs)");
    loom::Options opts(options);
    auto e = std::make_unique<Exec>();
    loom::Rank r(rank);
    e->dev = r.device();
    e->global_rank = r.global_rank();
    e->scopes = parse_scopes(opts.get_string("scopes", ""));
    e->warmup = opts.get_int("warmup_steps", 1);
    // A direct run first: libraries initialise on first use (cuBLAS handles and
    // workspaces, lazily loaded kernels), which must not happen inside a capture.
    const loom_device_api* api = e->dev.api();
    LOOM_REQUIRE(api->capture_begin && api->capture_end && api->graph_replay && api->graph_destroy,
                 "exec/partial_graph: the rank's device plugin does not implement graph capture "
                 "(capture_begin/capture_end/graph_replay); use exec.mode = \"eager\"");
    // Without a graph pool, memory a captured step frees goes back to eager use
    // while later replays still write it.
    LOOM_REQUIRE((e->dev.features() & LOOM_DEVICE_GRAPH_POOL) != 0,
                 "exec/partial_graph: the rank's device plugin has no graph pool (LOOM_DEVICE_GRAPH_POOL, ABI 1.3), "
                 "so replayed steps could write memory it has handed out again; use exec.mode = \"eager\" or a "
                 "device plugin built for ABI 1.3");
    *out = reinterpret_cast<loom_exec*>(e.release());
  });
}

// After one whole step: a configured scope that matched none of this rank's layer
// steps is most likely a typo; say which names exist. One whose steps are never
// capturable (a MoE layer's, whose parts have their own scope) captures nothing:
// say which scopes can be. (Warnings, not errors: with pipeline parallelism another
// stage may hold that layer.)
void check_scopes(Exec& e) {
  e.scopes_checked = true;
  auto list = [](const std::set<std::string>& names) {
    std::string out;
    for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
    return out.empty() ? std::string("none") : out;
  };
  for (const std::string& s : e.scopes)
    if (e.seen_scopes.count(s) == 0)
      LOOM_LOG(WARNING) << "exec/partial_graph rank " << e.global_rank << ": option scopes names \"" << s
                        << "\", which none of this rank's layer steps has (scopes: " << list(e.seen_scopes) << ")";
    else if (e.capturable_scopes.count(s) == 0)
      LOOM_LOG(WARNING) << "exec/partial_graph rank " << e.global_rank << ": option scopes names \"" << s
                        << "\", whose steps are not capturable here and run directly (capturable scopes: "
                        << list(e.capturable_scopes) << ")";
}

void destroy(loom_exec* x) {
  if (x == nullptr) return;
  auto* e = reinterpret_cast<Exec*>(x);
  for (auto& [key, k] : e->keys)
    if (k.graph) e->dev.api()->graph_destroy(e->dev.raw(), k.graph);
  delete e;
}

loom_status run_direct(Exec& e, const loom_exec_step& step) {
  e.stats.direct += 1;
  return step.fn(step.ctx);
}

loom_status run(loom_exec* x, loom_rank*, const loom_exec_step* step) {
  if (x == nullptr || step == nullptr || step->fn == nullptr)
    return loom::make_status(LOOM_CODE_INVALID_ARGUMENT, "exec/partial_graph: step without a function");
  Exec& e = *reinterpret_cast<Exec*>(x);
  const std::string scope = step->scope ? step->scope : "";
  const int32_t substep = LOOM_HAS_SLOT(step, loom_exec_step, substep) ? step->substep : 0;
  const Exec::StepId id{step->key, substep};
  // A step run from inside one being captured (a sub-step of a layer that called
  // itself capturable) is part of that graph.
  if (e.capturing) return step->fn(step->ctx);
  if (!e.scopes_checked) {
    if (e.first_step.first < 0) e.first_step = id;
    else if (id == e.first_step) check_scopes(e);
    e.seen_scopes.insert(scope);
    if (step->capturable) e.capturable_scopes.insert(scope);
  }
  if (!step->capturable) return run_direct(e, *step);
  if (!e.scopes.empty() && e.scopes.count(scope) == 0) return run_direct(e, *step);

  Exec::Key& k = e.keys[id];
  if (k.graph == nullptr && k.runs < e.warmup) {
    k.runs += 1;
    return run_direct(e, *step);
  }
  const loom_device_api* api = e.dev.api();
  if (k.graph == nullptr) {
    // Capture: the device records the step's launches (and allocations come from
    // its graph pool); nothing runs until the replay below.
    if (loom_status s = api->capture_begin(e.dev.raw(), e.dev.stream())) return s;
    e.capturing = true;
    loom_status failed = step->fn(step->ctx);
    e.capturing = false;
    loom_graph* g = nullptr;
    loom_status ended = api->capture_end(e.dev.raw(), e.dev.stream(), &g);
    if (failed != nullptr || ended != nullptr) {
      if (g) api->graph_destroy(e.dev.raw(), g);
      if (failed != nullptr && ended != nullptr) loom::host().status_destroy(ended);
      return failed != nullptr ? failed : ended;
    }
    k.graph = g;
    e.stats.graphs += 1;
  }
  e.stats.replays += 1;
  return api->graph_replay(e.dev.raw(), k.graph, e.dev.stream());
}

loom_status stats(loom_exec* x, loom_exec_stats* out) {
  if (x == nullptr || out == nullptr)
    return loom::make_status(LOOM_CODE_INVALID_ARGUMENT, "exec/partial_graph stats: NULL argument");
  const loom_exec_stats& s = reinterpret_cast<Exec*>(x)->stats;
  const uint32_t size = out->struct_size;
  std::memcpy(out, &s, std::min<size_t>(size, sizeof(s)));
  out->struct_size = size;
  return nullptr;
}

const loom_exec_api* table() {
  static const loom_exec_api api = [] {
    loom_exec_api a = loom::make<loom_exec_api>();
    a.create = create;
    a.destroy = destroy;
    a.run = run;
    a.features = LOOM_EXEC_REPLAYS | LOOM_EXEC_SUBSTEPS;
    a.stats = stats;
    return a;
  }();
  return &api;
}

}  // namespace

LOOM_PLUGIN_LIBRARY(loom::raw_plugin(
    "exec", "partial_graph", "1.1.0",
    "captures capturable layer steps (attention, MLP) and sub-steps (the MoE router) into device graphs once and "
    "replays them",
    LOOM_API_EXEC, table(),
    {loom::opt_string("scopes", "",
                      "comma-separated scopes whose steps are captured: layer plugin names (\"attention,mlp\") "
                      "and sub-step scopes (\"moe_router\"); empty: every capturable step"),
     loom::opt_int("warmup_steps", 1, "runs of each step made directly before it is captured").in("[1, 1000]")}))
