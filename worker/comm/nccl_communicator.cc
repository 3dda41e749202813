#include "worker/comm/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cuda/cuda_check.h"
#include "worker/comm/checks.h"

namespace shardserve {
namespace {

// A Status for the failed NCCL result `r` (neither ncclSuccess nor ncclInProgress) of `what`. The
// code says what a caller can do: a peer or the network failed -> Unavailable; a bad argument or
// call -> InvalidArgument; CUDA or NCCL internals -> Internal.
absl::Status NcclError(ncclResult_t r, ncclComm_t comm, const char* what) {
  absl::StatusCode code = absl::StatusCode::kInternal;
  switch (r) {
    case ncclSystemError:
    case ncclRemoteError: code = absl::StatusCode::kUnavailable; break;
    case ncclInvalidArgument:
    case ncclInvalidUsage: code = absl::StatusCode::kInvalidArgument; break;
    default: break;
  }
  const char* detail = ncclGetLastError(comm);
  return absl::Status(code, absl::StrCat(what, ": NCCL error ", ncclGetErrorString(r),
                                         detail != nullptr && *detail != '\0' ? absl::StrCat(" (", detail, ")") : ""));
}

// OK when a call on a non-blocking communicator was accepted: done, or running in the background.
absl::Status Accepted(ncclResult_t r, ncclComm_t comm, const char* call) {
  return r == ncclSuccess || r == ncclInProgress ? absl::OkStatus() : NcclError(r, comm, call);
}

absl::StatusOr<ncclDataType_t> NcclType(DType t) {
  switch (t) {
    case DType::kF32: return ncclFloat32;
    case DType::kF16: return ncclFloat16;
    case DType::kBF16: return ncclBfloat16;
    case DType::kI32: return ncclInt32;
    case DType::kI8: return ncclInt8;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype #", static_cast<int>(t)));
}

// Owns a non-blocking NCCL communicator (created with ncclConfig_t::blocking = 0, so that no NCCL
// call blocks the host and every wait below can end at a deadline), the device scalar Barrier
// all-reduces and the event that marks the end of each call's work on the stream. Not thread-safe
// (see Communicator).
class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(int rank, int size, int device, cudaStream_t stream, std::string where, absl::Duration timeout)
      : rank_(rank),
        size_(size),
        device_(device),
        stream_(stream),
        where_(std::move(where)),
        other_ranks_(comm::OtherRanks(rank, size)),
        timeout_(timeout) {}

  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  // Errors are not reported from here: a healthy communicator is finalized (which waits for the
  // peers' outstanding work, up to the timeout), any other one aborted.
  ~NcclCommunicator() override {
    cudaSetDevice(device_);
    if (comm_ != nullptr) {
      const bool finalized =
          Accepted(ncclCommFinalize(comm_), comm_, "ncclCommFinalize").ok() && WaitForComm(absl::Now() + timeout_).ok();
      if (finalized) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    }
    if (done_ != nullptr) cudaEventDestroy(done_);
    if (scalar_ != nullptr) cudaFree(scalar_);
  }

  // Allocates the buffers, takes part in the unique-id exchange and creates the NCCL communicator,
  // all within the timeout. On error the destructor frees what was made.
  absl::Status Init(RendezvousStore* store, const std::string& group_name) {
    const absl::Time deadline = absl::Now() + timeout_;
    SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaMalloc(&scalar_, sizeof(float)));
    SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaMemset(scalar_, 0, sizeof(float)));
    SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));

    const std::string key = absl::StrCat(group_name, "/nccl/unique_id");
    ncclUniqueId id;
    if (rank_ == 0) {
      if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) return NcclError(r, nullptr, "ncclGetUniqueId");
      if (absl::Status s = store->Set(key, std::string(id.internal, sizeof(id.internal))); !s.ok()) {
        return absl::Status(
            s.code(), absl::StrCat("NCCL rendezvous of ", where_, ": publishing the unique id failed: ", s.message()));
      }
    } else {
      absl::StatusOr<std::string> value = store->Get(key, std::max(deadline - absl::Now(), absl::ZeroDuration()));
      if (!value.ok()) {
        const std::string what = value.status().code() == absl::StatusCode::kDeadlineExceeded
                                     ? absl::StrCat("timed out: rank 0 did not publish the NCCL unique id within ",
                                                    absl::FormatDuration(timeout_))
                                     : std::string("failed: the rendezvous store returned an error");
        return absl::Status(value.status().code(),
                            absl::StrCat("NCCL rendezvous of ", where_, " ", what, ": ", value.status().message()));
      }
      if (value->size() != sizeof(id.internal)) {
        return absl::InvalidArgumentError(absl::StrCat("NCCL rendezvous of ", where_, ": the store holds ",
                                                       value->size(), " bytes under '", key, "', not the ",
                                                       sizeof(id.internal), " of an NCCL unique id"));
      }
      std::memcpy(id.internal, value->data(), sizeof(id.internal));
    }

    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    if (absl::Status s =
            Accepted(ncclCommInitRankConfig(&comm_, size_, id, rank_, &config), comm_, "ncclCommInitRankConfig");
        !s.ok()) {
      Abort();
      return absl::Status(s.code(), absl::StrCat("NCCL rendezvous of ", where_, ": ", s.message()));
    }
    if (absl::Status s = WaitForComm(deadline); !s.ok()) {
      Abort();
      if (s.code() == absl::StatusCode::kDeadlineExceeded) {
        return absl::DeadlineExceededError(absl::StrCat("NCCL rendezvous of ", where_, " timed out: ", other_ranks_,
                                                        " did not all join within ", absl::FormatDuration(timeout_),
                                                        " (NCCL does not say which)"));
      }
      return absl::Status(s.code(), absl::StrCat("NCCL rendezvous of ", where_, ": ", s.message()));
    }
    return absl::OkStatus();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::Status AllReduceSum(Tensor* t) override {
    return Run("AllReduceSum", other_ranks_, [&]() -> absl::Status {
      SHARDSERVE_ASSIGN_OR_RETURN(const ncclDataType_t type, NcclType(t->dtype));
      return Accepted(ncclAllReduce(t->data, t->data, static_cast<size_t>(t->numel()), type, ncclSum, comm_, stream_),
                      comm_, "ncclAllReduce");
    });
  }

  absl::Status AllGather(Tensor* out, const Tensor& in) override {
    return Run("AllGather", other_ranks_, [&]() -> absl::Status {
      SHARDSERVE_RETURN_IF_ERROR(comm::CheckAllGatherShapes(*out, in, size_));
      SHARDSERVE_ASSIGN_OR_RETURN(const ncclDataType_t type, NcclType(in.dtype));
      return Accepted(ncclAllGather(in.data, out->data, static_cast<size_t>(in.numel()), type, comm_, stream_), comm_,
                      "ncclAllGather");
    });
  }

  absl::Status Send(const Tensor& t, int peer) override {
    return Run("Send", absl::StrCat("rank ", peer), [&]() -> absl::Status {
      SHARDSERVE_RETURN_IF_ERROR(comm::CheckPeer(peer, rank_, size_));
      SHARDSERVE_ASSIGN_OR_RETURN(const ncclDataType_t type, NcclType(t.dtype));
      return Accepted(ncclSend(t.data, static_cast<size_t>(t.numel()), type, peer, comm_, stream_), comm_, "ncclSend");
    });
  }

  absl::Status Recv(Tensor* t, int peer) override {
    return Run("Recv", absl::StrCat("rank ", peer), [&]() -> absl::Status {
      SHARDSERVE_RETURN_IF_ERROR(comm::CheckPeer(peer, rank_, size_));
      SHARDSERVE_ASSIGN_OR_RETURN(const ncclDataType_t type, NcclType(t->dtype));
      return Accepted(ncclRecv(t->data, static_cast<size_t>(t->numel()), type, peer, comm_, stream_), comm_,
                      "ncclRecv");
    });
  }

  // One NCCL group of a send and a receive per rank with rows to move, this rank's own included
  // (NCCL copies those), so that NCCL schedules them together and no order of the ranks deadlocks.
  absl::Status AllToAllV(Tensor* out, const Tensor& in, absl::Span<const int64_t> send_rows,
                         absl::Span<const int64_t> recv_rows) override {
    return Run("AllToAllV", other_ranks_, [&]() -> absl::Status {
      SHARDSERVE_ASSIGN_OR_RETURN(const int64_t row_elements,
                                  CheckAllToAllVArgs(*out, in, send_rows, recv_rows, rank_, size_));
      SHARDSERVE_ASSIGN_OR_RETURN(const ncclDataType_t type, NcclType(in.dtype));
      const size_t row = static_cast<size_t>(row_elements), row_bytes = row * DTypeSize(in.dtype);
      SHARDSERVE_RETURN_IF_ERROR(Accepted(ncclGroupStart(), comm_, "ncclGroupStart"));
      absl::Status enqueued;
      size_t send_at = 0, recv_at = 0;  // bytes into in and out
      for (int p = 0; p < size_ && enqueued.ok(); ++p) {
        const size_t send_n = static_cast<size_t>(send_rows[p]) * row, recv_n = static_cast<size_t>(recv_rows[p]) * row;
        if (send_n > 0) {
          enqueued = Accepted(ncclSend(in.as<uint8_t>() + send_at, send_n, type, p, comm_, stream_), comm_, "ncclSend");
        }
        if (recv_n > 0 && enqueued.ok()) {
          enqueued =
              Accepted(ncclRecv(out->as<uint8_t>() + recv_at, recv_n, type, p, comm_, stream_), comm_, "ncclRecv");
        }
        send_at += static_cast<size_t>(send_rows[p]) * row_bytes;
        recv_at += static_cast<size_t>(recv_rows[p]) * row_bytes;
      }
      // The group is closed even after a failed call in it.
      const absl::Status ended = Accepted(ncclGroupEnd(), comm_, "ncclGroupEnd");
      return enqueued.ok() ? ended : enqueued;
    });
  }

  // An all-reduce of one element: it completes on a rank only once every rank has joined it.
  absl::Status Barrier() override {
    return Run("Barrier", other_ranks_, [&]() -> absl::Status {
      return Accepted(ncclAllReduce(scalar_, scalar_, 1, ncclFloat32, ncclSum, comm_, stream_), comm_, "ncclAllReduce");
    });
  }

 private:
  // Runs operation `op`, which waits on `peers`, unless the communicator is already broken:
  // `enqueue` issues the NCCL call on stream_, then this waits until the work is done or the
  // deadline passes. Any error aborts the NCCL communicator and breaks this one.
  template <typename Enqueue>
  absl::Status Run(const char* op, const std::string& peers, Enqueue&& enqueue) {
    if (!broken_.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "NCCL ", op, " in ", where_, ": the communicator is unusable after an earlier error: ", broken_.message()));
    }
    const absl::Time deadline = absl::Now() + timeout_;
    absl::Status status = [&]() -> absl::Status {
      SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
      SHARDSERVE_RETURN_IF_ERROR(enqueue());
      // A non-blocking communicator may still be enqueuing (ncclInProgress); the stream holds the
      // work only once that is done.
      SHARDSERVE_RETURN_IF_ERROR(WaitForComm(deadline));
      SHARDSERVE_CUDA_RETURN_IF_ERROR(cudaEventRecord(done_, stream_));
      return WaitForEvent(deadline);
    }();
    if (status.ok()) return status;
    Abort();
    std::string why;
    if (status.code() == absl::StatusCode::kDeadlineExceeded) {
      why = absl::StrCat("timed out: not complete within ", absl::FormatDuration(timeout_), ", waiting on ", peers,
                         " (a peer is dead, hung, or not calling ", op, "); the NCCL communicator was aborted: ");
    }
    broken_ = absl::Status(status.code(), absl::StrCat("NCCL ", op, " in ", where_, ": ", why, status.message()));
    return broken_;
  }

  // Polls until comm_ has no NCCL call in progress. Fails on an NCCL error (a peer's failure
  // included) and with DeadlineExceeded at `deadline`.
  absl::Status WaitForComm(absl::Time deadline) {
    while (true) {
      ncclResult_t state = ncclSuccess;
      if (ncclResult_t r = ncclCommGetAsyncError(comm_, &state); r != ncclSuccess) {
        return NcclError(r, comm_, "ncclCommGetAsyncError");
      }
      if (state == ncclSuccess) return absl::OkStatus();
      if (state != ncclInProgress) return NcclError(state, comm_, "the communicator");
      if (absl::Now() >= deadline) return absl::DeadlineExceededError("NCCL still in progress at the deadline");
      std::this_thread::yield();
    }
  }

  // Polls until the work before done_ on the stream has finished, watching comm_ for asynchronous
  // errors meanwhile. Spins (yielding the core) rather than sleeping: a decode-sized all-reduce
  // takes tens of microseconds, less than a sleep's wake-up.
  absl::Status WaitForEvent(absl::Time deadline) {
    while (true) {
      const cudaError_t e = cudaEventQuery(done_);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) return cuda::CudaErrorToStatus(e, "cudaEventQuery", __FILE__, __LINE__);
      ncclResult_t state = ncclSuccess;
      if (ncclResult_t r = ncclCommGetAsyncError(comm_, &state); r != ncclSuccess) {
        return NcclError(r, comm_, "ncclCommGetAsyncError");
      }
      if (state != ncclSuccess && state != ncclInProgress) return NcclError(state, comm_, "the communicator");
      if (absl::Now() >= deadline) return absl::DeadlineExceededError("the stream had not reached the end of the call");
      std::this_thread::yield();
    }
  }

  // Stops the NCCL communicator's kernels and frees it. The stream's later work can then run.
  void Abort() {
    if (comm_ == nullptr) return;
    ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  // Constant after construction.
  const int rank_;
  const int size_;
  const int device_;
  const cudaStream_t stream_;      // not owned
  const std::string where_;        // "group 'tp0' (rank 1 of 2)"
  const std::string other_ranks_;  // the ranks a collective waits on, for messages
  const absl::Duration timeout_;

  // Made by Init; comm_ is null again once aborted.
  ncclComm_t comm_ = nullptr;
  void* scalar_ = nullptr;  // one float on device_, for Barrier
  cudaEvent_t done_ = nullptr;

  // The first error; once set, every call fails at once.
  absl::Status broken_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(RendezvousStore* store,
                                                                   const std::string& group_name, int rank, int size,
                                                                   int cuda_device, CUstream_st* stream,
                                                                   absl::Duration timeout) {
  SHARDSERVE_RETURN_IF_ERROR(comm::CheckGroupArgs("NCCL", store, group_name, rank, size, timeout));
  auto communicator = std::make_unique<NcclCommunicator>(rank, size, cuda_device, stream,
                                                         comm::GroupWhere(group_name, rank, size), timeout);
  SHARDSERVE_RETURN_IF_ERROR(communicator->Init(store, group_name));
  return communicator;
}

}  // namespace shardserve
