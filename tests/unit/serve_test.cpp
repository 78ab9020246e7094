// `loom serve`'s API apart from the sockets (engine/cli/serve_api.hpp) and the reply
// text it streams (engine/cli/reply_text.hpp), on the synthetic addition task's symbols
// ("0".."9" = ids 0..9, "+" 10, "=" 11, "|" 12) with a scripted generator: each request
// draws the script's tokens, so what the API makes of them is checked exactly. The
// real model behind the API is checked by tests/cli/serve_test.sh (answers equal to
// loom generate's) and the Generator by generation_test.cpp.
#include "support/rank_trace.hpp"

#include "engine/cli/reply_text.hpp"
#include "engine/cli/serve_api.hpp"
#include "engine/runtime/launcher.hpp"
#include "engine/train/text_codec.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace {

using loom::cli::answer_request;
using loom::cli::HttpAnswer;
using nlohmann::json;

const loom::train::TextCodec& codec() {
  static const loom::train::TextCodec c("", loom::testing::plan_from(loom::testing::tiny_manifest(), {}).config);
  return c;
}

std::vector<int32_t> ids(const std::string& text) { return codec().encode(text); }

TEST(ReplyText, GivesEachTokensTextAndHoldsBackAStopStringsStart) {
  loom::cli::ReplyText plain(codec(), ids("12+34="));
  EXPECT_EQ(plain.context_text(), "12+34=");
  EXPECT_EQ(plain.add(4), "4");
  EXPECT_EQ(plain.add(6), "6");
  EXPECT_EQ(plain.finish(), "");
  EXPECT_EQ(plain.text(), "46");

  loom::cli::ReplyText r(codec(), ids("1="), {"34|", "9"});
  EXPECT_EQ(r.add(1), "1");
  EXPECT_EQ(r.add(3), "");   // may start "34|"
  EXPECT_EQ(r.add(4), "");   // still may
  EXPECT_EQ(r.add(5), "345");  // it did not
  EXPECT_FALSE(r.stopped());
  EXPECT_EQ(r.add(3), "");
  EXPECT_EQ(r.add(4), "");
  EXPECT_EQ(r.add(12), "");  // "34|": the reply ends before it
  EXPECT_TRUE(r.stopped());
  EXPECT_EQ(r.add(9), "");
  EXPECT_EQ(r.finish(), "");
  EXPECT_EQ(r.text(), "1345");

  loom::cli::ReplyText tail(codec(), ids("1="), {"34|"});
  EXPECT_EQ(tail.add(2), "2");
  EXPECT_EQ(tail.add(3), "");
  EXPECT_EQ(tail.finish(), "3");  // a stop string's start that never finished is text
  EXPECT_EQ(tail.text(), "23");
}

// A generator that draws `script` (up to max_new_tokens, ending at a stop token or the
// stop signal, as the Generator does) and notes each request.
struct Scripted {
  std::vector<int32_t> script;
  std::vector<loom::train::GenerationRequest> seen;
  loom::train::GenerationResult operator()(const loom::train::GenerationRequest& req) {
    seen.push_back(req);
    loom::train::GenerationResult r;
    for (int32_t t : script) {
      if (static_cast<int64_t>(r.tokens.size()) == req.max_new_tokens) break;
      const bool stop_signal = req.stop_signal && req.stop_signal->load() != 0;  // as all-reduced before this token
      r.tokens.push_back(t);
      if (req.on_token) req.on_token(t);
      if (std::find(req.stop_tokens.begin(), req.stop_tokens.end(), t) != req.stop_tokens.end()) break;
      if (stop_signal) {
        r.interrupted = true;
        break;
      }
    }
    return r;
  }
};

struct Events : loom::cli::EventStream {
  bool open() override { return opened = true; }
  bool connected() override { return ++connected_calls <= connected_for; }
  int connected_calls = 0, connected_for = 1 << 30;
  bool send(const std::string& data) override {
    events.push_back(data);
    return static_cast<int>(events.size()) < gone_after;
  }
  void close() override { closed = true; }
  bool opened = false, closed = false;
  int gone_after = 1 << 30;
  std::vector<std::string> events;
};

struct Api {
  Scripted gen;
  loom::cli::ServedModel model;
  std::atomic<int> shutting_down{0};
  Events events;
  explicit Api(std::vector<int32_t> script) {
    gen.script = std::move(script);
    model.name = "tiny";
    model.codec = &codec();
    model.no_chat = "no tokenizer";
    model.end_of_document = 12;  // "|"
    model.generate = [this](const loom::train::GenerationRequest& r) { return gen(r); };
    model.shutting_down = &shutting_down;
  }
  HttpAnswer call(const std::string& method, const std::string& path, const std::string& body) {
    return answer_request(model, method, path, body, events);
  }
  json post(const std::string& path, const json& body, int want_status = 200) {
    const HttpAnswer a = call(path == "/api" ? "PUT" : "POST", path, body.dump());
    EXPECT_EQ(a.status, want_status) << a.body;
    return a.status == 0 ? json() : json::parse(a.body);
  }
  std::string refusal(const std::string& path, const json& body, int status = 400) {
    const json j = post(path, body, status);
    return j.contains("error") ? j["error"]["message"].get<std::string>() : j.dump();
  }
};

TEST(ServeApi, CompletionsWriteTheDrawnTokensAndEndAtTheEndOfDocument) {
  Api api({4, 6, 12, 7});
  const json j = api.post("/v1/completions", {{"model", "tiny"}, {"prompt", "12+34="}, {"temperature", 0}, {"seed", 3}});
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["model"], "tiny");
  EXPECT_EQ(j["choices"][0]["text"], "46");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(j["usage"], json({{"prompt_tokens", 6}, {"completion_tokens", 3}, {"total_tokens", 9},
                               {"prompt_tokens_details", {{"cached_tokens", 0}}}}));
  ASSERT_EQ(api.gen.seen.size(), 1u);
  const loom::train::GenerationRequest& req = api.gen.seen[0];
  EXPECT_EQ(req.prompt, ids("12+34="));
  EXPECT_EQ(req.max_new_tokens, 16);  // OpenAI's default
  EXPECT_EQ(req.sampling.temperature, 0.0);
  EXPECT_EQ(req.sampling.seed, 3u);
  EXPECT_EQ(req.stop_tokens, std::vector<int32_t>{12});

  // Token ids, two prompts, two choices each (seeds 5 and 6), echo, max_tokens.
  const json k = api.post("/v1/completions", {{"prompt", json::array({json::array({1, 2}), json::array({3})})}, {"n", 2}, {"seed", 5}, {"echo", true},
                                             {"max_tokens", 1}, {"top_k", 4}, {"top_p", 0.5}});
  ASSERT_EQ(k["choices"].size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(k["choices"][i]["index"], i);
    EXPECT_EQ(k["choices"][i]["text"], std::string(i < 2 ? "12" : "3") + "4");
    EXPECT_EQ(k["choices"][i]["finish_reason"], "length");
    EXPECT_EQ(api.gen.seen[1 + i].sampling.seed, 5u + static_cast<uint64_t>(i % 2));
    EXPECT_EQ(api.gen.seen[1 + i].sampling.top_k, 4);
    EXPECT_EQ(api.gen.seen[1 + i].sampling.top_p, 0.5);
  }
  EXPECT_EQ(k["usage"]["prompt_tokens"], 3);  // each prompt counted once
  // An empty prompt starts a document.
  api.post("/v1/completions", {{"prompt", ""}, {"max_tokens", 2}});
  EXPECT_EQ(api.gen.seen.back().prompt, std::vector<int32_t>{12});
}

TEST(ServeApi, StopStringsEndTheTextAndTheGeneration) {
  Api api({4, 6, 3, 4, 5, 5, 5});
  const json j = api.post("/v1/completions", {{"prompt", "1="}, {"stop", json::array({"34", "99"})}});
  EXPECT_EQ(j["choices"][0]["text"], "46");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  // The completion's tokens are those up to the one completing "34": 4 6 3 4 (the stop
  // takes hold with the next token, 5, drawn but not the completion's).
  EXPECT_EQ(j["usage"]["completion_tokens"], 4);
  EXPECT_EQ(api.gen.seen.size(), 1u);
}

TEST(ServeApi, AStreamSendsEachTokensTextThenTheFinishAndDone) {
  Api api({4, 3, 6, 12});
  const HttpAnswer a = api.call("POST", "/v1/completions",
                                json{{"prompt", "1="}, {"stream", true}, {"stop", "36"},
                                     {"stream_options", {{"include_usage", true}}}}.dump());
  EXPECT_EQ(a.status, 0);
  EXPECT_TRUE(api.events.opened);
  EXPECT_TRUE(api.events.closed);
  std::string text;
  std::vector<json> chunks;
  for (size_t i = 0; i + 1 < api.events.events.size(); ++i) chunks.push_back(json::parse(api.events.events[i]));
  ASSERT_GE(chunks.size(), 3u);
  for (size_t i = 0; i + 2 < chunks.size(); ++i) {
    EXPECT_TRUE(chunks[i]["choices"][0]["finish_reason"].is_null());
    text += chunks[i]["choices"][0]["text"].get<std::string>();
  }
  EXPECT_EQ(text, "4");  // "3" held back as the start of "36", which came
  EXPECT_EQ(chunks[chunks.size() - 2]["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(chunks.back()["usage"]["completion_tokens"], 3);
  EXPECT_EQ(api.events.events.back(), "[DONE]");
}

TEST(ServeApi, AClientThatLeavesAStreamStopsTheGeneration) {
  Api api({1, 2, 3, 4, 5, 6, 7, 8, 9});
  api.events.gone_after = 2;  // the second event fails
  const HttpAnswer a = api.call("POST", "/v1/completions", json{{"prompt", "1="}, {"stream", true}}.dump());
  EXPECT_EQ(a.status, 0);
  ASSERT_EQ(api.gen.seen.size(), 1u);
  EXPECT_EQ(api.events.events.size(), 2u);  // nothing sent after the failure
}

TEST(ServeApi, ShutdownStopsAGenerationAndRefusesTheNext) {
  Api api({1, 2, 3, 4, 5, 6, 7, 8, 9});
  api.model.generate = [&api](const loom::train::GenerationRequest& r) {
    api.shutting_down = 1;  // a signal while the model runs
    return api.gen(r);
  };
  const json j = api.post("/v1/completions", {{"prompt", "1="}});
  EXPECT_EQ(j["choices"][0]["finish_reason"], "abort");
  EXPECT_EQ(j["usage"]["completion_tokens"], 2);
  EXPECT_NE(api.refusal("/v1/completions", {{"prompt", "1="}}, 503).find("shutting down"), std::string::npos);
}

// A request with several choices cut by a shutdown answers them all: the running one
// up to its token, the ones not begun empty, each "abort".
TEST(ServeApi, ShutdownAnswersEveryChoiceOfARequest) {
  Api api({1, 2, 3, 4, 5, 6, 7, 8, 9});
  api.model.generate = [&api](const loom::train::GenerationRequest& r) {
    api.shutting_down = 1;
    return api.gen(r);
  };
  const json j = api.post("/v1/completions", {{"prompt", "1="}, {"n", 2}});
  ASSERT_EQ(j["choices"].size(), 2u);
  EXPECT_EQ(j["choices"][0]["text"], "12");
  EXPECT_EQ(j["choices"][1]["text"], "");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "abort");
  EXPECT_EQ(j["choices"][1]["finish_reason"], "abort");
  EXPECT_EQ(api.gen.seen.size(), 1u);
}

// A client that leaves a request that is not streamed cuts it after the current token.
TEST(ServeApi, AClientThatLeavesCutsTheGeneration) {
  Api api({1, 2, 3, 4, 5, 6, 7, 8, 9});
  api.events.connected_for = 3;  // the check before it starts, then after tokens 1 and 2
  const json j = api.post("/v1/completions", {{"prompt", "1="}});
  EXPECT_EQ(j["choices"][0]["finish_reason"], "abort");
  EXPECT_EQ(j["usage"]["completion_tokens"], 4);
}

TEST(ServeApi, MegatronsApiAnswersThePromptWithItsContinuation) {
  Api api({4, 6, 12});
  const json j = api.post("/api", {{"prompts", json::array({"12+34=", "1="})}, {"tokens_to_generate", 5}, {"top_k", 1},
                                   {"random_seed", 9}, {"top_p", 0.0}});
  EXPECT_EQ(j["text"], json::array({"12+34=46", "1=46"}));
  EXPECT_EQ(j["segments"][1], json::array({"1", "=", "4", "6", "|"}));
  EXPECT_EQ(api.gen.seen[0].sampling.top_p, 1.0);  // 0: off
  EXPECT_EQ(api.gen.seen[0].sampling.seed, 9u);
  EXPECT_EQ(api.gen.seen[1].sampling.seed, 10u);
  EXPECT_EQ(api.gen.seen[0].max_new_tokens, 5);
  api.post("/api", {{"prompts", json::array({"1="})}, {"stop_on_eol", true}, {"add_BOS", true}});
  EXPECT_EQ(api.gen.seen.back().prompt, (std::vector<int32_t>{12, 1, 11}));
}

TEST(ServeApi, RequestsItCannotServeAreRefusedByName) {
  Api api({4});
  auto has = [](const std::string& message, const std::string& part) {
    return message.find(part) != std::string::npos;
  };
  EXPECT_TRUE(has(api.refusal("/v1/completions", {{"prompt", "1"}, {"temprature", 1}}), "unrecognized request argument: temprature"));
  EXPECT_TRUE(has(api.refusal("/v1/completions", {{"prompt", "1"}, {"logprobs", 2}}), "'logprobs' is not supported"));
  EXPECT_TRUE(has(api.refusal("/v1/completions", {{"prompt", "1"}, {"presence_penalty", 0.5}}), "no penalties"));
  EXPECT_TRUE(has(api.refusal("/v1/completions", {{"prompt", "1"}, {"temperature", -1}}), "'temperature' must be"));
  EXPECT_TRUE(has(api.refusal("/v1/completions", {{"prompt", "1"}, {"max_tokens", 1.5}}), "'max_tokens' must be an integer"));
  EXPECT_TRUE(has(api.refusal("/v1/completions", {{"prompt", "1"}, {"n", 17}}), "'n' must be an integer in [1, 16]"));
  EXPECT_TRUE(has(api.refusal("/v1/completions", {{"prompt", "1"}, {"stop", json::array({"a", ""})}}), "not empty"));
  EXPECT_TRUE(has(api.refusal("/v1/completions", {{"prompt", json::array({json::array({1, -2})})}}), "integers >= 0"));
  EXPECT_TRUE(has(api.refusal("/v1/completions", {{"prompt", "1"}, {"model", "gpt-4"}}, 404), "is not served here"));
  EXPECT_TRUE(has(api.refusal("/v1/completions", {{"max_tokens", 2}}), "'prompt' is required"));
  EXPECT_TRUE(has(api.refusal("/v1/completions", {{"prompt", "1"}, {"stream_options", {{"include_usage", true}}}}),
                  "goes with \"stream\": true"));
  EXPECT_TRUE(has(api.refusal("/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "1"}}}}}),
                  "this server writes no chat: no tokenizer"));
  EXPECT_TRUE(has(api.refusal("/api", {{"prompts", json::array({"1"})}, {"logprobs", true}}), "'logprobs' is not supported"));
  EXPECT_TRUE(has(api.refusal("/api", {{"prompts", "1"}}), "'prompts' must be a list of strings"));
  EXPECT_TRUE(has(api.refusal("/v1/completions", {{"prompt", "1"}, {"seed", 9223372036854775808ull}}), "'seed' must be"));
  EXPECT_TRUE(has(api.refusal("/v1/completions", {{"prompt", "1"}, {"logprobs", 0}}), "'logprobs' is not supported"));
  EXPECT_TRUE(has(api.refusal("/v1/completions", {{"prompt", "1"}, {"user", 5}}), "'user' must be a string"));
  EXPECT_TRUE(has(api.refusal("/v1/completions", {{"prompt", std::vector<std::string>(129, "1")}}), "128 at most"));
  api.model.chat = loom::text::ChatTemplate::named("chatml");
  EXPECT_TRUE(has(api.refusal("/v1/chat/completions",
                              {{"messages", json::array({{{"role", "user"}, {"content", "1"}, {"name", "x"}}})}}),
                  "message 1: 'name' is not supported"));
  api.model.chat.reset();
  const std::string deep = "{\"prompt\": " + std::string(100000, '[') + std::string(100000, ']') + "}";
  const HttpAnswer too_deep = api.call("POST", "/v1/completions", deep);
  EXPECT_EQ(too_deep.status, 400);
  EXPECT_TRUE(has(too_deep.body, "nests deeper than 32 levels")) << too_deep.body;
  const HttpAnswer not_json = api.call("POST", "/v1/completions", "{\"prompt\": ");
  EXPECT_EQ(not_json.status, 400);
  EXPECT_TRUE(has(not_json.body, "the body is not JSON"));
  EXPECT_EQ(api.call("POST", "/v1/completions", "[1]").status, 400);
  const HttpAnswer wrong_method = api.call("GET", "/v1/completions", "");
  EXPECT_EQ(wrong_method.status, 405);
  EXPECT_EQ(wrong_method.allow, "POST");
  EXPECT_EQ(api.call("GET", "/v2/anything", "").status, 404);
  EXPECT_EQ(api.call("GET", "/health?x=1", "").status, 200);
  EXPECT_EQ(json::parse(api.call("GET", "/v1/models", "").body)["data"][0]["id"], "tiny");
  // What the generator refuses (a token outside the vocabulary) is the request's fault.
  api.model.generate = [](const loom::train::GenerationRequest&) -> loom::train::GenerationResult {
    throw loom::Error("prompt token 99 is outside the vocabulary [0, 13)");
  };
  EXPECT_TRUE(has(api.refusal("/v1/completions", {{"prompt", json::array({99})}}), "outside the vocabulary"));
  // The model's ranks failing is the server's end, not a refusal.
  api.model.generate = [](const loom::train::GenerationRequest&) -> loom::train::GenerationResult {
    throw loom::runtime::RunError("rank 0 failed: device lost");
  };
  EXPECT_THROW(api.call("POST", "/v1/completions", json{{"prompt", "1"}}.dump()), loom::runtime::RunError);
  EXPECT_TRUE(api.gen.seen.empty());
}

}  // namespace
