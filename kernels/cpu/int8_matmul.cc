#include "kernels/cpu/int8_matmul.h"

#include <algorithm>
#include <array>
#include <cstring>

#include "kernels/cpu/column_tiles.h"
#include "kernels/cpu/int8_matmul_tiles.h"
#include "kernels/quant.h"

namespace shardserve::cpu {
namespace {

using Vec8i8 = int8_t __attribute__((vector_size(8)));

// How 8 int8 weights become 8 floats without AVX2. (GCC 12 makes this eight scalar conversions,
// about 5x slower than AVX2's two instructions in int8_matmul_avx2.cc; both give the exact value of
// each int8, so the choice changes speed, not results.)
struct WidenInt8Portable {
  using V = Vec8;
  [[gnu::always_inline]] static inline V Load(const uint8_t* p) {
    Vec8i8 v;
    std::memcpy(&v, p, sizeof v);
    return __builtin_convertvector(v, Vec8);
  }
};

// e4m3's 256 values (kernels/quant.h's reference), looked up one by one.
const std::array<float, 256> kFp8Values = [] {
  std::array<float, 256> t{};
  for (int c = 0; c < 256; ++c) t[c] = Fp8E4m3ToFloat(static_cast<uint8_t>(c));
  return t;
}();

struct WidenFp8Portable {
  using V = Vec8;
  [[gnu::always_inline]] static inline V Load(const uint8_t* p) {
    V v;
    for (int j = 0; j < 8; ++j) v[j] = kFp8Values[p[j]];
    return v;
  }
};

using ColumnsFn = void (*)(float*, const float*, int64_t, int64_t, int64_t, const uint8_t*, const float*,
                           const float*, int64_t, int64_t);

void Run(ColumnsFn columns, float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* q,
         const float* scale, const float* bias, int threads) {
  ForEachColumnRange(m, kInt8TileRows, threads,
                     [&](int64_t r0, int64_t r1) { columns(y, x, n, m, k, q, scale, bias, r0, r1); });
}

using GroupColumnsFn = void (*)(float*, const float*, int64_t, int64_t, int64_t, const uint8_t*, const float*,
                                int64_t, const float*, int64_t, int64_t);

}  // namespace

void Int8ColumnsPortable(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* q,
                         const float* scale, const float* bias, int64_t r0, int64_t r1) {
  Columns<WidenInt8Portable>(y, x, n, m, k, q, scale, bias, r0, r1);
}

void Fp8ColumnsPortable(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* q,
                        const float* scale, const float* bias, int64_t r0, int64_t r1) {
  Columns<WidenFp8Portable>(y, x, n, m, k, q, scale, bias, r0, r1);
}

void Fp8GroupColumnsPortable(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* q,
                             const float* scale, int64_t group, const float* bias, int64_t r0, int64_t r1) {
  Columns<WidenFp8Portable, false, true>(y, x, n, m, k, q, scale, bias, r0, r1, group);
}

void Int8MatMul(float* y, const float* x, int64_t n, int64_t m, int64_t k, const int8_t* q, const float* scale,
                const float* bias, int threads, QuantIsa isa) {
  if (isa == QuantIsa::kAvx512Vnni) {
    Int8MatMulVnni(y, x, n, m, k, q, scale, bias, threads);
    return;
  }
  if (isa == QuantIsa::kAvx2Int8) {
    Int8MatMulAct8Avx2(y, x, n, m, k, q, scale, bias, threads);
    return;
  }
  const ColumnsFn columns = isa == QuantIsa::kAvx512 ? Int8ColumnsAvx512
                            : isa == QuantIsa::kAvx2 ? Int8ColumnsAvx2
                                                     : Int8ColumnsPortable;
  Run(columns, y, x, n, m, k, reinterpret_cast<const uint8_t*>(q), scale, bias, threads);
}

void Fp8MatMul(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* q, const float* scale,
               const float* bias, int threads, QuantIsa isa) {
  const ColumnsFn columns = isa == QuantIsa::kAvx512 || isa == QuantIsa::kAvx512Vnni ? Fp8ColumnsAvx512
                            : isa == QuantIsa::kAvx2 || isa == QuantIsa::kAvx2Int8 ? Fp8ColumnsAvx2
                                                     : Fp8ColumnsPortable;
  Run(columns, y, x, n, m, k, q, scale, bias, threads);
}

void Fp8GroupMatMul(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* q, const float* scale,
                    int64_t group, const float* bias, int threads, QuantIsa isa) {
  const GroupColumnsFn columns = isa == QuantIsa::kAvx512 || isa == QuantIsa::kAvx512Vnni ? Fp8GroupColumnsAvx512
                                 : isa == QuantIsa::kAvx2 || isa == QuantIsa::kAvx2Int8   ? Fp8GroupColumnsAvx2
                                                                                          : Fp8GroupColumnsPortable;
  ForEachColumnRange(m, kInt8TileRows, threads,
                     [&](int64_t r0, int64_t r1) { columns(y, x, n, m, k, q, scale, group, bias, r0, r1); });
}

}  // namespace shardserve::cpu
