// loom C++ layer: status/exception bridging, logging, options, rank services.
// Header-only; compiled into every plugin (and the engine). Nothing here crosses
// the ABI: the C tables in loom_abi.h are built from these classes.
#pragma once

#include <loom/loom_abi.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace loom {

// Bytes of one element of a LOOM_DTYPE_*; 0 for a value that is none of them. The one
// table of element sizes, for the engine and every plugin.
constexpr size_t dtype_size(int32_t dtype) noexcept {
  switch (dtype) {
    case LOOM_DTYPE_U8: return 1;
    case LOOM_DTYPE_BF16: case LOOM_DTYPE_F16: return 2;
    case LOOM_DTYPE_F32: case LOOM_DTYPE_I32: return 4;
    case LOOM_DTYPE_F64: case LOOM_DTYPE_I64: return 8;
    default: return 0;
  }
}

// The host table of this module (one per shared object; set by the entry point,
// or by the engine for itself).
inline const loom_host_api*& host_slot() {
  static const loom_host_api* host = nullptr;
  return host;
}
inline const loom_host_api& host() {
  const loom_host_api* h = host_slot();
  if (h == nullptr) throw std::logic_error("loom: host API used before loom_plugin_init");
  return *h;
}

// The exception a plugin (or the engine) throws; it becomes a loom_status at the edge.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message, int32_t code = LOOM_CODE_INTERNAL)
      : std::runtime_error(message), code_(code) {}
  int32_t code() const { return code_; }

 private:
  int32_t code_;
};

// Turns a status returned by the other side into an exception (and frees it).
inline void check(loom_status status) {
  if (status == nullptr) return;
  const loom_host_api& h = host();
  std::string message = h.status_message(status);
  int32_t code = h.status_code(status);
  h.status_destroy(status);
  throw Error(message, code);
}

inline loom_status make_status(int32_t code, const std::string& message) {
  return host().status_create(code, message.c_str());
}

// Runs fn, converting any exception into a status: nothing throws across the ABI.
template <typename Fn>
loom_status guard(Fn&& fn) noexcept {
  try {
    fn();
    return nullptr;
  } catch (const Error& e) {
    return host_slot() ? make_status(e.code(), e.what()) : nullptr;
  } catch (const std::bad_alloc&) {
    return host_slot() ? make_status(LOOM_CODE_OUT_OF_MEMORY, "out of host memory") : nullptr;
  } catch (const std::exception& e) {
    return host_slot() ? make_status(LOOM_CODE_INTERNAL, e.what()) : nullptr;
  } catch (...) {
    return host_slot() ? make_status(LOOM_CODE_INTERNAL, "unknown exception in plugin") : nullptr;
  }
}

// LOOM_LOG(INFO) << "text"; goes to the engine's log with this file and line.
class LogLine {
 public:
  LogLine(int32_t severity, const char* file, int line) : severity_(severity), file_(file), line_(line) {}
  ~LogLine() {
    if (host_slot() != nullptr) host().log(severity_, file_, line_, stream_.str().c_str());
  }
  template <typename T>
  LogLine& operator<<(const T& v) {
    stream_ << v;
    return *this;
  }

 private:
  int32_t severity_;
  const char* file_;
  int line_;
  std::ostringstream stream_;
};
#define LOOM_LOG_SEVERITY_INFO LOOM_LOG_INFO
#define LOOM_LOG_SEVERITY_WARNING LOOM_LOG_WARNING
#define LOOM_LOG_SEVERITY_ERROR LOOM_LOG_ERROR
#define LOOM_LOG(sev) ::loom::LogLine(LOOM_LOG_SEVERITY_##sev, __FILE__, __LINE__)

// Throws loom::Error with a formatted message when cond is false.
#define LOOM_REQUIRE(cond, msg)                                           \
  do {                                                                    \
    if (!(cond)) {                                                        \
      std::ostringstream loom_require_os_;                                \
      loom_require_os_ << msg;                                            \
      throw ::loom::Error(loom_require_os_.str(), LOOM_CODE_INVALID_ARGUMENT); \
    }                                                                     \
  } while (0)

// Read access to a plugin instance's resolved options (defaults applied).
class Options {
 public:
  explicit Options(const loom_options* opts) : opts_(opts) {}
  int64_t get_int(const char* name, int64_t fallback = 0) const {
    int64_t v = fallback;
    return (opts_ && host().option_int(opts_, name, &v)) ? v : fallback;
  }
  double get_float(const char* name, double fallback = 0) const {
    double v = fallback;
    return (opts_ && host().option_float(opts_, name, &v)) ? v : fallback;
  }
  bool get_bool(const char* name, bool fallback = false) const {
    int32_t v = fallback ? 1 : 0;
    return (opts_ && host().option_bool(opts_, name, &v)) ? v != 0 : fallback;
  }
  std::string get_string(const char* name, const std::string& fallback = "") const {
    const char* s = opts_ ? host().option_string(opts_, name) : nullptr;
    return s ? std::string(s) : fallback;
  }
  // The value of an option the plugin declares: the engine fills in the declared
  // default, so the default is written once, in the declaration. Throws loom::Error
  // when the option has no value (not declared, or of another type).
  int64_t declared_int(const char* name) const {
    int64_t v = 0;
    if (!opts_ || !host().option_int(opts_, name, &v)) missing(name, "integer");
    return v;
  }
  double declared_float(const char* name) const {
    double v = 0;
    if (!opts_ || !host().option_float(opts_, name, &v)) missing(name, "float");
    return v;
  }
  bool declared_bool(const char* name) const {
    int32_t v = 0;
    if (!opts_ || !host().option_bool(opts_, name, &v)) missing(name, "boolean");
    return v != 0;
  }
  std::string declared_string(const char* name) const {
    const char* s = opts_ ? host().option_string(opts_, name) : nullptr;
    if (s == nullptr) missing(name, "string");
    return s;
  }
  const loom_options* raw() const { return opts_; }

 private:
  [[noreturn]] static void missing(const char* name, const char* type) {
    throw ::loom::Error(std::string("option ") + name + " has no " + type +
                            " value: the plugin reads an option it does not declare (or declares another type)",
                        LOOM_CODE_INTERNAL);
  }
  const loom_options* opts_;
};

// Fills struct_size for any ABI argument struct: auto a = loom::make<loom_gemm_args>();
template <typename T>
T make() {
  T v;
  std::memset(&v, 0, sizeof(T));
  v.struct_size = static_cast<uint32_t>(sizeof(T));
  return v;
}

// A copy of an argument struct another side built, which may be older (shorter) or
// newer than this one: the members its struct_size covers, the rest zero.
template <typename T>
T copy_of(const T& theirs) {
  T v = make<T>();
  std::memcpy(&v, &theirs, std::min<size_t>(theirs.struct_size, sizeof(T)));
  v.struct_size = static_cast<uint32_t>(sizeof(T));
  return v;
}

// A collective started without waiting (Group::start, ABI 1.15). wait() once; a
// request destroyed before its wait waits there (its buffers stay the collective's
// until then) and drops the outcome, so an exception never leaves one running.
class CommRequest {
 public:
  CommRequest() = default;
  CommRequest(const loom_group& g, loom_comm_request* req, void* stream) : g_(g), req_(req), stream_(stream) {}
  CommRequest(CommRequest&& o) noexcept : g_(o.g_), req_(o.req_), stream_(o.stream_) { o.req_ = nullptr; }
  CommRequest& operator=(CommRequest&& o) noexcept {
    if (this != &o) {
      release();
      g_ = o.g_;
      req_ = o.req_;
      stream_ = o.stream_;
      o.req_ = nullptr;
    }
    return *this;
  }
  CommRequest(const CommRequest&) = delete;
  CommRequest& operator=(const CommRequest&) = delete;
  ~CommRequest() { release(); }

  bool pending() const { return req_ != nullptr; }
  // Returns once the collective is done (stream backends: orders the stream after it).
  void wait() {
    if (req_ == nullptr) return;
    loom_comm_request* r = req_;
    req_ = nullptr;
    check(g_.api->wait(g_.comm, r, stream_));
  }

 private:
  void release() noexcept {
    if (req_ == nullptr) return;
    loom_status s = g_.api->wait(g_.comm, req_, stream_);
    req_ = nullptr;
    if (s != nullptr) host().status_destroy(s);
  }
  loom_group g_{};
  loom_comm_request* req_ = nullptr;
  void* stream_ = nullptr;
};

// A rank group (tp, dp, ...) with typed collectives; identities when size == 1.
class Group {
 public:
  Group() : g_(make<loom_group>()) { g_.size = 1; }
  explicit Group(const loom_group& g) : g_(g) {}
  int size() const { return g_.size; }
  int rank() const { return g_.rank; }
  const loom_group& raw() const { return g_; }

  void all_reduce(void* stream, const void* send, void* recv, size_t count, int32_t dtype,
                  int32_t op = LOOM_REDUCE_SUM) const {
    if (g_.size <= 1 && send == recv) return;  // in-place on one rank: identity
    check(g_.api->all_reduce(g_.comm, stream, send, recv, count, dtype, op));
  }
  void all_gather(void* stream, const void* send, void* recv, size_t count, int32_t dtype) const {
    if (g_.size <= 1 && send == recv) return;  // in-place on one rank: identity
    check(g_.api->all_gather(g_.comm, stream, send, recv, count, dtype));
  }
  void reduce_scatter(void* stream, const void* send, void* recv, size_t count, int32_t dtype,
                      int32_t op = LOOM_REDUCE_SUM) const {
    if (g_.size <= 1 && send == recv) return;  // in-place on one rank: identity
    check(g_.api->reduce_scatter(g_.comm, stream, send, recv, count, dtype, op));
  }
  // Block i of send (count elements) to rank i; block j of recv from rank j.
  void all_to_all(void* stream, const void* send, void* recv, size_t count, int32_t dtype) const {
    check(g_.api->all_to_all(g_.comm, stream, send, recv, count, dtype));
  }
  // Variable blocks: send_counts[i] elements at send_displs[i] go to rank i;
  // recv_counts[j] elements from rank j land at recv_displs[j].
  void all_to_all_v(void* stream, const void* send, const size_t* send_counts, const size_t* send_displs, void* recv,
                    const size_t* recv_counts, const size_t* recv_displs, int32_t dtype) const {
    check(g_.api->all_to_all_v(g_.comm, stream, send, send_counts, send_displs, recv, recv_counts, recv_displs,
                               dtype));
  }
  void broadcast(void* stream, void* buf, size_t count, int32_t dtype, int root) const {
    if (g_.size <= 1) return;
    check(g_.api->broadcast(g_.comm, stream, buf, count, dtype, root));
  }
  void barrier() const {
    if (g_.size <= 1) return;
    check(g_.api->barrier(g_.comm));
  }
  // Point to point with the group's rank `peer`; send does not wait for the receiver.
  void send(void* stream, const void* buf, size_t count, int32_t dtype, int peer, int tag) const {
    check(g_.api->send(g_.comm, stream, buf, count, dtype, peer, tag));
  }
  void recv(void* stream, void* buf, size_t count, int32_t dtype, int peer, int tag) const {
    check(g_.api->recv(g_.comm, stream, buf, count, dtype, peer, tag));
  }

  // Starts a collective that runs while the caller goes on (ABI 1.15,
  // loom_comm_api.start); the buffers are the collective's until the request's
  // wait. A communicator without start runs it here, in line.
  CommRequest start(void* stream, const loom_collective& c) const {
    if (g_.size <= 1 && c.send == c.recv) return {};  // in-place on one rank: identity
    const bool p2p = c.kind == LOOM_COLLECTIVE_SEND || c.kind == LOOM_COLLECTIVE_RECV;
    const bool can_start = LOOM_HAS_SLOT(g_.api, loom_comm_api, wait) && g_.api->start != nullptr &&
                           (!p2p || (g_.api->features & LOOM_COMM_START_P2P) != 0);
    if (can_start) {
      loom_comm_request* req = nullptr;
      check(g_.api->start(g_.comm, stream, &c, &req));
      return CommRequest(g_, req, stream);
    }
    switch (c.kind) {
      case LOOM_COLLECTIVE_ALL_REDUCE: all_reduce(stream, c.send, c.recv, c.count, c.dtype, c.op); break;
      case LOOM_COLLECTIVE_ALL_GATHER: all_gather(stream, c.send, c.recv, c.count, c.dtype); break;
      case LOOM_COLLECTIVE_REDUCE_SCATTER: reduce_scatter(stream, c.send, c.recv, c.count, c.dtype, c.op); break;
      case LOOM_COLLECTIVE_SEND: send(stream, c.send, c.count, c.dtype, c.peer, c.tag); break;
      case LOOM_COLLECTIVE_RECV:  // in line it would wait now, where the caller meant to go on
        throw Error("Group::start_recv: the comm table cannot start a receive (the engine's can)",
                    LOOM_CODE_UNSUPPORTED);
      default: throw Error("Group::start: unknown collective kind " + std::to_string(c.kind), LOOM_CODE_INVALID_ARGUMENT);
    }
    return {};
  }
  CommRequest start_all_reduce(void* stream, const void* send, void* recv, size_t count, int32_t dtype,
                               int32_t op = LOOM_REDUCE_SUM) const {
    return start(stream, collective(LOOM_COLLECTIVE_ALL_REDUCE, send, recv, count, dtype, op));
  }
  CommRequest start_reduce_scatter(void* stream, const void* send, void* recv, size_t count, int32_t dtype,
                                   int32_t op = LOOM_REDUCE_SUM) const {
    return start(stream, collective(LOOM_COLLECTIVE_REDUCE_SCATTER, send, recv, count, dtype, op));
  }
  CommRequest start_all_gather(void* stream, const void* send, void* recv, size_t count, int32_t dtype) const {
    return start(stream, collective(LOOM_COLLECTIVE_ALL_GATHER, send, recv, count, dtype, LOOM_REDUCE_SUM));
  }
  // Point to point started without waiting (ABI 1.17): a receive posted before
  // its data is needed lets the transfer run meanwhile. The groups the engine hands
  // out take both on any comm plugin (it receives at the wait, in posting order,
  // where the plugin cannot start one).
  CommRequest start_send(void* stream, const void* buf, size_t count, int32_t dtype, int peer, int tag) const {
    loom_collective c = collective(LOOM_COLLECTIVE_SEND, buf, nullptr, count, dtype, LOOM_REDUCE_SUM);
    c.peer = peer;
    c.tag = tag;
    return start(stream, c);
  }
  CommRequest start_recv(void* stream, void* buf, size_t count, int32_t dtype, int peer, int tag) const {
    loom_collective c = collective(LOOM_COLLECTIVE_RECV, nullptr, buf, count, dtype, LOOM_REDUCE_SUM);
    c.peer = peer;
    c.tag = tag;
    return start(stream, c);
  }

 private:
  static loom_collective collective(int32_t kind, const void* send, void* recv, size_t count, int32_t dtype,
                                    int32_t op) {
    loom_collective c = make<loom_collective>();
    c.kind = kind;
    c.send = send;
    c.recv = recv;
    c.count = count;
    c.dtype = dtype;
    c.op = op;
    return c;
  }
  loom_group g_;
};

// Context parallelism's split of a sequence (ABI 1.6, see loom_layer_fwd_args): the
// `seq` positions are cut into 2*cp chunks and cp rank r holds chunks r and
// 2*cp - 1 - r, in that order, as seq / cp consecutive local rows. With cp = 1 a
// rank holds the whole sequence. The one place this layout is spelled out: the
// engine slices tokens with it, layers map their rows to positions with it.
class ContextSlice {
 public:
  // Local rows [local, local + length) hold positions [position, position + length).
  struct Run {
    int64_t local, position, length;
  };
  ContextSlice() = default;
  ContextSlice(int64_t seq, int cp, int rank) : seq_(seq), cp_(cp), rank_(rank) {
    if (cp < 1 || rank < 0 || rank >= cp || seq < 0 || (cp > 1 && seq % (2 * cp) != 0))
      throw Error("context parallelism: a sequence of " + std::to_string(seq) + " positions cannot be split into " +
                      std::to_string(2 * cp) + " equal chunks for cp rank " + std::to_string(rank) + " of " +
                      std::to_string(cp),
                  LOOM_CODE_INVALID_ARGUMENT);
  }
  int64_t seq() const { return seq_; }
  int cp() const { return cp_; }
  int rank() const { return rank_; }
  int64_t local_length() const { return seq_ / cp_; }
  int64_t chunk_length() const { return cp_ > 1 ? seq_ / (2 * cp_) : seq_; }
  // The first position of chunk `half` (0: the early one, 1: the late one) of cp rank j.
  int64_t chunk_start(int j, int half) const {
    return cp_ > 1 ? (half == 0 ? j : 2 * cp_ - 1 - j) * chunk_length() : 0;
  }
  // This rank's runs (one with cp = 1, else two) cut to the local rows [begin, end).
  std::vector<Run> runs(int64_t begin, int64_t end) const {
    std::vector<Run> out;
    const int halves = cp_ > 1 ? 2 : 1;
    for (int h = 0; h < halves; ++h) {
      const int64_t lo = h * chunk_length(), hi = lo + chunk_length();
      const int64_t a = begin > lo ? begin : lo, b = end < hi ? end : hi;
      if (a < b) out.push_back({a, chunk_start(rank_, h) + (a - lo), b - a});
    }
    return out;
  }
  std::vector<Run> runs() const { return runs(0, local_length()); }
  // The position of local row `local_row` of cp rank j (of this rank: position()).
  int64_t position_of(int j, int64_t local_row) const {
    const int64_t c = chunk_length();
    return local_row < c ? chunk_start(j, 0) + local_row : chunk_start(j, 1) + (local_row - c);
  }
  int64_t position(int64_t local_row) const { return position_of(rank_, local_row); }
  // A layer's check that its input holds this rank's rows: positions are derived
  // from seq(), so another row count would map rows past the sequence.
  void require_local_rows(int64_t rows, const std::string& who) const {
    if (cp_ > 1 && rows != local_length())
      throw Error(who + ": under context parallelism (cp = " + std::to_string(cp_) + ") the input holds " +
                      std::to_string(rows) + " positions per sequence, expected this rank's " +
                      std::to_string(local_length()) + " of " + std::to_string(seq_),
                  LOOM_CODE_INVALID_ARGUMENT);
  }

 private:
  int64_t seq_ = 0;
  int cp_ = 1, rank_ = 0;
};

// Every op of loom_device_ops as X(name, argument struct), in table order: what
// loom::Device wraps and loom::LayerValidation's has_* helpers ask about.
#define LOOM_DEVICE_OP_LIST(X)                    \
  X(gemm, loom_gemm_args)                         \
  X(layernorm_fwd, loom_layernorm_fwd_args)       \
  X(layernorm_bwd, loom_layernorm_bwd_args)       \
  X(gelu_fwd, loom_gelu_args)                     \
  X(gelu_bwd, loom_gelu_args)                     \
  X(attention_fwd, loom_attention_args)           \
  X(attention_bwd, loom_attention_args)           \
  X(xent, loom_xent_args)                         \
  X(embedding_fwd, loom_embedding_args)           \
  X(embedding_bwd, loom_embedding_args)           \
  X(elementwise, loom_elementwise_args)           \
  X(reduce, loom_reduce_args)                     \
  X(adamw, loom_adamw_args)                       \
  X(rmsnorm_fwd, loom_rmsnorm_fwd_args) /* 1.10 */\
  X(rmsnorm_bwd, loom_rmsnorm_bwd_args)           \
  X(swiglu_fwd, loom_swiglu_args)                 \
  X(swiglu_bwd, loom_swiglu_args)                 \
  X(rope_fwd, loom_rope_args)                     \
  X(rope_bwd, loom_rope_args)                     \
  X(sigmoid_fwd, loom_activation_args)            \
  X(sigmoid_bwd, loom_activation_args)            \
  X(host_task, loom_host_task_args) /* 1.12 */

// Whether op table `ops` has op `fn`: its struct_size covers the slot (an older
// device's table ends before a newer op) and the slot is set.
#define LOOM_DEVICE_HAS_OP(ops, fn) (LOOM_HAS_SLOT(ops, loom_device_ops, fn) && (ops)->fn != nullptr)

// The device of a rank, with the op table wrapped so failures throw.
class Device {
 public:
  Device() = default;
  Device(const loom_device_api* api, loom_device* dev, loom_stream* stream)
      : api_(api), dev_(dev), stream_(stream) {}
  const loom_device_api* api() const { return api_; }
  loom_device* raw() const { return dev_; }
  loom_stream* stream() const { return stream_; }
  void* native_stream() const { return api_->native_stream ? api_->native_stream(dev_, stream_) : nullptr; }
  bool is_host_memory() const { return api_->dl_device_type == kDLCPU; }

// Each op fn: fn(args) runs it; has_fn() says whether the device implements it
// (an older device's table ends before a newer op's slot).
#define LOOM_DEVICE_OP(fn, argtype)                                                     \
  bool has_##fn() const { return LOOM_DEVICE_HAS_OP(api_->ops, fn); }                 \
  void fn(argtype a) const {                                                            \
    a.struct_size = sizeof(a);                                                          \
    if (!has_##fn())                                                                    \
      throw Error("device op '" #fn "' is not implemented by this device plugin",       \
                  LOOM_CODE_UNSUPPORTED);                                               \
    check(api_->ops->fn(dev_, stream_, &a));                                            \
  }
  LOOM_DEVICE_OP_LIST(LOOM_DEVICE_OP)
#undef LOOM_DEVICE_OP

  // A host task (ABI 1.12): fn runs in this stream's order on the device's copy of
  // `args`, taken now, and again at each replay of a graph that recorded it:
  //   dev.host_task(&my_kernel, MyArgs{x, y, n});   // void my_kernel(MyArgs*)
  template <class Args>
  void host_task(void (*fn)(Args*), const Args& args) const {
    static_assert(std::is_trivially_copyable_v<Args>, "host task arguments are copied bytewise");
    static_assert(alignof(Args) <= alignof(std::max_align_t), "the device's copy is aligned as malloc's memory");
    // fn travels in the copy beside its arguments, so the task calls it with its own type.
    struct Task {
      void (*fn)(Args*);
      Args args;
    };
    static_assert(sizeof(Task) <= LOOM_HOST_TASK_MAX_ARGS_BYTES, "host task arguments exceed 4096 bytes");
    if (fn == nullptr) throw Error("host_task: fn is NULL", LOOM_CODE_INVALID_ARGUMENT);
    const Task task{fn, args};
    loom_host_task_args a = make<loom_host_task_args>();
    a.fn = [](void* p) {
      Task* t = static_cast<Task*>(p);
      t->fn(&t->args);
    };
    a.args = &task;
    a.args_bytes = sizeof(Task);
    host_task(a);
  }

  void copy(void* dst, const void* src, size_t bytes, int32_t kind) const {
    check(api_->copy(dev_, stream_, dst, src, bytes, kind));
  }
  void synchronize() const { check(api_->stream_synchronize(dev_, stream_)); }
  // rows x width bytes from src (row pitch src_pitch) to dst (row pitch dst_pitch).
  // A device without copy_2d (ABI 1.1) gets one copy per row.
  void copy_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t rows,
               int32_t kind) const {
    if (LOOM_HAS_SLOT(api_, loom_device_api, copy_2d) && api_->copy_2d != nullptr) {
      check(api_->copy_2d(dev_, stream_, dst, dst_pitch, src, src_pitch, width, rows, kind));
      return;
    }
    for (size_t r = 0; r < rows; ++r)
      copy(static_cast<char*>(dst) + r * dst_pitch, static_cast<const char*>(src) + r * src_pitch, width, kind);
  }
  // LOOM_DEVICE_* capability bits (none for a 1.1 device).
  uint64_t features() const { return LOOM_HAS_SLOT(api_, loom_device_api, features) ? api_->features : 0; }

 private:
  const loom_device_api* api_ = nullptr;
  loom_device* dev_ = nullptr;
  loom_stream* stream_ = nullptr;
};

// What a plugin sees of its rank: memory, device, groups.
class Rank {
 public:
  explicit Rank(loom_rank* r) : r_(r) {}
  loom_rank* raw() const { return r_; }
  int global_rank() const { return host().global_rank(r_); }
  Device device() const {
    const loom_device_api* api = nullptr;
    loom_device* dev = nullptr;
    loom_stream* stream = nullptr;
    check(host().device(r_, &api, &dev, &stream));
    return Device(api, dev, stream);
  }
  Group group(const char* kind) const {
    loom_group g = make<loom_group>();
    check(host().group(r_, kind, &g));
    return Group(g);
  }
  // The group, or a one-rank group when this host has none of that kind (a host
  // before the kind existed, or a test harness that builds only some groups).
  Group group_or_single(const char* kind) const {
    loom_group g = make<loom_group>();
    loom_status st = host().group(r_, kind, &g);
    if (st != nullptr && host().status_code(st) == LOOM_CODE_NOT_FOUND) {
      host().status_destroy(st);
      return Group();
    }
    check(st);
    return Group(g);
  }
  void* alloc(size_t bytes) const {
    void* p = nullptr;
    check(host().alloc(r_, bytes, &p));
    return p;
  }
  void free(void* p) const {
    if (p) host().free(r_, p);
  }
  // ABI 1.7: runs `part` as sub-step `substep` (>= 1) of the layer step `step_key`
  // (loom_layer_fwd_args.step_key) through this rank's exec plugin, `scope` naming
  // the part. With `capturable` (the step args' substeps_capturable, and the part
  // obeys the graph rules) the plugin may capture it once and replay it: then
  // `part` does not run, so what it allocates must be found again through
  // addresses recorded when it last ran. Directly when the rank's exec plugin does
  // not take sub-steps (no LOOM_EXEC_SUBSTEPS: it never agreed to be re-entered).
  template <typename Part>
  void run_substep(const char* scope, int64_t step_key, int32_t substep, bool capturable, Part&& part) const {
    const loom_exec_api* api = nullptr;
    loom_exec* exec = nullptr;
    loom_status st = host().exec(r_, &api, &exec);
    if (st != nullptr) host().status_destroy(st);
    if (st != nullptr || api == nullptr || api->run == nullptr || !LOOM_HAS_SLOT(api, loom_exec_api, features) ||
        (api->features & LOOM_EXEC_SUBSTEPS) == 0) {
      part();
      return;
    }
    loom_exec_step step = make<loom_exec_step>();
    step.scope = scope;
    step.key = step_key;
    step.substep = substep;
    step.capturable = capturable ? 1 : 0;
    step.ctx = &part;
    step.fn = [](void* ctx) -> loom_status { return guard([&] { (*static_cast<std::remove_reference_t<Part>*>(ctx))(); }); };
    check(api->run(exec, r_, &step));
  }

 private:
  loom_rank* r_;
};

// Device memory owned by a plugin object, freed through the host.
class Buffer {
 public:
  Buffer() = default;
  Buffer(loom_rank* rank, size_t bytes) : rank_(rank), bytes_(bytes) {
    if (bytes) ptr_ = Rank(rank).alloc(bytes);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      reset();
      rank_ = o.rank_;
      ptr_ = o.ptr_;
      bytes_ = o.bytes_;
      o.ptr_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  ~Buffer() { reset(); }
  void reset() {
    if (ptr_ && rank_) Rank(rank_).free(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  template <typename T = void>
  T* get() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }
  explicit operator bool() const { return ptr_ != nullptr; }

 private:
  loom_rank* rank_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace loom
