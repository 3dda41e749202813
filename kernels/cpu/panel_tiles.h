// The float32 panels' 8-float tiles (panel_matmul.h), as templates over how a panel's 16 weights at
// one input become two 8-float vectors (`W::T`, the panel's element type, and `W::Load(const T*,
// Vec8* lo, Vec8* hi)`, exact): panel_matmul.cc instantiates them for float32 and bf16 panels in
// functions cloned per instruction set, panel_matmul_avx2.cc for int8 panels with AVX2 intrinsics
// (GCC 12 widens an 8-byte GCC vector to int32 lanes one byte at a time: 16 instructions where
// VPMOVSXBD is one). Internal to those files: everything here has internal linkage.
#ifndef SHARDSERVE_KERNELS_CPU_PANEL_TILES_H_
#define SHARDSERVE_KERNELS_CPU_PANEL_TILES_H_

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/panel_matmul.h"
#include "kernels/cpu/tile_rows.h"
#include "kernels/host_vec.h"

namespace shardserve::cpu {
namespace {

// Rows per tile: 6 rows x 2 vectors = 12 accumulators, plus the two panel vectors and a broadcast,
// fill AVX2's 16 registers. Measured on one core of an AMD EPYC (AVX2), one PP=2 stage of the
// benchmark model: 4 rows 21.7 ms at 16 rows of x, 6 rows 21.6 ms; 6 rows 85.6 GFLOP/s at 512.
constexpr int kTileRows = 6;

// How a panel's 16 weights at one input become the tiles' two 8-float vectors (columns 0-7 and
// 8-15): float32 panels (PackPanels) load them; bf16 panels (PackPanelsBf16) and int8 ones
// (PackPanelsBytes) widen them, exactly (a bf16 value is the high half of its float32; every int8 is
// a float32), so the tiles' arithmetic is the same whichever they read.
struct F32Panels {
  using T = float;
  [[gnu::always_inline]] static inline void Load(const float* p, Vec8* lo, Vec8* hi) {
    *lo = LoadVec(p);
    *hi = LoadVec(p + kVecLanes);
  }
};

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
  const int64_t tiles = BalancedTiles(n, kTileRows), share = k / tiles * kPanelCols;
  WithBalancedTiles<kTileRows>(n, [&](int64_t r, auto R) __attribute__((always_inline)) {
    Tile<W, R, kPrefetch>(y + r * ldy, ldy, x + r * k, k, panel, cols, bias, next, tiles);
    if constexpr (kPrefetch) next += share;
  });
}

// Panels a weight of m output columns takes.
int64_t Panels(int64_t m) { return (m + kPanelCols - 1) / kPanelCols; }

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
// (shardserve bench). One tile gained little or nothing; from 32 rows on the arithmetic
// dominates. On two threads the loop needs each thread to claim its next panels before it starts
// the last of its claim: 8 and 16 rows alone took 10-22% less time, but TP=1 serving with its two
// threads (which share the cores with the coordinator and the clients) gave fewer output tokens/s
// at 32 streams in 6 of 7 alternating rounds (3-14% fewer), so two threads keep the plain loop.
constexpr int64_t kPrefetchMinRows = kTileRows + 1, kPrefetchMaxRows = 4 * kTileRows;

// Panels a thread takes at a time. Threads take them as they come free, not in fixed shares: a
// worker shares its cores with the coordinator, clients and the hypervisor, and with fixed shares a
// thread they preempt leaves the others spinning at the end of the loop (AMD EPYC, 2 vCPUs, TP=1 at
// 32 streams: 9.7% more output tokens/s than schedule(static), median of 5 alternating rounds
// of shardserve bench).
constexpr int64_t kPanelsAtATime = 2;

// Up to this many rows, products by a packed w run FewRowsProduct's tiles of several panels (a
// thread claims one tile, PanelsPerTile panels, at a time).
constexpr int64_t kFewRows = 3;

// y [n, m] = x [n, k] @ w^T (+ bias [m]) by a packed w of W's panels, on `threads` threads: the
// few-rows tiles up to kFewRows rows, the one-thread prefetch from kPrefetchMinRows to
// kPrefetchMaxRows, else panels shared out kPanelsAtATime at a time (PanelMatMulImpl's loops for a
// packed w). Only for a file compiled for one instruction set: an OpenMP loop in an always-inline
// helper of a cloned function runs baseline code (panel_matmul.cc, WideProduct).
template <class W>
void PackedPanelsProduct(float* y, const float* x, int64_t n, int64_t m, int64_t k, const typename W::T* w,
                         const float* bias, int threads) {
  const int64_t panels = Panels(m), stride = k * kPanelCols;
  if (n <= kFewRows) {
    const int64_t per = PanelsPerTile(static_cast<int>(n)), groups = (panels + per - 1) / per;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t p = g * per;
      FewRowsProduct<W>(y, x, n, m, k, w + p * stride, bias, std::min(per, panels - p), p * kPanelCols);
    }
    return;
  }
  if (threads == 1 && n >= kPrefetchMinRows && n <= kPrefetchMaxRows) {
    for (int64_t p = 0; p + 1 < panels; ++p) PanelProduct<W, true>(y, x, n, m, k, w + p * stride, w + (p + 1) * stride, bias, p);
    PanelProduct<W, false>(y, x, n, m, k, w + (panels - 1) * stride, nullptr, bias, panels - 1);  // no panel after it
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(dynamic, kPanelsAtATime)
  for (int64_t p = 0; p < panels; ++p) PanelProduct<W, false>(y, x, n, m, k, w + p * stride, nullptr, bias, p);
}

}  // namespace
}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_PANEL_TILES_H_
