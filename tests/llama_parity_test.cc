// Parity with Hugging Face transformers: for every fixture under tests/fixtures/models (made by
// tools/fixtures/make_parity_fixtures.py), the single-process forward pass must give the same last-position
// logits and the same 32 greedy tokens as transformers did, in float32 on the CPU backend and on
// the CUDA backend (skipped where no GPU is present), and stay close to them in lower precision
// (the CPU's bf16 products, the CUDA backend's bf16 and f16 activations).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/quant.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/kv_blocks.h"
#include "nlohmann/json.hpp"
#include "tests/golden.h"
#include "tests/bf16_products.h"
#include "worker/communicator.h"
#include "kernels/cuda/cuda_switches.h"
#include "worker/shard/greedy.h"
#include "worker/shard/model_shard.h"

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

// The fixtures without mixture-of-experts layers. Lower-precision engines run only these: a
// router picks its top k by logit, and on these tiny random models two experts' logits come within
// 1e-3 of each other somewhere in 32 tokens (tools/fixtures/make_parity_fixtures_tf5.py prints each MoE
// fixture's smallest gap), while bf16 rounding moves router logits by ~1e-2, so a lower-precision
// run may take another expert there and move the logits by far more than its rounding: such a
// comparison could not tell rounding from a broken kernel. Float32 engines, whose logits differ
// from transformers' by ~1e-6, route the same and run every fixture (LlamaParity).
std::vector<std::string> DenseFixtureNames() {
  std::vector<std::string> names;
  for (const std::string& name : FixtureNames()) {
    absl::StatusOr<ModelConfig> config = LoadModelConfig(kFixtures / name);
    if (!config.ok() || config->num_experts == 0) names.push_back(name);  // a bad config fails in LlamaParity
  }
  return names;
}

// The mixture-of-experts fixtures.
std::vector<std::string> MoeFixtureNames() {
  std::vector<std::string> names;
  for (const std::string& name : FixtureNames()) {
    absl::StatusOr<ModelConfig> config = LoadModelConfig(kFixtures / name);
    if (config.ok() && config->num_experts > 0) names.push_back(name);
  }
  return names;
}

// The fixtures whose sliding layers sit beside full-attention ones (Gemma 2 and 3: model/kv_blocks.h
// SlidingPoolWindow), which the workers give a KV pool of their own.
std::vector<std::string> SlidingPoolFixtureNames() {
  std::vector<std::string> names;
  for (const std::string& name : FixtureNames()) {
    absl::StatusOr<ModelConfig> config = LoadModelConfig(kFixtures / name);
    if (config.ok() && SlidingPoolWindow(*config) > 0) names.push_back(name);
  }
  return names;
}

// The fixtures the quantized-weight bounds below were measured on, all 64 or 128 inputs wide: not
// the ones tools/fixtures/make_parity_fixtures_tf5.py makes (*_tf5, *_tf4), which are there for the families
// and config.json formats of transformers 5 and have other widths (rows of 96 are one int4 group
// of 96, whose step, and so error, is larger than the bound's).
std::vector<std::string> QuantizationFixtureNames() {
  std::vector<std::string> names;
  for (const std::string& name : FixtureNames()) {
    if (!absl::EndsWith(name, "_tf5") && !absl::EndsWith(name, "_tf4")) names.push_back(name);
  }
  return names;
}


// 1e-4: both sides compute in float32, and only the order of summation differs (oneDNN vs
// PyTorch's kernels), which moves logits by ~1e-6 relative here. A real mistake (a wrong rope
// frequency, a missing bias, a wrong head mapping) moves them by 1e-2 or more.
constexpr double kLogitsTolerance = 1e-4;

// With bf16 products (CpuMatMul::kBF16) every product's inputs are rounded to 8 significant bits
// (relative error up to 2^-9), which moves these logits by ~1e-3 to 1e-2 of their scale; bf16 or
// f16 activations (the CUDA backend's) round every stored activation too. transformers itself,
// run in bf16 on these fixtures, is 0.016 to 0.057 from its float32 logits, in f16 0.002 to 0.006
// (tools/fixtures/hf_low_precision_error.py on an H100); the CUDA backend was 0.019 to 0.040 in bf16 and
// 0.001 to 0.005 in f16 there. The bound is loose by nature: it tells rounding from a broken
// kernel (a wrong layout or dtype gives errors of order 1), not from subtle model mistakes,
// which the float32 tests catch.
constexpr double kLowPrecisionLogitsTolerance = 5e-2;
// The fixtures where rounding alone moves transformers' own logits past that bound, with its
// bf16-against-float32 error there (tools/fixtures/hf_low_precision_error.py on the CPU): the bound is
// twice it. gemma3_cg_tf5 (a tied 72-wide embedding scaled by sqrt(72), read back as the LM head):
// 0.109 after the prompt.
double LowPrecisionTolerance(const std::string& fixture) {
  return fixture == "gemma3_cg_tf5" ? 2 * 0.109 : kLowPrecisionLogitsTolerance;
}
// int8 weights (LlamaInt8Weights below says why).
constexpr double kInt8LogitsTolerance = 1e-1;
// int4 weights (LlamaQuantizedWeights below says why).
constexpr double kInt4LogitsTolerance = 1.0;
// int4 and fp8 logits' correlation with HF's after the prompt, which logits collapsed to one value
// fail (0) though their normalized error (1) passes kInt4LogitsTolerance: measured 0.647 to 0.924
// for int4 and 0.982 to 0.993 for fp8 on these fixtures (AMD EPYC Zen 5, 2026-12-01).
constexpr double kInt4MinCorrelation = 0.5;
constexpr double kFp8MinCorrelation = 0.9;
constexpr double kInt4DequantizedTolerance = 1e-4;
// fp8 weights (LlamaQuantizedWeights below says why).
constexpr double kFp8LogitsTolerance = 0.5;
constexpr double kFp8DequantizedTolerance = 1e-4;
// int8-rounded activations against the exact products (LlamaActivationQuant below says why).
constexpr double kActivationQuantTolerance = 0.2;
// int16-rounded activations (int4 weights) against the exact products (likewise).
constexpr double kInt16ActivationTolerance = 2e-3;


// Where a forward pass runs: a backend and the precision of its arithmetic.
enum class Engine {
  kCpu,              // float32 (CpuMatMul::kF32)
  kCpuBf16Products,  // float32 activations, bf16 products (CpuMatMul::kBF16)
  kCuda,             // CUDA backend, float32 activations, true float32 cuBLAS products (no TF32)
  kCudaBf16,         // CUDA backend, bf16 activations (what a GPU worker runs for a bf16 checkpoint)
  kCudaF16,          // CUDA backend, f16 activations
  kCudaGraphs,       // kCuda with its decode steps replayed as CUDA graphs (CudaBackendOptions::step_graphs)
  kCudaSplitAttention,  // kCuda with small steps' attention split over the keys, 16 keys a range
  kCudaFused,        // kCuda with each residual add and the next RMSNorm as one kernel, RoPE + cache write
                     // as one, and (on the dense GEMV, as the worker runs) gate, up and SiLU x up as one
  kCudaDenseGemv,    // kCuda with decode products by the dense GEMV (CudaBackendOptions::dense_gemv)
  kCudaBf16DenseGemv,  // kCudaBf16 likewise
  kCudaDefaults,        // kCuda with every path the worker runs by default (CudaOptionsFromSwitches with no
                        // switch: graphs, split attention, the fused kernels, the dense GEMV)
  kCudaBf16Defaults,    // kCudaBf16 likewise: what a GPU worker serves a bf16 checkpoint with
  kCudaPdl,             // kCudaDefaults and programmatic dependent launch (CudaBackendOptions::pdl)
  kCudaBf16Pdl,         // kCudaBf16Defaults likewise
  kCudaMoeGrouped,      // kCudaDefaults and the grouped MoE experts (CudaBackendOptions::moe_grouped)
};

std::string EngineName(Engine e) {
  switch (e) {
    case Engine::kCpu: return "cpu";
    case Engine::kCpuBf16Products: return "cpu_bf16_products";
    case Engine::kCuda: return "cuda";
    case Engine::kCudaBf16: return "cuda_bf16";
    case Engine::kCudaF16: return "cuda_f16";
    case Engine::kCudaGraphs: return "cuda_graphs";
    case Engine::kCudaSplitAttention: return "cuda_split_attention";
    case Engine::kCudaFused: return "cuda_fused";
    case Engine::kCudaDenseGemv: return "cuda_dense_gemv";
    case Engine::kCudaBf16DenseGemv: return "cuda_bf16_dense_gemv";
    case Engine::kCudaDefaults: return "cuda_defaults";
    case Engine::kCudaBf16Defaults: return "cuda_bf16_defaults";
    case Engine::kCudaPdl: return "cuda_pdl";
    case Engine::kCudaBf16Pdl: return "cuda_bf16_pdl";
    case Engine::kCudaMoeGrouped: return "cuda_moe_grouped";
  }
  return "unknown";
}

void PrintTo(Engine e, std::ostream* os) { *os << EngineName(e); }

// Why `e` cannot run here, or "" where it can.
std::string MissingEngine(Engine e) {
  switch (e) {
    case Engine::kCpu: return "";
    case Engine::kCpuBf16Products: return CpuRunsBf16Products() ? "" : kNoBf16Products;
    case Engine::kCuda:
    case Engine::kCudaBf16:
    case Engine::kCudaF16:
    case Engine::kCudaGraphs:
    case Engine::kCudaSplitAttention:
    case Engine::kCudaFused:
    case Engine::kCudaDenseGemv:
    case Engine::kCudaBf16DenseGemv:
    case Engine::kCudaDefaults:
    case Engine::kCudaBf16Defaults:
    case Engine::kCudaPdl:
    case Engine::kCudaBf16Pdl:
    case Engine::kCudaMoeGrouped: return CudaDeviceCount() > 0 ? "" : "no CUDA device";
  }
  return "unknown engine";
}

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(Engine e) {
  switch (e) {
    case Engine::kCpu: return MakeCpuBackend(0, CpuMatMul::kF32);
    case Engine::kCpuBf16Products: return MakeCpuBackend(0, CpuMatMul::kBF16);
    case Engine::kCuda: return MakeCudaBackend(0, DType::kF32);
    case Engine::kCudaBf16: return MakeCudaBackend(0, DType::kBF16);
    case Engine::kCudaF16: return MakeCudaBackend(0, DType::kF16);
    case Engine::kCudaGraphs: return MakeCudaBackend(0, DType::kF32, {.step_graphs = true});
    case Engine::kCudaSplitAttention: return MakeCudaBackend(0, DType::kF32, {.split_attention_keys = 16});
    case Engine::kCudaFused:
      return MakeCudaBackend(0, DType::kF32, {.fused_kernels = true, .dense_gemv = true});
    case Engine::kCudaDenseGemv: return MakeCudaBackend(0, DType::kF32, {.dense_gemv = true});
    case Engine::kCudaBf16DenseGemv: return MakeCudaBackend(0, DType::kBF16, {.dense_gemv = true});
    case Engine::kCudaDefaults:
    case Engine::kCudaBf16Defaults:
    case Engine::kCudaPdl:
    case Engine::kCudaBf16Pdl:
    case Engine::kCudaMoeGrouped: {
      const bool f32 = e == Engine::kCudaDefaults || e == Engine::kCudaPdl || e == Engine::kCudaMoeGrouped;
      CudaBackendOptions options = CudaOptionsFromSwitches(*Flags::Parse({}, {}, WithCudaSwitches({})));
      options.split_attention_keys = 16;  // the fixtures' contexts are short: ranges of 16 keys split them
      options.pdl = e == Engine::kCudaPdl || e == Engine::kCudaBf16Pdl;
      options.moe_grouped = e == Engine::kCudaMoeGrouped;
      return MakeCudaBackend(0, f32 ? DType::kF32 : DType::kBF16, options);
    }
  }
  return absl::InvalidArgumentError("unknown engine");
}

using FixtureOnEngine = std::tuple<std::string, Engine>;

std::string ParamName(const ::testing::TestParamInfo<FixtureOnEngine>& info) {
  return std::get<0>(info.param) + "_" + EngineName(std::get<1>(info.param));
}

// A fixture on an engine; skipped where the engine cannot run.
class FixtureTest : public ::testing::TestWithParam<FixtureOnEngine> {
 protected:
  void SetUp() override {
    if (std::string why = MissingEngine(engine()); !why.empty()) GTEST_SKIP() << why;
  }
  const std::string& name() const { return std::get<0>(GetParam()); }
  Engine engine() const { return std::get<1>(GetParam()); }
};

// Float32 engines: the same greedy tokens as HF, logits within kLogitsTolerance.
class LlamaParity : public FixtureTest {};
// Lower-precision engines: logits within kLowPrecisionLogitsTolerance.
class LlamaLowPrecision : public FixtureTest {};

// A fixture's config and checkpoint, with a backend and a one-rank TP group to load whole-model
// shards of it.
// A checkpoint whose linear layers' weights (q/k/v/o, gate/up/down) read as their int4
// round trip, DequantizeInt4Groups(QuantizeInt4Groups(w)), whole (TP = 1 only): the float32
// engine on these runs the model --quantization int4 approximates, exactly up to float rounding.
class DequantizedWeights : public WeightSource {
 public:
  // quant: kInt4 or kFp8.
  DequantizedWeights(const WeightSource* inner, WeightQuant quant) : inner_(inner), quant_(quant) {}
  absl::Status CheckShape(const std::string& name, const std::vector<int64_t>& shape) const override {
    return inner_->CheckShape(name, shape);
  }
  absl::Status Read(const std::string& name, const std::vector<int64_t>& shape, const Slice& slice, DType dtype,
                    void* dst) const override {
    static const std::vector<std::string> kLinear = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                                                     "gate_proj.weight", "up_proj.weight", "down_proj.weight"};
    const bool linear = std::any_of(kLinear.begin(), kLinear.end(),
                                    [&](const std::string& s) { return absl::EndsWith(name, "." + s); });
    if (!linear) return inner_->Read(name, shape, slice, dtype, dst);
    if (dtype != DType::kF32 || shape.size() != 2 || slice.begin != 0 ||
        (slice.end != -1 && slice.end != shape[slice.dim])) {
      return absl::UnimplementedError("DequantizedWeights: whole float32 matrices only");
    }
    const int64_t m = shape[0], k = shape[1];
    std::vector<float> w(m * k);
    SHARDSERVE_RETURN_IF_ERROR(inner_->Read(name, shape, Slice{}, DType::kF32, w.data()));
    if (quant_ == WeightQuant::kFp8) {
      std::vector<float> scale(m);
      std::vector<uint8_t> q(m * k);
      SHARDSERVE_RETURN_IF_ERROR(QuantizeFp8Rows(scale.data(), q.data(), w.data(), m, k));
      DequantizeFp8Rows(static_cast<float*>(dst), scale.data(), q.data(), m, k);
      return absl::OkStatus();
    }
    std::vector<Int4Group128> blocks(m * Int4GroupsLayout{m, k}.groups_per_row());
    SHARDSERVE_RETURN_IF_ERROR(QuantizeInt4Groups(blocks.data(), w.data(), m, k));
    DequantizeInt4Groups(static_cast<float*>(dst), blocks.data(), m, k);
    return absl::OkStatus();
  }

 private:
  const WeightSource* inner_;
  WeightQuant quant_;
};

struct LoadedFixture {
  ModelConfig config;
  std::unique_ptr<Checkpoint> ckpt;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<LocalCommunicator> tp;

  absl::StatusOr<std::unique_ptr<ModelShard>> Load(const StepLimits& opt, WeightQuant quant = WeightQuant::kNone) {
    ShardSpec spec;
    spec.weight_quant = quant;
    return ModelShard::Load(*ckpt, config, spec, opt, backend.get(), tp.get());
  }
};

void OpenFixture(const fs::path& dir, Engine engine, LoadedFixture* f) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeBackend(engine);
  ASSERT_TRUE(backend.ok()) << backend.status();
  f->backend = std::move(*backend);
  f->tp = std::make_unique<LocalCommunicator>(f->backend.get());
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  f->config = *config;
  f->ckpt = std::move(*ckpt);
}

// Runs greedy generation with prefill chunks of `chunk` tokens on `engine` and checks it against HF.
void CheckAgainstHuggingFace(const std::string& name, Engine engine, int64_t chunk) {
  const fs::path dir = kFixtures / name;
  const Golden g = ReadGolden(dir);
  ASSERT_EQ(g.greedy.size(), 32u);

  LoadedFixture f;
  ASSERT_NO_FATAL_FAILURE(OpenFixture(dir, engine, &f));
  const StepLimits opt{.max_tokens_per_step = chunk, .max_seqs_per_step = 1, .block_size = 16, .num_kv_blocks = 8,
                       .max_model_len = 8 * 16};
  absl::StatusOr<std::unique_ptr<ModelShard>> model = f.Load(opt);
  ASSERT_TRUE(model.ok()) << model.status();

  std::vector<std::vector<float>> logits;
  absl::StatusOr<std::vector<int32_t>> ids = GreedyGenerate(model->get(), g.prompt, 32, &logits);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, g.greedy) << name << ": greedy tokens differ from Hugging Face's";
  ASSERT_EQ(logits.size(), 32u);
  // One logit per vocabulary entry, on both sides.
  const size_t V = static_cast<size_t>(f.config.vocab_size);
  ASSERT_EQ(g.prompt_last_logits.size(), V) << name << ": golden.json's prompt_last_logits";
  ASSERT_EQ(g.final_logits.size(), V) << name << ": golden.json's final_logits";
  ASSERT_EQ(logits.front().size(), V) << name << ": logits after the prompt";
  ASSERT_EQ(logits.back().size(), V) << name << ": logits at the 32nd decode step";
  const double prefill_err = NormalizedError(logits.front(), g.prompt_last_logits);
  const double decode_err = NormalizedError(logits.back(), g.final_logits);
  EXPECT_LE(prefill_err, kLogitsTolerance) << name << ": logits after the prompt";
  EXPECT_LE(decode_err, kLogitsTolerance) << name << ": logits at the 32nd decode step";
  std::printf("[ parity   ] %s on %s, chunk=%lld: prefill logits error %.3g, decode logits error %.3g\n",
              name.c_str(), EngineName(engine).c_str(), static_cast<long long>(chunk), prefill_err, decode_err);
  if (engine == Engine::kCudaGraphs || engine == Engine::kCudaDefaults || engine == Engine::kCudaPdl) {  // as graphs
    if (f.config.num_experts > 0) {  // the CUDA MoeExperts' loop reads its offsets on the host: graphs off, said
      EXPECT_NE(model->get()->step_graphs_off(), "");
      EXPECT_EQ(model->get()->step_graphs_recorded(), 0);
    } else {
      EXPECT_EQ(model->get()->step_graphs_off(), "");
      EXPECT_GE(model->get()->step_graphs_recorded(), 1);
    }
  }
  if (engine == Engine::kCudaMoeGrouped) {
    if (name.find("mxfp4") != std::string::npos) {  // MXFP4 experts keep the loop: the recording is refused, said
      EXPECT_NE(model->get()->step_graphs_off(), "");
    } else {  // the grouped GEMV reads the offsets on the device: MoE decode steps recorded
      EXPECT_EQ(model->get()->step_graphs_off(), "");
      EXPECT_GE(model->get()->step_graphs_recorded(), 1);
    }
  }
}

TEST_P(LlamaParity, WholePromptInOneStep) { CheckAgainstHuggingFace(name(), engine(), 128); }

// Prefill in chunks of 5 tokens exercises attention over cache entries written by earlier steps
// and block boundaries that fall inside a chunk.
TEST_P(LlamaParity, ChunkedPrefill) { CheckAgainstHuggingFace(name(), engine(), 5); }

// The sliding layers in a KV pool of their own (Gemma 2 and 3), only as large as their window and a
// step need (model/kv_blocks.h KvBlocksHeld): the sequence's blocks go round it as a ring
// (GreedyGenerate), so the blocks behind the window are overwritten while the full-attention layers
// keep every block. The fixtures slide over 32 tokens and their prompts have 48, so the ring turns
// before the first token is sampled and about 8 times more as 32 tokens are generated (blocks of 4
// tokens, prefill chunks of 5): still HF's greedy tokens and logits. A ring of 8 blocks (32 tokens,
// fewer than the window's 31 and a chunk's 5) overwrites keys inside the window of a chunk's first
// tokens, and the logits leave HF's: the test sees the pool.
class SlidingPoolParity : public FixtureTest {};
TEST_P(SlidingPoolParity, SlidingLayersInTheirOwnPoolMatchHuggingFace) {
  const fs::path dir = kFixtures / name();
  const Golden g = ReadGolden(dir);
  LoadedFixture f;
  ASSERT_NO_FATAL_FAILURE(OpenFixture(dir, engine(), &f));
  const int64_t window = SlidingPoolWindow(f.config), chunk = 5, bs = 4;
  const int64_t total = static_cast<int64_t>(g.prompt.size()) + 32;
  ASSERT_GT(static_cast<int64_t>(g.prompt.size()), window) << name() << ": the prompt must be longer than the window";
  StepLimits opt{.max_tokens_per_step = chunk, .max_seqs_per_step = 1, .block_size = bs,
                 .num_kv_blocks = KvBlocksFor(total, bs), .max_model_len = KvBlocksFor(total, bs) * bs};
  opt.num_sliding_kv_blocks = KvBlocksHeld(window, chunk, total, bs);
  ASSERT_LE(opt.num_sliding_kv_blocks, opt.num_kv_blocks / 2);
  const int64_t too_small = KvBlocksFor(window - 1 + chunk, bs) - 1;
  for (const int64_t ring : {opt.num_sliding_kv_blocks, too_small}) {
    StepLimits limits = opt;
    limits.num_sliding_kv_blocks = ring;
    absl::StatusOr<std::unique_ptr<ModelShard>> model = f.Load(limits);
    ASSERT_TRUE(model.ok()) << model.status();
    std::vector<std::vector<float>> logits;
    absl::StatusOr<std::vector<int32_t>> ids = GreedyGenerate(model->get(), g.prompt, 32, &logits);
    ASSERT_TRUE(ids.ok()) << ids.status();
    ASSERT_EQ(logits.size(), 32u);
    const double prefill_err = NormalizedError(logits.front(), g.prompt_last_logits);
    const double decode_err = NormalizedError(logits.back(), g.final_logits);
    std::printf("[ parity   ] %s on %s, sliding pool of %lld blocks of %lld (full pool %lld): prefill logits error %.3g, "
                "decode logits error %.3g\n",
                name().c_str(), EngineName(engine()).c_str(), static_cast<long long>(ring), static_cast<long long>(bs),
                static_cast<long long>(opt.num_kv_blocks), prefill_err, decode_err);
    if (ring == opt.num_sliding_kv_blocks) {
      EXPECT_EQ(*ids, g.greedy) << name() << ": greedy tokens differ from Hugging Face's";
      EXPECT_LE(prefill_err, kLogitsTolerance) << name() << ": logits after the prompt";
      EXPECT_LE(decode_err, kLogitsTolerance) << name() << ": logits at the 32nd decode step";
    } else {
      EXPECT_GT(std::max(prefill_err, decode_err), 100 * kLogitsTolerance)
          << name() << ": a ring smaller than the window and a step changed nothing";
    }
  }
}

// A lower-precision engine (the CPU's bf16 products, worker --matmul-dtype bf16; the CUDA
// backend's bf16 or f16 activations) against the same float32 reference, on the same two
// contexts: the prompt, and the prompt followed by HF's first 31 greedy tokens (fed as one prompt,
// so that a near-tie decided the other way earlier cannot change the context). Greedy tokens
// themselves may part from HF's at a near-tie (on these random-weight models some do within 32
// tokens), so they are only reported.
TEST_P(LlamaLowPrecision, StaysCloseToHuggingFace) {
  const fs::path dir = kFixtures / name();
  const Golden g = ReadGolden(dir);
  ASSERT_EQ(g.greedy.size(), 32u);
  LoadedFixture f;
  ASSERT_NO_FATAL_FAILURE(OpenFixture(dir, engine(), &f));
  const StepLimits opt{.max_tokens_per_step = 256, .max_seqs_per_step = 16, .block_size = 16, .num_kv_blocks = 8,
                       .max_model_len = 8 * 16};
  auto last_logits = [&](const std::vector<int32_t>& prompt, std::vector<int32_t>* ids) -> std::vector<float> {
    absl::StatusOr<std::unique_ptr<ModelShard>> model = f.Load(opt);
    EXPECT_TRUE(model.ok()) << model.status();
    if (!model.ok()) return {};
    std::vector<std::vector<float>> logits;
    absl::StatusOr<std::vector<int32_t>> got = GreedyGenerate(model->get(), prompt, ids != nullptr ? 32 : 1, &logits);
    EXPECT_TRUE(got.ok()) << got.status();
    if (!got.ok()) return {};
    if (ids != nullptr) *ids = *got;
    return logits.front();
  };
  std::vector<int32_t> ids;
  const std::vector<float> prefill = last_logits(g.prompt, &ids);
  std::vector<int32_t> forced = g.prompt;
  forced.insert(forced.end(), g.greedy.begin(), g.greedy.end() - 1);
  const std::vector<float> decode = last_logits(forced, nullptr);
  // One logit per vocabulary entry, on both sides.
  const size_t V = static_cast<size_t>(f.config.vocab_size);
  ASSERT_EQ(g.prompt_last_logits.size(), V) << name() << ": golden.json's prompt_last_logits";
  ASSERT_EQ(g.final_logits.size(), V) << name() << ": golden.json's final_logits";
  ASSERT_EQ(prefill.size(), V) << name() << ": logits after the prompt";
  ASSERT_EQ(decode.size(), V) << name() << ": logits after the prompt and 31 of HF's tokens";
  ASSERT_EQ(ids.size(), 32u);
  const double prefill_err = NormalizedError(prefill, g.prompt_last_logits);
  const double decode_err = NormalizedError(decode, g.final_logits);
  EXPECT_LE(prefill_err, LowPrecisionTolerance(name())) << name() << ": logits after the prompt";
  EXPECT_LE(decode_err, LowPrecisionTolerance(name())) << name() << ": logits after the prompt and 31 of HF's tokens";
  int same = 0;
  while (same < 32 && ids[same] == g.greedy[same]) ++same;
  std::printf("[ parity   ] %s on %s: prefill logits error %.3g, logits after 31 HF tokens error %.3g; "
              "the first %d of 32 greedy tokens equal HF's\n",
              name().c_str(), EngineName(engine()).c_str(), prefill_err, decode_err, same);
}

// Continuous batching over the paged KV cache, as the coordinator's scheduler plans steps: three
// sequences of different prompt lengths share every step (each its own token_seq row, the rows
// in a different order each step), their block tables hold disjoint, shuffled, non-contiguous
// blocks of 4 tokens, prompts are fed in chunks of at most 4 tokens and start at different
// steps, so decodes of one sequence run in the same step as prefill chunks of another. Every
// sequence must get the greedy tokens and logits it gets alone (GreedyGenerate, whole prompt in
// one step, blocks in order). The tolerance is the HF one above: only the GEMM shapes differ.
TEST_P(LlamaParity, BatchedSequencesMatchRunningAlone) {
  const std::string& name = this->name();
  const fs::path dir = kFixtures / name;
  const Golden g = ReadGolden(dir);
  ASSERT_GE(g.prompt.size(), 9u);
  LoadedFixture f;
  ASSERT_NO_FATAL_FAILURE(OpenFixture(dir, engine(), &f));
  Backend* backend = f.backend.get();

  constexpr int64_t kNewTokens = 10, kChunk = 4, kSeqs = 3;
  struct Seq {
    std::vector<int32_t> prompt;
    int start_step;
    std::vector<int32_t> want_ids;  // alone
    std::vector<std::vector<float>> want_logits;
    std::vector<int32_t> table;     // [max_blocks_per_seq] block ids
    std::vector<int32_t> tokens;    // prompt, then the tokens generated so far
    int64_t cached = 0;             // tokens[0, cached) are in the KV cache
    std::vector<int32_t> got_ids;
    std::vector<std::vector<float>> got_logits;
  };
  std::vector<Seq> seqs(kSeqs);
  seqs[0].prompt = g.prompt;                                                  // 12 or 40 tokens, from step 0
  seqs[1].prompt.assign(g.prompt.rbegin(), g.prompt.rbegin() + 9);           // 9 tokens, from step 2
  seqs[2].prompt = {g.prompt[1], g.prompt[4], g.prompt[2]};                   // 3 tokens, from step 3
  seqs[0].start_step = 0;
  seqs[1].start_step = 2;
  seqs[2].start_step = 3;

  // Each sequence alone, on a fresh shard.
  for (Seq& s : seqs) {
    absl::StatusOr<std::unique_ptr<ModelShard>> alone = f.Load(StepLimits{
        .max_tokens_per_step = 256, .max_seqs_per_step = 16, .block_size = 16, .num_kv_blocks = 64, .max_model_len = 512});
    ASSERT_TRUE(alone.ok()) << alone.status();
    absl::StatusOr<std::vector<int32_t>> ids = GreedyGenerate(alone->get(), s.prompt, kNewTokens, &s.want_logits);
    ASSERT_TRUE(ids.ok()) << ids.status();
    s.want_ids = *ids;
  }

  // All three in one shard: 48 blocks of 4 tokens, shuffled, 16 to each sequence.
  StepLimits opt{.max_tokens_per_step = 16, .max_seqs_per_step = kSeqs, .block_size = 4, .max_model_len = 16 * 4};
  opt.num_kv_blocks = kSeqs * opt.max_blocks_per_seq();
  absl::StatusOr<std::unique_ptr<ModelShard>> model = f.Load(opt);
  ASSERT_TRUE(model.ok()) << model.status();
  std::vector<int32_t> blocks(opt.num_kv_blocks);
  std::iota(blocks.begin(), blocks.end(), 0);
  std::shuffle(blocks.begin(), blocks.end(), std::mt19937(7));
  for (int64_t i = 0; i < kSeqs; ++i) {
    seqs[i].table.assign(blocks.begin() + i * opt.max_blocks_per_seq(), blocks.begin() + (i + 1) * opt.max_blocks_per_seq());
    seqs[i].tokens = seqs[i].prompt;
  }
  absl::StatusOr<Buffer> next_buf = backend->Allocate(kSeqs * sizeof(int32_t));
  ASSERT_TRUE(next_buf.ok());
  const int64_t V = f.config.vocab_size;

  bool mixed = false;  // some step held a decode and a prefill chunk of more than one token
  for (int step = 0;; ++step) {
    ASSERT_LT(step, 100) << "the schedule does not finish";
    std::vector<int> active;
    for (int i = 0; i < kSeqs; ++i) {
      if (step >= seqs[i].start_step && static_cast<int64_t>(seqs[i].got_ids.size()) < kNewTokens) active.push_back(i);
    }
    if (active.empty()) break;
    std::rotate(active.begin(), active.begin() + step % active.size(), active.end());  // rows move between steps

    StepBatch b;
    b.num_seqs = static_cast<int32_t>(active.size());
    std::vector<int> sampled;  // the sequence of each logit row
    bool decode = false, prefill = false;
    for (int row = 0; row < b.num_seqs; ++row) {
      Seq& s = seqs[active[row]];
      b.block_tables.insert(b.block_tables.end(), s.table.begin(), s.table.end());
      const int64_t chunk = std::min<int64_t>(static_cast<int64_t>(s.tokens.size()) - s.cached, kChunk);
      if (!s.got_ids.empty()) {
        decode = true;
      } else if (chunk > 1) {
        prefill = true;
      }
      for (int64_t t = 0; t < chunk; ++t) {
        const int64_t pos = s.cached + t;
        b.token_ids.push_back(s.tokens[pos]);
        b.positions.push_back(static_cast<int32_t>(pos));
        b.token_seq.push_back(row);
        b.slots.push_back(static_cast<int32_t>(s.table[pos / opt.block_size] * opt.block_size + pos % opt.block_size));
      }
      s.cached += chunk;
      if (s.cached == static_cast<int64_t>(s.tokens.size())) {  // its last known token: sample the next
        b.logit_rows.push_back(static_cast<int32_t>(b.positions.size()) - 1);
        sampled.push_back(active[row]);
      }
    }
    mixed |= decode && prefill;
    ASSERT_TRUE(model->get()->Forward(b).ok()) << "step " << step;

    const int64_t m = static_cast<int64_t>(b.logit_rows.size());
    if (m == 0) continue;
    const Tensor logits = model->get()->logits(m);
    Tensor next(next_buf->data(), DType::kI32, {m});
    ASSERT_TRUE(backend->Argmax(&next, logits).ok());
    std::vector<int32_t> ids(m);
    ASSERT_TRUE(backend->CopyToHost(ids.data(), next.data, m * sizeof(int32_t)).ok());
    for (int64_t i = 0; i < m; ++i) {
      Seq& s = seqs[sampled[i]];
      s.got_logits.emplace_back(V);
      ASSERT_TRUE(backend->CopyToHost(s.got_logits.back().data(), logits.as<float>() + i * V, V * sizeof(float)).ok());
      s.got_ids.push_back(ids[i]);
      s.tokens.push_back(ids[i]);
    }
  }
  EXPECT_TRUE(mixed) << "no step mixed a decode with a prefill chunk";

  for (int i = 0; i < kSeqs; ++i) {
    const Seq& s = seqs[i];
    EXPECT_EQ(s.got_ids, s.want_ids) << name << " sequence " << i << ": batched greedy tokens differ from alone";
    ASSERT_EQ(s.got_logits.size(), s.want_logits.size());
    ASSERT_EQ(s.want_logits.size(), static_cast<size_t>(kNewTokens)) << name << " sequence " << i;
    double worst = 0;
    for (size_t k = 0; k < s.got_logits.size(); ++k) {
      ASSERT_EQ(s.got_logits[k].size(), static_cast<size_t>(V)) << name << " sequence " << i << " token " << k;
      ASSERT_EQ(s.want_logits[k].size(), static_cast<size_t>(V)) << name << " sequence " << i << " token " << k;
      worst = std::max(worst, NormalizedError(s.got_logits[k], s.want_logits[k]));
    }
    EXPECT_LE(worst, kLogitsTolerance) << name << " sequence " << i << ": batched logits differ from alone";
    std::printf("[ batched  ] %s on %s, sequence %d (%zu prompt tokens): worst logits error vs alone %.3g\n",
                name.c_str(), EngineName(engine()).c_str(), i, s.prompt.size(), worst);
  }
}

// int8 weights (--quantization int8: the linear layers' weights quantized at load, one scale per
// output channel) against the same float32 reference as the lower-precision engines. Each weight
// is off by up to half a step, 1/254 of its row's largest; these fixtures' weights are uniformly
// random, so a typical weight is half its row's largest and off by up to ~1/127 of itself, and
// their logits move by 0.026 to 0.055 of their scale (measured, AMD EPYC, 2026-11-24): within
// kInt8LogitsTolerance, while a wrong scale or a mis-packed row moves them by ~1. The float32 run
// of the same fixture must differ from the int8 one (the weights really were quantized); greedy
// tokens are only reported (near-ties, as above).
TEST(LlamaInt8Weights, StayCloseToHuggingFace) {
  for (const std::string& name : QuantizationFixtureNames()) {
    const fs::path dir = kFixtures / name;
    const Golden g = ReadGolden(dir);
    ASSERT_EQ(g.greedy.size(), 32u);
    LoadedFixture f;
    ASSERT_NO_FATAL_FAILURE(OpenFixture(dir, Engine::kCpu, &f));
    const StepLimits opt{.max_tokens_per_step = 256, .max_seqs_per_step = 16, .block_size = 16, .num_kv_blocks = 8,
                         .max_model_len = 8 * 16};
    std::vector<float> logits_by[2];
    std::vector<int32_t> ids;
    for (WeightQuant quant : {WeightQuant::kNone, WeightQuant::kInt8}) {
      absl::StatusOr<std::unique_ptr<ModelShard>> model = f.Load(opt, quant);
      ASSERT_TRUE(model.ok()) << name << ": " << model.status();
      std::vector<std::vector<float>> logits;
      absl::StatusOr<std::vector<int32_t>> got = GreedyGenerate(model->get(), g.prompt, 32, &logits);
      ASSERT_TRUE(got.ok()) << name << ": " << got.status();
      logits_by[quant == WeightQuant::kInt8] = logits.front();
      if (quant == WeightQuant::kInt8) ids = *got;
    }
    const size_t V = static_cast<size_t>(f.config.vocab_size);
    ASSERT_EQ(g.prompt_last_logits.size(), V) << name;
    ASSERT_EQ(logits_by[1].size(), V) << name;
    EXPECT_NE(logits_by[0], logits_by[1]) << name << ": int8 weights gave the float32 logits bit for bit";
    const double err = NormalizedError(logits_by[1], g.prompt_last_logits);
    EXPECT_LE(err, kInt8LogitsTolerance) << name << ": int8 logits after the prompt";
    int same = 0;
    while (same < 32 && ids[same] == g.greedy[same]) ++same;
    std::printf("[ parity   ] %s with int8 weights: prefill logits error %.3g; the first %d of 32 greedy tokens "
                "equal HF's\n",
                name.c_str(), err, same);
  }
}

// int4 weights (--quantization int4: the linear layers' weights quantized at load in groups of 128
// inputs, a scale and a zero point each; these fixtures' rows of 64 inputs are one short group,
// their rows of 128 one whole group). Two checks:
// 1. Against the float32 engine running the int4 weights' round trip (DequantizedWeights, the
//    model int4 stands for; LlamaParity holds the float32 engine to Hugging Face's logits within
//    kLogitsTolerance): the same logits up to float32 rounding (measured 2.7e-6 to 7.4e-6 over 32
//    steps, AMD EPYC, 2026-11-24; the int4 product's per-group zero-point sums round ~10x more than
//    a plain float32 product, tests/kernels_cpu_test.cc), within kInt4DequantizedTolerance, and
//    the same 32 greedy tokens. A wrong nibble, zero point or scale moves logits by >= 1e-2.
// 2. Against Hugging Face's float32 logits: each weight moves by up to one step, (range of its
//    group) / 15, against int8's half step of (largest in its row) / 127: on these uniformly random
//    weights a step ~17x int8's (254 / 15), and the logits move in proportion: 0.39 to 0.82 of
//    their scale (measured, AMD EPYC, 2026-11-24) against int8's 0.026 to 0.055, so the bound is
//    int8's measured worst x 17 ~ 0.95, rounded to kInt4LogitsTolerance. On models this small
//    (64-wide rows, uniformly random weights) 4 bits change the model, so greedy tokens are only
//    reported; the first check is the one that catches a broken int4 path.
// fp8 weights (--quantization fp8: e4m3 with one scale per output channel, quantized at load).
// As int4's, two checks:
// 1. Against the float32 engine running the fp8 weights' round trip (DequantizedWeights): the same
//    logits up to float32 rounding (an fp8 product rounds as an int8 one: 1e-5 per op in
//    tests/kernels_cpu_test.cc; over the layers and 32 steps int4 measured < 1e-5), within
//    kFp8DequantizedTolerance, and the same 32 greedy tokens. A wrong bit in the e4m3 conversion
//    moves a weight by >= 2^-3 of itself and the logits by >> 1e-3.
// 2. Against Hugging Face's float32 logits: e4m3 keeps 3 mantissa bits, so each weight moves by
//    up to 2^-4 of itself (half its relative step 2^-3): on these uniformly random weights an rms
//    error of ~1.6% of a row's largest against int8's ~0.23% (half-step rms (largest / 127) /
//    sqrt(12)), ~7x int8's; the logits measured 0.12 to 0.19 of their scale (AMD EPYC,
//    2026-11-24; 2.8e-6 at worst in check 1) against int8's 0.026 to 0.055 (3-5x). The bound is
//    int8's measured worst x 7 ~ 0.39, rounded up to kFp8LogitsTolerance; a wrong scale or layout
//    gives ~1. Greedy tokens are only reported, as int8's (the first 0 to 10 of 32 equal HF's on
//    these 64-wide random models).
// Both checks, for int4 and for fp8 (the test parameter); int8's logits against Hugging Face's are
// printed beside them for scale (LlamaInt8Weights checks int8).
class LlamaQuantizedWeights : public ::testing::TestWithParam<WeightQuant> {};

TEST_P(LlamaQuantizedWeights, MatchTheDequantizedModelAndStayNearHuggingFace) {
  const WeightQuant quant = GetParam();
  const std::string q = WeightQuantName(quant);
  const double dequantized_tolerance = quant == WeightQuant::kInt4 ? kInt4DequantizedTolerance : kFp8DequantizedTolerance;
  const double logits_tolerance = quant == WeightQuant::kInt4 ? kInt4LogitsTolerance : kFp8LogitsTolerance;
  for (const std::string& name : QuantizationFixtureNames()) {
    const fs::path dir = kFixtures / name;
    const Golden g = ReadGolden(dir);
    ASSERT_EQ(g.greedy.size(), 32u);
    LoadedFixture f;
    ASSERT_NO_FATAL_FAILURE(OpenFixture(dir, Engine::kCpu, &f));
    const StepLimits opt{.max_tokens_per_step = 256, .max_seqs_per_step = 16, .block_size = 16, .num_kv_blocks = 8,
                         .max_model_len = 8 * 16};
    const auto run = [&](const WeightSource& weights, WeightQuant weight_quant, std::vector<std::vector<float>>* logits)
        -> absl::StatusOr<std::vector<int32_t>> {
      ShardSpec spec;
      spec.weight_quant = weight_quant;
      SHARDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<ModelShard> model,
                                  ModelShard::Load(weights, f.config, spec, opt, f.backend.get(), f.tp.get()));
      return GreedyGenerate(model.get(), g.prompt, 32, logits);
    };
    std::vector<std::vector<float>> quantized_logits, dequantized_logits, int8_logits;
    absl::StatusOr<std::vector<int32_t>> quantized = run(*f.ckpt, quant, &quantized_logits);
    ASSERT_TRUE(quantized.ok()) << name << ": " << quantized.status();
    const DequantizedWeights dequantized_weights(f.ckpt.get(), quant);
    absl::StatusOr<std::vector<int32_t>> dequantized = run(dequantized_weights, WeightQuant::kNone, &dequantized_logits);
    ASSERT_TRUE(dequantized.ok()) << name << ": " << dequantized.status();
    ASSERT_TRUE(run(*f.ckpt, WeightQuant::kInt8, &int8_logits).ok()) << name;
    const size_t V = static_cast<size_t>(f.config.vocab_size);
    ASSERT_EQ(g.prompt_last_logits.size(), V) << name;
    ASSERT_EQ(quantized_logits.front().size(), V) << name;

    double worst = 0;
    for (size_t step = 0; step < quantized_logits.size(); ++step) {
      worst = std::max(worst, NormalizedError(quantized_logits[step], dequantized_logits[step]));
    }
    EXPECT_LE(worst, dequantized_tolerance) << name << ": " << q << " against its dequantized weights in float32";
    EXPECT_EQ(*quantized, *dequantized) << name << ": greedy tokens of " << q << " and of its dequantized weights";
    const double err = NormalizedError(quantized_logits.front(), g.prompt_last_logits);
    const double int8_err = NormalizedError(int8_logits.front(), g.prompt_last_logits);
    EXPECT_GT(err, 0) << name << ": " << q << " weights gave HF's float32 logits exactly";
    EXPECT_LE(err, logits_tolerance) << name << ": " << q << " logits after the prompt";
    // The bound above passes logits that collapsed to zeros (an error of exactly 1): they must also
    // rise and fall with HF's.
    const double corr = Correlation(quantized_logits.front(), g.prompt_last_logits);
    EXPECT_GE(corr, quant == WeightQuant::kInt4 ? kInt4MinCorrelation : kFp8MinCorrelation) << name << ": " << q << " logits' correlation with HF's after the prompt";
    int same = 0;
    while (same < 32 && (*quantized)[same] == g.greedy[same]) ++same;
    std::printf("[ parity   ] %s with %s weights: logits error %.3g against the dequantized model (32 steps' "
                "worst), %.3g against HF after the prompt (int8: %.3g), correlation %.3f; the first %d of 32 greedy "
                "tokens equal HF's\n",
                name.c_str(), q.c_str(), worst, err, int8_err, corr, same);
  }
}

// The bounds above fail a model whose logits collapsed: all zeros pass the int4 error bound (an error
// of exactly 1) but not the correlation.
TEST(LlamaQuantizedBounds, FailLogitsThatCollapsed) {
  const Golden g = ReadGolden(kFixtures / "llama_gqa");
  const std::vector<float> zeros(g.prompt_last_logits.size(), 0.0f);
  const std::vector<float> constant(g.prompt_last_logits.size(), 3.0f);
  EXPECT_LE(NormalizedError(zeros, g.prompt_last_logits), kInt4LogitsTolerance);
  EXPECT_LT(Correlation(zeros, g.prompt_last_logits), kInt4MinCorrelation);
  EXPECT_LT(Correlation(constant, g.prompt_last_logits), kInt4MinCorrelation);
  EXPECT_GT(Correlation(g.prompt_last_logits, g.prompt_last_logits), 0.999);
}

INSTANTIATE_TEST_SUITE_P(Formats, LlamaQuantizedWeights, ::testing::Values(WeightQuant::kInt4, WeightQuant::kFp8),
                         [](const ::testing::TestParamInfo<WeightQuant>& info) {
                           return std::string(WeightQuantName(info.param));
                         });

// --activation-quantization int8 (CpuActivationQuant::kInt8: the int8 and int4 weights' products
// on int8-rounded inputs, AVX-512 VNNI or AVX2) against the same weights multiplied exactly (the default).
// Each input of a product moves by up to half a step, (its row's largest) / 254, as llama.cpp's
// Q8_0 activations do: the same step as int8 weights' (LlamaInt8Weights), on the other operand.
// Checked per fixture, for int8 and int4 weights:
// 1. The logits after the prompt and at every decode step while the two runs' greedy tokens agree
//    (a later step's context differs), against the exact run's: measured 0.050 to 0.108 (AMD EPYC,
//    2026-11-25; the worst over up to 32 steps), against int8 weights' 0.026 to 0.055 from HF
//    after the prompt alone. Activations are further from uniform than these fixtures' weights (a
//    row's largest is more times its rms), so the same step costs about twice as much. The bound,
//    kActivationQuantTolerance = 0.2, is the measured worst x ~2; a wrong scale, block sum or
//    zero-point term in the integer products moves the logits by ~1.
// 2. Against Hugging Face's float32 logits after the prompt: within the weights' own bound
//    (kInt8LogitsTolerance, kInt4LogitsTolerance) plus kActivationQuantTolerance (measured int8
//    0.054 to 0.094 against exact int8's 0.026 to 0.055; int4 0.40 to 0.83, as exact int4's).
// 3. The first greedy token equals the exact run's on every fixture (measured: the first 2 to 32
//    of 32 equal; near-ties on these 64-wide random models part them later, so the rest, and the
//    tokens against HF's, are reported). The runs must differ (the integer path really ran).
// --activation-quantization int16 (int4 weights only; AVX-512 VNNI) is held to the same checks with
// kInt16ActivationTolerance = 2e-3: each input moves by up to 1/65534 of its group of 128's
// largest, 258 times less than int8's step; measured 2.9e-4 to 7.9e-4 against the exact products
// over all 32 steps, the greedy tokens all 32 of the exact run's on every fixture (AMD EPYC Zen 4,
// 2026-12-04); at least the first 16 must be.
class LlamaActivationQuant : public ::testing::TestWithParam<CpuActivationQuant> {};

TEST_P(LlamaActivationQuant, StaysNearTheExactProducts) {
  const CpuActivationQuant act_quant = GetParam();
  const double tolerance =
      act_quant == CpuActivationQuant::kInt8 ? kActivationQuantTolerance : kInt16ActivationTolerance;
  if (absl::StatusOr<std::unique_ptr<Backend>> probe = MakeCpuBackend(1, CpuMatMul::kF32, act_quant); !probe.ok()) {
    GTEST_SKIP() << probe.status();
  }
  for (const std::string& name : QuantizationFixtureNames()) {
    const fs::path dir = kFixtures / name;
    const Golden g = ReadGolden(dir);
    ASSERT_EQ(g.greedy.size(), 32u);
    LoadedFixture f;
    ASSERT_NO_FATAL_FAILURE(OpenFixture(dir, Engine::kCpu, &f));
    absl::StatusOr<std::unique_ptr<Backend>> act_backend = MakeCpuBackend(0, CpuMatMul::kF32, act_quant);
    ASSERT_TRUE(act_backend.ok()) << act_backend.status();
    LocalCommunicator act_tp(act_backend->get());
    const char* acts = CpuActivationQuantName(act_quant);
    const StepLimits opt{.max_tokens_per_step = 256, .max_seqs_per_step = 16, .block_size = 16, .num_kv_blocks = 8,
                         .max_model_len = 8 * 16};
    const auto run = [&](Backend* backend, Communicator* tp, WeightQuant quant, std::vector<std::vector<float>>* logits)
        -> absl::StatusOr<std::vector<int32_t>> {
      ShardSpec spec;
      spec.weight_quant = quant;
      SHARDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<ModelShard> model,
                                  ModelShard::Load(*f.ckpt, f.config, spec, opt, backend, tp));
      return GreedyGenerate(model.get(), g.prompt, 32, logits);
    };
    for (const WeightQuant quant : {WeightQuant::kInt8, WeightQuant::kInt4}) {
      if (act_quant == CpuActivationQuant::kInt16 && quant != WeightQuant::kInt4) continue;  // int4's only
      const std::string what = absl::StrCat(name, " with ", WeightQuantName(quant), " weights");
      std::vector<std::vector<float>> exact_logits, act_logits;
      absl::StatusOr<std::vector<int32_t>> exact = run(f.backend.get(), f.tp.get(), quant, &exact_logits);
      ASSERT_TRUE(exact.ok()) << what << ": " << exact.status();
      absl::StatusOr<std::vector<int32_t>> act = run(act_backend->get(), &act_tp, quant, &act_logits);
      ASSERT_TRUE(act.ok()) << what << ": " << act.status();
      ASSERT_EQ(act->size(), 32u) << what;
      ASSERT_EQ(act_logits.front().size(), g.prompt_last_logits.size()) << what;
      EXPECT_NE(act_logits.front(), exact_logits.front()) << what << ": " << acts
                                                          << " activations gave the exact logits bit for bit";
      size_t agree = 0;  // leading greedy tokens the two runs share
      while (agree < 32 && (*act)[agree] == (*exact)[agree]) ++agree;
      EXPECT_GE(agree, act_quant == CpuActivationQuant::kInt16 ? 16u : 1u)
          << what << ": the leading greedy tokens differ from the exact products'";
      double worst = 0;  // over the steps whose context is the same in both runs
      for (size_t step = 0; step <= std::min<size_t>(agree, 31); ++step) {
        worst = std::max(worst, NormalizedError(act_logits[step], exact_logits[step]));
      }
      EXPECT_LE(worst, tolerance) << what << ": " << acts << " activations against the exact products";
      const double err = NormalizedError(act_logits.front(), g.prompt_last_logits);
      const double exact_err = NormalizedError(exact_logits.front(), g.prompt_last_logits);
      const double weights_bound = quant == WeightQuant::kInt8 ? kInt8LogitsTolerance : kInt4LogitsTolerance;
      EXPECT_LE(err, weights_bound + tolerance) << what << ": logits after the prompt against HF";
      int same = 0, exact_same = 0;
      while (same < 32 && (*act)[same] == g.greedy[same]) ++same;
      while (exact_same < 32 && (*exact)[exact_same] == g.greedy[exact_same]) ++exact_same;
      std::printf("[ parity   ] %s, %s activations: logits error %.3g against the exact products (%zu steps' "
                  "worst), %.3g against HF after the prompt (exact: %.3g); greedy tokens: the first %zu of 32 equal "
                  "the exact run's, %d equal HF's (exact: %d)\n",
                  what.c_str(), acts, worst, std::min<size_t>(agree, 31) + 1, err, exact_err, agree, same, exact_same);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Activations, LlamaActivationQuant,
                         ::testing::Values(CpuActivationQuant::kInt8, CpuActivationQuant::kInt16),
                         [](const ::testing::TestParamInfo<CpuActivationQuant>& info) {
                           return std::string(CpuActivationQuantName(info.param));
                         });
INSTANTIATE_TEST_SUITE_P(Fixtures, LlamaParity,
                         ::testing::Combine(::testing::ValuesIn(FixtureNames()),
                                            ::testing::Values(Engine::kCpu, Engine::kCuda, Engine::kCudaGraphs,
                                                              Engine::kCudaSplitAttention, Engine::kCudaFused,
                                                              Engine::kCudaDenseGemv, Engine::kCudaDefaults,
                                                              Engine::kCudaPdl)),
                         ParamName);
// The mixture-of-experts fixtures with the experts as one grouped GEMV, their decode steps recorded
// as graphs (LlamaParity checks that the graphs ran).
INSTANTIATE_TEST_SUITE_P(MoeFixtures, LlamaParity,
                         ::testing::Combine(::testing::ValuesIn(MoeFixtureNames()),
                                            ::testing::Values(Engine::kCudaMoeGrouped)),
                         ParamName);
INSTANTIATE_TEST_SUITE_P(Fixtures, SlidingPoolParity,
                         ::testing::Combine(::testing::ValuesIn(SlidingPoolFixtureNames()),
                                            ::testing::Values(Engine::kCpu, Engine::kCuda, Engine::kCudaGraphs)),
                         ParamName);
INSTANTIATE_TEST_SUITE_P(Fixtures, LlamaLowPrecision,
                         ::testing::Combine(::testing::ValuesIn(DenseFixtureNames()),
                                            ::testing::Values(Engine::kCpuBf16Products, Engine::kCudaBf16,
                                                              Engine::kCudaF16, Engine::kCudaBf16DenseGemv,
                                                              Engine::kCudaBf16Defaults, Engine::kCudaBf16Pdl)),
                         ParamName);

// The suite above silently has no cases if the fixtures vanish; this makes that a failure.
TEST(LlamaParityFixtures, AllFixtureKindsPresent) {
  const std::vector<std::string> names = FixtureNames();
  for (const char* want : {"llama_gqa", "qwen2_tied_bias", "llama3_rope", "mistral_sharded", "llama_bf16",
                           "llama3_rope_tf5", "qwen2_tf5", "qwen3_tf5", "qwen3_tf4", "phi3_tf5", "mistral_window_tf5", "gemma2_tf5",
                           "phi3_longrope_tf5", "phi4_mini_tf5", "llama_yarn_tf5", "llama_linear_tf5", "llama_dynamic_tf5",
                           "gemma3_tf5", "gemma3_tf4", "gemma3_cg_tf5", "gemma3_cg_tf4", "qwen3_moe_tf5",
                           "qwen3_moe_bf16_tf5", "mixtral_tf5", "mixtral_bf16_tf5", "qwen2_moe_tf5", "qwen2_moe_bf16_tf5",
                           "deepseek_v3_tf5", "deepseek_v3_bf16_tf5", "glm4_moe_tf5", "glm4_moe_bf16_tf5", "gpt_oss_tf5",
                           "gpt_oss_bf16_tf5", "gpt_oss_mxfp4_tf5"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << "missing fixture " << want;
  }
}

}  // namespace
}  // namespace shardserve
