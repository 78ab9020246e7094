#include "engine/model/param_plan.hpp"

#include "engine/model/param_init.hpp"

#include <loom/cpp/core.hpp>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <algorithm>
#include <functional>
#include <map>
#include <numeric>
#include <set>
#include <stdexcept>

namespace loom::model {

namespace {
int64_t product(const std::vector<int64_t>& s) {
  return std::accumulate(s.begin(), s.end(), int64_t{1}, std::multiplies<int64_t>());
}

// What a layer declares of a parameter, checked before anything is sized from it: a
// name, 1-4 dims each at least 1 and at most 2^48 elements in all (byte counts stay far
// from int64), a partition dim among its dims, a finite non-negative init_std.
constexpr int64_t kMaxParamElements = int64_t{1} << 48;
void check_decl(const loom_param_decl& d, const std::string& layer) {
  LOOM_REQUIRE(d.name != nullptr && d.name[0] != '\0', layer << ": a parameter declaration without a name");
  const std::string name = layer + "." + d.name;
  LOOM_REQUIRE(d.ndim >= 1 && d.ndim <= 4, name << ": ndim must be 1..4, got " << d.ndim);
  int64_t elements = 1;
  for (int i = 0; i < d.ndim; ++i) {
    LOOM_REQUIRE(d.shape[i] >= 1, name << ": dim " << i << " of its shape is " << d.shape[i] << " (each must be >= 1)");
    LOOM_REQUIRE(d.shape[i] <= kMaxParamElements / elements,
                 name << ": its shape holds more than 2^48 elements (dim " << i << " is " << d.shape[i] << ")");
    elements *= d.shape[i];
  }
  LOOM_REQUIRE(d.partition_dim >= -1 && d.partition_dim < d.ndim,
               name << ": partition_dim " << d.partition_dim << " is not one of its " << d.ndim << " dims (or -1)");
  LOOM_REQUIRE(std::isfinite(d.init_std) && d.init_std >= 0,
               name << ": init_std " << d.init_std << " must be a finite number >= 0");
}
}  // namespace

loom_param_decl param_decl_at(const loom_param_decl* decls, size_t i, const std::string& layer) {
  const size_t stride = decls[0].struct_size;
  constexpr size_t kSize10 = offsetof(loom_param_decl, tie_key) + sizeof(const char*);  // 1.0-1.3
  LOOM_REQUIRE(stride >= kSize10 && stride <= sizeof(loom_param_decl) && stride % alignof(loom_param_decl) == 0,
               layer << ": its parameter declarations have struct_size " << stride
                     << ", which no loom_param_decl of ABI 1.x has (" << kSize10 << " for 1.0-1.3, "
                     << sizeof(loom_param_decl) << " for 1." << LOOM_ABI_MINOR
                     << "); was the layer built against another header?");
  loom_param_decl d{};
  std::memcpy(&d, reinterpret_cast<const char*>(decls) + i * stride, stride);
  return d;
}

std::vector<loom_param_decl> checked_param_decls(const loom_param_decl* decls, size_t count, const std::string& layer) {
  LOOM_REQUIRE(count == 0 || decls != nullptr, layer << ": params() gave " << count << " parameters and no declarations");
  std::vector<loom_param_decl> out;
  std::set<std::string> names;
  for (size_t i = 0; i < count; ++i) {
    out.push_back(param_decl_at(decls, i, layer));
    check_decl(out.back(), layer);
    LOOM_REQUIRE(names.insert(out.back().name).second,
                 layer << " declares two parameters named " << out.back().name
                       << ": names are the keys of checkpoints and exports, so each must be unique in its layer");
  }
  return out;
}

CollectedParams collect_param_entries(const std::vector<std::string>& instances,
                                      const std::vector<const loom_param_decl*>& decls,
                                      const std::vector<size_t>& counts, int tp_size, int ep_size,
                                      int etp_size) {
  if (etp_size <= 0) etp_size = tp_size;
  LOOM_REQUIRE(instances.size() == decls.size() && decls.size() == counts.size(),
               "collect_param_entries: one instance name, declaration array and count per layer");
  CollectedParams out;
  std::map<std::string, std::string> owner_of;  // full name -> the layer declaring it: names are keys of checkpoints
  for (size_t li = 0; li < decls.size(); ++li) {
    const std::vector<loom_param_decl> layer_decls = checked_param_decls(decls[li], counts[li], instances[li]);
    for (size_t i = 0; i < layer_decls.size(); ++i) {
      const std::string name = instances[li] + "." + layer_decls[i].name;
      const auto [it, fresh] = owner_of.emplace(name, instances[li]);
      LOOM_REQUIRE(fresh, "layers " << it->second << " and " << instances[li] << " both give a parameter " << name
                                    << ": names are the keys of checkpoints and exports, so no layer's names may "
                                       "be another's");
      out.decls.push_back({static_cast<int>(li), static_cast<int>(i), layer_decls[i]});
    }
  }
  // One entry per parameter in model order; a tied parameter is owned by its
  // first declaration and later declarations share it.
  std::map<std::string, size_t> tied;  // tie_key -> entry index
  out.entry_of.resize(out.decls.size());
  for (size_t k = 0; k < out.decls.size(); ++k) {
    const DeclRef& d = out.decls[k];
    const std::string name = instances[static_cast<size_t>(d.layer)] + "." + d.decl.name;
    std::vector<int64_t> full(d.decl.shape, d.decl.shape + d.decl.ndim);
    const bool expert = d.decl.expert != 0;
    std::vector<int64_t> local = full;
    if (expert) {  // dim 0: one block per expert, split over ep
      LOOM_REQUIRE(d.decl.partition_dim != 0, name << ": an expert parameter's dim 0 is split over ep; partition_dim "
                                                      "must name another dimension (or -1)");
      LOOM_REQUIRE(full[0] % ep_size == 0, name << ": its " << full[0] << " experts (dim 0) do not split over ep = "
                                                << ep_size << "; choose parallel.ep dividing the number of experts");
      local[0] = full[0] / ep_size;
    }
    local = local_shape(local, d.decl.partition_dim, d.decl.partition_stride, expert ? etp_size : tp_size, name);
    const std::string tie = d.decl.tie_key ? d.decl.tie_key : "";
    if (!tie.empty()) {
      auto it = tied.find(tie);
      if (it != tied.end()) {
        const ParamEntry& owner = out.entries[it->second];
        LOOM_REQUIRE(owner.full_shape == full && owner.decl.partition_dim == d.decl.partition_dim,
                     name << " is tied to " << owner.name << " (tie_key '" << tie << "') but their shapes differ");
        out.entry_of[k] = it->second;
        continue;
      }
    }
    ParamEntry e;
    e.name = name;
    e.full_shape = full;
    e.local_shape = local;
    e.numel = static_cast<size_t>(product(local));
    e.layer = d.layer;
    e.decl = d.decl;
    e.duplicated = d.decl.partition_dim < 0;
    e.expert = expert;
    e.tie_key = tie;
    out.entry_of[k] = out.entries.size();
    if (!tie.empty()) tied[tie] = out.entries.size();
    out.entries.push_back(std::move(e));
  }
  return out;
}

void place_entries_in_chunks(CollectedParams& c, const std::vector<int>& chunk_of_layer,
                             const std::vector<int>& chunk_global_index, int num_global) {
  std::vector<int> decls_per_entry(c.entries.size(), 0);
  for (size_t k = 0; k < c.decls.size(); ++k) ++decls_per_entry[c.entry_of[k]];
  for (size_t i = 0; i < c.entries.size(); ++i) {
    ParamEntry& e = c.entries[i];
    e.chunk = chunk_of_layer[static_cast<size_t>(e.layer)];
    const int global_index = chunk_global_index[static_cast<size_t>(e.chunk)];
    if (e.tie_key.empty() || decls_per_entry[i] > 1 || num_global == 1) continue;
    LOOM_REQUIRE(global_index == 0 || global_index + 1 == num_global,
                 "parameter " << e.name << " is tied (tie_key '" << e.tie_key << "') across pipeline stages from chunk "
                              << global_index << "; ties across stages are kept in sync over the embedding group, "
                              << "which joins the first and the last chunk only");
    e.shared_across_stages = true;
  }
}

BufferLayout layout_entries(const std::vector<ParamEntry>& entries, size_t chunks, int dp, size_t bucket_size) {
  std::vector<int> chunk_of;
  std::vector<size_t> numels;
  std::vector<bool> expert;
  for (const ParamEntry& e : entries) {
    chunk_of.push_back(e.chunk);
    numels.push_back(e.numel);
    expert.push_back(e.expert);
  }
  return layout_model_buffer(chunk_of, numels, expert, chunks, dp, bucket_size);
}

}  // namespace loom::model
