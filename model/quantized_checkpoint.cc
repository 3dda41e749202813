#include "model/quantized_checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <regex>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/json.h"
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

absl::Status Unsupported(const std::string& source, const std::string& field, const json& value,
                         const std::string& what) {
  return absl::UnimplementedError(
      absl::StrCat(source, ": quantization_config field \"", field, "\" is ", value.dump(), "; ", what));
}

std::string ShapeText(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) absl::StrAppend(&out, i ? ", " : "", s[i]);
  return out + "]";
}

// An optional boolean field (absent or null: *out unchanged).
absl::Status GetBool(const json& q, const std::string& source, const std::string& field, bool* out) {
  auto it = q.find(field);
  if (it == q.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_boolean()) return FieldError(source, field, absl::StrCat("must be true or false, got ", it->dump()));
  *out = it->get<bool>();
  return absl::OkStatus();
}

// A required integer field.
absl::Status GetInt(const json& q, const std::string& source, const std::string& field, int64_t* out) {
  auto it = q.find(field);
  if (it == q.end() || !it->is_number_integer()) return FieldError(source, field, "is missing or not an integer");
  *out = it->get<int64_t>();
  return absl::OkStatus();
}

absl::Status CheckGroupSize(const std::string& source, const std::string& field, int64_t g) {
  if (g == 0 || g < -1 || g > (int64_t{1} << 20)) {
    return FieldError(source, field, absl::StrCat("must be -1 or in [1, 2^20], got ", g));
  }
  return absl::OkStatus();
}

// A list of module names (or "re:" patterns) stored plain; absent or null: none.
absl::Status GetModuleList(const json& q, const std::string& source, const std::string& field,
                           std::vector<std::string>* out) {
  auto it = q.find(field);
  if (it == q.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_array()) return FieldError(source, field, absl::StrCat("must be a list of module names, got ", it->dump()));
  for (const json& m : *it) {
    if (!m.is_string()) return FieldError(source, field, absl::StrCat("holds ", m.dump(), ", not a module name"));
    std::string name = m.get<std::string>();
    if (absl::StartsWith(name, "re:")) {
      try {
        std::regex check(name.substr(3));
      } catch (const std::regex_error&) {
        return FieldError(source, field, absl::StrCat("holds ", m.dump(), ", not a valid regular expression"));
      }
    }
    out->push_back(std::move(name));
  }
  return absl::OkStatus();
}

absl::StatusOr<CheckpointQuant> ParseGptq(const json& q, const std::string& source) {
  CheckpointQuant c;
  c.method = QuantMethod::kGptq;
  auto bits = q.find("bits");
  if (bits == q.end() || !bits->is_number_integer()) return FieldError(source, "bits", "is missing or not an integer");
  if (*bits != 4 && *bits != 8) return Unsupported(source, "bits", *bits, "GPTQ loads 4 or 8 bits");
  c.bits = bits->get<int>();
  SHARDSERVE_RETURN_IF_ERROR(GetInt(q, source, "group_size", &c.group_size));
  SHARDSERVE_RETURN_IF_ERROR(CheckGroupSize(source, "group_size", c.group_size));
  SHARDSERVE_RETURN_IF_ERROR(GetBool(q, source, "sym", &c.sym));
  SHARDSERVE_RETURN_IF_ERROR(GetBool(q, source, "desc_act", &c.desc_act));
  // GPTQModel's per-module overrides: "-:<regex>" keeps the modules it matches (from the start of
  // the name) unquantized; any other key overrides bits / group_size for its modules, which this
  // loader does not read.
  if (auto dynamic = q.find("dynamic"); dynamic != q.end() && !dynamic->is_null()) {
    if (!dynamic->is_object()) return FieldError(source, "dynamic", absl::StrCat("must be an object, got ", dynamic->dump()));
    for (const auto& [key, value] : dynamic->items()) {
      if (!absl::StartsWith(key, "-:")) {
        return Unsupported(source, "dynamic", json::object({{key, value}}),
                           "per-module overrides are not read (only \"-:\" patterns, modules left unquantized)");
      }
      c.ignore.push_back("re:" + key.substr(2));
      try {
        std::regex check(key.substr(2));
      } catch (const std::regex_error&) {
        return FieldError(source, "dynamic", absl::StrCat("holds \"", key, "\", not a valid regular expression"));
      }
    }
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

absl::StatusOr<CheckpointQuant> ParseAwq(const json& q, const std::string& source) {
  CheckpointQuant c;
  c.method = QuantMethod::kAwq;
  c.sym = false;
  auto version = q.find("version");
  if (version != q.end() && !version->is_null() && !(version->is_string() && absl::EqualsIgnoreCase(version->get<std::string>(), "gemm"))) {
    return Unsupported(source, "version", *version, "AWQ loads the \"gemm\" packing only");
  }
  int64_t bits = 0;
  SHARDSERVE_RETURN_IF_ERROR(GetInt(q, source, "bits", &bits));
  if (bits != 4) return Unsupported(source, "bits", bits, "AWQ (gemm) loads 4 bits");
  SHARDSERVE_RETURN_IF_ERROR(GetInt(q, source, "group_size", &c.group_size));
  SHARDSERVE_RETURN_IF_ERROR(CheckGroupSize(source, "group_size", c.group_size));
  bool zero_point = true;
  SHARDSERVE_RETURN_IF_ERROR(GetBool(q, source, "zero_point", &zero_point));
  if (!zero_point) return Unsupported(source, "zero_point", false, "AWQ (gemm) checkpoints store zero points");
  SHARDSERVE_RETURN_IF_ERROR(GetModuleList(q, source, "modules_to_not_convert", &c.ignore));
  return c;
}

absl::StatusOr<CheckpointQuant> ParseCompressedTensors(const json& q, const std::string& source) {
  CheckpointQuant c;
  c.method = QuantMethod::kCompressedTensors;
  auto groups = q.find("config_groups");
  if (groups == q.end() || !groups->is_object() || groups->size() != 1) {
    return absl::UnimplementedError(
        absl::StrCat(source, ": quantization_config field \"config_groups\" must hold exactly one group, got ",
                     groups == q.end() ? "none" : groups->dump()));
  }
  const std::string gname = groups->begin().key();
  const json& g = groups->begin().value();
  const std::string gfield = "config_groups." + gname;
  if (!g.is_object()) return FieldError(source, gfield, "must be an object");
  auto targets = g.find("targets");
  if (targets == g.end() || *targets != json::array({"Linear"})) {
    return Unsupported(source, gfield + ".targets", targets == g.end() ? json() : *targets,
                       "only [\"Linear\"] loads (with \"ignore\" for the exceptions)");
  }
  for (const char* off : {"output_activations"}) {
    if (auto it = g.find(off); it != g.end() && !it->is_null()) {
      return Unsupported(source, gfield + "." + off, *it, "not supported");
    }
  }
  auto sparsity = q.find("sparsity_config");
  if (sparsity != q.end() && !sparsity->is_null() && !sparsity->empty() &&
      sparsity->value("format", std::string("dense")) != "dense") {
    return Unsupported(source, "sparsity_config", *sparsity, "sparse checkpoints do not load");
  }
  std::string format;
  for (const json* where : {&g, &q}) {  // a group's own format wins over the top-level one
    if (auto it = where->find("format"); format.empty() && it != where->end() && it->is_string()) format = *it;
  }
  auto w = g.find("weights");
  if (w == g.end() || !w->is_object()) return FieldError(source, gfield + ".weights", "is missing or not an object");
  const std::string wf = gfield + ".weights";
  auto nb = w->find("num_bits");
  if (nb == w->end() || !nb->is_number_integer()) return FieldError(source, wf + ".num_bits", "is missing or not an integer");
  const int64_t bits = nb->get<int64_t>();
  const std::string type = w->value("type", std::string());
  const std::string strategy = w->value("strategy", std::string());
  if (auto it = w->find("symmetric"); it != w->end() && !it->is_null()) {
    if (!it->is_boolean()) return FieldError(source, wf + ".symmetric", absl::StrCat("must be true or false, got ", it->dump()));
    c.sym = it->get<bool>();
  }
  for (const char* off : {"actorder", "block_structure"}) {
    if (auto it = w->find(off); it != w->end() && !it->is_null() && *it != false) {
      return Unsupported(source, wf + "." + off, *it, "not supported");
    }
  }
  if (auto it = w->find("dynamic"); it != w->end() && *it != false) {
    return Unsupported(source, wf + ".dynamic", *it, "weights must be quantized statically");
  }
  if (format == "pack-quantized") {
    if (type != "int") return Unsupported(source, wf + ".type", w->value("type", json()), "pack-quantized is \"int\"");
    if (bits != 4 && bits != 8) return Unsupported(source, wf + ".num_bits", bits, "pack-quantized loads 4 or 8 bits");
    c.bits = static_cast<int>(bits);
    if (strategy == "group") {
      auto gs = w->find("group_size");
      if (gs == w->end() || !gs->is_number_integer() || *gs <= 0) {
        return FieldError(source, wf + ".group_size", "must be a positive integer for strategy \"group\"");
      }
      c.group_size = gs->get<int64_t>();
      SHARDSERVE_RETURN_IF_ERROR(CheckGroupSize(source, wf + ".group_size", c.group_size));
    } else if (strategy == "channel") {
      c.group_size = -1;
    } else {
      return Unsupported(source, wf + ".strategy", w->value("strategy", json()),
                         "pack-quantized loads \"group\" or \"channel\"");
    }
  } else if (format == "float-quantized") {
    if (type != "float" || bits != 8) {
      return Unsupported(source, wf + ".type", w->value("type", json()),
                         "float-quantized loads type \"float\", num_bits 8 (e4m3)");
    }
    if (!c.sym) return Unsupported(source, wf + ".symmetric", false, "fp8 weights are symmetric");
    if (strategy != "channel" && strategy != "tensor") {
      return Unsupported(source, wf + ".strategy", w->value("strategy", json()),
                         "float-quantized loads \"channel\" or \"tensor\"");
    }
    c.bits = 8;
    c.fp8 = true;
    c.group_size = -1;
    c.per_tensor = strategy == "tensor";
  } else {
    return Unsupported(source, "format", format.empty() ? json() : json(format),
                       "compressed-tensors loads \"pack-quantized\" and \"float-quantized\"");
  }
  SHARDSERVE_RETURN_IF_ERROR(GetModuleList(q, source, "ignore", &c.ignore));
  return c;
}

absl::StatusOr<CheckpointQuant> ParseFp8(const json& q, const std::string& source) {
  CheckpointQuant c;
  c.method = QuantMethod::kFp8;
  c.bits = 8;
  c.fp8 = true;
  c.group_size = -1;
  auto block = q.find("weight_block_size");
  if (block == q.end() || !block->is_array() || block->size() != 2 || !(*block)[0].is_number_integer() ||
      !(*block)[1].is_number_integer() || (*block)[0] <= 0 || (*block)[1] <= 0 || (*block)[0] > (1 << 20) ||
      (*block)[1] > (1 << 20)) {
    return FieldError(source, "weight_block_size",
                      absl::StrCat("must be two positive integers [out, in] (e.g. [128, 128]), got ",
                                   block == q.end() ? "none" : block->dump()));
  }
  c.block_out = (*block)[0].get<int64_t>();
  c.block_in = (*block)[1].get<int64_t>();
  if (auto a = q.find("activation_scheme"); a != q.end() && !a->is_null() && *a != "dynamic") {
    return Unsupported(source, "activation_scheme", *a, "FP8 checkpoints load with \"dynamic\"");
  }
  SHARDSERVE_RETURN_IF_ERROR(GetModuleList(q, source, "modules_to_not_convert", &c.ignore));
  return c;
}

const char* MethodName(QuantMethod m) {
  switch (m) {
    case QuantMethod::kGptq: return "GPTQ";
    case QuantMethod::kAwq: return "AWQ";
    case QuantMethod::kCompressedTensors: return "compressed-tensors";
    case QuantMethod::kFp8: return "FP8";
  }
  return "?";
}

// Checks `name` against `shape`, adding the format's reading of it to the error.
absl::Status CheckTensor(const WeightSource& ckpt, const CheckpointQuant& c, const std::string& name,
                         const std::vector<int64_t>& shape) {
  absl::Status s = ckpt.CheckShape(name, shape);
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(s.message(), " (", c.Describe(), ": ", name, " should be ",
                                             ShapeText(shape), ")"));
}

// The tensors of a [out, in] weight `prefix` and their shapes.
std::vector<std::pair<std::string, std::vector<int64_t>>> ExpectedTensors(const CheckpointQuant& c,
                                                                         const std::string& prefix, int64_t out,
                                                                         int64_t in) {
  const int64_t p = c.values_per_int32(), G = c.groups(in);
  switch (c.method) {
    case QuantMethod::kGptq:
      return {{prefix + ".qweight", {in / p, out}},
              {prefix + ".qzeros", {G, out / p}},
              {prefix + ".scales", {G, out}},
              {prefix + ".g_idx", {in}}};
    case QuantMethod::kAwq:
      return {{prefix + ".qweight", {in, out / p}}, {prefix + ".qzeros", {G, out / p}}, {prefix + ".scales", {G, out}}};
    case QuantMethod::kCompressedTensors:
      if (c.fp8) return {{prefix + ".weight", {out, in}}, {prefix + ".weight_scale", c.per_tensor ? std::vector<int64_t>{1} : std::vector<int64_t>{out, 1}}};
      if (c.sym) {
        return {{prefix + ".weight_packed", {out, in / p}}, {prefix + ".weight_scale", {out, G}}, {prefix + ".weight_shape", {2}}};
      }
      return {{prefix + ".weight_packed", {out, in / p}},
              {prefix + ".weight_scale", {out, G}},
              {prefix + ".weight_zero_point", {out / p, G}},
              {prefix + ".weight_shape", {2}}};
    case QuantMethod::kFp8:
      return {{prefix + ".weight", {out, in}},
              {prefix + ".weight_scale_inv",
               {(out + c.block_out - 1) / c.block_out, (in + c.block_in - 1) / c.block_in}}};
  }
  return {};
}

// Scales must be finite and nonzero: `at(i)` names element i of `values` in the tensor's own
// index order.
template <typename At>
absl::Status CheckScales(const std::string& name, const std::vector<float>& values, At at) {
  for (size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i]) || values[i] == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, at(i), " is ", values[i], "; quantization scales must be finite and nonzero"));
    }
  }
  return absl::OkStatus();
}

// This rank's slice of an integer-quantized weight, before it is repacked or dequantized.
struct IntWeight {
  int bits = 4;
  int64_t group_size = 0;
  int64_t m = 0, k = 0, i0 = 0, G = 0;
  std::vector<uint8_t> q;      // [m][k]: unsigned stored values
  std::vector<int32_t> zero;   // [G][m]: what q is measured from
  std::vector<float> scale;    // [G][m]
  std::vector<int32_t> group;  // [k]: each local input's group
};

// Sets result->rows to a kernels/quant.h one-byte-rows layout (Int8RowsLayout / Fp8RowsLayout,
// the same bytes): the scales [m] (as float32 bytes), then room for the codes [m, k].
void StartRows(QuantizedLinearSlice* result, WeightQuant kernel, const float* scale) {
  result->kernel = kernel;
  const int64_t scale_bytes = Int8RowsLayout{result->m, result->k}.scale_bytes();
  result->rows.resize(static_cast<size_t>(Int8RowsLayout{result->m, result->k}.bytes()));
  std::memcpy(result->rows.data(), scale, static_cast<size_t>(scale_bytes));
}

QuantizedLinearSlice Finish(const IntWeight& w, bool map) {
  QuantizedLinearSlice result;
  result.m = w.m;
  result.k = w.k;
  // The int4 blocks hold 4-bit values in groups of 128 that start where this rank's inputs do.
  bool contiguous128 = map && w.bits == 4 && w.group_size == kInt4GroupSize && w.i0 % kInt4GroupSize == 0;
  for (int64_t li = 0; li < w.k && contiguous128; ++li) contiguous128 = w.group[li] == (w.i0 + li) / kInt4GroupSize;
  if (contiguous128) {
    result.kernel = WeightQuant::kInt4;
    const Int4GroupsLayout layout{w.m, w.k};
    const int64_t gpr = layout.groups_per_row();
    result.blocks.assign(w.m * gpr, Int4Group128{});
    for (int64_t r = 0; r < w.m; ++r) {
      for (int64_t lg = 0; lg < gpr; ++lg) {
        const int64_t g = w.group[lg * kInt4GroupSize];
        Int4Group128& b = result.blocks[r * gpr + lg];
        std::memset(&b, 0, sizeof(b));
        b.scale = w.scale[g * w.m + r];
        b.zero = static_cast<uint8_t>(w.zero[g * w.m + r]);  // 0..16 (GPTQ v1 stores up to 15, + 1)
        const int64_t n = std::min<int64_t>(kInt4GroupSize, w.k - lg * kInt4GroupSize);
        const uint8_t* q = &w.q[r * w.k + lg * kInt4GroupSize];
        for (int64_t j = 0; j < n; ++j) {
          if (j < kInt4GroupSize / 2) {
            b.q[j] |= q[j];
          } else {
            b.q[j - kInt4GroupSize / 2] |= static_cast<uint8_t>(q[j] << 4);
          }
        }
      }
    }
    return result;
  }
  // The int8 rows hold one symmetric scale per output: every local input in one group, every zero
  // point 128, so that w = scale x (q - 128) with q - 128 an int8 (-128 included).
  bool one_group = map && w.bits == 8 && w.k > 0;
  for (int64_t li = 1; li < w.k && one_group; ++li) one_group = w.group[li] == w.group[0];
  bool zero128 = one_group;
  for (int64_t r = 0; r < w.m && zero128; ++r) zero128 = w.zero[w.group[0] * w.m + r] == 128;
  if (zero128) {
    StartRows(&result, WeightQuant::kInt8, &w.scale[w.group[0] * w.m]);
    uint8_t* codes = result.rows.data() + Int8RowsLayout{w.m, w.k}.scale_bytes();
    for (int64_t i = 0; i < w.m * w.k; ++i) codes[i] = static_cast<uint8_t>(w.q[i] ^ 0x80);  // q - 128, two's complement
    return result;
  }
  const std::string groups =
      w.group_size > 0 ? absl::StrCat("groups of ", w.group_size) : std::string("one group per output channel");
  if (!map) {
    result.why_dense = "asked for";
  } else if (w.bits == 8) {
    result.why_dense = !one_group ? absl::StrCat("8 bits in ", groups,
                                                 " along the input: the int8 kernel has one scale per output channel")
                                  : "8 bits with zero points other than 128: the int8 kernel is symmetric";
  } else {
    result.why_dense = w.group_size != kInt4GroupSize
                           ? absl::StrCat("4 bits in ", groups, ": the int4 kernel's groups are 128 inputs")
                           : "4 bits in groups that g_idx reorders: the int4 kernel's groups are 128 contiguous inputs";
  }
  result.dense.resize(w.m * w.k);
  for (int64_t r = 0; r < w.m; ++r) {
    for (int64_t li = 0; li < w.k; ++li) {
      const int64_t g = w.group[li];
      result.dense[r * w.k + li] =
          static_cast<float>(static_cast<int32_t>(w.q[r * w.k + li]) - w.zero[g * w.m + r]) * w.scale[g * w.m + r];
    }
  }
  return result;
}

// This rank's ranges of the outputs [o0, o1) and inputs [i0, i1), checked against the packing.
struct Ranges {
  int64_t o0, o1, i0, i1;
  int64_t m() const { return o1 - o0; }
  int64_t k() const { return i1 - i0; }
};

absl::StatusOr<Ranges> SliceRanges(const CheckpointQuant& c, const std::string& prefix, int64_t out, int64_t in,
                                   const Slice& slice) {
  if (slice.dim != 0 && slice.dim != 1) return absl::InvalidArgumentError(absl::StrCat(prefix, ": bad slice dim"));
  const int64_t extent = slice.dim == 0 ? out : in;
  const int64_t multiple = slice.dim == 0 ? c.output_multiple() : c.input_multiple(/*split=*/false);
  const int64_t begin = slice.begin, end = slice.end < 0 ? extent : slice.end;
  if (begin < 0 || begin > end || end > extent || begin % multiple != 0 || (end % multiple != 0 && end != extent)) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, ": this rank's ", slice.dim == 0 ? "outputs" : "inputs", " [",
                                                   begin, ", ", end, ") of ", extent, " must be whole int32s of the ",
                                                   MethodName(c.method), " packing (multiples of ", multiple, ")"));
  }
  if (slice.dim == 0) return Ranges{begin, end, 0, in};
  return Ranges{0, out, begin, end};
}

// Unpacks value j (bits wide, lowest first) of `word`.
inline uint8_t Field(int32_t word, int bits, int64_t j) {
  return static_cast<uint8_t>((static_cast<uint32_t>(word) >> (bits * j)) & ((1u << bits) - 1));
}

// GPTQ and AWQ: scales [G, out] and qzeros [G, out / p] of this rank's outputs, every group, into
// w->scale and w->zero (as stored). Output r's zero in group g is value nibble[r % p] (r % p when
// null) of qzeros[g][r / p].
absl::Status ReadScalesAndZeros(const WeightSource& ckpt, const std::string& prefix, int64_t out, int64_t p,
                                const Ranges& rg, const int* nibble, IntWeight* w) {
  const int64_t G = w->G, m = rg.m();
  w->scale.resize(G * m);
  SHARDSERVE_RETURN_IF_ERROR(
      ckpt.Read(prefix + ".scales", {G, out}, Slice{1, rg.o0, rg.o1}, DType::kF32, w->scale.data()));
  SHARDSERVE_RETURN_IF_ERROR(CheckScales(prefix + ".scales", w->scale, [&](size_t i) {
    return absl::StrCat("[", static_cast<int64_t>(i) / m, "][", rg.o0 + static_cast<int64_t>(i) % m, "]");
  }));
  std::vector<int32_t> qzeros(G * (m / p));
  SHARDSERVE_RETURN_IF_ERROR(
      ckpt.Read(prefix + ".qzeros", {G, out / p}, Slice{1, rg.o0 / p, rg.o1 / p}, DType::kI32, qzeros.data()));
  w->zero.resize(G * m);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t r = 0; r < m; ++r) {
      w->zero[g * m + r] = Field(qzeros[g * (m / p) + r / p], w->bits, nibble ? nibble[r % p] : r % p);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<IntWeight> ReadGptq(const WeightSource& ckpt, const CheckpointQuant& c, const std::string& prefix,
                                   int64_t out, int64_t in, const Ranges& rg) {
  const int64_t p = c.values_per_int32(), G = c.groups(in), m = rg.m(), k = rg.k();
  IntWeight w{c.bits, c.group_size, m, k, rg.i0, G, {}, {}, {}, {}};
  // g_idx whole (small), then its values.
  std::vector<int32_t> g_idx(in);
  SHARDSERVE_RETURN_IF_ERROR(ckpt.Read(prefix + ".g_idx", {in}, Slice{0, 0, -1}, DType::kI32, g_idx.data()));
  for (int64_t i = 0; i < in; ++i) {
    if (g_idx[i] < 0 || g_idx[i] >= G) {
      return absl::InvalidArgumentError(absl::StrCat(prefix, ".g_idx[", i, "] is ", g_idx[i], ", outside the ", G,
                                                     " groups [0, ", G, ") of group_size ", c.group_size));
    }
    if (c.group_size > 0 && !c.desc_act && g_idx[i] != i / c.group_size) {
      return absl::InvalidArgumentError(absl::StrCat(prefix, ".g_idx[", i, "] is ", g_idx[i],
                                                     " but desc_act is false, so input ", i, " belongs to group ",
                                                     i / c.group_size, " (group_size ", c.group_size, ")"));
    }
  }
  w.group.assign(g_idx.begin() + rg.i0, g_idx.begin() + rg.i1);
  SHARDSERVE_RETURN_IF_ERROR(ReadScalesAndZeros(ckpt, prefix, out, p, rg, /*nibble=*/nullptr, &w));
  const int32_t sym_zero = 1 << (c.bits - 1);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t r = 0; r < m; ++r) {
      const int32_t stored = w.zero[g * m + r];
      const int32_t z = c.v2 ? stored : stored + 1;
      if (c.sym && z != sym_zero) {
        return absl::InvalidArgumentError(absl::StrCat(
            prefix, ".qzeros: group ", g, ", output ", rg.o0 + r, " has zero point ", z, " (stored ", stored,
            ", format ", c.v2 ? "gptq_v2" : "gptq v1, stored + 1",
            ") but quantization_config field \"sym\" is true, which means ", sym_zero));
      }
      w.zero[g * m + r] = z;
    }
  }
  // qweight: this rank's rows (inputs / p) and columns (outputs).
  std::vector<int32_t> qweight((k / p) * m);
  const Slice qslice = rg.i0 > 0 || rg.i1 < in ? Slice{0, rg.i0 / p, rg.i1 / p} : Slice{1, rg.o0, rg.o1};
  SHARDSERVE_RETURN_IF_ERROR(ckpt.Read(prefix + ".qweight", {in / p, out}, qslice, DType::kI32, qweight.data()));
  w.q.resize(m * k);
  for (int64_t li = 0; li < k; ++li) {
    for (int64_t r = 0; r < m; ++r) w.q[r * k + li] = Field(qweight[(li / p) * m + r], c.bits, li % p);
  }
  return w;
}

absl::StatusOr<IntWeight> ReadAwq(const WeightSource& ckpt, const CheckpointQuant& c, const std::string& prefix,
                                  int64_t out, int64_t in, const Ranges& rg) {
  const int64_t p = 8, G = c.groups(in), m = rg.m(), k = rg.k();
  IntWeight w{4, c.group_size, m, k, rg.i0, G, {}, {}, {}, {}};
  w.group.resize(k);
  for (int64_t li = 0; li < k; ++li) w.group[li] = c.group_size > 0 ? static_cast<int32_t>((rg.i0 + li) / c.group_size) : 0;
  SHARDSERVE_RETURN_IF_ERROR(ReadScalesAndZeros(ckpt, prefix, out, p, rg, kAwqNibble, &w));
  std::vector<int32_t> qweight(k * (m / p));
  const Slice qslice = rg.i0 > 0 || rg.i1 < in ? Slice{0, rg.i0, rg.i1} : Slice{1, rg.o0 / p, rg.o1 / p};
  SHARDSERVE_RETURN_IF_ERROR(ckpt.Read(prefix + ".qweight", {in, out / p}, qslice, DType::kI32, qweight.data()));
  w.q.resize(m * k);
  for (int64_t li = 0; li < k; ++li) {
    for (int64_t r = 0; r < m; ++r) w.q[r * k + li] = Field(qweight[li * (m / p) + r / p], 4, kAwqNibble[r % p]);
  }
  return w;
}

absl::StatusOr<IntWeight> ReadPackQuantized(const WeightSource& ckpt, const CheckpointQuant& c,
                                            const std::string& prefix, int64_t out, int64_t in, const Ranges& rg) {
  const int64_t p = c.values_per_int32(), G = c.groups(in), m = rg.m(), k = rg.k();
  IntWeight w{c.bits, c.group_size, m, k, rg.i0, G, {}, {}, {}, {}};
  int32_t shape[2];
  SHARDSERVE_RETURN_IF_ERROR(ckpt.Read(prefix + ".weight_shape", {2}, Slice{0, 0, -1}, DType::kI32, shape));
  if (shape[0] != out || shape[1] != in) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, ".weight_shape is [", shape[0], ", ", shape[1],
                                                   "] but config.json implies [", out, ", ", in, "]"));
  }
  w.group.resize(k);
  for (int64_t li = 0; li < k; ++li) w.group[li] = c.group_size > 0 ? static_cast<int32_t>((rg.i0 + li) / c.group_size) : 0;
  std::vector<float> scale(m * G);  // [local out][G], transposed below
  SHARDSERVE_RETURN_IF_ERROR(
      ckpt.Read(prefix + ".weight_scale", {out, G}, Slice{0, rg.o0, rg.o1}, DType::kF32, scale.data()));
  SHARDSERVE_RETURN_IF_ERROR(CheckScales(prefix + ".weight_scale", scale, [&](size_t i) {
    return absl::StrCat("[", rg.o0 + static_cast<int64_t>(i) / G, "][", static_cast<int64_t>(i) % G, "]");
  }));
  w.scale.resize(G * m);
  w.zero.assign(G * m, 1 << (c.bits - 1));  // symmetric: q is stored + 2^(bits - 1), the zero point 0 too
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < G; ++g) w.scale[g * m + r] = scale[r * G + g];
  }
  if (!c.sym) {
    std::vector<int32_t> zp((m / p) * G);
    SHARDSERVE_RETURN_IF_ERROR(ckpt.Read(prefix + ".weight_zero_point", {out / p, G}, Slice{0, rg.o0 / p, rg.o1 / p},
                                         DType::kI32, zp.data()));
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t g = 0; g < G; ++g) w.zero[g * m + r] = Field(zp[(r / p) * G + g], c.bits, r % p);
    }
  }
  std::vector<int32_t> packed(m * (k / p));
  const Slice pslice = rg.i0 > 0 || rg.i1 < in ? Slice{1, rg.i0 / p, rg.i1 / p} : Slice{0, rg.o0, rg.o1};
  SHARDSERVE_RETURN_IF_ERROR(ckpt.Read(prefix + ".weight_packed", {out, in / p}, pslice, DType::kI32, packed.data()));
  w.q.resize(m * k);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t li = 0; li < k; ++li) w.q[r * k + li] = Field(packed[r * (k / p) + li / p], c.bits, li % p);
  }
  return w;
}

// fp8 formats: compressed-tensors' per-channel / per-tensor scales onto the fp8 rows as stored;
// FP8's block scales dequantized to float32.
absl::StatusOr<QuantizedLinearSlice> ReadFp8(const WeightSource& ckpt, const CheckpointQuant& c,
                                             const std::string& prefix, int64_t out, int64_t in, const Ranges& rg,
                                             const Slice& slice, bool map) {
  QuantizedLinearSlice result;
  result.m = rg.m();
  result.k = rg.k();
  const int64_t m = rg.m(), k = rg.k();
  const Slice weight_slice{slice.dim, slice.begin, slice.end};
  if (c.method == QuantMethod::kFp8) {
    const int64_t bo = (out + c.block_out - 1) / c.block_out, bi = (in + c.block_in - 1) / c.block_in;
    std::vector<float> s(bo * bi);
    SHARDSERVE_RETURN_IF_ERROR(
        ckpt.Read(prefix + ".weight_scale_inv", {bo, bi}, Slice{0, 0, -1}, DType::kF32, s.data()));
    SHARDSERVE_RETURN_IF_ERROR(CheckScales(prefix + ".weight_scale_inv", s, [&](size_t i) {
      return absl::StrCat("[", static_cast<int64_t>(i) / bi, "][", static_cast<int64_t>(i) % bi, "]");
    }));
    // The fp8 kernels' input-group scales hold the block scales exactly (each block's scale repeated
    // over its rows), where this rank's inputs start on a block's edge and the blocks are whole
    // vectors of the kernels (or this rank's inputs lie in one block: one scale a row).
    const bool one_block = rg.i0 % c.block_in == 0 && k <= c.block_in;
    const bool groups = rg.i0 % c.block_in == 0 && c.block_in % kFp8GroupMultiple == 0;
    if (map && (one_block || groups)) {
      const int64_t group = one_block ? 0 : c.block_in;
      const Fp8RowsLayout layout{m, k, group};
      const int64_t G = layout.groups_per_row();
      result.kernel = WeightQuant::kFp8;
      result.group = group;
      result.rows.resize(static_cast<size_t>(layout.bytes()));
      std::vector<float> local(static_cast<size_t>(m * G));
      for (int64_t r = 0; r < m; ++r) {
        const float* srow = &s[((rg.o0 + r) / c.block_out) * bi + rg.i0 / c.block_in];
        for (int64_t g = 0; g < G; ++g) local[r * G + g] = srow[g];
      }
      std::memcpy(result.rows.data(), local.data(), static_cast<size_t>(layout.scale_bytes()));
      uint8_t* codes = result.rows.data() + layout.scale_bytes();
      SHARDSERVE_RETURN_IF_ERROR(ckpt.Read(prefix + ".weight", {out, in}, weight_slice, DType::kI8, codes));
      for (int64_t i = 0; i < m * k; ++i) {
        if (Fp8E4m3IsNan(codes[i])) {
          return absl::InvalidArgumentError(absl::StrCat(prefix, ".weight[", rg.o0 + i / k, "][", rg.i0 + i % k,
                                                         "] is NaN (an e4m3 0x7f / 0xff)"));
        }
      }
      return result;
    }
    result.dense.resize(m * k);
    SHARDSERVE_RETURN_IF_ERROR(ckpt.Read(prefix + ".weight", {out, in}, weight_slice, DType::kF32, result.dense.data()));
    for (int64_t i = 0; i < m * k; ++i) {
      if (std::isnan(result.dense[i])) {
        return absl::InvalidArgumentError(absl::StrCat(prefix, ".weight[", rg.o0 + i / k, "][", rg.i0 + i % k,
                                                       "] is NaN (an e4m3 0x7f / 0xff)"));
      }
    }
    for (int64_t r = 0; r < m; ++r) {
      const float* srow = &s[((rg.o0 + r) / c.block_out) * bi];
      for (int64_t li = 0; li < k; ++li) result.dense[r * k + li] *= srow[(rg.i0 + li) / c.block_in];
    }
    if (!map) {
      result.why_dense = "asked for";
    } else if (rg.i0 % c.block_in != 0) {
      result.why_dense = absl::StrCat("e4m3 with ", c.block_out, "x", c.block_in, " block scales: this rank's inputs start at ",
                                      rg.i0, ", inside a block of ", c.block_in, " (the fp8 kernels' scale groups start "
                                      "where a rank's inputs do)");
    } else {
      result.why_dense = absl::StrCat("e4m3 with ", c.block_out, "x", c.block_in, " block scales: the fp8 kernels take "
                                      "scale groups of a multiple of ", kFp8GroupMultiple, " inputs");
    }
    return result;
  }
  // compressed-tensors float-quantized: one scale per output channel, or one for the tensor.
  std::vector<float> s(c.per_tensor ? 1 : m);
  if (c.per_tensor) {
    SHARDSERVE_RETURN_IF_ERROR(ckpt.Read(prefix + ".weight_scale", {1}, Slice{0, 0, -1}, DType::kF32, s.data()));
  } else {
    SHARDSERVE_RETURN_IF_ERROR(
        ckpt.Read(prefix + ".weight_scale", {out, 1}, Slice{0, rg.o0, rg.o1}, DType::kF32, s.data()));
  }
  SHARDSERVE_RETURN_IF_ERROR(CheckScales(prefix + ".weight_scale", s, [&](size_t i) {
    return c.per_tensor ? std::string("[0]") : absl::StrCat("[", rg.o0 + static_cast<int64_t>(i), "][0]");
  }));
  if (c.per_tensor) s.assign(m, s[0]);
  StartRows(&result, WeightQuant::kFp8, s.data());
  uint8_t* codes = result.rows.data() + Fp8RowsLayout{m, k}.scale_bytes();
  SHARDSERVE_RETURN_IF_ERROR(ckpt.Read(prefix + ".weight", {out, in}, weight_slice, DType::kI8, codes));
  for (int64_t i = 0; i < m * k; ++i) {
    if (Fp8E4m3IsNan(codes[i])) {
      return absl::InvalidArgumentError(absl::StrCat(prefix, ".weight[", rg.o0 + i / k, "][", rg.i0 + i % k,
                                                     "] is NaN (an e4m3 0x7f / 0xff)"));
    }
  }
  if (!map) {
    result.dense.resize(m * k);
    for (int64_t i = 0; i < m * k; ++i) result.dense[i] = Fp8E4m3ToFloat(codes[i]) * s[i / k];
    result.rows.clear();
    result.kernel = WeightQuant::kNone;
    result.why_dense = "asked for";
  }
  return result;
}

}  // namespace

int64_t CheckpointQuant::output_multiple() const {
  switch (method) {
    case QuantMethod::kGptq:
    case QuantMethod::kAwq: return values_per_int32();
    case QuantMethod::kCompressedTensors: return fp8 || sym ? 1 : values_per_int32();
    case QuantMethod::kFp8: return 1;
  }
  return 1;
}

int64_t CheckpointQuant::input_multiple(bool split) const {
  int64_t m = 1;
  if (method == QuantMethod::kGptq || (method == QuantMethod::kCompressedTensors && !fp8)) m = values_per_int32();
  const bool contiguous_groups = !fp8 && group_size > 0 && !(method == QuantMethod::kGptq && desc_act);
  if (split && contiguous_groups) m = std::lcm(m, group_size);
  return m;
}

bool CheckpointQuant::Quantizes(const std::string& module) const {
  for (const std::string& entry : ignore) {
    if (absl::StartsWith(entry, "re:")) {
      if (std::regex_search(module, std::regex(entry.substr(3)), std::regex_constants::match_continuous)) return false;
    } else if (entry == module) {
      return false;
    }
  }
  return true;
}

std::string CheckpointQuant::Describe() const {
  switch (method) {
    case QuantMethod::kGptq:
      return absl::StrCat("GPTQ ", bits, "-bit, group_size ", group_size, sym ? ", sym" : ", asym",
                          desc_act ? ", desc_act" : "", v2 ? ", gptq_v2" : ", gptq v1");
    case QuantMethod::kAwq: return absl::StrCat("AWQ 4-bit gemm, group_size ", group_size);
    case QuantMethod::kCompressedTensors:
      if (fp8) return absl::StrCat("compressed-tensors float-quantized fp8 e4m3, per ", per_tensor ? "tensor" : "channel");
      return absl::StrCat("compressed-tensors pack-quantized int", bits, ", ",
                          group_size > 0 ? absl::StrCat("group_size ", group_size) : std::string("per channel"),
                          sym ? ", sym" : ", asym");
    case QuantMethod::kFp8: return absl::StrCat("FP8 e4m3, ", block_out, "x", block_in, " blocks");
  }
  return "?";
}

std::string CheckpointQuant::Name() const {
  if (fp8) return absl::StrCat(MethodName(method), method == QuantMethod::kFp8 ? " e4m3" : " fp8");
  if (method == QuantMethod::kCompressedTensors) return absl::StrCat(MethodName(method), " int", bits);
  return absl::StrCat(MethodName(method), " ", bits, "-bit");
}

WeightQuant CheckpointQuantKernel(const CheckpointQuant& c) {
  if (c.fp8) return c.method == QuantMethod::kCompressedTensors || Fp8BlocksMapped(c) ? WeightQuant::kFp8 : WeightQuant::kNone;
  if (c.bits == 4) {
    return c.group_size == kInt4GroupSize && !(c.method == QuantMethod::kGptq && c.desc_act) ? WeightQuant::kInt4
                                                                                             : WeightQuant::kNone;
  }
  return c.bits == 8 && c.group_size == -1 && c.sym ? WeightQuant::kInt8 : WeightQuant::kNone;
}

const void* QuantizedLinearSlice::stored() const {
  switch (kernel) {
    case WeightQuant::kInt4: return blocks.data();
    case WeightQuant::kInt8:
    case WeightQuant::kFp8: return rows.data();
    case WeightQuant::kMxfp4:  // (not one of these formats' kernels: model/mxfp4.h)
    case WeightQuant::kNone: return nullptr;
  }
  return nullptr;
}

bool Fp8BlocksMapped(const CheckpointQuant& c) {
  return c.method == QuantMethod::kFp8 && c.block_in % kFp8GroupMultiple == 0;
}

int64_t CheckpointLinearBytes(const CheckpointQuant& c, int64_t rows, int64_t cols, int64_t col0) {
  if (c.method == QuantMethod::kFp8) {  // as ReadFp8 decides
    if (col0 % c.block_in != 0) return -1;  // a cut inside a block: dequantized
    if (cols <= c.block_in) return QuantizedWeightBytes(WeightQuant::kFp8, rows, cols);  // one block: a scale a row
    if (c.block_in % kFp8GroupMultiple != 0) return -1;
    return QuantizedWeightBytes(WeightQuant::kFp8, rows, cols, c.block_in);
  }
  const WeightQuant kernel = CheckpointQuantKernel(c);
  return kernel == WeightQuant::kNone ? -1 : QuantizedWeightBytes(kernel, rows, cols);
}

const float* QuantizedLinearSlice::scales() const { return reinterpret_cast<const float*>(rows.data()); }

float QuantizedLinearSlice::row_scale(int64_t r) const {
  float v;
  std::memcpy(&v, rows.data() + r * static_cast<int64_t>(sizeof(float)), sizeof v);
  return v;
}

absl::StatusOr<CheckpointQuant> ParseCheckpointQuant(const std::string& text, const std::string& source) {
  absl::StatusOr<json> parsed = ParseJson<json>(text, absl::StrCat(source, ": quantization_config"));
  if (!parsed.ok()) return parsed.status();
  const json q = *std::move(parsed);
  if (!q.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": field \"quantization_config\" must be an object"));
  }
  auto method = q.find("quant_method");
  if (method == q.end() || !method->is_string()) return FieldError(source, "quant_method", "is missing or not a string");
  try {
    if (*method == "gptq") return ParseGptq(q, source);
    if (*method == "awq") return ParseAwq(q, source);
    if (*method == "compressed-tensors") return ParseCompressedTensors(q, source);
    if (*method == "fp8") return ParseFp8(q, source);
  } catch (const json::exception& e) {  // a field of an unexpected JSON type (value() on a non-object, ...)
    return absl::InvalidArgumentError(absl::StrCat(source, ": quantization_config: ", e.what()));
  }
  return absl::UnimplementedError(absl::StrCat(
      source, ": quantization_config field \"quant_method\" is ", method->dump(),
      "; only \"gptq\", \"awq\", \"compressed-tensors\" and \"fp8\" checkpoints load (or none)"));
}

absl::Status CheckQuantizedLinear(const WeightSource& ckpt, const CheckpointQuant& c, const std::string& prefix,
                                  int64_t out, int64_t in) {
  const int64_t p = c.values_per_int32();
  const bool in_packed = c.method == QuantMethod::kGptq || (c.method == QuantMethod::kCompressedTensors && !c.fp8);
  const bool out_packed = c.method == QuantMethod::kGptq || c.method == QuantMethod::kAwq ||
                          (c.method == QuantMethod::kCompressedTensors && !c.fp8 && !c.sym);
  if ((in_packed && in % p != 0) || (out_packed && out % p != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, ": a [", out, ", ", in, "] ", c.Describe(),
                                                   " weight needs its packed sizes to divide by ", p,
                                                   " (values per int32)"));
  }
  for (const auto& [name, shape] : ExpectedTensors(c, prefix, out, in)) {
    SHARDSERVE_RETURN_IF_ERROR(CheckTensor(ckpt, c, name, shape));
  }
  return absl::OkStatus();
}

namespace {

// The weights `w` stands for must be finite: finite scales times the codes can still overflow
// float32 (a scale of 1e38 times an int4 value of 15, or an fp8 448), which would make every
// logit NaN at the first step. Each row is dequantized as the kernels read it (kernels/quant.h)
// and checked; InvalidArgument naming the first weight that is not finite, in the whole layer's
// [out, in] coordinates (`row0`, `col0`: where the slice starts).
absl::Status CheckFinite(const std::string& prefix, const QuantizedLinearSlice& w, int64_t row0, int64_t col0) {
  std::vector<float> row(static_cast<size_t>(w.kernel == WeightQuant::kNone ? 0 : w.k));
  const int64_t blocks_per_row = (w.k + kInt4GroupSize - 1) / kInt4GroupSize;
  for (int64_t r = 0; r < w.m; ++r) {
    const float* values = row.data();
    if (w.kernel == WeightQuant::kNone) {
      values = w.dense.data() + r * w.k;
    } else {
      const float scale = w.kernel == WeightQuant::kInt4 || w.group > 0 ? 0.0f : w.row_scale(r);
      switch (w.kernel) {
        case WeightQuant::kInt4:
          DequantizeInt4Groups(row.data(), w.blocks.data() + r * blocks_per_row, 1, w.k);
          break;
        case WeightQuant::kInt8:
          DequantizeInt8Rows(row.data(), &scale, reinterpret_cast<const int8_t*>(w.codes()) + r * w.k, 1, w.k);
          break;
        default:
          if (w.group > 0) {
            const int64_t G = Fp8RowsLayout{w.m, w.k, w.group}.groups_per_row();
            DequantizeFp8Groups(row.data(), w.scales() + r * G, w.codes() + r * w.k, 1, w.k, w.group);
          } else {
            DequantizeFp8Rows(row.data(), &scale, w.codes() + r * w.k, 1, w.k);
          }
          break;
      }
    }
    for (int64_t i = 0; i < w.k; ++i) {
      if (!std::isfinite(values[i])) {
        return absl::InvalidArgumentError(absl::StrCat(
            prefix, ": weight [", row0 + r, "][", col0 + i, "] is ", values[i],
            ": its scale times its quantized value overflows float32 (a corrupt or hostile checkpoint)"));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<QuantizedLinearSlice> ReadSlice(const WeightSource& ckpt, const CheckpointQuant& c,
                                               const std::string& prefix, int64_t out, int64_t in,
                                               const Slice& slice, bool map) {
  SHARDSERVE_ASSIGN_OR_RETURN(const Ranges rg, SliceRanges(c, prefix, out, in, slice));
  absl::StatusOr<IntWeight> w;
  switch (c.method) {
    case QuantMethod::kGptq: w = ReadGptq(ckpt, c, prefix, out, in, rg); break;
    case QuantMethod::kAwq: w = ReadAwq(ckpt, c, prefix, out, in, rg); break;
    case QuantMethod::kCompressedTensors:
      if (c.fp8) return ReadFp8(ckpt, c, prefix, out, in, rg, slice, map);
      w = ReadPackQuantized(ckpt, c, prefix, out, in, rg);
      break;
    case QuantMethod::kFp8: return ReadFp8(ckpt, c, prefix, out, in, rg, slice, map);
  }
  if (!w.ok()) return w.status();
  return Finish(*w, map);
}

}  // namespace

absl::StatusOr<QuantizedLinearSlice> ReadQuantizedLinear(const WeightSource& ckpt, const CheckpointQuant& c,
                                                         const std::string& prefix, int64_t out, int64_t in,
                                                         const Slice& slice, bool map) {
  SHARDSERVE_RETURN_IF_ERROR(CheckQuantizedLinear(ckpt, c, prefix, out, in));
  SHARDSERVE_ASSIGN_OR_RETURN(QuantizedLinearSlice w, ReadSlice(ckpt, c, prefix, out, in, slice, map));
  SHARDSERVE_RETURN_IF_ERROR(
      CheckFinite(prefix, w, slice.dim == 0 ? slice.begin : 0, slice.dim == 1 ? slice.begin : 0));
  return w;
}

}  // namespace shardserve
