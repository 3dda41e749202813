#include "worker/llama.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "kernels/tensor.h"
#include "model/families/registry.h"
#include "model/quantized_checkpoint.h"

namespace shardserve {

namespace {

// The prefix of a linear weight's name ("model.layers.0.mlp.up_proj" of "...up_proj.weight").
std::string LinearPrefix(const std::string& name) { return name.substr(0, name.size() - std::string(".weight").size()); }

// A decoder layer's linear weight that a published quantized checkpoint stores quantized (not in
// its ignore list): model/quantized_checkpoint.h.
bool IsQuantizedLinear(const ModelConfig& config, const WeightDecl& w) {
  return config.checkpoint_quant.has_value() && w.part == WeightPart::kLayer && IsProductWeight(w.role) &&
         config.checkpoint_quant->Quantizes(LinearPrefix(w.name));
}

}  // namespace

absl::StatusOr<Tensor> LlamaShard::Alloc(DType t, absl::Span<const int64_t> dims) {
  if (dims.size() > Tensor::kMaxDims) return absl::InternalError(absl::StrCat("a buffer of ", dims.size(), " dimensions"));
  Tensor view;
  view.dtype = t;
  for (int64_t d : dims) view.shape[view.ndim++] = d;
  absl::StatusOr<Buffer> buf = backend_->Allocate(std::max<size_t>(view.bytes(), 1));
  if (!buf.ok()) return buf.status();
  view.data = buf->data();
  buffers_.push_back(std::move(*buf));
  return view;
}

absl::StatusOr<Tensor> LlamaShard::AllocStepBuffer(DType t, absl::Span<const int64_t> dims) {
  absl::StatusOr<Tensor> view = Alloc(t, dims);
  if (view.ok()) step_buffer_bytes_ += view->bytes();
  return view;
}

uint8_t* LlamaShard::Staging(size_t bytes) {
  if (bytes > staging_bytes_) {
    // The old one freed first (never both at once); the new one uninitialized: every byte of it is
    // written before it is copied.
    staging_.reset();
    staging_.reset(new uint8_t[bytes]);
    staging_bytes_ = bytes;
  }
  return staging_.get();
}

absl::StatusOr<Tensor> LlamaShard::LoadWeight(const WeightSource& ckpt, const std::string& name,
                                              std::vector<int64_t> full_shape, const Slice& slice) {
  // Nothing is sized from config.json before the checkpoint confirms the shape (Load checks
  // every tensor first; this keeps the rule for each one).
  SHARDSERVE_RETURN_IF_ERROR(ckpt.CheckShape(name, full_shape));
  std::vector<int64_t> local = full_shape;
  local[slice.dim] = (slice.end < 0 ? full_shape[slice.dim] : slice.end) - slice.begin;
  Tensor t;
  if (local.size() == 1) {
    SHARDSERVE_ASSIGN_OR_RETURN(t, Alloc(backend_->act_dtype(), {local[0]}));
  } else {
    SHARDSERVE_ASSIGN_OR_RETURN(t, Alloc(backend_->act_dtype(), {local[0], local[1]}));
  }
  if (backend_->device_kind() == DeviceKind::kCpu) {
    // Host memory: read the slice straight into place.
    SHARDSERVE_RETURN_IF_ERROR(ckpt.Read(name, full_shape, slice, t.dtype, t.data));
  } else if (absl::Status s = ckpt.ReadOnDevice(name, full_shape, slice, backend_, &t); !absl::IsUnimplemented(s)) {
    // Made in device memory (dummy weights with --dummy-weights device): no host copy.
    SHARDSERVE_RETURN_IF_ERROR(s);
  } else {
    uint8_t* staging = Staging(t.bytes());
    SHARDSERVE_RETURN_IF_ERROR(ckpt.Read(name, full_shape, slice, t.dtype, staging));
    SHARDSERVE_RETURN_IF_ERROR(backend_->CopyToDevice(t.data, staging, t.bytes()));
  }
  weight_bytes_ += t.bytes();
  return t;
}

absl::StatusOr<Tensor> LlamaShard::LoadQuantizedCheckpointWeight(const WeightSource& ckpt, const std::string& name,
                                                  const std::vector<int64_t>& full_shape, const Slice& slice) {
  const std::string prefix = LinearPrefix(name);
  SHARDSERVE_ASSIGN_OR_RETURN(QuantizedLinearSlice w,
                              ReadQuantizedLinear(ckpt, *config_.checkpoint_quant, prefix, full_shape[0], full_shape[1], slice));
  Tensor packed;
  ++quant_paths_[static_cast<int>(w.kernel)];
  if (w.kernel != WeightQuant::kNone) {  // the kernel's own layout, bit for bit
    absl::StatusOr<Buffer> buffer = backend_->PackQuantizedWeight(w.kernel, w.stored(), w.m, w.k, &packed);
    if (!buffer.ok()) return absl::Status(buffer.status().code(), absl::StrCat(prefix, ": ", buffer.status().message()));
    weight_bytes_ += packed.bytes();
    buffers_.push_back(std::move(*buffer));
    return packed;
  }
  if (quant_why_dense_.empty()) quant_why_dense_ = w.why_dense;
  // Dequantized to float32 at load (exact): a plain weight from here on.
  Tensor plain;
  SHARDSERVE_ASSIGN_OR_RETURN(plain, UploadHostWeight(prefix, w.dense.data(), {w.m, w.k}));
  absl::StatusOr<Buffer> buffer = backend_->PackMatMulWeight(plain, &packed, WeightQuant::kNone);
  if (!buffer.ok()) return absl::Status(buffer.status().code(), absl::StrCat(name, ": ", buffer.status().message()));
  if (buffer->data() != nullptr) {
    weight_bytes_ = weight_bytes_ - plain.bytes() + packed.bytes();
    buffers_.back() = std::move(*buffer);
  }
  return packed;
}

absl::StatusOr<Tensor> LlamaShard::LoadMatMulWeight(const WeightSource& ckpt, const WeightDecl& w, const Slice& slice,
                                                    WeightQuant quant) {
  // A published quantized checkpoint stores the decoder layers' linear weights in its format
  // (model/quantized_checkpoint.h); its embeddings, LM head and ignored modules are plain.
  if (IsQuantizedLinear(config_, w)) return LoadQuantizedCheckpointWeight(ckpt, w.name, w.shape, slice);
  Tensor plain, packed;
  SHARDSERVE_ASSIGN_OR_RETURN(plain, LoadWeight(ckpt, w.name, CheckpointShape(w), CheckpointSlice(w, slice)));
  absl::StatusOr<Buffer> buffer = backend_->PackMatMulWeight(plain, &packed, quant);
  if (!buffer.ok()) return absl::Status(buffer.status().code(), absl::StrCat(w.name, ": ", buffer.status().message()));
  if (buffer->data() != nullptr) {  // the packed copy replaces the plain one (BF16: half its bytes)
    // Logical bytes, as the planner counts: quantized weights with their scales (and zeros) (kernels/quant.h).
    weight_bytes_ = weight_bytes_ - plain.bytes() + packed.bytes();
    buffers_.back() = std::move(*buffer);
  }
  return packed;
}

absl::StatusOr<Tensor> LlamaShard::LoadNormPlusOne(const WeightSource& ckpt, const WeightDecl& w) {
  const int64_t n = w.shape[0];
  std::vector<float> plus_one(n);
  SHARDSERVE_RETURN_IF_ERROR(ckpt.Read(w.name, w.shape, Slice{0, 0, -1}, DType::kF32, plus_one.data()));
  for (float& v : plus_one) v = 1.0f + v;
  return UploadHostWeight(w.name, plus_one.data(), {n});
}

absl::StatusOr<Tensor> LlamaShard::UploadHostWeight(const std::string& name, const float* values,
                                                    absl::Span<const int64_t> dims) {
  Tensor t;
  SHARDSERVE_ASSIGN_OR_RETURN(t, Alloc(backend_->act_dtype(), dims));
  uint8_t* staging = Staging(t.bytes());
  if (!ConvertOnHost(staging, t.dtype, values, DType::kF32, static_cast<size_t>(t.numel()))) {
    return absl::InternalError(absl::StrCat(name, ": cannot convert to ", DTypeName(t.dtype)));
  }
  SHARDSERVE_RETURN_IF_ERROR(backend_->CopyToDevice(t.data, staging, t.bytes()));
  weight_bytes_ += t.bytes();
  return t;
}

std::string LlamaShard::GpuPathsNotYetRun() const {
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
  if (config_.final_logit_softcap > 0 && is_last_stage()) paths.push_back("logit soft-capping");
  for (const LayerRopeKind& rope : rope_) {
    if (rope.options.rotary_dim < config_.head_dim || rope.options.attention_factor != 1.0f ||
        rope.options.long_inv_freq != nullptr) {
      paths.push_back("RoPE with partial rotary, an attention factor or LongRoPE");
      break;
    }
  }
  return absl::StrJoin(paths, ", ");
}

std::string LlamaShard::QuantizationSummary() const {
  if (!config_.checkpoint_quant.has_value()) return WeightQuantName(spec_.weight_quant);
  constexpr std::pair<WeightQuant, const char*> kPaths[] = {
      {WeightQuant::kInt4, "as int4 groups of 128"},
      {WeightQuant::kInt8, "as int8 per output channel"},
      {WeightQuant::kFp8, "as fp8 e4m3 per output channel"}};
  std::string out = absl::StrCat(config_.checkpoint_quant->Describe(), ": linear weights");
  bool any = false;
  for (const auto& [kernel, what] : kPaths) {
    if (const int n = quant_paths_[static_cast<int>(kernel)]; n > 0) {
      absl::StrAppend(&out, any ? ", " : " ", n, " ", what, " (the checkpoint's codes and scales, exact)");
      any = true;
    }
  }
  if (const int n = quant_paths_[static_cast<int>(WeightQuant::kNone)]; n > 0 || !any) {
    absl::StrAppend(&out, any ? ", " : " ", n, " dequantized to float32 at load",
                    quant_why_dense_.empty() ? "" : absl::StrCat(" (", quant_why_dense_, ")"),
                    n > 0 ? ", which saves no memory" : "");
  }
  return out;
}

Tensor* LlamaShard::Slot(const WeightDecl& w) {
  if (w.part == WeightPart::kLayer) {
    Layer& l = layers_[w.layer - first_layer_];
    switch (w.role) {
      case WeightRole::kInputNorm: return &l.input_layernorm;
      case WeightRole::kQProj: return &l.q_proj;
      case WeightRole::kKProj: return &l.k_proj;
      case WeightRole::kVProj: return &l.v_proj;
      case WeightRole::kQBias: return &l.q_bias;
      case WeightRole::kKBias: return &l.k_bias;
      case WeightRole::kVBias: return &l.v_bias;
      case WeightRole::kQNorm: return &l.q_norm;
      case WeightRole::kKNorm: return &l.k_norm;
      case WeightRole::kOProj: return &l.o_proj;
      case WeightRole::kOBias: return &l.o_bias;
      case WeightRole::kAttnOutNorm: return &l.attn_out_norm;
      case WeightRole::kPreMlpNorm: return &l.pre_mlp_norm;
      case WeightRole::kMlpOutNorm: return &l.mlp_out_norm;
      case WeightRole::kGateProj: return &l.gate_proj;
      case WeightRole::kUpProj: return &l.up_proj;
      case WeightRole::kDownProj: return &l.down_proj;
      default: return nullptr;
    }
  }
  switch (w.role) {
    case WeightRole::kEmbedTokens: return &embed_tokens_;
    case WeightRole::kFinalNorm: return &norm_;
    case WeightRole::kLmHead: return &lm_head_;
    default: return nullptr;
  }
}

Tensor* LlamaShard::StepBufferSlot(const std::string& name) {
  const std::pair<const char*, Tensor*> slots[] = {
      {"ids", &ids_},       {"positions", &positions_}, {"token_seq", &token_seq_}, {"slots", &slots_},
      {"block_tables", &block_tables_}, {"logit_rows", &logit_rows_}, {"hidden", &hidden_},
      {"normed", &normed_}, {"q", &q_},  {"k", &k_},   {"v", &v_},   {"attn", &attn_}, {"proj", &proj_},
      {"gate", &gate_},     {"up", &up_}, {"inv_freq", &inv_freq_},   {"last", &last_},
      {"local_logits", &local_logits_}, {"gathered_logits", &gathered_logits_}, {"logits", &logits_}};
  for (const auto& [slot, tensor] : slots) {
    if (name == slot) return tensor;
  }
  return nullptr;
}

absl::StatusOr<std::unique_ptr<LlamaShard>> LlamaShard::Load(const WeightSource& ckpt, const ModelConfig& config,
                                                             const ShardSpec& spec, const StepLimits& opt,
                                                             Backend* backend, Communicator* tp) {
  std::unique_ptr<LlamaShard> m(new LlamaShard());
  m->config_ = config;
  m->spec_ = spec;
  m->limits_ = opt;
  m->backend_ = backend;
  m->tp_ = tp;
  const int64_t L = config.num_hidden_layers;
  m->first_layer_ = spec.first_layer;
  m->end_layer_ = spec.end_layer < 0 ? L : spec.end_layer;
  SHARDSERVE_RETURN_IF_ERROR(CheckShard(config, spec, opt));
  if (tp->size() != spec.tp_size || tp->rank() != spec.tp_rank) {
    return absl::InvalidArgumentError(absl::StrCat("shard is TP rank ", spec.tp_rank, " of ", spec.tp_size,
                                                   " but the communicator is rank ", tp->rank(), " of ", tp->size()));
  }
  SHARDSERVE_ASSIGN_OR_RETURN(m->tp_shard_, ComputeTpShard(config, spec.tp_rank, spec.tp_size));
  const TpShard& s = m->tp_shard_;
  const std::vector<WeightDecl> tensors =
      StageWeights(config, m->first_layer_, m->end_layer_, m->is_first_stage(), m->is_last_stage());

  // ---- Shapes first: config.json's sizes are only bounded (model/config.cc) until the
  // checkpoint confirms them, so every tensor's shape is checked before anything is allocated ----
  for (const WeightDecl& w : tensors) {
    if (IsQuantizedLinear(config, w)) {
      SHARDSERVE_RETURN_IF_ERROR(
          CheckQuantizedLinear(ckpt, *config.checkpoint_quant, LinearPrefix(w.name), w.shape[0], w.shape[1]));
    } else {
      SHARDSERVE_RETURN_IF_ERROR(ckpt.CheckShape(w.name, CheckpointShape(w)));
    }
  }

  // ---- Weights: this rank's slice of this stage's tensors, as the family declares them ----
  // A tied table on a stage that both looks tokens up and computes the logits is one buffer: in the
  // products' layout where the backend's Embedding reads that (Backend::EmbeddingTakesPackedTable:
  // the CPU's float32 panels, which the LM head's product would otherwise repack from the plain
  // table on every step), else plain.
  const bool one_packed_table = config.tie_word_embeddings && m->is_first_stage() && m->is_last_stage() &&
                                backend->EmbeddingTakesPackedTable();
  m->layers_.resize(m->end_layer_ - m->first_layer_);
  for (const WeightDecl& w : tensors) {
    Tensor* slot = m->Slot(w);
    if (slot == nullptr) {
      return absl::InternalError(absl::StrCat(w.name, ": the forward pass of ", config.architecture_name,
                                              " has no place for this tensor"));
    }
    if (!HoldsAny(w.split, s)) continue;  // another rank's (o_proj's bias: rank 0's)
    const Slice slice = ShardSlice(w.split, s);
    if (w.role == WeightRole::kLmHead && config.tie_word_embeddings && m->is_first_stage()) {
      *slot = m->embed_tokens_;  // tied, and already loaded on this stage (packed if one_packed_table)
    } else if (w.role == WeightRole::kEmbedTokens) {
      SHARDSERVE_ASSIGN_OR_RETURN(*slot, one_packed_table ? m->LoadMatMulWeight(ckpt, w, slice)
                                                          : m->LoadWeight(ckpt, w.name, CheckpointShape(w), CheckpointSlice(w, slice)));
    } else if (config.norm_plus_one && IsNormWeight(w.role)) {
      SHARDSERVE_ASSIGN_OR_RETURN(*slot, m->LoadNormPlusOne(ckpt, w));
    } else if (IsProductWeight(w.role)) {
      // The decoder layers' products take --quantization; the LM head stays in the act dtype.
      const WeightQuant quant = w.part == WeightPart::kLayer ? spec.weight_quant : WeightQuant::kNone;
      SHARDSERVE_ASSIGN_OR_RETURN(*slot, m->LoadMatMulWeight(ckpt, w, slice, quant));
    } else {
      SHARDSERVE_ASSIGN_OR_RETURN(*slot, m->LoadWeight(ckpt, w.name, CheckpointShape(w), CheckpointSlice(w, slice)));
    }
  }
  // The paged KV cache of each layer: this rank's KV heads only.
  const int64_t D = config.head_dim;
  for (Layer& l : m->layers_) {
    SHARDSERVE_ASSIGN_OR_RETURN(l.k_cache, m->Alloc(backend->act_dtype(), {opt.num_kv_blocks, opt.block_size, s.kv_heads, D}));
    SHARDSERVE_ASSIGN_OR_RETURN(l.v_cache, m->Alloc(backend->act_dtype(), {opt.num_kv_blocks, opt.block_size, s.kv_heads, D}));
    SHARDSERVE_RETURN_IF_ERROR(backend->Fill0(l.k_cache.data, l.k_cache.bytes()));
    SHARDSERVE_RETURN_IF_ERROR(backend->Fill0(l.v_cache.data, l.v_cache.bytes()));
    m->kv_cache_bytes_ += l.k_cache.bytes() + l.v_cache.bytes();
  }

  // ---- Scratch: everything a step needs, allocated once ----
  for (const StepBufferDecl& b : StepBuffers(config, s, backend->act_dtype(), opt, m->is_last_stage())) {
    Tensor* slot = m->StepBufferSlot(b.name);
    if (slot == nullptr) return absl::InternalError(absl::StrCat("step buffer \"", b.name, "\" has no slot"));
    SHARDSERVE_ASSIGN_OR_RETURN(*slot, m->AllocStepBuffer(b.dtype, b.dims));
  }
  if (config.embedding_scale != 0) {
    // The factor in the act dtype, as transformers casts it before the product.
    const float f32 = static_cast<float>(config.embedding_scale);
    uint16_t narrow = 0;
    m->embedding_scale_ = f32;
    if (backend->act_dtype() != DType::kF32 && ConvertOnHost(&narrow, backend->act_dtype(), &f32, DType::kF32, 1)) {
      ConvertOnHost(&m->embedding_scale_, DType::kF32, &narrow, backend->act_dtype(), 1);
    }
  }
  // RoPE: each kind of layer's frequencies in two rows of inv_freq_ (LongRoPE's long ones second).
  const std::vector<RopeTable> rope_tables = RopeTables(config);
  const int64_t rotary_half = config.RotaryDim() / 2;
  m->rope_.resize(rope_tables.size());
  for (size_t t = 0; t < rope_tables.size(); ++t) {
    const RopeTable& table = rope_tables[t];
    LayerRopeKind& kind = m->rope_[t];
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
  m->graphs_on_ = backend->records_graphs() && tp->size() == 1;
  m->staging_.reset();  // load-time only (Staging)
  m->staging_bytes_ = 0;
  backend->ReleaseLoadBuffers();
  return m;
}

Tensor LlamaShard::hidden(int64_t n) const { return hidden_.Rows(0, n); }
Tensor LlamaShard::logits(int64_t m) const { return logits_.Rows(0, m); }

absl::Status LlamaShard::Upload(const Tensor& dst, const std::vector<int32_t>& src) {
  if (src.empty()) return absl::OkStatus();
  return backend_->CopyToDevice(dst.data, src.data(), src.size() * sizeof(int32_t));
}

absl::Status LlamaShard::Forward(const StepBatch& b) {
  SHARDSERVE_RETURN_IF_ERROR(CheckStepBatch(b, limits_, config_, is_first_stage()));
  const int64_t n = static_cast<int64_t>(b.positions.size());
  const int64_t m = static_cast<int64_t>(b.logit_rows.size());

  // Step metadata to the device.
  SHARDSERVE_RETURN_IF_ERROR(Upload(positions_.Rows(0, n), b.positions));
  SHARDSERVE_RETURN_IF_ERROR(Upload(token_seq_.Rows(0, n), b.token_seq));
  SHARDSERVE_RETURN_IF_ERROR(Upload(slots_.Rows(0, n), b.slots));
  SHARDSERVE_RETURN_IF_ERROR(Upload(block_tables_.Rows(0, b.num_seqs), b.block_tables));
  SHARDSERVE_RETURN_IF_ERROR(Upload(logit_rows_.Rows(0, m), b.logit_rows));
  if (is_first_stage()) SHARDSERVE_RETURN_IF_ERROR(Upload(ids_.Rows(0, n), b.token_ids));

  if (graphs_on_ && n == b.num_seqs && n <= kMaxGraphSeqs) return ComputeWithGraph(n, m, b.num_seqs);
  return Compute(n, m, b.num_seqs);
}

absl::Status LlamaShard::ComputeWithGraph(int64_t n, int64_t m, int64_t seqs) {
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

absl::Status LlamaShard::Compute(int64_t n, int64_t m, int64_t seqs) {
  const float eps = static_cast<float>(config_.rms_norm_eps);
  const float scale = config_.attention_scale > 0 ? static_cast<float>(config_.attention_scale)
                                                 : 1.0f / std::sqrt(static_cast<float>(config_.head_dim));
  Backend& be = *backend_;
  Tensor ids = ids_.Rows(0, n), positions = positions_.Rows(0, n), token_seq = token_seq_.Rows(0, n),
         slots = slots_.Rows(0, n), tables = block_tables_.Rows(0, seqs), rows = logit_rows_.Rows(0, m);
  Tensor x = hidden_.Rows(0, n), normed = normed_.Rows(0, n), q = q_.Rows(0, n), k = k_.Rows(0, n),
         v = v_.Rows(0, n), attn = attn_.Rows(0, n), proj = proj_.Rows(0, n), gate = gate_.Rows(0, n),
         up = up_.Rows(0, n);

  // Embedding (first stage): vocab-parallel lookup, then all-reduce fills in the other ranks' rows.
  if (is_first_stage()) {
    SHARDSERVE_RETURN_IF_ERROR(be.Embedding(&x, embed_tokens_, ids, tp_shard_.vocab_rows.begin));
    SHARDSERVE_RETURN_IF_ERROR(tp_->AllReduceSum(&x));
    // times sqrt(hidden_size), in the act dtype (Gemma's normalizer)
    if (embedding_scale_ != 0) SHARDSERVE_RETURN_IF_ERROR(be.Scale(&x, x, embedding_scale_));
  }
  const bool gelu = config_.activation == ModelConfig::Activation::kGeluTanh;

  for (size_t li = 0; li < layers_.size(); ++li) {
    Layer& l = layers_[li];
    // attention norm (from the second layer on, done with the previous layer's residual add)
    if (li == 0) SHARDSERVE_RETURN_IF_ERROR(be.RmsNorm(&normed, x, l.input_layernorm, eps));
    // q, k, v projections (column-parallel: this rank's heads), one call: a backend may fuse them
    const MatMulProduct qkv[] = {{&q, &l.q_proj, l.q_bias.data ? &l.q_bias : nullptr},
                                 {&k, &l.k_proj, l.k_bias.data ? &l.k_bias : nullptr},
                                 {&v, &l.v_proj, l.v_bias.data ? &l.v_bias : nullptr}};
    SHARDSERVE_RETURN_IF_ERROR(be.MatMuls(normed, qkv));
    // q and k RMS-normed per head, over head_dim, in place (Qwen3's q_norm and k_norm)
    if (l.q_norm.data != nullptr) {
      const int64_t D = config_.head_dim;
      Tensor q_heads(q.data, q.dtype, {n * tp_shard_.q_heads, D}), k_heads(k.data, k.dtype, {n * tp_shard_.kv_heads, D});
      SHARDSERVE_RETURN_IF_ERROR(be.RmsNorm(&q_heads, q_heads, l.q_norm, eps));
      SHARDSERVE_RETURN_IF_ERROR(be.RmsNorm(&k_heads, k_heads, l.k_norm, eps));
    }
    // rotary position embedding, then k/v written to the paged cache (one pass where the backend fuses them)
    const LayerRopeKind& rope = rope_[config_.LayerRopeTable(first_layer_ + static_cast<int64_t>(li))];
    SHARDSERVE_RETURN_IF_ERROR(be.RopeCacheWrite(&q, &k, v, positions, rope.inv_freq,
                                                 static_cast<int>(config_.head_dim), rope.options, &l.k_cache,
                                                 &l.v_cache, slots));
    // causal attention over the cache (within the layer's sliding window, if it has one)
    AttentionOptions attention;
    attention.window = config_.LayerWindow(first_layer_ + static_cast<int64_t>(li));
    attention.softcap = static_cast<float>(config_.attn_logit_softcap);
    SHARDSERVE_RETURN_IF_ERROR(
        be.Attention(&attn, q, l.k_cache, l.v_cache, positions, token_seq, tables, scale, attention));
    // o_proj (row-parallel; its bias, if any, on one rank) + all-reduce of the partial sums
    SHARDSERVE_RETURN_IF_ERROR(be.MatMul(&proj, attn, l.o_proj, l.o_bias.data ? &l.o_bias : nullptr));
    SHARDSERVE_RETURN_IF_ERROR(tp_->AllReduceSum(&proj));
    // the attention output's own norm (Gemma 2), in place
    if (l.attn_out_norm.data != nullptr) SHARDSERVE_RETURN_IF_ERROR(be.RmsNorm(&proj, proj, l.attn_out_norm, eps));
    // residual, then the mlp norm (one pass where the backend fuses them)
    SHARDSERVE_RETURN_IF_ERROR(be.AddRmsNorm(&x, proj, &normed, l.pre_mlp_norm, eps));
    // gated mlp: gate/up column-parallel, act(gate) x up into gate (SwiGLU: one pass where the
    // backend fuses them; GeGLU with tanh gelu), down row-parallel + all-reduce
    if (gelu) {
      const MatMulProduct gate_up[] = {{&gate, &l.gate_proj, nullptr}, {&up, &l.up_proj, nullptr}};
      SHARDSERVE_RETURN_IF_ERROR(be.MatMuls(normed, gate_up));
      SHARDSERVE_RETURN_IF_ERROR(be.GeluTanhMul(&gate, gate, up));
    } else {
      SHARDSERVE_RETURN_IF_ERROR(be.GateUpSilu(&gate, &up, normed, l.gate_proj, l.up_proj));
    }
    SHARDSERVE_RETURN_IF_ERROR(be.MatMul(&proj, gate, l.down_proj, nullptr));
    SHARDSERVE_RETURN_IF_ERROR(tp_->AllReduceSum(&proj));
    // the mlp output's own norm (Gemma 2), in place
    if (l.mlp_out_norm.data != nullptr) SHARDSERVE_RETURN_IF_ERROR(be.RmsNorm(&proj, proj, l.mlp_out_norm, eps));
    // residual, then the next layer's attention norm
    if (li + 1 < layers_.size()) {
      SHARDSERVE_RETURN_IF_ERROR(be.AddRmsNorm(&x, proj, &normed, layers_[li + 1].input_layernorm, eps));
    } else {
      SHARDSERVE_RETURN_IF_ERROR(be.Add(&x, x, proj));
    }
  }

  if (!is_last_stage() || m == 0) return absl::OkStatus();
  // The rows whose logits are wanted (Embedding with the hidden state as the table is a row gather).
  Tensor last = last_.Rows(0, m), last_normed = normed_.Rows(0, m);
  SHARDSERVE_RETURN_IF_ERROR(be.Embedding(&last, x, rows, 0));
  // final norm
  SHARDSERVE_RETURN_IF_ERROR(be.RmsNorm(&last_normed, last, norm_, eps));
  // LM head (vocab-parallel), then all-gather every rank's slice of the vocabulary
  const int64_t w = tp_shard_.vocab_rows_per_rank, local = tp_shard_.vocab_rows.size();
  Tensor local_logits(local_logits_.data, DType::kF32, {m, local});
  SHARDSERVE_RETURN_IF_ERROR(be.MatMul(&local_logits, last_normed, lm_head_, nullptr));
  // cap * tanh(logits / cap), each rank on its slice (Gemma 2's final_logit_softcapping)
  if (config_.final_logit_softcap > 0) {
    SHARDSERVE_RETURN_IF_ERROR(be.Softcap(&local_logits, static_cast<float>(config_.final_logit_softcap)));
  }
  Tensor padded(local_logits_.data, DType::kF32, {m, w});  // the last rank's slice may be short
  // With one rank, gathered [1][row][vocab] is logits [row][vocab]: gather straight into it.
  const bool one_rank = spec_.tp_size == 1;
  Tensor gathered(one_rank ? logits_.data : gathered_logits_.data, DType::kF32, {spec_.tp_size, m, w});
  SHARDSERVE_RETURN_IF_ERROR(tp_->AllGather(&gathered, padded));
  if (one_rank) return absl::OkStatus();
  // gathered is [rank][row][w]; logits are [row][vocab]: copy each rank's columns into place.
  const int64_t V = config_.vocab_size;
  for (int r = 0; r < spec_.tp_size; ++r) {
    const int64_t cols = std::min(w, V - r * w);
    for (int64_t i = 0; i < m; ++i) {
      SHARDSERVE_RETURN_IF_ERROR(be.CopyOnDevice(logits_.as<float>() + i * V + r * w,
                                      gathered_logits_.as<float>() + (r * m + i) * w, cols * sizeof(float)));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> GreedyGenerate(LlamaShard* model, const std::vector<int32_t>& prompt,
                                                    int64_t max_new_tokens,
                                                    std::vector<std::vector<float>>* step_logits) {
  const StepLimits& opt = model->limits();
  if (prompt.empty()) return absl::InvalidArgumentError("the prompt is empty");
  if (!model->is_first_stage() || !model->is_last_stage()) {
    return absl::FailedPreconditionError("GreedyGenerate needs the whole model in this process");
  }
  const int64_t total = static_cast<int64_t>(prompt.size()) + max_new_tokens;
  const int64_t blocks = (total + opt.block_size - 1) / opt.block_size;
  if (blocks > opt.max_blocks_per_seq() || blocks > opt.num_kv_blocks) {
    return absl::InvalidArgumentError(absl::StrCat(total, " tokens need ", blocks, " KV blocks of ", opt.block_size,
                                                   "; this runtime has ", std::min(opt.max_blocks_per_seq(), opt.num_kv_blocks)));
  }
  Backend* be = model->backend();
  absl::StatusOr<Buffer> next_buf = be->Allocate(sizeof(int32_t));
  if (!next_buf.ok()) return next_buf.status();
  Tensor next(next_buf->data(), DType::kI32, {1});
  const int64_t V = model->config().vocab_size;

  StepBatch b;
  b.num_seqs = 1;
  b.block_tables.assign(opt.max_blocks_per_seq(), 0);
  for (int64_t i = 0; i < blocks; ++i) b.block_tables[i] = static_cast<int32_t>(i);  // slot == position

  std::vector<int32_t> out;
  std::vector<int32_t> pending(prompt);  // tokens not yet in the cache
  int64_t pos = 0;
  while (static_cast<int64_t>(out.size()) < max_new_tokens) {
    // Feed pending tokens in chunks; the last chunk asks for logits of its last token.
    const int64_t chunk = std::min<int64_t>(static_cast<int64_t>(pending.size()), opt.max_tokens_per_step);
    const bool final_chunk = chunk == static_cast<int64_t>(pending.size());
    b.token_ids.assign(pending.begin(), pending.begin() + chunk);
    b.positions.resize(chunk);
    b.slots.resize(chunk);
    for (int64_t t = 0; t < chunk; ++t) b.positions[t] = b.slots[t] = static_cast<int32_t>(pos + t);
    b.token_seq.assign(chunk, 0);
    b.logit_rows.clear();
    if (final_chunk) b.logit_rows.push_back(static_cast<int32_t>(chunk - 1));
    SHARDSERVE_RETURN_IF_ERROR(model->Forward(b));
    pos += chunk;
    pending.erase(pending.begin(), pending.begin() + chunk);
    if (!final_chunk) continue;

    Tensor logits = model->logits(1);
    SHARDSERVE_RETURN_IF_ERROR(be->Argmax(&next, logits));
    int32_t id = 0;
    SHARDSERVE_RETURN_IF_ERROR(be->CopyToHost(&id, next.data, sizeof(id)));
    if (step_logits != nullptr) {
      step_logits->emplace_back(V);
      SHARDSERVE_RETURN_IF_ERROR(be->CopyToHost(step_logits->back().data(), logits.data, V * sizeof(float)));
    }
    out.push_back(id);
    pending.push_back(id);
  }
  return out;
}

}  // namespace shardserve
