// What a worker checks in every message its coordinator sends (worker.proto CoordinatorMessage),
// before it acts on it: the Assignment (alone, then against the model's config.json), a Regroup,
// an adopting Assignment, and each step (the StepBatch a plan expands into, and its sampling
// rows). The coordinator is a peer over the network: a message from a buggy or hostile one is an
// InvalidArgument naming what is wrong, never an out-of-range index.
//
// The types they check a step and a shard as (ShardSpec, StepBatch) are the shard's inputs:
// worker/shard_inputs.h.
//
// Pure functions of their arguments (no backend, no collectives, no I/O), so that every worker of
// a group reaches the same verdict, and so that fuzz/coordinator_message_fuzzer.cc runs exactly
// these on arbitrary messages. StepExecutor, ModelShard and Sampler call them (one home each).
//
// Threading: none of these keep state; call them from any thread.
#ifndef SHARDSERVE_WORKER_STEP_CHECKS_H_
#define SHARDSERVE_WORKER_STEP_CHECKS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "model/config.h"
#include "model/step_limits.h"
#include "shardserve/v1/worker.pb.h"
#include "worker/shard_inputs.h"

namespace shardserve {

// An Assignment on its own: model path set, stage and TP rank inside their counts (at most 1024
// each), the groups it needs named, a known weight quantization, step limits present and decided
// (StepLimits::ValidateDecided), a collective timeout in (0, 24 h].
absl::Status CheckAssignment(const v1::Assignment& a);

// The shard `spec` of the model `config` within `limits`, as ModelShard::Load checks it before
// reading any weight: a non-empty layer range inside the model's layers (end_layer < 0: through
// the last), decided limits with a sliding layers' pool (num_sliding_kv_blocks > 0) only for a model
// that has one (model/kv_blocks.h SlidingPoolWindow), a TP split the heads, MLP and vocabulary allow (ComputeTpShard), and a quantization
// the TP split allows (CheckQuantizedShard).
absl::Status CheckShard(const ModelConfig& config, const ShardSpec& spec, const StepLimits& limits);

// The ShardSpec an Assignment asks for.
ShardSpec ShardSpecOf(const v1::Assignment& a);

// The assignment's stage agrees with its layers: stage 0 holds layer 0 (the embedding), the last
// stage holds the last layer (the LM head), and no other stage holds either.
absl::Status CheckStageLayers(const v1::Assignment& a, const ModelConfig& config);

// A Regroup for the worker assigned `a` (its stage and TP size) whose group is at `epoch`: a later
// epoch, and every group it needs named.
absl::Status CheckRegroup(const v1::Assignment& a, uint64_t epoch, const v1::Regroup& r);

// An adopting Assignment `wanted` for a worker holding the shard of `held` at `epoch`: the same
// shard (SameShard, model/shard_identity.h: FailedPrecondition), then CheckRegroup of its epoch and
// group names.
absl::Status CheckAdopt(const v1::Assignment& held, uint64_t epoch, const v1::Assignment& wanted);

// The Regroup an adopting Assignment amounts to: its epoch, group names and rendezvous token.
v1::Regroup RegroupOf(const v1::Assignment& a);

// The sampling rows of step `step_id`: InvalidArgument naming the step, the row and the field for
// the first out-of-range one: temperature finite >= 0; top_k >= 0; top_p and min_p in [0, 1];
// repetition_penalty 0 or in (0, 10]; presence/frequency_penalty in [-2, 2]; top_logprobs in
// [0, 20] and only with logprobs; penalty ids in [0, vocab_size) (model/sampling_bounds.h).
absl::Status CheckRowSampling(uint64_t step_id, const google::protobuf::RepeatedPtrField<v1::RowSampling>& rows,
                              int64_t vocab_size);

// The token masks of step `plan` (constrained decoding) for a last stage sampling `logit_rows`
// rows over `vocab_size` ids: mask_logit_rows strictly increasing in [0, logit_rows), exactly
// ceil(vocab_size / 32) mask_words per masked row, no bit at or past vocab_size set, and at least
// one token allowed per row. On success, (*masks)[i] points at logit row i's mask in the plan (null:
// not masked); `masks` is resized to logit_rows.
absl::Status CheckTokenMasks(const v1::StepPlan& plan, int64_t logit_rows, int64_t vocab_size,
                             std::vector<const uint32_t*>* masks);

// A step batch for a shard of `config` within `limits` (`first_stage`: it embeds token ids): 1 to
// max_tokens_per_step tokens with equal-length lists, 1 to max_seqs_per_step sequences, block
// tables of num_seqs x max_blocks_per_seq entries in [0, num_kv_blocks) (with a sliding layers'
// pool, sliding slots and tables as many, inside that pool; none without), token ids in the
// vocabulary, positions inside the context (the tables' width and max_position_embeddings), cache
// slots in the cache, logit rows among the step's tokens.
absl::Status CheckStepBatch(const StepBatch& b, const StepLimits& limits, const ModelConfig& config, bool first_stage);

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_STEP_CHECKS_H_
