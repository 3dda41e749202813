// UTF-8 for the grammar engine: decoding of grammar and schema text (utf8proc), and the byte
// rules the matcher applies one byte at a time.
#ifndef SHARDSERVE_GRAMMAR_UTF8_H_
#define SHARDSERVE_GRAMMAR_UTF8_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "utf8proc.h"

namespace shardserve::grammar {

inline constexpr uint32_t kMaxCodePoint = 0x10FFFF;

// The code point starting at s[i] and its length in bytes; nullopt for invalid UTF-8 (overlong
// forms, surrogates, truncation).
inline std::optional<uint32_t> DecodeUtf8(std::string_view s, size_t i, size_t* len) {
  utf8proc_int32_t cp = -1;
  const utf8proc_ssize_t n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + i),
                                              static_cast<utf8proc_ssize_t>(s.size() - i), &cp);
  if (n <= 0 || cp < 0) return std::nullopt;
  *len = static_cast<size_t>(n);
  return static_cast<uint32_t>(cp);
}

inline std::string EncodeUtf8(uint32_t cp) {
  utf8proc_uint8_t buf[4];
  const utf8proc_ssize_t n = utf8proc_encode_char(static_cast<utf8proc_int32_t>(cp), buf);
  return std::string(reinterpret_cast<const char*>(buf), static_cast<size_t>(n));
}

}  // namespace shardserve::grammar

#endif  // SHARDSERVE_GRAMMAR_UTF8_H_
