// Seeded random draws for sampling. A draw depends only on (seed, step), never on what else is in
// the batch or on the backend, so a seeded request reproduces anywhere.
#ifndef SHARDSERVE_KERNELS_SAMPLING_H_
#define SHARDSERVE_KERNELS_SAMPLING_H_

#include <cstdint>

namespace shardserve {

// SplitMix64 (Steele, Lea, Flood 2014): a well-mixed 64-bit hash of its input.
inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A uniform float in [0, 1) for the `step`-th token of a request seeded with `seed`.
inline float SampleUniform(uint64_t seed, uint64_t step) {
  uint64_t h = SplitMix64(SplitMix64(seed) ^ (step * 0xd1b54a32d192ed03ull));
  return static_cast<float>(h >> 40) * (1.0f / 16777216.0f);  // 24 random bits
}

}  // namespace shardserve

#endif  // SHARDSERVE_KERNELS_SAMPLING_H_
