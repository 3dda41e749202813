#include "kernels/backend.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace shardserve {

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    if (owner_ != nullptr && data_ != nullptr) owner_->Free(data_);
    owner_ = o.owner_;
    data_ = o.data_;
    bytes_ = o.bytes_;
    o.owner_ = nullptr;
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

Buffer::~Buffer() {
  if (owner_ != nullptr && data_ != nullptr) owner_->Free(data_);
}

absl::Status CheckAttentionOptions(const char* op, const AttentionOptions& options, int64_t q_heads) {
  if (options.window < 0) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": window ", options.window, " is negative (0: no window)"));
  }
  if (!(options.softcap >= 0.0f) || !std::isfinite(options.softcap)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": softcap ", options.softcap, " is not a finite number >= 0 (0: no capping)"));
  }
  const Tensor* sinks = options.sinks;
  if (sinks != nullptr && (sinks->dtype != DType::kF32 || sinks->ndim != 1 || sinks->dim(0) != q_heads ||
                           (q_heads > 0 && sinks->data == nullptr))) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": sinks must be F32 [q_heads] = [", q_heads, "] with data; got ",
                                                   DTypeName(sinks->dtype), " ", sinks->ShapeString(),
                                                   sinks->data == nullptr ? " without data" : ""));
  }
  return absl::OkStatus();
}

absl::Status CheckRopeOptions(const char* op, const RopeOptions& options, int head_dim) {
  if (options.rotary_dim < 0 || options.rotary_dim % 2 != 0 || options.rotary_dim > head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": rotary_dim ", options.rotary_dim,
                                                   " must be even and in [2, head_dim ", head_dim,
                                                   "] (0: the whole head)"));
  }
  if (!(options.attention_factor > 0.0f) || !std::isfinite(options.attention_factor)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": attention_factor ", options.attention_factor, " is not a finite number > 0"));
  }
  if (options.long_from < 0) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": long_from ", options.long_from, " is negative"));
  }
  const int64_t half = (options.rotary_dim > 0 ? options.rotary_dim : head_dim) / 2;
  const Tensor* f = options.long_inv_freq;
  if (f != nullptr && (f->dtype != DType::kF32 || f->ndim != 1 || f->dim(0) != half || f->data == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": long_inv_freq must be F32 [rotary_dim / 2] = [", half,
                                                   "] with data; got ", DTypeName(f->dtype), " ", f->ShapeString(),
                                                   f->data == nullptr ? " without data" : ""));
    }
  return absl::OkStatus();
}

absl::Status CheckMoeRouting(const char* op, const MoeRouting& r, int64_t experts) {
  auto bad = [&](auto&&... why) { return absl::InvalidArgumentError(absl::StrCat(op, ": ", why...)); };
  if (experts < 1 || experts > (int64_t{1} << 24)) return bad("experts E = ", experts, " outside [1, 2^24]");
  if (r.k < 1 || r.k > experts) return bad("k = ", r.k, " outside [1, E = ", experts, "]");
  switch (r.router) {
    case MoeRouter::kSoftmaxTopK:
    case MoeRouter::kTopKSoftmax:
      if (r.selection_bias != nullptr) return bad("selection_bias is for the sigmoid group router only");
      return absl::OkStatus();
    case MoeRouter::kSigmoidGroupTopK:
      break;
    default:
      return bad("unknown router ", static_cast<int>(r.router));
  }
  if (r.n_group < 1 || r.n_group > 64 || experts % r.n_group != 0 || experts / r.n_group < 2) {
    return bad("n_group = ", r.n_group, " must be in [1, 64] and divide E = ", experts,
               " into groups of at least 2 experts");
  }
  if (r.topk_group < 1 || r.topk_group > r.n_group) {
    return bad("topk_group = ", r.topk_group, " outside [1, n_group = ", r.n_group, "]");
  }
  if (r.k > int64_t{r.topk_group} * (experts / r.n_group)) {
    return bad("k = ", r.k, " exceeds the experts of topk_group = ", r.topk_group, " groups of ",
               experts / r.n_group);
  }
  if (!std::isfinite(r.routed_scaling_factor)) return bad("routed_scaling_factor ", r.routed_scaling_factor, " is not finite");
  const Tensor* b = r.selection_bias;
  if (b != nullptr && (b->dtype != DType::kF32 || b->ndim != 1 || b->dim(0) != experts || b->data == nullptr)) {
    return bad("selection_bias must be F32 [E] = [", experts, "] with data; got ", DTypeName(b->dtype), " ",
               b->ShapeString(), b->data == nullptr ? " without data" : "");
  }
  return absl::OkStatus();
}

int64_t CudaDequantBlockRows(int64_t m, int64_t k, DType act, uint64_t limit) {
  if (m <= 0 || k <= 0) return 0;
  const uint64_t row_bytes = static_cast<uint64_t>(k) * DTypeSize(act);
  return static_cast<int64_t>(std::clamp<uint64_t>(limit / row_bytes, 1, static_cast<uint64_t>(m)));
}

uint64_t CudaDequantScratchBytes(int64_t m, int64_t k, DType act, uint64_t limit) {
  if (m <= 0 || k <= 0) return 0;
  const uint64_t rows = static_cast<uint64_t>(CudaDequantBlockRows(m, k, act, limit));
  return std::bit_ceil(std::max<uint64_t>(rows * static_cast<uint64_t>(k) * DTypeSize(act), 64));
}

absl::Status Backend::FillCounterUniform(Tensor* out, const CounterUniformSlice& slice) {
  SHARDSERVE_RETURN_IF_ERROR(CheckCounterUniformSlice("FillCounterUniform", *out, slice));
  if (device_kind() == DeviceKind::kCpu) {
    FillCounterUniformOnHost(out->data, out->dtype, slice);
    return absl::OkStatus();
  }
  std::vector<uint8_t> staging(out->bytes());
  FillCounterUniformOnHost(staging.data(), out->dtype, slice);
  return CopyToDevice(out->data, staging.data(), staging.size());
}

absl::StatusOr<Buffer> Backend::PackMatMulWeight(const Tensor& w, Tensor* packed, WeightQuant quant) {
  *packed = w;
  if (quant != WeightQuant::kNone) {
    return absl::UnimplementedError(absl::StrCat("PackMatMulWeight: the ", Describe(), " backend has no ",
                                                 WeightQuantName(quant), " weights yet; load without quantization"));
  }
  return Buffer();
}

absl::StatusOr<Buffer> Backend::PackQuantizedWeight(WeightQuant quant, const void*, int64_t, int64_t, Tensor*, int64_t) {
  return absl::UnimplementedError(absl::StrCat("PackQuantizedWeight: the ", Describe(), " backend has no ",
                                               WeightQuantName(quant),
                                               " weights yet (quantized checkpoints load on the CPU)"));
}

absl::Status Backend::MatMuls(const Tensor& x, absl::Span<const MatMulProduct> products) {
  for (const MatMulProduct& p : products) {
    if (p.w == nullptr) return absl::InvalidArgumentError("MatMuls: a product's weight is null");
    SHARDSERVE_RETURN_IF_ERROR(MatMul(p.out, x, *p.w, p.bias));
  }
  return absl::OkStatus();
}

absl::Status Backend::AddRmsNorm(Tensor* x, const Tensor& y, Tensor* normed, const Tensor& w, float eps) {
  if (x == nullptr || normed == nullptr) return absl::InvalidArgumentError("AddRmsNorm: x and normed must not be null");
  SHARDSERVE_RETURN_IF_ERROR(Add(x, *x, y));
  return RmsNorm(normed, *x, w, eps);
}

absl::Status Backend::RopeCacheWrite(Tensor* q, Tensor* k, const Tensor& v, const Tensor& positions,
                                     const Tensor& inv_freq, int head_dim, const RopeOptions& options,
                                     Tensor* k_cache, Tensor* v_cache, const Tensor& slots) {
  if (k == nullptr) return absl::InvalidArgumentError("RopeCacheWrite: k must not be null");
  SHARDSERVE_RETURN_IF_ERROR(Rope(q, k, positions, inv_freq, head_dim, options));
  return CacheWrite(k_cache, v_cache, *k, v, slots);
}

absl::Status Backend::GateUpSilu(Tensor* gate, Tensor* up, const Tensor& x, const Tensor& gate_w, const Tensor& up_w) {
  if (gate == nullptr || up == nullptr) return absl::InvalidArgumentError("GateUpSilu: gate and up must not be null");
  const MatMulProduct products[] = {{gate, &gate_w, nullptr}, {up, &up_w, nullptr}};
  SHARDSERVE_RETURN_IF_ERROR(MatMuls(x, products));
  return SiluMul(gate, *gate, *up);
}

absl::Status Backend::MoeRoute(Tensor*, Tensor*, const Tensor&, const MoeRouting&) {
  return absl::UnimplementedError(absl::StrCat("MoeRoute: the ", Describe(), " backend has no MoE routing"));
}
absl::Status Backend::MoeGroupByExpert(Tensor*, Tensor*, Tensor*, Tensor*, const Tensor&) {
  return absl::UnimplementedError(absl::StrCat("MoeGroupByExpert: the ", Describe(), " backend has no MoE grouping"));
}
absl::Status Backend::MoeCountRows(Tensor*, const Tensor&, int64_t, int64_t) {
  return absl::UnimplementedError(absl::StrCat("MoeCountRows: the ", Describe(), " backend has no MoE row counts"));
}
absl::Status Backend::MoeCombine(Tensor*, const Tensor&, const Tensor&, const Tensor&) {
  return absl::UnimplementedError(absl::StrCat("MoeCombine: the ", Describe(), " backend has no MoE combine"));
}
absl::Status Backend::SigmoidGateMul(Tensor*, const Tensor&, const Tensor&) {
  return absl::UnimplementedError(absl::StrCat("SigmoidGateMul: the ", Describe(), " backend has no sigmoid gate"));
}

absl::Status CheckMoeExperts(const char* op, const Tensor* out, const Tensor* gate, const Tensor* up, const Tensor& x,
                             const Tensor& offsets, const MoeExpertWeights& w) {
  const auto error = [op](const std::string& what) { return absl::InvalidArgumentError(absl::StrCat(op, ": ", what)); };
  if (out == nullptr || gate == nullptr || up == nullptr) return error("out, gate and up must not be null");
  if (offsets.dtype != DType::kI32 || offsets.ndim != 1 || offsets.dim(0) < 2) {
    return error("want offsets [E + 1] I32 with E >= 1");
  }
  const int64_t E = offsets.dim(0) - 1;
  if (w.begin < 0 || w.begin > w.end || w.end > E) {
    return error(absl::StrCat("experts [", w.begin, ", ", w.end, ") are not within [0, E = ", E, ")"));
  }
  for (absl::Span<const Tensor> t : {w.gate_proj, w.up_proj, w.down_proj}) {
    if (static_cast<int64_t>(t.size()) < w.end) {
      return error(absl::StrCat("want a gate_proj, up_proj and down_proj for each of experts [", w.begin, ", ", w.end,
                                ")"));
    }
  }
  if (x.ndim != 2 || out->ndim != 2 || gate->ndim != 2 || up->ndim != 2 || gate->shape != up->shape ||
      out->dim(0) != x.dim(0) || gate->dim(0) != x.dim(0)) {
    return error("want x [rows, h], out [rows, d], gate and up [rows, f]");
  }
  if (!(w.swiglu_limit >= 0.0f) || !std::isfinite(w.swiglu_limit)) return error("swiglu_limit must be finite, >= 0");
  return absl::OkStatus();
}

absl::Status Backend::MoeExperts(Tensor* out, Tensor* gate, Tensor* up, const Tensor& x, const Tensor& offsets,
                                 const MoeExpertWeights& w) {
  SHARDSERVE_RETURN_IF_ERROR(CheckMoeExperts("MoeExperts", out, gate, up, x, offsets, w));
  std::vector<int32_t> off(static_cast<size_t>(offsets.dim(0)));
  SHARDSERVE_RETURN_IF_ERROR(CopyToHost(off.data(), offsets.data, offsets.bytes()));
  const auto bias = [](absl::Span<const Tensor> b, int64_t e) -> const Tensor* {
    return e < static_cast<int64_t>(b.size()) && b[e].data != nullptr ? &b[e] : nullptr;
  };
  for (int64_t e = w.begin; e < w.end; ++e) {
    const int64_t begin = off[e], end = off[e + 1];
    if (begin < 0 || begin > end || end > x.dim(0)) {
      return absl::InvalidArgumentError(absl::StrCat("MoeExperts: expert ", e, "'s rows [", begin, ", ", end,
                                                     ") are not within x's ", x.dim(0), " rows"));
    }
    if (begin == end) continue;
    Tensor xe = x.Rows(begin, end), g = gate->Rows(begin, end), u = up->Rows(begin, end), o = out->Rows(begin, end);
    if (w.swiglu_limit > 0.0f) {
      // gate, up = gate_up_proj(x) + its bias; (clamp(up) + 1) * glu(min(gate, limit)) into gate
      const MatMulProduct gate_up[] = {{&g, &w.gate_proj[e], bias(w.gate_bias, e)},
                                       {&u, &w.up_proj[e], bias(w.up_bias, e)}};
      SHARDSERVE_RETURN_IF_ERROR(MatMuls(xe, gate_up));
      SHARDSERVE_RETURN_IF_ERROR(ClampedSwiGlu(&g, g, u, w.swiglu_alpha, w.swiglu_limit));
    } else {
      SHARDSERVE_RETURN_IF_ERROR(GateUpSilu(&g, &u, xe, w.gate_proj[e], w.up_proj[e]));
    }
    SHARDSERVE_RETURN_IF_ERROR(MatMul(&o, g, w.down_proj[e], bias(w.down_bias, e)));
  }
  return absl::OkStatus();
}

absl::Status Backend::BeginGraph() {
  return absl::UnimplementedError(absl::StrCat("BeginGraph: the ", Describe(), " backend does not record step graphs"));
}
absl::StatusOr<int> Backend::EndGraph() {
  return absl::UnimplementedError(absl::StrCat("EndGraph: the ", Describe(), " backend does not record step graphs"));
}
absl::Status Backend::RunGraph(int) {
  return absl::UnimplementedError(absl::StrCat("RunGraph: the ", Describe(), " backend does not record step graphs"));
}

absl::Status Backend::MlaAttention(Tensor*, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                   const Tensor&, Tensor*, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                   float, const MlaShape&) {
  return absl::UnimplementedError(absl::StrCat("multi-head latent attention (DeepSeek-V3) is not implemented on ",
                                               Describe(), "; it runs on the CPU backend"));
}

absl::Status Backend::ClampedSwiGlu(Tensor*, const Tensor&, const Tensor&, float, float) {
  return absl::UnimplementedError(absl::StrCat(Describe(), ": ClampedSwiGlu (gpt-oss's experts) is not implemented"));
}

}  // namespace shardserve
