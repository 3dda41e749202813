// MXFP4 (the OCP microscaling format with FP4 E2M1 elements), as gpt-oss's published checkpoints
// store their experts (config.json quantization_config quant_method "mxfp4"): a stacked expert
// weight <name> [E, out, in] (transformers' orientation, before its transpose) is
//   <name>_blocks  U8 [E, out, in / 32, 16]   32 codes per block, two a byte: element 2 j of a block
//                                             is the low nibble of byte j, element 2 j + 1 the high
//   <name>_scales  U8 [E, out, in / 32]       E8M0: the block's scale is 2^(s - 127)
// and each 4-bit code c is kMxfp4Values[c] (sign bit 3, then e2m1), so
//   w[e][o][32 g + i] = kMxfp4Values[code i of block (e, o, g)] * 2^(scales[e][o][g] - 127),
// transformers' integrations/mxfp4.py convert_moe_packed_tensors (FP4_VALUES, then torch.ldexp).
// Plain functions; thread-safe.
#ifndef SHARDSERVE_MODEL_MXFP4_H_
#define SHARDSERVE_MODEL_MXFP4_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/quant.h"

namespace shardserve {

// The format itself (kMxfp4BlockSize, kMxfp4Values, Mxfp4Block, the stored layout and its
// reference) is kernels/quant.h's; here, reading it from a checkpoint.

// Dequantizes rows x cols values (cols a multiple of 32) from `blocks` [rows, cols / 32, 16] and
// `scales` [rows, cols / 32] into `out` [rows, cols] float32 (exact: every value is a code's value
// times a power of two). InvalidArgument naming `name`, the row and the block when a scale makes a
// value that float32 cannot hold (a scale byte of 255 on a code of magnitude 2 or more overflows).
absl::Status DequantizeMxfp4(const uint8_t* blocks, const uint8_t* scales, int64_t rows, int64_t cols, float* out,
                             const std::string& name);

// MXFP4 as the fp8 kernels' layout with input-group scales (kernels/quant.h Fp8RowsLayout, group
// 32), exactly: every e2m1 value is an e4m3 one, and every E8M0 scale a float32 (2^-127 a
// subnormal). Rows `rows` (indices into `blocks` [*, groups, 16] / `scales` [*, groups]) and blocks
// [group0, group0 + num_groups) of each become `out`: Fp8RowsLayout{rows.size(), num_groups * 32,
// 32}'s bytes (scales, then codes), w[r][c] = e4m3(code) x scale[r][c / 32], DequantizeMxfp4's
// values bit for bit. False (out unspecified) when a scale byte is 255, which float32 cannot hold
// as a power of two (DequantizeMxfp4 then says whether a value overflows).
bool Mxfp4AsFp8Groups(const uint8_t* blocks, const uint8_t* scales, int64_t groups, const std::vector<int64_t>& rows,
                      int64_t group0, int64_t num_groups, std::vector<uint8_t>* out);

// Rows `rows` (indices into `blocks` [*, groups, 16] / `scales` [*, groups]) and blocks [group0,
// group0 + num_groups) of each as kernels/quant.h's Mxfp4RowsLayout{rows.size(), num_groups * 32}
// into `out`: the checkpoint's bytes as they are, codes then scales. False (out unspecified) when a
// value is past float32 (kernels/quant.h Mxfp4BlockFinite: a scale byte of 255, or 253 / 254 on a
// large code), which the kernels refuse (DequantizeMxfp4 then refuses it too, naming the block).
bool Mxfp4Rows(const uint8_t* blocks, const uint8_t* scales, int64_t groups, const std::vector<int64_t>& rows,
               int64_t group0, int64_t num_groups, std::vector<uint8_t>* out);

// The bytes MXFP4 stores for `elements` values (a multiple of 32): half a byte each and one scale
// byte per 32 (4.25 bits a value): Mxfp4RowsLayout's.
inline int64_t Mxfp4Bytes(int64_t elements) {
  return Mxfp4RowsLayout{1, elements}.bytes();
}

}  // namespace shardserve

#endif  // SHARDSERVE_MODEL_MXFP4_H_
