#include "worker/control_dispatch.h"

namespace shardserve {

ControlAction NextControlAction(const ControlState& state, const v1::CoordinatorMessage& m) {
  switch (m.msg_case()) {
    case v1::CoordinatorMessage::kAssignment:
      if (state.assigned_this_stream && m.assignment().epoch() <= state.epoch) return ControlAction::kSecondAssignment;
      if (!m.assignment().adopt()) return ControlAction::kLoad;
      return state.holds_shard ? ControlAction::kAdopt : ControlAction::kAdoptWithoutShard;
    case v1::CoordinatorMessage::kStep:
      return state.failed || !state.holds_shard ? ControlAction::kRefuseStep : ControlAction::kStep;
    case v1::CoordinatorMessage::kRegroup:
      return state.holds_shard ? ControlAction::kRegroup : ControlAction::kRegroupWithoutShard;
    case v1::CoordinatorMessage::kShutdown:
      if (!state.assigned_this_stream) return ControlAction::kRefused;
      return m.shutdown().let_go() ? ControlAction::kLetGo : ControlAction::kShutdown;
    case v1::CoordinatorMessage::MSG_NOT_SET:
      break;
  }
  return ControlAction::kIgnore;
}

}  // namespace shardserve
