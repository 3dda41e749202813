// The grammar IR's helpers (character classes, validation, printing), the GBNF parser and the
// builder for lists of choices.
#include "grammar/grammar.h"

#include <algorithm>
#include <map>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "grammar/utf8.h"

namespace shardserve::grammar {

bool CharClass::Contains(uint32_t cp) const { return Intersects(cp, cp); }

bool CharClass::Intersects(uint32_t lo, uint32_t hi) const {
  // The first range whose end is >= lo.
  auto it = std::lower_bound(ranges.begin(), ranges.end(), lo,
                             [](const std::pair<uint32_t, uint32_t>& r, uint32_t v) { return r.second < v; });
  return it != ranges.end() && it->first <= hi;
}

CharClass MakeCharClass(std::vector<std::pair<uint32_t, uint32_t>> ranges, bool negate) {
  std::sort(ranges.begin(), ranges.end());
  CharClass out;
  for (auto [lo, hi] : ranges) {
    if (lo > hi) continue;
    if (!out.ranges.empty() && lo <= out.ranges.back().second + 1) {
      out.ranges.back().second = std::max(out.ranges.back().second, hi);
    } else {
      out.ranges.push_back({lo, hi});
    }
  }
  if (negate) {
    CharClass complement;
    uint32_t next = 0;
    for (auto [lo, hi] : out.ranges) {
      if (lo > next) complement.ranges.push_back({next, lo - 1});
      next = hi + 1;
    }
    if (next <= kMaxCodePoint) complement.ranges.push_back({next, kMaxCodePoint});
    out = std::move(complement);
  }
  // Surrogates are not scalar values: UTF-8 never encodes them.
  CharClass cut;
  for (auto [lo, hi] : out.ranges) {
    if (hi < 0xD800 || lo > 0xDFFF) {
      cut.ranges.push_back({lo, hi});
      continue;
    }
    if (lo < 0xD800) cut.ranges.push_back({lo, 0xD7FF});
    if (hi > 0xDFFF) cut.ranges.push_back({0xE000, hi});
  }
  return cut;
}

namespace {

std::string EscapeCodePoint(uint32_t cp, bool in_class) {
  switch (cp) {
    case '\n': return "\\n";
    case '\r': return "\\r";
    case '\t': return "\\t";
    case '\\': return "\\\\";
    case '"': return in_class ? "\"" : "\\\"";
    case ']': return in_class ? "\\]" : "]";
    case '-': return in_class ? "\\-" : "-";
    case '^': return in_class ? "\\^" : "^";
    default: break;
  }
  if (cp < 0x20 || cp == 0x7F) return absl::StrFormat("\\x%02X", cp);
  if (cp < 0x80) return std::string(1, static_cast<char>(cp));
  return cp <= 0xFFFF ? absl::StrFormat("\\u%04X", cp) : absl::StrFormat("\\U%08X", cp);
}

}  // namespace

std::string CharClassGbnf(const CharClass& c) {
  // A special token's class (<[id]>), as the parser reads it
  if (c.ranges.size() == 1 && c.ranges[0].first == c.ranges[0].second && c.ranges[0].first >= kSpecialTokenBase) {
    return absl::StrCat("<[", c.ranges[0].first - kSpecialTokenBase, "]>");
  }
  std::string out = "[";
  for (auto [lo, hi] : c.ranges) {
    out += EscapeCodePoint(lo, true);
    if (hi != lo) absl::StrAppend(&out, "-", EscapeCodePoint(hi, true));
  }
  return out + "]";
}

std::string GbnfLiteral(std::string_view text) {
  std::string out = "\"";
  for (size_t i = 0; i < text.size();) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c >= 0x80) {  // non-ASCII UTF-8 kept as is; invalid bytes as \xHH (one byte each)
      size_t len = 0;
      if (DecodeUtf8(text, i, &len).has_value()) {
        out.append(text.substr(i, len));
        i += len;
        continue;
      }
      absl::StrAppendFormat(&out, "\\x%02X", c);
      ++i;
      continue;
    }
    out += EscapeCodePoint(c, false);
    ++i;
  }
  return out + "\"";
}

std::string Grammar::ToString() const {
  std::string out;
  for (size_t r = 0; r < rules.size(); ++r) {
    absl::StrAppend(&out, rules[r].name, " ::=");
    for (size_t a = 0; a < rules[r].alternatives.size(); ++a) {
      if (a > 0) out += " |";
      if (rules[r].alternatives[a].empty()) out += " \"\"";
      for (const Element& e : rules[r].alternatives[a]) {
        out += " ";
        if (e.kind == Element::Kind::kRule) {
          out += rules[e.index].name;
        } else {
          out += CharClassGbnf(classes[e.index]);
          if (e.kind == Element::Kind::kClassStar) out += "*";
        }
      }
    }
    out += "\n";
  }
  return out;
}

absl::Status ValidateGrammar(const Grammar& grammar) {
  const int n = static_cast<int>(grammar.rules.size());
  if (n == 0) return absl::InvalidArgumentError("the grammar has no rules");
  if (n > kMaxRules) return absl::InvalidArgumentError(absl::StrCat("the grammar has ", n, " rules, more than ", kMaxRules));
  if (grammar.root < 0 || grammar.root >= n) return absl::InvalidArgumentError("the grammar's root rule is out of range");
  int64_t elements = 0;
  for (const Rule& rule : grammar.rules) {
    for (const Sequence& seq : rule.alternatives) {
      elements += static_cast<int64_t>(seq.size());
      for (const Element& e : seq) {
        const int limit = e.kind == Element::Kind::kRule ? n : static_cast<int>(grammar.classes.size());
        if (e.index < 0 || e.index >= limit) {
          return absl::InvalidArgumentError(absl::StrCat("rule ", rule.name, " refers to an element out of range"));
        }
      }
    }
  }
  if (elements > kMaxElements) {
    return absl::InvalidArgumentError(
        absl::StrCat("the grammar has ", elements, " elements, more than ", kMaxElements));
  }
  // Nullable rules (match the empty string), to a fixed point.
  std::vector<char> nullable(n, 0);
  for (bool changed = true; changed;) {
    changed = false;
    for (int r = 0; r < n; ++r) {
      if (nullable[r]) continue;
      for (const Sequence& seq : grammar.rules[r].alternatives) {
        const bool all = std::all_of(seq.begin(), seq.end(), [&](const Element& e) {
          return e.kind == Element::Kind::kClassStar || (e.kind == Element::Kind::kRule && nullable[e.index]);
        });
        if (all) {
          nullable[r] = 1;
          changed = true;
          break;
        }
      }
    }
  }
  // Left calls: A -> B when an alternative of A reaches B before consuming a byte. A cycle is left
  // recursion, which the matcher's expansion could not finish.
  std::vector<std::vector<int>> calls(n);
  for (int r = 0; r < n; ++r) {
    for (const Sequence& seq : grammar.rules[r].alternatives) {
      for (const Element& e : seq) {
        if (e.kind == Element::Kind::kRule) calls[r].push_back(e.index);
        if (e.kind == Element::Kind::kClass || (e.kind == Element::Kind::kRule && !nullable[e.index])) break;
      }
    }
  }
  std::vector<char> color(n, 0);  // 0 unseen, 1 on the path, 2 done
  for (int start = 0; start < n; ++start) {
    if (color[start]) continue;
    std::vector<std::pair<int, size_t>> path = {{start, 0}};
    color[start] = 1;
    while (!path.empty()) {
      auto& [r, next] = path.back();
      if (next == calls[r].size()) {
        color[r] = 2;
        path.pop_back();
        continue;
      }
      const int callee = calls[r][next++];
      if (color[callee] == 1) {
        return absl::InvalidArgumentError(absl::StrCat("rule ", grammar.rules[callee].name,
                                                       " is left-recursive (reaches itself before reading a character)"));
      }
      if (color[callee] == 0) {
        color[callee] = 1;
        path.push_back({callee, 0});
      }
    }
  }
  return absl::OkStatus();
}

namespace {

// Builds a Grammar: rules by name, classes interned.
class Builder {
 public:
  explicit Builder(Grammar* g) : g_(g) {}

  int Class(const CharClass& c) {
    auto [it, inserted] = class_index_.try_emplace(c.ranges, static_cast<int>(g_->classes.size()));
    if (inserted) g_->classes.push_back(c);
    return it->second;
  }
  int NewRule(std::string name) {
    g_->rules.push_back(Rule{std::move(name), {}});
    return static_cast<int>(g_->rules.size()) - 1;
  }
  // x{min,max} (max < 0: unbounded) appended to `out`.
  absl::Status Repeat(const Sequence& atom, int min, int max, const std::string& base, Sequence* out) {
    if (min > kMaxRepeat || max > kMaxRepeat) {
      return absl::InvalidArgumentError(absl::StrCat("repetition count over ", kMaxRepeat));
    }
    count_ += static_cast<int64_t>(atom.size()) * (std::max(min, max) + 1);
    if (count_ > kMaxElements) return absl::InvalidArgumentError(absl::StrCat("grammar larger than ", kMaxElements, " elements"));
    for (int i = 0; i < min; ++i) out->insert(out->end(), atom.begin(), atom.end());
    if (max < 0) {
      if (atom.size() == 1 && atom[0].kind == Element::Kind::kClass) {
        out->push_back({Element::Kind::kClassStar, atom[0].index});
        return absl::OkStatus();
      }
      const int r = NewRule(absl::StrCat(base, "_star", g_->rules.size()));
      Sequence loop = atom;
      loop.push_back({Element::Kind::kRule, r});
      g_->rules[r].alternatives = {std::move(loop), {}};
      out->push_back({Element::Kind::kRule, r});
      return absl::OkStatus();
    }
    int prev = -1;  // (atom (atom (...)?)?)?, each level a rule
    for (int i = min; i < max; ++i) {
      const int r = NewRule(absl::StrCat(base, "_opt", g_->rules.size()));
      Sequence some = atom;
      if (prev >= 0) some.push_back({Element::Kind::kRule, prev});
      g_->rules[r].alternatives = {std::move(some), {}};
      prev = r;
    }
    if (prev >= 0) out->push_back({Element::Kind::kRule, prev});
    return absl::OkStatus();
  }

 private:
  Grammar* g_;
  std::map<std::vector<std::pair<uint32_t, uint32_t>>, int> class_index_;
  int64_t count_ = 0;
};

class GbnfParser {
 public:
  GbnfParser(std::string_view text, Grammar* g) : text_(text), g_(g), builder_(g) {}

  absl::Status Parse(std::string_view root_rule) {
    if (text_.size() > static_cast<size_t>(kMaxInputBytes)) {
      return absl::InvalidArgumentError(absl::StrCat("the grammar is longer than ", kMaxInputBytes, " bytes"));
    }
    SkipSpace();
    while (pos_ < text_.size()) {
      const size_t at = pos_;
      const std::string name = Name();
      if (name.empty()) return Error("expected a rule name");
      SkipSpace();
      if (text_.substr(pos_, 3) != "::=") return Error("expected ::= after the rule name");
      pos_ += 3;
      const int r = RuleIndex(name, at);
      if (defined_.contains(r)) return ErrorAt(at, absl::StrCat("rule ", name, " is defined twice"));
      defined_[r] = at;
      std::vector<Sequence> alternatives;
      SHARDSERVE_RETURN_IF_ERROR(Alternatives(name, 0, &alternatives));
      g_->rules[r].alternatives = std::move(alternatives);
      if (pos_ < text_.size() && text_[pos_] == ')') return Error("unbalanced )");
    }
    for (const auto& [name, index] : rule_index_) {
      if (!defined_.contains(index)) return ErrorAt(first_use_[index], absl::StrCat("rule ", name, " is not defined"));
    }
    auto root = rule_index_.find(std::string(root_rule));
    if (root == rule_index_.end()) return absl::InvalidArgumentError(absl::StrCat("the grammar has no rule ", std::string(root_rule)));
    g_->root = root->second;
    return ValidateGrammar(*g_);
  }

 private:
  absl::Status ErrorAt(size_t at, const std::string& what) const {
    int line = 1, column = 1;
    for (size_t i = 0; i < at && i < text_.size(); ++i) {
      if (text_[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    return absl::InvalidArgumentError(absl::StrCat("grammar line ", line, " column ", column, ": ", what));
  }
  absl::Status Error(const std::string& what) const { return ErrorAt(pos_, what); }

  void SkipSpace() {
    while (pos_ < text_.size()) {
      const char c = text_[pos_];
      if (c == '#') {
        while (pos_ < text_.size() && text_[pos_] != '\n') ++pos_;
      } else if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
        ++pos_;
      } else {
        break;
      }
    }
  }
  static bool NameChar(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
  }
  std::string Name() {
    const size_t start = pos_;
    while (pos_ < text_.size() && NameChar(text_[pos_])) ++pos_;
    return std::string(text_.substr(start, pos_ - start));
  }
  // Whether a rule definition (`name ::=`) starts at pos_.
  bool AtDefinition() const {
    size_t p = pos_;
    while (p < text_.size() && NameChar(text_[p])) ++p;
    if (p == pos_) return false;
    while (p < text_.size() && (text_[p] == ' ' || text_[p] == '\t' || text_[p] == '\n' || text_[p] == '\r')) ++p;
    return text_.substr(p, 3) == "::=";
  }
  int RuleIndex(const std::string& name, size_t at) {
    auto [it, inserted] = rule_index_.try_emplace(name, static_cast<int>(g_->rules.size()));
    if (inserted) {
      builder_.NewRule(name);
      first_use_[it->second] = at;
    }
    return it->second;
  }

  absl::StatusOr<uint32_t> Escape() {  // after the backslash
    if (pos_ >= text_.size()) return Error("unfinished escape");
    const char c = text_[pos_++];
    int digits = 0;
    switch (c) {
      case 'n': return '\n';
      case 'r': return '\r';
      case 't': return '\t';
      case '0': return 0;
      case 'x': digits = 2; break;
      case 'u': digits = 4; break;
      case 'U': digits = 8; break;
      default:
        if (c == '\\' || c == '"' || c == ']' || c == '[' || c == '-' || c == '^' || c == '/' || c == '.' || c == '\'') return c;
        return ErrorAt(pos_ - 1, absl::StrCat("unknown escape \\", std::string(1, c)));
    }
    uint32_t v = 0;
    for (int i = 0; i < digits; ++i) {
      if (pos_ >= text_.size() || !isxdigit(static_cast<unsigned char>(text_[pos_]))) return Error("expected a hex digit");
      const char h = text_[pos_++];
      v = v * 16 + static_cast<uint32_t>(h <= '9' ? h - '0' : (h | 0x20) - 'a' + 10);
    }
    if (v > kMaxCodePoint) return Error("code point past U+10FFFF");
    return v;
  }
  absl::StatusOr<uint32_t> Char() {  // one character of a literal or class
    if (text_[pos_] == '\\') {
      ++pos_;
      return Escape();
    }
    size_t len = 0;
    std::optional<uint32_t> cp = DecodeUtf8(text_, pos_, &len);
    if (!cp.has_value()) return Error("invalid UTF-8");
    pos_ += len;
    return *cp;
  }

  absl::Status Alternatives(const std::string& base, int depth, std::vector<Sequence>* out) {
    if (depth > kMaxNesting) return Error(absl::StrCat("groups nested deeper than ", kMaxNesting));
    while (true) {
      Sequence seq;
      SHARDSERVE_RETURN_IF_ERROR(SequenceOf(base, depth, &seq));
      out->push_back(std::move(seq));
      SkipSpace();
      if (pos_ < text_.size() && text_[pos_] == '|') {
        ++pos_;
        continue;
      }
      return absl::OkStatus();
    }
  }

  absl::Status SequenceOf(const std::string& base, int depth, Sequence* seq) {
    while (true) {
      SkipSpace();
      if (pos_ >= text_.size()) return absl::OkStatus();
      const char c = text_[pos_];
      if (c == '|' || c == ')') return absl::OkStatus();
      if (depth == 0 && AtDefinition()) return absl::OkStatus();
      Sequence atom;
      const size_t at = pos_;
      if (c == '"') {
        ++pos_;
        while (pos_ < text_.size() && text_[pos_] != '"') {
          SHARDSERVE_ASSIGN_OR_RETURN(uint32_t cp, Char());
          atom.push_back({Element::Kind::kClass, builder_.Class(CharClass{{{cp, cp}}})});
        }
        if (pos_ >= text_.size()) return ErrorAt(at, "unterminated literal");
        ++pos_;
      } else if (c == '[') {
        ++pos_;
        const bool negate = pos_ < text_.size() && text_[pos_] == '^';
        if (negate) ++pos_;
        std::vector<std::pair<uint32_t, uint32_t>> ranges;
        while (pos_ < text_.size() && text_[pos_] != ']') {
          SHARDSERVE_ASSIGN_OR_RETURN(uint32_t lo, Char());
          uint32_t hi = lo;
          if (pos_ + 1 < text_.size() && text_[pos_] == '-' && text_[pos_ + 1] != ']') {
            ++pos_;
            SHARDSERVE_ASSIGN_OR_RETURN(hi, Char());
            if (hi < lo) return ErrorAt(at, "character range out of order");
          }
          ranges.push_back({lo, hi});
        }
        if (pos_ >= text_.size()) return ErrorAt(at, "unterminated character class");
        ++pos_;
        CharClass cls = MakeCharClass(std::move(ranges), negate);
        if (cls.ranges.empty()) return ErrorAt(at, "empty character class");
        atom.push_back({Element::Kind::kClass, builder_.Class(cls)});
      } else if (c == '.') {
        ++pos_;
        atom.push_back({Element::Kind::kClass, builder_.Class(MakeCharClass({{'\n', '\n'}}, true))});
      } else if (c == '(') {
        ++pos_;
        std::vector<Sequence> alternatives;
        SHARDSERVE_RETURN_IF_ERROR(Alternatives(base, depth + 1, &alternatives));
        if (pos_ >= text_.size() || text_[pos_] != ')') return ErrorAt(at, "unclosed (");
        ++pos_;
        if (alternatives.size() == 1) {
          atom = std::move(alternatives[0]);
        } else {
          const int r = builder_.NewRule(absl::StrCat(base, "_group", g_->rules.size()));
          g_->rules[r].alternatives = std::move(alternatives);
          atom.push_back({Element::Kind::kRule, r});
        }
      } else if (c == '<' && pos_ + 1 < text_.size() && text_[pos_ + 1] == '[') {
        // <[ID]>: special token ID (a chat format's marker; grammar/utf8.h), as llama.cpp writes it
        pos_ += 2;
        int64_t id = 0;
        const size_t digits = pos_;
        while (pos_ < text_.size() && isdigit(static_cast<unsigned char>(text_[pos_])) && id <= kMaxSpecialTokenId) {
          id = id * 10 + (text_[pos_++] - '0');
        }
        if (pos_ == digits) return ErrorAt(at, "expected a token id after <[");
        if (id > kMaxSpecialTokenId) return ErrorAt(at, absl::StrCat("token id past ", kMaxSpecialTokenId));
        if (pos_ + 1 >= text_.size() || text_[pos_] != ']' || text_[pos_ + 1] != '>') {
          return ErrorAt(at, "expected ]> after <[ and a token id");
        }
        pos_ += 2;
        const uint32_t cp = SpecialTokenCodePoint(static_cast<int32_t>(id));
        atom.push_back({Element::Kind::kClass, builder_.Class(CharClass{{{cp, cp}}})});
      } else if (NameChar(c)) {
        const std::string name = Name();
        atom.push_back({Element::Kind::kRule, RuleIndex(name, at)});
      } else {
        return Error(absl::StrCat("unexpected character '", std::string(1, c), "'"));
      }
      // Quantifier.
      int min = 1, max = 1;
      if (pos_ < text_.size() && (text_[pos_] == '*' || text_[pos_] == '+' || text_[pos_] == '?')) {
        const char q = text_[pos_++];
        min = q == '+' ? 1 : 0;
        max = q == '?' ? 1 : -1;
      } else if (pos_ < text_.size() && text_[pos_] == '{') {
        const size_t qat = pos_++;
        SHARDSERVE_ASSIGN_OR_RETURN(min, Number());
        max = min;
        if (pos_ < text_.size() && text_[pos_] == ',') {
          ++pos_;
          SkipSpace();
          if (pos_ < text_.size() && text_[pos_] == '}') {
            max = -1;
          } else {
            SHARDSERVE_ASSIGN_OR_RETURN(max, Number());
          }
        }
        SkipSpace();
        if (pos_ >= text_.size() || text_[pos_] != '}') return ErrorAt(qat, "unclosed {m,n}");
        ++pos_;
        if (max >= 0 && max < min) return ErrorAt(qat, "{m,n} with n < m");
      }
      if (min == 1 && max == 1) {
        seq->insert(seq->end(), atom.begin(), atom.end());
      } else {
        if (atom.size() > 1) {  // a literal or group of several elements: one rule
          const int r = builder_.NewRule(absl::StrCat(base, "_group", g_->rules.size()));
          g_->rules[r].alternatives = {std::move(atom)};
          atom = {{Element::Kind::kRule, r}};
        }
        absl::Status s = builder_.Repeat(atom, min, max, base, seq);
        if (!s.ok()) return ErrorAt(at, std::string(s.message()));
      }
    }
  }

  absl::StatusOr<int> Number() {
    SkipSpace();
    const size_t start = pos_;
    int64_t v = 0;
    while (pos_ < text_.size() && isdigit(static_cast<unsigned char>(text_[pos_]))) {
      v = v * 10 + (text_[pos_++] - '0');
      if (v > kMaxRepeat) return ErrorAt(start, absl::StrCat("repetition count over ", kMaxRepeat));
    }
    if (pos_ == start) return Error("expected a number");
    SkipSpace();
    return static_cast<int>(v);
  }

  std::string_view text_;
  size_t pos_ = 0;
  Grammar* g_;
  Builder builder_;
  std::map<std::string, int> rule_index_;
  absl::flat_hash_map<int, size_t> defined_, first_use_;
};

}  // namespace

absl::StatusOr<Grammar> ParseGbnf(std::string_view text, std::string_view root_rule) {
  Grammar g;
  GbnfParser parser(text, &g);
  SHARDSERVE_RETURN_IF_ERROR(parser.Parse(root_rule));
  return g;
}

absl::StatusOr<Grammar> GrammarFromChoices(const std::vector<std::string>& choices) {
  if (choices.empty()) return absl::InvalidArgumentError("the list of choices is empty");
  std::string text = "root ::=";
  for (size_t i = 0; i < choices.size(); ++i) {
    absl::StrAppend(&text, i ? " | " : " ", GbnfLiteral(choices[i]));
  }
  return ParseGbnf(text);
}

absl::StatusOr<Grammar> GrammarFromRegex(std::string_view regex) {
  SHARDSERVE_ASSIGN_OR_RETURN(std::string body, RegexToGbnf(regex));
  return ParseGbnf(absl::StrCat("root ::= ", body));
}

}  // namespace shardserve::grammar
