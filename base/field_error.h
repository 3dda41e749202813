// A request field that is wrong, carried inside the error itself: the field's path as the API that
// checked it names it ("sampling.top_p", "prompt.token_ids.ids[3]", "messages[0].content") and
// what is wrong with it ("must be in [0, 1], got 2"). The status's message is "field: message",
// what a person reads; the FieldError travels beside it as the status's payloads, so that a layer
// that names the field otherwise (the OpenAI API's "top_p" for the gRPC API's "sampling.top_p")
// maps the field by its path and never reads the message.
//
// Threading: plain functions and values.
#ifndef SHARDSERVE_BASE_FIELD_ERROR_H_
#define SHARDSERVE_BASE_FIELD_ERROR_H_

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace shardserve {

struct FieldError {
  std::string field;    // the field's path
  std::string message;  // what is wrong with it
};

inline constexpr char kFieldPayload[] = "type.shardserve/field_error.field";
inline constexpr char kFieldMessagePayload[] = "type.shardserve/field_error.message";

// A status of `code` (InvalidArgument unless said) with the message "field: message", carrying the
// FieldError.
inline absl::Status FieldErrorStatus(absl::string_view field, absl::string_view message,
                                     absl::StatusCode code = absl::StatusCode::kInvalidArgument) {
  absl::Status s(code, absl::StrCat(field, ": ", message));
  s.SetPayload(kFieldPayload, absl::Cord(field));
  s.SetPayload(kFieldMessagePayload, absl::Cord(message));
  return s;
}

// The FieldError `status` carries, or none.
inline std::optional<FieldError> FieldErrorOf(const absl::Status& status) {
  const auto field = status.GetPayload(kFieldPayload);  // an absl::optional<absl::Cord>
  const auto message = status.GetPayload(kFieldMessagePayload);
  if (!field.has_value() || !message.has_value()) return std::nullopt;
  return FieldError{std::string(*field), std::string(*message)};
}

}  // namespace shardserve

#endif  // SHARDSERVE_BASE_FIELD_ERROR_H_
