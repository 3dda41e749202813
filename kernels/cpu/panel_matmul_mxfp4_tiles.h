// The MXFP4 panels' 8-float tiles (panel_matmul.h PanelMatMulMxfp4), as templates over how a panel
// step's 16 bytes (inputs 2j and 2j + 1 of 16 outputs) become four 8-float vectors of code values
// (`D::Decode(const uint8_t*, Vec8 even[2], Vec8 odd[2])`, exact) and over the multiply-add (`D::Fma`:
// fused on AVX2, a multiply and an add on baseline x86-64, as the float32 panels' clones):
// panel_matmul_mxfp4.cc instantiates them for baseline x86-64, panel_matmul_mxfp4_avx2.cc with
// AVX2 intrinsics. Internal to those files: everything here has internal linkage.
#ifndef SHARDSERVE_KERNELS_CPU_PANEL_MATMUL_MXFP4_TILES_H_
#define SHARDSERVE_KERNELS_CPU_PANEL_MATMUL_MXFP4_TILES_H_

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/cpu/panel_matmul.h"
#include "kernels/cpu/panel_tiles.h"
#include "kernels/cpu/tile_rows.h"
#include "kernels/host_vec.h"
#include "kernels/quant.h"

namespace shardserve::cpu {
namespace {

// Bytes of one panel's codes, and of its scales: k / 2 steps of 16 bytes; k / 32 blocks of 16.
inline int64_t Mxfp4PanelCodeBytes(int64_t k) { return k / 2 * kPanelCols; }
inline int64_t Mxfp4PanelScaleBytes(int64_t k) { return k / kMxfp4BlockSize * kPanelCols; }

// 2^(e - 127) for every E8M0 byte (255: +inf, which the backend never stores).
struct Mxfp4ScaleTable {
  float v[256];
  Mxfp4ScaleTable() {
    for (int e = 0; e < 256; ++e) v[e] = Mxfp4Scale(static_cast<uint8_t>(e));
  }
};
inline const Mxfp4ScaleTable& Mxfp4Scales() {
  static const Mxfp4ScaleTable t;
  return t;
}

// Rows per tile and panels per tile: 4 rows x 1 panel (8 chains, with the 4 decoded vectors and
// 2 scales, in AVX2's 16 registers as far as they go), 1-2 rows x 2 panels for a decode step.
constexpr int kMxfp4TileRows = 4;
constexpr int Mxfp4PanelsPerTile(int64_t rows) { return rows <= 2 ? 2 : 1; }

// y [R, cols] (row stride ldy) = x [R, k] (row stride k) @ P adjacent MXFP4 panels (the first's
// codes at `codes`, its scales at `scales`; the next panels' a panel's bytes further) (+ bias), cols
// <= 16 P. Each output one chain over k in order: D::Fma(weight, x, acc), the weight the code's
// value times its block's scale.
template <class D, int R, int P>
[[gnu::always_inline]] inline void Mxfp4Tile(float* y, int64_t ldy, const float* x, int64_t k, const uint8_t* codes,
                                             const uint8_t* scales, int64_t cols, const float* bias) {
  Vec8 acc[R][P][2];
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < P; ++q) acc[r][q][0] = acc[r][q][1] = Vec8{};
  }
  const int64_t code_stride = Mxfp4PanelCodeBytes(k), scale_stride = Mxfp4PanelScaleBytes(k);
  const float* table = Mxfp4Scales().v;
  for (int64_t g = 0; g < k / kMxfp4BlockSize; ++g) {
    Vec8 s[P][2];
    for (int q = 0; q < P; ++q) {
      const uint8_t* e = scales + q * scale_stride + g * kPanelCols;
      float f[kPanelCols];
      for (int64_t l = 0; l < kPanelCols; ++l) f[l] = table[e[l]];
      s[q][0] = LoadVec(f);
      s[q][1] = LoadVec(f + kVecLanes);
    }
    for (int64_t j = g * (kMxfp4BlockSize / 2); j < (g + 1) * (kMxfp4BlockSize / 2); ++j) {
      Vec8 even[P][2], odd[P][2];
      for (int q = 0; q < P; ++q) {
        D::Decode(codes + q * code_stride + j * kPanelCols, even[q], odd[q]);
        for (int h = 0; h < 2; ++h) {
          even[q][h] *= s[q][h];  // exact: a power of two times a value of 2 significant bits
          odd[q][h] *= s[q][h];
        }
      }
      for (int r = 0; r < R; ++r) {
        const float x0 = x[r * k + 2 * j], x1 = x[r * k + 2 * j + 1];
        for (int q = 0; q < P; ++q) {
          for (int h = 0; h < 2; ++h) acc[r][q][h] = D::Fma(even[q][h], x0, acc[r][q][h]);
        }
        for (int q = 0; q < P; ++q) {
          for (int h = 0; h < 2; ++h) acc[r][q][h] = D::Fma(odd[q][h], x1, acc[r][q][h]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < P; ++q) {
      const int64_t c0 = q * kPanelCols, n = std::min(kPanelCols, cols - c0);
      if (n <= 0) break;
      float out[kPanelCols];
      StoreVec(out, acc[r][q][0]);
      StoreVec(out + kVecLanes, acc[r][q][1]);
      float* yr = y + r * ldy + c0;
      for (int64_t c = 0; c < n; ++c) yr[c] = bias != nullptr ? out[c] + bias[c0 + c] : out[c];
    }
  }
}

// One panel's weights as the float32 panel PackPanels makes of the dequantized weights ([k][16]
// floats at `out`): each code's value times its block's scale, exact.
template <class D>
[[gnu::always_inline]] inline void DequantizeMxfp4Panel(float* out, const uint8_t* codes, const uint8_t* scales,
                                                        int64_t k) {
  const float* table = Mxfp4Scales().v;
  for (int64_t g = 0; g < k / kMxfp4BlockSize; ++g) {
    float f[kPanelCols];
    for (int64_t l = 0; l < kPanelCols; ++l) f[l] = table[scales[g * kPanelCols + l]];
    const Vec8 s[2] = {LoadVec(f), LoadVec(f + kVecLanes)};
    for (int64_t j = g * (kMxfp4BlockSize / 2); j < (g + 1) * (kMxfp4BlockSize / 2); ++j) {
      Vec8 even[2], odd[2];
      D::Decode(codes + j * kPanelCols, even, odd);
      for (int h = 0; h < 2; ++h) {
        StoreVec(out + 2 * j * kPanelCols + h * kVecLanes, even[h] * s[h]);
        StoreVec(out + (2 * j + 1) * kPanelCols + h * kVecLanes, odd[h] * s[h]);
      }
    }
  }
}

// From this many rows a product dequantizes each panel once (below): bench_matmul (one thread, a
// shared AVX-512 VM) had the AVX2 tiles decoding in registers faster at 4 rows (1.7 against 2.3 ms
// at 2880 x 2880) and slower at 16 (9.0 against 8.2; 47.5 against 22.0 at 64).
constexpr int64_t kMxfp4DequantizeRows = 8;

// The whole product. Below kMxfp4DequantizeRows rows (decode steps, short chunks): groups of
// Mxfp4PanelsPerTile(n) panels shared out to the threads as they come free (never k: the thread
// count cannot change a sum), each step's codes decoded in registers for the group's rows. From
// kMxfp4DequantizeRows rows each panel is dequantized once into the thread's float32 panel and
// multiplied by the float32 panels' own tiles (panel_tiles.h PanelProduct: the same chains), so
// that a prefill decodes each weight once, not once per tile of rows.
template <class D>
void Mxfp4Product(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* w, const float* bias,
                  int threads) {
  const int64_t panels = (m + kPanelCols - 1) / kPanelCols;
  const int64_t code_stride = Mxfp4PanelCodeBytes(k);
  const uint8_t* scale_base = w + panels * code_stride;
  (void)Mxfp4Scales();  // made before the threads start
  if (n >= kMxfp4DequantizeRows) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, kPanelsAtATime)
    for (int64_t p = 0; p < panels; ++p) {
      thread_local std::vector<float> panel;  // each thread's, grown once to a panel of the widest k
      if (panel.size() < static_cast<size_t>(k * kPanelCols)) panel.resize(static_cast<size_t>(k * kPanelCols));
      DequantizeMxfp4Panel<D>(panel.data(), w + p * code_stride, scale_base + p * Mxfp4PanelScaleBytes(k), k);
      PanelProduct<F32Panels, false>(y, x, n, m, k, panel.data(), nullptr, bias, p);
    }
    return;
  }
  const int64_t per = Mxfp4PanelsPerTile(n), groups = (panels + per - 1) / per;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t grp = 0; grp < groups; ++grp) {
    const int64_t p = grp * per, have = std::min(per, panels - p), c0 = p * kPanelCols;
    const int64_t cols = std::min(have * kPanelCols, m - c0);
    const uint8_t* codes = w + p * code_stride;
    const uint8_t* scales = scale_base + p * Mxfp4PanelScaleBytes(k);
    const float* b = bias != nullptr ? bias + c0 : nullptr;
    WithBalancedTiles<kMxfp4TileRows>(n, [&](int64_t r, auto R) __attribute__((always_inline)) {
      WithTileRows<2>(have, [&](auto Q) __attribute__((always_inline)) {
        if constexpr (Q() <= Mxfp4PanelsPerTile(R())) {
          Mxfp4Tile<D, R(), Q()>(y + r * m + c0, m, x + r * k, k, codes, scales, cols, b);
        }
      });
    });
  }
}

}  // namespace
}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_PANEL_MATMUL_MXFP4_TILES_H_
