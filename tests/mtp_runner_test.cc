// Speculative decoding with the model's multi-token-prediction (MTP) layer (worker/head_runner.h, run
// by StepExecutor) on tests/fixtures/models/deepseek_v3_mtp_tf5 (deepseek_v3_tf5 with an MTP layer:
// tools/fixtures/make_mtp_fixture.py). transformers does not run the layer, so there is no Hugging
// Face reference for its guesses; what must hold, and what these tests check:
//
// - The layer's forward (ModelShard with ShardSpec::mtp) is its decoder layer over
//   eh_proj(cat(enorm(embed(next token)), hnorm(hidden))): the same tokens and hidden states through a
//   plain shard of that decoder layer (its checkpoint's shared_head as the final norm and LM head),
//   fed the projection computed here on the host in double, give the same logits.
// - A CPU worker of the model with the layer, driven by the coordinator's Scheduler and DraftProposer
//   as the engine drives them (prompts prefilled in chunks, so a chunk's last row waits for its next
//   token; one prompt from the prefix cache), gives the greedy outputs of the same worker without
//   speculation; guesses are made, some accepted, some rejected; and after every step the guesses
//   for a sequence are those of a fresh model and layer fed its tokens in one go (FreshMtp): the
//   runner paired every hidden state with the right token at the right position, kept the waiting
//   rows and dropped the rejected ones.
// - A model without the layer, or a checkpoint without its tensors, is refused, naming what is missing.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/scheduler/proposer.h"
#include "coordinator/scheduler/scheduler.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "model/config.h"
#include "model/weight_source.h"
#include "nlohmann/json.hpp"
#include "tests/speculation_driver.h"
#include "worker/comm/rendezvous.h"
#include "worker/communicator.h"
#include "worker/head_runner.h"
#include "worker/shard/model_shard.h"
#include "worker/step_executor.h"

namespace shardserve {
namespace {

namespace fs = std::filesystem;

const fs::path kFixtures = fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/models";
const std::string kMtp = (kFixtures / "deepseek_v3_mtp_tf5").string();

constexpr int kGuesses = 3;

// Small steps, so that the prompts are prefilled in chunks.
StepLimits Limits() {
  return StepLimits{.max_tokens_per_step = 8, .max_seqs_per_step = 4, .block_size = 4, .num_kv_blocks = 64,
                    .max_model_len = 64};
}

absl::StatusOr<std::unique_ptr<StepExecutor>> Worker(const std::string& model, bool mtp) {
  absl::StatusOr<ModelConfig> config = LoadModelConfig(model);
  if (!config.ok()) return config.status();
  v1::Assignment a = WholeModelAssignment(model, config->num_hidden_layers, Limits());
  a.set_speculative_mtp(mtp);
  return CpuWorker(a);
}

// A fresh model and MTP layer, each a ModelShard of its own: the guesses the layer makes for a
// sequence's tokens computed in one go (the model's prefill over all but the last token, its
// final-normed hidden states paired with the tokens after them through the layer, then the layer
// again on its own output), what the runner's step-by-step state must reproduce.
struct FreshMtp {
  std::unique_ptr<Backend> backend = MakeCpuBackend(0, CpuMatMul::kF32);
  std::unique_ptr<Communicator> tp1, tp2;
  std::unique_ptr<WeightSource> weights;
  std::unique_ptr<ModelShard> model, mtp;
  StepLimits limits{.max_tokens_per_step = 64, .max_seqs_per_step = 4, .block_size = 4, .num_kv_blocks = 24,
                    .max_model_len = 80};

  FreshMtp() {
    absl::StatusOr<ModelConfig> config = LoadModelConfig(kMtp);
    EXPECT_TRUE(config.ok()) << config.status();
    absl::StatusOr<std::unique_ptr<WeightSource>> w = OpenWeightSource(kMtp, *config, LoadFormat::kAuto, 0);
    EXPECT_TRUE(w.ok()) << w.status();
    weights = std::move(*w);
    tp1 = std::make_unique<LocalCommunicator>(backend.get());
    tp2 = std::make_unique<LocalCommunicator>(backend.get());
    absl::StatusOr<std::unique_ptr<ModelShard>> m =
        ModelShard::Load(*weights, *config, ShardSpec{}, limits, backend.get(), tp1.get());
    EXPECT_TRUE(m.ok()) << m.status();
    const int64_t L = config->num_hidden_layers;
    absl::StatusOr<std::unique_ptr<ModelShard>> t = ModelShard::Load(
        *weights, *config, ShardSpec{.first_layer = L, .end_layer = L + 1, .mtp = true, .aux_hidden_layers = {}}, limits, backend.get(), tp2.get());
    EXPECT_TRUE(t.ok()) << t.status();
    if (m.ok() && t.ok()) {
      model = std::move(*m);
      mtp = std::move(*t);
    }
  }

  static StepBatch Batch(const std::vector<int32_t>& ids, int32_t first_pos, const StepLimits& l) {
    StepBatch b;
    b.token_ids = ids;
    for (size_t i = 0; i < ids.size(); ++i) {
      b.positions.push_back(first_pos + static_cast<int32_t>(i));
      b.token_seq.push_back(0);
      b.slots.push_back(first_pos + static_cast<int32_t>(i));
    }
    b.num_seqs = 1;
    for (int32_t j = 0; j < l.max_blocks_per_seq(); ++j) b.block_tables.push_back(j);
    b.logit_rows.push_back(static_cast<int32_t>(ids.size()) - 1);
    return b;
  }

  int32_t Argmax() {
    std::vector<float> logits(256);
    EXPECT_TRUE(backend->CopyToHost(logits.data(), mtp->logits(1).data, logits.size() * sizeof(float)).ok());
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }

  // The layer's k guesses after `tokens` (the last one sampled, not yet fed to the model).
  std::vector<int32_t> Guesses(const std::vector<int32_t>& tokens, int k) {
    const int64_t n = static_cast<int64_t>(tokens.size()) - 1;
    std::vector<int32_t> out;
    const std::vector<int32_t> fed(tokens.begin(), tokens.end() - 1), next(tokens.begin() + 1, tokens.end());
    EXPECT_TRUE(model->Forward(Batch(fed, 0, limits)).ok());
    Tensor hidden = mtp->hidden(n);
    EXPECT_TRUE(model->FinalNormed(&hidden, n).ok());
    EXPECT_TRUE(mtp->Forward(Batch(next, 0, limits)).ok());
    out.push_back(Argmax());
    const size_t row = static_cast<size_t>(mtp->hidden(1).bytes());
    for (int j = 1; j < k; ++j) {
      // the layer's output at its last token as the next input (already row 0 after a one-token forward)
      const int64_t last = j == 1 ? n - 1 : 0;
      if (last > 0) {
        EXPECT_TRUE(backend->CopyOnDevice(mtp->hidden(1).data, mtp->hidden(last + 1).Rows(last, last + 1).data, row).ok());
      }
      EXPECT_TRUE(mtp->Forward(Batch({out.back()}, static_cast<int32_t>(n - 1 + j), limits)).ok());
      out.push_back(Argmax());
    }
    return out;
  }
};

// Three prompts: Hugging Face's golden prompt and one sharing its first 8 tokens (two blocks of 4),
// and a third; all longer than a step's 8 tokens.
std::vector<std::vector<int32_t>> Prompts() {
  const std::vector<int32_t> golden = {227, 117, 20, 134, 113, 221, 101, 116, 30, 64, 79, 226};
  std::vector<int32_t> b(golden.begin(), golden.begin() + 8);
  for (int32_t t : {5, 6, 7, 166, 166}) b.push_back(t);
  return {golden, b, {3, 9, 27, 81, 243, 200, 100, 50, 25, 12, 6}};
}

TEST(MtpRunnerTest, GreedyOutputsAreThoseWithout) {
  absl::StatusOr<std::unique_ptr<StepExecutor>> plain = Worker(kMtp, false);
  ASSERT_TRUE(plain.ok()) << plain.status();
  absl::StatusOr<std::unique_ptr<StepExecutor>> mtp = Worker(kMtp, true);
  ASSERT_TRUE(mtp.ok()) << mtp.status();
  EXPECT_NE((*mtp)->draft_summary().find("multi-token-prediction layer 3"), std::string::npos)
      << (*mtp)->draft_summary();
  FreshMtp fresh;
  ASSERT_NE(fresh.mtp, nullptr);
  SpeculationOutcome want, got;
  const Drive drive{.limits = Limits(), .speculate = true, .guesses = kGuesses, .vocab = 256, .max_tokens = 24};
  Drive no_guesses = drive;
  no_guesses.speculate = false;
  RunRequests(plain->get(), no_guesses, Prompts(), &want);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  // Each step's guesses for the sequences that started from nothing cached (seq 2's cached prefix is
  // a hole in the layer's cache) against a fresh model and layer fed the sequence's tokens in one go.
  StepExecutor* worker = mtp->get();
  int checked = 0;
  RunRequests(worker, drive, Prompts(), &got,
              [&](uint64_t seq, const std::vector<int32_t>& tokens, const std::vector<int32_t>& guesses, int row,
                  int rows) {
                if (seq == 2) return;
                ++checked;
                ASSERT_EQ(guesses, fresh.Guesses(tokens, static_cast<int>(guesses.size()))) << "seq " << seq;
                // ... and the layer's output hidden state at the last guess's position (the last
                // forward's row of this sequence), which every pair before it shaped through the
                // layer's attention: float32 both ways, the same products over other batchings,
                // within 1e-4.
                const ModelShard* layer = worker->head_runner()->shard();
                std::vector<float> got_row(64), want_row(64);
                ASSERT_TRUE(layer->backend()
                                ->CopyToHost(got_row.data(), layer->hidden(rows).Rows(row - 1, row).data, 64 * sizeof(float))
                                .ok());
                ASSERT_TRUE(fresh.backend->CopyToHost(want_row.data(), fresh.mtp->hidden(1).data, 64 * sizeof(float)).ok());
                for (int i = 0; i < 64; ++i) ASSERT_NEAR(got_row[i], want_row[i], 1e-4) << "seq " << seq << " [" << i << "]";
              });
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  EXPECT_EQ(got.outputs, want.outputs);
  // Hugging Face's greedy tokens for the golden prompt (tests/fixtures/models/deepseek_v3_mtp_tf5/golden.json).
  const std::vector<int32_t> hf = {166, 166, 166, 111, 87, 226, 235, 161, 76, 255, 133, 25,
                                   119, 160, 195, 136, 113, 161, 76, 119, 237, 111, 7, 188};
  EXPECT_EQ(got.outputs[1], hf);
  EXPECT_GT(got.offers, 0);
  EXPECT_GT(got.spec.accepted, 0) << "the layer never agreed with the model";
  EXPECT_LT(got.spec.accepted, got.spec.proposed) << "no guess was rejected: nothing was rolled back";
  EXPECT_EQ(got.cached_prompt_tokens, 8);
  EXPECT_GT(checked, 20);
  EXPECT_EQ(worker->head_runner()->starved(), 0) << "the layer's pool holds every sequence's positions";
  std::printf("[ mtp      ] proposed %lld, accepted %lld in %lld verifications\n",
              static_cast<long long>(got.spec.proposed), static_cast<long long>(got.spec.accepted),
              static_cast<long long>(got.spec.verifications));
}

// The checkpoint with the MTP layer's shared_head as the final norm and LM head (the model's LM head
// kept with `models_head`), so that a plain shard of layer 3 is the layer's decoder layer and head.
class SharedHeadAsFinal : public WeightSource {
 public:
  SharedHeadAsFinal(const WeightSource& base, bool models_head) : base_(base), models_head_(models_head) {}
  absl::Status CheckShape(const std::string& name, const std::vector<int64_t>& shape) const override {
    return base_.CheckShape(Map(name), shape);
  }
  absl::Status Read(const std::string& name, const std::vector<int64_t>& shape, const Slice& slice, DType type,
                    void* dst) const override {
    return base_.Read(Map(name), shape, slice, type, dst);
  }

 private:
  std::string Map(const std::string& name) const {
    if (name == "model.norm.weight") return "model.layers.3.shared_head.norm.weight";
    if (name == "lm_head.weight" && !models_head_) return "model.layers.3.shared_head.head.weight";
    return name;
  }
  const WeightSource& base_;
  const bool models_head_;
};

// The checkpoint without the MTP layer's shared_head.head, as some leave it out.
class WithoutSharedHead : public WeightSource {
 public:
  explicit WithoutSharedHead(const WeightSource& base) : base_(base) {}
  absl::Status CheckShape(const std::string& name, const std::vector<int64_t>& shape) const override {
    return name == kHead ? absl::NotFoundError(name) : base_.CheckShape(name, shape);
  }
  absl::Status Read(const std::string& name, const std::vector<int64_t>& shape, const Slice& slice, DType type,
                    void* dst) const override {
    return name == kHead ? absl::NotFoundError(name) : base_.Read(name, shape, slice, type, dst);
  }

 private:
  static constexpr const char* kHead = "model.layers.3.shared_head.head.weight";
  const WeightSource& base_;
};

std::vector<float> ReadAll(const WeightSource& w, const std::string& name, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> out(static_cast<size_t>(n));
  EXPECT_TRUE(w.Read(name, shape, Slice{0, 0, -1}, DType::kF32, out.data()).ok()) << name;
  return out;
}

TEST(MtpRunnerTest, TheLayerIsItsDecoderLayerOverTheProjectedInputs) {
  absl::StatusOr<ModelConfig> config = LoadModelConfig(kMtp);
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_EQ(config->num_nextn_predict_layers, 1);
  const int64_t H = config->hidden_size, V = config->vocab_size, L = config->num_hidden_layers;
  absl::StatusOr<std::unique_ptr<WeightSource>> weights = OpenWeightSource(kMtp, *config, LoadFormat::kAuto, 0);
  ASSERT_TRUE(weights.ok()) << weights.status();
  std::unique_ptr<Backend> backend = MakeCpuBackend(0, CpuMatMul::kF32);
  LocalCommunicator tp1(backend.get()), tp2(backend.get());
  const StepLimits limits = Limits();
  // The checkpoint as it is, then without the layer's own head (the model's LM head instead).
  for (bool without_head : {false, true}) {
    SCOPED_TRACE(without_head ? "without shared_head.head" : "with shared_head.head");
    const ShardSpec mtp_spec{.first_layer = L, .end_layer = L + 1, .mtp = true, .aux_hidden_layers = {}};
    WithoutSharedHead headless(**weights);
    const WeightSource& source = without_head ? static_cast<const WeightSource&>(headless) : **weights;
    absl::StatusOr<std::unique_ptr<ModelShard>> mtp = ModelShard::Load(source, *config, mtp_spec, limits, backend.get(), &tp1);
    ASSERT_TRUE(mtp.ok()) << mtp.status();
    // The plain shard: layer L of a model one layer deeper, its last stage.
    ModelConfig deeper = *config;
    deeper.num_hidden_layers = L + 1;
    SharedHeadAsFinal renamed(**weights, without_head);
    absl::StatusOr<std::unique_ptr<ModelShard>> plain =
        ModelShard::Load(renamed, deeper, ShardSpec{.first_layer = L, .end_layer = L + 1, .aux_hidden_layers = {}}, limits, backend.get(), &tp2);
    ASSERT_TRUE(plain.ok()) << plain.status();

    // Two steps of one sequence: positions 0..3 (position 0's embedding masked), then 4..6.
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const std::vector<float> embed = ReadAll(**weights, "model.embed_tokens.weight", {V, H});
    const std::vector<float> enorm = ReadAll(**weights, "model.layers.3.enorm.weight", {H});
    const std::vector<float> hnorm = ReadAll(**weights, "model.layers.3.hnorm.weight", {H});
    const std::vector<float> eh = ReadAll(**weights, "model.layers.3.eh_proj.weight", {H, 2 * H});
    const double eps = config->rms_norm_eps;
    int32_t pos = 0;
    for (int64_t n : {4, 3}) {
      StepBatch b;
      std::vector<float> hidden(static_cast<size_t>(n * H)), projected(static_cast<size_t>(n * H));
      for (float& v : hidden) v = normal(rng);
      for (int64_t i = 0; i < n; ++i, ++pos) {
        const int32_t id = static_cast<int32_t>(rng() % V);
        b.token_ids.push_back(id);
        b.positions.push_back(pos);
        b.token_seq.push_back(0);
        b.slots.push_back(pos);
        // x = eh_proj(cat(enorm(embed(id)), hnorm(hidden))), the embedding zero at position 0
        std::vector<double> cat(2 * H);
        auto rms = [&](const float* x) {
          double s = 0;
          for (int64_t j = 0; j < H; ++j) s += static_cast<double>(x[j]) * x[j];
          return 1.0 / std::sqrt(s / H + eps);
        };
        const float* e = embed.data() + id * H;
        const float* h = hidden.data() + i * H;
        const double re = rms(e), rh = rms(h);
        for (int64_t j = 0; j < H; ++j) {
          cat[j] = pos == 0 ? 0.0 : e[j] * re * enorm[j];
          cat[H + j] = h[j] * rh * hnorm[j];
        }
        for (int64_t r = 0; r < H; ++r) {
          double s = 0;
          for (int64_t j = 0; j < 2 * H; ++j) s += eh[r * 2 * H + j] * cat[j];
          projected[i * H + r] = static_cast<float>(s);
        }
      }
      b.num_seqs = 1;
      for (int32_t j = 0; j < limits.max_blocks_per_seq(); ++j) b.block_tables.push_back(j);
      for (int32_t i = 0; i < n; ++i) b.logit_rows.push_back(i);
      ASSERT_TRUE(backend->CopyToDevice((*mtp)->hidden(n).data, hidden.data(), hidden.size() * sizeof(float)).ok());
      ASSERT_TRUE(backend->CopyToDevice((*plain)->hidden(n).data, projected.data(), projected.size() * sizeof(float)).ok());
      const absl::Status ran = (*mtp)->Forward(b);
      ASSERT_TRUE(ran.ok()) << ran;
      StepBatch no_ids = b;
      no_ids.token_ids.clear();
      const absl::Status ran_plain = (*plain)->Forward(no_ids);
      ASSERT_TRUE(ran_plain.ok()) << ran_plain;
      std::vector<float> got(static_cast<size_t>(n * V)), want(static_cast<size_t>(n * V));
      ASSERT_TRUE(backend->CopyToHost(got.data(), (*mtp)->logits(n).data, got.size() * sizeof(float)).ok());
      ASSERT_TRUE(backend->CopyToHost(want.data(), (*plain)->logits(n).data, want.size() * sizeof(float)).ok());
      // float32 on both sides; only the projection's summation differs (double here): a few ulps of
      // logits of size ~1 after one layer.
      double worst = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_TRUE(std::isfinite(got[i])) << i;
        worst = std::max(worst, std::abs(static_cast<double>(got[i]) - want[i]));
      }
      EXPECT_LT(worst, 1e-4) << "step of " << n << " tokens";
    }
  }
}

TEST(MtpRunnerTest, AModelWithoutTheLayerIsRefused) {
  absl::StatusOr<std::unique_ptr<StepExecutor>> w = Worker((kFixtures / "deepseek_v3_tf5").string(), true);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kFailedPrecondition) << w.status();
  EXPECT_NE(w.status().message().find("num_nextn_predict_layers is 0"), std::string::npos) << w.status();
}

TEST(MtpRunnerTest, ACheckpointWithoutTheLayersTensorsIsRefused) {
  // deepseek_v3_tf5's tensors under a config.json announcing one MTP layer.
  char pattern[] = "/tmp/mtp_runner_test.XXXXXX";
  const fs::path dir = mkdtemp(pattern);
  const fs::path src = kFixtures / "deepseek_v3_tf5";
  fs::copy_file(src / "model.safetensors", dir / "model.safetensors");
  std::ifstream in(src / "config.json");
  nlohmann::json config = nlohmann::json::parse(in);
  config["num_nextn_predict_layers"] = 1;
  std::ofstream(dir / "config.json") << config.dump(2);
  absl::StatusOr<std::unique_ptr<StepExecutor>> plain = Worker(dir.string(), false);
  EXPECT_TRUE(plain.ok()) << "the model itself loads: " << plain.status();
  absl::StatusOr<std::unique_ptr<StepExecutor>> w = Worker(dir.string(), true);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kFailedPrecondition) << w.status();
  EXPECT_NE(w.status().message().find("model.layers.3.enorm.weight"), std::string::npos) << w.status();
  EXPECT_NE(w.status().message().find("num_nextn_predict_layers (1)"), std::string::npos) << w.status();
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace
}  // namespace shardserve
