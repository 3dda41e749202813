// Python semantics, as jinja2 running in transformers' ImmutableSandboxedEnvironment shows them.
// Known approximation: isalpha/isdigit/isalnum look at ASCII only.
#include "coordinator/chat/methods.h"

#include <algorithm>
#include <iterator>

#include "coordinator/chat/budget.h"
#include "coordinator/chat/py_str.h"

namespace shardserve::chat {

bool HasMethod(const Value& obj, const std::string& name) {
  static const char* const kStr[] = {"strip", "lstrip", "rstrip", "split", "rsplit", "startswith", "endswith", "upper",
                                     "lower", "title", "capitalize", "replace", "find", "rfind", "count", "join",
                                     "splitlines", "isdigit", "isalpha", "isalnum", "isspace", "isupper", "islower"};
  static const char* const kDict[] = {"items", "keys", "values", "get"};
  if (obj.is_string()) return std::find(std::begin(kStr), std::end(kStr), name) != std::end(kStr);
  if (obj.is_dict() && !obj.AsDict().is_namespace) {
    return std::find(std::begin(kDict), std::end(kDict), name) != std::end(kDict);
  }
  return false;
}

std::optional<Value> CallMethod(const Value& obj, const std::string& name, CallArgs& args) {
  const Location where = args.where;
  auto str_arg = [&](size_t i, const char* kw) -> std::string {
    const Value* v = args.Get(i, kw);
    if (v == nullptr) throw TemplateError(name + "() missing argument '" + kw + "'", where);
    if (!v->is_string()) throw TemplateError(name + "() argument must be str, not " + v->TypeName(), where);
    return v->AsString();
  };
  if (obj.is_string()) {
    const std::string& s = obj.AsString();
    if (name == "strip") return Value(Strip(s, args.Get(0, "chars"), true, true));
    if (name == "lstrip") return Value(Strip(s, args.Get(0, "chars"), true, false));
    if (name == "rstrip") return Value(Strip(s, args.Get(0, "chars"), false, true));
    if (name == "upper") return Value(Upper(s));
    if (name == "lower") return Value(Lower(s));
    if (name == "title") return Value(PyTitle(s));
    if (name == "capitalize") return Value(Capitalize(s));
    if (name == "split" || name == "rsplit") {
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
    if (name == "startswith" || name == "endswith") {
      const Value* p = args.Get(0, "prefix");
      if (p == nullptr) throw TemplateError(name + "() takes at least 1 argument", where);
      std::vector<Value> options = p->is_list() ? p->AsList() : std::vector<Value>{*p};
      for (const Value& o : options) {
        if (!o.is_string()) throw TemplateError(name + " first arg must be str or a tuple of str, not " + o.TypeName(), where);
        const std::string& x = o.AsString();
        const bool hit = x.size() <= s.size() &&
                         (name == "startswith" ? s.compare(0, x.size(), x) == 0 : s.compare(s.size() - x.size(), x.size(), x) == 0);
        if (hit) return Value(true);
      }
      return Value(false);
    }
    if (name == "replace") {
      const Value* count = args.Get(2, "count");
      return Value(Replace(s, str_arg(0, "old"), str_arg(1, "new"), count ? ToIndex(*count, where) : -1));
    }
    if (name == "find" || name == "rfind" || name == "count") {
      const std::string sub = str_arg(0, "sub");
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
    if (name == "join") {
      const Value* items = args.Get(0, "iterable");
      if (items == nullptr) throw TemplateError("join() takes exactly one argument", where);
      std::string out;
      bool first = true;
      for (const Value& v : Iterate(*items, where)) {
        if (!v.is_string()) throw TemplateError("sequence item: expected str instance, " + v.TypeName() + " found", where);
        CheckGrowth(out, (first ? 0 : s.size()) + v.AsString().size(), &where);  // [big] * n joins to n times big
        out += (first ? "" : s) + v.AsString();
        first = false;
      }
      return Value(std::move(out));
    }
    if (name == "splitlines") {
      std::vector<Value> lines;
      size_t b = 0;
      for (size_t i = 0; i < s.size(); ++i) {
        if (s[i] == '\n' || s[i] == '\r') {
          CheckElements(static_cast<int64_t>(lines.size()) + 2, &where);  // the lines so far, this one, the list
          lines.emplace_back(s.substr(b, i - b));
          if (s[i] == '\r' && i + 1 < s.size() && s[i + 1] == '\n') ++i;
          b = i + 1;
        }
      }
      if (b < s.size()) lines.emplace_back(s.substr(b));
      return Value::List(std::move(lines));
    }
    auto all_of = [&](auto pred) {
      if (s.empty()) return Value(false);
      for (char c : s) if (!pred(c)) return Value(false);
      return Value(true);
    };
    if (name == "isdigit") return all_of([](char c) { return c >= '0' && c <= '9'; });
    if (name == "isalpha") return all_of([](char c) { return IsAsciiAlpha(c); });
    if (name == "isalnum") return all_of([](char c) { return IsAsciiAlpha(c) || (c >= '0' && c <= '9'); });
    if (name == "isspace") return all_of([](char c) { return IsPySpace(static_cast<unsigned char>(c)); });
    if (name == "isupper") return Value(Upper(s) == s && Lower(s) != s);
    if (name == "islower") return Value(Lower(s) == s && Upper(s) != s);
    return std::nullopt;
  }
  if (obj.is_dict()) {
    const Dict& d = obj.AsDict();
    if (name == "items") {
      std::vector<Value> pairs;
      for (const auto& [k, v] : d.items) pairs.push_back(Value::Tuple({k, v}));
      return Value::List(std::move(pairs));
    }
    if (name == "keys" || name == "values") {
      std::vector<Value> out;
      for (const auto& [k, v] : d.items) out.push_back(name == "keys" ? k : v);
      return Value::List(std::move(out));
    }
    if (name == "get") {
      const Value* key = args.Get(0, "key");
      if (key == nullptr) throw TemplateError("get expected at least 1 argument, got 0", where);
      const Value* v = d.Find(*key);
      if (v != nullptr) return *v;
      const Value* dflt = args.Get(1, "default");
      return dflt != nullptr ? *dflt : Value::None();
    }
  }
  return std::nullopt;
}

}  // namespace shardserve::chat
