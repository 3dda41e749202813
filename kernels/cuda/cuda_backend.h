// The CUDA backend's own header, beside the interface (kernels/backend.h): MakeCudaBackend and the
// switches of its paths (CudaBackendOptions); the command-line switches of the worker and
// generate-ids that set them are cuda_switches.h. Plain C++17 (the .cu files include it through
// cuda_backend.cuh, the backend's class, internal to kernels/cuda/); included with or without CUDA:
// cuda_backend.cu defines MakeCudaBackend, no_cuda.cc where SHARDSERVE_WITH_CUDA is OFF.
#ifndef SHARDSERVE_KERNELS_CUDA_CUDA_BACKEND_H_
#define SHARDSERVE_KERNELS_CUDA_CUDA_BACKEND_H_

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/tensor.h"

namespace shardserve {

// Paths of the CUDA backend, each off in a backend made without its option; the worker and
// generate-ids turn each on unless a --no-cuda-... switch says otherwise (cuda_switches.h),
// once it has passed its tests on a GPU (docs/gpu.md, "CUDA paths: where they last passed").
struct CudaBackendOptions {
  // Int8, int4 and fp8 weights (PackMatMulWeight / PackQuantizedWeight with a WeightQuant, and
  // MatMul by them: kernels/cuda/quant_matmul.cu). Off: those are refused with Unimplemented, as
  // before the kernels existed (worker --no-cuda-quantized-kernels). Passed on an H200 (2026-11-28).
  bool quantized_kernels = false;
  // Step graphs (Backend::BeginGraph / EndGraph / RunGraph as CUDA graphs: stream capture, then
  // cudaGraphLaunch), which ModelShard records for decode steps. Off: records_graphs() is false and
  // BeginGraph is refused (worker --no-cuda-graphs). Passed on an H200 (2026-11-28).
  bool step_graphs = false;
  // Split-KV ("flash-decoding") attention: for steps of at most 8 tokens each (token, head)'s keys
  // are split into ranges of at least this many keys (at most 64 ranges), one block each, their
  // partial softmax sums combined by a second kernel, so that a batch-1 decode uses more than
  // q_heads blocks. 0: one block per (token, head) (worker --no-cuda-split-attention; the worker's
  // default is kCudaSplitAttentionKeys). Passed on an H200 (2026-11-28).
  int split_attention_keys = 0;
  // Fused kernels, each giving the same bits as the ops it replaces: AddRmsNorm as one kernel (the
  // residual add and the next norm in one pass over the row), RopeCacheWrite as one kernel (the
  // rotated keys and the values written to the cache by the threads that rotate them) and, with
  // dense_gemv, GateUpSilu as one dense GEMV launch (each block a row of gate and of up, then silu x
  // up). Off: worker --no-cuda-fused-kernels. Passed on an H200 (2026-11-28; the last two since the
  // second run that day).
  bool fused_kernels = false;
  // The dense GEMV (kernels/cuda/gemv.cu): MatMul by a weight in the act dtype for up to 8 rows of
  // x (decode) with a kernel of our own instead of cuBLAS's split-K kernels. Off: worker
  // --no-cuda-dense-gemv. Passed on an H200 (2026-11-28).
  bool dense_gemv = false;
  // MatMul by int4 weights for up to 8 rows of x (decode) on the tensor cores (quant_matmul.cu's
  // Int4MmaGemvKernel: mma.sync on each group's codes less its zero, exact in the 16-bit act dtype,
  // with float32 sums) in place of the GEMV that makes each code a float. bf16 / f16 act dtypes, k a
  // multiple of 128; other shapes keep that GEMV. Worker --cuda-int4-mma. Passed on an H200
  // (2026-11-28) but slower there than the GEMV: off (docs/gpu.md).
  bool int4_mma = false;
  // Programmatic dependent launch (Hopper, sm_90 and up; ignored below): the decode step's kernels
  // launched with cudaLaunchAttributeProgrammaticStreamSerialization, so that a kernel's blocks
  // start while the one before it drains; each waits (griddepcontrol.wait) before it reads or
  // writes anything an earlier kernel touches, and the GEMVs first ask L2 for their first weights,
  // which no kernel writes. Worker --cuda-pdl. Written without a GPU; off until it passes on one
  // (docs/gpu.md).
  bool pdl = false;
  // fp8 weights' products for more than 8 rows of x (prefill) through cuBLASLt's fp8 GEMM on GPUs
  // of compute capability 8.9+ (kernels/cuda/fp8_gemm.cu): x's rows rounded to e4m3 with a scale
  // each (W8A8: inexact in x, each input moving by up to 2^-4 of itself), in place of the weight
  // dequantized to the act dtype and cuBLAS. Ignored below 8.9. Worker --cuda-fp8-gemm. Written
  // without a GPU; off until it passes on one (docs/gpu.md), and opt-in after that (inexact).
  bool fp8_gemm = false;
  // MatMul by int4 weights for up to 8 rows of x (decode) with the zero point folded out of the
  // inner loop (quant_matmul.cu's Int4FoldedGemvKernel: a byte permute and a multiply-add a code
  // where the default GEMV spends a subtraction more, four output rows a block; not exact in the
  // last bits as that one is: about 2^-14 of the products' magnitude). bf16 / f16 act dtypes, x
  // 16-byte aligned and k a multiple of 8; int4_mma, where it takes a shape, first. Worker
  // --cuda-int4-folded. Written without a GPU (2026-11-29): off until it passes on one.
  bool int4_folded = false;
  // MoeExperts (a mixture-of-experts layer's experts on their grouped rows) as a grouped GEMV that
  // reads the experts' row offsets on the device (moe.cu's GroupedGemvKernel: a block per expert,
  // product and 8 output columns, a warp a column, the expert's rows 4 at a time; gate and up in
  // one launch, then SiluMul or ClampedSwiGlu over the rows, then down_proj), in place of the host
  // loop of one product per expert; so records_moe_experts() is true and step graphs record MoE
  // decode steps. Weights in the act dtype (quantized experts keep the loop, and a step graph that
  // meets it is refused and graphs turned off). Not exact as the loop's cuBLAS / GEMV products
  // (another summation order). Worker --cuda-moe-grouped. Written without a GPU (2026-12-04): off
  // until it passes on one.
  bool moe_grouped = false;
  // The most device memory MatMul by a quantized weight uses for the weight's dequantized rows on
  // its cuBLAS path (more than 8 rows of x), a block of rows at a time; 0: kCudaDequantScratchBytes.
  // (Tests set a few KiB to cover several blocks.)
  size_t quantized_scratch_bytes = 0;
};

// The keys per range of the worker's split attention (CudaBackendOptions::split_attention_keys):
// one 128-key chunk of the attention kernel.
inline constexpr int kCudaSplitAttentionKeys = 128;

// The CUDA backend on device `ordinal`, with activations in `act` (F32, F16 or BF16).
// Unavailable when built without CUDA or when no GPU is present; the status says which.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int ordinal, DType act, const CudaBackendOptions& options = {});

}  // namespace shardserve

#endif  // SHARDSERVE_KERNELS_CUDA_CUDA_BACKEND_H_
