// The engine schema (every core key) and the cross-key rules.
#include "engine/manifest/schema.hpp"

#include "engine/manifest/batches.hpp"

#include "engine/manifest/run_config.hpp"
#include "engine/text/chat_template.hpp"
#include "engine/topology/layer_split.hpp"
#include "engine/topology/rank_groups.hpp"

#include <cmath>
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <initializer_list>
#include <iomanip>
#include <sstream>
#include <stdexcept>

namespace loom::manifest::schema {
namespace {

// Bounds that keep every size and product of sizes the engine forms far from int64
// (and the rank counts from int): a parallel group of at most 2^20 ranks, a world of at
// most 2^20 ranks (check_rules), at most 2^30 sequences in a batch.
constexpr double kMaxGroupSize = 1 << 20;
constexpr double kMaxBatch = 1 << 30;
constexpr double kMaxThreads = 4096;  // host threads a rank may ask for
using topology::kMaxWorld;
// Model dimensions: widths of at most 2^20 (the MLP 2^22), at most 2^16 layers or heads,
// 2^24 tokens a sequence, int32 token ids; and a microbatch's widest activation
// (sequence x micro-batch x the widest of hidden, MLP and vocab) of at most 2^48
// elements (check_rules), so element and byte counts of any tensor fit in int64.
constexpr double kMaxWidth = 1 << 20;
constexpr double kMaxCount = 1 << 16;
constexpr double kMaxSeq = 1 << 24;
constexpr double kMaxVocab = 2147483647.0;
constexpr double kMaxActivation = static_cast<double>(int64_t{1} << 48);

KeySpec key(std::string path, KeyType type, std::optional<std::string> dflt, std::string doc) {
  KeySpec k;
  k.path = std::move(path);
  k.type = type;
  k.default_value = std::move(dflt);
  k.doc = std::move(doc);
  return k;
}
KeySpec b(std::string path, bool dflt, std::string doc) {
  return key(std::move(path), KeyType::Bool, dflt ? "true" : "false", std::move(doc));
}
KeySpec i(std::string path, int64_t dflt, std::optional<double> min, std::string doc,
          std::optional<double> max = std::nullopt) {
  KeySpec k = key(std::move(path), KeyType::Int, std::to_string(dflt), std::move(doc));
  k.min = min;
  k.max = max;
  return k;
}
KeySpec f(std::string path, std::string dflt, std::optional<double> min, bool min_excl,
          std::string doc, std::optional<double> max = std::nullopt, bool max_excl = false) {
  KeySpec k = key(std::move(path), KeyType::Float, std::move(dflt), std::move(doc));
  k.min = min;
  k.min_exclusive = min_excl;
  k.max = max;
  k.max_exclusive = max_excl;
  return k;
}
KeySpec s(std::string path, const std::string& dflt, std::string doc,
          std::vector<std::string> allowed = {}) {
  KeySpec k = key(std::move(path), KeyType::String, "\"" + dflt + "\"", std::move(doc));
  k.allowed = std::move(allowed);
  return k;
}
// data.chat_template: "" (the tokenizer's own) or a template loom writes.
std::vector<std::string> chat_template_values() {
  std::vector<std::string> v{""};
  for (const std::string& name : text::ChatTemplate::names()) v.push_back(name);
  return v;
}
KeySpec sl(std::string path, std::string dflt, std::string doc) {
  return key(std::move(path), KeyType::StringList, std::move(dflt), std::move(doc));
}
KeySpec open_table(std::string path, std::string doc) {
  KeySpec k = key(std::move(path), KeyType::Table, std::nullopt, std::move(doc));
  k.open = true;
  return k;
}

// model.blocks: every entry a list of layer names under a name model.block_pattern can
// place (a TOML bare key: letters, digits, '_', '-'), none named after model.block.
std::string check_block_kinds(const toml::node& n) {
  for (auto&& [k, v] : *n.as_table()) {
    const std::string name(k.str());
    const bool bare = !name.empty() && std::all_of(name.begin(), name.end(), [](unsigned char c) {
      return std::isalnum(c) != 0 || c == '_' || c == '-';
    });
    if (!bare) return "name its block kinds with letters, digits, '_' and '-' (as a bare TOML key), not '" + name + "'";
    if (name == kDefaultBlock) return "not define '" + name + "' (that name is model.block's)";
    const toml::array* a = v.as_array();
    if (a != nullptr && a->empty()) return "give each block kind at least one layer (" + name + " has none)";
    if (a == nullptr || !a->is_homogeneous(toml::node_type::string))
      return "give each block kind an array of layer names (" + name + " is not one)";
  }
  return "";
}

// model.block_pattern: entries "NAME" or "NAME*N", N from 1 to 65536.
std::string check_block_pattern(const toml::node& n) {
  for (auto&& e : *n.as_array()) {
    const std::string entry = e.as_string()->get();
    if (!parse_block_run(entry))
      return "be a list of \"NAME\" or \"NAME*N\" entries (N from 1 to 65536), not \"" + entry + "\"";
  }
  return "";
}

// pipeline.chunk_layers: integers from 0 to 65536.
std::string check_chunk_layers(const toml::node& n) {
  for (auto&& e : *n.as_array())
    if (!e.is_integer() || e.as_integer()->get() < 0 || e.as_integer()->get() > static_cast<int64_t>(kMaxCount))
      return "be a list of block counts from 0 to 65536";
  return "";
}

const char* const kDims[] = {"tp", "cp", "ep", "dp", "pp"};

std::string check_order(const toml::node& n) {
  const std::string v = n.as_string()->get();
  std::vector<std::string> parts;
  std::string cur;
  for (char c : v) {
    if (c == '-') {
      parts.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  parts.push_back(cur);
  std::vector<std::string> want(std::begin(kDims), std::end(kDims));
  std::vector<std::string> got = parts;
  std::sort(want.begin(), want.end());
  std::sort(got.begin(), got.end());
  if (got == want) return "";
  return "be a '-'-joined permutation of tp, cp, ep, dp, pp (e.g. \"tp-cp-ep-dp-pp\")";
}

std::vector<KeySpec> build() {
  std::vector<KeySpec> v;
  // run
  v.push_back(s("run.name", "loom", "name of the run, used in logs and checkpoints"));
  v.push_back(i("run.steps", 100, 1, "number of optimizer steps to train"));
  v.push_back(i("run.train_samples", 0, 0,
                "train until this many samples are consumed instead (Megatron-LM's --train-samples): run.steps "
                "becomes the steps that take them at the global batch and its ramp, a last partial batch dropped "
                "(0 = run.steps)",
                static_cast<double>(int64_t{1} << 53)));
  v.push_back(i("run.seed", 1234, 0, "seed for parameter init, data order and dropout"));
  v.push_back(i("run.log_every", 10, 1, "log metrics every N steps"));
  v.push_back(i("run.eval_every", 0, 0, "evaluate on the validation split every N steps (0 = never)"));
  v.push_back(i("run.eval_batches", 4, 1,
                "validation microbatches per evaluation, shared among the data-parallel ranks (the same samples at "
                "any layout)"));
  v.push_back(i("run.sample_every", 0, 0,
                "print a greedy sample every N steps (0 = never): the start of a validation sequence (for "
                "data.kind = \"chat\", its conversation up to the assistant's first header) and what the model "
                "writes after it, with the key/value cache of `loom generate`"));
  v.push_back(i("run.sample_tokens", 32, 1, "tokens each sample adds (fewer when the model's seq_length is reached)"));
  v.push_back(s("run.metrics_file", "", "JSON-lines file the metrics are appended to (\"\" = none)"));
  v.push_back(s("run.tensorboard_dir", "",
                "directory of TensorBoard event files (Megatron-LM's --tensorboard-dir): each launch adds one with "
                "every step's scalars, Megatron's tags where it has them (\"lm loss\", \"learning-rate\", "
                "\"grad-norm\", \"lm loss validation\", ...; \"\" = none)"));
  v.push_back(f("run.exit_duration_minutes", "0.0", 0, false,
                "stop after the first step that ends more than N minutes after training started (Megatron-LM's "
                "--exit-duration-in-mins): the step is checkpointed as at a stop signal, its evaluation left to the "
                "resumed run, and `loom run` exits 0; --resume continues (0 = no limit)"));
  v.push_back(i("run.exit_interval", 0, 0,
                "stop after each step that is a multiple of N (Megatron-LM's --exit-interval), after its evaluation "
                "and checkpoint, and exit 0; --resume runs to the next multiple (0 = never)"));
  v.push_back(b("run.calculate_per_token_loss", false,
                "the step's loss is the sum over the global batch's target tokens divided by their number "
                "(Megatron-LM's --calculate-per-token-loss), so every token weighs the same whatever microbatch "
                "and dp rank holds it and the result does not depend on batch.micro_batch_size (MoE auxiliary "
                "losses stay a mean over microbatches, as in Megatron-LM); false = each microbatch's mean, averaged "
                "(a microbatch with few targets, as data.kind = \"chat\" and data.eod_mask_loss make them, weighs "
                "as much as one with many)"));
  // model
  v.push_back(i("model.hidden_size", 128, 1, "width of the residual stream", kMaxWidth));
  v.push_back(i("model.num_heads", 4, 1, "attention heads", kMaxCount));
  v.push_back(i("model.ffn_hidden_size", 0, 0, "MLP inner width (0 = 4 * hidden_size)", 4 * kMaxWidth));
  v.push_back(i("model.num_layers", 4, 1, "transformer blocks", kMaxCount));
  v.push_back(i("model.seq_length", 64, 1, "tokens per sequence", kMaxSeq));
  v.push_back(i("model.vocab_size", 0, 0, "vocabulary size (0 = taken from the data; token ids are int32)", kMaxVocab));
  v.push_back(i("model.vocab_divisor", 128, 1,
                "vocabulary padded to a multiple of vocab_divisor * tp", kMaxVocab));
  v.push_back(b("model.tie_embeddings", true, "share the embedding and lm_head weights"));
  {
    KeySpec std_key = f("model.init_method_std", "0.0", 0, false,
                        "standard deviation of the weights' normal initialisation (Megatron-LM's --init-method-std): "
                        "every layer's normally initialised parameter (the output projections scaled by "
                        "1/sqrt(2 * num_layers), as Megatron-LM does) draws from it instead of the std the layer "
                        "declares (0.02 for the built-in layers); 0 = the layers' own",
                        1.0);
    std_key.single_precision = true;  // the parameter declarations carry it as a float
    v.push_back(std::move(std_key));
  }
  v.push_back(sl("model.pre", "[\"embedding\"]", "layer instances before the blocks"));
  v.push_back(sl("model.block", "[\"attention\", \"mlp\"]",
                 "layer instances of one transformer block, repeated num_layers times (or where "
                 "model.block_pattern places \"block\")"));
  {
    KeySpec k = open_table(std::string(kBlockTable),
                           "[model.blocks] NAME = [layer instances]: further kinds of transformer block, which "
                           "model.block_pattern places (e.g. dense = [\"attention\", \"mlp\"] beside "
                           "model.block = [\"attention\", \"moe\"]); a layer instance named in several kinds is "
                           "one [model.layer.NAME] configuration");
    k.check = check_block_kinds;
    v.push_back(std::move(k));
  }
  {
    KeySpec k = sl("model.block_pattern", "[]",
                   "which block each of the num_layers transformer blocks is, in order: \"block\" (model.block) "
                   "or a name of model.blocks, \"NAME*N\" for N in a row (Megatron-LM's --moe-layer-freq "
                   "pattern, DeepSeek-V3's first_k_dense_replace = 3 of 61: [\"dense*3\", \"block*58\"]); "
                   "the entries add up to num_layers ([] = model.block every time)");
    k.check = check_block_pattern;
    v.push_back(std::move(k));
  }
  v.push_back(sl("model.post", "[\"lm_head\"]", "layer instances after the blocks"));
  v.push_back(s("model.recompute_granularity", "none",
                "activation recomputation (Megatron's --recompute-granularity): \"full\" keeps only each block's "
                "input (see recompute_method) between its forward and backward and runs its forward again in "
                "backward (less activation memory for about one more forward of the blocks); \"none\" keeps what "
                "the layers save",
                {"none", "full"}));
  v.push_back(s("model.recompute_method", "block",
                "with recompute_granularity = \"full\" (Megatron's --recompute-method): \"block\" recomputes "
                "each of the first recompute_num_layers blocks of each pipeline stage (each virtual stage under "
                "interleaving) from its input and keeps the others' activations; \"uniform\" recomputes every "
                "block, in groups of recompute_num_layers blocks that keep only the group's input",
                {"block", "uniform"}));
  v.push_back(i("model.recompute_num_layers", 0, 0,
                "with recompute_granularity = \"full\": blocks recomputed per stage (method block; 0 = every "
                "block), or blocks per group (method uniform; 0 = 1)"));
  v.push_back(open_table("model.layer",
                         "[model.layer.NAME] configures layer instance NAME: plugin (default NAME) "
                         "and that plugin's options"));
  // parallel
  v.push_back(i("parallel.tp", 1, 1, "tensor-parallel size", kMaxGroupSize));
  v.push_back(i("parallel.pp", 1, 1, "pipeline-parallel size (stages)", kMaxGroupSize));
  v.push_back(i("parallel.vpp", 1, 1, "virtual pipeline chunks per stage (interleaved schedule)", kMaxGroupSize));
  v.push_back(i("parallel.cp", 1, 1, "context-parallel size: the sequence is split over cp ranks, 2*cp chunks with each rank holding an early and a late one (causal balance); model.seq_length must be divisible by 2*cp",
                kMaxGroupSize));
  v.push_back(i("parallel.ep", 1, 1, "expert-parallel size", kMaxGroupSize));
  v.push_back(i("parallel.etp", 0, 0,
                "expert tensor-parallel size (0 = same as tp; 1 under tp > 1 with sequence parallelism folds "
                "the experts into ep: whole experts per rank, ep groups spanning tp ranks)",
                kMaxGroupSize));
  v.push_back(i("parallel.dp", 1, 1, "data-parallel size", kMaxGroupSize));
  {
    KeySpec k = s("parallel.order", "tp-cp-ep-dp-pp",
                  "rank-group order, fastest-varying first ('-'-joined permutation of tp,cp,ep,dp,pp)");
    k.check = check_order;
    v.push_back(std::move(k));
  }
  v.push_back(b("parallel.sequence_parallel", false,
                "shard layer-norm/dropout activations along the sequence over tp"));
  v.push_back(s("parallel.tensor", "tensor",
                "tensor-parallel service the layers call (plugin parallel/NAME, ABI 1.1)"));
  v.push_back(s("parallel.expert", "expert",
                "expert-parallel token dispatcher MoE layers call when ep > 1 (plugin parallel/NAME, ABI 1.4): "
                "expert = all-to-all, expert.allgather = all-gather + reduce-scatter"));
  // pipeline
  v.push_back(s("pipeline.schedule", "1f1b", "pipeline schedule plugin (parallel/pipeline.NAME)"));
  v.push_back(i("pipeline.microbatch_group_size", 0, 0,
                "microbatches per interleaving group (0 = pp)", kMaxBatch));
  v.push_back(i("pipeline.first_chunk_layers", 0, 0,
                "transformer layers in the first pipeline chunk, which also holds the embedding (0 = even split)",
                kMaxCount));
  v.push_back(i("pipeline.last_chunk_layers", 0, 0,
                "transformer layers in the last pipeline chunk, which also holds the output layer (0 = even split)",
                kMaxCount));
  {
    KeySpec k = key("pipeline.chunk_layers", KeyType::Array, "[]",
                    "transformer layers in each pipeline chunk, pp * vpp counts in model order (stage s's virtual "
                    "chunk v is chunk v * pp + s), e.g. [2, 4, 4, 3] to give the stages holding the embedding and "
                    "the output layer fewer blocks, or to balance dense and MoE blocks (Megatron-Core's "
                    "--pipeline-model-parallel-layout); the first and last may be 0 ([] = first_chunk_layers / "
                    "last_chunk_layers, else even)");
    k.check = check_chunk_layers;
    v.push_back(std::move(k));
  }
  v.push_back(b("pipeline.overlap_p2p_comm", true,
                "post each step's receive before the step ahead of it computes, so the transfer runs meanwhile "
                "(Megatron-LM's overlap_p2p_comm; bit-identical; overlaps where the comm plugin can start a receive: "
                "comm/local, comm/mpi, comm/nccl)"));
  v.push_back(open_table("pipeline.options", "options of the schedule plugin"));
  // batch
  v.push_back(i("batch.micro_batch_size", 4, 1, "sequences per microbatch", kMaxBatch));
  v.push_back(i("batch.global_batch_size", 32, 1, "sequences per optimizer step, over all dp ranks", kMaxBatch));
  {
    // Megatron-LM's --rampup-batch-size <start> <increment> <samples>.
    KeySpec k = key("batch.rampup_batch_size", KeyType::Array, "[]",
                    "[start, increment, samples] (Megatron-LM's --rampup-batch-size): the global batch starts at "
                    "start sequences and grows by increment each samples / ((global_batch_size - start) / "
                    "increment) training samples until global_batch_size; the learning-rate schedule follows the "
                    "samples with optimizer.*_samples ([] = no ramp)");
    k.check = [](const toml::node& v) -> std::string {
      const toml::array& a = *v.as_array();
      if (a.empty()) return "";
      if (a.size() != 3) return "be [start, increment, samples], three integers";
      for (size_t i = 0; i < 3; ++i) {
        const int64_t most = i < 2 ? static_cast<int64_t>(kMaxBatch) : int64_t{1} << 53;
        if (!a.get(i)->is_integer() || a.get(i)->as_integer()->get() < 1 || a.get(i)->as_integer()->get() > most)
          return "be [start, increment, samples], three integers: start and increment in [1, " +
                 std::to_string(static_cast<int64_t>(kMaxBatch)) + "], samples in [1, 2^53] (position " +
                 std::to_string(i + 1) + ")";
      }
      return "";
    };
    v.push_back(std::move(k));
  }
  // optimizer
  v.push_back(s("optimizer.strategy", "ddp",
                "optimizer strategy plugin (parallel/NAME): \"ddp\" (data-parallel all-reduce), \"distributed\" "
                "(Megatron-LM's distributed optimizer, ZeRO-1), or a third party's"));
  v.push_back(f("optimizer.lr", "1e-3", 0, true, "peak learning rate"));
  v.push_back(f("optimizer.min_lr", "0.0", 0, false, "learning rate at the end of the decay"));
  v.push_back(i("optimizer.warmup_steps", 0, 0,
                "linear warmup steps (a schedule in samples has optimizer.warmup_samples instead)"));
  v.push_back(s("optimizer.decay_style", "cosine",
                "the learning rate after the warmup (Megatron's --lr-decay-style): \"cosine\" or \"linear\" from lr "
                "to min_lr at decay_steps; \"constant\" stays at lr; \"inverse-square-root\" is lr * "
                "sqrt(max(warmup_steps, 1) / step), at least min_lr; \"wsd\" (warmup-stable-decay) stays at lr until the "
                "last wsd_decay_steps before decay_steps, then decays to min_lr (wsd_decay_style); every style "
                "but constant is min_lr after decay_steps. A schedule in samples reads the *_samples marks and the "
                "samples consumed through each step instead",
                {"cosine", "linear", "constant", "inverse-square-root", "wsd"}));
  v.push_back(i("optimizer.decay_steps", 0, 0,
                "the step the decay ends at, counted from the start (more than warmup_steps; 0 = run.steps)"));
  v.push_back(i("optimizer.wsd_decay_steps", 0, 0,
                "with decay_style = \"wsd\" (Megatron's --lr-wsd-decay-steps): the steps of the final decay, which "
                "ends at decay_steps (1 to decay_steps - warmup_steps)"));
  v.push_back(s("optimizer.wsd_decay_style", "exponential",
                "with decay_style = \"wsd\" (Megatron's --lr-wsd-decay-style): the shape of the final decay from lr "
                "to min_lr: \"exponential\" (2 * 0.5^r - 1 of the way), \"linear\", \"cosine\" or "
                "\"minus_sqrt\" (1 - sqrt(r)), r the fraction of the decay done",
                {"exponential", "linear", "cosine", "minus_sqrt"}));
  v.push_back(i("optimizer.warmup_samples", 0, 0,
                "the warmup in training samples (Megatron's --lr-warmup-samples). An optimizer.*_samples key the "
                "decay style reads, or run.train_samples without a *_steps mark, counts the whole schedule in "
                "samples: a step stands at the samples consumed through it, so a batch ramp "
                "(batch.rampup_batch_size) decays by the data seen, not by the steps"));
  v.push_back(f("optimizer.warmup_fraction", "0.0", 0, false,
                "the warmup as a share of the schedule up to the decay's end (Megatron's --lr-warmup-fraction): "
                "warmup_fraction x decay_steps (or decay_samples, or the run's length when 0), instead of "
                "warmup_steps or warmup_samples (0 = those)",
                1, true));
  v.push_back(i("optimizer.decay_samples", 0, 0,
                "the training samples the decay ends at (Megatron's --lr-decay-samples; more than warmup_samples; 0 = "
                "run.train_samples, or the samples of run.steps)"));
  v.push_back(i("optimizer.wsd_decay_samples", 0, 0,
                "with decay_style = \"wsd\" and the schedule in samples (Megatron's --lr-wsd-decay-samples): the "
                "samples of the final decay, which ends at decay_samples"));
  v.push_back(f("optimizer.beta1", "0.9", 0, false, "Adam beta1", 1, true));
  v.push_back(f("optimizer.beta2", "0.95", 0, false, "Adam beta2", 1, true));
  v.push_back(f("optimizer.eps", "1e-8", 0, true, "Adam epsilon"));
  v.push_back(f("optimizer.weight_decay", "0.1", 0, false,
                "decoupled weight decay (with weight_decay_incr_style = \"constant\")"));
  v.push_back(s("optimizer.weight_decay_incr_style", "constant",
                "the weight decay over the run (Megatron's --weight-decay-incr-style): \"constant\" is weight_decay; "
                "\"linear\" or \"cosine\" (a half cosine) go from start_weight_decay at the start to "
                "end_weight_decay at the run's end (its steps, or samples when the schedule counts samples)",
                {"constant", "linear", "cosine"}));
  v.push_back(f("optimizer.start_weight_decay", "0.0", 0, false,
                "with weight_decay_incr_style linear or cosine: the weight decay at the start (Megatron's "
                "--start-weight-decay)"));
  v.push_back(f("optimizer.end_weight_decay", "0.0", 0, false,
                "with weight_decay_incr_style linear or cosine: the weight decay at the run's end (Megatron's "
                "--end-weight-decay)"));
  v.push_back(f("optimizer.clip_grad", "1.0", 0, false, "global gradient-norm clip (0 = off)"));
  // The optimizer plugins take these as 32-bit floats (loom_optimizer_step_args).
  for (KeySpec& k : v)
    if (k.type == KeyType::Float && k.path.rfind("optimizer.", 0) == 0) k.single_precision = true;
  v.push_back(i("optimizer.bucket_size", 0, 0,
                "gradient bucket size in elements (0 = one bucket per model chunk; with overlap_grad_reduce, "
                "Megatron-LM's 40,000,000)"));
  v.push_back(b("optimizer.overlap_grad_reduce", false,
                "reduce each gradient bucket over dp while the backward is still running (Megatron-LM's "
                "overlap_grad_reduce): the strategy starts a bucket's collective once its gradients are final and "
                "waits for it in the optimizer step; results are the same as without"));
  v.push_back(b("optimizer.overlap_param_gather", false,
                "leave the distributed optimizer's all-gather of updated parameters running after the step and "
                "wait for each bucket only when the next forward reaches its first layer (Megatron-LM's "
                "overlap_param_gather; a strategy with LOOM_OPTIMIZER_OVERLAP_PARAM_GATHER, as "
                "\"distributed\"); results are the same as without"));
  v.push_back(open_table("optimizer.options", "options of the optimizer strategy plugin"));
  // exec
  v.push_back(s("exec.mode", "eager",
                "execution-mode plugin (exec/NAME): eager runs every layer step directly; partial_graph captures "
                "the capturable ones (attention, MLP, the MoE router's parts; tp = 1) into device graphs and "
                "replays them"));
  v.push_back(open_table("exec.options", "options of the exec plugin"));
  // device
  v.push_back(s("device.kind", "cpu", "device plugin (device/NAME)"));
  v.push_back(s("device.param_dtype", "fp32",
                "parameter and activation dtype (bf16: bf16 weights, activations and hidden states; fp32 master "
                "weights and moments in the optimizer; loss and softmax/layernorm statistics in fp32)",
                {"fp32", "bf16"}));
  v.push_back(s("device.grad_dtype", "fp32", "gradient dtype (the gradient buffer and its data-parallel reduction)",
                {"fp32", "bf16"}));
  v.push_back(b("device.grad_accumulation_fusion", true,
                "bf16 parameters with fp32 gradients: true = the backward ops accumulate straight into the "
                "fp32 gradients (Megatron's gradient-accumulation fusion; with device and tensor-parallel "
                "plugins of ABI 1.2, else as false); false = each microbatch's gradients in bf16 first, "
                "then added"));
  v.push_back(i("device.threads", 0, 0, "compute threads per rank (0 = auto)", kMaxThreads));
  v.push_back(f("device.peak_tflops", "0.0", 0, false,
                "peak TFLOP/s for MFU (0 = use the device's own figure)"));
  v.push_back(open_table("device.options", "options of the device plugin"));
  // comm
  v.push_back(s("comm.backend", "local", "communication plugin (comm/NAME)"));
  v.push_back(f("comm.timeout_s", "300.0", 0, true, "collective timeout in seconds (at least 1 ms is waited)",
                1e9));
  v.push_back(open_table("comm.options", "options of the comm plugin"));
  // data
  v.push_back(s("data.kind", "synthetic", "data source: synthetic, text (bytes), tokens (llm.c .bin), indexed "
                "(Megatron .bin/.idx, e.g. from loom preprocess), chat (conversations for supervised fine-tuning: "
                "a JSONL file of Megatron-LM's SFT format, {\"messages\": [{\"role\", \"content\"}, ...]} a line, "
                "written with data.chat_template and tokenized by data.tokenizer when the run starts; the loss "
                "counts the assistant's turns only; a line is one sample, cut after seq_length + 1 tokens or "
                "padded; a system message after the first starts another conversation of the line, which "
                "ends with the end-of-document token, so data.reset_attention_mask keeps them apart)",
                {"synthetic", "text", "tokens", "indexed", "chat"}));
  v.push_back(s("data.path", "", "file to read for kind text, tokens or chat; the PREFIX of PREFIX.bin/.idx for indexed"));
  {
    // Megatron-LM's --data-path with weights: [0.3, "a", 0.7, "b"].
    KeySpec k = key("data.blend", KeyType::Array, "[]",
                    "kind indexed or tokens: several datasets mixed by weight, Megatron-LM's --data-path "
                    "[w1, \"prefix1\", w2, \"prefix2\", ...] (weights normalised; each split blended alike)");
    k.check = [](const toml::node& v) -> std::string {
      const toml::array& a = *v.as_array();
      if (a.empty()) return "";
      if (a.size() % 2 != 0) return "be pairs of a weight and a path, [w1, \"path1\", w2, \"path2\", ...]";
      for (size_t i = 0; i < a.size(); i += 2) {
        const toml::node& w = *a.get(i);
        const double x = w.is_integer() ? static_cast<double>(w.as_integer()->get())
                                        : w.is_floating_point() ? w.as_floating_point()->get() : -1.0;
        if (!(x > 0) || !std::isfinite(x)) return "have a positive weight at position " + std::to_string(i + 1);
        if (!a.get(i + 1)->is_string() || a.get(i + 1)->as_string()->get().empty())
          return "have a non-empty path after each weight (position " + std::to_string(i + 2) + ")";
      }
      return "";
    };
    v.push_back(std::move(k));
  }
  v.push_back(s("data.tokenizer", "",
                "kind indexed or tokens: the tokenizer the token files were made with (a GPT-2 BPE directory or a "
                "SentencePiece .model, as loom preprocess took it): the model's vocabulary is its size when "
                "model.vocab_size is 0 (not the largest id the data holds), and loom generate, eval and export "
                "use it when not given --tokenizer; kind chat: the tokenizer the conversations are encoded with"));
  v.push_back(s("data.chat_template", "",
                "kind chat: how a conversation is written, \"chatml\" (<|im_start|>ROLE ... <|im_end|>: Qwen) or "
                "\"llama3\" (<|start_header_id|>ROLE<|end_header_id|> ... <|eot_id|>); \"\" = the one data.tokenizer's "
                "directory declares (chat_template.jinja or tokenizer_config.json; loom generate --chat writes "
                "prompts with it too)",
                chat_template_values()));
  v.push_back(b("data.chat_packing", false,
                "kind chat: the lines are packed once (in a seeded order, as NeMo packs SFT data), a sample as many "
                "whole lines as fit in seq_length + 1 tokens (a longer line alone, cut), and the packs shuffled "
                "each epoch: less padding; with "
                "data.reset_attention_mask = true and reset_position_ids = true each conversation computes as it "
                "would alone"));
  v.push_back(f("data.val_fraction", "0.1", 0, false, "fraction held out for validation", 0.5));
  v.push_back(b("data.eod_mask_loss", false,
                "no loss where the input token is the end-of-document token (Megatron-LM's --eod-mask-loss): a "
                "packed sample does not learn to predict a document's first token from the one before it"));
  v.push_back(i("data.eod_token", -1, -1,
                "the end-of-document token id data.eod_mask_loss and the document resets look for; -1 = "
                "data.tokenizer's (<|endoftext|>, </s>)"));
  v.push_back(b("data.reset_attention_mask", false,
                "a position attends only to its own document's positions, documents ending at end-of-document tokens "
                "(Megatron-LM's --reset-attention-mask; Llama 3's document masking)"));
  v.push_back(b("data.reset_position_ids", false,
                "positions count from each document's start, documents ending at end-of-document tokens "
                "(Megatron-LM's --reset-position-ids): rotary and learned position embeddings"));
  v.push_back(s("data.task", "add", "synthetic task name"));
  v.push_back(i("data.digits", 3, 1, "synthetic task size (digits)", 9));
  // checkpoint
  v.push_back(s("checkpoint.dir", "", "checkpoint directory (\"\" = no checkpoints)"));
  v.push_back(i("checkpoint.every", 0, 0, "checkpoint every N steps (0 = only at the end and on signals)"));
  v.push_back(i("checkpoint.keep_last", 0, 0,
                "after each save, remove the checkpoints before it but the newest keep_last - 1 (TorchTitan's "
                "keep_latest_k), so checkpoint.dir holds keep_last steps; steps after the saved one and "
                "unfinished saves are left alone (0 = keep all)"));
  v.push_back(b("checkpoint.async_save", false,
                "write the checkpoints of checkpoint.every beside training (Megatron-LM's --async-save): training "
                "waits while each rank's parameters and optimizer state are copied into host memory (as much "
                "host memory again) and for the commit, a thread of each rank writes its files, and the step "
                "directory appears at the first step by which every rank has written (the next save, a stop and "
                "the end wait for a write still running); the checkpoints at a stop signal and at the end are "
                "written in line; the files are the same bytes"));
  v.push_back(s("checkpoint.init_weights", "",
                "start from these weights instead of the random initialization (fine-tuning): a loom checkpoint "
                "(a step_N directory, or a checkpoint directory: its newest step) of any parallel layout, or a "
                "Hugging Face model directory (config.json + model.safetensors of GPT2LMHeadModel or "
                "LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, "
                "Qwen3ForCausalLM, "
                "Qwen3MoeForCausalLM, "
                "DeepseekV2ForCausalLM or DeepseekV3ForCausalLM); the "
                "model must be the checkpoint's but for how far attention reaches (sliding_window, rotary_base, "
                "rope_scaling and its factors: context extension), which the run names; the optimizer starts fresh at "
                "step 0; not read when resuming from a checkpoint (--resume before the first checkpoint starts from "
                "it) (\"\" = none)"));
  // plugins
  v.push_back(sl("plugins.search_paths", "[]",
                 "extra plugin directories (relative to the manifest file naming them)"));
  return v;
}

}  // namespace

std::optional<BlockRun> parse_block_run(const std::string& entry) {
  BlockRun run;
  const size_t star = entry.find('*');
  run.name = entry.substr(0, star);
  if (run.name.empty()) return std::nullopt;
  if (star == std::string::npos) return run;
  const std::string digits = entry.substr(star + 1);
  if (digits.empty() || digits.size() > 5 || digits.find_first_not_of("0123456789") != std::string::npos)
    return std::nullopt;
  run.count = std::stoll(digits);
  if (run.count < 1 || run.count > static_cast<int64_t>(kMaxCount)) return std::nullopt;
  return run;
}

std::optional<std::vector<std::string>> expand_block_pattern(const std::vector<std::string>& pattern, int64_t limit) {
  std::vector<std::string> out;
  for (const std::string& entry : pattern) {
    const std::optional<BlockRun> run = parse_block_run(entry);
    if (!run) return std::nullopt;
    if (run->count > limit - static_cast<int64_t>(out.size())) return std::nullopt;
    out.insert(out.end(), static_cast<size_t>(run->count), run->name);
  }
  return out;
}

std::string block_composition(const toml::table& resolved) {
  // A list of layer names as [a, b]; anything else as TOML.
  auto text = [](const toml::node* n, const char* fallback) {
    if (n == nullptr) return std::string(fallback);
    std::ostringstream os;
    if (const toml::array* a = n->as_array(); a != nullptr && a->is_homogeneous(toml::node_type::string)) {
      os << "[";
      for (size_t i = 0; i < a->size(); ++i) os << (i > 0 ? ", " : "") << a->get(i)->value_or(std::string());
      os << "]";
    } else {
      os << toml::node_view<const toml::node>(n);
    }
    return os.str();
  };
  const std::string block = text(resolved.at_path("model.block").node(), "[attention, mlp]");
  const int64_t layers = resolved.at_path("model.num_layers").value_or(int64_t{4});
  std::vector<std::string> pattern;
  if (const toml::array* a = resolved.at_path("model.block_pattern").as_array())
    for (const toml::node& e : *a) pattern.push_back(e.value_or(std::string()));
  std::vector<std::pair<std::string, int64_t>> runs;
  auto add = [&](const std::string& layers_text, int64_t count) {
    if (!runs.empty() && runs.back().first == layers_text) runs.back().second += count;
    else runs.emplace_back(layers_text, count);
  };
  const std::optional<std::vector<std::string>> kinds = expand_block_pattern(pattern, layers);
  if (pattern.empty() || !kinds) {  // every block model.block (or a pattern loom would refuse: as written)
    if (!pattern.empty()) return "model.block_pattern = " + text(resolved.at_path("model.block_pattern").node(), "");
    add(block, layers);
  } else {
    const toml::table* defined = resolved.at_path(kBlockTable).as_table();
    for (const std::string& kind : *kinds)
      add(kind == kDefaultBlock ? block : text(defined != nullptr ? defined->get(kind) : nullptr, "(undefined)"), 1);
  }
  std::string out;
  for (const auto& [layers_text, count] : runs)
    out += (out.empty() ? "" : ", ") + layers_text + " x " + std::to_string(count);
  return out;
}

std::string_view describe(KeyType type) {
  switch (type) {
    case KeyType::Bool: return "a boolean";
    case KeyType::Int: return "an integer";
    case KeyType::Float: return "a float";
    case KeyType::String: return "a string";
    case KeyType::StringList: return "an array of strings";
    case KeyType::Array: return "an array";
    case KeyType::Table: return "a table";
  }
  return "a value";
}

std::string KeySpec::section() const { return path.substr(0, path.find('.')); }
std::string KeySpec::name() const { return path.substr(path.find('.') + 1); }

const std::vector<KeySpec>& keys() {
  static const std::vector<KeySpec> all = build();
  return all;
}

const KeySpec* find(std::string_view path) {
  for (const KeySpec& k : keys())
    if (k.path == path) return &k;
  return nullptr;
}

toml::table default_of(std::string_view path) {
  const KeySpec* spec = find(path);
  if (spec == nullptr || !spec->default_value) return {};
  return toml::parse("v = " + *spec->default_value);  // the schema's defaults are TOML literals
}

const std::vector<std::string>& sections() {
  static const std::vector<std::string> all = [] {
    std::vector<std::string> out;
    for (const KeySpec& k : keys())
      if (std::find(out.begin(), out.end(), k.section()) == out.end()) out.push_back(k.section());
    return out;
  }();
  return all;
}

std::vector<std::string> section_keys(std::string_view section) {
  std::vector<std::string> out;
  for (const KeySpec& k : keys())
    if (k.section() == section) out.push_back(k.name());
  return out;
}

std::optional<int64_t> launcher_world_size(std::string* var) {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"}) {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') continue;
    int64_t n = 0;
    const char* end = v + std::char_traits<char>::length(v);
    auto res = std::from_chars(v, end, n);
    if (res.ec != std::errc() || res.ptr != end || n <= 0) continue;
    if (var != nullptr) *var = name;
    return n;
  }
  return std::nullopt;
}

int64_t resolved_steps(const Manifest& m) {
  const int64_t samples = m.get_int("run.train_samples");
  return samples > 0 ? steps_for_samples(RunConfig::batch_from(m), samples) : m.get_int("run.steps");
}

int64_t resolved_ffn_hidden_size(const Manifest& m) {
  int64_t ffn = m.get_int("model.ffn_hidden_size");
  return ffn == 0 ? 4 * m.get_int("model.hidden_size") : ffn;
}

int64_t resolved_etp(const Manifest& m) {
  int64_t etp = m.get_int("parallel.etp");
  return etp == 0 ? m.get_int("parallel.tp") : etp;
}

namespace {

std::string divisors_text(int64_t n, int64_t limit = 12) {
  std::ostringstream os;
  int shown = 0;
  for (int64_t d = 1; d <= n; ++d) {
    if (n % d != 0) continue;
    if (shown == limit) {
      os << ", ...";
      break;
    }
    os << (shown++ ? ", " : "") << d;
  }
  return os.str();
}

}  // namespace

void check_rules(const Manifest& m, const std::set<std::string>& bad,
                 std::vector<Diagnostic>& diags) {
  // A rule applies only when all its keys are valid; it is reported at the first
  // key, at the first key that was actually written when the first is a default.
  auto usable = [&](std::initializer_list<const char*> ks) {
    for (const char* k : ks)
      if (bad.count(k) || !m.contains(k)) return false;
    return true;
  };
  auto report = [&](std::initializer_list<const char*> ks, std::string msg) {
    const std::string first = *ks.begin();
    Origin where = m.origin(first);
    if (where.kind == Origin::Kind::Default) {
      for (const char* k : ks) {
        Origin o = m.origin(k);
        if (o.kind != Origin::Kind::Default) {
          where = o;
          break;
        }
      }
    }
    diags.push_back(Diagnostic{first, where, std::move(msg)});
  };
  auto I = [&](const char* k) { return m.get_int(k); };
  auto S = [](int64_t v) { return std::to_string(v); };
  auto G = [](double v) {
    std::ostringstream os;
    os << v;
    return os.str();
  };

  // A microbatch's widest activation (the logits, or the MLP's inner activation).
  if (usable({"model.seq_length", "batch.micro_batch_size", "model.hidden_size", "model.ffn_hidden_size",
              "model.vocab_size"})) {
    const double width = std::max({static_cast<double>(I("model.hidden_size")),
                                   static_cast<double>(resolved_ffn_hidden_size(m)),
                                   static_cast<double>(I("model.vocab_size"))});
    const double elems = static_cast<double>(I("model.seq_length")) * static_cast<double>(I("batch.micro_batch_size")) * width;
    if (elems > kMaxActivation) {
      std::ostringstream os;
      os << "a microbatch's widest activation, model.seq_length x batch.micro_batch_size x " << std::fixed
         << std::setprecision(0) << width << " (the widest of hidden, MLP and vocab) = " << elems
         << " elements, is more than loom holds in one tensor (2^48)";
      report({"model.seq_length", "batch.micro_batch_size"}, os.str());
    }
  }

  // The world first: the rules below multiply the group sizes, each at most 2^20.
  bool world_ok = true;
  if (usable({"parallel.tp", "parallel.cp", "parallel.pp", "parallel.dp"})) {
    const double world = static_cast<double>(I("parallel.tp")) * static_cast<double>(I("parallel.cp")) *
                         static_cast<double>(I("parallel.pp")) * static_cast<double>(I("parallel.dp"));
    if (world > static_cast<double>(kMaxWorld)) {
      world_ok = false;
      std::ostringstream os;
      os << "world size tp\u00b7cp\u00b7pp\u00b7dp = " << I("parallel.tp") << "\u00b7" << I("parallel.cp") << "\u00b7"
         << I("parallel.pp") << "\u00b7" << I("parallel.dp") << " = " << std::fixed << std::setprecision(0) << world
         << " ranks is more than loom runs (" << kMaxWorld << ")";
      // Keyed to the largest factor, the one most likely mistyped.
      const int64_t biggest = std::max({I("parallel.tp"), I("parallel.cp"), I("parallel.pp"), I("parallel.dp")});
      if (I("parallel.pp") == biggest) report({"parallel.pp", "parallel.tp", "parallel.cp", "parallel.dp"}, os.str());
      else if (I("parallel.dp") == biggest) report({"parallel.dp", "parallel.tp", "parallel.cp", "parallel.pp"}, os.str());
      else if (I("parallel.cp") == biggest) report({"parallel.cp", "parallel.tp", "parallel.pp", "parallel.dp"}, os.str());
      else report({"parallel.tp", "parallel.cp", "parallel.pp", "parallel.dp"}, os.str());
    }
  }

  if (usable({"model.num_heads", "parallel.tp"}) && I("model.num_heads") % I("parallel.tp") != 0)
    report({"model.num_heads", "parallel.tp"},
           "model.num_heads (" + S(I("model.num_heads")) + ") must be divisible by parallel.tp (" +
               S(I("parallel.tp")) + ") so each tensor-parallel rank holds whole heads; tp could be " +
               divisors_text(I("model.num_heads")));

  if (usable({"model.ffn_hidden_size", "model.hidden_size", "parallel.tp"})) {
    int64_t ffn = resolved_ffn_hidden_size(m), tp = I("parallel.tp");
    if (ffn % tp != 0) {
      std::string what = I("model.ffn_hidden_size") == 0
                             ? "model.ffn_hidden_size (0 = 4 * model.hidden_size = " + S(ffn) + ")"
                             : "model.ffn_hidden_size (" + S(ffn) + ")";
      report({"model.ffn_hidden_size", "model.hidden_size", "parallel.tp"},
             what + " must be divisible by parallel.tp (" + S(tp) +
                 ") so each tensor-parallel rank holds an equal slice of the MLP");
    }
  }

  if (usable({"model.hidden_size", "model.num_heads"}) &&
      I("model.hidden_size") % I("model.num_heads") != 0)
    report({"model.hidden_size", "model.num_heads"},
           "model.hidden_size (" + S(I("model.hidden_size")) + ") must be divisible by model.num_heads (" +
               S(I("model.num_heads")) + "); num_heads could be " +
               divisors_text(I("model.hidden_size")));

  // model.block_pattern: names that exist, num_layers blocks in all.
  if (usable({"model.block_pattern", "model.num_layers"}) && !bad.count(std::string(kBlockTable))) {
    const std::vector<std::string> pattern = m.get_string_list("model.block_pattern");
    const toml::table* kinds = m.get_table(std::string(kBlockTable));
    int64_t total = 0;
    std::string unknown;
    for (const std::string& entry : pattern) {
      const std::optional<BlockRun> run = parse_block_run(entry);
      if (!run) continue;  // the key's own check reported it
      total += run->count;
      if (run->name != kDefaultBlock && (kinds == nullptr || !kinds->contains(run->name)) && unknown.empty())
        unknown = run->name;
    }
    if (!unknown.empty()) {
      std::string defined = "block";
      if (kinds != nullptr)
        for (auto&& [k, v] : *kinds) defined += ", " + std::string(k.str());
      report({"model.block_pattern"}, "model.block_pattern names block '" + unknown +
                                          "', which is neither model.block (\"block\") nor an entry of "
                                          "model.blocks (defined: " + defined + ")");
    }
    if (!pattern.empty() && total != I("model.num_layers"))
      report({"model.block_pattern", "model.num_layers"},
             "model.block_pattern describes " + S(total) + " block(s), but model.num_layers is " +
                 S(I("model.num_layers")) + ": give one block for each (\"NAME*N\" for N in a row)");
  }

  if (usable({"model.num_layers", "parallel.pp", "parallel.vpp", "pipeline.first_chunk_layers",
              "pipeline.last_chunk_layers", "pipeline.chunk_layers"})) {
    const int64_t layers = I("model.num_layers"), pp = I("parallel.pp"), vpp = I("parallel.vpp");
    const int64_t first = I("pipeline.first_chunk_layers"), last = I("pipeline.last_chunk_layers");
    std::vector<int> each;
    for (auto&& e : *m.table().at_path("pipeline.chunk_layers").as_array())
      each.push_back(static_cast<int>(e.value_or(int64_t{0})));
    if (!each.empty()) {
      if (first > 0 || last > 0)
        report({"pipeline.chunk_layers", first > 0 ? "pipeline.first_chunk_layers" : "pipeline.last_chunk_layers"},
               "pipeline.chunk_layers gives every chunk its blocks; pipeline.first_chunk_layers and "
               "last_chunk_layers size chunks too: set one or the other");
      else if (pp * vpp > 1 && pp * vpp <= kMaxCount)  // one chunk: run_plan warns that they change nothing
        try {
          topology::blocks_per_chunk(static_cast<int>(layers), static_cast<int>(pp), static_cast<int>(vpp), 0, 0,
                                     each);
        } catch (const std::invalid_argument& e) {
          report({"pipeline.chunk_layers", "model.num_layers", "parallel.pp", "parallel.vpp"}, e.what());
        }
    } else if (first == 0 && last == 0) {
      if (layers % (pp * vpp) != 0)
        report({"model.num_layers", "parallel.pp", "parallel.vpp"},
               "model.num_layers (" + S(layers) + ") must be divisible by parallel.pp * parallel.vpp (" + S(pp) + "*" +
                   S(vpp) + " = " + S(pp * vpp) +
                   ") so every pipeline stage and virtual chunk gets the same number of layers, or set "
                   "pipeline.first_chunk_layers / pipeline.last_chunk_layers, or pipeline.chunk_layers, for an "
                   "uneven split");
    } else {
      try {
        topology::blocks_per_chunk(static_cast<int>(layers), static_cast<int>(pp), static_cast<int>(vpp),
                                   static_cast<int>(first), static_cast<int>(last));
      } catch (const std::invalid_argument& e) {
        report({first > 0 ? "pipeline.first_chunk_layers" : "pipeline.last_chunk_layers", "model.num_layers",
                "parallel.pp", "parallel.vpp"},
               std::string("pipeline.first_chunk_layers / pipeline.last_chunk_layers: ") + e.what());
      }
    }
  }

  if (usable({"parallel.vpp", "parallel.pp"}) && I("parallel.vpp") > 1 && I("parallel.pp") <= 1)
    report({"parallel.vpp", "parallel.pp"},
           "parallel.vpp = " + S(I("parallel.vpp")) +
               " (interleaved pipeline) requires parallel.pp > 1, got pp = " + S(I("parallel.pp")) +
               "; set pp > 1 or vpp = 1");

  if (usable({"batch.global_batch_size", "batch.micro_batch_size", "parallel.dp"})) {
    int64_t gbs = I("batch.global_batch_size"), mbs = I("batch.micro_batch_size"),
            dp = I("parallel.dp");
    if (gbs % (mbs * dp) != 0)
      report({"batch.global_batch_size", "batch.micro_batch_size", "parallel.dp"},
             "batch.global_batch_size (" + S(gbs) +
                 ") must be divisible by batch.micro_batch_size * parallel.dp (" + S(mbs) + "*" +
                 S(dp) + " = " + S(mbs * dp) +
                 ") so each of the dp ranks runs a whole number of microbatches");
    const toml::array* ramp = m.table().at_path("batch.rampup_batch_size").as_array();
    if (usable({"batch.rampup_batch_size"}) && ramp != nullptr && ramp->size() == 3) {
      const int64_t start = ramp->get(0)->value_or(int64_t{0}), step = ramp->get(1)->value_or(int64_t{0});
      if (start >= gbs)
        report({"batch.rampup_batch_size", "batch.global_batch_size"},
               "batch.rampup_batch_size starts at " + S(start) + " sequences, which is not below "
               "batch.global_batch_size = " + S(gbs) + ": there is nothing to ramp");
      else if ((gbs - start) % step != 0)
        report({"batch.rampup_batch_size", "batch.global_batch_size"},
               "batch.rampup_batch_size grows by " + S(step) + " from " + S(start) +
                   ", which does not reach batch.global_batch_size = " + S(gbs) + " (" + S(gbs - start) +
                   " is not a multiple of " + S(step) + ")");
      else if (start % (mbs * dp) != 0 || step % (mbs * dp) != 0)
        report({"batch.rampup_batch_size", "batch.micro_batch_size", "parallel.dp"},
               "batch.rampup_batch_size = [" + S(start) + ", " + S(step) + ", ...]: the start and the increment " +
                   "must be multiples of batch.micro_batch_size * parallel.dp (" + S(mbs * dp) +
                   ") so each of the dp ranks runs a whole number of microbatches at every batch of the ramp");
    }
  }

  // Context parallelism: each cp rank holds chunks r and 2cp-1-r of 2*cp equal ones.
  const bool cp_splits = usable({"parallel.cp", "model.seq_length"}) && I("parallel.cp") > 1 &&
                         I("model.seq_length") % (2 * I("parallel.cp")) == 0;
  if (usable({"parallel.cp", "model.seq_length"}) && I("parallel.cp") > 1 && !cp_splits)
    report({"parallel.cp", "model.seq_length"},
           "parallel.cp = " + S(I("parallel.cp")) + " splits the sequence into 2*cp = " + S(2 * I("parallel.cp")) +
               " equal chunks (each cp rank holds an early and a late one), so model.seq_length (" +
               S(I("model.seq_length")) + ") must be divisible by " + S(2 * I("parallel.cp")) + "; cp could be " +
               // cp > 1 needs seq_length = 2 cp k: the divisors of seq_length / 2 when it is even
               (I("model.seq_length") % 2 == 0 ? divisors_text(I("model.seq_length") / 2) : std::string("1")));
  // Samples run the training model's layers one position at a time, which they do
  // with whole sequences on every rank only.
  if (usable({"run.sample_every", "parallel.cp", "parallel.sequence_parallel", "parallel.tp"}) &&
      I("run.sample_every") > 0 &&
      (I("parallel.cp") > 1 || (m.get_bool("parallel.sequence_parallel") && I("parallel.tp") > 1)))
    report({"run.sample_every", I("parallel.cp") > 1 ? "parallel.cp" : "parallel.sequence_parallel"},
           "run.sample_every = " + S(I("run.sample_every")) +
               " generates one position at a time, which the layers do without context or sequence "
               "parallelism; set run.sample_every = 0 and sample a checkpoint with `loom generate` (at any layout)");
  // Under sequence parallelism the rows each rank holds (the whole sequence, or its
  // cp slice) split over tp.
  if (usable({"parallel.sequence_parallel", "model.seq_length", "parallel.tp", "parallel.cp"}) &&
      m.get_bool("parallel.sequence_parallel") &&
      I("model.seq_length") % (I("parallel.tp") * I("parallel.cp")) != 0 &&
      (I("parallel.cp") == 1 || cp_splits))
    report({"parallel.sequence_parallel", "model.seq_length", "parallel.tp"},
           "parallel.sequence_parallel = true requires model.seq_length (" + S(I("model.seq_length")) +
               ") to be divisible by parallel.tp (" + S(I("parallel.tp")) + ")" +
               (I("parallel.cp") > 1 ? " times parallel.cp (" + S(I("parallel.cp")) + "): each cp rank's " +
                                           S(I("model.seq_length") / I("parallel.cp")) + " rows split over tp"
                                     : std::string()));

  if (world_ok && usable({"parallel.tp", "parallel.cp", "parallel.pp", "parallel.dp"})) {
    std::string var;
    if (auto launched = m.describes_this_launch() ? launcher_world_size(&var) : std::nullopt) {
      int64_t tp = I("parallel.tp"), cp = I("parallel.cp"), pp = I("parallel.pp"),
              dp = I("parallel.dp");
      int64_t world = tp * cp * pp * dp;
      if (tp > *launched)
        report({"parallel.tp"}, "parallel.tp (" + S(tp) + ") is larger than the world: the launcher started " +
                                    S(*launched) + " processes (" + var + "=" + S(*launched) +
                                    "); a tensor-parallel group needs parallel.tp ranks");
      else if (world != *launched)
        report({"parallel.tp", "parallel.cp", "parallel.pp", "parallel.dp"},
               "world size tp\u00b7cp\u00b7pp\u00b7dp = " + S(tp) + "\u00b7" + S(cp) + "\u00b7" +
                   S(pp) + "\u00b7" + S(dp) + " = " + S(world) + " but the launcher started " +
                   S(*launched) + " processes (" + var + "=" + S(*launched) +
                   "); make parallel.tp * parallel.cp * parallel.pp * parallel.dp equal " +
                   S(*launched));
    }
  }

  // Expert groups fold over the tp x cp x dp ranks (Megatron's expert generator
  // counts cp into edp); MoE layers route the whole microbatch under cp.
  if (usable({"parallel.ep", "parallel.etp", "parallel.dp", "parallel.cp", "parallel.tp"})) {
    int64_t ep = I("parallel.ep"), etp = resolved_etp(m), tp = I("parallel.tp"),
            dp = I("parallel.dp"), cp = I("parallel.cp");
    if (etp == tp) {
      if (ep > 1 && (dp * cp) % ep != 0)
        report({"parallel.ep", "parallel.dp", "parallel.cp"},
               "parallel.ep (" + S(ep) + ") must divide parallel.dp * parallel.cp (" + S(dp) + "*" +
                   S(cp) + " = " + S(dp * cp) +
                   ") (MoE folding: ep\u00b7etp\u00b7edp\u00b7pp = world); ep could be " +
                   divisors_text(dp * cp));
    } else if ((tp * cp * dp) % (ep * etp) != 0) {
      report({"parallel.ep", "parallel.etp", "parallel.tp", "parallel.cp", "parallel.dp"},
             "parallel.ep * parallel.etp (" + S(ep) + "*" + S(etp) + " = " + S(ep * etp) +
                 ") must divide parallel.tp * parallel.cp * parallel.dp (" + S(tp) + "*" + S(cp) +
                 "*" + S(dp) + " = " + S(tp * cp * dp) +
                 ") (MoE folding: ep\u00b7etp\u00b7edp\u00b7pp = world)");
    } else if (usable({"parallel.sequence_parallel"}) && !m.get_bool("parallel.sequence_parallel")) {
      // Folded, the tp ranks act as expert ranks of their own tokens: without SP
      // they would all hold the same tokens and count them tp times.
      report({"parallel.etp", "parallel.sequence_parallel"},
             "parallel.etp = " + S(etp) + " under parallel.tp = " + S(tp) +
                 " folds the experts' tensor parallelism into expert parallelism, which needs every tp rank to "
                 "hold other tokens; set parallel.sequence_parallel = true (or parallel.etp = 0, same as tp)");
    }
  }

  const bool blended = usable({"data.blend"}) && m.table().at_path("data.blend").is_array() &&
                       !m.table().at_path("data.blend").as_array()->empty();
  if (blended && usable({"data.kind", "data.path"})) {
    const std::string kind = m.get_string("data.kind");
    if (kind != "tokens" && kind != "indexed")
      report({"data.blend", "data.kind"}, "data.blend mixes token datasets: set data.kind = \"indexed\" (Megatron "
                                          ".bin/.idx prefixes) or \"tokens\" (llm.c files), not \"" + kind + "\"");
    else if (!m.get_string("data.path").empty())
      report({"data.blend", "data.path"}, "data.blend and data.path both name the data; keep one");
  }
  if (!blended && !bad.count("data.blend") && usable({"data.kind", "data.path"})) {
    std::string kind = m.get_string("data.kind");
    if ((kind == "text" || kind == "tokens" || kind == "indexed" || kind == "chat") && m.get_string("data.path").empty())
      report({"data.kind", "data.path"},
             "data.kind = \"" + kind + "\" requires data.path (the file to read), which is empty");
  }
  // A tokenizer names what token files' ids mean; text is bytes, a synthetic task its symbols.
  if (usable({"data.kind", "data.tokenizer"}) && !m.get_string("data.tokenizer").empty()) {
    const std::string kind = m.get_string("data.kind");
    if (kind != "tokens" && kind != "indexed" && kind != "chat")
      report({"data.tokenizer", "data.kind"},
             "data.tokenizer names the tokenizer of token files (data.kind = \"indexed\" or \"tokens\"); data.kind = \"" +
                 kind + "\" has its own symbols (" + (kind == "text" ? "bytes" : "the task's") +
                 "): make token files with loom preprocess --tokenizer, or leave data.tokenizer empty");
  }
  // Conversations are text: the tokenizer makes their tokens, the template their turns.
  if (usable({"data.kind", "data.tokenizer", "data.chat_template"})) {
    const bool chat = m.get_string("data.kind") == "chat";
    if (chat && m.get_string("data.tokenizer").empty())
      report({"data.kind", "data.tokenizer"}, "data.kind = \"chat\" encodes the conversations with data.tokenizer, "
                                              "which is empty (a tokenizer.json directory, e.g. the model's own)");
    if (!chat && usable({"data.chat_packing"}) && m.get_bool("data.chat_packing"))
      report({"data.chat_packing", "data.kind"}, "data.chat_packing packs conversations, which only data.kind = "
                                                 "\"chat\" reads; data.kind = \"" + m.get_string("data.kind") + "\"");
    if (!chat && !m.get_string("data.chat_template").empty())
      report({"data.chat_template", "data.kind"}, "data.chat_template writes conversations, which only data.kind = "
                                                  "\"chat\" reads; data.kind = \"" + m.get_string("data.kind") + "\"");
  }
  // The loss mask and the document resets need to know which id ends a document, and
  // data with documents.
  for (const char* flag : {"data.eod_mask_loss", "data.reset_attention_mask", "data.reset_position_ids"}) {
    if (!usable({flag, "data.eod_token", "data.kind", "data.tokenizer"}) || !m.get_bool(flag)) continue;
    const std::string kind = m.get_string("data.kind");
    if (kind == "synthetic")
      report({flag, "data.kind"}, std::string(flag) + " looks for end-of-document tokens in the data; data.kind = "
                                  "\"synthetic\" has no documents (one problem a sequence)");
    else if (I("data.eod_token") < 0 && m.get_string("data.tokenizer").empty())
      report({flag, "data.eod_token", "data.tokenizer"},
             std::string(flag) + " needs the end-of-document token: " +
                 (kind == "text" ? "set data.eod_token to the byte that ends a document (e.g. 10, a newline)"
                                 : "set data.tokenizer (its <|endoftext|> or </s>) or data.eod_token (e.g. 50256 "
                                   "for GPT-2's token files)"));
  }
  // The first layer takes the tokens (the embedding) and the last computes the loss
  // (lm_head): without either the run fails at its first step.
  for (const char* list : {"model.pre", "model.post"})
    if (usable({list}) && m.get_string_list(list).empty())
      report({list}, std::string(list) + " is empty, but the model needs " +
                         (std::string(list) == "model.pre" ? "a first layer that takes the tokens (e.g. [\"embedding\"])"
                                                           : "a last layer that computes the loss (e.g. [\"lm_head\"])"));
  // Recomputation counts blocks of a stage: more than the model has is a typo.
  if (usable({"model.recompute_num_layers", "model.num_layers"}) &&
      I("model.recompute_num_layers") > I("model.num_layers"))
    report({"model.recompute_num_layers", "model.num_layers"},
           "model.recompute_num_layers (" + S(I("model.recompute_num_layers")) + ") is more than model.num_layers (" +
               S(I("model.num_layers")) + ")");
  // The learning-rate schedule (Megatron's OptimizerParamScheduler asserts the same):
  // a decay that ends above its start, or ends before the warmup does, is no schedule.
  const bool decays = usable({"optimizer.decay_style"}) && m.get_string("optimizer.decay_style") != "constant";
  if (decays && usable({"optimizer.lr", "optimizer.min_lr"}) &&
      m.get_float("optimizer.min_lr") > m.get_float("optimizer.lr"))
    report({"optimizer.min_lr", "optimizer.lr"},
           "optimizer.min_lr (" + G(m.get_float("optimizer.min_lr")) + ") is more than optimizer.lr (" +
               G(m.get_float("optimizer.lr")) + "): the decay would raise the learning rate");
  // run.train_samples replaces run.steps (a run.steps written too is warned of): at
  // least one step.
  const bool steps_known = usable({"run.steps", "run.train_samples", "batch.global_batch_size",
                                   "batch.micro_batch_size", "batch.rampup_batch_size"});
  bool steps_ok = steps_known;
  // The samples are counted in 64 bits and by the ramp's calculator in double: a run
  // of more than 2^53 of them has no exact position.
  if (steps_known && I("run.train_samples") == 0 &&
      I("run.steps") > (int64_t{1} << 53) / std::max<int64_t>(1, I("batch.global_batch_size"))) {
    report({"run.steps", "batch.global_batch_size"},
           "run.steps = " + S(I("run.steps")) + " of batch.global_batch_size = " + S(I("batch.global_batch_size")) +
               " are more than 2^53 training samples");
    steps_ok = false;
  }
  if (steps_known && I("run.train_samples") > 0) {
    if (resolved_steps(m) < 1) {
      report({"run.train_samples", "batch.global_batch_size"},
             "run.train_samples = " + S(I("run.train_samples")) + " is less than one global batch (" +
                 S(I("batch.global_batch_size")) + "): no step would be trained");
      steps_ok = false;
    }
  }
  // The schedule's marks count steps or samples (ScheduleMarks), never both, and
  // decay after the warmup.
  if (steps_ok && usable({"optimizer.decay_style", "optimizer.warmup_steps", "optimizer.decay_steps",
                          "optimizer.wsd_decay_steps", "optimizer.warmup_samples", "optimizer.decay_samples",
                          "optimizer.wsd_decay_samples", "optimizer.lr", "optimizer.min_lr",
                          "optimizer.wsd_decay_style", "optimizer.weight_decay", "optimizer.weight_decay_incr_style",
                          "optimizer.start_weight_decay", "optimizer.end_weight_decay", "optimizer.warmup_fraction"})) {
    const RunConfig::Optimizer o = RunConfig::schedule_from(m);
    const int64_t train_samples = I("run.train_samples");
    const std::pair<const char*, Mark> step_marks[] = {{"optimizer.warmup_steps", Mark::Warmup},
                                                        {"optimizer.decay_steps", Mark::Decay},
                                                        {"optimizer.wsd_decay_steps", Mark::WsdDecay}};
    const std::pair<const char*, Mark> sample_marks[] = {{"optimizer.warmup_samples", Mark::Warmup},
                                                          {"optimizer.decay_samples", Mark::Decay},
                                                          {"optimizer.wsd_decay_samples", Mark::WsdDecay}};
    std::vector<const char*> in_steps, in_samples;  // the marks set that the decay style reads
    for (const auto& [key, mark] : step_marks)
      if (I(key) > 0 && style_reads(o, mark)) in_steps.push_back(key);
    for (const auto& [key, mark] : sample_marks)
      if (I(key) > 0 && style_reads(o, mark)) in_samples.push_back(key);
    if (!in_steps.empty() && !in_samples.empty()) {
      report({in_steps.front(), in_samples.front()},
             std::string(in_steps.front()) + " and " + in_samples.front() + " are both set: the learning-rate "
             "schedule counts steps or training samples, not both (Megatron-LM's --lr-*-iters or --lr-*-samples)");
    } else if (o.warmup_fraction > 0 && (o.warmup_steps > 0 || o.warmup_samples > 0)) {
      const char* key = o.warmup_steps > 0 ? "optimizer.warmup_steps" : "optimizer.warmup_samples";
      report({"optimizer.warmup_fraction", key},
             "optimizer.warmup_fraction and " + std::string(key) + " both size the warmup; keep one (Megatron's "
             "--lr-warmup-fraction or --lr-warmup-iters / --lr-warmup-samples)");
    } else {
      const ScheduleMarks marks = schedule_marks(o, RunConfig::batch_from(m), resolved_steps(m), train_samples);
      const std::string unit = marks.unit();
      const std::string warmup_key = o.warmup_fraction > 0 ? "optimizer.warmup_fraction" : "optimizer.warmup_" + unit,
                        decay_key = "optimizer.decay_" + unit, wsd_key = "optimizer.wsd_decay_" + unit;
      const std::string megatron = marks.in_samples ? "samples" : "iters";
      if (decays && I(decay_key.c_str()) > 0 && static_cast<double>(marks.decay_end) <= marks.warmup)
        report({decay_key.c_str(), warmup_key.c_str()},
               decay_key + " (" + S(marks.decay_end) + ") must be more than the warmup (" + G(marks.warmup) + " " +
                   unit + ", " + warmup_key + "): the decay runs from the end of the warmup to " + decay_key +
                   " (Megatron's --lr-decay-" + megatron + ")");
      if (o.decay_style == "wsd") {
        const auto room = static_cast<int64_t>(std::floor(static_cast<double>(marks.decay_end) - marks.warmup));
        if (marks.wsd_decay < 1 || marks.wsd_decay > room)
          report({wsd_key.c_str(), "optimizer.decay_style"},
                 "optimizer.decay_style = \"wsd\" decays over the last " + wsd_key + " (" + S(marks.wsd_decay) +
                     ") " + unit + " before " + (marks.in_samples ? "sample " : "step ") + S(marks.decay_end) +
                     " (" + decay_key + ", or the run's " + unit + " when 0), after the " + G(marks.warmup) +
                     " warmup " + unit + ": it must be between 1 and " + S(room) +
                     (room < 1 ? " (none: the warmup fills the schedule)" : "") + " (Megatron's --lr-wsd-decay-" +
                     megatron + ")");
      }
    }
  }
  // A weight decay that changes over the run goes between two values the manifest names
  // (Megatron asserts both are given): their defaults would train with none.
  if (usable({"optimizer.weight_decay_incr_style", "optimizer.start_weight_decay", "optimizer.end_weight_decay"}) &&
      m.get_string("optimizer.weight_decay_incr_style") != "constant")
    for (const char* end : {"optimizer.start_weight_decay", "optimizer.end_weight_decay"})
      if (m.origin(end).kind == Origin::Kind::Default)
        report({end, "optimizer.weight_decay_incr_style"},
               "optimizer.weight_decay_incr_style = \"" + m.get_string("optimizer.weight_decay_incr_style") +
                   "\" goes from optimizer.start_weight_decay to optimizer.end_weight_decay: set both (Megatron's "
                   "--start-weight-decay and --end-weight-decay)");
  // The synthetic tasks: "add" is the one there is; a sequence holds whole problems
  // (a + b = c, c of digits + 1, and an end marker: 3 * digits + 4 tokens).
  if (usable({"data.kind", "data.task"}) && m.get_string("data.kind") == "synthetic" &&
      m.get_string("data.task") != "add")
    report({"data.task", "data.kind"},
           "data.task = \"" + m.get_string("data.task") + "\" is not a synthetic task; valid: \"add\"");
  if (usable({"data.kind", "data.task", "data.digits", "model.seq_length"}) &&
      m.get_string("data.kind") == "synthetic" && m.get_string("data.task") == "add" &&
      I("model.seq_length") < 3 * I("data.digits") + 4)
    report({"model.seq_length", "data.digits"},
           "model.seq_length (" + S(I("model.seq_length")) + ") holds no addition problem of data.digits = " +
               S(I("data.digits")) + " (one takes 3 * digits + 4 = " + S(3 * I("data.digits") + 4) +
               " tokens), so nothing would be trained; use model.seq_length >= " + S(3 * I("data.digits") + 4));
}

}  // namespace loom::manifest::schema
