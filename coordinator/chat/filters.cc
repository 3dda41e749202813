// Python semantics, as jinja2 running in transformers' ImmutableSandboxedEnvironment shows them.
#include "coordinator/chat/filters.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <iterator>

#include "coordinator/chat/budget.h"
#include "coordinator/chat/methods.h"
#include "coordinator/chat/py_str.h"

namespace shardserve::chat {

// --- tests ---

bool ApplyTest(const std::string& name, const Value& v, CallArgs& args) {
  const Location where = args.where;
  auto arg = [&](size_t i) -> const Value& {
    if (i >= args.positional.size()) throw TemplateError("test '" + name + "' needs an argument", where);
    return args.positional[i];
  };
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "boolean") return v.is_bool();
  if (name == "false") return v.is_bool() && !v.AsInt();
  if (name == "true") return v.is_bool() && v.AsInt();
  if (name == "integer") return v.is_int();
  if (name == "float") return v.is_float();
  if (name == "number") return v.is_number();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.is_dict();
  if (name == "iterable") return v.is_string() || v.is_list() || v.is_dict() || v.is_undefined();
  if (name == "sequence") return v.is_string() || v.is_list() || v.is_dict() || v.is_undefined();
  if (name == "callable") return v.is_function();
  if (name == "escaped") return false;
  // Python's `is`: exact for None, booleans and undefined; for other values, equal and of one kind.
  if (name == "sameas") return v.kind() == arg(0).kind() && Equals(v, arg(0));
  if (name == "equalto" || name == "eq" || name == "==") return Equals(v, arg(0));
  if (name == "ne" || name == "!=") return !Equals(v, arg(0));
  if (name == "lt" || name == "<") return Less(v, arg(0), where);
  if (name == "le" || name == "<=") return !Less(arg(0), v, where);
  if (name == "gt" || name == ">") return Less(arg(0), v, where);
  if (name == "ge" || name == ">=") return !Less(v, arg(0), where);
  if (name == "in") return BinaryOp("in", v, arg(0), where).Truthy();
  if (name == "odd" || name == "even" || name == "divisibleby") {
    if (!v.is_int() && !v.is_bool()) throw TemplateError("test '" + name + "' needs an integer, not " + v.TypeName(), where);
    if (name == "odd") return PyMod(v.AsInt(), 2) == 1;
    if (name == "even") return PyMod(v.AsInt(), 2) == 0;
    const int64_t d = ToIndex(arg(0), where);
    if (d == 0) throw TemplateError("integer division or modulo by zero", where);
    return PyMod(v.AsInt(), d) == 0;
  }
  if (name == "lower") return v.is_string() && Lower(v.AsString()) == v.AsString();
  if (name == "upper") return v.is_string() && Upper(v.AsString()) == v.AsString();
  throw TemplateError("no test named '" + name + "'", where);
}

// --- filters ---

namespace {

// Resolves a dotted attribute path ("function.name") on `v`, as jinja2's make_attrgetter does.
Value AttrPath(const Value& v, const Value& path, Location where) {
  if (path.is_int()) return GetItem(v, path, where);
  Value cur = v;
  const std::string p = path.Str();
  size_t b = 0;
  while (true) {
    const size_t dot = p.find('.', b);
    const std::string part = p.substr(b, dot == std::string::npos ? std::string::npos : dot - b);
    cur = GetItem(cur, Value(part), where);
    if (dot == std::string::npos) return cur;
    if (cur.is_undefined()) return cur;
    b = dot + 1;
  }
}

CallArgs Rest(const CallArgs& args, size_t from) {
  CallArgs rest;
  rest.where = args.where;
  for (size_t i = from; i < args.positional.size(); ++i) rest.positional.push_back(args.positional[i]);
  return rest;
}

int64_t Length(const Value& v, Location where) {
  if (v.is_string()) return static_cast<int64_t>(Decode(v.AsString()).size());
  if (v.is_list()) return static_cast<int64_t>(v.AsList().size());
  if (v.is_dict()) return static_cast<int64_t>(v.AsDict().items.size());
  if (v.is_undefined()) return 0;
  throw TemplateError("object of type '" + v.TypeName() + "' has no len()", where);
}

// One filter each. `name` is the name the template used, for the filters that share a function
// (first/last, select/reject/selectattr/rejectattr, sort/unique/min/max/dictsort) and for messages.

Value DefaultFilter(const std::string&, const Value& v, CallArgs& args) {
  const Value* dflt = args.Get(0, "default_value");
  const Value* boolean = args.Get(1, "boolean");
  const bool use = v.is_undefined() || (boolean != nullptr && boolean->Truthy() && !v.Truthy());
  return use ? (dflt ? *dflt : Value("")) : v;
}

Value SafeFilter(const std::string&, const Value& v, CallArgs&) { return v; }

Value StringFilter(const std::string&, const Value& v, CallArgs&) { return Value(v.Str()); }

Value LengthFilter(const std::string&, const Value& v, CallArgs& args) { return Value(Length(v, args.where)); }

// json.dumps with ASCII escapes for every non-ASCII code point (ensure_ascii=True): safe on JSON
// text, whose non-ASCII bytes are all inside strings.
std::string EscapeNonAscii(const std::string& json) {
  std::string ascii;
  for (uint32_t cp : Decode(json)) {
    if (cp < 0x80) { ascii.push_back(static_cast<char>(cp)); continue; }
    char buf[16];
    if (cp >= 0x10000) {
      const uint32_t x = cp - 0x10000;
      std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", 0xD800 + (x >> 10), 0xDC00 + (x & 0x3FF));
    } else {
      std::snprintf(buf, sizeof(buf), "\\u%04x", cp);
    }
    ascii += buf;
  }
  return ascii;
}

Value TojsonFilter(const std::string&, const Value& v, CallArgs& args) {
  const Location where = args.where;
  const Value* indent = args.Get(1, "indent");
  const Value* separators = args.Get(2, "separators");
  const Value* sort_keys = args.Get(3, "sort_keys");
  const Value* ensure_ascii = args.Get(0, "ensure_ascii");
  const int ind = (indent == nullptr || indent->is_none())
                      ? -1
                      : static_cast<int>(std::min<int64_t>(ToIndex(*indent, where), INT32_MAX));
  std::string item_sep = ind >= 0 ? "," : ", ", key_sep = ": ";
  if (separators != nullptr && separators->is_list() && separators->AsList().size() == 2) {
    item_sep = separators->AsList()[0].Str();
    key_sep = separators->AsList()[1].Str();
  }
  std::string out = v.ToJson(ind, item_sep, key_sep, sort_keys != nullptr && sort_keys->Truthy(), where);
  if (ensure_ascii != nullptr && ensure_ascii->Truthy()) return Value(EscapeNonAscii(out));
  return Value(std::move(out));
}

Value ItemsFilter(const std::string&, const Value& v, CallArgs& args) {
  if (v.is_undefined()) return Value::List();
  if (!v.is_dict()) throw TemplateError("Can only get item pairs from a mapping.", args.where);
  return *CallMethod(v, "items", args);
}

Value ListFilter(const std::string&, const Value& v, CallArgs& args) { return Value::List(Iterate(v, args.where)); }

// first, last.
Value FirstLastFilter(const std::string& name, const Value& v, CallArgs& args) {
  std::vector<Value> items = Iterate(v, args.where);
  if (items.empty()) return Value::Undefined("No " + name + " item, sequence was empty.");
  return name == "first" ? items.front() : items.back();
}

Value ReverseFilter(const std::string&, const Value& v, CallArgs& args) {
  if (v.is_string()) {
    std::vector<uint32_t> cps = Decode(v.AsString());
    std::reverse(cps.begin(), cps.end());
    return Value(Encode(cps, 0, cps.size()));
  }
  std::vector<Value> items = Iterate(v, args.where);
  std::reverse(items.begin(), items.end());
  return Value::List(std::move(items));
}

Value JoinFilter(const std::string&, const Value& v, CallArgs& args) {
  const Location where = args.where;
  const Value* sep = args.Get(0, "d");
  const Value* attribute = args.Get(1, "attribute");
  std::string out;
  bool first = true;
  const std::string separator = sep ? sep->Str() : "";
  for (const Value& item : Iterate(v, where)) {
    const std::string piece = (attribute ? AttrPath(item, *attribute, where) : item).Str();
    CheckGrowth(out, (first ? 0 : separator.size()) + piece.size(), &where);  // [big] * n joins to n times big
    if (!first) out += separator;
    out += piece;
    first = false;
  }
  return Value(std::move(out));
}

Value AttrFilter(const std::string&, const Value& v, CallArgs& args) {
  const Value* a = args.Get(0, "name");
  return a ? GetAttr(v, a->Str(), args.where) : Value::Undefined();
}

Value TrimFilter(const std::string&, const Value& v, CallArgs& args) {
  return Value(Strip(v.Str(), args.Get(0, "chars"), true, true));
}
Value UpperFilter(const std::string&, const Value& v, CallArgs&) { return Value(Upper(v.Str())); }
Value LowerFilter(const std::string&, const Value& v, CallArgs&) { return Value(Lower(v.Str())); }
Value TitleFilter(const std::string&, const Value& v, CallArgs&) { return Value(JinjaTitle(v.Str())); }
Value CapitalizeFilter(const std::string&, const Value& v, CallArgs&) { return Value(Capitalize(v.Str())); }
Value WordcountFilter(const std::string&, const Value& v, CallArgs&) {
  return Value(static_cast<int64_t>(Split(v.Str(), nullptr, -1).size()));
}

Value ReplaceFilter(const std::string&, const Value& v, CallArgs& args) {
  const Value* old_s = args.Get(0, "old");
  const Value* new_s = args.Get(1, "new");
  const Value* count = args.Get(2, "count");
  if (old_s == nullptr || new_s == nullptr) throw TemplateError("replace needs two arguments", args.where);
  return Value(Replace(v.Str(), old_s->Str(), new_s->Str(), count && !count->is_none() ? ToIndex(*count, args.where) : -1));
}

Value EscapeFilter(const std::string&, const Value& v, CallArgs&) {
  std::string out;
  for (char c : v.Str()) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out.push_back(c);
    }
  }
  return Value(std::move(out));
}

Value IndentFilter(const std::string&, const Value& v, CallArgs& args) {
  const Location where = args.where;
  const Value* width = args.Get(0, "width");
  const Value* first = args.Get(1, "first");
  const Value* blank = args.Get(2, "blank");
  const int64_t spaces = width != nullptr && !width->is_string() ? std::max<int64_t>(0, ToIndex(*width, where)) : 0;
  CheckBytes(spaces, &where);
  const std::string pad = width == nullptr ? "    " : width->is_string() ? width->AsString()
                                                                       : std::string(static_cast<size_t>(spaces), ' ');
  const std::string s = v.Str();
  std::vector<std::string> lines;
  size_t b = 0;
  for (size_t i = 0; i <= s.size(); ++i) {
    if (i == s.size() || s[i] == '\n') {
      lines.push_back(s.substr(b, i - b));
      b = i + 1;
    }
  }
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i > 0) out += "\n";
    const bool indent_it = (i > 0 || (first && first->Truthy())) &&
                            (!lines[i].empty() || (blank && blank->Truthy()));
    CheckGrowth(out, 1 + (indent_it ? pad.size() : 0) + lines[i].size(), &where);  // a wide pad on many lines
    out += (indent_it ? pad : "") + lines[i];
  }
  return Value(std::move(out));
}

Value IntFilter(const std::string&, const Value& v, CallArgs& args) {
  const Value* dflt = args.Get(0, "default");
  if (v.is_int() || v.is_bool()) return Value(v.AsInt());
  if (v.is_float()) return Value(static_cast<int64_t>(v.AsDouble()));
  if (v.is_string()) {
    const std::string s = Strip(v.AsString(), nullptr, true, true);
    int64_t out = 0;
    auto [ptr, ec] = std::from_chars(s.data() + (!s.empty() && s[0] == '+'), s.data() + s.size(), out);
    if (ec == std::errc() && ptr == s.data() + s.size() && !s.empty()) return Value(out);
    char* end = nullptr;
    const double d = std::strtod(s.c_str(), &end);
    if (!s.empty() && end == s.c_str() + s.size()) return Value(static_cast<int64_t>(d));
  }
  return dflt ? *dflt : Value(int64_t{0});
}

Value FloatFilter(const std::string&, const Value& v, CallArgs& args) {
  const Value* dflt = args.Get(0, "default");
  if (v.is_number()) return Value(v.AsDouble());
  if (v.is_string()) {
    const std::string s = Strip(v.AsString(), nullptr, true, true);
    char* end = nullptr;
    const double d = std::strtod(s.c_str(), &end);
    if (!s.empty() && end == s.c_str() + s.size()) return Value(d);
  }
  return dflt ? *dflt : Value(0.0);
}

Value AbsFilter(const std::string&, const Value& v, CallArgs& args) {
  if (v.is_float()) return Value(std::fabs(v.AsDouble()));
  if (v.is_int() || v.is_bool()) return Value(v.AsInt() < 0 ? -v.AsInt() : v.AsInt());
  throw TemplateError("bad operand type for abs(): '" + v.TypeName() + "'", args.where);
}

Value RoundFilter(const std::string&, const Value& v, CallArgs& args) {
  const Value* precision = args.Get(0, "precision");
  const Value* method = args.Get(1, "method");
  const int64_t p = precision ? ToIndex(*precision, args.where) : 0;
  const double scale = std::pow(10.0, static_cast<double>(p));
  const std::string m = method ? method->Str() : "common";
  double x = v.AsDouble() * scale;
  x = m == "ceil" ? std::ceil(x) : m == "floor" ? std::floor(x) : std::round(x);
  return Value(x / scale);
}

// select, reject (by a test of the item), selectattr, rejectattr (by a test of an attribute).
Value SelectFilter(const std::string& name, const Value& v, CallArgs& args) {
  const Location where = args.where;
  const bool by_attr = name == "selectattr" || name == "rejectattr";
  const bool keep_if = name == "select" || name == "selectattr";
  const size_t test_at = by_attr ? 1 : 0;
  std::vector<Value> out;
  for (const Value& item : Iterate(v, where)) {
    const Value subject = by_attr ? AttrPath(item, args.positional.empty() ? Value("") : args.positional[0], where) : item;
    bool passed;
    if (args.positional.size() <= test_at) {
      passed = subject.Truthy();
    } else {
      CallArgs test_args = Rest(args, test_at + 1);
      passed = ApplyTest(args.positional[test_at].Str(), subject, test_args);
    }
    if (passed == keep_if) out.push_back(item);
  }
  return Value::List(std::move(out));
}

Value MapFilter(const std::string&, const Value& v, CallArgs& args) {
  const Location where = args.where;
  const Value* attribute = nullptr;
  const Value* dflt = nullptr;
  for (const auto& [k, val] : args.kwargs) {
    if (k == "attribute") attribute = &val;
    if (k == "default") dflt = &val;
  }
  std::vector<Value> out;
  for (const Value& item : Iterate(v, where)) {
    if (attribute != nullptr) {
      Value got = AttrPath(item, *attribute, where);
      out.push_back(got.is_undefined() && dflt ? *dflt : got);
    } else {
      if (args.positional.empty()) throw TemplateError("map requires a filter argument", where);
      CallArgs filter_args = Rest(args, 1);
      out.push_back(ApplyFilter(args.positional[0].Str(), item, filter_args));
    }
  }
  return Value::List(std::move(out));
}

// sort, unique, min, max, dictsort: the filters that compare items by a key.
Value SortFilter(const std::string& name, const Value& v, CallArgs& args) {
  const Location where = args.where;
  const Value* attribute = nullptr;
  bool reverse = false, case_sensitive = false;
  for (const auto& [k, val] : args.kwargs) {
    if (k == "attribute") attribute = &val;
    if (k == "reverse") reverse = val.Truthy();
    if (k == "case_sensitive") case_sensitive = val.Truthy();
  }
  if (name == "sort") {
    if (args.positional.size() > 0) reverse = args.positional[0].Truthy();
    if (args.positional.size() > 1) case_sensitive = args.positional[1].Truthy();
    if (args.positional.size() > 2) attribute = &args.positional[2];
  }
  std::vector<Value> items;
  if (name == "dictsort") {
    if (!v.is_dict()) throw TemplateError("dictsort needs a mapping", where);
    for (const auto& [k, val] : v.AsDict().items) items.push_back(Value::Tuple({k, val}));
  } else {
    items = Iterate(v, where);
  }
  auto key = [&](const Value& item) {
    Value k = name == "dictsort" ? item.AsList()[0] : attribute ? AttrPath(item, *attribute, where) : item;
    if (!case_sensitive && k.is_string()) return Value(Lower(k.AsString()));
    return k;
  };
  if (name == "unique") {
    std::vector<Value> out, seen;
    for (const Value& item : items) {
      Value k = key(item);
      if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return Equals(s, k); })) {
        seen.push_back(k);
        out.push_back(item);
      }
    }
    return Value::List(std::move(out));
  }
  std::stable_sort(items.begin(), items.end(),
                   [&](const Value& a, const Value& b) { return reverse ? Less(key(b), key(a), where) : Less(key(a), key(b), where); });
  if (name == "min" || name == "max") {
    if (items.empty()) return Value::Undefined("No aggregated item, sequence was empty.");
    return name == "min" ? items.front() : items.back();
  }
  return Value::List(std::move(items));
}

Value SumFilter(const std::string&, const Value& v, CallArgs& args) {
  const Location where = args.where;
  const Value* attribute = args.Get(0, "attribute");
  const Value* start = args.Get(1, "start");
  Value total = start ? *start : Value(int64_t{0});
  for (const Value& item : Iterate(v, where)) total = BinaryOp("+", total, attribute ? AttrPath(item, *attribute, where) : item, where);
  return total;
}

Value BatchFilter(const std::string&, const Value& v, CallArgs& args) {
  const Location where = args.where;
  const Value* size = args.Get(0, "linecount");
  if (size == nullptr) throw TemplateError("batch needs a size", where);
  const int64_t n = ToIndex(*size, where);
  if (n <= 0) throw TemplateError("batch size must be positive", where);
  std::vector<Value> out, cur;
  for (const Value& item : Iterate(v, where)) {
    cur.push_back(item);
    if (static_cast<int64_t>(cur.size()) == n) out.push_back(Value::List(std::move(cur))), cur.clear();
  }
  if (!cur.empty()) out.push_back(Value::List(std::move(cur)));
  return Value::List(std::move(out));
}

struct Filter {
  const char* name;
  Value (*apply)(const std::string& name, const Value& input, CallArgs& args);
  // jinja2 str()s the input of its string filters: for them undefined is "".
  bool string_input = false;
};

const Filter kFilters[] = {
    {"trim", TrimFilter, true},         {"tojson", TojsonFilter},
    {"length", LengthFilter},           {"count", LengthFilter},
    {"items", ItemsFilter},             {"join", JoinFilter},
    {"upper", UpperFilter, true},       {"lower", LowerFilter, true},
    {"title", TitleFilter, true},       {"capitalize", CapitalizeFilter, true},
    {"replace", ReplaceFilter, true},   {"default", DefaultFilter},
    {"d", DefaultFilter},               {"first", FirstLastFilter},
    {"last", FirstLastFilter},          {"list", ListFilter},
    {"string", StringFilter},           {"int", IntFilter},
    {"float", FloatFilter},             {"abs", AbsFilter},
    {"round", RoundFilter},             {"select", SelectFilter},
    {"reject", SelectFilter},           {"selectattr", SelectFilter},
    {"rejectattr", SelectFilter},       {"map", MapFilter},
    {"reverse", ReverseFilter},         {"sort", SortFilter},
    {"unique", SortFilter},             {"min", SortFilter},
    {"max", SortFilter},                {"sum", SumFilter},
    {"safe", SafeFilter},               {"escape", EscapeFilter},
    {"e", EscapeFilter},                {"indent", IndentFilter, true},
    {"dictsort", SortFilter},           {"wordcount", WordcountFilter, true},
    {"attr", AttrFilter},               {"batch", BatchFilter},
};

const Filter* FindFilter(const std::string& name) {
  for (const Filter& f : kFilters) {
    if (name == f.name) return &f;
  }
  return nullptr;
}

}  // namespace

Value ApplyFilter(const std::string& name, const Value& v, CallArgs& args) {
  const Filter* filter = FindFilter(name);
  if (filter == nullptr) throw TemplateError("no filter named '" + name + "'", args.where);
  if (filter->string_input && v.is_undefined()) return filter->apply(name, Value(""), args);
  return filter->apply(name, v, args);
}

}  // namespace shardserve::chat
