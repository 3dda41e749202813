#include "coordinator/telemetry/metrics.h"

#include "absl/strings/str_cat.h"

namespace shardserve {
namespace {

prometheus::Histogram& AddHistogram(prometheus::Registry& registry, const std::string& name, const std::string& help,
                                    const std::string& model) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(registry).Add({{"model", model}},
                                                                                     LatencyBuckets());
}

prometheus::Gauge& AddGauge(prometheus::Registry& registry, const std::string& name, const std::string& help,
                            const std::string& model) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(registry).Add({{"model", model}});
}

prometheus::Counter& AddCounter(prometheus::Registry& registry, const std::string& name, const std::string& help,
                                const std::string& model) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(registry).Add({{"model", model}});
}

}  // namespace

CoordinatorMetrics::CoordinatorMetrics(const std::string& model)
    : model_(model),
      registry_(std::make_shared<prometheus::Registry>()),
      finished_family_(prometheus::BuildCounter()
                           .Name("shardserve_requests_finished_total")
                           .Help("Generations that finished normally, by reason (stop_token, stop_string, length).")
                           .Register(*registry_)),
      requests_family_(prometheus::BuildCounter()
                           .Name("shardserve_requests_total")
                           .Help("Generate requests by final gRPC status code name.")
                           .Register(*registry_)),
      worker_up_family_(prometheus::BuildGauge()
                            .Name("shardserve_worker_up")
                            .Help("1 while the coordinator sees the worker healthy, 0 once it is lost.")
                            .Register(*registry_)),
      auth_failures_family_(prometheus::BuildCounter()
                                .Name("shardserve_auth_failures_total")
                                .Help("Calls refused for want of credentials, by reason (missing_key, invalid_key, "
                                      "no_client_certificate, rendezvous_denied).")
                                .Register(*registry_)),
      http_requests_family_(prometheus::BuildCounter()
                                .Name("shardserve_http_requests_total")
                                .Help("OpenAI API HTTP requests by endpoint and HTTP status (499: a streaming "
                                      "client went away).")
                                .Register(*registry_)),
      cluster_state_family_(prometheus::BuildGauge()
                                .Name("shardserve_cluster_state")
                                .Help("1 for the worker group's current state (starting, serving, healing, "
                                      "degraded), 0 for the others.")
                                .Register(*registry_)),
      spec_accepted_by_position_family_(prometheus::BuildCounter()
                                            .Name("shardserve_spec_accepted_by_position_total")
                                            .Help("Speculative decoding: proposed tokens accepted, by their position "
                                                  "after the last accepted token (0-based).")
                                            .Register(*registry_)),
      time_to_first_token(AddHistogram(*registry_, "shardserve_time_to_first_token_seconds",
                                       "Seconds from a request's arrival to its first token sent.", model)),
      inter_token_latency(AddHistogram(*registry_, "shardserve_inter_token_latency_seconds",
                                       "Seconds between two consecutive tokens of one request.", model)),
      request_duration(AddHistogram(*registry_, "shardserve_request_duration_seconds",
                                    "Seconds from a Generate request's arrival to its final status.", model)),
      request_queue(AddHistogram(*registry_, "shardserve_request_queue_seconds",
                                 "Seconds a Generate request waited before its first step.", model)),
      step_sequences(prometheus::BuildHistogram()
                         .Name("shardserve_step_sequences")
                         .Help("Sequences in each step the coordinator sends (the running batch of a micro-batch).")
                         .Register(*registry_)
                         .Add({{"model", model}}, prometheus::Histogram::BucketBoundaries{1, 2, 4, 8, 16, 32, 64,
                                                                                           128, 256})),
      step_tokens(prometheus::BuildHistogram()
                      .Name("shardserve_step_tokens")
                      .Help("Tokens (prefill chunks and decodes) in each step the coordinator sends.")
                      .Register(*registry_)
                      .Add({{"model", model}}, prometheus::Histogram::BucketBoundaries{1, 4, 16, 64, 256, 1024, 4096})),
      step_plan_bytes(AddCounter(*registry_, "shardserve_step_plan_bytes_total",
                                 "Serialized bytes of the step plans sent, counted once per step (every worker gets "
                                 "them).",
                                 model)),
      requests_running(AddGauge(*registry_, "shardserve_requests_running",
                                "Sequences in the running batch (holding KV blocks).", model)),
      requests_waiting(AddGauge(*registry_, "shardserve_requests_waiting",
                                "Requests waiting to join the running batch (new or preempted).", model)),
      kv_blocks_used(AddGauge(*registry_, "shardserve_kv_blocks_used", "KV cache blocks held by running sequences.",
                              model)),
      preemptions(AddCounter(*registry_, "shardserve_preemptions_total",
                             "Sequences preempted for want of KV blocks (freed, recomputed later).", model)),
      kv_blocks_total(AddGauge(*registry_, "shardserve_kv_blocks_total", "KV cache blocks per worker (num_kv_blocks).",
                               model)),
      prompt_tokens(AddCounter(*registry_, "shardserve_prompt_tokens_total", "Prompt tokens of requests that ran.",
                               model)),
      generated_tokens(AddCounter(*registry_, "shardserve_generated_tokens_total", "Completion tokens sent to clients.",
                                  model)),
      heals(AddCounter(*registry_, "shardserve_heals_total",
                       "Times the worker group re-formed after a lost or failed worker and served again.", model)),
      heal_duration(prometheus::BuildHistogram()
                        .Name("shardserve_heal_duration_seconds")
                        .Help("Seconds from a worker's loss (or failure) to the group serving again.")
                        .Register(*registry_)
                        .Add({{"model", model}},
                             prometheus::Histogram::BucketBoundaries{0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300})),
      heal_requests_resumed(AddCounter(*registry_, "shardserve_heal_requests_resumed_total",
                                       "Requests held through a heal and resumed by recompute.", model)),
      heal_requests_failed(AddCounter(*registry_, "shardserve_heal_requests_failed_total",
                                      "Requests failed with UNAVAILABLE because the group did not heal within "
                                      "--heal-timeout-seconds.",
                                      model)),
      worker_restarts(AddCounter(*registry_, "shardserve_worker_restarts_total",
                                 "Workers that registered to take the slot of a lost worker.", model)),
      workers_adopted(AddCounter(*registry_, "shardserve_workers_adopted_total",
                                 "Workers that outlived an earlier coordinator and were adopted into their slot "
                                 "keeping the shard they held (no reload).",
                                 model)),
      prefix_cache_queries(AddCounter(*registry_, "shardserve_prefix_cache_queries_tokens_total",
                                      "Tokens of admitted sequences looked up in the prefix cache.", model)),
      prefix_cache_hits(AddCounter(*registry_, "shardserve_prefix_cache_hits_tokens_total",
                                   "Tokens found in the prefix cache (their KV not computed again).", model)),
      prefix_cache_blocks(AddGauge(*registry_, "shardserve_prefix_cache_blocks",
                                   "KV cache blocks holding a cached prefix that no running sequence holds.", model)),
      responses_stored(AddGauge(*registry_, "shardserve_http_responses_stored",
                                "Responses the HTTP API's /v1/responses keeps for previous_response_id.", model)),
      responses_stored_bytes(AddGauge(*registry_, "shardserve_http_responses_stored_bytes",
                                      "Bytes of the stored responses (at most --http-responses-store-bytes).",
                                      model)),
      spec_proposed(AddCounter(*registry_, "shardserve_spec_proposed_tokens_total",
                               "Speculative decoding: tokens proposed (guessed) for verification.", model)),
      spec_accepted(AddCounter(*registry_, "shardserve_spec_accepted_tokens_total",
                               "Speculative decoding: proposed tokens the model accepted.", model)),
      spec_rejected(AddCounter(*registry_, "shardserve_spec_rejected_tokens_total",
                               "Speculative decoding: proposed tokens rejected (their KV discarded).", model)),
      spec_verifications(AddCounter(*registry_, "shardserve_spec_verifications_total",
                                    "Speculative decoding: sequence rows that carried proposed tokens.", model)),
      spec_mean_accepted_length(AddGauge(*registry_, "shardserve_spec_mean_accepted_length",
                                         "Speculative decoding: tokens a verification yields on average (accepted "
                                         "proposals + the sampled one).",
                                         model)) {
  // Make the usual series exist at 0 from the start, so that rate() and alerts see them.
  for (const char* reason : {"missing_key", "invalid_key", "no_client_certificate", "rendezvous_denied"}) {
    auth_failures_family_.Add({{"model", model_}, {"reason", reason}});
  }
  for (const char* reason : {"stop_token", "stop_string", "length"}) {
    finished_family_.Add({{"model", model_}, {"reason", reason}});
  }
  requests_family_.Add({{"model", model_}, {"code", "OK"}});
  for (const char* endpoint : {"/v1/chat/completions", "/v1/completions"}) {
    http_requests_family_.Add({{"model", model_}, {"endpoint", endpoint}, {"status", "200"}});
  }
  SetClusterState("starting");
}

void CoordinatorMetrics::SetClusterState(const std::string& state) {
  for (const char* s : {"starting", "serving", "healing", "degraded"}) {
    cluster_state_family_.Add({{"model", model_}, {"state", s}}).Set(state == s ? 1 : 0);
  }
}

void CoordinatorMetrics::Speculation(int64_t proposed, int64_t accepted, int64_t verifications,
                                     const std::vector<int64_t>& accepted_by_position) {
  auto up_to = [](prometheus::Counter& c, int64_t total) {
    const double added = static_cast<double>(total) - c.Value();
    if (added > 0) c.Increment(added);
  };
  up_to(spec_proposed, proposed);
  up_to(spec_accepted, accepted);
  up_to(spec_rejected, proposed - accepted);
  up_to(spec_verifications, verifications);
  for (size_t i = 0; i < accepted_by_position.size(); ++i) {
    up_to(spec_accepted_by_position_family_.Add({{"model", model_}, {"position", absl::StrCat(i)}}),
          accepted_by_position[i]);
  }
  if (verifications > 0) {
    spec_mean_accepted_length.Set(static_cast<double>(accepted + verifications) / static_cast<double>(verifications));
  }
}

void CoordinatorMetrics::Finished(absl::string_view reason) {
  finished_family_.Add({{"model", model_}, {"reason", std::string(reason)}}).Increment();
}

void CoordinatorMetrics::AuthFailure(absl::string_view reason) {
  auth_failures_family_.Add({{"model", model_}, {"reason", std::string(reason)}}).Increment();
}

void CoordinatorMetrics::Ended(absl::string_view code_name) {
  requests_family_.Add({{"model", model_}, {"code", std::string(code_name)}}).Increment();
}

void CoordinatorMetrics::HttpRequest(absl::string_view endpoint, int status) {
  http_requests_family_.Add({{"model", model_}, {"endpoint", std::string(endpoint)}, {"status", absl::StrCat(status)}})
      .Increment();
}

void CoordinatorMetrics::SetWorkerUp(const std::string& worker, const std::string& node, int stage, int rank, bool up) {
  worker_up_family_
      .Add({{"model", model_},
            {"worker", worker},
            {"node", node},
            {"stage", absl::StrCat(stage)},
            {"rank", absl::StrCat(rank)}})
      .Set(up ? 1 : 0);
}

}  // namespace shardserve
