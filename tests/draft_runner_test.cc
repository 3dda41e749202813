// Speculative decoding's draft model on the worker that samples (worker/draft_runner.h, run by
// StepExecutor): a whole-model CPU worker of the demo model (models/demo) with a draft loaded from
// Assignment.draft_model_path, driven by the coordinator's Scheduler and DraftProposer as the
// engine drives them (the plans ask for guesses, the results bring them back, the proposer serves
// them at the sequence's next decode). Greedy throughout, products in float32.
//
// - The model as its own draft: every guess is accepted, and the outputs are those of the same
//   worker without speculation.
// - A different draft (models/demo-draft): guesses are rejected and rolled back, the outputs stay
//   those without speculation, and after every step the guesses for each sequence equal those of a
//   fresh draft (a ModelShard of its own, GreedyGenerate) fed exactly the sequence's tokens: the
//   draft's cache, cut back after rejections and fed again, holds the sequence's own tokens. Two
//   sequences share a prefix, so the second starts from the prefix cache (NewSeq.cached_token_ids).
// - A draft whose vocabulary is not the model's is refused, naming both.
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/scheduler/proposer.h"
#include "coordinator/scheduler/scheduler.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "model/config.h"
#include "model/weight_source.h"
#include "worker/comm/rendezvous.h"
#include "worker/communicator.h"
#include "worker/draft_runner.h"
#include "worker/shard/greedy.h"
#include "worker/shard/model_shard.h"
#include "worker/step_executor.h"

namespace shardserve {
namespace {

const std::string kDemo = std::string(SHARDSERVE_SOURCE_DIR) + "/models/demo";
const std::string kDemoDraft = std::string(SHARDSERVE_SOURCE_DIR) + "/models/demo-draft";

constexpr int kGuesses = 4;

StepLimits Limits() {
  return StepLimits{.max_tokens_per_step = 32, .max_seqs_per_step = 8, .block_size = 4, .num_kv_blocks = 64,
                    .max_model_len = 64};
}

absl::StatusOr<std::unique_ptr<StepExecutor>> Worker(const std::string& draft) {
  v1::Assignment a;
  a.set_worker_id("w0");
  a.set_model_path(kDemo);
  a.set_stage(0);
  a.set_num_stages(1);
  a.set_tp_rank(0);
  a.set_tp_size(1);
  a.set_first_layer(0);
  a.set_end_layer(4);
  ToProto(Limits(), a.mutable_limits());
  a.set_collective_timeout_seconds(10);
  a.set_draft_model_path(draft);
  InMemoryRendezvousStore store;  // unused: every group has one rank
  return StepExecutor::Create(a, "cpu", &store, "127.0.0.1", {.cpu_matmul = CpuMatMul::kF32});
}

// A fresh draft: the draft checkpoint alone in a ModelShard of its own.
struct FreshDraft {
  std::unique_ptr<Backend> backend = MakeCpuBackend(0, CpuMatMul::kF32);
  std::unique_ptr<Communicator> tp;
  std::unique_ptr<ModelShard> shard;

  explicit FreshDraft(const std::string& dir) {
    absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
    EXPECT_TRUE(config.ok()) << config.status();
    absl::StatusOr<std::unique_ptr<WeightSource>> weights = OpenWeightSource(dir, *config, LoadFormat::kAuto, 0, true);
    EXPECT_TRUE(weights.ok()) << weights.status();
    tp = std::make_unique<LocalCommunicator>(backend.get());
    StepLimits l = Limits();
    l.max_model_len = 96;
    l.num_kv_blocks = 24;
    absl::StatusOr<std::unique_ptr<ModelShard>> s = ModelShard::Load(**weights, *config, ShardSpec{}, l,
                                                                     backend.get(), tp.get());
    EXPECT_TRUE(s.ok()) << s.status();
    if (s.ok()) shard = std::move(*s);
  }
  // Its k greedy tokens after `tokens`.
  std::vector<int32_t> Guesses(const std::vector<int32_t>& tokens, int k) {
    absl::StatusOr<std::vector<int32_t>> out = GreedyGenerate(shard.get(), tokens, k);
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? *out : std::vector<int32_t>{};
  }
};

struct Outcome {
  std::map<uint64_t, std::vector<int32_t>> outputs;
  SpeculationStats spec;
  int64_t offers = 0, cached_prompt_tokens = 0;
};

// Runs the prompts (the second after the first's prompt has been computed, so that it finds its
// shared prefix in the cache) for `max_tokens` each through `worker` like the engine; with a
// draft, checks each step's guesses against `fresh` (when not null).
void RunRequests(StepExecutor* worker, bool speculate, const std::vector<std::vector<int32_t>>& prompts,
                 int64_t max_tokens, FreshDraft* fresh, Outcome* run) {
  DraftProposer proposer;
  SchedulerOptions o;
  o.limits = Limits();
  o.proposer = speculate ? &proposer : nullptr;
  o.num_speculative_tokens = speculate ? kGuesses : 0;
  o.speculative_max_running = 0;
  Scheduler sched(o);
  v1::RowSampling greedy;
  SeqOptions so;
  for (size_t i = 0; i < prompts.size(); ++i) {
    so.max_len = static_cast<int64_t>(prompts[i].size()) + max_tokens;
    if (i != 1) sched.Add(i + 1, prompts[i], greedy, so);
  }
  v1::StepPlan plan;
  v1::StepResult result;
  for (uint64_t step = 1; step < 500; ++step) {
    if (step == 3) {
      so.max_len = static_cast<int64_t>(prompts[1].size()) + max_tokens;
      sched.Add(2, prompts[1], greedy, so);
    }
    const MicroBatch* b = sched.Schedule(0, step, &plan);
    if (b == nullptr) break;
    const std::vector<MicroBatch::Entry> entries = b->entries;
    const int draft_tokens = b->draft_tokens;
    EXPECT_EQ(plan.num_draft_tokens(), draft_tokens);
    plan.set_epoch(worker->epoch());
    for (const v1::NewSeq& n : plan.new_seqs()) {
      EXPECT_EQ(n.cached_token_ids_size(), speculate ? n.num_cached_tokens() : 0);
      if (n.seq_id() == 2) run->cached_prompt_tokens = n.num_cached_tokens();
    }
    const absl::Status st = worker->Execute(plan, &result);
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_EQ(result.draft_ids_size(), b->draft_ids);
    const std::vector<int32_t> sampled(result.sampled_ids().begin(), result.sampled_ids().end());
    const std::vector<SampledToken> tokens = sched.Complete(0, sampled);
    int row = 0;
    for (const MicroBatch::Entry& e : entries) {
      if (e.logit_row < 0 || draft_tokens == 0) continue;
      const std::vector<int32_t> guesses(result.draft_ids().begin() + row * draft_tokens,
                                         result.draft_ids().begin() + (row + 1) * draft_tokens);
      ++row;
      if (fresh != nullptr) {
        ASSERT_EQ(guesses, fresh->Guesses(sched.tokens(e.seq), draft_tokens)) << "seq " << e.seq << " step " << step;
      }
      proposer.Offer(e.seq, sched.num_tokens(e.seq), guesses);
      ++run->offers;
    }
    for (const SampledToken& t : tokens) {
      std::vector<int32_t>& out = run->outputs[t.seq];
      if (static_cast<int64_t>(out.size()) == max_tokens) continue;
      out.push_back(t.token);
      if (static_cast<int64_t>(out.size()) == max_tokens) {
        sched.Remove(t.seq);
        proposer.Forget(t.seq);
      }
    }
  }
  EXPECT_EQ(sched.num_running() + sched.num_waiting(), 0);
  run->spec = sched.speculation();
}

// Three prompts; the first two share their first 12 tokens (three blocks of 4).
std::vector<std::vector<int32_t>> Prompts() {
  const std::vector<int32_t> shared = {0, 1017, 392, 261, 1120, 11, 287, 2216, 74, 264, 1391, 13};
  std::vector<int32_t> a = shared, b = shared;
  for (int32_t t : {300, 301, 17}) a.push_back(t);
  for (int32_t t : {2048, 99}) b.push_back(t);
  return {a, b, {0, 52, 1999, 3000, 7}};
}

TEST(DraftRunnerTest, TheModelAsItsOwnDraftIsAlwaysRight) {
  absl::StatusOr<std::unique_ptr<StepExecutor>> plain = Worker("");
  ASSERT_TRUE(plain.ok()) << plain.status();
  absl::StatusOr<std::unique_ptr<StepExecutor>> drafted = Worker(kDemo);
  ASSERT_TRUE(drafted.ok()) << drafted.status();
  Outcome want, got;
  RunRequests(plain->get(), false, Prompts(), 24, nullptr, &want);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  RunRequests(drafted->get(), true, Prompts(), 24, nullptr, &got);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  EXPECT_EQ(got.outputs, want.outputs);
  EXPECT_GT(got.offers, 0);
  EXPECT_GT(got.spec.proposed, 0);
  EXPECT_EQ(got.spec.accepted, got.spec.proposed) << "the model guessing its own greedy tokens";
  EXPECT_EQ(got.cached_prompt_tokens, 12);
}

TEST(DraftRunnerTest, AfterRejectionsTheGuessesAreAFreshDraftsOnTheSameTokens) {
  absl::StatusOr<std::unique_ptr<StepExecutor>> plain = Worker("");
  ASSERT_TRUE(plain.ok()) << plain.status();
  absl::StatusOr<std::unique_ptr<StepExecutor>> drafted = Worker(kDemoDraft);
  ASSERT_TRUE(drafted.ok()) << drafted.status();
  FreshDraft fresh(kDemoDraft);
  ASSERT_NE(fresh.shard, nullptr);
  Outcome want, got;
  RunRequests(plain->get(), false, Prompts(), 24, nullptr, &want);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  RunRequests(drafted->get(), true, Prompts(), 24, &fresh, &got);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  EXPECT_EQ(got.outputs, want.outputs);
  EXPECT_GT(got.spec.accepted, 0) << "the draft never agreed with the model";
  EXPECT_LT(got.spec.accepted, got.spec.proposed) << "no guess was rejected: nothing was rolled back";
  EXPECT_EQ(got.cached_prompt_tokens, 12);
  std::printf("[ draft    ] proposed %lld, accepted %lld in %lld verifications\n",
              static_cast<long long>(got.spec.proposed), static_cast<long long>(got.spec.accepted),
              static_cast<long long>(got.spec.verifications));
}

TEST(DraftRunnerTest, ADraftWithAnotherVocabularyIsRefused) {
  const std::string other = std::string(SHARDSERVE_SOURCE_DIR) + "/tests/fixtures/models/llama_gqa";
  absl::StatusOr<std::unique_ptr<StepExecutor>> w = Worker(other);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument) << w.status();
  EXPECT_NE(w.status().message().find(other), std::string::npos) << w.status();
  EXPECT_NE(w.status().message().find("4096"), std::string::npos) << w.status();
}

}  // namespace
}  // namespace shardserve
