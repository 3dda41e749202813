// The bounds of a request's sampling parameters (inference.proto SamplingParams, worker.proto
// RowSampling): part of the API, checked by the coordinator on every request, from either API
// (coordinator/api/request_validation.h PrepareGeneration), and by the worker on every step
// (worker/step_checks.h); the worker's sampler sizes its top-logprobs scratch by kMaxTopLogprobs.
#ifndef SHARDSERVE_MODEL_SAMPLING_BOUNDS_H_
#define SHARDSERVE_MODEL_SAMPLING_BOUNDS_H_

#include <cstdint>

namespace shardserve {

constexpr float kMaxRepetitionPenalty = 10.0f;            // repetition_penalty in (0, 10] (0 or 1: off)
constexpr float kMaxAbsPresenceFrequencyPenalty = 2.0f;   // presence/frequency_penalty in [-2, 2]
constexpr int32_t kMaxTopLogprobs = 20;                   // top_logprobs in [0, 20]
constexpr float kMaxAbsLogitBias = 100.0f;                // each logit_bias in [-100, 100], as OpenAI's
constexpr int32_t kMaxLogitBiasEntries = 1024;            // ids in one request's logit_bias
constexpr int32_t kMaxAllowedTokenIds = 4096;             // ids in one request's allowed_token_ids
constexpr int32_t kMaxBadWords = 64;                      // words in one request's bad_words
constexpr int32_t kMaxBadWordSequences = 2 * kMaxBadWords;  // their token sequences (bare and after a space)
constexpr int32_t kMaxBadWordBytes = 256;                 // bytes of one bad word
constexpr int32_t kMaxBadWordTokens = 256;                // tokens of one bad word as tokenized

}  // namespace shardserve

#endif  // SHARDSERVE_MODEL_SAMPLING_BOUNDS_H_
