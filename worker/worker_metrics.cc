#include "worker/worker_metrics.h"

#include "absl/strings/str_cat.h"
#include "telemetry/metrics_http.h"

namespace shardserve {
namespace {

prometheus::Labels With(prometheus::Labels labels, const std::string& name, const std::string& value) {
  labels.emplace(name, value);
  return labels;
}

}  // namespace

WorkerMetrics::WorkerMetrics(prometheus::Registry* registry, const std::string& model, const std::string& node,
                             int stage, int rank) {
  const prometheus::Labels base = {
      {"model", model}, {"node", node}, {"stage", absl::StrCat(stage)}, {"rank", absl::StrCat(rank)}};
  auto& step = prometheus::BuildHistogram()
                   .Name("shardserve_worker_step_seconds")
                   .Help("Seconds this worker spent executing one step, by phase (prefill: more tokens than "
                         "sequences; decode).")
                   .Register(*registry);
  prefill_seconds_ = &step.Add(With(base, "phase", "prefill"), LatencyBuckets());
  decode_seconds_ = &step.Add(With(base, "phase", "decode"), LatencyBuckets());
  auto& seconds = prometheus::BuildHistogram()
                      .Name("shardserve_worker_collective_seconds")
                      .Help("Seconds of one collective call, by op (all_reduce, all_gather, send, recv, all_to_all).")
                      .Register(*registry);
  auto& bytes = prometheus::BuildCounter()
                    .Name("shardserve_worker_collective_bytes_total")
                    .Help("Bytes this worker reduced, contributed to a gather, sent or received, by op.")
                    .Register(*registry);
  const char* const names[kOps] = {"all_reduce", "all_gather", "send", "recv", "all_to_all"};
  for (int i = 0; i < kOps; ++i) {
    collective_seconds_[i] = &seconds.Add(With(base, "op", names[i]), LatencyBuckets());
    collective_bytes_[i] = &bytes.Add(With(base, "op", names[i]));
  }
  weight_bytes_ = &prometheus::BuildGauge()
                       .Name("shardserve_worker_weight_bytes")
                       .Help("Bytes of model weights this worker holds.")
                       .Register(*registry)
                       .Add(base);
  steps_ = &prometheus::BuildCounter()
                .Name("shardserve_worker_steps_total")
                .Help("Steps this worker executed successfully.")
                .Register(*registry)
                .Add(base);
  auto& kernels = prometheus::BuildCounter()
                      .Name("shardserve_worker_kernel_launches_total")
                      .Help("GPU kernels this worker launched in its steps (each cuBLAS call counted as one; 0 on "
                            "the CPU), by phase: divided by shardserve_worker_step_seconds_count, kernels per step.")
                      .Register(*registry);
  prefill_kernels_ = &kernels.Add(With(base, "phase", "prefill"));
  decode_kernels_ = &kernels.Add(With(base, "phase", "decode"));
  expert_rows_family_ = &prometheus::BuildCounter()
                             .Name("shardserve_worker_expert_rows_total")
                             .Help("Tokens routed to each expert (one row per token and chosen expert) that this "
                                   "worker computed, by expert id: the experts' load balance.")
                             .Register(*registry);
  planned_memory_family_ = &prometheus::BuildGauge()
                                .Name("shardserve_worker_memory_planned_bytes")
                                .Help("The plan's memory for this worker by item (weights, kv_cache, step_buffers, "
                                      "process, ...; the planner's itemised memory), set at each load.")
                                .Register(*registry);
  process_memory_family_ = &prometheus::BuildGauge()
                                .Name("shardserve_worker_process_memory_bytes")
                                .Help("A CPU worker's own anonymous memory beside its weights, KV cache and step "
                                      "buffers (RssAnon less them), against the planned process item; at load and "
                                      "after steps, at most once a second.")
                                .Register(*registry);
  base_ = base;
}

void WorkerMetrics::SetPlannedMemory(const std::vector<std::pair<std::string, int64_t>>& items) {
  for (auto& [item, gauge] : planned_memory_) gauge->Set(0);  // an item the new plan lacks
  for (const auto& [item, bytes] : items) {
    prometheus::Gauge*& gauge = planned_memory_[item];
    if (gauge == nullptr) gauge = &planned_memory_family_->Add(With(base_, "item", item));
    gauge->Set(static_cast<double>(bytes));
  }
}

void WorkerMetrics::SetProcessMemory(int64_t bytes) {
  if (process_memory_ == nullptr) process_memory_ = &process_memory_family_->Add(base_);
  process_memory_->Set(static_cast<double>(bytes));
}

void WorkerMetrics::ExpertRowsDone(const std::vector<uint64_t>& totals) {
  if (expert_rows_.size() < totals.size()) {
    expert_rows_.resize(totals.size(), nullptr);
    expert_rows_seen_.resize(totals.size(), 0);
  }
  for (size_t e = 0; e < totals.size(); ++e) {
    if (totals[e] < expert_rows_seen_[e]) expert_rows_seen_[e] = 0;  // the shard was loaded again
    const uint64_t added = totals[e] - expert_rows_seen_[e];
    if (added == 0) continue;
    if (expert_rows_[e] == nullptr) expert_rows_[e] = &expert_rows_family_->Add(With(base_, "expert", absl::StrCat(e)));
    expert_rows_[e]->Increment(static_cast<double>(added));
    expert_rows_seen_[e] = totals[e];
  }
}

void WorkerMetrics::StepDone(bool prefill, double seconds, uint64_t kernel_launches) {
  (prefill ? prefill_seconds_ : decode_seconds_)->Observe(seconds);
  (prefill ? prefill_kernels_ : decode_kernels_)->Increment(static_cast<double>(kernel_launches));
  steps_->Increment();
}

void WorkerMetrics::Observe(CollectiveOp op, double seconds, uint64_t bytes) {
  const int i = static_cast<int>(op);
  if (i < 0 || i >= kOps) return;  // a barrier
  collective_seconds_[i]->Observe(seconds);
  collective_bytes_[i]->Increment(static_cast<double>(bytes));
}

}  // namespace shardserve
