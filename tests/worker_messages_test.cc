// coordinator/cluster/worker_messages.h: what the coordinator checks in a worker's StepResult
// (Register's checks are exercised through the pool in worker_pool_test). Each refusal names the
// step and what is wrong; the valid result beside it is accepted.
#include "coordinator/cluster/worker_messages.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

namespace shardserve {
namespace {

// Step 7's answer from the sampler: 2 rows, the second with 1 top logprob.
v1::StepResult Answer() {
  v1::StepResult r;
  r.set_step_id(7);
  r.add_sampled_ids(0);
  r.add_sampled_ids(99);
  r.add_logprobs()->set_logprob(-1.0f);
  v1::RowLogprobs* l = r.add_logprobs();
  l->set_logprob(-0.5f);
  l->add_top_ids(99);
  l->add_top_logprobs(-0.5f);
  r.set_forward_seconds(0.25);
  return r;
}

void ExpectRefused(const absl::Status& s, const std::string& names) {
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("step 7 " + names), std::string::npos) << s.message();
}

TEST(WorkerMessagesTest, StepResultRowsIdsAndTimings) {
  EXPECT_TRUE(CheckStepResult(Answer(), 2, 2, 100).ok());
  ExpectRefused(CheckStepResult(Answer(), 3, 2, 100), "came back with 2 sampled ids, expected 3");
  ExpectRefused(CheckStepResult(Answer(), 2, 0, 100), "came back with 2 logprob rows, expected 0");
  ExpectRefused(CheckStepResult(Answer(), 2, 2, 99), "sampled id 99 outside the vocabulary [0, 99)");

  // A draft model's guesses (StepResult.draft_ids): as many as the plan asked, in the vocabulary.
  v1::StepResult drafted = Answer();
  for (int32_t id : {5, 6, 7, 99}) drafted.add_draft_ids(id);
  EXPECT_TRUE(CheckStepResult(drafted, 2, 2, 100, 4).ok());
  ExpectRefused(CheckStepResult(Answer(), 2, 2, 100, 4), "came back with 0 draft ids, expected 4");
  ExpectRefused(CheckStepResult(drafted, 2, 2, 100), "came back with 4 draft ids, expected 0");
  ExpectRefused(CheckStepResult(drafted, 2, 2, 99, 4), "sampled id 99");
  drafted.set_sampled_ids(1, 3);
  drafted.mutable_logprobs(1)->set_top_ids(0, 3);
  ExpectRefused(CheckStepResult(drafted, 2, 2, 99, 4), "draft id 99 outside the vocabulary [0, 99)");

  v1::StepResult r = Answer();
  r.mutable_logprobs(1)->add_top_ids(3);  // one more id than logprobs
  ExpectRefused(CheckStepResult(r, 2, 2, 100), "has a malformed logprob row");
  r = Answer();
  r.mutable_logprobs(0)->set_logprob(std::nanf(""));
  ExpectRefused(CheckStepResult(r, 2, 2, 100), "has a malformed logprob row");
  r = Answer();
  r.mutable_logprobs(1)->set_top_ids(0, -1);
  ExpectRefused(CheckStepResult(r, 2, 2, 100), "logprob id -1");
  r = Answer();
  r.set_collective_seconds(std::numeric_limits<double>::infinity());
  ExpectRefused(CheckStepResult(r, 2, 2, 100), "timings are not finite");
  r = Answer();
  r.set_forward_seconds(-1);
  ExpectRefused(CheckStepResult(r, 2, 2, 100), "timings are not finite and >= 0");
}

// A worker reports the rows whose logits were not finite (worker.proto non_finite_rows): the
// coordinator fails those requests alone, so each index must name one row of the step, once.
TEST(WorkerMessagesTest, NonFiniteRowsAreAscendingRowsOfTheStep) {
  v1::StepResult r = Answer();
  r.add_non_finite_rows(0);
  r.add_non_finite_rows(1);
  EXPECT_TRUE(CheckStepResult(r, 2, 2, 100).ok());
  r = Answer();
  r.add_non_finite_rows(2);
  ExpectRefused(CheckStepResult(r, 2, 2, 100), "non-finite row 2 is not ascending inside [0, 2)");
  r = Answer();
  r.add_non_finite_rows(-1);
  ExpectRefused(CheckStepResult(r, 2, 2, 100), "non-finite row -1");
  r = Answer();
  r.add_non_finite_rows(1);
  r.add_non_finite_rows(1);
  ExpectRefused(CheckStepResult(r, 2, 2, 100), "non-finite row 1 is not ascending");
  r = Answer();
  r.add_non_finite_rows(0);  // from a worker that samples nothing
  ExpectRefused(CheckStepResult(r, 0, 0, 100), "came back with 2 sampled ids");
  r.clear_sampled_ids();
  r.clear_logprobs();
  ExpectRefused(CheckStepResult(r, 0, 0, 100), "non-finite row 0 is not ascending inside [0, 0)");
}

}  // namespace
}  // namespace shardserve
