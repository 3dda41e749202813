#include "worker/comm/staged_communicator.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace shardserve {

template <typename Call>
absl::Status StagedCommunicator::Guard(const char* op, Call&& call) {
  if (!error_.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(op, ": the host-staged communicator is unusable after an earlier error: ",
                                                      error_.message()));
  }
  absl::Status s = call();
  if (!s.ok()) error_ = s;
  return s;
}

void* StagedCommunicator::Grow(std::vector<uint8_t>* v, size_t bytes) {
  if (v->size() < bytes) v->resize(bytes);
  return v->data();
}

absl::Status StagedCommunicator::AllReduceSum(Tensor* t) {
  return Guard("AllReduceSum", [&]() -> absl::Status {
    const size_t n = static_cast<size_t>(t->numel());
    Tensor host = *t;
    host.data = Grow(&host_, t->bytes());
    SHARDSERVE_RETURN_IF_ERROR(copier_->ToHost(host.data, t->data, t->bytes()));
    if (t->dtype == DType::kF16 || t->dtype == DType::kBF16) {
      // Gloo sums F32 and I32: widen (exact), sum in float32, round once on the way back.
      Tensor wide = host;
      wide.dtype = DType::kF32;
      wide.data = Grow(&wide_, n * sizeof(float));
      ConvertOnHost(wide.data, DType::kF32, host.data, t->dtype, n);
      SHARDSERVE_RETURN_IF_ERROR(inner_->AllReduceSum(&wide));
      ConvertOnHost(host.data, t->dtype, wide.data, DType::kF32, n);
    } else {
      SHARDSERVE_RETURN_IF_ERROR(inner_->AllReduceSum(&host));
    }
    return copier_->ToDevice(t->data, host.data, t->bytes());
  });
}

template <typename Collective>
absl::Status StagedCommunicator::InToOut(const char* op, Tensor* out, const Tensor& in, Collective&& collective) {
  return Guard(op, [&]() -> absl::Status {
    Tensor host_in = in, host_out = *out;
    host_in.data = Grow(&host_, in.bytes());
    host_out.data = Grow(&wide_, out->bytes());
    SHARDSERVE_RETURN_IF_ERROR(copier_->ToHost(host_in.data, in.data, in.bytes()));
    SHARDSERVE_RETURN_IF_ERROR(collective(&host_out, host_in));
    return copier_->ToDevice(out->data, host_out.data, out->bytes());
  });
}

absl::Status StagedCommunicator::AllGather(Tensor* out, const Tensor& in) {
  return InToOut("AllGather", out, in,
                 [&](Tensor* host_out, const Tensor& host_in) { return inner_->AllGather(host_out, host_in); });
}

absl::Status StagedCommunicator::AllToAllV(Tensor* out, const Tensor& in, absl::Span<const int64_t> send_rows,
                                           absl::Span<const int64_t> recv_rows) {
  return InToOut("AllToAllV", out, in, [&](Tensor* host_out, const Tensor& host_in) -> absl::Status {
    // The device tensors too: the host copies never overlap, whatever out and in do.
    SHARDSERVE_RETURN_IF_ERROR(CheckAllToAllVArgs(*out, in, send_rows, recv_rows, rank(), size()).status());
    return inner_->AllToAllV(host_out, host_in, send_rows, recv_rows);
  });
}

absl::Status StagedCommunicator::Send(const Tensor& t, int peer) {
  return Guard("Send", [&]() -> absl::Status {
    Tensor host = t;
    host.data = Grow(&host_, t.bytes());
    SHARDSERVE_RETURN_IF_ERROR(copier_->ToHost(host.data, t.data, t.bytes()));
    return inner_->Send(host, peer);
  });
}

absl::Status StagedCommunicator::Recv(Tensor* t, int peer) {
  return Guard("Recv", [&]() -> absl::Status {
    Tensor host = *t;
    host.data = Grow(&host_, t->bytes());
    SHARDSERVE_RETURN_IF_ERROR(inner_->Recv(&host, peer));
    return copier_->ToDevice(t->data, host.data, t->bytes());
  });
}

absl::Status StagedCommunicator::Barrier() {
  return Guard("Barrier", [&]() -> absl::Status {
    SHARDSERVE_RETURN_IF_ERROR(copier_->Synchronize());
    return inner_->Barrier();
  });
}

}  // namespace shardserve
