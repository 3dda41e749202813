#include "coordinator/chat/parser.h"

#include <set>

#include "absl/strings/str_cat.h"

namespace shardserve::chat {
namespace {

std::string Describe(const Token& t) {
  switch (t.kind) {
    case TokenKind::kText: return "text";
    case TokenKind::kVarBegin: return "'{{'";
    case TokenKind::kVarEnd: return "'}}'";
    case TokenKind::kBlockBegin: return "'{%'";
    case TokenKind::kBlockEnd: return "'%}'";
    case TokenKind::kName: return "'" + t.text + "'";
    case TokenKind::kString: return "string literal";
    case TokenKind::kInt: case TokenKind::kFloat: return "number " + t.text;
    case TokenKind::kOp: return "'" + t.text + "'";
    case TokenKind::kEnd: return "end of template";
  }
  return "?";
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  std::shared_ptr<const Template> Run() {
    auto tmpl = std::make_shared<Template>();
    std::string end;
    tmpl->body = ParseBody({}, &end);
    return tmpl;
  }

 private:
  // Bounds the recursion of nested expressions and blocks, so that no template exhausts the stack.
  struct DepthGuard {
    DepthGuard(Parser* p, const Token& at) : parser(p) {
      if (++parser->depth_ > kMaxDepth) parser->Fail("expressions or blocks nested too deeply", at);
    }
    ~DepthGuard() { --parser->depth_; }
    Parser* parser;
  };
  static constexpr int kMaxDepth = 200;

  const Token& Peek(size_t ahead = 0) const {
    const size_t i = std::min(pos_ + ahead, tokens_.size() - 1);
    return tokens_[i];
  }
  const Token& Next() {
    const Token& t = Peek();
    if (pos_ < tokens_.size() - 1) ++pos_;
    return t;
  }
  bool IsOp(const char* op, size_t ahead = 0) const {
    return Peek(ahead).kind == TokenKind::kOp && Peek(ahead).text == op;
  }
  bool IsName(const char* name, size_t ahead = 0) const {
    return Peek(ahead).kind == TokenKind::kName && Peek(ahead).text == name;
  }
  [[noreturn]] void Fail(const std::string& message, const Token& at) const { throw TemplateError(message, at.where); }
  void ExpectOp(const char* op) {
    if (!IsOp(op)) Fail(absl::StrCat("expected '", op, "', got ", Describe(Peek())), Peek());
    Next();
  }
  void ExpectBlockEnd() {
    if (Peek().kind != TokenKind::kBlockEnd) Fail("expected '%}', got " + Describe(Peek()), Peek());
    Next();
  }
  std::string ExpectName(const char* what) {
    if (Peek().kind != TokenKind::kName) Fail(absl::StrCat("expected ", what, ", got ", Describe(Peek())), Peek());
    return Next().text;
  }

  ExprPtr Make(Expr::Kind kind, Location where) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->where = where;
    return e;
  }

  // Statements until a block tag opening with one of `ends` (consumed, its keyword in *end) or,
  // when `ends` is empty, the end of the template.
  Body ParseBody(const std::set<std::string>& ends, std::string* end) {
    Body body;
    while (true) {
      const Token& t = Peek();
      if (t.kind == TokenKind::kEnd) {
        if (!ends.empty()) {
          std::string closer = *ends.begin();
          for (const std::string& e : ends) {
            if (e.rfind("end", 0) == 0) closer = e;
          }
          Fail(absl::StrCat("unexpected end of template; expected '", closer, "' to close a block"), t);
        }
        *end = "";
        return body;
      }
      if (t.kind == TokenKind::kText) {
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::kText;
        s->where = t.where;
        s->text = t.text;
        body.push_back(std::move(s));
        Next();
      } else if (t.kind == TokenKind::kVarBegin) {
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::kOutput;
        s->where = t.where;
        Next();
        s->expr = ParseTupleOrExpression();
        if (Peek().kind != TokenKind::kVarEnd) Fail("expected '}}', got " + Describe(Peek()), Peek());
        Next();
        body.push_back(std::move(s));
      } else if (t.kind == TokenKind::kBlockBegin) {
        const Token& kw = Peek(1);
        if (kw.kind != TokenKind::kName) Fail("expected a tag name after '{%', got " + Describe(kw), kw);
        if (ends.count(kw.text)) {
          Next();
          Next();
          *end = kw.text;
          return body;
        }
        body.push_back(ParseStatement());
      } else {
        Fail("unexpected " + Describe(t), t);
      }
    }
  }

  StmtPtr ParseStatement() {
    DepthGuard guard(this, Peek());
    Next();  // {%
    const Token kw = Next();
    auto s = std::make_unique<Stmt>();
    s->where = kw.where;
    std::string end;
    if (kw.text == "if") {
      s->kind = Stmt::Kind::kIf;
      ExprPtr cond = ParseExpression();
      ExpectBlockEnd();
      Body body = ParseBody({"elif", "else", "endif"}, &end);
      s->branches.emplace_back(std::move(cond), std::move(body));
      while (end == "elif") {
        ExprPtr c = ParseExpression();
        ExpectBlockEnd();
        Body b = ParseBody({"elif", "else", "endif"}, &end);
        s->branches.emplace_back(std::move(c), std::move(b));
      }
      if (end == "else") {
        ExpectBlockEnd();
        s->else_body = ParseBody({"endif"}, &end);
      }
      ExpectBlockEnd();
    } else if (kw.text == "for") {
      s->kind = Stmt::Kind::kFor;
      s->targets.push_back(ExpectName("a loop variable"));
      while (IsOp(",")) {
        Next();
        s->targets.push_back(ExpectName("a loop variable"));
      }
      if (!IsName("in")) Fail("expected 'in', got " + Describe(Peek()), Peek());
      Next();
      s->expr = ParseOr();  // no conditional expression: a trailing `if` filters the loop
      if (IsName("if")) {
        Next();
        s->cond = ParseExpression();
      }
      if (IsName("recursive")) Fail("recursive loops are not supported", Peek());
      ExpectBlockEnd();
      s->body = ParseBody({"else", "endfor"}, &end);
      if (end == "else") {
        ExpectBlockEnd();
        s->else_body = ParseBody({"endfor"}, &end);
      }
      ExpectBlockEnd();
    } else if (kw.text == "set") {
      s->kind = Stmt::Kind::kSet;
      s->targets.push_back(ExpectName("a variable name"));
      if (IsOp(".")) {
        Next();
        s->attr = ExpectName("an attribute name");
      } else {
        while (IsOp(",")) {
          Next();
          s->targets.push_back(ExpectName("a variable name"));
        }
      }
      if (IsOp("=")) {
        Next();
        s->expr = ParseTupleOrExpression();
        ExpectBlockEnd();
      } else {
        if (s->targets.size() != 1 || !s->attr.empty()) Fail("expected '='", Peek());
        ExpectBlockEnd();
        s->block_set = true;
        s->body = ParseBody({"endset"}, &end);
        ExpectBlockEnd();
      }
    } else if (kw.text == "macro") {
      s->kind = Stmt::Kind::kMacro;
      s->name = ExpectName("a macro name");
      ExpectOp("(");
      while (!IsOp(")")) {
        s->targets.push_back(ExpectName("a parameter name"));
        if (IsOp("=")) {
          Next();
          s->defaults.push_back(ParseExpression());
        } else {
          s->defaults.push_back(nullptr);
        }
        if (!IsOp(",")) break;
        Next();
      }
      ExpectOp(")");
      ExpectBlockEnd();
      s->body = ParseBody({"endmacro"}, &end);
      ExpectBlockEnd();
    } else if (kw.text == "break" || kw.text == "continue") {
      s->kind = kw.text == "break" ? Stmt::Kind::kBreak : Stmt::Kind::kContinue;
      ExpectBlockEnd();
    } else if (kw.text == "generation") {
      s->kind = Stmt::Kind::kBlock;
      ExpectBlockEnd();
      s->body = ParseBody({"endgeneration"}, &end);
      ExpectBlockEnd();
    } else {
      Fail("unknown or unsupported tag '" + kw.text + "'", kw);
    }
    return s;
  }

  // `a, b` where a tuple is allowed (set values, {{ }}): a list at run time.
  ExprPtr ParseTupleOrExpression() {
    const Location where = Peek().where;
    ExprPtr first = ParseExpression();
    if (!IsOp(",")) return first;
    ExprPtr tuple = Make(Expr::Kind::kTuple, where);
    tuple->args.push_back(std::move(first));
    while (IsOp(",")) {
      Next();
      if (Peek().kind == TokenKind::kBlockEnd || Peek().kind == TokenKind::kVarEnd) break;
      tuple->args.push_back(ParseExpression());
    }
    return tuple;
  }

  ExprPtr ParseExpression() {
    DepthGuard guard(this, Peek());
    ExprPtr e = ParseOr();
    while (IsName("if")) {
      const Location where = Peek().where;
      Next();
      ExprPtr cond = ParseOr();
      ExprPtr other;
      if (IsName("else")) {
        Next();
        other = ParseExpression();
      }
      ExprPtr c = Make(Expr::Kind::kCondExpr, where);
      c->args.push_back(std::move(e));
      c->args.push_back(std::move(cond));
      c->args.push_back(std::move(other));
      e = std::move(c);
    }
    return e;
  }

  ExprPtr Binary(const std::string& op, ExprPtr a, ExprPtr b, Location where) {
    ExprPtr e = Make(Expr::Kind::kBinary, where);
    e->name = op;
    e->args.push_back(std::move(a));
    e->args.push_back(std::move(b));
    return e;
  }

  ExprPtr ParseOr() {
    ExprPtr e = ParseAnd();
    while (IsName("or")) {
      const Location where = Next().where;
      e = Binary("or", std::move(e), ParseAnd(), where);
    }
    return e;
  }

  ExprPtr ParseAnd() {
    ExprPtr e = ParseNot();
    while (IsName("and")) {
      const Location where = Next().where;
      e = Binary("and", std::move(e), ParseNot(), where);
    }
    return e;
  }

  ExprPtr ParseNot() {
    DepthGuard guard(this, Peek());
    if (IsName("not")) {
      const Location where = Next().where;
      ExprPtr e = Make(Expr::Kind::kUnary, where);
      e->name = "not";
      e->args.push_back(ParseNot());
      return e;
    }
    return ParseCompare();
  }

  ExprPtr ParseCompare() {
    ExprPtr first = ParseMath1();
    ExprPtr chain;
    while (true) {
      const Token& t = Peek();
      std::string op;
      if (t.kind == TokenKind::kOp &&
          (t.text == "==" || t.text == "!=" || t.text == "<" || t.text == "<=" || t.text == ">" || t.text == ">=")) {
        op = t.text;
        Next();
      } else if (IsName("in")) {
        op = "in";
        Next();
      } else if (IsName("not") && IsName("in", 1)) {
        op = "not in";
        Next();
        Next();
      } else {
        break;
      }
      if (!chain) {
        chain = Make(Expr::Kind::kCompare, t.where);
        chain->args.push_back(std::move(first));
      }
      chain->ops.push_back(op);
      chain->args.push_back(ParseMath1());
    }
    return chain ? std::move(chain) : std::move(first);
  }

  ExprPtr ParseMath1() {
    ExprPtr e = ParseConcat();
    while (IsOp("+") || IsOp("-")) {
      const Token& t = Next();
      const std::string op = t.text;
      e = Binary(op, std::move(e), ParseConcat(), t.where);
    }
    return e;
  }

  ExprPtr ParseConcat() {
    ExprPtr e = ParseMath2();
    while (IsOp("~")) {
      const Location where = Next().where;
      e = Binary("~", std::move(e), ParseMath2(), where);
    }
    return e;
  }

  ExprPtr ParseMath2() {
    ExprPtr e = ParsePow();
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      const Token& t = Next();
      const std::string op = t.text;
      e = Binary(op, std::move(e), ParsePow(), t.where);
    }
    return e;
  }

  ExprPtr ParsePow() {
    ExprPtr e = ParseUnary(true);
    while (IsOp("**")) {
      const Location where = Next().where;
      e = Binary("**", std::move(e), ParseUnary(true), where);
    }
    return e;
  }


  ExprPtr ParseUnary(bool with_filter) {
    DepthGuard guard(this, Peek());
    ExprPtr e;
    if (IsOp("-") || IsOp("+")) {
      const Token& t = Next();
      e = Make(Expr::Kind::kUnary, t.where);
      e->name = t.text;
      e->args.push_back(ParseUnary(false));
    } else {
      e = ParsePrimary();
    }
    e = ParsePostfix(std::move(e));
    if (with_filter) e = ParseFilterExpr(std::move(e));
    return e;
  }

  ExprPtr ParsePrimary() {
    const Token t = Next();
    switch (t.kind) {
      case TokenKind::kName: {
        ExprPtr e = Make(Expr::Kind::kLiteral, t.where);
        if (t.text == "true" || t.text == "True") e->literal = Value(true);
        else if (t.text == "false" || t.text == "False") e->literal = Value(false);
        else if (t.text == "none" || t.text == "None") e->literal = Value::None();
        else {
          e->kind = Expr::Kind::kName;
          e->name = t.text;
        }
        return e;
      }
      case TokenKind::kString: {
        std::string s = t.text;
        while (Peek().kind == TokenKind::kString) s += Next().text;  // adjacent literals concatenate
        ExprPtr e = Make(Expr::Kind::kLiteral, t.where);
        e->literal = Value(std::move(s));
        return e;
      }
      case TokenKind::kInt: {
        ExprPtr e = Make(Expr::Kind::kLiteral, t.where);
        e->literal = Value(t.int_value);
        return e;
      }
      case TokenKind::kFloat: {
        ExprPtr e = Make(Expr::Kind::kLiteral, t.where);
        e->literal = Value(t.float_value);
        return e;
      }
      case TokenKind::kOp:
        if (t.text == "(") {
          if (IsOp(")")) {
            Next();
            return Make(Expr::Kind::kTuple, t.where);
          }
          ExprPtr first = ParseExpression();
          if (IsOp(")")) {
            Next();
            return first;
          }
          ExprPtr tuple = Make(Expr::Kind::kTuple, t.where);
          tuple->args.push_back(std::move(first));
          while (IsOp(",")) {
            Next();
            if (IsOp(")")) break;
            tuple->args.push_back(ParseExpression());
          }
          ExpectOp(")");
          return tuple;
        }
        if (t.text == "[") {
          ExprPtr list = Make(Expr::Kind::kList, t.where);
          while (!IsOp("]")) {
            list->args.push_back(ParseExpression());
            if (!IsOp(",")) break;
            Next();
          }
          ExpectOp("]");
          return list;
        }
        if (t.text == "{") {
          ExprPtr dict = Make(Expr::Kind::kDict, t.where);
          while (!IsOp("}")) {
            dict->args.push_back(ParseExpression());
            ExpectOp(":");
            dict->args.push_back(ParseExpression());
            if (!IsOp(",")) break;
            Next();
          }
          ExpectOp("}");
          return dict;
        }
        break;
      default:
        break;
    }
    Fail("unexpected " + Describe(t), t);
  }

  void ParseCallArgs(Expr* call) {
    ExpectOp("(");
    while (!IsOp(")")) {
      if (Peek().kind == TokenKind::kName && IsOp("=", 1)) {
        std::string key = Next().text;
        Next();
        call->kwargs.emplace_back(std::move(key), ParseExpression());
      } else {
        if (!call->kwargs.empty()) Fail("positional argument after a keyword argument", Peek());
        call->args.push_back(ParseExpression());
      }
      if (!IsOp(",")) break;
      Next();
    }
    ExpectOp(")");
  }

  ExprPtr ParsePostfix(ExprPtr e) {
    while (true) {
      if (IsOp(".")) {
        const Location where = Next().where;
        const Token& t = Peek();
        if (t.kind == TokenKind::kName) {
          ExprPtr g = Make(Expr::Kind::kGetAttr, where);
          g->name = Next().text;
          g->args.push_back(std::move(e));
          e = std::move(g);
        } else if (t.kind == TokenKind::kInt) {
          ExprPtr g = Make(Expr::Kind::kGetItem, where);
          g->args.push_back(std::move(e));
          ExprPtr idx = Make(Expr::Kind::kLiteral, t.where);
          idx->literal = Value(Next().int_value);
          g->args.push_back(std::move(idx));
          e = std::move(g);
        } else {
          Fail("expected an attribute name after '.', got " + Describe(t), t);
        }
      } else if (IsOp("[")) {
        const Location where = Next().where;
        ExprPtr parts[3];
        int n = 0;
        bool is_slice = false;
        while (true) {
          if (IsOp(":")) {
            is_slice = true;
            Next();
            if (++n > 2) Fail("too many ':' in a slice", Peek());
            continue;
          }
          if (IsOp("]")) break;
          if (parts[n]) Fail("expected ':' or ']', got " + Describe(Peek()), Peek());
          parts[n] = ParseExpression();
        }
        ExpectOp("]");
        if (is_slice) {
          ExprPtr s = Make(Expr::Kind::kSlice, where);
          s->args.push_back(std::move(e));
          for (auto& p : parts) s->args.push_back(std::move(p));
          e = std::move(s);
        } else {
          if (!parts[0]) Fail("empty subscript", Peek());
          ExprPtr g = Make(Expr::Kind::kGetItem, where);
          g->args.push_back(std::move(e));
          g->args.push_back(std::move(parts[0]));
          e = std::move(g);
        }
      } else if (IsOp("(")) {
        ExprPtr c = Make(Expr::Kind::kCall, Peek().where);
        c->args.push_back(std::move(e));
        ParseCallArgs(c.get());
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  ExprPtr ParseFilterExpr(ExprPtr e) {
    while (true) {
      if (IsOp("|")) {
        Next();
        const Token& name = Peek();
        ExprPtr f = Make(Expr::Kind::kFilter, name.where);
        f->name = ExpectName("a filter name");
        f->args.push_back(std::move(e));
        if (IsOp("(")) ParseCallArgs(f.get());
        e = std::move(f);
      } else if (IsName("is")) {
        Next();
        ExprPtr t = Make(Expr::Kind::kTest, Peek().where);
        if (IsName("not")) {
          Next();
          t->negated = true;
        }
        if (Peek().kind == TokenKind::kName) {
          t->name = Next().text;
        } else if (Peek().kind == TokenKind::kOp &&
                   (Peek().text == "==" || Peek().text == "!=" || Peek().text == "<" || Peek().text == "<=" ||
                    Peek().text == ">" || Peek().text == ">=")) {
          t->name = Next().text;
        } else {
          Fail("expected a test name, got " + Describe(Peek()), Peek());
        }
        t->args.push_back(std::move(e));
        const Token& n = Peek();
        if (IsOp("(")) {
          ParseCallArgs(t.get());
        } else if ((n.kind == TokenKind::kName || n.kind == TokenKind::kString || n.kind == TokenKind::kInt ||
                    n.kind == TokenKind::kFloat || IsOp("[") || IsOp("{")) &&
                   !(IsName("else") || IsName("or") || IsName("and") || IsName("if"))) {
          t->args.push_back(ParsePostfix(ParsePrimary()));
        }
        e = std::move(t);
      } else if (IsOp("(")) {
        ExprPtr c = Make(Expr::Kind::kCall, Peek().where);
        c->args.push_back(std::move(e));
        ParseCallArgs(c.get());
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int depth_ = 0;
};

}  // namespace

absl::StatusOr<std::shared_ptr<const Template>> Parse(std::string_view source) {
  try {
    return Parser(LexOrThrow(source)).Run();
  } catch (const TemplateError& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("chat template line ", e.where().line, ", column ", e.where().column, ": ", e.message()));
  }
}

}  // namespace shardserve::chat
