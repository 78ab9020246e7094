#include "engine/cli/args.hpp"

#include "engine/text/chat_template.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>

namespace loom::cli {

Args::Args(int argc, char** argv, std::set<std::string> flags, std::set<std::string> options) {
  flags.insert("--help");
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) == 0) {
      std::string name = a, value;
      bool inline_value = false;
      if (auto eq = a.find('='); eq != std::string::npos) {
        name = a.substr(0, eq);
        value = a.substr(eq + 1);
        inline_value = true;
      }
      if (flags.count(name)) {
        if (inline_value) throw UsageError(name + " takes no value");
        flags_.insert(name);
      } else if (options.count(name)) {
        if (!inline_value) {
          if (i + 1 >= argc) throw UsageError(name + " needs a value");
          value = argv[++i];
        }
        values_[name].push_back(value);
      } else {
        std::string valid;
        for (const auto& f : flags) valid += " " + f;
        for (const auto& o : options) valid += " " + o + " V";
        throw UsageError("unknown option " + name + " (valid:" + valid + ")");
      }
    } else {
      positionals_.push_back(a);
    }
  }
}

std::optional<std::string> Args::get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end() || it->second.empty()) return std::nullopt;
  // An option read as one value was given once: a second --pp would otherwise win
  // silently over the first (options that repeat, --set, --input, are read with all()).
  if (it->second.size() > 1) {
    std::string given;
    for (const std::string& v : it->second) given += (given.empty() ? "" : ", ") + v;
    throw UsageError(name + " is given " + std::to_string(it->second.size()) + " times (" + given +
                     "); it takes one value");
  }
  return it->second.back();
}

const std::vector<std::string>& Args::all(const std::string& name) const {
  static const std::vector<std::string> kNone;
  auto it = values_.find(name);
  return it == values_.end() ? kNone : it->second;
}

long long Args::get_int(const std::string& name, long long fallback) const {
  auto v = get(name);
  if (!v) return fallback;
  char* end = nullptr;
  errno = 0;
  long long x = std::strtoll(v->c_str(), &end, 10);
  if (v->empty() || *end != '\0' || std::isspace(static_cast<unsigned char>(v->front())))
    throw UsageError(name + " expects an integer, got '" + *v + "'");
  if (errno == ERANGE) throw UsageError(name + " " + *v + " is out of range");
  return x;
}

std::string shell_word(const std::string& word) {
  std::string out = "'";
  for (char c : word) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string chat_template_option(const Args& args) {
  const std::string name = args.get("--chat-template").value_or("");
  const std::vector<std::string>& known = text::ChatTemplate::names();
  if (!name.empty() && std::find(known.begin(), known.end(), name) == known.end()) {
    std::string list;
    for (const std::string& k : known) list += (list.empty() ? "" : ", ") + k;
    throw UsageError("--chat-template " + name + " is not a template loom writes (" + list + ")");
  }
  return name;
}

}  // namespace loom::cli
