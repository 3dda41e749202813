// The CPU backend's matrix products: MatMul, and PackMatMulWeight's packing of weights at load
// (float32: panel_matmul.h's panels; bf16: oneDNN's layout, multiplied by oneDNN, or by
// bf16_matmul.h's product for a few rows; where oneDNN has no bf16 product, panel_matmul.h's bf16
// panels).
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <random>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cpu/bf16_matmul.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/int4_matmul.h"
#include "kernels/cpu/int8_matmul.h"
#include "kernels/cpu/isa_cap.h"
#include "kernels/cpu/panel_matmul.h"
#include "kernels/cpu/quant_isa.h"
#include "kernels/quant.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace shardserve::cpu {
namespace {

// Rows per oneDNN call of a bf16 product (CpuBackend::OneDnnMatMul): one AMX tile's rows, so that
// a lone decoding row costs little more than itself.
constexpr int64_t kBf16Rows = 16;

// Up to this many rows, a bf16 product whose weight is in bf16_matmul.h's layout runs that file's
// product (reading the weight once per step at memory speed) rather than oneDNN's, which pads the
// rows to kBf16Rows (bench_matmul at 1 to 16 rows, on a loaded
// machine: the hand-written one took less time up to 8 rows; at 16, about the same).
constexpr int64_t kBf16BlockedRows = 8;

// -1: no override of kBf16BlockedRows.
std::atomic<int64_t> g_bf16_blocked_rows{-1};

// Whether the memory of a and b overlaps (exact aliasing included); b's bytes are `b_bytes` when
// given (a packed weight's whole buffer: int8 panels pad their last panel past the layout's bytes).
bool Overlaps(const Tensor& a, const Tensor& b, size_t b_bytes = 0) {
  const auto* a0 = static_cast<const char*>(a.data);
  const auto* b0 = static_cast<const char*>(b.data);
  const size_t bn = b_bytes > 0 ? b_bytes : b.bytes();
  return a.bytes() > 0 && bn > 0 && a0 < b0 + bn && b0 < a0 + a.bytes();
}

// A oneDNN matmul's primitive descriptor (bias_desc null: no bias), in the API of oneDNN 2 (Debian
// 12) or 3 (which dropped the op descriptors).
dnnl::matmul::primitive_desc MatMulPrimitiveDesc(const dnnl::engine& engine, const dnnl::memory::desc& src,
                                                 const dnnl::memory::desc& weights, const dnnl::memory::desc* bias,
                                                 const dnnl::memory::desc& dst) {
#if DNNL_VERSION_MAJOR >= 3
  return bias != nullptr ? dnnl::matmul::primitive_desc(engine, src, weights, *bias, dst)
                         : dnnl::matmul::primitive_desc(engine, src, weights, dst);
#else
  return dnnl::matmul::primitive_desc(
      bias != nullptr ? dnnl::matmul::desc(src, weights, *bias, dst) : dnnl::matmul::desc(src, weights, dst), engine);
#endif
}

}  // namespace

bool CpuHasAvx512Bf16() {
  __builtin_cpu_init();
  // libgcc's answers include the OS's: AVX-512 only where XCR0 enables the zmm state.
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
         IsaCapAllows(IsaLevel::kAvx512Bf16);
}

bool OneDnnHasBf16MatMul() {
  // oneDNN's ISA values are supersets by bits, as in CpuHasNativeBf16MatMul below.
  const auto isa = static_cast<unsigned>(dnnl_get_effective_cpu_isa());
  const auto avx512 = static_cast<unsigned>(dnnl_cpu_isa_avx512_core);
  return (isa & avx512) == avx512;
}

bool OneDnnBf16UsesAmx() {
  // oneDNN's ISA values are supersets by bits, as in CpuHasNativeBf16MatMul below.
  const auto isa = static_cast<unsigned>(dnnl_get_effective_cpu_isa());
  const auto amx = static_cast<unsigned>(dnnl_cpu_isa_avx512_core_amx);
  return (isa & amx) == amx;
}

int64_t Bf16BlockedRows() {
  const int64_t o = g_bf16_blocked_rows.load(std::memory_order_relaxed);
  return o < 0 ? kBf16BlockedRows : o;
}

void SetBf16BlockedRowsOverride(std::optional<int64_t> rows) {
  g_bf16_blocked_rows.store(rows.has_value() ? std::max<int64_t>(0, *rows) : -1, std::memory_order_relaxed);
}

absl::Status CpuBackend::MatMul(Tensor* out, const Tensor& x, const Tensor& w, const Tensor* bias) {
  // w is F32, or BF16 / I8 when PackMatMulWeight stored it so (checked below).
  const ArgCheck check("MatMul", {{"out", out, kF32, 2},
                                  {"x", &x, kF32, 2},
                                  {"w", &w, w.dtype == kBF16 || w.dtype == DType::kI8 ? w.dtype : kF32, 2},
                                  {"bias", bias, kF32, 1, /*optional=*/true}});
  SHARDSERVE_RETURN_IF_ERROR(check.Types());
  const int64_t n = x.dim(0), k = x.dim(1), m = w.dim(0);
  if (w.dim(1) != k || out->dim(0) != n || out->dim(1) != m || (bias != nullptr && bias->dim(0) != m)) {
    return check.Error("want out [n, m], x [n, k], w [m, k], bias [m]");
  }
  absl::StatusOr<const PackedWeight*> packed = FindPacked(w);
  if (!packed.ok()) return check.Error(packed.status().message());
  const WeightQuant quant = *packed != nullptr ? (*packed)->quant : WeightQuant::kNone;
  if (w.quant != quant) {
    return check.Error(absl::StrCat("w says it is quantized as ", WeightQuantName(w.quant), ", its packed buffer holds ",
                                    WeightQuantName(quant)));
  }
  const int64_t group = *packed != nullptr ? (*packed)->group : 0;
  if (w.quant_group != group) {
    return check.Error(absl::StrCat("w says its fp8 scales are per ", w.quant_group, " inputs, its packed buffer's per ",
                                    group, " (0: per row)"));
  }
  // (A quantized w's bytes() are its layout's: scales and zeros included.)
  if (Overlaps(*out, x) || Overlaps(*out, w, *packed != nullptr ? (*packed)->bytes : 0) ||
      (bias != nullptr && Overlaps(*out, *bias))) {
    return check.Error("out must not overlap an input");
  }
  if (n == 0 || m == 0) return absl::OkStatus();

  const bool packed_bf16 = *packed != nullptr && (*packed)->bf16();
  if ((w.dtype == kBF16) != packed_bf16) {
    return check.Error("a BF16 w must be a weight PackMatMulWeight stored in bf16, and such a weight is BF16");
  }
  if ((w.dtype == DType::kI8) != (quant != WeightQuant::kNone)) {
    return check.Error(
        "an I8 w must be a weight PackMatMulWeight / PackQuantizedWeight stored in int8, int4, fp8 or mxfp4, and such a "
        "weight is I8");
  }
  float* y = out->as<float>();
  if (k == 0) {  // an empty sum: out is the bias (or 0) on every row
    for (int64_t r = 0; r < n; ++r) {
      if (bias != nullptr) {
        std::memcpy(y + r * m, bias->data, static_cast<size_t>(m) * sizeof(float));
      } else {
        std::fill(y + r * m, y + (r + 1) * m, 0.0f);
      }
    }
    return absl::OkStatus();
  }
  const float* b = bias != nullptr ? bias->as<float>() : nullptr;
  // int8 and int4 weights: the exact instance this CPU runs best, or under act_ kInt8 the one with
  // int8-rounded activations (under kInt16, int4 panels on int16-rounded ones).
  const QuantIsa int_isa = IntIsa();
  if (quant == WeightQuant::kMxfp4) {
    // Always panels (PackPanelsMxfp4), on the exact instance this CPU runs best (as fp8's).
    cpu::PanelMatMulMxfp4(y, x.as<float>(), n, m, k, static_cast<const uint8_t*>(w.data), b, threads_, ActiveQuantIsa());
    return absl::OkStatus();
  }
  if (quant == WeightQuant::kInt4) {
    if ((*packed)->int4_panels && act_ == CpuActivationQuant::kInt16) {
      cpu::PanelMatMulInt4Act16(y, x.as<float>(), n, m, k, static_cast<const cpu::Int4PanelGroup*>(w.data), b,
                                threads_);
      return absl::OkStatus();
    }
    if ((*packed)->int4_panels) {
      cpu::PanelMatMulInt4(y, x.as<float>(), n, m, k, static_cast<const cpu::Int4PanelGroup*>(w.data), b, threads_,
                           (*packed)->panel_tiles);
      return absl::OkStatus();
    }
    cpu::Int4MatMul(y, x.as<float>(), n, m, k, static_cast<const Int4Group128*>(w.data), b, threads_, int_isa);
    return absl::OkStatus();
  }
  if (quant == WeightQuant::kFp8 && group > 0) {
    // Input-group scales: [m, G] then the codes, or on panels [panel][G][16] then the panels.
    const int64_t groups = Fp8RowsLayout{m, k, group}.groups_per_row();
    const auto* scale = static_cast<const float*>(w.data);
    if ((*packed)->byte_panels) {
      const auto* q = static_cast<const uint8_t*>(w.data) + cpu::PanelScaleFloats(m, groups) * sizeof(float);
      cpu::PanelMatMulFp8Groups(y, x.as<float>(), n, m, k, q, scale, group, b, threads_);
    } else {
      const auto* q = static_cast<const uint8_t*>(w.data) + Fp8RowsLayout{m, k, group}.scale_bytes();
      cpu::Fp8GroupMatMul(y, x.as<float>(), n, m, k, q, scale, group, b, threads_);
    }
    return absl::OkStatus();
  }
  if (quant == WeightQuant::kInt8 || quant == WeightQuant::kFp8) {
    // (The same scales first, then the codes, in both layouts: Int8RowsLayout, Fp8RowsLayout.)
    const auto* scale = static_cast<const float*>(w.data);
    const auto* q = static_cast<const uint8_t*>(w.data) + Int8RowsLayout{m, k}.scale_bytes();
    if ((*packed)->byte_panels) {
      if (quant == WeightQuant::kInt8) {
        cpu::PanelMatMulInt8(y, x.as<float>(), n, m, k, q, scale, b, threads_, (*packed)->panel_tiles);
      } else {
        cpu::PanelMatMulFp8(y, x.as<float>(), n, m, k, q, scale, b, threads_);
      }
    } else if (quant == WeightQuant::kInt8) {
      cpu::Int8MatMul(y, x.as<float>(), n, m, k, reinterpret_cast<const int8_t*>(q), scale, b, threads_, int_isa);
    } else {
      cpu::Fp8MatMul(y, x.as<float>(), n, m, k, q, scale, b, threads_);
    }
    return absl::OkStatus();
  }
  if (packed_bf16 && (*packed)->bf16_panels) {
    // The inputs rounded to bf16 (to nearest even), as oneDNN's bf16 products round them.
    const float* xf = x.as<float>();
    bf16_x_.resize(static_cast<size_t>(n * k));
    for (int64_t i = 0; i < n * k; ++i) bf16_x_[i] = Bf16ToF32(F32ToBf16(xf[i]));
    cpu::PanelMatMulBf16(y, bf16_x_.data(), n, m, k, static_cast<const uint16_t*>(w.data), b, threads_);
    return absl::OkStatus();
  }
  if (!packed_bf16) {
    cpu::PanelMatMul(y, x.as<float>(), n, m, k, w.as<float>(), /*plain=*/*packed == nullptr, b, threads_,
                     &plain_panels_);
    return absl::OkStatus();
  }
  try {
    Bf16MatMul(y, x.as<float>(), n, m, k, **packed, w.data, b);
  } catch (const dnnl::error& e) {
    return absl::InternalError(
        absl::StrCat("MatMul: oneDNN failed (", e.what(), ") on x ", x.ShapeString(), ", packed bf16 w ", w.ShapeString()));
  }
  return absl::OkStatus();
}

std::string CpuBackend::QuantizedKernelsDescription(CpuActivationQuant act) {
  if (act == CpuActivationQuant::kInt16 && IntOnPanels(IntIsaFor(act))) {
    return absl::StrCat("int4 products on avx512vnni panels (activations rounded to int16 per group of 128); other ",
                        cpu::QuantizedKernelsDescription(IntIsaFor(act)));
  }
  return cpu::QuantizedKernelsDescription(IntIsaFor(act));
}

absl::StatusOr<const CpuBackend::PackedWeight*> CpuBackend::FindPacked(const Tensor& w) const {
  auto it = packed_.upper_bound(w.data);  // the first buffer above w.data
  if (it == packed_.begin()) return nullptr;
  --it;  // the last buffer at or below w.data
  const auto* begin = static_cast<const char*>(it->first);
  if (static_cast<const char*>(w.data) >= begin + it->second.bytes) return nullptr;
  if (w.data != it->first || w.dim(0) != it->second.m || w.dim(1) != it->second.k) {
    return absl::InvalidArgumentError(absl::StrCat("w views part of a packed [", it->second.m, ", ", it->second.k,
                                                   "] weight; pass the whole tensor PackMatMulWeight made"));
  }
  return &it->second;
}

void CpuBackend::Bf16MatMul(float* y, const float* x, int64_t n, int64_t m, int64_t k, const PackedWeight& packed,
                            void* w, const float* bias) {
  using dnnl::memory;
  constexpr auto f32 = memory::data_type::f32;
  constexpr auto bf16 = memory::data_type::bf16;
  constexpr auto ab = memory::format_tag::ab;
  // OpenMP's thread count is per calling thread; the step thread is not the one that made us.
  omp_set_num_threads(threads_);
  if (packed.bf16_chunk > 0 && n <= Bf16BlockedRows()) {
    cpu::Bf16BlockedMatMul(y, x, n, m, k, static_cast<const uint16_t*>(w), bias, packed.bf16_chunk, threads_);
    return;
  }
  const memory::desc bias_desc({1, m}, f32, ab);
  const memory::desc chunk_src({kBf16Rows, k}, bf16, ab), chunk_dst({kBf16Rows, m}, f32, ab);
  // The oneDNN matmul for this weight's shape and layout, made (JIT-compiled, ~0.4 ms) on first use.
  std::vector<std::pair<memory::desc, dnnl::matmul>>& made = bf16_matmuls_[{m, k, bias != nullptr}];
  auto it = std::find_if(made.begin(), made.end(), [&](const auto& p) { return p.first == packed.desc; });
  if (it == made.end()) {
    const dnnl::matmul::primitive_desc pd =
        MatMulPrimitiveDesc(engine_, chunk_src, packed.desc, bias != nullptr ? &bias_desc : nullptr, chunk_dst);
    it = made.emplace(made.end(), packed.desc, dnnl::matmul(pd));
  }
  const dnnl::matmul& mm = it->second;
  auto run = [&](void* src, float* dst) {
    std::unordered_map<int, memory> args = {{DNNL_ARG_SRC, memory(chunk_src, engine_, src)},
                                            {DNNL_ARG_WEIGHTS, memory(packed.desc, engine_, w)},
                                            {DNNL_ARG_DST, memory(chunk_dst, engine_, dst)}};
    if (bias != nullptr) args.emplace(DNNL_ARG_BIAS, memory(bias_desc, engine_, const_cast<float*>(bias)));
    mm.execute(stream_, args);
  };
  // Round x to bf16 (to nearest even) with a reorder made once per shape, into rows padded with
  // zeros to a multiple of kBf16Rows; then multiply kBf16Rows rows at a time. oneDNN's bf16
  // kernels sum in an order that depends on the row count (AMX and AVX-512 kernels for different
  // row counts and tails, K split differently), so a row's result would depend on how many rows
  // share its step; one primitive for every chunk gives every row the same arithmetic. Each
  // chunk re-reads the weight (a layer's matrix, from cache after the first chunk).
  const memory::desc x_desc({n, k}, f32, ab);
  const int64_t padded = (n + kBf16Rows - 1) / kBf16Rows * kBf16Rows;
  src_bf16_.resize(static_cast<size_t>(padded * k));
  const memory::desc rounded_desc({n, k}, bf16, ab);
  auto r = to_bf16_.find({n, k});
  if (r == to_bf16_.end()) {
    r = to_bf16_.emplace(std::make_pair(n, k), dnnl::reorder(dnnl::reorder::primitive_desc(engine_, x_desc, engine_,
                                                                                          rounded_desc)))
            .first;
  }
  memory from(x_desc, engine_, const_cast<float*>(x)), to(rounded_desc, engine_, src_bf16_.data());
  r->second.execute(stream_, from, to);
  std::fill(src_bf16_.begin() + n * k, src_bf16_.begin() + padded * k, uint16_t{0});
  const int64_t whole = n / kBf16Rows * kBf16Rows;  // rows in whole chunks, written straight to y
  for (int64_t c = 0; c < whole; c += kBf16Rows) run(src_bf16_.data() + c * k, y + c * m);
  if (whole < n) {  // the last, partial chunk: its output rows past n land in scratch
    last_chunk_out_.resize(static_cast<size_t>(kBf16Rows * m));
    run(src_bf16_.data() + whole * k, last_chunk_out_.data());
  }
  stream_.wait();
  if (whole < n) std::copy_n(last_chunk_out_.data(), (n - whole) * m, y + whole * m);
}

int64_t CpuBackend::FindBf16Chunk(const PackedWeight& packed, void* w) {
  const int64_t m = packed.m, k = packed.k;
  auto found = bf16_chunks_.find({m, k});
  if (found != bf16_chunks_.end()) return found->second;
  // A probe row and bias with full float32 mantissas (in [-1, 1)), the same on every call.
  std::mt19937 rng(25);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(k)), bias(static_cast<size_t>(m));
  for (float& v : x) v = dist(rng);
  for (float& v : bias) v = dist(rng);
  std::vector<float> want(static_cast<size_t>(m)), got(static_cast<size_t>(m));
  PackedWeight onednn = packed;
  onednn.bf16_chunk = 0;
  Bf16MatMul(want.data(), x.data(), 1, m, k, onednn, w, bias.data());
  const int64_t padded_k = (k + kBf16BlockInputs - 1) / kBf16BlockInputs * kBf16BlockInputs;
  int64_t chunk = 0;
  for (int64_t c = padded_k, j = -1; j <= 10; c = kBf16BlockInputs << ++j) {
    if (j >= 0 && c >= padded_k) break;  // one chunk: tried first
    cpu::Bf16BlockedMatMul(got.data(), x.data(), 1, m, k, static_cast<const uint16_t*>(w), bias.data(), c, threads_);
    if (got == want) {
      chunk = c;
      break;
    }
  }
  bf16_chunks_[{m, k}] = chunk;
  return chunk;
}

absl::StatusOr<Buffer> CpuBackend::PackQuantizedWeight(WeightQuant quant, const void* stored, int64_t m, int64_t k,
                                                       Tensor* packed, int64_t group) {
  if (quant == WeightQuant::kNone) {
    return absl::InvalidArgumentError("PackQuantizedWeight: kNone is no quantized layout; use PackMatMulWeight");
  }
  if (m <= 0 || k <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("PackQuantizedWeight: an empty [", m, ", ", k, "] ",
                                                   WeightQuantName(quant), " weight"));
  }
  if (group < 0 || (group > 0 && quant != WeightQuant::kFp8)) {
    return absl::InvalidArgumentError(absl::StrCat("PackQuantizedWeight: input groups of ", group, " for a ",
                                                   WeightQuantName(quant), " weight (only fp8 has them; 0: none)"));
  }
  if (quant == WeightQuant::kMxfp4) {
    // The checkpoint's codes and E8M0 scales (Mxfp4RowsLayout) repacked as panels.
    if (k % kMxfp4BlockSize != 0) {
      return absl::InvalidArgumentError(absl::StrCat("PackQuantizedWeight: an mxfp4 weight of ", k,
                                                     " inputs, not a whole number of blocks of ", kMxfp4BlockSize));
    }
    const auto* bytes = static_cast<const uint8_t*>(stored);
    if (!Mxfp4ValuesFinite(bytes, m, k)) {
      return absl::InvalidArgumentError(
          absl::StrCat("PackQuantizedWeight: an mxfp4 [", m, ", ", k,
                       "] weight with values past float32 (a scale byte of 255, NaN in E8M0, or 253 / 254 on a code "
                       "it carries past 2^128)"));
    }
    const auto panel_bytes = static_cast<size_t>(cpu::Mxfp4PanelBytes(m, k));
    SHARDSERVE_ASSIGN_OR_RETURN(Buffer buffer, Allocate(panel_bytes));
    cpu::PackPanelsMxfp4(static_cast<uint8_t*>(buffer.data()), bytes, m, k);
    packed_[buffer.data()] = PackedWeight{m, k, panel_bytes, {}, quant};
    *packed = Tensor(buffer.data(), DType::kI8, {m, k});
    packed->quant = quant;
    return buffer;
  }
  return PackQuantized(
      quant, m, k, packed,
      [&](void* to) {
        std::memcpy(to, stored, static_cast<size_t>(QuantizedWeightBytes(quant, m, k, group)));
        return absl::OkStatus();
      },
      group);
}

absl::StatusOr<Buffer> CpuBackend::PackQuantized(WeightQuant quant, int64_t m, int64_t k, Tensor* packed,
                                                 absl::FunctionRef<absl::Status(void*)> fill, int64_t group) {
  // A group of k or more inputs is one scale a row: the layout without groups, byte for byte.
  if (quant != WeightQuant::kFp8 || Fp8RowsLayout{m, k, group}.groups_per_row() == 1) group = 0;
  const auto bytes = static_cast<size_t>(QuantizedWeightBytes(quant, m, k, group));
  // The weight's instance, and whether it runs int8 / fp8 / int4 weights as panels (fp8 has no
  // integer instance: its own is the exact one, ActiveQuantIsa, whatever act_).
  const QuantIsa isa = quant == WeightQuant::kFp8 ? ActiveQuantIsa() : IntIsa();
  const bool byte_panels =
      quant == WeightQuant::kFp8 ? Fp8OnPanels(isa) : quant == WeightQuant::kInt8 && IntOnPanels(isa);
  if (byte_panels && group > 0) {
    // The rows' layout first, then its scales in panel order and its codes as panels (panel_matmul.h).
    std::vector<uint8_t> rows(bytes);
    SHARDSERVE_RETURN_IF_ERROR(fill(rows.data()));
    const Fp8RowsLayout layout{m, k, group};
    const int64_t groups = layout.groups_per_row();
    const int64_t scale_bytes = cpu::PanelScaleFloats(m, groups) * static_cast<int64_t>(sizeof(float));
    const auto panel_bytes = static_cast<size_t>(scale_bytes + cpu::PanelMatMulFloats(m, k));
    SHARDSERVE_ASSIGN_OR_RETURN(Buffer buffer, Allocate(panel_bytes));
    std::vector<float> scales(static_cast<size_t>(m * groups));
    std::memcpy(scales.data(), rows.data(), static_cast<size_t>(layout.scale_bytes()));
    cpu::PackPanelScales(static_cast<float*>(buffer.data()), scales.data(), m, groups);
    cpu::PackPanelsBytes(static_cast<uint8_t*>(buffer.data()) + scale_bytes, rows.data() + layout.scale_bytes(), m, k);
    PackedWeight& p = packed_[buffer.data()] = PackedWeight{m, k, panel_bytes, {}, quant};
    p.group = group;
    p.byte_panels = true;
    p.panel_tiles = PanelTilesFor(isa);
    *packed = Tensor(buffer.data(), DType::kI8, {m, k});
    packed->quant = quant;
    packed->quant_group = group;
    return buffer;
  }
  if (byte_panels) {
    // The rows' layout first, then its codes repacked as panels after its scales (panel_matmul.h).
    std::vector<uint8_t> rows(bytes);
    SHARDSERVE_RETURN_IF_ERROR(fill(rows.data()));
    const int64_t scale_bytes = Int8RowsLayout{m, k}.scale_bytes();
    const auto panel_bytes = static_cast<size_t>(scale_bytes + cpu::PanelMatMulFloats(m, k));
    SHARDSERVE_ASSIGN_OR_RETURN(Buffer buffer, Allocate(panel_bytes));
    std::memcpy(buffer.data(), rows.data(), static_cast<size_t>(scale_bytes));
    cpu::PackPanelsBytes(static_cast<uint8_t*>(buffer.data()) + scale_bytes, rows.data() + scale_bytes, m, k);
    packed_[buffer.data()] = PackedWeight{m, k, panel_bytes, {}, quant};
    packed_[buffer.data()].byte_panels = true;
    packed_[buffer.data()].panel_tiles = PanelTilesFor(isa);
    *packed = Tensor(buffer.data(), DType::kI8, {m, k});
    packed->quant = quant;
    return buffer;
  }
  if (quant == WeightQuant::kInt4 && IntOnPanels(isa)) {
    // The blocks first, then repacked as panels (panel_matmul.h).
    std::vector<Int4Group128> blocks(static_cast<size_t>(m * Int4GroupsLayout{m, k}.groups_per_row()));
    SHARDSERVE_RETURN_IF_ERROR(fill(blocks.data()));
    const auto panel_bytes = static_cast<size_t>(cpu::Int4PanelGroupCount(m, k)) * sizeof(cpu::Int4PanelGroup);
    SHARDSERVE_ASSIGN_OR_RETURN(Buffer buffer, Allocate(panel_bytes));
    // (int16 activations' product reads the codes in its own order: panel_matmul.h Int4CodeOrder.)
    cpu::PackPanelsInt4(static_cast<cpu::Int4PanelGroup*>(buffer.data()), blocks.data(), m, k,
                        act_ == CpuActivationQuant::kInt16 ? cpu::Int4CodeOrder::kOctets : cpu::Int4CodeOrder::kPairs);
    packed_[buffer.data()] = PackedWeight{m, k, panel_bytes, {}, quant};
    packed_[buffer.data()].int4_panels = true;
    packed_[buffer.data()].panel_tiles = PanelTilesFor(isa);
    *packed = Tensor(buffer.data(), DType::kI8, {m, k});
    packed->quant = quant;
    return buffer;
  }
  SHARDSERVE_ASSIGN_OR_RETURN(Buffer buffer, Allocate(bytes));
  SHARDSERVE_RETURN_IF_ERROR(fill(buffer.data()));
  packed_[buffer.data()] = PackedWeight{m, k, bytes, {}, quant};
  packed_[buffer.data()].group = group;
  *packed = Tensor(buffer.data(), DType::kI8, {m, k});
  packed->quant = quant;
  packed->quant_group = group;
  return buffer;
}

absl::StatusOr<Buffer> CpuBackend::PackF32Panels(const Tensor& w, Tensor* packed) {
  const int64_t m = w.dim(0), k = w.dim(1);
  const auto bytes = static_cast<size_t>(cpu::PanelMatMulFloats(m, k)) * sizeof(float);
  absl::StatusOr<Buffer> buffer = Allocate(bytes);
  if (!buffer.ok()) return buffer.status();
  cpu::PackPanels(static_cast<float*>(buffer->data()), w.as<float>(), m, k);
  packed_[buffer->data()] = PackedWeight{m, k, bytes, {}};
  *packed = Tensor(buffer->data(), kF32, {m, k});
  return buffer;
}

absl::StatusOr<Buffer> CpuBackend::PackTiedTable(const Tensor& w, Tensor* packed) {
  const ArgCheck check("PackTiedTable", {{"w", &w, kF32, 2}});
  SHARDSERVE_RETURN_IF_ERROR(check.Types());
  *packed = w;
  if (w.dim(0) == 0 || w.dim(1) == 0) return Buffer();  // nothing to multiply or look up
  return PackF32Panels(w, packed);
}

absl::StatusOr<Buffer> CpuBackend::PackMatMulWeight(const Tensor& w, Tensor* packed, WeightQuant quant) {
  const ArgCheck check("PackMatMulWeight", {{"w", &w, kF32, 2}});
  SHARDSERVE_RETURN_IF_ERROR(check.Types());
  *packed = w;
  const int64_t m = w.dim(0), k = w.dim(1);
  if (m == 0 || k == 0) return Buffer();  // nothing to multiply; MatMul handles it plain
  if (quant == WeightQuant::kMxfp4) {
    return check.Error("nothing quantizes into mxfp4 at load; PackQuantizedWeight takes a checkpoint's codes");
  }
  if (quant != WeightQuant::kNone) {  // kernels/quant.h's layouts, for int8_matmul.h and int4_matmul.h
    return PackQuantized(quant, m, k, packed, [&](void* to) -> absl::Status {
      const absl::Status s = QuantizeWeight(quant, to, w.as<float>(), m, k);
      return s.ok() ? s : check.Error(s.message());
    });
  }
  if (matmul_ == CpuMatMul::kF32) return PackF32Panels(w, packed);  // panels for panel_matmul.h's loops
  if (!OneDnnHasBf16MatMul()) {  // bf16 panels for panel_matmul.h's loops
    const auto bytes = static_cast<size_t>(cpu::PanelMatMulFloats(m, k)) * sizeof(uint16_t);
    absl::StatusOr<Buffer> buffer = Allocate(bytes);
    if (!buffer.ok()) return buffer.status();
    cpu::PackPanelsBf16(static_cast<uint16_t*>(buffer->data()), w.as<float>(), m, k);
    PackedWeight& p = packed_[buffer->data()] = PackedWeight{m, k, bytes, {}};
    p.bf16_panels = true;
    *packed = Tensor(buffer->data(), kBF16, {m, k});
    return buffer;
  }
  using dnnl::memory;
  constexpr auto bf16 = memory::data_type::bf16;
  // The layout oneDNN picks for kBf16Rows-row products, the only row count Bf16MatMul uses, picked
  // under this backend's thread count (oneDNN's choice depends on the calling thread's OpenMP
  // count, which a loading thread may hold at another value), so that every weight of a shape gets
  // the layout the products run with.
  omp_set_num_threads(threads_);
  try {
    const dnnl::matmul::primitive_desc pd = MatMulPrimitiveDesc(
        engine_, memory::desc({kBf16Rows, k}, bf16, memory::format_tag::ab),
        memory::desc({k, m}, bf16, memory::format_tag::any), nullptr,
        memory::desc({kBf16Rows, m}, memory::data_type::f32, memory::format_tag::ab));
    const memory::desc layout = pd.weights_desc();
    absl::StatusOr<Buffer> buffer = Allocate(layout.get_size());
    if (!buffer.ok()) return buffer.status();
    // w [m, k] row-major is the matmul's [k, m] weights in column-major ("ba") order. The reorder
    // converts to bf16, rounding to nearest even.
    memory plain(memory::desc({k, m}, memory::data_type::f32, memory::format_tag::ba), engine_, w.data);
    memory blocked(layout, engine_, buffer->data());
    omp_set_num_threads(threads_);
    dnnl::reorder(plain, blocked).execute(stream_, plain, blocked);
    stream_.wait();
    PackedWeight& p = packed_[buffer->data()] = PackedWeight{m, k, layout.get_size(), layout};
    // bf16_matmul.h reads oneDNN's layout where it is the one that file knows and it sums as oneDNN
    // does: on AVX-512 BF16 without AMX. (With AMX its tiles sum in their own order, and some shapes
    // get 48-column blocks, as measured on an Intel Xeon with AMX.)
    static const bool blocked_bf16 = cpu::CpuHasAvx512Bf16() && !cpu::OneDnnBf16UsesAmx();
    if (blocked_bf16 && layout == memory::desc({k, m}, bf16, memory::format_tag::BA16a64b2a)) {
      p.bf16_chunk = FindBf16Chunk(p, buffer->data());
    }
    *packed = Tensor(buffer->data(), kBF16, {m, k});
    return buffer;
  } catch (const dnnl::error& e) {
    *packed = w;
    if (e.status == dnnl_unimplemented) {
      return absl::FailedPreconditionError(
          "PackMatMulWeight: oneDNN has no bf16 matrix product for this CPU (it needs AVX-512); multiply in f32");
    }
    return absl::InternalError(absl::StrCat("PackMatMulWeight: oneDNN failed (", e.what(), ") on w ", w.ShapeString()));
  }
}

}  // namespace shardserve::cpu

namespace shardserve {

bool CpuHasNativeBf16MatMul() {
  // oneDNN's ISA values are supersets by bits: AMX's include AVX512-BF16's.
  const auto isa = static_cast<unsigned>(dnnl_get_effective_cpu_isa());
  const auto bf16 = static_cast<unsigned>(dnnl_cpu_isa_avx512_core_bf16);
  return (isa & bf16) == bf16;
}

}  // namespace shardserve
