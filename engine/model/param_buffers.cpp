#include "engine/model/param_buffers.hpp"

#include "engine/model/param_init.hpp"
#include "engine/model/tensor_view.hpp"
#include "engine/topology/rank_groups.hpp"

#include <algorithm>
#include <functional>
#include <numeric>

namespace loom::model {

int32_t model_dtype(const std::string& name) {
  if (name == "fp32") return LOOM_DTYPE_F32;
  if (name == "bf16") return LOOM_DTYPE_BF16;
  throw loom::Error("unsupported model dtype '" + name + "' (fp32 or bf16)", LOOM_CODE_INVALID_ARGUMENT);
}

namespace {
int64_t product(const std::vector<int64_t>& s) {
  return std::accumulate(s.begin(), s.end(), int64_t{1}, std::multiplies<int64_t>());
}
}  // namespace

ParamBuffers::ParamBuffers(runtime::RankRuntime& rank, const Layers& layers, int num_layers, size_t bucket_size,
                           int32_t param_dtype, int32_t grad_dtype, uint64_t seed, float init_std)
    : rank_(rank), param_dtype_(param_dtype), grad_dtype_(grad_dtype) {
  for (const LocalChunk& c : layers.chunks()) chunk_global_index_.push_back(c.global_index);
  CollectedParams collected = collect(layers);
  layer_entries_.resize(layers.size());
  for (size_t k = 0; k < collected.decls.size(); ++k) {
    std::vector<size_t>& of_layer = layer_entries_[static_cast<size_t>(collected.decls[k].layer)];
    if (std::find(of_layer.begin(), of_layer.end(), collected.entry_of[k]) == of_layer.end())
      of_layer.push_back(collected.entry_of[k]);
  }
  entries_ = std::move(collected.entries);
  lay_out(layers.chunk_count(), bucket_size);
  allocate();
  initialise(num_layers, seed, init_std);
  bind(layers, collected);
}

// The entries from the layers' declarations (tie dedupe, local shapes), each in its chunk.
CollectedParams ParamBuffers::collect(const Layers& layers) const {
  const loom::Group tp = rank_.group_or_self("tp");
  std::vector<std::string> instances;
  std::vector<const loom_param_decl*> layer_decls;
  std::vector<size_t> counts;
  for (const Layer& l : layers) {
    const loom_param_decl* d = nullptr;
    size_t n = 0;
    loom::check(l.api->params(l.handle, &d, &n));
    instances.push_back(l.spec.instance);
    layer_decls.push_back(d);
    counts.push_back(n);
  }
  const loom::Group ep = rank_.group_or_self("ep"), etp = rank_.group_or_self("etp");
  CollectedParams collected =
      collect_param_entries(instances, layer_decls, counts, tp.size(), ep.size(), etp.size());
  std::vector<int> chunk_of_layer;
  for (const Layer& l : layers) chunk_of_layer.push_back(l.chunk);
  place_entries_in_chunks(collected, chunk_of_layer, chunk_global_index_, layers.chunk(0).num_global);
  return collected;
}

// Megatron's layout (reverse order, aligned starts, dp-divisible buckets), one
// buffer region per chunk and one for the expert parameters.
void ParamBuffers::lay_out(size_t chunks, size_t bucket_size) {
  const int cp = rank_.group_or_self("cp").size();
  layout_ = layout_entries(entries_, chunks, rank_.group_or_self(topology::gradient_group_kind(cp)).size(),
                           bucket_size);
  for (size_t i = 0; i < entries_.size(); ++i) entries_[i].offset = layout_.params[i].start;
  numel_ = layout_.numel;
}

void ParamBuffers::allocate() {
  params_ = loom::Buffer(&rank_, numel_ * loom::dtype_size(param_dtype_));
  grads_ = loom::Buffer(&rank_, numel_ * loom::dtype_size(grad_dtype_));
  rank_.dev().elementwise({.op = LOOM_EW_FILL, .n = static_cast<int64_t>(numel_), .out = params_.get(),
                           .alpha = 0.f, .dtype = param_dtype_, .out_dtype = param_dtype_});
  zero_grads();
}

// Each entry: the full tensor from (seed, name), independently of the layout.
void ParamBuffers::initialise(int num_layers, uint64_t seed, float init_std) {
  assign([&](const ParamEntry& e) {
    return init_full(e.decl.init, init_std > 0.0f ? init_std : e.decl.init_std, num_layers, product(e.full_shape),
                     seed, e.tie_key.empty() ? e.name : e.tie_key);
  });
}

std::vector<float> ParamBuffers::local_part(const ParamEntry& e, std::vector<float> full) const {
  if (static_cast<int64_t>(full.size()) != product(e.full_shape))
    throw loom::Error("parameter " + e.name + ": a whole tensor of " + std::to_string(full.size()) +
                      " elements for its " + std::to_string(product(e.full_shape)));
  const loom::Group tp = rank_.group_or_self("tp");
  const loom::Group ep = rank_.group_or_self("ep"), etp = rank_.group_or_self("etp");
  std::vector<int64_t> shape = e.full_shape;
  if (e.expert && ep.size() > 1) {
    shape[0] /= ep.size();
    const size_t block = full.size() / static_cast<size_t>(ep.size());
    full = std::vector<float>(full.begin() + static_cast<std::ptrdiff_t>(block * static_cast<size_t>(ep.rank())),
                              full.begin() + static_cast<std::ptrdiff_t>(block * static_cast<size_t>(ep.rank() + 1)));
  }
  std::vector<float> local(e.numel);
  const loom::Group& split = e.expert ? etp : tp;
  take_slice(full, shape, e.decl.partition_dim, e.decl.partition_stride, split.size(), split.rank(), local.data());
  return local;
}

void ParamBuffers::assign(const FullTensorOf& full_of) {
  const size_t psize = loom::dtype_size(param_dtype_);
  loom::Device dev = rank_.dev();
  // A non-fp32 parameter is drawn in fp32 like every other and stored cast by the
  // device's EW_CAST (round to nearest even), through an fp32 staging buffer.
  size_t largest = 0;
  for (const ParamEntry& e : entries_) largest = std::max(largest, e.numel);
  loom::Buffer staging;
  if (param_dtype_ != LOOM_DTYPE_F32) staging = loom::Buffer(&rank_, largest * sizeof(float));

  for (const ParamEntry& e : entries_) {
    const std::vector<float> local = local_part(e, full_of(e));
    if (param_dtype_ == LOOM_DTYPE_F32) {
      dev.copy(params_.get<float>() + e.offset, local.data(), e.numel * sizeof(float), LOOM_COPY_HOST_TO_DEVICE);
    } else {
      dev.copy(staging.get(), local.data(), e.numel * sizeof(float), LOOM_COPY_HOST_TO_DEVICE);
      dev.elementwise({.op = LOOM_EW_CAST, .n = static_cast<int64_t>(e.numel), .x = staging.get(),
                       .out = params_.get<char>() + e.offset * psize, .dtype = LOOM_DTYPE_F32,
                       .out_dtype = param_dtype_});
      dev.synchronize();  // the staging buffer is reused by the next entry
    }
  }
  dev.synchronize();
}

// Each layer gets views of its parameters and gradients in its declaration order
// (a tied declaration views its entry's memory).
void ParamBuffers::bind(const Layers& layers, const CollectedParams& collected) {
  const size_t psize = loom::dtype_size(param_dtype_), gsize = loom::dtype_size(grad_dtype_);
  views_.resize(layers.size());
  for (size_t li = 0; li < layers.size(); ++li) {
    LayerViews& v = views_[li];
    std::vector<const ParamEntry*> declared;  // the layer's declarations' entries
    for (size_t k = 0; k < collected.decls.size(); ++k)
      if (collected.decls[k].layer == static_cast<int>(li)) declared.push_back(&entries_[collected.entry_of[k]]);
    for (const ParamEntry* e : declared) v.shapes.push_back(e->local_shape);
    for (size_t j = 0; j < declared.size(); ++j) {
      const ParamEntry& e = *declared[j];
      v.params.push_back(device_view(rank_, params_.get<char>() + e.offset * psize, v.shapes[j], param_dtype_));
      v.grads.push_back(device_view(rank_, grads_.get<char>() + e.offset * gsize, v.shapes[j], grad_dtype_));
    }
    const Layer& l = layers[li];
    loom::check(l.api->bind(l.handle, v.params.data(), v.grads.data(), v.params.size()));
  }
}

void ParamBuffers::zero_grads() {
  rank_.dev().elementwise({.op = LOOM_EW_FILL, .n = static_cast<int64_t>(numel_), .out = grads_.get(),
                           .alpha = 0.f, .dtype = grad_dtype_, .out_dtype = grad_dtype_});
}

std::vector<loom_param_info> ParamBuffers::param_infos() const {
  std::vector<loom_param_info> out;
  for (const ParamEntry& e : entries_) {
    loom_param_info i = loom::make<loom_param_info>();
    i.name = e.name.c_str();
    i.offset = e.offset;
    i.numel = e.numel;
    i.no_weight_decay = e.decl.no_weight_decay;
    i.duplicated = e.duplicated ? 1 : 0;
    out.push_back(i);
  }
  return out;
}

std::vector<int32_t> ParamBuffers::counted_elsewhere() const {
  std::vector<int32_t> out;
  for (const ParamEntry& e : entries_)
    out.push_back(e.shared_across_stages && chunk_global_index_[static_cast<size_t>(e.chunk)] != 0 ? 1 : 0);
  return out;
}

std::vector<int32_t> ParamBuffers::expert_flags() const {
  std::vector<int32_t> out;
  for (const ParamEntry& e : entries_) out.push_back(e.expert ? 1 : 0);
  return out;
}

bool ParamBuffers::has_expert_params() const {
  return std::any_of(entries_.begin(), entries_.end(), [](const ParamEntry& e) { return e.expert; });
}

}  // namespace loom::model
