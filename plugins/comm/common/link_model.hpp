// The network model of comm/local's `links` option (loom/cpp/link_model.hpp, in the
// SDK, where `loom plan --perf` reads the same costs) and the wait that applies it.
#pragma once

#include <loom/cpp/link_model.hpp>

#include <chrono>

namespace loom::comm_common {

using loom::CollectiveKind;
using loom::collective_seconds;
using loom::Link;
using loom::LinkModel;

// Sleeps until `start` + `seconds` (returns at once when that has passed).
void wait_until(std::chrono::steady_clock::time_point start, double seconds);

}  // namespace loom::comm_common
