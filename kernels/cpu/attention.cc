// The CPU backend's paged KV cache ops: CacheWrite (k, v into cache slots) and Attention (each
// token's query heads over its sequence's cache blocks), with their vectorized inner loops.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/paged_tokens.h"
#include "kernels/cpu/tanh_avx2.h"

namespace shardserve::cpu {
namespace {

// Attention's inner loops over one KV block: `rows` cache rows of one kv head, `stride` floats
// apart, head_dim hd. A head_dim that is not a multiple of 16 (scores) or 8 (weighted sums) ends
// in a chunk padded with zeros, which adds nothing.

// Scores w[r] = (q . k_r) * scale. Each dot product keeps 16 float partial sums (lane j adds
// q[i] k_r[i] for i = j mod 16, in order; lanes 0-7 in one half, 8-15 in the other), then adds
// them pairwise: j + j+8 (the two halves), then j + j+4, j + j+2, 0 + 1. The pairwise sums of 16
// rows are done together, as a transpose: after FoldN, lane l of the result holds partial l % N
// of row l / N of the rows in a and b.
[[gnu::always_inline]] inline Vec8 Fold4(Vec8 a, Vec8 b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
}
[[gnu::always_inline]] inline Vec8 Fold2(Vec8 a, Vec8 b) {
  return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13) +
         __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15);
}
[[gnu::always_inline]] inline Vec8 Fold1(Vec8 a, Vec8 b) {
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
}

SHARDSERVE_VECTOR_CLONES void BlockScores(
    float* w, const float* q, const float* k, int64_t rows, int64_t stride, int64_t hd, float scale) {
  constexpr int64_t kRows = 2 * kVecLanes;       // rows scored together
  const int64_t full = hd - hd % (2 * kVecLanes);  // head_dim in whole 16-float steps; the rest is a padded tail
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t count = std::min(kRows, rows - r0);
    Vec8 sums[kRows];  // row r's partial sums j + j+8
    for (int64_t r = 0; r < kRows; ++r) {
      Vec8 lo = {}, hi = {};
      if (r < count) {
        const float* kr = k + (r0 + r) * stride;
        for (int64_t i = 0; i < full; i += 2 * kVecLanes) {
          lo += LoadVec(q + i) * LoadVec(kr + i);
          hi += LoadVec(q + i + kVecLanes) * LoadVec(kr + i + kVecLanes);
        }
        if (full < hd) {
          const int64_t rest = hd - full;
          lo += LoadVec(q + full, rest) * LoadVec(kr + full, rest);
          hi += LoadVec(q + full + kVecLanes, rest - kVecLanes) * LoadVec(kr + full + kVecLanes, rest - kVecLanes);
        }
      }
      sums[r] = lo + hi;
    }
    Vec8 quarter[8], eighth[4];
    for (int j = 0; j < 8; ++j) quarter[j] = Fold4(sums[2 * j], sums[2 * j + 1]);
    for (int j = 0; j < 4; ++j) eighth[j] = Fold2(quarter[2 * j], quarter[2 * j + 1]);
    StoreVec(w + r0, Fold1(eighth[0], eighth[1]) * scale, count);
    StoreVec(w + r0 + kVecLanes, Fold1(eighth[2], eighth[3]) * scale, count - kVecLanes);
  }
}

// out += sum_r p[r] v_r, in float, row by row (each element adds its rows in order), 64 elements
// of out at a time held in registers (8 independent chains), then 8 at a time.
SHARDSERVE_VECTOR_CLONES void BlockWeightedSum(
    float* out, const float* p, const float* v, int64_t rows, int64_t stride, int64_t hd) {
  constexpr int64_t kChains = 8;
  int64_t i = 0;
  for (; i + kChains * kVecLanes <= hd; i += kChains * kVecLanes) {
    Vec8 o[kChains];
    for (int64_t j = 0; j < kChains; ++j) o[j] = LoadVec(out + i + j * kVecLanes);
    for (int64_t r = 0; r < rows; ++r) {
      const float* vr = v + r * stride + i;
      for (int64_t j = 0; j < kChains; ++j) o[j] += p[r] * LoadVec(vr + j * kVecLanes);
    }
    for (int64_t j = 0; j < kChains; ++j) StoreVec(out + i + j * kVecLanes, o[j]);
  }
  for (; i < hd; i += kVecLanes) {
    const int64_t lanes = std::min(kVecLanes, hd - i);
    Vec8 o = LoadVec(out + i, lanes);
    for (int64_t r = 0; r < rows; ++r) o += p[r] * LoadVec(v + r * stride + i, lanes);
    StoreVec(out + i, o, lanes);
  }
}

}  // namespace

std::string PagedTokensError(const Tensor& block_tables, const Tensor& positions, const Tensor& token_seq,
                             int64_t num_blocks, int64_t block_size, int64_t window) {
  const int64_t n = positions.dim(0), num_seqs = block_tables.dim(0), max_blocks = block_tables.dim(1);
  const int32_t* pos = positions.as<int32_t>();
  const int32_t* seq = token_seq.as<int32_t>();
  const int32_t* tables = block_tables.as<int32_t>();
  for (int64_t t = 0; t < n; ++t) {
    if (seq[t] < 0 || seq[t] >= num_seqs) {
      return absl::StrCat("token ", t, " names sequence ", seq[t], " but there are ", num_seqs);
    }
    if (pos[t] < 0 || pos[t] / block_size >= max_blocks) {
      return absl::StrCat("token ", t, " has position ", pos[t], ", outside its block table's ", max_blocks,
                          " blocks of ", block_size);
    }
    const int32_t* table = tables + seq[t] * max_blocks;
    const int64_t first_key = window > 0 ? std::max<int64_t>(0, pos[t] - window + 1) : 0;
    for (int64_t b = first_key / block_size; b <= pos[t] / block_size; ++b) {
      if (table[b] < 0 || table[b] >= num_blocks) {
        return absl::StrCat("sequence ", seq[t], " block table entry ", b, " is block ", table[b], ", outside the cache's ",
                            num_blocks, " blocks");
      }
    }
  }
  return "";
}

absl::Status CpuBackend::CacheWrite(Tensor* k_cache, Tensor* v_cache, const Tensor& k, const Tensor& v,
                                    const Tensor& slots) {
  const ArgCheck check("CacheWrite", {{"k_cache", k_cache, kF32, 4},
                                      {"v_cache", v_cache, kF32, 4},
                                      {"k", &k, kF32, 2},
                                      {"v", &v, kF32, 2},
                                      {"slots", &slots, kI32, 1}});
  SHARDSERVE_RETURN_IF_ERROR(check.Types());
  const int64_t n = k.dim(0);
  const int64_t num_slots = k_cache->dim(0) * k_cache->dim(1);
  const int64_t row = k_cache->dim(2) * k_cache->dim(3);  // kv_heads * head_dim
  if (!SameShape(*k_cache, *v_cache) || !SameShape(k, v) || k.dim(1) != row || slots.dim(0) != n) {
    return check.Error("want k_cache and v_cache [blocks, block_size, kv_heads, head_dim], "
                       "k and v [n, kv_heads * head_dim], slots [n]");
  }
  // Check every slot before writing any, so bad metadata leaves the cache untouched.
  const int32_t* slot = slots.as<int32_t>();
  for (int64_t t = 0; t < n; ++t) {
    if (slot[t] < 0 || slot[t] >= num_slots) {
      return check.Error(absl::StrCat("slot ", slot[t], " of token ", t, " is outside the cache's ", num_slots, " slots"));
    }
  }
  const size_t row_bytes = static_cast<size_t>(row) * sizeof(float);
  for (int64_t t = 0; t < n; ++t) {
    std::memcpy(k_cache->as<float>() + slot[t] * row, k.as<float>() + t * row, row_bytes);
    std::memcpy(v_cache->as<float>() + slot[t] * row, v.as<float>() + t * row, row_bytes);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Attention(Tensor* out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                   const Tensor& positions, const Tensor& token_seq, const Tensor& block_tables,
                                   float scale, const AttentionOptions& options) {
  const ArgCheck check("Attention", {{"out", out, kF32, 2},
                                     {"q", &q, kF32, 2},
                                     {"k_cache", &k_cache, kF32, 4},
                                     {"v_cache", &v_cache, kF32, 4},
                                     {"positions", &positions, kI32, 1},
                                     {"token_seq", &token_seq, kI32, 1},
                                     {"block_tables", &block_tables, kI32, 2}});
  SHARDSERVE_RETURN_IF_ERROR(check.Types());
  const int64_t n = q.dim(0);
  const int64_t num_blocks = k_cache.dim(0), block_size = k_cache.dim(1);
  const int64_t kv_heads = k_cache.dim(2), head_dim = k_cache.dim(3);
  const int64_t max_blocks = block_tables.dim(1);
  if (!SameShape(k_cache, v_cache) || block_size == 0 || kv_heads == 0 || head_dim == 0) {
    return check.Error("want k_cache and v_cache [blocks, block_size, kv_heads, head_dim], all but blocks > 0");
  }
  const int64_t q_heads = q.dim(1) / head_dim;
  if (!SameShape(*out, q) || q.dim(1) % head_dim != 0 || q_heads % kv_heads != 0 || positions.dim(0) != n ||
      token_seq.dim(0) != n) {
    return check.Error("want out and q [n, q_heads * head_dim] with q_heads a multiple of kv_heads, "
                       "positions and token_seq [n]");
  }
  SHARDSERVE_RETURN_IF_ERROR(CheckAttentionOptions("Attention", options, q_heads));
  const float* sinks = options.sinks != nullptr ? options.sinks->as<float>() : nullptr;
  for (int64_t h = 0; sinks != nullptr && h < q_heads; ++h) {
    if (!std::isfinite(sinks[h])) return check.Error(absl::StrCat("sinks[", h, "] is ", sinks[h], ", not finite"));
  }
  const int64_t window = options.window;
  const float softcap = options.softcap;
  static const bool avx2 = TanhHasAvx2();  // soft-capping with Sleef's tanhf, as PyTorch's kernels
  // The first position a token at position p attends to: p - window < j (AttentionOptions::window).
  auto first_key = [window](int64_t p) { return window > 0 ? std::max<int64_t>(0, p - window + 1) : int64_t{0}; };

  // Check the metadata before reading the cache: every token's sequence, its position, and each
  // block-table entry it will read must be in range. Bad metadata is an error, never a stray read.
  const int32_t* pos = positions.as<int32_t>();
  const int32_t* seq = token_seq.as<int32_t>();
  const int32_t* tables = block_tables.as<int32_t>();
  if (const std::string error = PagedTokensError(block_tables, positions, token_seq, num_blocks, block_size, window);
      !error.empty()) {
    return check.Error(error);
  }

  // Work items: up to kChunk consecutive tokens of one sequence (and all its kv heads, or a share
  // of them when there are fewer chunks than threads), spread over the backend's threads. An
  // item's query rows (each token's query heads on those kv heads) share its sequence's cache
  // blocks, which it reads a block at a time, all its kv heads together, prefetching the next
  // block: so each block streams from memory once per item, in address order, and then from L1.
  // An item starts at the block of the first key any of its tokens attends to (block 0 without a
  // window). Every query row's arithmetic is the same whatever else is in its item or the batch, so
  // a token's output does not depend on the batch's composition.
  constexpr int64_t kChunk = 16;
  const int64_t group = q_heads / kv_heads;         // query heads per kv head (GQA)
  const int64_t slot_stride = kv_heads * head_dim;  // floats between consecutive cache slots
  attn_items_.clear();
  int64_t span = 0;  // the most keys from an item's first block to its last key
  for (int64_t t = 0; t < n;) {
    int64_t end = t + 1;
    while (end < n && end - t < kChunk && seq[end] == seq[t]) ++end;
    attn_items_.push_back({t, end});
    int64_t lo = pos[t], hi = pos[t];
    for (int64_t u = t; u < end; ++u) lo = std::min<int64_t>(lo, pos[u]), hi = std::max<int64_t>(hi, pos[u]);
    span = std::max(span, hi + 1 - first_key(lo) / block_size * block_size);
    t = end;
  }
  const auto chunks = static_cast<int64_t>(attn_items_.size());
  const int64_t splits = chunks < threads_ ? std::min<int64_t>(kv_heads, threads_) : 1;  // kv-head shares per chunk
  const int64_t max_rows = std::min(n, kChunk) * q_heads;  // query rows in one item at most
  // A row's scores, then probabilities, key j of the item at j - (its first block's first key); one
  // more entry, past its last key, holds its sink.
  const int64_t width = span + 1;
  attn_weights_.resize(static_cast<size_t>(threads_ * max_rows * width));
  const int64_t items = chunks * splits;
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1) if (items > 1)
  for (int64_t i = 0; i < items; ++i) {
    // Not a structured binding: the lambdas below use first and last, and clang 14 (the fuzz and
    // CI sanitizer build) cannot capture a binding.
    const int64_t first = attn_items_[i / splits].first, last = attn_items_[i / splits].second;
    const int64_t kv_begin = kv_heads * (i % splits) / splits, kv_end = kv_heads * (i % splits + 1) / splits;
    const int32_t* table = tables + seq[first] * max_blocks;  // position j lives in block table[j / block_size]
    float* weights = attn_weights_.data() + omp_get_thread_num() * max_rows * width;  // [rows, width]
    int64_t item_context = 0, item_first = pos[first];
    for (int64_t t = first; t < last; ++t) {
      item_context = std::max(item_context, int64_t{pos[t]} + 1);
      item_first = std::min<int64_t>(item_first, pos[t]);
    }
    const int64_t first_block = first_key(item_first) / block_size;
    const int64_t blocks = (item_context + block_size - 1) / block_size;
    const int64_t key0 = first_block * block_size;  // the key at weights[r * width]
    // Query row r of the item: token first + r / heads, query head kv_begin * group + r % heads,
    // which reads kv head (that head) / group, at that offset in each cache slot. It attends to
    // keys [begin_of(r), context_of(r)).
    const int64_t heads = (kv_end - kv_begin) * group;
    const int64_t rows = (last - first) * heads;
    auto head_of = [&](int64_t r) { return kv_begin * group + r % heads; };
    auto context_of = [&](int64_t r) { return int64_t{pos[first + r / heads]} + 1; };
    auto begin_of = [&](int64_t r) { return first_key(pos[first + r / heads]); };
    auto q_offset = [&](int64_t r) { return (first + r / heads) * q.dim(1) + head_of(r) * head_dim; };
    auto kv_offset = [&](int64_t r) { return head_of(r) / group * head_dim; };
    // Asks for this item's part of a block's slots ahead of its use.
    auto prefetch = [&](const float* block) {
      for (int64_t slot = 0; slot < block_size; ++slot) {
        for (int64_t f = kv_begin * head_dim; f < kv_end * head_dim; f += 64 / sizeof(float)) {
          __builtin_prefetch(block + slot * slot_stride + f);
        }
      }
    };
    // Row r's keys in block b: [from, to), empty when from >= to.
    auto keys_in = [&](int64_t r, int64_t b) {
      return std::pair<int64_t, int64_t>{std::max(begin_of(r), b * block_size),
                                         std::min(context_of(r), (b + 1) * block_size)};
    };

    // Scores as transformers' eager attention: (q . k) * scale, then (with softcap) softcap *
    // tanh(score / softcap), then a float32 softmax with the max subtracted, over the row's keys
    // and (with sinks) its head's sink, whose weight is then dropped. A block's slots are
    // consecutive in the cache, slot_stride floats apart.
    for (int64_t b = first_block; b < blocks; ++b) {
      const float* k_block = k_cache.as<float>() + table[b] * block_size * slot_stride;
      if (b + 1 < blocks) prefetch(k_cache.as<float>() + table[b + 1] * block_size * slot_stride);
      for (int64_t r = 0; r < rows; ++r) {
        const auto [from, to] = keys_in(r, b);
        if (from < to) {
          BlockScores(weights + r * width + from - key0, q.as<float>() + q_offset(r),
                      k_block + (from - b * block_size) * slot_stride + kv_offset(r), to - from, slot_stride,
                      head_dim, scale);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* row = weights + r * width + begin_of(r) - key0;  // the row's keys, then its sink
      const int64_t keys = context_of(r) - begin_of(r);
      if (softcap > 0.0f && avx2) {
        SoftcapAvx2(row, keys, softcap);
      } else if (softcap > 0.0f) {
        for (int64_t j = 0; j < keys; ++j) row[j] = softcap * std::tanh(row[j] / softcap);
      }
      if (sinks != nullptr) row[keys] = sinks[head_of(r)];
      SoftmaxRow(row, row, keys + (sinks != nullptr ? 1 : 0), 1.0f);
    }

    // out = sum_j p_j v_j, accumulated in float, a block at a time. q's rows of this item are all
    // read above, and no other item reads them, so this is correct even if out is q.
    for (int64_t r = 0; r < rows; ++r) std::fill_n(out->as<float>() + q_offset(r), head_dim, 0.0f);
    for (int64_t b = first_block; b < blocks; ++b) {
      const float* v_block = v_cache.as<float>() + table[b] * block_size * slot_stride;
      if (b + 1 < blocks) prefetch(v_cache.as<float>() + table[b + 1] * block_size * slot_stride);
      for (int64_t r = 0; r < rows; ++r) {
        const auto [from, to] = keys_in(r, b);
        if (from < to) {
          BlockWeightedSum(out->as<float>() + q_offset(r), weights + r * width + from - key0,
                           v_block + (from - b * block_size) * slot_stride + kv_offset(r), to - from, slot_stride,
                           head_dim);
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace shardserve::cpu
