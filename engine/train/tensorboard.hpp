// TensorBoard event files, as tf.summary and torch.utils.tensorboard write them and
// Megatron-LM's --tensorboard-dir fills: records of Event protocol buffers, each framed
// as a TFRecord (the length as a little-endian uint64, its masked CRC-32C, the bytes,
// their masked CRC-32C). Only what scalars need is encoded (Event: wall_time 1, step 2,
// file_version 3, summary 5, session_log 7; Summary.Value: tag 1, simple_value 2).
#pragma once

#include <cstddef>
#include <cstdint>
#include <sys/types.h>
#include <string>
#include <utility>
#include <vector>

namespace loom::train {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, as iSCSI's RFC 3720), and the
// mask TFRecord applies to it: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t crc32c(const void* data, size_t size);
uint32_t masked_crc32c(const void* data, size_t size);

using Scalars = std::vector<std::pair<std::string, float>>;

// The serialized Event of `values` at `step` (an empty list: no summary field).
std::string scalars_event(double wall_time, int64_t step, const Scalars& values);
// The first event of a file: its format, "brain.Event:2".
std::string file_version_event(double wall_time);
// SessionLog START at `step`: TensorBoard drops what an earlier launch wrote from that
// step on (the steps a resumed run trains again).
std::string session_start_event(double wall_time, int64_t step);
// One TFRecord of `data`.
std::string tf_record(const std::string& data);

class TensorBoardWriter {
 public:
  // Creates `dir` (and its parents); throws std::runtime_error, naming it, when it
  // cannot. The file is made at the first write (a launch that fails before its first
  // step leaves none): events.out.tfevents.<seconds>.<microseconds>.<host>.<pid>.<n>,
  // names in launch order as TensorBoard reads a directory's files, starting with the
  // file version and a session start at `first_step`.
  TensorBoardWriter(const std::string& dir, int64_t first_step);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;
  // One event of scalars at `step`, written through to the file. A failed write (a full
  // disk) cuts the file back to its last whole record and throws std::runtime_error.
  void write(int64_t step, const Scalars& values);
  // The file's path ("" before the first write).
  const std::string& path() const { return path_; }

 private:
  void open();
  void append(const std::string& event, int64_t step);

  std::string dir_;
  int64_t first_step_ = 1;
  std::string path_;
  int fd_ = -1;
  off_t written_ = 0;  // the bytes of whole records in the file
};

}  // namespace loom::train
