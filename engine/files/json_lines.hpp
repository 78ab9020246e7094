// JSON Lines, as loom reads datasets (pretraining documents, conversations, evaluation
// examples): one JSON value a line, blank lines skipped, a line named "NAME:N" in
// messages.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace loom::files {

struct JsonLine {
  int64_t number;         // 1-based, counting blank lines
  std::string_view text;  // into the content it was split from
};

// The lines of `content` that hold more than spaces, tabs and a carriage return.
std::vector<JsonLine> json_lines(std::string_view content);

class JsonLineError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The line's JSON value; throws JsonLineError "NAME:N: not JSON (why)".
nlohmann::json parse_json_line(const JsonLine& line, const std::string& name);

}  // namespace loom::files
