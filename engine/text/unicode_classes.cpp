#include "engine/text/unicode_classes.hpp"

#include <algorithm>
#include <iterator>

namespace loom::text {

namespace {

struct CodeRange {
  uint32_t first, last;
};

#include "engine/text/unicode_classes.inc"

template <size_t N>
bool in(const CodeRange (&ranges)[N], uint32_t cp) {
  const CodeRange* it =
      std::upper_bound(std::begin(ranges), std::end(ranges), cp, [](uint32_t v, const CodeRange& r) { return v < r.first; });
  return it != std::begin(ranges) && cp <= std::prev(it)->last;
}

}  // namespace

bool is_letter(uint32_t cp) { return in(kLetter, cp); }
bool is_number(uint32_t cp) { return in(kNumber, cp); }
bool is_space(uint32_t cp) { return in(kSpace, cp); }

CodePoint decode_utf8(std::string_view s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char b0 = byte(i);
  const CodePoint invalid{0x110000u | b0, 1};
  if (b0 < 0x80) return {b0, 1};
  size_t n = 0;
  uint32_t cp = 0, min = 0;
  if ((b0 & 0xe0) == 0xc0) n = 2, cp = b0 & 0x1f, min = 0x80;
  else if ((b0 & 0xf0) == 0xe0) n = 3, cp = b0 & 0x0f, min = 0x800;
  else if ((b0 & 0xf8) == 0xf0) n = 4, cp = b0 & 0x07, min = 0x10000;
  else return invalid;
  if (i + n > s.size()) return invalid;
  for (size_t k = 1; k < n; ++k) {
    if ((byte(i + k) & 0xc0) != 0x80) return invalid;
    cp = (cp << 6) | (byte(i + k) & 0x3f);
  }
  if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return invalid;  // overlong or not a scalar
  return {cp, n};
}

}  // namespace loom::text
