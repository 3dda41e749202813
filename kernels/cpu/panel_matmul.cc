#include "kernels/cpu/panel_matmul.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/cpu/vec.h"

namespace shardserve::cpu {
namespace {

// Rows per tile: 6 rows x 2 vectors = 12 accumulators, plus the two panel vectors and a broadcast,
// fill AVX2's 16 registers. Measured on one core of an AMD EPYC (AVX2), one PP=2 stage of the
// benchmark model: 4 rows 21.7 ms at 16 rows of x, 6 rows 21.6 ms; 6 rows 85.6 GFLOP/s at 512.
constexpr int kTileRows = 6;

// y [R, cols] (row stride ldy) = x [R, k] (row stride k) @ one panel [k, 16] (+ bias [cols]).
// Each output is one chain over k in order: the arithmetic is the same for every R and tile.
template <int R>
[[gnu::always_inline]] inline void Tile(float* y, int64_t ldy, const float* x, int64_t k, const float* panel,
                                        int64_t cols, const float* bias) {
  Vec8 lo[R], hi[R];  // columns 0-7 and 8-15 of each row
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = Vec8{};
  for (int64_t kk = 0; kk < k; ++kk) {
    const Vec8 b_lo = LoadVec(panel + kk * kPanelCols), b_hi = LoadVec(panel + kk * kPanelCols + kVecLanes);
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

// Rows [0, n) of x times one panel, in tiles of kTileRows rows and one shorter last tile.
[[gnu::always_inline]] inline void PanelRows(float* y, int64_t ldy, const float* x, int64_t n, int64_t k,
                                             const float* panel, int64_t cols, const float* bias) {
  int64_t r = 0;
  for (; r + kTileRows <= n; r += kTileRows) Tile<kTileRows>(y + r * ldy, ldy, x + r * k, k, panel, cols, bias);
  switch (n - r) {
    case 5: Tile<5>(y + r * ldy, ldy, x + r * k, k, panel, cols, bias); break;
    case 4: Tile<4>(y + r * ldy, ldy, x + r * k, k, panel, cols, bias); break;
    case 3: Tile<3>(y + r * ldy, ldy, x + r * k, k, panel, cols, bias); break;
    case 2: Tile<2>(y + r * ldy, ldy, x + r * k, k, panel, cols, bias); break;
    case 1: Tile<1>(y + r * ldy, ldy, x + r * k, k, panel, cols, bias); break;
    default: break;
  }
}
static_assert(kTileRows == 6, "PanelRows' switch covers tails of 1 to 5 rows");

// Panels a weight of m output columns takes.
int64_t Panels(int64_t m) { return (m + kPanelCols - 1) / kPanelCols; }

// Panel p of w [m, k] (row-major) into out [k, 16], zero-padded past column m.
void PackPanel(float* out, const float* w, int64_t m, int64_t k, int64_t p) {
  const int64_t c0 = p * kPanelCols, cols = std::min(kPanelCols, m - c0);
  if (cols < kPanelCols) std::fill(out, out + k * kPanelCols, 0.0f);
  for (int64_t c = 0; c < cols; ++c) {
    const float* wr = w + (c0 + c) * k;
    for (int64_t kk = 0; kk < k; ++kk) out[kk * kPanelCols + c] = wr[kk];
  }
}

SHARDSERVE_VECTOR_CLONES
void PanelMatMulImpl(float* y, const float* x, int64_t n, int64_t m, int64_t k, const float* w, bool plain,
                     const float* bias, int threads, float* scratch) {
  const int64_t panels = Panels(m);
  // Threads share out whole panels (columns), never k, so the thread count cannot change a sum.
  // Each panel is read from memory once and stays in cache (k x 64 bytes) for all rows' tiles.
  // They take two panels at a time as they come free: a worker shares its cores with the
  // coordinator, clients and the hypervisor, and with fixed shares a thread they preempt leaves
  // the others spinning at the end of the loop (AMD EPYC, 2 vCPUs, TP=1 at 32 streams: 9.7% more
  // output tokens/s than schedule(static), median of 5 alternating rounds; docs/benchmarks.md).
#pragma omp parallel for num_threads(threads) schedule(dynamic, 2)
  for (int64_t p = 0; p < panels; ++p) {
    const float* panel = w + p * k * kPanelCols;
    if (plain) {
      float* own = scratch + static_cast<int64_t>(omp_get_thread_num()) * k * kPanelCols;
      PackPanel(own, w, m, k, p);
      panel = own;
    }
    const int64_t c0 = p * kPanelCols;
    PanelRows(y + c0, m, x, n, k, panel, std::min(kPanelCols, m - c0), bias != nullptr ? bias + c0 : nullptr);
  }
}

}  // namespace

int64_t PanelMatMulFloats(int64_t m, int64_t k) { return Panels(m) * k * kPanelCols; }

void PackPanels(float* packed, const float* w, int64_t m, int64_t k) {
  for (int64_t p = 0; p < Panels(m); ++p) PackPanel(packed + p * k * kPanelCols, w, m, k, p);
}

void PanelMatMul(float* y, const float* x, int64_t n, int64_t m, int64_t k, const float* w, bool plain,
                 const float* bias, int threads, std::vector<float>* scratch) {
  if (plain) {
    const auto need = static_cast<size_t>(threads * k * kPanelCols);
    if (scratch->size() < need) scratch->resize(need);
  }
  PanelMatMulImpl(y, x, n, m, k, w, plain, bias, threads, plain ? scratch->data() : nullptr);
}

}  // namespace shardserve::cpu
