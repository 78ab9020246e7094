// Reading a file whole, for the files loom reads at once (a checkpoint's manifest.toml,
// tokenizer files, evaluation data, texts to tokenize, indexed datasets).
#pragma once

#include <optional>
#include <string>

namespace loom::files {

// What a path that is not a regular file is, for messages: "a directory", "a FIFO",
// "a device", "a socket" (`mode` is struct stat's st_mode).
const char* not_regular_kind(unsigned mode);

// Pipes::Allow: a FIFO is read too (a command's own input: `--input <(zcat x.gz)`).
enum class Pipes { Refuse, Allow };

// The bytes of the regular file at `path`; nullopt when it cannot be opened or read,
// with errno saying why and, when given, `why` in words for the caller's own error.
// Anything but a regular file (or a FIFO where allowed) is refused without reading
// (EINVAL; `why` says "not a regular file (a FIFO)"): a FIFO inside a checkpoint or
// a dataset would block the read where no signal is looked at, a directory or a
// device reads as nonsense.
std::optional<std::string> read_whole_file(const std::string& path, std::string* why = nullptr,
                                           Pipes pipes = Pipes::Refuse);

}  // namespace loom::files
