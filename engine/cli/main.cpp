// loom: run, validate and explain training runs.
#include "engine/cli/commands.hpp"
#include "engine/cli/interrupt.hpp"
#include "engine/plugins/registry.hpp"

#include <glog/logging.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <optional>
#include <iostream>
#include <string>

namespace {

struct Command {
  const char* name;
  int (*fn)(int, char**);
  const char* summary;
  // run, generate and serve stop in good order on SIGINT/SIGTERM (after a step, a token);
  // the others end at once, saying so, without half-written files (ExitOnSignal).
  bool own_signals = false;
};

const Command kCommands[] = {
    {"run", loom::cli::cmd_run, "train: loom run MANIFEST [--set key=value]... [--resume | --resume-if-any] [--metrics FILE]", true},
    {"validate", loom::cli::cmd_validate, "check a manifest and print the resolved values and the plan"},
    {"plugins", loom::cli::cmd_plugins, "list, describe, check or test plugins: loom plugins list|info NAME|check DIR|test LIB"},
    {"plan", loom::cli::cmd_plan, "memory per rank without running (params, grads, optimizer state, activations); --perf: step time, --search: layouts ranked"},
    {"optimizer-layout", loom::cli::cmd_optimizer_layout,
     "the distributed optimizer's buffer layout and dp shards: --param-numels 3,5,4,4 --dp 2"},
    {"groups", loom::cli::cmd_groups, "print the rank groups of a parallel layout"},
    {"schedule", loom::cli::cmd_schedule, "print, check and simulate a pipeline schedule: --pp P --microbatches M [--vpp V]"},
    {"preprocess", loom::cli::cmd_preprocess,
     "text or JSONL to token files (Megatron .bin/.idx or llm.c .bin): --tokenizer DIR --input F --output-prefix P"},
    {"tokenize", loom::cli::cmd_tokenize, "encode text to token ids, or decode ids: --tokenizer DIR|MODEL --text TEXT"},
    {"export", loom::cli::cmd_export,
     "a checkpoint (any parallel layout) as a Hugging Face model: CHECKPOINT --format hf OUTDIR"},
    {"import", loom::cli::cmd_import,
     "a Hugging Face model (or a checkpoint) as a checkpoint of a manifest's layout: SOURCE MANIFEST OUTDIR"},
    {"generate", loom::cli::cmd_generate,
     "text from a trained model, with a key/value cache: CHECKPOINT --prompt TEXT [--temperature T] [--top-k K]", true},
    {"serve", loom::cli::cmd_serve,
     "an HTTP server of a trained model: OpenAI completions and chat completions, Megatron's PUT /api", true},
    {"eval", loom::cli::cmd_eval,
     "perplexity (sliding windows) or LAMBADA last-word accuracy: CHECKPOINT --data FILE [--task lambada]"},
    {"inspect", loom::cli::cmd_inspect,
     "what a checkpoint holds: step, samples read, the layout that saved it, its layers' state: CHECKPOINT [--json]"},
    {"tokenizer-train", loom::cli::cmd_tokenizer_train,
     "train a SentencePiece model: --input F --model-prefix P --vocab-size N"},
};

void usage(std::ostream& os) {
  os << "usage: loom <command> [options]   (loom <command> --help for details)\n\ncommands:\n";
  for (const Command& c : kCommands)
    os << "  " << c.name << std::string(std::max<size_t>(2, 18 - std::strlen(c.name)), ' ') << c.summary << "\n";
}

// A command's printed result that could not be written (a full disk, a closed pipe)
// is a failure, not a success with nothing to show.
int finish_output(int status, const std::string& label) {
  errno = 0;
  std::cout.flush();
  if (std::cout.good() && std::fflush(stdout) == 0) return status;
  const int err = errno;
  std::cerr << label << ": could not write the output to stdout" << (err != 0 ? std::string(": ") + std::strerror(err) : "")
            << "\n";
  return status == 0 ? 1 : status;
}

}  // namespace

int main(int argc, char** argv) {
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  if (const char* v = std::getenv("LOOM_LOG_LEVEL")) FLAGS_minloglevel = std::atoi(v);
  else FLAGS_minloglevel = google::GLOG_WARNING;  // the CLI prints its own progress lines
  loom::plugins::host_api();
  // A file-size limit (ulimit -f) makes a write fail with EFBIG, which every writer
  // reports as a failed write (a checkpoint, the metrics), instead of killing the
  // process without a word.
  std::signal(SIGXFSZ, SIG_IGN);

  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    usage(argc < 2 ? std::cerr : std::cout);
    return argc < 2 ? 2 : 0;
  }
  if (std::strcmp(argv[1], "--version") == 0) {
    std::cout << "loom " << LOOM_VERSION << " (plugin ABI " << LOOM_ABI_MAJOR << "." << LOOM_ABI_MINOR << ")\n";
    return 0;
  }
  for (const Command& c : kCommands) {
    if (std::strcmp(argv[1], c.name) != 0) continue;
    static const std::string label = std::string("loom ") + c.name;  // outlives the handler
    std::optional<loom::cli::ExitOnSignal> stop;
    if (!c.own_signals) stop.emplace(label.c_str());
    return finish_output(c.fn(argc - 2, argv + 2), label);
  }
  std::cerr << "loom: unknown command '" << argv[1] << "'\n";
  usage(std::cerr);
  return 2;
}
