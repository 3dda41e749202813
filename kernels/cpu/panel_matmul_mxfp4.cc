// The MXFP4 panels (panel_matmul.h PackPanelsMxfp4, PanelMatMulMxfp4): their packing, the baseline
// x86-64 instance of their 8-float tiles (panel_matmul_mxfp4_tiles.h: each code looked up in a
// 16-entry table, a multiply and an add per input), and the choice among the three instances
// (AVX-512: panel_matmul_mxfp4_avx512.cc; AVX2: panel_matmul_mxfp4_avx2.cc).
#include <cstdint>
#include <cstring>

#include "kernels/cpu/panel_matmul.h"
#include "kernels/cpu/panel_matmul_mxfp4_tiles.h"
#include "kernels/cpu/quant_isa.h"
#include "kernels/quant.h"

namespace shardserve::cpu {

// The other instances (their files alone are compiled for their instruction sets).
void PanelMatMulMxfp4Avx512(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* w,
                            const float* bias, int threads);
void PanelMatMulMxfp4Avx2(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* w,
                          const float* bias, int threads);

namespace {

// Baseline x86-64: each code's value from the table, lane by lane (GCC 12 has no 16-entry float
// lookup without AVX2); a multiply and an add per input (no FMA), as PanelMatMul's baseline clone.
struct Mxfp4Portable {
  [[gnu::always_inline]] static inline void Decode(const uint8_t* p, Vec8 even[2], Vec8 odd[2]) {
    float e[kPanelCols], o[kPanelCols];
    for (int64_t l = 0; l < kPanelCols; ++l) {
      e[l] = kMxfp4Values[p[l] & 0x0F];
      o[l] = kMxfp4Values[p[l] >> 4];
    }
    for (int h = 0; h < 2; ++h) {
      even[h] = LoadVec(e + h * kVecLanes);
      odd[h] = LoadVec(o + h * kVecLanes);
    }
  }
  [[gnu::always_inline]] static inline Vec8 Fma(const Vec8& w, float x, const Vec8& acc) { return acc + w * x; }
};

}  // namespace

int64_t Mxfp4PanelBytes(int64_t m, int64_t k) {
  const int64_t panels = (m + kPanelCols - 1) / kPanelCols;
  return panels * (Mxfp4PanelCodeBytes(k) + Mxfp4PanelScaleBytes(k));
}

void PackPanelsMxfp4(uint8_t* packed, const uint8_t* stored, int64_t m, int64_t k) {
  const Mxfp4RowsLayout layout{m, k};
  const int64_t panels = (m + kPanelCols - 1) / kPanelCols, groups = layout.blocks_per_row();
  const int64_t pairs = k / 2;  // a row's code bytes: byte j holds inputs 2j (low nibble) and 2j + 1
  const uint8_t* scales = stored + layout.code_bytes();
  uint8_t* packed_scales = packed + panels * Mxfp4PanelCodeBytes(k);
  for (int64_t p = 0; p < panels; ++p) {
    uint8_t* codes = packed + p * Mxfp4PanelCodeBytes(k);
    uint8_t* s = packed_scales + p * Mxfp4PanelScaleBytes(k);
    for (int64_t c = 0; c < kPanelCols; ++c) {
      const int64_t row = p * kPanelCols + c;
      for (int64_t j = 0; j < pairs; ++j) codes[j * kPanelCols + c] = row < m ? stored[row * pairs + j] : 0;
      for (int64_t g = 0; g < groups; ++g) s[g * kPanelCols + c] = row < m ? scales[row * groups + g] : 0;
    }
  }
}

void PanelMatMulMxfp4(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* w, const float* bias,
                      int threads, QuantIsa isa) {
  switch (isa) {
    case QuantIsa::kAvx512:
    case QuantIsa::kAvx512Vnni: PanelMatMulMxfp4Avx512(y, x, n, m, k, w, bias, threads); return;
    case QuantIsa::kAvx2:
    case QuantIsa::kAvx2Int8: PanelMatMulMxfp4Avx2(y, x, n, m, k, w, bias, threads); return;
    case QuantIsa::kPortable: Mxfp4Product<Mxfp4Portable>(y, x, n, m, k, w, bias, threads); return;
  }
}

}  // namespace shardserve::cpu
