// The run manifest: TOML (TOML++) with `extends` inheritance and --set overrides,
// validated as a whole against the engine schema (schema.cpp) and, once plugins
// are loaded, against each plugin's option declarations. Every diagnostic names
// the key path, file:line:column and what would be valid.
#pragma once

#include <toml++/toml.h>

#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace loom::manifest {

// Where a value came from.
struct Origin {
  enum class Kind { File, Default, Override };
  Kind kind = Kind::Default;
  std::string file;   // File: the manifest file (after extends resolution)
  int line = 0;       // File: 1-based
  int column = 0;
  std::string text;   // Override: the --set argument as given
  std::string str() const;  // "configs/x.toml:12:3", "default", "--set run.steps=5"
};

struct Diagnostic {
  std::string key;       // dotted key path, e.g. "parallel.tp"
  Origin origin;         // where the offending value (or its table) is
  std::string message;   // what is wrong and what would be valid
  std::string str() const;  // "configs/x.toml:12:3: parallel.tp: <message>"
};

// Thrown with every diagnostic found (never just the first).
class ManifestError : public std::runtime_error {
 public:
  explicit ManifestError(std::vector<Diagnostic> diags);
  const std::vector<Diagnostic>& diagnostics() const { return diags_; }

 private:
  std::vector<Diagnostic> diags_;
};

// The values a numeric or string setting allows: the engine's own keys and the
// options plugins declare are checked by the same rules and messages.
struct ValueBounds {
  std::optional<double> min, max;  // Int and Float
  bool min_exclusive = false, max_exclusive = false;
  // A Float the math takes as a 32-bit float (the optimizer's settings, every plugin's
  // float option): its value rounded to float must also be finite and in bounds.
  bool single_precision = false;
  std::vector<std::string> allowed;  // String: the allowed values; empty = any

  // "must be >= 1", "must be between 0 and 0.5", "" when unbounded.
  std::string bounds_text() const;
  // "[0, 1)", "[1, inf)"; "" when unbounded.
  std::string interval_text() const;
  // "" when `v` (already of the right type and finite) is allowed; otherwise the
  // message tail after the key: "must be >= 1, got 0", "must be one of ..., got ...".
  std::string problem(const toml::node& v) const;
  // A plugin's declaration: `range` like "[0, 1)" or "(0, inf)" (NULL = none) and
  // `choices` like "a|b" (NULL = none). Throws std::invalid_argument when malformed.
  static ValueBounds parse(const char* range, const char* choices);
};

// One option of a plugin, as its declaration says (mirrors loom_option_decl).
struct OptionDecl {
  enum class Type { Bool, Int, Float, String };
  Type type;
  std::string name;
  std::optional<std::string> default_value;  // TOML literal; nullopt = required
  std::string doc;
  ValueBounds bounds;  // ABI 1.9 range / choices; unbounded for older plugins
};

class Manifest {
 public:
  // Reads `path`, follows `extends` (relative to the including file; cycles are
  // errors), applies overrides ("key.path=value": TOML value, or a bare word
  // taken as a string), fills defaults from the engine schema and validates the
  // core schema and the cross-key rules. Throws ManifestError with all problems.
  static Manifest load(const std::string& path, const std::vector<std::string>& overrides = {});
  // The same from TOML text (tests); `name` stands in for the file name. A manifest
  // of another run (a checkpoint's, read for its layout) is not this process's launch:
  // Launch::Other skips the check of its world size against mpirun's/srun's.
  enum class Launch { This, Other };
  static Manifest parse(const std::string& text, const std::string& name,
                        const std::vector<std::string>& overrides = {}, Launch launch = Launch::This);
  // Whether the world size is checked against the launcher's (Launch::This).
  bool describes_this_launch() const { return this_launch_; }

  // The resolved table: defaults filled in, overrides applied.
  const toml::table& table() const { return table_; }
  // Provenance of a key path (Default for schema defaults).
  Origin origin(const std::string& key_path) const;
  // Every leaf key path with its value as TOML text and its origin, in schema order.
  struct Entry { std::string key; std::string value; Origin origin; };
  std::vector<Entry> entries() const;

  // Typed access; throws std::logic_error if the key is missing or of the wrong type
  // (cannot happen for schema keys after validation).
  int64_t get_int(const std::string& key_path) const;
  double get_float(const std::string& key_path) const;  // ints are accepted as floats
  bool get_bool(const std::string& key_path) const;
  std::string get_string(const std::string& key_path) const;
  std::vector<std::string> get_string_list(const std::string& key_path) const;
  bool contains(const std::string& key_path) const;
  const toml::table* get_table(const std::string& key_path) const;

  // Validates the table at `section_path` (e.g. "model.layer.attention",
  // "device.options") against a plugin's options: unknown keys (with a "did you
  // mean"), wrong types. Fills in defaults. `skip` keys are allowed (e.g. "plugin").
  // Appends to diags rather than throwing, so callers can report everything at once.
  void apply_plugin_options(const std::string& section_path, const std::string& plugin_name,
                            const std::vector<OptionDecl>& decls, std::vector<Diagnostic>& diags,
                            const std::vector<std::string>& skip = {});

  // The resolved manifest as TOML text (for checkpoints and `loom validate`).
  std::string to_toml() const;

 private:
  toml::table table_;
  std::map<std::string, Origin> origins_;
  std::map<std::string, Origin> key_origins_;  // where each key itself is written
  bool this_launch_ = true;
  friend class ManifestLoader;
};

// A value as one line of TOML text: 2, 0.001, "ddp", ["attention", "mlp"], { a = 1 }.
std::string to_toml_text(const toml::node& value);

// Closest candidate by edit distance, or "" when none is close enough.
std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates);

// An integer of a manifest's text as `overrides` set it (the last setting of the key
// wins), else as the text has it: for a command that replaces some of the run's sizes
// and needs one before the whole manifest, with its replacements, can be checked.
// An override that is not a number is left to that check: the text's value is returned.
int64_t int_as_overridden(const std::string& text, const std::string& name, const std::vector<std::string>& overrides,
                          const std::string& key);

}  // namespace loom::manifest
