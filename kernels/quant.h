// Quantized weight formats: how a MatMul weight may be stored (Backend::PackMatMulWeight), one
// declared layout per format and one dequantize reference per format, which the fast kernels
// (kernels/cpu/int8_matmul.h: int8 and fp8, kernels/cpu/int4_matmul.h, kernels/cpu/panel_matmul.h:
// mxfp4) are tested against (tests/kernels_cpu_test.cc).
//
// Embeddings, norms and the LM head stay in the activation dtype, as in the peers (vLLM,
// llama.cpp): only the linear layers' weights are quantized.
#ifndef SHARDSERVE_KERNELS_QUANT_H_
#define SHARDSERVE_KERNELS_QUANT_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardserve {

enum class WeightQuant : uint8_t {
  kNone = 0,  // the activation dtype (or the backend's own packing of it)
  kInt8 = 1,  // int8, symmetric, one float32 scale per output channel (below)
  kInt4 = 2,  // 4-bit unsigned with a zero point, per group of 128 inputs (Int4Group128 below)
  kFp8 = 3,   // fp8 e4m3 (OCP E4M3FN), one float32 scale per output channel, or per output channel and
              // group of inputs (Fp8RowsLayout below, its `group`)
  kMxfp4 = 4,  // MXFP4: e2m1 codes with an E8M0 scale per 32 inputs (Mxfp4RowsLayout below), as
               // gpt-oss's experts are published; loaded as stored, never quantized into at load
};

// "none", "int8", "int4", "fp8", "mxfp4".
const char* WeightQuantName(WeightQuant q);
// The inverse of WeightQuantName for the formats a weight can be quantized into at load
// (--quantization: none, int8, int4, fp8); InvalidArgument listing them otherwise (mxfp4 too: only
// a checkpoint stores it).
absl::StatusOr<WeightQuant> ParseWeightQuant(absl::string_view name);

// Bytes of a weight [m, k] stored as `q` (its layout's below: values, scales and zeros); m x k x 4
// (float32) for kNone. `group`: kFp8's inputs per scale (Fp8RowsLayout::group; 0: one scale a row),
// 0 for the other formats (kMxfp4's group is always kMxfp4BlockSize; k a multiple of it).
int64_t QuantizedWeightBytes(WeightQuant q, int64_t m, int64_t k, int64_t group = 0);

// ---- int8, per output channel ----------------------------------------------------------------
// A weight w [m, k] (row r = output channel r) is stored as
//   scale [m] float32, then q [m, k] int8 (row-major),
// with scale[r] = max_c |w[r][c]| / 127 and q[r][c] = round(w[r][c] / scale[r]) in [-127, 127]
// (round half away from zero; an all-zero row has scale 0 and q 0). So w[r][c] ~ q[r][c] x
// scale[r], off by at most scale[r] / 2, and a product x @ w^T is (x @ q^T) x scale per column.
// The kernels read every int8 value, -128 included: a published symmetric 8-bit checkpoint's codes
// (GPTQ sym with zero point 128, compressed-tensors int8) reach -128 and are copied in as they are
// (model/quantized_checkpoint.h).
struct Int8RowsLayout {
  int64_t m = 0, k = 0;
  // Bytes of the whole stored weight, and where q starts (scales first: 4-byte aligned).
  int64_t bytes() const { return scale_bytes() + m * k; }
  int64_t scale_bytes() const { return m * static_cast<int64_t>(sizeof(float)); }
};
static_assert(sizeof(float) == 4 && sizeof(int8_t) == 1, "the int8 layout counts 4-byte scales and 1-byte values");

// Quantizes w [m, k] float32 into `scale` [m] and `q` [m, k]. Non-finite weights are refused
// (InvalidArgument naming the row and column) before anything is written.
absl::Status QuantizeInt8Rows(float* scale /*[m]*/, int8_t* q /*[m, k]*/, const float* w /*[m, k]*/, int64_t m,
                              int64_t k);
// The reference: w [m, k] = q x scale per row.
void DequantizeInt8Rows(float* w /*[m, k]*/, const float* scale /*[m]*/, const int8_t* q /*[m, k]*/, int64_t m,
                        int64_t k);

// ---- fp8 e4m3, per output channel (or per output channel and group of inputs) -------------------
// A weight w [m, k] is stored as
//   scale [m] float32, then q [m, k] bytes, each an OCP "E4M3FN" fp8 number (the byte of
//   torch.float8_e4m3fn / __nv_fp8_e4m3): sign bit, 4 exponent bits (bias 7), 3 mantissa bits;
//   exponent 0 is subnormal (m / 8 x 2^-6); no infinities; 0x7F / 0xFF are NaN; largest 448,
// with scale[r] = max_c |w[r][c]| / 448 and q[r][c] = e4m3(w[r][c] / scale[r]), rounded to the
// nearest e4m3 number (ties to even mantissa) and saturated at +-448; an all-zero row has scale 0
// and q 0. So w[r][c] ~ Fp8E4m3ToFloat(q[r][c]) x scale[r], off by at most 2^-4 of |w[r][c]|
// (half of e4m3's relative step 2^-3) where |w / scale| >= 2^-6 (e4m3's normal range), and by at
// most 2^-10 x scale[r] below it (the subnormals' half step).
// The same bytes and per-channel scales as a compressed-tensors "float-quantized" channel-wise fp8
// checkpoint (weight_scale [m, 1]), so a loader may copy those in as they are; per-tensor scales
// repeat per row. A loader must refuse NaN bytes (0x7F, 0xFF: Fp8E4m3IsNan): the kernels read
// them as +-480, the reference as NaN. 1 byte a weight plus 4 bytes a row.
//
// With input-group scales (`group` > 0): scale [m, G] float32 (G = ceil(k / group), row-major),
// then q [m, k] as above, and w[r][c] = Fp8E4m3ToFloat(q[r][c]) x scale[r][c / group] (each
// product rounded once to float32): the last group of a row is shorter when group does not divide
// k. What an FP8 checkpoint with block scales (weight_block_size [bo, bi], DeepSeek-V3's and
// Qwen3's 128 x 128) holds, exactly: its block's scale repeated over the block's bo rows, group =
// bi (model/quantized_checkpoint.h). Nothing quantizes into it at load (QuantizeWeight makes one
// scale a row). 1 byte a weight plus 4 bytes a group. A group of k or more inputs is one scale a
// row: the bytes of the layout without groups. The CUDA fp8 kernels take groups that are multiples
// of kFp8GroupMultiple (each run of 8 weights in one group), the CPU's any group (lane by lane
// where a vector spans two); loaders map multiples of kFp8GroupMultiple only and keep other sizes
// dequantized.
struct Fp8RowsLayout {
  int64_t m = 0, k = 0;
  int64_t group = 0;  // inputs per scale; 0: one scale per row
  // Scales per row: 1 without groups (or a group of k or more), else ceil(k / group).
  int64_t groups_per_row() const { return group > 0 && group < k ? (k + group - 1) / group : 1; }
  // Bytes of the whole stored weight, and where q starts (scales first: 4-byte aligned).
  int64_t bytes() const { return scale_bytes() + m * k; }
  int64_t scale_bytes() const { return m * groups_per_row() * static_cast<int64_t>(sizeof(float)); }
};
inline constexpr int64_t kFp8GroupMultiple = 8;
inline constexpr float kFp8E4m3Max = 448.0f;

// One e4m3 byte's value (exact in float32); NaN for 0x7F and 0xFF.
float Fp8E4m3ToFloat(uint8_t v);
// The e4m3 byte nearest to v (ties to even), saturated at +-448; NaN gives 0x7F.
uint8_t FloatToFp8E4m3(float v);
inline bool Fp8E4m3IsNan(uint8_t v) { return (v & 0x7F) == 0x7F; }

// Quantizes w [m, k] float32 into `scale` [m] and `q` [m, k]. Non-finite weights are refused
// (InvalidArgument naming the row and column) before anything is written.
absl::Status QuantizeFp8Rows(float* scale /*[m]*/, uint8_t* q /*[m, k]*/, const float* w /*[m, k]*/, int64_t m,
                             int64_t k);
// The reference: w [m, k] = Fp8E4m3ToFloat(q) x scale per row.
void DequantizeFp8Rows(float* w /*[m, k]*/, const float* scale /*[m]*/, const uint8_t* q /*[m, k]*/, int64_t m,
                       int64_t k);
// The reference with input-group scales: w[r][c] = Fp8E4m3ToFloat(q[r][c]) x scale[r][c / group]
// (Fp8RowsLayout{m, k, group}.groups_per_row() scales a row; group 0: DequantizeFp8Rows).
void DequantizeFp8Groups(float* w /*[m, k]*/, const float* scale /*[m, G]*/, const uint8_t* q /*[m, k]*/, int64_t m,
                         int64_t k, int64_t group);

// ---- int4, groups of 128 along the input, asymmetric ------------------------------------------
// A weight w [m, k] is stored as m x ceil(k / 128) blocks, row by row (block [r][g] holds
// w[r][128 g .. min(128 g + 128, k))), each an Int4Group128: a float32 scale s, an integer zero
// point z (in [0, 15] from the quantizer below; up to 16 from a GPTQ v1 checkpoint, whose stored
// zeros are off by one: model/quantized_checkpoint.cc), and 128 unsigned 4-bit values q in [0, 15], with
//   w[r][128 g + j] ~ (q_j - z) x s.
// When k is not a multiple of 128 the last group of each row is shorter (k % 128 values; its
// unused nibbles are 0 and multiply nothing). Tensor parallelism must not cut a group: a rank's
// slice of a row-parallel weight (o_proj, down_proj) must be a whole number of groups, which
// model/sharding.h CheckQuantizedShard checks, so that each rank's own quantization of its slice is
// the same as quantizing the whole weight.
// As GPTQ / AWQ's asymmetric 4-bit: the group's range [lo, hi] is widened to hold 0,
// s = (hi - lo) / 15, z = round(-lo / s), q_j = clamp(round(w_j / s) + z, 0, 15) (round half away
// from zero). Every weight is then off by at most s (half a step for its own rounding, up to half
// a step more where the zero's rounding pushes it past 0 or 15 and it is clamped); an all-zero
// group has s = 0, z = 0, q = 0.
// Packing: byte j (0 <= j < 64) holds value j in its low nibble and value j + 64 in its high
// nibble, so that 8 bytes give two runs of 8 consecutive inputs (what an 8-lane kernel multiplies).
// 72 bytes per 128 weights: 4.5 bits a weight.
inline constexpr int64_t kInt4GroupSize = 128;
struct Int4Group128 {
  float scale;                    // s
  uint8_t zero;                   // z: 0-15 quantized here, up to 16 from GPTQ v1
  uint8_t pad[3];                 // 0
  uint8_t q[kInt4GroupSize / 2];  // value j in the low nibble of q[j] (j < 64), else the high one of q[j - 64]
};
static_assert(sizeof(Int4Group128) == 72, "Int4Group128 is 4 + 1 + 3 + 64 bytes, no padding");

struct Int4GroupsLayout {
  int64_t m = 0, k = 0;
  int64_t groups_per_row() const { return (k + kInt4GroupSize - 1) / kInt4GroupSize; }
  // Bytes of the whole stored weight: blocks only (scales and zeros inside them).
  int64_t bytes() const { return m * groups_per_row() * static_cast<int64_t>(sizeof(Int4Group128)); }
};

// Quantizes w [m, k] float32 into m x ceil(k / 128) blocks. Non-finite weights are refused
// (InvalidArgument naming the row and column) before anything is written.
absl::Status QuantizeInt4Groups(Int4Group128* blocks /*[m, ceil(k / 128)]*/, const float* w /*[m, k]*/, int64_t m,
                                int64_t k);
// The reference: w [m, k] = (q - zero) x scale per group.
void DequantizeInt4Groups(float* w /*[m, k]*/, const Int4Group128* blocks /*[m, ceil(k / 128)]*/, int64_t m,
                          int64_t k);

// ---- MXFP4: e2m1 codes, one E8M0 scale per 32 inputs ------------------------------------------
// The OCP microscaling format with FP4 E2M1 elements, as gpt-oss's checkpoints publish their
// experts (model/mxfp4.h reads them). A weight w [m, k] (k a multiple of 32) is stored as
//   blocks [m, k / 32] Mxfp4Block (16 bytes each: code 2 j of the block in the low nibble of byte j,
//   code 2 j + 1 in the high one), then scales [m, k / 32] bytes (E8M0),
// with w[r][32 g + i] = kMxfp4Values[code i of block (r, g)] x 2^(scales[r][g] - 127) (each a power
// of two times a value of at most 2 significant bits: exact in float32 where finite). Not finite:
// every value of a block with scale byte 255 (NaN in OCP's E8M0), and codes of magnitude 4 or 6
// under 253 and 2 or more under 254 (2^128 and past); the kernels refuse a weight that has any
// when it is stored (Mxfp4ValuesFinite). The codes are the checkpoint's `_blocks` bytes and the scales its `_scales`
// bytes, row by row, as they are: 4.25 bits a weight. The CPU backend repacks them into panels of
// the same bytes (kernels/cpu/panel_matmul.h PackPanelsMxfp4); CUDA reads them as they are.
inline constexpr int64_t kMxfp4BlockSize = 32;   // inputs per scale
inline constexpr int64_t kMxfp4BlockBytes = 16;  // bytes per block of codes
// The 16 values of an e2m1 code: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (code | 8).
inline constexpr float kMxfp4Values[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                           -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
// One block's codes (its scale byte is stored apart).
struct Mxfp4Block {
  uint8_t codes[kMxfp4BlockBytes];
};
static_assert(sizeof(Mxfp4Block) == kMxfp4BlockBytes, "a block of 32 e2m1 codes is 16 bytes");
// The E8M0 scale byte that means NaN.
inline constexpr uint8_t kMxfp4NanScale = 255;

struct Mxfp4RowsLayout {
  int64_t m = 0, k = 0;  // k a multiple of kMxfp4BlockSize
  int64_t blocks_per_row() const { return k / kMxfp4BlockSize; }
  // Bytes of the codes (where the scales start), of the scales, and of the whole stored weight.
  int64_t code_bytes() const { return m * blocks_per_row() * kMxfp4BlockBytes; }
  int64_t scale_bytes() const { return m * blocks_per_row(); }
  int64_t bytes() const { return code_bytes() + scale_bytes(); }
};

// An E8M0 scale byte's value, 2^(e - 127), exactly (2^-127 a float32 subnormal); +inf for 255.
float Mxfp4Scale(uint8_t e);
// The reference: w [m, k] from `stored` (Mxfp4RowsLayout{m, k}'s bytes), code value x scale, each
// exact. A scale byte of 255 gives NaN for that block's values (a stored weight never has one).
void DequantizeMxfp4Rows(float* w /*[m, k]*/, const uint8_t* stored, int64_t m, int64_t k);
// Whether every value of one block (its 16 code bytes and scale byte) is finite in float32.
bool Mxfp4BlockFinite(const uint8_t* codes /*[16]*/, uint8_t scale);
// Whether every value of `stored` (Mxfp4RowsLayout{m, k}) is: what the kernels take.
bool Mxfp4ValuesFinite(const uint8_t* stored, int64_t m, int64_t k);

// ---- Any format ---------------------------------------------------------------------------------

// Quantizes w [m, k] float32 into `stored`: QuantizedWeightBytes(quant, m, k) bytes of quant's
// layout (int8 / fp8: the scales, then the codes; int4: the blocks), as the quantizers above do,
// with the rows shared among `threads` threads (0: one per hardware thread): every row's bytes are
// a function of that row alone, so the bytes do not depend on the split. What both backends call to
// quantize a weight at load (the Llama-3-8B's 7 G weights took over 150 s in one thread; int8 and
// int4 now go 8 weights at a time, fp8 without libm: one AVX2 EPYC thread quantizes about 380 M
// weights/s to int4, 345 M to int8, 140 M to fp8, against 75-90, 75-90 and 30-45 before:
// bench_matmul's packing times). Non-finite weights are refused, naming the row and column, before anything
// is written (one scan, shared among the threads too); kNone and kMxfp4 are refused.
absl::Status QuantizeWeight(WeightQuant quant, void* stored, const float* w /*[m, k]*/, int64_t m, int64_t k,
                            int threads = 0);
enum class DType : uint8_t;  // kernels/tensor.h (which includes this header)
// The same for w [m, k] in F32, F16 or BF16 (`dtype`), the 16-bit rows widened exactly to float32
// a few at a time in each thread (the same bytes as widening the whole weight first, without its
// float32 copy): what the CUDA backend quantizes a weight in the act dtype with.
absl::Status QuantizeWeight(WeightQuant quant, void* stored, const void* w /*[m, k]*/, DType dtype, int64_t m,
                            int64_t k, int threads = 0);

}  // namespace shardserve

#endif  // SHARDSERVE_KERNELS_QUANT_H_
