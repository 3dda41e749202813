// Whitespace rules, as jinja2's lexer applies them with transformers' settings:
//  - the source's newlines are normalized to \n and one trailing newline is dropped
//    (keep_trailing_newline=False);
//  - `{%-`, `{{-`, `{#-` strip all whitespace before the tag; `-%}`, `-}}`, `-#}` all after it;
//  - trim_blocks: the first newline after a block or comment tag is removed (`+%}` keeps it);
//  - lstrip_blocks: spaces and tabs from the start of a line up to a block or comment tag are
//    removed (`{%+` keeps them); "start of a line" includes text right after a tag whose end
//    consumed a newline, as in jinja2.
#include "coordinator/chat/lexer.h"

#include <algorithm>
#include <charconv>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "coordinator/chat/value.h"

namespace shardserve::chat {
namespace {

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
bool IsNameStart(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool IsDigit(char c) { return c >= '0' && c <= '9'; }
bool IsNameChar(char c) { return IsNameStart(c) || IsDigit(c); }


class Lexer {
 public:
  explicit Lexer(std::string source) : src_(std::move(source)) {
    line_starts_.push_back(0);
    for (size_t i = 0; i < src_.size(); ++i) {
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
    }
  }

  std::vector<Token> Run() {
    size_t pos = 0;
    bool line_starting = true;
    while (pos < src_.size()) {
      size_t start = FindTagStart(pos);
      std::string text = src_.substr(pos, start - pos);
      const size_t text_pos = pos;
      if (start == src_.size()) {
        Emit(TokenKind::kText, std::move(text), text_pos);
        break;
      }
      const char type = src_[start + 1];  // '{', '%' or '#'
      const char modifier = start + 2 < src_.size() ? src_[start + 2] : '\0';
      if (modifier == '-') {
        while (!text.empty() && IsSpace(text.back())) text.pop_back();
      } else if (type != '{' && modifier != '+') {
        // lstrip_blocks: only spaces and tabs between the line's start and the tag.
        size_t l_pos = text.rfind('\n');
        l_pos = l_pos == std::string::npos ? 0 : l_pos + 1;
        if (l_pos > 0 || line_starting) {
          if (text.find_first_not_of(" \t", l_pos) == std::string::npos) text.resize(l_pos);
        }
      }
      Emit(TokenKind::kText, std::move(text), text_pos);
      size_t inner = start + 2 + ((modifier == '-' || modifier == '+') ? 1 : 0);
      if (type == '#') {
        pos = LexComment(start, inner, &line_starting);
      } else if (type == '%' && IsRawTag(inner)) {
        pos = LexRaw(start, inner, &line_starting);
      } else {
        pos = LexTag(type, start, inner, &line_starting);
      }
    }
    Token end{TokenKind::kEnd, "", 0, 0, LocAt(src_.size())};
    tokens_.push_back(end);
    return std::move(tokens_);
  }

 private:
  Location LocAt(size_t offset) const {
    auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), offset);
    const size_t line = static_cast<size_t>(it - line_starts_.begin());
    return Location{static_cast<int>(line), static_cast<int>(offset - line_starts_[line - 1] + 1)};
  }

  [[noreturn]] void Fail(const std::string& message, size_t offset) const { throw TemplateError(message, LocAt(offset)); }

  void Emit(TokenKind kind, std::string text, size_t offset) {
    if (kind == TokenKind::kText && text.empty()) return;
    Token t;
    t.kind = kind;
    t.text = std::move(text);
    t.where = LocAt(offset);
    tokens_.push_back(std::move(t));
  }

  size_t FindTagStart(size_t pos) const {
    while (true) {
      size_t p = src_.find('{', pos);
      if (p == std::string::npos || p + 1 >= src_.size()) return src_.size();
      const char c = src_[p + 1];
      if (c == '{' || c == '%' || c == '#') return p;
      pos = p + 1;
    }
  }

  // After a tag's closing delimiter at `pos`: applies `-` (strip all whitespace) or trim_blocks
  // (one newline, block and comment tags only) and returns where the next text starts.
  size_t AfterTagEnd(size_t pos, char end_modifier, bool trim_blocks, bool* line_starting) {
    if (end_modifier == '-') {
      size_t p = pos;
      while (p < src_.size() && IsSpace(src_[p])) ++p;
      *line_starting = p > pos && src_[p - 1] == '\n';
      return p;
    }
    if (trim_blocks && end_modifier != '+' && pos < src_.size() && src_[pos] == '\n') {
      *line_starting = true;
      return pos + 1;
    }
    *line_starting = false;
    return pos;
  }

  size_t LexComment(size_t start, size_t inner, bool* line_starting) {
    size_t end = src_.find("#}", inner);
    if (end == std::string::npos) Fail("unterminated comment: missing '#}'", start);
    const char modifier = end > inner && src_[end - 1] == '-' ? '-' : (end > inner && src_[end - 1] == '+' ? '+' : '\0');
    return AfterTagEnd(end + 2, modifier, /*trim_blocks=*/true, line_starting);
  }

  bool IsRawTag(size_t p) const {
    while (p < src_.size() && IsSpace(src_[p])) ++p;
    if (src_.compare(p, 3, "raw") != 0) return false;
    p += 3;
    while (p < src_.size() && IsSpace(src_[p])) ++p;
    if (p < src_.size() && src_[p] == '-') ++p;
    return src_.compare(p, 2, "%}") == 0;
  }

  // {% raw %} ... {% endraw %}: the text in between is output as is.
  size_t LexRaw(size_t start, size_t inner, bool* line_starting) {
    size_t close = src_.find("%}", inner);
    const char open_end_mod = src_[close - 1] == '-' ? '-' : '\0';
    size_t body = AfterTagEnd(close + 2, open_end_mod, true, line_starting);
    size_t search = body;
    while (true) {
      size_t tag = src_.find("{%", search);
      if (tag == std::string::npos) Fail("unterminated raw block: missing '{% endraw %}'", start);
      size_t p = tag + 2;
      const char mod = p < src_.size() && (src_[p] == '-' || src_[p] == '+') ? src_[p] : '\0';
      if (mod != '\0') ++p;
      while (p < src_.size() && IsSpace(src_[p])) ++p;
      if (src_.compare(p, 6, "endraw") != 0) {
        search = tag + 2;
        continue;
      }
      p += 6;
      while (p < src_.size() && IsSpace(src_[p])) ++p;
      char end_mod = '\0';
      if (p < src_.size() && src_[p] == '-') end_mod = '-', ++p;
      if (src_.compare(p, 2, "%}") != 0) Fail("malformed endraw tag", tag);
      std::string text = src_.substr(body, tag - body);
      if (mod == '-') {
        while (!text.empty() && IsSpace(text.back())) text.pop_back();
      }
      Emit(TokenKind::kText, std::move(text), body);
      return AfterTagEnd(p + 2, end_mod, true, line_starting);
    }
  }

  size_t LexTag(char type, size_t start, size_t p, bool* line_starting) {
    const bool is_var = type == '{';
    Emit(is_var ? TokenKind::kVarBegin : TokenKind::kBlockBegin, is_var ? "{{" : "{%", start);
    int depth = 0;  // open brackets, so that `}}` inside a dict literal does not end a {{ }}
    while (true) {
      while (p < src_.size() && IsSpace(src_[p])) ++p;
      if (p >= src_.size()) Fail(is_var ? "unterminated '{{': missing '}}'" : "unterminated '{%': missing '%}'", start);
      const char end_char = is_var ? '}' : '%';
      // Tag end: [-+]?%} or -?}}.
      for (char mod : {'-', '+', '\0'}) {
        size_t q = p;
        if (mod != '\0') {
          if (src_[q] != mod) continue;
          ++q;
        }
        if (depth == 0 && q + 1 < src_.size() && src_[q] == end_char && src_[q + 1] == '}') {
          Emit(is_var ? TokenKind::kVarEnd : TokenKind::kBlockEnd, is_var ? "}}" : "%}", p);
          return AfterTagEnd(q + 2, mod, /*trim_blocks=*/!is_var, line_starting);
        }
      }
      const char c = src_[p];
      if (c == '"' || c == '\'') {
        p = LexString(p);
      } else if (IsDigit(c)) {
        p = LexNumber(p);
      } else if (IsNameStart(c)) {
        size_t q = p;
        while (q < src_.size() && IsNameChar(src_[q])) ++q;
        Emit(TokenKind::kName, src_.substr(p, q - p), p);
        p = q;
      } else {
        static const char* const kTwo[] = {"//", "**", "==", "!=", "<=", ">="};
        bool matched = false;
        for (const char* op : kTwo) {
          if (src_.compare(p, 2, op) == 0) {
            Emit(TokenKind::kOp, op, p);
            p += 2;
            matched = true;
            break;
          }
        }
        if (matched) continue;
        if (std::strchr("+-*/%~<>=()[]{},.:|", c) == nullptr) {
          Fail(absl::StrCat("unexpected character '", std::string(1, c), "' in a tag"), p);
        }
        if (c == '(' || c == '[' || c == '{') ++depth;
        if ((c == ')' || c == ']' || c == '}') && depth > 0) --depth;
        Emit(TokenKind::kOp, std::string(1, c), p);
        ++p;
      }
    }
  }

  // A Python string literal; escapes decoded as Python's unicode-escape codec does.
  size_t LexString(size_t start) {
    const char quote = src_[start];
    std::string out;
    size_t p = start + 1;
    while (true) {
      if (p >= src_.size()) Fail("unterminated string literal", start);
      const char c = src_[p];
      if (c == quote) break;
      if (c != '\\') {
        out.push_back(c);
        ++p;
        continue;
      }
      if (p + 1 >= src_.size()) Fail("unterminated string literal", start);
      const char e = src_[p + 1];
      p += 2;
      switch (e) {
        case 'n': out.push_back('\n'); break;
        case 't': out.push_back('\t'); break;
        case 'r': out.push_back('\r'); break;
        case '\\': out.push_back('\\'); break;
        case '\'': out.push_back('\''); break;
        case '"': out.push_back('"'); break;
        case 'a': out.push_back('\a'); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'v': out.push_back('\v'); break;
        case '\n': break;  // line continuation
        case 'x': case 'u': case 'U': {
          const size_t n = e == 'x' ? 2 : (e == 'u' ? 4 : 8);
          if (p + n > src_.size()) Fail("truncated \\" + std::string(1, e) + " escape", p - 2);
          uint32_t cp = 0;
          auto [ptr, ec] = std::from_chars(src_.data() + p, src_.data() + p + n, cp, 16);
          if (ec != std::errc() || ptr != src_.data() + p + n || cp > 0x10FFFF) {
            Fail("malformed \\" + std::string(1, e) + " escape", p - 2);
          }
          AppendUtf8(&out, cp);
          p += n;
          break;
        }
        default:
          if (e >= '0' && e <= '7') {  // octal, up to three digits
            uint32_t cp = static_cast<uint32_t>(e - '0');
            for (int i = 0; i < 2 && p < src_.size() && src_[p] >= '0' && src_[p] <= '7'; ++i, ++p) {
              cp = cp * 8 + static_cast<uint32_t>(src_[p] - '0');
            }
            AppendUtf8(&out, cp);
          } else {  // unknown escapes stay as written
            out.push_back('\\');
            out.push_back(e);
          }
      }
    }
    Emit(TokenKind::kString, std::move(out), start);
    return p + 1;
  }

  size_t LexNumber(size_t start) {
    size_t p = start;
    while (p < src_.size() && (IsDigit(src_[p]) || src_[p] == '_')) ++p;
    bool is_float = false;
    if (p + 1 < src_.size() && src_[p] == '.' && IsDigit(src_[p + 1])) {
      is_float = true;
      ++p;
      while (p < src_.size() && (IsDigit(src_[p]) || src_[p] == '_')) ++p;
    }
    if (p < src_.size() && (src_[p] == 'e' || src_[p] == 'E')) {
      size_t q = p + 1;
      if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
      if (q < src_.size() && IsDigit(src_[q])) {
        is_float = true;
        p = q;
        while (p < src_.size() && IsDigit(src_[p])) ++p;
      }
    }
    std::string spelling = src_.substr(start, p - start);
    std::string digits;
    for (char c : spelling) if (c != '_') digits.push_back(c);
    Token t;
    t.text = spelling;
    t.where = LocAt(start);
    if (is_float) {
      t.kind = TokenKind::kFloat;
      t.float_value = std::strtod(digits.c_str(), nullptr);
    } else {
      t.kind = TokenKind::kInt;
      auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), t.int_value);
      if (ec != std::errc()) Fail("integer literal out of range: " + spelling, start);
    }
    tokens_.push_back(std::move(t));
    return p;
  }

  std::string src_;
  std::vector<size_t> line_starts_;
  std::vector<Token> tokens_;
};

std::string NormalizeNewlines(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out.push_back('\n');
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out.push_back(source[i]);
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();  // keep_trailing_newline=False
  return out;
}

}  // namespace

std::vector<Token> LexOrThrow(std::string_view source) { return Lexer(NormalizeNewlines(source)).Run(); }

absl::StatusOr<std::vector<Token>> Lex(std::string_view source) {
  try {
    return LexOrThrow(source);
  } catch (const TemplateError& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("chat template line ", e.where().line, ", column ", e.where().column, ": ", e.message()));
  }
}

}  // namespace shardserve::chat
