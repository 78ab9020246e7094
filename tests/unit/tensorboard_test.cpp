// TensorBoard event files: CRC-32C against RFC 3720's check values, an Event's bytes
// worked out by hand from the protocol buffer encoding, and a run's file read back
// with a reader of its own (the TFRecord framing and its checksums, the Event and
// Summary fields): every step's scalars are the run's, and a resumed run starts a
// session at its first step. A write the file system refuses leaves whole records (and
// the metrics file whole lines).
#include "support/train_fixture.hpp"

#include "engine/train/tensorboard.hpp"
#include "engine/train/trainer.hpp"

#include <gtest/gtest.h>

#include <boost/filesystem.hpp>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include <sys/resource.h>

namespace {

namespace fs = boost::filesystem;
using loom::testing::run_and_trace;
using loom::testing::tiny_manifest;

std::string bytes(std::initializer_list<int> b) {
  std::string s;
  for (int x : b) s.push_back(static_cast<char>(x));
  return s;
}

// RFC 3720, B.4: the CRC-32C of "123456789" (the usual check value), of 32 zero bytes
// and of 32 bytes of 0xff.
TEST(TensorBoard, Crc32cIsRfc3720s) {
  EXPECT_EQ(loom::train::crc32c("123456789", 9), 0xE3069283u);
  const std::string zeros(32, '\0'), ones(32, '\xff');
  EXPECT_EQ(loom::train::crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(loom::train::crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  const uint32_t c = 0xE3069283u;
  EXPECT_EQ(loom::train::masked_crc32c("123456789", 9), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

// Event{wall_time = 0.5, step = 3, summary{value{tag "loss", simple_value 2.5}}}:
// wall_time is field 1, fixed64 (key 0x09, then 0.5 as a little-endian double); step
// field 2, varint (0x10 0x03); summary field 5, length-delimited (0x2a, 13 bytes):
// its value field 1 (0x0a, 11 bytes) holds the tag, field 1 (0x0a 0x04 "loss"), and
// simple_value, field 2, fixed32 (0x15, then 2.5f = 0x40200000 little-endian).
TEST(TensorBoard, AnEventsBytesAreTheProtocolBufferEncoding) {
  const std::string expected = bytes({0x09, 0, 0, 0, 0, 0, 0, 0xe0, 0x3f, 0x10, 0x03, 0x2a, 0x0d, 0x0a, 0x0b, 0x0a, 0x04,
                                      'l', 'o', 's', 's', 0x15, 0x00, 0x00, 0x20, 0x40});
  EXPECT_EQ(loom::train::scalars_event(0.5, 3, {{"loss", 2.5f}}), expected);
  // Step 300 is a two-byte varint: 300 = 0b10'0101100 -> 0xac 0x02.
  EXPECT_EQ(loom::train::scalars_event(0.5, 300, {}).substr(9), bytes({0x10, 0xac, 0x02}));
  // The file's first event: file_version, field 3 (0x1a), "brain.Event:2".
  EXPECT_EQ(loom::train::file_version_event(0.5).substr(9), bytes({0x1a, 13}) + "brain.Event:2");
  // SessionLog{status START = 1} as field 7 (0x3a), at step 4.
  EXPECT_EQ(loom::train::session_start_event(0.5, 4).substr(9), bytes({0x10, 0x04, 0x3a, 0x02, 0x08, 0x01}));
  // The record: the length (8 bytes, little-endian), its masked CRC, the data, its masked CRC.
  const std::string record = loom::train::tf_record("abc");
  ASSERT_EQ(record.size(), 8u + 4 + 3 + 4);
  EXPECT_EQ(record.substr(0, 8), bytes({3, 0, 0, 0, 0, 0, 0, 0}));
  uint32_t crc = 0;
  std::memcpy(&crc, record.data() + 8, 4);
  EXPECT_EQ(crc, loom::train::masked_crc32c(record.data(), 8));
  EXPECT_EQ(record.substr(12, 3), "abc");
  std::memcpy(&crc, record.data() + 15, 4);
  EXPECT_EQ(crc, loom::train::masked_crc32c("abc", 3));
}

// What a reader of an event file finds: each event's step, its scalars by tag, its
// file version and whether it starts a session.
struct ReadEvent {
  int64_t step = 0;
  std::map<std::string, float> scalars;
  std::string file_version;
  bool session_start = false;
};

// A reader of the protocol buffer wire format, for the fields the writer uses.
class Fields {
 public:
  explicit Fields(const std::string& b) : b_(b) {}
  bool next(uint32_t& field, uint32_t& wire) {
    if (at_ >= b_.size()) return false;
    const uint64_t key = varint();
    field = static_cast<uint32_t>(key >> 3);
    wire = static_cast<uint32_t>(key & 7);
    return true;
  }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      const auto byte = static_cast<unsigned char>(b_.at(at_++));
      v |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return v;
    }
  }
  std::string take(size_t n) {
    std::string s = b_.substr(at_, n);
    EXPECT_EQ(s.size(), n) << "a field runs past its message";
    at_ += n;
    return s;
  }
  std::string bytes_field() { return take(varint()); }

 private:
  const std::string& b_;
  size_t at_ = 0;
};

ReadEvent parse_event(const std::string& data) {
  ReadEvent e;
  Fields f(data);
  uint32_t field = 0, wire = 0;
  while (f.next(field, wire)) {
    if (field == 1 && wire == 1) {
      f.take(8);
    } else if (field == 2 && wire == 0) {
      e.step = static_cast<int64_t>(f.varint());
    } else if (field == 3 && wire == 2) {
      e.file_version = f.bytes_field();
    } else if (field == 7 && wire == 2) {
      const std::string log = f.bytes_field();
      Fields l(log);
      uint32_t lf = 0, lw = 0;
      while (l.next(lf, lw)) {
        EXPECT_EQ(lf, 1u);
        e.session_start = l.varint() == 1;
      }
    } else if (field == 5 && wire == 2) {
      const std::string summary = f.bytes_field();
      Fields s(summary);
      uint32_t sf = 0, sw = 0;
      while (s.next(sf, sw)) {
        EXPECT_EQ(sf, 1u);
        const std::string value = s.bytes_field();
        Fields v(value);
        std::string tag;
        float x = 0;
        uint32_t vf = 0, vw = 0;
        while (v.next(vf, vw)) {
          if (vf == 1) tag = v.bytes_field();
          if (vf == 2) std::memcpy(&x, v.take(4).data(), 4);
        }
        e.scalars[tag] = x;
      }
    } else {
      ADD_FAILURE() << "unexpected field " << field << " (wire type " << wire << ")";
      return e;
    }
  }
  return e;
}

// The events of `path`, each record's two checksums checked.
std::vector<ReadEvent> read_events(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<ReadEvent> out;
  size_t at = 0;
  while (at < file.size()) {
    uint64_t size = 0;
    uint32_t size_crc = 0, data_crc = 0;
    if (file.size() - at < 12) {
      ADD_FAILURE() << "a torn record at byte " << at;
      break;
    }
    std::memcpy(&size, file.data() + at, 8);
    std::memcpy(&size_crc, file.data() + at + 8, 4);
    EXPECT_EQ(size_crc, loom::train::masked_crc32c(file.data() + at, 8)) << "byte " << at;
    if (file.size() - at - 12 < size + 4) {
      ADD_FAILURE() << "a torn record at byte " << at;
      break;
    }
    const std::string data = file.substr(at + 12, size);
    std::memcpy(&data_crc, file.data() + at + 12 + size, 4);
    EXPECT_EQ(data_crc, loom::train::masked_crc32c(data.data(), data.size())) << "byte " << at;
    out.push_back(parse_event(data));
    at += 12 + size + 4;
  }
  return out;
}

std::vector<std::string> event_files(const std::string& dir) {
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  return files;
}

// A run's event file holds its file version, a session start at step 1, then each
// step's scalars as the run recorded them (and its evaluations'); a resumed run's new
// file starts its session at the step after the checkpoint.
TEST(TensorBoard, ARunsEventFileHoldsEveryStepsScalars) {
  const std::string dir = loom::testing::scratch_dir("tensorboard");
  fs::remove_all(dir);
  const std::string tb = dir + "/tb", ck = "checkpoint.dir=\"" + dir + "/ck\"";
  loom::train::TrainOptions opts;
  opts.tensorboard_dir = tb;
  auto run = run_and_trace(tiny_manifest(), {"run.steps=6", "run.eval_every=3", ck}, opts);
  std::vector<std::string> files = event_files(tb);
  ASSERT_EQ(files.size(), 1u);
  std::vector<ReadEvent> events = read_events(files[0]);
  ASSERT_EQ(events.size(), 2u + 6);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_TRUE(events[1].session_start);
  EXPECT_EQ(events[1].step, 1);
  for (size_t i = 0; i < 6; ++i) {
    const ReadEvent& e = events[2 + i];
    const loom::train::StepRecord& r = run.result.steps[i];
    EXPECT_EQ(e.step, r.step);
    EXPECT_EQ(e.scalars.at("lm loss"), static_cast<float>(r.loss)) << "step " << r.step;
    EXPECT_EQ(e.scalars.at("learning-rate"), r.lr);
    EXPECT_EQ(e.scalars.at("weight-decay"), r.weight_decay);
    EXPECT_EQ(e.scalars.at("grad-norm"), static_cast<float>(r.grad_norm));
    EXPECT_EQ(e.scalars.at("batch-size"), 8.0f);
    EXPECT_GT(e.scalars.at("iteration-time"), 0.0f);
    EXPECT_EQ(e.scalars.count("lm loss validation"), r.evaluated ? 1u : 0u) << "step " << r.step;
    if (r.evaluated) {
      EXPECT_EQ(e.scalars.at("lm loss validation"), static_cast<float>(r.val_loss));
    }
  }
  EXPECT_TRUE(run.result.steps[2].evaluated);
  // A resume from step 6 to 8 adds a file whose session starts at step 7.
  opts.resume = true;
  run_and_trace(tiny_manifest(), {"run.steps=8", "run.eval_every=3", "optimizer.decay_steps=6", ck}, opts);
  files = event_files(tb);
  ASSERT_EQ(files.size(), 2u);
  // In name order (TensorBoard's), the resumed launch's file comes second.
  EXPECT_EQ(read_events(files[0]).size(), 2u + 6);
  const std::vector<ReadEvent> resumed = read_events(files[1]);
  ASSERT_EQ(resumed.size(), 4u);
  EXPECT_TRUE(resumed[1].session_start);
  EXPECT_EQ(resumed[1].step, 7);
  EXPECT_EQ(resumed[2].step, 7);
  EXPECT_EQ(resumed[3].step, 8);
  fs::remove_all(dir);
}

// A write the file system refuses (here the file-size limit, its signal ignored: EFBIG)
// throws naming the step, and leaves the file at its last whole record, which a
// reader reads to the end.
TEST(TensorBoard, AFailedWriteLeavesNoTornRecord) {
  const std::string dir = loom::testing::scratch_dir("tensorboard_full");
  fs::remove_all(dir);
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  const auto previous = std::signal(SIGXFSZ, SIG_IGN);
  std::string failure;
  std::string path;
  {
    loom::train::TensorBoardWriter writer(dir, 1);
    writer.write(1, {{"lm loss", 1.0f}});
    path = writer.path();
    rlimit limited = old;
    limited.rlim_cur = 1000;  // bytes: a few dozen records of two scalars
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0);
    try {
      for (int64_t step = 2; step < 1000; ++step) writer.write(step, {{"lm loss", 1.0f}, {"learning-rate", 0.5f}});
    } catch (const std::exception& e) {
      failure = e.what();
    }
    ::setrlimit(RLIMIT_FSIZE, &old);
  }
  std::signal(SIGXFSZ, previous);
  EXPECT_NE(failure.find("tensorboard file " + path + ": writing step "), std::string::npos) << failure;
  const std::vector<ReadEvent> events = read_events(path);  // fails on a torn record
  ASSERT_GE(events.size(), 3u);
  EXPECT_LE(fs::file_size(path), 1000u);
  EXPECT_EQ(events.back().scalars.count("learning-rate"), 1u);
  fs::remove_all(dir);
}

// The metrics file likewise: a run whose metrics line the file-size limit refuses stops
// naming the step, and the file keeps whole lines only.
TEST(Metrics, AFailedWriteLeavesWholeLines) {
  const std::string dir = loom::testing::scratch_dir("metrics_full");
  fs::remove_all(dir);
  fs::create_directories(dir);
  loom::train::TrainOptions opts;
  opts.metrics_file = dir + "/m.jsonl";
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  const auto previous = std::signal(SIGXFSZ, SIG_IGN);
  rlimit limited = old;
  limited.rlim_cur = 1500;  // a few lines of a step's JSON
  std::string failure;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0);
  try {
    run_and_trace(tiny_manifest(), {"run.steps=50"}, opts);
  } catch (const std::exception& e) {
    failure = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, previous);
  EXPECT_NE(failure.find("metrics file " + opts.metrics_file + ": writing step "), std::string::npos) << failure;
  std::ifstream in(opts.metrics_file, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_FALSE(text.empty());
  EXPECT_EQ(text.back(), '\n') << "a torn last line";
  EXPECT_LE(text.size(), 1500u);
  fs::remove_all(dir);
}

// A directory that cannot be made stops the run before it trains, naming it.
TEST(TensorBoard, ADirectoryThatCannotBeMadeIsRefused) {
  const std::string dir = loom::testing::scratch_dir("tensorboard_bad");
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir + "/file") << "x";
  loom::train::TrainOptions opts;
  opts.tensorboard_dir = dir + "/file/tb";
  try {
    run_and_trace(tiny_manifest(), {"run.steps=2"}, opts);
    ADD_FAILURE() << "a directory under a file was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("tensorboard directory " + dir + "/file/tb: cannot create it"),
              std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

}  // namespace
