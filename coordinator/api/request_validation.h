// The check of every generation request at the edge: both APIs (the gRPC InferenceService and the
// OpenAI HTTP API, whose body protocol.h first turns into a GenerateRequest) hand a request here
// before the engine sees it. Each field is checked once, against the model and max_model_len, and
// an error names the field (base/field_error.h) as the gRPC API spells it; the OpenAI API renames
// it to its own (openai::RenameGenerationError).
//
// Threading: plain functions over borrowed values; safe to call from any thread.
#ifndef SHARDSERVE_COORDINATOR_API_REQUEST_VALIDATION_H_
#define SHARDSERVE_COORDINATOR_API_REQUEST_VALIDATION_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "coordinator/engine/generation.h"
#include "coordinator/model/served_model.h"
#include "shardserve/v1/inference.pb.h"

namespace shardserve {

// A client's request_id may be logged and echoed: at most 128 printable ASCII characters without
// spaces (empty: the server makes one).
bool IsValidRequestId(absl::string_view id);
// OK for such an id, else InvalidArgument "FIELD: at most 128 printable characters ..." naming `field`
// (base/field_error.h): the gRPC API's request_id, the OpenAI API's request_id and X-Request-Id.
absl::Status CheckRequestId(absl::string_view field, absl::string_view id);

// OK when every id the tokenizer gave for a prompt is the model's (a tokenizer may hold more ids
// than config.json's vocab_size: Kimi K2's last two special ids); otherwise InvalidArgument on
// `field` naming the token and the vocabulary.
absl::Status CheckTokenizedPrompt(absl::string_view field, const std::vector<int32_t>& ids, const ServedModel& model);

// Checks `request` against the model and `max_model_len` and resolves it (defaults applied, text
// tokenized, a seed drawn, a structured output compiled); InvalidArgument naming the field
// otherwise. `default_request_id` is used when the request has none.
absl::StatusOr<GenerationParams> PrepareGeneration(const v1::GenerateRequest& request, const ServedModel& model,
                                                   int64_t max_model_len, const std::string& default_request_id);

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_API_REQUEST_VALIDATION_H_
