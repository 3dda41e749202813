// Number formatting shared by the planner's messages and its table: one way to print a size, a
// count and a duration everywhere.
#ifndef SHARDSERVE_COORDINATOR_PLANNER_FORMAT_H_
#define SHARDSERVE_COORDINATOR_PLANNER_FORMAT_H_

#include <cstdint>
#include <string>

#include "absl/strings/str_format.h"

namespace shardserve::planner_format {

// "17,984".
inline std::string Count(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

// "135.43 GiB", "12.50 MiB", "3.0 KiB": binary units, as GPU memory is sold and nvidia-smi counts
// it, in the largest unit that keeps a digit before the point.
inline std::string Size(double bytes) {
  constexpr double kKiB = 1024.0, kMiB = kKiB * 1024, kGiB = kMiB * 1024;
  const double magnitude = bytes < 0 ? -bytes : bytes;
  if (magnitude >= kGiB) return absl::StrFormat("%.2f GiB", bytes / kGiB);
  if (magnitude >= kMiB) return absl::StrFormat("%.2f MiB", bytes / kMiB);
  return absl::StrFormat("%.1f KiB", bytes / kKiB);
}

// "72.71B", "494.03M", "214,528".
inline std::string Parameters(int64_t n) {
  if (n >= 1'000'000'000) return absl::StrFormat("%.2fB", n / 1e9);
  if (n >= 1'000'000) return absl::StrFormat("%.2fM", n / 1e6);
  return Count(n);
}

// "37.31 ms".
inline std::string Ms(double seconds) { return absl::StrFormat("%.2f ms", seconds * 1e3); }

// How a model's weights are held, after its size: "in bf16", or where its routed experts' products
// are kept in a format of their own (Plan::experts_format), "in bf16 with the experts' products in
// mxfp4 (4.25 bits a weight, as published)".
inline std::string HeldIn(const std::string& dtype, const std::string& experts_format) {
  if (experts_format.empty()) return "in " + dtype;
  return absl::StrFormat("in %s with the experts' products in %s%s", dtype, experts_format,
                         experts_format == "mxfp4" ? " (4.25 bits a weight, as published)" : "");
}

// "TP=2 x PP=1".
inline std::string Layout(int tp, int pp) { return absl::StrFormat("TP=%d x PP=%d", tp, pp); }

}  // namespace shardserve::planner_format

#endif  // SHARDSERVE_COORDINATOR_PLANNER_FORMAT_H_
