// The host CPU's vectors: 8 floats in a GCC vector extension (one AVX2 register, half an AVX-512
// one), in functions cloned per instruction set, since the build targets baseline x86-64. Used by
// the CPU backend's kernels (kernels/cpu/) and by the weight quantizers (quant.cc), which run on
// the host whichever backend holds the weights; so this header is not the CPU backend's, and its
// namespace (cpu) names the host's processor.
//
// Why 8 and not 16 floats: GCC 12 has no register mode for a 16-float vector without AVX-512, so
// on AVX2 it keeps one that lives across loop iterations (an accumulator) on the stack and moves it
// through memory on every step. Measured on an AMD EPYC (AVX2): float32 products 7 GFLOP/s with
// 16-float accumulators against 80 with 8-float ones; attention 4-8x slower
// (bench_attention). Loops that want 16 lanes (attention's dot products) use two halves.
#ifndef SHARDSERVE_KERNELS_HOST_VEC_H_
#define SHARDSERVE_KERNELS_HOST_VEC_H_

#include <cstdint>
#include <cstring>

namespace shardserve::cpu {

using Vec8 = float __attribute__((vector_size(32)));
using Vec8i = int32_t __attribute__((vector_size(32)));
inline constexpr int64_t kVecLanes = 8;

// Clones for AVX-512 (x86-64-v4) and AVX2 + FMA (x86-64-v3) CPUs, and baseline x86-64, chosen at
// load by the CPU. ("avx2" alone would leave out FMA: a multiply and an add.) Which clone runs is
// fixed per machine, so a result is too. The helpers below are always inlined into the clones, so
// that a vector never crosses a call (kernels/CMakeLists.txt silences GCC's -Wpsabi note that a
// vector's calling convention differs between targets).
//
// ThreadSanitizer builds (tools/ci/sanitize.sh tsan) have no clones, only the baseline code: the
// clones' resolver (an IFUNC) runs while the dynamic loader relocates the program, before the TSan
// runtime is initialized, and its instrumentation then crashed every program that links the
// kernels (SIGSEGV in SoftmaxRow's resolver, before main).
//
// Clang builds (the fuzz targets and CI's ASan + UBSan programs: tools/ci/fuzz.sh) have no clones
// either: clang 14 refuses an 8-float vector passed by value or returned between a clone (AVX
// enabled) and the helpers below (compiled for the file's baseline), although always_inline means
// no call is ever made; GCC only notes it (-Wpsabi).
#if defined(__SANITIZE_THREAD__) || defined(__clang__)
#define SHARDSERVE_VECTOR_CLONES
#else
#define SHARDSERVE_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif

// Loads 8 floats at p, or only the first `count` of them (none when count <= 0), the other lanes
// zero. The fixed-size copy compiles to one vector move.
[[gnu::always_inline]] inline Vec8 LoadVec(const float* p, int64_t count = kVecLanes) {
  Vec8 v = {};
  if (count >= kVecLanes) {
    std::memcpy(&v, p, sizeof v);
  } else if (count > 0) {
    std::memcpy(&v, p, static_cast<size_t>(count) * sizeof(float));
  }
  return v;
}

// Stores v's 8 floats at p, or only the first `count` of them (none when count <= 0).
[[gnu::always_inline]] inline void StoreVec(float* p, const Vec8& v, int64_t count = kVecLanes) {
  if (count >= kVecLanes) {
    std::memcpy(p, &v, sizeof v);
  } else if (count > 0) {
    std::memcpy(p, &v, static_cast<size_t>(count) * sizeof(float));
  }
}

// v with the lanes from `count` on set to `fill`.
[[gnu::always_inline]] inline Vec8 KeepLanes(Vec8 v, int64_t count, float fill) {
  const Vec8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
  return lane < static_cast<int32_t>(count < kVecLanes ? count : kVecLanes) ? v : Vec8{} + fill;
}

}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_HOST_VEC_H_
