#include "model/mxfp4.h"

#include <cmath>

#include "absl/strings/str_cat.h"

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

}  // namespace shardserve
