// The CPU backend's class (cpu_backend.h) outside its ops: host memory and copies, the shape check
// the ops share, and MakeCpuBackend.
#include <omp.h>
#include <sys/mman.h>

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

// From this size a buffer starts on a 2 MiB boundary and asks the kernel for transparent huge pages
// (madvise MADV_HUGEPAGE, which the default "madvise" mode of
// /sys/kernel/mm/transparent_hugepage/enabled honours; a hint, ignored where they are off). A
// decode step streams every weight once, and on 4 KiB pages each page starts a new TLB walk and a
// new hardware prefetch stream: bench_matmul's one-row float32 product of a Qwen3-MoE-sized stage
// (--layers 4 --hidden 2048 --kv 512 --mlp 6144, 2 threads) took 20.7-21.0 ms on 4 KiB pages and
// 11.6-11.8 ms on huge ones on the Zen 4 EPYC (36 against 66 GB/s; bf16 10.5 against 6.2 ms). The
// buffer's memory is not rounded up: the last partial 2 MiB stays on small pages.
constexpr size_t kHugePage = size_t{2} << 20;

}  // namespace

bool SameShape(const Tensor& a, const Tensor& b) {
  if (a.ndim != b.ndim) return false;
  for (int i = 0; i < a.ndim; ++i) {
    if (a.shape[i] != b.shape[i]) return false;
  }
  return true;
}

absl::StatusOr<Buffer> CpuBackend::Allocate(size_t bytes) {
  if (bytes > std::numeric_limits<size_t>::max() - kHugePage) {
    return absl::ResourceExhaustedError(absl::StrCat("cpu Allocate: ", bytes, " bytes is too large"));
  }
  const bool huge = bytes >= kHugePage;
  void* data = nullptr;
  // (A non-null pointer for 0 bytes too; posix_memalign takes any size.)
  if (posix_memalign(&data, huge ? kHugePage : kAlignment, std::max(bytes, kAlignment)) != 0 || data == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cpu Allocate: out of host memory for ", bytes, " bytes"));
  }
  if (huge) madvise(data, bytes / kHugePage * kHugePage, MADV_HUGEPAGE);  // a hint: its result does not matter
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
