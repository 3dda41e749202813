// The arithmetic of the CUDA int4 GEMV with the zero point folded out of its loop
// (kernels/cuda/quant_matmul.cu's Int4FoldedGemvKernel, CudaBackendOptions::int4_folded): one
// thread's share of one Int4Group128 (kernels/quant.h) times one row of x. Header-only for host and
// device code (nvcc sees __host__ __device__, as kernels/counter_uniform.h), so that the CPU's tests
// run the kernel's own arithmetic against DequantizeInt4Groups (tests/kernels_cuda_test.cc,
// Int4FoldedArithmetic), where no GPU is.
//
// A code q (0..15) is made the float 0.5 + q / 256 (0x3F000000 | q << 16: the nibble lands in
// 0.5's mantissa, exact) by one byte permute, and multiplied into d = sum (0.5 + q / 256) x at once.
// With sx = sum x over the same inputs, sum (q - zero) x = 256 (d - (0.5 + zero / 256) sx): the
// zero point comes off once a group (one fused multiply-add), not once a code as in the default GEMV
// (a byte permute, a subtraction and a multiply-add a code). Not exact as that one is: d carries
// 0.5 sum x beside the codes' sums, so its float32 rounding is about 2^-21 of sum |x| where the
// products are about 2^-7 of it (|q - zero| ~ 4 of 256): the result moves by about 2^-14 of the
// products' magnitude (the test bounds it at 2^-12), far inside a bf16 or f16 output's rounding.
//
// Thread p (0..7) of a group takes its 8-byte word p of codes (bytes 8 p .. 8 p + 7 of q): the low
// nibbles are inputs 8 p + [0, 8) of the group, the high ones 64 + 8 p + [0, 8) (q's layout).
#ifndef SHARDSERVE_KERNELS_INT4_FOLDED_H_
#define SHARDSERVE_KERNELS_INT4_FOLDED_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SHARDSERVE_FOLDED_FN __host__ __device__ __forceinline__
#else
#define SHARDSERVE_FOLDED_FN inline
#endif

namespace shardserve {

// 0.5 + q / 256, q the byte t (0..3) of `lows` (every byte below 16): on the GPU one byte permute
// of that byte under 0x3F000000 (0.5).
SHARDSERVE_FOLDED_FN float FoldedCode(uint32_t lows, int t) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(__byte_perm(lows, 0x3F000000u, 0x7044u | (static_cast<uint32_t>(t) << 8)));
#else
  const uint32_t bits = 0x3F000000u | (((lows >> (8 * t)) & 0xFFu) << 16);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// w[j] = 0.5 + q / 256 for the sixteen codes of a thread's word (lo: its bytes 0-3, hi: 4-7):
// j < 8 the low nibbles (inputs 8 p + j), j >= 8 the high ones (inputs 64 + 8 p + j - 8).
SHARDSERVE_FOLDED_FN void FoldedCodes(uint32_t lo, uint32_t hi, float (&w)[16]) {
  const uint32_t lows[4] = {lo & 0x0F0F0F0Fu, hi & 0x0F0F0F0Fu, (lo >> 4) & 0x0F0F0F0Fu, (hi >> 4) & 0x0F0F0F0Fu};
  for (int j = 0; j < 16; ++j) w[j] = FoldedCode(lows[j / 4], j % 4);
}

// sum x over a thread's sixteen inputs, in one fixed tree.
SHARDSERVE_FOLDED_FN float FoldedSumX(const float (&x)[16]) {
  float s[8];
  for (int j = 0; j < 8; ++j) s[j] = x[2 * j] + x[2 * j + 1];
  for (int j = 0; j < 4; ++j) s[j] += s[j + 4];
  return (s[0] + s[2]) + (s[1] + s[3]);
}

// A group's header as the fold uses it: its scale times 256 (exact) and 0.5 + zero / 256 (exact).
SHARDSERVE_FOLDED_FN float FoldedScale(float scale) { return scale * 256.0f; }
SHARDSERVE_FOLDED_FN float FoldedZero(uint32_t zero) { return fmaf(static_cast<float>(zero), 1.0f / 256.0f, 0.5f); }

// acc + scale x sum (q - zero) x over a thread's sixteen inputs: w from FoldedCodes, sx =
// FoldedSumX(x), scale256 = FoldedScale(scale), cz = FoldedZero(zero).
SHARDSERVE_FOLDED_FN float FoldedAccumulate(const float (&w)[16], const float (&x)[16], float sx, float scale256,
                                            float cz, float acc) {
  float d = 0.0f;
  for (int j = 0; j < 16; ++j) d = fmaf(w[j], x[j], d);
  return fmaf(scale256, fmaf(-cz, sx, d), acc);
}

}  // namespace shardserve

#undef SHARDSERVE_FOLDED_FN

#endif  // SHARDSERVE_KERNELS_INT4_FOLDED_H_
