// The CPU backend: float32 activations in host memory, OpenBLAS (CBLAS) for matrix products,
// plain loops for everything else.
//
// Numerics follow PyTorch float32 as Hugging Face transformers uses it, so that the CPU path can
// be compared with transformers directly:
// - Element-wise math is done in float32, in the same order of operations as the transformers
//   code it mirrors (noted per op).
// - Long reductions (RmsNorm's sum of squares, softmax normalizers over a vocabulary or a
//   context) accumulate in double and round once. PyTorch's vectorized cascade sums are within
//   a few ulp of that correctly rounded value; a plain float running sum over 150k logits is not.
// - Short dot products (one head, head_dim terms) are float, like a SIMD BLAS kernel.
//
// Inner loops are written so that GCC and Clang can vectorize them without -ffast-math:
// element-wise loops over contiguous rows, and dot products split into independent partial sums
// (see Dot).
//
// Threading: OpenBLAS threads its GEMMs (MakeCpuBackend(threads) sets how many); the other loops
// run on the calling thread. A CpuBackend is used by one thread at a time (backend.h); its scratch
// vectors rely on that.
#include <cblas.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"
#include "kernels/tensor.h"

namespace shardserve {
namespace {

// 64 bytes: a cache line, and the widest SIMD register (AVX-512), so aligned vector loads never
// split lines.
constexpr size_t kAlignment = 64;

constexpr DType kF32 = DType::kF32;
constexpr DType kI32 = DType::kI32;

// ---- Argument checks ---------------------------------------------------------------------------

// One tensor argument of an op and the dtype and rank the op expects of it.
struct Arg {
  const char* name;
  const Tensor* tensor;  // null only for an optional argument that was not given
  DType dtype;
  int ndim;
  bool optional = false;
};

// Checks an op's N tensor arguments and formats errors that name the op and every argument's
// dtype and shape, e.g. "RmsNorm: want out and x [n, d], w [d]; got out F32 [2, 8], x F32 [2, 8],
// w F32 [4]". Lives for one op call; the Tensors it points to must outlive it.
template <size_t N>
class ArgCheck {
 public:
  ArgCheck(const char* op, const Arg (&args)[N]) : op_(op) { std::copy(args, args + N, args_.begin()); }

  // Dtype, rank, non-negative dimensions whose element count (and byte size) fits in int64,
  // and data present whenever there are elements.
  absl::Status Types() const {
    for (const Arg& a : args_) {
      if (a.tensor == nullptr) {
        if (a.optional) continue;
        return Error(absl::StrCat(a.name, " is null"));
      }
      const Tensor& t = *a.tensor;
      if (t.dtype != a.dtype || t.ndim != a.ndim) {
        return Error(absl::StrCat(a.name, " must be ", DTypeName(a.dtype), " with ", a.ndim, " dimension",
                                  a.ndim == 1 ? "" : "s",
                                  a.dtype == kF32 ? " (the CPU backend computes in float32)" : ""));
      }
      int64_t elements = 1;
      for (int d = 0; d < t.ndim; ++d) {
        if (t.shape[d] < 0 || __builtin_mul_overflow(elements, t.shape[d], &elements) ||
            elements > std::numeric_limits<int64_t>::max() / 8) {
          return Error(absl::StrCat(a.name, " has a negative or overflowing shape"));
        }
      }
      if (elements > 0 && t.data == nullptr) return Error(absl::StrCat(a.name, " has no data"));
    }
    return absl::OkStatus();
  }

  absl::Status Error(absl::string_view what) const {
    std::string got;
    for (const Arg& a : args_) {
      if (a.tensor == nullptr) {
        if (!a.optional) absl::StrAppend(&got, got.empty() ? "" : ", ", a.name, " null");
        continue;
      }
      absl::StrAppend(&got, got.empty() ? "" : ", ", a.name, " ", DTypeName(a.tensor->dtype), " ",
                      a.tensor->ShapeString());
    }
    return absl::InvalidArgumentError(absl::StrCat(op_, ": ", what, "; got ", got));
  }

 private:
  const char* op_;
  std::array<Arg, N> args_;
};

bool SameShape(const Tensor& a, const Tensor& b) {
  if (a.ndim != b.ndim) return false;
  for (int i = 0; i < a.ndim; ++i) {
    if (a.shape[i] != b.shape[i]) return false;
  }
  return true;
}

// Whether the memory of a and b overlaps (exact aliasing included).
bool Overlaps(const Tensor& a, const Tensor& b) {
  const auto* a0 = static_cast<const char*>(a.data);
  const auto* b0 = static_cast<const char*>(b.data);
  return a.bytes() > 0 && b.bytes() > 0 && a0 < b0 + b.bytes() && b0 < a0 + a.bytes();
}

// ---- Math helpers ------------------------------------------------------------------------------


// out = softmax(x / temperature) over one row of v, like torch.softmax(x / t, dim=-1) in float32:
// scale, subtract the max, exp, multiply by 1 / sum (PyTorch's vectorized softmax multiplies by
// the reciprocal too). out may alias x. -inf entries (masked tokens) get exactly 0 as long as
// one entry is finite. Returns the normalizer; it is NaN when the row holds a NaN or +inf or is
// all -inf (and then so does out), otherwise it is >= 1 (the max contributes exp(0)).
double SoftmaxRow(float* out, const float* x, int64_t v, float temperature) {
  float max = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < v; ++i) {
    out[i] = x[i] / temperature;
    max = std::max(max, out[i]);
  }
  double sum = 0.0;
  for (int64_t i = 0; i < v; ++i) {
    out[i] = std::exp(out[i] - max);
    sum += out[i];
  }
  const float inv_sum = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < v; ++i) out[i] *= inv_sum;
  return sum;
}

// ---- The backend -------------------------------------------------------------------------------

class CpuBackend final : public Backend {
 public:
  DeviceKind device_kind() const override { return DeviceKind::kCpu; }
  DType act_dtype() const override { return kF32; }
  std::string Describe() const override {
    // openblas_get_config() reads like "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY Haswell MAX_THREADS=64".
    return absl::StrCat("cpu (", openblas_get_config(), ", ", openblas_get_num_threads(), " threads)");
  }

  absl::StatusOr<Buffer> Allocate(size_t bytes) override;
  void Free(void* data) override { std::free(data); }
  absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes) override {
    return Copy("CopyToDevice", dst, host_src, bytes);
  }
  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) override {
    return Copy("CopyToHost", host_dst, src, bytes);
  }
  absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes) override {
    return Copy("CopyOnDevice", dst, src, bytes);
  }
  absl::Status Fill0(void* dst, size_t bytes) override;
  absl::Status Synchronize() override { return absl::OkStatus(); }  // every op is done when it returns

  absl::Status Embedding(Tensor* out, const Tensor& table, const Tensor& ids, int64_t row_offset) override;
  absl::Status RmsNorm(Tensor* out, const Tensor& x, const Tensor& w, float eps) override;
  absl::Status MatMul(Tensor* out, const Tensor& x, const Tensor& w, const Tensor* bias) override;
  absl::Status Rope(Tensor* q, Tensor* k, const Tensor& positions, const Tensor& inv_freq, int head_dim) override;
  absl::Status CacheWrite(Tensor* k_cache, Tensor* v_cache, const Tensor& k, const Tensor& v,
                          const Tensor& slots) override;
  absl::Status Attention(Tensor* out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                         const Tensor& positions, const Tensor& token_seq, const Tensor& block_tables,
                         float scale) override;
  absl::Status SiluMul(Tensor* out, const Tensor& gate, const Tensor& up) override;
  absl::Status Add(Tensor* out, const Tensor& a, const Tensor& b) override;
  absl::Status Softmax(Tensor* out, const Tensor& x, float temperature) override;
  absl::Status Argmax(Tensor* out, const Tensor& logits) override;
  absl::Status Sample(Tensor* out, const Tensor& logits, const std::vector<SampleParams>& params) override;

 private:
  static absl::Status Copy(const char* op, void* dst, const void* src, size_t bytes);

  // Scratch reused across calls, so that ops do not allocate once the largest shapes have been
  // seen. Each vector only grows. Touched only by the one thread using the backend.
  std::vector<float> rope_cos_;       // [head_dim / 2] cos of one token's angles
  std::vector<float> rope_sin_;       // [head_dim / 2] sin of one token's angles
  std::vector<int64_t> attn_slots_;   // [longest context] cache slot of each position of one token's sequence
  std::vector<float> attn_weights_;   // [longest context] scores, then probabilities, of one query head
  std::vector<float> sample_probs_;   // [vocab] probabilities of one row
  std::vector<float> sample_sorted_;  // [vocab] probabilities partially sorted for top-k / top-p
};

absl::StatusOr<Buffer> CpuBackend::Allocate(size_t bytes) {
  // aligned_alloc wants a size that is a multiple of the alignment (and we want a non-null
  // pointer for 0 bytes too).
  if (bytes > std::numeric_limits<size_t>::max() - kAlignment) {
    return absl::ResourceExhaustedError(absl::StrCat("cpu Allocate: ", bytes, " bytes is too large"));
  }
  const size_t rounded = std::max(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  void* data = std::aligned_alloc(kAlignment, rounded);
  if (data == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cpu Allocate: out of host memory for ", bytes, " bytes"));
  }
  return Buffer(this, data, bytes);
}

absl::Status CpuBackend::Copy(const char* op, void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr || src == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": null pointer for ", bytes, " bytes"));
  }
  std::memmove(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::Fill0(void* dst, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (dst == nullptr) return absl::InvalidArgumentError(absl::StrCat("Fill0: null pointer for ", bytes, " bytes"));
  std::memset(dst, 0, bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::Embedding(Tensor* out, const Tensor& table, const Tensor& ids, int64_t row_offset) {
  const ArgCheck check("Embedding", {{"out", out, kF32, 2}, {"table", &table, kF32, 2}, {"ids", &ids, kI32, 1}});
  if (absl::Status s = check.Types(); !s.ok()) return s;
  const int64_t n = out->dim(0), d = out->dim(1), rows = table.dim(0);
  if (table.dim(1) != d || ids.dim(0) != n) return check.Error("want out [n, d], table [rows, d], ids [n]");
  if (row_offset < 0) return check.Error(absl::StrCat("row_offset ", row_offset, " is negative"));

  const int32_t* id = ids.as<int32_t>();
  for (int64_t t = 0; t < n; ++t) {
    float* dst = out->as<float>() + t * d;
    const int64_t row = static_cast<int64_t>(id[t]) - row_offset;  // row in this shard's slice
    if (row >= 0 && row < rows) {
      std::memcpy(dst, table.as<float>() + row * d, static_cast<size_t>(d) * sizeof(float));
    } else {
      std::fill(dst, dst + d, 0.0f);  // another shard's row; the all-reduce fills it in
    }
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::RmsNorm(Tensor* out, const Tensor& x, const Tensor& w, float eps) {
  const ArgCheck check("RmsNorm", {{"out", out, kF32, 2}, {"x", &x, kF32, 2}, {"w", &w, kF32, 1}});
  if (absl::Status s = check.Types(); !s.ok()) return s;
  if (!SameShape(*out, x) || w.dim(0) != x.dim(1)) return check.Error("want out and x [n, d], w [d]");

  const int64_t n = x.dim(0), d = x.dim(1);
  const float* weight = w.as<float>();
  for (int64_t t = 0; t < n; ++t) {
    const float* xr = x.as<float>() + t * d;
    float* yr = out->as<float>() + t * d;
    // LlamaRMSNorm: variance = x.pow(2).mean(-1) in float32; x * rsqrt(variance + eps); w * that.
    double sum_squares = 0.0;
    for (int64_t i = 0; i < d; ++i) sum_squares += static_cast<double>(xr[i]) * xr[i];
    const float variance = static_cast<float>(sum_squares / static_cast<double>(d));
    const float inv_rms = 1.0f / std::sqrt(variance + eps);
    for (int64_t i = 0; i < d; ++i) yr[i] = weight[i] * (xr[i] * inv_rms);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::MatMul(Tensor* out, const Tensor& x, const Tensor& w, const Tensor* bias) {
  const ArgCheck check("MatMul", {{"out", out, kF32, 2},
                                  {"x", &x, kF32, 2},
                                  {"w", &w, kF32, 2},
                                  {"bias", bias, kF32, 1, /*optional=*/true}});
  if (absl::Status s = check.Types(); !s.ok()) return s;
  const int64_t n = x.dim(0), k = x.dim(1), m = w.dim(0);
  if (w.dim(1) != k || out->dim(0) != n || out->dim(1) != m || (bias != nullptr && bias->dim(0) != m)) {
    return check.Error("want out [n, m], x [n, k], w [m, k], bias [m]");
  }
  constexpr int64_t kBlasMax = std::numeric_limits<int>::max();  // CBLAS sizes are int
  if (n > kBlasMax || m > kBlasMax || k > kBlasMax) return check.Error("a dimension exceeds CBLAS's int range");
  if (Overlaps(*out, x) || Overlaps(*out, w) || (bias != nullptr && Overlaps(*out, *bias))) {
    return check.Error("out must not overlap an input");
  }
  if (n == 0 || m == 0) return absl::OkStatus();

  float* y = out->as<float>();
  // With a bias, out starts as the bias broadcast over rows and GEMM adds to it (beta = 1), as
  // torch.addmm does for nn.Linear.
  if (bias != nullptr) {
    for (int64_t r = 0; r < n; ++r) std::memcpy(y + r * m, bias->data, static_cast<size_t>(m) * sizeof(float));
  }
  // Row-major out[n, m] = x[n, k] @ w[m, k]^T. Leading dimensions must be >= 1 even when k = 0
  // (then GEMM only applies beta).
  const int ld = static_cast<int>(std::max<int64_t>(k, 1));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(n), static_cast<int>(m),
              static_cast<int>(k), 1.0f, x.as<float>(), ld, w.as<float>(), ld, bias != nullptr ? 1.0f : 0.0f, y,
              static_cast<int>(m));
  return absl::OkStatus();
}

absl::Status CpuBackend::Rope(Tensor* q, Tensor* k, const Tensor& positions, const Tensor& inv_freq, int head_dim) {
  const ArgCheck check("Rope", {{"q", q, kF32, 2},
                                {"k", k, kF32, 2},
                                {"positions", &positions, kI32, 1},
                                {"inv_freq", &inv_freq, kF32, 1}});
  if (absl::Status s = check.Types(); !s.ok()) return s;
  if (head_dim <= 0 || head_dim % 2 != 0) return check.Error(absl::StrCat("head_dim ", head_dim, " must be even and > 0"));
  const int64_t n = q->dim(0), half = head_dim / 2;
  if (k->dim(0) != n || positions.dim(0) != n || q->dim(1) % head_dim != 0 || k->dim(1) % head_dim != 0 ||
      inv_freq.dim(0) != half) {
    return check.Error(absl::StrCat("want q [n, q_heads * ", head_dim, "], k [n, kv_heads * ", head_dim,
                                    "], positions [n], inv_freq [", half, "]"));
  }

  rope_cos_.resize(static_cast<size_t>(half));
  rope_sin_.resize(static_cast<size_t>(half));
  const float* freq = inv_freq.as<float>();
  // Rotates every head of one token's row: x[i], x[i + half] -> x[i] cos - x[i + half] sin,
  // x[i + half] cos + x[i] sin, which is transformers' q * cos + rotate_half(q) * sin.
  const auto rotate_row = [&](float* row, int64_t width) {
    for (float* head = row; head < row + width; head += head_dim) {
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = head[i], x2 = head[i + half];
        head[i] = x1 * rope_cos_[i] - x2 * rope_sin_[i];
        head[i + half] = x2 * rope_cos_[i] + x1 * rope_sin_[i];
      }
    }
  };
  for (int64_t t = 0; t < n; ++t) {
    // As transformers: freqs = inv_freq * position in float32, then cos and sin of that float.
    const float pos = static_cast<float>(positions.as<int32_t>()[t]);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = pos * freq[i];
      rope_cos_[i] = std::cos(angle);
      rope_sin_[i] = std::sin(angle);
    }
    rotate_row(q->as<float>() + t * q->dim(1), q->dim(1));
    rotate_row(k->as<float>() + t * k->dim(1), k->dim(1));
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::CacheWrite(Tensor* k_cache, Tensor* v_cache, const Tensor& k, const Tensor& v,
                                    const Tensor& slots) {
  const ArgCheck check("CacheWrite", {{"k_cache", k_cache, kF32, 4},
                                      {"v_cache", v_cache, kF32, 4},
                                      {"k", &k, kF32, 2},
                                      {"v", &v, kF32, 2},
                                      {"slots", &slots, kI32, 1}});
  if (absl::Status s = check.Types(); !s.ok()) return s;
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
                                   float scale) {
  const ArgCheck check("Attention", {{"out", out, kF32, 2},
                                     {"q", &q, kF32, 2},
                                     {"k_cache", &k_cache, kF32, 4},
                                     {"v_cache", &v_cache, kF32, 4},
                                     {"positions", &positions, kI32, 1},
                                     {"token_seq", &token_seq, kI32, 1},
                                     {"block_tables", &block_tables, kI32, 2}});
  if (absl::Status s = check.Types(); !s.ok()) return s;
  const int64_t n = q.dim(0);
  const int64_t num_blocks = k_cache.dim(0), block_size = k_cache.dim(1);
  const int64_t kv_heads = k_cache.dim(2), head_dim = k_cache.dim(3);
  const int64_t num_seqs = block_tables.dim(0), max_blocks = block_tables.dim(1);
  if (!SameShape(k_cache, v_cache) || block_size == 0 || kv_heads == 0 || head_dim == 0) {
    return check.Error("want k_cache and v_cache [blocks, block_size, kv_heads, head_dim], all but blocks > 0");
  }
  const int64_t q_heads = q.dim(1) / head_dim;
  if (!SameShape(*out, q) || q.dim(1) % head_dim != 0 || q_heads % kv_heads != 0 || positions.dim(0) != n ||
      token_seq.dim(0) != n) {
    return check.Error("want out and q [n, q_heads * head_dim] with q_heads a multiple of kv_heads, "
                       "positions and token_seq [n]");
  }

  // Check the metadata before reading the cache: every token's sequence, its position, and each
  // block-table entry it will read must be in range. Bad metadata is an error, never a stray read.
  const int32_t* pos = positions.as<int32_t>();
  const int32_t* seq = token_seq.as<int32_t>();
  const int32_t* tables = block_tables.as<int32_t>();
  int64_t longest = 0;  // the longest context (position + 1) of any token
  for (int64_t t = 0; t < n; ++t) {
    if (seq[t] < 0 || seq[t] >= num_seqs) {
      return check.Error(absl::StrCat("token ", t, " names sequence ", seq[t], " but there are ", num_seqs));
    }
    if (pos[t] < 0 || pos[t] / block_size >= max_blocks) {
      return check.Error(absl::StrCat("token ", t, " has position ", pos[t], ", outside its block table's ",
                                      max_blocks, " blocks of ", block_size));
    }
    const int32_t* table = tables + seq[t] * max_blocks;
    for (int64_t b = 0; b <= pos[t] / block_size; ++b) {
      if (table[b] < 0 || table[b] >= num_blocks) {
        return check.Error(absl::StrCat("sequence ", seq[t], " block table entry ", b, " is block ", table[b],
                                        ", outside the cache's ", num_blocks, " blocks"));
      }
    }
    longest = std::max(longest, int64_t{pos[t]} + 1);
  }

  attn_slots_.resize(static_cast<size_t>(longest));
  attn_weights_.resize(static_cast<size_t>(longest));
  const int64_t group = q_heads / kv_heads;   // query heads per kv head (GQA)
  const int64_t slot_stride = kv_heads * head_dim;  // floats between consecutive cache slots
  for (int64_t t = 0; t < n; ++t) {
    // Resolve the block table once per token: position j lives in cache slot attn_slots_[j].
    const int64_t context = int64_t{pos[t]} + 1;
    const int32_t* table = tables + seq[t] * max_blocks;
    for (int64_t j = 0; j < context; ++j) attn_slots_[j] = table[j / block_size] * block_size + j % block_size;

    const int64_t blocks = (context + block_size - 1) / block_size;
    for (int64_t h = 0; h < q_heads; ++h) {
      const float* qh = q.as<float>() + t * q.dim(1) + h * head_dim;
      const float* k_base = k_cache.as<float>() + (h / group) * head_dim;  // kv head h / group, slot 0
      const float* v_base = v_cache.as<float>() + (h / group) * head_dim;
      float* weights = attn_weights_.data();

      // Scores as transformers' eager attention: (q . k) * scale, then a float32 softmax with the
      // max subtracted. A block's slots are consecutive in the cache, slot_stride floats apart:
      // one matrix-vector product per block.
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t rows = std::min(block_size, context - b * block_size);
        cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<int>(rows), static_cast<int>(head_dim), scale,
                    k_base + attn_slots_[b * block_size] * slot_stride, static_cast<int>(slot_stride), qh, 1, 0.0f,
                    weights + b * block_size, 1);
      }
      float max = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < context; ++j) max = std::max(max, weights[j]);
      double sum = 0.0;
      for (int64_t j = 0; j < context; ++j) {
        weights[j] = std::exp(weights[j] - max);
        sum += weights[j];
      }
      const float inv_sum = static_cast<float>(1.0 / sum);
      for (int64_t j = 0; j < context; ++j) weights[j] *= inv_sum;

      // out = sum_j p_j v_j, accumulated in float, a block at a time. q's head is no longer
      // needed, so this is correct even if out is q.
      float* oh = out->as<float>() + t * q.dim(1) + h * head_dim;
      std::fill(oh, oh + head_dim, 0.0f);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t rows = std::min(block_size, context - b * block_size);
        cblas_sgemv(CblasRowMajor, CblasTrans, static_cast<int>(rows), static_cast<int>(head_dim), 1.0f,
                    v_base + attn_slots_[b * block_size] * slot_stride, static_cast<int>(slot_stride),
                    weights + b * block_size, 1, 1.0f, oh, 1);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::SiluMul(Tensor* out, const Tensor& gate, const Tensor& up) {
  const ArgCheck check("SiluMul", {{"out", out, kF32, 2}, {"gate", &gate, kF32, 2}, {"up", &up, kF32, 2}});
  if (absl::Status s = check.Types(); !s.ok()) return s;
  if (!SameShape(*out, gate) || !SameShape(gate, up)) return check.Error("want out, gate and up all [n, f]");

  const int64_t count = gate.numel();
  const float* g = gate.as<float>();
  const float* u = up.as<float>();
  float* y = out->as<float>();
  // silu(g) = g / (1 + exp(-g)), as PyTorch's CPU kernel; exp(-g) = inf for very negative g
  // gives -0, the right limit.
  for (int64_t i = 0; i < count; ++i) y[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  return absl::OkStatus();
}

absl::Status CpuBackend::Add(Tensor* out, const Tensor& a, const Tensor& b) {
  const ArgCheck check("Add", {{"out", out, kF32, 2}, {"a", &a, kF32, 2}, {"b", &b, kF32, 2}});
  if (absl::Status s = check.Types(); !s.ok()) return s;
  if (!SameShape(*out, a) || !SameShape(a, b)) return check.Error("want out, a and b all [n, d]");

  const int64_t count = a.numel();
  const float* x = a.as<float>();
  const float* z = b.as<float>();
  float* y = out->as<float>();
  for (int64_t i = 0; i < count; ++i) y[i] = x[i] + z[i];  // element-wise, so out may alias a or b
  return absl::OkStatus();
}

absl::Status CpuBackend::Softmax(Tensor* out, const Tensor& x, float temperature) {
  const ArgCheck check("Softmax", {{"out", out, kF32, 2}, {"x", &x, kF32, 2}});
  if (absl::Status s = check.Types(); !s.ok()) return s;
  if (!SameShape(*out, x)) return check.Error("want out and x [n, v]");
  if (!(temperature > 0.0f) || !std::isfinite(temperature)) {
    return check.Error(absl::StrCat("temperature ", temperature, " must be finite and > 0"));
  }

  const int64_t n = x.dim(0), v = x.dim(1);
  for (int64_t r = 0; r < n; ++r) SoftmaxRow(out->as<float>() + r * v, x.as<float>() + r * v, v, temperature);
  return absl::OkStatus();
}

absl::Status CpuBackend::Argmax(Tensor* out, const Tensor& logits) {
  const ArgCheck check("Argmax", {{"out", out, kI32, 1}, {"logits", &logits, kF32, 2}});
  if (absl::Status s = check.Types(); !s.ok()) return s;
  const int64_t n = logits.dim(0), v = logits.dim(1);
  if (out->dim(0) != n || v == 0) return check.Error("want out [n], logits [n, v] with v > 0");
  if (v > std::numeric_limits<int32_t>::max()) return check.Error("v exceeds the int32 id range");

  for (int64_t r = 0; r < n; ++r) {
    const float* row = logits.as<float>() + r * v;
    // The first maximum, with NaN above everything, as torch.argmax.
    int64_t best = 0;
    for (int64_t i = 1; i < v; ++i) {
      if (row[i] > row[best] || (std::isnan(row[i]) && !std::isnan(row[best]))) best = i;
    }
    out->as<int32_t>()[r] = static_cast<int32_t>(best);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Sample(Tensor* out, const Tensor& logits, const std::vector<SampleParams>& params) {
  const ArgCheck check("Sample", {{"out", out, kI32, 1}, {"logits", &logits, kF32, 2}});
  if (absl::Status s = check.Types(); !s.ok()) return s;
  const int64_t n = logits.dim(0), v = logits.dim(1);
  if (out->dim(0) != n || v == 0) return check.Error("want out [n], logits [n, v] with v > 0");
  if (v > std::numeric_limits<int32_t>::max()) return check.Error("v exceeds the int32 id range");
  if (params.size() != static_cast<size_t>(n)) {
    return check.Error(absl::StrCat(params.size(), " SampleParams for ", n, " rows"));
  }
  for (int64_t r = 0; r < n; ++r) {
    const SampleParams& p = params[r];
    if (!(p.temperature > 0.0f) || !std::isfinite(p.temperature) || p.top_k < 0 || !(p.top_p > 0.0f) ||
        !(p.top_p <= 1.0f) || !(p.uniform >= 0.0f) || !(p.uniform < 1.0f)) {
      return check.Error(absl::StrCat("row ", r, " has temperature ", p.temperature, ", top_k ", p.top_k, ", top_p ",
                                      p.top_p, ", uniform ", p.uniform, "; want temperature > 0, top_k >= 0, "
                                      "top_p in (0, 1], uniform in [0, 1)"));
    }
  }

  sample_probs_.resize(static_cast<size_t>(v));
  sample_sorted_.resize(static_cast<size_t>(v));
  float* probs = sample_probs_.data();
  float* sorted = sample_sorted_.data();
  for (int64_t r = 0; r < n; ++r) {
    const SampleParams& p = params[r];
    if (!std::isfinite(SoftmaxRow(probs, logits.as<float>() + r * v, v, p.temperature))) {
      return check.Error(absl::StrCat("row ", r, " of logits holds a NaN or +inf, or is all -inf"));
    }

    // Tokens with prob >= keep_from are kept. Start with all of them.
    float keep_from = 0.0f;
    // top_k: keep every token at least as likely as the k-th most likely, ties included.
    if (p.top_k > 0 && p.top_k < v) {
      std::copy(probs, probs + v, sorted);
      std::nth_element(sorted, sorted + (p.top_k - 1), sorted + v, std::greater<float>());
      keep_from = sorted[p.top_k - 1];
    }
    // top_p, over what top_k kept, renormalized (as transformers' TopPLogitsWarper after
    // TopKLogitsWarper, and vLLM): take tokens from the most likely down until their mass reaches
    // top_p; the last one taken sets the bar, so tokens tied with it stay too.
    if (p.top_p < 1.0f) {
      int64_t kept = 0;
      double kept_mass = 0.0;
      for (int64_t i = 0; i < v; ++i) {
        if (probs[i] >= keep_from) {
          sorted[kept++] = probs[i];
          kept_mass += probs[i];
        }
      }
      const double target = static_cast<double>(p.top_p) * kept_mass;
      // Only the most likely tokens matter, so sort just the top `count` (nth_element, then sort),
      // growing it 8x until it holds the target mass. LLM distributions are peaked, so this
      // usually ends in the first round rather than sorting the whole vocabulary.
      for (int64_t count = std::min<int64_t>(kept, 64);; count = std::min(kept, count * 8)) {
        std::nth_element(sorted, sorted + (count - 1), sorted + kept, std::greater<float>());
        std::sort(sorted, sorted + count, std::greater<float>());
        int64_t last = 0;  // index in `sorted` of the last token taken
        double mass = sorted[0];
        while (mass < target && last + 1 < count) mass += sorted[++last];
        if (mass >= target || count == kept) {  // when rounding leaves mass short: all are kept
          keep_from = sorted[last];
          break;
        }
      }
    }

    // Inverse CDF over the kept tokens in vocabulary order: the first whose cumulative mass
    // exceeds uniform * kept mass. Both sums add the same values in the same order, so the last
    // kept token's cumulative mass equals the kept mass, which exceeds uniform * kept mass for
    // uniform < 1; should rounding say otherwise, `chosen` is left at the last kept token.
    // Tokens of probability 0 are skipped (the most likely token always has prob > 0).
    double kept_mass = 0.0;
    for (int64_t i = 0; i < v; ++i) {
      if (probs[i] >= keep_from) kept_mass += probs[i];
    }
    const double target = static_cast<double>(p.uniform) * kept_mass;
    double mass = 0.0;
    int64_t chosen = -1;
    for (int64_t i = 0; i < v; ++i) {
      if (probs[i] < keep_from || probs[i] == 0.0f) continue;
      chosen = i;
      mass += probs[i];
      if (mass > target) break;
    }
    out->as<int32_t>()[r] = static_cast<int32_t>(chosen);
  }
  return absl::OkStatus();
}

}  // namespace

std::unique_ptr<Backend> MakeCpuBackend(int threads) {
  if (threads > 0) openblas_set_num_threads(threads);
  return std::make_unique<CpuBackend>();
}

}  // namespace shardserve
