// worker/persistent_batch.h: the running batch a worker holds from stateful step plans. What it
// derives (positions, slots, block tables, logit rows, draw indices, penalty ids) is checked
// against what the stateless plans carried, and every bad plan is InvalidArgument naming what is
// wrong. The scheduler's randomized cluster tests (scheduler_test.cc) decode every plan with it too.
#include "worker/persistent_batch.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace shardserve {
namespace {

using RowList = google::protobuf::RepeatedPtrField<v1::RowSampling>;

// 4 rows and 12 tokens a step, blocks of 4 tokens, 16 blocks, tables of 4 blocks (16 tokens).
constexpr StepLimits kLimits{.max_tokens_per_step = 12, .max_seqs_per_step = 4, .block_size = 4,
                             .num_kv_blocks = 16, .max_model_len = 16};
constexpr int64_t kVocab = 100;

void AddNewSeq(v1::StepPlan* plan, uint64_t id, std::vector<int32_t> blocks, int32_t prompt_len,
               const v1::RowSampling& sampling = v1::RowSampling()) {
  v1::NewSeq* n = plan->add_new_seqs();
  n->set_seq_id(id);
  n->mutable_block_ids()->Add(blocks.begin(), blocks.end());
  *n->mutable_sampling() = sampling;
  n->set_prompt_len(prompt_len);
}

void AddBlocks(v1::StepPlan* plan, uint64_t id, std::vector<int32_t> blocks) {
  v1::SeqBlocks* a = plan->add_appended_blocks();
  a->set_seq_id(id);
  a->mutable_block_ids()->Add(blocks.begin(), blocks.end());
}

void AddRow(v1::StepPlan* plan, uint64_t id, int32_t start, std::vector<int32_t> tokens, bool sample) {
  plan->mutable_token_ids()->Add(tokens.begin(), tokens.end());
  plan->add_row_seq_ids(id);
  plan->add_row_start_positions(start);
  plan->add_row_num_tokens(static_cast<int32_t>(tokens.size()));
  plan->add_row_samples(sample);
}

class PersistentBatchTest : public ::testing::Test {
 protected:
  PersistentBatchTest() : state_(kLimits, kVocab, /*keep_history=*/true) { state_.Reserve(&batch_); }

  absl::Status Apply(const v1::StepPlan& plan) { return state_.Apply(plan, &batch_, &sampling_); }

  // Applies `plan` and expects InvalidArgument whose message has `want`.
  void ExpectBad(const v1::StepPlan& plan, const std::string& want) {
    const absl::Status s = Apply(plan);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << want << ": " << s;
    EXPECT_NE(s.message().find(want), std::string::npos) << "want '" << want << "' in: " << s.message();
  }

  // Seq 1: prompt {11, 12, 13, 14, 15} in blocks 7 and 2, fed whole, sampling.
  v1::StepPlan Prefill(const v1::RowSampling& sampling = v1::RowSampling()) {
    v1::StepPlan p;
    p.set_step_id(1);
    AddNewSeq(&p, 1, {7, 2}, 5, sampling);
    AddRow(&p, 1, 0, {11, 12, 13, 14, 15}, true);
    return p;
  }

  PersistentBatch state_;
  StepBatch batch_;
  RowList sampling_;
};

// A prefill, then a prompt chunk of a second sequence beside a decode of the first, then a decode
// that crosses into an appended block: the batch is what a stateless plan carried.
TEST_F(PersistentBatchTest, DerivesWhatStatelessPlansCarried) {
  v1::RowSampling rs;
  rs.set_seed(42);
  rs.set_temperature(0.5f);
  rs.set_repetition_penalty(1.3f);
  ASSERT_TRUE(Apply(Prefill(rs)).ok());
  EXPECT_EQ(batch_.token_ids, (std::vector<int32_t>{11, 12, 13, 14, 15}));
  EXPECT_EQ(batch_.positions, (std::vector<int32_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(batch_.token_seq, (std::vector<int32_t>{0, 0, 0, 0, 0}));
  EXPECT_EQ(batch_.slots, (std::vector<int32_t>{28, 29, 30, 31, 8}));
  EXPECT_EQ(batch_.num_seqs, 1);
  EXPECT_EQ(batch_.block_tables, (std::vector<int32_t>{7, 2, 0, 0}));
  EXPECT_EQ(batch_.logit_rows, (std::vector<int32_t>{4}));
  ASSERT_EQ(sampling_.size(), 1);
  EXPECT_EQ(sampling_[0].seed(), 42u);
  EXPECT_EQ(sampling_[0].draw_index(), 0u);
  EXPECT_EQ(std::vector<int32_t>(sampling_[0].penalty_prompt_ids().begin(), sampling_[0].penalty_prompt_ids().end()),
            (std::vector<int32_t>{11, 12, 13, 14, 15}));
  EXPECT_EQ(sampling_[0].penalty_output_ids_size(), 0);

  // Seq 1 decodes its sampled 50; seq 2 prefills 3 of its 6 prompt tokens (no sample).
  v1::StepPlan p;
  p.set_step_id(2);
  AddNewSeq(&p, 2, {5, 6}, 6);
  AddRow(&p, 1, 5, {50}, true);
  AddRow(&p, 2, 0, {21, 22, 23}, false);
  ASSERT_TRUE(Apply(p).ok());
  EXPECT_EQ(batch_.positions, (std::vector<int32_t>{5, 0, 1, 2}));
  EXPECT_EQ(batch_.token_seq, (std::vector<int32_t>{0, 1, 1, 1}));
  EXPECT_EQ(batch_.slots, (std::vector<int32_t>{9, 20, 21, 22}));
  EXPECT_EQ(batch_.block_tables, (std::vector<int32_t>{7, 2, 0, 0, 5, 6, 0, 0}));
  EXPECT_EQ(batch_.logit_rows, (std::vector<int32_t>{0}));
  ASSERT_EQ(sampling_.size(), 1);
  EXPECT_EQ(sampling_[0].draw_index(), 1u);
  EXPECT_EQ(std::vector<int32_t>(sampling_[0].penalty_output_ids().begin(), sampling_[0].penalty_output_ids().end()),
            (std::vector<int32_t>{50}));
  EXPECT_EQ(state_.fed(1), 6);
  EXPECT_EQ(state_.fed(2), 3);

  // Seq 1 fills block 2 (positions 6, 7) over two decodes, then crosses into appended block 11.
  for (int32_t pos : {6, 7}) {
    v1::StepPlan d;
    d.set_step_id(static_cast<uint64_t>(pos) - 3);
    AddRow(&d, 1, pos, {pos + 50}, true);
    ASSERT_TRUE(Apply(d).ok());
  }
  v1::StepPlan cross;
  cross.set_step_id(5);
  AddBlocks(&cross, 1, {11});
  AddRow(&cross, 1, 8, {58}, true);
  ASSERT_TRUE(Apply(cross).ok());
  EXPECT_EQ(batch_.slots, (std::vector<int32_t>{44}));
  EXPECT_EQ(batch_.block_tables, (std::vector<int32_t>{7, 2, 11, 0}));
  EXPECT_EQ(sampling_[0].draw_index(), 4u);
  EXPECT_EQ(std::vector<int32_t>(sampling_[0].penalty_output_ids().begin(), sampling_[0].penalty_output_ids().end()),
            (std::vector<int32_t>{50, 56, 57, 58}));
  EXPECT_EQ(state_.blocks(1), (std::vector<int32_t>{7, 2, 11}));
}

// Penalty ids are kept only where asked (the worker that samples), and only for the penalties
// that read them: the prompt for the repetition penalty, the completion for any.
TEST_F(PersistentBatchTest, KeepsPenaltyIdsOnlyWhereNeeded) {
  v1::RowSampling presence;
  presence.set_presence_penalty(0.5f);
  ASSERT_TRUE(Apply(Prefill(presence)).ok());
  EXPECT_EQ(sampling_[0].penalty_prompt_ids_size(), 0);
  EXPECT_EQ(sampling_[0].penalty_output_ids_size(), 0);
  v1::StepPlan d;
  d.set_step_id(2);
  AddRow(&d, 1, 5, {9}, true);
  ASSERT_TRUE(Apply(d).ok());
  EXPECT_EQ(sampling_[0].penalty_output_ids_size(), 1);

  PersistentBatch elsewhere(kLimits, kVocab, /*keep_history=*/false);
  StepBatch b;
  elsewhere.Reserve(&b);
  ASSERT_TRUE(elsewhere.Apply(Prefill(presence), &b, &sampling_).ok());
  ASSERT_TRUE(elsewhere.Apply(d, &b, &sampling_).ok());
  EXPECT_EQ(sampling_[0].penalty_output_ids_size(), 0);
  EXPECT_EQ(sampling_[0].presence_penalty(), 0.5f);

  // Bad words read the output too.
  PersistentBatch words(kLimits, kVocab, /*keep_history=*/true);
  v1::RowSampling bad;
  bad.add_bad_word_ids(4);
  bad.add_bad_word_lengths(1);
  ASSERT_TRUE(words.Apply(Prefill(bad), &b, &sampling_).ok());
  ASSERT_TRUE(words.Apply(d, &b, &sampling_).ok());
  EXPECT_EQ(std::vector<int32_t>(sampling_[0].penalty_output_ids().begin(), sampling_[0].penalty_output_ids().end()),
            std::vector<int32_t>{9});
  EXPECT_EQ(sampling_[0].penalty_prompt_ids_size(), 0);
}

// A preempted sequence is freed and comes back new in the same plan, with other blocks, fed from
// position 0; the history starts over with it.
TEST_F(PersistentBatchTest, FreedSequenceComesBackNew) {
  v1::RowSampling rs;
  rs.set_frequency_penalty(1.0f);
  ASSERT_TRUE(Apply(Prefill(rs)).ok());
  v1::StepPlan p;
  p.set_step_id(2);
  p.add_freed_seq_ids(1);
  AddNewSeq(&p, 1, {3, 4}, 5, rs);
  AddRow(&p, 1, 0, {11, 12, 13, 14, 15, 50}, true);
  ASSERT_TRUE(Apply(p).ok());
  EXPECT_EQ(batch_.slots, (std::vector<int32_t>{12, 13, 14, 15, 16, 17}));
  EXPECT_EQ(sampling_[0].draw_index(), 1u);
  EXPECT_EQ(std::vector<int32_t>(sampling_[0].penalty_output_ids().begin(), sampling_[0].penalty_output_ids().end()),
            (std::vector<int32_t>{50}));
  EXPECT_EQ(state_.size(), 1);
  v1::StepPlan f;
  f.set_step_id(3);
  f.add_freed_seq_ids(1);
  AddNewSeq(&f, 2, {0}, 1);
  AddRow(&f, 2, 0, {1}, true);
  ASSERT_TRUE(Apply(f).ok());
  EXPECT_FALSE(state_.Holds(1));
  EXPECT_TRUE(state_.Holds(2));
}

TEST_F(PersistentBatchTest, RefusesUnknownSequences) {
  v1::StepPlan row;
  row.set_step_id(9);
  AddRow(&row, 3, 0, {1}, true);
  ExpectBad(row, "step 9: row 0 names seq 3, which this worker does not hold");

  v1::StepPlan blocks;
  blocks.set_step_id(9);
  AddBlocks(&blocks, 3, {1});
  AddRow(&blocks, 3, 0, {1}, true);
  ExpectBad(blocks, "appended_blocks[0] names seq 3, which this worker does not hold");

  v1::StepPlan freed;
  freed.set_step_id(9);
  freed.add_freed_seq_ids(3);
  ExpectBad(freed, "freed_seq_ids names seq 3, which this worker does not hold");
}

TEST_F(PersistentBatchTest, RefusesARowForAFreedSequence) {
  ASSERT_TRUE(Apply(Prefill()).ok());
  v1::StepPlan p;
  p.set_step_id(2);
  p.add_freed_seq_ids(1);
  AddRow(&p, 1, 5, {1}, true);
  ExpectBad(p, "row 0 names seq 1, which this worker does not hold");
}

TEST_F(PersistentBatchTest, RefusesASequenceFreedTwice) {
  ASSERT_TRUE(Apply(Prefill()).ok());
  v1::StepPlan p;
  p.set_step_id(2);
  p.add_freed_seq_ids(1);
  p.add_freed_seq_ids(1);
  ExpectBad(p, "freed_seq_ids names seq 1, which this worker does not hold");
}

TEST_F(PersistentBatchTest, RefusesASequenceSentNewTwice) {
  ASSERT_TRUE(Apply(Prefill()).ok());
  v1::StepPlan again = Prefill();
  again.set_step_id(2);
  ExpectBad(again, "new_seqs[0]: seq 1 is already held");

  PersistentBatch other(kLimits, kVocab, true);
  v1::StepPlan twice;
  twice.set_step_id(3);
  AddNewSeq(&twice, 4, {0}, 1);
  AddNewSeq(&twice, 4, {1}, 1);
  AddRow(&twice, 4, 0, {1}, true);
  const absl::Status s = other.Apply(twice, &batch_, &sampling_);
  EXPECT_NE(s.message().find("new_seqs[1]: seq 4 is already held"), std::string::npos) << s;
}

TEST_F(PersistentBatchTest, RefusesATableLongerThanMaxBlocksPerSeq) {
  v1::StepPlan p;
  p.set_step_id(1);
  AddNewSeq(&p, 1, {0, 1, 2, 3, 4}, 1);
  AddRow(&p, 1, 0, {1}, true);
  ExpectBad(p, "new_seqs gives seq 1 5 blocks; a table holds at most 4");

  ASSERT_TRUE(Apply(Prefill()).ok());  // 2 blocks
  v1::StepPlan grow;
  grow.set_step_id(2);
  AddBlocks(&grow, 1, {3, 4, 5});
  AddRow(&grow, 1, 5, {1}, true);
  ExpectBad(grow, "appended_blocks gives seq 1 5 blocks; a table holds at most 4");
}

TEST_F(PersistentBatchTest, RefusesBlocksOutsideTheCache) {
  for (int32_t block : {-1, 16}) {
    PersistentBatch state(kLimits, kVocab, true);
    v1::StepPlan p;
    p.set_step_id(1);
    AddNewSeq(&p, 1, {0, block}, 1);
    AddRow(&p, 1, 0, {1}, true);
    const absl::Status s = state.Apply(p, &batch_, &sampling_);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find(absl::StrCat("new_seqs gives seq 1 block ", block, " outside [0, 16)")),
              std::string::npos)
        << s;
  }
  ASSERT_TRUE(Apply(Prefill()).ok());
  v1::StepPlan grow;
  grow.set_step_id(2);
  AddBlocks(&grow, 1, {16});
  AddRow(&grow, 1, 5, {1}, true);
  ExpectBad(grow, "appended_blocks gives seq 1 block 16 outside [0, 16)");
}

// A worker holds no sliding layers' pool: a plan that gives a sequence a sliding table is refused,
// naming the field, rather than run with the sliding layers reading the other table.
TEST_F(PersistentBatchTest, RefusesSlidingTablesItHasNoPoolFor) {
  v1::StepPlan p = Prefill();
  p.mutable_new_seqs(0)->add_sliding_block_ids(3);
  ExpectBad(p, "new_seqs gives seq 1 1 sliding_block_ids; this worker holds no sliding layers' pool");
  ASSERT_TRUE(Apply(Prefill()).ok());
  v1::StepPlan grow;
  grow.set_step_id(2);
  AddBlocks(&grow, 1, {5});
  grow.mutable_appended_blocks(0)->add_sliding_block_ids(5);
  AddRow(&grow, 1, 5, {1}, true);
  ExpectBad(grow, "appended_blocks gives seq 1 1 sliding_block_ids; this worker holds no sliding layers' pool");
}

// With a sliding layers' pool (num_sliding_kv_blocks 6) each sequence has a second table, as long as
// its first: the sliding slots and tables come from it as the others come from the first, padded
// with block 0 alike, and they keep naming the blocks the coordinator let go of.
TEST_F(PersistentBatchTest, DerivesTheSlidingLayersSlotsAndTables) {
  StepLimits limits = kLimits;
  limits.num_sliding_kv_blocks = 6;
  PersistentBatch state(limits, kVocab, /*keep_history=*/false);
  StepBatch batch;
  state.Reserve(&batch);
  v1::StepPlan p = Prefill();
  p.mutable_new_seqs(0)->add_sliding_block_ids(5);
  p.mutable_new_seqs(0)->add_sliding_block_ids(3);
  AddNewSeq(&p, 2, {4}, 2);
  p.mutable_new_seqs(1)->add_sliding_block_ids(1);
  AddRow(&p, 2, 0, {21, 22}, true);
  ASSERT_TRUE(state.Apply(p, &batch, &sampling_).ok());
  EXPECT_EQ(batch.slots, (std::vector<int32_t>{28, 29, 30, 31, 8, 16, 17}));
  EXPECT_EQ(batch.sliding_slots, (std::vector<int32_t>{20, 21, 22, 23, 12, 4, 5}));
  EXPECT_EQ(batch.block_tables, (std::vector<int32_t>{7, 2, 0, 0, 4, 0, 0, 0}));
  EXPECT_EQ(batch.sliding_block_tables, (std::vector<int32_t>{5, 3, 0, 0, 1, 0, 0, 0}));
  EXPECT_EQ(state.sliding_blocks(1), (std::vector<int32_t>{5, 3}));

  // Seq 1 grows into an appended block; seq 2 decodes in its first.
  v1::StepPlan grow;
  grow.set_step_id(2);
  AddBlocks(&grow, 1, {9});
  grow.mutable_appended_blocks(0)->add_sliding_block_ids(4);
  AddRow(&grow, 1, 5, {1, 2, 3, 4}, true);
  AddRow(&grow, 2, 2, {23}, true);
  ASSERT_TRUE(state.Apply(grow, &batch, &sampling_).ok());
  EXPECT_EQ(batch.slots, (std::vector<int32_t>{9, 10, 11, 36, 18}));
  EXPECT_EQ(batch.sliding_slots, (std::vector<int32_t>{13, 14, 15, 16, 6}));
  EXPECT_EQ(batch.sliding_block_tables, (std::vector<int32_t>{5, 3, 4, 0, 1, 0, 0, 0}));

  // Bad sliding tables: too short, an id outside the pool, on a new sequence and on appended blocks.
  v1::StepPlan shorter;
  shorter.set_step_id(3);
  AddNewSeq(&shorter, 3, {10, 11}, 1);
  shorter.mutable_new_seqs(0)->add_sliding_block_ids(2);
  AddRow(&shorter, 3, 0, {1}, true);
  for (const auto& [plan, want] :
       std::vector<std::pair<v1::StepPlan, std::string>>{
           {shorter, "step 3: new_seqs gives seq 3 2 block_ids but 1 sliding_block_ids; the sliding table must be as long"}}) {
    PersistentBatch fresh(limits, kVocab, false);
    const absl::Status s = fresh.Apply(plan, &batch, &sampling_);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(want), std::string::npos) << s.message();
  }
  v1::StepPlan outside;
  outside.set_step_id(4);
  AddNewSeq(&outside, 3, {10}, 1);
  outside.mutable_new_seqs(0)->add_sliding_block_ids(6);
  AddRow(&outside, 3, 0, {1}, true);
  {
    PersistentBatch fresh(limits, kVocab, false);
    const absl::Status s = fresh.Apply(outside, &batch, &sampling_);
    EXPECT_NE(s.message().find("new_seqs gives seq 3 sliding block 6 outside [0, 6)"), std::string::npos) << s;
  }
  v1::StepPlan append;
  append.set_step_id(5);
  AddBlocks(&append, 2, {12});
  AddRow(&append, 2, 3, {1}, true);
  const absl::Status missing = state.Apply(append, &batch, &sampling_);
  EXPECT_NE(missing.message().find("appended_blocks gives seq 2 1 block_ids but 0 sliding_block_ids"),
            std::string::npos)
      << missing;
}

TEST_F(PersistentBatchTest, RefusesPositionsBeyondTheTable) {
  v1::StepPlan p;
  p.set_step_id(1);
  AddNewSeq(&p, 1, {7}, 5);
  AddRow(&p, 1, 0, {11, 12, 13, 14, 15}, true);
  ExpectBad(p, "row 0 feeds seq 1 positions up to 4, beyond its table of 1 blocks of 4 tokens");
}

TEST_F(PersistentBatchTest, RefusesPositionsThatAreNotTheNextOnes) {
  ASSERT_TRUE(Apply(Prefill()).ok());
  for (int32_t start : {4, 6, 0}) {
    v1::StepPlan p;
    p.set_step_id(2);
    AddRow(&p, 1, start, {1}, true);
    ExpectBad(p, absl::StrCat("row 0 starts seq 1 at position ", start, "; it was fed 5 tokens"));
  }
}

TEST_F(PersistentBatchTest, RefusesASequenceInTwoRows) {
  ASSERT_TRUE(Apply(Prefill()).ok());
  v1::StepPlan p;
  p.set_step_id(2);
  AddRow(&p, 1, 5, {1}, false);
  AddRow(&p, 1, 6, {2}, true);
  ExpectBad(p, "row 1 names seq 1 a second time");
}

TEST_F(PersistentBatchTest, RefusesMoreRowsOrTokensThanTheLimits) {
  v1::StepPlan rows;
  rows.set_step_id(1);
  for (uint64_t id = 1; id <= 5; ++id) AddRow(&rows, id, 0, {1}, true);
  ExpectBad(rows, "5 rows; a step takes 1 to 4");

  v1::StepPlan none;
  none.set_step_id(1);
  ExpectBad(none, "0 rows; a step takes 1 to 4");

  v1::StepPlan tokens;
  tokens.set_step_id(1);
  AddNewSeq(&tokens, 1, {0, 1, 2, 3}, 13);
  AddRow(&tokens, 1, 0, std::vector<int32_t>(13, 1), true);
  ExpectBad(tokens, "13 token ids; a step takes 1 to 12");
}

TEST_F(PersistentBatchTest, RefusesMoreHeldSequencesThanMaxSeqsPerStep) {
  v1::StepPlan p;
  p.set_step_id(1);
  for (uint64_t id = 1; id <= 4; ++id) AddNewSeq(&p, id, {static_cast<int32_t>(id)}, 1);
  for (uint64_t id = 1; id <= 4; ++id) AddRow(&p, id, 0, {1}, true);
  ASSERT_TRUE(Apply(p).ok());
  v1::StepPlan more;
  more.set_step_id(2);
  AddNewSeq(&more, 5, {5}, 1);
  AddRow(&more, 5, 0, {1}, true);
  ExpectBad(more, "new_seqs[0]: seq 5 would be the 5th sequence held; at most max_seqs_per_step = 4");
}

TEST_F(PersistentBatchTest, RefusesRowListsThatDoNotAgree) {
  v1::StepPlan p = Prefill();
  p.add_row_samples(true);
  ExpectBad(p, "row lists have 1 seq ids, 1 start positions, 1 token counts and 2 sample flags");

  PersistentBatch a(kLimits, kVocab, true), b(kLimits, kVocab, true), c(kLimits, kVocab, true);
  v1::StepPlan extra = Prefill();
  extra.add_token_ids(3);
  absl::Status s = a.Apply(extra, &batch_, &sampling_);
  EXPECT_NE(s.message().find("the rows feed 5 tokens but token_ids has 6"), std::string::npos) << s;

  v1::StepPlan zero = Prefill();
  zero.set_row_num_tokens(0, 0);
  s = b.Apply(zero, &batch_, &sampling_);
  EXPECT_NE(s.message().find("row 0 feeds seq 1 0 tokens"), std::string::npos) << s;

  v1::StepPlan past = Prefill();
  past.set_row_num_tokens(0, 6);
  s = c.Apply(past, &batch_, &sampling_);
  EXPECT_NE(s.message().find("row 0 feeds seq 1 6 tokens; the step's token_ids have 5 left"), std::string::npos) << s;
}

TEST_F(PersistentBatchTest, RefusesBadNewSequences) {
  v1::StepPlan inside = Prefill();
  inside.mutable_new_seqs(0)->set_prompt_len(6);
  ExpectBad(inside, "row 0 samples seq 1 after 5 tokens, inside its prompt of 6");

  for (int32_t len : {0, 17}) {
    PersistentBatch state(kLimits, kVocab, true);
    v1::StepPlan p = Prefill();
    p.mutable_new_seqs(0)->set_prompt_len(len);
    const absl::Status s = state.Apply(p, &batch_, &sampling_);
    EXPECT_NE(s.message().find(absl::StrCat("new_seqs[0]: seq 1 prompt_len ", len, " outside [1, 16]")),
              std::string::npos)
        << s;
  }
  PersistentBatch state(kLimits, kVocab, true);
  v1::RowSampling drawn;
  drawn.set_draw_index(3);
  const absl::Status s = state.Apply(Prefill(drawn), &batch_, &sampling_);
  EXPECT_NE(s.message().find("sampling carries draw_index, penalty ids or a scored id"), std::string::npos) << s;
}

// Prompt log-probabilities: a row's scored positions (row_num_scored) come just before its sampled
// one, each a logit row with logprobs, the sequence's prompt_logprobs alternatives and the prompt's
// next token (scored_ids); a plan that scores where it may not is refused, naming what is wrong.
TEST_F(PersistentBatchTest, ScoredPositionsComeBeforeTheSampledOne) {
  v1::RowSampling asks;
  asks.set_temperature(0.5f);
  asks.set_prompt_logprobs(4);
  // Seq 1's prompt {11 .. 15}: a first chunk of 3 scores them all, the second (2 tokens) its first
  // and samples at its last.
  v1::StepPlan p;
  p.set_step_id(1);
  AddNewSeq(&p, 1, {7, 2}, 5, asks);
  AddRow(&p, 1, 0, {11, 12, 13}, false);
  p.add_row_num_scored(3);
  for (int32_t id : {12, 13, 14}) p.add_scored_ids(id);
  ASSERT_TRUE(Apply(p).ok()) << Apply(p);
  EXPECT_EQ(batch_.logit_rows, (std::vector<int32_t>{0, 1, 2}));
  ASSERT_EQ(sampling_.size(), 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(sampling_[i].scored_id(), 12 + i);
    EXPECT_TRUE(sampling_[i].logprobs());
    EXPECT_EQ(sampling_[i].top_logprobs(), 4);
    EXPECT_EQ(sampling_[i].temperature(), 0.0f) << "a scored row draws nothing";
  }
  v1::StepPlan q;
  q.set_step_id(2);
  AddRow(&q, 1, 3, {14, 15}, true);
  q.add_row_num_scored(1);
  q.add_scored_ids(15);
  ASSERT_TRUE(Apply(q).ok());
  EXPECT_EQ(batch_.logit_rows, (std::vector<int32_t>{0, 1}));
  ASSERT_EQ(sampling_.size(), 2);
  EXPECT_EQ(sampling_[0].scored_id(), 15);
  EXPECT_FALSE(sampling_[1].has_scored_id());
  EXPECT_EQ(sampling_[1].temperature(), 0.5f);
  EXPECT_EQ(sampling_[1].draw_index(), 0u);

  const auto refused = [&](const v1::RowSampling& sampling, int32_t scored, std::vector<int32_t> ids, bool sample,
                           const std::string& want) {
    PersistentBatch state(kLimits, kVocab, true);
    v1::StepPlan bad;
    bad.set_step_id(1);
    AddNewSeq(&bad, 1, {7, 2}, 5, sampling);
    AddRow(&bad, 1, 0, sample ? std::vector<int32_t>{11, 12, 13, 14, 15} : std::vector<int32_t>{11, 12, 13}, sample);
    bad.add_row_num_scored(scored);
    bad.mutable_scored_ids()->Add(ids.begin(), ids.end());
    const absl::Status s = state.Apply(bad, &batch_, &sampling_);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << want << ": " << s;
    EXPECT_NE(s.message().find(want), std::string::npos) << "want '" << want << "' in: " << s.message();
  };
  refused(v1::RowSampling(), 3, {12, 13, 14}, false, "which asked for no prompt logprobs");
  refused(asks, 4, {12, 13, 14, 15}, false, "they must lie among its 3 positions");
  refused(asks, 5, {12, 13, 14, 15, 1}, true, "each be followed by a token of its prompt of 5");
  refused(asks, 3, {12, 13}, false, "scored_ids has 2 ids left");
  refused(asks, 2, {12, 13, 14}, false, "the rows score 2 positions but scored_ids has 3 ids");
  refused(asks, 3, {12, 13, 100}, false, "scored_ids[2] 100 is outside the vocabulary");
  refused(asks, 4, {12, 13, 14, 15}, true, "more than max_seqs_per_step = 4 positions");
  v1::RowSampling carried = asks;
  carried.set_scored_id(3);
  refused(carried, 3, {12, 13, 14}, false, "sampling carries draw_index, penalty ids or a scored id");
}

// A sequence whose first blocks hold cached KV (the coordinator's prefix cache) starts after them:
// its first row's positions and slots begin at num_cached_tokens, so the shared blocks are never
// written; the draw index still counts from the prompt's end.
TEST_F(PersistentBatchTest, StartsANewSequenceAfterItsCachedTokens) {
  v1::StepPlan p;
  p.set_step_id(1);
  AddNewSeq(&p, 1, {7, 2, 9}, 10);
  p.mutable_new_seqs(0)->set_num_cached_tokens(8);
  AddRow(&p, 1, 8, {18, 19}, true);
  ASSERT_TRUE(Apply(p).ok());
  EXPECT_EQ(batch_.positions, (std::vector<int32_t>{8, 9}));
  EXPECT_EQ(batch_.slots, (std::vector<int32_t>{9 * 4 + 0, 9 * 4 + 1}));
  EXPECT_EQ(state_.fed(1), 10);
  ASSERT_EQ(sampling_.size(), 1);
  EXPECT_EQ(sampling_[0].draw_index(), 0u);
}

TEST_F(PersistentBatchTest, RefusesBadNumCachedTokens) {
  struct Case {
    int32_t cached;
    std::string want;
  };
  for (const Case& c : {Case{-4, "num_cached_tokens -4 is not a multiple of the block size 4 below the 8 tokens"},
                        Case{3, "num_cached_tokens 3 is not a multiple"}, Case{8, "num_cached_tokens 8 is not"}}) {
    PersistentBatch state(kLimits, kVocab, true);
    v1::StepPlan p = Prefill();
    p.mutable_new_seqs(0)->set_num_cached_tokens(c.cached);
    const absl::Status s = state.Apply(p, &batch_, &sampling_);
    EXPECT_NE(s.message().find(c.want), std::string::npos) << s;
  }
  // A penalty needs every token fed.
  PersistentBatch state(kLimits, kVocab, true);
  v1::RowSampling penalty;
  penalty.set_frequency_penalty(0.5f);
  v1::StepPlan p;
  p.set_step_id(1);
  AddNewSeq(&p, 1, {7, 2}, 5, penalty);
  p.mutable_new_seqs(0)->set_num_cached_tokens(4);
  AddRow(&p, 1, 4, {15}, true);
  const absl::Status s = state.Apply(p, &batch_, &sampling_);
  EXPECT_NE(s.message().find("has a sampling penalty on and num_cached_tokens 4"), std::string::npos) << s;
  // A row that starts before the cached tokens is refused like any other wrong start.
  PersistentBatch other(kLimits, kVocab, true);
  v1::StepPlan q = Prefill();
  q.mutable_new_seqs(0)->set_num_cached_tokens(4);
  const absl::Status t = other.Apply(q, &batch_, &sampling_);
  EXPECT_NE(t.message().find("row 0 starts seq 1 at position 0; it was fed 4 tokens"), std::string::npos) << t;
}

TEST_F(PersistentBatchTest, RefusesTokenIdsOutsideTheVocabulary) {
  v1::StepPlan p = Prefill();
  p.set_token_ids(2, kVocab);
  ExpectBad(p, "token id 100 outside the vocabulary [0, 100)");
}

// Asynchronous scheduling: a row that feeds its last sample gets the id the sampler drew for it
// (the plan carries a placeholder), also in the penalty ids, and each sample feeds once, at the
// position it is the token of.
TEST(PersistentBatchFedSampleTest, FeedsTheSampleDrawnForTheSequence) {
  PersistentBatch state(kLimits, kVocab, /*keep_history=*/true, /*feeds_samples=*/true);
  StepBatch batch;
  RowList sampling;
  state.Reserve(&batch);
  v1::RowSampling rs;
  rs.set_presence_penalty(0.5f);
  v1::StepPlan p;
  p.set_step_id(1);
  AddNewSeq(&p, 1, {7, 2}, 3, rs);
  AddNewSeq(&p, 2, {5}, 2);
  AddRow(&p, 1, 0, {11, 12, 13}, true);
  AddRow(&p, 2, 0, {21, 22}, true);
  ASSERT_TRUE(state.Apply(p, &batch, &sampling).ok());
  google::protobuf::RepeatedField<int32_t> drawn;
  drawn.Add(41);
  drawn.Add(42);
  state.RecordSamples(drawn);

  // Seq 1 feeds its sample (41) in row 1; seq 2 feeds its sample (42) in row 0.
  v1::StepPlan q;
  q.set_step_id(2);
  AddRow(&q, 2, 2, {0}, true);
  AddRow(&q, 1, 3, {0}, true);
  q.add_row_feeds_sample(true);
  q.add_row_feeds_sample(true);
  ASSERT_TRUE(state.Apply(q, &batch, &sampling).ok());
  EXPECT_EQ(batch.token_ids, (std::vector<int32_t>{42, 41}));
  EXPECT_EQ(batch.positions, (std::vector<int32_t>{2, 3}));
  ASSERT_EQ(sampling.size(), 2);
  EXPECT_EQ(std::vector<int32_t>(sampling[1].penalty_output_ids().begin(), sampling[1].penalty_output_ids().end()),
            (std::vector<int32_t>{41}));
  drawn.Set(0, 52);
  drawn.Set(1, 51);
  state.RecordSamples(drawn);

  // Seq 1 feeds 51 beside a row of seq 2 that feeds a known token (the flag is per row).
  v1::StepPlan r;
  r.set_step_id(3);
  AddRow(&r, 1, 4, {0}, true);
  AddRow(&r, 2, 3, {52}, false);
  r.add_row_feeds_sample(true);
  r.add_row_feeds_sample(false);
  ASSERT_TRUE(state.Apply(r, &batch, &sampling).ok());
  EXPECT_EQ(batch.token_ids, (std::vector<int32_t>{51, 52}));
  EXPECT_EQ(std::vector<int32_t>(sampling[0].penalty_output_ids().begin(), sampling[0].penalty_output_ids().end()),
            (std::vector<int32_t>{41, 51}));
}

TEST(PersistentBatchFedSampleTest, RefusesRowsThatCannotFeedASample) {
  StepBatch batch;
  RowList sampling;
  // A worker that has prefilled seq 1's prompt {11, 12, 13} and, with `drawn`, drawn 41 after it.
  auto prefilled = [&](bool feeds_samples, bool drawn) {
    auto state = std::make_unique<PersistentBatch>(kLimits, kVocab, true, feeds_samples);
    state->Reserve(&batch);
    v1::StepPlan p;
    p.set_step_id(1);
    AddNewSeq(&p, 1, {7, 2}, 3);
    AddRow(&p, 1, 0, {11, 12, 13}, true);
    EXPECT_TRUE(state->Apply(p, &batch, &sampling).ok());
    google::protobuf::RepeatedField<int32_t> ids;
    ids.Add(41);
    if (drawn) state->RecordSamples(ids);
    return state;
  };
  // Step `step`: seq 1 from `start`, its row feeding its last sample and `tokens` after it.
  auto feed = [](uint64_t step, int32_t start, std::vector<int32_t> tokens) {
    v1::StepPlan q;
    q.set_step_id(step);
    AddRow(&q, 1, start, std::move(tokens), true);
    q.add_row_feeds_sample(true);
    return q;
  };
  auto expect_bad = [](const absl::Status& s, const std::string& want) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(want), std::string::npos) << "want '" << want << "' in: " << s.message();
  };
  // A worker that does not both embed and sample.
  expect_bad(prefilled(false, true)->Apply(feed(2, 3, {0}), &batch, &sampling), "only the workers of a group of one stage");
  // No sample drawn yet.
  expect_bad(prefilled(true, false)->Apply(feed(2, 3, {0}), &batch, &sampling), "this worker holds none for it");
  // More than the one token.
  expect_bad(prefilled(true, true)->Apply(feed(2, 3, {0, 5}), &batch, &sampling), "its last sample and 1 more tokens");
  // A sample of another position: the coordinator fed 41 itself, so the next row has none.
  std::unique_ptr<PersistentBatch> state = prefilled(true, true);
  v1::StepPlan known = feed(2, 3, {41});
  known.set_row_feeds_sample(0, false);
  ASSERT_TRUE(state->Apply(known, &batch, &sampling).ok());
  expect_bad(state->Apply(feed(3, 4, {0}), &batch, &sampling), "that sample is the token at position 3");
  // Flags not one per row.
  v1::StepPlan two_flags = feed(2, 3, {0});
  two_flags.add_row_feeds_sample(false);
  expect_bad(prefilled(true, true)->Apply(two_flags, &batch, &sampling), "row_feeds_sample has 2 flags for 1 rows");
}

}  // namespace
}  // namespace shardserve
