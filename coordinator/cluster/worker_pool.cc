#include "coordinator/cluster/worker_pool.h"

#include <utility>

namespace shardserve {

absl::StatusOr<std::unique_ptr<WorkerPool>> WorkerPool::Create(const ServedModel* model, const PoolOptions& options) {
  absl::StatusOr<GroupFormation> formation = GroupFormation::Create(model, options);
  if (!formation.ok()) return formation.status();
  return std::unique_ptr<WorkerPool>(new WorkerPool(std::move(*formation)));
}

WorkerPool::WorkerPool(GroupFormation formation) : membership_(std::move(formation)), steps_(&membership_) {}

void WorkerPool::OnMessage(int worker, const v1::WorkerMessage& message) {
  if (message.has_step_result()) {
    steps_.OnResult(worker, message.step_result());
  } else {
    membership_.OnMessage(worker, message);
  }
}

}  // namespace shardserve
