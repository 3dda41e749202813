#include "kernels/counter_uniform.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace shardserve {

absl::Status CheckCounterUniformSlice(const char* op, const Tensor& out, const CounterUniformSlice& s) {
  if (s.rows < 0 || s.cols < 1) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": tensor shape [", s.rows, ", ", s.cols, "] is not a shape"));
  }
  if (s.dim != 0 && s.dim != 1) return absl::InvalidArgumentError(absl::StrCat(op, ": slice dimension ", s.dim, " is not 0 or 1"));
  const int64_t extent = s.dim == 0 ? s.rows : s.cols;
  if (s.begin < 0 || s.begin > s.end || s.end > extent) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": slice [", s.begin, ", ", s.end, ") of dimension ", s.dim,
                                                   " outside [0, ", extent, "]"));
  }
  if (out.dtype != DType::kF32 && out.dtype != DType::kF16 && out.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": output dtype ", DTypeName(out.dtype), " is not F32, F16 or BF16"));
  }
  if (out.numel() != s.out_rows() * s.out_cols()) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": output ", out.ShapeString(), " holds ", out.numel(),
                                                   " elements; the slice has ", s.out_rows(), " x ", s.out_cols()));
  }
  if (out.numel() > 0 && out.data == nullptr) return absl::InvalidArgumentError(absl::StrCat(op, ": null output"));
  return absl::OkStatus();
}

void FillCounterUniformOnHost(void* dst, DType dst_type, const CounterUniformSlice& s) {
  const int64_t out_rows = s.out_rows(), out_cols = s.out_cols();
  const size_t ds = DTypeSize(dst_type);
  uint8_t* out = static_cast<uint8_t*>(dst);
  // Each output row is a run of consecutive flat indices, made in float32 through a small buffer
  // and converted into place.
  constexpr int64_t kChunk = 4096;
  float chunk[kChunk];
  for (int64_t r = 0; r < out_rows; ++r) {
    const int64_t first = s.dim == 0 ? (s.begin + r) * s.cols : r * s.cols + s.begin;
    uint8_t* row = out + static_cast<size_t>(r * out_cols) * ds;
    for (int64_t done = 0; done < out_cols; done += kChunk) {
      const int64_t m = std::min(kChunk, out_cols - done);
      float* to = dst_type == DType::kF32 ? reinterpret_cast<float*>(row) + done : chunk;
      for (int64_t i = 0; i < m; ++i) to[i] = CounterUniformValue(s.key, s.scale, static_cast<uint64_t>(first + done + i));
      if (dst_type != DType::kF32) ConvertOnHost(row + static_cast<size_t>(done) * ds, dst_type, chunk, DType::kF32, m);
    }
  }
}

}  // namespace shardserve
