// Manifest loading, validation, provenance, plugin options and serialisation.
// Positions in the expectations are 1-based line:column of the TOML strings
// below; for a value the column is where the value starts, for an unknown key
// where the key starts.
#include "engine/manifest/manifest.hpp"
#include "engine/manifest/schema.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace loom::manifest {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

constexpr const char* kLauncherVars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"};

// Runs every test outside any launcher (the world-size rule reads the environment)
// and gives each test its own scratch directory.
class ManifestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : kLauncherVars) {
      const char* old = std::getenv(v);
      saved_.push_back(old ? std::optional<std::string>(old) : std::nullopt);
      unsetenv(v);
    }
    static std::atomic<int> counter{0};
    dir_ = fs::temp_directory_path() /
           ("loom_manifest_test_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    for (size_t i = 0; i < saved_.size(); ++i) {
      if (saved_[i])
        setenv(kLauncherVars[i], saved_[i]->c_str(), 1);
      else
        unsetenv(kLauncherVars[i]);
    }
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  std::string write(const std::string& rel, const std::string& text) {
    fs::path p = dir_ / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
    return p.string();
  }

  // The diagnostics of a manifest that must not load.
  static std::vector<Diagnostic> errors(const std::string& text,
                                        const std::vector<std::string>& overrides = {}) {
    try {
      Manifest::parse(text, "m.toml", overrides);
    } catch (const ManifestError& e) {
      return e.diagnostics();
    }
    ADD_FAILURE() << "expected a ManifestError for:\n" << text;
    return {};
  }
  // The one diagnostic of a manifest with exactly one problem.
  static Diagnostic one_error(const std::string& text,
                              const std::vector<std::string>& overrides = {}) {
    std::vector<Diagnostic> d = errors(text, overrides);
    EXPECT_EQ(d.size(), 1u) << joined(d);
    return d.empty() ? Diagnostic{} : d.front();
  }
  static std::string joined(const std::vector<Diagnostic>& d) {
    std::string out;
    for (const auto& x : d) out += x.str() + "\n";
    return out;
  }
  static std::string pos(const Origin& o) {
    return o.file + ":" + std::to_string(o.line) + ":" + std::to_string(o.column);
  }

  std::vector<std::optional<std::string>> saved_;
  fs::path dir_;
};

// ---- defaults and typed access ----------------------------------------------

TEST_F(ManifestTest, EmptyManifestGetsEveryDefault) {
  Manifest m = Manifest::parse("", "empty.toml");
  for (const schema::KeySpec& k : schema::keys()) {
    if (k.type == schema::KeyType::Table) continue;
    EXPECT_TRUE(m.contains(k.path)) << k.path;
    EXPECT_EQ(m.origin(k.path).kind, Origin::Kind::Default) << k.path;
  }
  EXPECT_EQ(m.get_string("run.name"), "loom");
  EXPECT_EQ(m.get_int("run.steps"), 100);
  EXPECT_EQ(m.get_int("run.seed"), 1234);
  EXPECT_EQ(m.get_int("model.hidden_size"), 128);
  EXPECT_EQ(m.get_int("model.vocab_divisor"), 128);
  EXPECT_TRUE(m.get_bool("model.tie_embeddings"));
  EXPECT_EQ(m.get_string_list("model.pre"), std::vector<std::string>{"embedding"});
  EXPECT_EQ(m.get_string_list("model.block"), (std::vector<std::string>{"attention", "mlp"}));
  EXPECT_EQ(m.get_string_list("model.post"), std::vector<std::string>{"lm_head"});
  EXPECT_EQ(m.get_string("parallel.order"), "tp-cp-ep-dp-pp");
  EXPECT_FALSE(m.get_bool("parallel.sequence_parallel"));
  EXPECT_EQ(m.get_string("pipeline.schedule"), "1f1b");
  EXPECT_EQ(m.get_int("batch.global_batch_size"), 32);
  EXPECT_EQ(m.get_string("optimizer.strategy"), "ddp");
  EXPECT_DOUBLE_EQ(m.get_float("optimizer.lr"), 1e-3);
  EXPECT_DOUBLE_EQ(m.get_float("optimizer.beta2"), 0.95);
  EXPECT_DOUBLE_EQ(m.get_float("optimizer.eps"), 1e-8);
  EXPECT_DOUBLE_EQ(m.get_float("comm.timeout_s"), 300.0);
  EXPECT_DOUBLE_EQ(m.get_float("data.val_fraction"), 0.1);
  EXPECT_EQ(m.get_string("data.kind"), "synthetic");
  EXPECT_EQ(m.get_int("data.digits"), 3);
  EXPECT_TRUE(m.get_string_list("plugins.search_paths").empty());
  EXPECT_EQ(m.origin("run.steps").str(), "default");
  // Open tables are not invented.
  EXPECT_EQ(m.get_table("device.options"), nullptr);
  EXPECT_NE(m.get_table("parallel"), nullptr);
}

TEST_F(ManifestTest, TypedGettersAndIntsAsFloats) {
  Manifest m = Manifest::parse(
      "[run]\nsteps = 7\nname = \"tiny\"\n[optimizer]\nlr = 1\nclip_grad = 0\n"
      "[model]\nblock = [\"mlp\"]\n",
      "t.toml");
  EXPECT_EQ(m.get_int("run.steps"), 7);
  EXPECT_EQ(m.get_string("run.name"), "tiny");
  EXPECT_DOUBLE_EQ(m.get_float("optimizer.lr"), 1.0);
  EXPECT_DOUBLE_EQ(m.get_float("optimizer.clip_grad"), 0.0);
  // Stored as floats so plugins and serialisation see the schema's type.
  EXPECT_TRUE(m.table().at_path("optimizer.lr").is_floating_point());
  EXPECT_DOUBLE_EQ(m.get_float("run.steps"), 7.0);  // an int read as a float
  EXPECT_EQ(m.get_string_list("model.block"), std::vector<std::string>{"mlp"});
  EXPECT_THROW(m.get_int("optimizer.lr"), std::logic_error);
  EXPECT_THROW(m.get_string("run.steps"), std::logic_error);
  EXPECT_THROW(m.get_int("run.nope"), std::logic_error);
  EXPECT_THROW(m.get_string_list("run.name"), std::logic_error);
  EXPECT_FALSE(m.contains("run.nope"));
  EXPECT_EQ(m.origin("run.steps").str(), "t.toml:2:9");
  EXPECT_EQ(m.origin("optimizer.lr").str(), "t.toml:5:6");
  EXPECT_EQ(m.origin("optimizer.beta1").kind, Origin::Kind::Default);
}

TEST_F(ManifestTest, LayerInstancesDefaultTheirPlugin) {
  Manifest m = Manifest::parse(
      "[model.layer.attn]\nplugin = \"attention\"\ndropout = 0.1\n[model.layer.mlp]\n", "l.toml");
  EXPECT_EQ(m.get_string("model.layer.attn.plugin"), "attention");
  EXPECT_EQ(m.origin("model.layer.attn.plugin").str(), "l.toml:2:10");
  EXPECT_EQ(m.get_string("model.layer.mlp.plugin"), "mlp");
  EXPECT_EQ(m.origin("model.layer.mlp.plugin").kind, Origin::Kind::Default);
  // Plugin options are not checked by the core schema.
  EXPECT_DOUBLE_EQ(m.get_float("model.layer.attn.dropout"), 0.1);
}

// ---- per-key errors -----------------------------------------------------------

TEST_F(ManifestTest, SyntaxErrorHasLineAndColumn) {
  Diagnostic d = one_error("[run]\nsteps = = 3\n");
  EXPECT_EQ(pos(d.origin), "m.toml:2:9");
  EXPECT_THAT(d.message, StartsWith("invalid TOML: "));
  EXPECT_THAT(d.str(), StartsWith("m.toml:2:9: invalid TOML: "));
}

TEST_F(ManifestTest, UnknownKeySuggestsTheClosest) {
  Diagnostic d = one_error("[parallel]\ntp = 2\ntpp = 2\n", {"run.steps=1"});
  EXPECT_EQ(d.key, "parallel.tpp");
  EXPECT_EQ(d.message, "unknown key 'parallel.tpp' (did you mean 'parallel.tp'?)");
  EXPECT_EQ(pos(d.origin), "m.toml:3:1");
  EXPECT_EQ(d.str(),
            "m.toml:3:1: parallel.tpp: unknown key 'parallel.tpp' (did you mean 'parallel.tp'?)");
}

TEST_F(ManifestTest, UnknownKeySuggestsAnotherSection) {
  Diagnostic d = one_error("[run]\nsteps = 3\n\n[parallel]\n  micro_batch_size = 2\n");
  EXPECT_EQ(d.message,
            "unknown key 'parallel.micro_batch_size' (did you mean 'batch.micro_batch_size'?)");
  EXPECT_EQ(pos(d.origin), "m.toml:5:3");
}

TEST_F(ManifestTest, UnknownKeyWithoutSuggestionListsTheSection) {
  Diagnostic d = one_error("[batch]\nzzzzzzzz = 1\n");
  EXPECT_EQ(d.message,
            "unknown key 'batch.zzzzzzzz' (valid keys in [batch]: micro_batch_size, "
            "global_batch_size, rampup_batch_size)");
  EXPECT_EQ(pos(d.origin), "m.toml:2:1");
}

TEST_F(ManifestTest, UnknownSectionListsTheValidOnes) {
  Diagnostic d = one_error("[run]\nsteps = 3\n[paralel]\ntp = 2\n");
  EXPECT_EQ(d.key, "paralel");
  EXPECT_THAT(d.message, StartsWith("unknown section 'paralel' (did you mean 'parallel'?)"));
  EXPECT_THAT(d.message, HasSubstr("valid sections are run, model, parallel, pipeline, batch, "
                                   "optimizer, exec, device, comm, data, checkpoint, plugins"));
  EXPECT_EQ(pos(d.origin), "m.toml:3:2");
}

TEST_F(ManifestTest, UnknownTopLevelKeyPointsIntoItsSection) {
  Diagnostic d = one_error("steps = 5\n");
  EXPECT_EQ(d.message, "unknown key 'steps' (did you mean 'run.steps'?)");
  EXPECT_EQ(pos(d.origin), "m.toml:1:1");
}

TEST_F(ManifestTest, WrongType) {
  Diagnostic d = one_error("[parallel]\ntp = \"2\"\n");
  EXPECT_EQ(d.key, "parallel.tp");
  EXPECT_EQ(d.message, "parallel.tp must be an integer, got string \"2\"");
  EXPECT_EQ(pos(d.origin), "m.toml:2:6");

  d = one_error("[model]\nblock = [\"attention\", 3]\n");
  EXPECT_EQ(d.message, "model.block must be an array of strings, got array [\"attention\", 3]");
  EXPECT_EQ(pos(d.origin), "m.toml:2:9");

  d = one_error("[optimizer]\nlr = \"fast\"\n");
  EXPECT_EQ(d.message, "optimizer.lr must be a float, got string \"fast\"");

  d = one_error("[model]\ntie_embeddings = 1\n");
  EXPECT_EQ(d.message, "model.tie_embeddings must be a boolean, got integer 1");
  EXPECT_EQ(pos(d.origin), "m.toml:2:18");

  d = one_error("parallel = 2\n");
  EXPECT_EQ(d.key, "parallel");
  EXPECT_THAT(d.message, StartsWith("parallel must be a table"));

  d = one_error("[model.layer]\nattn = 3\n");
  EXPECT_EQ(d.key, "model.layer.attn");
  EXPECT_THAT(d.message, StartsWith("model.layer.attn must be a table"));
  EXPECT_EQ(pos(d.origin), "m.toml:2:8");
}

TEST_F(ManifestTest, OutOfRange) {
  Diagnostic d = one_error("[parallel]\ntp = 0\n");
  EXPECT_EQ(d.message, "parallel.tp must be between 1 and 1048576, got 0");
  EXPECT_EQ(pos(d.origin), "m.toml:2:6");

  d = one_error("[optimizer]\nlr = 0\n");
  EXPECT_EQ(d.message, "optimizer.lr must be > 0, got 0");

  d = one_error("[data]\nval_fraction = 0.7\n");
  EXPECT_EQ(d.message, "data.val_fraction must be between 0 and 0.5, got 0.7");
  EXPECT_EQ(pos(d.origin), "m.toml:2:16");

  d = one_error("[data]\ndigits = 12\n");
  EXPECT_EQ(d.message, "data.digits must be between 1 and 9, got 12");

  d = one_error("[optimizer]\nbeta2 = 1.0\n");
  EXPECT_EQ(d.message, "optimizer.beta2 must be >= 0 and < 1, got 1.0");
}

TEST_F(ManifestTest, NotAllowedValue) {
  Diagnostic d = one_error("[data]\nkind = \"csv\"\n");
  EXPECT_EQ(d.key, "data.kind");
  EXPECT_EQ(d.message, "data.kind must be one of \"synthetic\", \"text\", \"tokens\", \"indexed\", \"chat\", got \"csv\"");
  EXPECT_EQ(pos(d.origin), "m.toml:2:8");


  d = one_error("[parallel]\norder = \"tp-dp\"\n");
  EXPECT_EQ(d.message,
            "parallel.order must be a '-'-joined permutation of tp, cp, ep, dp, pp "
            "(e.g. \"tp-cp-ep-dp-pp\"), got \"tp-dp\"");
  EXPECT_EQ(pos(d.origin), "m.toml:2:9");
  // Any permutation is fine.
  EXPECT_NO_THROW(Manifest::parse("[parallel]\norder = \"pp-dp-ep-cp-tp\"\n", "m.toml"));
}

TEST_F(ManifestTest, AllErrorsAreReportedAtOnce) {
  const std::string text =
      "[parallel]\n"
      "tp = \"2\"\n"     // 2:6 wrong type
      "tpp = 2\n"        // 3:1 unknown key
      "[device]\n"
      "param_dtype = \"fp8\"\n"  // 5:15 not allowed
      "[data]\n"
      "digits = 0\n";    // 7:10 out of range
  try {
    Manifest::parse(text, "m.toml");
    FAIL() << "expected a ManifestError";
  } catch (const ManifestError& e) {
    const auto& d = e.diagnostics();
    ASSERT_EQ(d.size(), 4u) << joined(d);
    EXPECT_EQ(d[0].str(), "m.toml:2:6: parallel.tp: parallel.tp must be an integer, got string \"2\"");
    EXPECT_EQ(pos(d[1].origin), "m.toml:3:1");
    EXPECT_EQ(d[1].key, "parallel.tpp");
    EXPECT_EQ(pos(d[2].origin), "m.toml:5:15");
    EXPECT_EQ(d[2].key, "device.param_dtype");
    EXPECT_EQ(pos(d[3].origin), "m.toml:7:10");
    EXPECT_EQ(d[3].key, "data.digits");
    std::string what = e.what();
    EXPECT_THAT(what, StartsWith("manifest has 4 errors:\nm.toml:2:6: parallel.tp: "));
    EXPECT_EQ(std::count(what.begin(), what.end(), '\n'), 4);
  }
}

TEST_F(ManifestTest, OneErrorIsSingular) {
  try {
    Manifest::parse("[parallel]\ntp = 0\n", "m.toml");
    FAIL() << "expected a ManifestError";
  } catch (const ManifestError& e) {
    EXPECT_EQ(std::string(e.what()),
              "manifest has 1 error:\nm.toml:2:6: parallel.tp: parallel.tp must be between 1 and 1048576, got 0");
  }
}

// ---- cross-key rules ----------------------------------------------------------

TEST_F(ManifestTest, HeadsDivisibleByTp) {
  Diagnostic d = one_error("[model]\nnum_heads = 6\nhidden_size = 48\n[parallel]\ntp = 4\n");
  EXPECT_EQ(d.key, "model.num_heads");
  EXPECT_THAT(d.message, HasSubstr("model.num_heads (6) must be divisible by parallel.tp (4)"));
  EXPECT_THAT(d.message, HasSubstr("tp could be 1, 2, 3, 6"));
  EXPECT_EQ(pos(d.origin), "m.toml:2:13");
}

TEST_F(ManifestTest, RuleOnADefaultIsReportedWhereAKeyWasWritten) {
  // num_heads is the default 4; the diagnostic points at the tp the user wrote.
  Diagnostic d = one_error("[parallel]\ntp = 8\n");
  EXPECT_EQ(d.key, "model.num_heads");
  EXPECT_THAT(d.message, HasSubstr("model.num_heads (4) must be divisible by parallel.tp (8)"));
  EXPECT_EQ(pos(d.origin), "m.toml:2:6");
}

TEST_F(ManifestTest, FfnDivisibleByTp) {
  Diagnostic d = one_error(
      "[model]\nnum_heads = 8\nhidden_size = 64\nffn_hidden_size = 100\n[parallel]\ntp = 8\n");
  EXPECT_EQ(d.key, "model.ffn_hidden_size");
  EXPECT_THAT(d.message, HasSubstr("model.ffn_hidden_size (100) must be divisible by parallel.tp (8)"));
  EXPECT_EQ(pos(d.origin), "m.toml:4:19");
  // ffn_hidden_size = 0 resolves to 4*hidden_size = 256, a multiple of 8.
  EXPECT_NO_THROW(Manifest::parse("[model]\nnum_heads = 8\nhidden_size = 64\n[parallel]\ntp = 8\n",
                                  "m.toml"));
}

TEST_F(ManifestTest, HiddenDivisibleByHeads) {
  Diagnostic d = one_error("[model]\nhidden_size = 130\nnum_heads = 4\n");
  EXPECT_EQ(d.key, "model.hidden_size");
  EXPECT_THAT(d.message, HasSubstr("model.hidden_size (130) must be divisible by model.num_heads (4)"));
  EXPECT_EQ(pos(d.origin), "m.toml:2:15");
}

TEST_F(ManifestTest, LayersDivisibleByPpTimesVpp) {
  Diagnostic d = one_error("[model]\nnum_layers = 6\n[parallel]\npp = 2\nvpp = 2\n");
  EXPECT_EQ(d.key, "model.num_layers");
  EXPECT_THAT(d.message,
              HasSubstr("model.num_layers (6) must be divisible by parallel.pp * parallel.vpp "
                        "(2*2 = 4)"));
  EXPECT_EQ(pos(d.origin), "m.toml:2:14");
  EXPECT_NO_THROW(Manifest::parse("[model]\nnum_layers = 8\n[parallel]\npp = 2\nvpp = 2\n", "m"));
}

TEST_F(ManifestTest, VppNeedsPp) {
  Diagnostic d = one_error("[parallel]\nvpp = 2\n");
  EXPECT_EQ(d.key, "parallel.vpp");
  EXPECT_THAT(d.message, HasSubstr("requires parallel.pp > 1"));
  EXPECT_EQ(pos(d.origin), "m.toml:2:7");
}

TEST_F(ManifestTest, GlobalBatchDivisibleByMicroTimesDp) {
  Diagnostic d = one_error(
      "[batch]\nmicro_batch_size = 4\nglobal_batch_size = 30\n[parallel]\ndp = 2\n");
  EXPECT_EQ(d.key, "batch.global_batch_size");
  EXPECT_THAT(d.message,
              HasSubstr("batch.global_batch_size (30) must be divisible by "
                        "batch.micro_batch_size * parallel.dp (4*2 = 8)"));
  EXPECT_THAT(d.message, HasSubstr("so each of the dp ranks runs a whole number of microbatches"));
  EXPECT_EQ(pos(d.origin), "m.toml:3:21");
}

// Sizes whose products wrapped around int64 (a SIGFPE in validate, plan and run, or
// "world size -2") are refused with the bound; a world of more ranks than loom runs too.
TEST_F(ManifestTest, HugeParallelAndBatchSizesAreRefusedWithTheirBound) {
  for (const char* set : {"parallel.dp=2305843009213693952", "parallel.pp=4611686018427387904",
                                 "parallel.cp=9223372036854775807", "parallel.vpp=9223372036854775807",
                                 "parallel.tp=1048577", "parallel.ep=1048577", "parallel.etp=1048577"}) {
    const Diagnostic d = one_error("", {set});
    EXPECT_THAT(d.message, HasSubstr("must be between")) << set;
    EXPECT_THAT(d.message, HasSubstr("1048576")) << set;
  }
  for (const char* set : {"batch.micro_batch_size=4611686018427387904", "batch.global_batch_size=1073741825"}) {
    const Diagnostic d = one_error("", {set});
    EXPECT_THAT(d.message, HasSubstr("must be between 1 and 1073741824")) << set;
  }
  // Model dimensions (num_layers 2^62 used to validate and build a model without blocks).
  for (const char* set : {"model.hidden_size=4611686018427387904", "model.num_layers=4611686018427387904",
                          "model.seq_length=4611686018427387904", "model.vocab_size=2147483648",
                          "model.ffn_hidden_size=4611686018427387904", "model.num_heads=65537"}) {
    const Diagnostic d = one_error("", {set});
    EXPECT_THAT(d.message, HasSubstr("must be between")) << set;
  }
  const Diagnostic wide = one_error("", {"model.seq_length=16777216", "batch.micro_batch_size=1048576",
                                         "batch.global_batch_size=2097152"});
  EXPECT_THAT(wide.message, HasSubstr("a microbatch's widest activation"));
  EXPECT_THAT(wide.message, HasSubstr("is more than loom holds in one tensor (2^48)"));
  const Diagnostic world = one_error("[model]\nnum_heads = 1024\nhidden_size = 1024\n[batch]\nmicro_batch_size = 1\n"
                                     "global_batch_size = 1024\n",
                                     {"parallel.tp=1024", "parallel.dp=1024", "parallel.pp=2", "model.num_layers=2"});
  EXPECT_THAT(world.message, HasSubstr("world size tp\u00b7cp\u00b7pp\u00b7dp = 1024\u00b71\u00b72\u00b71024 = "
                                       "2097152 ranks is more than loom runs (1048576)"));
  // Keyed to the largest factor (here dp), not to tp.
  const Diagnostic dp = one_error("", {"parallel.dp=1048576", "parallel.tp=2", "batch.micro_batch_size=1",
                                       "batch.global_batch_size=1048576"});
  EXPECT_EQ(dp.key, "parallel.dp");
  EXPECT_THAT(dp.message, HasSubstr("world size"));
}

TEST_F(ManifestTest, SequenceParallelNeedsSeqDivisibleByTp) {
  Diagnostic d = one_error(
      "[parallel]\nsequence_parallel = true\ntp = 2\n[model]\nseq_length = 65\n");
  EXPECT_EQ(d.key, "parallel.sequence_parallel");
  EXPECT_THAT(d.message,
              HasSubstr("requires model.seq_length (65) to be divisible by parallel.tp (2)"));
  EXPECT_EQ(pos(d.origin), "m.toml:2:21");
  // Pointless but allowed with tp = 1; fine without sequence parallelism.
  EXPECT_NO_THROW(Manifest::parse("[parallel]\nsequence_parallel = true\n[model]\nseq_length = 65\n", "m"));
  EXPECT_NO_THROW(Manifest::parse("[parallel]\ntp = 2\n[model]\nseq_length = 65\n", "m"));
}

TEST_F(ManifestTest, UnevenPipelineSplitMustAddUp) {
  Diagnostic d = one_error("[model]\nnum_layers = 7\n[parallel]\npp = 4\n[pipeline]\nfirst_chunk_layers = 2\n");
  EXPECT_EQ(d.key, "pipeline.first_chunk_layers");
  EXPECT_THAT(d.message, HasSubstr("the other 3 chunks would share 5 layers"));
  EXPECT_EQ(pos(d.origin), "m.toml:6:22");
  EXPECT_NO_THROW(Manifest::parse("[model]\nnum_layers = 7\n[parallel]\npp = 4\n[pipeline]\nfirst_chunk_layers = 1\n", "m"));
  // An even split that does not divide points at the uneven keys.
  d = one_error("[model]\nnum_layers = 6\n[parallel]\npp = 4\n");
  EXPECT_EQ(d.key, "model.num_layers");
  EXPECT_THAT(d.message, HasSubstr("pipeline.first_chunk_layers / pipeline.last_chunk_layers"));
  // pipeline.chunk_layers: pp * vpp counts that add up, not beside first/last_chunk_layers.
  EXPECT_NO_THROW(Manifest::parse("[model]\nnum_layers = 6\n[parallel]\npp = 4\n[pipeline]\nchunk_layers = [1, 2, 2, 1]\n", "m"));
  d = one_error("[model]\nnum_layers = 6\n[parallel]\npp = 4\n[pipeline]\nchunk_layers = [1, 2, 2]\n");
  EXPECT_EQ(d.key, "pipeline.chunk_layers");
  EXPECT_THAT(d.message, HasSubstr("there are pp * vpp = 4 chunks"));
  EXPECT_EQ(pos(d.origin), "m.toml:6:16");
  d = one_error("[model]\nnum_layers = 6\n[parallel]\npp = 2\n[pipeline]\nchunk_layers = [3, 3]\nlast_chunk_layers = 3\n");
  EXPECT_EQ(d.key, "pipeline.chunk_layers");
  EXPECT_THAT(d.message, HasSubstr("set one or the other"));
  d = one_error("[model]\nnum_layers = 6\n[parallel]\npp = 2\n[pipeline]\nchunk_layers = [7, -1]\n");
  EXPECT_THAT(d.message, HasSubstr("pipeline.chunk_layers must be a list of block counts from 0 to 65536"));
  d = one_error("[model]\nnum_layers = 6\n[parallel]\npp = 2\n[pipeline]\nchunk_layers = [3, \"3\"]\n");
  EXPECT_THAT(d.message, HasSubstr("pipeline.chunk_layers must be a list of block counts from 0 to 65536"));
}

TEST_F(ManifestTest, BlockPatternMustPlaceNumLayersBlocksOfKnownKinds) {
  const std::string kinds = "[model]\nnum_layers = 4\nblock_pattern = [\"dense*2\", \"block*3\"]\n[model.blocks]\n"
                            "dense = [\"attention\", \"mlp\"]\n";
  Diagnostic d = one_error(kinds);
  EXPECT_EQ(d.key, "model.block_pattern");
  EXPECT_THAT(d.message, HasSubstr("describes 5 block(s), but model.num_layers is 4"));
  EXPECT_EQ(pos(d.origin), "m.toml:3:17");
  EXPECT_NO_THROW(Manifest::parse("[model]\nnum_layers = 4\nblock_pattern = [\"dense*2\", \"block*2\"]\n"
                                  "[model.blocks]\ndense = [\"attention\", \"mlp\"]\n", "m"));
  d = one_error("[model]\nnum_layers = 2\nblock_pattern = [\"sparse*2\"]\n");
  EXPECT_THAT(d.message, HasSubstr("names block 'sparse', which is neither model.block (\"block\") nor an entry of "
                                   "model.blocks (defined: block)"));
}

TEST_F(ManifestTest, WorldSizeMustMatchTheLauncher) {
  const std::string text = "[parallel]\ntp = 2\npp = 2\n";
  EXPECT_NO_THROW(Manifest::parse(text, "m.toml"));  // no launcher: any world size
  setenv("OMPI_COMM_WORLD_SIZE", "8", 1);
  Diagnostic d = one_error(text);
  EXPECT_EQ(d.key, "parallel.tp");
  EXPECT_THAT(d.message,
              StartsWith("world size tp\u00b7cp\u00b7pp\u00b7dp = 2\u00b71\u00b72\u00b71 = 4 but the "
                         "launcher started 8 processes"));
  EXPECT_THAT(d.message, HasSubstr("OMPI_COMM_WORLD_SIZE=8"));
  EXPECT_EQ(pos(d.origin), "m.toml:2:6");
  // Matches with dp = 2.
  EXPECT_NO_THROW(Manifest::parse(text, "m.toml", {"parallel.dp=2"}));
  // OMPI_COMM_WORLD_SIZE wins over PMI_SIZE, which wins over SLURM_NTASKS.
  setenv("PMI_SIZE", "4", 1);
  EXPECT_THAT(one_error(text).message, HasSubstr("started 8 processes"));
  unsetenv("OMPI_COMM_WORLD_SIZE");
  EXPECT_NO_THROW(Manifest::parse(text, "m.toml"));
  unsetenv("PMI_SIZE");
  setenv("SLURM_NTASKS", "2", 1);
  EXPECT_THAT(one_error(text).message, HasSubstr("launcher started 2 processes (SLURM_NTASKS=2)"));
}

TEST_F(ManifestTest, ExpertParallelMustDivideDataTimesContext) {
  Diagnostic d = one_error("[parallel]\nep = 3\ndp = 2\n");
  EXPECT_EQ(d.key, "parallel.ep");
  EXPECT_THAT(d.message, HasSubstr("parallel.ep (3) must divide parallel.dp * parallel.cp (2*1 = 2)"));
  EXPECT_EQ(pos(d.origin), "m.toml:2:6");
  EXPECT_NO_THROW(Manifest::parse("[parallel]\nep = 2\ndp = 2\n", "m"));
}

// Context parallelism cuts the sequence into 2*cp chunks (an early and a late one
// per rank), so seq_length must divide by 2*cp, and under sequence parallelism each
// rank's seq / cp rows by tp; refused at the key, with the cp sizes that would fit.
TEST_F(ManifestTest, ContextParallelismNeedsTheSequenceToSplit) {
  Diagnostic cp = one_error("[model]\nseq_length = 12\n[parallel]\ncp = 4\n[data]\ndigits = 1\n");
  EXPECT_EQ(cp.key, "parallel.cp");
  EXPECT_THAT(cp.message, HasSubstr("model.seq_length (12) must be divisible by 8"));
  EXPECT_THAT(cp.message, HasSubstr("cp could be 1, 2, 3, 6"));
  EXPECT_EQ(pos(cp.origin), "m.toml:4:6");
  // An odd length has no two equal halves: only cp = 1 fits.
  Diagnostic odd = one_error("[model]\nseq_length = 9\n[parallel]\ncp = 2\n[data]\ndigits = 1\n");
  EXPECT_THAT(odd.message, HasSubstr("cp could be 1"));
  EXPECT_THAT(odd.message, Not(HasSubstr("cp could be 1,")));
  Diagnostic sp = one_error("[model]\nseq_length = 12\n[parallel]\ncp = 2\ntp = 4\nsequence_parallel = true\n[data]\ndigits = 1\n");
  EXPECT_EQ(sp.key, "parallel.sequence_parallel");
  EXPECT_THAT(sp.message, HasSubstr("divisible by parallel.tp (4) times parallel.cp (2)"));
  EXPECT_NO_THROW(Manifest::parse("[model]\nseq_length = 16\n[parallel]\ncp = 2\ntp = 4\nsequence_parallel = true\n", "m"));
}

// The synthetic addition task: a sequence too short for one problem trained to "loss
// 0, exact-match 100%" on nothing; an unknown task passed validate and failed in run.
TEST_F(ManifestTest, SyntheticDataNeedsAKnownTaskAndRoomForAProblem) {
  Diagnostic d = one_error("[model]\nseq_length = 12\n");
  EXPECT_EQ(d.key, "model.seq_length");
  EXPECT_THAT(d.message, HasSubstr("holds no addition problem of data.digits = 3 (one takes 3 * digits + 4 = 13"));
  EXPECT_NO_THROW(Manifest::parse("[model]\nseq_length = 13\n", "m"));
  EXPECT_NO_THROW(Manifest::parse("[model]\nseq_length = 7\n[data]\ndigits = 1\n", "m"));
  Diagnostic task = one_error("[data]\ntask = \"mul\"\n");
  EXPECT_EQ(task.key, "data.task");
  EXPECT_THAT(task.message, HasSubstr("is not a synthetic task; valid: \"add\""));
}

// Megatron's scheduler asserts what these refuse: a wsd decay needs its length, inside
// the steps between the warmup and decay_steps (run.steps when 0).
TEST_F(ManifestTest, AWsdScheduleNeedsItsDecayWithinTheSchedule) {
  Diagnostic none = one_error("[optimizer]\ndecay_style = \"wsd\"\n");
  EXPECT_EQ(none.key, "optimizer.wsd_decay_steps");
  EXPECT_THAT(none.message, HasSubstr("optimizer.wsd_decay_steps (0) steps before step 100"));
  EXPECT_THAT(none.message, HasSubstr("it must be between 1 and 100"));
  Diagnostic long_decay =
      one_error("[run]\nsteps = 50\n[optimizer]\ndecay_style = \"wsd\"\nwarmup_steps = 10\nwsd_decay_steps = 41\n");
  EXPECT_THAT(long_decay.message, HasSubstr("it must be between 1 and 40"));
  EXPECT_NO_THROW(Manifest::parse("[run]\nsteps = 50\n[optimizer]\ndecay_style = \"wsd\"\nwarmup_steps = 10\n"
                                  "wsd_decay_steps = 40\n", "m"));
  Diagnostic full = one_error("[optimizer]\ndecay_style = \"wsd\"\nwarmup_steps = 100\nwsd_decay_steps = 1\n");
  EXPECT_THAT(full.message, HasSubstr("between 1 and 0 (none: the warmup fills the schedule)"));
  Diagnostic spelled = one_error("[optimizer]\ndecay_style = \"WSD\"\n");
  EXPECT_EQ(spelled.key, "optimizer.decay_style");
  // A constant rate has no decay to end: decay_steps within the warmup is no error then.
  EXPECT_NO_THROW(Manifest::parse("[optimizer]\ndecay_style = \"constant\"\nwarmup_steps = 5\ndecay_steps = 3\n", "m"));
  EXPECT_EQ(one_error("[optimizer]\nwarmup_steps = 5\ndecay_steps = 3\n").key, "optimizer.decay_steps");
}

TEST_F(ManifestTest, TextDataNeedsAPath) {
  Diagnostic d = one_error("[data]\nkind = \"text\"\n");
  EXPECT_EQ(d.key, "data.kind");
  EXPECT_THAT(d.message, HasSubstr("requires data.path"));
  EXPECT_EQ(pos(d.origin), "m.toml:2:8");
  EXPECT_NO_THROW(Manifest::parse("[data]\nkind = \"tokens\"\npath = \"x.bin\"\n", "m"));
}

TEST_F(ManifestTest, RulesSkipKeysThatAreAlreadyWrong) {
  // tp = 0 is out of range; no division by zero and no second, derived error.
  std::vector<Diagnostic> d = errors("[parallel]\ntp = 0\nsequence_parallel = true\n");
  ASSERT_EQ(d.size(), 1u) << joined(d);
  EXPECT_EQ(d[0].key, "parallel.tp");
}

// ---- extends --------------------------------------------------------------------

TEST_F(ManifestTest, ExtendsMergesChildOverBase) {
  const std::string base = write("configs/base.toml",
                                 "[run]\nsteps = 7\n[parallel]\ntp = 2\npp = 2\n"
                                 "[model]\nblock = [\"attention\", \"mlp\", \"mlp\"]\n"
                                 "[model.layer.attention]\ndropout = 0.1\n");
  const std::string child = write("configs/exp/child.toml",
                                  "extends = \"../base.toml\"\n[parallel]\ntp = 4\n"
                                  "[model]\nblock = [\"mlp\"]\n"
                                  "[model.layer.attention]\ncausal = false\n");
  Manifest m = Manifest::load(child);
  EXPECT_EQ(m.get_int("parallel.tp"), 4);
  EXPECT_EQ(m.get_int("parallel.pp"), 2);
  EXPECT_EQ(m.get_int("run.steps"), 7);
  EXPECT_EQ(m.get_string_list("model.block"), std::vector<std::string>{"mlp"});  // arrays replace
  EXPECT_DOUBLE_EQ(m.get_float("model.layer.attention.dropout"), 0.1);          // tables merge
  EXPECT_FALSE(m.get_bool("model.layer.attention.causal"));
  EXPECT_FALSE(m.contains("extends"));

  const std::string base_shown = (fs::path(child).parent_path() / "../base.toml").lexically_normal().string();
  EXPECT_EQ(base_shown, base);
  EXPECT_EQ(m.origin("parallel.tp").str(), child + ":3:6");
  EXPECT_EQ(m.origin("parallel.pp").str(), base + ":5:6");
  EXPECT_EQ(m.origin("run.steps").str(), base + ":2:9");
  EXPECT_EQ(m.origin("model.block").str(), child + ":5:9");
  EXPECT_EQ(m.origin("model.layer.attention.dropout").str(), base + ":9:11");
  EXPECT_EQ(m.origin("model.layer.attention.causal").str(), child + ":7:10");
}

TEST_F(ManifestTest, ExtendsChainsAndErrorsInTheBaseNameTheBase) {
  const std::string a = write("a.toml", "[run]\nsteps = 1\nseed = 5\n");
  const std::string b = write("b.toml", "extends = \"a.toml\"\n[run]\nsteps = 2\n");
  const std::string c = write("c.toml", "extends = \"b.toml\"\n[run]\nname = \"c\"\n");
  Manifest m = Manifest::load(c);
  EXPECT_EQ(m.get_int("run.steps"), 2);
  EXPECT_EQ(m.get_int("run.seed"), 5);
  EXPECT_EQ(m.get_string("run.name"), "c");
  EXPECT_EQ(m.origin("run.seed").str(), a + ":3:8");

  write("bad_base.toml", "[parallel]\ntp = 0\n");
  const std::string d = write("d.toml", "extends = \"bad_base.toml\"\n");
  try {
    Manifest::load(d);
    FAIL() << "expected a ManifestError";
  } catch (const ManifestError& e) {
    ASSERT_EQ(e.diagnostics().size(), 1u);
    EXPECT_EQ(e.diagnostics()[0].origin.str(), (dir_ / "bad_base.toml").string() + ":2:6");
  }
}

TEST_F(ManifestTest, ExtendsCycleIsAnError) {
  const std::string a = write("a.toml", "extends = \"b.toml\"\n");
  const std::string b = write("b.toml", "# b\nextends = \"a.toml\"\n[run]\nsteps = 3\n");
  try {
    Manifest::load(a);
    FAIL() << "expected a ManifestError";
  } catch (const ManifestError& e) {
    ASSERT_EQ(e.diagnostics().size(), 1u);
    const Diagnostic& d = e.diagnostics()[0];
    EXPECT_EQ(d.key, "extends");
    EXPECT_EQ(d.origin.str(), b + ":2:11");
    EXPECT_EQ(d.message, "extends cycle: " + a + " -> " + b + " -> " + a);
  }
  const std::string self = write("self.toml", "extends = \"self.toml\"\n");
  EXPECT_THROW(Manifest::load(self), ManifestError);
}

// Not a TOML file: a directory trained the default model, /dev/zero ran out of memory
// ("std::bad_alloc"), a FIFO would block, an unreadable file read as empty.
TEST_F(ManifestTest, AManifestOrBaseThatIsNoFileIsRefusedSayingWhatItIs) {
  auto load_error = [](const std::string& path) -> std::string {
    try {
      Manifest::load(path);
    } catch (const ManifestError& e) {
      return e.diagnostics().empty() ? "" : e.diagnostics()[0].str();
    }
    return "(loaded)";
  };
  EXPECT_THAT(load_error(dir_.string()), HasSubstr("is not a manifest file: it is a directory"));
  if (fs::exists("/dev/zero")) {
    EXPECT_THAT(load_error("/dev/zero"), HasSubstr("is not a manifest file: it is not a regular file"));
    const std::string ext = write("ext.toml", "extends = \"/dev/zero\"\n");
    EXPECT_THAT(load_error(ext), HasSubstr("(/dev/zero) is not a regular file"));
  }
  const std::string dir_base = write("dirbase.toml", "extends = \"" + dir_.string() + "\"\n");
  EXPECT_THAT(load_error(dir_base), HasSubstr("is a directory, not a TOML file"));
}

// --set with a table value merges into the table the file has, as dotted keys would.
TEST_F(ManifestTest, ATableOverrideMergesIntoTheFilesTable) {
  Manifest m = Manifest::parse("[parallel]\ndp = 2\ntp = 2\n[model]\nnum_heads = 4\n", "m.toml",
                               {"parallel={tp=1, pp=1}"});
  EXPECT_EQ(m.get_int("parallel.dp"), 2);  // kept
  EXPECT_EQ(m.get_int("parallel.tp"), 1);  // replaced
  EXPECT_EQ(m.origin("parallel.dp").kind, Origin::Kind::File);
  EXPECT_EQ(m.origin("parallel.tp").kind, Origin::Kind::Override);
  // An empty table empties it (how a script clears a table of options).
  Manifest cleared = Manifest::parse("[device.options]\nthreads = 2\n", "m.toml", {"device.options={}"});
  ASSERT_NE(cleared.get_table("device.options"), nullptr);
  EXPECT_TRUE(cleared.get_table("device.options")->empty());
}

TEST_F(ManifestTest, MissingBaseIsAnError) {
  const std::string child = write("child.toml", "\nextends = \"nope.toml\"\n");
  try {
    Manifest::load(child);
    FAIL() << "expected a ManifestError";
  } catch (const ManifestError& e) {
    ASSERT_EQ(e.diagnostics().size(), 1u);
    const Diagnostic& d = e.diagnostics()[0];
    EXPECT_EQ(d.key, "extends");
    EXPECT_EQ(d.origin.str(), child + ":2:11");
    EXPECT_THAT(d.message, HasSubstr("\"nope.toml\" not found"));
    EXPECT_THAT(d.message, HasSubstr((dir_ / "nope.toml").string()));
  }
  EXPECT_THROW(Manifest::load((dir_ / "absent.toml").string()), ManifestError);
}

TEST_F(ManifestTest, SearchPathsAreRelativeToTheFileNamingThem) {
  write("sub/base.toml", "[plugins]\nsearch_paths = [\"plugins\", \"/abs/dir\"]\n");
  const std::string child = write("child.toml", "extends = \"sub/base.toml\"\n");
  Manifest m = Manifest::load(child);
  auto paths = m.get_string_list("plugins.search_paths");
  ASSERT_EQ(paths.size(), 2u);
  EXPECT_EQ(paths[0], (fs::absolute(dir_) / "sub" / "plugins").lexically_normal().string());
  EXPECT_EQ(paths[1], "/abs/dir");
}

// ---- --set overrides ---------------------------------------------------------------

TEST_F(ManifestTest, OverridesParseTomlValues) {
  Manifest m = Manifest::parse(
      "[parallel]\ntp = 1\n", "m.toml",
      {"parallel.tp=2", "optimizer.lr=0.5", "model.tie_embeddings=false",
       "model.block=[\"mlp\", \"mlp\"]", "run.name=\"quoted name\"", "model.layer.attn.dropout=0.2"});
  EXPECT_EQ(m.get_int("parallel.tp"), 2);
  EXPECT_DOUBLE_EQ(m.get_float("optimizer.lr"), 0.5);
  EXPECT_FALSE(m.get_bool("model.tie_embeddings"));
  EXPECT_EQ(m.get_string_list("model.block"), (std::vector<std::string>{"mlp", "mlp"}));
  EXPECT_EQ(m.get_string("run.name"), "quoted name");
  EXPECT_DOUBLE_EQ(m.get_float("model.layer.attn.dropout"), 0.2);
  EXPECT_EQ(m.origin("parallel.tp").kind, Origin::Kind::Override);
  EXPECT_EQ(m.origin("parallel.tp").str(), "--set parallel.tp=2");
  EXPECT_EQ(m.origin("model.layer.attn.dropout").str(), "--set model.layer.attn.dropout=0.2");
}

TEST_F(ManifestTest, BareWordIsAString) {
  Manifest bare = Manifest::parse("", "m.toml", {"optimizer.strategy=distributed"});
  Manifest quoted = Manifest::parse("", "m.toml", {"optimizer.strategy=\"distributed\""});
  EXPECT_EQ(bare.get_string("optimizer.strategy"), "distributed");
  EXPECT_EQ(bare.table(), quoted.table());
  // The later override wins.
  Manifest twice = Manifest::parse("", "m.toml", {"run.steps=3", "run.steps=4"});
  EXPECT_EQ(twice.get_int("run.steps"), 4);
  EXPECT_EQ(twice.origin("run.steps").str(), "--set run.steps=4");
}

TEST_F(ManifestTest, OverrideErrorsNameTheSetText) {
  Diagnostic d = one_error("", {"parallel.tpp=2"});
  EXPECT_EQ(d.str(),
            "--set parallel.tpp=2: parallel.tpp: unknown key 'parallel.tpp' (did you mean "
            "'parallel.tp'?)");
  EXPECT_EQ(d.origin.kind, Origin::Kind::Override);

  d = one_error("[parallel]\ntp = 2\n", {"parallel.tp=two"});
  EXPECT_EQ(d.str(), "--set parallel.tp=two: parallel.tp: parallel.tp must be an integer, got string \"two\"");

  d = one_error("", {"device.param_dtype=fp8"});
  EXPECT_THAT(d.str(), StartsWith("--set device.param_dtype=fp8: device.param_dtype: "));

  d = one_error("", {"run.steps"});
  EXPECT_THAT(d.message, HasSubstr("expected --set key.path=value"));

  d = one_error("", {"run..steps=1"});
  EXPECT_THAT(d.message, HasSubstr("not a key path"));

  d = one_error("[run]\nsteps = 3\n", {"run.steps.x=1"});
  EXPECT_THAT(d.message, HasSubstr("run.steps is integer 3, not a table"));
}

// ---- plugin options -------------------------------------------------------------------

std::vector<OptionDecl> attention_decls() {
  return {
      {OptionDecl::Type::Float, "dropout", "0.0", "dropout probability"},
      {OptionDecl::Type::Bool, "causal", "true", "causal mask"},
      {OptionDecl::Type::Int, "kv_heads", "0", "grouped-query heads (0 = num_heads)"},
      {OptionDecl::Type::String, "impl", "\"naive\"", "kernel"},
  };
}

TEST_F(ManifestTest, PluginOptionsGetDefaults) {
  Manifest m = Manifest::parse(
      "[model.layer.attn]\nplugin = \"attention\"\ndropout = 1\n", "m.toml");
  std::vector<Diagnostic> diags;
  m.apply_plugin_options("model.layer.attn", "layer/attention", attention_decls(), diags, {"plugin"});
  EXPECT_TRUE(diags.empty()) << joined(diags);
  EXPECT_DOUBLE_EQ(m.get_float("model.layer.attn.dropout"), 1.0);
  EXPECT_TRUE(m.table().at_path("model.layer.attn.dropout").is_floating_point());
  EXPECT_EQ(m.origin("model.layer.attn.dropout").str(), "m.toml:3:11");
  EXPECT_TRUE(m.get_bool("model.layer.attn.causal"));
  EXPECT_EQ(m.get_int("model.layer.attn.kv_heads"), 0);
  EXPECT_EQ(m.get_string("model.layer.attn.impl"), "naive");
  EXPECT_EQ(m.origin("model.layer.attn.impl").kind, Origin::Kind::Default);

  // An absent section is created with the defaults.
  m.apply_plugin_options("device.options", "device/cpu",
                         {{OptionDecl::Type::Int, "align", "64", "alignment"}}, diags);
  EXPECT_TRUE(diags.empty()) << joined(diags);
  EXPECT_EQ(m.get_int("device.options.align"), 64);
  EXPECT_EQ(m.origin("device.options.align").kind, Origin::Kind::Default);
}

TEST_F(ManifestTest, PluginOptionErrors) {
  Manifest m = Manifest::parse(
      "[model.layer.attention]\ndropuot = 0.1\ncausal = \"yes\"\n", "m.toml");
  std::vector<Diagnostic> diags;
  std::vector<OptionDecl> decls = attention_decls();
  decls.push_back({OptionDecl::Type::Int, "window", std::nullopt, "attention window"});
  m.apply_plugin_options("model.layer.attention", "layer/attention", decls, diags, {"plugin"});
  ASSERT_EQ(diags.size(), 3u) << joined(diags);

  EXPECT_EQ(diags[0].key, "model.layer.attention.causal");
  EXPECT_THAT(diags[0].message,
              StartsWith("model.layer.attention.causal must be a boolean, got string \"yes\""));
  EXPECT_EQ(pos(diags[0].origin), "m.toml:3:10");

  EXPECT_EQ(diags[1].key, "model.layer.attention.dropuot");
  EXPECT_EQ(diags[1].message,
            "unknown option 'dropuot' for layer/attention at model.layer.attention (did you mean "
            "'dropout'?)");
  EXPECT_EQ(pos(diags[1].origin), "m.toml:2:1");

  EXPECT_EQ(diags[2].key, "model.layer.attention.window");
  EXPECT_THAT(diags[2].message,
              StartsWith("missing required option 'window' for layer/attention at "
                         "model.layer.attention"));
  EXPECT_EQ(pos(diags[2].origin), "m.toml:1:1");

  // A plugin that takes no options says so.
  std::vector<Diagnostic> none;
  Manifest n = Manifest::parse("[exec.options]\nfoo = 1\n", "m.toml");
  n.apply_plugin_options("exec.options", "exec/eager", {}, none);
  ASSERT_EQ(none.size(), 1u);
  EXPECT_THAT(none[0].message, HasSubstr("exec/eager takes no options"));
}

TEST_F(ManifestTest, PluginOptionRangesAndChoices) {
  // The declaration forms of loom_option_decl.range / .choices.
  const ValueBounds unit = ValueBounds::parse("[0, 1)", nullptr);
  EXPECT_EQ(unit.interval_text(), "[0, 1)");
  EXPECT_EQ(unit.bounds_text(), "must be >= 0 and < 1");
  EXPECT_EQ(ValueBounds::parse(" ( 0 , inf ) ", nullptr).interval_text(), "(0, inf)");
  EXPECT_EQ(ValueBounds::parse("[-1,]", nullptr).bounds_text(), "must be >= -1");
  EXPECT_EQ(ValueBounds::parse("[1, 8]", nullptr).bounds_text(), "must be between 1 and 8");
  EXPECT_EQ(ValueBounds::parse(nullptr, "a|b|c").allowed, (std::vector<std::string>{"a", "b", "c"}));
  for (const char* bad : {"0, 1", "[0; 1]", "[a, 1]", "[2, 1]", "[1, 1)", "[0, 1, 2]", "[nan, 1]", "[]"})
    EXPECT_THROW(ValueBounds::parse(bad, nullptr), std::invalid_argument) << bad;
  // A plugin's float option is held to what a 32-bit float makes of it, bounds rounded
  // alike: 1e-300 is 0, not > 0; 0.1 stays within [0, 0.1] and 0.7 within [0.7, 1].
  auto value = [](double v) { return toml::value<double>(v); };
  EXPECT_THAT(ValueBounds::parse("(0, 1)", nullptr).problem(value(1e-300)),
              HasSubstr("which is 0 as a 32-bit float"));
  EXPECT_THAT(ValueBounds::parse("(0, inf)", nullptr).problem(value(1e300)), HasSubstr("at most 3.4e38"));
  EXPECT_EQ(ValueBounds::parse("[0, 0.1]", nullptr).problem(value(0.1)), "");
  EXPECT_EQ(ValueBounds::parse("[0.7, 1]", nullptr).problem(value(0.7)), "");
  ValueBounds wide = ValueBounds::parse("(0, inf)", nullptr);
  wide.single_precision = false;  // an engine key used as a double (comm.timeout_s)
  EXPECT_EQ(wide.problem(value(1e-50)), "");

  Manifest m = Manifest::parse(
      "[model.layer.attention]\ndropout = 1\nkv_heads = -2\nimpl = \"flsh\"\n", "m.toml");
  std::vector<OptionDecl> decls = attention_decls();
  decls[0].bounds = ValueBounds::parse("[0, 1)", nullptr);
  decls[2].bounds = ValueBounds::parse("[0, 4096]", nullptr);
  decls[3].bounds = ValueBounds::parse(nullptr, "naive|flash");
  std::vector<Diagnostic> diags;
  m.apply_plugin_options("model.layer.attention", "layer/attention", decls, diags, {"plugin"});
  ASSERT_EQ(diags.size(), 3u) << joined(diags);
  EXPECT_THAT(diags[0].message, StartsWith("model.layer.attention.dropout must be >= 0 and < 1, got 1"));
  EXPECT_EQ(pos(diags[0].origin), "m.toml:2:11");
  EXPECT_THAT(diags[1].message, StartsWith("model.layer.attention.impl must be one of \"naive\", \"flash\", got "
                                           "\"flsh\" (did you mean \"flash\"?)"));
  EXPECT_THAT(diags[1].message, HasSubstr("(option of layer/attention: kernel)"));
  EXPECT_THAT(diags[2].message, StartsWith("model.layer.attention.kv_heads must be between 0 and 4096, got -2"));

  // Values inside the bounds pass, the bounds' ends as declared.
  Manifest ok = Manifest::parse("[model.layer.attention]\ndropout = 0\nkv_heads = 4096\nimpl = \"flash\"\n", "m.toml");
  std::vector<Diagnostic> none;
  ok.apply_plugin_options("model.layer.attention", "layer/attention", decls, none, {"plugin"});
  EXPECT_TRUE(none.empty()) << joined(none);
}

// ---- serialisation and entries ---------------------------------------------------------

TEST_F(ManifestTest, ToTomlRoundTrips) {
  Manifest m = Manifest::parse(
      "[run]\nname = \"quote \\\" and \\\\ backslash\\n\"\nsteps = 12\n"
      "[optimizer]\nlr = 3e-4\nbeta2 = 0.999\n"
      "[model.layer.attn]\nplugin = \"attention\"\ndropout = 0.1\n"
      "[model.layer.\"odd key\"]\nx = [1, 2]\ny = { z = \"w\" }\n"
      "[pipeline.options]\n",
      "m.toml", {"data.val_fraction=0.25", "model.block=[\"attn\", \"mlp\"]"});
  const std::string text = m.to_toml();
  Manifest again = Manifest::parse(text, "again.toml");
  EXPECT_EQ(m.table(), again.table()) << text;
  EXPECT_EQ(again.get_string("run.name"), "quote \" and \\ backslash\n");
  EXPECT_DOUBLE_EQ(again.get_float("optimizer.lr"), 3e-4);
  EXPECT_NE(again.get_table("pipeline.options"), nullptr);  // empty tables survive
  EXPECT_THAT(text, HasSubstr("lr = 3e-04\n"));       // shortest float forms
  EXPECT_THAT(text, HasSubstr("beta2 = 0.999\n"));
  EXPECT_THAT(text, HasSubstr("[model.layer.\"odd key\"]\n"));
  // Sections and keys in schema order; a layer table starts with its plugin.
  EXPECT_THAT(text, StartsWith("[run]\nname = "));
  EXPECT_LT(text.find("[model]"), text.find("[parallel]"));
  EXPECT_THAT(text, HasSubstr("[model.layer.attn]\nplugin = \"attention\"\ndropout = 0.1\n"));
  // Serialising again gives the same text.
  EXPECT_EQ(again.to_toml(), text);
}

TEST_F(ManifestTest, EntriesListEveryLeafInSchemaOrder) {
  Manifest m = Manifest::parse("[model.layer.attn]\ndropout = 0.1\n[parallel]\ntp = 2\n", "m.toml",
                               {"run.steps=5"});
  std::vector<Manifest::Entry> e = m.entries();
  size_t leaves = 0;
  for (const schema::KeySpec& k : schema::keys()) leaves += k.type != schema::KeyType::Table;
  ASSERT_EQ(e.size(), leaves + 2);  // + model.layer.attn.{dropout,plugin}
  EXPECT_EQ(e[0].key, "run.name");
  EXPECT_EQ(e[0].value, "\"loom\"");
  EXPECT_EQ(e[1].key, "run.steps");
  EXPECT_EQ(e[1].value, "5");
  EXPECT_EQ(e[1].origin.str(), "--set run.steps=5");
  auto find = [&](const std::string& key) -> const Manifest::Entry* {
    for (const auto& x : e)
      if (x.key == key) return &x;
    return nullptr;
  };
  auto index = [&](const std::string& key) { return find(key) - e.data(); };
  ASSERT_NE(find("model.layer.attn.dropout"), nullptr);
  EXPECT_EQ(find("model.layer.attn.dropout")->value, "0.1");
  EXPECT_EQ(find("model.layer.attn.dropout")->origin.str(), "m.toml:2:11");
  EXPECT_EQ(find("parallel.tp")->origin.str(), "m.toml:4:6");
  EXPECT_EQ(find("model.block")->value, "[\"attention\", \"mlp\"]");
  EXPECT_EQ(find("optimizer.lr")->value, "0.001");
  EXPECT_EQ(find("optimizer.eps")->value, "1e-08");
  EXPECT_LT(index("model.post"), index("model.layer.attn.dropout"));
  EXPECT_LT(index("model.layer.attn.plugin"), index("parallel.tp"));
}

// ---- did you mean ------------------------------------------------------------------------

TEST(DidYouMean, PicksTheClosestWithinALengthScaledDistance) {
  EXPECT_EQ(did_you_mean("tpp", {"tp", "pp", "dp"}), "tp");
  EXPECT_EQ(did_you_mean("dropuot", {"causal", "dropout"}), "dropout");  // transposition
  EXPECT_EQ(did_you_mean("TP", {"pp", "tp"}), "tp");                    // case-insensitive
  EXPECT_EQ(did_you_mean("paralel", {"run", "parallel", "pipeline"}), "parallel");
  EXPECT_EQ(did_you_mean("xyz", {"tp", "pp"}), "");
  EXPECT_EQ(did_you_mean("hidden", {"hidden_size"}), "");  // 5 edits is too far for 6 letters
  EXPECT_EQ(did_you_mean("global_bach_sise", {"global_batch_size", "micro_batch_size"}),
            "global_batch_size");
  EXPECT_EQ(did_you_mean("a", {"b"}), "");
  EXPECT_EQ(did_you_mean("anything", {}), "");
}

}  // namespace
}  // namespace loom::manifest
