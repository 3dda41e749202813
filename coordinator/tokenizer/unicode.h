// UTF-8 and Unicode helpers shared by the tokenizer components: validation, code point
// decoding, lossy decoding with the exact replacement rules of Rust's String::from_utf8_lossy
// (what Hugging Face tokenizers uses), Unicode properties through utf8proc, and the GPT-2
// byte-level alphabet.
//
// Everything here is a pure function or immutable static data: thread-safe.
#ifndef SHARDSERVE_COORDINATOR_TOKENIZER_UNICODE_H_
#define SHARDSERVE_COORDINATOR_TOKENIZER_UNICODE_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace shardserve::tokenizer_internal {

// U+FFFD REPLACEMENT CHARACTER, in UTF-8.
inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";

// Returns the byte offset of the first byte of `s` that is not part of a well-formed UTF-8
// sequence (overlongs, surrogates and code points above U+10FFFF are ill-formed), or
// std::string_view::npos when all of `s` is valid.
size_t FindInvalidUtf8(std::string_view s);

// Length in bytes of the UTF-8 sequence that starts with `lead` (1 for ASCII and for bytes that
// cannot start a sequence). For valid UTF-8 this is the length of the character.
inline size_t Utf8Length(uint8_t lead) {
  if (lead < 0xC0) return 1;
  if (lead < 0xE0) return 2;
  if (lead < 0xF0) return 3;
  return 4;
}

// Decodes the character starting at s[i]; `s` must be valid UTF-8 there. Sets *len to its
// length in bytes.
char32_t DecodeUtf8(std::string_view s, size_t i, size_t* len);

// Appends the UTF-8 encoding of `cp` (a Unicode scalar value) to `out`.
void AppendUtf8(char32_t cp, std::string* out);

// Appends `bytes` to `out` as text, replacing each maximal ill-formed subpart with U+FFFD, as
// Rust's String::from_utf8_lossy does. When `final` is false a trailing sequence that is
// incomplete but could still become valid is left alone; returns the number of bytes consumed
// (all of them when `final`). Lossy decoding of a prefix is therefore stable: decoding
// bytes[0, consumed) and later the rest gives the same text as decoding everything at once.
size_t AppendLossyUtf8(std::string_view bytes, bool final, std::string* out);

// Unicode White_Space, as Rust's char::is_whitespace and Oniguruma's \s define it.
bool IsWhitespace(char32_t cp);

// Rust regex's \w (Unicode word character): letters, marks, decimal and letter numbers,
// connector punctuation, and the joiners U+200C/U+200D.
bool IsWordChar(char32_t cp);

// GPT-2's reversible byte <-> character mapping used by byte-level BPE: printable Latin-1
// bytes map to themselves, the other 68 bytes to U+0100..U+0143 in order.
const std::array<char32_t, 256>& ByteToChar();
// The inverse of ByteToChar(): the byte for `cp`, or -1 if `cp` is not in the alphabet.
int CharToByte(char32_t cp);

}  // namespace shardserve::tokenizer_internal

#endif  // SHARDSERVE_COORDINATOR_TOKENIZER_UNICODE_H_
