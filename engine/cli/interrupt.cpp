#include "engine/cli/interrupt.hpp"

#include "engine/files/temporaries.hpp"

#include <atomic>
#include <csignal>
#include <cstring>
#include <unistd.h>

namespace loom::cli {
namespace {

std::atomic<const char*> g_command{nullptr};

void say(const char* s) noexcept {
  const ssize_t ignored = ::write(2, s, std::strlen(s));
  (void)ignored;
}

extern "C" void on_stop_signal(int) {
  const char* command = g_command.load();
  exit_interrupted(command != nullptr ? command : "loom", "interrupted by a signal");
}

}  // namespace

void exit_interrupted(const char* command, const char* why) noexcept {
  say("\n");
  say(command);
  say(": ");
  say(why);
  say("\n");
  files::remove_temporaries();
  ::_exit(130);
}

ExitOnSignal::ExitOnSignal(const char* command) {
  g_command.store(command);
  for (int sig : {SIGINT, SIGTERM}) std::signal(sig, on_stop_signal);
}

ExitOnSignal::~ExitOnSignal() {
  for (int sig : {SIGINT, SIGTERM}) std::signal(sig, SIG_DFL);
  g_command.store(nullptr);
}

}  // namespace loom::cli
