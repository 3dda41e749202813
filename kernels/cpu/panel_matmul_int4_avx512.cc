// The int4 panels' product (panel_matmul.h's PanelMatMulInt4), on CPUs with AVX-512F: the CPU
// backend's exact int4 product there (quant_isa.h IntOnPanels). As the float32 panels' AVX-512
// tiles (panel_matmul_avx512.cc), each zmm holds one panel's 16 outputs and each FMA broadcasts one
// input, so that a panel's codes, widened once in registers, serve every row of a tile: a prefill's
// tile of 12 rows x 2 panels runs 24 FMAs per widened vector. (The blocks' 16-lane product it
// replaced, the input k in the lanes, needed a full input vector per 4 of its FMAs and reached
// three quarters of the float32 panels' rate on a Zen 5 EPYC: bench_matmul.) A
// thread reads its blocks of 4 panels as one stream, a 64-byte line per pair of inputs.
//
// Widening: a byte holds an output's codes at inputs 2j (low nibble) and 2j + 1 (high one); 16
// bytes zero-extended to int32 lanes become floats by a lookup in [0, 1, ..., 15] (VPERMPS reads an
// index's low 4 bits only, so the low nibbles need no mask; the high ones a shift): per 32 weights
// one load, two lookups and a shift.
//
// This file alone is compiled with -mavx512f -mavx512bw -mavx512vl -mfma (kernels/CMakeLists.txt);
// the CPU backend calls PanelMatMulInt4 only on CPUs that have them.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cpu/panel_matmul.h"
#include "kernels/cpu/tile_rows.h"
#include "kernels/cpu/tile_store_avx512.h"

namespace shardserve::cpu {
namespace {

static_assert(sizeof(Int4PanelGroup) == kInt4GroupPanels * (2 * 64 + 1024), "scales, zeros and 64 code lines");

// Rows per tile, at most, and panels per tile for a tile of `rows` rows: all 4 of a block up to 5
// rows (4 to 20 sums: the codes of 4 panels at both inputs of a pair, 8 registers, fit beside
// them), 2 from 6 rows (12 to 24 sums).
constexpr int64_t kInt4TileRows = 12;
constexpr int64_t Int4PanelsFor(int64_t rows) { return rows <= 5 ? 4 : 2; }
// A tile asks the cache for the line kPrefetchBytes past each one it reads (the weight is one
// stream per thread, and one core's hardware prefetcher keeps too few lines of one stream in
// flight).
constexpr int64_t kPrefetchBytes = 8192;

// Inputs 2j and 2j + 1 of group g: the P panels' codes widened, both inputs from one load (R x P
// sums + 2P codes, the table and a broadcast fit the 32 registers), then each row's input broadcast
// once for its P sums (rows outer: so that no row's broadcast stays in a register). kOne: input 2j
// alone (a short last group's odd last input).
template <int R, int P, bool kOne = false>
[[gnu::always_inline]] inline void Pair(__m512 (&part)[R][P], const float* xg, int64_t k, const Int4PanelGroup& group,
                                        int first, int64_t j, __m512 table) {
  static_assert(R * P + 2 * P <= 28, "the sums and the codes in registers");
  __m512 even[P], odd[P];
  for (int q = 0; q < P; ++q) {
    const __m512i bytes =
        _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(group.q[j][first + q])));
    even[q] = _mm512_permutexvar_ps(bytes, table);
    if constexpr (!kOne) odd[q] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  }
  for (int r = 0; r < R; ++r) {
    const __m512 xb = _mm512_set1_ps(xg[r * k + 2 * j]);
    for (int q = 0; q < P; ++q) part[r][q] = _mm512_fmadd_ps(even[q], xb, part[r][q]);
  }
  if constexpr (!kOne) {
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(xg[r * k + 2 * j + 1]);
      for (int q = 0; q < P; ++q) part[r][q] = _mm512_fmadd_ps(odd[q], xb, part[r][q]);
    }
  }
}

// y [R, cols] (row stride ldy) = x [R, k] (row stride k) @ panels [first, first + P) of the
// block whose groups are at `block` (+ bias [cols]), the rows' group sums at sums [R, groups]. Per
// output and group g: the chain of fma(q, x, partial) over the group's inputs in order from zero,
// then
//   acc = fma(scale, fnmadd(zero, sum of the group's x, partial), acc)
// from acc = 0, group by group; y = acc (+ bias). The same operations whatever R, P and the tile.
template <int R, int P>
[[gnu::always_inline]] inline void Tile(float* y, int64_t ldy, const float* x, int64_t k, const float* sums,
                                        const Int4PanelGroup* block, int first, int64_t groups, int64_t cols,
                                        const float* bias) {
  const __m512 table = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  // The totals, updated once a group: in memory (L1), so that the registers hold the partial sums.
  alignas(64) float acc[R][P][kPanelCols] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const Int4PanelGroup& group = block[g];
    const int64_t base = g * kInt4PanelGroupInputs, size = std::min(kInt4PanelGroupInputs, k - base);
    const float* xg = x + base;
    __m512 part[R][P];
    for (int r = 0; r < R; ++r) {
      for (int q = 0; q < P; ++q) part[r][q] = _mm512_setzero_ps();
    }
    const int64_t pairs = size / 2;
    for (int64_t j = 0; j < pairs; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(group.q[j]) + kPrefetchBytes, _MM_HINT_T0);
      Pair<R, P>(part, xg, k, group, first, j, table);
    }
    if (size % 2 != 0) Pair<R, P, true>(part, xg, k, group, first, pairs, table);
    for (int q = 0; q < P; ++q) {
      const __m512 scale = _mm512_load_ps(group.scale[first + q]), zero = _mm512_load_ps(group.zero[first + q]);
      for (int r = 0; r < R; ++r) {
        const __m512 centred = _mm512_fnmadd_ps(zero, _mm512_set1_ps(sums[r * groups + g]), part[r][q]);
        _mm512_store_ps(acc[r][q], _mm512_fmadd_ps(scale, centred, _mm512_load_ps(acc[r][q])));
      }
    }
  }
  StoreTileSums<R, P>(y, ldy, cols, bias, [&](int r, int q) { return _mm512_load_ps(acc[r][q]); });
}

// Every row of y (row stride m) at block b's output columns, P panels at a time, the rows in
// balanced tiles (WithBalancedTiles).
template <int P>
void Block(float* y, int64_t m, const float* x, int64_t n, int64_t k, const float* sums, const Int4PanelGroup* w,
           int64_t groups, int64_t b, const float* bias) {
  for (int first = 0; first < kInt4GroupPanels; first += P) {
    const int64_t c0 = (b * kInt4GroupPanels + first) * kPanelCols;
    if (c0 >= m) break;
    const int64_t cols = std::min(P * kPanelCols, m - c0);
    const float* bc = bias != nullptr ? bias + c0 : nullptr;
    WithBalancedTiles<kInt4TileRows>(n, [&](int64_t r, auto R) __attribute__((always_inline)) {
      // (Every tile of a product has at least the registers of its longest: the same P serves.)
      if constexpr (R() * P + 2 * P <= 28) {
        Tile<R(), P>(y + r * m + c0, m, x + r * k, k, sums + r * groups, w + b * groups, first, groups, cols, bc);
      }
    });
  }
}

}  // namespace

void PanelMatMulInt4BlocksAvx512(float* y, const float* x, int64_t n, int64_t m, int64_t k, const float* sums,
                                 const Int4PanelGroup* w, int64_t b0, int64_t b1, const float* bias) {
  const int64_t groups = (k + kInt4PanelGroupInputs - 1) / kInt4PanelGroupInputs;
  const int64_t per = Int4PanelsFor(LongestBalancedTile(n, kInt4TileRows));
  for (int64_t b = b0; b < b1; ++b) {
    if (per == 4) {
      Block<4>(y, m, x, n, k, sums, w, groups, b, bias);
    } else {
      Block<2>(y, m, x, n, k, sums, w, groups, b, bias);
    }
  }
}

}  // namespace shardserve::cpu
