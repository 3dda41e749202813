// The worker's Prometheus metrics, all defined here (docs/metrics.md lists them; a test checks
// that every one named there is exposed). Each carries the labels model (the checkpoint
// directory's base name), node, stage and rank (TP rank), known once the worker is assigned: the
// metrics are created then, in a registry the process already serves (telemetry/metrics_http.h).
//
// Ownership: borrows the registry, which must outlive this; the metrics stay in the registry.
// Threading: thread-safe (prometheus-cpp metrics are atomic). Every series the hot path touches is
// resolved at construction: observing allocates nothing.
#ifndef SHARDSERVE_WORKER_WORKER_METRICS_H_
#define SHARDSERVE_WORKER_WORKER_METRICS_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "worker/timed_communicator.h"

namespace shardserve {

class WorkerMetrics final : public CollectiveObserver {
 public:
  WorkerMetrics(prometheus::Registry* registry, const std::string& model, const std::string& node, int stage,
                int rank);
  WorkerMetrics(const WorkerMetrics&) = delete;
  WorkerMetrics& operator=(const WorkerMetrics&) = delete;

  // A step ran successfully in `seconds` with `kernel_launches` kernels (0 on the CPU); `prefill`
  // when it carried more tokens than sequences.
  void StepDone(bool prefill, double seconds, uint64_t kernel_launches = 0);
  void SetWeightBytes(uint64_t bytes) { weight_bytes_->Set(static_cast<double>(bytes)); }
  // The plan's memory for this worker, item by item (Assignment.planned_memory: weights, kv_cache,
  // step_buffers, process, ...), at each load: a series per item, set again by a later load.
  void SetPlannedMemory(const std::vector<std::pair<std::string, int64_t>>& items);
  // A CPU worker's own memory beside its buffers (StepExecutor::ProcessMemoryBytes), against the
  // plan's `process` item; its series is made at the first call, so a CUDA worker has none.
  void SetProcessMemory(int64_t bytes);
  // The shard's rows per expert since load (ModelShard::expert_rows_total): the counters grow by
  // what is new since the last call (from zero again after a reload). A series is made the first
  // time its expert has rows, so a worker shows the experts it computes.
  void ExpertRowsDone(const std::vector<uint64_t>& totals);
  // CollectiveObserver. Barriers are not counted.
  void Observe(CollectiveOp op, double seconds, uint64_t bytes) override;

 private:
  static constexpr int kOps = 5;  // all_reduce, all_gather, send, recv, all_to_all (CollectiveOp order)
  static_assert(static_cast<int>(CollectiveOp::kBarrier) == kOps, "every op but the barrier, the last, has a series");
  // ---- Constant after construction (the series they point to live in the registry) ----
  prometheus::Histogram* prefill_seconds_ = nullptr;
  prometheus::Histogram* decode_seconds_ = nullptr;
  prometheus::Histogram* collective_seconds_[kOps] = {};
  prometheus::Counter* collective_bytes_[kOps] = {};
  prometheus::Gauge* weight_bytes_ = nullptr;
  prometheus::Counter* steps_ = nullptr;
  prometheus::Counter* prefill_kernels_ = nullptr;
  prometheus::Counter* decode_kernels_ = nullptr;
  prometheus::Family<prometheus::Counter>* expert_rows_family_ = nullptr;
  prometheus::Family<prometheus::Gauge>* planned_memory_family_ = nullptr;
  prometheus::Family<prometheus::Gauge>* process_memory_family_ = nullptr;
  prometheus::Labels base_;
  // ---- The worker service's thread only (SetPlannedMemory, SetProcessMemory) ----
  std::map<std::string, prometheus::Gauge*> planned_memory_;  // by item
  prometheus::Gauge* process_memory_ = nullptr;                // made at the first SetProcessMemory
  // ---- The step loop's only (ExpertRowsDone) ----
  std::vector<prometheus::Counter*> expert_rows_;  // by expert id; null until it has rows
  std::vector<uint64_t> expert_rows_seen_;         // the totals at the last call
};

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_WORKER_METRICS_H_
