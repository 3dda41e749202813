// Whether this CPU runs the CPU backend's bf16 products (CpuMatMul::kBF16), for tests of them to
// skip where it does not. oneDNN has them on AVX-512 CPUs (natively with AVX512-BF16 or AMX) and
// not on older ones (AVX2), where PackMatMulWeight must refuse with FailedPrecondition naming
// bf16: checked here, so that a skip never hides some other failure.
#ifndef SHARDSERVE_TESTS_BF16_PRODUCTS_H_
#define SHARDSERVE_TESTS_BF16_PRODUCTS_H_

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/tensor.h"

namespace shardserve {

inline bool CpuRunsBf16Products() {
  std::unique_ptr<Backend> backend = MakeCpuBackend(1, CpuMatMul::kBF16);
  std::vector<float> w(16 * 16, 1.0f);
  Tensor packed;
  const absl::StatusOr<Buffer> buffer = backend->PackMatMulWeight(Tensor(w.data(), DType::kF32, {16, 16}), &packed);
  if (buffer.ok()) return true;
  EXPECT_EQ(buffer.status().code(), absl::StatusCode::kFailedPrecondition) << buffer.status();
  EXPECT_NE(std::string(buffer.status().message()).find("bf16"), std::string::npos) << buffer.status();
  return false;
}

inline constexpr char kNoBf16Products[] = "oneDNN has no bf16 products on this CPU (they need AVX-512)";

}  // namespace shardserve

#endif  // SHARDSERVE_TESTS_BF16_PRODUCTS_H_
