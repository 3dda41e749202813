// worker/step_checks.h: what a worker checks in its coordinator's messages, on the demo model's
// config.json (4 layers, 6 heads, 2 KV heads, vocabulary 4096). Each check is shown refusing the
// input it exists for, naming it, and accepting the valid one next to it.
#include "worker/step_checks.h"

#include <gtest/gtest.h>

#include <string>

#include "absl/strings/match.h"
#include "model/config.h"
#include "model/step_limits.h"
#include "shardserve/v1/worker.pb.h"

namespace shardserve {
namespace {

ModelConfig Demo() {
  absl::StatusOr<ModelConfig> c = LoadModelConfig(std::string(SHARDSERVE_SOURCE_DIR) + "/models/demo");
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

StepLimits Limits() {
  return StepLimits{.max_tokens_per_step = 64, .max_seqs_per_step = 4, .block_size = 16, .num_kv_blocks = 8,
                    .max_model_len = 64};
}

// Stage `stage` of 2 (two layers each), TP rank 0 of 2, epoch 3.
v1::Assignment Assigned(int stage) {
  v1::Assignment a;
  a.set_model_path("models/demo");
  a.set_stage(stage);
  a.set_num_stages(2);
  a.set_tp_rank(0);
  a.set_tp_size(2);
  a.set_first_layer(2 * stage);
  a.set_end_layer(2 * stage + 2);
  a.set_tp_group("e3/tp/stage" + std::to_string(stage));
  if (stage == 0) a.set_send_group("e3/pp/tp0/stage0-1");
  if (stage == 1) a.set_recv_group("e3/pp/tp0/stage0-1");
  a.set_collective_timeout_seconds(60);
  ToProto(Limits(), a.mutable_limits());
  a.set_epoch(3);
  return a;
}

void ExpectRefused(const absl::Status& s, const std::string& names) {
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find(names), std::string::npos) << s.message();
}

TEST(StepChecksTest, AssignmentAgainstTheModel) {
  const ModelConfig config = Demo();
  for (int stage : {0, 1}) {
    const v1::Assignment a = Assigned(stage);
    EXPECT_TRUE(CheckAssignment(a).ok());
    EXPECT_TRUE(CheckShard(config, ShardSpecOf(a), Limits()).ok());
    EXPECT_TRUE(CheckStageLayers(a, config).ok());
  }
  v1::Assignment a = Assigned(1);
  a.set_collective_timeout_seconds(0);
  ExpectRefused(CheckAssignment(a), "collective_timeout_seconds");
  a = Assigned(1);
  a.clear_recv_group();
  ExpectRefused(CheckAssignment(a), "recv_group");

  a = Assigned(1);
  a.set_end_layer(5);  // the model has 4
  ExpectRefused(CheckShard(config, ShardSpecOf(a), Limits()), "layer range [2, 5)");
  a.set_end_layer(-1);  // through the last layer
  EXPECT_TRUE(CheckShard(config, ShardSpecOf(a), Limits()).ok());
  EXPECT_TRUE(CheckStageLayers(a, config).ok());
  a.set_tp_size(4);  // 2 KV heads do not split 4 ways
  a.set_tp_rank(3);
  EXPECT_FALSE(CheckShard(config, ShardSpecOf(a), Limits()).ok());

  StepLimits sliding = Limits();
  sliding.num_sliding_kv_blocks = 8;
  ExpectRefused(CheckShard(config, ShardSpecOf(Assigned(0)), sliding),
                "num_sliding_kv_blocks 8 for a model with 4 layers of which none slides beside a full-attention "
                "one: it has no sliding layers' pool (0)");
  ModelConfig every_layer_slides = config;
  every_layer_slides.layer_window = {8, 8, 8, 8};
  ExpectRefused(CheckShard(every_layer_slides, ShardSpecOf(Assigned(0)), sliding), "num_sliding_kv_blocks 8");
  ModelConfig mixed = config;  // Gemma 3's pattern: full attention in the last layer
  mixed.layer_window = {8, 8, 8, 0};
  EXPECT_TRUE(CheckShard(mixed, ShardSpecOf(Assigned(0)), sliding).ok());

  a = Assigned(0);
  a.set_end_layer(4);  // stage 0 of 2 holding the last layer: the LM head on the wrong stage
  ExpectRefused(CheckStageLayers(a, config), "does not match layers [0, 4)");
  a = Assigned(1);
  a.set_first_layer(0);  // stage 1 holding the embedding
  ExpectRefused(CheckStageLayers(a, config), "stage 1 of 2");
}

TEST(StepChecksTest, RegroupAndAdopt) {
  const v1::Assignment held = Assigned(1);
  v1::Regroup r;
  r.set_epoch(4);
  r.set_tp_group("e4/tp/stage1");
  r.set_recv_group("e4/pp/tp0/stage0-1");
  EXPECT_TRUE(CheckRegroup(held, 3, r).ok());
  ExpectRefused(CheckRegroup(held, 4, r), "epoch 4 is not after the current 4");
  r.clear_recv_group();
  ExpectRefused(CheckRegroup(held, 3, r), "recv_group");

  v1::Assignment wanted = Assigned(1);
  wanted.set_epoch(5);
  wanted.set_worker_id("another id");
  wanted.set_tp_group("e5/tp/stage1");
  wanted.set_recv_group("e5/pp/tp0/stage0-1");
  EXPECT_TRUE(CheckAdopt(held, 3, wanted).ok());
  EXPECT_EQ(RegroupOf(wanted).recv_group(), "e5/pp/tp0/stage0-1");
  ExpectRefused(CheckAdopt(held, 5, wanted), "adopt: epoch 5");
  wanted.set_expert_parallel(true);  // the same layers, but whole experts: another shard
  EXPECT_TRUE(absl::IsFailedPrecondition(CheckAdopt(held, 3, wanted)));
  wanted.set_expert_parallel(false);
  EXPECT_TRUE(CheckAdopt(held, 3, wanted).ok());
  wanted.set_end_layer(3);  // another shard
  EXPECT_TRUE(absl::IsFailedPrecondition(CheckAdopt(held, 3, wanted)));
}

TEST(StepChecksTest, TokenMasks) {
  constexpr int64_t kVocab = 40;  // two words per mask; ids 32..39 in the second
  std::vector<const uint32_t*> masks;
  v1::StepPlan plan;
  plan.set_step_id(5);
  // No masks: every row unmasked.
  ASSERT_TRUE(CheckTokenMasks(plan, 3, kVocab, &masks).ok());
  EXPECT_EQ(masks, std::vector<const uint32_t*>(3, nullptr));
  // Rows 0 and 2 masked.
  plan.add_mask_logit_rows(0);
  plan.add_mask_logit_rows(2);
  for (uint32_t w : {1u, 0u, 0u, 0x80u}) plan.add_mask_words(w);
  ASSERT_TRUE(CheckTokenMasks(plan, 3, kVocab, &masks).ok());
  ASSERT_EQ(masks.size(), 3u);
  EXPECT_EQ(masks[0], plan.mask_words().data());
  EXPECT_EQ(masks[1], nullptr);
  EXPECT_EQ(masks[2], plan.mask_words().data() + 2);

  const auto refused = [&](const v1::StepPlan& p, int64_t rows, const std::string& want) {
    const absl::Status s = CheckTokenMasks(p, rows, kVocab, &masks);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << want;
    EXPECT_TRUE(absl::StrContains(s.message(), want)) << s.message();
    EXPECT_TRUE(absl::StrContains(s.message(), "step 5")) << s.message();
  };
  v1::StepPlan p = plan;
  p.add_mask_words(1);
  refused(p, 3, "5 mask_words for 2 masked rows; want 2 per row");
  refused(plan, 2, "mask_logit_rows[1] 2 is not increasing within the step's 2 logit rows");
  p = plan;
  p.set_mask_logit_rows(1, 0);
  refused(p, 3, "mask_logit_rows[1] 0 is not increasing");
  p = plan;
  p.set_mask_logit_rows(0, -1);
  refused(p, 3, "mask_logit_rows[0] -1");
  p = plan;
  p.set_mask_words(3, 1u << 8);  // id 40: past the vocabulary
  refused(p, 3, "the mask of logit row 2 allows ids at or past vocab_size 40");
  p = plan;
  p.set_mask_words(0, 0);
  refused(p, 3, "the mask of logit row 0 allows no token");
}

TEST(StepChecksTest, StepBatchIndexesStayInside) {
  const ModelConfig config = Demo();
  const StepLimits l = Limits();  // 4 blocks of 16 per sequence, 8 blocks in the cache
  StepBatch b;
  b.token_ids = {5, 6};
  b.positions = {0, 1};
  b.token_seq = {0, 0};
  b.slots = {16, 17};
  b.block_tables = {1, 0, 0, 0};
  b.num_seqs = 1;
  b.logit_rows = {1};
  EXPECT_TRUE(CheckStepBatch(b, l, config, /*first_stage=*/true).ok());
  StepBatch bad = b;
  bad.slots[1] = 8 * 16;
  ExpectRefused(CheckStepBatch(bad, l, config, true), "cache slot 128 outside [0, 128)");
  bad = b;
  bad.block_tables[3] = 8;
  ExpectRefused(CheckStepBatch(bad, l, config, true), "block 8 outside [0, 8)");
  bad = b;
  bad.positions[1] = 64;
  ExpectRefused(CheckStepBatch(bad, l, config, true), "position 64");
  bad = b;
  bad.token_ids[0] = 4096;
  ExpectRefused(CheckStepBatch(bad, l, config, true), "token id 4096");
  EXPECT_TRUE(CheckStepBatch(bad, l, config, /*first_stage=*/false).ok());  // later stages take hidden states
  bad = b;
  bad.logit_rows = {2};
  ExpectRefused(CheckStepBatch(bad, l, config, true), "logit row 2");
  bad = b;
  bad.sliding_slots = {0, 1};  // no sliding layers' pool in these limits
  ExpectRefused(CheckStepBatch(bad, l, config, true), "sliding_slots has 2 and sliding_block_tables 0 entries, "
                                                      "expected 0 and 0 (num_sliding_kv_blocks 0)");

  // With a sliding layers' pool of 3 blocks: its slots and tables, shaped as the others, inside it.
  StepLimits pool = l;
  pool.num_sliding_kv_blocks = 3;
  ExpectRefused(CheckStepBatch(b, pool, config, true), "expected 2 and 4 (num_sliding_kv_blocks 3)");
  StepBatch both = b;
  both.sliding_slots = {32, 33};
  both.sliding_block_tables = {2, 0, 0, 0};
  EXPECT_TRUE(CheckStepBatch(both, pool, config, true).ok());
  bad = both;
  bad.sliding_block_tables.pop_back();
  ExpectRefused(CheckStepBatch(bad, pool, config, true), "sliding_block_tables 3 entries, expected 2 and 4");
  bad = both;
  bad.sliding_slots[1] = 48;
  ExpectRefused(CheckStepBatch(bad, pool, config, true), "sliding cache slot 48 outside [0, 48)");
  bad = both;
  bad.sliding_block_tables[2] = 3;
  ExpectRefused(CheckStepBatch(bad, pool, config, true), "sliding block 3 outside [0, 3)");
  bad = both;
  bad.sliding_block_tables[0] = -1;
  ExpectRefused(CheckStepBatch(bad, pool, config, true), "sliding block -1 outside [0, 3)");
}

}  // namespace
}  // namespace shardserve
