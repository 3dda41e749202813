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

// The finish reason's label in shardserve_requests_finished_total.
const char* FinishLabel(v1::FinishReason r) {
  switch (r) {
    case v1::FINISH_REASON_STOP_TOKEN: return "stop_token";
    case v1::FINISH_REASON_STOP_STRING: return "stop_string";
    case v1::FINISH_REASON_LENGTH: return "length";
    default: return "unspecified";
  }
}

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
    CoordinatorRequestLog(request->request_id().empty() ? fallback_id : request->request_id(),
                   absl::StrCat("rejected: ", params.status().message()), "warn");
    return params.status();
  }
  if (metrics_ != nullptr) metrics_->requests_waiting.Increment();
  absl::Status turn = TakeTurn(context);
  if (metrics_ != nullptr) metrics_->requests_waiting.Decrement();
  if (!turn.ok()) {
    CoordinatorRequestLog(params->request_id, absl::StrCat("not run: ", turn.message()), "warn");
    return turn;
  }
  if (metrics_ != nullptr) metrics_->requests_running.Increment();
  absl::Status status = Run(context, *params, arrival, writer);
  if (metrics_ != nullptr) {
    metrics_->requests_running.Decrement();
    metrics_->kv_blocks_used.Set(0);  // the sequence's blocks are free again
  }
  ReleaseTurn();
  return status;
}

absl::Status InferenceService::Run(grpc::ServerContext* context, const GenerationParams& params,
                                   std::chrono::steady_clock::time_point arrival,
                                   grpc::ServerWriter<v1::GenerateResponse>* writer) {
  const std::string& id = params.request_id;
  if (absl::Status s = pool_->CheckServing(); !s.ok()) {
    CoordinatorRequestLog(id, absl::StrCat("refused: ", s.message()), "warn");
    return s;
  }
  const StepSizing sizing = pool_->sizing();
  CoordinatorRequestLog(id, absl::StrFormat("started: %d prompt tokens, max_tokens %d, temperature %g%s",
                                            params.prompt.size(), params.max_tokens, params.temperature,
                                            params.ignore_eos ? ", ignore_eos" : ""));
  const auto start = std::chrono::steady_clock::now();
  if (metrics_ != nullptr) {
    metrics_->request_queue.Observe(SecondsSince(arrival));
    metrics_->prompt_tokens.Increment(static_cast<double>(params.prompt.size()));
    metrics_->kv_blocks_total.Set(static_cast<double>(sizing.max_blocks_per_seq));
  }
  int64_t cached_tokens = 0;  // tokens in the KV cache: the sequence's blocks are ceil(this / block_size)
  auto last_token_time = start;
  double first_token_seconds = 0;
  Generation generation(params, model_->eos_ids, model_->tokenizer.get(), sizing.max_tokens_per_step,
                        sizing.max_blocks_per_seq);
  v1::StepPlan step;
  StepOutcome outcome;
  v1::GenerateResponse response;
  for (;;) {
    if (context->IsCancelled()) {
      CoordinatorRequestLog(id,
                            absl::StrCat("cancelled by the client after ", generation.completion_tokens(), " tokens"));
      return absl::CancelledError("the client cancelled the request");
    }
    const bool samples = generation.NextStep(next_step_.fetch_add(1), &step);
    const auto step_start = std::chrono::steady_clock::now();
    if (absl::Status s = pool_->RunStep(step, step_timeout_, &outcome); !s.ok()) {
      CoordinatorRequestLog(
          id, absl::StrCat("aborted after ", generation.completion_tokens(), " tokens: ", s.message()), "error");
      return s;
    }
    cached_tokens += step.token_ids_size();
    if (metrics_ != nullptr && sizing.block_size > 0) {
      metrics_->kv_blocks_used.Set(static_cast<double>((cached_tokens + sizing.block_size - 1) / sizing.block_size));
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
      CoordinatorRequestLog(id,
                            absl::StrCat("the client went away after ", generation.completion_tokens(), " tokens"));
      return absl::CancelledError("the client went away");
    }
    if (metrics_ != nullptr) {
      const auto now = std::chrono::steady_clock::now();
      if (generation.completion_tokens() == 1) {
        metrics_->time_to_first_token.Observe(SecondsSince(arrival));
      } else {
        metrics_->inter_token_latency.Observe(std::chrono::duration<double>(now - last_token_time).count());
      }
      last_token_time = now;
      metrics_->generated_tokens.Increment(response.token_ids_size());
      if (done) metrics_->Finished(FinishLabel(response.finish_reason()));
    }
    if (done) {
      const double seconds = SecondsSince(start);
      CoordinatorRequestLog(id, absl::StrFormat("finished (%s): %d + %d tokens in %.2f s, first token after %.3f s, "
                                                "%.1f tokens/s",
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
