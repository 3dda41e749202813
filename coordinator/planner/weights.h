// The weights a worker loads and the bytes one tensor-parallel rank's slice of them takes, cut
// exactly as the worker cuts them (model/families/, model/sharding.h), so the planner's memory
// figures are the worker's.
//
// The list comes from config.json (when no safetensors are at hand: a 72B model can be planned
// from its config alone) or from a checkpoint, whose tensors are then checked against config.json:
// every tensor a worker reads must be there, with the shape config.json implies and a dtype the
// loader converts. Plain value types; thread-compatible.
#ifndef SHARDSERVE_COORDINATOR_PLANNER_WEIGHTS_H_
#define SHARDSERVE_COORDINATOR_PLANNER_WEIGHTS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/quant.h"
#include "kernels/tensor.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/families/declaration.h"
#include "model/sharding.h"

namespace shardserve {

// The planner's tensors are the family's declaration (model/families/declaration.h): every tensor
// the workers load, with the shapes config.json implies (model/families/registry.h ModelWeights).
// Tied models have no lm_head.weight: their last stage loads embed_tokens.weight as its LM head.

// The declared tensors, read from `checkpoint` (shapes as stored). Also FailedPrecondition, naming
// it, for a bias in a plain checkpoint that the declaration does not list (the math would leave it
// out). FailedPrecondition naming the tensor,
// the checkpoint directory and both shapes when a tensor is missing, has another shape than
// config.json implies, or is stored in a dtype the loader cannot convert (F32, F16, BF16 only).
absl::StatusOr<std::vector<WeightDecl>> CheckpointWeights(const ModelConfig& config, const Checkpoint& checkpoint);

// Bytes of the checkpoint's tensors that no worker loads.
struct UnservedBytes {
  // Outside the served text model (neither under config.weight_prefix nor its LM head): a
  // multimodal checkpoint's vision tower and projector.
  uint64_t outside_text_model = 0;
  // Of layers after config.num_hidden_layers: a multi-token-prediction layer (DeepSeek-V3's and
  // GLM-4.5's layer 61 and 92), unless `mtp_loaded` (--speculative mtp).
  uint64_t after_last_layer = 0;
};
UnservedBytes UnservedCheckpointBytes(const ModelConfig& config, const Checkpoint& checkpoint, bool mtp_loaded);

// Elements of `tensor` that the rank described by `shard` holds.
int64_t ShardElements(const WeightDecl& tensor, const TpShard& shard);

// One TP rank's weight bytes, by part, in the dtype the workers load weights in.
struct RankWeights {
  uint64_t embedding = 0;        // first stage
  std::vector<uint64_t> layers;  // per decoder layer
  // Of `layers`, the routed experts' products (gate/up/down of each expert this rank holds): the
  // part of a sparse layer that a decode step reads only for the experts its tokens choose.
  std::vector<uint64_t> expert_layers;
  uint64_t final_norm = 0;       // last stage
  uint64_t lm_head = 0;          // last stage; for tied models, the embedding slice again
  bool tied = false;             // lm_head is embed_tokens: one copy when one stage is first and last
  // Per decoder layer: the CUDA backend's dequantize scratch for its largest quantized weight
  // (CudaDequantScratchBytes, kernels/backend.h, in the dtype counted); 0 where none is quantized.
  std::vector<uint64_t> dequant_scratch;
  // The multi-token-prediction layers' tensors among those counted (WeightPart::kMtp; registry.h
  // MtpWeights), and the same scratch for their largest quantized weight.
  uint64_t mtp = 0;
  uint64_t mtp_dequant_scratch = 0;
  // A CPU worker's host memory in flight while it loads one weight beyond what it keeps
  // (worker/shard/loader.cc; LoadStaging), by part: per decoder layer, the embedding, the final norm
  // and LM head, the multi-token-prediction layers.
  struct Staging {
    uint64_t in_flight = 0;  // the largest weight's float32 copies in flight while it is converted
    uint64_t kept = 0;       // the loader's staging buffer, grown to the largest weight converted on the host
  };
  std::vector<Staging> layer_staging;
  Staging embedding_staging, lm_head_staging, mtp_staging;

  // Bytes of the stage holding layers [first_layer, end_layer).
  uint64_t Stage(int64_t first_layer, int64_t end_layer, bool first_stage, bool last_stage) const;
  // Of those, the routed experts' bytes.
  uint64_t StageExperts(int64_t first_layer, int64_t end_layer) const;
  // The dequantize scratch a CUDA worker holding layers [first_layer, end_layer) allocates: the
  // largest of theirs (the backend grows one scratch to its largest weight's need).
  uint64_t DequantScratch(int64_t first_layer, int64_t end_layer) const;
  // The most host memory beyond its weights a CPU worker holding those layers (and the embedding, the
  // LM head and the multi-token-prediction layers where `first_stage`, `last_stage`) takes while it
  // loads: the largest weight's float32 copies in flight and the staging buffer the loader keeps from
  // the weights before it. Every weight is read in float32 (the CPU backend's activation dtype); a
  // plain one straight into the buffer it is then packed from (its float32 in flight beside the
  // packed copy the weights count), one converted on the host (an expert's part of a stacked tensor,
  // rows picked from a fused tensor, a quantized checkpoint's weight dequantized) as at most two
  // copies of what is read and three of its slice (read, transposed; picked, staged, uploaded).
  uint64_t LoadStaging(int64_t first_layer, int64_t end_layer, bool first_stage, bool last_stage) const;
};

// `quant`: how the linear layers' weights are stored (the worker's ShardSpec::weight_quant);
// `products`: the dtype the products' weights that are not quantized are stored in where it is not
// `dtype` (PlanOptions::products_dtype).
RankWeights CountRankWeights(const ModelConfig& config, const std::vector<WeightDecl>& tensors, const TpShard& shard,
                             DType dtype, WeightQuant quant = WeightQuant::kNone,
                             std::optional<DType> products = std::nullopt);

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_PLANNER_WEIGHTS_H_
