// The switches that turn the CUDA backend's paths off, shared by the worker and generate-ids: each
// path is on by default since it passed its op and parity tests on a GPU (docs/gpu.md, "CUDA
// paths: where they last passed"); --no-cuda-... keeps the plain path, to compare or to work
// around a fault. Ignored on cpu.
#pragma once

#include <array>
#include <set>
#include <string>

#include "base/flags.h"
#include "kernels/backend.h"

namespace shardserve {

inline constexpr std::array<const char*, 4> kCudaOffSwitches = {"no-cuda-quantized-kernels", "no-cuda-graphs",
                                                                 "no-cuda-split-attention", "no-cuda-fused-kernels"};

// `switches` and those (each after `prefix`: launch and bench take them as --worker-no-cuda-...),
// for Flags::Parse.
inline std::set<std::string> WithCudaOffSwitches(std::set<std::string> switches, const std::string& prefix = "") {
  for (const char* name : kCudaOffSwitches) switches.insert(prefix + name);
  return switches;
}

// The usage lines of those switches (the worker's and generate-ids' --help).
inline constexpr char kCudaOffSwitchesUsage[] =
    "  --no-cuda-quantized-kernels  --device cuda: refuse int8 / int4 / fp8 weights (coordinator\n"
    "                           --quantization, quantized checkpoints) instead of multiplying by them\n"
    "                           with the CUDA kernels for them\n"
    "  --no-cuda-graphs         --device cuda: run every decode step op by op, not recorded once as a\n"
    "                           CUDA graph and replayed (decode steps of one token a sequence, at most\n"
    "                           64 sequences, TP = 1: worker/llama.h)\n"
    "  --no-cuda-split-attention  --device cuda: one block a (token, head) for the whole context, in\n"
    "                           place of steps of up to 8 tokens split over the keys (ranges of 128,\n"
    "                           combined by a second kernel)\n"
    "  --no-cuda-fused-kernels  --device cuda: each residual add and the RMSNorm after it as two\n"
    "                           kernels (the same bits as the one fused kernel)\n";

// CudaBackendOptions with every path on but those a --no-cuda-... switch of `flags` turns off.
inline CudaBackendOptions CudaOptionsFromSwitches(const Flags& flags) {
  return {.quantized_kernels = !flags.Has("no-cuda-quantized-kernels"),
          .step_graphs = !flags.Has("no-cuda-graphs"),
          .split_attention_keys = flags.Has("no-cuda-split-attention") ? 0 : kCudaSplitAttentionKeys,
          .fused_kernels = !flags.Has("no-cuda-fused-kernels")};
}

}  // namespace shardserve
