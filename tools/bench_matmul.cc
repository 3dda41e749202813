// bench_matmul: the CPU backend's float32 matrix products (kernels/cpu/panel_matmul.h) beside
// oneDNN's matmul as the backend used it before (weights reordered once into the layout oneDNN
// picks, one primitive per row count), over the weights of one pipeline stage, side by side in one
// run: for each row count, the two alternate `--repeat` times and the medians are reported.
// Also says, per row count, whether each one's rows equal the same rows of a 512-row product
// (bitwise), the property continuous batching needs. A third column times the backend's products
// by the same weights quantized to int8 (--quantization int8: kernels/cpu/int8_matmul.h) and a
// fourth to int4 (--quantization int4: kernels/cpu/int4_matmul.h), with the weight bytes per
// second each product reads (4 per parameter for float32, 1 for int8, 72 / 128 for int4).
//
//   bench_matmul [--threads 1] [--layers 6] [--hidden 768] [--kv 256] [--mlp 2048] [--repeat 7]
//
// Defaults: one PP=2 stage of the benchmark model (tools/make_bench_model.py), one thread (what
// each of two PP=2 workers gets on a 2-core machine). Random weights and inputs in [-0.05, 0.05].
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/tensor.h"
#include "tools/bench_util.h"
#include "tools/cli/bench_stats.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace {

using shardserve::Backend;
using shardserve::Buffer;
using shardserve::DType;
using shardserve::Tensor;
using shardserve::cli::Percentile;

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

}  // namespace

int main(int argc, char** argv) {
  const std::optional<std::map<std::string, int64_t>> flags = shardserve::bench::PositiveIntFlagsOrUsage(
      "bench_matmul", "usage: bench_matmul [--threads N] [--layers L] [--hidden H] [--kv KV] [--mlp I] [--repeat R]\n",
      argc, argv, {{"threads", 1}, {"layers", 6}, {"hidden", 768}, {"kv", 256}, {"mlp", 2048}, {"repeat", 7}});
  if (!flags) return 2;
  const int threads = static_cast<int>(flags->at("threads")), repeat = static_cast<int>(flags->at("repeat"));
  const int64_t layers = flags->at("layers"), hidden = flags->at("hidden"), kv = flags->at("kv"), mlp = flags->at("mlp");
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
  const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-0.05f, 0.05f);
  struct Weight {
    Shape shape;
    Buffer buffer;
    Tensor packed;
    std::unique_ptr<OneDnnProduct> onednn;
    Buffer int8_buffer;
    Tensor int8;
    Buffer int4_buffer;
    Tensor int4;
  };
  std::vector<Weight> weights;
  for (int64_t l = 0; l < layers; ++l) {
    for (const Shape& s : layer) {
      std::vector<float> w(static_cast<size_t>(s.m * s.k));
      for (float& v : w) v = dist(rng);
      Weight weight{s, {}, {}, std::make_unique<OneDnnProduct>(engine, w.data(), s.m, s.k), {}, {}, {}, {}};
      auto buffer = backend->PackMatMulWeight(Tensor(w.data(), DType::kF32, {s.m, s.k}), &weight.packed);
      if (!buffer.ok()) {
        std::fprintf(stderr, "bench_matmul: %s\n", std::string(buffer.status().message()).c_str());
        return 1;
      }
      weight.buffer = std::move(*buffer);
      auto int8 = backend->PackMatMulWeight(Tensor(w.data(), DType::kF32, {s.m, s.k}), &weight.int8,
                                            shardserve::WeightQuant::kInt8);
      if (!int8.ok()) {
        std::fprintf(stderr, "bench_matmul: %s\n", std::string(int8.status().message()).c_str());
        return 1;
      }
      weight.int8_buffer = std::move(*int8);
      auto int4 = backend->PackMatMulWeight(Tensor(w.data(), DType::kF32, {s.m, s.k}), &weight.int4,
                                            shardserve::WeightQuant::kInt4);
      if (!int4.ok()) {
        std::fprintf(stderr, "bench_matmul: %s\n", std::string(int4.status().message()).c_str());
        return 1;
      }
      weight.int4_buffer = std::move(*int4);
      weights.push_back(std::move(weight));
    }
  }
  const int64_t max_rows = 512, widest = std::max({hidden, kv, mlp});
  std::vector<float> x(static_cast<size_t>(max_rows * widest)), y(static_cast<size_t>(max_rows * widest));
  for (float& v : x) v = dist(rng);

  // The first weight's products of all 512 rows, to compare each row count's rows with.
  const Shape first = weights[0].shape;
  // quant: 0 float32 panels, 8 int8, 4 int4.
  auto ours = [&](const Weight& w, float* out, int64_t n, int quant = 0) {
    Tensor tx(x.data(), DType::kF32, {n, w.shape.k}), ty(out, DType::kF32, {n, w.shape.m});
    if (absl::Status s = backend->MatMul(&ty, tx, quant == 8 ? w.int8 : quant == 4 ? w.int4 : w.packed, nullptr);
        !s.ok()) {
      std::fprintf(stderr, "bench_matmul: %s\n", std::string(s.message()).c_str());
      std::exit(1);
    }
  };
  std::vector<float> ours_all(static_cast<size_t>(max_rows * first.m)), onednn_all(ours_all.size()),
      int8_all(ours_all.size()), int4_all(ours_all.size());
  ours(weights[0], ours_all.data(), max_rows);
  ours(weights[0], int8_all.data(), max_rows, 8);
  ours(weights[0], int4_all.data(), max_rows, 4);
  weights[0].onednn->Run(stream, onednn_all.data(), x.data(), max_rows);

  std::printf("one stage: %lld layers, %.1fM parameters of products, %d thread(s), median of %d\n",
              static_cast<long long>(layers), params / 1e6, threads, repeat);
  std::printf("%6s  %12s %8s %6s  %12s %8s %6s  %7s  %10s %7s %6s %7s  %10s %7s %6s %7s\n", "rows", "panels ms",
              "GFLOP/s", "same", "oneDNN ms", "GFLOP/s", "same", "speedup", "int8 ms", "w GB/s", "same", "vs f32",
              "int4 ms", "w GB/s", "same", "vs f32");
  for (int64_t n : {1, 2, 4, 8, 16, 32, 64, 128, 512}) {
    std::vector<double> t_ours, t_onednn, t_int8, t_int4;
    for (int r = 0; r < repeat; ++r) {
      for (int which = 0; which < 4; ++which) {
        const auto t0 = std::chrono::steady_clock::now();
        for (Weight& w : weights) {
          if (which == 1) {
            w.onednn->Run(stream, y.data(), x.data(), n);
          } else {
            ours(w, y.data(), n, which == 2 ? 8 : which == 3 ? 4 : 0);
          }
        }
        (which == 0 ? t_ours : which == 1 ? t_onednn : which == 2 ? t_int8 : t_int4)
            .push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
    }
    std::vector<float> part(static_cast<size_t>(n * first.m));
    ours(weights[0], part.data(), n);
    const bool ours_same = std::memcmp(part.data(), ours_all.data(), part.size() * sizeof(float)) == 0;
    weights[0].onednn->Run(stream, part.data(), x.data(), n);
    const bool onednn_same = std::memcmp(part.data(), onednn_all.data(), part.size() * sizeof(float)) == 0;
    ours(weights[0], part.data(), n, 8);
    const bool int8_same = std::memcmp(part.data(), int8_all.data(), part.size() * sizeof(float)) == 0;
    ours(weights[0], part.data(), n, 4);
    const bool int4_same = std::memcmp(part.data(), int4_all.data(), part.size() * sizeof(float)) == 0;
    const double a = Percentile(t_ours, 50), b = Percentile(t_onednn, 50), c = Percentile(t_int8, 50),
                 d = Percentile(t_int4, 50), flops = 2.0 * static_cast<double>(n) * params;
    std::printf("%6lld  %12.2f %8.1f %6s  %12.2f %8.1f %6s  %6.2fx  %10.2f %7.1f %6s %6.2fx  %10.2f %7.1f %6s %6.2fx\n",
                static_cast<long long>(n), a * 1e3, flops / a / 1e9, ours_same ? "yes" : "NO", b * 1e3,
                flops / b / 1e9, onednn_same ? "yes" : "NO", b / a, c * 1e3, params / c / 1e9,
                int8_same ? "yes" : "NO", a / c, d * 1e3, params * 72 / 128 / d / 1e9, int4_same ? "yes" : "NO",
                a / d);
  }
  return 0;
}
