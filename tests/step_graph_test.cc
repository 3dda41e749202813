// Step graphs (worker/shard/model_shard.h, Backend::BeginGraph / EndGraph / RunGraph) on the CPU: the shard's
// side of CUDA graphs, checked without a GPU. RecordingBackend runs a CPU backend's ops and, between
// BeginGraph and EndGraph, records them instead, as CUDA stream capture does: each op with the
// arguments it was called with (tensor addresses and shapes, scalars), run again in order by
// RunGraph on whatever the buffers then hold; a call that waits for the device spoils the
// recording. So a step graph that baked in something of the step it was recorded in (a position, a
// block table, a row count), or a step that forgot to upload its metadata before the graph, gives
// other logits than the same steps run as they are. The CUDA backend's own recording (stream
// capture) is kernels_cuda_test's and the GPU run's (docs/gpu.md).
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/dummy_weights.h"
#include "worker/communicator.h"
#include "kernels/cuda/cuda_switches.h"
#include "worker/shard/model_shard.h"

namespace shardserve {
namespace {

namespace fs = std::filesystem;
const fs::path kFixtures = fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/models";

class RecordingBackend final : public Backend {
 public:
  // kind: the device kind it reports (the inner backend's unless given: kCuda makes ModelShard load
  // a checkpoint's weights through host staging and CopyToDevice, as on a GPU).
  explicit RecordingBackend(std::unique_ptr<Backend> inner, std::optional<DeviceKind> kind = std::nullopt)
      : inner_(std::move(inner)), kind_(kind.value_or(inner_->device_kind())) {}

  // The next recording fails at EndGraph, as a CUDA capture spoiled by the driver would.
  void SpoilNextRecording() { spoil_next_ = true; }
  // Reports that MoeExperts reads its offsets on the host (records_moe_experts() false), as the
  // base's does. By default its MoeExperts is recorded, the inner backend reading the offsets when
  // the op runs (on the CPU host memory is the device's): what a device kernel does.
  void SetMoeExpertsOnHost() { moe_experts_on_host_ = true; }
  int graphs_run() const { return graphs_run_; }

  DeviceKind device_kind() const override { return kind_; }
  uint64_t bytes_to_device() const { return bytes_to_device_; }
  DType act_dtype() const override { return inner_->act_dtype(); }
  std::string Describe() const override { return "recording " + inner_->Describe(); }
  absl::StatusOr<Buffer> Allocate(size_t bytes) override {
    if (recording_) return Spoil("Allocate");
    return inner_->Allocate(bytes);
  }
  void Free(void* data) override { inner_->Free(data); }
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    if (recording_) return Spoil("CopyToDevice");
    bytes_to_device_ += bytes;
    return inner_->CopyToDevice(dst, src, bytes);
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    if (recording_) return Spoil("CopyToHost");
    return inner_->CopyToHost(dst, src, bytes);
  }
  absl::Status Synchronize() override {
    if (recording_) return Spoil("Synchronize");
    return inner_->Synchronize();
  }
  absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes) override {
    return Op([=, this] { return inner_->CopyOnDevice(dst, src, bytes); });
  }
  absl::Status Fill0(void* dst, size_t bytes) override {
    return Op([=, this] { return inner_->Fill0(dst, bytes); });
  }
  absl::Status FillCounterUniform(Tensor* out, const CounterUniformSlice& slice) override {
    if (recording_) return Spoil("FillCounterUniform");
    return inner_->FillCounterUniform(out, slice);
  }
  absl::StatusOr<Buffer> PackMatMulWeight(const Tensor& w, Tensor* packed, WeightQuant quant) override {
    if (recording_) return Spoil("PackMatMulWeight");
    return inner_->PackMatMulWeight(w, packed, quant);
  }
  absl::StatusOr<Buffer> PackQuantizedWeight(WeightQuant quant, const void* stored, int64_t m, int64_t k,
                                             Tensor* packed, int64_t group = 0) override {
    if (recording_) return Spoil("PackQuantizedWeight");
    return inner_->PackQuantizedWeight(quant, stored, m, k, packed, group);
  }
  absl::StatusOr<Buffer> PackTiedTable(const Tensor& w, Tensor* packed) override {
    if (recording_) return Spoil("PackTiedTable");
    return inner_->PackTiedTable(w, packed);
  }
  void ReleaseLoadBuffers() override {
    ++releases_;
    inner_->ReleaseLoadBuffers();
  }
  int releases() const { return releases_; }

  absl::Status Embedding(Tensor* out, const Tensor& table, const Tensor& ids, int64_t row_offset) override {
    return Op([=, this, o = *out]() mutable { return inner_->Embedding(&o, table, ids, row_offset); });
  }
  absl::Status RmsNorm(Tensor* out, const Tensor& x, const Tensor& w, float eps) override {
    return Op([=, this, o = *out]() mutable { return inner_->RmsNorm(&o, x, w, eps); });
  }
  absl::Status MatMul(Tensor* out, const Tensor& x, const Tensor& w, const Tensor* bias) override {
    std::optional<Tensor> b;
    if (bias != nullptr) b = *bias;
    return Op([=, this, o = *out]() mutable { return inner_->MatMul(&o, x, w, b ? &*b : nullptr); });
  }
  absl::Status Rope(Tensor* q, Tensor* k, const Tensor& positions, const Tensor& inv_freq, int head_dim,
                    const RopeOptions& options) override {
    return Op([=, this, qq = *q, kk = *k]() mutable {
      return inner_->Rope(&qq, &kk, positions, inv_freq, head_dim, options);
    });
  }
  absl::Status CacheWrite(Tensor* k_cache, Tensor* v_cache, const Tensor& k, const Tensor& v,
                          const Tensor& slots) override {
    return Op([=, this, kc = *k_cache, vc = *v_cache]() mutable { return inner_->CacheWrite(&kc, &vc, k, v, slots); });
  }
  absl::Status Attention(Tensor* out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                         const Tensor& positions, const Tensor& token_seq, const Tensor& block_tables,
                         float scale, const AttentionOptions& options) override {
    return Op([=, this, o = *out]() mutable {
      return inner_->Attention(&o, q, k_cache, v_cache, positions, token_seq, block_tables, scale, options);
    });
  }
  absl::Status SiluMul(Tensor* out, const Tensor& gate, const Tensor& up) override {
    return Op([=, this, o = *out]() mutable { return inner_->SiluMul(&o, gate, up); });
  }
  absl::Status GeluTanhMul(Tensor* out, const Tensor& gate, const Tensor& up) override {
    return Op([=, this, o = *out]() mutable { return inner_->GeluTanhMul(&o, gate, up); });
  }
  absl::Status Scale(Tensor* out, const Tensor& x, float factor) override {
    return Op([=, this, o = *out]() mutable { return inner_->Scale(&o, x, factor); });
  }
  absl::Status Softcap(Tensor* x, float cap) override {
    return Op([=, this, xx = *x]() mutable { return inner_->Softcap(&xx, cap); });
  }
  absl::Status Add(Tensor* out, const Tensor& a, const Tensor& b) override {
    return Op([=, this, o = *out]() mutable { return inner_->Add(&o, a, b); });
  }
  absl::Status ClampedSwiGlu(Tensor* out, const Tensor& gate, const Tensor& up, float alpha, float limit) override {
    return Op([=, this, o = *out]() mutable { return inner_->ClampedSwiGlu(&o, gate, up, alpha, limit); });
  }
  absl::Status MoeRoute(Tensor* ids, Tensor* weights, const Tensor& logits, const MoeRouting& routing) override {
    std::optional<Tensor> bias;
    if (routing.selection_bias != nullptr) bias = *routing.selection_bias;
    return Op([=, this, i = *ids, w = *weights]() mutable {
      MoeRouting r = routing;
      r.selection_bias = bias ? &*bias : nullptr;
      return inner_->MoeRoute(&i, &w, logits, r);
    });
  }
  absl::Status MoeGroupByExpert(Tensor* order, Tensor* rows, Tensor* offsets, Tensor* tokens,
                                const Tensor& ids) override {
    std::optional<Tensor> t;
    if (tokens != nullptr) t = *tokens;
    return Op([=, this, o = *order, r = *rows, off = *offsets]() mutable {
      return inner_->MoeGroupByExpert(&o, &r, &off, t ? &*t : nullptr, ids);
    });
  }
  absl::Status MoeCountRows(Tensor* counts, const Tensor& offsets, int64_t begin, int64_t end) override {
    return Op([=, this, c = *counts]() mutable { return inner_->MoeCountRows(&c, offsets, begin, end); });
  }
  bool records_moe_experts() const override { return !moe_experts_on_host_; }
  absl::Status MoeExperts(Tensor* out, Tensor* gate, Tensor* up, const Tensor& x, const Tensor& offsets,
                          const MoeExpertWeights& w) override {
    if (moe_experts_on_host_) return Backend::MoeExperts(out, gate, up, x, offsets, w);  // reads them now
    return Op([=, this, o = *out, g = *gate, u = *up]() mutable {
      return inner_->MoeExperts(&o, &g, &u, x, offsets, w);
    });
  }
  absl::Status MoeCombine(Tensor* out, const Tensor& expert_out, const Tensor& rows, const Tensor& weights) override {
    return Op([=, this, o = *out]() mutable { return inner_->MoeCombine(&o, expert_out, rows, weights); });
  }
  absl::Status SigmoidGateMul(Tensor* out, const Tensor& x, const Tensor& gate) override {
    return Op([=, this, o = *out]() mutable { return inner_->SigmoidGateMul(&o, x, gate); });
  }
  absl::Status Softmax(Tensor* out, const Tensor& x, float temperature) override {
    return Op([=, this, o = *out]() mutable { return inner_->Softmax(&o, x, temperature); });
  }
  absl::Status Argmax(Tensor* out, const Tensor& logits) override {
    return Op([=, this, o = *out]() mutable { return inner_->Argmax(&o, logits); });
  }
  absl::Status FiniteRows(Tensor* out, const Tensor& logits) override {
    return Op([=, this, o = *out]() mutable { return inner_->FiniteRows(&o, logits); });
  }
  absl::Status Sample(Tensor* out, const Tensor& logits, const std::vector<SampleParams>& params) override {
    return Op([=, this, o = *out]() mutable { return inner_->Sample(&o, logits, params); });
  }

  bool records_graphs() const override { return true; }
  absl::Status BeginGraph() override {
    if (recording_) return absl::FailedPreconditionError("BeginGraph: already recording");
    recording_ = true;
    spoiled_ = absl::OkStatus();
    ops_.clear();
    return absl::OkStatus();
  }
  absl::StatusOr<int> EndGraph() override {
    if (!recording_) return absl::FailedPreconditionError("EndGraph: not recording");
    recording_ = false;
    if (spoil_next_) {
      spoil_next_ = false;
      return absl::InternalError("a spoiled recording (RecordingBackend::SpoilNextRecording)");
    }
    if (!spoiled_.ok()) return spoiled_;
    graphs_.push_back(std::move(ops_));
    ops_.clear();
    return static_cast<int>(graphs_.size()) - 1;
  }
  absl::Status RunGraph(int id) override {
    if (recording_ || id < 0 || static_cast<size_t>(id) >= graphs_.size()) {
      return absl::InvalidArgumentError("RunGraph: no such graph");
    }
    ++graphs_run_;
    for (const std::function<absl::Status()>& op : graphs_[static_cast<size_t>(id)]) {
      if (absl::Status s = op(); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

 private:
  // Runs `op` now, or records it (its arguments as they are now) during a recording.
  absl::Status Op(std::function<absl::Status()> op) {
    if (!recording_) return op();
    ops_.push_back(std::move(op));
    return absl::OkStatus();
  }
  absl::Status Spoil(const char* call) {
    absl::Status s = absl::FailedPreconditionError(std::string(call) + " during a recording");
    if (spoiled_.ok()) spoiled_ = s;
    return s;
  }

  std::unique_ptr<Backend> inner_;
  const DeviceKind kind_;
  uint64_t bytes_to_device_ = 0;
  int releases_ = 0;  // ReleaseLoadBuffers calls
  bool recording_ = false, spoil_next_ = false, moe_experts_on_host_ = false;
  absl::Status spoiled_;
  std::vector<std::function<absl::Status()>> ops_;
  std::vector<std::vector<std::function<absl::Status()>>> graphs_;
  int graphs_run_ = 0;
};

ModelConfig Config(const std::string& fixture) {
  absl::StatusOr<ModelConfig> c = LoadModelConfig(kFixtures / fixture);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : ModelConfig{};
}

// Two sequences in one shard, prompts of 5 and 3 tokens prefilled in one step, then decoded
// together for `decodes` steps, their rows swapped every other step, their KV blocks shuffled.
// Returns every logit row of every step, in sequence order.
struct Schedule {
  std::vector<std::vector<float>> logits;  // [step * 2 + seq][vocab]
  int graphs_recorded = 0;
  uint64_t graph_replays = 0;
  std::string graphs_off;
  std::vector<uint64_t> expert_rows;  // ModelShard::ExpertRowsTotal after the last step
};
// The model: the fixture's config, and `source`'s weights, else dummy weights of seed 3.
Schedule RunTwoSequences(Backend* backend, int decodes, const WeightSource* source = nullptr,
                         const std::string& fixture = "llama_gqa") {
  Schedule out;
  const ModelConfig c = Config(fixture);
  const DummyWeights dummy(c, 3);
  const WeightSource& w = source != nullptr ? *source : dummy;
  LocalCommunicator tp(backend);
  StepLimits limits{.max_tokens_per_step = 16, .max_seqs_per_step = 2, .block_size = 4, .max_model_len = 32};
  limits.num_kv_blocks = 2 * limits.max_blocks_per_seq();
  absl::StatusOr<std::unique_ptr<ModelShard>> model = ModelShard::Load(w, c, ShardSpec{}, limits, backend, &tp);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return out;
  std::vector<int32_t> blocks(limits.num_kv_blocks);
  std::iota(blocks.begin(), blocks.end(), 0);
  std::shuffle(blocks.begin(), blocks.end(), std::mt19937(11));
  const int64_t per = limits.max_blocks_per_seq();
  const std::vector<std::vector<int32_t>> tables = {{blocks.begin(), blocks.begin() + per},
                                                    {blocks.begin() + per, blocks.end()}};
  std::vector<std::vector<int32_t>> tokens = {{1, 17, 200, 42, 5}, {7, 99, 255}};
  std::vector<int64_t> cached = {0, 0};
  absl::StatusOr<Buffer> next_buf = backend->Allocate(2 * sizeof(int32_t));
  EXPECT_TRUE(next_buf.ok());
  const int64_t V = c.vocab_size;
  for (int step = 0; step <= decodes; ++step) {
    const std::vector<int> order = step % 2 == 0 ? std::vector<int>{0, 1} : std::vector<int>{1, 0};
    StepBatch b;
    b.num_seqs = 2;
    for (int row = 0; row < 2; ++row) {
      const int s = order[row];
      b.block_tables.insert(b.block_tables.end(), tables[s].begin(), tables[s].end());
      for (int64_t pos = cached[s]; pos < static_cast<int64_t>(tokens[s].size()); ++pos) {
        b.token_ids.push_back(tokens[s][pos]);
        b.positions.push_back(static_cast<int32_t>(pos));
        b.token_seq.push_back(row);
        b.slots.push_back(tables[s][pos / limits.block_size] * static_cast<int32_t>(limits.block_size) +
                          static_cast<int32_t>(pos % limits.block_size));
      }
      cached[s] = static_cast<int64_t>(tokens[s].size());
      b.logit_rows.push_back(static_cast<int32_t>(b.positions.size()) - 1);
    }
    const absl::Status s = model->get()->Forward(b);
    EXPECT_TRUE(s.ok()) << "step " << step << ": " << s;
    if (!s.ok()) return out;
    const Tensor logits = model->get()->logits(2);
    Tensor next(next_buf->data(), DType::kI32, {2});
    EXPECT_TRUE(backend->Argmax(&next, logits).ok());
    std::vector<int32_t> ids(2);
    EXPECT_TRUE(backend->CopyToHost(ids.data(), next.data, sizeof(int32_t) * 2).ok());
    std::vector<std::vector<float>> rows(2, std::vector<float>(V));
    for (int row = 0; row < 2; ++row) {
      EXPECT_TRUE(backend->CopyToHost(rows[order[row]].data(), logits.as<float>() + row * V, V * sizeof(float)).ok());
      tokens[order[row]].push_back(ids[row]);
    }
    out.logits.push_back(rows[0]);
    out.logits.push_back(rows[1]);
  }
  out.graphs_recorded = model->get()->step_graphs_recorded();
  out.graph_replays = model->get()->step_graph_replays();
  out.graphs_off = model->get()->step_graphs_off();
  absl::StatusOr<std::vector<uint64_t>> rows = model->get()->ExpertRowsTotal();
  EXPECT_TRUE(rows.ok()) << rows.status();
  if (rows.ok()) out.expert_rows = *rows;
  return out;
}

// The decode steps (two tokens, two logit rows: one shape) run as they are once, are recorded and
// run once, then replayed: every logit bit equal to the plain backend's, whose steps all run as
// they are. The prefill step (8 tokens of 2 sequences) is no graph.
TEST(StepGraphTest, ReplayedDecodeStepsGiveTheLogitsOfStepsRunAsTheyAre) {
  constexpr int kDecodes = 8;
  std::unique_ptr<Backend> plain = MakeCpuBackend(2);
  const Schedule want = RunTwoSequences(plain.get(), kDecodes);
  EXPECT_EQ(want.graphs_recorded, 0) << "the CPU backend records no graphs";

  RecordingBackend recording(MakeCpuBackend(2));
  const Schedule got = RunTwoSequences(&recording, kDecodes);
  EXPECT_EQ(got.graphs_recorded, 1);
  EXPECT_EQ(got.graph_replays, static_cast<uint64_t>(kDecodes - 2));
  EXPECT_EQ(recording.graphs_run(), kDecodes - 1) << "the recorded step, then the replays";
  EXPECT_EQ(got.graphs_off, "");
  ASSERT_EQ(got.logits.size(), want.logits.size());
  ASSERT_EQ(got.logits.size(), static_cast<size_t>(2 * (kDecodes + 1)));
  for (size_t i = 0; i < got.logits.size(); ++i) {
    EXPECT_EQ(got.logits[i], want.logits[i]) << "step " << i / 2 << ", sequence " << i % 2;
  }
}

// Mixture-of-experts models record their decode steps too where the backend's MoeExperts reads its
// offsets on the device: routing, grouping, the experts, the combine and the shared experts' gate
// all recorded with the step (a host read would spoil it), and the replays give the logits of the
// steps run as they are (Qwen2-MoE with its gated shared expert, Qwen3-MoE, Mixtral, gpt-oss with
// its router bias, clamped SwiGLU, attention sinks and sliding window); the rows each expert got
// are counted on the device, the same either way.
TEST(StepGraphTest, MixtureOfExpertsDecodeStepsAreRecordedAndReplayed) {
  constexpr int kDecodes = 6;
  for (const char* fixture : {"qwen2_moe_tf5", "qwen3_moe_tf5", "mixtral_tf5", "gpt_oss_tf5"}) {
    SCOPED_TRACE(fixture);
    std::unique_ptr<Backend> plain = MakeCpuBackend(2);
    const Schedule want = RunTwoSequences(plain.get(), kDecodes, nullptr, fixture);
    RecordingBackend recording(MakeCpuBackend(2));
    const Schedule got = RunTwoSequences(&recording, kDecodes, nullptr, fixture);
    EXPECT_EQ(got.graphs_off, "");
    EXPECT_EQ(got.graphs_recorded, 1);
    EXPECT_EQ(got.graph_replays, static_cast<uint64_t>(kDecodes - 2));
    ASSERT_EQ(got.logits.size(), want.logits.size());
    ASSERT_EQ(got.logits.size(), static_cast<size_t>(2 * (kDecodes + 1)));
    for (size_t i = 0; i < got.logits.size(); ++i) {
      EXPECT_EQ(got.logits[i], want.logits[i]) << "step " << i / 2 << ", sequence " << i % 2;
    }
    EXPECT_EQ(got.expert_rows, want.expert_rows);
    const ModelConfig c = Config(fixture);
    uint64_t rows = 0;
    for (uint64_t r : got.expert_rows) rows += r;
    // every token of every step once a sparse layer per expert it chose
    int64_t sparse_layers = 0;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) sparse_layers += c.LayerIsSparse(l) ? 1 : 0;
    EXPECT_EQ(rows, static_cast<uint64_t>((8 + 2 * kDecodes) * c.num_experts_per_tok * sparse_layers));
  }
}

// Where MoeExperts reads its offsets on the host (the base's, the CUDA backend's today), an MoE
// model's steps run as they are, and the shard says why.
TEST(StepGraphTest, MixtureOfExpertsRunWithoutGraphsWhereTheExpertsReadTheHost) {
  std::unique_ptr<Backend> plain = MakeCpuBackend(2);
  const Schedule want = RunTwoSequences(plain.get(), 4, nullptr, "qwen3_moe_tf5");
  RecordingBackend recording(MakeCpuBackend(2));
  recording.SetMoeExpertsOnHost();
  const Schedule got = RunTwoSequences(&recording, 4, nullptr, "qwen3_moe_tf5");
  EXPECT_EQ(got.graphs_recorded, 0);
  EXPECT_EQ(recording.graphs_run(), 0);
  EXPECT_NE(got.graphs_off.find("mixture-of-experts"), std::string::npos) << got.graphs_off;
  ASSERT_EQ(got.logits.size(), 10u);
  EXPECT_EQ(got.logits, want.logits);
  EXPECT_EQ(got.expert_rows, want.expert_rows);
}

// A recording that fails turns graphs off for the shard: that step and the later ones run as they
// are, with the same logits, and the shard says why.
TEST(StepGraphTest, AFailedRecordingTurnsGraphsOffAndTheStepRunsAsItIs) {
  constexpr int kDecodes = 5;
  std::unique_ptr<Backend> plain = MakeCpuBackend(2);
  const Schedule want = RunTwoSequences(plain.get(), kDecodes);
  RecordingBackend recording(MakeCpuBackend(2));
  recording.SpoilNextRecording();
  const Schedule got = RunTwoSequences(&recording, kDecodes);
  EXPECT_EQ(got.graphs_recorded, 0);
  EXPECT_EQ(got.graph_replays, 0u);
  EXPECT_EQ(recording.graphs_run(), 0);
  EXPECT_NE(got.graphs_off.find("a spoiled recording"), std::string::npos) << got.graphs_off;
  EXPECT_NE(got.graphs_off.find("2 tokens, 2 logit rows"), std::string::npos) << got.graphs_off;
  ASSERT_EQ(got.logits.size(), want.logits.size());
  for (size_t i = 0; i < got.logits.size(); ++i) {
    EXPECT_EQ(got.logits[i], want.logits[i]) << "step " << i / 2 << ", sequence " << i % 2;
  }
}

// On a backend that is not the CPU, ModelShard::Load reads each weight of a real checkpoint into its
// host staging (one buffer, grown to the largest weight and reused, freed when Load returns) and
// copies it to the device: every logit bit equal to the CPU backend's, which reads the weights
// straight into place, and every weight byte copied (the whole checkpoint, its F32 tensors as F32);
// Load ends by letting the backend release its load-time host buffers (ReleaseLoadBuffers), once.
TEST(StepGraphTest, ADeviceBackendLoadsACheckpointThroughHostStagingToTheCpuLogits) {
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(kFixtures / "llama_gqa");
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  std::unique_ptr<Backend> plain = MakeCpuBackend(2);
  const Schedule want = RunTwoSequences(plain.get(), 3, ckpt->get());
  RecordingBackend device(MakeCpuBackend(2), DeviceKind::kCuda);
  const Schedule got = RunTwoSequences(&device, 3, ckpt->get());
  uint64_t checkpoint_bytes = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kFixtures / "llama_gqa")) {
    if (entry.path().extension() == ".safetensors") checkpoint_bytes += std::filesystem::file_size(entry.path());
  }
  EXPECT_GE(device.bytes_to_device(), checkpoint_bytes * 9 / 10) << "the weights went through CopyToDevice";
  EXPECT_EQ(device.releases(), 1) << "Load tells the backend once, at the end, that its load buffers may go";
  ASSERT_EQ(got.logits.size(), want.logits.size());
  ASSERT_EQ(got.logits.size(), 8u);
  for (size_t i = 0; i < got.logits.size(); ++i) {
    EXPECT_EQ(got.logits[i], want.logits[i]) << "step " << i / 2 << ", sequence " << i % 2;
  }
}

// The base Backend records nothing: the CPU backend says so and refuses a recording.
TEST(StepGraphTest, TheCpuBackendRecordsNoGraphs) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend(1);
  EXPECT_FALSE(cpu->records_graphs());
  EXPECT_TRUE(absl::IsUnimplemented(cpu->BeginGraph()));
  EXPECT_TRUE(absl::IsUnimplemented(cpu->EndGraph().status()));
  EXPECT_TRUE(absl::IsUnimplemented(cpu->RunGraph(0)));
}

// The worker's and generate-ids' CUDA paths: each that passed on a GPU on with no switch
// (docs/gpu.md), each --no-cuda-... switch turning its own off and no other; the int4 tensor-core
// GEMV (slower there than the default) off unless --cuda-int4-mma, programmatic dependent launch
// (not yet run on one) unless --cuda-pdl, cuBLASLt's fp8 GEMM (not yet run, inexact) unless
// --cuda-fp8-gemm, the int4 GEMV with the zero folded out (not yet run) unless --cuda-int4-folded,
// the grouped MoE experts (not yet run) unless --cuda-moe-grouped.
TEST(CudaSwitches, EveryPathOnButThoseASwitchTurnsOff) {
  auto parse = [](std::vector<std::string> args) {
    absl::StatusOr<Flags> f = Flags::Parse(args, {}, WithCudaSwitches({}));
    EXPECT_TRUE(f.ok()) << f.status();
    return CudaOptionsFromSwitches(*f);
  };
  const CudaBackendOptions on = parse({});
  EXPECT_TRUE(on.quantized_kernels);
  EXPECT_TRUE(on.step_graphs);
  EXPECT_EQ(on.split_attention_keys, kCudaSplitAttentionKeys);
  EXPECT_TRUE(on.fused_kernels);
  EXPECT_TRUE(on.dense_gemv);
  EXPECT_FALSE(on.int4_mma) << "slower than the GEMV on an H200: off unless asked for";
  const CudaBackendOptions mma = parse({"--cuda-int4-mma"});
  EXPECT_TRUE(mma.int4_mma && mma.quantized_kernels && mma.dense_gemv && mma.step_graphs && mma.fused_kernels);
  EXPECT_FALSE(mma.pdl || on.pdl) << "not yet run on a GPU: off unless asked for";
  const CudaBackendOptions pdl = parse({"--cuda-pdl"});
  EXPECT_TRUE(pdl.pdl && pdl.step_graphs && pdl.fused_kernels && pdl.dense_gemv);
  EXPECT_FALSE(pdl.int4_mma || pdl.fp8_gemm);
  EXPECT_FALSE(on.fp8_gemm) << "rounds x to e4m3, and not yet run on a GPU: off unless asked for";
  const CudaBackendOptions fp8 = parse({"--cuda-fp8-gemm"});
  EXPECT_TRUE(fp8.fp8_gemm && fp8.quantized_kernels && fp8.step_graphs && fp8.dense_gemv);
  EXPECT_FALSE(fp8.pdl || fp8.int4_mma || fp8.int4_folded);
  EXPECT_FALSE(on.int4_folded) << "not yet run on a GPU: off unless asked for";
  EXPECT_FALSE(on.moe_grouped) << "not yet run on a GPU: off unless asked for";
  const CudaBackendOptions grouped = parse({"--cuda-moe-grouped"});
  EXPECT_TRUE(grouped.moe_grouped && grouped.step_graphs && grouped.dense_gemv);
  EXPECT_FALSE(grouped.int4_folded || grouped.pdl || grouped.fp8_gemm || grouped.int4_mma);
  const CudaBackendOptions folded = parse({"--cuda-int4-folded"});
  EXPECT_TRUE(folded.int4_folded && folded.quantized_kernels && folded.step_graphs && folded.dense_gemv);
  EXPECT_FALSE(folded.int4_mma || folded.pdl || folded.fp8_gemm);
  const CudaBackendOptions no_graphs = parse({"--no-cuda-graphs"});
  EXPECT_FALSE(no_graphs.step_graphs);
  EXPECT_TRUE(no_graphs.quantized_kernels && no_graphs.fused_kernels && no_graphs.split_attention_keys > 0 &&
              no_graphs.dense_gemv);
  const CudaBackendOptions no_gemv = parse({"--no-cuda-dense-gemv"});
  EXPECT_FALSE(no_gemv.dense_gemv);
  EXPECT_TRUE(no_gemv.step_graphs && no_gemv.quantized_kernels && no_gemv.fused_kernels);
  EXPECT_FALSE(parse({"--no-cuda-quantized-kernels"}).quantized_kernels);
  EXPECT_EQ(parse({"--no-cuda-split-attention"}).split_attention_keys, 0);
  EXPECT_FALSE(parse({"--no-cuda-fused-kernels"}).fused_kernels);
  const CudaBackendOptions off = parse({"--no-cuda-quantized-kernels", "--no-cuda-graphs", "--no-cuda-split-attention",
                                       "--no-cuda-fused-kernels", "--no-cuda-dense-gemv"});
  EXPECT_FALSE(off.quantized_kernels || off.step_graphs || off.fused_kernels || off.dense_gemv);
  EXPECT_EQ(off.split_attention_keys, 0);
  // launch / bench take them with a prefix; the old opt-in switches are gone.
  EXPECT_TRUE(Flags::Parse({"--worker-no-cuda-graphs"}, {}, WithCudaSwitches({}, "worker-")).ok());
  EXPECT_FALSE(Flags::Parse({"--cuda-graphs"}, {}, WithCudaSwitches({})).ok());
  EXPECT_FALSE(Flags::Parse({"--cuda-dense-gemv"}, {}, WithCudaSwitches({})).ok());
  EXPECT_FALSE(Flags::Parse({"--cuda-fused-rope-cache"}, {}, WithCudaSwitches({})).ok());
  EXPECT_FALSE(Flags::Parse({"--cuda-fused-silu"}, {}, WithCudaSwitches({})).ok());
}

}  // namespace
}  // namespace shardserve
