// Python semantics, as jinja2 running in transformers' ImmutableSandboxedEnvironment shows them.
// Known approximations: case mapping is Unicode's simple mapping (see ToUpper); isalpha/isdigit/
// isalnum look at ASCII only.
#include "coordinator/chat/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "coordinator/chat/runtime/budget.h"
#include <utf8proc.h>

namespace shardserve::chat {
namespace {

// Budget checks before an allocation of known size; no-ops outside a render. `where` defaults to
// the node the renderer is evaluating.
void CheckBytes(int64_t size, const Location* where = nullptr) {
  if (BudgetTracker* t = BudgetTracker::Current()) t->CheckBytes(size, where ? *where : t->where());
}
// Also a step of the render (see BudgetTracker::Tick): the loops that grow a string one piece at a
// time (printing, JSON, join, replace, indent) poll the deadline through it.
void CheckGrowth(const std::string& out, size_t more, const Location* where = nullptr) {
  if (BudgetTracker* t = BudgetTracker::Current()) {
    t->CheckBytes(static_cast<int64_t>(out.size() + more), where ? *where : t->where());
    t->Tick();
  }
}
void CheckElements(int64_t n, const Location* where = nullptr) {
  if (BudgetTracker* t = BudgetTracker::Current()) t->CheckElements(n, where ? *where : t->where());
}
// a * b for sizes, saturating at INT64_MAX (which no budget admits).
int64_t SaturatingMul(int64_t a, int64_t b) {
  if (a <= 0 || b <= 0) return 0;
  return a > INT64_MAX / b ? INT64_MAX : a * b;
}

[[noreturn]] void Fail(const std::string& message, Location where) { throw TemplateError(message, where); }

[[noreturn]] void FailUndefined(const Value& v, Location where) {
  Fail(v.undefined_hint().empty() ? std::string("undefined value used") : v.undefined_hint() + " is undefined", where);
}

// --- UTF-8 ---

std::vector<uint32_t> Decode(const std::string& s) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if (i + n > s.size()) n = 1;
    uint32_t cp = n == 1 ? c : (c & (0xFF >> (n + 1)));
    for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(cp);
    i += n;
  }
  return out;
}


std::string Encode(const std::vector<uint32_t>& cps, size_t begin, size_t end) {
  std::string out;
  for (size_t i = begin; i < end; ++i) AppendUtf8(&out, cps[i]);
  return out;
}

// Python's str.isspace() code points.
bool IsPySpace(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// str.strip/lstrip/rstrip: whitespace when `chars` is null, else any of chars' code points.
std::string Strip(const std::string& s, const Value* chars, bool left, bool right) {
  std::vector<uint32_t> cps = Decode(s);
  std::vector<uint32_t> set;
  const bool whitespace = chars == nullptr || chars->is_none() || chars->is_undefined();
  if (!whitespace) set = Decode(chars->Str());
  auto strip = [&](uint32_t c) { return whitespace ? IsPySpace(c) : std::find(set.begin(), set.end(), c) != set.end(); };
  size_t b = 0, e = cps.size();
  if (left) while (b < e && strip(cps[b])) ++b;
  if (right) while (e > b && strip(cps[e - 1])) --e;
  return Encode(cps, b, e);
}

bool IsAsciiAlpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }

// Case mapping: Unicode's simple (one code point to one) mappings, through utf8proc. Python uses the
// full mappings, which differ for a few code points ('ß'.upper() is 'SS' there, 'ß' here).
uint32_t ToUpper(uint32_t c) { return static_cast<uint32_t>(utf8proc_toupper(static_cast<utf8proc_int32_t>(c))); }
uint32_t ToLower(uint32_t c) { return static_cast<uint32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))); }
uint32_t ToTitle(uint32_t c) { return static_cast<uint32_t>(utf8proc_totitle(static_cast<utf8proc_int32_t>(c))); }
bool IsCased(uint32_t c) {
  const utf8proc_category_t cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT;
}

std::string MapCase(const std::string& s, uint32_t (*f)(uint32_t)) {
  std::string out;
  for (uint32_t c : Decode(s)) AppendUtf8(&out, f(c));
  return out;
}
std::string Upper(const std::string& s) { return MapCase(s, ToUpper); }
std::string Lower(const std::string& s) { return MapCase(s, ToLower); }
// Python's str.capitalize(): the first character in title case, the rest lower case.
std::string Capitalize(const std::string& s) {
  std::string out;
  bool first = true;
  for (uint32_t c : Decode(s)) {
    AppendUtf8(&out, first ? ToTitle(c) : ToLower(c));
    first = false;
  }
  return out;
}
// Python's str.title(): a character after a cased one is lowered, any other is title-cased.
std::string PyTitle(const std::string& s) {
  std::string out;
  bool prev_cased = false;
  for (uint32_t c : Decode(s)) {
    AppendUtf8(&out, prev_cased ? ToLower(c) : ToTitle(c));
    prev_cased = IsCased(c);
  }
  return out;
}
// jinja2's title filter: words start after whitespace, '-', '(', '{', '[' or '<'; each word is
// word[0].upper() + word[1:].lower().
std::string JinjaTitle(const std::string& s) {
  std::string out;
  bool start = true;
  for (uint32_t c : Decode(s)) {
    const bool sep = IsPySpace(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
    if (sep) {
      AppendUtf8(&out, c);
      start = true;
    } else {
      AppendUtf8(&out, start ? ToUpper(c) : ToLower(c));
      start = false;
    }
  }
  return out;
}

std::string Replace(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
  std::string out;
  if (from.empty()) {  // Python inserts `to` between every code point
    std::vector<uint32_t> cps = Decode(s);
    int64_t done = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || done < count) CheckGrowth(out, to.size() + 4), out += to, ++done;
      if (i < cps.size()) AppendUtf8(&out, cps[i]);
    }
    return out;
  }
  size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t hit = s.find(from, pos);
    if (hit == std::string::npos) break;
    CheckGrowth(out, hit - pos + to.size());
    out.append(s, pos, hit - pos);
    out += to;
    pos = hit + from.size();
    ++done;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

std::vector<Value> Split(const std::string& s, const Value* sep, int64_t maxsplit) {
  std::vector<Value> out;
  if (sep == nullptr || sep->is_none()) {  // runs of whitespace, ends ignored
    std::vector<uint32_t> cps = Decode(s);
    size_t i = 0;
    while (true) {
      while (i < cps.size() && IsPySpace(cps[i])) ++i;
      if (i == cps.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
        size_t e = cps.size();
        while (e > i && IsPySpace(cps[e - 1])) --e;
        out.emplace_back(Encode(cps, i, e));
        break;
      }
      size_t j = i;
      while (j < cps.size() && !IsPySpace(cps[j])) ++j;
      CheckElements(static_cast<int64_t>(out.size()) + 2);  // the items so far, this one, the list
      out.emplace_back(Encode(cps, i, j));
      i = j;
    }
    return out;
  }
  const std::string& d = sep->AsString();
  if (d.empty()) throw TemplateError("empty separator", Location{});
  size_t pos = 0;
  while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
    size_t hit = s.find(d, pos);
    if (hit == std::string::npos) break;
    CheckElements(static_cast<int64_t>(out.size()) + 2);  // the items so far, this one, the list
    out.emplace_back(s.substr(pos, hit - pos));
    pos = hit + d.size();
  }
  out.emplace_back(s.substr(pos));
  return out;
}

std::string JsonString(const std::string& s, bool ensure_ascii) {
  std::string out = "\"";
  if (ensure_ascii) {
    for (uint32_t cp : Decode(s)) {
      char buf[16];
      if (cp == '"') out += "\\\"";
      else if (cp == '\\') out += "\\\\";
      else if (cp == '\n') out += "\\n";
      else if (cp == '\r') out += "\\r";
      else if (cp == '\t') out += "\\t";
      else if (cp == '\b') out += "\\b";
      else if (cp == '\f') out += "\\f";
      else if (cp < 0x20 || cp > 0x7E) {
        if (cp >= 0x10000) {
          const uint32_t v = cp - 0x10000;
          std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
        } else {
          std::snprintf(buf, sizeof(buf), "\\u%04x", cp);
        }
        out += buf;
      } else {
        out.push_back(static_cast<char>(cp));
      }
    }
  } else {
    for (char c : s) {
      const unsigned char u = static_cast<unsigned char>(c);
      if (c == '"') out += "\\\"";
      else if (c == '\\') out += "\\\\";
      else if (c == '\n') out += "\\n";
      else if (c == '\r') out += "\\r";
      else if (c == '\t') out += "\\t";
      else if (c == '\b') out += "\\b";
      else if (c == '\f') out += "\\f";
      else if (u < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof(buf), "\\u%04x", u);
        out += buf;
      } else {
        out.push_back(c);
      }
    }
  }
  out.push_back('"');
  return out;
}

std::string PyStringRepr(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos;
  const bool has_double = s.find('"') != std::string::npos;
  const char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, quote);
  for (uint32_t cp : Decode(s)) {
    if (cp == static_cast<uint32_t>(quote) || cp == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(cp));
    } else if (cp == '\n') out += "\\n";
    else if (cp == '\r') out += "\\r";
    else if (cp == '\t') out += "\\t";
    else if (cp < 0x20 || cp == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", cp);
      out += buf;
    } else {
      AppendUtf8(&out, cp);
    }
  }
  out.push_back(quote);
  return out;
}

int64_t FloorDiv(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}
int64_t PyMod(int64_t a, int64_t b) {
  int64_t m = a % b;
  if (m != 0 && ((m < 0) != (b < 0))) m += b;
  return m;
}

int64_t ToIndex(const Value& v, Location where) {
  if (v.is_int() || v.is_bool()) return v.AsInt();
  Fail("indices must be integers, not " + v.TypeName(), where);
}

}  // namespace

void AppendUtf8(std::string* out, uint32_t cp) {
  uint8_t bytes[4];
  const utf8proc_ssize_t n = utf8proc_encode_char(static_cast<utf8proc_int32_t>(cp), bytes);
  out->append(reinterpret_cast<const char*>(bytes), static_cast<size_t>(n));
}

// --- CallArgs, Dict ---

const Value* CallArgs::Get(size_t index, const std::string& name) const {
  if (index < positional.size()) return &positional[index];
  for (const auto& [k, v] : kwargs) {
    if (k == name) return &v;
  }
  return nullptr;
}

const Value* Dict::Find(const Value& key) const {
  for (const auto& [k, v] : items) {
    if (Equals(k, key)) return &v;
  }
  return nullptr;
}

void Dict::Set(const Value& key, Value value) {
  for (auto& [k, v] : items) {
    if (Equals(k, key)) {
      v = std::move(value);
      return;
    }
  }
  items.emplace_back(key, std::move(value));
}

// --- Value ---

Value Value::Undefined(std::string hint) {
  Value v;
  v.name_ = std::move(hint);
  return v;
}

Value Value::None() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}

Value::Value(std::string s) : kind_(Kind::kString) {
  if (BudgetTracker* t = BudgetTracker::Current()) t->ChargeBytes(static_cast<int64_t>(s.size()), t->where());
  str_ = std::make_shared<std::string>(std::move(s));
}

Value Value::List(std::vector<Value> items) {
  Value v;
  v.kind_ = Kind::kList;
  const size_t n = items.size();
  v.list_ = std::make_shared<std::vector<Value>>(std::move(items));
  if (BudgetTracker* t = BudgetTracker::Current()) t->Register(v, n);
  return v;
}

Value Value::Tuple(std::vector<Value> items) {
  Value v = List(std::move(items));
  v.tuple_ = true;
  return v;
}

Value Value::MakeDict(Dict dict) {
  Value v;
  v.kind_ = Kind::kDict;
  const size_t n = dict.items.size();
  v.dict_ = std::make_shared<Dict>(std::move(dict));
  if (BudgetTracker* t = BudgetTracker::Current()) t->Register(v, n);
  return v;
}

Value Value::Func(std::string name, Function fn) {
  Value v;
  v.kind_ = Kind::kFunction;
  v.name_ = std::move(name);
  v.fn_ = std::make_shared<Function>(std::move(fn));
  return v;
}

Value Value::FromJson(const nlohmann::ordered_json& json) {
  switch (json.type()) {
    case nlohmann::ordered_json::value_t::null: return None();
    case nlohmann::ordered_json::value_t::boolean: return Value(json.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value(json.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const uint64_t u = json.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) return Value(static_cast<double>(u));
      return Value(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float: return Value(json.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value(json.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      std::vector<Value> items;
      for (const auto& item : json) items.push_back(FromJson(item));
      return List(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict d;
      for (const auto& [k, v] : json.items()) d.items.emplace_back(Value(k), FromJson(v));
      return MakeDict(std::move(d));
    }
    default: return None();  // binary / discarded: not produced by the JSON parser
  }
}

bool Value::Truthy() const {
  switch (kind_) {
    case Kind::kUndefined: case Kind::kNone: return false;
    case Kind::kBool: case Kind::kInt: return int_ != 0;
    case Kind::kFloat: return float_ != 0.0;
    case Kind::kString: return !str_->empty();
    case Kind::kList: return !list_->empty();
    case Kind::kDict: return !dict_->items.empty();
    case Kind::kFunction: return true;
  }
  return false;
}

std::string Value::TypeName() const {
  switch (kind_) {
    case Kind::kUndefined: return "Undefined";
    case Kind::kNone: return "NoneType";
    case Kind::kBool: return "bool";
    case Kind::kInt: return "int";
    case Kind::kFloat: return "float";
    case Kind::kString: return "str";
    case Kind::kList: return "list";
    case Kind::kDict: return dict_->is_namespace ? "Namespace" : "dict";
    case Kind::kFunction: return "function";
  }
  return "?";
}

std::string FloatRepr(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (v == 0) return std::signbit(v) ? "-0.0" : "0.0";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), v, std::chars_format::scientific);
  std::string sci(buf, res.ptr);  // -d.ddddde[+-]XX
  const bool neg = sci[0] == '-';
  if (neg) sci.erase(0, 1);
  const size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exp = std::stoi(sci.substr(e + 1));
  std::string out = neg ? "-" : "";
  if (exp >= -5 + 1 && exp < 16) {  // Python's repr: fixed notation for 1e-4 <= |v| < 1e16
    if (exp >= 0) {
      if (static_cast<int>(digits.size()) <= exp + 1) {
        out += digits + std::string(exp + 1 - digits.size(), '0') + ".0";
      } else {
        out += digits.substr(0, exp + 1) + "." + digits.substr(exp + 1);
      }
    } else {
      out += "0." + std::string(-exp - 1, '0') + digits;
    }
    return out;
  }
  out += digits.substr(0, 1);
  if (digits.size() > 1) out += "." + digits.substr(1);
  char ebuf[16];
  std::snprintf(ebuf, sizeof(ebuf), "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
  return out + ebuf;
}

std::string Value::Str() const {
  switch (kind_) {
    case Kind::kUndefined: return "";
    case Kind::kString: return *str_;
    default: return Repr();
  }
}

std::string Value::Repr() const {
  std::string out;
  ReprTo(&out);
  return out;
}

void Value::ReprTo(std::string* out) const {
  // Appends `s` unless the render's byte budget cannot hold the result: lists may hold the same
  // list or string many times over, so what they print can be far larger than what they hold.
  auto put = [out](std::string_view s) {
    CheckGrowth(*out, s.size());
    out->append(s);
  };
  switch (kind_) {
    case Kind::kUndefined: return;
    case Kind::kNone: return put("None");
    case Kind::kBool: return put(int_ ? "True" : "False");
    case Kind::kInt: return put(std::to_string(int_));
    case Kind::kFloat: return put(FloatRepr(float_));
    case Kind::kString: return put(PyStringRepr(*str_));
    case Kind::kList: {
      const DepthGuard level;
      put(tuple_ ? "(" : "[");
      for (size_t i = 0; i < list_->size(); ++i) {
        if (i) put(", ");
        (*list_)[i].ReprTo(out);
      }
      if (tuple_) return put(list_->size() == 1 ? ",)" : ")");
      return put("]");
    }
    case Kind::kDict: {
      const DepthGuard level;
      put(dict_->is_namespace ? "<Namespace {" : "{");
      for (size_t i = 0; i < dict_->items.size(); ++i) {
        if (i) put(", ");
        dict_->items[i].first.ReprTo(out);
        put(": ");
        dict_->items[i].second.ReprTo(out);
      }
      return put(dict_->is_namespace ? "}>" : "}");
    }
    case Kind::kFunction: return put("<function " + name_ + ">");
  }
}

std::string Value::ToJson(int indent, const std::string& item_sep, const std::string& key_sep, bool sort_keys,
                          Location where) const {
  std::string out;
  std::function<void(const Value&, int)> emit = [&](const Value& v, int level) {
    const DepthGuard depth;
    // Every append is checked against the render's byte budget first: shared lists and a large
    // indent make JSON far larger than what the value holds.
    auto newline = [&](int l) {
      if (indent < 0) return;
      const int64_t spaces = SaturatingMul(indent, l);
      CheckGrowth(out, static_cast<size_t>(std::min<int64_t>(spaces, INT64_MAX - 1) + 1), &where);
      out += "\n";
      out.append(static_cast<size_t>(spaces), ' ');
    };
    auto put = [&](const std::string& s) {
      CheckGrowth(out, s.size(), &where);
      out += s;
    };
    switch (v.kind()) {
      case Kind::kNone: put("null"); break;
      case Kind::kBool: put(v.AsInt() ? "true" : "false"); break;
      case Kind::kInt: put(std::to_string(v.AsInt())); break;
      case Kind::kFloat: {
        const double d = v.AsDouble();
        put(std::isnan(d) ? "NaN" : std::isinf(d) ? (d > 0 ? "Infinity" : "-Infinity") : FloatRepr(d));
        break;
      }
      case Kind::kString: put(JsonString(v.AsString(), false)); break;
      case Kind::kList: {
        const auto& items = v.AsList();
        if (items.empty()) { put("[]"); break; }
        put("[");
        for (size_t i = 0; i < items.size(); ++i) {
          if (i) put(item_sep);
          newline(level + 1);
          emit(items[i], level + 1);
        }
        newline(level);
        put("]");
        break;
      }
      case Kind::kDict: {
        std::vector<std::pair<std::string, const Value*>> entries;
        for (const auto& [k, val] : v.AsDict().items) {
          std::string key;
          if (k.is_string()) key = k.AsString();
          else if (k.is_bool()) key = k.AsInt() ? "true" : "false";
          else if (k.is_none()) key = "null";
          else if (k.is_int() || k.is_float()) key = k.Repr();
          else Fail("keys must be str, int, float, bool or None, not " + k.TypeName(), where);
          entries.emplace_back(std::move(key), &val);
        }
        if (sort_keys) {
          std::stable_sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
        }
        if (entries.empty()) { put("{}"); break; }
        put("{");
        for (size_t i = 0; i < entries.size(); ++i) {
          if (i) put(item_sep);
          newline(level + 1);
          put(JsonString(entries[i].first, false) + key_sep);
          emit(*entries[i].second, level + 1);
        }
        newline(level);
        put("}");
        break;
      }
      case Kind::kUndefined: Fail("Object of type Undefined is not JSON serializable", where);
      case Kind::kFunction: Fail("Object of type function is not JSON serializable", where);
    }
  };
  emit(*this, 0);
  return out;
}

// --- comparisons ---

bool Equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.AsDouble() == b.AsDouble();
    return a.AsInt() == b.AsInt();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::kUndefined: case Value::Kind::kNone: return true;
    case Value::Kind::kString: return a.AsString() == b.AsString();
    case Value::Kind::kList: {
      const DepthGuard level;
      const auto &x = a.AsList(), &y = b.AsList();
      if (x.size() != y.size() || a.is_tuple() != b.is_tuple()) return false;
      for (size_t i = 0; i < x.size(); ++i) if (!Equals(x[i], y[i])) return false;
      return true;
    }
    case Value::Kind::kDict: {
      const DepthGuard level;
      const auto &x = a.AsDict(), &y = b.AsDict();
      if (x.items.size() != y.items.size()) return false;
      for (const auto& [k, v] : x.items) {
        const Value* other = y.Find(k);
        if (other == nullptr || !Equals(v, *other)) return false;
      }
      return true;
    }
    case Value::Kind::kFunction: return &a.AsFunction() == &b.AsFunction();
    default: return false;
  }
}

bool Less(const Value& a, const Value& b, Location where) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.AsDouble() < b.AsDouble();
    return a.AsInt() < b.AsInt();
  }
  if (a.is_string() && b.is_string()) return a.AsString() < b.AsString();
  if (a.is_list() && b.is_list()) {
    const DepthGuard level;
    const auto &x = a.AsList(), &y = b.AsList();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!Equals(x[i], y[i])) return Less(x[i], y[i], where);
    }
    return x.size() < y.size();
  }
  if (a.is_undefined()) FailUndefined(a, where);
  if (b.is_undefined()) FailUndefined(b, where);
  Fail("'<' not supported between instances of '" + a.TypeName() + "' and '" + b.TypeName() + "'", where);
}

// --- operators ---

Value BinaryOp(const std::string& op, const Value& a, const Value& b, Location where) {
  if (op == "~") {
    std::string out = a.Str();
    const std::string right = b.Str();
    CheckGrowth(out, right.size(), &where);
    out += right;
    return Value(std::move(out));
  }
  if (op == "in") {
    if (b.is_string()) {
      if (!a.is_string()) Fail("'in <string>' requires string as left operand, not " + a.TypeName(), where);
      return Value(b.AsString().find(a.AsString()) != std::string::npos);
    }
    if (b.is_list()) {
      for (const Value& v : b.AsList()) if (Equals(v, a)) return Value(true);
      return Value(false);
    }
    if (b.is_dict()) return Value(b.AsDict().Find(a) != nullptr);
    if (b.is_undefined()) return Value(false);
    Fail("argument of type '" + b.TypeName() + "' is not iterable", where);
  }
  if (a.is_undefined()) FailUndefined(a, where);
  if (b.is_undefined()) FailUndefined(b, where);
  auto unsupported = [&]() -> Value {
    Fail("unsupported operand type(s) for " + op + ": '" + a.TypeName() + "' and '" + b.TypeName() + "'", where);
  };
  if (a.is_number() && b.is_number()) {
    const bool f = a.is_float() || b.is_float();
    if (op == "+") return f ? Value(a.AsDouble() + b.AsDouble()) : Value(a.AsInt() + b.AsInt());
    if (op == "-") return f ? Value(a.AsDouble() - b.AsDouble()) : Value(a.AsInt() - b.AsInt());
    if (op == "*") return f ? Value(a.AsDouble() * b.AsDouble()) : Value(a.AsInt() * b.AsInt());
    if (op == "/") {
      if (b.AsDouble() == 0) Fail("division by zero", where);
      return Value(a.AsDouble() / b.AsDouble());
    }
    if (op == "//" || op == "%") {
      if (b.AsDouble() == 0) Fail(op == "//" ? "integer division or modulo by zero" : "modulo by zero", where);
      if (f) {
        const double x = a.AsDouble(), y = b.AsDouble();
        const double m = std::fmod(x, y);
        const double mod = (m != 0 && ((m < 0) != (y < 0))) ? m + y : m;
        return op == "%" ? Value(mod) : Value(std::floor((x - mod) / y + 0.5));
      }
      return op == "//" ? Value(FloorDiv(a.AsInt(), b.AsInt())) : Value(PyMod(a.AsInt(), b.AsInt()));
    }
    if (op == "**") {
      if (!f && b.AsInt() >= 0) {
        // By squaring, in 64-bit two's complement (where Python's integers would grow): a time
        // logarithmic in the exponent, whatever its size.
        uint64_t r = 1, base = static_cast<uint64_t>(a.AsInt());
        for (uint64_t e = static_cast<uint64_t>(b.AsInt()); e != 0; e >>= 1) {
          if (e & 1) r *= base;
          base *= base;
        }
        return Value(static_cast<int64_t>(r));
      }
      return Value(std::pow(a.AsDouble(), b.AsDouble()));
    }
    return unsupported();
  }
  if (op == "+" && a.is_string() && b.is_string()) {
    CheckGrowth(a.AsString(), b.AsString().size(), &where);
    return Value(a.AsString() + b.AsString());
  }
  if (op == "+" && a.is_list() && b.is_list()) {
    CheckElements(static_cast<int64_t>(a.AsList().size() + b.AsList().size()) + 1, &where);
    std::vector<Value> items = a.AsList();
    items.insert(items.end(), b.AsList().begin(), b.AsList().end());
    return Value::List(std::move(items));
  }
  if (op == "*" && (a.is_string() || a.is_list()) && (b.is_int() || b.is_bool())) {
    const size_t unit = a.is_string() ? a.AsString().size() : a.AsList().size();
    const int64_t total = SaturatingMul(static_cast<int64_t>(unit), b.AsInt());
    if (a.is_string()) CheckBytes(total, &where);
    else CheckElements(total + 1, &where);
    if (a.is_string()) {
      std::string out;
      for (int64_t i = 0; i < b.AsInt(); ++i) out += a.AsString();
      return Value(std::move(out));
    }
    std::vector<Value> items;
    for (int64_t i = 0; i < b.AsInt(); ++i) items.insert(items.end(), a.AsList().begin(), a.AsList().end());
    return Value::List(std::move(items));
  }
  if (op == "*" && (b.is_string() || b.is_list()) && (a.is_int() || a.is_bool())) return BinaryOp(op, b, a, where);
  if (op == "+" && (a.is_string() || b.is_string())) {
    Fail(a.is_string() ? "can only concatenate str (not \"" + b.TypeName() + "\") to str"
                       : "unsupported operand type(s) for +: '" + a.TypeName() + "' and 'str'",
         where);
  }
  return unsupported();
}

// --- attribute and item access ---

namespace {
bool IsMethodName(const Value& obj, const std::string& name) {
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
}  // namespace

Value GetAttr(const Value& obj, const std::string& name, Location where) {
  if (obj.is_undefined()) FailUndefined(obj, where);
  // jinja2 tries getattr() first, so dict methods win over keys of the same name.
  if (IsMethodName(obj, name)) {
    return Value::Func(name, [obj, name](CallArgs& args) {
      std::optional<Value> r = CallMethod(obj, name, args);
      return r.has_value() ? *r : Value::Undefined(name);
    });
  }
  if (obj.is_dict()) {
    const Value* v = obj.AsDict().Find(Value(name));
    if (v != nullptr) return *v;
    return Value::Undefined("'" + obj.TypeName() + " object' has no attribute '" + name + "'");
  }
  return Value::Undefined("'" + obj.TypeName() + " object' has no attribute '" + name + "'");
}

Value GetItem(const Value& obj, const Value& key, Location where) {
  if (obj.is_undefined()) FailUndefined(obj, where);
  if (obj.is_dict()) {
    const Value* v = obj.AsDict().Find(key);
    if (v != nullptr) return *v;
    if (key.is_string()) return GetAttr(obj, key.AsString(), where);
    return Value::Undefined("'" + obj.TypeName() + " object' has no attribute " + key.Repr());
  }
  if (obj.is_list() || obj.is_string()) {
    if (key.is_string()) return GetAttr(obj, key.AsString(), where);
    if (!key.is_int() && !key.is_bool()) return Value::Undefined(obj.TypeName() + " index " + key.Repr());
    int64_t i = key.AsInt();
    if (obj.is_list()) {
      const int64_t n = static_cast<int64_t>(obj.AsList().size());
      if (i < 0) i += n;
      if (i < 0 || i >= n) return Value::Undefined("list index " + key.Repr() + " out of range");
      return obj.AsList()[static_cast<size_t>(i)];
    }
    std::vector<uint32_t> cps = Decode(obj.AsString());
    const int64_t n = static_cast<int64_t>(cps.size());
    if (i < 0) i += n;
    if (i < 0 || i >= n) return Value::Undefined("string index " + key.Repr() + " out of range");
    return Value(Encode(cps, static_cast<size_t>(i), static_cast<size_t>(i) + 1));
  }
  return Value::Undefined("'" + obj.TypeName() + " object' has no attribute " + key.Repr());
}

Value Slice(const Value& obj, const Value* start, const Value* stop, const Value* step, Location where) {
  if (obj.is_undefined()) FailUndefined(obj, where);
  if (!obj.is_list() && !obj.is_string()) Fail("'" + obj.TypeName() + "' object is not subscriptable", where);
  std::vector<uint32_t> cps;
  int64_t n;
  if (obj.is_string()) {
    cps = Decode(obj.AsString());
    n = static_cast<int64_t>(cps.size());
  } else {
    n = static_cast<int64_t>(obj.AsList().size());
  }
  auto present = [](const Value* v) { return v != nullptr && !v->is_none(); };
  const int64_t st = present(step) ? ToIndex(*step, where) : 1;
  if (st == 0) Fail("slice step cannot be zero", where);
  auto clamp = [&](const Value* v, int64_t dflt) {
    if (!present(v)) return dflt;
    int64_t i = ToIndex(*v, where);
    if (i < 0) i += n;
    if (st > 0) return std::clamp<int64_t>(i, 0, n);
    return std::clamp<int64_t>(i, -1, n - 1);
  };
  const int64_t b = clamp(start, st > 0 ? 0 : n - 1);
  const int64_t e = clamp(stop, st > 0 ? n : -1);
  std::vector<int64_t> idx;
  for (int64_t i = b; st > 0 ? i < e : i > e; i += st) idx.push_back(i);
  if (obj.is_string()) {
    std::string out;
    for (int64_t i : idx) AppendUtf8(&out, cps[static_cast<size_t>(i)]);
    return Value(std::move(out));
  }
  std::vector<Value> items;
  for (int64_t i : idx) items.push_back(obj.AsList()[static_cast<size_t>(i)]);
  return Value::List(std::move(items));
}

std::vector<Value> Iterate(const Value& v, Location where) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return {};
    case Value::Kind::kList: return v.AsList();
    case Value::Kind::kDict: {
      std::vector<Value> keys;
      for (const auto& [k, unused] : v.AsDict().items) keys.push_back(k);
      return keys;
    }
    case Value::Kind::kString: {
      std::vector<Value> chars;
      std::vector<uint32_t> cps = Decode(v.AsString());
      CheckElements(static_cast<int64_t>(cps.size()), &where);  // one value each
      for (size_t i = 0; i < cps.size(); ++i) chars.emplace_back(Encode(cps, i, i + 1));
      return chars;
    }
    default: Fail("'" + v.TypeName() + "' object is not iterable", where);
  }
}

// --- methods ---

std::optional<Value> CallMethod(const Value& obj, const std::string& name, CallArgs& args) {
  const Location where = args.where;
  auto str_arg = [&](size_t i, const char* kw) -> std::string {
    const Value* v = args.Get(i, kw);
    if (v == nullptr) Fail(name + "() missing argument '" + kw + "'", where);
    if (!v->is_string()) Fail(name + "() argument must be str, not " + v->TypeName(), where);
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
      if (sep != nullptr && !sep->is_none() && !sep->is_string()) Fail("must be str or None, not " + sep->TypeName(), where);
      if (sep != nullptr && sep->is_string() && sep->AsString().empty()) Fail("empty separator", where);
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
      if (p == nullptr) Fail(name + "() takes at least 1 argument", where);
      std::vector<Value> options = p->is_list() ? p->AsList() : std::vector<Value>{*p};
      for (const Value& o : options) {
        if (!o.is_string()) Fail(name + " first arg must be str or a tuple of str, not " + o.TypeName(), where);
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
      if (items == nullptr) Fail("join() takes exactly one argument", where);
      std::string out;
      bool first = true;
      for (const Value& v : Iterate(*items, where)) {
        if (!v.is_string()) Fail("sequence item: expected str instance, " + v.TypeName() + " found", where);
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
      if (key == nullptr) Fail("get expected at least 1 argument, got 0", where);
      const Value* v = d.Find(*key);
      if (v != nullptr) return *v;
      const Value* dflt = args.Get(1, "default");
      return dflt != nullptr ? *dflt : Value::None();
    }
  }
  return std::nullopt;
}

// --- tests ---

namespace {
const char* const kTests[] = {"defined", "undefined", "none", "boolean", "false", "true", "integer", "float", "number",
                              "string", "mapping", "iterable", "sequence", "callable", "sameas", "equalto", "eq", "==",
                              "ne", "!=", "lt", "<", "le", "<=", "gt", ">", "ge", ">=", "in", "odd", "even",
                              "divisibleby", "lower", "upper", "escaped"};
}  // namespace

bool HasTest(const std::string& name) { return std::find(std::begin(kTests), std::end(kTests), name) != std::end(kTests); }

bool ApplyTest(const std::string& name, const Value& v, CallArgs& args) {
  const Location where = args.where;
  auto arg = [&](size_t i) -> const Value& {
    if (i >= args.positional.size()) Fail("test '" + name + "' needs an argument", where);
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
    if (!v.is_int() && !v.is_bool()) Fail("test '" + name + "' needs an integer, not " + v.TypeName(), where);
    if (name == "odd") return PyMod(v.AsInt(), 2) == 1;
    if (name == "even") return PyMod(v.AsInt(), 2) == 0;
    const int64_t d = ToIndex(arg(0), where);
    if (d == 0) Fail("integer division or modulo by zero", where);
    return PyMod(v.AsInt(), d) == 0;
  }
  if (name == "lower") return v.is_string() && Lower(v.AsString()) == v.AsString();
  if (name == "upper") return v.is_string() && Upper(v.AsString()) == v.AsString();
  Fail("no test named '" + name + "'", where);
}

// --- filters ---

namespace {
const char* const kFilters[] = {"trim", "tojson", "length", "count", "items", "join", "upper", "lower", "title",
                                "capitalize", "replace", "default", "d", "first", "last", "list", "string", "int",
                                "float", "abs", "round", "select", "reject", "selectattr", "rejectattr", "map",
                                "reverse", "sort", "unique", "min", "max", "sum", "safe", "escape", "e", "indent",
                                "dictsort", "wordcount", "attr", "batch"};

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
  Fail("object of type '" + v.TypeName() + "' has no len()", where);
}
}  // namespace

bool HasFilter(const std::string& name) {
  return std::find(std::begin(kFilters), std::end(kFilters), name) != std::end(kFilters);
}

Value ApplyFilter(const std::string& name, const Value& v, CallArgs& args) {
  const Location where = args.where;
  if (name == "default" || name == "d") {
    const Value* dflt = args.Get(0, "default_value");
    const Value* boolean = args.Get(1, "boolean");
    const bool use = v.is_undefined() || (boolean != nullptr && boolean->Truthy() && !v.Truthy());
    return use ? (dflt ? *dflt : Value("")) : v;
  }
  if (name == "safe") return v;
  if (name == "string") return Value(v.Str());
  if (name == "length" || name == "count") return Value(Length(v, where));
  if (name == "tojson") {
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
    if (ensure_ascii != nullptr && ensure_ascii->Truthy()) {
      // Re-escape non-ASCII: safe on JSON text, whose non-ASCII bytes are all inside strings.
      std::string ascii;
      for (uint32_t cp : Decode(out)) {
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
      return Value(std::move(ascii));
    }
    return Value(std::move(out));
  }
  if (name == "items") {
    if (v.is_undefined()) return Value::List();
    if (!v.is_dict()) Fail("Can only get item pairs from a mapping.", where);
    return *CallMethod(v, "items", args);
  }
  if (name == "list") return Value::List(Iterate(v, where));
  if (name == "first" || name == "last") {
    std::vector<Value> items = Iterate(v, where);
    if (items.empty()) return Value::Undefined("No " + name + " item, sequence was empty.");
    return name == "first" ? items.front() : items.back();
  }
  if (name == "reverse") {
    if (v.is_string()) {
      std::vector<uint32_t> cps = Decode(v.AsString());
      std::reverse(cps.begin(), cps.end());
      return Value(Encode(cps, 0, cps.size()));
    }
    std::vector<Value> items = Iterate(v, where);
    std::reverse(items.begin(), items.end());
    return Value::List(std::move(items));
  }
  if (name == "join") {
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
  if (name == "attr") {
    const Value* a = args.Get(0, "name");
    return a ? GetAttr(v, a->Str(), where) : Value::Undefined();
  }
  if (v.is_undefined() && (name == "trim" || name == "upper" || name == "lower" || name == "title" ||
                           name == "capitalize" || name == "replace" || name == "indent" || name == "wordcount")) {
    // jinja2 str()s its input for string filters: undefined is "".
    return ApplyFilter(name, Value(""), args);
  }
  if (name == "trim") return Value(Strip(v.Str(), args.Get(0, "chars"), true, true));
  if (name == "upper") return Value(Upper(v.Str()));
  if (name == "lower") return Value(Lower(v.Str()));
  if (name == "title") return Value(JinjaTitle(v.Str()));
  if (name == "capitalize") return Value(Capitalize(v.Str()));
  if (name == "wordcount") return Value(static_cast<int64_t>(Split(v.Str(), nullptr, -1).size()));
  if (name == "replace") {
    const Value* old_s = args.Get(0, "old");
    const Value* new_s = args.Get(1, "new");
    const Value* count = args.Get(2, "count");
    if (old_s == nullptr || new_s == nullptr) Fail("replace needs two arguments", where);
    return Value(Replace(v.Str(), old_s->Str(), new_s->Str(), count && !count->is_none() ? ToIndex(*count, where) : -1));
  }
  if (name == "escape" || name == "e") {
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
  if (name == "indent") {
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
  if (name == "int") {
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
  if (name == "float") {
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
  if (name == "abs") {
    if (v.is_float()) return Value(std::fabs(v.AsDouble()));
    if (v.is_int() || v.is_bool()) return Value(v.AsInt() < 0 ? -v.AsInt() : v.AsInt());
    Fail("bad operand type for abs(): '" + v.TypeName() + "'", where);
  }
  if (name == "round") {
    const Value* precision = args.Get(0, "precision");
    const Value* method = args.Get(1, "method");
    const int64_t p = precision ? ToIndex(*precision, where) : 0;
    const double scale = std::pow(10.0, static_cast<double>(p));
    const std::string m = method ? method->Str() : "common";
    double x = v.AsDouble() * scale;
    x = m == "ceil" ? std::ceil(x) : m == "floor" ? std::floor(x) : std::round(x);
    return Value(x / scale);
  }
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
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
  if (name == "map") {
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
        if (args.positional.empty()) Fail("map requires a filter argument", where);
        CallArgs filter_args = Rest(args, 1);
        out.push_back(ApplyFilter(args.positional[0].Str(), item, filter_args));
      }
    }
    return Value::List(std::move(out));
  }
  if (name == "sort" || name == "unique" || name == "min" || name == "max" || name == "dictsort") {
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
      if (!v.is_dict()) Fail("dictsort needs a mapping", where);
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
  if (name == "sum") {
    const Value* attribute = args.Get(0, "attribute");
    const Value* start = args.Get(1, "start");
    Value total = start ? *start : Value(int64_t{0});
    for (const Value& item : Iterate(v, where)) total = BinaryOp("+", total, attribute ? AttrPath(item, *attribute, where) : item, where);
    return total;
  }
  if (name == "batch") {
    const Value* size = args.Get(0, "linecount");
    if (size == nullptr) Fail("batch needs a size", where);
    const int64_t n = ToIndex(*size, where);
    if (n <= 0) Fail("batch size must be positive", where);
    std::vector<Value> out, cur;
    for (const Value& item : Iterate(v, where)) {
      cur.push_back(item);
      if (static_cast<int64_t>(cur.size()) == n) out.push_back(Value::List(std::move(cur))), cur.clear();
    }
    if (!cur.empty()) out.push_back(Value::List(std::move(cur)));
    return Value::List(std::move(out));
  }
  Fail("no filter named '" + name + "'", where);
}

}  // namespace shardserve::chat
