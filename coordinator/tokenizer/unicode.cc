#include "coordinator/tokenizer/unicode.h"

#include <utf8proc.h>

#include <cstring>

namespace shardserve::tokenizer_internal {
namespace {

// What starts at a given position of a byte string, by the rules of Unicode 3.9 (Table 3-7,
// well-formed UTF-8 byte sequences) and the "maximal subpart" practice of chapter 3.9.
enum class SequenceKind { kValid, kInvalid, kIncomplete };
struct Sequence {
  SequenceKind kind;
  size_t len;  // kValid: the character; kInvalid: the maximal subpart; kIncomplete: bytes present
};

Sequence Examine(std::string_view s, size_t i) {
  const auto b = static_cast<uint8_t>(s[i]);
  if (b < 0x80) return {SequenceKind::kValid, 1};
  size_t need = 0;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b >= 0xC2 && b <= 0xDF) {
    need = 2;
  } else if (b == 0xE0) {
    need = 3, lo = 0xA0;  // no overlongs
  } else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) {
    need = 3;
  } else if (b == 0xED) {
    need = 3, hi = 0x9F;  // no surrogates
  } else if (b == 0xF0) {
    need = 4, lo = 0x90;  // no overlongs
  } else if (b >= 0xF1 && b <= 0xF3) {
    need = 4;
  } else if (b == 0xF4) {
    need = 4, hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return {SequenceKind::kInvalid, 1};  // continuation byte, C0, C1 or F5..FF
  }
  for (size_t k = 1; k < need; ++k) {
    if (i + k >= s.size()) return {SequenceKind::kIncomplete, k};
    const auto c = static_cast<uint8_t>(s[i + k]);
    if (c < (k == 1 ? lo : 0x80) || c > (k == 1 ? hi : 0xBF)) return {SequenceKind::kInvalid, k};
  }
  return {SequenceKind::kValid, need};
}

// Length of the leading run of ASCII bytes of s[i, end), eight at a time.
size_t AsciiRun(std::string_view s, size_t i) {
  const size_t start = i;
  while (i + 8 <= s.size()) {
    uint64_t word;
    std::memcpy(&word, s.data() + i, 8);
    if (word & 0x8080808080808080ull) break;
    i += 8;
  }
  while (i < s.size() && static_cast<uint8_t>(s[i]) < 0x80) ++i;
  return i - start;
}

std::array<char32_t, 256> MakeByteToChar() {
  std::array<char32_t, 256> table{};
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    table[b] = printable ? static_cast<char32_t>(b) : next++;
  }
  return table;
}

}  // namespace

size_t FindInvalidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    i += AsciiRun(s, i);
    if (i >= s.size()) break;
    const Sequence seq = Examine(s, i);
    if (seq.kind != SequenceKind::kValid) return i;
    i += seq.len;
  }
  return std::string_view::npos;
}

char32_t DecodeUtf8(std::string_view s, size_t i, size_t* len) {
  const auto b0 = static_cast<uint8_t>(s[i]);
  *len = Utf8Length(b0);
  auto cont = [&](size_t k) { return static_cast<char32_t>(static_cast<uint8_t>(s[i + k]) & 0x3F); };
  switch (*len) {
    case 1:
      return b0;
    case 2:
      return (static_cast<char32_t>(b0 & 0x1F) << 6) | cont(1);
    case 3:
      return (static_cast<char32_t>(b0 & 0x0F) << 12) | (cont(1) << 6) | cont(2);
    default:
      return (static_cast<char32_t>(b0 & 0x07) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3);
  }
}

void AppendUtf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

size_t AppendLossyUtf8(std::string_view bytes, bool final, std::string* out) {
  size_t i = 0;
  while (i < bytes.size()) {
    const size_t ascii = AsciiRun(bytes, i);
    out->append(bytes.data() + i, ascii);
    i += ascii;
    if (i >= bytes.size()) break;
    const Sequence seq = Examine(bytes, i);
    switch (seq.kind) {
      case SequenceKind::kValid:
        out->append(bytes.data() + i, seq.len);
        i += seq.len;
        break;
      case SequenceKind::kInvalid:
        out->append(kReplacementChar);
        i += seq.len;
        break;
      case SequenceKind::kIncomplete:
        if (!final) return i;
        out->append(kReplacementChar);  // the incomplete tail is one maximal subpart
        i = bytes.size();
        break;
    }
  }
  return i;
}

bool IsWhitespace(char32_t cp) {
  // The White_Space property of PropList.txt (unchanged since Unicode 6.3).
  switch (cp) {
    case 0x09:
    case 0x0A:
    case 0x0B:
    case 0x0C:
    case 0x0D:
    case 0x20:
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

bool IsWordChar(char32_t cp) {
  if (cp < 0x80) {
    return (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || (cp >= '0' && cp <= '9') || cp == '_';
  }
  if (cp == 0x200C || cp == 0x200D) return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

const std::array<char32_t, 256>& ByteToChar() {
  static const std::array<char32_t, 256> table = MakeByteToChar();
  return table;
}

int CharToByte(char32_t cp) {
  static const std::array<int16_t, 0x144> inverse = [] {
    std::array<int16_t, 0x144> inv;
    inv.fill(-1);
    const auto& forward = ByteToChar();
    for (int b = 0; b < 256; ++b) inv[forward[b]] = static_cast<int16_t>(b);
    return inv;
  }();
  return cp < inverse.size() ? inverse[cp] : -1;
}

}  // namespace shardserve::tokenizer_internal
