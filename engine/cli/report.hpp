// How every subcommand reports an invalid manifest or a refused plan: the diagnostics
// as JSON on stdout with --json, otherwise the text (one line per problem) on stderr.
#pragma once

#include "engine/manifest/manifest.hpp"
#include "engine/runtime/launcher.hpp"
#include "engine/runtime/json.hpp"

#include <iostream>

namespace loom::cli {

// Returns the exit code for an invalid manifest (1).
inline int report_manifest_error(const manifest::ManifestError& e, bool json) {
  if (json) {
    nlohmann::ordered_json errors = nlohmann::ordered_json::array();
    for (const auto& d : e.diagnostics())
      errors.push_back({{"key", d.key}, {"origin", d.origin.str()}, {"message", d.message}});
    std::cout << runtime::dump_json({{"valid", false}, {"errors", errors}}) << "\n";
  } else {
    std::cerr << e.what() << "\n";
  }
  return 1;
}

// Any other refusal (a plugin's, the plan's) alike: with --json one error of no key,
// otherwise "loom COMMAND: message" on stderr. Returns 1.
inline int report_error(const std::exception& e, bool json, const std::string& command) {
  const std::string why = runtime::error_message(e);
  if (json) {
    const nlohmann::ordered_json error = {{"key", ""}, {"origin", ""}, {"message", why}};
    std::cout << runtime::dump_json({{"valid", false}, {"errors", nlohmann::ordered_json::array({error})}}) << "\n";
  } else {
    std::cerr << "loom " << command << ": " << why << "\n";
  }
  return 1;
}

}  // namespace loom::cli
