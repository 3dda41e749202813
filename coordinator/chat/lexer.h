// The chat-template lexer: Jinja source text -> a flat list of tokens, with the whitespace control
// transformers compiles with (trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False) and
// the `-`/`+` modifiers on tags already applied to the text tokens, so the parser never sees layout.
//
// Every token records the 1-based line and column of its first character in the template, which
// every later error (syntax or runtime) reports.
#ifndef SHARDSERVE_COORDINATOR_CHAT_LEXER_H_
#define SHARDSERVE_COORDINATOR_CHAT_LEXER_H_

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace shardserve::chat {

// A position in the template source.
struct Location {
  int line = 1;
  int column = 1;
};

// What every stage of the engine throws internally; Render()/Parse() turn it into an absl::Status
// that carries the message and the location. Never crosses the library's boundary.
class TemplateError : public std::runtime_error {
 public:
  TemplateError(std::string message, Location where, bool raised = false)
      : std::runtime_error(message), message_(std::move(message)), where_(where), raised_(raised) {}
  const std::string& message() const { return message_; }
  Location where() const { return where_; }
  // True for raise_exception(): the template's own message, not an engine diagnostic.
  bool raised() const { return raised_; }

 private:
  std::string message_;
  Location where_;
  bool raised_;
};

enum class TokenKind {
  kText,        // literal template text between tags
  kVarBegin,    // {{
  kVarEnd,      // }}
  kBlockBegin,  // {%
  kBlockEnd,    // %}
  kName,        // identifier or keyword
  kString,      // string literal, escapes already decoded
  kInt,
  kFloat,
  kOp,          // operator or punctuation: + - * / // % ** ~ == != < <= > >= = ( ) [ ] { } , . : |
  kEnd,         // end of the template
};

struct Token {
  TokenKind kind;
  std::string text;  // kText/kName/kString/kOp: the text; numbers: their spelling
  int64_t int_value = 0;
  double float_value = 0;
  Location where;
};

// Splits `source` into tokens. A syntax error (unterminated tag or string, stray character) is
// INVALID_ARGUMENT naming the line and column.
absl::StatusOr<std::vector<Token>> Lex(std::string_view source);

// Same, throwing TemplateError; for the parser.
std::vector<Token> LexOrThrow(std::string_view source);

}  // namespace shardserve::chat

#endif  // SHARDSERVE_COORDINATOR_CHAT_LEXER_H_
