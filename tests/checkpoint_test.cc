// config.json and safetensors reading: slices, sharded checkpoints, and every kind of bad input
// (each gives an error naming the file and the tensor or field; none crashes).
#include <unistd.h>

#include <bit>
#include <cmath>
#include <functional>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/families/registry.h"
#include "kernels/quant.h"
#include "model/mxfp4.h"
#include "model/sharding.h"
#include "nlohmann/json.hpp"
#include "tests/device_like_backend.h"
#include "worker/shard/model_shard.h"

namespace shardserve {
namespace {

namespace fs = std::filesystem;

// Small step limits for loading a shard: 256 tokens and 16 sequences per step, 64 blocks of 16 tokens.
constexpr StepLimits kLimits{.max_tokens_per_step = 256, .max_seqs_per_step = 16, .block_size = 16,
                             .num_kv_blocks = 64, .max_model_len = 512};
using json = nlohmann::json;
using ::testing::HasSubstr;
using ::testing::Not;

// A tensor to write: name, shape, F32 values (generated) or raw header overrides.
struct FakeTensor {
  std::string name;
  std::vector<int64_t> shape;
};

// Writes a safetensors file of F32 tensors whose value at flat index i is base + i, where base
// is the tensor's order in `tensors` times 1000.
void WriteSafetensors(const fs::path& path, const std::vector<FakeTensor>& tensors) {
  json header = json::object();
  std::vector<float> data;
  for (size_t t = 0; t < tensors.size(); ++t) {
    int64_t numel = 1;
    for (int64_t d : tensors[t].shape) numel *= d;
    const size_t begin = data.size() * 4;
    for (int64_t i = 0; i < numel; ++i) data.push_back(static_cast<float>(t * 1000 + i));
    header[tensors[t].name] = {{"dtype", "F32"}, {"shape", tensors[t].shape}, {"data_offsets", {begin, data.size() * 4}}};
  }
  std::string h = header.dump();
  std::ofstream out(path, std::ios::binary);
  uint64_t len = h.size();
  out.write(reinterpret_cast<const char*>(&len), 8);
  out << h;
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size() * 4));
}

// Overwrites element `index` of F32 tensor `name` in the safetensors file at `path` with `value`.
void PoisonF32(const fs::path& path, const std::string& name, int64_t index, float value) {
  std::fstream f(path, std::ios::binary | std::ios::in | std::ios::out);
  uint64_t len = 0;
  f.read(reinterpret_cast<char*>(&len), 8);
  std::string h(len, '\0');
  f.read(h.data(), static_cast<std::streamsize>(len));
  const uint64_t begin = json::parse(h)[name]["data_offsets"][0].get<uint64_t>();
  f.seekp(static_cast<std::streamoff>(8 + len + begin + 4 * index));
  f.write(reinterpret_cast<const char*>(&value), 4);
}

// Writes raw bytes: an 8-byte little-endian length, the header text, then `data_bytes` zeros.
void WriteRaw(const fs::path& path, uint64_t declared_len, const std::string& header, size_t data_bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(&declared_len), 8);
  out << header;
  out << std::string(data_bytes, '\0');
}

json TinyConfig() {
  return {{"architectures", {"LlamaForCausalLM"}}, {"vocab_size", 16},         {"hidden_size", 8},
          {"intermediate_size", 12},               {"num_hidden_layers", 1},   {"num_attention_heads", 2},
          {"num_key_value_heads", 1},              {"rms_norm_eps", 1e-5},     {"torch_dtype", "float32"},
          {"max_position_embeddings", 64}};
}

std::vector<FakeTensor> TinyTensors() {
  return {{"model.embed_tokens.weight", {16, 8}},
          {"model.layers.0.input_layernorm.weight", {8}},
          {"model.layers.0.self_attn.q_proj.weight", {8, 8}},
          {"model.layers.0.self_attn.k_proj.weight", {4, 8}},
          {"model.layers.0.self_attn.v_proj.weight", {4, 8}},
          {"model.layers.0.self_attn.o_proj.weight", {8, 8}},
          {"model.layers.0.post_attention_layernorm.weight", {8}},
          {"model.layers.0.mlp.gate_proj.weight", {12, 8}},
          {"model.layers.0.mlp.up_proj.weight", {12, 8}},
          {"model.layers.0.mlp.down_proj.weight", {8, 12}},
          {"model.norm.weight", {8}},
          {"lm_head.weight", {16, 8}}};
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("shardserve_ckpt_test_" + std::to_string(getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  void WriteConfig(const json& config) { std::ofstream(dir_ / "config.json") << config.dump(); }
  void WriteTiny(std::vector<FakeTensor> tensors = TinyTensors(), json config = TinyConfig()) {
    WriteConfig(config);
    WriteSafetensors(dir_ / "model.safetensors", tensors);
  }
  // Loads the whole model on the CPU backend; returns the status.
  absl::Status LoadModel() {
    absl::StatusOr<ModelConfig> config = LoadModelConfig(dir_);
    if (!config.ok()) return config.status();
    absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_);
    if (!ckpt.ok()) return ckpt.status();
    std::unique_ptr<Backend> backend = MakeCpuBackend();
    LocalCommunicator tp(backend.get());
    return ModelShard::Load(**ckpt, *config, ShardSpec{}, kLimits, backend.get(), &tp).status();
  }
  std::string OpenError() {
    absl::StatusOr<std::unique_ptr<Checkpoint>> c = Checkpoint::Open(dir_);
    EXPECT_FALSE(c.ok());
    return c.ok() ? "" : std::string(c.status().message());
  }

  fs::path dir_;
};

// ---- Good input -----------------------------------------------------------------------------

TEST_F(CheckpointTest, ReadsRowAndColumnSlicesWithoutTheRest) {
  WriteTiny();
  auto ckpt = Checkpoint::Open(dir_);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  // gate_proj is tensor #7: value = 7000 + flat index; shape [12, 8].
  std::vector<float> rows(3 * 8);
  ASSERT_TRUE((*ckpt)->Read("model.layers.0.mlp.gate_proj.weight", {12, 8}, Slice{0, 4, 7}, DType::kF32, rows.data()).ok());
  for (int r = 0; r < 3; ++r)
    for (int c = 0; c < 8; ++c) EXPECT_EQ(rows[r * 8 + c], 7000 + (4 + r) * 8 + c);
  std::vector<float> cols(12 * 2);
  ASSERT_TRUE((*ckpt)->Read("model.layers.0.mlp.gate_proj.weight", {12, 8}, Slice{1, 6, 8}, DType::kF32, cols.data()).ok());
  for (int r = 0; r < 12; ++r)
    for (int c = 0; c < 2; ++c) EXPECT_EQ(cols[r * 2 + c], 7000 + r * 8 + 6 + c);
  // Narrowing to BF16 on the way: 7000 + 4*8 = 7032 is exact in bf16? 7032 = 0b1101101111000 needs
  // 10 significant bits; bf16 keeps 8, so it rounds to 7040 (round to nearest even).
  std::vector<uint16_t> bf(3 * 8);
  ASSERT_TRUE((*ckpt)->Read("model.layers.0.mlp.gate_proj.weight", {12, 8}, Slice{0, 4, 7}, DType::kBF16, bf.data()).ok());
  EXPECT_EQ(Bf16ToF32(bf[0]), 7040.0f);
}

TEST_F(CheckpointTest, ShardedCheckpointWithIndex) {
  WriteConfig(TinyConfig());
  std::vector<FakeTensor> all = TinyTensors();
  std::vector<FakeTensor> a(all.begin(), all.begin() + 5), b(all.begin() + 5, all.end());
  WriteSafetensors(dir_ / "model-00001-of-00002.safetensors", a);
  WriteSafetensors(dir_ / "model-00002-of-00002.safetensors", b);
  json index = {{"metadata", json::object()}, {"weight_map", json::object()}};
  for (const auto& t : a) index["weight_map"][t.name] = "model-00001-of-00002.safetensors";
  for (const auto& t : b) index["weight_map"][t.name] = "model-00002-of-00002.safetensors";
  std::ofstream(dir_ / "model.safetensors.index.json") << index.dump();
  auto ckpt = Checkpoint::Open(dir_);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->tensors().size(), all.size());
  EXPECT_EQ((*ckpt)->tensors().at("lm_head.weight").file, "model-00002-of-00002.safetensors");
  EXPECT_TRUE(LoadModel().ok()) << LoadModel();
}

TEST_F(CheckpointTest, ConfigDefaultsAndLlama3RopeScaling) {
  json c = TinyConfig();
  c.erase("num_key_value_heads");
  c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  auto config = ParseModelConfig(c.dump(), "config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->num_key_value_heads, 2);  // defaults to the attention heads
  EXPECT_EQ(config->head_dim, 4);
  EXPECT_EQ(config->rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_EQ(config->ParameterCount(), 16 * 8 * 2 + (8 * 8 * 2 + 8 * 8 * 2 + 3 * 8 * 12 + 2 * 8) + 8);
}

// config.json as transformers 5.x's save_pretrained writes it: RoPE in "rope_parameters" (base and
// scaling together), "dtype" for "torch_dtype". Such a Llama 3 checkpoint used to load with base
// 10000 and no scaling, and decode other tokens than transformers from the first one.
TEST_F(CheckpointTest, TransformersFiveConfigGivesTheSameModelAsFour) {
  json v4 = TinyConfig();
  v4["rope_theta"] = 500000.0;
  v4["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                        {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 32}};
  v4["torch_dtype"] = "bfloat16";
  json v5 = TinyConfig();
  v5.erase("torch_dtype");
  v5["dtype"] = "bfloat16";
  v5["rope_parameters"] = {{"rope_theta", 500000.0}, {"rope_type", "llama3"}, {"factor", 8.0},
                           {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                           {"original_max_position_embeddings", 32}};
  v5["transformers_version"] = "5.0.0";
  auto four = ParseModelConfig(v4.dump(), "config.json");
  auto five = ParseModelConfig(v5.dump(), "config.json");
  ASSERT_TRUE(four.ok()) << four.status();
  ASSERT_TRUE(five.ok()) << five.status();
  EXPECT_EQ(five->rope_theta, 500000.0);
  EXPECT_EQ(five->rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_TRUE(five->rope_scaling == four->rope_scaling);
  EXPECT_EQ(five->dtype, DType::kBF16);
  EXPECT_EQ(RopeInvFreq(*five), RopeInvFreq(*four));
  // Without scaling: the base alone.
  v5["rope_parameters"] = {{"rope_theta", 1e6}, {"rope_type", "default"}};
  auto plain = ParseModelConfig(v5.dump(), "config.json");
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->rope_theta, 1e6);
  EXPECT_EQ(plain->rope_scaling.type, RopeScaling::Type::kNone);
}

// Each family reads config.json as transformers builds its model (model/families/llama.cc): Llama
// and Qwen3 put attention_bias on q, k, v and o; Qwen2 has q/k/v biases whatever it says and none on
// o; Mistral has none (transformers does not read the field for it); Qwen3 norms q and k per head.
// An architecture without a declaration is refused with the list of those there are.
TEST_F(CheckpointTest, EachFamilyReadsItsFieldsAsTransformersDoes) {
  struct Case {
    const char* architecture;
    bool attention_bias;
    bool qkv_bias, o_bias, qk_norm;
    int64_t more_norms = 0;  // [hidden] norms a layer beyond Llama's two (Gemma 2's post-attention and post-MLP)
  };
  const Case cases[] = {
      {"LlamaForCausalLM", false, false, false, false}, {"LlamaForCausalLM", true, true, true, false},
      {"Qwen2ForCausalLM", false, true, false, false},  {"Qwen2ForCausalLM", true, true, false, false},
      {"MistralForCausalLM", true, false, false, false}, {"Qwen3ForCausalLM", false, false, false, true},
      {"Qwen3ForCausalLM", true, true, true, true},     {"Phi3ForCausalLM", true, false, false, false},
      {"Gemma2ForCausalLM", true, true, true, false, 2}, {"Gemma3ForCausalLM", false, false, false, true, 2},
  };
  for (const Case& k : cases) {
    json c = TinyConfig();
    c["architectures"] = {k.architecture};
    c["attention_bias"] = k.attention_bias;
    auto config = ParseModelConfig(c.dump(), "config.json");
    ASSERT_TRUE(config.ok()) << config.status();
    SCOPED_TRACE(absl::StrCat(k.architecture, " attention_bias ", k.attention_bias));
    EXPECT_EQ(config->qkv_bias, k.qkv_bias);
    EXPECT_EQ(config->o_bias, k.o_bias);
    EXPECT_EQ(config->qk_norm, k.qk_norm);
    // The parameters are the declared tensors': embedding and LM head, q and o [8, 8], k and v [4, 8],
    // the MLP, two norms, the final norm; q/k/v biases (8 + 4 + 4), o's (8), two [head_dim 4] norms.
    EXPECT_EQ(config->ParameterCount(), 16 * 8 * 2 + (8 * 8 * 2 + 4 * 8 * 2 + 3 * 8 * 12 + 2 * 8) + 8 +
                                            (k.qkv_bias ? 16 : 0) + (k.o_bias ? 8 : 0) + (k.qk_norm ? 8 : 0) + 8 * k.more_norms);
  }
  json c = TinyConfig();
  c["architectures"] = {"GPTNeoXForCausalLM"};
  auto config = ParseModelConfig(c.dump(), "config.json");
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(config.status().message()),
              HasSubstr("\"GPTNeoXForCausalLM\" is not supported (supported: DeepseekV3ForCausalLM, LlamaForCausalLMEagle3, Gemma2ForCausalLM, "
                        "Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Glm4MoeForCausalLM, GptOssForCausalLM, LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, "
                        "Phi3ForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM)"));
}

// Gemma 3 as published (Gemma3ForConditionalGeneration): the text model from text_config over
// Gemma3TextConfig's defaults (the 27B's file gives no vocab_size, context or tie), dtype and
// eos_token_id from the top level, its tensors under language_model.model. by default; nothing of
// the vision tower is declared.
TEST_F(CheckpointTest, Gemma3ConditionalGenerationServesItsTextConfig) {
  auto c = LoadModelConfig(fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/configs/gemma-3-27b-it.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture_name, "Gemma3ForConditionalGeneration");
  EXPECT_EQ(c->vocab_size, 262208);
  EXPECT_EQ(c->hidden_size, 5376);
  EXPECT_EQ(c->num_hidden_layers, 62);
  EXPECT_EQ(c->num_attention_heads, 32);
  EXPECT_EQ(c->num_key_value_heads, 16);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->max_position_embeddings, 131072);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_TRUE(c->qk_norm);
  EXPECT_EQ(c->dtype, DType::kBF16);
  EXPECT_EQ(c->eos_token_ids, (std::vector<int64_t>{1, 106}));
  EXPECT_EQ(c->bos_token_id, 2);
  EXPECT_DOUBLE_EQ(c->attention_scale, 1.0 / std::sqrt(168.0));
  EXPECT_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kLinear);
  EXPECT_EQ(c->rope_scaling.factor, 8.0);
  ASSERT_TRUE(c->sliding_rope.has_value());
  EXPECT_EQ(c->sliding_rope->theta, 1e4);
  for (int64_t i = 0; i < 62; ++i) EXPECT_EQ(c->LayerWindow(i), (i + 1) % 6 == 0 ? 0 : 1024) << "layer " << i;
  const std::vector<WeightDecl> weights = ModelWeights(*c);
  ASSERT_FALSE(weights.empty());
  EXPECT_EQ(weights.front().name, "language_model.model.embed_tokens.weight");
  EXPECT_EQ(weights.back().name, "language_model.model.norm.weight");  // tied: no LM head of its own
  for (const WeightDecl& w : weights) {
    EXPECT_TRUE(absl::StartsWith(w.name, "language_model.model.")) << w.name;
  }
  // 27.0 billion text parameters (the 27B's 27.4 less the vision tower's 0.4).
  EXPECT_NEAR(static_cast<double>(c->ParameterCount()), 27.0e9, 0.05e9);

  json j = json::parse(std::ifstream(fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/configs/gemma-3-27b-it.json"));
  json no_text = j;
  no_text.erase("text_config");
  auto e = ParseModelConfig(no_text.dump(), "config.json");
  ASSERT_FALSE(e.ok());
  EXPECT_THAT(std::string(e.status().message()),
              HasSubstr("config.json: field \"text_config\" must be an object: Gemma3ForConditionalGeneration keeps"));
  json tie = j;
  tie["tie_word_embeddings"] = false;
  tie["text_config"]["tie_word_embeddings"] = true;
  e = ParseModelConfig(tie.dump(), "config.json");
  ASSERT_FALSE(e.ok());
  EXPECT_THAT(std::string(e.status().message()),
              HasSubstr("field \"tie_word_embeddings\" is false but text_config's is true"));
  // The text model's fields are checked as a causal LM's, named under text_config.
  json bad = j;
  bad["text_config"]["num_key_value_heads"] = 5;
  e = ParseModelConfig(bad.dump(), "config.json");
  ASSERT_FALSE(e.ok());
  EXPECT_THAT(std::string(e.status().message()),
              HasSubstr("config.json text_config: field \"num_key_value_heads\" (5) must divide num_attention_heads"));
  // Untied, its LM head is the layout's: language_model.lm_head.weight.
  json untied = j;
  untied["tie_word_embeddings"] = false;
  auto u = ParseModelConfig(untied.dump(), "config.json");
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(ModelWeights(*u).back().name, "language_model.lm_head.weight");
}

// A Gemma3ForConditionalGeneration checkpoint directory: its tensors' layout (language_model.model.
// as transformers 4.50 and 5.x save it, model.language_model. as 4.52-4.57 did) is the one its
// embedding is found under; neither is refused naming both; the vision tower's tensors (biases
// included) are not loaded.
TEST_F(CheckpointTest, Gemma3ConditionalGenerationLayoutIsTheCheckpoints) {
  json config = {{"architectures", {"Gemma3ForConditionalGeneration"}},
                 {"torch_dtype", "float32"},
                 {"text_config",
                  {{"vocab_size", 16}, {"hidden_size", 8}, {"intermediate_size", 12}, {"num_hidden_layers", 1},
                   {"num_attention_heads", 2}, {"num_key_value_heads", 1}, {"head_dim", 4},
                   {"max_position_embeddings", 64}}}};
  const auto tensors = [](const std::string& prefix, const std::string& vision) {
    std::vector<FakeTensor> t = {{prefix + "embed_tokens.weight", {16, 8}}};
    for (const char* norm : {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                             "post_feedforward_layernorm"}) {
      t.push_back({absl::StrCat(prefix, "layers.0.", norm, ".weight"), {8}});
    }
    for (const auto& [name, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
             {"self_attn.q_proj.weight", {8, 8}}, {"self_attn.k_proj.weight", {4, 8}},
             {"self_attn.v_proj.weight", {4, 8}}, {"self_attn.o_proj.weight", {8, 8}},
             {"self_attn.q_norm.weight", {4}},    {"self_attn.k_norm.weight", {4}},
             {"mlp.gate_proj.weight", {12, 8}},   {"mlp.up_proj.weight", {12, 8}},
             {"mlp.down_proj.weight", {8, 12}}}) {
      t.push_back({absl::StrCat(prefix, "layers.0.", name), shape});
    }
    t.push_back({prefix + "norm.weight", {8}});
    t.push_back({vision + "vision_tower.vision_model.post_layernorm.bias", {4}});
    t.push_back({vision + "multi_modal_projector.mm_input_projection_weight", {4, 8}});
    return t;
  };
  for (const auto& [prefix, vision] : {std::pair<std::string, std::string>{"language_model.model.", ""},
                                       {"model.language_model.", "model."}}) {
    SCOPED_TRACE(prefix);
    WriteTiny(tensors(prefix, vision), config);
    absl::StatusOr<ModelConfig> c = LoadModelConfig(dir_);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->weight_prefix, prefix);
    EXPECT_EQ(ModelWeights(*c).front().name, prefix + "embed_tokens.weight");
    absl::Status loaded = LoadModel();
    EXPECT_TRUE(loaded.ok()) << loaded;
  }
  WriteTiny(tensors("text.", ""), config);
  absl::StatusOr<ModelConfig> c = LoadModelConfig(dir_);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr("has none of \"language_model.model.embed_tokens.weight\", "
                        "\"model.language_model.embed_tokens.weight\", where Gemma3ForConditionalGeneration keeps"));
}

// The declared tensor `name` of `config`, or null.
// Each edit of `saved` is refused by ParseModelConfig with an error holding its message.
void ExpectRefused(const json& saved, const std::vector<std::pair<std::function<void(json&)>, std::string>>& refused) {
  for (const auto& [edit, message] : refused) {
    json bad = saved;
    edit(bad);
    auto config = ParseModelConfig(bad.dump(), "config.json");
    ASSERT_FALSE(config.ok()) << message;
    EXPECT_THAT(std::string(config.status().message()), HasSubstr(message));
  }
}

const WeightDecl* FindDecl(const std::vector<WeightDecl>& decls, const std::string& name) {
  for (const WeightDecl& w : decls) {
    if (w.name == name) return &w;
  }
  return nullptr;
}

// Qwen3-MoE's config.json as transformers 5 writes it (num_local_experts) and as the published
// checkpoints have it (num_experts), read the same: which layers are sparse (mlp_only_layers,
// decoder_sparse_step), each expert's tensors under the published names, cut for TP over
// moe_intermediate_size; bad or missing fields refused by name.
TEST_F(CheckpointTest, Qwen3MoeConfigAndTensorsAsTransformersReadThem) {
  std::ifstream in(fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/models/qwen3_moe_tf5/config.json");
  const json saved = json::parse(in);
  ASSERT_TRUE(saved.contains("num_local_experts"));  // what transformers 5's save_pretrained writes
  json hub = saved;
  hub["num_experts"] = hub["num_local_experts"];
  hub.erase("num_local_experts");
  for (const json& form : {saved, hub}) {
    auto c = ParseModelConfig(form.dump(), "config.json");
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->num_experts, 5);
    EXPECT_EQ(c->num_experts_per_tok, 2);
    EXPECT_EQ(c->moe_intermediate_size, 32);
    EXPECT_TRUE(c->norm_topk_prob);
    EXPECT_EQ(c->sparse_layers, (std::vector<bool>{true, false, true}));  // mlp_only_layers [1]
    const std::vector<WeightDecl> decls = ModelWeights(*c);
    const WeightDecl* router = FindDecl(decls, "model.layers.0.mlp.gate.weight");
    ASSERT_NE(router, nullptr);
    EXPECT_EQ(router->shape, (std::vector<int64_t>{5, 48}));
    EXPECT_EQ(router->split, TpSplit::kReplicated);
    const WeightDecl* down = FindDecl(decls, "model.layers.2.mlp.experts.4.down_proj.weight");
    ASSERT_NE(down, nullptr);
    EXPECT_EQ(down->shape, (std::vector<int64_t>{48, 32}));
    EXPECT_EQ(down->split, TpSplit::kExpertCols);
    EXPECT_EQ(down->expert, 4);
    EXPECT_NE(FindDecl(decls, "model.layers.1.mlp.gate_proj.weight"), nullptr);  // the dense layer
    EXPECT_EQ(FindDecl(decls, "model.layers.1.mlp.gate.weight"), nullptr);
    EXPECT_EQ(FindDecl(decls, "model.layers.0.mlp.gate_proj.weight"), nullptr);
    // TP = 2: rank 1 holds rows [16, 32) of each expert's gate and up, those columns of its down.
    auto shard = ComputeTpShard(*c, 1, 2);
    ASSERT_TRUE(shard.ok()) << shard.status();
    EXPECT_EQ(shard->expert_rows.begin, 16);
    EXPECT_EQ(shard->expert_rows.end, 32);
    EXPECT_EQ(shard->mlp_rows.begin, 32);  // the dense layer's intermediate_size 64
  }
  // decoder_sparse_step 2 with no mlp_only_layers: the odd layers sparse (Qwen3MoeDecoderLayer).
  json stepped = saved;
  stepped["decoder_sparse_step"] = 2;
  stepped["mlp_only_layers"] = json::array();
  auto c = ParseModelConfig(stepped.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sparse_layers, (std::vector<bool>{false, true, false}));
  // A TP size that does not divide the experts' intermediate size.
  stepped["moe_intermediate_size"] = 30;
  c = ParseModelConfig(stepped.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(std::string(ComputeTpShard(*c, 0, 4).status().message()),
              HasSubstr("does not divide the experts' intermediate size 30"));

  const std::vector<std::pair<std::function<void(json&)>, std::string>> refused = {
      {[](json& j) { j["num_experts"] = 6; }, "\"num_local_experts\" is 5 but \"num_experts\" is 6"},
      {[](json& j) { j.erase("moe_intermediate_size"); }, "\"moe_intermediate_size\" is missing"},
      {[](json& j) { j["num_experts_per_tok"] = 6; }, "\"num_experts_per_tok\" must be in [1, 5]"},
      {[](json& j) { j["mlp_only_layers"] = {3}; }, "\"mlp_only_layers\" has 3; want layer indices in [0, 3)"},
      {[](json& j) { j["decoder_sparse_step"] = 0; }, "\"decoder_sparse_step\" must be >= 1"},
      {[](json& j) { j["norm_topk_prob"] = "yes"; }, "\"norm_topk_prob\" must be true or false"},
      // (a quantization_config loads: tests/quantized_checkpoint_test.cc's MoE fixtures; a bad one is
      // refused by its format's rules)
      {[](json& j) { j["quantization_config"] = {{"quant_method", "gptq"}, {"bits", 3}, {"group_size", 128}}; },
       "GPTQ loads 4 or 8 bits"},
  };
  ExpectRefused(saved, refused);
}

// Mixtral: every layer sparse, experts of intermediate_size under block_sparse_moe's names (w1
// gate, w3 up, w2 down), the k weights always renormalised.
TEST_F(CheckpointTest, MixtralExpertsInEveryLayer) {
  json j = TinyConfig();
  j["architectures"] = {"MixtralForCausalLM"};
  j["num_hidden_layers"] = 2;
  j["num_local_experts"] = 3;
  j["num_experts_per_tok"] = 2;
  auto c = ParseModelConfig(j.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sparse_layers, (std::vector<bool>{true, true}));
  EXPECT_EQ(c->moe_intermediate_size, 12);
  EXPECT_TRUE(c->norm_topk_prob);
  const std::vector<WeightDecl> decls = ModelWeights(*c);
  ASSERT_NE(FindDecl(decls, "model.layers.1.block_sparse_moe.gate.weight"), nullptr);
  const WeightDecl* w2 = FindDecl(decls, "model.layers.1.block_sparse_moe.experts.2.w2.weight");
  ASSERT_NE(w2, nullptr);
  EXPECT_EQ(w2->shape, (std::vector<int64_t>{8, 12}));
  EXPECT_EQ(w2->role, WeightRole::kExpertDownProj);
  const WeightDecl* w3 = FindDecl(decls, "model.layers.0.block_sparse_moe.experts.0.w3.weight");
  ASSERT_NE(w3, nullptr);
  EXPECT_EQ(w3->role, WeightRole::kExpertUpProj);
  // Parameters: Llama's tiny model without its MLP, plus per layer a router [3, 8] and 3 experts of
  // 3 x [12, 8].
  EXPECT_EQ(c->ParameterCount(), 16 * 8 * 2 + 2 * (8 * 8 * 2 + 4 * 8 * 2 + 2 * 8 + 3 * 8 + 3 * 3 * 8 * 12) + 8);
  j.erase("num_experts_per_tok");
  c = ParseModelConfig(j.dump(), "config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("\"num_experts_per_tok\" is missing"));
}

// DeepSeek-V3: latent attention's sizes (head_dim becomes qk_rope_head_dim; the softmax scale
// qk_head_dim^-0.5 times YaRN's mscale_all_dim factor squared), the router's fields, the shared
// experts' size, the dense first layers; q_b_proj and kv_a_proj_with_mqa picked per head into their
// parts without and with RoPE (the RoPE rows de-interleaved), the heads cut over TP; bad fields named.
TEST_F(CheckpointTest, DeepseekV3LatentAttentionAndRouter) {
  std::ifstream in(fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/models/deepseek_v3_tf5/config.json");
  const json saved = json::parse(in);
  auto c = ParseModelConfig(saved.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->mla());
  EXPECT_EQ(c->head_dim, 8);
  EXPECT_EQ(c->q_lora_rank, 48);
  EXPECT_EQ(c->kv_lora_rank, 32);
  EXPECT_TRUE(c->rope_interleave);
  const double mscale = 0.1 * 0.8 * std::log(4.0) + 1.0;  // yarn_get_mscale(factor 4, mscale_all_dim 0.8)
  EXPECT_NEAR(c->attention_scale, mscale * mscale / std::sqrt(24.0), 1e-12);
  EXPECT_EQ(c->KvValuesPerToken(4), 32 + 8);
  EXPECT_EQ(c->n_group, 3);
  EXPECT_EQ(c->topk_group, 2);
  EXPECT_DOUBLE_EQ(c->routed_scaling_factor, 2.5);
  EXPECT_EQ(c->shared_expert_intermediate_size, 32);
  EXPECT_EQ(c->sparse_layers, (std::vector<bool>{false, true, true}));
  const std::vector<WeightDecl> decls = ModelWeights(*c);
  std::vector<const WeightDecl*> q_b;
  for (const WeightDecl& w : decls) {
    if (w.name == "model.layers.1.self_attn.q_b_proj.weight") q_b.push_back(&w);
  }
  ASSERT_EQ(q_b.size(), 2u);
  EXPECT_EQ(q_b[0]->shape, (std::vector<int64_t>{4 * 16, 48}));
  EXPECT_EQ(q_b[0]->fused_shape, (std::vector<int64_t>{4 * 24, 48}));
  EXPECT_EQ(q_b[1]->role, WeightRole::kQPeProj);
  EXPECT_EQ(q_b[1]->pick.from, 16);
  EXPECT_TRUE(q_b[1]->pick.deinterleave);
  EXPECT_EQ(FindDecl(decls, "model.layers.0.mlp.gate.weight"), nullptr);  // the dense first layer
  ASSERT_NE(FindDecl(decls, "model.layers.2.mlp.shared_experts.down_proj.weight"), nullptr);
  // TP = 2: rank 1 holds heads 2 and 3: their rows of each q part and of kv_b_proj, their o_proj columns.
  auto shard = ComputeTpShard(*c, 1, 2);
  ASSERT_TRUE(shard.ok()) << shard.status();
  EXPECT_EQ(shard->mla_q_nope_rows.begin, 2 * 16);
  EXPECT_EQ(shard->mla_q_pe_rows.begin, 2 * 8);
  EXPECT_EQ(shard->mla_kv_b_rows.begin, 2 * (16 + 24));
  EXPECT_EQ(shard->mla_o_cols.begin, 2 * 24);
  EXPECT_EQ(shard->mla_o_cols.end, 4 * 24);
  // q_lora_rank null: one q_proj.
  json no_q_lora = saved;
  no_q_lora["q_lora_rank"] = nullptr;
  c = ParseModelConfig(no_q_lora.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->q_lora_rank, 0);
  EXPECT_NE(FindDecl(ModelWeights(*c), "model.layers.0.self_attn.q_proj.weight"), nullptr);
  EXPECT_EQ(FindDecl(ModelWeights(*c), "model.layers.0.self_attn.q_a_proj.weight"), nullptr);

  const std::vector<std::pair<std::function<void(json&)>, std::string>> refused = {
      {[](json& j) { j["n_group"] = 2; }, "\"n_group\" must divide n_routed_experts (9)"},
      {[](json& j) { j["topk_group"] = 4; }, "\"topk_group\" must be in [1, n_group = 3]"},
      {[](json& j) { j["topk_group"] = 1; j["num_experts_per_tok"] = 4; }, "keep at least num_experts_per_tok (4)"},
      {[](json& j) { j.erase("kv_lora_rank"); }, "\"kv_lora_rank\" is missing"},
      {[](json& j) { j["qk_rope_head_dim"] = 7; }, "\"qk_rope_head_dim\" must be even"},
      {[](json& j) { j["q_lora_rank"] = 0; }, "\"q_lora_rank\" must be null or in [1, 65536]"},
      {[](json& j) { j["attention_bias"] = true; }, "latent attention with biases is not supported"},
      {[](json& j) { j["first_k_dense_replace"] = -1; }, "\"first_k_dense_replace\" must be >= 0"},
      {[](json& j) { j["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"weight_block_size", {0, 128}}}; },
       "\"weight_block_size\" must be two positive integers"},
  };
  ExpectRefused(saved, refused);
}

// GLM-4.5 (Glm4MoeForCausalLM): q/k/v biases with attention_bias (never on o), q/k norms with
// use_qk_norm, RoPE on half of each head unless partial_rotary_factor says otherwise (Glm4MoeConfig's
// default, also where config.json has none), and DeepSeek-V3's router with Glm4MoeConfig's defaults
// (1 group, 1 kept, 1 dense layer, a scaling of 1) for the fields the file leaves out.
TEST_F(CheckpointTest, Glm4MoeAttentionAndRouterDefaults) {
  std::ifstream in(fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/models/glm4_moe_tf5/config.json");
  const json saved = json::parse(in);
  auto c = ParseModelConfig(saved.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->mla());
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_FALSE(c->o_bias);
  EXPECT_TRUE(c->qk_norm);
  EXPECT_EQ(c->head_dim, 16);
  EXPECT_EQ(c->RotaryDim(), 8);
  EXPECT_EQ(c->n_group, 2);
  EXPECT_DOUBLE_EQ(c->routed_scaling_factor, 1.8);
  EXPECT_EQ(c->shared_expert_intermediate_size, 32);
  EXPECT_EQ(c->sparse_layers, (std::vector<bool>{false, true, true}));
  const std::vector<WeightDecl> decls = ModelWeights(*c);
  EXPECT_NE(FindDecl(decls, "model.layers.0.self_attn.q_proj.bias"), nullptr);
  EXPECT_EQ(FindDecl(decls, "model.layers.0.self_attn.o_proj.bias"), nullptr);
  EXPECT_NE(FindDecl(decls, "model.layers.0.self_attn.k_norm.weight"), nullptr);
  EXPECT_NE(FindDecl(decls, "model.layers.0.mlp.gate_proj.weight"), nullptr);  // the dense first layer
  EXPECT_NE(FindDecl(decls, "model.layers.1.mlp.gate.e_score_correction_bias"), nullptr);
  EXPECT_NE(FindDecl(decls, "model.layers.2.mlp.shared_experts.up_proj.weight"), nullptr);
  // A 4.x-style file with only what a published one has: the top-level partial_rotary_factor, no
  // use_qk_norm (off), and the router fields left to Glm4MoeConfig's defaults.
  json sparse = saved;
  for (const char* field : {"use_qk_norm", "n_group", "topk_group", "first_k_dense_replace", "routed_scaling_factor",
                            "rope_parameters", "attention_bias"}) {
    sparse.erase(field);
  }
  sparse["rope_theta"] = 1000000.0;
  c = ParseModelConfig(sparse.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->qkv_bias);
  EXPECT_FALSE(c->qk_norm);
  EXPECT_EQ(c->RotaryDim(), 8);  // partial_rotary_factor absent: 0.5
  EXPECT_EQ(c->n_group, 1);
  EXPECT_EQ(c->topk_group, 1);
  EXPECT_DOUBLE_EQ(c->routed_scaling_factor, 1.0);
  EXPECT_EQ(c->sparse_layers, (std::vector<bool>{false, true, true}));
  EXPECT_EQ(FindDecl(ModelWeights(*c), "model.layers.0.self_attn.q_norm.weight"), nullptr);
  sparse["partial_rotary_factor"] = 0.75;
  c = ParseModelConfig(sparse.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->RotaryDim(), 12);
  // A default that leaves an odd count is refused naming the field and the default.
  sparse.erase("partial_rotary_factor");
  sparse["head_dim"] = 6;
  sparse["num_attention_heads"] = 8;
  sparse["num_key_value_heads"] = 2;
  c = ParseModelConfig(sparse.dump(), "config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr("\"partial_rotary_factor\" is absent, so Glm4MoeForCausalLM's default 0.5, which rotates 3 of "
                        "head_dim 6"));
}

// The declaration of expert `expert`'s tensor of `role` (a part of a stacked tensor for gpt-oss).
const WeightDecl* FindExpertDecl(const std::vector<WeightDecl>& decls, WeightRole role, int64_t layer, int64_t expert) {
  for (const WeightDecl& w : decls) {
    if (w.role == role && w.layer == layer && w.expert == expert) return &w;
  }
  return nullptr;
}

// gpt-oss: GptOssConfig's fields as transformers 5 saves them (biases on by default, sinks, the
// alternating sliding layers and their window, yarn, every layer sparse with experts of
// intermediate_size, the clamped SwiGLU's limit and alpha); each expert's gate, up and down and their
// biases declared as parts of the stacked tensors (gate the even outputs of gate_up_proj, up the odd
// ones, transposed from [in, out]); the down bias on one rank when the experts are cut, on its
// expert's rank with expert parallelism; the sinks cut by heads; GptOssConfig's defaults where the
// file leaves fields out; bad fields named.
TEST_F(CheckpointTest, GptOssFieldsAndStackedExperts) {
  std::ifstream in(fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/models/gpt_oss_tf5/config.json");
  const json saved = json::parse(in);
  auto c = ParseModelConfig(saved.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_TRUE(c->o_bias);
  EXPECT_TRUE(c->attention_sinks);
  EXPECT_EQ(c->layer_window, (std::vector<int64_t>{32, 0, 32}));
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kYarn);
  EXPECT_FALSE(c->rope_scaling.truncate);
  EXPECT_DOUBLE_EQ(c->rope_theta, 150000.0);
  EXPECT_NEAR(c->rope_scaling.attention_factor, 0.1 * std::log(4.0) + 1.0, 1e-12);
  EXPECT_EQ(c->num_experts, 5);
  EXPECT_EQ(c->num_experts_per_tok, 2);
  EXPECT_EQ(c->moe_intermediate_size, 32);
  EXPECT_EQ(c->sparse_layers, (std::vector<bool>{true, true, true}));
  EXPECT_DOUBLE_EQ(c->swiglu_limit, 1.0);
  EXPECT_DOUBLE_EQ(c->swiglu_alpha, 1.702);
  EXPECT_FALSE(c->mxfp4_experts);
  const std::vector<WeightDecl> decls = ModelWeights(*c);
  const WeightDecl* gate = FindExpertDecl(decls, WeightRole::kExpertGateProj, 1, 3);
  const WeightDecl* up = FindExpertDecl(decls, WeightRole::kExpertUpProj, 1, 3);
  const WeightDecl* down = FindExpertDecl(decls, WeightRole::kExpertDownProj, 1, 3);
  const WeightDecl* down_bias = FindExpertDecl(decls, WeightRole::kExpertDownBias, 1, 3);
  ASSERT_TRUE(gate != nullptr && up != nullptr && down != nullptr && down_bias != nullptr);
  EXPECT_EQ(gate->name, "model.layers.1.mlp.experts.gate_up_proj");
  EXPECT_EQ(gate->shape, (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(gate->fused_shape, (std::vector<int64_t>{5, 64, 64}));
  EXPECT_EQ(gate->stack.period, 2);
  EXPECT_EQ(gate->stack.from, 0);
  EXPECT_TRUE(gate->stack.transposed);
  EXPECT_EQ(up->stack.from, 1);
  EXPECT_EQ(down->shape, (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(down->fused_shape, (std::vector<int64_t>{5, 32, 64}));
  EXPECT_EQ(down->split, TpSplit::kExpertCols);
  EXPECT_EQ(FindExpertDecl(decls, WeightRole::kExpertUpBias, 1, 3)->fused_shape, (std::vector<int64_t>{5, 64}));
  EXPECT_EQ(down_bias->split, TpSplit::kExpertFirstRank);
  EXPECT_TRUE(TakesWeightQuant(*gate));
  EXPECT_FALSE(TakesWeightQuant(*down_bias));
  EXPECT_FALSE(TakesWeightQuant(*FindDecl(decls, "model.layers.0.mlp.router.weight")));
  ASSERT_NE(FindDecl(decls, "model.layers.0.mlp.router.bias"), nullptr);
  const WeightDecl* sinks = FindDecl(decls, "model.layers.2.self_attn.sinks");
  ASSERT_NE(sinks, nullptr);
  EXPECT_EQ(sinks->split, TpSplit::kQHeads);
  {
    const int64_t H = 64, V = 256, E = 5, I = 32;
    const int64_t attention = 64 * H * 2 + 32 * H * 2 + 64 + 32 * 2 + H + 4;  // q, o; k, v; biases; sinks
    const int64_t expert = H * 2 * I + 2 * I + I * H + H;                   // gate_up and down, their biases
    EXPECT_EQ(c->ParameterCount(), 3 * (attention + 2 * H + E * H + E + E * expert) + H + 2 * V * H);
  }
  // TP = 2: rank 1 holds query heads 2 and 3's sinks, rows [16, 32) of each expert's gate and up
  // (and of their biases), those columns of down; the down bias is rank 0's. Expert parallelism:
  // expert 3 whole on rank 1, with its down bias.
  auto shard = ComputeTpShard(*c, 1, 2);
  ASSERT_TRUE(shard.ok()) << shard.status();
  EXPECT_EQ(ShardSlice(TpSplit::kQHeads, *shard).begin, 2);
  EXPECT_EQ(ShardSlice(TpSplit::kQHeads, *shard).end, 4);
  EXPECT_EQ(shard->expert_rows.begin, 16);
  EXPECT_FALSE(HoldsAny(TpSplit::kExpertFirstRank, *shard, 3));
  EXPECT_TRUE(HoldsAny(TpSplit::kExpertFirstRank, *ComputeTpShard(*c, 0, 2), 3));
  auto ep = ComputeTpShard(*c, 1, 2, /*expert_parallel=*/true);
  ASSERT_TRUE(ep.ok()) << ep.status();
  EXPECT_TRUE(HoldsAny(TpSplit::kExpertFirstRank, *ep, 3));
  EXPECT_FALSE(HoldsAny(TpSplit::kExpertFirstRank, *ComputeTpShard(*c, 0, 2, true), 3));

  // GptOssConfig's defaults: attention_bias true, the even layers sliding over 128 tokens, base
  // 150000 with yarn factor 32 over 4096 positions, swiglu_limit 7 and alpha 1.702.
  json bare = saved;
  for (const char* field : {"attention_bias", "layer_types", "sliding_window", "rope_parameters", "swiglu_limit",
                            "swiglu_alpha"}) {
    bare.erase(field);
  }
  c = ParseModelConfig(bare.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_EQ(c->layer_window, (std::vector<int64_t>{128, 0, 128}));
  EXPECT_DOUBLE_EQ(c->rope_theta, 150000.0);
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kYarn);
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 32.0);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 4096);
  EXPECT_FALSE(c->rope_scaling.truncate);
  EXPECT_DOUBLE_EQ(c->swiglu_limit, 7.0);
  EXPECT_DOUBLE_EQ(c->swiglu_alpha, 1.702);
  json unbiased = saved;
  unbiased["attention_bias"] = false;
  c = ParseModelConfig(unbiased.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(FindDecl(ModelWeights(*c), "model.layers.0.self_attn.q_proj.bias"), nullptr);
  // MXFP4 experts (as published): only the experts' products are read from blocks and scales.
  json mxfp4 = saved;
  mxfp4["quantization_config"] = {{"quant_method", "mxfp4"}, {"modules_to_not_convert", {"lm_head"}}};
  c = ParseModelConfig(mxfp4.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->mxfp4_experts);
  EXPECT_FALSE(c->checkpoint_quant.has_value());
  const std::vector<WeightDecl> q = ModelWeights(*c);
  EXPECT_TRUE(IsMxfp4Part(*c, *FindExpertDecl(q, WeightRole::kExpertUpProj, 0, 1)));
  EXPECT_FALSE(IsMxfp4Part(*c, *FindExpertDecl(q, WeightRole::kExpertUpBias, 0, 1)));
  EXPECT_FALSE(IsMxfp4Part(*c, *FindDecl(q, "model.layers.0.self_attn.q_proj.weight")));
  const auto stored = Mxfp4Tensors(*FindExpertDecl(q, WeightRole::kExpertDownProj, 0, 1));
  ASSERT_EQ(stored.size(), 2u);
  EXPECT_EQ(stored[0].first, "model.layers.0.mlp.experts.down_proj_blocks");
  EXPECT_EQ(stored[0].second, (std::vector<int64_t>{5, 64, 1, 16}));
  EXPECT_EQ(stored[1].second, (std::vector<int64_t>{5, 64, 1}));

  const std::vector<std::pair<std::function<void(json&)>, std::string>> refused = {
      {[](json& j) { j["swiglu_limit"] = 0; }, "\"swiglu_limit\" must be > 0"},
      {[](json& j) { j["swiglu_alpha"] = -1.0; }, "\"swiglu_alpha\" must be > 0"},
      {[](json& j) { j["num_local_experts"] = 0; }, "GptOssForCausalLM's layers are all mixtures of experts"},
      {[](json& j) { j["num_experts_per_tok"] = 6; }, "\"num_experts_per_tok\" must be in [1, 5]"},
      {[](json& j) { j["hidden_act"] = "gelu"; }, "\"hidden_act\" is \"gelu\""},
      {[](json& j) { j["layer_types"][1] = "chunked_attention"; }, "\"layer_types\" has \"chunked_attention\""},
      {[](json& j) { j["rope_parameters"]["rope_type"] = "proportional"; }, "rope_type \"proportional\""},
      {[](json& j) { j["quantization_config"] = {{"quant_method", "fp8"}}; }, "quant_method \"fp8\""},
      {[](json& j) { j["quantization_config"] = {{"quant_method", "mxfp4"}, {"modules_to_not_convert", {"model.layers.*.mlp.experts"}}}; },
       "the experts of an mxfp4 checkpoint are all MXFP4"},
      {[](json& j) { j["quantization_config"] = {{"quant_method", "mxfp4"}}; j["intermediate_size"] = 48; },
       "is not a multiple of 32"},
  };
  ExpectRefused(saved, refused);
}

// gpt-oss's experts (the clamped SwiGLU) and DeepSeek-V3's latent attention load on a device backend
// too, and the shard names their kernels among those not yet run on a GPU (the worker's one line at
// start, docs/gpu.md); the same fixtures on the CPU backend name none.
TEST_F(CheckpointTest, DeviceShardsNameTheirKernelsNotYetRunOnAGpu) {
  for (const auto& [fixture, path] : {std::pair{"gpt_oss_tf5", "gpt-oss's clamped SwiGLU"},
                                      std::pair{"deepseek_v3_tf5", "multi-head latent attention"}}) {
    const fs::path dir = fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/models" / fixture;
    absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
    ASSERT_TRUE(config.ok()) << config.status();
    absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    DeviceLikeBackend device;
    LocalCommunicator device_tp(&device);
    absl::StatusOr<std::unique_ptr<ModelShard>> on_device =
        ModelShard::Load(**ckpt, *config, ShardSpec{}, kLimits, &device, &device_tp);
    ASSERT_TRUE(on_device.ok()) << fixture << ": " << on_device.status();
    EXPECT_THAT((*on_device)->GpuPathsNotYetRun(), HasSubstr(path)) << fixture;
    std::unique_ptr<Backend> cpu = MakeCpuBackend();
    LocalCommunicator cpu_tp(cpu.get());
    absl::StatusOr<std::unique_ptr<ModelShard>> on_cpu =
        ModelShard::Load(**ckpt, *config, ShardSpec{}, kLimits, cpu.get(), &cpu_tp);
    ASSERT_TRUE(on_cpu.ok()) << fixture << ": " << on_cpu.status();
    EXPECT_EQ((*on_cpu)->GpuPathsNotYetRun(), "") << fixture;
  }
}

// Dummy weights of a model whose checkpoint would hold MXFP4 experts (gpt-oss as published) make
// the experts' plain stacked tensors, and the model loads from them (benchmarks of gpt-oss without
// its checkpoint).
TEST_F(CheckpointTest, DummyWeightsOfMxfp4ExpertsArePlain) {
  const fs::path dir = fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/models/gpt_oss_mxfp4_tf5";
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_TRUE(config->mxfp4_experts);
  absl::StatusOr<std::unique_ptr<WeightSource>> dummy = OpenWeightSource(dir, *config, LoadFormat::kDummy, 7);
  ASSERT_TRUE(dummy.ok()) << dummy.status();
  EXPECT_TRUE((*dummy)->MakesPlainWeights());
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  LocalCommunicator tp(cpu.get());
  const absl::Status loaded = ModelShard::Load(**dummy, *config, ShardSpec{}, kLimits, cpu.get(), &tp).status();
  EXPECT_TRUE(loaded.ok()) << loaded;
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_FALSE((*ckpt)->MakesPlainWeights());
  // The checkpoint's MXFP4 experts load as they are (gate, up and down of each expert), none
  // dequantized; asked for int8, they are dequantized and quantized again, the log saying why.
  absl::StatusOr<std::unique_ptr<ModelShard>> real = ModelShard::Load(**ckpt, *config, ShardSpec{}, kLimits, cpu.get(), &tp);
  ASSERT_TRUE(real.ok()) << real.status();
  const int64_t products = 3 * config->num_experts * static_cast<int64_t>(std::count(
                               config->sparse_layers.begin(), config->sparse_layers.end(), true));
  EXPECT_THAT((*real)->QuantizationSummary(),
              HasSubstr(absl::StrCat(products, " as mxfp4 (the checkpoint's e2m1 codes and E8M0 scales, 4.25 bits a "
                                               "weight), 0 dequantized at load")));
  EXPECT_THAT((*real)->QuantizationSummary(), Not(HasSubstr("not as mxfp4")));
  ShardSpec int8;
  int8.weight_quant = WeightQuant::kInt8;
  absl::StatusOr<std::unique_ptr<ModelShard>> requantized = ModelShard::Load(**ckpt, *config, int8, kLimits, cpu.get(), &tp);
  ASSERT_TRUE(requantized.ok()) << requantized.status();
  EXPECT_THAT((*requantized)->QuantizationSummary(),
              HasSubstr(absl::StrCat("int8; MXFP4 experts' products: 0 as mxfp4")));
  EXPECT_THAT((*requantized)->QuantizationSummary(),
              HasSubstr(absl::StrCat(products, " dequantized at load (not as mxfp4: --quantization int8 asked for)")));
}

// A device backend: with mxfp4 kernels the experts stay mxfp4 and the shard names their GPU path
// among those not yet run; one without them (its PackQuantizedWeight Unimplemented for mxfp4) takes
// the experts on the fp8 kernels with a scale per 32 inputs (Mxfp4AsFp8Groups), the log saying why,
// and names that path instead. Without any quantized kernels the load fails, naming the expert.
TEST_F(CheckpointTest, Mxfp4ExpertsOnABackendWithoutMxfp4KernelsTakeTheFp8Kernels) {
  const fs::path dir = fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/models/gpt_oss_mxfp4_tf5";
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  const int64_t products = 3 * config->num_experts * config->num_hidden_layers;
  {
    DeviceLikeBackend device;
    device.quantized = true;
    LocalCommunicator tp(&device);
    absl::StatusOr<std::unique_ptr<ModelShard>> shard = ModelShard::Load(**ckpt, *config, ShardSpec{}, kLimits, &device, &tp);
    ASSERT_TRUE(shard.ok()) << shard.status();
    EXPECT_THAT((*shard)->QuantizationSummary(), HasSubstr(absl::StrCat(products, " as mxfp4")));
    EXPECT_THAT((*shard)->GpuPathsNotYetRun(), HasSubstr("MXFP4 experts' products"));
  }
  {
    DeviceLikeBackend device;
    device.quantized = true;
    device.without = {WeightQuant::kMxfp4};
    LocalCommunicator tp(&device);
    absl::StatusOr<std::unique_ptr<ModelShard>> shard = ModelShard::Load(**ckpt, *config, ShardSpec{}, kLimits, &device, &tp);
    ASSERT_TRUE(shard.ok()) << shard.status();
    const std::string summary = (*shard)->QuantizationSummary();
    EXPECT_THAT(summary, HasSubstr(absl::StrCat("0 as mxfp4 (the checkpoint's e2m1 codes and E8M0 scales, 4.25 bits a "
                                                "weight), ",
                                                products, " as fp8 e4m3 with a scale per 32 inputs")));
    EXPECT_THAT(summary, HasSubstr("0 dequantized at load (not as mxfp4: this backend has no mxfp4 kernels"));
    EXPECT_THAT((*shard)->GpuPathsNotYetRun(), HasSubstr("fp8 products with input-group scales"));
    EXPECT_THAT((*shard)->GpuPathsNotYetRun(), Not(HasSubstr("MXFP4 experts' products")));
  }
  DeviceLikeBackend none;
  LocalCommunicator tp(&none);
  const absl::Status refused = ModelShard::Load(**ckpt, *config, ShardSpec{}, kLimits, &none, &tp).status();
  EXPECT_TRUE(absl::IsUnimplemented(refused)) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("(expert 0)"));
}

// model/mxfp4.h's DequantizeMxfp4 against transformers' own decoding (integrations/mxfp4.py
// convert_moe_packed_tensors) of random blocks (every code) and scales from 2^-6 to 2^6
// (tests/fixtures/mxfp4/model.safetensors, written by tools/fixtures/make_parity_fixtures_tf5.py):
// bit for bit, after transformers' transpose to [E, in, out]. A scale that overflows float32 is refused.
TEST_F(CheckpointTest, Mxfp4DequantizationIsTransformers) {
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/mxfp4");
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  const int64_t E = 2, rows = 3, groups = 2, cols = groups * kMxfp4BlockSize;
  std::vector<int8_t> blocks(E * rows * groups * kMxfp4BlockBytes), scales(E * rows * groups);
  absl::Status read = (*ckpt)->Read("w_blocks", {E, rows, groups, kMxfp4BlockBytes}, Slice{}, DType::kI8, blocks.data());
  ASSERT_TRUE(read.ok()) << read;
  read = (*ckpt)->Read("w_scales", {E, rows, groups}, Slice{}, DType::kI8, scales.data());
  ASSERT_TRUE(read.ok()) << read;
  std::vector<float> want(E * cols * rows);
  read = (*ckpt)->Read("dequantized", {E, cols, rows}, Slice{}, DType::kF32, want.data());
  ASSERT_TRUE(read.ok()) << read;
  // One expert's slab read alone (a row range of the 4-D tensor), as the loader reads it.
  std::vector<int8_t> second(rows * groups * kMxfp4BlockBytes);
  ASSERT_TRUE((*ckpt)->Read("w_blocks", {E, rows, groups, kMxfp4BlockBytes}, Slice{0, 1, 2}, DType::kI8, second.data()).ok());
  EXPECT_TRUE(std::equal(second.begin(), second.end(), blocks.begin() + second.size()));
  for (int64_t e = 0; e < E; ++e) {
    std::vector<float> got(rows * cols);
    ASSERT_TRUE(DequantizeMxfp4(reinterpret_cast<const uint8_t*>(blocks.data()) + e * rows * groups * kMxfp4BlockBytes,
                                reinterpret_cast<const uint8_t*>(scales.data()) + e * rows * groups, rows, cols,
                                got.data(), "w")
                    .ok());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < cols; ++i) {
        ASSERT_EQ(got[r * cols + i], want[(e * cols + i) * rows + r]) << "expert " << e << " row " << r << " input " << i;
      }
    }
  }
  // U8 codes read as anything but raw bytes are refused, naming the dtype.
  std::vector<float> as_float(E * rows * groups * kMxfp4BlockBytes);
  const absl::Status s = (*ckpt)->Read("w_blocks", {E, rows, groups, kMxfp4BlockBytes}, Slice{}, DType::kF32, as_float.data());
  EXPECT_THAT(std::string(s.message()), HasSubstr("U8"));
  const uint8_t big_codes[16] = {0x77, 0x77, 0x77, 0x77, 0x77, 0x77, 0x77, 0x77, 0x77, 0x77, 0x77, 0x77, 0x77, 0x77, 0x77, 0x77};
  const uint8_t huge_scale[1] = {255};
  std::vector<float> out(32);
  const absl::Status overflow = DequantizeMxfp4(big_codes, huge_scale, 1, 32, out.data(), "w_blocks");
  EXPECT_THAT(std::string(overflow.message()), HasSubstr("overflow float32"));
}

// Rows x groups MXFP4 blocks and scales as a checkpoint stores them (`seed` picks them): every code
// (all 16, both nibbles) in the first bytes, scales 2^-127 and 2^125 (the largest a code of 6 keeps in
// float32) first, then random ones; and their values as transformers decodes them (DequantizeMxfp4).
struct Mxfp4Sample {
  static constexpr int64_t kRows = 5, kGroups = 4, kCols = kGroups * kMxfp4BlockSize;
  std::vector<uint8_t> blocks, scales;
  std::vector<float> values;  // [kRows, kCols]
};
Mxfp4Sample RandomMxfp4(uint32_t seed) {
  Mxfp4Sample x;
  x.blocks.resize(x.kRows * x.kGroups * kMxfp4BlockBytes);
  x.scales.resize(x.kRows * x.kGroups);
  std::mt19937 rng(seed);
  for (size_t i = 0; i < x.blocks.size(); ++i) {
    x.blocks[i] = i < 8 ? static_cast<uint8_t>(i * 0x11 + 0x10 * (i & 1)) : rng() & 0xFF;
  }
  for (size_t i = 0; i < x.scales.size(); ++i) x.scales[i] = i == 0 ? 0 : i == 1 ? 252 : 100 + rng() % 50;
  x.values.resize(x.kRows * x.kCols);
  const absl::Status s = DequantizeMxfp4(x.blocks.data(), x.scales.data(), x.kRows, x.kCols, x.values.data(), "w");
  EXPECT_TRUE(s.ok()) << s;
  return x;
}

// `got`, [picked rows, k] of the blocks from `group0` on, holds x's values of those rows and inputs,
// bit for bit.
void ExpectPickedValues(const Mxfp4Sample& x, const std::vector<int64_t>& picked, int64_t group0, int64_t k,
                        const std::vector<float>& got) {
  for (size_t r = 0; r < picked.size(); ++r) {
    for (int64_t c = 0; c < k; ++c) {
      const float expected = x.values[picked[r] * x.kCols + group0 * kMxfp4BlockSize + c];
      ASSERT_EQ(std::bit_cast<uint32_t>(got[r * k + c]), std::bit_cast<uint32_t>(expected))
          << "row " << picked[r] << " input " << c << ": " << got[r * k + c] << " vs " << expected;
    }
  }
}

// MXFP4 as the fp8 kernels' layout with a scale per 32 inputs (Mxfp4AsFp8Groups): every code (all
// 16, both nibbles) and scales from 2^-127 to 2^125 (RandomMxfp4), rows picked out of order and
// blocks from the second on, dequantize (kernels/quant.h DequantizeFp8Groups) to DequantizeMxfp4's
// values bit for bit; a scale byte of 255 is refused (false), as float32 has no 2^128.
TEST(Mxfp4AsFp8, TheLayoutHoldsTheSameValues) {
  Mxfp4Sample x = RandomMxfp4(7);
  const int64_t groups = x.kGroups;
  const std::vector<int64_t> picked = {3, 0, 4};
  for (const auto& [group0, num_groups] : {std::pair<int64_t, int64_t>{0, 4}, {1, 2}, {3, 1}}) {
    SCOPED_TRACE(::testing::Message() << "blocks [" << group0 << ", " << group0 + num_groups << ")");
    std::vector<uint8_t> layout;
    ASSERT_TRUE(Mxfp4AsFp8Groups(x.blocks.data(), x.scales.data(), groups, picked, group0, num_groups, &layout));
    const int64_t m = static_cast<int64_t>(picked.size()), k = num_groups * kMxfp4BlockSize;
    const Fp8RowsLayout l{m, k, kMxfp4BlockSize};
    ASSERT_EQ(static_cast<int64_t>(layout.size()), l.bytes());
    EXPECT_EQ(l.bytes(), QuantizedWeightBytes(WeightQuant::kFp8, m, k, kMxfp4BlockSize));
    std::vector<float> got(m * k);
    DequantizeFp8Groups(got.data(), reinterpret_cast<const float*>(layout.data()), layout.data() + l.scale_bytes(), m,
                        k, kMxfp4BlockSize);
    ExpectPickedValues(x, picked, group0, k, got);
  }
  x.scales[2 * groups + 1] = 255;
  std::vector<uint8_t> layout;
  EXPECT_FALSE(Mxfp4AsFp8Groups(x.blocks.data(), x.scales.data(), groups, {2}, 0, groups, &layout));
  EXPECT_TRUE(Mxfp4AsFp8Groups(x.blocks.data(), x.scales.data(), groups, {2}, 2, 2, &layout));  // not that block
}

// MXFP4 kept as it is (Mxfp4Rows: the loader's picked rows and blocks of a stacked expert into
// kernels/quant.h's Mxfp4RowsLayout): every code (all 16, both nibbles) and scales from 2^-127 to
// 2^125 (RandomMxfp4), rows picked out of order and blocks from the second on, dequantize
// (DequantizeMxfp4Rows, the kernels' reference) to DequantizeMxfp4's values bit for bit
// (transformers' decoding, above); the layout's bytes are 4.25 bits a value. Refused (false), as the
// kernels refuse them: a scale byte of 255, and 254 / 253 on a code they carry past float32 (2 and 4:
// 2^128); the largest finite codes under each kept.
TEST(Mxfp4Rows, TheLayoutHoldsTheCheckpointsValues) {
  const Mxfp4Sample x = RandomMxfp4(11);
  const int64_t groups = x.kGroups, cols = x.kCols;
  const std::vector<int64_t> picked = {3, 0, 4};
  for (const auto& [group0, num_groups] : {std::pair<int64_t, int64_t>{0, 4}, {1, 2}, {3, 1}}) {
    SCOPED_TRACE(::testing::Message() << "blocks [" << group0 << ", " << group0 + num_groups << ")");
    std::vector<uint8_t> layout;
    ASSERT_TRUE(Mxfp4Rows(x.blocks.data(), x.scales.data(), groups, picked, group0, num_groups, &layout));
    const int64_t m = static_cast<int64_t>(picked.size()), k = num_groups * kMxfp4BlockSize;
    ASSERT_EQ(static_cast<int64_t>(layout.size()), (Mxfp4RowsLayout{m, k}.bytes()));
    EXPECT_EQ(QuantizedWeightBytes(WeightQuant::kMxfp4, m, k), m * k / 2 + m * k / 32);
    EXPECT_TRUE(Mxfp4ValuesFinite(layout.data(), m, k));
    std::vector<float> got(m * k);
    DequantizeMxfp4Rows(got.data(), layout.data(), m, k);
    ExpectPickedValues(x, picked, group0, k, got);
  }
  std::vector<uint8_t> layout;
  for (const auto& [scale, code, finite] : {std::tuple<uint8_t, uint8_t, bool>{255, 0x00, false}, {254, 0x33, true},
                                            {254, 0x34, false}, {254, 0xC0, false}, {253, 0x55, true}, {253, 0x60, false}}) {
    SCOPED_TRACE(::testing::Message() << "scale " << int{scale} << ", code byte " << int{code});
    std::vector<uint8_t> b = x.blocks, s = x.scales;
    std::fill_n(b.begin() + (2 * groups + 1) * kMxfp4BlockBytes, kMxfp4BlockBytes, uint8_t{0});
    b[(2 * groups + 1) * kMxfp4BlockBytes + 7] = code;
    s[2 * groups + 1] = scale;
    EXPECT_EQ(Mxfp4Rows(b.data(), s.data(), groups, {2}, 0, groups, &layout), finite);
    EXPECT_TRUE(Mxfp4Rows(b.data(), s.data(), groups, {2}, 2, 2, &layout));  // not that block
    std::vector<float> dequantized(cols);
    EXPECT_EQ(DequantizeMxfp4(b.data() + 2 * groups * kMxfp4BlockBytes, s.data() + 2 * groups, 1, cols,
                              dequantized.data(), "w")
                  .ok(),
              finite || scale == 255);  // (255 on code 0 is NaN, not an overflow: DequantizeMxfp4 gives 0 x 2^128)
  }
}

// Qwen2-MoE: Qwen3-MoE's fields plus the shared expert (its size required, its tensors cut over TP
// like a dense MLP, the [1, hidden] gate replicated and never quantized), q/k/v biases unless
// qkv_bias is false.
TEST_F(CheckpointTest, Qwen2MoeSharedExpertAndQkvBias) {
  std::ifstream in(fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/models/qwen2_moe_tf5/config.json");
  const json saved = json::parse(in);
  auto c = ParseModelConfig(saved.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->shared_expert_intermediate_size, 32);
  EXPECT_FALSE(c->qkv_bias);  // qkv_bias false in this file
  EXPECT_FALSE(c->o_bias);
  EXPECT_EQ(c->sparse_layers, (std::vector<bool>{true, true, false}));
  const std::vector<WeightDecl> decls = ModelWeights(*c);
  const WeightDecl* down = FindDecl(decls, "model.layers.1.mlp.shared_expert.down_proj.weight");
  ASSERT_NE(down, nullptr);
  EXPECT_EQ(down->shape, (std::vector<int64_t>{48, 32}));
  EXPECT_EQ(down->split, TpSplit::kSharedExpertCols);
  EXPECT_TRUE(TakesWeightQuant(*down));
  const WeightDecl* gate = FindDecl(decls, "model.layers.0.mlp.shared_expert_gate.weight");
  ASSERT_NE(gate, nullptr);
  EXPECT_EQ(gate->shape, (std::vector<int64_t>{1, 48}));
  EXPECT_EQ(gate->split, TpSplit::kReplicated);
  EXPECT_FALSE(TakesWeightQuant(*gate));
  EXPECT_FALSE(TakesWeightQuant(*FindDecl(decls, "model.layers.0.mlp.gate.weight")));
  EXPECT_EQ(FindDecl(decls, "model.layers.2.mlp.shared_expert.gate_proj.weight"), nullptr);  // the dense layer
  auto shard = ComputeTpShard(*c, 1, 2);
  ASSERT_TRUE(shard.ok()) << shard.status();
  EXPECT_EQ(shard->shared_expert_rows.begin, 16);
  EXPECT_EQ(shard->shared_expert_rows.end, 32);

  json biased = saved;
  biased.erase("qkv_bias");  // Qwen2MoeConfig's default: true
  c = ParseModelConfig(biased.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_FALSE(c->o_bias);
  biased["shared_expert_intermediate_size"] = 30;
  c = ParseModelConfig(biased.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(std::string(ComputeTpShard(*c, 0, 4).status().message()),
              HasSubstr("does not divide the shared expert's intermediate size 30"));
  biased.erase("shared_expert_intermediate_size");
  c = ParseModelConfig(biased.dump(), "config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("\"shared_expert_intermediate_size\" is missing"));
}

// Gemma 3's config.json in both formats: 5.x's rope_parameters keyed by layer type and 4.x's
// rope_theta / rope_local_base_freq / rope_scaling give the same model; five sliding layers to one
// global unless layer_types (or sliding_window_pattern) says otherwise; each layer's RoPE table by
// its type, whether or not it has a window.
TEST_F(CheckpointTest, Gemma3RopePerLayerTypeInBothFormats) {
  std::ifstream in(fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/models/gemma3_tf5/config.json");
  json v5 = json::parse(in);
  auto five = ParseModelConfig(v5.dump(), "config.json");
  ASSERT_TRUE(five.ok()) << five.status();
  EXPECT_TRUE(five->qk_norm);
  EXPECT_EQ(five->attn_logit_softcap, 0.0);
  EXPECT_DOUBLE_EQ(five->attention_scale, 1.0 / std::sqrt(48.0));
  EXPECT_EQ(five->layer_window, (std::vector<int64_t>{32, 32, 32, 32, 32, 0}));
  EXPECT_EQ(five->rope_theta, 1e6);
  EXPECT_EQ(five->rope_scaling.type, RopeScaling::Type::kLinear);
  EXPECT_EQ(five->rope_scaling.factor, 8.0);
  ASSERT_TRUE(five->sliding_rope.has_value());
  EXPECT_EQ(five->sliding_rope->theta, 1e4);
  EXPECT_EQ(five->sliding_rope->scaling.type, RopeScaling::Type::kNone);
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(five->LayerRopeTable(i), i == 5 ? 0 : 1) << "layer " << i;
  const std::vector<RopeTable> tables = RopeTables(*five);
  ASSERT_EQ(tables.size(), 2u);
  EXPECT_EQ(tables[0].inv_freq[0], 1.0f / 8);  // 1e6^0 / 8
  EXPECT_EQ(tables[1].inv_freq[0], 1.0f);
  EXPECT_FLOAT_EQ(tables[0].inv_freq[1], 1.0f / std::pow(1e6f, 2.0f / 32) / 8);
  EXPECT_FLOAT_EQ(tables[1].inv_freq[1], 1.0f / std::pow(1e4f, 2.0f / 32));

  // The same model as 4.x wrote it.
  json v4 = v5;
  v4.erase("rope_parameters");
  v4.erase("layer_types");
  v4["rope_theta"] = 1e6;
  v4["rope_local_base_freq"] = 1e4;
  v4["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 8.0}};
  auto four = ParseModelConfig(v4.dump(), "config.json");
  ASSERT_TRUE(four.ok()) << four.status();
  EXPECT_EQ(four->layer_window, five->layer_window);
  EXPECT_EQ(four->sliding_layers, five->sliding_layers);
  EXPECT_TRUE(four->rope_scaling == five->rope_scaling);
  EXPECT_TRUE(*four->sliding_rope == *five->sliding_rope);
  // sliding_window_pattern 2 and no window: the sliding layers keep their RoPE, not a window.
  v4["sliding_window_pattern"] = 2;
  v4["sliding_window"] = nullptr;
  four = ParseModelConfig(v4.dump(), "config.json");
  ASSERT_TRUE(four.ok()) << four.status();
  EXPECT_EQ(four->layer_window, (std::vector<int64_t>(6, 0)));
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(four->LayerRopeTable(i), i % 2 == 0 ? 1 : 0) << "layer " << i;
  // Defaults: rope_theta 1e6, rope_local_base_freq 1e4, window 4096, query_pre_attn_scalar 256.
  v4.erase("rope_theta");
  v4.erase("rope_local_base_freq");
  v4.erase("sliding_window");
  v4.erase("query_pre_attn_scalar");
  v4.erase("rope_scaling");
  four = ParseModelConfig(v4.dump(), "config.json");
  ASSERT_TRUE(four.ok()) << four.status();
  EXPECT_EQ(four->rope_theta, 1e6);
  EXPECT_EQ(four->sliding_rope->theta, 1e4);
  EXPECT_EQ(four->layer_window[0], 4096);
  EXPECT_DOUBLE_EQ(four->attention_scale, 1.0 / 16);

  // What is refused, by name.
  struct Case {
    std::function<void(json&)> edit;
    const char* says;
  };
  const Case cases[] = {
      {[](json& c) { c["rope_parameters"]["global"] = {{"rope_theta", 1e6}}; },
       "field \"rope_parameters\" has \"global\"; this architecture's is keyed by layer type"},
      {[](json& c) { c["rope_theta"] = 5e5; }, "field \"rope_parameters.full_attention\" has rope_theta 1e+06 but"},
      {[](json& c) { c["rope_local_base_freq"] = 5e4; },
       "field \"rope_parameters.sliding_attention\" has rope_theta 10000 but the file's \"rope_local_base_freq\""},
      {[](json& c) { c["rope_parameters"]["sliding_attention"]["rope_type"] = "dynamic"; },
       "field \"rope_parameters.sliding_attention\" has rope_type \"dynamic\" but no \"factor\""},
      {[](json& c) { c["use_bidirectional_attention"] = true; }, "field \"use_bidirectional_attention\" is true"},
  };
  for (const Case& k : cases) {
    json c = v5;
    k.edit(c);
    auto parsed = ParseModelConfig(c.dump(), "config.json");
    ASSERT_FALSE(parsed.ok()) << c.dump();
    EXPECT_THAT(std::string(parsed.status().message()), HasSubstr(k.says));
  }
}

// Gemma 2's config.json as transformers 5 writes it: every field that shapes its math read, and
// its sliding layers by layer_types or, as 4.x files have none, the even ones.
TEST_F(CheckpointTest, Gemma2FieldsAreRead) {
  std::ifstream in(fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/models/gemma2_tf5/config.json");
  json c = json::parse(in);
  auto config = ParseModelConfig(c.dump(), "config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->activation, ModelConfig::Activation::kGeluTanh);
  EXPECT_TRUE(config->norm_plus_one);
  EXPECT_EQ(config->embedding_scale, 8.0);
  EXPECT_DOUBLE_EQ(config->attention_scale, 1.0 / std::sqrt(24.0));
  EXPECT_EQ(config->attn_logit_softcap, 5.0);
  EXPECT_EQ(config->final_logit_softcap, 8.0);
  EXPECT_EQ(config->layer_window, (std::vector<int64_t>{32, 0, 32, 0}));
  c["layer_types"] = {"full_attention", "sliding_attention", "sliding_attention", "full_attention"};
  config = ParseModelConfig(c.dump(), "config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->layer_window, (std::vector<int64_t>{0, 32, 32, 0}));
  c.erase("layer_types");
  config = ParseModelConfig(c.dump(), "config.json");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->layer_window, (std::vector<int64_t>{32, 0, 32, 0}));
  c["layer_types"] = {"full_attention"};
  EXPECT_THAT(std::string(ParseModelConfig(c.dump(), "config.json").status().message()),
              HasSubstr("field \"layer_types\" has 1 entries for 4 layers"));
  c.erase("layer_types");
  c["hidden_activation"] = "silu";
  EXPECT_THAT(std::string(ParseModelConfig(c.dump(), "config.json").status().message()),
              HasSubstr("field \"hidden_activation\" is \"silu\"; Gemma2ForCausalLM takes \"gelu_pytorch_tanh\""));
}

// What would change the math and is not implemented is refused, naming the field; both formats in
// one file must agree.
TEST_F(CheckpointTest, NewerConfigFieldsThatChangeTheMathAreRefusedByName) {
  struct Case {
    json fields;
    const char* says;
  };
  const std::vector<Case> cases = {
      {{{"rope_parameters", {{"rope_theta", 1e4}, {"rope_type", "dynamic"}}}},
       "field \"rope_parameters\" has rope_type \"dynamic\" but no \"factor\""},
      {{{"rope_parameters", {{"rope_theta", 1e4}, {"rope_type", "dynamic"}, {"factor", 0.0}}}},
       "field \"rope_parameters\" needs factor > 0"},
      {{{"max_position_embeddings", nullptr}, {"rope_parameters", {{"rope_theta", 1e4}, {"rope_type", "dynamic"}, {"factor", 2.0}}}},
       "has rope_type \"dynamic\", which needs max_position_embeddings > 0"},
      {{{"rope_parameters", {{"rope_theta", 1e4}, {"rope_type", "proportional"}, {"factor", 4.0}}}},
       "field \"rope_parameters\" has rope_type \"proportional\", which is not supported (supported: default, linear"},
      {{{"rope_scaling", {{"rope_type", "linear"}}}}, "field \"rope_scaling\" has rope_type \"linear\" but no \"factor\""},
      {{{"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}, {"attention_factor", -1.0}}}},
       "field \"rope_scaling\" needs attention_factor > 0"},
      {{{"rope_scaling", {{"rope_type", "longrope"}, {"short_factor", {1.0, 1.0}}}}},
       "field \"rope_scaling\" has rope_type \"longrope\" but no \"long_factor\" list"},
      {{{"rope_scaling", {{"rope_type", "longrope"}, {"short_factor", {1.0, 1.0}}, {"long_factor", {1.0, 0.0}}}}},
       "has \"long_factor\" with 0.0; want numbers > 0"},
      {{{"rope_scaling", {{"rope_type", "longrope"}, {"short_factor", {1.0}}, {"long_factor", {1.0}}}}},
       "has longrope short_factor / long_factor of 1 / 1 entries; want rotary_dim / 2 = 2"},
      {{{"architectures", {"Phi3ForCausalLM"}}, {"rope_scaling", {{"rope_type", "linear"}, {"factor", 2.0}}}},
       "field \"rope_scaling\" has rope_type \"linear\"; Phi3ForCausalLM takes default and longrope"},
      {{{"architectures", {"Phi3ForCausalLM"}}, {"partial_rotary_factor", 0.25}},
       "field \"partial_rotary_factor\" is 0.25, which rotates 1 of head_dim 4 dimensions; want an even number"},
      {{{"architectures", {"Phi3ForCausalLM"}}, {"partial_rotary_factor", 0.5},
        {"rope_parameters", {{"rope_theta", 1e4}, {"rope_type", "default"}, {"partial_rotary_factor", 1.0}}}},
       "field \"rope_parameters\" has partial_rotary_factor 1 but \"partial_rotary_factor\" has 0.5"},
      {{{"rope_parameters", {{"full_attention", {{"rope_theta", 1e6}}}, {"sliding_attention", {{"rope_theta", 1e4}}}}}},
       "field \"rope_parameters\" is given per layer type (\"full_attention\""},
      {{{"rope_parameters", {{"rope_type", "default"}}}}, "field \"rope_parameters\" has no \"rope_theta\""},
      {{{"rope_theta", 1e4}, {"rope_parameters", {{"rope_theta", 5e5}, {"rope_type", "default"}}}},
       "has rope_theta 500000 but the file's \"rope_theta\" is 10000"},
      {{{"rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}, {"original_max_position_embeddings", 32}}},
        {"rope_parameters", {{"rope_theta", 1e4}, {"rope_type", "default"}}}},
       "\"rope_parameters\" and \"rope_scaling\" describe different RoPE scalings"},
      {{{"dtype", "float16"}}, "field \"dtype\" is \"float16\" but \"torch_dtype\" is \"float32\""},
      {{{"partial_rotary_factor", 0.75}},
       "field \"partial_rotary_factor\" is 0.75; LlamaForCausalLM rotates the whole head (only 1 is supported)"},
      {{{"rope_parameters", {{"rope_theta", 1e4}, {"rope_type", "default"}, {"partial_rotary_factor", 0.5}}}},
       "field \"rope_parameters\" has partial_rotary_factor 0.5"},
      {{{"architectures", {"Phi3ForCausalLM"}},
        {"quantization_config",
         {{"quant_method", "fp8"}, {"activation_scheme", "dynamic"}, {"weight_block_size", json::array({4, 4})}}}},
       "tensor \"model.layers.0.self_attn.qkv_proj.weight\" fuses several products"},
      {{{"layer_types", {"full_attention", "sliding_attention"}}}, "field \"layer_types\" has \"sliding_attention\""},
      {{{"final_logit_softcapping", 30.0}}, "field \"final_logit_softcapping\" is 30.0"},
      {{{"architectures", {"Qwen2ForCausalLM"}}, {"use_sliding_window", true}}, "field \"use_sliding_window\" is true"},
  };
  for (const Case& c : cases) {
    json config = TinyConfig();
    for (const auto& [k, v] : c.fields.items()) config[k] = v;
    auto parsed = ParseModelConfig(config.dump(), "config.json");
    ASSERT_FALSE(parsed.ok()) << config.dump();
    EXPECT_THAT(std::string(parsed.status().message()), HasSubstr(c.says)) << config.dump();
  }
  // The values that change nothing pass.
  json config = TinyConfig();
  config["partial_rotary_factor"] = 1.0;
  config["layer_types"] = {"full_attention"};
  config["final_logit_softcapping"] = nullptr;
  config["dtype"] = "float32";
  EXPECT_TRUE(ParseModelConfig(config.dump(), "config.json").ok());
}

// The RoPE types as transformers computes them: inv_freq and the attention factor of
// modeling_rope_utils.py's ROPE_INIT_FUNCTIONS (transformers 5.24, float32) for head_dim 16,
// theta 1e4, max_position_embeddings 256, against what RopeTables gives from the same config.json.
TEST_F(CheckpointTest, RopeTypesGiveTransformersFrequencies) {
  struct Case {
    const char* name;
    json fields;
    std::vector<float> inv_freq;  // transformers' (longrope: the short factors')
    double attention_factor;
    std::vector<float> long_inv_freq = {};  // longrope: seq_len > original_max_position_embeddings
    int64_t long_from = 0;
  };
  const std::vector<Case> cases = {
      {"linear",
       {{"rope_parameters", {{"rope_type", "linear"}, {"rope_theta", 1e4}, {"factor", 2.0}}}},
       {0.5f, 0.158113882f, 0.0500000007f, 0.0158113893f, 0.00499999989f, 0.00158113893f, 0.000500000024f,
        0.000158113893f},
       1.0},
      {"yarn",
       {{"rope_parameters",
         {{"rope_type", "yarn"}, {"rope_theta", 1e4}, {"factor", 4.0}, {"original_max_position_embeddings", 64}}}},
       {1.0f, 0.237170815f, 0.049999997f, 0.00790569466f, 0.00249999994f, 0.000790569466f, 0.000250000012f,
        7.90569466e-05f},
       1.138629436111989},
      {"yarn with mscale, betas and no truncation (4.x rope_scaling)",
       {{"rope_theta", 1e4},
        {"rope_scaling",
         {{"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 64}, {"mscale", 0.707},
          {"mscale_all_dim", 1.0}, {"beta_fast", 16}, {"beta_slow", 2}, {"truncate", false}}}},
       {1.0f, 0.14849025f, 0.0250000004f, 0.00790569466f, 0.00249999994f, 0.000790569466f, 0.000250000012f,
        7.90569466e-05f},
       0.964326914892074},
      // dynamic (NTK) at any position below max_position_embeddings (all a shard serves): the
      // default frequencies, in both formats.
      {"dynamic",
       {{"rope_parameters", {{"rope_type", "dynamic"}, {"rope_theta", 1e4}, {"factor", 4.0}}}},
       {1.0f, 0.316227764f, 0.100000001f, 0.0316227786f, 0.00999999978f, 0.00316227786f, 0.00100000005f,
        0.000316227786f},
       1.0},
      {"dynamic (4.x rope_scaling)",
       {{"rope_theta", 1e4}, {"rope_scaling", {{"type", "dynamic"}, {"factor", 2.7}}}},
       {1.0f, 0.316227764f, 0.100000001f, 0.0316227786f, 0.00999999978f, 0.00316227786f, 0.00100000005f,
        0.000316227786f},
       1.0},
      // Phi-4-mini-shaped: longrope on 3/4 of the head, original_max_position_embeddings at the top
      // level (which Phi3Config puts in place of the object's 4096 default); factor from 256 / 32.
      {"longrope, partial rotary",
       {{"architectures", {"Phi3ForCausalLM"}},
        {"original_max_position_embeddings", 32},
        {"rope_parameters",
         {{"rope_type", "longrope"}, {"rope_theta", 1e4}, {"partial_rotary_factor", 0.75},
          {"short_factor", {1.0, 1.1, 1.2, 1.5, 2.0, 2.5}}, {"long_factor", {1.0, 2.0, 4.0, 8.0, 16.0, 32.0}}}}},
       {1.0f, 0.195857689f, 0.0386799015f, 0.00666666683f, 0.00107721717f, 0.000185663579f},
       1.2649110640673518,
       {1.0f, 0.107721724f, 0.011603971f, 0.00124999997f, 0.000134652146f, 1.45049671e-05f},
       32},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    json config = TinyConfig();
    config["hidden_size"] = 32;  // head_dim 16
    config["max_position_embeddings"] = 256;
    for (const auto& [k, v] : c.fields.items()) config[k] = v;
    auto parsed = ParseModelConfig(config.dump(), "config.json");
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    const std::vector<RopeTable> tables = RopeTables(*parsed);
    ASSERT_EQ(tables.size(), 1u);
    // float32 pow may differ from PyTorch's by an ulp; a wrong formula is off by far more.
    const auto expect_near = [](const std::vector<float>& got, const std::vector<float>& want) {
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 2e-6 * want[i]) << "frequency " << i;
    };
    expect_near(tables[0].inv_freq, c.inv_freq);
    expect_near(tables[0].long_inv_freq, c.long_inv_freq);
    EXPECT_EQ(tables[0].long_from, c.long_from);
    EXPECT_FLOAT_EQ(tables[0].attention_factor, static_cast<float>(c.attention_factor));
    EXPECT_EQ(parsed->RotaryDim(), static_cast<int64_t>(2 * c.inv_freq.size()));
  }
}

// Phi3Config's original_max_position_embeddings (the top level's, else 4096) replaces the RoPE
// object's, as transformers does when it builds the model; for the others the top level's does too
// where there is one, else the object's, else max_position_embeddings.
TEST_F(CheckpointTest, LongRopeOriginalContextAsTransformersResolvesIt) {
  json config = TinyConfig();
  config["architectures"] = {"Phi3ForCausalLM"};
  config["max_position_embeddings"] = 8192;
  config["rope_scaling"] = {{"type", "su"}, {"short_factor", {1.0, 1.0}}, {"long_factor", {2.0, 2.0}},
                            {"original_max_position_embeddings", 512}};
  auto parsed = ParseModelConfig(config.dump(), "config.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->rope_scaling.type, RopeScaling::Type::kLongRope);  // "su" is longrope
  EXPECT_EQ(parsed->rope_scaling.original_max_position_embeddings, 4096);
  EXPECT_EQ(RopeTables(*parsed)[0].long_from, 4096);
  EXPECT_DOUBLE_EQ(parsed->rope_scaling.attention_factor, std::sqrt(1 + std::log(2.0) / std::log(4096.0)));
  config["original_max_position_embeddings"] = 1024;
  parsed = ParseModelConfig(config.dump(), "config.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->rope_scaling.original_max_position_embeddings, 1024);
  json llama = TinyConfig();
  llama["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 2.0}};
  parsed = ParseModelConfig(llama.dump(), "config.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->rope_scaling.original_max_position_embeddings, 64);  // max_position_embeddings
}

TEST_F(CheckpointTest, ZeroByteTensorsTileWithTheirNeighbours) {
  WriteConfig(TinyConfig());
  // "empty" [0] takes no bytes at offset 0, where "w" begins: still an exact tiling.
  std::string h = R"({"empty": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},)"
                  R"( "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})";
  WriteRaw(dir_ / "model.safetensors", h.size(), h, 8);
  auto ckpt = Checkpoint::Open(dir_);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->tensors().size(), 2u);
}

// Every committed checkpoint (written by the safetensors library, so its tensors tile the data
// section) opens, with its config.json.
TEST(CommittedCheckpointsTest, EveryFixtureAndTheDemoModelOpen) {
  std::vector<fs::path> dirs = {fs::path(SHARDSERVE_SOURCE_DIR) / "models/demo"};
  for (const auto& e : fs::directory_iterator(fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/models")) {
    if (e.is_directory()) dirs.push_back(e.path());
  }
  ASSERT_GE(dirs.size(), 6u) << "models/demo and the five fixtures";
  for (const fs::path& d : dirs) {
    absl::StatusOr<ModelConfig> config = LoadModelConfig(d);
    EXPECT_TRUE(config.ok()) << d << ": " << config.status();
    absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(d);
    EXPECT_TRUE(ckpt.ok()) << d << ": " << ckpt.status();
  }
}

// ---- Bad input: one test per case ------------------------------------------------------------

TEST_F(CheckpointTest, MissingConfigFile) {
  auto config = LoadModelConfig(dir_);
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("config.json"));
}

TEST_F(CheckpointTest, MissingWeightsFile) {
  WriteConfig(TinyConfig());
  EXPECT_THAT(OpenError(), HasSubstr("no model.safetensors"));
}

TEST_F(CheckpointTest, InvalidJsonConfig) {
  std::ofstream(dir_ / "config.json") << "{\"architectures\": [\"LlamaForCausalLM\"], ";
  auto config = LoadModelConfig(dir_);
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("config.json is not valid JSON: "));
}

TEST_F(CheckpointTest, MissingConfigField) {
  json c = TinyConfig();
  c.erase("hidden_size");
  auto config = ParseModelConfig(c.dump(), "x/config.json");
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("x/config.json: field \"hidden_size\" is missing"));
}

TEST_F(CheckpointTest, UnsupportedArchitecture) {
  json c = TinyConfig();
  c["architectures"] = {"GPTNeoXForCausalLM"};
  auto config = ParseModelConfig(c.dump(), "config.json");
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("GPTNeoXForCausalLM"));
}

TEST_F(CheckpointTest, UnsupportedConfigDtype) {
  json c = TinyConfig();
  c["torch_dtype"] = "float64";
  auto config = ParseModelConfig(c.dump(), "config.json");
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("torch_dtype"));
}

// Found with fuzz/config_fuzzer (fuzz/corpus/config/regress_*.json): each was an abort or
// undefined behaviour before, and is an error naming the field now.
TEST_F(CheckpointTest, ConfigDtypeOfAnotherTypeIsAnErrorNotAnException) {
  json c = TinyConfig();
  c["torch_dtype"] = 1;  // json::value() threw type_error here
  auto config = ParseModelConfig(c.dump(), "config.json");
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("\"torch_dtype\" must be a string"));
}

TEST_F(CheckpointTest, DimensionsWhoseParameterCountOverflowsAreRefused) {
  // The fuzzer's input (every dimension at 2^31) overflowed int64 in ParameterCount(): each size
  // is now bounded on its own (this one names hidden_size) ...
  json c = TinyConfig();
  c["hidden_size"] = int64_t{1} << 31;
  c["intermediate_size"] = int64_t{1} << 31;
  c["num_hidden_layers"] = int64_t{1} << 31;
  c["num_attention_heads"] = int64_t{1} << 21;
  c["num_key_value_heads"] = int64_t{1} << 21;
  c["head_dim"] = 1024;
  auto config = ParseModelConfig(c.dump(), "config.json");
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("hidden_size"));
  // ... and sizes each within bounds must still describe at most 1e15 parameters together
  // (here ~9e15, which ParameterCount() holds in int64 without overflow).
  c["hidden_size"] = int64_t{1} << 18;
  c["intermediate_size"] = int64_t{1} << 20;
  c["num_hidden_layers"] = 1024;
  c["num_attention_heads"] = int64_t{1} << 14;
  c["num_key_value_heads"] = int64_t{1} << 14;
  config = ParseModelConfig(c.dump(), "config.json");
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("parameters, above the"));
}

TEST_F(CheckpointTest, RopeThetaThatIsZeroInFloat32IsRefused) {
  json c = TinyConfig();
  c["rope_theta"] = 1e-50;  // > 0 in double, 0 in float32: RoPE frequencies were inf
  auto config = ParseModelConfig(c.dump(), "config.json");
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("\"rope_theta\" gives RoPE frequencies"));
}

TEST_F(CheckpointTest, HeadsThatDoNotDivide) {
  json c = TinyConfig();
  c["num_key_value_heads"] = 3;
  auto config = ParseModelConfig(c.dump(), "config.json");
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("num_key_value_heads"));
}

// Each size in config.json is checked where it is parsed, naming the field and the value: at
// least 1 and below a stated bound, so that no product of them overflows and a typo is an error
// before anything is sized from it.
TEST_F(CheckpointTest, ConfigSizesOutOfRangeNameTheFieldAndTheValue) {
  struct Case {
    std::string field;
    json value;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"max_position_embeddings", 0, "field \"max_position_embeddings\" must be in [32, 2^31], got 0"},
      {"max_position_embeddings", -5, "field \"max_position_embeddings\" must be in [32, 2^31], got -5"},
      {"max_position_embeddings", 2, "field \"max_position_embeddings\" must be in [32, 2^31], got 2"},
      {"max_position_embeddings", int64_t{1} << 40,
       "field \"max_position_embeddings\" must be in [32, 2^31], got 1099511627776"},
      {"vocab_size", int64_t{1} << 40, "field \"vocab_size\" must be in [1, 2^24], got 1099511627776"},
      {"hidden_size", 1 << 20, "field \"hidden_size\" must be in [1, 2^18], got 1048576"},
      {"intermediate_size", int64_t{1} << 33, "field \"intermediate_size\" must be in [1, 2^20], got 8589934592"},
      {"intermediate_size", -12, "field \"intermediate_size\" must be in [1, 2^20], got -12"},
      {"num_hidden_layers", 100000, "field \"num_hidden_layers\" must be in [1, 1024], got 100000"},
      {"num_attention_heads", 0, "field \"num_attention_heads\" must be in [1, 2^14], got 0"},
      {"num_key_value_heads", 1 << 20, "field \"num_key_value_heads\" must be in [1, 2^14], got 1048576"},
      {"eos_token_id", 16, "field \"eos_token_id\" has 16, outside the vocabulary [0, 16)"},
      {"eos_token_id", json::array({2, -1}), "field \"eos_token_id\" has -1, outside the vocabulary [0, 16)"},
      {"bos_token_id", 99, "field \"bos_token_id\" is 99, outside the vocabulary [0, 16)"},
  };
  for (const Case& c : cases) {
    json config = TinyConfig();
    config[c.field] = c.value;
    auto parsed = ParseModelConfig(config.dump(), "x/config.json");
    ASSERT_FALSE(parsed.ok()) << c.field << " = " << c.value.dump() << " was accepted";
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(parsed.status().message()), HasSubstr("x/config.json: " + c.expected)) << c.value.dump();
  }
  // Mistral's sliding_window is bounded as a context length is; in range it is every layer's window
  // and leaves the context as it was.
  json mistral = TinyConfig();
  mistral["architectures"] = {"MistralForCausalLM"};
  mistral["sliding_window"] = 2;
  auto parsed = ParseModelConfig(mistral.dump(), "config.json");
  ASSERT_FALSE(parsed.ok());
  EXPECT_THAT(std::string(parsed.status().message()), HasSubstr("field \"sliding_window\" must be null or in [32, 2^31], got 2"));
  mistral["sliding_window"] = 32;
  parsed = ParseModelConfig(mistral.dump(), "config.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->layer_window, std::vector<int64_t>{32});
  EXPECT_EQ(parsed->max_position_embeddings, 64);
  // Absent, max_position_embeddings is 0: the server then needs --max-model-len.
  json absent = TinyConfig();
  absent.erase("max_position_embeddings");
  parsed = ParseModelConfig(absent.dump(), "config.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->max_position_embeddings, 0);
  // In range: the bounds themselves, and eos ids inside the vocabulary.
  json edge = TinyConfig();
  edge["max_position_embeddings"] = 32;
  edge["eos_token_id"] = {0, 15};
  edge["bos_token_id"] = 1;
  parsed = ParseModelConfig(edge.dump(), "config.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->eos_token_ids, (std::vector<int64_t>{0, 15}));
}

TEST_F(CheckpointTest, SizesThatTogetherDescribeTooManyParametersAreRefused) {
  // Each size within its bound, but 1024 layers x 3 x 2^18 x 2^20 MLP weights is ~8.6e17.
  json c = TinyConfig();
  c["num_hidden_layers"] = 1024;
  c["hidden_size"] = 1 << 18;
  c["intermediate_size"] = 1 << 20;
  c["num_attention_heads"] = 1 << 14;
  c["num_key_value_heads"] = 1 << 14;
  auto config = ParseModelConfig(c.dump(), "x/config.json");
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("x/config.json: the sizes describe"));
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("intermediate_size 1048576"));
  EXPECT_THAT(std::string(config.status().message()), HasSubstr("1e+15"));
}

// Each expert of each layer is declared as its own weights, which every plan walks: 1024 layers of
// 4096 experts (each within its bound, 1.9e14 parameters) took `shardserve plan` 7 GB and a minute.
// All layers' experts together are bounded, the MTP layers' included, well above Kimi K2's 23,424.
TEST_F(CheckpointTest, TooManyExpertsInAllLayersAreRefusedBeforeAnyIsDeclared) {
  json j = json::parse(std::ifstream(fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/configs/deepseek-v3.json"));
  j["num_hidden_layers"] = 1024;
  j["n_routed_experts"] = 4096;
  auto c = ParseModelConfig(j.dump(), "config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr("\"n_routed_experts\" is 4096 experts a layer, 4198400 in its 1025 layers "
                        "(num_hidden_layers and num_nextn_predict_layers); this server takes at most 65536"));
  // The bound itself is taken, one more layer is not.
  j["n_routed_experts"] = 1024;
  j["num_hidden_layers"] = 63;
  c = ParseModelConfig(j.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  j["num_hidden_layers"] = 64;
  c = ParseModelConfig(j.dump(), "config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("66560 in its 65 layers"));
  // Kimi K2's shape (DeepSeek-V3's with 384 experts and 61 layers) parses.
  j["num_hidden_layers"] = 61;
  j["n_routed_experts"] = 384;
  EXPECT_TRUE(ParseModelConfig(j.dump(), "config.json").ok());
}

// A config.json whose sizes are within bounds but far larger than the checkpoint's tensors: the
// shapes are checked before anything is allocated, so the error names the tensor and both shapes
// (before, the loader first tried to allocate the 16 TiB embedding and failed with an
// out-of-memory error that named no tensor).
TEST_F(CheckpointTest, ShapesAreCheckedBeforeAnythingIsAllocated) {
  json c = TinyConfig();
  c["vocab_size"] = 1 << 24;
  c["hidden_size"] = 1 << 18;
  c["head_dim"] = 4;  // q_dim 8, kv_dim 4, as in the file
  WriteTiny(TinyTensors(), c);
  absl::Status s = LoadModel();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("tensor \"model.embed_tokens.weight\" has shape [16, 8] but "
                                                  "config.json implies [16777216, 262144]"));
}

TEST_F(CheckpointTest, UnsupportedTensorDtype) {
  WriteConfig(TinyConfig());
  std::string h = R"({"w": {"dtype": "F64", "shape": [2], "data_offsets": [0, 16]}})";
  WriteRaw(dir_ / "model.safetensors", h.size(), h, 16);
  const std::string err = OpenError();
  EXPECT_THAT(err, HasSubstr("model.safetensors"));
  EXPECT_THAT(err, HasSubstr("\"w\""));
  EXPECT_THAT(err, HasSubstr("F64"));
}

TEST_F(CheckpointTest, TruncatedFile) {
  WriteTiny();
  const fs::path f = dir_ / "model.safetensors";
  fs::resize_file(f, fs::file_size(f) - 100);
  const std::string err = OpenError();
  EXPECT_THAT(err, HasSubstr("model.safetensors"));
  EXPECT_THAT(err, HasSubstr("lm_head.weight"));  // the last tensor is the one cut short
  EXPECT_THAT(err, HasSubstr("truncated"));
}

TEST_F(CheckpointTest, FileShorterThanTheLengthPrefix) {
  WriteConfig(TinyConfig());
  std::ofstream(dir_ / "model.safetensors") << "abc";
  EXPECT_THAT(OpenError(), HasSubstr("too short"));
}

TEST_F(CheckpointTest, HeaderLengthLies) {
  WriteConfig(TinyConfig());
  std::string h = R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})";
  WriteRaw(dir_ / "model.safetensors", 1ull << 40, h, 8);
  EXPECT_THAT(OpenError(), HasSubstr("header length"));
}

TEST_F(CheckpointTest, HeaderIsNotJson) {
  WriteConfig(TinyConfig());
  std::string h = "{\"w\": {\"dtype\": ";
  WriteRaw(dir_ / "model.safetensors", h.size(), h, 8);
  EXPECT_THAT(OpenError(), HasSubstr("model.safetensors: header is not valid JSON: "));
}

TEST_F(CheckpointTest, OffsetsPastTheEndOfTheFile) {
  WriteConfig(TinyConfig());
  std::string h = R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})";
  WriteRaw(dir_ / "model.safetensors", h.size(), h, 8);  // only 8 data bytes
  const std::string err = OpenError();
  EXPECT_THAT(err, HasSubstr("\"w\""));
  EXPECT_THAT(err, HasSubstr("outside"));
}

TEST_F(CheckpointTest, OffsetsDisagreeWithShape) {
  WriteConfig(TinyConfig());
  std::string h = R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}})";
  WriteRaw(dir_ / "model.safetensors", h.size(), h, 16);
  const std::string err = OpenError();
  EXPECT_THAT(err, HasSubstr("\"w\""));
  EXPECT_THAT(err, HasSubstr("needs 16"));
}

TEST_F(CheckpointTest, OffsetsReversed) {
  WriteConfig(TinyConfig());
  std::string h = R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})";
  WriteRaw(dir_ / "model.safetensors", h.size(), h, 16);
  EXPECT_THAT(OpenError(), HasSubstr("outside"));
}

TEST_F(CheckpointTest, ShapeOverflows) {
  WriteConfig(TinyConfig());
  std::string h = R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 0]}})";
  WriteRaw(dir_ / "model.safetensors", h.size(), h, 0);
  const std::string err = OpenError();
  EXPECT_THAT(err, HasSubstr("\"w\""));
  EXPECT_THAT(err, HasSubstr("overflows"));
}

TEST_F(CheckpointTest, OffsetsOverflow) {
  WriteConfig(TinyConfig());
  std::string h = R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [18446744073709551615, 7]}})";
  WriteRaw(dir_ / "model.safetensors", h.size(), h, 8);
  EXPECT_THAT(OpenError(), HasSubstr("outside"));
}

// The data_offsets of the tensors must tile the data section: sorted by begin, the first begins at
// 0, each begins where the previous ends, the last ends at the end of the file.
TEST_F(CheckpointTest, TensorsThatShareBytesAreRefused) {
  // A real checkpoint whose k_proj [4, 8] is pointed at the first half of q_proj's [8, 8] bytes:
  // every entry is inside the file and matches its shape, but two tensors read the same bytes
  // (the model would load and give different tokens).
  WriteTiny();
  const fs::path f = dir_ / "model.safetensors";
  std::ifstream in(f, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  uint64_t len = 0;
  std::memcpy(&len, bytes.data(), 8);
  json header = json::parse(bytes.substr(8, len));
  const uint64_t q_begin = header["model.layers.0.self_attn.q_proj.weight"]["data_offsets"][0];
  header["model.layers.0.self_attn.k_proj.weight"]["data_offsets"] = {q_begin, q_begin + 4 * 8 * 4};
  const std::string h = header.dump();
  WriteRaw(f, h.size(), h, 0);
  std::ofstream(f, std::ios::binary | std::ios::app).write(bytes.data() + 8 + len, bytes.size() - 8 - len);
  const std::string err = OpenError();
  EXPECT_THAT(err, HasSubstr("model.safetensors"));
  EXPECT_THAT(err, HasSubstr("model.layers.0.self_attn.q_proj.weight"));
  EXPECT_THAT(err, HasSubstr("model.layers.0.self_attn.k_proj.weight"));
  EXPECT_THAT(err, HasSubstr("overlaps"));
  EXPECT_THAT(err, HasSubstr("tile"));
}

TEST_F(CheckpointTest, TwoTensorsOnTheSameBytesAreRefused) {
  WriteConfig(TinyConfig());
  std::string h = R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                  R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})";
  WriteRaw(dir_ / "model.safetensors", h.size(), h, 8);
  const std::string err = OpenError();
  EXPECT_THAT(err, HasSubstr("tensor \"b\" [0, 8] overlaps tensor \"a\" [0, 8]"));
}

TEST_F(CheckpointTest, AHoleBetweenTensorsIsRefused) {
  WriteConfig(TinyConfig());
  std::string h = R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                  R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}})";
  WriteRaw(dir_ / "model.safetensors", h.size(), h, 24);
  const std::string err = OpenError();
  EXPECT_THAT(err, HasSubstr("data bytes [8, 16) belong to no tensor"));
  EXPECT_THAT(err, HasSubstr("\"a\" [0, 8]"));
  EXPECT_THAT(err, HasSubstr("\"b\" [16, 24]"));
}

TEST_F(CheckpointTest, AHoleBeforeTheFirstTensorIsRefused) {
  WriteConfig(TinyConfig());
  std::string h = R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})";
  WriteRaw(dir_ / "model.safetensors", h.size(), h, 16);
  const std::string err = OpenError();
  EXPECT_THAT(err, HasSubstr("data bytes [0, 8) belong to no tensor"));
  EXPECT_THAT(err, HasSubstr("before the first tensor \"w\" [8, 16]"));
}

TEST_F(CheckpointTest, BytesAfterTheLastTensorAreRefused) {
  WriteConfig(TinyConfig());
  std::string h = R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})";
  WriteRaw(dir_ / "model.safetensors", h.size(), h, 12);
  const std::string err = OpenError();
  EXPECT_THAT(err, HasSubstr("data bytes [8, 12) after the last tensor \"w\" [0, 8] belong to no tensor"));
}

TEST_F(CheckpointTest, IndexNamesAMissingFile) {
  WriteConfig(TinyConfig());
  std::ofstream(dir_ / "model.safetensors.index.json")
      << R"({"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}})";
  EXPECT_THAT(OpenError(), HasSubstr("model-00001-of-00002.safetensors"));
}

TEST_F(CheckpointTest, IndexPointsOutsideTheDirectory) {
  WriteConfig(TinyConfig());
  std::ofstream(dir_ / "model.safetensors.index.json") << R"({"weight_map": {"lm_head.weight": "../../etc/passwd"}})";
  EXPECT_THAT(OpenError(), HasSubstr("not a file name inside the checkpoint directory"));
}

// A NUL inside an index's file name ended the name open() saw: "model.safetensors\0.evil" opened
// model.safetensors, another file than the one the index names. Refused like a path outside it.
TEST_F(CheckpointTest, IndexFileNameWithANulByteIsRefused) {
  WriteTiny();
  json index = {{"weight_map", json::object()}};
  for (const auto& t : TinyTensors()) index["weight_map"][t.name] = std::string("model.safetensors\0.evil", 23);
  std::ofstream(dir_ / "model.safetensors.index.json") << index.dump();
  EXPECT_THAT(OpenError(), HasSubstr("\"model.safetensors\\000.evil\", which is not a file name inside the checkpoint "
                                     "directory"));
  // The index alone, as ParseSafetensorsIndex reads it.
  std::map<std::string, std::string> weight_map;
  const absl::Status s = ParseSafetensorsIndex(index.dump(), "index.json", &weight_map);
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
}

// One NaN or Inf weight made every logit NaN: generate-ids printed "0 0 0 ..." and the server
// failed its first step as a lost worker. Refused at load, naming the tensor and the element, in
// whatever type the weight is read as and for the row or column slice that holds it.
TEST_F(CheckpointTest, ANanOrInfiniteWeightIsRefusedNamingTheTensorAndTheElement) {
  const std::string gate = "model.layers.0.mlp.gate_proj.weight";  // [12, 8]
  for (const float poison : {std::nanf(""), std::numeric_limits<float>::infinity(),
                             -std::numeric_limits<float>::infinity()}) {
    WriteTiny();
    PoisonF32(dir_ / "model.safetensors", gate, 5 * 8 + 3, poison);  // [5, 3]
    auto ckpt = Checkpoint::Open(dir_);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    for (const DType type : {DType::kF32, DType::kBF16, DType::kF16}) {
      std::vector<float> buf(12 * 8);
      const absl::Status rows = (*ckpt)->Read(gate, {12, 8}, Slice{0, 4, 7}, type, buf.data());
      ASSERT_FALSE(rows.ok()) << DTypeName(type);
      EXPECT_THAT(std::string(rows.message()), HasSubstr("tensor \"" + gate + "\": " + gate + "[5][3] is "));
      EXPECT_THAT(std::string(rows.message()), HasSubstr(std::isnan(poison) ? " is nan;" : poison > 0 ? " is inf;" : " is -inf;"));
      EXPECT_THAT(std::string(rows.message()), HasSubstr("weights and scales must be finite"));
      const absl::Status cols = (*ckpt)->Read(gate, {12, 8}, Slice{1, 2, 4}, type, buf.data());
      ASSERT_FALSE(cols.ok()) << DTypeName(type);
      EXPECT_THAT(std::string(cols.message()), HasSubstr(gate + "[5][3] is "));
      // Slices without it read.
      EXPECT_TRUE((*ckpt)->Read(gate, {12, 8}, Slice{0, 6, 12}, type, buf.data()).ok());
      EXPECT_TRUE((*ckpt)->Read(gate, {12, 8}, Slice{1, 4, 8}, type, buf.data()).ok());
    }
    EXPECT_THAT(std::string(LoadModel().message()), HasSubstr("weights and scales must be finite"));
  }
}

// The check rides on the conversion's loop: 8 bytes at a time for a read in the stored type, one
// value at a time otherwise. Every position of a [3, 7] tensor (words and the values after the last
// whole word), in every stored type read as every float type, by rows and by columns: the element
// named is the poisoned one, and the largest finite values (first and last, each sign) read. A
// float32 value beyond float16's range is refused when read as float16, where it is an infinity.
TEST_F(CheckpointTest, EveryPositionOfANonFiniteValueIsFoundInEveryStoredType) {
  constexpr int64_t kRows = 3, kCols = 7, kN = kRows * kCols;
  const fs::path file = dir_ / "model.safetensors";
  // Writes tensor "w" [3, 7] of `type` holding `values` (float32, converted) into the checkpoint.
  const auto write = [&](DType type, std::vector<float> values, int64_t max_at = -1) {
    std::vector<uint8_t> data(kN * DTypeSize(type));
    ASSERT_TRUE(ConvertOnHost(data.data(), type, values.data(), DType::kF32, kN));
    if (max_at >= 0) {  // the type's largest finite value, positive at max_at, negative at the end
      const uint32_t max_bits = type == DType::kF32 ? 0x7f7fffffu : type == DType::kBF16 ? 0x7f7fu : 0x7bffu;
      const uint32_t sign = type == DType::kF32 ? 0x80000000u : 0x8000u;
      const size_t es = DTypeSize(type);
      const uint32_t negative = max_bits | sign;
      std::memcpy(data.data() + max_at * es, &max_bits, es);
      std::memcpy(data.data() + (kN - 1) * es, &negative, es);
    }
    const std::string h = json{{"w", {{"dtype", DTypeName(type)}, {"shape", {kRows, kCols}},
                                      {"data_offsets", {0, data.size()}}}}}.dump();
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    const uint64_t len = h.size();
    out.write(reinterpret_cast<const char*>(&len), 8);
    out << h;
    out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  };
  std::vector<float> clean(kN);
  for (int64_t i = 0; i < kN; ++i) clean[i] = static_cast<float>(i - 10) * 0.25f;
  std::vector<float> buf(kN);
  for (const DType stored : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (const DType read : {DType::kF32, DType::kBF16, DType::kF16}) {
      SCOPED_TRACE(absl::StrCat(DTypeName(stored), " read as ", DTypeName(read)));
      // The largest finite values of the stored type read as that type (and as wider ones).
      write(stored, clean, 0);
      auto ckpt = Checkpoint::Open(dir_);
      ASSERT_TRUE(ckpt.ok()) << ckpt.status();
      if (read == stored || DTypeSize(read) > DTypeSize(stored)) {
        EXPECT_TRUE((*ckpt)->Read("w", {kRows, kCols}, Slice{0, 0, -1}, read, buf.data()).ok());
      }
      for (int64_t p = 0; p < kN; ++p) {
        for (const float poison : {std::nanf(""), std::numeric_limits<float>::infinity(),
                                   -std::numeric_limits<float>::infinity()}) {
          std::vector<float> values = clean;
          values[p] = poison;
          write(stored, values);
          ckpt = Checkpoint::Open(dir_);
          ASSERT_TRUE(ckpt.ok()) << ckpt.status();
          const std::string want = absl::StrCat("w[", p / kCols, "][", p % kCols, "] is ");
          const absl::Status rows = (*ckpt)->Read("w", {kRows, kCols}, Slice{0, 0, -1}, read, buf.data());
          EXPECT_THAT(std::string(rows.message()), HasSubstr(want)) << "position " << p;
          const absl::Status cols = (*ckpt)->Read("w", {kRows, kCols}, Slice{1, 1, kCols}, read, buf.data());
          if (p % kCols >= 1) {
            EXPECT_THAT(std::string(cols.message()), HasSubstr(want)) << "position " << p;
          } else {
            EXPECT_TRUE(cols.ok()) << "position " << p << ": " << cols;
          }
        }
      }
    }
  }
  // 70000 is finite in float32 and bfloat16, an infinity in float16.
  std::vector<float> big = clean;
  big[9] = 70000.0f;
  write(DType::kF32, big);
  auto ckpt = Checkpoint::Open(dir_);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_TRUE((*ckpt)->Read("w", {kRows, kCols}, Slice{0, 0, -1}, DType::kBF16, buf.data()).ok());
  EXPECT_THAT(std::string((*ckpt)->Read("w", {kRows, kCols}, Slice{0, 0, -1}, DType::kF16, buf.data()).message()),
              HasSubstr("w[1][2] is inf"));
}

TEST_F(CheckpointTest, MissingTensor) {
  std::vector<FakeTensor> t = TinyTensors();
  t.erase(t.begin() + 3);  // k_proj
  WriteTiny(t);
  absl::Status s = LoadModel();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(s.message()), HasSubstr("model.layers.0.self_attn.k_proj.weight"));
}

TEST_F(CheckpointTest, ShapeDisagreesWithConfig) {
  json c = TinyConfig();
  c["intermediate_size"] = 16;  // the file has 12
  WriteTiny(TinyTensors(), c);
  absl::Status s = LoadModel();
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("model.layers.0.mlp.gate_proj.weight"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("[12, 8]"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("config.json"));
}

TEST_F(CheckpointTest, BadStepInputIsAnErrorNotACrash) {
  WriteTiny();
  auto config = LoadModelConfig(dir_);
  auto ckpt = Checkpoint::Open(dir_);
  ASSERT_TRUE(config.ok() && ckpt.ok());
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  LocalCommunicator tp(backend.get());
  const StepLimits opt = kLimits;
  auto model = ModelShard::Load(**ckpt, *config, ShardSpec{}, opt, backend.get(), &tp);
  ASSERT_TRUE(model.ok()) << model.status();
  StepBatch b;
  b.token_ids = {99};  // vocabulary is 16
  b.positions = {0};
  b.token_seq = {0};
  b.slots = {0};
  b.num_seqs = 1;
  b.block_tables.assign(opt.max_blocks_per_seq(), 0);
  absl::Status s = (*model)->Forward(b);
  EXPECT_THAT(std::string(s.message()), HasSubstr("token id 99"));
  b.token_ids = {1};
  b.block_tables[0] = 1000;
  s = (*model)->Forward(b);
  EXPECT_THAT(std::string(s.message()), HasSubstr("block 1000"));
}

}  // namespace
}  // namespace shardserve
