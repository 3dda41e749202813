// A Communicator that forwards every call to another one and adds up the time the calls take, so
// that a step can report its forward time and its collective time apart (StepResult).
//
// Before each call with peers it waits for the work the backend has queued (Backend::Synchronize).
// On the CPU backend that costs nothing. On CUDA it keeps the kernels' time out of the
// collective's, and it orders a collective that runs on another CUDA stream than the backend's
// after the kernels that produce its input (the worker runs NCCL on the legacy default stream:
// step_executor.cc).
//
// Each call can also be reported to a CollectiveObserver (the worker's Prometheus metrics).
//
// The inner communicator can be replaced (Replace) when the group re-forms under a new epoch, so
// that whoever holds this one (the shard holds the TP group's) keeps a valid pointer.
//
// Ownership: owns the inner communicator; borrows the backend and the observer, which must outlive
// it.
// Threading: as any Communicator, one thread at a time.
#ifndef SHARDSERVE_WORKER_TIMED_COMMUNICATOR_H_
#define SHARDSERVE_WORKER_TIMED_COMMUNICATOR_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <utility>

#include "worker/communicator.h"
#include "base/status_macros.h"

namespace shardserve {

enum class CollectiveOp { kAllReduce, kAllGather, kSend, kRecv, kAllToAll, kBarrier };

// Told about every collective call as it returns: its op, seconds and bytes (the tensor this rank
// reduced, contributed to the gather, sent or received; for an all-to-all, the rows it sent, its
// own included; 0 for a barrier). Called on the step's thread; must not block.
class CollectiveObserver {
 public:
  virtual ~CollectiveObserver() = default;
  virtual void Observe(CollectiveOp op, double seconds, uint64_t bytes) = 0;
};

class TimedCommunicator final : public Communicator {
 public:
  TimedCommunicator(std::unique_ptr<Communicator> inner, Backend* backend)
      : inner_(std::move(inner)), backend_(backend) {}

  int rank() const override { return inner_ != nullptr ? inner_->rank() : 0; }
  int size() const override { return inner_ != nullptr ? inner_->size() : 0; }
  absl::Status AllReduceSum(Tensor* t) override {
    return Timed(CollectiveOp::kAllReduce, t->bytes(), [&] { return inner_->AllReduceSum(t); });
  }
  absl::Status AllGather(Tensor* out, const Tensor& in) override {
    return Timed(CollectiveOp::kAllGather, in.bytes(), [&] { return inner_->AllGather(out, in); });
  }
  absl::Status Send(const Tensor& t, int peer) override {
    return Timed(CollectiveOp::kSend, t.bytes(), [&] { return inner_->Send(t, peer); });
  }
  absl::Status Recv(Tensor* t, int peer) override {
    return Timed(CollectiveOp::kRecv, t->bytes(), [&] { return inner_->Recv(t, peer); });
  }
  absl::Status AllToAllV(Tensor* out, const Tensor& in, absl::Span<const int64_t> send_rows,
                         absl::Span<const int64_t> recv_rows) override {
    return Timed(CollectiveOp::kAllToAll, in.bytes(), [&] { return inner_->AllToAllV(out, in, send_rows, recv_rows); });
  }
  absl::Status Barrier() override {
    return Timed(CollectiveOp::kBarrier, 0, [&] { return inner_->Barrier(); });
  }

  // Where every call is reported from now on (null: nowhere).
  void set_observer(CollectiveObserver* observer) { observer_ = observer; }

  // Closes the inner communicator (its peers see the connections drop) and forwards to `inner`
  // from now on (null: only until the next Replace; no call may come in between).
  void Replace(std::unique_ptr<Communicator> inner) {
    inner_.reset();
    inner_ = std::move(inner);
  }

  // Seconds spent in calls since the last ResetSeconds() (or construction).
  double seconds() const { return seconds_; }
  void ResetSeconds() { seconds_ = 0; }

 private:
  template <typename Call>
  absl::Status Timed(CollectiveOp op, uint64_t bytes, Call&& call) {
    // A group of one (LocalCommunicator) communicates nothing: its calls are the identity or a copy
    // queued on the backend itself, so there is nothing to order or time, and on CUDA a wait here
    // would stall the step twice per layer.
    if (inner_ == nullptr) return absl::FailedPreconditionError("the collective group is closed (a step or a regroup failed; it re-forms at the next regroup)");
    if (inner_->size() > 1) {
      SHARDSERVE_RETURN_IF_ERROR(backend_->Synchronize());
    }
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = call();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    seconds_ += seconds;
    if (observer_ != nullptr) observer_->Observe(op, seconds, bytes);
    return s;
  }

  std::unique_ptr<Communicator> inner_;
  Backend* const backend_;
  CollectiveObserver* observer_ = nullptr;
  double seconds_ = 0;
};

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_TIMED_COMMUNICATOR_H_
