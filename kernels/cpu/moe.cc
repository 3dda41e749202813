// CpuBackend's mixture-of-experts steps: MoeRoute, MoeGroupByExpert and MoeCombine (kernels/backend.h
// states what each computes). Plain loops on the calling thread: the router's work is a few
// passes over E per token, and the combine is k row updates per token.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/moe_routing.h"

namespace shardserve::cpu {

absl::Status CpuBackend::MoeRoute(Tensor* ids, Tensor* weights, const Tensor& logits, const MoeRouting& routing) {
  const ArgCheck check("MoeRoute", {{"ids", ids, kI32, 2}, {"weights", weights, kF32, 2}, {"logits", &logits, kF32, 2}});
  SHARDSERVE_RETURN_IF_ERROR(check.Types());
  const int64_t n = logits.dim(0);
  const int64_t E = logits.dim(1);
  SHARDSERVE_RETURN_IF_ERROR(CheckMoeRouting("MoeRoute", routing, E));
  if (ids->dim(0) != n || ids->dim(1) != routing.k || !SameShape(*ids, *weights)) {
    return check.Error(absl::StrCat("want ids and weights [n, k] = [", n, ", ", routing.k, "] for logits [n, E]"));
  }
  const float* bias = routing.selection_bias != nullptr ? routing.selection_bias->as<const float>() : nullptr;
  if (bias != nullptr) {
    for (int64_t e = 0; e < E; ++e) {
      if (!std::isfinite(bias[e])) return check.Error(absl::StrCat("selection_bias[", e, "] = ", bias[e], " is not finite"));
    }
  }
  const float* x = logits.as<const float>();
  for (int64_t i = 0; i < n * E; ++i) {
    if (!std::isfinite(x[i])) {
      return check.Error(absl::StrCat("router logit [", i / E, ", ", i % E, "] = ", x[i],
                                      " is not finite (NaN or infinite logits have no routing)"));
    }
  }
  const moe::RouteParams p{static_cast<int>(routing.router), static_cast<int>(E), routing.k, routing.norm_topk_prob,
                           routing.n_group, routing.topk_group, routing.routed_scaling_factor, bias};
  int32_t* out_ids = ids->as<int32_t>();
  float* out_w = weights->as<float>();
  for (int64_t t = 0; t < n; ++t) moe::RouteToken(x + t * E, p, out_ids + t * p.k, out_w + t * p.k);
  // weights_in_act: the act dtype is F32 here, so nothing to round.
  return absl::OkStatus();
}

absl::Status CpuBackend::MoeGroupByExpert(Tensor* order, Tensor* rows, Tensor* offsets, Tensor* tokens,
                                          const Tensor& ids) {
  const ArgCheck check("MoeGroupByExpert", {{"order", order, kI32, 1},
                                            {"rows", rows, kI32, 2},
                                            {"offsets", offsets, kI32, 1},
                                            {"tokens", tokens, kI32, 1, true},
                                            {"ids", &ids, kI32, 2}});
  SHARDSERVE_RETURN_IF_ERROR(check.Types());
  const int64_t pairs = ids.numel();
  if (!SameShape(*rows, ids) || order->dim(0) != pairs || offsets->dim(0) < 2 ||
      (tokens != nullptr && tokens->dim(0) != pairs)) {
    return check.Error("want order and tokens [n * k], rows and ids [n, k], offsets [E + 1] with E >= 1");
  }
  if (pairs > std::numeric_limits<int32_t>::max()) return check.Error("n * k must be below 2^31");
  const int64_t E = offsets->dim(0) - 1;
  const int32_t* id = ids.as<const int32_t>();
  for (int64_t i = 0; i < pairs; ++i) {
    if (id[i] < 0 || id[i] >= E) {
      return check.Error(absl::StrCat("ids[", i / ids.dim(1), ", ", i % ids.dim(1), "] = ", id[i], " outside [0, E = ", E, ")"));
    }
  }
  // Counting sort: counts, their exclusive prefix sums, then each pair in increasing p.
  int32_t* off = offsets->as<int32_t>();
  std::vector<int32_t> next(E + 1, 0);
  for (int64_t i = 0; i < pairs; ++i) ++next[id[i] + 1];
  for (int64_t e = 0; e < E; ++e) next[e + 1] += next[e];
  std::copy(next.begin(), next.end(), off);
  int32_t* ord = order->as<int32_t>();
  int32_t* row = rows->as<int32_t>();
  for (int64_t i = 0; i < pairs; ++i) {
    const int32_t r = next[id[i]]++;
    ord[r] = static_cast<int32_t>(i);
    row[i] = r;
  }
  if (tokens != nullptr) {
    int32_t* token = tokens->as<int32_t>();
    const int64_t k = ids.dim(1);
    for (int64_t r = 0; r < pairs; ++r) token[r] = static_cast<int32_t>(ord[r] / k);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::MoeCountRows(Tensor* counts, const Tensor& offsets, int64_t begin, int64_t end) {
  const ArgCheck check("MoeCountRows", {{"counts", counts, kI32, 1}, {"offsets", &offsets, kI32, 1}});
  SHARDSERVE_RETURN_IF_ERROR(check.Types());
  const int64_t E = counts->dim(0);
  if (offsets.dim(0) != E + 1 || begin < 0 || begin > end || end > E) {
    return check.Error(absl::StrCat("want counts [E], offsets [E + 1] and experts [", begin, ", ", end,
                                    ") within [0, E)"));
  }
  const int32_t* off = offsets.as<const int32_t>();
  int32_t* count = counts->as<int32_t>();
  for (int64_t e = begin; e < end; ++e) {
    if (off[e + 1] < off[e]) {
      return check.Error(absl::StrCat("offsets[", e + 1, "] = ", off[e + 1], " is below offsets[", e, "] = ", off[e]));
    }
    count[e] += off[e + 1] - off[e];
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::MoeCombine(Tensor* out, const Tensor& expert_out, const Tensor& rows, const Tensor& weights) {
  const ArgCheck check("MoeCombine", {{"out", out, kF32, 2},
                                      {"expert_out", &expert_out, kF32, 2},
                                      {"rows", &rows, kI32, 2},
                                      {"weights", &weights, kF32, 2}});
  SHARDSERVE_RETURN_IF_ERROR(check.Types());
  const int64_t n = out->dim(0), d = out->dim(1), k = rows.dim(1);
  if (!SameShape(rows, weights) || rows.dim(0) != n || expert_out.dim(1) != d) {
    return check.Error("want out [n, d], expert_out [expert_rows, d], rows and weights [n, k]");
  }
  if (out->numel() > 0 && out->data == expert_out.data) return check.Error("out must not alias expert_out");
  const int64_t expert_rows = expert_out.dim(0);
  const int32_t* row = rows.as<const int32_t>();
  for (int64_t i = 0; i < rows.numel(); ++i) {
    if (row[i] < 0 || row[i] >= expert_rows) {
      return check.Error(absl::StrCat("rows[", i / k, ", ", i % k, "] = ", row[i], " outside [0, expert_rows = ",
                                      expert_rows, ")"));
    }
  }
  const float* w = weights.as<const float>();
  const float* y = expert_out.as<const float>();
  float* o = out->as<float>();
  std::vector<int> slots(k);
  for (int64_t t = 0; t < n; ++t) {
    // The token's slots in increasing row (transformers' expert order for grouped rows).
    for (int64_t s = 0; s < k; ++s) slots[s] = static_cast<int>(s);
    const int32_t* tr = row + t * k;
    std::sort(slots.begin(), slots.end(), [&](int a, int b) { return tr[a] < tr[b] || (tr[a] == tr[b] && a < b); });
    float* ot = o + t * d;
    std::fill(ot, ot + d, 0.0f);
    for (int64_t s : slots) {
      const float ws = w[t * k + s];
      const float* ys = y + static_cast<int64_t>(tr[s]) * d;
      for (int64_t j = 0; j < d; ++j) ot[j] += ws * ys[j];
    }
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::SigmoidGateMul(Tensor* out, const Tensor& x, const Tensor& gate) {
  const ArgCheck check("SigmoidGateMul", {{"out", out, kF32, 2}, {"x", &x, kF32, 2}, {"gate", &gate, kF32, 2}});
  SHARDSERVE_RETURN_IF_ERROR(check.Types());
  const int64_t n = x.dim(0), d = x.dim(1);
  if (!SameShape(*out, x) || gate.dim(0) != n || gate.dim(1) != 1) {
    return check.Error("want out and x [n, d], gate [n, 1]");
  }
  const float* g = gate.as<const float>();
  const float* in = x.as<const float>();
  float* o = out->as<float>();
  for (int64_t t = 0; t < n; ++t) {
    const float scale = 1.0f / (1.0f + std::exp(-g[t]));
    for (int64_t j = 0; j < d; ++j) o[t * d + j] = in[t * d + j] * scale;
  }
  return absl::OkStatus();
}

}  // namespace shardserve::cpu
