// The input rows of the CPU's integer products (QuantIsa::kAvx512Vnni: int8_matmul_vnni.cc,
// int4_matmul_vnni.cc; QuantIsa::kAvx2Int8: int8_matmul_act8_avx2.cc, int4_matmul_act8_avx2.cc)
// quantized to int8, one scale per row (max |x| / 127, round to nearest), as llama.cpp quantizes
// activations for its integer dot products: each activation moves by up to 1/254 of its
// row's largest, so those products are not exact against the dequantized weights (quant_isa.h).
//
// QuantizeActivationRows runs the instance of `isa` (kAvx512Vnni: activation_rows_avx512.cc,
// kAvx2Int8: activation_rows_avx2.cc; call it only on a CPU that has it). Both give the same values
// (the same IEEE division and round-to-nearest-even conversion, value by value).
//
// Thread-compatible value type; QuantizeActivationRows is a pure function of its arguments.
#ifndef SHARDSERVE_KERNELS_CPU_ACTIVATION_ROWS_H_
#define SHARDSERVE_KERNELS_CPU_ACTIVATION_ROWS_H_

#include <cstdint>
#include <vector>

#include "kernels/cpu/quant_isa.h"

namespace shardserve::cpu {

struct ActivationRows {
  int64_t block = 0;              // values per block: each row is padded to whole blocks
  int64_t blocks = 0;             // blocks per row: ceil(k / block)
  std::vector<int8_t> values;     // [n, blocks x block], in [-127, 127], zero-padded
  std::vector<int32_t> block_sum; // [n, blocks]: each block's sum of values
  std::vector<int32_t> sum;       // [n]: each row's
  std::vector<float> scale;       // [n]: x ~ values x scale; 0 for an all-zero row, NaN for one with NaN or Inf
};

// Quantizes x [n, k] into *out (its vectors reused: no allocation once they have grown) on `isa`'s
// instance (kAvx512Vnni or kAvx2Int8).
void QuantizeActivationRows(ActivationRows* out, const float* x, int64_t n, int64_t k, int64_t block, QuantIsa isa);

// The instances' per-row work (activation_rows_avx512.cc, activation_rows_avx2.cc), for
// QuantizeActivationRows: max |x| over row[0, k) (NaN if any is NaN or Inf); and the row's values
// round(x / s) in [-127, 127] into v[0, k) with each block's sum into bsum (v's padding untouched
// or written with zeros).
float RowAbsMaxAvx512(const float* row, int64_t k);
float RowAbsMaxAvx2(const float* row, int64_t k);
void RowValuesAvx512(const float* row, int64_t k, float s, int64_t block, int8_t* v, int32_t* bsum);
void RowValuesAvx2(const float* row, int64_t k, float s, int64_t block, int8_t* v, int32_t* bsum);

}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_ACTIVATION_ROWS_H_
