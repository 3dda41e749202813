#include "kernels/cpu/isa_cap.h"

#include <cstdlib>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "oneapi/dnnl/dnnl.h"

namespace shardserve::cpu {
namespace {

struct NamedIsa {
  const char* name;
  dnnl_cpu_isa_t isa;
};

// oneDNN 2.6's names for its cap (what its environment reader accepts, case aside).
constexpr NamedIsa kOneDnnIsas[] = {
    {"ALL", dnnl_cpu_isa_all},
    {"SSE41", dnnl_cpu_isa_sse41},
    {"AVX", dnnl_cpu_isa_avx},
    {"AVX2", dnnl_cpu_isa_avx2},
    {"AVX2_VNNI", dnnl_cpu_isa_avx2_vnni},
    {"AVX512_MIC", dnnl_cpu_isa_avx512_mic},
    {"AVX512_MIC_4OPS", dnnl_cpu_isa_avx512_mic_4ops},
    {"AVX512_CORE", dnnl_cpu_isa_avx512_core},
    {"AVX512_CORE_VNNI", dnnl_cpu_isa_avx512_core_vnni},
    {"AVX512_CORE_BF16", dnnl_cpu_isa_avx512_core_bf16},
    {"AVX512_CORE_AMX", dnnl_cpu_isa_avx512_core_amx},
};

// oneDNN's ISA values are supersets by bits: a level is included when all of its bits are.
bool Includes(dnnl_cpu_isa_t have, dnnl_cpu_isa_t want) {
  const auto h = static_cast<unsigned>(have), w = static_cast<unsigned>(want);
  return (h & w) == w;
}

dnnl_cpu_isa_t OneDnnIsa(IsaLevel level) {
  switch (level) {
    case IsaLevel::kAvx2: return dnnl_cpu_isa_avx2;
    case IsaLevel::kAvx512: return dnnl_cpu_isa_avx512_core;
    case IsaLevel::kAvx512Vnni: return dnnl_cpu_isa_avx512_core_vnni;
    case IsaLevel::kAvx512Bf16: return dnnl_cpu_isa_avx512_core_bf16;
  }
  return dnnl_cpu_isa_all;
}

// The variable oneDNN reads its cap from, and its value; name null when neither is set (oneDNN
// prefers ONEDNN_ to DNNL_).
std::pair<const char*, const char*> CapVariable() {
  for (const char* name : {"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"}) {
    if (const char* value = std::getenv(name); value != nullptr && *value != '\0') return {name, value};
  }
  return {nullptr, nullptr};
}

}  // namespace

bool IsaCapAllows(IsaLevel level) { return Includes(dnnl_get_effective_cpu_isa(), OneDnnIsa(level)); }

absl::Status CheckIsaCapSetting() {
  const auto [name, value] = CapVariable();
  if (name == nullptr) return absl::OkStatus();
  const std::string upper = absl::AsciiStrToUpper(value);
  std::vector<std::string> names;
  for (const NamedIsa& n : kOneDnnIsas) {
    if (upper == n.name) return absl::OkStatus();
    names.push_back(n.name);
  }
  return absl::InvalidArgumentError(absl::StrCat(name, "='", value, "' is not an instruction set oneDNN knows (",
                                                 absl::StrJoin(names, ", "),
                                                 "); oneDNN would ignore it and cap nothing"));
}

std::string IsaCapNote() {
  const auto [name, value] = CapVariable();
  if (name == nullptr) return "";
  const dnnl_cpu_isa_t effective = dnnl_get_effective_cpu_isa();
  for (const NamedIsa& n : kOneDnnIsas) {
    if (n.isa == effective) return absl::StrCat(", within ", name, "=", value, ": ", n.name);
  }
  return absl::StrCat(", within ", name, "=", value);
}

}  // namespace shardserve::cpu
