#include "kernels/cpu/panel_matmul.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "kernels/cpu/isa_cap.h"
#include "kernels/cpu/panel_matmul_avx512.h"
#include "kernels/cpu/panel_tiles.h"
#include "kernels/cpu/tile_rows.h"
#include "kernels/host_vec.h"
#include "kernels/tensor.h"

namespace shardserve::cpu {
namespace {

using Vec16u16 = uint16_t __attribute__((vector_size(32)));

// A bf16 panel's 16 values at one input are stored in the order Bf16PanelSlot gives, so that
// interleaving them with zeros within each 128-bit half of a register (VPUNPCKLWD / VPUNPCKHWD
// on AVX2, one instruction each) yields columns 0-7 and 8-15 as float32 bits.
struct Bf16Panels {
  using T = uint16_t;
  [[gnu::always_inline]] static inline void Load(const uint16_t* p, Vec8* lo, Vec8* hi) {
    Vec16u16 v;
    std::memcpy(&v, p, sizeof v);
    const Vec16u16 z = {};
    const Vec16u16 l = __builtin_shufflevector(z, v, 0, 16, 1, 17, 2, 18, 3, 19, 8, 24, 9, 25, 10, 26, 11, 27);
    const Vec16u16 h = __builtin_shufflevector(z, v, 4, 20, 5, 21, 6, 22, 7, 23, 12, 28, 13, 29, 14, 30, 15, 31);
    std::memcpy(lo, &l, sizeof l);
    std::memcpy(hi, &h, sizeof h);
  }
};

// Where column c (0-15) of a bf16 panel's input step is stored: Load above takes stored values
// 0-3 and 8-11 into columns 0-7, 4-7 and 12-15 into columns 8-15 (columns 4-7 and 8-11 swap).
constexpr int64_t Bf16PanelSlot(int64_t c) { return c < 4 || c >= 12 ? c : c < 8 ? c + 4 : c - 4; }

// Rows [r0, r0 + 8) of w [m, k] (row-major), inputs [kk, kk + 8), transposed into out[i * 16 + j]
// = w[r0 + j][kk + i]: eight loads, three rounds of shuffles (AVX's unpack, shuffle and lane
// permute of an 8 x 8 transpose), eight stores.
[[gnu::always_inline]] inline void Transpose8x8(float* out, const float* w, int64_t k, int64_t r0, int64_t kk) {
  Vec8 a[8], b[8];
  for (int j = 0; j < 8; ++j) a[j] = LoadVec(w + (r0 + j) * k + kk);
  for (int j = 0; j < 8; j += 2) {  // pairs of rows interleaved
    b[j] = __builtin_shufflevector(a[j], a[j + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    b[j + 1] = __builtin_shufflevector(a[j], a[j + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int j = 0; j < 8; j += 4) {  // then pairs of pairs
    for (int h = 0; h < 2; ++h) {
      a[j + h] = __builtin_shufflevector(b[j + h], b[j + h + 2], 0, 1, 8, 9, 4, 5, 12, 13);
      a[j + h + 2] = __builtin_shufflevector(b[j + h], b[j + h + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    }
  }
  // a[0..3]: rows 0-3 at inputs {0, 4}, {2, 6}, {1, 5}, {3, 7} (low half, high half); a[4..7] rows 4-7.
  constexpr int kInput[4] = {0, 2, 1, 3};
  for (int q = 0; q < 4; ++q) {
    StoreVec(out + kInput[q] * kPanelCols, __builtin_shufflevector(a[q], a[q + 4], 0, 1, 2, 3, 8, 9, 10, 11));
    StoreVec(out + (kInput[q] + 4) * kPanelCols, __builtin_shufflevector(a[q], a[q + 4], 4, 5, 6, 7, 12, 13, 14, 15));
  }
}

// Panel p of w [m, k] (row-major) into out [k, 16], zero-padded past column m. Whole panels go 8 x 8
// blocks at a time (a plain weight is packed so on every product, panel_matmul.h), the rest element
// by element; either way the same floats.
[[gnu::always_inline]] inline void PackPanel(float* out, const float* w, int64_t m, int64_t k, int64_t p) {
  const int64_t c0 = p * kPanelCols, cols = std::min(kPanelCols, m - c0);
  int64_t done = 0;  // inputs [0, done) packed
  if (cols == kPanelCols) {
    for (; done + kVecLanes <= k; done += kVecLanes) {
      Transpose8x8(out + done * kPanelCols, w, k, c0, done);
      Transpose8x8(out + done * kPanelCols + kVecLanes, w, k, c0 + kVecLanes, done);
    }
  } else {
    std::fill(out, out + k * kPanelCols, 0.0f);
  }
  for (int64_t c = 0; c < cols; ++c) {
    const float* wr = w + (c0 + c) * k;
    for (int64_t kk = done; kk < k; ++kk) out[kk * kPanelCols + c] = wr[kk];
  }
}

// Panels [p, p + have) (have <= kFewRowsPanels) of the product's w: where they lie in a packed w,
// or, for a plain w, packed into this thread's part of `scratch` first. Always inlined, so that
// the packing is compiled for the caller's instruction set.
[[gnu::always_inline]] inline const float* PanelsOf(const float* w, bool plain, int64_t m, int64_t k, float* scratch,
                                                    int64_t p, int64_t have) {
  if (!plain) return w + p * k * kPanelCols;
  float* own = scratch + static_cast<int64_t>(omp_get_thread_num()) * kFewRowsPanels * k * kPanelCols;
  for (int64_t q = 0; q < have; ++q) PackPanel(own + q * k * kPanelCols, w, m, k, p + q);
  return own;
}

// From this many rows, products run the AVX-512 tiles (panel_matmul_avx512.h) where the CPU has them.
constexpr int64_t kWideMinRows = kFewRows + 1;
// A plain w's group of those panels is packed into the same per-thread scratch as the few rows' ones.
static_assert(WidePanelsPerGroup(kWideMinRows) <= kFewRowsPanels && WidePanelsPerGroup(1024) <= kFewRowsPanels,
              "PanelMatMul's scratch holds kFewRowsPanels panels a thread");

// PanelMatMulImpl's products by the AVX-512 tiles: groups of WidePanelsPerGroup(n) panels (a
// plain w's packed into this thread's scratch first), a thread claiming one group at a time; with
// the prefetch as the 8-float tiles' (kPrefetchMinRows to kPrefetchMaxRows rows, one thread).
// Cloned, not inlined into PanelMatMulImpl: GCC outlines an OpenMP loop's body before it inlines,
// with the target of the function the loop is written in (so a plain w's packing, inlined into it,
// is compiled for AVX-512 in the AVX-512 clone, not for baseline x86-64: 4x slower).
SHARDSERVE_VECTOR_CLONES
void WideProduct(float* y, const float* x, int64_t n, int64_t m, int64_t k, const float* w, bool plain,
                 const float* bias, int threads, float* scratch) {
  const int64_t panels = Panels(m), per = WidePanelsPerGroup(n), groups = (panels + per - 1) / per;
  const int64_t group_floats = per * k * kPanelCols;
  const auto group = [&](int64_t g, const float* panel, const float* next, int64_t next_have) {
    const int64_t p = g * per, have = std::min(per, panels - p), c0 = p * kPanelCols;
    PanelGroupAvx512(y + c0, m, x, n, k, panel, have, std::min(per * kPanelCols, m - c0),
                     bias != nullptr ? bias + c0 : nullptr, next, next_have);
  };
  if (threads == 1 && !plain && n >= kPrefetchMinRows && n <= kPrefetchMaxRows) {
    for (int64_t g = 0; g < groups; ++g) {
      const bool last = g + 1 == groups;
      group(g, w + g * group_floats, last ? nullptr : w + (g + 1) * group_floats,
            last ? 0 : std::min(per, panels - (g + 1) * per));
    }
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t g = 0; g < groups; ++g) {
    group(g, PanelsOf(w, plain, m, k, scratch, g * per, std::min(per, panels - g * per)), nullptr, 0);
  }
}

// The product by a float32 w (bf16 false: packed by PackPanels, or plain; `wide`: the AVX-512 tiles
// where they apply) or by a bf16 one (bf16 true: packed by PackPanelsBf16; plain and wide false), on 8-float tiles of the same chains whichever it is. One cloned function for all,
// so that each OpenMP loop's body is compiled for the clone's instruction set (see WideProduct).
SHARDSERVE_VECTOR_CLONES
void PanelMatMulImpl(float* y, const float* x, int64_t n, int64_t m, int64_t k, const void* w, bool bf16,
                     bool plain, const float* bias, int threads, float* scratch, bool wide) {
  const int64_t panels = Panels(m), stride = k * kPanelCols;
  const auto* wf = static_cast<const float*>(w);
  const auto* wb = static_cast<const uint16_t*>(w);
  // Threads share out whole panels (columns), never k, so the thread count cannot change a sum.
  // Each panel is read from memory once and stays in cache (k x 64 bytes) for all rows' tiles.
  if (wide && n >= kWideMinRows) {
    WideProduct(y, x, n, m, k, wf, plain, bias, threads, scratch);
    return;
  }
  if (wide && plain && n <= kPlainTileRows) {  // a plain w read as it is, kPlainPanels panels' rows at a time
    const int64_t groups = (panels + kPlainPanels - 1) / kPlainPanels;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t c0 = g * kPlainPanels * kPanelCols;
      PlainPanelsAvx512(y + c0, m, x, n, k, wf + c0 * k, std::min(kPlainPanels * kPanelCols, m - c0),
                        bias != nullptr ? bias + c0 : nullptr);
    }
    return;
  }
  if (n <= kFewRows) {
    const int64_t per = PanelsPerTile(static_cast<int>(n)), groups = (panels + per - 1) / per;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t p = g * per, have = std::min(per, panels - p);
      if (bf16) {
        FewRowsProduct<Bf16Panels>(y, x, n, m, k, wb + p * stride, bias, have, p * kPanelCols);
      } else {
        FewRowsProduct<F32Panels>(y, x, n, m, k, PanelsOf(wf, plain, m, k, scratch, p, have), bias, have,
                                  p * kPanelCols);
      }
    }
    return;
  }
  if (threads == 1 && !plain && n >= kPrefetchMinRows && n <= kPrefetchMaxRows) {
    const auto each = [&](auto panels_of) __attribute__((always_inline)) {
      using W = decltype(panels_of);
      const auto* wp = static_cast<const typename W::T*>(w);
      for (int64_t p = 0; p + 1 < panels; ++p) {
        PanelProduct<W, true>(y, x, n, m, k, wp + p * stride, wp + (p + 1) * stride, bias, p);
      }
      PanelProduct<W, false>(y, x, n, m, k, wp + (panels - 1) * stride, nullptr, bias, panels - 1);  // no panel after it
    };
    if (bf16) {
      each(Bf16Panels{});
    } else {
      each(F32Panels{});
    }
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(dynamic, kPanelsAtATime)
  for (int64_t p = 0; p < panels; ++p) {
    if (bf16) {
      PanelProduct<Bf16Panels, false>(y, x, n, m, k, wb + p * stride, nullptr, bias, p);
    } else {
      PanelProduct<F32Panels, false>(y, x, n, m, k, PanelsOf(wf, plain, m, k, scratch, p, 1), nullptr, bias, p);
    }
  }
}

// The override of ActivePanelTiles: -1 none, else a PanelTiles.
std::atomic<int> g_tiles_override{-1};

}  // namespace

bool PanelTilesSupported(PanelTiles tiles) {
  if (tiles == PanelTiles::kVec8) return true;
  __builtin_cpu_init();
  // libgcc's answer includes the OS's: AVX-512 only where XCR0 enables the zmm state.
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma") && IsaCapAllows(IsaLevel::kAvx512);
}

PanelTiles ActivePanelTiles() {
  const int o = g_tiles_override.load(std::memory_order_relaxed);
  if (o >= 0) return static_cast<PanelTiles>(o);
  static const PanelTiles best = PanelTilesSupported(PanelTiles::kAvx512) ? PanelTiles::kAvx512 : PanelTiles::kVec8;
  return best;
}

void SetPanelTilesOverride(std::optional<PanelTiles> tiles) {
  g_tiles_override.store(tiles.has_value() ? static_cast<int>(*tiles) : -1, std::memory_order_relaxed);
}

int64_t PanelMatMulFloats(int64_t m, int64_t k) { return Panels(m) * k * kPanelCols; }

void PackPanels(float* packed, const float* w, int64_t m, int64_t k) {
  for (int64_t p = 0; p < Panels(m); ++p) PackPanel(packed + p * k * kPanelCols, w, m, k, p);
}

void PanelMatMul(float* y, const float* x, int64_t n, int64_t m, int64_t k, const float* w, bool plain,
                 const float* bias, int threads, std::vector<float>* scratch) {
  if (plain) {
    const auto need = static_cast<size_t>(threads * kFewRowsPanels * k * kPanelCols);
    if (scratch->size() < need) scratch->resize(need);
  }
  PanelMatMulImpl(y, x, n, m, k, w, /*bf16=*/false, plain, bias, threads, plain ? scratch->data() : nullptr,
                  ActivePanelTiles() == PanelTiles::kAvx512);
}

void PackPanelsBf16(uint16_t* packed, const float* w, int64_t m, int64_t k) {
  for (int64_t p = 0; p < Panels(m); ++p) {
    uint16_t* panel = packed + p * k * kPanelCols;
    for (int64_t c = 0; c < kPanelCols; ++c) {
      const int64_t row = p * kPanelCols + c, slot = Bf16PanelSlot(c);
      for (int64_t kk = 0; kk < k; ++kk) panel[kk * kPanelCols + slot] = row < m ? F32ToBf16(w[row * k + kk]) : 0;
    }
  }
}

void PanelMatMulBf16(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint16_t* w, const float* bias,
                     int threads) {
  PanelMatMulImpl(y, x, n, m, k, w, /*bf16=*/true, /*plain=*/false, bias, threads, nullptr, /*wide=*/false);
}

void PackPanelsBytes(uint8_t* packed, const uint8_t* q, int64_t m, int64_t k) {
  for (int64_t p = 0; p < Panels(m); ++p) {
    uint8_t* panel = packed + p * k * kPanelCols;
    for (int64_t c = 0; c < kPanelCols; ++c) {
      const int64_t row = p * kPanelCols + c;
      for (int64_t kk = 0; kk < k; ++kk) panel[kk * kPanelCols + c] = row < m ? q[row * k + kk] : 0;
    }
  }
}

// The one-byte panels' instances: AVX-512's (panel_matmul_bytes_avx512.cc), int8 (fp8 false) or
// e4m3 (true) bytes, and AVX2's for int8 (panel_matmul_avx2.cc).
void PanelMatMulBytesAvx512(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* w,
                            const float* scale, int64_t group, const float* bias, int threads, bool fp8);
void PanelMatMulInt8Avx2(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* w,
                         const float* scale, const float* bias, int threads);

void PanelMatMulInt8(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* w, const float* scale,
                     const float* bias, int threads, PanelTiles tiles) {
  if (tiles == PanelTiles::kAvx512) {
    PanelMatMulBytesAvx512(y, x, n, m, k, w, scale, /*group=*/0, bias, threads, /*fp8=*/false);
  } else {
    PanelMatMulInt8Avx2(y, x, n, m, k, w, scale, bias, threads);
  }
}

void PanelMatMulFp8(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* w, const float* scale,
                    const float* bias, int threads) {
  PanelMatMulBytesAvx512(y, x, n, m, k, w, scale, /*group=*/0, bias, threads, /*fp8=*/true);
}

int64_t PanelScaleFloats(int64_t m, int64_t groups) { return Panels(m) * groups * kPanelCols; }

void PackPanelScales(float* packed, const float* scale, int64_t m, int64_t groups) {
  for (int64_t p = 0; p < Panels(m); ++p) {
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t c = 0; c < kPanelCols; ++c) {
        const int64_t row = p * kPanelCols + c;
        packed[(p * groups + g) * kPanelCols + c] = row < m ? scale[row * groups + g] : 0.0f;
      }
    }
  }
}

void PanelMatMulFp8Groups(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* w,
                          const float* scales, int64_t group, const float* bias, int threads) {
  PanelMatMulBytesAvx512(y, x, n, m, k, w, scales, group, bias, threads, /*fp8=*/true);
}

// PanelMatMulInt4's two instances (panel_matmul_int4_avx512.cc, panel_matmul_int4_avx2.cc): every
// row of y at the output columns of blocks [b0, b1), the rows' group sums at sums [n, groups].
void PanelMatMulInt4BlocksAvx512(float* y, const float* x, int64_t n, int64_t m, int64_t k, const float* sums,
                                 const Int4PanelGroup* w, int64_t b0, int64_t b1, const float* bias);
void PanelMatMulInt4BlocksAvx2(float* y, const float* x, int64_t n, int64_t m, int64_t k, const float* sums,
                               const Int4PanelGroup* w, int64_t b0, int64_t b1, const float* bias);

namespace {

// Each row's sum over each group of 128 inputs (PanelMatMulInt4's `sum of the group's inputs`): 16
// lanes over the group's chunks of 16 (lane l sums inputs 16 c + l), then lanes l and l + 8 added,
// then l and l + 4, l and l + 2, l and l + 1. Cloned per instruction set, the same additions in
// each (a lane's sum is one chain whatever the vector width).
SHARDSERVE_VECTOR_CLONES
void Int4GroupSums(float* sums, const float* x, int64_t n, int64_t k, int64_t groups) {
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t base = g * kInt4PanelGroupInputs, size = std::min(kInt4PanelGroupInputs, k - base);
      const float* row = x + i * k + base;
      float lane[16] = {};
      int64_t c = 0;
      for (; c + 16 <= size; c += 16) {
        for (int l = 0; l < 16; ++l) lane[l] += row[c + l];
      }
      for (int l = 0; c + l < size; ++l) lane[l] += row[c + l];
      for (int width = 8; width >= 1; width /= 2) {
        for (int l = 0; l < width; ++l) lane[l] += lane[l + width];
      }
      sums[i * groups + g] = lane[0];
    }
  }
}

}  // namespace

void PanelMatMulInt4(float* y, const float* x, int64_t n, int64_t m, int64_t k, const Int4PanelGroup* w,
                     const float* bias, int threads, PanelTiles tiles) {
  const int64_t groups = (k + kInt4PanelGroupInputs - 1) / kInt4PanelGroupInputs;
  const int64_t blocks = (m + kInt4GroupPanels * kPanelCols - 1) / (kInt4GroupPanels * kPanelCols);
  thread_local std::vector<float> sums;  // the calling thread's, reused
  if (sums.size() < static_cast<size_t>(n * groups)) sums.resize(static_cast<size_t>(n * groups));
  Int4GroupSums(sums.data(), x, n, k, groups);
  const float* s = sums.data();  // (named here: inside the parallel loop, `sums` is each thread's own)
  const auto run = tiles == PanelTiles::kAvx512 ? PanelMatMulInt4BlocksAvx512 : PanelMatMulInt4BlocksAvx2;
  const int parts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, blocks)));
  // Threads share out whole blocks (columns), never k, so the thread count cannot change a sum;
  // each thread's blocks are adjacent, one stream of memory.
#pragma omp parallel for num_threads(parts) schedule(static)
  for (int t = 0; t < parts; ++t) {
    run(y, x, n, m, k, s, w, blocks * t / parts, blocks * (t + 1) / parts, bias);
  }
}

int64_t Int4PanelGroupCount(int64_t m, int64_t k) {
  constexpr int64_t kOutputs = kInt4GroupPanels * kPanelCols;
  return (m + kOutputs - 1) / kOutputs * Int4GroupsLayout{m, k}.groups_per_row();
}

void PackPanelsInt4(Int4PanelGroup* packed, const Int4Group128* blocks, int64_t m, int64_t k, Int4CodeOrder order) {
  constexpr int64_t kOutputs = kInt4GroupPanels * kPanelCols;
  const int64_t groups = Int4GroupsLayout{m, k}.groups_per_row();
  for (int64_t b = 0; b < (m + kOutputs - 1) / kOutputs; ++b) {
    for (int64_t g = 0; g < groups; ++g) {
      Int4PanelGroup& out = packed[b * groups + g];
      out = Int4PanelGroup{};
      for (int64_t o = 0; o < kOutputs && b * kOutputs + o < m; ++o) {
        const int64_t p = o / kPanelCols, c = o % kPanelCols;
        const Int4Group128& block = blocks[(b * kOutputs + o) * groups + g];
        out.scale[p][c] = block.scale;
        out.zero[p][c] = static_cast<float>(block.zero);
        const auto code = [&](int64_t j) { return j < 64 ? block.q[j] & 15 : block.q[j - 64] >> 4; };
        if (order == Int4CodeOrder::kPairs) {
          for (int64_t j = 0; j < kInt4PanelGroupInputs / 2; ++j) {
            out.q[j][p][c] = static_cast<uint8_t>(code(2 * j) | code(2 * j + 1) << 4);
          }
          continue;
        }
        // kOctets: byte b of output c's 4 bytes is half h = b / 2's nibbles t = 2 (b % 2) (low)
        // and t + 1 (high), the codes at inputs 8o + 2t + h.
        uint8_t* bytes = &out.q[0][0][0];
        for (int64_t o = 0; o < kInt4PanelGroupInputs / 8; ++o) {
          for (int64_t b = 0; b < 4; ++b) {
            const int64_t h = b / 2, t = 2 * (b % 2);
            bytes[((o * kInt4GroupPanels + p) * kPanelCols + c) * 4 + b] =
                static_cast<uint8_t>(code(8 * o + 2 * t + h) | code(8 * o + 2 * (t + 1) + h) << 4);
          }
        }
      }
    }
  }
}

}  // namespace shardserve::cpu
