// Everything decided before a run starts: the validated manifest, the plugins it
// names (each option section checked against that plugin's schema), the layer
// list and the parallel layout. `loom validate` prints it; `loom run` executes it.
#pragma once

#include "engine/manifest/manifest.hpp"
#include "engine/manifest/run_config.hpp"
#include "engine/model/model.hpp"
#include "engine/pipeline/schedule.hpp"
#include "engine/plugins/registry.hpp"
#include "engine/runtime/launcher.hpp"
#include "engine/topology/rank_groups.hpp"

#include <map>
#include <string>
#include <vector>

namespace loom::train {

// The most batch sizes a batch.rampup_batch_size may pass through: each one's pipeline
// orders are made and checked before launch.
constexpr size_t kMaxRampBatches = 4096;

struct RunPlan {
  manifest::Manifest manifest;  // provenance of every value, plugin option sections, the TOML text
  manifest::RunConfig config;   // the manifest's values, typed, with the plugins' option defaults filled in
  const plugins::Registry* registry = nullptr;
  const plugins::LoadedPlugin* device = nullptr;
  const plugins::LoadedPlugin* comm = nullptr;
  const plugins::LoadedPlugin* exec = nullptr;
  const plugins::LoadedPlugin* optimizer = nullptr;
  const plugins::LoadedPlugin* tensor = nullptr;  // parallel.tensor: the service the layers call
  const plugins::LoadedPlugin* expert = nullptr;  // parallel.expert: the MoE layers' dispatcher (ABI 1.4)
  const plugins::LoadedPlugin* schedule = nullptr;  // parallel/pipeline.NAME
  std::vector<model::LayerSpec> layers;
  topology::ParallelSizes sizes;
  int dp = 1;
  int64_t microbatches = 1;  // per dp rank per step (of the whole global batch)
  pipeline::PipelineOrders orders;  // every rank's schedule order, checked free of deadlock
  // The schedule's orders of a step of `microbatches` per rank (`orders`, or those of a
  // batch ramp's smaller step, made again; make_plan has checked each count's).
  pipeline::PipelineOrders orders_for(int64_t microbatches) const;
  std::vector<int> blocks_per_chunk;  // transformer blocks of each global pipeline chunk
  std::vector<std::vector<model::LayerSpec>> chunks;  // the layers of each global pipeline chunk
  std::vector<std::string> plugin_load_errors;  // libraries on the path that failed to load
  // api_type -> table: the services a rank's layers get from host->service(rank, api_type,
  // NULL), as the manifest names them (parallel.tensor, parallel.expert).
  std::map<int32_t, const void*> services() const;
  // What is legal but most likely a mistake (a [model.layer.X] table no layer uses);
  // validate, plan and run print them.
  std::vector<std::string> warnings;
};

// How to start the plan's ranks: its device and comm plugins with their options, the
// layout, the comm timeout, threads per rank and the services the layers call.
runtime::LaunchConfig launch_config(const RunPlan& plan);

// What a plan is for: a run this process launches, or the layout of a checkpoint
// another launch wrote (gathering or exporting it), which must not be checked against
// how this process was started (threads vs mpirun, its comm backend).
enum class PlanUse { Launch, CheckpointLayout };

// Loads plugins (plugins.search_paths, LOOM_PLUGIN_PATH, the install dir) into
// `registry`, resolves every plugin the manifest names and validates their option
// sections. Throws manifest::ManifestError with every problem found.
RunPlan make_plan(manifest::Manifest m, plugins::Registry& registry, PlanUse use = PlanUse::Launch);

// `plan`'s resolved manifest with `overrides` ("key.path=value") applied, planned again
// with the same registry (another layout or batch of the same run). Throws as make_plan.
RunPlan replan(const RunPlan& plan, const std::vector<std::string>& overrides);

// The manifest a checkpoint keeps: `plan`'s, its paths as resolved and made absolute
// (data files and the tokenizer found again by generate, eval and export from anywhere).
std::string saved_manifest(const RunPlan& plan);

}  // namespace loom::train
