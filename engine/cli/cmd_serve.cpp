// loom serve CHECKPOINT|MANIFEST|HF_DIR [--host H] [--port P] [--model-name NAME]
//   [--tokenizer PATH] [--chat-template NAME] [--set key=value]... [--plugin-path DIR]...
// An HTTP server of a trained model: OpenAI's completions and chat completions and
// Megatron-LM's PUT /api (serve_api.hpp), the model built once on its ranks
// (train::Generator) and each request run in turn. HTTP/1.1 by Boost.Beast, one thread
// per connection, keep-alive, streamed answers as server-sent events.
#include "engine/cli/args.hpp"
#include "engine/cli/commands.hpp"
#include "engine/cli/interrupt.hpp"
#include "engine/cli/model_source.hpp"
#include "engine/cli/serve_api.hpp"
#include "engine/runtime/launcher.hpp"
#include "engine/text/chat_template.hpp"
#include "engine/train/generation.hpp"
#include "engine/train/text_codec.hpp"

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <iomanip>
#include <iostream>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

namespace loom::cli {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

const char* kUsage =
    "usage: loom serve CHECKPOINT|MANIFEST|HF_DIR [options]\n"
    "  the model as loom generate takes it (a checkpoint, a manifest with weights, a Hugging Face\n"
    "  directory), served over HTTP until SIGINT/SIGTERM:\n"
    "    POST /v1/completions       OpenAI completions: prompt, max_tokens (16), temperature, top_p,\n"
    "                               top_k, seed, n, stop, echo, stream\n"
    "    POST /v1/chat/completions  OpenAI chat completions: messages, written with the chat template\n"
    "    PUT  /api                  Megatron-LM's text generation server: prompts, tokens_to_generate\n"
    "    GET  /v1/models, /health\n"
    "  --host H             the address to listen on (default 127.0.0.1; 0.0.0.0: every interface)\n"
    "  --port P             the port (default 8000; 0: one the system picks, printed)\n"
    "  --model-name NAME    the model's name in requests and answers (default: the path given)\n"
    "  --tokenizer PATH     as loom generate's (default: the run's data.tokenizer)\n"
    "  --chat-template T    chatml or llama3 (default: the run's data.chat_template, else the one the\n"
    "                       tokenizer's directory declares; without one, chat completions are refused)\n"
    "  --max-connections N  open connections at most (default 64); more are answered 503\n"
    "  --set key=value      the layout or device, as loom generate's (parallel.tp=2, device.kind=\"cuda\")\n"
    "Requests run one at a time. SIGINT/SIGTERM: no new connections, a generation in flight stops\n"
    "after its current token and is answered, then the server exits with status 0.\n";

constexpr size_t kMaxBodyBytes = 8u << 20;
// A connection has this long to send a whole request, from the end of the one before
// (or from its start): an idle keep-alive or a client that sends nothing (or a byte a
// minute) does not hold one of the --max-connections for ever.
constexpr auto kRequestTime = std::chrono::seconds(60);

std::atomic<int> g_stop{0};
extern "C" void on_serve_signal(int) { g_stop.store(1); }

// The open connections' sockets: a connection reading a request past its deadline is
// shut (the accept loop looks every 200 ms); at shutdown every read is ended (a client
// idle on keep-alive), while an answer being written still goes out.
class OpenSockets {
 public:
  using Clock = std::chrono::steady_clock;
  // false once reads have ended: the connection is not served.
  bool add(int fd) {
    std::lock_guard<std::mutex> lock(mu_);
    if (ended_) return false;
    deadlines_[fd] = Clock::now() + kRequestTime;
    return true;
  }
  void remove(int fd) {
    std::lock_guard<std::mutex> lock(mu_);
    deadlines_.erase(fd);
  }
  // The connection waits for a request (a deadline) or answers one (none).
  void reading(int fd, bool yes) {
    std::lock_guard<std::mutex> lock(mu_);
    deadlines_[fd] = yes ? Clock::now() + kRequestTime : Clock::time_point::max();
  }
  void shut_late() {
    std::lock_guard<std::mutex> lock(mu_);
    const Clock::time_point now = Clock::now();
    for (auto& [fd, deadline] : deadlines_)
      if (deadline < now) {
        ::shutdown(fd, SHUT_RDWR);
        deadline = Clock::time_point::max();
      }
  }
  void end_reads() {
    std::lock_guard<std::mutex> lock(mu_);
    ended_ = true;
    for (const auto& [fd, deadline] : deadlines_) ::shutdown(fd, SHUT_RD);
  }

 private:
  std::mutex mu_;
  std::map<int, Clock::time_point> deadlines_;
  bool ended_ = false;
};

// A streamed answer on the socket: chunked transfer, one chunk per event.
class SocketEvents : public EventStream {
 public:
  SocketEvents(tcp::socket& socket, unsigned version, bool keep_alive)
      : socket_(socket), version_(version), keep_alive_(keep_alive) {}
  bool open() override {
    http::response<http::empty_body> res{http::status::ok, version_};
    res.set(http::field::server, "loom");
    res.set(http::field::content_type, "text/event-stream");
    res.set(http::field::cache_control, "no-cache");
    res.keep_alive(keep_alive_);
    res.chunked(true);
    http::response_serializer<http::empty_body> sr{res};
    beast::error_code ec;
    http::write_header(socket_, sr, ec);
    opened_ = !ec;
    return ok_ = !ec;
  }
  bool send(const std::string& data) override {
    if (!ok_) return false;
    const std::string event = "data: " + data + "\n\n";
    beast::error_code ec;
    net::write(socket_, http::make_chunk(net::buffer(event)), ec);
    return ok_ = !ec;
  }
  void close() override {
    if (!ok_) return;
    beast::error_code ec;
    net::write(socket_, http::make_chunk_last(), ec);
    ok_ = !ec;
  }
  // The client closed its side (or reset it): nobody will read the answer.
  bool connected() override {
    pollfd p{socket_.native_handle(), POLLRDHUP, 0};
    return ::poll(&p, 1, 0) <= 0 || (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) == 0;
  }
  bool opened() const { return opened_; }
  bool ok() const { return ok_; }

 private:
  tcp::socket& socket_;
  unsigned version_;
  bool keep_alive_;
  bool opened_ = false, ok_ = false;
};

class Server {
 public:
  explicit Server(const ServedModel& model) : model(model) {}
  void log(const std::string& line) {
    std::lock_guard<std::mutex> lock(mu_);
    std::cerr << "loom serve: " << line << "\n" << std::flush;
  }
  // The model's ranks failed: no more requests.
  void fail(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_) error_ = why;
    failed_ = true;
  }
  bool failed() const { return failed_; }
  std::string error() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

  const ServedModel& model;
  OpenSockets sockets;

 private:
  std::mutex mu_;
  std::atomic<bool> failed_{false};
  std::string error_;
};

// A request the parser refused (not HTTP, a bad header), as opposed to a connection
// that ended.
bool is_bad_request(const beast::error_code& ec) {
  return ec.category() == http::make_error_code(http::error::bad_method).category() &&
         ec != http::error::end_of_stream && ec != http::error::partial_message;
}

bool write_answer(tcp::socket& socket, unsigned version, bool keep_alive, const HttpAnswer& a) {
  http::response<http::string_body> res{static_cast<http::status>(a.status), version};
  res.set(http::field::server, "loom");
  res.set(http::field::content_type, a.content_type);
  if (!a.allow.empty()) res.set(http::field::allow, a.allow);
  res.keep_alive(keep_alive);
  res.body() = a.body;
  res.prepare_payload();
  beast::error_code ec;
  http::write(socket, res, ec);
  return !ec;
}

// One connection (its socket added to server.sockets): requests in turn until the
// client closes it, a request that cannot be read, or shutdown.
void serve_connection(Server& server, tcp::socket socket) {
  const int fd = socket.native_handle();
  beast::flat_buffer buffer;
  for (;;) {
    server.sockets.reading(fd, true);
    http::request_parser<http::string_body> parser;
    parser.body_limit(kMaxBodyBytes);
    beast::error_code ec;
    http::read_header(socket, buffer, parser, ec);
    if (!ec && parser.get()[http::field::expect] == "100-continue") {  // curl's, for bodies over 1 KB
      http::response<http::empty_body> go_on{http::status::continue_, parser.get().version()};
      http::write(socket, go_on, ec);
    }
    // A transfer coding other than chunked would leave the body unread, to be taken for
    // the next request: refused, and the connection closed.
    const auto coding = parser.get().find(http::field::transfer_encoding);
    if (!ec && coding != parser.get().end() && !beast::iequals(coding->value(), "chunked")) {
      write_answer(socket, parser.get().version(), false,
                   error_answer(501, "Transfer-Encoding " + std::string(coding->value()) + " is not taken (chunked is)"));
      server.log("a request with Transfer-Encoding " + std::string(coding->value()) + ": 501");
      break;
    }
    if (!ec && !parser.is_done()) http::read(socket, buffer, parser, ec);
    if (ec) {
      // A request that is not HTTP, or too large, is answered before the connection closes.
      if (ec == http::error::body_limit) {
        write_answer(socket, 11, false, error_answer(413, "the body is over " + std::to_string(kMaxBodyBytes) + " bytes"));
        server.log("a request over " + std::to_string(kMaxBodyBytes) + " bytes: 413");
      } else if (is_bad_request(ec)) {
        write_answer(socket, 11, false, error_answer(400, "the request is not HTTP/1.1: " + ec.message()));
        server.log("a request that is not HTTP/1.1 (" + ec.message() + "): 400");
      }
      break;
    }
    server.sockets.reading(fd, false);
    const http::request<http::string_body>& req = parser.get();
    const bool keep_alive = req.keep_alive() && g_stop.load() == 0;
    const auto t0 = std::chrono::steady_clock::now();
    SocketEvents events(socket, req.version(), keep_alive);
    HttpAnswer a;
    try {
      a = answer_request(server.model, std::string(req.method_string()), std::string(req.target()), req.body(), events);
    } catch (const runtime::RunError& e) {
      server.fail(e.what());
      a = error_answer(500, std::string("the model's ranks failed: ") + e.what());
    } catch (const std::exception& e) {
      a = error_answer(500, e.what());
    }
    bool written = true, cut = false;
    if (events.opened() && a.status != 0) {  // a failure after the stream began: its last event
      events.send(a.body);
      events.close();
      cut = true;  // without [DONE]; the connection ends
    } else if (a.status == 0) {
      written = events.ok();
    } else {
      written = write_answer(socket, req.version(), keep_alive && !server.failed(), a);
    }
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::ostringstream line;
    line << req.method_string() << " " << req.target() << " " << (a.status == 0 ? 200 : a.status)
         << (a.status == 0 ? " (stream)" : "") << std::fixed << std::setprecision(1) << " " << ms << " ms"
         << (written ? "" : " (the client left before the answer)");
    server.log(line.str());
    if (!written || cut || !keep_alive || server.failed()) break;
  }
  server.sockets.remove(fd);
  beast::error_code ignored;
  socket.shutdown(tcp::socket::shutdown_both, ignored);
}

tcp::endpoint listen_endpoint(const std::string& host, int port) {
  beast::error_code ec;
  const net::ip::address address = net::ip::make_address(host == "localhost" ? "127.0.0.1" : host, ec);
  if (ec) throw UsageError("--host " + host + " is not an IP address (e.g. 127.0.0.1, 0.0.0.0, ::1)");
  return tcp::endpoint(address, static_cast<unsigned short>(port));
}

// The model's chat template, or why there is none.
void find_chat(ServedModel& m, const Args& args, const train::TextCodec& codec, const manifest::RunConfig& config) {
  const std::string named = chat_template_option(args);
  if (codec.tokenizer() == nullptr) {
    if (!named.empty()) throw UsageError("--chat-template needs the model's tokenizer (" + codec.describe() + "); give --tokenizer");
    m.no_chat = "the model has no tokenizer to write a chat template with (" + codec.describe() + ")";
    return;
  }
  try {
    text::ChatTemplate chat = text::resolve_chat_template(named.empty() ? config.data.chat_template : named,
                                                          args.get("--tokenizer").value_or(config.data.tokenizer),
                                                          "start loom serve with --chat-template");
    chat.require_special_tokens(*codec.tokenizer());
    m.chat_stops = {chat.end_of_turn(*codec.tokenizer())};
    const int64_t end = config.data.eod_token >= 0 ? config.data.eod_token : chat.end_of_conversation(*codec.tokenizer());
    if (end >= 0) m.chat_stops.push_back(static_cast<int32_t>(end));
    m.chat = std::move(chat);
  } catch (const std::exception& e) {
    if (!named.empty()) throw;  // asked for by name: an error, not a server without chat
    m.no_chat = e.what();
  }
}

}  // namespace

int cmd_serve(int argc, char** argv) {
  try {
    Args args(argc, argv, {},
              {"--host", "--port", "--model-name", "--tokenizer", "--chat-template", "--max-connections", "--set",
               "--plugin-path"});
    if (args.flag("--help")) {
      std::cout << kUsage;
      return 0;
    }
    if (args.positionals().size() != 1) throw UsageError("serve takes one CHECKPOINT, MANIFEST or HF_DIR");
    const long long port = args.get_int("--port", 8000);
    if (port < 0 || port > 65535) throw UsageError("--port must be in [0, 65535]");
    const long long max_connections = args.get_int("--max-connections", 64);
    if (max_connections < 1) throw UsageError("--max-connections must be >= 1");
    const tcp::endpoint endpoint = listen_endpoint(args.get("--host").value_or("127.0.0.1"), static_cast<int>(port));
    chat_template_option(args);  // a usage error before anything loads
    if (runtime::detect_process_launch().multi_process)
      throw UsageError("loom serve runs every rank as a thread of one process; start it without " +
                       runtime::detect_process_launch().launcher);

    // The port first: one in use is said before a model loads for minutes. Connections
    // made while it loads wait in the listen queue.
    net::io_context ioc;
    tcp::acceptor acceptor(ioc);
    beast::error_code ec;
    acceptor.open(endpoint.protocol(), ec);
    if (!ec) acceptor.set_option(net::socket_base::reuse_address(true), ec);
    if (!ec) acceptor.bind(endpoint, ec);
    if (!ec) acceptor.listen(net::socket_base::max_listen_connections, ec);
    if (ec)
      throw loom::Error("cannot listen on " + endpoint.address().to_string() + ":" + std::to_string(endpoint.port()) +
                        ": " + ec.message());
    // Loading ends at once on a signal (nothing is written); serving stops in good order.
    std::optional<ExitOnSignal> while_loading(std::in_place, "loom serve");
    plugins::Registry& r = plugins::registry();
    r.load_dirs(plugins::Registry::search_paths(args.all("--plugin-path")));
    ModelSource src = load_model_source(args.positionals()[0], args.all("--set"), r, train::generation_plan);
    const train::TextCodec codec(args.get("--tokenizer").value_or(""), src.plan.config);
    codec.require_fits(src.vocab);
    ServedModel model;
    model.name = args.get("--model-name").value_or(args.positionals()[0]);
    model.codec = &codec;
    find_chat(model, args, codec, src.plan.config);
    const int64_t trained_eod = src.plan.config.data.eod_token;
    model.end_of_document = static_cast<int32_t>(trained_eod >= 0 ? trained_eod : codec.eod());
    model.vocab = codec.vocab();
    train::Generator generator(src.plan, src.weights, src.vocab);
    src.weights = {};  // on the ranks now
    model.generate = [&](const train::GenerationRequest& req) { return generator.generate(req); };
    model.shutting_down = &g_stop;

    while_loading.reset();
    for (int sig : {SIGINT, SIGTERM}) std::signal(sig, on_serve_signal);
    std::signal(SIGPIPE, SIG_IGN);  // a client gone mid-answer is a failed write, not the end of the server

    Server server(model);
    const tcp::endpoint bound = acceptor.local_endpoint();
    server.log("serving " + model.name + " (tp " + std::to_string(src.plan.sizes.tp) + ", pp " +
               std::to_string(src.plan.sizes.pp) + ", " + src.plan.config.device.kind + ", chat " +
               (model.chat ? model.chat->name() : "off: " + model.no_chat) + ") on http://" +
               (bound.address().is_v6() ? "[" + bound.address().to_string() + "]" : bound.address().to_string()) +
               ":" + std::to_string(bound.port()));

    struct Connection {
      std::thread thread;
      std::atomic<bool> done{false};
    };
    std::list<Connection> connections;
    while (g_stop.load() == 0 && !server.failed()) {
      server.sockets.shut_late();
      pollfd ready{acceptor.native_handle(), POLLIN, 0};
      if (::poll(&ready, 1, 200) <= 0) continue;  // a timeout, or a signal: look at the flags again
      tcp::socket socket(ioc);
      acceptor.accept(socket, ec);
      if (ec) continue;
      for (auto it = connections.begin(); it != connections.end();)  // the finished ones
        if (it->done) {
          it->thread.join();
          it = connections.erase(it);
        } else {
          ++it;
        }
      if (static_cast<long long>(connections.size()) >= max_connections) {
        write_answer(socket, 11, false,
                     error_answer(503, "the server has " + std::to_string(max_connections) + " connections open"));
        continue;
      }
      if (!server.sockets.add(socket.native_handle())) break;
      Connection& c = connections.emplace_back();
      c.thread = std::thread([&server, &c, s = std::move(socket)]() mutable {
        serve_connection(server, std::move(s));
        c.done = true;
      });
    }
    acceptor.close(ec);
    server.sockets.end_reads();
    for (Connection& c : connections) c.thread.join();
    if (server.failed()) {
      std::cerr << "loom serve: stopped: the model's ranks failed: " << server.error() << "\n";
      return 1;
    }
    server.log("stopped");
    return 0;
  } catch (const UsageError& e) {
    std::cerr << "loom serve: " << e.what() << "\n" << kUsage;
    return 2;
  } catch (const manifest::ManifestError& e) {
    std::cerr << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "loom serve: " << runtime::error_message(e) << "\n";
    return 1;
  }
}

}  // namespace loom::cli
