// Two views of a Plan: a table for people and one JSON object for programs (`shardserve plan` and
// `shardserve plan --json`).
#ifndef SHARDSERVE_COORDINATOR_PLANNER_RENDER_H_
#define SHARDSERVE_COORDINATOR_PLANNER_RENDER_H_

#include <string>

#include "coordinator/planner/planner.h"

namespace shardserve {

// The plan as text: model and cluster, the verdict and its reason, the stages, every GPU's
// memory, the decode estimate, and the layouts weighed (at most 10; the JSON lists all).
std::string PlanTable(const Plan& plan);

// The plan as one JSON object (indented). Always has "tp", "pp", "stages" (first_layer and
// last_layer inclusive), "per_gpu" (stage, tp_rank, weight_bytes, kv_cache_tokens, ...), "fits"
// and "reason"; docs/planner.md lists every field.
std::string PlanJson(const Plan& plan);

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_PLANNER_RENDER_H_
