#include "kernels/cpu/int4_matmul.h"

#include <algorithm>
#include <cstring>

#include "kernels/cpu/column_tiles.h"
#include "kernels/cpu/int4_matmul_tiles.h"

namespace shardserve::cpu {
namespace {

using Vec8u8 = uint8_t __attribute__((vector_size(8)));

// How 8 packed bytes become 16 floats without AVX2 (GCC's generic vectors; the same exact values).
struct UnpackPortable {
  [[gnu::always_inline]] static inline void Load(const uint8_t* p, Vec8* lo, Vec8* hi) {
    Vec8u8 v;
    std::memcpy(&v, p, sizeof v);
    const Vec8i bytes = __builtin_convertvector(v, Vec8i);
    *lo = __builtin_convertvector(bytes & 15, Vec8);
    *hi = __builtin_convertvector(bytes >> 4, Vec8);
  }
};

}  // namespace

void Int4ColumnsPortable(float* y, const float* x, int64_t n, int64_t m, int64_t k, const Int4Group128* blocks,
                         const float* bias, int64_t r0, int64_t r1) {
  Columns<UnpackPortable>(y, x, n, m, k, blocks, bias, r0, r1);
}

void Int4MatMul(float* y, const float* x, int64_t n, int64_t m, int64_t k, const Int4Group128* blocks,
                const float* bias, int threads, QuantIsa isa) {
  if (isa == QuantIsa::kAvx512Vnni) {
    Int4MatMulVnni(y, x, n, m, k, blocks, bias, threads);
    return;
  }
  if (isa == QuantIsa::kAvx2Int8) {
    Int4MatMulAct8Avx2(y, x, n, m, k, blocks, bias, threads);
    return;
  }
  // (kAvx512: the AVX2 instance; the backend multiplies int4 as panels there, IntOnPanels.)
  const auto columns = isa == QuantIsa::kAvx512 || isa == QuantIsa::kAvx2 ? Int4ColumnsAvx2 : Int4ColumnsPortable;
  ForEachColumnRange(m, kInt4TileRows, threads,
                     [&](int64_t r0, int64_t r1) { columns(y, x, n, m, k, blocks, bias, r0, r1); });
}

}  // namespace shardserve::cpu
