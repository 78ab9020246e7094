// Minimal JSON output for --json modes (no JSON library on the machines).
#pragma once

#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

namespace loom::cli {

inline std::string json_str(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

inline std::string json_num(double v) {
  if (!std::isfinite(v)) return "null";
  std::ostringstream os;
  os.precision(10);
  os << v;
  return os.str();
}

// Builds one JSON object: JsonObject().add("a", 1).add_raw("b", "[1,2]").str()
class JsonObject {
 public:
  JsonObject& add(const std::string& k, const std::string& v) { return add_raw(k, json_str(v)); }
  JsonObject& add(const std::string& k, const char* v) { return add_raw(k, json_str(v)); }
  JsonObject& add(const std::string& k, bool v) { return add_raw(k, v ? "true" : "false"); }
  JsonObject& add(const std::string& k, long long v) { return add_raw(k, std::to_string(v)); }
  JsonObject& add(const std::string& k, int v) { return add_raw(k, std::to_string(v)); }
  JsonObject& add(const std::string& k, size_t v) { return add_raw(k, std::to_string(v)); }
  JsonObject& add(const std::string& k, double v) { return add_raw(k, json_num(v)); }
  JsonObject& add_raw(const std::string& k, const std::string& raw) {
    body_ += (body_.empty() ? "" : ", ") + json_str(k) + ": " + raw;
    return *this;
  }
  std::string str() const { return "{" + body_ + "}"; }

 private:
  std::string body_;
};

inline std::string json_array(const std::vector<std::string>& raw_items) {
  std::string out = "[";
  for (size_t i = 0; i < raw_items.size(); ++i) out += (i ? ", " : "") + raw_items[i];
  return out + "]";
}

}  // namespace loom::cli
