// loom run MANIFEST [--set key=value]... [--resume] [--metrics FILE] [--json]
#include "engine/cli/args.hpp"
#include "engine/files/temporaries.hpp"
#include "engine/interop/hugging_face.hpp"
#include "engine/cli/commands.hpp"
#include "engine/train/checkpoint.hpp"
#include "engine/train/data.hpp"
#include "engine/train/trainer.hpp"
#include "engine/plugins/registry.hpp"
#include "engine/runtime/launcher.hpp"

#include <boost/filesystem.hpp>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <iomanip>
#include <iostream>

namespace loom::cli {
namespace {

std::atomic<int> g_stop{0};
std::atomic<bool> g_under_launcher{false};  // set before the handlers are installed
std::atomic<bool> g_stepped{false};  // a training step of this process has finished
// The first signal asks every rank to stop after its current step (a step can take
// minutes, so it says so at once); a second one ends the process without waiting,
// for a step that cannot finish. Before this process has finished a step there is
// nothing new to save, and starting up may block where no flag is looked at (a file
// system that hangs): the first signal stops at once; not under mpirun/srun, where a
// process that has finished its first step would wait for one that left (the flag is
// agreed on after the step). Only async-signal-safe calls here.
extern "C" void on_signal(int sig) {
  if (!g_stepped.load() && !g_under_launcher.load()) {
    static const char kEarly[] =
        "\nloom run: signal received before the first step finished: nothing new to save; stopping now\n";
    [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, kEarly, sizeof kEarly - 1);
    files::remove_temporaries();
    ::_exit(130);
  }
  if (g_stop.exchange(1) == 0) {
    static const char kFirst[] =
        "\nloom run: signal received: stopping after the current step (and writing a checkpoint when "
        "checkpoint.dir is set); signal again to stop at once without one\n";
    // mpirun turns a Ctrl-C into SIGTERM and kills the ranks soon after: only its
    // forwarded SIGUSR1 leaves them the time to finish the step and save.
    static const char kUnderLauncher[] =
        "\nloom run: SIGINT/SIGTERM received under mpirun/srun: stopping after the current step, but the "
        "launcher may kill this rank first (no checkpoint then); send SIGUSR1 to mpirun to stop with one\n";
    const bool warn = g_under_launcher.load() && sig != SIGUSR1;
    [[maybe_unused]] ssize_t n = warn ? ::write(STDERR_FILENO, kUnderLauncher, sizeof kUnderLauncher - 1)
                                      : ::write(STDERR_FILENO, kFirst, sizeof kFirst - 1);
    return;
  }
  static const char kSecond[] = "loom run: second signal: stopping now, without a checkpoint\n";
  [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, kSecond, sizeof kSecond - 1);
  files::remove_temporaries();  // a trace or metrics file being written: not left half done
  ::_exit(130);
}

const char* kUsage =
    "usage: loom run MANIFEST [--set key.path=value]... [--resume | --resume-if-any] [--metrics FILE]\n"
    "                [--tensorboard DIR] [--trace FILE]\n"
    "  --set       override a manifest value (TOML value, or a bare word as a string); repeatable\n"
    "  --resume    continue from the latest complete checkpoint in checkpoint.dir\n"
    "  --resume-if-any  the same, or start the run when checkpoint.dir holds none yet (one command line for\n"
    "              every job of a chain, with run.exit_duration_minutes or run.exit_interval)\n"
    "  --metrics   write one JSON object per step to FILE (and one of step and val_* of an evaluation\n"
    "              a stop cut short, after --resume)\n"
    "  --tensorboard  write every step's scalars to a new TensorBoard event file in DIR (run.tensorboard_dir;\n"
    "              Megatron-LM's tags: \"lm loss\", \"learning-rate\", \"grad-norm\", \"lm loss validation\", ...)\n"
    "  --trace     write every rank's real timeline (forward/backward per microbatch and chunk, p2p, collectives,\n"
    "              optimizer) to FILE as a Chrome trace, viewable in Perfetto (under mpirun/srun each\n"
    "              process writes FILE.rankN)\n"
    "SIGINT/SIGTERM/SIGUSR1 stop every rank after the current step, write a checkpoint (when checkpoint.dir is set)\nand exit 130; a second signal stops at once, without a checkpoint, as does the first before a step has finished (not under mpirun/srun, where every rank stops after a step). Under mpirun send SIGUSR1 to mpirun (it forwards it; Ctrl-C gives ranks only a second).\n";

// What loading the plugins went wrong, on stderr once: a library that failed to load
// or a search path that does not exist is a warning (the run may not need it). A
// kind/name found in two files is not among them: the plan refuses it.
void report_plugin_loading() {
  static bool reported = false;
  if (reported) return;
  reported = true;
  const plugins::Registry& r = plugins::registry();
  constexpr size_t kShown = 20;  // a directory of broken files says so without a line for each
  size_t warnings = 0;
  for (const std::string& e : r.load_errors())
    if (std::find(r.duplicate_errors().begin(), r.duplicate_errors().end(), e) == r.duplicate_errors().end() &&
        ++warnings <= kShown)
      std::cerr << "loom run: warning: " << e << "\n";
  if (warnings > kShown)
    std::cerr << "loom run: warning: " << warnings - kShown << " more libraries failed to load (loom plugins check DIR "
              << "lists each)\n";
}

// Under mpirun/srun a process may be the only one to fail (a file missing on its node,
// another command line), so every process says why it stopped, naming its rank.
std::string process_prefix() {
  const runtime::ProcessLaunch proc = runtime::detect_process_launch();
  if (!proc.multi_process) return "";
  return "[process " + std::to_string(proc.rank) + " of " + std::to_string(proc.world_size) + "] ";
}

}  // namespace

int cmd_run(int argc, char** argv) {
  try {
    Args args(argc, argv, {"--resume", "--resume-if-any"}, {"--set", "--metrics", "--trace", "--tensorboard"});
    if (args.flag("--help")) {
      std::cout << kUsage;
      return 0;
    }
    if (args.positionals().size() != 1) throw UsageError("run takes one MANIFEST");
    // From here on a stop signal is honoured: at once until a step has finished
    // (planning, loading plugins and a checkpoint take a while), after the current
    // step from then on.
    // SIGUSR1 too: mpirun forwards it to every rank (SIGINT becomes SIGTERM there,
    // followed by SIGKILL a second later), and Slurm sends it ahead of a time limit
    // (sbatch --signal=USR1@120).
    g_under_launcher = runtime::detect_process_launch().multi_process;
    struct StopSignals {
      StopSignals() {
        for (int sig : {SIGINT, SIGTERM, SIGUSR1}) std::signal(sig, on_signal);
      }
      // SIGUSR1 asks for a checkpoint and a stop: once training has ended there is
      // nothing to do (a late one from mpirun or Slurm must not end the finished
      // process with status 138 while it prints its summary and exits).
      void training_ended() {
        for (int sig : {SIGINT, SIGTERM}) std::signal(sig, SIG_DFL);
        std::signal(SIGUSR1, SIG_IGN);
      }
      ~StopSignals() { training_ended(); }
    } stop_signals;
    train::RunPlan plan =
        train::make_plan(manifest::Manifest::load(args.positionals()[0], args.all("--set")), plugins::registry());
    report_plugin_loading();
    // Under mpirun/srun this process hosts one rank; only global rank 0 prints the
    // step log and writes --metrics (checkpoints: every rank writes its own file,
    // rank 0 commits).
    const runtime::ProcessLaunch proc = runtime::detect_process_launch();
    if (proc.rank == 0)
      for (const std::string& w : plan.warnings) std::cerr << "loom run: warning: " << w << "\n";
    const bool leader = !proc.multi_process || proc.rank == 0;
    train::TrainOptions opts;
    if (args.flag("--resume") && args.flag("--resume-if-any"))
      throw UsageError("--resume and --resume-if-any are alternatives: --resume refuses a checkpoint.dir without a "
                       "checkpoint, --resume-if-any starts the run there");
    opts.start_without_checkpoint = args.flag("--resume-if-any");
    opts.resume = args.flag("--resume") || opts.start_without_checkpoint;
    // checkpoint.init_weights: a loom checkpoint of any layout, or a Hugging Face directory.
    opts.read_init_weights = [&plan](int64_t vocab) {
      return interop::read_initial_weights(plan.config.checkpoint.init_weights, plan, vocab, plugins::registry());
    };
    opts.metrics_file = args.get("--metrics").value_or(plan.config.run.metrics_file);
    if (args.has("--metrics") && opts.metrics_file.empty()) throw UsageError("--metrics needs a file name");
    opts.tensorboard_dir = args.get("--tensorboard").value_or(plan.config.run.tensorboard_dir);
    if (args.has("--tensorboard") && opts.tensorboard_dir.empty())
      throw UsageError("--tensorboard needs a directory");
    opts.log = &std::cout;
    opts.trace_file = args.get("--trace").value_or("");
    if (args.has("--trace") && opts.trace_file.empty()) throw UsageError("--trace needs a file name");
    boost::system::error_code ec;
    if (!opts.trace_file.empty() && !opts.metrics_file.empty() &&
        boost::filesystem::weakly_canonical(opts.trace_file, ec) ==
            boost::filesystem::weakly_canonical(opts.metrics_file, ec))
      throw UsageError("--trace and the metrics file are both " + opts.trace_file + "; one would overwrite the other");
    // One process per rank: each writes its own rank's timeline beside the others.
    if (proc.multi_process && !opts.trace_file.empty()) opts.trace_file += ".rank" + std::to_string(proc.rank);
    if (!leader) {
      opts.metrics_file.clear();
      opts.tensorboard_dir.clear();
      opts.log = nullptr;
    }
    opts.stop_signal = &g_stop;
    opts.stepped = &g_stepped;
    train::TrainResult r = train::train(plan, opts);
    stop_signals.training_ended();

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
      // A training step's communication (the last one evaluation did not add to).
      for (auto it = r.steps.rbegin(); it != r.steps.rend(); ++it)
        if (!it->evaluated || it == r.steps.rend() - 1) {
          std::cout << runtime::comm_stats_summary(it->comm, "comm in step " + std::to_string(it->step) + " (rank 0)")
                    << "\n";
          break;
        }
      if (auto it = r.exec_stats.find(0); it != r.exec_stats.end())
        std::cout << "exec " << plan.exec->name << " (rank 0): " << it->second.graphs << " graphs captured, "
                  << it->second.replays << " layer steps replayed, " << it->second.direct << " run directly\n";
      if (plan.sizes.pp > 1) {  // the schedule's activation cost, per pipeline rank
        std::cout << "pipeline: peak microbatch-chunks in flight (activation memory) by rank:";
        for (const auto& [rank, n] : r.peak_in_flight)
          std::cout << " " << rank << ": " << n << " (" << std::setprecision(1)
                    << r.peak_activation_bytes[rank] / (1024.0 * 1024.0) << " MiB)";
        std::cout << "\n";
      }
    }
    if (!opts.trace_file.empty() && leader) std::cout << "trace: " << opts.trace_file << "\n";
    if (!r.checkpoint.empty()) std::cout << "checkpoint: " << r.checkpoint << "\n";
    if (r.interrupted) {
      if (plan.config.checkpoint.dir.empty())
        std::cout << "interrupted: stopped after step " << r.final_step
                  << "; no checkpoint was written (checkpoint.dir is not set), so --resume cannot continue it\n";
      else
        std::cout << "interrupted: stopped after step " << r.final_step << "; resume with --resume\n";
      return 130;
    }
    if (!r.exit_reason.empty()) {  // a planned stop (a job's time slot): the job did what it was asked
      std::cout << "exit: stopped after step " << r.final_step << " of " << r.end_step << " as "
                << r.exit_reason << " asks"
                << (plan.config.checkpoint.dir.empty() ? "; no checkpoint was written (checkpoint.dir is not set)"
                                                       : "; resume with --resume")
                << "\n";
    }
    return 0;
  } catch (const UsageError& e) {
    std::cerr << "loom run: " << e.what() << "\n" << kUsage;
    return 2;
  } catch (const manifest::ManifestError& e) {
    report_plugin_loading();  // often why a plugin the manifest names is missing
    std::cerr << process_prefix() << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    report_plugin_loading();
    std::cerr << process_prefix() << "loom run: " << runtime::error_message(e) << "\n";
    return 1;
  }
}

}  // namespace loom::cli
