// Tests of the last stage's sampler (worker/sampler.h) on the CPU backend, against brute-force
// references written here in double precision: log-softmax of the raw logits, the Hugging Face /
// vLLM penalty rules, min_p, and the draw Backend::Sample defines (the first kept token, in
// vocabulary order, whose cumulative renormalized probability exceeds the draw).
//
// The host rows are also run through a backend that says it is not the CPU (DeviceLikeBackend),
// so the copy-to-host path and the sampler's own CPU backend are covered without a GPU. The last
// test runs the sampler inside a worker's StepExecutor on a parity fixture.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/backend.h"
#include "kernels/sampling.h"
#include "tests/bf16_products.h"
#include "tests/device_like_backend.h"
#include "tests/one_worker.h"
#include "tests/overflowing_fixture.h"
#include "shardserve/v1/worker.pb.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "worker/communicator.h"
#include "worker/shard/greedy.h"
#include "worker/shard/model_shard.h"
#include "worker/sampler.h"
#include "worker/step_checks.h"
#include "worker/step_executor.h"

namespace shardserve {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
using RowList = google::protobuf::RepeatedPtrField<v1::RowSampling>;

// ---- References (double) ---------------------------------------------------------------------

std::vector<double> LogSoftmax(const std::vector<float>& x) {
  const double max = *std::max_element(x.begin(), x.end());
  double sum = 0;
  for (float xi : x) sum += std::exp(xi - max);
  std::vector<double> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = x[i] - max - std::log(sum);
  return out;
}

// The ids of the n largest values, largest first, ties lower id first.
std::vector<int32_t> TopIds(const std::vector<float>& x, int n) {
  std::vector<int32_t> ids(x.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return x[a] > x[b]; });
  ids.resize(std::min<size_t>(n, ids.size()));
  return ids;
}

// Hugging Face RepetitionPenaltyLogitsProcessor over the distinct ids of prompt and output, then
// vLLM's frequency (per occurrence in the output) and presence (once per distinct output id).
std::vector<double> Penalized(const std::vector<float>& x, const v1::RowSampling& r) {
  std::vector<double> out(x.begin(), x.end());
  const double rp = r.repetition_penalty();
  if (rp != 0 && rp != 1) {
    std::vector<bool> seen(x.size(), false);
    for (const auto* ids : {&r.penalty_prompt_ids(), &r.penalty_output_ids()}) {
      for (int32_t t : *ids) seen[t] = true;
    }
    for (size_t t = 0; t < x.size(); ++t) {
      if (seen[t]) out[t] = out[t] > 0 ? out[t] / rp : out[t] * rp;
    }
  }
  std::vector<int> count(x.size(), 0);
  for (int32_t t : r.penalty_output_ids()) ++count[t];
  for (size_t t = 0; t < x.size(); ++t) {
    out[t] -= r.frequency_penalty() * count[t] + r.presence_penalty() * (count[t] > 0 ? 1 : 0);
  }
  return out;
}

// The distribution a sampled row draws from: softmax(x / T); min_p (p < min_p * p_max dropped);
// top_k (ties with the k-th kept); top_p over what is left, renormalized (ties with the last
// taken kept); renormalized.
std::vector<double> Distribution(const std::vector<double>& x, const v1::RowSampling& r) {
  const size_t v = x.size();
  const double t = r.temperature();
  const double max = *std::max_element(x.begin(), x.end());
  std::vector<double> p(v);
  double sum = 0;
  for (size_t i = 0; i < v; ++i) sum += (p[i] = std::exp((x[i] - max) / t));
  for (double& pi : p) pi /= sum;
  const double p_max = *std::max_element(p.begin(), p.end());
  for (double& pi : p) {
    if (pi < r.min_p() * p_max) pi = 0;
  }
  double keep_from = 0;
  if (r.top_k() > 0 && static_cast<size_t>(r.top_k()) < v) {
    std::vector<double> sorted = p;
    std::sort(sorted.begin(), sorted.end(), std::greater<double>());
    keep_from = sorted[r.top_k() - 1];
  }
  if (r.top_p() > 0 && r.top_p() < 1) {
    std::vector<double> sorted;
    for (double pi : p) {
      if (pi >= keep_from && pi > 0) sorted.push_back(pi);
    }
    std::sort(sorted.begin(), sorted.end(), std::greater<double>());
    const double kept = std::accumulate(sorted.begin(), sorted.end(), 0.0);
    double mass = 0;
    for (double pi : sorted) {
      mass += pi;
      keep_from = pi;
      if (mass >= r.top_p() * kept) break;
    }
  }
  double kept = 0;
  for (double& pi : p) kept += (pi = pi >= keep_from ? pi : 0);
  for (double& pi : p) pi /= kept;
  return p;
}

// The token Backend::Sample's rule picks for draw u, or -1 when u is within 1e-5 of a cumulative
// boundary (float rounding may then go either way).
int32_t InverseCdf(const std::vector<double>& p, double u) {
  double cum = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] == 0) continue;
    if (std::abs(cum - u) < 1e-5 || std::abs(cum + p[i] - u) < 1e-5) return -1;
    cum += p[i];
    if (cum > u) return static_cast<int32_t>(i);
  }
  return -1;
}

int32_t Argmax(const std::vector<double>& x) {
  return static_cast<int32_t>(std::max_element(x.begin(), x.end()) - x.begin());
}

// The gap between the largest and the second largest value.
double TopMargin(const std::vector<double>& x) {
  std::vector<double> s = x;
  std::partial_sort(s.begin(), s.begin() + 2, s.end(), std::greater<double>());
  return s[0] - s[1];
}

// ---- Fixture ---------------------------------------------------------------------------------

v1::RowSampling Greedy() { return v1::RowSampling(); }

v1::RowSampling Sampled(float temperature, uint64_t seed, uint64_t draw_index, int32_t top_k = 0, float top_p = 0) {
  v1::RowSampling r;
  r.set_temperature(temperature);
  r.set_seed(seed);
  r.set_draw_index(draw_index);
  r.set_top_k(top_k);
  r.set_top_p(top_p);
  return r;
}

class SamplerTest : public ::testing::Test {
 protected:
  static constexpr int64_t kMaxRows = 16;

  // Samples `rows` over host logits [rows.size(), v] on `backend` (the CPU backend by default).
  absl::StatusOr<v1::StepResult> Run(const std::vector<float>& logits, int64_t v, const std::vector<v1::RowSampling>& rows,
                                     Backend* backend = nullptr, const std::vector<const uint32_t*>& masks = {}) {
    if (backend == nullptr) backend = cpu_.get();
    absl::StatusOr<std::unique_ptr<Sampler>> sampler = Sampler::Create(backend, kMaxRows, v);
    if (!sampler.ok()) return sampler.status();
    const int64_t m = static_cast<int64_t>(rows.size());
    absl::StatusOr<Buffer> buf = backend->Allocate(std::max<size_t>(logits.size() * sizeof(float), 1));
    if (!buf.ok()) return buf.status();
    if (absl::Status s = backend->CopyToDevice(buf->data(), logits.data(), logits.size() * sizeof(float)); !s.ok()) {
      return s;
    }
    RowList list;
    for (const v1::RowSampling& r : rows) *list.Add() = r;
    v1::StepResult result;
    const Tensor t(buf->data(), DType::kF32, {m, v});
    SHARDSERVE_RETURN_IF_ERROR((*sampler)->Sample(/*step_id=*/7, t, list, &result, masks));
    return result;
  }
  // One row's sampled id.
  int32_t One(const std::vector<float>& logits, const v1::RowSampling& r) {
    absl::StatusOr<v1::StepResult> result = Run(logits, static_cast<int64_t>(logits.size()), {r});
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? result->sampled_ids(0) : -1;
  }

  std::vector<float> Random(size_t n, float lo, float hi) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng_);
    return v;
  }

  std::unique_ptr<Backend> cpu_ = MakeCpuBackend();
  std::mt19937 rng_{20250101};
};

// A draw index whose SampleUniform(seed, index) lies in [lo, hi).
uint64_t DrawIn(uint64_t seed, float lo, float hi) {
  for (uint64_t i = 0;; ++i) {
    const float u = SampleUniform(seed, i);
    if (u >= lo && u < hi) return i;
  }
}

// ---- Logprobs --------------------------------------------------------------------------------

// 1e-5: the normalizer is summed in double and each logprob is one float rounding of x - lse
// (|x - lse| < 20 here, so half an ulp is < 1e-6). Logprobs of the penalized or tempered logits
// (rows 1 and 2) would be off by 0.1 or more.
constexpr double kLogprobTolerance = 1e-5;

TEST_F(SamplerTest, LogprobsAreLogSoftmaxOfTheRawLogits) {
  const int64_t v = 1000;
  std::vector<float> row = Random(v, -8.0f, 8.0f);
  row[5] = row[10] = row[20] = 9.5f;  // a three-way tie for the most likely: ids 5, 10, 20 in that order
  row[30] = row[31] = 9.0f;           // and a tie for 4th/5th
  const std::vector<double> want = LogSoftmax(row);
  const std::vector<int32_t> want_top = TopIds(row, 20);
  ASSERT_EQ(std::vector<int32_t>(want_top.begin(), want_top.begin() + 5), (std::vector<int32_t>{5, 10, 20, 30, 31}));

  v1::RowSampling greedy = Greedy();
  v1::RowSampling sampled = Sampled(0.8f, 3, 4, 0, 0.9f);
  v1::RowSampling penalized = Sampled(1.3f, 5, 6);  // logprobs stay those of the raw logits
  penalized.set_repetition_penalty(1.7f);
  penalized.set_presence_penalty(1.0f);
  penalized.set_min_p(0.01f);
  penalized.add_penalty_prompt_ids(5);
  penalized.add_penalty_output_ids(10);
  penalized.add_penalty_output_ids(10);
  v1::RowSampling few = Sampled(1.0f, 8, 9);
  few.set_top_logprobs(2);
  for (v1::RowSampling* r : {&greedy, &sampled, &penalized}) r->set_top_logprobs(20);
  for (v1::RowSampling* r : {&greedy, &sampled, &penalized, &few}) r->set_logprobs(true);
  v1::RowSampling none = Sampled(1.0f, 1, 1);  // asks nothing: an empty entry

  std::vector<float> logits;
  for (int i = 0; i < 5; ++i) logits.insert(logits.end(), row.begin(), row.end());
  for (Backend* backend : {cpu_.get(), static_cast<Backend*>(nullptr)}) {
    DeviceLikeBackend device_like;
    absl::StatusOr<v1::StepResult> result =
        Run(logits, v, {greedy, sampled, penalized, few, none}, backend ? backend : &device_like);
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_EQ(result->sampled_ids_size(), 5);
    ASSERT_EQ(result->logprobs_size(), 5);
    EXPECT_EQ(result->sampled_ids(0), 5);  // the first of the tied maxima
    for (int i = 0; i < 4; ++i) {
      const v1::RowLogprobs& lp = result->logprobs(i);
      const int32_t id = result->sampled_ids(i);
      EXPECT_NEAR(lp.logprob(), want[id], kLogprobTolerance) << "row " << i;
      const int n = i == 3 ? 2 : 20;
      ASSERT_EQ(lp.top_ids_size(), n) << "row " << i;
      ASSERT_EQ(lp.top_logprobs_size(), n) << "row " << i;
      for (int k = 0; k < n; ++k) {
        EXPECT_EQ(lp.top_ids(k), want_top[k]) << "row " << i << " rank " << k;
        EXPECT_NEAR(lp.top_logprobs(k), want[want_top[k]], kLogprobTolerance) << "row " << i << " rank " << k;
      }
    }
    const v1::RowLogprobs& empty = result->logprobs(4);
    EXPECT_EQ(empty.top_ids_size(), 0);
    EXPECT_EQ(empty.logprob(), 0.0f);
  }
}

// A scored prompt position (RowSampling.scored_id) draws nothing: its id is the scored one, its
// logprob that id's under the raw logits, its rank 1 + the ids with a larger logit (ties: not
// larger), its alternatives the most likely; a sampled row's rank likewise. On the CPU and on a
// device-like backend (the row copied to the host).
TEST_F(SamplerTest, ScoredRowsGiveTheScoredTokensLogprobAndRank) {
  const int64_t v = 300;
  std::vector<float> row = Random(v, -5.0f, 5.0f);
  row[40] = row[41] = 7.0f;  // the most likely two, tied
  row[90] = 6.0f;
  const std::vector<double> want = LogSoftmax(row);
  v1::RowSampling scored;
  scored.set_logprobs(true);
  scored.set_top_logprobs(3);
  scored.set_scored_id(90);
  v1::RowSampling tied = scored;
  tied.set_scored_id(41);
  v1::RowSampling unlikely = scored;
  unlikely.set_top_logprobs(0);
  const int32_t least = static_cast<int32_t>(std::min_element(row.begin(), row.end()) - row.begin());
  unlikely.set_scored_id(least);
  v1::RowSampling greedy = Greedy();
  greedy.set_logprobs(true);
  std::vector<float> logits;
  for (int i = 0; i < 4; ++i) logits.insert(logits.end(), row.begin(), row.end());
  for (Backend* backend : {cpu_.get(), static_cast<Backend*>(nullptr)}) {
    DeviceLikeBackend device_like;
    absl::StatusOr<v1::StepResult> result = Run(logits, v, {scored, tied, unlikely, greedy}, backend ? backend : &device_like);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(std::vector<int32_t>(result->sampled_ids().begin(), result->sampled_ids().end()),
              (std::vector<int32_t>{90, 41, least, 40}));
    ASSERT_EQ(result->logprobs_size(), 4);
    EXPECT_NEAR(result->logprobs(0).logprob(), want[90], kLogprobTolerance);
    EXPECT_EQ(result->logprobs(0).rank(), 3);
    EXPECT_EQ(std::vector<int32_t>(result->logprobs(0).top_ids().begin(), result->logprobs(0).top_ids().end()),
              (std::vector<int32_t>{40, 41, 90}));
    EXPECT_EQ(result->logprobs(1).rank(), 1) << "a tie is not larger";
    EXPECT_NEAR(result->logprobs(2).logprob(), want[least], kLogprobTolerance);
    EXPECT_EQ(result->logprobs(2).rank(), v);
    EXPECT_EQ(result->logprobs(2).top_ids_size(), 0);
    EXPECT_EQ(result->logprobs(3).rank(), 1);
  }
  v1::RowSampling outside = scored;
  outside.set_scored_id(static_cast<int32_t>(v));
  v1::RowSampling bare;
  bare.set_scored_id(3);  // without logprobs
  for (const v1::RowSampling& bad : {outside, bare}) {
    absl::StatusOr<v1::StepResult> result = Run(std::vector<float>(row), v, {bad});
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
    EXPECT_NE(result.status().message().find("scored_id"), std::string::npos) << result.status();
  }
}

TEST_F(SamplerTest, NoLogprobsWhenNoRowAsks) {
  absl::StatusOr<v1::StepResult> result = Run(Random(2 * 50, -1, 1), 50, {Greedy(), Sampled(1, 2, 3)});
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->sampled_ids_size(), 2);
  EXPECT_EQ(result->logprobs_size(), 0);
}

// ---- Penalties -------------------------------------------------------------------------------

TEST_F(SamplerTest, RepetitionPenaltyFollowsHuggingFace) {
  // A positive logit is divided: 3.0 / 2 = 1.5 < 2.0, so greedy moves from token 0 to token 1.
  v1::RowSampling r = Greedy();
  EXPECT_EQ(One({3.0f, 2.0f, -1.0f}, r), 0);
  r.set_repetition_penalty(2.0f);
  r.add_penalty_prompt_ids(0);
  EXPECT_EQ(One({3.0f, 2.0f, -1.0f}, r), 1);

  // A negative logit is multiplied: -1.0 * 1.5 = -1.5 < -1.2 (dividing would give -0.67 > -1.2).
  v1::RowSampling neg = Greedy();
  neg.set_repetition_penalty(1.5f);
  neg.add_penalty_output_ids(0);
  EXPECT_EQ(One({-1.0f, -1.2f, -3.0f}, neg), 1);

  // Once per distinct id, however often it appears in prompt and output: 3.0 / 1.5 = 2.0 > 1.9
  // (applied three times it would be 0.89).
  v1::RowSampling once = Greedy();
  once.set_repetition_penalty(1.5f);
  for (int i = 0; i < 2; ++i) once.add_penalty_prompt_ids(0);
  once.add_penalty_output_ids(0);
  EXPECT_EQ(One({3.0f, 1.9f}, once), 0);

  // A penalty below 1 encourages: 1.0 / 0.5 = 2.0 > 1.5.
  v1::RowSampling encourage = Greedy();
  encourage.set_repetition_penalty(0.5f);
  encourage.add_penalty_prompt_ids(0);
  EXPECT_EQ(One({1.0f, 1.5f}, encourage), 0);

  // repetition_penalty 1 and 0 are off.
  for (float off : {0.0f, 1.0f}) {
    r.set_repetition_penalty(off);
    EXPECT_EQ(One({3.0f, 2.0f, -1.0f}, r), 0);
  }
}

TEST_F(SamplerTest, PresenceAndFrequencyCountOutputOccurrences) {
  // frequency 0.3 per occurrence, presence 0.1 once: token 0 (twice) 2.0 - 0.6 - 0.1 = 1.3,
  // token 1 (once) 1.75 - 0.3 - 0.1 = 1.35: token 1. Counting token 0 once would give it 1.6.
  v1::RowSampling r = Greedy();
  r.set_frequency_penalty(0.3f);
  r.set_presence_penalty(0.1f);
  for (int32_t id : {0, 1, 0}) r.add_penalty_output_ids(id);
  EXPECT_EQ(One({2.0f, 1.75f, 1.0f}, r), 1);

  // Presence once, not per occurrence: 2.0 - 0.5 = 1.5 > 1.4 (thrice would be 0.5).
  v1::RowSampling presence = Greedy();
  presence.set_presence_penalty(0.5f);
  for (int i = 0; i < 3; ++i) presence.add_penalty_output_ids(0);
  EXPECT_EQ(One({2.0f, 1.4f}, presence), 0);

  // Negative frequency encourages repeats: 1.0 + 2 * 0.2 = 1.4 > 1.2.
  v1::RowSampling encourage = Greedy();
  encourage.set_frequency_penalty(-0.2f);
  for (int i = 0; i < 2; ++i) encourage.add_penalty_output_ids(0);
  EXPECT_EQ(One({1.0f, 1.2f}, encourage), 0);

  // Prompt ids take no presence/frequency penalty.
  v1::RowSampling prompt_only = Greedy();
  prompt_only.set_presence_penalty(2.0f);
  prompt_only.add_penalty_prompt_ids(0);
  EXPECT_EQ(One({2.0f, 1.4f}, prompt_only), 0);
}

// Random rows and penalties against the reference: greedy must pick the reference's argmax, and
// a sampled row (with min_p, top_k, top_p) the token the reference distribution's inverse CDF
// gives for the row's draw.
TEST_F(SamplerTest, RandomPenaltiesMatchTheReference) {
  const int64_t v = 64;
  std::uniform_int_distribution<int32_t> id(0, v - 1);
  std::uniform_real_distribution<float> unit(0, 1);
  int checked_greedy = 0, checked_sampled = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const std::vector<float> row = Random(v, -4.0f, 4.0f);
    v1::RowSampling r = trial % 2 == 0 ? Greedy() : Sampled(0.5f + unit(rng_), 99, trial, trial % 3 == 0 ? 20 : 0,
                                                         trial % 5 == 0 ? 0.9f : 0.0f);
    r.set_repetition_penalty(trial % 4 == 0 ? 1.0f : 0.5f + 2.0f * unit(rng_));
    r.set_presence_penalty(-2.0f + 4.0f * unit(rng_));
    r.set_frequency_penalty(-2.0f + 4.0f * unit(rng_));
    if (trial % 3 == 1) r.set_min_p(0.2f * unit(rng_));
    for (int i = 0; i < 10; ++i) r.add_penalty_prompt_ids(id(rng_));
    for (int i = 0; i < 12; ++i) r.add_penalty_output_ids(id(rng_) % 16);  // repeats are likely
    const std::vector<double> pen = Penalized(row, r);
    const int32_t got = One(row, r);
    if (r.temperature() == 0) {
      if (TopMargin(pen) < 1e-4) continue;  // float rounding may pick either
      EXPECT_EQ(got, Argmax(pen)) << "trial " << trial;
      ++checked_greedy;
    } else {
      const int32_t want = InverseCdf(Distribution(pen, r), SampleUniform(r.seed(), r.draw_index()));
      if (want < 0) continue;
      EXPECT_EQ(got, want) << "trial " << trial;
      ++checked_sampled;
    }
  }
  EXPECT_GT(checked_greedy, 190);
  EXPECT_GT(checked_sampled, 190);
}

TEST_F(SamplerTest, GreedyWithPenaltyChangesTheArgmax) {
  const std::vector<float> row = Random(100, -3.0f, 3.0f);
  const int32_t plain = One(row, Greedy());
  std::vector<double> raw(row.begin(), row.end());
  ASSERT_EQ(plain, Argmax(raw));
  v1::RowSampling r = Greedy();
  r.set_frequency_penalty(2.0f);
  for (int i = 0; i < 3; ++i) r.add_penalty_output_ids(plain);
  const int32_t penalized = One(row, r);
  EXPECT_NE(penalized, plain);
  EXPECT_EQ(penalized, Argmax(Penalized(row, r)));
}

// ---- logit_bias and min_tokens ----------------------------------------------------------------

v1::RowSampling WithBias(v1::RowSampling r, int32_t id, float bias) {
  r.add_logit_bias_ids(id);
  r.add_logit_bias_values(bias);
  return r;
}

TEST_F(SamplerTest, LogitBiasOfPlus100ForcesAToken) {
  const std::vector<float> row = Random(100, -3.0f, 3.0f);
  const int32_t plain = One(row, Greedy());
  const int32_t forced = (plain + 17) % 100;
  EXPECT_EQ(One(row, WithBias(Greedy(), forced, 100.0f)), forced);
  // Seeded sampling: every draw is the forced token (its probability is 1 - e^-94 or more).
  for (uint64_t draw = 0; draw < 50; ++draw) {
    EXPECT_EQ(One(row, WithBias(Sampled(1.0f, 5, draw), forced, 100.0f)), forced) << draw;
  }
  // The same seed and draw give the same token with or without other rows (the host path's draw).
  const v1::RowSampling biased = WithBias(Sampled(1.0f, 5, 3), forced, 5.0f);
  EXPECT_EQ(One(row, biased), One(row, biased));
}

TEST_F(SamplerTest, LogitBiasOfMinus100BansAToken) {
  std::vector<float> row = Random(100, -1.0f, 1.0f);
  row[42] = 8.0f;  // by far the most likely
  EXPECT_EQ(One(row, Greedy()), 42);
  const int32_t banned_greedy = One(row, WithBias(Greedy(), 42, -100.0f));
  EXPECT_NE(banned_greedy, 42);
  std::vector<double> rest(row.begin(), row.end());
  rest[42] = -1e9;
  EXPECT_EQ(banned_greedy, Argmax(rest));
  for (uint64_t draw = 0; draw < 200; ++draw) {
    EXPECT_NE(One(row, WithBias(Sampled(1.0f, 9, draw), 42, -100.0f)), 42) << draw;
  }
}

TEST_F(SamplerTest, MinTokensBansTheEndIdsUntilReached) {
  std::vector<float> row = Random(50, -1.0f, 1.0f);
  row[7] = 6.0f;  // the EOS is by far the most likely
  v1::RowSampling r = Greedy();
  r.set_min_tokens(3);
  r.add_min_tokens_banned_ids(7);
  for (uint64_t draw = 0; draw < 3; ++draw) {
    r.set_draw_index(draw);
    EXPECT_NE(One(row, r), 7) << draw;
    v1::RowSampling s = r;
    s.set_temperature(1.0f);
    s.set_seed(4);
    EXPECT_NE(One(row, s), 7) << draw;
  }
  r.set_draw_index(3);  // min_tokens reached: the EOS may come
  EXPECT_EQ(One(row, r), 7);
}

// ---- Token masks (constrained decoding) ------------------------------------------------------

// A bitmask over v ids allowing exactly `allowed`.
std::vector<uint32_t> MaskOf(int64_t v, const std::vector<int32_t>& allowed) {
  std::vector<uint32_t> m((v + 31) / 32, 0);
  for (int32_t id : allowed) m[id / 32] |= 1u << (id % 32);
  return m;
}

TEST_F(SamplerTest, MaskedRowsChooseOnlyAllowedTokens) {
  constexpr int64_t v = 100;
  // Three rows: masked greedy, unmasked greedy, masked sampled; each row's most likely token is
  // disallowed by its mask.
  std::vector<float> logits = Random(3 * v, -1.0f, 1.0f);
  for (int r = 0; r < 3; ++r) logits[r * v + 10 + r] = 9.0f;
  const std::vector<int32_t> allowed0 = {3, 40, 77}, allowed2 = {5, 6, 64, 99};
  const std::vector<uint32_t> m0 = MaskOf(v, allowed0), m2 = MaskOf(v, allowed2);
  const std::vector<const uint32_t*> masks = {m0.data(), nullptr, m2.data()};
  DeviceLikeBackend device_like;  // and the same through the copy-to-host path
  for (uint64_t draw = 0; draw < 100; ++draw) {
    for (Backend* backend : {cpu_.get(), static_cast<Backend*>(&device_like)}) {
      absl::StatusOr<v1::StepResult> r = Run(logits, v, {Greedy(), Greedy(), Sampled(1.0f, 11, draw)}, backend, masks);
      ASSERT_TRUE(r.ok()) << r.status();
      // Greedy under the mask: the argmax of the allowed logits.
      std::vector<double> row0(logits.begin(), logits.begin() + v);
      for (int64_t i = 0; i < v; ++i) {
        if (std::find(allowed0.begin(), allowed0.end(), i) == allowed0.end()) row0[i] = -1e30;
      }
      EXPECT_EQ(r->sampled_ids(0), Argmax(row0));
      EXPECT_EQ(r->sampled_ids(1), 11);  // unmasked: its own argmax
      EXPECT_NE(std::find(allowed2.begin(), allowed2.end(), r->sampled_ids(2)), allowed2.end()) << draw;
    }
  }
  // The mask comes before logit_bias: +100 on a disallowed token does not bring it back.
  const std::vector<float> row(logits.begin(), logits.begin() + v);
  absl::StatusOr<v1::StepResult> biased = Run(row, v, {WithBias(Greedy(), 50, 100.0f)}, nullptr, {m0.data()});
  ASSERT_TRUE(biased.ok()) << biased.status();
  EXPECT_NE(std::find(allowed0.begin(), allowed0.end(), biased->sampled_ids(0)), allowed0.end());
  // Logprobs stay those of the raw logits.
  v1::RowSampling lp = Greedy();
  lp.set_logprobs(true);
  absl::StatusOr<v1::StepResult> with_lp = Run(row, v, {lp}, nullptr, {m0.data()});
  ASSERT_TRUE(with_lp.ok()) << with_lp.status();
  const std::vector<double> ls = LogSoftmax(row);
  EXPECT_NEAR(with_lp->logprobs(0).logprob(), ls[with_lp->sampled_ids(0)], kLogprobTolerance);
  // A mask list of the wrong length is refused.
  EXPECT_FALSE(Run(row, v, {Greedy()}, nullptr, {m0.data(), m0.data()}).ok());
}

// ---- min_p -----------------------------------------------------------------------------------

TEST_F(SamplerTest, MinPMasksExactlyTheTokensBelowTheThreshold) {
  // Probabilities (0.05, 0.4, 0.1, 0.3, 0.15) at T = 1; min_p 0.3 keeps p >= 0.12: {1, 3, 4},
  // renormalized 0.47, 0.35, 0.18.
  const std::vector<double> probs = {0.05, 0.4, 0.1, 0.3, 0.15};
  std::vector<float> row;
  for (double p : probs) row.push_back(static_cast<float>(std::log(p)));
  // A draw in [0, 0.05) picks token 0 without min_p, token 1 with it; one in [0.451, 0.469)
  // picks token 2 without (cumulative 0.45, 0.55) and token 1 with it (cumulative 0.47).
  for (auto [lo, hi, without] : {std::tuple{0.0f, 0.049f, 0}, std::tuple{0.451f, 0.469f, 2}}) {
    v1::RowSampling r = Sampled(1.0f, 11, DrawIn(11, lo, hi));
    EXPECT_EQ(One(row, r), without);
    r.set_min_p(0.3f);
    EXPECT_EQ(One(row, r), 1);
  }
  // Over many draws no masked token is ever drawn, and each draw is the reference's.
  v1::RowSampling r = Sampled(1.0f, 12, 0);
  r.set_min_p(0.3f);
  const std::vector<double> raw(row.begin(), row.end());
  const std::vector<double> want = Distribution(raw, r);
  ASSERT_EQ(want[0], 0.0);
  ASSERT_EQ(want[2], 0.0);
  for (uint64_t i = 0; i < 500; ++i) {
    r.set_draw_index(i);
    const int32_t got = One(row, r);
    EXPECT_TRUE(got == 1 || got == 3 || got == 4) << "draw " << i << " got masked token " << got;
    const int32_t ref = InverseCdf(want, SampleUniform(12, i));
    if (ref >= 0) {
      EXPECT_EQ(got, ref) << "draw " << i;
    }
  }
}

TEST_F(SamplerTest, MinPAppliesAfterTemperature) {
  // Relative probabilities p_i / p_max at T = 1: (0.125, 1, 0.25, 0.75, 0.375); at T = 2 their
  // square roots: (0.354, 1, 0.5, 0.866, 0.612). min_p 0.4 masks {0, 2, 4} at T = 1, {0} at T = 2.
  const std::vector<double> probs = {0.05, 0.4, 0.1, 0.3, 0.15};
  std::vector<float> row;
  for (double p : probs) row.push_back(static_cast<float>(std::log(p)));
  for (float t : {1.0f, 2.0f}) {
    std::vector<int> count(5, 0);
    v1::RowSampling r = Sampled(t, 13, 0);
    r.set_min_p(0.4f);
    for (uint64_t i = 0; i < 400; ++i) {
      r.set_draw_index(i);
      ++count[One(row, r)];
    }
    EXPECT_EQ(count[0], 0) << "T " << t;
    if (t == 1.0f) {
      EXPECT_EQ(count[2] + count[4], 0);
    } else {
      EXPECT_GT(count[2], 0);
      EXPECT_GT(count[4], 0);
    }
  }
}

// 20k draws of a 5-token row with temperature, top_p and min_p: frequencies match the reference
// (min_p, then top_p over the renormalized rest). Each frequency has a standard deviation of at
// most sqrt(0.25 / 20000) = 0.0035, so 0.02 is over 5 of them; a wrong order of min_p and top_p or
// a missing renormalization moves some probability by more than 0.05 here.
TEST_F(SamplerTest, DrawsFollowTheRenormalizedDistribution) {
  const std::vector<float> row = {2.0f, 1.2f, -0.5f, 0.0f, 1.0f};
  v1::RowSampling r = Sampled(0.8f, 2024, 0, 0, 0.8f);
  r.set_min_p(0.15f);
  const std::vector<double> want = Distribution(std::vector<double>(row.begin(), row.end()), r);
  int masked = 0;
  for (double p : want) masked += p == 0;
  ASSERT_GE(masked, 2) << "the setting should drop tokens through both min_p and top_p";

  constexpr int kDraws = 20000, kRowsPerStep = kMaxRows;
  std::vector<int> count(row.size(), 0);
  std::vector<float> logits;
  for (int i = 0; i < kRowsPerStep; ++i) logits.insert(logits.end(), row.begin(), row.end());
  for (int step = 0; step < kDraws / kRowsPerStep; ++step) {
    std::vector<v1::RowSampling> rows(kRowsPerStep, r);
    for (int i = 0; i < kRowsPerStep; ++i) rows[i].set_draw_index(step * kRowsPerStep + i);
    absl::StatusOr<v1::StepResult> result = Run(logits, 5, rows);
    ASSERT_TRUE(result.ok()) << result.status();
    for (int32_t id : result->sampled_ids()) ++count[id];
  }
  double max_error = 0;
  for (size_t i = 0; i < row.size(); ++i) {
    if (want[i] == 0) {
      EXPECT_EQ(count[i], 0) << "token " << i;
    }
    max_error = std::max(max_error, std::abs(static_cast<double>(count[i]) / kDraws - want[i]));
  }
  std::printf("    5-token row, T 0.8, top_p 0.8, min_p 0.15: max |freq - p| %.4f over %d draws\n", max_error, kDraws);
  EXPECT_LT(max_error, 0.02);
}

// ---- Batch independence and routing ------------------------------------------------------------

TEST_F(SamplerTest, RowsDoNotDependOnTheRestOfTheBatch) {
  const int64_t v = 500;
  const std::vector<float> row = Random(v, -5.0f, 5.0f);
  v1::RowSampling host = Sampled(0.9f, 77, 3, 40, 0.95f);
  host.set_min_p(0.02f);
  host.set_repetition_penalty(1.2f);
  host.set_logprobs(true);
  host.set_top_logprobs(3);
  for (int32_t id : {1, 2, 3}) host.add_penalty_output_ids(id);
  const v1::RowSampling plain = Sampled(1.1f, 78, 4, 0, 0.9f);
  v1::RowSampling greedy_lp = Greedy();
  greedy_lp.set_logprobs(true);

  // The batch: 8 different rows, the row under test at position 3.
  std::vector<v1::RowSampling> others = {Greedy(), Sampled(0.7f, 1, 1), Sampled(1.5f, 2, 2, 5), Greedy(),
                                         Sampled(1.0f, 3, 3), Greedy(), Sampled(0.5f, 4, 4)};
  others[2].set_min_p(0.1f);
  others[4].set_logprobs(true);
  others[6].set_presence_penalty(1.0f);
  others[6].add_penalty_output_ids(0);
  for (const v1::RowSampling& subject : {host, plain, greedy_lp}) {
    for (uint64_t draw = 0; draw < 20; ++draw) {
      v1::RowSampling s = subject;
      s.set_draw_index(draw);
      absl::StatusOr<v1::StepResult> alone = Run(row, v, {s});
      ASSERT_TRUE(alone.ok()) << alone.status();

      std::vector<v1::RowSampling> rows = others;
      rows.insert(rows.begin() + 3, s);
      std::vector<float> logits;
      for (int i = 0; i < 8; ++i) {
        const std::vector<float> other = i == 3 ? row : Random(v, -5.0f, 5.0f);
        logits.insert(logits.end(), other.begin(), other.end());
      }
      absl::StatusOr<v1::StepResult> batched = Run(logits, v, rows);
      ASSERT_TRUE(batched.ok()) << batched.status();
      ASSERT_EQ(batched->sampled_ids_size(), 8);
      EXPECT_EQ(batched->sampled_ids(3), alone->sampled_ids(0)) << "draw " << draw;
      if (s.logprobs()) {
        EXPECT_EQ(batched->logprobs(3).SerializeAsString(), alone->logprobs(0).SerializeAsString());
      }
    }
  }
}

TEST_F(SamplerTest, NeutralExtrasDrawWhatThePlainPathDraws) {
  const int64_t v = 300;
  for (int trial = 0; trial < 50; ++trial) {
    const std::vector<float> row = Random(v, -6.0f, 6.0f);
    v1::RowSampling plain = Sampled(0.6f + trial % 5 * 0.2f, 31, trial, trial % 3 == 0 ? 30 : 0,
                                    trial % 2 == 0 ? 0.85f : 0.0f);
    v1::RowSampling neutral = plain;  // the host path, with nothing that changes the row
    neutral.set_logprobs(true);
    neutral.set_top_logprobs(1);
    neutral.set_repetition_penalty(trial % 2 == 0 ? 1.0f : 0.0f);
    neutral.add_penalty_prompt_ids(0);  // ids with penalties off
    const int32_t want = One(row, plain);
    EXPECT_EQ(One(row, neutral), want) << "trial " << trial;
    DeviceLikeBackend device_like;  // and the same through the copy-to-host path
    std::vector<float> two_rows = row;
    two_rows.insert(two_rows.end(), row.begin(), row.end());
    absl::StatusOr<v1::StepResult> result = Run(two_rows, v, {neutral, plain}, &device_like);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->sampled_ids(0), want) << "trial " << trial;
    EXPECT_EQ(result->sampled_ids(1), want) << "trial " << trial;
    EXPECT_GT(device_like.copies_to_host, 0);
  }
}

// ---- allowed_ids and bad words -------------------------------------------------------------

// allowed_ids: only those ids are chosen, greedy or drawn, and the logprobs stay the raw logits'.
// Bad words: a one-id word is never chosen; a longer one's last id only where its other ids end the
// output so far (penalty_output_ids). Bans that would leave nothing yield. The CPU and a device-like
// backend agree.
TEST_F(SamplerTest, AllowedIdsAndBadWordsRestrictTheChoice) {
  const int64_t v = 50;
  std::vector<float> row = Random(v, -2.0f, 2.0f);
  row[7] = 9.0f;  // the argmax
  row[8] = 8.0f;
  row[9] = 7.0f;
  const std::vector<double> logsoftmax = LogSoftmax(row);
  v1::RowSampling allowed = Greedy();
  allowed.add_allowed_ids(30);
  allowed.add_allowed_ids(9);
  allowed.set_logprobs(true);
  v1::RowSampling word = Greedy();  // {3, 7}: 7 banned after a 3 only
  word.add_bad_word_ids(3);
  word.add_bad_word_ids(7);
  word.add_bad_word_lengths(2);
  v1::RowSampling after = word;
  after.add_penalty_output_ids(5);
  after.add_penalty_output_ids(3);
  v1::RowSampling single = Greedy();  // {7} and {8}: both always banned
  for (int32_t id : {7, 8}) {
    single.add_bad_word_ids(id);
    single.add_bad_word_lengths(1);
  }
  v1::RowSampling yields = allowed;  // bans 9 and 30, all that is allowed: they yield
  for (int32_t id : {9, 30}) {
    yields.add_bad_word_ids(id);
    yields.add_bad_word_lengths(1);
  }
  std::vector<float> logits;
  for (int i = 0; i < 5; ++i) logits.insert(logits.end(), row.begin(), row.end());
  for (Backend* backend : {cpu_.get(), static_cast<Backend*>(nullptr)}) {
    DeviceLikeBackend device_like;
    absl::StatusOr<v1::StepResult> result = Run(logits, v, {allowed, word, after, single, yields}, backend ? backend : &device_like);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(std::vector<int32_t>(result->sampled_ids().begin(), result->sampled_ids().end()),
              (std::vector<int32_t>{9, 7, 8, 9, 9}));
    EXPECT_NEAR(result->logprobs(0).logprob(), logsoftmax[9], kLogprobTolerance);
  }
  // Drawn with temperature, only allowed ids ever come.
  v1::RowSampling drawn = Sampled(2.0f, 5, 0);
  for (int32_t id : {1, 2, 40}) drawn.add_allowed_ids(id);
  for (uint64_t draw = 0; draw < 200; ++draw) {
    drawn.set_draw_index(draw);
    const int32_t id = One(row, drawn);
    EXPECT_TRUE(id == 1 || id == 2 || id == 40) << "draw " << draw << " chose " << id;
  }
}

// ---- Bad parameters --------------------------------------------------------------------------

TEST_F(SamplerTest, EachInvalidParameterIsInvalidArgumentNamingIt) {
  const int64_t v = 10;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    std::string field;
    std::function<void(v1::RowSampling*)> set;
  };
  const std::vector<Case> cases = {
      {"temperature", [](auto* r) { r->set_temperature(-0.1f); }},
      {"temperature", [&](auto* r) { r->set_temperature(nan); }},
      {"temperature", [](auto* r) { r->set_temperature(kInf); }},
      {"top_k", [](auto* r) { r->set_top_k(-1); }},
      {"top_p", [](auto* r) { r->set_top_p(1.5f); }},
      {"top_p", [](auto* r) { r->set_top_p(-0.1f); }},
      {"top_p", [&](auto* r) { r->set_top_p(nan); }},
      {"min_p", [](auto* r) { r->set_min_p(1.01f); }},
      {"min_p", [](auto* r) { r->set_min_p(-0.5f); }},
      {"repetition_penalty", [](auto* r) { r->set_repetition_penalty(-1.0f); }},
      {"repetition_penalty", [](auto* r) { r->set_repetition_penalty(10.5f); }},
      {"repetition_penalty", [&](auto* r) { r->set_repetition_penalty(nan); }},
      {"presence_penalty", [](auto* r) { r->set_presence_penalty(2.5f); }},
      {"presence_penalty", [](auto* r) { r->set_presence_penalty(-kInf); }},
      {"frequency_penalty", [](auto* r) { r->set_frequency_penalty(-2.01f); }},
      {"frequency_penalty", [&](auto* r) { r->set_frequency_penalty(nan); }},
      {"top_logprobs", [](auto* r) { r->set_logprobs(true), r->set_top_logprobs(21); }},
      {"top_logprobs", [](auto* r) { r->set_logprobs(true), r->set_top_logprobs(-1); }},
      {"top_logprobs", [](auto* r) { r->set_top_logprobs(3); }},  // without logprobs
      {"penalty_prompt_ids[1]", [](auto* r) { r->add_penalty_prompt_ids(0), r->add_penalty_prompt_ids(10); }},
      {"penalty_prompt_ids[0]", [](auto* r) { r->add_penalty_prompt_ids(-1); }},
      {"penalty_output_ids[0]", [](auto* r) { r->add_penalty_output_ids(v); }},
      {"logit_bias_values[0]", [](auto* r) { r->add_logit_bias_ids(1), r->add_logit_bias_values(100.5f); }},
      {"logit_bias_values[0]", [&](auto* r) { r->add_logit_bias_ids(1), r->add_logit_bias_values(nan); }},
      {"logit_bias_ids", [](auto* r) { r->add_logit_bias_ids(1); }},  // no value
      {"logit_bias_ids[0]", [](auto* r) { r->add_logit_bias_ids(v), r->add_logit_bias_values(1); }},
      {"min_tokens", [](auto* r) { r->set_min_tokens(-1); }},
      {"min_tokens_banned_ids[0]", [](auto* r) { r->set_min_tokens(2), r->add_min_tokens_banned_ids(-3); }},
      {"allowed_ids[1]", [](auto* r) { r->add_allowed_ids(2), r->add_allowed_ids(v); }},
      {"bad_word_lengths[0]", [](auto* r) { r->add_bad_word_lengths(0); }},
      {"bad_word_ids", [](auto* r) { r->add_bad_word_lengths(2), r->add_bad_word_ids(1); }},
      {"bad_word_ids[0]", [](auto* r) { r->add_bad_word_lengths(1), r->add_bad_word_ids(-1); }},
  };
  for (const Case& c : cases) {
    v1::RowSampling bad = Sampled(1.0f, 1, 1);
    c.set(&bad);
    absl::StatusOr<v1::StepResult> result = Run(std::vector<float>(2 * v, 0.0f), v, {Greedy(), bad});
    ASSERT_FALSE(result.ok()) << c.field;
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
    const std::string message(result.status().message());
    EXPECT_NE(message.find("step 7 row 1: " + c.field), std::string::npos) << message;

    RowList list;
    *list.Add() = Greedy();
    *list.Add() = bad;
    EXPECT_EQ(CheckRowSampling(7, list, v).code(), absl::StatusCode::kInvalidArgument) << c.field;
  }
  // The edges of every range are valid.
  v1::RowSampling edge = Sampled(1.0f, 1, 1, 0, 1.0f);
  edge.set_min_p(1.0f);
  edge.set_repetition_penalty(10.0f);
  edge.set_presence_penalty(-2.0f);
  edge.set_frequency_penalty(2.0f);
  edge.set_logprobs(true);
  edge.set_top_logprobs(20);
  edge.add_penalty_prompt_ids(v - 1);
  edge.add_penalty_output_ids(0);
  absl::StatusOr<v1::StepResult> ok = Run(Random(v, -1, 1), v, {edge});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->logprobs(0).top_ids_size(), v);  // top_logprobs 20 over a 10-token vocabulary
}

// Valid but extreme parameters must not overflow the logits into an error (which would fail the
// worker for one request's parameters): a temperature below 1e-5 is greedy, and a tiny
// repetition penalty makes its token overwhelmingly likely, not +inf.
TEST_F(SamplerTest, ExtremeValidParametersDoNotOverflow) {
  const std::vector<float> row = {1.0f, 3.0f, 2.0f, 0.5f};
  for (float t : {1e-30f, std::numeric_limits<float>::denorm_min(), 9e-6f}) {
    v1::RowSampling r = Sampled(t, 1, 2);
    EXPECT_EQ(One(row, r), 1) << "temperature " << t;
    r.set_logprobs(true);
    r.set_min_p(0.5f);
    EXPECT_EQ(One(row, r), 1) << "temperature " << t;
  }
  v1::RowSampling tiny = Sampled(0.5f, 1, 2);
  tiny.set_repetition_penalty(std::numeric_limits<float>::denorm_min());
  tiny.add_penalty_prompt_ids(3);
  tiny.add_penalty_prompt_ids(0);  // both now at the +1e30 cap: a tie between 0 and 3
  for (uint64_t draw = 0; draw < 20; ++draw) {
    tiny.set_draw_index(draw);
    const int32_t got = One(row, tiny);
    EXPECT_TRUE(got == 0 || got == 3) << got;
  }
}

TEST_F(SamplerTest, RejectsLogitsOfTheWrongShape) {
  // 3 rows of logits for 2 rows of sampling, and a vocabulary of 9 for a sampler of 10.
  absl::StatusOr<std::unique_ptr<Sampler>> sampler = Sampler::Create(cpu_.get(), kMaxRows, 10);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  std::vector<float> zeros(30, 0.0f);
  RowList two;
  *two.Add() = Greedy();
  *two.Add() = Greedy();
  v1::StepResult result;
  EXPECT_EQ((*sampler)->Sample(1, Tensor(zeros.data(), DType::kF32, {3, 10}), two, &result).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*sampler)->Sample(1, Tensor(zeros.data(), DType::kF32, {2, 9}), two, &result).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*sampler)->Sample(1, Tensor(zeros.data(), DType::kF32, {2, 10}), two, &result).ok());
  std::vector<v1::RowSampling> too_many(kMaxRows + 1, Greedy());
  EXPECT_EQ(Run(std::vector<float>(10 * (kMaxRows + 1), 0.0f), 10, too_many).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A row whose logits hold a NaN or an infinity (the model overflowed for that sequence) is reported
// in non_finite_rows, with id 0 and no logprobs, on every path it would have taken; the other rows
// of the step are sampled exactly as alone, and the step succeeds (one sequence's numeric failure
// is not the worker's). On the CPU backend and on one that is not the CPU (device rows, copies).
TEST_F(SamplerTest, NonFiniteRowsAreReportedAndTheOtherRowsSampledAsAlone) {
  const int64_t v = 300;
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  v1::RowSampling host = Sampled(0.8f, 5, 6, 20);
  host.set_logprobs(true);
  host.set_top_logprobs(2);
  v1::RowSampling greedy_lp = Greedy();
  greedy_lp.set_logprobs(true);
  v1::RowSampling penalized = Greedy();
  penalized.set_repetition_penalty(1.5f);
  penalized.add_penalty_output_ids(7);
  // Row i: sampling, and the value written into its logits at column 11 (0: none).
  const std::vector<std::pair<v1::RowSampling, float>> cases = {
      {Greedy(), 0},          {Greedy(), kNaN},      {Sampled(1.0f, 1, 2), kInf}, {Sampled(0.7f, 3, 4), 0},
      {host, -kInf},          {host, 0},             {greedy_lp, kNaN},           {penalized, kInf},
      {penalized, 0},         {Sampled(1.2f, 8, 9), -kInf}, {Greedy(), 0}};
  const std::vector<int32_t> want_non_finite = {1, 2, 4, 6, 7, 9};
  DeviceLikeBackend device_like;
  for (Backend* backend : {cpu_.get(), static_cast<Backend*>(&device_like)}) {
    SCOPED_TRACE(backend->Describe());
    std::vector<float> logits;
    std::vector<v1::RowSampling> rows;
    std::vector<std::vector<float>> row_logits;
    for (const auto& [sampling, bad] : cases) {
      std::vector<float> row = Random(v, -4.0f, 4.0f);
      if (bad != 0) row[11] = bad;
      logits.insert(logits.end(), row.begin(), row.end());
      rows.push_back(sampling);
      row_logits.push_back(row);
    }
    absl::StatusOr<v1::StepResult> batched = Run(logits, v, rows, backend);
    ASSERT_TRUE(batched.ok()) << batched.status();
    EXPECT_EQ(std::vector<int32_t>(batched->non_finite_rows().begin(), batched->non_finite_rows().end()),
              want_non_finite);
    ASSERT_EQ(batched->sampled_ids_size(), static_cast<int>(cases.size()));
    ASSERT_EQ(batched->logprobs_size(), static_cast<int>(cases.size()));
    for (size_t i = 0; i < cases.size(); ++i) {
      SCOPED_TRACE(i);
      if (cases[i].second != 0) {
        EXPECT_EQ(batched->sampled_ids(i), 0);
        EXPECT_EQ(batched->logprobs(i).ByteSizeLong(), 0u);
        continue;
      }
      absl::StatusOr<v1::StepResult> alone = Run(row_logits[i], v, {rows[i]}, backend);
      ASSERT_TRUE(alone.ok()) << alone.status();
      EXPECT_EQ(alone->non_finite_rows_size(), 0);
      EXPECT_EQ(batched->sampled_ids(i), alone->sampled_ids(0));
      if (rows[i].logprobs()) {
        EXPECT_EQ(batched->logprobs(i).SerializeAsString(), alone->logprobs(0).SerializeAsString());
      }
    }
  }
}

// ---- In the worker's step ----------------------------------------------------------------------

// A whole fixture model (`layers` layers) in one CPU worker.
absl::StatusOr<std::unique_ptr<StepExecutor>> WholeModelWorker(const std::string& fixture, int layers,
                                                                std::optional<CpuMatMul> matmul = std::nullopt,
                                                                int64_t num_kv_blocks = 16) {
  // (a fixture's name, or an absolute path to a model)
  const std::string model =
      fixture.front() == '/' ? fixture : std::string(SHARDSERVE_SOURCE_DIR) + "/tests/fixtures/models/" + fixture;
  return CpuWorker(WholeModelAssignment(model, layers,
                                        StepLimits{.max_tokens_per_step = 16, .max_seqs_per_step = 4, .block_size = 4,
                                                   .num_kv_blocks = num_kv_blocks, .max_model_len = 4 * 4}),
                   matmul);
}

// A worker refuses a KV cache that int32 slots cannot address (more than kMaxKvCacheTokens
// tokens) with the field named, before it allocates anything; the bound is the slots', not a
// lower one (an H100 planned 4.6M blocks of 16 for the demo model, 74M tokens, and must get them).
TEST(StepExecutorAssignment, KvCacheIsBoundedByInt32Slots) {
  const int64_t max_blocks = kMaxKvCacheTokens / 4;  // blocks of 4 tokens
  for (int64_t blocks : {int64_t{0}, max_blocks + 1, int64_t{1} << 62}) {
    absl::StatusOr<std::unique_ptr<StepExecutor>> executor = WholeModelWorker("llama_gqa", 5, std::nullopt, blocks);
    ASSERT_FALSE(executor.ok()) << blocks << " blocks";
    EXPECT_EQ(executor.status().code(), absl::StatusCode::kInvalidArgument) << executor.status();
    const std::string want = absl::StrCat("num_kv_blocks ", blocks, " outside [1, ", max_blocks, "]");
    EXPECT_NE(executor.status().message().find(want), std::string::npos) << executor.status();
  }
}

// A new sequence for a stateful plan: its blocks, settings and prompt length.
void AddNewSeq(v1::StepPlan* plan, uint64_t id, std::vector<int32_t> blocks, const v1::RowSampling& sampling,
               int32_t prompt_len) {
  v1::NewSeq* n = plan->add_new_seqs();
  n->set_seq_id(id);
  n->mutable_block_ids()->Add(blocks.begin(), blocks.end());
  *n->mutable_sampling() = sampling;
  n->set_prompt_len(prompt_len);
}

// A row of a stateful plan: `tokens` fed to `id` from `start`.
void AddRow(v1::StepPlan* plan, uint64_t id, int32_t start, std::vector<int32_t> tokens, bool sample) {
  plan->mutable_token_ids()->Add(tokens.begin(), tokens.end());
  plan->add_row_seq_ids(id);
  plan->add_row_start_positions(start);
  plan->add_row_num_tokens(static_cast<int32_t>(tokens.size()));
  plan->add_row_samples(sample);
}

// The sampler inside StepExecutor (the whole llama_gqa fixture in one worker): a step of two
// prefilling sequences gets one id per logit row and logprobs for the row that asks; the next
// step decodes one of them from the state the first left (only its token travels); a step with a
// bad sampling parameter fails before the forward pass with the field named, and so does a row
// for a sequence the worker does not hold.
TEST(StepExecutorSampling, SamplesEveryLogitRowWithTheSampler) {
  absl::StatusOr<std::unique_ptr<StepExecutor>> executor = WholeModelWorker("llama_gqa", 5);
  ASSERT_TRUE(executor.ok()) << executor.status();

  // Sequence 10: tokens 5, 6, 7 in block 3; sequence 11: tokens 8, 9 in block 9.
  v1::StepPlan plan;
  plan.set_step_id(1);
  v1::RowSampling greedy;
  greedy.set_logprobs(true);
  greedy.set_top_logprobs(3);
  AddNewSeq(&plan, 10, {3}, greedy, 3);
  AddNewSeq(&plan, 11, {9}, Sampled(0.7f, 5, 0, 10, 0.9f), 2);
  AddRow(&plan, 10, 0, {5, 6, 7}, true);
  AddRow(&plan, 11, 0, {8, 9}, true);
  v1::StepResult result;
  ASSERT_TRUE((*executor)->Execute(plan, &result).ok());
  ASSERT_EQ(result.sampled_ids_size(), 2);
  ASSERT_EQ(result.logprobs_size(), 2);
  const v1::RowLogprobs& lp = result.logprobs(0);
  ASSERT_EQ(lp.top_ids_size(), 3);
  EXPECT_EQ(lp.top_ids(0), result.sampled_ids(0));  // greedy picks the most likely
  EXPECT_EQ(lp.top_logprobs(0), lp.logprob());
  EXPECT_LT(lp.logprob(), 0.0f);
  EXPECT_GE(lp.top_logprobs(0), lp.top_logprobs(1));
  EXPECT_EQ(result.logprobs(1).top_ids_size(), 0);
  EXPECT_GE(result.sampled_ids(1), 0);
  EXPECT_LT(result.sampled_ids(1), 512);

  // Decode sequence 10: its token at position 3, the last slot of block 3.
  v1::StepPlan decode;
  decode.set_step_id(2);
  AddRow(&decode, 10, 3, {result.sampled_ids(0)}, true);
  ASSERT_TRUE((*executor)->Execute(decode, &result).ok());
  ASSERT_EQ(result.sampled_ids_size(), 1);

  // A new sequence with min_p 2 samples in row 1 of step 3.
  v1::StepPlan bad_min_p;
  bad_min_p.set_step_id(3);
  v1::RowSampling min_p = Greedy();
  min_p.set_min_p(2.0f);
  AddNewSeq(&bad_min_p, 12, {4}, min_p, 1);
  AddRow(&bad_min_p, 11, 2, {result.sampled_ids(0)}, true);
  AddRow(&bad_min_p, 12, 0, {5}, true);
  const absl::Status bad = (*executor)->Execute(bad_min_p, &result);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
  EXPECT_NE(bad.message().find("step 3 row 1: min_p"), std::string::npos) << bad;

  absl::StatusOr<std::unique_ptr<StepExecutor>> fresh = WholeModelWorker("llama_gqa", 5);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  const absl::Status unknown = (*fresh)->Execute(decode, &result);
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInvalidArgument) << unknown;
  EXPECT_NE(unknown.message().find("step 2: row 0 names seq 10, which this worker does not hold"), std::string::npos)
      << unknown;
}

// A real model whose logits overflow for one sequence (tests/overflowing_fixture.h: one token's
// embedding overflows to inf, then NaN): the step succeeds, that row is reported in non_finite_rows,
// and a sequence without the token in the same step gets the token it gets alone, before and after,
// also in the KV blocks the failed sequence filled with NaN.
TEST(StepExecutorSampling, ASequenceWhoseLogitsAreNotFiniteIsReportedAndTheOthersGoOn) {
  char pattern[] = "/tmp/overflowing_gemma.XXXXXX";
  const std::string dir = mkdtemp(pattern);
  const absl::Status written = WriteOverflowingGemma(dir);
  ASSERT_TRUE(written.ok()) << written;
  absl::StatusOr<std::unique_ptr<StepExecutor>> executor = WholeModelWorker(dir, 4);
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(executor.ok()) << executor.status();
  const std::vector<int32_t> clean = {39, 252, 211, 166}, bad = {39, kOverflowingToken, 211};
  v1::RowSampling sampled = Sampled(0.8f, 3, 0);
  sampled.set_logprobs(true);

  // Step 1: sequence 10, alone.
  v1::StepPlan alone;
  alone.set_step_id(1);
  AddNewSeq(&alone, 10, {0}, Greedy(), 4);
  AddRow(&alone, 10, 0, clean, true);
  v1::StepResult result;
  ASSERT_TRUE((*executor)->Execute(alone, &result).ok());
  ASSERT_EQ(result.sampled_ids_size(), 1);
  EXPECT_EQ(result.non_finite_rows_size(), 0);
  const int32_t want = result.sampled_ids(0);

  // Step 2: the same prompt as sequence 20 between two sequences holding the token, greedy and
  // sampled with logprobs.
  v1::StepPlan mixed;
  mixed.set_step_id(2);
  AddNewSeq(&mixed, 11, {1}, Greedy(), 3);
  AddNewSeq(&mixed, 20, {2}, Greedy(), 4);
  AddNewSeq(&mixed, 12, {3}, sampled, 3);
  AddRow(&mixed, 11, 0, bad, true);
  AddRow(&mixed, 20, 0, clean, true);
  AddRow(&mixed, 12, 0, bad, true);
  const absl::Status s = (*executor)->Execute(mixed, &result);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_EQ(result.sampled_ids_size(), 3);
  EXPECT_EQ(std::vector<int32_t>(result.non_finite_rows().begin(), result.non_finite_rows().end()),
            (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(result.sampled_ids(1), want);

  // Step 3: a new sequence in block 1, which sequence 11 filled with NaN, gets the lone token too
  // (blocks are the coordinator's to give: a freed one goes to the next sequence as it is).
  v1::StepPlan after;
  after.set_step_id(3);
  for (uint64_t id : {10, 11, 12, 20}) after.add_freed_seq_ids(id);
  AddNewSeq(&after, 30, {1}, Greedy(), 4);
  AddRow(&after, 30, 0, clean, true);
  ASSERT_TRUE((*executor)->Execute(after, &result).ok());
  ASSERT_EQ(result.sampled_ids_size(), 1);
  EXPECT_EQ(result.non_finite_rows_size(), 0);
  EXPECT_EQ(result.sampled_ids(0), want);
}

// generate-ids' loop (GreedyGenerate) on the same model: a prompt with the token is an error
// saying the logits are not finite, where it printed the NaN's index as a token; one without it
// generates.
TEST(GreedyGenerateTest, LogitsThatAreNotFiniteAreAnErrorNotATokenId) {
  char pattern[] = "/tmp/overflowing_gemma.XXXXXX";
  const std::string dir = mkdtemp(pattern);
  const absl::Status written = WriteOverflowingGemma(dir);
  ASSERT_TRUE(written.ok()) << written;
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  LocalCommunicator tp(backend.get());
  const StepLimits limits{.max_tokens_per_step = 16, .max_seqs_per_step = 1, .block_size = 4, .num_kv_blocks = 8,
                          .max_model_len = 32};
  absl::StatusOr<std::unique_ptr<ModelShard>> model =
      ModelShard::Load(**checkpoint, *config, ShardSpec{}, limits, backend.get(), &tp);
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  absl::StatusOr<std::vector<int32_t>> bad = GreedyGenerate(model->get(), {39, kOverflowingToken, 211}, 4);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInternal) << bad.status();
  EXPECT_NE(bad.status().message().find("the model's logits after 3 tokens (0 generated) are not finite"),
            std::string::npos)
      << bad.status();
  absl::StatusOr<std::vector<int32_t>> good = GreedyGenerate(model->get(), {39, 252, 211}, 4);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(good->size(), 4u);
}

// The products' precision when the worker is not told one (--matmul-dtype auto): a bf16
// checkpoint's are bf16 where the CPU has bf16 instructions, which halves its packed weights; an
// f32 checkpoint's stay f32; a precision given explicitly wins. Whether the CPU has bf16
// instructions is read from CPUID (bf16_products.h), not from CpuHasNativeBf16MatMul(), which
// ChooseCpuMatMul asks and which is checked against it here.
TEST(StepExecutorCpuMatMul, AutoFollowsTheCheckpointDtype) {
  const bool native = CpuHasBf16Instructions();
  EXPECT_EQ(CpuHasNativeBf16MatMul(), native) << "CPUID says AVX512-BF16 " << (native ? "present" : "absent")
                                              << OneDnnIsaCap();
  EXPECT_EQ(StepExecutor::ChooseCpuMatMul(DType::kF32), CpuMatMul::kF32);
  EXPECT_EQ(StepExecutor::ChooseCpuMatMul(DType::kF16), CpuMatMul::kF32);
  EXPECT_EQ(StepExecutor::ChooseCpuMatMul(DType::kBF16), native ? CpuMatMul::kBF16 : CpuMatMul::kF32);

  absl::StatusOr<std::unique_ptr<StepExecutor>> bf16_auto = WholeModelWorker("llama_bf16", 3);
  absl::StatusOr<std::unique_ptr<StepExecutor>> bf16_f32 = WholeModelWorker("llama_bf16", 3, CpuMatMul::kF32);
  absl::StatusOr<std::unique_ptr<StepExecutor>> f32_auto = WholeModelWorker("llama_gqa", 5);
  ASSERT_TRUE(bf16_auto.ok()) << bf16_auto.status();
  ASSERT_TRUE(bf16_f32.ok()) << bf16_f32.status();
  ASSERT_TRUE(f32_auto.ok()) << f32_auto.status();
  const bool bf16_products = (*bf16_auto)->backend_name().find("bf16 products") != std::string::npos;
  EXPECT_EQ(bf16_products, native) << (*bf16_auto)->backend_name();
  EXPECT_EQ((*bf16_f32)->backend_name().find("bf16"), std::string::npos) << (*bf16_f32)->backend_name();
  EXPECT_EQ((*f32_auto)->backend_name().find("bf16"), std::string::npos) << (*f32_auto)->backend_name();
  // llama_bf16: 155k parameters in products (untied LM head), 33k in the float32 embedding table.
  if (native) {
    EXPECT_LT((*bf16_auto)->weight_bytes(), (*bf16_f32)->weight_bytes() * 3 / 4);
  } else {
    std::printf("[ note     ] this CPU has no bf16 instructions: auto chose f32 products\n");
    EXPECT_EQ((*bf16_auto)->weight_bytes(), (*bf16_f32)->weight_bytes());
  }
}

}  // namespace
}  // namespace shardserve
