// The kernel benchmarks' (bench_matmul, bench_attention) command lines: every flag is `--name N`
// with N a positive integer, parsed by every binary's flag parser (base/flags.h).
#ifndef SHARDSERVE_TOOLS_BENCH_BENCH_UTIL_H_
#define SHARDSERVE_TOOLS_BENCH_BENCH_UTIL_H_

#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/flags.h"

namespace shardserve::bench {

// Each flag of `defaults` as given on the command line, else its default. An unknown flag, an
// argument that is not a flag, a value that is not an integer or one below 1 is an error naming it.
inline absl::StatusOr<std::map<std::string, int64_t>> PositiveIntFlags(int argc, char** argv,
                                                                       const std::map<std::string, int64_t>& defaults) {
  std::set<std::string> names;
  for (const auto& [name, fallback] : defaults) names.insert(name);
  absl::StatusOr<Flags> flags = Flags::Parse(std::vector<std::string>(argv + 1, argv + argc), names);
  if (!flags.ok()) return flags.status();
  if (!flags->positional().empty()) {
    return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", flags->positional()[0], "'"));
  }
  std::map<std::string, int64_t> values;
  for (const auto& [name, fallback] : defaults) {
    absl::StatusOr<int64_t> value = flags->GetInt(name, fallback);
    if (!value.ok()) return value.status();
    if (*value < 1) return absl::InvalidArgumentError(absl::StrCat("flag --", name, " must be >= 1, not ", *value));
    values[name] = *value;
  }
  return values;
}

// PositiveIntFlags, or nothing after printing "<tool>: <what is wrong>" and `usage` to stderr (the
// caller then exits with status 2).
inline std::optional<std::map<std::string, int64_t>> PositiveIntFlagsOrUsage(
    const char* tool, const char* usage, int argc, char** argv, const std::map<std::string, int64_t>& defaults) {
  absl::StatusOr<std::map<std::string, int64_t>> flags = PositiveIntFlags(argc, argv, defaults);
  if (!flags.ok()) {
    std::fprintf(stderr, "%s: %s\n%s", tool, std::string(flags.status().message()).c_str(), usage);
    return std::nullopt;
  }
  return *std::move(flags);
}

}  // namespace shardserve::bench

#endif  // SHARDSERVE_TOOLS_BENCH_BENCH_UTIL_H_
