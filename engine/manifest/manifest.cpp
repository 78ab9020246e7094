// Manifest loading (extends, --set overrides), validation against the engine
// schema, provenance, plugin option validation and serialisation.
//
// toml++ does not keep source positions when nodes are copied, so provenance is
// recorded when each file is parsed (one Origin per node path, for the value and
// for the key) and carried alongside the table through merges and overrides.
#include "engine/manifest/manifest.hpp"

#include "engine/manifest/schema.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <system_error>

namespace loom::manifest {

namespace fs = std::filesystem;
using OriginMap = std::map<std::string, Origin>;

namespace {

// ---- small helpers -------------------------------------------------------

std::string join_path(const std::string& prefix, std::string_view key) {
  return prefix.empty() ? std::string(key) : prefix + "." + std::string(key);
}

std::vector<std::string> split_path(std::string_view path) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : path) {
    if (c == '.') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

// The most parts a dotted key may have. Manifest keys have at most six
// (model.layer.NAME.options...); toml++ parses a dotted key and loom walks a key path a
// frame per part, so a key of ~40,000 parts overflowed the stack (SIGSEGV).
constexpr int kMaxKeyParts = 64;

// The 1-based line of the first key in `text` (a TOML document) with more than
// kMaxKeyParts dot-joined parts, outside strings and comments; 0 when there is none.
// A float (1.5) or a time (00:32:00.999) has one dot, values in arrays are apart.
int line_of_overlong_key(std::string_view text) {
  int line = 1, dots = 0;
  size_t i = 0;
  auto starts = [&](std::string_view s) { return text.substr(i, s.size()) == s; };
  while (i < text.size()) {
    const char c = text[i];
    if (starts("\"\"\"") || starts("'''")) {  // a multi-line string: its own lines, no key
      const std::string_view close = text.substr(i, 3);
      i += 3;
      while (i < text.size() && !starts(close)) {
        if (close[0] == '"' && text[i] == '\\') ++i;  // an escape (a line-ending one joins lines)
        if (i < text.size() && text[i] == '\n') ++line;
        ++i;
      }
      i += 3;
      continue;
    }
    if (c == '"' || c == '\'') {  // a one-line string: a quoted key part or a value
      for (++i; i < text.size() && text[i] != c && text[i] != '\n'; ++i)
        if (c == '"' && text[i] == '\\' && i + 1 < text.size() && text[i + 1] != '\n') ++i;
      if (i < text.size() && text[i] == c) ++i;  // an unclosed one ends at its line's end, which is counted
      continue;
    }
    if (c == '#') {
      while (i < text.size() && text[i] != '\n') ++i;
      continue;
    }
    if (c == '.') {
      if (++dots >= kMaxKeyParts) return line;
    } else if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == ' ' || c == '\t')) {
      dots = 0;  // '=', '[', ']', ',', '{', a newline...: the chain ends
    }
    if (c == '\n') ++line;
    ++i;
  }
  return 0;
}

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string join_list(const std::vector<std::string>& items, const std::string& sep = ", ") {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

bool is_bare_key(std::string_view k) {
  if (k.empty()) return false;
  for (char c : k)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) return false;
  return true;
}

std::string quote_basic(std::string_view s) {
  std::string out = "\"";
  for (char ch : s) {
    unsigned char c = static_cast<unsigned char>(ch);
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\t': out += "\\t"; break;
      case '\n': out += "\\n"; break;
      case '\f': out += "\\f"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += ch;
        }
    }
  }
  return out + "\"";
}

std::string key_text(std::string_view k) { return is_bare_key(k) ? std::string(k) : quote_basic(k); }

std::string format_float(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v < 0 ? "-inf" : "inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, v);  // shortest round-trip form
  std::string s(buf, res.ptr);
  if (s.find_first_of(".eE") == std::string::npos) s += ".0";
  return s;
}

std::string type_name(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::table: return "table";
    case toml::node_type::array: return "array";
    case toml::node_type::string: return "string";
    case toml::node_type::integer: return "integer";
    case toml::node_type::floating_point: return "float";
    case toml::node_type::boolean: return "boolean";
    case toml::node_type::date: return "date";
    case toml::node_type::time: return "time";
    case toml::node_type::date_time: return "date-time";
    default: return "nothing";
  }
}

// "string \"2\"", shortened to one readable line.
std::string describe_value(const toml::node& n) {
  std::string text = to_toml_text(n);
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return type_name(n) + " " + text;
}

std::string quoted_list(const std::vector<std::string>& items) {
  std::vector<std::string> q;
  for (const auto& s : items) q.push_back(quote_basic(s));
  return join_list(q);
}

Origin file_origin(const std::string& file, const toml::source_region& src) {
  Origin o;
  o.kind = Origin::Kind::File;
  o.file = file;
  o.line = static_cast<int>(src.begin.line);
  o.column = static_cast<int>(src.begin.column);
  return o;
}

Origin override_origin(const std::string& text) {
  Origin o;
  o.kind = Origin::Kind::Override;
  o.text = text;
  return o;
}

// Records every node's position under `prefix` (arrays are leaves).
void record(const toml::table& t, const std::string& prefix, const std::string& file,
            OriginMap& vals, OriginMap& keys) {
  for (auto&& [k, v] : t) {
    std::string path = join_path(prefix, k.str());
    vals[path] = file_origin(file, v.source());
    keys[path] = k.source().begin.line ? file_origin(file, k.source()) : vals[path];
    if (const toml::table* sub = v.as_table()) record(*sub, path, file, vals, keys);
  }
}

// Sets `o` for `path` and every node below it.
void mark(const toml::node& n, const std::string& path, const Origin& o, OriginMap& vals,
          OriginMap& keys) {
  vals[path] = o;
  keys[path] = o;
  if (const toml::table* t = n.as_table())
    for (auto&& [k, v] : *t) mark(v, join_path(path, k.str()), o, vals, keys);
}

bool is_under(const std::string& key, const std::string& path) {
  return key == path || (key.size() > path.size() && key.compare(0, path.size(), path) == 0 &&
                         key[path.size()] == '.');
}

void erase_under(OriginMap& m, const std::string& path) {
  for (auto it = m.lower_bound(path); it != m.end() && it->first.compare(0, path.size(), path) == 0;) {
    if (is_under(it->first, path))
      it = m.erase(it);
    else
      ++it;
  }
}

void copy_under(const OriginMap& from, OriginMap& to, const std::string& path) {
  for (auto it = from.lower_bound(path);
       it != from.end() && it->first.compare(0, path.size(), path) == 0; ++it)
    if (is_under(it->first, path)) to[it->first] = it->second;
}

const toml::node* find_node(const toml::table& root, std::string_view path) {
  const toml::table* t = &root;
  const toml::node* n = nullptr;
  for (const std::string& part : split_path(path)) {
    if (t == nullptr) return nullptr;
    n = t->get(part);
    if (n == nullptr) return nullptr;
    t = n->as_table();
  }
  return n;
}

toml::node* find_node(toml::table& root, std::string_view path) {
  return const_cast<toml::node*>(find_node(static_cast<const toml::table&>(root), path));
}

// Parses a TOML literal ("4", "\"gelu\"", "[1, 2]"); null when it is not one value.
std::unique_ptr<toml::table> parse_literal(const std::string& text) {
  try {
    auto t = std::make_unique<toml::table>(toml::parse(std::string_view("v = " + text + "\n")));
    if (t->size() != 1 || !t->contains("v")) return nullptr;
    return t;
  } catch (const toml::parse_error&) {
    return nullptr;
  }
}

// Relative plugins.search_paths entries become absolute, relative to `dir`.
void resolve_search_paths(toml::table& root, const fs::path& dir) {
  toml::node* n = find_node(root, "plugins.search_paths");
  if (n == nullptr || !n->is_array()) return;
  toml::array resolved;
  for (const toml::node& e : *n->as_array()) {
    if (const auto* s = e.as_string()) {
      fs::path p(s->get());
      if (!p.empty() && p.is_relative()) p = (dir / p).lexically_normal();
      resolved.push_back(p.string());
    } else {
      resolved.push_back(e);
    }
  }
  root["plugins"].as_table()->insert_or_assign("search_paths", std::move(resolved));
}

fs::path dir_of(const std::string& file) {
  fs::path dir = fs::path(file).parent_path();
  std::error_code ec;
  fs::path abs = fs::absolute(dir.empty() ? fs::path(".") : dir, ec);
  return ec ? dir : abs.lexically_normal();
}

// Optimal-string-alignment distance (Levenshtein plus adjacent transpositions).
size_t edit_distance(const std::string& a, const std::string& b) {
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<size_t>> d(n + 1, std::vector<size_t>(m + 1));
  for (size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (size_t i = 1; i <= n; ++i) {
    for (size_t j = 1; j <= m; ++j) {
      size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[n][m];
}

// ---- serialisation -------------------------------------------------------

// The keys of `t` (at dotted `path`) with core keys first, in schema order.
std::vector<std::pair<std::string, const toml::node*>> ordered(const toml::table& t,
                                                               const std::string& path) {
  static const std::map<std::string, size_t> rank = [] {
    std::map<std::string, size_t> r;
    for (const schema::KeySpec& k : schema::keys()) {
      std::string p;
      for (const std::string& part : split_path(k.path)) {
        p = join_path(p, part);
        r.emplace(p, r.size());
      }
    }
    return r;
  }();
  std::vector<std::pair<std::string, const toml::node*>> out;
  for (auto&& [k, v] : t) out.emplace_back(std::string(k.str()), &v);
  const bool layer = path.rfind(std::string(schema::kLayerTable) + ".", 0) == 0 &&
                     std::count(path.begin(), path.end(), '.') == 2;
  auto rank_of = [&](const std::string& k) -> size_t {
    if (layer && k == "plugin") return 0;  // [model.layer.NAME] starts with its plugin
    auto it = rank.find(join_path(path, k));
    return it == rank.end() ? rank.size() : it->second;
  };
  std::stable_sort(out.begin(), out.end(),
                   [&](const auto& a, const auto& b) { return rank_of(a.first) < rank_of(b.first); });
  return out;
}

// Leaves as `key = value`, then each sub-table under its [header] (tables that
// hold only tables get no header of their own).
void emit_table(std::string& out, const toml::table& t, const std::string& path,
                const std::string& header) {
  const auto keys = ordered(t, path);
  for (const auto& [k, v] : keys)
    if (!v->is_table()) out += key_text(k) + " = " + to_toml_text(*v) + "\n";
  for (const auto& [k, v] : keys) {
    const toml::table* sub = v->as_table();
    if (sub == nullptr) continue;
    const std::string sub_header = header.empty() ? key_text(k) : header + "." + key_text(k);
    bool has_leaf = sub->empty();
    for (auto&& [sk, sv] : *sub) has_leaf = has_leaf || !sv.is_table();
    if (has_leaf) out += (out.empty() ? "[" : "\n[") + sub_header + "]\n";
    emit_table(out, *sub, join_path(path, k), sub_header);
  }
}

}  // namespace

// ---- public small types --------------------------------------------------

std::string Origin::str() const {
  switch (kind) {
    case Kind::File:
      if (line <= 0) return file;
      return file + ":" + std::to_string(line) + ":" + std::to_string(column);
    case Kind::Default: return "default";
    case Kind::Override: return "--set " + text;
  }
  return "?";
}

std::string Diagnostic::str() const {
  return origin.str() + ": " + (key.empty() ? "" : key + ": ") + message;
}

namespace {
std::string format_errors(const std::vector<Diagnostic>& diags) {
  std::string out = "manifest has " + std::to_string(diags.size()) +
                    (diags.size() == 1 ? " error:" : " errors:");
  for (const Diagnostic& d : diags) out += "\n" + d.str();
  return out;
}
}  // namespace

ManifestError::ManifestError(std::vector<Diagnostic> diags)
    : std::runtime_error(format_errors(diags)), diags_(std::move(diags)) {}

std::string to_toml_text(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::string: return quote_basic(n.as_string()->get());
    case toml::node_type::integer: return std::to_string(n.as_integer()->get());
    case toml::node_type::floating_point: return format_float(n.as_floating_point()->get());
    case toml::node_type::boolean: return n.as_boolean()->get() ? "true" : "false";
    case toml::node_type::array: {
      std::vector<std::string> parts;
      for (const toml::node& e : *n.as_array()) parts.push_back(to_toml_text(e));
      return "[" + join_list(parts) + "]";
    }
    case toml::node_type::table: {
      const toml::table& t = *n.as_table();
      if (t.empty()) return "{}";
      std::vector<std::string> parts;
      for (auto&& [k, v] : t) parts.push_back(key_text(k.str()) + " = " + to_toml_text(v));
      return "{ " + join_list(parts) + " }";
    }
    default: {  // dates and times
      std::ostringstream os;
      os << toml::toml_formatter(n);
      return os.str();
    }
  }
}

std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates) {
  const std::string w = lower(word);
  const size_t threshold = std::max<size_t>(1, w.size() / 3);
  size_t best = static_cast<size_t>(-1);
  std::string out;
  for (const std::string& c : candidates) {
    const std::string lc = lower(c);
    size_t d = edit_distance(w, lc);
    if (d <= threshold && d < std::max(w.size(), lc.size()) && d < best) {
      best = d;
      out = c;
    }
  }
  return out;
}

// ---- allowed values ------------------------------------------------------

namespace {

// Shortest text of a bound: 1, 0.5, 1e-08.
std::string number_text(double v) {
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, res.ptr);
}

std::string trimmed(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return std::string(s);
}

// One end of an interval: nullopt for "", "inf" or "-inf" (unbounded).
std::optional<double> interval_end(const std::string& text, const std::string& range) {
  if (text.empty() || text == "inf" || text == "+inf" || text == "-inf") return std::nullopt;
  double v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || ptr != text.data() + text.size() || !std::isfinite(v))
    throw std::invalid_argument("range \"" + range + "\" has the bound '" + text + "', which is not a number");
  return v;
}

}  // namespace

std::string ValueBounds::bounds_text() const {
  if (min && max && !min_exclusive && !max_exclusive)
    return "must be between " + number_text(*min) + " and " + number_text(*max);
  std::string out;
  if (min) out = std::string(min_exclusive ? "> " : ">= ") + number_text(*min);
  if (max) {
    if (!out.empty()) out += " and ";
    out += std::string(max_exclusive ? "< " : "<= ") + number_text(*max);
  }
  return out.empty() ? out : "must be " + out;
}

std::string ValueBounds::interval_text() const {
  if (!min && !max) return "";
  return std::string(min && !min_exclusive ? "[" : "(") + (min ? number_text(*min) : "-inf") + ", " +
         (max ? number_text(*max) : "inf") + (max && !max_exclusive ? "]" : ")");
}

std::string ValueBounds::problem(const toml::node& v) const {
  if (v.is_integer() || v.is_floating_point()) {
    const double x = v.is_integer() ? static_cast<double>(v.as_integer()->get()) : v.as_floating_point()->get();
    auto within = [&](double y) {
      bool ok = true;
      if (min) ok = ok && (min_exclusive ? y > *min : y >= *min);
      if (max) ok = ok && (max_exclusive ? y < *max : y <= *max);
      return ok;
    };
    if (!within(x)) return bounds_text() + ", got " + to_toml_text(v);
    // A value in range that rounds out of it as the 32-bit float the math takes
    // (beta2 = 0.99999999999 is 1.0f, eps = 1e-300 is 0) or past float's range would
    // train NaNs. Compared as floats, bounds rounded too: 0.1 stays within [0, 0.1].
    if (single_precision && v.is_floating_point()) {
      const float f = static_cast<float>(x);
      if (!std::isfinite(f)) return "must be at most 3.4e38 in magnitude (a 32-bit float), got " + to_toml_text(v);
      bool ok = true;
      if (min) ok = ok && (min_exclusive ? f > static_cast<float>(*min) : f >= static_cast<float>(*min));
      if (max) ok = ok && (max_exclusive ? f < static_cast<float>(*max) : f <= static_cast<float>(*max));
      if (!ok)
        return bounds_text() + ", got " + to_toml_text(v) + ", which is " + number_text(static_cast<double>(f)) +
               " as a 32-bit float (what the math uses)";
    }
    return "";
  }
  if (v.is_string() && !allowed.empty()) {
    const std::string& s = v.as_string()->get();
    if (std::find(allowed.begin(), allowed.end(), s) != allowed.end()) return "";
    const std::string close = did_you_mean(s, allowed);
    return "must be one of " + quoted_list(allowed) + ", got " + quote_basic(s) +
           (close.empty() ? "" : " (did you mean " + quote_basic(close) + "?)");
  }
  return "";
}

ValueBounds ValueBounds::parse(const char* range, const char* choices) {
  ValueBounds b;
  b.single_precision = true;  // a plugin's float option: layers compute in fp32 or bf16
  if (range != nullptr) {
    const std::string r = trimmed(range);
    const size_t comma = r.find(',');
    if (r.size() < 3 || (r.front() != '[' && r.front() != '(') || (r.back() != ']' && r.back() != ')') ||
        comma == std::string::npos || r.find(',', comma + 1) != std::string::npos)
      throw std::invalid_argument("range \"" + r + "\" is not an interval like \"[0, 1)\" or \"[1, inf)\"");
    b.min = interval_end(trimmed(std::string_view(r).substr(1, comma - 1)), r);
    b.max = interval_end(trimmed(std::string_view(r).substr(comma + 1, r.size() - comma - 2)), r);
    b.min_exclusive = r.front() == '(';
    b.max_exclusive = r.back() == ')';
    if (b.min && b.max && (*b.min > *b.max || (*b.min == *b.max && (b.min_exclusive || b.max_exclusive))))
      throw std::invalid_argument("range \"" + r + "\" is empty");
  }
  if (choices != nullptr) {
    std::string_view c(choices);
    for (size_t start = 0;;) {
      const size_t bar = c.find('|', start);
      b.allowed.push_back(std::string(c.substr(start, bar == std::string_view::npos ? bar : bar - start)));
      if (b.allowed.back().empty())
        throw std::invalid_argument("choices \"" + std::string(c) + "\" hold an empty value (values between '|')");
      if (bar == std::string_view::npos) break;
      start = bar + 1;
    }
  }
  return b;
}

// ---- loading -------------------------------------------------------------

class ManifestLoader {
 public:
  explicit ManifestLoader(bool this_launch = true) { m_.this_launch_ = this_launch; }
  Manifest run(const std::string& path, const std::string* text,
               const std::vector<std::string>& overrides) {
    std::error_code ec;
    fs::path canon = fs::weakly_canonical(fs::absolute(path, ec), ec);
    std::vector<std::pair<fs::path, std::string>> chain{{canon, path}};
    Loaded root;
    if (load_file(path, text, chain, root)) {
      m_.table_ = std::move(root.table);
      m_.origins_ = std::move(root.vals);
      m_.key_origins_ = std::move(root.keys);
    }
    for (const std::string& o : overrides) apply_override(o);
    if (!diags_.empty()) throw ManifestError(std::move(diags_));

    std::error_code cwd_ec;
    fs::path cwd = fs::current_path(cwd_ec);
    resolve_search_paths(m_.table_, cwd);

    validate();
    if (!diags_.empty()) throw ManifestError(std::move(diags_));
    return std::move(m_);
  }

 private:
  struct Loaded {
    toml::table table;
    OriginMap vals, keys;
  };

  void diag(std::string key, Origin where, std::string message) {
    diags_.push_back(Diagnostic{std::move(key), std::move(where), std::move(message)});
  }

  // Reads and parses `path` (or `text`), follows `extends`; false on errors.
  bool load_file(const std::string& path, const std::string* text,
                 std::vector<std::pair<fs::path, std::string>>& chain, Loaded& out) {
    std::string content;
    if (text != nullptr) {
      content = *text;
    } else {
      Origin o;
      o.kind = Origin::Kind::File;
      o.file = path;
      // A manifest is a small regular file: a directory, a FIFO (which would block) or
      // a device (endless /dev/zero) is refused before reading.
      constexpr std::uintmax_t kMaxManifestBytes = 16u << 20;
      std::error_code ec;
      const fs::file_status st = fs::status(path, ec);
      if (!ec && fs::exists(st) && !fs::is_regular_file(st)) {
        diag("", o, std::string("is not a manifest file: it is ") +
                        (fs::is_directory(st) ? "a directory" : "not a regular file (a FIFO, socket or device)") +
                        "; give the path of a TOML file");
        return false;
      }
      if (!ec && fs::exists(st) && fs::file_size(path, ec) > kMaxManifestBytes) {
        diag("", o, "is " + std::to_string(fs::file_size(path, ec)) +
                        " bytes, not a manifest (a TOML file of at most 16 MiB)");
        return false;
      }
      std::ifstream in(path, std::ios::binary);
      if (!in) {
        diag("", o, "cannot open the manifest file (check the path)");
        return false;
      }
      std::ostringstream ss;
      ss << in.rdbuf();
      if (in.bad() || (ss.str().empty() && errno == EIO)) {
        diag("", o, "cannot read the manifest file (" + std::string(std::strerror(errno)) + ")");
        return false;
      }
      content = ss.str();
    }

    Loaded self;
    if (const int line = line_of_overlong_key(content); line > 0) {
      Origin at = file_origin(path, toml::source_region{});
      at.line = line;
      at.column = 1;
      diag("", at, "a dotted key of more than " + std::to_string(kMaxKeyParts) + " parts; manifest keys have a few");
      return false;
    }
    try {
      self.table = toml::parse(std::string_view(content), std::string_view(path));
    } catch (const toml::parse_error& e) {
      std::string what(e.description());
      if (!what.empty()) what[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(what[0])));
      diag("", file_origin(path, e.source()), "invalid TOML: " + what);
      return false;
    }
    record(self.table, "", path, self.vals, self.keys);
    resolve_search_paths(self.table, dir_of(path));

    const toml::node* ext = self.table.get("extends");
    if (ext == nullptr) {
      out = std::move(self);
      return true;
    }
    const Origin where = self.vals["extends"];
    if (!ext->is_string()) {
      diag("extends", where,
           "extends must be a string (the base manifest's path, relative to this file), got " +
               describe_value(*ext));
      return false;
    }
    const std::string rel = ext->as_string()->get();
    const fs::path target = (fs::path(path).parent_path() / rel).lexically_normal();
    const std::string shown = target.string();
    std::error_code ec;
    const fs::path canon = fs::weakly_canonical(fs::absolute(target, ec), ec);
    for (size_t i = 0; i < chain.size(); ++i) {
      if (chain[i].first != canon) continue;
      std::vector<std::string> names;
      for (size_t j = i; j < chain.size(); ++j) names.push_back(chain[j].second);
      names.push_back(shown);
      diag("extends", where, "extends cycle: " + join_list(names, " -> "));
      return false;
    }
    if (fs::exists(target, ec) && !fs::is_regular_file(target, ec)) {
      diag("extends", where,
           "base manifest " + quote_basic(rel) + " (" + shown + ") is " +
               (fs::is_directory(target, ec) ? "a directory" : "not a regular file (a FIFO, socket or device)") +
               ", not a TOML file");
      return false;
    }
    if (!fs::is_regular_file(target, ec)) {
      diag("extends", where,
           "base manifest " + quote_basic(rel) + " not found (looked for " + shown +
               "; extends is relative to the including file)");
      return false;
    }
    chain.emplace_back(canon, shown);
    Loaded base;
    bool ok = load_file(shown, nullptr, chain, base);
    chain.pop_back();
    if (!ok) return false;

    self.table.erase("extends");
    erase_under(self.vals, "extends");
    erase_under(self.keys, "extends");
    merge(base, base.table, self.table, "", self);
    out = std::move(base);
    return true;
  }

  // Deep-merges `src` (described by `info`) over `acc`: tables merge key by key,
  // anything else replaces, and takes its origin along.
  static void merge(Loaded& acc, toml::table& dst, toml::table& src, const std::string& prefix,
                    const Loaded& info) {
    for (auto&& [k, v] : src) {
      const std::string path = join_path(prefix, k.str());
      toml::node* existing = dst.get(k.str());
      if (existing != nullptr && existing->is_table() && v.is_table()) {
        merge(acc, *existing->as_table(), *v.as_table(), path, info);
        continue;
      }
      erase_under(acc.vals, path);
      erase_under(acc.keys, path);
      copy_under(info.vals, acc.vals, path);
      copy_under(info.keys, acc.keys, path);
      dst.insert_or_assign(k.str(), std::move(v));
    }
  }

  void apply_override(const std::string& arg) {
    const Origin o = override_origin(arg);
    const size_t eq = arg.find('=');
    if (eq == std::string::npos) {
      diag("", o, "expected --set key.path=value (e.g. --set parallel.tp=2)");
      return;
    }
    const std::string key = trim(std::string_view(arg).substr(0, eq));
    const std::string val = trim(std::string_view(arg).substr(eq + 1));
    const std::vector<std::string> parts = split_path(key);
    // The value holds keys only inside an inline table (a bare word with dots is a string).
    if (parts.size() > static_cast<size_t>(kMaxKeyParts) ||
        (val.find('{') != std::string::npos && line_of_overlong_key(val) > 0)) {
      diag("", o, "a key path of more than " + std::to_string(kMaxKeyParts) + " parts; manifest keys have a few");
      return;
    }
    for (const std::string& p : parts) {
      if (p.empty()) {
        diag(key, o, "'" + key + "' is not a key path (expected names joined by '.', e.g. run.steps)");
        return;
      }
    }
    if (key == "extends") {
      diag(key, o, "extends cannot be set with --set; name the base manifest in the file");
      return;
    }

    // A TOML value, or else the text itself as a string; but digits that do not fit a
    // TOML integer are a number out of range, not a word.
    std::unique_ptr<toml::table> parsed = parse_literal(val);
    if (!parsed && !val.empty() && val.find_first_not_of("+-0123456789_") == std::string::npos &&
        val.find_first_of("0123456789") != std::string::npos) {
      diag(key, o, key + " = " + val + " is out of the range of a 64-bit integer (-2^63 to 2^63-1)");
      return;
    }
    if (!parsed) {
      parsed = std::make_unique<toml::table>();
      parsed->insert("v", val);
    }
    assign(key, parts, std::move(*parsed->get("v")), o);
  }

  // Sets `key` (split into `parts`) to `value`. A non-empty table value given for a key
  // that already holds a table merges into it, key by key (--set 'parallel={tp=2}' keeps
  // the file's other parallel keys, as TOML's own dotted keys would); an empty one,
  // --set 'device.options={}', empties it.
  void assign(const std::string& key, const std::vector<std::string>& parts, toml::node&& value, const Origin& o) {
    if (value.is_table() && !value.as_table()->empty()) {
      const toml::node* existing = m_.table_.at_path(key).node();
      if (existing != nullptr && existing->is_table()) {
        for (auto&& [k, v] : *value.as_table()) {
          std::vector<std::string> sub = parts;
          sub.emplace_back(k.str());
          assign(join_path(key, std::string(k.str())), sub, std::move(v), o);
        }
        return;
      }
    }
    toml::table* t = &m_.table_;
    std::string path;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      path = join_path(path, parts[i]);
      toml::node* n = t->get(parts[i]);
      if (n == nullptr) {
        t->insert(parts[i], toml::table{});
        n = t->get(parts[i]);
        m_.origins_[path] = o;
        m_.key_origins_[path] = o;
      }
      if (!n->is_table()) {
        diag(key, o,
             "cannot set " + key + ": " + path + " is " + describe_value(*n) + ", not a table");
        return;
      }
      t = n->as_table();
    }
    erase_under(m_.origins_, key);
    erase_under(m_.key_origins_, key);
    mark(value, key, o, m_.origins_, m_.key_origins_);
    t->insert_or_assign(parts.back(), std::move(value));
  }

  // ---- validation ----

  Origin value_origin(const std::string& path) const { return m_.origin(path); }
  Origin key_origin(const std::string& path) const {
    auto it = m_.key_origins_.find(path);
    return it != m_.key_origins_.end() ? it->second : m_.origin(path);
  }

  void validate() {
    std::set<std::string> bad;
    const auto& sections = schema::sections();
    std::vector<std::string> broken_sections;
    for (auto&& [k, v] : m_.table_) {
      const std::string name(k.str());
      if (std::find(sections.begin(), sections.end(), name) == sections.end()) {
        unknown_top_level(name, v);
        continue;
      }
      if (!v.is_table()) {
        diag(name, value_origin(name),
             name + " must be a table ([" + name + "] with keys " +
                 join_list(schema::section_keys(name)) + "), got " + describe_value(v));
        broken_sections.push_back(name);
        continue;
      }
      check_section(name, *v.as_table(), bad);
    }

    // Defaults for what is missing.
    Origin dflt;
    for (const schema::KeySpec& spec : schema::keys()) {
      const std::string section = spec.section();
      if (std::find(broken_sections.begin(), broken_sections.end(), section) !=
          broken_sections.end()) {
        bad.insert(spec.path);
        continue;
      }
      if (spec.type == schema::KeyType::Table) continue;  // open tables: nothing to default
      toml::node* sec = m_.table_.get(section);
      if (sec == nullptr) {
        m_.table_.insert(section, toml::table{});
        sec = m_.table_.get(section);
        m_.origins_[section] = dflt;
        m_.key_origins_[section] = dflt;
      }
      toml::table& st = *sec->as_table();
      if (st.contains(spec.name())) continue;
      if (!spec.default_value) {
        diag(spec.path, value_origin(section),
             "missing required key " + spec.path + " (" + spec.doc + ")");
        bad.insert(spec.path);
        continue;
      }
      std::unique_ptr<toml::table> lit = parse_literal(*spec.default_value);
      st.insert(spec.name(), std::move(*lit->get("v")));
      m_.origins_[spec.path] = dflt;
      m_.key_origins_[spec.path] = dflt;
    }
    default_schedule_for_vpp();

    // Report per-key problems in the order they appear, then the cross-key rules.
    std::stable_sort(diags_.begin(), diags_.end(), [](const Diagnostic& a, const Diagnostic& b) {
      auto rank = [](const Origin& o) {
        return o.kind == Origin::Kind::File ? 0 : o.kind == Origin::Kind::Override ? 1 : 2;
      };
      if (rank(a.origin) != rank(b.origin)) return rank(a.origin) < rank(b.origin);
      if (a.origin.kind != Origin::Kind::File) return false;
      if (a.origin.file != b.origin.file) return a.origin.file < b.origin.file;
      if (a.origin.line != b.origin.line) return a.origin.line < b.origin.line;
      return a.origin.column < b.origin.column;
    });
    schema::check_rules(m_, bad, diags_);
  }

  // pipeline.schedule's default follows parallel.vpp: the interleaved schedule when
  // vpp > 1 (Megatron-LM's), so the resolved manifest — what `loom validate` prints and
  // a checkpoint keeps — names the schedule that runs.
  void default_schedule_for_vpp() {
    auto origin = m_.origins_.find("pipeline.schedule");
    if (origin == m_.origins_.end() || origin->second.kind != Origin::Kind::Default) return;
    const auto vpp = m_.table_.at_path("parallel.vpp").value<int64_t>();
    toml::table* pipeline = m_.table_["pipeline"].as_table();
    if (vpp && *vpp > 1 && pipeline != nullptr) pipeline->insert_or_assign("schedule", "interleaved");
  }

  void unknown_top_level(const std::string& name, const toml::node& v) {
    const auto& sections = schema::sections();
    if (v.is_table()) {
      std::string s = did_you_mean(name, sections);
      diag(name, key_origin(name),
           "unknown section '" + name + "'" + (s.empty() ? "" : " (did you mean '" + s + "'?)") +
               "; valid sections are " + join_list(sections));
      return;
    }
    std::string s = suggest_anywhere(name);
    diag(name, key_origin(name),
         "unknown key '" + name + "'" +
             (s.empty() ? "; top-level keys are extends and the sections " + join_list(sections)
                        : " (did you mean '" + s + "'?)"));
  }

  // A core key named `leaf` in any section: exact name first, then a close one.
  static std::string suggest_anywhere(const std::string& leaf) {
    std::vector<std::string> names, paths;
    for (const schema::KeySpec& k : schema::keys()) {
      if (k.name() == leaf) return k.path;
      names.push_back(k.name());
      paths.push_back(k.path);
    }
    std::string s = did_you_mean(leaf, names);
    if (s.empty()) return "";
    return paths[static_cast<size_t>(std::find(names.begin(), names.end(), s) - names.begin())];
  }

  void check_section(const std::string& section, toml::table& tbl, std::set<std::string>& bad) {
    std::vector<std::pair<std::string, double>> to_float;
    for (auto&& [k, v] : tbl) {
      const std::string name(k.str());
      const std::string path = section + "." + name;
      const schema::KeySpec* spec = schema::find(path);
      if (spec == nullptr) {
        const std::vector<std::string> names = schema::section_keys(section);
        std::string s = did_you_mean(name, names);
        std::string sugg = s.empty() ? suggest_anywhere(name) : section + "." + s;
        diag(path, key_origin(path),
             "unknown key '" + path + "'" +
                 (sugg.empty() ? " (valid keys in [" + section + "]: " + join_list(names) + ")"
                               : " (did you mean '" + sugg + "'?)"));
        continue;
      }
      if (!check_value(*spec, v)) {
        bad.insert(path);
        continue;
      }
      if (spec->type == schema::KeyType::Float && v.is_integer())
        to_float.emplace_back(name, static_cast<double>(v.as_integer()->get()));
      if (spec->path == schema::kLayerTable) check_layers(*v.as_table(), bad);
    }
    for (auto& [name, value] : to_float) tbl.insert_or_assign(name, value);
  }

  // Type, range, allowed values; false (with a diagnostic) when wrong.
  bool check_value(const schema::KeySpec& spec, const toml::node& v) {
    using schema::KeyType;
    bool type_ok = false;
    switch (spec.type) {
      case KeyType::Bool: type_ok = v.is_boolean(); break;
      case KeyType::Int: type_ok = v.is_integer(); break;
      case KeyType::Float: type_ok = v.is_floating_point() || v.is_integer(); break;
      case KeyType::String: type_ok = v.is_string(); break;
      case KeyType::StringList:
        type_ok = v.is_array() && v.as_array()->is_homogeneous(toml::node_type::string);
        if (v.is_array() && v.as_array()->empty()) type_ok = true;
        break;
      case KeyType::Array: type_ok = v.is_array(); break;
      case KeyType::Table: type_ok = v.is_table(); break;
    }
    const Origin where = value_origin(spec.path);
    if (!type_ok) {
      diag(spec.path, where,
           spec.path + " must be " + std::string(schema::describe(spec.type)) + ", got " +
               describe_value(v));
      return false;
    }
    if (spec.type == KeyType::Int || spec.type == KeyType::Float) {
      double x = v.is_integer() ? static_cast<double>(v.as_integer()->get())
                                : v.as_floating_point()->get();
      if (!std::isfinite(x)) {  // TOML's inf and nan: no setting takes them
        diag(spec.path, where, spec.path + " must be a finite number, got " + to_toml_text(v));
        return false;
      }
    }
    if (const std::string problem = spec.problem(v); !problem.empty()) {
      diag(spec.path, where, spec.path + " " + problem);
      return false;
    }
    if (spec.check) {
      std::string problem = spec.check(v);
      if (!problem.empty()) {
        diag(spec.path, where, spec.path + " must " + problem + ", got " + to_toml_text(v));
        return false;
      }
    }
    return true;
  }

  // [model.layer.NAME]: a table with an optional string `plugin` (default NAME);
  // the other keys belong to the plugin and are checked by apply_plugin_options.
  void check_layers(toml::table& layers, std::set<std::string>& bad) {
    const std::string prefix(schema::kLayerTable);
    for (auto&& [k, v] : layers) {
      const std::string name(k.str());
      const std::string path = prefix + "." + name;
      toml::table* t = v.as_table();
      if (t == nullptr) {
        diag(path, value_origin(path),
             path + " must be a table ([" + path + "] with plugin = \"...\" and the plugin's options), got " +
                 describe_value(v));
        bad.insert(path);
        continue;
      }
      const std::string plugin_path = path + ".plugin";
      if (const toml::node* p = t->get("plugin")) {
        if (!p->is_string() || p->as_string()->get().empty()) {
          diag(plugin_path, value_origin(plugin_path),
               plugin_path + " must be a non-empty string (a layer plugin name), got " +
                   describe_value(*p));
          bad.insert(plugin_path);
        }
        continue;
      }
      t->insert("plugin", name);
      m_.origins_[plugin_path] = Origin{};
      m_.key_origins_[plugin_path] = Origin{};
    }
  }

  Manifest m_;
  std::vector<Diagnostic> diags_;
};

Manifest Manifest::load(const std::string& path, const std::vector<std::string>& overrides) {
  return ManifestLoader().run(path, nullptr, overrides);
}

Manifest Manifest::parse(const std::string& text, const std::string& name,
                         const std::vector<std::string>& overrides, Launch launch) {
  return ManifestLoader(launch == Launch::This).run(name, &text, overrides);
}

// ---- access --------------------------------------------------------------

Origin Manifest::origin(const std::string& key_path) const {
  auto it = origins_.find(key_path);
  return it != origins_.end() ? it->second : Origin{};
}

namespace {
[[noreturn]] void access_error(const std::string& key, const toml::node* n, const char* want) {
  if (n == nullptr) throw std::logic_error("manifest key '" + key + "' is missing");
  throw std::logic_error("manifest key '" + key + "' is " + describe_value(*n) + ", not " + want);
}
}  // namespace

int64_t Manifest::get_int(const std::string& key_path) const {
  const toml::node* n = find_node(table_, key_path);
  if (n == nullptr || !n->is_integer()) access_error(key_path, n, "an integer");
  return n->as_integer()->get();
}

double Manifest::get_float(const std::string& key_path) const {
  const toml::node* n = find_node(table_, key_path);
  if (n != nullptr && n->is_floating_point()) return n->as_floating_point()->get();
  if (n != nullptr && n->is_integer()) return static_cast<double>(n->as_integer()->get());
  access_error(key_path, n, "a float");
}

bool Manifest::get_bool(const std::string& key_path) const {
  const toml::node* n = find_node(table_, key_path);
  if (n == nullptr || !n->is_boolean()) access_error(key_path, n, "a boolean");
  return n->as_boolean()->get();
}

std::string Manifest::get_string(const std::string& key_path) const {
  const toml::node* n = find_node(table_, key_path);
  if (n == nullptr || !n->is_string()) access_error(key_path, n, "a string");
  return n->as_string()->get();
}

std::vector<std::string> Manifest::get_string_list(const std::string& key_path) const {
  const toml::node* n = find_node(table_, key_path);
  if (n == nullptr || !n->is_array()) access_error(key_path, n, "an array of strings");
  std::vector<std::string> out;
  for (const toml::node& e : *n->as_array()) {
    if (!e.is_string()) access_error(key_path, n, "an array of strings");
    out.push_back(e.as_string()->get());
  }
  return out;
}

bool Manifest::contains(const std::string& key_path) const {
  return find_node(table_, key_path) != nullptr;
}

const toml::table* Manifest::get_table(const std::string& key_path) const {
  const toml::node* n = find_node(table_, key_path);
  return n != nullptr ? n->as_table() : nullptr;
}

std::vector<Manifest::Entry> Manifest::entries() const {
  std::vector<Entry> out;
  std::set<std::string> seen;
  std::function<void(const std::string&, const toml::node&)> walk =
      [&](const std::string& path, const toml::node& n) {
        if (const toml::table* t = n.as_table()) {
          for (auto&& [k, v] : *t) walk(join_path(path, k.str()), v);
          return;
        }
        if (!seen.insert(path).second) return;
        out.push_back(Entry{path, to_toml_text(n), origin(path)});
      };
  for (const schema::KeySpec& spec : schema::keys())
    if (const toml::node* n = find_node(table_, spec.path)) walk(spec.path, *n);
  walk("", table_);  // whatever the schema does not list
  return out;
}

std::string Manifest::to_toml() const {
  std::string out;
  emit_table(out, table_, "", "");
  return out;
}

// ---- plugin options ------------------------------------------------------

void Manifest::apply_plugin_options(const std::string& section_path, const std::string& plugin_name,
                                    const std::vector<OptionDecl>& decls,
                                    std::vector<Diagnostic>& diags,
                                    const std::vector<std::string>& skip) {
  auto skipped = [&](const std::string& k) {
    return std::find(skip.begin(), skip.end(), k) != skip.end();
  };
  auto type_ok = [](OptionDecl::Type t, const toml::node& v) {
    switch (t) {
      case OptionDecl::Type::Bool: return v.is_boolean();
      case OptionDecl::Type::Int: return v.is_integer();
      case OptionDecl::Type::Float: return v.is_floating_point() || v.is_integer();
      case OptionDecl::Type::String: return v.is_string();
    }
    return false;
  };
  auto type_text = [](OptionDecl::Type t) -> std::string {
    switch (t) {
      case OptionDecl::Type::Bool: return "a boolean";
      case OptionDecl::Type::Int: return "an integer";
      case OptionDecl::Type::Float: return "a float";
      case OptionDecl::Type::String: return "a string";
    }
    return "a value";
  };
  auto key_origin = [&](const std::string& path) {
    auto it = key_origins_.find(path);
    return it != key_origins_.end() ? it->second : origin(path);
  };
  // Where a missing option is reported: the section, or its closest written ancestor.
  auto nearest_origin = [&](std::string path) {
    while (!path.empty()) {
      auto it = origins_.find(path);
      if (it != origins_.end() && it->second.kind != Origin::Kind::Default) return it->second;
      size_t dot = path.rfind('.');
      path = dot == std::string::npos ? "" : path.substr(0, dot);
    }
    return Origin{};
  };

  toml::table* sec = nullptr;
  if (toml::node* n = find_node(table_, section_path)) {
    sec = n->as_table();
    if (sec == nullptr) {
      diags.push_back(Diagnostic{section_path, origin(section_path),
                                 section_path + " must be a table of options for " + plugin_name +
                                     ", got " + describe_value(*n)});
      return;
    }
  }

  std::vector<std::string> names;
  for (const OptionDecl& d : decls) names.push_back(d.name);

  if (sec != nullptr) {
    std::vector<std::pair<std::string, double>> to_float;
    for (auto&& [k, v] : *sec) {
      const std::string key(k.str());
      if (skipped(key)) continue;
      const std::string path = section_path + "." + key;
      auto it = std::find_if(decls.begin(), decls.end(),
                             [&](const OptionDecl& d) { return d.name == key; });
      if (it == decls.end()) {
        std::string s = did_you_mean(key, names);
        std::string hint = !s.empty()       ? " (did you mean '" + s + "'?)"
                           : names.empty() ? " (" + plugin_name + " takes no options)"
                                           : " (valid options: " + join_list(names) + ")";
        diags.push_back(Diagnostic{path, key_origin(path),
                                   "unknown option '" + key + "' for " + plugin_name + " at " +
                                       section_path + hint});
        continue;
      }
      if (!type_ok(it->type, v)) {
        diags.push_back(Diagnostic{path, origin(path),
                                   path + " must be " + type_text(it->type) + ", got " +
                                       describe_value(v) + " (option of " + plugin_name +
                                       (it->doc.empty() ? "" : ": " + it->doc) + ")"});
        continue;
      }
      if (it->type == OptionDecl::Type::Float && v.is_floating_point() &&
          !std::isfinite(v.as_floating_point()->get())) {  // as for the engine's own settings
        diags.push_back(Diagnostic{path, origin(path),
                                   path + " must be a finite number, got " + to_toml_text(v) + " (option of " +
                                       plugin_name + (it->doc.empty() ? "" : ": " + it->doc) + ")"});
        continue;
      }
      if (const std::string problem = it->bounds.problem(v); !problem.empty()) {
        diags.push_back(Diagnostic{path, origin(path),
                                   path + " " + problem + " (option of " + plugin_name +
                                       (it->doc.empty() ? "" : ": " + it->doc) + ")"});
        continue;
      }
      if (it->type == OptionDecl::Type::Float && v.is_integer())
        to_float.emplace_back(key, static_cast<double>(v.as_integer()->get()));
    }
    for (auto& [key, value] : to_float) sec->insert_or_assign(key, value);
  }

  for (const OptionDecl& d : decls) {
    if (sec != nullptr && sec->contains(d.name)) continue;
    const std::string path = section_path + "." + d.name;
    if (!d.default_value) {
      diags.push_back(Diagnostic{path, nearest_origin(section_path),
                                 "missing required option '" + d.name + "' for " + plugin_name +
                                     " at " + section_path +
                                     (d.doc.empty() ? "" : " (" + d.doc + ")")});
      continue;
    }
    std::unique_ptr<toml::table> lit = parse_literal(*d.default_value);
    if (!lit || !type_ok(d.type, *lit->get("v"))) {
      diags.push_back(Diagnostic{path, Origin{},
                                 "plugin " + plugin_name + " declares the default " +
                                     quote_basic(*d.default_value) + " for option '" + d.name +
                                     "', which does not parse as " + type_text(d.type) +
                                     " (a bug in the plugin)"});
      continue;
    }
    if (sec == nullptr) {  // create the section (and any missing parents)
      toml::table* t = &table_;
      std::string p;
      for (const std::string& part : split_path(section_path)) {
        p = join_path(p, part);
        toml::node* n = t->get(part);
        if (n == nullptr) {
          t->insert(part, toml::table{});
          n = t->get(part);
          origins_[p] = Origin{};
          key_origins_[p] = Origin{};
        }
        t = n->as_table();
        if (t == nullptr) {
          diags.push_back(Diagnostic{section_path, origin(p),
                                     "cannot hold the options of " + plugin_name + ": " + p +
                                         " is " + describe_value(*n) + ", not a table"});
          return;
        }
      }
      sec = t;
    }
    toml::node& value = *lit->get("v");
    if (d.type == OptionDecl::Type::Float && value.is_integer())
      sec->insert(d.name, static_cast<double>(value.as_integer()->get()));
    else
      sec->insert(d.name, std::move(value));
    origins_[path] = Origin{};
    key_origins_[path] = Origin{};
  }
}

int64_t int_as_overridden(const std::string& text, const std::string& name, const std::vector<std::string>& overrides,
                          const std::string& key) {
  int64_t v = Manifest::parse(text, name, {}, Manifest::Launch::Other).get_int(key);
  for (const std::string& o : overrides)
    if (o.rfind(key + "=", 0) == 0) try {
        v = std::stoll(o.substr(key.size() + 1));
      } catch (const std::exception&) {  // not a number: the whole manifest's check says so
      }
  return v;
}

}  // namespace loom::manifest
