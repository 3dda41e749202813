// The split of a mixture-of-experts layer's experts (worker/shard/expert_plan.h) on random data:
// expert parallelism (each rank of a Gloo group of 2 or 3 threads holds a block of whole experts;
// its slice of the tokens dispatched to their experts' ranks and back by all-to-all, then
// all-gathered) against the experts cut over the same group (each rank a slice of every expert's
// intermediate size, one all-reduce), and in a group of one (where the flag changes nothing), for
// step sizes that leave ranks with uneven slices of the tokens or with none. The block around the plan is MoeMlp's (worker/shard/decoder.cc): route,
// group by expert, gather, Dispatch, SwiGLU per expert, Return, combine, Join.
//
// Tolerance: float32 throughout. With whole experts each token's output is the same sum as on one
// rank (bit for bit, checked against a group of one); with cut experts down_proj's partial sums are
// added by the all-reduce in another order, which moves values of magnitude ~1 by a few ulps:
// 1e-5 relative to the largest output, with random data scaled so that outputs are O(1).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "model/sharding.h"
#include "worker/comm/gloo_communicator.h"
#include "worker/comm/rendezvous.h"
#include "worker/communicator.h"
#include "worker/shard/expert_plan.h"

namespace shardserve {
namespace {

constexpr int64_t H = 16, I = 24, k = 2;

// A layer's weights, whole, on the host.
struct Experts {
  int64_t E = 0;
  std::vector<float> router;               // [E, H]
  std::vector<std::vector<float>> gate, up, down;  // per expert [I, H], [I, H], [H, I]
};

Experts RandomExperts(int64_t E, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  auto fill = [&](int64_t count, float scale) {
    std::vector<float> v(count);
    for (float& x : v) x = d(rng) * scale;
    return v;
  };
  Experts x;
  x.E = E;
  x.router = fill(E * H, 1.0f);
  for (int64_t e = 0; e < E; ++e) {
    x.gate.push_back(fill(I * H, 0.3f));
    x.up.push_back(fill(I * H, 0.3f));
    x.down.push_back(fill(H * I, 0.3f));
  }
  return x;
}

// Memory for tensors of one rank, kept alive with it.
struct Arena {
  std::vector<std::unique_ptr<std::vector<char>>> blocks;
  std::vector<Buffer> packed;
  Tensor Alloc(DType dtype, std::initializer_list<int64_t> dims) {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    blocks.push_back(std::make_unique<std::vector<char>>(std::max<int64_t>(n, 1) * DTypeSize(dtype)));
    return Tensor(blocks.back()->data(), dtype, dims);
  }
  Tensor Weight(Backend& be, const std::vector<float>& host, int64_t rows, int64_t cols) {
    Tensor plain = Alloc(DType::kF32, {rows, cols});
    std::copy(host.begin(), host.end(), plain.as<float>());
    Tensor w;
    absl::StatusOr<Buffer> b = be.PackMatMulWeight(plain, &w);
    EXPECT_TRUE(b.ok()) << b.status();
    packed.push_back(std::move(*b));
    return w;
  }
};

// Rows [begin, end) or columns of a row-major [rows, cols] matrix.
std::vector<float> RowsOf(const std::vector<float>& m, int64_t cols, Range r) {
  return std::vector<float>(m.begin() + r.begin * cols, m.begin() + r.end * cols);
}
std::vector<float> ColsOf(const std::vector<float>& m, int64_t rows, int64_t cols, Range c) {
  std::vector<float> out;
  for (int64_t i = 0; i < rows; ++i) out.insert(out.end(), m.begin() + i * cols + c.begin, m.begin() + i * cols + c.end);
  return out;
}

// One rank's MoE output [n, H] for the hidden states x [n, H], under `expert_parallel` or with the
// experts cut, over `comm`. The steps of DecoderBlocks::MoeMlp (Qwen3-MoE's routing).
std::vector<float> RunMoe(Communicator& comm, bool expert_parallel, const Experts& x, const std::vector<float>& hidden,
                          int64_t n, int64_t max_n) {
  std::unique_ptr<Backend> backend = MakeCpuBackend(1);
  Backend& be = *backend;
  const int t = comm.size(), r = comm.rank();
  const int64_t E = x.E, nk = max_n * k, c = (max_n + t - 1) / t;
  ExpertPlan plan{.group = &comm, .expert_parallel = expert_parallel, .num_experts = E,
                  .experts = expert_parallel ? ExpertRange(E, r, t) : Range{0, E}};
  // This rank's weights: its experts whole, or its slice of every expert's intermediate size.
  const Range f = expert_parallel ? Range{0, I} : Range{r * I / t, (r + 1) * I / t};
  Arena a;
  const Tensor router = a.Weight(be, x.router, E, H);
  std::vector<Tensor> gate(E), up(E), down(E);
  for (int64_t e = plan.experts.begin; e < plan.experts.end; ++e) {
    gate[e] = a.Weight(be, RowsOf(x.gate[e], H, f), f.size(), H);
    up[e] = a.Weight(be, RowsOf(x.up[e], H, f), f.size(), H);
    down[e] = a.Weight(be, ColsOf(x.down[e], H, I, f), H, f.size());
  }
  MoeScratch m;
  m.router_logits = a.Alloc(DType::kF32, {max_n, E});
  m.ids = a.Alloc(DType::kI32, {max_n, k});
  m.weights = a.Alloc(DType::kF32, {max_n, k});
  m.order = a.Alloc(DType::kI32, {nk});
  m.rows = a.Alloc(DType::kI32, {max_n, k});
  m.offsets = a.Alloc(DType::kI32, {E + 1});
  m.row_counts = a.Alloc(DType::kI32, {E});
  std::fill_n(m.row_counts.as<int32_t>(), E, 0);
  m.tokens = a.Alloc(DType::kI32, {nk});
  m.in = a.Alloc(DType::kF32, {nk, H});
  m.gate = a.Alloc(DType::kF32, {nk, f.size()});
  m.up = a.Alloc(DType::kF32, {nk, f.size()});
  m.out = a.Alloc(DType::kF32, {nk, H});
  m.all_offsets = a.Alloc(DType::kI32, {t, E + 1});
  m.exchanged = a.Alloc(DType::kF32, {nk, H});
  m.regroup = a.Alloc(DType::kI32, {nk});
  m.ungroup = a.Alloc(DType::kI32, {nk});
  m.gathered = a.Alloc(DType::kF32, {t * c, H});
  MoeHostScratch host;
  host.all_offsets.resize(t * (E + 1));
  host.local_offsets.resize(E + 1);
  host.regroup.resize(nk);
  host.ungroup.resize(nk);
  host.send_rows.resize(t);
  host.recv_rows.resize(t);
  Tensor normed = a.Alloc(DType::kF32, {n, H}), proj_all = a.Alloc(DType::kF32, {n, H});
  std::copy(hidden.begin(), hidden.end(), normed.as<float>());
  MoeRouting routing;
  routing.router = MoeRouter::kSoftmaxTopK;
  routing.k = static_cast<int>(k);
  routing.norm_topk_prob = true;

  auto run = [&]() -> absl::Status {
    const Range tokens = plan.TokenRows(n);
    const int64_t nl = tokens.size(), nlk = nl * k;
    const Tensor h = normed.Rows(tokens.begin, tokens.end);
    Tensor proj = proj_all.Rows(0, nl), logits = m.router_logits.Rows(0, nl), ids = m.ids.Rows(0, nl),
           weights = m.weights.Rows(0, nl), order = m.order.Rows(0, nlk), rows = m.rows.Rows(0, nl);
    if (absl::Status s = be.MatMul(&logits, h, router, nullptr); !s.ok()) return s;
    if (absl::Status s = be.MoeRoute(&ids, &weights, logits, routing); !s.ok()) return s;
    Tensor token_ids = m.tokens.Rows(0, nlk), in = m.in.Rows(0, nlk);
    if (absl::Status s = be.MoeGroupByExpert(&order, &rows, &m.offsets, &token_ids, ids); !s.ok()) return s;
    if (absl::Status s = be.Embedding(&in, h, token_ids, 0); !s.ok()) return s;
    ExpertRows local;
    if (absl::Status s = plan.Dispatch(be, m, host, nlk, &local); !s.ok()) return s;
    if (absl::Status s = be.MoeCountRows(&m.row_counts, local.offsets, plan.experts.begin, plan.experts.end);
        !s.ok()) {
      return s;
    }
    const int64_t rows_here = local.in.dim(0);
    Tensor g = m.gate.Rows(0, rows_here), u = m.up.Rows(0, rows_here);
    const MoeExpertWeights w{
        .gate_proj = gate, .up_proj = up, .down_proj = down, .begin = plan.experts.begin, .end = plan.experts.end};
    if (absl::Status s = be.MoeExperts(&local.out, &g, &u, local.in, local.offsets, w); !s.ok()) return s;
    Tensor expert_out;
    if (absl::Status s = plan.Return(be, m, host, local, nlk, &expert_out); !s.ok()) return s;
    if (absl::Status s = be.MoeCombine(&proj, expert_out, rows, weights); !s.ok()) return s;
    return plan.Join(be, m, &proj_all);
  };
  const absl::Status s = run();
  EXPECT_TRUE(s.ok()) << "rank " << r << ": " << s;
  // Every row of this step counted once over the group with whole experts, on every rank when cut.
  uint64_t counted = 0;
  for (int64_t e = 0; e < E; ++e) counted += m.row_counts.as<int32_t>()[e];
  if (!expert_parallel) {
    EXPECT_EQ(counted, static_cast<uint64_t>(n * k));
  }
  return std::vector<float>(proj_all.as<float>(), proj_all.as<float>() + n * H);
}

// Runs fn(comm) on every rank of a Gloo group of `size` threads; returns rank 0's result and checks
// every rank got the same.
std::vector<float> OnGloo(int size, const std::string& name,
                          const std::function<std::vector<float>(Communicator& comm)>& fn) {
  InMemoryRendezvousStore store;
  std::vector<std::vector<float>> results(size);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      absl::StatusOr<std::unique_ptr<Communicator>> comm =
          MakeGlooCommunicator(&store, name, rank, size, "127.0.0.1", absl::Seconds(60));
      ASSERT_TRUE(comm.ok()) << comm.status();
      results[rank] = fn(**comm);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int rank = 1; rank < size; ++rank) EXPECT_EQ(results[rank], results[0]) << "rank " << rank << " differs";
  return results[0];
}

struct Case {
  int ranks;
  int64_t experts;
  int64_t n;  // the step's tokens
};

class ExpertPlanTest : public ::testing::TestWithParam<Case> {};

TEST_P(ExpertPlanTest, ExpertParallelGivesTheCutExpertsResult) {
  const Case& p = GetParam();
  const Experts x = RandomExperts(p.experts, 1234 + static_cast<uint32_t>(p.experts * 10 + p.n));
  std::mt19937 rng(99 + static_cast<uint32_t>(p.n));
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> hidden(p.n * H);
  for (float& v : hidden) v = d(rng);
  const int64_t max_n = 9;  // the step limit the scratch is sized for (>= n)

  std::unique_ptr<Backend> cpu = MakeCpuBackend(1);
  LocalCommunicator one(cpu.get());
  const std::vector<float> whole = RunMoe(one, /*expert_parallel=*/false, x, hidden, p.n, max_n);
  const std::vector<float> cut = OnGloo(p.ranks, absl::StrCat("cut", p.ranks, "_", p.experts, "_", p.n),
                                        [&](Communicator& c) { return RunMoe(c, false, x, hidden, p.n, max_n); });
  const std::vector<float> ep = OnGloo(p.ranks, absl::StrCat("ep", p.ranks, "_", p.experts, "_", p.n),
                                       [&](Communicator& c) { return RunMoe(c, true, x, hidden, p.n, max_n); });
  ASSERT_EQ(ep.size(), whole.size());
  ASSERT_EQ(cut.size(), whole.size());
  float scale = 0;
  for (float v : whole) scale = std::max(scale, std::fabs(v));
  ASSERT_GT(scale, 0.1f) << "the random data should give outputs of order 1";
  for (size_t i = 0; i < whole.size(); ++i) {
    ASSERT_TRUE(std::isfinite(ep[i])) << i;
    EXPECT_EQ(ep[i], whole[i]) << "row " << i / H << " column " << i % H << ": whole experts, one rank's sums";
    EXPECT_NEAR(ep[i], cut[i], 1e-5f * scale) << "row " << i / H << " column " << i % H;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, ExpertPlanTest,
                         ::testing::Values(Case{1, 5, 3}, Case{2, 5, 7}, Case{2, 5, 1}, Case{2, 4, 8}, Case{3, 7, 9}, Case{3, 7, 2},
                                           Case{3, 5, 4}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return absl::StrCat("Ranks", info.param.ranks, "_Experts", info.param.experts, "_Tokens",
                                               info.param.n);
                         });

// The experts each rank holds: contiguous blocks, floor division, every expert once.
TEST(ExpertRangeTest, BlocksCoverEveryExpertOnce) {
  EXPECT_EQ(ExpertRange(8, 0, 3).begin, 0);
  EXPECT_EQ(ExpertRange(8, 0, 3).end, 2);
  EXPECT_EQ(ExpertRange(8, 1, 3).end, 5);
  EXPECT_EQ(ExpertRange(8, 2, 3).end, 8);
  for (int64_t E : {3, 5, 7, 64, 257}) {
    for (int t = 1; t <= std::min<int64_t>(E, 8); ++t) {
      int64_t next = 0;
      for (int r = 0; r < t; ++r) {
        const Range got = ExpertRange(E, r, t);
        EXPECT_EQ(got.begin, next);
        EXPECT_GE(got.size(), E / t);
        EXPECT_LE(got.size(), E / t + 1);
        next = got.end;
      }
      EXPECT_EQ(next, E);
    }
  }
}

}  // namespace
}  // namespace shardserve
