// The CPU backend: float32 activations in host memory; matrix products on weights packed once, at
// load (float32: panel_matmul.h's loops, whose rows never depend on the batch; bf16: oneDNN), plain
// loops for everything else.
//
// Numerics follow PyTorch float32 as Hugging Face transformers uses it, so that the CPU path can
// be compared with transformers directly:
// - Element-wise math is done in float32, in the same order of operations as the transformers
//   code it mirrors (noted per op).
// - Long reductions (RmsNorm's sum of squares, softmax normalizers over a vocabulary or a
//   context) accumulate in double and round once. PyTorch's vectorized cascade sums are within
//   a few ulp of that correctly rounded value; a plain float running sum over 150k logits is not.
// - Short dot products (one head, head_dim terms) are float, like a SIMD BLAS kernel.
// - exp is a vectorized polynomial (ExpVec) within an ulp or two of glibc's expf, as PyTorch's
//   vectorized softmax and SiLU use their own (Sleef's) rather than libm's.
// - CpuMatMul::kBF16 (backend.h) departs from this on purpose: products of bf16-rounded inputs.
//
// Inner loops are written so that GCC and Clang can vectorize them without -ffast-math:
// element-wise loops over contiguous rows; attention, softmax and SiLU with 8-float GCC vectors
// (kernels/cpu/vec.h), dot products in independent partial sums (see BlockScores).
//
// Threading: matrix products, attention (up to 16 tokens of one sequence per iteration)
// and SiluMul run on the backend's OpenMP threads (MakeCpuBackend(threads) sets how many); the
// other ops run on the calling thread. A CpuBackend is used by one thread at a time (backend.h);
// its scratch vectors rely on that.
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"
#include "kernels/cpu/panel_matmul.h"
#include "kernels/cpu/vec.h"
#include "kernels/tensor.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace shardserve {
namespace {

// 64 bytes: a cache line, and the widest SIMD register (AVX-512), so aligned vector loads never
// split lines.
constexpr size_t kAlignment = 64;

// Rows per oneDNN call of a bf16 product (CpuBackend::OneDnnMatMul): one AMX tile's rows, so that
// a lone decoding row costs little more than itself.
constexpr int64_t kBf16Rows = 16;

constexpr DType kF32 = DType::kF32;
constexpr DType kI32 = DType::kI32;
constexpr DType kBF16 = DType::kBF16;

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

// Loops that matter are written with 8-float GCC vectors (kernels/cpu/vec.h) in functions cloned
// per instruction set.
using cpu::KeepLanes;
using cpu::kVecLanes;
using cpu::LoadVec;
using cpu::StoreVec;
using cpu::Vec8;
using cpu::Vec8i;

// e^x of 8 floats, with Cephes' expf polynomial (relative error about 2e-7, like glibc's expf
// within an ulp or two): x = n ln2 + r, |r| <= ln2 / 2, e^x = 2^n e^r. Below -87.3 (where expf
// turns subnormal) it gives 0, above 88 +inf (exp(88) is 1.7e38, close to FLT_MAX); NaN stays NaN.
[[gnu::always_inline]] inline Vec8 ExpVec(Vec8 x) {
  constexpr float kLow = -87.3f, kHigh = 88.0f, kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const Vec8 xc = x < kLow ? Vec8{} + kLow : (x > kHigh ? Vec8{} + kHigh : x);  // NaN fails both tests
  const Vec8 t = xc * 1.44269504088896341f + kRound;  // n + kRound, n = round(x / ln2)
  const Vec8 n = t - kRound;
  Vec8 r = xc - n * 0.693359375f;  // ln2 in two parts, so that r is exact
  r = r - n * -2.12194440e-4f;
  Vec8 p = Vec8{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const Vec8 e_r = p * r * r + r + 1.0f;
  Vec8i bits;  // 2^n: the exponent field n + 127, n in [-126, 127]
  std::memcpy(&bits, &t, sizeof bits);
  bits = (bits - 0x4B400000 + 127) << 23;  // 0x4B400000: kRound's bits, so bits - it = n
  Vec8 two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  const Vec8 e = e_r * two_n;
  return x < kLow ? Vec8{} : (x > kHigh ? Vec8{} + std::numeric_limits<float>::infinity() : e);
}


// out = softmax(x / temperature) over one row of v, like torch.softmax(x / t, dim=-1) in float32:
// scale, subtract the max, exp, multiply by 1 / sum (PyTorch's vectorized softmax multiplies by
// the reciprocal too). out may alias x. -inf entries (masked tokens) get exactly 0 as long as
// one entry is finite. Returns the normalizer; it is NaN when the row holds a NaN or +inf or is
// all -inf (and then so does out), otherwise it is >= 1 (the max contributes exp(0)).
SHARDSERVE_VECTOR_CLONES double SoftmaxRow(float* out, const float* x, int64_t v, float temperature) {
  // The max, lane by lane (NaN entries never win, as with std::max), then across lanes.
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  Vec8 lane_max = Vec8{} + kNegInf;
  for (int64_t i = 0; i < v; i += kVecLanes) {
    const int64_t lanes = std::min(kVecLanes, v - i);
    const Vec8 xi = LoadVec(x + i, lanes) / temperature;
    StoreVec(out + i, xi, lanes);
    const Vec8 counted = KeepLanes(xi, lanes, kNegInf);
    lane_max = lane_max < counted ? counted : lane_max;
  }
  float max = kNegInf;
  for (int64_t j = 0; j < kVecLanes; ++j) max = std::max(max, lane_max[j]);
  // The normalizer in double: 16 partial sums (element i goes to partial i mod 16), as four
  // vectors of 4 doubles, added in order at the end.
  using Vec4d = double __attribute__((vector_size(32)));
  Vec4d sum0 = {}, sum1 = {}, sum2 = {}, sum3 = {};
  for (int64_t i = 0; i < v; i += 2 * kVecLanes) {
    const int64_t lanes = v - i;  // of the 16 from i, those in the row (the first `lanes`)
    const Vec8 lo = ExpVec(LoadVec(out + i, lanes) - max);
    const Vec8 hi = ExpVec(LoadVec(out + i + kVecLanes, lanes - kVecLanes) - max);
    StoreVec(out + i, lo, lanes);
    StoreVec(out + i + kVecLanes, hi, lanes - kVecLanes);
    const Vec8 lo_counted = KeepLanes(lo, lanes, 0.0f), hi_counted = KeepLanes(hi, lanes - kVecLanes, 0.0f);
    sum0 += __builtin_convertvector(__builtin_shufflevector(lo_counted, lo_counted, 0, 1, 2, 3), Vec4d);
    sum1 += __builtin_convertvector(__builtin_shufflevector(lo_counted, lo_counted, 4, 5, 6, 7), Vec4d);
    sum2 += __builtin_convertvector(__builtin_shufflevector(hi_counted, hi_counted, 0, 1, 2, 3), Vec4d);
    sum3 += __builtin_convertvector(__builtin_shufflevector(hi_counted, hi_counted, 4, 5, 6, 7), Vec4d);
  }
  double sum = 0.0;
  for (const Vec4d& part : {sum0, sum1, sum2, sum3}) {
    for (int j = 0; j < 4; ++j) sum += part[j];
  }
  const float inv_sum = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < v; ++i) out[i] *= inv_sum;
  return sum;
}

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

// y[i] = silu(g[i]) * u[i] for i in [begin, end): see CpuBackend::SiluMul.
SHARDSERVE_VECTOR_CLONES void SiluMulRange(float* y, const float* g, const float* u, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += kVecLanes) {
    const int64_t lanes = std::min(kVecLanes, end - i);
    const Vec8 gi = LoadVec(g + i, lanes);
    StoreVec(y + i, gi / (1.0f + ExpVec(-gi)) * LoadVec(u + i, lanes), lanes);
  }
}

// A oneDNN matmul's primitive descriptor (bias_desc null: no bias), in the API of oneDNN 2 (Debian
// 12) or 3 (which dropped the op descriptors).
dnnl::matmul::primitive_desc MatMulPrimitiveDesc(const dnnl::engine& engine, const dnnl::memory::desc& src,
                                                 const dnnl::memory::desc& weights, const dnnl::memory::desc* bias,
                                                 const dnnl::memory::desc& dst) {
#if DNNL_VERSION_MAJOR >= 3
  return bias != nullptr ? dnnl::matmul::primitive_desc(engine, src, weights, *bias, dst)
                         : dnnl::matmul::primitive_desc(engine, src, weights, dst);
#else
  return dnnl::matmul::primitive_desc(
      bias != nullptr ? dnnl::matmul::desc(src, weights, *bias, dst) : dnnl::matmul::desc(src, weights, dst), engine);
#endif
}

// ---- The backend -------------------------------------------------------------------------------

class CpuBackend final : public Backend {
 public:
  CpuBackend(int threads, CpuMatMul matmul) : threads_(threads), matmul_(matmul) {}

  DeviceKind device_kind() const override { return DeviceKind::kCpu; }
  DType act_dtype() const override { return kF32; }
  std::string Describe() const override {
    const dnnl_version_t* v = dnnl_version();
    const std::string products = matmul_ == CpuMatMul::kBF16
                                     ? absl::StrCat("bf16 products on oneDNN ", v->major, ".", v->minor, ".", v->patch)
                                     : "f32 products";
    return absl::StrCat("cpu (", products, ", ", threads_, " threads)");
  }

  absl::StatusOr<Buffer> Allocate(size_t bytes) override;
  void Free(void* data) override {
    packed_.erase(data);
    std::free(data);
  }
  absl::StatusOr<Buffer> PackMatMulWeight(const Tensor& w, Tensor* packed) override;
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
  // A weight PackMatMulWeight repacked, keyed in packed_ by the address of its buffer.
  struct PackedWeight {
    int64_t m = 0, k = 0;      // the logical [m, k]
    size_t bytes = 0;          // the buffer's size
    // bf16 weights: oneDNN's layout of them, as the [k, m] "weights" of a matmul. Float32
    // weights: none (data_type undef); they are panels (panel_matmul.h).
    dnnl::memory::desc desc;
    bool bf16() const { return desc.data_type() == dnnl::memory::data_type::bf16; }
  };

  static absl::Status Copy(const char* op, void* dst, const void* src, size_t bytes);
  // The packed weight w views, or null when w is plain. An error when w lies inside a packed
  // buffer without being the whole of it (a Rows() view, say).
  absl::StatusOr<const PackedWeight*> FindPacked(const Tensor& w) const;
  // y [n, m] = x [n, k] @ w^T (+ bias [m]) with oneDNN, for a weight `packed` stored in bf16 at w:
  // x rounded to bf16 (in src_bf16_), kBf16Rows rows at a time. Throws dnnl::error.
  void Bf16MatMul(float* y, const float* x, int64_t n, int64_t m, int64_t k, const PackedWeight& packed, void* w,
                  const float* bias);

  const int threads_;  // OpenMP's threads for this backend's products, attention and SiluMul
  const CpuMatMul matmul_;  // the dtype PackMatMulWeight stores weights in
  const dnnl::engine engine_{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream_{engine_};
  std::map<const void*, PackedWeight> packed_;
  // oneDNN bf16 matmuls of kBf16Rows rows by (m, k, bias): one per weight shape, made
  // (JIT-compiled, ~0.4 ms) on first use. A model has a handful of weight shapes.
  std::map<std::tuple<int64_t, int64_t, bool>, dnnl::matmul> bf16_matmuls_;
  // For bf16 products: reorders of an [n, k] float32 input to bf16, by (n, k), and their output.
  std::map<std::pair<int64_t, int64_t>, dnnl::reorder> to_bf16_;
  std::vector<uint16_t> src_bf16_;
  std::vector<float> last_chunk_out_;  // [kBf16Rows, m]: a bf16 product's last, partial chunk of rows
  std::vector<float> plain_panels_;    // [threads, k, 16]: float32 products by a plain weight (panel_matmul.h)

  // Scratch reused across calls, so that ops do not allocate once the largest shapes have been
  // seen. Each vector only grows. Touched only by the one thread using the backend.
  std::vector<float> rope_cos_;       // [head_dim / 2] cos of one token's angles
  std::vector<float> rope_sin_;       // [head_dim / 2] sin of one token's angles
  std::vector<std::pair<int64_t, int64_t>> attn_items_;  // [first, last) tokens of one sequence
  std::vector<float> attn_weights_;   // [threads, item rows, longest context] scores, then probabilities
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
  // w is F32, or BF16 when PackMatMulWeight stored it so (checked below).
  const ArgCheck check("MatMul", {{"out", out, kF32, 2},
                                  {"x", &x, kF32, 2},
                                  {"w", &w, w.dtype == kBF16 ? kBF16 : kF32, 2},
                                  {"bias", bias, kF32, 1, /*optional=*/true}});
  if (absl::Status s = check.Types(); !s.ok()) return s;
  const int64_t n = x.dim(0), k = x.dim(1), m = w.dim(0);
  if (w.dim(1) != k || out->dim(0) != n || out->dim(1) != m || (bias != nullptr && bias->dim(0) != m)) {
    return check.Error("want out [n, m], x [n, k], w [m, k], bias [m]");
  }
  if (Overlaps(*out, x) || Overlaps(*out, w) || (bias != nullptr && Overlaps(*out, *bias))) {
    return check.Error("out must not overlap an input");
  }
  if (n == 0 || m == 0) return absl::OkStatus();

  absl::StatusOr<const PackedWeight*> packed = FindPacked(w);
  if (!packed.ok()) return check.Error(packed.status().message());
  const bool packed_bf16 = *packed != nullptr && (*packed)->bf16();
  if ((w.dtype == kBF16) != packed_bf16) {
    return check.Error("a BF16 w must be a weight PackMatMulWeight stored in bf16, and such a weight is BF16");
  }
  float* y = out->as<float>();
  if (k == 0) {  // an empty sum: out is the bias (or 0) on every row
    for (int64_t r = 0; r < n; ++r) {
      if (bias != nullptr) {
        std::memcpy(y + r * m, bias->data, static_cast<size_t>(m) * sizeof(float));
      } else {
        std::fill(y + r * m, y + (r + 1) * m, 0.0f);
      }
    }
    return absl::OkStatus();
  }
  const float* b = bias != nullptr ? bias->as<float>() : nullptr;
  if (!packed_bf16) {
    cpu::PanelMatMul(y, x.as<float>(), n, m, k, w.as<float>(), /*plain=*/*packed == nullptr, b, threads_,
                     &plain_panels_);
    return absl::OkStatus();
  }
  try {
    Bf16MatMul(y, x.as<float>(), n, m, k, **packed, w.data, b);
  } catch (const dnnl::error& e) {
    return absl::InternalError(
        absl::StrCat("MatMul: oneDNN failed (", e.what(), ") on x ", x.ShapeString(), ", packed bf16 w ", w.ShapeString()));
  }
  return absl::OkStatus();
}

absl::StatusOr<const CpuBackend::PackedWeight*> CpuBackend::FindPacked(const Tensor& w) const {
  auto it = packed_.upper_bound(w.data);  // the first buffer above w.data
  if (it == packed_.begin()) return nullptr;
  --it;  // the last buffer at or below w.data
  const auto* begin = static_cast<const char*>(it->first);
  if (static_cast<const char*>(w.data) >= begin + it->second.bytes) return nullptr;
  if (w.data != it->first || w.dim(0) != it->second.m || w.dim(1) != it->second.k) {
    return absl::InvalidArgumentError(absl::StrCat("w views part of a packed [", it->second.m, ", ", it->second.k,
                                                   "] weight; pass the whole tensor PackMatMulWeight made"));
  }
  return &it->second;
}

void CpuBackend::Bf16MatMul(float* y, const float* x, int64_t n, int64_t m, int64_t k, const PackedWeight& packed,
                            void* w, const float* bias) {
  using dnnl::memory;
  constexpr auto f32 = memory::data_type::f32;
  constexpr auto bf16 = memory::data_type::bf16;
  constexpr auto ab = memory::format_tag::ab;
  // OpenMP's thread count is per calling thread; the step thread is not the one that made us.
  omp_set_num_threads(threads_);
  const memory::desc bias_desc({1, m}, f32, ab);
  const memory::desc chunk_src({kBf16Rows, k}, bf16, ab), chunk_dst({kBf16Rows, m}, f32, ab);
  // The oneDNN matmul for this weight's shape, made (JIT-compiled, ~0.4 ms) on first use.
  auto it = bf16_matmuls_.find({m, k, bias != nullptr});
  if (it == bf16_matmuls_.end()) {
    const dnnl::matmul::primitive_desc pd =
        MatMulPrimitiveDesc(engine_, chunk_src, packed.desc, bias != nullptr ? &bias_desc : nullptr, chunk_dst);
    it = bf16_matmuls_.emplace(std::make_tuple(m, k, bias != nullptr), dnnl::matmul(pd)).first;
  }
  const dnnl::matmul& mm = it->second;
  auto run = [&](void* src, float* dst) {
    std::unordered_map<int, memory> args = {{DNNL_ARG_SRC, memory(chunk_src, engine_, src)},
                                            {DNNL_ARG_WEIGHTS, memory(packed.desc, engine_, w)},
                                            {DNNL_ARG_DST, memory(chunk_dst, engine_, dst)}};
    if (bias != nullptr) args.emplace(DNNL_ARG_BIAS, memory(bias_desc, engine_, const_cast<float*>(bias)));
    mm.execute(stream_, args);
  };
  // Round x to bf16 (to nearest even) with a reorder made once per shape, into rows padded with
  // zeros to a multiple of kBf16Rows; then multiply kBf16Rows rows at a time. oneDNN's bf16
  // kernels sum in an order that depends on the row count (AMX and AVX-512 kernels for different
  // row counts and tails, K split differently), so a row's result would depend on how many rows
  // share its step; one primitive for every chunk gives every row the same arithmetic. Each
  // chunk re-reads the weight (a layer's matrix, from cache after the first chunk).
  const memory::desc x_desc({n, k}, f32, ab);
  const int64_t padded = (n + kBf16Rows - 1) / kBf16Rows * kBf16Rows;
  src_bf16_.resize(static_cast<size_t>(padded * k));
  const memory::desc rounded_desc({n, k}, bf16, ab);
  auto r = to_bf16_.find({n, k});
  if (r == to_bf16_.end()) {
    r = to_bf16_.emplace(std::make_pair(n, k), dnnl::reorder(dnnl::reorder::primitive_desc(engine_, x_desc, engine_,
                                                                                          rounded_desc)))
            .first;
  }
  memory from(x_desc, engine_, const_cast<float*>(x)), to(rounded_desc, engine_, src_bf16_.data());
  r->second.execute(stream_, from, to);
  std::fill(src_bf16_.begin() + n * k, src_bf16_.begin() + padded * k, uint16_t{0});
  const int64_t whole = n / kBf16Rows * kBf16Rows;  // rows in whole chunks, written straight to y
  for (int64_t c = 0; c < whole; c += kBf16Rows) run(src_bf16_.data() + c * k, y + c * m);
  if (whole < n) {  // the last, partial chunk: its output rows past n land in scratch
    last_chunk_out_.resize(static_cast<size_t>(kBf16Rows * m));
    run(src_bf16_.data() + whole * k, last_chunk_out_.data());
  }
  stream_.wait();
  if (whole < n) std::copy_n(last_chunk_out_.data(), (n - whole) * m, y + whole * m);
}

absl::StatusOr<Buffer> CpuBackend::PackMatMulWeight(const Tensor& w, Tensor* packed) {
  const ArgCheck check("PackMatMulWeight", {{"w", &w, kF32, 2}});
  if (absl::Status s = check.Types(); !s.ok()) return s;
  *packed = w;
  const int64_t m = w.dim(0), k = w.dim(1);
  if (m == 0 || k == 0) return Buffer();  // nothing to multiply; MatMul handles it plain
  if (matmul_ == CpuMatMul::kF32) {  // panels for panel_matmul.h's loops
    const auto bytes = static_cast<size_t>(cpu::PanelMatMulFloats(m, k)) * sizeof(float);
    absl::StatusOr<Buffer> buffer = Allocate(bytes);
    if (!buffer.ok()) return buffer.status();
    cpu::PackPanels(static_cast<float*>(buffer->data()), w.as<float>(), m, k);
    packed_[buffer->data()] = PackedWeight{m, k, bytes, {}};
    *packed = Tensor(buffer->data(), kF32, {m, k});
    return buffer;
  }
  using dnnl::memory;
  constexpr auto bf16 = memory::data_type::bf16;
  // The layout oneDNN picks for kBf16Rows-row products, the only row count Bf16MatMul uses.
  try {
    const dnnl::matmul::primitive_desc pd = MatMulPrimitiveDesc(
        engine_, memory::desc({kBf16Rows, k}, bf16, memory::format_tag::ab),
        memory::desc({k, m}, bf16, memory::format_tag::any), nullptr,
        memory::desc({kBf16Rows, m}, memory::data_type::f32, memory::format_tag::ab));
    const memory::desc layout = pd.weights_desc();
    absl::StatusOr<Buffer> buffer = Allocate(layout.get_size());
    if (!buffer.ok()) return buffer.status();
    // w [m, k] row-major is the matmul's [k, m] weights in column-major ("ba") order. The reorder
    // converts to bf16, rounding to nearest even.
    memory plain(memory::desc({k, m}, memory::data_type::f32, memory::format_tag::ba), engine_, w.data);
    memory blocked(layout, engine_, buffer->data());
    omp_set_num_threads(threads_);
    dnnl::reorder(plain, blocked).execute(stream_, plain, blocked);
    stream_.wait();
    packed_[buffer->data()] = PackedWeight{m, k, layout.get_size(), layout};
    *packed = Tensor(buffer->data(), kBF16, {m, k});
    return buffer;
  } catch (const dnnl::error& e) {
    *packed = w;
    if (e.status == dnnl_unimplemented) {
      return absl::FailedPreconditionError(
          "PackMatMulWeight: oneDNN has no bf16 matrix product for this CPU (it needs AVX-512); multiply in f32");
    }
    return absl::InternalError(absl::StrCat("PackMatMulWeight: oneDNN failed (", e.what(), ") on w ", w.ShapeString()));
  }
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

  // Work items: up to kChunk consecutive tokens of one sequence (and all its kv heads, or a share
  // of them when there are fewer chunks than threads), spread over the backend's threads. An
  // item's query rows (each token's query heads on those kv heads) share its sequence's cache
  // blocks, which it reads a block at a time, all its kv heads together, prefetching the next
  // block: so each block streams from memory once per item, in address order, and then from L1.
  // Every query row's arithmetic is the same whatever else is in its item or the batch, so a
  // token's output does not depend on the batch's composition.
  constexpr int64_t kChunk = 16;
  const int64_t group = q_heads / kv_heads;         // query heads per kv head (GQA)
  const int64_t slot_stride = kv_heads * head_dim;  // floats between consecutive cache slots
  attn_items_.clear();
  for (int64_t t = 0; t < n;) {
    int64_t end = t + 1;
    while (end < n && end - t < kChunk && seq[end] == seq[t]) ++end;
    attn_items_.push_back({t, end});
    t = end;
  }
  const auto chunks = static_cast<int64_t>(attn_items_.size());
  const int64_t splits = chunks < threads_ ? std::min<int64_t>(kv_heads, threads_) : 1;  // kv-head shares per chunk
  const int64_t max_rows = std::min(n, kChunk) * q_heads;  // query rows in one item at most
  attn_weights_.resize(static_cast<size_t>(threads_ * max_rows * longest));
  const int64_t items = chunks * splits;
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1) if (items > 1)
  for (int64_t i = 0; i < items; ++i) {
    const auto [first, last] = attn_items_[i / splits];
    const int64_t kv_begin = kv_heads * (i % splits) / splits, kv_end = kv_heads * (i % splits + 1) / splits;
    const int32_t* table = tables + seq[first] * max_blocks;  // position j lives in block table[j / block_size]
    float* weights = attn_weights_.data() + omp_get_thread_num() * max_rows * longest;  // [rows, longest]
    int64_t item_context = 0;
    for (int64_t t = first; t < last; ++t) item_context = std::max(item_context, int64_t{pos[t]} + 1);
    const int64_t blocks = (item_context + block_size - 1) / block_size;
    // Query row r of the item: token first + r / heads, query head kv_begin * group + r % heads,
    // which reads kv head (that head) / group, at that offset in each cache slot.
    const int64_t heads = (kv_end - kv_begin) * group;
    const int64_t rows = (last - first) * heads;
    auto head_of = [&](int64_t r) { return kv_begin * group + r % heads; };
    auto context_of = [&](int64_t r) { return int64_t{pos[first + r / heads]} + 1; };
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

    // Scores as transformers' eager attention: (q . k) * scale, then a float32 softmax with the
    // max subtracted. A block's slots are consecutive in the cache, slot_stride floats apart.
    for (int64_t b = 0; b < blocks; ++b) {
      const float* k_block = k_cache.as<float>() + table[b] * block_size * slot_stride;
      if (b + 1 < blocks) prefetch(k_cache.as<float>() + table[b + 1] * block_size * slot_stride);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t valid = std::min(block_size, context_of(r) - b * block_size);
        if (valid > 0) {
          BlockScores(weights + r * longest + b * block_size, q.as<float>() + q_offset(r), k_block + kv_offset(r),
                      valid, slot_stride, head_dim, scale);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) SoftmaxRow(weights + r * longest, weights + r * longest, context_of(r), 1.0f);

    // out = sum_j p_j v_j, accumulated in float, a block at a time. q's rows of this item are all
    // read above, and no other item reads them, so this is correct even if out is q.
    for (int64_t r = 0; r < rows; ++r) std::fill_n(out->as<float>() + q_offset(r), head_dim, 0.0f);
    for (int64_t b = 0; b < blocks; ++b) {
      const float* v_block = v_cache.as<float>() + table[b] * block_size * slot_stride;
      if (b + 1 < blocks) prefetch(v_cache.as<float>() + table[b + 1] * block_size * slot_stride);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t valid = std::min(block_size, context_of(r) - b * block_size);
        if (valid > 0) {
          BlockWeightedSum(out->as<float>() + q_offset(r), weights + r * longest + b * block_size,
                           v_block + kv_offset(r), valid, slot_stride, head_dim);
        }
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
  // gives -0, the right limit. In chunks over the backend's threads.
  constexpr int64_t kChunk = 4096;
  const int64_t chunks = (count + kChunk - 1) / kChunk;
#pragma omp parallel for num_threads(threads_) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) SiluMulRange(y, g, u, c * kChunk, std::min(count, (c + 1) * kChunk));
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

std::unique_ptr<Backend> MakeCpuBackend(int threads, CpuMatMul matmul) {
  return std::make_unique<CpuBackend>(threads > 0 ? threads : omp_get_max_threads(), matmul);
}

bool CpuHasNativeBf16MatMul() {
  // oneDNN's ISA values are supersets by bits: AMX's include AVX512-BF16's.
  const auto isa = static_cast<unsigned>(dnnl_get_effective_cpu_isa());
  const auto bf16 = static_cast<unsigned>(dnnl_cpu_isa_avx512_core_bf16);
  return (isa & bf16) == bf16;
}

}  // namespace shardserve
