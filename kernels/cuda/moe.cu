// CudaBackend's mixture-of-experts steps: MoeRoute (a thread per token running kernels/moe_routing.h,
// the CPU backend's code), MoeGroupByExpert (a counting sort in one block), MoeCountRows (a thread
// per expert), MoeCombine and SigmoidGateMul (a block per token). Bad ids, rows and non-finite logits, which only the device sees, set bits of the
// device error word (reported by the next Synchronize()) and are skipped.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_backend.cuh"
#include "kernels/cuda/device_util.cuh"
#include "kernels/moe_routing.h"

namespace shardserve::cuda {
namespace {

// MoeRoute: one thread per token; a token's work is k passes over its E logits (at most a few
// thousand exps for E = 256, k = 8), and 128-thread blocks spread a decode batch over SMs.
constexpr int kMoeRouteThreads = 128;
// MoeGroupByExpert: one block; each thread counts, then places, the pairs of its experts (so the
// order within an expert is the pairs' order without atomics): O(E x n x k) reads of the ids, all
// threads reading the same id at once (a broadcast). A first version, meant for decode-sized steps.
constexpr int kMoeGroupThreads = 1024;
// MoeCombine: one block per token, a thread per element of the row (rows of 2k-8k elements).
constexpr int kMoeCombineThreads = 256;

// weights_rounding: 0 none, else the act dtype's rounding (1 bf16, 2 f16). L: the logits' type
// (float, or the act dtype widened as read).
template <typename L>
__global__ void MoeRouteKernel(int32_t* ids, float* weights, const L* logits, moe::RouteParams p, int64_t n,
                               int weights_rounding, unsigned* errors) {
  WaitForPriorKernels();
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n) return;
  int32_t* id = ids + t * p.k;
  float* w = weights + t * p.k;
  if (!moe::RouteToken(logits + t * p.experts, p, id, w)) {
    atomicOr(errors, kErrMoeLogit);
    return;
  }
  for (int i = 0; i < p.k; ++i) {
    if (weights_rounding == 1) w[i] = __bfloat162float(__float2bfloat16(w[i]));
    if (weights_rounding == 2) w[i] = __half2float(__float2half(w[i]));
  }
}

// tokens (may be null): each grouped pair's token, order / k.
__global__ void MoeGroupKernel(int32_t* order, int32_t* rows, int32_t* offsets, int32_t* tokens, const int32_t* ids,
                               int64_t pairs, int64_t k, int64_t experts, unsigned* errors) {
  WaitForPriorKernels();
  for (int64_t i = threadIdx.x; i < pairs; i += blockDim.x) {
    if (ids[i] < 0 || ids[i] >= experts) {
      rows[i] = -1;
      atomicOr(errors, kErrMoeExpert);
    }
  }
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    int32_t count = 0;
    for (int64_t i = 0; i < pairs; ++i) count += ids[i] == e;
    offsets[e + 1] = count;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    offsets[0] = 0;
    for (int64_t e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < experts; e += blockDim.x) {
    int32_t at = offsets[e];
    for (int64_t i = 0; i < pairs; ++i) {
      if (ids[i] != e) continue;
      order[at] = static_cast<int32_t>(i);
      if (tokens != nullptr) tokens[at] = static_cast<int32_t>(i / k);
      rows[i] = at++;
    }
  }
}

// counts[e] += offsets[e + 1] - offsets[e], a thread per expert.
__global__ void MoeCountRowsKernel(int32_t* counts, const int32_t* offsets, int64_t begin, int64_t end,
                                   unsigned* errors) {
  WaitForPriorKernels();
  const int64_t e = begin + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= end) return;
  const int32_t rows = offsets[e + 1] - offsets[e];
  if (rows < 0) {
    atomicOr(errors, kErrMoeOffsets);
    return;
  }
  counts[e] += rows;
}

// out[t] = round(x[t] * round(sigmoid(gate[t]))), a block per token.
template <typename T>
__global__ void SigmoidGateMulKernel(T* out, const T* x, const T* gate, int64_t d) {
  WaitForPriorKernels();
  const int64_t t = blockIdx.x;
  const float scale = ToFloat(FromFloat<T>(1.0f / (1.0f + expf(-ToFloat(gate[t])))));
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    out[t * d + j] = FromFloat<T>(__fmul_rn(ToFloat(x[t * d + j]), scale));
  }
}

// out[t] = sum of w * y[row] over the token's slots in increasing row, each product and each sum
// rounded to T (transformers' index_add_ in the hidden dtype); __fmul_rn / __fadd_rn keep the
// compiler from fusing them into an FMA, which would round once where transformers rounds twice.
template <typename T>
__global__ void MoeCombineKernel(T* out, const T* y, const int32_t* rows, const float* weights, int64_t d, int k,
                                 int64_t expert_rows, unsigned* errors) {
  WaitForPriorKernels();
  const int64_t t = blockIdx.x;
  const int32_t* row = rows + t * k;
  const float* w = weights + t * k;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    float acc = 0.0f;
    int prev = -1;  // slot added last; slots in (row, slot) order
    for (int i = 0; i < k; ++i) {
      int s = -1;
      for (int c = 0; c < k; ++c) {
        const bool after = prev < 0 || row[c] > row[prev] || (row[c] == row[prev] && c > prev);
        if (after && (s < 0 || row[c] < row[s] || (row[c] == row[s] && c < s))) s = c;
      }
      prev = s;
      const int32_t r = row[s];
      if (r < 0 || r >= expert_rows) {
        if (j == 0) atomicOr(errors, kErrMoeRow);
        continue;
      }
      const float prod = ToFloat(FromFloat<T>(__fmul_rn(w[s], ToFloat(y[r * d + j]))));
      acc = ToFloat(FromFloat<T>(__fadd_rn(acc, prod)));
    }
    out[t * d + j] = FromFloat<T>(acc);
  }
}

// MoeExperts with CudaBackendOptions::moe_grouped: a grouped GEMV. A block per (expert, product,
// tile of kGroupedWarps output columns), a warp per column; the expert's rows, read from the offsets
// on the device, kGroupedRows at a time, so that a decode step reads each expert's weights about
// once. Blocks of experts without rows return at once; the grid is fixed by the expert count, so a
// step graph replays it whatever the routing.
constexpr int kGroupedWarps = 8;
constexpr int kGroupedRows = 4;

// One product of a launch: per expert e (device arrays), its weight [m, k] and bias [m] (entries or
// the whole array null: none), into out [rows, m].
template <typename T>
struct GroupedProduct {
  const T* const* w;
  const T* const* bias;
  T* out;
};

// kVec inputs of a lane at a time (16 bytes) where k is a multiple of it and rows are 16-byte aligned.
template <typename T, int kVec>
__global__ void GroupedGemvKernel(GroupedProduct<T> p0, GroupedProduct<T> p1, int products, const T* x,
                                  int64_t x_rows, const int32_t* offsets, int64_t begin, int64_t m, int64_t k,
                                  unsigned tiles, unsigned* errors) {
  WaitForPriorKernels();
  const unsigned tile = blockIdx.x % tiles;
  const unsigned rest = blockIdx.x / tiles;
  const GroupedProduct<T>& p = rest % products == 0 ? p0 : p1;
  const int64_t e = begin + rest / products;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t j = static_cast<int64_t>(tile) * kGroupedWarps + warp;
  const int64_t row_begin = offsets[e], row_end = offsets[e + 1];
  if (row_begin < 0 || row_end < row_begin || row_end > x_rows) {
    if (threadIdx.x == 0 && tile == 0) atomicOr(errors, kErrMoeOffsets);
    return;
  }
  if (j >= m) return;  // whole warps
  const T* w = p.w[e] + j * k;
  const T* bias = p.bias != nullptr ? p.bias[e] : nullptr;
  for (int64_t r0 = row_begin; r0 < row_end; r0 += kGroupedRows) {
    const int rows = static_cast<int>(row_end - r0 < kGroupedRows ? row_end - r0 : kGroupedRows);
    float acc[kGroupedRows] = {};
    for (int64_t i = static_cast<int64_t>(lane) * kVec; i < k; i += 32 * kVec) {
      alignas(16) T wv[kVec];
      if constexpr (kVec > 1) {
        *reinterpret_cast<uint4*>(wv) = *reinterpret_cast<const uint4*>(w + i);
      } else {
        wv[0] = w[i];
      }
#pragma unroll
      for (int r = 0; r < kGroupedRows; ++r) {
        if (r >= rows) break;
        alignas(16) T xv[kVec];
        if constexpr (kVec > 1) {
          *reinterpret_cast<uint4*>(xv) = *reinterpret_cast<const uint4*>(x + (r0 + r) * k + i);
        } else {
          xv[0] = x[(r0 + r) * k + i];
        }
#pragma unroll
        for (int v = 0; v < kVec; ++v) acc[r] = fmaf(ToFloat(wv[v]), ToFloat(xv[v]), acc[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < kGroupedRows; ++r) {
      float sum = acc[r];
      for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      if (lane == 0 && r < rows) {
        p.out[(r0 + r) * m + j] = FromFloat<T>(sum + (bias != nullptr ? ToFloat(bias[j]) : 0.0f));
      }
    }
  }
}

}  // namespace

absl::StatusOr<const CudaBackend::GroupedExperts*> CudaBackend::GroupedTable(const MoeExpertWeights& w, int64_t f,
                                                                            int64_t h, int64_t d) {
  const int64_t E = static_cast<int64_t>(w.gate_proj.size());
  std::vector<const void*> host(static_cast<size_t>(6 * E), nullptr);
  bool grouped = true;
  const auto plain = [&](const Tensor& t, int64_t rows, int64_t cols) {
    const bool ok = t.data != nullptr && t.quant == WeightQuant::kNone && t.dtype == act_ && t.ndim == 2 &&
                    t.dim(0) == rows && t.dim(1) == cols && reinterpret_cast<uintptr_t>(t.data) % 16 == 0;
    grouped = grouped && ok;
    return t.data;
  };
  const auto bias = [&](absl::Span<const Tensor> b, int64_t e, int64_t size) -> const void* {
    if (e >= static_cast<int64_t>(b.size()) || b[e].data == nullptr) return nullptr;
    grouped = grouped && b[e].dtype == act_ && b[e].numel() == size;
    return b[e].data;
  };
  for (int64_t e = w.begin; e < w.end; ++e) {
    host[e] = plain(w.gate_proj[e], f, h);
    host[E + e] = plain(w.up_proj[e], f, h);
    host[2 * E + e] = plain(w.down_proj[e], d, f);
    host[3 * E + e] = bias(w.gate_bias, e, f);
    host[4 * E + e] = bias(w.up_bias, e, f);
    host[5 * E + e] = bias(w.down_bias, e, d);
  }
  GroupedExperts& t = grouped_experts_[w.gate_proj.data()];
  if (t.host == host && (t.table.data() != nullptr || !t.grouped)) return &t;
  t.host = host;
  t.grouped = grouped;
  if (!grouped) return &t;
  SHARDSERVE_ASSIGN_OR_RETURN(t.table, Allocate(host.size() * sizeof(void*)));
  SHARDSERVE_RETURN_IF_ERROR(CopyToDevice(t.table.data(), host.data(), host.size() * sizeof(void*)));
  return &t;
}

absl::Status CudaBackend::MoeExperts(Tensor* out, Tensor* gate, Tensor* up, const Tensor& x, const Tensor& offsets,
                                     const MoeExpertWeights& w) {
  constexpr const char* kOp = "MoeExperts";
  SHARDSERVE_RETURN_IF_ERROR(CheckMoeExperts(kOp, out, gate, up, x, offsets, w));
  if (!options_.moe_grouped) return Backend::MoeExperts(out, gate, up, x, offsets, w);
  const auto all = {std::pair<const char*, const Tensor*>{"out", out}, {"gate", gate}, {"up", up}, {"x", &x}};
  if (!Is(*out, 2, act_) || !Is(*gate, 2, act_) || !Is(*up, 2, act_) || !Is(x, 2, act_)) {
    return Invalid(kOp, absl::StrCat("want out, gate, up and x ", DTypeName(act_)), all);
  }
  const int64_t rows = x.dim(0), h = x.dim(1), f = gate->dim(1), d = out->dim(1);
  SHARDSERVE_ASSIGN_OR_RETURN(const GroupedExperts* table, GroupedTable(w, f, h, d));
  if (!table->grouped) return Backend::MoeExperts(out, gate, up, x, offsets, w);  // quantized experts: the loop
  if (w.begin == w.end || rows == 0) return absl::OkStatus();
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  const int64_t E = static_cast<int64_t>(w.gate_proj.size()), experts = w.end - w.begin;
  const void* const* ptr = static_cast<const void* const*>(table->table.data());
  const bool any_bias = std::any_of(table->host.begin() + 3 * E, table->host.end(), [](const void* p) { return p; });
  return DispatchFloat(act_, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    constexpr int kVec = 16 / sizeof(T);
    const auto table_of = [&](int i) { return reinterpret_cast<const T* const*>(ptr + i * E); };
    const auto launch = [&](GroupedProduct<T> p0, GroupedProduct<T> p1, int products, const Tensor& in, int64_t m,
                            int64_t k) {
      const unsigned tiles = static_cast<unsigned>((m + kGroupedWarps - 1) / kGroupedWarps);
      const unsigned grid = static_cast<unsigned>(tiles * products * experts);
      const bool vec = k % kVec == 0 && reinterpret_cast<uintptr_t>(in.data) % 16 == 0;
      if (vec) {
        return Launch("GroupedGemvKernel", GroupedGemvKernel<T, kVec>, grid, kGroupedWarps * 32, p0, p1, products,
                      in.as<const T>(), rows, offsets.as<const int32_t>(), w.begin, m, k, tiles, errors_dev_);
      }
      return Launch("GroupedGemvKernel", GroupedGemvKernel<T, 1>, grid, kGroupedWarps * 32, p0, p1, products,
                    in.as<const T>(), rows, offsets.as<const int32_t>(), w.begin, m, k, tiles, errors_dev_);
    };
    // gate = gate_proj(x) (+ bias), up = up_proj(x) (+ bias): one launch
    const GroupedProduct<T> g{table_of(0), any_bias ? table_of(3) : nullptr, gate->as<T>()};
    const GroupedProduct<T> u{table_of(1), any_bias ? table_of(4) : nullptr, up->as<T>()};
    SHARDSERVE_RETURN_IF_ERROR(launch(g, u, 2, x, f, h));
    // silu(gate) * up, or gpt-oss's clamped SwiGLU, over every row (a row of no expert here is scratch)
    if (w.swiglu_limit > 0.0f) {
      SHARDSERVE_RETURN_IF_ERROR(ClampedSwiGlu(gate, *gate, *up, w.swiglu_alpha, w.swiglu_limit));
    } else {
      SHARDSERVE_RETURN_IF_ERROR(SiluMul(gate, *gate, *up));
    }
    // out = down_proj(gate) (+ bias)
    const GroupedProduct<T> down{table_of(2), any_bias ? table_of(5) : nullptr, out->as<T>()};
    return launch(down, down, 1, *gate, d, f);
  });
}

absl::Status CudaBackend::MoeRoute(Tensor* ids, Tensor* weights, const Tensor& logits, const MoeRouting& routing) {
  constexpr const char* kOp = "MoeRoute";
  if (ids == nullptr || weights == nullptr) return Invalid(kOp, "ids and weights must not be null", {});
  const auto all = {std::pair<const char*, const Tensor*>{"ids", ids}, {"weights", weights}, {"logits", &logits}};
  if (!(Is(logits, 2, DType::kF32) || Is(logits, 2, act_)) || !Is(*ids, 2, DType::kI32) ||
      !Is(*weights, 2, DType::kF32)) {
    return Invalid(kOp, absl::StrCat("expected ids [n, k] I32, weights [n, k] F32, logits [n, E] F32 or ", DTypeName(act_)),
                   all);
  }
  const int64_t n = logits.dim(0), E = logits.dim(1);
  SHARDSERVE_RETURN_IF_ERROR(CheckMoeRouting(kOp, routing, E));
  if (ids->dim(0) != n || ids->dim(1) != routing.k || !SameShape(*ids, *weights)) {
    return Invalid(kOp, absl::StrCat("want ids and weights [n, k] = [", n, ", ", routing.k, "]"), all);
  }
  if (n == 0) return absl::OkStatus();
  if (n > int64_t{kMoeRouteThreads} * 0x7fffffff) return Invalid(kOp, "too many tokens", all);
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  const moe::RouteParams p{static_cast<int>(routing.router), static_cast<int>(E), routing.k, routing.norm_topk_prob,
                           routing.n_group, routing.topk_group, routing.routed_scaling_factor,
                           routing.selection_bias != nullptr ? routing.selection_bias->as<const float>() : nullptr};
  const int rounding = !routing.weights_in_act ? 0 : act_ == DType::kBF16 ? 1 : act_ == DType::kF16 ? 2 : 0;
  const unsigned grid = static_cast<unsigned>((n + kMoeRouteThreads - 1) / kMoeRouteThreads);
  return DispatchFloat(logits.dtype, [&](auto tag) {
    using L = typename decltype(tag)::type;
    return Launch("MoeRouteKernel", MoeRouteKernel<L>, grid, kMoeRouteThreads, ids->as<int32_t>(),
                  weights->as<float>(), logits.as<const L>(), p, n, rounding, errors_dev_);
  });
}

absl::Status CudaBackend::MoeGroupByExpert(Tensor* order, Tensor* rows, Tensor* offsets, Tensor* tokens,
                                           const Tensor& ids) {
  constexpr const char* kOp = "MoeGroupByExpert";
  if (order == nullptr || rows == nullptr || offsets == nullptr) {
    return Invalid(kOp, "order, rows and offsets must not be null", {});
  }
  const auto all = {std::pair<const char*, const Tensor*>{"order", order}, {"rows", rows}, {"offsets", offsets},
                    {"ids", &ids}};
  if (!Is(*order, 1, DType::kI32) || !Is(*rows, 2, DType::kI32) || !Is(*offsets, 1, DType::kI32) ||
      !Is(ids, 2, DType::kI32)) {
    return Invalid(kOp, "expected order [n * k], rows [n, k], offsets [E + 1] and ids [n, k], all I32", all);
  }
  const int64_t pairs = ids.numel();
  if (!SameShape(*rows, ids) || order->dim(0) != pairs || offsets->dim(0) < 2) {
    return Invalid(kOp, "want order [n * k], rows and ids [n, k], offsets [E + 1] with E >= 1", all);
  }
  if (tokens != nullptr && (!Is(*tokens, 1, DType::kI32) || tokens->dim(0) != pairs)) {
    return Invalid(kOp, "want tokens [n * k] I32", {{"tokens", tokens}, {"ids", &ids}});
  }
  if (pairs > 0x7fffffff) return Invalid(kOp, "n * k must be below 2^31", all);
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  return Launch("MoeGroupKernel", MoeGroupKernel, 1, kMoeGroupThreads, order->as<int32_t>(), rows->as<int32_t>(),
                offsets->as<int32_t>(), tokens != nullptr ? tokens->as<int32_t>() : nullptr, ids.as<const int32_t>(),
                pairs, ids.dim(1), offsets->dim(0) - 1, errors_dev_);
}

absl::Status CudaBackend::MoeCountRows(Tensor* counts, const Tensor& offsets, int64_t begin, int64_t end) {
  constexpr const char* kOp = "MoeCountRows";
  if (counts == nullptr) return Invalid(kOp, "counts is null", {});
  const auto all = {std::pair<const char*, const Tensor*>{"counts", counts}, {"offsets", &offsets}};
  if (!Is(*counts, 1, DType::kI32) || !Is(offsets, 1, DType::kI32) || offsets.dim(0) != counts->dim(0) + 1 ||
      begin < 0 || begin > end || end > counts->dim(0)) {
    return Invalid(kOp, absl::StrCat("want counts [E] and offsets [E + 1] I32, experts [", begin, ", ", end,
                                     ") within [0, E)"),
                   all);
  }
  if (begin == end) return absl::OkStatus();
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  constexpr int kThreads = 128;
  return Launch("MoeCountRowsKernel", MoeCountRowsKernel, static_cast<unsigned>((end - begin + kThreads - 1) / kThreads),
                kThreads, counts->as<int32_t>(), offsets.as<const int32_t>(), begin, end, errors_dev_);
}

absl::Status CudaBackend::SigmoidGateMul(Tensor* out, const Tensor& x, const Tensor& gate) {
  constexpr const char* kOp = "SigmoidGateMul";
  if (out == nullptr) return Invalid(kOp, "out is null", {});
  const auto all = {std::pair<const char*, const Tensor*>{"out", out}, {"x", &x}, {"gate", &gate}};
  if (!Is(*out, 2, act_) || !Is(x, 2, act_) || !Is(gate, 2, act_) || !SameShape(*out, x) || gate.dim(0) != x.dim(0) ||
      gate.dim(1) != 1) {
    return Invalid(kOp, absl::StrCat("want out and x [n, d], gate [n, 1], all ", DTypeName(act_)), all);
  }
  const int64_t n = x.dim(0);
  if (n == 0 || x.dim(1) == 0) return absl::OkStatus();
  if (n > 0x7fffffff) return Invalid(kOp, "too many tokens", all);
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  return DispatchFloat(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return Launch("SigmoidGateMulKernel", SigmoidGateMulKernel<T>, static_cast<unsigned>(n), kMoeCombineThreads,
                  out->as<T>(), x.as<const T>(), gate.as<const T>(), x.dim(1));
  });
}

absl::Status CudaBackend::MoeCombine(Tensor* out, const Tensor& expert_out, const Tensor& rows, const Tensor& weights) {
  constexpr const char* kOp = "MoeCombine";
  if (out == nullptr) return Invalid(kOp, "out is null", {});
  const auto all = {std::pair<const char*, const Tensor*>{"out", out}, {"expert_out", &expert_out}, {"rows", &rows},
                    {"weights", &weights}};
  if (!Is(*out, 2, act_) || !Is(expert_out, 2, act_) || !Is(rows, 2, DType::kI32) || !Is(weights, 2, DType::kF32)) {
    return Invalid(kOp, absl::StrCat("expected out [n, d] and expert_out [expert_rows, d] ", DTypeName(act_),
                                     ", rows [n, k] I32, weights [n, k] F32"),
                   all);
  }
  const int64_t n = out->dim(0), d = out->dim(1);
  if (!SameShape(rows, weights) || rows.dim(0) != n || expert_out.dim(1) != d) {
    return Invalid(kOp, "want out [n, d], expert_out [expert_rows, d], rows and weights [n, k]", all);
  }
  if (out->numel() > 0 && out->data == expert_out.data) return Invalid(kOp, "out must not alias expert_out", all);
  if (n == 0 || d == 0) return absl::OkStatus();
  if (n > 0x7fffffff || rows.dim(1) > 0x7fffffff) return Invalid(kOp, "too many tokens or slots", all);
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  return DispatchFloat(act_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return Launch("MoeCombineKernel", MoeCombineKernel<T>, static_cast<unsigned>(n), kMoeCombineThreads,
                  out->as<T>(), expert_out.as<const T>(), rows.as<const int32_t>(), weights.as<const float>(), d,
                  static_cast<int>(rows.dim(1)), expert_out.dim(0), errors_dev_);
  });
}

}  // namespace shardserve::cuda
