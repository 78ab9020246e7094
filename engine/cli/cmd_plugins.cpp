// loom plugins list | info NAME | check DIR
#include "engine/cli/args.hpp"
#include "engine/cli/commands.hpp"
#include "engine/cli/json.hpp"
#include "engine/plugins/registry.hpp"

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

std::string plugin_json(const plugins::LoadedPlugin& p, bool with_options) {
  JsonObject o;
  o.add("name", p.key()).add("kind", p.kind).add("version", p.version).add("description", p.description)
      .add("file", p.file).add("abi", std::to_string(p.abi_major) + "." + std::to_string(p.abi_minor));
  if (with_options) {
    std::vector<std::string> opts;
    for (const auto& d : p.options) {
      JsonObject od;
      od.add("name", d.name).add("type", type_name(d.type)).add("doc", d.doc);
      if (d.default_value) od.add("default", *d.default_value);
      else od.add_raw("default", "null");
      if (!d.bounds.interval_text().empty()) od.add("range", d.bounds.interval_text());
      if (!d.bounds.allowed.empty()) {
        std::vector<std::string> choices;
        for (const std::string& c : d.bounds.allowed) choices.push_back(json_str(c));
        od.add_raw("choices", json_array(choices));
      }
      opts.push_back(od.str());
    }
    o.add_raw("options", json_array(opts));
  }
  return o.str();
}

void print_info(const plugins::LoadedPlugin& p) {
  std::cout << p.key() << " " << p.version << "  — " << p.description << "\n"
            << "  file: " << p.file << "\n  abi:  " << p.abi_major << "." << p.abi_minor << "\n";
  if (p.options.empty()) {
    std::cout << "  options: none\n";
    return;
  }
  size_t name_width = 0, allowed_width = 0;
  for (const auto& d : p.options) {
    name_width = std::max(name_width, d.name.size());
    allowed_width = std::max(allowed_width, allowed_text(d).size());
  }
  std::cout << "  options:\n";
  for (const auto& d : p.options)
    std::cout << "    " << std::left << std::setw(static_cast<int>(name_width + 2)) << d.name << std::setw(8)
              << type_name(d.type) << std::setw(14) << (d.default_value ? *d.default_value : "(required)")
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
    "Plugins are found in --plugin-path, $LOOM_PLUGIN_PATH, then next to the loom binary.\n";

}  // namespace

int cmd_plugins(int argc, char** argv) {
  try {
    Args args(argc, argv, {"--json"}, {"--plugin-path"});
    const auto& pos = args.positionals();
    if (args.flag("--help")) {
      std::cout << kUsage;
      return 0;
    }
    if (pos.empty()) throw UsageError("missing subcommand (list, info or check)");
    const std::string& sub = pos[0];
    if (sub == "list") {
      plugins::Registry& r = loaded(args);
      if (args.flag("--json")) {
        std::vector<std::string> items;
        for (const auto& p : r.all()) items.push_back(plugin_json(*p, false));
        std::cout << JsonObject().add_raw("plugins", json_array(items)).str() << "\n";
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
      if (args.flag("--json")) std::cout << plugin_json(*hits[0], true) << "\n";
      else print_info(*hits[0]);
      return 0;
    }
    if (sub == "check") {
      if (pos.size() != 2) throw UsageError("plugins check takes one DIR");
      // A fresh registry: check DIR on its own, against this engine's ABI.
      plugins::Registry r;
      int failures = 0;
      std::vector<std::string> items;
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
          std::vector<std::string> jn;
          for (const auto& n : names) jn.push_back(json_str(n));
          items.push_back(JsonObject().add("file", f).add("ok", error.empty()).add("error", error)
                              .add_raw("plugins", json_array(jn)).str());
        } else if (error.empty()) {
          std::cout << "ok    " << f << ":";
          for (const auto& n : names) std::cout << " " << n;
          std::cout << "\n";
        } else {
          std::cout << "FAIL  " << error << "\n";
        }
      }
      warn_shadowed(r, dir);
      if (args.flag("--json"))
        std::cout << JsonObject().add("dir", pos[1]).add("failures", failures).add_raw("files", json_array(items)).str()
                  << "\n";
      else
        std::cout << files.size() - failures << " of " << files.size() << " libraries load\n";
      return failures ? 1 : 0;
    }
    throw UsageError("unknown subcommand '" + sub + "' (list, info, check)");
  } catch (const UsageError& e) {
    std::cerr << "loom plugins: " << e.what() << "\n" << kUsage;
    return 2;
  }
}

}  // namespace loom::cli
