// Files written whole or not at all go to a temporary beside their final name first
// and are renamed onto it once complete. While such a temporary exists it is listed
// here, so that a signal that ends the command at once (engine/cli/interrupt.hpp)
// removes it rather than leaving half a file behind.
#pragma once

#include <csignal>
#include <ios>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace loom::files {

// `path` is a temporary until forgotten. At most kMaxTemporaries at once (more are
// not removed by a signal, only by their writers); paths longer than kMaxPath bytes
// likewise.
constexpr int kMaxTemporaries = 64;
constexpr int kMaxPath = 4096;
void add_temporary(const std::string& path);
// A directory made to hold temporaries: removed after them, and only if then empty.
void add_temporary_directory(const std::string& path);
void forget_temporary(const std::string& path);

// Removes every listed temporary, then every listed directory left empty.
// Async-signal-safe (unlink and rmdir only): for signal handlers.
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
  // Forgets the path without removing it: what is there is not this writer's.
  void disown();

 private:
  std::string path_;
  bool committed_ = false;
};

// While it lives, SIGINT and SIGTERM wait (blocked for the calling thread, the one
// that runs a command's writing) so that a group of renames is done whole: a stop
// signal never leaves one file of a set new and the other old.
class RenamesTogether {
 public:
  RenamesTogether();
  ~RenamesTogether();
  RenamesTogether(const RenamesTogether&) = delete;
  RenamesTogether& operator=(const RenamesTogether&) = delete;

 private:
  sigset_t before_;
};

// Renames each temporary onto its final name as one set: a stop signal waits meanwhile
// (RenamesTogether), and when a rename fails those done before it are undone (an
// earlier file at a final name is kept by a hard link until every rename is done, then
// put back; where there was none, the new file is removed), so the names hold the whole
// new set or what they held before. Returns "" or why not, naming the file; the
// temporaries not renamed are left to their owners (removed when destroyed). On a file
// system without hard links an earlier file cannot be kept, and is then lost too.
std::string commit_together(const std::vector<std::pair<Temporary*, std::string>>& renames);

// A file written whole or not at all at `path`: write to path(), then commit(). A
// regular file (or none) is written beside its name and renamed onto it, so an earlier
// file stays until the new one is whole; through a symbolic link, beside the file it
// names (the link stays); a pipe or device, and the process's own stdout or stderr
// (/dev/stdout, also when redirected to a file), are written directly.
class WholeFile {
 public:
  explicit WholeFile(const std::string& path);
  const std::string& path() const { return temporary_ ? temporary_->path() : target_; }
  // How to open path(): appending when written directly (opening stdout redirected to a
  // file anew must not truncate what the command printed before), else from empty.
  std::ios::openmode mode() const { return std::ios::binary | (temporary_ ? std::ios::trunc : std::ios::app); }
  // False (errno set) when the rename failed; the temporary is then removed.
  bool commit();
  // Whether the file is replaced whole (written beside it, then renamed), not written
  // directly (a pipe, a device, the process's own output).
  bool replaces() const { return temporary_ != nullptr; }
  // Gives up without removing what is at path() (a check that wrote nothing there).
  void disown() {
    if (temporary_) temporary_->disown();
  }

 private:
  std::string target_;
  std::unique_ptr<Temporary> temporary_;
  int own_fd_ = -1;  // 1 or 2 when path is the process's own stdout or stderr
};

// Why a WholeFile at `path` could not be written, or "" when it can: checked before long
// work whose result it will hold, so that the work is not lost at the end. Creates
// nothing that stays (its temporary is made and removed); a pipe or device is not
// opened (a pipe would wait for its reader).
std::string cannot_write(const std::string& path);

}  // namespace loom::files
