// Published GPTQ checkpoints (model/gptq.h): every fixture under tests/fixtures/gptq (made by
// tools/make_gptq_fixtures.py) gives Hugging Face's greedy tokens and logits in one process, by
// the path it should take (the int4 kernel's blocks, or float32 dequantized at load), and every
// malformed checkpoint or config is refused with an error naming the tensor or the field.
// (The multi-process layouts are in tests/cluster_test.cc, ClusterGptqTest.)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "base/status_macros.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/quant.h"
#include "kernels/tensor.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/gptq.h"
#include "model/sharding.h"
#include "model/weight_source.h"
#include "nlohmann/json.hpp"
#include "worker/communicator.h"
#include "worker/llama.h"

namespace shardserve {
namespace {

namespace fs = std::filesystem;

const fs::path kGptqFixtures = fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/gptq";

// The weights are exactly what HF ran (an f16 scale times a small integer, in float32), so the only
// difference is float32 rounding: the dequantized path sums as the float32 parity tests do (1e-6
// relative measured there); the mapped path's int4 kernel sums scale x (sum x q - zero x sum x)
// per group, ~10x more rounding (tests/llama_parity_test.cc, kInt4DequantizedTolerance). 1e-4 of the
// logits' scale bounds both with room; a wrong nibble, zero point (the v1 + 1), scale or g_idx
// moves the logits by 1e-2 or more.
constexpr double kTolerance = 1e-4;

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

double NormalizedError(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size() || b.empty()) return INFINITY;
  double diff = 0, scale = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return diff / scale;
}

const StepLimits kLimits{.max_tokens_per_step = 256, .max_seqs_per_step = 4, .block_size = 16, .num_kv_blocks = 8,
                         .max_model_len = 8 * 16};

// Loads `dir` in one process (TP = 1 unless `spec` says otherwise: then only the load is tried).
absl::StatusOr<std::unique_ptr<LlamaShard>> LoadModel(const fs::path& dir, Backend* backend, Communicator* tp,
                                                      ShardSpec spec = {}) {
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  if (!config.ok()) return config.status();
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir);
  if (!ckpt.ok()) return ckpt.status();
  return LlamaShard::Load(**ckpt, *config, spec, kLimits, backend, tp);
}

struct Variant {
  std::string name;
  bool mapped;  // every linear weight takes the int4 path (else every one is dequantized)
};

const Variant kVariants[] = {
    {"llama_sym4_g128_v1", true},           {"qwen2_asym4_g128_v2", true},
    {"qwen2_asym4_g32_desc_act_v1", false}, {"qwen2_sym4_gall_v1", false},
    {"qwen2_asym8_g32_v2", false},
};

class GptqParity : public ::testing::TestWithParam<Variant> {};

// HF's 32 greedy tokens exactly, and its logits after the prompt and at the last step within
// kTolerance; the worker's summary names the path every weight took.
TEST_P(GptqParity, GivesHuggingFaceTokensAndLogits) {
  const Variant& v = GetParam();
  const fs::path dir = kGptqFixtures / v.name;
  const Golden g = LoadGolden(dir);
  ASSERT_EQ(g.greedy.size(), 32u);
  std::unique_ptr<Backend> backend = MakeCpuBackend(0, CpuMatMul::kF32);
  LocalCommunicator tp(backend.get());
  absl::StatusOr<std::unique_ptr<LlamaShard>> model = LoadModel(dir, backend.get(), &tp);
  ASSERT_TRUE(model.ok()) << v.name << ": " << model.status();
  const std::string summary = (*model)->QuantizationSummary();
  const int layers = static_cast<int>((*model)->config().num_hidden_layers);
  if (v.mapped) {
    EXPECT_TRUE(absl::StrContains(summary, absl::StrCat(7 * layers, " linear weights as int4"))) << summary;
    EXPECT_FALSE(absl::StrContains(summary, "dequantized")) << summary;
  } else {
    EXPECT_TRUE(absl::StrContains(summary, absl::StrCat(7 * layers, " dequantized to float32"))) << summary;
  }
  std::vector<std::vector<float>> logits;
  absl::StatusOr<std::vector<int32_t>> ids = GreedyGenerate(model->get(), g.prompt, 32, &logits);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, g.greedy) << v.name;
  ASSERT_EQ(logits.size(), 32u);
  const double first = NormalizedError(logits.front(), g.prompt_last_logits);
  const double last = NormalizedError(logits.back(), g.final_logits);
  EXPECT_LE(first, kTolerance) << v.name << ": logits after the prompt";
  EXPECT_LE(last, kTolerance) << v.name << ": logits of the last greedy step";
  std::printf("[ gptq     ] %s: %s; logits error %.3g after the prompt, %.3g at step 32\n", v.name.c_str(),
              summary.c_str(), first, last);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GptqParity, ::testing::ValuesIn(kVariants),
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
  void Copy(const std::string& variant) {
    for (const auto& e : fs::directory_iterator(kGptqFixtures / variant)) {
      fs::copy_file(e.path(), dir_ / e.path().filename(), fs::copy_options::overwrite_existing);
    }
  }
  void EditConfig(const std::string& field, const nlohmann::json& value) {
    std::ifstream in(dir_ / "config.json");
    nlohmann::json j = nlohmann::json::parse(in);
    j["quantization_config"][field] = value;
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
    absl::StatusOr<std::unique_ptr<LlamaShard>> model = LoadModel(dir_, backend.get(), &tp, spec);
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
  absl::StatusOr<std::unique_ptr<LlamaShard>> model = LoadModel(dir_, backend.get(), &tp);
  EXPECT_TRUE(model.ok()) << model.status();
}

TEST_F(GptqRefusalTest, AnotherQuantMethod) {
  Copy("qwen2_asym4_g128_v2");
  EditConfig("quant_method", "awq");
  ExpectRefused({"quant_method", "\"awq\""});
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
  ExpectRefused({".qweight", "8 bits"});
}

TEST_F(GptqRefusalTest, NanInfAndZeroScales) {
  for (uint16_t bad : {uint16_t{0x7e00} /*NaN*/, uint16_t{0x7c00} /*+Inf*/, uint16_t{0} /*zero*/}) {
    Copy("qwen2_asym4_g32_desc_act_v1");
    Poke("model.layers.2.mlp.down_proj.scales", 2 * 5, &bad, 2);  // scales[0][5]
    ExpectRefused({"model.layers.2.mlp.down_proj.scales[0][5]", "finite and nonzero"});
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

// TP = 2 would cut o_proj's 64 inputs (one short group of 128) into 32 per rank: refused with the
// numbers, by the check the planner uses too. Groups of 32 split cleanly.
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

// Known answers, independent of tools/make_gptq_fixtures.py (which shares the loader's reading of
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
  // Whole tensors only, in their own dtype (F16 widened to F32).
  absl::Status Read(const std::string& name, const std::vector<int64_t>& shape, const Slice& slice, DType dst_type,
                    void* dst) const override {
    SHARDSERVE_RETURN_IF_ERROR(CheckShape(name, shape));
    const Stored& t = tensors_.at(name);
    if (slice.begin != 0 || (slice.end != -1 && slice.end != t.shape[slice.dim])) {
      return absl::UnimplementedError("whole tensors only");
    }
    if (t.dtype == DType::kI32 && dst_type == DType::kI32) {
      std::memcpy(dst, t.bytes.data(), t.bytes.size());
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
  GptqConfig c;
  c.group_size = -1;
  absl::StatusOr<GptqLinearSlice> w = ReadGptqLinear(src, c, "l", 8, 8, Slice{0, 0, -1});
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_FALSE(w->mapped);
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
  GptqConfig c;
  c.sym = false;
  c.v2 = true;
  absl::StatusOr<GptqLinearSlice> w = ReadGptqLinear(src, c, "l", 8, 128, Slice{0, 0, -1});
  ASSERT_TRUE(w.ok()) << w.status();
  ASSERT_TRUE(w->mapped);
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
  w = ReadGptqLinear(src, c, "l", 8, 128, Slice{0, 0, -1});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->blocks[5].zero, 4);
}

TEST(GptqConfigTest, ParsesTheFields) {
  absl::StatusOr<GptqConfig> c = ParseGptqConfig(
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
  EXPECT_FALSE(GptqMapsToInt4(*c));
  for (const char* bad : {R"({"bits": 4, "group_size": 128})", R"({"quant_method": "gptq", "group_size": 128})",
                          R"({"quant_method": "gptq", "bits": 4})", R"({"quant_method": "gptq", "bits": 4,
                          "group_size": -2})", R"({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": 1})",
                          R"([1])"}) {
    EXPECT_FALSE(ParseGptqConfig(bad, "config.json").ok()) << bad;
  }
}

}  // namespace
}  // namespace shardserve
