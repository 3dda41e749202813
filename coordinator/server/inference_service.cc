#include "coordinator/server/inference_service.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "coordinator/server/grpc_status.h"
#include "coordinator/server/log.h"

namespace shardserve {
namespace {

// How often a request waiting for its turn checks whether its client gave up.
constexpr absl::Duration kTurnPoll = absl::Milliseconds(100);

const char* FinishName(v1::FinishReason r) {
  switch (r) {
    case v1::FINISH_REASON_STOP_TOKEN: return "stop token";
    case v1::FINISH_REASON_STOP_STRING: return "stop string";
    case v1::FINISH_REASON_LENGTH: return "length";
    default: return "unfinished";
  }
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

absl::Status InferenceService::TakeTurn(grpc::ServerContext* context) {
  absl::MutexLock lock(&mu_);
  while (busy_ && !shutting_down_) {
    if (context->IsCancelled()) return absl::CancelledError("the client cancelled while the request was queued");
    mu_.AwaitWithTimeout(absl::Condition(this, &InferenceService::TurnFree), kTurnPoll);
  }
  if (shutting_down_) return absl::UnavailableError("the coordinator is shutting down");
  busy_ = true;
  return absl::OkStatus();
}

void InferenceService::ReleaseTurn() {
  absl::MutexLock lock(&mu_);
  busy_ = false;
}

void InferenceService::Shutdown() {
  absl::MutexLock lock(&mu_);
  shutting_down_ = true;
}

grpc::Status InferenceService::Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                                        grpc::ServerWriter<v1::GenerateResponse>* writer) {
  const std::string fallback_id = absl::StrFormat("req-%06d", next_request_.fetch_add(1));
  absl::StatusOr<GenerationParams> params =
      PrepareGeneration(*request, *model_, pool_->max_model_len(), fallback_id);
  if (!params.ok()) {
    CoordinatorLog(request->request_id().empty() ? fallback_id : request->request_id(),
                   absl::StrCat("rejected: ", params.status().message()));
    return ToGrpcStatus(params.status());
  }
  if (absl::Status s = TakeTurn(context); !s.ok()) {
    CoordinatorLog(params->request_id, absl::StrCat("not run: ", s.message()));
    return ToGrpcStatus(s);
  }
  absl::Status status = Run(context, *params, writer);
  ReleaseTurn();
  return ToGrpcStatus(status);
}

absl::Status InferenceService::Run(grpc::ServerContext* context, const GenerationParams& params,
                                   grpc::ServerWriter<v1::GenerateResponse>* writer) {
  const std::string& id = params.request_id;
  if (absl::Status s = pool_->CheckServing(); !s.ok()) {
    CoordinatorLog(id, absl::StrCat("refused: ", s.message()));
    return s;
  }
  const StepSizing sizing = pool_->sizing();
  CoordinatorLog(id, absl::StrFormat("started: %d prompt tokens, max_tokens %d, temperature %g%s", params.prompt.size(),
                                     params.max_tokens, params.temperature, params.ignore_eos ? ", ignore_eos" : ""));
  const auto start = std::chrono::steady_clock::now();
  double first_token_seconds = 0;
  Generation generation(params, model_->eos_ids, model_->tokenizer.get(), sizing.max_tokens_per_step,
                        sizing.max_blocks_per_seq);
  v1::StepPlan step;
  StepOutcome outcome;
  v1::GenerateResponse response;
  for (;;) {
    if (context->IsCancelled()) {
      CoordinatorLog(id, absl::StrCat("cancelled by the client after ", generation.completion_tokens(), " tokens"));
      return absl::CancelledError("the client cancelled the request");
    }
    const bool samples = generation.NextStep(next_step_.fetch_add(1), &step);
    const auto step_start = std::chrono::steady_clock::now();
    if (absl::Status s = pool_->RunStep(step, step_timeout_, &outcome); !s.ok()) {
      CoordinatorLog(id, absl::StrCat("aborted after ", generation.completion_tokens(), " tokens: ", s.message()));
      return s;
    }
    if (!samples) continue;  // a prefill chunk before the last one
    if (outcome.sampled_ids.size() != 1) {  // RunStep checked the sampler's answer: cannot happen
      return absl::InternalError(absl::StrCat("step ", step.step_id(), " returned ", outcome.sampled_ids.size(),
                                              " sampled ids for one sequence"));
    }
    const bool done = generation.Accept(outcome.sampled_ids[0], &response);
    if (generation.completion_tokens() == 1) first_token_seconds = SecondsSince(start);
    response.set_request_id(id);
    v1::StepTimings* t = response.mutable_timings();
    t->set_step_seconds(SecondsSince(step_start));
    t->set_forward_seconds(outcome.forward_seconds);
    t->set_collective_seconds(outcome.collective_seconds);
    if (!writer->Write(response)) {
      CoordinatorLog(id, absl::StrCat("the client went away after ", generation.completion_tokens(), " tokens"));
      return absl::CancelledError("the client went away");
    }
    if (done) {
      const double seconds = SecondsSince(start);
      CoordinatorLog(id, absl::StrFormat("finished (%s): %d + %d tokens in %.2f s, first token after %.3f s, %.1f "
                                         "tokens/s",
                                         FinishName(response.finish_reason()), params.prompt.size(),
                                         generation.completion_tokens(), seconds, first_token_seconds,
                                         generation.completion_tokens() / std::max(seconds, 1e-9)));
      return absl::OkStatus();
    }
  }
}

grpc::Status InferenceService::Tokenize(grpc::ServerContext*, const v1::TokenizeRequest* request,
                                        v1::TokenizeResponse* response) {
  if (model_->tokenizer == nullptr) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("text: the model ", model_->name, " has no tokenizer.json, so it cannot tokenize text")));
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

grpc::Status InferenceService::GetModelInfo(grpc::ServerContext*, const v1::GetModelInfoRequest*,
                                            v1::ModelInfo* response) {
  FillModelInfo(response);
  return grpc::Status::OK;
}

grpc::Status InferenceService::GetClusterStatus(grpc::ServerContext*, const v1::GetClusterStatusRequest*,
                                                v1::ClusterStatus* response) {
  pool_->FillStatus(response);
  FillModelInfo(response->mutable_model());
  return grpc::Status::OK;
}

}  // namespace shardserve
