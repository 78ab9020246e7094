#include "engine/train/checkpoint.hpp"

#include "engine/model/param_init.hpp"

#include <boost/filesystem.hpp>
#include <toml++/toml.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <sstream>
#include <unistd.h>

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

void fsync_path(const std::string& path, bool directory) {
  int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0) throw CheckpointError("cannot open " + path + " to sync it: " + std::strerror(errno));
  int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw CheckpointError("fsync of " + path + " failed: " + std::strerror(errno));
}

void write_all(const std::string& path, const std::vector<std::pair<const void*, size_t>>& parts) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) throw CheckpointError("cannot create " + path + ": " + std::strerror(errno));
  bool ok = true;
  for (const auto& [p, n] : parts) ok = ok && (n == 0 || std::fwrite(p, 1, n, f) == n);
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

std::string temp_checkpoint_path(const std::string& dir, int64_t step) {
  return (fs::path(dir) / (".tmp-" + fs::path(checkpoint_path(dir, step)).filename().string() + "-" +
                           std::to_string(::getpid())))
      .string();
}

void prepare_temp_dir(const std::string& tmp) {
  boost::system::error_code ec;
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) throw CheckpointError("cannot create checkpoint directory " + tmp + ": " + ec.message());
}

std::optional<int64_t> latest_checkpoint(const std::string& dir) {
  boost::system::error_code ec;
  if (!fs::is_directory(dir, ec)) return std::nullopt;
  std::optional<int64_t> best;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step_", 0) != 0 || !fs::is_directory(e.path())) continue;
    char* end = nullptr;
    long long step = std::strtoll(name.c_str() + 5, &end, 10);
    if (*end != '\0') continue;
    if (!best || step > *best) best = step;
  }
  return best;
}

void write_rank_file(const std::string& tmp, int rank, int64_t step, const RankState& state) {
  Header h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.version = kVersion;
  h.rank = static_cast<uint32_t>(rank);
  h.step = step;
  h.numel = state.params.size();
  h.optimizer_bytes = state.optimizer.size();
  uint64_t c = model::fnv1a(state.params.data(), state.params.size() * sizeof(float));
  h.checksum = model::fnv1a(state.optimizer.data(), state.optimizer.size(), c);
  write_all(rank_file(tmp, rank), {{&h, sizeof(h)},
                                   {state.params.data(), state.params.size() * sizeof(float)},
                                   {state.optimizer.data(), state.optimizer.size()}});
}

void commit_checkpoint(const std::string& dir, const std::string& tmp, const CheckpointMeta& meta,
                       const std::string& manifest_toml) {
  toml::table t{{"step", meta.step}, {"world", meta.world}, {"tp", meta.tp},
                {"pp", meta.pp},     {"dp", meta.dp},       {"strategy", meta.strategy}, {"format", 1}};
  std::ostringstream os;
  os << t << "\n";
  const std::string meta_text = os.str();
  write_all((fs::path(tmp) / "meta.toml").string(), {{meta_text.data(), meta_text.size()}});
  write_all((fs::path(tmp) / "manifest.toml").string(), {{manifest_toml.data(), manifest_toml.size()}});
  fsync_path(tmp, true);
  const std::string final_dir = checkpoint_path(dir, meta.step);
  boost::system::error_code ec;
  std::string old;
  if (fs::exists(final_dir)) {  // re-saving a step: move the old one aside first
    old = final_dir + ".old-" + std::to_string(::getpid());
    fs::rename(final_dir, old, ec);
    if (ec) throw CheckpointError("cannot replace " + final_dir + ": " + ec.message());
  }
  fs::rename(tmp, final_dir, ec);
  if (ec) throw CheckpointError("cannot move " + tmp + " to " + final_dir + ": " + ec.message());
  fsync_path(dir, true);
  if (!old.empty()) fs::remove_all(old, ec);
}

CheckpointMeta read_meta(const std::string& step_dir) {
  const std::string path = (fs::path(step_dir) / "meta.toml").string();
  CheckpointMeta m;
  try {
    toml::table t = toml::parse_file(path);
    auto need = [&](const char* key) -> int64_t {
      auto v = t[key].value<int64_t>();
      if (!v) throw CheckpointError("checkpoint " + step_dir + " is corrupt: meta.toml has no integer '" + key + "'");
      return *v;
    };
    m.step = need("step");
    m.world = static_cast<int>(need("world"));
    m.tp = static_cast<int>(need("tp"));
    m.pp = static_cast<int>(need("pp"));
    m.dp = static_cast<int>(need("dp"));
    m.strategy = t["strategy"].value_or(std::string());
  } catch (const toml::parse_error& e) {
    throw CheckpointError("checkpoint " + step_dir + " is corrupt: " + path + ": " + std::string(e.description()));
  }
  return m;
}

RankState read_rank_file(const std::string& step_dir, int rank, int64_t expect_numel) {
  const std::string path = rank_file(step_dir, rank);
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
  RankState s;
  s.params.resize(h.numel);
  s.optimizer.resize(h.optimizer_bytes);
  in.read(reinterpret_cast<char*>(s.params.data()), h.numel * sizeof(float));
  in.read(s.optimizer.data(), h.optimizer_bytes);
  if (!in || in.peek() != std::char_traits<char>::eof())
    throw CheckpointError(path + ": truncated or oversized checkpoint file");
  uint64_t c = model::fnv1a(s.params.data(), s.params.size() * sizeof(float));
  c = model::fnv1a(s.optimizer.data(), s.optimizer.size(), c);
  if (c != h.checksum) throw CheckpointError(path + ": checksum mismatch; the checkpoint is corrupt");
  return s;
}

}  // namespace loom::train
