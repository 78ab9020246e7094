// `loom plan --perf --search`: every layout of a world size that the manifest's model
// can run and whose ranks fit their device, ranked by estimated step time.
//
// A layout is (tp, cp, pp, dp) with tp x cp x pp x dp = the world size, with and
// without sequence parallelism when tp > 1, and pipelines with the 1F1B schedule or
// interleaved over 2 virtual stages; the rest of the manifest stays as written (its
// batch, optimizer, experts). A layout the
// plan refuses (heads not divisible by tp, a global batch not divisible into
// microbatches, ...) or that does not fit in memory is listed with the reason.
// Compute is measured once per (tp, cp, SP), as `loom plan --perf` measures it.
#pragma once

#include "engine/train/perf_model.hpp"
#include "engine/train/run_plan.hpp"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace loom::train {

struct LayoutChoice {
  int tp = 1, cp = 1, pp = 1, dp = 1, vpp = 1;
  bool sp = false;  // sequence parallelism
  std::vector<std::string> overrides;  // what makes the manifest this layout (--set ...)
  std::string refused;                 // "" = planned and fits; else why not
  uint64_t most_bytes = 0;             // the rank that needs most: parameters, gradients, state, activations
  PerfEstimate estimate;
  std::string name() const;            // "tp 2 + SP x pp 2 (vpp 2) x dp 1"
};

struct LayoutSearch {
  int world = 1;
  std::vector<LayoutChoice> ranked;   // fastest first
  std::vector<LayoutChoice> refused;  // in enumeration order
  int profiles = 0;                   // compute measurements taken
};

// `progress` (may be empty) is told of each measurement before it runs. With `given`
// (a profile measured elsewhere) nothing is measured and only layouts of its tp and
// cp are considered (the others are listed as refused). `measure_blocks`: as
// measure_compute's `blocks`.
LayoutSearch search_layouts(const RunPlan& plan, int world, const LinkModel& links, int cores,
                            const std::function<void(const std::string&)>& progress = {},
                            const ComputeProfile* given = nullptr, int64_t measure_blocks = 0);

}  // namespace loom::train
