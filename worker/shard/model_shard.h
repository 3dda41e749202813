// One shard of a model: a layer range (a pipeline stage) on one tensor-parallel rank, with its
// weights (loader.h), its paged KV cache, its step buffers, and the step runner that drives the
// family's decoder blocks (decoder.h) over a step: the step's metadata to the device, embedding on
// the first stage, the stage's layers, the logits of the rows that sample on the last stage
// (gathered over the TP group), replayed from step graphs where the backend records them. The whole
// model in one process is the shard {all layers, rank 0 of 1}, which runs the same code.
//
// Ownership: ModelShard owns its weights, KV cache and step buffers (all allocated once, at Load).
// It borrows the Backend and the Communicator, which must outlive it.
// Threading: not thread-safe; one step at a time.
#ifndef SHARDSERVE_WORKER_SHARD_MODEL_SHARD_H_
#define SHARDSERVE_WORKER_SHARD_MODEL_SHARD_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "model/config.h"
#include "model/sharding.h"
#include "model/step_limits.h"
#include "model/weight_source.h"
#include "worker/communicator.h"
#include "worker/shard/arena.h"
#include "worker/shard/decoder.h"
#include "worker/shard/loader.h"
#include "worker/shard_inputs.h"  // ShardSpec, StepBatch

namespace shardserve {

class ModelShard {
 public:
  // Loads this shard's slice of the weights (a Checkpoint, or DummyWeights) in the backend's
  // activation dtype and allocates the KV cache and every step buffer.
  static absl::StatusOr<std::unique_ptr<ModelShard>> Load(const WeightSource& weights, const ModelConfig& config,
                                                          const ShardSpec& spec, const StepLimits& limits,
                                                          Backend* backend, Communicator* tp);

  // Runs the shard's layers over a step. On the first stage the input is the batch's token ids;
  // on later stages it is `hidden` ([n, hidden] act, from the previous stage). A
  // multi-token-prediction layer's shard (ShardSpec::mtp) takes both: for each row the next token's
  // id (batch.token_ids) and the model's normed hidden state at the row's position (`hidden`), and
  // computes eh_proj(cat(enorm(embed(id)), hnorm(hidden))) (the embedding zero at position 0, as
  // vLLM's DeepSeekMultiTokenPredictorLayer masks it), its decoder layer, then its head's logits. An
  // EAGLE-3 head's shard (ShardSpec::eagle3) takes both too, `hidden` being fc's projection of the
  // model's hidden states (Eagle3Input) or its own output: DecoderBlocks::Eagle3Layer, then its
  // logits over its own vocabulary. With ShardSpec::aux_hidden_layers, the input hidden state of each
  // of those layers the stage holds goes to aux_hidden() on the way. On return
  // `hidden` holds this stage's output hidden state; on the last stage, logits() holds
  // [m, vocab] F32 logits for batch.logit_rows. All outputs live on the backend's device.
  absl::Status Forward(const StepBatch& batch);

  // [n, hidden] act: this step's hidden state (input on later stages, output on every stage).
  Tensor hidden(int64_t n) const;
  // [m, vocab] F32, valid after Forward on the last stage.
  Tensor logits(int64_t m) const;
  // [aux layers x n, hidden] act (ShardSpec::aux_hidden_layers): the model's hidden state at the input
  // of each of those layers, one block of n rows a layer in their order. A stage writes the blocks of
  // its layers during Forward; the others come from the previous stage (the worker passes the
  // tensor along with hidden()). Empty without aux layers.
  Tensor aux_hidden(int64_t n) const;
  // On an EAGLE-3 head's shard: its fc over `aux` (another shard's aux_hidden(n)), the blocks side by
  // side a row, into `out` ([n, hidden] act): the hidden states its first guesses read.
  absl::Status Eagle3Input(Tensor* out, const Tensor& aux, int64_t n);
  // On the last stage after Forward: the model's final norm of the step's first n hidden rows (every
  // fed token's, not only the logit rows') into `out` ([n, hidden] act): the states a
  // multi-token-prediction layer reads (worker/head_runner.h; vLLM and SGLang feed it the normed state).
  absl::Status FinalNormed(Tensor* out, int64_t n) const;

  // ShardSpec::aux_hidden_layers: the layers whose input hidden states aux_hidden() keeps.
  const std::vector<int64_t>& aux_hidden_layers() const { return spec_.aux_hidden_layers; }
  bool is_first_stage() const { return first_layer_ == 0; }
  // The embedding table where this shard holds it whole (the first stage on one TP rank), for a head
  // that shares it (ShardSpec::embedding); null elsewhere.
  const Tensor* whole_embedding() const {
    return is_first_stage() && spec_.tp_size == 1 && weights_.embed_tokens.data != nullptr ? &weights_.embed_tokens
                                                                                            : nullptr;
  }
  // (a multi-token-prediction layer's shard, ShardSpec::mtp, is neither first nor last stage of the
  // model, but ends in logits as the last does: its head's)
  bool is_last_stage() const { return end_layer_ >= config_.num_hidden_layers; }
  const ModelConfig& config() const { return config_; }
  const StepLimits& limits() const { return limits_; }
  uint64_t weight_bytes() const { return load_.weight_bytes; }
  // Rows (token, expert pairs) each expert computed on this rank since load, by expert id (empty for
  // a dense model): the experts' load balance (MoeHostScratch::expert_rows_total). The steps' counts
  // are summed on the device; each call reads and adds those of the steps run since the one before
  // (one small read after the step's own).
  absl::StatusOr<std::vector<uint64_t>> ExpertRowsTotal();
  // Bytes of the buffers one step works in (inputs, activations, logits, RoPE frequencies): what
  // the planner counts as activation bytes (coordinator/planner/planner.cc).
  uint64_t step_buffer_bytes() const { return step_buffer_bytes_; }
  // Bytes of this shard's paged KV cache (K and V of every layer it holds, in either pool: kv_pools.h;
  // latent attention's latent rows).
  uint64_t kv_cache_bytes() const { return kv_cache_bytes_; }
  Backend* backend() const { return backend_; }
  // Step graphs (Backend::BeginGraph / RunGraph; the CUDA worker's, but --no-cuda-graphs): decode steps
  // (one token a sequence, at most kMaxGraphSeqs sequences) are replayed from a recording of the
  // step's ops, one graph per shape (tokens, logit rows), when the backend records graphs and the
  // TP group is one rank (a larger group's collectives wait for the device: TimedCommunicator).
  // The first step of a shape runs as it is (the kernels' code and cuBLAS's workspace loaded), the
  // second is recorded and run, the later ones replay it. If a recording fails the shard turns
  // graphs off, runs that step as it is, and step_graphs_off() says why. A model with experts runs
  // with graphs only where the backend's MoeExperts reads its row offsets on the device
  // (Backend::records_moe_experts); elsewhere step_graphs_off() says so.
  static constexpr int64_t kMaxGraphSeqs = 64;
  int step_graphs_recorded() const { return static_cast<int>(graphs_recorded_); }
  uint64_t step_graph_replays() const { return graph_replays_; }
  const std::string& step_graphs_off() const { return graphs_off_why_; }
  // How the linear weights are held, for the worker log (loader.h QuantizationSummary).
  std::string QuantizationSummary() const;
  // The CUDA kernels this shard runs that have not yet passed on a GPU (docs/gpu.md), for one line
  // at start; empty when none (and on the CPU).
  std::string GpuPathsNotYetRun() const;

 private:
  explicit ModelShard(Backend* backend) : backend_(backend), arena_(backend) {}
  // Where step buffer `name` (the family's StepBufferDecl) goes; null for one the step has no place for.
  Tensor* StepBufferSlot(const std::string& name);
  absl::Status Upload(const Tensor& dst, const std::vector<int32_t>& src);
  // The step's ops on n tokens of `seqs` sequences, m logit rows, its metadata already uploaded:
  // everything they read is in this shard's buffers, so a recording of them replays any step of
  // the same shape.
  absl::Status Compute(int64_t n, int64_t m, int64_t seqs);
  // Compute as a step graph of shape (n, m): run, recorded or replayed (step_graphs_recorded()).
  absl::Status ComputeWithGraph(int64_t n, int64_t m, int64_t seqs);
  // The logits of m rows, [m, vocab] F32, from each rank's slice in local_logits_.
  absl::Status GatherLogits(int64_t m);

  // ---- Constant after Load ----
  ModelConfig config_;
  ShardSpec spec_;
  StepLimits limits_;
  TpPlan tp_;
  int64_t first_layer_ = 0, end_layer_ = 0;
  Backend* const backend_;
  DeviceArena arena_;  // every allocation; tensors below view into it
  LoadReport load_;
  uint64_t step_buffer_bytes_ = 0;
  uint64_t kv_cache_bytes_ = 0;
  ShardWeights weights_;
  std::vector<KvCache> kv_;  // one per layer of the stage
  std::vector<DeviceRope> rope_;  // per RoPE table, views of inv_freq_'s rows
  std::unique_ptr<DecoderBlocks> blocks_;

  // ---- Step buffers, sized for max_tokens_per_step (n) and max_seqs_per_step (m) ----
  Tensor ids_, positions_, token_seq_, slots_, block_tables_, logit_rows_;  // I32
  Tensor sliding_slots_, sliding_block_tables_;  // I32, the sliding layers' pool's (kv_pools.h); only with one
  Tensor hidden_;     // [n, hidden] residual stream
  Tensor normed_;     // [n, hidden]
  Tensor q_, k_, v_;  // [n, q], [n, kv], [n, kv]
  Tensor attn_;       // [n, q]
  Tensor proj_;       // [n, hidden] o_proj / down_proj output (partial sums before all-reduce)
  Tensor gate_, up_;  // [n, f]
  MoeScratch moe_;    // the sparse layers' (models with experts only): n * k rows
  MoeHostScratch moe_host_;
  MlaScratch mla_;    // the latent-attention layers' (DeepSeek-V3 only)
  Tensor inv_freq_;   // [kRopeTableRows, rotary_dim / 2] F32: RopeTables' frequencies, two rows a table
  Tensor last_;       // [m, hidden] rows whose logits are wanted
  Tensor local_logits_;     // [m, vocab_rows_per_rank] F32
  Tensor gathered_logits_;  // [tp, m, vocab_rows_per_rank] F32; only when tp > 1
  Tensor logits_;           // [m, vocab] F32
  // A head's shard only (an MTP layer's or an EAGLE-3 head's; registry.h HeadStepBuffers):
  Tensor head_pairs_;     // [2 n + 1, hidden]: enorm(embed) rows [0, n), hnorm(hidden) rows [n, 2 n), a zero row
  Tensor head_cat_;       // [n, 2 hidden] their concatenation
  Tensor head_cat_rows_;  // [2 n] I32: the pairs' rows the concatenation gathers
  std::vector<int32_t> head_cat_rows_host_;  // reserved for 2 n
  // (an EAGLE-3 head's shard uses the three above as the MTP layer's: its embedding's and hidden
  // state's norms side by side, no zero row read; and these for its fc's input:)
  Tensor eagle3_cat_;       // [n, aux layers x the model's hidden]
  Tensor eagle3_cat_rows_;  // [aux layers x n] I32: the aux blocks' rows the concatenation gathers
  std::vector<int32_t> eagle3_cat_rows_host_;
  // With ShardSpec::aux_hidden_layers:
  Tensor aux_hidden_;  // [aux layers x n, hidden]

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

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_SHARD_MODEL_SHARD_H_
