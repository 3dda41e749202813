// An OpenAI API request body off the wire, as coordinator/api/openai/http_server.cc handles it: the
// first byte picks the endpoint (modulo 4: 0 /v1/chat/completions, 1 /v1/completions, 2 /tokenize,
// 3 /detokenize; of the chat bytes, those 4 modulo 8 /v1/responses, whose body ResponsesToChat
// makes a chat completion's first, a previous_response_id reading the input as stored before it),
// the rest is the body. ParseRequest (coordinator/api/openai/protocol.h), then for
// chat the demo model's chat template (continuing the final message when asked) and tokenizer, then
// PrepareGeneration against the demo model (models/demo) and the renaming of its errors; or
// ParseTokenizeRequest / ParseDetokenizeRequest, then the template and the tokenizer.
//
// Invariants: every refusal is InvalidArgument and names its field as its param when its message
// starts with one; an accepted request has 1 <= n <= kMaxChoices and prompt + max_tokens within
// max_model_len; the error body is valid JSON; a /v1/responses input accepted, stored
// (NormalizedInputItems) and read back makes the same chat messages, and its oldest turns dropped
// one by one (DropOldestTurn) leave fewer messages each time, the last one kept; its Response is
// made (ResponsesView, whole and streamed) without an exception, whatever its fields hold.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/api/openai/protocol.h"
#include "coordinator/api/openai/responses.h"
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

// A chat's prompt as the server renders it, or nullopt once a refusal was checked.
std::optional<std::string> Render(const shardserve::openai::Request& request) {
  const shardserve::ServedModel& model = Model();
  absl::StatusOr<std::string> prompt =
      request.continue_final_message
          ? model.chat_template->RenderContinuing(request.messages, request.tools, request.chat_template_kwargs)
          : model.chat_template->Render(request.messages, request.add_generation_prompt, request.tools,
                                        request.chat_template_kwargs);
  if (!prompt.ok()) {
    CheckRefusal(prompt.status());
    return std::nullopt;
  }
  return *std::move(prompt);
}

// /tokenize and /detokenize.
void Tokenize(const std::string& body) {
  const shardserve::Tokenizer& tokenizer = *Model().tokenizer;
  absl::StatusOr<shardserve::openai::TokenizeRequest> request = shardserve::openai::ParseTokenizeRequest(body);
  if (!request.ok()) return CheckRefusal(request.status());
  std::string text = request->prompt;
  if (request->chat) {
    Check(!request->messages.continue_final_message || !request->messages.add_generation_prompt,
          "a continuation with a generation prompt accepted");
    std::optional<std::string> prompt = Render(request->messages);
    if (!prompt.has_value()) return;
    text = *std::move(prompt);
  }
  absl::StatusOr<std::vector<int32_t>> ids = tokenizer.Encode(text, request->add_special_tokens);
  if (!ids.ok()) return;
  for (int32_t id : *ids) Check(id >= 0 && id < tokenizer.vocab_size(), "a token id outside the vocabulary");
}

void Detokenize(const std::string& body) {
  const shardserve::Tokenizer& tokenizer = *Model().tokenizer;
  absl::StatusOr<shardserve::openai::DetokenizeRequest> request = shardserve::openai::ParseDetokenizeRequest(body);
  if (!request.ok()) return CheckRefusal(request.status());
  std::vector<int32_t> known;
  for (int32_t id : request->tokens) {
    Check(id >= 0, "a negative token id accepted");
    if (id < tokenizer.vocab_size()) known.push_back(id);  // the server refuses the others by name
  }
  tokenizer.Decode(known, /*skip_special_tokens=*/false);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 8 == 4) {
    absl::StatusOr<nlohmann::ordered_json> parsed = shardserve::openai::ParseBody(body);
    // A previous_response_id continues a stored conversation: here the input itself, as stored.
    std::optional<nlohmann::ordered_json> earlier;
    if (parsed.ok() && parsed->is_object() && parsed->contains("previous_response_id") && parsed->contains("input")) {
      earlier = shardserve::openai::NormalizedInputItems((*parsed)["input"], "resp_fuzz");
    }
    const nlohmann::ordered_json* stored = earlier.has_value() ? &*earlier : nullptr;
    absl::StatusOr<nlohmann::ordered_json> chat = parsed.ok() ? shardserve::openai::ResponsesToChat(*parsed, stored)
                                                              : absl::StatusOr<nlohmann::ordered_json>(parsed.status());
    if (!chat.ok()) {
      CheckRefusal(chat.status());
      return 0;
    }
    // An accepted input, stored and read back, makes the same messages.
    nlohmann::ordered_json again = *parsed;
    again["input"] = shardserve::openai::NormalizedInputItems((*parsed)["input"], "resp_fuzz");
    absl::StatusOr<nlohmann::ordered_json> back = shardserve::openai::ResponsesToChat(again, stored);
    if (!back.ok() || (*back)["messages"] != (*chat)["messages"]) {
      std::fprintf(stderr, "the stored input reads back otherwise: %s\n", again.dump().c_str());
      std::abort();
    }
    // The answer's Response is made from the request's fields whatever they hold, whole and streamed.
    const nlohmann::ordered_json answer = nlohmann::ordered_json::parse(
        R"({"id": "chatcmpl-f", "created": 0, "model": "demo", "usage": {}, "choices": [{"index": 0,
            "finish_reason": "stop", "message": {"role": "assistant", "content": "x"}}]})");
    shardserve::openai::ResponsesView view(*parsed);
    view.Answer(answer);
    view.Chunk(nlohmann::ordered_json::parse(
        R"({"id": "chatcmpl-f", "created": 0, "model": "demo", "choices": [{"index": 0, "delta": {"content": "x"}}]})"));
    view.End();
    // truncation "auto" drops whole turns: fewer messages each time, the last one kept, then it stops.
    nlohmann::ordered_json messages = (*chat)["messages"];
    for (size_t size = messages.size(); shardserve::openai::DropOldestTurn(&messages, nullptr);
         size = messages.size()) {
      if (messages.size() >= size || messages.empty() || messages.back() != (*chat)["messages"].back()) {
        std::fprintf(stderr, "a dropped turn broke the conversation: %s\n", (*chat)["messages"].dump().c_str());
        std::abort();
      }
    }
    body = chat->dump();
  }
  if (data[0] % 4 == 2) {
    Tokenize(body);
    return 0;
  }
  if (data[0] % 4 == 3) {
    Detokenize(body);
    return 0;
  }
  const Endpoint endpoint = data[0] % 4 == 0 ? Endpoint::kChatCompletions : Endpoint::kCompletions;
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
    std::optional<std::string> prompt = Render(*request);
    if (!prompt.has_value()) return 0;
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
