// The running batch as a worker holds it, by sequence id (worker.proto StepPlan, protocol version
// 2, as vLLM v1's persistent batch): each sequence's block table, sampling settings, prompt
// length, the number of tokens fed to it so far and, when the sampler needs them, the fed tokens
// themselves. Apply() takes a stateful StepPlan, updates the state and expands the plan into
// what the stateless plans of version 1 carried: a StepBatch for ModelShard::Forward and one
// RowSampling per logit row for the Sampler.
//
// What a worker derives, for a row of sequence s feeding n tokens from start_position p0:
//   positions   p0 .. p0 + n - 1 (p0 must equal the tokens fed to s so far; a new sequence
//               counts the num_cached_tokens its shared blocks hold as fed: they are never
//               written again, since slots come from positions >= p0 only);
//   slots       table[pos / block_size] * block_size + pos % block_size;
//   block table s's, padded with block 0 to max_blocks_per_seq (row-major [rows, width]);
//   sliding     where the sliding layers have a pool of their own (num_sliding_kv_blocks > 0), the
//               same slots and table from s's sliding table (NewSeq.sliding_block_ids), which is
//               always as long as its table;
//   logit row   the row's last token, when the row samples (its last row_num_sampled tokens
//               when the row verifies proposed tokens: speculative decoding); before them, one
//               per scored position (row_num_scored: prompt log-probabilities), whose RowSampling
//               is logprobs with the sequence's prompt_logprobs alternatives and scored_id, the
//               prompt's next token (scored_ids);
//   draw_index  p0 + n - prompt_len (a row samples only once every token of s is fed, so this is
//               the number of tokens generated so far: the coordinator's tokens.size() -
//               prompt_len); at a sampled position p before the row's last, p + 1 - prompt_len;
//   penalties   penalty_prompt_ids = the fed tokens at positions < prompt_len (repetition penalty
//               on), penalty_output_ids = those at positions >= prompt_len (any penalty on): the
//               prompt and every token generated so far, in order, as the coordinator sent them
//               in version 1 (a preempted sequence comes back new and is fed from position 0);
//   fed sample  a row with row_feeds_sample (asynchronous scheduling) feeds the token the group
//               sampled for s at its last sampled position (RecordSamples), which must be the
//               row's position p0; only in a group of one stage (`feeds_samples`), whose workers
//               both embed and are given the samples.
//
// Every bad plan is InvalidArgument naming the step and what is wrong, never a crash: an unknown or
// twice-new or twice-freed id, a num_cached_tokens off the block grid, past its blocks or with a
// penalty on, a table past max_blocks_per_seq, a row that feeds a sample where this worker cannot
// (not its group's only worker), of more than one token, or with no sample of s at its
// position, a block outside [0, num_kv_blocks) (a sliding block outside [0, num_sliding_kv_blocks),
// sliding ids where there is no such pool, or a sliding table not as long as the table), a row
// whose positions are not the next ones or lie beyond its table, more rows, tokens or held
// sequences than the limits, lists of unequal length, a token id outside the vocabulary. The state
// is changed as the plan is read, so after an error it is undefined: the worker runs no further
// steps (StepExecutor), and the coordinator starts a new group with new workers.
//
// Bounds: at most max_seqs_per_step sequences are held (the coordinator's running set, whose
// freed ids come before its new ones). Memory is allocated once, at construction: a slot per
// sequence with its block table reserved to max_blocks_per_seq, the id map reserved, the batch's
// vectors reserved to the limits. Token histories (kept only with `keep_history`, for sequences
// with a penalty on) grow with their sequences; their capacity stays with the slot.
//
// Threading: not thread-safe; one plan at a time.
#ifndef SHARDSERVE_WORKER_PERSISTENT_BATCH_H_
#define SHARDSERVE_WORKER_PERSISTENT_BATCH_H_

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "model/step_limits.h"
#include "shardserve/v1/worker.pb.h"
#include "worker/shard_inputs.h"  // StepBatch

namespace shardserve {

class PersistentBatch {
 public:
  // For plans within `limits` (checked by the caller: ValidateDecided) over a vocabulary of
  // `vocab_size` ids. With `keep_history` (the worker that samples) the fed tokens of sequences
  // with a penalty on are kept and handed to the sampler; elsewhere the penalty ids stay empty.
  // With `feeds_samples` (a group of one stage: its workers embed, and are given the samples)
  // rows may feed the samples RecordSamples kept (StepPlan.row_feeds_sample).
  PersistentBatch(const StepLimits& limits, int64_t vocab_size, bool keep_history, bool feeds_samples = false);

  // Applies `plan` (freed ids, new sequences, appended blocks, rows: in that order) and fills
  // `batch` (its vectors cleared and refilled within their capacity) and `sampling` (one per
  // logit row, elements reused). `batch` should come from Reserve() for no allocation.
  absl::Status Apply(const v1::StepPlan& plan, StepBatch* batch,
                     google::protobuf::RepeatedPtrField<v1::RowSampling>* sampling);

  // The sampler drew `sampled` (one id per logit row of the last Apply()): each row's sample at its
  // last sampled position is kept for a later row that feeds it. Ids past the logit rows are
  // ignored; rows without an id keep none.
  void RecordSamples(const google::protobuf::RepeatedField<int32_t>& sampled);

  // Reserves `batch`'s vectors for the largest step within the limits.
  void Reserve(StepBatch* batch) const;

  // Drops every sequence (the group re-formed: the coordinator recomputes them all, as new ones).
  void Clear();

  // Sequences held.
  int64_t size() const { return static_cast<int64_t>(index_.size()); }
  bool Holds(uint64_t seq_id) const { return index_.contains(seq_id); }
  // Tokens fed to a held sequence so far; -1 for an unknown id.
  int64_t fed(uint64_t seq_id) const;
  // A held sequence's block table; empty for an unknown id.
  std::vector<int32_t> blocks(uint64_t seq_id) const;
  // A held sequence's sliding layers' block table; empty for an unknown id or without that pool.
  std::vector<int32_t> sliding_blocks(uint64_t seq_id) const;

 private:
  struct Seq {
    uint64_t id = 0;
    std::vector<int32_t> blocks;  // block table, reserved to max_blocks_per_seq
    std::vector<int32_t> sliding_blocks;  // the sliding layers' table (as long as blocks), likewise
    int64_t fed = 0;              // tokens fed so far (from num_cached_tokens): the next row starts here
    int64_t prompt_len = 0;
    bool repetition = false;      // repetition penalty on: keep the prompt
    bool penalty = false;         // any penalty on: keep the completion
    uint64_t last_step = 0;       // Apply() call that last gave it a row (1-based; 0: none)
    // Its last sample (RecordSamples) and the position that token takes; -1: none.
    int32_t sample = -1;
    int64_t sample_at = -1;
    // Settings; with keep_history, the penalty ids hold the fed tokens (see the file comment).
    v1::RowSampling sampling;
  };

  // Applies the plan's rollbacks (speculative decoding: rejected proposals) to held sequences.
  absl::Status Rollback(const v1::StepPlan& plan);
  // Appends `ids` to s's table and `sliding_ids` to its sliding table (ids in range, as many of
  // each where the sliding pool exists, none of the second where it does not).
  absl::Status AppendBlocks(uint64_t step_id, Seq& s, const google::protobuf::RepeatedField<int32_t>& ids,
                            const google::protobuf::RepeatedField<int32_t>& sliding_ids, const char* what);

  // ---- Constant after construction ----
  StepLimits limits_;
  int64_t vocab_size_ = 0;
  bool keep_history_ = false;
  bool feeds_samples_ = false;

  // ---- State ----
  std::vector<Seq> slots_;                        // [max_seqs_per_step]
  std::vector<int32_t> free_slots_;               // indices into slots_ not holding a sequence
  absl::flat_hash_map<uint64_t, int32_t> index_;  // seq id -> slot
  uint64_t applied_ = 0;                          // Apply() calls so far
  // Per logit row of the last Apply(): the slot whose sample it is, or -1 for a position before the
  // row's last (reserved to max_seqs_per_step).
  std::vector<int32_t> sampled_slots_;
};

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_PERSISTENT_BATCH_H_
