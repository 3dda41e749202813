// Regular expressions (ECMAScript syntax, as JSON Schema's `pattern`) to GBNF text.
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "grammar/grammar.h"
#include "grammar/utf8.h"

namespace shardserve::grammar {
namespace {

using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;

const Ranges kDigit = {{'0', '9'}};
const Ranges kWord = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
const Ranges kSpace = {{'\t', '\r'}, {' ', ' '}, {0xA0, 0xA0}, {0x1680, 0x1680}, {0x2000, 0x200A},
                       {0x2028, 0x2029}, {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000}, {0xFEFF, 0xFEFF}};

class RegexParser {
 public:
  explicit RegexParser(std::string_view re) : re_(re) {}

  absl::StatusOr<std::string> Parse() {
    if (re_.size() > static_cast<size_t>(kMaxInputBytes)) return absl::InvalidArgumentError("the regular expression is too long");
    if (pos_ < re_.size() && re_[pos_] == '^') ++pos_;
    SHARDSERVE_ASSIGN_OR_RETURN(std::string out, Alternation(0));
    if (pos_ < re_.size()) return Error(re_[pos_] == ')' ? "unbalanced )" : "unexpected character");
    return out;
  }

 private:
  absl::Status Error(const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat("regular expression offset ", pos_, ": ", what));
  }
  bool AtEnd() const { return pos_ >= re_.size(); }

  absl::StatusOr<std::string> Alternation(int depth) {
    if (depth > kMaxNesting) return Error(absl::StrCat("groups nested deeper than ", kMaxNesting));
    std::string out = "(";
    while (true) {
      SHARDSERVE_ASSIGN_OR_RETURN(std::string seq, Sequence(depth));
      out += seq.empty() ? "\"\"" : seq;
      if (!AtEnd() && re_[pos_] == '|') {
        ++pos_;
        out += " | ";
        continue;
      }
      return out + ")";
    }
  }

  absl::StatusOr<std::string> Sequence(int depth) {
    std::string out;
    while (!AtEnd() && re_[pos_] != '|' && re_[pos_] != ')') {
      const size_t at = pos_;
      std::string atom;
      const char c = re_[pos_];
      if (c == '$') {
        ++pos_;
        if (!AtEnd() && re_[pos_] != ')' && re_[pos_] != '|') return Error("$ is supported only at the end");
        continue;
      }
      if (c == '^') return Error("^ is supported only at the start");
      if (c == '*' || c == '+' || c == '?' || c == '{') return Error("quantifier with nothing to repeat");
      if (c == '(') {
        ++pos_;
        if (re_.substr(pos_, 2) == "?:") {
          pos_ += 2;
        } else if (re_.substr(pos_, 2) == "?=" || re_.substr(pos_, 2) == "?!" || re_.substr(pos_, 3) == "?<=" ||
                   re_.substr(pos_, 3) == "?<!") {
          return Error("look-around assertions are not supported");
        } else if (re_.substr(pos_, 2) == "?<") {  // named group: the name is dropped
          while (!AtEnd() && re_[pos_] != '>') ++pos_;
          if (AtEnd()) return Error("unterminated group name");
          ++pos_;
        } else if (!AtEnd() && re_[pos_] == '?') {
          return Error("unsupported group syntax (?");
        }
        SHARDSERVE_ASSIGN_OR_RETURN(atom, Alternation(depth + 1));
        if (AtEnd() || re_[pos_] != ')') return Error("unclosed (");
        ++pos_;
      } else if (c == '[') {
        SHARDSERVE_ASSIGN_OR_RETURN(atom, Class());
      } else if (c == '.') {
        ++pos_;
        atom = CharClassGbnf(MakeCharClass({{'\n', '\n'}, {'\r', '\r'}, {0x2028, 0x2029}}, true));
      } else {
        Ranges ranges;
        bool negate = false;
        SHARDSERVE_RETURN_IF_ERROR(Char(/*in_class=*/false, &ranges, &negate));
        atom = ranges.size() == 1 && ranges[0].first == ranges[0].second && !negate
                   ? GbnfLiteral(EncodeUtf8(ranges[0].first))
                   : CharClassGbnf(MakeCharClass(ranges, negate));
      }
      (void)at;
      SHARDSERVE_ASSIGN_OR_RETURN(std::string quantifier, Quantifier());
      if (!out.empty()) out += " ";
      absl::StrAppend(&out, atom, quantifier);
    }
    return out;
  }

  absl::StatusOr<std::string> Quantifier() {
    if (AtEnd()) return std::string();
    std::string q;
    const char c = re_[pos_];
    if (c == '*' || c == '+' || c == '?') {
      ++pos_;
      q = std::string(1, c);
    } else if (c == '{') {
      size_t p = pos_ + 1;
      auto number = [&](std::optional<int>* v) -> bool {
        int64_t n = 0;
        const size_t start = p;
        while (p < re_.size() && re_[p] >= '0' && re_[p] <= '9') {
          n = n * 10 + (re_[p++] - '0');
          if (n > kMaxRepeat) return false;
        }
        if (p > start) *v = static_cast<int>(n);
        return true;
      };
      std::optional<int> min, max;
      bool comma = false;
      if (!number(&min)) return Error(absl::StrCat("repetition count over ", kMaxRepeat));
      if (p < re_.size() && re_[p] == ',') {
        comma = true;
        ++p;
        if (!number(&max)) return Error(absl::StrCat("repetition count over ", kMaxRepeat));
      }
      if (!min.has_value() || p >= re_.size() || re_[p] != '}') return Error("malformed {m,n}");
      if (max.has_value() && *max < *min) return Error("{m,n} with n < m");
      pos_ = p + 1;
      q = !comma ? absl::StrCat("{", *min, "}") : max.has_value() ? absl::StrCat("{", *min, ",", *max, "}") : absl::StrCat("{", *min, ",}");
    } else {
      return std::string();
    }
    if (!AtEnd() && re_[pos_] == '?') ++pos_;  // lazy: the same strings
    if (!AtEnd() && (re_[pos_] == '*' || re_[pos_] == '+' || re_[pos_] == '?' || re_[pos_] == '{')) {
      return Error("nothing to repeat after a quantifier");
    }
    return q;
  }

  absl::StatusOr<std::string> Class() {
    ++pos_;  // [
    const bool negate = !AtEnd() && re_[pos_] == '^';
    if (negate) ++pos_;
    Ranges ranges;
    bool first = true;
    while (!AtEnd() && (re_[pos_] != ']' || (first && false))) {
      first = false;
      Ranges lo_ranges;
      bool lo_negated = false;
      SHARDSERVE_RETURN_IF_ERROR(Char(/*in_class=*/true, &lo_ranges, &lo_negated));
      const bool single = lo_ranges.size() == 1 && lo_ranges[0].first == lo_ranges[0].second && !lo_negated;
      if (single && pos_ + 1 < re_.size() && re_[pos_] == '-' && re_[pos_ + 1] != ']') {
        ++pos_;
        Ranges hi_ranges;
        bool hi_negated = false;
        SHARDSERVE_RETURN_IF_ERROR(Char(/*in_class=*/true, &hi_ranges, &hi_negated));
        if (hi_ranges.size() != 1 || hi_ranges[0].first != hi_ranges[0].second || hi_negated) {
          return Error("a class escape cannot end a range");
        }
        if (hi_ranges[0].first < lo_ranges[0].first) return Error("character range out of order");
        ranges.push_back({lo_ranges[0].first, hi_ranges[0].first});
        continue;
      }
      if (lo_negated) {
        for (auto r : MakeCharClass(lo_ranges, true).ranges) ranges.push_back(r);
      } else {
        ranges.insert(ranges.end(), lo_ranges.begin(), lo_ranges.end());
      }
    }
    if (AtEnd()) return Error("unterminated character class");
    ++pos_;
    CharClass cls = MakeCharClass(ranges, negate);
    if (cls.ranges.empty()) return Error("empty character class");
    return CharClassGbnf(cls);
  }

  // One character or class escape at pos_: its ranges (and whether they are negated: \D \W \S).
  absl::Status Char(bool in_class, Ranges* ranges, bool* negate) {
    if (re_[pos_] != '\\') {
      size_t len = 0;
      std::optional<uint32_t> cp = DecodeUtf8(re_, pos_, &len);
      if (!cp.has_value()) return Error("invalid UTF-8");
      pos_ += len;
      ranges->push_back({*cp, *cp});
      return absl::OkStatus();
    }
    ++pos_;
    if (AtEnd()) return Error("unfinished escape");
    const char c = re_[pos_++];
    auto single = [&](uint32_t cp) {
      ranges->push_back({cp, cp});
      return absl::OkStatus();
    };
    switch (c) {
      case 'd': *ranges = kDigit; return absl::OkStatus();
      case 'w': *ranges = kWord; return absl::OkStatus();
      case 's': *ranges = kSpace; return absl::OkStatus();
      case 'D': *ranges = kDigit; *negate = true; return absl::OkStatus();
      case 'W': *ranges = kWord; *negate = true; return absl::OkStatus();
      case 'S': *ranges = kSpace; *negate = true; return absl::OkStatus();
      case 'n': return single('\n');
      case 'r': return single('\r');
      case 't': return single('\t');
      case 'f': return single('\f');
      case 'v': return single('\v');
      case '0': return single(0);
      case 'b':
        if (in_class) return single('\b');
        return Error("word boundaries (\\b) are not supported");
      case 'B': return Error("word boundaries (\\B) are not supported");
      case 'x':
      case 'u': {
        int digits = c == 'x' ? 2 : 4;
        bool braced = false;
        if (c == 'u' && !AtEnd() && re_[pos_] == '{') {
          braced = true;
          ++pos_;
          digits = 6;
        }
        uint32_t v = 0;
        int n = 0;
        while (n < digits && !AtEnd() && isxdigit(static_cast<unsigned char>(re_[pos_]))) {
          const char h = re_[pos_++];
          v = v * 16 + static_cast<uint32_t>(h <= '9' ? h - '0' : (h | 0x20) - 'a' + 10);
          ++n;
        }
        if (braced) {
          if (AtEnd() || re_[pos_] != '}' || n == 0) return Error("malformed \\u{...}");
          ++pos_;
        } else if (n != digits) {
          return Error("expected hex digits");
        }
        if (v > kMaxCodePoint) return Error("code point past U+10FFFF");
        return single(v);
      }
      default:
        if (c >= '1' && c <= '9') return Error("back-references are not supported");
        if (c == 'p' || c == 'P' || c == 'k' || c == 'c') {
          return Error(absl::StrCat("the escape \\", std::string(1, c), " is not supported"));
        }
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
          return Error(absl::StrCat("unknown escape \\", std::string(1, c)));
        }
        --pos_;
        {
          size_t len = 0;
          std::optional<uint32_t> cp = DecodeUtf8(re_, pos_, &len);
          if (!cp.has_value()) return Error("invalid UTF-8");
          pos_ += len;
          return single(*cp);
        }
    }
  }

  std::string_view re_;
  size_t pos_ = 0;
};

}  // namespace

absl::StatusOr<std::string> RegexToGbnf(std::string_view regex) { return RegexParser(regex).Parse(); }

}  // namespace shardserve::grammar
