// How every comm plugin words a timeout in its messages: "after 200 ms", "after 2.0 s".
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace loom::comm_common {

inline std::string after_text(int64_t timeout_ms) {
  char buf[48];
  if (timeout_ms < 1000) {
    std::snprintf(buf, sizeof buf, "after %lld ms", static_cast<long long>(timeout_ms));
  } else {
    std::snprintf(buf, sizeof buf, "after %.1f s", static_cast<double>(timeout_ms) / 1000.0);
  }
  return buf;
}

}  // namespace loom::comm_common
