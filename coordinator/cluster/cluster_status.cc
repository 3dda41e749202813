// Membership::FillStatus: the group as `shardserve status` shows it (inference.proto ClusterStatus).
#include "coordinator/cluster/membership.h"

#include <vector>

#include "absl/strings/str_cat.h"

#include "coordinator/planner/render.h"

namespace shardserve {

void Membership::FillStatus(v1::ClusterStatus* status) {
  absl::MutexLock lock(&mu_);
  status->set_tp(options_.gpus_per_node);
  status->set_pp(options_.nodes);
  if (plan_) status->set_plan_text(PlanTable(*plan_));
  std::vector<int> shown = pending_;  // before the group is formed: the registered workers
  if (group_) {
    // The slots' workers (a lost one while its slot is open), then replacements not yet placed.
    shown.clear();
    for (const Slot& slot : group_->slots) shown.push_back(slot.worker);
    for (const auto& [rank, index] : replacements_) shown.push_back(index);
  }
  const size_t first_spare = shown.size();
  shown.insert(shown.end(), spares_.begin(), spares_.end());  // idle spares: stage -1
  for (size_t k = 0; k < shown.size(); ++k) {
    const int i = shown[k];
    const Worker& w = *workers_[i];
    v1::WorkerStatus* s = status->add_workers();
    s->set_worker_id(w.id);
    s->set_node(w.hello.node());
    s->set_device(w.hello.device());
    s->set_address(w.hello.address());
    s->set_metrics_address(w.hello.metrics_address());
    s->set_stage(w.stage);
    s->set_tp_rank(w.tp_rank);
    if (w.stage >= 0) {
      s->set_first_layer(static_cast<int32_t>(w.first_layer));
      s->set_last_layer(static_cast<int32_t>(w.end_layer - 1));
    }
    s->set_state(w.state);
    s->set_weight_bytes(w.weight_bytes);
    s->set_detail(k >= first_spare ? absl::StrCat("spare: takes the next lost slot of node ", w.hello.node())
                                   : w.detail);
  }
  status->set_serving(phase_ == Phase::kServing);
  status->set_state(StateNameLocked());
  status->set_epoch(group_ ? group_->epoch : 0);
}

}  // namespace shardserve
