// Published GPTQ checkpoints (config.json quantization_config with quant_method "gptq"), loaded
// as they are: each quantized linear layer <prefix> is stored as four tensors instead of
// <prefix>.weight [out, in]:
//   <prefix>.qweight  I32 [in / p, out]   p = 32 / bits values per int32, packed along the input:
//                                         value i of column c is bits (i % p) x bits.. of
//                                         qweight[i / p][c] (lowest bits first)
//   <prefix>.qzeros   I32 [G, out / p]    zero points, packed the same way along the output
//   <prefix>.scales   F16/BF16/F32 [G, out]
//   <prefix>.g_idx    I32 [in]            the group of each input, in [0, G)
// with G = ceil(in / group_size) groups (1 when group_size is -1), and
//   w[c][i] = scales[g][c] x (q[i][c] - z[g][c]),  g = g_idx[i],
// where z is the stored zero plus 1 in checkpoint_format "gptq" (v1; AutoGPTQ stores zero - 1)
// and the stored zero in "gptq_v2". sym = true checkpoints must store z = 2^(bits - 1).
//
// Two ways to hold a weight (ReadGptqLinear):
// - mapped: 4 bits, group_size 128, g_idx[i] == i / 128 for every input (no desc_act reorder):
//   the values, scales (f16 widened to f32, exact) and zero points are repacked, bit for bit, into
//   kernels/quant.h's Int4Group128 blocks, which the int4 kernels multiply (4.5 bits a weight).
// - dequantized: anything else GPTQ allows (8 bits, other group sizes, -1, desc_act with a
//   shuffled g_idx): w is computed exactly in float32 at load and multiplied as a float32
//   weight. This path saves no memory yet (the worker log says so).
//
// Tensor parallelism: column-parallel layers (q/k/v/gate/up) take a range of the outputs (a
// multiple of p, for qzeros' packing); row-parallel ones (o/down) a range of the inputs (a
// multiple of p, for qweight's packing, and of group_size when groups are contiguous, so that no
// rank cuts a group: model/sharding.h CheckGptqShard). Each rank reads only its slice of qweight,
// and of qzeros and scales along the output; g_idx, and the groups along the input, whole.
//
// Every field and tensor is checked before use; a mismatch is an error naming the tensor (or the
// config field) and the numbers, never a crash or silent garbage.
// Thread-compatible value types and free functions.
#ifndef SHARDSERVE_MODEL_GPTQ_H_
#define SHARDSERVE_MODEL_GPTQ_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/quant.h"

namespace shardserve {

class WeightSource;
struct Slice;

struct GptqConfig {
  int bits = 4;                 // 4 or 8
  int64_t group_size = 128;     // > 0, or -1: one group over the whole input
  bool sym = true;
  bool desc_act = false;
  bool v2 = false;              // checkpoint_format "gptq_v2": zeros stored without the -1
  int values_per_int32() const { return 32 / bits; }
  // Groups of an input of width `in`.
  int64_t groups(int64_t in) const { return group_size > 0 ? (in + group_size - 1) / group_size : 1; }
};

// Whether every weight of such a checkpoint takes the mapped path (4 bits, group_size 128, no
// desc_act), as the planner counts it. (A desc_act checkpoint whose g_idx turns out trivial is
// mapped too; the planner then counts float32 for it, an overestimate.)
bool GptqMapsToInt4(const GptqConfig& config);

// Parses config.json's quantization_config (the JSON text of that object). `source` names the file
// in errors. quant_method other than "gptq", bits other than 4 / 8, group_size 0 or < -1, a
// checkpoint_format other than "gptq" / "gptq_v2": InvalidArgument or Unimplemented naming the
// field and its value.
absl::StatusOr<GptqConfig> ParseGptqConfig(const std::string& quantization_config_json, const std::string& source);

// OK when the four tensors of `prefix` exist with the shapes and dtypes a [out, in] weight of
// `config` implies; else an error naming the tensor, the expected and the stored shape. Reads no data.
absl::Status CheckGptqLinear(const WeightSource& ckpt, const GptqConfig& config, const std::string& prefix,
                             int64_t out, int64_t in);

// One rank's slice of a GPTQ linear layer, as MatMul will hold it.
struct GptqLinearSlice {
  int64_t m = 0, k = 0;               // local out, local in
  bool mapped = false;                // true: `blocks`; false: `dense`
  std::vector<Int4Group128> blocks;   // [m, ceil(k / 128)], Int4GroupsLayout{m, k}
  std::vector<float> dense;           // [m, k], row-major
};

// Reads `slice` (dim 0: a range of the outputs, dim 1: a range of the inputs; Slice.end -1: to the
// end) of the [out, in] GPTQ weight `prefix` and converts it (mapped or dequantized, above). Errors
// name the tensor and what is wrong: NaN / Inf / zero scales, g_idx out of [0, G), zero points
// that disagree with sym, a slice that cuts a packed int32.
absl::StatusOr<GptqLinearSlice> ReadGptqLinear(const WeightSource& ckpt, const GptqConfig& config,
                                               const std::string& prefix, int64_t out, int64_t in, const Slice& slice);

}  // namespace shardserve

#endif  // SHARDSERVE_MODEL_GPTQ_H_
