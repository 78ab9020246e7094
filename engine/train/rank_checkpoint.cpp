#include "engine/train/rank_checkpoint.hpp"

namespace loom::train {

std::string save_checkpoint(const RunPlan& plan, runtime::RankRuntime& rank, const model::Model& model,
                            const OptimizerBinding& optimizer, int64_t step, uint64_t consumed_samples,
                            bool evaluation_pending, const std::string& manifest_toml) {
  const manifest::RunConfig& config = plan.config;
  const std::string& dir = config.checkpoint.dir;
  const loom::Group world = rank.group_or_self("world");
  const bool leader = rank.global_rank() == 0;
  const std::string tmp = temp_checkpoint_path(dir, step);
  if (leader) prepare_temp_dir(tmp);
  world.barrier();
  RankState s;
  s.elem_size = loom::dtype_size(model.param_dtype());
  s.params.resize(model.numel() * s.elem_size);
  rank.dev().copy(s.params.data(), model.params(), s.params.size(), LOOM_COPY_DEVICE_TO_HOST);
  s.optimizer = optimizer.save_state();
  const int64_t checksum = static_cast<int64_t>(write_rank_file(tmp, rank.global_rank(), step, s));
  write_param_layout(tmp, rank.global_rank(), param_layout_of(model));
  std::vector<int64_t> checksums(static_cast<size_t>(world.size()));  // every file written when it returns
  world.all_gather(nullptr, &checksum, checksums.data(), 1, LOOM_DTYPE_I64);
  std::string committed;
  if (leader) {
    CheckpointMeta meta{step, plan.sizes.world, plan.sizes.tp, plan.sizes.pp, plan.dp,
                        config.optimizer.strategy, config.optimizer.bucket_size,
                        config.device.param_dtype, plan.sizes.ep, plan.sizes.order,
                        plan.sizes.expert_tp()};
    meta.cp = plan.sizes.cp;
    meta.vocab = model.dims().vocab;
    meta.consumed_samples = static_cast<int64_t>(consumed_samples);
    meta.evaluation_pending = evaluation_pending;
    for (const int64_t c : checksums) meta.rank_checksums.push_back(static_cast<uint64_t>(c));
    commit_checkpoint(dir, tmp, meta, manifest_toml);
    committed = checkpoint_path(dir, step);
  }
  world.barrier();
  return committed;
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
    require_same_model(from.dir, manifest_toml);  // what the shapes cannot tell
    RankState s = read_rank_file(from.dir, r, static_cast<int64_t>(model.numel()),
                                 loom::dtype_size(model.param_dtype()));
    dev.copy(model.params(), s.params.data(), s.params.size(), LOOM_COPY_HOST_TO_DEVICE);
    optimizer.load_state(s.optimizer);
  } else {
    const int64_t bucket_size =
        from.old_bucket_size >= 0 ? from.old_bucket_size : plan.config.optimizer.bucket_size;
    load_resharded(from.dir, from.old_dp, from.old_world, plan.sizes, r, model, dev, static_cast<size_t>(bucket_size),
                   optimizer.api(), optimizer.handle(), "parallel/" + plan.optimizer->name);
    require_same_model(from.dir, manifest_toml);  // after the shapes, which load_resharded compares
  }
  if (from.regather) require_same_model(from.dir, manifest_toml);
  dev.synchronize();
}

}  // namespace loom::train
