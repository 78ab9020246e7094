// TensorBoard event files (see tensorboard.hpp): the protocol buffer wire format by
// hand (varints, fixed 32/64-bit little-endian, length-delimited fields).
#include "engine/train/tensorboard.hpp"

#include <boost/filesystem.hpp>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <fcntl.h>
#include <unistd.h>

namespace loom::train {

namespace {

std::array<uint32_t, 256> crc32c_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) != 0 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

template <typename T>
void put_little_endian(std::string& out, T v) {
  unsigned char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));  // x86-64 and aarch64 are little-endian
  out.append(reinterpret_cast<const char*>(bytes), sizeof(T));
}

enum Wire : uint32_t { kVarint = 0, kFixed64 = 1, kBytes = 2, kFixed32 = 5 };

void put_key(std::string& out, uint32_t field, Wire wire) { put_varint(out, (field << 3) | wire); }

void put_bytes(std::string& out, uint32_t field, const std::string& bytes) {
  put_key(out, field, kBytes);
  put_varint(out, bytes.size());
  out += bytes;
}

// Event's wall_time (1) and step (2), every event's start.
std::string event_head(double wall_time, int64_t step) {
  std::string e;
  put_key(e, 1, kFixed64);
  put_little_endian(e, wall_time);
  if (step != 0) {  // proto3: a zero is left out
    put_key(e, 2, kVarint);
    put_varint(e, static_cast<uint64_t>(step));
  }
  return e;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t crc32c(const void* data, size_t size) {
  static const std::array<uint32_t, 256> table = crc32c_table();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < size; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t c = crc32c(data, size);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string scalars_event(double wall_time, int64_t step, const Scalars& values) {
  std::string summary;
  for (const auto& [tag, value] : values) {
    std::string v;
    put_bytes(v, 1, tag);
    put_key(v, 2, kFixed32);
    put_little_endian(v, value);
    put_bytes(summary, 1, v);
  }
  std::string e = event_head(wall_time, step);
  if (!values.empty()) put_bytes(e, 5, summary);
  return e;
}

std::string file_version_event(double wall_time) {
  std::string e = event_head(wall_time, 0);
  put_bytes(e, 3, "brain.Event:2");
  return e;
}

std::string session_start_event(double wall_time, int64_t step) {
  std::string log;
  put_key(log, 1, kVarint);
  put_varint(log, 1);  // SessionLog.status START
  std::string e = event_head(wall_time, step);
  put_bytes(e, 7, log);
  return e;
}

std::string tf_record(const std::string& data) {
  std::string r;
  const uint64_t size = data.size();
  put_little_endian(r, size);
  put_little_endian(r, masked_crc32c(r.data(), sizeof(size)));
  r += data;
  put_little_endian(r, masked_crc32c(data.data(), data.size()));
  return r;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir, int64_t first_step)
    : dir_(dir), first_step_(first_step) {
  boost::system::error_code ec;
  if (boost::filesystem::exists(dir, ec) && !boost::filesystem::is_directory(dir, ec))
    throw std::runtime_error("tensorboard directory " + dir + ": it is a file, not a directory");
  boost::filesystem::create_directories(dir, ec);
  if (ec || !boost::filesystem::is_directory(dir))
    throw std::runtime_error("tensorboard directory " + dir + ": cannot create it (" +
                             (ec ? ec.message() : std::string("not a directory")) + ")");
}

TensorBoardWriter::~TensorBoardWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void TensorBoardWriter::open() {
  char host[256] = "localhost";
  (void)::gethostname(host, sizeof(host) - 1);
  std::string name = host;
  std::replace(name.begin(), name.end(), '/', '_');
  // The time to the microsecond, zero-padded, keeps the files of launches in name order.
  const auto micros = std::chrono::duration_cast<std::chrono::microseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  char stamp[64];
  std::snprintf(stamp, sizeof(stamp), "%lld.%06lld", static_cast<long long>(micros / 1000000),
                static_cast<long long>(micros % 1000000));
  const std::string stem = (boost::filesystem::path(dir_) / ("events.out.tfevents." + std::string(stamp) + "." + name +
                                                             "." + std::to_string(::getpid())))
                               .string();
  for (int n = 0; fd_ < 0; ++n) {
    char count[16];
    std::snprintf(count, sizeof(count), ".%03d", n);
    path_ = stem + count;
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ < 0 && (errno != EEXIST || n >= 999))
      throw std::runtime_error("tensorboard file " + path_ + ": cannot create it (" + std::strerror(errno) + ")");
  }
  append(file_version_event(now_seconds()), 0);
  append(session_start_event(now_seconds(), first_step_), first_step_);
}

void TensorBoardWriter::write(int64_t step, const Scalars& values) {
  if (fd_ < 0) open();
  append(scalars_event(now_seconds(), step, values), step);
}

void TensorBoardWriter::append(const std::string& event, int64_t step) {
  const std::string record = tf_record(event);
  size_t done = 0;
  while (done < record.size()) {
    const ssize_t n = ::write(fd_, record.data() + done, record.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = n < 0 ? errno : ENOSPC;
      (void)::ftruncate(fd_, written_);  // no torn record for a reader to stop at
      (void)::lseek(fd_, written_, SEEK_SET);
      throw std::runtime_error("tensorboard file " + path_ + ": writing step " + std::to_string(step) + " failed (" +
                               std::strerror(error) + ")");
    }
    done += static_cast<size_t>(n);
  }
  written_ += static_cast<off_t>(record.size());
}

}  // namespace loom::train
