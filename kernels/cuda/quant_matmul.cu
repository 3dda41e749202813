// The CUDA backend's products by quantized weights (kernels/quant.h: int8 and fp8 per output row,
// fp8 with input-group scales (an FP8 checkpoint's block scales; written without a GPU, not yet run
// on one), int4 in groups of 128, MXFP4 (gpt-oss's experts: e2m1 codes and an E8M0 scale per 32
// inputs; written without a GPU, not yet run on one)), behind CudaBackendOptions::quantized_kernels (on in the worker unless
// --no-cuda-quantized-kernels). These GEMVs (a block per two rows, an instance per input-row count)
// passed their CudaQuant tests on an H200 and served the 8B quantized at load there, int4 and int8
// (docs/performance.md).
//
// Storage: the CPU's layouts, byte for byte (PackQuantizedWeight is a copy to the device). One
// layout for both backends and for the checkpoints' loader (model/quantized_checkpoint.h), and the
// planner's byte counts hold as they are. What the GPU kernels want from it they get: an int8 / fp8
// row is k contiguous bytes (16-byte loads when k % 16 == 0 and the rows are aligned, else byte
// loads); an int4 row is groups x 72 contiguous bytes, read as 8-byte words (9 a group: the
// scale-and-zero header, then 64 bytes of nibbles, eight threads' loads). A Marlin-style repack
// (scales apart, nibbles interleaved for tensor-core fragments) would come with a tensor-core
// kernel; not written.
//
// MatMul out [n, m] = x [n, k] @ w^T (+ bias):
// - n <= kGemvMaxRows (decode): a GEMV that reads each weight byte once. A block of four warps
//   computes kGemvRows output rows, its threads strided runs of the rows' bytes, several loads in
//   flight; the codes are made float in registers (a byte permute under 2^23 and a subtraction,
//   exact, where an integer conversion runs at a quarter of the rate), each input value loaded once
//   for all of the block's rows (read through L1/L2: the same x for every block), summed in
//   float32, reduced across each warp with shuffles and across the warps in shared memory; one
//   thread per output scales (int8, fp8: by the row's scale once; int4: per group as it goes), adds
//   the bias, rounds once to out's dtype. On the H200 at Llama-3-8B's shapes the first GEMVs (a
//   warp a row, integer conversions) read 557 GB/s of int4 and 1,112 of int8, the second (a warp
//   per two rows, eight input rows unrolled in every instance) 744 and 1,379, of the 4.5 TB/s a
//   streaming read reaches; Nsight Compute found those latency-bound, neither DRAM nor the SMs busy
//   (Nsight Compute); the batch-1 instances below have a fifteenth of their code (gemv.cuh's
//   note). With CudaBackendOptions::int4_mma (passed on the H200 but slower there: off) int4 takes the
//   tensor cores instead (Int4MmaGemvKernel below) for bf16 / f16 act, k % 128 == 0 and every zero
//   below 128 (checked when the weight is stored); other shapes keep the GEMV.
//   With CudaBackendOptions::int4_folded (written without a GPU: off) int4 takes
//   Int4FoldedGemvKernel for 16-bit act dtypes instead: the zero point folded out of the loop.
// - n > kGemvMaxRows (prefill): the weight dequantized to the act dtype, kCudaDequantScratchBytes
//   (kernels/backend.h) worth of rows at a time, into a scratch buffer sized when the weight was
//   stored (CudaDequantScratchBytes: the planner counts the same), then cuBLAS (Gemm, matmul.cu) for that block
//   of out's columns, accumulating onto the broadcast bias. The weight is read once per call; the
//   dequantized rows are rounded to the act dtype (bf16: 2^-9 relative), as any bf16 GEMM's are.
//   fp8 weights with CudaBackendOptions::fp8_gemm (sm_89+): cuBLASLt's fp8 GEMM on x rounded to
//   e4m3 instead, no dequantize (fp8_gemm.cu).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "base/status_macros.h"
#include "kernels/cuda/cuda_backend.cuh"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/gemv.cuh"
#include "kernels/int4_folded.h"
#include "kernels/quant.h"

namespace shardserve::cuda {
namespace {

// Steps of 16-byte weight loads per row a thread issues before using the first (int8 / fp8: 2 x
// 16 B x 2 rows), and steps of sixteen int4 groups (a header and a word of nibbles per thread and
// row): the bytes in flight.
constexpr int kGemvLoads = 2;
constexpr int kInt4Steps = 2;
// Eight threads take an int4 group; a block's 128 threads, sixteen groups a step.
constexpr int kInt4GroupsPerStep = kGemvThreads / 8;
// An int4 group as 8-byte words: word 0 is the header (scale, zero, pad), words 1..8 the nibbles.
constexpr int kInt4Words = static_cast<int>(sizeof(Int4Group128) / 8);
static_assert(sizeof(Int4Group128) % 8 == 0 && offsetof(Int4Group128, q) == 8,
              "the int4 GEMV reads a group as 9 aligned 8-byte words, the nibbles from the second on");

// An OCP E4M3FN byte's value (Fp8E4m3ToFloat's, exactly; the NaN bytes 0x7F / 0xFF read as +-480,
// as the CPU kernels read them: loaders refuse them). The 7 magnitude bits placed at float's
// exponent-and-mantissa top give 2^(e - 127) (1 + m / 8); e4m3's bias is 7, hence e + 120. Exponent
// 0 is subnormal: m x 2^-9.
__device__ __forceinline__ float Fp8ToFloat(uint32_t v) {
  const uint32_t e = (v >> 3) & 0xFu, man = v & 7u;
  const float f = e == 0 ? static_cast<float>(man) * 0.001953125f : __uint_as_float(((e + 120u) << 23) | (man << 20));
  return (v & 0x80u) != 0 ? -f : f;
}

// A stored byte of an int8 (two's complement) or fp8 row, as float.
template <bool kFp8>
__device__ __forceinline__ float RowValue(uint32_t byte) {
  if constexpr (kFp8) {
    return Fp8ToFloat(byte);
  } else {
    return static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(byte)));
  }
}

// 2^23 + byte t of `bytes` (0 <= t < 4), as a float, built by one byte permute under 0x4B000000
// (the float 2^23, whose unit in the last place is 1): a code's value as float in one instruction
// where an integer-to-float conversion runs at a quarter of the rate. Minus kMagic (+ the code's
// offset) it is the code, exactly.
constexpr float kMagic = 8388608.0f;  // 2^23
__device__ __forceinline__ float MagicByte(uint32_t bytes, int t) {
  return __uint_as_float(__byte_perm(bytes, 0x4B000000u, 0x7540u + static_cast<uint32_t>(t)));
}

// Int8 or fp8 rows (Int8RowsLayout / Fp8RowsLayout): block b computes output rows kGemvRows b +
// [0, kGemvRows), for N input rows (those past n skipped). kVec: q's rows and x's rows are 16-byte
// aligned and hold multiples of 16 bytes (k % 16 == 0): thread t multiplies weights 16 t + 2048 l
// (l < kGemvLoads) of each row a step, all loads of a step in flight before the first is used, a
// block reading 2 KB of each row a load; else one byte a thread a step (still coalesced). int8
// codes are read as float by MagicByte on the codes + 128.
// fp8 with input-group scales (group > 0, a multiple of kFp8GroupMultiple = 8: an FP8 checkpoint's
// block scales, scale [m, G]; written without a GPU, not yet run on one): on the vector path each
// thread's 16 weights are two runs of 8 in one group each, summed apart and each sum times its
// group's scale into the row's sum; on the byte path each weight times its group's scale. The
// finished sums are then not scaled again.
template <typename T, typename TO, bool kFp8, int N, bool kVec>
__global__ void __launch_bounds__(kGemvThreads)
    RowsGemvKernel(TO* __restrict__ out /*[n, m]*/, const T* __restrict__ x /*[n, k]*/,
                   const float* __restrict__ scale /*[m] or [m, G]*/, const uint8_t* __restrict__ q /*[m, k]*/,
                   const T* __restrict__ bias /*[m] or null*/, int n, int m, int k, int group, bool prefetch) {
  constexpr int R = kGemvRows;
  const int r0 = static_cast<int>(blockIdx.x) * R;
  const bool groups = kFp8 && group > 0;  // the same for every thread
  const int per_row = groups ? (k + group - 1) / group : 1;
  const uint8_t* qr[R];
  const float* sr[R];  // groups: the row's G scales
#pragma unroll
  for (int rr = 0; rr < R; ++rr) {
    qr[rr] = q + static_cast<int64_t>(min(r0 + rr, m - 1)) * k;  // past m: not written
    sr[rr] = scale + static_cast<int64_t>(min(r0 + rr, m - 1)) * per_row;
  }
  if (kVec && prefetch) {  // launched with PDL: the first loads' lines into L2 while the kernel ahead drains
#pragma unroll
    for (int l = 0; l < kGemvLoads; ++l) {
      const int c = static_cast<int>(threadIdx.x) * 16 + kGemvThreads * 16 * l;
#pragma unroll
      for (int rr = 0; rr < R; ++rr) {
        if (c < k && (c & 127) == 0) PrefetchL2(qr[rr] + c);
      }
    }
  }
  WaitForPriorKernels();  // CudaBackend::Launch
  float acc[R][N] = {};
  if constexpr (kVec) {
    constexpr int kStride = kGemvThreads * 16;
    for (int base = static_cast<int>(threadIdx.x) * 16; base < k; base += kStride * kGemvLoads) {
      uint4 loaded[kGemvLoads][R];
#pragma unroll
      for (int l = 0; l < kGemvLoads; ++l) {
        const int c = base + kStride * l;
#pragma unroll
        for (int rr = 0; rr < R; ++rr) {
          loaded[l][rr] = c < k ? __ldg(reinterpret_cast<const uint4*>(qr[rr] + c)) : make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int l = 0; l < kGemvLoads; ++l) {
        const int c = base + kStride * l;
        if (c >= k) break;
        float w[R][16];
#pragma unroll
        for (int rr = 0; rr < R; ++rr) {
          const uint32_t words[4] = {loaded[l][rr].x, loaded[l][rr].y, loaded[l][rr].z, loaded[l][rr].w};
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            if constexpr (kFp8) {
              w[rr][j] = Fp8ToFloat((words[j / 4] >> (8 * (j % 4))) & 0xFFu);
            } else {  // the code + 128 (its sign bit flipped) under 2^23, less both
              w[rr][j] = MagicByte(words[j / 4] ^ 0x80808080u, j % 4) - (kMagic + 128.0f);
            }
          }
        }
        float s0[R], s1[R];  // groups: the scales of inputs c .. c + 7 and c + 8 .. c + 15
        if (groups) {
#pragma unroll
          for (int rr = 0; rr < R; ++rr) {
            s0[rr] = __ldg(sr[rr] + c / group);
            s1[rr] = __ldg(sr[rr] + min(c + 8, k - 1) / group);
          }
        }
#pragma unroll
        for (int i = 0; i < N; ++i) {
          if (i < n) {  // the same for the whole block
            float xv[16];
            LoadX8<T, true>(x + static_cast<int64_t>(i) * k, c, k, xv);
            LoadX8<T, true>(x + static_cast<int64_t>(i) * k, c + 8, k, xv + 8);
#pragma unroll
            for (int rr = 0; rr < R; ++rr) {
              if (groups) {
                float d0 = 0.0f, d1 = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; ++j) d0 = fmaf(w[rr][j], xv[j], d0);
#pragma unroll
                for (int j = 8; j < 16; ++j) d1 = fmaf(w[rr][j], xv[j], d1);
                acc[rr][i] = fmaf(d1, s1[rr], fmaf(d0, s0[rr], acc[rr][i]));
              } else {
                float d = 0.0f;
#pragma unroll
                for (int j = 0; j < 16; ++j) d = fmaf(w[rr][j], xv[j], d);
                acc[rr][i] += d;
              }
            }
          }
        }
      }
    }
  } else {
    for (int c = static_cast<int>(threadIdx.x); c < k; c += kGemvThreads) {
      float w[R];
#pragma unroll
      for (int rr = 0; rr < R; ++rr) {
        w[rr] = RowValue<kFp8>(__ldg(qr[rr] + c));
        if (groups) w[rr] *= __ldg(sr[rr] + c / group);
      }
#pragma unroll
      for (int i = 0; i < N; ++i) {
        if (i < n) {
          const float xi = ToFloat(x[static_cast<int64_t>(i) * k + c]);
#pragma unroll
          for (int rr = 0; rr < R; ++rr) acc[rr][i] += w[rr] * xi;
        }
      }
    }
  }
  FinishRows<T, TO, N>(out, acc, groups ? nullptr : scale, bias, n, m, r0);
}

// An e2m1 code (the low 4 bits of c) as float, exactly kMxfp4Values[c]: exponent field e = bits
// 1-2 and mantissa bit 0; e = 0 is 0 or 0.5 (m x 0.5), else (1 + m / 2) 2^(e - 1); bit 3 the sign.
__device__ __forceinline__ float E2m1ToFloat(uint32_t c) {
  const uint32_t e = (c >> 1) & 3u, man = c & 1u;
  const float f = e == 0 ? static_cast<float>(man) * 0.5f : __uint_as_float(((e + 126u) << 23) | (man << 22));
  return (c & 8u) != 0 ? -f : f;
}

// An E8M0 scale byte as 2^(e - 127), exactly (byte 0: the subnormal 2^-127; 255, which
// PackQuantizedWeight refuses, would read as +inf).
__device__ __forceinline__ float E8m0ToFloat(uint32_t e) { return e == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(e << 23); }

// MXFP4 rows (Mxfp4RowsLayout: blocks [m, G] of 16 bytes, then scales [m, G]; k = 32 G): block b
// computes output rows kGemvRows b + [0, kGemvRows), for N input rows (those past n skipped). Thread
// t takes blocks t, t + 128, ... of each row: one 16-byte load of codes and one scale byte, its 32
// values made float (E2m1ToFloat, times the block's scale: DequantizeMxfp4Rows' values exactly), each
// input row's 32 products summed in order and added to the row's sum; the block's sums as the other
// GEMVs' (FinishRows). kVecX: x's rows 16-byte aligned (LoadX8's vector loads). Written without a
// GPU, not yet run on one (CudaVsCpu.Mxfp4MatMul).
template <typename T, typename TO, int N, bool kVecX>
__global__ void __launch_bounds__(kGemvThreads)
    Mxfp4GemvKernel(TO* __restrict__ out /*[n, m]*/, const T* __restrict__ x /*[n, k]*/,
                    const uint8_t* __restrict__ blocks /*[m, G, 16]*/, const uint8_t* __restrict__ scales /*[m, G]*/,
                    const T* __restrict__ bias /*[m] or null*/, int n, int m, int k, bool prefetch) {
  constexpr int R = kGemvRows;
  const int r0 = static_cast<int>(blockIdx.x) * R;
  const int G = k / static_cast<int>(kMxfp4BlockSize);
  const uint4* br[R];
  const uint8_t* sr[R];
#pragma unroll
  for (int rr = 0; rr < R; ++rr) {
    const int64_t row = min(r0 + rr, m - 1);  // past m: not written
    br[rr] = reinterpret_cast<const uint4*>(blocks) + row * G;
    sr[rr] = scales + row * G;
  }
  if (prefetch) {  // launched with PDL: the first blocks' lines into L2 while the kernel ahead drains
    const int g = static_cast<int>(threadIdx.x);
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
      if (g < G && (g & 7) == 0) PrefetchL2(br[rr] + g);
    }
  }
  WaitForPriorKernels();  // CudaBackend::Launch
  float acc[R][N] = {};
  for (int g = static_cast<int>(threadIdx.x); g < G; g += kGemvThreads) {
    float w[R][32];
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
      const uint4 q = __ldg(br[rr] + g);
      const float s = E8m0ToFloat(__ldg(sr[rr] + g));
      const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const uint32_t byte = (words[j / 4] >> (8 * (j % 4))) & 0xFFu;
        w[rr][2 * j] = E2m1ToFloat(byte) * s;
        w[rr][2 * j + 1] = E2m1ToFloat(byte >> 4) * s;
      }
    }
    const int c = g * static_cast<int>(kMxfp4BlockSize);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (i < n) {  // the same for the whole block
        float xv[32];
#pragma unroll
        for (int h = 0; h < 4; ++h) LoadX8<T, kVecX>(x + static_cast<int64_t>(i) * k, c + 8 * h, k, xv + 8 * h);
#pragma unroll
        for (int rr = 0; rr < R; ++rr) {
          float d = 0.0f;
#pragma unroll
          for (int j = 0; j < 32; ++j) d = fmaf(w[rr][j], xv[j], d);
          acc[rr][i] += d;
        }
      }
    }
  }
  FinishRows<T, TO, N>(out, acc, nullptr, bias, n, m, r0);
}

// Int4 groups (Int4GroupsLayout): block b computes output rows kGemvRows b + [0, kGemvRows), for N
// input rows (those past n skipped). Eight threads take a group (thread / 8: which of sixteen
// groups a step, thread % 8: which of its eight 8-byte words of nibbles) and all eight read its
// header (scale, zero) as one broadcast 8-byte load; kInt4Steps steps (32 groups of each row) are
// loaded before any is used. Thread p of a group multiplies inputs 128 g + 8 p + [0, 8) (low
// nibbles) and the same + 64 (high nibbles), each code made float by MagicByte less 2^23 + zero:
// (q - zero) exactly, as DequantizeInt4Groups has it; the group's sum times its scale. Inputs at or
// past k (the last group of a row when k % 128 != 0) are 0 and add nothing. kVecX: x's rows are
// 16-byte aligned and hold multiples of 16 bytes.
template <typename T, typename TO, int N, bool kVecX>
__global__ void __launch_bounds__(kGemvThreads)
    Int4GemvKernel(TO* __restrict__ out /*[n, m]*/, const T* __restrict__ x /*[n, k]*/,
                   const Int4Group128* __restrict__ blocks /*[m, groups]*/, const T* __restrict__ bias /*[m] or null*/,
                   int n, int m, int k, int groups, bool prefetch) {
  constexpr int R = kGemvRows;
  const int first = static_cast<int>(threadIdx.x) >> 3, p = static_cast<int>(threadIdx.x) & 7;
  const int r0 = static_cast<int>(blockIdx.x) * R;
  const uint2* words[R];
#pragma unroll
  for (int rr = 0; rr < R; ++rr) {
    words[rr] = reinterpret_cast<const uint2*>(blocks + static_cast<int64_t>(min(r0 + rr, m - 1)) * groups);
  }
  // Launched with PDL: the first step's groups into L2 while the kernel ahead drains (weights); a
  // group's 72 bytes span at most two lines, asked for by its first two threads.
  if (prefetch) {
#pragma unroll
    for (int u = 0; u < kInt4Steps; ++u) {
      const int g = first + kInt4GroupsPerStep * u;
#pragma unroll
      for (int rr = 0; rr < R; ++rr) {
        if (p < 2 && g < groups) PrefetchL2(words[rr] + static_cast<int64_t>(g) * kInt4Words + 8 * p);
      }
    }
  }
  WaitForPriorKernels();  // CudaBackend::Launch
  float acc[R][N] = {};
  for (int g0 = first; g0 < groups; g0 += kInt4GroupsPerStep * kInt4Steps) {
    uint2 head[kInt4Steps][R], nib[kInt4Steps][R];
#pragma unroll
    for (int u = 0; u < kInt4Steps; ++u) {
      const int g = g0 + kInt4GroupsPerStep * u;
#pragma unroll
      for (int rr = 0; rr < R; ++rr) {
        const uint2* group = words[rr] + static_cast<int64_t>(g) * kInt4Words;
        head[u][rr] = g < groups ? __ldg(group) : make_uint2(0, 0);
        nib[u][rr] = g < groups ? __ldg(group + 1 + p) : make_uint2(0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kInt4Steps; ++u) {
      const int g = g0 + kInt4GroupsPerStep * u;
      if (g >= groups) break;
      float w[R][16], s[R];
#pragma unroll
      for (int rr = 0; rr < R; ++rr) {
        s[rr] = __uint_as_float(head[u][rr].x);
        const float mz = kMagic + static_cast<float>(head[u][rr].y & 0xFFu);  // 2^23 + zero
        const uint32_t nibbles[4] = {nib[u][rr].x & 0x0F0F0F0Fu, nib[u][rr].y & 0x0F0F0F0Fu,
                                     (nib[u][rr].x >> 4) & 0x0F0F0F0Fu, (nib[u][rr].y >> 4) & 0x0F0F0F0Fu};
#pragma unroll
        for (int j = 0; j < 16; ++j) w[rr][j] = MagicByte(nibbles[j / 4], j % 4) - mz;
      }
      const int c = g * static_cast<int>(kInt4GroupSize) + 8 * p;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        if (i < n) {  // the same for the whole block
          float xv[16];
          LoadX8<T, kVecX>(x + static_cast<int64_t>(i) * k, c, k, xv);
          LoadX8<T, kVecX>(x + static_cast<int64_t>(i) * k, c + static_cast<int>(kInt4GroupSize) / 2, k, xv + 8);
#pragma unroll
          for (int rr = 0; rr < R; ++rr) {
            float d = 0.0f;
#pragma unroll
            for (int j = 0; j < 16; ++j) d = fmaf(w[rr][j], xv[j], d);
            acc[rr][i] = fmaf(s[rr], d, acc[rr][i]);
          }
        }
      }
    }
  }
  FinishRows<T, TO, N>(out, acc, nullptr, bias, n, m, r0);
}

// ---- int4, the zero point folded out of the inner loop (CudaBackendOptions::int4_folded; written
// 2026-11-29 without a GPU, off until it passes there)
// The GEMV above spends 5.9 instructions a code in its loop on sm_90 (its SASS: a byte permute, a
// subtraction and a multiply-add a code, 377 instructions for 64 codes with the masks, x's
// widening for two rows and the addresses; tools/gpu/sass_census.py), and its SMs, not DRAM, were the
// limit on the H200 (32% of the int4 roofline). Here a code costs a byte permute and a multiply-add,
// the zero point taken off once a group and row (kernels/int4_folded.h, whose arithmetic the CPU
// tests run too): 4.0 instructions a code in the loop. Four output rows a block (kFoldRows) share
// each input value's widening and sum. Not exact in the last bits as the GEMV's products are (about
// 2^-14 of the products' magnitude, far inside a bf16 / f16 output's rounding), so taken for 16-bit
// act dtypes only (float32 act keeps the GEMV above); a non-finite x gives NaN in its input row's
// outputs. Block b computes output rows 4 b + [0, 4) (rows past m read as row m - 1 and not
// written), the threads and steps as in Int4GemvKernel; x's rows 16-byte aligned, k % 8 == 0.
constexpr int kFoldRows = 4;

template <typename T, typename TO, int N>
__global__ void __launch_bounds__(kGemvThreads)
    Int4FoldedGemvKernel(TO* __restrict__ out /*[n, m]*/, const T* __restrict__ x /*[n, k]*/,
                         const Int4Group128* __restrict__ blocks /*[m, groups]*/,
                         const T* __restrict__ bias /*[m] or null*/, int n, int m, int k, int groups, bool prefetch) {
  constexpr int R = kFoldRows;
  const int first = static_cast<int>(threadIdx.x) >> 3, p = static_cast<int>(threadIdx.x) & 7;
  const int r0 = static_cast<int>(blockIdx.x) * R;
  // at[rr]: row rr's group g0 (below), its header; advanced a loop's groups at a time (kept in
  // registers: recomputed from the row's index each loop, the addresses took a third of the loop).
  const uint2* at[R];
#pragma unroll
  for (int rr = 0; rr < R; ++rr) {
    at[rr] = reinterpret_cast<const uint2*>(blocks + static_cast<int64_t>(min(r0 + rr, m - 1)) * groups + first);
  }
  constexpr int kStepWords = kInt4GroupsPerStep * kInt4Words;
  if (prefetch) {  // launched with PDL: as Int4GemvKernel
#pragma unroll
    for (int u = 0; u < kInt4Steps; ++u) {
#pragma unroll
      for (int rr = 0; rr < R; ++rr) {
        if (p < 2 && first + kInt4GroupsPerStep * u < groups) PrefetchL2(at[rr] + kStepWords * u + 8 * p);
      }
    }
  }
  WaitForPriorKernels();  // CudaBackend::Launch
  float acc[R][N] = {};
  for (int g0 = first; g0 < groups; g0 += kInt4GroupsPerStep * kInt4Steps) {
    uint2 head[kInt4Steps][R], nib[kInt4Steps][R];
#pragma unroll
    for (int u = 0; u < kInt4Steps; ++u) {
      if (g0 + kInt4GroupsPerStep * u < groups) {  // else not read (the loop below stops first)
#pragma unroll
        for (int rr = 0; rr < R; ++rr) {
          head[u][rr] = __ldg(at[rr] + kStepWords * u);
          nib[u][rr] = __ldg(at[rr] + kStepWords * u + 1 + p);
        }
      }
    }
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
      at[rr] += kStepWords * kInt4Steps;
      asm("" : "+l"(at[rr]));  // opaque to the compiler, which would rederive it from g0 (64-bit multiplies)
    }
#pragma unroll
    for (int u = 0; u < kInt4Steps; ++u) {
      const int g = g0 + kInt4GroupsPerStep * u;
      if (g >= groups) break;
      float w[R][16], s[R], cz[R];
#pragma unroll
      for (int rr = 0; rr < R; ++rr) {
        s[rr] = FoldedScale(__uint_as_float(head[u][rr].x));
        cz[rr] = FoldedZero(head[u][rr].y & 0xFFu);
        FoldedCodes(nib[u][rr].x, nib[u][rr].y, w[rr]);
      }
      const int c = g * static_cast<int>(kInt4GroupSize) + 8 * p;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        if (i < n) {  // the same for the whole block
          float xv[16];
          LoadX8<T, true>(x + static_cast<int64_t>(i) * k, c, k, xv);
          LoadX8<T, true>(x + static_cast<int64_t>(i) * k, c + static_cast<int>(kInt4GroupSize) / 2, k, xv + 8);
          const float sx = FoldedSumX(xv);
#pragma unroll
          for (int rr = 0; rr < R; ++rr) acc[rr][i] = FoldedAccumulate(w[rr], xv, sx, s[rr], cz[rr], acc[rr][i]);
        }
      }
    }
  }
  FinishRows<T, TO, N>(out, acc, nullptr, bias, n, m, r0);
}

// ---- int4 on the tensor cores (CudaBackendOptions::int4_mma; passed on an H200, 2026-11-28, but
// slower there than the GEMV above: 300 against 374 tok/s in the quant bench, latency-bound at few
// blocks (k / v: 64 blocks) and 28 groups a warp (down); off by default)
// The GEMV above spends about four instructions a weight (its code made float, less the zero, times
// x) and ran at 32% of the int4 roofline on the H200, its SMs busy and DRAM not (Nsight Compute;
// docs/performance.md). Here a warp multiplies 16 rows by up to 8 input rows with mma.sync m16n8k16 (A: the
// codes less their zero, 16-bit; B: x; float32 sums), each code made a 16-bit value two at a time:
// about 1.5 instructions a weight.
//
// The codes: (w & 0x000F000F) | magic is a pair of 16-bit values magic + q (magic's unit in the
// last place is 1: bf16 128, f16 1024), and one fma.rn.*x2 by 1 plus -(magic + zero) leaves q -
// zero, exactly (bf16 holds integers to 256; zero < 128, checked when the weight is stored). The
// products of those with bf16 / f16 x are exact in float32, summed there; a group's sums times its
// scale, as DequantizeInt4Groups's (q - zero) x scale has it.
//
// Which inputs each lane multiplies: mma gives lane (row = lane / 4, t = lane % 4) the k-slots 2t,
// 2t + 1, 2t + 8, 2t + 9 of A's rows row and row + 8 and the same k-slots of B's column row, so a
// lane's four k-slots can stand for any four inputs, the same in A and B. Lane t of a group takes
// the code bytes 16 t + [0, 16): word j (bytes 16 t + 4 j + [0, 4)) holds inputs c = 16 t + 4 j +
// [0, 4) in its low nibbles and c + 64 in its high ones, two products of 16 inputs: slots (2t, 2t +
// 1) are inputs (c, c + 2) (the bytes 0 and 2 a mask keeps), slots (2t + 8, 2t + 9) inputs (c + 1,
// c + 3) (after a shift by 8); x's pairs are permuted to match (PRMT).
//
// Block b computes output rows 16 b + [0, 16) (rows past m read as row m - 1 and not written), its
// four warps the groups g = warp + 4 i, kMmaSteps groups' loads in flight before the first is used,
// then their sums added in a fixed order in shared memory: an output's bits depend on its own input
// row only, whatever else is in the batch. x's rows are 16-byte aligned, k % 128 == 0 (whole groups).
constexpr int kMmaRows = 16;
constexpr int kMmaSteps = 2;
static_assert(kGemvThreads == kMmaRows * kGemvMaxRows, "the block's threads finish its 16 x 8 outputs, one each");

// The 16-bit halves of the pairs: kMagic | q = magic + q; kNeg | zero = -(magic + zero); kOne = 1.
template <typename T>
struct MmaBits;
template <>
struct MmaBits<__nv_bfloat16> {
  static constexpr uint32_t kMagic = 0x4300, kNeg = 0xC300, kOne = 0x3F80;
};
template <>
struct MmaBits<__half> {
  static constexpr uint32_t kMagic = 0x6400, kNeg = 0xE400, kOne = 0x3C00;
};

// Both halves of `a` times 1 plus those of `c`, rounded to T (exact for the small integers here).
template <typename T>
__device__ __forceinline__ uint32_t PairFma(uint32_t a, uint32_t c) {
  constexpr uint32_t one = MmaBits<T>::kOne * 0x10001u;
  uint32_t d;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(one), "r"(c));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(one), "r"(c));
  }
  return d;
}

// d += A (16 x 16, four pairs a lane) x B (16 x 8, two pairs a lane), float32 (mma.sync m16n8k16).
template <typename T>
__device__ __forceinline__ void Mma16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#else
  __trap();  // the backend refuses devices below compute capability 8.0
#endif
}

// One 16-input product of a group into d: the low (kHigh false) or high nibbles of a code word of
// the lane's two rows (w0: row, w1: row + 8; each less its zero, neg0 / neg1) by the x pairs of
// the word's inputs (x01: inputs c, c + 1; x23: c + 2, c + 3).
template <typename T, bool kHigh>
__device__ __forceinline__ void Int4Mma(float (&d)[4], uint32_t w0, uint32_t w1, uint32_t neg0, uint32_t neg1,
                                        uint32_t x01, uint32_t x23) {
  constexpr uint32_t kMask = 0x000F000Fu, kMagic = MmaBits<T>::kMagic * 0x10001u;
  const uint32_t s02 = kHigh ? 4 : 0, s13 = kHigh ? 12 : 8;  // bytes 0, 2 and bytes 1, 3 to the low nibble
  const uint32_t a[4] = {PairFma<T>(((w0 >> s02) & kMask) | kMagic, neg0),
                         PairFma<T>(((w1 >> s02) & kMask) | kMagic, neg1),
                         PairFma<T>(((w0 >> s13) & kMask) | kMagic, neg0),
                         PairFma<T>(((w1 >> s13) & kMask) | kMagic, neg1)};
  Mma16x8x16<T>(d, a, __byte_perm(x01, x23, 0x5410), __byte_perm(x01, x23, 0x7632));
}

template <typename T, typename TO>
__global__ void __launch_bounds__(kGemvThreads)
    Int4MmaGemvKernel(TO* __restrict__ out /*[n, m]*/, const T* __restrict__ x /*[n, k]*/,
                      const Int4Group128* __restrict__ blocks /*[m, groups]*/,
                      const T* __restrict__ bias /*[m] or null*/, int n, int m, int k, int groups, bool prefetch) {
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int row = lane >> 2, t = lane & 3;
  const int r0 = static_cast<int>(blockIdx.x) * kMmaRows;
  const uint2* words[2] = {
      reinterpret_cast<const uint2*>(blocks + static_cast<int64_t>(min(r0 + row, m - 1)) * groups),
      reinterpret_cast<const uint2*>(blocks + static_cast<int64_t>(min(r0 + row + 8, m - 1)) * groups)};
  // Launched with PDL: the first step's groups into L2 while the kernel ahead drains, as above.
  if (prefetch) {
#pragma unroll
    for (int u = 0; u < kMmaSteps; ++u) {
      const int g = warp + kGemvWarps * u;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (t < 2 && g < groups) PrefetchL2(words[h] + static_cast<int64_t>(g) * kInt4Words + 8 * t);
      }
    }
  }
  WaitForPriorKernels();       // CudaBackend::Launch
  const bool has_x = row < n;  // B's column `row`: input row `row`, zeros past n
  const uint4* xr = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(has_x ? row : 0) * k);
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // rows row, row + 8 (scaled sums) x columns 2t, 2t + 1
  for (int g0 = warp; g0 < groups; g0 += kGemvWarps * kMmaSteps) {
    uint2 head[kMmaSteps][2], codes[kMmaSteps][2][2];
    uint4 xs[kMmaSteps][4];
#pragma unroll
    for (int u = 0; u < kMmaSteps; ++u) {
      const int g = g0 + kGemvWarps * u;
      const bool valid = g < groups;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint2* group = words[h] + static_cast<int64_t>(g) * kInt4Words;
        head[u][h] = valid ? __ldg(group) : make_uint2(0, 0);
        codes[u][h][0] = valid ? __ldg(group + 1 + 2 * t) : make_uint2(0, 0);
        codes[u][h][1] = valid ? __ldg(group + 2 + 2 * t) : make_uint2(0, 0);
      }
      // Inputs 128 g + 16 t + [0, 16) and the same + 64 (8 values a 16-byte load).
      const uint4* xg = xr + static_cast<int64_t>(g) * (kInt4GroupSize / 8) + 2 * t;
#pragma unroll
      for (int v = 0; v < 4; ++v) xs[u][v] = valid && has_x ? __ldg(xg + (v & 1) + 8 * (v >> 1)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kMmaSteps; ++u) {
      if (g0 + kGemvWarps * u >= groups) break;  // the same for the whole warp
      uint32_t neg[2];
      float scale[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        scale[h] = __uint_as_float(head[u][h].x);
        neg[h] = (MmaBits<T>::kNeg | (head[u][h].y & 0xFFu)) * 0x10001u;
      }
      float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t w0 = j & 1 ? codes[u][0][j >> 1].y : codes[u][0][j >> 1].x;
        const uint32_t w1 = j & 1 ? codes[u][1][j >> 1].y : codes[u][1][j >> 1].x;
        const uint4& lo = xs[u][j >> 1];       // inputs 16 t + 8 (j / 2) + [0, 8)
        const uint4& hi = xs[u][2 + (j >> 1)];  // the same + 64
        const uint32_t lo01 = j & 1 ? lo.z : lo.x, lo23 = j & 1 ? lo.w : lo.y;
        const uint32_t hi01 = j & 1 ? hi.z : hi.x, hi23 = j & 1 ? hi.w : hi.y;
        Int4Mma<T, false>(d, w0, w1, neg[0], neg[1], lo01, lo23);
        Int4Mma<T, true>(d, w0, w1, neg[0], neg[1], hi01, hi23);
      }
      acc[0] = fmaf(scale[0], d[0], acc[0]);
      acc[1] = fmaf(scale[0], d[1], acc[1]);
      acc[2] = fmaf(scale[1], d[2], acc[2]);
      acc[3] = fmaf(scale[1], d[3], acc[3]);
    }
  }
  __shared__ float part[kGemvWarps][kMmaRows][kGemvMaxRows];
  part[warp][row][2 * t] = acc[0];
  part[warp][row][2 * t + 1] = acc[1];
  part[warp][row + 8][2 * t] = acc[2];
  part[warp][row + 8][2 * t + 1] = acc[3];
  __syncthreads();
  const int rr = static_cast<int>(threadIdx.x) / kGemvMaxRows, i = static_cast<int>(threadIdx.x) % kGemvMaxRows;
  const int r = r0 + rr;
  if (i < n && r < m) {
    float sum = part[0][rr][i];
#pragma unroll
    for (int w = 1; w < kGemvWarps; ++w) sum += part[w][rr][i];
    const float b = bias != nullptr ? ToFloat(bias[r]) : 0.0f;
    out[static_cast<int64_t>(i) * m + r] = FromFloat<TO>(sum + b);
  }
}

// w [rows, k] (act) = rows r0 .. r0 + rows of an int8 / fp8 weight, dequantized as
// DequantizeInt8Rows / DequantizeFp8Rows do (value x scale in float32), rounded once; fp8 with
// input-group scales (group > 0: scale [m, G]) as DequantizeFp8Groups.
template <typename T, bool kFp8>
__global__ void DequantRowsKernel(T* __restrict__ w, const float* __restrict__ scale, const uint8_t* __restrict__ q,
                                  int64_t r0, int64_t rows, int64_t k, int64_t group) {
  const uint8_t* q0 = q + r0 * k;
  if (kFp8 && group > 0) {
    const int64_t per_row = (k + group - 1) / group;
    GRID_STRIDE_LOOP(i, rows * k) {
      const int64_t r = i / k;
      w[i] = FromFloat<T>(RowValue<kFp8>(q0[i]) * scale[(r0 + r) * per_row + (i - r * k) / group]);
    }
  } else {
    GRID_STRIDE_LOOP(i, rows * k) w[i] = FromFloat<T>(RowValue<kFp8>(q0[i]) * scale[r0 + i / k]);
  }
}

// The same for int4 groups, as DequantizeInt4Groups: (q - zero) x scale.
template <typename T>
__global__ void DequantInt4Kernel(T* __restrict__ w, const Int4Group128* __restrict__ blocks, int64_t r0,
                                  int64_t rows, int64_t k, int64_t groups) {
  GRID_STRIDE_LOOP(i, rows * k) {
    const int64_t r = i / k, c = i - r * k;
    const Int4Group128& b = blocks[(r0 + r) * groups + c / kInt4GroupSize];
    const int j = static_cast<int>(c % kInt4GroupSize);
    const int byte = b.q[j % (kInt4GroupSize / 2)];
    const int v = j < kInt4GroupSize / 2 ? (byte & 15) : (byte >> 4);
    w[i] = FromFloat<T>(static_cast<float>(v - b.zero) * b.scale);
  }
}

// The same for MXFP4 rows, as DequantizeMxfp4Rows: code value x 2^(e - 127), exact.
template <typename T>
__global__ void DequantMxfp4Kernel(T* __restrict__ w, const uint8_t* __restrict__ blocks,
                                   const uint8_t* __restrict__ scales, int64_t r0, int64_t rows, int64_t k) {
  const int64_t groups = k / kMxfp4BlockSize;
  GRID_STRIDE_LOOP(i, rows * k) {
    const int64_t r = i / k, c = i - r * k, block = (r0 + r) * groups + c / kMxfp4BlockSize;
    const int j = static_cast<int>(c % kMxfp4BlockSize);
    const uint32_t byte = blocks[block * kMxfp4BlockBytes + j / 2];
    w[i] = FromFloat<T>(E2m1ToFloat((j & 1) != 0 ? byte >> 4 : byte) * E8m0ToFloat(scales[block]));
  }
}

absl::Status Off(const char* op, WeightQuant quant) {
  return absl::UnimplementedError(absl::StrCat(
      op, ": the CUDA kernels for ", WeightQuantName(quant),
      " weights are off on this backend (shardserve-worker --no-cuda-quantized-kernels; launch / bench --compare: "
      "--worker-no-cuda-quantized-kernels; docs/gpu.md): load without quantization, or leave them on"));
}

}  // namespace

absl::StatusOr<Buffer> CudaBackend::PackQuantizedWeight(WeightQuant quant, const void* stored, int64_t m, int64_t k,
                                                        Tensor* packed, int64_t group) {
  if (quant == WeightQuant::kNone) {
    return absl::InvalidArgumentError("PackQuantizedWeight: kNone is no quantized layout; use PackMatMulWeight");
  }
  if (!options_.quantized_kernels) return Off("PackQuantizedWeight", quant);
  if (m <= 0 || k <= 0 || !FitsInt(m) || !FitsInt(k)) {
    return absl::InvalidArgumentError(absl::StrCat("PackQuantizedWeight: a [", m, ", ", k, "] ", WeightQuantName(quant),
                                                   " weight (want 0 < m, k <= 2^31 - 1)"));
  }
  if (stored == nullptr) return absl::InvalidArgumentError("PackQuantizedWeight: stored is null");
  // fp8's input-group scales: RowsGemvKernel's runs of 8 inputs each in one group.
  if (group < 0 || (group > 0 && (quant != WeightQuant::kFp8 || group % kFp8GroupMultiple != 0))) {
    return absl::InvalidArgumentError(absl::StrCat("PackQuantizedWeight: input groups of ", group, " for a ",
                                                   WeightQuantName(quant), " weight (fp8 only, a multiple of ",
                                                   kFp8GroupMultiple, "; 0: none)"));
  }
  if (quant == WeightQuant::kMxfp4) {  // the checkpoint's codes and scales as they are (Mxfp4RowsLayout)
    if (k % kMxfp4BlockSize != 0) {
      return absl::InvalidArgumentError(absl::StrCat("PackQuantizedWeight: an mxfp4 weight of ", k,
                                                     " inputs, not a whole number of blocks of ", kMxfp4BlockSize));
    }
    if (!Mxfp4ValuesFinite(static_cast<const uint8_t*>(stored), m, k)) {
      return absl::InvalidArgumentError(
          absl::StrCat("PackQuantizedWeight: an mxfp4 [", m, ", ", k,
                       "] weight with values past float32 (a scale byte of 255, NaN in E8M0, or 253 / 254 on a code "
                       "it carries past 2^128)"));
    }
  }
  const auto bytes = static_cast<size_t>(QuantizedWeightBytes(quant, m, k, group));
  if (quant == WeightQuant::kFp8 && Fp8RowsLayout{m, k, group}.groups_per_row() == 1) group = 0;  // one scale a row
  absl::StatusOr<Buffer> buffer = Allocate(bytes);
  if (!buffer.ok()) return buffer.status();
  SHARDSERVE_RETURN_IF_ERROR(CopyToDevice(buffer->data(), stored, bytes));
  // The scratch MatMul dequantizes this weight's rows into (above kGemvMaxRows rows of x), grown now,
  // at load, so that no step allocates it and the worker can report it beside the plan.
  SHARDSERVE_RETURN_IF_ERROR(GrowDevice(&dequant_dev_, &dequant_capacity_, DequantScratchBytes(m, k)));
  // Int4MmaGemvKernel's exact q - zero needs zero < 128 (any int4 quantizer's is at most 16).
  bool small_zeros = false;
  if (quant == WeightQuant::kInt4 && options_.int4_mma) {
    const auto* groups = static_cast<const Int4Group128*>(stored);
    const int64_t count = m * Int4GroupsLayout{m, k}.groups_per_row();
    small_zeros = true;
    for (int64_t g = 0; g < count && small_zeros; ++g) small_zeros = groups[g].zero < 128;
  }
  quantized_[buffer->data()] = QuantizedWeight{m, k, quant, small_zeros, group};
  *packed = Tensor(buffer->data(), DType::kI8, {m, k});
  packed->quant = quant;
  packed->quant_group = group;
  return buffer;
}

absl::StatusOr<Buffer> CudaBackend::PackMatMulWeight(const Tensor& w, Tensor* packed, WeightQuant quant) {
  if (quant == WeightQuant::kNone) return Backend::PackMatMulWeight(w, packed, quant);
  *packed = w;
  if (!options_.quantized_kernels) return Off("PackMatMulWeight", quant);
  if (quant == WeightQuant::kMxfp4) {
    return Invalid("PackMatMulWeight", "nothing quantizes into mxfp4 at load; PackQuantizedWeight takes a checkpoint's codes",
                   {{"w", &w}});
  }
  if (!Is(w, 2, act_)) {
    return Invalid("PackMatMulWeight", absl::StrCat("expected w [m, k] ", DTypeName(act_)), {{"w", &w}});
  }
  const int64_t m = w.dim(0), k = w.dim(1);
  if (m == 0 || k == 0) return Buffer();  // nothing to multiply; MatMul handles it plain
  // Quantized on the host by kernels/quant.h's own quantizers (once, at load; QuantizeWeight: the
  // rows over the host's threads, each widening its own rows of the act dtype), so that both
  // backends hold the same bytes for the same weight. The host buffers are kept for the next
  // weight (until ReleaseLoadBuffers, when the model is loaded): the 8B's 7 G weights took 52 s to
  // start on the H200's host (2026-11-28) when each weight had fresh buffers and a float32 copy
  // widened by one thread.
  pack_raw_.resize(std::max(pack_raw_.size(), w.bytes()));
  SHARDSERVE_RETURN_IF_ERROR(CopyToHost(pack_raw_.data(), w.data, w.bytes()));
  const auto stored_bytes = static_cast<size_t>(QuantizedWeightBytes(quant, m, k));
  pack_stored_.resize(std::max(pack_stored_.size(), stored_bytes));  // new[]: 16-byte aligned
  const absl::Status s = QuantizeWeight(quant, pack_stored_.data(), pack_raw_.data(), act_, m, k);
  if (!s.ok()) return Invalid("PackMatMulWeight", s.message(), {{"w", &w}});
  return PackQuantizedWeight(quant, pack_stored_.data(), m, k, packed);
}

absl::Status CudaBackend::QuantizedMatMul(Tensor* out, const Tensor& x, const Tensor& w, const Tensor* bias) {
  constexpr const char* kOp = "MatMul";
  const auto all = {std::pair<const char*, const Tensor*>{"out", out}, {"x", &x}, {"w", &w}, {"bias", bias}};
  if (w.quant == WeightQuant::kNone || !Is(w, 2, DType::kI8)) {
    return Invalid(kOp, "an I8 w must be a weight PackMatMulWeight / PackQuantizedWeight stored quantized", all);
  }
  if (!options_.quantized_kernels) return Off(kOp, w.quant);
  const auto it = quantized_.find(w.data);
  if (it == quantized_.end() || it->second.m != w.dim(0) || it->second.k != w.dim(1) || it->second.quant != w.quant ||
      it->second.group != w.quant_group) {
    return Invalid(kOp,
                   absl::StrCat("w (", WeightQuantName(w.quant),
                                ") is not the whole of a quantized weight this backend stored; pass the tensor "
                                "PackMatMulWeight / PackQuantizedWeight made"),
                   all);
  }
  const bool out_ok = Is(*out, 2, DType::kF32) || Is(*out, 2, act_);
  if (!out_ok || !Is(x, 2, act_) || (bias != nullptr && !Is(*bias, 1, act_))) {
    return Invalid(kOp,
                   absl::StrCat("expected out [n, m] F32 or ", DTypeName(act_), ", x [n, k] and bias [m] or null ",
                                DTypeName(act_), ", w quantized [m, k]"),
                   all);
  }
  const int64_t n = x.dim(0), k = x.dim(1), m = w.dim(0);
  if (w.dim(1) != k || out->dim(0) != n || out->dim(1) != m || (bias != nullptr && bias->dim(0) != m)) {
    return Invalid(kOp, "shapes do not match", all);
  }
  if (!FitsInt(n)) return Invalid(kOp, "n exceeds cuBLAS's int range", all);
  if (n == 0) return absl::OkStatus();  // (m, k > 0: PackQuantizedWeight refuses empty weights)
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  const WeightQuant quant = w.quant;
  const int64_t group = it->second.group;  // fp8's inputs per scale (0: one a row)
  const int64_t scale_bytes = Fp8RowsLayout{m, k, group}.scale_bytes();  // int8's with group 0
  const auto* scale = static_cast<const float*>(w.data);
  const auto* q = static_cast<const uint8_t*>(w.data) + scale_bytes;
  const auto* blocks = static_cast<const Int4Group128*>(w.data);
  const int64_t groups = Int4GroupsLayout{m, k}.groups_per_row();
  const auto* mx_blocks = static_cast<const uint8_t*>(w.data);  // mxfp4: codes, then scales
  const uint8_t* mx_scales = mx_blocks + Mxfp4RowsLayout{m, k}.code_bytes();
  if (!Aligned(w.data, 8)) return Invalid(kOp, "a quantized w must be 8-byte aligned", all);

  if (n <= kGemvMaxRows && k <= kGemvMaxK) {
    // LoadX8's vector loads: runs of 8 inputs, each wholly in a row or wholly past its end.
    const bool vec_x = Aligned(x.data, 16) && k % 8 == 0;
    const bool vec_w = Aligned(q, 16) && k % 16 == 0;
    const auto grid = static_cast<unsigned>(CeilDiv(m, kGemvRows));
    const int rows = static_cast<int>(n), mi = static_cast<int>(m), ki = static_cast<int>(k);
    const bool mma = quant == WeightQuant::kInt4 && options_.int4_mma && it->second.small_zeros &&
                     act_ != DType::kF32 && k % kInt4GroupSize == 0 && Aligned(x.data, 16);
    const bool folded = quant == WeightQuant::kInt4 && options_.int4_folded && act_ != DType::kF32 && vec_x;
    return DispatchFloat(act_, [&](auto tag) -> absl::Status {
      using T = typename decltype(tag)::type;
      const T* xs = x.as<const T>();
      const T* b = bias != nullptr ? bias->as<const T>() : nullptr;
      auto launch = [&](auto* y) -> absl::Status {
        using TO = std::remove_pointer_t<decltype(y)>;
        if (quant == WeightQuant::kMxfp4) {
          return ForGemvInstance(rows, vec_x, [&](auto kn, auto kvec) -> absl::Status {
            SHARDSERVE_RETURN_IF_ERROR(Launch("Mxfp4GemvKernel", Mxfp4GemvKernel<T, TO, kn(), kvec()>, grid,
                                              kGemvThreads, y, xs, mx_blocks, mx_scales, b, rows, mi, ki, pdl_));
            return absl::OkStatus();
          });
        }
        if (quant == WeightQuant::kInt4) {
          if constexpr (sizeof(T) == 2) {
            if (mma) {
              SHARDSERVE_RETURN_IF_ERROR(Launch("Int4MmaGemvKernel", Int4MmaGemvKernel<T, TO>,
                                                static_cast<unsigned>(CeilDiv(m, kMmaRows)), kGemvThreads, y, xs,
                                                blocks, b, rows, mi, ki, static_cast<int>(groups), pdl_));
              return absl::OkStatus();
            }
            if (folded) {
              return ForGemvInstance(rows, true, [&](auto kn, auto) -> absl::Status {
                SHARDSERVE_RETURN_IF_ERROR(Launch("Int4FoldedGemvKernel", Int4FoldedGemvKernel<T, TO, kn()>,
                                                  static_cast<unsigned>(CeilDiv(m, kFoldRows)), kGemvThreads, y, xs,
                                                  blocks, b, rows, mi, ki, static_cast<int>(groups), pdl_));
                return absl::OkStatus();
              });
            }
          }
          return ForGemvInstance(rows, vec_x, [&](auto kn, auto kvec) -> absl::Status {
            SHARDSERVE_RETURN_IF_ERROR(Launch("Int4GemvKernel", Int4GemvKernel<T, TO, kn(), kvec()>, grid, kGemvThreads,
                                              y, xs, blocks, b, rows, mi, ki, static_cast<int>(groups), pdl_));
            return absl::OkStatus();
          });
        }
        return ForGemvInstance(rows, vec_w && vec_x, [&](auto kn, auto kvec) -> absl::Status {
          if (quant == WeightQuant::kInt8) {
            SHARDSERVE_RETURN_IF_ERROR(Launch("RowsGemvKernel<int8>", RowsGemvKernel<T, TO, false, kn(), kvec()>, grid,
                                              kGemvThreads, y, xs, scale, q, b, rows, mi, ki, 0, pdl_));
          } else {
            SHARDSERVE_RETURN_IF_ERROR(Launch("RowsGemvKernel<fp8>", RowsGemvKernel<T, TO, true, kn(), kvec()>, grid,
                                              kGemvThreads, y, xs, scale, q, b, rows, mi, ki, static_cast<int>(group),
                                              pdl_));
          }
          return absl::OkStatus();
        });
      };
      return out->dtype == DType::kF32 ? launch(out->as<float>()) : launch(out->as<T>());
    });
  }

  if (bias != nullptr) SHARDSERVE_RETURN_IF_ERROR(BroadcastBias(out, *bias));
  // fp8 by cuBLASLt's fp8 GEMM on x rounded to e4m3 (options_.fp8_gemm, fp8_gemm.cu), where it
  // takes the shape; else, or where it finds no algorithm, the dequantize path.
  // (Its scales are one a row: fp8 with input-group scales keeps the dequantize path.)
  if (quant == WeightQuant::kFp8 && group == 0 && Fp8GemmTakes(m, k, q, out->data)) {
    SHARDSERVE_ASSIGN_OR_RETURN(
        const bool done, Fp8Gemm(out->data, out->dtype, x.data, n, m, k, q, scale, bias != nullptr ? 1.0f : 0.0f));
    if (done) return absl::OkStatus();
  }
  // Dequantize a block of rows into the scratch, multiply it with cuBLAS into its columns of out.
  const int64_t block_rows = CudaDequantBlockRows(m, k, act_, DequantScratchLimit());
  // Grown when w was stored (PackQuantizedWeight); a no-op here unless that failed half-way.
  SHARDSERVE_RETURN_IF_ERROR(GrowDevice(&dequant_dev_, &dequant_capacity_, DequantScratchBytes(m, k)));
  const size_t out_elem = DTypeSize(out->dtype);
  for (int64_t r0 = 0; r0 < m; r0 += block_rows) {
    const int64_t rows = std::min(block_rows, m - r0);
    SHARDSERVE_RETURN_IF_ERROR(DispatchFloat(act_, [&](auto tag) -> absl::Status {
      using T = typename decltype(tag)::type;
      T* dst = reinterpret_cast<T*>(dequant_dev_);
      const unsigned grid = GridFor(rows * k, kElementwiseThreads);
      if (quant == WeightQuant::kInt4) {
        DequantInt4Kernel<T><<<grid, kElementwiseThreads, 0, stream_>>>(dst, blocks, r0, rows, k, groups);
        SHARDSERVE_CUDA_RETURN_IF_LAUNCH_ERROR("DequantInt4Kernel");
      } else if (quant == WeightQuant::kMxfp4) {
        DequantMxfp4Kernel<T><<<grid, kElementwiseThreads, 0, stream_>>>(dst, mx_blocks, mx_scales, r0, rows, k);
        SHARDSERVE_CUDA_RETURN_IF_LAUNCH_ERROR("DequantMxfp4Kernel");
      } else if (quant == WeightQuant::kInt8) {
        DequantRowsKernel<T, false><<<grid, kElementwiseThreads, 0, stream_>>>(dst, scale, q, r0, rows, k, 0);
        SHARDSERVE_CUDA_RETURN_IF_LAUNCH_ERROR("DequantRowsKernel<int8>");
      } else {
        DequantRowsKernel<T, true><<<grid, kElementwiseThreads, 0, stream_>>>(dst, scale, q, r0, rows, k, group);
        SHARDSERVE_CUDA_RETURN_IF_LAUNCH_ERROR("DequantRowsKernel<fp8>");
      }
      return absl::OkStatus();
    }));
    SHARDSERVE_RETURN_IF_ERROR(Gemm(static_cast<char*>(out->data) + static_cast<size_t>(r0) * out_elem, out->dtype, m,
                                    x.data, dequant_dev_, n, rows, k, bias != nullptr ? 1.0f : 0.0f));
  }
  return absl::OkStatus();
}

}  // namespace shardserve::cuda
