// The value type of the chat-template engine and the operations on values alone: Python semantics of
// truth, equality, ordering, str() and repr(), JSON in (nlohmann) and out (json.dumps as
// transformers' `tojson` calls it), operators, attribute and item access. The filters and tests
// that real chat templates use are in filters.h, the methods of str and dict (str.strip,
// dict.items ...) in methods.h, Python's str operations they share in py_str.h.
//
// Values are cheap to copy: strings are copied, lists and dicts are shared (Python reference
// semantics: `namespace` attributes set in a loop are seen outside it). A Value is not thread-safe;
// each render owns its values.
//
// Inside a render, what creates lists, dicts and strings charges the render's budget
// (budget.h), before allocating where the size is known; a budget exceeded throws
// BudgetError. Outside a render (FromJson of the request, the parser's literals) nothing is charged.
#ifndef SHARDSERVE_COORDINATOR_CHAT_VALUE_H_
#define SHARDSERVE_COORDINATOR_CHAT_VALUE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "coordinator/chat/lexer.h"
#include "nlohmann/json.hpp"

namespace shardserve::chat {

class Value;

// The arguments of a call: positional, then keyword, and where the call is in the template.
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> kwargs;
  Location where;

  // Argument `index`, or keyword `name`, or nullopt.
  const Value* Get(size_t index, const std::string& name) const;
};

using Function = std::function<Value(CallArgs&)>;

// An insertion-ordered dict (Python 3.7+ semantics, which json.dumps and `items` show).
struct Dict {
  std::vector<std::pair<Value, Value>> items;
  bool is_namespace = false;  // made by namespace(): the only dict `set x.attr = ...` may change

  const Value* Find(const Value& key) const;
  void Set(const Value& key, Value value);
};

class Value {
 public:
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kFunction };

  Value() = default;  // undefined
  Value(bool b) : kind_(Kind::kBool), int_(b) {}  // NOLINT: implicit on purpose, as in Python
  Value(int v) : kind_(Kind::kInt), int_(v) {}  // NOLINT
  Value(int64_t v) : kind_(Kind::kInt), int_(v) {}  // NOLINT
  Value(double v) : kind_(Kind::kFloat), float_(v) {}  // NOLINT
  // Inside a render, a new string is charged to its byte budget (budget.h).
  Value(std::string s);  // NOLINT
  Value(const char* s) : Value(std::string(s)) {}  // NOLINT

  // An undefined value; `hint` is what was looked up, for the error if it is then used.
  static Value Undefined(std::string hint = "");
  static Value None();
  static Value List(std::vector<Value> items = {});
  // A Python tuple: a list that prints as (a, b) and never equals a list.
  static Value Tuple(std::vector<Value> items);
  static Value MakeDict(Dict dict = {});
  static Value Func(std::string name, Function fn);
  // JSON from the request or the tokenizer config: objects keep their key order.
  static Value FromJson(const nlohmann::ordered_json& json);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt; }
  bool is_float() const { return kind_ == Kind::kFloat; }
  bool is_number() const { return kind_ == Kind::kInt || kind_ == Kind::kFloat || kind_ == Kind::kBool; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_function() const { return kind_ == Kind::kFunction; }
  bool is_tuple() const { return kind_ == Kind::kList && tuple_; }

  bool Truthy() const;
  int64_t AsInt() const { return int_; }  // kInt, kBool
  double AsDouble() const { return kind_ == Kind::kFloat ? float_ : static_cast<double>(int_); }
  const std::string& AsString() const { return *str_; }
  std::vector<Value>& AsList() const { return *list_; }
  Dict& AsDict() const { return *dict_; }
  const Function& AsFunction() const { return *fn_; }
  const std::string& undefined_hint() const { return name_; }
  const std::string& function_name() const { return name_; }

  // Python's str(): what {{ value }} prints (undefined prints nothing, None prints "None").
  std::string Str() const;
  // Python's repr(), used by str() of lists and dicts.
  std::string Repr() const;
  // json.dumps(value, ensure_ascii=False, indent=indent, separators=..., sort_keys=...):
  // indent < 0 means None. Throws TemplateError at `where` for what JSON cannot hold.
  std::string ToJson(int indent, const std::string& item_sep, const std::string& key_sep, bool sort_keys,
                     Location where) const;
  // Python type name, for error messages: "str", "int", "dict", "NoneType" ...
  std::string TypeName() const;

 private:
  void ReprTo(std::string* out) const;

  Kind kind_ = Kind::kUndefined;
  int64_t int_ = 0;
  double float_ = 0;
  bool tuple_ = false;
  std::string name_;  // undefined: the name looked up; function: its name
  std::shared_ptr<std::string> str_;
  std::shared_ptr<std::vector<Value>> list_;
  std::shared_ptr<Dict> dict_;
  std::shared_ptr<Function> fn_;
};

// Python ==.
bool Equals(const Value& a, const Value& b);
// Python <, for numbers, strings and lists; anything else throws TemplateError at `where`.
bool Less(const Value& a, const Value& b, Location where);
// Python's repr() of a float: shortest round-trip digits, "1.0", "1e-05", "1e+16", "inf", "nan".
std::string FloatRepr(double v);

// --- operations the runtime applies to values; each throws TemplateError at `where` ---

// Binary operators: + - * / // % ** ~ and `in`.
Value BinaryOp(const std::string& op, const Value& a, const Value& b, Location where);
// obj.name: an attribute (dict key, list/str method bound to obj), else undefined.
Value GetAttr(const Value& obj, const std::string& name, Location where);
// obj[key]: dict lookup, list/str index (negative from the end), else undefined.
Value GetItem(const Value& obj, const Value& key, Location where);
// obj[start:stop:step] for lists and strings, Python semantics; null members are absent.
Value Slice(const Value& obj, const Value* start, const Value* stop, const Value* step, Location where);
// The items a `for` loop visits: list items, dict keys, string characters; undefined is empty.
std::vector<Value> Iterate(const Value& v, Location where);
// Python's a % b for ints: the remainder takes the sign of b (b != 0).
int64_t PyMod(int64_t a, int64_t b);
// An int (or bool) used as an index, a count or a size; anything else throws TemplateError at `where`.
int64_t ToIndex(const Value& v, Location where);

// Appends code point `cp` to `out` as UTF-8 (utf8proc's encoder; the lexer's \u escapes and the
// string methods share it).
void AppendUtf8(std::string* out, uint32_t cp);

}  // namespace shardserve::chat

#endif  // SHARDSERVE_COORDINATOR_CHAT_VALUE_H_
