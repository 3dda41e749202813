#include "coordinator/planner/weights.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "kernels/backend.h"
#include "model/families/registry.h"
#include "model/mxfp4.h"
#include "model/quantized_checkpoint.h"

namespace shardserve {
namespace {

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace

absl::StatusOr<std::vector<WeightDecl>> CheckpointWeights(const ModelConfig& config, const Checkpoint& checkpoint) {
  std::vector<WeightDecl> weights = ModelWeights(config);
  const std::string where = checkpoint.dir().string();
  for (WeightDecl& w : weights) {
    if (IsCheckpointQuantized(config, w)) {  // stored in its format's tensors (model/quantized_checkpoint.h)
      const std::vector<int64_t>& shape = CheckpointShape(w);  // a picked part's: the fused tensor's
      absl::Status s = CheckQuantizedLinear(checkpoint, *config.checkpoint_quant, LinearPrefix(w.name), shape[0], shape[1]);
      if (!s.ok()) return absl::FailedPreconditionError(absl::StrCat("checkpoint ", where, ": ", s.message()));
      continue;
    }
    if (IsMxfp4Part(config, w)) {  // gpt-oss's experts as published: MXFP4 codes and scales (model/mxfp4.h)
      for (const auto& [name, shape] : Mxfp4Tensors(w)) {
        absl::StatusOr<const TensorInfo*> t = checkpoint.Find(name);
        if (!t.ok()) {
          return absl::FailedPreconditionError(absl::StrCat("checkpoint ", where, " has no tensor \"", name,
                                                            "\", which config.json's mxfp4 experts need"));
        }
        if ((*t)->shape != shape || (*t)->extra != TensorInfo::Extra::kU8) {
          return absl::FailedPreconditionError(absl::StrCat("checkpoint ", where, ": tensor \"", name, "\" is ",
                                                            (*t)->dtype_name(), " ", ShapeString((*t)->shape),
                                                            "; mxfp4 experts need U8 ", ShapeString(shape)));
        }
      }
      continue;
    }
    auto it = checkpoint.tensors().find(w.name);
    if (it == checkpoint.tensors().end()) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint ", where, " has no tensor \"", w.name,
                                                        "\", which config.json (", config.architecture_name, ", ",
                                                        config.num_hidden_layers, " layers) needs"));
    }
    const TensorInfo& t = it->second;
    if (t.shape != CheckpointShape(w)) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint ", where, ": tensor \"", w.name, "\" has shape ",
                                                        ShapeString(t.shape), " but config.json implies ",
                                                        ShapeString(CheckpointShape(w))));
    }
    if (t.dtype != DType::kF32 && t.dtype != DType::kF16 && t.dtype != DType::kBF16) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint ", where, ": tensor \"", w.name, "\" is stored as ",
                                                        t.dtype_name(), "; the workers load F32, F16 or BF16"));
    }
  }
  if (!config.checkpoint_quant.has_value()) {
    // A bias the declaration does not list would be silently left out of the math (config.json's
    // attention_bias false for a checkpoint that has them): refused, naming it. Published quantized
    // checkpoints are exempt: some store a zero bias beside every quantized product; so are the
    // tensors outside the decoder (a vision tower's, which is not served). The multi-token-prediction
    // layers' own biases (GLM-4.5's attention has them) are declared there (MtpWeights), loaded or not.
    absl::flat_hash_set<std::string> declared;
    for (const WeightDecl& w : weights) declared.insert(w.name);
    for (const WeightDecl& w : MtpWeights(config)) declared.insert(w.name);
    for (const auto& [name, info] : checkpoint.tensors()) {
      if (absl::EndsWith(name, ".bias") && absl::StartsWith(name, config.weight_prefix) && !declared.contains(name)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "checkpoint ", where, " has tensor \"", name, "\", which ", config.architecture_name,
            " as config.json describes it has no place for (is attention_bias in config.json wrong?)"));
      }
    }
  }
  return weights;
}

UnservedBytes UnservedCheckpointBytes(const ModelConfig& config, const Checkpoint& checkpoint, bool mtp_loaded) {
  const std::string layers = absl::StrCat(config.weight_prefix, "layers.");
  const int64_t served_layers = config.num_hidden_layers + (mtp_loaded ? config.num_nextn_predict_layers : 0);
  UnservedBytes bytes;
  for (const auto& [name, info] : checkpoint.tensors()) {
    if (!absl::StartsWith(name, config.weight_prefix)) {
      if (name != config.lm_head_weight) bytes.outside_text_model += info.nbytes;
      continue;
    }
    // "model.layers.61.eh_proj.weight": the layer's index, where the name has one.
    absl::string_view rest(name);
    int64_t layer = 0;
    if (!absl::ConsumePrefix(&rest, layers)) continue;
    const size_t dot = rest.find('.');
    if (dot != absl::string_view::npos && absl::SimpleAtoi(rest.substr(0, dot), &layer) && layer >= served_layers) {
      bytes.after_last_layer += info.nbytes;
    }
  }
  return bytes;
}

int64_t ShardElements(const WeightDecl& t, const TpShard& s) {
  if (!HoldsAny(t.split, s, t.expert)) return 0;
  const Slice cut = ShardSlice(t.split, s);
  int64_t n = 1;
  for (size_t d = 0; d < t.shape.size(); ++d) {
    const bool sliced = t.split != TpSplit::kReplicated && t.split != TpSplit::kFirstRank &&
                        t.split != TpSplit::kExpertFirstRank && static_cast<int>(d) == cut.dim;
    n *= sliced ? cut.end - cut.begin : t.shape[d];
  }
  return n;
}

RankWeights CountRankWeights(const ModelConfig& config, const std::vector<WeightDecl>& tensors, const TpShard& shard,
                             DType dtype, WeightQuant quant, std::optional<DType> products) {
  RankWeights r;
  r.layers.assign(config.num_hidden_layers, 0);
  r.expert_layers.assign(config.num_hidden_layers, 0);
  r.dequant_scratch.assign(config.num_hidden_layers, 0);
  r.layer_staging.assign(config.num_hidden_layers, {});
  r.tied = config.tie_word_embeddings;
  for (const WeightDecl& t : tensors) {
    const int64_t elements = ShardElements(t, shard);
    if (elements == 0) continue;  // another rank's (o_proj's bias; an expert of another rank's block)
    {
      // Loading it on a CPU worker (RankWeights::LoadStaging): what is read in float32, and how.
      const uint64_t slice = static_cast<uint64_t>(elements) * sizeof(float);
      const std::vector<int64_t>& full = CheckpointShape(t);
      int64_t part = elements;  // what is read: the slice, or an expert's whole slab, or whole blocks of rows
      if (t.stack.period > 0 && !full.empty() && full[0] > 0) {
        part = 1;
        for (size_t d = 1; d < full.size(); ++d) part *= full[d];
      } else if (t.pick.period > 0 && t.pick.count > 0) {
        part = elements / t.pick.count * t.pick.period;
      }
      const bool on_host = t.stack.period > 0 || t.pick.period > 0 || IsCheckpointQuantized(config, t);
      const uint64_t in_flight = on_host ? 2 * static_cast<uint64_t>(part) * sizeof(float) + 3 * slice : slice;
      RankWeights::Staging* st = t.part == WeightPart::kLayer       ? &r.layer_staging[t.layer]
                                 : t.part == WeightPart::kEmbedding ? &r.embedding_staging
                                 : t.part == WeightPart::kMtp       ? &r.mtp_staging
                                                                    : &r.lm_head_staging;
      st->in_flight = std::max(st->in_flight, in_flight);
      if (on_host) st->kept = std::max(st->kept, slice);
    }
    uint64_t bytes = static_cast<uint64_t>(elements) * DTypeSize(dtype);
    // DeepSeek-V3's router bias stays float32 (worker/shard/loader.cc)
    // (and gpt-oss's attention sinks)
    if (t.role == WeightRole::kRouterBias || t.role == WeightRole::kSinks) bytes = static_cast<uint64_t>(elements) * sizeof(float);
    // This rank's [rows, cols] of a linear layer's weight (what a quantized layout is counted on).
    const bool cols_cut = t.split != TpSplit::kReplicated && t.split != TpSplit::kFirstRank &&
                          t.split != TpSplit::kExpertFirstRank && ShardSlice(t.split, shard).dim == 1;
    const int64_t rows = t.shape.size() != 2 ? 0 : cols_cut ? t.shape[0] : (t.shape[1] == 0 ? 0 : elements / t.shape[1]);
    const int64_t cols = elements / std::max<int64_t>(rows, 1);
    WeightQuant stored = WeightQuant::kNone;  // how the worker stores it, when quantized
    if (quant != WeightQuant::kNone && TakesWeightQuant(t)) {
      // A linear layer's weight (q/k/v/o, gate/up/down) in its kernels/quant.h layout, per local
      // output row: int8 and fp8 a byte per value and a float32 scale; int4 ceil(local inputs /
      // 128) blocks of 72 bytes (64 bytes of packed values, a float32 scale, the zero point and
      // padding).
      stored = quant;
      bytes = static_cast<uint64_t>(QuantizedWeightBytes(quant, rows, cols));
    }
    if (IsCheckpointQuantized(config, t) && IsProductWeight(t.role) && t.pick.period == 0) {
      // A quantized checkpoint's linear weight, as the worker holds it (model/quantized_checkpoint.h):
      // the int4 / int8 / fp8 kernel's layout (codes, scales and zero points) where the format maps
      // onto one, else dequantized to float32 on the host and held in the workers' dtype as a plain
      // weight (worker/shard/loader.cc: that path saves no memory). MLA's parts picked from
      // q_b_proj / kv_a_proj_with_mqa and its kv_b_proj are dequantized and then held as the plain
      // checkpoint's are (counted above).
      // FP8 block scales: the fp8 kernel's input-group scales, 1 byte a weight and 4 a block's row,
      // unless this rank's inputs start inside a block (CheckpointLinearBytes).
      const int64_t col0 = cols_cut ? ShardSlice(t.split, shard).begin : 0;
      const int64_t held = CheckpointLinearBytes(*config.checkpoint_quant, rows, cols, col0);
      const CheckpointQuant& c = *config.checkpoint_quant;
      stored = held < 0 ? WeightQuant::kNone : c.fp8 ? WeightQuant::kFp8 : CheckpointQuantKernel(c);
      if (held >= 0) bytes = static_cast<uint64_t>(held);
    }
    if (IsMxfp4Part(config, t) && quant == WeightQuant::kNone) {
      // gpt-oss's MXFP4 experts kept as the checkpoint's codes and scales (kernels/quant.h
      // Mxfp4RowsLayout: half a byte a weight and one per block of 32, 4.25 bits), as the CPU and
      // CUDA backends hold them, unless this rank's inputs cut a block (then dequantized, counted
      // above). (A backend without mxfp4 kernels would hold them on the fp8 kernels instead,
      // worker/shard/loader.cc: neither of ours.)
      const int64_t col0 = cols_cut ? ShardSlice(t.split, shard).begin : 0;
      if (col0 % kMxfp4BlockSize == 0 && cols % kMxfp4BlockSize == 0) {
        stored = WeightQuant::kMxfp4;
        bytes = static_cast<uint64_t>(QuantizedWeightBytes(WeightQuant::kMxfp4, rows, cols));
      }
    }
    if (stored == WeightQuant::kNone && products.has_value() && IsProductWeight(t.role)) {
      // Packed for MatMul in the workers' products dtype (the CPU backend's bf16 products). A tied
      // table is the embedding's role, kept in float32 panels (Backend::PackTiedTable).
      bytes = static_cast<uint64_t>(elements) * DTypeSize(*products);
    }
    if (stored != WeightQuant::kNone && rows > 0 && cols > 0) {
      const uint64_t scratch = CudaDequantScratchBytes(rows, cols, dtype);
      if (t.part == WeightPart::kLayer) r.dequant_scratch[t.layer] = std::max(r.dequant_scratch[t.layer], scratch);
      if (t.part == WeightPart::kMtp) r.mtp_dequant_scratch = std::max(r.mtp_dequant_scratch, scratch);
    }
    switch (t.part) {
      case WeightPart::kEmbedding: r.embedding += bytes; break;
      case WeightPart::kLayer:
        r.layers[t.layer] += bytes;
        if (t.role == WeightRole::kExpertGateProj || t.role == WeightRole::kExpertUpProj ||
            t.role == WeightRole::kExpertDownProj) {
          r.expert_layers[t.layer] += bytes;
        }
        break;
      case WeightPart::kFinalNorm: r.final_norm += bytes; break;
      case WeightPart::kLmHead: r.lm_head += bytes; break;
      case WeightPart::kMtp: r.mtp += bytes; break;
    }
  }
  if (r.tied) {
    r.lm_head = r.embedding;  // the last stage's LM head is its own copy of the embedding slice
    r.lm_head_staging.in_flight = std::max(r.lm_head_staging.in_flight, r.embedding_staging.in_flight);
  }
  return r;
}

uint64_t RankWeights::DequantScratch(int64_t first_layer, int64_t end_layer) const {
  uint64_t bytes = 0;
  for (int64_t i = first_layer; i < end_layer; ++i) bytes = std::max(bytes, dequant_scratch[i]);
  return bytes;
}

uint64_t RankWeights::LoadStaging(int64_t first_layer, int64_t end_layer, bool first_stage, bool last_stage) const {
  std::vector<Staging> parts(layer_staging.begin() + first_layer, layer_staging.begin() + end_layer);
  if (first_stage) parts.push_back(embedding_staging);
  if (last_stage) parts.insert(parts.end(), {lm_head_staging, mtp_staging});
  // The loader's staging buffer only grows, and stays until the load ends: at any weight's load it
  // holds at most the largest converted before it.
  uint64_t in_flight = 0, kept = 0;
  for (const Staging& st : parts) {
    in_flight = std::max(in_flight, st.in_flight);
    kept = std::max(kept, st.kept);
  }
  return in_flight + kept;
}

uint64_t RankWeights::StageExperts(int64_t first_layer, int64_t end_layer) const {
  uint64_t bytes = 0;
  for (int64_t i = first_layer; i < end_layer; ++i) bytes += expert_layers[i];
  return bytes;
}

uint64_t RankWeights::Stage(int64_t first_layer, int64_t end_layer, bool first_stage, bool last_stage) const {
  uint64_t bytes = 0;
  for (int64_t i = first_layer; i < end_layer; ++i) bytes += layers[i];
  if (first_stage) bytes += embedding;
  if (last_stage) {
    bytes += final_norm;
    // A tied LM head on the first stage is the embedding already counted (worker/shard/loader.cc shares it).
    if (!(tied && first_stage)) bytes += lm_head;
  }
  return bytes;
}

}  // namespace shardserve
