// Each rank's part of a checkpoint: its parameters and optimizer state written
// into the step's temporary directory, in line or beside training, and committed by
// rank 0 once every rank has written (checkpoint.hpp has the files and the atomic
// commit), and read back on resume, in the same layout or resharded.
#pragma once

#include "engine/train/init_weights.hpp"

#include "engine/model/model.hpp"
#include "engine/train/checkpoint.hpp"
#include "engine/train/optimizer_binding.hpp"
#include "engine/train/run_plan.hpp"

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace loom::train {

// One rank's checkpoint saves. A save has three parts: staging (rank 0 prepares the
// step's temporary directory; this rank's parameters and optimizer state are copied
// into host memory), writing this rank's files (fsynced), and the commit (every
// rank: the files' checksums gathered, then rank 0 writes meta.toml and renames the
// directory into place). In line, save() does all three while training waits. In the
// background (checkpoint.async_save, Megatron-LM's --async-save) a thread of this
// rank's own writes while training goes on, and the commit comes at a step where every
// rank's write has finished (the training loop asks each step, in the reduction of
// its stop flag: writing()), or before the next save, or at the run's end. Either way
// the checkpoint's files are the same bytes: only when they are written differs.
class CheckpointSaver {
 public:
  // What a commit saved, for the log.
  struct Committed {
    int64_t step = 0;
    std::string dir;           // the committed step directory on rank 0; "" on the others
    uint64_t bytes = 0;        // every rank's files
    double waited_ms = 0;      // training stopped for it on this rank: staging and the commit (in line: the write too)
    double written_ms = 0;     // the slowest rank's writing of its files
    bool background = false;   // written beside training
  };
  // Called on this rank's thread as soon as a save is committed (before anything after
  // it can fail, so a committed step is always reported).
  using OnCommit = std::function<void(const Committed&)>;
  // Called on the writing thread before it writes (tests hold a write back with it).
  using BeforeWrite = std::function<void(int64_t step, int rank)>;

  CheckpointSaver(const RunPlan& plan, runtime::RankRuntime& rank, std::string manifest_toml, OnCommit on_commit,
                  BeforeWrite before_write = nullptr);
  // A write still running is stopped (between pieces of its file) and joined: a run
  // that fails commits nothing, and leaves the temporary directory as a crash does
  // (prepare_checkpoint_dir removes it when its process is gone).
  ~CheckpointSaver();
  CheckpointSaver(const CheckpointSaver&) = delete;
  CheckpointSaver& operator=(const CheckpointSaver&) = delete;

  // Every rank calls it at the same point. Commits the save still pending first, then
  // saves `step`: whole when `in_line`, else staged with its write started.
  // `consumed_samples`: the training samples the run has read by `step`;
  // `evaluation_pending`: a stop signal came before step's evaluation ended (a resume
  // runs it first).
  void save(const model::Model& model, const OptimizerBinding& optimizer, int64_t step, uint64_t consumed_samples,
            bool evaluation_pending, bool in_line);
  // Whether a save is staged and not yet committed (the same on every rank).
  bool pending() const { return pending_ != nullptr; }
  // Whether this rank's write of it is still running.
  bool writing() const;
  // Every rank calls it at the same point: waits for this rank's write, then commits
  // the pending save (nothing when there is none). A failed write throws here, on its rank.
  void commit_pending();

 private:
  struct Pending;
  std::unique_ptr<Pending> stage(const model::Model& model, const OptimizerBinding& optimizer, int64_t step,
                                 uint64_t consumed_samples, bool evaluation_pending);
  void write(Pending& p);
  void commit(Pending& p);

  const RunPlan& plan_;
  runtime::RankRuntime& rank_;
  const std::string manifest_toml_;
  OnCommit on_commit_;
  BeforeWrite before_write_;
  std::unique_ptr<Pending> pending_;
  std::atomic<bool> cancel_{false};
};

// Loads `from` into this rank's parameters and optimizer state, after checking the
// parameter layout and the model the checkpoint kept.
// `regathered`: with from.regather, the checkpoint's whole tensors and their optimizer
// state (gather_checkpoint with the state, read once for every rank), cut for this rank.
void restore_checkpoint(const RunPlan& plan, const ResumePoint& from, runtime::RankRuntime& rank,
                        model::Model& model, OptimizerBinding& optimizer, const std::string& manifest_toml,
                        const InitialWeights* regathered = nullptr);

}  // namespace loom::train
