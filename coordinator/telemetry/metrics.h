// The coordinator's Prometheus metrics, all defined here (docs/metrics.md lists them; a test checks
// that every one named there is exposed). Each carries the label `model` (the checkpoint
// directory's base name).
//
// Ownership: owns its registry (serve it with ServeMetrics, telemetry/metrics_http.h); the metric
// objects it hands out live as long as it does.
// Threading: every method is thread-safe (prometheus-cpp metrics are atomic; worker_up's family is
// guarded by the library).
#ifndef SHARDSERVE_COORDINATOR_TELEMETRY_METRICS_H_
#define SHARDSERVE_COORDINATOR_TELEMETRY_METRICS_H_

#include <memory>
#include <string>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <vector>

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
  // An HTTP request (coordinator/openai) answered with `status` on `endpoint` ("/v1/completions",
  // ..., "other"); 499: a streaming client that went away.
  void HttpRequest(absl::string_view endpoint, int status);
  // How the coordinator sees a worker of the planned group: up (registered, loading, ready) or
  // lost.
  void SetWorkerUp(const std::string& worker, const std::string& node, int stage, int rank, bool up);
  // A call refused for want of credentials: reason is "missing_key" or "invalid_key" (the client
  // API's API keys) or "no_client_certificate" (a Connect or rendezvous call without a verified
  // certificate from the cluster's CA) or "rendezvous_denied" (a rendezvous call whose token does not
  // grant its key: rendezvous_grants.h).
  void AuthFailure(absl::string_view reason);
  // The group's state (Membership::StateName: starting, serving, healing, degraded): its series is
  // 1, the others 0.
  void SetClusterState(const std::string& state);
  // Speculative decoding's cumulative counts (the scheduler's SpeculationStats): the counters
  // move up to them, and the mean accepted length is set.
  void Speculation(int64_t proposed, int64_t accepted, int64_t verifications,
                   const std::vector<int64_t>& accepted_by_position);

 private:
  const std::string model_;
  const std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& finished_family_;
  prometheus::Family<prometheus::Counter>& requests_family_;
  prometheus::Family<prometheus::Gauge>& worker_up_family_;
  prometheus::Family<prometheus::Counter>& auth_failures_family_;
  prometheus::Family<prometheus::Counter>& http_requests_family_;
  prometheus::Family<prometheus::Gauge>& cluster_state_family_;
  prometheus::Family<prometheus::Counter>& spec_accepted_by_position_family_;

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
  // ---- Healing (docs/healing.md) ----
  prometheus::Counter& heals;                     // the group re-formed and serves again
  prometheus::Histogram& heal_duration;           // seconds, loss -> serving again
  prometheus::Counter& heal_requests_resumed;     // requests held through a heal that went on
  prometheus::Counter& heal_requests_failed;      // requests failed because a heal took too long
  prometheus::Counter& worker_restarts;           // workers registered for a lost slot
  prometheus::Counter& workers_adopted;           // workers a (restarted) coordinator adopted, shard kept
  // ---- Prefix caching ----
  prometheus::Counter& prefix_cache_queries;  // tokens looked up in the prefix cache
  prometheus::Counter& prefix_cache_hits;     // tokens found there
  prometheus::Gauge& prefix_cache_blocks;     // blocks cached, held by no sequence
  // ---- The HTTP API's stored responses (/v1/responses) ----
  prometheus::Gauge& responses_stored;        // responses stored
  prometheus::Gauge& responses_stored_bytes;  // their bytes, within --http-responses-store-bytes
  // ---- Speculative decoding (docs/speculative-decoding.md) ----
  prometheus::Counter& spec_proposed;       // tokens proposed
  prometheus::Counter& spec_accepted;       // of them accepted
  prometheus::Counter& spec_rejected;       // of them rejected
  prometheus::Counter& spec_verifications;  // sequence rows that carried proposals
  prometheus::Gauge& spec_mean_accepted_length;  // tokens per verification: (accepted + rows) / rows
};

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_TELEMETRY_METRICS_H_
