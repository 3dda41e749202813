#include "kernels/quant.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

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

// InvalidArgument naming the first non-finite weight of w [m, k] (row, column), else OK.
absl::Status RefuseNonFinite(const char* format, const float* w, int64_t m, int64_t k) {
  for (int64_t i = 0; i < m * k; ++i) {
    if (!std::isfinite(w[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(format, " quantization: weight [", i / k, ", ", i % k, "] is ", w[i], ", not a finite number"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

const char* WeightQuantName(WeightQuant q) {
  switch (q) {
    case WeightQuant::kNone: return "none";
    case WeightQuant::kInt8: return "int8";
    case WeightQuant::kInt4: return "int4";
    case WeightQuant::kFp8: return "fp8";
  }
  return "?";
}

absl::StatusOr<WeightQuant> ParseWeightQuant(absl::string_view name) {
  for (WeightQuant q : {WeightQuant::kNone, WeightQuant::kInt8, WeightQuant::kInt4, WeightQuant::kFp8}) {
    if (name == WeightQuantName(q)) return q;
  }
  return absl::InvalidArgumentError(absl::StrCat("quantization must be none, int8, int4 or fp8, got '", name, "'"));
}

int64_t QuantizedWeightBytes(WeightQuant q, int64_t m, int64_t k) {
  switch (q) {
    case WeightQuant::kNone: return m * k * static_cast<int64_t>(sizeof(float));
    case WeightQuant::kInt8: return Int8RowsLayout{m, k}.bytes();
    case WeightQuant::kInt4: return Int4GroupsLayout{m, k}.bytes();
    case WeightQuant::kFp8: return Fp8RowsLayout{m, k}.bytes();
  }
  return 0;
}

absl::Status QuantizeInt8Rows(float* scale, int8_t* q, const float* w, int64_t m, int64_t k) {
  SHARDSERVE_RETURN_IF_ERROR(RefuseNonFinite("int8", w, m, k));
  for (int64_t r = 0; r < m; ++r) {
    const float* row = w + r * k;
    float max_abs = 0;
    for (int64_t c = 0; c < k; ++c) max_abs = Max(max_abs, std::fabs(row[c]));
    scale[r] = max_abs / 127.0f;
    int8_t* out = q + r * k;
    for (int64_t c = 0; c < k; ++c) {
      // |row[c] / scale| <= 127 up to rounding of the division: clamp it there.
      const float v = scale[r] == 0 ? 0.0f : RoundHalfAway(row[c] / scale[r]);
      out[c] = static_cast<int8_t>(Max(-127.0f, Min(127.0f, v)));
    }
  }
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
  const float a = std::fmin(std::fabs(v), kFp8E4m3Max);  // saturate (inf too)
  if (a == 0) return sign;
  // The step between neighbours at a's binade: 2^(e - 3) for normal a in [2^e, 2^(e+1)), e >= -6;
  // 2^-9 below 2^-6 (subnormal). a / step is then exact in float32 and rounds (to even) to the
  // number of steps, whose bits are the code's exponent and mantissa fields.
  int e;
  std::frexp(a, &e);  // a = f x 2^e, f in [0.5, 1): a in [2^(e-1), 2^e)
  const int binade = std::max(e - 1, -6);
  const float steps = std::nearbyint(std::ldexp(a, 3 - binade));  // in [8, 16] (normal) or [0, 8] (subnormal)
  // 16 steps is the next binade's 8 (mantissa carries into the exponent); below 2^-6 the code is
  // the step count itself (exponent 0 or, at 8 steps, exponent 1 mantissa 0: the same bits).
  const int code = binade == -6 && steps < 8 ? static_cast<int>(steps)
                                             : ((binade + 7) << 3) + static_cast<int>(steps) - 8;
  return static_cast<uint8_t>(sign | std::min(code, 0x7E));
}

absl::Status QuantizeFp8Rows(float* scale, uint8_t* q, const float* w, int64_t m, int64_t k) {
  SHARDSERVE_RETURN_IF_ERROR(RefuseNonFinite("fp8", w, m, k));
  for (int64_t r = 0; r < m; ++r) {
    const float* row = w + r * k;
    float max_abs = 0;
    for (int64_t c = 0; c < k; ++c) max_abs = std::fmax(max_abs, std::fabs(row[c]));
    scale[r] = max_abs / kFp8E4m3Max;
    uint8_t* out = q + r * k;
    for (int64_t c = 0; c < k; ++c) out[c] = scale[r] == 0 ? 0 : FloatToFp8E4m3(row[c] / scale[r]);
  }
  return absl::OkStatus();
}

void DequantizeFp8Rows(float* w, const float* scale, const uint8_t* q, int64_t m, int64_t k) {
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < k; ++c) w[r * k + c] = Fp8E4m3ToFloat(q[r * k + c]) * scale[r];
  }
}

absl::Status QuantizeInt4Groups(Int4Group128* blocks, const float* w, int64_t m, int64_t k) {
  SHARDSERVE_RETURN_IF_ERROR(RefuseNonFinite("int4", w, m, k));
  const int64_t groups = Int4GroupsLayout{m, k}.groups_per_row();
  constexpr int64_t kHalf = kInt4GroupSize / 2;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* v = w + r * k + g * kInt4GroupSize;
      const int64_t size = std::min(kInt4GroupSize, k - g * kInt4GroupSize);  // the last group may be short
      Int4Group128& b = blocks[r * groups + g];
      b = Int4Group128{};
      float lo = 0, hi = 0;  // the range, widened to hold 0
      for (int64_t j = 0; j < size; ++j) {
        lo = Min(lo, v[j]);
        hi = Max(hi, v[j]);
      }
      // hi - lo may overflow to inf for weights near float's limits: divide each first.
      const float scale = hi / 15.0f - lo / 15.0f;
      if (!(scale > 0)) continue;  // an all-zero group (or one too small to scale): q = 0, s = 0
      b.scale = scale;
      b.zero = static_cast<uint8_t>(Min(15.0f, Max(0.0f, RoundHalfAway(-lo / scale))));
      for (int64_t j = 0; j < size; ++j) {
        const float q = Min(15.0f, Max(0.0f, RoundHalfAway(v[j] / scale) + b.zero));
        const auto nibble = static_cast<uint8_t>(q);
        b.q[j % kHalf] |= static_cast<uint8_t>(j < kHalf ? nibble : nibble << 4);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status QuantizeWeight(WeightQuant quant, void* stored, const float* w, int64_t m, int64_t k, int threads) {
  if (quant == WeightQuant::kNone) return absl::InvalidArgumentError("QuantizeWeight: kNone is no quantized layout");
  if (m < 0 || k < 0) return absl::InvalidArgumentError(absl::StrCat("QuantizeWeight: a [", m, ", ", k, "] weight"));
  // Here, with the whole weight's row and column (each thread's quantizer would name its own rows').
  SHARDSERVE_RETURN_IF_ERROR(RefuseNonFinite(WeightQuantName(quant), w, m, k));
  // Rows [r0, r1) into their own bytes of the layout.
  auto rows = [&](int64_t r0, int64_t r1) -> absl::Status {
    const int64_t n = r1 - r0;
    auto* bytes = static_cast<uint8_t*>(stored);
    if (quant == WeightQuant::kInt4) {
      return QuantizeInt4Groups(reinterpret_cast<Int4Group128*>(bytes) + r0 * Int4GroupsLayout{m, k}.groups_per_row(),
                                w + r0 * k, n, k);
    }
    auto* scale = reinterpret_cast<float*>(bytes) + r0;
    uint8_t* q = bytes + Int8RowsLayout{m, k}.scale_bytes() + r0 * k;  // fp8's layout is int8's
    return quant == WeightQuant::kInt8 ? QuantizeInt8Rows(scale, reinterpret_cast<int8_t*>(q), w + r0 * k, n, k)
                                       : QuantizeFp8Rows(scale, q, w + r0 * k, n, k);
  };
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  constexpr int64_t kMinRowsPerThread = 16;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, m / kMinRowsPerThread));
  std::vector<absl::Status> status(static_cast<size_t>(parts));
  std::vector<std::thread> workers;
  for (int64_t p = 1; p < parts; ++p) {
    const int64_t r0 = m * p / parts, r1 = m * (p + 1) / parts;
    try {
      workers.emplace_back([&, p, r0, r1] { status[p] = rows(r0, r1); });
    } catch (const std::system_error&) {  // no thread to be had: this one does the part
      status[p] = rows(r0, r1);
    }
  }
  status[0] = rows(0, m / parts);
  for (std::thread& t : workers) t.join();
  for (const absl::Status& s : status) SHARDSERVE_RETURN_IF_ERROR(s);
  return absl::OkStatus();
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
