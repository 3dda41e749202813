// The CUDA backend's paged KV cache ops: CacheWrite (k, v into cache slots) and Attention (online
// softmax over a sequence's cache blocks; split over the keys for small steps with
// CudaBackendOptions::split_attention_keys), their kernels and launches.
#include <algorithm>
#include <cstdint>
#include <utility>

#include "kernels/cuda/cuda_backend.cuh"
#include "kernels/cuda/device_util.cuh"

namespace shardserve::cuda {
namespace {

// One thread per element of k/v; `row` = kv_heads * head_dim elements per slot.
template <typename T>
__global__ void CacheWriteKernel(T* k_cache /*[num_slots, row]*/, T* v_cache /*[num_slots, row]*/,
                                 const T* k /*[n, row]*/, const T* v /*[n, row]*/, const int32_t* slots /*[n]*/,
                                 int64_t n, int64_t row, int64_t num_slots, unsigned* errors) {
  WaitForPriorKernels();  // CudaBackend::Launch
  GRID_STRIDE_LOOP(i, n * row) {
    const int64_t t = i / row;
    const int64_t j = i - t * row;
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= num_slots) {
      if (j == 0) atomicOr(errors, kErrCacheSlot);
      continue;
    }
    k_cache[slot * row + j] = k[i];
    v_cache[slot * row + j] = v[i];
  }
}

// ---- Attention --------------------------------------------------------------------------------
// q . k of one key, q in shared memory as float. Rows of 16 bytes' worth of T are read with one
// 16-byte load each where head_dim allows it and the row is 16-byte aligned (`vec`).
template <typename T>
__device__ __forceinline__ float DotQK(const float* q_s, const T* k, int head_dim, bool vec) {
  float dot = 0.0f;
  if (vec) {
    constexpr int kE = 16 / sizeof(T);
    const uint4* k4 = reinterpret_cast<const uint4*>(k);
    // Unrolled so that a key's loads are all in flight at once (a loop bounded by the runtime
    // head_dim waited a memory latency per load: 30 us a layer's attention at 200 keys, H200).
#pragma unroll 16
    for (int i = 0; i < head_dim / kE; ++i) {
      const uint4 raw = k4[i];
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < kE; ++j) dot += q_s[i * kE + j] * ToFloat(e[j]);
    }
  } else {
    for (int d = 0; d < head_dim; ++d) dot += q_s[d] * ToFloat(k[d]);
  }
  return dot;
}

// Four values of T as one load: 8 bytes of 16-bit values, 16 of float32.
template <typename T>
struct Raw4 {
  using type = uint2;
};
template <>
struct Raw4<float> {
  using type = float4;
};

// row[0, 4) as they are stored, 0 at and past `left` (the dims left in the head). vec: the row is
// aligned to 4 elements and 4 divides head_dim, so the four are one load.
template <typename T>
__device__ __forceinline__ typename Raw4<T>::type LoadRaw4(const T* row, int left, bool vec) {
  using R = typename Raw4<T>::type;
  if (vec) return *reinterpret_cast<const R*>(row);
  R raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int j = 0; j < 4; ++j) e[j] = j < left ? row[j] : FromFloat<T>(0.0f);
  return raw;
}

// One block per (token t, query head h); blockIdx.x = t * q_heads + h. The context (positions
// 0..p of the token's sequence) is walked in chunks of kAttnChunk keys with an online softmax:
// a running max m, running denominator l and running numerator acc[] (per output dim), rescaled
// by exp(m_old - m_new) whenever the max grows. In a chunk every thread scores one key (its whole
// q . k, so a chunk's key loads are all in flight at once), then each warp sums the weighted
// values of every kAttnWarps-th key of the chunk into its own acc[], four dims a lane, loads
// independent of each other; at the end the warps' sums are added in warp order. Every
// index taken from device metadata is checked; an out-of-range one sets an error bit and its key
// gets weight 0 (the output row is zero when nothing valid is left).
//
// AttentionOptions: with window > 0 the block walks keys (pos - window, pos] only, from the
// window's first key; with softcap > 0 each score becomes softcap * tanh(score / softcap); with
// sinks the softmax starts from the head's sink as if it were a key with no value (m = sink,
// l = 1), so the max includes it and the denominator counts it. Each is a uniform branch outside
// the inner loops, and the defaults (0, 0, null) leave the arithmetic as it was without them.
//
// kSplit (split-KV, "flash-decoding"): blockIdx.x = (t * q_heads + h) * splits + s, and the block
// walks only keys [first + s * split_keys, first + (s + 1) * split_keys) of the context (first:
// the window's first key, else 0), writing its running max, denominator and unnormalized
// numerator to partial[blockIdx.x] (head_dim + 2 floats: m, l, acc), for AttentionCombineKernel,
// which adds the sink; a range past the context (or a bad token) writes l = 0.
template <typename T, bool kSplit>
__global__ void __launch_bounds__(kAttnThreads)
    AttentionKernel(T* out /*[n, q_heads * hd]*/, const T* q /*[n, q_heads * hd]*/,
                    const T* k_cache /*[num_blocks, block_size, kv_heads, hd]*/,
                    const T* v_cache /*[num_blocks, block_size, kv_heads, hd]*/, const int32_t* positions /*[n]*/,
                    const int32_t* token_seq /*[n]*/, const int32_t* block_tables /*[num_seqs, max_blocks]*/,
                    int q_heads, int kv_heads, int head_dim, int block_size, int64_t num_blocks, int64_t num_seqs,
                    int64_t max_blocks, float scale, int64_t window, float softcap, const float* sinks /*[q_heads]*/,
                    unsigned* errors, int splits = 1, int split_keys = 0, float* partial = nullptr) {
  WaitForPriorKernels();  // CudaBackend::Launch
  __shared__ float q_s[kAttnMaxHeadDim];
  __shared__ float w_s[kAttnChunk];       // softmax weights of the chunk's keys (0: skipped)
  __shared__ int64_t base_s[kAttnChunk];  // element offset of each key's head in the cache
  __shared__ float scratch_s[32];

  const int64_t row = kSplit ? blockIdx.x / splits : blockIdx.x;  // t * q_heads + h
  const int split = static_cast<int>(blockIdx.x - row * (kSplit ? splits : 1));
  const int64_t t = row / q_heads;
  const int h = static_cast<int>(row - t * q_heads);
  const int kv_head = h / (q_heads / kv_heads);
  const T* qh = q + (t * q_heads + h) * head_dim;
  T* oh = out + (t * q_heads + h) * head_dim;

  const int64_t seq = token_seq[t];
  const int64_t pos = positions[t];
  const bool bad_seq = seq < 0 || seq >= num_seqs;
  const bool bad_pos = pos < 0 || pos / block_size >= max_blocks;
  // The keys this block walks: the context from the window's first key (AttentionOptions::window:
  // pos - j < window), or its split's range of it.
  const int64_t first = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
  const int64_t begin = kSplit ? first + static_cast<int64_t>(split) * split_keys : first;
  const int64_t end = kSplit ? min(pos + 1, begin + split_keys) : pos + 1;
  float* part = kSplit ? partial + blockIdx.x * static_cast<int64_t>(head_dim + 2) : nullptr;
  if (bad_seq || bad_pos) {  // the same for every thread of the block
    if (threadIdx.x == 0 && split == 0) atomicOr(errors, bad_seq ? kErrAttentionSeq : kErrAttentionPos);
    if constexpr (kSplit) {
      if (threadIdx.x == 0) part[0] = -INFINITY, part[1] = 0.0f;
    } else {
      for (int d = threadIdx.x; d < head_dim; d += blockDim.x) oh[d] = FromFloat<T>(0.0f);
    }
    return;
  }
  if (kSplit && begin >= end) {  // a range past the context: nothing to add
    if (threadIdx.x == 0) part[0] = -INFINITY, part[1] = 0.0f;
    return;
  }
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) q_s[d] = ToFloat(qh[d]);
  __syncthreads();

  const int32_t* table = block_tables + seq * max_blocks;
  const int64_t slot_elems = static_cast<int64_t>(kv_heads) * head_dim;
  const bool vec = head_dim % (16 / static_cast<int>(sizeof(T))) == 0 &&
                   reinterpret_cast<uintptr_t>(k_cache) % 16 == 0;  // then every head's row is aligned too
  // Without a sink, nothing yet; with one (the unsplit kernel), the sink as a key of weight
  // exp(sink - m) and no value.
  float m = -INFINITY;
  float l = 0.0f;
  if (!kSplit && sinks != nullptr) m = sinks[h], l = 1.0f;
  // This thread's sums of its warp's keys' weighted values, dims 4 lane + 128 r + [0, 4).
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  const bool vec_v = head_dim % 4 == 0 && reinterpret_cast<uintptr_t>(v_cache) % (4 * sizeof(T)) == 0;
  float acc[kAttnRuns][4];
#pragma unroll
  for (int r = 0; r < kAttnRuns; ++r) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[r][e] = 0.0f;
  }

  for (int64_t start = begin; start < end; start += kAttnChunk) {
    const int keys = static_cast<int>(end - start < kAttnChunk ? end - start : kAttnChunk);
    // This thread's key: its score, and where its head's row starts (0, with no weight, if none).
    float score = -INFINITY;
    int64_t base = 0;
    if (threadIdx.x < keys) {
      const int64_t j = start + threadIdx.x;
      const int64_t block = table[j / block_size];  // j / block_size <= pos / block_size < max_blocks
      if (block >= 0 && block < num_blocks) {
        base = (block * block_size + j % block_size) * slot_elems + static_cast<int64_t>(kv_head) * head_dim;
        score = DotQK(q_s, k_cache + base, head_dim, vec) * scale;
        if (softcap > 0.0f) score = softcap * tanhf(score / softcap);  // Gemma 2: scale, then cap
      } else {
        atomicOr(errors, kErrAttentionBlock);
      }
    }
    const float m_new = fmaxf(m, BlockAllReduce(score, MaxOp{}, scratch_s));
    if (m_new == -INFINITY) continue;  // no valid key so far (bad blocks); uniform over the block
    const float w = score == -INFINITY ? 0.0f : expf(score - m_new);
    w_s[threadIdx.x] = w;  // kAttnChunk == kAttnThreads
    base_s[threadIdx.x] = base;
    const float chunk_sum = BlockAllReduce(w, SumOp{}, scratch_s);  // its barriers also publish w_s, base_s
    const float alpha = expf(m - m_new);  // 0 on the first valid chunk (m = -inf)
    l = l * alpha + chunk_sum;
    // The chunk's weighted values: warp w takes keys w, w + kAttnWarps, ... of the chunk (all
    // kAttnChunk entries of w_s / base_s are set: a key past the chunk has weight 0, row 0), lane
    // l dims 4 l + 128 r of each, so that a thread's kAttnChunk / kAttnWarps value loads per run
    // are all in flight at once (one thread a dim walking all 128 keys waited four memory
    // latencies a chunk: 20 us a layer at 135 keys, H200).
#pragma unroll
    for (int r = 0; r < kAttnRuns; ++r) {
      const int d0 = r * kAttnRunDims + lane * 4;
      if (d0 < head_dim) {  // the same for the whole warp up to the last run
        float a[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) a[e] = acc[r][e] * alpha;
        // All of the warp's keys loaded before the first is used. A skipped key's row is read but
        // not used: a select, so that garbage there (NaN) never reaches the sum, and the loads
        // stay unconditional, independent of each other.
        // Split (decode: few blocks) all 32 of the warp's keys at once, 146 registers in bf16;
        // else (prefill: blocks enough for every SM) 16 at a time, fewer registers, more blocks
        // resident an SM.
        constexpr int kKeys = kAttnChunk / kAttnWarps, kBatch = kSplit ? kKeys : kKeys / 2;
#pragma unroll
        for (int i0 = 0; i0 < kKeys; i0 += kBatch) {
          typename Raw4<T>::type raw[kBatch];
#pragma unroll
          for (int i = 0; i < kBatch; ++i) {
            raw[i] = LoadRaw4(v_cache + base_s[(i0 + i) * kAttnWarps + warp] + d0, head_dim - d0, vec_v);
          }
#pragma unroll
          for (int i = 0; i < kBatch; ++i) {
            const float wc = w_s[(i0 + i) * kAttnWarps + warp];
            const T* vv = reinterpret_cast<const T*>(&raw[i]);
#pragma unroll
            for (int e = 0; e < 4; ++e) a[e] += wc != 0.0f ? wc * ToFloat(vv[e]) : 0.0f;
          }
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[r][e] = a[e];
      }
    }
    m = m_new;
    __syncthreads();  // weights and offsets read before the next chunk overwrites them
  }
  // The warps' sums of each dim, added in warp order by the thread that owns the dim.
  __shared__ float sums_s[kAttnWarps][kAttnMaxHeadDim];
#pragma unroll
  for (int r = 0; r < kAttnRuns; ++r) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = r * kAttnRunDims + lane * 4 + e;
      if (d < head_dim) sums_s[warp][d] = acc[r][e];
    }
  }
  __syncthreads();
  for (int d = threadIdx.x; d < head_dim; d += kAttnThreads) {
    float sum = sums_s[0][d];
#pragma unroll
    for (int w = 1; w < kAttnWarps; ++w) sum += sums_s[w][d];
    if constexpr (kSplit) {
      part[2 + d] = sum;
    } else {
      oh[d] = FromFloat<T>(l > 0.0f ? sum / l : 0.0f);
    }
  }
  if constexpr (kSplit) {
    if (threadIdx.x == 0) part[0] = m, part[1] = l;
  }
}

// One block per (token, query head): the splits' partial sums of AttentionKernel<T, true> merged
// as the online softmax merges chunks (each rescaled by exp(m_s - max m), ranges with l = 0
// skipped), then normalized and rounded once; zero when no range had a valid key. With sinks the
// head's sink joins the max and adds exp(sink - max) to the denominator, no value.
template <typename T>
__global__ void __launch_bounds__(kAttnThreads)
    AttentionCombineKernel(T* out /*[n, q_heads * hd]*/, const float* partial /*[n * q_heads * splits, hd + 2]*/,
                           int splits, int head_dim, int q_heads, const float* sinks /*[q_heads]*/) {
  WaitForPriorKernels();  // CudaBackend::Launch
  const int64_t row = blockIdx.x;  // t * q_heads + h
  const int64_t stride = head_dim + 2;
  const float* p = partial + row * splits * stride;
  float m = -INFINITY;
  for (int s = 0; s < splits; ++s) {
    if (p[s * stride + 1] > 0.0f) m = fmaxf(m, p[s * stride]);
  }
  float l = 0.0f;
  if (sinks != nullptr) {
    const float sink = sinks[row % q_heads];
    m = fmaxf(m, sink);
    l = expf(sink - m);
  }
  for (int s = 0; s < splits; ++s) {
    const float ls = p[s * stride + 1];
    if (ls > 0.0f) l += ls * expf(p[s * stride] - m);
  }
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float a = 0.0f;
    for (int s = 0; s < splits; ++s) {
      if (p[s * stride + 1] > 0.0f) a += p[s * stride + 2 + d] * expf(p[s * stride] - m);
    }
    out[row * head_dim + d] = FromFloat<T>(l > 0.0f ? a / l : 0.0f);
  }
}

}  // namespace

absl::Status CudaBackend::CheckCacheWrite(const Tensor* k_cache, const Tensor* v_cache, const Tensor& k,
                                          const Tensor& v, const Tensor& slots) {
  constexpr const char* kOp = "CacheWrite";
  if (k_cache == nullptr || v_cache == nullptr) {
    return Invalid(kOp, "k_cache and v_cache must not be null", {{"k_cache", k_cache}, {"v_cache", v_cache}});
  }
  const auto all = {std::pair<const char*, const Tensor*>{"k_cache", k_cache},
                    {"v_cache", v_cache},
                    {"k", &k},
                    {"v", &v},
                    {"slots", &slots}};
  if (!Is(*k_cache, 4, act_) || !Is(*v_cache, 4, act_) || !Is(k, 2, act_) || !Is(v, 2, act_) ||
      !Is(slots, 1, DType::kI32)) {
    return Invalid(kOp,
                   absl::StrCat("expected caches [blocks, bs, kv_heads, hd] and k, v [n, kv_heads * hd] ",
                                DTypeName(act_), ", slots [n] I32"),
                   all);
  }
  const int64_t n = k.dim(0), row = k_cache->dim(2) * k_cache->dim(3);
  if (!SameShape(*k_cache, *v_cache) || !SameShape(k, v) || k.dim(1) != row || slots.dim(0) != n) {
    return Invalid(kOp, "shapes do not match", all);
  }
  cache_limits_ = absl::StrCat("num_blocks ", k_cache->dim(0), ", block_size ", k_cache->dim(1));
  return absl::OkStatus();
}

absl::Status CudaBackend::CacheWrite(Tensor* k_cache, Tensor* v_cache, const Tensor& k, const Tensor& v,
                                     const Tensor& slots) {
  SHARDSERVE_RETURN_IF_ERROR(CheckCacheWrite(k_cache, v_cache, k, v, slots));
  const int64_t n = k.dim(0), row = k_cache->dim(2) * k_cache->dim(3);
  if (n * row == 0) return absl::OkStatus();
  const int64_t num_slots = k_cache->dim(0) * k_cache->dim(1);
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  return DispatchFloat(act_, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    SHARDSERVE_RETURN_IF_ERROR(Launch("CacheWriteKernel", CacheWriteKernel<T>, GridFor(n * row, kElementwiseThreads),
                                      kElementwiseThreads, k_cache->as<T>(), v_cache->as<T>(), k.as<const T>(),
                                      v.as<const T>(), slots.as<const int32_t>(), n, row, num_slots, errors_dev_));
    return absl::OkStatus();
  });
}

absl::Status CudaBackend::Attention(Tensor* out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                    const Tensor& positions, const Tensor& token_seq, const Tensor& block_tables,
                                    float scale, const AttentionOptions& options) {
  constexpr const char* kOp = "Attention";
  if (out == nullptr) return Invalid(kOp, "out is null", {{"q", &q}, {"k_cache", &k_cache}});
  const auto all = {std::pair<const char*, const Tensor*>{"out", out},
                    {"q", &q},
                    {"k_cache", &k_cache},
                    {"v_cache", &v_cache},
                    {"positions", &positions},
                    {"token_seq", &token_seq},
                    {"block_tables", &block_tables}};
  if (!Is(*out, 2, act_) || !Is(q, 2, act_) || !Is(k_cache, 4, act_) || !Is(v_cache, 4, act_) ||
      !Is(positions, 1, DType::kI32) || !Is(token_seq, 1, DType::kI32) || !Is(block_tables, 2, DType::kI32)) {
    return Invalid(kOp,
                   absl::StrCat("expected out, q [n, q_heads * hd] and caches [blocks, bs, kv_heads, hd] ",
                                DTypeName(act_), ", positions and token_seq [n] I32, block_tables [seqs, max_blocks] I32"),
                   all);
  }
  const int64_t n = q.dim(0), num_blocks = k_cache.dim(0), block_size = k_cache.dim(1), kv_heads = k_cache.dim(2),
                head_dim = k_cache.dim(3);
  if (!SameShape(*out, q) || !SameShape(k_cache, v_cache) || positions.dim(0) != n || token_seq.dim(0) != n) {
    return Invalid(kOp, "shapes do not match", all);
  }
  if (head_dim <= 0 || head_dim > kAttnMaxHeadDim || block_size <= 0 || kv_heads <= 0) {
    return Invalid(kOp,
                   absl::StrCat("need 0 < head_dim <= ", kAttnMaxHeadDim, ", block_size > 0 and kv_heads > 0"), all);
  }
  if (q.dim(1) % head_dim != 0 || (q.dim(1) / head_dim) % kv_heads != 0) {
    return Invalid(kOp,
                   absl::StrCat("q's width ", q.dim(1), " is not q_heads * head_dim with q_heads a multiple of kv_heads ",
                                kv_heads, " (head_dim ", head_dim, ")"),
                   all);
  }
  const int64_t q_heads = q.dim(1) / head_dim;
  SHARDSERVE_RETURN_IF_ERROR(CheckAttentionOptions(kOp, options, q_heads));
  if (n == 0 || q_heads == 0) return absl::OkStatus();
  const float* sinks = options.sinks != nullptr ? options.sinks->as<const float>() : nullptr;
  if (!FitsInt(n * q_heads) || !FitsInt(block_size)) return Invalid(kOp, "too many (token, head) pairs", all);
  attention_limits_ = absl::StrCat("seqs ", block_tables.dim(0), ", max_blocks ", block_tables.dim(1), ", num_blocks ",
                                   num_blocks, ", block_size ", block_size);
  // Split-KV: the ranges follow from the shapes alone (the longest context the block tables allow,
  // or the window where that is shorter), never from the step's positions, so a step graph
  // recorded with them replays any step.
  int splits = 1, split_keys = 0;
  if (options_.split_attention_keys > 0 && n <= kAttnSplitMaxTokens) {
    const int64_t max_context = options.window > 0 ? std::min(block_tables.dim(1) * block_size, options.window)
                                                   : block_tables.dim(1) * block_size;
    const int64_t keys = std::max<int64_t>(options_.split_attention_keys, CeilDiv(max_context, kAttnMaxSplits));
    if (keys < max_context && FitsInt(keys)) {
      split_keys = static_cast<int>(keys);
      splits = static_cast<int>(CeilDiv(max_context, keys));
    }
  }
  SHARDSERVE_RETURN_IF_ERROR(Activate());
  if (splits > 1) {
    SHARDSERVE_RETURN_IF_ERROR(
        GrowDevice(&split_dev_, &split_capacity_,
                   static_cast<size_t>(kAttnSplitMaxTokens * q_heads * kAttnMaxSplits * (head_dim + 2))));
  }
  return DispatchFloat(act_, [&](auto tag) -> absl::Status {
    using T = typename decltype(tag)::type;
    if (splits == 1) {
      SHARDSERVE_RETURN_IF_ERROR(Launch(
          "AttentionKernel", AttentionKernel<T, false>, static_cast<unsigned>(n * q_heads), kAttnThreads, out->as<T>(),
          q.as<const T>(), k_cache.as<const T>(), v_cache.as<const T>(), positions.as<const int32_t>(),
          token_seq.as<const int32_t>(), block_tables.as<const int32_t>(), static_cast<int>(q_heads),
          static_cast<int>(kv_heads), static_cast<int>(head_dim), static_cast<int>(block_size), num_blocks,
          block_tables.dim(0), block_tables.dim(1), scale, options.window, options.softcap, sinks, errors_dev_, 1, 0,
          nullptr));
      return absl::OkStatus();
    }
    SHARDSERVE_RETURN_IF_ERROR(Launch(
        "AttentionKernel<split>", AttentionKernel<T, true>, static_cast<unsigned>(n * q_heads * splits), kAttnThreads,
        out->as<T>(), q.as<const T>(), k_cache.as<const T>(), v_cache.as<const T>(), positions.as<const int32_t>(),
        token_seq.as<const int32_t>(), block_tables.as<const int32_t>(), static_cast<int>(q_heads),
        static_cast<int>(kv_heads), static_cast<int>(head_dim), static_cast<int>(block_size), num_blocks,
        block_tables.dim(0), block_tables.dim(1), scale, options.window, options.softcap, sinks, errors_dev_, splits,
        split_keys, split_dev_));
    SHARDSERVE_RETURN_IF_ERROR(Launch("AttentionCombineKernel", AttentionCombineKernel<T>,
                                      static_cast<unsigned>(n * q_heads), kAttnThreads, out->as<T>(), split_dev_,
                                      splits, static_cast<int>(head_dim), static_cast<int>(q_heads), sinks));
    return absl::OkStatus();
  });
}

}  // namespace shardserve::cuda
