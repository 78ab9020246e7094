// SIGINT and SIGTERM for commands whose work cannot stop part-way in good order (a
// library call runs to its end, a result is worthless half done): the signal says the
// command was interrupted, removes the temporaries of files being written
// (engine/files/temporaries.hpp), and ends the process with status 130 at once.
// `loom run` and `loom generate` stop in good order instead (after a step, a token).
#pragma once

namespace loom::cli {

class ExitOnSignal {
 public:
  // `command` ("loom eval") starts the message; a string literal (kept, not copied).
  explicit ExitOnSignal(const char* command);
  ~ExitOnSignal();  // the default actions again
  ExitOnSignal(const ExitOnSignal&) = delete;
  ExitOnSignal& operator=(const ExitOnSignal&) = delete;
};

// What the handler does, for handlers of their own (async-signal-safe): writes
// "\n<command>: <why>\n" to stderr, removes the temporaries and _exits with 130.
[[noreturn]] void exit_interrupted(const char* command, const char* why) noexcept;

}  // namespace loom::cli
