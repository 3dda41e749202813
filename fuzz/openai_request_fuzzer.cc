// An OpenAI API request body off the wire, as coordinator/api/openai/http_server.cc handles it: the
// first byte picks the endpoint (even: /v1/chat/completions, odd: /v1/completions), the rest is
// the body. ParseRequest (coordinator/api/openai/protocol.h), then for chat the demo model's chat
// template and tokenizer, then PrepareGeneration against the demo model (models/demo) and the
// renaming of its errors.
//
// Invariants: every refusal is InvalidArgument and names its field as its param when its message
// starts with one; an accepted request has 1 <= n <= kMaxChoices and prompt + max_tokens within
// max_model_len; the error body is valid JSON.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/api/openai/protocol.h"
#include "coordinator/api/request_validation.h"
#include "coordinator/model/served_model.h"
#include "nlohmann/json.hpp"

namespace {

using shardserve::openai::Endpoint;

const shardserve::ServedModel& Model() {
  static const shardserve::ServedModel* model = [] {
    absl::StatusOr<std::unique_ptr<shardserve::ServedModel>> m =
        shardserve::ServedModel::Open(std::string(SHARDSERVE_SOURCE_DIR) + "/models/demo");
    if (!m.ok() || (*m)->chat_template == nullptr) {
      std::fprintf(stderr, "openai_request_fuzzer: the demo model (with its chat template) does not load\n");
      std::abort();
    }
    return m->release();
  }();
  return *model;
}

void Check(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "openai_request_fuzzer: %s\n", what);
  std::abort();
}

void CheckRefusal(const absl::Status& status) {
  Check(absl::IsInvalidArgument(status), "a refusal that is not InvalidArgument");
  const std::string body = shardserve::openai::ErrorBody(shardserve::openai::ErrorFromStatus(status));
  Check(nlohmann::json::accept(body), "an error body that is not JSON");
  const std::string param = shardserve::openai::ParamOf(status);
  if (!param.empty()) Check(status.message().substr(0, param.size()) == param, "a param the message does not start with");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  Model();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const Endpoint endpoint = data[0] % 2 == 0 ? Endpoint::kChatCompletions : Endpoint::kCompletions;
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  absl::StatusOr<shardserve::openai::Request> request = shardserve::openai::ParseRequest(endpoint, body);
  if (!request.ok()) {
    CheckRefusal(request.status());
    return 0;
  }
  Check(request->n >= 1 && request->n <= shardserve::openai::kMaxChoices, "n out of range accepted");
  const bool chat = endpoint == Endpoint::kChatCompletions;
  const int prompts = chat ? 1 : static_cast<int>(request->prompts.size());
  Check(chat ? request->prompts.empty() : prompts >= 1 && prompts <= shardserve::openai::kMaxPrompts,
        "a completion's prompts out of range accepted");
  Check(static_cast<int64_t>(prompts) * request->n <= shardserve::openai::kMaxBatchChoices,
        "more choices than a request may have accepted");
  const shardserve::ServedModel& model = Model();
  const int64_t max_model_len = model.config.max_position_embeddings;
  std::optional<std::vector<int32_t>> ids;
  if (chat) {
    absl::StatusOr<std::string> prompt = model.chat_template->Render(
        request->messages, request->add_generation_prompt, request->tools, request->chat_template_kwargs);
    if (!prompt.ok()) {
      CheckRefusal(prompt.status());
      return 0;
    }
    absl::StatusOr<std::vector<int32_t>> encoded = model.tokenizer->Encode(*prompt, /*add_special_tokens=*/false);
    if (!encoded.ok()) return 0;
    ids = std::move(*encoded);
  }
  const int32_t max_tokens = static_cast<int32_t>(request->max_tokens.value_or(16));
  for (int p = 0; p < prompts; ++p) {
    const std::vector<int32_t>* prompt_ids = chat                         ? &*ids
                                             : request->prompts[p].is_ids ? &request->prompts[p].ids
                                                                          : nullptr;
    absl::StatusOr<shardserve::GenerationParams> params = shardserve::PrepareGeneration(
        shardserve::openai::ToGenerateRequest(*request, p, 0, max_tokens, prompt_ids), model, max_model_len,
        "cmpl-fuzz");
    if (!params.ok()) {
      CheckRefusal(shardserve::openai::RenameGenerationError(params.status(), endpoint, request->constraint_field,
                                                             prompts > 1 ? p : -1));
      return 0;
    }
    Check(static_cast<int64_t>(params->prompt.size()) + params->max_tokens <= max_model_len,
          "prompt + max_tokens exceed max_model_len");
  }
  return 0;
}
