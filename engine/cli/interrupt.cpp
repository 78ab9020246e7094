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

namespace {
constexpr int kSignals[] = {SIGINT, SIGTERM};
struct sigaction g_before[2];  // each signal's action before, restored after
bool g_installed[2] = {false, false};
}  // namespace

ExitOnSignal::ExitOnSignal(const char* command) {
  g_command.store(command);
  for (int i = 0; i < 2; ++i) {
    g_installed[i] = false;
    if (::sigaction(kSignals[i], nullptr, &g_before[i]) != 0) continue;
    if (g_before[i].sa_handler == SIG_IGN) continue;  // ignored as started (a background job): stays so
    struct sigaction act {};
    act.sa_handler = on_stop_signal;
    sigemptyset(&act.sa_mask);
    g_installed[i] = ::sigaction(kSignals[i], &act, nullptr) == 0;
  }
}

ExitOnSignal::~ExitOnSignal() {
  for (int i = 0; i < 2; ++i)
    if (g_installed[i]) ::sigaction(kSignals[i], &g_before[i], nullptr);
  g_command.store(nullptr);
}

}  // namespace loom::cli
