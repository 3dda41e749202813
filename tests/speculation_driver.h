// Drives a worker (StepExecutor) that proposes its own guesses (a draft model, the MTP layer, an
// EAGLE-3 head: StepResult.draft_ids) through the coordinator's Scheduler and DraftProposer as the
// engine drives them, for the tests of those proposers (draft_runner_test, mtp_runner_test,
// eagle3_test): the plans ask for guesses, the results bring them back, the proposer serves them at
// the sequence's next decode. Greedy throughout.
#ifndef SHARDSERVE_TESTS_SPECULATION_DRIVER_H_
#define SHARDSERVE_TESTS_SPECULATION_DRIVER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/scheduler/proposer.h"
#include "coordinator/scheduler/scheduler.h"
#include "gtest/gtest.h"
#include "tests/one_worker.h"
#include "worker/step_executor.h"

namespace shardserve {

struct SpeculationOutcome {
  std::map<uint64_t, std::vector<int32_t>> outputs;
  SpeculationStats spec;
  int64_t offers = 0, cached_prompt_tokens = 0;
};

struct Drive {
  StepLimits limits;
  bool speculate = false;
  int guesses = 0;           // a step's guesses a sequence, when speculating
  int64_t vocab = 0;         // every guess is an id below this
  int64_t max_tokens = 0;    // each prompt's
  uint64_t second_at = 6;    // the step at which the second prompt comes (its prefix cached by then)
  int64_t max_running = 0;   // no guesses while this many sequences run (0: no limit)
};

// Called for each sampling row's guesses: the sequence, its tokens so far (the sample included), the
// guesses, the row among the step's sampling rows (from 1) and their count.
using GuessCheck = std::function<void(uint64_t seq, const std::vector<int32_t>& tokens,
                                      const std::vector<int32_t>& guesses, int row, int rows)>;

// Runs the prompts (seq i + 1, the second from step d.second_at) for d.max_tokens each through
// `worker`; `check`, when given, sees every row's guesses.
inline void RunRequests(StepExecutor* worker, const Drive& d, const std::vector<std::vector<int32_t>>& prompts,
                        SpeculationOutcome* run, const GuessCheck& check = nullptr) {
  DraftProposer proposer;
  SchedulerOptions o;
  o.limits = d.limits;
  o.proposer = d.speculate ? &proposer : nullptr;
  o.num_speculative_tokens = d.speculate ? d.guesses : 0;
  o.speculative_max_running = d.max_running;
  Scheduler sched(o);
  v1::RowSampling greedy;
  SeqOptions so;
  for (size_t i = 0; i < prompts.size(); ++i) {
    so.max_len = static_cast<int64_t>(prompts[i].size()) + d.max_tokens;
    if (i != 1) sched.Add(i + 1, prompts[i], greedy, so);
  }
  v1::StepPlan plan;
  v1::StepResult result;
  for (uint64_t step = 1; step < 500; ++step) {
    if (step == d.second_at && prompts.size() > 1) {
      so.max_len = static_cast<int64_t>(prompts[1].size()) + d.max_tokens;
      sched.Add(2, prompts[1], greedy, so);
    }
    const MicroBatch* b = sched.Schedule(0, step, &plan);
    if (b == nullptr) break;
    const std::vector<MicroBatch::Entry> entries = b->entries;
    const int draft_tokens = b->draft_tokens;
    EXPECT_EQ(plan.num_draft_tokens(), draft_tokens);
    plan.set_epoch(worker->epoch());
    for (const v1::NewSeq& n : plan.new_seqs()) {
      EXPECT_EQ(n.cached_token_ids_size(), d.speculate ? n.num_cached_tokens() : 0);
      if (n.seq_id() == 2) run->cached_prompt_tokens = n.num_cached_tokens();
    }
    const absl::Status st = worker->Execute(plan, &result);
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_EQ(result.draft_ids_size(), b->draft_ids);
    const std::vector<int32_t> sampled(result.sampled_ids().begin(), result.sampled_ids().end());
    const std::vector<SampledToken> tokens = sched.Complete(0, sampled);
    int row = 0, rows = 0;
    for (const MicroBatch::Entry& e : entries) rows += e.logit_row >= 0 ? 1 : 0;
    for (const MicroBatch::Entry& e : entries) {
      if (e.logit_row < 0 || draft_tokens == 0) continue;
      const std::vector<int32_t> guesses(result.draft_ids().begin() + row * draft_tokens,
                                         result.draft_ids().begin() + (row + 1) * draft_tokens);
      ++row;
      for (int32_t g : guesses) ASSERT_TRUE(g >= 0 && g < d.vocab) << g;
      if (check) {
        check(e.seq, sched.tokens(e.seq), guesses, row, rows);
        if (::testing::Test::HasFatalFailure()) return;
      }
      proposer.Offer(e.seq, sched.num_tokens(e.seq), guesses);
      ++run->offers;
    }
    for (const SampledToken& t : tokens) {
      std::vector<int32_t>& out = run->outputs[t.seq];
      if (static_cast<int64_t>(out.size()) == d.max_tokens) continue;
      out.push_back(t.token);
      if (static_cast<int64_t>(out.size()) == d.max_tokens) {
        sched.Remove(t.seq);
        proposer.Forget(t.seq);
      }
    }
  }
  EXPECT_EQ(sched.num_running() + sched.num_waiting(), 0);
  run->spec = sched.speculation();
}

}  // namespace shardserve

#endif  // SHARDSERVE_TESTS_SPECULATION_DRIVER_H_
