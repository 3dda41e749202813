// The AVX-512 VNNI instance of the int8 products (int8_matmul.h's Int8MatMulVnni): activations
// quantized to int8 per row, integer dot products (VPDPBUSD) against the int8 weights. This file
// alone is compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni (kernels/CMakeLists.txt);
// Int8MatMul calls it only when asked for QuantIsa::kAvx512Vnni on a CPU that has it.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/cpu/int8_matmul.h"

namespace shardserve::cpu {
namespace {

constexpr int64_t kChunk = 64;  // int8 values per zmm register
constexpr int kTileRows = 8;    // weight rows per tile, as the float kernels'

// Input row i, quantized: |xq| as bytes (VPDPBUSD's unsigned operand), the chunks' sign masks
// (bit j of masks[c]: xq[64 c + j] < 0, so that the weight is negated there instead), its scale.
struct QuantizedRows {
  int64_t chunks = 0;
  std::vector<uint8_t> magnitude;  // [n, chunks x 64], zero-padded
  std::vector<__mmask64> negative;  // [n, chunks]
  std::vector<float> scale;         // [n]; NaN for a row holding NaN or Inf
};

void QuantizeRows(QuantizedRows* out, const float* x, int64_t n, int64_t k) {
  out->chunks = (k + kChunk - 1) / kChunk;
  out->magnitude.assign(static_cast<size_t>(n * out->chunks * kChunk), 0);
  out->negative.assign(static_cast<size_t>(n * out->chunks), 0);
  out->scale.assign(static_cast<size_t>(n), 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float* row = x + i * k;
    float amax = 0;
    bool finite = true;
    for (int64_t c = 0; c < k; ++c) {
      finite = finite && std::isfinite(row[c]);
      amax = std::max(amax, std::fabs(row[c]));
    }
    if (!finite) {
      out->scale[i] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    if (amax == 0) continue;
    const float s = amax / 127.0f;
    out->scale[i] = s;
    uint8_t* mag = out->magnitude.data() + i * out->chunks * kChunk;
    __mmask64* neg = out->negative.data() + i * out->chunks;
    for (int64_t c = 0; c < k; ++c) {
      const float v = std::fmin(127.0f, std::fmax(-127.0f, std::nearbyint(row[c] / s)));
      mag[c] = static_cast<uint8_t>(std::fabs(v));
      if (v < 0) neg[c / kChunk] |= __mmask64{1} << (c % kChunk);
    }
  }
}

// y[i .. i+I) x columns [r, r+R) as exact int32 dot products, then scaled.
template <int R, int I>
inline void Tile(float* y, const QuantizedRows& xq, int64_t i, int64_t m, int64_t k, const int8_t* q,
                 const float* scale, const float* bias, int64_t r) {
  __m512i acc[I][R];
  for (int a = 0; a < I; ++a) {
    for (int b = 0; b < R; ++b) acc[a][b] = _mm512_setzero_si512();
  }
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t c = 0; c < xq.chunks; ++c) {
    const int64_t left = k - c * kChunk;
    const __mmask64 load = left >= kChunk ? ~__mmask64{0} : (__mmask64{1} << left) - 1;
    __m512i mag[I];
    __mmask64 neg[I];
    for (int a = 0; a < I; ++a) {
      mag[a] = _mm512_loadu_si512(xq.magnitude.data() + ((i + a) * xq.chunks + c) * kChunk);
      neg[a] = xq.negative[(i + a) * xq.chunks + c];
    }
    for (int b = 0; b < R; ++b) {
      const __m512i w = _mm512_maskz_loadu_epi8(load, q + (r + b) * k + c * kChunk);
      for (int a = 0; a < I; ++a) {
        // The weight with x's sign (|q| <= 127: negation cannot overflow), times |x|.
        acc[a][b] = _mm512_dpbusd_epi32(acc[a][b], mag[a], _mm512_mask_sub_epi8(w, neg[a], zero, w));
      }
    }
  }
  for (int a = 0; a < I; ++a) {
    for (int b = 0; b < R; ++b) {
      const float v =
          static_cast<float>(_mm512_reduce_add_epi32(acc[a][b])) * (xq.scale[i + a] * scale[r + b]);
      y[(i + a) * m + r + b] = bias != nullptr ? v + bias[r + b] : v;
    }
  }
}

template <int I>
inline void TileOf(int64_t rows, float* y, const QuantizedRows& xq, int64_t i, int64_t m, int64_t k, const int8_t* q,
                   const float* scale, const float* bias, int64_t r) {
  switch (rows) {
    case 8: Tile<8, I>(y, xq, i, m, k, q, scale, bias, r); break;
    case 7: Tile<7, I>(y, xq, i, m, k, q, scale, bias, r); break;
    case 6: Tile<6, I>(y, xq, i, m, k, q, scale, bias, r); break;
    case 5: Tile<5, I>(y, xq, i, m, k, q, scale, bias, r); break;
    case 4: Tile<4, I>(y, xq, i, m, k, q, scale, bias, r); break;
    case 3: Tile<3, I>(y, xq, i, m, k, q, scale, bias, r); break;
    case 2: Tile<2, I>(y, xq, i, m, k, q, scale, bias, r); break;
    case 1: Tile<1, I>(y, xq, i, m, k, q, scale, bias, r); break;
    default: break;
  }
}

}  // namespace

void Int8MatMulVnni(float* y, const float* x, int64_t n, int64_t m, int64_t k, const int8_t* q, const float* scale,
                    const float* bias, int threads) {
  thread_local QuantizedRows xq;  // the calling thread's scratch, reused (no allocation per step once grown)
  QuantizeRows(&xq, x, n, k);
  const int64_t tiles = (m + kTileRows - 1) / kTileRows;
  const int nthreads = threads > 0 ? threads : omp_get_max_threads();
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(nthreads, tiles));
  const QuantizedRows& rows_q = xq;
#pragma omp parallel for num_threads(static_cast<int>(parts)) schedule(static)
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t r0 = tiles * p / parts * kTileRows, r1 = std::min(m, tiles * (p + 1) / parts * kTileRows);
    for (int64_t r = r0; r < r1; r += kTileRows) {
      const int64_t rows = std::min<int64_t>(kTileRows, r1 - r);
      int64_t i = 0;
      for (; i + 2 <= n; i += 2) {
        TileOf<2>(std::min<int64_t>(rows, 4), y, rows_q, i, m, k, q, scale, bias, r);
        if (rows > 4) TileOf<2>(rows - 4, y, rows_q, i, m, k, q, scale, bias, r + 4);
      }
      if (i < n) TileOf<1>(rows, y, rows_q, i, m, k, q, scale, bias, r);
    }
  }
}

}  // namespace shardserve::cpu
