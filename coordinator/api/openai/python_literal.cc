#include "coordinator/api/openai/python_literal.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"
#include "coordinator/tokenizer/unicode.h"

namespace shardserve::openai {
namespace {

using Json = nlohmann::ordered_json;

// Brackets nested deeper than this are refused (Python's own parser stops near 200).
constexpr int kMaxDepth = 100;

bool IsIdentifierChar(char c) { return absl::ascii_isalnum(c) || c == '_' || static_cast<unsigned char>(c) >= 0x80; }

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// A number or bool as Python compares them (True == 1 == 1.0).
double NumberOf(const Json& v) {
  if (v.is_boolean()) return v.get<bool>() ? 1.0 : 0.0;
  if (v.is_number_unsigned()) return static_cast<double>(v.get<uint64_t>());
  if (v.is_number_integer()) return static_cast<double>(v.get<int64_t>());
  return v.get<double>();
}

// A dict key as json.dumps writes it, or nullopt for a key it refuses (a tuple).
std::optional<std::string> KeyText(const Json& key) {
  if (key.is_string()) return key.get<std::string>();
  if (key.is_boolean()) return key.get<bool>() ? "true" : "false";
  if (key.is_null()) return "null";
  if (key.is_number()) return key.dump();
  return std::nullopt;
}

class Reader {
 public:
  explicit Reader(absl::string_view s) : s_(s) {}

  // The whole text: one value, or several separated by commas (a tuple without parentheses).
  std::optional<Json> Whole() {
    SkipLeading();
    std::optional<Json> first = Value();
    if (!first) return std::nullopt;
    Skip();
    if (Peek() == ',') {
      Json items = Json::array();
      items.push_back(std::move(*first));
      while (Consume(',')) {
        Skip();
        if (AtEnd()) break;
        std::optional<Json> v = Value();
        if (!v) return std::nullopt;
        items.push_back(std::move(*v));
        Skip();
      }
      first = std::move(items);
    }
    Skip();
    if (!AtEnd()) return std::nullopt;
    return first;
  }

 private:
  bool AtEnd() const { return pos_ >= s_.size(); }
  char Peek(size_t ahead = 0) const { return pos_ + ahead < s_.size() ? s_[pos_ + ahead] : '\0'; }
  bool Consume(char c) {
    if (Peek() != c || AtEnd()) return false;
    ++pos_;
    return true;
  }

  // Blank lines, spaces and comments before the value (ast.literal_eval strips the spaces and tabs
  // that would otherwise be an indent).
  void SkipLeading() {
    while (!AtEnd()) {
      const char c = Peek();
      if (c == ' ' || c == '\t' || c == '\f' || c == '\n') {
        ++pos_;
      } else if (c == '#') {
        while (!AtEnd() && Peek() != '\n') ++pos_;
      } else {
        break;
      }
    }
  }

  // Spaces, comments, joined lines; newlines inside brackets, and outside them only where nothing
  // but blank lines and comments follow (a second line would be a second statement).
  void Skip() {
    while (!AtEnd()) {
      const char c = Peek();
      if (c == ' ' || c == '\t' || c == '\f') {
        ++pos_;
      } else if (c == '#') {
        while (!AtEnd() && Peek() != '\n') ++pos_;
      } else if (c == '\\' && Peek(1) == '\n') {
        pos_ += 2;
      } else if (c == '\n') {
        if (depth_ > 0) {
          ++pos_;
          continue;
        }
        const size_t here = pos_;
        SkipLeading();
        if (!AtEnd()) pos_ = here;
        return;
      } else {
        return;
      }
    }
  }

  std::optional<Json> Value() {
    const char c = Peek();
    if (c == '[' || c == '(' || c == '{') {
      if (depth_ >= kMaxDepth) return std::nullopt;
      ++pos_;
      ++depth_;
      std::optional<Json> v = c == '{' ? Dict() : Sequence(c == '[' ? ']' : ')');
      --depth_;
      return v;
    }
    if (c == '-' || c == '+') {
      // One sign before a number, which parentheses may hold: -5, -(5).
      ++pos_;
      Skip();
      int parens = 0;
      while (Peek() == '(') {
        if (depth_ >= kMaxDepth) return std::nullopt;
        ++pos_;
        ++parens;
        ++depth_;
        Skip();
      }
      if (!absl::ascii_isdigit(Peek()) && !(Peek() == '.' && absl::ascii_isdigit(Peek(1)))) return std::nullopt;
      std::optional<Json> n = Number();
      for (; parens > 0; --parens) {
        Skip();
        if (!Consume(')')) return std::nullopt;
        --depth_;
      }
      if (!n || c == '+') return n;
      if (n->is_number_float()) return Json(-n->get<double>());
      if (n->is_number_unsigned()) {
        const uint64_t u = n->get<uint64_t>();
        if (u > uint64_t{1} << 63) return std::nullopt;
        return Json(u == uint64_t{1} << 63 ? INT64_MIN : -static_cast<int64_t>(u));
      }
      return Json(-n->get<int64_t>());
    }
    if (absl::ascii_isdigit(c) || (c == '.' && absl::ascii_isdigit(Peek(1)))) return Number();
    if (c == '\'' || c == '"') return Strings();
    if (absl::ascii_isalpha(c) || c == '_') {
      size_t end = pos_;
      while (end < s_.size() && IsIdentifierChar(s_[end])) ++end;
      const absl::string_view word = s_.substr(pos_, end - pos_);
      if (end < s_.size() && (s_[end] == '\'' || s_[end] == '"')) return Strings();  // a prefixed string
      pos_ = end;
      if (word == "True") return Json(true);
      if (word == "False") return Json(false);
      if (word == "None") return Json(nullptr);
      return std::nullopt;
    }
    return std::nullopt;
  }

  // A list's or tuple's items up to `close` (the opening bracket read); "(x)" is x itself.
  std::optional<Json> Sequence(char close) {
    Json items = Json::array();
    bool comma = false;
    Skip();
    while (!Consume(close)) {
      std::optional<Json> v = Value();
      if (!v) return std::nullopt;
      items.push_back(std::move(*v));
      Skip();
      if (Consume(',')) {
        comma = true;
        Skip();
        continue;
      }
      Skip();
      if (!Consume(close)) return std::nullopt;
      if (close == ')' && !comma && items.size() == 1) return std::move(items[0]);
      return items;
    }
    return items;
  }

  // A dict's pairs up to '}' (the '{' read); a set (no ':') is refused.
  std::optional<Json> Dict() {
    Json out = Json::object();
    std::vector<Json> keys;  // as written, to tell keys that json.dumps would write alike
    Skip();
    while (!Consume('}')) {
      std::optional<Json> key = Value();
      if (!key) return std::nullopt;
      Skip();
      if (!Consume(':')) return std::nullopt;
      Skip();
      std::optional<Json> value = Value();
      if (!value) return std::nullopt;
      std::optional<std::string> name = KeyText(*key);
      if (!name) return std::nullopt;
      // The same string again replaces the value in place, as in a Python dict. Keys that Python
      // holds apart but json.dumps writes alike ('1' and 1), or that Python takes for one another
      // (1, 1.0 and True), are refused.
      for (const Json& seen : keys) {
        if (seen.is_string() && key->is_string()) continue;
        if (KeyText(seen) == name || (seen.is_primitive() && !seen.is_string() && !seen.is_null() &&
                                      key->is_primitive() && !key->is_string() && !key->is_null() &&
                                      NumberOf(seen) == NumberOf(*key))) {
          return std::nullopt;
        }
      }
      keys.push_back(*key);
      out[*name] = std::move(*value);
      Skip();
      if (Consume(',')) {
        Skip();
        continue;
      }
      Skip();
      if (!Consume('}')) return std::nullopt;
      break;
    }
    return out;
  }

  // One or more adjacent string literals, joined.
  std::optional<Json> Strings() {
    std::string out;
    bool any = false;
    while (true) {
      size_t p = pos_;
      while (p < s_.size() && absl::ascii_isalpha(s_[p])) ++p;
      // Only r and u prefixes make a str that json.dumps writes (b: bytes; f: not a literal).
      const std::string prefix = absl::AsciiStrToLower(s_.substr(pos_, p - pos_));
      if (!prefix.empty() && prefix != "r" && prefix != "u") return std::nullopt;
      const bool raw = prefix == "r";
      if (p >= s_.size() || (s_[p] != '\'' && s_[p] != '"')) {
        if (!any) return std::nullopt;
        break;
      }
      pos_ = p;
      if (!OneString(raw, &out)) return std::nullopt;
      any = true;
      Skip();
      const char c = Peek();
      if (c != '\'' && c != '"' && !absl::ascii_isalpha(c)) break;
      if (absl::ascii_isalpha(c)) {
        size_t q = pos_;
        while (q < s_.size() && absl::ascii_isalpha(s_[q])) ++q;
        if (q >= s_.size() || (s_[q] != '\'' && s_[q] != '"')) break;
      }
    }
    return Json(std::move(out));
  }

  // One quoted string from its opening quote, its text appended to `out`.
  bool OneString(bool raw, std::string* out) {
    const char quote = Peek();
    const bool triple = Peek(1) == quote && Peek(2) == quote;
    pos_ += triple ? 3 : 1;
    while (true) {
      if (AtEnd()) return false;
      const char c = Peek();
      if (c == quote && (!triple || (Peek(1) == quote && Peek(2) == quote))) {
        pos_ += triple ? 3 : 1;
        return true;
      }
      if (c == '\n' && !triple) return false;
      if (c != '\\') {
        out->push_back(c);
        ++pos_;
        continue;
      }
      // A backslash: in a raw string it stays, with the character after it (a quote after it
      // does not end the string); otherwise an escape as Python reads it.
      if (pos_ + 1 >= s_.size()) return false;
      const char e = Peek(1);
      if (raw) {
        out->push_back('\\');
        out->push_back(e);
        pos_ += 2;
        continue;
      }
      pos_ += 2;
      switch (e) {
        case '\n': break;
        case '\\': out->push_back('\\'); break;
        case '\'': out->push_back('\''); break;
        case '"': out->push_back('"'); break;
        case 'a': out->push_back('\a'); break;
        case 'b': out->push_back('\b'); break;
        case 'f': out->push_back('\f'); break;
        case 'n': out->push_back('\n'); break;
        case 'r': out->push_back('\r'); break;
        case 't': out->push_back('\t'); break;
        case 'v': out->push_back('\v'); break;
        case 'x':
        case 'u':
        case 'U': {
          const int digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          uint32_t cp = 0;
          for (int i = 0; i < digits; ++i) {
            const int h = HexValue(Peek());
            if (h < 0) return false;
            cp = cp * 16 + static_cast<uint32_t>(h);
            ++pos_;
          }
          if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
          tokenizer_internal::AppendUtf8(static_cast<char32_t>(cp), out);
          break;
        }
        default:
          if (e >= '0' && e <= '7') {
            uint32_t cp = static_cast<uint32_t>(e - '0');
            for (int i = 0; i < 2 && Peek() >= '0' && Peek() <= '7'; ++i) {
              cp = cp * 8 + static_cast<uint32_t>(Peek() - '0');
              ++pos_;
            }
            tokenizer_internal::AppendUtf8(static_cast<char32_t>(cp), out);
          } else if (e == 'N') {
            return false;  // a character by its name: no table of names here
          } else {
            out->push_back('\\');  // an escape Python does not know stays as written
            --pos_;
          }
      }
    }
  }

  // Digits with single underscores between them, in `base`; their text without the underscores.
  bool Digits(int base, std::string* out) {
    bool any = false;
    while (!AtEnd()) {
      const char c = Peek();
      const int v = HexValue(c);
      if (v >= 0 && v < base && (base == 16 || absl::ascii_isdigit(c))) {
        out->push_back(c);
        ++pos_;
        any = true;
      } else if (c == '_' && any && pos_ + 1 < s_.size() && HexValue(Peek(1)) >= 0 && HexValue(Peek(1)) < base &&
                 (base == 16 || absl::ascii_isdigit(Peek(1)))) {
        ++pos_;
      } else {
        break;
      }
    }
    return any;
  }

  std::optional<Json> Number() {
    std::string text;
    if (Peek() == '0' && (Peek(1) == 'x' || Peek(1) == 'X' || Peek(1) == 'o' || Peek(1) == 'O' || Peek(1) == 'b' ||
                          Peek(1) == 'B')) {
      const char kind = absl::ascii_tolower(Peek(1));
      const int base = kind == 'x' ? 16 : kind == 'o' ? 8 : 2;
      pos_ += 2;
      if (Peek() == '_') ++pos_;  // 0x_ff
      if (!Digits(base, &text) || IsIdentifierChar(Peek())) return std::nullopt;
      return Integer(text, base);
    }
    bool is_float = false;
    const bool whole = Digits(10, &text);
    if (Peek() == '.') {
      is_float = true;
      text.push_back('.');
      ++pos_;
      std::string fraction;
      if (Digits(10, &fraction)) {
        text += fraction;
      } else if (!whole) {
        return std::nullopt;
      }
    }
    if (Peek() == 'e' || Peek() == 'E') {
      const size_t before = pos_;
      std::string exponent = "e";
      ++pos_;
      if (Peek() == '+' || Peek() == '-') {
        exponent.push_back(Peek());
        ++pos_;
      }
      std::string digits;
      if (!Digits(10, &digits)) {
        pos_ = before;
        return std::nullopt;
      }
      text += exponent + digits;
      is_float = true;
    }
    if (IsIdentifierChar(Peek())) return std::nullopt;  // 1j (complex), 5x
    if (!is_float) {
      // Leading zeros only in zero itself (007 is a syntax error).
      if (text.size() > 1 && text[0] == '0' && text.find_first_not_of('0') != std::string::npos) return std::nullopt;
      return Integer(text, 10);
    }
    char* end = nullptr;
    const double d = std::strtod(text.c_str(), &end);
    if (end != text.c_str() + text.size() || !std::isfinite(d)) return std::nullopt;
    return Json(d);
  }

  // An integer's digits in `base` within 64 bits (unsigned above INT64_MAX).
  std::optional<Json> Integer(const std::string& digits, int base) {
    uint64_t v = 0;
    for (char c : digits) {
      const uint64_t d = static_cast<uint64_t>(HexValue(c));
      if (v > (UINT64_MAX - d) / static_cast<uint64_t>(base)) return std::nullopt;
      v = v * static_cast<uint64_t>(base) + d;
    }
    if (v <= static_cast<uint64_t>(INT64_MAX)) return Json(static_cast<int64_t>(v));
    return Json(v);
  }

  absl::string_view s_;
  size_t pos_ = 0;
  int depth_ = 0;
};

}  // namespace

std::optional<Json> ReadPythonLiteral(absl::string_view text) {
  if (text.find('\0') != absl::string_view::npos) return std::nullopt;  // Python refuses source with NUL
  // Python reads "\r\n" and "\r" as "\n" everywhere, inside triple-quoted strings too.
  std::string lines;
  if (text.find('\r') != absl::string_view::npos) {
    lines = absl::StrReplaceAll(text, {{"\r\n", "\n"}});
    std::replace(lines.begin(), lines.end(), '\r', '\n');
    text = lines;
  }
  return Reader(text).Whole();
}

}  // namespace shardserve::openai
