// Checkpoints: <dir>/step_<N>/ holds one file per rank (parameters + optimizer
// state, checksummed), the resolved manifest and a meta file. A checkpoint is
// written into a temporary directory, fsynced, and renamed into place, so a
// crash never leaves a half-written step_<N>: what exists is complete.
#pragma once

#include "engine/model/buffer_layout.hpp"
#include "engine/model/model.hpp"
#include "engine/topology/rank_groups.hpp"
#include "engine/train/run_plan.hpp"

#include <loom/cpp/core.hpp>

#include <atomic>
#include <cstdint>
#include <ostream>
#include <optional>
#include <thread>
#include <stdexcept>
#include <string>
#include <vector>

namespace loom::train {

class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct RankState {
  std::vector<char> params;          // the rank's flat parameter buffer, in its dtype (device.param_dtype)
  size_t elem_size = sizeof(float);  // bytes per parameter element
  std::vector<char> optimizer;       // the optimizer strategy's state blob
};

struct CheckpointMeta {
  int64_t step = 0;                  // steps completed
  int world = 1, tp = 1, pp = 1, dp = 1;
  std::string strategy;              // optimizer.strategy that wrote it
  int64_t bucket_size = -1;          // optimizer.bucket_size that wrote it (-1: not recorded)
  std::string param_dtype = "fp32";  // device.param_dtype that wrote it (not recorded before bf16: fp32)
  int ep = 1;                        // parallel.ep that wrote it (not recorded before expert parallelism: 1)
  std::string order = "tp-cp-ep-dp-pp";  // parallel.order that wrote it (not recorded before: the default)
  int etp = 0;                       // parallel.etp that wrote it, resolved (0: not recorded, i.e. tp)
  int expert_tp() const { return etp > 0 ? etp : tp; }
  int cp = 1;                        // parallel.cp that wrote it (not recorded before: 1)
  int64_t vocab = 0;                 // the model's vocabulary, unpadded (0: not recorded)
  int64_t consumed_samples = -1;     // training samples read by `step` (-1: not recorded, i.e. step x the global batch)
  std::vector<uint64_t> rank_checksums;  // each rank file's, by rank (empty: not recorded)
  bool evaluation_pending = false;   // a stop signal came before `step`'s evaluation (run.eval_every) ended
  // The ranks that wrote a layer-state file (rank_NNNNN.state: one rank of each group
  // holding the same layers, when they keep state) and each file's checksum.
  std::vector<int> state_ranks;
  std::vector<uint64_t> state_checksums;
};

// A resume must keep device.param_dtype: the parameter files hold that dtype and
// the optimizer state has fp32 master weights exactly when it is not fp32.
// Throws a CheckpointError naming both otherwise.
void require_same_param_dtype(const std::string& step_dir, const CheckpointMeta& meta, const std::string& param_dtype);

// A resume must continue the same model: the architecture keys of the manifest the
// checkpoint kept (manifest.toml) against this run's (`manifest_toml`, of `plan`); throws a
// CheckpointError naming the first that differs (a checkpoint without a manifest passes).
// A layer option one manifest lacks (a checkpoint written before its plugin declared it)
// counts as the plugin's default.
void require_same_model(const std::string& step_dir, const std::string& manifest_toml, const RunPlan& plan);
// The settings that choose which samples come after the checkpoint (run.seed and every
// data.* key) where the checkpoint's manifest and `manifest_toml` differ: "key: was ->
// now" each (empty for a checkpoint without its manifest). A resume with them changed
// is allowed (a new data mix, say) but is not the uninterrupted run: it is said.
std::vector<std::string> data_order_changes(const std::string& step_dir, const std::string& manifest_toml);
// Likewise the learning-rate and weight-decay schedules, when a step after
// `from_step` (the checkpoint's, after `from_samples` training samples; a schedule in
// samples places each later step by this run's batches) gets another rate or weight
// decay under `now` than under the checkpoint's settings (its manifest's, batches
// included): the first such step and its values, then each setting that differs
// ("key: was -> now"; where the decay ends, or the weight decay's schedule, when it
// moved). Allowed (annealing a wsd run from a constant one changes it on purpose), and
// said: raising run.steps with decay_steps = 0 moves the decay's end, which
// Megatron-LM's scheduler check would refuse.
std::vector<std::string> schedule_changes(const std::string& step_dir, const manifest::RunConfig& now,
                                          int64_t from_step, uint64_t from_samples);

// Path of step N's directory.
std::string checkpoint_path(const std::string& dir, int64_t step);
// The complete steps in dir (step_N directories with their meta.toml), ascending;
// `skipped` gets each step_* directory that is not a complete checkpoint, as
// "<path> (<why>)": no meta.toml, or a name that is no step number.
std::vector<int64_t> complete_checkpoints(const std::string& dir, std::vector<std::string>* skipped = nullptr);
// The highest of them, or nullopt when there is none.
std::optional<int64_t> latest_checkpoint(const std::string& dir, std::vector<std::string>* skipped = nullptr);
// checkpoint.keep_last (TorchTitan's keep_latest_k), by the holder of the directory's
// lock (global rank 0's process): after step `saved_step` is saved, prune() takes the
// complete checkpoints before it but the newest keep_last - 1 (none when keep_last is 0)
// out of their step_N names at once and removes their files on a thread of its own,
// joined before the next pruning and when the pruner goes (the run's end); steps after
// the saved one and step_N directories that are not complete checkpoints are never
// touched. Returns the step paths taken out; those that could not be moved, and the
// files the last pruning could not remove, go to `failed` as "<path> (<why>)" (the
// save itself stands). A stop while files are being removed leaves
// .removing-step_N-PID, which the next run's prepare_checkpoint_dir removes.
class CheckpointPruner {
 public:
  CheckpointPruner(std::string dir, int64_t keep_last);
  ~CheckpointPruner();
  CheckpointPruner(const CheckpointPruner&) = delete;
  CheckpointPruner& operator=(const CheckpointPruner&) = delete;
  std::vector<std::string> prune(int64_t saved_step, std::vector<std::string>* failed);
  // Waits for the files of the last pruning to be gone; returns what could not be
  // removed, as "<path> (<why>)".
  std::vector<std::string> finish();

 private:
  std::string dir_;
  int64_t keep_last_ = 0;
  std::thread removing_;
  std::vector<std::string> not_removed_;  // written by removing_, read after it is joined
};
// The step directory a user's path names (`loom export`, `generate`, `eval`,
// checkpoint.init_weights): the path itself when it holds meta.toml, else the newest
// complete step of it as a checkpoint.dir (the step_* directories passed over go to
// `skipped`, as latest_checkpoint's); "" when it is neither.
std::string named_checkpoint(const std::string& path, std::vector<std::string>* skipped = nullptr);
// Held by the process of global rank 0 while it trains (flock on checkpoint.dir/.lock,
// released when the process ends however it ends): a second run saving into the same
// directory is refused naming the process that holds it.
class CheckpointDirLock {
 public:
  explicit CheckpointDirLock(const std::string& dir);  // throws CheckpointError
  ~CheckpointDirLock();
  CheckpointDirLock(const CheckpointDirLock&) = delete;
  CheckpointDirLock& operator=(const CheckpointDirLock&) = delete;

 private:
  int fd_ = -1;
};

// Before training: creates checkpoint.dir, takes its lock into `lock` (the process of
// global rank 0; null for the others), then, holding it, removes the temporary
// directories of unfinished saves whose process is gone and puts back a step moved
// aside by a save that stopped, and what a stopped pruning left (.removing-step_N-*),
// and proves the directory writable (a probe file). Throws CheckpointError naming the
// directory; returns warnings (what could not be removed, and why).
std::vector<std::string> prepare_checkpoint_dir(const std::string& dir, std::optional<CheckpointDirLock>* lock);

// The parameters a rank holds, as a checkpoint records them: name and local
// shape, in model order (model::Model::param_entries()).
struct ParamLayoutEntry {
  std::string name;
  std::vector<int64_t> shape;
};
using ParamLayoutList = std::vector<ParamLayoutEntry>;
ParamLayoutList param_layout_of(const model::Model& model);
// rank_NNNNN.params next to the rank's file in `tmp`: one line per parameter,
// "name d0 d1 ...". A resume checks it against the model (check_param_layout), so a
// checkpoint of another model is refused naming the first parameter that differs
// (the rank file alone would only show a different element count, or none).
void write_param_layout(const std::string& tmp, int rank, const ParamLayoutList& params);
// Throws CheckpointError naming the file and the first difference; a checkpoint
// written before these files existed has none and passes.
void check_param_layout(const std::string& step_dir, int file_rank, const ParamLayoutList& params);

// Per-rank file, written into the temporary directory `tmp` (fsynced).
// Returns the file's checksum, which meta.toml records for every rank. A raised
// `cancel` stops a long write between pieces (CheckpointError).
uint64_t write_rank_file(const std::string& tmp, int rank, int64_t step, const RankState& state,
                         const std::atomic<bool>* cancel = nullptr);
// rank_NNNNN.state in `tmp` (fsynced): the layers' state a rank holds (ABI 1.23,
// model::LayerStates), written by one rank of the group holding each pipeline stage's
// layers (their copies are the same). Returns its checksum, which meta.toml records.
uint64_t write_state_file(const std::string& tmp, int rank, int64_t step, const model::StateValues& states);
// Every layer-state file meta.toml lists, checked against it (step, rank, checksum),
// merged by name; empty for a checkpoint without any. Throws CheckpointError.
model::StateValues read_layer_states(const std::string& step_dir);

// Rank 0, after every rank wrote its file: meta + manifest, fsync, atomic rename.
void commit_checkpoint(const std::string& dir, const std::string& tmp, const CheckpointMeta& meta,
                       const std::string& manifest_toml);
// After a run that failed, by the holder of checkpoint.dir's lock: removes this run's
// unfinished saves (.tmp-step_N-<this run's id>), which nothing will commit, so that a
// save that failed on a full disk gives its space back now (under mpirun, where the
// next run cannot tell a job's leftovers from a live job's, as far as the job lets it:
// another process may still write there). Returns what could not be removed, as
// "<path> (<why>)"; throws boost's filesystem_error when the directory cannot be read.
std::vector<std::string> remove_unfinished_saves_of_this_run(const std::string& dir);
// The temporary directory for step N (created by rank 0 before the others write).
std::string temp_checkpoint_path(const std::string& dir, int64_t step);
void prepare_temp_dir(const std::string& tmp);

CheckpointMeta read_meta(const std::string& step_dir);
// Once a resumed run has done the evaluation a stop cut short: meta.toml rewritten
// whole without evaluation_pending (a later resume does not run it again).
void clear_evaluation_pending(const std::string& step_dir);
// Reads and verifies one rank's file (magic, version, sizes, checksum); its
// parameters are expect_numel elements of elem_size bytes.
RankState read_rank_file(const std::string& step_dir, int rank, int64_t expect_numel, size_t elem_size = sizeof(float));

// --- Resuming at another data-parallel size (tp and pp unchanged) ---
// The global ranks that held this rank's (tp, pp) position in a run of `old_world`
// ranks (the same tp, cp, pp and order as `sizes`): its old gradient group (dp, or
// dp-cp under context parallelism), in that group's rank order.
std::vector<int> old_dp_peers(const topology::ParallelSizes& sizes, int rank, int old_world);
// A flat parameter buffer laid out as `from` re-laid as `to`: parameter i (model
// order, the same in both) moves from from.params[i] to to.params[i]; padding is zero.
// params holds from.numel elements of elem_size bytes.
std::vector<char> remap_params(const std::vector<char>& params, size_t elem_size, const model::BufferLayout& from,
                               const model::BufferLayout& to);
// The whole resume at another dp for one rank: reads the files of the old ranks at
// this rank's (tp, pp) position (old_world ranks, old_dp of them per position),
// recomputes the old layout of the model's parameters (the same layout function,
// the old dp), moves the parameters entry by entry into the model's buffer, and
// hands the old optimizer states and layout to the strategy's state_load_resharded
// (`plugin` names it in errors; a strategy that reports LOOM_CODE_UNSUPPORTED is
// refused with a CheckpointError).
void load_resharded(const std::string& step_dir, int old_dp, int old_world, const topology::ParallelSizes& sizes,
                    int rank, model::Model& model, const loom::Device& dev, size_t bucket_size,
                    const loom_optimizer_api* api, loom_optimizer* opt, const std::string& plugin);

// Where --resume continues from: the newest complete checkpoint in ckpt_dir, checked
// against this run (step within run.steps, vocabulary `vocab`, parameter dtype, cp, tp, pp, order, ep and
// etp kept; a dp change only with an optimizer that reshards). Says on `log` which
// incomplete step directories it skipped. Throws CheckpointError with what to set.
struct ResumePoint {
  std::string dir;                 // the checkpoint's directory
  int64_t step = 0;                // the step it holds
  uint64_t consumed_samples = 0;   // the training samples read by then (where the data continues)
  int64_t steps = 0;               // the step this run ends at (run.train_samples: counted on from the samples read)
  bool evaluation_pending = false; // its step's evaluation, cut short by a stop signal, is run first
  int old_dp = 0, old_world = 0;   // the checkpoint's dp and world when dp or the bucket size changes (reshard); else 0
  int64_t old_bucket_size = -1;    // its optimizer.bucket_size when resharding (-1: not recorded)
  // Another tp, pp, cp, ep or etp (or order): the parameters and optimizer state are
  // regathered by name and element (gather_checkpoint with the state).
  bool regather = false;
};
ResumePoint plan_resume(const RunPlan& plan, const std::string& ckpt_dir, int64_t vocab, std::ostream* log);

}  // namespace loom::train
