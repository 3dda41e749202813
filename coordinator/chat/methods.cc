// Python semantics, as jinja2 running in transformers' ImmutableSandboxedEnvironment shows them.
// Known approximation: isalpha/isdigit/isalnum look at ASCII only.
#include "coordinator/chat/methods.h"

#include <utility>

#include "coordinator/chat/budget.h"
#include "coordinator/chat/py_str.h"

namespace shardserve::chat {

namespace {

// A str method: `s` the string, `name` the method's name (one function serves a pair such as
// split/rsplit), `args` the call's arguments.
using StrMethod = Value (*)(const std::string& s, const std::string& name, CallArgs& args);
using DictMethod = Value (*)(const Dict& d, const std::string& name, CallArgs& args);

// Argument `i` (or keyword `kw`) of method `name`, which must be a str.
std::string StrArg(const std::string& name, CallArgs& args, size_t i, const char* kw) {
  const Value* v = args.Get(i, kw);
  if (v == nullptr) throw TemplateError(name + "() missing argument '" + kw + "'", args.where);
  if (!v->is_string()) throw TemplateError(name + "() argument must be str, not " + v->TypeName(), args.where);
  return v->AsString();
}

// Python's str.split and str.rsplit (sep None: runs of whitespace).
Value SplitMethod(const std::string& s, const std::string& name, CallArgs& args) {
  const Location& where = args.where;
  const Value* sep = args.Get(0, "sep");
  const Value* maxsplit = args.Get(1, "maxsplit");
  const int64_t m = maxsplit ? ToIndex(*maxsplit, where) : -1;
  if (sep != nullptr && !sep->is_none() && !sep->is_string()) throw TemplateError("must be str or None, not " + sep->TypeName(), where);
  if (sep != nullptr && sep->is_string() && sep->AsString().empty()) throw TemplateError("empty separator", where);
  if (name == "rsplit" && m >= 0) {  // split from the right: split all, then rejoin the head
    std::vector<Value> all = Split(s, sep, -1);
    if (static_cast<int64_t>(all.size()) <= m + 1 || sep == nullptr || sep->is_none()) return Value::List(all);
    const size_t head = all.size() - static_cast<size_t>(m);
    std::string joined;
    for (size_t i = 0; i < head; ++i) joined += (i ? sep->AsString() : "") + all[i].AsString();
    std::vector<Value> out{Value(joined)};
    out.insert(out.end(), all.begin() + static_cast<std::ptrdiff_t>(head), all.end());
    return Value::List(std::move(out));
  }
  return Value::List(Split(s, sep, m));
}

// str.startswith / str.endswith, with a str or a tuple of str.
Value AffixMethod(const std::string& s, const std::string& name, CallArgs& args) {
  const Value* p = args.Get(0, "prefix");
  if (p == nullptr) throw TemplateError(name + "() takes at least 1 argument", args.where);
  std::vector<Value> options = p->is_list() ? p->AsList() : std::vector<Value>{*p};
  for (const Value& o : options) {
    if (!o.is_string()) throw TemplateError(name + " first arg must be str or a tuple of str, not " + o.TypeName(), args.where);
    const std::string& x = o.AsString();
    const bool hit = x.size() <= s.size() &&
                     (name == "startswith" ? s.compare(0, x.size(), x) == 0 : s.compare(s.size() - x.size(), x.size(), x) == 0);
    if (hit) return Value(true);
  }
  return Value(false);
}

// str.find / str.rfind (code-point index, -1 if absent) and str.count.
Value FindMethod(const std::string& s, const std::string& name, CallArgs& args) {
  const std::string sub = StrArg(name, args, 0, "sub");
  if (name == "count") {
    if (sub.empty()) return Value(static_cast<int64_t>(Decode(s).size() + 1));
    int64_t c = 0;
    for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++c;
    return Value(c);
  }
  const size_t p = name == "find" ? s.find(sub) : s.rfind(sub);
  if (p == std::string::npos) return Value(int64_t{-1});
  return Value(static_cast<int64_t>(Decode(s.substr(0, p)).size()));
}

Value JoinMethod(const std::string& s, const std::string&, CallArgs& args) {
  const Value* items = args.Get(0, "iterable");
  if (items == nullptr) throw TemplateError("join() takes exactly one argument", args.where);
  std::string out;
  bool first = true;
  for (const Value& v : Iterate(*items, args.where)) {
    if (!v.is_string()) throw TemplateError("sequence item: expected str instance, " + v.TypeName() + " found", args.where);
    CheckGrowth(out, (first ? 0 : s.size()) + v.AsString().size(), &args.where);  // [big] * n joins to n times big
    out += (first ? "" : s) + v.AsString();
    first = false;
  }
  return Value(std::move(out));
}

Value SplitLinesMethod(const std::string& s, const std::string&, CallArgs& args) {
  std::vector<Value> lines;
  size_t b = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\n' || s[i] == '\r') {
      CheckElements(static_cast<int64_t>(lines.size()) + 2, &args.where);  // the lines so far, this one, the list
      lines.emplace_back(s.substr(b, i - b));
      if (s[i] == '\r' && i + 1 < s.size() && s[i + 1] == '\n') ++i;
      b = i + 1;
    }
  }
  if (b < s.size()) lines.emplace_back(s.substr(b));
  return Value::List(std::move(lines));
}

// Python's str.isX(): false for "", else whether every character passes.
template <bool (*kPred)(char)>
Value AllOf(const std::string& s, const std::string&, CallArgs&) {
  if (s.empty()) return Value(false);
  for (char c : s) if (!kPred(c)) return Value(false);
  return Value(true);
}
bool IsDigit(char c) { return c >= '0' && c <= '9'; }
bool IsAlpha(char c) { return IsAsciiAlpha(c); }
bool IsAlnum(char c) { return IsAsciiAlpha(c) || IsDigit(c); }
bool IsSpace(char c) { return IsPySpace(static_cast<unsigned char>(c)); }

const std::pair<const char*, StrMethod> kStrMethods[] = {
    {"strip", [](const std::string& s, const std::string&, CallArgs& a) { return Value(Strip(s, a.Get(0, "chars"), true, true)); }},
    {"lstrip", [](const std::string& s, const std::string&, CallArgs& a) { return Value(Strip(s, a.Get(0, "chars"), true, false)); }},
    {"rstrip", [](const std::string& s, const std::string&, CallArgs& a) { return Value(Strip(s, a.Get(0, "chars"), false, true)); }},
    {"upper", [](const std::string& s, const std::string&, CallArgs&) { return Value(Upper(s)); }},
    {"lower", [](const std::string& s, const std::string&, CallArgs&) { return Value(Lower(s)); }},
    {"title", [](const std::string& s, const std::string&, CallArgs&) { return Value(PyTitle(s)); }},
    {"capitalize", [](const std::string& s, const std::string&, CallArgs&) { return Value(Capitalize(s)); }},
    {"split", SplitMethod},
    {"rsplit", SplitMethod},
    {"startswith", AffixMethod},
    {"endswith", AffixMethod},
    {"replace",
     [](const std::string& s, const std::string& name, CallArgs& a) {
       const Value* count = a.Get(2, "count");
       return Value(Replace(s, StrArg(name, a, 0, "old"), StrArg(name, a, 1, "new"), count ? ToIndex(*count, a.where) : -1));
     }},
    {"find", FindMethod},
    {"rfind", FindMethod},
    {"count", FindMethod},
    {"join", JoinMethod},
    {"splitlines", SplitLinesMethod},
    {"isdigit", AllOf<IsDigit>},
    {"isalpha", AllOf<IsAlpha>},
    {"isalnum", AllOf<IsAlnum>},
    {"isspace", AllOf<IsSpace>},
    {"isupper", [](const std::string& s, const std::string&, CallArgs&) { return Value(Upper(s) == s && Lower(s) != s); }},
    {"islower", [](const std::string& s, const std::string&, CallArgs&) { return Value(Lower(s) == s && Upper(s) != s); }},
};

Value ItemsMethod(const Dict& d, const std::string&, CallArgs&) {
  std::vector<Value> pairs;
  for (const auto& [k, v] : d.items) pairs.push_back(Value::Tuple({k, v}));
  return Value::List(std::move(pairs));
}

Value KeysOrValuesMethod(const Dict& d, const std::string& name, CallArgs&) {
  std::vector<Value> out;
  for (const auto& [k, v] : d.items) out.push_back(name == "keys" ? k : v);
  return Value::List(std::move(out));
}

Value GetMethod(const Dict& d, const std::string&, CallArgs& args) {
  const Value* key = args.Get(0, "key");
  if (key == nullptr) throw TemplateError("get expected at least 1 argument, got 0", args.where);
  const Value* v = d.Find(*key);
  if (v != nullptr) return *v;
  const Value* dflt = args.Get(1, "default");
  return dflt != nullptr ? *dflt : Value::None();
}

const std::pair<const char*, DictMethod> kDictMethods[] = {
    {"items", ItemsMethod}, {"keys", KeysOrValuesMethod}, {"values", KeysOrValuesMethod}, {"get", GetMethod}};

template <typename Fn, size_t N>
Fn Find(const std::pair<const char*, Fn> (&table)[N], const std::string& name) {
  for (const auto& [n, fn] : table) {
    if (name == n) return fn;
  }
  return nullptr;
}

// A namespace() object has no methods: its attributes are its keys.
bool HasDictMethods(const Value& obj) { return obj.is_dict() && !obj.AsDict().is_namespace; }

}  // namespace

bool HasMethod(const Value& obj, const std::string& name) {
  if (obj.is_string()) return Find(kStrMethods, name) != nullptr;
  return HasDictMethods(obj) && Find(kDictMethods, name) != nullptr;
}

std::optional<Value> CallMethod(const Value& obj, const std::string& name, CallArgs& args) {
  if (obj.is_string()) {
    if (StrMethod fn = Find(kStrMethods, name)) return fn(obj.AsString(), name, args);
  } else if (obj.is_dict()) {
    if (DictMethod fn = Find(kDictMethods, name)) return fn(obj.AsDict(), name, args);
  }
  return std::nullopt;
}

}  // namespace shardserve::chat
