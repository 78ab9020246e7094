#include "engine/manifest/run_config.hpp"

#include "engine/manifest/schema.hpp"

#include <boost/filesystem.hpp>

#include <stdexcept>

namespace loom::manifest {

namespace {

toml::table table_or_empty(const Manifest& m, const std::string& path) {
  const toml::table* t = m.get_table(path);
  return t != nullptr ? *t : toml::table{};
}

// A relative path (data.path, checkpoint.init_weights) is taken relative to the
// manifest file that sets it when the file (or, for an indexed dataset's prefix, its
// .idx) exists there, so a config works from any working directory.
std::string resolved_path(const Manifest& m, const std::string& key, std::string path) {
  const Origin o = m.origin(key);
  if (!path.empty() && path[0] != '/' && o.kind == Origin::Kind::File && !o.file.empty()) {
    const boost::filesystem::path candidate = boost::filesystem::path(o.file).parent_path() / path;
    if (boost::filesystem::exists(candidate) || boost::filesystem::exists(candidate.string() + ".idx"))
      return candidate.lexically_normal().string();
  }
  return path;
}
std::string resolved_path(const Manifest& m, const std::string& key) { return resolved_path(m, key, m.get_string(key)); }

int as_int(int64_t v) { return static_cast<int>(v); }  // the schema bounds these keys to 32 bits

}  // namespace

const toml::table& RunConfig::Model::layer_section(const std::string& name) const {
  static const toml::table empty;
  auto it = layer.find(name);
  return it == layer.end() ? empty : it->second;
}

namespace {
// Block b's kind: "block" (model.block) or a name of model.blocks.
const std::string& block_kind(const RunConfig::Model& m, int64_t b) {
  static const std::string default_block(schema::kDefaultBlock);
  return m.block_pattern.empty() ? default_block : m.block_pattern[static_cast<size_t>(b)];
}
}  // namespace

const std::vector<std::string>& RunConfig::Model::block_layers(int64_t b) const {
  const std::string& kind = block_kind(*this, b);
  return kind == schema::kDefaultBlock ? block : blocks.at(kind);
}

std::string RunConfig::Model::block_key(int64_t b) const {
  const std::string& kind = block_kind(*this, b);
  return kind == schema::kDefaultBlock ? "model.block" : std::string(schema::kBlockTable) + "." + kind;
}

RunConfig::Batch RunConfig::batch_from(const Manifest& m) {
  Batch b;
  b.micro_batch_size = m.get_int("batch.micro_batch_size");
  b.global_batch_size = m.get_int("batch.global_batch_size");
  read_rampup(m.table(), b);
  return b;
}

void RunConfig::read_rampup(const toml::table& t, Batch& b) {
  b.rampup_start = b.rampup_increment = b.rampup_samples = 0;
  if (const toml::array* ramp = t.at_path("batch.rampup_batch_size").as_array(); ramp && ramp->size() == 3) {
    b.rampup_start = ramp->get(0)->value_or(int64_t{0});
    b.rampup_increment = ramp->get(1)->value_or(int64_t{0});
    b.rampup_samples = ramp->get(2)->value_or(int64_t{0});
  }
}

RunConfig::Optimizer RunConfig::schedule_from(const Manifest& m) {
  Optimizer o;
  o.lr = m.get_float("optimizer.lr");
  o.min_lr = m.get_float("optimizer.min_lr");
  o.warmup_steps = m.get_int("optimizer.warmup_steps");
  o.decay_steps = m.get_int("optimizer.decay_steps");
  o.decay_style = m.get_string("optimizer.decay_style");
  o.wsd_decay_steps = m.get_int("optimizer.wsd_decay_steps");
  o.wsd_decay_style = m.get_string("optimizer.wsd_decay_style");
  o.warmup_samples = m.get_int("optimizer.warmup_samples");
  o.decay_samples = m.get_int("optimizer.decay_samples");
  o.wsd_decay_samples = m.get_int("optimizer.wsd_decay_samples");
  o.warmup_fraction = m.get_float("optimizer.warmup_fraction");
  o.weight_decay = m.get_float("optimizer.weight_decay");
  o.weight_decay_incr_style = m.get_string("optimizer.weight_decay_incr_style");
  o.start_weight_decay = m.get_float("optimizer.start_weight_decay");
  o.end_weight_decay = m.get_float("optimizer.end_weight_decay");
  return o;
}

RunConfig RunConfig::from(const Manifest& m) {
  RunConfig c;
  c.run.name = m.get_string("run.name");
  c.run.train_samples = m.get_int("run.train_samples");
  c.run.steps = schema::resolved_steps(m);
  c.run.seed = m.get_int("run.seed");
  c.run.log_every = m.get_int("run.log_every");
  c.run.eval_every = m.get_int("run.eval_every");
  c.run.eval_batches = m.get_int("run.eval_batches");
  c.run.sample_every = m.get_int("run.sample_every");
  c.run.sample_tokens = m.get_int("run.sample_tokens");
  c.run.metrics_file = m.get_string("run.metrics_file");
  c.run.tensorboard_dir = m.get_string("run.tensorboard_dir");
  c.run.exit_duration_minutes = m.get_float("run.exit_duration_minutes");
  c.run.exit_interval = m.get_int("run.exit_interval");
  c.run.calculate_per_token_loss = m.get_bool("run.calculate_per_token_loss");

  c.model.hidden_size = m.get_int("model.hidden_size");
  c.model.num_heads = m.get_int("model.num_heads");
  c.model.ffn_hidden_size = schema::resolved_ffn_hidden_size(m);
  c.model.num_layers = m.get_int("model.num_layers");
  c.model.seq_length = m.get_int("model.seq_length");
  c.model.vocab_size = m.get_int("model.vocab_size");
  c.model.vocab_divisor = m.get_int("model.vocab_divisor");
  c.model.init_method_std = m.get_float("model.init_method_std");
  c.model.tie_embeddings = m.get_bool("model.tie_embeddings");
  c.model.pre = m.get_string_list("model.pre");
  c.model.block = m.get_string_list("model.block");
  c.model.post = m.get_string_list("model.post");
  if (const toml::table* kinds = m.get_table(std::string(schema::kBlockTable)))
    for (const auto& [name, node] : *kinds) {
      std::vector<std::string>& layers = c.model.blocks[std::string(name.str())];
      for (const toml::node& e : *node.as_array()) layers.push_back(e.as_string()->get());
    }
  // A validated manifest's pattern places num_layers blocks of kinds it defines.
  const std::vector<std::string> pattern = m.get_string_list("model.block_pattern");
  c.model.block_pattern = schema::expand_block_pattern(pattern, c.model.num_layers).value_or(std::vector<std::string>{});
  if (!pattern.empty() && static_cast<int64_t>(c.model.block_pattern.size()) != c.model.num_layers)
    throw std::logic_error("model.block_pattern of an unvalidated manifest");
  for (const std::string& kind : c.model.block_pattern)
    if (kind != schema::kDefaultBlock && c.model.blocks.count(kind) == 0)
      throw std::logic_error("model.block_pattern names an undefined block kind in an unvalidated manifest");
  c.model.recompute_granularity = m.get_string("model.recompute_granularity");
  c.model.recompute_method = m.get_string("model.recompute_method");
  c.model.recompute_num_layers = m.get_int("model.recompute_num_layers");
  if (const toml::table* layers = m.get_table(std::string(schema::kLayerTable)))
    for (const auto& [name, node] : *layers)
      if (const toml::table* t = node.as_table()) {
        const std::string layer(name.str());
        c.model.layer.emplace(layer, *t);
        for (const auto& [key, value] : *t) {
          const std::string option = layer + "." + std::string(key.str());
          const Origin o = m.origin(std::string(schema::kLayerTable) + "." + option);
          if (o.kind != Origin::Kind::Default) c.model.layer_origin.emplace(option, o);
        }
      }

  c.parallel.tp = as_int(m.get_int("parallel.tp"));
  c.parallel.pp = as_int(m.get_int("parallel.pp"));
  c.parallel.vpp = as_int(m.get_int("parallel.vpp"));
  c.parallel.cp = as_int(m.get_int("parallel.cp"));
  c.parallel.ep = as_int(m.get_int("parallel.ep"));
  c.parallel.etp = as_int(m.get_int("parallel.etp"));
  c.parallel.dp = as_int(m.get_int("parallel.dp"));
  c.parallel.order = m.get_string("parallel.order");
  c.parallel.sequence_parallel = m.get_bool("parallel.sequence_parallel");
  c.parallel.tensor = m.get_string("parallel.tensor");
  c.parallel.expert = m.get_string("parallel.expert");

  c.pipeline.schedule = m.get_string("pipeline.schedule");  // its default follows parallel.vpp (Manifest)
  c.pipeline.microbatch_group_size = as_int(m.get_int("pipeline.microbatch_group_size"));
  c.pipeline.overlap_p2p_comm = m.get_bool("pipeline.overlap_p2p_comm");
  c.pipeline.first_chunk_layers = as_int(m.get_int("pipeline.first_chunk_layers"));
  c.pipeline.last_chunk_layers = as_int(m.get_int("pipeline.last_chunk_layers"));
  if (const toml::array* each = m.table().at_path("pipeline.chunk_layers").as_array())
    for (const toml::node& n : *each) c.pipeline.chunk_layers.push_back(as_int(n.value_or(int64_t{0})));
  c.pipeline.options = table_or_empty(m, "pipeline.options");

  c.batch = batch_from(m);

  c.optimizer = schedule_from(m);
  c.optimizer.strategy = m.get_string("optimizer.strategy");
  c.optimizer.beta1 = m.get_float("optimizer.beta1");
  c.optimizer.beta2 = m.get_float("optimizer.beta2");
  c.optimizer.eps = m.get_float("optimizer.eps");
  c.optimizer.clip_grad = m.get_float("optimizer.clip_grad");
  c.optimizer.overlap_grad_reduce = m.get_bool("optimizer.overlap_grad_reduce");
  c.optimizer.overlap_param_gather = m.get_bool("optimizer.overlap_param_gather");
  c.optimizer.bucket_size = m.get_int("optimizer.bucket_size");
  // Overlap needs several buckets: Megatron-LM's default size when none is set.
  if (c.optimizer.overlap_grad_reduce && c.optimizer.bucket_size == 0) c.optimizer.bucket_size = kOverlapBucketSize;
  c.optimizer.options = table_or_empty(m, "optimizer.options");

  c.exec.mode = m.get_string("exec.mode");
  c.exec.options = table_or_empty(m, "exec.options");

  c.device.kind = m.get_string("device.kind");
  c.device.param_dtype = m.get_string("device.param_dtype");
  c.device.grad_dtype = m.get_string("device.grad_dtype");
  c.device.grad_accumulation_fusion = m.get_bool("device.grad_accumulation_fusion");
  c.device.threads = as_int(m.get_int("device.threads"));
  c.device.peak_tflops = m.get_float("device.peak_tflops");
  c.device.options = table_or_empty(m, "device.options");

  c.comm.backend = m.get_string("comm.backend");
  c.comm.timeout_s = m.get_float("comm.timeout_s");
  c.comm.options = table_or_empty(m, "comm.options");

  c.data.kind = m.get_string("data.kind");
  c.data.path = resolved_path(m, "data.path");
  if (const toml::array* blend = m.table().at_path("data.blend").as_array())
    for (size_t i = 0; i + 1 < blend->size(); i += 2) {
      const toml::node& w = *blend->get(i);
      const double weight = w.is_integer() ? static_cast<double>(w.as_integer()->get()) : w.value_or(0.0);
      c.data.blend.emplace_back(weight, resolved_path(m, "data.blend", blend->get(i + 1)->value_or(std::string())));
    }
  c.data.tokenizer = resolved_path(m, "data.tokenizer");
  c.data.chat_template = m.get_string("data.chat_template");
  c.data.chat_packing = m.get_bool("data.chat_packing");
  c.data.val_fraction = m.get_float("data.val_fraction");
  c.data.eod_mask_loss = m.get_bool("data.eod_mask_loss");
  c.data.eod_token = m.get_int("data.eod_token");
  c.data.reset_attention_mask = m.get_bool("data.reset_attention_mask");
  c.data.reset_position_ids = m.get_bool("data.reset_position_ids");
  c.data.task = m.get_string("data.task");
  c.data.digits = m.get_int("data.digits");

  c.checkpoint.dir = m.get_string("checkpoint.dir");
  c.checkpoint.init_weights = resolved_path(m, "checkpoint.init_weights");
  c.checkpoint.every = m.get_int("checkpoint.every");
  c.checkpoint.keep_last = m.get_int("checkpoint.keep_last");
  c.checkpoint.async_save = m.get_bool("checkpoint.async_save");

  c.plugins.search_paths = m.get_string_list("plugins.search_paths");
  return c;
}

}  // namespace loom::manifest
