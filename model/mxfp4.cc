#include "model/mxfp4.h"

#include <array>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/quant.h"

namespace shardserve {

absl::Status DequantizeMxfp4(const uint8_t* blocks, const uint8_t* scales, int64_t rows, int64_t cols, float* out,
                             const std::string& name) {
  if (cols % kMxfp4BlockSize != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": MXFP4 rows of ", cols, " values, not a whole number of blocks of ", kMxfp4BlockSize));
  }
  const int64_t groups = cols / kMxfp4BlockSize;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t block = r * groups + g;
      const int exponent = static_cast<int>(scales[block]) - 127;
      const uint8_t* codes = reinterpret_cast<const Mxfp4Block*>(blocks)[block].codes;
      float* to = out + r * cols + g * kMxfp4BlockSize;
      for (int64_t j = 0; j < kMxfp4BlockBytes; ++j) {
        to[2 * j] = std::ldexp(kMxfp4Values[codes[j] & 0x0F], exponent);
        to[2 * j + 1] = std::ldexp(kMxfp4Values[codes[j] >> 4], exponent);
      }
      for (int64_t i = 0; i < kMxfp4BlockSize; ++i) {
        if (!std::isfinite(to[i])) {
          return absl::InvalidArgumentError(absl::StrCat(
              name, ": row ", r, " block ", g, " has scale byte ", static_cast<int>(scales[block]),
              ", which makes its values overflow float32 (the checkpoint is corrupt)"));
        }
      }
    }
  }
  return absl::OkStatus();
}

bool Mxfp4AsFp8Groups(const uint8_t* blocks, const uint8_t* scales, int64_t groups, const std::vector<int64_t>& rows,
                      int64_t group0, int64_t num_groups, std::vector<uint8_t>* out) {
  // kMxfp4Values[c] as e4m3 (each is one exactly)
  static const std::array<uint8_t, 16> kE4m3 = [] {
    std::array<uint8_t, 16> t{};
    for (int c = 0; c < 16; ++c) t[c] = FloatToFp8E4m3(kMxfp4Values[c]);
    return t;
  }();
  const int64_t m = static_cast<int64_t>(rows.size()), k = num_groups * kMxfp4BlockSize;
  // Fp8RowsLayout{m, k, 32}: [m, num_groups] float32 scales (one a row when the row is one block),
  // then the codes [m, k]
  const Fp8RowsLayout layout{m, k, kMxfp4BlockSize};
  out->assign(static_cast<size_t>(layout.bytes()), 0);
  float* scale = reinterpret_cast<float*>(out->data());
  uint8_t* codes = out->data() + layout.scale_bytes();
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < num_groups; ++g) {
      const int64_t block = rows[r] * groups + group0 + g;
      if (scales[block] == 255) return false;
      const float s = std::ldexp(1.0f, static_cast<int>(scales[block]) - 127);
      std::memcpy(scale + r * num_groups + g, &s, sizeof(float));
      const uint8_t* in = reinterpret_cast<const Mxfp4Block*>(blocks)[block].codes;
      uint8_t* to = codes + r * k + g * kMxfp4BlockSize;
      for (int64_t j = 0; j < kMxfp4BlockBytes; ++j) {
        to[2 * j] = kE4m3[in[j] & 0x0F];
        to[2 * j + 1] = kE4m3[in[j] >> 4];
      }
    }
  }
  return true;
}

bool Mxfp4Rows(const uint8_t* blocks, const uint8_t* scales, int64_t groups, const std::vector<int64_t>& rows,
               int64_t group0, int64_t num_groups, std::vector<uint8_t>* out) {
  const int64_t m = static_cast<int64_t>(rows.size());
  const Mxfp4RowsLayout layout{m, num_groups * kMxfp4BlockSize};
  out->assign(static_cast<size_t>(layout.bytes()), 0);
  uint8_t* to_scales = out->data() + layout.code_bytes();
  for (int64_t r = 0; r < m; ++r) {
    const int64_t first = rows[r] * groups + group0;
    std::memcpy(out->data() + r * num_groups * kMxfp4BlockBytes, blocks + first * kMxfp4BlockBytes,
                static_cast<size_t>(num_groups * kMxfp4BlockBytes));
    for (int64_t g = 0; g < num_groups; ++g) {
      if (!Mxfp4BlockFinite(blocks + (first + g) * kMxfp4BlockBytes, scales[first + g])) return false;
      to_scales[r * num_groups + g] = scales[first + g];
    }
  }
  return true;
}

}  // namespace shardserve
