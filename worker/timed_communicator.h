// A Communicator that forwards every call to another one and adds up the time the calls take, so
// that a step can report its forward time and its collective time apart (StepResult).
//
// Before each call it waits for the work the backend has queued (Backend::Synchronize). On the CPU
// backend that costs nothing. On CUDA it keeps the kernels' time out of the collective's, and it
// orders a collective that runs on another CUDA stream than the backend's after the kernels that
// produce its input (the worker runs NCCL on the legacy default stream: step_executor.cc).
//
// Ownership: owns the inner communicator; borrows the backend, which must outlive it.
// Threading: as any Communicator, one thread at a time.
#ifndef SHARDSERVE_WORKER_TIMED_COMMUNICATOR_H_
#define SHARDSERVE_WORKER_TIMED_COMMUNICATOR_H_

#include <chrono>
#include <memory>
#include <utility>

#include "worker/communicator.h"

namespace shardserve {

class TimedCommunicator final : public Communicator {
 public:
  TimedCommunicator(std::unique_ptr<Communicator> inner, Backend* backend)
      : inner_(std::move(inner)), backend_(backend) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::Status AllReduceSum(Tensor* t) override {
    return Timed([&] { return inner_->AllReduceSum(t); });
  }
  absl::Status AllGather(Tensor* out, const Tensor& in) override {
    return Timed([&] { return inner_->AllGather(out, in); });
  }
  absl::Status Send(const Tensor& t, int peer) override {
    return Timed([&] { return inner_->Send(t, peer); });
  }
  absl::Status Recv(Tensor* t, int peer) override {
    return Timed([&] { return inner_->Recv(t, peer); });
  }
  absl::Status Barrier() override {
    return Timed([&] { return inner_->Barrier(); });
  }

  // Seconds spent in calls since the last ResetSeconds() (or construction).
  double seconds() const { return seconds_; }
  void ResetSeconds() { seconds_ = 0; }

 private:
  template <typename Call>
  absl::Status Timed(Call&& call) {
    if (absl::Status s = backend_->Synchronize(); !s.ok()) return s;
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = call();
    seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return s;
  }

  const std::unique_ptr<Communicator> inner_;
  Backend* const backend_;
  double seconds_ = 0;
};

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_TIMED_COMMUNICATOR_H_
