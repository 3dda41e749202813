#include "kernels/backend.h"

namespace shardserve {

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    if (owner_ != nullptr && data_ != nullptr) owner_->Free(data_);
    owner_ = o.owner_;
    data_ = o.data_;
    bytes_ = o.bytes_;
    o.owner_ = nullptr;
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

Buffer::~Buffer() {
  if (owner_ != nullptr && data_ != nullptr) owner_->Free(data_);
}

absl::StatusOr<Buffer> Backend::PackMatMulWeight(const Tensor& w, Tensor* packed, WeightQuant quant) {
  *packed = w;
  if (quant != WeightQuant::kNone) {
    return absl::UnimplementedError(absl::StrCat("PackMatMulWeight: the ", Describe(), " backend has no ",
                                                 WeightQuantName(quant), " weights yet; load without quantization"));
  }
  return Buffer();
}

absl::StatusOr<Buffer> Backend::PackQuantizedWeight(WeightQuant quant, const void*, int64_t, int64_t, Tensor*) {
  return absl::UnimplementedError(absl::StrCat("PackQuantizedWeight: the ", Describe(), " backend has no ",
                                               WeightQuantName(quant),
                                               " weights yet (quantized checkpoints load on the CPU)"));
}

}  // namespace shardserve
