// What the coordinator's flags say about its workers: the layout, the step limits asked for, how
// the weights are stored and loaded, and the timeouts that decide when a worker is lost. Read by
// GroupFormation (the plan and the assignments), Membership (heartbeats) and WorkerPool.
#ifndef SHARDSERVE_COORDINATOR_CLUSTER_POOL_OPTIONS_H_
#define SHARDSERVE_COORDINATOR_CLUSTER_POOL_OPTIONS_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/time/time.h"
#include "kernels/quant.h"
#include "model/config.h"
#include "model/step_limits.h"
#include "model/weight_source.h"

namespace shardserve {

struct PoolOptions {
  int nodes = 1;          // pipeline stages
  int gpus_per_node = 1;  // TP ranks per stage
  // As the flags give them. Undecided (0) until the group forms: limits.max_model_len, the
  // planner's choice (the model's max_position_embeddings, lowered to what the KV cache holds),
  // and limits.num_kv_blocks, as many as the smallest worker's memory holds beside its weights
  // (the plan's), at most kMaxCpuKvCacheBytes per worker on CPU workers.
  StepLimits limits;
  // How the workers store the linear layers' weights (--quantization; kernels/quant.h).
  WeightQuant weight_quant = WeightQuant::kNone;
  // Whether the TP ranks hold whole experts (--expert-parallel; model/sharding.h).
  bool expert_parallel = false;
  // Where the workers' weights come from (--load-format, --dummy-seed; model/weight_source.h).
  LoadFormat load_format = LoadFormat::kAuto;
  uint64_t dummy_seed = 0;
  // Speculative decoding's draft model or EAGLE-3 head (--draft-model; docs/speculative-decoding.md):
  // its directory, absolute, as the workers see it; the worker that samples loads it beside its
  // shard. "": none. With it, its config.json, which the plan counts on that worker
  // (PlanOptions::draft, or with speculative_eagle3 PlanOptions::eagle3).
  std::string draft_model_path;
  std::optional<ModelConfig> draft_config;
  // Speculative decoding with the model's multi-token-prediction layer (--speculative mtp): the
  // worker that samples loads and runs it (Assignment.speculative_mtp), and the plan counts it there
  // (PlanOptions::mtp).
  bool speculative_mtp = false;
  // Speculative decoding with an EAGLE-3 head (--speculative eagle3; draft_model_path its directory,
  // draft_config its config.json): the worker that samples loads and runs it
  // (Assignment.speculative_eagle3), and every worker keeps the model's hidden states at
  // aux_hidden_layers (Eagle3AuxLayers).
  bool speculative_eagle3 = false;
  std::vector<int64_t> aux_hidden_layers;
  absl::Duration collective_timeout = absl::Seconds(5);
  absl::Duration heartbeat_timeout = absl::Seconds(3);
};

// KV cache a CPU worker allocates at most when --num-kv-blocks does not say: the host's memory
// is shared with everything else on it, and a local cluster runs several workers on one host
// (vLLM's CPU backend takes 4 GiB by default; 256 MiB holds thousands of tokens of small models).
constexpr uint64_t kMaxCpuKvCacheBytes = uint64_t{256} << 20;

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_CLUSTER_POOL_OPTIONS_H_
