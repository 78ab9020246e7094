#include "link_model.hpp"

#include <thread>

namespace loom::comm_common {

void wait_until(std::chrono::steady_clock::time_point start, double seconds) {
  if (seconds <= 0) return;
  std::this_thread::sleep_until(start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                            std::chrono::duration<double>(seconds)));
}

}  // namespace loom::comm_common
