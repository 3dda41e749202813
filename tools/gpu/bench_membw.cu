// The read bandwidth a plain streaming kernel reaches on this GPU: the roofline issue 29's decode
// figures are held against (tools/gpu/gpu-bench.sh builds this with the GPU machine's own nvcc and runs
// it in the same command as the benchmarks).
//
//   nvcc -O3 -arch=native -o bench_membw tools/gpu/bench_membw.cu && ./bench_membw [GIB] [REPS]
//
// Reads a buffer of GIB GiB (default 4: far beyond any L2) REPS times (default 20) with 16-byte
// loads, each thread summing what it read so that no load can be dropped, and prints one JSON
// object: the device, the buffer, the best and median GB/s (1e9 bytes/s, as datasheets count),
// each timed with CUDA events. Exit 1 on any CUDA error, naming the call.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                                                 \
  do {                                                                                              \
    cudaError_t e_ = (call);                                                                        \
    if (e_ != cudaSuccess) {                                                                        \
      std::fprintf(stderr, "bench_membw: %s failed: %s\n", #call, cudaGetErrorString(e_));          \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (0)

// Each thread reads a grid-strided run of 16-byte words and folds them into one value; one word
// per block is written, so the reads are live and the writes negligible.
__global__ void ReadKernel(const uint4* __restrict__ in, size_t n, unsigned* __restrict__ out) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(in + i);  // streaming: no reuse expected
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  __shared__ unsigned block_acc;
  if (threadIdx.x == 0) block_acc = 0;
  __syncthreads();
  atomicXor(&block_acc, acc);
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = block_acc;
}

int main(int argc, char** argv) {
  const double gib = argc > 1 ? std::atof(argv[1]) : 4.0;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 20;
  if (!(gib > 0 && gib <= 64) || reps < 1 || reps > 1000) {
    std::fprintf(stderr, "usage: bench_membw [GIB in (0, 64]] [REPS in 1..1000]\n");
    return 2;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const size_t bytes = static_cast<size_t>(gib * (1ull << 30)) / sizeof(uint4) * sizeof(uint4);
  const size_t n = bytes / sizeof(uint4);
  const int threads = 512;
  const int blocks = prop.multiProcessorCount * 4;  // enough loads in flight to cover the latency
  uint4* in = nullptr;
  unsigned* out = nullptr;
  CHECK(cudaMalloc(&in, bytes));
  CHECK(cudaMalloc(&out, blocks * sizeof(unsigned)));
  CHECK(cudaMemset(in, 1, bytes));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  ReadKernel<<<blocks, threads>>>(in, n, out);  // warm-up
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<double> gbps;
  for (int r = 0; r < reps; ++r) {
    CHECK(cudaEventRecord(start));
    ReadKernel<<<blocks, threads>>>(in, n, out);
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    CHECK(cudaGetLastError());
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    gbps.push_back(static_cast<double>(bytes) / (ms * 1e-3) / 1e9);
  }
  std::sort(gbps.begin(), gbps.end());
  int clock_khz = 0, bus_bits = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, 0));
  CHECK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, 0));
  std::printf(
      "{\"device\": \"%s\", \"sms\": %d, \"buffer_bytes\": %zu, \"reps\": %d, \"best_gbps\": %.1f, "
      "\"median_gbps\": %.1f, \"peak_from_clocks_gbps\": %.1f}\n",
      prop.name, prop.multiProcessorCount, bytes, reps, gbps.back(), gbps[gbps.size() / 2],
      2.0 * clock_khz * 1e3 * bus_bits / 8 / 1e9);
  CHECK(cudaFree(in));
  CHECK(cudaFree(out));
  return 0;
}
