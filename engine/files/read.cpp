#include "engine/files/read.hpp"

#include <cerrno>

#include <fcntl.h>
#include <unistd.h>

namespace loom::files {

std::optional<std::string> read_whole_file(const std::string& path) {
  struct Fd {  // closed however this returns (appending may throw bad_alloc)
    int fd;
    ~Fd() {
      if (fd < 0) return;
      const int error = errno;
      ::close(fd);
      errno = error;
    }
  } f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (f.fd < 0) return std::nullopt;
  std::string bytes;
  char chunk[1 << 16];
  for (;;) {
    const ssize_t n = ::read(f.fd, chunk, sizeof chunk);
    if (n == 0) return bytes;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return std::nullopt;
    bytes.append(chunk, static_cast<size_t>(n));
  }
}

}  // namespace loom::files
