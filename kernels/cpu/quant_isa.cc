#include "kernels/cpu/quant_isa.h"

#include <atomic>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/isa_cap.h"

namespace shardserve::cpu {
namespace {

// -1: no override; else a QuantIsa.
std::atomic<int> g_override{-1};

// Whether the CPU (and its OS) has `isa`'s instructions, whatever the cap.
bool CpuHas(QuantIsa isa) {
  __builtin_cpu_init();
  // libgcc's answers include the OS's: AVX-512 only where XCR0 enables the zmm state.
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  switch (isa) {
    case QuantIsa::kPortable: return true;
    case QuantIsa::kAvx2: return avx2;
    case QuantIsa::kAvx512: return avx512;
    case QuantIsa::kAvx512Vnni: return avx512 && __builtin_cpu_supports("avx512vnni");
    case QuantIsa::kAvx2Int8: return avx2;
  }
  return false;
}

}  // namespace

const char* QuantIsaName(QuantIsa isa) {
  switch (isa) {
    case QuantIsa::kPortable: return "portable";
    case QuantIsa::kAvx2: return "avx2";
    case QuantIsa::kAvx512: return "avx512";
    case QuantIsa::kAvx512Vnni: return "avx512vnni";
    case QuantIsa::kAvx2Int8: return "avx2int8";
  }
  return "?";
}

bool QuantIsaSupported(QuantIsa isa) {
  if (!CpuHas(isa)) return false;
  switch (isa) {
    case QuantIsa::kPortable: return true;
    case QuantIsa::kAvx2:
    case QuantIsa::kAvx2Int8: return IsaCapAllows(IsaLevel::kAvx2);
    case QuantIsa::kAvx512: return IsaCapAllows(IsaLevel::kAvx512);
    case QuantIsa::kAvx512Vnni: return IsaCapAllows(IsaLevel::kAvx512Vnni);
  }
  return false;
}

QuantIsa ActiveQuantIsa() {
  static const QuantIsa best = QuantIsaSupported(QuantIsa::kAvx512) ? QuantIsa::kAvx512
                               : QuantIsaSupported(QuantIsa::kAvx2) ? QuantIsa::kAvx2
                                                                    : QuantIsa::kPortable;
  const int o = g_override.load(std::memory_order_relaxed);
  return o < 0 ? best : static_cast<QuantIsa>(o);
}

std::optional<QuantIsa> Int8ActivationsIsa() {
  if (QuantIsaSupported(QuantIsa::kAvx512Vnni)) return QuantIsa::kAvx512Vnni;
  if (QuantIsaSupported(QuantIsa::kAvx2Int8)) return QuantIsa::kAvx2Int8;
  return std::nullopt;
}

void SetQuantIsaOverride(std::optional<QuantIsa> isa) {
  g_override.store(isa.has_value() ? static_cast<int>(*isa) : -1, std::memory_order_relaxed);
}

std::string QuantizedKernelsDescription(QuantIsa int_isa) {
  __builtin_cpu_init();
  const auto yes = [](bool b) { return b ? "yes" : "no"; };
  const bool vnni = QuantIsaSupported(QuantIsa::kAvx512Vnni);
  const std::string cpu =
      absl::StrCat("[cpu: avx2+fma ", yes(CpuHas(QuantIsa::kAvx2)), ", avx512f/bw/vl ", yes(CpuHas(QuantIsa::kAvx512)),
                   ", avx512-vnni ", yes(CpuHas(QuantIsa::kAvx512Vnni)), IsaCapNote());
  // fp8 has no integer instance: it runs the exact one, on panels (Fp8OnPanels) or its rows.
  const std::string fp8 = Fp8OnPanels(ActiveQuantIsa()) ? "16-float panels" : QuantIsaName(ActiveQuantIsa());
  // mxfp4 (gpt-oss's experts) is on panels on every CPU, by the exact instance (PanelMatMulMxfp4).
  const QuantIsa exact = ActiveQuantIsa();
  const std::string mxfp4 = absl::StrCat(", mxfp4 on ",
                                         exact == QuantIsa::kAvx512 ? "16-float" : exact == QuantIsa::kAvx2 ? "8-float" : "portable",
                                         " panels");
  if (int_isa == QuantIsa::kAvx512Vnni || int_isa == QuantIsa::kAvx2Int8) {
    return absl::StrCat("int8/int4 products on ", QuantIsaName(int_isa), " (activations rounded to int8), fp8 on ", fp8,
                        mxfp4, " ", cpu, "]");
  }
  const std::string inexact = vnni ? ": not used, inexact (--activation-quantization int8 or int16 uses it)]" : "]";
  if (Fp8OnPanels(int_isa)) {
    return absl::StrCat("int8/fp8/int4 products on 16-float panels (codes widened in registers)", mxfp4, " ", cpu, inexact);
  }
  if (IntOnPanels(int_isa)) {
    return absl::StrCat("int8/int4 products on 8-float panels (codes widened in registers), fp8 on ", fp8, mxfp4, " ",
                        cpu, inexact);
  }
  return absl::StrCat("int8/fp8/int4 products on ", QuantIsaName(int_isa), mxfp4, " ", cpu, inexact);
}

}  // namespace shardserve::cpu
