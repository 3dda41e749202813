#include "worker/communicator.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"

namespace shardserve {
namespace {

// `rows` (send_rows or recv_rows) has `size` entries, none negative, adding up to `total`, the rows
// of `tensor` (in or out). No sum is formed that could overflow: each count is compared with what
// is left of `total`.
absl::Status CheckRowCounts(const char* name, absl::Span<const int64_t> rows, int size, const char* tensor,
                            int64_t total) {
  const auto wrong = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("AllToAllV: ", name, " [", absl::StrJoin(rows, ", "), "] ", why));
  };
  if (rows.size() != static_cast<size_t>(size)) {
    return wrong(absl::StrCat("has ", rows.size(), " entries, not one per rank of the group of ", size));
  }
  int64_t left = total;
  for (int64_t r : rows) {
    if (r < 0) return wrong("has a negative count");
    if (r > left) return wrong(absl::StrCat("adds up to more than the ", total, " rows of ", tensor));
    left -= r;
  }
  if (left != 0) return wrong(absl::StrCat("adds up to ", total - left, ", not the ", total, " rows of ", tensor));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int64_t> CheckAllToAllVArgs(const Tensor& out, const Tensor& in, absl::Span<const int64_t> send_rows,
                                           absl::Span<const int64_t> recv_rows, int rank, int size) {
  bool ok = out.dtype == in.dtype && in.quant == WeightQuant::kNone && out.quant == WeightQuant::kNone &&
            in.ndim >= 1 && in.ndim <= Tensor::kMaxDims && out.ndim == in.ndim && in.dim(0) >= 0 && out.dim(0) >= 0;
  int64_t row_elements = 1;
  for (int i = 1; ok && i < in.ndim; ++i) {
    ok = out.dim(i) == in.dim(i) && in.dim(i) >= 0;
    row_elements *= in.dim(i);
  }
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("AllToAllV: in and out must be [rows, ...one row shape] in one dtype; got out ",
                     DTypeName(out.dtype), " ", out.ShapeString(), " and in ", DTypeName(in.dtype), " ",
                     in.ShapeString()));
  }
  SHARDSERVE_RETURN_IF_ERROR(CheckRowCounts("send_rows", send_rows, size, "in", in.dim(0)));
  SHARDSERVE_RETURN_IF_ERROR(CheckRowCounts("recv_rows", recv_rows, size, "out", out.dim(0)));
  if (send_rows[rank] != recv_rows[rank]) {
    return absl::InvalidArgumentError(absl::StrCat("AllToAllV: rank ", rank, " sends itself ", send_rows[rank],
                                                   " rows (send_rows) but receives ", recv_rows[rank],
                                                   " from itself (recv_rows)"));
  }
  const auto in_begin = reinterpret_cast<uintptr_t>(in.data);
  const auto out_begin = reinterpret_cast<uintptr_t>(out.data);
  if (in.bytes() > 0 && out.bytes() > 0 && in_begin < out_begin + out.bytes() && out_begin < in_begin + in.bytes()) {
    return absl::InvalidArgumentError("AllToAllV: in and out overlap");
  }
  return row_elements;
}

absl::Status LocalCommunicator::AllToAllV(Tensor* out, const Tensor& in, absl::Span<const int64_t> send_rows,
                                          absl::Span<const int64_t> recv_rows) {
  SHARDSERVE_RETURN_IF_ERROR(CheckAllToAllVArgs(*out, in, send_rows, recv_rows, 0, 1).status());
  if (in.bytes() == 0) return absl::OkStatus();
  return backend_->CopyOnDevice(out->data, in.data, in.bytes());
}

}  // namespace shardserve
