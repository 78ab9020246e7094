// The Unicode classes the GPT-2 pre-tokenizer splits text by: letters (\p{L}),
// numbers (\p{N}) and white space (the White_Space property: what \s matches in
// Python's regex module, which OpenAI's encoder.py uses), as code point ranges
// generated from Unicode's data (unicode_classes.inc), and UTF-8 decoding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace loom::text {

bool is_letter(uint32_t cp);
bool is_number(uint32_t cp);
bool is_space(uint32_t cp);

// The code point at s[i] and its length in bytes. A byte that does not start a
// valid UTF-8 sequence is returned as itself (cp = the byte | 0x110000, outside
// Unicode: no class) with length 1, so any byte string can be split.
struct CodePoint {
  uint32_t cp;
  size_t bytes;
};
CodePoint decode_utf8(std::string_view s, size_t i);

}  // namespace loom::text
