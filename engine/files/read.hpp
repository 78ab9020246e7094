// Reading a file whole, for the files loom reads at once (a checkpoint's manifest.toml,
// tokenizer files, evaluation data, texts to tokenize).
#pragma once

#include <optional>
#include <string>

namespace loom::files {

// The bytes of the file at `path`; nullopt when it cannot be opened or read (a
// directory cannot), with errno saying why, for the caller's own error.
std::optional<std::string> read_whole_file(const std::string& path);

}  // namespace loom::files
