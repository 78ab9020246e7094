// Reading a file whole, for the small text files loom reads at once (manifests, a
// checkpoint's meta.toml and manifest.toml, tokenizer files, evaluation data).
#pragma once

#include <optional>
#include <string>

namespace loom::files {

// The bytes of the file at `path`; nullopt when it cannot be opened or read (a
// directory cannot), with errno saying why, for the caller's own error.
std::optional<std::string> read_whole_file(const std::string& path);

}  // namespace loom::files
