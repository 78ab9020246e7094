// run.calculate_per_token_loss (Megatron-LM's --calculate-per-token-loss): the step's
// loss is the global batch's summed loss over its target tokens divided by their
// number, so it equals one microbatch holding the whole batch at any micro-batch size
// and parallel layout. The microbatches here hold different numbers of targets
// (data.eod_mask_loss on lines of text), where the default mean of microbatch means
// differs.
#include "support/rank_trace.hpp"
#include "support/train_fixture.hpp"

#include <boost/filesystem.hpp>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace {

class PerTokenLoss : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(loom::testing::scratch_dir("per_token_loss"));
    std::mt19937 rng(5);  // lines of 1 to 12 letters: a sequence of 16 holds one to several
    std::ofstream out(*dir_ + "/lines.txt");
    for (int line = 0; line < 800; ++line) {
      const int n = 1 + static_cast<int>(rng() % 12);
      for (int c = 0; c < n; ++c) out << static_cast<char>('a' + rng() % 8);
      out << '\n';
    }
  }
  static void TearDownTestSuite() {
    boost::filesystem::remove_all(*dir_);
    delete dir_;
  }
  static loom::testing::RankTrace run(std::vector<std::string> o) {
    o.insert(o.begin(), {"data.kind=\"text\"", "data.path=\"" + *dir_ + "/lines.txt\"", "data.eod_token=10",
                         "data.eod_mask_loss=true", "run.steps=6", "optimizer.eps=1e-6"});
    return loom::testing::run_all_ranks(loom::testing::tiny_manifest() + "\n[parallel]\n", o);
  }
  static double worst_loss_difference(const loom::testing::RankTrace& a, const loom::testing::RankTrace& b) {
    double worst = 0;
    for (size_t s = 0; s < a.loss.size(); ++s)
      worst = std::max(worst, std::fabs(a.loss[s] - b.loss[s]) / std::fabs(b.loss[s]));
    return worst;
  }
  static std::string* dir_;
};
std::string* PerTokenLoss::dir_ = nullptr;

TEST_F(PerTokenLoss, EveryMicroBatchSizeAndLayoutTrainsAsOneMicrobatchOfTheWholeBatch) {
  // One microbatch of the global batch of 8: its mean is the per-token loss, bit for bit.
  const loom::testing::RankTrace whole = run({"batch.micro_batch_size=8"});
  const loom::testing::RankTrace whole_per_token = run({"batch.micro_batch_size=8", "run.calculate_per_token_loss=true"});
  ASSERT_EQ(whole.loss.size(), 6u);
  EXPECT_EQ(whole.loss, whole_per_token.loss);
  EXPECT_GT(worst_loss_difference(run({"batch.micro_batch_size=2"}), whole), 1e-4)
      << "the microbatches' means equal the batch's: the test cannot tell per-token loss apart";
  for (const std::vector<std::string>& layout : std::vector<std::vector<std::string>>{
           {"batch.micro_batch_size=2"},
           {"batch.micro_batch_size=1"},
           {"batch.micro_batch_size=2", "parallel.dp=2"},
           {"batch.micro_batch_size=1", "parallel.dp=2", "optimizer.strategy=\"distributed\""},
           {"batch.micro_batch_size=2", "parallel.pp=2"},
           {"batch.micro_batch_size=2", "parallel.cp=2"},
           {"batch.micro_batch_size=2", "parallel.tp=2", "parallel.sequence_parallel=true"},
           {"batch.micro_batch_size=1", "parallel.dp=2", "parallel.pp=2", "parallel.vpp=1"}}) {
    std::string name;
    for (const std::string& o : layout) name += o + " ";
    SCOPED_TRACE(name);
    std::vector<std::string> o = layout;
    o.push_back("run.calculate_per_token_loss=true");
    const loom::testing::RankTrace par = run(o);
    ASSERT_EQ(par.loss.size(), whole.loss.size());
    for (size_t s = 0; s < whole.loss.size(); ++s) {
      EXPECT_NEAR(par.loss[s], whole.loss[s], 2e-5 * std::fabs(whole.loss[s])) << "loss at step " << s + 1;
      EXPECT_NEAR(par.result.steps[s].grad_norm, whole.result.steps[s].grad_norm,
                  2e-5 * whole.result.steps[s].grad_norm)
          << "gradient norm at step " << s + 1;
    }
  }
}

}  // namespace
