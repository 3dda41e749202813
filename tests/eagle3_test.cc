// Speculative decoding with an EAGLE-3 head (worker/head_runner.h, --speculative eagle3) on
// tests/fixtures/models/llama_gqa_eagle3, a head for tests/fixtures/models/llama_gqa written by
// tools/fixtures/make_eagle3_fixture.py. transformers does not run EAGLE-3 heads: the script computes
// what the head must guess itself, in double precision, from vLLM's formulas (its guesses.json).
// What must hold, and what these tests check:
//
// - config.json as the published heads write it is read (draft_vocab_size, target_hidden_size,
//   eagle_config's layers) and what this server cannot run is refused, naming the field; a head that
//   does not fit the model is refused, naming what differs.
// - A worker with the head, given the golden prompt in one step, samples the model's first greedy
//   token and returns the script's three guesses: the model's hidden states kept at layers 1, 2 and 4,
//   fc, the head's layer over the next token's embedding (the model's: the head has none), its own
//   output fed back for the later guesses, and d2t mapping its vocabulary to the model's.
// - Driven as the engine drives it (prompts prefilled in chunks, one from the prefix cache), its
//   greedy outputs are those of the same worker without speculation, and its guesses are accepted
//   and rejected both.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "model/config.h"
#include "nlohmann/json.hpp"
#include "tests/speculation_driver.h"
#include "worker/step_executor.h"

namespace shardserve {
namespace {

namespace fs = std::filesystem;

const fs::path kFixtures = fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/models";
const std::string kModel = (kFixtures / "llama_gqa").string();
const std::string kHead = (kFixtures / "llama_gqa_eagle3").string();

constexpr int kGuesses = 3;

StepLimits Limits(int64_t tokens_per_step) {
  return StepLimits{.max_tokens_per_step = tokens_per_step, .max_seqs_per_step = 4, .block_size = 4,
                    .num_kv_blocks = 64, .max_model_len = 64};
}

// A CPU worker of llama_gqa, with the EAGLE-3 head at `head` (none: "") over its layers 1, 2 and 4.
absl::StatusOr<std::unique_ptr<StepExecutor>> Worker(const StepLimits& limits, const std::string& head,
                                                     const std::vector<int64_t>& kept = {1, 2, 4}) {
  v1::Assignment a = WholeModelAssignment(kModel, 5, limits);
  if (!head.empty()) {
    a.set_speculative_eagle3(true);
    a.set_draft_model_path(head);
    for (int64_t layer : kept) a.add_aux_hidden_layers(layer);
  }
  return CpuWorker(a);
}

Drive Driven(const StepLimits& limits, bool speculate, int64_t max_tokens) {
  return {.limits = limits, .speculate = speculate, .guesses = kGuesses, .vocab = 512, .max_tokens = max_tokens};
}

nlohmann::json ReadJson(const fs::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

TEST(Eagle3Test, TheHeadsConfigIsReadAsPublished) {
  absl::StatusOr<ModelConfig> head = LoadModelConfig(kHead);
  ASSERT_TRUE(head.ok()) << head.status();
  ASSERT_TRUE(head->eagle3.has_value());
  EXPECT_EQ(head->vocab_size, 384);  // its LM head's: draft_vocab_size
  EXPECT_EQ(head->eagle3->embedding_vocab_size, 512);
  EXPECT_EQ(head->eagle3->target_hidden_size, 64);
  EXPECT_EQ(head->eagle3->aux_layers, (std::vector<int64_t>{1, 2, 4}));
  absl::StatusOr<ModelConfig> model = LoadModelConfig(kModel);
  ASSERT_TRUE(model.ok()) << model.status();
  absl::StatusOr<std::vector<int64_t>> aux = Eagle3AuxLayers(*head, *model);
  ASSERT_TRUE(aux.ok()) << aux.status();
  EXPECT_EQ(*aux, (std::vector<int64_t>{1, 2, 4}));

  const nlohmann::json base = ReadJson(fs::path(kHead) / "config.json");
  auto parse = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = base;
    edit(j);
    return ParseModelConfig(j.dump(), "config.json");
  };
  // Without eagle_config's list, the layers are (2, L / 2, L - 3): for this model's 5, (2, 2, 2).
  absl::StatusOr<ModelConfig> plain = parse([](nlohmann::json& j) { j.erase("eagle_config"); });
  ASSERT_TRUE(plain.ok()) << plain.status();
  aux = Eagle3AuxLayers(*plain, *model);
  ASSERT_FALSE(aux.ok());
  EXPECT_NE(aux.status().message().find("layers 2, 2, 2 (2, L / 2, L - 3"), std::string::npos) << aux.status();
  ModelConfig wide = *model;
  wide.hidden_size = 128;
  aux = Eagle3AuxLayers(*head, wide);
  ASSERT_FALSE(aux.ok());
  EXPECT_NE(aux.status().message().find("target_hidden_size"), std::string::npos) << aux.status();
  ModelConfig wider_head = *head;  // its fc reads the model's states, but its own width is not the model's
  wider_head.hidden_size = 96;
  aux = Eagle3AuxLayers(wider_head, *model);
  ASSERT_FALSE(aux.ok());
  EXPECT_NE(aux.status().message().find("hidden_size 96 is not the served model's 64"), std::string::npos)
      << aux.status();
  ModelConfig other_vocab = *model;
  other_vocab.vocab_size = 1000;
  EXPECT_FALSE(Eagle3AuxLayers(*head, other_vocab).ok());

  const std::pair<std::function<void(nlohmann::json&)>, const char*> refused[] = {
      {[](nlohmann::json& j) { j["num_hidden_layers"] = 2; }, "num_hidden_layers"},
      {[](nlohmann::json& j) { j["eagle_config"]["use_aux_hidden_state"] = false; }, "use_aux_hidden_state"},
      {[](nlohmann::json& j) { j["draft_vocab_size"] = 600; }, "draft_vocab_size"},
      {[](nlohmann::json& j) { j["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = {1, "two"}; },
       "eagle_aux_hidden_state_layer_ids"},
      {[](nlohmann::json& j) { j["target_hidden_size"] = 0; }, "target_hidden_size"},
  };
  for (const auto& [edit, field] : refused) {
    absl::StatusOr<ModelConfig> c = parse(edit);
    ASSERT_FALSE(c.ok()) << field;
    EXPECT_NE(c.status().message().find(field), std::string::npos) << c.status();
  }
  // Its token ids are the served model's, not its LM head's: an eos_token_id past draft_vocab_size is
  // the model's id (the published head for Llama-3.1-8B: eos 128001, 32,000 ids of 128,256 guessed).
  absl::StatusOr<ModelConfig> published =
      LoadModelConfig(fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/configs/eagle3-llama-3.1-8b.json");
  ASSERT_TRUE(published.ok()) << published.status();
  EXPECT_EQ(published->vocab_size, 32000);
  EXPECT_EQ(published->eagle3->embedding_vocab_size, 128256);
  EXPECT_EQ(published->eos_token_ids, (std::vector<int64_t>{128001}));
  absl::StatusOr<ModelConfig> past = parse([](nlohmann::json& j) { j["eos_token_id"] = 512; });
  ASSERT_FALSE(past.ok());
  EXPECT_NE(past.status().message().find("outside the vocabulary [0, 512)"), std::string::npos) << past.status();
}

TEST(Eagle3Test, TheHeadsGuessesAreTheReferences) {
  const nlohmann::json golden = ReadJson(fs::path(kHead) / "guesses.json");
  const std::vector<int32_t> prompt = golden.at("prompt_ids").get<std::vector<int32_t>>();
  const StepLimits limits = Limits(16);  // the prompt in one step
  absl::StatusOr<std::unique_ptr<StepExecutor>> worker = Worker(limits, kHead);
  ASSERT_TRUE(worker.ok()) << worker.status();
  EXPECT_NE((*worker)->draft_summary().find("EAGLE-3 head"), std::string::npos) << (*worker)->draft_summary();
  EXPECT_NE((*worker)->draft_summary().find("layers 1, 2, 4"), std::string::npos) << (*worker)->draft_summary();
  // (the head has no embedding: it looks tokens up in the model's, which this one worker holds whole)
  EXPECT_NE((*worker)->draft_summary().find("the model's embedding shared"), std::string::npos)
      << (*worker)->draft_summary();
  std::vector<std::vector<int32_t>> first;
  SpeculationOutcome run;
  RunRequests(worker->get(), Driven(limits, true, 4), {prompt}, &run,
              [&](uint64_t, const std::vector<int32_t>& tokens, const std::vector<int32_t>& guesses, int, int) {
                if (first.empty()) first = {tokens, guesses};
              });
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_EQ(first.size(), 2u);
  ASSERT_EQ(first[0].size(), prompt.size() + 1) << "the prompt was not one step";
  EXPECT_EQ(first[0].back(), golden.at("first_sample").get<int32_t>());
  EXPECT_EQ(first[1], golden.at("guesses").get<std::vector<int32_t>>());
}

// Hugging Face's golden prompt, one sharing its first 8 tokens, and a third; longer than a step's 8
// tokens, so that they are prefilled in chunks.
std::vector<std::vector<int32_t>> Prompts(const std::vector<int32_t>& golden) {
  std::vector<int32_t> b(golden.begin(), golden.begin() + 8);
  for (int32_t t : {5, 6, 7, 166, 166}) b.push_back(t);
  return {golden, b, {3, 9, 27, 81, 243, 200, 100, 50, 25, 12, 6}};
}

TEST(Eagle3Test, GreedyOutputsAreThoseWithout) {
  const nlohmann::json golden = ReadJson(fs::path(kModel) / "golden.json");
  const std::vector<int32_t> prompt = golden.at("prompt_ids").get<std::vector<int32_t>>();
  const std::vector<int32_t> hf = golden.at("greedy_ids").get<std::vector<int32_t>>();
  const StepLimits limits = Limits(8);
  absl::StatusOr<std::unique_ptr<StepExecutor>> plain = Worker(limits, "");
  ASSERT_TRUE(plain.ok()) << plain.status();
  absl::StatusOr<std::unique_ptr<StepExecutor>> head = Worker(limits, kHead);
  ASSERT_TRUE(head.ok()) << head.status();
  SpeculationOutcome want, got;
  RunRequests(plain->get(), Driven(limits, false, 24), Prompts(prompt), &want);
  ASSERT_FALSE(HasFatalFailure());
  RunRequests(head->get(), Driven(limits, true, 24), Prompts(prompt), &got);
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_EQ(got.outputs, want.outputs);
  EXPECT_EQ(got.outputs[1], std::vector<int32_t>(hf.begin(), hf.begin() + 24));
  EXPECT_GT(got.offers, 0);
  EXPECT_GT(got.spec.accepted, 0) << "the head never agreed with the model";
  EXPECT_LT(got.spec.accepted, got.spec.proposed) << "no guess was rejected: nothing was rolled back";
  EXPECT_EQ(got.cached_prompt_tokens, 8);
  EXPECT_EQ((*head)->head_runner()->starved(), 0) << "the head's pool holds every sequence's positions";
  std::printf("[ eagle3   ] proposed %lld, accepted %lld in %lld verifications\n",
              static_cast<long long>(got.spec.proposed), static_cast<long long>(got.spec.accepted),
              static_cast<long long>(got.spec.verifications));
}

// While the batch is large enough that no sequence guesses (speculative_max_running), the head runs
// nothing: those positions are holes in its cache. The second prompt comes while the others run, so
// it decodes its first tokens without guesses and guesses over its holes once it runs alone; the
// outputs stay those without the head.
TEST(Eagle3Test, StepsWithoutGuessesRunNoHead) {
  const nlohmann::json golden = ReadJson(fs::path(kModel) / "golden.json");
  const StepLimits limits = Limits(8);
  absl::StatusOr<std::unique_ptr<StepExecutor>> plain = Worker(limits, "");
  ASSERT_TRUE(plain.ok()) << plain.status();
  absl::StatusOr<std::unique_ptr<StepExecutor>> head = Worker(limits, kHead);
  ASSERT_TRUE(head.ok()) << head.status();
  Drive drive = Driven(limits, true, 24);
  drive.max_running = 3;
  const std::vector<std::vector<int32_t>> prompts = Prompts(golden.at("prompt_ids").get<std::vector<int32_t>>());
  SpeculationOutcome want, got, every;
  RunRequests(plain->get(), Driven(limits, false, 24), prompts, &want);
  ASSERT_FALSE(HasFatalFailure());
  RunRequests(head->get(), drive, prompts, &got);
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_EQ(got.outputs, want.outputs);
  const HeadRunner* runner = (*head)->head_runner();
  EXPECT_GT(runner->idle_steps(), 0) << "every step asked for guesses";
  EXPECT_GT(got.offers, 0) << "no sequence guessed once the batch shrank";
  // A worker guessing in every step runs the head more often.
  absl::StatusOr<std::unique_ptr<StepExecutor>> always = Worker(limits, kHead);
  ASSERT_TRUE(always.ok()) << always.status();
  RunRequests(always->get(), Driven(limits, true, 24), prompts, &every);
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_EQ(every.outputs, want.outputs);
  EXPECT_EQ((*always)->head_runner()->idle_steps(), 0);
  EXPECT_GT((*always)->head_runner()->forwards(), runner->forwards());
  std::printf("[ eagle3   ] idle steps %lld; proposed %lld, accepted %lld (every step: %lld of %lld)\n",
              static_cast<long long>(runner->idle_steps()), static_cast<long long>(got.spec.proposed),
              static_cast<long long>(got.spec.accepted), static_cast<long long>(every.spec.accepted),
              static_cast<long long>(every.spec.proposed));
}

// With --load-format dummy (benchmarks of the machinery without checkpoints) the head is made from
// its config.json alone, as the model is: a directory with nothing else serves, and guesses come
// back (in the model's vocabulary: d2t is the identity then).
TEST(Eagle3Test, ADummyHeadFromItsConfigAloneRuns) {
  char pattern[] = "/tmp/eagle3_test.XXXXXX";
  const fs::path dir = mkdtemp(pattern);
  fs::copy_file(fs::path(kHead) / "config.json", dir / "config.json");
  const StepLimits limits = Limits(8);
  v1::Assignment a = WholeModelAssignment(kModel, 5, limits);
  a.set_load_format(v1::LOAD_FORMAT_DUMMY);
  a.set_dummy_seed(7);
  a.set_speculative_eagle3(true);
  a.set_draft_model_path(dir.string());
  for (int64_t layer : {1, 2, 4}) a.add_aux_hidden_layers(layer);
  absl::StatusOr<std::unique_ptr<StepExecutor>> worker = CpuWorker(a);
  ASSERT_TRUE(worker.ok()) << worker.status();
  const nlohmann::json golden = ReadJson(fs::path(kModel) / "golden.json");
  SpeculationOutcome run;
  RunRequests(worker->get(), Driven(limits, true, 8), Prompts(golden.at("prompt_ids").get<std::vector<int32_t>>()),
              &run);
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_GT(run.offers, 0);
  EXPECT_GT(run.spec.proposed, 0);
  EXPECT_EQ(run.outputs.size(), 3u);
  std::error_code ec;
  fs::remove_all(dir, ec);
}

TEST(Eagle3Test, AHeadThatDoesNotFitIsRefused) {
  // A model for a head: refused, naming the architecture.
  absl::StatusOr<std::unique_ptr<StepExecutor>> worker = Worker(Limits(8), kModel);
  ASSERT_FALSE(worker.ok());
  EXPECT_NE(worker.status().message().find("takes an EAGLE-3 head"), std::string::npos) << worker.status();
  // Workers that keep the model's hidden states at other layers than the head reads: refused, naming
  // both lists.
  worker = Worker(Limits(8), kHead, {1, 3, 4});
  ASSERT_FALSE(worker.ok());
  EXPECT_NE(worker.status().message().find("layers 1, 2, 4 but the workers keep layers 1, 3, 4"), std::string::npos)
      << worker.status();
}

}  // namespace
}  // namespace shardserve
