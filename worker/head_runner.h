// Speculative decoding with a head over the model's own hidden states, on the worker that samples
// (docs/speculative-decoding.md): DeepSeek-V3's multi-token-prediction (MTP) layer (--speculative
// mtp: model.layers.{L}, L = num_hidden_layers, which predicts the token after next from the model's
// hidden state at a position and the next token), or an EAGLE-3 head (--speculative eagle3: a
// decoder layer of its own, loaded from its directory, over its fc's projection of the model's
// hidden states at a few layers, ShardSpec::aux_hidden_layers, guessing in its own vocabulary, which
// d2t maps to the model's). It is the draft model's counterpart (worker/draft_runner.h): its guesses
// go back in StepResult.draft_ids and the coordinator's DraftProposer serves them; but where a draft
// model catches up from tokens alone, a head reads the model's hidden states, which exist only in
// the step that computed them, so it follows every step that guesses.
//
// Each step that asks for guesses (Propose, after sampling; whether or not the row samples):
//   - the model's hidden state of every fed row (the MTP layer's: final-normed, ModelShard::FinalNormed,
//     as vLLM and SGLang feed it; an EAGLE-3 head's: fc over the aux layers' states,
//     ModelShard::Eagle3Input) pairs with the token after it: the next fed token, or for a row that
//     samples, the tokens Scheduler::Verify will keep (the fed guesses while the sample before each
//     equals it) and then the sample after them. Rows past the kept ones are dropped; a prefill
//     chunk's last row waits for its next token, kept on the device until the sequence's next row
//     (one row a sequence);
//   - the head runs over those pairs, each at its row's position, into its own paged KV cache, and
//     its argmax at each sampling row's last pair is the first guess;
//   - when the plan asks for K > 1 guesses (StepPlan.num_draft_tokens), the head runs K - 1 more
//     times, one token a sampling row, on its own output hidden state (before its final norm) and its
//     last guess (as vLLM's EAGLE proposer runs both); the positions so written are rewritten by the
//     next step's pairs before anything reads them.
// With K = 0 (speculation is off for the step: the batch is large, Scheduler) the head runs
// nothing: the positions so fed are holes in its KV cache, as are positions whose hidden states
// this worker never saw (a prefix from the prefix cache, a sequence's start after the group
// re-formed). A hole holds whatever its slot last held: worse guesses once the sequence guesses
// again, never different outputs, since the verification decides; a large batch pays nothing for
// the head (docs/performance.md measures both).
//
// The head's KV cache: a paged pool of its own, as the draft model's (model/step_limits.h
// DraftStepLimits: as many blocks as the model's cache and room for every sequence's guesses). A
// sequence takes blocks as the positions it writes grow and gives them back when it is freed (a
// rolled-back guess's position is written again by the next step's pairs); a row that finds too few
// free blocks is skipped for that step (starved()): a hole in that cache and no guesses, never other
// outputs.
//
// Memory: the head's weights, KV cache and step buffers (ModelShard), and a table of hidden rows
// [max_seqs_per_step + max_tokens_per_step, hidden] with its index buffers (registry.h
// HeadRunnerBuffers), allocated at Load; the planner counts the same (coordinator/planner/memory.h
// HeadBytes, docs/planner.md). Ownership: owns the head's shard and its communicator of one rank;
// borrows the model's shard, which must outlive it.
// Threading: not thread-safe; the step's thread.
#ifndef SHARDSERVE_WORKER_HEAD_RUNNER_H_
#define SHARDSERVE_WORKER_HEAD_RUNNER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "google/protobuf/repeated_field.h"
#include "model/config.h"
#include "model/step_limits.h"
#include "model/weight_source.h"
#include "shardserve/v1/worker.pb.h"
#include "worker/communicator.h"
#include "worker/head_kv_pool.h"
#include "worker/shard/model_shard.h"
#include "worker/shard_inputs.h"  // StepBatch

namespace shardserve {

class HeadRunner {
 public:
  // The head's step limits for a model served within `target`: model/families/registry.h
  // HeadStepLimits (DraftStepLimits', its KV cache's pool among them, with room for one more token a
  // sequence a step: a prefill chunk's waiting row).
  static StepLimits HeadLimits(const StepLimits& target);

  // Loads the MTP layer num_hidden_layers of `config` from `weights` (whole, in the backend's act
  // dtype, linear weights as `quant`) beside `target`, the last stage's shard on TP rank 0, for plans
  // within `limits`. FailedPrecondition naming the field or tensor when the model has no such layer.
  static absl::StatusOr<std::unique_ptr<HeadRunner>> Load(const WeightSource& weights, const ModelConfig& config,
                                                         WeightQuant quant, const StepLimits& limits,
                                                         ModelShard* target);

  // Loads the EAGLE-3 head at `head_dir` (its config.json LlamaForCausalLMEagle3, its tensors from
  // there as `format` reads them) beside `target`, whose aux_hidden_layers must be the ones the head
  // reads (Eagle3AuxLayers), for plans within `limits`. Where the head has no embedding it looks its
  // tokens up in the model's: `target`'s own table where that holds it whole (Eagle3SharesEmbedding),
  // else a copy read from `model_weights`. Errors name the head's directory and what does not fit the
  // model.
  static absl::StatusOr<std::unique_ptr<HeadRunner>> LoadEagle3(const std::string& head_dir, LoadFormat format,
                                                               uint64_t dummy_seed, const WeightSource& model_weights,
                                                               const ModelConfig& model_config, WeightQuant quant,
                                                               const StepLimits& limits, ModelShard* target);

  // Follows `plan` (after PersistentBatch::Apply accepted it): freed sequences give back their slot,
  // new ones take one. InvalidArgument for a num_draft_tokens outside [0, kMaxSpeculativeTokens].
  absl::Status Apply(const v1::StepPlan& plan);

  // After the step ran (and sampled `sampled`, one id per logit row, row after row): when the plan
  // asks for num_draft_tokens guesses, the pairs above through the head and that many guesses per
  // row that samples appended to *draft_ids; else nothing but the check that it knows every row's
  // sequence.
  absl::Status Propose(const v1::StepPlan& plan, const google::protobuf::RepeatedField<int32_t>& sampled,
                       google::protobuf::RepeatedField<int32_t>* draft_ids);

  // Drops every sequence (the group re-formed, or the coordinator went away).
  void Clear();

  // (not the model's embedding where the head shares it: shares_embedding())
  uint64_t weight_bytes() const { return shard_->weight_bytes(); }
  bool shares_embedding() const { return shares_embedding_; }
  uint64_t kv_cache_bytes() const { return shard_->kv_cache_bytes(); }
  // The layer's shard's step buffers (HeadLimits), and the runner's own: the hidden rows' table and
  // its index buffers.
  uint64_t step_buffer_bytes() const { return shard_->step_buffer_bytes(); }
  uint64_t buffer_bytes() const { return buffer_bytes_; }
  // All of the above: the device memory the layer takes beside the model's shard.
  uint64_t total_bytes() const { return weight_bytes() + kv_cache_bytes() + step_buffer_bytes() + buffer_bytes(); }
  // Head forwards run so far; rows skipped for want of free blocks; steps skipped for asking no
  // guesses (K = 0); blocks free now.
  int64_t forwards() const { return forwards_; }
  int64_t starved() const { return starved_; }
  int64_t idle_steps() const { return idle_steps_; }
  int64_t free_blocks() const { return pool_.free_blocks(); }
  // For tests: the layer's shard.
  ModelShard* shard() const { return shard_.get(); }

 private:
  struct Seq {
    int32_t slot = 0;         // its waiting row's in the table
    std::vector<int32_t> blocks;  // its block table in the head's pool: positions [0, blocks x block size)
    bool waiting = false;     // a hidden row waits in table_ row `slot` for its next token
    int32_t waiting_pos = 0;  // that row's position
  };
  HeadRunner() = default;
  // The table, index buffers and scratch, for the head of `config` beside `target` (after shard_).
  absl::Status Init(const ModelConfig& config, const StepLimits& limits, ModelShard* target);
  // Gives back s's blocks and forgets its waiting row.
  void Release(Seq& s);
  // Adds the token `id` at `pos` of `s` (within its blocks) to batch_ (a new row of the batch when `new_row`), its
  // hidden state table_ row `src`.
  void Add(const Seq& s, int32_t id, int32_t pos, int32_t src, bool new_row);
  void ClearBatch();
  // Runs batch_ with its hidden rows gathered from `table` by src_rows_host_; the argmax after each
  // logit row into next_.
  absl::Status Run(const Tensor& table);

  // ---- Constant after Load ----
  std::unique_ptr<Communicator> tp_;  // one rank
  std::unique_ptr<ModelShard> shard_;
  ModelShard* target_ = nullptr;
  Backend* backend_ = nullptr;
  StepLimits limits_;       // the head's (HeadLimits)
  int64_t context_ = 0;     // the positions it takes: its KV cache's and its RoPE's
  int64_t table_seqs_ = 0;  // the table's waiting rows [0, table_seqs_); the step's after them
  bool eagle3_ = false;       // an EAGLE-3 head (else the MTP layer)
  bool shares_embedding_ = false;  // looks tokens up in the model shard's own table
  std::vector<int32_t> d2t_;  // an EAGLE-3 head's: its id d is the model's d + d2t_[d]
  Buffer table_buffer_, src_rows_buffer_, ids_buffer_;
  Tensor table_;           // [table_seqs_ + target max_tokens_per_step, hidden] act
  Tensor src_rows_, ids_;  // [HeadLimits' max_tokens_per_step] I32, [max_seqs_per_step] I32
  uint64_t buffer_bytes_ = 0;  // of the three above

  // ---- State ----
  std::vector<Seq> slots_;
  std::vector<int32_t> free_slots_;
  HeadKvPool pool_;                               // the head's KV cache's blocks
  absl::flat_hash_map<uint64_t, int32_t> index_;  // seq id -> slot
  int64_t forwards_ = 0;
  int64_t starved_ = 0;
  int64_t idle_steps_ = 0;
  // Propose's scratch, reserved at Load.
  StepBatch batch_;
  std::vector<int32_t> src_rows_host_;  // per batch_ token: its hidden state's row of the table
  std::vector<int32_t> next_;           // per logit row: the argmax
  struct Guessing {
    int32_t out = 0;  // where its guesses go in draft_ids
    int32_t slot = 0;
    int32_t pos = 0;  // the position of its last pair
  };
  std::vector<Guessing> guessing_;  // the sampling rows that guess, in logit-row order
  std::vector<int32_t> waits_;      // (slot, step row) pairs whose row waits after this step
};

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_HEAD_RUNNER_H_
