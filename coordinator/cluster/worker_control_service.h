// The coordinator's side of worker.proto: each worker's Connect stream (handed to the WorkerPool)
// and the rendezvous store the workers' collectives form their groups through.
//
// With mutual TLS (the coordinator's --tls-ca), every call must come from a peer that presented a
// certificate from the cluster's CA: the port asks for one but, since it also serves the client
// API, lets a client without one connect; such a call here is refused (UNAUTHENTICATED), logged
// with the peer's address and counted (shardserve_auth_failures_total{reason="no_client_certificate"})
// before a Connect's register is even read, so it never gets a slot. A certificate from another CA
// fails the handshake itself.
//
// Rendezvous calls are bound to their writer as well: each carries the token of the caller's
// Assignment or Regroup, and a key is taken only from the rank it names and given only to the
// members of its group (rendezvous_grants.h); anything else is PERMISSION_DENIED naming the key and
// why, logged with the peer's address and counted
// (shardserve_auth_failures_total{reason="rendezvous_denied"}).
//
// A Connect stream holds one of gRPC's threads. Until its first message (a worker sends its register
// at once) it is unauthenticated by the pool: at most ConnectLimits::max_unregistered such streams
// at once (the next is refused RESOURCE_EXHAUSTED at once, logged with its peer), each for at most
// register_timeout (then cancelled and logged), so that silent streams cannot hold the
// coordinator's threads. Registered streams are bounded by the pool's slots.
//
// Ownership: borrows the pool and the metrics, which must outlive the service. Threading: gRPC calls the methods
// from its threads, concurrently; everything here is thread-safe.
#ifndef SHARDSERVE_COORDINATOR_CLUSTER_WORKER_CONTROL_SERVICE_H_
#define SHARDSERVE_COORDINATOR_CLUSTER_WORKER_CONTROL_SERVICE_H_

#include <functional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/telemetry/metrics.h"
#include "coordinator/cluster/rendezvous_grants.h"
#include "coordinator/cluster/rendezvous_table.h"
#include "coordinator/cluster/worker_pool.h"
#include "shardserve/v1/worker.grpc.pb.h"

namespace shardserve {

// Connect streams that have not sent their first message yet (see above).
struct ConnectLimits {
  int max_unregistered = 64;
  absl::Duration register_timeout = absl::Seconds(30);
};

class WorkerControlService final : public v1::WorkerControl::Service {
 public:
  // `require_client_certificate`: mutual TLS (see above). `metrics` may be null. `grants`: who may
  // rendezvous (borrowed); null: the pool's. With neither, every rendezvous call is refused.
  explicit WorkerControlService(WorkerPool* pool, bool require_client_certificate = false,
                                CoordinatorMetrics* metrics = nullptr, RendezvousGrants* grants = nullptr,
                                ConnectLimits connect_limits = {})
      : pool_(pool),
        require_client_certificate_(require_client_certificate),
        metrics_(metrics),
        grants_(grants != nullptr ? grants : pool != nullptr ? pool->rendezvous_grants() : nullptr),
        connect_limits_(connect_limits) {}

  grpc::Status Connect(grpc::ServerContext* context,
                       grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage>* stream) override;
  grpc::Status RendezvousSet(grpc::ServerContext* context, const v1::RendezvousSetRequest* request,
                             v1::RendezvousSetResponse* response) override;
  grpc::Status RendezvousGet(grpc::ServerContext* context, const v1::RendezvousGetRequest* request,
                             v1::RendezvousGetResponse* response) override;

  // Makes waiting RendezvousGet calls return at once (Unavailable), and every later one.
  void Shutdown();

  // Connect streams waiting for their first message now.
  int unregistered_connects();

 private:
  // OK, or UNAUTHENTICATED (logged, counted) when mutual TLS is on and the peer has no verified
  // certificate. `call` names the method for the log.
  grpc::Status Authenticate(grpc::ServerContext* context, const char* call);
  // OK, or PERMISSION_DENIED (logged with the peer, counted) when `check` refused the call.
  grpc::Status Authorize(grpc::ServerContext* context, const absl::Status& check);

  WorkerPool* const pool_;
  const bool require_client_certificate_;
  CoordinatorMetrics* const metrics_;  // may be null
  RendezvousGrants* const grants_;     // may be null: no rendezvous allowed
  const ConnectLimits connect_limits_;
  RendezvousTable table_;
  absl::Mutex mu_;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  int unregistered_ ABSL_GUARDED_BY(mu_) = 0;  // Connect streams before their first message
};

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_CLUSTER_WORKER_CONTROL_SERVICE_H_
