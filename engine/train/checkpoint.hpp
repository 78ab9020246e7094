// Checkpoints: <dir>/step_<N>/ holds one file per rank (parameters + optimizer
// state, checksummed), the resolved manifest and a meta file. A checkpoint is
// written into a temporary directory, fsynced, and renamed into place, so a
// crash never leaves a half-written step_<N>: what exists is complete.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace loom::train {

class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct RankState {
  std::vector<float> params;         // the rank's flat parameter buffer
  std::vector<char> optimizer;       // the optimizer strategy's state blob
};

struct CheckpointMeta {
  int64_t step = 0;                  // steps completed
  int world = 1, tp = 1, pp = 1, dp = 1;
  std::string strategy;              // optimizer.strategy that wrote it
};

// Path of step N's directory.
std::string checkpoint_path(const std::string& dir, int64_t step);
// The highest complete step in dir, or nullopt when there is none.
std::optional<int64_t> latest_checkpoint(const std::string& dir);

// Per-rank file, written into the temporary directory `tmp` (fsynced).
void write_rank_file(const std::string& tmp, int rank, int64_t step, const RankState& state);
// Rank 0, after every rank wrote its file: meta + manifest, fsync, atomic rename.
void commit_checkpoint(const std::string& dir, const std::string& tmp, const CheckpointMeta& meta,
                       const std::string& manifest_toml);
// The temporary directory for step N (created by rank 0 before the others write).
std::string temp_checkpoint_path(const std::string& dir, int64_t step);
void prepare_temp_dir(const std::string& tmp);

CheckpointMeta read_meta(const std::string& step_dir);
// Reads and verifies one rank's file (magic, version, sizes, checksum).
RankState read_rank_file(const std::string& step_dir, int rank, int64_t expect_numel);

}  // namespace loom::train
