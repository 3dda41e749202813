// The CUDA backend's multi-head latent attention (Backend::MlaAttention; DeepSeek-V2/V3): the latent
// cache write, then one block per (token, head) over its sequence's cached latents with kv_b_proj
// absorbed, as the CPU backend computes it (kernels/cpu/mla_attention.cc): the query taken into
// latent space by the head's key rows of kv_b, scores against the cached latents and RoPE keys
// with an online softmax, the weighted latent taken out by the head's value rows.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include "kernels/cuda/cuda_backend.cuh"
#include "kernels/cuda/device_util.cuh"

namespace shardserve::cuda {
namespace {

// One block of kMlaThreads per (token, head). The latent width (kv_lora_rank: 512 in DeepSeek-V3
// and Kimi K2) is at most kMlaMaxLatent, so each thread owns kMlaLatentPerThread dims of the
// weighted latent; the query's parts fit in shared memory (qk_nope_head_dim 128, qk_rope_head_dim
// 64 in those models). Keys are walked in chunks of kMlaChunk: warp w scores keys w, w + 8, ... of
// the chunk (its lanes split the cache row, so each key's row is read coalesced), then every
// thread adds the chunk's weighted latents for its dims (coalesced across the block).
constexpr int kMlaThreads = 256;
constexpr int kMlaWarps = kMlaThreads / 32;
constexpr int kMlaChunk = 32;
constexpr int kMlaMaxLatent = 1024;
constexpr int kMlaMaxNope = 256;
constexpr int kMlaMaxRope = 128;
constexpr int kMlaLatentPerThread = kMlaMaxLatent / kMlaThreads;

// One thread per element of the cache rows [kv_c | k_pe] of the step's tokens.
template <typename T>
__global__ void MlaCacheWriteKernel(T* cache /*[num_slots, latent + rope]*/, const T* kv_c /*[n, latent]*/,
                                    const T* k_pe /*[n, rope]*/, const int32_t* slots /*[n]*/, int64_t n, int latent,
                                    int rope, int64_t num_slots, unsigned* errors) {
  WaitForPriorKernels();  // CudaBackend::Launch
  const int64_t row = latent + rope;
  GRID_STRIDE_LOOP(i, n * row) {
    const int64_t t = i / row;
    const int64_t j = i - t * row;
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= num_slots) {
      if (j == 0) atomicOr(errors, kErrCacheSlot);
      continue;
    }
    cache[slot * row + j] = j < latent ? kv_c[t * latent + j] : k_pe[t * rope + (j - latent)];
  }
}

// blockIdx.x = t * heads + h. Every index taken from device metadata is checked: a bad sequence or
// position zeroes the head's output and sets an error bit; a bad block-table entry sets one and its
// key gets weight 0 (the output is zero when no valid key is left), as AttentionKernel does.
template <typename T>
__global__ void __launch_bounds__(kMlaThreads)
    MlaAttentionKernel(T* out /*[n, heads * v]*/, const T* q_nope /*[n, heads * nope]*/,
                       const T* q_pe /*[n, heads * rope]*/, const T* cache /*[num_blocks * block_size, latent + rope]*/,
                       const T* kv_b /*[heads * (nope + v), latent]*/, const int32_t* positions /*[n]*/,
                       const int32_t* token_seq /*[n]*/, const int32_t* block_tables /*[num_seqs, max_blocks]*/,
                       int heads, int nope, int rope, int v, int latent, int block_size, int64_t num_blocks,
                       int64_t num_seqs, int64_t max_blocks, float scale, unsigned* errors) {
  WaitForPriorKernels();  // CudaBackend::Launch
  __shared__ float qn_s[kMlaMaxNope];
  __shared__ float qpe_s[kMlaMaxRope];
  __shared__ float lat_s[kMlaMaxLatent];  // the query in latent space, then the weighted latent
  __shared__ float score_s[kMlaChunk];    // the chunk's scores (-inf: no key)
  __shared__ int64_t base_s[kMlaChunk];   // element offset of each key's cache row

  const int64_t t = blockIdx.x / heads;
  const int h = static_cast<int>(blockIdx.x - t * heads);
  T* oh = out + (t * heads + h) * v;
  const int64_t seq = token_seq[t];
  const int64_t pos = positions[t];
  const bool bad_seq = seq < 0 || seq >= num_seqs;
  const bool bad_pos = pos < 0 || pos / block_size >= max_blocks;
  if (bad_seq || bad_pos) {  // the same for every thread of the block
    if (threadIdx.x == 0 && h == 0) atomicOr(errors, bad_seq ? kErrAttentionSeq : kErrAttentionPos);
    for (int d = threadIdx.x; d < v; d += blockDim.x) oh[d] = FromFloat<T>(0.0f);
    return;
  }
  const T* w_uk = kv_b + static_cast<int64_t>(h) * (nope + v) * latent;  // [nope, latent]
  const T* w_uv = w_uk + static_cast<int64_t>(nope) * latent;             // [v, latent]
  for (int d = threadIdx.x; d < nope; d += blockDim.x) qn_s[d] = ToFloat(q_nope[(t * heads + h) * nope + d]);
  for (int d = threadIdx.x; d < rope; d += blockDim.x) qpe_s[d] = ToFloat(q_pe[(t * heads + h) * rope + d]);
  __syncthreads();
  // q_latent = W_UK_h^T q_nope_h: a thread a latent dim, each row of W_UK read across the block
  for (int l = threadIdx.x; l < latent; l += blockDim.x) {
    float s = 0.0f;
    for (int d = 0; d < nope; ++d) s += qn_s[d] * ToFloat(w_uk[static_cast<int64_t>(d) * latent + l]);
    lat_s[l] = s;
  }
  __syncthreads();

  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  const int64_t row = latent + rope;
  const int32_t* table = block_tables + seq * max_blocks;
  float m = -INFINITY;  // running max
  float l = 0.0f;       // running denominator
  float acc[kMlaLatentPerThread];
#pragma unroll
  for (int k = 0; k < kMlaLatentPerThread; ++k) acc[k] = 0.0f;
  for (int64_t start = 0; start <= pos; start += kMlaChunk) {
    const int keys = static_cast<int>(pos + 1 - start < kMlaChunk ? pos + 1 - start : kMlaChunk);
    // score_j = (q_latent . c_j + q_pe . k_pe_j) * scale
    for (int i = warp; i < kMlaChunk; i += kMlaWarps) {
      float score = -INFINITY;
      int64_t base = 0;
      if (i < keys) {
        const int64_t j = start + i;
        const int64_t block = table[j / block_size];  // j / block_size <= pos / block_size < max_blocks
        if (block >= 0 && block < num_blocks) {
          base = (block * block_size + j % block_size) * row;
          float dot = 0.0f;
          for (int e = lane; e < latent; e += 32) dot += lat_s[e] * ToFloat(cache[base + e]);
          for (int e = lane; e < rope; e += 32) dot += qpe_s[e] * ToFloat(cache[base + latent + e]);
          score = WarpAllReduce(dot, SumOp{}) * scale;
        } else if (lane == 0) {
          atomicOr(errors, kErrAttentionBlock);
        }
      }
      if (lane == 0) score_s[i] = score, base_s[i] = base;
    }
    __syncthreads();
    float chunk_max = -INFINITY;
    for (int i = 0; i < kMlaChunk; ++i) chunk_max = fmaxf(chunk_max, score_s[i]);
    const float m_new = fmaxf(m, chunk_max);
    const float alpha = m == -INFINITY ? 0.0f : expf(m - m_new);
    float chunk_sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kMlaLatentPerThread; ++k) acc[k] *= alpha;
    for (int i = 0; i < kMlaChunk; ++i) {
      if (score_s[i] == -INFINITY) continue;  // no key (past the context, or a bad block)
      const float w = expf(score_s[i] - m_new);
      chunk_sum += w;
      const T* c = cache + base_s[i];
#pragma unroll
      for (int k = 0; k < kMlaLatentPerThread; ++k) {
        const int d = threadIdx.x + k * kMlaThreads;
        if (d < latent) acc[k] += w * ToFloat(c[d]);
      }
    }
    l = l * alpha + chunk_sum;
    m = m_new;
    __syncthreads();  // the chunk's scores read before the next chunk writes them
  }
  // o_latent = sum_j softmax(score)_j c_j
#pragma unroll
  for (int k = 0; k < kMlaLatentPerThread; ++k) {
    const int d = threadIdx.x + k * kMlaThreads;
    if (d < latent) lat_s[d] = l > 0.0f ? acc[k] / l : 0.0f;
  }
  __syncthreads();
  // out_h = W_UV_h o_latent: a warp an output dim, its lanes along the row
  for (int d = warp; d < v; d += kMlaWarps) {
    const T* w_row = w_uv + static_cast<int64_t>(d) * latent;
    float s = 0.0f;
    for (int e = lane; e < latent; e += 32) s += ToFloat(w_row[e]) * lat_s[e];
    s = WarpAllReduce(s, SumOp{});
    if (lane == 0) oh[d] = FromFloat<T>(s);
  }
}

}  // namespace

absl::Status CudaBackend::MlaAttention(Tensor* out, const Tensor& q_nope, const Tensor& q_pe, const Tensor& kv_c,
                                       const Tensor& k_pe, const Tensor& kv_b, Tensor* cache, const Tensor& slots,
                                       const Tensor& positions, const Tensor& token_seq, const Tensor& block_tables,
                                       float scale, const MlaShape& shape) {
  constexpr const char* kOp = "MlaAttention";
  if (out == nullptr || cache == nullptr) {
    return Invalid(kOp, "out and cache must not be null", {{"out", out}, {"cache", cache}});
  }
  const auto all = {std::pair<const char*, const Tensor*>{"out", out},
                    {"q_nope", &q_nope},
                    {"q_pe", &q_pe},
                    {"kv_c", &kv_c},
                    {"k_pe", &k_pe},
                    {"kv_b", &kv_b},
                    {"cache", cache},
                    {"slots", &slots},
                    {"positions", &positions},
                    {"token_seq", &token_seq},
                    {"block_tables", &block_tables}};
  if (!Is(*out, 2, act_) || !Is(q_nope, 2, act_) || !Is(q_pe, 2, act_) || !Is(kv_c, 2, act_) || !Is(k_pe, 2, act_) ||
      !Is(kv_b, 2, act_) || !Is(*cache, 4, act_) || !Is(slots, 1, DType::kI32) || !Is(positions, 1, DType::kI32) ||
      !Is(token_seq, 1, DType::kI32) || !Is(block_tables, 2, DType::kI32)) {
    return Invalid(kOp,
                   absl::StrCat("expected out, q_nope, q_pe, kv_c, k_pe, kv_b 2-D and cache 4-D ", DTypeName(act_),
                                ", slots, positions and token_seq [n] I32, block_tables [seqs, max_blocks] I32"),
                   all);
  }
  const int64_t n = q_nope.dim(0), H = shape.heads, nope = shape.nope, rope = shape.rope, v = shape.v,
                L = shape.latent;
  if (H <= 0 || nope <= 0 || rope <= 0 || v <= 0 || L <= 0 || L > kMlaMaxLatent || nope > kMlaMaxNope ||
      rope > kMlaMaxRope) {
    return Invalid(kOp,
                   absl::StrCat("heads ", H, ", nope ", nope, ", rope ", rope, ", v ", v, " and latent ", L,
                                " must all be > 0, with latent <= ", kMlaMaxLatent, ", nope <= ", kMlaMaxNope,
                                " and rope <= ", kMlaMaxRope),
                   all);
  }
  const int64_t num_blocks = cache->dim(0), block_size = cache->dim(1);
  if (out->dim(0) != n || out->dim(1) != H * v || q_nope.dim(1) != H * nope || q_pe.dim(0) != n ||
      q_pe.dim(1) != H * rope || kv_c.dim(0) != n || kv_c.dim(1) != L || k_pe.dim(0) != n || k_pe.dim(1) != rope ||
      kv_b.dim(0) != H * (nope + v) || kv_b.dim(1) != L || cache->dim(2) != 1 || cache->dim(3) != L + rope ||
      block_size <= 0 || slots.dim(0) != n || positions.dim(0) != n || token_seq.dim(0) != n) {
    return Invalid(kOp,
                   absl::StrCat("want out [n, heads * v], q_nope [n, heads * nope], q_pe [n, heads * rope], kv_c [n, ",
                                "latent], k_pe [n, rope], kv_b [heads * (nope + v), latent], cache [blocks, ",
                                "block_size, 1, latent + rope], slots, positions and token_seq [n] (heads ", H,
                                ", nope ", nope, ", rope ", rope, ", v ", v, ", latent ", L, ")"),
                   all);
  }
  if (n == 0) return absl::OkStatus();
  if (!FitsInt(n * H) || !FitsInt(block_size)) return Invalid(kOp, "too many (token, head) pairs", all);
  cache_limits_ = absl::StrCat("num_blocks ", num_blocks, ", block_size ", block_size);
  attention_limits_ = absl::StrCat("seqs ", block_tables.dim(0), ", max_blocks ", block_tables.dim(1), ", num_blocks ",
                                   num_blocks, ", block_size ", block_size);
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  return DispatchFloat(act_, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    const int64_t row = L + rope;
    SHARDSERVE_RETURN_IF_ERROR(Launch("MlaCacheWriteKernel", MlaCacheWriteKernel<T>,
                                      GridFor(n * row, kElementwiseThreads), kElementwiseThreads, cache->as<T>(),
                                      kv_c.as<const T>(), k_pe.as<const T>(), slots.as<const int32_t>(), n,
                                      static_cast<int>(L), static_cast<int>(rope), num_blocks * block_size,
                                      errors_dev_));
    return Launch("MlaAttentionKernel", MlaAttentionKernel<T>, static_cast<unsigned>(n * H), kMlaThreads,
                  out->as<T>(), q_nope.as<const T>(), q_pe.as<const T>(), cache->as<const T>(), kv_b.as<const T>(),
                  positions.as<const int32_t>(), token_seq.as<const int32_t>(), block_tables.as<const int32_t>(),
                  static_cast<int>(H), static_cast<int>(nope), static_cast<int>(rope), static_cast<int>(v),
                  static_cast<int>(L), static_cast<int>(block_size), num_blocks, block_tables.dim(0),
                  block_tables.dim(1), scale, errors_dev_);
  });
}

}  // namespace shardserve::cuda
