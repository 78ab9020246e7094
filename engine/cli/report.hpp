// How every subcommand reports an invalid manifest: the diagnostics as JSON on
// stdout with --json, otherwise the text (one line per problem) on stderr.
#pragma once

#include "engine/cli/json.hpp"
#include "engine/manifest/manifest.hpp"

#include <iostream>

namespace loom::cli {

// Returns the exit code for an invalid manifest (1).
inline int report_manifest_error(const manifest::ManifestError& e, bool json) {
  if (json) {
    std::vector<std::string> errs;
    for (const auto& d : e.diagnostics())
      errs.push_back(JsonObject().add("key", d.key).add("origin", d.origin.str()).add("message", d.message).str());
    std::cout << JsonObject().add("valid", false).add_raw("errors", json_array(errs)).str() << "\n";
  } else {
    std::cerr << e.what() << "\n";
  }
  return 1;
}

}  // namespace loom::cli
