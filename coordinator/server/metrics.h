// The coordinator's Prometheus metrics, all defined here (docs/metrics.md lists them; a test checks
// that every one named there is exposed). Each carries the label `model` (the checkpoint
// directory's base name).
//
// Ownership: owns its registry (serve it with ServeMetrics, telemetry/metrics_http.h); the metric
// objects it hands out live as long as it does.
// Threading: every method is thread-safe (prometheus-cpp metrics are atomic; worker_up's family is
// guarded by the library).
#ifndef SHARDSERVE_COORDINATOR_SERVER_METRICS_H_
#define SHARDSERVE_COORDINATOR_SERVER_METRICS_H_

#include <memory>
#include <string>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "absl/strings/string_view.h"
#include "telemetry/metrics_http.h"

namespace shardserve {

class CoordinatorMetrics {
 public:
  explicit CoordinatorMetrics(const std::string& model);
  CoordinatorMetrics(const CoordinatorMetrics&) = delete;
  CoordinatorMetrics& operator=(const CoordinatorMetrics&) = delete;

  const std::shared_ptr<prometheus::Registry>& registry() const { return registry_; }

  // A request finished normally: reason is "stop_token", "stop_string" or "length".
  void Finished(absl::string_view reason);
  // A Generate call ended with the gRPC status code `code_name` ("OK", "UNAVAILABLE", ...).
  void Ended(absl::string_view code_name);
  // How the coordinator sees a worker of the planned group: up (registered, loading, ready) or
  // lost.
  void SetWorkerUp(const std::string& worker, const std::string& node, int stage, int rank, bool up);

 private:
  const std::string model_;
  const std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& finished_family_;
  prometheus::Family<prometheus::Counter>& requests_family_;
  prometheus::Family<prometheus::Gauge>& worker_up_family_;

 public:
  // ---- Observed directly by the inference service and the pool ----
  prometheus::Histogram& time_to_first_token;   // seconds, arrival -> first token sent
  prometheus::Histogram& inter_token_latency;   // seconds between two tokens of a request
  prometheus::Histogram& request_duration;      // seconds, arrival -> final status
  prometheus::Histogram& request_queue;         // seconds, arrival -> first step
  prometheus::Histogram& step_sequences;  // sequences per step sent
  prometheus::Histogram& step_tokens;     // tokens per step sent
  prometheus::Counter& step_plan_bytes;   // serialized StepPlan bytes, once per step (each worker gets them)
  prometheus::Gauge& requests_running;
  prometheus::Gauge& requests_waiting;
  prometheus::Gauge& kv_blocks_used;   // blocks held by running sequences
  prometheus::Counter& preemptions;
  prometheus::Gauge& kv_blocks_total;  // num_kv_blocks the workers hold
  prometheus::Counter& prompt_tokens;
  prometheus::Counter& generated_tokens;
  prometheus::Counter& prefix_cache_queries;  // tokens looked up in the prefix cache
  prometheus::Counter& prefix_cache_hits;     // tokens found there
  prometheus::Gauge& prefix_cache_blocks;     // blocks cached, held by no sequence
};

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_SERVER_METRICS_H_
