// The CPU backend's hand-written bf16 product for few input rows (a decode step's 1 to a few), on
// AVX-512 BF16 (VDPBF16PS), reading the weight in the blocked layout oneDNN picks for its own bf16
// products (so that one copy of the weight serves both: oneDNN keeps the larger row counts,
// CpuBackend::Bf16MatMul in matmul.cc picks). That layout, "BA16a64b2a" of the [k, m] weights of a
// matmul: the m outputs in blocks of 64 columns, each block one contiguous run of padded_k x 64
// bf16 values (padded_k: k rounded up to 32, zero-padded; m padded to 64, zero-padded) in which
// input pair p (inputs 2p and 2p + 1) of the block's 64 columns is 128 values: for each column c,
// w[c][2p], w[c][2p + 1].
//
// Each output is summed as oneDNN's AVX-512 BF16 kernels (brgemm) sum it: the inputs in chunks
// (oneDNN's K block times its batch: 512 or 1024 inputs for oneDNN 2.6 at k > 512, all of them up
// to 512), each chunk in one float32 accumulator from 0, VDPBF16PS over the input pairs in order,
// each chunk's sum added to the total so far, the bias added last; x rounded to bf16 to nearest even
// first (VCVTNEPS2BF16, as oneDNN's reorder). With oneDNN's chunk (which the CPU backend finds for
// each weight shape when it packs it, matching a probe product bitwise), a row's result does not
// depend on how many rows share its step, nor on which of the two products ran it
// (tests/kernels_cpu_test.cc checks both, bitwise).
//
// Thread-safety: Bf16BlockedMatMul is a pure function of its arguments but for the calling thread's
// own scratch (the rounded x); it runs `threads` OpenMP threads of its own. The others may be called
// from any thread; SetBf16BlockedRowsOverride is for tools and tests, before products run.
#ifndef SHARDSERVE_KERNELS_CPU_BF16_MATMUL_H_
#define SHARDSERVE_KERNELS_CPU_BF16_MATMUL_H_

#include <cstdint>
#include <optional>

namespace shardserve::cpu {

// Columns per block and inputs per k block of the layout above.
constexpr int64_t kBf16BlockColumns = 64;
constexpr int64_t kBf16BlockInputs = 32;

// Whether this CPU (and its OS) runs Bf16BlockedMatMul: AVX-512 F/BW/VL and BF16, within oneDNN's cap
// (isa_cap.h). (This and the
// four below are defined in matmul.cc, compiled for baseline x86-64.)
bool CpuHasAvx512Bf16();
// Whether oneDNN multiplies bf16 here: its avx512_core ISA or more (with AVX512-BF16 natively, else
// emulated). Where it does not (AVX2 CPUs), the CPU backend's bf16 products run panel_matmul.h's
// bf16 panels.
bool OneDnnHasBf16MatMul();
// Whether oneDNN's bf16 products run on AMX tiles here (Intel Xeon from Sapphire Rapids on). Its
// AMX kernels sum in an order of their own, which Bf16BlockedMatMul does not reproduce, so the CPU
// backend keeps every weight on oneDNN there (matmul.cc).
bool OneDnnBf16UsesAmx();
// Up to how many rows the CPU backend's bf16 products run Bf16BlockedMatMul (where the weight is
// in its layout): the override when one is set, else the default (matmul.cc, measured).
int64_t Bf16BlockedRows();
// Makes Bf16BlockedRows return `rows` (0: oneDNN for every row count; nullopt: back to the
// default). For bench_matmul's side-by-side runs and the tests' comparisons of the two.
void SetBf16BlockedRowsOverride(std::optional<int64_t> rows);

// y [n, m] = bf16(x [n, k]) @ w^T (+ bias [m], may be null) for w in the layout above with
// padded_k = k rounded up to kBf16BlockInputs, summing `chunk` inputs at a time (rounded down to a
// multiple of kBf16BlockInputs; less than one: all at once), on `threads` OpenMP threads (<= 0:
// OpenMP's default), split by blocks of output columns. Only where CpuHasAvx512Bf16().
void Bf16BlockedMatMul(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint16_t* w,
                       const float* bias, int64_t chunk, int threads);

}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_BF16_MATMUL_H_
