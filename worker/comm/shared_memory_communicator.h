// Collectives through shared memory for a CPU group whose ranks run on one host. Every operation
// goes through a segment that every rank maps: each rank copies its tensor in, waits for its
// peers' copies, and sums or copies them out, which costs microseconds where Gloo's loopback TCP
// costs a few hundred for the messages and wake-ups of each of a decode step's collectives
// (docs/performance.md, "TP and PP on one host"). Only Send and Recv in a group of more than two ranks
// (which the worker does not form) stay with the wrapped communicator.
#ifndef SHARDSERVE_WORKER_COMM_SHARED_MEMORY_COMMUNICATOR_H_
#define SHARDSERVE_WORKER_COMM_SHARED_MEMORY_COMMUNICATOR_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/communicator.h"

namespace shardserve {

// Returns a communicator that runs the group's operations through shared memory when every rank
// of `host`'s group maps one POSIX shared-memory segment (one host and one /dev/shm: processes of
// one machine, or the containers of one pod), and `host` itself otherwise (ranks on several
// machines, or in separate pods). Every rank of the group calls this at the same point of its
// sequence of collectives, right after joining `host`: the ranks agree through two small
// AllGathers of `host`, whose errors this returns. `group_name` names the group in messages;
// `timeout` bounds each wait for the peers, as it does `host`'s.
//
// The segment holds two buffers of 1 MiB a rank (reserved when it is made, so a full /dev/shm is a
// fallback to `host`, not a SIGBUS later); larger tensors go through in pieces. It is unlinked as
// soon as every rank has mapped it, so nothing is left in /dev/shm when the processes end. Each
// rank keeps one thread, asleep, that holds its liveness mutex (see the .cc).
//
// The Communicator contract holds: every rank sums in rank order (the same bits on every rank); a
// wait longer than `timeout` is DeadlineExceeded naming the ranks that did not arrive; a peer whose
// process ended (seen within about 10 ms of waiting), whose communicator was destroyed, or which
// gave up after an error of its own is Unavailable; ranks that call different collectives, dtypes
// or sizes at the same point are InvalidArgument on every rank, naming both (AllToAllV: the pair
// whose counts, dtypes or row shapes disagree, before any row moves; Send and Recv: both ranks,
// where a Recv of another shape leaves a TCP sender to time out); after any error every
// call is FailedPrecondition quoting it. Not thread-safe, like every Communicator.
absl::StatusOr<std::unique_ptr<Communicator>> WithSharedMemory(std::unique_ptr<Communicator> host,
                                                               const std::string& group_name, absl::Duration timeout);

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_COMM_SHARED_MEMORY_COMMUNICATOR_H_
