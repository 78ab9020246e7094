#include "engine/train/memory_plan.hpp"

#include "engine/model/param_init.hpp"
#include "engine/pipeline/partition.hpp"
#include "engine/pipeline/schedule.hpp"
#include "engine/plugins/registry.hpp"
#include "engine/runtime/rank_runtime.hpp"
#include "engine/topology/rank_groups.hpp"
#include "engine/train/data.hpp"

#include <loom/cpp/core.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <iomanip>
#include <map>
#include <sstream>

namespace loom::train {

using namespace loom::model;  // the parameter collection and layout this plan sizes

size_t optimizer_bytes_per_element(const std::string& param_dtype) {
  size_t b = 4 + 4;                           // Adam m and v (fp32)
  if (model_dtype(param_dtype) != LOOM_DTYPE_F32) b += 4;  // fp32 master parameters
  // No fp32 copy of bf16 gradients: AdamW reads them in their own dtype, so bf16
  // gradients cost 2 bytes where Megatron-LM's table (which keeps fp32 main
  // gradients) counts 2 + 4.
  return b;
}

namespace {

// Byte sums and products that stop at 2^64 - 1 instead of wrapping: an absurd model's
// plan must read "too big", never small.
uint64_t sat_add(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }
uint64_t sat_mul(uint64_t a, uint64_t b) { return b != 0 && a > UINT64_MAX / b ? UINT64_MAX : a * b; }

// The most parameter elements one rank may hold (2^48: 1 PiB of fp32 weights, beyond
// any device), so every per-rank byte count of them fits in 64 bits.
constexpr size_t kMaxRankElements = size_t{1} << 48;

// The device the layers are created on to be planned: one whose memory is the host's
// (LOOM_DEVICE_HOST_MEMORY), so any machine can plan any run; the run's own device when
// it is one, else the first loaded one that is.
const plugins::LoadedPlugin& planning_device(const RunPlan& plan) {
  auto host_memory = [](const plugins::LoadedPlugin& p) {
    const loom_device_api* d = p.kind == "device" ? p.device() : nullptr;
    return d != nullptr && LOOM_HAS_SLOT(d, loom_device_api, features) && (d->features & LOOM_DEVICE_HOST_MEMORY) != 0;
  };
  if (plan.device != nullptr && host_memory(*plan.device)) return *plan.device;
  for (const auto& p : plan.registry->all())
    if (host_memory(*p)) return *p;
  throw loom::Error("no loaded device plugin allocates host memory (LOOM_DEVICE_HOST_MEMORY), so the layers cannot "
                    "be planned on this machine; add device/cpu to the plugin search path");
}

// The layers of one rank, created from their plugins and destroyed with it.
struct PlannedLayers {
  struct Layer {
    const loom_layer_api* api = nullptr;
    loom_layer* handle = nullptr;
  };
  std::vector<Layer> layers;
  ~PlannedLayers() {
    for (Layer& l : layers)
      if (l.handle) l.api->destroy(l.handle);
  }
};

}  // namespace

bool shards_optimizer_state(const RunPlan& plan) {
  const loom_optimizer_api* opt = plan.optimizer != nullptr ? plan.optimizer->optimizer() : nullptr;
  return opt != nullptr && LOOM_HAS_SLOT(opt, loom_optimizer_api, features) &&
         (opt->features & LOOM_OPTIMIZER_SHARDED_STATE) != 0;
}

uint64_t rank_total_bytes(const RankMemory& r) {
  uint64_t total = 0;
  for (const uint64_t b : {r.param_bytes, r.grad_bytes, r.optimizer_bytes, r.activation_bytes, r.recompute_bytes,
                           r.work_bytes, r.input_bytes, r.workspace_bytes})
    total = sat_add(total, b);
  return total;
}

uint64_t device_capacity(const RunPlan& plan, int ranks_in_process) {
  if (plan.device == nullptr || plan.device->device() == nullptr) return 0;
  const loom_device_api* api = plan.device->device();
  if (!LOOM_HAS_SLOT(api, loom_device_api, memory_stats) || api->memory_stats == nullptr) return 0;
  plugins::OptionValues options(&plan.config.device.options, plan.device->options);
  loom_device_create_args args = loom::make<loom_device_create_args>();
  args.num_threads = 1;
  args.ranks_in_process = std::max(1, ranks_in_process);
  loom_device* dev = nullptr;
  if (loom_status st = api->create(options.raw(), &args, &dev); st != nullptr) {
    plugins::host_api()->status_destroy(st);  // e.g. no GPU on this machine: unknown
    return 0;
  }
  loom_memory_stats stats = loom::make<loom_memory_stats>();
  uint64_t capacity = 0;
  if (loom_status st = api->memory_stats(dev, &stats); st == nullptr)
    capacity = stats.capacity_bytes;
  else
    plugins::host_api()->status_destroy(st);
  api->destroy(dev);
  return capacity;
}

std::string memory_problem(const MemoryPlan& mp, uint64_t capacity, const std::string& device, int ranks_in_process) {
  if (capacity == 0 || mp.ranks.empty()) return "";
  const RankMemory* worst = &mp.ranks.front();
  for (const RankMemory& r : mp.ranks)
    if (rank_total_bytes(r) > rank_total_bytes(*worst)) worst = &r;
  const uint64_t need = rank_total_bytes(*worst);
  if (need <= capacity) return "";
  // GiB, or MiB below one (a small model against a small device would read "0.0 GiB").
  const bool gib = capacity >= (uint64_t{1} << 30);
  const double unit = gib ? 1024.0 * 1024.0 * 1024.0 : 1024.0 * 1024.0;
  const char* name = gib ? " GiB" : " MiB";
  std::ostringstream os;
  os << std::fixed << std::setprecision(1) << "the plan needs " << static_cast<double>(need) / unit << name
     << " on rank " << worst->rank
     << " (parameters, gradients, optimizer state, activations, work buffers), more than the "
     << static_cast<double>(capacity) / unit << name << " of memory " << device << " offers a rank here";
  if (ranks_in_process > 1) os << " (its memory shared by the " << ranks_in_process << " ranks of this process)";
  return os.str();
}

MemoryPlan plan_memory(const RunPlan& plan, int64_t vocab) {
  const manifest::RunConfig& config = plan.config;
  if (vocab <= 0) vocab = config.model.vocab_size;
  if (vocab <= 0) vocab = make_data_source(config)->vocab_size();

  MemoryPlan out;
  out.param_dtype = config.device.param_dtype;
  out.grad_dtype = config.device.grad_dtype;
  out.strategy = config.optimizer.strategy;
  out.world = plan.sizes.world;
  out.tp = plan.sizes.tp;
  out.cp = plan.sizes.cp;
  out.ep = plan.sizes.ep;
  out.dp = plan.dp;
  out.pp = plan.sizes.pp;
  out.vocab = vocab;
  out.bucket_size = static_cast<size_t>(config.optimizer.bucket_size);
  out.microbatches_in_flight = 1;  // the most over ranks, set below
  const size_t psize = loom::dtype_size(model_dtype(out.param_dtype)),
               gsize = loom::dtype_size(model_dtype(out.grad_dtype));
  const size_t opt_per_elem = optimizer_bytes_per_element(out.param_dtype);
  // A strategy that shards its state keeps 1/dp of it (Megatron's distributed optimizer).
  const bool distributed = shards_optimizer_state(plan);

  const topology::RankGroups groups = topology::RankGroups::build(plan.sizes);
  out.edp = groups.edp();
  const plugins::LoadedPlugin& cpu = planning_device(plan);
  plugins::OptionValues dev_opts(nullptr, cpu.options);  // its defaults: planning runs no math
  const loom_model_dims dims = model_dims(config, vocab, plan.sizes.tp);
  const bool sp = config.parallel.sequence_parallel;

  // The pipeline: each stage's chunks, and the order its schedule runs them in.
  const int pp = plan.sizes.pp;
  const std::vector<std::vector<LayerSpec>>& global_chunks = plan.chunks;
  const pipeline::PipelineOrders& orders = plan.orders;  // make_plan's
  // Hidden states (and every activation) are in the parameters' dtype.
  // A rank holds seq / cp rows (its context-parallel slice), / tp of them under SP.
  const int64_t rows = dims.seq_len / plan.sizes.cp;
  const uint64_t hidden_state_bytes = static_cast<uint64_t>(
      (sp && plan.sizes.tp > 1 ? rows / plan.sizes.tp : rows) * dims.micro_batch * dims.hidden * psize);
  out.hidden_state_bytes = hidden_state_bytes;
  // The step's inputs, held for the whole run (train::Microbatches, DropoutSeeds): a
  // token and a target buffer of the rank's rows per microbatch (and the documents'
  // starts and positions when data.reset_* asks for them), and its dropout seed.
  const uint64_t row_buffers = 2 + (plan.config.data.reset_attention_mask ? 1 : 0) +
                               (plan.config.data.reset_position_ids ? 1 : 0);
  const uint64_t input_bytes =
      static_cast<uint64_t>(plan.microbatches) *
      (row_buffers * static_cast<uint64_t>(rows * dims.micro_batch) * sizeof(int32_t) + sizeof(uint64_t));
  // Parameters are replicated over dp x cp ranks: the optimizer's group.
  const int grad_group = plan.dp * plan.sizes.cp;

  // Ranks differ only by their (tp, pp) coordinates; plan each once.
  std::map<std::pair<int, int>, RankMemory> by_coords;
  for (int r = 0; r < groups.world(); ++r) {
    const int tp_rank = groups.rank_in_group("tp", r);
    const int pp_rank = groups.rank_in_group("pp", r);
    RankMemory rm;
    if (auto it = by_coords.find({tp_rank, pp_rank}); it != by_coords.end()) {
      rm = it->second;
    } else {
      loom_device_create_args dargs = loom::make<loom_device_create_args>();
      dargs.global_rank = r;
      dargs.local_rank = 0;
      dargs.num_threads = 1;
      dargs.ranks_in_process = 1;
      loom_device* dev = nullptr;
      loom::check(cpu.device()->create(dev_opts.raw(), &dargs, &dev));
      runtime::RankRuntime rt(r, cpu.device(), dev);
      for (const auto& [api_type, table] : plan.services()) rt.set_service(api_type, table);
      loom_group tp = loom::make<loom_group>();
      tp.api = nullptr;
      tp.comm = nullptr;
      tp.size = plan.sizes.tp;
      tp.rank = tp_rank;
      rt.add_group("tp", tp);
      // Layers may ask for other groups by kind (layer/moe: "ep"); their sizes are
      // the plan's, their communicators absent (planning runs no collective).
      loom_group ep = tp;
      ep.size = plan.sizes.ep;
      ep.rank = groups.rank_in_group("ep", r);
      rt.add_group("ep", ep);
      loom_group etp = tp;
      etp.size = plan.sizes.expert_tp();
      etp.rank = groups.rank_in_group("etp", r);
      rt.add_group("etp", etp);
      loom_group cpg = tp;
      cpg.size = plan.sizes.cp;
      cpg.rank = groups.rank_in_group("cp", r);
      rt.add_group("cp", cpg);

      PlannedLayers layers;
      std::vector<std::string> instances;
      std::vector<const loom_param_decl*> decls;
      std::vector<size_t> counts;
      const std::vector<ModelChunk> chunks = pipeline::local_chunks(global_chunks, pp, pp_rank);
      std::vector<uint64_t> chunk_activations;  // saved per microbatch by each local chunk
      std::vector<int> chunk_of_layer;
      std::vector<int> group_of_layer;  // per layer: its recompute group in its chunk, or -1
      std::vector<size_t> kept_states;  // per chunk: hidden states kept per microbatch
      for (size_t c = 0; c < chunks.size(); ++c) {
        const std::vector<int> groups = recompute_groups(config, chunks[c].layers);
        kept_states.push_back(kept_hidden_states(groups, chunks[c].global_index + 1 == chunks[c].num_global));
        for (size_t k = 0; k < chunks[c].layers.size(); ++k) {
          const LayerSpec& spec = chunks[c].layers[k];
          group_of_layer.push_back(groups[k]);
          PlannedLayers::Layer l;
          l.handle = create_layer(config, *plan.registry, &rt, spec, dims, tp, &l.api);
          layers.layers.push_back(l);
          const loom_param_decl* d = nullptr;
          size_t n = 0;
          loom::check(l.api->params(l.handle, &d, &n));
          instances.push_back(spec.instance);
          decls.push_back(d);
          counts.push_back(n);
          chunk_of_layer.push_back(static_cast<int>(c));
        }
      }
      CollectedParams cp = collect_param_entries(instances, decls, counts, plan.sizes.tp, plan.sizes.ep, etp.size);
      std::vector<int> chunk_global_index;
      for (const ModelChunk& c : chunks) chunk_global_index.push_back(c.global_index);
      place_entries_in_chunks(cp, chunk_of_layer, chunk_global_index, chunks.front().num_global);
      for (const ParamEntry& e : cp.entries)
        rm.counted_elsewhere |= e.shared_across_stages && chunk_global_index[static_cast<size_t>(e.chunk)] != 0;

      // Bind each layer to views without memory, of the run's dtypes and local
      // shapes (as the Model binds them): a layer sizes its activations by the
      // dtype of its parameters.
      const DLDataType pdl = psize == 2 ? DLDataType{kDLBfloat, 16, 1} : DLDataType{kDLFloat, 32, 1};
      const DLDataType gdl = gsize == 2 ? DLDataType{kDLBfloat, 16, 1} : DLDataType{kDLFloat, 32, 1};
      std::vector<std::vector<size_t>> decls_of_layer(layers.layers.size());  // in declaration order
      for (size_t k = 0; k < cp.decls.size(); ++k) decls_of_layer[static_cast<size_t>(cp.decls[k].layer)].push_back(k);
      for (size_t li = 0; li < layers.layers.size(); ++li) {
        std::vector<DLTensor> pv, gv;
        for (const size_t k : decls_of_layer[li]) {
          const ParamEntry& e = cp.entries[cp.entry_of[k]];
          DLTensor t{};
          t.device = {kDLCPU, 0};
          t.ndim = static_cast<int32_t>(e.local_shape.size());
          t.shape = const_cast<int64_t*>(e.local_shape.data());
          t.dtype = pdl;
          pv.push_back(t);
          t.dtype = gdl;
          gv.push_back(t);
        }
        const PlannedLayers::Layer& l = layers.layers[li];
        loom::check(l.api->bind(l.handle, pv.data(), gv.data(), pv.size()));
      }
      RankShape shape;
      shape.chunk_layers.assign(chunks.size(), 0);
      shape.chunk_forward_flops.assign(chunks.size(), 0.0);
      for (size_t li = 0; li < layers.layers.size(); ++li) {
        const PlannedLayers::Layer& l = layers.layers[li];
        const size_t c = static_cast<size_t>(chunk_of_layer[li]);
        ++shape.chunk_layers[c];
        const double flops = LOOM_HAS_SLOT(l.api, loom_layer_api, forward_flops) && l.api->forward_flops
                                 ? l.api->forward_flops(l.handle)
                                 : 0.0;
        shape.chunk_forward_flops[c] += flops;
        shape.layer_forward_flops.push_back(flops);
        rm.workspace_bytes = std::max(rm.workspace_bytes, model::layer_bytes(l.api, l.handle, model::LayerBytes::Workspace,
                                                                             instances[li]));
      }
      chunk_activations.assign(chunks.size(), 0);
      // Per chunk, the largest recompute group's re-created bytes: its layers' saved
      // activations and its inner hidden states (the group's input and output are held).
      std::vector<uint64_t> chunk_recompute(chunks.size(), 0);
      std::map<std::pair<size_t, int>, uint64_t> group_bytes;
      for (size_t li = 0; li < layers.layers.size(); ++li) {
        const PlannedLayers::Layer& l = layers.layers[li];
        const uint64_t bytes = model::layer_bytes(l.api, l.handle, model::LayerBytes::Activations,
                                                  instances[li]);
        const size_t c = static_cast<size_t>(chunk_of_layer[li]);
        const int g = group_of_layer[li];
        if (g < 0) {
          chunk_activations[c] = sat_add(chunk_activations[c], bytes);
          continue;
        }
        uint64_t& gb = group_bytes[{c, g}];
        // Its input is an inner state of the group unless it is the group's first layer.
        const bool inner_input = li > 0 && group_of_layer[li - 1] == g && chunk_of_layer[li - 1] == chunk_of_layer[li];
        gb = sat_add(gb, sat_add(bytes, inner_input ? hidden_state_bytes : 0));
        chunk_recompute[c] = std::max(chunk_recompute[c], gb);
      }
      for (size_t c = 0; c < chunks.size(); ++c) {
        // The hidden states the engine keeps per microbatch, one per layer boundary
        // but inside recompute groups (as Model::activation_bytes counts them), plus
        // the received input.
        chunk_activations[c] =
            sat_add(chunk_activations[c], sat_mul(static_cast<uint64_t>(kept_states[c]), hidden_state_bytes));
        if (chunks[c].global_index > 0) chunk_activations[c] = sat_add(chunk_activations[c], hidden_state_bytes);
      }

      auto too_many = [&](const std::string& count) {
        return loom::Error("rank " + std::to_string(r) + " would hold " + count +
                           " parameter elements; a rank is planned for at most 2^48 (1 PiB of fp32 weights): "
                           "split the model over more ranks (parallel.tp, parallel.pp, parallel.ep) or make it smaller");
      };
      for (const ParamEntry& e : cp.entries) {
        // Summed with a bound: the count of an absurd model would wrap past 2^64.
        if (e.numel > kMaxRankElements - std::min(rm.params, kMaxRankElements)) throw too_many("more than 2^48");
        if (e.shared_across_stages) rm.tied_numel += e.numel;
        rm.params += e.numel;
        shape.planned.push_back({.name = e.name, .full_shape = e.full_shape, .local_shape = e.local_shape,
                                 .partition_dim = e.decl.partition_dim,
                                 .partition_stride = std::max(1, e.decl.partition_stride), .expert = e.expert,
                                 .tie_key = e.tie_key});
      }
      rm.param_count = cp.entries.size();
      shape.layout = layout_entries(cp.entries, chunks.size(), grad_group, out.bucket_size);
      rm.buffer_numel = shape.layout.numel;
      if (rm.buffer_numel > kMaxRankElements) throw too_many(std::to_string(rm.buffer_numel));
      rm.param_bytes = rm.buffer_numel * psize;
      rm.grad_bytes = rm.buffer_numel * gsize;
      // The distributed optimizer shards dense buckets over dp (x cp) and the expert
      // region (the buffer's tail) over edp (dp / ep, or tp dp / (etp ep) folded).
      size_t expert_start = shape.layout.numel;
      for (size_t i = 0; i < cp.entries.size(); ++i)
        if (cp.entries[i].expert) expert_start = std::min(expert_start, shape.layout.params[i].start);
      rm.expert_start = expert_start;
      rm.shape = std::make_shared<const RankShape>(std::move(shape));
      const size_t edp = static_cast<size_t>(groups.edp());
      const size_t state_elems = distributed ? expert_start / static_cast<size_t>(grad_group) +
                                                   (rm.buffer_numel - expert_start) / std::max<size_t>(1, edp)
                                             : rm.buffer_numel;
      rm.optimizer_bytes = state_elems * opt_per_elem;
      // Activations at the schedule's peak: walk the stage's order, adding a
      // chunk's bytes at each forward and dropping them at its backward.
      uint64_t held = 0;
      int in_flight = 0;
      const std::vector<int32_t> order =
          orders.order.empty() ? std::vector<int32_t>{1, -1} : orders.order[static_cast<size_t>(pp_rank)];
      uint64_t recompute_peak = 0;
      // A receive posted a step early (pipeline.overlap_p2p_comm) holds the next
      // forward's input during this step.
      const bool post_early = config.pipeline.overlap_p2p_comm && pp > 1;
      for (size_t k = 0; k < order.size(); ++k) {
        const int32_t entry = order[k];
        const size_t c = static_cast<size_t>(std::abs(entry) - 1);
        const uint64_t bytes = chunk_activations[c];
        const bool next_receives = post_early && k + 1 < order.size() && order[k + 1] > 0 &&
                                   chunks[static_cast<size_t>(order[k + 1] - 1)].global_index > 0;
        const uint64_t early = next_receives ? hidden_state_bytes : 0;
        if (entry < 0) recompute_peak = std::max(recompute_peak, sat_add(sat_add(held, early), chunk_recompute[c]));
        const uint64_t before = held;
        held = entry > 0 ? sat_add(held, bytes) : held - std::min(held, bytes);
        in_flight += entry > 0 ? 1 : -1;
        rm.activation_bytes = std::max(rm.activation_bytes, sat_add(std::max(before, held), early));
        rm.in_flight = std::max(rm.in_flight, in_flight);
      }
      rm.recompute_bytes = recompute_peak > rm.activation_bytes ? recompute_peak - rm.activation_bytes : 0;
      // The executor's output-gradient slots: one when a backward receives its
      // gradient, a second when receives are posted early and several do.
      int receiving_backwards = 0;
      for (const int32_t entry : order)
        if (entry < 0 && chunks[static_cast<size_t>(-entry - 1)].global_index + 1 < chunks[0].num_global)
          ++receiving_backwards;
      const int slots = (receiving_backwards > 0 ? 1 : 0) + (post_early && receiving_backwards > 1 ? 1 : 0);
      rm.work_bytes = static_cast<uint64_t>(2 + slots) * hidden_state_bytes;
      rm.input_bytes = input_bytes;
      out.microbatches_in_flight = std::max<int64_t>(out.microbatches_in_flight, rm.in_flight);
      rm.bytes_per_param =
          rm.params ? double(rm.param_bytes + rm.grad_bytes + rm.optimizer_bytes) / double(rm.params) : 0.0;
      by_coords[{tp_rank, pp_rank}] = rm;
    }
    rm.rank = r;
    rm.tp_rank = tp_rank;
    rm.cp_rank = groups.rank_in_group("cp", r);
    rm.dp_rank = groups.rank_in_group("dp", r);
    rm.pp_rank = pp_rank;
    rm.ep_rank = groups.rank_in_group("ep", r);
    rm.etp_rank = groups.rank_in_group("etp", r);
    out.ranks.push_back(std::move(rm));
  }
  return out;
}

}  // namespace loom::train
