// JSON Schema to GBNF (grammar/json_schema.h).
#include "grammar/json_schema.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/json.h"
#include "base/status_macros.h"

namespace shardserve::grammar {
namespace {

using Json = nlohmann::ordered_json;

// The JSON lexicon, written so that a string's characters and a number's digits are read by a
// class star inside one rule (grammar.h: their tokens are then decided at compile time).
constexpr char kBasics[] = R"(json-string ::= "\"" json-string-body
json-string-body ::= [^"\\\x00-\x1F]* json-string-tail
json-string-tail ::= "\"" | "\\" json-escape json-string-body
json-escape ::= ["\\/bfnrt] | "u" [0-9A-Fa-f] [0-9A-Fa-f] [0-9A-Fa-f] [0-9A-Fa-f]
json-integer ::= "0" | "-"? [1-9] [0-9]*
json-number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [+-]? [0-9]+)?
json-boolean ::= "true" | "false"
json-null ::= "null"
json-value ::= json-number | json-string | json-boolean | json-null | json-array | json-object
json-array ::= "[" (json-value ("," json-value)*)? "]"
json-object ::= "{" (json-string ":" json-value ("," json-string ":" json-value)*)? "}"
)";

// Formats as regular expressions over the string's characters (the languages xgrammar gives them,
// except email's quoted local part, which is left out).
const std::map<std::string, std::string>& Formats() {
  static const auto* formats = [] {
    const std::string date = "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])";
    const std::string time =
        "([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])";
    const std::string atext = "[a-zA-Z0-9_!#$%&'*+/=?^`{|}~-]";
    const std::string octet = "(25[0-5]|2[0-4][0-9]|[01]?[0-9]?[0-9])";
    return new std::map<std::string, std::string>{
        {"date", date},
        {"time", time},
        {"date-time", date + "T" + time},
        {"uuid", "[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}"},
        {"email", atext + "+(\\." + atext + "+)*@[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?(\\.[A-Za-z0-9][-A-Za-z0-9]*[A-Za-z0-9])*"},
        {"ipv4", "(" + octet + "\\.){3}" + octet},
    };
  }();
  return *formats;
}

const std::set<std::string>& Annotations() {
  static const auto* keys = new std::set<std::string>{
      "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
      "writeOnly", "$defs", "definitions", "strict", "name"};
  return *keys;
}

const std::set<std::string>& Supported() {
  static const auto* keys = new std::set<std::string>{
      "type", "properties", "required", "additionalProperties", "enum", "const", "anyOf", "oneOf", "$ref", "items",
      "prefixItems", "minItems", "maxItems", "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
      "exclusiveMinimum", "exclusiveMaximum"};
  return *keys;
}

// Decimal digits of n >= 0.
std::string Digits(uint64_t n) { return std::to_string(n); }

// GBNF alternatives for the decimal strings of equal length between lo and hi (lo <= hi).
std::string SameLengthRange(const std::string& lo, const std::string& hi) {
  if (lo.empty()) return "\"\"";
  if (lo == hi) return GbnfLiteral(lo);
  const std::string rest_lo = lo.substr(1), rest_hi = hi.substr(1);
  const size_t n = rest_lo.size();
  auto any_digits = [&]() { return n == 0 ? std::string() : absl::StrCat(" [0-9]{", n, "}"); };
  if (lo[0] == hi[0]) return absl::StrCat("\"", std::string(1, lo[0]), "\" (", SameLengthRange(rest_lo, rest_hi), ")");
  if (rest_lo == std::string(n, '0') && rest_hi == std::string(n, '9')) {
    return absl::StrCat("[", std::string(1, lo[0]), "-", std::string(1, hi[0]), "]", any_digits());
  }
  std::vector<std::string> alts;
  alts.push_back(absl::StrCat("\"", std::string(1, lo[0]), "\" (", SameLengthRange(rest_lo, std::string(n, '9')), ")"));
  if (hi[0] - lo[0] >= 2) {
    alts.push_back(absl::StrCat("[", std::string(1, static_cast<char>(lo[0] + 1)), "-",
                                std::string(1, static_cast<char>(hi[0] - 1)), "]", any_digits()));
  }
  alts.push_back(absl::StrCat("\"", std::string(1, hi[0]), "\" (", SameLengthRange(std::string(n, '0'), rest_hi), ")"));
  return absl::StrJoin(alts, " | ");
}

// Positive integers in [lo, hi] (1 <= lo; hi nullopt: unbounded), without leading zeros.
std::string PositiveRange(uint64_t lo, std::optional<uint64_t> hi) {
  std::vector<std::string> alts;
  const std::string lo_s = Digits(lo);
  const size_t max_len = hi.has_value() ? Digits(*hi).size() : lo_s.size();
  for (size_t len = lo_s.size(); len <= max_len; ++len) {
    const std::string a = len == lo_s.size() ? lo_s : "1" + std::string(len - 1, '0');
    const std::string b = hi.has_value() && len == max_len ? Digits(*hi) : std::string(len, '9');
    alts.push_back(absl::StrCat("(", SameLengthRange(a, b), ")"));
  }
  if (!hi.has_value()) alts.push_back(absl::StrCat("[1-9] [0-9]{", lo_s.size(), ",}"));
  return absl::StrJoin(alts, " | ");
}

// Integers in [lo, hi] (nullopt: unbounded that side), as "0" | "-"? [1-9][0-9]* writes them.
std::string IntegerRange(std::optional<int64_t> lo, std::optional<int64_t> hi) {
  std::vector<std::string> alts;
  // Negative values: "-" then the magnitudes in [max(1, -hi), -lo].
  if (!lo.has_value() || *lo < 0) {
    const uint64_t mag_lo = hi.has_value() && *hi < 0 ? static_cast<uint64_t>(-(*hi + 1)) + 1 : 1;
    std::optional<uint64_t> mag_hi;
    if (lo.has_value()) mag_hi = static_cast<uint64_t>(-(*lo + 1)) + 1;
    if (!mag_hi.has_value() || mag_lo <= *mag_hi) alts.push_back(absl::StrCat("\"-\" (", PositiveRange(mag_lo, mag_hi), ")"));
  }
  if ((!lo.has_value() || *lo <= 0) && (!hi.has_value() || *hi >= 0)) alts.push_back("\"0\"");
  if (!hi.has_value() || *hi > 0) {
    const uint64_t p_lo = lo.has_value() && *lo > 0 ? static_cast<uint64_t>(*lo) : 1;
    std::optional<uint64_t> p_hi;
    if (hi.has_value()) p_hi = static_cast<uint64_t>(*hi);
    if (!p_hi.has_value() || p_lo <= *p_hi) alts.push_back(absl::StrCat("(", PositiveRange(p_lo, p_hi), ")"));
  }
  return alts.empty() ? std::string() : absl::StrJoin(alts, " | ");
}

class SchemaWriter {
 public:
  // Helper rules are named `prefix` and a counter.
  explicit SchemaWriter(const Json& root, std::string prefix = "") : root_(root), prefix_(std::move(prefix)) {}

  // `root_name ::= ...`, then the shared JSON rules (kBasics) when `basics`, then the helpers.
  absl::StatusOr<std::string> Write(std::string_view root_name = "root", bool basics = true) {
    SHARDSERVE_ASSIGN_OR_RETURN(std::string body, Visit(root_, "", 0));
    std::string out = absl::StrCat(std::string(root_name), " ::= ", body, "\n", basics ? kBasics : "");
    for (const auto& [name, rule] : rules_) absl::StrAppend(&out, name, " ::= ", rule, "\n");
    return out;
  }

 private:
  static absl::Status Error(const std::string& path, const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("JSON Schema at ", path.empty() ? "/" : path, ": ", what));
  }

  // A rule named after `hint`, holding `body`; returns its name.
  std::string AddRule(const std::string& hint, std::string body) {
    const std::string name = absl::StrCat(prefix_, "s", rules_.size(), "-", hint);
    rules_[name] = std::move(body);
    return name;
  }

  absl::StatusOr<std::string> Ref(const std::string& ref, const std::string& path, int depth) {
    auto it = refs_.find(ref);
    if (it != refs_.end()) return it->second;
    const Json* target = nullptr;
    if (ref == "#") {
      target = &root_;
    } else {
      for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
        const std::string p = prefix;
        if (ref.rfind(p, 0) != 0) continue;
        const std::string key = p.substr(2, p.size() - 3);
        const std::string name = ref.substr(p.size());
        if (root_.contains(key) && root_[key].is_object() && root_[key].contains(name)) target = &root_[key][name];
      }
    }
    if (target == nullptr) return Error(path, absl::StrCat("$ref \"", ref, "\" does not name \"#\", #/$defs/NAME or #/definitions/NAME of this schema"));
    const std::string name = absl::StrCat(prefix_, "ref", refs_.size());
    refs_[ref] = name;  // before the visit: a recursive reference finds it
    SHARDSERVE_ASSIGN_OR_RETURN(std::string body, Visit(*target, ref.substr(1), depth + 1));
    rules_[name] = body;
    return name;
  }

  absl::StatusOr<std::string> Visit(const Json& s, const std::string& path, int depth) {
    if (depth > kMaxNesting) return Error(path, absl::StrCat("schemas nested deeper than ", kMaxNesting));
    if (++visits_ > 100000) return Error(path, "the schema is too large");
    if (s.is_boolean()) {
      if (s.get<bool>()) return std::string("json-value");
      return Error(path, "the schema false admits no value");
    }
    if (!s.is_object()) return Error(path, "a schema must be an object or a boolean");
    for (const auto& [key, value] : s.items()) {
      if (!Supported().contains(key) && !Annotations().contains(key)) {
        return Error(path, absl::StrCat("unsupported keyword \"", key, "\""));
      }
    }
    if (s.contains("$ref")) {
      if (!s["$ref"].is_string()) return Error(path + "/$ref", "must be a string");
      return Ref(s["$ref"].get<std::string>(), path, depth);
    }
    if (s.contains("const")) return GbnfLiteral(s["const"].dump());
    if (s.contains("enum")) {
      const Json& e = s["enum"];
      if (!e.is_array() || e.empty()) return Error(path + "/enum", "must be a non-empty array");
      std::vector<std::string> alts;
      for (const Json& v : e) alts.push_back(GbnfLiteral(v.dump()));
      return absl::StrCat("(", absl::StrJoin(alts, " | "), ")");
    }
    for (const char* key : {"anyOf", "oneOf"}) {
      if (!s.contains(key)) continue;
      const Json& list = s[key];
      if (!list.is_array() || list.empty()) return Error(path + "/" + key, "must be a non-empty array");
      std::vector<std::string> alts;
      for (size_t i = 0; i < list.size(); ++i) {
        SHARDSERVE_ASSIGN_OR_RETURN(std::string alt, Visit(list[i], absl::StrCat(path, "/", key, "/", i), depth + 1));
        alts.push_back(alt);
      }
      return absl::StrCat("(", absl::StrJoin(alts, " | "), ")");
    }
    std::vector<std::string> types;
    if (s.contains("type")) {
      const Json& t = s["type"];
      if (t.is_string()) {
        types.push_back(t.get<std::string>());
      } else if (t.is_array() && !t.empty()) {
        for (const Json& x : t) {
          if (!x.is_string()) return Error(path + "/type", "must be a string or an array of strings");
          types.push_back(x.get<std::string>());
        }
      } else {
        return Error(path + "/type", "must be a string or an array of strings");
      }
    } else if (s.contains("properties") || s.contains("additionalProperties") || s.contains("required")) {
      types = {"object"};
    } else if (s.contains("items") || s.contains("prefixItems") || s.contains("minItems") || s.contains("maxItems")) {
      types = {"array"};
    } else if (s.contains("pattern") || s.contains("format") || s.contains("minLength") || s.contains("maxLength")) {
      types = {"string"};
    } else if (s.contains("minimum") || s.contains("maximum") || s.contains("exclusiveMinimum") || s.contains("exclusiveMaximum")) {
      types = {"number"};
    } else {
      return std::string("json-value");
    }
    std::vector<std::string> alts;
    for (const std::string& type : types) {
      SHARDSERVE_ASSIGN_OR_RETURN(std::string alt, VisitType(s, type, path, depth));
      alts.push_back(alt);
    }
    return alts.size() == 1 ? alts[0] : absl::StrCat("(", absl::StrJoin(alts, " | "), ")");
  }

  absl::StatusOr<std::optional<int64_t>> Count(const Json& s, const char* key, const std::string& path) {
    if (!s.contains(key)) return std::optional<int64_t>();
    const Json& v = s[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > kMaxRepeat) {
      return Error(absl::StrCat(path, "/", key), absl::StrCat("must be an integer from 0 to ", kMaxRepeat));
    }
    return std::optional<int64_t>(v.get<int64_t>());
  }

  absl::StatusOr<std::string> VisitType(const Json& s, const std::string& type, const std::string& path, int depth) {
    if (type == "null") return std::string("json-null");
    if (type == "boolean") return std::string("json-boolean");
    if (type == "string") return VisitString(s, path);
    if (type == "integer" || type == "number") return VisitNumber(s, type == "integer", path);
    if (type == "array") return VisitArray(s, path, depth);
    if (type == "object") return VisitObject(s, path, depth);
    return Error(path + "/type", absl::StrCat("unknown type \"", type, "\""));
  }

  absl::StatusOr<std::string> VisitString(const Json& s, const std::string& path) {
    SHARDSERVE_ASSIGN_OR_RETURN(std::optional<int64_t> min, Count(s, "minLength", path));
    SHARDSERVE_ASSIGN_OR_RETURN(std::optional<int64_t> max, Count(s, "maxLength", path));
    if (min.has_value() && max.has_value() && *max < *min) return Error(path, "maxLength is less than minLength");
    const bool lengths = min.has_value() || max.has_value();
    std::optional<std::string> regex;
    if (s.contains("pattern")) {
      if (!s["pattern"].is_string()) return Error(path + "/pattern", "must be a string");
      regex = s["pattern"].get<std::string>();
    }
    if (s.contains("format")) {
      if (!s["format"].is_string()) return Error(path + "/format", "must be a string");
      const std::string format = s["format"].get<std::string>();
      auto it = Formats().find(format);
      if (it == Formats().end()) return Error(path + "/format", absl::StrCat("unsupported format \"", format, "\""));
      if (regex.has_value()) return Error(path, "pattern and format together are not supported");
      regex = it->second;
    }
    if (regex.has_value()) {
      if (lengths) return Error(path, "minLength / maxLength with a pattern or format are not supported");
      absl::StatusOr<std::string> body = RegexToGbnf(*regex);
      if (!body.ok()) return Error(path + (s.contains("pattern") ? "/pattern" : "/format"), std::string(body.status().message()));
      return AddRule("string", absl::StrCat("\"\\\"\" ", *body, " \"\\\"\""));
    }
    if (!lengths) return std::string("json-string");
    // One rule per count of characters read, each calling the next in tail position, so that the
    // whole string is one frame on the stack (grammar.h): "\"" then after k characters
    // `[^"\\\x00-\x1F] next | "\\" json-escape next | "\""` (the quote once k >= minLength).
    const int64_t lo = min.value_or(0);
    const int64_t top = max.has_value() ? *max : lo;
    std::string next = max.has_value() ? std::string("\"\\\"\"") : std::string("json-string-body");
    for (int64_t k = top - 1; k >= 0; --k) {
      std::string body = absl::StrCat("[^\"\\\\\\x00-\\x1F] ", next, " | \"\\\\\" json-escape ", next);
      if (k >= lo) absl::StrAppend(&body, " | \"\\\"\"");
      next = AddRule("chars", body);
    }
    return AddRule("string", absl::StrCat("\"\\\"\" ", next));
  }

  absl::StatusOr<std::string> VisitNumber(const Json& s, bool integer, const std::string& path) {
    std::optional<int64_t> lo, hi;
    constexpr double kLimit = 9e15;  // integers a double holds exactly, with room
    bool excl_lo = false, excl_hi = false;
    for (const std::string key : {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"}) {
      if (!s.contains(key)) continue;
      const Json& v = s[key];
      if (!v.is_number()) return Error(absl::StrCat(path, "/", key), "must be a number");
      const double d = v.get<double>();
      if (!std::isfinite(d) || std::fabs(d) > kLimit) return Error(absl::StrCat(path, "/", key), "is out of range");
      const bool lower = key == "minimum" || key == "exclusiveMinimum";
      const bool exclusive = key.rfind("exclusive", 0) == 0;
      if (!integer && d != std::floor(d)) {
        return Error(absl::StrCat(path, "/", key), "a number's bound must be an integer");
      }
      int64_t b = lower ? static_cast<int64_t>(std::ceil(d)) : static_cast<int64_t>(std::floor(d));
      if (integer && exclusive && static_cast<double>(b) == d) b += lower ? 1 : -1;
      if (lower) {
        if (!lo.has_value() || b > *lo || (b == *lo && exclusive)) excl_lo = !integer && exclusive;
        lo = lo.has_value() ? std::max(*lo, b) : b;
      } else {
        if (!hi.has_value() || b < *hi || (b == *hi && exclusive)) excl_hi = !integer && exclusive;
        hi = hi.has_value() ? std::min(*hi, b) : b;
      }
    }
    if (!lo.has_value() && !hi.has_value()) return std::string(integer ? "json-integer" : "json-number");
    if (lo.has_value() && hi.has_value() && *lo > *hi) return Error(path, "the bounds admit no value");
    if (integer) return AddRule("integer", IntegerRange(lo, hi));
    // A bounded number: an integer in range, or I.F with a fraction that is not all zeros, which
    // lies strictly between two integers; no exponent.
    std::vector<std::string> alts;
    const std::optional<int64_t> int_lo = lo.has_value() && excl_lo ? std::optional<int64_t>(*lo + 1) : lo;
    const std::optional<int64_t> int_hi = hi.has_value() && excl_hi ? std::optional<int64_t>(*hi - 1) : hi;
    if (!int_lo.has_value() || !int_hi.has_value() || *int_lo <= *int_hi) {
      const std::string ints = IntegerRange(int_lo, int_hi);
      if (!ints.empty()) alts.push_back(absl::StrCat("(", ints, ")"));
    }
    const std::string fraction = "\".\" [0-9]* [1-9]";
    // I.F with I in [i_lo, i_hi] (nullopt: unbounded), after `sign`.
    auto fractions = [&](uint64_t i_lo, std::optional<uint64_t> i_hi, const std::string& sign) {
      if (i_hi.has_value() && i_lo > *i_hi) return;
      std::string part = i_lo == 0 ? "\"0\"" : "";
      if (!i_hi.has_value() || *i_hi >= 1) {
        const std::string pos = PositiveRange(std::max<uint64_t>(i_lo, 1), i_hi);
        part = part.empty() ? pos : absl::StrCat(part, " | ", pos);
      }
      alts.push_back(absl::StrCat(sign, "(", part, ") ", fraction));
    };
    // Positive side: I.F in (I, I+1) with I >= max(lo, 0) and I + 1 <= hi.
    if (!hi.has_value() || *hi >= 1) {
      fractions(lo.has_value() && *lo > 0 ? static_cast<uint64_t>(*lo) : 0,
                hi.has_value() ? std::optional<uint64_t>(*hi - 1) : std::nullopt, "");
    }
    // Negative side: -I.F in (-(I+1), -I) with I >= max(-hi, 0) and -(I+1) >= lo.
    if (!lo.has_value() || *lo <= -1) {
      fractions(hi.has_value() && *hi < 0 ? static_cast<uint64_t>(-*hi) : 0,
                lo.has_value() ? std::optional<uint64_t>(-*lo - 1) : std::nullopt, "\"-\" ");
    }
    if (alts.empty()) return Error(path, "the bounds admit no value");
    return AddRule("number", absl::StrJoin(alts, " | "));
  }

  absl::StatusOr<std::string> VisitArray(const Json& s, const std::string& path, int depth) {
    SHARDSERVE_ASSIGN_OR_RETURN(std::optional<int64_t> min, Count(s, "minItems", path));
    SHARDSERVE_ASSIGN_OR_RETURN(std::optional<int64_t> max, Count(s, "maxItems", path));
    if (min.has_value() && max.has_value() && *max < *min) return Error(path, "maxItems is less than minItems");
    std::vector<std::string> prefix;
    if (s.contains("prefixItems")) {
      const Json& p = s["prefixItems"];
      if (!p.is_array()) return Error(path + "/prefixItems", "must be an array");
      for (size_t i = 0; i < p.size(); ++i) {
        SHARDSERVE_ASSIGN_OR_RETURN(std::string item, Visit(p[i], absl::StrCat(path, "/prefixItems/", i), depth + 1));
        prefix.push_back(item);
      }
    }
    std::optional<std::string> item;  // nullopt: no items past the prefix
    if (s.contains("items")) {
      if (!(s["items"].is_boolean() && !s["items"].get<bool>())) {
        SHARDSERVE_ASSIGN_OR_RETURN(std::string i, Visit(s["items"], path + "/items", depth + 1));
        item = i;
      }
    } else if (prefix.empty()) {
      item = "json-value";
    }
    const int64_t k = static_cast<int64_t>(prefix.size());
    const int64_t lo = min.value_or(0);
    if (lo > k && !item.has_value()) return Error(path, "minItems exceeds the items the schema admits");
    if (max.has_value() && *max < k) prefix.resize(*max);
    // The items from index i on, after i items (i > 0: each starts with a comma).
    // Prefix items past minItems may be left out, and with them everything after.
    std::string tail;  // items past the prefix
    if (item.has_value() && (!max.has_value() || *max > k)) {
      const int64_t extra_lo = std::max<int64_t>(0, lo - k);
      const std::optional<int64_t> extra_hi = max.has_value() ? std::optional<int64_t>(*max - k) : std::nullopt;
      const std::string hi_text = extra_hi.has_value() ? absl::StrCat(*extra_hi) : "";
      if (k > 0) {
        tail = absl::StrCat("(\",\" ", *item, "){", extra_lo, ",", hi_text, "}");
      } else if (extra_lo > 0) {
        const std::string more_hi = extra_hi.has_value() ? absl::StrCat(*extra_hi - 1) : "";
        tail = absl::StrCat(*item, " (\",\" ", *item, "){", extra_lo - 1, ",", more_hi, "}");
      } else if (!extra_hi.has_value() || *extra_hi > 0) {
        const std::string more_hi = extra_hi.has_value() ? absl::StrCat(*extra_hi - 1) : "";
        tail = absl::StrCat("(", *item, " (\",\" ", *item, "){0,", more_hi, "})?");
      }
    }
    std::string body = tail;
    for (int64_t i = static_cast<int64_t>(prefix.size()) - 1; i >= 0; --i) {
      const std::string sep = i > 0 ? "\",\" " : "";
      std::string here = absl::StrCat(sep, prefix[i], body.empty() ? "" : " ", body);
      body = i >= lo ? absl::StrCat("(", here, ")?") : here;
    }
    return AddRule("array", absl::StrCat("\"[\" ", body, body.empty() ? "" : " ", "\"]\""));
  }

  absl::StatusOr<std::string> VisitObject(const Json& s, const std::string& path, int depth) {
    std::vector<std::pair<std::string, std::string>> props;  // (key literal, value)
    std::set<std::string> required;
    if (s.contains("required")) {
      if (!s["required"].is_array()) return Error(path + "/required", "must be an array of strings");
      for (const Json& r : s["required"]) {
        if (!r.is_string()) return Error(path + "/required", "must be an array of strings");
        required.insert(r.get<std::string>());
      }
    }
    if (s.contains("properties")) {
      if (!s["properties"].is_object()) return Error(path + "/properties", "must be an object");
      for (const auto& [key, schema] : s["properties"].items()) {
        SHARDSERVE_ASSIGN_OR_RETURN(std::string v, Visit(schema, absl::StrCat(path, "/properties/", key), depth + 1));
        props.push_back({key, v});
      }
    }
    for (const std::string& r : required) {
      bool found = false;
      for (const auto& p : props) found |= p.first == r;
      if (!found) return Error(path + "/required", absl::StrCat("\"", r, "\" is not among the properties"));
    }
    std::optional<std::string> extra;  // the value schema of other properties
    if (s.contains("additionalProperties")) {
      const Json& a = s["additionalProperties"];
      if (!(a.is_boolean() && !a.get<bool>())) {
        SHARDSERVE_ASSIGN_OR_RETURN(std::string v, Visit(a, path + "/additionalProperties", depth + 1));
        extra = v;
      }
    } else if (props.empty()) {
      extra = "json-value";
    }
    // after[i]: properties i.. once one has been written (each starts with a comma);
    // first[i]: properties i.. when none has been written yet.
    const size_t n = props.size();
    std::string after = extra.has_value() ? absl::StrCat("(\",\" json-string \":\" ", *extra, ")*") : "";
    std::string first = extra.has_value() ? absl::StrCat("(json-string \":\" ", *extra, " ", after, ")?") : "";
    for (size_t i = n; i-- > 0;) {
      const std::string pair = absl::StrCat(GbnfLiteral(Json(props[i].first).dump()), " \":\" ", props[i].second);
      const std::string after_rule = AddRule("props", after.empty() ? "\"\"" : after);
      const std::string first_rule = AddRule("props", first.empty() ? "\"\"" : first);
      std::string with = absl::StrCat(pair, " ", after_rule);
      if (required.contains(props[i].first)) {
        after = absl::StrCat("\",\" ", with);
        first = with;
      } else {
        after = absl::StrCat("\",\" ", with, " | ", after_rule);
        first = absl::StrCat(with, " | ", first_rule);
      }
      // Keep each level a rule: the text stays linear in the number of properties.
      after = AddRule("props", after);
      first = AddRule("props", first);
    }
    return AddRule("object", absl::StrCat("\"{\" ", first.empty() ? "" : first + " ", "\"}\""));
  }

  const Json& root_;
  const std::string prefix_;
  std::map<std::string, std::string> rules_;
  std::map<std::string, std::string> refs_;
  int64_t visits_ = 0;
};

absl::StatusOr<Json> ParseSchema(std::string_view schema_json) {
  if (schema_json.size() > static_cast<size_t>(kMaxInputBytes)) {
    return absl::InvalidArgumentError(absl::StrCat("the JSON Schema is longer than ", kMaxInputBytes, " bytes"));
  }
  return ParseJson<Json>(schema_json, "the JSON Schema", kMaxNesting);
}

}  // namespace

absl::StatusOr<std::string> JsonSchemaToGbnf(std::string_view schema_json) {
  SHARDSERVE_ASSIGN_OR_RETURN(Json schema, ParseSchema(schema_json));
  return SchemaWriter(schema).Write();
}

absl::StatusOr<std::string> JsonSchemaToGbnfRules(std::string_view schema_json, std::string_view root_name,
                                                  std::string_view prefix) {
  SHARDSERVE_ASSIGN_OR_RETURN(Json schema, ParseSchema(schema_json));
  return SchemaWriter(schema, std::string(prefix)).Write(root_name, /*basics=*/false);
}

std::string JsonSharedGbnf() { return kBasics; }

absl::StatusOr<Grammar> GrammarFromJsonSchema(std::string_view schema_json) {
  SHARDSERVE_ASSIGN_OR_RETURN(std::string gbnf, JsonSchemaToGbnf(schema_json));
  return ParseGbnf(gbnf);
}

absl::StatusOr<Grammar> GrammarForAnyJson() { return ParseGbnf(absl::StrCat("root ::= json-value\n", kBasics)); }

}  // namespace shardserve::grammar
