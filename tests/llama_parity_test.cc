// Parity with Hugging Face transformers: for every fixture under tests/fixtures/models (made by
// tools/make_parity_fixtures.py), the single-process forward pass on the CPU backend must give
// the same last-position logits and the same 32 greedy tokens as transformers did.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "nlohmann/json.hpp"
#include "worker/llama.h"

namespace shardserve {
namespace {

namespace fs = std::filesystem;

const fs::path kFixtures = fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/models";

std::vector<std::string> FixtureNames() {
  std::vector<std::string> names;
  if (fs::is_directory(kFixtures)) {
    for (const auto& e : fs::directory_iterator(kFixtures)) {
      if (fs::exists(e.path() / "golden.json")) names.push_back(e.path().filename().string());
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

// max|a - b| / max|b|: the error relative to the logits' scale, so one number bounds every entry.
double NormalizedError(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return diff / scale;
}

// 1e-4: both sides compute in float32, and only the order of summation differs (OpenBLAS vs
// PyTorch's kernels), which moves logits by ~1e-6 relative here. A real mistake (a wrong rope
// frequency, a missing bias, a wrong head mapping) moves them by 1e-2 or more.
constexpr double kLogitsTolerance = 1e-4;

struct Golden {
  std::vector<int32_t> prompt, greedy;
  std::vector<float> prompt_last_logits, final_logits;
};

Golden LoadGolden(const fs::path& dir) {
  std::ifstream in(dir / "golden.json");
  nlohmann::json j = nlohmann::json::parse(in);
  Golden g;
  g.prompt = j.at("prompt_ids").get<std::vector<int32_t>>();
  g.greedy = j.at("greedy_ids").get<std::vector<int32_t>>();
  g.prompt_last_logits = j.at("prompt_last_logits").get<std::vector<float>>();
  g.final_logits = j.at("final_logits").get<std::vector<float>>();
  return g;
}

class LlamaParity : public ::testing::TestWithParam<std::string> {};

// Runs greedy generation with prefill chunks of `chunk` tokens and checks it against HF.
void CheckAgainstHuggingFace(const std::string& name, int64_t chunk) {
  const fs::path dir = kFixtures / name;
  const Golden g = LoadGolden(dir);
  ASSERT_EQ(g.greedy.size(), 32u);

  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  LocalCommunicator tp(backend.get());
  RuntimeOptions opt;
  opt.max_tokens_per_step = chunk;
  opt.max_seqs_per_step = 1;
  opt.block_size = 16;
  opt.max_blocks_per_seq = 8;
  opt.num_kv_blocks = 8;
  absl::StatusOr<std::unique_ptr<LlamaShard>> model = LlamaShard::Load(**ckpt, *config, ShardSpec{}, opt, backend.get(), &tp);
  ASSERT_TRUE(model.ok()) << model.status();

  std::vector<std::vector<float>> logits;
  absl::StatusOr<std::vector<int32_t>> ids = GreedyGenerate(model->get(), g.prompt, 32, &logits);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, g.greedy) << name << ": greedy tokens differ from Hugging Face's";
  ASSERT_EQ(logits.size(), 32u);
  const double prefill_err = NormalizedError(logits.front(), g.prompt_last_logits);
  const double decode_err = NormalizedError(logits.back(), g.final_logits);
  EXPECT_LE(prefill_err, kLogitsTolerance) << name << ": logits after the prompt";
  EXPECT_LE(decode_err, kLogitsTolerance) << name << ": logits at the 32nd decode step";
  std::printf("[ parity   ] %s chunk=%lld: prefill logits error %.3g, decode logits error %.3g\n", name.c_str(),
              static_cast<long long>(chunk), prefill_err, decode_err);
}

TEST_P(LlamaParity, WholePromptInOneStep) { CheckAgainstHuggingFace(GetParam(), 128); }

// Prefill in chunks of 5 tokens exercises attention over cache entries written by earlier steps
// and block boundaries that fall inside a chunk.
TEST_P(LlamaParity, ChunkedPrefill) { CheckAgainstHuggingFace(GetParam(), 5); }

INSTANTIATE_TEST_SUITE_P(Fixtures, LlamaParity, ::testing::ValuesIn(FixtureNames()),
                         [](const auto& info) { return info.param; });

// The suite above silently has no cases if the fixtures vanish; this makes that a failure.
TEST(LlamaParityFixtures, AllFixtureKindsPresent) {
  const std::vector<std::string> names = FixtureNames();
  for (const char* want : {"llama_gqa", "qwen2_tied_bias", "llama3_rope", "mistral_sharded", "llama_bf16"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << "missing fixture " << want;
  }
}

}  // namespace
}  // namespace shardserve
