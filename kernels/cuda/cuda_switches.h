// The command-line switches of the CUDA backend's paths (CudaBackendOptions, cuda_backend.h),
// shared by the worker and generate-ids. A path that passed its op and parity tests on a GPU is on
// by default (docs/gpu.md, "CUDA paths: where they last passed") and --no-cuda-... keeps the plain
// path, to compare or to work around a fault; one not yet run on a GPU, or slower there, is off and
// --cuda-... turns it on. Ignored on cpu.
#ifndef SHARDSERVE_KERNELS_CUDA_CUDA_SWITCHES_H_
#define SHARDSERVE_KERNELS_CUDA_CUDA_SWITCHES_H_

#include <array>
#include <set>
#include <string>

#include "base/flags.h"
#include "kernels/cuda/cuda_backend.h"

namespace shardserve {

inline constexpr std::array<const char*, 5> kCudaOffSwitches = {"no-cuda-quantized-kernels", "no-cuda-graphs",
                                                                 "no-cuda-split-attention", "no-cuda-fused-kernels",
                                                                 "no-cuda-dense-gemv"};
// Paths off by default, a switch turns each on: int4 on the tensor cores passed its tests on an
// H200 but ran slower than the GEMV there; programmatic dependent launch, the fp8 GEMM, the int4
// GEMV with the zero folded out and the grouped MoE experts are not yet run on a GPU, and the fp8
// GEMM rounds x to e4m3 (inexact: opt-in for good) (docs/gpu.md).
inline constexpr std::array<const char*, 5> kCudaOnSwitches = {"cuda-int4-mma", "cuda-pdl", "cuda-fp8-gemm",
                                                               "cuda-int4-folded", "cuda-moe-grouped"};

// `switches` and all of those (each after `prefix`: launch and bench take them as
// --worker-no-cuda-... / --worker-cuda-...), for Flags::Parse.
inline std::set<std::string> WithCudaSwitches(std::set<std::string> switches, const std::string& prefix = "") {
  for (const char* name : kCudaOffSwitches) switches.insert(prefix + name);
  for (const char* name : kCudaOnSwitches) switches.insert(prefix + name);
  return switches;
}

// The usage lines of those switches (the worker's and generate-ids' --help).
inline constexpr char kCudaSwitchesUsage[] =
    "  --no-cuda-quantized-kernels  --device cuda: refuse int8 / int4 / fp8 weights (coordinator\n"
    "                           --quantization, quantized checkpoints) instead of multiplying by them\n"
    "                           with the CUDA kernels for them\n"
    "  --no-cuda-graphs         --device cuda: run every decode step op by op, not recorded once as a\n"
    "                           CUDA graph and replayed (decode steps of one token a sequence, at most\n"
    "                           64 sequences, TP = 1: worker/shard/model_shard.h)\n"
    "  --no-cuda-split-attention  --device cuda: one block a (token, head) for the whole context, in\n"
    "                           place of steps of up to 8 tokens split over the keys (ranges of 128,\n"
    "                           combined by a second kernel)\n"
    "  --no-cuda-fused-kernels  --device cuda: each residual add and the RMSNorm after it, the\n"
    "                           rotary embedding and the KV-cache write, and SwiGLU's gate and up\n"
    "                           products and its SiLU x up as separate kernels (the same bits as the\n"
    "                           fused ones)\n"
    "  --no-cuda-dense-gemv     --device cuda: multiply up to 8 rows (decode) by the act-dtype weights\n"
    "                           with cuBLAS, in place of the GEMV of our own\n"
    "  --cuda-int4-mma          --device cuda: multiply up to 8 rows (decode) by int4 weights on the\n"
    "                           tensor cores (bf16 / f16, inputs a multiple of 128); passed on an\n"
    "                           H200 but slower there than the default GEMV, so off (docs/gpu.md)\n"
    "  --cuda-pdl               --device cuda, Hopper: launch the step's kernels with programmatic\n"
    "                           dependent launch (each kernel's blocks start while the one before\n"
    "                           drains); written without a GPU, so off by default (docs/gpu.md)\n"
    "  --cuda-fp8-gemm          --device cuda, compute capability 8.9+: multiply more than 8 rows\n"
    "                           (prefill) by fp8 weights with cuBLASLt's fp8 GEMM, x rounded to e4m3\n"
    "                           per row (W8A8: inexact in x); written without a GPU (docs/gpu.md)\n"
    "  --cuda-int4-folded       --device cuda: multiply up to 8 rows (decode) by int4 weights with the\n"
    "                           zero point folded out of the GEMV's inner loop (bf16 / f16; fewer\n"
    "                           instructions a weight); written without a GPU (docs/gpu.md)\n"
    "  --cuda-moe-grouped       --device cuda: a mixture-of-experts layer's experts as one grouped\n"
    "                           GEMV reading their row counts on the device (so MoE decode steps are\n"
    "                           recorded as graphs); written without a GPU (docs/gpu.md)\n";

// CudaBackendOptions with every path that passed on a GPU on but those a --no-cuda-... switch of
// `flags` turns off, and the others on where their switch is given.
inline CudaBackendOptions CudaOptionsFromSwitches(const Flags& flags) {
  return {.quantized_kernels = !flags.Has("no-cuda-quantized-kernels"),
          .step_graphs = !flags.Has("no-cuda-graphs"),
          .split_attention_keys = flags.Has("no-cuda-split-attention") ? 0 : kCudaSplitAttentionKeys,
          .fused_kernels = !flags.Has("no-cuda-fused-kernels"),
          .dense_gemv = !flags.Has("no-cuda-dense-gemv"),
          .int4_mma = flags.Has("cuda-int4-mma"),
          .pdl = flags.Has("cuda-pdl"),
          .fp8_gemm = flags.Has("cuda-fp8-gemm"),
          .int4_folded = flags.Has("cuda-int4-folded"),
          .moe_grouped = flags.Has("cuda-moe-grouped")};
}

}  // namespace shardserve

#endif  // SHARDSERVE_KERNELS_CUDA_CUDA_SWITCHES_H_
