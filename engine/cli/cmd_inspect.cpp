// loom inspect CHECKPOINT [--json]
// What a checkpoint holds without loading the model: its step and the training samples
// read, the layout and settings that saved it, and its layers' state (ABI 1.23: the MoE
// expert biases and the load that last moved them), every file it reads checked.
#include "engine/cli/args.hpp"
#include "engine/cli/commands.hpp"
#include "engine/cli/model_source.hpp"
#include "engine/runtime/json.hpp"
#include "engine/train/checkpoint.hpp"

#include <iomanip>
#include <iostream>
#include <sstream>

namespace loom::cli {
namespace {

const char* kUsage =
    "usage: loom inspect CHECKPOINT [--json]\n"
    "Prints what a checkpoint holds: its step and the training samples read by then, the\n"
    "parallel layout, optimizer strategy and parameter dtype that saved it, and its layers'\n"
    "state outside the parameters (e.g. layer/moe's router.expert_bias and the load that last\n"
    "moved it), each array's values (the first 16; --json: all). CHECKPOINT is a step_N\n"
    "directory or a checkpoint.dir (its newest complete step). The files read are checked as a\n"
    "resume checks them (exit 1 when one is damaged).\n";

std::string values_text(const std::vector<float>& v) {
  constexpr size_t kShown = 16;
  std::ostringstream os;
  os << std::setprecision(6);
  for (size_t i = 0; i < v.size() && i < kShown; ++i) os << (i ? " " : "") << v[i];
  if (v.size() > kShown) os << " ... (" << v.size() - kShown << " more)";
  return os.str();
}

}  // namespace

int cmd_inspect(int argc, char** argv) {
  try {
    Args args(argc, argv, {"--json"}, {});
    if (args.flag("--help")) {
      std::cout << kUsage;
      return 0;
    }
    const auto& pos = args.positionals();
    if (pos.size() != 1) throw UsageError("inspect takes one CHECKPOINT");
    const std::string step = checkpoint_step_dir(pos[0], "inspecting");
    const train::CheckpointMeta m = train::read_meta(step);
    const model::StateValues states = train::read_layer_states(step);
    const int64_t samples = m.consumed_samples;  // -1: not recorded
    if (args.flag("--json")) {
      nlohmann::ordered_json state = nlohmann::ordered_json::object();
      for (const auto& [name, v] : states) state[name] = v;
      std::cout << runtime::dump_json({{"checkpoint", step},
                                       {"step", m.step},
                                       {"consumed_samples", samples},
                                       {"world", m.world},
                                       {"tp", m.tp},
                                       {"cp", m.cp},
                                       {"pp", m.pp},
                                       {"dp", m.dp},
                                       {"ep", m.ep},
                                       {"etp", m.expert_tp()},
                                       {"order", m.order},
                                       {"strategy", m.strategy},
                                       {"param_dtype", m.param_dtype},
                                       {"vocab", m.vocab},
                                       {"evaluation_pending", m.evaluation_pending},
                                       {"layer_state", state}})
                << "\n";
      return 0;
    }
    std::cout << "checkpoint " << step << ": step " << m.step;
    if (samples >= 0) std::cout << ", " << samples << " training samples read";
    if (m.evaluation_pending) std::cout << " (its evaluation was cut short: a resume runs it first)";
    std::cout << "\nsaved by: world " << m.world << " = tp " << m.tp << " x cp " << m.cp << " x pp " << m.pp << " x dp "
              << m.dp << " (ep " << m.ep << ", etp " << m.expert_tp() << ", order " << m.order << "), optimizer "
              << m.strategy << ", parameters " << m.param_dtype;
    if (m.vocab > 0) std::cout << ", vocabulary " << m.vocab;
    std::cout << "\n";
    if (states.empty()) {
      std::cout << "layer state: none\n";
      return 0;
    }
    std::cout << "layer state (" << m.state_ranks.size() << (m.state_ranks.size() == 1 ? " file" : " files") << "):\n";
    size_t width = 0;
    for (const auto& [name, v] : states) width = std::max(width, name.size());
    for (const auto& [name, v] : states)
      std::cout << "  " << std::left << std::setw(static_cast<int>(width)) << name << "  [" << v.size() << "]  "
                << values_text(v) << "\n";
    return 0;
  } catch (const UsageError& e) {
    std::cerr << "loom inspect: " << e.what() << "\n" << kUsage;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "loom inspect: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace loom::cli
