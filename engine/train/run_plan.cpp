#include "engine/train/run_plan.hpp"

#include "engine/train/batch_ramp.hpp"

#include "engine/manifest/batches.hpp"
#include "engine/manifest/schema.hpp"
#include "engine/pipeline/partition.hpp"
#include "engine/pipeline/schedule.hpp"
#include "engine/runtime/launcher.hpp"
#include "engine/topology/rank_groups.hpp"

#include <loom/cpp/link_model.hpp>

#include <boost/filesystem.hpp>

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>
#include <stdexcept>

namespace loom::train {

namespace {
// The ranks of one expert group with its edp replicas: the union of the edp groups
// of the members of group `kind` ("ep", or "etp-ep" folded) of rank r, sorted.
std::vector<int> with_edp_replicas(const topology::RankGroups& groups, const std::string& kind, int r) {
  std::vector<int> out;
  for (int peer : groups.group_of(kind, r))
    for (int q : groups.group_of("edp", peer)) out.push_back(q);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::vector<int> sorted(std::vector<int> v) {
  std::sort(v.begin(), v.end());
  return v;
}

// Expert parallelism splits a stage's tokens over its experts. Either the experts
// keep the dense tp split (etp = tp) and the ranks an expert's gradient is summed
// over (ep x edp) are one dp group; or the run folds MoE parallelism (etp != tp,
// Megatron-Core's "MoE Parallel Folding"): then the expert groups (etp x ep x edp) cover exactly a stage's tp x
// dp ranks. Under context parallelism the cp ranks count as dp ranks (their
// tokens meet the same experts): dp-cp and tp-dp-cp. Orders that put ep elsewhere
// would mix tp slices or replicas silently.
void require_experts_fold_into_dp(const manifest::Manifest& man, const topology::ParallelSizes& sizes) {
  const topology::RankGroups groups = topology::RankGroups::build(sizes);
  // The ranks that hold replicas of a stage's dense parameters (with and without its tp peers).
  const char* replicas = topology::gradient_group_kind(sizes.cp);
  const char* tp_replicas = sizes.cp > 1 ? "tp-dp-cp" : "tp-dp";
  for (int r = 0; r < groups.world(); ++r) {
    const bool folded = groups.group_of("etp", r).size() != groups.group_of("tp", r).size();
    const bool fits = folded ? with_edp_replicas(groups, "etp-ep", r) == sorted(groups.group_of(tp_replicas, r))
                             : groups.group_of("etp", r) == groups.group_of("tp", r) &&
                                   with_edp_replicas(groups, "ep", r) == sorted(groups.group_of(replicas, r));
    if (fits) continue;
    throw manifest::ManifestError(
        {{"parallel.order", man.origin("parallel.order"),
          "parallel.order = \"" + sizes.order + "\" puts rank " + std::to_string(r) +
              (folded ? "'s expert groups (etp x ep x edp) across other ranks than its tp x dp (x cp) ranks"
                      : "'s expert groups (ep x edp) across other ranks than its dp (x cp) group") +
              "; expert parallelism needs ep between tp and pp with dp (e.g. the default \"tp-cp-ep-dp-pp\")"}});
  }
}
// The comm plugin's declared reach (ABI 1.9 LOOM_COMM_*): a plugin whose ranks are
// threads of one process cannot serve one process per rank (mpirun, srun), nor the
// reverse. A device's memory to a plugin of host buffers only is staged by the engine
// (runtime::DeviceStaging): said, not refused.
void check_comm_fits(const manifest::Manifest& man, RunPlan& plan, std::vector<manifest::Diagnostic>& diags) {
  if (plan.comm == nullptr || plan.device == nullptr || plan.comm->abi_minor < 9) return;  // older: undeclared
  const loom_comm_api* comm = plan.comm->comm();
  const uint64_t features = comm != nullptr && LOOM_HAS_SLOT(comm, loom_comm_api, features) ? comm->features : 0;
  const int world = plan.sizes.world;
  if (world > 1 && runtime::needs_staging(plan.device, plan.comm))
    plan.warnings.push_back(plan.comm->key() + " exchanges host memory and " + plan.device->key() +
                            " keeps tensors in memory of its own: each collective copies its device buffers through "
                            "host memory (slow; comm.backend = \"nccl\" moves them between GPUs, one GPU per rank)");
  const runtime::ProcessLaunch launch = runtime::detect_process_launch();
  // A world of one rank in one process is both.
  const uint64_t needed = launch.multi_process ? LOOM_COMM_PROCESSES : world > 1 ? LOOM_COMM_THREADS : 0;
  if ((features & needed) != needed)
    diags.push_back({"comm.backend", man.origin("comm.backend"),
                     launch.multi_process
                         ? "this process was started by " + launch.launcher + " as one process per rank, but " +
                               plan.comm->key() + " runs every rank as a thread of one process; add --set "
                               "comm.backend=mpi (or run without mpirun/srun)"
                         : plan.comm->key() + " needs one process per rank; start the run with mpirun -np " +
                               std::to_string(world) + " (or srun), or use comm.backend = \"local\""});
}

// The list of model.pre, model.block (model.blocks.NAME) or model.post that layer i of
// the model came from.
std::string list_of(const manifest::RunConfig& config, const std::vector<model::LayerSpec>& layers, size_t i) {
  if (layers[i].block_index >= 0) return config.model.block_key(layers[i].block_index);
  return i < config.model.pre.size() ? "model.pre" : "model.post";
}

// Parameters, checkpoints and exports name a layer's tensors after its instance
// (blocks.3.mlp.fc1.weight): a name listed twice in one block, or in both model.pre
// and model.post, would give two layers the same names, and everything that finds a
// tensor by name (resuming at another layout, init_weights, export) would take the
// first's for both.
void check_unique_instances(const manifest::Manifest& man, const manifest::RunConfig& config,
                            const std::vector<model::LayerSpec>& layers, std::vector<manifest::Diagnostic>& diags) {
  std::set<std::string> seen;
  for (size_t i = 0; i < layers.size(); ++i) {
    if (seen.insert(layers[i].instance).second) continue;
    const std::string key = list_of(config, layers, i), name = layers[i].config;
    const auto& pre = config.model.pre;
    const bool in_pre_and_post = key == "model.post" && std::find(pre.begin(), pre.end(), name) != pre.end();
    diags.push_back({key, man.origin(key),
                     "layer '" + name + "' is listed twice" + (in_pre_and_post ? " in model.pre and model.post" : " in " + key) +
                         ", so both would have the parameters named " + layers[i].instance +
                         ".*; give the second its own name with the same plugin, e.g. [model.layer." + name +
                         "2] plugin = \"" + layers[i].plugin + "\""});
    return;  // one is enough
  }
}

// A comm plugin's `links` option is the SDK's network model (loom/cpp/link_model.hpp,
// which `loom plan --perf` reads too): checked here, so that loom validate reports a
// malformed spec with its origin instead of the run failing when its world is made.
void check_links(const manifest::Manifest& man, const plugins::LoadedPlugin* comm, const manifest::RunConfig& config,
                 std::vector<manifest::Diagnostic>& diags) {
  if (comm == nullptr) return;
  const bool declares = std::any_of(comm->options.begin(), comm->options.end(),
                                    [](const manifest::OptionDecl& d) { return d.name == "links"; });
  const toml::node* v = config.comm.options.get("links");
  if (!declares || v == nullptr || !v->is_string()) return;
  try {
    (void)LinkModel::parse(v->as_string()->get());
  } catch (const std::invalid_argument& e) {
    diags.push_back({"comm.options.links", man.origin("comm.options.links"), e.what()});
  }
}

// A layer that reads the tokens comes first and one that writes the loss comes last
// (ABI 1.9 LOOM_LAYER_READS_TOKENS / LOOM_LAYER_WRITES_LOSS): an embedding in a block
// or an output head in model.pre would train nonsense or fail inside the first step.
void check_layer_places(const manifest::Manifest& man, const manifest::RunConfig& config,
                        const plugins::Registry& registry,
                        const std::vector<model::LayerSpec>& layers, std::vector<manifest::Diagnostic>& diags) {
  for (size_t i = 0; i < layers.size(); ++i) {
    const plugins::LoadedPlugin* p = registry.find("layer", layers[i].plugin);
    if (p == nullptr || p->abi_minor < 9 || p->layer() == nullptr) continue;  // older layers declare no place
    const loom_layer_api* api = p->layer();
    const uint64_t features = LOOM_HAS_SLOT(api, loom_layer_api, features) ? api->features : 0;
    const bool reads = (features & LOOM_LAYER_READS_TOKENS) != 0, writes = (features & LOOM_LAYER_WRITES_LOSS) != 0;
    const bool first = i == 0, last = i + 1 == layers.size();
    std::string problem;
    if (reads && !first) problem = "reads the tokens (an embedding), so it can only be the model's first layer";
    else if (writes && !last) problem = "writes the loss (an output head), so it can only be the model's last layer";
    else if (first && !reads) problem = "is the model's first layer but does not read the tokens (it needs an input)";
    else if (last && !writes) problem = "is the model's last layer but does not write the loss";
    if (problem.empty()) continue;
    const std::string key = list_of(config, layers, i);
    diags.push_back({key, man.origin(key),
                     "layer " + layers[i].instance + " (" + p->key() + ") " + problem +
                         "; the model is model.pre, then num_layers blocks (model.block, or the kinds of "
                         "model.block_pattern), then model.post (e.g. "
                         "pre = [\"embedding\"], block = [\"attention\", \"mlp\"], post = [\"lm_head\"])"});
    return;  // one is enough: the others follow from the same list
  }
}

// Megatron-LM's --position-embedding-type is one per model: layers that declare the
// SDK's position_embedding option (loom/layers/positions.hpp) and set it apart leave
// the model with no position embedding, or two. A warning: "" when they agree.
std::string position_embedding_disagreement(const manifest::Manifest& man, const std::vector<model::LayerSpec>& layers) {
  std::map<std::string, std::string> value_of;  // layer table -> its value
  for (const model::LayerSpec& l : layers) {
    const std::string key = std::string(manifest::schema::kLayerTable) + "." + l.config + ".position_embedding";
    if (man.contains(key)) value_of[l.config] = man.get_string(key);
  }
  std::set<std::string> values;
  std::string listed;
  for (const auto& [table, value] : value_of) {
    values.insert(value);
    listed += (listed.empty() ? "" : ", ") + table + " = " + value;
  }
  if (values.size() < 2) return "";
  return "the layers set position_embedding apart (" + listed +
         "): the model gets no position embedding, or two; set the same on every layer that declares it";
}

// [model.layer.X] tables with a value written in the manifest or by --set that no
// layer of model.pre, model.block or model.post uses: their options are not even
// checked (e.g. MoE options on a dense model).
std::vector<std::string> unused_layer_tables(const manifest::Manifest& man, const std::set<std::string>& used) {
  std::vector<std::string> out;
  const toml::table* layers = man.get_table(std::string(manifest::schema::kLayerTable));
  if (layers == nullptr) return out;
  for (auto&& [k, v] : *layers) {
    const std::string name(k.str()), section = std::string(manifest::schema::kLayerTable) + "." + name;
    if (used.count(name) || !v.is_table()) continue;
    for (auto&& [key, value] : *v.as_table()) {
      const manifest::Origin o = man.origin(section + "." + std::string(key.str()));
      if (o.kind == manifest::Origin::Kind::Default) continue;
      out.push_back(o.str() + ": " + section + " is set but no layer of the model (model.pre, the blocks "
                    "model.block or model.block_pattern places, model.post) is '" + name +
                    "', so it has no effect and its options are not checked");
      break;
    }
  }
  return out;
}

// Whether the manifest or --set gave `key` a value (not its default).
// Whether `key` is written (in a file or by --set) with another value than its
// default: the keys the "changes nothing" warnings name. A key written at its default
// changes nothing either way, and manifest copies (a checkpoint's) write every key.
bool written(const manifest::Manifest& man, const char* key) {
  if (man.origin(key).kind == manifest::Origin::Kind::Default) return false;
  const toml::table d = manifest::schema::default_of(key);
  if (d.empty()) return true;
  const toml::node_view<const toml::node> value = man.table().at_path(key), fallback = d["v"];
  if (value.is_number() && fallback.is_number())  // 0 and 0.0 alike
    return value.value<double>() != fallback.value<double>();
  std::ostringstream a, b;
  a << value;
  b << fallback;
  return a.str() != b.str();
}

// Whether the schedule's orders are those of the default group size (0: pp), as with
// a schedule that does not read it (1F1B, GPipe); false when the default is refused.
bool same_orders_as_default_group(const RunPlan& plan, const loom_options* schedule_options) {
  try {
    return pipeline::compute_orders(*plan.schedule, schedule_options, plan.sizes.pp, plan.config.parallel.vpp,
                                    static_cast<int>(plan.microbatches), 0)
               .order == plan.orders.order;
  } catch (const std::exception&) {
    return false;
  }
}

// Schedule keys written in the manifest or by --set that the chosen styles never read:
// wsd's keys under another decay style; min_lr and decay_* under "constant"; a
// weight-decay schedule's ends under a constant weight decay (not the constant under a
// schedule: configs that others extend write it).
std::vector<std::string> schedule_settings_that_change_nothing(const manifest::Manifest& man,
                                                               const manifest::RunConfig::Optimizer& o) {
  std::vector<std::string> out;
  auto unread = [&](const char* key, const std::string& why) {
    if (written(man, key))
      out.push_back(man.origin(key).str() + ": " + key + " " + why + "; with optimizer.decay_style = \"" +
                    o.decay_style + "\" it changes nothing");
  };
  if (o.decay_style != "wsd")
    for (const char* key : {"optimizer.wsd_decay_steps", "optimizer.wsd_decay_samples", "optimizer.wsd_decay_style"})
      unread(key, "shapes the final decay of decay_style = \"wsd\"");
  if (o.decay_style == "constant")
    for (const char* key : {"optimizer.min_lr", "optimizer.decay_steps", "optimizer.decay_samples"})
      unread(key, "is where a decay ends");
  const std::string wd_style = "; with optimizer.weight_decay_incr_style = \"" + o.weight_decay_incr_style + "\"";
  if (o.weight_decay_incr_style == "constant")
    for (const char* key : {"optimizer.start_weight_decay", "optimizer.end_weight_decay"})
      if (written(man, key))
        out.push_back(man.origin(key).str() + ": " + key + " is an end of a weight-decay schedule" + wd_style +
                      " the weight decay is optimizer.weight_decay and this changes nothing");
  return out;
}

}  // namespace

pipeline::PipelineOrders RunPlan::orders_for(int64_t m) const {
  if (m == microbatches && !orders.order.empty()) return orders;
  plugins::OptionValues schedule_opts(&config.pipeline.options, schedule->options);
  return pipeline::compute_orders(*schedule, schedule_opts.raw(), sizes.pp, config.parallel.vpp, static_cast<int>(m),
                                  config.pipeline.microbatch_group_size);
}

std::map<int32_t, const void*> RunPlan::services() const {
  std::map<int32_t, const void*> out;
  if (tensor != nullptr) out[LOOM_API_TENSOR_PARALLEL] = tensor->api;
  if (expert != nullptr) out[LOOM_API_EXPERT_PARALLEL] = expert->api;
  return out;
}

runtime::LaunchConfig launch_config(const RunPlan& plan) {
  runtime::LaunchConfig lc;
  lc.device_plugin = plan.device;
  lc.device_options = &plan.config.device.options;
  lc.comm_plugin = plan.comm;
  lc.comm_options = &plan.config.comm.options;
  lc.sizes = plan.sizes;
  // Rounded up: a timeout below a millisecond would become 0, which means none.
  lc.timeout_ms = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(plan.config.comm.timeout_s * 1000)));
  lc.threads = plan.config.device.threads;
  lc.services = plan.services();
  return lc;
}

RunPlan make_plan(manifest::Manifest m, plugins::Registry& registry, PlanUse use) {
  RunPlan plan{std::move(m)};
  plan.registry = &registry;
  manifest::Manifest& man = plan.manifest;
  plan.config = manifest::RunConfig::from(man);
  const manifest::RunConfig& config = plan.config;

  // Search paths named in the manifest are relative to the file that names them.
  std::vector<std::string> extra;
  const manifest::Origin po = man.origin("plugins.search_paths");
  for (const std::string& p : config.plugins.search_paths) {
    boost::filesystem::path path(p);
    if (path.is_relative() && po.kind == manifest::Origin::Kind::File && !po.file.empty())
      path = boost::filesystem::path(po.file).parent_path() / path;
    extra.push_back(path.lexically_normal().string());
  }
  plan.plugin_load_errors = registry.load_dirs(plugins::Registry::search_paths(extra));
  std::vector<manifest::Diagnostic> diags;
  // A kind/name in two files: which one runs would depend on the search order (what
  // `loom run` refuses, validate and plan refuse alike).
  for (const std::string& e : registry.duplicate_errors())
    if (std::find(plan.plugin_load_errors.begin(), plan.plugin_load_errors.end(), e) != plan.plugin_load_errors.end())
      diags.push_back({"plugins.search_paths", man.origin("plugins.search_paths"), e});

  // The layout, from keys the schema has checked (each size and their product bounded).
  plan.sizes.tp = config.parallel.tp;
  plan.sizes.cp = config.parallel.cp;
  plan.sizes.pp = config.parallel.pp;
  plan.sizes.ep = config.parallel.ep;
  plan.sizes.etp = config.parallel.etp;
  plan.sizes.order = config.parallel.order;
  plan.dp = config.parallel.dp;
  plan.sizes.world = plan.sizes.tp * plan.sizes.cp * plan.sizes.pp * plan.dp;
  plan.microbatches = config.batch.global_batch_size / (config.batch.micro_batch_size * plan.dp);

  auto need = [&](const std::string& key, const std::string& kind, const std::string& name,
                  const std::string& options_section) -> const plugins::LoadedPlugin* {
    const plugins::LoadedPlugin* p = registry.find(kind, name);
    if (p == nullptr) {
      std::vector<std::string> names;
      for (const auto& q : registry.all())
        if (q->kind == kind) names.push_back(q->name);
      std::string available;
      for (const std::string& n : names) available += (available.empty() ? "" : ", ") + n;
      const std::string close = manifest::did_you_mean(name, names);
      std::string msg = "no plugin " + kind + "/" + name + " is loaded (available: " +
                        (available.empty() ? "none" : available) + ")" +
                        (close.empty() ? "" : " (did you mean \"" + close + "\"?)");
      for (const std::string& e : plan.plugin_load_errors)
        if (e.find("_" + name) != std::string::npos) msg += "; note: " + e;
      diags.push_back({key, man.origin(key), msg});
      return nullptr;
    }
    if (!options_section.empty()) man.apply_plugin_options(options_section, p->key(), p->options, diags);
    return p;
  };
  plan.device = need("device.kind", "device", config.device.kind, "device.options");
  plan.comm = need("comm.backend", "comm", config.comm.backend, "comm.options");
  check_links(man, plan.comm, config, diags);
  plan.exec = need("exec.mode", "exec", config.exec.mode, "exec.options");
  plan.optimizer = need("optimizer.strategy", "parallel", config.optimizer.strategy, "optimizer.options");
  if (plan.optimizer != nullptr && plan.optimizer->api_type != LOOM_API_OPTIMIZER) {
    diags.push_back({"optimizer.strategy", man.origin("optimizer.strategy"),
                     "plugin " + plan.optimizer->key() + " is not an optimizer strategy (it provides another table); "
                     "optimizer.strategy names a parallel plugin with an optimizer table: \"ddp\", \"distributed\" "
                     "or a third party's"});
    plan.optimizer = nullptr;
  }
  plan.schedule = need("pipeline.schedule", "parallel", pipeline::schedule_plugin_name(config.pipeline.schedule),
                       "pipeline.options");

  // The services layers call: the configured plugin must provide that table.
  auto service = [&](const std::string& key, const std::string& name, int32_t api_type,
                     const char* what) -> const plugins::LoadedPlugin* {
    const plugins::LoadedPlugin* p = need(key, "parallel", name, "");
    if (p && p->api_type != api_type) {
      diags.push_back({key, man.origin(key),
                       "plugin " + p->key() + " is not " + what + " (it provides another table)"});
      return nullptr;
    }
    return p;
  };
  plan.tensor =
      service("parallel.tensor", config.parallel.tensor, LOOM_API_TENSOR_PARALLEL, "a tensor-parallel service");
  if (config.parallel.ep > 1)
    plan.expert =
        service("parallel.expert", config.parallel.expert, LOOM_API_EXPERT_PARALLEL, "an expert-parallel dispatcher");

  plan.layers = model::model_layers(config);
  check_unique_instances(man, config, plan.layers, diags);
  std::set<std::string> configured;
  for (const model::LayerSpec& l : plan.layers) {
    if (!configured.insert(l.config).second) continue;
    const std::string section = "model.layer." + l.config;
    const plugins::LoadedPlugin* p = registry.find("layer", l.plugin);
    if (p == nullptr) {
      std::string key = man.contains(section + ".plugin") ? section + ".plugin" : "model.block";
      if (!man.contains(section + ".plugin")) {
        for (size_t i = 0; i < plan.layers.size(); ++i)
          if (plan.layers[i].config == l.config) {
            key = list_of(config, plan.layers, i);
            break;
          }
      }
      std::string available;
      for (const auto& q : registry.all())
        if (q->kind == "layer") available += (available.empty() ? "" : ", ") + q->name;
      diags.push_back({key, man.origin(key),
                       "layer '" + l.config + "' uses plugin layer/" + l.plugin + ", which is not loaded (available: " +
                           (available.empty() ? "none" : available) + "; or add a [" + section +
                           "] table with plugin = \"...\")"});
      continue;
    }
    man.apply_plugin_options(section, p->key(), p->options, diags, {"plugin"});
    // Context parallelism hands every layer a slice of the sequence (ABI 1.6): only
    // layers that say they compute the serial model's values for it get one.
    const loom_layer_api* api = p->layer();
    const bool takes_slice = LOOM_HAS_SLOT(api, loom_layer_api, features) &&
                             (api->features & LOOM_LAYER_CONTEXT_PARALLEL) != 0;
    if (config.parallel.cp > 1 && !takes_slice)
      diags.push_back({"parallel.cp", man.origin("parallel.cp"),
                       "layer '" + l.config + "' (plugin " + p->key() + ", ABI 1." + std::to_string(p->abi_minor) +
                           ") does not take a context-parallel slice of the sequence (it does not advertise "
                           "LOOM_LAYER_CONTEXT_PARALLEL, ABI 1.6); set parallel.cp = 1"});
    // Documents packed in a sequence (ABI 1.22): every layer must keep them apart, or
    // mix no positions.
    const bool documents = p->abi_minor >= 22 && LOOM_HAS_SLOT(api, loom_layer_api, features) &&
                           (api->features & LOOM_LAYER_DOCUMENTS) != 0;
    for (const char* key : {"data.reset_attention_mask", "data.reset_position_ids"})
      if (man.get_bool(key) && !documents)
        diags.push_back({key, man.origin(key),
                         "layer '" + l.config + "' (plugin " + p->key() + ", ABI 1." + std::to_string(p->abi_minor) +
                             ") does not keep the documents of a sequence apart (it does not advertise "
                             "LOOM_LAYER_DOCUMENTS, ABI 1.22); set " + key + " = false"});
  }
  check_layer_places(man, config, registry, plan.layers, diags);
  plan.warnings = unused_layer_tables(man, configured);
  // Block kinds the pattern never places (model.block too, when written).
  const auto placed = [&](const std::string& kind) {
    const std::vector<std::string>& p = config.model.block_pattern;
    return p.empty() ? kind == manifest::schema::kDefaultBlock : std::find(p.begin(), p.end(), kind) != p.end();
  };
  for (const auto& [kind, layers] : config.model.blocks)
    if (!placed(kind)) {
      const std::string key = std::string(manifest::schema::kBlockTable) + "." + kind;
      plan.warnings.push_back(man.origin(key).str() + ": " + key + " is set but model.block_pattern places no '" +
                              kind + "' block, so it has no effect");
    }
  if (!placed(std::string(manifest::schema::kDefaultBlock)) && written(man, "model.block"))
    plan.warnings.push_back(man.origin("model.block").str() +
                            ": model.block is set but model.block_pattern places no \"block\", so it has no effect "
                            "and its layers are not checked");
  if (const std::string w = position_embedding_disagreement(man, plan.layers); !w.empty()) plan.warnings.push_back(w);
  if (config.parallel.pp * config.parallel.vpp == 1) {
    for (const char* key : {"pipeline.first_chunk_layers", "pipeline.last_chunk_layers"})
      if (man.get_int(key) > 0)
        plan.warnings.push_back(man.origin(key).str() + ": " + key + " sizes a pipeline chunk; with one chunk " +
                                "(parallel.pp = 1) it changes nothing");
    if (!config.pipeline.chunk_layers.empty())
      plan.warnings.push_back(man.origin("pipeline.chunk_layers").str() +
                              ": pipeline.chunk_layers sizes the pipeline chunks; with one chunk (parallel.pp = 1) "
                              "it changes nothing");
  }
  if (config.model.recompute_granularity == "none")
    for (const char* key : {"model.recompute_method", "model.recompute_num_layers"})
      if (written(man, key))
        plan.warnings.push_back(man.origin(key).str() + ": " + key + " chooses what full recomputation keeps; with "
                                "model.recompute_granularity = \"none\" it changes nothing");
  for (const std::string& w : schedule_settings_that_change_nothing(man, config.optimizer)) plan.warnings.push_back(w);
  const manifest::ScheduleMarks marks = manifest::schedule_marks(config);
  const std::string unit = marks.unit();
  if (marks.warmup > static_cast<double>(marks.decay_end) && man.get_int("optimizer.decay_" + unit) == 0)
    plan.warnings.push_back(man.origin("optimizer.warmup_" + unit).str() + ": the warmup (" +
                            std::to_string(static_cast<int64_t>(marks.warmup)) + " " + unit + ") outlasts the run (" +
                            std::to_string(marks.decay_end) + " " + unit + "): the learning rate never reaches optimizer.lr");
  if (config.checkpoint.dir.empty())
    for (const char* key : {"checkpoint.every", "checkpoint.keep_last", "checkpoint.async_save"})
      if (key == std::string("checkpoint.async_save") ? config.checkpoint.async_save : man.get_int(key) > 0)
        plan.warnings.push_back(man.origin(key).str() + ": " + key + " is set but checkpoint.dir is empty, so no "
                                "checkpoint is saved");
  if (config.run.train_samples > 0 && written(man, "run.steps"))
    plan.warnings.push_back(man.origin("run.steps").str() + ": run.steps is replaced by run.train_samples = " +
                            std::to_string(config.run.train_samples) + ", which takes " +
                            std::to_string(config.run.steps) + (config.run.steps == 1 ? " step" : " steps") +
                            " from the start (a resume counts on from the samples it read)");
  for (const char* key : {"run.exit_duration_minutes", "run.exit_interval"})
    if (config.checkpoint.dir.empty() && man.get_float(key) > 0 &&
        (key != std::string("run.exit_interval") || config.run.exit_interval < config.run.steps))
      plan.warnings.push_back(man.origin(key).str() + ": " + key + " stops the run early, but checkpoint.dir is "
                              "empty, so the steps trained are not saved and --resume cannot continue");
  if (config.run.exit_interval >= config.run.steps)
    plan.warnings.push_back(man.origin("run.exit_interval").str() + ": run.exit_interval = " +
                            std::to_string(config.run.exit_interval) + " is not below run.steps = " +
                            std::to_string(config.run.steps) + ", so it stops no run before its end");
  if (!config.checkpoint.init_weights.empty() && config.model.init_method_std > 0)
    plan.warnings.push_back(man.origin("model.init_method_std").str() + ": model.init_method_std sets the random "
                            "initialisation; the run starts from checkpoint.init_weights, so it changes nothing");
  if (!config.checkpoint.dir.empty() && config.checkpoint.async_save && config.checkpoint.every == 0)
    plan.warnings.push_back(man.origin("checkpoint.async_save").str() + ": checkpoint.async_save writes the "
                            "checkpoints of checkpoint.every beside training; with checkpoint.every = 0 there are "
                            "only those at a stop signal and at the end, written in line, so it changes nothing");
  if (config.data.kind == "synthetic" && written(man, "data.val_fraction"))
    plan.warnings.push_back(man.origin("data.val_fraction").str() + ": data.val_fraction holds out a share of a "
                            "file's tokens; data.kind = \"synthetic\" generates its validation problems apart, so it "
                            "changes nothing");
  if (config.data.kind != "synthetic")
    for (const char* key : {"data.task", "data.digits"})
      if (written(man, key))
        plan.warnings.push_back(man.origin(key).str() + ": " + key + " shapes the synthetic task; with data.kind = \"" +
                                config.data.kind + "\" it changes nothing");
  if (!config.data.eod_mask_loss && !config.data.documents() && config.data.kind != "chat" &&
      written(man, "data.eod_token"))
    plan.warnings.push_back(man.origin("data.eod_token").str() + ": data.eod_token names the token that ends a "
                            "document for data.eod_mask_loss, data.reset_attention_mask and data.reset_position_ids; "
                            "with all three false it changes nothing");
  if (config.data.kind == "synthetic" && !config.data.path.empty())
    plan.warnings.push_back(man.origin("data.path").str() + ": data.path is set but data.kind = \"synthetic\" "
                            "generates its data; set data.kind = \"text\" or \"tokens\" to read the file");
  if (use == PlanUse::Launch) check_comm_fits(man, plan, diags);
  // A layer step with a tensor-parallel collective inside is never captured (comm
  // plugins do not promise capture; model::CapturePolicy): all of it runs directly.
  if (plan.exec != nullptr && config.parallel.tp > 1) {
    const loom_exec_api* exec = plan.exec->exec();
    if (exec != nullptr && LOOM_HAS_SLOT(exec, loom_exec_api, features) && (exec->features & LOOM_EXEC_REPLAYS) != 0)
      plan.warnings.push_back(man.origin("exec.mode").str() + ": exec.mode = \"" + config.exec.mode + "\" captures " +
                              "no layer step with parallel.tp = " + std::to_string(config.parallel.tp) +
                              " (a step with a tensor-parallel collective inside is not captured): every step runs "
                              "directly, as with \"eager\"");
  }
  // A recomputed forward runs inside the backward, outside the captured forward and
  // backward steps an exec plugin that replays would replay.
  if (plan.exec != nullptr && config.model.recompute_granularity != "none") {
    const loom_exec_api* exec = plan.exec->exec();
    if (exec != nullptr && LOOM_HAS_SLOT(exec, loom_exec_api, features) && (exec->features & LOOM_EXEC_REPLAYS) != 0)
      diags.push_back({"model.recompute_granularity", man.origin("model.recompute_granularity"),
                       "model.recompute_granularity = \"" + config.model.recompute_granularity +
                           "\" with exec.mode = \"" + config.exec.mode + "\" (" + plan.exec->key() +
                           ", which captures and replays layer steps) is not supported: a recomputed forward runs "
                           "inside the backward, between captured steps; set model.recompute_granularity = "
                           "\"none\" or exec.mode = \"eager\""});
  }
  // Layers that mix positions run their context-parallel slice through windowed
  // attention (ABI 1.6): a device without it is refused here, so `loom validate`
  // says so before a run starts.
  if (plan.device != nullptr && config.parallel.cp > 1) {
    const loom_device_api* dev = plan.device->device();
    const bool window = dev != nullptr && LOOM_HAS_SLOT(dev, loom_device_api, features) &&
                        (dev->features & LOOM_DEVICE_ATTENTION_WINDOW) != 0;
    if (!window)
      diags.push_back({"parallel.cp", man.origin("parallel.cp"),
                       "context parallelism needs windowed attention from the device, which " + plan.device->key() +
                           " (ABI 1." + std::to_string(plan.device->abi_minor) +
                           ") does not advertise (LOOM_DEVICE_ATTENTION_WINDOW, ABI 1.6); set parallel.cp = 1 or "
                           "use a device plugin built against ABI 1.6"});
  }
  // A tensor-parallel service before 1.6 draws dropout masks by the rank's rows,
  // the same on every cp rank.
  if (plan.tensor != nullptr && config.parallel.cp > 1 && plan.tensor->abi_minor < 6)
    diags.push_back({"parallel.cp", man.origin("parallel.cp"),
                     "context parallelism needs a tensor-parallel service built for ABI 1.6 or later (its dropout "
                     "masks follow positions in the whole sequence); " + plan.tensor->key() + " is ABI 1." +
                         std::to_string(plan.tensor->abi_minor) + "; set parallel.cp = 1 or rebuild it"});
  if (!diags.empty()) throw manifest::ManifestError(std::move(diags));
  plan.config = manifest::RunConfig::from(man);  // again: the plugins' option defaults are now filled in

  if (plan.sizes.ep > 1 || plan.sizes.experts_fold_tp())
    require_experts_fold_into_dp(man, plan.sizes);
  // The schedule plugin's orders, proven free of deadlock, now rather than when the run
  // starts: a group size or layout it refuses is then a validate error too.
  plugins::OptionValues schedule_opts(&config.pipeline.options, plan.schedule->options);
  plan.orders = plan.orders_for(plan.microbatches);
  pipeline::simulate(plan.orders);
  // A batch ramp's smaller steps: each count's orders checked alike (and made again
  // when the run reaches it: kept, a long ramp's would hold memory quadratic in it).
  const std::vector<int64_t> counts = BatchRamp(config.batch, plan.dp).microbatch_counts();
  if (counts.size() > kMaxRampBatches)
    throw manifest::ManifestError({{"batch.rampup_batch_size", man.origin("batch.rampup_batch_size"),
                                    "the ramp passes through " + std::to_string(counts.size()) +
                                        " batch sizes, more than " + std::to_string(kMaxRampBatches) +
                                        " (each one's pipeline orders are checked before launch); take a larger "
                                        "increment"}});
  for (const int64_t m : counts) {
    if (m == plan.microbatches) continue;
    try {
      pipeline::simulate(plan.orders_for(m));
    } catch (const std::exception& e) {
      throw manifest::ManifestError({{"batch.rampup_batch_size", man.origin("batch.rampup_batch_size"),
                                      "the ramp's steps of " + std::to_string(m) + " microbatch(es) per rank: " +
                                          e.what()}});
    }
  }
  if (config.pipeline.microbatch_group_size > 0 && same_orders_as_default_group(plan, schedule_opts.raw()))
    plan.warnings.push_back(man.origin("pipeline.microbatch_group_size").str() + ": pipeline.microbatch_group_size = " +
                            std::to_string(config.pipeline.microbatch_group_size) + " gives the same orders as 0 (pp) " +
                            "under schedule " + plan.schedule->key() + ": it changes nothing");
  plan.blocks_per_chunk =
      topology::blocks_per_chunk(static_cast<int>(config.model.num_layers), plan.sizes.pp, config.parallel.vpp,
                                 config.pipeline.first_chunk_layers, config.pipeline.last_chunk_layers,
                                 config.pipeline.chunk_layers);
  plan.chunks = pipeline::partition_layers(plan.layers, plan.blocks_per_chunk);
  // Blocks without layers (model.block = []) leave chunks empty: a stage with nothing
  // to run has no activations to pass on.
  int first_block = 0;
  for (size_t g = 0; g < plan.chunks.size(); first_block += plan.blocks_per_chunk[g], ++g)
    if (plan.chunks[g].empty()) {
      const std::string key =
          first_block < config.model.num_layers ? config.model.block_key(first_block) : std::string("model.block");
      throw manifest::ManifestError({{key, man.origin(key),
                                      "pipeline chunk " + std::to_string(g) + " of " +
                                          std::to_string(plan.chunks.size()) + " holds no layer (its blocks have "
                                          "none); give " + key + " layers, or set parallel.pp = 1 and "
                                          "parallel.vpp = 1"}});
    }
  return plan;
}

namespace {

// Overrides that give a copy of the manifest (which has no file to resolve them
// against) the paths it wrote relative to its own file, as they were resolved;
// `absolute`: made absolute too, for a copy read from anywhere later.
std::vector<std::string> resolved_paths(const RunPlan& plan, bool absolute) {
  std::vector<std::string> all;
  auto quoted = [&](const std::string& s) {
    const std::string p = absolute ? boost::filesystem::absolute(s).lexically_normal().string() : s;
    return manifest::to_toml_text(toml::value<std::string>(p));
  };
  const manifest::RunConfig& c = plan.config;
  if (!c.data.path.empty()) all.push_back("data.path=" + quoted(c.data.path));
  if (!c.data.blend.empty()) {
    std::string blend = "[";
    for (const auto& [weight, path] : c.data.blend)
      blend += (blend.size() > 1 ? ", " : "") + manifest::to_toml_text(toml::value<double>(weight)) + ", " + quoted(path);
    all.push_back("data.blend=" + blend + "]");
  }
  if (!c.data.tokenizer.empty()) all.push_back("data.tokenizer=" + quoted(c.data.tokenizer));
  if (!c.checkpoint.init_weights.empty()) all.push_back("checkpoint.init_weights=" + quoted(c.checkpoint.init_weights));
  return all;
}

}  // namespace

RunPlan replan(const RunPlan& plan, const std::vector<std::string>& overrides) {
  std::vector<std::string> all = resolved_paths(plan, false);
  all.insert(all.end(), overrides.begin(), overrides.end());
  return make_plan(manifest::Manifest::parse(plan.manifest.to_toml(), "a copy of the manifest", all),
                   const_cast<plugins::Registry&>(*plan.registry));
}

std::string saved_manifest(const RunPlan& plan) {
  return manifest::Manifest::parse(plan.manifest.to_toml(), "a copy of the manifest", resolved_paths(plan, true))
      .to_toml();
}

}  // namespace loom::train
