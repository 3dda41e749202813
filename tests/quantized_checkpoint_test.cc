// Published quantized checkpoints (model/quantized_checkpoint.h): every fixture under
// tests/fixtures/{gptq,awq,fp8,compressed_tensors} (made by tools/fixtures/make_quantized_fixtures.py) gives
// Hugging Face's greedy tokens and logits in one process, by the path it should take (the int4,
// int8 or fp8 kernel's layout, or float32 dequantized at load), and every malformed checkpoint or config is
// refused with an error naming the tensor or the field.
// (The multi-process layouts are in tests/cluster_test.cc, ClusterGptqTest.)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "base/status_macros.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/quant.h"
#include "kernels/tensor.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/families/registry.h"
#include "model/quantized_checkpoint.h"
#include "model/sharding.h"
#include "model/weight_source.h"
#include "nlohmann/json.hpp"
#include "tests/golden.h"
#include "worker/communicator.h"
#include "worker/shard/greedy.h"
#include "worker/shard/model_shard.h"

namespace shardserve {
namespace {

namespace fs = std::filesystem;

const fs::path kFixtures = fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures";
const fs::path kGptqFixtures = kFixtures / "gptq";

// The weights are exactly what HF ran (an f16 / bf16 / f32 scale times a small integer or an e4m3
// value, in float32), so the only difference is float32 rounding: the dequantized path sums as the
// float32 parity tests do (1e-6 relative measured there); the int8 / fp8 kernels sum x x code in
// float32 lanes and scale once per output (the same rounding, 1e-5 in the kernel tests), and with
// an FP8 checkpoint's block scales (input-group scales) multiply each code by its block's scale
// first, giving the dequantized path's float32 weights bit for bit, then sum in their own order
// (the same rounding again: the codes are the checkpoint's, only the order of additions differs); the int4
// kernel sums scale x (sum x q - zero x sum x) per group, ~10x more rounding (tests/llama_parity_test.cc,
// kInt4DequantizedTolerance). 1e-4 of the logits' scale bounds both with room; a wrong nibble
// (AWQ's interleave), zero point (GPTQ v1's + 1, compressed-tensors' offset), scale, block index or
// g_idx moves the logits by 1e-2 or more.
constexpr double kTolerance = 1e-4;



const StepLimits kLimits{.max_tokens_per_step = 256, .max_seqs_per_step = 4, .block_size = 16, .num_kv_blocks = 8,
                         .max_model_len = 8 * 16};

// Loads `dir` in one process (TP = 1 unless `spec` says otherwise: then only the load is tried).
absl::StatusOr<std::unique_ptr<ModelShard>> LoadModel(const fs::path& dir, Backend* backend, Communicator* tp,
                                                      ShardSpec spec = {}) {
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  if (!config.ok()) return config.status();
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir);
  if (!ckpt.ok()) return ckpt.status();
  return ModelShard::Load(**ckpt, *config, spec, kLimits, backend, tp);
}

struct Variant {
  std::string dir;   // under tests/fixtures
  std::string name;
  WeightQuant kernel;  // the layout every quantized linear weight takes (kNone: every one dequantized)
  int plain = 0;     // linear weights the checkpoint's ignore list keeps plain
  // Mixture-of-experts fixtures: the quantized linear weights (attention, dense MLPs, every expert,
  // shared experts; MLA's picked parts and kv_b_proj); 0: a dense model's 7 per layer.
  int linears = 0;
  // FP8 block scales held by the fp8 kernel: the blocks ("32x64"), and how many of `linears` are
  // dequantized all the same (MLA's parts of q_b_proj / kv_a_proj_with_mqa and its kv_b_proj).
  std::string blocks = "";
  int dequantized = 0;
};

void PrintTo(const Variant& v, std::ostream* os) { *os << v.dir << "/" << v.name; }

constexpr WeightQuant kInt4 = WeightQuant::kInt4, kInt8 = WeightQuant::kInt8, kFp8 = WeightQuant::kFp8,
                      kDense = WeightQuant::kNone;
const Variant kVariants[] = {
    {"gptq", "llama_sym4_g128_v1", kInt4},
    {"gptq", "qwen2_asym4_g128_v2", kInt4},
    {"gptq", "qwen2_asym4_g32_desc_act_v1", kDense},
    {"gptq", "qwen2_sym4_gall_v1", kDense},
    {"gptq", "qwen2_asym8_g32_v2", kDense},
    {"awq", "awq_llama_g128", kInt4},
    {"awq", "awq_qwen2_g32", kDense},
    {"fp8", "fp8_qwen2_block32x64", kFp8, 0, 0, "32x64"},
    {"compressed_tensors", "ct_int4_sym_g128_llama", kInt4},
    {"compressed_tensors", "ct_int4_asym_g32_qwen2", kDense},
    {"compressed_tensors", "ct_int8_channel_qwen2", kInt8},
    {"compressed_tensors", "ct_fp8_channel_qwen2", kFp8, /*plain=*/1},
    // Qwen3-MoE (3 layers, layer 1 dense, 5 experts): 3 x 4 attention + 3 dense MLP + 2 x 5 x 3 experts.
    {"gptq", "gptq_qwen3_moe_sym4_g16", kDense, 0, 45},
    {"gptq", "gptq_qwen3_moe_sym4_g128", kInt4, 0, 45},
    {"fp8", "fp8_qwen3_moe_block24x40", kFp8, 0, 45, "24x40"},
    // Mixtral (2 layers, 3 experts): 2 x 4 attention + 2 x 3 x 3 experts.
    {"awq", "awq_mixtral_g16", kDense, 0, 26},
    // Qwen2-MoE (3 layers, layer 2 dense, 5 experts and a shared one): 12 + 3 + 2 x (15 + 3).
    {"compressed_tensors", "ct_int4_sym_g8_qwen2_moe", kDense, 0, 51},
    {"compressed_tensors", "ct_fp8_channel_qwen2_moe", kFp8, 0, 51},
    // DeepSeek-V3 (3 layers, layer 0 dense, 9 experts, 1 shared): 3 x 7 MLA (q_a_proj, q_b_proj's
    // two parts, kv_a_proj_with_mqa's two, kv_b_proj, o_proj) + 3 dense MLP + 2 x (27 + 3); of
    // those 3 x 5 (the picked parts and kv_b_proj) dequantized.
    {"fp8", "fp8_deepseek_v3_block128", kFp8, 0, 84, "128x128", 15},
    // GLM-4.5 (3 layers, layer 0 dense, 6 experts, 1 shared): 3 x 4 attention + 3 dense MLP + 2 x (18 + 3).
    {"awq", "awq_glm4_moe_g8", kDense, 0, 57},
};

// What the worker's summary says of `n` weights in `kernel`'s layout (ModelShard::QuantizationSummary);
// `blocks`: an FP8 checkpoint's block scales on the fp8 kernel.
std::string PathWords(WeightQuant kernel, int n, const std::string& blocks = "") {
  switch (kernel) {
    case WeightQuant::kInt4: return absl::StrCat(n, " as int4 groups of 128");
    case WeightQuant::kInt8: return absl::StrCat(n, " as int8 per output channel");
    case WeightQuant::kFp8:
      if (!blocks.empty()) return absl::StrCat(n, " as fp8 e4m3 with ", blocks, " block scales");
      return absl::StrCat(n, " as fp8 e4m3 per output channel");
    case WeightQuant::kMxfp4: return absl::StrCat(n, " as mxfp4");
    case WeightQuant::kNone: return absl::StrCat(n, " dequantized to float32");
  }
  return "?";
}

class QuantizedParity : public ::testing::TestWithParam<Variant> {};

// HF's 32 greedy tokens exactly, and its logits after the prompt and at the last step within
// kTolerance; the worker's summary names the path every weight took.
TEST_P(QuantizedParity, GivesHuggingFaceTokensAndLogits) {
  const Variant& v = GetParam();
  const fs::path dir = kFixtures / v.dir / v.name;
  const Golden g = ReadGolden(dir);
  ASSERT_EQ(g.greedy.size(), 32u);
  std::unique_ptr<Backend> backend = MakeCpuBackend(0, CpuMatMul::kF32);
  LocalCommunicator tp(backend.get());
  absl::StatusOr<std::unique_ptr<ModelShard>> model = LoadModel(dir, backend.get(), &tp);
  ASSERT_TRUE(model.ok()) << v.name << ": " << model.status();
  const std::string summary = (*model)->QuantizationSummary();
  const int layers = static_cast<int>((*model)->config().num_hidden_layers);
  const int linears = v.linears > 0 ? v.linears : 7 * layers - v.plain;
  EXPECT_TRUE(absl::StrContains(
      summary, absl::StrCat(": linear weights ", PathWords(v.kernel, linears - v.dequantized, v.blocks))))
      << summary;
  if (v.dequantized > 0) {
    EXPECT_TRUE(absl::StrContains(summary, absl::StrCat(", ", v.dequantized, " dequantized to float32"))) << summary;
  } else if (v.kernel != kDense) {
    EXPECT_FALSE(absl::StrContains(summary, "dequantized")) << summary;
  }
  EXPECT_EQ(CheckpointQuantKernel(*(*model)->config().checkpoint_quant), v.kernel) << "what the planner counts";
  std::vector<std::vector<float>> logits;
  absl::StatusOr<std::vector<int32_t>> ids = GreedyGenerate(model->get(), g.prompt, 32, &logits);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, g.greedy) << v.name;
  ASSERT_EQ(logits.size(), 32u);
  const double first = NormalizedError(logits.front(), g.prompt_last_logits);
  const double last = NormalizedError(logits.back(), g.final_logits);
  EXPECT_LE(first, kTolerance) << v.name << ": logits after the prompt";
  EXPECT_LE(last, kTolerance) << v.name << ": logits of the last greedy step";
  std::printf("[ quantized ] %s: %s; logits error %.3g after the prompt, %.3g at step 32\n", v.name.c_str(),
              summary.c_str(), first, last);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, QuantizedParity, ::testing::ValuesIn(kVariants),
                         [](const ::testing::TestParamInfo<Variant>& info) { return info.param.name; });

// ---- Refusals: a corrupted copy of a fixture in a temporary directory ----------------------------

class GptqRefusalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/gptq_test.XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  // `variant`: a GPTQ fixture's name, or "<format dir>/<name>" under tests/fixtures.
  void Copy(const std::string& variant) {
    const fs::path from = variant.find('/') != std::string::npos ? kFixtures / variant : kGptqFixtures / variant;
    for (const auto& e : fs::directory_iterator(from)) {
      fs::copy_file(e.path(), dir_ / e.path().filename(), fs::copy_options::overwrite_existing);
    }
  }
  void EditConfig(const std::string& field, const nlohmann::json& value) {
    EditQuant([&](nlohmann::json& q) { q[field] = value; });
  }
  // Any change to quantization_config (nested fields).
  void EditQuant(const std::function<void(nlohmann::json&)>& edit) {
    std::ifstream in(dir_ / "config.json");
    nlohmann::json j = nlohmann::json::parse(in);
    edit(j["quantization_config"]);
    std::ofstream(dir_ / "config.json") << j.dump(2);
  }
  // Overwrites `n` bytes of tensor `name` at byte `at` of its data.
  void Poke(const std::string& name, uint64_t at, const void* bytes, size_t n) {
    absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    absl::StatusOr<const TensorInfo*> t = (*ckpt)->Find(name);
    ASSERT_TRUE(t.ok()) << t.status();
    const uint64_t offset = (*t)->offset + at;
    const fs::path file = dir_ / (*t)->file;
    ckpt->reset();
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(offset));
    f.write(static_cast<const char*>(bytes), static_cast<std::streamsize>(n));
  }
  // Renames a tensor in the safetensors header (same length, so the header stays valid).
  void Rename(const std::string& from, const std::string& to) {
    ASSERT_EQ(from.size(), to.size());
    std::string bytes;
    {
      std::ifstream in(dir_ / "model.safetensors", std::ios::binary);
      bytes.assign(std::istreambuf_iterator<char>(in), {});
    }
    const size_t at = bytes.find("\"" + from + "\"");
    ASSERT_NE(at, std::string::npos) << from;
    bytes.replace(at + 1, from.size(), to);
    std::ofstream(dir_ / "model.safetensors", std::ios::binary) << bytes;
  }
  // The load fails, and its message holds every one of `parts`.
  void ExpectRefused(const std::vector<std::string>& parts, ShardSpec spec = {}) {
    std::unique_ptr<Backend> backend = MakeCpuBackend(0, CpuMatMul::kF32);
    LocalCommunicator tp(backend.get());
    absl::StatusOr<std::unique_ptr<ModelShard>> model = LoadModel(dir_, backend.get(), &tp, spec);
    ASSERT_FALSE(model.ok()) << "a corrupted checkpoint loaded";
    for (const std::string& part : parts) {
      EXPECT_TRUE(absl::StrContains(model.status().message(), part)) << model.status() << "\nlacks: " << part;
    }
  }
  fs::path dir_;
};

TEST_F(GptqRefusalTest, TheUnchangedCopyLoads) {
  Copy("qwen2_asym4_g32_desc_act_v1");
  std::unique_ptr<Backend> backend = MakeCpuBackend(0, CpuMatMul::kF32);
  LocalCommunicator tp(backend.get());
  absl::StatusOr<std::unique_ptr<ModelShard>> model = LoadModel(dir_, backend.get(), &tp);
  EXPECT_TRUE(model.ok()) << model.status();
}

TEST_F(GptqRefusalTest, AnotherQuantMethod) {
  Copy("qwen2_asym4_g128_v2");
  EditConfig("quant_method", "bitsandbytes");
  ExpectRefused({"quant_method", "\"bitsandbytes\""});
  // A GPTQ checkpoint labelled AWQ: AWQ's qweight is [in, out / 8], GPTQ's [in / 8, out].
  Copy("qwen2_asym4_g128_v2");
  EditConfig("quant_method", "awq");
  ExpectRefused({"model.layers.0.self_attn.q_proj.qweight", "AWQ 4-bit gemm"});
}

TEST_F(GptqRefusalTest, UnsupportedBits) {
  Copy("qwen2_asym4_g128_v2");
  EditConfig("bits", 3);
  ExpectRefused({"bits", "3"});
}

TEST_F(GptqRefusalTest, BadGroupSizeAndFormat) {
  Copy("qwen2_asym4_g128_v2");
  EditConfig("group_size", 0);
  ExpectRefused({"group_size", "got 0"});
  Copy("qwen2_asym4_g128_v2");
  EditConfig("checkpoint_format", "marlin");
  ExpectRefused({"checkpoint_format", "marlin"});
}

TEST_F(GptqRefusalTest, MissingTensor) {
  Copy("qwen2_asym4_g128_v2");
  Rename("model.layers.1.mlp.up_proj.g_idx", "model.layers.1.mlp.up_proj.g_idy");
  ExpectRefused({"model.layers.1.mlp.up_proj.g_idx"});
  Copy("qwen2_asym4_g128_v2");
  Rename("model.layers.0.self_attn.k_proj.scales", "model.layers.0.self_attn.k_proj.scalez");
  ExpectRefused({"model.layers.0.self_attn.k_proj.scales"});
}

TEST_F(GptqRefusalTest, ShapesThatDisagreeWithTheConfig) {
  // group_size 32 on a g128 checkpoint: 2 or 4 groups expected, 1 stored.
  Copy("qwen2_asym4_g128_v2");
  EditConfig("group_size", 32);
  ExpectRefused({".qzeros", "group_size 32"});
  // 8 bits on a 4-bit checkpoint: qweight [in / 4, out] expected, [in / 8, out] stored.
  Copy("qwen2_asym4_g128_v2");
  EditConfig("bits", 8);
  ExpectRefused({".qweight", "GPTQ 8-bit"});
}

// A NaN or infinite scale is refused as the checkpoint reader reads it (checkpoint.h: "weights and
// scales must be finite"), a zero one by the quantized reader ("must be finite and nonzero").
TEST_F(GptqRefusalTest, NanInfAndZeroScales) {
  for (uint16_t bad : {uint16_t{0x7e00} /*NaN*/, uint16_t{0x7c00} /*+Inf*/, uint16_t{0} /*zero*/}) {
    Copy("qwen2_asym4_g32_desc_act_v1");
    Poke("model.layers.2.mlp.down_proj.scales", 2 * 5, &bad, 2);  // scales[0][5]
    ExpectRefused({"model.layers.2.mlp.down_proj.scales[0][5]", "must be finite"});
  }
}

TEST_F(GptqRefusalTest, GroupIndexOutOfRange) {
  Copy("qwen2_asym4_g32_desc_act_v1");
  const int32_t bad = 2;  // o_proj's 64 inputs make 2 groups of 32
  Poke("model.layers.0.self_attn.o_proj.g_idx", 4 * 7, &bad, 4);
  ExpectRefused({"model.layers.0.self_attn.o_proj.g_idx[7] is 2", "outside"});
  Copy("qwen2_asym4_g32_desc_act_v1");
  const int32_t negative = -1;
  Poke("model.layers.0.self_attn.o_proj.g_idx", 0, &negative, 4);
  ExpectRefused({"model.layers.0.self_attn.o_proj.g_idx[0] is -1"});
}

TEST_F(GptqRefusalTest, ReorderedGroupsWithoutDescAct) {
  Copy("qwen2_asym4_g32_desc_act_v1");
  EditConfig("desc_act", false);
  ExpectRefused({".g_idx[", "desc_act is false"});
}

TEST_F(GptqRefusalTest, ZeroPointsThatContradictSym) {
  Copy("llama_sym4_g128_v1");
  const int32_t zeros = 0;  // v1 stored 0: zero point 1, not sym's 8
  Poke("model.layers.1.mlp.gate_proj.qzeros", 0, &zeros, 4);
  ExpectRefused({"model.layers.1.mlp.gate_proj.qzeros", "zero point 1", "\"sym\" is true"});
}

TEST_F(GptqRefusalTest, QuantizingAGptqCheckpointAgain) {
  Copy("llama_sym4_g128_v1");
  ShardSpec spec;
  spec.weight_quant = WeightQuant::kInt4;
  ExpectRefused({"already quantized", "--quantization none"}, spec);
}

// ---- AWQ, FP8, compressed-tensors refusals ---------------------------------------------------------

TEST_F(GptqRefusalTest, AwqUnsupportedFieldsAndShapes) {
  Copy("awq/awq_qwen2_g32");
  EditConfig("version", "gemv");
  ExpectRefused({"\"version\"", "gemv"});
  Copy("awq/awq_qwen2_g32");
  EditConfig("bits", 8);
  ExpectRefused({"\"bits\"", "8", "AWQ"});
  Copy("awq/awq_qwen2_g32");
  EditConfig("group_size", 64);  // 1 group of 64 expected along o_proj's 64 inputs, 2 stored
  ExpectRefused({".qzeros", "AWQ 4-bit gemm, group_size 64"});
  Copy("awq/awq_qwen2_g32");
  Rename("model.layers.2.self_attn.v_proj.qzeros", "model.layers.2.self_attn.v_proj.qzeroz");
  ExpectRefused({"model.layers.2.self_attn.v_proj.qzeros"});
}

TEST_F(GptqRefusalTest, AwqNanAndZeroScales) {
  for (uint16_t bad : {uint16_t{0x7e00} /*NaN*/, uint16_t{0} /*zero*/}) {
    Copy("awq/awq_qwen2_g32");
    Poke("model.layers.1.mlp.down_proj.scales", 2 * (64 + 5), &bad, 2);  // scales[1][5]
    ExpectRefused({"model.layers.1.mlp.down_proj.scales[1][5]", "must be finite"});
  }
}

TEST_F(GptqRefusalTest, Fp8FieldsTensorsAndValues) {
  Copy("fp8/fp8_qwen2_block32x64");
  EditConfig("weight_block_size", nlohmann::json::array({0, 128}));
  ExpectRefused({"\"weight_block_size\"", "[0,128]"});
  Copy("fp8/fp8_qwen2_block32x64");
  EditConfig("activation_scheme", "static");
  ExpectRefused({"\"activation_scheme\"", "static"});
  Copy("fp8/fp8_qwen2_block32x64");
  EditConfig("weight_block_size", nlohmann::json::array({64, 64}));  // 1 x 1 blocks expected, 2 x 1 stored
  ExpectRefused({"model.layers.0.self_attn.q_proj.weight_scale_inv", "[1, 1]", "64x64 blocks"});
  Copy("fp8/fp8_qwen2_block32x64");
  Rename("model.layers.0.self_attn.k_proj.weight_scale_inv", "model.layers.0.self_attn.k_proj.weight_scale_inX");
  ExpectRefused({"model.layers.0.self_attn.k_proj.weight_scale_inv"});
  for (float bad : {NAN, 0.0f, INFINITY}) {
    Copy("fp8/fp8_qwen2_block32x64");
    Poke("model.layers.2.mlp.down_proj.weight_scale_inv", 4 * 3, &bad, 4);  // [1][1] of 2 x 2 blocks
    ExpectRefused({"model.layers.2.mlp.down_proj.weight_scale_inv[1][1]", "must be finite"});
  }
  Copy("fp8/fp8_qwen2_block32x64");
  const uint8_t nan = 0x7f;
  Poke("model.layers.1.mlp.down_proj.weight", 3 * 128 + 5, &nan, 1);
  ExpectRefused({"model.layers.1.mlp.down_proj.weight[3][5] is nan", "must be finite"});
}

TEST_F(GptqRefusalTest, CompressedTensorsConfig) {
  const std::string v = "compressed_tensors/ct_int4_asym_g32_qwen2";
  Copy(v);
  EditConfig("format", "naive-quantized");
  ExpectRefused({"\"format\"", "naive-quantized"});
  Copy(v);
  EditQuant([](nlohmann::json& q) { q["config_groups"]["group_0"]["weights"]["num_bits"] = 2; });
  ExpectRefused({"config_groups.group_0.weights.num_bits", "2"});
  Copy(v);
  EditQuant([](nlohmann::json& q) { q["config_groups"]["group_0"]["weights"]["strategy"] = "block"; });
  ExpectRefused({"config_groups.group_0.weights.strategy", "block"});
  Copy(v);
  EditQuant([](nlohmann::json& q) { q["config_groups"]["group_1"] = q["config_groups"]["group_0"]; });
  ExpectRefused({"\"config_groups\"", "exactly one group"});
  Copy(v);
  EditQuant([](nlohmann::json& q) { q["config_groups"]["group_0"]["targets"] = {"re:.*q_proj"}; });
  ExpectRefused({"config_groups.group_0.targets", "re:.*q_proj"});
  Copy(v);
  EditQuant([](nlohmann::json& q) { q["config_groups"]["group_0"]["weights"]["actorder"] = "group"; });
  ExpectRefused({"config_groups.group_0.weights.actorder"});
  Copy(v);
  EditQuant([](nlohmann::json& q) { q["ignore"] = {"re:("}; });
  ExpectRefused({"\"ignore\"", "not a valid regular expression"});
}

TEST_F(GptqRefusalTest, CompressedTensorsTensors) {
  const std::string v = "compressed_tensors/ct_int4_asym_g32_qwen2";
  Copy(v);
  Rename("model.layers.1.mlp.up_proj.weight_zero_point", "model.layers.1.mlp.up_proj.weight_zero_poinX");
  ExpectRefused({"model.layers.1.mlp.up_proj.weight_zero_point"});
  Copy(v);
  EditQuant([](nlohmann::json& q) { q["config_groups"]["group_0"]["weights"]["group_size"] = 64; });
  ExpectRefused({"weight_scale", "group_size 64"});
  Copy(v);
  const int64_t rows = 65;
  Poke("model.layers.0.self_attn.q_proj.weight_shape", 0, &rows, 8);
  ExpectRefused({"model.layers.0.self_attn.q_proj.weight_shape is [65, 64]", "[64, 64]"});
  Copy(v);
  const int64_t huge = int64_t{1} << 40;  // I64, read as I32: refused, not truncated
  Poke("model.layers.0.self_attn.q_proj.weight_shape", 8, &huge, 8);
  ExpectRefused({"model.layers.0.self_attn.q_proj.weight_shape", "(I64) holds a value outside the int32 range"});
  Copy(v);
  const uint16_t zero = 0;
  Poke("model.layers.0.self_attn.o_proj.weight_scale", 2 * (2 * 2 + 1), &zero, 2);  // [2][1] of [64, 2]
  ExpectRefused({"model.layers.0.self_attn.o_proj.weight_scale[2][1]", "finite and nonzero"});
  Copy("compressed_tensors/ct_fp8_channel_qwen2");
  const uint16_t bf16_nan = 0x7fc0;
  Poke("model.layers.2.self_attn.q_proj.weight_scale", 2 * 3, &bf16_nan, 2);
  ExpectRefused({"model.layers.2.self_attn.q_proj.weight_scale[3][0]", "must be finite"});
  // The ignored module is plain: without the ignore entry its quantized tensors are looked for.
  Copy("compressed_tensors/ct_fp8_channel_qwen2");
  EditConfig("ignore", nlohmann::json::array({"lm_head"}));
  ExpectRefused({"model.layers.0.mlp.down_proj.weight_scale"});
}

// TP = 2 would cut o_proj's 64 inputs (one short group of 128) into 32 per rank: refused with the
// numbers, by the check the planner uses too. Groups of 32 split cleanly.
// Mixture-of-experts checkpoints: a corrupt scale of one expert, an expert tensor whose shape
// disagrees with config.json, a router stored quantized, and FP8 DeepSeek-V3's kv_b_proj and
// q_b_proj scales are refused naming the tensor.
TEST_F(GptqRefusalTest, MixtureOfExpertsTensors) {
  for (uint16_t bad : {uint16_t{0x7e00} /*NaN*/, uint16_t{0} /*zero*/}) {
    Copy("gptq_qwen3_moe_sym4_g16");
    Poke("model.layers.2.mlp.experts.3.down_proj.scales", 2 * 7, &bad, 2);  // scales[0][7]
    ExpectRefused({"model.layers.2.mlp.experts.3.down_proj.scales[0][7]", "must be finite"});
  }
  // moe_intermediate_size 40: gate_proj's qweight [48 / 8, 40] expected, [6, 32] stored
  Copy("gptq_qwen3_moe_sym4_g16");
  {
    std::ifstream in(dir_ / "config.json");
    nlohmann::json j = nlohmann::json::parse(in);
    j["moe_intermediate_size"] = 40;
    std::ofstream(dir_ / "config.json") << j.dump(2);
  }
  ExpectRefused({"model.layers.0.mlp.experts.0.gate_proj.qweight", "[6, 40]"});
  // a router stored as another tensor (as if quantized): its plain weight is missing, by name
  Copy("gptq_qwen3_moe_sym4_g16");
  Rename("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.gate.weighX");
  ExpectRefused({"model.layers.0.mlp.gate.weight"});
  for (float bad : {NAN, 0.0f}) {
    Copy("fp8/fp8_deepseek_v3_block128");
    Poke("model.layers.1.self_attn.kv_b_proj.weight_scale_inv", 4 * 1, &bad, 4);  // [1][0] of 2 x 1 blocks
    ExpectRefused({"model.layers.1.self_attn.kv_b_proj.weight_scale_inv[1][0]", "must be finite"});
    Copy("fp8/fp8_deepseek_v3_block128");
    Poke("model.layers.2.self_attn.q_b_proj.weight_scale_inv", 0, &bad, 4);
    ExpectRefused({"model.layers.2.self_attn.q_b_proj.weight_scale_inv[0][0]", "must be finite"});
  }
  Copy("fp8/fp8_deepseek_v3_block128");
  Rename("model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv", "model.layers.1.mlp.shared_experts.up_proj.weight_scale_inX");
  ExpectRefused({"model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv"});
}

// The experts' TP cuts follow each format's rules too (moe_intermediate_size 32: gate/up rows and
// down inputs of 16 a rank at TP = 2): GPTQ group 16 allows TP = 2 and refuses TP = 4 (8 inputs, not
// a group of 16); group 128 refuses TP = 2 naming o_proj (64 inputs, not a whole group), and with
// expert parallelism too (the attention is still cut); FP8 blocks allow any cut.
TEST(GptqShardTest, ExpertsFollowTheFormatsRules) {
  absl::StatusOr<ModelConfig> g16 = LoadModelConfig(kGptqFixtures / "gptq_qwen3_moe_sym4_g16");
  ASSERT_TRUE(g16.ok()) << g16.status();
  EXPECT_TRUE(CheckQuantizedShard(*g16, 2, WeightQuant::kNone).ok());
  EXPECT_TRUE(CheckQuantizedShard(*g16, 2, WeightQuant::kNone, /*expert_parallel=*/true).ok());
  absl::Status s = CheckQuantizedShard(*g16, 4, WeightQuant::kNone);
  EXPECT_FALSE(s.ok());
  absl::StatusOr<ModelConfig> g128 = LoadModelConfig(kGptqFixtures / "gptq_qwen3_moe_sym4_g128");
  ASSERT_TRUE(g128.ok()) << g128.status();
  s = CheckQuantizedShard(*g128, 2, WeightQuant::kNone, /*expert_parallel=*/true);
  EXPECT_TRUE(absl::StrContains(s.message(), "o_proj's input of 64 columns")) << s;
  // with o_proj and the dense MLP wide enough, the experts' down_proj is what TP = 2 cuts
  ModelConfig wide = *g128;
  wide.num_attention_heads = 16;
  wide.intermediate_size = 256;
  s = CheckQuantizedShard(wide, 2, WeightQuant::kNone);
  EXPECT_TRUE(absl::StrContains(s.message(), "the experts' down_proj's input of 32 columns")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "--expert-parallel")) << s;
  EXPECT_TRUE(CheckQuantizedShard(wide, 2, WeightQuant::kNone, /*expert_parallel=*/true).ok());
  for (const char* fp8 : {"fp8/fp8_qwen3_moe_block24x40", "fp8/fp8_deepseek_v3_block128"}) {
    absl::StatusOr<ModelConfig> c = LoadModelConfig(kFixtures / fp8);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_TRUE(CheckQuantizedShard(*c, 2, WeightQuant::kNone).ok()) << fp8;
  }
}

TEST(GptqShardTest, RefusesALayoutThatCutsAGroup) {
  absl::StatusOr<ModelConfig> g128 = LoadModelConfig(kGptqFixtures / "llama_sym4_g128_v1");
  ASSERT_TRUE(g128.ok()) << g128.status();
  absl::Status s = CheckQuantizedShard(*g128, 2, WeightQuant::kNone);
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(absl::StrContains(s.message(), "o_proj's input of 64 columns split over tensor parallel size 2 gives 32"))
      << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "groups of 128")) << s;
  EXPECT_TRUE(CheckQuantizedShard(*g128, 1, WeightQuant::kNone).ok());
  absl::StatusOr<ModelConfig> g32 = LoadModelConfig(kGptqFixtures / "qwen2_asym8_g32_v2");
  ASSERT_TRUE(g32.ok()) << g32.status();
  EXPECT_TRUE(CheckQuantizedShard(*g32, 2, WeightQuant::kNone).ok());
  // 8 bits pack 4 zero points per int32: TP = 4 leaves k/v 16 rows (one replicated head), fine;
  // o_proj 64 / 4 = 16 inputs, not a whole group of 32.
  EXPECT_FALSE(CheckQuantizedShard(*g32, 4, WeightQuant::kNone).ok());
}

// Known answers, independent of tools/fixtures/make_quantized_fixtures.py (which shares the loader's reading of
// the format): AutoGPTQ's packing puts input 8r + j of column c in bits 4j.. of qweight[r][c]
// (lowest first), output 8w + j's zero in bits 4j.. of qzeros[g][w], and v1 stores zero - 1
// (AutoGPTQ's symmetric qzeros are 0x77777777: zero 8).
class FakeGptqTensors : public WeightSource {
 public:
  void Add(const std::string& name, std::vector<int64_t> shape, DType dtype, std::vector<uint8_t> bytes) {
    tensors_[name] = {std::move(shape), dtype, std::move(bytes)};
  }
  absl::Status CheckShape(const std::string& name, const std::vector<int64_t>& shape) const override {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) return absl::NotFoundError(name);
    return it->second.shape == shape ? absl::OkStatus() : absl::InvalidArgumentError(name + ": shape");
  }
  // A range of rows or columns, in the stored dtype (F16 widened to F32; kI8 stands for F8_E4M3,
  // decoded or raw).
  absl::Status Read(const std::string& name, const std::vector<int64_t>& shape, const Slice& slice, DType dst_type,
                    void* dst) const override {
    SHARDSERVE_RETURN_IF_ERROR(CheckShape(name, shape));
    const Stored& whole = tensors_.at(name);
    // The slice's elements, in the stored dtype (a range of rows, or of each row's columns).
    Stored t{whole.shape, whole.dtype, {}};
    const size_t es = DTypeSize(whole.dtype);
    const int64_t rows = whole.shape[0], cols = whole.shape.size() == 2 ? whole.shape[1] : 1;
    const int64_t end = slice.end < 0 ? whole.shape[slice.dim] : slice.end;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t at = slice.dim == 0 ? r : c;
        if (at < slice.begin || at >= end) continue;
        const uint8_t* from = whole.bytes.data() + static_cast<size_t>(r * cols + c) * es;
        t.bytes.insert(t.bytes.end(), from, from + es);
      }
    }
    if (t.dtype == DType::kI32 && dst_type == DType::kI32) {
      std::memcpy(dst, t.bytes.data(), t.bytes.size());
      return absl::OkStatus();
    }
    if (t.dtype == DType::kI8 && dst_type == DType::kI8) {  // F8_E4M3 read raw
      std::memcpy(dst, t.bytes.data(), t.bytes.size());
      return absl::OkStatus();
    }
    if (t.dtype == DType::kI8 && dst_type == DType::kF32) {  // stands for F8_E4M3 here
      for (size_t i = 0; i < t.bytes.size(); ++i) static_cast<float*>(dst)[i] = Fp8E4m3ToFloat(t.bytes[i]);
      return absl::OkStatus();
    }
    if (!ConvertOnHost(dst, dst_type, t.bytes.data(), t.dtype, t.bytes.size() / DTypeSize(t.dtype))) {
      return absl::InvalidArgumentError(name + ": dtype");
    }
    return absl::OkStatus();
  }

 private:
  struct Stored {
    std::vector<int64_t> shape;
    DType dtype;
    std::vector<uint8_t> bytes;
  };
  std::map<std::string, Stored> tensors_;
};

template <typename T>
std::vector<uint8_t> Bytes(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

TEST(GptqKnownAnswers, DequantizedPathUnpacksAsAutoGptq) {
  // [out 8, in 8], 4 bits, group_size -1, sym, v1: every qweight word 0xFEDCBA98 holds q = 8 + j for
  // input j, the zero is 7 + 1 = 8 and the scale 1 (f16 0x3C00): w[c][i] = i.
  FakeGptqTensors src;
  src.Add("l.qweight", {1, 8}, DType::kI32, Bytes(std::vector<uint32_t>(8, 0xFEDCBA98u)));
  src.Add("l.qzeros", {1, 1}, DType::kI32, Bytes(std::vector<uint32_t>{0x77777777u}));
  src.Add("l.scales", {1, 8}, DType::kF16, Bytes(std::vector<uint16_t>(8, 0x3C00)));
  src.Add("l.g_idx", {8}, DType::kI32, Bytes(std::vector<int32_t>(8, 0)));
  CheckpointQuant c;
  c.group_size = -1;
  absl::StatusOr<QuantizedLinearSlice> w = ReadQuantizedLinear(src, c, "l", 8, 8, Slice{0, 0, -1});
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_EQ(w->kernel, WeightQuant::kNone);
  EXPECT_TRUE(absl::StrContains(w->why_dense, "4 bits in one group per output channel")) << w->why_dense;
  for (int r = 0; r < 8; ++r) {
    for (int i = 0; i < 8; ++i) EXPECT_EQ(w->dense[r * 8 + i], static_cast<float>(i)) << r << ", " << i;
  }
}

TEST(GptqKnownAnswers, MappedPathRepacksAsAutoGptq) {
  // [out 8, in 128], 4 bits, group_size 128, asym, gptq_v2: qweight words 0x76543210 hold q = i % 8,
  // qzeros 0x33333333 zero 3 for every output, scales 0.5 (f16 0x3800): w[c][i] = (i % 8 - 3) / 2.
  FakeGptqTensors src;
  src.Add("l.qweight", {16, 8}, DType::kI32, Bytes(std::vector<uint32_t>(16 * 8, 0x76543210u)));
  src.Add("l.qzeros", {1, 1}, DType::kI32, Bytes(std::vector<uint32_t>{0x33333333u}));
  src.Add("l.scales", {1, 8}, DType::kF16, Bytes(std::vector<uint16_t>(8, 0x3800)));
  std::vector<int32_t> g_idx(128, 0);
  src.Add("l.g_idx", {128}, DType::kI32, Bytes(g_idx));
  CheckpointQuant c;
  c.sym = false;
  c.v2 = true;
  absl::StatusOr<QuantizedLinearSlice> w = ReadQuantizedLinear(src, c, "l", 8, 128, Slice{0, 0, -1});
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_EQ(w->kernel, WeightQuant::kInt4);
  ASSERT_EQ(w->blocks.size(), 8u);
  EXPECT_EQ(w->blocks[0].zero, 3);
  EXPECT_EQ(w->blocks[0].scale, 0.5f);
  std::vector<float> dense(8 * 128);
  DequantizeInt4Groups(dense.data(), w->blocks.data(), 8, 128);
  for (int r = 0; r < 8; ++r) {
    for (int i = 0; i < 128; ++i) {
      EXPECT_EQ(dense[r * 128 + i], static_cast<float>(i % 8 - 3) * 0.5f) << r << ", " << i;
    }
  }
  // The same checkpoint in v1 reads each zero as 3 + 1.
  c.v2 = false;
  w = ReadQuantizedLinear(src, c, "l", 8, 128, Slice{0, 0, -1});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->blocks[5].zero, 4);
}

// AutoAWQ's gemm packing: output 8 w + t is nibble [0,4,1,5,2,6,3,7][t] of the word (its packing
// order [0,2,4,6,1,3,5,7] puts output ORDER[j] in nibble j), zeros stored without an offset.
TEST(QuantizedKnownAnswers, AwqInterleavedNibbles) {
  // [out 8, in 8], one group: nibble j of each qweight word holds ORDER[j], so output t's q is t;
  // zeros 1 (0x11111111), scales 1: w[t][i] = t - 1.
  FakeGptqTensors src;
  src.Add("l.qweight", {8, 1}, DType::kI32, Bytes(std::vector<uint32_t>(8, 0x75316420u)));
  src.Add("l.qzeros", {1, 1}, DType::kI32, Bytes(std::vector<uint32_t>{0x11111111u}));
  src.Add("l.scales", {1, 8}, DType::kF16, Bytes(std::vector<uint16_t>(8, 0x3C00)));
  absl::StatusOr<CheckpointQuant> c =
      ParseCheckpointQuant(R"({"quant_method": "awq", "bits": 4, "group_size": -1, "version": "gemm"})", "t");
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<QuantizedLinearSlice> w = ReadQuantizedLinear(src, *c, "l", 8, 8, Slice{0, 0, -1});
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_EQ(w->kernel, WeightQuant::kNone);
  for (int t = 0; t < 8; ++t) {
    for (int i = 0; i < 8; ++i) EXPECT_EQ(w->dense[t * 8 + i], static_cast<float>(t - 1)) << t << ", " << i;
  }
}

// compressed-tensors pack_to_int32: values along the input, zero points along the output, both
// stored + 2^(bits - 1); w = scale x (q - zp) on the signed values.
TEST(QuantizedKnownAnswers, CompressedTensorsPackQuantized) {
  // [out 8, in 8], int4 asym per channel: every weight word 0x76543210 stores input i as i
  // (signed i - 8); the zero-point word 0x76543210 stores output r's as r (signed r - 8);
  // scales 0.5: w[r][i] = ((i - 8) - (r - 8)) / 2 = (i - r) / 2.
  FakeGptqTensors src;
  src.Add("l.weight_packed", {8, 1}, DType::kI32, Bytes(std::vector<uint32_t>(8, 0x76543210u)));
  src.Add("l.weight_zero_point", {1, 1}, DType::kI32, Bytes(std::vector<uint32_t>{0x76543210u}));
  src.Add("l.weight_scale", {8, 1}, DType::kF16, Bytes(std::vector<uint16_t>(8, 0x3800)));
  src.Add("l.weight_shape", {2}, DType::kI32, Bytes(std::vector<int32_t>{8, 8}));
  absl::StatusOr<CheckpointQuant> c = ParseCheckpointQuant(
      R"({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
          "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": false,
          "strategy": "channel"}}}, "ignore": ["lm_head"]})",
      "t");
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<QuantizedLinearSlice> w = ReadQuantizedLinear(src, *c, "l", 8, 8, Slice{0, 0, -1});
  ASSERT_TRUE(w.ok()) << w.status();
  for (int r = 0; r < 8; ++r) {
    for (int i = 0; i < 8; ++i) EXPECT_EQ(w->dense[r * 8 + i], (i - r) * 0.5f) << r << ", " << i;
  }
  EXPECT_FALSE(c->Quantizes("lm_head"));
  EXPECT_TRUE(c->Quantizes("model.layers.0.mlp.up_proj"));
}

// FP8 128 x 128 blocks: w[r][c] = e4m3 x weight_scale_inv[r / 128][c / 128], on the dequantized
// path (map false) and held by the fp8 kernel with input-group scales of 128 (each block's scale
// repeated over its 128 rows, the codes as stored), whose reference (DequantizeFp8Groups) gives the
// same weights; whole, and as a column-parallel rank's rows [128, 256) and a row-parallel rank's
// inputs [128, 384) (scales from the second block column on).
TEST(QuantizedKnownAnswers, Fp8BlockScales) {
  FakeGptqTensors src;
  std::vector<uint8_t> codes(256 * 384, 0x38);                 // e4m3 1.0
  for (int i = 0; i < 384; i += 7) codes[200 * 384 + i] = 0xC4;  // e4m3 -3.0 in row 200
  src.Add("l.weight", {256, 384}, DType::kI8, codes);
  src.Add("l.weight_scale_inv", {2, 3}, DType::kF32, Bytes(std::vector<float>{1, 2, 3, 4, 5, 6}));
  absl::StatusOr<CheckpointQuant> c = ParseCheckpointQuant(
      R"({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})", "t");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(CheckpointQuantKernel(*c), WeightQuant::kFp8);
  auto value = [&](int r, int i) {
    return (r == 200 && i % 7 == 0 ? -3.0f : 1.0f) * static_cast<float>(1 + (r / 128) * 3 + i / 128);
  };
  for (const Slice slice : {Slice{0, 0, -1}, Slice{0, 128, 256}, Slice{1, 128, -1}}) {
    const int r0 = slice.dim == 0 ? static_cast<int>(slice.begin) : 0;
    const int i0 = slice.dim == 1 ? static_cast<int>(slice.begin) : 0;
    const std::string what = absl::StrCat("slice ", slice.dim, ":", slice.begin);
    absl::StatusOr<QuantizedLinearSlice> dense = ReadQuantizedLinear(src, *c, "l", 256, 384, slice, /*map=*/false);
    ASSERT_TRUE(dense.ok()) << what << ": " << dense.status();
    absl::StatusOr<QuantizedLinearSlice> w = ReadQuantizedLinear(src, *c, "l", 256, 384, slice);
    ASSERT_TRUE(w.ok()) << what << ": " << w.status();
    ASSERT_EQ(w->kernel, WeightQuant::kFp8) << what << ": " << w->why_dense;
    EXPECT_EQ(w->group, 128) << what;
    const int64_t m = w->m, k = w->k, G = (k + 127) / 128;
    ASSERT_EQ(w->rows.size(), static_cast<size_t>(m * G * 4 + m * k)) << what;
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t g = 0; g < G; ++g) {
        EXPECT_EQ(w->scales()[r * G + g], static_cast<float>(1 + ((r0 + r) / 128) * 3 + (i0 / 128 + g))) << what;
      }
    }
    EXPECT_EQ(std::memcmp(w->codes(), codes.data() + r0 * 384 + i0, static_cast<size_t>(k)), 0) << what;
    std::vector<float> back(m * k);
    DequantizeFp8Groups(back.data(), w->scales(), w->codes(), m, k, w->group);
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t i = 0; i < k; ++i) {
        ASSERT_EQ(dense->dense[r * k + i], value(r0 + r, i0 + i)) << what << ": " << r << ", " << i;
        ASSERT_EQ(back[r * k + i], value(r0 + r, i0 + i)) << what << ": " << r << ", " << i;
      }
    }
  }
}

// ---- Checkpoints kept in a kernel's layout (int8, fp8): the codes and scales as stored ----------

// Int8RowsLayout's reference applied to a slice held as int8 rows (or Fp8RowsLayout's for fp8,
// with its input-group scales where it has them).
std::vector<float> DequantizeRows(const QuantizedLinearSlice& w) {
  std::vector<float> out(w.m * w.k);
  if (w.kernel == WeightQuant::kInt8) {
    DequantizeInt8Rows(out.data(), w.scales(), reinterpret_cast<const int8_t*>(w.codes()), w.m, w.k);
  } else {
    DequantizeFp8Groups(out.data(), w.scales(), w.codes(), w.m, w.k, w.group);
  }
  return out;
}

// [out 8, in 8] 8-bit codes, 4 per int32 along the input (lowest byte first): each word 0x01FF8000
// stores inputs 4j .. 4j + 3 as 0x00, 0x80, 0xFF, 0x01, i.e. q - 128 = -128, 0, 127, -127; output
// r's scale is r + 1 (f16 1 .. 8): w[r][i] = (r + 1) x kCodes[i % 4].
constexpr int kCodes[4] = {-128, 0, 127, -127};
const std::vector<uint16_t> kF16OneToEight = {0x3C00, 0x4000, 0x4200, 0x4400, 0x4500, 0x4600, 0x4700, 0x4800};

void ExpectInt8KnownAnswer(const QuantizedLinearSlice& w, const std::string& what) {
  ASSERT_EQ(w.kernel, WeightQuant::kInt8) << what << ": " << w.why_dense;
  ASSERT_EQ(w.rows.size(), static_cast<size_t>(Int8RowsLayout{8, 8}.bytes())) << what;
  const std::vector<float> back = DequantizeRows(w);
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(w.row_scale(r), static_cast<float>(r + 1)) << what << " row " << r;
    for (int i = 0; i < 8; ++i) {
      EXPECT_EQ(static_cast<int8_t>(w.codes()[r * 8 + i]), kCodes[i % 4]) << what << ": " << r << ", " << i;
      EXPECT_EQ(back[r * 8 + i], static_cast<float>((r + 1) * kCodes[i % 4])) << what << ": " << r << ", " << i;
    }
  }
}

// Finite scales whose product with a quantized value overflows float32 (1e38 x -128) made an
// infinite weight that was loaded (every logit NaN at the first step). Refused, naming the weight,
// on the int8 kernel layout and on the dequantized path alike.
TEST(QuantizedKnownAnswers, AScaleTimesAValueThatOverflowsFloat32IsRefused) {
  FakeGptqTensors src;
  src.Add("l.qweight", {2, 8}, DType::kI32, Bytes(std::vector<uint32_t>(2 * 8, 0x01FF8000u)));
  src.Add("l.qzeros", {1, 2}, DType::kI32, Bytes(std::vector<uint32_t>(2, 0x7F7F7F7Fu)));
  std::vector<float> scales(8, 1.0f);
  scales[5] = 1e38f;  // finite, and nonzero
  src.Add("l.scales", {1, 8}, DType::kF32, Bytes(scales));
  src.Add("l.g_idx", {8}, DType::kI32, Bytes(std::vector<int32_t>(8, 0)));
  absl::StatusOr<CheckpointQuant> c =
      ParseCheckpointQuant(R"({"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": true})", "t");
  ASSERT_TRUE(c.ok()) << c.status();
  for (bool map : {true, false}) {
    absl::StatusOr<QuantizedLinearSlice> w = ReadQuantizedLinear(src, *c, "l", 8, 8, Slice{0, 0, -1}, map);
    EXPECT_TRUE(absl::IsInvalidArgument(w.status())) << map << ": " << w.status();
    EXPECT_TRUE(absl::StrContains(w.status().message(), "l: weight [5][0] is -inf: its scale times its quantized "
                                                         "value overflows float32"))
        << w.status();
    // A slice without that output loads; one with it names the weight in the layer's coordinates.
    EXPECT_TRUE(ReadQuantizedLinear(src, *c, "l", 8, 8, Slice{0, 0, 4}, map).ok());
    w = ReadQuantizedLinear(src, *c, "l", 8, 8, Slice{0, 4, -1}, map);
    EXPECT_TRUE(absl::StrContains(w.status().message(), "weight [5][0] is -inf")) << w.status();
  }
}

TEST(QuantizedKnownAnswers, Gptq8BitSymPerChannelKeepsItsInt8Codes) {
  // GPTQ v1 stores the zero point 128 as 127 (0x7F7F7F7F).
  FakeGptqTensors src;
  src.Add("l.qweight", {2, 8}, DType::kI32, Bytes(std::vector<uint32_t>(2 * 8, 0x01FF8000u)));
  src.Add("l.qzeros", {1, 2}, DType::kI32, Bytes(std::vector<uint32_t>(2, 0x7F7F7F7Fu)));
  src.Add("l.scales", {1, 8}, DType::kF16, Bytes(kF16OneToEight));
  src.Add("l.g_idx", {8}, DType::kI32, Bytes(std::vector<int32_t>(8, 0)));
  absl::StatusOr<CheckpointQuant> c =
      ParseCheckpointQuant(R"({"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": true})", "t");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(CheckpointQuantKernel(*c), WeightQuant::kInt8);
  absl::StatusOr<QuantizedLinearSlice> w = ReadQuantizedLinear(src, *c, "l", 8, 8, Slice{0, 0, -1});
  ASSERT_TRUE(w.ok()) << w.status();
  ExpectInt8KnownAnswer(*w, "GPTQ");
  // The dequantized path gives the same floats.
  absl::StatusOr<QuantizedLinearSlice> dense = ReadQuantizedLinear(src, *c, "l", 8, 8, Slice{0, 0, -1}, /*map=*/false);
  ASSERT_TRUE(dense.ok()) << dense.status();
  EXPECT_EQ(dense->dense, DequantizeRows(*w));
  // Asymmetric with zero points other than 128 (v1 stores 0x7E: 127): dequantized, saying why.
  src.Add("l.qzeros", {1, 2}, DType::kI32, Bytes(std::vector<uint32_t>(2, 0x7E7E7E7Eu)));
  c->sym = false;
  w = ReadQuantizedLinear(src, *c, "l", 8, 8, Slice{0, 0, -1});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->kernel, WeightQuant::kNone);
  EXPECT_TRUE(absl::StrContains(w->why_dense, "zero points other than 128")) << w->why_dense;
  EXPECT_EQ(w->dense[3 * 8 + 2], 4.0f * (255 - 127));
  EXPECT_EQ(CheckpointQuantKernel(*c), WeightQuant::kNone);
}

TEST(QuantizedKnownAnswers, CompressedTensorsInt8ChannelKeepsItsInt8Codes) {
  FakeGptqTensors src;
  src.Add("l.weight_packed", {8, 2}, DType::kI32, Bytes(std::vector<uint32_t>(8 * 2, 0x01FF8000u)));
  src.Add("l.weight_scale", {8, 1}, DType::kF16, Bytes(kF16OneToEight));
  src.Add("l.weight_shape", {2}, DType::kI32, Bytes(std::vector<int32_t>{8, 8}));
  absl::StatusOr<CheckpointQuant> c = ParseCheckpointQuant(
      R"({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
          "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "symmetric": true,
          "strategy": "channel"}}}})",
      "t");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(CheckpointQuantKernel(*c), WeightQuant::kInt8);
  absl::StatusOr<QuantizedLinearSlice> w = ReadQuantizedLinear(src, *c, "l", 8, 8, Slice{0, 0, -1});
  ASSERT_TRUE(w.ok()) << w.status();
  ExpectInt8KnownAnswer(*w, "compressed-tensors");
  // Groups of 4 along the input: two scales per row, dequantized, saying why.
  src.Add("l.weight_scale", {8, 2}, DType::kF16, Bytes(std::vector<uint16_t>(16, 0x3C00)));
  c->group_size = 4;
  w = ReadQuantizedLinear(src, *c, "l", 8, 8, Slice{0, 0, -1});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->kernel, WeightQuant::kNone);
  EXPECT_TRUE(absl::StrContains(w->why_dense, "8 bits in groups of 4 along the input")) << w->why_dense;
  EXPECT_EQ(CheckpointQuantKernel(*c), WeightQuant::kNone);
}

// compressed-tensors float-quantized: the e4m3 bytes as stored, one scale per row (a per-tensor
// scale repeated), every byte but the NaNs 0x7F and 0xFF (0x7E, 0xFE in their place); half the rows
// or inputs (TP slices) too.
TEST(QuantizedKnownAnswers, CompressedTensorsFp8KeepsItsBytes) {
  std::vector<uint8_t> bytes(8 * 32);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(Fp8E4m3IsNan(static_cast<uint8_t>(i)) ? i - 1 : i);
  for (const char* strategy : {"channel", "tensor"}) {
    const bool tensor = std::string(strategy) == "tensor";
    FakeGptqTensors src;
    src.Add("l.weight", {8, 32}, DType::kI8, bytes);
    if (tensor) {
      src.Add("l.weight_scale", {1}, DType::kF32, Bytes(std::vector<float>{0.25f}));
    } else {
      src.Add("l.weight_scale", {8, 1}, DType::kF16, Bytes(kF16OneToEight));
    }
    absl::StatusOr<CheckpointQuant> c = ParseCheckpointQuant(
        absl::StrCat(R"({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
          "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": ")",
                     strategy, R"("}}}})"),
        "t");
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(CheckpointQuantKernel(*c), WeightQuant::kFp8);
    for (const Slice slice : {Slice{0, 0, -1}, Slice{0, 4, 8}, Slice{1, 16, 32}}) {
      const std::string what = absl::StrCat(strategy, " slice dim ", slice.dim, " from ", slice.begin);
      absl::StatusOr<QuantizedLinearSlice> w = ReadQuantizedLinear(src, *c, "l", 8, 32, slice);
      ASSERT_TRUE(w.ok()) << what << ": " << w.status();
      ASSERT_EQ(w->kernel, WeightQuant::kFp8) << what;
      const int64_t r0 = slice.dim == 0 ? slice.begin : 0, i0 = slice.dim == 1 ? slice.begin : 0;
      for (int64_t r = 0; r < w->m; ++r) {
        EXPECT_EQ(w->row_scale(r), tensor ? 0.25f : static_cast<float>(r0 + r + 1)) << what;
        for (int64_t i = 0; i < w->k; ++i) {
          ASSERT_EQ(w->codes()[r * w->k + i], bytes[(r0 + r) * 32 + i0 + i]) << what << ": " << r << ", " << i;
        }
      }
      absl::StatusOr<QuantizedLinearSlice> dense = ReadQuantizedLinear(src, *c, "l", 8, 32, slice, /*map=*/false);
      ASSERT_TRUE(dense.ok()) << dense.status();
      EXPECT_EQ(dense->dense, DequantizeRows(*w)) << what;
    }
  }
}

// FP8 block scales stay dequantized where the fp8 kernels' input-group scales cannot hold them,
// saying why: blocks of inputs that are not a multiple of 8 (20), and a row-parallel rank whose
// inputs start inside a block (inputs [64, 384) of 128-wide blocks); a rank whose inputs start on a
// block's edge maps, and one whose inputs lie in one block maps with one scale a row (group 0), even
// for blocks of 20. The planner counts the same (CheckpointLinearBytes).
TEST(QuantizedKnownAnswers, Fp8BlockScalesOffTheKernelsGroupsStayDequantizedSayingWhy) {
  FakeGptqTensors src;
  src.Add("l.weight", {256, 384}, DType::kI8, std::vector<uint8_t>(256 * 384, 0x38));
  src.Add("l.weight_scale_inv", {2, 3}, DType::kF32, Bytes(std::vector<float>{1, 2, 3, 4, 5, 6}));
  src.Add("n.weight", {256, 40}, DType::kI8, std::vector<uint8_t>(256 * 40, 0x38));
  src.Add("n.weight_scale_inv", {2, 2}, DType::kF32, Bytes(std::vector<float>{1, 2, 3, 4}));
  absl::StatusOr<CheckpointQuant> c128 = ParseCheckpointQuant(
      R"({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})", "t");
  absl::StatusOr<CheckpointQuant> c20 = ParseCheckpointQuant(
      R"({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 20]})", "t");
  ASSERT_TRUE(c128.ok() && c20.ok()) << c128.status() << c20.status();
  EXPECT_EQ(CheckpointQuantKernel(*c20), WeightQuant::kNone);
  // Blocks of 20 inputs: dequantized, saying so.
  absl::StatusOr<QuantizedLinearSlice> w = ReadQuantizedLinear(src, *c20, "n", 256, 40, Slice{0, 0, -1});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->kernel, WeightQuant::kNone);
  EXPECT_TRUE(absl::StrContains(w->why_dense, "128x20 block scales: the fp8 kernels take scale groups of a multiple "
                                              "of 8 inputs"))
      << w->why_dense;
  EXPECT_EQ(CheckpointLinearBytes(*c20, 256, 40, 0), -1);
  // ... but a rank's 20 inputs in one block: one scale a row.
  w = ReadQuantizedLinear(src, *c20, "n", 256, 40, Slice{1, 20, -1});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->kernel, WeightQuant::kFp8) << w->why_dense;
  EXPECT_EQ(w->group, 0);
  EXPECT_EQ(w->scales()[0], 2.0f);
  EXPECT_EQ(w->scales()[200], 4.0f);
  EXPECT_EQ(CheckpointLinearBytes(*c20, 256, 20, 20), 256 * 20 + 256 * 4);
  // A row-parallel rank's inputs from 64, inside the first 128-wide block: dequantized, saying so.
  w = ReadQuantizedLinear(src, *c128, "l", 256, 384, Slice{1, 64, -1});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->kernel, WeightQuant::kNone);
  EXPECT_TRUE(absl::StrContains(w->why_dense, "this rank's inputs start at 64, inside a block of 128")) << w->why_dense;
  EXPECT_EQ(CheckpointLinearBytes(*c128, 256, 320, 64), -1);
  // From 128, on a block's edge: the kernel's layout, 1 byte a weight and 4 a group of 128.
  w = ReadQuantizedLinear(src, *c128, "l", 256, 384, Slice{1, 128, -1});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->kernel, WeightQuant::kFp8) << w->why_dense;
  EXPECT_EQ(CheckpointLinearBytes(*c128, 256, 256, 128), 256 * 256 + 256 * 2 * 4);
  EXPECT_EQ(CheckpointLinearBytes(*c128, 256, 384, 0), 256 * 384 + 256 * 3 * 4);
  // Asked not to map: dequantized, saying that.
  w = ReadQuantizedLinear(src, *c128, "l", 256, 384, Slice{0, 0, -1}, /*map=*/false);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->kernel, WeightQuant::kNone);
}

// Every fixture whose weights take a kernel layout: each quantized linear weight of every layer, in
// the layout, is exactly (==) the dequantized path's float32 weight by that layout's reference
// (kernels/quant.h), whole and as each of two TP ranks' slices. (The parity tests above then show
// the kernels multiply them as HF does.)
TEST(QuantizedKnownAnswers, FixtureWeightsInKernelLayoutsEqualTheDequantizedOnes) {
  for (const Variant& v : kVariants) {
    if (v.kernel == kDense) continue;
    const fs::path dir = kFixtures / v.dir / v.name;
    absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
    ASSERT_TRUE(config.ok()) << config.status();
    absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    const CheckpointQuant& c = *config->checkpoint_quant;
    int checked = 0;
    // every linear weight the family declares that the checkpoint stores quantized (the experts too)
    for (const WeightDecl& decl : ModelWeights(*config)) {
      if (!IsCheckpointQuantized(*config, decl) || !IsProductWeight(decl.role) || decl.pick.period > 0) continue;
      const std::string prefix = LinearPrefix(decl.name);
      const int64_t out = decl.shape[0], in = decl.shape[1];
      const WeightRole r = decl.role;
      const int dim = r == WeightRole::kOProj || r == WeightRole::kDownProj || r == WeightRole::kExpertDownProj ||
                              r == WeightRole::kSharedDownProj
                          ? 1
                          : 0;  // row-parallel products are cut along their inputs
      {
        const int64_t extent = dim == 0 ? out : in;
        for (const Slice slice : {Slice{dim, 0, -1}, Slice{dim, 0, extent / 2}, Slice{dim, extent / 2, -1}}) {
          // Slices that cut int4 groups are refused by the planner (CheckQuantizedShard); skip them.
          if (slice.dim == 1 && slice.end != -1 && v.kernel == kInt4 && extent / 2 % kInt4GroupSize != 0) continue;
          if (slice.dim == 1 && slice.begin > 0 && v.kernel == kInt4 && slice.begin % kInt4GroupSize != 0) continue;
          const std::string what = absl::StrCat(v.name, " ", prefix, " slice ", slice.dim, ":", slice.begin);
          absl::StatusOr<QuantizedLinearSlice> w = ReadQuantizedLinear(**ckpt, c, prefix, out, in, slice);
          ASSERT_TRUE(w.ok()) << what << ": " << w.status();
          // FP8 blocks: a rank whose inputs start inside a block stays dequantized (Fp8BlockScalesOff...).
          if (!v.blocks.empty() && slice.dim == 1 && slice.begin % c.block_in != 0) {
            ASSERT_EQ(w->kernel, kDense) << what;
            EXPECT_TRUE(absl::StrContains(w->why_dense, "inside a block")) << what << ": " << w->why_dense;
            continue;
          }
          ASSERT_EQ(w->kernel, v.kernel) << what << ": " << w->why_dense;
          absl::StatusOr<QuantizedLinearSlice> dense = ReadQuantizedLinear(**ckpt, c, prefix, out, in, slice, false);
          ASSERT_TRUE(dense.ok()) << what << ": " << dense.status();
          std::vector<float> back(w->m * w->k);
          if (v.kernel == kInt4) {
            DequantizeInt4Groups(back.data(), w->blocks.data(), w->m, w->k);
          } else {
            back = DequantizeRows(*w);
          }
          ASSERT_EQ(back, dense->dense) << what;
          ++checked;
        }
      }
    }
    EXPECT_GT(checked, 0) << v.name;
  }
}

// Each format's TP rules (CheckQuantizedShard via CheckpointQuant::output_multiple / input_multiple).
TEST(QuantizedShardTest, EachFormatsRules) {
  auto load = [](const std::string& v) {
    absl::StatusOr<ModelConfig> c = LoadModelConfig(kFixtures / v);
    EXPECT_TRUE(c.ok()) << v << ": " << c.status();
    return *c;
  };
  EXPECT_TRUE(CheckQuantizedShard(load("awq/awq_qwen2_g32"), 2, WeightQuant::kNone).ok());
  absl::Status s = CheckQuantizedShard(load("awq/awq_llama_g128"), 2, WeightQuant::kNone);
  EXPECT_TRUE(absl::StrContains(s.message(), "not a whole number of groups of 128")) << s;
  EXPECT_TRUE(CheckQuantizedShard(load("compressed_tensors/ct_int4_asym_g32_qwen2"), 2, WeightQuant::kNone).ok());
  s = CheckQuantizedShard(load("compressed_tensors/ct_int4_asym_g32_qwen2"), 4, WeightQuant::kNone);
  EXPECT_TRUE(absl::StrContains(s.message(), "o_proj's input of 64 columns split over tensor parallel size 4 gives 16"))
      << s;
  EXPECT_TRUE(CheckQuantizedShard(load("fp8/fp8_qwen2_block32x64"), 4, WeightQuant::kNone).ok());
  s = CheckQuantizedShard(load("fp8/fp8_qwen2_block32x64"), 1, WeightQuant::kInt8);
  EXPECT_TRUE(absl::StrContains(s.message(), "already quantized (FP8 e4m3, 32x64 blocks)")) << s;
}

TEST(GptqConfigTest, ParsesTheFields) {
  absl::StatusOr<CheckpointQuant> c = ParseCheckpointQuant(
      R"({"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": false, "desc_act": true,
          "checkpoint_format": "gptq_v2"})",
      "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->bits, 8);
  EXPECT_EQ(c->group_size, -1);
  EXPECT_EQ(c->groups(4096), 1);
  EXPECT_FALSE(c->sym);
  EXPECT_TRUE(c->desc_act);
  EXPECT_TRUE(c->v2);
  EXPECT_EQ(CheckpointQuantKernel(*c), WeightQuant::kNone);  // 8 bits with zero points
  for (const char* bad : {R"({"bits": 4, "group_size": 128})", R"({"quant_method": "gptq", "group_size": 128})",
                          R"({"quant_method": "gptq", "bits": 4})", R"({"quant_method": "gptq", "bits": 4,
                          "group_size": -2})", R"({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": 1})",
                          R"([1])"}) {
    EXPECT_FALSE(ParseCheckpointQuant(bad, "config.json").ok()) << bad;
  }
  // GPTQModel's "dynamic": "-:" patterns leave their modules plain (a MoE router), overrides are refused
  c = ParseCheckpointQuant(
      R"({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"-:.*[.]mlp[.]gate$": {}}})", "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->Quantizes("model.layers.3.mlp.gate"));
  EXPECT_TRUE(c->Quantizes("model.layers.3.mlp.gate_proj"));
  EXPECT_TRUE(c->Quantizes("model.layers.3.mlp.experts.0.gate_proj"));
  c = ParseCheckpointQuant(
      R"({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"+:.*down_proj": {"bits": 8}}})",
      "config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(absl::StrContains(c.status().message(), "\"dynamic\"")) << c.status();
  EXPECT_TRUE(absl::StrContains(c.status().message(), "+:.*down_proj")) << c.status();
}

}  // namespace
}  // namespace shardserve
