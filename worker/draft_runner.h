// Speculative decoding's draft model on the worker that samples (docs/speculative-decoding.md): a
// small model with the target's vocabulary, whole in this process, run right after the step's
// sampling to guess each sampled sequence's next tokens for the coordinator's next step, with no
// round trip of its own.
//
// What it does with each plan (after the worker's PersistentBatch accepted it):
//   Apply    follows the plan as the persistent batch does: freed sequences drop their draft state,
//            rollbacks cut the fed tokens, a new sequence starts from the ids its cached prefix
//            holds (NewSeq.cached_token_ids: no row feeds those), every row appends its fed tokens.
//   Propose  after sampling, when the plan asks (StepPlan.num_draft_tokens = K > 0), for every row
//            that samples: the sequence's tokens as the coordinator's verification will leave them
//            (Scheduler::Verify: the fed proposed tokens kept while the sample at the position
//            before each equals it, then the sample after the last kept one), the draft's KV cut
//            back to the longest prefix of them it holds, the missing tokens fed (usually 1 or 2;
//            a whole prompt the first time), then K greedy (argmax) tokens, batched over the rows:
//            K draft forwards in all (more only when the missing tokens exceed a step), K ids per
//            row into StepResult.draft_ids.
//
// The draft's KV cache: its own paged pool (model/step_limits.h DraftStepLimits) of as many blocks as the model's cache
// and room for every sequence's guesses past its tokens (the proposed tokens are fed past the
// sequence's last), at most max_seqs_per_step sequences of max_model_len + kMaxSpeculativeTokens tokens.
// A sequence takes blocks as its draft KV grows and gives back those past a cut. Per sequence it
// remembers which tokens its KV holds (positions 0 on); a rollback cuts that record and its blocks.
// The model's cache may share a cached prefix among sequences where the draft's holds a copy per
// sequence: a row that finds too few free blocks gets no guesses that step (starved()), and the
// verification turns its padding away.
//
// Memory: every buffer is sized at construction (the per-sequence token records reserved to the
// slot's length, the draft's step batch to its limits). Ownership: owns the DraftModel.
// Threading: not thread-safe; the step's thread.
#ifndef SHARDSERVE_WORKER_DRAFT_RUNNER_H_
#define SHARDSERVE_WORKER_DRAFT_RUNNER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "google/protobuf/repeated_field.h"
#include "model/step_limits.h"
#include "shardserve/v1/worker.pb.h"
#include "worker/head_kv_pool.h"
#include "worker/shard_inputs.h"  // StepBatch

namespace shardserve {

// The draft's forward pass: a whole model over a StepBatch laid out as ModelShard::Forward takes it
// (worker/shard_inputs.h), in the draft's own KV cache, with the greedy id after each logit row.
// ShardDraftModel (worker/step_executor.cc) is a ModelShard; tests pass models of their own.
class DraftModel {
 public:
  virtual ~DraftModel() = default;
  // Runs `batch` and sets (*next)[i] to the argmax id of the logits after batch.logit_rows[i]
  // (next->size() == logit_rows.size() on success).
  virtual absl::Status Forward(const StepBatch& batch, std::vector<int32_t>* next) = 0;
};

class DraftRunner {
 public:
  // For plans within `target` (the worker's limits) over a vocabulary of `vocab_size` ids; `model`
  // runs within DraftStepLimits(target) and takes positions below `max_positions` (the draft's context:
  // DraftStepLimits' max_model_len, or less where the draft's config says so). A sequence longer than
  // that gets padding for guesses (its last token, repeated: the verification refuses what is
  // wrong), as do the guesses past it.
  DraftRunner(std::unique_ptr<DraftModel> model, const StepLimits& target, int64_t vocab_size, int64_t max_positions);

  // Follows `plan` (see above). Call after PersistentBatch::Apply accepted it. InvalidArgument for a
  // new sequence whose cached_token_ids are not its num_cached_tokens ids of the vocabulary, or a
  // num_draft_tokens outside [0, kMaxSpeculativeTokens]; the state is undefined after an error.
  absl::Status Apply(const v1::StepPlan& plan);

  // After the step sampled `sampled` (one id per logit row, row after row): when the plan asks,
  // appends num_draft_tokens guesses per row that samples to *draft_ids. Errors are the draft
  // model's.
  absl::Status Propose(const v1::StepPlan& plan, const google::protobuf::RepeatedField<int32_t>& sampled,
                       google::protobuf::RepeatedField<int32_t>* draft_ids);

  // Drops every sequence (the group re-formed, or the coordinator went away).
  void Clear();

  // For tests: the tokens a held sequence was fed, and those whose KV the draft holds (empty for
  // an unknown id); draft forwards run so far.
  std::vector<int32_t> fed(uint64_t seq) const;
  std::vector<int32_t> held(uint64_t seq) const;
  int64_t forwards() const { return forwards_; }
  // Rows that got no guesses for want of free blocks; blocks free now.
  int64_t starved() const { return starved_; }
  int64_t free_blocks() const { return pool_.free_blocks(); }

 private:
  struct Seq {
    std::vector<int32_t> fed;   // the tokens fed to the model so far (the cached prefix included)
    std::vector<int32_t> held;    // the tokens whose KV the draft's cache holds, from position 0
    std::vector<int32_t> blocks;  // its block table: held's positions and those about to be fed
  };
  // One row of the draft's work in Propose.
  struct Work {
    Seq* seq = nullptr;
    std::vector<int32_t> pending;  // tokens to feed before the first guess
    int64_t from = 0;              // pending[from..] not yet fed
    int32_t out = 0;               // where its guesses go in draft_ids
    bool active = false;           // still guessing (within the draft's context)
  };

  // Adds `n` tokens of `s` (from `ids`) at its next positions as a row of batch_; with `logit`, the
  // last one's logits are wanted.
  // (Within blocks Cover gave.)
  void AddRow(Seq& s, const int32_t* ids, int64_t n, bool logit);
  void ClearBatch();
  // Grows s.blocks to hold `tokens` tokens; false, with none taken, when too few are free.
  bool Cover(Seq& s, int64_t tokens);
  // Cuts s.held to at most `tokens` tokens and gives back the blocks past them.
  void Cut(Seq& s, int64_t tokens);

  // ---- Constant after construction ----
  std::unique_ptr<DraftModel> model_;
  StepLimits limits_;  // the draft's
  int64_t vocab_size_ = 0;
  int64_t max_positions_ = 0;

  // ---- State ----
  std::vector<Seq> slots_;                        // [max_seqs_per_step]
  std::vector<int32_t> free_slots_;
  HeadKvPool pool_;                               // the draft's KV cache's blocks
  absl::flat_hash_map<uint64_t, int32_t> index_;  // seq id -> slot
  int64_t forwards_ = 0;
  int64_t starved_ = 0;
  // Propose's scratch, reserved at construction.
  std::vector<Work> work_;
  StepBatch batch_;
  std::vector<int32_t> next_;
  std::vector<int32_t> batch_rows_;  // the work row of each of batch_'s rows
};

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_DRAFT_RUNNER_H_
