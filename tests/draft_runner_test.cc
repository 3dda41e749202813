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
#include "tests/speculation_driver.h"
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
  v1::Assignment a = WholeModelAssignment(kDemo, 4, Limits());
  a.set_draft_model_path(draft);
  return CpuWorker(a);
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

// The engine's drive of the worker: the second prompt from step 3.
Drive Driven(bool speculate) {
  return {.limits = Limits(), .speculate = speculate, .guesses = kGuesses, .vocab = 4096, .max_tokens = 24,
          .second_at = 3};
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
  SpeculationOutcome want, got;
  RunRequests(plain->get(), Driven(false), Prompts(), &want);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  RunRequests(drafted->get(), Driven(true), Prompts(), &got);
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
  SpeculationOutcome want, got;
  RunRequests(plain->get(), Driven(false), Prompts(), &want);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  // After every step, each sequence's guesses are those of a fresh draft fed its tokens.
  RunRequests(drafted->get(), Driven(true), Prompts(), &got,
              [&](uint64_t seq, const std::vector<int32_t>& tokens, const std::vector<int32_t>& guesses, int, int) {
                ASSERT_EQ(guesses, fresh.Guesses(tokens, static_cast<int>(guesses.size()))) << "seq " << seq;
              });
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
