#include "worker/shard/arena.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shardserve {

absl::StatusOr<Tensor> DeviceArena::Alloc(DType t, absl::Span<const int64_t> dims) {
  if (dims.size() > Tensor::kMaxDims) return absl::InternalError(absl::StrCat("a buffer of ", dims.size(), " dimensions"));
  Tensor view;
  view.dtype = t;
  for (int64_t d : dims) view.shape[view.ndim++] = d;
  absl::StatusOr<Buffer> buf = backend_->Allocate(std::max<size_t>(view.bytes(), 1));
  if (!buf.ok()) return buf.status();
  view.data = buf->data();
  buffers_.push_back(std::move(*buf));
  return view;
}

}  // namespace shardserve
