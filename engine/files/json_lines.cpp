#include "engine/files/json_lines.hpp"

namespace loom::files {

std::vector<JsonLine> json_lines(std::string_view content) {
  std::vector<JsonLine> lines;
  int64_t number = 0;
  for (size_t at = 0; at < content.size();) {
    size_t end = content.find('\n', at);
    if (end == std::string_view::npos) end = content.size();
    ++number;
    const std::string_view line = content.substr(at, end - at);
    if (line.find_first_not_of(" \t\r") != std::string_view::npos) lines.push_back({number, line});
    at = end + 1;
  }
  return lines;
}

nlohmann::json parse_json_line(const JsonLine& line, const std::string& name) {
  try {
    return nlohmann::json::parse(line.text);
  } catch (const nlohmann::json::exception& e) {
    throw JsonLineError(name + ":" + std::to_string(line.number) + ": not JSON (" + e.what() + ")");
  }
}

}  // namespace loom::files
