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
// The codes are the int4 panels' in their own order (panel_matmul.h Int4CodeOrder::kOctets): a
// 64-byte line holds a panel's 16 outputs x 8 inputs, and each of the line's 16-bit lanes shifted
// right by 4t and masked to its low nibble gives, in each 32-bit lane, one output's codes at inputs
// 8o + 2t and 8o + 2t + 1 as the two int16 VPDPWSSD wants: 7 instructions for 128 codes, where the
// exact instance's order (bytes zero-extended to int32 lanes, then (b | b << 12) & 0x000F000F) took
// 12, besides VPDPWSSD's 4 a row. Each row's pair of inputs is one 32-bit broadcast. The weights
// are asked for into L2 (prefetcht1) 16 KiB ahead, where into L1 (prefetcht0) 8 KiB ahead, as the
// exact instance does, held the one-row product to 22 GB/s: bench_matmul --threads 2 --layers 8
// --hidden 2048 --kv 512 --mlp 6144 on the Zen 4 EPYC, medians: 1 row 9.88 ms before both changes,
// 8.45 with the L2 requests alone, 7.42 with both (29 GB/s); 8 to 32 rows 5-10% less; 4 rows
// within 4% either way.
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
constexpr int64_t kPrefetchBytes = 16384;  // into L2 (prefetcht1), this far ahead: see above
constexpr int64_t kOctetBytes = kInt4GroupPanels * kPanelCols * 4;  // a block's codes at 8 inputs (kOctets order)
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
  static_assert(R * P + 2 * P + 2 <= 32, "the sums, the lines, their codes, the mask and a broadcast in registers");
  const __m512i nibble = _mm512_set1_epi16(0x000F);
  alignas(64) float acc[R][P][kPanelCols] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* q = &block[g].q[0][0][0];
    const int64_t octets = (std::min(kGroup, k - g * kGroup) + 7) / 8;  // v and the codes are 0 past k
    const int16_t* v = rows.group_row(g, row0);
    __m512i part[R][P];
    for (int r = 0; r < R; ++r) {
      for (int p = 0; p < P; ++p) part[r][p] = _mm512_setzero_si512();
    }
    for (int64_t o = 0; o < octets; ++o) {
      const uint8_t* octet = q + o * kOctetBytes;  // 4 lines: the block's panels at these 8 inputs
      for (int64_t at = 0; at < kOctetBytes; at += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(octet + at) + kPrefetchBytes, _MM_HINT_T1);
      }
      __m512i line[P];
      for (int p = 0; p < P; ++p) line[p] = _mm512_load_si512(octet + (first + p) * 64);
      for (int t = 0; t < 4; ++t) {  // inputs 8o + 2t and 8o + 2t + 1
        __m512i codes[P];
        for (int p = 0; p < P; ++p) {
          const __m512i shifted = t == 0 ? line[p] : _mm512_srli_epi16(line[p], 4 * t);
          codes[p] = t == 3 ? shifted : _mm512_and_si512(shifted, nibble);
        }
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, v + r * kGroup + 8 * o + 2 * t, sizeof pair);
          const __m512i xb = _mm512_set1_epi32(pair);
          for (int p = 0; p < P; ++p) part[r][p] = _mm512_dpwssd_epi32(part[r][p], codes[p], xb);
        }
      }
    }
    for (int p = 0; p < P; ++p) {
      const __m512 scale = _mm512_load_ps(block[g].scale[first + p]), zero = _mm512_load_ps(block[g].zero[first + p]);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (row0 + r) * groups + g;
        const __m512 centred =
            _mm512_fnmadd_ps(zero, _mm512_set1_ps(rows.sum[at]), _mm512_cvtepi32_ps(part[r][p]));
        const __m512 s = _mm512_mul_ps(scale, _mm512_set1_ps(rows.scale[at]));
        _mm512_store_ps(acc[r][p], _mm512_fmadd_ps(s, centred, _mm512_load_ps(acc[r][p])));
      }
    }
  }
  StoreTileSums<R, P>(y, ldy, cols, bias, [&](int r, int p) { return _mm512_load_ps(acc[r][p]); });
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
      if constexpr (R() * P + 2 * P + 2 <= 32) {
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
