// The run configuration: every engine key of a validated manifest, read once
// into typed fields. Engine code reads these fields, never the manifest by key;
// the manifest keeps provenance (file:line), plugin option sections and the
// TOML text that checkpoints store. Field names are the manifest's key names.
#pragma once

#include "engine/manifest/manifest.hpp"

#include <toml++/toml.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace loom::manifest {

// Gradient bucket size (elements) of optimizer.overlap_grad_reduce without an
// optimizer.bucket_size: Megatron-LM's DistributedDataParallel default, 40M.
constexpr int64_t kOverlapBucketSize = 40000000;

struct RunConfig {
  struct Run {
    std::string name;
    int64_t steps = 0, seed = 0, log_every = 0, eval_every = 0, eval_batches = 0;
    int64_t sample_every = 0, sample_tokens = 0;  // greedy samples during training
    std::string metrics_file;
    std::string tensorboard_dir;
    int64_t train_samples = 0;         // > 0: run.steps is resolved from it (steps_for_samples)
    double exit_duration_minutes = 0;  // 0 = no limit
    int64_t exit_interval = 0;         // 0 = never
    bool calculate_per_token_loss = false;  // the batch's loss over its tokens, not a mean of microbatch means
  } run;
  struct Model {
    int64_t hidden_size = 0, num_heads = 0;
    int64_t ffn_hidden_size = 0;  // resolved: 0 in the manifest means 4 * hidden_size
    int64_t num_layers = 0, seq_length = 0;
    int64_t vocab_size = 0;  // 0: the data source's vocabulary
    int64_t vocab_divisor = 0;
    double init_method_std = 0;  // > 0: every normal init's std (0: each layer's declaration)
    bool tie_embeddings = false;
    std::vector<std::string> pre, block, post;  // layer configuration names
    // model.blocks: the further block kinds by name; model.block_pattern expanded to
    // one kind per block ("block" = model.block), empty when every block is model.block.
    std::map<std::string, std::vector<std::string>> blocks;
    std::vector<std::string> block_pattern;
    std::string recompute_granularity, recompute_method;
    int64_t recompute_num_layers = 0;
    std::map<std::string, toml::table> layer;  // [model.layer.NAME] sections
    // Where the manifest sets each layer option ("NAME.key"); options left at their defaults are absent.
    std::map<std::string, Origin> layer_origin;
    // The [model.layer.NAME] section, or an empty table when there is none.
    const toml::table& layer_section(const std::string& name) const;
    // The layer names of transformer block b, and the key they come from
    // ("model.block" or "model.blocks.NAME").
    const std::vector<std::string>& block_layers(int64_t b) const;
    std::string block_key(int64_t b) const;
  } model;
  struct Parallel {
    int tp = 1, pp = 1, vpp = 1, cp = 1, ep = 1;
    int etp = 0;  // 0 = the same as tp (topology::ParallelSizes::expert_tp resolves it)
    int dp = 1;
    std::string order;
    bool sequence_parallel = false;
    std::string tensor, expert;  // the service plugins' names
  } parallel;
  struct Pipeline {
    std::string schedule;  // resolved: "interleaved" for the default schedule when vpp > 1
    int microbatch_group_size = 0, first_chunk_layers = 0, last_chunk_layers = 0;
    std::vector<int> chunk_layers;  // blocks per global chunk; empty: first/last_chunk_layers, else even
    bool overlap_p2p_comm = true;  // receives posted a step early
    toml::table options;
  } pipeline;
  struct Batch {
    int64_t micro_batch_size = 1, global_batch_size = 1;
    // batch.rampup_batch_size: [start, increment, samples]; start 0 = no ramp.
    int64_t rampup_start = 0, rampup_increment = 0, rampup_samples = 0;
  } batch;
  struct Optimizer {
    std::string strategy;
    double lr = 0, min_lr = 0;
    int64_t warmup_steps = 0, decay_steps = 0;
    std::string decay_style;      // cosine, linear, constant, inverse-square-root, wsd
    int64_t wsd_decay_steps = 0;  // wsd: the final decay's steps
    // The same marks in training samples (Megatron-LM's --lr-*-samples); see ScheduleMarks.
    int64_t warmup_samples = 0, decay_samples = 0, wsd_decay_samples = 0;
    double warmup_fraction = 0;  // > 0: the warmup is this share of the decay (Megatron's --lr-warmup-fraction)
    std::string weight_decay_incr_style;  // constant (weight_decay), linear, cosine
    double start_weight_decay = 0, end_weight_decay = 0;
    std::string wsd_decay_style;  // wsd: exponential, linear, cosine, minus_sqrt
    double beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0, clip_grad = 0;
    int64_t bucket_size = 0;      // resolved: kOverlapBucketSize when overlapping without one
    bool overlap_grad_reduce = false;
    bool overlap_param_gather = false;
    toml::table options;
  } optimizer;
  struct Exec {
    std::string mode;
    toml::table options;
  } exec;
  struct Device {
    std::string kind, param_dtype, grad_dtype;
    bool grad_accumulation_fusion = false;
    int threads = 0;
    double peak_tflops = 0;
    toml::table options;
  } device;
  struct Comm {
    std::string backend;
    double timeout_s = 0;
    toml::table options;
  } comm;
  struct Data {
    std::string kind;
    std::string path;  // resolved: relative to the manifest file that names it, when the file (prefix) exists there
    std::vector<std::pair<double, std::string>> blend;  // (weight, path resolved as path is); empty: data.path
    std::string tokenizer;  // resolved as path is; "" = none named
    std::string chat_template;  // kind chat: "chatml", "llama3", "" = data.tokenizer's own
    bool chat_packing = false;  // kind chat: several whole lines a sample
    double val_fraction = 0;
    bool eod_mask_loss = false;  // no loss where the input is eod_token (Megatron-LM's --eod-mask-loss)
    int64_t eod_token = -1;      // -1 = the tokenizer's end-of-document token
    bool reset_attention_mask = false;  // attention within each document only (Megatron-LM's flag)
    bool reset_position_ids = false;    // positions from each document's start (Megatron-LM's flag)
    bool documents() const { return reset_attention_mask || reset_position_ids; }
    std::string task;
    int64_t digits = 0;
  } data;
  struct Checkpoint {
    std::string dir;
    int64_t every = 0;
    int64_t keep_last = 0;     // 0 = keep every checkpoint
    bool async_save = false;   // write periodic checkpoints beside training
    std::string init_weights;  // "" = the layers' random initialization
  } checkpoint;
  struct Plugins {
    std::vector<std::string> search_paths;
  } plugins;

  // Reads every engine key of `m`, which has passed the schema (Manifest::load or parse).
  static RunConfig from(const Manifest& m);
  // The batch keys alone (what the schema's checks need of them).
  static Batch batch_from(const Manifest& m);
  // batch.rampup_batch_size of a manifest's table (none: no ramp), as batch_from reads it.
  static void read_rampup(const toml::table& t, Batch& b);
  // The schedule's keys alone (lr, min_lr, the styles and the marks, the weight decay).
  static Optimizer schedule_from(const Manifest& m);
};

}  // namespace loom::manifest
