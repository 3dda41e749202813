#include "kernels/cpu/int8_matmul.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "kernels/cpu/vec.h"

namespace shardserve::cpu {
namespace {

using Vec8i8 = int8_t __attribute__((vector_size(8)));

// Weight rows and input rows one tile multiplies: 4 x 2 = 8 independent sums, the chains two
// 4-deep FMA units need, and each weight vector is loaded once for both input rows.
constexpr int kTileRows = 4, kTileInputs = 2;

// The sum of v's lanes, in one fixed order.
[[gnu::always_inline]] inline float SumLanes(const Vec8& v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// 8 int8 weights at p (or the first `count`, the rest 0) as floats.
[[gnu::always_inline]] inline Vec8 LoadInt8(const int8_t* p, int64_t count) {
  Vec8i8 v = {};
  std::memcpy(&v, p, static_cast<size_t>(count < kVecLanes ? count : kVecLanes));
  return __builtin_convertvector(v, Vec8);
}

// y[i .. i+I) x columns [r, r+R): R x I sums, each over k in the same order whatever R and I
// (the tile's size only decides which sums share a weight load), so that tails and full tiles
// give every output the same bits. Bounds are compile-time so the sums stay in registers.
template <int R, int I>
[[gnu::always_inline]] inline void Tile(float* y, const float* x, int64_t i, int64_t m, int64_t k, const int8_t* q,
                                        const float* scale, const float* bias, int64_t r) {
  Vec8 acc[I][R] = {};
  for (int64_t c = 0; c < k; c += kVecLanes) {
    const int64_t count = k - c;
    Vec8 xv[I];
    for (int a = 0; a < I; ++a) xv[a] = LoadVec(x + (i + a) * k + c, count);
    for (int b = 0; b < R; ++b) {
      const Vec8 wv = LoadInt8(q + (r + b) * k + c, count);
      for (int a = 0; a < I; ++a) acc[a][b] += xv[a] * wv;
    }
  }
  for (int a = 0; a < I; ++a) {
    for (int b = 0; b < R; ++b) {
      const float v = SumLanes(acc[a][b]) * scale[r + b];
      y[(i + a) * m + r + b] = bias != nullptr ? v + bias[r + b] : v;
    }
  }
}

template <int R>
[[gnu::always_inline]] inline void TileRows(float* y, const float* x, int64_t n, int64_t m, int64_t k,
                                            const int8_t* q, const float* scale, const float* bias, int64_t r) {
  int64_t i = 0;
  for (; i + kTileInputs <= n; i += kTileInputs) Tile<R, kTileInputs>(y, x, i, m, k, q, scale, bias, r);
  if (i < n) Tile<R, 1>(y, x, i, m, k, q, scale, bias, r);
}

// Output columns [r0, r1) of every row of y.
SHARDSERVE_VECTOR_CLONES
void Int8Columns(float* y, const float* x, int64_t n, int64_t m, int64_t k, const int8_t* q, const float* scale,
                 const float* bias, int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + kTileRows <= r1; r += kTileRows) TileRows<kTileRows>(y, x, n, m, k, q, scale, bias, r);
  switch (r1 - r) {
    case 3: TileRows<3>(y, x, n, m, k, q, scale, bias, r); break;
    case 2: TileRows<2>(y, x, n, m, k, q, scale, bias, r); break;
    case 1: TileRows<1>(y, x, n, m, k, q, scale, bias, r); break;
    default: break;
  }
}

}  // namespace

void Int8MatMul(float* y, const float* x, int64_t n, int64_t m, int64_t k, const int8_t* q, const float* scale,
                const float* bias, int threads) {
  // Columns in whole tiles per thread, so that every output is computed by the same tile code.
  const int64_t tiles = (m + kTileRows - 1) / kTileRows;
  const int nthreads = threads > 0 ? threads : omp_get_max_threads();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(nthreads, tiles));
#pragma omp parallel for num_threads(static_cast<int>(parts)) schedule(static)
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t r0 = tiles * p / parts * kTileRows, r1 = std::min(m, tiles * (p + 1) / parts * kTileRows);
    if (r0 < r1) Int8Columns(y, x, n, m, k, q, scale, bias, r0, r1);
  }
}

}  // namespace shardserve::cpu
