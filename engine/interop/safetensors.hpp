// The safetensors format (Hugging Face, github.com/huggingface/safetensors): an 8-byte
// little-endian header length N, N bytes of JSON — for each tensor {"dtype", "shape",
// "data_offsets": [begin, end]} relative to the data that follows, and an optional
// "__metadata__" map of strings — then the tensors' bytes, packed without holes. The
// header is written and read with nlohmann::json; reading refuses a header that does not
// describe the file exactly (offsets out of range, overlapping or leaving holes, a size
// that is not shape x dtype, an unknown dtype) naming the tensor.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace loom::interop {

class SafetensorsError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct NamedTensor {
  std::string name;
  std::string dtype;            // "F32", "BF16", "F16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL"
  std::vector<int64_t> shape;
  std::vector<char> data;       // row-major, little-endian
};

// Bytes per element of a safetensors dtype; 0 when unknown.
size_t safetensors_dtype_size(const std::string& dtype);

// Writes `tensors` in order (the header sorted by name, as the format's writers do),
// with `metadata`, into path: through a temporary file renamed into place, or straight
// into `path` with `direct` (a caller whose path is a temporary of its own).
void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {}, bool direct = false);

// Whether `path` starts as a safetensors file does: a header length within the file and
// a header that is a JSON object (what an export may replace; other files are left).
bool looks_like_safetensors(const std::string& path);

struct SafetensorsFile {
  std::vector<NamedTensor> tensors;  // in the order of their data
  std::map<std::string, std::string> metadata;
};
SafetensorsFile read_safetensors(const std::string& path);

// A model's tensors in a Hugging Face directory: DIR/model.safetensors, or the shards
// save_pretrained writes above its max_shard_size (DIR/model.safetensors.index.json,
// whose weight_map names each tensor's file, model-0000i-of-0000N.safetensors). Every
// shard is read and checked against the index: each tensor in the file the index names,
// listed once, none missing, shard names plain file names in DIR. `source` is set to
// what the tensors came from, for messages.
std::vector<NamedTensor> read_safetensors_model(const std::string& dir, std::string* source = nullptr);
// The same from the bytes of a file (`what` names it in errors).
SafetensorsFile parse_safetensors(const std::vector<char>& bytes, const std::string& what);

}  // namespace loom::interop
