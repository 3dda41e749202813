// What this CPU offers the CPU backend's bf16 products (CpuMatMul::kBF16), read from CPUID
// (the compiler's __builtin_cpu_supports, which also checks that the OS saves the AVX-512
// registers) and never from oneDNN or the backend, whose answers are what the tests check:
// oneDNN multiplies bf16 on AVX-512 CPUs (natively with AVX512-BF16, which AMX CPUs have too;
// emulated without it); on older ones (AVX2) the backend multiplies bf16 on its own bf16 panels
// (kernels/cpu/panel_matmul.h). Tests of bf16 products run on every CPU: a refusal is a failure.
#ifndef SHARDSERVE_TESTS_BF16_PRODUCTS_H_
#define SHARDSERVE_TESTS_BF16_PRODUCTS_H_

#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/tensor.h"

namespace shardserve {

// AVX-512 as oneDNN's avx512_core ISA needs it (F, BW, VL and DQ): the least on which oneDNN
// multiplies bf16, and what PackMatMulWeight's refusal says bf16 products need.
inline bool CpuHasAvx512Core() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;  // not x86: tests of bf16 products run where the backend packs them (below)
#endif
}

// AVX512-BF16 on top of that (oneDNN's avx512_core_bf16 ISA, which its AMX ISAs include): bf16
// products in bf16 instructions, what CpuHasNativeBf16MatMul() reports.
inline bool CpuHasBf16Instructions() {
#if defined(__x86_64__) || defined(__i386__)
  return CpuHasAvx512Core() && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// A oneDNN ISA cap (DNNL_MAX_CPU_ISA, ONEDNN_MAX_CPU_ISA) in the environment, for failure
// messages: under a cap oneDNN, and the backend's own products with it (kernels/cpu/isa_cap.h), do
// less than CPUID shows, so tests that expect what CPUID shows fail, and say why. The capped
// dispatch has tests of its own (ctest kernels_cpu_avx2_cap, llama_parity_avx2_cap).
inline std::string OneDnnIsaCap() {
  std::string cap;
  for (const char* name : {"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"}) {
    if (const char* value = std::getenv(name); value != nullptr) cap += std::string(" (") + name + "=" + value + ")";
  }
  return cap;
}

// Whether tests of bf16 products run here: on every CPU, where the backend must pack a bf16 weight
// (oneDNN's layout on AVX-512 CPUs, its bf16 panels elsewhere). A refusal fails the calling test,
// which then skips the rest.
inline bool CpuRunsBf16Products() {
  std::unique_ptr<Backend> backend = MakeCpuBackend(1, CpuMatMul::kBF16);
  std::vector<float> w(16 * 16, 1.0f);
  Tensor packed;
  const absl::StatusOr<Buffer> buffer = backend->PackMatMulWeight(Tensor(w.data(), DType::kF32, {16, 16}), &packed);
  EXPECT_TRUE(buffer.ok()) << "the CPU backend multiplies bf16 on every CPU ("
                           << (CpuHasAvx512Core() ? "oneDNN's products: CPUID shows AVX-512" : "its bf16 panels")
                           << "), but: " << buffer.status() << OneDnnIsaCap();
  return buffer.ok();
}

inline constexpr char kNoBf16Products[] = "the CPU backend refused to pack a bf16 weight (a failure, reported above)";

}  // namespace shardserve

#endif  // SHARDSERVE_TESTS_BF16_PRODUCTS_H_
