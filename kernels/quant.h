// Quantized weight formats: how a MatMul weight may be stored (Backend::PackMatMulWeight), one
// declared layout per format and one dequantize reference per format, which the fast kernels
// (kernels/cpu/int8_matmul.h) are tested against (tests/kernels_cpu_test.cc).
//
// Embeddings, norms and the LM head stay in the activation dtype, as in the peers (vLLM,
// llama.cpp): only the linear layers' weights are quantized.
#ifndef SHARDSERVE_KERNELS_QUANT_H_
#define SHARDSERVE_KERNELS_QUANT_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardserve {

enum class WeightQuant : uint8_t {
  kNone = 0,  // the activation dtype (or the backend's own packing of it)
  kInt8 = 1,  // int8, symmetric, one float32 scale per output channel (below)
};

// "none", "int8".
const char* WeightQuantName(WeightQuant q);
// The inverse of WeightQuantName; InvalidArgument listing the names otherwise.
absl::StatusOr<WeightQuant> ParseWeightQuant(absl::string_view name);

// ---- int8, per output channel ----------------------------------------------------------------
// A weight w [m, k] (row r = output channel r) is stored as
//   scale [m] float32, then q [m, k] int8 (row-major),
// with scale[r] = max_c |w[r][c]| / 127 and q[r][c] = round(w[r][c] / scale[r]) in [-127, 127]
// (round half away from zero; an all-zero row has scale 0 and q 0). So w[r][c] ~ q[r][c] x
// scale[r], off by at most scale[r] / 2, and a product x @ w^T is (x @ q^T) x scale per column.
struct Int8RowsLayout {
  int64_t m = 0, k = 0;
  // Bytes of the whole stored weight, and where q starts (scales first: 4-byte aligned).
  int64_t bytes() const { return scale_bytes() + m * k; }
  int64_t scale_bytes() const { return m * static_cast<int64_t>(sizeof(float)); }
};
static_assert(sizeof(float) == 4 && sizeof(int8_t) == 1, "the int8 layout counts 4-byte scales and 1-byte values");

// Quantizes w [m, k] float32 into `scale` [m] and `q` [m, k]. Non-finite weights are refused
// (InvalidArgument naming the row and column) before anything is written.
absl::Status QuantizeInt8Rows(float* scale /*[m]*/, int8_t* q /*[m, k]*/, const float* w /*[m, k]*/, int64_t m,
                              int64_t k);
// The reference: w [m, k] = q x scale per row.
void DequantizeInt8Rows(float* w /*[m, k]*/, const float* scale /*[m]*/, const int8_t* q /*[m, k]*/, int64_t m,
                        int64_t k);

}  // namespace shardserve

#endif  // SHARDSERVE_KERNELS_QUANT_H_
