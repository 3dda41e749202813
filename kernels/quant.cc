#include "kernels/quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/host_vec.h"
#include "kernels/tensor.h"

namespace shardserve {

namespace {

// std::round (half away from zero), std::fmin and std::fmax for the finite values the quantizers
// see, inline: their libm calls were half of QuantizeInt4Groups' time. Each result the quantizers
// keep is cast to an integer, so where these differ from libm's (the sign of a zero) nothing does.
float RoundHalfAway(float x) {
  if (!(std::fabs(x) < 4194304.0f)) return std::round(x);  // 2^22 and beyond (or NaN): libm's
  const float t = static_cast<float>(static_cast<int32_t>(x));  // toward zero, exact
  const float d = x - t;                                        // exact: |d| < 1
  return t + static_cast<float>(d >= 0.5f) - static_cast<float>(d <= -0.5f);  // no branch: random data
}
float Min(float a, float b) { return b < a ? b : a; }
float Max(float a, float b) { return a < b ? b : a; }

using cpu::Vec8;
using cpu::Vec8i;
using cpu::kVecLanes;

// The vector forms of the helpers above, lane by lane the same operations (so the same results):
// the quantizers below run 8 weights at a time where they can, in functions cloned per instruction
// set (SHARDSERVE_VECTOR_CLONES). Scalar, the Llama-3-8B's 7 G weights took over 150 s on one
// thread (kernels/quant.h), 75 M weights/s an AVX2 EPYC thread. Vectors go by reference, which any
// compiler takes in a clone (clang refuses an 8-float vector passed by value between an AVX clone
// and a baseline helper: kernels/host_vec.h).
[[gnu::always_inline]] inline void Load8(Vec8* v, const float* p) { std::memcpy(v, p, sizeof *v); }
[[gnu::always_inline]] inline void MinVec(Vec8* a, const Vec8& b) { *a = b < *a ? b : *a; }
[[gnu::always_inline]] inline void MaxVec(Vec8* a, const Vec8& b) { *a = *a < b ? b : *a; }
// RoundHalfAway for lanes below 2^22 in magnitude (the caller checks: Below2To22).
[[gnu::always_inline]] inline void RoundHalfAwayVec(Vec8* x) {
  const Vec8 t = __builtin_convertvector(__builtin_convertvector(*x, Vec8i), Vec8);  // toward zero, exact
  const Vec8 d = *x - t;                                                              // exact: |d| < 1
  const Vec8 one = Vec8{} + 1.0f, zero = {};
  *x = t + (d >= 0.5f ? one : zero) - (d <= -0.5f ? one : zero);
}
// Whether any lane of a comparison's result is set (one OR of its 4 quadwords, not 8 lane tests).
[[gnu::always_inline]] inline bool AnyLane(const Vec8i& mask) {
  uint64_t q[4];
  std::memcpy(q, &mask, sizeof q);
  return ((q[0] | q[1]) | (q[2] | q[3])) != 0;
}
// Whether every lane of x is below 2^22 in magnitude (false for NaN): RoundHalfAway's own range.
[[gnu::always_inline]] inline bool Below2To22(const Vec8& x) {
  const Vec8 magnitude = x < 0.0f ? -x : x;
  return !AnyLane(!(magnitude < 4194304.0f));
}

// InvalidArgument naming the first non-finite weight of w [m, k] (row row0 + r, column), else OK. Scans 8
// at a time (a non-finite v has v - v NaN, which equals nothing), then names the place by a scalar
// look at the vector that has one.
SHARDSERVE_VECTOR_CLONES
absl::Status RefuseNonFinite(const char* format, const float* w, int64_t m, int64_t k, int64_t row0 = 0) {
  const int64_t total = m * k;
  for (int64_t i = 0; i < total; i += kVecLanes) {
    Vec8 v = {};
    std::memcpy(&v, w + i, static_cast<size_t>(std::min<int64_t>(kVecLanes, total - i)) * sizeof(float));
    if (!AnyLane((v - v) != 0.0f)) continue;
    for (int64_t j = i; j < std::min(total, i + kVecLanes); ++j) {
      if (!std::isfinite(w[j])) {
        return absl::InvalidArgumentError(absl::StrCat(format, " quantization: weight [", row0 + j / k, ", ", j % k,
                                                       "] is ", w[j], ", not a finite number"));
      }
    }
  }
  return absl::OkStatus();
}

// The quantizers' work on finite weights (the callers check): QuantizeInt8Rows / QuantizeInt4Groups
// below, row by row.
SHARDSERVE_VECTOR_CLONES
void Int8Rows(float* scale, int8_t* q, const float* w, int64_t m, int64_t k) {
  for (int64_t r = 0; r < m; ++r) {
    const float* row = w + r * k;
    // Max is order-free here: every |w| >= +0, and +0 stays unless a larger value comes.
    Vec8 max_vec = {};
    int64_t c = 0;
    for (; c + kVecLanes <= k; c += kVecLanes) {
      Vec8 v;
      Load8(&v, row + c);
      MaxVec(&max_vec, v < 0.0f ? -v : v);
    }
    float max_abs = 0;
    for (int l = 0; l < kVecLanes; ++l) max_abs = Max(max_abs, max_vec[l]);
    for (; c < k; ++c) max_abs = Max(max_abs, std::fabs(row[c]));
    scale[r] = max_abs / 127.0f;
    const float s = scale[r];
    int8_t* out = q + r * k;
    c = 0;
    if (s != 0) {
      for (; c + kVecLanes <= k; c += kVecLanes) {
        Vec8 x;
        Load8(&x, row + c);
        x /= s;
        if (!Below2To22(x)) break;  // the scalar loop below takes it from here
        RoundHalfAwayVec(&x);
        MinVec(&x, Vec8{} + 127.0f);
        MaxVec(&x, Vec8{} - 127.0f);
        const Vec8i codes = __builtin_convertvector(x, Vec8i);
        for (int l = 0; l < kVecLanes; ++l) out[c + l] = static_cast<int8_t>(codes[l]);
      }
    }
    for (; c < k; ++c) {
      // |row[c] / scale| <= 127 up to rounding of the division: clamp it there.
      const float v = s == 0 ? 0.0f : RoundHalfAway(row[c] / s);
      out[c] = static_cast<int8_t>(Max(-127.0f, Min(127.0f, v)));
    }
  }
}

// A whole group's values j and j + 64 into byte j of b (its scale and zero set), 8 bytes a step, as
// Int4Groups' scalar loop: Min(15, Max(0, RoundHalfAway(w / s) + zero)). False, with the bytes
// partly written, where a quotient is out of RoundHalfAwayVec's range.
[[gnu::always_inline]] inline bool PackInt4Group(Int4Group128* b, const float* v) {
  constexpr int64_t kHalf = kInt4GroupSize / 2;
  const float zero = b->zero;
  for (int64_t j = 0; j < kHalf; j += kVecLanes) {
    Vec8 low, high;
    Load8(&low, v + j);
    Load8(&high, v + kHalf + j);
    low /= b->scale;
    high /= b->scale;
    if (!Below2To22(low) || !Below2To22(high)) return false;
    RoundHalfAwayVec(&low);
    RoundHalfAwayVec(&high);
    low += zero;
    high += zero;
    MaxVec(&low, Vec8{});
    MinVec(&low, Vec8{} + 15.0f);
    MaxVec(&high, Vec8{});
    MinVec(&high, Vec8{} + 15.0f);
    const Vec8i bytes = __builtin_convertvector(low, Vec8i) | (__builtin_convertvector(high, Vec8i) << 4);
    for (int l = 0; l < kVecLanes; ++l) b->q[j + l] = static_cast<uint8_t>(bytes[l]);
  }
  return true;
}

SHARDSERVE_VECTOR_CLONES
void Int4Groups(Int4Group128* blocks, const float* w, int64_t m, int64_t k) {
  const int64_t groups = Int4GroupsLayout{m, k}.groups_per_row();
  constexpr int64_t kHalf = kInt4GroupSize / 2;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* v = w + r * k + g * kInt4GroupSize;
      const int64_t size = std::min(kInt4GroupSize, k - g * kInt4GroupSize);  // the last group may be short
      Int4Group128& b = blocks[r * groups + g];
      b = Int4Group128{};
      float lo = 0, hi = 0;  // the range, widened to hold 0
      if (size == kInt4GroupSize) {
        // Min and Max are order-free here: +0 stays unless a value strictly beyond it comes.
        Vec8 lo_vec = {}, hi_vec = {};
        for (int64_t j = 0; j < size; j += kVecLanes) {
          Vec8 x;
          Load8(&x, v + j);
          MinVec(&lo_vec, x);
          MaxVec(&hi_vec, x);
        }
        for (int l = 0; l < kVecLanes; ++l) {
          lo = Min(lo, lo_vec[l]);
          hi = Max(hi, hi_vec[l]);
        }
      } else {
        for (int64_t j = 0; j < size; ++j) {
          lo = Min(lo, v[j]);
          hi = Max(hi, v[j]);
        }
      }
      // hi - lo may overflow to inf for weights near float's limits: divide each first.
      const float scale = hi / 15.0f - lo / 15.0f;
      if (!(scale > 0)) continue;  // an all-zero group (or one too small to scale): q = 0, s = 0
      b.scale = scale;
      b.zero = static_cast<uint8_t>(Min(15.0f, Max(0.0f, RoundHalfAway(-lo / scale))));
      if (size == kInt4GroupSize && PackInt4Group(&b, v)) continue;
      for (int64_t j = 0; j < kHalf; ++j) b.q[j] = 0;  // what PackInt4Group wrote before it gave up
      for (int64_t j = 0; j < size; ++j) {
        const float qv = Min(15.0f, Max(0.0f, RoundHalfAway(v[j] / scale) + b.zero));
        const auto nibble = static_cast<uint8_t>(qv);
        b.q[j % kHalf] |= static_cast<uint8_t>(j < kHalf ? nibble : nibble << 4);
      }
    }
  }
}

}  // namespace

const char* WeightQuantName(WeightQuant q) {
  switch (q) {
    case WeightQuant::kNone: return "none";
    case WeightQuant::kInt8: return "int8";
    case WeightQuant::kInt4: return "int4";
    case WeightQuant::kFp8: return "fp8";
    case WeightQuant::kMxfp4: return "mxfp4";
  }
  return "?";
}

absl::StatusOr<WeightQuant> ParseWeightQuant(absl::string_view name) {
  for (WeightQuant q : {WeightQuant::kNone, WeightQuant::kInt8, WeightQuant::kInt4, WeightQuant::kFp8}) {
    if (name == WeightQuantName(q)) return q;
  }
  return absl::InvalidArgumentError(absl::StrCat("quantization must be none, int8, int4 or fp8, got '", name, "'"));
}

int64_t QuantizedWeightBytes(WeightQuant q, int64_t m, int64_t k, int64_t group) {
  switch (q) {
    case WeightQuant::kNone: return m * k * static_cast<int64_t>(sizeof(float));
    case WeightQuant::kInt8: return Int8RowsLayout{m, k}.bytes();
    case WeightQuant::kInt4: return Int4GroupsLayout{m, k}.bytes();
    case WeightQuant::kFp8: return Fp8RowsLayout{m, k, group}.bytes();
    case WeightQuant::kMxfp4: return Mxfp4RowsLayout{m, k}.bytes();
  }
  return 0;
}

float Mxfp4Scale(uint8_t e) {
  if (e == kMxfp4NanScale) return std::numeric_limits<float>::infinity();
  return std::ldexp(1.0f, static_cast<int>(e) - 127);
}

void DequantizeMxfp4Rows(float* w, const uint8_t* stored, int64_t m, int64_t k) {
  const Mxfp4RowsLayout layout{m, k};
  const int64_t groups = layout.blocks_per_row();
  const auto* blocks = reinterpret_cast<const Mxfp4Block*>(stored);
  const uint8_t* scales = stored + layout.code_bytes();
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t e = scales[r * groups + g];
      const uint8_t* codes = blocks[r * groups + g].codes;
      float* to = w + r * k + g * kMxfp4BlockSize;
      for (int64_t j = 0; j < kMxfp4BlockBytes; ++j) {
        for (int h = 0; h < 2; ++h) {
          const float v = kMxfp4Values[h == 0 ? codes[j] & 0x0F : codes[j] >> 4];
          to[2 * j + h] = e == kMxfp4NanScale ? std::numeric_limits<float>::quiet_NaN()
                                              : std::ldexp(v, static_cast<int>(e) - 127);
        }
      }
    }
  }
}

bool Mxfp4BlockFinite(const uint8_t* codes, uint8_t scale) {
  if (scale < 253) return true;  // 6 x 2^125 < 2^128
  if (scale == kMxfp4NanScale) return false;
  // The smallest magnitude code (bits 0-2) past float32: 4 (value 2) under 254, 6 (value 4) under 253.
  const int limit = scale == 254 ? 4 : 6;
  for (int64_t j = 0; j < kMxfp4BlockBytes; ++j) {
    if ((codes[j] & 7) >= limit || ((codes[j] >> 4) & 7) >= limit) return false;
  }
  return true;
}

bool Mxfp4ValuesFinite(const uint8_t* stored, int64_t m, int64_t k) {
  const Mxfp4RowsLayout layout{m, k};
  const auto* blocks = reinterpret_cast<const Mxfp4Block*>(stored);
  const uint8_t* scales = stored + layout.code_bytes();
  for (int64_t b = 0; b < layout.scale_bytes(); ++b) {
    if (!Mxfp4BlockFinite(blocks[b].codes, scales[b])) return false;
  }
  return true;
}

absl::Status QuantizeInt8Rows(float* scale, int8_t* q, const float* w, int64_t m, int64_t k) {
  SHARDSERVE_RETURN_IF_ERROR(RefuseNonFinite("int8", w, m, k));
  Int8Rows(scale, q, w, m, k);
  return absl::OkStatus();
}

void DequantizeInt8Rows(float* w, const float* scale, const int8_t* q, int64_t m, int64_t k) {
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < k; ++c) w[r * k + c] = static_cast<float>(q[r * k + c]) * scale[r];
  }
}

float Fp8E4m3ToFloat(uint8_t v) {
  if (Fp8E4m3IsNan(v)) return std::numeric_limits<float>::quiet_NaN();
  const int exponent = (v >> 3) & 15, mantissa = v & 7;
  // Exponent 0: subnormal, m / 8 x 2^-6; else (1 + m / 8) x 2^(e - 7).
  const float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                        : std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
  return (v & 0x80) != 0 ? -magnitude : magnitude;
}

uint8_t FloatToFp8E4m3(float v) {
  if (std::isnan(v)) return 0x7F;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const float a = Min(std::fabs(v), kFp8E4m3Max);  // saturate (inf too)
  if (a == 0) return sign;
  // The step between neighbours at a's binade: 2^(e - 3) for normal a in [2^e, 2^(e+1)), e >= -6;
  // 2^-9 below 2^-6 (subnormal). a / step is then exact in float32 and rounds (to even) to the
  // number of steps, whose bits are the code's exponent and mantissa fields. No libm: e is a's
  // float exponent field (below 2^-126 anything under -6 does), a / step a product by a power of
  // two built from its bits (2^-5 .. 2^9: exact), the rounding float's own to nearest even: for 0
  // <= x < 2^23, x + 2^23 lies where floats are 1 apart (the sum's rounding is the rounding of x),
  // and subtracting 2^23 is exact. (Half of QuantizeFp8Rows' time was frexp, ldexp and nearbyint.)
  uint32_t bits;
  std::memcpy(&bits, &a, sizeof bits);
  const int binade = std::max(static_cast<int>(bits >> 23) - 127, -6);  // a > 0: no sign bit
  const uint32_t step_bits = static_cast<uint32_t>(3 - binade + 127) << 23;
  float inverse_step;
  std::memcpy(&inverse_step, &step_bits, sizeof inverse_step);
  const float steps = (a * inverse_step + 8388608.0f) - 8388608.0f;  // in [8, 16] (normal) or [0, 8] (subnormal)
  // 16 steps is the next binade's 8 (mantissa carries into the exponent); below 2^-6 the code is
  // the step count itself (exponent 0 or, at 8 steps, exponent 1 mantissa 0: the same bits).
  const int code = binade == -6 && steps < 8 ? static_cast<int>(steps)
                                             : ((binade + 7) << 3) + static_cast<int>(steps) - 8;
  return static_cast<uint8_t>(sign | std::min(code, 0x7E));
}

namespace {

void Fp8Rows(float* scale, uint8_t* q, const float* w, int64_t m, int64_t k) {
  for (int64_t r = 0; r < m; ++r) {
    const float* row = w + r * k;
    float max_abs = 0;
    for (int64_t c = 0; c < k; ++c) max_abs = Max(max_abs, std::fabs(row[c]));  // finite: std::fmax's
    scale[r] = max_abs / kFp8E4m3Max;
    uint8_t* out = q + r * k;
    for (int64_t c = 0; c < k; ++c) out[c] = scale[r] == 0 ? 0 : FloatToFp8E4m3(row[c] / scale[r]);
  }
}

}  // namespace

absl::Status QuantizeFp8Rows(float* scale, uint8_t* q, const float* w, int64_t m, int64_t k) {
  SHARDSERVE_RETURN_IF_ERROR(RefuseNonFinite("fp8", w, m, k));
  Fp8Rows(scale, q, w, m, k);
  return absl::OkStatus();
}

void DequantizeFp8Rows(float* w, const float* scale, const uint8_t* q, int64_t m, int64_t k) {
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < k; ++c) w[r * k + c] = Fp8E4m3ToFloat(q[r * k + c]) * scale[r];
  }
}

void DequantizeFp8Groups(float* w, const float* scale, const uint8_t* q, int64_t m, int64_t k, int64_t group) {
  const int64_t G = Fp8RowsLayout{m, k, group}.groups_per_row();
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < k; ++c) w[r * k + c] = Fp8E4m3ToFloat(q[r * k + c]) * scale[r * G + (G == 1 ? 0 : c / group)];
  }
}

absl::Status QuantizeInt4Groups(Int4Group128* blocks, const float* w, int64_t m, int64_t k) {
  SHARDSERVE_RETURN_IF_ERROR(RefuseNonFinite("int4", w, m, k));
  Int4Groups(blocks, w, m, k);
  return absl::OkStatus();
}

namespace {

// The first of a 16-bit weight's (F16 / BF16) rows [r0, r1) of width k whose exponent bits are all
// ones (Inf or NaN), as RefuseNonFinite's error with its value, else OK.
absl::Status RefuseNonFinite16(const char* format, const uint16_t* w, DType dtype, int64_t r0, int64_t r1, int64_t k) {
  const uint16_t exponent = dtype == DType::kBF16 ? 0x7F80 : 0x7C00;
  constexpr int64_t kRun = 64;
  for (int64_t i0 = r0 * k; i0 < r1 * k; i0 += kRun) {
    const int64_t i1 = std::min(r1 * k, i0 + kRun);
    bool any = false;
    for (int64_t i = i0; i < i1; ++i) any |= (w[i] & exponent) == exponent;
    if (!any) continue;
    for (int64_t i = i0; i < i1; ++i) {
      if ((w[i] & exponent) != exponent) continue;
      float v = 0.0f;
      ConvertOnHost(&v, DType::kF32, &w[i], dtype, 1);
      return absl::InvalidArgumentError(
          absl::StrCat(format, " quantization: weight [", i / k, ", ", i % k, "] is ", v, ", not a finite number"));
    }
  }
  return absl::OkStatus();
}

// f(r0, r1) for [0, m) in up to `threads` parts of at least 16 rows (this thread takes the first),
// the first error in row order.
absl::Status ForRowParts(int64_t m, int threads, const std::function<absl::Status(int64_t, int64_t)>& f) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  constexpr int64_t kMinRowsPerThread = 16;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, m / kMinRowsPerThread));
  std::vector<absl::Status> status(static_cast<size_t>(parts));
  std::vector<std::thread> workers;
  for (int64_t p = 1; p < parts; ++p) {
    const int64_t r0 = m * p / parts, r1 = m * (p + 1) / parts;
    try {
      workers.emplace_back([&, p, r0, r1] { status[p] = f(r0, r1); });
    } catch (const std::system_error&) {  // no thread to be had: this one does the part
      status[p] = f(r0, r1);
    }
  }
  status[0] = f(0, m / parts);
  for (std::thread& t : workers) t.join();
  for (const absl::Status& s : status) SHARDSERVE_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

}  // namespace

absl::Status QuantizeWeight(WeightQuant quant, void* stored, const void* w, DType dtype, int64_t m, int64_t k,
                            int threads) {
  if (quant == WeightQuant::kNone) return absl::InvalidArgumentError("QuantizeWeight: kNone is no quantized layout");
  if (quant == WeightQuant::kMxfp4) {
    return absl::InvalidArgumentError("QuantizeWeight: nothing quantizes into mxfp4; only a checkpoint stores it");
  }
  if (m < 0 || k < 0) return absl::InvalidArgumentError(absl::StrCat("QuantizeWeight: a [", m, ", ", k, "] weight"));
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("QuantizeWeight: a ", DTypeName(dtype), " weight; quantizers take F32, F16 or BF16"));
  }
  const char* name = WeightQuantName(quant);
  // The whole weight checked first, so that nothing is written for a weight that is refused; the
  // error names the first non-finite weight in row order (each part's first, in part order).
  SHARDSERVE_RETURN_IF_ERROR(ForRowParts(m, threads, [&](int64_t r0, int64_t r1) {
    return dtype == DType::kF32 ? RefuseNonFinite(name, static_cast<const float*>(w) + r0 * k, r1 - r0, k, r0)
                                : RefuseNonFinite16(name, static_cast<const uint16_t*>(w), dtype, r0, r1, k);
  }));
  // Rows [r0, r0 + n) from their float32 values f into their own bytes of the layout (checked
  // above: the unchecked quantizers).
  auto quantize = [&](int64_t r0, int64_t n, const float* f) {
    auto* bytes = static_cast<uint8_t*>(stored);
    if (quant == WeightQuant::kInt4) {
      Int4Groups(reinterpret_cast<Int4Group128*>(bytes) + r0 * Int4GroupsLayout{m, k}.groups_per_row(), f, n, k);
      return;
    }
    auto* scale = reinterpret_cast<float*>(bytes) + r0;
    uint8_t* q = bytes + Int8RowsLayout{m, k}.scale_bytes() + r0 * k;  // fp8's layout is int8's
    if (quant == WeightQuant::kInt8) {
      Int8Rows(scale, reinterpret_cast<int8_t*>(q), f, n, k);
    } else {
      Fp8Rows(scale, q, f, n, k);
    }
  };
  return ForRowParts(m, threads, [&](int64_t r0, int64_t r1) -> absl::Status {
    if (dtype == DType::kF32) {
      quantize(r0, r1 - r0, static_cast<const float*>(w) + r0 * k);
      return absl::OkStatus();
    }
    // 16-bit rows widened exactly, a few at a time, into this thread's float32 buffer (about 1 MiB).
    const int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, k));
    std::vector<float> f(static_cast<size_t>(std::min(chunk, r1 - r0) * k));
    for (int64_t c0 = r0; c0 < r1; c0 += chunk) {
      const int64_t n = std::min(chunk, r1 - c0);
      ConvertOnHost(f.data(), DType::kF32, static_cast<const uint16_t*>(w) + c0 * k, dtype, static_cast<size_t>(n * k));
      quantize(c0, n, f.data());
    }
    return absl::OkStatus();
  });
}

absl::Status QuantizeWeight(WeightQuant quant, void* stored, const float* w, int64_t m, int64_t k, int threads) {
  return QuantizeWeight(quant, stored, w, DType::kF32, m, k, threads);
}

void DequantizeInt4Groups(float* w, const Int4Group128* blocks, int64_t m, int64_t k) {
  const int64_t groups = Int4GroupsLayout{m, k}.groups_per_row();
  constexpr int64_t kHalf = kInt4GroupSize / 2;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const Int4Group128& b = blocks[r * groups + g];
      const int64_t size = std::min(kInt4GroupSize, k - g * kInt4GroupSize);
      for (int64_t j = 0; j < size; ++j) {
        const int q = j < kHalf ? (b.q[j] & 15) : (b.q[j - kHalf] >> 4);
        w[r * k + g * kInt4GroupSize + j] = static_cast<float>(q - b.zero) * b.scale;
      }
    }
  }
}

}  // namespace shardserve
