#include "engine/cli/model_source.hpp"

#include "engine/cli/args.hpp"
#include "engine/files/read.hpp"
#include "engine/interop/hf_config.hpp"
#include "engine/interop/hugging_face.hpp"
#include "engine/manifest/manifest.hpp"
#include "engine/text/tokenizer.hpp"
#include "engine/train/checkpoint.hpp"
#include "engine/train/data.hpp"
#include "engine/train/gather.hpp"

#include <boost/filesystem.hpp>

#include <cerrno>
#include <cstdlib>
#include <map>
#include <cstring>
#include <iostream>

namespace loom::cli {
namespace {

// The step directory of a checkpoint path, or "" when it is not one; the step
// directories passed over are said on stderr.
std::string checkpoint_step(const std::string& path) {
  std::vector<std::string> skipped;
  const std::string step = train::named_checkpoint(path, &skipped);
  if (!step.empty())
    for (const std::string& s : skipped) std::cerr << "note: skipped " << s << "; reading " << step << "\n";
  return step;
}

// The settings that decide how text maps to the model's tokens without a --tokenizer
// (train::TextCodec): a manifest that names a checkpoint must keep the checkpoint's, or
// its ids would be decoded as another vocabulary's.
void require_same_text_encoding(const std::string& saved_toml, const train::RunPlan& plan, const std::string& step) {
  const manifest::Manifest saved = manifest::Manifest::parse(saved_toml, step + "/manifest.toml", {},
                                                             manifest::Manifest::Launch::Other);
  const std::string kind = saved.get_string("data.kind");
  std::vector<std::pair<std::string, std::string>> keys = {{"data.kind", kind}};
  if (kind == "synthetic")
    keys.insert(keys.end(), {{"data.task", saved.get_string("data.task")},
                             {"data.digits", std::to_string(saved.get_int("data.digits"))}});
  if (kind == "chat") keys.emplace_back("data.chat_template", saved.get_string("data.chat_template"));
  for (const auto& [key, was] : keys) {
    const std::string now = key == "data.digits" ? std::to_string(plan.manifest.get_int(key)) : plan.manifest.get_string(key);
    if (now != was)
      throw UsageError("the checkpoint " + step + " was trained with " + key + " = " + was + ", this manifest has " +
                       now + ": its tokens would be read as another vocabulary's; set " + key + " as the checkpoint has it");
  }
  // Two tokenizers (by their vocabularies, wherever their files are), when the
  // checkpoint's still loads.
  const std::string was = saved.get_string("data.tokenizer"), now = plan.config.data.tokenizer;
  if (was.empty() || now.empty()) return;
  std::unique_ptr<text::Tokenizer> before;
  try {
    before = text::load_tokenizer(was);
  } catch (const text::TokenizerError&) {
    return;  // moved away: nothing to compare with
  }
  std::unique_ptr<text::Tokenizer> after;
  try {
    after = text::load_tokenizer(now);
  } catch (const text::TokenizerError&) {
    return;  // said when the text is encoded (--tokenizer may stand in for it)
  }
  if (!text::same_vocabulary(*before, *after))
    throw UsageError("the checkpoint " + step + " was trained with data.tokenizer = " + was + ", this manifest has " +
                     now + ", another vocabulary: its tokens would be read as another tokenizer's; set "
                     "data.tokenizer as the checkpoint has it");
}

// The weights of checkpoint `step` and the plan `plan_of` makes from the manifest it
// saved, which must hold the same model.
ModelSource from_checkpoint(const std::string& step,
                            const std::function<train::RunPlan(const std::string& saved_toml)>& plan_of,
                            plugins::Registry& registry) {
  train::WholeCheckpoint ck = train::gather_checkpoint(step, registry);
  train::RunPlan plan = plan_of(ck.manifest_toml);
  train::require_same_architecture(ck.manifest_toml, plan, step, "the checkpoint");
  train::InitialWeights w{step, std::move(ck.tensors), ck.vocab, "the checkpoint"};
  w.states = std::move(ck.states);
  return {std::move(plan), std::move(w), ck.vocab};
}

// --set may change how the model runs (layout, micro-batch, device, communication,
// execution), never what it is or how its text is encoded: those come with the weights.
// The key an override sets ("parallel.pp" of " parallel.pp = 2").
std::string override_key(const std::string& o) {
  std::string key = o.substr(0, o.find('='));
  key.erase(0, key.find_first_not_of(" \t"));
  key.erase(key.find_last_not_of(" \t") + 1);
  return key;
}

void check_overrides(const std::vector<std::string>& overrides) {
  static const char* const kRunKeys[] = {"parallel.", "pipeline.", "device.", "comm.", "exec.", "batch.micro_batch_size="};
  for (const std::string& o : overrides) {
    const std::string key = override_key(o);  // as the manifest reads it
    bool allowed = false;
    for (const char* k : kRunKeys) {
      const std::string prefix = k;
      allowed = allowed || (prefix.back() == '=' ? key == prefix.substr(0, prefix.size() - 1) : key.rfind(prefix, 0) == 0);
    }
    if (!allowed)
      throw UsageError("--set " + o + ": the model, its data settings (the vocabulary its text is encoded with) "
                       "and the rest come with the weights; --set may change parallel.*, pipeline.*, device.*, "
                       "comm.*, exec.* and batch.micro_batch_size");
  }
}

// Another pipeline (parallel.pp or vpp set) is not the saved one's split: its chunk
// sizes, virtual stages and schedule start from their defaults (the same blocks at
// any split), each still settable after them. Without, a checkpoint trained at pp 2 x
// vpp 2 with uneven chunks could not be sampled at pp 1.
std::vector<std::string> with_pipeline_defaults(const std::vector<std::string>& overrides) {
  std::map<std::string, std::string> set;  // key -> value text
  for (const std::string& o : overrides)
    set[override_key(o)] = o.find('=') == std::string::npos ? "" : o.substr(o.find('=') + 1);
  if (!set.count("parallel.pp") && !set.count("parallel.vpp")) return overrides;
  // A vpp the manifest would read as more than 1 keeps the interleaved schedule.
  const bool interleaved = set.count("parallel.vpp") && std::strtoll(set["parallel.vpp"].c_str(), nullptr, 10) > 1;
  std::vector<std::string> out = {"parallel.vpp=1", "pipeline.first_chunk_layers=0", "pipeline.last_chunk_layers=0",
                                  "pipeline.chunk_layers=[]",
                                  std::string("pipeline.schedule=\"") + (interleaved ? "interleaved" : "1f1b") + "\""};
  out.insert(out.end(), overrides.begin(), overrides.end());
  return out;
}

// A manifest's model (`text`, named `path` in messages): its checkpoint.dir's newest
// checkpoint, else its checkpoint.init_weights.
ModelSource from_manifest(const std::string& text, const std::string& path, const std::vector<std::string>& overrides,
                          plugins::Registry& registry, const PlanFor& plan_for);

}  // namespace

ModelSource load_model_source(const std::string& path, const std::vector<std::string>& given,
                              plugins::Registry& registry, const PlanFor& plan_for) {
  namespace fs = boost::filesystem;
  check_overrides(given);
  const std::vector<std::string> overrides = with_pipeline_defaults(given);
  if (!fs::exists(path)) throw UsageError(path + ": no such checkpoint, manifest or Hugging Face model");
  std::string step = checkpoint_step(path);
  if (step.empty() && fs::is_directory(path) && fs::exists(fs::path(path) / "config.json")) {
    // A Hugging Face model directory: the manifest its config.json describes (what
    // `loom import --write-manifest` writes), the directory's weights its init_weights.
    const std::string text = interop::manifest_for_hf(path) + "\n[checkpoint]\ninit_weights = " +
                             manifest::to_toml_text(toml::value<std::string>(fs::absolute(path).lexically_normal().string())) +
                             "\n";
    return from_manifest(text, (fs::path(path) / "config.json").string() + " (as a manifest)", overrides, registry,
                         plan_for);
  }
  if (step.empty() && fs::is_directory(path))
    throw loom::Error(path + " holds no complete checkpoint (a step_N directory with meta.toml) nor a Hugging Face "
                             "model (config.json)");
  if (!step.empty())
    return from_checkpoint(
        step, [&](const std::string& saved) { return plan_for(saved, step + "/manifest.toml", overrides, registry); },
        registry);
  std::string why;
  const std::optional<std::string> text = files::read_whole_file(path, &why, files::Pipes::Allow);
  if (!text) throw UsageError(path + ": cannot read the manifest (" + why + ")");
  return from_manifest(*text, path, overrides, registry, plan_for);
}

namespace {

ModelSource from_manifest(const std::string& text, const std::string& path, const std::vector<std::string>& overrides,
                          plugins::Registry& registry, const PlanFor& plan_for) {
  namespace fs = boost::filesystem;
  std::string step;
  train::RunPlan plan = plan_for(text, path, overrides, registry);
  // The manifest's own checkpoint settings (the command's plan need not keep them),
  // its paths resolved as a run resolves them. A run that saved checkpoints (a
  // fine-tuning run of init_weights, say) is sampled at its newest. Read as written:
  // the overrides a command takes (layout, micro-batch) change none of them, and would
  // make a training manifest's batches (a ramp, say) fail checks the command's plan drops.
  const manifest::RunConfig own = manifest::RunConfig::from(
      manifest::Manifest::parse(text, path, {}, manifest::Manifest::Launch::Other));
  const std::string& init = own.checkpoint.init_weights;
  const std::string& dir = own.checkpoint.dir;
  const manifest::RunConfig& c = plan.config;
  if (!dir.empty() && !(step = checkpoint_step(dir)).empty())
    return from_checkpoint(
        step,
        [&](const std::string& saved) {
          require_same_text_encoding(saved, plan, step);
          return std::move(plan);
        },
        registry);
  // checkpoint.dir is relative to the working directory (where `loom run` wrote it).
  boost::system::error_code ec;
  const std::string no_checkpoint =
      dir.empty() ? "" : "checkpoint.dir = " + dir + " holds no checkpoint (seen from " + fs::current_path(ec).string() + ")";
  if (!init.empty()) {
    if (!no_checkpoint.empty()) std::cerr << "note: " << no_checkpoint << "; reading checkpoint.init_weights\n";
    const int64_t vocab = c.model.vocab_size > 0 ? c.model.vocab_size : train::make_data_source(c)->vocab_size();
    train::InitialWeights w = interop::read_initial_weights(init, plan, vocab, registry);
    // A loom checkpoint's ids mean what its own data settings say (a Hugging Face
    // model's vocabulary comes with a --tokenizer, checked by its size).
    const fs::path saved = fs::path(w.source) / "manifest.toml";
    if (fs::exists(fs::path(w.source) / "meta.toml")) {
      if (const std::optional<std::string> saved_text = files::read_whole_file(saved.string()))
        require_same_text_encoding(*saved_text, plan, w.source);
    }
    return {std::move(plan), std::move(w), vocab};
  }
  throw UsageError(path + " names no weights" + (no_checkpoint.empty() ? "" : " (" + no_checkpoint + ")") +
                   ": set checkpoint.init_weights, or checkpoint.dir to a directory with a checkpoint, or give "
                   "the checkpoint itself");
}

}  // namespace

std::string checkpoint_step_dir(const std::string& path, const std::string& doing) {
  namespace fs = boost::filesystem;
  if (!fs::exists(fs::path(path) / "meta.toml") && !fs::is_directory(path))
    throw UsageError(path + " is not a checkpoint (" + (fs::exists(path) ? "a file, not a directory" : "no such directory") +
                     ")");
  std::vector<std::string> skipped;
  const std::string step = train::named_checkpoint(path, &skipped);
  if (step.empty()) throw UsageError(path + " holds no complete checkpoint (a step_N directory with meta.toml)");
  for (const std::string& s : skipped) std::cerr << "note: skipped " << s << "; " << doing << " " << step << "\n";
  return step;
}

}  // namespace loom::cli
