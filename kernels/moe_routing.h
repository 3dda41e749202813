// One token's mixture-of-experts routing (Backend::MoeRoute), written once for the CPU backend and
// the CUDA kernel (compiled for both by nvcc: SHARDSERVE_MOE_HD). Sequential float32 loops, no
// arrays: the k experts are picked one at a time, each the best in top-k order (larger value, then
// lower id) after the one picked before it, so the state is the previous pick alone.
#ifndef SHARDSERVE_KERNELS_MOE_ROUTING_H_
#define SHARDSERVE_KERNELS_MOE_ROUTING_H_

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define SHARDSERVE_MOE_HD __host__ __device__
#else
#define SHARDSERVE_MOE_HD
#endif

namespace shardserve::moe {

// MoeRouter's values as ints (the kernel's parameter block is plain data).
enum : int { kRouteSoftmaxTopK = 0, kRouteTopKSoftmax = 1, kRouteSigmoidGroupTopK = 2 };

// Checked parameters of one MoeRoute call.
struct RouteParams {
  int router;
  int experts;  // E
  int k;
  bool norm_topk_prob;
  int n_group;  // <= 64
  int topk_group;
  float routed_scaling_factor;
  const float* bias;  // [E] or null
};

// Whether (va, a) comes before (vb, b) in top-k order: the larger value, then the lower index.
SHARDSERVE_MOE_HD inline bool Before(float va, int a, float vb, int b) { return va > vb || (va == vb && a < b); }

// Neither NaN nor infinite (written out: std::isfinite is not a device function).
SHARDSERVE_MOE_HD inline bool Finite(float x) { return x - x == 0.0f; }

SHARDSERVE_MOE_HD inline float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// The router's selection value of expert e for one token (its probability, logit or biased score).
// L: the logits' type, float or (on the device) a 16-bit act type, widened to float as read.
template <typename L>
struct Scores {
  const L* logits;  // [E]
  const RouteParams* p;
  float max_logit;  // kRouteSoftmaxTopK
  float inv_sum;    // kRouteSoftmaxTopK: 1 / sum(exp(logit - max))

  SHARDSERVE_MOE_HD float Logit(int e) const { return static_cast<float>(logits[e]); }
  SHARDSERVE_MOE_HD float Select(int e) const {
    switch (p->router) {
      case kRouteSoftmaxTopK:
        return expf(Logit(e) - max_logit) * inv_sum;
      case kRouteTopKSoftmax:
        return Logit(e);
      default:
        return Sigmoid(Logit(e)) + (p->bias != nullptr ? p->bias[e] : 0.0f);
    }
  }
  // DeepSeek-V3's group score: the sum of the group's two largest selection values.
  SHARDSERVE_MOE_HD float Group(int g) const {
    const int size = p->experts / p->n_group;
    int first = -1, second = -1;
    float v1 = 0.0f, v2 = 0.0f;
    for (int e = g * size; e < (g + 1) * size; ++e) {
      const float v = Select(e);
      if (first < 0 || Before(v, e, v1, first)) {
        second = first, v2 = v1;
        first = e, v1 = v;
      } else if (second < 0 || Before(v, e, v2, second)) {
        second = e, v2 = v;
      }
    }
    return v1 + v2;
  }
  // Bit g set for each of the topk_group best groups (top-k order over the group scores).
  SHARDSERVE_MOE_HD uint64_t KeptGroups() const {
    uint64_t kept = 0;
    for (int g = 0; g < p->n_group; ++g) {
      const float mine = Group(g);
      int better = 0;
      for (int h = 0; h < p->n_group && better < p->topk_group; ++h) {
        if (h != g && Before(Group(h), h, mine, g)) ++better;
      }
      if (better < p->topk_group) kept |= uint64_t{1} << g;
    }
    return kept;
  }
};

// Routes one token (its logits of type L: Scores): ids[k] and weights[k]. Returns false (writing ids -1, weights 0) when a logit or
// a selection value is not finite.
template <typename L>
SHARDSERVE_MOE_HD inline bool RouteToken(const L* logits, const RouteParams& p, int32_t* ids, float* weights) {
  const int E = p.experts;
  Scores<L> s{logits, &p, 0.0f, 1.0f};
  bool finite = true;
  float max_logit = -INFINITY;
  for (int e = 0; e < E; ++e) {
    finite = finite && Finite(s.Logit(e)) && (p.bias == nullptr || Finite(p.bias[e]));
    max_logit = fmaxf(max_logit, s.Logit(e));
  }
  if (!finite) {
    for (int i = 0; i < p.k; ++i) ids[i] = -1, weights[i] = 0.0f;
    return false;
  }
  if (p.router == kRouteSoftmaxTopK) {
    float sum = 0.0f;
    for (int e = 0; e < E; ++e) sum += expf(s.Logit(e) - max_logit);
    s.max_logit = max_logit;
    s.inv_sum = 1.0f / sum;
  }
  const bool grouped = p.router == kRouteSigmoidGroupTopK && p.n_group != p.topk_group;
  const int group_size = p.router == kRouteSigmoidGroupTopK ? E / p.n_group : E;
  // Experts of dropped groups are never picked (transformers masks them with -inf; k never exceeds
  // the kept experts).
  const uint64_t kept = grouped ? s.KeptGroups() : ~uint64_t{0};
  int prev = -1;
  float prev_v = 0.0f;
  for (int i = 0; i < p.k; ++i) {
    int best = -1;
    float best_v = 0.0f;
    for (int g = 0; g < E / group_size; ++g) {
      if (((kept >> g) & 1) == 0) continue;
      for (int e = g * group_size; e < (g + 1) * group_size; ++e) {
        const float v = s.Select(e);
        if (prev >= 0 && !Before(prev_v, prev, v, e)) continue;  // at or before the previous pick
        if (best < 0 || Before(v, e, best_v, best)) best = e, best_v = v;
      }
    }
    ids[i] = best;
    weights[i] = best_v;
    prev = best, prev_v = best_v;
  }
  switch (p.router) {
    case kRouteSoftmaxTopK:
      if (p.norm_topk_prob) {
        float sum = 0.0f;
        for (int i = 0; i < p.k; ++i) sum += weights[i];
        for (int i = 0; i < p.k; ++i) weights[i] /= sum;
      }
      break;
    case kRouteTopKSoftmax: {
      // softmax over the chosen logits; the first is their largest.
      const float m = weights[0];
      float sum = 0.0f;
      for (int i = 0; i < p.k; ++i) sum += expf(weights[i] - m);
      for (int i = 0; i < p.k; ++i) weights[i] = expf(weights[i] - m) / sum;
      break;
    }
    default: {
      // The unbiased scores of the chosen experts.
      for (int i = 0; i < p.k; ++i) weights[i] = Sigmoid(s.Logit(ids[i]));
      if (p.norm_topk_prob) {
        float sum = 0.0f;
        for (int i = 0; i < p.k; ++i) sum += weights[i];
        sum += 1e-20f;
        for (int i = 0; i < p.k; ++i) weights[i] /= sum;
      }
      for (int i = 0; i < p.k; ++i) weights[i] *= p.routed_scaling_factor;
      break;
    }
  }
  return true;
}

}  // namespace shardserve::moe

#endif  // SHARDSERVE_KERNELS_MOE_ROUTING_H_
