// JSON as loom writes it (--json output, comm counters, Chrome traces):
// nlohmann::ordered_json values, so keys keep the order they were added in, written
// compact on one line. Non-finite numbers come out as null; bytes that are not UTF-8
// (a file name, a --set value) come out as U+FFFD instead of failing the output.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace loom::runtime {

inline std::string dump_json(const nlohmann::ordered_json& j) {
  return j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

}  // namespace loom::runtime
