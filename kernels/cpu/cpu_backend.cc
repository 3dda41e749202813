// The CPU backend's class (cpu_backend.h) outside its ops: host memory and copies, the shape check
// the ops share, and MakeCpuBackend.
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/isa_cap.h"
#include "kernels/cpu/quant_isa.h"

namespace shardserve {
namespace cpu {
namespace {

// 64 bytes: a cache line, and the widest SIMD register (AVX-512), so aligned vector loads never
// split lines.
constexpr size_t kAlignment = 64;

}  // namespace

bool SameShape(const Tensor& a, const Tensor& b) {
  if (a.ndim != b.ndim) return false;
  for (int i = 0; i < a.ndim; ++i) {
    if (a.shape[i] != b.shape[i]) return false;
  }
  return true;
}

absl::StatusOr<Buffer> CpuBackend::Allocate(size_t bytes) {
  // aligned_alloc wants a size that is a multiple of the alignment (and we want a non-null
  // pointer for 0 bytes too).
  if (bytes > std::numeric_limits<size_t>::max() - kAlignment) {
    return absl::ResourceExhaustedError(absl::StrCat("cpu Allocate: ", bytes, " bytes is too large"));
  }
  const size_t rounded = std::max(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  void* data = std::aligned_alloc(kAlignment, rounded);
  if (data == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cpu Allocate: out of host memory for ", bytes, " bytes"));
  }
  return Buffer(this, data, bytes);
}

absl::Status CpuBackend::Copy(const char* op, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr || src == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": null pointer for ", bytes, " bytes"));
  }
  std::memmove(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::Fill0(void* dst, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr) return absl::InvalidArgumentError(absl::StrCat("Fill0: null pointer for ", bytes, " bytes"));
  std::memset(dst, 0, bytes);
  return absl::OkStatus();
}

}  // namespace cpu

std::unique_ptr<Backend> MakeCpuBackend(int threads, CpuMatMul matmul) {
  return std::make_unique<cpu::CpuBackend>(threads > 0 ? threads : omp_get_max_threads(), matmul);
}

CpuActivationQuant DefaultCpuActivationQuant() {
  // int16 wherever it runs (AVX-512 VNNI): measured faster served than the exact int4 products on
  // the Intel Xeons with AMX and on the Zen 4 EPYC (docs/performance.md).
  return cpu::QuantIsaSupported(cpu::QuantIsa::kAvx512Vnni) ? CpuActivationQuant::kInt16 : CpuActivationQuant::kNone;
}

absl::StatusOr<CpuActivationQuant> ParseCpuActivationQuant(const std::string& name) {
  if (name == "auto") return DefaultCpuActivationQuant();
  if (name == "none") return CpuActivationQuant::kNone;
  if (name == "int8") return CpuActivationQuant::kInt8;
  if (name == "int16") return CpuActivationQuant::kInt16;
  return absl::InvalidArgumentError(
      absl::StrCat("activation-quantization must be auto, none, int8 or int16, got '", name, "'"));
}

const char* CpuActivationQuantName(CpuActivationQuant act) {
  switch (act) {
    case CpuActivationQuant::kInt8: return "int8";
    case CpuActivationQuant::kInt16: return "int16";
    case CpuActivationQuant::kNone: break;
  }
  return "none";
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCpuBackend(int threads, CpuMatMul matmul, CpuActivationQuant act) {
  if (absl::Status cap = cpu::CheckIsaCapSetting(); !cap.ok()) return cap;
  if (act == CpuActivationQuant::kInt8 && !cpu::Int8ActivationsIsa().has_value()) {
    // No fall back: the flag asks for llama.cpp's arithmetic, and a silent exact run would be
    // another model's figures.
    return absl::FailedPreconditionError(absl::StrCat(
        "--activation-quantization int8 runs the int8/int4 products on AVX-512 VNNI or AVX2, which this CPU lacks (",
        cpu::QuantizedKernelsDescription(), "); run without it (none: the exact products)"));
  }
  if (act == CpuActivationQuant::kInt16 && !cpu::QuantIsaSupported(cpu::QuantIsa::kAvx512Vnni)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--activation-quantization int16 runs the int4 products on AVX-512 VNNI, which this CPU lacks (",
        cpu::QuantizedKernelsDescription(), "); run without it (none: the exact products) or with int8"));
  }
  return std::make_unique<cpu::CpuBackend>(threads > 0 ? threads : omp_get_max_threads(), matmul, act);
}

}  // namespace shardserve
