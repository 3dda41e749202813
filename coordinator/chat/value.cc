// Python semantics, as jinja2 running in transformers' ImmutableSandboxedEnvironment shows them.
#include "coordinator/chat/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "coordinator/chat/budget.h"
#include "coordinator/chat/methods.h"
#include "coordinator/chat/py_str.h"
#include <utf8proc.h>

namespace shardserve::chat {
namespace {

// a * b for sizes, saturating at INT64_MAX (which no budget admits).
int64_t SaturatingMul(int64_t a, int64_t b) {
  if (a <= 0 || b <= 0) return 0;
  return a > INT64_MAX / b ? INT64_MAX : a * b;
}

[[noreturn]] void Fail(const std::string& message, Location where) { throw TemplateError(message, where); }

[[noreturn]] void FailUndefined(const Value& v, Location where) {
  Fail(v.undefined_hint().empty() ? std::string("undefined value used") : v.undefined_hint() + " is undefined", where);
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

}  // namespace

int64_t PyMod(int64_t a, int64_t b) {
  int64_t m = a % b;
  if (m != 0 && ((m < 0) != (b < 0))) m += b;
  return m;
}

int64_t ToIndex(const Value& v, Location where) {
  if (v.is_int() || v.is_bool()) return v.AsInt();
  Fail("indices must be integers, not " + v.TypeName(), where);
}

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

Value GetAttr(const Value& obj, const std::string& name, Location where) {
  if (obj.is_undefined()) FailUndefined(obj, where);
  // jinja2 tries getattr() first, so dict methods win over keys of the same name.
  if (HasMethod(obj, name)) {
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

}  // namespace shardserve::chat
