// loom export CHECKPOINT --format hf OUTDIR [--plugin-path DIR]...
// A checkpoint (a step_N directory, or a checkpoint.dir whose newest complete step is
// taken), from any parallel layout, as a Hugging Face transformers model directory.
#include "engine/cli/args.hpp"
#include "engine/cli/commands.hpp"
#include "engine/cli/model_source.hpp"
#include "engine/files/read.hpp"
#include "engine/interop/hugging_face.hpp"
#include "engine/manifest/manifest.hpp"
#include "engine/train/checkpoint.hpp"

#include <boost/filesystem.hpp>

#include <cstdint>
#include <iostream>

namespace loom::cli {
namespace {

const char* kUsage =
    "usage: loom export CHECKPOINT --format hf OUTDIR [--tokenizer DIR|MODEL] [--max-shard-size SIZE]\n"
    "                   [--plugin-path DIR]...\n"
    "Writes OUTDIR/model.safetensors and OUTDIR/config.json, loadable by transformers'\n"
    "GPT2LMHeadModel (GPT-2 blocks), LlamaForCausalLM (RMSNorm, SwiGLU, RoPE, no biases) or\n"
    "MixtralForCausalLM (the same with top-k SwiGLU expert blocks), and with the attention's\n"
    "qk_norm Qwen3ForCausalLM or Qwen3MoeForCausalLM, with add_qkv_bias Qwen2ForCausalLM or\n"
    "Qwen2MoeForCausalLM,\n"
    "with multi_latent_attention\n"
    "DeepseekV3ForCausalLM (sigmoid router) or DeepseekV2ForCausalLM (softmax router),\n"
    "from a checkpoint of any parallel layout. CHECKPOINT is a step_N directory or a\n"
    "checkpoint.dir (its newest complete step). --tokenizer (the GPT-2 BPE directory, tokenizer.json or\n"
    "SentencePiece model the data was encoded with) adds the tokenizer files AutoTokenizer reads:\n"
    "vocab.json and merges.txt, tokenizer.json, or tokenizer.model, with tokenizer_config.json and\n"
    "special_tokens_map.json;\n"
    "without it, the run's data.tokenizer when it names one. Weights above --max-shard-size (default\n"
    "5GB, as save_pretrained) go in shards with model.safetensors.index.json.\n";

// The tokenizer a checkpoint's run named (data.tokenizer), when it loads from here;
// "" otherwise (said on stderr when named but not found).
std::string trained_tokenizer(const std::string& step) {
  const std::string saved = step + "/manifest.toml";
  const std::optional<std::string> text = files::read_whole_file(saved);
  if (!text) return "";
  const std::string path = manifest::Manifest::parse(*text, saved, {}, manifest::Manifest::Launch::Other)
                               .get_string("data.tokenizer");
  if (path.empty() || boost::filesystem::exists(path)) return path;
  std::cerr << "loom export: warning: the model was trained with data.tokenizer = " << path
            << ", not found from here; exporting without tokenizer files (give --tokenizer)\n";
  return "";
}

// "5GB", "500MB", "64KB" (powers of 1000, as save_pretrained's max_shard_size) or bytes.
uint64_t parse_size(const std::string& text) {
  size_t used = 0;
  unsigned long long n = 0;
  try {
    n = std::stoull(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string unit = text.substr(used);
  const uint64_t scale = unit.empty() || unit == "B" ? 1 : unit == "KB" ? 1000 : unit == "MB" ? 1000000
                         : unit == "GB" ? 1000000000 : 0;
  if (used == 0 || scale == 0 || n == 0 || text[0] == '-' || n > UINT64_MAX / scale)
    throw UsageError("--max-shard-size " + text + ": give a size such as 5GB, 500MB, 64KB or a number of bytes");
  return n * scale;
}

}  // namespace

int cmd_export(int argc, char** argv) {
  try {
    Args args(argc, argv, {}, {"--format", "--plugin-path", "--tokenizer", "--max-shard-size"});
    if (args.flag("--help")) {
      std::cout << kUsage;
      return 0;
    }
    const auto& pos = args.positionals();
    if (pos.size() != 2) throw UsageError("export takes CHECKPOINT and OUTDIR");
    if (args.get("--format").value_or("") != "hf") throw UsageError("--format hf is the one format (Hugging Face)");
    if (pos[1].empty()) throw UsageError("OUTDIR is empty");
    plugins::Registry& r = plugins::registry();
    r.load_dirs(plugins::Registry::search_paths(args.all("--plugin-path")));
    const std::string step = checkpoint_step_dir(pos[0], "exporting");
    const std::optional<std::string> given = args.get("--tokenizer");
    const std::string tokenizer = given ? *given : trained_tokenizer(step);
    const uint64_t shard = args.has("--max-shard-size") ? parse_size(*args.get("--max-shard-size"))
                                                        : interop::kHfMaxShardBytes;
    const interop::HfModel hf = interop::export_hf(step, pos[1], r, tokenizer, shard);
    size_t bytes = 0;
    for (const auto& t : hf.tensors) bytes += t.data.size();
    std::cout << "export: " << step << " -> " << pos[1] << " (" << hf.architecture << ", " << hf.tensors.size()
              << " tensors, " << bytes / (1024 * 1024) << " MiB";
    for (const std::string& f : hf.files) std::cout << (f == hf.files.front() ? "; tokenizer: " : ", ") << f;
    std::cout << ")\n";
    const auto names = [](const std::vector<std::string>& files) {
      std::string s;
      for (const std::string& f : files) s += (s.empty() ? "" : ", ") + f;
      return s;
    };
    if (!hf.removed.empty())
      std::cout << "export: removed the earlier export's " << names(hf.removed) << " from " << pos[1] << "\n";
    if (!hf.kept.empty())
      std::cerr << "loom export: warning: " << pos[1] << " has tokenizer files this export did not write ("
                << names(hf.kept) << "); they may not match the model: give --tokenizer, or remove them\n";
    return 0;
  } catch (const UsageError& e) {
    std::cerr << "loom export: " << e.what() << "\n" << kUsage;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "loom export: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace loom::cli
