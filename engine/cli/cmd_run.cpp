// loom run MANIFEST [--set key=value]... [--resume] [--metrics FILE] [--json]
#include "engine/cli/args.hpp"
#include "engine/cli/commands.hpp"
#include "engine/train/checkpoint.hpp"
#include "engine/train/data.hpp"
#include "engine/train/trainer.hpp"
#include "engine/runtime/launcher.hpp"

#include <atomic>
#include <csignal>
#include <iomanip>
#include <iostream>

namespace loom::cli {
namespace {

std::atomic<int> g_stop{0};
extern "C" void on_signal(int) { g_stop.store(1); }

const char* kUsage =
    "usage: loom run MANIFEST [--set key.path=value]... [--resume] [--metrics FILE]\n"
    "  --set       override a manifest value (TOML value, or a bare word as a string); repeatable\n"
    "  --resume    continue from the latest complete checkpoint in checkpoint.dir\n"
    "  --metrics   write one JSON object per step to FILE\n"
    "SIGINT/SIGTERM stop after the current step, write a checkpoint (when checkpoint.dir is set) and exit 130.\n";

}  // namespace

int cmd_run(int argc, char** argv) {
  try {
    Args args(argc, argv, {"--resume"}, {"--set", "--metrics"});
    if (args.flag("--help")) {
      std::cout << kUsage;
      return 0;
    }
    if (args.positionals().size() != 1) throw UsageError("run takes one MANIFEST");
    train::RunPlan plan =
        train::make_plan(manifest::Manifest::load(args.positionals()[0], args.all("--set")), plugins::registry());
    train::TrainOptions opts;
    opts.resume = args.flag("--resume");
    opts.metrics_file = args.get("--metrics").value_or(plan.manifest.get_string("run.metrics_file"));
    opts.log = &std::cout;
    opts.stop_signal = &g_stop;
    std::signal(SIGINT, on_signal);
    std::signal(SIGTERM, on_signal);
    train::TrainResult r = train::train(plan, opts);
    std::signal(SIGINT, SIG_DFL);
    std::signal(SIGTERM, SIG_DFL);

    if (!r.steps.empty()) {
      const train::StepRecord& first = r.steps.front();
      const train::StepRecord& last = r.steps.back();
      double ms = 0;
      for (const auto& s : r.steps) ms += s.ms;
      std::cout << std::fixed << std::setprecision(4) << "summary: steps " << r.start_step + 1 << ".." << r.final_step
                << " | loss " << first.loss << " -> " << last.loss << std::setprecision(1) << " | mean "
                << ms / r.steps.size() << " ms/step | peak memory (rank 0) " << last.mem_peak / (1024.0 * 1024.0) << " MiB";
      for (auto it = r.steps.rbegin(); it != r.steps.rend(); ++it)
        if (it->evaluated) {
          std::cout << std::setprecision(4) << " | val loss " << it->val_loss;
          if (it->exact_match >= 0) std::cout << std::setprecision(1) << " | val exact-match " << 100 * it->exact_match << "%";
          break;
        }
      std::cout << "\n";
    }
    if (!r.checkpoint.empty()) std::cout << "checkpoint: " << r.checkpoint << "\n";
    if (r.interrupted) {
      std::cout << "interrupted: stopped after step " << r.final_step << "; resume with --resume\n";
      return 130;
    }
    return 0;
  } catch (const UsageError& e) {
    std::cerr << "loom run: " << e.what() << "\n" << kUsage;
    return 2;
  } catch (const manifest::ManifestError& e) {
    std::cerr << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "loom run: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace loom::cli
