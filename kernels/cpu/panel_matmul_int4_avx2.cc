// The int4 panels' product (panel_matmul.h's PanelMatMulInt4) on CPUs with AVX2 and FMA but not
// AVX-512: the same panels and the same operations per output as panel_matmul_int4_avx512.cc, in
// 8-float vectors (each panel's 16 outputs are two), so its results are that file's bit for bit
// (tests/kernels_cpu_test.cc compares them where a CPU has both). Widening: 8 bytes of a line
// zero-extended to int32 lanes, their low nibbles masked (the even input) or shifted (the odd one),
// then converted; AVX2's VPERMPS looks up among 8 values only, not 16.
//
// Tiles, with AVX2's 16 registers, in halves of a panel (8 outputs): 1 row x 8 halves and 2 rows x
// 4 (8 sums; one load widened for both inputs of a pair, its codes used as they are made); 3 and 4
// rows x 2; 5 to 7 rows x 1 (8 sums per widened vector at most), each input broadcast once for the
// codes it meets; from 8 rows, WidenedBlock below. (Tiles of up to 12 rows, as the AVX-512 file's,
// took 105-119 ms at 128 rows against 94 for 8: their 12 input rows, k x 4 bytes apart, spilled
// registers and met in the same cache sets.) bench_matmul on a Zen 5, the AVX2 instances:
// 1.27-2.12x the blocks' 8-lane product (bench_matmul --threads 2 --layers 12 --max-rows 128).
//
// From 8 rows (WidenedBlock) each group's codes are widened once for a panel and all its tiles of
// rows, into an 8 KiB buffer of floats that 6-row x 2-vector tiles read as the float32 panels' read
// a panel: the same operations per output. On a Zen 3 core (bench_matmul --threads 1, the register
// tiles and these in alternating runs) that is 1.1x the register tiles at 8 rows, 1.2x at 32 and
// 1.4-1.6x from 128, about the float32 panels' speed there.

// This file alone is compiled with -mavx2 -mfma (kernels/CMakeLists.txt); the CPU backend calls it
// only on CPUs that have them.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/cpu/panel_matmul.h"
#include "kernels/cpu/tile_rows.h"

namespace shardserve::cpu {
namespace {

constexpr int kHalf = kPanelCols / 2;  // outputs per 8-float vector
constexpr int64_t kInt4TileRows = 8;
// Halves (8 outputs) per tile for a tile of `rows` rows.
constexpr int HalvesFor(int64_t rows) { return rows == 1 ? 8 : rows == 2 ? 4 : rows <= 4 ? 2 : 1; }
// As panel_matmul_int4_avx512.cc: the line this far past each one read is asked for.
constexpr int64_t kPrefetchBytes = 8192;

// Half `half` of a block's panels (its outputs 8 half .. + 7): in panel half / 2, indexed within it
// (one pointer running across the panels would index past each panel's array).
template <typename T>
[[gnu::always_inline]] inline const T* Half(const T (&panels)[kInt4GroupPanels][kPanelCols], int half) {
  return panels[half / 2] + kHalf * (half % 2);
}

// Half first + h of a block (its outputs 8 (first + h) .. + 7) of line j: its 8 bytes as int32
// lanes (Bytes), or their codes at input 2j (kOdd false) or 2j + 1 as floats (Widen). (A line's
// halves are 8 bytes apart, as its scales' and zeros' are 8 floats apart.)
[[gnu::always_inline]] inline __m256i Bytes(const Int4PanelGroup& group, int64_t j, int first, int h) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(Half(group.q[j], first + h))));
}
template <bool kOdd>
[[gnu::always_inline]] inline __m256 Widen(const Int4PanelGroup& group, int64_t j, int first, int h) {
  const __m256i bytes = Bytes(group, j, first, h);
  return _mm256_cvtepi32_ps(kOdd ? _mm256_srli_epi32(bytes, 4) : _mm256_and_si256(bytes, _mm256_set1_epi32(15)));
}

// Input 2j + kOdd of the tile's R rows: each row's sums (R x 2P, h = 2 panel + half) by the codes.
template <int R, int H, bool kOdd>
[[gnu::always_inline]] inline void Step(__m256 (&part)[R][H], const float* xg, int64_t k,
                                        const Int4PanelGroup& group, int first, int64_t j) {
  __m256 w[H];
  for (int h = 0; h < H; ++h) w[h] = Widen<kOdd>(group, j, first, h);
  for (int r = 0; r < R; ++r) {
    const __m256 xb = _mm256_set1_ps(xg[r * k + 2 * j + (kOdd ? 1 : 0)]);
    for (int h = 0; h < H; ++h) part[r][h] = _mm256_fmadd_ps(w[h], xb, part[r][h]);
  }
}

// y [R, cols] = x [R, k] @ halves [first, first + H) of a block (+ bias): panel_matmul_int4_avx512.cc's
// Tile, the same operations on each output.
template <int R, int H>
[[gnu::always_inline]] inline void Tile(float* y, int64_t ldy, const float* x, int64_t k, const float* sums,
                                        const Int4PanelGroup* block, int first, int64_t groups, int64_t cols,
                                        const float* bias) {
  alignas(32) float acc[R][H][kHalf] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const Int4PanelGroup& group = block[g];
    const int64_t base = g * kInt4PanelGroupInputs, size = std::min(kInt4PanelGroupInputs, k - base);
    const float* xg = x + base;
    __m256 part[R][H];
    for (int r = 0; r < R; ++r) {
      for (int h = 0; h < H; ++h) part[r][h] = _mm256_setzero_ps();
    }
    const int64_t pairs = size / 2;
    for (int64_t j = 0; j < pairs; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(group.q[j]) + kPrefetchBytes, _MM_HINT_T0);
      if constexpr (R <= 2) {  // one load widened for both inputs, its codes used as they are made
        __m256 even[R], odd[R];
        for (int r = 0; r < R; ++r) {
          even[r] = _mm256_set1_ps(xg[r * k + 2 * j]);
          odd[r] = _mm256_set1_ps(xg[r * k + 2 * j + 1]);
        }
        for (int h = 0; h < H; ++h) {
          const __m256i bytes = Bytes(group, j, first, h);
          const __m256 low = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
          const __m256 high = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
          for (int r = 0; r < R; ++r) part[r][h] = _mm256_fmadd_ps(low, even[r], part[r][h]);
          for (int r = 0; r < R; ++r) part[r][h] = _mm256_fmadd_ps(high, odd[r], part[r][h]);
        }
      } else {
        Step<R, H, false>(part, xg, k, group, first, j);
        Step<R, H, true>(part, xg, k, group, first, j);
      }
    }
    if (size % 2 != 0) Step<R, H, false>(part, xg, k, group, first, pairs);  // a short last group's last input
    for (int h = 0; h < H; ++h) {
      const __m256 scale = _mm256_load_ps(Half(group.scale, first + h));
      const __m256 zero = _mm256_load_ps(Half(group.zero, first + h));
      for (int r = 0; r < R; ++r) {
        const __m256 centred = _mm256_fnmadd_ps(zero, _mm256_set1_ps(sums[r * groups + g]), part[r][h]);
        _mm256_store_ps(acc[r][h], _mm256_fmadd_ps(scale, centred, _mm256_load_ps(acc[r][h])));
      }
    }
  }
  for (int h = 0; h < H; ++h) {
    const int64_t c0 = h * kHalf, n = std::min<int64_t>(kHalf, cols - c0);
    if (n <= 0) break;
    for (int r = 0; r < R; ++r) {
      // With no bias the sum is stored as it is (adding +0.0 would turn a -0.0 sum into +0.0).
      for (int64_t c = 0; c < n; ++c) y[r * ldy + c0 + c] = bias != nullptr ? acc[r][h][c] + bias[c0 + c] : acc[r][h][c];
    }
  }
}

// From kWidenedMinRows rows (a prefill's, many streams', an expert's share of a prefill), the
// codes are widened once per group and panel, not once per tile of rows: into a buffer of floats
// [inputs][16] that every tile then reads as the float32 panels' tiles read a panel (panel_tiles.h:
// 6 rows x 2 vectors, 12 sums, a broadcast of x feeding two of them), each row's sums of the groups
// before kept in `acc`. Each output's operations are Tile's, in the same order: only the loops
// around them differ.
constexpr int64_t kWidenedMinRows = 8;
constexpr int64_t kWidenedTileRows = 6;

// acc [R][16] (row stride 16) += one group of R rows (x rows xg, row stride k; their group sums at
// sums, row stride `groups`) times a panel's widened codes [size][16], as Tile's epilogue adds it.
template <int R>
[[gnu::always_inline]] inline void WidenedTile(float* acc, const float* xg, int64_t k, const float* sums,
                                               int64_t groups, const float* codes, int64_t size, const float* scale,
                                               const float* zero) {
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t j = 0; j < size; ++j) {
    const __m256 w_lo = _mm256_load_ps(codes + j * kPanelCols);
    const __m256 w_hi = _mm256_load_ps(codes + j * kPanelCols + kHalf);
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_set1_ps(xg[r * k + j]);
      lo[r] = _mm256_fmadd_ps(w_lo, xb, lo[r]);
      hi[r] = _mm256_fmadd_ps(w_hi, xb, hi[r]);
    }
  }
  const __m256 scale_lo = _mm256_load_ps(scale), scale_hi = _mm256_load_ps(scale + kHalf);
  const __m256 zero_lo = _mm256_load_ps(zero), zero_hi = _mm256_load_ps(zero + kHalf);
  for (int r = 0; r < R; ++r) {
    const __m256 sum = _mm256_set1_ps(sums[r * groups]);
    float* a = acc + r * kPanelCols;
    _mm256_storeu_ps(a, _mm256_fmadd_ps(scale_lo, _mm256_fnmadd_ps(zero_lo, sum, lo[r]), _mm256_loadu_ps(a)));
    _mm256_storeu_ps(a + kHalf,
                     _mm256_fmadd_ps(scale_hi, _mm256_fnmadd_ps(zero_hi, sum, hi[r]), _mm256_loadu_ps(a + kHalf)));
  }
}

// Every row of y (row stride m) at block b's output columns, a panel at a time, its codes widened
// group by group (kWidenedMinRows rows or more).
void WidenedBlock(float* y, int64_t m, const float* x, int64_t n, int64_t k, const float* sums,
                  const Int4PanelGroup* block, int64_t groups, int64_t b, const float* bias) {
  alignas(32) float codes[kInt4PanelGroupInputs][kPanelCols];
  thread_local std::vector<float> acc;  // [n][16], the calling thread's
  acc.resize(static_cast<size_t>(n * kPanelCols));
  const __m128i low_nibbles = _mm_set1_epi8(15);
  for (int p = 0; p < kInt4GroupPanels; ++p) {
    const int64_t c0 = (b * kInt4GroupPanels + p) * kPanelCols;
    if (c0 >= m) break;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t g = 0; g < groups; ++g) {
      const Int4PanelGroup& group = block[g];
      const int64_t base = g * kInt4PanelGroupInputs, size = std::min(kInt4PanelGroupInputs, k - base);
      for (int64_t j = 0; j < (size + 1) / 2; ++j) {  // input pair 2j, 2j + 1: 16 bytes, a code each
        const __m128i bytes = _mm_load_si128(reinterpret_cast<const __m128i*>(group.q[j][p]));
        const __m128i even = _mm_and_si128(bytes, low_nibbles);
        const __m128i odd = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibbles);
        _mm256_store_ps(codes[2 * j], _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(even)));
        _mm256_store_ps(codes[2 * j] + kHalf, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(even, 8))));
        _mm256_store_ps(codes[2 * j + 1], _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(odd)));
        _mm256_store_ps(codes[2 * j + 1] + kHalf, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(odd, 8))));
      }
      WithBalancedTiles<kWidenedTileRows>(n, [&](int64_t r, auto R) __attribute__((always_inline)) {
        WidenedTile<R()>(acc.data() + r * kPanelCols, x + r * k + base, k, sums + r * groups + g, groups, codes[0],
                         size, group.scale[p], group.zero[p]);
      });
    }
    const int64_t cols = std::min<int64_t>(kPanelCols, m - c0);
    for (int64_t r = 0; r < n; ++r) {
      // With no bias the sum is stored as it is (adding +0.0 would turn a -0.0 sum into +0.0).
      for (int64_t c = 0; c < cols; ++c) {
        const float a = acc[r * kPanelCols + c];
        y[r * m + c0 + c] = bias != nullptr ? a + bias[c0 + c] : a;
      }
    }
  }
}

// Every row of y (row stride m) at block b's output columns, H halves at a time, the rows in
// balanced tiles (WithBalancedTiles).
template <int H>
void Block(float* y, int64_t m, const float* x, int64_t n, int64_t k, const float* sums, const Int4PanelGroup* w,
           int64_t groups, int64_t b, const float* bias) {
  for (int first = 0; first < 2 * kInt4GroupPanels; first += H) {
    const int64_t c0 = b * kInt4GroupPanels * kPanelCols + first * kHalf;
    if (c0 >= m) break;
    const int64_t cols = std::min<int64_t>(H * kHalf, m - c0);
    const float* bc = bias != nullptr ? bias + c0 : nullptr;
    WithBalancedTiles<kInt4TileRows>(n, [&](int64_t r, auto R) __attribute__((always_inline)) {
      // (Every tile of a product has at least the halves of its longest: the same H serves.)
      if constexpr (HalvesFor(R()) >= H) {
        Tile<R(), H>(y + r * m + c0, m, x + r * k, k, sums + r * groups, w + b * groups, first, groups, cols, bc);
      }
    });
  }
}

}  // namespace

void PanelMatMulInt4BlocksAvx2(float* y, const float* x, int64_t n, int64_t m, int64_t k, const float* sums,
                               const Int4PanelGroup* w, int64_t b0, int64_t b1, const float* bias) {
  const int64_t groups = (k + kInt4PanelGroupInputs - 1) / kInt4PanelGroupInputs;
  const int per = HalvesFor(LongestBalancedTile(n, kInt4TileRows));
  for (int64_t b = b0; b < b1; ++b) {
    if (n >= kWidenedMinRows) {
      WidenedBlock(y, m, x, n, k, sums, w + b * groups, groups, b, bias);
      continue;
    }
    switch (per) {
      case 8: Block<8>(y, m, x, n, k, sums, w, groups, b, bias); break;
      case 4: Block<4>(y, m, x, n, k, sums, w, groups, b, bias); break;
      case 2: Block<2>(y, m, x, n, k, sums, w, groups, b, bias); break;
      default: Block<1>(y, m, x, n, k, sums, w, groups, b, bias); break;
    }
  }
}

}  // namespace shardserve::cpu
