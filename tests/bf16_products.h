// What this CPU offers the CPU backend's bf16 products (CpuMatMul::kBF16), read from CPUID
// (the compiler's __builtin_cpu_supports, which also checks that the OS saves the AVX-512
// registers) and never from oneDNN or the backend, whose answers are what the tests check:
// oneDNN multiplies bf16 on AVX-512 CPUs (natively with AVX512-BF16, which AMX CPUs have too;
// emulated without it) and not on older ones (AVX2), where PackMatMulWeight must refuse with
// FailedPrecondition naming bf16. Tests of bf16 products run wherever the CPU has AVX-512, so
// that oneDNN or the backend refusing them there is a failure, and skip only where it has not.
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
// messages: a cap makes oneDNN refuse what the CPU has, which these tests report as a failure.
inline std::string OneDnnIsaCap() {
  std::string cap;
  for (const char* name : {"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"}) {
    if (const char* value = std::getenv(name); value != nullptr) cap += std::string(" (") + name + "=" + value + ")";
  }
  return cap;
}

// Whether tests of bf16 products run here. Where CPUID shows AVX-512, they must: the backend
// packing a bf16 weight is checked, and its refusal is a failure (and they run on, to fail
// further). Where it does not, the backend must refuse as documented (FailedPrecondition naming
// bf16, also checked) and they are skipped; should it multiply bf16 all the same (a later oneDNN
// on a CPU with other bf16 instructions), they run.
inline bool CpuRunsBf16Products() {
  std::unique_ptr<Backend> backend = MakeCpuBackend(1, CpuMatMul::kBF16);
  std::vector<float> w(16 * 16, 1.0f);
  Tensor packed;
  const absl::StatusOr<Buffer> buffer = backend->PackMatMulWeight(Tensor(w.data(), DType::kF32, {16, 16}), &packed);
  if (CpuHasAvx512Core()) {
    EXPECT_TRUE(buffer.ok()) << "this CPU has AVX-512 (CPUID), so the CPU backend must multiply bf16, but: "
                             << buffer.status() << OneDnnIsaCap();
    return true;
  }
  if (buffer.ok()) return true;
  EXPECT_EQ(buffer.status().code(), absl::StatusCode::kFailedPrecondition) << buffer.status();
  EXPECT_NE(std::string(buffer.status().message()).find("bf16"), std::string::npos) << buffer.status();
  return false;
}

inline constexpr char kNoBf16Products[] = "this CPU has no AVX-512 (CPUID), which oneDNN's bf16 products need";

}  // namespace shardserve

#endif  // SHARDSERVE_TESTS_BF16_PRODUCTS_H_
