#include "engine/interop/safetensors.hpp"
#include <memory>
#include <map>

#include "engine/files/temporaries.hpp"

#include <nlohmann/json.hpp>

#include <boost/filesystem.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <limits>

namespace loom::interop {

namespace {

// A header this large is not a model's (the format's own reader stops at 100 MB).
constexpr uint64_t kMaxHeader = 100ull << 20;

std::string fail_in(const std::string& what, const std::string& why) { return what + ": " + why; }

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

size_t safetensors_dtype_size(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "BF16" || d == "F16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL") return 1;
  return 0;
}

void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata, bool direct) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<const NamedTensor*> by_name;
  for (const NamedTensor& t : tensors) by_name.push_back(&t);
  std::sort(by_name.begin(), by_name.end(), [](auto* a, auto* b) { return a->name < b->name; });
  uint64_t offset = 0;
  std::map<std::string, std::pair<uint64_t, uint64_t>> at;
  for (const NamedTensor& t : tensors) {
    const size_t es = safetensors_dtype_size(t.dtype);
    if (es == 0) throw SafetensorsError(fail_in(path, "tensor " + t.name + " has unknown dtype " + t.dtype));
    if (static_cast<uint64_t>(numel(t.shape)) * es != t.data.size())
      throw SafetensorsError(fail_in(path, "tensor " + t.name + " holds " + std::to_string(t.data.size()) +
                                               " bytes, not its shape times its dtype's size"));
    if (!at.emplace(t.name, std::make_pair(offset, offset + t.data.size())).second)
      throw SafetensorsError(fail_in(path, "two tensors are named " + t.name));
    offset += t.data.size();
  }
  for (const NamedTensor* t : by_name)
    header[t->name] = {{"dtype", t->dtype}, {"shape", t->shape}, {"data_offsets", {at[t->name].first, at[t->name].second}}};
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  std::unique_ptr<files::Temporary> temporary;  // removed on a failure, or by a signal ending the command
  if (!direct) temporary = std::make_unique<files::Temporary>(path + ".tmp");
  const std::string& tmp = direct ? path : temporary->path();
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw SafetensorsError("cannot write " + tmp + ": " + std::strerror(errno));
    const uint64_t n = text.size();
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
    out.write(reinterpret_cast<const char*>(len), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const NamedTensor& t : tensors) out.write(t.data.data(), static_cast<std::streamsize>(t.data.size()));
    out.flush();
    if (!out) throw SafetensorsError("cannot write " + tmp + ": " + std::strerror(errno));
  }
  if (temporary && !temporary->commit(path))
    throw SafetensorsError("cannot rename " + tmp + " to " + path + ": " + std::strerror(errno));
}

namespace {

// The header's tensors (without their bytes) in the order of their data, which they tile
// exactly, with each one's [begin, end) in the data; refuses what does not describe a
// file of `data_size` bytes of data.
struct Header {
  SafetensorsFile file;
  std::vector<std::pair<uint64_t, uint64_t>> spans;
};
Header parse_header(const char* header_begin, uint64_t n, uint64_t data_size, const std::string& what) {
  const char* header_end = header_begin + n;
  if (std::find(header_begin, header_end, '\0') != header_end)
    throw SafetensorsError(fail_in(what, "the header holds NUL bytes (the format pads it with spaces only)"));
  // A name given twice would silently keep one of the two tensors.
  std::set<std::string> names;
  std::string duplicate;
  const nlohmann::json::parser_callback_t note_names = [&](int depth, nlohmann::json::parse_event_t event,
                                                           nlohmann::json& parsed) {
    if (depth == 1 && event == nlohmann::json::parse_event_t::key && !names.insert(parsed.get<std::string>()).second &&
        duplicate.empty())
      duplicate = parsed.get<std::string>();
    return true;
  };
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(header_begin, header_end, note_names);
  } catch (const nlohmann::json::exception& e) {
    throw SafetensorsError(fail_in(what, std::string("the header is not JSON: ") + e.what()));
  }
  if (!duplicate.empty()) throw SafetensorsError(fail_in(what, "the header names " + duplicate + " twice"));
  if (!header.is_object()) throw SafetensorsError(fail_in(what, "the header is not a JSON object"));
  SafetensorsFile out;
  struct Span {
    uint64_t begin, end;
    size_t index;
  };
  std::vector<Span> spans;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) throw SafetensorsError(fail_in(what, "__metadata__ is not an object of strings"));
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) throw SafetensorsError(fail_in(what, "__metadata__." + m.key() + " is not a string"));
        out.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& why) { return SafetensorsError(fail_in(what, "tensor " + name + ": " + why)); };
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
      throw bad("needs dtype, shape and data_offsets");
    if (!v["dtype"].is_string()) throw bad("dtype is not a string");
    NamedTensor t;
    t.name = name;
    t.dtype = v["dtype"].get<std::string>();
    const size_t es = safetensors_dtype_size(t.dtype);
    if (es == 0) throw bad("unknown dtype " + t.dtype);
    if (!v["shape"].is_array()) throw bad("shape is not an array");
    uint64_t count = 1;
    for (const auto& d : v["shape"]) {
      if (!d.is_number_unsigned()) throw bad("shape holds something other than a non-negative integer");
      const uint64_t dim = d.get<uint64_t>();
      if (dim != 0 && count > std::numeric_limits<uint64_t>::max() / dim / es) throw bad("shape overflows");
      count *= dim;
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    const nlohmann::json& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      throw bad("data_offsets is not two non-negative integers");
    const uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    if (b > e || e > data_size)
      throw bad("data_offsets [" + std::to_string(b) + ", " + std::to_string(e) + "] lie outside the " +
                std::to_string(data_size) + " bytes of data");
    if (e - b != count * es)
      throw bad("data_offsets span " + std::to_string(e - b) + " bytes, but shape x dtype is " +
                std::to_string(count * es));
    spans.push_back({b, e, out.tensors.size()});
    out.tensors.push_back(std::move(t));
  }
  // The tensors tile the data exactly: no overlap, no hole.
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  uint64_t at = 0;
  for (const Span& s : spans) {
    if (s.begin < at)
      throw SafetensorsError(fail_in(what, "tensor " + out.tensors[s.index].name + " overlaps the one before it"));
    if (s.begin > at)
      throw SafetensorsError(fail_in(what, "bytes [" + std::to_string(at) + ", " + std::to_string(s.begin) +
                                               ") of the data belong to no tensor"));
    at = s.end;
  }
  if (at != data_size)
    throw SafetensorsError(fail_in(what, "the last " + std::to_string(data_size - at) + " bytes belong to no tensor"));
  Header h;
  h.file.metadata = std::move(out.metadata);
  for (const Span& s : spans) {
    h.file.tensors.push_back(std::move(out.tensors[s.index]));
    h.spans.emplace_back(s.begin, s.end);
  }
  return h;
}

// The header length at the start of a file of `size` bytes, checked.
uint64_t header_length(const unsigned char* first8, uint64_t size, const std::string& what) {
  if (size < 8) throw SafetensorsError(fail_in(what, "shorter than the 8-byte header length"));
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(first8[i]) << (8 * i);
  if (n > kMaxHeader || n > size - 8)
    throw SafetensorsError(fail_in(what, "header length " + std::to_string(n) + " exceeds the file (" +
                                             std::to_string(size) + " bytes) or 100 MB"));
  return n;
}

}  // namespace

SafetensorsFile parse_safetensors(const std::vector<char>& bytes, const std::string& what) {
  const uint64_t n = header_length(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), what);
  Header h = parse_header(bytes.data() + 8, n, bytes.size() - 8 - n, what);
  const char* data = bytes.data() + 8 + n;
  for (size_t i = 0; i < h.spans.size(); ++i)
    h.file.tensors[i].data.assign(data + h.spans[i].first, data + h.spans[i].second);
  return std::move(h.file);
}



bool looks_like_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  boost::system::error_code ec;
  const uint64_t size = boost::filesystem::file_size(path, ec);
  unsigned char first8[8] = {};
  if (!in || ec || size < 8 || !in.read(reinterpret_cast<char*>(first8), 8)) return false;
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(first8[i]) << (8 * i);
  if (n == 0 || n > kMaxHeader || n > size - 8) return false;
  std::string header(n, '\0');
  if (!in.read(header.data(), static_cast<std::streamsize>(n))) return false;
  const nlohmann::json j = nlohmann::json::parse(header, nullptr, /*allow_exceptions=*/false);
  return j.is_object();
}

SafetensorsFile read_safetensors(const std::string& path) {
  if (!boost::filesystem::is_regular_file(path)) {
    const std::string index = path + ".index.json";  // save_pretrained's shards: model-00001-of-0000N.safetensors
    if (boost::filesystem::exists(index))
      throw SafetensorsError(path + " is split into shards (" + index + "): read the model's directory");
    throw SafetensorsError("cannot read " + path + (boost::filesystem::exists(path) ? ": not a regular file" : ""));
  }
  // The header, then each tensor's bytes read into it in turn (they tile the data in
  // order): the file is never held whole beside the tensors.
  std::ifstream in(path, std::ios::binary);
  if (!in) throw SafetensorsError("cannot read " + path);
  boost::system::error_code ec;
  const uint64_t size = boost::filesystem::file_size(path, ec);
  if (ec) throw SafetensorsError("cannot read " + path + ": " + ec.message());
  unsigned char first8[8] = {};
  in.read(reinterpret_cast<char*>(first8), size < 8 ? static_cast<std::streamsize>(size) : 8);
  const uint64_t n = header_length(first8, size, path);
  std::string header(n, '\0');
  in.read(header.data(), static_cast<std::streamsize>(n));
  if (!in) throw SafetensorsError("cannot read " + path + "'s header");
  Header h = parse_header(header.data(), n, size - 8 - n, path);
  for (size_t i = 0; i < h.spans.size(); ++i) {
    std::vector<char>& data = h.file.tensors[i].data;
    data.resize(h.spans[i].second - h.spans[i].first);
    in.read(data.data(), static_cast<std::streamsize>(data.size()));
    if (!in) throw SafetensorsError("cannot read " + path + " (tensor " + h.file.tensors[i].name + ")");
  }
  return std::move(h.file);
}

std::vector<NamedTensor> read_safetensors_model(const std::string& dir, std::string* source) {
  namespace fs = boost::filesystem;
  const std::string whole = (fs::path(dir) / "model.safetensors").string();
  const std::string index_path = whole + ".index.json";
  if (fs::is_regular_file(whole) || !fs::exists(index_path)) {
    if (source) *source = whole;
    if (!fs::exists(whole))
      throw SafetensorsError(dir + " has neither model.safetensors nor model.safetensors.index.json (a Hugging Face "
                             "model's weights)");
    return read_safetensors(whole).tensors;
  }
  if (source) *source = index_path;
  nlohmann::json index;
  try {
    std::ifstream in(index_path, std::ios::binary);
    if (!in) throw SafetensorsError("cannot read " + index_path);
    index = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw SafetensorsError(index_path + " is not JSON: " + e.what());
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object() ||
      index["weight_map"].empty())
    throw SafetensorsError(index_path + " has no weight_map (tensor name -> shard file)");
  std::vector<std::string> shards;  // in the order the index first names them
  std::map<std::string, std::string> shard_of;
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string() || file.get<std::string>().empty() ||
        fs::path(file.get<std::string>()).filename().string() != file.get<std::string>() || file == "." || file == "..")
      throw SafetensorsError(index_path + ": tensor " + name + "'s shard " + file.dump() +
                             " is not a file name in the model's directory");
    if (std::find(shards.begin(), shards.end(), file.get<std::string>()) == shards.end()) shards.push_back(file);
    shard_of[name] = file;
  }
  std::vector<NamedTensor> out;
  std::map<std::string, std::string> found;  // tensor -> the shard that holds it
  for (const std::string& shard : shards) {
    for (NamedTensor& t : read_safetensors((fs::path(dir) / shard).string()).tensors) {
      const auto listed = shard_of.find(t.name);
      if (listed == shard_of.end())
        throw SafetensorsError(shard + " holds " + t.name + ", which " + index_path + "'s weight_map does not list");
      if (listed->second != shard)
        throw SafetensorsError(shard + " holds " + t.name + ", which " + index_path + " puts in " + listed->second);
      if (!found.emplace(t.name, shard).second)
        throw SafetensorsError(shard + " holds " + t.name + " twice");
      out.push_back(std::move(t));
    }
  }
  for (const auto& [name, shard] : shard_of)
    if (!found.count(name))
      throw SafetensorsError(index_path + " puts " + name + " in " + shard + ", which does not hold it");
  return out;
}

}  // namespace loom::interop
