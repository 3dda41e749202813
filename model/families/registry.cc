#include "model/families/registry.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "model/families/families.h"
#include "model/kv_blocks.h"
#include "model/mxfp4.h"

namespace shardserve {
namespace {

constexpr const FamilyDeclaration* kFamilies[] = {
    &kDeepseekV3Family, &kEagle3LlamaFamily, &kGemma2Family,  &kGemma3Family,  &kGemma3ConditionalFamily,
    &kGlm4MoeFamily,    &kGptOssFamily,      &kLlamaFamily,   &kMistralFamily, &kMixtralFamily,
    &kPhi3Family,       &kQwen2Family,       &kQwen2MoeFamily, &kQwen3Family,  &kQwen3MoeFamily};

}  // namespace

LayerTensors::LayerTensors(const std::string& decoder_prefix, int64_t layer, std::vector<WeightDecl>* out)
    : layer_(layer), prefix_(absl::StrCat(decoder_prefix, "layers.", layer, ".")), out_(out) {}

void LayerTensors::Add(const char* name, std::vector<int64_t> shape, TpSplit split, WeightRole role,
                       std::vector<int64_t> fused_shape, int64_t fused_offset) {
  out_->push_back(
      {prefix_ + name, std::move(shape), WeightPart::kLayer, layer_, split, role, std::move(fused_shape), fused_offset});
}

void LayerTensors::AddPicked(const char* name, std::vector<int64_t> shape, std::vector<int64_t> fused_shape,
                             TpSplit split, WeightRole role, WeightDecl::RowPick pick) {
  Add(name, std::move(shape), split, role, std::move(fused_shape));
  out_->back().pick = pick;
}

void LayerTensors::AddExpert(const char* experts, int64_t expert, const char* name, std::vector<int64_t> shape,
                             TpSplit split, WeightRole role) {
  WeightDecl w{absl::StrCat(prefix_, experts, ".", expert, ".", name), std::move(shape), WeightPart::kLayer, layer_,
               split, role};
  w.expert = expert;
  out_->push_back(std::move(w));
}

void LayerTensors::AddExpertPart(const char* name, int64_t expert, std::vector<int64_t> shape,
                                 std::vector<int64_t> fused_shape, TpSplit split, WeightRole role,
                                 WeightDecl::ExpertStack stack) {
  Add(name, std::move(shape), split, role, std::move(fused_shape));
  out_->back().expert = expert;
  out_->back().stack = stack;
}

std::vector<WeightDecl> DecoderWeights(const ModelConfig& c,
                                       const std::function<void(const ModelConfig&, LayerTensors&)>& layer) {
  const int64_t H = c.hidden_size, V = c.vocab_size;
  std::vector<WeightDecl> w;
  w.push_back({c.weight_prefix + "embed_tokens.weight", {V, H}, WeightPart::kEmbedding, -1, TpSplit::kVocabRows,
               WeightRole::kEmbedTokens});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    LayerTensors tensors(c.weight_prefix, i, &w);
    layer(c, tensors);
  }
  w.push_back({c.weight_prefix + "norm.weight", {H}, WeightPart::kFinalNorm, -1, TpSplit::kReplicated, WeightRole::kFinalNorm});
  if (!c.tie_word_embeddings) {
    w.push_back({c.lm_head_weight, {V, H}, WeightPart::kLmHead, -1, TpSplit::kVocabRows, WeightRole::kLmHead});
  }
  return w;
}

bool IsProductWeight(WeightRole role) {
  switch (role) {
    case WeightRole::kQProj:
    case WeightRole::kKProj:
    case WeightRole::kVProj:
    case WeightRole::kOProj:
    case WeightRole::kGateProj:
    case WeightRole::kUpProj:
    case WeightRole::kDownProj:
    case WeightRole::kRouter:
    case WeightRole::kExpertGateProj:
    case WeightRole::kExpertUpProj:
    case WeightRole::kExpertDownProj:
    case WeightRole::kSharedGateProj:
    case WeightRole::kSharedUpProj:
    case WeightRole::kSharedDownProj:
    case WeightRole::kSharedExpertGate:
    case WeightRole::kQAProj:
    case WeightRole::kQNopeProj:
    case WeightRole::kQPeProj:
    case WeightRole::kKvAProj:
    case WeightRole::kKPeProj:
    case WeightRole::kLmHead:
    case WeightRole::kMtpEhProj:
    case WeightRole::kEagle3Fc:
      return true;
    default:
      return false;
  }
}

bool TakesWeightQuant(const WeightDecl& w) {
  // (a multi-token-prediction layer's decoder block as any layer's; its eh_proj and head plain)
  const bool layer = w.part == WeightPart::kLayer ||
                     (w.part == WeightPart::kMtp && w.role != WeightRole::kLmHead && w.role != WeightRole::kMtpEhProj);
  return layer && IsProductWeight(w.role) && w.role != WeightRole::kRouter && w.role != WeightRole::kSharedExpertGate;
}

std::string LinearPrefix(const std::string& name) {
  return name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0 ? name.substr(0, name.size() - 7) : name;
}

bool IsCheckpointQuantized(const ModelConfig& config, const WeightDecl& w) {
  return config.checkpoint_quant.has_value() && (TakesWeightQuant(w) || ((w.part == WeightPart::kLayer || w.part == WeightPart::kMtp) && w.role == WeightRole::kKvBProj)) &&
         config.checkpoint_quant->Quantizes(LinearPrefix(w.name));
}

bool IsNormWeight(WeightRole role) {
  switch (role) {
    case WeightRole::kInputNorm:
    case WeightRole::kQNorm:
    case WeightRole::kKNorm:
    case WeightRole::kAttnOutNorm:
    case WeightRole::kPreMlpNorm:
    case WeightRole::kMlpOutNorm:
    case WeightRole::kQANorm:
    case WeightRole::kKvANorm:
    case WeightRole::kFinalNorm:
    case WeightRole::kMtpENorm:
    case WeightRole::kMtpHNorm:
      return true;
    default:
      return false;
  }
}

const FamilyDeclaration* FindFamily(std::string_view architecture) {
  for (const FamilyDeclaration* f : kFamilies) {
    if (architecture == f->architecture) return f;
  }
  return nullptr;
}

std::string SupportedArchitectures() {
  return absl::StrJoin(kFamilies, ", ",
                       [](std::string* out, const FamilyDeclaration* f) { out->append(f->architecture); });
}

std::vector<WeightDecl> ModelWeights(const ModelConfig& config) {
  if (config.family == nullptr) return {};
  return config.family->weights(config);
}

std::vector<WeightDecl> MtpWeights(const ModelConfig& config) {
  if (config.family == nullptr || config.family->mtp_weights == nullptr || config.num_nextn_predict_layers <= 0) return {};
  return config.family->mtp_weights(config);
}

bool IsMxfp4Part(const ModelConfig& config, const WeightDecl& w) {
  return config.mxfp4_experts && w.stack.period > 0 && IsProductWeight(w.role);
}

std::vector<std::pair<std::string, std::vector<int64_t>>> Mxfp4Tensors(const WeightDecl& w) {
  const std::vector<int64_t>& f = w.fused_shape;  // [E, in, out] transposed, else [E, out, in]
  if (f.size() != 3) return {};
  const int64_t out = w.stack.transposed ? f[2] : f[1], in = w.stack.transposed ? f[1] : f[2];
  return {{w.name + "_blocks", {f[0], out, in / kMxfp4BlockSize, kMxfp4BlockBytes}},
          {w.name + "_scales", {f[0], out, in / kMxfp4BlockSize}}};
}

int64_t ActiveParameterCount(const ModelConfig& config) {
  int64_t n = 0;
  for (const WeightDecl& w : ModelWeights(config)) {
    if (w.expert >= config.num_experts_per_tok) continue;  // k experts' worth of each sparse layer
    int64_t elements = 1;
    for (int64_t d : w.shape) elements *= d;
    n += elements;
  }
  return n;
}

std::vector<WeightDecl> StageWeights(const ModelConfig& config, int64_t first_layer, int64_t end_layer,
                                     bool first_stage, bool last_stage) {
  std::vector<WeightDecl> stage;
  std::optional<WeightDecl> tied_head;
  for (WeightDecl& w : ModelWeights(config)) {
    switch (w.part) {
      case WeightPart::kEmbedding:
        if (last_stage && config.tie_word_embeddings) {
          tied_head = w;
          tied_head->part = WeightPart::kLmHead;
          tied_head->role = WeightRole::kLmHead;
        }
        if (first_stage) stage.push_back(std::move(w));
        break;
      case WeightPart::kLayer:
        if (w.layer >= first_layer && w.layer < end_layer) stage.push_back(std::move(w));
        break;
      case WeightPart::kFinalNorm:
      case WeightPart::kLmHead:
        if (last_stage) stage.push_back(std::move(w));
        break;
      case WeightPart::kMtp:
        break;  // MtpWeights'
    }
  }
  if (tied_head.has_value()) stage.push_back(std::move(*tied_head));
  return stage;
}

std::vector<StepBufferDecl> StepBuffers(const ModelConfig& config, const TpShard& shard, DType act,
                                        const StepLimits& limits, bool last_stage) {
  const int64_t n = limits.max_tokens_per_step, m = limits.max_seqs_per_step, H = config.hidden_size;
  std::vector<StepBufferDecl> b = {
      {"ids", DType::kI32, {n}},          {"positions", DType::kI32, {n}},
      {"token_seq", DType::kI32, {n}},    {"slots", DType::kI32, {n}},
      {"block_tables", DType::kI32, {m, limits.max_blocks_per_seq()}},
      {"logit_rows", DType::kI32, {m}},   {"hidden", act, {n, H}},
      {"normed", act, {n, H}},
  };
  // The sliding layers' own slots and tables, for a model whose sliding layers have a pool of their
  // own (model/kv_blocks.h SlidingPoolWindow; read only when num_sliding_kv_blocks > 0).
  if (SlidingPoolWindow(config) > 0) {
    b.push_back({"sliding_slots", DType::kI32, {n}});
    b.push_back({"sliding_block_tables", DType::kI32, {m, limits.max_blocks_per_seq()}});
  }
  if (config.family != nullptr) {
    for (StepBufferDecl& d : config.family->layer_buffers(config, shard, act, n)) b.push_back(std::move(d));
  }
  if (last_stage) {
    const int64_t w = shard.vocab_rows_per_rank;
    b.push_back({"last", act, {m, H}});
    b.push_back({"local_logits", DType::kF32, {m, w}});
    // With one rank the slice is gathered straight into the logits.
    if (shard.tp_size > 1) b.push_back({"gathered_logits", DType::kF32, {shard.tp_size, m, w}});
    b.push_back({"logits", DType::kF32, {m, config.vocab_size}});
  }
  return b;
}

std::vector<StepBufferDecl> HeadStepBuffers(const ModelConfig& config, DType act, const StepLimits& limits) {
  const int64_t n = limits.max_tokens_per_step, H = config.hidden_size;
  return {{"head_pairs", act, {2 * n + 1, H}}, {"head_cat", act, {n, 2 * H}}, {"head_cat_rows", DType::kI32, {2 * n}}};
}

StepLimits HeadStepLimits(const StepLimits& model) {
  StepLimits d = DraftStepLimits(model);
  d.max_tokens_per_step = model.max_tokens_per_step + model.max_seqs_per_step;
  return d;
}

std::vector<StepBufferDecl> HeadRunnerBuffers(const ModelConfig& config, DType act, const StepLimits& model) {
  const int64_t m = model.max_seqs_per_step, H = config.hidden_size;
  return {{"head_table", act, {m + model.max_tokens_per_step, H}},
          {"head_src_rows", DType::kI32, {HeadStepLimits(model).max_tokens_per_step}},
          {"head_ids", DType::kI32, {m}}};
}

std::vector<StepBufferDecl> Eagle3StepBuffers(const ModelConfig& config, DType act, const StepLimits& limits) {
  if (!config.eagle3.has_value()) return {};
  const int64_t n = limits.max_tokens_per_step;
  const int64_t a = config.eagle3->num_aux();
  return {{"eagle3_cat", act, {n, a * config.eagle3->target_hidden_size}}, {"eagle3_cat_rows", DType::kI32, {a * n}}};
}

std::vector<StepBufferDecl> AuxHiddenBuffers(const ModelConfig& config, int64_t aux_layers, DType act,
                                             const StepLimits& limits) {
  if (aux_layers == 0) return {};
  return {{"aux_hidden", act, {aux_layers * limits.max_tokens_per_step, config.hidden_size}}};
}

}  // namespace shardserve
