#include "coordinator/cluster/step_dispatcher.h"

#include <algorithm>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "coordinator/cluster/worker_messages.h"

namespace shardserve {

using Phase = Membership::Phase;
using LossCause = Membership::LossCause;

StepDispatcher::StepDispatcher(Membership* membership)
    : membership_(membership),
      num_stages_(membership->formation().options().nodes),
      vocab_size_(membership->formation().model().config.vocab_size) {}

bool StepDispatcher::StepSettledLocked(const InFlightStep& step) const {
  for (const Slot& s : membership_->GroupLocked().slots) {
    if (!step.answered[s.rank] && !membership_->LostLocked(s.worker)) return false;
  }
  return true;
}

absl::Status StepDispatcher::CheckResultLocked(int worker, const InFlightStep& step, const v1::StepResult& r) const {
  const auto [stage, tp_rank] = membership_->PositionLocked(worker);
  const bool sampler = stage == num_stages_ - 1 && tp_rank == 0;
  const int want = sampler ? step.rows : 0;
  return CheckStepResult(r, want, sampler && step.wants_logprobs ? step.rows : 0, vocab_size_,
                         sampler ? step.draft_ids : 0);
}

absl::Status StepDispatcher::StartStep(const v1::StepPlan& step, int logit_rows, bool wants_logprobs, int draft_ids) {
  std::vector<int> group;
  std::vector<bool> samples;  // group[i] is a last-stage worker
  uint64_t epoch = 0;
  {
    absl::MutexLock lock(membership_->mu());
    if (membership_->PhaseLocked() != Phase::kServing) return membership_->NotServingLocked();
    const Group& g = membership_->GroupLocked();
    epoch = g.epoch;
    InFlightStep& f = steps_[step.step_id()];
    f.rows = logit_rows;
    f.wants_logprobs = wants_logprobs;
    f.draft_ids = draft_ids;
    f.answered.assign(g.slots.size(), false);
    f.results.assign(g.slots.size(), v1::StepResult());
    for (const Slot& s : g.slots) {
      group.push_back(s.worker);
      samples.push_back(s.stage == num_stages_ - 1);
      membership_->StepSentLocked(s.worker, step.step_id());
    }
  }
  v1::CoordinatorMessage message;
  *message.mutable_step() = step;
  message.mutable_step()->set_epoch(epoch);
  // Token masks are for the last stage's sampler only, and so are the cached tokens' ids a draft
  // model needs: the other stages get the plan without them.
  const bool cached_ids = std::any_of(step.new_seqs().begin(), step.new_seqs().end(),
                                      [](const v1::NewSeq& n) { return n.cached_token_ids_size() > 0; });
  const bool last_only = step.mask_logit_rows_size() > 0 || cached_ids;
  v1::CoordinatorMessage unmasked;
  if (last_only) {
    unmasked = message;
    unmasked.mutable_step()->clear_mask_logit_rows();
    unmasked.mutable_step()->clear_mask_words();
    for (v1::NewSeq& n : *unmasked.mutable_step()->mutable_new_seqs()) n.clear_cached_token_ids();
  }
  for (size_t k = 0; k < group.size(); ++k) {
    membership_->Send(group[k], samples[k] || !last_only ? message : unmasked);
  }
  return absl::OkStatus();
}

void StepDispatcher::DropSteps() {
  absl::MutexLock lock(membership_->mu());
  steps_.clear();
}

void StepDispatcher::OnResult(int worker, const v1::StepResult& r) {
  Outgoing to_send;
  {
    absl::MutexLock lock(membership_->mu());
    if (!membership_->HeardLocked(worker)) return;  // too late: nothing it says matters now
    to_send = membership_->StepAnsweredLocked(worker, r.step_id());
    const auto [stage, tp_rank] = membership_->PositionLocked(worker);
    auto it = steps_.find(r.step_id());
    // Stale: no step in flight by that id, a worker without a slot, or another epoch's result.
    if (it != steps_.end() && stage >= 0 && r.epoch() == membership_->GroupLocked().epoch) {
      const Group& g = membership_->GroupLocked();
      const int pos = RankOf(g.shape, stage, tp_rank);
      if (g.slots[pos].worker == worker && !it->second.answered[pos]) {
        if (absl::Status s = CheckResultLocked(worker, it->second, r); !s.ok()) {
          membership_->MarkLostLocked(worker, LossCause::kMalformed,
                                      absl::StrCat("sent a malformed result: ", s.message()));
        } else {
          it->second.results[pos] = r;
          it->second.answered[pos] = true;
          membership_->SignalLocked();
        }
      }
    }
  }
  membership_->SendAll(to_send);
}

absl::Status StepDispatcher::FinishStep(uint64_t step_id, absl::Duration timeout, StepOutcome* outcome) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(membership_->mu());
  auto it = steps_.find(step_id);
  if (it == steps_.end()) return absl::InternalError(absl::StrCat("step ", step_id, " is not in flight"));
  absl::Cleanup done = [this, step_id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(membership_->mu()) { steps_.erase(step_id); };
  const InFlightStep& step = it->second;
  auto serving = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(membership_->mu()) {
    return membership_->PhaseLocked() == Phase::kServing;
  };
  while (serving() && !StepSettledLocked(step)) {
    if (membership_->WaitLocked(deadline)) break;
  }
  if (serving() && !StepSettledLocked(step)) {
    for (const Slot& s : membership_->GroupLocked().slots) {
      if (!step.answered[s.rank]) {
        membership_->MarkLostLocked(s.worker, LossCause::kStepDeadline,
                                    absl::StrCat("did not answer step ", step_id, " within ",
                                                 absl::FormatDuration(timeout), " (--step-timeout-seconds)"));
      }
    }
  }
  if (!serving()) {
    // Give the other workers a moment to report, so that the message names every worker involved
    // (not while healing: the requests wait, and the heal should not).
    const absl::Time settle = absl::Now() + kLossSettle;
    while (!StepSettledLocked(step) && membership_->PhaseLocked() != Phase::kShuttingDown &&
           membership_->PhaseLocked() != Phase::kHealing) {
      if (membership_->WaitLocked(settle)) break;
    }
    return membership_->NotServingLocked();
  }
  membership_->StepCompletedLocked();
  outcome->sampled_ids.clear();
  outcome->logprobs.clear();
  outcome->non_finite_rows.clear();
  outcome->draft_ids.clear();
  outcome->forward_seconds = outcome->collective_seconds = 0;
  for (const v1::StepResult& r : step.results) {
    if (r.sampled_ids_size() > 0) outcome->sampled_ids.assign(r.sampled_ids().begin(), r.sampled_ids().end());
    if (r.logprobs_size() > 0) outcome->logprobs.assign(r.logprobs().begin(), r.logprobs().end());
    if (r.draft_ids_size() > 0) outcome->draft_ids.assign(r.draft_ids().begin(), r.draft_ids().end());
    if (r.non_finite_rows_size() > 0) {
      outcome->non_finite_rows.assign(r.non_finite_rows().begin(), r.non_finite_rows().end());
    }
    outcome->forward_seconds = std::max(outcome->forward_seconds, r.forward_seconds());
    outcome->collective_seconds = std::max(outcome->collective_seconds, r.collective_seconds());
  }
  return absl::OkStatus();
}

}  // namespace shardserve
