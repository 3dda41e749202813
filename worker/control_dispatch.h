// What a worker does with each message the coordinator sends on its control stream
// (WorkerService::Serve, worker/worker_service.h), as a pure function of where the worker stands,
// so that fuzz/coordinator_message_fuzzer.cc runs the worker's own dispatch, not a copy of it.
#ifndef SHARDSERVE_WORKER_CONTROL_DISPATCH_H_
#define SHARDSERVE_WORKER_CONTROL_DISPATCH_H_

#include <cstdint>

#include "shardserve/v1/worker.pb.h"

namespace shardserve {

// Where a worker stands when a message arrives.
struct ControlState {
  bool assigned_this_stream = false;  // this control stream brought an Assignment
  bool holds_shard = false;           // a loaded shard (its StepExecutor)
  bool failed = false;                // a failure that no load, adoption or regroup has cleared since
  uint64_t epoch = 0;                 // the shard's epoch; without one, the last assignment's
};

enum class ControlAction {
  kLoad,                  // an Assignment: load its shard, dropping the one held
  kAdopt,                 // an Assignment with adopt: keep the shard held, join the new groups
  kAdoptWithoutShard,     // ... but no shard is held: a failure
  kSecondAssignment,      // an Assignment on a stream that had one, not of a later epoch: a failure
  kStep,                  // a StepPlan: execute it
  kRefuseStep,            // a StepPlan before a shard is held or after a failure: answer the failure
  kRegroup,               // a Regroup: re-form the groups under its epoch, keeping the weights
  kRegroupWithoutShard,   // ... but no shard is held: a failure
  kShutdown,              // a Shutdown: the coordinator stops, Run() returns OK
  kRefused,               // a Shutdown before any Assignment on this stream: the coordinator refused this worker
  kLetGo,                 // a Shutdown with let_go: a replacement whose load failed is let go
  kIgnore,                // an empty message (from a newer protocol)
};

// The action for `message` given `state`. A second Assignment on one stream is taken only under a
// later epoch: after this worker's load failed, the re-formed group gives it its slot again
// (docs/healing.md).
ControlAction NextControlAction(const ControlState& state, const v1::CoordinatorMessage& message);

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_CONTROL_DISPATCH_H_
