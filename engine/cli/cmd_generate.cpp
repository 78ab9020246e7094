// loom generate CHECKPOINT|MANIFEST --prompt TEXT [--max-new-tokens N] [--temperature T]
//   [--top-k K] [--top-p P] [--seed S] [--tokenizer DIR|MODEL] [--prompt-ids 1,2,3]
//   [--chat [--system TEXT] [--chat-template NAME] [--interactive]] [--no-cache] [--set key=value]... [--json]
//   [--plugin-path DIR]...
// Text from a trained model, with a key/value cache (engine/train/generation.hpp).
#include "engine/cli/args.hpp"
#include "engine/cli/commands.hpp"
#include "engine/cli/model_source.hpp"
#include "engine/cli/reply_text.hpp"
#include "engine/runtime/launcher.hpp"
#include "engine/text/chat_template.hpp"
#include "engine/text/tokenizer.hpp"
#include "engine/train/generation.hpp"
#include "engine/train/text_codec.hpp"

#include <boost/filesystem.hpp>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <csignal>
#include <optional>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>

namespace loom::cli {
namespace {

const char* kUsage =
    "usage: loom generate CHECKPOINT|MANIFEST|HF_DIR (--prompt TEXT | --prompt-ids 1,2,3) [options]\n"
    "  CHECKPOINT          a step_N directory, or a checkpoint.dir (its newest complete step): the model\n"
    "                      of the manifest it saved, at its tensor and pipeline sizes\n"
    "  MANIFEST            a .toml whose checkpoint.dir (its newest step, once the run saved one) or\n"
    "                      checkpoint.init_weights (a loom checkpoint or a Hugging Face directory) holds\n"
    "                      the weights\n"
    "  HF_DIR              a Hugging Face model directory (config.json, model.safetensors): the model\n"
    "                      its config describes (loom import --write-manifest's), its tokenizer if any\n"
    "  --max-new-tokens N  tokens to add (default 64; fewer when the model's seq_length is reached)\n"
    "  --temperature T     0 = greedy; default 1\n"
    "  --top-k K           sample among the K most likely tokens (0 = all; default 0)\n"
    "  --top-p P           then among the fewest whose probabilities reach P (default 1)\n"
    "  --seed S            the sampling seed (default 0)\n"
    "  --stop-token ID     end when this token is drawn (default: the end of document the model was\n"
    "                      trained with: data.eod_token, else the tokenizer's; with --chat the end of\n"
    "                      the turn or of the conversation)\n"
    "  --chat              the prompt is a user's message: written with the chat template (a run's\n"
    "                      data.chat_template, else the one the tokenizer's directory declares) and the\n"
    "                      assistant's header after it; the reply alone is printed, ending at the end\n"
    "                      of the turn (<|im_end|>, <|eot_id|>)\n"
    "  --system TEXT       with --chat: a system message before the user's\n"
    "  --chat-template T   with --chat: chatml or llama3 instead\n"
    "  --interactive       with --chat: a conversation, a message a line of stdin (--prompt: the first),\n"
    "                      each reply printed as it comes; each turn reuses the cached earlier ones\n"
    "  --tokenizer PATH    any loom preprocess reads (GPT-2 BPE, tokenizer.json, SentencePiece); the run's\n"
    "                      data.tokenizer, a synthetic task's symbols or, for data.kind = \"text\", bytes\n"
    "  --no-cache          run the whole sequence again for every token (what the cache saves)\n"
    "  --set key=value     override the manifest's layout or device (parallel.tp=2, parallel.pp=2;\n"
    "                      device.kind=\"cuda\" with device.options={} for a CPU checkpoint); repeatable\n"
    "  --json              one JSON object: the prompt and new token ids, the text, timings\n"
    "SIGINT/SIGTERM stop after the current token.\n";

std::atomic<int> g_stop{0};
extern "C" void on_generate_signal(int) { g_stop.store(1); }

// The text as it is generated: the prompt once the first token comes (after the
// request was checked), then each token's text once it is final (ReplyText).
class Stream {
 public:
  // `echo`: the prompt is printed before the first token (else only what follows it).
  Stream(const train::TextCodec& codec, const std::vector<int32_t>& prompt, bool echo) : reply_(codec, prompt), echo_(echo) {}
  void add(int32_t token) {
    start();
    std::cout << reply_.add(token) << std::flush;
  }
  // What was held back at the end (a character left incomplete), then a newline.
  void finish() {
    start();
    std::cout << reply_.finish() << "\n" << std::flush;
  }

 private:
  void start() {
    if (started_ || !echo_) return;
    started_ = true;
    std::cout << reply_.context_text();
  }

  ReplyText reply_;
  bool echo_;
  bool started_ = false;
};

// --chat: the conversation so far, written with the chat template (the run's
// data.chat_template, else its tokenizer's, or the one named here, or the one
// --tokenizer's directory declares), and the tokens that end a reply.
struct Chat {
  text::ChatTemplate chat_template;
  text::Conversation conversation;  // the system message, then the turns
  std::vector<int32_t> stops;       // the end of a turn, and of a conversation where known
  // The conversation and the assistant's header after it.
  std::vector<int32_t> prompt(const train::TextCodec& codec) const {
    return chat_template.encode(*codec.tokenizer(), conversation, true).ids;
  }
};
Chat start_chat(const Args& args, const train::TextCodec& codec, const manifest::RunConfig& config) {
  const text::Tokenizer* tokenizer = codec.tokenizer();
  if (tokenizer == nullptr)
    throw UsageError("--chat writes the prompt with a chat template, which needs the model's tokenizer (" +
                     codec.describe() + "); give --tokenizer");
  const std::string named = chat_template_option(args);
  Chat chat{text::resolve_chat_template(named.empty() ? config.data.chat_template : named,
                                        args.get("--tokenizer").value_or(config.data.tokenizer), "give --chat-template"),
            {}, {}};
  chat.chat_template.require_special_tokens(*tokenizer);
  if (args.has("--system")) chat.conversation.push_back({"system", *args.get("--system")});
  chat.stops = {chat.chat_template.end_of_turn(*tokenizer)};
  const int64_t end = config.data.eod_token >= 0 ? config.data.eod_token : chat.chat_template.end_of_conversation(*tokenizer);
  if (end >= 0) chat.stops.push_back(static_cast<int32_t>(end));
  return chat;
}

// --interactive: a conversation with the model, a user message a line of stdin (the
// first one --prompt's, when given), each reply printed as it comes (or, with --json,
// a line of JSON a turn). The model stays built and each turn reuses what the cache
// holds of the turns before. Ends at the end of stdin (0) or on a signal (130, after
// the current token).
int chat_interactively(const ModelSource& src, const train::TextCodec& codec, Chat chat, train::GenerationRequest req,
                       const std::optional<std::string>& first, bool json) {
  train::Generator generator(src.plan, src.weights, src.vocab);
  const bool prompt_user = ::isatty(0) != 0 && !json;
  const size_t kept = chat.conversation.size();  // the system message
  const uint64_t seed = req.sampling.seed;
  for (int64_t turn = 0; g_stop.load() == 0; ++turn) {
    std::string message;
    if (turn == 0 && first) {
      message = *first;
    } else {
      if (prompt_user) std::cerr << "> " << std::flush;
      if (!std::getline(std::cin, message)) break;
    }
    if (message.empty()) continue;
    chat.conversation.push_back({"user", message});
    req.prompt = chat.prompt(codec);
    if (static_cast<int64_t>(req.prompt.size()) >= generator.seq_len() && chat.conversation.size() > kept + 1) {
      std::cerr << "loom generate: the conversation no longer fits the model's seq_length of " << generator.seq_len()
                << " tokens: it starts again from this message\n";
      chat.conversation.erase(chat.conversation.begin() + static_cast<std::ptrdiff_t>(kept), chat.conversation.end() - 1);
      req.prompt = chat.prompt(codec);
    }
    req.sampling.seed = seed + static_cast<uint64_t>(turn);
    ReplyText reply(codec, req.prompt);
    req.on_token = [&](int32_t t) {
      if (std::find(chat.stops.begin(), chat.stops.end(), t) != chat.stops.end()) return;
      const std::string fresh = reply.add(t);
      if (!json) std::cout << fresh << std::flush;
    };
    train::GenerationResult res;
    try {
      res = generator.generate(req);
    } catch (const runtime::RunError&) {
      throw;
    } catch (const std::exception& e) {  // this message cannot be answered (too long): say so, go on
      std::cerr << "loom generate: " << e.what() << "\n";
      chat.conversation.pop_back();
      continue;
    }
    const std::string rest = reply.finish();
    if (json) {
      nlohmann::ordered_json j;
      j["turn"] = turn;
      j["reply"] = reply.text();
      j["ids"] = res.tokens;
      j["prompt_tokens"] = req.prompt.size();
      j["reused"] = res.reused;
      j["interrupted"] = res.interrupted;
      std::cout << j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) << "\n" << std::flush;
    } else {
      std::cout << rest << "\n" << std::flush;
    }
    chat.conversation.push_back({"assistant", reply.text()});
  }
  return g_stop.load() != 0 ? 130 : 0;
}

std::vector<int32_t> parse_ids(const std::string& list) {
  std::vector<int32_t> ids;
  std::stringstream ss(list);
  for (std::string item; std::getline(ss, item, ',');) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || item.empty() || std::isspace(static_cast<unsigned char>(item.front())) || v < 0 ||
        v > INT32_MAX)
      throw UsageError("--prompt-ids: '" + item + "' is not a token id (comma-separated integers >= 0)");
    ids.push_back(static_cast<int32_t>(v));
  }
  return ids;
}

double parse_double(const Args& args, const std::string& name, double fallback) {
  const auto v = args.get(name);
  if (!v) return fallback;
  size_t used = 0;
  double d = 0;
  try {
    d = std::stod(*v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v->size() || v->empty() || std::isspace(static_cast<unsigned char>(v->front())) || !std::isfinite(d))
    throw UsageError(name + " " + *v + " is not a finite number (or out of range)");
  return d;
}

}  // namespace

int cmd_generate(int argc, char** argv) {
  try {
    Args args(argc, argv, {"--no-cache", "--json", "--chat", "--interactive"},
              {"--prompt", "--prompt-ids", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed",
               "--stop-token", "--tokenizer", "--set", "--plugin-path", "--system", "--chat-template"});
    if (args.flag("--help")) {
      std::cout << kUsage;
      return 0;
    }
    if (args.positionals().size() != 1) throw UsageError("generate takes one CHECKPOINT or MANIFEST");
    const bool chat = args.flag("--chat"), interactive = args.flag("--interactive");
    if (interactive && !chat) throw UsageError("--interactive goes with --chat");
    if (interactive && args.has("--prompt-ids")) throw UsageError("--interactive reads messages, not --prompt-ids");
    if (!interactive && args.has("--prompt") == args.has("--prompt-ids"))
      throw UsageError("give --prompt TEXT or --prompt-ids, one of them");
    if (chat && !interactive && !args.has("--prompt")) throw UsageError("--chat takes the user's message as --prompt TEXT");
    for (const char* option : {"--system", "--chat-template"})
      if (!chat && args.has(option)) throw UsageError(std::string(option) + " goes with --chat");
    chat_template_option(args);  // a usage error before anything loads
    train::GenerationRequest req;
    req.max_new_tokens = args.get_int("--max-new-tokens", 64);
    if (req.max_new_tokens < 1) throw UsageError("--max-new-tokens must be >= 1");
    req.sampling.temperature = parse_double(args, "--temperature", 1.0);
    req.sampling.top_k = args.get_int("--top-k", 0);
    req.sampling.top_p = parse_double(args, "--top-p", 1.0);
    req.sampling.seed = static_cast<uint64_t>(args.get_int("--seed", 0));
    if (req.sampling.temperature < 0) throw UsageError("--temperature must be >= 0");
    if (req.sampling.top_k < 0) throw UsageError("--top-k must be >= 0");
    if (!(req.sampling.top_p > 0 && req.sampling.top_p <= 1)) throw UsageError("--top-p must be in (0, 1]");
    req.use_cache = !args.flag("--no-cache");

    plugins::Registry& r = plugins::registry();
    r.load_dirs(plugins::Registry::search_paths(args.all("--plugin-path")));
    // One sequence decodes at dp = cp = ep = 1 without sequence parallelism (the plan
    // sets them): a --set of those changes nothing, said rather than taken silently.
    for (const std::string& o : args.all("--set"))
      for (const char* key : {"parallel.dp", "parallel.cp", "parallel.ep", "parallel.sequence_parallel"})
        if (o.rfind(std::string(key) + "=", 0) == 0 || o.rfind(std::string(key) + " ", 0) == 0)
          std::cerr << "loom generate: warning: --set " << o << " changes nothing: one sequence decodes at dp = cp = "
                       "ep = 1 without sequence parallelism (tp and pp split the model)\n";
    const ModelSource src = load_model_source(args.positionals()[0], args.all("--set"), r, train::generation_plan);
    const train::TextCodec codec(args.get("--tokenizer").value_or(""), src.plan.config);
    codec.require_fits(src.vocab);
    std::optional<Chat> conversation;
    if (chat) conversation = start_chat(args, codec, src.plan.config);
    if (chat && !interactive) conversation->conversation.push_back({"user", *args.get("--prompt")});
    req.prompt = interactive                ? std::vector<int32_t>{}
                 : chat                     ? conversation->prompt(codec)
                 : args.has("--prompt-ids") ? parse_ids(*args.get("--prompt-ids"))
                                            : codec.encode(*args.get("--prompt"));
    const int64_t trained_eod = src.plan.config.data.eod_token;
    if (args.has("--stop-token") || !chat) {
      const long long stop = args.get_int("--stop-token", trained_eod >= 0 ? trained_eod : codec.eod());
      if (stop < -1 || stop >= src.vocab)
        throw UsageError("--stop-token " + std::to_string(stop) + " is not a token of the model's vocabulary [0, " +
                         std::to_string(src.vocab) + ") (or -1: none)");
      if (stop >= 0) req.stop_tokens = {static_cast<int32_t>(stop)};
    } else {
      req.stop_tokens = conversation->stops;
    }
    req.token_limit = codec.vocab();
    const bool json = args.flag("--json");
    Stream stream(codec, req.prompt, !chat);
    // A reply's end-of-turn token is where it stops, not part of it.
    const auto stops_reply = [&](int32_t t) {
      return chat && std::find(req.stop_tokens.begin(), req.stop_tokens.end(), t) != req.stop_tokens.end();
    };
    if (!json) req.on_token = [&](int32_t t) {
      if (!stops_reply(t)) stream.add(t);
    };
    req.stop_signal = &g_stop;
    // Without SA_RESTART: a signal while --interactive waits for a line ends the wait.
    struct sigaction on_signal {};
    on_signal.sa_handler = on_generate_signal;
    for (int sig : {SIGINT, SIGTERM}) ::sigaction(sig, &on_signal, nullptr);
    if (interactive) {
      conversation->stops = req.stop_tokens;
      return chat_interactively(src, codec, *conversation, req, args.get("--prompt"), json);
    }
    const train::GenerationResult res = train::generate(src.plan, src.weights, src.vocab, req);
    for (int sig : {SIGINT, SIGTERM}) std::signal(sig, SIG_DFL);

    const double decode_tokens = res.tokens.size() > 1 ? static_cast<double>(res.tokens.size() - 1) : 0.0;
    const double tokens_per_s = res.decode_ms > 0 ? 1000.0 * decode_tokens / res.decode_ms : 0.0;
    if (json) {
      nlohmann::ordered_json j;
      j["source"] = src.weights.source;
      j["prompt_ids"] = req.prompt;
      j["ids"] = res.tokens;
      j["text"] = codec.has_text() ? nlohmann::ordered_json(codec.decode(res.tokens)) : nlohmann::ordered_json();
      if (chat) {
        std::vector<int32_t> reply = res.tokens;
        if (!reply.empty() && stops_reply(reply.back())) reply.pop_back();
        j["reply"] = codec.decode(reply);
      }
      j["prefill_ms"] = res.prefill_ms;
      j["decode_ms"] = res.decode_ms;
      j["decode_tokens_per_s"] = tokens_per_s;
      j["cache"] = req.use_cache;
      j["reached_seq_length"] = res.reached_seq_len;
      j["interrupted"] = res.interrupted;
      // Bytes that are not UTF-8 (a byte-level model's, a token cut inside a character)
      // become U+FFFD rather than an exception after the work is done.
      std::cout << j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) << "\n";
    } else {
      stream.finish();
      std::cerr << std::fixed << std::setprecision(1) << "generate: " << res.tokens.size() << " tokens from "
                << src.weights.source << " (tp " << src.plan.sizes.tp << ", pp " << src.plan.sizes.pp << ", "
                << (req.use_cache ? "kv cache" : "no cache") << ") | prompt " << req.prompt.size() << " tokens in "
                << res.prefill_ms << " ms | " << tokens_per_s << " tokens/s after it"
                << (res.reached_seq_len ? " | stopped at the model's seq_length" : "")
                << (res.interrupted ? " | interrupted" : "") << "\n";
    }
    return res.interrupted ? 130 : 0;
  } catch (const UsageError& e) {
    std::cerr << "loom generate: " << e.what() << "\n" << kUsage;
    return 2;
  } catch (const manifest::ManifestError& e) {
    std::cerr << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "loom generate: " << runtime::error_message(e) << "\n";
    return 1;
  }
}

}  // namespace loom::cli
