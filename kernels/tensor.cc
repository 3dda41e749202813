#include "kernels/tensor.h"

#include <cstring>

namespace shardserve {
namespace {

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Shifts `mantissa` right by `shift` (1..31), rounding to nearest, ties to even.
uint32_t ShiftRightRoundEven(uint32_t mantissa, int shift) {
  const uint32_t kept = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  return kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
}

}  // namespace

// IEEE binary16: 1 sign bit, 5 exponent bits (bias 15), 10 mantissa bits.
float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return BitsFloat(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN (payload kept)
  if (exponent != 0) return BitsFloat(sign | ((exponent + 127 - 15) << 23) | (mantissa << 13));
  // Zero or subnormal: mantissa * 2^-24, exact in float32.
  const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
  return sign ? -magnitude : magnitude;
}

uint16_t F32ToF16(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) {  // NaN: keep it quiet and keep the top payload bits.
    return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  }
  // 65520 = 0x477ff000 is halfway between the largest half (65504) and 2^16; it and everything
  // above it (inf included) rounds to inf.
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (abs >= 0x38800000u) {  // >= 2^-14: a normal half. Rebias the exponent, round 13 bits away.
    // A carry out of the mantissa correctly bumps the exponent.
    return static_cast<uint16_t>(sign | ShiftRightRoundEven(abs - ((127u - 15u) << 23), 13));
  }
  // Below 2^-14: a half subnormal, in units of 2^-24. Values up to 2^-25 (half a unit, a tie
  // that goes to even 0) round to zero; the shift below would exceed 24 for them.
  if (abs <= 0x33000000u) return sign;
  // The value is m * 2^(e - 150) with the implicit bit in m; in units of 2^-24 that is
  // m >> (126 - e), with e in [102, 112] here, so the shift is 14..24.
  const uint32_t exponent = abs >> 23;
  const uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
  return static_cast<uint16_t>(sign | ShiftRightRoundEven(mantissa, static_cast<int>(126 - exponent)));
}

bool ConvertOnHost(void* dst, DType dst_type, const void* src, DType src_type, size_t n) {
  const auto is_float = [](DType t) { return t == DType::kF32 || t == DType::kF16 || t == DType::kBF16; };
  if (!is_float(dst_type) || !is_float(src_type)) return false;
  if (dst_type == src_type) {
    if (n != 0) std::memmove(dst, src, n * DTypeSize(dst_type));
    return true;
  }
  // Widen each element to float32 (exact), then narrow to the destination type (round to
  // nearest even). float32 holds every F16 and BF16 value exactly, so going through it loses
  // nothing beyond the final rounding.
  // Elements are loaded and stored with memcpy: src is often a tensor inside a mapped
  // safetensors file, whose data offsets the format does not align (found by UBSan), and
  // dereferencing a misaligned float* is undefined behaviour. The compiler emits plain moves.
  const auto* from = static_cast<const uint8_t*>(src);
  auto* to = static_cast<uint8_t*>(dst);
  for (size_t i = 0; i < n; ++i) {
    float value = 0.0f;
    uint16_t half = 0;
    switch (src_type) {
      case DType::kF32: std::memcpy(&value, from + i * 4, 4); break;
      case DType::kF16: std::memcpy(&half, from + i * 2, 2); value = F16ToF32(half); break;
      case DType::kBF16: std::memcpy(&half, from + i * 2, 2); value = Bf16ToF32(half); break;
      case DType::kI32:
      case DType::kI8: return false;
    }
    switch (dst_type) {
      case DType::kF32: std::memcpy(to + i * 4, &value, 4); break;
      case DType::kF16: half = F32ToF16(value); std::memcpy(to + i * 2, &half, 2); break;
      case DType::kBF16: half = F32ToBf16(value); std::memcpy(to + i * 2, &half, 2); break;
      case DType::kI32:
      case DType::kI8: return false;
    }
  }
  return true;
}

}  // namespace shardserve
