// The client API (inference.proto InferenceService) on top of the engine and the worker pool.
//
// Generate checks the request (INVALID_ARGUMENT naming the field), submits it to the engine
// (continuous batching: coordinator/engine/engine.h; UNAVAILABLE while the group is not serving,
// RESOURCE_EXHAUSTED past the waiting limit), then writes the responses the engine streams to the
// client. A client that goes away or whose deadline passes is cancelled in the engine at its next
// step. A broken group ends the stream with UNAVAILABLE naming the lost worker. Tokenize,
// GetModelInfo and GetClusterStatus answer whatever the group's state.
//
// With API keys (--api-keys-file, security/api_keys.h) every method first checks the call's
// `authorization: Bearer <key>` metadata: UNAUTHENTICATED without a valid key, counted in
// shardserve_auth_failures_total. (grpc.health.v1 is another service: it stays open for probes.)
//
// Ownership: borrows the model, the pool, the engine, the metrics and the API keys, which must
// outlive the service.
// Threading: gRPC calls the methods from its threads, concurrently; everything is thread-safe.
#ifndef SHARDSERVE_COORDINATOR_API_INFERENCE_SERVICE_H_
#define SHARDSERVE_COORDINATOR_API_INFERENCE_SERVICE_H_

#include <atomic>
#include <chrono>
#include <cstdint>

#include "coordinator/engine/engine.h"
#include "coordinator/telemetry/metrics.h"
#include "coordinator/model/served_model.h"
#include "coordinator/cluster/worker_pool.h"
#include "security/api_keys.h"
#include "shardserve/v1/inference.grpc.pb.h"

namespace shardserve {

class InferenceService final : public v1::InferenceService::Service {
 public:
  // `metrics` may be null (no metrics); `api_keys` null: no key needed.
  InferenceService(const ServedModel* model, WorkerPool* pool, Engine* engine, CoordinatorMetrics* metrics = nullptr,
                   ApiKeys* api_keys = nullptr)
      : model_(model), pool_(pool), engine_(engine), metrics_(metrics), api_keys_(api_keys) {}

  grpc::Status Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override;
  grpc::Status Tokenize(grpc::ServerContext* context, const v1::TokenizeRequest* request,
                        v1::TokenizeResponse* response) override;
  grpc::Status GetModelInfo(grpc::ServerContext* context, const v1::GetModelInfoRequest* request,
                            v1::ModelInfo* response) override;
  grpc::Status GetClusterStatus(grpc::ServerContext* context, const v1::GetClusterStatusRequest* request,
                                v1::ClusterStatus* response) override;

 private:
  // Generate without the end-of-call metrics.
  absl::Status GenerateStatus(grpc::ServerContext* context, const v1::GenerateRequest* request,
                              std::chrono::steady_clock::time_point arrival,
                              grpc::ServerWriter<v1::GenerateResponse>* writer);
  void FillModelInfo(v1::ModelInfo* info);
  // OK, or UNAUTHENTICATED (counted) when API keys are on and the call has no valid one.
  grpc::Status Authenticate(grpc::ServerContext* context);

  const ServedModel* const model_;
  WorkerPool* const pool_;
  Engine* const engine_;
  CoordinatorMetrics* const metrics_;  // may be null
  ApiKeys* const api_keys_;            // may be null

  std::atomic<uint64_t> next_request_ = 1;  // for ids of requests that bring none
};

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_API_INFERENCE_SERVICE_H_
