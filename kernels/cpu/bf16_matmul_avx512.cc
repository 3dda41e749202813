// Bf16BlockedMatMul (bf16_matmul.h): this file alone is compiled with -mavx512f -mavx512bw
// -mavx512vl -mavx512bf16 (kernels/CMakeLists.txt); matmul.cc calls it only where
// CpuHasAvx512Bf16(). Tiles of B column blocks (64 outputs each, 4 zmm accumulators per input row)
// by I input rows: each weight zmm is loaded once per tile and used by the I rows; a lone input
// row takes 2 blocks at a time (8 independent accumulators, enough to keep VDPBF16PS busy).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/cpu/bf16_matmul.h"
#include "kernels/cpu/column_tiles.h"

namespace shardserve::cpu {
namespace {

constexpr int64_t kLanes = 16;  // float32 outputs per zmm

// x [n, k] rounded to bf16 into rows of padded_k values, the tail zeros.
void RoundRows(uint16_t* out, const float* x, int64_t n, int64_t k, int64_t padded_k) {
  for (int64_t i = 0; i < n; ++i) {
    const float* row = x + i * k;
    uint16_t* to = out + i * padded_k;
    int64_t c = 0;
    for (; c + kLanes <= k; c += kLanes) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + c), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + c)));
    }
    if (c < k) {
      const __mmask16 mask = static_cast<__mmask16>((1u << (k - c)) - 1);
      _mm256_mask_storeu_epi16(to + c, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, row + c)));
    }
    std::fill(to + k, to + padded_k, uint16_t{0});
  }
}

// Outputs [col, col + 64 B) (those below m) of input rows [i, i + I): the inputs in chunks of
// `chunk`, each summed from zero in registers and then added to the sum so far (kept in y).
template <int B, int I>
inline void Tile(float* y, const uint16_t* xb, int64_t i, int64_t m, int64_t padded_k, int64_t chunk,
                 const uint16_t* w, const float* bias, int64_t col) {
  const uint16_t* block = w + col * padded_k;  // block col / 64 starts at (col / 64) 64 padded_k
  const uint16_t* rows[I];
  for (int a = 0; a < I; ++a) rows[a] = xb + (i + a) * padded_k;
  for (int64_t k0 = 0; k0 < padded_k; k0 += chunk) {
    __m512 acc[I][B][4];
    for (int a = 0; a < I; ++a) {
      for (int b = 0; b < B; ++b) {
        for (int c = 0; c < 4; ++c) acc[a][b][c] = _mm512_setzero_ps();
      }
    }
    const int64_t k1 = std::min(padded_k, k0 + chunk);
    for (int64_t p = k0 / 2; p < k1 / 2; ++p) {
      __m512bh xv[I];
      for (int a = 0; a < I; ++a) {
        int32_t pair;
        std::memcpy(&pair, rows[a] + 2 * p, sizeof pair);
        xv[a] = (__m512bh)_mm512_set1_epi32(pair);
      }
      for (int b = 0; b < B; ++b) {
        const uint16_t* at = block + b * kBf16BlockColumns * padded_k + p * 2 * kBf16BlockColumns;
        for (int c = 0; c < 4; ++c) {
          const __m512bh wv = (__m512bh)_mm512_loadu_si512(at + c * 2 * kLanes);
          for (int a = 0; a < I; ++a) acc[a][b][c] = _mm512_dpbf16_ps(acc[a][b][c], xv[a], wv);
        }
      }
    }
    const bool first = k0 == 0, last = k1 == padded_k;
    for (int a = 0; a < I; ++a) {
      float* out = y + (i + a) * m;
      for (int b = 0; b < B; ++b) {
        for (int c = 0; c < 4; ++c) {
          const int64_t at = col + b * kBf16BlockColumns + c * kLanes;
          if (at >= m) break;
          const __mmask16 mask = m - at >= kLanes ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (m - at)) - 1);
          __m512 v = acc[a][b][c];
          if (!first) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, out + at));
          if (last && bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + at));
          _mm512_mask_storeu_ps(out + at, mask, v);
        }
      }
    }
  }
}

// Every input row over the blocks [col, col + 64 B).
template <int B>
inline void Blocks(float* y, const uint16_t* xb, int64_t n, int64_t m, int64_t padded_k, int64_t chunk,
                   const uint16_t* w, const float* bias, int64_t col) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) Tile<B, 4>(y, xb, i, m, padded_k, chunk, w, bias, col);
  switch (n - i) {
    case 3: Tile<B, 3>(y, xb, i, m, padded_k, chunk, w, bias, col); break;
    case 2: Tile<B, 2>(y, xb, i, m, padded_k, chunk, w, bias, col); break;
    case 1: Tile<B, 1>(y, xb, i, m, padded_k, chunk, w, bias, col); break;
    default: break;
  }
}

}  // namespace

void Bf16BlockedMatMul(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint16_t* w,
                       const float* bias, int64_t chunk, int threads) {
  const int64_t padded_k = (k + kBf16BlockInputs - 1) / kBf16BlockInputs * kBf16BlockInputs;
  chunk = chunk < kBf16BlockInputs ? padded_k : chunk / kBf16BlockInputs * kBf16BlockInputs;
  thread_local std::vector<uint16_t> xb;  // the calling thread's scratch, reused (grows only)
  if (xb.size() < static_cast<size_t>(n * padded_k)) xb.resize(static_cast<size_t>(n * padded_k));
  RoundRows(xb.data(), x, n, k, padded_k);
  const uint16_t* rounded = xb.data();
  // Column ranges of whole pairs of blocks per thread; a lone row takes them two at a time, more
  // rows one (their I x 4 accumulators are enough).
  constexpr int64_t kPair = 2 * kBf16BlockColumns;
  ForEachColumnRange(m, kPair, threads, [&](int64_t c0, int64_t c1) {
    int64_t col = c0;
    if (n == 1) {
      for (; col + kBf16BlockColumns < c1; col += kPair) Blocks<2>(y, rounded, n, m, padded_k, chunk, w, bias, col);
    }
    for (; col < c1; col += kBf16BlockColumns) Blocks<1>(y, rounded, n, m, padded_k, chunk, w, bias, col);
  });
}

}  // namespace shardserve::cpu
