// The coordinator's side of worker.proto: each worker's Connect stream (handed to the WorkerPool)
// and the rendezvous store the workers' collectives form their groups through.
//
// Ownership: borrows the pool, which must outlive the service. Threading: gRPC calls the methods
// from its threads, concurrently; everything here is thread-safe.
#ifndef SHARDSERVE_COORDINATOR_SERVER_WORKER_CONTROL_SERVICE_H_
#define SHARDSERVE_COORDINATOR_SERVER_WORKER_CONTROL_SERVICE_H_

#include <functional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/server/worker_pool.h"
#include "shardserve/v1/worker.grpc.pb.h"

namespace shardserve {

// Keys and values published by the workers' collectives while they form their groups
// (worker/comm/rendezvous.h explains the keys). Bounded in the number and size of entries, so a
// confused or hostile client cannot exhaust the coordinator's memory. Thread-safe.
class RendezvousTable {
 public:
  // InvalidArgument for an empty or oversized key or value; ResourceExhausted when full.
  absl::Status Set(const std::string& key, const std::string& value);
  // Waits until `key` is set (its value), `deadline` passes (DeadlineExceeded naming the key), or
  // `cancelled` turns true (Cancelled). `cancelled` is polled every 100 ms.
  absl::StatusOr<std::string> Get(const std::string& key, absl::Time deadline,
                                  const std::function<bool()>& cancelled);

 private:
  absl::Mutex mu_;
  absl::CondVar set_;  // signalled on every Set
  absl::flat_hash_map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

class WorkerControlService final : public v1::WorkerControl::Service {
 public:
  explicit WorkerControlService(WorkerPool* pool) : pool_(pool) {}

  grpc::Status Connect(grpc::ServerContext* context,
                       grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage>* stream) override;
  grpc::Status RendezvousSet(grpc::ServerContext* context, const v1::RendezvousSetRequest* request,
                             v1::RendezvousSetResponse* response) override;
  grpc::Status RendezvousGet(grpc::ServerContext* context, const v1::RendezvousGetRequest* request,
                             v1::RendezvousGetResponse* response) override;

  // Makes waiting RendezvousGet calls return at once (Unavailable), and every later one.
  void Shutdown();

 private:
  WorkerPool* const pool_;
  RendezvousTable table_;
  absl::Mutex mu_;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_SERVER_WORKER_CONTROL_SERVICE_H_
