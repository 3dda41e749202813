// One shard of a Llama-shaped model (Llama, Mistral, Qwen2, Qwen3: model/families/llama.cc): its
// weights, loaded as the family's declaration lists them, its paged KV cache and its forward pass. A shard is a layer range (a pipeline stage) and a tensor-parallel rank; the
// whole model in one process is the shard {all layers, rank 0 of 1}, which runs the same code.
//
// Ownership: LlamaShard owns its weights, KV cache and scratch buffers (all allocated once, at
// Load). It borrows the Backend and the Communicator, which must outlive it.
// Threading: not thread-safe; one step at a time.
#ifndef SHARDSERVE_WORKER_LLAMA_H_
#define SHARDSERVE_WORKER_LLAMA_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "model/config.h"
#include "model/families/declaration.h"
#include "model/sharding.h"
#include "model/step_limits.h"
#include "model/weight_source.h"
#include "worker/communicator.h"
#include "worker/step_checks.h"  // ShardSpec, StepBatch

namespace shardserve {

class LlamaShard {
 public:
  // Loads this shard's slice of the weights (a Checkpoint, or DummyWeights) in the backend's
  // activation dtype and allocates the KV cache and every scratch buffer.
  static absl::StatusOr<std::unique_ptr<LlamaShard>> Load(const WeightSource& weights, const ModelConfig& config,
                                                          const ShardSpec& spec, const StepLimits& limits,
                                                          Backend* backend, Communicator* tp);

  // Runs the shard's layers over a step. On the first stage the input is the batch's token ids;
  // on later stages it is `hidden` ([n, hidden] act, from the previous stage). On return
  // `hidden` holds this stage's output hidden state; on the last stage, logits() holds
  // [m, vocab] F32 logits for batch.logit_rows. All outputs live on the backend's device.
  absl::Status Forward(const StepBatch& batch);

  // [n, hidden] act: this step's hidden state (input on later stages, output on every stage).
  Tensor hidden(int64_t n) const;
  // [m, vocab] F32, valid after Forward on the last stage.
  Tensor logits(int64_t m) const;

  bool is_first_stage() const { return first_layer_ == 0; }
  bool is_last_stage() const { return end_layer_ == config_.num_hidden_layers; }
  const ModelConfig& config() const { return config_; }
  const StepLimits& limits() const { return limits_; }
  uint64_t weight_bytes() const { return weight_bytes_; }
  // Bytes of the buffers one step works in (inputs, activations, logits, RoPE frequencies): what
  // the planner counts as activation bytes (coordinator/planner/planner.cc).
  uint64_t step_buffer_bytes() const { return step_buffer_bytes_; }
  // Bytes of this shard's paged KV cache (K and V of every layer it holds).
  uint64_t kv_cache_bytes() const { return kv_cache_bytes_; }
  Backend* backend() const { return backend_; }
  // Step graphs (Backend::BeginGraph / RunGraph; the CUDA worker's, but --no-cuda-graphs): decode steps
  // (one token a sequence, at most kMaxGraphSeqs sequences) are replayed from a recording of the
  // step's ops, one graph per shape (tokens, logit rows), when the backend records graphs and the
  // TP group is one rank (a larger group's collectives wait for the device: TimedCommunicator).
  // The first step of a shape runs as it is (the kernels' code and cuBLAS's workspace loaded), the
  // second is recorded and run, the later ones replay it. If a recording fails the shard turns
  // graphs off, runs that step as it is, and step_graphs_off() says why.
  static constexpr int64_t kMaxGraphSeqs = 64;
  int step_graphs_recorded() const { return static_cast<int>(graphs_recorded_); }
  uint64_t step_graph_replays() const { return graph_replays_; }
  const std::string& step_graphs_off() const { return graphs_off_why_; }
  // How the linear weights are held, for the worker log: the --quantization name, or for a published
  // quantized checkpoint its format and how many weights took each path (model/quantized_checkpoint.h).
  std::string QuantizationSummary() const;
  // The CUDA kernels this shard runs that have not yet passed on a GPU (docs/gpu.md), for one line
  // at start; empty when none (and on the CPU).
  std::string GpuPathsNotYetRun() const;

 private:
  // One decoder layer's slice. Shapes are this rank's (q = local q heads * head_dim, kv = local
  // KV heads * head_dim, f = local intermediate size).
  struct Layer {
    Tensor input_layernorm;           // [hidden]
    Tensor q_proj, k_proj, v_proj;    // [q, hidden], [kv, hidden], [kv, hidden]
    Tensor q_bias, k_bias, v_bias;    // [q], [kv], [kv] (Qwen2; Llama, Qwen3 with attention_bias; else data == nullptr)
    Tensor q_norm, k_norm;            // [head_dim] each (Qwen3; else data == nullptr)
    Tensor o_proj;                    // [hidden, q]
    Tensor o_bias;                    // [hidden] on TP rank 0 (Llama, Qwen3 with attention_bias; else data == nullptr)
    Tensor attn_out_norm;             // [hidden] of the attention's output (Gemma 2; else data == nullptr)
    Tensor pre_mlp_norm;              // [hidden]
    Tensor mlp_out_norm;              // [hidden] of the MLP's output (Gemma 2; else data == nullptr)
    Tensor gate_proj, up_proj;        // [f, hidden]
    Tensor down_proj;                 // [hidden, f]
    Tensor k_cache, v_cache;          // [blocks, block_size, local kv heads, head_dim]
  };

  LlamaShard() = default;
  absl::StatusOr<Tensor> LoadWeight(const WeightSource& ckpt, const std::string& name, std::vector<int64_t> full_shape,
                                    const Slice& slice);
  // LoadWeight, then the backend's PackMatMulWeight: for weights only MatMul reads.
  // An RMSNorm's weight w, stored for a scale of 1 + w (Gemma): read in float32, 1 added there as
  // transformers adds it, then held in the act dtype.
  absl::StatusOr<Tensor> LoadNormPlusOne(const WeightSource& ckpt, const WeightDecl& w);
  // A weight made on the host in float32, held in the act dtype on the backend's device (counted
  // in weight_bytes()).
  absl::StatusOr<Tensor> UploadHostWeight(const std::string& name, const float* values, absl::Span<const int64_t> dims);
  absl::StatusOr<Tensor> LoadMatMulWeight(const WeightSource& ckpt, const WeightDecl& w, const Slice& slice,
                                          WeightQuant quant = WeightQuant::kNone);
  // Where the loader puts tensor `w` (a layer's or the stage's field), and step buffer `name`;
  // null for one the forward pass has no place for.
  Tensor* Slot(const WeightDecl& w);
  Tensor* StepBufferSlot(const std::string& name);
  // A published quantized checkpoint's linear weight `name` (<prefix>.weight): its codes and scales
  // in an int4 / int8 / fp8 kernel layout, or dequantized to float32 and packed as a plain weight
  // (model/quantized_checkpoint.h).
  absl::StatusOr<Tensor> LoadQuantizedCheckpointWeight(const WeightSource& ckpt, const std::string& name,
                                                       const std::vector<int64_t>& full_shape, const Slice& slice);
  absl::StatusOr<Tensor> Alloc(DType t, absl::Span<const int64_t> dims);
  // Alloc, counted in step_buffer_bytes().
  absl::StatusOr<Tensor> AllocStepBuffer(DType t, absl::Span<const int64_t> dims);
  absl::Status Upload(const Tensor& dst, const std::vector<int32_t>& src);
  // The step's ops on n tokens of `seqs` sequences, m logit rows, its metadata already uploaded:
  // everything they read is in this shard's buffers, so a recording of them replays any step of
  // the same shape.
  absl::Status Compute(int64_t n, int64_t m, int64_t seqs);
  // Compute as a step graph of shape (n, m): run, recorded or replayed (step_graphs_recorded()).
  absl::Status ComputeWithGraph(int64_t n, int64_t m, int64_t seqs);

  // ---- Constant after Load ----
  ModelConfig config_;
  ShardSpec spec_;
  StepLimits limits_;
  TpShard tp_shard_;
  int64_t first_layer_ = 0, end_layer_ = 0;
  Backend* backend_ = nullptr;
  Communicator* tp_ = nullptr;
  std::vector<Buffer> buffers_;  // every allocation; tensors below view into these
  // Host staging for weights bound for device memory (LoadWeight, LoadQuantizedCheckpointWeight):
  // one buffer grown to the largest weight and reused, where a fresh zero-filled buffer per weight
  // (page faults and a fill for every byte) took 6.7 s against 0.7 s for 8.6 GB of 117 MB weights
  // on a Zen 5 VM. Freed when Load returns.
  std::unique_ptr<uint8_t[]> staging_;
  size_t staging_bytes_ = 0;
  uint8_t* Staging(size_t bytes);
  uint64_t weight_bytes_ = 0;
  uint64_t step_buffer_bytes_ = 0;
  uint64_t kv_cache_bytes_ = 0;
  // A quantized checkpoint's linear weights by the layout that holds them (kNone: dequantized to
  // float32), indexed by WeightQuant, and why the first dequantized one is.
  int quant_paths_[4] = {};
  std::string quant_why_dense_;

  Tensor embed_tokens_;  // [vocab rows of this rank, hidden] (first stage; packed when it is also lm_head_, Load)
  std::vector<Layer> layers_;
  Tensor norm_;          // [hidden] (last stage)
  Tensor lm_head_;       // [vocab rows of this rank, hidden] (last stage)
  Tensor inv_freq_;      // [kRopeTableRows, rotary_dim / 2] F32: RopeTables' frequencies, two rows a table
  // Per RoPE table (ModelConfig::LayerRopeTable): its rows of inv_freq_ and the kernel's options.
  struct LayerRopeKind {
    Tensor inv_freq;       // [rotary_dim / 2] F32
    Tensor long_inv_freq;  // [rotary_dim / 2] F32 (LongRoPE's, read only then)
    RopeOptions options;
  };
  std::vector<LayerRopeKind> rope_;
  float embedding_scale_ = 0;  // Gemma's sqrt(hidden_size) in the act dtype; 0 for none

  // ---- Scratch, sized for max_tokens_per_step (n) and max_seqs_per_step (m) ----
  Tensor ids_, positions_, token_seq_, slots_, block_tables_, logit_rows_;  // I32
  Tensor hidden_;     // [n, hidden] residual stream
  Tensor normed_;     // [n, hidden]
  Tensor q_, k_, v_;  // [n, q], [n, kv], [n, kv]
  Tensor attn_;       // [n, q]
  Tensor proj_;       // [n, hidden] o_proj / down_proj output (partial sums before all-reduce)
  Tensor gate_, up_;  // [n, f]
  Tensor last_;       // [m, hidden] rows whose logits are wanted
  Tensor local_logits_;   // [m, vocab_rows_per_rank] F32
  Tensor gathered_logits_;  // [tp, m, vocab_rows_per_rank] F32; only when tp > 1
  Tensor logits_;     // [m, vocab] F32

  // ---- Step graphs, by shape (tokens, logit rows): -1 until recorded ----
  struct StepGraph {
    bool ran = false;  // the shape's first step ran as it is
    int id = -1;       // Backend::EndGraph's id once recorded
  };
  std::map<std::pair<int64_t, int64_t>, StepGraph> graphs_;
  bool graphs_on_ = false;  // the backend records graphs, and the TP group is one rank (Load)
  int64_t graphs_recorded_ = 0;
  uint64_t graph_replays_ = 0;
  std::string graphs_off_why_;
};

// Greedy decoding of one sequence in a single process (prefill in chunks of at most
// max_tokens_per_step, then one token per step). Returns the new ids; when `last_logits` is not
// null it receives the F32 logits that chose each new token, [steps][vocab], on the host.
absl::StatusOr<std::vector<int32_t>> GreedyGenerate(LlamaShard* model, const std::vector<int32_t>& prompt,
                                                    int64_t max_new_tokens,
                                                    std::vector<std::vector<float>>* step_logits = nullptr);

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_LLAMA_H_
