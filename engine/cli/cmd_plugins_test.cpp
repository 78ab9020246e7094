// loom plugins test LIB|DIR [--layer NAME] [--set KEY=VALUE]... [--tp N] [--no-sp] [--skip CHECK]... [--json]
// The layer plugin harness (engine/testing/layer_harness.hpp) on a plugin author's
// library, with the real device/cpu, comm/local and parallel/tensor.
#include "engine/cli/args.hpp"
#include "engine/cli/commands.hpp"
#include "engine/manifest/manifest.hpp"
#include "engine/runtime/json.hpp"
#include "engine/testing/layer_harness.hpp"

#include <boost/filesystem.hpp>

#include <algorithm>
#include <iomanip>
#include <iostream>

namespace loom::cli {
namespace {

const char* kUsage =
    "usage: loom plugins test LIB|DIR [--layer NAME] [--set KEY=VALUE]... [--tp N] [--no-sp] [--skip CHECK]...\n"
    "                         [--seed S] [--json] [--plugin-path DIR]...\n"
    "Checks each layer plugin of LIB (a .so, or every .so in DIR) on device/cpu: gradients against\n"
    "finite differences, gradient accumulation, microbatches in flight, generation's kv_cache forwards\n"
    "(a layer with LOOM_LAYER_KV_CACHE) against a whole-sequence forward, the memory it keeps and\n"
    "allocates against what it declares to `loom plan` (activation_bytes, workspace_bytes), and tp N\n"
    "(default 2; 1 = none) with and without sequence parallelism against one rank; a layer with state\n"
    "(ABI 1.23): end_step after a forward without its backward leaves it as end_step alone, and it stays\n"
    "finite. --set gives the layer's options (TOML values, or a bare word as a string). --skip leaves a\n"
    "check out (gradients, accumulation, microbatches, kv_cache, memory, state, tpN, tpN+sp). Exit status\n"
    "1 when a check fails.\n";

// The .so files of LIB: the file itself, or those of the directory.
std::vector<std::string> libraries(const std::string& lib) {
  namespace fs = boost::filesystem;
  if (!fs::exists(lib)) throw UsageError(lib + " does not exist");
  if (!fs::is_directory(lib)) return {lib};
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(lib))
    if (e.path().extension() == ".so") files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  if (files.empty()) throw UsageError(lib + " holds no .so file");
  return files;
}

// The layer's options from --set, checked against its declarations as a manifest's
// [model.layer.NAME] table is (unknown keys, types, ranges; defaults filled in).
manifest::Manifest layer_options(const plugins::LoadedPlugin& p, const std::vector<std::string>& sets) {
  const std::string section = "model.layer." + p.name;
  std::vector<std::string> overrides;
  for (const std::string& s : sets) overrides.push_back(section + "." + s);
  manifest::Manifest m = manifest::Manifest::parse("[data]\nkind = \"synthetic\"\n", "loom plugins test", overrides);
  std::vector<manifest::Diagnostic> diags;
  m.apply_plugin_options(section, p.key(), p.options, diags, {"plugin"});
  if (!diags.empty()) throw manifest::ManifestError(diags);
  return m;
}

nlohmann::ordered_json run_json(const harness::CheckRun& c) {
  return {{"check", c.check},
          {"ok", c.error.empty() && c.findings.ok()},
          {"compared", c.findings.compared},
          {"failures", c.error.empty() ? c.findings.failures : std::vector<std::string>{c.error}}};
}

void print_run(const harness::CheckRun& c) {
  const bool ok = c.error.empty() && c.findings.ok();
  std::cout << "  " << (ok ? "ok    " : "FAIL  ") << std::left << std::setw(14) << c.check;
  if (ok) {
    std::cout << c.findings.compared << " values compared\n";
    return;
  }
  std::cout << "\n";
  const std::string text = c.error.empty() ? c.findings.text() : "the layer refused or threw: " + c.error;
  size_t start = 0;
  for (size_t end = text.find('\n'); start <= text.size(); end = text.find('\n', start)) {
    std::cout << "        " << text.substr(start, end - start) << "\n";
    if (end == std::string::npos) break;
    start = end + 1;
  }
}

}  // namespace

int cmd_plugins_test(int argc, char** argv) {
  try {
    Args args(argc, argv, {"--json", "--no-sp"}, {"--layer", "--set", "--tp", "--seed", "--skip", "--plugin-path"});
    if (args.flag("--help")) {
      std::cout << kUsage;
      return 0;
    }
    const auto& pos = args.positionals();
    if (pos.size() != 2) throw UsageError("plugins test takes one LIB (a .so file or a directory of them)");
    harness::SuiteOptions so;
    so.tp = static_cast<int>(args.get_int("--tp", 2));
    so.seed = static_cast<uint64_t>(args.get_int("--seed", 1));
    so.sequence_parallel = !args.flag("--no-sp");
    so.skip = args.all("--skip");
    const std::string tp_check = "tp" + std::to_string(so.tp);
    for (const std::string& c : so.skip)
      if (c != "gradients" && c != "accumulation" && c != "microbatches" && c != "kv_cache" && c != "memory" &&
          c != "state" && c != tp_check && c != tp_check + "+sp")
        throw UsageError("--skip " + c + ": no such check (gradients, accumulation, microbatches, kv_cache, memory, " +
                         "state, " + tp_check + ", " + tp_check + "+sp)");
    if (so.tp < 1 || so.tp > 8 || so.dims.seq_len % so.tp != 0 || so.dims.ffn_hidden % so.tp != 0)
      throw UsageError("--tp must be 1, 2, 4 or 8");
    // A head per tp rank at least (head size 4), so the model splits at this tp.
    if (so.dims.heads < so.tp) {
      so.dims.heads = so.tp;
      so.dims.hidden = 4 * so.tp;
    }

    // The libraries under test first, so that their plugins are the ones tested; then
    // the search path for device/cpu, comm/local and parallel/tensor.
    plugins::Registry r;
    std::vector<const plugins::LoadedPlugin*> tested;
    for (const std::string& f : libraries(pos[1])) {
      const size_t before = r.all().size();
      r.load_file(f);  // a library that does not load is the answer: PluginError below
      for (size_t i = before; i < r.all().size(); ++i)
        if (r.all()[i]->kind == "layer") tested.push_back(r.all()[i].get());
    }
    r.load_dirs(plugins::Registry::search_paths(args.all("--plugin-path")));  // a built-in it shadows is skipped
    if (const auto want = args.get("--layer")) {
      std::erase_if(tested, [&](const plugins::LoadedPlugin* p) { return p->name != *want; });
      if (tested.empty()) throw UsageError(pos[1] + " has no layer plugin named '" + *want + "'");
    }
    if (tested.empty()) throw UsageError(pos[1] + " registers no layer plugin (only layers are tested)");
    for (const char* needed : {"device/cpu", "comm/local", "parallel/tensor"}) {
      const std::string key(needed);
      if (r.find(key.substr(0, key.find('/')), key.substr(key.find('/') + 1)) == nullptr) {
        std::cerr << "loom plugins test: " << key
                  << " is not on the plugin search path (--plugin-path, $LOOM_PLUGIN_PATH, next to loom)\n";
        return 1;
      }
    }

    int failed = 0, total = 0;
    nlohmann::ordered_json items = nlohmann::ordered_json::array();
    for (const plugins::LoadedPlugin* p : tested) {
      const manifest::Manifest m = layer_options(*p, args.all("--set"));
      const std::vector<harness::CheckRun> runs =
          harness::check_layer_plugin(r, p->name, m.get_table("model.layer." + p->name), so);
      if (!args.flag("--json")) std::cout << p->key() << "  (" << p->file << ")\n";
      nlohmann::ordered_json checks = nlohmann::ordered_json::array();
      for (const harness::CheckRun& c : runs) {
        ++total;
        if (!c.error.empty() || !c.findings.ok()) ++failed;
        if (args.flag("--json")) checks.push_back(run_json(c));
        else print_run(c);
      }
      items.push_back({{"plugin", p->key()}, {"file", p->file}, {"checks", checks}});
    }
    if (args.flag("--json"))
      std::cout << runtime::dump_json({{"failures", failed}, {"checks", total}, {"plugins", items}}) << "\n";
    else
      std::cout << total - failed << " of " << total << " checks pass\n";
    if (total == 0) {
      std::cerr << "loom plugins test: every check was skipped; nothing was tested\n";
      return 2;
    }
    return failed ? 1 : 0;
  } catch (const UsageError& e) {
    std::cerr << "loom plugins test: " << e.what() << "\n" << kUsage;
    return 2;
  } catch (const manifest::ManifestError& e) {
    for (const auto& d : e.diagnostics()) std::cerr << "loom plugins test: " << d.str() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "loom plugins test: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace loom::cli
