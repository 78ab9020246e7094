#include "engine/text/tokenizer.hpp"

#include "engine/files/temporaries.hpp"

#include "engine/text/gpt2_tokenizer.hpp"
#include "engine/text/hf_tokenizer.hpp"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cerrno>
#include <cstring>
#include <sstream>
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <boost/filesystem.hpp>

#include <unordered_map>

namespace loom::text {

namespace {

class SentencePieceTokenizer : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& path) : path_(path) {
    const auto status = sp_.Load(path);
    if (status.ok()) return;
    if (status.ToString().find("ParseFromArray") != std::string::npos)  // the bytes are not a model
      throw TokenizerError(path + ": not a SentencePiece model (a .model file, as loom tokenizer-train or "
                           "spm_train write) nor a GPT-2 BPE directory (encoder.json and vocab.bpe)");
    throw TokenizerError(path + ": not a SentencePiece model (" + status.ToString() + ")");
  }
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int> ids;
    const auto status = sp_.Encode(std::string(text), &ids);
    if (!status.ok()) throw TokenizerError(path_ + ": encoding failed (" + status.ToString() + ")");
    return {ids.begin(), ids.end()};
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    for (int32_t id : ids)
      if (id < 0 || id >= vocab_size())
        throw TokenizerError(path_ + ": id " + std::to_string(id) + " is outside the vocabulary of " +
                             std::to_string(vocab_size()));
    std::string out;
    const auto status = sp_.Decode(std::vector<int>(ids.begin(), ids.end()), &out);
    if (!status.ok()) throw TokenizerError(path_ + ": decoding failed (" + status.ToString() + ")");
    return out;
  }
  int32_t vocab_size() const override { return sp_.GetPieceSize(); }
  int32_t eod() const override { return sp_.eos_id(); }
  int32_t bos() const override { return sp_.bos_id(); }
  int32_t unk() const override { return sp_.unk_id(); }
  std::string piece(int32_t id) const override {
    if (id < 0 || id >= vocab_size())
      throw TokenizerError(path_ + ": id " + std::to_string(id) + " is outside the vocabulary of " +
                           std::to_string(vocab_size()));
    return sp_.IdToPiece(id);
  }
  std::string describe() const override {
    return "SentencePiece (" + std::to_string(vocab_size()) + " tokens) from " + path_;
  }

 private:
  std::string path_;
  sentencepiece::SentencePieceProcessor sp_;
};

// The longest line of the files, in bytes (SentencePiece skips longer lines than its
// max_sentence_length; loom trains on every line).
size_t longest_line(const std::vector<std::string>& files) {
  size_t longest = 0;
  for (const std::string& f : files) {
    std::FILE* in = std::fopen(f.c_str(), "rb");
    if (in == nullptr) throw TokenizerError(f + ": cannot read the training text (" + std::strerror(errno) + ")");
    char chunk[1 << 16];
    size_t line = 0, n = 0;
    while ((n = std::fread(chunk, 1, sizeof chunk, in)) > 0)
      for (size_t i = 0; i < n; ++i) {
        if (chunk[i] == '\n') line = 0;
        else longest = std::max(longest, ++line);
      }
    std::fclose(in);
  }
  return longest;
}

// SentencePiece's "Vocabulary size too high (1000). Please set it to a value <= 651."
// as what to do; "" for another message.
std::string vocab_too_high(const std::string& message) {
  const std::string marker = "Please set it to a value <= ";
  const size_t at = message.find(marker);
  if (at == std::string::npos) return "";
  std::istringstream number(message.substr(at + marker.size()));
  int64_t most = 0;
  if (!(number >> most)) return "";
  return "the text has too few distinct pieces for the vocabulary asked: give a vocabulary size of at most " +
         std::to_string(most) + ", or more text";
}

}  // namespace

TokenizerSource tokenizer_source(const std::string& path) {
  namespace fs = boost::filesystem;
  if (fs::is_directory(path)) {
    const fs::path dir(path);
    // A directory with neither file below is read as GPT-2's: its error names encoder.json.
    // tokenizer.model first: Llama 2's, Mistral's and Gemma's directories ship a
    // tokenizer.json of the same SentencePiece model beside it (byte-fallback BPE).
    if (!fs::exists(dir / "encoder.json") && fs::is_regular_file(dir / "tokenizer.model"))
      return {TokenizerFormat::SentencePiece, (dir / "tokenizer.model").string()};
    if (!fs::exists(dir / "encoder.json") && fs::is_regular_file(dir / "tokenizer.json"))
      return {TokenizerFormat::HuggingFaceJson, (dir / "tokenizer.json").string()};
    return {TokenizerFormat::Gpt2Bpe, path};
  }
  if (fs::is_regular_file(path))
    return {fs::path(path).extension() == ".json" ? TokenizerFormat::HuggingFaceJson : TokenizerFormat::SentencePiece,
            path};
  throw TokenizerError(path + ": no such tokenizer: give a directory with GPT-2's encoder.json and vocab.bpe "
                              "(scripts/fetch-gpt2-tokenizer.sh fetches them), a Hugging Face model directory or "
                              "tokenizer.json, or a SentencePiece .model file (loom tokenizer-train makes one)");
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path) {
  const TokenizerSource s = tokenizer_source(path);
  switch (s.format) {
    case TokenizerFormat::Gpt2Bpe: return std::make_unique<Gpt2Tokenizer>(Gpt2Tokenizer::load(s.file));
    case TokenizerFormat::HuggingFaceJson: return std::make_unique<HfTokenizer>(HfTokenizer::load(s.file));
    case TokenizerFormat::SentencePiece: break;
  }
  return std::make_unique<SentencePieceTokenizer>(s.file);
}

bool same_vocabulary(const Tokenizer& a, const Tokenizer& b) {
  if (a.vocab_size() != b.vocab_size()) return false;
  for (int32_t id = 0; id < a.vocab_size(); ++id)
    if (a.piece(id) != b.piece(id)) return false;
  return true;
}

void train_sentencepiece(const SentencePieceTraining& how) {
  if (how.inputs.empty()) throw TokenizerError("training a SentencePiece model needs at least one input file");
  std::string inputs;
  for (const std::string& f : how.inputs) {
    if (!boost::filesystem::is_regular_file(f)) throw TokenizerError(f + ": cannot read the training text");
    for (const std::string& out : {how.model_prefix + ".model", how.model_prefix + ".vocab"}) {
      boost::system::error_code ec;
      if (boost::filesystem::equivalent(f, out, ec) && !ec)
        throw TokenizerError("the model would be written over " + out + ", which is the input " + f +
                             ": choose another --model-prefix");
    }
    if (f.find(',') != std::string::npos)
      throw TokenizerError(f + ": SentencePiece's trainer takes its inputs as one comma-separated list, so a path "
                               "with a comma cannot be given; rename or link the file");
    inputs += (inputs.empty() ? "" : ",") + f;
  }
  const boost::filesystem::path prefix_dir = boost::filesystem::path(how.model_prefix).parent_path();
  if (!prefix_dir.empty() && !boost::filesystem::is_directory(prefix_dir))
    throw TokenizerError(how.model_prefix + ": the directory " + prefix_dir.string() +
                         " does not exist (the model is written as PREFIX.model and PREFIX.vocab)");
  for (const char* ext : {".model", ".vocab"})
    if (boost::filesystem::is_directory(how.model_prefix + ext))
      throw TokenizerError(how.model_prefix + ext + " is a directory; the model is written as PREFIX.model and "
                           "PREFIX.vocab: remove it or choose another --model-prefix");
  // Both files are trained under a temporary prefix, then renamed: a failure leaves
  // neither (nor an earlier pair half replaced), a signal ending the command no temporary.
  const std::string staging = how.model_prefix + ".training";
  files::Temporary model(staging + ".model"), vocab(staging + ".vocab");
  const std::unordered_map<std::string, std::string> args = {
      {"input", inputs},
      {"model_prefix", staging},
      {"vocab_size", std::to_string(how.vocab_size)},
      {"model_type", how.model_type},
      {"character_coverage", std::to_string(how.character_coverage)},
      {"num_threads", std::to_string(how.threads)},
      {"max_sentence_length", std::to_string(std::max<size_t>(4192, std::min<size_t>(longest_line(how.inputs), INT32_MAX)))},
      // As Llama's tokenizer: any text encodes (unknown characters as their bytes), and
      // text is kept as written (no NFKC folding, white space kept), so decode(encode(s)) == s.
      {"byte_fallback", "true"},
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"minloglevel", "2"},
  };
  const auto status = sentencepiece::SentencePieceTrainer::Train(args);
  if (!status.ok() && status.ToString().find("!sentences_.empty()") != std::string::npos)
    throw TokenizerError("no training text in " + inputs + " (blank lines are skipped)");
  if (!status.ok()) {
    // "Vocabulary size is smaller than required_chars. 300 vs 316."
    const std::string text = status.ToString(), marker = "smaller than required_chars. ";
    if (const size_t at = text.find(marker); at != std::string::npos) {
      std::istringstream numbers(text.substr(at + marker.size()));
      int64_t asked = 0, needed = 0;
      std::string vs;
      if (numbers >> asked >> vs >> needed && vs == "vs")
        throw TokenizerError("a vocabulary of " + std::to_string(asked) + " tokens is smaller than the " +
                             std::to_string(needed) + " it needs before any merge: one for each distinct character "
                             "of the text, the 256 byte-fallback tokens and the special tokens; give a vocabulary "
                             "size of at least " + std::to_string(needed) + ", or a lower character coverage");
    }
    if (const std::string what = vocab_too_high(text); !what.empty()) throw TokenizerError(what);
    throw TokenizerError("training the SentencePiece model failed: " + text);
  }
  const std::string final_model = how.model_prefix + ".model", final_vocab = how.model_prefix + ".vocab";
  if (const std::string why = files::commit_together({{&model, final_model}, {&vocab, final_vocab}}); !why.empty())
    throw TokenizerError(why);  // not one file of the pair without the other
}

}  // namespace loom::text
