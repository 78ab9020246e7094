#include "engine/text/token_files.hpp"

#include "engine/files/read.hpp"
#include "engine/files/temporaries.hpp"

#include <cerrno>
#include <climits>
#include <cstring>
#include <unistd.h>

namespace loom::text {

namespace {

constexpr char kIndexMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr uint64_t kIndexVersion = 1;
// Megatron's DType codes.
constexpr uint8_t kCodeI32 = 4, kCodeU16 = 8;

size_t item_size(TokenType t) { return t == TokenType::U16 ? 2 : 4; }

// Little-endian bytes of an integer (the format's byte order on every host).
template <typename T>
void put(std::string& out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) out += static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff);
}
template <typename T>
T get(const std::string& in, size_t& at, const std::string& path) {
  if (at + sizeof(T) > in.size()) throw TokenFileError(path + ": truncated (ends inside its header or tables)");
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(in[at + i])) << (8 * i);
  at += sizeof(T);
  return static_cast<T>(v);
}

std::string errno_text() { return std::strerror(errno); }

// Writes `bytes` to `tmp` and flushes it to disk; removes it and throws on failure.
void write_synced(const std::string& tmp, const std::string& bytes) {
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) throw TokenFileError(tmp + ": cannot open for writing (" + errno_text() + ")");
  const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size() && std::fflush(f) == 0 &&
                  ::fsync(fileno(f)) == 0;
  const std::string why = errno_text();
  std::fclose(f);
  if (!ok) {
    std::remove(tmp.c_str());
    throw TokenFileError(tmp + ": writing failed (" + why + ")");
  }
}

// Writes `bytes` to PATH.tmp, flushes it to disk and renames it to PATH.
void write_file_atomically(const std::string& path, const std::string& bytes) {
  files::Temporary tmp(path + ".tmp");  // a signal ending the command removes it
  write_synced(tmp.path(), bytes);
  if (!tmp.commit(path))
    throw TokenFileError(path + ": cannot rename the finished file into place (" + errno_text() + ")");
}

std::string read_file(const std::string& path) {
  std::string why;
  std::optional<std::string> bytes = files::read_whole_file(path, &why);
  if (!bytes) throw TokenFileError(path + ": cannot read the file (" + why + ")");
  return std::move(*bytes);
}

void append_tokens(std::string& out, const std::vector<int32_t>& tokens, TokenType type, const std::string& where) {
  for (int32_t t : tokens) {
    if (type == TokenType::U16) {
      if (t < 0 || t > 0xffff)
        throw TokenFileError(where + ": token " + std::to_string(t) + " does not fit uint16 (a vocabulary of 65500 "
                             "or more tokens is written as int32)");
      put<uint16_t>(out, static_cast<uint16_t>(t));
    } else {
      put<int32_t>(out, t);
    }
  }
}

}  // namespace

TokenType token_type_for(int64_t vocab_size) { return vocab_size < 65500 ? TokenType::U16 : TokenType::I32; }

IndexedDatasetWriter::IndexedDatasetWriter(const std::string& prefix, TokenType type) : prefix_(prefix), type_(type) {
  bin_tmp_ = std::make_unique<files::Temporary>(prefix_ + ".bin.tmp");  // removed by a stopping signal
  bin_ = std::fopen(bin_tmp_->path().c_str(), "wb");
  if (bin_ == nullptr) throw TokenFileError(bin_tmp_->path() + ": cannot open for writing (" + errno_text() + ")");
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (bin_ != nullptr) std::fclose(bin_);
}

void IndexedDatasetWriter::add_document(const std::vector<int32_t>& tokens) {
  std::string bytes;
  append_tokens(bytes, tokens, type_, prefix_ + ".bin");
  if (std::fwrite(bytes.data(), 1, bytes.size(), bin_) != bytes.size())
    throw TokenFileError(prefix_ + ".bin: writing failed (" + errno_text() + ")");
  if (!tokens.empty()) lengths_.push_back(static_cast<int32_t>(tokens.size()));
  doc_ends_.push_back(lengths_.size());
  tokens_ += static_cast<int64_t>(tokens.size());
}

void IndexedDatasetWriter::finish() {
  const bool flushed = std::fflush(bin_) == 0 && ::fsync(fileno(bin_)) == 0;
  std::fclose(bin_);
  bin_ = nullptr;
  if (!flushed) throw TokenFileError(prefix_ + ".bin: writing failed (" + errno_text() + ")");
  // The index: header, then per sequence its length and byte offset, then the
  // document boundaries (0, then the sequence count after each document).
  std::string idx(kIndexMagic, sizeof(kIndexMagic));
  put<uint64_t>(idx, kIndexVersion);
  put<uint8_t>(idx, type_ == TokenType::U16 ? kCodeU16 : kCodeI32);
  const auto n = static_cast<uint64_t>(lengths_.size());
  put<uint64_t>(idx, n);
  put<uint64_t>(idx, static_cast<uint64_t>(doc_ends_.size()) + 1);
  for (int32_t len : lengths_) put<int32_t>(idx, len);
  int64_t offset = 0;
  for (int32_t len : lengths_) {
    put<int64_t>(idx, offset);
    offset += static_cast<int64_t>(len) * static_cast<int64_t>(item_size(type_));
  }
  put<int64_t>(idx, 0);
  for (uint64_t end : doc_ends_) put<int64_t>(idx, static_cast<int64_t>(end));
  // Both files complete under their temporary names, then renamed as a pair: a failure
  // leaves the earlier dataset (or none) as it was.
  files::Temporary idx_tmp(prefix_ + ".idx.tmp");
  write_synced(idx_tmp.path(), idx);
  if (const std::string why =
          files::commit_together({{bin_tmp_.get(), prefix_ + ".bin"}, {&idx_tmp, prefix_ + ".idx"}});
      !why.empty())
    throw TokenFileError(why);
}

std::string indexed_prefix_hint(const std::string& prefix) {
  const std::string suffix = ".bin";
  if (::access((prefix + ".idx").c_str(), F_OK) == 0 || prefix.size() <= suffix.size() ||
      prefix.compare(prefix.size() - suffix.size(), suffix.size(), suffix) != 0)
    return "";
  return " (an indexed dataset is named by its prefix, without .bin: " +
         prefix.substr(0, prefix.size() - suffix.size()) + ")";
}

IndexedDataset IndexedDataset::read(const std::string& prefix) {
  const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
  if (const std::string hint = indexed_prefix_hint(prefix); !hint.empty())
    throw TokenFileError(idx_path + ": no such file" + hint);
  const std::string idx = read_file(idx_path), bin = read_file(bin_path);
  if (idx.size() < sizeof(kIndexMagic) || std::memcmp(idx.data(), kIndexMagic, sizeof(kIndexMagic)) != 0)
    throw TokenFileError(idx_path + ": not a Megatron indexed dataset index (no MMIDIDX header)");
  size_t at = sizeof(kIndexMagic);
  const auto version = get<uint64_t>(idx, at, idx_path);
  if (version != kIndexVersion)
    throw TokenFileError(idx_path + ": index version " + std::to_string(version) + ", this reader knows 1");
  IndexedDataset out;
  const auto code = get<uint8_t>(idx, at, idx_path);
  if (code != kCodeU16 && code != kCodeI32)
    throw TokenFileError(idx_path + ": token type code " + std::to_string(code) + " (this reader knows uint16 = 8 "
                         "and int32 = 4)");
  out.type = code == kCodeU16 ? TokenType::U16 : TokenType::I32;
  const auto sequences = get<uint64_t>(idx, at, idx_path), doc_entries = get<uint64_t>(idx, at, idx_path);
  if (sequences > idx.size() || doc_entries > idx.size() || doc_entries == 0)
    throw TokenFileError(idx_path + ": counts " + std::to_string(sequences) + " and " + std::to_string(doc_entries) +
                         " do not fit the file");
  std::vector<int32_t> lengths(sequences);
  std::vector<int64_t> offsets(sequences), docs(doc_entries);
  for (auto& v : lengths) v = get<int32_t>(idx, at, idx_path);
  for (auto& v : offsets) v = get<int64_t>(idx, at, idx_path);
  for (auto& v : docs) v = get<int64_t>(idx, at, idx_path);
  const size_t es = item_size(out.type);
  // Megatron's writer lays the sequences back to back: each pointer is where the
  // previous sequence ends, so a damaged index is caught here, not read as tokens.
  for (size_t s = 0; s < lengths.size(); ++s) {
    const int64_t want = s == 0 ? 0 : offsets[s - 1] + static_cast<int64_t>(lengths[s - 1]) * static_cast<int64_t>(es);
    if (lengths[s] < 0 || offsets[s] != want)
      throw TokenFileError(idx_path + ": sequence " + std::to_string(s) + " has length " + std::to_string(lengths[s]) +
                           " at byte " + std::to_string(offsets[s]) + ", expected a length >= 0 at byte " +
                           std::to_string(want) + " (the sequences lie back to back)");
  }
  // The whole index describes the whole .bin, as Megatron's writer leaves them: the
  // document index runs from sequence 0 to the last, nothing follows it, and the
  // sequences end where the .bin ends (a .bin of another dataset, or an llm.c file
  // written under the same prefix, is refused rather than read as these tokens).
  if (at != idx.size())
    throw TokenFileError(idx_path + ": " + std::to_string(idx.size() - at) +
                         " bytes follow the document index (is it another dataset's index?)");
  if (docs.front() != 0 || static_cast<uint64_t>(docs.back()) != sequences)
    throw TokenFileError(idx_path + ": the document index runs from sequence " + std::to_string(docs.front()) +
                         " to " + std::to_string(docs.back()) + ", not from 0 to the " + std::to_string(sequences) +
                         " sequences");
  const uint64_t described =
      lengths.empty() ? 0 : static_cast<uint64_t>(offsets.back()) + static_cast<uint64_t>(lengths.back()) * es;
  if (described != bin.size())
    throw TokenFileError(bin_path + " holds " + std::to_string(bin.size()) + " bytes but " + idx_path + " describes " +
                         std::to_string(described) + " (are they the files of one dataset?)");
  for (size_t d = 0; d + 1 < docs.size(); ++d) {
    if (docs[d] < 0 || docs[d] > docs[d + 1] || static_cast<uint64_t>(docs[d + 1]) > sequences)
      throw TokenFileError(idx_path + ": document " + std::to_string(d) + " has sequences " + std::to_string(docs[d]) +
                           ".." + std::to_string(docs[d + 1]) + " of " + std::to_string(sequences));
    std::vector<int32_t> tokens;
    for (int64_t s = docs[d]; s < docs[d + 1]; ++s) {
      const auto k = static_cast<size_t>(s);
      if (lengths[k] < 0 || offsets[k] < 0 ||
          static_cast<uint64_t>(offsets[k]) + static_cast<uint64_t>(lengths[k]) * es > bin.size())
        throw TokenFileError(bin_path + ": sequence " + std::to_string(s) + " lies outside the file");
      size_t pos = static_cast<size_t>(offsets[k]);
      for (int32_t i = 0; i < lengths[k]; ++i)
        tokens.push_back(out.type == TokenType::U16 ? static_cast<int32_t>(get<uint16_t>(bin, pos, bin_path))
                                                    : get<int32_t>(bin, pos, bin_path));
    }
    out.documents.push_back(std::move(tokens));
  }
  return out;
}

void write_llmc_tokens(const std::string& path, const std::vector<int32_t>& tokens) {
  if (tokens.size() > static_cast<size_t>(INT32_MAX))
    throw TokenFileError(path + ": " + std::to_string(tokens.size()) +
                         " tokens do not fit llm.c's header (an int32 count); write Megatron's format or split the input");
  std::string bytes;
  int32_t header[256] = {};
  header[0] = 20240520;
  header[1] = 1;
  header[2] = static_cast<int32_t>(tokens.size());
  for (int32_t h : header) put<int32_t>(bytes, h);
  append_tokens(bytes, tokens, TokenType::U16, path);
  write_file_atomically(path, bytes);
}

}  // namespace loom::text
