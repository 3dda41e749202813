// Tensors as the kernels see them: a typed, shaped view of memory that somebody else owns.
//
// Ownership: a Tensor never owns its memory. Memory is owned by a Buffer (below), allocated by a
// Backend, and must outlive every Tensor that views it. Tensors are plain values; copying one
// copies the view, not the data. Not thread-safe beyond what plain values are.
#ifndef SHARDSERVE_KERNELS_TENSOR_H_
#define SHARDSERVE_KERNELS_TENSOR_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>

#include "kernels/quant.h"

namespace shardserve {

// Element types. F32/F16/BF16 for weights and activations, I32 for ids, positions, block tables,
// I8 for quantized weights (kernels/quant.h).
enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2, kI32 = 3, kI8 = 4 };

inline size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF16: return 2;
    case DType::kBF16: return 2;
    case DType::kI32: return 4;
    case DType::kI8: return 1;
  }
  return 0;
}

inline const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kI32: return "I32";
    case DType::kI8: return "I8";
  }
  return "?";
}

enum class DeviceKind : uint8_t { kCpu = 0, kCuda = 1 };

// A view of up to 4 dimensions, row-major and contiguous (the last dimension is contiguous).
struct Tensor {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  DType dtype = DType::kF32;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  // A quantized weight (Backend::PackMatMulWeight): an I8 [m, k] view of its kernels/quant.h
  // layout, whose bytes() are that layout's (scales and zeros included), not m x k.
  WeightQuant quant = WeightQuant::kNone;
  // kFp8 with input-group scales: inputs per scale (kernels/quant.h Fp8RowsLayout::group); 0: one a row.
  int64_t quant_group = 0;

  Tensor() = default;
  Tensor(void* d, DType t, std::initializer_list<int64_t> dims) : data(d), dtype(t) {
    for (int64_t s : dims) shape[ndim++] = s;
  }

  int64_t dim(int i) const { return shape[i < 0 ? ndim + i : i]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  size_t bytes() const {
    if (quant != WeightQuant::kNone && ndim == 2) return static_cast<size_t>(QuantizedWeightBytes(quant, shape[0], shape[1], quant_group));
    return static_cast<size_t>(numel()) * DTypeSize(dtype);
  }
  // Rows of a 2-D view: [begin, end) of dimension 0 (not of a quantized weight's).
  Tensor Rows(int64_t begin, int64_t end) const {
    Tensor t = *this;
    t.shape[0] = end - begin;
    t.data = static_cast<char*>(data) + static_cast<size_t>(begin) * RowBytes();
    return t;
  }
  size_t RowBytes() const { return ndim == 0 ? 0 : bytes() / static_cast<size_t>(shape[0] ? shape[0] : 1); }
  template <typename T> T* as() const { return static_cast<T*>(data); }
  std::string ShapeString() const {
    std::string s = "[";
    for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
  }
};

// 16-bit float conversions on the host (round-to-nearest-even when narrowing).
inline float Bf16ToF32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t F32ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float F16ToF32(uint16_t h);
uint16_t F32ToF16(float f);

// Converts n elements between float types on the host. Supported: any of F32/F16/BF16 to any.
// Returns false for an unsupported pair (I32 to a float type, say). Neither pointer needs to be
// aligned (a tensor in a mapped safetensors file need not be).
bool ConvertOnHost(void* dst, DType dst_type, const void* src, DType src_type, size_t n);

}  // namespace shardserve

#endif  // SHARDSERVE_KERNELS_TENSOR_H_
