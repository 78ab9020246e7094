// The layer harness (`loom plugins test`) catches each kind of mistake a layer author
// makes: layer/faulty_scale (tests/harness) makes one at a time, chosen by its option,
// and exactly the checks that should fail do; made correctly, every check passes.
#include "engine/plugins/registry.hpp"
#include "engine/testing/layer_harness.hpp"

#include <gtest/gtest.h>
#include <toml++/toml.h>

#include <map>
#include <set>
#include <string>

namespace {

loom::plugins::Registry& registry() {
  static loom::plugins::Registry r;
  static const bool loaded = [] {
    loom::plugins::host_api();
    r.load_file(LOOM_TEST_HARNESS_PLUGIN);
    r.load_dirs({LOOM_TEST_PLUGIN_DIR});
    return true;
  }();
  (void)loaded;
  return r;
}

// The checks that fail for layer/faulty_scale with `fault` (and `state`).
std::set<std::string> failing_checks(const std::string& fault, const std::string& state = "none") {
  toml::table options;
  options.insert("fault", fault);
  options.insert("state", state);
  std::set<std::string> failing;
  for (const loom::harness::CheckRun& c : loom::harness::check_layer_plugin(registry(), "faulty_scale", &options)) {
    if (c.error.empty()) {
      EXPECT_GT(c.findings.compared, 0) << fault << ": " << c.check << " compared nothing";
    }
    if (!c.error.empty() || !c.findings.ok()) failing.insert(c.check);
  }
  return failing;
}

TEST(LayerHarness, ACorrectLayerPassesEveryCheck) {
  EXPECT_EQ(failing_checks("none"), std::set<std::string>{});
  // One that reads its input back in the backward where the forward was given it (the
  // ABI keeps that memory until then): the harness must keep it too.
  toml::table options;
  options.insert("borrow_input", true);
  for (const loom::harness::CheckRun& c : loom::harness::check_layer_plugin(registry(), "faulty_scale", &options))
    EXPECT_TRUE(c.error.empty() && c.findings.ok()) << c.check << ": " << c.error << c.findings.text();
}

TEST(LayerHarness, EachMistakeFailsTheChecksThatLookForIt) {
  // A wrong gradient is as wrong on one rank as on two: tp compares them, so only
  // the finite differences see it. An overwritten gradient also loses the first of
  // two microbatches in flight; an input gradient added to the garbage in grad_input
  // is wrong by that garbage.
  const std::map<std::string, std::set<std::string>> expected = {
      {"gradient", {"gradients"}},
      {"overwrite", {"accumulation", "microbatches"}},
      {"input", {"gradients", "accumulation"}},
      {"shared_state", {"microbatches"}},
      {"reduce", {"tp2", "tp2+sp"}},
      {"kv_cache", {"kv_cache"}},
      // Memory the plan is not told of, or never given back.
      {"workspace", {"memory"}},
      {"leak", {"memory"}},
      // Writing outside a tensor, or into the input, fails every check that makes the call.
      {"grad_overrun", {"gradients", "accumulation", "microbatches", "memory", "tp2", "tp2+sp"}},
      {"input_overrun", {"gradients", "accumulation", "microbatches", "memory", "tp2", "tp2+sp"}},
      {"writes_input", {"gradients", "accumulation", "microbatches", "kv_cache", "memory", "tp2", "tp2+sp"}},
  };
  for (const auto& [fault, checks] : expected) EXPECT_EQ(failing_checks(fault), checks) << "fault = " << fault;
}

// Layer state (ABI 1.23) counted in backward and summed over the ranks holding the
// layer passes; counted in forward (twice under recomputation, and for forwards never
// trained) or not finite fails the state check, and not summed the tp checks.
TEST(LayerHarness, LayerStateMustCountTrainedMicrobatchesAndStayFinite) {
  std::set<std::string> checks_run;
  toml::table options;
  options.insert("state", "backward");
  for (const loom::harness::CheckRun& c : loom::harness::check_layer_plugin(registry(), "faulty_scale", &options)) {
    checks_run.insert(c.check);
    EXPECT_TRUE(c.error.empty() && c.findings.ok()) << c.check << ": " << c.error << c.findings.text();
  }
  EXPECT_TRUE(checks_run.count("state")) << "a layer with state is checked for it";
  EXPECT_EQ(failing_checks("none", "backward"), std::set<std::string>{});
  EXPECT_EQ(failing_checks("none", "forward"), std::set<std::string>{"state"});
  EXPECT_EQ(failing_checks("none", "nan"), std::set<std::string>{"state"});
  // Copies not summed over the ranks holding the layer differ from the serial run's
  // where the ranks see other rows (sequence shards; without SP each sees them all).
  EXPECT_EQ(failing_checks("none", "unreduced"), std::set<std::string>{"tp2+sp"});
  // Each for its own reason: counted forwards, and (only that) a NaN.
  auto state_findings = [](const std::string& state) {
    toml::table o;
    o.insert("state", state);
    for (const loom::harness::CheckRun& c : loom::harness::check_layer_plugin(registry(), "faulty_scale", &o))
      if (c.check == "state") return c.findings.text();
    return std::string("(no state check)");
  };
  const std::string forward = state_findings("forward"), nan = state_findings("nan");
  EXPECT_NE(forward.find("left other state than end_step alone"), std::string::npos) << forward;
  EXPECT_EQ(nan.find("left other state than end_step alone"), std::string::npos) << nan;
  EXPECT_NE(nan.find("rows_seen[0] is nan after a trained microbatch and end_step"), std::string::npos) << nan;
  // Without state there is no state check.
  options.insert_or_assign("state", "none");
  for (const loom::harness::CheckRun& c : loom::harness::check_layer_plugin(registry(), "faulty_scale", &options))
    EXPECT_NE(c.check, "state");
}

// What a failing check reports: the value, what it was compared with, the bound.
TEST(LayerHarness, AFailureNamesTheParameterAndTheNumbers) {
  loom::harness::HarnessRank rank(registry());
  toml::table options;
  options.insert("fault", "gradient");
  loom::harness::HarnessLayer layer(rank, "faulty_scale", loom::harness::default_dims(), &options);
  std::mt19937 rng(3);
  layer.randomize(rng);
  const loom::harness::Findings f = loom::harness::check_gradients(layer, rng);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.text().find("gain["), std::string::npos) << f.text();
  EXPECT_NE(f.text().find("finite differences"), std::string::npos) << f.text();
}

// A write outside a tensor names the call, the tensor and how far it went.
TEST(LayerHarness, AWriteOutsideATensorIsNamed) {
  loom::harness::HarnessRank rank(registry());
  const std::map<std::string, std::string> expected = {
      {"grad_overrun", "faulty_scale backward: wrote 1 of the 64 values after the end of the gradient of gain"},
      {"input_overrun", "faulty_scale backward: wrote 1 of the 64 values after the end of grad_input"},
      {"writes_input", "faulty_scale forward: changed its input"},
  };
  for (const auto& [fault, message] : expected) {
    toml::table options;
    options.insert("fault", fault);
    loom::harness::HarnessLayer layer(rank, "faulty_scale", loom::harness::default_dims(), &options);
    std::mt19937 rng(3);
    const loom::harness::Batch b = loom::harness::make_batch(layer.dims(), rng);
    std::string error;
    try {
      layer.forward(b);
      layer.backward(b);
    } catch (const std::exception& e) {
      error = e.what();
    }
    EXPECT_NE(error.find(message), std::string::npos) << fault << ": " << error;
  }
}

}  // namespace
