// The int4 panels' product on int16 activations (panel_matmul.h's PanelMatMulInt4Act16), on CPUs
// with AVX-512 VNNI: the CPU backend's int4 product under --activation-quantization int16.
//
// Each row's inputs are quantized per group of 128 (the weights' groups): sx = max |x| / 32767 over
// the group, v = round(x x (32767 / max |x|)) to nearest even, in [-32767, 32767]. The codes and v
// are then multiplied as integers, two inputs at a time (VPDPWSSD: 16 outputs x 2 inputs a
// instruction, where the exact product's FMA does 16 x 1), and each output's group total is scaled
// in float32:
//   acc = fma(scale x sx, fnmadd(zero, sum of the group's v, float(sum_j q_j v_j)), acc)
// from acc = 0, group by group; y = acc (+ bias). The integer sums are exact (|q v| x 128 < 2^26),
// so the only rounding besides float32's is the activations': each moves by at most half a step,
// max |x| / 65534 of its group, a hundred times finer than bf16's and 258 times finer than int8's
// (--activation-quantization int8).
//
// The codes come as the exact instance's (panel_matmul_int4_avx512.cc) layout has them: byte q[j][p][c]
// holds output c's codes at inputs 2j (low nibble) and 2j + 1 (high one), which VPDPWSSD wants as the
// two 16-bit halves of a lane: 16 bytes zero-extended to int32 lanes b, then (b | b << 12) & 0x000F000F,
// three instructions per 32 weights (no table). Each row's pair of inputs is one 32-bit broadcast.
// Tiles of up to 8 rows x 2 panels, or up to 5 rows x all 4 panels of a block. (Up to 12 rows, as
// the exact instance's, took twice as long from 9 rows a tile: 13.05 against 6.66 ms for 32 rows of
// bench_matmul's stage on a Zen 4 EPYC, 2 threads; 8 rows reach 363 GFLOP/s there, 1.9x the exact
// product's 190.)
//
// This file alone is compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mfma
// (kernels/CMakeLists.txt); the CPU backend calls it only on CPUs that have them.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/panel_matmul.h"
#include "kernels/cpu/tile_rows.h"
#include "kernels/cpu/tile_store_avx512.h"

namespace shardserve::cpu {
namespace {

constexpr int64_t kGroup = kInt4PanelGroupInputs;  // 128: the weights' groups, and the activations'
constexpr int64_t kTileRows = 8;
constexpr int64_t PanelsFor(int64_t rows) { return rows <= 5 ? 4 : 2; }
constexpr int64_t kPrefetchBytes = 8192;  // as the exact instance: one stream a thread
constexpr float kLevels = 32767.0f;

// n rows of `groups` groups: v [groups][n][128] (zero past k), group by group so that a tile's rows
// at one group lie 256 bytes apart, where row by row they lie 2k bytes apart (4 KiB at k = 2048: one
// set of the L1 cache for every row); 1-5% faster at 8 to 32 rows (bench_matmul --hidden 2048 --kv
// 512 --mlp 5632, Zen 4). And per row and group [n][groups] its scale and its sum of v.
struct Rows16 {
  int64_t n = 0;
  std::vector<int16_t> v;
  std::vector<float> scale;
  std::vector<float> sum;  // each group's sum of v, as a float (exact: |sum| <= 128 x 32767 < 2^24)
  int16_t* group_row(int64_t g, int64_t i) { return v.data() + (g * n + i) * kGroup; }
  const int16_t* group_row(int64_t g, int64_t i) const { return v.data() + (g * n + i) * kGroup; }
};

// *rows sized for n rows of `groups` groups (their values left to QuantizeRows).
void SizeRows(Rows16* rows, int64_t n, int64_t groups) {
  rows->n = n;
  rows->v.resize(static_cast<size_t>(n * groups * kGroup));
  rows->scale.resize(static_cast<size_t>(n * groups));
  rows->sum.resize(static_cast<size_t>(n * groups));
}

// Rows [i0, i1) of x [n, k] -> *rows (sized by SizeRows; Int16ActivationGroups states the rounding),
// every value of their groups written. A group with a NaN or an infinity gets scale NaN (its row's
// outputs are NaN) and v 0.
void QuantizeRows(Rows16* rows, const float* x, int64_t k, int64_t groups, int64_t i0, int64_t i1) {
  const __m512 finite = _mm512_set1_ps(std::numeric_limits<float>::max());
  for (int64_t i = i0; i < i1; ++i) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + i * k + g * kGroup;
      const int64_t size = std::min(kGroup, k - g * kGroup);
      __m512 amax = _mm512_setzero_ps();
      __mmask16 bad = 0;
      for (int64_t c = 0; c < size; c += 16) {
        const __mmask16 lanes = FirstLanes(size - c);
        const __m512 a = _mm512_abs_ps(_mm512_maskz_loadu_ps(lanes, xg + c));
        bad |= _mm512_mask_cmp_ps_mask(lanes, a, finite, _CMP_NLE_UQ);  // NaN or above the largest float
        amax = _mm512_max_ps(amax, a);
      }
      const int64_t at = i * groups + g;
      int16_t* v = rows->group_row(g, i);
      const float m = _mm512_reduce_max_ps(amax);
      if (bad != 0 || m == 0) {
        rows->scale[at] = bad != 0 ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
        rows->sum[at] = 0;
        std::fill(v, v + kGroup, int16_t{0});
        continue;
      }
      const __m512 inv = _mm512_set1_ps(kLevels / m);
      __m512i sum = _mm512_setzero_si512();
      for (int64_t c = 0; c < size; c += 16) {
        const __mmask16 lanes = FirstLanes(size - c);
        // round to nearest even (MXCSR's default), then saturated to int16 (|x| x inv <= 32767 anyway)
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, xg + c), inv));
        sum = _mm512_add_epi32(sum, q);
        _mm256_mask_storeu_epi16(v + c, lanes, _mm512_cvtsepi32_epi16(q));
      }
      std::fill(v + size, v + kGroup, int16_t{0});  // past k
      rows->scale[at] = m / kLevels;
      rows->sum[at] = static_cast<float>(_mm512_reduce_add_epi32(sum));
    }
  }
}

// y [R, cols] (row stride ldy) = rows [R] @ panels [first, first + P) of the block at `block` (+ bias).
template <int R, int P>
[[gnu::always_inline]] inline void Tile(float* y, int64_t ldy, const Rows16& rows, int64_t row0, int64_t k,
                                        const Int4PanelGroup* block, int first, int64_t groups, int64_t cols,
                                        const float* bias) {
  static_assert(R * P + P + 2 <= 32, "the sums, the codes, the mask and a broadcast in registers");
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
  alignas(64) float acc[R][P][kPanelCols] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const Int4PanelGroup& group = block[g];
    const int64_t pairs = (std::min(kGroup, k - g * kGroup) + 1) / 2;  // v and the codes are 0 past k
    const int16_t* v = rows.group_row(g, row0);
    __m512i part[R][P];
    for (int r = 0; r < R; ++r) {
      for (int q = 0; q < P; ++q) part[r][q] = _mm512_setzero_si512();
    }
    for (int64_t j = 0; j < pairs; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(group.q[j]) + kPrefetchBytes, _MM_HINT_T0);
      __m512i codes[P];
      for (int q = 0; q < P; ++q) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(group.q[j][first + q])));
        codes[q] = _mm512_and_si512(_mm512_or_si512(b, _mm512_slli_epi32(b, 12)), nibbles);
      }
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, v + r * kGroup + 2 * j, sizeof pair);
        const __m512i xb = _mm512_set1_epi32(pair);
        for (int q = 0; q < P; ++q) part[r][q] = _mm512_dpwssd_epi32(part[r][q], codes[q], xb);
      }
    }
    for (int q = 0; q < P; ++q) {
      const __m512 scale = _mm512_load_ps(group.scale[first + q]), zero = _mm512_load_ps(group.zero[first + q]);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (row0 + r) * groups + g;
        const __m512 centred =
            _mm512_fnmadd_ps(zero, _mm512_set1_ps(rows.sum[at]), _mm512_cvtepi32_ps(part[r][q]));
        const __m512 s = _mm512_mul_ps(scale, _mm512_set1_ps(rows.scale[at]));
        _mm512_store_ps(acc[r][q], _mm512_fmadd_ps(s, centred, _mm512_load_ps(acc[r][q])));
      }
    }
  }
  StoreTileSums<R, P>(y, ldy, cols, bias, [&](int r, int q) { return _mm512_load_ps(acc[r][q]); });
}

// Every row of y (row stride m) at block b's output columns, P panels at a time, the rows in
// balanced tiles.
template <int P>
void Block(float* y, int64_t m, const Rows16& rows, int64_t n, int64_t k, const Int4PanelGroup* w, int64_t groups,
           int64_t b, const float* bias) {
  for (int first = 0; first < kInt4GroupPanels; first += P) {
    const int64_t c0 = (b * kInt4GroupPanels + first) * kPanelCols;
    if (c0 >= m) break;
    const int64_t cols = std::min(P * kPanelCols, m - c0);
    const float* bc = bias != nullptr ? bias + c0 : nullptr;
    WithBalancedTiles<kTileRows>(n, [&](int64_t r, auto R) __attribute__((always_inline)) {
      if constexpr (R() * P + P + 2 <= 32) {
        Tile<R(), P>(y + r * m + c0, m, rows, r, k, w + b * groups, first, groups, cols, bc);
      }
    });
  }
}

}  // namespace

void Int16ActivationGroups(int16_t* v, float* scale, float* sum, const float* x, int64_t n, int64_t k) {
  const int64_t groups = (k + kGroup - 1) / kGroup;
  Rows16 rows;
  // Poisoned first, as a reused buffer would hold another product's values: QuantizeRows writes them all.
  rows.v.assign(static_cast<size_t>(n * groups * kGroup), int16_t{0x5555});
  SizeRows(&rows, n, groups);
  QuantizeRows(&rows, x, k, groups, 0, n);
  for (int64_t i = 0; i < n; ++i) {  // to the row-major layout this function states
    for (int64_t g = 0; g < groups; ++g) std::copy_n(rows.group_row(g, i), kGroup, v + (i * groups + g) * kGroup);
  }
  std::copy(rows.scale.begin(), rows.scale.end(), scale);
  std::copy(rows.sum.begin(), rows.sum.end(), sum);
}

void PanelMatMulInt4Act16(float* y, const float* x, int64_t n, int64_t m, int64_t k, const Int4PanelGroup* w,
                          const float* bias, int threads) {
  const int64_t groups = (k + kGroup - 1) / kGroup;
  const int64_t blocks = (m + kInt4GroupPanels * kPanelCols - 1) / (kInt4GroupPanels * kPanelCols);
  thread_local Rows16 rows;  // the calling thread's, reused
  SizeRows(&rows, n, groups);
  Rows16& r = rows;  // (named here: inside the parallel region, `rows` is each thread's own)
  const int64_t per = PanelsFor(LongestBalancedTile(n, kTileRows));
  const int parts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, blocks)));
  // The threads first quantize a share of the rows each (rather than one thread while the others
  // wait), then share out whole blocks (columns), never k, so the thread count cannot change a sum;
  // each thread's blocks are adjacent, one stream of memory.
#pragma omp parallel num_threads(parts)
  {
    const int t = omp_get_thread_num(), team = omp_get_num_threads();
    QuantizeRows(&r, x, k, groups, n * t / team, n * (t + 1) / team);
#pragma omp barrier
    for (int64_t b = blocks * t / team; b < blocks * (t + 1) / team; ++b) {
      if (per == 4) {
        Block<4>(y, m, r, n, k, w, groups, b, bias);
      } else {
        Block<2>(y, m, r, n, k, w, groups, b, bias);
      }
    }
  }
}

}  // namespace shardserve::cpu
