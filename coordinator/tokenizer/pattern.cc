#include "coordinator/tokenizer/pattern.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "absl/strings/str_cat.h"
#include "coordinator/tokenizer/string_util.h"
#include "coordinator/tokenizer/unicode.h"

namespace shardserve::tokenizer_internal {
namespace {

// Unicode White_Space (unicode.h, IsWhitespace) as the inside of a PCRE2 character class.
constexpr std::string_view kWhiteSpaceClass =
    "\\x{9}-\\x{D}\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";

// Rewrites \s and \S (see pattern.h); everything else is copied as written.
absl::StatusOr<std::string> TranslateOniguruma(std::string_view pattern) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[++i];
      if (e == 's') {
        absl::StrAppend(&out, in_class ? "" : "[", Sv(kWhiteSpaceClass), in_class ? "" : "]");
      } else if (e == 'S') {
        if (in_class) {
          return absl::UnimplementedError(
              absl::StrCat("regex '", Sv(pattern), "': \\S inside a character class is not supported"));
        }
        absl::StrAppend(&out, "[^", Sv(kWhiteSpaceClass), "]");
      } else {
        out.push_back(c);
        out.push_back(e);
      }
      continue;
    }
    out.push_back(c);
    if (!in_class && c == '[') {
      in_class = true;
      // A ']' right after '[' or '[^' is a literal member, not the end of the class.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out.push_back(pattern[++i]);
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out.push_back(pattern[++i]);
    } else if (in_class && c == ']') {
      in_class = false;
    }
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
