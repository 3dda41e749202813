// The model families this server runs, keyed on config.json's "architectures", and the questions
// the rest of the code asks of a model's declaration (model/families/declaration.h): which tensors
// a checkpoint holds, which a stage loads, which buffers a step needs.
#ifndef SHARDSERVE_MODEL_FAMILIES_REGISTRY_H_
#define SHARDSERVE_MODEL_FAMILIES_REGISTRY_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "model/families/declaration.h"

namespace shardserve {

// The declaration of `architecture` ("Qwen3ForCausalLM"); null when this server has none.
const FamilyDeclaration* FindFamily(std::string_view architecture);
// The architectures FindFamily knows, comma-separated, for error messages.
std::string SupportedArchitectures();

// Every tensor of the model's checkpoint, with the shapes config.json implies (config.family's
// declaration); empty for a config without a family.
std::vector<WeightDecl> ModelWeights(const ModelConfig& config);

// The tensors of the model's multi-token-prediction layers (FamilyDeclaration::mtp_weights), in
// load order; empty for a model without them (num_nextn_predict_layers 0, or a family that has none).
std::vector<WeightDecl> MtpWeights(const ModelConfig& config);

// Whether `w` is an expert's product that a ModelConfig::mxfp4_experts checkpoint stores in MXFP4
// (a part of a stacked tensor, WeightDecl::stack; the biases stay plain).
bool IsMxfp4Part(const ModelConfig& config, const WeightDecl& w);
// The tensors such a part's stacked tensor is stored as (model/mxfp4.h): <name>_blocks
// [E, out, in / 32, 16] and <name>_scales [E, out, in / 32], out and in as MatMul takes the expert.
std::vector<std::pair<std::string, std::vector<int64_t>>> Mxfp4Tensors(const WeightDecl& w);

// The parameters one token reads (ModelConfig::ParameterCount's, with a sparse layer's experts
// counted num_experts_per_tok times, not num_experts): the model's active parameters.
int64_t ActiveParameterCount(const ModelConfig& config);

// What the stage holding layers [first_layer, end_layer) loads, in load order: the embedding (first
// stage), its layers' tensors, the final norm and the LM head (last stage). A tied LM head is the
// embedding's tensor under the role kLmHead.
std::vector<WeightDecl> StageWeights(const ModelConfig& config, int64_t first_layer, int64_t end_layer,
                                     bool first_stage, bool last_stage);

// Every buffer one step works in on the rank `shard` of a stage, for `limits`: the step's inputs
// (ids, positions, sequences, cache slots, block tables, logit rows), the residual stream and its
// norm, the family's layer buffers, and on the last stage the logits (this rank's slice, every
// rank's gathered when TP > 1, the whole rows).
std::vector<StepBufferDecl> StepBuffers(const ModelConfig& config, const TpShard& shard, DType act,
                                        const StepLimits& limits, bool last_stage);

// The buffers a head's shard (a multi-token-prediction layer's, ShardSpec::mtp, or an EAGLE-3
// head's, ShardSpec::eagle3) adds to StepBuffers' for `limits`: the normed embeddings and hidden states of a step's tokens side by side ("head_pairs",
// [2 n + 1, hidden], the last row zero), their concatenation ("head_cat", [n, 2 hidden]) and the
// rows that gather it ("head_cat_rows", [2 n]).
std::vector<StepBufferDecl> HeadStepBuffers(const ModelConfig& config, DType act, const StepLimits& limits);

// The limits a head (the model's multi-token-prediction layer or an EAGLE-3 head) runs within beside
// a model served within `model` (worker/head_runner.h, --speculative mtp or eagle3):
// model/step_limits.h DraftStepLimits', with room
// for one more token a sequence a step (a prefill chunk's last row, which waits for its next token);
// its KV cache is DraftStepLimits' pool (the model's blocks and room for every sequence's guesses).
// The planner counts the head's cache and buffers from these.
StepLimits HeadStepLimits(const StepLimits& model);

// The buffers worker/head_runner.h holds beside the head's shard for a model served within
// `model`: the hidden rows the head reads ("head_table", [max_seqs_per_step + max_tokens_per_step,
// hidden]: a waiting row per sequence slot, then a step's rows), the rows a forward gathers from it
// ("head_src_rows", [HeadStepLimits' max_tokens_per_step] I32) and the guesses ("head_ids",
// [max_seqs_per_step] I32).
std::vector<StepBufferDecl> HeadRunnerBuffers(const ModelConfig& config, DType act, const StepLimits& model);

// The buffers an EAGLE-3 head's shard (ShardSpec::eagle3) adds to HeadStepBuffers' (which it uses as
// the MTP layer does): its fc's input, the model's hidden states at its aux layers side by side
// ("eagle3_cat", [n, aux layers x the model's hidden]), and the rows that gather it
// ("eagle3_cat_rows", [aux layers x n]).
std::vector<StepBufferDecl> Eagle3StepBuffers(const ModelConfig& config, DType act, const StepLimits& limits);

// The buffer every worker of a model served with an EAGLE-3 head keeps beside StepBuffers' for
// `limits` (ShardSpec::aux_hidden_layers, `aux_layers` of them): the model's input hidden state at
// each of those layers, the earlier stages' received with the step's hidden state ("aux_hidden",
// [aux_layers x n, hidden]); none when aux_layers is 0.
std::vector<StepBufferDecl> AuxHiddenBuffers(const ModelConfig& config, int64_t aux_layers, DType act,
                                             const StepLimits& limits);

}  // namespace shardserve

#endif  // SHARDSERVE_MODEL_FAMILIES_REGISTRY_H_
