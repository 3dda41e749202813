// bench_attention: the CPU backend's paged attention (Backend::Attention) on the shapes serving
// gives it: a decode step of `--seqs` sequences (one token each) and a prefill chunk of one
// sequence, over a cache filled with random values, for every layer of one worker. Reports medians
// of `--repeat` runs, and an FNV-1a hash of each case's output bits, so two builds (two kernel
// versions) can be timed alternately and checked to give bitwise the same attention.
//
//   bench_attention [--threads 1] [--layers 12] [--q-heads 12] [--kv-heads 4] [--head-dim 64]
//                   [--seqs 32] [--context 192] [--prefill 128] [--repeat 9]
//
// Defaults: the benchmark model (tools/fixtures/make_bench_model.py) on one thread; a decode step of 32
// streams at context 192 (the middle of a 128-in, 128-out request) and a 128-token prefill.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/tensor.h"
#include "tools/bench/bench_util.h"
#include "tools/cli/bench_stats.h"

namespace {

using shardserve::Backend;
using shardserve::DType;
using shardserve::Tensor;
using shardserve::cli::Percentile;

constexpr int64_t kBlockSize = 16;  // tokens per KV block, as the worker's default (worker/shard/model_shard.h)

uint64_t Fnv1a(const std::vector<float>& v) {
  uint64_t h = 14695981039346656037ULL;
  const auto* bytes = reinterpret_cast<const unsigned char*>(v.data());
  for (size_t i = 0; i < v.size() * sizeof(float); ++i) h = (h ^ bytes[i]) * 1099511628211ULL;
  return h;
}

// One attention case: n tokens with their positions and sequences, block tables, and q.
struct Case {
  const char* name = "";
  std::vector<int32_t> positions, token_seq, tables;
  int64_t seqs = 0, max_blocks = 0;
  double flops = 0;  // multiply-adds of q.k and p.v, times 2
};

}  // namespace

int main(int argc, char** argv) {
  const std::optional<std::map<std::string, int64_t>> flags = shardserve::bench::PositiveIntFlagsOrUsage(
      "bench_attention",
      "usage: bench_attention [--threads N] [--layers L] [--q-heads H] [--kv-heads KV] [--head-dim D] [--seqs S] "
      "[--context C] [--prefill P] [--repeat R]\n",
      argc, argv,
      {{"threads", 1}, {"layers", 12}, {"q-heads", 12}, {"kv-heads", 4}, {"head-dim", 64}, {"seqs", 32},
       {"context", 192}, {"prefill", 128}, {"repeat", 9}});
  if (!flags) return 2;
  const int threads = static_cast<int>(flags->at("threads")), repeat = static_cast<int>(flags->at("repeat"));
  const int64_t layers = flags->at("layers"), q_heads = flags->at("q-heads"), kv_heads = flags->at("kv-heads");
  const int64_t head_dim = flags->at("head-dim"), seqs = flags->at("seqs"), context = flags->at("context");
  const int64_t prefill = flags->at("prefill");
  if (q_heads % kv_heads != 0) {
    std::fprintf(stderr, "bench_attention: --q-heads must be a multiple of --kv-heads\n");
    return 2;
  }
  omp_set_num_threads(threads);
  std::unique_ptr<Backend> backend = shardserve::MakeCpuBackend(threads, shardserve::CpuMatMul::kF32);

  // Decode: sequence s holds `context` tokens (its new one at position context - 1), in blocks laid
  // out one sequence after another. Prefill: one sequence's first `prefill` tokens.
  auto blocks_for = [](int64_t tokens) { return (tokens + kBlockSize - 1) / kBlockSize; };
  Case decode, chunk;
  decode.name = "decode";
  chunk.name = "prefill";
  decode.seqs = seqs;
  decode.max_blocks = blocks_for(context);
  for (int64_t s = 0; s < seqs; ++s) {
    decode.positions.push_back(static_cast<int32_t>(context - 1));
    decode.token_seq.push_back(static_cast<int32_t>(s));
    for (int64_t b = 0; b < decode.max_blocks; ++b) decode.tables.push_back(static_cast<int32_t>(s * decode.max_blocks + b));
  }
  decode.flops = 4.0 * static_cast<double>(seqs * context * q_heads * head_dim);
  chunk.seqs = 1;
  chunk.max_blocks = blocks_for(prefill);
  for (int64_t t = 0; t < prefill; ++t) {
    chunk.positions.push_back(static_cast<int32_t>(t));
    chunk.token_seq.push_back(0);
    chunk.flops += 4.0 * static_cast<double>((t + 1) * q_heads * head_dim);
  }
  for (int64_t b = 0; b < chunk.max_blocks; ++b) chunk.tables.push_back(static_cast<int32_t>(b));

  // One cache per layer (so that, as in a worker, each layer's cache streams from memory).
  const int64_t cache_blocks = std::max(decode.seqs * decode.max_blocks, chunk.max_blocks);
  const int64_t cache_floats = cache_blocks * kBlockSize * kv_heads * head_dim;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<std::vector<float>> k_caches(layers), v_caches(layers);
  for (int64_t l = 0; l < layers; ++l) {
    k_caches[l].resize(static_cast<size_t>(cache_floats));
    v_caches[l].resize(static_cast<size_t>(cache_floats));
    for (float& x : k_caches[l]) x = dist(rng);
    for (float& x : v_caches[l]) x = dist(rng);
  }
  const int64_t widest = std::max(seqs, prefill) * q_heads * head_dim;
  std::vector<float> q(static_cast<size_t>(widest)), out(static_cast<size_t>(widest));
  for (float& x : q) x = dist(rng);
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));

  // Every layer's attention for one case; the output is the last layer's.
  auto run = [&](Case& c) {
    const auto n = static_cast<int64_t>(c.positions.size());
    const Tensor tq(q.data(), DType::kF32, {n, q_heads * head_dim});
    Tensor tout(out.data(), DType::kF32, {n, q_heads * head_dim});
    const Tensor pos(c.positions.data(), DType::kI32, {n}), seq(c.token_seq.data(), DType::kI32, {n});
    const Tensor tables(c.tables.data(), DType::kI32, {c.seqs, c.max_blocks});
    for (int64_t l = 0; l < layers; ++l) {
      const Tensor kc(k_caches[l].data(), DType::kF32, {cache_blocks, kBlockSize, kv_heads, head_dim});
      const Tensor vc(v_caches[l].data(), DType::kF32, {cache_blocks, kBlockSize, kv_heads, head_dim});
      if (absl::Status s = backend->Attention(&tout, tq, kc, vc, pos, seq, tables, scale); !s.ok()) {
        std::fprintf(stderr, "bench_attention: %s\n", std::string(s.message()).c_str());
        std::exit(1);
      }
    }
    return std::vector<float>(out.begin(), out.begin() + n * q_heads * head_dim);
  };

  std::printf("%s; %lld layers, %lld query heads, %lld kv heads, head_dim %lld, median of %d\n",
              backend->Describe().c_str(), static_cast<long long>(layers), static_cast<long long>(q_heads),
              static_cast<long long>(kv_heads), static_cast<long long>(head_dim), repeat);
  std::printf("%-8s %6s %8s  %10s %8s  %s\n", "case", "tokens", "context", "ms", "GFLOP/s", "output hash");
  for (Case* c : {&decode, &chunk}) {
    const uint64_t hash = Fnv1a(run(*c));  // also warms up
    std::vector<double> times;
    for (int r = 0; r < repeat; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      run(*c);
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    const double t = Percentile(times, 50);
    const int64_t longest = c == &decode ? context : prefill;
    std::printf("%-8s %6zu %8lld  %10.3f %8.2f  %016llx\n", c->name, c->positions.size(),
                static_cast<long long>(longest), t * 1e3, c->flops * static_cast<double>(layers) / t / 1e9,
                static_cast<unsigned long long>(hash));
  }
  return 0;
}
