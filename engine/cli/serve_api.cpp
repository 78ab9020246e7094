#include "engine/cli/serve_api.hpp"

#include "engine/cli/reply_text.hpp"
#include "engine/runtime/launcher.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>

namespace loom::cli {

namespace {

using json = nlohmann::ordered_json;

// A request the API refuses: its status, OpenAI's error type and the field at fault.
struct Refusal : std::runtime_error {
  Refusal(int status, const std::string& message, std::string type = "invalid_request_error", std::string param = "")
      : std::runtime_error(message), status(status), type(std::move(type)), param(std::move(param)) {}
  int status;
  std::string type, param;
};

json error_json(const std::string& message, const std::string& type, const std::string& param) {
  json e;
  e["message"] = message;
  e["type"] = type;
  e["param"] = param.empty() ? json() : json(param);
  e["code"] = json();
  return json{{"error", e}};
}

// Bytes that are not UTF-8 (a byte-level model's half characters) become U+FFFD.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

HttpAnswer json_answer(const json& j, int status = 200) { return {status, "application/json", dump(j), ""}; }

int64_t unix_time() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

constexpr int kMaxDepth = 32;
constexpr size_t kMaxPrompts = 128;  // a request's prompts (times n: its sequences)

// The fields of a request body, each read at most once; what is left unread at the end
// is a field the endpoint does not know.
class Body {
 public:
  Body(const std::string& text, std::set<std::string> known) : known_(std::move(known)) {
    // Nesting is bounded before anything copies the value (a copy recurses: a body
    // of 80 000 brackets would overflow the stack).
    const json::parser_callback_t bounded = [](int depth, json::parse_event_t, json&) {
      if (depth > kMaxDepth) throw Refusal(400, "the body nests deeper than " + std::to_string(kMaxDepth) + " levels");
      return true;
    };
    try {
      j_ = json::parse(text, bounded);
    } catch (const json::exception& e) {
      throw Refusal(400, std::string("the body is not JSON: ") + e.what());
    }
    if (!j_.is_object()) throw Refusal(400, "the body is not a JSON object");
    for (const auto& [key, value] : j_.items())
      if (!known_.count(key))
        throw Refusal(400, "unrecognized request argument: " + key, "invalid_request_error", key);
  }

  // The field, or null when absent or null.
  const json* get(const std::string& name) const {
    const auto it = j_.find(name);
    return it == j_.end() || it->is_null() ? nullptr : &*it;
  }
  const json& require(const std::string& name) const {
    const json* v = get(name);
    if (v == nullptr) throw Refusal(400, "'" + name + "' is required", "invalid_request_error", name);
    return *v;
  }
  double number(const std::string& name, double fallback, double lo, double hi) const {
    const json* v = get(name);
    if (v == nullptr) return fallback;
    if (!v->is_number() || !std::isfinite(v->get<double>()) || v->get<double>() < lo || v->get<double>() > hi)
      throw Refusal(400, "'" + name + "' must be a number in [" + fmt(lo) + ", " + fmt(hi) + "]", "invalid_request_error",
                    name);
    return v->get<double>();
  }
  int64_t integer(const std::string& name, int64_t fallback, int64_t lo, int64_t hi) const {
    const json* v = get(name);
    if (v == nullptr) return fallback;
    int64_t value = 0;
    bool whole = false;
    if (v->is_number_unsigned()) {  // above INT64_MAX it would wrap: compared unsigned
      whole = hi >= 0 && v->get<uint64_t>() <= static_cast<uint64_t>(hi);
      value = whole ? static_cast<int64_t>(v->get<uint64_t>()) : 0;
    } else if (v->is_number_integer()) {
      whole = true;
      value = v->get<int64_t>();
    } else if (v->is_number_float()) {
      const double d = v->get<double>();
      whole = std::trunc(d) == d && std::fabs(d) < 9.0e18;
      value = whole ? static_cast<int64_t>(d) : 0;
    }
    if (!whole || value < lo || value > hi)
      throw Refusal(400, "'" + name + "' must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]",
                    "invalid_request_error", name);
    return value;
  }
  bool boolean(const std::string& name, bool fallback) const {
    const json* v = get(name);
    if (v == nullptr) return fallback;
    if (!v->is_boolean()) throw Refusal(400, "'" + name + "' must be true or false", "invalid_request_error", name);
    return v->get<bool>();
  }
  // A field the server does not implement: accepted only when null or at the one value
  // that asks for nothing in OpenAI's (or Megatron-LM's) meaning of the field.
  enum class Nothing { OnlyNull, False, Zero, Empty, EmptyText };
  void unsupported(const std::string& name, const std::string& what, Nothing nothing = Nothing::OnlyNull) const {
    const json* v = get(name);
    if (v == nullptr) return;
    const bool asks_nothing =
        (nothing == Nothing::False && v->is_boolean() && !v->get<bool>()) ||
        (nothing == Nothing::Zero && v->is_number() && v->get<double>() == 0) ||
        (nothing == Nothing::Empty && (v->is_object() || v->is_array()) && v->empty()) ||
        (nothing == Nothing::EmptyText && v->is_string() && v->get<std::string>().empty());
    if (!asks_nothing)
      throw Refusal(400, "'" + name + "' is not supported: loom serve " + what, "invalid_request_error", name);
  }
  void text(const std::string& name) const {
    const json* v = get(name);
    if (v != nullptr && !v->is_string()) throw Refusal(400, "'" + name + "' must be a string", "invalid_request_error", name);
  }

 private:
  static std::string fmt(double x) {
    std::ostringstream s;
    s << x;
    return s.str();
  }
  json j_;
  std::set<std::string> known_;
};

// A request's sampling, stops and lengths, as the OpenAI endpoints read them.
struct Settings {
  train::Sampling sampling;
  int64_t max_tokens = 0;
  int64_t n = 1;
  std::vector<std::string> stop_strings;
  bool stream = false;
  bool usage_in_stream = false;
};

uint64_t random_seed() { return (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}(); }

Settings openai_settings(const ServedModel& m, const Body& b, int64_t default_max_tokens) {
  if (const json* name = b.get("model")) {
    if (!name->is_string()) throw Refusal(400, "'model' must be a string", "invalid_request_error", "model");
    if (name->get<std::string>() != m.name)
      throw Refusal(404, "the model '" + name->get<std::string>() + "' is not served here (this server serves '" +
                             m.name + "')",
                    "invalid_request_error", "model");
  }
  Settings s;
  s.sampling.temperature = b.number("temperature", 1.0, 0.0, 1e6);
  s.sampling.top_p = b.number("top_p", 1.0, 0.0, 1.0);
  if (s.sampling.top_p == 0.0) throw Refusal(400, "'top_p' must be above 0", "invalid_request_error", "top_p");
  const int64_t top_k = b.integer("top_k", 0, -1, INT32_MAX);  // -1 and 0: every token (vLLM takes both)
  s.sampling.top_k = std::max<int64_t>(top_k, 0);
  s.sampling.seed = b.get("seed") ? static_cast<uint64_t>(b.integer("seed", 0, INT64_MIN, INT64_MAX)) : random_seed();
  s.max_tokens = b.integer("max_tokens", default_max_tokens, 0, INT32_MAX);
  if (b.get("max_completion_tokens")) s.max_tokens = b.integer("max_completion_tokens", 0, 0, INT32_MAX);
  s.n = b.integer("n", 1, 1, 16);
  s.stream = b.boolean("stream", false);
  if (const json* options = b.get("stream_options")) {
    if (!s.stream) throw Refusal(400, "'stream_options' goes with \"stream\": true", "invalid_request_error", "stream_options");
    if (!options->is_object()) throw Refusal(400, "'stream_options' must be an object", "invalid_request_error", "stream_options");
    for (const auto& [key, value] : options->items()) {
      if (key != "include_usage" || !value.is_boolean())
        throw Refusal(400, "'stream_options' takes {\"include_usage\": true|false}", "invalid_request_error",
                      "stream_options");
      s.usage_in_stream = value.get<bool>();
    }
  }
  if (const json* stop = b.get("stop")) {
    const json list = stop->is_string() ? json::array({*stop}) : *stop;
    if (!list.is_array() || list.size() > 4)
      throw Refusal(400, "'stop' must be a string or a list of up to 4 strings", "invalid_request_error", "stop");
    for (const json& x : list) {
      if (!x.is_string() || x.get<std::string>().empty())
        throw Refusal(400, "'stop' must hold strings that are not empty", "invalid_request_error", "stop");
      s.stop_strings.push_back(x.get<std::string>());
    }
  }
  b.unsupported("top_logprobs", "returns no log-probabilities", Body::Nothing::Zero);
  b.unsupported("presence_penalty", "applies no penalties", Body::Nothing::Zero);
  b.unsupported("frequency_penalty", "applies no penalties", Body::Nothing::Zero);
  b.unsupported("logit_bias", "applies no logit bias", Body::Nothing::Empty);
  b.text("user");
  return s;
}

// One generated choice.
struct Choice {
  std::string text;
  std::string finish_reason;
  std::vector<int32_t> ids;  // every token drawn (a stop token, one after a stop string)
  int64_t tokens = 0;        // the completion's tokens: up to the one that completed a stop string
  int64_t cached = 0;        // prompt tokens whose keys and values the model had cached
  bool started = true;       // false: not begun (the server was shutting down, the client gone)
};

// Runs one choice: `prompt` continued, its text given to `on_text` as it becomes final
// (a streamed answer; false: the client is gone, stop). Tokens in `stop_tokens` end it
// and are not text; so does a stop string, the text ending before it. A shutdown or a
// client that left ends it after the current token ("abort"), or before it starts.
Choice run_choice(const ServedModel& m, const std::vector<int32_t>& prompt, const Settings& s, uint64_t seed,
                  const std::vector<int32_t>& stop_tokens, const std::function<bool(const std::string&)>& on_text,
                  EventStream& client) {
  const auto must_stop = [&] { return (m.shutting_down && m.shutting_down->load() != 0) || !client.connected(); };
  Choice c;
  if (must_stop()) {
    c.finish_reason = "abort";
    c.started = false;
    return c;
  }
  if (s.max_tokens == 0) {
    c.finish_reason = "length";
    return c;
  }
  ReplyText reply(*m.codec, prompt, s.stop_strings);
  std::atomic<int> stop{0};
  bool stopped_by_token = false;
  train::GenerationRequest req;
  req.prompt = prompt;
  req.max_new_tokens = s.max_tokens;
  req.sampling = s.sampling;
  req.sampling.seed = seed;
  req.stop_tokens = stop_tokens;
  req.token_limit = m.vocab;
  req.stop_signal = &stop;
  req.on_token = [&](int32_t token) {
    if (must_stop()) stop = 1;
    if (reply.stopped()) return;  // the token after a stop string, drawn before the stop took hold
    ++c.tokens;
    if (std::find(stop_tokens.begin(), stop_tokens.end(), token) != stop_tokens.end()) {
      stopped_by_token = true;
      return;
    }
    const std::string fresh = reply.add(token);
    if (reply.stopped()) stop = 1;
    if (!fresh.empty() && on_text && !on_text(fresh)) stop = 1;
  };
  train::GenerationResult r;
  try {
    r = m.generate(req);
  } catch (const runtime::RunError&) {
    throw;
  } catch (const std::exception& e) {  // the request's own fault, found before any rank ran it
    throw Refusal(400, e.what());
  }
  const std::string rest = reply.finish();
  if (!rest.empty() && on_text) on_text(rest);
  c.text = reply.text();
  c.ids = std::move(r.tokens);
  c.cached = r.reused;
  c.finish_reason = stopped_by_token || reply.stopped() ? "stop" : r.interrupted ? "abort" : "length";
  return c;
}

// OpenAI's usage; cached_tokens: prompt tokens the model's key/value cache held from
// the request before (a conversation's earlier turns), not computed again.
json usage_json(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens) {
  return json{{"prompt_tokens", prompt_tokens},
              {"completion_tokens", completion_tokens},
              {"total_tokens", prompt_tokens + completion_tokens},
              {"prompt_tokens_details", {{"cached_tokens", cached_tokens}}}};
}

std::string next_id(const std::string& prefix) {
  static std::atomic<uint64_t> counter{0};
  return prefix + "-" + std::to_string(unix_time()) + "-" + std::to_string(++counter);
}

// A prompt of the completions endpoint: text, or token ids.
std::vector<int32_t> prompt_ids(const ServedModel& m, const json& p) {
  if (p.is_string()) {
    const std::string text = p.get<std::string>();
    if (!text.empty()) {
      try {
        return m.codec->encode(text);
      } catch (const std::exception& e) {
        throw Refusal(400, std::string("the prompt cannot be encoded: ") + e.what(), "invalid_request_error", "prompt");
      }
    }
    // An empty prompt starts a document, as GPT-2's unconditional samples do.
    if (m.end_of_document < 0)
      throw Refusal(400, "the prompt is empty and the model has no end-of-document token to start from",
                    "invalid_request_error", "prompt");
    return {m.end_of_document};
  }
  std::vector<int32_t> ids;
  for (const json& t : p) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX)
      throw Refusal(400, "a prompt of token ids holds integers >= 0 only", "invalid_request_error", "prompt");
    ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  if (ids.empty()) throw Refusal(400, "a prompt of token ids is empty", "invalid_request_error", "prompt");
  return ids;
}

// The prompts of a completions request: a text, a list of texts, a list of ids, or a
// list of lists of ids.
std::vector<json> prompt_list(const json& p) {
  const bool one = p.is_string() || (p.is_array() && !p.empty() && p.front().is_number());
  if (one) return {p};
  if (!p.is_array() || p.empty())
    throw Refusal(400, "'prompt' must be a string, a list of strings, a list of token ids or a list of such lists",
                  "invalid_request_error", "prompt");
  std::vector<json> out;
  for (const json& x : p) {
    if (!x.is_string() && !x.is_array())
      throw Refusal(400, "'prompt' must be a string, a list of strings, a list of token ids or a list of such lists",
                    "invalid_request_error", "prompt");
    out.push_back(x);
  }
  return out;
}

// Text events of a streamed answer; every event after the client left is dropped.
class Events {
 public:
  explicit Events(EventStream& s) : s_(s) {}
  bool open() { return live_ = s_.open(); }
  bool send(const json& j) {
    if (live_) live_ = s_.send(dump(j));
    return live_;
  }
  void done() {
    if (live_) live_ = s_.send("[DONE]");
    s_.close();
  }
  // A refusal once the stream is open: its last event, as OpenAI's streams end.
  HttpAnswer fail(const json& error) {
    send(error);
    done();
    return {0, "", "", ""};
  }

 private:
  EventStream& s_;
  bool live_ = false;
};

// What names an OpenAI answer, and its chunks when streamed.
struct AnswerHead {
  std::string id, object, chunk_object;
  int64_t created = 0;
  std::string model;
};

// The end of an OpenAI answer: streamed, the usage as a last chunk (when asked for)
// and [DONE]; else the whole answer.
HttpAnswer finish_answer(Events& events, const Settings& s, const AnswerHead& head, const json& choices,
                         const json& usage) {
  if (!s.stream)
    return json_answer({{"id", head.id}, {"object", head.object}, {"created", head.created}, {"model", head.model},
                        {"choices", choices}, {"usage", usage}});
  if (s.usage_in_stream)
    events.send(json{{"id", head.id}, {"object", head.chunk_object}, {"created", head.created}, {"model", head.model},
                     {"choices", json::array()}, {"usage", usage}});
  events.done();
  return {0, "", "", ""};
}

HttpAnswer completions(const ServedModel& m, const std::string& body, EventStream& stream) {
  const Body b(body, {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options",
                      "stop", "seed", "echo", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
                      "best_of", "suffix", "user"});
  const Settings s = openai_settings(m, b, 16);
  const bool echo = b.boolean("echo", false);
  b.unsupported("suffix", "does not insert text", Body::Nothing::EmptyText);
  b.unsupported("logprobs", "returns no log-probabilities");
  if (b.get("best_of") && b.integer("best_of", 1, 1, 16) != s.n)
    throw Refusal(400, "'best_of' is not supported: loom serve returns every choice it generates", "invalid_request_error",
                  "best_of");
  std::vector<std::vector<int32_t>> prompts;
  for (const json& p : prompt_list(b.require("prompt"))) prompts.push_back(prompt_ids(m, p));
  if (prompts.size() > kMaxPrompts)
    throw Refusal(400, "'prompt' holds " + std::to_string(prompts.size()) + " prompts; a request takes " +
                           std::to_string(kMaxPrompts) + " at most", "invalid_request_error", "prompt");
  std::vector<int32_t> stops;
  if (m.end_of_document >= 0) stops.push_back(m.end_of_document);
  const std::string id = next_id("cmpl");
  const int64_t created = unix_time();
  auto chunk = [&](int64_t index, const std::string& text, const json& finish) {
    json c{{"index", index}, {"text", text}, {"logprobs", json()}, {"finish_reason", finish}};
    return json{{"id", id}, {"object", "text_completion"}, {"created", created}, {"model", m.name}, {"choices", {c}}};
  };
  Events events(stream);
  if (s.stream) events.open();
  json choices = json::array();
  int64_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
  bool started = false;
  try {
  for (size_t p = 0; p < prompts.size(); ++p) {
    prompt_tokens += static_cast<int64_t>(prompts[p].size());
    const std::string prompt_text = echo ? ReplyText(*m.codec, prompts[p]).context_text() : "";
    for (int64_t i = 0; i < s.n; ++i) {
      const int64_t index = static_cast<int64_t>(p) * s.n + i;
      if (s.stream && echo) events.send(chunk(index, prompt_text, json()));
      std::function<bool(const std::string&)> on_text;
      if (s.stream) on_text = [&](const std::string& t) { return events.send(chunk(index, t, json())); };
      const Choice c =
          run_choice(m, prompts[p], s, s.sampling.seed + static_cast<uint64_t>(i), stops, on_text, stream);
      started = started || c.started;
      completion_tokens += c.tokens;
      cached_tokens += c.cached;
      if (s.stream) events.send(chunk(index, "", c.finish_reason));
      choices.push_back({{"index", index}, {"text", prompt_text + c.text}, {"logprobs", json()},
                         {"finish_reason", c.finish_reason}});
    }
  }
  } catch (const Refusal& r) {
    if (!s.stream) throw;
    return events.fail(error_json(r.what(), r.type, r.param));
  }
  if (!started && !s.stream) throw Refusal(503, "the server is shutting down", "server_error");
  return finish_answer(events, s, {id, "text_completion", "text_completion", created, m.name}, choices,
                       usage_json(prompt_tokens, completion_tokens, cached_tokens));
}

HttpAnswer chat_completions(const ServedModel& m, const std::string& body, EventStream& stream) {
  const Body b(body, {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
                      "stream", "stream_options", "stop", "seed", "logprobs", "top_logprobs", "presence_penalty",
                      "frequency_penalty", "logit_bias", "user", "response_format", "tools", "tool_choice",
                      "parallel_tool_calls"});
  const Settings s = openai_settings(m, b, INT32_MAX);  // the reply ends at its end of turn, or at seq_length
  b.unsupported("tools", "writes no tool calls", Body::Nothing::Empty);
  b.unsupported("logprobs", "returns no log-probabilities", Body::Nothing::False);
  if (const json* choice = b.get("tool_choice"); choice && !(choice->is_string() && choice->get<std::string>() == "none"))
    throw Refusal(400, "'tool_choice' is not supported: loom serve writes no tool calls", "invalid_request_error",
                  "tool_choice");
  if (const json* format = b.get("response_format");
      format && !(format->is_object() && format->size() == 1 && format->value("type", "") == "text"))
    throw Refusal(400, "'response_format' is not supported beyond {\"type\": \"text\"}", "invalid_request_error",
                  "response_format");
  if (!m.chat) throw Refusal(400, "this server writes no chat: " + m.no_chat, "invalid_request_error", "messages");
  const json& messages = b.require("messages");
  for (size_t i = 0; messages.is_array() && i < messages.size(); ++i)
    for (auto it = messages[i].begin(); messages[i].is_object() && it != messages[i].end(); ++it)
      if (const std::string& key = it.key(); key != "role" && key != "content")
        throw Refusal(400, "message " + std::to_string(i + 1) + ": '" + key + "' is not supported (a message is " +
                               "{\"role\", \"content\"})", "invalid_request_error", "messages");
  text::Conversation conversation;
  try {
    conversation = text::conversation_from_json(json{{"messages", messages}});
  } catch (const std::exception& e) {
    throw Refusal(400, e.what(), "invalid_request_error", "messages");
  }
  std::vector<int32_t> prompt;
  try {
    prompt = m.chat->encode(*m.codec->tokenizer(), conversation, true).ids;
  } catch (const std::exception& e) {
    throw Refusal(400, std::string("the conversation cannot be written: ") + e.what(), "invalid_request_error",
                  "messages");
  }
  const std::string id = next_id("chatcmpl");
  const int64_t created = unix_time();
  auto chunk = [&](int64_t index, const json& delta, const json& finish) {
    json c{{"index", index}, {"delta", delta}, {"logprobs", json()}, {"finish_reason", finish}};
    return json{{"id", id}, {"object", "chat.completion.chunk"}, {"created", created}, {"model", m.name},
                {"choices", {c}}};
  };
  Events events(stream);
  if (s.stream) events.open();
  json choices = json::array();
  int64_t completion_tokens = 0, cached_tokens = 0;
  bool started = false;
  try {
  for (int64_t i = 0; i < s.n; ++i) {
    if (s.stream) events.send(chunk(i, {{"role", "assistant"}, {"content", ""}}, json()));
    std::function<bool(const std::string&)> on_text;
    if (s.stream) on_text = [&](const std::string& t) { return events.send(chunk(i, {{"content", t}}, json())); };
    const Choice c = run_choice(m, prompt, s, s.sampling.seed + static_cast<uint64_t>(i), m.chat_stops, on_text, stream);
    started = started || c.started;
    completion_tokens += c.tokens;
    cached_tokens += c.cached;
    if (s.stream) events.send(chunk(i, json::object(), c.finish_reason));
    choices.push_back({{"index", i}, {"message", {{"role", "assistant"}, {"content", c.text}}}, {"logprobs", json()},
                       {"finish_reason", c.finish_reason}});
  }
  } catch (const Refusal& r) {
    if (!s.stream) throw;
    return events.fail(error_json(r.what(), r.type, r.param));
  }
  if (!started && !s.stream) throw Refusal(503, "the server is shutting down", "server_error");
  return finish_answer(events, s, {id, "chat.completion", "chat.completion.chunk", created, m.name}, choices,
                       usage_json(static_cast<int64_t>(prompt.size()), completion_tokens, cached_tokens));
}

// Megatron-LM's text generation server (tools/run_text_generation_server.py): PUT /api.
HttpAnswer megatron_api(const ServedModel& m, const std::string& body, EventStream& client) {
  const Body b(body, {"prompts", "tokens_to_generate", "temperature", "top_k", "top_p", "random_seed", "logprobs",
                      "add_BOS", "stop_on_eol", "stop_on_double_eol", "prevent_newline_after_colon", "beam_width",
                      "no_log", "top_p_decay", "top_p_bound", "length_penalty"});
  const json& prompts = b.require("prompts");
  if (!prompts.is_array() || prompts.empty())
    throw Refusal(400, "'prompts' must be a list of strings", "invalid_request_error", "prompts");
  if (prompts.size() > kMaxPrompts)
    throw Refusal(400, "'prompts' holds " + std::to_string(prompts.size()) + " prompts; a request takes " +
                           std::to_string(kMaxPrompts) + " at most", "invalid_request_error", "prompts");
  Settings s;
  s.max_tokens = b.integer("tokens_to_generate", 64, 0, INT32_MAX);
  s.sampling.temperature = b.number("temperature", 1.0, 0.0, 100.0);
  s.sampling.top_k = b.integer("top_k", 0, 0, INT32_MAX);
  const double top_p = b.number("top_p", 0.0, 0.0, 1.0);  // 0: off, as Megatron-LM reads it
  s.sampling.top_p = top_p > 0.0 ? top_p : 1.0;
  const int64_t seed = b.integer("random_seed", -1, -1, INT64_MAX);
  s.sampling.seed = seed >= 0 ? static_cast<uint64_t>(seed) : random_seed();
  const bool add_bos = b.boolean("add_BOS", false);
  if (b.boolean("stop_on_double_eol", false)) s.stop_strings.push_back("\n\n");
  if (b.boolean("stop_on_eol", false)) s.stop_strings.push_back("\n");
  b.boolean("no_log", false);
  b.unsupported("logprobs", "returns no log-probabilities", Body::Nothing::False);
  b.unsupported("prevent_newline_after_colon", "does not constrain tokens", Body::Nothing::False);
  b.unsupported("beam_width", "does not search beams");
  b.unsupported("top_p_decay", "does not decay top_p", Body::Nothing::Zero);
  b.unsupported("top_p_bound", "does not decay top_p", Body::Nothing::Zero);
  b.unsupported("length_penalty", "does not search beams");
  if (add_bos && m.end_of_document < 0)
    throw Refusal(400, "'add_BOS': the model has no end-of-document token to start with", "invalid_request_error",
                  "add_BOS");
  std::vector<int32_t> stops;
  if (m.end_of_document >= 0) stops.push_back(m.end_of_document);
  json texts = json::array(), segments = json::array();
  for (size_t p = 0; p < prompts.size(); ++p) {
    if (!prompts[p].is_string()) throw Refusal(400, "'prompts' must be a list of strings", "invalid_request_error", "prompts");
    std::vector<int32_t> ids = prompt_ids(m, prompts[p]);
    if (add_bos && !prompts[p].get<std::string>().empty()) ids.insert(ids.begin(), m.end_of_document);
    // Megatron-LM answers the prompt with what follows it, and the text of each token.
    const Choice c = run_choice(m, ids, s, s.sampling.seed + p, stops, nullptr, client);
    if (!c.started && p == 0) throw Refusal(503, "the server is shutting down", "server_error");
    texts.push_back(ReplyText(*m.codec, ids).context_text() + c.text);
    json seg = json::array();
    for (int32_t t : ids) seg.push_back(m.codec->decode({t}));
    for (int32_t t : c.ids) seg.push_back(m.codec->decode({t}));
    segments.push_back(seg);
  }
  return json_answer({{"text", texts}, {"segments", segments}, {"logprobs", json()}});
}

HttpAnswer refuse(const Refusal& r) {
  return json_answer(error_json(r.what(), r.type, r.param), r.status);
}

}  // namespace

HttpAnswer error_answer(int status, const std::string& message) {
  return json_answer(error_json(message, status >= 500 ? "server_error" : "invalid_request_error", ""), status);
}

HttpAnswer answer_request(const ServedModel& m, const std::string& method, const std::string& target,
                          const std::string& body, EventStream& stream) {
  const std::string path = target.substr(0, target.find('?'));
  struct Route {
    const char* path;
    const char* method;
  };
  static const Route kRoutes[] = {{"/v1/completions", "POST"}, {"/v1/chat/completions", "POST"}, {"/api", "PUT"},
                                  {"/v1/models", "GET"},       {"/health", "GET"}};
  const Route* route = nullptr;
  for (const Route& r : kRoutes)
    if (path == r.path) route = &r;
  try {
    if (route == nullptr)
      throw Refusal(404, "no such path: " + path + " (POST /v1/completions, POST /v1/chat/completions, PUT /api, "
                         "GET /v1/models, GET /health)");
    if (method != route->method) {
      HttpAnswer a = refuse(Refusal(405, path + " takes " + route->method + ", not " + method));
      a.allow = route->method;
      return a;
    }
    if (path == "/health") return json_answer({{"status", "ok"}, {"model", m.name}});
    if (path == "/v1/models")
      return json_answer({{"object", "list"},
                          {"data", {{{"id", m.name}, {"object", "model"}, {"created", unix_time()}, {"owned_by", "loom"}}}}});
    if (!m.codec->has_text())
      throw Refusal(400, "the model has no tokenizer, so the server takes and writes no text: give --tokenizer");
    if (path == "/v1/completions") return completions(m, body, stream);
    if (path == "/v1/chat/completions") return chat_completions(m, body, stream);
    return megatron_api(m, body, stream);
  } catch (const Refusal& r) {
    return refuse(r);
  }
}

}  // namespace loom::cli
