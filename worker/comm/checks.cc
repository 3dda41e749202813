#include "worker/comm/checks.h"

#include "absl/strings/str_cat.h"

namespace shardserve::comm {

absl::Status CheckGroupArgs(const char* impl, const RendezvousStore* store, const std::string& group_name, int rank,
                            int size, absl::Duration timeout) {
  const std::string what = absl::StrCat(impl, " communicator for ", GroupWhere(group_name, rank, size));
  if (store == nullptr) return absl::InvalidArgumentError(absl::StrCat(what, ": no rendezvous store"));
  if (group_name.empty()) return absl::InvalidArgumentError(absl::StrCat(what, ": the group name is empty"));
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": the rank must be in [0, size) and size >= 1"));
  }
  if (timeout < absl::Milliseconds(1) || timeout == absl::InfiniteDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the timeout must be finite and at least 1ms, not ", absl::FormatDuration(timeout)));
  }
  return absl::OkStatus();
}

std::string GroupWhere(const std::string& group_name, int rank, int size) {
  return absl::StrCat("group '", group_name, "' (rank ", rank, " of ", size, ")");
}

std::string OtherRanks(int rank, int size) {
  std::string ranks;
  for (int r = 0; r < size; ++r) {
    if (r != rank) absl::StrAppend(&ranks, ranks.empty() ? "" : ", ", r);
  }
  return ranks.empty() ? "no other rank" : absl::StrCat(size == 2 ? "rank " : "ranks ", ranks);
}

absl::Status CheckPeer(int peer, int rank, int size) {
  if (peer < 0 || peer >= size || peer == rank) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer rank ", peer, " is not another rank of this group of ", size, " (this is rank ", rank, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckAllGatherShapes(const Tensor& out, const Tensor& in, int size) {
  bool ok = out.dtype == in.dtype && in.ndim >= 0 && in.ndim < Tensor::kMaxDims && out.ndim == in.ndim + 1 &&
            out.dim(0) == size;
  for (int i = 0; ok && i < in.ndim; ++i) ok = out.dim(i + 1) == in.dim(i);
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("out must be [", size, ", ...in's shape] in in's dtype; got out ",
                                                 DTypeName(out.dtype), " ", out.ShapeString(), " and in ",
                                                 DTypeName(in.dtype), " ", in.ShapeString()));
}

std::string DescribeTensor(int64_t dtype, const Tensor& shape) {
  const bool known = dtype >= 0 && dtype <= static_cast<int64_t>(DType::kI8);
  return absl::StrCat(known ? DTypeName(static_cast<DType>(dtype)) : "an unknown dtype", " ", shape.ShapeString());
}

absl::Status SentOtherThanExpected(int peer, const std::string& sent, const std::string& expected) {
  return absl::InvalidArgumentError(absl::StrCat("rank ", peer, " sent ", sent, " but this rank expected ", expected));
}

absl::Status SendsOtherRowsThanExpected(int peer, const std::string& sends, const std::string& expected) {
  return absl::InvalidArgumentError(
      absl::StrCat("rank ", peer, " sends ", sends, " but this rank expected ", expected, " from it"));
}

absl::Status ExpectsOtherRowCount(int peer, int64_t expects, int64_t sends) {
  return absl::InvalidArgumentError(
      absl::StrCat("rank ", peer, " expects ", expects, " row(s) from this rank, which sends it ", sends));
}

}  // namespace shardserve::comm
