#include "model/gptq.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/tensor.h"
#include "model/weight_source.h"
#include "nlohmann/json.hpp"

namespace shardserve {
namespace {

using json = nlohmann::json;

absl::Status FieldError(const std::string& source, const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": quantization_config field \"", field, "\" ", what));
}

std::string ShapeText(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) absl::StrAppend(&out, i ? ", " : "", s[i]);
  return out + "]";
}

}  // namespace

bool GptqMapsToInt4(const GptqConfig& c) { return c.bits == 4 && c.group_size == kInt4GroupSize && !c.desc_act; }

absl::StatusOr<GptqConfig> ParseGptqConfig(const std::string& text, const std::string& source) {
  json q = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (q.is_discarded() || !q.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": field \"quantization_config\" must be an object"));
  }
  auto method = q.find("quant_method");
  if (method == q.end() || !method->is_string()) return FieldError(source, "quant_method", "is missing or not a string");
  if (*method != "gptq") {
    return absl::UnimplementedError(absl::StrCat(source, ": quantization_config field \"quant_method\" is ",
                                                 method->dump(), "; only \"gptq\" checkpoints load (or none)"));
  }
  GptqConfig c;
  auto bits = q.find("bits");
  if (bits == q.end() || !bits->is_number_integer()) return FieldError(source, "bits", "is missing or not an integer");
  if (*bits != 4 && *bits != 8) {
    return absl::UnimplementedError(
        absl::StrCat(source, ": quantization_config field \"bits\" is ", bits->dump(), "; GPTQ loads 4 or 8 bits"));
  }
  c.bits = bits->get<int>();
  auto group = q.find("group_size");
  if (group == q.end() || !group->is_number_integer()) {
    return FieldError(source, "group_size", "is missing or not an integer");
  }
  c.group_size = group->get<int64_t>();
  if (c.group_size == 0 || c.group_size < -1 || c.group_size > (int64_t{1} << 20)) {
    return FieldError(source, "group_size", absl::StrCat("must be -1 or in [1, 2^20], got ", c.group_size));
  }
  for (auto [field, out] : {std::pair{"sym", &c.sym}, {"desc_act", &c.desc_act}}) {
    auto it = q.find(field);
    if (it == q.end() || it->is_null()) continue;
    if (!it->is_boolean()) return FieldError(source, field, absl::StrCat("must be true or false, got ", it->dump()));
    *out = it->get<bool>();
  }
  auto format = q.find("checkpoint_format");
  if (format != q.end() && !format->is_null()) {
    if (*format == "gptq_v2") {
      c.v2 = true;
    } else if (*format != "gptq") {
      return FieldError(source, "checkpoint_format", absl::StrCat("is ", format->dump(), "; \"gptq\" or \"gptq_v2\""));
    }
  }
  return c;
}

absl::Status CheckGptqLinear(const WeightSource& ckpt, const GptqConfig& c, const std::string& prefix, int64_t out,
                             int64_t in) {
  const int64_t p = c.values_per_int32();
  if (in % p != 0 || out % p != 0) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, ": a [", out, ", ", in, "] GPTQ weight of ", c.bits,
                                                   " bits needs both sizes to divide by ", p, " (values per int32)"));
  }
  const int64_t g = c.groups(in);
  for (const auto& [suffix, shape] : {std::pair<const char*, std::vector<int64_t>>{".qweight", {in / p, out}},
                                      {".qzeros", {g, out / p}},
                                      {".scales", {g, out}},
                                      {".g_idx", {in}}}) {
    absl::Status s = ckpt.CheckShape(prefix + suffix, shape);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat(s.message(), " (GPTQ ", c.bits, " bits, group_size ", c.group_size,
                                                 ": ", prefix, suffix, " should be ", ShapeText(shape), ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<GptqLinearSlice> ReadGptqLinear(const WeightSource& ckpt, const GptqConfig& c,
                                               const std::string& prefix, int64_t out, int64_t in,
                                               const Slice& slice) {
  SHARDSERVE_RETURN_IF_ERROR(CheckGptqLinear(ckpt, c, prefix, out, in));
  const int64_t p = c.values_per_int32(), G = c.groups(in);
  const uint32_t mask = (1u << c.bits) - 1;
  if (slice.dim != 0 && slice.dim != 1) return absl::InvalidArgumentError(absl::StrCat(prefix, ": bad slice dim"));
  const int64_t extent = slice.dim == 0 ? out : in;
  const int64_t begin = slice.begin, end = slice.end < 0 ? extent : slice.end;
  if (begin < 0 || begin > end || end > extent || begin % p != 0 || end % p != 0) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, ": this rank's ", slice.dim == 0 ? "outputs" : "inputs", " [",
                                                   begin, ", ", end, ") of ", extent,
                                                   " must be whole int32s of the GPTQ packing (multiples of ", p, ")"));
  }
  const int64_t o0 = slice.dim == 0 ? begin : 0, o1 = slice.dim == 0 ? end : out;
  const int64_t i0 = slice.dim == 1 ? begin : 0, i1 = slice.dim == 1 ? end : in;
  const int64_t m = o1 - o0, k = i1 - i0;

  // g_idx whole (small), then its values.
  std::vector<int32_t> g_idx(in);
  SHARDSERVE_RETURN_IF_ERROR(ckpt.Read(prefix + ".g_idx", {in}, Slice{0, 0, -1}, DType::kI32, g_idx.data()));
  bool trivial128 = c.bits == 4 && c.group_size == kInt4GroupSize;
  for (int64_t i = 0; i < in; ++i) {
    if (g_idx[i] < 0 || g_idx[i] >= G) {
      return absl::InvalidArgumentError(absl::StrCat(prefix, ".g_idx[", i, "] is ", g_idx[i], ", outside the ", G,
                                                     " groups [0, ", G, ") of group_size ", c.group_size));
    }
    if (c.group_size > 0 && !c.desc_act && g_idx[i] != i / c.group_size) {
      return absl::InvalidArgumentError(absl::StrCat(prefix, ".g_idx[", i, "] is ", g_idx[i], " but desc_act is false, so input ", i,
                                                     " belongs to group ", i / c.group_size, " (group_size ", c.group_size, ")"));
    }
    if (trivial128 && g_idx[i] != i / kInt4GroupSize) trivial128 = false;
  }
  // The mapped path needs this rank's inputs to start on a group (CheckGptqShard makes it so).
  const bool mapped = trivial128 && i0 % kInt4GroupSize == 0;

  // Scales and zeros: this rank's outputs, every group.
  std::vector<float> scales(G * m);
  SHARDSERVE_RETURN_IF_ERROR(ckpt.Read(prefix + ".scales", {G, out}, Slice{1, o0, o1}, DType::kF32, scales.data()));
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t r = 0; r < m; ++r) {
      const float s = scales[g * m + r];
      if (!std::isfinite(s) || s == 0) {
        return absl::InvalidArgumentError(absl::StrCat(prefix, ".scales[", g, "][", o0 + r, "] is ", s,
                                                       "; GPTQ scales must be finite and nonzero"));
      }
    }
  }
  std::vector<int32_t> qzeros(G * (m / p));
  SHARDSERVE_RETURN_IF_ERROR(
      ckpt.Read(prefix + ".qzeros", {G, out / p}, Slice{1, o0 / p, o1 / p}, DType::kI32, qzeros.data()));
  std::vector<int32_t> zeros(G * m);  // [g][local out]
  const int32_t sym_zero = 1 << (c.bits - 1);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t r = 0; r < m; ++r) {
      const uint32_t word = static_cast<uint32_t>(qzeros[g * (m / p) + r / p]);
      const int32_t stored = static_cast<int32_t>((word >> (c.bits * (r % p))) & mask);
      const int32_t z = c.v2 ? stored : stored + 1;
      if (c.sym && z != sym_zero) {
        return absl::InvalidArgumentError(absl::StrCat(
            prefix, ".qzeros: group ", g, ", output ", o0 + r, " has zero point ", z, " (stored ", stored, ", format ",
            c.v2 ? "gptq_v2" : "gptq v1, stored + 1", ") but quantization_config field \"sym\" is true, which means ",
            sym_zero));
      }
      zeros[g * m + r] = z;
    }
  }

  // qweight: this rank's rows (inputs / p) and columns (outputs).
  std::vector<int32_t> qweight((k / p) * m);
  const Slice qweight_slice = slice.dim == 1 ? Slice{0, i0 / p, i1 / p} : Slice{1, o0, o1};
  SHARDSERVE_RETURN_IF_ERROR(ckpt.Read(prefix + ".qweight", {in / p, out}, qweight_slice, DType::kI32, qweight.data()));
  auto value = [&](int64_t li, int64_t r) -> int32_t {  // local input li, local output r
    const uint32_t word = static_cast<uint32_t>(qweight[(li / p) * m + r]);
    return static_cast<int32_t>((word >> (c.bits * (li % p))) & mask);
  };

  GptqLinearSlice result;
  result.m = m;
  result.k = k;
  result.mapped = mapped;
  if (mapped) {
    const Int4GroupsLayout layout{m, k};
    const int64_t gpr = layout.groups_per_row();
    result.blocks.assign(m * gpr, Int4Group128{});
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t lg = 0; lg < gpr; ++lg) {
        const int64_t g = i0 / kInt4GroupSize + lg;
        Int4Group128& b = result.blocks[r * gpr + lg];
        std::memset(&b, 0, sizeof(b));
        b.scale = scales[g * m + r];
        b.zero = static_cast<uint8_t>(zeros[g * m + r]);  // 0..16 (v1 stores up to 15, + 1)
        const int64_t n = std::min<int64_t>(kInt4GroupSize, k - lg * kInt4GroupSize);
        for (int64_t j = 0; j < n; ++j) {
          const auto v = static_cast<uint8_t>(value(lg * kInt4GroupSize + j, r));
          if (j < kInt4GroupSize / 2) {
            b.q[j] |= v;
          } else {
            b.q[j - kInt4GroupSize / 2] |= static_cast<uint8_t>(v << 4);
          }
        }
      }
    }
  } else {
    result.dense.resize(m * k);
    for (int64_t li = 0; li < k; ++li) {
      const int64_t g = g_idx[i0 + li];
      for (int64_t r = 0; r < m; ++r) {
        result.dense[r * k + li] = static_cast<float>(value(li, r) - zeros[g * m + r]) * scales[g * m + r];
      }
    }
  }
  return result;
}

}  // namespace shardserve
