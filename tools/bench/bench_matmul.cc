// bench_matmul: the CPU backend's float32 matrix products (kernels/cpu/panel_matmul.h) beside
// oneDNN's matmul as the backend used it before (weights reordered once into the layout oneDNN
// picks, one primitive per row count), the backend's bf16 products where the CPU has them (oneDNN's
// in chunks of 16 rows, "bf16 oneDNN", and what the backend runs, "bf16": kernels/cpu/bf16_matmul.h's
// product up to a few rows; where oneDNN has no bf16 product, the backend's bf16 panels, "bf16
// panels": kernels/cpu/panel_matmul.h), and the backend's products by the same weights quantized
// to int8, fp8 (kernels/cpu/int8_matmul.h) and int4 (the blocks of kernels/cpu/int4_matmul.h, and
// the panels of kernels/cpu/panel_matmul.h that the backend runs on AVX2 and AVX-512 CPUs), and by
// random mxfp4 weights (its panels: every k must be a multiple of 32), on each
// instruction set this CPU has (AVX2, AVX-512, and int8 and int4 with activations quantized, as
// --activation-quantization int8 runs them: on AVX-512 VNNI, else AVX2; kernels/cpu/quant_isa.h; and int4 on
// int16-rounded activations, "int4 panels int16", as --activation-quantization int16 runs it on AVX-512
// VNNI), over the weights of one
// pipeline stage (and float32 by the plain weight, "f32 plain w", a row-major weight packed
// on every product; and, where the CPU has AVX-512, the float32 panels' 8-float tiles, "f32 vec8 tiles",
// beside the AVX-512 ones the backend runs from 4 rows), side by side in one run: for each row
// count, all of them alternate `--repeat` times and the medians are reported (and the minimum,
// "min ms", and the mean CPU time of this process per run, "cpu ms": on a machine shared with other
// work, the least disturbed run and the time the product itself spent on the cores), with the weight bytes per second each product reads (4 per
// parameter for float32, 2 for bf16, 1 for int8 and fp8, 72 / 128 for int4), and whether each one's rows
// equal the same rows of a product of max(256, --max-rows) rows (bitwise), the property continuous
// batching needs. Row counts: 1, 2, 4, ... up to --max-rows (512: a prefill step's).
// oneDNN runs on --threads OpenMP threads, as ours (its CPU time / wall time is printed to show it).
//
//   bench_matmul [--threads 1] [--layers 6] [--hidden 768] [--kv 256] [--mlp 2048] [--repeat 7]
//                [--max-rows 64]
//
// Defaults: one PP=2 stage of the benchmark model (tools/fixtures/make_bench_model.py), one thread (what
// each of two PP=2 workers gets on a 2-core machine). Llama-3-8B's shapes (4096 x 4096, 14336 x
// 4096, 4096 x 14336): --layers 1 --hidden 4096 --kv 1024 --mlp 14336. Random weights and inputs
// in [-0.05, 0.05].
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/cpu/bf16_matmul.h"
#include "kernels/cpu/int4_matmul.h"
#include "kernels/cpu/int8_matmul.h"
#include "kernels/cpu/panel_matmul.h"
#include "kernels/cpu/quant_isa.h"
#include "kernels/quant.h"
#include "kernels/tensor.h"
#include "oneapi/dnnl/dnnl.hpp"
#include "tools/bench/bench_util.h"
#include "tools/cli/bench_stats.h"

namespace {

using shardserve::Backend;
using shardserve::Buffer;
using shardserve::DType;
using shardserve::Tensor;
using shardserve::cli::Percentile;
using shardserve::cpu::PanelTiles;

// A matmul primitive descriptor in oneDNN 2's API (Debian 12) or 3's (no op descriptors).
dnnl::matmul::primitive_desc MatMulDesc(const dnnl::engine& engine, const dnnl::memory::desc& src,
                                        const dnnl::memory::desc& weights, const dnnl::memory::desc& dst) {
#if DNNL_VERSION_MAJOR >= 3
  return dnnl::matmul::primitive_desc(engine, src, weights, dst);
#else
  return dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, weights, dst), engine);
#endif
}

// oneDNN's float32 matmul by one weight w [m, k], as cpu_backend.cc used it up to commit be1c94f.
class OneDnnProduct {
 public:
  OneDnnProduct(const dnnl::engine& engine, const float* w, int64_t m, int64_t k) : engine_(engine), m_(m), k_(k) {
    using dnnl::memory;
    const dnnl::matmul::primitive_desc pd =
        MatMulDesc(engine_, Desc(16, k), memory::desc({k, m}, memory::data_type::f32, memory::format_tag::any),
                   Desc(16, m));
    layout_ = pd.weights_desc();
    packed_.resize(layout_.get_size() / sizeof(float));
    memory plain(memory::desc({k, m}, memory::data_type::f32, memory::format_tag::ba), engine_, const_cast<float*>(w));
    memory blocked(layout_, engine_, packed_.data());
    dnnl::stream s(engine_);
    dnnl::reorder(plain, blocked).execute(s, plain, blocked);
    s.wait();
  }
  void Run(dnnl::stream& s, float* y, const float* x, int64_t n) {
    auto it = by_rows_.find(n);
    if (it == by_rows_.end()) {
      it = by_rows_.emplace(n, dnnl::matmul(MatMulDesc(engine_, Desc(n, k_), layout_, Desc(n, m_)))).first;
    }
    it->second.execute(s, {{DNNL_ARG_SRC, dnnl::memory(Desc(n, k_), engine_, const_cast<float*>(x))},
                           {DNNL_ARG_WEIGHTS, dnnl::memory(layout_, engine_, packed_.data())},
                           {DNNL_ARG_DST, dnnl::memory(Desc(n, m_), engine_, y)}});
    s.wait();
  }

 private:
  static dnnl::memory::desc Desc(int64_t rows, int64_t cols) {
    return dnnl::memory::desc({rows, cols}, dnnl::memory::data_type::f32, dnnl::memory::format_tag::ab);
  }
  dnnl::engine engine_;
  int64_t m_, k_;
  dnnl::memory::desc layout_;
  std::vector<float> packed_;
  std::map<int64_t, dnnl::matmul> by_rows_;
};

double CpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

}  // namespace

int main(int argc, char** argv) {
  using shardserve::WeightQuant;
  using shardserve::cpu::QuantIsa;
  const std::optional<std::map<std::string, int64_t>> flags = shardserve::bench::PositiveIntFlagsOrUsage(
      "bench_matmul", "usage: bench_matmul [--threads N] [--layers L] [--hidden H] [--kv KV] [--mlp I] [--repeat R] "
      "[--max-rows M]\n",
      argc, argv,
      {{"threads", 1}, {"layers", 6}, {"hidden", 768}, {"kv", 256}, {"mlp", 2048}, {"repeat", 7}, {"max-rows", 64}});
  if (!flags) return 2;
  const int threads = static_cast<int>(flags->at("threads")), repeat = static_cast<int>(flags->at("repeat"));
  const int64_t layers = flags->at("layers"), hidden = flags->at("hidden"), kv = flags->at("kv"), mlp = flags->at("mlp");
  // oneDNN (built with OpenMP on Debian) takes its thread count from this thread's OpenMP setting
  // when it runs; dynamic adjustment off, so that it is exactly that.
  omp_set_dynamic(0);
  omp_set_num_threads(threads);
  struct Shape {
    int64_t m, k;
  };
  // One layer's products: q, k, v, o, gate, up, down.
  const Shape layer[] = {{hidden, hidden}, {kv, hidden}, {kv, hidden}, {hidden, hidden},
                         {mlp, hidden},    {mlp, hidden}, {hidden, mlp}};
  double params = 0;
  for (const Shape& s : layer) params += static_cast<double>(s.m * s.k) * static_cast<double>(layers);

  std::unique_ptr<Backend> backend = shardserve::MakeCpuBackend(threads, shardserve::CpuMatMul::kF32);
  // bf16 products where the CPU has bf16 instructions (oneDNN's and the backend's), or where oneDNN
  // has none at all, the backend's bf16 panels (kernels/cpu/panel_matmul.h).
  const bool bf16_panels = !shardserve::cpu::OneDnnHasBf16MatMul();
  const bool bf16 = shardserve::CpuHasNativeBf16MatMul() || bf16_panels;
  std::unique_ptr<Backend> bf16_backend = bf16 ? shardserve::MakeCpuBackend(threads, shardserve::CpuMatMul::kBF16) : nullptr;
  const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-0.05f, 0.05f);
  // The kernels compared: float32 panels, oneDNN float32, then each format on each instruction set.
  struct Kernel {
    std::string name;
    WeightQuant quant;
    std::optional<QuantIsa> isa;  // quantized ones only
    double bytes_per_param;
    // bf16 ones only: Bf16BlockedRows's override (0: oneDNN at every row count; nullopt: the backend's choice).
    std::optional<int64_t> bf16_rows = std::nullopt;
    // float32 ones only: the panels' tiles (nullopt: the backend's choice; kernels/cpu/panel_matmul.h).
    std::optional<PanelTiles> tiles = std::nullopt;
    // int8 / int4 on int8-rounded activations: run by act8_backend (--activation-quantization int8).
    bool act8 = false;
  };
  std::vector<Kernel> kernels = {{"f32 panels", WeightQuant::kNone, std::nullopt, 4},
                                 {"f32 plain w", WeightQuant::kNone, std::nullopt, 4},
                                 {"f32 oneDNN", WeightQuant::kNone, std::nullopt, 4}};
  if (shardserve::cpu::PanelTilesSupported(PanelTiles::kAvx512)) {  // the 8-float tiles beside the AVX-512 ones
    kernels.insert(kernels.begin() + 1, {"f32 vec8 tiles", WeightQuant::kNone, std::nullopt, 4, std::nullopt, PanelTiles::kVec8});
  }
  if (bf16_panels) {
    kernels.push_back({"bf16 panels", WeightQuant::kNone, std::nullopt, 2, std::nullopt});
  } else if (bf16) {
    kernels.push_back({"bf16 oneDNN", WeightQuant::kNone, std::nullopt, 2, 0});
    kernels.push_back({"bf16", WeightQuant::kNone, std::nullopt, 2, std::nullopt});
  }
  for (QuantIsa isa : {QuantIsa::kAvx2, QuantIsa::kAvx512}) {
    if (!shardserve::cpu::QuantIsaSupported(isa)) continue;
    for (WeightQuant q : {WeightQuant::kInt8, WeightQuant::kFp8, WeightQuant::kInt4}) {
      if (q == WeightQuant::kInt4 && isa == QuantIsa::kAvx512) continue;  // AVX-512's int4: "int4 panels" below
      kernels.push_back({absl::StrCat(shardserve::WeightQuantName(q), " ", shardserve::cpu::QuantIsaName(isa)), q, isa,
                         q == WeightQuant::kInt4 ? 72.0 / 128 : 1.0});
    }
  }
  // Where the backend keeps int8 and int4 weights as panels (kernels/cpu/quant_isa.h IntOnPanels:
  // AVX2 and AVX-512 CPUs; fp8 too on AVX-512 ones, Fp8OnPanels), "int8 avx2", "fp8 avx512", "int4
  // avx512", ... above multiply the rows / blocks themselves (Int8MatMul, Fp8MatMul, Int4MatMul) and
  // "int8 panels", ... are the backend's.
  const bool panels = shardserve::cpu::IntOnPanels(shardserve::cpu::ActiveQuantIsa());
  if (panels) {
    kernels.push_back({"int8 panels", WeightQuant::kInt8, std::nullopt, 1.0});
    if (shardserve::cpu::Fp8OnPanels(shardserve::cpu::ActiveQuantIsa())) {
      kernels.push_back({"fp8 panels", WeightQuant::kFp8, std::nullopt, 1.0});
    }
    kernels.push_back({"int4 panels", WeightQuant::kInt4, std::nullopt, 72.0 / 128});
  }
  // On an AVX-512 CPU, the same panels by the AVX2 CPUs' instance (8-float vectors) beside them.
  if (shardserve::cpu::ActiveQuantIsa() == QuantIsa::kAvx512) {
    kernels.push_back({"int8 panels avx2", WeightQuant::kInt8, std::nullopt, 1.0});
    kernels.push_back({"int4 panels avx2", WeightQuant::kInt4, std::nullopt, 72.0 / 128});
  }
  // int4 on int16-rounded activations (--activation-quantization int16: PanelMatMulInt4Act16), on the
  // same panels with their codes in that product's order (Int4CodeOrder::kOctets), where the CPU has
  // AVX-512 VNNI.
  const bool int16_panels = panels && shardserve::cpu::QuantIsaSupported(QuantIsa::kAvx512Vnni);
  if (int16_panels) {
    kernels.push_back({"int4 panels int16", WeightQuant::kInt4, std::nullopt, 72.0 / 128});
  }
  // mxfp4 (gpt-oss's experts as published: kernels/cpu/panel_matmul.h PanelMatMulMxfp4), on panels on
  // every CPU, by the CPU's exact instance, and on an AVX-512 CPU by the AVX2 one beside it. Its codes
  // and scales are random (nothing quantizes into mxfp4), scales near 1 (finite products).
  // (Only where every product's inputs are whole blocks of 32.)
  const bool mxfp4 = hidden % shardserve::kMxfp4BlockSize == 0 && mlp % shardserve::kMxfp4BlockSize == 0;
  if (mxfp4) kernels.push_back({"mxfp4 panels", WeightQuant::kMxfp4, std::nullopt, 17.0 / 32});
  if (mxfp4 && shardserve::cpu::ActiveQuantIsa() == QuantIsa::kAvx512) {
    kernels.push_back({"mxfp4 panels avx2", WeightQuant::kMxfp4, QuantIsa::kAvx2, 17.0 / 32});
  }
  // The products a worker runs under --activation-quantization int8 (VNNI's, else AVX2's), packed and
  // run by a backend made as that worker makes its own.
  const std::optional<QuantIsa> act8_isa = shardserve::cpu::Int8ActivationsIsa();
  std::unique_ptr<Backend> act8_backend;
  if (act8_isa.has_value()) {
    act8_backend = *shardserve::MakeCpuBackend(threads, shardserve::CpuMatMul::kF32, shardserve::CpuActivationQuant::kInt8);
    for (WeightQuant q : {WeightQuant::kInt8, WeightQuant::kInt4}) {
      kernels.push_back({absl::StrCat(shardserve::WeightQuantName(q), " ", shardserve::cpu::QuantIsaName(*act8_isa)), q,
                         std::nullopt, q == WeightQuant::kInt4 ? 72.0 / 128 : 1.0, std::nullopt, std::nullopt, true});
    }
  }
  struct Weight {
    Shape shape;
    std::unique_ptr<OneDnnProduct> onednn;
    std::map<WeightQuant, std::pair<Buffer, Tensor>> packed;  // kNone: float32 panels
    std::map<WeightQuant, std::pair<Buffer, Tensor>> act8;    // int8 and int4, packed by act8_backend
    std::pair<Buffer, Tensor> bf16;                           // where the CPU has bf16 products
    std::vector<float> plain;                                 // w itself ("f32 plain w": packed per product)
    std::vector<uint8_t> int8_rows, fp8_rows;                 // where the backend packs them as panels
    std::vector<shardserve::Int4Group128> int4_blocks;         // where the backend packs int4 as panels
    std::vector<shardserve::cpu::Int4PanelGroup> int4_octets;  // those panels in int16 activations' order
  };
  std::vector<Weight> weights;
  std::map<WeightQuant, double> pack_seconds;  // the backend's packing (quantization) of every weight, per format
  for (int64_t l = 0; l < layers; ++l) {
    for (const Shape& s : layer) {
      std::vector<float> w(static_cast<size_t>(s.m * s.k));
      for (float& v : w) v = dist(rng);
      Weight weight{s, std::make_unique<OneDnnProduct>(engine, w.data(), s.m, s.k), {}, {}, {}, w, {}, {}, {}, {}};
      for (WeightQuant q : {WeightQuant::kNone, WeightQuant::kInt8, WeightQuant::kFp8, WeightQuant::kInt4}) {
        Tensor packed;
        const auto t0 = std::chrono::steady_clock::now();
        auto buffer = backend->PackMatMulWeight(Tensor(w.data(), DType::kF32, {s.m, s.k}), &packed, q);
        pack_seconds[q] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (!buffer.ok()) {
          std::fprintf(stderr, "bench_matmul: %s\n", std::string(buffer.status().message()).c_str());
          return 1;
        }
        weight.packed[q] = {std::move(*buffer), packed};
        if (act8_backend != nullptr && (q == WeightQuant::kInt8 || q == WeightQuant::kInt4)) {
          Tensor packed_act8;
          auto buffer_act8 = act8_backend->PackMatMulWeight(Tensor(w.data(), DType::kF32, {s.m, s.k}), &packed_act8, q);
          if (!buffer_act8.ok()) {
            std::fprintf(stderr, "bench_matmul: %s\n", std::string(buffer_act8.status().message()).c_str());
            return 1;
          }
          weight.act8[q] = {std::move(*buffer_act8), packed_act8};
        }
      }
      if (mxfp4) {
        std::vector<uint8_t> stored(static_cast<size_t>(shardserve::Mxfp4RowsLayout{s.m, s.k}.bytes()));
        const int64_t codes = shardserve::Mxfp4RowsLayout{s.m, s.k}.code_bytes();
        for (int64_t i = 0; i < static_cast<int64_t>(stored.size()); ++i) {
          stored[i] = static_cast<uint8_t>(i < codes ? rng() & 0xFF : 120 + rng() % 8);
        }
        Tensor packed;
        const auto t0 = std::chrono::steady_clock::now();
        auto buffer = backend->PackQuantizedWeight(WeightQuant::kMxfp4, stored.data(), s.m, s.k, &packed);
        pack_seconds[WeightQuant::kMxfp4] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (!buffer.ok()) {
          std::fprintf(stderr, "bench_matmul: %s\n", std::string(buffer.status().message()).c_str());
          return 1;
        }
        weight.packed[WeightQuant::kMxfp4] = {std::move(*buffer), packed};
      }
      if (panels) {
        weight.int8_rows.resize(static_cast<size_t>(shardserve::Int8RowsLayout{s.m, s.k}.bytes()));
        weight.fp8_rows.resize(static_cast<size_t>(shardserve::Fp8RowsLayout{s.m, s.k}.bytes()));
        weight.int4_blocks.resize(static_cast<size_t>(s.m * shardserve::Int4GroupsLayout{s.m, s.k}.groups_per_row()));
        for (auto [q, to] : {std::pair<WeightQuant, void*>{WeightQuant::kInt8, weight.int8_rows.data()},
                             {WeightQuant::kFp8, weight.fp8_rows.data()},
                             {WeightQuant::kInt4, weight.int4_blocks.data()}}) {
          if (absl::Status st = shardserve::QuantizeWeight(q, to, w.data(), s.m, s.k); !st.ok()) {
            std::fprintf(stderr, "bench_matmul: %s\n", std::string(st.message()).c_str());
            return 1;
          }
        }
      }
      if (int16_panels) {
        weight.int4_octets.resize(static_cast<size_t>(shardserve::cpu::Int4PanelGroupCount(s.m, s.k)));
        shardserve::cpu::PackPanelsInt4(weight.int4_octets.data(), weight.int4_blocks.data(), s.m, s.k,
                                        shardserve::cpu::Int4CodeOrder::kOctets);
      }
      if (bf16) {
        Tensor packed;
        auto buffer = bf16_backend->PackMatMulWeight(Tensor(w.data(), DType::kF32, {s.m, s.k}), &packed);
        if (!buffer.ok()) {
          std::fprintf(stderr, "bench_matmul: %s\n", std::string(buffer.status().message()).c_str());
          return 1;
        }
        weight.bf16 = {std::move(*buffer), packed};
      }
      weights.push_back(std::move(weight));
    }
  }
  const int64_t max_rows = std::max<int64_t>(256, flags->at("max-rows")), widest = std::max({hidden, kv, mlp});
  std::vector<float> x(static_cast<size_t>(max_rows * widest)), y(static_cast<size_t>(max_rows * widest));
  for (float& v : x) v = dist(rng);

  const auto run = [&](const Kernel& kernel, Weight& w, float* out, int64_t n) {
    if (kernel.name == "f32 oneDNN") {
      omp_set_num_threads(threads);
      w.onednn->Run(stream, out, x.data(), n);
      return;
    }
    if (panels && kernel.quant == WeightQuant::kInt4 && kernel.isa.has_value()) {  // the blocks' instances
      shardserve::cpu::Int4MatMul(out, x.data(), n, w.shape.m, w.shape.k, w.int4_blocks.data(), nullptr, threads, *kernel.isa);
      return;
    }
    const int64_t scale_bytes = shardserve::Int8RowsLayout{w.shape.m, w.shape.k}.scale_bytes();  // fp8's too
    if (panels && kernel.quant != WeightQuant::kInt4 && kernel.quant != WeightQuant::kMxfp4 &&
        kernel.isa.has_value()) {  // the rows' instances
      const std::vector<uint8_t>& rows = kernel.quant == WeightQuant::kInt8 ? w.int8_rows : w.fp8_rows;
      const auto* scale = reinterpret_cast<const float*>(rows.data());
      if (kernel.quant == WeightQuant::kInt8) {
        shardserve::cpu::Int8MatMul(out, x.data(), n, w.shape.m, w.shape.k,
                                    reinterpret_cast<const int8_t*>(rows.data() + scale_bytes), scale, nullptr, threads,
                                    *kernel.isa);
      } else {
        shardserve::cpu::Fp8MatMul(out, x.data(), n, w.shape.m, w.shape.k, rows.data() + scale_bytes, scale, nullptr,
                                   threads, *kernel.isa);
      }
      return;
    }
    if (kernel.name == "int4 panels int16") {
      shardserve::cpu::PanelMatMulInt4Act16(out, x.data(), n, w.shape.m, w.shape.k, w.int4_octets.data(), nullptr,
                                            threads);
      return;
    }
    if (kernel.name == "int8 panels avx2") {
      const Tensor& packed = w.packed[kernel.quant].second;
      shardserve::cpu::PanelMatMulInt8(out, x.data(), n, w.shape.m, w.shape.k,
                                       static_cast<const uint8_t*>(packed.data) + scale_bytes,
                                       static_cast<const float*>(packed.data), nullptr, threads, PanelTiles::kVec8);
      return;
    }
    shardserve::cpu::SetQuantIsaOverride(kernel.isa);
    shardserve::cpu::SetPanelTilesOverride(kernel.tiles);
    const bool is_bf16 = kernel.name.rfind("bf16", 0) == 0;
    if (is_bf16) shardserve::cpu::SetBf16BlockedRowsOverride(kernel.bf16_rows);
    Tensor tx(x.data(), DType::kF32, {n, w.shape.k}), ty(out, DType::kF32, {n, w.shape.m});
    const Tensor plain(w.plain.data(), DType::kF32, {w.shape.m, w.shape.k});
    const Tensor& tw = kernel.name == "f32 plain w" ? plain
                       : kernel.act8           ? w.act8[kernel.quant].second
                                               : w.packed[kernel.quant].second;
    Backend* by = is_bf16 ? bf16_backend.get() : kernel.act8 ? act8_backend.get() : backend.get();
    if (absl::Status s = by->MatMul(&ty, tx, is_bf16 ? w.bf16.second : tw, nullptr); !s.ok()) {
      std::fprintf(stderr, "bench_matmul: %s\n", std::string(s.message()).c_str());
      std::exit(1);
    }
  };
  // The first weight's products of all max_rows rows, to compare each row count's rows with.
  const Shape first = weights[0].shape;
  std::vector<std::vector<float>> all(kernels.size(), std::vector<float>(static_cast<size_t>(max_rows * first.m)));
  for (size_t i = 0; i < kernels.size(); ++i) run(kernels[i], weights[0], all[i].data(), max_rows);

  shardserve::cpu::SetQuantIsaOverride(std::nullopt);  // the description says what the backend picks
  std::printf("one stage: %lld layers, %.1fM parameters of products, %d thread(s), median of %d; %s\n",
              static_cast<long long>(layers), params / 1e6, threads, repeat,
              shardserve::cpu::QuantizedKernelsDescription().c_str());
  std::printf("packing the weights (load time; quantizing: kernels/quant.h QuantizeWeight):");
  for (const auto& [q, seconds] : pack_seconds) {
    std::printf(" %s %.0f ms (%.0fM weights/s)", q == WeightQuant::kNone ? "f32 panels" : WeightQuantName(q),
                seconds * 1e3, params / seconds / 1e6);
  }
  std::printf("\n");
  std::printf("%6s  %-16s %10s %8s %8s %8s %8s %6s %7s %9s\n", "rows", "kernel", "ms", "min ms", "cpu ms", "GFLOP/s",
              "w GB/s", "same", "vs f32", "cpu/wall");
  for (int64_t n = 1; n <= flags->at("max-rows"); n *= 2) {
    std::vector<std::vector<double>> t(kernels.size());
    std::vector<double> cpu(kernels.size(), 0), wall(kernels.size(), 0);
    for (int r = 0; r < repeat; ++r) {
      for (size_t i = 0; i < kernels.size(); ++i) {
        const double c0 = CpuSeconds();
        const auto t0 = std::chrono::steady_clock::now();
        for (Weight& w : weights) run(kernels[i], w, y.data(), n);
        const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        t[i].push_back(dt);
        wall[i] += dt;
        cpu[i] += CpuSeconds() - c0;
      }
    }
    const double f32 = Percentile(t[0], 50), flops = 2.0 * static_cast<double>(n) * params;
    for (size_t i = 0; i < kernels.size(); ++i) {
      std::vector<float> part(static_cast<size_t>(n * first.m));
      run(kernels[i], weights[0], part.data(), n);
      const bool same = std::memcmp(part.data(), all[i].data(), part.size() * sizeof(float)) == 0;
      const double a = Percentile(t[i], 50), least = *std::min_element(t[i].begin(), t[i].end());
      std::printf("%6lld  %-16s %10.2f %8.2f %8.2f %8.1f %8.1f %6s %6.2fx %9.2f\n", static_cast<long long>(n),
                  kernels[i].name.c_str(), a * 1e3, least * 1e3, cpu[i] / repeat * 1e3, flops / a / 1e9,
                  params * kernels[i].bytes_per_param / a / 1e9, same ? "yes" : "NO", f32 / a, cpu[i] / wall[i]);
    }
  }
  shardserve::cpu::SetQuantIsaOverride(std::nullopt);
  shardserve::cpu::SetBf16BlockedRowsOverride(std::nullopt);
  return 0;
}
