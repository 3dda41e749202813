// kernels/: the mixture-of-experts steps of Backend (MoeRoute, MoeGroupByExpert, MoeCountRows,
// MoeExperts, MoeCombine, SigmoidGateMul) against
// plain references written here, against transformers' routers (tests/fixtures/moe/routing.json,
// made by tools/fixtures/make_moe_routing_fixture.py), and their refusals. Every case runs on the CPU backend
// and, where a GPU is present, on the CUDA backend with f32 and bf16 activations (skipped, and
// reported as skipped, without one). Outputs sit between guard zones that must come back untouched.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <numeric>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/tensor.h"
#include "nlohmann/json.hpp"

namespace shardserve {
namespace {

constexpr size_t kGuard = 256;          // bytes each side of an output
constexpr uint8_t kGuardByte = 0xA5;  // also the outputs' initial contents

struct BackendCase {
  const char* name;
  bool cuda;
  DType act;
  bool grouped = false;  // CudaBackendOptions::moe_grouped
};

void PrintTo(const BackendCase& c, std::ostream* os) { *os << c.name; }

bool IsInvalidArgumentNaming(const absl::Status& s, const std::string& op) {
  return s.code() == absl::StatusCode::kInvalidArgument && s.message().find(op) != std::string::npos;
}

float RoundTo(DType act, float v) {
  switch (act) {
    case DType::kBF16:
      return Bf16ToF32(F32ToBf16(v));
    case DType::kF16:
      return F16ToF32(F32ToF16(v));
    default:
      return v;
  }
}

class MoeOpsTest : public ::testing::TestWithParam<BackendCase> {
 protected:
  void SetUp() override {
    const BackendCase c = GetParam();
    if (!c.cuda) {
      backend_ = MakeCpuBackend(1);
      return;
    }
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    auto b = MakeCudaBackend(0, c.act, {.moe_grouped = c.grouped});
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = std::move(*b);
  }

  // A device tensor between two guard zones, its bytes (guards included) first set to kGuardByte,
  // then the tensor's to `host` when given.
  struct Guarded {
    Buffer buffer;
    Tensor tensor;
    size_t bytes = 0;
    Tensor* ptr() { return &tensor; }
    const Tensor& t() const { return tensor; }
  };
  Guarded Make(DType dtype, std::initializer_list<int64_t> shape, const void* host = nullptr) {
    Guarded g;
    Tensor probe(nullptr, dtype, shape);
    g.bytes = probe.bytes();
    auto buf = backend_->Allocate(g.bytes + 2 * kGuard);
    EXPECT_TRUE(buf.ok()) << buf.status();
    g.buffer = std::move(*buf);
    std::vector<uint8_t> init(g.bytes + 2 * kGuard, kGuardByte);
    if (host != nullptr) std::memcpy(init.data() + kGuard, host, g.bytes);
    EXPECT_TRUE(backend_->CopyToDevice(g.buffer.data(), init.data(), init.size()).ok());
    g.tensor = Tensor(static_cast<uint8_t*>(g.buffer.data()) + kGuard, dtype, shape);
    return g;
  }
  Guarded F32(std::initializer_list<int64_t> shape, const std::vector<float>& v) {
    return Make(DType::kF32, shape, v.data());
  }
  Guarded I32(std::initializer_list<int64_t> shape, const std::vector<int32_t>& v) {
    return Make(DType::kI32, shape, v.data());
  }
  // Activations in the backend's act dtype from float values.
  Guarded Act(std::initializer_list<int64_t> shape, const std::vector<float>& v) {
    const DType act = backend_->act_dtype();
    std::vector<uint8_t> bytes(v.size() * DTypeSize(act));
    EXPECT_TRUE(ConvertOnHost(bytes.data(), act, v.data(), DType::kF32, v.size()));
    return Make(act, shape, bytes.data());
  }
  // The tensor's contents as T, after checking that its guard zones are untouched.
  template <typename T>
  std::vector<T> Read(const Guarded& g) {
    std::vector<uint8_t> all(g.bytes + 2 * kGuard);
    EXPECT_TRUE(backend_->CopyToHost(all.data(), g.buffer.data(), all.size()).ok());
    for (size_t i = 0; i < kGuard; ++i) {
      EXPECT_EQ(all[i], kGuardByte) << "write before the output at byte " << i;
      EXPECT_EQ(all[kGuard + g.bytes + i], kGuardByte) << "write after the output at byte " << i;
    }
    std::vector<T> out(g.bytes / sizeof(T));
    std::memcpy(out.data(), all.data() + kGuard, g.bytes);
    return out;
  }
  std::vector<float> ReadAct(const Guarded& g) {
    const std::vector<uint8_t> raw = Read<uint8_t>(g);
    std::vector<float> out(g.tensor.numel());
    EXPECT_TRUE(ConvertOnHost(out.data(), DType::kF32, raw.data(), g.tensor.dtype, out.size()));
    return out;
  }

  // Routes [n, E] logits; the ids and weights read back (guards checked).
  void Route(const std::vector<float>& logits, int64_t n, int64_t E, const MoeRouting& r, std::vector<int32_t>* ids,
             std::vector<float>* weights) {
    Guarded x = F32({n, E}, logits);
    Guarded id = Make(DType::kI32, {n, r.k}), w = Make(DType::kF32, {n, r.k});
    const absl::Status s = backend_->MoeRoute(id.ptr(), w.ptr(), x.t(), r);
    ASSERT_TRUE(s.ok()) << s;
    *ids = Read<int32_t>(id);
    *weights = Read<float>(w);
  }

  std::unique_ptr<Backend> backend_;
};

// ---- Plain references -----------------------------------------------------------------------

// The top k indices of v: larger value first, then lower index (a stable sort, descending).
std::vector<int> TopK(const std::vector<float>& v, int k, const std::vector<bool>* allowed = nullptr) {
  std::vector<int> idx;
  for (int i = 0; i < static_cast<int>(v.size()); ++i) {
    if (allowed == nullptr || (*allowed)[i]) idx.push_back(i);
  }
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return v[a] > v[b]; });
  idx.resize(k);
  return idx;
}

// One token's routing as transformers' routers compute it, with ties to the lower id.
void RouteReference(const std::vector<float>& logits, const MoeRouting& r, const std::vector<float>& bias,
                    std::vector<int>* ids, std::vector<float>* weights) {
  const int E = static_cast<int>(logits.size());
  weights->clear();
  if (r.router == MoeRouter::kSoftmaxTopK) {
    const float m = *std::max_element(logits.begin(), logits.end());
    float sum = 0;
    for (float l : logits) sum += std::exp(l - m);
    std::vector<float> p(E);
    for (int e = 0; e < E; ++e) p[e] = std::exp(logits[e] - m) / sum;
    *ids = TopK(p, r.k);
    float s = 0;
    for (int e : *ids) weights->push_back(p[e]), s += p[e];
    if (r.norm_topk_prob) {
      for (float& w : *weights) w /= s;
    }
  } else if (r.router == MoeRouter::kTopKSoftmax) {
    *ids = TopK(logits, r.k);
    const float m = logits[(*ids)[0]];
    float s = 0;
    for (int e : *ids) s += std::exp(logits[e] - m);
    for (int e : *ids) weights->push_back(std::exp(logits[e] - m) / s);
  } else {
    std::vector<float> sc(E), choice(E);
    for (int e = 0; e < E; ++e) sc[e] = 1.0f / (1.0f + std::exp(-logits[e])), choice[e] = sc[e] + bias[e];
    const int size = E / r.n_group;
    std::vector<float> group(r.n_group);
    for (int g = 0; g < r.n_group; ++g) {
      std::vector<float> members(choice.begin() + g * size, choice.begin() + (g + 1) * size);
      const std::vector<int> two = TopK(members, 2);
      group[g] = members[two[0]] + members[two[1]];
    }
    std::vector<bool> allowed(E, false);
    for (int g : TopK(group, r.topk_group)) std::fill(allowed.begin() + g * size, allowed.begin() + (g + 1) * size, true);
    *ids = TopK(choice, r.k, &allowed);
    float s = 0;
    for (int e : *ids) weights->push_back(sc[e]), s += sc[e];
    for (float& w : *weights) w = (r.norm_topk_prob ? w / (s + 1e-20f) : w) * r.routed_scaling_factor;
  }
}

std::vector<float> RandomVector(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// ---- MoeRoute -------------------------------------------------------------------------------


TEST_P(MoeOpsTest, RouteMatchesTransformersRouters) {
  std::ifstream f(std::string(SHARDSERVE_SOURCE_DIR) + "/tests/fixtures/moe/routing.json");
  ASSERT_TRUE(f.good()) << "tests/fixtures/moe/routing.json missing";
  const nlohmann::json fixture = nlohmann::json::parse(f);
  int cases = 0;
  for (const auto& c : fixture.at("cases")) {
    SCOPED_TRACE(c.at("name").get<std::string>());
    const std::string router = c.at("router");
    MoeRouting r;
    r.router = router == "softmax_topk"   ? MoeRouter::kSoftmaxTopK
               : router == "topk_softmax" ? MoeRouter::kTopKSoftmax
                                          : MoeRouter::kSigmoidGroupTopK;
    r.k = c.at("k");
    r.norm_topk_prob = c.at("norm_topk_prob");
    r.n_group = c.at("n_group");
    r.topk_group = c.at("topk_group");
    r.routed_scaling_factor = c.at("routed_scaling_factor");
    const int64_t E = c.at("experts");
    std::vector<float> logits;
    for (const auto& row : c.at("logits")) {
      for (float v : row) logits.push_back(v);
    }
    const int64_t n = static_cast<int64_t>(logits.size()) / E;
    Guarded bias;
    if (!c.at("selection_bias").is_null()) {
      bias = F32({E}, c.at("selection_bias").get<std::vector<float>>());
      r.selection_bias = bias.ptr();
    }
    Guarded ids = Make(DType::kI32, {n, r.k}), weights = Make(DType::kF32, {n, r.k});
    Guarded x = F32({n, E}, logits);
    ASSERT_TRUE(backend_->MoeRoute(ids.ptr(), weights.ptr(), x.t(), r).ok());
    const std::vector<int32_t> got_ids = Read<int32_t>(ids);
    const std::vector<float> got_w = Read<float>(weights);
    for (int64_t t = 0; t < n; ++t) {
      const auto want_ids = c.at("ids")[t].get<std::vector<int>>();
      const auto want_w = c.at("weights")[t].get<std::vector<float>>();
      // DeepSeek-V3's router asks torch.topk for sorted=False: compare as sets, weight by id.
      for (int s = 0; s < r.k; ++s) {
        const int32_t id = got_ids[t * r.k + s];
        const auto at = std::find(want_ids.begin(), want_ids.end(), id);
        ASSERT_NE(at, want_ids.end()) << "token " << t << " slot " << s << " expert " << id << " not chosen by torch";
        const size_t j = at - want_ids.begin();
        if (c.at("sorted").get<bool>()) {
          EXPECT_EQ(j, static_cast<size_t>(s)) << "token " << t << ": top-k order differs";
        }
        // float32 throughout; torch's vectorized exp and sums differ from ours by a few ulp.
        EXPECT_NEAR(got_w[t * r.k + s], want_w[j], 4e-6f * std::max(1.0f, std::fabs(want_w[j])))
            << "token " << t << " slot " << s;
      }
    }
    ++cases;
  }
  EXPECT_EQ(cases, 10);
}

struct RouteShape {
  MoeRouter router;
  int64_t E;
  int k;
  bool norm;
  int n_group;
  int topk_group;
};

TEST_P(MoeOpsTest, RouteMatchesReference) {
  const RouteShape shapes[] = {
      {MoeRouter::kSoftmaxTopK, 8, 2, true, 1, 1},    {MoeRouter::kSoftmaxTopK, 60, 4, false, 1, 1},
      {MoeRouter::kSoftmaxTopK, 7, 1, true, 1, 1},    {MoeRouter::kSoftmaxTopK, 7, 7, false, 1, 1},
      {MoeRouter::kSoftmaxTopK, 129, 8, true, 1, 1},  {MoeRouter::kTopKSoftmax, 32, 4, false, 1, 1},
      {MoeRouter::kTopKSoftmax, 5, 5, false, 1, 1},   {MoeRouter::kTopKSoftmax, 3, 1, false, 1, 1},
      {MoeRouter::kSigmoidGroupTopK, 256, 8, true, 8, 4}, {MoeRouter::kSigmoidGroupTopK, 30, 5, false, 3, 1},
      {MoeRouter::kSigmoidGroupTopK, 12, 12, true, 6, 6}, {MoeRouter::kSigmoidGroupTopK, 2, 1, true, 1, 1},
  };
  uint32_t seed = 1;
  for (const RouteShape& sh : shapes) {
    for (int64_t n : {int64_t{1}, int64_t{333}}) {
      SCOPED_TRACE(absl::StrCat("router ", static_cast<int>(sh.router), " E ", sh.E, " k ", sh.k, " n ", n));
      MoeRouting r;
      r.router = sh.router, r.k = sh.k, r.norm_topk_prob = sh.norm, r.n_group = sh.n_group, r.topk_group = sh.topk_group;
      std::vector<float> bias(sh.E, 0.0f);
      Guarded bias_dev;
      if (sh.router == MoeRouter::kSigmoidGroupTopK) {
        r.routed_scaling_factor = 2.5f;
        bias = RandomVector(sh.E, seed++, 0.3f);
        bias_dev = F32({sh.E}, bias);
        r.selection_bias = bias_dev.ptr();
      }
      const std::vector<float> logits = RandomVector(n * sh.E, seed++, 2.0f);
      std::vector<int32_t> ids;
      std::vector<float> weights;
      Route(logits, n, sh.E, r, &ids, &weights);
      if (HasFatalFailure()) return;
      for (int64_t t = 0; t < n; ++t) {
        std::vector<int> want_ids;
        std::vector<float> want_w;
        RouteReference(std::vector<float>(logits.begin() + t * sh.E, logits.begin() + (t + 1) * sh.E), r, bias,
                       &want_ids, &want_w);
        for (int s = 0; s < sh.k; ++s) {
          ASSERT_EQ(ids[t * sh.k + s], want_ids[s]) << "token " << t << " slot " << s;
          EXPECT_NEAR(weights[t * sh.k + s], want_w[s], 4e-6f * std::max(1.0f, std::fabs(want_w[s])));
        }
      }
    }
  }
}

TEST_P(MoeOpsTest, RouteBreaksTiesByLowerExpertId) {
  // Equal values: every router picks the lower id first. (torch.topk with k < E picks among equal
  // values in the order its selection leaves them, not by id: docs/kernels.md.)
  const std::vector<float> row = {1.0f, 3.0f, 3.0f, 2.0f, 3.0f, 0.0f};
  for (MoeRouter router : {MoeRouter::kSoftmaxTopK, MoeRouter::kTopKSoftmax, MoeRouter::kSigmoidGroupTopK}) {
    for (int k : {1, 2, 3, 4, 6}) {
      SCOPED_TRACE(absl::StrCat("router ", static_cast<int>(router), " k ", k));
      MoeRouting r;
      r.router = router, r.k = k;
      std::vector<int32_t> ids;
      std::vector<float> w;
      Route(row, 1, 6, r, &ids, &w);
      if (HasFatalFailure()) return;
      const std::vector<int32_t> order = {1, 2, 4, 3, 0, 5};
      EXPECT_EQ(ids, std::vector<int32_t>(order.begin(), order.begin() + k));
      // Tied experts get equal weights.
      for (int s = 1; s < std::min(k, 3); ++s) EXPECT_EQ(w[s], w[0]);
    }
  }
  // All equal, E not a power of two: ids 0..k-1, weights 1/k after renormalising.
  MoeRouting r;
  r.k = 5, r.norm_topk_prob = true;
  std::vector<int32_t> ids;
  std::vector<float> w;
  Route(std::vector<float>(2 * 13, 0.25f), 2, 13, r, &ids, &w);
  if (HasFatalFailure()) return;
  for (int t = 0; t < 2; ++t) {
    for (int s = 0; s < 5; ++s) {
      EXPECT_EQ(ids[t * 5 + s], s);
      EXPECT_NEAR(w[t * 5 + s], 0.2f, 1e-7f);
    }
  }
  // Tied groups (DeepSeek-V3): the lower group is kept.
  MoeRouting g;
  g.router = MoeRouter::kSigmoidGroupTopK, g.k = 2, g.n_group = 4, g.topk_group = 1;
  Route({0.0f, 1.0f, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f, 1.0f}, 1, 8, g, &ids, &w);
  if (HasFatalFailure()) return;
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 0}));
}

TEST_P(MoeOpsTest, RouteRefusesNonFiniteLogits) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    SCOPED_TRACE(bad);
    std::vector<float> logits = RandomVector(3 * 5, 7);
    logits[1 * 5 + 2] = bad;
    Guarded x = F32({3, 5}, logits);
    Guarded ids = Make(DType::kI32, {3, 2}), w = Make(DType::kF32, {3, 2});
    MoeRouting r;
    r.k = 2;
    const absl::Status s = backend_->MoeRoute(ids.ptr(), w.ptr(), x.t(), r);
    if (!GetParam().cuda) {
      EXPECT_TRUE(IsInvalidArgumentNaming(s, "MoeRoute")) << s;
      EXPECT_NE(s.message().find("[1, 2]"), std::string::npos) << s;
      continue;
    }
    // The CUDA backend reports it at the next synchronization; the row's ids are -1.
    ASSERT_TRUE(s.ok()) << s;
    const absl::Status sync = backend_->Synchronize();
    EXPECT_TRUE(IsInvalidArgumentNaming(sync, "MoeRoute")) << sync;
    const std::vector<int32_t> got = Read<int32_t>(ids);
    EXPECT_EQ(got[2], -1);
    EXPECT_EQ(got[3], -1);
    EXPECT_GE(got[0], 0);
    EXPECT_TRUE(backend_->Synchronize().ok()) << "the error word is cleared once reported";
  }
  // A NaN selection bias likewise.
  Guarded x = F32({1, 4}, {0.1f, 0.2f, 0.3f, 0.4f});
  Guarded bias = F32({4}, {0.0f, std::numeric_limits<float>::quiet_NaN(), 0.0f, 0.0f});
  Guarded ids = Make(DType::kI32, {1, 1}), w = Make(DType::kF32, {1, 1});
  MoeRouting r;
  r.router = MoeRouter::kSigmoidGroupTopK, r.selection_bias = bias.ptr();
  const absl::Status s = backend_->MoeRoute(ids.ptr(), w.ptr(), x.t(), r);
  if (GetParam().cuda) {
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_TRUE(IsInvalidArgumentNaming(backend_->Synchronize(), "MoeRoute"));
  } else {
    EXPECT_TRUE(IsInvalidArgumentNaming(s, "selection_bias")) << s;
  }
}

TEST_P(MoeOpsTest, RouteRefusesBadArguments) {
  Guarded x = F32({3, 6}, RandomVector(18, 3));
  Guarded ids = Make(DType::kI32, {3, 2}), w = Make(DType::kF32, {3, 2});
  Guarded ids_f = Make(DType::kF32, {3, 2}), w_short = Make(DType::kF32, {2, 2});
  Guarded x_i = Make(DType::kI32, {3, 6}, nullptr);
  Guarded bias5 = F32({5}, std::vector<float>(5, 0.0f));
  auto route = [&](Tensor* i, Tensor* wt, const Tensor& l, MoeRouting r) { return backend_->MoeRoute(i, wt, l, r); };
  MoeRouting ok;
  ok.k = 2;
  ASSERT_TRUE(route(ids.ptr(), w.ptr(), x.t(), ok).ok());
  struct Bad {
    const char* what;
    MoeRouting r;
  };
  std::vector<Bad> bad;
  auto add = [&](const char* what, auto edit) {
    MoeRouting r = ok;
    edit(r);
    bad.push_back({what, r});
  };
  add("k = 0", [](MoeRouting& r) { r.k = 0; });
  add("k = 7", [](MoeRouting& r) { r.k = 7; });
  add("n_group = 4", [](MoeRouting& r) { r.router = MoeRouter::kSigmoidGroupTopK, r.n_group = 4; });
  add("n_group = 6", [](MoeRouting& r) { r.router = MoeRouter::kSigmoidGroupTopK, r.n_group = 6, r.topk_group = 1; });
  add("topk_group = 4", [](MoeRouting& r) { r.router = MoeRouter::kSigmoidGroupTopK, r.n_group = 3, r.topk_group = 4; });
  add("topk_group = 0", [](MoeRouting& r) { r.router = MoeRouter::kSigmoidGroupTopK, r.n_group = 3, r.topk_group = 0; });
  add("exceeds the experts", [](MoeRouting& r) {
    r.router = MoeRouter::kSigmoidGroupTopK, r.n_group = 3, r.topk_group = 1, r.k = 3;
  });
  add("routed_scaling_factor", [](MoeRouting& r) {
    r.router = MoeRouter::kSigmoidGroupTopK, r.routed_scaling_factor = std::numeric_limits<float>::infinity();
  });
  add("selection_bias must be F32 [E]", [&](MoeRouting& r) { r.router = MoeRouter::kSigmoidGroupTopK, r.selection_bias = bias5.ptr(); });
  add("sigmoid group router only", [&](MoeRouting& r) { r.selection_bias = bias5.ptr(); });
  add("unknown router", [](MoeRouting& r) { r.router = static_cast<MoeRouter>(9); });
  for (const Bad& b : bad) {
    const absl::Status s = route(ids.ptr(), w.ptr(), x.t(), b.r);
    EXPECT_TRUE(IsInvalidArgumentNaming(s, "MoeRoute")) << b.what << ": " << s;
    EXPECT_NE(s.message().find(b.what), std::string::npos) << s;
  }
  EXPECT_TRUE(IsInvalidArgumentNaming(route(ids_f.ptr(), w.ptr(), x.t(), ok), "MoeRoute"));
  EXPECT_TRUE(IsInvalidArgumentNaming(route(ids.ptr(), w_short.ptr(), x.t(), ok), "MoeRoute"));
  EXPECT_TRUE(IsInvalidArgumentNaming(route(ids.ptr(), w.ptr(), x_i.t(), ok), "MoeRoute"));
  EXPECT_TRUE(IsInvalidArgumentNaming(route(nullptr, w.ptr(), x.t(), ok), "MoeRoute"));
  MoeRouting k3 = ok;
  k3.k = 3;
  EXPECT_TRUE(IsInvalidArgumentNaming(route(ids.ptr(), w.ptr(), x.t(), k3), "MoeRoute"));
  EXPECT_TRUE(backend_->Synchronize().ok());
}

// The router's logits as the product leaves them, in the act dtype, route as the same values in
// float32 (MoeRoute widens them as it reads them).
TEST_P(MoeOpsTest, RouteReadsLogitsInTheActDtype) {
  const DType act = backend_->act_dtype();
  const int64_t n = 9, E = 60;
  std::vector<float> logits = RandomVector(n * E, 61, 2.0f);
  for (float& v : logits) v = RoundTo(act, v);
  MoeRouting r;
  r.k = 4;
  r.norm_topk_prob = true;
  r.weights_in_act = true;
  Guarded as_f32 = F32({n, E}, logits), as_act = Act({n, E}, logits);
  Guarded ids32 = Make(DType::kI32, {n, r.k}), w32 = Make(DType::kF32, {n, r.k}), ids = Make(DType::kI32, {n, r.k}),
          w = Make(DType::kF32, {n, r.k});
  ASSERT_TRUE(backend_->MoeRoute(ids32.ptr(), w32.ptr(), as_f32.t(), r).ok());
  const absl::Status s = backend_->MoeRoute(ids.ptr(), w.ptr(), as_act.t(), r);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(Read<int32_t>(ids), Read<int32_t>(ids32));
  EXPECT_EQ(Read<float>(w), Read<float>(w32));
}

// ---- MoeGroupByExpert -------------------------------------------------------------------------

TEST_P(MoeOpsTest, GroupByExpertIsAStableCountingSort) {
  struct Shape {
    int64_t n, k, E;
  };
  uint32_t seed = 11;
  for (const Shape& sh : {Shape{1, 1, 1}, Shape{1, 4, 7}, Shape{5, 3, 3}, Shape{1000, 8, 60}, Shape{777, 2, 300},
                          Shape{64, 6, 6}}) {
    SCOPED_TRACE(absl::StrCat("n ", sh.n, " k ", sh.k, " E ", sh.E));
    std::mt19937 rng(seed++);
    std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(sh.E) - 1);
    std::vector<int32_t> ids(sh.n * sh.k);
    for (int32_t& id : ids) id = pick(rng);
    Guarded id = I32({sh.n, sh.k}, ids);
    Guarded order = Make(DType::kI32, {sh.n * sh.k}), rows = Make(DType::kI32, {sh.n, sh.k}),
            offsets = Make(DType::kI32, {sh.E + 1}), tokens = Make(DType::kI32, {sh.n * sh.k});
    const absl::Status s = backend_->MoeGroupByExpert(order.ptr(), rows.ptr(), offsets.ptr(), tokens.ptr(), id.t());
    ASSERT_TRUE(s.ok()) << s;
    const std::vector<int32_t> got_order = Read<int32_t>(order), got_rows = Read<int32_t>(rows),
                               got_off = Read<int32_t>(offsets), got_tokens = Read<int32_t>(tokens);
    // Reference: pairs sorted by expert, stably.
    std::vector<int32_t> want_order(ids.size());
    std::iota(want_order.begin(), want_order.end(), 0);
    std::stable_sort(want_order.begin(), want_order.end(), [&](int32_t a, int32_t b) { return ids[a] < ids[b]; });
    EXPECT_EQ(got_order, want_order);
    std::vector<int32_t> want_off(sh.E + 1, 0);
    for (int32_t e : ids) ++want_off[e + 1];
    std::partial_sum(want_off.begin(), want_off.end(), want_off.begin());
    EXPECT_EQ(got_off, want_off);
    for (size_t r = 0; r < want_order.size(); ++r) {
      ASSERT_EQ(got_rows[want_order[r]], static_cast<int32_t>(r));
      ASSERT_EQ(got_tokens[r], want_order[r] / sh.k) << "grouped row " << r << "'s token";
    }
  }
}

TEST_P(MoeOpsTest, GroupByExpertRefusesBadIds) {
  Guarded order = Make(DType::kI32, {6}), rows = Make(DType::kI32, {3, 2}), offsets = Make(DType::kI32, {5});
  for (int32_t bad : {-1, 4, std::numeric_limits<int32_t>::max()}) {
    Guarded id = I32({3, 2}, {0, 1, 2, bad, 3, 0});
    const absl::Status s = backend_->MoeGroupByExpert(order.ptr(), rows.ptr(), offsets.ptr(), nullptr, id.t());
    if (!GetParam().cuda) {
      EXPECT_TRUE(IsInvalidArgumentNaming(s, "MoeGroupByExpert")) << s;
      EXPECT_NE(s.message().find(absl::StrCat("ids[1, 1] = ", bad)), std::string::npos) << s;
      continue;
    }
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_TRUE(IsInvalidArgumentNaming(backend_->Synchronize(), "MoeGroupByExpert"));
    EXPECT_EQ(Read<int32_t>(rows)[3], -1);
    EXPECT_EQ(Read<int32_t>(offsets).back(), 5) << "the bad pair is left out of the groups";
  }
  Guarded id = I32({3, 2}, {0, 1, 2, 3, 3, 0});
  Guarded short_order = Make(DType::kI32, {5}), rows_t = Make(DType::kI32, {2, 3}), off1 = Make(DType::kI32, {1});
  Guarded id_f = Make(DType::kF32, {3, 2});
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MoeGroupByExpert(short_order.ptr(), rows.ptr(), offsets.ptr(), nullptr, id.t()),
                                      "MoeGroupByExpert"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MoeGroupByExpert(order.ptr(), rows_t.ptr(), offsets.ptr(), nullptr, id.t()),
                                      "MoeGroupByExpert"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MoeGroupByExpert(order.ptr(), rows.ptr(), off1.ptr(), nullptr, id.t()),
                                      "MoeGroupByExpert"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MoeGroupByExpert(order.ptr(), rows.ptr(), offsets.ptr(), nullptr, id_f.t()),
                                      "MoeGroupByExpert"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MoeGroupByExpert(nullptr, rows.ptr(), offsets.ptr(), nullptr, id.t()),
                                      "MoeGroupByExpert"));
  Guarded short_tokens = Make(DType::kI32, {5}), tokens_f = Make(DType::kF32, {6});
  EXPECT_TRUE(IsInvalidArgumentNaming(
      backend_->MoeGroupByExpert(order.ptr(), rows.ptr(), offsets.ptr(), short_tokens.ptr(), id.t()),
      "MoeGroupByExpert"));
  EXPECT_TRUE(IsInvalidArgumentNaming(
      backend_->MoeGroupByExpert(order.ptr(), rows.ptr(), offsets.ptr(), tokens_f.ptr(), id.t()), "MoeGroupByExpert"));
}

// ---- MoeCountRows ----------------------------------------------------------------------------

TEST_P(MoeOpsTest, CountRowsAddsEachExpertsRows) {
  Guarded counts = I32({5}, {1, 2, 3, 4, 5});
  Guarded offsets = I32({6}, {0, 3, 3, 7, 10, 12});
  ASSERT_TRUE(backend_->MoeCountRows(counts.ptr(), offsets.t(), 1, 4).ok());
  EXPECT_EQ(Read<int32_t>(counts), (std::vector<int32_t>{1, 2, 7, 7, 5})) << "experts 1 to 3 only";
  ASSERT_TRUE(backend_->MoeCountRows(counts.ptr(), offsets.t(), 0, 5).ok());
  EXPECT_EQ(Read<int32_t>(counts), (std::vector<int32_t>{4, 2, 11, 10, 7}));
  ASSERT_TRUE(backend_->MoeCountRows(counts.ptr(), offsets.t(), 2, 2).ok());
  EXPECT_TRUE(backend_->Synchronize().ok());

  Guarded short_offsets = I32({5}, {0, 1, 2, 3, 4}), counts_f = Make(DType::kF32, {5});
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MoeCountRows(counts.ptr(), short_offsets.t(), 0, 4), "MoeCountRows"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MoeCountRows(counts_f.ptr(), offsets.t(), 0, 5), "MoeCountRows"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MoeCountRows(counts.ptr(), offsets.t(), 3, 6), "MoeCountRows"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MoeCountRows(counts.ptr(), offsets.t(), 3, 2), "MoeCountRows"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MoeCountRows(nullptr, offsets.t(), 0, 5), "MoeCountRows"));
  Guarded decreasing = I32({6}, {0, 3, 2, 7, 10, 12});
  const absl::Status s = backend_->MoeCountRows(counts.ptr(), decreasing.t(), 0, 5);
  if (!GetParam().cuda) {
    EXPECT_TRUE(IsInvalidArgumentNaming(s, "MoeCountRows")) << s;
    EXPECT_NE(s.message().find("offsets[2] = 2"), std::string::npos) << s;
  } else {
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_TRUE(IsInvalidArgumentNaming(backend_->Synchronize(), "MoeCountRows"));
  }
}

// ---- MoeExperts ------------------------------------------------------------------------------

// MoeExperts against each expert's ops called one by one on its rows: the same bits (the base's loop;
// the CUDA grouped GEMV within a bound), the rows of experts outside the range untouched, and bad
// offsets refused.
TEST_P(MoeOpsTest, ExpertsEqualEachExpertsOpsOnItsRows) {
  const int64_t E = 5, h = 24, f = 16, d = 24;
  // rows per expert: 3, 0, 1, 4, 2 (offsets 0, 3, 3, 4, 8, 10)
  const std::vector<int32_t> off = {0, 3, 3, 4, 8, 10};
  const int64_t rows = off.back();
  uint32_t seed = 41;
  std::vector<Guarded> held;
  std::vector<Tensor> gate_w, up_w, down_w, gate_b, up_b, down_b;
  for (int64_t e = 0; e < E; ++e) {
    held.push_back(Act({f, h}, RandomVector(f * h, seed++, 0.3f)));
    gate_w.push_back(held.back().t());
    held.push_back(Act({f, h}, RandomVector(f * h, seed++, 0.3f)));
    up_w.push_back(held.back().t());
    held.push_back(Act({d, f}, RandomVector(d * f, seed++, 0.3f)));
    down_w.push_back(held.back().t());
    held.push_back(Act({f}, RandomVector(f, seed++, 0.5f)));
    gate_b.push_back(held.back().t());
    held.push_back(Act({f}, RandomVector(f, seed++, 0.5f)));
    up_b.push_back(held.back().t());
    held.push_back(Act({d}, RandomVector(d, seed++, 0.5f)));
    down_b.push_back(e == 3 ? Tensor() : held.back().t());  // expert 3 without a down bias (another rank's)
  }
  const std::vector<float> x_host = RandomVector(rows * h, seed++, 2.0f);
  Guarded x = Act({rows, h}, x_host), offsets = I32({E + 1}, off);
  for (const bool clamped : {false, true}) {
    SCOPED_TRACE(clamped ? "gpt-oss's clamped SwiGLU with biases" : "SwiGLU");
    MoeExpertWeights w{.gate_proj = gate_w, .up_proj = up_w, .down_proj = down_w, .begin = 1, .end = 4};
    if (clamped) {
      w.gate_bias = gate_b, w.up_bias = up_b, w.down_bias = down_b;
      w.swiglu_alpha = 1.702f, w.swiglu_limit = 0.75f;
    }
    const std::vector<float> before = RandomVector(rows * d, seed++);
    Guarded out = Act({rows, d}, before), gate = Make(backend_->act_dtype(), {rows, f}),
            up = Make(backend_->act_dtype(), {rows, f});
    const absl::Status s = backend_->MoeExperts(out.ptr(), gate.ptr(), up.ptr(), x.t(), offsets.t(), w);
    ASSERT_TRUE(s.ok()) << s;
    const std::vector<float> got = ReadAct(out);
    // Each expert in [1, 4) with rows by its own ops; the rows of experts 0 and 4 as they were.
    Guarded want = Act({rows, d}, before), g = Make(backend_->act_dtype(), {rows, f}),
            u = Make(backend_->act_dtype(), {rows, f});
    for (int64_t e = 1; e < 4; ++e) {
      if (off[e] == off[e + 1]) continue;
      const int64_t b = off[e], end = off[e + 1];
      Tensor xe = x.t().Rows(b, end), ge = g.t().Rows(b, end), ue = u.t().Rows(b, end), oe = want.t().Rows(b, end);
      if (clamped) {
        ASSERT_TRUE(backend_->MatMul(&ge, xe, gate_w[e], &gate_b[e]).ok());
        ASSERT_TRUE(backend_->MatMul(&ue, xe, up_w[e], &up_b[e]).ok());
        ASSERT_TRUE(backend_->ClampedSwiGlu(&ge, ge, ue, w.swiglu_alpha, w.swiglu_limit).ok());
        ASSERT_TRUE(backend_->MatMul(&oe, ge, down_w[e], e == 3 ? nullptr : &down_b[e]).ok());
      } else {
        ASSERT_TRUE(backend_->GateUpSilu(&ge, &ue, xe, gate_w[e], up_w[e]).ok());
        ASSERT_TRUE(backend_->MatMul(&oe, ge, down_w[e], nullptr).ok());
      }
    }
    const std::vector<float> expected = ReadAct(want);
    // The grouped GEMV sums in another order than the products it replaces: within a few of the act
    // dtype's roundings (the gate and up rounded before the activation), else the same bits.
    const float tolerance = !GetParam().grouped ? 0.0f : backend_->act_dtype() == DType::kF32 ? 1e-5f : 3e-2f;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < d; ++j) {
        const float want_v = expected[r * d + j];
        ASSERT_LE(std::abs(got[r * d + j] - want_v), tolerance * std::max(1.0f, std::abs(want_v)))
            << "row " << r << " col " << j << ": " << got[r * d + j] << " against " << want_v;
      }
    }
    for (int64_t r : {0, 1, 2, 8, 9}) EXPECT_EQ(got[r * d], RoundTo(backend_->act_dtype(), before[r * d])) << r;
  }

  // Refusals: offsets past x's rows or decreasing, experts outside E, too few weights, bad shapes.
  Guarded out = Make(backend_->act_dtype(), {rows, d}), gate = Make(backend_->act_dtype(), {rows, f}),
          up = Make(backend_->act_dtype(), {rows, f}), up_short = Make(backend_->act_dtype(), {rows - 1, f});
  const MoeExpertWeights all{.gate_proj = gate_w, .up_proj = up_w, .down_proj = down_w, .begin = 0, .end = E};
  Guarded past = I32({E + 1}, {0, 3, 3, 4, 8, 11}), decreasing = I32({E + 1}, {0, 3, 2, 4, 8, 10});
  for (const Guarded* bad : {&past, &decreasing}) {
    const absl::Status s = backend_->MoeExperts(out.ptr(), gate.ptr(), up.ptr(), x.t(), bad->t(), all);
    if (!GetParam().grouped) {
      EXPECT_TRUE(IsInvalidArgumentNaming(s, "MoeExperts")) << s;
    } else {  // read on the device: reported at the next Synchronize()
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_TRUE(IsInvalidArgumentNaming(backend_->Synchronize(), "MoeExperts"));
    }
  }
  MoeExpertWeights beyond = all;
  beyond.end = E + 1;
  const std::vector<Tensor> four(gate_w.begin(), gate_w.begin() + 4);
  MoeExpertWeights few = all;
  few.up_proj = four;
  for (const MoeExpertWeights* bad : {&beyond, &few}) {
    EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MoeExperts(out.ptr(), gate.ptr(), up.ptr(), x.t(), offsets.t(), *bad),
                                        "MoeExperts"));
  }
  EXPECT_TRUE(IsInvalidArgumentNaming(
      backend_->MoeExperts(out.ptr(), gate.ptr(), up_short.ptr(), x.t(), offsets.t(), all), "MoeExperts"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MoeExperts(nullptr, gate.ptr(), up.ptr(), x.t(), offsets.t(), all),
                                      "MoeExperts"));
}

// ---- SigmoidGateMul --------------------------------------------------------------------------

TEST_P(MoeOpsTest, SigmoidGateMulRoundsTheGateThenTheProduct) {
  const DType act = backend_->act_dtype();
  const int64_t n = 7, d = 33;
  std::vector<float> x = RandomVector(n * d, 51, 3.0f), gate = RandomVector(n, 52, 4.0f);
  gate[0] = -100.0f, gate[1] = 100.0f;  // saturated: 0 and 1
  for (float& v : x) v = RoundTo(act, v);
  for (float& v : gate) v = RoundTo(act, v);
  Guarded xs = Act({n, d}, x), g = Act({n, 1}, gate), out = Make(act, {n, d});
  ASSERT_TRUE(backend_->SigmoidGateMul(out.ptr(), xs.t(), g.t()).ok());
  const std::vector<float> got = ReadAct(out);
  for (int64_t t = 0; t < n; ++t) {
    // transformers: F.sigmoid(gate_logit) in the act dtype, times the shared expert's output
    const float scale = RoundTo(act, 1.0f / (1.0f + std::exp(-gate[t])));
    for (int64_t j = 0; j < d; ++j) {
      // exact on the CPU; CUDA's expf may differ from std::exp by an ulp, which moves the rounding
      const float want = RoundTo(act, x[t * d + j] * scale);
      if (!GetParam().cuda) {
        ASSERT_EQ(got[t * d + j], want) << "token " << t << " dim " << j;
      } else {
        ASSERT_NEAR(got[t * d + j], want, std::abs(want) * (act == DType::kF32 ? 1e-6f : 8e-3f)) << t << ", " << j;
      }
    }
  }
  // in place
  ASSERT_TRUE(backend_->SigmoidGateMul(xs.ptr(), xs.t(), g.t()).ok());
  EXPECT_EQ(ReadAct(xs), got);
  Guarded g2 = Act({n, 2}, RandomVector(2 * n, 53)), out_short = Make(act, {n - 1, d});
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->SigmoidGateMul(out.ptr(), xs.t(), g2.t()), "SigmoidGateMul"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->SigmoidGateMul(out_short.ptr(), xs.t(), g.t()), "SigmoidGateMul"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->SigmoidGateMul(nullptr, xs.t(), g.t()), "SigmoidGateMul"));
}

// ---- MoeCombine ------------------------------------------------------------------------------

TEST_P(MoeOpsTest, CombineMatchesTransformersExpertLoop) {
  const DType act = backend_->act_dtype();
  struct Shape {
    int64_t n, k, E, d;
  };
  uint32_t seed = 21;
  for (const Shape& sh : {Shape{1, 1, 1, 8}, Shape{1, 4, 4, 33}, Shape{300, 8, 60, 64}, Shape{17, 3, 7, 1}}) {
    SCOPED_TRACE(absl::StrCat("n ", sh.n, " k ", sh.k, " E ", sh.E, " d ", sh.d));
    // Distinct experts per token (as routing gives), in a shuffled slot order.
    std::mt19937 rng(seed++);
    std::vector<int32_t> ids;
    for (int64_t t = 0; t < sh.n; ++t) {
      std::vector<int32_t> e(sh.E);
      std::iota(e.begin(), e.end(), 0);
      std::shuffle(e.begin(), e.end(), rng);
      ids.insert(ids.end(), e.begin(), e.begin() + sh.k);
    }
    std::vector<float> weights = RandomVector(sh.n * sh.k, seed++, 0.5f);
    std::vector<float> y = RandomVector(sh.n * sh.k * sh.d, seed++, 4.0f);
    for (float& v : y) v = RoundTo(act, v);
    Guarded id = I32({sh.n, sh.k}, ids);
    Guarded order = Make(DType::kI32, {sh.n * sh.k}), rows = Make(DType::kI32, {sh.n, sh.k}),
            offsets = Make(DType::kI32, {sh.E + 1});
    ASSERT_TRUE(backend_->MoeGroupByExpert(order.ptr(), rows.ptr(), offsets.ptr(), nullptr, id.t()).ok());
    const std::vector<int32_t> row = Read<int32_t>(rows);
    Guarded expert_out = Act({sh.n * sh.k, sh.d}, y), w = F32({sh.n, sh.k}, weights);
    Guarded out = Make(act, {sh.n, sh.d});
    const absl::Status s = backend_->MoeCombine(out.ptr(), expert_out.t(), rows.t(), w.t());
    ASSERT_TRUE(s.ok()) << s;
    const std::vector<float> got = ReadAct(out);
    // transformers: final = zeros; per expert in increasing id: index_add_(tokens, (y * w).to(act)).
    for (int64_t t = 0; t < sh.n; ++t) {
      std::vector<int> slots(sh.k);
      std::iota(slots.begin(), slots.end(), 0);
      std::sort(slots.begin(), slots.end(), [&](int a, int b) { return ids[t * sh.k + a] < ids[t * sh.k + b]; });
      for (int64_t j = 0; j < sh.d; ++j) {
        float acc = 0.0f;
        for (int s : slots) {
          const float prod = RoundTo(act, weights[t * sh.k + s] * y[row[t * sh.k + s] * sh.d + j]);
          acc = RoundTo(act, acc + prod);
        }
        ASSERT_EQ(got[t * sh.d + j], acc) << "token " << t << " dim " << j;
      }
    }
  }
}

TEST_P(MoeOpsTest, CombineRefusesBadArguments) {
  const DType act = backend_->act_dtype();
  Guarded out = Make(act, {2, 4}), y = Act({4, 4}, RandomVector(16, 5));
  Guarded rows = I32({2, 2}, {0, 3, 1, 2}), w = F32({2, 2}, {0.5f, 0.5f, 0.25f, 0.75f});
  ASSERT_TRUE(backend_->MoeCombine(out.ptr(), y.t(), rows.t(), w.t()).ok());
  Guarded out_d = Make(act, {2, 3}), rows_3 = I32({2, 3}, {0, 1, 2, 3, 0, 1}), w_i = Make(DType::kI32, {2, 2});
  Guarded rows_f = Make(DType::kF32, {2, 2});
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MoeCombine(out_d.ptr(), y.t(), rows.t(), w.t()), "MoeCombine"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MoeCombine(out.ptr(), y.t(), rows_3.t(), w.t()), "MoeCombine"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MoeCombine(out.ptr(), y.t(), rows.t(), w_i.t()), "MoeCombine"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MoeCombine(out.ptr(), y.t(), rows_f.t(), w.t()), "MoeCombine"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MoeCombine(nullptr, y.t(), rows.t(), w.t()), "MoeCombine"));
  Tensor alias = y.t();
  Tensor alias_out(alias.data, act, {2, 4});
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MoeCombine(&alias_out, y.t(), rows.t(), w.t()), "alias"));
  for (int32_t bad : {-1, 4}) {
    Guarded bad_rows = I32({2, 2}, {0, 3, bad, 2});
    const absl::Status s = backend_->MoeCombine(out.ptr(), y.t(), bad_rows.t(), w.t());
    if (!GetParam().cuda) {
      EXPECT_TRUE(IsInvalidArgumentNaming(s, "MoeCombine")) << s;
      EXPECT_NE(s.message().find(absl::StrCat("rows[1, 0] = ", bad)), std::string::npos) << s;
    } else {
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_TRUE(IsInvalidArgumentNaming(backend_->Synchronize(), "MoeCombine"));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, MoeOpsTest,
                         ::testing::Values(BackendCase{"Cpu", false, DType::kF32},
                                           BackendCase{"CudaF32", true, DType::kF32},
                                           BackendCase{"CudaBF16", true, DType::kBF16},
                                           BackendCase{"CudaF32Grouped", true, DType::kF32, true},
                                           BackendCase{"CudaBF16Grouped", true, DType::kBF16, true}),
                         [](const ::testing::TestParamInfo<BackendCase>& info) { return info.param.name; });

}  // namespace
}  // namespace shardserve
