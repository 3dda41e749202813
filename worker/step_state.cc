#include "worker/step_state.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "worker/step_checks.h"

namespace shardserve {

absl::Status CheckLoadable(const v1::Assignment& a, const ModelConfig& config) {
  SHARDSERVE_RETURN_IF_ERROR(CheckAssignment(a));
  SHARDSERVE_RETURN_IF_ERROR(CheckShard(config, ShardSpecOf(a), FromProto(a.limits())));
  return CheckStageLayers(a, config);
}

StepState::StepState(const v1::Assignment& a, int64_t vocab_size)
    : vocab_size_(vocab_size),
      epoch_(a.epoch()),
      one_stage_(a.num_stages() == 1),
      state_(FromProto(a.limits()), vocab_size, a.stage() + 1 == a.num_stages() && a.tp_rank() == 0,
             a.num_stages() == 1) {
  state_.Reserve(&batch_);
}

absl::Status StepState::Prepare(const v1::StepPlan& plan) {
  if (plan.epoch() != epoch_) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", plan.step_id(), " is of epoch ", plan.epoch(), "; this worker's group is epoch ", epoch_));
  }
  if (plan.share_samples() && (!one_stage_ || plan.num_draft_tokens() > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step ", plan.step_id(), " shares its samples with the TP group; ",
        one_stage_ ? absl::StrCat("it asks for ", plan.num_draft_tokens(), " draft tokens a row, whose rows sample more")
                   : "this worker's group has more than one stage, whose first stage does not sample"));
  }
  SHARDSERVE_RETURN_IF_ERROR(state_.Apply(plan, &batch_, &sampling_));
  // Every worker checks the sampling parameters, not only the one that samples: the plan is the
  // same everywhere, so all fail here together instead of leaving peers waiting in a collective.
  // (The penalty ids, kept only where the sampler is, are fed token ids the persistent batch
  // checked on every worker alike.)
  return CheckRowSampling(plan.step_id(), sampling_, vocab_size_);
}

absl::Status StepState::Regroup(const v1::Assignment& held, const v1::Regroup& r) {
  SHARDSERVE_RETURN_IF_ERROR(CheckRegroup(held, epoch_, r));
  state_.Clear();
  epoch_ = r.epoch();
  return absl::OkStatus();
}

absl::Status StepState::Adopt(const v1::Assignment& held, const v1::Assignment& wanted) {
  SHARDSERVE_RETURN_IF_ERROR(CheckAdopt(held, epoch_, wanted));
  return Regroup(wanted, RegroupOf(wanted));
}

}  // namespace shardserve
