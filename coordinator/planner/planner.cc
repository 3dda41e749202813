#include "coordinator/planner/planner.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "coordinator/planner/format.h"
#include "coordinator/planner/memory.h"
#include "coordinator/planner/weights.h"
#include "kernels/backend.h"
#include "model/families/registry.h"
#include "model/kv_blocks.h"
#include "model/quantized_checkpoint.h"
#include "model/sharding.h"

namespace shardserve {
namespace {

namespace fmt = planner_format;

// When max_model_len is not set and no layout holds max_position_embeddings tokens, the plan
// lowers it to what the KV cache holds, but not below this: a shorter context is not worth serving.
constexpr int64_t kMinLoweredModelLen = 2048;

// Beyond these a config.json is not a model but a typo: products of its sizes could overflow 64
// bits, or the layouts to weigh would not fit in memory. (The largest published dense models have
// under 1e12 parameters and 128 layers.)
constexpr double kMaxParameters = 1e15;
constexpr int64_t kMaxLayers = 1024;

// How well a layout fits: it holds the target sequence length, holds only a lowered one (when the
// length was not set), or does not fit.
enum class Tier { kFull = 0, kLowered = 1, kNone = 2 };

// Everything one MakePlan call shares across the layouts it weighs.
struct Context {
  const ModelConfig& config;
  const ClusterSpec& cluster;
  const PlanOptions& options;
  DType dtype;
  uint64_t usable;     // bytes per GPU the worker may use
  int64_t target_len;  // max_model_len wanted
  int64_t min_len;     // the shortest max_model_len accepted (== target_len when it was set)
  std::vector<WeightDecl> tensors;
  // A draft model (PlanOptions::draft) on the last stage's TP rank 0: GpuPlan::draft_bytes and
  // draft_kv_bytes_per_token there.
  uint64_t draft_bytes = 0;
  uint64_t draft_kv_bytes_per_token = 0;
  // A head (PlanOptions::mtp or eagle3) on the same worker: GpuPlan::head_weight_bytes there, and its
  // largest quantized weight's dequantize scratch on CUDA.
  uint64_t head_weight_bytes = 0;
  uint64_t head_dequant_scratch = 0;
  // Of those, an EAGLE-3 head's copy of the model's embedding, which a worker that holds the model's
  // table whole shares instead (Eagle3SharesEmbedding); 0 where the head has its own.
  uint64_t head_shared_embedding_bytes = 0;
};

// One layout, evaluated.
struct Layout {
  int tp = 1, pp = 1;
  std::vector<StagePlan> stages;
  std::vector<GpuPlan> gpus;
  DecodeEstimate decode;
  int64_t kv_blocks = 0;  // the smallest GPU's
  Tier tier = Tier::kNone;
  int64_t max_model_len = 0;
  int64_t shortfall = 0;  // the largest GPU's
  int worst_gpu = 0;      // index into gpus of that GPU
};

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// TP groups of `tp` GPUs the cluster holds: a group never spans nodes.
int StageSlots(const ClusterSpec& c, int tp) {
  int slots = 0;
  for (int g : c.gpus_per_node) slots += g / tp;
  return slots;
}

// The TP sizes that divide the model's heads (model/sharding.h), cut no quantization group
// (CheckQuantizedShard) and fit in the largest node.
std::vector<int> ValidTpSizes(const ModelConfig& config, const ClusterSpec& cluster, WeightQuant quant,
                              bool expert_parallel) {
  std::vector<int> sizes;
  for (int t = 1; t <= cluster.max_gpus_per_node(); ++t) {
    if (CheckTpDivides(config, t, expert_parallel).ok() && CheckQuantizedShard(config, t, quant, expert_parallel).ok()) {
      sizes.push_back(t);
    }
  }
  return sizes;
}

// Layers per stage, balanced by weight bytes. Every layer has the same shapes, so a stage's bytes
// are first/last extras + layers x layer_bytes: the embedding (first stage) and the final norm and
// LM head (last stage) are the extras.
//
// Rule: start from an even split of the layer count (the remainder to the later stages), then
// move one layer at a time from the heaviest stage to the lightest while that lowers the heavier
// of the two, never below one layer per stage. Each move lowers the sum of squared loads, so it
// ends; when it ends no layout has a lower maximum (the heaviest stage could only shed a layer to
// a stage that would then be at least as heavy). An extra smaller than a layer therefore moves
// nothing: Qwen2.5-72B on PP=2 is 40 + 40 (its embedding and LM head are 1.4 layers each, one at
// each end), and on PP=3 it is 26 + 28 + 26.
std::vector<int64_t> BalanceLayers(int64_t layers, int pp, uint64_t layer_bytes, uint64_t first_extra,
                                   uint64_t last_extra) {
  std::vector<int64_t> count(pp, layers / pp);
  for (int64_t i = 0; i < layers % pp; ++i) count[pp - 1 - i] += 1;
  auto load = [&](int s) {
    return (s == 0 ? first_extra : 0) + (s == pp - 1 ? last_extra : 0) + static_cast<uint64_t>(count[s]) * layer_bytes;
  };
  for (;;) {
    int heavy = 0, light = 0;
    for (int s = 1; s < pp; ++s) {
      if (load(s) > load(heavy)) heavy = s;
      if (load(s) < load(light)) light = s;
    }
    if (count[heavy] <= 1 || load(light) + layer_bytes >= load(heavy)) break;
    --count[heavy];
    ++count[light];
  }
  return count;
}

// The options' step limits serving sequences of `len` tokens.
StepLimits ServedLimits(const Context& ctx, int64_t len) {
  StepLimits limits = ctx.options.limits;
  limits.max_model_len = len;
  return limits;
}

// The KV cache device `g` needs for one sequence of the shortest max_model_len accepted.
uint64_t NeedKvBytes(const Context& ctx, const GpuPlan& g) {
  const int64_t blocks = CeilDiv(ctx.min_len, ctx.options.limits.block_size);
  return GpuKvBytes(g, blocks, PlannedSlidingBlocks(ctx.config, ctx.options.limits, blocks, ctx.min_len),
                    ctx.options.limits.block_size) +
         DraftKvBytes(g, ServedLimits(ctx, ctx.min_len), blocks);
}

// A draft model's bytes (PlanOptions::draft) as the worker that samples allocates them
// (worker/step_executor.cc ShardDraftModel): its whole weights and step buffers in ctx.dtype within
// DraftStepLimits, and its KV bytes per token (its blocks follow the model's: DraftKvBytes).
absl::Status CountDraft(Context* ctx) {
  const ModelConfig& d = *ctx->options.draft;
  if (d.eagle3.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat("the draft model is an EAGLE-3 head (", d.architecture_name,
                                                   "): plan it as one (--speculative eagle3), not as a draft model"));
  }
  if (d.vocab_size != ctx->config.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("the draft model has a vocabulary of ", d.vocab_size,
                                                   " ids but the model has ", ctx->config.vocab_size,
                                                   "; a draft must share the model's tokenizer and vocabulary"));
  }
  absl::StatusOr<TpShard> whole = ComputeTpShard(d, 0, 1);
  if (!whole.ok()) return whole.status();
  const StepLimits limits = DraftStepLimits(ServedLimits(*ctx, ctx->target_len));
  // Every layer's K and V in the one pool (a draft's sliding layers read their window through it).
  const uint64_t per_token = static_cast<uint64_t>(d.num_hidden_layers) *
                             static_cast<uint64_t>(d.KvValuesPerToken(whole->kv_heads)) * DTypeSize(ctx->dtype);
  ctx->draft_kv_bytes_per_token = per_token;
  ctx->draft_bytes =
      CountRankWeights(d, ModelWeights(d), *whole, ctx->dtype, WeightQuant::kNone, ctx->options.products_dtype)
          .Stage(0, d.num_hidden_layers, true, true) +
      StepBufferBytes(d, *whole, ctx->dtype, limits, /*last_stage=*/true);
  return absl::OkStatus();
}

// The model's multi-token-prediction layer (PlanOptions::mtp) as the worker that samples loads it
// (worker/head_runner.h HeadRunner::Load): its first layer's tensors whole (one TP rank of one), in
// ctx.dtype, linear weights as options.weight_quant or in the checkpoint's format. It is planned as a
// draft model is: its weights and buffers (memory.h HeadBytes) a fixed amount there, its KV
// cache one layer's latent row a token of DraftStepLimits' pool, which follows the model's blocks.
absl::Status CountMtp(Context* ctx) {
  const ModelConfig& c = ctx->config;
  if (ctx->options.draft.has_value()) {
    return absl::InvalidArgumentError(
        "a draft model and the multi-token-prediction layer are two ways of speculative decoding and a server "
        "runs one (--speculative draft or mtp): plan with one of them");
  }
  std::vector<WeightDecl> tensors;
  for (WeightDecl& w : MtpWeights(c)) {
    if (w.layer == c.num_hidden_layers) tensors.push_back(std::move(w));  // of several, the first runs
  }
  if (tensors.empty()) {
    const bool declared = c.family != nullptr && c.family->mtp_weights != nullptr;
    return absl::InvalidArgumentError(absl::StrCat(
        "--speculative mtp needs the model's multi-token-prediction layer, but ", c.architecture_name,
        declared ? absl::StrCat(" as config.json describes it has none (num_nextn_predict_layers ",
                                c.num_nextn_predict_layers, ")")
                 : " has no such layer in this server (only DeepSeek-V3's family declares one)",
        "; plan with --draft-model or without speculative decoding"));
  }
  absl::StatusOr<TpShard> whole = ComputeTpShard(c, 0, 1);
  if (!whole.ok()) return whole.status();
  const RankWeights w =
      CountRankWeights(c, tensors, *whole, ctx->dtype, ctx->options.weight_quant, ctx->options.products_dtype);
  ctx->head_weight_bytes = w.mtp;
  ctx->head_dequant_scratch = w.mtp_dequant_scratch;
  GpuPlan sampler;
  sampler.head_weight_bytes = w.mtp;
  const HeadMemory m = HeadBytes(c, sampler, ctx->dtype, ServedLimits(*ctx, ctx->target_len));
  ctx->draft_bytes = m.weights + m.buffers;
  ctx->draft_kv_bytes_per_token = static_cast<uint64_t>(c.KvValuesPerToken(whole->kv_heads)) * DTypeSize(ctx->dtype);
  return absl::OkStatus();
}

// An EAGLE-3 head (PlanOptions::eagle3) as the worker that samples loads it (worker/head_runner.h
// HeadRunner::LoadEagle3): its tensors whole (one TP rank of one), in ctx.dtype, linear weights as
// options.weight_quant, the model's embedding copied in where the head has none (and the worker does
// not hold the model's table whole, to share: Context::head_shared_embedding_bytes). It is planned as the
// MTP layer is: its weights and buffers (memory.h HeadBytes) a fixed amount there, its KV cache one
// layer's K and V a token of DraftStepLimits' pool. The hidden states every worker keeps for it are
// in each one's step buffers (ActivationBytes).
absl::Status CountEagle3(Context* ctx) {
  const ModelConfig& head = *ctx->options.eagle3;
  if (ctx->options.draft.has_value() || ctx->options.mtp) {
    return absl::InvalidArgumentError(absl::StrCat(
        "an EAGLE-3 head and ", ctx->options.mtp ? "the multi-token-prediction layer" : "a draft model",
        " are two ways of speculative decoding and a server runs one: plan with one of them"));
  }
  if (!head.eagle3.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat("--speculative eagle3 takes an EAGLE-3 head (LlamaForCausalLMEagle3); ",
                                                   "this config.json's architecture is ", head.architecture_name));
  }
  absl::StatusOr<std::vector<int64_t>> aux = Eagle3AuxLayers(head, ctx->config);
  if (!aux.ok()) return aux.status();
  absl::StatusOr<TpShard> whole = ComputeTpShard(head, 0, 1);
  if (!whole.ok()) return whole.status();
  const RankWeights w = CountRankWeights(head, ModelWeights(head), *whole, ctx->dtype, ctx->options.weight_quant,
                                         ctx->options.products_dtype);
  ctx->head_weight_bytes = w.Stage(0, head.num_hidden_layers, true, true);
  ctx->head_dequant_scratch = w.DequantScratch(0, head.num_hidden_layers);
  ctx->head_shared_embedding_bytes = Eagle3SharesEmbedding(head, /*whole_table=*/true) ? w.embedding : 0;
  GpuPlan sampler;
  sampler.head_weight_bytes = ctx->head_weight_bytes;
  const HeadMemory m = HeadBytes(head, sampler, ctx->dtype, ServedLimits(*ctx, ctx->target_len));
  ctx->draft_bytes = m.weights + m.buffers;
  ctx->draft_kv_bytes_per_token =
      static_cast<uint64_t>(head.KvValuesPerToken(whole->kv_heads)) * DTypeSize(ctx->dtype);
  return absl::OkStatus();
}

// Tokens of the model's KV cache device `g` holds in `free` bytes (its sliding pool and a draft's
// blocks beside them: memory.h MostKvBlocks), at most `most_blocks` blocks where those count.
int64_t KvCacheTokens(const Context& ctx, const GpuPlan& g, int64_t free, int64_t most_blocks) {
  if (g.sliding_kv_bytes_per_token == 0 && g.draft_kv_bytes_per_token == 0) {
    return free > 0 ? free / static_cast<int64_t>(g.kv_bytes_per_token) : 0;
  }
  return MostKvBlocks(ctx.config, g, ctx.options.limits, ctx.target_len, free, most_blocks) *
         ctx.options.limits.block_size;
}

// The worker's step buffers (memory.h StepBufferBytes), with the block table sized for the target
// length, an upper bound on the one the workers get.
uint64_t ActivationBytes(const Context& ctx, const TpShard& s, bool last_stage) {
  StepLimits limits = ctx.options.limits;
  limits.num_kv_blocks = 0;
  limits.max_model_len = ctx.target_len;
  return StepBufferBytes(ctx.config, s, ctx.dtype, limits, last_stage, AuxLayers(ctx.options));
}

// Assigns stage s to the s-th TP group slot: nodes in order, groups packed from GPU 0, so
// consecutive stages share a node whenever they can (their hop then stays on NVLink).
void PlaceStages(const ClusterSpec& cluster, int tp, std::vector<StagePlan>* stages) {
  size_t s = 0;
  for (int node = 0; node < cluster.nodes() && s < stages->size(); ++node) {
    for (int slot = 0; slot < cluster.gpus_per_node[node] / tp && s < stages->size(); ++slot, ++s) {
      (*stages)[s].node = node;
      (*stages)[s].first_gpu = slot * tp;
    }
  }
}

// Roofline of one decode step of `batch` sequences through every stage in turn (planner.h
// DecodeEstimate). Memory-bound: a GPU reads every weight byte it holds once a step, but of a
// sparse layer's experts only the fraction its tokens choose. A ring all-reduce of M bytes over t
// GPUs moves 2 (t-1)/t x M per GPU; the logits all-gather moves (t-1) slices of F32 logits; a stage
// hands its hidden states (M bytes) to the next over NVLink or, between nodes, the NIC. With expert
// parallelism each rank routes its 1/t of the tokens and sends each token's hidden state to the
// ranks of its k experts, (t-1)/t of them elsewhere, and gets the results back the same way, then
// one all-gather gives every rank every token. Each collective or message also pays the link's
// fixed latency, which is what dominates at batch 1.
DecodeEstimate EstimateDecode(const Context& ctx, const Layout& l) {
  const ClusterSpec& c = ctx.cluster;
  const ModelConfig& config = ctx.config;
  const int batch = ctx.options.decode_batch;
  const double M = static_cast<double>(batch) * static_cast<double>(config.hidden_size * DTypeSize(ctx.dtype));
  const int t = l.tp;
  DecodeEstimate e;
  e.batch = batch;
  double expert_fraction = 1;  // of the experts' bytes, what a step reads
  if (config.num_experts > 0) {
    const double k = static_cast<double>(config.num_experts_per_tok), E = static_cast<double>(config.num_experts);
    expert_fraction = 1.0 - std::pow(1.0 - k / E, batch);
    e.experts = config.num_experts;
    e.experts_read = E * expert_fraction;
  }
  for (size_t s = 0; s < l.stages.size(); ++s) {
    const StagePlan& st = l.stages[s];
    double max_read = 0;
    for (int r = 0; r < t; ++r) {
      const GpuPlan& g = l.gpus[s * t + r];
      max_read = std::max(max_read, static_cast<double>(g.weight_bytes - g.expert_weight_bytes) +
                                        expert_fraction * static_cast<double>(g.expert_weight_bytes));
    }
    e.weights_s += max_read / c.gpu.hbm_bytes_per_s;
    if (t > 1) {
      const double all_reduce = c.intra_node_latency_s + 2.0 * (t - 1) / t * M / c.intra_node_bytes_per_s;
      int64_t sparse = 0;
      for (int64_t i = st.first_layer; i <= st.last_layer; ++i) sparse += config.LayerIsSparse(i) ? 1 : 0;
      const int64_t exchanged = ctx.options.expert_parallel ? sparse : 0;  // MLPs without an all-reduce
      const int64_t count = 2 * st.num_layers() - exchanged + (st.embedding ? 1 : 0);  // o_proj, down_proj; embedding
      e.collectives_s += static_cast<double>(count) * all_reduce;
      if (exchanged > 0) {
        const double k = static_cast<double>(config.num_experts_per_tok);
        const double all_to_all = c.intra_node_latency_s + k * M / t * (t - 1) / t / c.intra_node_bytes_per_s;
        const double all_gather = c.intra_node_latency_s + (t - 1.0) / t * M / c.intra_node_bytes_per_s;
        e.collectives_s += static_cast<double>(exchanged) * (2 * all_to_all + all_gather);
      }
      if (st.lm_head) {
        const double slice = 4.0 * static_cast<double>(batch) * static_cast<double>(CeilDiv(config.vocab_size, t));
        e.collectives_s += c.intra_node_latency_s + (t - 1) * slice / c.intra_node_bytes_per_s;
      }
    }
    if (s + 1 < l.stages.size()) {
      const bool same_node = l.stages[s + 1].node == st.node;
      e.transfers_s += same_node ? c.intra_node_latency_s + M / c.intra_node_bytes_per_s
                                 : c.inter_node_latency_s + M / c.inter_node_bytes_per_s;
    }
  }
  return e;
}

// Lays the model out as TP = tp, PP = pp (both valid for the model and the cluster) and measures
// every GPU's memory.
Layout Evaluate(const Context& ctx, const std::vector<RankWeights>& ranks, const std::vector<TpShard>& shards, int tp,
                int pp) {
  const ModelConfig& c = ctx.config;
  const int64_t block = ctx.options.limits.block_size;
  Layout l;
  l.tp = tp;
  l.pp = pp;

  // Stages, balanced on rank 0 (it holds the widest vocab slice; layers are alike on every rank).
  const RankWeights& r0 = ranks[0];
  std::vector<int64_t> counts =
      BalanceLayers(c.num_hidden_layers, pp, r0.layers[0], r0.embedding, r0.final_norm + r0.lm_head);
  int64_t next = 0;
  for (int s = 0; s < pp; ++s) {
    StagePlan st;
    st.first_layer = next;
    st.last_layer = next + counts[s] - 1;
    st.embedding = s == 0;
    st.lm_head = s == pp - 1;
    next += counts[s];
    l.stages.push_back(st);
  }
  PlaceStages(ctx.cluster, tp, &l.stages);

  // Per GPU: weights, step buffers and reserve first; the KV cache takes what is left: the
  // full-attention layers' pool and, where the sliding layers have one of their own (Gemma 2 and 3),
  // theirs, sized for as many target_len sequences (memory.h MostKvBlocks).
  const int64_t most_blocks = kMaxKvCacheTokens / block;  // cache slots are I32
  l.kv_blocks = most_blocks;
  l.shortfall = INT64_MIN;
  for (int s = 0; s < pp; ++s) {
    const StagePlan& st = l.stages[s];
    for (int r = 0; r < tp; ++r) {
      GpuPlan g;
      g.stage = s;
      g.tp_rank = r;
      g.node = st.node;
      g.gpu = st.first_gpu + r;
      g.weight_bytes = ranks[r].Stage(st.first_layer, st.last_layer + 1, st.embedding, st.lm_head);
      g.expert_weight_bytes = ranks[r].StageExperts(st.first_layer, st.last_layer + 1);
      g.activation_bytes = ActivationBytes(ctx, shards[r], st.lm_head);
      g.reserve_bytes = ctx.options.runtime_reserve_bytes;
      const bool sampler = st.lm_head && r == 0;
      if (sampler) {  // the worker that samples runs the draft or the head
        // (a head shares the model's embedding where this worker holds it whole)
        const uint64_t shared = st.embedding && tp == 1 ? ctx.head_shared_embedding_bytes : 0;
        g.draft_bytes = ctx.draft_bytes - shared;
        g.draft_kv_bytes_per_token = ctx.draft_kv_bytes_per_token;
        g.head_weight_bytes = ctx.head_weight_bytes - shared;
      }
      if (!ctx.cluster.gpu.is_cpu()) {
        // (the backend grows one scratch for the largest quantized weight, the layer's included)
        g.dequant_scratch_bytes = std::max(ranks[r].DequantScratch(st.first_layer, st.last_layer + 1),
                                           sampler ? ctx.head_dequant_scratch : 0);
      } else {
        g.load_staging_bytes = ranks[r].LoadStaging(st.first_layer, st.last_layer + 1, st.embedding, st.lm_head);
        g.reserve_bytes += g.load_staging_bytes;
      }
      int64_t sliding_layers = 0;
      for (int64_t i = st.first_layer; i <= st.last_layer; ++i) sliding_layers += InSlidingPool(c, i) ? 1 : 0;
      const uint64_t per_layer = c.KvValuesPerToken(shards[r].kv_heads) * DTypeSize(ctx.dtype);
      g.kv_bytes_per_token = (st.num_layers() - sliding_layers) * per_layer;
      g.sliding_kv_bytes_per_token = sliding_layers * per_layer;
      // (a draft model's or the multi-token-prediction layer's weights and buffers in draft_bytes, its
      // cache per token beside the model's: KvCacheTokens)
      const int64_t fixed = static_cast<int64_t>(g.weight_bytes + g.activation_bytes + g.reserve_bytes + g.draft_bytes);
      g.kv_cache_tokens = KvCacheTokens(ctx, g, static_cast<int64_t>(ctx.usable) - fixed, most_blocks);
      g.shortfall_bytes = fixed + static_cast<int64_t>(NeedKvBytes(ctx, g)) - static_cast<int64_t>(ctx.usable);
      l.kv_blocks = std::min(l.kv_blocks, g.kv_cache_tokens / block);
      if (g.shortfall_bytes > l.shortfall) {
        l.shortfall = g.shortfall_bytes;
        l.worst_gpu = static_cast<int>(l.gpus.size());
      }
      l.gpus.push_back(g);
    }
  }
  const int64_t capacity = l.kv_blocks * block;
  if (capacity >= ctx.target_len) {
    l.tier = Tier::kFull;
    l.max_model_len = ctx.target_len;
  } else if (capacity >= ctx.min_len) {
    l.tier = Tier::kLowered;
    l.max_model_len = capacity;
  } else {
    l.tier = Tier::kNone;
    l.max_model_len = ctx.target_len;
  }
  l.decode = EstimateDecode(ctx, l);
  return l;
}

// Orders layouts best first: those holding the target length, then those holding a lowered one,
// each by estimated decode step (ties: fewer GPUs, then the larger TP); then those that do not
// fit, closest first.
bool Better(const Layout& a, const Layout& b) {
  if (a.tier != b.tier) return a.tier < b.tier;
  if (a.tier == Tier::kNone) {
    return std::tuple(a.shortfall, a.tp * a.pp, -a.tp) < std::tuple(b.shortfall, b.tp * b.pp, -b.tp);
  }
  return std::tuple(a.decode.total_s(), a.tp * a.pp, -a.tp) < std::tuple(b.decode.total_s(), b.tp * b.pp, -b.tp);
}

// "node 0 GPU 1", or "node 0 CPU worker 1".
std::string GpuName(const GpuSpec& gpu, const GpuPlan& g) {
  return absl::StrCat("node ", g.node, " ", gpu.device_noun(), " ", g.gpu);
}

LayoutOption Summarize(const Context& ctx, const Layout& l) {
  LayoutOption o;
  o.tp = l.tp;
  o.pp = l.pp;
  o.fits = l.tier != Tier::kNone;
  o.max_model_len = o.fits ? l.max_model_len : 0;
  o.kv_cache_tokens = l.kv_blocks * ctx.options.limits.block_size;
  for (const GpuPlan& g : l.gpus) o.max_weight_bytes = std::max(o.max_weight_bytes, g.weight_bytes);
  o.shortfall_bytes = o.fits ? 0 : l.shortfall;
  o.decode_step_s = l.decode.total_s();
  switch (l.tier) {
    case Tier::kFull: o.note = "fits"; break;
    case Tier::kLowered: o.note = absl::StrCat("fits with max_model_len ", fmt::Count(l.max_model_len)); break;
    case Tier::kNone:
      o.note = absl::StrCat("short by ", fmt::Size(l.shortfall), " on ", GpuName(ctx.cluster.gpu, l.gpus[l.worst_gpu]));
      break;
  }
  return o;
}

// Why the chosen layout, for a plan that fits.
std::string FitReason(const Context& ctx, const Layout& chosen, const std::vector<const Layout*>& fitting,
                      bool forced) {
  std::string why = absl::StrCat(fmt::Layout(chosen.tp, chosen.pp), " on ", ctx.cluster.gpu.Count(chosen.tp * chosen.pp),
                                 " fits with KV cache for ",
                                 fmt::Count(chosen.kv_blocks * ctx.options.limits.block_size), " tokens");
  // What the layouts it was chosen among have in common.
  const bool full = chosen.tier == Tier::kFull;
  const std::string sequence = absl::StrCat(" a ", fmt::Count(ctx.target_len), "-token sequence");
  if (forced) {
    absl::StrAppend(&why, " (layout forced)");
  } else if (fitting.size() == 1) {
    absl::StrAppend(&why, "; it is the only layout that ", full ? "holds" + sequence : "fits");
  } else {
    absl::StrAppend(&why, "; the fastest estimated decode step (", fmt::Ms(chosen.decode.total_s()), ") of the ",
                    fitting.size(), " layouts that ", full ? "hold" + sequence : "fit",
                    " (next: ", fmt::Layout(fitting[1]->tp, fitting[1]->pp), ", ",
                    fmt::Ms(fitting[1]->decode.total_s()), ")");
  }
  if (chosen.tier == Tier::kLowered) {
    absl::StrAppend(&why, ". max_model_len lowered from ", fmt::Count(ctx.target_len), " to ",
                    fmt::Count(chosen.max_model_len), ": no layout's KV cache holds a ", fmt::Count(ctx.target_len),
                    "-token sequence (set max_model_len, add GPUs or raise gpu_memory_utilization)");
  }
  const bool eagle3 = ctx.options.eagle3.has_value();
  for (const GpuPlan& g : chosen.gpus) {
    if (g.head_weight_bytes == 0) continue;
    // Its weights and buffers a fixed amount; its cache one layer's row beside each of the model's.
    StepLimits served = ServedLimits(ctx, chosen.max_model_len);
    served.num_kv_blocks = chosen.kv_blocks;
    const HeadMemory m = HeadBytes(eagle3 ? *ctx.options.eagle3 : ctx.config, g, ctx.dtype, served);
    absl::StrAppend(&why, eagle3 ? ". The EAGLE-3 head takes " : ". The multi-token-prediction layer takes ",
                    fmt::Size(m.total()), " on ", GpuName(ctx.cluster.gpu, g), ": ", fmt::Size(m.weights),
                    " of weights, ",
                    fmt::Size(m.buffers), " of buffers and ", fmt::Size(m.kv_cache), " of KV cache (",
                    fmt::Size(g.draft_kv_bytes_per_token), " a token of the model's cache, one layer's ",
                    ctx.config.mla() && !eagle3 ? "latent row" : "K and V",
                    ", and room for every sequence's guesses), so that GPU's share of the model's cache, the same on "
                    "every GPU, is smaller");
  }
  if (eagle3) {
    const ModelConfig& c = ctx.config;
    const uint64_t kept = DeclaredBytes(AuxHiddenBuffers(c, AuxLayers(ctx.options), ctx.dtype, ctx.options.limits));
    absl::StrAppend(&why, "; every GPU keeps the model's hidden states at the head's ", AuxLayers(ctx.options),
                    " layers for it, ", fmt::Size(kept), " of its step buffers");
  }
  return why + ".";
}

// Plan::experts_format.
std::string ExpertsFormat(const ModelConfig& c, const PlanOptions& options) {
  // (--quantization stores them as every linear layer; and the CPU and CUDA backends both keep
  // mxfp4 weights: weights.cc CountRankWeights)
  return c.mxfp4_experts && options.weight_quant == WeightQuant::kNone ? "mxfp4" : "";
}

// Why nothing fits, by how much, and what would help.
std::string RefusalReason(const Context& ctx, const Layout& closest, uint64_t model_bytes, bool forced) {
  const ModelConfig& c = ctx.config;
  const GpuPlan& g = closest.gpus[closest.worst_gpu];
  const int64_t need_tokens = CeilDiv(ctx.min_len, ctx.options.limits.block_size) * ctx.options.limits.block_size;
  const uint64_t kv = NeedKvBytes(ctx, g);
  const uint64_t fixed = g.weight_bytes + g.activation_bytes + g.reserve_bytes + g.draft_bytes;
  std::string speculative;  // on the worker that samples (its cache is in the KV cache's bytes)
  if (g.draft_bytes > 0) {
    absl::StrAppend(&speculative, fmt::Size(g.draft_bytes),
                    g.head_weight_bytes == 0        ? " draft model + "
                    : ctx.options.eagle3.has_value() ? " EAGLE-3 head + "
                                                     : " multi-token-prediction layer + ");
  }
  std::string why = absl::StrFormat("%s (%d layers, %s parameters: %s %s) does not fit on %s. ", c.architecture_name,
                                    c.num_hidden_layers, fmt::Parameters(c.ParameterCount()), fmt::Size(model_bytes),
                                    fmt::HeldIn(WeightsDTypeName(ctx.dtype, ctx.options),
                                                ExpertsFormat(c, ctx.options)),
                                    ctx.cluster.Describe());
  absl::StrAppend(&why, forced ? "The forced layout, " : "The closest layout, ", fmt::Layout(closest.tp, closest.pp),
                  ", needs ", fmt::Size(fixed + kv), " on ", GpuName(ctx.cluster.gpu, g), " (",
                  fmt::Size(g.weight_bytes), " weights + ",
                  fmt::Size(g.activation_bytes), " step buffers + ", fmt::Size(g.reserve_bytes),
                  ctx.cluster.gpu.is_cpu() ? " process (libraries, threads, load staging) + " : " runtime reserve + ",
                  speculative, fmt::Size(kv), " KV cache for ", fmt::Count(need_tokens), " tokens) but ", fmt::Size(ctx.usable),
                  absl::StrFormat(" is usable (%.2f x %s)", ctx.options.gpu_memory_utilization,
                                  fmt::Size(ctx.cluster.gpu.memory_bytes)),
                  ": short by ", fmt::Size(g.shortfall_bytes), ".");
  if (fixed <= ctx.usable) {
    // Weights fit; the KV cache is what is missing.
    absl::StrAppend(&why, " Its KV cache holds only ", fmt::Count(closest.kv_blocks * ctx.options.limits.block_size),
                    " tokens: lower max_model_len to at most that, raise gpu_memory_utilization or add GPUs.");
  } else if (ctx.usable > ctx.options.runtime_reserve_bytes + g.activation_bytes) {
    const uint64_t room = ctx.usable - ctx.options.runtime_reserve_bytes - g.activation_bytes;
    absl::StrAppend(&why, " The weights alone need at least ", CeilDiv(model_bytes, room), " ",
                    ctx.cluster.gpu.device_noun(), "s of this size.");
  }
  return why;
}

absl::Status ValidateOptions(const PlanOptions& o) {
  if (!(o.gpu_memory_utilization > 0 && o.gpu_memory_utilization <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("gpu_memory_utilization must be in (0, 1], got ", o.gpu_memory_utilization));
  }
  if (o.limits.max_model_len < 0 || o.limits.max_model_len > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_model_len must be 0 (the model's) or in [1, 2^31], got ", o.limits.max_model_len));
  }
  if (o.runtime_reserve_bytes > (uint64_t{1} << 50)) {
    return absl::InvalidArgumentError(
        absl::StrCat("runtime_reserve_bytes must be at most 2^50, got ", o.runtime_reserve_bytes));
  }
  if (o.tp < 0 || o.pp < 0) return absl::InvalidArgumentError("TP and PP must be >= 1 when forced");
  if (o.decode_batch < 1 || o.decode_batch > 4096) {
    return absl::InvalidArgumentError(absl::StrCat("decode_batch must be in [1, 4096], got ", o.decode_batch));
  }
  for (auto [name, v, max] : {std::tuple{"max_tokens_per_step", o.limits.max_tokens_per_step, int64_t{1} << 20},
                              {"max_seqs_per_step", o.limits.max_seqs_per_step, int64_t{1} << 20},
                              {"block_size", o.limits.block_size, int64_t{1} << 16}}) {
    if (v < 1 || v > max) return absl::InvalidArgumentError(absl::StrCat(name, " must be in [1, ", max, "], got ", v));
  }
  if (o.dtype && *o.dtype == DType::kI32) return absl::InvalidArgumentError("the model dtype must be F32, F16 or BF16");
  return absl::OkStatus();
}

// Checks a forced TP and/or PP against the model and the cluster, with errors naming the numbers.
absl::Status CheckForcedLayout(const ModelConfig& c, const ClusterSpec& cluster, int tp, int pp, WeightQuant quant,
                               bool expert_parallel) {
  if (tp > 0) {
    if (absl::Status s = CheckTpDivides(c, tp, expert_parallel); !s.ok()) {
      std::vector<int> valid = ValidTpSizes(c, cluster, quant, expert_parallel);
      return absl::InvalidArgumentError(
          absl::StrCat("TP=", tp, ": ", s.message(), " (", c.num_attention_heads, " heads, ", c.num_key_value_heads,
                       " KV heads, intermediate size ", c.intermediate_size,
                       "); TP sizes that work on this cluster: ", absl::StrJoin(valid, ", ")));
    }
    if (tp > cluster.max_gpus_per_node()) {
      return absl::InvalidArgumentError(absl::StrCat("TP=", tp, " needs ", tp, " GPUs in one node (tensor parallelism ",
                                                     "stays inside a node) but the largest node has ",
                                                     cluster.max_gpus_per_node()));
    }
    if (absl::Status s = CheckQuantizedShard(c, tp, quant, expert_parallel); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("TP=", tp, ": ", s.message(), "; TP sizes that work on this cluster: ",
                                                     absl::StrJoin(ValidTpSizes(c, cluster, quant, expert_parallel), ", ")));
    }
  }
  if (pp > 0 && pp > c.num_hidden_layers) {
    return absl::InvalidArgumentError(absl::StrCat("PP=", pp, " needs ", pp, " stages of at least one layer but the ",
                                                   "model has ", c.num_hidden_layers, " layers"));
  }
  if (pp > cluster.total_gpus()) {
    return absl::InvalidArgumentError(absl::StrCat("PP=", pp, " needs ", pp, " GPUs (one TP group per stage) but ",
                                                   cluster.Describe(), " has ", cluster.total_gpus()));
  }
  if (tp > 0 && pp > 0 && pp > StageSlots(cluster, tp)) {
    return absl::InvalidArgumentError(absl::StrCat(fmt::Layout(tp, pp), " needs ", pp, " groups of ", tp,
                                                   " GPUs inside nodes; ", cluster.Describe(), " has room for ",
                                                   StageSlots(cluster, tp)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DType> ParsePlanDType(const std::string& name) {
  const std::string n = absl::AsciiStrToLower(name);
  if (n == "bf16" || n == "bfloat16") return DType::kBF16;
  if (n == "fp16" || n == "f16" || n == "float16") return DType::kF16;
  if (n == "fp32" || n == "f32" || n == "float32") return DType::kF32;
  return absl::InvalidArgumentError(absl::StrCat("dtype \"", name, "\" is not one of bf16, fp16, fp32"));
}

std::string WeightsDTypeName(DType dtype, const PlanOptions& options) {
  if (!options.products_dtype.has_value() || *options.products_dtype == dtype) return PlanDTypeName(dtype);
  return absl::StrCat(PlanDTypeName(dtype), " with the products in ", PlanDTypeName(*options.products_dtype));
}

const char* PlanDTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return "bf16";
    case DType::kF16: return "fp16";
    case DType::kF32: return "fp32";
    case DType::kI32: return "i32";
    case DType::kI8: return "int8";
  }
  return "?";
}

absl::StatusOr<PlannerModel> OpenPlannerModel(const std::filesystem::path& path) {
  PlannerModel m;
  absl::StatusOr<ModelConfig> config = LoadModelConfig(path);
  if (!config.ok()) return config.status();
  m.config = std::move(*config);
  if (std::filesystem::is_directory(path)) {
    bool has_weights = false;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(path, ec)) {
      if (entry.path().extension() == ".safetensors") has_weights = true;
    }
    if (ec) return absl::NotFoundError(absl::StrCat(path.string(), ": cannot list the directory: ", ec.message()));
    if (has_weights) {
      absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(path);
      if (!ckpt.ok()) return ckpt.status();
      m.checkpoint = std::move(*ckpt);
    }
  }
  return m;
}

absl::StatusOr<Plan> MakePlan(const ModelConfig& config, const Checkpoint* checkpoint, const ClusterSpec& cluster,
                              const PlanOptions& options) {
  SHARDSERVE_RETURN_IF_ERROR(ValidateOptions(options));
  SHARDSERVE_RETURN_IF_ERROR(ValidateCluster(cluster));
  const ModelConfig& c = config;
  // A float estimate first, so that no integer product of the sizes below can overflow.
  const double params =
      static_cast<double>(c.num_hidden_layers) * (2.0 * c.hidden_size * c.q_dim() + 2.0 * c.hidden_size * c.kv_dim() +
                                                  3.0 * c.hidden_size * c.intermediate_size +
                                                  (1.0 + 3.0 * c.moe_intermediate_size) * c.hidden_size * c.num_experts) +
      2.0 * c.vocab_size * c.hidden_size;
  if (!(params <= kMaxParameters)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("config.json describes %.3g parameters; the planner stops at %.0g", params, kMaxParameters));
  }
  if (c.num_hidden_layers > kMaxLayers) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json has ", c.num_hidden_layers, " layers; the planner stops at ", kMaxLayers));
  }
  if (options.limits.max_model_len == 0 && c.max_position_embeddings <= 0) {
    return absl::InvalidArgumentError("config.json has no max_position_embeddings: set max_model_len");
  }
  if (c.max_position_embeddings > 0 && options.limits.max_model_len > c.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("max_model_len ", options.limits.max_model_len,
                                                   " is longer than the model's max_position_embeddings (",
                                                   c.max_position_embeddings, ")"));
  }
  // expert parallelism needs experts (any TP: with one rank it holds them all, whole)
  if (options.expert_parallel) SHARDSERVE_RETURN_IF_ERROR(CheckTpDivides(c, 1, /*expert_parallel=*/true));
  SHARDSERVE_RETURN_IF_ERROR(
      CheckForcedLayout(c, cluster, options.tp, options.pp, options.weight_quant, options.expert_parallel));

  Context ctx{c, cluster, options, options.dtype.value_or(c.dtype), 0, 0, 0, {}};
  ctx.usable = static_cast<uint64_t>(options.gpu_memory_utilization * static_cast<double>(cluster.gpu.memory_bytes));
  ctx.target_len = options.limits.max_model_len > 0 ? options.limits.max_model_len : c.max_position_embeddings;
  ctx.min_len = options.limits.max_model_len > 0 ? ctx.target_len : std::min(ctx.target_len, kMinLoweredModelLen);
  if (checkpoint != nullptr) {
    absl::StatusOr<std::vector<WeightDecl>> w = CheckpointWeights(c, *checkpoint);
    if (!w.ok()) return w.status();
    ctx.tensors = std::move(*w);
  } else {
    ctx.tensors = ModelWeights(c);
  }
  if (options.draft.has_value()) SHARDSERVE_RETURN_IF_ERROR(CountDraft(&ctx));
  if (options.mtp) SHARDSERVE_RETURN_IF_ERROR(CountMtp(&ctx));
  if (options.eagle3.has_value()) SHARDSERVE_RETURN_IF_ERROR(CountEagle3(&ctx));

  // Weigh every layout the request allows.
  std::vector<int> tps = options.tp > 0 ? std::vector<int>{options.tp}
                                        : ValidTpSizes(c, cluster, options.weight_quant, options.expert_parallel);
  std::vector<Layout> layouts;
  for (int tp : tps) {
    std::vector<TpShard> shards;
    std::vector<RankWeights> ranks;
    for (int r = 0; r < tp; ++r) {
      absl::StatusOr<TpShard> shard = ComputeTpShard(c, r, tp, options.expert_parallel);
      if (!shard.ok()) return shard.status();
      shards.push_back(*shard);
      ranks.push_back(
          CountRankWeights(c, ctx.tensors, *shard, ctx.dtype, options.weight_quant, options.products_dtype));
    }
    const int max_pp = static_cast<int>(std::min<int64_t>(c.num_hidden_layers, StageSlots(cluster, tp)));
    for (int pp = 1; pp <= max_pp; ++pp) {
      if (options.pp != 0 && options.pp != pp) continue;
      layouts.push_back(Evaluate(ctx, ranks, shards, tp, pp));
      // A deeper pipeline reads the same weights per token one stage after another and adds a hop
      // per stage, so once a layout holds the target length no larger PP with this TP can win.
      if (layouts.back().tier == Tier::kFull) break;
    }
  }
  std::stable_sort(layouts.begin(), layouts.end(), Better);
  const Layout& best = layouts.front();

  Plan plan;
  plan.architecture = c.architecture_name;
  plan.weights_from = checkpoint != nullptr ? absl::StrCat("checkpoint ", checkpoint->dir().string()) : "config.json";
  plan.num_layers = c.num_hidden_layers;
  plan.parameters = c.ParameterCount();
  plan.active_parameters = ActiveParameterCount(c);
  if (checkpoint != nullptr) {
    const UnservedBytes unserved = UnservedCheckpointBytes(c, *checkpoint, options.mtp);
    plan.unserved_checkpoint_bytes = unserved.outside_text_model;
    plan.unserved_layer_bytes = unserved.after_last_layer;
  }
  absl::StatusOr<TpShard> whole = ComputeTpShard(c, 0, 1);
  if (!whole.ok()) return whole.status();
  plan.model_weight_bytes = CountRankWeights(c, ctx.tensors, *whole, ctx.dtype, options.weight_quant,
                                             options.products_dtype)
                                .Stage(0, c.num_hidden_layers, /*first_stage=*/true, /*last_stage=*/true);
  plan.dtype = ctx.dtype;
  plan.checkpoint_dtype = c.dtype;
  if (c.checkpoint_quant.has_value()) {
    switch (CheckpointQuantKernel(*c.checkpoint_quant)) {
      case WeightQuant::kInt4: plan.checkpoint_quant = " as int4 groups of 128"; break;
      case WeightQuant::kInt8: plan.checkpoint_quant = " as int8 per output channel"; break;
      case WeightQuant::kFp8:
        plan.checkpoint_quant = c.checkpoint_quant->method == QuantMethod::kFp8
                                    ? absl::StrCat(" as fp8 e4m3 with ", c.checkpoint_quant->block_out, "x",
                                                   c.checkpoint_quant->block_in, " block scales")
                                    : std::string(" as fp8 e4m3 per output channel");
        break;
      case WeightQuant::kMxfp4:  // (gpt-oss's MXFP4 is ModelConfig::mxfp4_experts, not a checkpoint_quant)
      case WeightQuant::kNone:  // held as a plain weight in the workers' dtype
        plan.checkpoint_quant = absl::StrCat(" dequantized to ", ctx.dtype == DType::kF32 ? "float32" : PlanDTypeName(ctx.dtype));
        break;
    }
    plan.checkpoint_quant = absl::StrCat(c.checkpoint_quant->Name(), plan.checkpoint_quant);
  }
  plan.experts_format = ExpertsFormat(c, options);
  plan.cluster = cluster;
  plan.options = options;
  plan.options.dtype = ctx.dtype;
  plan.usable_bytes_per_gpu = ctx.usable;
  plan.tp = best.tp;
  plan.pp = best.pp;
  plan.stages = best.stages;
  plan.per_gpu = best.gpus;
  plan.max_model_len = best.max_model_len;
  plan.target_max_model_len = ctx.target_len;
  plan.kv_cache_tokens = best.kv_blocks * options.limits.block_size;
  plan.limits = options.limits;
  plan.limits.num_kv_blocks = best.kv_blocks;
  plan.limits.max_model_len = best.max_model_len;
  plan.limits.num_sliding_kv_blocks = PlannedSlidingBlocks(c, options.limits, best.kv_blocks, best.max_model_len);
  plan.decode = best.decode;
  for (const Layout& l : layouts) plan.layouts.push_back(Summarize(ctx, l));
  plan.fits = best.tier != Tier::kNone;
  FillMemoryItems(c, &plan);
  const bool forced = options.tp > 0 && options.pp > 0;
  if (plan.fits) {
    std::vector<const Layout*> fitting;
    for (const Layout& l : layouts) {
      if (l.tier == best.tier) fitting.push_back(&l);
    }
    plan.reason = FitReason(ctx, best, fitting, forced);
  } else {
    plan.reason = RefusalReason(ctx, best, plan.model_weight_bytes, forced);
  }
  if (options.weight_quant != WeightQuant::kNone) {
    PlanOptions plain = options;
    plain.weight_quant = WeightQuant::kNone;
    absl::StatusOr<Plan> without = MakePlan(config, checkpoint, cluster, plain);
    if (!without.ok()) return without.status();
    plan.unquantized = Plan::Unquantized{without->fits, without->tp, without->pp, without->kv_cache_tokens,
                                         without->model_weight_bytes};
  }
  return plan;
}

}  // namespace shardserve
