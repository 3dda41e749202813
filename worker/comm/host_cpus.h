// The CPUs that the ranks of a group on one host share. A CPU worker's math runs on OpenMP threads
// whose idle ones spin before they sleep: where a host's workers run more threads in all than the
// CPUs they may use, each collective waits on a peer whose threads are descheduled behind those
// spinning ones, and a step takes many times its time (docs/performance.md, "TP and PP on one
// host"). The worker says so at load, naming the share each should take.
#ifndef SHARDSERVE_WORKER_COMM_HOST_CPUS_H_
#define SHARDSERVE_WORKER_COMM_HOST_CPUS_H_

#include <sched.h>

#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/communicator.h"

namespace shardserve {

// One rank's compute threads and the CPUs it may run on (its affinity).
struct RankCpus {
  int threads = 0;
  cpu_set_t cpus;
};

// "" when the ranks' threads fit the CPUs they may use together (the union of their sets: ranks
// pinned to CPUs of their own are counted apart); else a sentence for the worker's log naming the
// threads, the CPUs and each rank's share.
std::string OversubscriptionNote(absl::Span<const RankCpus> ranks);

// Gathers each rank's `threads` and affinity (sched_getaffinity) through `group`, whose ranks share
// a host, and returns OversubscriptionNote of them: the same on every rank. Every rank calls it at
// the same point of its collectives (an AllGather).
absl::StatusOr<std::string> HostCpuShare(Communicator& group, int threads);

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_COMM_HOST_CPUS_H_
