// The chat-template parser: tokens (lexer.h) -> an AST of statements and expressions, following
// jinja2's grammar and operator precedence (lowest first): `x if c else y`, or, and, not,
// comparisons and `in`, + -, ~, * / // %, **, unary - +, then postfix: `.attr`, `[key]`,
// `[a:b:c]`, `(args)`, `| filter(args)`, `is [not] test(args)`.
//
// Statements: if/elif/else, for (with `if` filter, `else`, tuple targets), set (name, ns.attr,
// tuple, block set), macro, break/continue (loopcontrols), raw (in the lexer), and transformers'
// {% generation %} (rendered as its body). A Template is immutable once parsed and may be rendered
// from several threads at once.
#ifndef SHARDSERVE_COORDINATOR_CHAT_PARSER_H_
#define SHARDSERVE_COORDINATOR_CHAT_PARSER_H_

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/chat/lexer.h"
#include "coordinator/chat/value.h"

namespace shardserve::chat {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kLiteral,   // literal
    kName,      // name
    kList,      // args: items
    kTuple,     // args: items (a tuple: a list that prints as (a, b))
    kDict,      // args: key0, value0, key1, value1 ...
    kGetAttr,   // args[0].name
    kGetItem,   // args[0][args[1]]
    kSlice,     // args[0][args[1]:args[2]:args[3]], absent parts are null
    kCall,      // args[0](args[1..], kwargs)
    kFilter,    // args[0] | name(args[1..], kwargs)
    kTest,      // args[0] is [not] name(args[1..])
    kUnary,     // name in {"-", "+", "not"}; args[0]
    kBinary,    // args[0] name args[1]; name is an operator, "in", "not in", "and", "or"
    kCondExpr,  // args[0] if args[1] else args[2] (args[2] null: undefined)
    kCompare,   // args[0] ops[0] args[1] ops[1] args[2] ...: a Python chain (a < b < c)
  };
  Kind kind;
  Location where;
  Value literal;
  std::string name;
  bool negated = false;  // kTest: `is not`
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;  // kCompare: "==", "!=", "<", "<=", ">", ">=", "in", "not in"
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Stmt {
  enum class Kind {
    kText,      // text
    kOutput,    // {{ expr }}
    kIf,        // branches (condition, body) ...; else_body
    kFor,       // for targets in expr [if cond]: body; else_body when nothing was visited
    kSet,       // targets = expr, or target_object.attr = expr, or (block set) targets = body
    kMacro,     // name(params with defaults): body
    kBreak,
    kContinue,
    kBlock,     // a body rendered in place ({% generation %})
  };
  Kind kind;
  Location where;
  std::string text;
  ExprPtr expr;
  ExprPtr cond;
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body body;
  Body else_body;
  std::vector<std::string> targets;  // kFor/kSet: names; kMacro: parameter names
  std::vector<ExprPtr> defaults;     // kMacro: default per parameter (null: required)
  std::string attr;                  // kSet on a namespace: targets[0].attr
  std::string name;                  // kMacro
  bool block_set = false;            // kSet: {% set x %}...{% endset %}
};

struct Template {
  Body body;
};

// Parses a template. A syntax error is INVALID_ARGUMENT "chat template line L, column C: ...".
absl::StatusOr<std::shared_ptr<const Template>> Parse(std::string_view source);

}  // namespace shardserve::chat

#endif  // SHARDSERVE_COORDINATOR_CHAT_PARSER_H_
