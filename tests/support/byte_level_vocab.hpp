// The 256 single-byte tokens of a byte-level BPE vocabulary (GPT-2's bytes_to_unicode:
// printable Latin-1 bytes stand for themselves, the others for U+0100.. in byte order),
// token -> id = the byte, for tests that write small tokenizer.json files.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

namespace loom::testing {

inline nlohmann::json byte_level_vocab() {
  nlohmann::json vocab = nlohmann::json::object();
  int next = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
    const uint32_t cp = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + next++);
    std::string u;
    if (cp < 0x80) u += static_cast<char>(cp);
    else u += static_cast<char>(0xc0 | (cp >> 6)), u += static_cast<char>(0x80 | (cp & 0x3f));
    vocab[u] = b;
  }
  return vocab;
}

}  // namespace loom::testing
