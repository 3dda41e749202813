// An oracle for the tokenizer fuzz targets, written apart from coordinator/tokenizer/unicode.h so
// that a bug there is not repeated here: is `s` well-formed UTF-8 (RFC 3629: no overlong forms,
// no surrogates, nothing above U+10FFFF)?
#ifndef SHARDSERVE_FUZZ_UTF8_H_
#define SHARDSERVE_FUZZ_UTF8_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace shardserve_fuzz {

inline bool IsValidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const uint8_t b = static_cast<uint8_t>(s[i]);
    size_t n;
    uint32_t cp, min;
    if (b < 0x80) { ++i; continue; }
    if ((b & 0xE0) == 0xC0) { n = 2; cp = b & 0x1F; min = 0x80; }
    else if ((b & 0xF0) == 0xE0) { n = 3; cp = b & 0x0F; min = 0x800; }
    else if ((b & 0xF8) == 0xF0) { n = 4; cp = b & 0x07; min = 0x10000; }
    else return false;
    if (s.size() - i < n) return false;
    for (size_t k = 1; k < n; ++k) {
      const uint8_t c = static_cast<uint8_t>(s[i + k]);
      if ((c & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (c & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n;
  }
  return true;
}

}  // namespace shardserve_fuzz

#endif  // SHARDSERVE_FUZZ_UTF8_H_
