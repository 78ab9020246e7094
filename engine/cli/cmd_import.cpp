// loom import SOURCE MANIFEST OUTDIR [--set key=value]... [--plugin-path DIR]...
// A Hugging Face model directory (or a loom checkpoint of any layout) as a loom
// checkpoint of the manifest's model and parallel layout: OUTDIR/step_00000000, the
// weights read as checkpoint.init_weights reads them, the optimizer state fresh.
#include "engine/cli/args.hpp"
#include "engine/cli/commands.hpp"
#include "engine/files/temporaries.hpp"
#include "engine/interop/hf_config.hpp"
#include "engine/interop/hugging_face.hpp"
#include "engine/manifest/manifest.hpp"
#include "engine/plugins/registry.hpp"
#include "engine/train/checkpoint.hpp"
#include "engine/train/trainer.hpp"

#include <boost/filesystem.hpp>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iostream>

namespace loom::cli {
namespace {

const char* kUsage =
    "usage: loom import SOURCE MANIFEST OUTDIR [--set key=value]... [--plugin-path DIR]...\n"
    "       loom import SOURCE --write-manifest FILE [--seq-length N]\n"
    "Writes OUTDIR/step_00000000: a loom checkpoint of MANIFEST's model at its parallel layout\n"
    "(tp, pp, dp, cp, ep, dtype) holding SOURCE's weights, with a fresh optimizer state. SOURCE is\n"
    "a Hugging Face model directory (config.json + model.safetensors of GPT2LMHeadModel,\n"
    "LlamaForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM,\n"
    "Qwen3MoeForCausalLM,\n"
    "DeepseekV2ForCausalLM or DeepseekV3ForCausalLM) or a loom\n"
    "checkpoint of any layout, read as\n"
    "checkpoint.init_weights reads it; MANIFEST must describe the same model (what differs is named).\n"
    "Then: loom run MANIFEST --set checkpoint.dir=OUTDIR --resume  trains on from it (the same run\n"
    "as checkpoint.init_weights = SOURCE), and loom generate, eval and export read OUTDIR.\n"
    "OUTDIR must hold no checkpoint yet.\n"
    "--write-manifest writes FILE (- for standard output; an existing file is not replaced): a manifest\n"
    "of SOURCE's model as its config.json describes it (the layers, their options, the blocks'\n"
    "pattern, the rotary scaling; the tokenizer beside it as data.tokenizer), with a fine-tuning run\n"
    "of one CPU rank around it to edit (layout, batch, optimizer, data). --seq-length: the training\n"
    "sequence length (default: the model's context, at most 4096).\n";

// loom import SOURCE --write-manifest FILE: the manifest of SOURCE's model.
int write_manifest(const Args& args) {
  const auto& pos = args.positionals();
  if (pos.size() != 1) throw UsageError("import --write-manifest takes SOURCE only");
  const std::string file = *args.get("--write-manifest");
  if (file.empty()) throw UsageError("--write-manifest needs a file name");
  const int64_t seq = args.get_int("--seq-length", 0);
  if (args.has("--seq-length") && seq < 1) throw UsageError("--seq-length must be at least 1");
  const std::string text = interop::manifest_for_hf(pos[0], seq);
  if (file == "-") {
    std::cout << text;
    return 0;
  }
  if (boost::filesystem::exists(file))
    throw std::runtime_error(file + " exists; the manifest is not written over it (give a new name, or - for "
                             "standard output)");
  files::WholeFile out(file);
  {
    std::ofstream f(out.path(), out.mode());
    f << text;
    f.close();
    if (!f) throw std::runtime_error("cannot write " + file + ": " + std::strerror(errno));
  }
  if (!out.commit()) throw std::runtime_error("cannot write " + file + ": " + std::strerror(errno));
  std::cout << "wrote " << file << ": " << pos[0] << "'s model; edit its run (layout, batch, optimizer, data.path), "
            << "then: loom import " << shell_word(pos[0]) << " " << shell_word(file) << " OUTDIR\n";
  return 0;
}

// A path as the run's manifest must hold it: --set values are taken as written, so a
// relative one is made absolute here (the checkpoint's manifest.toml keeps it).
std::string absolute(const std::string& path) {
  boost::filesystem::path p = boost::filesystem::absolute(path).lexically_normal();
  while (p.filename() == "." && p.has_parent_path()) p = p.parent_path();  // "dir/" reads as "dir/."
  return p.string();
}

// A string as a TOML value (quotes, backslashes and control characters escaped).
std::string toml_string(const std::string& s) { return manifest::to_toml_text(toml::value<std::string>(s)); }

// A failed import leaves no OUTDIR of its own making: the run it starts makes the
// directory and its lock before the source is read.
struct MadeOutdir {
  std::string dir;
  bool existed = true, done = false;
  ~MadeOutdir() {
    namespace fs = boost::filesystem;
    boost::system::error_code ec;
    if (done || existed || dir.empty() || !fs::is_directory(dir, ec)) return;
    for (const auto& e : fs::directory_iterator(dir, ec))
      if (e.path().filename() != ".lock") return;  // something else was written: leave it
    fs::remove_all(dir, ec);
  }
};

}  // namespace

int cmd_import(int argc, char** argv) {
  MadeOutdir made;
  try {
    Args args(argc, argv, {}, {"--set", "--plugin-path", "--write-manifest", "--seq-length"});
    if (args.flag("--help")) {
      std::cout << kUsage;
      return 0;
    }
    if (args.has("--write-manifest")) return write_manifest(args);
    const auto& pos = args.positionals();
    if (pos.size() != 3) throw UsageError("import takes SOURCE, MANIFEST and OUTDIR");
    if (args.has("--seq-length")) throw UsageError("--seq-length goes with --write-manifest");
    for (const std::string& p : pos)
      if (p.empty()) throw UsageError("an empty path");
    const std::string source = absolute(pos[0]), out = absolute(pos[2]);
    if (!boost::filesystem::is_directory(source))
      throw std::runtime_error(pos[0] + " is not a directory (a Hugging Face model directory or a loom checkpoint)");
    // The checkpoint goes beside nothing of the source's: written into it, a Hugging
    // Face directory would hold a loom checkpoint too, which init_weights refuses.
    const boost::filesystem::path src(source), dst(out);
    if (dst == src || dst.string().rfind(src.string() + "/", 0) == 0)
      throw std::runtime_error(pos[2] + " is " + (dst == src ? "" : "inside ") + pos[0] +
                               ", the source; import into a directory of its own");
    if (const std::optional<int64_t> step = train::latest_checkpoint(out))
      throw std::runtime_error(pos[2] + " holds checkpoints already (the newest " +
                               train::checkpoint_path(pos[2], *step) + "); import into a new or empty directory");
    made.dir = out;
    made.existed = boost::filesystem::exists(out);
    plugins::Registry& registry = plugins::registry();
    registry.load_dirs(plugins::Registry::search_paths(args.all("--plugin-path")));
    std::vector<std::string> overrides = args.all("--set");
    // Last, so they win over the manifest's and the command line's own.
    overrides.insert(overrides.end(), {"checkpoint.init_weights=" + toml_string(source),
                                       "checkpoint.dir=" + toml_string(out), "checkpoint.keep_last=0"});
    const train::RunPlan plan = train::make_plan(manifest::Manifest::load(pos[1], overrides), registry);
    train::TrainOptions opts;
    opts.save_start_only = true;
    opts.log = &std::cout;
    opts.read_init_weights = [&](int64_t vocab) {
      return interop::read_initial_weights(source, plan, vocab, registry, "SOURCE " + pos[0]);
    };
    const train::TrainResult r = train::train(plan, opts);
    made.done = true;
    std::cout << "import: " << pos[0] << " -> " << r.checkpoint << " (world " << plan.sizes.world << ": tp "
              << plan.sizes.tp << ", pp " << plan.sizes.pp << ", dp " << plan.dp << ", cp " << plan.sizes.cp << ", ep "
              << plan.sizes.ep << "; " << plan.config.device.param_dtype << ")\n"
              << "next: loom run " << shell_word(pos[1]);
    for (const std::string& set : args.all("--set")) std::cout << " --set " << shell_word(set);
    std::cout << " --set " << shell_word("checkpoint.dir=" + toml_string(out)) << " --resume\n";
    return 0;
  } catch (const UsageError& e) {
    std::cerr << "loom import: " << e.what() << "\n" << kUsage;
    return 2;
  } catch (const manifest::ManifestError& e) {
    std::cerr << "loom import: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "loom import: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace loom::cli
