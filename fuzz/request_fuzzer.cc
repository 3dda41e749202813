// A GenerateRequest off the wire, as InferenceService::Generate receives it: protobuf parsing,
// then the coordinator's validation at the edge (PrepareGeneration,
// coordinator/api/request_validation.h) against the demo model (models/demo, loaded once as the
// coordinator loads it), then, for a request that passes, the stream a Generation
// (coordinator/engine/generation.h) makes when the model "samples" the prompt's own ids back.
//
// Invariants: a refused request is InvalidArgument; an accepted one has prompt ids inside the
// vocabulary and prompt + max_tokens within max_model_len, logit_bias and min_tokens within their
// bounds and a RowSampling the workers' CheckRowSampling accepts, a structured output compiled
// and its first mask one the workers' CheckTokenMasks accepts; the streamed text is the decode of the
// accepted ids (special tokens skipped unless skip_special_tokens is false; the EOS that ends it
// never text), cut before the first stop string (with include_stop_str_in_output, after it).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "coordinator/api/request_validation.h"
#include "coordinator/engine/generation.h"
#include "coordinator/model/served_model.h"
#include "model/sampling_bounds.h"
#include "worker/step_checks.h"
#include "google/protobuf/stubs/logging.h"
#include "shardserve/v1/inference.pb.h"

namespace {

const shardserve::ServedModel& Model() {
  static const shardserve::ServedModel* model = [] {
    absl::StatusOr<std::unique_ptr<shardserve::ServedModel>> m =
        shardserve::ServedModel::Open(std::string(SHARDSERVE_SOURCE_DIR) + "/models/demo");
    if (!m.ok()) {
      std::fprintf(stderr, "request_fuzzer: %s\n", std::string(m.status().message()).c_str());
      std::abort();
    }
    return m->release();
  }();
  return *model;
}

void Check(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "request_fuzzer: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Parsing refuses a text field that is not UTF-8, as gRPC does, and logs each refusal; quiet.
  google::protobuf::SetLogHandler(nullptr);
  Model();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  shardserve::v1::GenerateRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(std::min<size_t>(size, INT32_MAX)))) return 0;
  const shardserve::ServedModel& model = Model();
  const int64_t max_model_len = model.config.max_position_embeddings;
  absl::StatusOr<shardserve::GenerationParams> params =
      shardserve::PrepareGeneration(request, model, max_model_len, "req-fuzz");
  if (!params.ok()) {
    Check(absl::IsInvalidArgument(params.status()), "a refusal that is not InvalidArgument");
    return 0;
  }
  const int64_t vocab = model.config.vocab_size;
  Check(!params->prompt.empty(), "empty prompt accepted");
  for (int32_t id : params->prompt) Check(id >= 0 && id < vocab, "prompt id outside the vocabulary");
  Check(params->max_tokens > 0 && static_cast<int64_t>(params->prompt.size()) + params->max_tokens <= max_model_len,
        "prompt + max_tokens exceed max_model_len");
  Check(params->logit_bias.size() <= static_cast<size_t>(shardserve::kMaxLogitBiasEntries), "logit_bias over its bound");
  for (const auto& [id, bias] : params->logit_bias) {
    Check(id >= 0 && id < vocab && bias >= -shardserve::kMaxAbsLogitBias && bias <= shardserve::kMaxAbsLogitBias,
          "logit_bias id outside the vocabulary or bias out of range accepted");
  }
  Check(params->min_tokens >= 0 && params->min_tokens <= params->max_tokens, "min_tokens above max_tokens accepted");
  // What the workers receive passes their own checks (worker/step_checks.h).
  google::protobuf::RepeatedPtrField<shardserve::v1::RowSampling> rows;
  *rows.Add() = shardserve::SamplingTemplate(*params);
  Check(shardserve::CheckRowSampling(0, rows, vocab).ok(), "an accepted request's RowSampling fails the worker's checks");
  // An accepted constraint is compiled, and its first mask passes the workers' CheckTokenMasks.
  Check(request.sampling().has_structured_output() == (params->grammar != nullptr),
        "a structured output accepted without its compiled grammar");
  if (params->grammar != nullptr) {
    shardserve::grammar::GrammarMatcher matcher(params->grammar);
    shardserve::v1::StepPlan plan;
    plan.add_mask_logit_rows(0);
    plan.mutable_mask_words()->Resize(matcher.mask_words(), 0);
    matcher.FillNextTokenBitmask(plan.mutable_mask_words()->mutable_data());
    // A language with no sentence allows nothing: the engine ends such a request with an error.
    const auto& words = plan.mask_words();
    if (std::any_of(words.begin(), words.end(), [](uint32_t w) { return w != 0; })) {
      std::vector<const uint32_t*> masks;
      Check(shardserve::CheckTokenMasks(plan, 1, vocab, &masks).ok(), "an accepted grammar's first mask fails the workers' checks");
    }
  }

  // Stream the prompt's ids back as if sampled.
  shardserve::Generation generation(*params, model.eos_ids, model.tokenizer.get());
  std::vector<int32_t> accepted;
  std::string streamed;
  bool finished = false;
  shardserve::v1::GenerateResponse response;
  for (int32_t id : params->prompt) {
    if (accepted.size() >= 64) break;
    accepted.push_back(id);
    finished = generation.Accept(id, &response);
    streamed += response.text();
    if (finished) break;
  }
  if (finished) {
    std::vector<int32_t> text_ids = accepted;
    const bool eos = !params->ignore_eos &&
                     std::find(model.eos_ids.begin(), model.eos_ids.end(), accepted.back()) != model.eos_ids.end();
    if (eos && !params->skip_special_tokens) text_ids.pop_back();  // never text (else skipped when special)
    const std::string full = model.tokenizer->Decode(text_ids, params->skip_special_tokens);
    size_t cut = std::string::npos, end = std::string::npos;
    for (const std::string& stop : params->stop) {
      if (const size_t at = full.find(stop); at < cut) {
        cut = at;
        end = at + stop.size();
      }
    }
    Check(streamed == full.substr(0, params->include_stop_str_in_output ? end : cut),
          "streamed text is not the decode cut at the first stop string");
  }
  return 0;
}
