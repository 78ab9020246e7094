// loom validate MANIFEST [--set key=value]... [--json]
// Prints every resolved value with where it came from, and the plan.
#include "engine/cli/args.hpp"
#include "engine/runtime/launcher.hpp"
#include "engine/cli/commands.hpp"
#include "engine/manifest/batches.hpp"
#include "engine/cli/report.hpp"
#include "engine/manifest/schema.hpp"
#include "engine/runtime/json.hpp"
#include "engine/train/preflight.hpp"
#include "engine/train/run_plan.hpp"

#include <algorithm>
#include <iomanip>
#include <iostream>

namespace loom::cli {
namespace {

const char* kUsage =
    "usage: loom validate MANIFEST [--set key.path=value]... [--json]\n"
    "       loom validate --reference      (every manifest key as a Markdown table)\n"
    "Checks the manifest and the plugins it names; prints resolved values with their origin\n"
    "(file:line, default or --set) and the plan. Exit 1 with every problem when invalid.\n";

std::string origin_kind(const manifest::Origin& o) {
  switch (o.kind) {
    case manifest::Origin::Kind::File: return "file";
    case manifest::Origin::Kind::Default: return "default";
    case manifest::Origin::Kind::Override: return "set";
  }
  return "?";
}

// The manifest reference, from the schema the loader validates against.
void print_reference() {
  namespace schema = manifest::schema;
  std::string section;
  for (const schema::KeySpec& k : schema::keys()) {
    if (k.section() != section) {
      section = k.section();
      std::cout << "\n### `[" << section << "]`\n\n| key | type | default | meaning |\n|---|---|---|---|\n";
    }
    std::string doc = k.doc;
    if (!k.allowed.empty()) {
      if (!doc.empty() && doc.back() != '.') doc += ".";
      doc += " One of:";
      for (const auto& a : k.allowed) doc += " `" + a + "`";
      doc += ".";
    }
    if (std::string b = k.bounds_text(); !b.empty()) doc += " (" + b + ")";
    std::cout << "| `" << k.path << "` | " << schema::describe(k.type) << " | "
              << (k.default_value ? "`" + *k.default_value + "`" : (k.type == schema::KeyType::Table ? "" : "required"))
              << " | " << doc << " |\n";
  }
}

}  // namespace

int cmd_validate(int argc, char** argv) {
  bool json = false;
  try {
    Args args(argc, argv, {"--json", "--reference"}, {"--set"});
    json = args.flag("--json");
    if (args.flag("--help")) {
      std::cout << kUsage;
      return 0;
    }
    if (args.flag("--reference")) {
      print_reference();
      return 0;
    }
    if (args.positionals().size() != 1) throw UsageError("validate takes one MANIFEST");
    train::RunPlan plan =
        train::make_plan(manifest::Manifest::load(args.positionals()[0], args.all("--set")), plugins::registry());
    // What train() checks before launch (the data, every rank's layers, memory), before
    // "valid" is said.
    const train::Preflight checked = train::preflight(plan, plan.sizes.world);
    const manifest::Manifest& m = plan.manifest;
    const manifest::RunConfig& config = plan.config;
    const int64_t layers = config.model.num_layers;
    const int64_t per_stage = layers / (plan.sizes.pp * config.parallel.vpp);  // the even split
    // Transformer layers per global pipeline chunk (uneven when the manifest says so).
    const std::vector<int>& per_chunk = plan.blocks_per_chunk;
    std::string per_chunk_text;
    for (size_t g = 0; g < per_chunk.size(); ++g) per_chunk_text += (g ? ", " : "") + std::to_string(per_chunk[g]);
    const int world = plan.sizes.world;
    const int64_t etp = plan.sizes.expert_tp();

    if (json) {
      using nlohmann::ordered_json;
      ordered_json entries = ordered_json::array();
      for (const auto& e : m.entries())
        entries.push_back(
            {{"key", e.key}, {"value", e.value}, {"origin", e.origin.str()}, {"source", origin_kind(e.origin)}});
      ordered_json layer_items = ordered_json::array();
      for (const auto& l : plan.layers) layer_items.push_back({{"name", l.instance}, {"plugin", "layer/" + l.plugin}});
      const ordered_json p = {{"world_size", world},
                              {"tp", plan.sizes.tp},
                              {"cp", plan.sizes.cp},
                              {"pp", plan.sizes.pp},
                              {"dp", plan.dp},
                              {"ep", plan.sizes.ep},
                              {"etp", etp},
                              {"vpp", config.parallel.vpp},
                              {"layers_per_stage", per_stage},
                              {"layers_per_chunk", per_chunk},
                              {"microbatches_per_rank", plan.microbatches},
                              {"rampup_batch_size", manifest::ramps(config.batch)
                                                        ? ordered_json::array({config.batch.rampup_start,
                                                                                 config.batch.rampup_increment,
                                                                                 config.batch.rampup_samples})
                                                        : ordered_json::array()},
                              {"device", plan.device->key()},
                              {"comm", plan.comm->key()},
                              {"exec", plan.exec->key()},
                              {"optimizer", plan.optimizer->key()},
                              {"schedule", plan.schedule->key()},
                              {"expert_dispatcher", plan.expert ? plan.expert->key() : ""},
                              {"layers", layer_items}};
      // What the text form says as warnings: settings that change nothing, plugins that
      // did not load, and a plan past what this machine's device offers a rank (which
      // loom run refuses here; another machine may hold it).
      ordered_json warnings = ordered_json::array();
      for (const std::string& e : plan.plugin_load_errors) warnings.push_back(e);
      for (const std::string& w : plan.warnings) warnings.push_back(w);
      std::cout << runtime::dump_json({{"valid", true},
                                       {"memory_problem", checked.memory_problem},
                                       {"warnings", warnings},
                                       {"plan", p},
                                       {"values", entries}})
                << "\n";
      return 0;
    }
    std::cout << "manifest: " << args.positionals()[0] << " is valid\n\nresolved values:\n";
    // Columns as wide as the widest key and value (up to a limit, so one long
    // string value does not push every origin off the screen).
    size_t key_width = 0, value_width = 0;
    for (const auto& e : m.entries()) {
      key_width = std::max(key_width, e.key.size());
      value_width = std::max(value_width, std::min<size_t>(e.value.size(), 40));
    }
    for (const auto& e : m.entries())
      std::cout << "  " << std::left << std::setw(static_cast<int>(key_width)) << e.key << " = "
                << std::setw(static_cast<int>(value_width)) << e.value << " # " << e.origin.str() << "\n";
    std::cout << "\nplan:\n"
              << "  world size        " << world << " = tp " << plan.sizes.tp << " x cp " << plan.sizes.cp << " x pp "
              << plan.sizes.pp << " x dp " << plan.dp << "\n"
              << "  expert layout     ep " << plan.sizes.ep << " x etp " << etp << " (edp "
              << plan.dp * plan.sizes.tp * plan.sizes.cp / std::max<int64_t>(1, plan.sizes.ep * etp)
              << (plan.expert ? ", dispatcher " + plan.expert->key() : std::string()) << ")\n"
              << "  layers per chunk  " << per_chunk_text << " (global chunks 0.." << per_chunk.size() - 1 << " of "
              << layers << " blocks; vpp " << config.parallel.vpp << ", schedule " << plan.schedule->key()
              << ")\n"
              << "  microbatches      " << plan.microbatches << " per dp rank per step (" << config.batch.micro_batch_size
              << " sequences each; global batch " << config.batch.global_batch_size
              << (manifest::ramps(config.batch)
                      ? ", ramped from " + std::to_string(config.batch.rampup_start) + " by " +
                            std::to_string(config.batch.rampup_increment) + " over " +
                            std::to_string(config.batch.rampup_samples) + " samples"
                      : std::string())
              << ")\n"
              << "  gradient buckets  "
              << (config.optimizer.bucket_size > 0 ? std::to_string(config.optimizer.bucket_size) + " elements"
                                                   : std::string("one per model chunk"))
              << (config.optimizer.overlap_grad_reduce
                      ? std::string(", reduced during the backward (overlap_grad_reduce") +
                            (config.optimizer.overlap_param_gather ? "; parameters gathered into the next forward" : "") +
                            ")"
                      : std::string(config.optimizer.overlap_param_gather
                                        ? ", parameters gathered into the next forward (overlap_param_gather)"
                                        : ""))
              << ((config.optimizer.overlap_grad_reduce || config.optimizer.overlap_param_gather) &&
                          plan.dp * plan.sizes.cp == 1
                      ? "; one data-parallel rank: nothing to overlap"
                      : "")
              << "\n"
              << "  plugins           " << plan.device->key() << ", " << plan.comm->key() << ", " << plan.exec->key()
              << ", " << plan.optimizer->key() << ", " << plan.schedule->key() << ", " << plan.tensor->key()
              << (plan.expert ? ", " + plan.expert->key() : std::string()) << "\n  model             ";
    // The chain, or its ends when it is long (thousands of layers).
    const size_t shown = plan.layers.size() <= 24 ? plan.layers.size() : 12;
    for (size_t i = 0; i < shown; ++i)
      std::cout << (i ? " -> " : "") << plan.layers[i].instance << (i % 4 == 3 ? "\n                    " : "");
    if (shown < plan.layers.size())
      std::cout << " -> ... (" << plan.layers.size() - shown - 2 << " more) -> "
                << plan.layers[plan.layers.size() - 2].instance << " -> " << plan.layers.back().instance;
    std::cout << "\n";
    for (const std::string& e : plan.plugin_load_errors) std::cout << "warning: " << e << "\n";
    for (const std::string& w : plan.warnings) std::cout << "warning: " << w << "\n";
    if (!checked.memory_problem.empty())
      std::cout << "warning: " << checked.memory_problem << "; loom run refuses it on this machine (loom plan shows "
                << "each rank's share)\n";
    return 0;
  } catch (const UsageError& e) {
    std::cerr << "loom validate: " << e.what() << "\n" << kUsage;
    return 2;
  } catch (const manifest::ManifestError& e) {
    return report_manifest_error(e, json);
  } catch (const std::exception& e) {
    return report_error(e, json, "validate");
  }
}

}  // namespace loom::cli
