#include "engine/train/layout_search.hpp"

#include "engine/runtime/launcher.hpp"
#include "engine/train/memory_plan.hpp"
#include "engine/train/preflight.hpp"

#include <algorithm>
#include <map>
#include <tuple>

namespace loom::train {

namespace {

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

// A candidate's settings over the manifest's: its sizes, 1F1B (interleaved with virtual
// stages) for every candidate alike, and an even pipeline split but where it has the
// manifest's own pipeline (pp and vpp), whose split (uneven first and last chunks) it keeps.
std::vector<std::string> layout_overrides(const LayoutChoice& c, const RunPlan& plan) {
  std::vector<std::string> sets = {"parallel.tp=" + std::to_string(c.tp), "parallel.cp=" + std::to_string(c.cp),
                                   "parallel.pp=" + std::to_string(c.pp), "parallel.dp=" + std::to_string(c.dp),
                                   "parallel.vpp=" + std::to_string(c.vpp),
                                   std::string("parallel.sequence_parallel=") + (c.sp ? "true" : "false")};
  sets.push_back(c.vpp > 1 ? "pipeline.schedule=\"interleaved\"" : "pipeline.schedule=\"1f1b\"");
  if (c.pp != plan.sizes.pp || c.vpp != plan.config.parallel.vpp)
    sets.insert(sets.end(), {"pipeline.first_chunk_layers=0", "pipeline.last_chunk_layers=0", "pipeline.chunk_layers=[]"});
  return sets;
}

// The first line of a refusal (make_plan reports every problem; one says enough here).
std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

}  // namespace

std::string LayoutChoice::name() const {
  std::string n = "tp " + std::to_string(tp) + (sp ? " + SP" : "");
  if (cp > 1) n += " x cp " + std::to_string(cp);
  n += " x pp " + std::to_string(pp);
  if (vpp > 1) n += " (vpp " + std::to_string(vpp) + ")";
  return n + " x dp " + std::to_string(dp);
}

LayoutSearch search_layouts(const RunPlan& plan, int world, const LinkModel& links, int cores,
                            const std::function<void(const std::string&)>& progress, const ComputeProfile* given,
                            int64_t measure_blocks) {
  LayoutSearch out;
  out.world = world;
  // By (tp, cp, sp, blocks recomputed): one measurement serves every pipeline split with
  // the same share of its blocks recomputed.
  std::map<std::tuple<int, int, bool, int64_t>, ComputeProfile> profiles;
  std::map<std::tuple<int, int, bool, int64_t>, std::string> unmeasurable;  // why measuring failed
  auto consider = [&](LayoutChoice c) {
    c.overrides = layout_overrides(c, plan);
    try {
      if (given != nullptr && (given->tp != c.tp || given->cp != c.cp))
        throw loom::Error("--profile was measured at tp " + std::to_string(given->tp) + ", cp " +
                          std::to_string(given->cp));
      const RunPlan p = replan(plan, c.overrides);
      const Preflight checked = preflight(p, world);
      for (const RankMemory& r : checked.memory.ranks) c.most_bytes = std::max(c.most_bytes, rank_total_bytes(r));
      if (!checked.memory_problem.empty()) throw loom::Error(checked.memory_problem);
      const std::tuple<int, int, bool, int64_t> key{c.tp, c.cp, c.sp, recomputed_blocks(p)};
      auto it = profiles.find(key);
      if (it == profiles.end() && given != nullptr) it = profiles.emplace(key, *given).first;
      if (auto f = unmeasurable.find(key); it == profiles.end() && f != unmeasurable.end()) throw loom::Error(f->second);
      if (it == profiles.end()) {
        if (progress)
          progress("measuring compute at tp " + std::to_string(c.tp) + (c.sp ? " + SP" : "") + ", cp " +
                   std::to_string(c.cp));
        try {
          it = profiles.emplace(key, measure_compute(p, threads_per_rank(p, cores), measure_blocks)).first;
        } catch (const loom::Error& e) {  // the same for every layout of this key: measured once
          unmeasurable.emplace(key, e.what());
          throw;
        }
        ++out.profiles;
      }
      c.estimate = estimate_step(p, checked.memory, it->second, links, cores);
      out.ranked.push_back(std::move(c));
    } catch (const manifest::ManifestError& e) {
      const std::vector<manifest::Diagnostic>& d = e.diagnostics();
      // The message names its key, as a rule: the key only when it does not.
      const std::string message = d.empty() ? first_line(e.what()) : first_line(d.front().message);
      c.refused = d.empty() || message.rfind(d.front().key, 0) == 0 ? message : d.front().key + ": " + message;
      out.refused.push_back(std::move(c));
    } catch (const std::exception& e) {
      c.refused = first_line(runtime::error_message(e));
      out.refused.push_back(std::move(c));
    }
  };
  std::vector<LayoutChoice> candidates;
  for (const int tp : divisors(world))
    for (const int cp : divisors(world / tp))
      for (const int pp : divisors(world / (tp * cp)))
        for (const bool sp : tp > 1 ? std::vector<bool>{false, true} : std::vector<bool>{false})
          for (const int vpp : pp > 1 ? std::vector<int>{1, 2} : std::vector<int>{1}) {
            LayoutChoice c;
            c.tp = tp;
            c.cp = cp;
            c.pp = pp;
            c.dp = world / (tp * cp * pp);
            c.vpp = vpp;
            c.sp = sp;
            candidates.push_back(c);
          }
  // A world of many divisors has many layouts (720720: about 330,000), each planned:
  // say how far it is.
  const size_t step = std::max<size_t>(1000, candidates.size() / 10);
  if (progress && candidates.size() >= step)
    progress("planning " + std::to_string(candidates.size()) + " layouts of " + std::to_string(world) + " ranks");
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (progress && i > 0 && i % step == 0)
      progress("planned " + std::to_string(i) + " of " + std::to_string(candidates.size()) + " layouts");
    consider(std::move(candidates[i]));
  }
  std::stable_sort(out.ranked.begin(), out.ranked.end(), [](const LayoutChoice& a, const LayoutChoice& b) {
    return a.estimate.step_s < b.estimate.step_s;
  });
  return out;
}

}  // namespace loom::train
