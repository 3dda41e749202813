#include "coordinator/cluster/worker_messages.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "coordinator/planner/cluster.h"
#include "model/sampling_bounds.h"

namespace shardserve {
namespace {

// "cpu", "cuda" or "cuda:K", K a decimal number in [0, kMaxDeviceOrdinal] (the worker's
// --device, as worker/step_executor.h ParseDevice takes it, without a sign or spaces).
bool ValidDevice(const std::string& device) {
  if (device == "cpu" || device == "cuda") return true;
  if (device.rfind("cuda:", 0) != 0) return false;
  const std::string k = device.substr(5);
  if (k.empty() || k.size() > 4 || !std::all_of(k.begin(), k.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return false;
  }
  return std::stoi(k) <= kMaxDeviceOrdinal;
}

bool Printable(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c > ' ' && c < 127; });
}

}  // namespace

absl::Status CheckRegister(const v1::Register& hello) {
  if (hello.protocol_version() != kWorkerProtocolVersion) {
    return absl::FailedPreconditionError(absl::StrCat("the worker speaks protocol version ", hello.protocol_version(),
                                                      "; this coordinator speaks ", kWorkerProtocolVersion));
  }
  for (auto [field, value] : {std::pair{"node", &hello.node()}, {"device", &hello.device()},
                              {"address", &hello.address()}, {"collective_host", &hello.collective_host()}}) {
    if (value->empty() || value->size() > kMaxNameLength || !Printable(*value)) {
      return absl::InvalidArgumentError(absl::StrCat("register.", field, " must be 1 to ", kMaxNameLength,
                                                     " printable characters without spaces"));
    }
  }
  if (hello.metrics_address().size() > kMaxNameLength || !Printable(hello.metrics_address())) {
    return absl::InvalidArgumentError(absl::StrCat("register.metrics_address must be at most ", kMaxNameLength,
                                                   " printable characters without spaces"));
  }
  if (!ValidDevice(hello.device())) {
    return absl::InvalidArgumentError(absl::StrCat("register.device must be cpu, cuda or cuda:K with K in [0, ",
                                                   kMaxDeviceOrdinal, "], got \"", hello.device(), "\""));
  }
  if (hello.memory_bytes() <= 0 || hello.memory_bytes() > kMaxWorkerMemory) {
    return absl::InvalidArgumentError(absl::StrCat("register.memory_bytes must be in [1, 2^50], got ",
                                                   hello.memory_bytes()));
  }
  // 0: not reported (the planner assumes its default); anything else is a figure the planner
  // takes, or the worker is refused. NaN fails both comparisons.
  const double bandwidth = hello.memory_bytes_per_s();
  if (!(bandwidth == 0 || (bandwidth >= kMinBandwidthBytesPerS && bandwidth <= kMaxBandwidthBytesPerS))) {
    return absl::InvalidArgumentError(absl::StrCat("register.memory_bytes_per_s must be 0 (not reported) or in [",
                                                   kMinBandwidthBytesPerS, ", ", kMaxBandwidthBytesPerS,
                                                   "] bytes/s, got ", bandwidth));
  }
  if (!v1::CpuMatMulDtype_IsValid(hello.cpu_matmul())) {
    return absl::InvalidArgumentError(
        absl::StrCat("register.cpu_matmul must be one of CpuMatMulDtype's values, got ", hello.cpu_matmul()));
  }
  return absl::OkStatus();
}

absl::Status CheckStepResult(const v1::StepResult& r, int sampled_rows, int logprob_rows, int64_t vocab_size,
                             int draft_ids) {
  auto bad = [&](auto... parts) { return absl::InvalidArgumentError(absl::StrCat("step ", r.step_id(), " ", parts...)); };
  if (r.sampled_ids_size() != sampled_rows) {
    return bad("came back with ", r.sampled_ids_size(), " sampled ids, expected ", sampled_rows);
  }
  for (int32_t id : r.sampled_ids()) {
    if (id < 0 || id >= vocab_size) return bad("sampled id ", id, " outside the vocabulary [0, ", vocab_size, ")");
  }
  if (r.logprobs_size() != logprob_rows) {
    return bad("came back with ", r.logprobs_size(), " logprob rows, expected ", logprob_rows);
  }
  for (const v1::RowLogprobs& l : r.logprobs()) {
    if (l.top_ids_size() != l.top_logprobs_size() || l.top_ids_size() > kMaxTopLogprobs || std::isnan(l.logprob())) {
      return bad("has a malformed logprob row");
    }
    for (int32_t id : l.top_ids()) {
      if (id < 0 || id >= vocab_size) return bad("logprob id ", id, " outside the vocabulary [0, ", vocab_size, ")");
    }
  }
  if (r.draft_ids_size() != draft_ids) {
    return bad("came back with ", r.draft_ids_size(), " draft ids, expected ", draft_ids);
  }
  for (int32_t id : r.draft_ids()) {
    if (id < 0 || id >= vocab_size) return bad("draft id ", id, " outside the vocabulary [0, ", vocab_size, ")");
  }
  int32_t previous = -1;
  for (int32_t row : r.non_finite_rows()) {
    if (row <= previous || row >= sampled_rows) {
      return bad("non-finite row ", row, " is not ascending inside [0, ", sampled_rows, ")");
    }
    previous = row;
  }
  if (!(std::isfinite(r.forward_seconds()) && r.forward_seconds() >= 0 && std::isfinite(r.collective_seconds()) &&
        r.collective_seconds() >= 0)) {
    return bad("timings are not finite and >= 0");
  }
  return absl::OkStatus();
}

}  // namespace shardserve
