// The cap on the instruction sets the CPU kernels pick at run time. oneDNN reads one from the
// environment, ONEDNN_MAX_CPU_ISA (or its older name DNNL_MAX_CPU_ISA), and the CPU backend's own
// products follow the same setting, so that one variable caps both: with ONEDNN_MAX_CPU_ISA=AVX2 on
// an AVX-512 CPU, oneDNN's JIT and every product of ours (float32 and bf16 panels, the bf16 blocked
// product, int8, fp8 and int4: panel_matmul.h PanelTilesSupported, quant_isa.h QuantIsaSupported,
// bf16_matmul.h CpuHasAvx512Bf16) take the instances an AVX2-only CPU takes. Uses: a like-for-like
// run beside a peer built for AVX2 (docs/performance.md), and testing the AVX2 paths end to end on an
// AVX-512 machine (ctest llama_parity_avx2_cap).
//
// What it does not reach: the loops compiled as GCC target clones (kernels/host_vec.h SHARDSERVE_VECTOR_CLONES:
// attention, RMSNorm, RoPE, the elementwise ops), whose clone the loader picks by CPUID alone.
//
// Thread-safety: all functions may be called from any thread. oneDNN fixes its cap at its first
// query, so setting the variable after the process has started changes nothing but
// CheckIsaCapSetting's answer.
#ifndef SHARDSERVE_KERNELS_CPU_ISA_CAP_H_
#define SHARDSERVE_KERNELS_CPU_ISA_CAP_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace shardserve::cpu {

// The instruction-set levels the CPU kernels dispatch on, each with oneDNN's name for it.
enum class IsaLevel : uint8_t {
  kAvx2,        // AVX2 + FMA ("AVX2")
  kAvx512,      // AVX-512 F/BW/VL/DQ/CD ("AVX512_CORE")
  kAvx512Vnni,  // and VNNI ("AVX512_CORE_VNNI")
  kAvx512Bf16,  // and BF16 ("AVX512_CORE_BF16")
};

// Whether the cap lets the kernels use `level` (oneDNN's effective ISA includes it). It says
// nothing of the CPU beyond that: oneDNN's effective ISA is never above the CPU's, but the callers
// check the CPU's own bits too, as before the cap.
bool IsaCapAllows(IsaLevel level);

// OK, or InvalidArgument naming the variable and its value when ONEDNN_MAX_CPU_ISA or
// DNNL_MAX_CPU_ISA holds a value that is not one of oneDNN's ISA names (oneDNN ignores such a
// value without a word, capping nothing). MakeCpuBackend(threads, matmul, act) returns it.
absl::Status CheckIsaCapSetting();

// For the worker's log: "" when neither variable is set, else ", within ONEDNN_MAX_CPU_ISA=<value>:
// <oneDNN's effective ISA>" (or DNNL_MAX_CPU_ISA), e.g. ", within ONEDNN_MAX_CPU_ISA=avx2: AVX2".
std::string IsaCapNote();

}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_ISA_CAP_H_
