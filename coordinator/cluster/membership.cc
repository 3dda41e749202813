#include "coordinator/cluster/membership.h"

#include <algorithm>
#include <map>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "coordinator/cluster/worker_messages.h"
#include "coordinator/telemetry/log.h"

namespace shardserve {
namespace {

// Why a worker whose stream is gone is lost, whether the reader or a writer noticed first.
constexpr char kStreamEnded[] =
    "its control stream ended (the process exited or was killed, or the connection dropped)";
// Re-formings without a step completing in between before the group is given up: a worker that
// fails every step on its own (not because a peer died) would otherwise heal forever.
constexpr int kMaxHealsWithoutProgress = 3;

}  // namespace

Membership::Membership(GroupFormation formation) : formation_(std::move(formation)) {
  monitor_ = std::thread([this] { MonitorLoop(); });
}

Membership::~Membership() {
  {
    absl::MutexLock lock(&mu_);
    stop_monitor_ = true;
  }
  monitor_.join();
}

void Membership::SetServingListener(std::function<void(bool)> listener) {
  absl::MutexLock lock(&mu_);
  listener_ = std::move(listener);
  listener_(phase_ == Phase::kServing);
}

// ---- Registration and the group ---------------------------------------------------------------

absl::StatusOr<int> Membership::Register(const v1::Register& hello, WorkerLink* link) {
  SHARDSERVE_RETURN_IF_ERROR(CheckRegister(hello));

  Outgoing to_send;
  int index = 0;
  {
    absl::MutexLock lock(&mu_);
    const int expected = options_.nodes * options_.gpus_per_node;
    const bool healing = phase_ == Phase::kHealing;
    switch (phase_) {
      case Phase::kShuttingDown: return absl::UnavailableError("the coordinator is shutting down");
      case Phase::kFailed: return absl::FailedPreconditionError(failed_reason_);
      case Phase::kWaiting: {  // one more worker for the group, or a spare
        std::map<std::string, int> per_node;
        for (int i : pending_) ++per_node[workers_[i]->hello.node()];
        if (!per_node.count(hello.node()) && static_cast<int>(per_node.size()) == options_.nodes) {
          std::vector<std::string> names;
          for (const auto& [name, count] : per_node) names.push_back(name);
          return absl::FailedPreconditionError(absl::StrCat("the group already has its ", options_.nodes, " nodes (",
                                                            absl::StrJoin(names, ", "), "): node ", hello.node(),
                                                            " is one too many (--nodes)"));
        }
        if (hello.spare() || per_node[hello.node()] >= options_.gpus_per_node) {
          // A spare, or its node has its workers already (most often one of them, started again by
          // a supervisor, or one too many started for it): it waits as a spare of its node, as it
          // would once the group serves.
          return RegisterSpareWhileWaitingLocked(hello, link);
        }
        index = AddWorkerLocked(hello, link);
        pending_.push_back(index);
        CoordinatorLog(workers_[index]->id,
                       absl::StrCat("registered from node ", hello.node(), " (", hello.device(), ", ", hello.address(),
                                    hello.metrics_address().empty() ? "" : ", metrics ", hello.metrics_address(),
                                    hello.has_held() ? absl::StrCat(", holding stage ", hello.held().assignment().stage(),
                                                                    " tp rank ", hello.held().assignment().tp_rank(),
                                                                    " of epoch ", hello.held().assignment().epoch(),
                                                                    " from an earlier coordinator")
                                                     : "",
                                    "): ", pending_.size(), " of ", expected, " workers"),
                       LogIds{"", workers_[index]->id, hello.node()});
        if (static_cast<int>(pending_.size()) == expected) to_send = FormGroupLocked();
        break;
      }
      case Phase::kHealing:
      case Phase::kLoading:
      case Phase::kServing: {
        // A worker (not Register.spare) takes an open slot of its node (healing). Otherwise (most
        // often the worker of a slot a spare or a replacement has taken, started again by a
        // supervisor, or a lost worker that registers again), and always for Register.spare, it
        // becomes a spare of its node, if it is of one of the group's nodes and fits its slots; a
        // spare takes an open slot of its node at once.
        const bool open = healing && !hello.spare() && HasOpenSlotLocked(hello.node());
        absl::StatusOr<int> joined = open ? RegisterReplacementLocked(hello, link) : RegisterAsSpareLocked(hello, link);
        if (!joined.ok()) {
          CoordinatorLog("group", absl::StrCat("refused a ", hello.spare() ? "spare" : "worker", " from node ",
                                               hello.node(), ": ", joined.status().message()),
                         LogIds{"", "", hello.node(), -1, -1, "warn"});
          return joined.status();
        }
        index = *joined;
        if (healing) {
          UseSparesLocked();
          to_send = TryRegroupLocked();
        }
        break;
      }
    }
  }
  SendAll(to_send);
  return index;
}

void Membership::Send(int worker, const v1::CoordinatorMessage& message) {
  if (!SendTo(worker, message)) {
    absl::MutexLock lock(&mu_);
    MarkLostLocked(worker, LossCause::kStreamEnded, kStreamEnded);
  }
}

void Membership::SendAll(const Outgoing& messages) {
  for (const auto& [i, message] : messages) Send(i, message);
}

Outgoing Membership::FormGroupLocked() {
  std::vector<Registered> registered;
  for (int i : pending_) registered.push_back(Registered{i, &workers_[i]->hello});
  absl::StatusOr<FormedGroup> formed = formation_.Form(registered);
  Outgoing out;
  if (!formed.ok()) {
    failed_reason_ = absl::StrCat("cannot plan ", formation_.model().name,
                                  " on the registered workers: ", formed.status().message());
    CoordinatorLog("group", failed_reason_);
    SetPhaseLocked(Phase::kFailed);
    for (const std::vector<int>* workers : {&pending_, &spares_}) {
      for (int i : *workers) {
        v1::CoordinatorMessage m;
        m.mutable_shutdown()->set_reason(failed_reason_);
        out.emplace_back(i, std::move(m));
      }
    }
    return out;
  }
  plan_ = std::move(formed->plan);
  limits_ = formed->limits;
  group_ = std::move(formed->group);
  std::vector<std::string> stages;
  for (const Slot& slot : group_->slots) {
    const StagePlan& st = plan_->stages[slot.stage];
    v1::CoordinatorMessage m = AssignmentLocked(slot);
    out.emplace_back(slot.worker, std::move(m));
    if (slot.tp_rank == 0) {
      stages.push_back(absl::StrCat("stage ", slot.stage, " = node ", slot.node, " (layers ", st.first_layer, "-",
                                    st.last_layer, ")"));
    }
  }
  pending_.clear();
  // Spares that registered while the group formed can be checked against their node's slots now.
  for (auto& message : LetGoUnfitSparesLocked()) out.push_back(std::move(message));
  SetPhaseLocked(Phase::kLoading);
  CoordinatorLog("group", absl::StrCat("complete (epoch ", group_->epoch, "); planned TP=", options_.gpus_per_node,
                                       " x PP=", options_.nodes, ", max_model_len ", plan_->max_model_len,
                                       ", KV cache ", limits_.num_kv_blocks, " blocks of ", limits_.block_size,
                                       " tokens (", formed->kv_from, "): ", absl::StrJoin(stages, ", "),
                                       "; loading"));
  return out;
}

v1::CoordinatorMessage Membership::AssignmentLocked(const Slot& slot) {
  Worker& w = *workers_[slot.worker];
  v1::CoordinatorMessage m;
  v1::Assignment* a = m.mutable_assignment();
  *a = formation_.AssignmentFor(slot, w.id, group_->epoch, *plan_, limits_);
  w.stage = slot.stage;
  w.tp_rank = slot.tp_rank;
  w.first_layer = a->first_layer();
  w.end_layer = a->end_layer();
  w.state = v1::WORKER_STATE_LOADING;
  w.epoch = group_->epoch;
  w.failed = false;
  w.load_pending = true;
  if (metrics_ != nullptr) metrics_->SetWorkerUp(w.id, w.hello.node(), w.stage, w.tp_rank, true);
  a->set_rendezvous_token(rendezvous_grants_.Grant(slot.worker, w.id, group_->epoch, RendezvousGroupsOf(slot)));
  w.adopting = false;
  if (w.hello.has_held() && !w.loaded) {
    // It outlived an earlier coordinator holding a shard: adopt it when that shard is this slot's.
    const v1::HeldShard& held = w.hello.held();
    const std::string where = absl::StrCat("slot (node ", slot.node, ", stage ", slot.stage, ", tp rank ",
                                           slot.tp_rank, ")");
    if (const absl::Status same = formation_.CheckAdopt(held, *a); same.ok()) {
      a->set_adopt(true);
      w.adopting = true;
      CoordinatorLog(NameLocked(slot.worker),
                     absl::StrCat("adopting into ", where, " under epoch ", group_->epoch,
                                  ": it holds that shard (loaded as ", held.assignment().worker_id().substr(0, 64),
                                  " of epoch ", held.assignment().epoch(), " for an earlier coordinator); it keeps "
                                  "its weights and joins the new groups"),
                     LogIds{"", w.id, w.hello.node(), slot.stage, slot.tp_rank});
    } else {
      CoordinatorLog(NameLocked(slot.worker),
                     absl::StrCat("holds another shard than ", where, " needs (", same.message(),
                                  "): it drops it and loads the slot's"),
                     LogIds{"", w.id, w.hello.node(), slot.stage, slot.tp_rank, "warn"});
    }
  }
  return m;
}

void Membership::OnMessage(int index, const v1::WorkerMessage& message) {
  Outgoing to_send;
  {
    absl::MutexLock lock(&mu_);
    if (!HeardLocked(index)) return;  // too late: nothing it says matters now
    Worker& w = *workers_[index];
    switch (message.msg_case()) {
      case v1::WorkerMessage::kHeartbeat:
        if (phase_ == Phase::kHealing) to_send = TryRegroupLocked();  // kLossSettle may have passed
        break;
      case v1::WorkerMessage::kLoaded: {
        const v1::Loaded& l = message.loaded();
        if (w.load_pending && l.epoch() < w.epoch) break;  // the answer to an older Regroup: stale
        if (w.state != v1::WORKER_STATE_LOADING || !w.load_pending || l.epoch() != w.epoch) {
          MarkLostLocked(index, LossCause::kMalformed,
                         absl::StrCat("sent Loaded for epoch ", l.epoch(), " without an assignment to load"));
          break;
        }
        w.state = v1::WORKER_STATE_READY;
        w.load_pending = false;
        const bool regrouped = w.loaded;
        w.loaded = true;
        w.weight_bytes = l.weight_bytes();
        w.detail.clear();
        if (w.adopting && metrics_ != nullptr) metrics_->workers_adopted.Increment();
        CoordinatorLog(NameLocked(index),
                       absl::StrCat(w.adopting ? "adopted (kept its weights, joined the groups)"
                                    : regrouped ? "regrouped"
                                                : "loaded",
                                    " in ", l.load_seconds(), " s (epoch ", w.epoch, ")"),
                       LogIds{"", w.id, w.hello.node(), w.stage, w.tp_rank});
        w.adopting = false;
        const bool all_ready = std::all_of(group_->slots.begin(), group_->slots.end(), [&](const Slot& s) {
          const Worker& h = *workers_[s.worker];
          return h.state == v1::WORKER_STATE_READY && h.epoch == group_->epoch;
        });
        if (phase_ == Phase::kLoading && all_ready) {
          SetPhaseLocked(Phase::kServing);
          CoordinatorLog("group", "every worker is loaded: SERVING");
        } else if (phase_ == Phase::kHealing && all_ready && !needs_new_epoch_) {
          const double seconds = absl::ToDoubleSeconds(absl::Now() - heal_started_);
          SetPhaseLocked(Phase::kServing);
          if (metrics_ != nullptr) {
            metrics_->heals.Increment();
            metrics_->heal_duration.Observe(seconds);
          }
          CoordinatorLog("group", absl::StrFormat("healed in %.2f s: every worker is ready under epoch %d: SERVING",
                                                  seconds, group_->epoch));
        } else if (phase_ == Phase::kHealing) {
          to_send = TryRegroupLocked();  // a survivor of the first load may have been the last to settle
        }
        break;
      }
      case v1::WorkerMessage::kStepResult:
        // The result itself is the step dispatcher's (WorkerPool hands results to
        // StepDispatcher::OnResult, which calls StepAnsweredLocked); here only that it answered.
        to_send = StepAnsweredLocked(index, message.step_result().step_id());
        break;
      case v1::WorkerMessage::kFailure: {
        const v1::Failure& f = message.failure();
        const std::string why = absl::StrCat("reported a failure: ", f.message().substr(0, kMaxFailureLength));
        w.last_step_answered = std::max(w.last_step_answered, f.step_id());
        if (f.epoch() < w.epoch) {
          // A failure of an older epoch's step (it was in a collective with the lost peer): the
          // group re-forms anyway. It settles the worker, though.
          if (phase_ == Phase::kHealing) to_send = TryRegroupLocked();
          break;
        }
        if (!w.loaded && w.replacement) {
          // A replacement's load failed: it cannot hold its slot, which opens again. It is let go
          // (told why: its process exits 1; a supervisor may start another).
          MarkLostLocked(index, LossCause::kFailure, why);
          v1::CoordinatorMessage bye;
          bye.mutable_shutdown()->set_reason(absl::StrCat("this worker could not load its slot's shard and is let go (",
                                                          f.message().substr(0, kMaxFailureLength), ")"));
          bye.mutable_shutdown()->set_let_go(true);
          to_send.emplace_back(index, std::move(bye));
          break;
        }
        // A worker of the group's first load (or of an adoption) whose load failed keeps its slot,
        // as a survivor whose step failed does: most often a peer died under it (a rendezvous or a
        // connection that never came); it is sent its Assignment again when the group re-forms. One
        // that fails on its own gives up the group after kMaxHealsWithoutProgress re-formings.
        if (f.step_id() == 0) w.load_pending = false;  // its load or Regroup failed
        if (w.adopting) w.hello.clear_held();  // its shard is gone: the next Assignment loads one
        w.adopting = false;
        w.failed = true;
        w.detail = why;
        CoordinatorLog(NameLocked(index), absl::StrCat("FAILED under epoch ", w.epoch, ": ", f.message()),
                       LogIds{"", w.id, w.hello.node(), w.stage, w.tp_rank, "error"});
        if (phase_ == Phase::kServing || phase_ == Phase::kLoading) {
          StartHealLocked(absl::StrCat(NameLocked(index), " ", why));
        } else if (phase_ == Phase::kHealing) {
          needs_new_epoch_ = true;
          to_send = TryRegroupLocked();
        }
        changed_.SignalAll();
        break;
      }
      case v1::WorkerMessage::kRegister:
        MarkLostLocked(index, LossCause::kMalformed, "sent a second Register");
        break;
      case v1::WorkerMessage::MSG_NOT_SET:
        break;  // a message of a newer protocol: nothing to do with it
    }
  }
  SendAll(to_send);
}

void Membership::Disconnect(int index) {
  absl::MutexLock lock(&mu_);
  Worker& w = *workers_[index];
  w.link = nullptr;
  mu_.Await(absl::Condition(+[](int* sends) { return *sends == 0; }, &w.sends_in_flight));
  if (phase_ != Phase::kShuttingDown) {
    MarkLostLocked(index, LossCause::kStreamEnded, kStreamEnded);
  }
}

bool Membership::HeardLocked(int index) {
  Worker& w = *workers_[index];
  w.last_heard = absl::Now();
  return w.state != v1::WORKER_STATE_LOST;
}

Outgoing Membership::StepAnsweredLocked(int index, uint64_t step_id) {
  Worker& w = *workers_[index];
  w.last_step_answered = std::max(w.last_step_answered, step_id);
  if (phase_ == Phase::kHealing) return TryRegroupLocked();  // a survivor may be settled now
  return {};
}

void Membership::StepSentLocked(int index, uint64_t step_id) { workers_[index]->last_step_sent = step_id; }

bool Membership::LostLocked(int index) const { return workers_[index]->state == v1::WORKER_STATE_LOST; }

std::pair<int, int> Membership::PositionLocked(int index) const {
  return {workers_[index]->stage, workers_[index]->tp_rank};
}

bool Membership::SendTo(int index, const v1::CoordinatorMessage& message) {
  Worker* w;
  WorkerLink* link;
  {
    absl::MutexLock lock(&mu_);
    w = workers_[index].get();
    link = w->link;
    if (link == nullptr) return false;
    ++w->sends_in_flight;
  }
  const bool ok = link->Send(message);
  absl::MutexLock lock(&mu_);
  --w->sends_in_flight;
  return ok;
}

void Membership::MarkLostLocked(int index, LossCause cause, const std::string& detail) {
  Worker& w = *workers_[index];
  if (w.state == v1::WORKER_STATE_LOST) return;
  w.state = v1::WORKER_STATE_LOST;
  w.cause = cause;
  w.detail = detail;
  w.lost_at = absl::Now();
  // Lost is lost: a frozen worker whose stream is still open must not write or read rendezvous
  // keys any more (its slot's next holder gets a grant of its own).
  rendezvous_grants_.Revoke(index);
  // A failed worker keeps its stream (it stays up, NOT_SERVING, for a person to inspect); any
  // other lost worker's stream is ended, which also unblocks a send stuck on it.
  if (cause != LossCause::kFailure && w.link != nullptr) w.link->Cancel();
  changed_.SignalAll();
  if (auto spare = std::find(spares_.begin(), spares_.end(), index); spare != spares_.end()) {
    spares_.erase(spare);
    CoordinatorLog(w.id, absl::StrCat("spare left: ", detail), LogIds{"", w.id, w.hello.node(), -1, -1, "warn"});
    return;
  }
  for (auto it = replacements_.begin(); it != replacements_.end(); ++it) {
    if (it->second != index) continue;
    // A replacement that leaves before the group re-forms: its slot is open again.
    replacements_.erase(it);
    CoordinatorLog(NameLocked(index), absl::StrCat("replacement left before the group re-formed: ", detail),
                   LogIds{"", w.id, w.hello.node(), w.stage, w.tp_rank, "warn"});
    return;
  }
  if (w.stage < 0) {
    // Not in a group yet: it just leaves, and another worker may take its place.
    pending_.erase(std::remove(pending_.begin(), pending_.end(), index), pending_.end());
    CoordinatorLog(w.id, absl::StrCat("left before the group was complete: ", detail),
                   LogIds{"", w.id, w.hello.node(), -1, -1, "warn"});
    // A spare of its node takes its place (the group had fewer than all its workers, so it still
    // has fewer: this never completes it).
    auto spare = std::find_if(spares_.begin(), spares_.end(),
                              [&](int i) { return workers_[i]->hello.node() == w.hello.node(); });
    if (phase_ == Phase::kWaiting && spare != spares_.end()) {
      pending_.push_back(*spare);
      CoordinatorLog(workers_[*spare]->id,
                     absl::StrCat("spare joins the forming group in place of ", w.id, " (node ", w.hello.node(),
                                  "): ", pending_.size(), " of ", options_.nodes * options_.gpus_per_node, " workers"),
                     LogIds{"", workers_[*spare]->id, w.hello.node()});
      spares_.erase(spare);
    }
    return;
  }
  if (!group_ || group_->slots[RankOf(group_->shape, w.stage, w.tp_rank)].worker != index) {
    // It held a slot once and was replaced already: nothing depends on it.
    CoordinatorLog(NameLocked(index), absl::StrCat("gone (replaced earlier): ", detail),
                   LogIds{"", w.id, w.hello.node(), w.stage, w.tp_rank});
    return;
  }
  if (metrics_ != nullptr) metrics_->SetWorkerUp(w.id, w.hello.node(), w.stage, w.tp_rank, false);
  CoordinatorLog(NameLocked(index), absl::StrCat("LOST (epoch ", group_->epoch, "): ", detail),
                 LogIds{"", w.id, w.hello.node(), w.stage, w.tp_rank, "error"});
  if (phase_ == Phase::kServing || phase_ == Phase::kLoading) {
    // Lost while the group serves, or while it first loads (or a new coordinator adopts it): the
    // same heal; survivors still loading finish their load first (TryRegroupLocked waits for them).
    StartHealLocked(absl::StrCat(NameLocked(index), " is lost: ", detail));
    UseSparesLocked();
  } else if (phase_ == Phase::kHealing) {
    needs_new_epoch_ = true;  // whoever joined the next epoch's groups must form them again
    CoordinatorLog("group", absl::StrCat("healing: slot (node ", w.hello.node(), ", stage ", w.stage, ", tp rank ",
                                         w.tp_rank, ") is open again; waiting for a worker from node ",
                                         w.hello.node()));
    UseSparesLocked();
  }
}

void Membership::StartHealLocked(const std::string& why) {
  if (heals_without_progress_ >= kMaxHealsWithoutProgress) {
    failed_reason_ = absl::StrCat("the worker group re-formed ", heals_without_progress_,
                                  " times without completing a step; giving up (restart the coordinator and the "
                                  "workers): ", why);
    SetPhaseLocked(Phase::kFailed);
    CoordinatorLog("group", failed_reason_, LogIds{"", "", "", -1, -1, "error"});
    return;
  }
  heal_started_ = absl::Now();
  needs_new_epoch_ = true;
  SetPhaseLocked(Phase::kHealing);
  std::vector<std::string> open;
  for (const Slot& s : group_->slots) {
    if (workers_[s.worker]->state == v1::WORKER_STATE_LOST) {
      open.push_back(absl::StrCat("node ", s.node, ", stage ", s.stage, ", tp rank ", s.tp_rank));
    }
  }
  CoordinatorLog("group", absl::StrCat("HEALING (epoch ", group_->epoch, "): ", why, "; requests are held",
                                       open.empty() ? "; the same workers re-form the group"
                                                    : absl::StrCat("; waiting for a worker for slot(s) ",
                                                                   absl::StrJoin(open, "; "))),
                 LogIds{"", "", "", -1, -1, "warn"});
}

absl::Status Membership::CheckFitsSlotLocked(const v1::Register& hello, const Slot& slot) const {
  return formation_.CheckFitsSlot(hello, workers_[slot.worker]->hello.device(), slot, *plan_, limits_);
}

void Membership::UseSparesLocked() {
  if (phase_ != Phase::kHealing) return;
  for (const Slot& s : group_->slots) {
    if (workers_[s.worker]->state != v1::WORKER_STATE_LOST || replacements_.count(s.rank)) continue;
    for (auto it = spares_.begin(); it != spares_.end(); ++it) {
      Worker& spare = *workers_[*it];
      if (spare.hello.node() != s.node) continue;
      if (absl::Status fits = CheckFitsSlotLocked(spare.hello, s); !fits.ok()) {
        CoordinatorLog(NameLocked(*it), absl::StrCat("spare cannot take the slot: ", fits.message()),
                       LogIds{"", spare.id, spare.hello.node(), -1, -1, "warn"});
        continue;
      }
      spare.stage = s.stage;
      spare.tp_rank = s.tp_rank;
      spare.replacement = true;
      replacements_[s.rank] = *it;
      if (metrics_ != nullptr) metrics_->worker_restarts.Increment();
      CoordinatorLog(spare.id,
                     absl::StrCat("spare takes slot (node ", s.node, ", stage ", s.stage, ", tp rank ", s.tp_rank,
                                  ") of lost ", NameLocked(s.worker), " (epoch ", group_->epoch, ")"),
                     LogIds{"", spare.id, spare.hello.node(), s.stage, s.tp_rank});
      spares_.erase(it);
      break;
    }
  }
}

int Membership::AddWorkerLocked(const v1::Register& hello, WorkerLink* link) {
  const int index = static_cast<int>(workers_.size());
  auto w = std::make_unique<Worker>();
  w->id = absl::StrCat("w", index);
  w->hello = hello;
  w->last_heard = absl::Now();
  w->link = link;
  workers_.push_back(std::move(w));
  return index;
}

bool Membership::HasOpenSlotLocked(const std::string& node) const {
  return std::any_of(group_->slots.begin(), group_->slots.end(), [&](const Slot& s) {
    return s.node == node && workers_[s.worker]->state == v1::WORKER_STATE_LOST && !replacements_.count(s.rank);
  });
}

absl::StatusOr<int> Membership::RegisterAsSpareLocked(const v1::Register& hello, WorkerLink* link) {
  const Slot* slot = nullptr;  // the first slot of its node: any of them is the one it would take
  std::vector<std::string> nodes;
  for (const Slot& s : group_->slots) {
    if (slot == nullptr && s.node == hello.node()) slot = &s;
    if (s.tp_rank == 0) nodes.push_back(s.node);
  }
  if (slot == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        phase_ == Phase::kHealing ? "the worker group is healing (" : "the worker group is already complete (",
        options_.nodes, " nodes x ", options_.gpus_per_node, " workers) and node ", hello.node(),
        " is not one of its nodes (", absl::StrJoin(nodes, ", "),
        "): a worker takes a slot of its own node (--node) when that slot's worker is lost, or waits as its spare"));
  }
  // A spare that could never take a slot of its node is of no use: refused, saying why.
  SHARDSERVE_RETURN_IF_ERROR(CheckFitsSlotLocked(hello, *slot));
  const int index = AddWorkerLocked(hello, link);
  spares_.push_back(index);
  CoordinatorLog(workers_[index]->id,
                 absl::StrCat("registered from node ", hello.node(), " (", hello.device(), ", ", hello.address(),
                              hello.has_held() ? absl::StrCat(", holding stage ", hello.held().assignment().stage(),
                                                              " tp rank ", hello.held().assignment().tp_rank(),
                                                              " of epoch ", hello.held().assignment().epoch())
                                               : "",
                              ") as a spare: ",
                              hello.spare() ? "a spare worker (--spare)"
                                            : absl::StrCat("every slot of node ", hello.node(),
                                                           " has a worker (a lost worker's slot is taken by a spare "
                                                           "or a replacement)"),
                              "; ", spares_.size(), " spare(s) idle"),
                 LogIds{"", workers_[index]->id, hello.node()});
  return index;
}

absl::StatusOr<int> Membership::RegisterSpareWhileWaitingLocked(const v1::Register& hello, WorkerLink* link) {
  // Whether it fits its node's slots is known only once the group is planned (the KV cache follows
  // the smallest worker's memory): FormGroupLocked checks it then. The kind of device is known now.
  for (int i : pending_) {
    const v1::Register& member = workers_[i]->hello;
    if ((member.device() == "cpu") != (hello.device() == "cpu")) {
      return absl::FailedPreconditionError(absl::StrCat("device ", hello.device(), " cannot be a spare of node ",
                                                        hello.node(), ": the group's workers run on ",
                                                        member.device()));
    }
  }
  const int index = AddWorkerLocked(hello, link);
  spares_.push_back(index);
  CoordinatorLog(workers_[index]->id,
                 absl::StrCat("registered from node ", hello.node(), " (", hello.device(), ", ", hello.address(),
                              ") as a spare: ",
                              hello.spare() ? "a spare worker (--spare)"
                                            : absl::StrCat("node ", hello.node(), " already has its ",
                                                           options_.gpus_per_node, " workers (--gpus-per-node)"),
                              ", the group is not complete yet; ", spares_.size(), " spare(s) idle"),
                 LogIds{"", workers_[index]->id, hello.node()});
  return index;
}

Outgoing Membership::LetGoUnfitSparesLocked() {
  Outgoing out;
  std::vector<std::string> nodes;
  for (const Slot& s : group_->slots) {
    if (s.tp_rank == 0) nodes.push_back(s.node);
  }
  for (auto it = spares_.begin(); it != spares_.end();) {
    Worker& w = *workers_[*it];
    const auto slot = std::find_if(group_->slots.begin(), group_->slots.end(),
                                   [&](const Slot& s) { return s.node == w.hello.node(); });
    absl::Status fits =
        slot == group_->slots.end()
            ? absl::FailedPreconditionError(absl::StrCat("node ", w.hello.node(), " is not one of the group's nodes (",
                                                         absl::StrJoin(nodes, ", "),
                                                         "): a spare takes a slot of its own node (--node)"))
            : CheckFitsSlotLocked(w.hello, *slot);
    if (fits.ok()) {
      ++it;
      continue;
    }
    // Refused now that the group is planned: told why (its process exits 1), then forgotten. It
    // is marked lost here, so that its stream ending says nothing more.
    w.state = v1::WORKER_STATE_LOST;
    w.detail = absl::StrCat("spare refused when the group formed: ", fits.message());
    w.lost_at = absl::Now();
    CoordinatorLog(w.id, w.detail, LogIds{"", w.id, w.hello.node(), -1, -1, "warn"});
    v1::CoordinatorMessage bye;
    bye.mutable_shutdown()->set_reason(std::string(fits.message()));
    out.emplace_back(*it, std::move(bye));
    it = spares_.erase(it);
  }
  return out;
}

absl::StatusOr<int> Membership::RegisterReplacementLocked(const v1::Register& hello, WorkerLink* link) {
  std::vector<std::string> open;
  const Slot* slot = nullptr;
  for (const Slot& s : group_->slots) {
    if (workers_[s.worker]->state != v1::WORKER_STATE_LOST || replacements_.count(s.rank)) continue;
    open.push_back(absl::StrCat("node ", s.node, " stage ", s.stage, " tp rank ", s.tp_rank));
    if (slot == nullptr && s.node == hello.node()) slot = &s;
  }
  if (slot == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the worker group is healing and has no open slot on node ", hello.node(),
        open.empty() ? std::string("; every slot has a worker")
                     : absl::StrCat("; open slots: ", absl::StrJoin(open, ", "), " (a replacement uses its --node)")));
  }
  SHARDSERVE_RETURN_IF_ERROR(CheckFitsSlotLocked(hello, *slot));
  const std::string where = absl::StrCat("slot (node ", slot->node, ", stage ", slot->stage, ", tp rank ",
                                         slot->tp_rank, ")");
  const int index = AddWorkerLocked(hello, link);
  workers_[index]->stage = slot->stage;
  workers_[index]->tp_rank = slot->tp_rank;
  workers_[index]->replacement = true;
  replacements_[slot->rank] = index;
  if (metrics_ != nullptr) metrics_->worker_restarts.Increment();
  CoordinatorLog(workers_[index]->id,
                 absl::StrCat("registered from node ", hello.node(), " (", hello.device(), ", ", hello.address(),
                              ") as the replacement for ", where, " of lost ", NameLocked(slot->worker), " (epoch ",
                              group_->epoch, ")"),
                 LogIds{"", workers_[index]->id, hello.node(), slot->stage, slot->tp_rank});
  return index;
}

Outgoing Membership::TryRegroupLocked() {
  Outgoing out;
  if (phase_ != Phase::kHealing || !needs_new_epoch_) return out;
  // With no one to replace (a step failed, no worker lost yet), wait a moment: the failure was
  // most likely caused by a peer whose loss the coordinator has not seen yet (a killed worker's
  // peers report the broken connection at about the time its stream ends).
  if (replacements_.empty() && absl::Now() - heal_started_ < kLossSettle) return out;
  for (const Slot& s : group_->slots) {
    auto r = replacements_.find(s.rank);
    const Worker& h = *workers_[r != replacements_.end() ? r->second : s.worker];
    if (h.state == v1::WORKER_STATE_LOST || h.link == nullptr) return out;  // the slot is open
    // A survivor still in a step of the old epoch (bounded by the collective timeout), or in a
    // load or regroup not answered: the new groups would wait for it.
    if (r == replacements_.end() && (h.last_step_answered < h.last_step_sent || h.load_pending)) return out;
  }
  if (heals_without_progress_ >= kMaxHealsWithoutProgress) {
    failed_reason_ = absl::StrCat("the worker group re-formed ", heals_without_progress_,
                                  " times without completing a step; giving up (restart the coordinator and the "
                                  "workers)");
    SetPhaseLocked(Phase::kFailed);
    CoordinatorLog("group", failed_reason_, LogIds{"", "", "", -1, -1, "error"});
    return out;
  }
  Group next = *group_;
  std::vector<std::string> replaced;
  for (const auto& [rank, index] : replacements_) {
    const Slot& s = next.slots[rank];
    absl::StatusOr<Group> g = Replace(next, s.stage, s.tp_rank, Member{index, workers_[index]->hello.node()});
    if (!g.ok()) {
      // Register checked the node: this is a bug, not the replacement's fault.
      CoordinatorLog("group", absl::StrCat("cannot place ", workers_[index]->id, ": ", g.status().message()),
                     LogIds{"", "", "", -1, -1, "error"});
      return out;
    }
    replaced.push_back(absl::StrCat(workers_[index]->id, " for ", workers_[s.worker]->id));
    next = std::move(*g);
  }
  if (replacements_.empty()) next = NextEpoch(next);
  const uint64_t old_epoch = group_->epoch;
  group_ = std::move(next);
  replacements_.clear();
  needs_new_epoch_ = false;
  ++heals_without_progress_;
  for (const Slot& s : group_->slots) {
    Worker& w = *workers_[s.worker];
    if (!w.loaded) {
      out.emplace_back(s.worker, AssignmentLocked(s));
    } else {
      w.state = v1::WORKER_STATE_LOADING;
      w.epoch = group_->epoch;
      w.failed = false;
      v1::CoordinatorMessage m;
      v1::Regroup* r = m.mutable_regroup();
      r->set_epoch(group_->epoch);
      r->set_tp_group(s.tp_group);
      r->set_send_group(s.send_group);
      r->set_recv_group(s.recv_group);
      r->set_rendezvous_token(rendezvous_grants_.Grant(s.worker, w.id, group_->epoch, RendezvousGroupsOf(s)));
      out.emplace_back(s.worker, std::move(m));
    }
    workers_[s.worker]->load_pending = true;
  }
  CoordinatorLog("group", absl::StrCat("re-forming: epoch ", old_epoch, " -> ", group_->epoch, "; ",
                                       replaced.empty() ? "the same workers" : absl::StrJoin(replaced, ", "),
                                       "; survivors keep their weights and join the new groups"));
  return out;
}

std::optional<absl::Time> Membership::HealingSince() {
  absl::MutexLock lock(&mu_);
  if (phase_ != Phase::kHealing) return std::nullopt;
  return heal_started_;
}

std::string Membership::StateName() {
  absl::MutexLock lock(&mu_);
  return StateNameLocked();
}

std::string Membership::StateNameLocked() const {
  switch (phase_) {
    case Phase::kServing: return "serving";
    case Phase::kHealing: return "healing";
    case Phase::kWaiting:
    case Phase::kLoading: return "starting";
    default: return "degraded";
  }
}

uint64_t Membership::epoch() {
  absl::MutexLock lock(&mu_);
  return group_ ? group_->epoch : 0;
}

void Membership::SetPhaseLocked(Phase phase) {
  const bool was_serving = phase_ == Phase::kServing;
  phase_ = phase;
  changed_.SignalAll();
  if (metrics_ != nullptr) metrics_->SetClusterState(StateNameLocked());
  if (was_serving != (phase == Phase::kServing) && listener_) listener_(phase == Phase::kServing);
}

std::string Membership::NameLocked(int index) const {
  const Worker& w = *workers_[index];
  if (w.stage < 0) return absl::StrCat("worker ", w.id, " (node ", w.hello.node(), ")");
  return absl::StrCat("worker ", w.id, " (node ", w.hello.node(), ", stage ", w.stage, ", tp rank ", w.tp_rank, ")");
}

absl::Status Membership::NotServingLocked() const {
  const int expected = options_.nodes * options_.gpus_per_node;
  switch (phase_) {
    case Phase::kServing:
      return absl::OkStatus();
    case Phase::kWaiting:
      return absl::UnavailableError(absl::StrCat("the worker group is not complete: ", pending_.size(), " of ",
                                                 expected, " workers have registered (", options_.nodes,
                                                 " nodes x ", options_.gpus_per_node, " workers)"));
    case Phase::kLoading: {
      const auto ready = std::count_if(group_->slots.begin(), group_->slots.end(), [&](const Slot& s) {
        return workers_[s.worker]->state == v1::WORKER_STATE_READY;
      });
      return absl::UnavailableError(
          absl::StrCat("the workers are loading the model: ", ready, " of ", expected, " loaded"));
    }
    case Phase::kHealing: {
      // The lost workers first (the likely cause, in the order of LossCause), then the failed ones.
      std::vector<int> lost, failed;
      for (const Slot& s : group_->slots) {
        const Worker& w = *workers_[s.worker];
        if (w.state == v1::WORKER_STATE_LOST) {
          lost.push_back(s.worker);
        } else if (w.failed) {
          failed.push_back(s.worker);
        }
      }
      std::sort(lost.begin(), lost.end(), [&](int a, int b) {
        return std::tuple(workers_[a]->cause, workers_[a]->lost_at) < std::tuple(workers_[b]->cause, workers_[b]->lost_at);
      });
      std::string message = absl::StrFormat("the worker group is healing (for %.1f s, epoch %d): ",
                                            absl::ToDoubleSeconds(absl::Now() - heal_started_), group_->epoch);
      for (size_t k = 0; k < lost.size(); ++k) {
        const Worker& w = *workers_[lost[k]];
        const int rank = RankOf(group_->shape, w.stage, w.tp_rank);
        absl::StrAppend(&message, k == 0 ? "" : "; ", NameLocked(lost[k]), " is lost: ", w.detail,
                        replacements_.count(rank) ? absl::StrCat("; its replacement ", workers_[replacements_.at(rank)]->id,
                                                                 " has registered")
                                                  : absl::StrCat("; its slot (node ", w.hello.node(), ", stage ",
                                                                 w.stage, ", tp rank ", w.tp_rank,
                                                                 ") waits for a worker from node ", w.hello.node()));
      }
      for (size_t k = 0; k < failed.size(); ++k) {
        absl::StrAppend(&message, lost.empty() && k == 0 ? "" : "; ", NameLocked(failed[k]), " ",
                        workers_[failed[k]]->detail);
      }
      if (lost.empty() && failed.empty()) {
        const auto ready = std::count_if(group_->slots.begin(), group_->slots.end(), [&](const Slot& s) {
          return workers_[s.worker]->state == v1::WORKER_STATE_READY;
        });
        absl::StrAppend(&message, "re-forming under epoch ", group_->epoch, ": ", ready, " of ", expected,
                        " workers ready");
      }
      return absl::UnavailableError(message);
    }
    case Phase::kFailed:
    case Phase::kShuttingDown:
      return absl::UnavailableError(failed_reason_);
  }
  return absl::InternalError("unknown phase");
}

absl::Status Membership::CheckServing() {
  absl::MutexLock lock(&mu_);
  return NotServingLocked();
}

// ---- Sizes, metrics, shutdown (status: cluster_status.cc; heartbeats: heartbeat_monitor.cc) ------

int64_t Membership::max_model_len() {
  absl::MutexLock lock(&mu_);
  return plan_ ? plan_->max_model_len : formation_.target_max_model_len();
}

StepLimits Membership::limits() {
  absl::MutexLock lock(&mu_);
  return limits_;
}

void Membership::SetMetrics(CoordinatorMetrics* metrics) {
  absl::MutexLock lock(&mu_);
  metrics_ = metrics;
  if (metrics_ != nullptr) metrics_->SetClusterState(StateNameLocked());
}

void Membership::Shutdown(const std::string& reason) {
  std::vector<int> connected;
  {
    absl::MutexLock lock(&mu_);
    if (phase_ == Phase::kShuttingDown) return;
    failed_reason_ = reason;
    SetPhaseLocked(Phase::kShuttingDown);
    for (size_t i = 0; i < workers_.size(); ++i) {
      if (workers_[i]->link != nullptr) connected.push_back(static_cast<int>(i));
    }
  }
  v1::CoordinatorMessage message;
  message.mutable_shutdown()->set_reason(reason);
  for (int i : connected) SendTo(i, message);
  absl::MutexLock lock(&mu_);
  for (int i : connected) {
    if (workers_[i]->link != nullptr) workers_[i]->link->Cancel();
  }
  CoordinatorLog("group", absl::StrCat("shut down (", connected.size(), " workers told to stop): ", reason));
}

}  // namespace shardserve