#include "coordinator/engine/engine.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "coordinator/telemetry/log.h"
#include "model/kv_blocks.h"

namespace shardserve {
namespace {

// How long the idle loop sleeps before looking again (it is woken for anything that matters).
constexpr absl::Duration kIdleWait = absl::Milliseconds(100);

double SecondsBetween(SteadyTime a, SteadyTime b) { return std::chrono::duration<double>(b - a).count(); }

// A step's logprobs row for `token` as the API gives them, into `out`.
void SetTokenLogprobs(int32_t token, const v1::RowLogprobs& row, v1::TokenLogprobs* out) {
  out->set_token_id(token);
  out->set_logprob(row.logprob());
  out->set_rank(row.rank());
  for (int k = 0; k < row.top_ids_size(); ++k) {
    v1::TopLogprob* top = out->add_top_logprobs();
    top->set_token_id(row.top_ids(k));
    top->set_logprob(row.top_logprobs(k));
  }
}

const char* FinishLabel(v1::FinishReason r) {
  switch (r) {
    case v1::FINISH_REASON_STOP_TOKEN: return "stop_token";
    case v1::FINISH_REASON_STOP_STRING: return "stop_string";
    case v1::FINISH_REASON_LENGTH: return "length";
    default: return "unspecified";
  }
}

const char* FinishName(v1::FinishReason r) {
  switch (r) {
    case v1::FINISH_REASON_STOP_TOKEN: return "stop token";
    case v1::FINISH_REASON_STOP_STRING: return "stop string";
    case v1::FINISH_REASON_LENGTH: return "length";
    default: return "unfinished";
  }
}

}  // namespace

// ---- RequestStream ------------------------------------------------------------------------------

bool RequestStream::Next(absl::Duration wait, v1::GenerateResponse* response, std::optional<absl::Status>* ended) {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !responses_.empty() || ended_.has_value(); };
  mu_.AwaitWithTimeout(absl::Condition(&ready), wait);
  if (!responses_.empty()) {
    *response = std::move(responses_.front());
    responses_.pop_front();
    return true;
  }
  *ended = ended_;
  return false;
}

void RequestStream::Push(v1::GenerateResponse response) {
  absl::MutexLock lock(&mu_);
  responses_.push_back(std::move(response));
}

void RequestStream::End(absl::Status status) {
  absl::MutexLock lock(&mu_);
  if (!ended_) ended_ = std::move(status);
}

// ---- Engine: the handlers' side -----------------------------------------------------------------

absl::Status CheckSpeculativeOptions(const EngineOptions& o) {
  if (!o.speculative.empty() && o.speculative != "ngram" && o.speculative != "draft" && o.speculative != "mtp" &&
      o.speculative != "eagle3") {
    return absl::InvalidArgumentError(absl::StrCat("--speculative '", o.speculative,
                                                   "' is not a proposer; those there are: ngram, draft, mtp, eagle3"));
  }
  if (o.speculative == "draft" && o.draft_model.empty()) {
    return absl::InvalidArgumentError("--speculative draft needs --draft-model DIR (the draft model's checkpoint)");
  }
  if (o.speculative == "eagle3" && o.draft_model.empty()) {
    return absl::InvalidArgumentError("--speculative eagle3 needs --draft-model DIR (the EAGLE-3 head's directory)");
  }
  if (o.speculative != "draft" && o.speculative != "eagle3" && !o.draft_model.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--draft-model ", o.draft_model, " needs --speculative draft (or eagle3, for an EAGLE-3 head)"));
  }
  if (o.num_speculative_tokens < 0 || o.num_speculative_tokens > kMaxSpeculativeTokens) {
    return absl::InvalidArgumentError(absl::StrCat("--num-speculative-tokens ", o.num_speculative_tokens,
                                                   " is outside [1, ", kMaxSpeculativeTokens, "]"));
  }
  if (!o.speculative.empty() && o.num_speculative_tokens == 0) {
    return absl::InvalidArgumentError(absl::StrCat("--speculative ", o.speculative,
                                                   " needs --num-speculative-tokens in [1, ", kMaxSpeculativeTokens, "]"));
  }
  if (o.speculative.empty() && o.proposer == nullptr && o.num_speculative_tokens != 0) {
    return absl::InvalidArgumentError("--num-speculative-tokens needs --speculative (e.g. --speculative ngram)");
  }
  if (o.adaptive_speculative_tokens && o.speculative.empty() && o.proposer == nullptr) {
    return absl::InvalidArgumentError("--adaptive-speculative-tokens needs --speculative (e.g. --speculative ngram)");
  }
  if (o.speculative_max_running < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--speculative-max-running ", o.speculative_max_running, " is negative (0: no limit)"));
  }
  if (o.ngram_min < 1 || o.ngram_max < o.ngram_min || o.ngram_max > NgramProposer::kMaxN) {
    return absl::InvalidArgumentError(absl::StrCat("n-gram lengths ", o.ngram_min, "..", o.ngram_max,
                                                   " must satisfy 1 <= min <= max <= ", NgramProposer::kMaxN));
  }
  return absl::OkStatus();
}

Engine::Engine(const ServedModel* model, WorkerPool* pool, const EngineOptions& options, CoordinatorMetrics* metrics)
    : model_(model), pool_(pool), options_(options), metrics_(metrics) {
  if (options_.speculative == "ngram") ngram_ = std::make_unique<NgramProposer>(options_.ngram_min, options_.ngram_max);
  // A draft model's guesses, the multi-token-prediction layer's and an EAGLE-3 head's come back alike
  // (StepResult.draft_ids).
  if (options_.speculative == "draft" || options_.speculative == "mtp" || options_.speculative == "eagle3") {
    draft_ = std::make_unique<DraftProposer>();
  }
  loop_ = std::thread([this] { Loop(); });
}

Engine::~Engine() { Shutdown(); }

void Engine::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    shutting_down_ = true;
    wake_.SignalAll();
  }
  if (loop_.joinable()) loop_.join();
}

absl::StatusOr<Engine::Submitted> Engine::Submit(GenerationParams params, SteadyTime arrival) {
  // A healing group takes requests (they wait for it), until the heal has lasted heal_timeout.
  if (const std::optional<absl::Time> since = pool_->HealingSince();
      !since.has_value() || absl::Now() - *since > options_.heal_timeout) {
    SHARDSERVE_RETURN_IF_ERROR(pool_->CheckServing());
  }
  absl::MutexLock lock(&mu_);
  if (shutting_down_) return absl::UnavailableError("the coordinator is shutting down");
  // Requests not yet scheduled take the free places of the running batch first, then the queue.
  const int64_t max_running = pool_->limits().max_seqs_per_step;
  const int64_t free_places = std::max<int64_t>(0, max_running - stats_.running());
  if (queued_ >= options_.max_waiting + free_places) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the server is full: ", stats_.running(), " sequences are running (--max-num-seqs ", max_running, ") and ",
        queued_ - free_places, " requests are waiting (--max-waiting-requests ", options_.max_waiting,
        "); retry later"));
  }
  if (params.prompt_logprobs >= 0 && (!options_.speculative.empty() || options_.proposer != nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling.prompt_logprobs: not served with speculative decoding (this coordinator runs --speculative ",
        options_.speculative.empty() ? "with a test proposer" : options_.speculative, ")"));
  }
  auto r = std::make_unique<Request>();
  r->id = next_id_++;
  r->stream = std::make_shared<RequestStream>();
  r->params = std::move(params);
  r->arrival = arrival;
  Submitted out{r->id, r->stream};
  inbox_.push_back(std::move(r));
  ++queued_;
  wake_.SignalAll();
  return out;
}

void Engine::Cancel(uint64_t id, absl::Status why) {
  absl::MutexLock lock(&mu_);
  cancels_.emplace_back(id, std::move(why));
  wake_.SignalAll();
}

void Engine::FillStatus(v1::SchedulerStatus* status) {
  {
    absl::MutexLock lock(&mu_);
    *status = stats_;
    status->set_waiting(static_cast<int32_t>(inbox_.size() + stats_.waiting()));
    if (stats_.kv_blocks_total() > 0) return;
  }
  // The group serves but the loop has not made its scheduler yet (it does within kIdleWait).
  if (!pool_->CheckServing().ok()) return;
  const SchedulerOptions o = SchedulerOptionsFromPool();
  status->set_kv_blocks_total(o.limits.num_kv_blocks);
  status->set_kv_blocks_free(o.limits.num_kv_blocks);
  status->set_block_size(o.limits.block_size);
  status->set_max_running(static_cast<int32_t>(o.limits.max_seqs_per_step));
  status->set_max_waiting(static_cast<int32_t>(options_.max_waiting));
  status->set_micro_batches(o.lanes);
  status->set_max_tokens_per_step(o.limits.max_tokens_per_step);
  status->set_prefix_caching(o.prefix_caching);
  status->set_speculative(o.proposer != nullptr ? (options_.speculative.empty() ? "test" : options_.speculative) : "");
}

// ---- Engine: the loop ---------------------------------------------------------------------------

void Engine::Loop() {
  for (;;) {
    std::vector<std::unique_ptr<Request>> arrivals;
    std::vector<std::pair<uint64_t, absl::Status>> cancels;
    {
      absl::MutexLock lock(&mu_);
      const bool idle = scheduler_ == nullptr || scheduler_->num_running() + scheduler_->num_waiting() == 0;
      if (in_flight_.empty() && cancels_.empty() && !shutting_down_ &&
          ((inbox_.empty() && idle) || pool_->HealingSince().has_value())) {
        wake_.WaitWithTimeout(&mu_, kIdleWait);
      }
      if (shutting_down_) break;
      arrivals.swap(inbox_);
      cancels.swap(cancels_);
    }
    if (!EnsureScheduler() && !arrivals.empty()) {
      const absl::Status s = pool_->CheckServing();
      for (auto& r : arrivals) {
        CoordinatorRequestLog(r->params.request_id, absl::StrCat("refused: ", s.message()), "warn");
        EndStream(*r, s.ok() ? absl::UnavailableError("the worker group is not serving") : s);
      }
      arrivals.clear();
    }
    for (auto& r : arrivals) Admit(std::move(r));
    for (const auto& [id, why] : cancels) CancelNow(id, why);
    if (scheduler_ == nullptr) continue;
    if (!arrivals.empty() || !cancels.empty()) PublishStats();
    if (WaitForHeal()) continue;

    absl::Status status = SendSteps();
    if (status.ok() && !in_flight_.empty()) status = FinishOldest();
    if (!status.ok()) {
      if (pool_->HealingSince().has_value()) {
        HoldForHeal(status);
      } else {
        FailAll(status);
      }
    }
    PublishStats();
  }
  FailAll(absl::UnavailableError("the coordinator is shutting down"));
}

SchedulerOptions Engine::SchedulerOptionsFromPool() {
  SchedulerOptions o;
  o.limits = pool_->limits();
  o.lanes = options_.micro_batches > 0 ? options_.micro_batches : pool_->num_stages();
  o.prefix_caching = options_.prefix_caching;
  o.proposer = ngram_ != nullptr ? ngram_.get() : draft_ != nullptr ? draft_.get() : options_.proposer;
  o.num_speculative_tokens = o.proposer != nullptr ? options_.num_speculative_tokens : 0;
  o.guess_filter = this;
  o.speculative_max_running = options_.speculative_max_running;
  o.adaptive_speculative_tokens = options_.adaptive_speculative_tokens;
  // The workers put in the samples themselves: those that embed must hold them, so the group is one
  // stage, whose TP rank 0 samples and, in a TP group, shares them (StepPlan.share_samples).
  o.feed_samples = options_.async_scheduling && pool_->num_stages() == 1 && o.proposer == nullptr;
  // Where every layer slides (Mistral or Phi-3 with a window), sequences let go of the blocks
  // behind their window (scheduler.h). Where full-attention layers sit beside sliding ones (Gemma
  // 2 and 3), the sliding layers have a pool of their own on the workers (num_sliding_kv_blocks,
  // model/kv_blocks.h), from which sequences let go of those blocks likewise; the full layers keep
  // every block.
  int64_t window = 0;
  bool full_layers = false;
  for (int64_t i = 0; i < model_->config.num_hidden_layers; ++i) {
    window = std::max(window, model_->config.LayerWindow(i));
    full_layers = full_layers || model_->config.LayerWindow(i) == 0;
  }
  if (!full_layers) {
    o.sliding_window = window;
    o.full_layers = false;
  } else if (o.limits.num_sliding_kv_blocks > 0) {
    o.sliding_window = SlidingPoolWindow(model_->config);
    o.full_layers = true;
  }
  return o;
}

bool Engine::EnsureScheduler() {
  if (scheduler_ != nullptr) return true;
  if (!pool_->CheckServing().ok()) return false;
  const SchedulerOptions o = SchedulerOptionsFromPool();
  scheduler_ = std::make_unique<Scheduler>(o);
  share_samples_ = o.feed_samples && pool_->group_size() > 1;
  CoordinatorLog("scheduler", absl::StrCat("continuous batching: up to ", o.limits.max_seqs_per_step, " sequences and ",
                                           o.limits.max_tokens_per_step, " tokens per step, ", o.lanes,
                                           " micro-batch(es) in flight, KV cache ", o.limits.num_kv_blocks, " blocks of ",
                                           o.limits.block_size, " tokens, prefix caching ",
                                           o.prefix_caching ? "on" : "off",
                                           o.feed_samples ? ", asynchronous scheduling" : "",
                                           o.sliding_window > 0
                                               ? absl::StrCat(", blocks behind the ", o.sliding_window,
                                                              "-token sliding window let go",
                                                              o.full_layers ? absl::StrCat(" from the sliding layers' ",
                                                                                           o.limits.num_sliding_kv_blocks,
                                                                                           " blocks")
                                                                            : "")
                                               : ""));
  if (metrics_ != nullptr) metrics_->kv_blocks_total.Set(static_cast<double>(o.limits.num_kv_blocks));
  PublishStats();
  return true;
}

void Engine::Admit(std::unique_ptr<Request> r) {
  const GenerationParams& p = r->params;
  r->generation = std::make_unique<Generation>(r->params, model_->eos_ids, model_->tokenizer.get());
  if (p.grammar != nullptr) r->matcher = std::make_unique<grammar::GrammarMatcher>(p.grammar);
  SeqOptions seq;
  seq.max_len = static_cast<int64_t>(p.prompt.size()) + p.max_tokens;
  seq.feed_ahead = r->matcher == nullptr;  // a grammar's mask needs the token sampled before it
  scheduler_->Add(r->id, p.prompt, SamplingTemplate(p), seq);
  if (metrics_ != nullptr) metrics_->prompt_tokens.Increment(static_cast<double>(p.prompt.size()));
  CoordinatorRequestLog(p.request_id, absl::StrFormat("queued: %d prompt tokens, max_tokens %d, temperature %g%s",
                                                      p.prompt.size(), p.max_tokens, p.temperature,
                                                      p.ignore_eos ? ", ignore_eos" : ""));
  requests_[r->id] = std::move(r);
}

void Engine::CancelNow(uint64_t id, const absl::Status& why) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;  // already ended
  CoordinatorRequestLog(it->second->params.request_id,
                        absl::StrCat(why.message(), " after ", it->second->generation->completion_tokens(),
                                     " tokens: removed, its KV blocks freed"));
  End(id, why);
}

absl::Status Engine::SendSteps() {
  for (int lane = 0; lane < scheduler_->lanes(); ++lane) {
    while (!scheduler_->LaneBusy(lane)) {
      const MicroBatch* batch = scheduler_->Schedule(lane, next_step_, &step_);
      if (batch == nullptr) break;
      SHARDSERVE_RETURN_IF_ERROR(SendStep(*batch));
    }
  }
  return absl::OkStatus();
}

absl::Status Engine::SendStep(const MicroBatch& batch) {
  ++next_step_;
  AddTokenMasks(batch, &step_);
  step_.set_share_samples(share_samples_);
  const auto now = std::chrono::steady_clock::now();
  if (!batch.started.empty()) {
    for (uint64_t id : batch.started) {
      Request& r = *requests_.at(id);
      r.started = now;
      if (metrics_ != nullptr) metrics_->request_queue.Observe(SecondsBetween(r.arrival, now));
    }
    absl::MutexLock lock(&mu_);
    queued_ -= static_cast<int64_t>(batch.started.size());
  }
  if (metrics_ != nullptr) {
    metrics_->step_sequences.Observe(static_cast<double>(batch.entries.size()));
    metrics_->step_tokens.Observe(static_cast<double>(batch.prefill_tokens + batch.decode_tokens));
    metrics_->step_plan_bytes.Increment(static_cast<double>(step_.ByteSizeLong()));
  }
  SHARDSERVE_RETURN_IF_ERROR(pool_->StartStep(step_, batch.logit_rows, batch.wants_logprobs, batch.draft_ids));
  InFlight f;
  f.lane = batch.lane;
  f.step_id = batch.step_id;
  f.sent = now;
  if (batch.draft_tokens > 0) {
    f.draft_tokens = batch.draft_tokens;
    for (const MicroBatch::Entry& e : batch.entries) {
      if (e.logit_row >= 0) f.sampling.push_back(e.seq);
    }
  }
  in_flight_.push_back(std::move(f));
  return absl::OkStatus();
}

absl::Status Engine::FinishOldest() {
  const InFlight f = in_flight_.front();
  in_flight_.pop_front();
  SHARDSERVE_RETURN_IF_ERROR(pool_->FinishStep(f.step_id, options_.step_timeout, &outcome_));
  const auto now = std::chrono::steady_clock::now();
  // A step sent while the one before it was in flight (asynchronous scheduling, micro-batches) is
  // timed from that one's result (StepTimings.step_seconds).
  const double step_seconds = SecondsBetween(std::max(f.sent, last_finish_), now);
  last_finish_ = now;
  scored_.clear();
  const std::vector<SampledToken> sampled = scheduler_->Complete(f.lane, outcome_.sampled_ids, &scored_);
  TakeScored(scored_);
  // The draft model's guesses, made for each sampled sequence's tokens as verified now: served at
  // its next decode (DraftProposer), before its tokens are streamed (a request they end forgets
  // them).
  if (draft_ != nullptr && f.draft_tokens > 0 &&
      outcome_.draft_ids.size() == f.sampling.size() * static_cast<size_t>(f.draft_tokens)) {
    for (size_t i = 0; i < f.sampling.size(); ++i) {
      const auto from = outcome_.draft_ids.begin() + static_cast<std::ptrdiff_t>(i * f.draft_tokens);
      if (scheduler_->Contains(f.sampling[i])) {
        draft_->Offer(f.sampling[i], scheduler_->num_tokens(f.sampling[i]),
                      std::vector<int32_t>(from, from + f.draft_tokens));
      }
    }
  }
  for (const SampledToken& t : sampled) {
    auto found = requests_.find(t.seq);
    if (found == requests_.end()) continue;  // ended by an earlier token of the same step's accepted run
    Request& r = *found->second;
    if (std::binary_search(outcome_.non_finite_rows.begin(), outcome_.non_finite_rows.end(), t.logit_row)) {
      // A numeric failure of this sequence alone (its input overflowed the model): its request
      // fails; the group and the other sequences of the step go on.
      const absl::Status failed = absl::InternalError(absl::StrCat(
          "the model's logits for this sequence were not finite (NaN or infinity) after ",
          r.generation->completion_tokens(), " generated tokens: the model's arithmetic overflowed on this input"));
      CoordinatorRequestLog(r.params.request_id, absl::StrCat("failed: ", failed.message()), "error");
      End(t.seq, failed);
      continue;
    }
    if (r.matcher != nullptr) {
      if (absl::Status s = AcceptConstrained(r, t.token); !s.ok()) {
        CoordinatorRequestLog(r.params.request_id, absl::StrCat("failed: ", s.message()), "error");
        End(t.seq, s);
        continue;
      }
    }
    v1::GenerateResponse response;
    const bool done = r.generation->Accept(t.token, &response);
    const int64_t cached = scheduler_->cached_prompt_tokens(t.seq);
    if (response.has_usage()) response.mutable_usage()->set_cached_prompt_tokens(static_cast<int32_t>(cached));
    response.set_request_id(r.params.request_id);
    v1::StepTimings* timings = response.mutable_timings();
    timings->set_step_seconds(step_seconds);
    timings->set_forward_seconds(outcome_.forward_seconds);
    timings->set_collective_seconds(outcome_.collective_seconds);
    if (r.params.logprobs && t.logit_row < static_cast<int32_t>(outcome_.logprobs.size())) {
      SetTokenLogprobs(t.token, outcome_.logprobs[t.logit_row], response.add_logprobs());
    }
    const int32_t generated = r.generation->completion_tokens();
    if (generated == 1 && r.params.prompt_logprobs >= 0) {
      const int64_t scored = std::count(r.prompt_scored.begin(), r.prompt_scored.end(), true);
      if (scored != static_cast<int64_t>(r.params.prompt.size()) - 1) {
        const absl::Status failed = absl::InternalError(absl::StrCat(
            "the prompt's log-probabilities are incomplete at its first token: ", scored, " of ",
            r.params.prompt.size() - 1, " positions scored"));
        CoordinatorRequestLog(r.params.request_id, absl::StrCat("failed: ", failed.message()), "error");
        End(t.seq, failed);
        continue;
      }
      for (v1::TokenLogprobs& l : r.prompt_logprobs) *response.add_prompt_logprobs() = std::move(l);
      r.prompt_logprobs.clear();
    }
    if (generated == 1) r.first_token_seconds = SecondsBetween(r.arrival, now);
    if (metrics_ != nullptr) {
      if (generated == 1) {
        metrics_->time_to_first_token.Observe(r.first_token_seconds);
      } else {
        metrics_->inter_token_latency.Observe(SecondsBetween(r.last_token, now));
      }
      metrics_->generated_tokens.Increment(response.token_ids_size());
      if (done) metrics_->Finished(FinishLabel(response.finish_reason()));
    }
    r.last_token = now;
    if (done) {
      const double seconds = SecondsBetween(r.arrival, now);
      CoordinatorRequestLog(r.params.request_id,
                            absl::StrFormat("finished (%s): %d + %d tokens (%d prompt tokens from the prefix cache) "
                                            "in %.2f s, first token after %.3f s, %.1f tokens/s",
                                            FinishName(response.finish_reason()), r.params.prompt.size(), generated,
                                            cached, seconds, r.first_token_seconds,
                                            generated / std::max(seconds, 1e-9)));
    }
    r.stream->Push(std::move(response));
    if (done) End(t.seq, absl::OkStatus());
  }
  return absl::OkStatus();
}

void Engine::TakeScored(const std::vector<ScoredPositions>& scored) {
  for (const ScoredPositions& sp : scored) {
    auto found = requests_.find(sp.seq);
    if (found == requests_.end()) continue;
    Request& r = *found->second;
    const int64_t n = static_cast<int64_t>(r.params.prompt.size()) - 1;
    if (r.prompt_logprobs.empty()) {
      r.prompt_logprobs.resize(static_cast<size_t>(n));
      r.prompt_scored.assign(static_cast<size_t>(n), false);
    }
    const auto& bad_rows = outcome_.non_finite_rows;
    const auto first_bad = std::lower_bound(bad_rows.begin(), bad_rows.end(), sp.logit_row);
    if (first_bad != bad_rows.end() && *first_bad < sp.logit_row + sp.count) {
      const absl::Status failed = absl::InternalError(absl::StrCat(
          "the model's logits at prompt position ", sp.position + (*first_bad - sp.logit_row),
          " were not finite (NaN or infinity): the model's arithmetic overflowed on this input"));
      CoordinatorRequestLog(r.params.request_id, absl::StrCat("failed: ", failed.message()), "error");
      End(sp.seq, failed);
      continue;
    }
    for (int32_t j = 0; j < sp.count; ++j) {
      const int32_t row = sp.logit_row + j;
      const int64_t at = sp.position + j;  // predicts the prompt token at + 1
      if (at < 0 || at >= n || row >= static_cast<int32_t>(outcome_.logprobs.size()) ||
          row >= static_cast<int32_t>(outcome_.sampled_ids.size())) {
        continue;
      }
      v1::TokenLogprobs& l = r.prompt_logprobs[static_cast<size_t>(at)];
      l.Clear();
      SetTokenLogprobs(outcome_.sampled_ids[row], outcome_.logprobs[row], &l);
      r.prompt_scored[static_cast<size_t>(at)] = true;
    }
  }
}

void Engine::AddTokenMasks(const MicroBatch& batch, v1::StepPlan* step) {
  for (const MicroBatch::Entry& e : batch.entries) {
    if (e.logit_row < 0) continue;
    Request& r = *requests_.at(e.seq);
    if (r.matcher == nullptr) continue;
    const int words = r.matcher->mask_words();
    google::protobuf::RepeatedField<uint32_t>* out = step->mutable_mask_words();
    const int at = out->size();
    out->Resize(at + e.samples * words, 0);
    if (r.guess_mask_rows >= e.samples) {
      // Made when the scheduler cut the guesses (Allowed); the first e.samples of them.
      std::copy_n(r.guess_masks.begin(), e.samples * words, out->mutable_data() + at);
    } else {
      r.matcher->FillNextTokenBitmask(out->mutable_data() + at);  // no guesses: e.samples is 1
    }
    r.guess_mask_rows = 0;
    for (int i = 0; i < e.samples; ++i) {
      uint32_t* mask = out->mutable_data() + at + i * words;
      step->add_mask_logit_rows(e.logit_row + i);
      if (std::all_of(mask, mask + words, [](uint32_t w) { return w == 0; })) {
        // Nothing allowed (a matcher that stopped, or a grammar that ends where the model has no
        // EOS; only ever at the row's first position, as guesses before such a position are
        // cut): the row still needs a token the workers accept; the request ends when it comes
        // back.
        r.grammar_error = r.matcher->status().ok()
                              ? absl::InternalError("the structured output's grammar allows no token here")
                              : absl::ResourceExhaustedError(absl::StrCat(
                                    "the structured output's grammar is too ambiguous to follow: ", r.matcher->status().message()));
        mask[0] = 1;
      }
    }
  }
}

int Engine::Allowed(uint64_t seq, const std::vector<int32_t>& guesses) {
  auto it = requests_.find(seq);
  if (it == requests_.end()) return 0;
  Request& r = *it->second;
  if (r.matcher == nullptr) return static_cast<int>(guesses.size());
  // Its matcher is over every token sampled so far: a sequence decodes once its step is back.
  const int kept = r.matcher->GuessMasks(guesses, &r.guess_masks);
  r.guess_mask_rows = kept + 1;
  return kept;
}

absl::Status Engine::AcceptConstrained(Request& r, int32_t token) {
  if (!r.grammar_error.ok()) return r.grammar_error;
  if (!r.matcher->AcceptToken(token)) {
    return absl::InternalError(absl::StrCat("the sampled token ", token,
                                            " is not one the structured output's grammar allows (its mask was ignored)"));
  }
  return absl::OkStatus();
}

void Engine::EndStream(Request& r, const absl::Status& status) {
  r.stream->End(status);
  if (r.started == SteadyTime()) {  // never scheduled: it was still counted as queued
    absl::MutexLock lock(&mu_);
    --queued_;
  }
}

void Engine::End(uint64_t id, const absl::Status& status) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  // The scheduler and the published status (metrics, GetClusterStatus) let the sequence go before
  // its client learns that it ended: a client that reads them next sees it gone.
  if (scheduler_ != nullptr) {
    scheduler_->Remove(id);
    PublishStats();
  }
  if (draft_ != nullptr) draft_->Forget(id);
  EndStream(*it->second, status);
  requests_.erase(it);
}

void Engine::FailAll(const absl::Status& status) {
  for (auto& [id, r] : requests_) {
    CoordinatorRequestLog(r->params.request_id,
                          absl::StrCat("aborted after ", r->generation->completion_tokens(), " tokens: ",
                                       status.message()),
                          "error");
    EndStream(*r, status);
  }
  requests_.clear();
  if (scheduler_ != nullptr) scheduler_->Clear();
  if (draft_ != nullptr) draft_->Clear();
  in_flight_.clear();
  pool_->DropSteps();
  std::vector<std::unique_ptr<Request>> inbox;
  {
    absl::MutexLock lock(&mu_);
    inbox.swap(inbox_);
  }
  for (auto& r : inbox) EndStream(*r, status);
}

void Engine::HoldForHeal(const absl::Status& status) {
  in_flight_.clear();
  pool_->DropSteps();
  scheduler_->RequeueAllForRegroup();
  if (draft_ != nullptr) draft_->Clear();  // the new group's draft starts empty and catches up
  holding_ = true;
  held_.clear();
  for (auto& [id, r] : requests_) {
    held_.push_back(id);
    CoordinatorRequestLog(r->params.request_id,
                          absl::StrCat("held after ", r->generation->completion_tokens(),
                                       " tokens: it resumes by recompute when the worker group has healed (",
                                       status.message(), ")"),
                          "warn");
  }
}

bool Engine::WaitForHeal() {
  const std::optional<absl::Time> since = pool_->HealingSince();
  const uint64_t epoch = pool_->epoch();
  if (since.has_value()) {
    if (!holding_) HoldForHeal(pool_->CheckServing());
    if (absl::Now() - *since > options_.heal_timeout && !requests_.empty()) {
      const absl::Status why = pool_->CheckServing();
      const absl::Status status = absl::UnavailableError(absl::StrCat(
          why.message(), "; the heal took longer than ", absl::FormatDuration(options_.heal_timeout),
          " (--heal-timeout-seconds)"));
      if (metrics_ != nullptr) metrics_->heal_requests_failed.Increment(static_cast<double>(requests_.size()));
      FailAll(status);
      held_.clear();
    }
    return true;
  }
  // The group re-formed (also when it healed between two looks: its epoch moved on).
  if (!holding_ && scheduled_epoch_ != 0 && epoch != scheduled_epoch_) {
    HoldForHeal(absl::UnavailableError(absl::StrCat("the worker group re-formed under epoch ", epoch)));
  }
  scheduled_epoch_ = epoch;
  if (holding_) {
    holding_ = false;
    int64_t resumed = 0;
    for (uint64_t id : held_) {
      auto it = requests_.find(id);
      if (it == requests_.end()) continue;
      ++resumed;
      CoordinatorRequestLog(it->second->params.request_id,
                            absl::StrCat("resumed by recompute after ", it->second->generation->completion_tokens(),
                                         " tokens (epoch ", epoch, ")"));
    }
    if (metrics_ != nullptr) metrics_->heal_requests_resumed.Increment(static_cast<double>(resumed));
    held_.clear();
  }
  return false;
}

void Engine::PublishSpeculation(v1::SchedulerStatus* s) {
  const SchedulerOptions& o = scheduler_->options();
  if (o.proposer == nullptr) return;
  const SpeculationStats& spec = scheduler_->speculation();
  s->set_speculative(options_.speculative.empty() ? "test" : options_.speculative);
  s->set_spec_proposed_tokens(spec.proposed);
  s->set_spec_accepted_tokens(spec.accepted);
  s->set_spec_verifications(spec.verifications);
  s->mutable_spec_accepted_by_position()->Add(spec.accepted_by_position.begin(), spec.accepted_by_position.end());
  if (metrics_ != nullptr) metrics_->Speculation(spec.proposed, spec.accepted, spec.verifications, spec.accepted_by_position);
}

void Engine::PublishStats() {
  if (scheduler_ == nullptr) return;
  const SchedulerOptions& o = scheduler_->options();
  v1::SchedulerStatus s;
  s.set_kv_blocks_total(scheduler_->num_blocks());
  s.set_kv_blocks_free(scheduler_->num_free_blocks());
  s.set_block_size(o.limits.block_size);
  s.set_running(static_cast<int32_t>(scheduler_->num_running()));
  s.set_waiting(static_cast<int32_t>(scheduler_->num_waiting()));  // FillStatus adds the inbox
  s.set_max_running(static_cast<int32_t>(o.limits.max_seqs_per_step));
  s.set_max_waiting(static_cast<int32_t>(options_.max_waiting));
  s.set_preemptions(scheduler_->preemptions());
  s.set_micro_batches(o.lanes);
  s.set_max_tokens_per_step(o.limits.max_tokens_per_step);
  s.set_prefix_caching(o.prefix_caching);
  s.set_kv_blocks_cached(scheduler_->num_cached_blocks());
  s.set_prefix_cache_query_tokens(scheduler_->prefix_query_tokens());
  s.set_prefix_cache_hit_tokens(scheduler_->prefix_hit_tokens());
  PublishSpeculation(&s);
  if (metrics_ != nullptr) {
    metrics_->kv_blocks_used.Set(static_cast<double>(s.kv_blocks_total() - s.kv_blocks_free()));
    metrics_->requests_running.Set(static_cast<double>(s.running()));
    const double new_preemptions = static_cast<double>(s.preemptions()) - metrics_->preemptions.Value();
    if (new_preemptions > 0) metrics_->preemptions.Increment(new_preemptions);
    // The scheduler's counters are cumulative, like the metrics.
    for (auto [counter, total] : {std::pair{&metrics_->prefix_cache_queries, s.prefix_cache_query_tokens()},
                                  std::pair{&metrics_->prefix_cache_hits, s.prefix_cache_hit_tokens()}}) {
      const double added = static_cast<double>(total) - counter->Value();
      if (added > 0) counter->Increment(added);
    }
    metrics_->prefix_cache_blocks.Set(static_cast<double>(s.kv_blocks_cached()));
  }
  absl::MutexLock lock(&mu_);
  stats_ = s;
  if (metrics_ != nullptr) metrics_->requests_waiting.Set(static_cast<double>(inbox_.size() + s.waiting()));
}

}  // namespace shardserve
