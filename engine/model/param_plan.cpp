#include "engine/model/param_plan.hpp"

#include "engine/model/param_init.hpp"

#include <loom/cpp/core.hpp>

#include <cstddef>
#include <cstring>
#include <algorithm>
#include <functional>
#include <map>
#include <numeric>
#include <stdexcept>

namespace loom::model {

namespace {
int64_t product(const std::vector<int64_t>& s) {
  return std::accumulate(s.begin(), s.end(), int64_t{1}, std::multiplies<int64_t>());
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

CollectedParams collect_param_entries(const std::vector<std::string>& instances,
                                      const std::vector<const loom_param_decl*>& decls,
                                      const std::vector<size_t>& counts, int tp_size, int ep_size,
                                      int etp_size) {
  if (etp_size <= 0) etp_size = tp_size;
  LOOM_REQUIRE(instances.size() == decls.size() && decls.size() == counts.size(),
               "collect_param_entries: one instance name, declaration array and count per layer");
  CollectedParams out;
  for (size_t li = 0; li < decls.size(); ++li)
    for (size_t i = 0; i < counts[li]; ++i)
      out.decls.push_back({static_cast<int>(li), static_cast<int>(i), param_decl_at(decls[li], i, instances[li])});
  // One entry per parameter in model order; a tied parameter is owned by its
  // first declaration and later declarations share it.
  std::map<std::string, size_t> tied;  // tie_key -> entry index
  out.entry_of.resize(out.decls.size());
  for (size_t k = 0; k < out.decls.size(); ++k) {
    const DeclRef& d = out.decls[k];
    const std::string name = instances[static_cast<size_t>(d.layer)] + "." + d.decl.name;
    LOOM_REQUIRE(d.decl.ndim >= 1 && d.decl.ndim <= 4, name << ": ndim must be 1..4");
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
