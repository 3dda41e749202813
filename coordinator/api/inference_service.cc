#include "coordinator/api/inference_service.h"

#include <chrono>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordinator/api/grpc_status.h"
#include "coordinator/api/request_validation.h"
#include "coordinator/telemetry/log.h"

namespace shardserve {
namespace {

// How often a handler waiting for its next token checks whether its client gave up.
constexpr absl::Duration kCancelPoll = absl::Milliseconds(50);

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Why the call is over from the client's side: its deadline passed, or it cancelled. The client
// ends the call at its own deadline, which may come a little before the server's copy of it.
absl::Status ClientGone(grpc::ServerContext* context) {
  if (context->deadline() <= std::chrono::system_clock::now() + std::chrono::milliseconds(200)) {
    return absl::DeadlineExceededError("the request's deadline passed");
  }
  return absl::CancelledError("the client cancelled the request");
}

}  // namespace

grpc::Status InferenceService::Authenticate(grpc::ServerContext* context) {
  if (api_keys_ == nullptr) return grpc::Status::OK;
  std::optional<absl::string_view> header;
  const auto& metadata = context->client_metadata();
  if (auto it = metadata.find(kAuthorizationMetadata); it != metadata.end()) {
    header = absl::string_view(it->second.data(), it->second.size());
  }
  const ApiKeys::Verdict verdict = api_keys_->Check(header);
  if (verdict == ApiKeys::Verdict::kOk) return grpc::Status::OK;
  if (metrics_ != nullptr) metrics_->AuthFailure(verdict == ApiKeys::Verdict::kMissing ? "missing_key" : "invalid_key");
  return ToGrpcStatus(ApiKeys::ToStatus(verdict));
}

grpc::Status InferenceService::Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                                        grpc::ServerWriter<v1::GenerateResponse>* writer) {
  if (grpc::Status auth = Authenticate(context); !auth.ok()) return auth;
  const auto arrival = std::chrono::steady_clock::now();
  const absl::Status status = GenerateStatus(context, request, arrival, writer);
  if (metrics_ != nullptr) {
    metrics_->request_duration.Observe(SecondsSince(arrival));
    metrics_->Ended(absl::StatusCodeToString(status.code()));
  }
  return ToGrpcStatus(status);
}

absl::Status InferenceService::GenerateStatus(grpc::ServerContext* context, const v1::GenerateRequest* request,
                                              std::chrono::steady_clock::time_point arrival,
                                              grpc::ServerWriter<v1::GenerateResponse>* writer) {
  const std::string fallback_id = absl::StrFormat("req-%06d", next_request_.fetch_add(1));
  absl::StatusOr<GenerationParams> params =
      PrepareGeneration(*request, *model_, pool_->max_model_len(), fallback_id);
  if (!params.ok()) {
    // A malformed request_id is not written to the log (it may hold newlines or any byte).
    const bool own_id = !request->request_id().empty() && IsValidRequestId(request->request_id());
    CoordinatorRequestLog(own_id ? request->request_id() : fallback_id,
                          absl::StrCat("rejected: ", params.status().message()), "warn");
    return params.status();
  }
  const std::string id = params->request_id;
  absl::StatusOr<Engine::Submitted> submitted = engine_->Submit(*std::move(params), arrival);
  if (!submitted.ok()) {
    CoordinatorRequestLog(id, absl::StrCat("refused: ", submitted.status().message()), "warn");
    return submitted.status();
  }
  v1::GenerateResponse response;
  std::optional<absl::Status> ended;
  for (;;) {
    if (submitted->stream->Next(kCancelPoll, &response, &ended)) {
      if (!writer->Write(response)) {
        absl::Status why = ClientGone(context);
        engine_->Cancel(submitted->id, why);
        return why;
      }
    } else if (ended.has_value()) {
      return *ended;
    } else if (context->IsCancelled()) {
      absl::Status why = ClientGone(context);
      engine_->Cancel(submitted->id, why);
      return why;
    }
  }
}

grpc::Status InferenceService::Tokenize(grpc::ServerContext* context, const v1::TokenizeRequest* request,
                                        v1::TokenizeResponse* response) {
  if (grpc::Status auth = Authenticate(context); !auth.ok()) return auth;
  // Bytes on the wire (see inference.proto): checked whatever the model, naming the offending byte.
  if (absl::Status utf8 = CheckUtf8(request->text()); !utf8.ok()) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat("text: ", utf8.message())));
  }
  if (model_->tokenizer == nullptr) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("text: ", model_->NoTokenizer(), ", so it cannot tokenize text")));
  }
  absl::StatusOr<std::vector<int32_t>> ids = model_->tokenizer->Encode(request->text(), request->add_special_tokens());
  if (!ids.ok()) return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat("text: ", ids.status().message())));
  response->mutable_ids()->Add(ids->begin(), ids->end());
  return grpc::Status::OK;
}

void InferenceService::FillModelInfo(v1::ModelInfo* info) {
  const ModelConfig& c = model_->config;
  info->set_name(model_->name);
  info->set_architecture(c.architecture_name);
  info->set_vocab_size(c.vocab_size);
  info->set_num_layers(static_cast<int32_t>(c.num_hidden_layers));
  info->set_max_model_len(pool_->max_model_len());
  info->set_parameters(c.ParameterCount());
  info->set_dtype(model_->dtype_name());
  info->mutable_eos_token_ids()->Add(model_->eos_ids.begin(), model_->eos_ids.end());
}

grpc::Status InferenceService::GetModelInfo(grpc::ServerContext* context, const v1::GetModelInfoRequest*,
                                            v1::ModelInfo* response) {
  if (grpc::Status auth = Authenticate(context); !auth.ok()) return auth;
  FillModelInfo(response);
  return grpc::Status::OK;
}

grpc::Status InferenceService::GetClusterStatus(grpc::ServerContext* context, const v1::GetClusterStatusRequest*,
                                                v1::ClusterStatus* response) {
  if (grpc::Status auth = Authenticate(context); !auth.ok()) return auth;
  pool_->FillStatus(response);
  FillModelInfo(response->mutable_model());
  engine_->FillStatus(response->mutable_scheduler());
  return grpc::Status::OK;
}

}  // namespace shardserve
