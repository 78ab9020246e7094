#include "link_model.hpp"

#include <sys/prctl.h>

#include <thread>

namespace loom::comm_common {

void wait_until(std::chrono::steady_clock::time_point start, double seconds) {
  if (seconds <= 0) return;
  // Linux lets a sleeping thread wake up to 50 us late by default (its timer slack),
  // which, on every one of hundreds of small modelled collectives, would add far more
  // than the model says; 1 ns leaves the scheduler's own wake-up latency.
  thread_local const bool precise = prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL) == 0;
  (void)precise;
  std::this_thread::sleep_until(start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                            std::chrono::duration<double>(seconds)));
}

}  // namespace loom::comm_common
