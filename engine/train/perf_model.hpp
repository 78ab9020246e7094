// A step-time estimate for a manifest before it runs (`loom plan --perf`).
//
// Compute is measured, communication is modelled. `measure_compute` runs the
// manifest's model for a few steps on this machine's device at the layout's tensor
// and context parallelism, without pipeline stages (what a rank computes per
// microbatch; on a CPU with as many ranks sharing the cores as the layout has) and keeps how long forwards, backwards and the optimizer step took,
// split into a part fixed per layer and a part in proportion to each layer's FLOPs
// (two microbatch sizes), and the layers' own collectives (tp, cp, ep) per microbatch
// as the engine's counters saw them. `estimate_step` then composes a step of the full
// layout: each pipeline stage's chunks from its layers' FLOPs, the schedule's order
// played out with p2p transfers on the pp link (pipeline::simulate), the tied-embedding
// sum, the data-parallel gradient reduction per bucket (hidden behind the backward with
// optimizer.overlap_grad_reduce), the optimizer step on the rank's share, the
// distributed optimizer's parameter all-gather (hidden behind the next forward with
// optimizer.overlap_param_gather), each collective costed by the alpha-beta link model
// (loom/cpp/link_model.hpp: the links comm/local's `links` option gives), and ranks
// sharing this machine's cores.
#pragma once

#include "engine/runtime/comm_stats.hpp"
#include "engine/train/memory_plan.hpp"
#include "engine/train/run_plan.hpp"

#include <loom/cpp/link_model.hpp>

#include <nlohmann/json.hpp>

#include <map>
#include <string>
#include <vector>

namespace loom::train {

// Seconds per group kind, per op ("tp" -> "all_reduce" -> 0.004).
using CommSeconds = std::map<std::string, std::map<std::string, double>>;

struct ComputeProfile {
  std::string device;          // device.kind it was measured on
  int tp = 1, cp = 1, dp = 1;  // the layout it ran at (pp 1)
  int threads = 1;             // device threads per rank
  int64_t micro_batch = 1;
  int64_t microbatches = 1;    // per step
  // One microbatch through every layer of one rank (all pipeline stages' layers):
  // seconds fixed per layer (summed over layers) and in proportion to FLOPs.
  double forward_fixed_s = 0, forward_flops_s = 0;
  double backward_fixed_s = 0, backward_flops_s = 0;
  double layer_flops = 0;  // forward FLOPs of one microbatch over those layers
  int layers = 0;
  // The transformer blocks of the measured model, and of the manifest's: fewer when
  // every layer on one rank would not fit the device (or as asked); each layer's time
  // is then that of its FLOPs. The distinct forward FLOPs of its layers (one per kind
  // of layer) tell the estimate that a plan's layers are the ones measured; empty in a
  // profile written before they were kept.
  int64_t blocks = 0, model_blocks = 0;
  std::vector<double> distinct_layer_flops;
  // What else decides a layer's time, as the measured manifest set it: the shapes,
  // dtypes, recomputation (by method "block": the blocks recomputed over all pipeline
  // chunks, not the count per chunk), execution mode, micro-batch and every layer option
  // (as set, else its default), by key. An estimate refuses a run that differs in any;
  // empty in a profile written before it was kept.
  std::map<std::string, std::string> model;
  double optimizer_s = 0;       // one optimizer step of a rank that steps `buffer_elements`
  size_t buffer_elements = 0;
  double other_s = 0;           // per step, outside forwards, backwards and the optimizer
  // The layers' own collectives over one step of `microbatches` (every kind but the
  // engine's and the optimizer's: dp, dp-cp, edp, pp, embedding, world).
  runtime::CommStats layer_comm;
  CommSeconds layer_comm_s;  // how long those took (no links), per step
  int runs = 0;            // training runs measured (2 when the microbatch could be halved)
  double wall_s = 0;       // what measuring took
};

// Measures `plan`'s model on its device at its tp and cp without pipeline stages and
// links, `threads` device threads per rank. On a host-memory device (the ranks share
// this machine) with as many ranks as `plan` (dp = dp x pp), else with dp = 1 (ep when
// experts are split). Every rank holds every layer, so a model that fits only split
// into stages is measured with the most of its transformer blocks that fit; `blocks`
// > 0 asks for that many (a deep model measured sooner). Throws loom::Error when not
// even one block fits.
ComputeProfile measure_compute(const RunPlan& plan, int threads, int64_t blocks = 0);

// Recomputation by method "block" (recompute_num_layers blocks of each pipeline chunk):
// the blocks the run recomputes over all its chunks, what the measuring run, one chunk,
// recomputes in their place (a profile holds that count). -1 when blocks are not
// recomputed that way.
int64_t recomputed_blocks(const RunPlan& plan);

// A profile as JSON (`loom plan --perf --save-profile`), and back: measured on one
// machine (a GPU node), it estimates other links, dp, pp and overlap settings of the
// same model, tp and cp anywhere (`--profile`). Reading throws loom::Error naming the
// missing or malformed field.
nlohmann::ordered_json profile_to_json(const ComputeProfile& p);
// The settings ComputeProfile::model keeps, of `plan`.
std::map<std::string, std::string> compute_settings(const RunPlan& plan);
ComputeProfile profile_from_json(const nlohmann::ordered_json& j);

// One pipeline stage (its tp, cp and dp ranks are alike) over one step.
struct StageEstimate {
  int stage = 0;
  double forward_s = 0, backward_s = 0;  // compute of all its microbatches
  double layer_comm_s = 0;               // what the links add to the layers' collectives (within the above)
  double pipeline_wait_s = 0;            // idle in the schedule: the bubble and p2p transfers
  double embedding_s = 0;                // tied copies summed over the embedding group
  double grad_reduce_s = 0, grad_reduce_exposed_s = 0;   // dp gradient reduction, and what the step waits for
  double optimizer_s = 0;
  double param_gather_s = 0, param_gather_exposed_s = 0;
  double bookkeeping_s = 0;  // loss, gradient norm and stop-flag reductions, other per-step work
  double step_s = 0;
};

struct PerfEstimate {
  std::vector<StageEstimate> stages;
  double step_s = 0;
  double tokens_per_s = 0;
  double flops_per_step = 0;  // forward and backward over the world (3 x forward)
  double mfu = 0;             // 0 when device.peak_tflops is unknown
  int threads = 1, cores = 1;
  double contention = 1;      // slowdown of the FLOP-proportional compute from more busy threads than cores
  double thread_scale = 1;    // the profile's threads per rank over this layout's (host-memory devices)
  std::vector<std::string> notes;
};

// The links of `plan`: comm.options.links (comm/local's); loom::Error naming the key
// when it does not parse.
LinkModel plan_links(const RunPlan& plan);

// Group kinds whose collectives the estimate of `plan` costs (the layers' own as
// `profile` counted them, the engine's and the optimizer's) that have no link of
// their own in `links` and no "*" link: they cost nothing. Empty when every link is
// ideal (nothing modelled at all).
std::vector<std::string> unmodelled_kinds(const RunPlan& plan, const ComputeProfile& profile, const LinkModel& links);

// Device threads a rank of `plan` gets on `cores` cores (as the launcher gives them).
int threads_per_rank(const RunPlan& plan, int cores);

PerfEstimate estimate_step(const RunPlan& plan, const MemoryPlan& mp, const ComputeProfile& profile,
                           const LinkModel& links, int cores);

// The mean step time of `plan` as it is (its links, threads and layout) over `steps`
// steps after the first `warmup`, writing nothing (no checkpoints, metrics, evaluation).
// `links` (a spec, "" = as the manifest says) replaces comm.options.links when the
// comm plugin has that option.
double measure_step_s(const RunPlan& plan, int64_t steps, int64_t warmup = 2, const std::string& links = "");

// Seconds of every collective counted in `stats` (calls and bytes per op) on the link
// of its kind among that kind's group in `groups` (none: no time), less what `measured`
// says those calls already took (per kind and op, never below 0).
double modelled_comm_seconds(const runtime::CommStats& stats, const LinkModel& links,
                             const topology::RankGroups& groups, const CommSeconds& measured = {});

}  // namespace loom::train
