// Published quantized checkpoints, loaded as they are: config.json's quantization_config names the
// format, and each quantized linear layer <prefix> (a decoder layer's q/k/v/o/gate/up/down_proj) is
// stored as that format's tensors instead of a plain <prefix>.weight [out, in].
//
// GPTQ (quant_method "gptq"; AutoGPTQ / GPTQModel / optimum):
//   <prefix>.qweight  I32 [in / p, out]   p = 32 / bits values per int32, packed along the input:
//                                         value i of column c is bits (i % p) x bits.. of
//                                         qweight[i / p][c] (lowest bits first)
//   <prefix>.qzeros   I32 [G, out / p]    zero points, packed the same way along the output
//   <prefix>.scales   F16/BF16/F32 [G, out]
//   <prefix>.g_idx    I32 [in]            the group of each input, in [0, G)
//   with G = ceil(in / group_size) groups (1 when group_size is -1), and
//   w[c][i] = scales[g][c] x (q[i][c] - z[g][c]),  g = g_idx[i],
//   where z is the stored zero plus 1 in checkpoint_format "gptq" (v1; AutoGPTQ stores zero - 1)
//   and the stored zero in "gptq_v2". sym = true checkpoints must store z = 2^(bits - 1).
//   GPTQModel's "dynamic" {"-:<regex>": {}} entries keep the modules they match plain (as an ignore
//   list); entries that override bits or group_size per module are refused.
//
// AWQ (quant_method "awq", version "gemm"; AutoAWQ), 4 bits:
//   <prefix>.qweight  I32 [in, out / 8]   packed along the output in AWQ's interleaved order: output
//                                         8 w + t is nibble kAwqNibble[t] (= [0,4,1,5,2,6,3,7][t])
//                                         of qweight[i][w] (packing order [0,2,4,6,1,3,5,7])
//   <prefix>.qzeros   I32 [G, out / 8]    zero points, packed the same way; stored as they are (no
//                                         GPTQ v1 offset)
//   <prefix>.scales   F16 [G, out]
//   w[c][i] = scales[g][c] x (q - z),  g = i / group_size.
//
// compressed-tensors (quant_method "compressed-tensors"; llm-compressor), one config group whose
// targets are ["Linear"], modules in `ignore` (names, or "re:" regular expressions matched from
// the start) stored plain:
//   format "pack-quantized", weights type "int", num_bits 4 or 8, strategy "group" or "channel":
//   <prefix>.weight_packed      I32 [out, in / p]  packed along the input, lowest bits first, each
//                                                  value stored as q + 2^(bits-1) (q signed)
//   <prefix>.weight_scale       F16/BF16/F32 [out, G]   (G = 1 for "channel")
//   <prefix>.weight_zero_point  I32 [out / p, G]   only when symmetric is false: the signed zero
//                                                  points + 2^(bits-1), packed along the output
//   <prefix>.weight_shape       I32/I64 [2]        = [out, in]
//   w[c][i] = weight_scale[c][g] x (q - zp) = scale x (stored q - stored zp),  g = i / group_size.
//   format "float-quantized", weights type "float", num_bits 8 (e4m3), strategy "channel" or
//   "tensor":
//   <prefix>.weight        F8_E4M3 [out, in]
//   <prefix>.weight_scale  F16/BF16/F32 [out, 1] ("channel") or [1] ("tensor")
//   w[c][i] = weight[c][i] x weight_scale[c or 0].
//   (Activation quantization, input_activations, is not applied: the activations stay in the
//   compute dtype, as for every weight-only format here.)
//
// FP8 (quant_method "fp8", weight_block_size [bn, bk]; DeepSeek-V3 / Qwen3-FP8 style):
//   <prefix>.weight            F8_E4M3 [out, in]
//   <prefix>.weight_scale_inv  F32/BF16/F16 [ceil(out / bn), ceil(in / bk)]
//   w[c][i] = weight[c][i] x weight_scale_inv[c / bn][i / bk]; modules_to_not_convert stored plain.
//
// How a worker holds each weight (ReadQuantizedLinear): on a quantized kernel where the stored
// codes and scales are that kernel's layout (kernels/quant.h) bit for bit, with no requantization
// (exact), else dequantized:
// - int4: 4 bits in contiguous groups of 128 (GPTQ without a reordering g_idx, AWQ group_size
//   128, compressed-tensors int4 group_size 128): the values, scales (widened to f32, exact) and
//   zero points are repacked into Int4Group128 blocks (4.5 bits a weight).
// - int8: 8 bits with one scale per output channel over this rank's inputs (GPTQ group_size -1,
//   compressed-tensors strategy "channel") and every zero point 128 (symmetric: GPTQ sym,
//   compressed-tensors symmetric): code - 128 is the int8 value (-128 included) and the scale
//   (widened to f32) the row's, as Int8RowsLayout (8 bits + 4 bytes a row).
// - fp8: compressed-tensors float-quantized e4m3 with strategy "channel" or "tensor" (the one
//   scale repeated per row): the bytes as stored, as Fp8RowsLayout.
// - fp8 with input-group scales: FP8's block scales [bn, bk] with bk a multiple of
//   kFp8GroupMultiple (8; DeepSeek-V3's and Qwen3's 128 x 128): the e4m3 bytes as stored and, per
//   output row, the scale of each of its blocks (the block's scale repeated over its bn rows, exact),
//   as Fp8RowsLayout{m, k, group = bk} (1 byte a weight and 4 bytes per bk of a row). Where a
//   row-parallel rank's inputs start inside a block (an offset that is not a multiple of bk) the
//   groups would not start where the rank's inputs do: that slice is dequantized, saying so. A
//   rank whose inputs lie within one block (any bk) takes one scale a row.
// - dequantized: everything else (8 bits in groups along the input or with zero points,
//   other group sizes, desc_act reorders, FP8 blocks of other widths or cut inside): w is computed
//   exactly in float32 at load (f16 / bf16 / e4m3 times a small integer or an f32 scale) and
//   multiplied as a plain weight; QuantizedLinearSlice::why_dense says why, the worker log too.
//   This path saves no memory. (Folding FP8's block scales into one per-row scale instead would
//   round the e4m3 codes again, up to 2^-4 of each weight, where the format promises the stored
//   values.)
// Tensor parallelism: column-parallel layers (q/k/v/gate/up) take a range of the outputs,
// row-parallel ones (o/down) a range of the inputs; each format needs those ranges to be whole
// packed int32s and (for row-parallel) whole groups: CheckpointQuant::output_multiple /
// input_multiple, which model/sharding.h CheckQuantizedShard checks. Each rank reads only its
// slice of the packed tensors.
// Mixture-of-experts checkpoints (Qwen3-MoE, Mixtral, Qwen2-MoE, DeepSeek-V3) store every expert's
// gate/up/down (and the shared experts') this way under their own prefixes, cut for TP as a dense
// MLP's or whole under expert parallelism; the router stays plain. Which weights a checkpoint
// quantizes: model/families/declaration.h IsCheckpointQuantized.
//
// Every field and tensor is checked before use; a mismatch is an error naming the tensor (or the
// config field) and the numbers, never a crash or silent garbage.
// Thread-compatible value types and free functions.
#ifndef SHARDSERVE_MODEL_QUANTIZED_CHECKPOINT_H_
#define SHARDSERVE_MODEL_QUANTIZED_CHECKPOINT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/quant.h"

namespace shardserve {

class WeightSource;
struct Slice;

enum class QuantMethod : uint8_t { kGptq, kAwq, kCompressedTensors, kFp8 };

// AWQ's nibble of output t (0..7) within an int32 of 8 outputs.
inline constexpr int kAwqNibble[8] = {0, 4, 1, 5, 2, 6, 3, 7};

struct CheckpointQuant {
  QuantMethod method = QuantMethod::kGptq;
  int bits = 4;                 // integer formats: 4 or 8; fp8 formats: 8
  bool fp8 = false;             // e4m3 weights (FP8, compressed-tensors float-quantized)
  int64_t group_size = 128;     // > 0, or -1: one group over the whole input (per channel)
  bool sym = true;
  bool desc_act = false;        // GPTQ: g_idx may reorder the groups
  bool v2 = false;              // GPTQ checkpoint_format "gptq_v2": zeros stored without the -1
  bool per_tensor = false;      // compressed-tensors float-quantized strategy "tensor"
  int64_t block_out = 0, block_in = 0;  // FP8 weight_block_size
  std::vector<std::string> ignore;      // modules stored plain (names or "re:" patterns)

  int values_per_int32() const { return fp8 ? 1 : 32 / bits; }
  // Groups of an input of width `in`.
  int64_t groups(int64_t in) const { return group_size > 0 ? (in + group_size - 1) / group_size : 1; }
  // What each rank's range of outputs (q/k/v/gate/up) and of inputs (o/down) must be a multiple
  // of, for this format's packing (and, for inputs with TP > 1, its groups).
  int64_t output_multiple() const;
  int64_t input_multiple(bool split) const;
  // Whether decoder-layer module `module` (a weight name without ".weight") is stored quantized,
  // i.e. not in the ignore list.
  bool Quantizes(const std::string& module) const;
  // "GPTQ 4-bit, group_size 128, sym, gptq v1" and so on, for logs and errors.
  std::string Describe() const;
  // "GPTQ 4-bit", "AWQ 4-bit", "compressed-tensors int8", "FP8 e4m3": the plan's short name.
  std::string Name() const;
};

// The kernel layout every quantized weight of such a checkpoint takes (kInt4, kInt8, kFp8), or
// kNone where they are dequantized to float32, as the planner counts them. (A GPTQ desc_act
// checkpoint whose g_idx turns out trivial, or an 8-bit one whose zero points all happen to be
// 128, is mapped too; the planner then counts float32 for it, an overestimate.)
WeightQuant CheckpointQuantKernel(const CheckpointQuant& config);
// Whether `config` is an FP8 checkpoint with block scales whose blocks the fp8 kernels' input-group
// scales hold (block_in a multiple of kFp8GroupMultiple): its linear weights load as kFp8 with
// Fp8RowsLayout::group = block_in, unless a rank's inputs start inside a block.
bool Fp8BlocksMapped(const CheckpointQuant& config);
// Bytes a worker holds for a rank's [rows, cols] slice, starting at input column col0, of one of
// `config`'s quantized linear weights in a kernel layout, as ReadQuantizedLinear decides it; -1
// where it is dequantized (the caller counts the workers' dtype). What the planner counts.
int64_t CheckpointLinearBytes(const CheckpointQuant& config, int64_t rows, int64_t cols, int64_t col0);

// Parses config.json's quantization_config (the JSON text of that object). `source` names the file
// in errors. A quant_method other than the four above, bits, formats, strategies or fields this
// loader does not read: InvalidArgument or Unimplemented naming the field and its value.
absl::StatusOr<CheckpointQuant> ParseCheckpointQuant(const std::string& quantization_config_json,
                                                     const std::string& source);

// OK when the tensors of `prefix` exist with the shapes (and, where the format fixes it, dtypes)
// a [out, in] weight of `config` implies; else an error naming the tensor, the expected and the
// stored shape. Reads no data (except compressed-tensors' two-element weight_shape).
absl::Status CheckQuantizedLinear(const WeightSource& ckpt, const CheckpointQuant& config, const std::string& prefix,
                                  int64_t out, int64_t in);

// One rank's slice of a quantized linear layer, as MatMul will hold it.
struct QuantizedLinearSlice {
  int64_t m = 0, k = 0;               // local out, local in
  WeightQuant kernel = WeightQuant::kNone;  // the layout below that holds it; kNone: `dense`
  int64_t group = 0;                  // kFp8: inputs per scale (FP8 block scales' block_in); 0: one a row
  std::vector<Int4Group128> blocks;   // kInt4: [m, ceil(k / 128)], Int4GroupsLayout{m, k}
  std::vector<uint8_t> rows;          // kInt8 / kFp8: Int8RowsLayout{m, k} / Fp8RowsLayout{m, k, group}'s bytes
  std::vector<float> dense;           // kNone: [m, k], row-major
  std::string why_dense;              // kNone: why no kernel layout holds it, for the worker log

  // kernels/quant.h's layout of `kernel` (kNone: null): what Backend::PackQuantizedWeight takes.
  const void* stored() const;
  // kInt8 / kFp8 without groups: row r's scale; and the codes [m, k] inside `rows`.
  float row_scale(int64_t r) const;
  const uint8_t* codes() const { return rows.data() + Fp8RowsLayout{m, k, group}.scale_bytes(); }
  // kInt8 / kFp8: the scales [m, Fp8RowsLayout{m, k, group}.groups_per_row()] inside `rows`.
  const float* scales() const;
};

// Reads `slice` (dim 0: a range of the outputs, dim 1: a range of the inputs; Slice.end -1: to the
// end) of the [out, in] quantized weight `prefix` and converts it (onto a kernel layout or
// dequantized, above; `map` false: always dequantized, what the tests compare the layouts with).
// Errors name the tensor and what is wrong: NaN / Inf / zero scales, NaN fp8 values, g_idx out of
// [0, G), zero points that disagree with sym, a slice that cuts a packed int32.
absl::StatusOr<QuantizedLinearSlice> ReadQuantizedLinear(const WeightSource& ckpt, const CheckpointQuant& config,
                                                         const std::string& prefix, int64_t out, int64_t in,
                                                         const Slice& slice, bool map = true);

}  // namespace shardserve

#endif  // SHARDSERVE_MODEL_QUANTIZED_CHECKPOINT_H_
