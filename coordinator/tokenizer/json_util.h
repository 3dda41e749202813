// Checked access to the fields of tokenizer.json and its companion files. nlohmann::json throws
// on a type mismatch; these helpers test types first and turn a malformed file into an
// InvalidArgument status that names the component and the field.
#ifndef SHARDSERVE_COORDINATOR_TOKENIZER_JSON_UTIL_H_
#define SHARDSERVE_COORDINATOR_TOKENIZER_JSON_UTIL_H_

#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "coordinator/tokenizer/string_util.h"
#include "nlohmann/json.hpp"

namespace shardserve::tokenizer_internal {

using Json = nlohmann::json;

// `where` names the component in messages, e.g. "tokenizer.json: normalizer Replace".
inline absl::Status Malformed(std::string_view where, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(Sv(where), ": ", Sv(what)));
}

inline absl::Status Unsupported(std::string_view where, std::string_view what) {
  return absl::UnimplementedError(absl::StrCat(Sv(where), ": ", Sv(what), " is not supported"));
}

// The field `key` of `obj`, or nullptr when `obj` is not an object or has no such field.
inline const Json* Field(const Json& obj, std::string_view key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(key);
  return it == obj.end() ? nullptr : &*it;
}

inline absl::StatusOr<std::string> GetString(const Json& obj, std::string_view key, std::string_view where) {
  const Json* v = Field(obj, key);
  if (v == nullptr || !v->is_string()) return Malformed(where, absl::StrCat("'", Sv(key), "' must be a string"));
  return v->get_ref<const std::string&>();
}

// A boolean field that may be absent or null, which means `fallback`.
inline absl::StatusOr<bool> GetBool(const Json& obj, std::string_view key, bool fallback, std::string_view where) {
  const Json* v = Field(obj, key);
  if (v == nullptr || v->is_null()) return fallback;
  if (!v->is_boolean()) return Malformed(where, absl::StrCat("'", Sv(key), "' must be true or false"));
  return v->get<bool>();
}

// A field that must be an array.
inline absl::StatusOr<const Json*> GetArray(const Json& obj, std::string_view key, std::string_view where) {
  const Json* v = Field(obj, key);
  if (v == nullptr || !v->is_array()) return Malformed(where, absl::StrCat("'", Sv(key), "' must be an array"));
  return v;
}

// A token that tokenizer_config.json names (`value` is its field `key`, or an item of it): a
// string, {"content": ...}, or absent (nullptr) / null (nullopt).
inline absl::StatusOr<std::optional<std::string>> ConfigToken(const Json* value, std::string_view key) {
  if (value == nullptr || value->is_null()) return std::optional<std::string>();
  if (value->is_string()) return std::optional<std::string>(value->get<std::string>());
  if (const Json* content = Field(*value, "content"); content != nullptr && content->is_string()) {
    return std::optional<std::string>(content->get<std::string>());
  }
  return Malformed("tokenizer_config.json",
                   absl::StrCat("'", Sv(key), "' must be a string, an object with 'content', or null"));
}

// The "type" of a component object ("BPE", "NFC", "Sequence" ...).
inline absl::StatusOr<std::string> ComponentType(const Json& component, std::string_view where) {
  if (!component.is_object()) return Malformed(where, "must be an object or null");
  return GetString(component, "type", where);
}

// A pattern object, {"String": "..."} or {"Regex": "..."}: sets *text and *is_regex.
inline absl::Status GetPattern(const Json& obj, std::string_view where, std::string* text, bool* is_regex) {
  const Json* p = Field(obj, "pattern");
  if (p == nullptr || !p->is_object()) return Malformed(where, "'pattern' must be an object");
  if (const Json* s = Field(*p, "String"); s != nullptr && s->is_string()) {
    *text = s->get<std::string>();
    *is_regex = false;
    return absl::OkStatus();
  }
  if (const Json* r = Field(*p, "Regex"); r != nullptr && r->is_string()) {
    *text = r->get<std::string>();
    *is_regex = true;
    return absl::OkStatus();
  }
  return Malformed(where, "'pattern' must be {\"String\": ...} or {\"Regex\": ...}");
}

}  // namespace shardserve::tokenizer_internal

#endif  // SHARDSERVE_COORDINATOR_TOKENIZER_JSON_UTIL_H_
