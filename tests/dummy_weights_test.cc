// DummyWeights (--load-format dummy, model/dummy_weights.h): any slice equals the same elements
// of the whole tensor, values are a function of the seed, unknown names and wrong shapes are
// refused as Checkpoint refuses them, and an 80-layer model of such weights gives finite logits.
#include "model/dummy_weights.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <filesystem>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "model/config.h"
#include "worker/communicator.h"
#include "worker/shard/greedy.h"
#include "worker/shard/model_shard.h"

namespace shardserve {
namespace {

namespace fs = std::filesystem;
const fs::path kFixtures = fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/models";

ModelConfig Config(const std::string& fixture) {
  absl::StatusOr<ModelConfig> c = LoadModelConfig(kFixtures / fixture);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : ModelConfig{};
}

std::vector<float> ReadF32(const WeightSource& w, const std::string& name, const std::vector<int64_t>& shape,
                           const Slice& slice) {
  int64_t n = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    n *= static_cast<int>(d) == slice.dim ? (slice.end < 0 ? shape[d] : slice.end) - slice.begin : shape[d];
  }
  std::vector<float> out(n, NAN);
  absl::Status s = w.Read(name, shape, slice, DType::kF32, out.data());
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

TEST(DummyWeightsTest, RowAndColumnSlicesAreTheWholeTensorsElements) {
  const ModelConfig c = Config("qwen2_tied_bias");
  const DummyWeights w(c, 3);
  const std::string o = "model.layers.1.self_attn.o_proj.weight";
  const int64_t rows = c.hidden_size, cols = c.q_dim();
  const std::vector<float> whole = ReadF32(w, o, {rows, cols}, Slice{0, 0, -1});
  for (int64_t i = 0; i < rows * cols; ++i) ASSERT_EQ(whole[i], w.Element(o, i)) << i;
  // Rows [3, 9) and columns [5, 11): the elements at the same (r, c) of the whole.
  const std::vector<float> row_part = ReadF32(w, o, {rows, cols}, Slice{0, 3, 9});
  for (int64_t r = 3; r < 9; ++r) {
    for (int64_t k = 0; k < cols; ++k) ASSERT_EQ(row_part[(r - 3) * cols + k], whole[r * cols + k]);
  }
  const std::vector<float> col_part = ReadF32(w, o, {rows, cols}, Slice{1, 5, 11});
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 5; k < 11; ++k) ASSERT_EQ(col_part[r * 6 + (k - 5)], whole[r * cols + k]);
  }
  // A bias, a 1-D range of it.
  const std::string b = "model.layers.0.self_attn.k_proj.bias";
  const std::vector<float> bias = ReadF32(w, b, {c.kv_dim()}, Slice{0, 0, -1});
  const std::vector<float> bias_part = ReadF32(w, b, {c.kv_dim()}, Slice{0, 2, 7});
  for (int64_t i = 2; i < 7; ++i) EXPECT_EQ(bias_part[i - 2], bias[i]);
  // In bf16: the float32 values rounded, as Checkpoint converts.
  std::vector<uint16_t> bf16(rows * cols);
  ASSERT_TRUE(w.Read(o, {rows, cols}, Slice{0, 0, -1}, DType::kBF16, bf16.data()).ok());
  for (int64_t i = 0; i < rows * cols; ++i) ASSERT_EQ(bf16[i], F32ToBf16(whole[i])) << i;
}

TEST(DummyWeightsTest, ValuesHaveTheStatedScalesAndFollowTheSeed) {
  const ModelConfig c = Config("llama_gqa");
  const DummyWeights a(c, 0), again(c, 0), other(c, 1);
  const std::string up = "model.layers.2.mlp.up_proj.weight";
  const std::vector<int64_t> shape = {c.intermediate_size, c.hidden_size};
  const std::vector<float> x = ReadF32(a, up, shape, Slice{0, 0, -1});
  EXPECT_EQ(x, ReadF32(again, up, shape, Slice{0, 0, -1}));
  const std::vector<float> y = ReadF32(other, up, shape, Slice{0, 0, -1});
  int64_t same = 0;
  for (size_t i = 0; i < x.size(); ++i) same += x[i] == y[i];
  EXPECT_LT(same, 4) << "seeds 0 and 1 give mostly the same values";
  // Another tensor of the same shape and seed is another stream.
  const std::vector<float> gate = ReadF32(a, "model.layers.2.mlp.gate_proj.weight", shape, Slice{0, 0, -1});
  EXPECT_NE(x, gate);

  // Uniform in (-1/sqrt(in), 1/sqrt(in)): inside the bound, mean ~0, variance ~a^2 / 3.
  const double bound = 1.0 / std::sqrt(static_cast<double>(c.hidden_size));
  double sum = 0, sum2 = 0;
  for (float v : x) {
    ASSERT_LT(std::abs(v), bound);
    sum += v;
    sum2 += static_cast<double>(v) * v;
  }
  const double n = static_cast<double>(x.size()), mean = sum / n, var = sum2 / n - mean * mean;
  EXPECT_LT(std::abs(mean), 0.05 * bound);
  EXPECT_NEAR(var, bound * bound / 3, 0.05 * bound * bound);
  // Norms are 1.0 exactly.
  for (float v : ReadF32(a, "model.layers.0.input_layernorm.weight", {c.hidden_size}, Slice{0, 0, -1})) EXPECT_EQ(v, 1.0f);
  for (float v : ReadF32(a, "model.norm.weight", {c.hidden_size}, Slice{0, 0, -1})) EXPECT_EQ(v, 1.0f);
}

TEST(DummyWeightsTest, RefusesWhatTheModelDoesNotHaveAsACheckpointDoes) {
  const ModelConfig c = Config("llama_gqa");  // untied, no attention bias, 5 layers
  const DummyWeights w(c, 0);
  std::vector<float> buf(c.vocab_size * c.hidden_size);
  const Slice all{0, 0, -1};
  for (const std::string name : {"model.layers.5.input_layernorm.weight", "model.layers.0.self_attn.q_proj.bias",
                                 "lm_head.bias", "model.embed_tokens"}) {
    absl::Status s = w.CheckShape(name, {c.hidden_size});
    EXPECT_TRUE(absl::IsNotFound(s)) << name << ": " << s;
    EXPECT_NE(s.message().find(name), std::string::npos) << s;
    EXPECT_TRUE(absl::IsNotFound(w.Read(name, {c.hidden_size}, all, DType::kF32, buf.data())));
  }
  absl::Status s = w.Read("lm_head.weight", {c.vocab_size + 1, c.hidden_size}, all, DType::kF32, buf.data());
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("[512, 64]"), std::string::npos) << s;
  EXPECT_NE(s.message().find("[513, 64]"), std::string::npos) << s;
  EXPECT_TRUE(absl::IsInvalidArgument(
      w.Read("lm_head.weight", {c.vocab_size, c.hidden_size}, Slice{0, 10, c.vocab_size + 1}, DType::kF32, buf.data())));
  EXPECT_TRUE(absl::IsInvalidArgument(
      w.Read("lm_head.weight", {c.vocab_size, c.hidden_size}, Slice{2, 0, 1}, DType::kF32, buf.data())));
  EXPECT_TRUE(absl::IsInvalidArgument(
      w.Read("lm_head.weight", {c.vocab_size, c.hidden_size}, all, DType::kI32, buf.data())));

  // Tied models have no lm_head.weight; Qwen2 has q/k/v biases.
  const DummyWeights tied(Config("qwen2_tied_bias"), 0);
  EXPECT_TRUE(absl::IsNotFound(tied.CheckShape("lm_head.weight", {1, 1})));
  const ModelConfig q = Config("qwen2_tied_bias");
  EXPECT_TRUE(tied.CheckShape("model.layers.0.self_attn.q_proj.bias", {q.q_dim()}).ok());
}

// Values pinned from an independent reimplementation of the formula (FNV-1a of the name, SplitMix64
// of the seed and the element index, the top 24 bits k to float(2k + 1) / 2^24 - 1, times
// 1/sqrt(cols) or 0.1 for biases, each step rounded to float32 as C++ rounds it), in Python:
// tools/ci/dummy_weights_reference.py prints them, and the ctest dummy_weights_reference checks that
// these literals are its values. A change of the formula (which would change every dummy-based
// expectation and the GPU kernel's) fails here first.
TEST(DummyWeightsTest, KnownValues) {
  const DummyWeights w(Config("qwen2_tied_bias"), 7);  // hidden 64, intermediate 128
  EXPECT_EQ(w.Element("model.embed_tokens.weight", 0), 0x1.962148p-4f);
  EXPECT_EQ(w.Element("model.embed_tokens.weight", 1), 0x1.ea05f0p-4f);
  EXPECT_EQ(w.Element("model.embed_tokens.weight", 12345), 0x1.feff20p-4f);
  EXPECT_EQ(w.Element("model.layers.2.mlp.down_proj.weight", 0), -0x1.403214p-4f);
  EXPECT_EQ(w.Element("model.layers.2.mlp.down_proj.weight", 7), -0x1.315434p-4f);
  EXPECT_EQ(w.Element("model.layers.2.mlp.down_proj.weight", 8191), 0x1.676b4cp-5f);
  EXPECT_EQ(w.Element("model.layers.0.self_attn.q_proj.bias", 0), -0x1.f13cfep-5f);
  EXPECT_EQ(w.Element("model.layers.0.self_attn.q_proj.bias", 63), 0x1.7b396ep-4f);
}

// ReadOnDevice (the path a CUDA worker takes with --dummy-weights device) writes what Read writes,
// through Backend::FillCounterUniform; here on the CPU backend, the same bytes in F32 and (through
// the host conversion) BF16. Without on_device it refuses with Unimplemented, and the loader reads
// on the host as before. The CUDA kernel's bytes are checked against the host generator's in
// kernels_cuda_test (CudaVsCpu.CounterUniform).
TEST(DummyWeightsTest, ReadOnDeviceWritesWhatReadWrites) {
  const ModelConfig c = Config("qwen2_tied_bias");
  const DummyWeights on(c, 5, /*on_device=*/true), off(c, 5);
  std::unique_ptr<Backend> cpu = MakeCpuBackend(1);
  const std::string name = "model.layers.1.mlp.gate_proj.weight";
  const std::vector<int64_t> shape = {c.intermediate_size, c.hidden_size};
  for (const Slice& slice : {Slice{0, 0, -1}, Slice{0, 32, 64}, Slice{1, 16, 48}}) {
    for (DType t : {DType::kF32, DType::kBF16}) {
      const int64_t rows = slice.dim == 0 ? (slice.end < 0 ? shape[0] : slice.end) - slice.begin : shape[0];
      const int64_t cols = slice.dim == 1 ? slice.end - slice.begin : shape[1];
      absl::StatusOr<Buffer> buf = cpu->Allocate(static_cast<size_t>(rows * cols) * DTypeSize(t));
      ASSERT_TRUE(buf.ok()) << buf.status();
      Tensor dst = buf->View(t, {rows, cols});
      std::memset(dst.data, 0xFF, dst.bytes());
      absl::Status s = on.ReadOnDevice(name, shape, slice, cpu.get(), &dst);
      ASSERT_TRUE(s.ok()) << s;
      std::vector<uint8_t> want(dst.bytes(), 0);
      ASSERT_TRUE(off.Read(name, shape, slice, t, want.data()).ok());
      EXPECT_EQ(std::memcmp(dst.data, want.data(), want.size()), 0) << DTypeName(t) << " slice dim " << slice.dim;
      EXPECT_TRUE(absl::IsUnimplemented(off.ReadOnDevice(name, shape, slice, cpu.get(), &dst)));
    }
  }
  // Errors name the tensor: a wrong shape, and an output of the wrong size.
  absl::StatusOr<Buffer> small = cpu->Allocate(16);
  ASSERT_TRUE(small.ok());
  Tensor tiny = small->View(DType::kF32, {2, 2});
  absl::Status s = on.ReadOnDevice(name, shape, Slice{0, 0, -1}, cpu.get(), &tiny);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find(name), std::string::npos) << s;
  EXPECT_TRUE(absl::IsInvalidArgument(on.ReadOnDevice(name, {1, 1}, Slice{0, 0, -1}, cpu.get(), &tiny)));
}

// The argument in model/dummy_weights.cc (pre-norm blocks add increments of bounded size) checked:
// 80 layers of a small model (llama_gqa's sizes: hidden 64, 4 heads, 2 KV heads) load and decode
// 8 tokens with finite logits of a sane size (RMS between 0.05 and 10, not all alike).
TEST(DummyWeightsTest, EightyLayersGiveFiniteLogits) {
  ModelConfig c = Config("llama_gqa");
  c.num_hidden_layers = 80;
  const DummyWeights w(c, 0);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  LocalCommunicator tp(backend.get());
  const StepLimits limits{.max_tokens_per_step = 64, .max_seqs_per_step = 1, .block_size = 16, .num_kv_blocks = 4,
                          .max_model_len = 64};
  absl::StatusOr<std::unique_ptr<ModelShard>> model = ModelShard::Load(w, c, ShardSpec{}, limits, backend.get(), &tp);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<int32_t> prompt = {1, 17, 300, 42, 511, 7, 99, 256, 3, 128};
  std::vector<std::vector<float>> logits;
  absl::StatusOr<std::vector<int32_t>> ids = GreedyGenerate(model->get(), prompt, 8, &logits);
  ASSERT_TRUE(ids.ok()) << ids.status();
  ASSERT_EQ(logits.size(), 8u);
  for (const std::vector<float>& step : logits) {
    double sum2 = 0;
    float lo = INFINITY, hi = -INFINITY;
    for (float v : step) {
      ASSERT_TRUE(std::isfinite(v));
      sum2 += static_cast<double>(v) * v;
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    const double rms = std::sqrt(sum2 / step.size());
    EXPECT_GT(rms, 0.05);
    EXPECT_LT(rms, 10.0);
    EXPECT_GT(hi - lo, 0.1) << "the logits are all alike";
  }
}

}  // namespace
}  // namespace shardserve
