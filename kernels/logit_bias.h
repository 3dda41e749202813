// Bounds on a request's logit_bias (inference.proto SamplingParams.logit_bias, worker.proto
// RowSampling.logit_bias_ids/values), checked by the coordinator on every request and by the
// worker on every step; the other sampling bounds are in sampling.h.
#ifndef SHARDSERVE_KERNELS_LOGIT_BIAS_H_
#define SHARDSERVE_KERNELS_LOGIT_BIAS_H_

#include <cstdint>

namespace shardserve {

constexpr float kMaxAbsLogitBias = 100.0f;      // each bias in [-100, 100], as OpenAI's
constexpr int32_t kMaxLogitBiasEntries = 1024;  // ids in one request's logit_bias

}  // namespace shardserve

#endif  // SHARDSERVE_KERNELS_LOGIT_BIAS_H_
