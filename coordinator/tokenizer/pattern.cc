#include "coordinator/tokenizer/pattern.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/tokenizer/string_util.h"
#include "coordinator/tokenizer/unicode.h"

namespace shardserve::tokenizer_internal {
namespace {

// Unicode White_Space (unicode.h, IsWhitespace) as the inside of a PCRE2 character class.
constexpr std::string_view kWhiteSpaceClass =
    "\\x{9}-\\x{D}\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";

// True if PCRE2 knows `name` as a script (\p{sc:NAME} compiles).
bool IsScript(std::string_view name) {
  const std::string probe = absl::StrCat("\\p{sc:", Sv(name), "}");
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(probe.data()), probe.size(), PCRE2_UTF | PCRE2_UCP,
                                   &error, &offset, nullptr);
  pcre2_code_free(code);
  return code != nullptr;
}

// Appends the escape \p{...} or \P{...} that starts at pattern[i] ('\\') and returns the index
// of its '}'; npos if pattern[i] starts no such escape. A script name becomes \p{sc:NAME}: from
// PCRE2 10.40 a bare script name matches the script's extensions (U+3002 "。" is then Han, as
// it is in none of the engines whose patterns these are), and sc: restores the Script property.
size_t AppendProperty(std::string_view pattern, size_t i, std::string* out) {
  if (pattern[i] != '\\' || i + 2 >= pattern.size() || (pattern[i + 1] != 'p' && pattern[i + 1] != 'P') ||
      pattern[i + 2] != '{') {
    return std::string_view::npos;
  }
  const size_t close = pattern.find('}', i + 3);
  if (close == std::string_view::npos) return std::string_view::npos;
  const std::string_view name = pattern.substr(i + 3, close - i - 3);
  const bool negated_name = !name.empty() && name[0] == '^';
  const std::string_view bare = negated_name ? name.substr(1) : name;
  out->append(pattern.substr(i, 3));
  if (negated_name) out->push_back('^');
  if (bare.find_first_of(":=") == std::string_view::npos && IsScript(bare)) out->append("sc:");
  out->append(bare);
  out->push_back('}');
  return close;
}

// The end of the character class that opens at pattern[open] ('['): the index of its closing ']'
// (npos if none). A ']' right after '[' or '[^' is a member; nested classes ([:alpha:] or an
// operand of &&) and escapes are skipped whole.
size_t ClassEnd(std::string_view pattern, size_t open) {
  size_t i = open + 1;
  if (i < pattern.size() && pattern[i] == '^') ++i;
  if (i < pattern.size() && pattern[i] == ']') ++i;
  for (int depth = 0; i < pattern.size(); ++i) {
    if (pattern[i] == '\\') {
      ++i;
    } else if (pattern[i] == '[') {
      ++depth;
    } else if (pattern[i] == ']') {
      if (depth == 0) return i;
      --depth;
    }
  }
  return std::string_view::npos;
}

// The members of a character class (between its brackets), \s rewritten as the White_Space set.
absl::StatusOr<std::string> ClassMembers(std::string_view pattern, std::string_view members) {
  std::string out;
  for (size_t i = 0; i < members.size(); ++i) {
    if (const size_t close = AppendProperty(members, i, &out); close != std::string_view::npos) {
      i = close;
      continue;
    }
    if (members[i] == '\\' && i + 1 < members.size()) {
      const char e = members[++i];
      if (e == 'S') {
        return absl::UnimplementedError(
            absl::StrCat("regex '", Sv(pattern), "': \\S inside a character class is not supported"));
      }
      if (e == 's') {
        out.append(kWhiteSpaceClass);
      } else {
        out.push_back('\\');
        out.push_back(e);
      }
      continue;
    }
    out.push_back(members[i]);
  }
  return out;
}

// A class intersection [A&&B&&...] (Oniguruma and Rust's regex, which tiktoken patterns use; PCRE2
// before 10.45 has none) as look-aheads before the first operand: (?:(?=[B])...[A]), with
// (?![C]) for a negated operand [^C]. Each operand is a list of members or one nested class.
absl::StatusOr<std::string> Intersection(std::string_view pattern, std::string_view body) {
  auto unsupported = [&](std::string_view why) {
    return absl::UnimplementedError(absl::StrCat("regex '", Sv(pattern), "': ", Sv(why)));
  };
  if (!body.empty() && body[0] == '^') return unsupported("a negated class intersection [^...&&...] is not supported");
  std::vector<std::string_view> operands;
  size_t start = 0;
  for (size_t i = 0; i < body.size(); ++i) {
    if (body[i] == '\\') {
      ++i;
    } else if (body[i] == '[') {
      const size_t end = ClassEnd(body, i);
      if (end == std::string_view::npos) return unsupported("an unclosed class inside a class intersection");
      i = end;
    } else if (body.substr(i, 2) == "&&") {
      operands.push_back(body.substr(start, i - start));
      start = i + 2;
      ++i;
    }
  }
  operands.push_back(body.substr(start));
  std::string lookaheads, first;
  for (size_t k = 0; k < operands.size(); ++k) {
    std::string_view op = operands[k];
    bool negated = false;
    if (!op.empty() && op[0] == '[' && op.substr(0, 2) != "[:" && ClassEnd(op, 0) == op.size() - 1) {
      op = op.substr(1, op.size() - 2);  // one nested class: its members
      if (!op.empty() && op[0] == '^') {
        negated = true;
        op.remove_prefix(1);
      }
    }
    if (op.empty()) return unsupported("an empty operand of a class intersection");
    for (size_t i = 0; i < op.size(); ++i) {  // members only: a nested class here would be a union
      if (op[i] == '\\') {
        ++i;
      } else if (op[i] == '[' && op.substr(i, 2) != "[:") {
        return unsupported("a nested class beside other members in a class intersection");
      }
    }
    absl::StatusOr<std::string> members = ClassMembers(pattern, op);
    if (!members.ok()) return members.status();
    const std::string cls = absl::StrCat("[", negated ? "^" : "", *members, "]");
    if (k == 0) {
      first = cls;
    } else {
      absl::StrAppend(&lookaheads, "(?=", cls, ")");
    }
  }
  return absl::StrCat("(?:", lookaheads, first, ")");
}

// Rewrites \s and \S, and class intersections (see pattern.h); everything else is copied as written.
absl::StatusOr<std::string> TranslateOniguruma(std::string_view pattern) {
  std::string out;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (const size_t close = AppendProperty(pattern, i, &out); close != std::string_view::npos) {
      i = close;
      continue;
    }
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[++i];
      if (e == 's') {
        absl::StrAppend(&out, "[", Sv(kWhiteSpaceClass), "]");
      } else if (e == 'S') {
        absl::StrAppend(&out, "[^", Sv(kWhiteSpaceClass), "]");
      } else {
        out.push_back(c);
        out.push_back(e);
      }
      continue;
    }
    if (c != '[') {
      out.push_back(c);
      continue;
    }
    const size_t end = ClassEnd(pattern, i);
    if (end == std::string_view::npos) {  // PCRE2 reports the missing ']'
      out.append(pattern.substr(i));
      break;
    }
    const std::string_view body = pattern.substr(i + 1, end - i - 1);
    absl::StatusOr<std::string> translated;
    if (body.find("&&") != std::string_view::npos) {
      translated = Intersection(pattern, body);
    } else {
      const bool negated = !body.empty() && body[0] == '^';
      translated = ClassMembers(pattern, negated ? body.substr(1) : body);
      if (translated.ok()) *translated = absl::StrCat("[", negated ? "^" : "", *translated, "]");
    }
    if (!translated.ok()) return translated.status();
    out += *translated;
    i = end;
  }
  return out;
}

// Per-thread PCRE2 match state, shared by every Pattern used on that thread.
class MatchState {
 public:
  MatchState()
      : data_(pcre2_match_data_create(1, nullptr)),
        context_(pcre2_match_context_create(nullptr)),
        // The JIT stack starts at 32 KiB and may grow to 8 MiB; virtual memory until touched.
        jit_stack_(pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr)) {
    pcre2_jit_stack_assign(context_, nullptr, jit_stack_);
  }
  ~MatchState() {
    pcre2_jit_stack_free(jit_stack_);
    pcre2_match_context_free(context_);
    pcre2_match_data_free(data_);
  }
  MatchState(const MatchState&) = delete;
  MatchState& operator=(const MatchState&) = delete;

  pcre2_match_data* data() { return data_; }
  pcre2_match_context* context() { return context_; }

 private:
  pcre2_match_data* data_;
  pcre2_match_context* context_;
  pcre2_jit_stack* jit_stack_;
};

std::string Pcre2Message(int code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(code, buffer, sizeof(buffer));
  return reinterpret_cast<const char*>(buffer);
}

}  // namespace

std::unique_ptr<Pattern> Pattern::Literal(std::string_view text) {
  std::unique_ptr<Pattern> p(new Pattern());
  p->literal_ = std::string(text);
  return p;
}

absl::StatusOr<std::unique_ptr<Pattern>> Pattern::Regex(std::string_view pattern) {
  absl::StatusOr<std::string> translated = TranslateOniguruma(pattern);
  if (!translated.ok()) return translated.status();
  int error = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated->data()), translated->size(),
                                   PCRE2_UTF | PCRE2_UCP, &error, &error_offset, nullptr);
  if (code == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "regex '", Sv(pattern), "' does not compile (PCRE2: ", Pcre2Message(error), " at offset ", error_offset, ")"));
  }
  std::unique_ptr<Pattern> p(new Pattern());
  p->code_ = code;
  // Without JIT support (some architectures) pcre2_match interprets the pattern instead.
  p->jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  return p;
}

Pattern::~Pattern() { pcre2_code_free(code_); }

absl::Status Pattern::ForEachMatch(std::string_view subject, absl::FunctionRef<void(size_t, size_t)> on_match) const {
  if (code_ == nullptr) {
    if (literal_.empty()) return absl::OkStatus();
    for (size_t at = subject.find(literal_); at != std::string_view::npos;
         at = subject.find(literal_, at + literal_.size())) {
      on_match(at, at + literal_.size());
    }
    return absl::OkStatus();
  }
  thread_local MatchState state;
  const auto* data = reinterpret_cast<PCRE2_SPTR>(subject.data());
  size_t start = 0;
  while (start < subject.size()) {
    const int rc =
        jit_ ? pcre2_jit_match(code_, data, subject.size(), start, 0, state.data(), state.context())
             : pcre2_match(code_, data, subject.size(), start, PCRE2_NO_UTF_CHECK, state.data(), state.context());
    if (rc == PCRE2_ERROR_NOMATCH) break;
    // rc == 0 means the match succeeded but had more capture groups than the match data holds.
    if (rc < 0) return absl::ResourceExhaustedError(absl::StrCat("regex match failed: ", Pcre2Message(rc)));
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.data());
    const size_t begin = ovector[0], end = ovector[1];
    if (end == begin) {  // empty match: try again one character further on
      if (end >= subject.size()) break;
      start = end + Utf8Length(static_cast<uint8_t>(subject[end]));
      continue;
    }
    on_match(begin, end);
    start = end;
  }
  return absl::OkStatus();
}

}  // namespace shardserve::tokenizer_internal
