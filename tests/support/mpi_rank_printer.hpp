// For gtest binaries run under mpirun: rank 0 prints as usual, every other rank
// prints only its failures, each prefixed with the rank (one report, not N).
#pragma once

#include <gtest/gtest.h>

#include <iostream>

namespace loom::testing {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::cerr << "[rank " << rank_ << "] " << (r.file_name() ? r.file_name() : "?") << ":" << r.line_number()
                << ": " << r.summary() << "\n";
  }

 private:
  int rank_;
};

// Call after InitGoogleTest, once the process knows its rank.
inline void print_failures_with_rank(int rank) {
  if (rank == 0) return;
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  delete listeners.Release(listeners.default_result_printer());
  listeners.Append(new RankFailurePrinter(rank));
}

}  // namespace loom::testing
