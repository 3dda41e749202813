// The CPU backend's multi-head latent attention (Backend::MlaAttention): the latent cache write,
// then each (token, head) over its sequence's cached latents with kv_b_proj absorbed: the query
// taken into latent space by the head's key rows of kv_b, scores against the latents and RoPE
// keys, the softmax-weighted latent taken out by the head's value rows. Plain loops in float32.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/paged_tokens.h"

namespace shardserve::cpu {

absl::Status CpuBackend::MlaAttention(Tensor* out, const Tensor& q_nope, const Tensor& q_pe, const Tensor& kv_c,
                                      const Tensor& k_pe, const Tensor& kv_b, Tensor* cache, const Tensor& slots,
                                      const Tensor& positions, const Tensor& token_seq, const Tensor& block_tables,
                                      float scale, const MlaShape& shape) {
  const ArgCheck check("MlaAttention", {{"out", out, kF32, 2},
                                        {"q_nope", &q_nope, kF32, 2},
                                        {"q_pe", &q_pe, kF32, 2},
                                        {"kv_c", &kv_c, kF32, 2},
                                        {"k_pe", &k_pe, kF32, 2},
                                        {"kv_b", &kv_b, kF32, 2},
                                        {"cache", cache, kF32, 4},
                                        {"slots", &slots, kI32, 1},
                                        {"positions", &positions, kI32, 1},
                                        {"token_seq", &token_seq, kI32, 1},
                                        {"block_tables", &block_tables, kI32, 2}});
  SHARDSERVE_RETURN_IF_ERROR(check.Types());
  const int64_t n = q_nope.dim(0), H = shape.heads, nope = shape.nope, rope = shape.rope, v = shape.v,
                L = shape.latent, row = L + rope;
  if (H <= 0 || nope <= 0 || rope <= 0 || v <= 0 || L <= 0) {
    return check.Error(absl::StrCat("heads ", H, ", nope ", nope, ", rope ", rope, ", v ", v, " and latent ", L,
                                    " must all be > 0"));
  }
  const int64_t num_blocks = cache->dim(0), block_size = cache->dim(1);
  const int64_t max_blocks = block_tables.dim(1);
  if (out->dim(0) != n || out->dim(1) != H * v || q_nope.dim(1) != H * nope || q_pe.dim(0) != n ||
      q_pe.dim(1) != H * rope || kv_c.dim(0) != n || kv_c.dim(1) != L || k_pe.dim(0) != n || k_pe.dim(1) != rope ||
      kv_b.dim(0) != H * (nope + v) || kv_b.dim(1) != L || cache->dim(2) != 1 || cache->dim(3) != row ||
      block_size == 0 || slots.dim(0) != n || positions.dim(0) != n || token_seq.dim(0) != n) {
    return check.Error(absl::StrCat("want out [n, heads * v], q_nope [n, heads * nope], q_pe [n, heads * rope], kv_c [n, ",
                                    "latent], k_pe [n, rope], kv_b [heads * (nope + v), latent], cache [blocks, ",
                                    "block_size, 1, latent + rope], slots, positions and token_seq [n] (heads ", H,
                                    ", nope ", nope, ", rope ", rope, ", v ", v, ", latent ", L, ")"));
  }
  // Every slot, sequence, position and block-table entry in range before anything is read or written.
  const int32_t* slot = slots.as<int32_t>();
  const int32_t* pos = positions.as<int32_t>();
  const int32_t* seq = token_seq.as<int32_t>();
  const int32_t* tables = block_tables.as<int32_t>();
  for (int64_t t = 0; t < n; ++t) {
    if (slot[t] < 0 || slot[t] >= num_blocks * block_size) {
      return check.Error(absl::StrCat("token ", t, " has slot ", slot[t], ", outside the cache's ",
                                      num_blocks * block_size));
    }
  }
  if (const std::string error = PagedTokensError(block_tables, positions, token_seq, num_blocks, block_size, 0);
      !error.empty()) {
    return check.Error(error);
  }

  // The cache rows [c | k_pe], the step's own tokens first (prefill attends to them).
  float* rows = cache->as<float>();
  for (int64_t t = 0; t < n; ++t) {
    std::memcpy(rows + slot[t] * row, kv_c.as<float>() + t * L, L * sizeof(float));
    std::memcpy(rows + slot[t] * row + L, k_pe.as<float>() + t * rope, rope * sizeof(float));
  }

  int64_t context = 0;
  for (int64_t t = 0; t < n; ++t) context = std::max<int64_t>(context, int64_t{pos[t]} + 1);
  const int64_t per_thread = 2 * L + context;
  mla_scratch_.resize(static_cast<size_t>(threads_ * per_thread));
  const float* wb = kv_b.as<float>();
  const int64_t items = n * H;
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1) if (items > 1)
  for (int64_t i = 0; i < items; ++i) {
    const int64_t t = i / H, h = i % H;
    float* q_latent = mla_scratch_.data() + omp_get_thread_num() * per_thread;  // [L]
    float* o_latent = q_latent + L;                                              // [L]
    float* scores = o_latent + L;                                                // [context]
    const float* qn = q_nope.as<float>() + t * H * nope + h * nope;
    const float* qr = q_pe.as<float>() + t * H * rope + h * rope;
    const float* w_uk = wb + h * (nope + v) * L;  // [nope, L]
    const float* w_uv = w_uk + nope * L;          // [v, L]
    // q_latent = W_UK_h^T q_nope_h
    std::fill(q_latent, q_latent + L, 0.0f);
    for (int64_t d = 0; d < nope; ++d) {
      const float qd = qn[d];
      for (int64_t l = 0; l < L; ++l) q_latent[l] += qd * w_uk[d * L + l];
    }
    // scores over the sequence's positions 0..p, softmax in float32 with the max subtracted
    const int32_t* table = tables + seq[t] * max_blocks;
    const int64_t keys = int64_t{pos[t]} + 1;
    float max_score = -INFINITY;
    for (int64_t j = 0; j < keys; ++j) {
      const float* kj = rows + (int64_t{table[j / block_size]} * block_size + j % block_size) * row;
      float s = 0.0f;
      for (int64_t l = 0; l < L; ++l) s += q_latent[l] * kj[l];
      for (int64_t d = 0; d < rope; ++d) s += qr[d] * kj[L + d];
      scores[j] = s * scale;
      max_score = std::max(max_score, scores[j]);
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < keys; ++j) sum += (scores[j] = std::exp(scores[j] - max_score));
    const float inv = 1.0f / sum;
    // o_latent = sum_j p_j c_j; out_h = W_UV_h o_latent
    std::fill(o_latent, o_latent + L, 0.0f);
    for (int64_t j = 0; j < keys; ++j) {
      const float* kj = rows + (int64_t{table[j / block_size]} * block_size + j % block_size) * row;
      const float p = scores[j] * inv;
      for (int64_t l = 0; l < L; ++l) o_latent[l] += p * kj[l];
    }
    float* o = out->as<float>() + t * H * v + h * v;
    for (int64_t d = 0; d < v; ++d) {
      float s = 0.0f;
      for (int64_t l = 0; l < L; ++l) s += w_uv[d * L + l] * o_latent[l];
      o[d] = s;
    }
  }
  return absl::OkStatus();
}

}  // namespace shardserve::cpu
