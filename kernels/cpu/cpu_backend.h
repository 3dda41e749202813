// The CPU backend (kernels/backend.h): the CpuBackend class, shared by the files that define it:
// cpu_backend.cc (memory, MakeCpuBackend), elementwise.cc, matmul.cc, attention.cc and sampling.cc
// (the ops), and what those share: argument checks, ExpVec, SoftmaxRow. Internal to kernels/cpu/;
// everything else uses MakeCpuBackend (kernels/backend.h).
//
// Float32 activations in host memory; matrix products on weights packed once, at
// load (float32: panel_matmul.h's loops, whose rows never depend on the batch; bf16: oneDNN, or
// panel_matmul.h's bf16 panels where oneDNN has no bf16 product), plain
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
// - tanh (GeluTanhMul, Softcap) is PyTorch's vectorized one (Sleef's tanhf_u10) as nearly as we
//   can without its code: tanh in double rounded once, and +-1 beyond Sleef's cutoff (elementwise.cc).
// - CpuMatMul::kBF16 (backend.h) departs from this on purpose: products of bf16-rounded inputs.
//
// Inner loops are written so that GCC and Clang can vectorize them without -ffast-math:
// element-wise loops over contiguous rows; attention, softmax and SiLU with 8-float GCC vectors
// (kernels/host_vec.h), dot products in independent partial sums (see BlockScores, attention.cc).
//
// Threading: matrix products, attention (up to 16 tokens of one sequence per iteration), SiluMul
// and GeluTanhMul run on the backend's OpenMP threads (MakeCpuBackend(threads) sets how many); the
// other ops run on the calling thread. A CpuBackend is used by one thread at a time (backend.h);
// its scratch vectors rely on that.
#ifndef SHARDSERVE_KERNELS_CPU_CPU_BACKEND_H_
#define SHARDSERVE_KERNELS_CPU_CPU_BACKEND_H_

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"
#include "kernels/cpu/bf16_matmul.h"
#include "kernels/cpu/panel_matmul.h"
#include "kernels/cpu/quant_isa.h"
#include "kernels/host_vec.h"
#include "kernels/tensor.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace shardserve::cpu {

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

bool SameShape(const Tensor& a, const Tensor& b);  // cpu_backend.cc

// ---- Math helpers ------------------------------------------------------------------------------

// Loops that matter are written with 8-float GCC vectors (kernels/host_vec.h) in functions cloned
// per instruction set.

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
// Defined in sampling.cc; attention.cc uses it too.
double SoftmaxRow(float* out, const float* x, int64_t v, float temperature);

// ---- The backend -------------------------------------------------------------------------------

class CpuBackend final : public Backend {
 public:
  // act kInt8 only on a CPU with AVX-512 VNNI (MakeCpuBackend checks).
  CpuBackend(int threads, CpuMatMul matmul, CpuActivationQuant act = CpuActivationQuant::kNone)
      : threads_(threads), matmul_(matmul), act_(act) {}

  DeviceKind device_kind() const override { return DeviceKind::kCpu; }
  DType act_dtype() const override { return kF32; }
  std::string Describe() const override {
    const dnnl_version_t* v = dnnl_version();
    const std::string products =
        matmul_ == CpuMatMul::kBF16 && !OneDnnHasBf16MatMul()
            ? "bf16 products on 8-float panels (oneDNN has none for this CPU: bf16 weights widened in registers, "
              "inputs rounded to bf16)"
        : matmul_ == CpuMatMul::kBF16
            ? absl::StrCat("bf16 products on oneDNN ", v->major, ".", v->minor, ".", v->patch,
                           OneDnnBf16UsesAmx()  ? ", every row on its amx tiles"
                           : CpuHasAvx512Bf16() ? absl::StrCat(", up to ", Bf16BlockedRows(), " rows on avx512-bf16")
                                                : "")
            : absl::StrCat("f32 products", ActivePanelTiles() == PanelTiles::kAvx512
                                                                        ? ", avx512 tiles from 4 rows"
                                                                        : "");
    return absl::StrCat("cpu (", products, "; ", QuantizedKernelsDescription(act_), ", ", threads_, " threads)");
  }

  int compute_threads() const override { return threads_; }

  absl::StatusOr<Buffer> Allocate(size_t bytes) override;
  void Free(void* data) override {
    packed_.erase(data);
    std::free(data);
  }
  absl::StatusOr<Buffer> PackMatMulWeight(const Tensor& w, Tensor* packed, WeightQuant quant) override;
  // Float32 panels (what PackMatMulWeight makes on a CpuMatMul::kF32 backend) on either backend:
  // Embedding gathers a row's k values, one from each input step of its panel.
  absl::StatusOr<Buffer> PackTiedTable(const Tensor& w, Tensor* packed) override;
  absl::StatusOr<Buffer> PackQuantizedWeight(WeightQuant quant, const void* stored, int64_t m, int64_t k,
                                             Tensor* packed, int64_t group = 0) override;
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
  absl::Status Rope(Tensor* q, Tensor* k, const Tensor& positions, const Tensor& inv_freq, int head_dim,
                    const RopeOptions& options) override;
  absl::Status CacheWrite(Tensor* k_cache, Tensor* v_cache, const Tensor& k, const Tensor& v,
                          const Tensor& slots) override;
  absl::Status Attention(Tensor* out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                         const Tensor& positions, const Tensor& token_seq, const Tensor& block_tables,
                         float scale, const AttentionOptions& options) override;
  absl::Status MlaAttention(Tensor* out, const Tensor& q_nope, const Tensor& q_pe, const Tensor& kv_c,
                            const Tensor& k_pe, const Tensor& kv_b, Tensor* cache, const Tensor& slots,
                            const Tensor& positions, const Tensor& token_seq, const Tensor& block_tables, float scale,
                            const MlaShape& shape) override;
  absl::Status SiluMul(Tensor* out, const Tensor& gate, const Tensor& up) override;
  absl::Status GeluTanhMul(Tensor* out, const Tensor& gate, const Tensor& up) override;
  absl::Status ClampedSwiGlu(Tensor* out, const Tensor& gate, const Tensor& up, float alpha, float limit) override;
  absl::Status Scale(Tensor* out, const Tensor& x, float factor) override;
  absl::Status Softcap(Tensor* x, float cap) override;
  absl::Status Add(Tensor* out, const Tensor& a, const Tensor& b) override;
  absl::Status Softmax(Tensor* out, const Tensor& x, float temperature) override;
  absl::Status Argmax(Tensor* out, const Tensor& logits) override;
  absl::Status FiniteRows(Tensor* out, const Tensor& logits) override;
  absl::Status Sample(Tensor* out, const Tensor& logits, const std::vector<SampleParams>& params) override;
  // moe.cc: the per-token routing of kernels/moe_routing.h, a stable counting sort, the combine.
  absl::Status MoeRoute(Tensor* ids, Tensor* weights, const Tensor& logits, const MoeRouting& routing) override;
  absl::Status MoeGroupByExpert(Tensor* order, Tensor* rows, Tensor* offsets, Tensor* tokens,
                                const Tensor& ids) override;
  absl::Status MoeCountRows(Tensor* counts, const Tensor& offsets, int64_t begin, int64_t end) override;
  absl::Status MoeCombine(Tensor* out, const Tensor& expert_out, const Tensor& rows, const Tensor& weights) override;
  absl::Status SigmoidGateMul(Tensor* out, const Tensor& x, const Tensor& gate) override;

 private:
  // SiluMul's and GeluTanhMul's body (elementwise.cc): `op`'s argument checks, then
  // range(y, gate, up, begin, end) over chunks of the elements on the backend's threads.
  using GatedRange = void (*)(float* y, const float* gate, const float* up, int64_t begin, int64_t end);
  absl::Status GatedMul(const char* op, GatedRange range, Tensor* out, const Tensor& gate, const Tensor& up);

  // A weight PackMatMulWeight repacked, keyed in packed_ by the address of its buffer.
  struct PackedWeight {
    int64_t m = 0, k = 0;      // the logical [m, k]
    size_t bytes = 0;          // the buffer's size
    // bf16 weights: oneDNN's layout of them, as the [k, m] "weights" of a matmul. Float32
    // weights: none (data_type undef); they are panels (panel_matmul.h).
    dnnl::memory::desc desc;
    // kInt8: int8 rows (kernels/quant.h Int8RowsLayout: scales, then values); kFp8: e4m3 rows
    // (Fp8RowsLayout, the same order); kInt4: Int4Group128 blocks (Int4GroupsLayout); kMxfp4:
    // always panel_matmul.h's MXFP4 panels (PackPanelsMxfp4: the codes, then the scales), which
    // PanelMatMulMxfp4 multiplies on every CPU. Each is viewed as an I8 tensor [m, k] whose `quant`
    // says which (so that its bytes() are the layout's; `bytes` counts the last panel's padding).
    WeightQuant quant = WeightQuant::kNone;
    // kFp8 with input-group scales: inputs per scale (Fp8RowsLayout::group; the scales [m, G] before
    // the codes, or on panels PackPanelScales' [panel][G][16]); 0: one scale a row.
    int64_t group = 0;
    // bf16 weights whose `desc` is the blocked layout bf16_matmul.h's product reads too, on a CPU
    // that runs it, and whose oneDNN products that product repeats bitwise with this chunk (its
    // `chunk` argument, found by FindBf16Chunk): Bf16MatMul multiplies few rows by it. 0: oneDNN only.
    int64_t bf16_chunk = 0;
    // bf16 weights on a CPU where oneDNN has no bf16 product: panel_matmul.h's bf16 panels (desc
    // undef), which PanelMatMulBf16 multiplies.
    bool bf16_panels = false;
    // kInt8 / kFp8 weights on a CPU that multiplies them on panels (quant_isa.h IntOnPanels,
    // Fp8OnPanels): the row layout's scales, then the codes as panel_matmul.h's one-byte panels,
    // which PanelMatMulInt8 / PanelMatMulFp8 multiply (`bytes` counts the last panel's padding).
    bool byte_panels = false;
    // kInt4 weights on a CPU whose int4 instance would be AVX-512's or AVX2's (quant_isa.h
    // IntOnPanels): the blocks repacked as panel_matmul.h's int4 panels, which PanelMatMulInt4
    // multiplies (`bytes` counts the last block's padding).
    bool int4_panels = false;
    // The instance either panels' product runs, the one packing chose (quant_isa.h PanelTilesFor).
    cpu::PanelTiles panel_tiles{};
    bool bf16() const { return bf16_panels || desc.data_type() == dnnl::memory::data_type::bf16; }
  };

  // cpu/quant_isa.h's QuantizedKernelsDescription for the int8/int4 instance `act` picks (this
  // header does not include the kernels').
  static std::string QuantizedKernelsDescription(CpuActivationQuant act);
  static absl::Status Copy(const char* op, void* dst, const void* src, size_t bytes);
  // Allocates `quant`'s layout of an [m, k] weight, lets `fill` write it, registers it in packed_
  // and points *packed at it (PackMatMulWeight's quantizers and PackQuantizedWeight's copy); an
  // int8 or fp8 one on a CPU that multiplies them on panels is filled aside and repacked
  // (byte_panels).
  // `group`: kFp8's inputs per scale (0: one scale a row).
  absl::StatusOr<Buffer> PackQuantized(WeightQuant quant, int64_t m, int64_t k, Tensor* packed,
                                       absl::FunctionRef<absl::Status(void*)> fill, int64_t group = 0);
  // w [m, k] (F32, m and k >= 1) as float32 panels (PackPanels), registered in packed_.
  absl::StatusOr<Buffer> PackF32Panels(const Tensor& w, Tensor* packed);
  // The packed weight w views, or null when w is plain. An error when w lies inside a packed
  // buffer without being the whole of it (a Rows() view, say).
  absl::StatusOr<const PackedWeight*> FindPacked(const Tensor& w) const;
  // y [n, m] = x [n, k] @ w^T (+ bias [m]) with oneDNN, for a weight `packed` stored in bf16 at w:
  // x rounded to bf16 (in src_bf16_), kBf16Rows rows at a time; up to kBf16BlockedRows rows by
  // bf16_matmul.h's product instead where packed.bf16_chunk > 0. Throws dnnl::error.
  void Bf16MatMul(float* y, const float* x, int64_t n, int64_t m, int64_t k, const PackedWeight& packed, void* w,
                  const float* bias);
  // The chunk with which bf16_matmul.h's product gives bitwise oneDNN's (Bf16MatMul's) products by
  // the bf16 weight `packed` at w, in the layout that product reads: the first of k rounded up to 32
  // and 32 x 2^j (j = 0 .. 10) that matches on a probe row, with a bias; 0 if none does. Cached by
  // shape in bf16_chunks_. Throws dnnl::error.
  int64_t FindBf16Chunk(const PackedWeight& packed, void* w);
  // The instance the int8 and int4 weights' products run on under `act`: the exact one this CPU
  // runs best, or under kInt8 quant_isa.h's Int8ActivationsIsa() (MakeCpuBackend refuses kInt8 on
  // a CPU without one). IntIsa: this backend's.
  static QuantIsa IntIsaFor(CpuActivationQuant act) {
    return act == CpuActivationQuant::kInt8 ? Int8ActivationsIsa().value_or(ActiveQuantIsa()) : ActiveQuantIsa();
  }
  QuantIsa IntIsa() const { return IntIsaFor(act_); }

  const int threads_;  // OpenMP's threads for this backend's products, attention, SiluMul and GeluTanhMul
  const CpuMatMul matmul_;  // the dtype PackMatMulWeight stores weights in
  const CpuActivationQuant act_;  // kInt8: int8 and int4 weights' products on Int8ActivationsIsa(); kInt16: int4's
                                  // on PanelMatMulInt4Act16
  const dnnl::engine engine_{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream_{engine_};
  std::map<const void*, PackedWeight> packed_;
  // oneDNN bf16 matmuls of kBf16Rows rows by (m, k, bias) and the weight's layout (a primitive is
  // made for one layout): one per weight shape, made (JIT-compiled, ~0.4 ms) on first use. A model
  // has a handful of weight shapes, each packed in one layout (PackMatMulWeight picks it under this
  // backend's thread count, as the products run).
  std::map<std::tuple<int64_t, int64_t, bool>, std::vector<std::pair<dnnl::memory::desc, dnnl::matmul>>> bf16_matmuls_;
  std::map<std::pair<int64_t, int64_t>, int64_t> bf16_chunks_;  // FindBf16Chunk's answers by (m, k)
  // For bf16 products: reorders of an [n, k] float32 input to bf16, by (n, k), and their output.
  std::map<std::pair<int64_t, int64_t>, dnnl::reorder> to_bf16_;
  std::vector<uint16_t> src_bf16_;
  std::vector<float> last_chunk_out_;  // [kBf16Rows, m]: a bf16 product's last, partial chunk of rows
  std::vector<float> plain_panels_;    // [threads, k, 16]: float32 products by a plain weight (panel_matmul.h)
  std::vector<float> bf16_x_;          // [n, k]: a bf16 panels product's input, rounded to bf16

  // Scratch reused across calls, so that ops do not allocate once the largest shapes have been
  // seen. Each vector only grows. Touched only by the one thread using the backend.
  std::vector<float> rope_cos_;       // [head_dim / 2] cos of one token's angles
  std::vector<float> rope_sin_;       // [head_dim / 2] sin of one token's angles
  std::vector<std::pair<int64_t, int64_t>> attn_items_;  // [first, last) tokens of one sequence
  std::vector<float> attn_weights_;   // [threads, item rows, keys an item spans + 1] scores, then probabilities
  std::vector<float> mla_scratch_;    // [threads, 2 * latent + context]: MlaAttention's q_latent, o_latent, scores
  std::vector<float> sample_probs_;   // [vocab] probabilities of one row
  std::vector<float> sample_sorted_;  // [vocab] probabilities partially sorted for top-k / top-p
};

}  // namespace shardserve::cpu

#endif  // SHARDSERVE_KERNELS_CPU_CPU_BACKEND_H_
