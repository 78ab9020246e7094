#include "engine/train/checkpoint.hpp"
#include "engine/train/batch_ramp.hpp"
#include "engine/manifest/batches.hpp"
#include "engine/manifest/schema.hpp"

#include "engine/files/read.hpp"
#include "engine/files/temporaries.hpp"

#include "engine/model/param_plan.hpp"

#include "engine/model/param_init.hpp"
#include "engine/topology/layer_split.hpp"
#include "engine/topology/rank_groups.hpp"
#include "engine/train/init_weights.hpp"
#include "engine/train/optimizer_binding.hpp"

#include <boost/filesystem.hpp>
#include <glog/logging.h>
#include <toml++/toml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <fstream>
#include <iomanip>
#include <set>
#include <sstream>
#include <thread>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>
#include <utility>

namespace loom::train {
namespace {

namespace fs = boost::filesystem;
constexpr char kMagic[8] = {'L', 'O', 'O', 'M', 'C', 'K', 'P', 'T'};
constexpr uint32_t kVersion = 1;

struct Header {
  char magic[8];
  uint32_t version;
  uint32_t rank;
  int64_t step;
  uint64_t numel;
  uint64_t optimizer_bytes;
  uint64_t checksum;  // FNV-1a over the payload
};

std::string rank_file(const std::string& dir, int rank) {
  char name[32];
  std::snprintf(name, sizeof(name), "rank_%05d.bin", rank);
  return (fs::path(dir) / name).string();
}

// A checkpoint's files are read only when they are regular files: a FIFO would block
// the read where no signal is looked at, a directory reads as an empty file.
void require_regular_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || S_ISREG(st.st_mode)) return;  // a missing file: the caller's message
  throw CheckpointError(path + " is not a regular file (" + files::not_regular_kind(st.st_mode) +
                        "): the checkpoint is damaged");
}

void fsync_path(const std::string& path, bool directory) {
  int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) throw CheckpointError("cannot open " + path + " to sync it: " + std::strerror(errno));
  int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw CheckpointError("fsync of " + path + " failed: " + std::strerror(errno));
}

// `cancel` (optional): checked between pieces of 64 MiB, so that a large file written
// beside training stops soon when the run fails (the file is then left unfinished in
// the temporary directory, which nothing commits).
void write_all(const std::string& path, const std::vector<std::pair<const void*, size_t>>& parts,
               const std::atomic<bool>* cancel = nullptr) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) throw CheckpointError("cannot create " + path + ": " + std::strerror(errno));
  constexpr size_t kPiece = size_t{64} << 20;
  bool ok = true, cancelled = false;
  for (const auto& [p, n] : parts)
    for (size_t at = 0; ok && !cancelled && at < n; at += kPiece) {
      const size_t len = std::min(kPiece, n - at);
      ok = std::fwrite(static_cast<const char*>(p) + at, 1, len, f) == len;
      cancelled = cancel && cancel->load(std::memory_order_relaxed);
    }
  if (cancelled) {
    std::fclose(f);
    throw CheckpointError("writing " + path + " stopped: the run ended first");
  }
  ok = (std::fflush(f) == 0) && ok;
  ok = (::fsync(::fileno(f)) == 0) && ok;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) throw CheckpointError("writing " + path + " failed: " + std::strerror(errno) + " (disk full?)");
}

}  // namespace

std::string checkpoint_path(const std::string& dir, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "step_%08lld", static_cast<long long>(step));
  return (fs::path(dir) / name).string();
}

namespace {
// The step number of a "step_N" name (0 to 2^63 - 1; any spelling of the number), or
// nullopt.
std::optional<int64_t> step_number(const std::string& name) {
  if (name.rfind("step_", 0) != 0) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long long step = std::strtoll(name.c_str() + 5, &end, 10);
  if (end == name.c_str() + 5 || *end != '\0' || errno == ERANGE || step < 0) return std::nullopt;
  return step;
}
// Whether `name` is the one a save gives `step` (step_00000200, not step_200).
bool saved_name(const std::string& name, int64_t step) {
  return fs::path(checkpoint_path(".", step)).filename().string() == name;
}

// Unique per run and the same in every process of it: under mpirun/srun each rank is
// its own process and writes into the directory rank 0 prepared, so the job's id
// stands in for the process id (and, not a process id, is never taken for a dead one).
std::string run_id() {
  std::string run_id = std::to_string(::getpid());
  if (const char* ns = std::getenv("PMIX_NAMESPACE"); ns && *ns) {
    run_id = ns;
  } else if (const char* job = std::getenv("SLURM_JOB_ID"); job && *job) {
    const char* step_id = std::getenv("SLURM_STEP_ID");
    run_id = std::string(job) + "." + (step_id ? step_id : "0");
  }
  for (char& c : run_id)
    if (c == '/') c = '_';
  return run_id;
}
}  // namespace

std::string temp_checkpoint_path(const std::string& dir, int64_t step) {
  return (fs::path(dir) / (".tmp-" + fs::path(checkpoint_path(dir, step)).filename().string() + "-" + run_id()))
      .string();
}

std::vector<std::string> remove_unfinished_saves_of_this_run(const std::string& dir) {
  const std::string suffix = "-" + run_id();
  std::vector<std::string> failed;
  boost::system::error_code ec;
  std::vector<fs::path> mine;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(".tmp-step_", 0) == 0 && name.size() > suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
      mine.push_back(e.path());
  }
  for (const fs::path& p : mine) {
    boost::system::error_code rm;
    fs::remove_all(p, rm);
    if (rm) failed.push_back(p.string() + " (" + rm.message() + ")");
  }
  return failed;
}

void prepare_temp_dir(const std::string& tmp) {
  boost::system::error_code ec;
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) throw CheckpointError("cannot create checkpoint directory " + tmp + ": " + ec.message());
}

std::vector<int64_t> complete_checkpoints(const std::string& dir, std::vector<std::string>* skipped) {
  // skipped: "<path> (<why>)" for each step_* directory that is not a checkpoint.
  boost::system::error_code ec;
  std::vector<int64_t> steps;
  if (!fs::is_directory(dir, ec)) return steps;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step_", 0) != 0 || !fs::is_directory(e.path())) continue;
    // A name that is no step number (or one past int64), or a directory without the
    // meta.toml a save writes last before its rename: not a checkpoint of this engine.
    const std::optional<int64_t> number = step_number(name);
    if (!number) {
      if (skipped) skipped->push_back(e.path().string() + " (its name is not step_ and a step number of 0 to 2^63-1)");
      continue;
    }
    const int64_t step = *number;
    // Read back under the name a save gives step N (step_00000200), never another
    // spelling of the number (step_200 would be looked for as step_00000200).
    if (!saved_name(name, step)) {
      if (skipped)
        skipped->push_back(e.path().string() + " (not the name a save gives step " + std::to_string(step) + ": " +
                           fs::path(checkpoint_path(dir, step)).filename().string() + ")");
      continue;
    }
    if (!fs::is_regular_file(e.path() / "meta.toml", ec)) {
      if (skipped) skipped->push_back(e.path().string() + " (no meta.toml: a save that did not finish)");
      continue;
    }
    steps.push_back(step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::optional<int64_t> latest_checkpoint(const std::string& dir, std::vector<std::string>* skipped) {
  const std::vector<int64_t> steps = complete_checkpoints(dir, skipped);
  if (steps.empty()) return std::nullopt;
  return steps.back();
}

CheckpointPruner::CheckpointPruner(std::string dir, int64_t keep_last) : dir_(std::move(dir)), keep_last_(keep_last) {}

CheckpointPruner::~CheckpointPruner() { finish(); }

std::vector<std::string> CheckpointPruner::finish() {
  if (removing_.joinable()) removing_.join();
  return std::exchange(not_removed_, {});
}

std::vector<std::string> CheckpointPruner::prune(int64_t saved_step, std::vector<std::string>* failed) {
  std::vector<std::string> pruned;
  if (keep_last_ <= 0) return pruned;
  for (std::string& f : finish())  // the last pruning's files gone first
    if (failed) failed->push_back(std::move(f));
  std::vector<int64_t> older;
  for (const int64_t step : complete_checkpoints(dir_, nullptr))
    if (step < saved_step) older.push_back(step);
  const size_t keep_older = static_cast<size_t>(std::min<int64_t>(keep_last_ - 1, static_cast<int64_t>(older.size())));
  std::vector<std::string> aside;
  for (size_t i = 0; i + keep_older < older.size(); ++i) {
    // Out of its name at once, so a stop while its files go never leaves a step_N that
    // looks whole; clear_unfinished_saves removes what a stopped run left.
    const std::string path = checkpoint_path(dir_, older[i]);
    const std::string moved = (fs::path(dir_) / (".removing-" + fs::path(path).filename().string() + "-" +
                                                 std::to_string(::getpid())))
                                  .string();
    boost::system::error_code ec;
    fs::rename(path, moved, ec);
    if (ec) {
      if (failed) failed->push_back(path + " (" + ec.message() + ")");
      continue;
    }
    aside.push_back(moved);
    pruned.push_back(path);
  }
  // The files go on a thread of their own: deleting a large checkpoint on a slow file
  // system would hold rank 0 while the other ranks wait in the next step's collectives.
  if (!aside.empty())
    removing_ = std::thread([this, aside = std::move(aside)] {
      for (const std::string& p : aside) {
        boost::system::error_code ec;
        fs::remove_all(p, ec);
        if (ec) not_removed_.push_back(p + " (" + ec.message() + ")");
      }
    });
  return pruned;
}

std::string named_checkpoint(const std::string& path, std::vector<std::string>* skipped) {
  boost::system::error_code ec;
  if (fs::exists(fs::path(path) / "meta.toml", ec)) return path;
  const std::optional<int64_t> step = latest_checkpoint(path, skipped);
  return step ? checkpoint_path(path, *step) : "";
}

CheckpointDirLock::CheckpointDirLock(const std::string& dir) {
  const std::string path = (fs::path(dir) / ".lock").string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw CheckpointError("checkpoint.dir " + dir + ": cannot open " + path + " (" + std::strerror(errno) + ")");
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    char holder[32] = {};
    const ssize_t n = ::pread(fd_, holder, sizeof(holder) - 1, 0);
    ::close(fd_);
    fd_ = -1;
    std::string who = n > 0 ? std::string(holder, static_cast<size_t>(n)) : std::string();
    who.erase(std::remove(who.begin(), who.end(), '\n'), who.end());
    throw CheckpointError("checkpoint.dir " + dir + " is in use by another run" +
                          (who.empty() ? std::string() : " (process " + who + ")") +
                          "; two runs saving into one directory would interleave their checkpoints: wait for it, "
                          "or give this run another checkpoint.dir");
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) < 0) {
    // The lock holds without the note of who holds it.
  }
}

CheckpointDirLock::~CheckpointDirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

namespace {
void clear_unfinished_saves(const std::string& dir, std::vector<std::string>& warnings);
void probe_writable(const std::string& dir);
}  // namespace

std::vector<std::string> prepare_checkpoint_dir(const std::string& dir, std::optional<CheckpointDirLock>* lock) {
  std::vector<std::string> warnings;
  boost::system::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    throw CheckpointError("checkpoint.dir " + dir + " exists and is not a directory; name a directory for the "
                          "checkpoints");
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    throw CheckpointError("checkpoint.dir " + dir + " cannot be created" + (ec ? ": " + ec.message() : std::string()) +
                          "; checkpoints would fail only after training");
  if (lock != nullptr) {
    lock->emplace(dir);  // before touching what another run may be writing
    clear_unfinished_saves(dir, warnings);
  }
  // A step's name taken by something a save cannot replace whole (a file, a dangling or
  // looping link) failed that save only after training to it, or replaced a file.
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const std::optional<int64_t> number = step_number(name);
    if (!number || !saved_name(name, *number)) continue;
    const int64_t step = *number;
    boost::system::error_code st;
    if (!fs::is_directory(e.path(), st))
      throw CheckpointError("checkpoint.dir holds " + e.path().string() + ", which is not a directory (" +
                            (fs::is_symlink(fs::symlink_status(e.path(), st)) ? "a link to none"
                             : st                                              ? st.message()
                                                                               : "a file") +
                            "): a save of step " + std::to_string(step) + " would fail or replace it; move it away");
  }
  probe_writable(dir);
  return warnings;
}

namespace {

void clear_unfinished_saves(const std::string& dir, std::vector<std::string>& warnings) {
  boost::system::error_code ec;
  // Temporary directories of saves that never finished (a crash, a full disk) go first:
  // on a full disk they are what the probe below would fail for.
  // They are .tmp-step_N-PID with a dead PID. A job id in place of the PID
  // (mpirun, srun) cannot be checked and is left alone.
  // Likewise step_N.old-PID, a step being saved again moved aside: put back when the
  // save stopped before its replacement took the name, else removed.
  std::vector<fs::path> entries;
  for (const auto& e : fs::directory_iterator(dir, ec)) entries.push_back(e.path());
  for (const fs::path& path : entries) {
    const std::string name = path.filename().string();
    // A pruned step (checkpoint.keep_last) whose removal did not finish: only the
    // holder of this directory's lock prunes, and that is this process now.
    if (name.rfind(".removing-step_", 0) == 0) {
      boost::system::error_code rm;
      fs::remove_all(path, rm);
      if (rm)
        warnings.push_back("checkpoint.dir: could not remove " + path.string() + " (" + rm.message() +
                           "), a checkpoint checkpoint.keep_last pruned; remove it by hand");
      else
        LOG(INFO) << "checkpoint.dir: removed " << path.string() << ", a pruned checkpoint a stopped run left";
      continue;
    }
    const bool unfinished = name.rfind(".tmp-step_", 0) == 0;
    const size_t old = name.rfind(".old-");
    if (!unfinished && (name.rfind("step_", 0) != 0 || old == std::string::npos)) continue;
    const size_t dash = name.rfind('-');
    char* end = nullptr;
    const long pid = std::strtol(name.c_str() + dash + 1, &end, 10);
    if (dash == std::string::npos || end == name.c_str() + dash + 1 || *end != '\0' || pid <= 0 || pid == ::getpid())
      continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // still running, or not ours to tell
    boost::system::error_code rm;
    const fs::path replaced = path.parent_path() / name.substr(0, unfinished ? 0 : old);
    if (!unfinished && !fs::exists(replaced, rm)) {
      fs::rename(path, replaced, rm);
      if (!rm)
        LOG(INFO) << "checkpoint.dir: restored " << replaced.string() << " from " << name
                  << ", moved aside by process " << pid
                  << " to be saved again, which stopped before the new save took its place";
      continue;
    }
    fs::remove_all(path, rm);
    LOG(INFO) << "checkpoint.dir: removed " << path.string()
              << (unfinished ? ", an unfinished save" : ", a step saved again since") << " of process " << pid
              << ", which no longer runs";
  }
}

void probe_writable(const std::string& dir) {
  boost::system::error_code ec;
  const std::string probe = (fs::path(dir) / (".probe-" + std::to_string(::getpid()))).string();
  {
    std::ofstream f(probe);
    if (!(f << "loom\n") || !f.flush()) {
      fs::remove(probe, ec);
      throw CheckpointError("checkpoint.dir " + dir + " is not writable (" + std::strerror(errno) +
                            "); checkpoints would fail only after training");
    }
  }
  fs::remove(probe, ec);
}

}  // namespace

namespace {
std::string layout_file(const std::string& dir, int rank) {
  char name[32];
  std::snprintf(name, sizeof(name), "rank_%05d.params", rank);
  return (fs::path(dir) / name).string();
}
std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}
}  // namespace

ParamLayoutList param_layout_of(const model::Model& model) {
  ParamLayoutList out;
  for (const model::ParamEntry& e : model.param_entries()) out.push_back({e.name, e.local_shape});
  return out;
}

void write_param_layout(const std::string& tmp, int rank, const ParamLayoutList& params) {
  std::ostringstream os;
  for (const ParamLayoutEntry& p : params) {  // a tab after the name: names may hold spaces
    os << p.name << '\t';
    for (size_t i = 0; i < p.shape.size(); ++i) os << (i ? " " : "") << p.shape[i];
    os << '\n';
  }
  const std::string text = os.str();
  write_all(layout_file(tmp, rank), {{text.data(), text.size()}});
}

namespace {
// A file older checkpoints lack is missing from `step_dir`: fine for a checkpoint of
// that age, corrupt for one that records its rank files' checksums (every checkpoint
// since writes the manifest and the parameter lists too).
void require_older_format(const std::string& step_dir, const std::string& missing) {
  if (!read_meta(step_dir).rank_checksums.empty())
    throw CheckpointError("checkpoint " + step_dir + " is incomplete: " + missing +
                          " is missing (this checkpoint's format writes it); the checks it serves cannot be made");
}
}  // namespace

void check_param_layout(const std::string& step_dir, int file_rank, const ParamLayoutList& params) {
  const std::string path = layout_file(step_dir, file_rank);
  boost::system::error_code ec;
  if (!fs::exists(path, ec)) {
    require_older_format(step_dir, path);  // written before checkpoints recorded it
    return;
  }
  require_regular_file(path);
  std::ifstream in(path);
  if (!in) throw CheckpointError("cannot read " + path + ": " + std::strerror(errno));
  ParamLayoutList saved;
  std::string line;
  int64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    // A name is printable text (a garbage file would otherwise be echoed as raw bytes).
    if (std::any_of(line.begin(), line.end(), [](unsigned char c) { return c != '\t' && (c < 0x20 || c > 0x7e); }))
      throw CheckpointError(path + ": line " + std::to_string(line_no) +
                            " is not a parameter line (name, then its shape); the checkpoint is corrupt");
    std::istringstream ls(line);
    ParamLayoutEntry e;
    if (!std::getline(ls, e.name, '\t') || e.name.empty()) continue;
    for (int64_t d; ls >> d;) e.shape.push_back(d);
    saved.push_back(std::move(e));
  }
  const std::string why = "; resume with the model it was written by (its manifest: " +
                          (fs::path(step_dir) / "manifest.toml").string() + ")";
  for (size_t i = 0; i < std::min(saved.size(), params.size()); ++i) {
    if (saved[i].name != params[i].name)
      throw CheckpointError(path + ": parameter " + std::to_string(i) + " is " + saved[i].name +
                            " in the checkpoint but " + params[i].name + " in this model" + why);
    if (saved[i].shape != params[i].shape)
      throw CheckpointError(path + ": parameter " + params[i].name + " has shape " + shape_text(saved[i].shape) +
                            " in the checkpoint but " + shape_text(params[i].shape) + " in this model" + why);
  }
  if (saved.size() != params.size())
    throw CheckpointError(path + ": the checkpoint holds " + std::to_string(saved.size()) +
                          " parameters on this rank, this model " + std::to_string(params.size()) + why);
}

uint64_t write_rank_file(const std::string& tmp, int rank, int64_t step, const RankState& state,
                         const std::atomic<bool>* cancel) {
  Header h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.version = kVersion;
  h.rank = static_cast<uint32_t>(rank);
  h.step = step;
  h.numel = state.params.size() / state.elem_size;
  h.optimizer_bytes = state.optimizer.size();
  uint64_t c = model::fnv1a(state.params.data(), state.params.size());
  h.checksum = model::fnv1a(state.optimizer.data(), state.optimizer.size(), c);
  write_all(rank_file(tmp, rank), {{&h, sizeof(h)},
                                   {state.params.data(), state.params.size()},
                                   {state.optimizer.data(), state.optimizer.size()}},
            cancel);
  return h.checksum;
}

namespace {

constexpr char kStateMagic[8] = {'L', 'O', 'O', 'M', 'S', 'T', 'A', 'T'};
constexpr uint32_t kStateVersion = 1;

struct StateHeader {
  char magic[8];
  uint32_t version;
  uint32_t rank;
  int64_t step;
  uint64_t bytes;     // of the body after the header
  uint64_t checksum;  // FNV-1a over the body
};

std::string state_file(const std::string& dir, int rank) {
  char name[32];
  std::snprintf(name, sizeof(name), "rank_%05d.state", rank);
  return (fs::path(dir) / name).string();
}

// The body: the number of arrays, then each as (name bytes u32, name, elements u64,
// fp32 values), in name order.
std::vector<char> encode_states(const model::StateValues& states) {
  std::vector<char> body;
  auto put = [&](const void* p, size_t n) {
    body.insert(body.end(), static_cast<const char*>(p), static_cast<const char*>(p) + n);
  };
  const uint64_t arrays = states.size();
  put(&arrays, sizeof arrays);
  for (const auto& [name, values] : states) {
    const uint32_t len = static_cast<uint32_t>(name.size());
    const uint64_t count = values.size();
    put(&len, sizeof len);
    put(name.data(), len);
    put(&count, sizeof count);
    put(values.data(), values.size() * sizeof(float));
  }
  return body;
}

// Reads a body back into `out`, refusing sizes past its end, names already there and
// bytes left over.
void decode_states(const std::vector<char>& body, const std::string& path, model::StateValues& out) {
  size_t at = 0;
  auto take = [&](void* p, uint64_t n) {
    if (n > body.size() - at) throw CheckpointError(path + ": truncated or corrupt layer-state file");
    std::memcpy(p, body.data() + at, static_cast<size_t>(n));
    at += static_cast<size_t>(n);
  };
  uint64_t arrays = 0;
  take(&arrays, sizeof arrays);
  for (uint64_t i = 0; i < arrays; ++i) {
    uint32_t len = 0;
    take(&len, sizeof len);
    std::string name(std::min<size_t>(len, body.size() - at), '\0');
    take(name.data(), len);
    if (name.empty()) throw CheckpointError(path + ": a layer state without a name; the file is corrupt");
    uint64_t count = 0;
    take(&count, sizeof count);
    if (count > (body.size() - at) / sizeof(float))
      throw CheckpointError(path + ": truncated or corrupt layer-state file");
    std::vector<float> values(static_cast<size_t>(count));
    take(values.data(), count * sizeof(float));
    if (!out.emplace(name, std::move(values)).second)
      throw CheckpointError(path + ": layer state " + name + " is saved twice in the checkpoint; it is inconsistent");
  }
  if (at != body.size()) throw CheckpointError(path + ": bytes after the layer states; the file is corrupt");
}

// A TOML value as the file writes it, for messages.
std::string toml_text(const toml::node& n) {
  std::ostringstream os;
  n.visit([&](const auto& v) { os << v; });
  return os.str();
}

std::string hex16(uint64_t c) {
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(c));
  return hex;
}

}  // namespace

uint64_t write_state_file(const std::string& tmp, int rank, int64_t step, const model::StateValues& states) {
  const std::vector<char> body = encode_states(states);
  StateHeader h{};
  std::memcpy(h.magic, kStateMagic, sizeof(kStateMagic));
  h.version = kStateVersion;
  h.rank = static_cast<uint32_t>(rank);
  h.step = step;
  h.bytes = body.size();
  h.checksum = model::fnv1a(body.data(), body.size());
  write_all(state_file(tmp, rank), {{&h, sizeof(h)}, {body.data(), body.size()}});
  return h.checksum;
}

model::StateValues read_layer_states(const std::string& step_dir) {
  const CheckpointMeta meta = read_meta(step_dir);
  model::StateValues out;
  for (size_t i = 0; i < meta.state_ranks.size(); ++i) {
    const std::string path = state_file(step_dir, meta.state_ranks[i]);
    require_regular_file(path);
    std::ifstream in(path, std::ios::binary);
    if (!in)
      throw CheckpointError("checkpoint " + step_dir + " has no layer-state file " + path +
                            ", which its meta.toml lists");
    StateHeader h{};
    in.read(reinterpret_cast<char*>(&h), sizeof(h));
    if (!in || std::memcmp(h.magic, kStateMagic, sizeof(kStateMagic)) != 0)
      throw CheckpointError(path + ": not a loom layer-state file (bad header)");
    if (h.version != kStateVersion)
      throw CheckpointError(path + ": layer-state format " + std::to_string(h.version) +
                            " is not supported (expected " + std::to_string(kStateVersion) + ")");
    boost::system::error_code ec;
    const uint64_t file_bytes = fs::file_size(path, ec);
    if (ec || file_bytes != sizeof(h) + h.bytes)
      throw CheckpointError(path + ": the header's size does not match the file's; it is truncated or corrupt");
    if (h.step != meta.step || h.rank != static_cast<uint32_t>(meta.state_ranks[i]) ||
        h.checksum != meta.state_checksums[i])
      throw CheckpointError(path + ": not the layer-state file this checkpoint saved (its step, rank or checksum is not "
                            "the one meta.toml records); the checkpoint is inconsistent");
    std::vector<char> body(static_cast<size_t>(h.bytes));
    in.read(body.data(), static_cast<std::streamsize>(body.size()));
    if (!in || model::fnv1a(body.data(), body.size()) != h.checksum)
      throw CheckpointError(path + ": checksum mismatch; the layer-state file is corrupt");
    decode_states(body, path, out);
  }
  return out;
}

namespace {

std::string meta_text(const CheckpointMeta& meta) {
  toml::table t{{"step", meta.step}, {"world", meta.world}, {"tp", meta.tp},
                {"pp", meta.pp},     {"dp", meta.dp},       {"strategy", meta.strategy}, {"format", 1}};
  std::ostringstream os;
  if (meta.bucket_size >= 0) t.insert("bucket_size", meta.bucket_size);
  t.insert("param_dtype", meta.param_dtype);
  t.insert("ep", meta.ep);
  t.insert("order", meta.order);
  t.insert("etp", meta.expert_tp());
  t.insert("cp", meta.cp);
  if (meta.vocab > 0) t.insert("vocab", meta.vocab);
  if (meta.consumed_samples >= 0) t.insert("consumed_samples", meta.consumed_samples);
  if (meta.evaluation_pending) t.insert("evaluation_pending", true);
  toml::array sums;  // ties the rank files to this save: one copied in from another run is refused
  for (const uint64_t c : meta.rank_checksums) sums.push_back(hex16(c));
  if (!sums.empty()) t.insert("rank_checksums", std::move(sums));
  if (!meta.state_ranks.empty()) {
    toml::array ranks, state_sums;
    for (const int r : meta.state_ranks) ranks.push_back(r);
    for (const uint64_t c : meta.state_checksums) state_sums.push_back(hex16(c));
    t.insert("state_ranks", std::move(ranks));
    t.insert("state_checksums", std::move(state_sums));
  }
  os << t << "\n";
  return os.str();
}

}  // namespace

void commit_checkpoint(const std::string& dir, const std::string& tmp, const CheckpointMeta& meta,
                       const std::string& manifest_toml) {
  const std::string text = meta_text(meta);
  write_all((fs::path(tmp) / "meta.toml").string(), {{text.data(), text.size()}});
  write_all((fs::path(tmp) / "manifest.toml").string(), {{manifest_toml.data(), manifest_toml.size()}});
  fsync_path(tmp, true);
  const std::string final_dir = checkpoint_path(dir, meta.step);
  boost::system::error_code ec;
  std::string old;
  if (fs::exists(final_dir)) {  // re-saving a step: move the old one aside first
    old = final_dir + ".old-" + run_id();
    fs::rename(final_dir, old, ec);
    if (ec) throw CheckpointError("cannot replace " + final_dir + ": " + ec.message());
  }
  fs::rename(tmp, final_dir, ec);
  if (ec) throw CheckpointError("cannot move " + tmp + " to " + final_dir + ": " + ec.message());
  fsync_path(dir, true);
  if (!old.empty()) fs::remove_all(old, ec);
}

void clear_evaluation_pending(const std::string& step_dir) {
  CheckpointMeta meta = read_meta(step_dir);
  if (!meta.evaluation_pending) return;
  meta.evaluation_pending = false;
  const std::string path = (fs::path(step_dir) / "meta.toml").string(), text = meta_text(meta);
  files::Temporary tmp(path + ".tmp");
  write_all(tmp.path(), {{text.data(), text.size()}});
  if (!tmp.commit(path)) throw CheckpointError("cannot rewrite " + path + ": " + std::strerror(errno));
  fsync_path(step_dir, true);
}

CheckpointMeta read_meta(const std::string& step_dir) {
  const std::string path = (fs::path(step_dir) / "meta.toml").string();
  require_regular_file(path);
  CheckpointMeta m;
  try {
    toml::table t = toml::parse_file(path);
    auto need = [&](const char* key) -> int64_t {
      auto v = t[key].value<int64_t>();
      if (!v) throw CheckpointError("checkpoint " + step_dir + " is corrupt: meta.toml has no integer '" + key + "'");
      return *v;
    };
    // meta.toml's own format (1 since it has one; absent before): a later engine's
    // checkpoint may mean other things by the same keys.
    const int64_t format = t["format"].value_or(int64_t{1});
    if (format != 1)
      throw CheckpointError("checkpoint " + step_dir + ": meta.toml format " + std::to_string(format) +
                            ", this engine reads format 1 (was it written by a newer loom?)");
    // A number of ranks, read whole before it is narrowed (2^32 + 2 read as 2 passed).
    auto ranks = [&](const char* key, std::optional<int64_t> dflt) -> int {
      const int64_t v = dflt ? t[key].value_or(*dflt) : need(key);
      if (v < 1 || v > topology::kMaxWorld)
        throw CheckpointError("checkpoint " + step_dir + " is corrupt: meta.toml has " + key + " = " +
                              std::to_string(v) + " (a number of ranks, 1 to " + std::to_string(topology::kMaxWorld) +
                              ")");
      return static_cast<int>(v);
    };
    m.step = need("step");
    // A step directory holds the step it is named after: a copy of step 4 as
    // step_00000099 would be resumed from as the newest, and pruning would go by it.
    std::string name = step_dir;
    while (name.size() > 1 && name.back() == '/') name.pop_back();
    name = fs::path(name).filename().string();
    if (const std::optional<int64_t> named = step_number(name); named && saved_name(name, *named) && *named != m.step)
      throw CheckpointError("checkpoint " + step_dir + " is named after step " + std::to_string(*named) +
                            " but its meta.toml says step " + std::to_string(m.step) +
                            " (a copy under another step's name?); give it the name of its step, " +
                            fs::path(checkpoint_path(".", m.step)).filename().string() + ", or remove it");
    m.world = ranks("world", std::nullopt);
    m.tp = ranks("tp", std::nullopt);
    m.pp = ranks("pp", std::nullopt);
    m.dp = ranks("dp", std::nullopt);
    m.strategy = t["strategy"].value_or(std::string());
    m.bucket_size = t["bucket_size"].value_or(int64_t{-1});
    m.param_dtype = t["param_dtype"].value_or(std::string("fp32"));
    m.ep = ranks("ep", 1);
    m.order = t["order"].value_or(std::string("tp-cp-ep-dp-pp"));
    const int64_t etp = t["etp"].value_or(int64_t{0});  // 0: a checkpoint from before etp (= tp)
    m.etp = etp == 0 ? 0 : ranks("etp", 1);
    m.cp = ranks("cp", 1);
    m.vocab = t["vocab"].value_or(int64_t{0});
    m.consumed_samples = t["consumed_samples"].value_or(int64_t{-1});
    m.evaluation_pending = t["evaluation_pending"].value_or(false);
    // An array's entries, each checked by `read` (absent: none; anything but an array: corrupt).
    auto entries = [&](const char* key, const auto& read) {
      const toml::node_view<toml::node> v = t[key];
      if (!v) return;
      const toml::array* a = v.as_array();
      if (a == nullptr) throw CheckpointError("checkpoint " + step_dir + " is corrupt: meta.toml's " + key + " is not an array");
      for (const toml::node& n : *a) read(n);
    };
    auto checksums = [&](const char* key) {
      std::vector<uint64_t> out;
      entries(key, [&](const toml::node& n) {
        const std::optional<std::string> hex = n.value_exact<std::string>();
        if (!hex || hex->size() != 16 ||
            !std::all_of(hex->begin(), hex->end(), [](unsigned char c) { return std::isxdigit(c) != 0; }))
          throw CheckpointError("checkpoint " + step_dir + " is corrupt: meta.toml's " + key + " has " +
                                toml_text(n) + " (16 hexadecimal digits each)");
        out.push_back(std::strtoull(hex->c_str(), nullptr, 16));
      });
      return out;
    };
    m.rank_checksums = checksums("rank_checksums");
    m.state_checksums = checksums("state_checksums");
    entries("state_ranks", [&](const toml::node& n) {
      const std::optional<int64_t> r = n.value_exact<int64_t>();
      if (!r || *r < 0 || *r >= m.world)
        throw CheckpointError("checkpoint " + step_dir + " is corrupt: meta.toml's state_ranks has " + toml_text(n) +
                              " (a rank of its world of " + std::to_string(m.world) + ")");
      m.state_ranks.push_back(static_cast<int>(*r));
    });
    if (m.state_ranks.size() != m.state_checksums.size())
      throw CheckpointError("checkpoint " + step_dir + " is corrupt: meta.toml's state_ranks and state_checksums " +
                            "differ in length");
    if (m.step < 0 || m.etp < 0 || m.vocab < 0 || m.consumed_samples < -1)
      throw CheckpointError("checkpoint " + step_dir +
                            " is corrupt: meta.toml has a negative step, etp, vocab or consumed_samples");
    // Each step reads a global batch of 1 to 2^30 samples (the schema's bounds).
    constexpr int64_t kMostSamplesAStep = int64_t{1} << 30;
    if (m.consumed_samples >= 0 &&
        (m.consumed_samples < m.step || m.consumed_samples / kMostSamplesAStep > m.step))
      throw CheckpointError("checkpoint " + step_dir + " is corrupt: meta.toml has consumed_samples = " +
                            std::to_string(m.consumed_samples) + " after " + std::to_string(m.step) +
                            " steps (each step reads 1 to 2^30 samples)");
    if (m.strategy.empty() && !m.rank_checksums.empty())  // this format writes both
      throw CheckpointError("checkpoint " + step_dir + " is corrupt: meta.toml has no strategy (the optimizer plugin "
                            "that wrote the state, e.g. \"ddp\")");
  } catch (const toml::parse_error& e) {
    throw CheckpointError("checkpoint " + step_dir + " is corrupt: " + path + ": " + std::string(e.description()));
  }
  return m;
}

namespace {

// The checkpoint's manifest.toml (the resolved manifest of the run that saved it) and
// this run's, parsed; throws toml::parse_error for either.
struct TwoManifests {
  toml::table saved, now;
};
TwoManifests parse_manifests(const std::string& saved_path, const std::string& manifest_toml) {
  return {toml::parse_file(saved_path), toml::parse(manifest_toml)};
}
// The checkpoint's manifest.toml for what a resume only remarks on: nullopt when it has
// none (an older format) or one that does not parse (refused, naming the file, where
// the model is compared).
std::optional<toml::table> manifest_to_compare(const std::string& step_dir) {
  const std::string path = (fs::path(step_dir) / "manifest.toml").string();
  boost::system::error_code ec;
  if (!fs::is_regular_file(path, ec)) return std::nullopt;
  try {
    return toml::parse_file(path);
  } catch (const toml::parse_error&) {
    return std::nullopt;
  }
}

// A key of a saved manifest, or the schema's default when the checkpoint predates the
// key (it had the default's meaning then); a value of another type counts as missing.
template <typename T>
T saved_value(const toml::table& saved, const char* key) {
  if (std::optional<T> v = saved.at_path(key).value<T>()) return *v;
  const toml::table d = manifest::schema::default_of(key);
  if (std::optional<T> v = d["v"].value<T>()) return *v;
  throw std::logic_error(std::string("no schema default for ") + key);
}

// A rate or bound as a person writes it (0.0002, not 0.00020000000000000001).
std::string short_float(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

// A key's value as TOML text, "" where the table has none.
std::string value_text(const toml::table& t, const std::string& key) {
  std::ostringstream os;
  if (auto n = t.at_path(key)) os << n;
  return os.str();
}

}  // namespace

std::vector<std::string> data_order_changes(const std::string& step_dir, const std::string& manifest_toml) {
  const std::optional<toml::table> saved = manifest_to_compare(step_dir);
  if (!saved) return {};
  TwoManifests m{*saved, {}};
  try {
    m.now = toml::parse(manifest_toml);
  } catch (const toml::parse_error&) {
    return {};
  }
  std::set<std::string> keys = {"run.seed"};
  for (const toml::table* t : {m.saved.at_path("data").as_table(), m.now.at_path("data").as_table()})
    if (t != nullptr)
      for (auto&& [k, v] : *t) keys.insert("data." + std::string(k.str()));
  std::vector<std::string> out;
  for (const std::string& key : keys) {
    const std::string was = value_text(m.saved, key), now = value_text(m.now, key);
    if (was != now)
      out.push_back(key + ": " + (was.empty() ? "(unset)" : was) + " -> " + (now.empty() ? "(unset)" : now));
  }
  return out;
}

std::vector<std::string> schedule_changes(const std::string& step_dir, const manifest::RunConfig& now,
                                          int64_t from_step, uint64_t from_samples) {
  const std::optional<toml::table> saved = manifest_to_compare(step_dir);
  if (!saved) return {};
  // The checkpoint's schedule: this run's config with the saved run's schedule keys (a
  // key a checkpoint from before it was added lacks had its default's meaning).
  manifest::RunConfig was = now;
  manifest::RunConfig::Optimizer& o = was.optimizer;
  const auto i = [&](const char* key) { return saved_value<int64_t>(*saved, key); };
  const auto f = [&](const char* key) { return saved_value<double>(*saved, key); };
  const auto s = [&](const char* key) { return saved_value<std::string>(*saved, key); };
  o.lr = f("optimizer.lr");
  o.min_lr = f("optimizer.min_lr");
  o.warmup_steps = i("optimizer.warmup_steps");
  o.decay_steps = i("optimizer.decay_steps");
  o.decay_style = s("optimizer.decay_style");
  o.wsd_decay_steps = i("optimizer.wsd_decay_steps");
  o.wsd_decay_style = s("optimizer.wsd_decay_style");
  o.warmup_samples = i("optimizer.warmup_samples");
  o.decay_samples = i("optimizer.decay_samples");
  o.wsd_decay_samples = i("optimizer.wsd_decay_samples");
  o.warmup_fraction = f("optimizer.warmup_fraction");
  o.weight_decay = f("optimizer.weight_decay");
  o.weight_decay_incr_style = s("optimizer.weight_decay_incr_style");
  o.start_weight_decay = f("optimizer.start_weight_decay");
  o.end_weight_decay = f("optimizer.end_weight_decay");
  // The checkpoint's batches: a schedule in samples ends at the samples of its run.
  if (const int64_t global = i("batch.global_batch_size"); global > 0) {
    was.batch.global_batch_size = global;
    manifest::RunConfig::read_rampup(*saved, was.batch);
  }
  was.run.steps = i("run.steps");
  was.run.train_samples = i("run.train_samples");
  if (was.run.train_samples > 0) was.run.steps = manifest::steps_for_samples(was.batch, was.run.train_samples);
  const manifest::ScheduleMarks was_marks = manifest::schedule_marks(was), now_marks = manifest::schedule_marks(now);
  auto rate = [&](const manifest::RunConfig& c, const manifest::ScheduleMarks& marks, SchedulePoint at) {
    return learning_rate(c.optimizer, marks, at);
  };
  auto decay = [&](const manifest::RunConfig& c, const manifest::ScheduleMarks& marks, SchedulePoint at) {
    return weight_decay(c.optimizer, marks, at);
  };
  // Said only when a step still to come gets another rate or weight decay (a warmup
  // changed after it ended, or a decay already over, changes nothing ahead): the first
  // ten million steps ahead and the last are compared, each at the samples this run's
  // batches consume through it.
  auto differs_at = [&](SchedulePoint at) {
    return rate(was, was_marks, at) != rate(now, now_marks, at) || decay(was, was_marks, at) != decay(now, now_marks, at);
  };
  const int64_t last = now.run.steps, scanned = std::min<int64_t>(last, from_step + 10'000'000);
  std::optional<SchedulePoint> differs;
  uint64_t samples = from_samples;
  for (int64_t step = from_step + 1; step <= scanned && !differs; ++step) {
    samples += static_cast<uint64_t>(manifest::global_batch_at(now.batch, samples));
    if (differs_at({step, samples})) differs = SchedulePoint{step, samples};
  }
  if (!differs && last > scanned) {
    const SchedulePoint end{last, manifest::samples_before(now.batch, last, from_step, from_samples)};
    if (differs_at(end)) differs = end;
  }
  if (!differs) return {};
  std::ostringstream rates;
  rates << std::setprecision(6) << "step " << differs->step << " gets lr " << rate(now, now_marks, *differs)
        << " and weight decay " << decay(now, now_marks, *differs) << " where the checkpoint's schedule gives "
        << rate(was, was_marks, *differs) << " and " << decay(was, was_marks, *differs);
  std::vector<std::string> out = {rates.str()};
  auto changed = [&](const char* key, const std::string& before, const std::string& after) {
    if (before != after) out.push_back(std::string(key) + ": " + before + " -> " + after);
  };
  const manifest::RunConfig::Optimizer& n = now.optimizer;
  changed("optimizer.lr", short_float(o.lr), short_float(n.lr));
  changed("optimizer.min_lr", short_float(o.min_lr), short_float(n.min_lr));
  changed("optimizer.warmup_steps", std::to_string(o.warmup_steps), std::to_string(n.warmup_steps));
  changed("optimizer.warmup_samples", std::to_string(o.warmup_samples), std::to_string(n.warmup_samples));
  changed("optimizer.warmup_fraction", short_float(o.warmup_fraction), short_float(n.warmup_fraction));
  changed("optimizer.decay_style", o.decay_style, n.decay_style);
  changed("optimizer.wsd_decay_steps", std::to_string(o.wsd_decay_steps), std::to_string(n.wsd_decay_steps));
  changed("optimizer.wsd_decay_samples", std::to_string(o.wsd_decay_samples), std::to_string(n.wsd_decay_samples));
  changed("optimizer.wsd_decay_style", o.wsd_decay_style, n.wsd_decay_style);
  changed("optimizer.weight_decay", short_float(o.weight_decay), short_float(n.weight_decay));
  changed("optimizer.weight_decay_incr_style", o.weight_decay_incr_style, n.weight_decay_incr_style);
  changed("optimizer.start_weight_decay", short_float(o.start_weight_decay), short_float(n.start_weight_decay));
  changed("optimizer.end_weight_decay", short_float(o.end_weight_decay), short_float(n.end_weight_decay));
  if (was_marks.in_samples != now_marks.in_samples)
    out.push_back(std::string("the schedule's unit: ") + was_marks.unit() + " -> " + now_marks.unit() +
                  " (optimizer.*_samples or run.train_samples count it in samples)");
  else if (was_marks.decay_end != now_marks.decay_end)
    out.push_back(std::string("the decay's end (optimizer.decay_") + now_marks.unit() + ", or the run's length when " +
                  "it is 0): " + std::to_string(was_marks.decay_end) + " -> " + std::to_string(now_marks.decay_end) +
                  " " + now_marks.unit() + " (set optimizer.decay_" + now_marks.unit() +
                  " to keep one schedule over runs of other lengths)");
  const bool wd_schedule = o.weight_decay_incr_style != "constant" || n.weight_decay_incr_style != "constant";
  if (wd_schedule && was_marks.in_samples == now_marks.in_samples && was_marks.run_length != now_marks.run_length)
    out.push_back(std::string("the weight decay's end (the run's length): ") + std::to_string(was_marks.run_length) +
                  " -> " + std::to_string(now_marks.run_length) + " " + now_marks.unit());
  return out;
}

void require_same_model(const std::string& step_dir, const std::string& manifest_toml, const RunPlan& plan) {
  const std::string path = (fs::path(step_dir) / "manifest.toml").string();
  boost::system::error_code ec;
  if (!fs::exists(path, ec)) {
    require_older_format(step_dir, path);  // written before checkpoints kept their manifest
    return;
  }
  require_regular_file(path);
  TwoManifests m;
  try {
    m = parse_manifests(path, manifest_toml);
  } catch (const toml::parse_error& e) {
    throw CheckpointError("checkpoint " + step_dir + " is corrupt: " + path + ": " + std::string(e.description()));
  }
  auto refuse = [&](const std::string& key, const std::string& was, const std::string& now) {
    throw CheckpointError(step_dir + " holds a model with " + key + " = " + was + ", this run has " + key + " = " + now +
                          ": resuming would continue another model; set " + key + " as the checkpoint has it");
  };
  // The keys that make another model with the same parameter shapes (the shapes
  // themselves are compared by check_param_layout).
  for (const char* key : {"model.hidden_size", "model.num_heads", "model.ffn_hidden_size", "model.num_layers",
                          "model.vocab_size", "model.vocab_divisor", "model.tie_embeddings", "model.pre",
                          "model.post"}) {
    // 0 in the manifest means "derived" (the data's vocabulary, 4 x hidden): say so.
    auto shown = [&](const std::string& v) {
      if (v.empty()) return std::string("(unset)");
      if (v != "0") return v;
      return std::string(key) == "model.vocab_size" ? std::string("0 (the data's vocabulary)")
             : std::string(key) == "model.ffn_hidden_size" ? std::string("0 (4 x hidden_size)")
                                                             : v;
    };
    const std::string was = value_text(m.saved, key), now = value_text(m.now, key);
    if (was != now) refuse(key, shown(was), shown(now));
  }
  // The blocks, however model.block, model.blocks and model.block_pattern write them.
  if (const std::string was = manifest::schema::block_composition(m.saved),
      now = manifest::schema::block_composition(m.now);
      was != now)
    throw CheckpointError(step_dir + " holds a model whose blocks are " + was + ", this run's are " + now +
                          ": resuming would continue another model; set model.block, model.blocks and "
                          "model.block_pattern as the checkpoint has them");
  // Each layer's options (both manifests are resolved: plugin defaults written out),
  // which can change the function with every shape kept (rope's base, MoE's top_k);
  // training-only ones (dropout, capacity) may change. An option a manifest lacks is
  // the default of the plugin this run's layer of that name has: a checkpoint written
  // before the plugin declared it ran as the default does.
  auto declared_default = [&](const std::string& layer, const std::string& option) -> std::string {
    for (const model::LayerSpec& spec : plan.layers) {
      if (spec.config != layer) continue;
      for (const manifest::OptionDecl& d : plan.registry->get("layer", spec.plugin).options)
        if (d.name == option) return option_default_text(d);
    }
    return "";
  };
  for (const toml::table* t : {m.saved.at_path("model.layer").as_table(), m.now.at_path("model.layer").as_table()}) {
    if (t == nullptr) continue;
    for (auto&& [layer, section] : *t) {
      if (!section.is_table()) continue;
      for (auto&& [option, value] : *section.as_table()) {
        if (training_only_option(std::string(option.str()))) continue;
        const std::string key = "model.layer." + std::string(layer.str()) + "." + std::string(option.str());
        std::string was = value_text(m.saved, key), now = value_text(m.now, key);
        if (was.empty()) was = declared_default(std::string(layer.str()), std::string(option.str()));
        if (now.empty()) now = declared_default(std::string(layer.str()), std::string(option.str()));
        if (was != now) refuse(key, was.empty() ? "(unset)" : was, now.empty() ? "(unset)" : now);
      }
    }
  }
}

void require_same_param_dtype(const std::string& step_dir, const CheckpointMeta& meta, const std::string& param_dtype) {
  if (meta.param_dtype == param_dtype) return;
  throw CheckpointError(step_dir + " holds " + meta.param_dtype + " parameters (device.param_dtype = \"" +
                        meta.param_dtype + "\"), this run has device.param_dtype = \"" + param_dtype +
                        "\": the parameter files and the optimizer state (fp32 master weights only with bf16 "
                        "parameters) differ; resume with device.param_dtype=\"" + meta.param_dtype + "\"");
}

RankState read_rank_file(const std::string& step_dir, int rank, int64_t expect_numel, size_t elem_size) {
  const std::string path = rank_file(step_dir, rank);
  require_regular_file(path);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CheckpointError("checkpoint " + step_dir + " has no file for rank " + std::to_string(rank) + " (" + path + ")");
  Header h{};
  in.read(reinterpret_cast<char*>(&h), sizeof(h));
  if (!in || std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0)
    throw CheckpointError(path + ": not a loom checkpoint file (bad header)");
  if (h.version != kVersion)
    throw CheckpointError(path + ": checkpoint format " + std::to_string(h.version) + " is not supported (expected " +
                          std::to_string(kVersion) + ")");
  if (static_cast<int64_t>(h.numel) != expect_numel)
    throw CheckpointError(path + ": holds " + std::to_string(h.numel) + " parameters but this model has " +
                          std::to_string(expect_numel) + " on rank " + std::to_string(rank) +
                          "; the manifest's model or parallel layout differs from the checkpoint's");
  // The header's sizes against the file's before anything is allocated (a corrupt
  // optimizer_bytes asked for gigabytes), and its step and rank against meta.toml's.
  boost::system::error_code size_ec;
  const uint64_t file_bytes = fs::file_size(path, size_ec);
  const uint64_t payload = file_bytes - std::min<uint64_t>(file_bytes, sizeof(h));
  if (size_ec || h.numel > payload / elem_size || h.optimizer_bytes != payload - h.numel * elem_size)
    throw CheckpointError(path + ": the header's sizes (" + std::to_string(h.numel) + " parameters, " +
                          std::to_string(h.optimizer_bytes) + " optimizer bytes) do not match the file's " +
                          std::to_string(file_bytes) + " bytes; the checkpoint is truncated or corrupt");
  const CheckpointMeta meta = read_meta(step_dir);
  const int64_t meta_step = meta.step;
  if (h.step != meta_step || h.rank != static_cast<uint32_t>(rank))
    throw CheckpointError(path + ": written by rank " + std::to_string(h.rank) + " at step " + std::to_string(h.step) +
                          ", but it is rank " + std::to_string(rank) + "'s file of " + step_dir +
                          ", whose meta.toml says step " + std::to_string(meta_step) +
                          "; the checkpoint is inconsistent (a file copied in, or meta.toml edited)");
  if (!meta.rank_checksums.empty() && meta.rank_checksums.size() != static_cast<size_t>(meta.world))
    throw CheckpointError("checkpoint " + step_dir + " is corrupt: meta.toml's rank_checksums has " +
                          std::to_string(meta.rank_checksums.size()) + " entries for world " + std::to_string(meta.world));
  if (static_cast<size_t>(rank) < meta.rank_checksums.size() && meta.rank_checksums[static_cast<size_t>(rank)] != h.checksum)
    throw CheckpointError(path + ": not the file this checkpoint saved for rank " + std::to_string(rank) +
                          " (its checksum is not the one meta.toml records); the checkpoint is inconsistent (a file "
                          "copied in from another run?)");
  RankState s;
  s.elem_size = elem_size;
  s.params.resize(h.numel * elem_size);
  s.optimizer.resize(h.optimizer_bytes);
  in.read(s.params.data(), static_cast<std::streamsize>(s.params.size()));
  in.read(s.optimizer.data(), h.optimizer_bytes);
  if (!in || in.peek() != std::char_traits<char>::eof())
    throw CheckpointError(path + ": truncated or oversized checkpoint file");
  uint64_t c = model::fnv1a(s.params.data(), s.params.size());
  c = model::fnv1a(s.optimizer.data(), s.optimizer.size(), c);
  if (c != h.checksum) throw CheckpointError(path + ": checksum mismatch; the checkpoint is corrupt");
  return s;
}

std::vector<int> old_dp_peers(const topology::ParallelSizes& sizes, int rank, int old_world) {
  topology::ParallelSizes old = sizes;
  old.world = old_world;
  const topology::RankGroups now = topology::RankGroups::build(sizes);
  const topology::RankGroups before = topology::RankGroups::build(old);
  // The old gradient group (dp, or dp-cp) of this rank's tp and pp coordinates, in
  // its rank-in-group order: the order its optimizer shards were laid out in.
  topology::Coords c = now.coords(rank);
  c.dp = 0;
  c.cp = 0;
  return before.group_of(topology::gradient_group_kind(sizes.cp), before.rank_of(c));
}

std::vector<char> remap_params(const std::vector<char>& params, size_t elem_size, const model::BufferLayout& from,
                               const model::BufferLayout& to) {
  const size_t numel = params.size() / elem_size;
  if (numel != from.numel || from.params.size() != to.params.size())
    throw CheckpointError("cannot remap a parameter buffer of " + std::to_string(numel) +
                          " elements laid out for " + std::to_string(from.numel) + " elements and " +
                          std::to_string(from.params.size()) + " parameters onto " + std::to_string(to.params.size()) +
                          " parameters; the model differs from the checkpoint's");
  std::vector<char> out(to.numel * elem_size, 0);  // padding: +0.0 in fp32 and bf16
  for (size_t i = 0; i < to.params.size(); ++i) {
    const model::Range& a = from.params[i];
    const model::Range& b = to.params[i];
    if (a.size() != b.size() || a.end > numel || b.end > to.numel)
      throw CheckpointError("parameter " + std::to_string(i) + " holds " + std::to_string(a.size()) +
                            " elements in the checkpoint but " + std::to_string(b.size()) +
                            " in this run; the model differs from the checkpoint's");
    std::copy(params.begin() + static_cast<std::ptrdiff_t>(a.start * elem_size),
              params.begin() + static_cast<std::ptrdiff_t>(a.end * elem_size),
              out.begin() + static_cast<std::ptrdiff_t>(b.start * elem_size));
  }
  return out;
}

void load_resharded(const std::string& step_dir, int old_dp, int old_world, const topology::ParallelSizes& sizes,
                    int rank, model::Model& model, const loom::Device& dev, size_t bucket_size,
                    const loom_optimizer_api* api, loom_optimizer* opt, const std::string& plugin) {
  // The optimizer's group was dp x cp ranks (dp-cp under context parallelism).
  const int old_group = old_dp * sizes.cp;
  const model::BufferLayout old_layout =
      model::layout_entries(model.param_entries(), model.chunk_count(), old_group, bucket_size);
  const std::vector<int> peers = old_dp_peers(sizes, rank, old_world);
  if (static_cast<int>(peers.size()) != old_group)
    throw CheckpointError(step_dir + " is corrupt: its meta says dp=" + std::to_string(old_dp) + " over " +
                          std::to_string(old_world) + " ranks, which gives " + std::to_string(peers.size()) +
                          " data-parallel ranks under this run's tp, cp and pp");
  std::vector<RankState> old;
  const size_t elem_size = loom::dtype_size(model.param_dtype());
  const ParamLayoutList layout = param_layout_of(model);
  for (int peer : peers) {
    check_param_layout(step_dir, peer, layout);  // dp peers hold the same parameters
    old.push_back(read_rank_file(step_dir, peer, static_cast<int64_t>(old_layout.numel), elem_size));
  }

  // Parameters: every dp replica saved the same buffer; old dp rank 0's is used.
  const std::vector<char> params = remap_params(old.front().params, elem_size, old_layout, model.layout());
  dev.copy(model.params(), params.data(), params.size(), LOOM_COPY_HOST_TO_DEVICE);

  std::vector<const void*> states;
  std::vector<size_t> state_bytes, old_offsets, old_numels, old_buckets;
  for (const RankState& s : old) {
    states.push_back(s.optimizer.data());
    state_bytes.push_back(s.optimizer.size());
  }
  for (const model::Range& r : old_layout.params) {
    old_offsets.push_back(r.start);
    old_numels.push_back(r.size());
  }
  for (const model::Range& b : old_layout.buckets) old_buckets.push_back(b.start);
  old_buckets.push_back(old_layout.numel);
  loom_optimizer_reshard_args ra = loom::make<loom_optimizer_reshard_args>();
  ra.old_dp = old_group;
  ra.states = states.data();
  ra.state_bytes = state_bytes.data();
  ra.old_numel = old_layout.numel;
  ra.old_offsets = old_offsets.data();
  ra.old_numels = old_numels.data();
  ra.num_params = old_offsets.size();
  ra.old_bucket_offsets = old_buckets.data();
  ra.old_num_buckets = old_layout.buckets.size();
  if (!LOOM_HAS_SLOT(api, loom_optimizer_api, state_load_resharded) || api->state_load_resharded == nullptr)
    throw CheckpointError("optimizer plugin " + plugin + " cannot reshard the state of " + step_dir + " (dp=" +
                          std::to_string(old_dp) + "): it has no state_load_resharded (ABI 1.1); resume with "
                          "parallel.dp=" + std::to_string(old_dp));
  try {
    loom::check(api->state_load_resharded(opt, &ra));
  } catch (const loom::Error& e) {
    if (e.code() != LOOM_CODE_UNSUPPORTED) throw;
    throw CheckpointError("optimizer plugin " + plugin + " cannot reshard the state of " + step_dir + " (dp=" +
                          std::to_string(old_dp) + ") to dp=" + std::to_string(topology::RankGroups::build(sizes).dp()) +
                          ": " + e.what() + "; resume with parallel.dp=" + std::to_string(old_dp));
  }
  dev.synchronize();
}

namespace {

// The checkpoint's layers went to the same pipeline chunks (virtual stages, uneven
// chunks) as this run's, as the keys of its saved manifest split them.
bool same_stage_split(const std::string& step_dir, const RunPlan& plan) {
  const std::string path = (fs::path(step_dir) / "manifest.toml").string();
  boost::system::error_code ec;
  if (!fs::exists(path, ec)) return true;  // written before checkpoints kept their manifest
  toml::table saved;
  try {
    saved = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    throw CheckpointError("checkpoint " + step_dir + " is corrupt: " + path + ": " + std::string(e.description()));
  }
  // The blocks of each chunk as the checkpoint's keys split them (absent keys: their
  // defaults), however they were written (an even split, first_chunk_layers or
  // chunk_layers).
  const auto value = [&](const char* key, int64_t fallback) { return saved.at_path(key).value_or(fallback); };
  if (value("parallel.pp", 1) != plan.sizes.pp || value("parallel.vpp", 1) != plan.config.parallel.vpp) return false;
  std::vector<int> each;
  if (const toml::array* a = saved.at_path("pipeline.chunk_layers").as_array())
    for (const toml::node& n : *a) each.push_back(static_cast<int>(n.value_or(int64_t{-1})));
  try {
    return topology::blocks_per_chunk(static_cast<int>(value("model.num_layers", 0)),
                                      static_cast<int>(value("parallel.pp", 1)), static_cast<int>(value("parallel.vpp", 1)),
                                      static_cast<int>(value("pipeline.first_chunk_layers", 0)),
                                      static_cast<int>(value("pipeline.last_chunk_layers", 0)), each) ==
           plan.blocks_per_chunk;
  } catch (const std::invalid_argument&) {
    return false;  // a split loom would refuse: not this run's
  }
}

}  // namespace

namespace {
std::string bucket_text(int64_t size) {
  return size > 0 ? std::to_string(size) + " elements" : std::string("one per model chunk (optimizer.bucket_size 0)");
}
}  // namespace

ResumePoint plan_resume(const RunPlan& plan, const std::string& ckpt_dir, int64_t vocab, std::ostream* log) {
  ResumePoint out;
  if (ckpt_dir.empty())
    throw CheckpointError("--resume (or --resume-if-any) needs checkpoint.dir in the manifest (where to find the "
                          "checkpoint)");
  std::vector<std::string> incomplete;
  auto latest = latest_checkpoint(ckpt_dir, &incomplete);
  if (!latest) throw CheckpointError("--resume: no complete checkpoint in " + ckpt_dir);
  const std::string resume_dir = checkpoint_path(ckpt_dir, *latest);
  out.dir = resume_dir;
  if (log)
    for (const std::string& d : incomplete)
      *log << "resume: skipped " << d << "; resuming from " << resume_dir << std::endl;
  CheckpointMeta meta = read_meta(resume_dir);
  require_same_param_dtype(resume_dir, meta, plan.config.device.param_dtype);
  // The data continues after the samples read so far, whatever this run's global batch
  // (a checkpoint that did not record them read step x the global batch its manifest
  // has, or, without one, this run's).
  const BatchRamp ramp(plan.config.batch, plan.dp);
  const uint64_t by_batch = ramp.samples_before(meta.step, 0, 0);
  out.consumed_samples = meta.consumed_samples >= 0 ? static_cast<uint64_t>(meta.consumed_samples) : by_batch;
  out.evaluation_pending = meta.evaluation_pending;
  if (meta.consumed_samples < 0) {
    boost::system::error_code ec;
    const fs::path saved = fs::path(resume_dir) / "manifest.toml";
    if (fs::exists(saved, ec)) {
      try {
        const toml::table t = toml::parse_file(saved.string());
        if (const std::optional<int64_t> batch = t.at_path("batch.global_batch_size").value<int64_t>(); batch && *batch > 0)
          out.consumed_samples = static_cast<uint64_t>(meta.step) * static_cast<uint64_t>(*batch);
      } catch (const toml::parse_error&) {
        // a corrupt manifest is refused where the model is compared
      }
    }
  }
  if (log && out.consumed_samples != by_batch)
    *log << "resume: " << resume_dir << " read " << out.consumed_samples << " training samples in " << meta.step
         << " steps; this run continues from there, " << ramp.global_batch_at(out.consumed_samples) << " a step"
         << (ramp.ramps() ? " (batch.rampup_batch_size's batch there)" : "") << std::endl;
  // run.train_samples: the steps that take the samples left at this run's batches (with
  // the batches of the checkpoint's run, the manifest's run.steps).
  const int64_t train_samples = plan.config.run.train_samples;
  out.steps = train_samples > 0 ? meta.step + manifest::steps_for_samples(plan.config.batch, train_samples,
                                                                           out.consumed_samples)
                                : plan.config.run.steps;
  const int64_t steps = out.steps;
  if (log && out.steps != plan.config.run.steps)
    *log << "resume: run.train_samples = " << train_samples << " ends at step " << out.steps << " ("
         << out.steps - meta.step << " more steps from the " << out.consumed_samples << " samples read)" << std::endl;
  // Another vocabulary can pad to the same shapes: ids would mean other tokens.
  if (meta.vocab > 0 && meta.vocab != vocab)
    throw CheckpointError("--resume: " + resume_dir + " has a vocabulary of " + std::to_string(meta.vocab) +
                          ", the run " + std::to_string(vocab) + " (model.vocab_size, data.tokenizer's, or the data's)");

  if (meta.step > steps)
    throw CheckpointError(resume_dir + " is at step " + std::to_string(meta.step) + ", past run.steps = " +
                          std::to_string(steps) + "; raise run.steps to continue training it");
  if (meta.step == steps && log)
    *log << "resume: " << resume_dir << " is at run.steps = " << meta.step << "; nothing to train"
                 << std::endl;
  const std::string layouts = resume_dir + " was written with tp=" + std::to_string(meta.tp) + " pp=" +
                              std::to_string(meta.pp) + " dp=" + std::to_string(meta.dp) + "; this run has tp=" +
                              std::to_string(plan.sizes.tp) + " pp=" + std::to_string(plan.sizes.pp) +
                              " dp=" + std::to_string(plan.dp);
  // meta.toml's own sizes must agree (an edited world gave 'written with tp=1 pp=1 dp=2;
  // this run has tp=1 pp=1 dp=2').
  if (meta.world != meta.tp * meta.cp * meta.pp * meta.dp)
    throw CheckpointError(resume_dir + "/meta.toml is inconsistent: world = " + std::to_string(meta.world) +
                          " but tp*cp*pp*dp = " + std::to_string(meta.tp) + "*" + std::to_string(meta.cp) + "*" +
                          std::to_string(meta.pp) + "*" + std::to_string(meta.dp) + " = " +
                          std::to_string(meta.tp * meta.cp * meta.pp * meta.dp) + "; the checkpoint is corrupt");
  // Another tensor, pipeline, context or expert layout (or rank order) puts other
  // slices on each rank, and ranks of an expert layout hold other experts whatever the
  // dp: the parameters and the optimizer state are regathered by name and element, as
  // Megatron's distributed checkpoints are loaded at another layout.
  const bool experts_apart = meta.ep > 1 || meta.expert_tp() != meta.tp;
  const bool same_places = meta.tp == plan.sizes.tp && meta.pp == plan.sizes.pp && meta.cp == plan.sizes.cp &&
                           meta.ep == plan.sizes.ep && meta.expert_tp() == plan.sizes.expert_tp() &&
                           meta.order == plan.sizes.order && same_stage_split(resume_dir, plan) &&
                           meta.strategy == plan.config.optimizer.strategy;
  if (!same_places || (experts_apart && meta.dp != plan.dp)) {
    const loom_optimizer_api* run_api = plan.optimizer->optimizer();
    const plugins::LoadedPlugin* saver = plan.registry->find("parallel", meta.strategy);
    const loom_optimizer_api* saver_api = saver != nullptr ? saver->optimizer() : nullptr;
    const auto sizes = [](int tp, int pp, int cp, int ep, int etp, int dp) {
      return "tp=" + std::to_string(tp) + " pp=" + std::to_string(pp) + " cp=" + std::to_string(cp) + " ep=" +
             std::to_string(ep) + " etp=" + std::to_string(etp) + " dp=" + std::to_string(dp);
    };
    const std::string moved =
        resume_dir + " was written at " + sizes(meta.tp, meta.pp, meta.cp, meta.ep, meta.expert_tp(), meta.dp) +
        (same_stage_split(resume_dir, plan) ? "" : " with other pipeline chunks") +
        (meta.strategy == plan.config.optimizer.strategy ? "" : " by optimizer.strategy = \"" + meta.strategy + "\"") +
        "; this run has " + sizes(plan.sizes.tp, plan.sizes.pp, plan.sizes.cp, plan.sizes.ep, plan.sizes.expert_tp(), plan.dp) +
        (meta.strategy == plan.config.optimizer.strategy ? "" : " with \"" + plan.config.optimizer.strategy + "\"");
    if (saver_api == nullptr || !LOOM_HAS_SLOT(saver_api, loom_optimizer_api, state_decode) ||
        saver_api->state_decode == nullptr)
      throw CheckpointError(moved + ": regathering needs optimizer plugin parallel/" + meta.strategy +
                            (saver ? " (ABI 1." + std::to_string(saver->abi_minor) + ")" : std::string(" (not loaded)")) +
                            " to read its state by element (state_decode, ABI 1.14); resume with parallel.tp=" +
                            std::to_string(meta.tp) + " parallel.pp=" + std::to_string(meta.pp) + " parallel.cp=" +
                            std::to_string(meta.cp) + " parallel.ep=" + std::to_string(meta.ep));
    if (!LOOM_HAS_SLOT(run_api, loom_optimizer_api, state_import) || run_api->state_import == nullptr)
      throw CheckpointError(moved + ": optimizer plugin parallel/" + plan.optimizer->name + " (ABI 1." +
                            std::to_string(plan.optimizer->abi_minor) +
                            ") cannot load state by element (state_import, ABI 1.14); resume at the checkpoint's layout");
    if (log) *log << "resume: " << moved << "; regathering parameters and optimizer state by name" << std::endl;
    out.regather = true;
    out.step = meta.step;
    return out;
  }
  // Another dp pads the buffers otherwise, and so may another bucket size
  // (optimizer.overlap_grad_reduce sets Megatron's 40M when none is given): each rank
  // maps its dp peers' files by parameter (when the bucket size changed but the
  // buffers come out the same, the rank reads its own file as is).
  const bool other_buckets = meta.bucket_size >= 0 && meta.bucket_size != plan.config.optimizer.bucket_size;
  if (meta.dp != plan.dp || other_buckets) {
    const loom_optimizer_api* api = plan.optimizer->optimizer();
    if (!LOOM_HAS_SLOT(api, loom_optimizer_api, state_load_resharded) || api->state_load_resharded == nullptr)
      throw CheckpointError(
          (meta.dp != plan.dp ? layouts : resume_dir + " was written with gradient buckets of " +
                                              bucket_text(meta.bucket_size) + ", this run has " +
                                              bucket_text(plan.config.optimizer.bucket_size)) +
          ", and optimizer plugin parallel/" + plan.optimizer->name + " (ABI 1." +
          std::to_string(plan.optimizer->abi_minor) + ") cannot reshard its state (no state_load_resharded, ABI 1.1); " +
          (meta.dp != plan.dp ? "resume with parallel.dp=" + std::to_string(meta.dp) + " or rebuild the plugin with resharding"
                              : "resume with optimizer.bucket_size=" + std::to_string(meta.bucket_size) +
                                    (plan.config.optimizer.overlap_grad_reduce
                                         ? " (optimizer.overlap_grad_reduce sets 40000000 when it is 0)"
                                         : "")));
    out.old_dp = meta.dp;
    out.old_world = meta.world;
    out.old_bucket_size = meta.bucket_size;  // the old layout's buckets (-1: not recorded)
  }
  out.step = meta.step;
  return out;
}

}  // namespace loom::train
