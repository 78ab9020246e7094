// The HTTP API of `loom serve`, apart from the sockets (cmd_serve.cpp's): a request's
// method, path and body in, the answer out.
//   POST /v1/completions       OpenAI's completions (prompt: text, texts, ids or lists
//                              of ids; max_tokens, temperature, top_p, top_k, seed, n,
//                              stop, echo, stream)
//   POST /v1/chat/completions  OpenAI's chat completions (messages written with the
//                              model's chat template; the reply ends at the end of turn)
//   PUT  /api                  Megatron-LM's text generation server (prompts,
//                              tokens_to_generate, temperature, top_k, top_p,
//                              random_seed, add_BOS, stop_on_eol, stop_on_double_eol)
//   GET  /v1/models, /health
// Fields the server does not implement (logprobs, penalties, logit_bias, tools, beam
// search) are refused by name rather than ignored; so is any field it does not know.
// Requests run one at a time, each choice of each prompt in turn (batch size one).
#pragma once

#include "engine/text/chat_template.hpp"
#include "engine/train/generation.hpp"
#include "engine/train/text_codec.hpp"

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace loom::cli {

struct HttpAnswer {
  int status = 200;  // 0: sent already, as an event stream
  std::string content_type = "application/json";
  std::string body;
  std::string allow;  // 405: the methods the path takes
};

// The client of a request: where a streamed answer ("stream": true) goes, as
// server-sent events. Each call returns false once the client is gone; the generation
// then stops.
class EventStream {
 public:
  virtual ~EventStream() = default;
  virtual bool open() = 0;                         // status 200, text/event-stream
  virtual bool send(const std::string& data) = 0;  // one event: "data: DATA\n\n"
  virtual void close() = 0;                        // the end of the stream
  // Whether the client is still there (streamed or not): a request whose client left is
  // cut after the current token, nobody reading its answer.
  virtual bool connected() { return true; }
};

struct ServedModel {
  std::string name;                          // "model" in requests and answers
  const train::TextCodec* codec = nullptr;   // text in and out (has_text)
  std::optional<text::ChatTemplate> chat;    // none: chat completions are refused, saying
  std::string no_chat;                       // why
  std::vector<int32_t> chat_stops;           // the end of a turn, and of a conversation
  int32_t end_of_document = -1;              // completions stop at it (-1: none)
  int64_t vocab = 0;                         // drawable tokens: the tokenizer's (0: the model's)
  std::function<train::GenerationResult(const train::GenerationRequest&)> generate;
  const std::atomic<int>* shutting_down = nullptr;  // non-zero: a generation stops after its token
};

// The answer to one request. Throws runtime::RunError when the model's ranks failed
// (the server cannot go on); every other problem is an answer (400, 404, 405, 500).
HttpAnswer answer_request(const ServedModel& model, const std::string& method, const std::string& target,
                          const std::string& body, EventStream& stream);

// An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}.
HttpAnswer error_answer(int status, const std::string& message);

}  // namespace loom::cli
