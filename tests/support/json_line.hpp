// Reading back the JSON loom writes. nlohmann::ordered_json keeps the keys in the
// order they were written, so comparing two such values also compares that order.
#pragma once

#include <nlohmann/json.hpp>

#include <stdexcept>
#include <string>

namespace loom::testing {

// A subcommand's --json output: exactly one "\n"-terminated line holding one JSON value.
inline nlohmann::ordered_json json_line(const std::string& out) {
  if (out.empty() || out.find('\n') != out.size() - 1) throw std::runtime_error("not one line of JSON: " + out);
  return nlohmann::ordered_json::parse(out);
}

}  // namespace loom::testing
