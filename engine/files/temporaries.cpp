#include "engine/files/temporaries.hpp"

#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <iostream>
#include <mutex>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

namespace loom::files {
namespace {

// Fixed storage a signal handler can read without a lock. A slot's `version` is odd
// while its path is being written (a seqlock): the handler copies the path, then
// unlinks the copy only if the version is even and unchanged, so a path rewritten by
// another thread meanwhile (forgotten, the slot reused) is never unlinked half old and
// half new — that would name some other file.
struct Slot {
  std::atomic<unsigned> version{0};
  std::atomic<bool> listed{false};
  bool directory = false;  // written with the path, under an odd version
  char path[kMaxPath + 1] = {};
};
Slot g_slots[kMaxTemporaries];
std::mutex g_mutex;  // writers only; the handler takes no lock

}  // namespace

namespace {

void list(const std::string& path, bool directory) {
  if (path.empty() || path.size() > static_cast<size_t>(kMaxPath)) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  for (Slot& s : g_slots) {
    if (s.listed.load()) continue;
    s.version.fetch_add(1);  // odd: being written
    std::atomic_thread_fence(std::memory_order_release);
    std::memcpy(s.path, path.c_str(), path.size() + 1);
    s.directory = directory;
    s.listed.store(true);
    s.version.fetch_add(1, std::memory_order_release);
    return;
  }
}

}  // namespace

void add_temporary(const std::string& path) { list(path, false); }
void add_temporary_directory(const std::string& path) { list(path, true); }

void forget_temporary(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (Slot& s : g_slots)
    if (s.listed.load() && path == s.path) {
      s.listed.store(false);
      return;
    }
}

void remove_temporaries() noexcept {
  char copy[kMaxPath + 1];
  // Files first: a directory goes only when empty; directories again while any went
  // (a parent is empty once its listed child is gone).
  bool removed = true;
  for (int pass = 0; removed && pass <= kMaxTemporaries; ++pass) {
    removed = false;
    for (Slot& s : g_slots) {
      const unsigned before = s.version.load(std::memory_order_acquire);
      if ((before & 1u) != 0 || !s.listed.load()) continue;
      std::memcpy(copy, s.path, sizeof copy);
      const bool directory = s.directory;
      std::atomic_thread_fence(std::memory_order_acquire);
      if (s.version.load(std::memory_order_relaxed) != before) continue;  // rewritten meanwhile
      if (directory != (pass > 0)) continue;
      copy[kMaxPath] = '\0';
      if (directory ? ::rmdir(copy) == 0 : (::unlink(copy), false)) removed = true;
    }
    if (pass == 0) removed = true;  // the files' pass: go on to the directories
  }
}

Temporary::Temporary(std::string path) : path_(std::move(path)) { add_temporary(path_); }

Temporary::~Temporary() {
  if (!committed_) std::remove(path_.c_str());  // removed before it is forgotten: a signal between finds it gone
  forget_temporary(path_);
}

bool Temporary::commit(const std::string& final_path) {
  if (std::rename(path_.c_str(), final_path.c_str()) != 0) return false;
  committed_ = true;
  forget_temporary(path_);
  return true;
}

void Temporary::disown() {
  committed_ = true;
  forget_temporary(path_);
}

RenamesTogether::RenamesTogether() {
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop, &before_);
}

RenamesTogether::~RenamesTogether() { pthread_sigmask(SIG_SETMASK, &before_, nullptr); }

std::string commit_together(const std::vector<std::pair<Temporary*, std::string>>& renames) {
  const RenamesTogether together;
  std::vector<std::string> kept(renames.size());  // a link to the earlier file at each name ("": none)
  for (size_t i = 0; i < renames.size(); ++i) {
    const std::string link = renames[i].first->path() + ".earlier";
    std::remove(link.c_str());
    if (::link(renames[i].second.c_str(), link.c_str()) == 0) kept[i] = link;
  }
  std::string why;
  size_t done = 0;
  for (; done < renames.size(); ++done)
    if (!renames[done].first->commit(renames[done].second)) {
      why = "cannot rename " + renames[done].first->path() + " to " + renames[done].second + " (" +
            std::strerror(errno) + ")";
      break;
    }
  for (size_t i = 0; i < renames.size(); ++i) {
    if (!why.empty() && i < done) {  // undo: the earlier file back, or no file
      if (kept[i].empty()) {
        std::remove(renames[i].second.c_str());
      } else if (std::rename(kept[i].c_str(), renames[i].second.c_str()) != 0) {
        why += "; the earlier " + renames[i].second + " is kept as " + kept[i];
        continue;
      }
    }
    if (!kept[i].empty()) std::remove(kept[i].c_str());
  }
  return why;
}

WholeFile::WholeFile(const std::string& path) : target_(path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) return;  // a pipe, a device: directly
  // The process's own output (/dev/stdout, /proc/self/fd/1) redirected to a file is
  // written where it points, never replaced: that file is the user's.
  for (int fd : {1, 2}) {
    struct stat out {};
    if (::stat(path.c_str(), &st) == 0 && ::fstat(fd, &out) == 0 && st.st_dev == out.st_dev && st.st_ino == out.st_ino) {
      // What the command printed goes first; commit() moves the descriptor past what
      // this file appends, so what it prints next follows instead of overwriting it.
      std::cout.flush();
      std::cerr.flush();
      std::fflush(nullptr);
      own_fd_ = fd;
      return;
    }
  }
  if (path.rfind("/dev/", 0) == 0 || path.rfind("/proc/", 0) == 0) return;
  // The file a link names is replaced, not the link; a link to no file yet names the
  // file to create.
  char resolved[PATH_MAX];
  for (int hop = 0; hop < 40 && ::lstat(target_.c_str(), &st) == 0 && S_ISLNK(st.st_mode); ++hop) {
    if (::realpath(target_.c_str(), resolved) != nullptr) {
      target_ = resolved;
      break;
    }
    const ssize_t n = ::readlink(target_.c_str(), resolved, sizeof resolved - 1);
    if (n <= 0) break;
    const std::string link(resolved, static_cast<size_t>(n));
    const size_t slash = target_.rfind('/');
    target_ = link[0] == '/' || slash == std::string::npos ? link : target_.substr(0, slash + 1) + link;
  }
  temporary_ = std::make_unique<Temporary>(target_ + ".tmp");
}

bool WholeFile::commit() {
  if (own_fd_ >= 0) (void)::lseek(own_fd_, 0, SEEK_END);  // a pipe or terminal has no offset: nothing to do
  return !temporary_ || temporary_->commit(target_);
}

std::string cannot_write(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return "it is a directory";
    if (!S_ISREG(st.st_mode)) return "";  // a pipe or device: written directly when the time comes
  }
  WholeFile file(path);
  const bool beside = file.path() != path;  // a temporary beside it, renamed onto it
  // A temporary left by an earlier writer is opened, not made (and stays).
  const bool made = beside && ::access(file.path().c_str(), F_OK) != 0;
  const int fd = made ? ::open(file.path().c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644)
                      : ::open(file.path().c_str(), O_WRONLY | O_APPEND);
  const std::string why =
      fd < 0 ? std::string(beside ? "cannot create " + file.path() : "cannot open it") + ": " + std::strerror(errno) : "";
  if (fd >= 0) ::close(fd);
  if (made && fd >= 0) (void)::unlink(file.path().c_str());
  file.disown();  // a temporary an earlier writer left stays
  return why;
}

}  // namespace loom::files
