#include "engine/train/data.hpp"

#include "engine/files/read.hpp"

#include "engine/model/param_init.hpp"
#include "engine/text/token_files.hpp"
#include "engine/text/tokenizer.hpp"
#include "engine/train/blend.hpp"
#include "engine/train/chat_data.hpp"
#include "engine/train/documents.hpp"

#include <boost/filesystem.hpp>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace loom::train {
namespace {

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t z = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull + (a << 6) + (a >> 2));
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Addition with the answer written least-significant digit first (so the carry
// flows in generation order): "123+459=2850\n" means 123+459=0582. Several
// problems are packed per sequence; only answer tokens carry a loss. A problem
// belongs to the validation split iff a hash of its operands says so, so
// validation problems are never seen in training.
class AdditionTask : public DataSource {
 public:
  static constexpr int32_t kPlus = 10, kEquals = 11, kEnd = 12;
  AdditionTask(int digits, uint64_t seed) : digits_(digits), seed_(seed) {
    max_ = 1;
    for (int i = 0; i < digits; ++i) max_ *= 10;
  }
  int64_t vocab_size() const override { return 13; }
  std::string describe() const override {
    return "synthetic addition of " + std::to_string(digits_) + "-digit numbers (answers reversed), vocab 13";
  }
  bool has_exact_match() const override { return true; }
  std::string render(const int32_t* t, int64_t n) const override {
    std::string s;
    for (int64_t i = 0; i < n; ++i) s += t[i] < 10 ? char('0' + t[i]) : t[i] == kPlus ? '+' : t[i] == kEquals ? '=' : '|';
    return s;
  }
  std::vector<int32_t> encode(const std::string& text) const override {
    std::vector<int32_t> ids;
    for (char c : text) {
      if (c >= '0' && c <= '9') ids.push_back(c - '0');
      else if (c == '+') ids.push_back(kPlus);
      else if (c == '=') ids.push_back(kEquals);
      else if (c == '|') ids.push_back(kEnd);
      else
        throw DataError(std::string("the addition task has no token for '") + c + "' (its symbols: 0-9 + = |)");
    }
    return ids;
  }
  void sample(Split split, uint64_t index, int64_t seq, int32_t* tokens, int32_t* targets) const override {
    const int len = 3 * digits_ + 4;  // a + b = c(digits+1) end
    uint64_t state = mix(seed_ ^ (split == Split::Train ? 0x7261696eull : 0x76616c69ull), index);
    int64_t pos = 0;
    for (int i = 0; i < seq; ++i) {
      tokens[i] = kEnd;
      targets[i] = -1;
    }
    while (pos + len <= seq) {
      uint64_t a, b;
      do {  // draw until the problem is in this split
        state = mix(state, 1);
        a = state % max_;
        state = mix(state, 2);
        b = state % max_;
      } while (is_validation(a, b) != (split == Split::Validation));
      int32_t* t = tokens + pos;
      write_number(a, digits_, false, t);
      t[digits_] = kPlus;
      write_number(b, digits_, false, t + digits_ + 1);
      t[2 * digits_ + 1] = kEquals;
      write_number(a + b, digits_ + 1, true, t + 2 * digits_ + 2);
      t[len - 1] = kEnd;
      // Predict every answer digit and the end marker from the token before it.
      for (int j = 2 * digits_ + 1; j < len - 1; ++j) targets[pos + j] = tokens[pos + j + 1];
      pos += len;
    }
  }

 private:
  bool is_validation(uint64_t a, uint64_t b) const { return mix(a * max_ + b, 0xC0FFEE) % 10 == 0; }
  static void write_number(uint64_t v, int width, bool reversed, int32_t* out) {
    for (int i = 0; i < width; ++i) {
      int32_t d = static_cast<int32_t>(v % 10);
      v /= 10;
      out[reversed ? i : width - 1 - i] = d;
    }
  }
  int digits_;
  uint64_t seed_;
  uint64_t max_;
};

// A token stream split into train (first part) and validation (last part);
// sample i starts at a pseudo-random offset of its split.
class StreamSource : public DataSource {
 public:
  StreamSource(std::vector<int32_t> tokens, int64_t vocab, double val_fraction, uint64_t seed, std::string what,
               bool bytes)
      : tokens_(std::move(tokens)), vocab_(vocab), seed_(seed), what_(std::move(what)), bytes_(bytes) {
    split_at_ = static_cast<int64_t>(tokens_.size() * (1.0 - val_fraction));
  }
  int64_t vocab_size() const override { return vocab_; }
  std::string describe() const override {
    return what_ + ": " + std::to_string(tokens_.size()) + " tokens (" + std::to_string(split_at_) + " train), vocab " +
           std::to_string(vocab_);
  }
  std::string render(const int32_t* t, int64_t n) const override {
    if (!bytes_) return DataSource::render(t, n);
    std::string s;
    for (int64_t i = 0; i < n; ++i) s += (t[i] >= 32 && t[i] < 127) ? char(t[i]) : ' ';
    return s;
  }
  void sample(Split split, uint64_t index, int64_t seq, int32_t* tokens, int32_t* targets) const override {
    const int64_t begin = split == Split::Train ? 0 : split_at_;
    const int64_t end = split == Split::Train ? split_at_ : static_cast<int64_t>(tokens_.size());
    const int64_t span = end - begin - seq;  // starts whose seq + 1 tokens fit the split
    if (span <= 0)
      throw DataError(what_ + ": the " + std::string(split == Split::Train ? "training" : "validation") +
                      " split has " + std::to_string(end - begin) + " tokens, fewer than seq_length + 1 = " +
                      std::to_string(seq + 1) + "; use more data, a shorter model.seq_length or another data.val_fraction");
    const int64_t start = begin + static_cast<int64_t>(mix(seed_ + (split == Split::Train ? 0 : 1), index) % span);
    for (int64_t i = 0; i < seq; ++i) {
      tokens[i] = tokens_[start + i];
      targets[i] = tokens_[start + i + 1];
    }
  }

 private:
  std::vector<int32_t> tokens_;
  int64_t vocab_;
  uint64_t seed_;
  std::string what_;
  bool bytes_;
  int64_t split_at_ = 0;
};

std::vector<char> read_file(const std::string& path, const std::string& key) {
  // The manifest key that named the file, for messages.
  const std::string named = key == "blend"             ? "data.blend's \"" + path + "\""
                            : key.rfind("--", 0) == 0 ? key + " " + path  // a command-line option
                                                      : "data." + key + " = \"" + path + "\"";
  // Only a regular file: a FIFO would block the read where no signal is looked at,
  // a directory or a device reads as nonsense.
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    throw DataError(named + " is not a regular file (" + files::not_regular_kind(st.st_mode) +
                    "); give a text or token file");
  // POSIX reads, so a read error (EIO: /proc/self/mem, a failing disk) is reported with
  // the path rather than thrown from inside std::filebuf.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw DataError(named + ": cannot open the file (" + std::strerror(errno) + ")");
  std::vector<char> bytes;
  std::string failure;
  try {
    if (st.st_size > 0) bytes.reserve(static_cast<size_t>(st.st_size));
    char chunk[1 << 16];
    for (;;) {
      const ssize_t n = ::read(fd, chunk, sizeof chunk);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        failure = std::string("reading the file failed (") + std::strerror(errno) + ")";
        break;
      }
      if (n == 0) break;
      bytes.insert(bytes.end(), chunk, chunk + n);
    }
  } catch (const std::bad_alloc&) {
    failure = "not enough memory to hold the file (" + std::to_string(st.st_size >> 20) + " MiB)";
  }
  ::close(fd);
  if (!failure.empty()) throw DataError(named + ": " + failure);
  return bytes;
}


// The largest token must fit the vocabulary (model.vocab_size, or the data's own).
int64_t checked_vocab(const std::string& path, int32_t max_token, int64_t vocab) {
  if (vocab == 0) vocab = max_token + 1;
  if (max_token >= vocab)
    throw DataError(path + ": token " + std::to_string(max_token) + " is outside the vocabulary of " +
                    std::to_string(vocab) + " (model.vocab_size, or data.tokenizer's)");
  return vocab;
}

// Token files' vocabulary: model.vocab_size, else data.tokenizer's, else 0 (the data's
// largest id + 1). A vocabulary smaller than the tokenizer's is refused: the tokenizer
// would make ids the model has no rows for.
int64_t token_vocab(const manifest::RunConfig& config) {
  const int64_t vocab = config.model.vocab_size;
  const std::string& path = config.data.tokenizer;
  if (path.empty()) return vocab;
  int64_t tokenizer_vocab = 0;
  try {
    tokenizer_vocab = text::load_tokenizer(path)->vocab_size();
  } catch (const text::TokenizerError& e) {
    throw DataError(std::string("data.tokenizer: ") + e.what());
  }
  if (vocab > 0 && vocab < tokenizer_vocab)
    throw DataError("model.vocab_size = " + std::to_string(vocab) + " is smaller than data.tokenizer's " +
                    std::to_string(tokenizer_vocab) + " tokens (" + path + "); leave it 0 to take the tokenizer's");
  return vocab > 0 ? vocab : tokenizer_vocab;
}

// kind "tokens": an llm.c file as one stream; "indexed": Megatron's documents.
std::unique_ptr<DataSource> token_source(const std::string& kind, const std::string& path, const std::string& key,
                                         int64_t vocab, double val_fraction, uint64_t seed) {
  int32_t max_token = 0;
  if (kind == "tokens") {
    std::vector<int32_t> tokens = read_llmc_tokens(path, key);
    for (int32_t t : tokens) max_token = std::max(max_token, t);
    vocab = checked_vocab(path, max_token, vocab);
    return std::make_unique<StreamSource>(std::move(tokens), vocab, val_fraction, seed, path, false);
  }
  std::vector<std::vector<int32_t>> docs;
  try {
    docs = text::IndexedDataset::read(path).documents;
  } catch (const text::TokenFileError& e) {
    throw DataError(key + " = " + path + " (an indexed dataset, PREFIX.bin + PREFIX.idx: loom preprocess writes "
                    "one): " + e.what());
  }
  int64_t n = 0;
  for (const auto& d : docs) {
    n += static_cast<int64_t>(d.size());
    for (int32_t t : d) max_token = std::max(max_token, t);
  }
  if (n < 2) throw DataError(path + ".bin: the indexed dataset holds fewer than 2 tokens");
  vocab = checked_vocab(path, max_token, vocab);
  return std::make_unique<DocumentSource>(std::move(docs), vocab, val_fraction, seed, path);
}

std::unique_ptr<DataSource> unmasked_data_source(const manifest::RunConfig& config) {
  const std::string& kind = config.data.kind;
  const uint64_t seed = static_cast<uint64_t>(config.run.seed);
  const double val_fraction = config.data.val_fraction;
  if (kind == "synthetic") {
    const std::string& task = config.data.task;
    if (task != "add") throw DataError("data.task = \"" + task + "\" is not a synthetic task; valid: \"add\"");
    return std::make_unique<AdditionTask>(static_cast<int>(config.data.digits), seed);
  }
  const std::string& path = config.data.path;
  if (kind == "text") {
    std::vector<char> bytes = read_file(path, "path");
    if (bytes.empty()) throw DataError(path + ": the text file is empty");
    std::vector<int32_t> tokens;
    try {
      tokens.resize(bytes.size());
    } catch (const std::bad_alloc&) {
      throw DataError(path + ": not enough memory for its " + std::to_string(bytes.size()) + " tokens (" +
                      std::to_string(bytes.size() * sizeof(int32_t) >> 20) + " MiB)");
    }
    for (size_t i = 0; i < bytes.size(); ++i) tokens[i] = static_cast<unsigned char>(bytes[i]);
    return std::make_unique<StreamSource>(std::move(tokens), 256, val_fraction, seed, path + " (bytes)", true);
  }
  const int64_t vocab = token_vocab(config);
  if ((kind == "tokens" || kind == "indexed") && !config.data.blend.empty()) {
    std::vector<std::unique_ptr<DataSource>> parts;
    std::vector<double> weights;
    for (const auto& [weight, part] : config.data.blend) {
      parts.push_back(token_source(kind, part, "blend", vocab, val_fraction, seed));
      weights.push_back(weight);
    }
    return std::make_unique<BlendedSource>(std::move(parts), std::move(weights));
  }
  if (kind == "tokens" || kind == "indexed")
    return token_source(kind, path, "path", vocab, val_fraction, seed);
  if (kind == "chat") return chat_source(config, vocab);
  throw DataError("data.kind = \"" + kind + "\" is unknown; valid: \"synthetic\", \"text\", \"tokens\", \"indexed\", "
                  "\"chat\"");
}

// Megatron-LM's --eod-mask-loss: no loss at a position whose input token ends a
// document, so a sample packing several documents does not learn to guess the next
// document's first token from the end of the one before.
class EodLossMask : public DataSource {
 public:
  EodLossMask(std::unique_ptr<DataSource> inner, int32_t eod) : inner_(std::move(inner)), eod_(eod) {}
  int64_t vocab_size() const override { return inner_->vocab_size(); }
  std::string describe() const override {
    return inner_->describe() + "; no loss after end-of-document token " + std::to_string(eod_);
  }
  void sample(Split split, uint64_t index, int64_t seq, int32_t* tokens, int32_t* targets) const override {
    inner_->sample(split, index, seq, tokens, targets);
    for (int64_t s = 0; s < seq; ++s)
      if (tokens[s] == eod_) targets[s] = -1;
  }
  void check_split(Split split, int64_t seq) const override { inner_->check_split(split, seq); }
  std::string warning(int64_t seq) const override { return inner_->warning(seq); }
  std::vector<int32_t> sample_prompt(Split split, uint64_t index, int64_t seq) const override {
    return inner_->sample_prompt(split, index, seq);
  }
  bool has_exact_match() const override { return inner_->has_exact_match(); }
  std::string render(const int32_t* tokens, int64_t n) const override { return inner_->render(tokens, n); }
  std::vector<int32_t> encode(const std::string& text) const override { return inner_->encode(text); }

 private:
  std::unique_ptr<DataSource> inner_;
  int32_t eod_;
};

}  // namespace

std::vector<int32_t> read_llmc_tokens(const std::string& path, const std::string& key) {
  std::vector<char> bytes = read_file(path, key);
  constexpr size_t kHeader = 256 * sizeof(int32_t);
  if (bytes.size() < kHeader)
    throw DataError(path + ": truncated token file (" + std::to_string(bytes.size()) +
                    " bytes, smaller than the 1024-byte llm.c header)");
  int32_t header[256];
  std::memcpy(header, bytes.data(), kHeader);
  if (header[0] != 20240520)
    throw DataError(path + ": not an llm.c token file (magic " + std::to_string(header[0]) + ", expected 20240520)");
  if (header[1] != 1)
    throw DataError(path + ": llm.c token file version " + std::to_string(header[1]) + " is not supported (expected 1)");
  const int64_t n = header[2];
  if (n <= 0)
    throw DataError(path + ": the llm.c token file holds no tokens (its header says " + std::to_string(n) + ")");
  const size_t want = kHeader + static_cast<size_t>(n) * sizeof(uint16_t);
  if (bytes.size() != want)
    throw DataError(path + ": truncated or padded token file: header says " + std::to_string(n) + " tokens (" +
                    std::to_string(want) + " bytes) but the file has " + std::to_string(bytes.size()) + " bytes");
  std::vector<int32_t> tokens(n);
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data() + kHeader);
  for (int64_t i = 0; i < n; ++i) tokens[i] = p[2 * i] | (p[2 * i + 1] << 8);
  return tokens;
}

std::string DataSource::render(const int32_t* tokens, int64_t n) const {
  std::string s;
  for (int64_t i = 0; i < n; ++i) s += (i ? " " : "") + std::to_string(tokens[i]);
  return s;
}

std::string DataSource::warning(int64_t) const { return ""; }

std::vector<int32_t> DataSource::sample_prompt(Split split, uint64_t index, int64_t seq) const {
  std::vector<int32_t> tokens(static_cast<size_t>(seq)), targets(tokens.size());
  sample(split, index, seq, tokens.data(), targets.data());
  tokens.resize(static_cast<size_t>(std::max<int64_t>(1, seq / 4)));
  return tokens;
}

void DataSource::check_split(Split split, int64_t seq) const {
  std::vector<int32_t> tokens(static_cast<size_t>(seq)), targets(static_cast<size_t>(seq));
  sample(split, 0, seq, tokens.data(), targets.data());
}

std::vector<int32_t> DataSource::encode(const std::string&) const {
  throw DataError(describe() + ": its tokens have no text form here; give a tokenizer");
}

std::unique_ptr<DataSource> make_data_source(const manifest::RunConfig& config) {
  std::unique_ptr<DataSource> source = unmasked_data_source(config);
  if (!config.data.eod_mask_loss) return source;
  if (config.data.kind == "synthetic")
    throw DataError("data.eod_mask_loss masks the loss after end-of-document tokens; data.kind = \"synthetic\" has "
                    "no documents");
  const int32_t eod = end_of_document_token(config, source->vocab_size());
  return std::make_unique<EodLossMask>(std::move(source), eod);
}

namespace {

// Conversations end with a token their template does not write (an Instruct
// tokenizer's eos is its end of turn, which would split every turn into a document).
int32_t conversation_end(const manifest::RunConfig& config, const text::Tokenizer& tokenizer) {
  const text::ChatTemplate chat = chat_template_of(config);
  const int32_t eod = chat.end_of_conversation(tokenizer);
  if (eod < 0)
    throw DataError("data.tokenizer (" + config.data.tokenizer + ") has no token to end a conversation with that "
                    "chat template " + chat.name() + " does not write inside one (its eos ends every turn); set "
                    "data.eod_token");
  return eod;
}

}  // namespace

int32_t end_of_document_token(const manifest::RunConfig& config, int64_t vocab) {
  int64_t eod = config.data.eod_token;
  if (eod < 0 && !config.data.tokenizer.empty()) {
    try {
      const std::unique_ptr<text::Tokenizer> tokenizer = text::load_tokenizer(config.data.tokenizer);
      eod = config.data.kind == "chat" ? conversation_end(config, *tokenizer) : tokenizer->eod();
    } catch (const text::TokenizerError& e) {
      throw DataError(std::string("data.tokenizer: ") + e.what());
    }
    if (eod < 0)
      throw DataError("data.tokenizer (" + config.data.tokenizer +
                      ") has no end-of-document token; set data.eod_token");
  }
  if (eod < 0) throw DataError("the end-of-document token is unknown: set data.tokenizer or data.eod_token");
  if (eod >= vocab)
    throw DataError((config.data.eod_token >= 0 ? "data.eod_token = " + std::to_string(eod)
                                                : "data.tokenizer's end-of-document token " + std::to_string(eod)) +
                    " is outside the vocabulary of " + std::to_string(vocab) + " tokens");
  return static_cast<int32_t>(eod);
}

int32_t document_end_for(const manifest::RunConfig& config, int64_t vocab) {
  if (!config.data.documents()) return -1;
  if (config.data.kind == "synthetic")
    throw DataError("data.reset_attention_mask and data.reset_position_ids look for end-of-document tokens; "
                    "data.kind = \"synthetic\" has no documents");
  return end_of_document_token(config, vocab);
}

DocumentInputs document_inputs(const manifest::RunConfig& config, int64_t vocab) {
  DocumentInputs d;
  d.end_of_document = document_end_for(config, vocab);
  d.starts = config.data.reset_attention_mask;
  d.positions = config.data.reset_position_ids;
  return d;
}

std::string documents_text(const DocumentInputs& d) {
  if (!d.starts && !d.positions) return "";
  std::string s = "; documents end at token " + std::to_string(d.end_of_document) + ": ";
  if (d.starts) s += "attention within each";
  if (d.starts && d.positions) s += ", ";
  if (d.positions) s += "positions from each start";
  return s;
}

std::string end_token_unseen(const DataSource& data, const manifest::RunConfig& config, int64_t vocab) {
  if (!config.data.eod_mask_loss && !config.data.documents()) return "";
  const int32_t eod = end_of_document_token(config, vocab);
  constexpr int kSamples = 64;
  const int64_t seq = config.model.seq_length;
  std::vector<int32_t> tokens(static_cast<size_t>(seq)), targets(tokens.size());
  for (int i = 0; i < kSamples; ++i) {
    data.sample(Split::Train, static_cast<uint64_t>(i), seq, tokens.data(), targets.data());
    if (std::find(tokens.begin(), tokens.end(), eod) != tokens.end()) return "";
  }
  return "the end-of-document token " + std::to_string(eod) + " occurs in none of the first " +
         std::to_string(kSamples) + " training sequences, so data.eod_mask_loss and data.reset_* change nothing "
         "there (token files made without loom preprocess --append-eod have none)";
}

std::vector<int32_t> document_starts(const std::vector<int32_t>& tokens, int64_t seq, int64_t micro_batch,
                                     int32_t end_of_document) {
  std::vector<int32_t> starts(tokens.size());
  for (int64_t b = 0; b < micro_batch; ++b) {
    int32_t start = 0;
    for (int64_t s = 0; s < seq; ++s) {
      const size_t at = static_cast<size_t>(s * micro_batch + b);
      starts[at] = start;
      if (tokens[at] == end_of_document) start = static_cast<int32_t>(s + 1);
    }
  }
  return starts;
}

std::vector<int32_t> document_positions(const std::vector<int32_t>& starts, int64_t micro_batch) {
  std::vector<int32_t> positions(starts.size());
  for (size_t i = 0; i < starts.size(); ++i)
    positions[i] = static_cast<int32_t>(static_cast<int64_t>(i) / micro_batch) - starts[i];
  return positions;
}

void fill_microbatch(const DataSource& src, Split split, uint64_t first_sample, int64_t micro_batch, int64_t seq,
                     int32_t* tokens, int32_t* targets) {
  std::vector<int32_t> t(seq), g(seq);
  for (int64_t b = 0; b < micro_batch; ++b) {
    src.sample(split, first_sample + b, seq, t.data(), g.data());
    for (int64_t s = 0; s < seq; ++s) {
      tokens[s * micro_batch + b] = t[s];
      targets[s * micro_batch + b] = g[s];
    }
  }
}

}  // namespace loom::train
