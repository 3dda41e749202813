// A Communicator for device tensors over a host communicator (Gloo): every call copies the device
// tensor to host memory, runs the inner collective on the host copy, and copies the result back.
// For TP and PP as several worker processes sharing one GPU (worker --collectives gloo on
// --device cuda), where NCCL refuses two ranks on one device. The model code is the same: it
// calls the communicator at the same places with device tensors.
//
//   AllReduceSum(t):  t (device) -> host; F16/BF16 widened to F32 on the host (Gloo sums F32 and
//                     I32 only; one rounding of the float32 sum back to t's dtype); inner
//                     AllReduceSum; narrowed; -> t
//   AllGather(out,in): in -> host; inner AllGather into a host out; -> out
//   Send(t) / Recv(t): t -> host; inner Send / inner Recv into host; -> t
//   AllToAllV(out,in): in -> host; inner AllToAllV into a host out; -> out
//   Barrier():         waits for the device's queued work (DeviceCopier::Synchronize), then the
//                      inner Barrier
//
// Staging memory is plain (pageable) host memory, grown to the largest call and kept (nothing is
// allocated per step once the largest step has run). Pinned memory would let the copies overlap;
// not done: this path is for correctness runs on one GPU, not for speed.
//
// Errors: as any Communicator (worker/communicator.h). A failed copy also breaks the communicator:
// every later call returns FailedPrecondition quoting the first error.
//
// Ownership: owns the inner communicator and the copier. Threading: one thread at a time.
#ifndef SHARDSERVE_WORKER_COMM_STAGED_COMMUNICATOR_H_
#define SHARDSERVE_WORKER_COMM_STAGED_COMMUNICATOR_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/tensor.h"
#include "worker/communicator.h"

namespace shardserve {

// Copies between the device memory the forward pass uses and host memory.
class DeviceCopier {
 public:
  virtual ~DeviceCopier() = default;
  // Returns once host_dst holds the bytes (after the device's queued work that writes src).
  virtual absl::Status ToHost(void* host_dst, const void* device_src, size_t bytes) = 0;
  // Returns once host_src may be reused.
  virtual absl::Status ToDevice(void* device_dst, const void* host_src, size_t bytes) = 0;
  // Waits for the device's queued work.
  virtual absl::Status Synchronize() = 0;
};

// The copies of a Backend (CopyToHost / CopyToDevice / Synchronize). Borrows the backend, which
// must outlive it.
class BackendCopier final : public DeviceCopier {
 public:
  explicit BackendCopier(Backend* backend) : backend_(backend) {}
  absl::Status ToHost(void* host_dst, const void* device_src, size_t bytes) override {
    return backend_->CopyToHost(host_dst, device_src, bytes);
  }
  absl::Status ToDevice(void* device_dst, const void* host_src, size_t bytes) override {
    return backend_->CopyToDevice(device_dst, host_src, bytes);
  }
  absl::Status Synchronize() override { return backend_->Synchronize(); }

 private:
  Backend* const backend_;
};

class StagedCommunicator final : public Communicator {
 public:
  StagedCommunicator(std::unique_ptr<Communicator> inner, std::unique_ptr<DeviceCopier> copier)
      : inner_(std::move(inner)), copier_(std::move(copier)) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::Status AllReduceSum(Tensor* t) override;
  absl::Status AllGather(Tensor* out, const Tensor& in) override;
  absl::Status Send(const Tensor& t, int peer) override;
  absl::Status Recv(Tensor* t, int peer) override;
  absl::Status AllToAllV(Tensor* out, const Tensor& in, absl::Span<const int64_t> send_rows,
                         absl::Span<const int64_t> recv_rows) override;
  absl::Status Barrier() override;

 private:
  // Runs `call` unless an earlier call failed; remembers its first error.
  template <typename Call>
  absl::Status Guard(const char* op, Call&& call);
  // Guard of op: in to host_, collective(host out in wide_, host in), wide_ to out.
  template <typename Collective>
  absl::Status InToOut(const char* op, Tensor* out, const Tensor& in, Collective&& collective);
  // host_ (or wide_) grown to at least `bytes`; returns its data.
  static void* Grow(std::vector<uint8_t>* v, size_t bytes);

  const std::unique_ptr<Communicator> inner_;
  const std::unique_ptr<DeviceCopier> copier_;
  std::vector<uint8_t> host_;   // the device tensor's bytes (AllGather, AllToAllV: the input)
  std::vector<uint8_t> wide_;   // AllReduceSum of F16/BF16: the float32 copy; AllGather, AllToAllV: the output
  absl::Status error_;          // the first error; OK until one
};

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_COMM_STAGED_COMMUNICATOR_H_
