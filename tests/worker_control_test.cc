// worker/control_dispatch.h and worker/step_state.h: what a worker does with each coordinator
// message given where it stands, and the epoch and running batch it keeps between steps (what
// WorkerService and StepExecutor run, and fuzz/coordinator_message_fuzzer.cc with them).
#include <gtest/gtest.h>

#include <string>

#include "model/config.h"
#include "model/step_limits.h"
#include "shardserve/v1/worker.pb.h"
#include "worker/control_dispatch.h"
#include "worker/step_state.h"

namespace shardserve {
namespace {

// The demo model's one stage, TP 1, epoch 3.
v1::Assignment Assigned() {
  v1::Assignment a;
  a.set_worker_id("w0");
  a.set_model_path("models/demo");
  a.set_num_stages(1);
  a.set_tp_size(1);
  a.set_end_layer(4);
  a.set_collective_timeout_seconds(60);
  ToProto(StepLimits{.max_tokens_per_step = 64, .max_seqs_per_step = 4, .block_size = 16, .num_kv_blocks = 8,
                     .max_model_len = 64},
          a.mutable_limits());
  a.set_epoch(3);
  return a;
}

v1::CoordinatorMessage Assignment(uint64_t epoch, bool adopt) {
  v1::CoordinatorMessage m;
  *m.mutable_assignment() = Assigned();
  m.mutable_assignment()->set_epoch(epoch);
  m.mutable_assignment()->set_adopt(adopt);
  return m;
}

// A step of epoch `epoch` feeding a new sequence 4 prompt tokens, sampled.
v1::StepPlan Prefill(uint64_t epoch) {
  v1::StepPlan p;
  p.set_step_id(1);
  p.set_epoch(epoch);
  p.add_row_seq_ids(7);
  p.add_row_start_positions(0);
  p.add_row_num_tokens(4);
  p.add_row_samples(true);
  for (int32_t id : {1, 2, 3, 4}) p.add_token_ids(id);
  v1::NewSeq* s = p.add_new_seqs();
  s->set_seq_id(7);
  s->add_block_ids(0);
  s->set_prompt_len(4);
  return p;
}

TEST(ControlDispatchTest, EachMessageByWhereTheWorkerStands) {
  const ControlState fresh;
  const ControlState serving{.assigned_this_stream = true, .holds_shard = true, .failed = false, .epoch = 3};
  ControlState failed = serving;
  failed.failed = true;
  ControlState rejoined = serving;  // a shard held from an earlier stream
  rejoined.assigned_this_stream = false;

  EXPECT_EQ(NextControlAction(fresh, Assignment(1, false)), ControlAction::kLoad);
  EXPECT_EQ(NextControlAction(fresh, Assignment(1, true)), ControlAction::kAdoptWithoutShard);
  EXPECT_EQ(NextControlAction(rejoined, Assignment(4, true)), ControlAction::kAdopt);
  EXPECT_EQ(NextControlAction(rejoined, Assignment(1, false)), ControlAction::kLoad);
  // A second assignment on one stream only under a later epoch.
  EXPECT_EQ(NextControlAction(serving, Assignment(3, false)), ControlAction::kSecondAssignment);
  EXPECT_EQ(NextControlAction(serving, Assignment(3, true)), ControlAction::kSecondAssignment);
  EXPECT_EQ(NextControlAction(failed, Assignment(4, false)), ControlAction::kLoad);

  v1::CoordinatorMessage step;
  *step.mutable_step() = Prefill(3);
  EXPECT_EQ(NextControlAction(serving, step), ControlAction::kStep);
  EXPECT_EQ(NextControlAction(failed, step), ControlAction::kRefuseStep);
  EXPECT_EQ(NextControlAction(fresh, step), ControlAction::kRefuseStep);

  v1::CoordinatorMessage regroup;
  regroup.mutable_regroup()->set_epoch(4);
  EXPECT_EQ(NextControlAction(failed, regroup), ControlAction::kRegroup);
  EXPECT_EQ(NextControlAction(fresh, regroup), ControlAction::kRegroupWithoutShard);

  v1::CoordinatorMessage shutdown;
  shutdown.mutable_shutdown()->set_reason("stop");
  EXPECT_EQ(NextControlAction(fresh, shutdown), ControlAction::kRefused);
  EXPECT_EQ(NextControlAction(rejoined, shutdown), ControlAction::kRefused);
  EXPECT_EQ(NextControlAction(serving, shutdown), ControlAction::kShutdown);
  shutdown.mutable_shutdown()->set_let_go(true);
  EXPECT_EQ(NextControlAction(serving, shutdown), ControlAction::kLetGo);

  EXPECT_EQ(NextControlAction(serving, v1::CoordinatorMessage()), ControlAction::kIgnore);
}

TEST(StepStateTest, StepsOfTheGroupsEpochOnlyAndRegroupDropsTheBatch) {
  absl::StatusOr<ModelConfig> config = LoadModelConfig(std::string(SHARDSERVE_SOURCE_DIR) + "/models/demo");
  ASSERT_TRUE(config.ok()) << config.status();
  const v1::Assignment a = Assigned();
  ASSERT_TRUE(CheckLoadable(a, *config).ok()) << CheckLoadable(a, *config);
  StepState steps(a, config->vocab_size);
  EXPECT_EQ(steps.epoch(), 3u);

  const absl::Status other = steps.Prepare(Prefill(2));
  EXPECT_TRUE(absl::IsFailedPrecondition(other)) << other;
  EXPECT_NE(other.message().find("is of epoch 2; this worker's group is epoch 3"), std::string::npos) << other;

  ASSERT_TRUE(steps.Prepare(Prefill(3)).ok()) << steps.Prepare(Prefill(3));
  EXPECT_EQ(steps.batch().positions.size(), 4u);
  EXPECT_EQ(steps.sampling().size(), 1);
  // The sequence is running now: a second prefill of it is refused.
  v1::StepPlan again = Prefill(3);
  again.set_step_id(2);
  EXPECT_TRUE(absl::IsInvalidArgument(steps.Prepare(again)));

  // A regroup to an older epoch is refused; to a later one drops the batch, so the same
  // sequence may start again under the new epoch.
  v1::Regroup r;
  r.set_epoch(2);
  EXPECT_FALSE(steps.Regroup(a, r).ok());
  r.set_epoch(4);
  ASSERT_TRUE(steps.Regroup(a, r).ok()) << steps.Regroup(a, r);
  EXPECT_EQ(steps.epoch(), 4u);
  EXPECT_TRUE(steps.Prepare(Prefill(4)).ok()) << steps.Prepare(Prefill(4));

  // An adoption of another shard is FailedPrecondition; of this one, under a later epoch, OK.
  v1::Assignment other_shard = a;
  other_shard.set_end_layer(2);
  other_shard.set_num_stages(2);
  other_shard.set_epoch(5);
  other_shard.set_adopt(true);
  EXPECT_TRUE(absl::IsFailedPrecondition(steps.Adopt(a, other_shard))) << steps.Adopt(a, other_shard);
  v1::Assignment same = a;
  same.set_worker_id("w9");
  same.set_epoch(5);
  same.set_adopt(true);
  ASSERT_TRUE(steps.Adopt(a, same).ok()) << steps.Adopt(a, same);
  EXPECT_EQ(steps.epoch(), 5u);
}

// Asynchronous scheduling in a TP group of one stage: every rank feeds the samples a share_samples
// step gave it (StepExecutor::ShareSamples all-reduces TP rank 0's ids), and takes such a step only
// where the group is one stage and no row samples draft tokens.
TEST(StepStateTest, SharedSamplesFeedTheRowsOfAOneStageTpGroup) {
  v1::Assignment rank1 = Assigned();
  rank1.set_tp_size(2);
  rank1.set_tp_rank(1);
  v1::StepPlan prefill = Prefill(3);
  prefill.set_share_samples(true);
  v1::StepPlan decode;  // seq 7's next position, fed its last sample
  decode.set_step_id(2);
  decode.set_epoch(3);
  decode.add_row_seq_ids(7);
  decode.add_row_start_positions(4);
  decode.add_row_num_tokens(1);
  decode.add_row_samples(true);
  decode.add_row_feeds_sample(true);
  decode.add_token_ids(0);

  StepState steps(rank1, 1000);
  ASSERT_TRUE(steps.Prepare(prefill).ok()) << steps.Prepare(prefill);
  google::protobuf::RepeatedField<int32_t> shared;
  shared.Add(42);
  steps.RecordSamples(shared);
  ASSERT_TRUE(steps.Prepare(decode).ok()) << steps.Prepare(decode);
  ASSERT_EQ(steps.batch().token_ids.size(), 1u);
  EXPECT_EQ(steps.batch().token_ids[0], 42);

  // A rank that was given no sample refuses the row, by name.
  StepState unshared(rank1, 1000);
  ASSERT_TRUE(unshared.Prepare(prefill).ok());
  const absl::Status none = unshared.Prepare(decode);
  EXPECT_TRUE(absl::IsInvalidArgument(none)) << none;
  EXPECT_NE(none.message().find("this worker holds none for it"), std::string::npos) << none;

  // Two stages: the first does not sample, so no step shares samples there (nor feeds them).
  v1::Assignment two_stages = rank1;
  two_stages.set_num_stages(2);
  two_stages.set_end_layer(2);
  StepState staged(two_stages, 1000);
  const absl::Status refused = staged.Prepare(prefill);
  EXPECT_TRUE(absl::IsInvalidArgument(refused)) << refused;
  EXPECT_NE(refused.message().find("shares its samples with the TP group; this worker's group has more than one stage"),
            std::string::npos)
      << refused;
  StepState staged_feed(two_stages, 1000);
  ASSERT_TRUE(staged_feed.Prepare(Prefill(3)).ok());
  const absl::Status fed = staged_feed.Prepare(decode);
  EXPECT_NE(fed.message().find("only the workers of a group of one stage"), std::string::npos) << fed;

  // Draft tokens: a row samples more than one id.
  v1::StepPlan drafts = prefill;
  drafts.set_num_draft_tokens(2);
  StepState drafted(rank1, 1000);
  const absl::Status with_drafts = drafted.Prepare(drafts);
  EXPECT_TRUE(absl::IsInvalidArgument(with_drafts)) << with_drafts;
  EXPECT_NE(with_drafts.message().find("it asks for 2 draft tokens a row"), std::string::npos) << with_drafts;
}

}  // namespace
}  // namespace shardserve
