#include "kernels/cpu/panel_matmul.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "kernels/cpu/panel_matmul_avx512.h"
#include "kernels/cpu/tile_rows.h"
#include "kernels/cpu/vec.h"
#include "kernels/tensor.h"

namespace shardserve::cpu {
namespace {

// Rows per tile: 6 rows x 2 vectors = 12 accumulators, plus the two panel vectors and a broadcast,
// fill AVX2's 16 registers. Measured on one core of an AMD EPYC (AVX2), one PP=2 stage of the
// benchmark model: 4 rows 21.7 ms at 16 rows of x, 6 rows 21.6 ms; 6 rows 85.6 GFLOP/s at 512.
constexpr int kTileRows = 6;

// How a panel's 16 weights at one input become the tiles' two 8-float vectors (columns 0-7 and
// 8-15): float32 panels (PackPanels) load them; bf16 panels (PackPanelsBf16) widen them, exactly
// (a bf16 value is the high half of its float32), so the tiles' arithmetic is the same either way.
struct F32Panels {
  using T = float;
  [[gnu::always_inline]] static inline void Load(const float* p, Vec8* lo, Vec8* hi) {
    *lo = LoadVec(p);
    *hi = LoadVec(p + kVecLanes);
  }
};

using Vec16u16 = uint16_t __attribute__((vector_size(32)));

// A bf16 panel's 16 values at one input are stored in the order kBf16PanelOrder gives, so that
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

// y [R, cols] (row stride ldy) = x [R, k] (row stride k) @ one panel [k, 16] (+ bias [cols]).
// Each output is one chain over k in order: the arithmetic is the same for every R and tile, and
// with or without kPrefetch, which only asks the cache for 16 floats at `ahead` (then the 16 after
// them, ...) every `every` k steps on the way.
template <class W, int R, bool kPrefetch>
[[gnu::always_inline]] inline void Tile(float* y, int64_t ldy, const float* x, int64_t k, const typename W::T* panel,
                                        int64_t cols, const float* bias, const typename W::T* ahead, int64_t every) {
  Vec8 lo[R], hi[R];  // columns 0-7 and 8-15 of each row
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = Vec8{};
  int64_t countdown = every;
  for (int64_t kk = 0; kk < k; ++kk) {
    if constexpr (kPrefetch) {
      if (--countdown == 0) {
        countdown = every;
        __builtin_prefetch(ahead);
        ahead += kPanelCols;
      }
    }
    Vec8 b_lo, b_hi;
    W::Load(panel + kk * kPanelCols, &b_lo, &b_hi);
    for (int r = 0; r < R; ++r) {
      const float xr = x[r * k + kk];
      lo[r] += b_lo * xr;
      hi[r] += b_hi * xr;
    }
  }
  for (int r = 0; r < R; ++r) {
    float out[kPanelCols];
    StoreVec(out, lo[r]);
    StoreVec(out + kVecLanes, hi[r]);
    float* yr = y + r * ldy;
    if (bias != nullptr) {
      for (int64_t c = 0; c < cols; ++c) yr[c] = out[c] + bias[c];
    } else {
      std::memcpy(yr, out, static_cast<size_t>(cols) * sizeof(float));
    }
  }
}

// y [R, cols] (row stride ldy) = x [R, k] (row stride k) @ P adjacent panels [k, 16] each (the
// first at `panel`; cols <= 16 P of their columns kept, + bias [cols]), for R = 1 to 3 rows, whose
// tiles of one panel keep only 2R FMA chains going and wait on their latency: P panels at a time
// keep 2RP. Each output is the same chain over k as Tile's (bitwise its result).
template <class W, int R, int P>
[[gnu::always_inline]] inline void PanelsTile(float* y, int64_t ldy, const float* x, int64_t k,
                                              const typename W::T* panel, int64_t cols, const float* bias) {
  Vec8 lo[R][P], hi[R][P];
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < P; ++q) lo[r][q] = hi[r][q] = Vec8{};
  }
  const int64_t stride = k * kPanelCols;
  for (int64_t kk = 0; kk < k; ++kk) {
    Vec8 b_lo[P], b_hi[P];
    for (int q = 0; q < P; ++q) W::Load(panel + q * stride + kk * kPanelCols, &b_lo[q], &b_hi[q]);
    for (int r = 0; r < R; ++r) {
      const float xr = x[r * k + kk];
      for (int q = 0; q < P; ++q) {
        lo[r][q] += b_lo[q] * xr;
        hi[r][q] += b_hi[q] * xr;
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < P; ++q) {
      const int64_t c0 = q * kPanelCols, n = std::min(kPanelCols, cols - c0);
      float out[kPanelCols];
      StoreVec(out, lo[r][q]);
      StoreVec(out + kVecLanes, hi[r][q]);
      float* yr = y + r * ldy + c0;
      if (bias != nullptr) {
        for (int64_t c = 0; c < n; ++c) yr[c] = out[c] + bias[c0 + c];
      } else {
        std::memcpy(yr, out, static_cast<size_t>(n) * sizeof(float));
      }
    }
  }
}

// Panels a PanelsTile of R rows takes at once: 8 to 12 chains.
constexpr int PanelsPerTile(int rows) { return rows == 1 ? 4 : 2; }

// The most: a thread's scratch holds this many panels of a plain w.
constexpr int64_t kFewRowsPanels = PanelsPerTile(1);

// Rows [0, n) (n <= 3) of x times `have` (<= PanelsPerTile(n)) adjacent panels of a packed w, the
// first at `panel`, output columns [c0, m), in one PanelsTile.
template <class W>
[[gnu::always_inline]] inline void FewRowsProduct(float* y, const float* x, int64_t n, int64_t m, int64_t k,
                                                  const typename W::T* panel, const float* bias, int64_t have,
                                                  int64_t c0) {
  const int64_t cols = std::min(m - c0, PanelsPerTile(static_cast<int>(n)) * kPanelCols);
  const float* b = bias != nullptr ? bias + c0 : nullptr;
  WithTileRows<3>(n, [&](auto R) __attribute__((always_inline)) {
    constexpr int kP = PanelsPerTile(R());
    if (have == kP) {
      PanelsTile<W, R(), kP>(y + c0, m, x, k, panel, cols, b);
    } else {
      WithTileRows<kP>(have, [&](auto Q) __attribute__((always_inline)) {
        PanelsTile<W, R(), Q()>(y + c0, m, x, k, panel, cols, b);
      });
    }
  });
}

// Rows [0, n) of x times one panel, in the fewest tiles of at most kTileRows rows, their sizes
// differing by one at most (8 rows: 4 + 4, not 6 + 2). A tile of r rows keeps 2r FMA chains going,
// and below 4 rows (8 chains) it waits on their latency, not on the two FMA units. With kPrefetch
// the t tiles share out the next panel's k x 16 floats (at `next`) between them: each asks for
// k / t of its k steps' worth, one step's every t steps, so that memory streams that panel while
// this one's tiles compute.
template <class W, bool kPrefetch>
[[gnu::always_inline]] inline void PanelRows(float* y, int64_t ldy, const float* x, int64_t n, int64_t k,
                                             const typename W::T* panel, int64_t cols, const float* bias,
                                             const typename W::T* next) {
  const int64_t tiles = (n + kTileRows - 1) / kTileRows, share = k / tiles * kPanelCols;
  const int64_t base = n / tiles, longer = n % tiles;  // the first `longer` tiles take base + 1 rows
  int64_t r = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t rows = base + (t < longer ? 1 : 0);
    float* yt = y + r * ldy;
    const float* xt = x + r * k;
    WithTileRows<kTileRows>(rows, [&](auto R) __attribute__((always_inline)) {
      Tile<W, R, kPrefetch>(yt, ldy, xt, k, panel, cols, bias, next, tiles);
    });
    r += rows;
    if constexpr (kPrefetch) next += share;
  }
}

// Panels a weight of m output columns takes.
int64_t Panels(int64_t m) { return (m + kPanelCols - 1) / kPanelCols; }

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

// Panel p of a product: y's columns from p * 16 times `panel` (its k x 16 weights); with kPrefetch
// its tiles ask for `next` (panel p + 1 of a packed w). Always inlined, so that it is compiled for
// the caller's instruction set.
template <class W, bool kPrefetch>
[[gnu::always_inline]] inline void PanelProduct(float* y, const float* x, int64_t n, int64_t m, int64_t k,
                                                const typename W::T* panel, const typename W::T* next,
                                                const float* bias, int64_t p) {
  const int64_t c0 = p * kPanelCols;
  PanelRows<W, kPrefetch>(y + c0, m, x, n, k, panel, std::min(kPanelCols, m - c0),
                          bias != nullptr ? bias + c0 : nullptr, next);
}

// Products whose tiles ask for the next panel's weights while they compute: from 7 to 24 rows (2 to
// 4 tiles), on one thread. Then the first tile of a panel reads it from memory, the others from
// cache, and without the requests the first one waits for memory while no arithmetic overlaps it.
// One PP=2 stage's products (bench_matmul, AMD EPYC, medians of 3 alternating runs): 8 and 16 rows
// take 29-36% less time on one core; PP=2 at 16 streams (one thread per worker, 8- and 16-row
// decode steps) serves 8-10% more output tokens/s, one micro-batch at a time or two in flight
// (docs/benchmarks.md). One tile gained little or nothing; from 32 rows on the arithmetic
// dominates. On two threads the loop needs each thread to claim its next panels before it starts
// the last of its claim: 8 and 16 rows alone took 10-22% less time, but TP=1 serving with its two
// threads (which share the cores with the coordinator and the clients) gave fewer output tokens/s
// at 32 streams in 6 of 7 alternating rounds (3-14% fewer), so two threads keep the plain loop.
constexpr int64_t kPrefetchMinRows = kTileRows + 1, kPrefetchMaxRows = 4 * kTileRows;

// Panels a thread takes at a time. Threads take them as they come free, not in fixed shares: a
// worker shares its cores with the coordinator, clients and the hypervisor, and with fixed shares a
// thread they preempt leaves the others spinning at the end of the loop (AMD EPYC, 2 vCPUs, TP=1 at
// 32 streams: 9.7% more output tokens/s than schedule(static), median of 5 alternating rounds;
// docs/benchmarks.md).
constexpr int64_t kPanelsAtATime = 2;

// Up to this many rows, products by a packed w run FewRowsProduct's tiles of several panels (a
// thread claims one tile, PanelsPerTile panels, at a time).
constexpr int64_t kFewRows = 3;

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

// The product by a float32 w (bf16 false: packed by PackPanels, or plain; `wide`: the AVX-512
// tiles where they apply) or by a bf16 one (bf16 true: packed by PackPanelsBf16; plain and wide
// false), on 8-float tiles of the same chains either way. One cloned function for both, so that
// each OpenMP loop's body is compiled for the clone's instruction set (see WideProduct).
SHARDSERVE_VECTOR_CLONES
void PanelMatMulImpl(float* y, const float* x, int64_t n, int64_t m, int64_t k, const void* w, bool bf16, bool plain,
                     const float* bias, int threads, float* scratch, bool wide) {
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
    for (int64_t p = 0; p < panels; ++p) {
      const bool last = p + 1 == panels;  // no panel after it to ask for
      if (bf16) {
        if (last) {
          PanelProduct<Bf16Panels, false>(y, x, n, m, k, wb + p * stride, nullptr, bias, p);
        } else {
          PanelProduct<Bf16Panels, true>(y, x, n, m, k, wb + p * stride, wb + (p + 1) * stride, bias, p);
        }
      } else if (last) {
        PanelProduct<F32Panels, false>(y, x, n, m, k, wf + p * stride, nullptr, bias, p);
      } else {
        PanelProduct<F32Panels, true>(y, x, n, m, k, wf + p * stride, wf + (p + 1) * stride, bias, p);
      }
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
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
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

}  // namespace shardserve::cpu
