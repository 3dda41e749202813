// The coordinator and the workers together: real shardserve-coordinator and shardserve-worker
// processes on 127.0.0.1, driven through the client API.
//
// - Parity: for every fixture and every layout the model allows (TP in {1, 2} inside a node, PP in
//   {1, 2, 3} nodes), the cluster's greedy tokens equal Hugging Face's (golden.json). Exact
//   equality, no tolerance: every layout computes in float32 (worker --matmul-dtype f32, also for
//   the bf16 checkpoint, whose golden tokens are float32's) and only the order of summation
//   differs (the TP all-reduce adds partial sums), which moves logits by ~1e-6 relative while the
//   smallest gap between the top two logits along any golden sequence is 2e-3.
// - Chunked prefill: a prompt longer than a step gives the tokens of a single-process run.
// - The client API on one cluster: streaming, usage, finish reasons, stop ids, seeded sampling,
//   bad requests, model info, cluster status.
// - Failures: a worker killed (SIGKILL) or stopped (SIGSTOP) in the middle of a generation, with no
//   replacement, ends the stream with UNAVAILABLE naming it once the heal times out (here
//   --heal-timeout-seconds 2; tests/heal_test.cc covers replacements); the coordinator reports
//   NOT_SERVING, refuses new requests with the same message and keeps running.
// - A numeric failure of one sequence (its logits not finite: tests/overflowing_fixture.h) ends
//   that request with INTERNAL saying so; the request streaming beside it, and later ones, get
//   their golden tokens, and the group stays SERVING in the same epoch.
//
// Every process runs in its own process group and dies with the test (PR_SET_PDEATHSIG); every
// wait is bounded; teardown kills and reaps every child.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <functional>
#include <latch>
#include <map>
#include <memory>
#include <ostream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "coordinator/planner/format.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/quant_isa.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/sharding.h"
#include "nlohmann/json.hpp"
#include "shardserve/v1/inference.grpc.pb.h"
#include "tests/cluster_harness.h"
#include "tests/overflowing_fixture.h"
#include "worker/communicator.h"
#include "worker/shard/greedy.h"
#include "worker/shard/model_shard.h"

namespace shardserve {
namespace {

// The Cluster and Generate() are in tests/cluster_harness.h; tests/harness_test.cc tests its processes.

// ---- Parity with Hugging Face, every layout ---------------------------------------------------------

struct Layout {
  std::string fixture;
  int tp;
  int pp;
};

void PrintTo(const Layout& l, std::ostream* os) { *os << "TP=" << l.tp << " PP=" << l.pp << " " << l.fixture; }

std::vector<Layout> Layouts() {
  // The fixtures' layer counts (checked against config.json by the test): PP may not exceed them.
  const std::vector<std::pair<std::string, int>> fixtures = {
      {"llama3_rope", 2}, {"llama_bf16", 3}, {"llama_gqa", 5}, {"mistral_sharded", 4}, {"qwen2_tied_bias", 3},
      // config.json as transformers 5 writes it (rope_parameters, dtype, layer_types); Qwen3 in both
      // formats; Phi-3's fused tensors; Mistral's sliding window; the RoPE types (LongRoPE crossing
      // its original context, partial rotary, yarn, linear, dynamic).
      {"llama3_rope_tf5", 2}, {"qwen2_tf5", 3}, {"qwen3_tf5", 3}, {"qwen3_tf4", 2}, {"phi3_tf5", 3},
      {"mistral_window_tf5", 2}, {"gemma2_tf5", 4}, {"phi3_longrope_tf5", 2}, {"phi4_mini_tf5", 2},
      {"llama_yarn_tf5", 2}, {"llama_linear_tf5", 2}, {"llama_dynamic_tf5", 2},
      // Gemma 3: q/k norms, five sliding layers to one global, a RoPE per layer type; both formats.
      {"gemma3_tf5", 6}, {"gemma3_tf4", 4},
      // Mixtures of experts, each expert's intermediate size split over the TP group: Qwen3-MoE
      // with 5 experts, 2 a token, a dense layer among sparse ones (mlp_only_layers), and with 7, 3 a
      // token, dense and sparse layers in turn (decoder_sparse_step 2), bf16 weights.
      {"qwen3_moe_tf5", 3}, {"qwen3_moe_bf16_tf5", 4},
      // Mixtral: experts in every layer, 3 of 2 a token (float32) and 5 of 3 (bf16 weights).
      {"mixtral_tf5", 2}, {"mixtral_bf16_tf5", 3},
      // Qwen2-MoE: the shared expert gated per token beside 5 experts of 2 (float32) and 7 of 3 (bf16).
      {"qwen2_moe_tf5", 3}, {"qwen2_moe_bf16_tf5", 4},
      // DeepSeek-V3: latent attention (its latent cache whole on every TP rank, the heads split)
      // with q_lora_rank and YaRN, and without q_lora_rank; the sigmoid group-limited router with
      // shared experts after a dense layer.
      {"deepseek_v3_tf5", 3}, {"deepseek_v3_bf16_tf5", 3},
      // GLM-4.5: that router under Llama-shaped attention with partial rotary, with q/k/v biases and
      // q/k norms (float32) and without (bf16 weights, n_group 1, 2 dense layers).
      {"glm4_moe_tf5", 3}, {"glm4_moe_bf16_tf5", 4},
      // gpt-oss: attention sinks, sliding and full layers in turn, experts with biases and the
      // clamped SwiGLU (their down bias added once over the TP group), float32, bf16 weights and
      // MXFP4 experts.
      {"gpt_oss_tf5", 3}, {"gpt_oss_bf16_tf5", 4}, {"gpt_oss_mxfp4_tf5", 2},
      // Gemma 3 as published (Gemma3ForConditionalGeneration): its text model, tensors under
      // language_model.model. (transformers 5) and model.language_model. (4.52-4.57).
      {"gemma3_cg_tf5", 6}, {"gemma3_cg_tf4", 4}};
  std::vector<Layout> out;
  for (const auto& [name, layers] : fixtures) {
    for (int tp : {1, 2}) {
      for (int pp : {1, 2, 3}) {
        if (pp <= layers) out.push_back({name, tp, pp});
      }
    }
  }
  return out;
}

// What worker `i` of `cluster` logged of its memory (StepExecutor::MemoryReport's lines "memory NAME:
// planned P B ..., measured M B ..."): name -> (planned, measured), for the items it measures.
std::map<std::string, std::pair<int64_t, int64_t>> LoggedMemory(Cluster& cluster, int i) {
  std::ifstream log(cluster.worker(i).log());
  std::map<std::string, std::pair<int64_t, int64_t>> items;
  const std::regex line(R"(memory (\w+): planned (-?\d+) B .*, measured (-?\d+) B)");
  for (std::string text; std::getline(log, text);) {
    std::smatch match;
    if (std::regex_search(text, match, line)) {
      items[match[1].str()] = {std::stoll(match[2].str()), std::stoll(match[3].str())};
    }
  }
  return items;
}

class ClusterParityTest : public ::testing::TestWithParam<Layout> {};

TEST_P(ClusterParityTest, GreedyTokensMatchHuggingFace) {
  const Layout& l = GetParam();
  std::ifstream config_file(kFixtures / l.fixture / "config.json");
  const nlohmann::json config = nlohmann::json::parse(config_file);
  const nlohmann::json& text = config.contains("text_config") ? config["text_config"] : config;  // a multimodal model's
  ASSERT_GE(text["num_hidden_layers"].get<int>(), l.pp) << "the layout table is stale";
  const Golden golden = LoadGolden(l.fixture);
  Cluster cluster({l.fixture, l.pp, l.tp, {"--matmul-dtype", "f32"}});
  ASSERT_TRUE(cluster.Start());

  const Streamed r = Generate(cluster.client(), TokenRequest(golden.prompt, 32));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message() << "\n" << cluster.Logs();
  EXPECT_EQ(r.tokens, golden.greedy);
  ASSERT_FALSE(r.messages.empty());
  EXPECT_EQ(r.messages.back().finish_reason(), v1::FINISH_REASON_LENGTH);
  std::printf("[ timing   ] TP=%d PP=%d %s: cluster up in %.2f s, 32 tokens in %.2f s\n", l.tp, l.pp,
              l.fixture.c_str(), cluster.start_seconds(), r.seconds);
}

INSTANTIATE_TEST_SUITE_P(Layouts, ClusterParityTest, ::testing::ValuesIn(Layouts()),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return "TP" + std::to_string(info.param.tp) + "_PP" + std::to_string(info.param.pp) + "_" +
                                  info.param.fixture;
                         });

// CPU workers hold what their plan says: their weights as planned to the byte, in float32 products or
// bf16 ones (worker --matmul-dtype, which the worker tells the coordinator at Register: the products'
// weights in half the bytes, the rest float32), and their own memory beside their buffers within the
// plan's "process" item (planner/memory.h: the coordinator's reserve for CPU workers and the load's
// staging), which each logs beside its RssAnon less its weights, KV cache and step buffers: a dense
// model across TP, a mixture of experts across PP, and in bf16 the latter, a tied table and every
// way of loading a product (Qwen2-MoE's shared expert and its gate, MLA's projections, gpt-oss's
// stacked experts with their biases, Phi-3's rows picked from fused tensors, Gemma's norms). (The
// process not under a sanitizer, whose shadow memory is the process's too.)
TEST(ClusterMemoryTest, CpuWorkersHoldWhatTheirPlanSays) {
  struct Case {
    Layout layout;
    const char* matmul;
  };
  for (const Case& c : {Case{{"llama3_rope", 2, 1}, "f32"}, Case{{"qwen3_moe_tf5", 1, 2}, "f32"},
                        Case{{"qwen3_moe_tf5", 1, 2}, "bf16"}, Case{{"qwen2_tied_bias", 1, 1}, "bf16"},
                        Case{{"qwen2_moe_tf5", 1, 1}, "bf16"}, Case{{"deepseek_v3_tf5", 1, 1}, "bf16"},
                        Case{{"gpt_oss_tf5", 1, 1}, "bf16"}, Case{{"phi3_tf5", 1, 1}, "bf16"},
                        Case{{"gemma3_tf5", 1, 1}, "bf16"}}) {
    const Layout& l = c.layout;
    const std::string where = absl::StrCat(l.fixture, " TP=", l.tp, " PP=", l.pp, " ", c.matmul);
    const Golden golden = LoadGolden(l.fixture);
    Cluster cluster({l.fixture, l.pp, l.tp, {"--matmul-dtype", c.matmul}});
    ASSERT_TRUE(cluster.Start()) << where;
    const Streamed r = Generate(cluster.client(), TokenRequest(golden.prompt, 8));
    ASSERT_TRUE(r.status.ok()) << where << ": " << r.status.error_message() << "\n" << cluster.Logs();
    for (int i = 0; i < cluster.num_workers(); ++i) {
      std::map<std::string, std::pair<int64_t, int64_t>> items = LoggedMemory(cluster, i);
      for (const char* name : {"weights", "process"}) {
        ASSERT_TRUE(items.count(name)) << where << " worker " << i << " logged no memory " << name << "\n"
                                       << cluster.Logs();
      }
      EXPECT_EQ(items["weights"].first, items["weights"].second) << where << " worker " << i;
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
      const auto [planned, measured] = items["process"];
      EXPECT_GT(measured, 0) << where << " worker " << i;
      EXPECT_LE(measured, planned) << where << " worker " << i << "\n" << cluster.Logs();
      std::printf("[ memory   ] %s worker %d: process %.1f MiB of %.1f MiB planned\n", where.c_str(), i,
                  measured / 1048576.0, planned / 1048576.0);
#endif
    }
  }
}

// Speculative decoding's proposers on CPU workers hold what their plan says, to the byte: a draft
// model (its weights, KV cache and step buffers), the multi-token-prediction layer and an EAGLE-3
// head, with float32 products and with bf16 ones, whose weights the workers pack in bf16 through the
// same backend as the model's, so that the plan counts them so too (PlanOptions::products_dtype).
TEST(ClusterMemoryTest, CpuWorkersHoldTheProposersTheirPlanSays) {
  struct Case {
    std::string model;
    std::vector<std::string> flags;
    const char* item;
  };
  const fs::path source(SHARDSERVE_SOURCE_DIR);
  for (const Case& c :
       {Case{(source / "models/demo").string(),
             {"--speculative", "draft", "--draft-model", (source / "models/demo-draft").string(),
              "--num-speculative-tokens", "4"},
             "draft_model"},
        Case{"deepseek_v3_mtp_tf5", {"--speculative", "mtp", "--num-speculative-tokens", "3"}, "mtp_layer"},
        Case{"glm4_moe_mtp_tf5", {"--speculative", "mtp", "--num-speculative-tokens", "3"}, "mtp_layer"},
        Case{"llama_gqa",
             {"--speculative", "eagle3", "--draft-model", (source / "tests/fixtures/models/llama_gqa_eagle3").string(),
              "--num-speculative-tokens", "3"},
             "eagle3_head"}}) {
    std::map<std::string, int64_t> planned;
    for (const char* matmul : {"f32", "bf16"}) {
      const std::string where = absl::StrCat(c.item, " ", matmul);
      Cluster cluster({c.model, 1, 1, {"--matmul-dtype", matmul}}, c.flags);
      ASSERT_TRUE(cluster.Start()) << where;
      std::map<std::string, std::pair<int64_t, int64_t>> items = LoggedMemory(cluster, 0);
      ASSERT_TRUE(items.count(c.item)) << where << ": the worker logged no memory " << c.item << "\n" << cluster.Logs();
      EXPECT_GT(items[c.item].first, 0) << where;
      EXPECT_EQ(items[c.item].first, items[c.item].second) << where << " (planned, measured)";
      planned[matmul] = items[c.item].first;
    }
    EXPECT_LT(planned["bf16"], planned["f32"]) << c.item << ": bf16 products planned in no fewer bytes";
  }
}

// bf16 CPU products (worker --matmul-dtype bf16) give one process's outputs in every layout: PP = 2
// (a worker of one thread a stage) the greedy tokens of PP = 1 (one worker of two threads) and, bit
// for bit, their logprobs, on a model with a tied LM head and one without. Every weight is in the
// layout its product runs with whatever OpenMP count the loading thread held (once, a stage's
// products by the second and later weights of a shape ran with the first one's layout, and PP = 2's
// tokens were others from the first), and a last stage's copy of a tied table multiplies as one
// stage's own table does (Backend::PackTiedTable: the CPU's float32 panels; it was a bf16 product
// there). The layers' outputs pass between the stages unchanged.
TEST(ClusterParityTest, Bf16ProductsGiveOneProcesssOutputsInEveryLayout) {
  for (const std::string fixture : {"qwen2_tied_bias", "llama_gqa"}) {
    const Golden golden = LoadGolden(fixture);
    std::vector<Streamed> runs;
    for (int pp : {1, 2}) {
      Cluster cluster({fixture, pp, 1, {"--matmul-dtype", "bf16"}});
      ASSERT_TRUE(cluster.Start()) << fixture << " PP=" << pp;
      v1::GenerateRequest request = TokenRequest(golden.prompt, 16);
      request.mutable_sampling()->set_logprobs(true);
      runs.push_back(Generate(cluster.client(), request));
      ASSERT_TRUE(runs.back().status.ok()) << fixture << " PP=" << pp << ": " << runs.back().status.error_message()
                                           << "\n" << cluster.Logs();
    }
    EXPECT_EQ(runs[1].tokens, runs[0].tokens) << fixture;
    std::vector<float> logprobs[2];
    for (int i = 0; i < 2; ++i) {
      for (const v1::GenerateResponse& m : runs[i].messages) {
        for (const v1::TokenLogprobs& t : m.logprobs()) logprobs[i].push_back(t.logprob());
      }
    }
    ASSERT_EQ(logprobs[0].size(), 16u) << fixture;
    EXPECT_EQ(logprobs[1], logprobs[0]) << fixture << ": PP=2's logprobs are not PP=1's";
  }
}

// ---- Prompt log-probabilities --------------------------------------------------------------------

// The log-softmax of `logits` at `id`, in double.
double LogSoftmaxAt(const std::vector<float>& logits, int32_t id) {
  const double max = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - max);
  return static_cast<double>(logits[static_cast<size_t>(id)]) - max - std::log(sum);
}

// A prompt's log-probabilities (SamplingParams.prompt_logprobs) in TP {1, 2} x PP {1, 2}: the golden
// prompt followed by Hugging Face's 32 greedy tokens is scored, with 8 logit rows and 16 tokens a
// step (so its chunks are cut by the rows) while a decode of the golden prompt with logprobs runs
// beside it. Every prompt token after the first gets its entry; the greedy tokens' equal the
// decode's (rank 1, the same alternatives; the prefill's arithmetic differs from the decode's in
// the order of its sums, hence 1e-4), and at the two positions whose logits the fixture holds
// (after the prompt, at the 32nd decode step) Hugging Face's log-softmax, within twice the parity
// tests' logits tolerance (1e-4 of the largest logit: a log-probability is a logit less the log of
// the sum, each off by at most that).
class ClusterPromptLogprobsTest : public ::testing::TestWithParam<Layout> {};

TEST_P(ClusterPromptLogprobsTest, PromptLogprobsAreHuggingFacesAndTheDecodesOwn) {
  const Layout& l = GetParam();
  const Golden golden = LoadGolden(l.fixture);
  Cluster cluster({l.fixture, l.pp, l.tp, {"--matmul-dtype", "f32"}},
                  {"--max-num-seqs", "8", "--max-tokens-per-step", "16"});
  ASSERT_TRUE(cluster.Start());
  std::vector<int32_t> prompt = golden.prompt;
  prompt.insert(prompt.end(), golden.greedy.begin(), golden.greedy.end());
  v1::GenerateRequest score = TokenRequest(prompt, 2);
  score.mutable_sampling()->set_prompt_logprobs(3);
  v1::GenerateRequest decode = TokenRequest(golden.prompt, 32);
  decode.mutable_sampling()->set_logprobs(true);
  decode.mutable_sampling()->set_top_logprobs(3);
  Streamed decoded;
  std::thread beside([&] { decoded = Generate(cluster.client(), decode); });
  const Streamed scored = Generate(cluster.client(), score);
  beside.join();
  ASSERT_TRUE(decoded.status.ok()) << decoded.status.error_message() << "\n" << cluster.Logs();
  ASSERT_TRUE(scored.status.ok()) << scored.status.error_message() << "\n" << cluster.Logs();
  EXPECT_EQ(decoded.tokens, golden.greedy);
  std::vector<v1::TokenLogprobs> got, want;
  for (size_t i = 0; i < scored.messages.size(); ++i) {
    EXPECT_TRUE(i == 0 || scored.messages[i].prompt_logprobs_size() == 0) << "message " << i << " has prompt logprobs";
    got.insert(got.end(), scored.messages[i].prompt_logprobs().begin(), scored.messages[i].prompt_logprobs().end());
  }
  for (const v1::GenerateResponse& m : decoded.messages) want.insert(want.end(), m.logprobs().begin(), m.logprobs().end());
  ASSERT_EQ(got.size(), prompt.size() - 1);
  ASSERT_EQ(want.size(), golden.greedy.size());
  for (size_t i = 0; i < got.size(); ++i) {
    const v1::TokenLogprobs& g = got[i];
    EXPECT_EQ(g.token_id(), prompt[i + 1]) << "position " << i;
    ASSERT_EQ(g.top_logprobs_size(), 3) << "position " << i;
    EXPECT_LE(g.logprob(), g.top_logprobs(0).logprob()) << "position " << i;
    EXPECT_GE(g.rank(), 1) << "position " << i;
    EXPECT_EQ(g.rank() == 1, g.top_logprobs(0).token_id() == g.token_id()) << "position " << i;
  }
  const size_t first = golden.prompt.size() - 1;  // the position after which the first greedy token comes
  for (size_t j = 0; j < want.size(); ++j) {
    const v1::TokenLogprobs& g = got[first + j];
    EXPECT_EQ(g.rank(), 1) << "greedy token " << j;
    EXPECT_NEAR(g.logprob(), want[j].logprob(), 1e-4) << "greedy token " << j;
    for (int k = 0; k < 3; ++k) {
      EXPECT_EQ(g.top_logprobs(k).token_id(), want[j].top_logprobs(k).token_id()) << "greedy token " << j << " top " << k;
    }
  }
  for (const auto& [at, logits] : {std::pair{first, &golden.prompt_last_logits},
                                   std::pair{first + golden.greedy.size() - 1, &golden.final_logits}}) {
    const double hf = LogSoftmaxAt(*logits, prompt[at + 1]);
    const double scale = std::max(std::abs(*std::max_element(logits->begin(), logits->end())),
                                  std::abs(*std::min_element(logits->begin(), logits->end())));
    EXPECT_NEAR(got[at].logprob(), hf, 2 * 1e-4 * scale) << "position " << at << " against Hugging Face";
    std::printf("[ parity   ] TP=%d PP=%d %s: prompt logprob at position %zu %.6f, Hugging Face's %.6f\n", l.tp,
                l.pp, l.fixture.c_str(), at, got[at].logprob(), hf);
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, ClusterPromptLogprobsTest,
                         ::testing::Values(Layout{"llama_gqa", 1, 1}, Layout{"llama_gqa", 2, 1},
                                           Layout{"llama_gqa", 1, 2}, Layout{"llama_gqa", 2, 2},
                                           Layout{"qwen3_tf5", 2, 2}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return "TP" + std::to_string(info.param.tp) + "_PP" + std::to_string(info.param.pp) + "_" +
                                  info.param.fixture;
                         });

// ---- Expert parallelism: whole experts per rank, the same tokens ----------------------------------

// Every MoE fixture with --expert-parallel (worker/shard/expert_plan.h): each TP rank holds a block
// of whole experts and the tokens travel to them and back by all-to-all, then an all-gather joins
// the ranks' slices of the tokens. The greedy tokens are Hugging Face's, the same tokens the layouts
// above give with the experts cut (so identical with and without the flag), exactly: every layout
// computes in float32 and only the order of summation differs (an expert's whole down_proj instead
// of partial sums added by the all-reduce), within the margin the parity test's comment gives.
// The fixtures have 3, 5, 6, 7 and 9 experts: TP=2 splits 5, 7 and 9 unevenly (2 + 3, 3 + 4, 4 + 5), and
// TP=4 (1 KV head per 2 ranks) splits 5 as 1 + 1 + 1 + 2, 7 as 1 + 2 + 2 + 2 and 9 as 2 + 2 + 2 + 3. TP=3
// is not a layout any fixture allows (4 attention heads). gpt-oss's experts carry their biases (the
// down bias whole on the expert's rank), also at TP=1, where the flag changes nothing. DeepSeek-V3's
// (9 and 6 experts) come with group-limited routing and shared experts, whole on every rank, beside
// latent attention cut by heads; GLM-4.5's (6 and 5) with the same router beside Llama-shaped attention.
std::vector<Layout> ExpertParallelLayouts() {
  std::vector<Layout> out;
  for (const char* f : {"qwen3_moe_tf5", "qwen3_moe_bf16_tf5", "mixtral_tf5", "mixtral_bf16_tf5", "qwen2_moe_tf5",
                        "qwen2_moe_bf16_tf5", "deepseek_v3_tf5", "deepseek_v3_bf16_tf5", "glm4_moe_tf5",
                        "glm4_moe_bf16_tf5"}) {
    out.push_back({f, 2, 1});
    out.push_back({f, 2, 2});
  }
  for (const char* f : {"gpt_oss_tf5", "gpt_oss_bf16_tf5", "gpt_oss_mxfp4_tf5"}) {
    out.push_back({f, 2, 1});
    out.push_back({f, 2, 2});
  }
  out.push_back({"gpt_oss_tf5", 1, 1});
  out.push_back({"gpt_oss_tf5", 1, 2});
  out.push_back({"qwen3_moe_tf5", 4, 1});
  out.push_back({"qwen2_moe_bf16_tf5", 4, 1});
  out.push_back({"gpt_oss_bf16_tf5", 4, 1});
  out.push_back({"deepseek_v3_tf5", 4, 1});
  return out;
}

class ClusterExpertParallelTest : public ::testing::TestWithParam<Layout> {};

TEST_P(ClusterExpertParallelTest, GreedyTokensMatchHuggingFace) {
  const Layout& l = GetParam();
  const Golden golden = LoadGolden(l.fixture);
  Cluster cluster({l.fixture, l.pp, l.tp, {"--matmul-dtype", "f32"}}, {"--expert-parallel"});
  ASSERT_TRUE(cluster.Start());
  const Streamed r = Generate(cluster.client(), TokenRequest(golden.prompt, 32));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message() << "\n" << cluster.Logs();
  EXPECT_EQ(r.tokens, golden.greedy);
  // The workers hold whole experts, a block each: with an uneven split (5 or 7 experts) the ranks
  // of a stage with sparse layers hold different weight bytes, where cut experts give them the
  // same (a stage of dense layers only, qwen2_moe_tf5's last, holds no experts).
  std::ifstream config_file(kFixtures / l.fixture / "config.json");
  const nlohmann::json config = nlohmann::json::parse(config_file);
  int64_t experts = 0;
  for (const char* key : {"num_local_experts", "num_experts", "n_routed_experts"}) {
    if (config.contains(key)) experts = config[key].get<int64_t>();
  }
  ASSERT_GT(experts, 0) << l.fixture << ": no expert count in config.json";
  std::map<int, std::set<int64_t>> bytes_by_stage;
  const v1::ClusterStatus status = cluster.Status();
  for (const v1::WorkerStatus& w : status.workers()) bytes_by_stage[w.stage()].insert(w.weight_bytes());
  ASSERT_EQ(bytes_by_stage.size(), static_cast<size_t>(l.pp));
  // Each worker counted rows only for the experts it holds (its block), and every stage with
  // sparse layers counted some; the all-to-alls were timed.
  for (const v1::WorkerStatus& w : status.workers()) {
    const std::map<std::string, double> m = ParseSamples(HttpGetMetrics(w.metrics_address()));
    const Range mine = ExpertRange(experts, w.tp_rank(), l.tp);
    for (int64_t e = 0; e < experts; ++e) {
      const double rows = Sum(m, "shardserve_worker_expert_rows_total", {"expert=\"" + std::to_string(e) + "\""});
      if (e < mine.begin || e >= mine.end) {
        EXPECT_EQ(rows, 0) << "rank " << w.tp_rank() << " expert " << e;
      }
    }
    if (bytes_by_stage.size() == 1) {
      EXPECT_GT(Sum(m, "shardserve_worker_expert_rows_total", {}), 0) << "rank " << w.tp_rank();
      EXPECT_GT(Sum(m, "shardserve_worker_collective_seconds_count", {"op=\"all_to_all\""}), 0);
    }
  }
  bool uneven_stage = false;
  for (const auto& [stage, bytes] : bytes_by_stage) uneven_stage = uneven_stage || bytes.size() > 1;
  EXPECT_EQ(uneven_stage, experts % l.tp != 0) << experts << " experts over TP=" << l.tp;
  // Several sequences in one step too: prompts of different lengths, so that the ranks' slices
  // of a step's tokens hold parts of different sequences, and decode steps of fewer tokens than
  // ranks leave a rank with none.
  std::vector<Streamed> together(3);
  {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < together.size(); ++i) {
      threads.emplace_back([&, i] {
        const std::vector<int32_t> prompt(golden.prompt.begin(), golden.prompt.end() - static_cast<long>(i));
        together[i] = Generate(cluster.client(), TokenRequest(prompt, 8));
      });
    }
    for (std::thread& t : threads) t.join();
  }
  ASSERT_TRUE(together[0].status.ok()) << together[0].status.error_message() << "\n" << cluster.Logs();
  EXPECT_EQ(together[0].tokens, std::vector<int32_t>(golden.greedy.begin(), golden.greedy.begin() + 8));
  for (const Streamed& t : together) EXPECT_TRUE(t.status.ok()) << t.status.error_message();
  std::printf("[ timing   ] EP TP=%d PP=%d %s: cluster up in %.2f s, 32 tokens in %.2f s\n", l.tp, l.pp,
              l.fixture.c_str(), cluster.start_seconds(), r.seconds);
}

INSTANTIATE_TEST_SUITE_P(Layouts, ClusterExpertParallelTest, ::testing::ValuesIn(ExpertParallelLayouts()),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return "TP" + std::to_string(info.param.tp) + "_PP" + std::to_string(info.param.pp) + "_" +
                                  info.param.fixture;
                         });

// ---- Speculative decoding: outputs unchanged in every layout ----------------------------------------

// The coordinator speculates with the n-gram proposer (docs/speculative-decoding.md): the workers
// score a decoding sequence's guesses in one step and sample at each position. Greedy tokens stay
// Hugging Face's in TP {1, 2} x PP {1, 2}: the golden request, the same prompt continued by the
// first 12 golden tokens (the rest of the golden tokens follow), a request whose max_tokens and one
// whose stop token end it inside an accepted run (nothing after it is returned), all at once so
// that steps verify guesses of several sequences and decodes without guesses side by side, and
// the logprobs of a request carry one entry per token. Guesses were made and some accepted.
class ClusterSpeculationTest : public ::testing::TestWithParam<Layout> {};

TEST_P(ClusterSpeculationTest, NgramGuessesKeepHuggingFacesGreedyTokens) {
  const Layout& l = GetParam();
  const Golden golden = LoadGolden(l.fixture);
  ASSERT_GE(golden.greedy.size(), 32u);
  Cluster cluster({l.fixture, l.pp, l.tp, {"--matmul-dtype", "f32"}},
                  {"--speculative", "ngram", "--num-speculative-tokens", "4", "--block-size", "4"});
  ASSERT_TRUE(cluster.Start());
  std::vector<v1::GenerateRequest> requests;
  std::vector<std::vector<int32_t>> want;
  requests.push_back(TokenRequest(golden.prompt, 32));
  want.push_back(golden.greedy);
  std::vector<int32_t> continued = golden.prompt;
  continued.insert(continued.end(), golden.greedy.begin(), golden.greedy.begin() + 12);
  requests.push_back(TokenRequest(continued, 20));
  want.emplace_back(golden.greedy.begin() + 12, golden.greedy.begin() + 32);
  requests.push_back(TokenRequest(golden.prompt, 7));
  want.emplace_back(golden.greedy.begin(), golden.greedy.begin() + 7);
  // The first greedy token past the 10th that did not appear before it stops the fourth.
  size_t k = 10;
  while (std::find(golden.greedy.begin(), golden.greedy.begin() + k, golden.greedy[k]) != golden.greedy.begin() + k) ++k;
  ASSERT_LT(k, 32u);
  requests.push_back(TokenRequest(golden.prompt, 32));
  requests.back().mutable_sampling()->add_stop_token_ids(golden.greedy[k]);
  want.emplace_back(golden.greedy.begin(), golden.greedy.begin() + k + 1);
  requests[1].mutable_sampling()->set_logprobs(true);
  std::vector<Streamed> got(requests.size());
  {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < requests.size(); ++i) {
      threads.emplace_back([&, i] { got[i] = Generate(cluster.client(), requests[i]); });
    }
    for (std::thread& t : threads) t.join();
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(got[i].status.ok()) << i << ": " << got[i].status.error_message() << "\n" << cluster.Logs();
    EXPECT_EQ(got[i].tokens, want[i]) << "request " << i;
  }
  EXPECT_EQ(got[3].messages.back().finish_reason(), v1::FINISH_REASON_STOP_TOKEN);
  EXPECT_EQ(got[2].messages.back().finish_reason(), v1::FINISH_REASON_LENGTH);
  int logprobs = 0;
  for (const v1::GenerateResponse& m : got[1].messages) logprobs += m.logprobs_size();
  EXPECT_EQ(logprobs, 20);
  // Alone, the golden request again: its guesses verified one sequence at a time.
  const Streamed alone = Generate(cluster.client(), requests[0]);
  ASSERT_TRUE(alone.status.ok()) << alone.status.error_message();
  EXPECT_EQ(alone.tokens, golden.greedy);
  // Prompt log-probabilities are not served beside speculation: refused, naming the field.
  v1::GenerateRequest scored = requests[0];
  scored.mutable_sampling()->set_prompt_logprobs(0);
  const Streamed refused = Generate(cluster.client(), scored);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << refused.status.error_message();
  EXPECT_NE(refused.status.error_message().find("sampling.prompt_logprobs"), std::string::npos)
      << refused.status.error_message();
  const v1::SchedulerStatus s = cluster.Status().scheduler();
  EXPECT_EQ(s.speculative(), "ngram");
  EXPECT_GT(s.spec_proposed_tokens(), 0);
  // Mistral's 32 golden tokens never repeat a run of its text, so its guesses are all rejected:
  // every verification rolls back, across the window (accepted runs under windows are
  // speculation_test's).
  if (l.fixture != "mistral_window_tf5") {
    EXPECT_GT(s.spec_accepted_tokens(), 0) << "no guess was ever right";
  }
  EXPECT_LE(s.spec_accepted_tokens(), s.spec_proposed_tokens());
  EXPECT_EQ(s.kv_blocks_free(), s.kv_blocks_total()) << "every block back once the requests ended";
  // The coordinator's Prometheus counters say the same (docs/metrics.md): every accepted guess
  // counted at its position.
  const std::map<std::string, double> m = ParseSamples(HttpGetMetrics(cluster.metrics_address()));
  EXPECT_EQ(Sum(m, "shardserve_spec_proposed_tokens_total", {}), static_cast<double>(s.spec_proposed_tokens()));
  EXPECT_EQ(Sum(m, "shardserve_spec_accepted_tokens_total", {}), static_cast<double>(s.spec_accepted_tokens()));
  EXPECT_EQ(Sum(m, "shardserve_spec_accepted_by_position_total", {}), static_cast<double>(s.spec_accepted_tokens()));
  std::printf("[ timing   ] TP=%d PP=%d %s: speculation proposed %lld, accepted %lld in %lld verifications\n", l.tp,
              l.pp, l.fixture.c_str(), static_cast<long long>(s.spec_proposed_tokens()),
              static_cast<long long>(s.spec_accepted_tokens()), static_cast<long long>(s.spec_verifications()));
}

// Also the sliding windows: Mistral with a 32-token window in every layer, and Gemma 3 with a
// sliding layers' pool beside full-attention layers; their 48-token prompts and 32 generated
// tokens pass the window, so blocks are let go behind it while guesses are verified and rolled
// back.
INSTANTIATE_TEST_SUITE_P(Layouts, ClusterSpeculationTest,
                         ::testing::Values(Layout{"llama_gqa", 1, 1}, Layout{"llama_gqa", 2, 1}, Layout{"llama_gqa", 1, 2},
                                           Layout{"llama_gqa", 2, 2}, Layout{"mistral_window_tf5", 1, 1},
                                           Layout{"mistral_window_tf5", 2, 1}, Layout{"mistral_window_tf5", 1, 2},
                                           Layout{"mistral_window_tf5", 2, 2}, Layout{"gemma3_tf5", 1, 1},
                                           Layout{"gemma3_tf5", 2, 1}, Layout{"gemma3_tf5", 1, 2},
                                           Layout{"gemma3_tf5", 2, 2}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return "TP" + std::to_string(info.param.tp) + "_PP" + std::to_string(info.param.pp) + "_" +
                                  info.param.fixture;
                         });

// Constrained requests speculate too: the coordinator cuts each guess run where the grammar
// refuses it and sends a mask for every sampled position. The demo model (it has a tokenizer, which
// structured outputs need) answers a JSON Schema whose objects repeat their keys, greedy and with a
// seed, and a regular expression that repeats itself: with --speculative ngram every output is the
// one the same cluster gives without it, token for token, and valid under its constraint; guesses
// were made and some accepted.
class ClusterConstrainedSpeculationTest : public ::testing::TestWithParam<Layout> {};

constexpr char kPetsSchema[] =
    R"({"type": "array", "minItems": 3, "maxItems": 3, "items": {"type": "object", "properties":)"
    R"( {"name": {"type": "string", "maxLength": 6}, "id": {"type": "integer", "minimum": 0, "maximum": 99}},)"
    R"( "required": ["name", "id"], "additionalProperties": false}})";
constexpr char kRepeatRegex[] = "(ab, ){3}[a-z]{1,4}\\.";

// Empty when `text` is an array of three objects with exactly a short name and an id in [0, 99].
std::string CheckPets(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_array() || j.size() != 3) return "'" + text + "' is not an array of 3";
  for (const nlohmann::json& pet : j) {
    if (!pet.is_object() || pet.size() != 2 || !pet.contains("name") || !pet["name"].is_string() ||
        pet["name"].get<std::string>().size() > 6 || !pet.contains("id") || !pet["id"].is_number_integer() ||
        pet["id"].get<int64_t>() < 0 || pet["id"].get<int64_t>() > 99) {
      return "'" + text + "': " + pet.dump();
    }
  }
  return "";
}

TEST_P(ClusterConstrainedSpeculationTest, ConstrainedOutputsEqualThoseWithoutSpeculation) {
  const Layout& l = GetParam();
  std::vector<v1::GenerateRequest> requests(3);
  for (size_t i = 0; i < requests.size(); ++i) {
    v1::GenerateRequest& r = requests[i];
    r.set_text(i < 2 ? "Three pets as JSON, each with a name and an id:" : "Say ab three times:");
    r.set_request_id("constrained-" + std::to_string(i));
    r.mutable_sampling()->set_max_tokens(160);
    if (i < 2) {
      r.mutable_sampling()->mutable_structured_output()->set_json_schema(kPetsSchema);
    } else {
      r.mutable_sampling()->mutable_structured_output()->set_regex(kRepeatRegex);
    }
  }
  requests[1].mutable_sampling()->set_temperature(1.0f);
  requests[1].mutable_sampling()->set_seed(7);
  auto run = [&](const std::vector<std::string>& flags, std::vector<Streamed>* out, v1::SchedulerStatus* status) {
    ClusterSpecForTest spec;
    spec.fixture = (fs::path(SHARDSERVE_SOURCE_DIR) / "models/demo").string();
    spec.nodes = l.pp;
    spec.gpus_per_node = l.tp;
    Cluster cluster(std::move(spec), flags);
    ASSERT_TRUE(cluster.Start());
    out->assign(requests.size(), Streamed{});
    std::vector<std::thread> threads;
    for (size_t i = 0; i < requests.size(); ++i) {
      threads.emplace_back([&, i] { (*out)[i] = Generate(cluster.client(), requests[i]); });
    }
    for (std::thread& t : threads) t.join();
    for (size_t i = 0; i < requests.size(); ++i) {
      ASSERT_TRUE((*out)[i].status.ok()) << i << ": " << (*out)[i].status.error_message() << "\n" << cluster.Logs();
    }
    *status = cluster.Status().scheduler();
  };
  std::vector<Streamed> plain, speculated;
  v1::SchedulerStatus plain_status, s;
  run({"--block-size", "4"}, &plain, &plain_status);
  ASSERT_FALSE(HasFatalFailure());
  run({"--block-size", "4", "--speculative", "ngram", "--num-speculative-tokens", "4"}, &speculated, &s);
  ASSERT_FALSE(HasFatalFailure());
  for (size_t i = 0; i < requests.size(); ++i) {
    std::string text;
    for (const v1::GenerateResponse& m : speculated[i].messages) text += m.text();
    EXPECT_EQ(speculated[i].tokens, plain[i].tokens) << "request " << i << ": '" << text << "'";
    EXPECT_EQ(speculated[i].messages.back().finish_reason(), v1::FINISH_REASON_STOP_TOKEN) << "request " << i << ": '" << text << "'";
    if (i < 2) {
      EXPECT_EQ(CheckPets(text), "") << "request " << i;
    } else {
      EXPECT_TRUE(std::regex_match(text, std::regex(kRepeatRegex))) << "'" << text << "' does not match " << kRepeatRegex;
    }
  }
  EXPECT_EQ(plain_status.spec_proposed_tokens(), 0);
  EXPECT_GT(s.spec_proposed_tokens(), 0);
  EXPECT_GT(s.spec_accepted_tokens(), 0) << "no guess of a constrained request was ever right";
  EXPECT_EQ(s.kv_blocks_free(), s.kv_blocks_total()) << "every block back once the requests ended";
  std::printf("[ timing   ] TP=%d PP=%d constrained: speculation proposed %lld, accepted %lld in %lld verifications\n",
              l.tp, l.pp, static_cast<long long>(s.spec_proposed_tokens()), static_cast<long long>(s.spec_accepted_tokens()),
              static_cast<long long>(s.spec_verifications()));
}

INSTANTIATE_TEST_SUITE_P(Layouts, ClusterConstrainedSpeculationTest,
                         ::testing::Values(Layout{"demo", 1, 1}, Layout{"demo", 2, 1}, Layout{"demo", 1, 2},
                                           Layout{"demo", 2, 2}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return "TP" + std::to_string(info.param.tp) + "_PP" + std::to_string(info.param.pp) + "_" +
                                  info.param.fixture;
                         });

// Speculation keeps the outputs: three requests at once (greedy, seeded sampling at 0.8, greedy with
// logprobs), then the first again, whose prompt the prefix cache now holds (so the proposer is sent
// the cached tokens' ids), through a cluster of `model` in layout `l` without speculation and with
// `speculative` (the coordinator's flags): every output the same token for token and as long as its
// request asks; `proposer`'s guesses were made and at least `min_accepted_percent` of them (one at
// least) accepted, and the status names it; the repeat found its prefix cached and every block came
// back. A head (`head_item`, the plan's memory item: mtp_layer or eagle3_head; "" for none) is the
// plan's to the byte on the worker that runs it, the only one that lists it above 0, and every
// worker's step buffers are. Returns the speculating cluster's outputs, the repeat last.
std::vector<Streamed> ExpectSpeculationKeepsTheOutputs(const std::string& model, const Layout& l,
                                                       std::vector<v1::GenerateRequest> requests,
                                                       const std::vector<std::string>& speculative,
                                                       const std::string& proposer, int min_accepted_percent,
                                                       const std::string& head_item = "") {
  for (size_t i = 0; i < requests.size(); ++i) requests[i].set_request_id(proposer + "-" + std::to_string(i));
  requests[1].mutable_sampling()->set_temperature(0.8f);
  requests[1].mutable_sampling()->set_seed(11);
  requests[2].mutable_sampling()->set_logprobs(true);
  auto run = [&](const std::vector<std::string>& flags, std::vector<Streamed>* out, v1::SchedulerStatus* status,
                 bool speculating) {
    Cluster cluster({model, l.pp, l.tp, {"--matmul-dtype", "f32"}}, flags);
    ASSERT_TRUE(cluster.Start());
    out->assign(requests.size() + 1, Streamed{});
    std::vector<std::thread> threads;
    for (size_t i = 0; i < requests.size(); ++i) {
      threads.emplace_back([&, i] { (*out)[i] = Generate(cluster.client(), requests[i]); });
    }
    for (std::thread& t : threads) t.join();
    out->back() = Generate(cluster.client(), requests[0]);  // its prompt's blocks are cached now
    for (size_t i = 0; i < out->size(); ++i) {
      ASSERT_TRUE((*out)[i].status.ok()) << i << ": " << (*out)[i].status.error_message() << "\n" << cluster.Logs();
    }
    *status = cluster.Status().scheduler();
    if (!speculating || head_item.empty()) return;
    int heads = 0;
    for (int i = 0; i < cluster.num_workers(); ++i) {
      std::map<std::string, std::pair<int64_t, int64_t>> items = LoggedMemory(cluster, i);
      for (const std::string& name : {std::string("step_buffers"), head_item}) {
        ASSERT_TRUE(items.count(name)) << "worker " << i << " logged no memory " << name << "\n" << cluster.Logs();
        EXPECT_EQ(items[name].first, items[name].second) << "worker " << i << " " << name;
      }
      heads += items[head_item].first > 0 ? 1 : 0;
    }
    EXPECT_EQ(heads, 1) << "workers planned to hold " << head_item;
  };
  std::vector<Streamed> plain, speculated;
  v1::SchedulerStatus plain_status, s;
  run({"--block-size", "4"}, &plain, &plain_status, false);
  if (::testing::Test::HasFatalFailure()) return speculated;
  std::vector<std::string> flags = {"--block-size", "4"};
  flags.insert(flags.end(), speculative.begin(), speculative.end());
  run(flags, &speculated, &s, true);
  if (::testing::Test::HasFatalFailure()) return speculated;
  for (size_t i = 0; i < plain.size(); ++i) {
    const v1::GenerateRequest& asked = i < requests.size() ? requests[i] : requests[0];  // the repeat last
    EXPECT_EQ(speculated[i].tokens, plain[i].tokens) << "request " << i;
    EXPECT_EQ(speculated[i].tokens.size(), static_cast<size_t>(asked.sampling().max_tokens())) << "request " << i;
  }
  int logprobs = 0;
  for (const v1::GenerateResponse& m : speculated[2].messages) logprobs += m.logprobs_size();
  EXPECT_EQ(logprobs, static_cast<int>(requests[2].sampling().max_tokens()));
  EXPECT_EQ(s.speculative(), proposer);
  EXPECT_GT(s.spec_proposed_tokens(), 0);
  EXPECT_GT(s.spec_accepted_tokens(), 0) << "no guess of " << proposer << " was ever right";
  EXPECT_GE(s.spec_accepted_tokens() * 100, s.spec_proposed_tokens() * min_accepted_percent)
      << proposer << ": " << s.spec_accepted_tokens() << " of " << s.spec_proposed_tokens() << " guesses accepted";
  EXPECT_GT(s.prefix_cache_hit_tokens(), 0) << "the repeated request found no cached prefix";
  EXPECT_EQ(s.kv_blocks_free(), s.kv_blocks_total()) << "every block back once the requests ended";
  std::printf("[ timing   ] TP=%d PP=%d %s: speculation proposed %lld, accepted %lld in %lld verifications\n", l.tp,
              l.pp, proposer.c_str(), static_cast<long long>(s.spec_proposed_tokens()),
              static_cast<long long>(s.spec_accepted_tokens()), static_cast<long long>(s.spec_verifications()));
  return speculated;
}

// Speculation on the demo model, whose language makes guesses meaningful (the worker that samples
// runs the proposer right after sampling and returns its guesses with the step's samples): three
// prompts of King James text, 40 tokens each, through ExpectSpeculationKeepsTheOutputs.
void ExpectDemoGuessesKeepTheOutputs(const Layout& l, const std::vector<std::string>& speculative,
                                     const std::string& proposer, int min_accepted_percent) {
  std::vector<v1::GenerateRequest> requests(3);
  const char* prompts[] = {"And the LORD said unto Moses,", "In the beginning", "Blessed are the"};
  for (size_t i = 0; i < requests.size(); ++i) {
    requests[i].set_text(prompts[i]);
    requests[i].mutable_sampling()->set_max_tokens(40);
    requests[i].mutable_sampling()->set_ignore_eos(true);
  }
  ExpectSpeculationKeepsTheOutputs((fs::path(SHARDSERVE_SOURCE_DIR) / "models/demo").string(), l, std::move(requests),
                                   speculative, proposer, min_accepted_percent);
}

std::string DemoLayoutName(const ::testing::TestParamInfo<Layout>& info) {
  return "TP" + std::to_string(info.param.tp) + "_PP" + std::to_string(info.param.pp) + "_" + info.param.fixture;
}

// The draft model (--speculative draft, docs/speculative-decoding.md), models/demo-draft, in TP {1, 2}
// x PP {1, 2}, a third of its guesses or more right (half of them, about, are). The TP 2 layouts adapt each sequence's guesses
// (--adaptive-speculative-tokens).
class ClusterDraftSpeculationTest : public ::testing::TestWithParam<Layout> {};

TEST_P(ClusterDraftSpeculationTest, DraftGuessesKeepTheOutputs) {
  const Layout& l = GetParam();
  std::vector<std::string> flags = {"--speculative", "draft", "--draft-model",
                                    (fs::path(SHARDSERVE_SOURCE_DIR) / "models/demo-draft").string(),
                                    "--num-speculative-tokens", "4"};
  if (l.tp == 2) flags.push_back("--adaptive-speculative-tokens");
  ExpectDemoGuessesKeepTheOutputs(l, flags, "draft", 33);
}

INSTANTIATE_TEST_SUITE_P(Layouts, ClusterDraftSpeculationTest,
                         ::testing::Values(Layout{"demo", 1, 1}, Layout{"demo", 2, 1}, Layout{"demo", 1, 2},
                                           Layout{"demo", 2, 2}),
                         DemoLayoutName);

// The demo model's trained EAGLE-3 head (--speculative eagle3, models/demo-eagle3) over its real
// hidden states, at TP 1 (where it shares the model's embedding) and TP 2 x PP 2 (where each stage
// keeps its layers' states and passes them on): the outputs unchanged, and a third of its guesses
// or more right.
class ClusterDemoEagle3Test : public ::testing::TestWithParam<Layout> {};

TEST_P(ClusterDemoEagle3Test, TrainedHeadGuessesKeepTheOutputs) {
  ExpectDemoGuessesKeepTheOutputs(GetParam(),
                                  {"--speculative", "eagle3", "--draft-model",
                                   (fs::path(SHARDSERVE_SOURCE_DIR) / "models/demo-eagle3").string(),
                                   "--num-speculative-tokens", "3"},
                                  "eagle3", 33);
}

INSTANTIATE_TEST_SUITE_P(Layouts, ClusterDemoEagle3Test,
                         ::testing::Values(Layout{"demo", 1, 1}, Layout{"demo", 2, 2}), DemoLayoutName);

// Speculation on a test fixture (ExpectSpeculationKeepsTheOutputs, 32 tokens a request): Hugging
// Face's golden prompt twice and a third, the greedy one and its repeat Hugging Face's tokens.
void ExpectGuessesKeepTheOutputs(const Layout& l, const std::vector<std::string>& speculative,
                                 const std::string& proposer, const std::string& head_item) {
  const Golden golden = LoadGolden(l.fixture);
  const std::vector<Streamed> out = ExpectSpeculationKeepsTheOutputs(
      l.fixture, l,
      {TokenRequest(golden.prompt, 32), TokenRequest(golden.prompt, 32),
       TokenRequest({5, 6, 7, 166, 166, 30, 64, 79, 226}, 32)},
      speculative, proposer, 0, head_item);
  if (out.size() != 4) return;  // (a fatal failure, reported)
  EXPECT_EQ(out[0].tokens, golden.greedy);
  EXPECT_EQ(out[3].tokens, golden.greedy);
}

// The model's multi-token-prediction layer (--speculative mtp, docs/speculative-decoding.md):
// DeepSeek-V3 and GLM-4.5 with their MTP layers (tests/fixtures/models/deepseek_v3_mtp_tf5,
// glm4_moe_mtp_tf5), run by the worker that samples over every step's hidden states, in TP {1, 2} x
// PP {1, 2}.
class ClusterMtpSpeculationTest : public ::testing::TestWithParam<Layout> {};

TEST_P(ClusterMtpSpeculationTest, MtpGuessesKeepTheOutputs) {
  ExpectGuessesKeepTheOutputs(GetParam(), {"--speculative", "mtp", "--num-speculative-tokens", "3"}, "mtp",
                              "mtp_layer");
}

INSTANTIATE_TEST_SUITE_P(Layouts, ClusterMtpSpeculationTest,
                         ::testing::Values(Layout{"deepseek_v3_mtp_tf5", 1, 1}, Layout{"deepseek_v3_mtp_tf5", 2, 1},
                                           Layout{"deepseek_v3_mtp_tf5", 1, 2}, Layout{"deepseek_v3_mtp_tf5", 2, 2},
                                           Layout{"glm4_moe_mtp_tf5", 1, 1}, Layout{"glm4_moe_mtp_tf5", 2, 1},
                                           Layout{"glm4_moe_mtp_tf5", 1, 2}, Layout{"glm4_moe_mtp_tf5", 2, 2}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return "TP" + std::to_string(info.param.tp) + "_PP" + std::to_string(info.param.pp) + "_" +
                                  info.param.fixture;
                         });

// An EAGLE-3 head (--speculative eagle3 --draft-model DIR, docs/speculative-decoding.md):
// tests/fixtures/models/llama_gqa_eagle3 over llama_gqa, whose hidden states at layers 1, 2 and 4
// every stage keeps and passes on (with PP 2 the first stage's two and the second's one), run by the
// worker that samples, in TP {1, 2} x PP {1, 2}.
class ClusterEagle3SpeculationTest : public ::testing::TestWithParam<Layout> {};

TEST_P(ClusterEagle3SpeculationTest, HeadGuessesKeepTheOutputs) {
  const std::string head = (fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/models/llama_gqa_eagle3").string();
  ExpectGuessesKeepTheOutputs(
      GetParam(), {"--speculative", "eagle3", "--draft-model", head, "--num-speculative-tokens", "3"}, "eagle3",
      "eagle3_head");
}

INSTANTIATE_TEST_SUITE_P(Layouts, ClusterEagle3SpeculationTest,
                         ::testing::Values(Layout{"llama_gqa", 1, 1}, Layout{"llama_gqa", 2, 1},
                                           Layout{"llama_gqa", 1, 2}, Layout{"llama_gqa", 2, 2}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return "TP" + std::to_string(info.param.tp) + "_PP" + std::to_string(info.param.pp) + "_" +
                                  info.param.fixture;
                         });

// A model without a multi-token-prediction layer asked for --speculative mtp is refused at start
// (exit 1), naming config.json's field; so is a checkpoint whose config.json announces the layer
// but whose files leave its tensors out, naming the first missing one.
TEST(CoordinatorFlagsTest, MtpWithoutTheLayerIsRefused) {
  char pattern[] = "/tmp/cluster_test.XXXXXX";
  const fs::path dir = mkdtemp(pattern);
  const fs::path stripped = dir / "stripped";
  fs::create_directories(stripped);
  fs::copy_file(kFixtures / "deepseek_v3_tf5" / "model.safetensors", stripped / "model.safetensors");
  {
    std::ifstream in(kFixtures / "deepseek_v3_tf5" / "config.json");
    nlohmann::json config = nlohmann::json::parse(in);
    config["num_nextn_predict_layers"] = 1;
    std::ofstream(stripped / "config.json") << config.dump(2);
  }
  const std::vector<std::pair<fs::path, std::string>> cases = {
      {kFixtures / "deepseek_v3_tf5", "has no num_nextn_predict_layers above 0"},
      {kFixtures / "llama_gqa", "has no num_nextn_predict_layers this server reads"},
      {stripped, "has no tensor \"model.layers.3.enorm.weight\" of the multi-token-prediction layer"}};
  for (const auto& [model, want] : cases) {
    const fs::path log = dir / "coordinator.log";
    Process coordinator({SHARDSERVE_COORDINATOR_BIN, "--model", model.string(), "--listen", "127.0.0.1:0",
                         "--insecure", "--speculative", "mtp", "--num-speculative-tokens", "2"},
                        log);
    EXPECT_EQ(coordinator.Wait(std::chrono::seconds(20)), 1) << want << ": " << Tail(log);
    const std::string output = Tail(log, 1 << 16);
    EXPECT_NE(output.find(want), std::string::npos) << want << ": " << output;
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
}

// An EAGLE-3 head is refused at start (exit 1) where it cannot run, naming why: served as the model,
// given to --speculative draft, a model given to --speculative eagle3, a head for another model (its
// fc reads other layers than the model has), a head of another width than the model's, and a head
// without its tensors (the coordinator reads whether it has an embedding of its own).
TEST(CoordinatorFlagsTest, AnEagle3HeadWhereItCannotRunIsRefused) {
  char pattern[] = "/tmp/cluster_test.XXXXXX";
  const fs::path dir = mkdtemp(pattern);
  const std::string head = (kFixtures / "llama_gqa_eagle3").string(), model = (kFixtures / "llama_gqa").string();
  // The fixture head with hidden_size 96 (its fc still reads the model's 64-wide states).
  const fs::path wide_head = dir / "wide_head";
  fs::create_directories(wide_head);
  {
    std::ifstream in(fs::path(head) / "config.json");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::string narrow = "\"hidden_size\": 64";
    const size_t at = text.find(narrow);
    ASSERT_NE(at, std::string::npos) << text;
    text.replace(at, narrow.size(), "\"hidden_size\": 96, \"target_hidden_size\": 64");
    std::ofstream(wide_head / "config.json") << text;
  }
  const fs::path config_only = dir / "config_only";
  fs::create_directories(config_only);
  fs::copy_file(fs::path(head) / "config.json", config_only / "config.json");
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--model", head}, "holds an EAGLE-3 head (LlamaForCausalLMEagle3), not a model to serve"},
      {{"--model", model, "--speculative", "draft", "--draft-model", head}, "is an EAGLE-3 head, which --speculative eagle3 runs"},
      {{"--model", model, "--speculative", "eagle3", "--draft-model", model},
       "is a model (LlamaForCausalLM), not an EAGLE-3 head"},
      {{"--model", (kFixtures / "qwen3_tf5").string(), "--speculative", "eagle3", "--draft-model", head},
       "which are not distinct layers of the model's 3"},
      {{"--model", model, "--speculative", "eagle3", "--draft-model", wide_head.string()},
       "the EAGLE-3 head's hidden_size 96 is not the served model's 64"},
      {{"--model", model, "--speculative", "eagle3", "--draft-model", config_only.string()},
       "no model.safetensors or model.safetensors.index.json"}};
  for (const auto& [flags, want] : cases) {
    const fs::path log = dir / "coordinator.log";
    std::vector<std::string> args = {SHARDSERVE_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--insecure"};
    args.insert(args.end(), flags.begin(), flags.end());
    if (flags.size() > 2) args.insert(args.end(), {"--num-speculative-tokens", "2"});
    Process coordinator(args, log);
    EXPECT_EQ(coordinator.Wait(std::chrono::seconds(20)), 1) << want << ": " << Tail(log);
    const std::string output = Tail(log, 1 << 16);
    EXPECT_NE(output.find(want), std::string::npos) << want << ": " << output;
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
}

// ---- Sliding windows: blocks behind the window go to other sequences ------------------------------------

// Mistral with a 32-token window in every layer: a sequence lets go of the blocks behind its window
// as it advances, and other sequences take them. Six requests of 48 prompt + 32 generated tokens
// (20 blocks of 4 each if every block were kept) sent together to a cache of 24 blocks: a prompt
// takes 12 blocks to admit, then a sequence holds at most 9 (its window and a token), so they run
// side by side with no preemption, where without windows one sequence's 20 blocks leave no room for
// another and sequences are preempted (3 times here). The golden request's greedy tokens are
// Hugging Face's, and every request gets the tokens it gets alone.
class ClusterSlidingWindowTest : public ::testing::TestWithParam<Layout> {};

TEST_P(ClusterSlidingWindowTest, BlocksLetGoAreReusedAndTokensStayHuggingFaces) {
  const Layout& l = GetParam();
  const Golden golden = LoadGolden(l.fixture);
  Cluster cluster({l.fixture, l.pp, l.tp, {"--matmul-dtype", "f32"}},
                  {"--num-kv-blocks", "24", "--block-size", "4", "--max-model-len", "96"});
  ASSERT_TRUE(cluster.Start());
  std::vector<v1::GenerateRequest> requests;
  for (int i = 0; i < 6; ++i) {
    std::vector<int32_t> prompt = golden.prompt;
    for (size_t j = 0; i > 0 && j < prompt.size(); j += 3) prompt[j] = (prompt[j] + 37 * i) % 416;  // vocab_size
    requests.push_back(TokenRequest(prompt, 32));
    requests.back().set_request_id("window-" + std::to_string(i));
  }
  std::vector<Streamed> alone, together(requests.size());
  for (const v1::GenerateRequest& r : requests) {
    alone.push_back(Generate(cluster.client(), r));
    ASSERT_TRUE(alone.back().status.ok()) << alone.back().status.error_message() << "\n" << cluster.Logs();
  }
  EXPECT_EQ(alone[0].tokens, golden.greedy);
  {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < requests.size(); ++i) {
      threads.emplace_back([&, i] { together[i] = Generate(cluster.client(), requests[i]); });
    }
    for (std::thread& t : threads) t.join();
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(together[i].status.ok()) << i << ": " << together[i].status.error_message() << "\n" << cluster.Logs();
    EXPECT_EQ(together[i].tokens, alone[i].tokens) << "request " << i;
  }
  const v1::SchedulerStatus s = cluster.Status().scheduler();
  EXPECT_EQ(s.kv_blocks_total(), 24);
  EXPECT_EQ(s.preemptions(), 0) << "the blocks behind the window were not let go";
  std::printf("[ timing   ] TP=%d PP=%d %s: 6 requests of 80 tokens sent together to 24 blocks of 4, %lld preemptions\n",
              l.tp, l.pp, l.fixture.c_str(), static_cast<long long>(s.preemptions()));
}

INSTANTIATE_TEST_SUITE_P(Layouts, ClusterSlidingWindowTest,
                         ::testing::Values(Layout{"mistral_window_tf5", 1, 1}, Layout{"mistral_window_tf5", 2, 1},
                                           Layout{"mistral_window_tf5", 1, 2}, Layout{"mistral_window_tf5", 2, 2}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return "TP" + std::to_string(info.param.tp) + "_PP" + std::to_string(info.param.pp);
                         });

// Gemma 2 and 3: full-attention layers beside sliding ones (32-token windows), so the sliding layers
// have a KV pool of their own on the workers, and sequences let go of its blocks behind their window.
// Six requests of 48 prompt + 32 generated tokens (20 blocks of 4 each) sent together: the full
// layers' pool of 120 blocks holds all six; the sliding layers' pool is what the coordinator sizes
// beside it for 8 sequences at once (model/kv_blocks.h SlidingPoolBlocks), 74 blocks: 8 x 9 (the 31
// tokens before a decoded token, the token, 3 for the worst offset in a block) and an 8-token step,
// where keeping every block would take 120. They run side by side with no preemption, so the sliding blocks let go are taken by
// other sequences; the golden request's greedy tokens are Hugging Face's, and every request gets
// the tokens it gets alone.
class ClusterSlidingPoolTest : public ::testing::TestWithParam<Layout> {};

TEST_P(ClusterSlidingPoolTest, SlidingLayersOwnPoolIsReusedAndTokensStayHuggingFaces) {
  const Layout& l = GetParam();
  std::ifstream config_file(kFixtures / l.fixture / "config.json");
  const nlohmann::json config = nlohmann::json::parse(config_file);
  const nlohmann::json& text = config.contains("text_config") ? config["text_config"] : config;
  ASSERT_EQ(text["sliding_window"].get<int>(), 32) << "the figures above are for a 32-token window";
  const int vocab = text["vocab_size"].get<int>();
  const Golden golden = LoadGolden(l.fixture);
  ASSERT_EQ(golden.prompt.size(), 48u);
  Cluster cluster({l.fixture, l.pp, l.tp, {"--matmul-dtype", "f32"}},
                  {"--num-kv-blocks", "120", "--block-size", "4", "--max-model-len", "80", "--max-tokens-per-step",
                   "8", "--max-num-seqs", "8"});
  ASSERT_TRUE(cluster.Start());
  std::vector<v1::GenerateRequest> requests;
  for (int i = 0; i < 6; ++i) {
    std::vector<int32_t> prompt = golden.prompt;
    for (size_t j = 0; i > 0 && j < prompt.size(); j += 3) prompt[j] = (prompt[j] + 37 * i) % vocab;
    requests.push_back(TokenRequest(prompt, 32));
    requests.back().set_request_id("pool-" + std::to_string(i));
  }
  std::vector<Streamed> alone, together(requests.size());
  for (const v1::GenerateRequest& r : requests) {
    alone.push_back(Generate(cluster.client(), r));
    ASSERT_TRUE(alone.back().status.ok()) << alone.back().status.error_message() << "\n" << cluster.Logs();
  }
  EXPECT_EQ(alone[0].tokens, golden.greedy);
  {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < requests.size(); ++i) {
      threads.emplace_back([&, i] { together[i] = Generate(cluster.client(), requests[i]); });
    }
    for (std::thread& t : threads) t.join();
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(together[i].status.ok()) << i << ": " << together[i].status.error_message() << "\n" << cluster.Logs();
    EXPECT_EQ(together[i].tokens, alone[i].tokens) << "request " << i;
  }
  const v1::SchedulerStatus s = cluster.Status().scheduler();
  EXPECT_EQ(s.kv_blocks_total(), 120);
  EXPECT_EQ(s.preemptions(), 0) << "the sliding blocks behind the window were not let go";
  // The coordinator's scheduler line names the sliding layers' pool it sized.
  std::ifstream log_file(cluster.coordinator().log());
  const std::string log((std::istreambuf_iterator<char>(log_file)), std::istreambuf_iterator<char>());
  EXPECT_NE(log.find("blocks behind the 32-token sliding window let go from the sliding layers' 74 blocks"),
            std::string::npos)
      << cluster.Logs();
  std::printf("[ timing   ] TP=%d PP=%d %s: 6 requests of 80 tokens sent together to 120 full-layer and 74 "
              "sliding-layer blocks of 4, %lld preemptions\n",
              l.tp, l.pp, l.fixture.c_str(), static_cast<long long>(s.preemptions()));
}

INSTANTIATE_TEST_SUITE_P(Layouts, ClusterSlidingPoolTest,
                         ::testing::Values(Layout{"gemma3_tf5", 1, 1}, Layout{"gemma3_tf5", 2, 1},
                                           Layout{"gemma3_tf5", 1, 2}, Layout{"gemma3_tf5", 2, 2},
                                           Layout{"gemma2_tf5", 2, 2}, Layout{"gemma3_cg_tf5", 1, 2}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return "TP" + std::to_string(info.param.tp) + "_PP" + std::to_string(info.param.pp) + "_" +
                                  info.param.fixture;
                         });

// ---- The client API, on one cluster (TP=2 x PP=2, llama_gqa: 5 layers split 2 + 3) -------------------

class ClusterApiTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // The bandwidth only feeds the plan's decode estimate (checked in ModelInfoAndClusterStatus).
    cluster_ = new Cluster({"llama_gqa", 2, 2, {"--memory-bandwidth-gbps", "50"}});
    if (!cluster_->Start()) {
      delete cluster_;
      cluster_ = nullptr;
    }
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(cluster_, nullptr) << "the cluster did not start"; }

  static Cluster* cluster_;
};
Cluster* ClusterApiTest::cluster_ = nullptr;

TEST_F(ClusterApiTest, StreamsOneTokenPerMessageWithUsageOnTheLast) {
  const Golden golden = LoadGolden("llama_gqa");
  v1::GenerateRequest request = TokenRequest(golden.prompt, 5);
  request.set_request_id("usage-test");
  const Streamed r = Generate(cluster_->client(), request);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_EQ(r.messages.size(), 5u);
  for (size_t i = 0; i < r.messages.size(); ++i) {
    const v1::GenerateResponse& m = r.messages[i];
    EXPECT_EQ(m.token_ids_size(), 1);
    EXPECT_EQ(m.token_ids(0), golden.greedy[i]);
    EXPECT_EQ(m.text(), "") << "a model without tokenizer.json streams ids only";
    EXPECT_EQ(m.request_id(), "usage-test");
    EXPECT_GT(m.timings().step_seconds(), 0);
    EXPECT_GE(m.timings().step_seconds(), m.timings().forward_seconds());
    const bool last = i + 1 == r.messages.size();
    EXPECT_EQ(m.finish_reason(), last ? v1::FINISH_REASON_LENGTH : v1::FINISH_REASON_UNSPECIFIED);
    EXPECT_EQ(m.has_usage(), last);
  }
  EXPECT_EQ(r.messages.back().usage().prompt_tokens(), static_cast<int>(golden.prompt.size()));
  EXPECT_EQ(r.messages.back().usage().completion_tokens(), 5);
}

TEST_F(ClusterApiTest, StopsAfterAStopTokenId) {
  const Golden golden = LoadGolden("llama_gqa");
  // The first greedy token that did not appear before it.
  size_t k = 3;
  while (std::find(golden.greedy.begin(), golden.greedy.begin() + k, golden.greedy[k]) != golden.greedy.begin() + k) ++k;
  v1::GenerateRequest request = TokenRequest(golden.prompt, 32);
  request.mutable_sampling()->add_stop_token_ids(golden.greedy[k]);
  const Streamed r = Generate(cluster_->client(), request);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens, std::vector<int32_t>(golden.greedy.begin(), golden.greedy.begin() + k + 1));
  EXPECT_EQ(r.messages.back().finish_reason(), v1::FINISH_REASON_STOP_TOKEN);
  EXPECT_EQ(r.messages.back().usage().completion_tokens(), static_cast<int>(k + 1));
}

TEST_F(ClusterApiTest, SeededSamplingIsReproducible) {
  const Golden golden = LoadGolden("llama_gqa");
  v1::GenerateRequest request = TokenRequest(golden.prompt, 12);
  request.mutable_sampling()->set_temperature(1.5f);
  request.mutable_sampling()->set_top_k(50);
  request.mutable_sampling()->set_seed(7);
  const Streamed a = Generate(cluster_->client(), request);
  const Streamed b = Generate(cluster_->client(), request);
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  ASSERT_TRUE(b.status.ok()) << b.status.error_message();
  EXPECT_EQ(a.tokens.size(), 12u);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_NE(a.tokens, std::vector<int32_t>(golden.greedy.begin(), golden.greedy.begin() + 12))
      << "temperature 1.5 should not reproduce greedy decoding";
}

// Three requests at once. The coordinator batches concurrent requests (continuous batching, its
// schedule is tested in batching_test.cc) rather than serving them one at a time; whatever it
// batched, each stream carries its own request only: the lone run's greedy tokens, its own request
// id on every message, one finish reason and the usage, on its last message.
TEST_F(ClusterApiTest, ConcurrentRequestsEachGetTheirOwnStream) {
  const Golden golden = LoadGolden("llama_gqa");
  const std::vector<int32_t> want(golden.greedy.begin(), golden.greedy.begin() + 8);
  constexpr int kRequests = 3;
  Streamed results[kRequests];
  std::latch go(kRequests);
  std::vector<std::thread> threads;
  for (int i = 0; i < kRequests; ++i) {
    threads.emplace_back([&, i] {
      v1::GenerateRequest request = TokenRequest(golden.prompt, 8);
      request.set_request_id("concurrent-" + std::to_string(i));
      go.arrive_and_wait();  // released together
      results[i] = Generate(cluster_->client(), request);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kRequests; ++i) {
    SCOPED_TRACE("request concurrent-" + std::to_string(i));
    const Streamed& r = results[i];
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.tokens, want);
    ASSERT_FALSE(r.messages.empty());
    for (size_t m = 0; m < r.messages.size(); ++m) {
      const bool last = m + 1 == r.messages.size();
      EXPECT_EQ(r.messages[m].request_id(), "concurrent-" + std::to_string(i)) << "message " << m;
      EXPECT_EQ(r.messages[m].finish_reason(), last ? v1::FINISH_REASON_LENGTH : v1::FINISH_REASON_UNSPECIFIED)
          << "message " << m;
      EXPECT_EQ(r.messages[m].has_usage(), last) << "message " << m;
    }
    EXPECT_EQ(r.messages.back().usage().prompt_tokens(), static_cast<int>(golden.prompt.size()));
    EXPECT_EQ(r.messages.back().usage().completion_tokens(), 8);
  }
}

TEST_F(ClusterApiTest, BadRequestsAreInvalidArgumentNamingTheField) {
  const Golden golden = LoadGolden("llama_gqa");
  struct Case {
    std::string name;
    v1::GenerateRequest request;
    std::string field;
  };
  std::vector<Case> cases;
  cases.push_back({"no prompt", v1::GenerateRequest(), "prompt"});
  v1::GenerateRequest r = TokenRequest({1, 600, 3}, 4);
  cases.push_back({"id outside the vocabulary", r, "prompt.token_ids.ids[1]"});
  r = TokenRequest(golden.prompt, 4);
  r.set_text("hello");
  cases.push_back({"text without tokenizer.json", r, "tokenizer.json"});
  r = TokenRequest(golden.prompt, 250);
  cases.push_back({"longer than max_model_len", r, "max_model_len"});
  // A prompt that alone fills the context (max_model_len 256) is the prompt's fault, not max_tokens'.
  r = TokenRequest(std::vector<int32_t>(256, 1), 4);
  cases.push_back({"prompt of max_model_len tokens", r, "prompt: its 256 tokens do not fit max_model_len 256"});
  // Invalid UTF-8 is refused by the server, naming the byte (not a request it cannot parse,
  // INTERNAL with no message), whether or not the model has a tokenizer.
  r = TokenRequest(golden.prompt, 4);
  r.set_text("abc\xFF");
  cases.push_back({"invalid UTF-8 text", r, "prompt.text: not valid UTF-8: byte 0xFF at offset 3"});
  r = TokenRequest(golden.prompt, 4);
  r.set_request_id("id\xC3");
  cases.push_back({"request_id that is not ASCII", r, "request_id"});
  r = TokenRequest(golden.prompt, 4);
  r.mutable_sampling()->set_temperature(-1);
  cases.push_back({"negative temperature", r, "sampling.temperature"});
  r = TokenRequest(golden.prompt, 4);
  r.mutable_sampling()->set_top_p(1.5f);
  cases.push_back({"top_p above 1", r, "sampling.top_p"});
  r = TokenRequest(golden.prompt, 4);
  r.mutable_sampling()->add_stop_token_ids(-3);
  cases.push_back({"stop id outside the vocabulary", r, "sampling.stop_token_ids[0]"});
  for (const Case& c : cases) {
    const Streamed s = Generate(cluster_->client(), c.request);
    EXPECT_EQ(s.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.name;
    EXPECT_NE(s.status.error_message().find(c.field), std::string::npos)
        << c.name << ": '" << s.status.error_message() << "' does not name " << c.field;
    EXPECT_TRUE(s.messages.empty()) << c.name;
  }
  grpc::ClientContext context;
  v1::TokenizeRequest tokenize;
  tokenize.set_text("hello");
  v1::TokenizeResponse ids;
  EXPECT_EQ(cluster_->client()->Tokenize(&context, tokenize, &ids).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  grpc::ClientContext bad_utf8_context;
  tokenize.set_text("ok \xF4\x90\x80\x80");  // above U+10FFFF
  const grpc::Status bad_utf8 = cluster_->client()->Tokenize(&bad_utf8_context, tokenize, &ids);
  EXPECT_EQ(bad_utf8.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad_utf8.error_message();
  EXPECT_NE(bad_utf8.error_message().find("text: not valid UTF-8: byte 0xF4 at offset 3"), std::string::npos)
      << bad_utf8.error_message();
}

TEST_F(ClusterApiTest, ModelInfoAndClusterStatus) {
  grpc::ClientContext context;
  v1::ModelInfo info;
  ASSERT_TRUE(cluster_->client()->GetModelInfo(&context, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.name(), "llama_gqa");
  EXPECT_EQ(info.architecture(), "LlamaForCausalLM");
  EXPECT_EQ(info.vocab_size(), 512);
  EXPECT_EQ(info.num_layers(), 5);
  EXPECT_EQ(info.max_model_len(), 256);
  EXPECT_EQ(info.dtype(), "float32");
  EXPECT_EQ(std::vector<int32_t>(info.eos_token_ids().begin(), info.eos_token_ids().end()), std::vector<int32_t>{2});

  const v1::ClusterStatus status = cluster_->Status();
  EXPECT_EQ(status.tp(), 2);
  EXPECT_EQ(status.pp(), 2);
  EXPECT_TRUE(status.serving());
  EXPECT_NE(status.plan_text().find("memory 50 GB/s"), std::string::npos)
      << "the workers' --memory-bandwidth-gbps:\n" << status.plan_text();
  // CPU workers are called what they are, and the plan shows the KV cache the scheduler uses.
  EXPECT_NE(status.plan_text().find("on 4 CPU workers"), std::string::npos) << status.plan_text();
  EXPECT_EQ(status.plan_text().find("GPU"), std::string::npos) << status.plan_text();
  EXPECT_EQ(status.plan_text().find("HBM"), std::string::npos) << status.plan_text();
  const v1::SchedulerStatus& scheduler = status.scheduler();
  ASSERT_GT(scheduler.kv_blocks_total(), 0) << status.ShortDebugString();
  const std::string kv_line = absl::StrCat("KV cache ", planner_format::Count(scheduler.kv_blocks_total() * scheduler.block_size()),
                                           " tokens (", planner_format::Count(scheduler.kv_blocks_total()), " blocks of ",
                                           scheduler.block_size(), ")");
  EXPECT_NE(status.plan_text().find(kv_line), std::string::npos) << kv_line << "\n" << status.plan_text();
  EXPECT_EQ(status.model().name(), "llama_gqa");
  ASSERT_EQ(status.workers_size(), 4);
  std::vector<int> layers_held(5, 0);
  for (const v1::WorkerStatus& w : status.workers()) {
    EXPECT_EQ(w.state(), v1::WORKER_STATE_READY) << w.worker_id();
    EXPECT_EQ(w.node(), "n" + std::to_string(w.stage())) << "node i is stage i";
    EXPECT_GT(w.weight_bytes(), 0);
    for (int l = w.first_layer(); l <= w.last_layer(); ++l) layers_held[l] += 1;
  }
  EXPECT_EQ(layers_held, std::vector<int>(5, 2)) << "every layer on both TP ranks of exactly one stage";
}

TEST(WorkerFlagsTest, BadMemoryBandwidthIsAUsageErrorNamingTheFlag) {
  char pattern[] = "/tmp/cluster_test.XXXXXX";
  const fs::path dir = mkdtemp(pattern);
  for (const char* value : {"-1", "fast", "nan", "1e9", "1e-9"}) {
    const fs::path log = dir / "worker.log";
    Process worker({SHARDSERVE_WORKER_BIN, "--memory-bandwidth-gbps", value}, log);
    EXPECT_EQ(worker.Wait(std::chrono::seconds(20)), 2) << value;
    const std::string output = Tail(log, 1 << 16);  // the error, then the whole usage text
    EXPECT_NE(output.find("--memory-bandwidth-gbps must be 0 or a number of GB/s"), std::string::npos)
        << value << ": " << output;
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
}

// Speculative decoding's flags are checked at start: a usage error (exit 2) naming what is wrong.
TEST(CoordinatorFlagsTest, BadSpeculativeFlagsAreUsageErrorsNamingTheFlag) {
  char pattern[] = "/tmp/cluster_test.XXXXXX";
  const fs::path dir = mkdtemp(pattern);
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--speculative", "eagle", "--num-speculative-tokens", "4"}, "--speculative must be ngram, draft, mtp or eagle3, got 'eagle'"},
      {{"--speculative", "eagle3", "--num-speculative-tokens", "4"}, "--speculative eagle3 needs --draft-model DIR"},
      {{"--speculative", "draft", "--num-speculative-tokens", "4"}, "--speculative draft needs --draft-model DIR"},
      {{"--speculative", "ngram", "--num-speculative-tokens", "4", "--draft-model", "/tmp"},
       "--draft-model /tmp needs --speculative draft (or eagle3, for an EAGLE-3 head)"},
      {{"--speculative", "ngram"}, "--speculative ngram needs --num-speculative-tokens in [1, 16]"},
      {{"--speculative", "ngram", "--num-speculative-tokens", "17"}, "--num-speculative-tokens must be an integer in [1, 16]"},
      {{"--speculative", "ngram", "--num-speculative-tokens", "0"}, "--num-speculative-tokens must be an integer in [1, 16]"},
      {{"--num-speculative-tokens", "4"}, "--num-speculative-tokens needs --speculative"},
      {{"--speculative", "ngram", "--num-speculative-tokens", "2", "--speculative-max-running", "-1"},
       "--speculative-max-running must be an integer in [0, 4096]"},
      {{"--adaptive-speculative-tokens"}, "--adaptive-speculative-tokens needs --speculative"},
  };
  for (const auto& [flags, want] : cases) {
    const fs::path log = dir / "coordinator.log";
    std::vector<std::string> argv = {SHARDSERVE_COORDINATOR_BIN, "--model", (kFixtures / "llama_gqa").string(),
                                     "--listen", "127.0.0.1:0", "--insecure"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    Process coordinator(argv, log);
    EXPECT_EQ(coordinator.Wait(std::chrono::seconds(20)), 2) << want;
    const std::string output = Tail(log, 1 << 16);
    EXPECT_NE(output.find(want), std::string::npos) << want << ": " << output;
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
}

// A draft model whose vocabulary is not the model's is refused at start (exit 1), naming both.
TEST(CoordinatorFlagsTest, ADraftModelOfAnotherVocabularyIsRefused) {
  char pattern[] = "/tmp/cluster_test.XXXXXX";
  const fs::path dir = mkdtemp(pattern);
  const fs::path log = dir / "coordinator.log";
  const std::string demo = (fs::path(SHARDSERVE_SOURCE_DIR) / "models/demo").string();
  const std::string other = (kFixtures / "llama_gqa").string();
  Process coordinator({SHARDSERVE_COORDINATOR_BIN, "--model", demo, "--listen", "127.0.0.1:0", "--insecure",
                       "--speculative", "draft", "--num-speculative-tokens", "4", "--draft-model", other},
                      log);
  EXPECT_EQ(coordinator.Wait(std::chrono::seconds(20)), 1) << Tail(log);
  const std::string output = Tail(log, 1 << 16);
  EXPECT_NE(output.find("--draft-model " + other + " has a vocabulary of "), std::string::npos) << output;
  EXPECT_NE(output.find("but --model " + demo + " has 4096"), std::string::npos) << output;
  std::error_code ec;
  fs::remove_all(dir, ec);
}

// An instruction-set cap oneDNN would ignore (kernels/cpu/isa_cap.h) ends a CPU worker at start, before
// it looks for its coordinator (none listens at port 1: without the check it would keep retrying).
TEST(WorkerFlagsTest, AnIsaCapOneDnnWouldIgnoreIsRefusedAtStart) {
  char pattern[] = "/tmp/cluster_test.XXXXXX";
  const fs::path dir = mkdtemp(pattern);
  const fs::path log = dir / "worker.log";
  ASSERT_EQ(setenv("ONEDNN_MAX_CPU_ISA", "avx-512", 1), 0);
  Process worker({SHARDSERVE_WORKER_BIN, "--coordinator", "127.0.0.1:1", "--node", "n0", "--listen", "127.0.0.1:0",
                  "--memory-gb", "1"},
                 log);
  unsetenv("ONEDNN_MAX_CPU_ISA");
  EXPECT_EQ(worker.Wait(std::chrono::seconds(20)), 1) << Tail(log);
  EXPECT_NE(Tail(log).find("shardserve-worker: ONEDNN_MAX_CPU_ISA='avx-512' is not an instruction set oneDNN knows"),
            std::string::npos)
      << Tail(log);
  std::error_code ec;
  fs::remove_all(dir, ec);
}

// A TP group whose ranks share this host's memory shares its CPUs too: each rank warns, once loaded,
// when the group's compute threads outnumber the CPUs (worker/comm/host_cpus.h), and is silent when
// each has its share.
TEST(WorkerFlagsTest, ATpGroupWithMoreThreadsThanCpusWarnsOnEveryRank) {
  cpu_set_t set;
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  const int cpus = CPU_COUNT(&set);
  const std::string warning = absl::StrCat("the TP group's 2 ranks on this host run ", 2 * cpus,
                                           " compute threads on its ", cpus, " CPU", cpus == 1 ? "" : "s");
  // Logged after the load, so once the cluster serves, within a moment.
  const auto logged = [](Cluster& cluster, int w, const std::string& text) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    do {
      if (Tail(cluster.worker(w).log(), size_t{1} << 20).find(text) != std::string::npos) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    } while (std::chrono::steady_clock::now() < deadline);
    return false;
  };
  {
    Cluster cluster({"llama_gqa", /*nodes=*/1, /*gpus_per_node=*/2, {"--threads", std::to_string(cpus)}});
    ASSERT_TRUE(cluster.Start());
    for (int w = 0; w < 2; ++w) {
      EXPECT_TRUE(logged(cluster, w, "TP group: shared memory")) << cluster.Logs();
      EXPECT_TRUE(logged(cluster, w, warning)) << "worker " << w << " lacks '" << warning << "'\n" << cluster.Logs();
    }
  }
  // Each rank its share (on one CPU, two ranks of one thread each outnumber it: the case above).
  if (cpus < 2) return;
  Cluster cluster({"llama_gqa", /*nodes=*/1, /*gpus_per_node=*/2, {"--threads", std::to_string(cpus / 2)}});
  ASSERT_TRUE(cluster.Start());
  for (int w = 0; w < 2; ++w) {
    ASSERT_TRUE(logged(cluster, w, "TP group: shared memory")) << cluster.Logs();
    EXPECT_EQ(Tail(cluster.worker(w).log(), size_t{1} << 20).find("compute threads on its"), std::string::npos)
        << "worker " << w << "\n" << cluster.Logs();
  }
}

// A port a coordinator serves is refused to a second coordinator's gRPC port and to its HTTP port,
// at start and by name: gRPC's and httplib's default SO_REUSEPORT let both bind and take a share of
// the first one's connections (seen in CI: a launch whose --http-port was its own gRPC port served
// neither, its workers' TLS handshakes answered by the HTTP server).
TEST(CoordinatorFlagsTest, APortAnotherServerHoldsIsRefusedAtStart) {
  char pattern[] = "/tmp/cluster_test.XXXXXX";
  const fs::path dir = mkdtemp(pattern);
  const std::string demo = (fs::path(SHARDSERVE_SOURCE_DIR) / "models/demo").string();
  Process first(
      {SHARDSERVE_COORDINATOR_BIN, "--model", demo, "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"},
      dir / "first.log");
  std::string address;
  const auto deadline = Clock::now() + Scaled(std::chrono::seconds(20));
  while (address.empty() && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    address = LoggedAddress(dir / "first.log", "listening on ", ' ');
  }
  ASSERT_FALSE(address.empty()) << Tail(dir / "first.log");
  const std::string port = address.substr(address.rfind(':') + 1);
  Process grpc({SHARDSERVE_COORDINATOR_BIN, "--model", demo, "--listen", address, "--metrics-listen", "127.0.0.1:0"},
               dir / "grpc.log");
  EXPECT_EQ(grpc.Wait(std::chrono::seconds(20)), 1) << Tail(dir / "grpc.log");
  EXPECT_NE(Tail(dir / "grpc.log").find("cannot listen on " + address), std::string::npos) << Tail(dir / "grpc.log");
  Process http({SHARDSERVE_COORDINATOR_BIN, "--model", demo, "--listen", "127.0.0.1:0", "--metrics-listen",
                "127.0.0.1:0", "--http-port", port},
               dir / "http.log");
  EXPECT_EQ(http.Wait(std::chrono::seconds(20)), 1) << Tail(dir / "http.log");
  EXPECT_NE(Tail(dir / "http.log").find("cannot listen for HTTP on 127.0.0.1:" + port), std::string::npos)
      << Tail(dir / "http.log");
  std::error_code ec;
  fs::remove_all(dir, ec);
}

TEST_F(ClusterApiTest, AWorkerBeyondTheGroupIsRefusedAndTheGroupServesOn) {
  const fs::path log = cluster_->dir() / "extra-worker.log";
  Process extra({SHARDSERVE_WORKER_BIN, "--coordinator", cluster_->address(), "--node", "n9", "--listen",
                 "127.0.0.1:0", "--memory-gb", "4"},
                log);
  EXPECT_EQ(extra.Wait(std::chrono::seconds(20)), 1) << Tail(log);
  EXPECT_NE(Tail(log).find("refused this worker: the worker group is already complete"), std::string::npos)
      << Tail(log);
  EXPECT_EQ(cluster_->HealthStatus(), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(cluster_->Status().workers_size(), 4);
}

// ---- Text in, text out, on the demo model (it has a tokenizer.json) -----------------------------

// TP=2 x PP=2 on models/demo, as tools/demo.sh runs it. The streamed text deltas must concatenate
// to the decode of the streamed ids, and a stop string must cut the text before it.
class DemoTextTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string demo = (fs::path(SHARDSERVE_SOURCE_DIR) / "models/demo").string();
    auto tokenizer = Tokenizer::FromDirectory(demo);
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = tokenizer->release();
    cluster_ = new Cluster({demo, 2, 2, {}});  // an absolute path replaces the fixtures folder
    if (!cluster_->Start()) {
      delete cluster_;
      cluster_ = nullptr;
    }
  }
  static void TearDownTestSuite() {
    delete cluster_;
    delete tokenizer_;
    cluster_ = nullptr;
    tokenizer_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(cluster_, nullptr) << "the cluster did not start"; }

  static v1::GenerateRequest TextRequest(const std::string& prompt, int max_tokens) {
    v1::GenerateRequest r;
    r.set_text(prompt);
    r.mutable_sampling()->set_max_tokens(max_tokens);
    return r;
  }
  static std::string Text(const Streamed& r) {
    std::string text;
    for (const auto& m : r.messages) text += m.text();
    return text;
  }

  static Cluster* cluster_;
  static Tokenizer* tokenizer_;
};
Cluster* DemoTextTest::cluster_ = nullptr;
Tokenizer* DemoTextTest::tokenizer_ = nullptr;

TEST_F(DemoTextTest, TextDeltasConcatenateToTheDecodedIds) {
  const std::string prompt = "And the LORD said unto Moses,";
  const Streamed r = Generate(cluster_->client(), TextRequest(prompt, 40));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_FALSE(r.tokens.empty());
  EXPECT_EQ(Text(r), tokenizer_->Decode(r.tokens, /*skip_special_tokens=*/true));
  absl::StatusOr<std::vector<int32_t>> prompt_ids = tokenizer_->Encode(prompt, /*add_special_tokens=*/true);
  ASSERT_TRUE(prompt_ids.ok());
  EXPECT_EQ(r.messages.back().usage().prompt_tokens(), static_cast<int>(prompt_ids->size()));
  EXPECT_EQ(r.messages.back().usage().completion_tokens(), static_cast<int>(r.tokens.size()));
  EXPECT_NE(r.messages.back().finish_reason(), v1::FINISH_REASON_UNSPECIFIED);
  std::printf("[ demo     ] %s%s\n", prompt.c_str(), Text(r).c_str());
}

TEST_F(DemoTextTest, StopStringEndsTheTextBeforeIt) {
  const std::string prompt = "In the beginning";
  const Streamed full = Generate(cluster_->client(), TextRequest(prompt, 40));
  ASSERT_TRUE(full.status.ok()) << full.status.error_message();
  const std::string text = Text(full);
  // A stop string from the middle of the greedy text: it may span tokens, so the server must hold
  // back text that could be its start and never stream it.
  ASSERT_GT(text.size(), 24u) << text;
  const std::string stop = text.substr(text.size() / 2, 5);
  v1::GenerateRequest request = TextRequest(prompt, 40);
  request.mutable_sampling()->add_stop(stop);
  const Streamed r = Generate(cluster_->client(), request);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(Text(r), text.substr(0, text.find(stop))) << "stop string '" << stop << "'";
  EXPECT_EQ(r.messages.back().finish_reason(), v1::FINISH_REASON_STOP_STRING);
}

// ---- Chunked prefill ----------------------------------------------------------------------------------

// A prompt longer than a step (256 tokens) is prefilled in chunks, each handed down the pipeline.
// The cluster (TP=1, so that only the chunking and the stages differ) must give the tokens one
// process gives with the whole prompt in a single step.
TEST(ClusterPrefillTest, LongPromptIsPrefilledInChunksAcrossStages) {
  const std::string fixture = "llama3_rope";  // max_position_embeddings 1024
  const Golden golden = LoadGolden(fixture);
  std::vector<int32_t> prompt;
  while (prompt.size() < 600) prompt.insert(prompt.end(), golden.prompt.begin(), golden.prompt.end());

  absl::StatusOr<ModelConfig> config = LoadModelConfig(kFixtures / fixture);
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(kFixtures / fixture);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  LocalCommunicator tp(backend.get());
  const StepLimits whole_prompt{.max_tokens_per_step = 1024, .max_seqs_per_step = 1, .block_size = 16,
                                .num_kv_blocks = 64, .max_model_len = 64 * 16};
  absl::StatusOr<std::unique_ptr<ModelShard>> model =
      ModelShard::Load(**checkpoint, *config, ShardSpec{}, whole_prompt, backend.get(), &tp);
  ASSERT_TRUE(model.ok()) << model.status();
  absl::StatusOr<std::vector<int32_t>> reference = GreedyGenerate(model->get(), prompt, 16);
  ASSERT_TRUE(reference.ok()) << reference.status();

  Cluster cluster({fixture, 2, 1, {}});
  ASSERT_TRUE(cluster.Start());
  const Streamed r = Generate(cluster.client(), TokenRequest(prompt, 16));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message() << "\n" << cluster.Logs();
  EXPECT_EQ(r.tokens, *reference);
  EXPECT_EQ(r.messages.back().usage().prompt_tokens(), 600);
}

// ---- Quantized weights ---------------------------------------------------------------------------

// --quantization int8 or fp8 (e4m3, a scale per output channel) on the coordinator reaches every
// worker, which quantizes its own layers at load: with TP = 1 each layer is quantized whole, as in
// one process, so a TP=1 x PP=2 cluster gives exactly the greedy tokens of one process with the
// same quantization (and, the weights being quantized, not those of the float32 one on this
// fixture: the test would pass vacuously otherwise). The plan in the status counts the quantized
// weights. (int4 below needs a wider model, whose rows TP = 2 cuts on a group boundary.)
class ClusterQuantizationPerChannelTest : public ::testing::TestWithParam<WeightQuant> {};

TEST_P(ClusterQuantizationPerChannelTest, WeightsGiveTheTokensOfOneProcessOfTheSameQuantization) {
  const WeightQuant quantized = GetParam();
  const std::string name = WeightQuantName(quantized);
  const std::string fixture = "llama_gqa";
  const Golden golden = LoadGolden(fixture);
  absl::StatusOr<ModelConfig> config = LoadModelConfig(kFixtures / fixture);
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(kFixtures / fixture);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  LocalCommunicator tp(backend.get());
  const StepLimits limits{.max_tokens_per_step = 256, .max_seqs_per_step = 1, .block_size = 16, .num_kv_blocks = 8,
                          .max_model_len = 8 * 16};
  std::vector<int32_t> reference[2];
  for (WeightQuant quant : {WeightQuant::kNone, quantized}) {
    ShardSpec spec;
    spec.weight_quant = quant;
    absl::StatusOr<std::unique_ptr<ModelShard>> model =
        ModelShard::Load(**checkpoint, *config, spec, limits, backend.get(), &tp);
    ASSERT_TRUE(model.ok()) << model.status();
    absl::StatusOr<std::vector<int32_t>> ids = GreedyGenerate(model->get(), golden.prompt, 24);
    ASSERT_TRUE(ids.ok()) << ids.status();
    reference[quant == quantized] = *ids;
  }
  ASSERT_NE(reference[0], reference[1]) << name << " and float32 weights give the same 24 tokens on " << fixture;

  Cluster cluster({fixture, /*nodes=*/2, /*gpus_per_node=*/1, {}}, {"--quantization", name});
  ASSERT_TRUE(cluster.Start());
  const Streamed r = Generate(cluster.client(), TokenRequest(golden.prompt, 24));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message() << "\n" << cluster.Logs();
  EXPECT_EQ(r.tokens, reference[1]);
  EXPECT_NE(cluster.Status().plan_text().find("linear layers " + name), std::string::npos)
      << cluster.Status().plan_text();
}

INSTANTIATE_TEST_SUITE_P(Quantizations, ClusterQuantizationPerChannelTest,
                         ::testing::Values(WeightQuant::kInt8, WeightQuant::kFp8),
                         [](const ::testing::TestParamInfo<WeightQuant>& info) {
                           return std::string(WeightQuantName(info.param));
                         });

// Worker --activation-quantization int8 (launch and bench pass it to every worker) with
// --quantization int4 on two nodes (PP = 2, TP = 1: every product sees whole input rows, so each
// row's int8 scale is the one process's): the cluster gives exactly the greedy tokens of one
// process whose backend rounds the activations (MakeCpuBackend with CpuActivationQuant::kInt8),
// which differ from the exact int4 tokens on this fixture (the flag really reached the workers),
// and each worker's log names the instance (AVX-512 VNNI's where the CPU has it, else AVX2's).
// Skipped on a CPU with neither, where the workers refuse the flag (CpuActivationQuantTest checks
// the refusal).
TEST(ClusterQuantizationTest, Int8ActivationsGiveTheTokensOfOneSuchProcess) {
  absl::StatusOr<std::unique_ptr<Backend>> act_backend = MakeCpuBackend(0, CpuMatMul::kF32, CpuActivationQuant::kInt8);
  if (!act_backend.ok()) GTEST_SKIP() << act_backend.status();
  const std::string fixture = "llama_gqa";
  const Golden golden = LoadGolden(fixture);
  absl::StatusOr<ModelConfig> config = LoadModelConfig(kFixtures / fixture);
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(kFixtures / fixture);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  std::unique_ptr<Backend> exact_backend = MakeCpuBackend();
  const StepLimits limits{.max_tokens_per_step = 256, .max_seqs_per_step = 1, .block_size = 16, .num_kv_blocks = 8,
                          .max_model_len = 8 * 16};
  std::vector<int32_t> reference[2];
  for (Backend* backend : {exact_backend.get(), act_backend->get()}) {
    LocalCommunicator tp(backend);
    ShardSpec spec;
    spec.weight_quant = WeightQuant::kInt4;
    absl::StatusOr<std::unique_ptr<ModelShard>> model =
        ModelShard::Load(**checkpoint, *config, spec, limits, backend, &tp);
    ASSERT_TRUE(model.ok()) << model.status();
    absl::StatusOr<std::vector<int32_t>> ids = GreedyGenerate(model->get(), golden.prompt, 24);
    ASSERT_TRUE(ids.ok()) << ids.status();
    reference[backend == act_backend->get()] = *ids;
  }
  ASSERT_NE(reference[0], reference[1]) << "int8 activations give the exact int4 tokens on " << fixture;

  Cluster cluster({fixture, /*nodes=*/2, /*gpus_per_node=*/1, {"--activation-quantization", "int8"}},
                  {"--quantization", "int4"});
  ASSERT_TRUE(cluster.Start());
  const Streamed r = Generate(cluster.client(), TokenRequest(golden.prompt, 24));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message() << "\n" << cluster.Logs();
  EXPECT_EQ(r.tokens, reference[1]);
  for (int i = 0; i < cluster.num_workers(); ++i) {
    const std::string log = Tail(cluster.worker(i).log(), size_t{1} << 20);
    EXPECT_NE(log.find(absl::StrCat("int8/int4 products on ", cpu::QuantIsaName(*cpu::Int8ActivationsIsa()))),
              std::string::npos)
        << "worker " << i << "\n" << log;
  }
}

// --quantization int4 in every layout: each worker quantizes its own slice in groups of 128 inputs,
// and since a row-parallel slice here is a whole number of groups (o_proj 256 / 2 = 128 inputs,
// down_proj 512 / 2 = 256), every layout holds the very int4 weights of one process. TP = 1, TP = 2,
// PP = 2 and TP = 2 x PP = 2 give the greedy tokens of `shardserve generate-ids --quantization int4`
// (one process) exactly, as ClusterDummyWeightsTest does in float32 and for the same reason (only
// the TP all-reduce's order of summation differs). The model is made from a config.json alone
// (--load-format dummy), 256 wide: the fixtures' 64-wide rows would be cut inside a group by TP = 2.
// The float32 tokens of the same model must differ from the int4 ones (the weights really were
// quantized), and the plan in the status says int4.
// `fixture`'s config.json resized as above (and by `edit`) checked so, with dummy weights of `seed`;
// with `activations` (--activation-quantization) passed to generate-ids and to every worker, whose
// log must then name it.
void CheckInt4InEveryLayout(const std::string& fixture, int seed, const std::function<void(nlohmann::json&)>& edit,
                            const std::string& activations = "none") {
  char pattern[] = "/tmp/int4_model.XXXXXX";
  const fs::path dir = mkdtemp(pattern);
  {
    std::ifstream in(kFixtures / fixture / "config.json");
    nlohmann::json config = nlohmann::json::parse(in);
    config["hidden_size"] = 256;
    config["intermediate_size"] = 512;
    config["num_attention_heads"] = 4;
    config["num_key_value_heads"] = 2;
    config["head_dim"] = 64;
    config["num_hidden_layers"] = 4;
    edit(config);
    std::ofstream(dir / "config.json") << config.dump(2);
  }
  const std::vector<int32_t> prompt = {1, 5, 99, 300, 17, 42, 7, 256};
  const int new_tokens = 24;
  const auto generate_ids = [&](const std::string& quantization) {
    std::string command = std::string(SHARDSERVE_CLI_BIN) + " generate-ids --model " + dir.string() +
                          " --load-format dummy --dummy-seed " + std::to_string(seed) + " --quantization " + quantization +
                          " --activation-quantization " + activations +
                          " --max-new-tokens " + std::to_string(new_tokens);
    for (int32_t id : prompt) command += " " + std::to_string(id);
    std::vector<int32_t> ids;
    FILE* out = popen((command + " 2>&1").c_str(), "r");
    EXPECT_NE(out, nullptr);
    if (out == nullptr) return ids;
    std::string text;
    char buf[4096];
    while (size_t n = fread(buf, 1, sizeof(buf), out)) text.append(buf, n);
    EXPECT_EQ(pclose(out), 0) << command << ":\n" << text;
    std::istringstream in(text);
    for (int32_t id; in >> id;) ids.push_back(id);
    EXPECT_EQ(ids.size(), static_cast<size_t>(new_tokens)) << text;
    return ids;
  };
  const std::vector<int32_t> reference = generate_ids("int4");
  ASSERT_EQ(reference.size(), static_cast<size_t>(new_tokens));
  // Random models often repeat one token (seed 7 of the Llama one does, in float32 and int4 alike); the
  // seeds' tokens vary, so that a layout that got the weights wrong cannot match by luck.
  EXPECT_GE(std::set<int32_t>(reference.begin(), reference.end()).size(), 4u) << "a degenerate model";
  EXPECT_NE(generate_ids("none"), reference) << "int4 and float32 weights give the same tokens";

  for (auto [pp, tp] : {std::pair{1, 1}, {1, 2}, {2, 1}, {2, 2}}) {
    const std::vector<std::string> worker_flags = {"--matmul-dtype", "f32", "--activation-quantization", activations};
    Cluster cluster({dir.string(), /*nodes=*/pp, /*gpus_per_node=*/tp, worker_flags},
                    {"--quantization", "int4", "--load-format", "dummy", "--dummy-seed", std::to_string(seed)});
    ASSERT_TRUE(cluster.Start()) << "TP=" << tp << " PP=" << pp;
    const Streamed r = Generate(cluster.client(), TokenRequest(prompt, new_tokens));
    ASSERT_TRUE(r.status.ok()) << "TP=" << tp << " PP=" << pp << ": " << r.status.error_message() << "\n"
                               << cluster.Logs();
    EXPECT_EQ(r.tokens, reference) << "TP=" << tp << " PP=" << pp;
    EXPECT_NE(cluster.Status().plan_text().find("linear layers int4"), std::string::npos)
        << cluster.Status().plan_text();
    if (activations == "int16") {
      for (int i = 0; i < cluster.num_workers(); ++i) {
        const std::string log = Tail(cluster.worker(i).log(), size_t{1} << 20);
        EXPECT_NE(log.find("activations rounded to int16 per group of 128"), std::string::npos)
            << "TP=" << tp << " PP=" << pp << " worker " << i << "\n" << log;
      }
    }
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
}

TEST(ClusterQuantizationTest, Int4GivesTheTokensOfOneInt4ProcessInEveryLayout) {
  CheckInt4InEveryLayout("llama_gqa", 3, [](nlohmann::json&) {});
}

// The same on int16-rounded activations (--activation-quantization int16, AVX-512 VNNI CPUs): each
// rank rounds its slice of a row-parallel input per group of 128, the groups whole on every rank, so
// every layout computes the roundings of one process: its tokens exactly.
TEST(ClusterQuantizationTest, Int16ActivationsGiveTheTokensOfOneSuchProcessInEveryLayout) {
  if (!MakeCpuBackend(1, CpuMatMul::kF32, CpuActivationQuant::kInt16).ok()) {
    GTEST_SKIP() << "this CPU lacks AVX-512 VNNI (the workers refuse int16: CpuActivationQuantTest)";
  }
  CheckInt4InEveryLayout("llama_gqa", 3, [](nlohmann::json&) {}, "int16");
}

// The same with experts (Qwen3-MoE, 5 experts of 256, 2 a token, layer 1 dense): each rank quantizes
// its 128-input slice of every expert's down_proj, so every layout holds the experts of one int4
// process; the router stays float32 in all of them.
TEST(ClusterQuantizationTest, Int4ExpertsGiveTheTokensOfOneInt4ProcessInEveryLayout) {
  CheckInt4InEveryLayout("qwen3_moe_tf5", 2, [](nlohmann::json& config) {
    config["vocab_size"] = 512;  // the prompt's ids reach 300
    config["moe_intermediate_size"] = 256;
    config["mlp_only_layers"] = {1};
  });
}

// ---- Published quantized checkpoints (model/quantized_checkpoint.h, tests/fixtures/{gptq,awq,fp8,
// compressed_tensors}) ----
// Real processes in the layouts each variant allows give Hugging Face's greedy tokens (of the
// dequantized weights) exactly, as ClusterParityTest does for float32 checkpoints (worker
// --matmul-dtype f32 and --activation-quantization none, the exact products; the fixtures' smallest
// greedy margin is 2.2e-3, float32 rounding moves logits by ~1e-6): the int4-mapped variant in
// PP = 2 (TP = 2 would cut its one group of 128, refused); the dequantized ones in TP = 2 (each
// rank reading only its slice of the packed tensors, g_idx reordered by desc_act) and TP = 2 x
// PP = 2; one variant of each other format.
TEST(ClusterGptqTest, GptqCheckpointsGiveHuggingFaceTokensAcrossProcesses) {
  struct Case {
    std::string variant;  // under tests/fixtures
    int pp, tp;
    std::string log;      // what the worker log names
  };
  for (const Case& c : {Case{"gptq/llama_sym4_g128_v1", 2, 1, "GPTQ"}, Case{"gptq/qwen2_asym4_g32_desc_act_v1", 1, 2, "GPTQ"},
                        Case{"gptq/qwen2_asym8_g32_v2", 2, 2, "GPTQ"}, Case{"awq/awq_qwen2_g32", 1, 2, "AWQ"},
                        Case{"fp8/fp8_qwen2_block32x64", 2, 2, "as fp8 e4m3 with 32x64 block scales"},
                        Case{"compressed_tensors/ct_int4_asym_g32_qwen2", 1, 2, "compressed-tensors"},
                        Case{"compressed_tensors/ct_fp8_channel_qwen2", 2, 1, "compressed-tensors"}}) {
    const std::string fixture = "../" + c.variant;
    const Golden golden = LoadGolden(fixture);
    ASSERT_EQ(golden.greedy.size(), 32u);
    Cluster cluster({fixture, /*nodes=*/c.pp, /*gpus_per_node=*/c.tp,
                     {"--matmul-dtype", "f32", "--activation-quantization", "none"}});
    ASSERT_TRUE(cluster.Start()) << c.variant;
    const Streamed r = Generate(cluster.client(), TokenRequest(golden.prompt, 32));
    ASSERT_TRUE(r.status.ok()) << c.variant << ": " << r.status.error_message() << "\n" << cluster.Logs();
    EXPECT_EQ(r.tokens, golden.greedy) << c.variant << " TP=" << c.tp << " PP=" << c.pp;
    EXPECT_NE(cluster.Logs().find(c.log), std::string::npos) << "the worker log names the format";
  }
}

// Published quantized mixture-of-experts checkpoints in every TP x PP layout and with
// --expert-parallel: Hugging Face's greedy tokens of the dequantized weights, exactly (all float32,
// as above; the fixtures' smallest greedy margin is 1.3e-3). Qwen3-MoE GPTQ group 16 (dequantized;
// TP = 2 cuts the experts' 32 intermediate rows into whole groups), GPTQ group 128 on its int4 path
// (PP only: TP = 2 would cut o_proj's one group), FP8 with 24x40 blocks whose grid TP = 2's slices
// cut (each rank holds its slice on the fp8 kernel with its blocks' scales where its inputs start
// on a block's edge, else dequantized with the scales of the blocks they fall in), and DeepSeek-V3
// with 128x128 blocks on the fp8 kernel (MLA's picked q_b_proj / kv_a_proj_with_mqa rows and
// kv_b_proj read dequantized); one case of the other formats.
struct QuantizedMoeLayout {
  std::string variant;  // under tests/fixtures
  int tp, pp;
  bool expert_parallel;
  std::string log;  // what the worker log names
};

void PrintTo(const QuantizedMoeLayout& l, std::ostream* os) {
  *os << "TP=" << l.tp << " PP=" << l.pp << (l.expert_parallel ? " EP " : " ") << l.variant;
}

std::vector<QuantizedMoeLayout> QuantizedMoeLayouts() {
  std::vector<QuantizedMoeLayout> out;
  for (int tp : {1, 2}) {
    for (int pp : {1, 2}) out.push_back({"gptq/gptq_qwen3_moe_sym4_g16", tp, pp, false, "GPTQ"});
  }
  const std::vector<QuantizedMoeLayout> more = {
      {"gptq/gptq_qwen3_moe_sym4_g16", 2, 1, true, "GPTQ"},
      {"gptq/gptq_qwen3_moe_sym4_g16", 2, 2, true, "GPTQ"},
      {"gptq/gptq_qwen3_moe_sym4_g128", 1, 2, false, "as int4 groups of 128"},
      {"fp8/fp8_qwen3_moe_block24x40", 2, 1, false, "as fp8 e4m3 with 24x40 block scales"},
      {"fp8/fp8_qwen3_moe_block24x40", 2, 2, false, "as fp8 e4m3 with 24x40 block scales"},
      {"fp8/fp8_qwen3_moe_block24x40", 2, 2, true, "as fp8 e4m3 with 24x40 block scales"},
      {"fp8/fp8_deepseek_v3_block128", 1, 2, false, "as fp8 e4m3 with 128x128 block scales"},
      {"fp8/fp8_deepseek_v3_block128", 2, 2, false, "as fp8 e4m3 with 128x128 block scales"},
      {"fp8/fp8_deepseek_v3_block128", 2, 1, true, "as fp8 e4m3 with 128x128 block scales"},
      {"awq/awq_mixtral_g16", 2, 1, false, "AWQ"},
      {"awq/awq_glm4_moe_g8", 2, 2, false, "AWQ"},
      {"awq/awq_glm4_moe_g8", 2, 1, true, "AWQ"},
      {"compressed_tensors/ct_int4_sym_g8_qwen2_moe", 2, 2, false, "compressed-tensors"},
      {"compressed_tensors/ct_fp8_channel_qwen2_moe", 2, 1, true, "as fp8 e4m3 per output channel"}};
  out.insert(out.end(), more.begin(), more.end());
  return out;
}

class ClusterQuantizedMoeTest : public ::testing::TestWithParam<QuantizedMoeLayout> {};

TEST_P(ClusterQuantizedMoeTest, GreedyTokensMatchHuggingFace) {
  const QuantizedMoeLayout& l = GetParam();
  const std::string fixture = "../" + l.variant;
  const Golden golden = LoadGolden(fixture);
  ASSERT_EQ(golden.greedy.size(), 32u);
  std::vector<std::string> coordinator_flags;
  if (l.expert_parallel) coordinator_flags.push_back("--expert-parallel");
  Cluster cluster({fixture, /*nodes=*/l.pp, /*gpus_per_node=*/l.tp,
                   {"--matmul-dtype", "f32", "--activation-quantization", "none"}},
                  coordinator_flags);
  ASSERT_TRUE(cluster.Start()) << l.variant;
  const Streamed r = Generate(cluster.client(), TokenRequest(golden.prompt, 32));
  ASSERT_TRUE(r.status.ok()) << l.variant << ": " << r.status.error_message() << "\n" << cluster.Logs();
  EXPECT_EQ(r.tokens, golden.greedy);
  EXPECT_NE(cluster.Logs().find(l.log), std::string::npos) << "the worker log names the format\n" << cluster.Logs();
}

INSTANTIATE_TEST_SUITE_P(Layouts, ClusterQuantizedMoeTest, ::testing::ValuesIn(QuantizedMoeLayouts()),
                         [](const ::testing::TestParamInfo<QuantizedMoeLayout>& info) {
                           std::string name = info.param.variant.substr(info.param.variant.find('/') + 1);
                           return "TP" + std::to_string(info.param.tp) + "_PP" + std::to_string(info.param.pp) +
                                  (info.param.expert_parallel ? "_EP_" : "_") + name;
                         });

// ---- Dummy weights: a directory holding only config.json -------------------------------------------
// --load-format dummy on the coordinator reaches every worker, each making only its own slice of
// weights that are a function of (seed, tensor, element) alone: a TP=2 x PP=2 cluster gives the
// greedy tokens of `shardserve generate-ids --load-format dummy`, one process. Exact equality, as in
// ClusterParityTest and for the same reason: all float32 (worker --matmul-dtype f32; generate-ids'
// CPU backend computes in float32), only the TP all-reduce's order of summation differs. No
// tokenizer.json and no safetensors in the directory: token-id prompts only.
TEST(ClusterDummyWeightsTest, Tp2Pp2GivesTheTokensOfOneProcess) {
  char pattern[] = "/tmp/dummy_model.XXXXXX";
  const fs::path dir = mkdtemp(pattern);
  fs::copy_file(kFixtures / "llama_gqa" / "config.json", dir / "config.json");
  const std::vector<int32_t> prompt = {1, 5, 99, 300, 17, 42, 7, 256};
  const int new_tokens = 24;

  std::string command = std::string(SHARDSERVE_CLI_BIN) + " generate-ids --model " + dir.string() +
                        " --load-format dummy --dummy-seed 7 --max-new-tokens " + std::to_string(new_tokens);
  for (int32_t id : prompt) command += " " + std::to_string(id);
  std::vector<int32_t> reference;
  {
    FILE* out = popen((command + " 2>&1").c_str(), "r");
    ASSERT_NE(out, nullptr);
    std::string text;
    char buf[4096];
    while (size_t n = fread(buf, 1, sizeof(buf), out)) text.append(buf, n);
    ASSERT_EQ(pclose(out), 0) << command << ":\n" << text;
    std::istringstream ids(text);
    for (int32_t id; ids >> id;) reference.push_back(id);
    ASSERT_EQ(reference.size(), static_cast<size_t>(new_tokens)) << text;
  }

  {
    // The absolute directory replaces the harness's fixture directory (fs::path's operator/).
    Cluster cluster({dir.string(), /*nodes=*/2, /*gpus_per_node=*/2, {"--matmul-dtype", "f32"}},
                    {"--load-format", "dummy", "--dummy-seed", "7"});
    ASSERT_TRUE(cluster.Start());
    const Streamed r = Generate(cluster.client(), TokenRequest(prompt, new_tokens));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message() << "\n" << cluster.Logs();
    EXPECT_EQ(r.tokens, reference);
    // Each worker logs the plan's memory beside what it allocated: its weights, KV cache and step
    // buffers are the plan's to the byte, on every stage and rank.
    for (int i = 0; i < cluster.num_workers(); ++i) {
      std::map<std::string, std::pair<int64_t, int64_t>> items = LoggedMemory(cluster, i);
      for (const char* name : {"weights", "kv_cache", "step_buffers"}) {
        ASSERT_TRUE(items.count(name)) << "worker " << i << " logged no memory " << name << "\n" << cluster.Logs();
        EXPECT_GT(items[name].first, 0) << "worker " << i << " " << name;
        EXPECT_EQ(items[name].first, items[name].second) << "worker " << i << " " << name;
      }
    }
  }
  // Another seed is another model (or the test above would pass with any weights).
  {
    Cluster cluster({dir.string(), 1, 1, {"--matmul-dtype", "f32"}}, {"--load-format", "dummy", "--dummy-seed", "8"});
    ASSERT_TRUE(cluster.Start());
    const Streamed r = Generate(cluster.client(), TokenRequest(prompt, new_tokens));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message() << "\n" << cluster.Logs();
    EXPECT_NE(r.tokens, reference);
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
}

// Without --load-format dummy the same directory is refused: there are no safetensors to read.
TEST(ClusterDummyWeightsTest, ConfigOnlyDirectoryNeedsLoadFormatDummy) {
  char pattern[] = "/tmp/dummy_model.XXXXXX";
  const fs::path dir = mkdtemp(pattern);
  fs::copy_file(kFixtures / "llama_gqa" / "config.json", dir / "config.json");
  const std::string command = std::string(SHARDSERVE_CLI_BIN) + " generate-ids --model " + dir.string() + " 1 2 3 2>&1";
  FILE* out = popen(command.c_str(), "r");
  ASSERT_NE(out, nullptr);
  std::string text;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), out)) text.append(buf, n);
  EXPECT_NE(pclose(out), 0) << text;
  EXPECT_NE(text.find("safetensors"), std::string::npos) << text;
  std::error_code ec;
  fs::remove_all(dir, ec);
}

// ---- Failures ---------------------------------------------------------------------------------------

// Starts a generation long enough to outlive `act`, reads a few tokens, runs `act` on the worker
// at `victim`, and checks the stream ends with UNAVAILABLE naming that worker within 10 s (the
// cluster's heal timeout is 2 s and no replacement comes); then
// that the coordinator is NOT_SERVING, refuses a new request with the same news, and runs on.
void ExpectWorkerLossIsReported(Cluster& cluster, int victim, int sig, const std::string& cause) {
  // Who the victim is, as the coordinator names it.
  std::string victim_id;
  int stage = -1, tp_rank = -1;
  const v1::ClusterStatus before = cluster.Status();
  for (const v1::WorkerStatus& w : before.workers()) {
    if (w.address() == cluster.worker_address(victim)) {
      victim_id = w.worker_id();
      stage = w.stage();
      tp_rank = w.tp_rank();
    }
  }
  ASSERT_NE(victim_id, "") << "no worker listens on " << cluster.worker_address(victim);
  const std::string name = "worker " + victim_id + " (node n" + std::to_string(stage) + ", stage " +
                           std::to_string(stage) + ", tp rank " + std::to_string(tp_rank) + ")";

  // llama3_rope serves 1024 tokens; with the workers' 20 ms step delay this runs ~20 s.
  const Golden golden = LoadGolden("llama3_rope");
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = cluster.client()->Generate(&context, TokenRequest(golden.prompt, 900));
  v1::GenerateResponse message;
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(reader->Read(&message)) << reader->Finish().error_message();
  ASSERT_EQ(message.finish_reason(), v1::FINISH_REASON_UNSPECIFIED);

  const auto hit = Clock::now();
  cluster.worker(victim).Signal(sig);
  int more = 0;
  while (reader->Read(&message)) ++more;
  const grpc::Status status = reader->Finish();
  const double seconds = SecondsSince(hit);
  std::printf("[ timing   ] signal %d -> UNAVAILABLE after %.2f s (%d more tokens streamed): %s\n", sig, seconds, more,
              status.error_message().c_str());
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  EXPECT_LT(seconds, 10.0);
  EXPECT_NE(status.error_message().find(name + " is lost"), std::string::npos)
      << "'" << status.error_message() << "' does not name " << name << " first";
  EXPECT_NE(status.error_message().find(cause), std::string::npos) << status.error_message();

  EXPECT_EQ(cluster.HealthStatus(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  const Streamed again = Generate(cluster.client(), TokenRequest(golden.prompt, 4), std::chrono::seconds(15));
  EXPECT_EQ(again.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(again.status.error_message().find(name), std::string::npos) << again.status.error_message();
  EXPECT_TRUE(cluster.coordinator().running());

  const v1::ClusterStatus after = cluster.Status();
  EXPECT_FALSE(after.serving());
  for (const v1::WorkerStatus& w : after.workers()) {
    if (w.worker_id() == victim_id) {
      EXPECT_EQ(w.state(), v1::WORKER_STATE_LOST);
      EXPECT_NE(w.detail().find(cause), std::string::npos) << w.detail();
    }
  }
}

TEST(ClusterFailureTest, KilledWorkerEndsTheStreamWithUnavailable) {
  Cluster cluster({"llama3_rope", 2, 2, {"--debug-step-delay-ms", "20"}}, {"--heal-timeout-seconds", "2"});
  ASSERT_TRUE(cluster.Start());
  ExpectWorkerLossIsReported(cluster, /*victim=*/3, SIGKILL, "control stream ended");
  if (HasFailure()) std::printf("%s", cluster.Logs().c_str());

  // SIGTERM stops the coordinator cleanly; the workers left stop when their streams end.
  cluster.coordinator().Signal(SIGTERM);
  EXPECT_EQ(cluster.coordinator().Wait(std::chrono::seconds(10)), 0);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(cluster.worker(i).Wait(std::chrono::seconds(10)), 0) << "worker " << i;
}

TEST(ClusterFailureTest, HungWorkerIsLostAfterItsHeartbeatsStop) {
  Cluster cluster({"llama3_rope", 2, 1, {"--debug-step-delay-ms", "20"}}, {"--heal-timeout-seconds", "2"});
  ASSERT_TRUE(cluster.Start());
  ExpectWorkerLossIsReported(cluster, /*victim=*/1, SIGSTOP, "not even a heartbeat");

  // SIGTERM stops the other worker cleanly, after its step failed on the hung peer's timeout.
  cluster.worker(0).Signal(SIGTERM);
  EXPECT_EQ(cluster.worker(0).Wait(std::chrono::seconds(15)), 0);
  EXPECT_TRUE(cluster.coordinator().running());
  if (HasFailure()) std::printf("%s", cluster.Logs().c_str());
}

TEST(ClusterNumericFailureTest, ASequenceWithNonFiniteLogitsFailsAloneAndTheGroupServesOn) {
  char pattern[] = "/tmp/overflowing_gemma.XXXXXX";
  const fs::path model = mkdtemp(pattern);
  absl::Cleanup remove_model = [&model] {
    std::error_code ec;
    fs::remove_all(model, ec);
  };
  const absl::Status written = WriteOverflowingGemma(model);
  ASSERT_TRUE(written.ok()) << written;
  const Golden golden = LoadGolden("gemma2_tf5");
  // Steps slowed down, so that the clean request is still streaming when the bad one arrives.
  Cluster cluster({model.string(), 2, 1, {"--matmul-dtype", "f32", "--debug-step-delay-ms", "20"}});
  ASSERT_TRUE(cluster.Start());
  const uint64_t epoch = cluster.Status().epoch();

  Streamed before = Generate(cluster.client(), TokenRequest(golden.prompt, 32));
  ASSERT_TRUE(before.status.ok()) << before.status.error_message() << "\n" << cluster.Logs();
  EXPECT_EQ(before.tokens, golden.greedy);

  // A clean request streams while one whose prompt holds the token fails beside it: greedy (which
  // used to stream the NaN's index as tokens) and sampled (which used to fail the step as a worker
  // failure, re-forming the group until it gave up).
  for (const bool sampled : {false, true}) {
    SCOPED_TRACE(sampled ? "sampled" : "greedy");
    Streamed clean;
    std::thread streaming([&] { clean = Generate(cluster.client(), TokenRequest(golden.prompt, 32)); });
    const auto start = Clock::now();
    while (cluster.Status().scheduler().running() == 0 && SecondsSince(start) < ScaledSeconds(30)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    std::vector<int32_t> bad_prompt(golden.prompt.begin(), golden.prompt.begin() + 6);
    bad_prompt.push_back(kOverflowingToken);
    v1::GenerateRequest bad = TokenRequest(bad_prompt, 8);
    bad.set_request_id(sampled ? "overflowing-sampled" : "overflowing-greedy");
    if (sampled) {
      bad.mutable_sampling()->set_temperature(0.8f);
      bad.mutable_sampling()->set_seed(7);
    }
    const Streamed failed = Generate(cluster.client(), bad);
    streaming.join();
    EXPECT_EQ(failed.status.error_code(), grpc::StatusCode::INTERNAL) << failed.status.error_message();
    EXPECT_NE(
        failed.status.error_message().find("the model's logits for this sequence were not finite (NaN or infinity)"),
        std::string::npos)
        << failed.status.error_message();
    EXPECT_TRUE(failed.tokens.empty());
    ASSERT_TRUE(clean.status.ok()) << clean.status.error_message() << "\n" << cluster.Logs();
    EXPECT_EQ(clean.tokens, golden.greedy);
  }

  EXPECT_EQ(cluster.HealthStatus(), grpc::health::v1::HealthCheckResponse::SERVING);
  const v1::ClusterStatus status = cluster.Status();
  EXPECT_EQ(status.state(), "serving");
  EXPECT_EQ(status.epoch(), epoch) << "the group re-formed";
  Streamed after = Generate(cluster.client(), TokenRequest(golden.prompt, 32));
  ASSERT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(after.tokens, golden.greedy);

  // Each logged once, by the coordinator, naming the request.
  for (const std::string id : {"overflowing-greedy", "overflowing-sampled"}) {
    std::ifstream log(cluster.coordinator().log());
    int lines = 0;
    for (std::string line; std::getline(log, line);) {
      lines += line.find(id + ": failed: the model's logits for this sequence were not finite") != std::string::npos;
    }
    EXPECT_EQ(lines, 1) << id << "\n" << cluster.Logs();
  }
}

}  // namespace
}  // namespace shardserve
