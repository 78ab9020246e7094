// loom preprocess --tokenizer DIR --input FILE... --output-prefix PREFIX [options]
// loom tokenize --tokenizer DIR (--text TEXT | --file FILE) [--decode]
// loom tokenizer-train --input FILE... --model-prefix PREFIX --vocab-size N
// Text to token files, as Megatron-LM's tools/preprocess_data.py does: each line of
// a JSONL file (its --json-key field) or each whole text file is one document,
// encoded on several threads and written in input order.
#include "engine/cli/args.hpp"
#include "engine/cli/commands.hpp"
#include "engine/files/json_lines.hpp"
#include "engine/files/read.hpp"
#include "engine/files/temporaries.hpp"
#include "engine/runtime/json.hpp"
#include "engine/runtime/launcher.hpp"
#include "engine/text/chat_template.hpp"
#include "engine/text/tokenizer.hpp"
#include "engine/text/token_files.hpp"
#include "engine/train/chat_data.hpp"

#include <boost/filesystem.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

namespace loom::cli {
namespace {

const char* kPreprocessUsage =
    "usage: loom preprocess --tokenizer DIR --input FILE [--input FILE]... --output-prefix PREFIX\n"
    "                       [--format megatron|llmc] [--json-key text] [--append-eod] [--workers N]\n"
    "Tokenizes text into the files a run trains on. An input ending in .jsonl (or .json) has one\n"
    "document per line, its text in the --json-key field; any other input is one document.\n"
    "  --tokenizer   a directory with GPT-2's encoder.json and vocab.bpe (byte-level BPE;\n"
    "                scripts/fetch-gpt2-tokenizer.sh fetches them), a Hugging Face model directory\n"
    "                or its tokenizer.json (byte-level BPE: GPT-2's, Llama 3's, Qwen's), or a\n"
    "                SentencePiece .model (or a directory with tokenizer.model: Llama 2's)\n"
    "  --format      megatron (default): PREFIX.bin + PREFIX.idx, Megatron-LM's indexed dataset,\n"
    "                one sequence per document; llmc: PREFIX.bin, llm.c's uint16 token file\n"
    "  --append-eod  end every non-empty document with the end-of-document token (<|endoftext|>,\n"
    "                </s>), as Megatron's --append-eod\n"
    "  --workers     encoding threads (default: the machine's cores)\n"
    "Progress (documents, MB/s) goes to stderr; the files appear only when complete.\n";

const char* kTokenizeUsage =
    "usage: loom tokenize --tokenizer DIR|MODEL (--text TEXT | --file FILE) [--decode] [--json]\n"
    "       loom tokenize --tokenizer DIR --chat [--chat-template chatml|llama3] [--generation-prompt]\n"
    "                     (--text JSON | --file FILE.jsonl) [--json]\n"
    "Prints the token ids of the text (space-separated), or with --decode the text of the\n"
    "ids given as TEXT or in FILE. The tokenizer is any loom preprocess reads.\n"
    "With --chat, each line is a conversation as data.kind = \"chat\" reads it ({\"messages\":\n"
    "[{\"role\", \"content\"}, ...]}): printed as the chat template writes it (the tokenizer's\n"
    "own unless named), each followed by a blank line, or with --json as {\"text\", \"tokens\",\n"
    "\"targets\"}: the text as the template writes the messages, and the tokens training takes\n"
    "(a system message after the first starts another\n"
    "conversation; each ends with the end-of-document token) and 1 where it counts the token\n"
    "(the assistant's turns after their header, and each end of a conversation); with\n"
    "--generation-prompt the tokens a reply follows.\n";

std::string read_input(const std::string& path) {
  if (boost::filesystem::is_directory(path)) throw std::runtime_error(path + ": is a directory, not a file");
  std::string why;
  std::optional<std::string> bytes = files::read_whole_file(path, &why, files::Pipes::Allow);
  if (!bytes) throw std::runtime_error(path + ": cannot read the file (" + why + ")");
  return std::move(*bytes);
}

bool is_jsonl(const std::string& path) {
  std::string ext = boost::filesystem::path(path).extension().string();
  for (char& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return ext == ".jsonl" || ext == ".json";
}

// The documents of one input: its JSON lines' `key` fields, or the whole file.
std::vector<std::string> documents_of(const std::string& path, const std::string& key) {
  std::string content = read_input(path);
  if (!is_jsonl(path)) return {std::move(content)};
  std::vector<std::string> docs;
  for (const files::JsonLine& line : files::json_lines(content)) {
    const nlohmann::json j = files::parse_json_line(line, path);
    if (!j.is_object() || !j.contains(key) || !j[key].is_string())
      throw std::runtime_error(path + ":" + std::to_string(line.number) + ": no string field \"" + key +
                               "\" (--json-key names the field that holds the text)");
    docs.push_back(j[key].get<std::string>());
  }
  return docs;
}

// "\r  1200/5000 documents  12.3 MB  4.1 MB/s" on a terminal; a final line otherwise.
class Progress {
 public:
  Progress(size_t documents, double bytes) : documents_(documents), bytes_(bytes), tty_(isatty(2) != 0) {}
  void update(size_t done, double bytes_done, bool last) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    if (!last && (!tty_ || s - shown_ < 0.2)) return;
    shown_ = s;
    char line[160];
    std::snprintf(line, sizeof(line), "%s%zu/%zu documents  %.1f/%.1f MB  %.1f MB/s%s", tty_ ? "\r" : "", done,
                  documents_, bytes_done / 1e6, bytes_ / 1e6, s > 0 ? bytes_done / 1e6 / s : 0.0,
                  last || !tty_ ? "\n" : "");
    std::cerr << line << std::flush;
  }
  double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }

 private:
  size_t documents_;
  double bytes_;
  bool tty_;
  double shown_ = -1;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// Encodes every document on `workers` threads; calls `emit` with each document's
// tokens in input order (from the calling thread).
template <typename Emit>
void encode_in_order(const text::Tokenizer& tok, const std::vector<std::string>& docs, bool append_eod,
                     int workers, Progress& progress, double total_bytes, Emit&& emit) {
  std::vector<std::vector<int32_t>> encoded(docs.size());
  std::vector<char> ready(docs.size(), 0);
  std::atomic<size_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  std::string failure;
  auto work = [&] {
    for (size_t d; (d = next.fetch_add(1)) < docs.size();) {
      std::vector<int32_t> ids;
      try {
        ids = tok.encode(docs[d]);
        if (append_eod && !ids.empty()) ids.push_back(tok.eod());  // as Megatron: an empty document stays empty
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        if (failure.empty()) failure = "document " + std::to_string(d) + ": " + e.what();
      }
      std::lock_guard<std::mutex> lock(mu);
      encoded[d] = std::move(ids);
      ready[d] = 1;
      cv.notify_all();
    }
  };
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) threads.emplace_back(work);
  double bytes_done = 0;
  try {
    for (size_t d = 0; d < docs.size(); ++d) {
      std::vector<int32_t> ids;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return ready[d] != 0; });
        if (!failure.empty()) throw std::runtime_error(failure);
        ids = std::move(encoded[d]);
      }
      emit(ids);
      bytes_done += static_cast<double>(docs[d].size());
      progress.update(d + 1, bytes_done, d + 1 == docs.size());
    }
  } catch (...) {
    next = docs.size();  // the workers stop after their current document
    for (std::thread& t : threads) t.join();
    throw;
  }
  for (std::thread& t : threads) t.join();
  (void)total_bytes;
}

int preprocess(const Args& args) {
  if (!args.has("--tokenizer") || args.all("--input").empty() || !args.has("--output-prefix"))
    throw UsageError("preprocess needs --tokenizer, at least one --input and --output-prefix");
  const std::string format = args.get("--format").value_or("megatron");
  if (format != "megatron" && format != "llmc")
    throw UsageError("--format " + format + " is unknown; valid: megatron, llmc");
  const long long workers = args.get_int("--workers", std::max(1u, std::thread::hardware_concurrency()));
  if (workers < 1 || workers > 1024) throw UsageError("--workers must be between 1 and 1024");
  const std::string prefix = *args.get("--output-prefix");
  if (prefix.empty() || prefix.back() == '/') throw UsageError("--output-prefix must name files (PREFIX.bin, PREFIX.idx)");
  // An output must not overwrite an input (the files are written under .tmp names first).
  for (const std::string& input : args.all("--input"))
    for (const char* ext : {".bin", ".idx", ".bin.tmp", ".idx.tmp"}) {
      boost::system::error_code ec;
      if (boost::filesystem::equivalent(input, prefix + ext, ec) && !ec)
        throw UsageError("--output-prefix " + prefix + " would write " + prefix + ext + ", which is the input " + input);
    }
  const bool jsonl_input = std::any_of(args.all("--input").begin(), args.all("--input").end(), is_jsonl);
  if (args.has("--json-key") && !jsonl_input)
    throw UsageError("--json-key names a field of JSONL inputs (.jsonl, .json), and no input is one");
  // Where the files go, before the work whose result they hold.
  const boost::filesystem::path out_dir = boost::filesystem::path(prefix).parent_path();
  if (!out_dir.empty() && !boost::filesystem::is_directory(out_dir))
    throw std::runtime_error("--output-prefix " + prefix + ": the directory " + out_dir.string() + " does not exist");
  if (const std::string why = files::cannot_write(prefix + ".bin"); !why.empty())
    throw std::runtime_error(prefix + ".bin: " + why);
  const std::unique_ptr<text::Tokenizer> loaded = text::load_tokenizer(*args.get("--tokenizer"));
  const text::Tokenizer& tok = *loaded;
  if (args.flag("--append-eod") && tok.eod() < 0)
    throw std::runtime_error(tok.describe() + " has no end-of-document token for --append-eod");
  if (format == "llmc" && tok.vocab_size() > 65536)
    throw UsageError("--format llmc writes uint16 token ids, and " + tok.describe() +
                     " has more than 65536: use --format megatron (int32 ids for a vocabulary of 65500 or more)");

  std::vector<std::string> docs;
  for (const std::string& input : args.all("--input")) {
    std::vector<std::string> d = documents_of(input, args.get("--json-key").value_or("text"));
    docs.insert(docs.end(), std::make_move_iterator(d.begin()), std::make_move_iterator(d.end()));
  }
  double total_bytes = 0;
  for (const std::string& d : docs) total_bytes += static_cast<double>(d.size());
  Progress progress(docs.size(), total_bytes);
  int64_t tokens = 0;
  if (format == "megatron") {
    text::IndexedDatasetWriter out(prefix, text::token_type_for(tok.vocab_size()));
    encode_in_order(tok, docs, args.flag("--append-eod"), static_cast<int>(workers), progress, total_bytes,
                    [&](const std::vector<int32_t>& ids) { out.add_document(ids); });
    out.finish();
    tokens = out.tokens();
    std::cerr << "wrote " << prefix << ".bin and " << prefix << ".idx: ";
  } else {
    std::vector<int32_t> all;
    encode_in_order(tok, docs, args.flag("--append-eod"), static_cast<int>(workers), progress, total_bytes,
                    [&](const std::vector<int32_t>& ids) { all.insert(all.end(), ids.begin(), ids.end()); });
    text::write_llmc_tokens(prefix + ".bin", all);
    tokens = static_cast<int64_t>(all.size());
    std::cerr << "wrote " << prefix << ".bin: ";
    // A Megatron index beside it described the .bin just replaced.
    if (boost::filesystem::exists(prefix + ".idx") && std::remove((prefix + ".idx").c_str()) == 0)
      std::cerr << "(removed " << prefix << ".idx, the index of the .bin it replaced) ";
  }
  std::cerr << docs.size() << " documents, " << tokens << " tokens (vocab " << tok.vocab_size() << ") in "
            << progress.seconds() << " s\n";
  // The largest id in these files may be below the tokenizer's last: name it to train with.
  std::cerr << "to train on them: data.kind = \"" << (format == "megatron" ? "indexed" : "tokens")
            << "\", data.path = \"" << prefix << (format == "megatron" ? "" : ".bin") << "\", data.tokenizer = \""
            << *args.get("--tokenizer") << "\" (the model's vocabulary is then the tokenizer's " << tok.vocab_size()
            << ")\n";
  return 0;
}

// --chat: each line of the input a conversation, as the template writes it.
int tokenize_chat(const Args& args, const text::Tokenizer& tok, const std::string& input) {
  const text::ChatTemplate chat = text::resolve_chat_template(chat_template_option(args),
                                                              *args.get("--tokenizer"), "give --chat-template");
  chat.require_special_tokens(tok);
  const bool prompt = args.flag("--generation-prompt");
  const std::string name = args.has("--file") ? *args.get("--file") : "--text";
  for (const files::JsonLine& line : files::json_lines(input)) {
    text::Conversation conversation;
    try {
      conversation = text::conversation_from_json(files::parse_json_line(line, name));
    } catch (const text::TokenizerError& e) {
      throw std::runtime_error(name + ":" + std::to_string(line.number) + ": " + e.what());
    }
    const std::string rendered = chat.render(conversation, prompt);
    if (!args.flag("--json")) {  // each conversation, then a blank line
      std::cout << rendered << (rendered.empty() || rendered.back() != '\n' ? "\n\n" : "\n");
      continue;
    }
    // The tokens training takes from the line (each conversation ended), or with the
    // generation prompt those a reply would follow.
    const int32_t eod = chat.end_of_conversation(tok);
    if (!prompt && eod < 0)
      throw std::runtime_error(tok.describe() + " has no token to end a conversation that chat template " +
                               chat.name() + " does not write inside one; training names it with data.eod_token");
    const text::ChatTokens t =
        prompt ? chat.encode(tok, conversation, true) : train::line_tokens(chat, tok, conversation, eod);
    std::cout << runtime::dump_json({{"text", rendered}, {"tokens", t.ids}, {"targets", t.target}}) << "\n";
  }
  return 0;
}

int tokenize(const Args& args) {
  if (!args.has("--tokenizer") || args.has("--text") == args.has("--file"))
    throw UsageError("tokenize needs --tokenizer and one of --text or --file");
  const bool chat = args.flag("--chat");
  if (chat && args.flag("--decode")) throw UsageError("--chat encodes conversations; --decode decodes ids: one of them");
  if (!chat && (args.has("--chat-template") || args.flag("--generation-prompt")))
    throw UsageError("--chat-template and --generation-prompt go with --chat");
  chat_template_option(args);  // a usage error before anything loads
  const std::unique_ptr<text::Tokenizer> loaded = text::load_tokenizer(*args.get("--tokenizer"));
  const text::Tokenizer& tok = *loaded;
  const std::string input = args.has("--text") ? *args.get("--text") : read_input(*args.get("--file"));
  if (chat) return tokenize_chat(args, tok, input);
  if (args.flag("--decode")) {
    std::vector<int32_t> ids;
    std::istringstream in(input);
    for (std::string word; in >> word;) {
      try {
        size_t used = 0;
        const long long v = std::stoll(word, &used);
        if (used != word.size() || v < INT32_MIN || v > INT32_MAX) throw std::invalid_argument(word);
        ids.push_back(static_cast<int32_t>(v));
      } catch (const std::exception&) {
        throw UsageError("--decode reads token ids separated by spaces; '" + word + "' is not one");
      }
    }
    if (args.flag("--json")) {
      std::cout << runtime::dump_json({{"text", tok.decode(ids)}}) << "\n";
      return 0;
    }
    std::cout << tok.decode(ids);
    return 0;
  }
  const std::vector<int32_t> ids = tok.encode(input);
  if (args.flag("--json")) {
    std::cout << runtime::dump_json({{"tokens", ids}, {"count", ids.size()}}) << "\n";
    return 0;
  }
  for (size_t i = 0; i < ids.size(); ++i) std::cout << (i ? " " : "") << ids[i];
  std::cout << "\n";
  return 0;
}

const char* kTrainUsage =
    "usage: loom tokenizer-train --input FILE [--input FILE]... --model-prefix PREFIX --vocab-size N\n"
    "                            [--model-type bpe|unigram] [--character-coverage C] [--workers N]\n"
    "Trains a SentencePiece model on text (one sentence per line) into PREFIX.model and\n"
    "PREFIX.vocab as Llama-family tokenizers are made: byte fallback (any text encodes) and\n"
    "no normalization (the text is kept as written, so decoding gives it back).\n";

int train_tokenizer(const Args& args) {
  if (args.all("--input").empty() || !args.has("--model-prefix") || !args.has("--vocab-size"))
    throw UsageError("tokenizer-train needs at least one --input, --model-prefix and --vocab-size");
  text::SentencePieceTraining how;
  how.inputs = args.all("--input");
  how.model_prefix = *args.get("--model-prefix");
  how.vocab_size = static_cast<int32_t>(args.get_int("--vocab-size", 0));
  // Byte fallback needs its 256 byte pieces, <unk>, <s> and </s>, and a piece more.
  if (how.vocab_size < 260 || how.vocab_size > 1000000) throw UsageError("--vocab-size must be between 260 and 1000000");
  how.model_type = args.get("--model-type").value_or("bpe");
  if (how.model_type != "bpe" && how.model_type != "unigram")
    throw UsageError("--model-type " + how.model_type + " is unknown; valid: bpe, unigram");
  if (const auto c = args.get("--character-coverage")) {
    try {
      how.character_coverage = std::stod(*c);
    } catch (const std::exception&) {
      how.character_coverage = -1;
    }
    if (!(how.character_coverage > 0 && how.character_coverage <= 1))
      throw UsageError("--character-coverage must be in (0, 1], got " + *c);
  }
  const long long workers = args.get_int("--workers", std::min(128u, std::max(1u, std::thread::hardware_concurrency())));
  if (workers < 1 || workers > 128) throw UsageError("--workers must be between 1 and 128 (SentencePiece's limit)");
  how.threads = static_cast<int>(workers);
  if (how.model_prefix.empty() || how.model_prefix.back() == '/')
    throw UsageError("--model-prefix must name files (PREFIX.model, PREFIX.vocab)");
  const auto start = std::chrono::steady_clock::now();
  text::train_sentencepiece(how);
  std::cerr << "wrote " << how.model_prefix << ".model and " << how.model_prefix << ".vocab (" << how.vocab_size
            << " tokens, " << how.model_type << ") in "
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() << " s\n";
  return 0;
}

int run_command(const char* name, const char* usage, int argc, char** argv, std::set<std::string> flags,
                std::set<std::string> options, int (*fn)(const Args&)) {
  try {
    Args args(argc, argv, std::move(flags), std::move(options));
    if (args.flag("--help")) {
      std::cout << usage;
      return 0;
    }
    if (!args.positionals().empty()) throw UsageError(std::string(name) + " takes no positional arguments");
    return fn(args);
  } catch (const UsageError& e) {
    std::cerr << "loom " << name << ": " << e.what() << "\n" << usage;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "loom " << name << ": " << runtime::error_message(e) << "\n";
    return 1;
  }
}

}  // namespace

int cmd_preprocess(int argc, char** argv) {
  return run_command("preprocess", kPreprocessUsage, argc, argv, {"--append-eod"},
                     {"--tokenizer", "--input", "--output-prefix", "--format", "--json-key", "--workers"}, preprocess);
}

int cmd_tokenizer_train(int argc, char** argv) {
  return run_command("tokenizer-train", kTrainUsage, argc, argv, {},
                     {"--input", "--model-prefix", "--vocab-size", "--model-type", "--character-coverage", "--workers"},
                     train_tokenizer);
}

int cmd_tokenize(int argc, char** argv) {
  return run_command("tokenize", kTokenizeUsage, argc, argv, {"--decode", "--json", "--chat", "--generation-prompt"},
                     {"--tokenizer", "--text", "--file", "--chat-template"}, tokenize);
}

}  // namespace loom::cli
