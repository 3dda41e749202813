// The CPU backend's float32 matrix product, y [n, m] = x [n, k] @ w^T (+ bias), written so that a
// row's result never depends on the other rows of the call.
//
// Why not oneDNN here: continuous batching (tests/batching_test.cc) and seeded sampling need a
// row's product to be bitwise the same whether it is multiplied alone or among 300 others.
// oneDNN 2.6's float32 matmul does not give that on AVX2 CPUs (its gemm:jit picks gemv, small-M
// and blocked paths by row count, and repacks the weight on every call); on AVX-512 its brgemm
// happened to, as a property of its internals, not of its contract. Here it holds by construction:
// every output element is one float chain over k, k = 0, 1, ..., k - 1, each step a fused
// multiply-add (a multiply and an add on CPUs without FMA), whatever n, the row's position, the
// thread count or the weight's layout. oneDNN still does the bf16 products (matmul.cc),
// which need instructions (AMX, AVX512-BF16) it has and these loops do not use.
//
// Layout: a weight w [m, k] is packed once, at load, into panels of kPanelCols output columns:
// panel p holds w[p*16 + j][kk] at [p][kk][j] (the last panel zero-padded), so a panel is one
// contiguous stream that a tile of rows reads once (a tied embedding and LM head too: its table is
// stored so, Backend::PackTiedTable, and Embedding gathers rows from it). A plain w (a caller's
// row-major matrix: tools/bench/bench_matmul.cc's "f32 plain w") is packed panel by panel into per-thread scratch
// as the product runs (8 x 8 blocks transposed in registers), giving bitwise the same results as a
// packed one. Up to 3 rows (a decode step), a w's tiles take 2 to 4 panels at a time, so that 8 to
// 12 chains hide the FMA latency (one panel's 2 per row would not); the chains are the same.
//
// From 4 rows, on CPUs with AVX-512F, the products run AVX-512 tiles (panel_matmul_avx512.h: one
// zmm per panel per row, up to 14 rows x 2 panels at a time) instead of the 8-float ones, and up to
// 3 rows a plain w is multiplied as it is, with no scratch (16 x 16 blocks of it transposed in
// registers, one panel's 16 rows of w at a time): the same chains, so bitwise the same results.
//
// Thread-safety: the products are reentrant; they run on `threads` OpenMP threads of the caller.
// SetPanelTilesOverride is for tools and tests, before products run.
#ifndef SHARDSERVE_KERNELS_CPU_PANEL_MATMUL_H_
#define SHARDSERVE_KERNELS_CPU_PANEL_MATMUL_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "kernels/quant.h"

namespace shardserve::cpu {

// Output columns per panel: two 8-float vectors (AVX2 registers) per tile row, or one AVX-512 one.
inline constexpr int64_t kPanelCols = 16;

// Floats a packed w [m, k] takes: ceil(m / 16) panels of k x 16.
int64_t PanelMatMulFloats(int64_t m, int64_t k);

// packed [PanelMatMulFloats(m, k)] = w [m, k] (row-major) in panels. m, k >= 0.
void PackPanels(float* packed, const float* w, int64_t m, int64_t k);

// y [n, m] = x [n, k] @ w^T (+ bias [m], added to the finished sum) on `threads` threads (>= 1),
// w given packed by PackPanels, or plain [m, k] row-major when `plain` (packed then into
// `scratch`, grown to threads x 4 x k x 16 floats). y must not overlap the inputs. n, m, k >= 1.
void PanelMatMul(float* y, const float* x, int64_t n, int64_t m, int64_t k, const float* w, bool plain,
                 const float* bias, int threads, std::vector<float>* scratch);

// The same products by a weight stored in bf16 (half the bytes: a decode step, which reads every
// weight once, takes about half the time), for CPUs on which oneDNN has no bf16 product (the CPU
// backend's CpuMatMul::kBF16 there, matmul.cc). Panels as above, each input step's 16 values in
// the order Bf16Panels::Load in panel_matmul.cc wants; each value widened to float32 exactly in
// registers, then the 8-float tiles' chains: PanelMatMulBf16 gives bitwise PanelMatMul's results
// for the weight its bf16 values make. (No AVX-512 tiles, no plain w.)
// packed [PanelMatMulFloats(m, k)] (as many values as float32 panels) = w [m, k] rounded to bf16 (to
// nearest even). m, k >= 0.
void PackPanelsBf16(uint16_t* packed, const float* w, int64_t m, int64_t k);
// y [n, m] = x [n, k] @ w^T (+ bias [m]) on `threads` threads (>= 1), w packed by PackPanelsBf16.
// y must not overlap the inputs. n, m, k >= 1.
void PanelMatMulBf16(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint16_t* w, const float* bias,
                     int threads);

// The same products by one-byte weights with one float32 scale per output: int8 and fp8 e4m3
// (kernels/quant.h's Int8RowsLayout / Fp8RowsLayout codes and scales), whose products the CPU
// backend runs so (quant_isa.h IntOnPanels, Fp8OnPanels): panels as above, 16 bytes an input step in
// column order, each value widened to float32 in registers (exactly: an int8 by sign extension and
// conversion, an e4m3 byte by moving its bits into float32's; the NaN bytes 0x7F / 0xFF, which
// loaders refuse, read as +-480 as in the rows' products), the float32 panels' chains, then each
// sum times its column's scale (+ bias, in one fused multiply-add): y[i][c] = fma(chain of x[i][kk]
// q[c][kk] over kk, scale[c], bias[c]), the chains bitwise PanelMatMul's sums by the codes' values
// as floats. A decode step reads each panel as one stream, and a prefill's tiles widen each weight
// once for many rows.
// packed [PanelMatMulFloats(m, k)] (one byte a value) = q [m, k] (row-major) in panels. m, k >= 0.
void PackPanelsBytes(uint8_t* packed, const uint8_t* q, int64_t m, int64_t k);
// y [n, m] = x [n, k] @ (q x scale)^T (+ bias [m]) on `threads` threads (>= 1), int8 codes q packed
// by PackPanelsBytes, scale [m], by `tiles`' instance: kAvx512's (panel_matmul_bytes_avx512.cc,
// 16-float tiles, CPUs with AVX-512F) or kVec8's (panel_matmul_avx2.cc, the float32 panels' 8-float
// tiles, CPUs with AVX2 and FMA), bitwise the same results. y must not overlap the inputs. n, m, k >= 1.
enum class PanelTiles : uint8_t;
void PanelMatMulInt8(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* w, const float* scale,
                     const float* bias, int threads, PanelTiles tiles);
// The same by e4m3 bytes, on the 16-float tiles only: CPUs with AVX-512F (AVX2 CPUs keep the rows'
// product, quant_isa.h Fp8OnPanels).
void PanelMatMulFp8(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* w, const float* scale,
                    const float* bias, int threads);
// The same by e4m3 bytes with input-group scales (kernels/quant.h Fp8RowsLayout with `group` > 0:
// an FP8 checkpoint's block scales), scales in panel order (PackPanelScales): each widened vector of
// 16 codes is multiplied by its group's 16 scales before its fused multiply-adds, so that each
// output is PanelMatMul's chain for the weights DequantizeFp8Groups gives, bit for bit, the bias
// added to the finished sum: y[i][c] = (chain of x[i][kk] (code[c][kk] x scale[c][kk / group]) over
// kk) + bias[c]. Any group >= 1 (a group's scales are reloaded from L1 at its first input).
// Floats PackPanelScales writes for m outputs and `groups` scales a row: ceil(m / 16) x groups x 16.
int64_t PanelScaleFloats(int64_t m, int64_t groups);
// packed [panel][group][16] = scale [m, groups] (row-major), 0 past m.
void PackPanelScales(float* packed, const float* scale, int64_t m, int64_t groups);
void PanelMatMulFp8Groups(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* w,
                          const float* scales, int64_t group, const float* bias, int threads);

// The same products by int4 weights (kernels/quant.h's Int4Group128 blocks: groups of 128 inputs,
// a scale and a zero point each), for CPUs with AVX2 and FMA, whose exact int4 products the CPU backend
// runs so (quant_isa.h IntOnPanels; panel_matmul_int4_avx512.cc, _avx2.cc). Outputs in blocks of 4 panels
// (64 outputs); block b's group g is one Int4PanelGroup: its 4 panels' scales and zero points, then
// for each pair of inputs 128 g + 2j, 2j + 1 one 64-byte line, byte q[j][p][c] holding output
// 64 b + 16 p + c's code at input 2j (low nibble) and 2j + 1 (high nibble): a decode step reads
// the weight as one stream. Per output and group, the chain of fused multiply-adds of the codes as
// floats by the inputs, over the group's inputs in order from zero (`partial`), then, from acc = 0,
// group by group,
//   acc = fma(scale, fnmadd(zero, sum of the group's inputs, partial), acc),
// y = acc (+ bias); a row's sum of a group's inputs is 16 lanes over its chunks in order, the lanes
// then added. That is scale x sum_j x_j (q_j - zero) in another order of additions than the
// dequantized weights' (within float32 rounding of the reference, QuantIsaTest), the same
// operations for every row whatever the others (QuantMatMulRowsTest).
inline constexpr int64_t kInt4PanelGroupInputs = kInt4GroupSize;
inline constexpr int kInt4GroupPanels = 4;
struct alignas(64) Int4PanelGroup {
  float scale[kInt4GroupPanels][kPanelCols];  // each output's scale (0 past m)
  float zero[kInt4GroupPanels][kPanelCols];   // its zero point, as a float (0 past m)
  uint8_t q[kInt4PanelGroupInputs / 2][kInt4GroupPanels][kPanelCols];  // inputs 2j (low nibble), 2j + 1 (high)
};
// Int4PanelGroups a packed w [m, k] takes: ceil(m / 64) blocks of ceil(k / 128) groups.
int64_t Int4PanelGroupCount(int64_t m, int64_t k);
// The order of a group's code bytes: kPairs as `q` above (the exact instances'), or kOctets
// (PanelMatMulInt4Act16's): for each 8 inputs 8o .. 8o + 7, each panel p and output c, 4 bytes at
// byte offset ((o x 4 + p) x 16 + c) x 4 of `q`, read as two little-endian 16-bit halves h = 0, 1
// whose nibble t (bits 4t .. 4t + 3) is output c's code at input 8o + 2t + h. A 64-byte line is
// then a panel's 128 codes of 8 inputs, and shifting and masking its 16-bit lanes by 4t gives, in
// each 32-bit lane, one output's codes at inputs 8o + 2t and 8o + 2t + 1 as two int16: what VPDPWSSD
// multiplies by a pair of int16 activations, with no widening of bytes.
enum class Int4CodeOrder : uint8_t { kPairs = 0, kOctets = 1 };
// packed [Int4PanelGroupCount(m, k)] = blocks [m, ceil(k / 128)] (Int4GroupsLayout) in panels, the
// codes in `order`; the codes past k and the outputs past m are 0. m, k >= 0.
void PackPanelsInt4(Int4PanelGroup* packed, const Int4Group128* blocks, int64_t m, int64_t k,
                    Int4CodeOrder order = Int4CodeOrder::kPairs);
// y [n, m] = x [n, k] @ w^T (+ bias [m]) on `threads` threads (>= 1), w packed by PackPanelsInt4 in
// kPairs order, by `tiles`' instance: kAvx512's (panel_matmul_int4_avx512.cc, CPUs with AVX-512F) or kVec8's,
// 8-float vectors (panel_matmul_int4_avx2.cc, CPUs with AVX2 and FMA), bitwise the same results.
// y must not overlap the inputs. n, m, k >= 1.
void PanelMatMulInt4(float* y, const float* x, int64_t n, int64_t m, int64_t k, const Int4PanelGroup* w,
                     const float* bias, int threads, PanelTiles tiles);
// The same product on int16 activations (the CPU backend's int4 products under
// --activation-quantization int16; panel_matmul_int4_vnni.cc, CPUs with AVX-512 VNNI only), w packed
// by PackPanelsInt4 in kOctets order: each
// row's inputs quantized per group of 128 as Int16ActivationGroups states, the codes multiplied by
// them as integers (exact sums), then per output and group, from acc = 0,
//   acc = fma(scale x sx, fnmadd(zero, sum of the group's v, float(sum_j q_j v_j)), acc),
// y = acc (+ bias): scale x sx x sum_j (q_j - zero) v_j. Not exact against the dequantized weights
// (each activation moves by up to max |x| / 65534 of its group), the same operations for every row
// whatever the others. A group with a NaN or an infinity makes its row's outputs NaN.
void PanelMatMulInt4Act16(float* y, const float* x, int64_t n, int64_t m, int64_t k, const Int4PanelGroup* w,
                          const float* bias, int threads);
// PanelMatMulInt4Act16's quantization of x [n, k] (AVX-512 VNNI CPUs), G = ceil(k / 128) groups a
// row: for group g of row i, with M its largest |x|, scale[i * G + g] = M / 32767 and
// v[(i * G + g) * 128 + j] = round(x * (32767 / M)) (float32 product, to nearest even), sum its v
// (0 past k); an all-zero group has scale 0 and v 0, one with a NaN or an infinity scale NaN and v 0.
void Int16ActivationGroups(int16_t* v, float* scale, float* sum, const float* x, int64_t n, int64_t k);

// The same products by MXFP4 weights (kernels/quant.h Mxfp4RowsLayout: e2m1 codes, an E8M0 scale
// per 32 inputs; gpt-oss's experts as published), on every CPU: panels of 16 outputs whose input
// pair 2j, 2j + 1 is one 16-byte step (byte c: output c's code at input 2j in the low nibble, at
// 2j + 1 in the high one, its stored byte as it is), then each panel's scales, [G][16] bytes, so
// that a decode step reads 4.25 bits a weight as two streams. Each code is made a float by a
// 16-entry table (AVX-512: VPERMPS on the nibble; AVX2: VPERMPS on its 3 magnitude bits, the sign
// bit moved to float32's), times its block's scale 2^(e - 127) (exact: the weight DequantizeMxfp4Rows
// gives), then one fused multiply-add per input in order from zero, the bias added to the finished
// sum: each output is PanelMatMul's chain for the dequantized weights, bit for bit (the portable
// instance, with no FMA, a multiply and an add per input, as PanelMatMul's baseline clone).
// Bytes a packed w [m, k] takes (k a multiple of 32): ceil(m / 16) panels of k / 2 x 16 code bytes
// and k / 32 x 16 scale bytes (Mxfp4RowsLayout's bytes when 16 divides m).
int64_t Mxfp4PanelBytes(int64_t m, int64_t k);
// packed [Mxfp4PanelBytes(m, k)] = `stored` (Mxfp4RowsLayout{m, k}) in panels, codes and scales 0
// past m. m >= 0, k a multiple of 32.
void PackPanelsMxfp4(uint8_t* packed, const uint8_t* stored, int64_t m, int64_t k);
// y [n, m] = x [n, k] @ w^T (+ bias [m]) on `threads` threads (>= 1), w packed by PackPanelsMxfp4
// (no scale byte 255: the backend refuses it), by `isa`'s instance: AVX-512's 16-float tiles
// (kAvx512, kAvx512Vnni), AVX2's 8-float ones (kAvx2, kAvx2Int8) or baseline x86-64's (kPortable),
// which the CPU must support. y must not overlap the inputs. n, m >= 1, k a multiple of 32.
enum class QuantIsa : uint8_t;
void PanelMatMulMxfp4(float* y, const float* x, int64_t n, int64_t m, int64_t k, const uint8_t* w, const float* bias,
                      int threads, QuantIsa isa);

// Which tiles the products from 4 rows run: the 8-float ones (kVec8, every CPU) or the AVX-512
// ones (kAvx512, CPUs with AVX-512F and FMA).
enum class PanelTiles : uint8_t { kVec8 = 0, kAvx512 = 1 };
// Whether this CPU (and its OS) runs `tiles`, and oneDNN's cap allows them (isa_cap.h).
bool PanelTilesSupported(PanelTiles tiles);
// The tiles the products run: the override when one is set, else kAvx512 where supported.
PanelTiles ActivePanelTiles();
// Makes ActivePanelTiles return `tiles` (which must be supported; nullopt: back to the CPU's best).
// For tests and bench_matmul's side-by-side runs.
void SetPanelTilesOverride(std::optional<PanelTiles> tiles);

}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_PANEL_MATMUL_H_
