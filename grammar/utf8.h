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

// Special tokens (a chat format's markers, such as gpt-oss's <|channel|>) inside the grammar
// engine: special token `id` reads as the "character" kSpecialTokenBase + id, past Unicode, which
// the matcher decodes from the four bytes UTF-8's scheme would give it (lead byte 0xF5 to 0xF7,
// which valid UTF-8 never holds). GBNF writes it <[id]>; no other class holds it (negated classes
// and `.` cover Unicode's scalar values only), and a token of text holding a byte of 0xF5 or more
// is never allowed, so only the special token itself reads as one (TokenizerInfo).
inline constexpr uint32_t kSpecialTokenBase = 0x140000;
inline constexpr uint32_t kMaxEncodable = 0x1FFFFF;  // the largest value of UTF-8's four-byte scheme
inline constexpr int32_t kMaxSpecialTokenId = static_cast<int32_t>(kMaxEncodable - kSpecialTokenBase);
inline constexpr uint32_t SpecialTokenCodePoint(int32_t id) { return kSpecialTokenBase + static_cast<uint32_t>(id); }
// The four bytes special token `id` (0 <= id <= kMaxSpecialTokenId) reads as.
inline std::string SpecialTokenBytes(int32_t id) {
  const uint32_t cp = SpecialTokenCodePoint(id);
  return std::string{static_cast<char>(0xF0 | (cp >> 18)), static_cast<char>(0x80 | ((cp >> 12) & 0x3F)),
                     static_cast<char>(0x80 | ((cp >> 6) & 0x3F)), static_cast<char>(0x80 | (cp & 0x3F))};
}

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
