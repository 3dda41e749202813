#include "coordinator/chat/render.h"

#include <ctime>
#include <memory>
#include <new>
#include <stdexcept>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "coordinator/chat/filters.h"

namespace shardserve::chat {
namespace {

[[noreturn]] void Fail(const std::string& message, Location where) { throw TemplateError(message, where); }

struct Scope {
  std::unordered_map<std::string, Value> vars;
  std::shared_ptr<Scope> parent;

  const Value* Find(const std::string& name) const {
    for (const Scope* s = this; s != nullptr; s = s->parent.get()) {
      auto it = s->vars.find(name);
      if (it != s->vars.end()) return &it->second;
    }
    return nullptr;
  }
};
using ScopePtr = std::shared_ptr<Scope>;

ScopePtr Child(const ScopePtr& parent) {
  auto s = std::make_shared<Scope>();
  s->parent = parent;
  return s;
}

bool Compare(const std::string& op, const Value& a, const Value& b, Location where) {
  if (op == "==") return Equals(a, b);
  if (op == "!=") return !Equals(a, b);
  if (op == "<") return Less(a, b, where);
  if (op == ">") return Less(b, a, where);
  if (op == "<=") return !Less(b, a, where);
  if (op == ">=") return !Less(a, b, where);
  if (op == "in") return BinaryOp("in", a, b, where).Truthy();
  return !BinaryOp("in", a, b, where).Truthy();  // not in
}

enum class Flow { kNormal, kBreak, kContinue };

class Renderer {
 public:
  explicit Renderer(BudgetTracker* budget) : budget_(budget) {}

  Flow Exec(const Body& body, const ScopePtr& scope, std::string* out) {
    for (const StmtPtr& s : body) {
      const Flow f = Exec(*s, scope, out);
      if (f != Flow::kNormal) return f;
    }
    return Flow::kNormal;
  }

  int loop_depth = 0;

 private:
  Flow Exec(const Stmt& s, const ScopePtr& scope, std::string* out) {
    budget_->At(s.where);
    budget_->Tick();
    switch (s.kind) {
      case Stmt::Kind::kText: Append(s.text, s.where, out); return Flow::kNormal;
      case Stmt::Kind::kOutput: Append(Eval(*s.expr, scope).Str(), s.where, out); return Flow::kNormal;
      case Stmt::Kind::kIf:
        for (const auto& [cond, body] : s.branches) {
          if (Eval(*cond, scope).Truthy()) return Exec(body, scope, out);
        }
        return Exec(s.else_body, scope, out);
      case Stmt::Kind::kFor: return ExecFor(s, scope, out);
      case Stmt::Kind::kSet: {
        Value v;
        if (s.block_set) {
          std::string captured;
          Exec(s.body, scope, &captured);
          v = Value(std::move(captured));
        } else {
          v = Eval(*s.expr, scope);
        }
        if (!s.attr.empty()) {
          const Value* target = scope->Find(s.targets[0]);
          if (target == nullptr || !target->is_dict() || !target->AsDict().is_namespace) {
            Fail("cannot assign attribute on non-namespace object '" + s.targets[0] + "'", s.where);
          }
          target->AsDict().Set(Value(s.attr), std::move(v));
        } else {
          Assign(s.targets, v, *scope, s.where);
        }
        return Flow::kNormal;
      }
      case Stmt::Kind::kMacro: {
        // The macro holds its scope weakly: the scope holds the macro, and a strong pointer both
        // ways would be a cycle that outlives the render.
        const Stmt* macro = &s;
        std::weak_ptr<Scope> defined_in = scope;
        scope->vars[s.name] = Value::Func(s.name, [this, macro, defined_in](CallArgs& args) {
          ScopePtr home = defined_in.lock();
          if (home == nullptr) Fail("macro '" + macro->name + "' called outside the scope that defined it", args.where);
          return CallMacro(*macro, home, args);
        });
        return Flow::kNormal;
      }
      case Stmt::Kind::kBreak:
      case Stmt::Kind::kContinue:
        if (loop_depth == 0) Fail("'break' and 'continue' must be inside a loop", s.where);
        return s.kind == Stmt::Kind::kBreak ? Flow::kBreak : Flow::kContinue;
      case Stmt::Kind::kBlock: return Exec(s.body, scope, out);
    }
    return Flow::kNormal;
  }

  // The output (or a block's capture) grows: charged to the byte budget before it does.
  void Append(const std::string& text, Location where, std::string* out) {
    budget_->ChargeBytes(static_cast<int64_t>(text.size()), where);
    *out += text;
  }

  void Step(Location where) { budget_->Iteration(where); }

  static void Assign(const std::vector<std::string>& targets, const Value& v, Scope& scope, Location where) {
    if (targets.size() == 1) {
      scope.vars[targets[0]] = v;
      return;
    }
    std::vector<Value> items = Iterate(v, where);
    if (items.size() != targets.size()) {
      Fail(absl::StrCat("cannot unpack ", items.size(), " values into ", targets.size(), " names"), where);
    }
    for (size_t i = 0; i < targets.size(); ++i) scope.vars[targets[i]] = items[i];
  }

  Flow ExecFor(const Stmt& s, const ScopePtr& scope, std::string* out) {
    std::vector<Value> all = Iterate(Eval(*s.expr, scope), s.expr->where);
    std::vector<Value> items;
    if (s.cond) {  // the `if` filter runs before the loop, so loop.length counts what passes
      for (const Value& item : all) {
        Step(s.where);
        ScopePtr probe = Child(scope);
        Assign(s.targets, item, *probe, s.where);
        if (Eval(*s.cond, probe).Truthy()) items.push_back(item);
      }
    } else {
      items = std::move(all);
    }
    if (items.empty()) return Exec(s.else_body, scope, out);
    const int64_t n = static_cast<int64_t>(items.size());
    // One loop object for the whole loop, advanced each iteration, as jinja2's LoopContext.
    auto index = std::make_shared<int64_t>(0);
    Dict fields;
    for (const char* key : {"index", "index0", "revindex", "revindex0", "first", "last", "length", "depth", "depth0",
                            "previtem", "nextitem"}) {
      fields.items.emplace_back(Value(key), Value());
    }
    fields.items.emplace_back(Value("cycle"), Value::Func("loop.cycle", [index](CallArgs& args) {
                                if (args.positional.empty()) Fail("no items for cycling given", args.where);
                                return args.positional[static_cast<size_t>(*index) % args.positional.size()];
                              }));
    const Value loop = Value::MakeDict(std::move(fields));
    auto& f = loop.AsDict().items;
    ++loop_depth;
    for (int64_t i = 0; i < n; ++i) {
      Step(s.where);
      *index = i;
      f[0].second = Value(i + 1);
      f[1].second = Value(i);
      f[2].second = Value(n - i);
      f[3].second = Value(n - i - 1);
      f[4].second = Value(i == 0);
      f[5].second = Value(i == n - 1);
      f[6].second = Value(n);
      f[7].second = Value(int64_t{1});
      f[8].second = Value(int64_t{0});
      f[9].second = i > 0 ? items[static_cast<size_t>(i - 1)] : Value::Undefined("loop.previtem");
      f[10].second = i + 1 < n ? items[static_cast<size_t>(i + 1)] : Value::Undefined("loop.nextitem");
      ScopePtr iter = Child(scope);
      Assign(s.targets, items[static_cast<size_t>(i)], *iter, s.where);
      iter->vars["loop"] = loop;
      const Flow f = Exec(s.body, iter, out);
      if (f == Flow::kBreak) break;
    }
    --loop_depth;
    return Flow::kNormal;
  }

  Value CallMacro(const Stmt& macro, const ScopePtr& defined_in, CallArgs& args) {
    Step(args.where);
    budget_->Enter(args.where);  // each call is a level of C++ recursion: bounded before the stack is
    ScopePtr scope = Child(defined_in);
    for (size_t i = 0; i < macro.targets.size(); ++i) {
      const Value* given = args.Get(i, macro.targets[i]);
      if (given != nullptr) {
        scope->vars[macro.targets[i]] = *given;
      } else if (macro.defaults[i]) {
        scope->vars[macro.targets[i]] = Eval(*macro.defaults[i], scope);
      } else {
        scope->vars[macro.targets[i]] = Value::Undefined("'" + macro.targets[i] + "'");
      }
    }
    if (args.positional.size() > macro.targets.size()) {
      Fail(absl::StrCat("macro '", macro.name, "' takes ", macro.targets.size(), " arguments, got ",
                        args.positional.size()),
           args.where);
    }
    std::string out;
    const int saved_loop_depth = loop_depth;
    loop_depth = 0;
    Exec(macro.body, scope, &out);
    loop_depth = saved_loop_depth;
    budget_->Leave();
    return Value(std::move(out));
  }

  CallArgs EvalArgs(const Expr& e, size_t first, const ScopePtr& scope) {
    CallArgs args;
    args.where = e.where;
    for (size_t i = first; i < e.args.size(); ++i) args.positional.push_back(Eval(*e.args[i], scope));
    for (const auto& [k, v] : e.kwargs) args.kwargs.emplace_back(k, Eval(*v, scope));
    return args;
  }

  Value Eval(const Expr& e, const ScopePtr& scope) {
    budget_->At(e.where);
    budget_->Tick();
    switch (e.kind) {
      case Expr::Kind::kLiteral: return e.literal;
      case Expr::Kind::kName: {
        const Value* v = scope->Find(e.name);
        return v != nullptr ? *v : Value::Undefined("'" + e.name + "'");
      }
      case Expr::Kind::kList:
      case Expr::Kind::kTuple: {
        std::vector<Value> items;
        for (const ExprPtr& a : e.args) items.push_back(Eval(*a, scope));
        return e.kind == Expr::Kind::kTuple ? Value::Tuple(std::move(items)) : Value::List(std::move(items));
      }
      case Expr::Kind::kDict: {
        Dict d;
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) d.Set(Eval(*e.args[i], scope), Eval(*e.args[i + 1], scope));
        return Value::MakeDict(std::move(d));
      }
      case Expr::Kind::kGetAttr: return GetAttr(Eval(*e.args[0], scope), e.name, e.where);
      case Expr::Kind::kGetItem: return GetItem(Eval(*e.args[0], scope), Eval(*e.args[1], scope), e.where);
      case Expr::Kind::kSlice: {
        const Value obj = Eval(*e.args[0], scope);
        Value parts[3];
        const Value* p[3] = {nullptr, nullptr, nullptr};
        for (int i = 0; i < 3; ++i) {
          if (e.args[1 + i]) {
            parts[i] = Eval(*e.args[1 + i], scope);
            p[i] = &parts[i];
          }
        }
        return Slice(obj, p[0], p[1], p[2], e.where);
      }
      case Expr::Kind::kCall: {
        const Value callee = Eval(*e.args[0], scope);
        CallArgs args = EvalArgs(e, 1, scope);
        if (callee.is_undefined()) {
          Fail((callee.undefined_hint().empty() ? std::string("value") : callee.undefined_hint()) + " is undefined",
               e.where);
        }
        if (!callee.is_function()) Fail("'" + callee.TypeName() + "' object is not callable", e.where);
        budget_->At(e.where);
        return callee.AsFunction()(args);
      }
      case Expr::Kind::kFilter: {
        const Value input = Eval(*e.args[0], scope);
        CallArgs args = EvalArgs(e, 1, scope);
        budget_->At(e.where);
        return ApplyFilter(e.name, input, args);
      }
      case Expr::Kind::kTest: {
        const Value input = Eval(*e.args[0], scope);
        CallArgs args = EvalArgs(e, 1, scope);
        return Value(ApplyTest(e.name, input, args) != e.negated);
      }
      case Expr::Kind::kUnary: {
        const Value v = Eval(*e.args[0], scope);
        if (e.name == "not") return Value(!v.Truthy());
        if (v.is_undefined()) Fail(v.undefined_hint() + " is undefined", e.where);
        if (!v.is_number()) Fail("bad operand type for unary " + e.name + ": '" + v.TypeName() + "'", e.where);
        if (e.name == "+") return v.is_float() ? Value(v.AsDouble()) : Value(v.AsInt());
        return v.is_float() ? Value(-v.AsDouble()) : Value(-v.AsInt());
      }
      case Expr::Kind::kBinary: {
        if (e.name == "and" || e.name == "or") {  // Python: the deciding operand itself
          Value a = Eval(*e.args[0], scope);
          if (a.Truthy() == (e.name == "or")) return a;
          return Eval(*e.args[1], scope);
        }
        Value a = Eval(*e.args[0], scope);
        Value b = Eval(*e.args[1], scope);
        budget_->At(e.where);
        return BinaryOp(e.name, a, b, e.where);
      }
      case Expr::Kind::kCompare: {  // a < b < c is a < b and b < c, each operand evaluated once
        Value left = Eval(*e.args[0], scope);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = Eval(*e.args[i + 1], scope);
          if (!Compare(e.ops[i], left, right, e.where)) return Value(false);
          left = std::move(right);
        }
        return Value(true);
      }
      case Expr::Kind::kCondExpr:
        if (Eval(*e.args[1], scope).Truthy()) return Eval(*e.args[0], scope);
        return e.args[2] ? Eval(*e.args[2], scope) : Value::Undefined("the else branch of a conditional expression");
    }
    return Value::Undefined();
  }

  BudgetTracker* budget_;  // the render's; charged by everything the template does
};

Value MakeNamespace(CallArgs& args) {
  Dict d;
  d.is_namespace = true;
  for (const Value& p : args.positional) {
    if (!p.is_dict()) Fail("namespace() takes a mapping or keyword arguments", args.where);
    for (const auto& [k, v] : p.AsDict().items) d.Set(k, v);
  }
  for (const auto& [k, v] : args.kwargs) d.Set(Value(k), v);
  return Value::MakeDict(std::move(d));
}

ScopePtr Globals() {
  auto g = std::make_shared<Scope>();
  g->vars["raise_exception"] = Value::Func("raise_exception", [](CallArgs& args) -> Value {
    const Value* msg = args.Get(0, "message");
    throw TemplateError(msg ? msg->Str() : "", args.where, /*raised=*/true);
  });
  g->vars["strftime_now"] = Value::Func("strftime_now", [](CallArgs& args) -> Value {
    const Value* fmt = args.Get(0, "format");
    if (fmt == nullptr || !fmt->is_string()) Fail("strftime_now() needs a format string", args.where);
    const std::time_t now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    char buf[256];
    const size_t n = std::strftime(buf, sizeof(buf), fmt->AsString().c_str(), &local);
    return Value(std::string(buf, n));
  });
  g->vars["namespace"] = Value::Func("namespace", [](CallArgs& args) { return MakeNamespace(args); });
  g->vars["dict"] = Value::Func("dict", [](CallArgs& args) {
    Dict d;
    for (const auto& [k, v] : args.kwargs) d.Set(Value(k), v);
    return Value::MakeDict(std::move(d));
  });
  g->vars["range"] = Value::Func("range", [](CallArgs& args) {
    int64_t start = 0, stop = 0, step = 1;
    auto num = [&](size_t i) {
      const Value& v = args.positional[i];
      if (!v.is_int() && !v.is_bool()) Fail("range() needs integers, not " + v.TypeName(), args.where);
      return v.AsInt();
    };
    if (args.positional.size() == 1) {
      stop = num(0);
    } else if (args.positional.size() >= 2) {
      start = num(0);
      stop = num(1);
      if (args.positional.size() >= 3) step = num(2);
    } else {
      Fail("range expected at least 1 argument", args.where);
    }
    if (step == 0) Fail("range() arg 3 must not be zero", args.where);
    // Its length first, as Python's (overflow-safe), and charged before anything is allocated.
    const __int128 span = step > 0 ? static_cast<__int128>(stop) - start : static_cast<__int128>(start) - stop;
    const __int128 stride = step > 0 ? static_cast<__int128>(step) : -static_cast<__int128>(step);
    const __int128 length = span <= 0 ? 0 : (span - 1) / stride + 1;
    if (BudgetTracker* budget = BudgetTracker::Current()) {
      budget->CheckElements(length > INT64_MAX - 1 ? INT64_MAX : static_cast<int64_t>(length) + 1, args.where);
    }
    std::vector<Value> items;
    items.reserve(static_cast<size_t>(length));
    for (__int128 i = 0, v = start; i < length; ++i, v += step) items.emplace_back(static_cast<int64_t>(v));
    return Value::List(std::move(items));
  });
  return g;
}

}  // namespace

absl::StatusOr<std::string> Render(const Template& tmpl, const Value& context, const RenderBudget& budget) {
  // Declared first, so destroyed last: after the scopes, it empties every list and dict the render
  // made, which frees reference cycles (a namespace holding itself, a macro in its own scope).
  BudgetTracker tracker(budget);
  ScopePtr globals = Globals();
  ScopePtr root = Child(globals);
  if (context.is_dict()) {
    for (const auto& [k, v] : context.AsDict().items) root->vars[k.Str()] = v;
  }
  std::string out;
  try {
    Renderer r(&tracker);
    r.Exec(tmpl.body, root, &out);
  } catch (const TemplateError& e) {
    if (e.raised()) {
      return absl::InvalidArgumentError(absl::StrCat(e.message(), " (raised by the chat template at line ",
                                                     e.where().line, ", column ", e.where().column, ")"));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("chat template line ", e.where().line, ", column ", e.where().column, ": ", e.message()));
  } catch (const BudgetError& e) {
    return absl::Status(e.code(),
                        absl::StrCat(e.message(), " (line ", e.where().line, ", column ", e.where().column, ")"));
  } catch (const std::bad_alloc&) {
    // The budgets keep a render far below any machine's memory; this is the last line of defence.
    return absl::ResourceExhaustedError(absl::StrCat("the chat template ran out of memory (near line ",
                                                     tracker.where().line, ", column ", tracker.where().column, ")"));
  } catch (const std::length_error&) {
    return absl::ResourceExhaustedError(absl::StrCat("the chat template built a value too large (near line ",
                                                     tracker.where().line, ", column ", tracker.where().column, ")"));
  }
  return out;
}

}  // namespace shardserve::chat
