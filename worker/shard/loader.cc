#include "worker/shard/loader.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/families/registry.h"
#include "model/mxfp4.h"
#include "model/quantized_checkpoint.h"

namespace shardserve {

namespace {

// Expert `expert`'s slot among a layer's experts (the list grown to hold it); null for no expert.
Tensor* ExpertSlot(std::vector<Tensor>* experts, int64_t expert) {
  if (expert < 0) return nullptr;
  if (static_cast<size_t>(expert) >= experts->size()) experts->resize(expert + 1);
  return &(*experts)[expert];
}

// Where tensor `w` goes in `stage` (whose layers start at `first_layer`); null for one the forward
// pass has no place for.
Tensor* Slot(ShardWeights* stage, int64_t first_layer, const WeightDecl& w) {
  switch (w.role) {
    case WeightRole::kEmbedTokens: return &stage->embed_tokens;
    case WeightRole::kFinalNorm: return &stage->norm;
    case WeightRole::kLmHead: return &stage->lm_head;
    case WeightRole::kEagle3Fc: return &stage->eagle3_fc;
    default: break;
  }
  if (w.layer >= first_layer && w.layer - first_layer < static_cast<int64_t>(stage->layers.size())) {
    LayerWeights& l = stage->layers[w.layer - first_layer];
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
      case WeightRole::kRouter: return &l.router;
      case WeightRole::kExpertGateProj: return ExpertSlot(&l.expert_gate_proj, w.expert);
      case WeightRole::kExpertUpProj: return ExpertSlot(&l.expert_up_proj, w.expert);
      case WeightRole::kExpertDownProj: return ExpertSlot(&l.expert_down_proj, w.expert);
      case WeightRole::kSharedGateProj: return &l.shared_gate_proj;
      case WeightRole::kSharedUpProj: return &l.shared_up_proj;
      case WeightRole::kSharedDownProj: return &l.shared_down_proj;
      case WeightRole::kSharedExpertGate: return &l.shared_expert_gate;
      case WeightRole::kRouterBias: return &l.router_bias;
      case WeightRole::kSinks: return &l.sinks;
      case WeightRole::kRouterLogitBias: return &l.router_logit_bias;
      case WeightRole::kExpertGateBias: return ExpertSlot(&l.expert_gate_bias, w.expert);
      case WeightRole::kExpertUpBias: return ExpertSlot(&l.expert_up_bias, w.expert);
      case WeightRole::kExpertDownBias: return ExpertSlot(&l.expert_down_bias, w.expert);
      case WeightRole::kQAProj: return &l.q_a_proj;
      case WeightRole::kQANorm: return &l.q_a_layernorm;
      case WeightRole::kQNopeProj: return &l.q_nope_proj;
      case WeightRole::kQPeProj: return &l.q_pe_proj;
      case WeightRole::kKvAProj: return &l.kv_a_proj;
      case WeightRole::kKPeProj: return &l.k_pe_proj;
      case WeightRole::kKvANorm: return &l.kv_a_layernorm;
      case WeightRole::kKvBProj: return &l.kv_b_proj;
      case WeightRole::kMtpENorm: return &l.enorm;
      case WeightRole::kMtpHNorm: return &l.hnorm;
      case WeightRole::kMtpEhProj: return &l.eh_proj;
      default: return nullptr;
    }
  }
  return nullptr;
}

// The multi-token-prediction layer `layer`'s tensors (MtpWeights), its head the model's LM head
// where the checkpoint has no shared_head.head (as vLLM and SGLang load it); FailedPrecondition
// naming the first one the checkpoint lacks.
absl::StatusOr<std::vector<WeightDecl>> MtpStageWeights(const WeightSource& ckpt, const ModelConfig& config,
                                                        int64_t layer) {
  std::vector<WeightDecl> tensors;
  for (WeightDecl& w : MtpWeights(config)) {
    if (w.layer == layer) tensors.push_back(std::move(w));
  }
  if (tensors.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        config.architecture_name, " as config.json describes it has no multi-token-prediction layer ", layer,
        " (num_hidden_layers ", config.num_hidden_layers, ", num_nextn_predict_layers ",
        config.num_nextn_predict_layers, "); --speculative mtp needs one"));
  }
  for (WeightDecl& w : tensors) {
    if (w.role == WeightRole::kLmHead && absl::IsNotFound(ckpt.CheckShape(w.name, CheckpointShape(w)))) {
      w.name = config.tie_word_embeddings ? config.weight_prefix + "embed_tokens.weight" : config.lm_head_weight;
    }
    if (absl::IsNotFound(ckpt.CheckShape(w.name, CheckpointShape(w))) && !IsCheckpointQuantized(config, w)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the checkpoint has no tensor \"", w.name, "\" of the multi-token-prediction layer ", layer,
          " that config.json's num_nextn_predict_layers (", config.num_nextn_predict_layers,
          ") announces; --speculative mtp needs the layer's weights (some checkpoints leave them out)"));
    }
  }
  return tensors;
}

// One load: the tensors' device buffers (in the arena) and the host staging they pass through.
class WeightLoader {
 public:
  WeightLoader(const WeightSource& ckpt, const ModelConfig& config, Backend* backend, DeviceArena* arena,
               LoadReport* report)
      : ckpt_(ckpt), config_(config), backend_(backend), arena_(arena), report_(report) {}

  // Tensor `name` of `full_shape`, the part `slice` of it, in the act dtype.
  absl::StatusOr<Tensor> Plain(const std::string& name, std::vector<int64_t> full_shape, const Slice& slice);
  // Plain, then the backend's PackMatMulWeight (quantized as `quant`): for weights only MatMul reads.
  // A published quantized checkpoint's linear weight in its own format instead.
  absl::StatusOr<Tensor> Product(const WeightDecl& w, const Slice& slice, WeightQuant quant = WeightQuant::kNone);
  // A tied embedding and LM head's table: Plain, then the backend's PackTiedTable.
  absl::StatusOr<Tensor> TiedTable(const WeightDecl& w, const Slice& slice);
  // An RMSNorm's weight w, stored for a scale of 1 + w (Gemma): read in float32, 1 added there as
  // transformers adds it, then held in the act dtype.
  absl::StatusOr<Tensor> NormPlusOne(const WeightDecl& w);
  // The rows w.pick names of the checkpoint tensor's rows `slice` covers (whole blocks of
  // w.pick.period), in the act dtype; packed for MatMul (as `quant`) when w is a product's.
  absl::StatusOr<Tensor> Picked(const WeightDecl& w, const Slice& slice, WeightQuant quant);
  // A published quantized checkpoint's weight that is not a product (MLA's kv_b_proj, which the
  // attention reads plain): `slice` of it dequantized (model/quantized_checkpoint.h) and held in the
  // act dtype, as the plain checkpoint's would be.
  absl::StatusOr<Tensor> Dequantized(const WeightDecl& w, const Slice& slice);
  // Tensor w's `slice`, in float32 whatever the act dtype (DeepSeek-V3's router bias, which
  // transformers keeps in float32; gpt-oss's attention sinks, which the attention reads so).
  absl::StatusOr<Tensor> Float32(const WeightDecl& w, const Slice& slice);
  // Expert w.expert's part of a stacked tensor (WeightDecl::stack): its slab read (and transposed
  // to [out, in]), or dequantized from MXFP4 (ModelConfig::mxfp4_experts), its outputs picked, then
  // `slice` of it; packed for MatMul (as `quant`) when w is a product's.
  absl::StatusOr<Tensor> Stacked(const WeightDecl& w, const Slice& slice, WeightQuant quant);

 private:
  // A published quantized checkpoint's linear weight `name` (<prefix>.weight): its codes and scales
  // in an int4 / int8 / fp8 kernel layout, or dequantized to float32 and packed as a plain weight
  // (model/quantized_checkpoint.h).
  absl::StatusOr<Tensor> QuantizedCheckpointProduct(const std::string& name, const std::vector<int64_t>& full_shape,
                                                    const Slice& slice);
  // Rows `rows` (a dim-0 slice) of the quantized [out, in] weight `name`, dequantized to float32 into
  // `out` ([rows, in]). A format that packs several outputs into one int32 (GPTQ, AWQ, asymmetric
  // compressed-tensors) is read over whole packed int32s around them, then cut.
  absl::Status DequantizedRows(const std::string& name, const std::vector<int64_t>& full_shape, const Slice& rows,
                               float* out);
  // A weight made on the host in float32, held in the act dtype on the backend's device.
  absl::StatusOr<Tensor> UploadHost(const std::string& name, const float* values, absl::Span<const int64_t> dims);
  // `plain` (the arena's latest buffer) packed for MatMul as `quant`; the packed copy replaces it.
  absl::StatusOr<Tensor> Pack(const std::string& name, const Tensor& plain, WeightQuant quant);
  // What a packing of `plain` gave: `packed`, whose buffer (when the backend made one) replaces it.
  absl::StatusOr<Tensor> Adopt(const std::string& name, const Tensor& plain, absl::StatusOr<Buffer> buffer,
                               const Tensor& packed);
  // Host staging for weights bound for device memory: one buffer grown to the largest weight and
  // reused, where a fresh zero-filled buffer per weight (page faults and a fill for every byte)
  // took 6.7 s against 0.7 s for 8.6 GB of 117 MB weights on a Zen 5 VM.
  uint8_t* Staging(size_t bytes);

  const WeightSource& ckpt_;
  const ModelConfig& config_;
  Backend* const backend_;
  DeviceArena* const arena_;
  LoadReport* const report_;
  std::unique_ptr<uint8_t[]> staging_;
  size_t staging_bytes_ = 0;
};

uint8_t* WeightLoader::Staging(size_t bytes) {
  if (bytes > staging_bytes_) {
    // The old one freed first (never both at once); the new one uninitialized: every byte of it is
    // written before it is copied.
    staging_.reset();
    staging_.reset(new uint8_t[bytes]);
    staging_bytes_ = bytes;
  }
  return staging_.get();
}

absl::StatusOr<Tensor> WeightLoader::Plain(const std::string& name, std::vector<int64_t> full_shape,
                                           const Slice& slice) {
  // Nothing is sized from config.json before the checkpoint confirms the shape (LoadShardWeights
  // checks every tensor first; this keeps the rule for each one).
  SHARDSERVE_RETURN_IF_ERROR(ckpt_.CheckShape(name, full_shape));
  std::vector<int64_t> local = full_shape;
  local[slice.dim] = (slice.end < 0 ? full_shape[slice.dim] : slice.end) - slice.begin;
  Tensor t;
  SHARDSERVE_ASSIGN_OR_RETURN(t, arena_->Alloc(backend_->act_dtype(), local));
  if (backend_->device_kind() == DeviceKind::kCpu) {
    // Host memory: read the slice straight into place.
    SHARDSERVE_RETURN_IF_ERROR(ckpt_.Read(name, full_shape, slice, t.dtype, t.data));
  } else if (absl::Status s = ckpt_.ReadOnDevice(name, full_shape, slice, backend_, &t); !absl::IsUnimplemented(s)) {
    // Made in device memory (dummy weights with --dummy-weights device): no host copy.
    SHARDSERVE_RETURN_IF_ERROR(s);
  } else {
    uint8_t* staging = Staging(t.bytes());
    SHARDSERVE_RETURN_IF_ERROR(ckpt_.Read(name, full_shape, slice, t.dtype, staging));
    SHARDSERVE_RETURN_IF_ERROR(backend_->CopyToDevice(t.data, staging, t.bytes()));
  }
  report_->weight_bytes += t.bytes();
  return t;
}

absl::StatusOr<Tensor> WeightLoader::Pack(const std::string& name, const Tensor& plain, WeightQuant quant) {
  Tensor packed;
  return Adopt(name, plain, backend_->PackMatMulWeight(plain, &packed, quant), packed);
}

absl::StatusOr<Tensor> WeightLoader::TiedTable(const WeightDecl& w, const Slice& slice) {
  Tensor plain, packed;
  SHARDSERVE_ASSIGN_OR_RETURN(plain, Plain(w.name, CheckpointShape(w), CheckpointSlice(w, slice)));
  return Adopt(w.name, plain, backend_->PackTiedTable(plain, &packed), packed);
}

absl::StatusOr<Tensor> WeightLoader::Adopt(const std::string& name, const Tensor& plain, absl::StatusOr<Buffer> buffer,
                                           const Tensor& packed) {
  if (!buffer.ok()) return absl::Status(buffer.status().code(), absl::StrCat(name, ": ", buffer.status().message()));
  if (buffer->data() != nullptr) {  // the packed copy replaces the plain one (BF16: half its bytes)
    // Logical bytes, as the planner counts: quantized weights with their scales (and zeros) (kernels/quant.h).
    report_->weight_bytes = report_->weight_bytes - plain.bytes() + packed.bytes();
    arena_->ReplaceLatest(std::move(*buffer));
  }
  return packed;
}

absl::StatusOr<Tensor> WeightLoader::QuantizedCheckpointProduct(const std::string& name,
                                                                const std::vector<int64_t>& full_shape,
                                                                const Slice& slice) {
  const std::string prefix = LinearPrefix(name);
  SHARDSERVE_ASSIGN_OR_RETURN(QuantizedLinearSlice w,
                              ReadQuantizedLinear(ckpt_, *config_.checkpoint_quant, prefix, full_shape[0], full_shape[1], slice));
  // (An FP8 checkpoint's block scales on the fp8 kernel counted apart: LoadReport::kFp8BlocksPath.)
  const bool fp8_blocks = w.kernel == WeightQuant::kFp8 && config_.checkpoint_quant->method == QuantMethod::kFp8;
  ++report_->quant_paths[fp8_blocks ? LoadReport::kFp8BlocksPath : static_cast<int>(w.kernel)];
  if (w.kernel != WeightQuant::kNone) {  // the kernel's own layout, bit for bit
    Tensor packed;
    absl::StatusOr<Buffer> buffer = backend_->PackQuantizedWeight(w.kernel, w.stored(), w.m, w.k, &packed, w.group);
    if (!buffer.ok()) return absl::Status(buffer.status().code(), absl::StrCat(prefix, ": ", buffer.status().message()));
    report_->weight_bytes += packed.bytes();
    arena_->Keep(std::move(*buffer));
    return packed;
  }
  if (report_->quant_why_dense.empty()) report_->quant_why_dense = w.why_dense;
  // Dequantized to float32 at load (exact): a plain weight from here on.
  Tensor plain;
  SHARDSERVE_ASSIGN_OR_RETURN(plain, UploadHost(prefix, w.dense.data(), {w.m, w.k}));
  return Pack(name, plain, WeightQuant::kNone);
}

absl::StatusOr<Tensor> WeightLoader::Product(const WeightDecl& w, const Slice& slice, WeightQuant quant) {
  // A published quantized checkpoint stores the decoder layers' linear weights in its format
  // (model/quantized_checkpoint.h); its embeddings, LM head and ignored modules are plain.
  if (IsCheckpointQuantized(config_, w)) return QuantizedCheckpointProduct(w.name, w.shape, slice);
  Tensor plain;
  SHARDSERVE_ASSIGN_OR_RETURN(plain, Plain(w.name, CheckpointShape(w), CheckpointSlice(w, slice)));
  return Pack(w.name, plain, quant);
}

absl::StatusOr<Tensor> WeightLoader::NormPlusOne(const WeightDecl& w) {
  const int64_t n = w.shape[0];
  std::vector<float> plus_one(n);
  SHARDSERVE_RETURN_IF_ERROR(ckpt_.Read(w.name, w.shape, Slice{0, 0, -1}, DType::kF32, plus_one.data()));
  for (float& v : plus_one) v = 1.0f + v;
  return UploadHost(w.name, plus_one.data(), {n});
}

absl::StatusOr<Tensor> WeightLoader::Picked(const WeightDecl& w, const Slice& slice, WeightQuant quant) {
  const WeightDecl::RowPick& p = w.pick;
  const std::vector<int64_t>& full = w.fused_shape;
  const int64_t end = slice.end < 0 ? w.shape[0] : slice.end;
  if (full.size() != 2 || slice.dim != 0 || p.count <= 0 || p.from + p.count > p.period || slice.begin % p.count != 0 ||
      end % p.count != 0 || (p.deinterleave && p.count % 2 != 0)) {
    return absl::InternalError(absl::StrCat(w.name, ": rows picked as no whole blocks of ", p.period));
  }
  const int64_t first = slice.begin / p.count, blocks = end / p.count - first, cols = full[1];
  std::vector<float> read(static_cast<size_t>(blocks * p.period * cols));
  const Slice rows{0, first * p.period, (first + blocks) * p.period};
  if (IsCheckpointQuantized(config_, w)) {
    SHARDSERVE_RETURN_IF_ERROR(DequantizedRows(w.name, full, rows, read.data()));
  } else {
    SHARDSERVE_RETURN_IF_ERROR(ckpt_.Read(w.name, full, rows, DType::kF32, read.data()));
  }
  std::vector<float> picked(static_cast<size_t>(blocks * p.count * cols));
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t i = 0; i < p.count; ++i) {
      // de-interleaved: the pairs' first rows (0, 2, 4, ...), then their second ones (1, 3, 5, ...)
      const int64_t half = p.count / 2;
      const int64_t from = p.from + (!p.deinterleave ? i : i < half ? 2 * i : 2 * (i - half) + 1);
      std::memcpy(picked.data() + (b * p.count + i) * cols, read.data() + (b * p.period + from) * cols,
                  cols * sizeof(float));
    }
  }
  Tensor plain;
  SHARDSERVE_ASSIGN_OR_RETURN(plain, UploadHost(w.name, picked.data(), {blocks * p.count, cols}));
  if (!IsProductWeight(w.role)) return plain;
  return Pack(w.name, plain, quant);
}

absl::Status WeightLoader::DequantizedRows(const std::string& name, const std::vector<int64_t>& full_shape,
                                          const Slice& rows, float* out) {
  const int64_t m = config_.checkpoint_quant->output_multiple(), end = rows.end < 0 ? full_shape[0] : rows.end;
  const int64_t r0 = rows.begin / m * m, r1 = std::min(full_shape[0], (end + m - 1) / m * m);
  SHARDSERVE_ASSIGN_OR_RETURN(QuantizedLinearSlice q,
                              ReadQuantizedLinear(ckpt_, *config_.checkpoint_quant, LinearPrefix(name), full_shape[0],
                                                  full_shape[1], Slice{0, r0, r1}, /*map=*/false));
  if (q.k != full_shape[1] || q.m != r1 - r0) return absl::InternalError(absl::StrCat(name, ": dequantized rows of another shape"));
  ++report_->quant_paths[static_cast<int>(WeightQuant::kNone)];
  if (report_->quant_why_dense.empty()) {  // (a format's own reason, where it has one, is set by its other weights)
    report_->quant_why_dense = "MLA's parts of q_b_proj / kv_a_proj_with_mqa and kv_b_proj are read dequantized";
  }
  std::memcpy(out, q.dense.data() + (rows.begin - r0) * q.k, static_cast<size_t>((end - rows.begin) * q.k) * sizeof(float));
  return absl::OkStatus();
}

absl::StatusOr<Tensor> WeightLoader::Dequantized(const WeightDecl& w, const Slice& slice) {
  if (slice.dim != 0 || w.shape.size() != 2) {
    return absl::InternalError(absl::StrCat(w.name, ": a quantized weight held plain is cut by rows only"));
  }
  const int64_t rows = (slice.end < 0 ? w.shape[0] : slice.end) - slice.begin;
  std::vector<float> values(static_cast<size_t>(rows * w.shape[1]));
  SHARDSERVE_RETURN_IF_ERROR(DequantizedRows(w.name, w.shape, slice, values.data()));
  return UploadHost(w.name, values.data(), {rows, w.shape[1]});
}

absl::StatusOr<Tensor> WeightLoader::Float32(const WeightDecl& w, const Slice& slice) {
  if (w.shape.size() != 1) return absl::InternalError(absl::StrCat(w.name, ": read in float32 but not 1-D"));
  const int64_t count = (slice.end < 0 ? w.shape[0] : slice.end) - slice.begin;
  std::vector<float> values(static_cast<size_t>(count));
  SHARDSERVE_RETURN_IF_ERROR(ckpt_.Read(w.name, w.shape, slice, DType::kF32, values.data()));
  Tensor t;
  SHARDSERVE_ASSIGN_OR_RETURN(t, arena_->Alloc(DType::kF32, {count}));
  SHARDSERVE_RETURN_IF_ERROR(backend_->CopyToDevice(t.data, values.data(), t.bytes()));
  report_->weight_bytes += t.bytes();
  return t;
}

absl::StatusOr<Tensor> WeightLoader::Stacked(const WeightDecl& w, const Slice& slice, WeightQuant quant) {
  const WeightDecl::ExpertStack& st = w.stack;
  const std::vector<int64_t>& full = w.fused_shape;
  const bool product = full.size() == 3;
  // The expert's slab as [outputs, inputs] (a bias: [outputs, 1]) in float32.
  const int64_t outs = product ? (st.transposed ? full[2] : full[1]) : full[1];
  const int64_t ins = product ? (st.transposed ? full[1] : full[2]) : 1;
  if ((product ? w.shape.size() != 2 : w.shape.size() != 1) || st.period <= 0 || st.from >= st.period ||
      outs % st.period != 0 || w.shape[0] != outs / st.period || (product && w.shape[1] != ins)) {
    return absl::InternalError(absl::StrCat(w.name, ": expert ", w.expert, "'s part does not fit the stacked tensor"));
  }
  // Of each `period` outputs the one at `from` (gate_up's gate, or its up), then this rank's slice:
  // rows (a column-parallel product, a bias) or columns (a row-parallel product) of the picked [out, in].
  const int64_t picked_rows = outs / st.period;
  const int64_t row_begin = slice.dim == 0 ? slice.begin : 0;
  const int64_t row_end = slice.dim == 0 && slice.end >= 0 ? slice.end : picked_rows;
  const int64_t col_begin = slice.dim == 1 ? slice.begin : 0;
  const int64_t col_end = slice.dim == 1 && slice.end >= 0 ? slice.end : ins;
  if (row_begin < 0 || row_begin > row_end || row_end > picked_rows || col_begin < 0 || col_begin > col_end ||
      col_end > ins) {
    return absl::InternalError(absl::StrCat(w.name, ": expert ", w.expert, "'s slice outside its part"));
  }
  const int64_t rows = row_end - row_begin, cols = col_end - col_begin;
  const std::string name = absl::StrCat(w.name, " (expert ", w.expert, ")");

  std::vector<float> slab(static_cast<size_t>(outs * ins));
  const Slice expert{0, w.expert, w.expert + 1};
  if (product && config_.mxfp4_experts && !ckpt_.MakesPlainWeights()) {
    // <name>_blocks [E, out, in / 32, 16] and <name>_scales [E, out, in / 32]
    const int64_t groups = ins / kMxfp4BlockSize;
    std::vector<uint8_t> blocks(static_cast<size_t>(outs * groups * kMxfp4BlockBytes)),
        scales(static_cast<size_t>(outs * groups));
    const std::string blocks_name = w.name + "_blocks", scales_name = w.name + "_scales";
    SHARDSERVE_RETURN_IF_ERROR(
        ckpt_.Read(blocks_name, {full[0], outs, groups, kMxfp4BlockBytes}, expert, DType::kI8, blocks.data()));
    SHARDSERVE_RETURN_IF_ERROR(ckpt_.Read(scales_name, {full[0], outs, groups}, expert, DType::kI8, scales.data()));
    // Kept as the checkpoint's codes and scales (Mxfp4RowsLayout, the backend's mxfp4 kernels), or
    // where the backend has none on the fp8 kernels with a scale per 32 inputs (Mxfp4AsFp8Groups),
    // both exact, unless another layout was asked for (--quantization) or this rank's inputs cut a
    // block; the planner counts the mxfp4 bytes (coordinator/planner/weights.cc).
    std::string why_not;
    if (quant != WeightQuant::kNone) {
      why_not = absl::StrCat("--quantization ", WeightQuantName(quant), " asked for");
    } else if (col_begin % kMxfp4BlockSize != 0 || cols % kMxfp4BlockSize != 0) {
      why_not = absl::StrCat("this rank's inputs [", col_begin, ", ", col_end, ") cut a block of ", kMxfp4BlockSize);
    } else {
      std::vector<int64_t> picked(static_cast<size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) picked[r] = (row_begin + r) * st.period + st.from;
      const int64_t group0 = col_begin / kMxfp4BlockSize, num_groups = cols / kMxfp4BlockSize;
      std::vector<uint8_t> stored;
      if (!Mxfp4Rows(blocks.data(), scales.data(), groups, picked, group0, num_groups, &stored)) {
        why_not = "a value past float32 (a scale byte of 255, or 253 / 254 on a large code)";
      } else {
        Tensor packed;
        absl::StatusOr<Buffer> buffer = backend_->PackQuantizedWeight(WeightQuant::kMxfp4, stored.data(), rows, cols, &packed);
        if (buffer.ok()) {
          report_->weight_bytes += packed.bytes();
          ++report_->mxfp4_kept;
          arena_->Keep(std::move(*buffer));
          return packed;
        }
        if (!absl::IsUnimplemented(buffer.status())) {
          return absl::Status(buffer.status().code(), absl::StrCat(name, ": ", buffer.status().message()));
        }
        why_not = absl::StrCat("this backend has no mxfp4 kernels (", buffer.status().message(), ")");
        if (Mxfp4AsFp8Groups(blocks.data(), scales.data(), groups, picked, group0, num_groups, &stored)) {
          Tensor as_fp8;
          absl::StatusOr<Buffer> fp8 =
              backend_->PackQuantizedWeight(WeightQuant::kFp8, stored.data(), rows, cols, &as_fp8, kMxfp4BlockSize);
          if (!fp8.ok()) return absl::Status(fp8.status().code(), absl::StrCat(name, ": ", fp8.status().message()));
          report_->weight_bytes += as_fp8.bytes();
          ++report_->mxfp4_as_fp8;
          if (report_->mxfp4_why_not.empty()) report_->mxfp4_why_not = why_not;
          arena_->Keep(std::move(*fp8));
          return as_fp8;
        }
      }
    }
    if (report_->mxfp4_why_not.empty()) report_->mxfp4_why_not = why_not;
    ++report_->mxfp4_dequantized;
    SHARDSERVE_RETURN_IF_ERROR(DequantizeMxfp4(blocks.data(), scales.data(), outs, ins, slab.data(), blocks_name));
  } else if (product && st.transposed) {
    std::vector<float> stored(slab.size());  // [in, out]
    SHARDSERVE_RETURN_IF_ERROR(ckpt_.Read(w.name, full, expert, DType::kF32, stored.data()));
    for (int64_t i = 0; i < ins; ++i) {
      for (int64_t o = 0; o < outs; ++o) slab[o * ins + i] = stored[i * outs + o];
    }
  } else {
    SHARDSERVE_RETURN_IF_ERROR(ckpt_.Read(w.name, full, expert, DType::kF32, slab.data()));
  }
  std::vector<float> picked(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t o = (row_begin + r) * st.period + st.from;
    std::memcpy(picked.data() + r * cols, slab.data() + o * ins + col_begin, cols * sizeof(float));
  }
  if (!product) return UploadHost(name, picked.data(), {rows});
  Tensor plain;
  SHARDSERVE_ASSIGN_OR_RETURN(plain, UploadHost(name, picked.data(), {rows, cols}));
  return Pack(name, plain, quant);
}

absl::StatusOr<Tensor> WeightLoader::UploadHost(const std::string& name, const float* values,
                                                absl::Span<const int64_t> dims) {
  Tensor t;
  SHARDSERVE_ASSIGN_OR_RETURN(t, arena_->Alloc(backend_->act_dtype(), dims));
  uint8_t* staging = Staging(t.bytes());
  if (!ConvertOnHost(staging, t.dtype, values, DType::kF32, static_cast<size_t>(t.numel()))) {
    return absl::InternalError(absl::StrCat(name, ": cannot convert to ", DTypeName(t.dtype)));
  }
  SHARDSERVE_RETURN_IF_ERROR(backend_->CopyToDevice(t.data, staging, t.bytes()));
  report_->weight_bytes += t.bytes();
  return t;
}

}  // namespace

absl::StatusOr<ShardWeights> LoadShardWeights(const WeightSource& ckpt, const ModelConfig& config,
                                              const ShardSpec& spec, const TpShard& shard, Backend* backend,
                                              DeviceArena* arena, LoadReport* report) {
  const int64_t first = spec.first_layer, end = spec.end_layer < 0 ? config.num_hidden_layers : spec.end_layer;
  const bool first_stage = first == 0 && !spec.mtp, last_stage = end == config.num_hidden_layers && !spec.mtp;
  std::vector<WeightDecl> tensors;
  if (spec.mtp) {
    SHARDSERVE_ASSIGN_OR_RETURN(tensors, MtpStageWeights(ckpt, config, first));
  } else {
    tensors = StageWeights(config, first, end, first_stage, last_stage);
  }

  // ---- Shapes first: config.json's sizes are only bounded (model/config.cc) until the
  // checkpoint confirms them, so every tensor's shape is checked before anything is allocated ----
  for (const WeightDecl& w : tensors) {
    if (IsCheckpointQuantized(config, w)) {
      const std::vector<int64_t>& shape = CheckpointShape(w);  // a picked part's: the fused tensor's
      SHARDSERVE_RETURN_IF_ERROR(
          CheckQuantizedLinear(ckpt, *config.checkpoint_quant, LinearPrefix(w.name), shape[0], shape[1]));
    } else if (IsMxfp4Part(config, w) && !ckpt.MakesPlainWeights()) {
      for (const auto& [name, shape] : Mxfp4Tensors(w)) SHARDSERVE_RETURN_IF_ERROR(ckpt.CheckShape(name, shape));
    } else {
      SHARDSERVE_RETURN_IF_ERROR(ckpt.CheckShape(w.name, CheckpointShape(w)));
    }
  }

  // ---- This rank's slice of each tensor, as the family declares it ----
  // A tied table on a stage that both looks tokens up and computes the logits is one buffer, as
  // Backend::PackTiedTable lays it out (the CPU's float32 panels, which the LM head's product would
  // otherwise repack from the plain table on every step; plain on CUDA); a last stage's copy of it
  // is laid out the same way.
  const bool one_table = config.tie_word_embeddings && first_stage && last_stage;
  if (spec.embedding != nullptr && config.tie_word_embeddings) {
    return absl::InternalError("a shard whose LM head is its embedding loads its own table (ShardSpec::embedding)");
  }
  WeightLoader load(ckpt, config, backend, arena, report);
  ShardWeights stage;
  stage.layers.resize(end - first);
  for (const WeightDecl& w : tensors) {
    Tensor* slot = Slot(&stage, first, w);
    if (slot == nullptr) {
      return absl::InternalError(absl::StrCat(w.name, ": the forward pass of ", config.architecture_name,
                                              " has no place for this tensor"));
    }
    if (!HoldsAny(w.split, shard, w.expert)) continue;  // another rank's (o_proj's bias: rank 0's; an expert)
    const Slice slice = ShardSlice(w.split, shard);
    if (w.role == WeightRole::kLmHead && config.tie_word_embeddings && first_stage) {
      *slot = stage.embed_tokens;  // tied, and already loaded on this stage (by TiedTable if one_table)
    } else if (w.role == WeightRole::kLmHead && config.tie_word_embeddings) {
      // a later stage's copy of the tied table, laid out as the one table is, so that the LM head
      // multiplies alike in every layout (a bf16 CPU backend's in float32 either way)
      SHARDSERVE_ASSIGN_OR_RETURN(*slot, load.TiedTable(w, slice));
    } else if (w.role == WeightRole::kEmbedTokens && spec.embedding != nullptr) {
      *slot = *spec.embedding;  // another shard's, whose bytes are its own
    } else if (w.role == WeightRole::kEmbedTokens) {
      SHARDSERVE_ASSIGN_OR_RETURN(*slot, one_table ? load.TiedTable(w, slice)
                                                   : load.Plain(w.name, CheckpointShape(w), CheckpointSlice(w, slice)));
    } else if (w.pick.period > 0) {
      const WeightQuant quant = TakesWeightQuant(w) ? spec.weight_quant : WeightQuant::kNone;
      SHARDSERVE_ASSIGN_OR_RETURN(*slot, load.Picked(w, slice, quant));
    } else if (w.stack.period > 0) {
      const WeightQuant quant = TakesWeightQuant(w) ? spec.weight_quant : WeightQuant::kNone;
      SHARDSERVE_ASSIGN_OR_RETURN(*slot, load.Stacked(w, slice, quant));
    } else if (w.role == WeightRole::kRouterBias || w.role == WeightRole::kSinks) {
      SHARDSERVE_ASSIGN_OR_RETURN(*slot, load.Float32(w, slice));
    } else if (IsCheckpointQuantized(config, w) && !IsProductWeight(w.role)) {
      SHARDSERVE_ASSIGN_OR_RETURN(*slot, load.Dequantized(w, slice));
    } else if (config.norm_plus_one && IsNormWeight(w.role)) {
      SHARDSERVE_ASSIGN_OR_RETURN(*slot, load.NormPlusOne(w));
    } else if (IsProductWeight(w.role)) {
      // The decoder layers' products take --quantization (TakesWeightQuant); the LM head and an MoE
      // router stay in the act dtype.
      const WeightQuant quant = TakesWeightQuant(w) ? spec.weight_quant : WeightQuant::kNone;
      SHARDSERVE_ASSIGN_OR_RETURN(*slot, load.Product(w, slice, quant));
    } else {
      SHARDSERVE_ASSIGN_OR_RETURN(*slot, load.Plain(w.name, CheckpointShape(w), CheckpointSlice(w, slice)));
    }
  }
  // The norms a layer has are the ones its norm placement applies (worker/shard/decoder.cc); a
  // sparse layer has its router and all the experts this rank holds (shard.experts), a dense one its
  // MLP.
  const bool sandwich = config.family->norm_placement == FamilyDeclaration::NormPlacement::kSandwich;
  for (size_t i = 0; i < stage.layers.size(); ++i) {
    const LayerWeights& l = stage.layers[i];
    const bool sparse = config.LayerIsSparse(first + static_cast<int64_t>(i));
    bool has_experts = l.router.data != nullptr;
    for (const std::vector<Tensor>* v : {&l.expert_gate_proj, &l.expert_up_proj, &l.expert_down_proj}) {
      for (int64_t e = shard.experts.begin; e < shard.experts.end; ++e) {
        has_experts = has_experts && static_cast<size_t>(e) < v->size() && (*v)[e].data != nullptr;
      }
    }
    if (sparse != has_experts || sparse == (l.gate_proj.data != nullptr)) {
      return absl::InternalError(absl::StrCat(config.architecture_name, " layer ", first + static_cast<int64_t>(i),
                                              " is ", sparse ? "sparse" : "dense", " but its declared tensors ",
                                              sparse ? "lack the router or experts" : "are not a dense MLP's"));
    }
    if ((l.attn_out_norm.data != nullptr) != sandwich || (l.mlp_out_norm.data != nullptr) != sandwich) {
      return absl::InternalError(absl::StrCat(config.architecture_name, " declares ", sandwich ? "sandwich" : "pre-norm",
                                              " layers but its tensors ", sandwich ? "lack" : "include",
                                              " the norms of the blocks' outputs"));
    }
  }
  return stage;
}

std::string QuantizationSummary(const ModelConfig& config, const ShardSpec& spec, const LoadReport& report) {
  if (report.mxfp4_kept > 0 || report.mxfp4_as_fp8 > 0 || report.mxfp4_dequantized > 0) {
    std::string out = absl::StrCat(WeightQuantName(spec.weight_quant), "; MXFP4 experts' products: ", report.mxfp4_kept,
                                   " as mxfp4 (the checkpoint's e2m1 codes and E8M0 scales, 4.25 bits a weight)");
    if (report.mxfp4_as_fp8 > 0) {
      absl::StrAppend(&out, ", ", report.mxfp4_as_fp8,
                      " as fp8 e4m3 with a scale per 32 inputs (the checkpoint's values and scales, exact)");
    }
    absl::StrAppend(&out, ", ", report.mxfp4_dequantized, " dequantized at load");
    if (!report.mxfp4_why_not.empty()) absl::StrAppend(&out, " (not as mxfp4: ", report.mxfp4_why_not, ")");
    return out;
  }
  if (!config.checkpoint_quant.has_value()) return WeightQuantName(spec.weight_quant);
  constexpr std::pair<WeightQuant, const char*> kPaths[] = {
      {WeightQuant::kInt4, "as int4 groups of 128"},
      {WeightQuant::kInt8, "as int8 per output channel"},
      {WeightQuant::kFp8, "as fp8 e4m3 per output channel"}};
  std::string out = absl::StrCat(config.checkpoint_quant->Describe(), ": linear weights");
  bool any = false;
  for (const auto& [kernel, what] : kPaths) {
    if (const int n = report.quant_paths[static_cast<int>(kernel)]; n > 0) {
      absl::StrAppend(&out, any ? ", " : " ", n, " ", what, " (the checkpoint's codes and scales, exact)");
      any = true;
    }
  }
  if (const int n = report.quant_paths[LoadReport::kFp8BlocksPath]; n > 0) {
    const CheckpointQuant& c = *config.checkpoint_quant;
    absl::StrAppend(&out, any ? ", " : " ", n, " as fp8 e4m3 with ", c.block_out, "x", c.block_in,
                    " block scales (the checkpoint's codes and scales, exact)");
    any = true;
  }
  if (const int n = report.quant_paths[static_cast<int>(WeightQuant::kNone)]; n > 0 || !any) {
    absl::StrAppend(&out, any ? ", " : " ", n, " dequantized to float32 at load",
                    report.quant_why_dense.empty() ? "" : absl::StrCat(" (", report.quant_why_dense, ")"),
                    n > 0 ? ", which saves no memory" : "");
  }
  return out;
}

}  // namespace shardserve
