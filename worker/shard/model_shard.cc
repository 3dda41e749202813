#include "worker/shard/model_shard.h"

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "kernels/tensor.h"
#include "model/families/registry.h"
#include "worker/shard/kv_pools.h"
#include "worker/step_checks.h"

namespace shardserve {

namespace {

// One layer's KV cache layout, [blocks, block_size, heads, dim] for K and, where values are cached
// apart, the same for V: this rank's KV heads' keys and values (GQA), or for latent attention
// (ModelConfig::mla) one row of the latent and the RoPE key a token, whole on every rank, and no V.
struct KvCacheLayout {
  int64_t heads = 0;
  int64_t dim = 0;
  bool values = true;
};

KvCacheLayout LayerKvCacheLayout(const ModelConfig& config, const TpShard& shard) {
  if (config.mla()) return {.heads = 1, .dim = config.kv_lora_rank + config.qk_rope_head_dim, .values = false};
  return {.heads = shard.kv_heads, .dim = config.head_dim, .values = true};
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelShard>> ModelShard::Load(const WeightSource& ckpt, const ModelConfig& config,
                                                             const ShardSpec& spec, const StepLimits& opt,
                                                             Backend* backend, Communicator* tp) {
  std::unique_ptr<ModelShard> m(new ModelShard(backend));
  m->config_ = config;
  m->spec_ = spec;
  m->limits_ = opt;
  m->first_layer_ = spec.first_layer;
  m->end_layer_ = spec.end_layer < 0 ? config.num_hidden_layers : spec.end_layer;
  SHARDSERVE_RETURN_IF_ERROR(CheckShard(config, spec, opt));
  if (tp->size() != spec.tp_size || tp->rank() != spec.tp_rank) {
    return absl::InvalidArgumentError(absl::StrCat("shard is TP rank ", spec.tp_rank, " of ", spec.tp_size,
                                                   " but the communicator is rank ", tp->rank(), " of ", tp->size()));
  }
  m->tp_.group = tp;
  SHARDSERVE_ASSIGN_OR_RETURN(m->tp_.shard, ComputeTpShard(config, spec.tp_rank, spec.tp_size, spec.expert_parallel));
  const TpShard& s = m->tp_.shard;
  m->tp_.experts = {.group = tp, .expert_parallel = s.expert_parallel, .num_experts = config.num_experts,
                    .experts = s.experts};

  // ---- Weights: this rank's slice of this stage's tensors, as the family declares them ----
  SHARDSERVE_ASSIGN_OR_RETURN(m->weights_,
                              LoadShardWeights(ckpt, m->config_, spec, s, backend, &m->arena_, &m->load_));
  backend->ReleaseLoadBuffers();

  // ---- The paged KV cache of each layer, in its pool (kv_pools.h): this rank's KV heads only, or
  // latent attention's latent rows (LayerKvCacheLayout) ----
  const KvCacheLayout layout = LayerKvCacheLayout(config, s);
  m->kv_.resize(m->end_layer_ - m->first_layer_);
  for (size_t i = 0; i < m->kv_.size(); ++i) {
    KvCache& c = m->kv_[i];
    const int64_t blocks = LayerKvBlocks(config, opt, m->first_layer_ + static_cast<int64_t>(i));
    for (Tensor* t : {&c.k, &c.v}) {
      if (t == &c.v && !layout.values) continue;
      SHARDSERVE_ASSIGN_OR_RETURN(*t,
                                  m->arena_.Alloc(backend->act_dtype(), {blocks, opt.block_size, layout.heads, layout.dim}));
      SHARDSERVE_RETURN_IF_ERROR(backend->Fill0(t->data, t->bytes()));
      m->kv_cache_bytes_ += t->bytes();
    }
  }

  // ---- Step buffers: everything a step needs, allocated once; a head's (an MTP layer's or an
  // EAGLE-3 head's) and the hidden states kept for an EAGLE-3 head beside them. Zero-filled, as the
  // KV cache: resident from the load on (on a CPU, where a page is taken at its first write), so
  // that a memory limit too small for them stops the load rather than the first long step, and
  // the worker's own memory beside them is measured whole at load (StepExecutor::MemoryReport) ----
  const auto allocate = [&m, backend](const std::vector<StepBufferDecl>& decls) -> absl::Status {
    for (const StepBufferDecl& b : decls) {
      Tensor* slot = m->StepBufferSlot(b.name);
      if (slot == nullptr) return absl::InternalError(absl::StrCat("step buffer \"", b.name, "\" has no slot"));
      SHARDSERVE_ASSIGN_OR_RETURN(*slot, m->arena_.Alloc(b.dtype, b.dims));
      SHARDSERVE_RETURN_IF_ERROR(backend->Fill0(slot->data, slot->bytes()));
      m->step_buffer_bytes_ += slot->bytes();
    }
    return absl::OkStatus();
  };
  SHARDSERVE_RETURN_IF_ERROR(allocate(StepBuffers(config, s, backend->act_dtype(), opt, m->is_last_stage())));
  if (spec.mtp || spec.eagle3) {
    SHARDSERVE_RETURN_IF_ERROR(allocate(HeadStepBuffers(config, backend->act_dtype(), opt)));
    const Tensor zero = m->head_pairs_.Rows(2 * opt.max_tokens_per_step, 2 * opt.max_tokens_per_step + 1);
    SHARDSERVE_RETURN_IF_ERROR(backend->Fill0(zero.data, zero.bytes()));
    m->head_cat_rows_host_.reserve(2 * opt.max_tokens_per_step);
  }
  if (spec.eagle3) {
    SHARDSERVE_RETURN_IF_ERROR(allocate(Eagle3StepBuffers(config, backend->act_dtype(), opt)));
    m->eagle3_cat_rows_host_.reserve(m->eagle3_cat_rows_.numel());
  }
  SHARDSERVE_RETURN_IF_ERROR(allocate(
      AuxHiddenBuffers(config, static_cast<int64_t>(spec.aux_hidden_layers.size()), backend->act_dtype(), opt)));
  // RoPE: each kind of layer's frequencies in two rows of inv_freq_ (LongRoPE's long ones second).
  const std::vector<RopeTable> rope_tables = RopeTables(config);
  const int64_t rotary_half = config.RotaryDim() / 2;
  m->rope_.resize(rope_tables.size());  // never resized again: options point into it
  for (size_t t = 0; t < rope_tables.size(); ++t) {
    const RopeTable& table = rope_tables[t];
    DeviceRope& kind = m->rope_[t];
    for (auto [row, freqs, tensor] : {std::tuple{2 * t, &table.inv_freq, &kind.inv_freq},
                                      std::tuple{2 * t + 1, &table.long_inv_freq, &kind.long_inv_freq}}) {
      *tensor = Tensor(m->inv_freq_.Rows(row, row + 1).data, DType::kF32, {rotary_half});
      if (freqs->empty()) continue;
      SHARDSERVE_RETURN_IF_ERROR(backend->CopyToDevice(tensor->data, freqs->data(), freqs->size() * sizeof(float)));
    }
    kind.options = {.rotary_dim = static_cast<int>(config.RotaryDim()),
                    .attention_factor = table.attention_factor,
                    .long_inv_freq = table.long_inv_freq.empty() ? nullptr : &kind.long_inv_freq,
                    .long_from = table.long_from};
  }
  m->blocks_ = std::make_unique<DecoderBlocks>(backend, &m->tp_, m->config_, &m->rope_);
  // A sparse layer's step stays on the device where the backend's MoeExperts reads its offsets
  // there (expert parallelism, which reads row counts on the host, needs TP > 1).
  m->graphs_on_ = backend->records_graphs() && tp->size() == 1 &&
                  (config.num_experts == 0 || backend->records_moe_experts());
  if (backend->records_graphs() && tp->size() == 1 && !m->graphs_on_) {
    m->graphs_off_why_ = absl::StrCat("the mixture-of-experts layers' experts read their row counts on the host (",
                                      backend->Describe(), ")");
  }
  if (config.num_experts > 0) {
    MoeHostScratch& host = m->moe_host_;
    host.expert_rows_total.assign(config.num_experts, 0);
    host.row_counts.assign(config.num_experts, 0);
    SHARDSERVE_RETURN_IF_ERROR(backend->Fill0(m->moe_.row_counts.data, m->moe_.row_counts.bytes()));
    if (s.expert_parallel) {
      const size_t nk = static_cast<size_t>(opt.max_tokens_per_step * config.num_experts_per_tok);
      host.all_offsets.resize(static_cast<size_t>(spec.tp_size) * (config.num_experts + 1));
      host.local_offsets.resize(config.num_experts + 1);
      host.regroup.resize(nk);
      host.ungroup.resize(nk);
      host.send_rows.resize(spec.tp_size);
      host.recv_rows.resize(spec.tp_size);
    }
  }
  return m;
}

Tensor* ModelShard::StepBufferSlot(const std::string& name) {
  const std::pair<const char*, Tensor*> slots[] = {
      {"ids", &ids_},       {"positions", &positions_}, {"token_seq", &token_seq_}, {"slots", &slots_},
      {"block_tables", &block_tables_}, {"sliding_slots", &sliding_slots_},
      {"sliding_block_tables", &sliding_block_tables_}, {"logit_rows", &logit_rows_}, {"hidden", &hidden_},
      {"normed", &normed_}, {"q", &q_},  {"k", &k_},   {"v", &v_},   {"attn", &attn_}, {"proj", &proj_},
      {"gate", &gate_},     {"up", &up_}, {"inv_freq", &inv_freq_},   {"last", &last_},
      {"local_logits", &local_logits_}, {"gathered_logits", &gathered_logits_}, {"logits", &logits_},
      {"router_logits", &moe_.router_logits}, {"expert_ids", &moe_.ids}, {"expert_weights", &moe_.weights},
      {"expert_order", &moe_.order}, {"expert_rows", &moe_.rows}, {"expert_offsets", &moe_.offsets},
      {"expert_row_counts", &moe_.row_counts}, {"expert_tokens", &moe_.tokens},
      {"expert_in", &moe_.in}, {"expert_gate", &moe_.gate}, {"expert_up", &moe_.up}, {"expert_out", &moe_.out},
      {"shared_gate", &moe_.shared_gate}, {"shared_up", &moe_.shared_up}, {"shared_out", &moe_.shared_out},
      {"shared_gate_logit", &moe_.shared_gate_logit},
      {"expert_all_offsets", &moe_.all_offsets}, {"expert_exchanged", &moe_.exchanged},
      {"expert_regroup", &moe_.regroup}, {"expert_ungroup", &moe_.ungroup}, {"expert_gathered", &moe_.gathered},
      {"mla_q_a", &mla_.q_a}, {"mla_q_nope", &mla_.q_nope}, {"mla_q_pe", &mla_.q_pe}, {"mla_kv_c", &mla_.kv_c},
      {"mla_k_pe", &mla_.k_pe}, {"head_pairs", &head_pairs_}, {"head_cat", &head_cat_},
      {"head_cat_rows", &head_cat_rows_}, {"eagle3_cat", &eagle3_cat_}, {"eagle3_cat_rows", &eagle3_cat_rows_},
      {"aux_hidden", &aux_hidden_}};
  for (const auto& [slot, tensor] : slots) {
    if (name == slot) return tensor;
  }
  return nullptr;
}

absl::StatusOr<std::vector<uint64_t>> ModelShard::ExpertRowsTotal() {
  MoeHostScratch& host = moe_host_;
  if (config_.num_experts == 0) return host.expert_rows_total;
  // the device's counts since the last read (steps run in order on its stream: this read follows
  // them), added to the totals, and the device's zeroed
  const Tensor& counts = moe_.row_counts;
  SHARDSERVE_RETURN_IF_ERROR(backend_->CopyToHost(host.row_counts.data(), counts.data, counts.bytes()));
  SHARDSERVE_RETURN_IF_ERROR(backend_->Fill0(counts.data, counts.bytes()));
  for (size_t e = 0; e < host.row_counts.size(); ++e) {
    host.expert_rows_total[e] += static_cast<uint32_t>(host.row_counts[e]);
  }
  return host.expert_rows_total;
}

std::string ModelShard::QuantizationSummary() const { return shardserve::QuantizationSummary(config_, spec_, load_); }

std::string ModelShard::GpuPathsNotYetRun() const {
  if (backend_->device_kind() != DeviceKind::kCuda) return "";
  std::vector<std::string> paths;
  for (int64_t i = first_layer_; i < end_layer_; ++i) {
    if (config_.LayerWindow(i) > 0) {
      paths.push_back("sliding-window attention");
      break;
    }
  }
  if (config_.attn_logit_softcap > 0) paths.push_back("attention soft-capping");
  if (config_.activation == ModelConfig::Activation::kGeluTanh) paths.push_back("GeGLU (gelu_tanh)");
  if (config_.embedding_scale > 0) paths.push_back("the embedding scale");
  for (int64_t i = first_layer_; i < end_layer_; ++i) {
    if (config_.LayerIsSparse(i)) {
      paths.push_back(absl::StrCat("mixture-of-experts layers (routing, grouping, the experts' products",
                                   backend_->records_moe_experts() ? " as one grouped GEMV" : "", ", combine)"));
      if (spec_.expert_parallel) paths.push_back("expert parallelism (the all-to-all dispatch over NCCL)");
      break;
    }
  }
  if (config_.mla()) paths.push_back("multi-head latent attention");
  if (config_.swiglu_limit > 0) paths.push_back("gpt-oss's clamped SwiGLU");
  if (load_.mxfp4_kept > 0) paths.push_back("MXFP4 experts' products (Mxfp4GemvKernel, DequantMxfp4Kernel)");
  if (load_.mxfp4_as_fp8 > 0) paths.push_back("fp8 products with input-group scales (MXFP4 experts on the fp8 kernels)");
  if (config_.final_logit_softcap > 0 && is_last_stage()) paths.push_back("logit soft-capping");
  for (const DeviceRope& rope : rope_) {
    if (rope.options.rotary_dim < config_.head_dim || rope.options.attention_factor != 1.0f ||
        rope.options.long_inv_freq != nullptr) {
      paths.push_back("RoPE with partial rotary, an attention factor or LongRoPE");
      break;
    }
  }
  return absl::StrJoin(paths, ", ");
}

Tensor ModelShard::hidden(int64_t n) const { return hidden_.Rows(0, n); }
Tensor ModelShard::logits(int64_t m) const { return logits_.Rows(0, m); }

Tensor ModelShard::aux_hidden(int64_t n) const {
  if (aux_hidden_.data == nullptr) return Tensor();
  const int64_t a = static_cast<int64_t>(spec_.aux_hidden_layers.size());
  return Tensor(aux_hidden_.data, aux_hidden_.dtype, {a * n, config_.hidden_size});
}

absl::Status ModelShard::Eagle3Input(Tensor* out, const Tensor& aux, int64_t n) {
  if (!spec_.eagle3 || n <= 0 || n > limits_.max_tokens_per_step) {
    return absl::FailedPreconditionError(absl::StrCat("not an EAGLE-3 head's shard, or ", n, " rows out of its step"));
  }
  const int64_t width = eagle3_cat_.dim(1), target_hidden = config_.eagle3->target_hidden_size;
  const int64_t a = width / target_hidden;
  if (aux.dim(0) != a * n || aux.dim(1) != target_hidden) {
    return absl::InvalidArgumentError(absl::StrCat("the model's aux hidden states are [", aux.dim(0), ", ", aux.dim(1),
                                                   "]; the EAGLE-3 head reads ", a, " blocks of ", n, " rows of ",
                                                   target_hidden));
  }
  // cat(aux_0[i], aux_1[i], ...) a row, [n, a x hidden] as [a n, hidden]: a gather of block j's row i
  // into row i a + j
  eagle3_cat_rows_host_.clear();
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < a; ++j) eagle3_cat_rows_host_.push_back(static_cast<int32_t>(j * n + i));
  }
  SHARDSERVE_RETURN_IF_ERROR(Upload(eagle3_cat_rows_.Rows(0, a * n), eagle3_cat_rows_host_));
  Tensor rows(eagle3_cat_.data, aux.dtype, {a * n, target_hidden});
  SHARDSERVE_RETURN_IF_ERROR(backend_->Embedding(&rows, aux, eagle3_cat_rows_.Rows(0, a * n), 0));
  // x = fc(cat(...))
  const Tensor cat(eagle3_cat_.data, aux.dtype, {n, width});
  return backend_->MatMul(out, cat, weights_.eagle3_fc, nullptr);
}

absl::Status ModelShard::FinalNormed(Tensor* out, int64_t n) const {
  if (!is_last_stage() || spec_.mtp) return absl::FailedPreconditionError("only the last stage has the final norm");
  return backend_->RmsNorm(out, hidden_.Rows(0, n), weights_.norm, static_cast<float>(config_.rms_norm_eps));
}

absl::Status ModelShard::Upload(const Tensor& dst, const std::vector<int32_t>& src) {
  if (src.empty()) return absl::OkStatus();
  return backend_->CopyToDevice(dst.data, src.data(), src.size() * sizeof(int32_t));
}

absl::Status ModelShard::Forward(const StepBatch& b) {
  SHARDSERVE_RETURN_IF_ERROR(CheckStepBatch(b, limits_, config_, is_first_stage() || spec_.mtp));
  const int64_t n = static_cast<int64_t>(b.positions.size());
  const int64_t m = static_cast<int64_t>(b.logit_rows.size());

  // Step metadata to the device.
  SHARDSERVE_RETURN_IF_ERROR(Upload(positions_.Rows(0, n), b.positions));
  SHARDSERVE_RETURN_IF_ERROR(Upload(token_seq_.Rows(0, n), b.token_seq));
  SHARDSERVE_RETURN_IF_ERROR(Upload(slots_.Rows(0, n), b.slots));
  SHARDSERVE_RETURN_IF_ERROR(Upload(block_tables_.Rows(0, b.num_seqs), b.block_tables));
  if (limits_.num_sliding_kv_blocks > 0) {
    SHARDSERVE_RETURN_IF_ERROR(Upload(sliding_slots_.Rows(0, n), b.sliding_slots));
    SHARDSERVE_RETURN_IF_ERROR(Upload(sliding_block_tables_.Rows(0, b.num_seqs), b.sliding_block_tables));
  }
  SHARDSERVE_RETURN_IF_ERROR(Upload(logit_rows_.Rows(0, m), b.logit_rows));
  if (is_first_stage() || spec_.mtp) SHARDSERVE_RETURN_IF_ERROR(Upload(ids_.Rows(0, n), b.token_ids));
  if (spec_.mtp || spec_.eagle3) {
    // The concatenation's rows: token i's normed embedding (the MTP layer's: the zero row at
    // position 0), then its normed hidden state.
    const int32_t N = static_cast<int32_t>(limits_.max_tokens_per_step);
    head_cat_rows_host_.clear();
    for (int32_t i = 0; i < static_cast<int32_t>(n); ++i) {
      head_cat_rows_host_.push_back(spec_.mtp && b.positions[i] == 0 ? 2 * N : i);
      head_cat_rows_host_.push_back(N + i);
    }
    SHARDSERVE_RETURN_IF_ERROR(Upload(head_cat_rows_.Rows(0, 2 * n), head_cat_rows_host_));
  }

  if (graphs_on_ && n == b.num_seqs && n <= kMaxGraphSeqs) return ComputeWithGraph(n, m, b.num_seqs);
  return Compute(n, m, b.num_seqs);
}

absl::Status ModelShard::ComputeWithGraph(int64_t n, int64_t m, int64_t seqs) {
  StepGraph& g = graphs_[{n, m}];
  if (g.id >= 0) {
    ++graph_replays_;
    return backend_->RunGraph(g.id);
  }
  if (!g.ran) {
    g.ran = true;
    return Compute(n, m, seqs);
  }
  absl::Status why = backend_->BeginGraph();
  if (why.ok()) {
    const absl::Status computed = Compute(n, m, seqs);
    absl::StatusOr<int> id = backend_->EndGraph();  // ends the recording whether or not Compute failed
    if (computed.ok() && id.ok()) {
      g.id = *id;
      ++graphs_recorded_;
      return backend_->RunGraph(g.id);
    }
    why = computed.ok() ? id.status() : computed;
  }
  // Nothing recorded ran: turn graphs off and run the step as it is (a real error in the step
  // shows again there).
  graphs_on_ = false;
  graphs_off_why_ =
      absl::StrCat("recording the step graph of ", n, " tokens, ", m, " logit rows failed: ", why.message());
  return Compute(n, m, seqs);
}

absl::Status ModelShard::Compute(int64_t n, int64_t m, int64_t seqs) {
  Backend& be = *backend_;
  const StepMeta meta{positions_.Rows(0, n), token_seq_.Rows(0, n), slots_.Rows(0, n), block_tables_.Rows(0, seqs)};
  // The sliding layers' pool, where they have one (kv_pools.h): its own slots and tables.
  const StepMeta sliding_meta =
      limits_.num_sliding_kv_blocks > 0
          ? StepMeta{meta.positions, meta.token_seq, sliding_slots_.Rows(0, n), sliding_block_tables_.Rows(0, seqs)}
          : meta;
  LayerScratch s{normed_.Rows(0, n), q_.Rows(0, n),    k_.Rows(0, n),    v_.Rows(0, n),
                 attn_.Rows(0, n),   proj_.Rows(0, n), gate_.Rows(0, n), up_.Rows(0, n),
                 moe_,               &moe_host_,       mla_};
  Tensor x = hidden_.Rows(0, n);

  // Embedding (first stage; an EAGLE-3 head's below).
  if (is_first_stage() && !spec_.eagle3) {
    SHARDSERVE_RETURN_IF_ERROR(blocks_->Embed(&x, weights_.embed_tokens, ids_.Rows(0, n)));
  }
  if (spec_.mtp) {
    // A multi-token-prediction layer's input, from the next token and the model's hidden state x:
    // x = eh_proj(cat(enorm(embed(next token)), hnorm(x)))
    const LayerWeights& w = weights_.layers[0];
    const float eps = static_cast<float>(config_.rms_norm_eps);
    const int64_t N = limits_.max_tokens_per_step, H = config_.hidden_size;
    Tensor e = head_pairs_.Rows(0, n), h = head_pairs_.Rows(N, N + n);
    SHARDSERVE_RETURN_IF_ERROR(be.RmsNorm(&h, x, w.hnorm, eps));
    SHARDSERVE_RETURN_IF_ERROR(blocks_->Embed(&e, weights_.embed_tokens, ids_.Rows(0, n)));
    SHARDSERVE_RETURN_IF_ERROR(be.RmsNorm(&e, e, w.enorm, eps));
    // the concatenation, [n, 2 hidden] as [2 n, hidden]: a gather of the rows e_0, h_0, e_1, h_1, ...
    Tensor cat_rows(head_cat_.data, be.act_dtype(), {2 * n, H});
    SHARDSERVE_RETURN_IF_ERROR(be.Embedding(&cat_rows, head_pairs_, head_cat_rows_.Rows(0, 2 * n), 0));
    const Tensor cat(head_cat_.data, be.act_dtype(), {n, 2 * H});
    SHARDSERVE_RETURN_IF_ERROR(be.MatMul(&x, cat, w.eh_proj, nullptr));
  }
  const std::vector<LayerWeights>& layers = weights_.layers;
  if (spec_.eagle3) {
    // An EAGLE-3 head, from the next token and the hidden state x (fc's projection of the model's, or
    // its own previous output):
    // cat(input_layernorm(embed(next token)), hidden_norm(x)); the residual x, or hidden_norm(x)
    // with norm_before_residual
    const LayerWeights& w = layers[0];
    const float eps = static_cast<float>(config_.rms_norm_eps);
    const int64_t N = limits_.max_tokens_per_step, H = config_.hidden_size;
    Tensor e = head_pairs_.Rows(0, n), h = head_pairs_.Rows(N, N + n);
    SHARDSERVE_RETURN_IF_ERROR(be.RmsNorm(&h, x, w.hnorm, eps));
    if (config_.eagle3->norm_before_residual) SHARDSERVE_RETURN_IF_ERROR(be.CopyOnDevice(x.data, h.data, h.bytes()));
    SHARDSERVE_RETURN_IF_ERROR(blocks_->Embed(&e, weights_.embed_tokens, ids_.Rows(0, n)));
    SHARDSERVE_RETURN_IF_ERROR(be.RmsNorm(&e, e, w.input_layernorm, eps));
    Tensor cat_rows(head_cat_.data, be.act_dtype(), {2 * n, H});
    SHARDSERVE_RETURN_IF_ERROR(be.Embedding(&cat_rows, head_pairs_, head_cat_rows_.Rows(0, 2 * n), 0));
    const Tensor cat(head_cat_.data, be.act_dtype(), {n, 2 * H});
    SHARDSERVE_RETURN_IF_ERROR(blocks_->Eagle3Layer(first_layer_, w, kv_[0], meta, s, cat, &x));
  }
  // The stage's layers; each leaves the next one's input norm in s.normed. An EAGLE-3 head reads the
  // input hidden states of some (aux_hidden_layers): kept as they pass.
  const std::vector<int64_t>& aux_layers = spec_.aux_hidden_layers;
  if (!layers.empty() && !spec_.eagle3) {
    SHARDSERVE_RETURN_IF_ERROR(be.RmsNorm(&s.normed, x, layers[0].input_layernorm, static_cast<float>(config_.rms_norm_eps)));
  }
  for (size_t i = 0; i < layers.size() && !spec_.eagle3; ++i) {
    const Tensor* next_norm = i + 1 < layers.size() ? &layers[i + 1].input_layernorm : nullptr;
    const int64_t layer = first_layer_ + static_cast<int64_t>(i);
    const StepMeta& layer_meta = LayerInSlidingPool(config_, limits_, layer) ? sliding_meta : meta;
    if (auto a = std::find(aux_layers.begin(), aux_layers.end(), layer); a != aux_layers.end()) {
      const Tensor kept = aux_hidden(n).Rows((a - aux_layers.begin()) * n, (a - aux_layers.begin() + 1) * n);
      SHARDSERVE_RETURN_IF_ERROR(be.CopyOnDevice(kept.data, x.data, x.bytes()));
    }
    SHARDSERVE_RETURN_IF_ERROR(blocks_->Layer(layer, layers[i], kv_[i], layer_meta, s, &x, next_norm));
  }

  if (!is_last_stage() || m == 0) return absl::OkStatus();
  // The rows whose logits are wanted (Embedding with the hidden state as the table is a row
  // gather), then this rank's slice of their logits.
  Tensor last = last_.Rows(0, m), last_normed = normed_.Rows(0, m);
  SHARDSERVE_RETURN_IF_ERROR(be.Embedding(&last, x, logit_rows_.Rows(0, m), 0));
  Tensor local_logits(local_logits_.data, DType::kF32, {m, tp_.shard.vocab_rows.size()});
  SHARDSERVE_RETURN_IF_ERROR(blocks_->LocalLogits(&local_logits, last, &last_normed, weights_.norm, weights_.lm_head));
  return GatherLogits(m);
}

absl::Status ModelShard::GatherLogits(int64_t m) {
  // Every rank's slice of the vocabulary, all-gathered (the last rank's slice may be short: each
  // is padded to vocab_rows_per_rank).
  const int64_t w = tp_.shard.vocab_rows_per_rank;
  Tensor padded(local_logits_.data, DType::kF32, {m, w});
  // With one rank, gathered [1][row][vocab] is logits [row][vocab]: gather straight into it.
  const bool one_rank = spec_.tp_size == 1;
  Tensor gathered(one_rank ? logits_.data : gathered_logits_.data, DType::kF32, {spec_.tp_size, m, w});
  SHARDSERVE_RETURN_IF_ERROR(tp_.group->AllGather(&gathered, padded));
  if (one_rank) return absl::OkStatus();
  // gathered is [rank][row][w]; logits are [row][vocab]: copy each rank's columns into place.
  const int64_t V = config_.vocab_size;
  for (int r = 0; r < spec_.tp_size; ++r) {
    const int64_t cols = std::min(w, V - r * w);
    for (int64_t i = 0; i < m; ++i) {
      SHARDSERVE_RETURN_IF_ERROR(backend_->CopyOnDevice(logits_.as<float>() + i * V + r * w,
                                                        gathered_logits_.as<float>() + (r * m + i) * w,
                                                        cols * sizeof(float)));
    }
  }
  return absl::OkStatus();
}

}  // namespace shardserve
