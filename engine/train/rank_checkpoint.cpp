#include "engine/train/rank_checkpoint.hpp"

#include "engine/model/param_init.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <thread>
#include <utility>

namespace loom::train {

namespace {
double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// One copy of the layers' state is saved for the ranks holding them: refused, on every
// one of them, when their copies differ (a layer that lets them drift apart).
void require_equal_copies(const model::StateValues& values, const loom::Group& holders, int64_t step) {
  uint64_t hash = model::fnv1a(nullptr, 0);
  for (const auto& [name, v] : values) {
    hash = model::fnv1a(name.data(), name.size(), hash);
    hash = model::fnv1a(v.data(), v.size() * sizeof(float), hash);
  }
  std::vector<int64_t> all(static_cast<size_t>(std::max(1, holders.size())));
  const int64_t mine = static_cast<int64_t>(hash);
  holders.all_gather(nullptr, &mine, all.data(), 1, LOOM_DTYPE_I64);
  for (size_t r = 1; r < all.size(); ++r)
    if (all[r] != all[0])
      throw CheckpointError("the checkpoint of step " + std::to_string(step) + " is not saved: the layers' state "
                            "differs between the ranks that hold them (rank " + std::to_string(r) +
                            " of their tp-dp-cp group and rank 0); a layer must keep its state (loom_layer_api.state) "
                            "equal on every rank that holds it");
}

// A checkpoint a resume would refuse is not written (the copies are equal by now, so
// every rank holding them refuses alike).
void require_finite(const model::StateValues& values, int64_t step) {
  for (const auto& [name, v] : values)
    for (size_t i = 0; i < v.size(); ++i)
      if (!std::isfinite(v[i]))
        throw CheckpointError("the checkpoint of step " + std::to_string(step) + " is not saved: layer state " + name +
                              " holds " + std::to_string(v[i]) + " at element " + std::to_string(i) +
                              " (a resume would refuse it)");
}
}  // namespace

struct CheckpointSaver::Pending {
  CheckpointMeta meta;  // all but the ranks' checksums, known at the commit
  std::string tmp;      // the step's temporary directory
  RankState state;      // this rank's snapshot, freed once written
  // The layers' state, when this rank writes it for the ranks holding its layers.
  std::optional<model::StateValues> layer_states;
  uint64_t state_checksum = 0;
  ParamLayoutList layout;
  bool background = false;
  double waited_ms = 0;
  // Set by the writer (before `done`, which publishes them).
  uint64_t checksum = 0, bytes = 0;
  double written_ms = 0;
  std::exception_ptr error;
  std::atomic<bool> done{false};
  std::thread thread;
};

CheckpointSaver::CheckpointSaver(const RunPlan& plan, runtime::RankRuntime& rank, std::string manifest_toml,
                                 OnCommit on_commit, BeforeWrite before_write)
    : plan_(plan),
      rank_(rank),
      manifest_toml_(std::move(manifest_toml)),
      on_commit_(std::move(on_commit)),
      before_write_(std::move(before_write)) {}

CheckpointSaver::~CheckpointSaver() {
  cancel_ = true;
  if (pending_ && pending_->thread.joinable()) pending_->thread.join();
}

bool CheckpointSaver::writing() const { return pending_ && !pending_->done.load(std::memory_order_acquire); }

std::unique_ptr<CheckpointSaver::Pending> CheckpointSaver::stage(const model::Model& model,
                                                                 const OptimizerBinding& optimizer, int64_t step,
                                                                 uint64_t consumed_samples, bool evaluation_pending) {
  const manifest::RunConfig& config = plan_.config;
  auto p = std::make_unique<Pending>();
  // The layers' state first, so that a save it refuses leaves nothing on disk. Every
  // rank holding a layer holds the same state: the first of them writes it.
  if (!model.layer_states().empty()) {
    const loom::Group holders = rank_.group_or_self("tp-dp-cp");
    model::StateValues values = model.layer_states().snapshot();
    require_equal_copies(values, holders, step);
    require_finite(values, step);
    if (holders.rank() == 0) p->layer_states = std::move(values);
  }
  p->tmp = temp_checkpoint_path(config.checkpoint.dir, step);
  if (rank_.global_rank() == 0) prepare_temp_dir(p->tmp);
  rank_.group_or_self("world").barrier();
  p->state.elem_size = loom::dtype_size(model.param_dtype());
  p->state.params.resize(model.numel() * p->state.elem_size);
  rank_.dev().copy(p->state.params.data(), model.params(), p->state.params.size(), LOOM_COPY_DEVICE_TO_HOST);
  p->state.optimizer = optimizer.save_state();
  p->layout = param_layout_of(model);
  CheckpointMeta& meta = p->meta;
  meta = CheckpointMeta{step, plan_.sizes.world, plan_.sizes.tp, plan_.sizes.pp, plan_.dp,
                        config.optimizer.strategy, config.optimizer.bucket_size,
                        config.device.param_dtype, plan_.sizes.ep, plan_.sizes.order,
                        plan_.sizes.expert_tp()};
  meta.cp = plan_.sizes.cp;
  meta.vocab = model.dims().vocab;
  meta.consumed_samples = static_cast<int64_t>(consumed_samples);
  meta.evaluation_pending = evaluation_pending;
  return p;
}

// On the writer thread, or in line: never throws (a failure is kept for the commit).
void CheckpointSaver::write(Pending& p) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    if (before_write_) before_write_(p.meta.step, rank_.global_rank());
    p.bytes = p.state.params.size() + p.state.optimizer.size();
    p.checksum = write_rank_file(p.tmp, rank_.global_rank(), p.meta.step, p.state, &cancel_);
    write_param_layout(p.tmp, rank_.global_rank(), p.layout);
    if (p.layer_states) p.state_checksum = write_state_file(p.tmp, rank_.global_rank(), p.meta.step, *p.layer_states);
  } catch (...) {
    p.error = std::current_exception();
  }
  p.state = RankState{};  // the host copy goes as soon as it is on disk
  p.written_ms = ms_since(t0);
  p.done.store(true, std::memory_order_release);
}

void CheckpointSaver::commit(Pending& p) {
  const auto t0 = std::chrono::steady_clock::now();
  if (p.thread.joinable()) p.thread.join();
  if (p.error) {
    if (!p.background) std::rethrow_exception(p.error);
    try {
      std::rethrow_exception(p.error);
    } catch (const std::exception& e) {
      throw CheckpointError("the checkpoint of step " + std::to_string(p.meta.step) + ", written beside training, "
                            "failed: " + e.what());
    }
  }
  const loom::Group world = rank_.group_or_self("world");
  // Each rank's checksum, bytes and microseconds of writing (every file written when
  // it returns), and whether it wrote a layer-state file, with that file's checksum.
  constexpr size_t kFields = 5;
  const int64_t mine[kFields] = {static_cast<int64_t>(p.checksum), static_cast<int64_t>(p.bytes),
                                 static_cast<int64_t>(p.written_ms * 1e3), p.layer_states ? 1 : 0,
                                 static_cast<int64_t>(p.state_checksum)};
  std::vector<int64_t> all(kFields * static_cast<size_t>(world.size()));
  world.all_gather(nullptr, mine, all.data(), kFields, LOOM_DTYPE_I64);
  Committed c{p.meta.step, "", 0, p.waited_ms, 0, p.background};
  for (size_t r = 0; r < all.size(); r += kFields) {
    c.bytes += static_cast<uint64_t>(all[r + 1]);
    c.written_ms = std::max(c.written_ms, static_cast<double>(all[r + 2]) / 1e3);
  }
  if (rank_.global_rank() == 0) {
    for (size_t r = 0; r < all.size(); r += kFields) {
      p.meta.rank_checksums.push_back(static_cast<uint64_t>(all[r]));
      if (all[r + 3] == 0) continue;
      p.meta.state_ranks.push_back(static_cast<int>(r / kFields));
      p.meta.state_checksums.push_back(static_cast<uint64_t>(all[r + 4]));
    }
    commit_checkpoint(plan_.config.checkpoint.dir, p.tmp, p.meta, manifest_toml_);
    c.dir = checkpoint_path(plan_.config.checkpoint.dir, p.meta.step);
  }
  world.barrier();
  c.waited_ms += ms_since(t0);
  if (on_commit_) on_commit_(c);
}

void CheckpointSaver::commit_pending() {
  if (!pending_) return;
  const std::unique_ptr<Pending> p = std::move(pending_);
  commit(*p);
}

void CheckpointSaver::save(const model::Model& model, const OptimizerBinding& optimizer, int64_t step,
                           uint64_t consumed_samples, bool evaluation_pending, bool in_line) {
  commit_pending();
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_ptr<Pending> p = stage(model, optimizer, step, consumed_samples, evaluation_pending);
  p->waited_ms = ms_since(t0);
  if (in_line) {
    write(*p);
    p->waited_ms = ms_since(t0);
    commit(*p);
    return;
  }
  p->background = true;
  Pending& pending = *p;
  pending_ = std::move(p);
  pending.thread = std::thread([this, &pending] { write(pending); });
}

namespace {
// A resume at the checkpoint's dp whose bucket size differs but lays this rank's
// buffers out the same (every chunk smaller than both sizes): the file reads as is.
bool same_buffers(const ResumePoint& from, const RunPlan& plan, const model::Model& model) {
  if (from.old_dp != plan.dp || from.old_bucket_size < 0) return false;
  const model::BufferLayout old = model::layout_entries(model.param_entries(), model.chunk_count(),
                                                        from.old_dp * plan.sizes.cp,
                                                        static_cast<size_t>(from.old_bucket_size));
  const model::BufferLayout& now = model.layout();
  return old.numel == now.numel && old.params == now.params && old.buckets == now.buckets;
}
}  // namespace

void restore_checkpoint(const RunPlan& plan, const ResumePoint& from, runtime::RankRuntime& rank,
                        model::Model& model, OptimizerBinding& optimizer, const std::string& manifest_toml,
                        const InitialWeights* regathered) {
  const loom::Device dev = rank.dev();
  const int r = rank.global_rank();
  if (from.regather) {  // another layout: whole tensors and their state, cut for this rank
    LOOM_REQUIRE(regathered != nullptr, "resume from " << from.dir << " at another layout without its regathered state");
    load_initial_weights(*regathered, model.dims().vocab, model);
    std::vector<std::vector<float>> arrays = optimizer_state_for(*regathered, model.dims().vocab, model);
    std::vector<float*> ptrs;
    for (std::vector<float>& a : arrays) ptrs.push_back(a.data());
    loom_optimizer_elements e = loom::make<loom_optimizer_elements>();
    e.num_arrays = static_cast<uint32_t>(arrays.size());
    e.numel = model.numel();
    e.arrays = ptrs.data();
    loom::check(optimizer.api()->state_import(optimizer.handle(), &e));
  } else if (from.old_dp == 0 || same_buffers(from, plan, model)) {  // the same layout
    check_param_layout(from.dir, r, param_layout_of(model));
    require_same_model(from.dir, manifest_toml, plan);  // what the shapes cannot tell
    RankState s = read_rank_file(from.dir, r, static_cast<int64_t>(model.numel()),
                                 loom::dtype_size(model.param_dtype()));
    dev.copy(model.params(), s.params.data(), s.params.size(), LOOM_COPY_HOST_TO_DEVICE);
    optimizer.load_state(s.optimizer);
  } else {
    const int64_t bucket_size =
        from.old_bucket_size >= 0 ? from.old_bucket_size : plan.config.optimizer.bucket_size;
    load_resharded(from.dir, from.old_dp, from.old_world, plan.sizes, r, model, dev, static_cast<size_t>(bucket_size),
                   optimizer.api(), optimizer.handle(), "parallel/" + plan.optimizer->name);
    require_same_model(from.dir, manifest_toml, plan);  // after the shapes, which load_resharded compares
  }
  if (from.regather) require_same_model(from.dir, manifest_toml, plan);
  // The layers' state is the same at every layout (regathered: with the weights).
  if (!from.regather && !model.layer_states().empty())
    model.layer_states().assign(read_layer_states(from.dir), "checkpoint " + from.dir);
  dev.synchronize();
}

}  // namespace loom::train
