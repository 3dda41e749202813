// The input rows of the CPU's VNNI products (int8_matmul_vnni.cc, int4_matmul_vnni.cc: QuantIsa::
// kAvx512Vnni) quantized to int8, one scale per row (max |x| / 127, round to nearest), as llama.cpp
// quantizes activations for its integer dot products: each activation moves by up to 1/254 of its
// row's largest, so those products are not exact against the dequantized weights (quant_isa.h).
//
// QuantizeActivationRows is AVX-512 code (activation_rows.cc): call it only where those products run.
//
// Thread-compatible value type; QuantizeActivationRows is a pure function of its arguments.
#ifndef SHARDSERVE_KERNELS_CPU_ACTIVATION_ROWS_H_
#define SHARDSERVE_KERNELS_CPU_ACTIVATION_ROWS_H_

#include <cstdint>
#include <vector>

namespace shardserve::cpu {

struct ActivationRows {
  int64_t block = 0;              // values per block: each row is padded to whole blocks
  int64_t blocks = 0;             // blocks per row: ceil(k / block)
  std::vector<int8_t> values;     // [n, blocks x block], in [-127, 127], zero-padded
  std::vector<int32_t> block_sum; // [n, blocks]: each block's sum of values
  std::vector<int32_t> sum;       // [n]: each row's
  std::vector<float> scale;       // [n]: x ~ values x scale; 0 for an all-zero row, NaN for one with NaN or Inf
};

// Quantizes x [n, k] into *out (its vectors reused: no allocation once they have grown).
void QuantizeActivationRows(ActivationRows* out, const float* x, int64_t n, int64_t k, int64_t block);

}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_ACTIVATION_ROWS_H_
