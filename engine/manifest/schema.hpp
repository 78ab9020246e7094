// The engine schema: every core manifest key with its type, default, one-line doc
// and allowed values, plus the cross-key rules that no single key can check.
// Table-driven so `loom validate`, `loom explain` and the manifest reference can
// be generated from the same list the loader validates against.
#pragma once

#include "engine/manifest/manifest.hpp"

#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace loom::manifest::schema {

enum class KeyType { Bool, Int, Float, String, StringList, Array, Table };  // Array: any elements (its check says which)

// "a boolean", "an integer", ... as used in "X must be <...>".
std::string_view describe(KeyType type);

// Numeric bounds (Int and Float) and allowed strings come from ValueBounds.
struct KeySpec : ValueBounds {
  std::string path;  // dotted, e.g. "parallel.tp"
  KeyType type = KeyType::String;
  // TOML literal ("1", "\"ddp\"", "[\"mlp\"]"); nullopt = required. Tables have none.
  std::optional<std::string> default_value;
  std::string doc;  // one line
  // Table: open tables accept any keys here (plugins validate them later).
  bool open = false;
  // Extra check on a value of the right type: returns "" or the message tail
  // after "<path> must ..." (e.g. "be a '-'-joined permutation of ...").
  std::function<std::string(const toml::node&)> check;

  std::string section() const;  // "parallel"
  std::string name() const;     // "tp"
};

// Every core key, in the order of the manifest reference (sections in order,
// keys in order inside each section).
const std::vector<KeySpec>& keys();
// Null when `path` is not a core key.
const KeySpec* find(std::string_view path);
// A core key's default as a table {v = default} (read it as `d["v"]`); an empty table
// for a key without a default or not in the schema.
toml::table default_of(std::string_view path);
// The top-level sections in order: run, model, parallel, ...
const std::vector<std::string>& sections();
// The key names of one section ("tp", "pp", ...), in schema order.
std::vector<std::string> section_keys(std::string_view section);

// The path of the table whose sub-tables configure layer instances.
inline constexpr std::string_view kLayerTable = "model.layer";
// The table of further block kinds, and the name model.block_pattern gives model.block.
inline constexpr std::string_view kBlockTable = "model.blocks";
inline constexpr std::string_view kDefaultBlock = "block";

// One entry of model.block_pattern: "NAME" (one block) or "NAME*N" (N of them, 1 to
// 65536); nullopt when malformed.
struct BlockRun {
  std::string name;
  int64_t count = 1;
};
std::optional<BlockRun> parse_block_run(const std::string& entry);
// The blocks a valid model.block_pattern describes, one name per block in order;
// nullopt when it would be more than `limit` long (none is expanded past it).
std::optional<std::vector<std::string>> expand_block_pattern(const std::vector<std::string>& pattern, int64_t limit);
// What the transformer blocks of a resolved manifest (a checkpoint's manifest.toml, or
// one without model.block_pattern from before it existed) are, in order, as runs:
// `[attention, mlp] x 3, [attention, moe] x 58`; two manifests whose texts are
// equal compose the same blocks however they write it.
std::string block_composition(const toml::table& resolved);

// Cross-key rules (divisibility, factorisation, launcher world size, ...) over a
// manifest whose keys have been type- and range-checked and defaulted. Rules that
// involve a key in `bad` (one that already has a diagnostic) are skipped.
void check_rules(const Manifest& m, const std::set<std::string>& bad,
                 std::vector<Diagnostic>& diags);

// The world size the launcher started, from OMPI_COMM_WORLD_SIZE, PMI_SIZE or
// SLURM_NTASKS (first one set and a positive integer); `var` gets its name.
std::optional<int64_t> launcher_world_size(std::string* var = nullptr);

// Values whose 0 means "derived": model.ffn_hidden_size (0 = 4*hidden_size) and
// parallel.etp (0 = tp). Assume a validated manifest.
int64_t resolved_ffn_hidden_size(const Manifest& m);
// run.steps, or the steps of run.train_samples when it is set (Megatron-LM's
// --train-samples; engine/manifest/batches.hpp).
int64_t resolved_steps(const Manifest& m);
int64_t resolved_etp(const Manifest& m);

}  // namespace loom::manifest::schema
