// loom plugins list | info NAME | check DIR | test LIB (cmd_plugins_test.cpp)
#include "engine/cli/args.hpp"
#include "engine/cli/commands.hpp"
#include "engine/plugins/registry.hpp"
#include "engine/runtime/json.hpp"

#include <boost/filesystem.hpp>

#include <algorithm>
#include <iomanip>
#include <iostream>

namespace loom::cli {
namespace {

const char* type_name(manifest::OptionDecl::Type t) {
  switch (t) {
    case manifest::OptionDecl::Type::Bool: return "bool";
    case manifest::OptionDecl::Type::Int: return "int";
    case manifest::OptionDecl::Type::Float: return "float";
    case manifest::OptionDecl::Type::String: return "string";
  }
  return "?";
}

// "[0, 1)" or "probs|position"; "" when the option allows any value of its type.
std::string allowed_text(const manifest::OptionDecl& d) {
  std::string choices;
  for (const std::string& c : d.bounds.allowed) choices += (choices.empty() ? "" : "|") + c;
  return choices.empty() ? d.bounds.interval_text() : choices;
}

nlohmann::ordered_json plugin_json(const plugins::LoadedPlugin& p, bool with_options) {
  nlohmann::ordered_json o = {{"name", p.key()},
                              {"kind", p.kind},
                              {"version", p.version},
                              {"description", p.description},
                              {"file", p.file},
                              {"abi", std::to_string(p.abi_major) + "." + std::to_string(p.abi_minor)}};
  if (with_options) {
    nlohmann::ordered_json opts = nlohmann::ordered_json::array();
    for (const auto& d : p.options) {
      nlohmann::ordered_json od = {{"name", d.name}, {"type", type_name(d.type)}, {"doc", d.doc}};
      od["default"] = d.default_value ? nlohmann::ordered_json(*d.default_value) : nlohmann::ordered_json(nullptr);
      if (!d.bounds.interval_text().empty()) od["range"] = d.bounds.interval_text();
      if (!d.bounds.allowed.empty()) od["choices"] = d.bounds.allowed;
      opts.push_back(std::move(od));
    }
    o["options"] = std::move(opts);
  }
  return o;
}

void print_info(const plugins::LoadedPlugin& p) {
  std::cout << p.key() << " " << p.version << "  — " << p.description << "\n"
            << "  file: " << p.file << "\n  abi:  " << p.abi_major << "." << p.abi_minor << "\n";
  if (p.options.empty()) {
    std::cout << "  options: none\n";
    return;
  }
  auto default_text = [](const auto& d) { return d.default_value ? *d.default_value : std::string("(required)"); };
  size_t name_width = 0, default_width = 0, allowed_width = 0;  // each column as wide as its widest value
  for (const auto& d : p.options) {
    name_width = std::max(name_width, d.name.size());
    default_width = std::max(default_width, default_text(d).size());
    allowed_width = std::max(allowed_width, allowed_text(d).size());
  }
  std::cout << "  options:\n";
  for (const auto& d : p.options)
    std::cout << "    " << std::left << std::setw(static_cast<int>(name_width + 2)) << d.name << std::setw(8)
              << type_name(d.type) << std::setw(static_cast<int>(default_width + 2)) << default_text(d)
              << std::setw(static_cast<int>(allowed_width + (allowed_width ? 2 : 0))) << allowed_text(d) << d.doc
              << "\n";
}

// Loads the default search path; load errors are warnings here (one bad file must
// not hide the others).
plugins::Registry& loaded(const Args& args) {
  plugins::Registry& r = plugins::registry();
  for (const std::string& e : r.load_dirs(plugins::Registry::search_paths(args.all("--plugin-path"))))
    std::cerr << "warning: " << e << "\n";
  return r;
}

// A kind/name of DIR that the rest of the search path ($LOOM_PLUGIN_PATH, the
// plugins next to loom) provides too: `loom run` refuses a kind/name found in two
// files, so say it now (a warning: DIR itself is fine).
void warn_shadowed(const plugins::Registry& checked, const boost::filesystem::path& dir) {
  if (checked.all().empty()) return;
  boost::system::error_code ec;
  std::vector<std::string> others_dirs;
  for (const std::string& d : plugins::Registry::search_paths())
    if (!boost::filesystem::equivalent(d, dir, ec)) others_dirs.push_back(d);
  plugins::Registry others;
  others.load_dirs(others_dirs);  // their own load errors are not DIR's business
  for (const auto& p : checked.all()) {
    const plugins::LoadedPlugin* q = others.find(p->kind, p->name);
    if (q == nullptr || boost::filesystem::equivalent(q->file, p->file, ec)) continue;
    std::cerr << "warning: plugin " << p->key() << " in " << p->file << " is also provided by " << q->file
              << "; `loom run` refuses a plugin found in two files on its search path: remove one of them or rename it\n";
  }
}

const char* kUsage =
    "usage: loom plugins list [--json] [--plugin-path DIR]...\n"
    "       loom plugins info KIND/NAME|NAME [--json] [--plugin-path DIR]...\n"
    "       loom plugins check DIR [--json]\n"
    "       loom plugins test LIB|DIR [--layer NAME] [--set KEY=VALUE]... [--tp N] [--no-sp] [--skip CHECK]... [--json]\n"
    "Plugins are found in --plugin-path, $LOOM_PLUGIN_PATH, then next to the loom binary.\n";

}  // namespace

int cmd_plugins(int argc, char** argv) {
  if (argc > 0 && std::string(argv[0]) == "test") return cmd_plugins_test(argc, argv);  // its own options
  try {
    Args args(argc, argv, {"--json"}, {"--plugin-path"});
    const auto& pos = args.positionals();
    if (args.flag("--help")) {
      std::cout << kUsage;
      return 0;
    }
    if (pos.empty()) throw UsageError("missing subcommand (list, info, check or test)");
    const std::string& sub = pos[0];
    if (sub == "list") {
      plugins::Registry& r = loaded(args);
      if (args.flag("--json")) {
        nlohmann::ordered_json items = nlohmann::ordered_json::array();
        for (const auto& p : r.all()) items.push_back(plugin_json(*p, false));
        std::cout << runtime::dump_json({{"plugins", items}}) << "\n";
      } else {
        size_t width = 0;  // the longest kind/name, so every column lines up
        for (const auto& p : r.all()) width = std::max(width, p->key().size());
        for (const auto& p : r.all())
          std::cout << std::left << std::setw(static_cast<int>(width + 2)) << p->key() << std::setw(8) << p->version
                    << p->description << "\n";
      }
      return 0;
    }
    if (sub == "info") {
      if (pos.size() != 2) throw UsageError("plugins info takes one NAME (kind/name, or a name that is unique)");
      plugins::Registry& r = loaded(args);
      const std::string& want = pos[1];
      std::vector<const plugins::LoadedPlugin*> hits;
      for (const auto& p : r.all())
        if (p->key() == want || p->name == want) hits.push_back(p.get());
      if (hits.size() != 1) {
        std::cerr << "loom plugins info: " << (hits.empty() ? "no plugin named '" : "ambiguous name '") << want
                  << "'; `loom plugins list` shows the kind/name of each\n";
        return 1;
      }
      if (args.flag("--json")) std::cout << runtime::dump_json(plugin_json(*hits[0], true)) << "\n";
      else print_info(*hits[0]);
      return 0;
    }
    if (sub == "check") {
      if (pos.size() != 2) throw UsageError("plugins check takes one DIR");
      // A fresh registry: check DIR on its own, against this engine's ABI.
      plugins::Registry r;
      int failures = 0;
      nlohmann::ordered_json items = nlohmann::ordered_json::array();
      boost::filesystem::path dir(pos[1]);
      if (!boost::filesystem::is_directory(dir)) {
        std::cerr << "loom plugins check: " << pos[1] << " is not a directory\n";
        return 1;
      }
      std::vector<std::string> files;
      for (const auto& e : boost::filesystem::directory_iterator(dir))
        if (e.path().extension() == ".so") files.push_back(e.path().string());
      std::sort(files.begin(), files.end());
      for (const std::string& f : files) {
        size_t before = r.all().size();
        std::string error;
        try {
          r.load_file(f);
        } catch (const plugins::PluginError& e) {
          error = e.what();
          ++failures;
        }
        std::vector<std::string> names;
        for (size_t i = before; i < r.all().size(); ++i) names.push_back(r.all()[i]->key());
        if (args.flag("--json")) {
          items.push_back({{"file", f}, {"ok", error.empty()}, {"error", error}, {"plugins", names}});
        } else if (error.empty()) {
          std::cout << "ok    " << f << ":";
          for (const auto& n : names) std::cout << " " << n;
          std::cout << "\n";
          if (!plugins::Registry::searched_file_name(boost::filesystem::path(f).filename().string()))
            std::cerr << "warning: " << f << " is not named loom_*.so, so a search path does not load it; name it "
                      << "loom_<kind>_<name>.so (loom_add_plugin does)\n";
        } else {
          std::cout << "FAIL  " << error << "\n";
        }
      }
      warn_shadowed(r, dir);
      if (args.flag("--json"))
        std::cout << runtime::dump_json({{"dir", pos[1]}, {"failures", failures}, {"files", items}}) << "\n";
      else
        std::cout << files.size() - failures << " of " << files.size() << " libraries load\n";
      return failures ? 1 : 0;
    }
    throw UsageError("unknown subcommand '" + sub + "' (list, info, check, test)");
  } catch (const UsageError& e) {
    std::cerr << "loom plugins: " << e.what() << "\n" << kUsage;
    return 2;
  }
}

}  // namespace loom::cli
