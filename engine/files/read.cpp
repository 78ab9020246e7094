#include "engine/files/read.hpp"

#include <cerrno>
#include <cstring>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace loom::files {

const char* not_regular_kind(unsigned mode) {
  return S_ISDIR(mode)                    ? "a directory"
         : S_ISFIFO(mode)                 ? "a FIFO"
         : S_ISCHR(mode) || S_ISBLK(mode) ? "a device"
         : S_ISSOCK(mode)                 ? "a socket"
                                          : "not a file";
}

std::optional<std::string> read_whole_file(const std::string& path, std::string* why, Pipes pipes) {
  auto fail = [&]() -> std::optional<std::string> {
    if (why != nullptr) *why = std::strerror(errno);
    return std::nullopt;
  };
  struct Fd {  // closed however this returns (appending may throw bad_alloc)
    int fd;
    ~Fd() {
      if (fd < 0) return;
      const int error = errno;
      ::close(fd);
      errno = error;
    }
  } f{::open(path.c_str(), O_RDONLY | O_CLOEXEC | (pipes == Pipes::Refuse ? O_NONBLOCK : 0))};  // nor waits for a writer
  if (f.fd < 0) return fail();
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) return fail();
  const bool pipe = S_ISFIFO(st.st_mode) && pipes == Pipes::Allow;
  // Reads block as usual (a file system may answer EAGAIN to a non-blocking one).
  if (pipes == Pipes::Refuse && S_ISREG(st.st_mode) && ::fcntl(f.fd, F_SETFL, ::fcntl(f.fd, F_GETFL) & ~O_NONBLOCK) != 0)
    return fail();
  if (!S_ISREG(st.st_mode) && !pipe) {
    errno = EINVAL;
    if (why != nullptr) *why = std::string("not a regular file (") + not_regular_kind(st.st_mode) + ")";
    return std::nullopt;
  }
  std::string bytes;
  if (st.st_size > 0) bytes.reserve(static_cast<size_t>(st.st_size));
  char chunk[1 << 16];
  for (;;) {
    const ssize_t n = ::read(f.fd, chunk, sizeof chunk);
    if (n == 0) return bytes;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail();
    bytes.append(chunk, static_cast<size_t>(n));
  }
}

}  // namespace loom::files
