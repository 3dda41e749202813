// Which instruction set the CPU's quantized products (int8_matmul.h, int4_matmul.h) run on: one
// instance per set, picked at run time by CPUID (the build targets baseline x86-64), and the line
// the worker logs about it.
//
// Thread-safety: all functions may be called from any thread; SetQuantIsaOverride is for tools
// and tests, before products run.
#ifndef SHARDSERVE_KERNELS_CPU_QUANT_ISA_H_
#define SHARDSERVE_KERNELS_CPU_QUANT_ISA_H_

#include <cstdint>
#include <optional>
#include <string>

#include "kernels/cpu/panel_matmul.h"

namespace shardserve::cpu {

enum class QuantIsa : uint8_t {
  kPortable = 0,  // baseline x86-64 (GCC vectors, no FMA)
  kAvx2 = 1,      // AVX2 + FMA, 8 lanes
  kAvx512 = 2,    // AVX-512 F/BW/VL + FMA, 16 lanes
  // AVX-512 VNNI, int8 and int4: the activations quantized to int8 per row (scale max |x| / 127,
  // activation_rows.h) and multiplied in integers (VPDPBUSD), as llama.cpp's Q8_0 / Q4_0 products
  // do. Not exact against the dequantized weights (each activation moves by up to 1/254 of its
  // row's largest: ~5e-3 of an output, tests/kernels_cpu_test.cc), so never picked by
  // ActiveQuantIsa: only when asked for (the CPU backend under CpuActivationQuant::kInt8, worker
  // --activation-quantization int8; bench_matmul, tests). fp8 runs kAvx512's instance under it.
  kAvx512Vnni = 3,
  // AVX2 + FMA, int8 and int4 with the activations quantized as under kAvx512Vnni (activation_rows.h)
  // and multiplied in integers by VPMADDUBSW + VPMADDWD, as llama.cpp's AVX2 Q8_0 / Q4_0 products do
  // (int8_matmul_act8_avx2.cc, int4_matmul_act8_avx2.cc): the same integer sums as kAvx512Vnni's, so
  // as inexact, and likewise never picked by ActiveQuantIsa. It is what --activation-quantization int8
  // runs on a CPU with AVX2 but without AVX-512 VNNI (Int8ActivationsIsa). fp8 runs kAvx2's under it.
  kAvx2Int8 = 4,
};

// Whether the CPU backend stores int8 and int4 weights as panels and multiplies them by
// PanelMatMulInt8 / PanelMatMulInt4 (panel_matmul.h) rather than by Int8MatMul's rows
// (int8_matmul.h) / Int4MatMul's blocks (int4_matmul.h): where their instance would be AVX-512's or
// AVX2's (panel_matmul_bytes_avx512.cc, panel_matmul_avx2.cc; panel_matmul_int4_*.cc).
// The rows' and blocks' tiles, a dot product over k per output, ran at half the float32 panels'
// rate from 16 input rows on on the AVX2 EPYC (bench_matmul) and at 0.75-0.79x from 32 rows on a Zen 5 EPYC with AVX-512 ("int4 on AVX-512 as
// panels", "int8 on AVX-512 as panels").
inline bool IntOnPanels(QuantIsa isa) { return isa == QuantIsa::kAvx512 || isa == QuantIsa::kAvx2; }

// Whether it stores fp8 weights as panels (PanelMatMulFp8) rather than multiplying them by
// Fp8MatMul's rows: where fp8's instance (always the exact one, ActiveQuantIsa) is AVX-512's. On
// 8-float tiles the e4m3 widening (a shift, a mask and a multiply more than int8's) left them slower
// than the rows from 64 rows on (Zen 5 running the AVX2 code: bench_matmul).
inline bool Fp8OnPanels(QuantIsa isa) { return isa == QuantIsa::kAvx512; }

// The panels' instance (panel_matmul.h PanelTiles) for an int8 / int4 instance on panels: the
// 16-float tiles for kAvx512, the 8-float ones for kAvx2.
inline PanelTiles PanelTilesFor(QuantIsa isa) {
  return isa == QuantIsa::kAvx512 ? PanelTiles::kAvx512 : PanelTiles::kVec8;
}

// The instance the int8 and int4 products run on under --activation-quantization int8
// (CpuActivationQuant::kInt8): kAvx512Vnni where this CPU has it, else kAvx2Int8 where it has AVX2 +
// FMA; nullopt on a CPU with neither.
std::optional<QuantIsa> Int8ActivationsIsa();

// "portable", "avx2", "avx512", "avx512vnni", "avx2int8".
const char* QuantIsaName(QuantIsa isa);
// Whether this CPU (and its OS) can run `isa`'s instance, and oneDNN's cap allows it (isa_cap.h).
bool QuantIsaSupported(QuantIsa isa);
// The instance the products use: the override when one is set, else the widest exact one this CPU
// has (kAvx512, kAvx2 or kPortable).
QuantIsa ActiveQuantIsa();
// Makes ActiveQuantIsa return `isa` (which must be supported; nullopt: back to the CPU's best).
// For bench_matmul's side-by-side runs.
void SetQuantIsaOverride(std::optional<QuantIsa> isa);

// For the worker's log: which instance the int8 and int4 products run on (`int_isa`: the CPU
// backend passes Int8ActivationsIsa() under --activation-quantization int8), which one fp8's runs on, and
// what the CPU has (AVX2, FMA, AVX-512, VNNI).
std::string QuantizedKernelsDescription(QuantIsa int_isa = ActiveQuantIsa());

}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_QUANT_ISA_H_
