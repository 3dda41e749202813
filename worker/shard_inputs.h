// The inputs of a model shard (worker/shard/): which part of the model it holds (ShardSpec, at
// load) and one step's work on the host (StepBatch, every step). The worker builds them from its
// coordinator's messages and checks them first (worker/step_checks.h).
#ifndef SHARDSERVE_WORKER_SHARD_INPUTS_H_
#define SHARDSERVE_WORKER_SHARD_INPUTS_H_

#include <cstdint>
#include <vector>

#include "kernels/quant.h"
#include "kernels/tensor.h"

namespace shardserve {

// Which part of the model this process holds.
struct ShardSpec {
  int64_t first_layer = 0;  // inclusive
  int64_t end_layer = -1;   // exclusive; -1 = through the last layer
  int tp_rank = 0;
  int tp_size = 1;
  // How the linear layers' weights (q/k/v/o, gate/up/down) are stored: quantized at load, each rank
  // its own slice (kernels/quant.h). Embeddings, norms and the LM head keep the activation dtype.
  WeightQuant weight_quant = WeightQuant::kNone;
  // Expert parallelism (model/sharding.h): this rank holds its block of the experts whole, and the
  // mixture-of-experts layers exchange tokens with the other ranks by all-to-all.
  bool expert_parallel = false;
  // The model's multi-token-prediction layer (ModelConfig::num_nextn_predict_layers) as a shard of
  // its own (worker/head_runner.h): first_layer is num_hidden_layers, end_layer one past it, TP 1;
  // it loads MtpWeights, embeds the next tokens and reads the model's hidden states (ModelShard).
  bool mtp = false;
  // An EAGLE-3 head as a shard of its own (worker/head_runner.h, ModelConfig::eagle3): its one layer,
  // whole on one rank; it embeds the next tokens and reads a hidden state the runner puts in
  // hidden() (ModelShard::Forward).
  bool eagle3 = false;
  // The model's layers whose input hidden state (the residual stream before the layer) an EAGLE-3
  // head reads, ascending (Eagle3AuxLayers): every stage keeps those of its layers in aux_hidden()
  // and passes them on with its output. Empty: none kept.
  std::vector<int64_t> aux_hidden_layers = {};
  // The embedding table to look tokens up in, another shard's, instead of loading one: an EAGLE-3
  // head's that shares the served model's (Eagle3SharesEmbedding, worker/head_runner.h). That shard
  // must outlive this one. Null: the shard loads its own.
  const Tensor* embedding = nullptr;
};

// One step's work, on the host. Token t belongs to sequence token_seq[t] at position
// positions[t], and its K/V go to cache slot slots[t]. Block tables are row-major
// [num_seqs, max_blocks_per_seq]. logit_rows lists the tokens whose logits are wanted (the last
// token of each sequence that samples this step). Where the sliding layers have a pool of their own
// (StepLimits::num_sliding_kv_blocks > 0, model/kv_blocks.h InSlidingPool), those layers write token
// t's K/V to sliding_slots[t] and read through sliding_block_tables, shaped as slots and
// block_tables; both are empty otherwise.
struct StepBatch {
  std::vector<int32_t> token_ids;  // [n] (first stage only)
  std::vector<int32_t> positions;  // [n]
  std::vector<int32_t> token_seq;  // [n]
  std::vector<int32_t> slots;      // [n]
  std::vector<int32_t> block_tables;
  std::vector<int32_t> sliding_slots;         // [n] or empty
  std::vector<int32_t> sliding_block_tables;  // like block_tables, or empty
  int32_t num_seqs = 0;
  std::vector<int32_t> logit_rows;  // [m]

  // Empty, keeping every vector's capacity (a step's batch is rebuilt in place).
  void Clear() {
    for (std::vector<int32_t>* v : {&token_ids, &positions, &token_seq, &slots, &block_tables, &sliding_slots,
                                    &sliding_block_tables, &logit_rows}) {
      v->clear();
    }
    num_seqs = 0;
  }
};

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_SHARD_INPUTS_H_
