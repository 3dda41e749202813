// The patterns of tokenizer.json (Split pre-tokenizer, Replace normalizer and decoder): either a
// literal string or a regular expression. Hugging Face compiles the regular expressions with
// Oniguruma; we compile them with PCRE2 (UTF + UCP, JIT when available) after rewriting the one
// construct whose meaning differs between the two for the patterns real checkpoints use:
// \s and \S become the explicit Unicode White_Space set, because PCRE2's \s also matches
// U+180E and Oniguruma's does not. A class intersection [A&&[^B]] (Oniguruma has it, and so has
// Rust's regex, the dialect of tiktoken patterns such as Kimi K2's) becomes a look-ahead before a
// class, (?:(?![B])[A]), which PCRE2 before 10.45 can compile. A script, \p{Han}, becomes
// \p{sc:Han}: the Script property, which the other engines match, where PCRE2 from 10.40 matches
// Script_Extensions (U+3002 "。" would be Han). \p{L}, \p{N}, (?i:...) and look-ahead mean the
// same in all three.
//
// Thread-safety: a Pattern is immutable after Compile() and may be used from many threads at
// once; each thread keeps its own PCRE2 match data and JIT stack.
#ifndef SHARDSERVE_COORDINATOR_TOKENIZER_PATTERN_H_
#define SHARDSERVE_COORDINATOR_TOKENIZER_PATTERN_H_

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

struct pcre2_real_code_8;

namespace shardserve::tokenizer_internal {

class Pattern {
 public:
  // A literal pattern: matches the bytes of `text` exactly.
  static std::unique_ptr<Pattern> Literal(std::string_view text);
  // A regular expression in the Oniguruma dialect tokenizer.json uses. Fails with
  // InvalidArgument naming the pattern if PCRE2 cannot compile it, and with Unimplemented for
  // \S inside a character class (no PCRE2 equivalent without class subtraction) and for the class
  // intersections not written as above (negated, or a nested class beside other members).
  static absl::StatusOr<std::unique_ptr<Pattern>> Regex(std::string_view pattern);

  ~Pattern();
  Pattern(const Pattern&) = delete;
  Pattern& operator=(const Pattern&) = delete;

  // Calls on_match(begin, end) for each non-empty, non-overlapping match in `subject`, left to
  // right, with byte offsets into `subject`. `subject` must be valid UTF-8 (not re-checked).
  // Empty matches are skipped. Fails only if PCRE2 gives up (JIT stack or match limit).
  absl::Status ForEachMatch(std::string_view subject, absl::FunctionRef<void(size_t, size_t)> on_match) const;

 private:
  Pattern() = default;

  std::string literal_;                // literal patterns
  pcre2_real_code_8* code_ = nullptr;  // regular expressions; owned
  bool jit_ = false;                   // code_ was JIT-compiled
};

}  // namespace shardserve::tokenizer_internal

#endif  // SHARDSERVE_COORDINATOR_TOKENIZER_PATTERN_H_
