// Tensor parallelism through the whole engine: the same run at tp = 2, 4 and
// tp = 2 x dp = 2, and tp = 2 with sequence parallelism (tied and untied, vocab
// sizes that leave padding in a slice or a whole slice of padding), trains the
// same model as tp = 1, step by step (each rank's slices reassembled into full
// tensors), and parameters that every tp rank holds a copy of (layernorms,
// biases after the g reduction, position embeddings) stay bit-identical at every
// step. Dropout: the same seed gives the same run, and duplicated-region masks
// equal the serial run's (so tp = 2, with or without SP, still equals tp = 1).
// Communication: the engine's counts for one microbatch equal Megatron's.
#include "engine/runtime/json.hpp"
#include "engine/runtime/launcher.hpp"
#include "engine/train/data.hpp"
#include "support/train_fixture.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <map>

namespace {

using loom::model::ParamEntry;

// Every rank's parameters after every step, plus each rank's entry table.
struct RankTrace {
  std::vector<double> loss;
  std::vector<loom::train::StepRecord> steps;
  std::map<int, std::vector<std::vector<float>>> params;  // rank -> step -> flat buffer
  std::map<int, std::vector<ParamEntry>> entries;
};

RankTrace run_all_ranks(const std::vector<std::string>& overrides) {
  RankTrace t;
  std::mutex mu;
  loom::train::TrainOptions opts;
  opts.on_step = [&](int64_t, int rank, const loom::model::Model& m) {
    const float* p = static_cast<const float*>(m.params());
    std::lock_guard<std::mutex> lock(mu);
    t.params[rank].emplace_back(p, p + m.numel());
    if (!t.entries.count(rank)) t.entries[rank] = m.param_entries();
  };
  auto plan = loom::testing::plan_from(loom::testing::tiny_manifest(), overrides);
  auto result = loom::train::train(plan, opts);
  for (const auto& s : result.steps) t.loss.push_back(s.loss);
  t.steps = result.steps;
  return t;
}

// The full tensor of entry k at a step, from the slices of tp ranks 0..tp-1
// (global ranks 0..tp-1 are the tp group of dp rank 0).
std::vector<float> assemble(const RankTrace& t, size_t k, size_t step, int tp) {
  const ParamEntry& e0 = t.entries.at(0)[k];
  int64_t full_numel = 1;
  for (int64_t d : e0.full_shape) full_numel *= d;
  std::vector<float> full(full_numel);
  const int dim = e0.decl.partition_dim;
  if (dim < 0 || tp == 1) {
    const auto& buf = t.params.at(0)[step];
    std::copy(buf.begin() + e0.offset, buf.begin() + e0.offset + e0.numel, full.begin());
    return full;
  }
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < dim; ++d) outer *= e0.full_shape[d];
  for (size_t d = dim + 1; d < e0.full_shape.size(); ++d) inner *= e0.full_shape[d];
  const int stride = std::max(1, e0.decl.partition_stride);
  const int64_t block = e0.full_shape[dim] / stride, part = block / tp;
  for (int r = 0; r < tp; ++r) {
    const ParamEntry& e = t.entries.at(r)[k];
    const float* src = t.params.at(r)[step].data() + e.offset;
    for (int64_t o = 0; o < outer; ++o)
      for (int s = 0; s < stride; ++s)
        for (int64_t i = 0; i < part * inner; ++i)
          full[(o * e0.full_shape[dim] + s * block + r * part) * inner + i] = *src++;
  }
  return full;
}

// At init attention is nearly uniform, so the Q/K gradients are close to Adam's
// eps, where the update lr * g / (|g| + eps) amplifies rounding by ~lr / (4 eps).
// Tensor parallelism splits the GEMM reductions differently from the serial run
// (unlike data parallelism, which only regroups the accumulation), so these
// tests use eps = 1e-6: the comparison is then of the parallel arithmetic, not
// of Adam's conditioning.
// Every copy of a duplicated parameter (partition_dim -1) is bit-identical on
// tp ranks 0..tp-1 after every step.
void expect_duplicates_identical(const RankTrace& par, int tp) {
  const auto& entries = par.entries.at(0);
  int checked = 0;
  for (size_t k = 0; k < entries.size(); ++k) {
    const ParamEntry& e = entries[k];
    if (e.decl.partition_dim >= 0) continue;
    ++checked;
    for (int r = 1; r < tp; ++r)
      for (size_t s = 0; s < par.params.at(0).size(); ++s) {
        const auto& a = par.params.at(0)[s];
        const auto& b = par.params.at(r)[s];
        ASSERT_TRUE(std::equal(a.begin() + e.offset, a.begin() + e.offset + e.numel,
                               b.begin() + par.entries.at(r)[k].offset))
            << e.name << " differs between tp rank 0 and " << r << " after step " << s + 1;
      }
  }
  EXPECT_GT(checked, 0);
}

void expect_same_training(std::vector<std::string> overrides, int tp,
                          std::vector<std::string> serial_overrides = {}) {
  serial_overrides.insert(serial_overrides.end(), {"parallel.tp=1", "parallel.dp=1", "optimizer.eps=1e-6"});
  RankTrace serial = run_all_ranks(serial_overrides);
  overrides.push_back("optimizer.eps=1e-6");
  RankTrace par = run_all_ranks(overrides);
  ASSERT_GE(serial.loss.size(), 10u);
  ASSERT_EQ(par.loss.size(), serial.loss.size());
  const auto& entries = serial.entries.at(0);
  ASSERT_EQ(par.entries.at(0).size(), entries.size());
  for (size_t s = 0; s < serial.loss.size(); ++s) {
    EXPECT_NEAR(par.loss[s], serial.loss[s], 1e-5 * std::fabs(serial.loss[s])) << "step " << s + 1;
    for (size_t k = 0; k < entries.size(); ++k) {
      ASSERT_EQ(par.entries.at(0)[k].name, entries[k].name);
      // The padded vocabulary grows with tp: compare the rows both runs have.
      std::vector<float> a = assemble(par, k, s, tp), b = assemble(serial, k, s, 1);
      const size_t n = std::min(a.size(), b.size());
      double num = 0, den = 0;
      for (size_t i = 0; i < n; ++i) {
        num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
        den += double(b[i]) * b[i];
      }
      EXPECT_LT(std::sqrt(num / std::max(den, 1e-30)), 1e-5) << entries[k].name << " step " << s + 1;
    }
  }
  // Copies held by every tp rank are bit-identical during training.
  expect_duplicates_identical(par, tp);
}

TEST(TensorParallel, Tp2MatchesSerial) { expect_same_training({"parallel.tp=2"}, 2); }
TEST(TensorParallel, Tp4MatchesSerial) { expect_same_training({"parallel.tp=4"}, 4); }
TEST(TensorParallel, Tp2Dp2MatchesSerial) { expect_same_training({"parallel.tp=2", "parallel.dp=2"}, 2); }

// Sequence parallelism: hidden states between layers are sequence shards,
// layernorm/dropout/residual run on them, f/g become all-gather/reduce-scatter,
// and duplicated gradients are summed over tp by the engine. The vocabulary (13)
// padded to 128 * tp leaves rank 1 a slice of padding only.
TEST(TensorParallel, Tp2SequenceParallelMatchesSerial) {
  expect_same_training({"parallel.tp=2", "parallel.sequence_parallel=true"}, 2);
}
// Untied, and a divisor that leaves real and padded rows in one slice (13 -> 18:
// rank 0 holds ids 0..8, rank 1 ids 9..12 and 5 padded rows).
TEST(TensorParallel, Tp2SequenceParallelUntiedPartlyPaddedSliceMatchesSerial) {
  expect_same_training({"parallel.tp=2", "parallel.sequence_parallel=true", "model.tie_embeddings=false",
                        "model.vocab_divisor=3"},
                       2, {"model.tie_embeddings=false", "model.vocab_divisor=3"});
}
TEST(TensorParallel, Tp4SequenceParallelDp2MatchesSerial) {
  expect_same_training({"parallel.tp=4", "parallel.dp=2", "parallel.sequence_parallel=true"}, 4);
}

// Dropout in the duplicated regions (embedding, attention and MLP outputs) draws
// from the stream every tp rank shares, each rank its shard's part under SP: the
// masks are the serial run's, so the runs stay equal to it.
TEST(TensorParallel, DropoutOutsideTpRegionsMatchesSerialWithAndWithoutSp) {
  const std::vector<std::string> drop = {"model.layer.embedding.dropout=0.1", "model.layer.attention.dropout=0.1",
                                         "model.layer.mlp.dropout=0.1"};
  auto with = [&](std::vector<std::string> v) {
    v.insert(v.end(), drop.begin(), drop.end());
    return v;
  };
  expect_same_training(with({"parallel.tp=2"}), 2, drop);
  expect_same_training(with({"parallel.tp=2", "parallel.sequence_parallel=true"}), 2, drop);
}

// Llama-style blocks (RMSNorm everywhere, SwiGLU with fc1's gate and up split with
// stride 2, no biases, rotary embeddings instead of a position table) under tp 2,
// with and without sequence parallelism, train as the serial run.
TEST(TensorParallel, LlamaBlocksMatchSerialWithAndWithoutSp) {
  const std::vector<std::string> llama = {"model.layer.mlp.activation=swiglu",     "model.layer.mlp.norm=rmsnorm",
                                          "model.layer.mlp.bias=false",            "model.layer.attention.norm=rmsnorm",
                                          "model.layer.attention.bias=false",      "model.layer.lm_head.norm=rmsnorm",
                                          "model.layer.attention.position_embedding=rope",
                                          "model.layer.embedding.position_embedding=rope"};
  auto with = [&](std::vector<std::string> v) {
    v.insert(v.end(), llama.begin(), llama.end());
    return v;
  };
  expect_same_training(with({"parallel.tp=2"}), 2, llama);
  expect_same_training(with({"parallel.tp=2", "parallel.sequence_parallel=true"}), 2, llama);
}

// Grouped-query attention (2 key/value groups for 4 heads, Megatron's per-group QKV
// columns): each tp rank holds one group and its two query heads.
TEST(TensorParallel, GroupedQueryAttentionMatchesSerialWithAndWithoutSp) {
  const std::vector<std::string> gqa = {"model.layer.attention.num_query_groups=2",
                                        "model.layer.attention.position_embedding=rope",
                                        "model.layer.embedding.position_embedding=rope"};
  auto with = [&](std::vector<std::string> v) {
    v.insert(v.end(), gqa.begin(), gqa.end());
    return v;
  };
  expect_same_training(with({"parallel.tp=2"}), 2, gqa);
  expect_same_training(with({"parallel.tp=2", "parallel.sequence_parallel=true"}), 2, gqa);
}

// QK normalisation (Qwen3's shape: RMSNorm over each head's q and k, grouped-query
// attention, rope): each tp rank sees its heads only, so the two gammas' gradients are
// summed over tp, by the layer without SP and by the engine with it.
TEST(TensorParallel, QkNormMatchesSerialWithAndWithoutSp) {
  const std::vector<std::string> qk = {"model.layer.attention.qk_norm=true", "model.layer.attention.norm=rmsnorm",
                                       "model.layer.attention.num_query_groups=2",
                                       "model.layer.attention.position_embedding=rope",
                                       "model.layer.embedding.position_embedding=rope"};
  auto with = [&](std::vector<std::string> v) {
    v.insert(v.end(), qk.begin(), qk.end());
    return v;
  };
  expect_same_training(with({"parallel.tp=2"}), 2, qk);
  expect_same_training(with({"parallel.tp=2", "parallel.sequence_parallel=true"}), 2, qk);
  // LayerNorm's q and k (gammas and betas), multi-head.
  const std::vector<std::string> ln = {"model.layer.attention.qk_norm=true"};
  expect_same_training({"parallel.tp=2", "model.layer.attention.qk_norm=true"}, 2, ln);
}

// Dropout inside the TP region (the MLP's activation dropout, a stream per tp
// rank) and outside it: the same seed gives bit-identical runs, another seed
// another run, and the duplicated parameters stay bit-identical across tp ranks
// (a duplicated-region mask that differed between ranks would split them).
TEST(TensorParallel, DropoutSameSeedSameRunAndDuplicatesStayIdentical) {
  for (const bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "sequence parallel" : "tensor parallel");
    std::vector<std::string> o = {"parallel.tp=2", "model.layer.attention.dropout=0.1", "model.layer.mlp.dropout=0.1",
                                  "model.layer.mlp.activation_dropout=0.2", "model.layer.embedding.dropout=0.1",
                                  std::string("parallel.sequence_parallel=") + (sp ? "true" : "false")};
    RankTrace a = run_all_ranks(o), b = run_all_ranks(o);
    o.push_back("run.seed=8");
    RankTrace c = run_all_ranks(o);
    ASSERT_EQ(a.loss.size(), b.loss.size());
    EXPECT_EQ(a.loss, b.loss);
    for (const auto& [rank, steps] : a.params) {
      EXPECT_TRUE(steps == b.params.at(rank)) << "rank " << rank;
    }
    EXPECT_NE(a.loss, c.loss);
    expect_duplicates_identical(a, 2);
  }
}

// ---------------------------------------------------------------------------
// Communication accounting: one microbatch forward and backward through the
// Model on every rank, counted by the engine's shim per group kind.
// ---------------------------------------------------------------------------

struct MicrobatchComm {
  loom::runtime::CommStats forward, backward, finalize;
  int64_t duplicated_params = 0, duplicated_elements = 0;
};

std::map<int, MicrobatchComm> count_one_microbatch(const std::vector<std::string>& overrides) {
  auto plan = loom::testing::plan_from(loom::testing::tiny_manifest(), overrides);
  const loom::manifest::RunConfig& m = plan.config;
  auto data = loom::train::make_data_source(m);
  loom::runtime::LaunchConfig lc;
  lc.device_plugin = plan.device;
  lc.comm_plugin = plan.comm;
  lc.sizes = plan.sizes;
  lc.threads = 1;
  std::map<int, MicrobatchComm> out;
  std::mutex mu;
  loom::runtime::launch(lc, [&](loom::runtime::RankRuntime& rt) {
    const loom_model_dims dims = loom::model::model_dims(m, data->vocab_size(), plan.sizes.tp);
    loom::model::Model model(m, *plan.registry, rt, dims, plan.layers, 7);
    const int64_t S = dims.seq_len, B = dims.micro_batch;
    std::vector<int32_t> tokens(static_cast<size_t>(S * B)), targets(tokens.size());
    loom::train::fill_microbatch(*data, loom::train::Split::Train, 0, B, S, tokens.data(), targets.data());
    MicrobatchComm c;
    float loss = 0;
    int64_t count = 0;
    rt.reset_comm_stats();
    model.forward(0, tokens.data(), targets.data(), true, 1, &loss, &count);  // device/cpu: host memory
    c.forward = rt.comm_stats();
    rt.reset_comm_stats();
    model.backward(0, 1.0f, 1.0f);
    c.backward = rt.comm_stats();
    rt.reset_comm_stats();
    model.finalize_grads();
    c.finalize = rt.comm_stats();
    for (const ParamEntry& e : model.param_entries())
      if (e.duplicated) {
        ++c.duplicated_params;
        c.duplicated_elements += static_cast<int64_t>(e.numel);
      }
    std::lock_guard<std::mutex> lock(mu);
    out[rt.global_rank()] = std::move(c);
  });
  return out;
}

loom::runtime::CommCounter op(const loom::runtime::CommStats& s, const std::string& kind, const std::string& name) {
  auto k = s.find(kind);
  if (k == s.end()) return {};
  auto o = k->second.find(name);
  return o == k->second.end() ? loom::runtime::CommCounter{} : o->second;
}

// Nothing but `kind` communicated.
void expect_only(const loom::runtime::CommStats& s, const std::string& kind) {
  for (const auto& [k, ops] : s) {
    if (k != kind) {
      EXPECT_EQ(loom::runtime::total(s, k).calls, 0u) << k;
    }
  }
}

// Megatron's Figure 4 and the vocab-parallel ends, per microbatch, for L
// transformer layers (attention + MLP), T = s*b tokens, hidden H:
//  tp:  forward  1 + 2L all-reduces of T*H (embedding's g, one per attention and
//                per MLP block) + the cross-entropy's per-token scalars: one
//                all-reduce (max) of T and one (sum-exp | target logit) of 2T;
//       backward 2L + 1 all-reduces of T*H (one per block, and f's backward in
//                front of the logits; the embedding's g backward is the identity).
//  tp + SP: every T*H all-reduce becomes a reduce-scatter (leaving a TP region) or
//       an all-gather (entering one) of T*H elements, the same bus bytes:
//       forward 1 + 2L reduce-scatters, 2L + 1 all-gathers; backward 2L + 1
//       reduce-scatters, 2L + 1 all-gathers; the scalars unchanged; and after the
//       last microbatch one all-reduce per duplicated parameter. As in Megatron,
//       each column-parallel GEMM's input (the LN output) is gathered again in
//       backward instead of being kept: 2L + 1 more all-gathers of T*H there.
TEST(TensorParallel, CommunicationCountsMatchMegatron) {
  const std::vector<std::string> base = {"parallel.tp=2"};
  auto man = loom::testing::plan_from(loom::testing::tiny_manifest(), base).manifest;
  const uint64_t L = static_cast<uint64_t>(man.get_int("model.num_layers"));
  const uint64_t T = static_cast<uint64_t>(man.get_int("model.seq_length") * man.get_int("batch.micro_batch_size"));
  const uint64_t H = static_cast<uint64_t>(man.get_int("model.hidden_size"));
  const uint64_t p = 2, f32 = sizeof(float);
  const double ring = double(p - 1) / double(p);

  std::map<int, MicrobatchComm> tp = count_one_microbatch(base);
  std::map<int, MicrobatchComm> sp = count_one_microbatch({"parallel.tp=2", "parallel.sequence_parallel=true"});
  ASSERT_EQ(tp.size(), 2u);
  ASSERT_EQ(sp.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const MicrobatchComm& a = tp.at(r);
    expect_only(a.forward, "tp");
    expect_only(a.backward, "tp");
    auto ar = op(a.forward, "tp", "all_reduce");
    EXPECT_EQ(ar.calls, 1 + 2 * L + 2);
    EXPECT_EQ(ar.elements, (1 + 2 * L) * T * H + T + 2 * T);
    EXPECT_EQ(ar.bytes, ar.elements * f32);
    EXPECT_DOUBLE_EQ(ar.bus_bytes, 2 * ring * double(ar.bytes));
    EXPECT_EQ(loom::runtime::total(a.forward, "tp").calls, ar.calls);  // nothing else
    auto bar = op(a.backward, "tp", "all_reduce");
    EXPECT_EQ(bar.calls, 2 * L + 1);
    EXPECT_EQ(bar.elements, (2 * L + 1) * T * H);
    EXPECT_EQ(loom::runtime::total(a.backward, "tp").calls, bar.calls);
    EXPECT_EQ(loom::runtime::total(a.finalize, "tp").calls, 0u);  // no SP: duplicated gradients are whole

    const MicrobatchComm& b = sp.at(r);
    expect_only(b.forward, "tp");
    expect_only(b.backward, "tp");
    for (const auto* phase : {&b.forward, &b.backward}) {
      const bool fwd = phase == &b.forward;
      SCOPED_TRACE(fwd ? "forward" : "backward");
      auto rs = op(*phase, "tp", "reduce_scatter"), ag = op(*phase, "tp", "all_gather");
      EXPECT_EQ(rs.calls, 2 * L + 1);
      EXPECT_EQ(ag.calls, (fwd ? 1 : 2) * (2 * L + 1));
      EXPECT_EQ(rs.elements, rs.calls * T * H);
      EXPECT_EQ(ag.elements, ag.calls * T * H);
      EXPECT_DOUBLE_EQ(rs.bus_bytes, ring * double(rs.calls * T * H * f32));
      auto sar = op(*phase, "tp", "all_reduce");
      EXPECT_EQ(sar.calls, fwd ? 2u : 0u);
      EXPECT_EQ(sar.elements, fwd ? T + 2 * T : 0u);
      EXPECT_EQ(loom::runtime::total(*phase, "tp").calls, rs.calls + ag.calls + sar.calls);
    }
    // The bus bytes of tensor parallelism alone, plus the backward's re-gathers.
    const double tp_bus = loom::runtime::total(a.forward, "tp").bus_bytes + loom::runtime::total(a.backward, "tp").bus_bytes;
    const double sp_bus = loom::runtime::total(b.forward, "tp").bus_bytes + loom::runtime::total(b.backward, "tp").bus_bytes;
    EXPECT_DOUBLE_EQ(sp_bus, tp_bus + ring * double((2 * L + 1) * T * H * f32));
    // finalize_grads: one all-reduce per duplicated parameter, their sizes.
    auto fin = op(b.finalize, "tp", "all_reduce");
    EXPECT_GT(b.duplicated_params, 0);
    EXPECT_EQ(fin.calls, static_cast<uint64_t>(b.duplicated_params));
    EXPECT_EQ(fin.elements, static_cast<uint64_t>(b.duplicated_elements));
    EXPECT_EQ(loom::runtime::total(b.finalize, "tp").calls, fin.calls);
  }
  // tp = 1: the calls are identities, nothing reaches the comm plugin.
  std::map<int, MicrobatchComm> one = count_one_microbatch({"parallel.tp=1"});
  EXPECT_EQ(loom::runtime::total(one.at(0).forward, "tp").calls, 0u);
  EXPECT_EQ(loom::runtime::total(one.at(0).backward, "tp").calls, 0u);
}

// Sequence parallelism exists to save activation memory: what a layer keeps
// outside tensor-parallel regions covers seq / tp positions. At tp = 2, per
// microbatch, the 2L + 1 hidden states between layers and the 2L + 1 layer
// inputs saved for backward (attention, MLP, logits) are halved, so SP must hold
// at least (2L + 1) * T * H fp32 less than tp alone (more: layernorm statistics
// and dropout masks are halved too). Keeping the gathered T * H LN output for
// the weight gradient instead of gathering it again in backward undoes that.
TEST(TensorParallel, SequenceParallelHoldsLessActivationMemoryThanTensorParallelAlone) {
  auto held = [](const std::vector<std::string>& o) {
    auto plan = loom::testing::plan_from(loom::testing::tiny_manifest(), o);
    return loom::train::train(plan, {}).peak_activation_bytes;
  };
  const std::vector<std::string> base = {"parallel.tp=2", "run.steps=1"};
  auto with_sp = base;
  with_sp.push_back("parallel.sequence_parallel=true");
  const auto tp = held(base), sp = held(with_sp);
  auto man = loom::testing::plan_from(loom::testing::tiny_manifest(), base).manifest;
  const uint64_t L = static_cast<uint64_t>(man.get_int("model.num_layers"));
  const uint64_t T = static_cast<uint64_t>(man.get_int("model.seq_length") * man.get_int("batch.micro_batch_size"));
  const uint64_t H = static_cast<uint64_t>(man.get_int("model.hidden_size"));
  ASSERT_EQ(tp.size(), 2u);
  ASSERT_EQ(sp.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_GT(sp.at(r), 0u);
    EXPECT_LE(sp.at(r) + (2 * L + 1) * T * H * sizeof(float), tp.at(r));
  }
}

TEST(TensorParallel, CommStatsFormatting) {
  loom::runtime::CommStats s;
  s["tp"]["all_reduce"] = {3, 48, 192, 192.0};
  s["dp"]["reduce_scatter"] = {1, 2048, 8192, 4096.0};
  s["pp"]["send"] = {};  // empty counters are left out
  const nlohmann::ordered_json expected = nlohmann::ordered_json::parse(
      R"({"dp": {"reduce_scatter": {"calls": 1, "elements": 2048, "bytes": 8192, "bus_bytes": 4096}}, )"
      R"("tp": {"all_reduce": {"calls": 3, "elements": 48, "bytes": 192, "bus_bytes": 192}}})");
  EXPECT_EQ(loom::runtime::comm_stats_to_json(s), expected);
  const std::string text = loom::runtime::dump_json(loom::runtime::comm_stats_to_json(s));
  EXPECT_EQ(text.find('\n'), std::string::npos) << text;
  EXPECT_EQ(nlohmann::ordered_json::parse(text), expected) << text;
  EXPECT_TRUE(loom::runtime::comm_stats_to_json(s)["tp"]["all_reduce"]["bus_bytes"].is_number_float());
  EXPECT_EQ(loom::runtime::dump_json(loom::runtime::comm_stats_to_json({})), "{}");
  EXPECT_EQ(loom::runtime::comm_stats_summary(s), "comm per step: dp 1 reduce_scatter 8.00 KiB; tp 3 all_reduce 192 B");
  EXPECT_EQ(loom::runtime::comm_stats_summary({}), "comm per step: none");
  loom::runtime::CommStats sum = s;
  sum += s;
  EXPECT_EQ(loom::runtime::total(sum, "tp").calls, 6u);
  EXPECT_DOUBLE_EQ(loom::runtime::total(sum, "dp").bus_bytes, 8192.0);
}
// Untied embeddings, and evaluation: the vocab-parallel argmax (each rank's
// local winner, the lowest id among equal maxima) must pick the serial run's
// predictions, so validation loss and exact-match agree.
TEST(TensorParallel, Tp2UntiedAndEvaluationMatchSerial) {
  const std::vector<std::string> common = {"model.tie_embeddings=false", "run.steps=40", "run.eval_every=20",
                                           "optimizer.eps=1e-6"};
  auto with = [&](const std::string& extra) {
    auto v = common;
    v.push_back(extra);
    return v;
  };
  RankTrace a = run_all_ranks(with("parallel.tp=2"));
  RankTrace b = run_all_ranks(with("parallel.tp=1"));
  ASSERT_EQ(a.loss.size(), b.loss.size());
  for (size_t s = 0; s < a.loss.size(); ++s) EXPECT_NEAR(a.loss[s], b.loss[s], 1e-5 * b.loss[s]) << s + 1;
  int evaluated = 0;
  for (size_t s = 0; s < a.steps.size(); ++s) {
    ASSERT_EQ(a.steps[s].evaluated, b.steps[s].evaluated);
    if (!a.steps[s].evaluated) continue;
    ++evaluated;
    EXPECT_NEAR(a.steps[s].val_loss, b.steps[s].val_loss, 1e-5 * b.steps[s].val_loss);
    EXPECT_EQ(a.steps[s].exact_match, b.steps[s].exact_match) << "step " << s + 1;
    EXPECT_EQ(a.steps[s].token_accuracy, b.steps[s].token_accuracy) << "step " << s + 1;
  }
  EXPECT_EQ(evaluated, 2);
  // Early in training the answers are wrong but many tokens (the carry digit, the
  // end marker) are right: the argmax is exercised, not trivially all-wrong.
  EXPECT_GT(b.steps.back().token_accuracy, 0.2);
}

}  // namespace
