// How every subcommand reports an invalid manifest: the diagnostics as JSON on
// stdout with --json, otherwise the text (one line per problem) on stderr.
#pragma once

#include "engine/manifest/manifest.hpp"
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

}  // namespace loom::cli
