// The continuous-batching scheduler: which sequences run in the next step, with how many tokens,
// where their KV goes, and which sequences give their cache blocks back when the cache is full.
// It works in tokens and blocks only; the engine (coordinator/engine/engine.h) owns the requests
// (their text, stop conditions and streams) and the workers.
//
// A sequence is its tokens (prompt, then every sampled token) and how many of them were fed to
// steps already sent (their KV is in the cache once those steps come back). A step feeds each
// scheduled sequence its next tokens not yet fed: a prefill chunk, or the one token sampled last.
// Whenever a step feeds a sequence up to its last token, the step samples the sequence's next
// token. Preempted sequences lose their blocks and start over from token 0 (recompute: prompt and
// generated tokens are prefilled again), so nothing is lost.
//
// Micro-batches: the running sequences are split into `lanes` (PP for pipeline parallelism, else
// 1). Each lane has at most one step in flight; a sequence decodes in its lane (its home), which
// keeps the lanes' batches apart, so with PP = P stage k can work on one lane's step while stage
// k+1 works on another's. Prompt chunks need no sampled token, only the KV of the chunks before
// them, and every worker runs steps in the order they were sent: so the next chunk of a prompt
// may go into any lane's step while the chunk before it is still in flight, and a long prompt
// flows through the pipeline back to back instead of one chunk per round trip. The chunk that
// ends a prompt (it samples) moves the sequence to the step's lane when that lane holds less than
// its share of the sequences; otherwise that last token waits for the home lane.
//
// Each step of a lane, in this order, within max_tokens_per_step tokens:
//   1. decodes: every sequence of the lane with one sampled token to feed, oldest first;
//   2. prefills: running sequences with prompt (or recompute) tokens left to feed, oldest first,
//      each chunked to the prefill tokens left in the step;
//   3. admissions: waiting sequences, oldest first (preempted ones before new ones), while
//      fewer than max_seqs_per_step sequences run, no running sequence waits for a block, and free
//      blocks hold the sequence's first chunk. A sequence joins the lane while the lane holds less
//      than its share of all sequences; past that, it joins another lane below its share that has
//      a step in flight, and this step carries its prompt but the last token (which samples in
//      its own lane). A waiting sequence never takes blocks from a running one.
// With several lanes, the prefill tokens a step takes are capped at an even split, across the
// lanes, of the prefill work in flight and not yet fed (but never below max_tokens_per_step /
// lanes): a prompt is cut into equal chunks for the lanes' steps, so that a step with a prompt
// chunk and a step with decodes alone do not leave one stage idle while the other works
// (pipeline bubbles). With one lane there is no cap.
// When a running sequence needs a block and none is free, the newest running sequence that is
// neither in this step nor in a step in flight is preempted (the sequence itself, when it is the
// newest of all and in no step in flight); if every newer sequence is in a step, the sequence
// waits for the next step. Decodes come first, so a long prompt never stalls running decodes: it
// only takes the tokens they leave.
//
// Prefix caching (block_manager.h; SchedulerOptions::prefix_caching): the full blocks a step sent
// fills are registered in the block manager at once (every worker runs steps in the order sent, so
// a later step reads them written), during prefill and decode alike, so that a conversation's next
// turn (its earlier prompt and answer, then the new message) finds them. An admitted sequence
// (new, or preempted: recompute) takes the registered blocks holding the longest prefix of its
// tokens, all but its last token at most (the step that feeds it must sample), and starts with
// num_fed = the tokens they hold; the workers start it at that position (NewSeq.num_cached_tokens).
// It never writes them: it feeds and appends only after them. A sequence with a sampling penalty
// or bad words on takes no cached blocks (it still registers its own): the workers derive the
// penalties (and match the bad words) from the tokens fed, which must then be all of them. Blocks
// that sequences let go stay cached until a block is needed and none is empty; Clear() (the
// workers' KV is gone) drops them all.
//
// Sliding-window attention (SchedulerOptions::sliding_window): a sliding layer's next token
// attends to the window before it only, so after every step a sequence lets go of the sliding
// blocks that lie wholly before (its next position - window + 1) (BlockManager::Release): they go
// back to the free list, or to the cached ones when registered. Where every layer slides (Mistral
// or Phi-3 with a window) the one pool is theirs (limits.num_kv_blocks); where full-attention
// layers sit beside them (Gemma 2 and 3) the sliding layers have a pool of their own
// (limits.num_sliding_kv_blocks) and each sequence a second block table, as long as its first
// (NewSeq.sliding_block_ids), grown with it; admission and preemption count both pools. A prefix
// hit is the longer prefix both pools still hold whole (block_manager.h): a sliding block evicted
// after its sequence let it go ends the hit there, and the rest is computed again.
//
// Plans are stateful (worker.proto StepPlan, as vLLM v1's scheduler output): the workers hold the
// running batch by sequence id. All workers get the same plans in the same order, so one record
// per sequence of what they hold suffices (Seq::sent, Seq::blocks_sent): a sequence goes out in
// new_seqs (block table so far, sampling settings, prompt length, the tokens it starts with from
// the prefix cache) the first step that feeds it, later steps send its new blocks and the tokens
// fed; a sequence preempted, finished or removed that the workers hold goes out in freed_seq_ids
// of the next plan (a removed one still in a step in flight once that step is back), and a
// preempted one comes back new. Freed ids come first in a plan, so the workers hold at most the
// running set: max_seqs_per_step sequences.
//
// Speculative decoding (SchedulerOptions::proposer, docs/speculative-decoding.md): a decode of a
// sequence that allows it feeds its last sampled token and then up to num_speculative_tokens
// tokens its proposer guessed, and samples at each of those k + 1 positions. The guesses are not
// the sequence's tokens: num_fed counts only the sampled token, and only its blocks are
// registered, while the table grows over the guesses' positions without preempting anyone (fewer
// guesses when blocks are short). When the step is back (Verify), the longest prefix of guesses
// equal to the samples at the positions before them is accepted, plus the sample after it; they
// are appended, num_fed moves past the accepted guesses and their full blocks are registered, the
// blocks past the accepted tokens are given back, and the next plan rolls the workers back
// (StepPlan.rollback_*). With sliding windows the guesses' positions lie after the sampled
// token's, whose window the blocks released so far never reach, and a rollback cuts the sliding
// layers' table as the other (the blocks released behind the window hold accepted tokens only: a
// rejected position is never behind it). A constrained sequence is fed only the guesses its
// grammar allows (SchedulerOptions::guess_filter). A proposer that guesses within the steps (a draft
// model on the worker that samples: Proposer::proposes_in_step) is asked for guesses in every plan
// while speculation is on (StepPlan.num_draft_tokens), for each row that samples; the workers hold
// the draft's state, so a new sequence carries the ids of the tokens the prefix cache gave it
// (NewSeq.cached_token_ids). With adaptive_speculative_tokens a sequence's guesses adapt to its
// acceptance, as Hugging Face's assisted generation schedules them ("heuristic"): it starts at
// num_speculative_tokens, a verification that accepted every guess fed raises its number by 2
// (up to num_speculative_tokens), one that rejected any lowers it by 1 (down to 1); a draft model
// is then asked for the most any sampling row of the step may take. No guesses in a step while
// speculative_max_running sequences or more run, or past the sequence's max_len; a step's samples
// stay within max_seqs_per_step (the workers' logits rows).
//
// Prompt log-probabilities (RowSampling.prompt_logprobs): until a sequence has sampled its first
// token, each chunk of its prompt scores every position but the prompt's last (which samples): the
// logits at position p give the log-probability of the prompt token at p + 1 (StepPlan.row_num_scored
// and scored_ids; Complete hands the scored rows back). So every position of such a chunk takes a
// logit row, and a chunk is cut to the rows max_seqs_per_step leaves it: the step's rows so far and
// one for every other sequence that may still sample in the step (at least one row, else it waits
// for the next step). Such a sequence takes no cached blocks (the workers must compute every
// position), and a preempted one scores its prompt again.
//
// Asynchronous scheduling (SchedulerOptions::feed_samples, for a group of one stage, whose workers
// embed and are given the samples): a lane may have two steps in flight. A sequence whose one step
// in flight samples its next token, with every token known fed, is scheduled again at once (it
// "continues"): its row feeds one token, the one that step samples, which the workers put in
// themselves (StepPlan.row_feeds_sample), at the next position; num_fed counts it (one past the
// known tokens while that sample is in flight). So the workers find their next step waiting when
// they finish one, and the round trip to the coordinator and the scheduling of each token leave
// their critical path. A sequence continues only while the token its continuation samples lies
// within max_len, not when its options refuse it (SeqOptions::feed_ahead: a constrained sequence,
// whose mask needs that token), and never with speculative decoding. When the step in flight ends
// the sequence (a stop token or string, a cancellation), the engine removes it and the
// continuation's sample is dropped when it comes back (as for any sequence removed in flight).
// Blocks are registered for the prefix cache once their tokens are known (Complete registers what
// the sample completes).
//
// Threading: not thread-safe; the engine's thread owns it.
#ifndef SHARDSERVE_COORDINATOR_SCHEDULER_SCHEDULER_H_
#define SHARDSERVE_COORDINATOR_SCHEDULER_SCHEDULER_H_

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <vector>

#include "coordinator/scheduler/block_manager.h"
#include "coordinator/scheduler/proposer.h"
#include "model/step_limits.h"
#include "shardserve/v1/worker.pb.h"

namespace shardserve {

struct SchedulerOptions {
  // The running batch holds at most limits.max_seqs_per_step sequences; a step carries at most
  // limits.max_tokens_per_step tokens; block tables are limits.max_blocks_per_seq() wide.
  StepLimits limits;
  int lanes = 1;  // micro-batches in flight at most
  // Automatic prefix caching (see above); off: every sequence computes all its tokens.
  bool prefix_caching = true;
  // The prefix cache's block keys; null: SHA-256 (block_manager.h). Tests pass a colliding one.
  BlockManager::KeyFn prefix_key_fn = nullptr;
  // The window of the model's sliding-window layers, in tokens (the largest where they differ);
  // 0: none. With full_layers, the sliding layers' blocks are a pool of their own of
  // limits.num_sliding_kv_blocks (>= 1); without, every layer slides and limits.num_kv_blocks is
  // theirs (num_sliding_kv_blocks 0).
  int64_t sliding_window = 0;
  bool full_layers = true;
  // Speculative decoding (see above): null or num_speculative_tokens 0: off. Borrowed; outlives
  // the scheduler.
  const Proposer* proposer = nullptr;
  int num_speculative_tokens = 0;
  // Cuts each proposal to what the sequence's constraint allows; null: every guess may be fed.
  // Borrowed; outlives the scheduler.
  GuessFilter* guess_filter = nullptr;
  // No guesses in a step while this many sequences or more run; 0: no such limit.
  int64_t speculative_max_running = 8;
  // Each sequence's guesses adapt to what it accepts (see above): off, every decode may be fed
  // num_speculative_tokens of them.
  bool adaptive_speculative_tokens = false;
  // Asynchronous scheduling (see above): two steps in flight a lane, the second continuing the
  // sequences the first samples. Only for a group whose worker embeds and samples; ignored with a
  // proposer.
  bool feed_samples = false;
};

// Per-sequence settings beyond its sampling.
struct SeqOptions {
  int64_t max_len = 0;     // tokens it may reach (prompt + max_tokens); 0: limits.max_model_len
  bool feed_ahead = true;  // may continue before its sample is known (SchedulerOptions::feed_samples)
};

// Speculative decoding's counters, cumulative.
struct SpeculationStats {
  int64_t proposed = 0;       // tokens proposed
  int64_t accepted = 0;       // of them accepted
  int64_t verifications = 0;  // rows that carried at least one
  std::vector<int64_t> accepted_by_position;  // [num_speculative_tokens]
};

// One step of one lane, as scheduled.
struct MicroBatch {
  struct Entry {
    uint64_t seq = 0;
    int32_t tokens = 0;      // fed this step
    int32_t logit_row = -1;  // >= 0: the step samples this sequence's next token in that row
    int32_t samples = 0;     // logit rows from logit_row on: 1, or 1 + draft.size()
    int64_t start = 0;       // the position of its first token fed
    int32_t scored = 0;      // prompt positions scored from `start` on, in the logit rows before logit_row
    int32_t scored_row = -1;  // the first of them
    bool feeds_sample = false;  // continues: feeds the sample of the step in flight (the worker's)
    std::vector<int32_t> draft;  // proposed tokens fed after its sampled one (tokens counts them)
  };
  int lane = 0;
  uint64_t step_id = 0;
  std::vector<Entry> entries;   // block-table row i is entries[i]
  std::vector<uint64_t> started;  // sequences scheduled for the first time (out of the queue)
  int64_t prefill_tokens = 0;   // tokens of entries that feed more than one token
  int64_t decode_tokens = 0;
  int logit_rows = 0;           // positions that sample or score: the ids the step's result carries
  // A proposer whose guesses the workers make in the step (Proposer::proposes_in_step): the guesses
  // asked per row that samples (StepPlan.num_draft_tokens; 0: none), and the ids the result brings
  // back for them (StepResult.draft_ids), entry after entry.
  int draft_tokens = 0;
  int draft_ids = 0;
  bool wants_logprobs = false;  // one of them asks for logprobs
};

// A token a step sampled for a sequence.
struct SampledToken {
  uint64_t seq = 0;
  int32_t token = 0;
  int32_t logit_row = 0;  // the row of the step's result it came from
};

// Prompt positions a step scored for a sequence (prompt log-probabilities): positions
// position .. position + count - 1, in the step's logit rows logit_row .. logit_row + count - 1, each
// the log-probability of the prompt token after it.
struct ScoredPositions {
  uint64_t seq = 0;
  int64_t position = 0;
  int32_t logit_row = 0;
  int32_t count = 0;
};

class Scheduler {
 public:
  explicit Scheduler(const SchedulerOptions& options);

  // Queues a sequence. `id`s increase with arrival (older = smaller = served first). `sampling`
  // is the request's (its draw_index and penalty ids are ignored: workers derive them per step). The prompt must be
  // non-empty and the sequence must never need more than max_blocks_per_seq blocks (the caller
  // checks prompt + max_tokens against the served length).
  void Add(uint64_t id, std::vector<int32_t> prompt, const v1::RowSampling& sampling, SeqOptions seq = {});

  // Builds `lane`'s next step into `step` (cleared; `step_id` set). Returns the micro-batch, valid
  // until the lane's Complete of that step, or null when the lane is busy (LaneBusy) or has
  // nothing to run.
  // Plans are stateful (worker.proto StepPlan): every plan returned must reach every worker, in
  // the order built; when one cannot, the group is over (Clear()).
  const MicroBatch* Schedule(int lane, uint64_t step_id, v1::StepPlan* step);

  // `lane`'s oldest step in flight came back with one sampled id per logit row: its tokens are cached now, and the
  // sampled ids are appended to their sequences (of a row with guesses, the accepted ones: see
  // above). Returns them in row order, leaving out sequences removed while the step was in
  // flight (their blocks are freed now). The prompt positions the step scored go to `scored`
  // (when given), likewise.
  std::vector<SampledToken> Complete(int lane, const std::vector<int32_t>& sampled,
                                     std::vector<ScoredPositions>* scored = nullptr);

  // Ends a sequence (finished, cancelled): its blocks are freed now, or when the step it is in
  // comes back. Unknown ids are ignored.
  void Remove(uint64_t id);
  // Drops every sequence and forgets the steps in flight (the group broke): every block is free,
  // the prefix cache too (DropPrefixCache).
  void Clear();
  // The group re-forms under a new epoch (a worker was lost or failed; docs/healing.md): the
  // workers hold nothing and the KV cache is gone. Every sequence goes back to waiting, to be
  // recomputed from token 0 (prompt + generated, as after a preemption: its prompt length stays,
  // so its sampling draws continue where they stopped); the steps in flight are forgotten (their
  // tokens never come); sequences removed while in one are dropped; nothing is left to free on
  // the workers; the prefix cache is dropped. Not counted as preemptions.
  void RequeueAllForRegroup();
  // Forgets every cached block, so that no sequence admitted later takes KV that the workers no
  // longer hold (a new group starts with an empty cache). Sequences running keep their blocks.
  void DropPrefixCache();

  // The lane has as many steps in flight as it may: one, or two with feed_samples.
  bool LaneBusy(int lane) const { return static_cast<int>(lanes_[lane].batches.size()) >= depth_; }
  int lanes() const { return static_cast<int>(lanes_.size()); }
  bool Contains(uint64_t id) const { return seqs_.count(id) > 0; }
  // Tokens sampled for `id` so far (0 for unknown ids).
  int64_t generated(uint64_t id) const;
  // Its tokens, prompt and generated (0 for unknown ids).
  int64_t num_tokens(uint64_t id) const;

  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  // Blocks a sequence can be given: empty, or cached and no sequence's (evicted when taken).
  int64_t num_free_blocks() const { return blocks_.num_available(); }
  int64_t num_blocks() const { return blocks_.num_blocks(); }
  // Blocks holding a cached prefix that no sequence holds.
  int64_t num_cached_blocks() const { return blocks_.num_cached(); }
  // The full-attention layers' blocks (every layer's when all slide, or none does).
  const BlockManager& block_manager() const { return blocks_; }
  // The sliding-window layers' own blocks, beside full-attention layers; null where there are none.
  const BlockManager* sliding_block_manager() const { return sliding_ ? &*sliding_ : nullptr; }
  // Prefix-cache lookups at admissions, in tokens: the tokens of the sequences admitted (each
  // time, a preempted one again) that looked the cache up, and those found in it. Cumulative.
  int64_t prefix_query_tokens() const { return prefix_query_tokens_; }
  int64_t prefix_hit_tokens() const { return prefix_hit_tokens_; }
  // Prompt tokens of `id` whose KV came from the prefix cache at its latest admission (0 for
  // unknown ids, and with prefix caching off).
  int64_t cached_prompt_tokens(uint64_t id) const;
  int64_t preemptions() const { return preemptions_; }
  const SpeculationStats& speculation() const { return spec_; }
  // Blocks `id` holds (its table's length), its tokens, and those fed (for tests); 0 / empty for
  // unknown ids.
  int64_t table_blocks(uint64_t id) const;
  // Its block table and its sliding layers' table (BlockManager::kReleased where let go; the
  // second empty without that pool), for tests; empty for unknown ids.
  std::vector<int32_t> table(uint64_t id) const;
  std::vector<int32_t> sliding_table(uint64_t id) const;
  std::vector<int32_t> tokens(uint64_t id) const;
  int64_t fed(uint64_t id) const;
  const SchedulerOptions& options() const { return options_; }

 private:
  struct Seq {
    uint64_t id = 0;
    std::vector<int32_t> tokens;  // prompt + generated
    int64_t prompt_len = 0;
    int64_t num_fed = 0;          // tokens fed to steps sent (in the KV cache once they come back),
                                  // from the prefix cache's included
    int64_t num_cached = 0;       // tokens its table's shared blocks held at its latest admission
    bool penalized = false;       // a sampling penalty or bad words: takes no cached blocks
    bool scores = false;          // asks for prompt log-probabilities: takes no cached blocks
    BlockManager::Chain chain;    // its blocks registered (or found) so far
    std::vector<int32_t> blocks;  // block table
    // In the sliding layers' own pool (sliding_), likewise; as long as `blocks`.
    BlockManager::Chain sliding_chain;
    std::vector<int32_t> sliding_blocks;
    // The blocks found in the prefix cache at its admission, until its NewSeq is written (the
    // tables may have let the first of them go already).
    std::vector<int32_t> found, sliding_found;
    int lane = -1;                // while running: its home lane, where it decodes
    int in_flight = 0;            // steps in flight that feed it (> 1 for prompt chunks, and continuations)
    bool started = false;         // scheduled at least once
    bool in_batch = false;        // in the step being built
    bool removed = false;         // Remove()d while in a step in flight
    bool stalled = false;         // running, waits for a block a newer sequence in a step holds
    // What the workers hold of it (all get the same plans, in order): sent as a new sequence
    // and not freed since, and how many of its blocks they have.
    bool sent = false;
    int64_t blocks_sent = 0;
    v1::RowSampling sampling;
    SeqOptions options;
    int guesses = 0;  // the most guesses a decode may be fed (adaptive_speculative_tokens)

    // Tokens known and not yet fed; -1 while a continuation has fed the sample of a step in flight.
    int64_t unfed() const { return static_cast<int64_t>(tokens.size()) - num_fed; }
    // Tokens known and fed, whose blocks may be registered.
    int64_t known_fed() const { return std::min<int64_t>(num_fed, static_cast<int64_t>(tokens.size())); }
    // Its next token to feed is the one sampled last (else, with unfed() > 0, a prompt or
    // recompute chunk).
    bool decodes() const { return unfed() == 1 && in_flight == 0; }
  };
  struct Lane {
    std::deque<MicroBatch> batches;  // its steps in flight, oldest first (pointers stay valid)
    int64_t running = 0;
  };

  // `s` continues in the step being built (see above).
  bool Continues(const Seq& s) const;
  // Makes room for `s` to hold `tokens` tokens, preempting newer sequences; false when it cannot
  // now (`s` may have been preempted itself).
  bool Reserve(Seq& s, int64_t tokens);
  // Grows `s`'s tables in every pool to hold `tokens` tokens; false, with none changed, when a pool
  // has too few blocks.
  bool Grow(Seq& s, int64_t tokens);
  // Lets go of every block `s` holds, in every pool, and forgets its chains.
  void FreeBlocks(Seq& s);
  // Registers `s`'s full blocks whose tokens are known (every pool), for the prefix cache.
  void Register(Seq& s);
  // After a step fed `s` up to num_fed: registers its full blocks, then lets go of the sliding
  // blocks its next token no longer sees.
  void Advance(Seq& s);
  // Prompt positions that `chunk` of `s`'s unfed tokens scores (see above).
  int64_t Scored(const Seq& s, int64_t chunk) const;
  // The logit rows a chunk of `s` may take in the step being built, which has `rows` already.
  int64_t RowsFor(const Seq& s, int rows) const;
  // Adds `chunk` of `s`'s unfed tokens to the step being built (with `continues`, the one token
  // the step in flight samples).
  void Place(Seq& s, int64_t chunk, MicroBatch* batch, int* rows, std::vector<int32_t> draft = {},
             bool continues = false);
  // The guesses for decoding `s` (reserved for its next token) in a step with `tokens` tokens and
  // `samples` logit rows left to spare; its table grows over them.
  std::vector<int32_t> Propose(Seq& s, int64_t tokens, int64_t samples);
  // The samples of a row with guesses came back: accepts, appends, rolls back (see above).
  void Verify(Seq& s, const MicroBatch::Entry& e, const std::vector<int32_t>& sampled, std::vector<SampledToken>* out);
  // The most prefill tokens the next step takes: no limit with one lane, else an even split across
  // the lanes of the prefill tokens in flight and of those not yet fed, at least budget / lanes.
  int64_t PrefillCap() const;
  // The workers drop `s` with the next plan (when they hold it).
  void Forget(Seq& s);
  void Preempt(Seq& s);
  void Erase(Seq& s);
  // The plan of `batch` (its logit_rows and wants_logprobs set): what changed since the last
  // plan for its sequences, and the ids freed since.
  void WriteStep(MicroBatch& batch, v1::StepPlan* step);

  const SchedulerOptions options_;
  const int depth_;  // steps in flight a lane may have
  BlockManager blocks_;
  const int64_t blocks_window_;  // the window of blocks_' layers: sliding_window when every layer slides, else 0
  std::optional<BlockManager> sliding_;
  std::map<uint64_t, std::unique_ptr<Seq>> seqs_;  // every sequence not yet removed, by id
  std::set<uint64_t> running_;                     // hold blocks, belong to a lane
  std::set<uint64_t> waiting_;                     // no blocks: new, or preempted
  std::vector<Lane> lanes_;
  std::vector<uint64_t> freed_;  // sequences the workers hold and drop with the next plan
  struct Rollback {
    uint64_t seq = 0;
    int64_t tokens = 0;  // its num_fed and table length after Verify
    int64_t blocks = 0;
  };
  std::vector<Rollback> rollbacks_;  // what the workers roll back with the next plan
  SpeculationStats spec_;
  int64_t preemptions_ = 0;
  int64_t prefix_query_tokens_ = 0;
  int64_t prefix_hit_tokens_ = 0;
};

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_SCHEDULER_SCHEDULER_H_
