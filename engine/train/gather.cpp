#include "engine/train/gather.hpp"

#include "engine/files/read.hpp"
#include "engine/train/run_plan.hpp"

#include <boost/filesystem.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <set>

namespace loom::train {

namespace {

namespace fs = boost::filesystem;

int64_t product(const std::vector<int64_t>& shape, size_t from = 0) {
  int64_t n = 1;
  for (size_t i = from; i < shape.size(); ++i) n *= shape[i];
  return n;
}

// How one dim of a shard maps into the whole tensor: the shard's index j along it is
// whole index (j / part) * block + piece * part + j % part (stride blocks, each cut
// into parts, this shard holding part `piece` of each).
struct DimSplit {
  int64_t block = 0, part = 0, piece = 0;
  int64_t whole(int64_t j) const { return (j / part) * block + piece * part + j % part; }
};

// The split of each dim of parameter p on a rank: dim 0 over ep for an expert
// parameter; its partition dim over tp (etp for experts) with its stride.
std::vector<DimSplit> splits_of(const PlannedParam& p, const ShardCoords& at) {
  std::vector<DimSplit> s(p.full_shape.size());
  for (size_t d = 0; d < s.size(); ++d) s[d] = {p.full_shape[d], p.full_shape[d], 0};
  if (p.expert) s[0] = {p.full_shape[0], p.local_shape[0], at.ep_rank};
  if (p.partition_dim >= 0 && p.partition_dim < static_cast<int32_t>(s.size())) {
    const size_t d = static_cast<size_t>(p.partition_dim);
    s[d] = {p.full_shape[d] / p.partition_stride, p.local_shape[d] / p.partition_stride,
            p.expert ? at.etp_rank : at.tp_rank};
  }
  return s;
}

std::string read_text(const std::string& path) {
  std::string why;
  std::optional<std::string> bytes = files::read_whole_file(path, &why);
  if (!bytes) throw CheckpointError("cannot read " + path + " (" + why + ")");
  return std::move(*bytes);
}

}  // namespace

int64_t WholeTensor::numel() const { return product(shape); }

void for_each_shard_run(const PlannedParam& p, const ShardCoords& at,
                        const std::function<void(int64_t local, int64_t whole, int64_t count)>& run) {
  const std::vector<DimSplit> s = splits_of(p, at);
  const size_t nd = p.local_shape.size();
  if (nd == 0) return;
  // Rows of the last dim go in runs of `part` elements (its split's contiguous piece).
  const int64_t cols = p.local_shape[nd - 1], step = s[nd - 1].part;
  const int64_t rows = product(p.local_shape) / std::max<int64_t>(1, cols);
  std::vector<int64_t> idx(nd, 0);  // the shard's index of the current row (last dim 0)
  for (int64_t row = 0; row < rows; ++row) {
    int64_t base = 0;  // the whole tensor's offset of the row's dims before the last
    for (size_t d = 0; d + 1 < nd; ++d) base = base * p.full_shape[d] + s[d].whole(idx[d]);
    for (int64_t c = 0; c < cols; c += step) run(row * cols + c, base * p.full_shape[nd - 1] + s[nd - 1].whole(c), step);
    for (size_t d = nd - 1; d-- > 0;) {  // the next row's index
      if (++idx[d] < p.local_shape[d]) break;
      idx[d] = 0;
    }
  }
}

const WholeTensor* WholeCheckpoint::find(const std::string& name) const {
  for (const WholeTensor& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

namespace {

// The optimizer state of one rank's file, by element of its flat buffer.
struct RankElements {
  std::vector<std::vector<float>> arrays;
  std::vector<uint8_t> held;
};

RankElements decode_state(const loom_optimizer_api* api, const std::string& strategy, const std::vector<char>& blob,
                          size_t numel, const std::string& where) {
  RankElements out;
  loom_optimizer_elements e = loom::make<loom_optimizer_elements>();
  e.numel = numel;
  const auto check = [&](loom_status st) {
    try {
      loom::check(st);
    } catch (const std::exception& ex) {
      throw CheckpointError(where + ": parallel/" + strategy + " cannot read its optimizer state: " + ex.what());
    }
  };
  check(api->state_decode(blob.data(), blob.size(), &e));
  out.arrays.assign(e.num_arrays, std::vector<float>(numel, 0.0f));
  out.held.assign(numel, 0);
  std::vector<float*> ptrs;
  for (auto& a : out.arrays) ptrs.push_back(a.data());
  e.arrays = ptrs.data();
  e.held = out.held.data();
  check(api->state_decode(blob.data(), blob.size(), &e));
  return out;
}

}  // namespace

TensorFilter tensors_held_by(const MemoryPlan& plan, const std::vector<int32_t>& ranks) {
  auto names = std::make_shared<std::set<std::string>>(), ties = std::make_shared<std::set<std::string>>();
  for (int32_t r : ranks)
    for (const PlannedParam& p : plan.ranks.at(static_cast<size_t>(r)).planned()) {
      names->insert(p.name);
      if (!p.tie_key.empty()) ties->insert(p.tie_key);
    }
  return [names, ties](const PlannedParam& p) {
    return names->count(p.name) > 0 || (!p.tie_key.empty() && ties->count(p.tie_key) > 0);
  };
}

WholeCheckpoint gather_checkpoint(const std::string& step_dir, plugins::Registry& registry, bool with_state,
                                  const TensorFilter& wanted) {
  WholeCheckpoint out;
  out.meta = read_meta(step_dir);
  const std::string manifest_path = (fs::path(step_dir) / "manifest.toml").string();
  out.manifest_toml = read_text(manifest_path);
  RunPlan plan =
      make_plan(manifest::Manifest::parse(out.manifest_toml, manifest_path, {}, manifest::Manifest::Launch::Other),
                registry, PlanUse::CheckpointLayout);
  const CheckpointMeta& m = out.meta;
  if (plan.sizes.world != m.world || plan.sizes.tp != m.tp || plan.sizes.pp != m.pp || plan.sizes.ep != m.ep ||
      plan.sizes.cp != m.cp)
    throw CheckpointError("checkpoint " + step_dir + ": its manifest.toml plans world " +
                          std::to_string(plan.sizes.world) + " (tp " + std::to_string(plan.sizes.tp) + ", cp " +
                          std::to_string(plan.sizes.cp) + ", pp " + std::to_string(plan.sizes.pp) + ", ep " +
                          std::to_string(plan.sizes.ep) + ") but meta.toml says world " + std::to_string(m.world) +
                          " (tp " + std::to_string(m.tp) + ", cp " + std::to_string(m.cp) + ", pp " +
                          std::to_string(m.pp) + ", ep " + std::to_string(m.ep) + "); the checkpoint is corrupt");
  // The vocabulary the run had (recorded since checkpoints carry it; else the data's).
  const MemoryPlan mp = plan_memory(plan, m.vocab);
  out.vocab = mp.vocab;
  out.states = read_layer_states(step_dir);
  const int32_t dtype = m.param_dtype == "bf16" ? LOOM_DTYPE_BF16 : LOOM_DTYPE_F32;
  const size_t elem = m.param_dtype == "bf16" ? 2 : 4;

  const loom_optimizer_api* decoder = with_state ? plan.optimizer->optimizer() : nullptr;
  if (with_state && (!LOOM_HAS_SLOT(decoder, loom_optimizer_api, state_decode) || decoder->state_decode == nullptr))
    throw CheckpointError("checkpoint " + step_dir + ": its optimizer strategy parallel/" + plan.optimizer->name +
                          " (ABI 1." + std::to_string(plan.optimizer->abi_minor) +
                          ") cannot read back its state by element (no state_decode, ABI 1.14), so it resumes at its "
                          "own tp, pp, cp and ep only");
  std::map<std::string, size_t> index;  // name -> out.tensors
  std::vector<std::vector<bool>> filled;  // per tensor, which elements a rank has given
  std::vector<int64_t> missing;            // per tensor, how many it still lacks
  std::vector<std::vector<bool>> state_filled;  // per tensor, which elements' state a rank has given
  std::vector<int64_t> state_missing;
  std::set<std::string> declared;
  for (const RankMemory& r : mp.ranks)
    for (const PlannedParam& p : r.planned()) declared.insert(p.name);
  out.declared = declared.size();
  for (const RankMemory& r : mp.ranks) {
    // dp and cp replicas of a position hold the same values: read one of each (all of
    // them for the state, which the distributed optimizer shards over them).
    const auto want = [&](const PlannedParam& p) { return !wanted || wanted(p); };
    const bool needed = std::any_of(r.planned().begin(), r.planned().end(), [&](const PlannedParam& p) {
      if (!want(p)) return false;
      auto it = index.find(p.name);
      return with_state || it == index.end() || missing[it->second] > 0;
    });
    if (!needed) continue;
    const RankState state = read_rank_file(step_dir, r.rank, static_cast<int64_t>(r.layout().numel), elem);
    RankElements elements;
    if (with_state)
      elements = decode_state(decoder, plan.optimizer->name, state.optimizer, r.layout().numel,
                              "checkpoint " + step_dir + ", rank " + std::to_string(r.rank));
    ParamLayoutList layout;
    for (const PlannedParam& p : r.planned()) layout.push_back({p.name, p.local_shape});
    check_param_layout(step_dir, r.rank, layout);  // the plan's parameters are the file's
    for (size_t i = 0; i < r.planned().size(); ++i) {
      const PlannedParam& p = r.planned()[i];
      if (!want(p)) continue;
      auto [it, added] = index.emplace(p.name, out.tensors.size());
      if (added) {
        WholeTensor t;
        t.name = p.name;
        t.shape = p.full_shape;
        t.dtype = dtype;
        t.tie_key = p.tie_key;
        t.data.assign(static_cast<size_t>(t.numel()) * elem, 0);
        out.tensors.push_back(std::move(t));
        filled.emplace_back(static_cast<size_t>(out.tensors.back().numel()), false);
        missing.push_back(out.tensors.back().numel());
        state_filled.emplace_back(with_state ? static_cast<size_t>(out.tensors.back().numel()) : 0, false);
        state_missing.push_back(with_state ? out.tensors.back().numel() : 0);
      }
      WholeTensor& t = out.tensors[it->second];
      if (t.shape != p.full_shape)
        throw CheckpointError("checkpoint " + step_dir + ": parameter " + p.name + " has two shapes across ranks");
      const char* shard = state.params.data() + r.layout().params[i].start * elem;
      std::vector<bool>& done = filled[it->second];
      int64_t& left = missing[it->second];
      for_each_shard_run(p, {r.tp_rank, r.ep_rank, r.etp_rank}, [&](int64_t local, int64_t whole, int64_t n) {
        std::memcpy(t.data.data() + whole * elem, shard + local * elem, static_cast<size_t>(n) * elem);
        for (int64_t j = whole; j < whole + n; ++j)
          if (!done[static_cast<size_t>(j)]) {
            done[static_cast<size_t>(j)] = true;
            --left;
          }
      });
      if (!with_state) continue;
      if (t.state.empty()) t.state.assign(elements.arrays.size(), std::vector<float>(static_cast<size_t>(t.numel()), 0.0f));
      const size_t start = r.layout().params[i].start;
      std::vector<bool>& state_done = state_filled[it->second];
      int64_t& state_left = state_missing[it->second];
      for_each_shard_run(p, {r.tp_rank, r.ep_rank, r.etp_rank}, [&](int64_t local, int64_t whole, int64_t n) {
        for (int64_t j = 0; j < n; ++j) {
          const size_t from = start + static_cast<size_t>(local + j), to = static_cast<size_t>(whole + j);
          if (!elements.held[from] || state_done[to]) continue;
          for (size_t k = 0; k < t.state.size(); ++k) t.state[k][to] = elements.arrays[k][from];
          state_done[to] = true;
          --state_left;
        }
      });
    }
  }
  for (size_t k = 0; k < out.tensors.size(); ++k)
    if (with_state && state_missing[k] > 0)
      throw CheckpointError("checkpoint " + step_dir + ": the optimizer state of " + out.tensors[k].name + " lacks " +
                            std::to_string(state_missing[k]) + " element(s) no rank's state holds");
  for (size_t k = 0; k < out.tensors.size(); ++k)
    if (missing[k] > 0)
      throw CheckpointError("checkpoint " + step_dir + ": no rank holds all of " + out.tensors[k].name +
                            " (its shards do not cover it)");
  return out;
}

}  // namespace loom::train
