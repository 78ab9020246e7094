// A small command-line parser for the loom subcommands: flags (--json),
// options with values (--tp 2 or --tp=2, repeatable) and positionals.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace loom::cli {

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Args {
 public:
  // `flags` take no value; `options` take one. Anything else starting with -- is an error.
  Args(int argc, char** argv, std::set<std::string> flags, std::set<std::string> options);

  bool flag(const std::string& name) const { return flags_.count(name) > 0; }
  bool has(const std::string& name) const { return values_.count(name) > 0; }
  // The value given for an option; UsageError when it was given more than once (read
  // an option that repeats with all()).
  std::optional<std::string> get(const std::string& name) const;
  // A reference into the parsed options (one vector: begin() and end() may be taken apart).
  const std::vector<std::string>& all(const std::string& name) const;
  // Integer option; UsageError names the option when the value is not an integer.
  long long get_int(const std::string& name, long long fallback) const;
  const std::vector<std::string>& positionals() const { return positionals_; }

 private:
  std::set<std::string> flags_;
  std::map<std::string, std::vector<std::string>> values_;
  std::vector<std::string> positionals_;
};

// --chat-template NAME (generate, tokenize): "" when not given; UsageError naming the
// templates loom writes for another name.
std::string chat_template_option(const Args& args);

// `word` as one word of a POSIX shell command line (single-quoted, a ' inside as '\''),
// for the command lines the CLI prints for a user to run next.
std::string shell_word(const std::string& word);

}  // namespace loom::cli
