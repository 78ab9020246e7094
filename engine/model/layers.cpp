#include "engine/model/layers.hpp"

#include "engine/model/recompute.hpp"

namespace loom::model {

std::vector<LayerSpec> model_layers(const manifest::RunConfig& config) {
  auto resolve = [&](const std::string& name, int block, const std::string& instance) {
    LayerSpec s;
    s.config = name;
    s.instance = instance;
    s.block_index = block;
    s.plugin = name;
    if (auto p = config.model.layer_section(name).get_as<std::string>("plugin")) s.plugin = p->get();
    return s;
  };
  std::vector<LayerSpec> out;
  for (const auto& c : config.model.pre) out.push_back(resolve(c, -1, c));
  const int blocks = static_cast<int>(config.model.num_layers);
  for (int b = 0; b < blocks; ++b)
    for (const auto& c : config.model.block_layers(b))
      out.push_back(resolve(c, b, "blocks." + std::to_string(b) + "." + c));
  for (const auto& c : config.model.post) out.push_back(resolve(c, -1, c));
  return out;
}

loom_model_dims model_dims(const manifest::RunConfig& config, int64_t vocab, int tp) {
  loom_model_dims d = loom::make<loom_model_dims>();
  d.hidden = config.model.hidden_size;
  d.heads = config.model.num_heads;
  d.ffn_hidden = config.model.ffn_hidden_size;
  d.seq_len = config.model.seq_length;
  d.vocab = vocab;
  const int64_t multiple = config.model.vocab_divisor * tp;
  d.padded_vocab = (vocab + multiple - 1) / multiple * multiple;
  d.micro_batch = config.batch.micro_batch_size;
  d.num_layers = static_cast<int32_t>(config.model.num_layers);
  d.block_index = -1;
  d.tie_embeddings = config.model.tie_embeddings ? 1 : 0;
  return d;
}

namespace {
// The manifest's [model.layer.NAME] options of a layer, as its plugin gets them.
toml::table layer_options(const manifest::RunConfig& config, const LayerSpec& spec) {
  toml::table section = config.model.layer_section(spec.config);
  section.erase("plugin");
  return section;
}

// A layer plugin's refusal, naming the instance and the plugin; a refused option
// ("option NAME = value", the built-in layers' wording) is cited where the manifest
// sets it.
loom::Error layer_refusal(const manifest::RunConfig& config, const LayerSpec& spec, const toml::table& section,
                          const loom::Error& e) {
  const std::string msg = e.what();
  std::string where;
  for (const auto& [key, node] : section) {
    const std::string option = spec.config + "." + std::string(key.str());
    auto origin = config.model.layer_origin.find(option);
    if (origin != config.model.layer_origin.end() &&
        msg.find("option " + std::string(key.str()) + " =") != std::string::npos) {
      where = origin->second.str() + ": model.layer." + option + ": ";
      break;
    }
  }
  return loom::Error(where + "layer " + spec.instance + " (layer/" + spec.plugin + "): " + msg, e.code());
}
}  // namespace

loom_layer* create_layer(const manifest::RunConfig& config, const plugins::Registry& registry, loom_rank* rank,
                         const LayerSpec& spec, const loom_model_dims& dims, const loom_group& tp,
                         const loom_layer_api** api) {
  const plugins::LoadedPlugin& p = registry.get("layer", spec.plugin);
  const toml::table section = layer_options(config, spec);
  plugins::OptionValues opts(&section, p.options);
  loom_model_dims ld = dims;
  ld.block_index = spec.block_index;
  loom_layer_create_args args = loom::make<loom_layer_create_args>();
  args.dims = &ld;
  args.instance_name = spec.instance.c_str();
  args.tp = tp;
  args.sequence_parallel = config.parallel.sequence_parallel ? 1 : 0;
  args.grad_accumulation_fusion = config.device.grad_accumulation_fusion ? 1 : 0;
  *api = p.layer();
  loom_layer* handle = nullptr;
  try {
    loom::check((*api)->create(opts.raw(), rank, &args, &handle));
  } catch (const loom::Error& e) {
    throw layer_refusal(config, spec, section, e);
  }
  if (handle == nullptr)
    throw loom::Error("layer " + spec.instance + " (" + p.key() + "): create reported success without a layer "
                      "(a bug in the plugin)");
  return handle;
}

void validate_layer(const manifest::RunConfig& config, const plugins::Registry& registry, const LayerSpec& spec,
                    const loom_layer_validate_args& run) {
  const plugins::LoadedPlugin& p = registry.get("layer", spec.plugin);
  const loom_layer_api* api = p.layer();
  // A layer built before 1.12 has no validate member (its table ends before it).
  if (!LOOM_HAS_SLOT(api, loom_layer_api, validate) || api->validate == nullptr) return;
  const toml::table section = layer_options(config, spec);
  plugins::OptionValues opts(&section, p.options);
  loom_model_dims ld = *run.dims;
  ld.block_index = spec.block_index;
  loom_layer_validate_args args = run;
  args.dims = &ld;
  args.instance_name = spec.instance.c_str();
  try {
    loom::check(api->validate(opts.raw(), &args));
  } catch (const loom::Error& e) {
    throw layer_refusal(config, spec, section, e);
  }
}

namespace {
// Creates layer `spec` of local chunk `chunk`, in recompute group `group` (-1: none).
Layer make_layer(const manifest::RunConfig& config, const plugins::Registry& registry, runtime::RankRuntime& rank,
                 const loom_model_dims& dims, const loom_group& tp, const LayerSpec& spec, int chunk, int group) {
  Layer layer;
  layer.spec = spec;
  layer.chunk = chunk;
  layer.handle = create_layer(config, registry, &rank, spec, dims, tp, &layer.api);
  const int32_t capture_kind = LOOM_HAS_SLOT(layer.api, loom_layer_api, capturable) && layer.api->capturable
                                   ? layer.api->capturable(layer.handle)
                                   : 0;
  layer.capturable = capture_kind == 1;
  // 2 ("captures parts") means something only from a layer built for 1.7 or later.
  layer.captures_parts = capture_kind == 2 && registry.get("layer", spec.plugin).abi_minor >= 7;
  layer.recompute_group = group;
  layer.recompute = group >= 0;
  return layer;
}

// Dropping a forward's saved state without its backward is the release slot.
void require_release_to_recompute(const Layer& layer) {
  if (layer.recompute && layer.api->release == nullptr)
    throw loom::Error("layer " + layer.spec.instance + " (layer/" + layer.spec.plugin +
                          ") has no release slot, so its saved activations cannot be dropped for recomputation; "
                          "set model.recompute_granularity = \"none\"",
                      LOOM_CODE_UNSUPPORTED);
}
}  // namespace

Layers::Layers(const manifest::RunConfig& config, const plugins::Registry& registry, runtime::RankRuntime& rank,
               const loom_model_dims& dims, const std::vector<ModelChunk>& chunks) {
  const loom::Group tp = rank.group_or_self("tp");
  LOOM_REQUIRE(!chunks.empty(), "a model needs at least one chunk");
  try {
    for (const ModelChunk& chunk : chunks) add_chunk(config, registry, rank, dims, tp.raw(), chunk);
  } catch (...) {
    destroy();  // a constructor that throws does not run the destructor
    throw;
  }
}

void Layers::add_chunk(const manifest::RunConfig& config, const plugins::Registry& registry,
                       runtime::RankRuntime& rank, const loom_model_dims& dims, const loom_group& tp,
                       const ModelChunk& chunk) {
  LocalChunk local;
  local.global_index = chunk.global_index;
  local.num_global = chunk.num_global;
  local.first_layer = layers_.size();
  const std::vector<int> groups = recompute_groups(config, chunk.layers);
  for (size_t k = 0; k < chunk.layers.size(); ++k) {
    // Pushed before the check, so that a refused layer is destroyed with the others.
    layers_.push_back(make_layer(config, registry, rank, dims, tp, chunk.layers[k],
                                 static_cast<int>(chunks_.size()), groups[k]));
    require_release_to_recompute(layers_.back());
  }
  local.end_layer = layers_.size();
  chunks_.push_back(local);
}

void Layers::destroy() {
  for (Layer& l : layers_)
    if (l.handle) {
      l.api->destroy(l.handle);
      l.handle = nullptr;
    }
}

double Layers::forward_flops() const {
  double f = 0;
  for (const Layer& l : layers_)
    if (LOOM_HAS_SLOT(l.api, loom_layer_api, forward_flops) && l.api->forward_flops)
      f += l.api->forward_flops(l.handle);
  return f;
}

uint64_t Layers::saved_activation_bytes() const {
  uint64_t b = 0;
  for (const Layer& l : layers_)
    if (!l.recompute) b += layer_bytes(l.api, l.handle, LayerBytes::Activations, l.spec.instance);
  return b;
}

uint64_t layer_bytes(const loom_layer_api* api, loom_layer* handle, LayerBytes what, const std::string& instance) {
  constexpr uint64_t kMost = uint64_t{1} << 50;
  const bool activations = what == LayerBytes::Activations;
  uint64_t bytes = 0;
  if (activations && LOOM_HAS_SLOT(api, loom_layer_api, activation_bytes) && api->activation_bytes)
    bytes = api->activation_bytes(handle);
  if (!activations && LOOM_HAS_SLOT(api, loom_layer_api, workspace_bytes) && api->workspace_bytes)
    bytes = api->workspace_bytes(handle);
  if (bytes > kMost)
    throw loom::Error("layer " + instance + ": its " + (activations ? "activation_bytes" : "workspace_bytes") +
                      " is " + std::to_string(bytes) + ", more than 2^50 bytes (a bug in the plugin)");
  return bytes;
}

void check_layer_call(loom_status status, const Layer& l, const char* step) {
  if (status == nullptr) return;
  const loom_host_api* h = plugins::host_api();
  std::string message = h->status_message(status);
  const int32_t code = h->status_code(status);
  h->status_destroy(status);
  if (message.empty()) message = "(no message)";
  const std::string where = "layer/" + l.spec.plugin + ", " + step;
  throw loom::Error(message.rfind(l.spec.instance, 0) == 0 ? message + " (" + where + ")"
                                                            : l.spec.instance + " (" + where + "): " + message,
                    code);
}

}  // namespace loom::model
