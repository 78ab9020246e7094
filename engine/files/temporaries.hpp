// Files written whole or not at all go to a temporary beside their final name first
// and are renamed onto it once complete. While such a temporary exists it is listed
// here, so that a signal that ends the command at once (engine/cli/interrupt.hpp)
// removes it rather than leaving half a file behind.
#pragma once

#include <string>

namespace loom::files {

// `path` is a temporary until forgotten. At most kMaxTemporaries at once (more are
// not removed by a signal, only by their writers); paths longer than kMaxPath bytes
// likewise.
constexpr int kMaxTemporaries = 64;
constexpr int kMaxPath = 4096;
void add_temporary(const std::string& path);
void forget_temporary(const std::string& path);

// Removes every listed temporary. Async-signal-safe (unlink only): for signal handlers.
void remove_temporaries() noexcept;

// Lists `path` for its lifetime: the writer renames it into place (then commit()) or
// removes it when destroyed without a commit.
class Temporary {
 public:
  explicit Temporary(std::string path);
  ~Temporary();
  Temporary(const Temporary&) = delete;
  Temporary& operator=(const Temporary&) = delete;
  const std::string& path() const { return path_; }
  // Renames the temporary onto `final_path`; false (errno set) when the rename failed,
  // and the temporary is then removed on destruction.
  bool commit(const std::string& final_path);

 private:
  std::string path_;
  bool committed_ = false;
};

}  // namespace loom::files
