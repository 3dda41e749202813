// A counter-based generator of tensor values: element i of a tensor is a pure function of
// (key, i), never of the elements before it, so any slice of any tensor can be made where it lives,
// in any order, by any number of threads, with the same bits on the CPU and on a GPU. The dummy
// weights (model/dummy_weights.h) are made with it: each rank makes only its own shard, on the
// host (FillCounterUniformOnHost) or in device memory (Backend::FillCounterUniform; the CUDA
// kernel in kernels/cuda/counter_uniform.cu calls the same CounterUniformValue).
//
// Element i = scale * u(i), u(i) = (2k + 1) / 2^24 - 1 with k the top 24 bits of
// SplitMix64Mix(key + (i + 1) * golden gamma): the i-th output of a SplitMix64 generator seeded
// with `key` (Steele, Lea, Flood 2014; consecutive outputs pass BigCrush). u is inside (-1, 1).
// Every step is one IEEE-754 float32 operation rounded to nearest even, the same on the host and
// on a GPU: 2k + 1 (< 2^25) converted to float (rounded), the product by 2^-24 (exact, so a fused
// multiply-add with the subtraction gives the same result), the subtraction of 1, the product by
// scale. scale == 0 marks a tensor of 1.0 exactly (the norms).
//
// Header-only for host and device code (nvcc sees __host__ __device__); no state, thread-safe.
#ifndef SHARDSERVE_KERNELS_COUNTER_UNIFORM_H_
#define SHARDSERVE_KERNELS_COUNTER_UNIFORM_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/tensor.h"

#if defined(__CUDACC__)
#define SHARDSERVE_HOST_DEVICE __host__ __device__
#else
#define SHARDSERVE_HOST_DEVICE
#endif

namespace shardserve {

// SplitMix64's output function: a bijection of 64-bit words.
SHARDSERVE_HOST_DEVICE inline uint64_t SplitMix64Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The value of element `index` of the tensor with this key and scale (above).
SHARDSERVE_HOST_DEVICE inline float CounterUniformValue(uint64_t key, float scale, uint64_t index) {
  if (scale == 0) return 1.0f;
  constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;
  const uint64_t bits = SplitMix64Mix(key + (index + 1) * kGamma);
  const float u = static_cast<float>(2 * (bits >> 40) + 1) * (1.0f / 16777216.0f) - 1.0f;
  return scale * u;
}

// A slice of one dimension of a counter-generated [rows, cols] tensor (1-D tensors: cols = 1),
// written row-major: `dim` 0 takes rows [begin, end) (whole rows), `dim` 1 columns [begin, end) of
// every row. Element (r, c) of the whole tensor is CounterUniformValue(key, scale, r * cols + c).
struct CounterUniformSlice {
  uint64_t key = 0;
  float scale = 0;  // 0: every element is 1.0
  int64_t rows = 0, cols = 1;
  int dim = 0;
  int64_t begin = 0, end = 0;

  // Rows and columns of the slice as written.
  int64_t out_rows() const { return dim == 0 ? end - begin : rows; }
  int64_t out_cols() const { return dim == 0 ? cols : end - begin; }
};

// InvalidArgument naming what is wrong when the slice is not inside the tensor, or `out` is not a
// F32 / F16 / BF16 tensor of out_rows() x out_cols() elements. `op` prefixes the message.
absl::Status CheckCounterUniformSlice(const char* op, const Tensor& out, const CounterUniformSlice& s);

// Writes the slice into host memory `dst`: out_rows() x out_cols() elements of `dst_type` (F32,
// F16 or BF16, converted as ConvertOnHost converts: round to nearest even). The slice must be
// valid (CheckCounterUniformSlice).
void FillCounterUniformOnHost(void* dst, DType dst_type, const CounterUniformSlice& s);

}  // namespace shardserve

#endif  // SHARDSERVE_KERNELS_COUNTER_UNIFORM_H_
