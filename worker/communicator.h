// The collectives a model-parallel group needs, behind one interface: all-reduce and all-gather
// for a tensor-parallel group, send/recv for the hidden state between pipeline stages, all-to-all
// for the tokens an expert-parallel group routes to each other's experts, barrier.
// Implementations: NCCL on GPUs and Gloo over TCP on CPUs (worker/comm/); LocalCommunicator for a
// group of one, where every collective is the identity, so TP = 1 runs the same forward pass as
// any other size.
//
// Contract shared by every implementation:
// - Collectives are matched by order: every rank of the group calls the same sequence of
//   collectives with the same dtypes and shapes, and each Send is matched by a Recv of the same
//   dtype and shape on the peer. Nothing on the wire tags a call with its step.
// - Every call blocks until this rank's part is complete: the result is in the output tensor and
//   the inputs may be reused. Send therefore waits until the peer posts its Recv; two ranks that
//   both Send to each other first wait for each other until the timeout, so order the pairs.
// - Timeouts. Every communicator with peers is created with a timeout. An operation that does not
//   complete within it returns absl::DeadlineExceededError naming the operation, the group and the
//   peer ranks it waited on. (Gloo bounds each wait for a peer, so the limit is `timeout` without
//   progress from the peers; NCCL bounds the whole call.) No call hangs.
// - A lost connection to a peer (its process exited, or it gave up after its own timeout and
//   closed the connection) is absl::UnavailableError; an argument the implementation cannot
//   accept (shape, dtype, peer rank, row counts) is absl::InvalidArgumentError.
// - After any error, the argument errors included, the communicator is unusable: the peers'
//   sequence of collectives is no longer in step with this rank's. Every later call returns
//   absl::FailedPreconditionError at once, quoting the first error. Recovery is a new communicator
//   under a new group name, arranged by the coordinator.
//
// Threading: a Communicator is used by one thread at a time (the worker's step loop); it is not
// thread-safe. Tensors live on the device of the backend the forward pass uses (host memory for
// Gloo, device memory of the communicator's GPU for NCCL).
#ifndef SHARDSERVE_WORKER_COMMUNICATOR_H_
#define SHARDSERVE_WORKER_COMMUNICATOR_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/tensor.h"

namespace shardserve {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Sums `t` element-wise across the group, in place. Every rank passes the same shape.
  virtual absl::Status AllReduceSum(Tensor* t) = 0;
  // out[r] = in of rank r: out is [size, ...in's shape], in the same dtype. in and out must not
  // overlap.
  virtual absl::Status AllGather(Tensor* out, const Tensor& in) = 0;
  // Point-to-point, for the hidden state between pipeline stages: sends `t` to rank `peer`
  // (!= rank()), whose matching Recv(·, rank()) names the same dtype and shape.
  virtual absl::Status Send(const Tensor& t, int peer) = 0;
  // Receives into `t` what rank `peer` (!= rank()) sends with its matching Send.
  virtual absl::Status Recv(Tensor* t, int peer) = 0;
  // Every rank sends a block of rows to every rank (itself included), for expert parallelism. A row
  // is an entry of the leading dimension. `in` is [sum(send_rows), ...row shape]: send_rows[p] rows
  // for rank p, in rank order. `out` is [sum(recv_rows), ...the same row shape] in in's dtype, and
  // receives recv_rows[p] rows from rank p, in rank order. Both spans have size() entries, none
  // negative; a count may be 0. Rank r's send_rows[p] must equal rank p's recv_rows[r]: the ranks
  // exchange their counts first (an AllGather of them, as expert parallelism does). in and out
  // must not overlap. Arguments that break these rules on one rank are InvalidArgument there
  // (CheckAllToAllVArgs). Counts that disagree between two ranks are InvalidArgument on Gloo, which
  // exchanges them before any row; NCCL does not check them (see MakeNcclCommunicator).
  virtual absl::Status AllToAllV(Tensor* out, const Tensor& in, absl::Span<const int64_t> send_rows,
                                 absl::Span<const int64_t> recv_rows) = 0;
  // Returns once every rank of the group has called Barrier (and, on GPUs, once the work this rank
  // enqueued before it has finished).
  virtual absl::Status Barrier() = 0;
};

// The arguments AllToAllV accepts from rank `rank` of a group of `size` (see Communicator): in and
// out in one dtype, each with a leading dimension and the same dimensions after it, not
// overlapping; send_rows and recv_rows with `size` entries, none negative, summing to in's and
// out's rows; send_rows[rank] == recv_rows[rank] (a rank's rows to itself). Returns the elements in
// one row, or InvalidArgument naming what is wrong. Every implementation checks with this.
absl::StatusOr<int64_t> CheckAllToAllVArgs(const Tensor& out, const Tensor& in, absl::Span<const int64_t> send_rows,
                                           absl::Span<const int64_t> recv_rows, int rank, int size);

// A group of one rank: collectives are the identity and there is no peer to send to, so nothing
// can time out. `backend` (not owned) copies for AllGather and AllToAllV and must outlive this.
class LocalCommunicator final : public Communicator {
 public:
  explicit LocalCommunicator(Backend* backend) : backend_(backend) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  absl::Status AllReduceSum(Tensor*) override { return absl::OkStatus(); }
  absl::Status AllGather(Tensor* out, const Tensor& in) override {
    if (out->data == in.data) return absl::OkStatus();
    return backend_->CopyOnDevice(out->data, in.data, in.bytes());
  }
  absl::Status Send(const Tensor&, int peer) override { return NoPeer("Send", peer); }
  absl::Status Recv(Tensor*, int peer) override { return NoPeer("Recv", peer); }
  // Copies in to out: all of in's rows are this rank's own. (worker/communicator.cc)
  absl::Status AllToAllV(Tensor* out, const Tensor& in, absl::Span<const int64_t> send_rows,
                         absl::Span<const int64_t> recv_rows) override;
  absl::Status Barrier() override { return absl::OkStatus(); }

 private:
  static absl::Status NoPeer(const char* op, int peer) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, " with peer rank ", peer, " in a group of one (LocalCommunicator): there is no peer"));
  }

  Backend* backend_;
};

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_COMMUNICATOR_H_
