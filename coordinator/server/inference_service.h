// The client API (inference.proto InferenceService) on top of the worker pool.
//
// Generate requests run one at a time (batching is a later step): a request waits for its turn,
// checks that the group is serving, then runs its prefill step(s) and one decode step per token
// through WorkerPool::RunStep, streaming every token. A broken group ends the stream with
// UNAVAILABLE naming the lost worker; a request the model cannot take is INVALID_ARGUMENT naming
// the field. Tokenize, GetModelInfo and GetClusterStatus answer whatever the group's state.
//
// Ownership: borrows the model and the pool, which must outlive the service.
// Threading: gRPC calls the methods from its threads, concurrently; everything is thread-safe.
#ifndef SHARDSERVE_COORDINATOR_SERVER_INFERENCE_SERVICE_H_
#define SHARDSERVE_COORDINATOR_SERVER_INFERENCE_SERVICE_H_

#include <atomic>
#include <chrono>
#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/server/generation.h"
#include "coordinator/server/metrics.h"
#include "coordinator/server/served_model.h"
#include "coordinator/server/worker_pool.h"
#include "shardserve/v1/inference.grpc.pb.h"

namespace shardserve {

class InferenceService final : public v1::InferenceService::Service {
 public:
  // `step_timeout` bounds each step (--step-timeout-seconds). `metrics` (borrowed, may be null:
  // no metrics) must outlive the service.
  InferenceService(const ServedModel* model, WorkerPool* pool, absl::Duration step_timeout,
                   CoordinatorMetrics* metrics = nullptr)
      : model_(model), pool_(pool), step_timeout_(step_timeout), metrics_(metrics) {}

  grpc::Status Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override;
  grpc::Status Tokenize(grpc::ServerContext* context, const v1::TokenizeRequest* request,
                        v1::TokenizeResponse* response) override;
  grpc::Status GetModelInfo(grpc::ServerContext* context, const v1::GetModelInfoRequest* request,
                            v1::ModelInfo* response) override;
  grpc::Status GetClusterStatus(grpc::ServerContext* context, const v1::GetClusterStatusRequest* request,
                                v1::ClusterStatus* response) override;

  // Refuses new requests and makes queued ones return (UNAVAILABLE). The running one ends at its
  // next step, when the pool is shut down too.
  void Shutdown();

 private:
  // Waits until no other request runs: OK with the turn taken, Cancelled when the client gives up,
  // Unavailable when shutting down.
  absl::Status TakeTurn(grpc::ServerContext* context);
  void ReleaseTurn();
  bool TurnFree() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !busy_ || shutting_down_; }
  // Runs a checked request to its end; an error is the status the stream ends with.
  // `arrival`: when the call came in (for the latency metrics).
  absl::Status Run(grpc::ServerContext* context, const GenerationParams& params,
                   std::chrono::steady_clock::time_point arrival, grpc::ServerWriter<v1::GenerateResponse>* writer);
  // Generate without the end-of-call metrics.
  absl::Status GenerateStatus(grpc::ServerContext* context, const v1::GenerateRequest* request,
                              std::chrono::steady_clock::time_point arrival,
                              grpc::ServerWriter<v1::GenerateResponse>* writer);
  void FillModelInfo(v1::ModelInfo* info);

  const ServedModel* const model_;
  WorkerPool* const pool_;
  const absl::Duration step_timeout_;
  CoordinatorMetrics* const metrics_;  // may be null

  std::atomic<uint64_t> next_request_ = 1;  // for ids of requests that bring none
  std::atomic<uint64_t> next_step_ = 1;     // step ids, increasing across requests

  mutable absl::Mutex mu_;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;  // a Generate holds the turn
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_SERVER_INFERENCE_SERVICE_H_
