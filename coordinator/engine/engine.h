// The engine: continuous batching on top of the worker pool. One thread runs the loop
//
//   take new requests and cancellations -> schedule a step for every lane that may take one
//   (coordinator/scheduler) -> send it -> wait for the oldest step in flight -> hand each sampled
//   token to its request (text, stop conditions) and stream it -> drop finished requests
//
// so requests join and leave the running batch at every step, and with PP = P up to P
// micro-batches are in flight at once. In a group of one stage (TP 1 or more), scheduling is
// asynchronous (EngineOptions::async_scheduling; scheduler.h): the next step goes out before the one
// in flight is back, feeding the tokens that one samples (the workers put them in: TP rank 0 shares
// them with its group, StepPlan.share_samples), so the workers never wait for the coordinator
// between two decode steps. A request that the step in flight ends (a stop token or string) loses
// the token its next step sampled: it is never streamed.
//
// A gRPC handler submits its checked request, then reads the request's stream (RequestStream) and
// writes what it gets to its client; when the client goes away or its deadline passes, the handler
// cancels the request and the engine removes it at the next step, freeing its KV blocks.
//
// Prompt log-probabilities (SamplingParams.prompt_logprobs): the prompt positions each step scored
// (scheduler.h) are kept with their request and sent with its first token; after a preemption or a
// heal before it, the positions scored again replace them.
//
// A sequence whose logits were not finite (the worker's StepResult.non_finite_rows: the model
// overflowed on its input) ends with INTERNAL saying so, logged once; the step's other sequences
// and the group go on.
//
// Failure: when a step fails because the group is healing (a worker was lost or failed; the pool
// re-forms the group around a replacement, docs/healing.md), no step starts, every request is
// held and its sequence goes back to waiting (Scheduler::RequeueAllForRegroup); new requests are
// queued. When the group serves again, every sequence is recomputed from its prompt and the tokens
// already streamed and its stream goes on: no token repeated or skipped. A heal that lasts longer
// than heal_timeout fails every request held with the pool's UNAVAILABLE status naming the missing
// worker and its slot, and refuses new ones with it until the group serves again. When the group
// breaks for good, every request ends with the pool's UNAVAILABLE status, and later requests are
// refused with it.
//
// Ownership: borrows the model, the pool and the metrics (may be null), which must outlive it.
// Owns the loop thread, joined by Shutdown() or the destructor.
// Threading: Submit, Cancel, FillStatus and Shutdown are thread-safe; RequestStream's methods
// too.
#ifndef SHARDSERVE_COORDINATOR_ENGINE_ENGINE_H_
#define SHARDSERVE_COORDINATOR_ENGINE_ENGINE_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/scheduler/scheduler.h"
#include "coordinator/engine/generation.h"
#include "coordinator/telemetry/metrics.h"
#include "coordinator/model/served_model.h"
#include "coordinator/cluster/worker_pool.h"
#include "grammar/matcher.h"
#include "shardserve/v1/inference.pb.h"

namespace shardserve {

using SteadyTime = std::chrono::steady_clock::time_point;

struct EngineOptions {
  int64_t max_waiting = 256;  // requests queued beyond the running batch; more: RESOURCE_EXHAUSTED
  int micro_batches = 0;      // steps in flight at most; 0: the number of pipeline stages
  // Asynchronous scheduling where the group is one stage (TP 1 or more) and no speculative
  // decoding runs (--no-async-scheduling turns it off; scheduler.h SchedulerOptions::feed_samples).
  bool async_scheduling = true;
  absl::Duration step_timeout = absl::Seconds(60);
  // How long requests wait for a healing group (--heal-timeout-seconds).
  absl::Duration heal_timeout = absl::Seconds(60);
  bool prefix_caching = true;  // automatic prefix caching (coordinator/scheduler/scheduler.h)
  // Speculative decoding (docs/speculative-decoding.md): "" (off), "ngram", "draft", "mtp" or "eagle3"
  // (--speculative), at most num_speculative_tokens guesses per sequence per step, none while
  // speculative_max_running sequences or more run (0: no such limit), each sequence's number
  // adapting to its acceptance with adaptive_speculative_tokens (scheduler.h). With "draft", draft_model is
  // the draft's directory (--draft-model), which the worker that samples runs (the pool's
  // assignments carry it: PoolOptions::draft_model_path); with "mtp", that worker runs the model's
  // own multi-token-prediction layer (PoolOptions::speculative_mtp); with "eagle3", draft_model is
  // an EAGLE-3 head's directory, which that worker runs (PoolOptions::speculative_eagle3).
  std::string speculative;
  std::string draft_model;
  int num_speculative_tokens = 0;
  int64_t speculative_max_running = 8;
  bool adaptive_speculative_tokens = false;
  // The n-gram proposer's lengths, longest first.
  int ngram_min = 1;
  int ngram_max = 3;
  // Tests: a proposer of their own instead (borrowed, outlives the engine); with speculative "".
  const Proposer* proposer = nullptr;
};

// Checks the speculative decoding options: InvalidArgument naming the flag.
absl::Status CheckSpeculativeOptions(const EngineOptions& options);

// The responses of one request, from the engine to its gRPC handler.
class RequestStream {
 public:
  // Waits at most `wait` for the next response. Returns true with *response set, or false: when
  // the request has ended (*ended set to its final status; OK after the last response) or when
  // `wait` passed (*ended unset).
  bool Next(absl::Duration wait, v1::GenerateResponse* response, std::optional<absl::Status>* ended);

  // ---- The engine's side ----
  void Push(v1::GenerateResponse response);
  void End(absl::Status status);

 private:
  absl::Mutex mu_;
  std::deque<v1::GenerateResponse> responses_ ABSL_GUARDED_BY(mu_);
  std::optional<absl::Status> ended_ ABSL_GUARDED_BY(mu_);
};

class Engine : private GuessFilter {
 public:
  Engine(const ServedModel* model, WorkerPool* pool, const EngineOptions& options, CoordinatorMetrics* metrics);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  struct Submitted {
    uint64_t id = 0;  // for Cancel
    std::shared_ptr<RequestStream> stream;
  };
  // Queues a checked request that arrived at `arrival`. Unavailable when the group is not
  // serving or the engine is shutting down; ResourceExhausted, saying which limit, when
  // max_waiting requests are already queued.
  absl::StatusOr<Submitted> Submit(GenerationParams params, SteadyTime arrival);
  // Removes request `id` at the next step (its stream ends with `why`); its blocks are freed.
  void Cancel(uint64_t id, absl::Status why);
  // The scheduler's state (zeros before the group serves).
  void FillStatus(v1::SchedulerStatus* status);
  // Ends every request with Unavailable and stops the loop. Idempotent.
  void Shutdown();

 private:
  struct Request {
    uint64_t id = 0;
    std::shared_ptr<RequestStream> stream;
    GenerationParams params;
    std::unique_ptr<Generation> generation;
    // With a structured-output constraint: the grammar's state over the tokens accepted so far
    // (never over a step in flight, so preemption, recompute and a heal leave it right); and why
    // the grammar cannot go on (a matcher that stopped, or no token allowed), set when a step
    // carried such a row.
    std::unique_ptr<grammar::GrammarMatcher> matcher;
    absl::Status grammar_error;
    // Speculative decoding of a constrained request: the masks of the step being built, one per
    // position that samples (the sampled token's, then one after each guess kept), from Allowed,
    // for AddTokenMasks; guess_mask_rows 0: none.
    std::vector<uint32_t> guess_masks;
    int guess_mask_rows = 0;
    // With prompt log-probabilities: one per prompt token from the second on, filled as the steps
    // that score them come back (again after a preemption or a heal), sent with the first token.
    std::vector<v1::TokenLogprobs> prompt_logprobs;
    std::vector<bool> prompt_scored;  // which of them a step has filled
    SteadyTime arrival;
    SteadyTime started;     // first scheduled
    SteadyTime last_token;  // when the last token was streamed
    double first_token_seconds = 0;
  };
  struct InFlight {
    int lane = 0;
    uint64_t step_id = 0;
    SteadyTime sent;
    // With a draft model: the sequences of the step's rows that sample, in row order (the draft's
    // guesses come back for them), and the guesses per row.
    std::vector<uint64_t> sampling;
    int draft_tokens = 0;
  };

  void Loop();
  // The scheduler's sizes: the plan's, as the pool gave them to the workers.
  SchedulerOptions SchedulerOptionsFromPool();
  // Creates the scheduler once the group serves.
  bool EnsureScheduler();
  void Admit(std::unique_ptr<Request> request);
  void CancelNow(uint64_t id, const absl::Status& why);
  // Schedules and sends steps for every lane, as many as each may have in flight.
  absl::Status SendSteps();
  // Sends `batch` (the step_ Schedule just built) and records it in flight.
  absl::Status SendStep(const MicroBatch& batch);
  // Waits for the oldest step in flight and streams its tokens.
  absl::Status FinishOldest();
  // Constrained decoding: the token masks of `batch`'s sampling rows whose request has a grammar,
  // into `step` (StepPlan.mask_logit_rows / mask_words), from each matcher's state: one per
  // position that samples (a row with guesses samples after each, with the masks Allowed made).
  void AddTokenMasks(const MicroBatch& batch, v1::StepPlan* step);
  // The prompt positions a step scored: into their requests' prompt_logprobs (a non-finite row
  // fails its request).
  void TakeScored(const std::vector<ScoredPositions>& scored);
  // `r`'s matcher accepts `token` (sampled under its mask); an error ends the request.
  absl::Status AcceptConstrained(Request& r, int32_t token);
  // Ends `r`'s stream with `status`; a request never scheduled leaves the queued count.
  void EndStream(Request& r, const absl::Status& status);
  // Ends request `id` (finished: OK, or an error) and removes it from the scheduler.
  void End(uint64_t id, const absl::Status& status);
  // Ends every request with `status` (the group broke, or shutdown).
  void FailAll(const absl::Status& status);
  // A step failed while the pool heals: forgets the steps in flight and sends every sequence back
  // to waiting, to be recomputed once the group is whole.
  void HoldForHeal(const absl::Status& status);
  // While the pool heals: past heal_timeout, fails every request with the pool's status. True
  // while healing (no step may start).
  bool WaitForHeal();
  void PublishStats();
  // Speculative decoding's counters into `s` and the metrics.
  void PublishSpeculation(v1::SchedulerStatus* s);
  // GuessFilter, for the scheduler: a constrained request's guesses are cut where its grammar
  // stops allowing them (grammar/matcher.h GuessMasks), and the masks of its positions kept for
  // AddTokenMasks; its matcher stays over the accepted tokens (FinishOldest advances it over the
  // tokens a verification accepts). Other requests keep every guess.
  int Allowed(uint64_t seq, const std::vector<int32_t>& guesses) override;

  // ---- Constant after construction ----
  const ServedModel* const model_;
  WorkerPool* const pool_;
  const EngineOptions options_;
  CoordinatorMetrics* const metrics_;
  std::unique_ptr<Proposer> ngram_;  // with speculative "ngram"
  // With speculative "draft" or "mtp": the guesses the last step results brought, fed by FinishOldest.
  std::unique_ptr<DraftProposer> draft_;

  // ---- Guarded by mu_: the handlers' side ----
  absl::Mutex mu_;
  absl::CondVar wake_;  // a request or a cancellation arrived, or shutdown
  std::vector<std::unique_ptr<Request>> inbox_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<uint64_t, absl::Status>> cancels_ ABSL_GUARDED_BY(mu_);
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t queued_ ABSL_GUARDED_BY(mu_) = 0;  // submitted, not yet scheduled and not ended
  v1::SchedulerStatus stats_ ABSL_GUARDED_BY(mu_);  // published by the loop

  // ---- The loop thread's own ----
  std::unique_ptr<Scheduler> scheduler_;
  std::map<uint64_t, std::unique_ptr<Request>> requests_;  // in the scheduler
  std::deque<InFlight> in_flight_;
  SteadyTime last_finish_;  // when the last step came back
  bool share_samples_ = false;  // asynchronous scheduling in a TP group: StepPlan.share_samples
  uint64_t next_step_ = 1;
  // Requests held by the heal in progress (resumed when the group serves again).
  std::vector<uint64_t> held_;
  bool holding_ = false;          // HoldForHeal ran for the heal in progress
  uint64_t scheduled_epoch_ = 0;  // the group's epoch the scheduler's state is for
  StepOutcome outcome_;
  std::vector<ScoredPositions> scored_;  // FinishOldest's, kept for their capacity
  v1::StepPlan step_;

  std::thread loop_;
};

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_ENGINE_ENGINE_H_
