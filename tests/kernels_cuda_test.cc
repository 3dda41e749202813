// The CUDA backend against the CPU reference, op by op (kernels/backend.h).
//
// Every op runs for each CUDA activation dtype (F32, F16, BF16) on fresh random inputs with fixed
// seeds. Inputs are generated in float32 and rounded to the activation dtype first, so both
// backends see exactly the same numbers: the CUDA backend gets them in its dtype, the CPU backend
// (always F32) gets the rounded values as float32. The outputs are compared by normalized error
// max|cuda - cpu| / max|cpu| against a per-op, per-dtype threshold (Threshold() below says why
// each is what it is); a NaN or Inf on either side always fails. Every output buffer sits between
// guard zones filled with a pattern that must survive the op, and starts as all-NaN (bytes 0xFF)
// so that elements an op forgets to write fail too.
//
// Test names carry the op and the dtype: Ops/CudaVsCpu.Attention/BF16. Without a CUDA device (or
// in a build without CUDA) every case is reported as skipped with "no CUDA device"; an op that a
// backend reports as Unimplemented is skipped with that message, never passed. The CublasApi cases
// (cuBLAS opened at run time, kernels/cuda/cublas_api.h) need no device and run in every CUDA build.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#if SHARDSERVE_HAVE_CUDA
#include "kernels/cuda/cublas_api.h"
#endif
#include "kernels/counter_uniform.h"
#include "kernels/int4_folded.h"
#include "kernels/quant.h"
#include "kernels/sampling.h"
#include "kernels/tensor.h"

namespace shardserve {
namespace {

#define SS_CONCAT_INNER(a, b) a##b
#define SS_CONCAT(a, b) SS_CONCAT_INNER(a, b)

// `decl = *expr` for an absl::StatusOr expr, or a fatal failure naming the status.
#define SS_ASSIGN_OR_FAIL(decl, expr)                                                    \
  auto SS_CONCAT(status_or_, __LINE__) = (expr);                                         \
  ASSERT_TRUE(SS_CONCAT(status_or_, __LINE__).ok()) << SS_CONCAT(status_or_, __LINE__).status(); \
  decl = std::move(*SS_CONCAT(status_or_, __LINE__))

// Runs an op on one backend. Unimplemented is reported as a skip naming the backend and op (an
// unsupported op is not a pass); any other error fails the test.
#define SS_RUN_OP(backend_name, expr)                                                       \
  do {                                                                                      \
    const absl::Status op_status_ = (expr);                                                 \
    if (absl::IsUnimplemented(op_status_)) {                                                \
      GTEST_SKIP() << backend_name << " backend does not support " #expr ": " << op_status_; \
    }                                                                                       \
    ASSERT_TRUE(op_status_.ok()) << backend_name << ": " << op_status_;                     \
  } while (0)

#define SS_ASSERT_OK(expr)                     \
  do {                                         \
    const absl::Status ok_status_ = (expr);    \
    ASSERT_TRUE(ok_status_.ok()) << ok_status_; \
  } while (0)

// ---- Thresholds -------------------------------------------------------------------------------
enum class Op {
  kEmbedding,
  kRmsNorm,
  kMatMul,
  kMatMulF32Out,
  kRope,
  kCacheWrite,
  kAttention,
  kSiluMul,
  kAdd,
  kSoftmax,
  kGeluTanhMul,
  kScale,
  kSoftcap,
  kClampedSwiGlu,
  kMlaAttention,
};

// Unit roundoff of a float dtype: the largest relative error of one round-to-nearest.
double UnitRoundoff(DType t) {
  switch (t) {
    case DType::kF16: return std::ldexp(1.0, -11);   // 10 stored mantissa bits: 4.9e-4
    case DType::kBF16: return std::ldexp(1.0, -8);   // 7 stored mantissa bits: 3.9e-3
    default: return std::ldexp(1.0, -24);            // float32: 6.0e-8
  }
}

// The largest normalized error max|cuda - cpu| / max|cpu| accepted for `op` with activations in
// `act`. Both backends start from identical input values, so the difference has two sources:
//  (a) float32 arithmetic done in another order or with other library functions (summation order
//      in reductions and GEMM, expf/sincosf vs libm differing by an ulp or two, FMA contraction):
//      a few ulps of float32 relative to the largest output, growing slowly with the reduction
//      length. The floors below are 1e-5 (~170 float32 ulps) for the ops that reduce over at
//      most ~1000 terms or call exp/sin/cos, 2e-5 for Attention (exp of scores of magnitude up to
//      ~5 amplifies score errors by that much, then two more reductions), 1e-6 for Add (one
//      rounding each side, identical in float32).
//  (b) the CUDA output rounded once to the activation dtype (the CPU keeps float32): at most one
//      unit roundoff u of each element, so at most u after normalizing by max|cpu|. We allow 2u.
// An indexing or layout bug gives errors of order 1, far above every threshold here.
// Embedding and CacheWrite copy elements and must be exact.
double Threshold(Op op, DType act) {
  const double round_out = 2.0 * UnitRoundoff(act);
  switch (op) {
    case Op::kEmbedding:
    case Op::kCacheWrite:
      return 0.0;
    case Op::kAdd:
    case Op::kScale:  // one product, rounded once on each side
      return std::max(1e-6, act == DType::kF32 ? 0.0 : round_out);
    case Op::kRmsNorm:
    case Op::kRope:
    case Op::kSiluMul:
    case Op::kGeluTanhMul:  // CUDA's tanhf (2 ulp) where the CPU rounds tanh once
    case Op::kClampedSwiGlu:  // CUDA's expf against libm's
    case Op::kMatMul:
      return std::max(1e-5, act == DType::kF32 ? 0.0 : round_out);
    case Op::kAttention:
      return std::max(2e-5, act == DType::kF32 ? 0.0 : round_out);
    case Op::kMlaAttention:
      // Attention's sources of error with three reductions of up to ~600 terms in float32 (the
      // query into latent space, the scores over latent + rope dims, the value rows), each in
      // another order than the CPU's: 5e-5.
      return std::max(5e-5, act == DType::kF32 ? 0.0 : round_out);
    case Op::kMatMulF32Out:
      // Output stays float32, so only (a). For F16/BF16 inputs cuBLAS runs on tensor cores with
      // float32 accumulation, in a blocked order, and their adders are not guaranteed to round
      // like IEEE float32 (they may truncate the aligned addend): allow 1e-4, still 5x below the
      // F16 output rounding and 40x below BF16's, far below any real bug.
      return act == DType::kF32 ? 1e-5 : 1e-4;
    case Op::kSoftmax:
      // Float32 in and out for every act dtype: expf ulps and the order of the row sum.
      return 1e-5;
    case Op::kSoftcap:
      // Float32 in and out for every act dtype: CUDA's tanhf (2 ulp) against the CPU's tanh rounded
      // once, relative to cap: a few float32 ulps, so the floor of (a).
      return 1e-5;
  }
  return 0.0;
}

// ---- Host data --------------------------------------------------------------------------------
// Float values rounded to `t` (round-to-nearest-even, the same rounding the CUDA backend sees).
std::vector<float> RoundTo(std::vector<float> v, DType t) {
  if (t == DType::kF32) return v;
  std::vector<uint16_t> narrow(v.size());
  EXPECT_TRUE(ConvertOnHost(narrow.data(), t, v.data(), DType::kF32, v.size()));
  EXPECT_TRUE(ConvertOnHost(v.data(), DType::kF32, narrow.data(), t, v.size()));
  return v;
}

// n values uniform in [lo, hi), rounded to `t`.
std::vector<float> RandomValues(size_t n, uint32_t seed, DType t, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return RoundTo(std::move(v), t);
}

// Bytes of `v` in dtype `t`.
std::vector<uint8_t> Encode(const std::vector<float>& v, DType t) {
  std::vector<uint8_t> bytes(v.size() * DTypeSize(t));
  EXPECT_TRUE(ConvertOnHost(bytes.data(), t, v.data(), DType::kF32, v.size()));
  return bytes;
}

uint32_t Seed(Op op, DType act, uint32_t salt = 0) {
  return 1000u * static_cast<uint32_t>(op) + 17u * static_cast<uint32_t>(act) + salt + 12345u;
}

// ---- Guarded device tensors -------------------------------------------------------------------
constexpr size_t kGuardBytes = 256;     // on each side; keeps the payload 256-byte aligned like cudaMalloc
constexpr uint8_t kGuardByte = 0xA5;    // must survive every op
constexpr uint8_t kUnwrittenByte = 0xFF;  // an output's initial bytes: NaN for F32/F16/BF16, -1 for I32

// A tensor in a backend allocation, between two guard zones.
struct Guarded {
  Buffer buf;
  Tensor t;
  size_t payload = 0;
};

// Allocates a guarded tensor of `dims` and fills it with `data` (payload bytes), or with
// kUnwrittenByte when data is null.
absl::StatusOr<Guarded> MakeGuarded(Backend* be, DType t, std::initializer_list<int64_t> dims, const void* data) {
  Guarded g;
  g.t = Tensor(nullptr, t, dims);
  g.payload = g.t.bytes();
  absl::StatusOr<Buffer> buf = be->Allocate(g.payload + 2 * kGuardBytes);
  if (!buf.ok()) return buf.status();
  g.buf = std::move(*buf);
  g.t.data = static_cast<char*>(g.buf.data()) + kGuardBytes;
  std::vector<uint8_t> host(g.payload + 2 * kGuardBytes, kGuardByte);
  if (data != nullptr) {
    std::memcpy(host.data() + kGuardBytes, data, g.payload);
  } else {
    std::memset(host.data() + kGuardBytes, kUnwrittenByte, g.payload);
  }
  absl::Status s = be->CopyToDevice(g.buf.data(), host.data(), host.size());
  if (!s.ok()) return s;
  return g;
}

// Float values stored as `t`.
absl::StatusOr<Guarded> UploadF(Backend* be, const std::vector<float>& v, DType t,
                                std::initializer_list<int64_t> dims) {
  const std::vector<uint8_t> bytes = Encode(v, t);
  if (static_cast<int64_t>(v.size()) != Tensor(nullptr, t, dims).numel()) {
    return absl::InternalError("test bug: value count does not match the shape");
  }
  return MakeGuarded(be, t, dims, bytes.data());
}

absl::StatusOr<Guarded> UploadI(Backend* be, const std::vector<int32_t>& v, std::initializer_list<int64_t> dims) {
  if (static_cast<int64_t>(v.size()) != Tensor(nullptr, DType::kI32, dims).numel()) {
    return absl::InternalError("test bug: value count does not match the shape");
  }
  return MakeGuarded(be, DType::kI32, dims, v.data());
}

absl::StatusOr<Guarded> Output(Backend* be, DType t, std::initializer_list<int64_t> dims) {
  return MakeGuarded(be, t, dims, nullptr);
}

// The payload bytes; `guards_ok` says whether both guard zones still hold the pattern.
absl::StatusOr<std::vector<uint8_t>> ReadBytes(Backend* be, const Guarded& g, std::string* guard_error) {
  std::vector<uint8_t> host(g.buf.bytes());
  absl::Status s = be->CopyToHost(host.data(), g.buf.data(), host.size());
  if (!s.ok()) return s;
  guard_error->clear();
  for (size_t i = 0; i < kGuardBytes; ++i) {
    if (host[i] != kGuardByte) {
      *guard_error = "write " + std::to_string(kGuardBytes - i) + " bytes before the tensor";
      break;
    }
  }
  for (size_t i = 0; i < kGuardBytes && guard_error->empty(); ++i) {
    if (host[kGuardBytes + g.payload + i] != kGuardByte) {
      *guard_error = "write " + std::to_string(i) + " bytes after the end of the tensor";
    }
  }
  return std::vector<uint8_t>(host.begin() + kGuardBytes, host.begin() + kGuardBytes + g.payload);
}

// The tensor as float32 (from its dtype), with a failure if a guard was overwritten.
#define SS_READ_F(decl, backend, guarded)                                                        \
  std::vector<float> decl;                                                                       \
  do {                                                                                           \
    std::string guard_error_;                                                                    \
    absl::StatusOr<std::vector<uint8_t>> bytes_ = ReadBytes((backend), (guarded), &guard_error_); \
    ASSERT_TRUE(bytes_.ok()) << bytes_.status();                                                 \
    ASSERT_TRUE(guard_error_.empty()) << #guarded << ": stray " << guard_error_;                 \
    decl.resize(static_cast<size_t>((guarded).t.numel()));                                       \
    ASSERT_TRUE(ConvertOnHost(decl.data(), DType::kF32, bytes_->data(), (guarded).t.dtype, decl.size())); \
  } while (0)

#define SS_READ_I(decl, backend, guarded)                                                        \
  std::vector<int32_t> decl;                                                                     \
  do {                                                                                           \
    std::string guard_error_;                                                                    \
    absl::StatusOr<std::vector<uint8_t>> bytes_ = ReadBytes((backend), (guarded), &guard_error_); \
    ASSERT_TRUE(bytes_.ok()) << bytes_.status();                                                 \
    ASSERT_TRUE(guard_error_.empty()) << #guarded << ": stray " << guard_error_;                 \
    decl.resize(static_cast<size_t>((guarded).t.numel()));                                       \
    std::memcpy(decl.data(), bytes_->data(), bytes_->size());                                    \
  } while (0)

// Normalized error max|cuda - ref| / max|ref| (plain max|cuda - ref| when ref is all zero) within
// `threshold`; a NaN or Inf on either side fails.
::testing::AssertionResult Close(const char* what, const std::vector<float>& cuda, const std::vector<float>& ref,
                                 double threshold) {
  if (cuda.size() != ref.size()) {
    return ::testing::AssertionFailure() << what << ": " << cuda.size() << " CUDA values vs " << ref.size() << " CPU";
  }
  double max_err = 0.0, max_ref = 0.0;
  size_t worst = 0;
  for (size_t i = 0; i < cuda.size(); ++i) {
    if (!std::isfinite(cuda[i]) || !std::isfinite(ref[i])) {
      return ::testing::AssertionFailure() << what << ": non-finite value at " << i << ": CUDA " << cuda[i]
                                           << ", CPU " << ref[i];
    }
    const double err = std::fabs(static_cast<double>(cuda[i]) - ref[i]);
    if (err > max_err) {
      max_err = err;
      worst = i;
    }
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(ref[i])));
  }
  const double normalized = max_ref > 0.0 ? max_err / max_ref : max_err;
  if (normalized > threshold || (threshold == 0.0 && max_err != 0.0)) {
    return ::testing::AssertionFailure() << what << ": normalized error " << normalized << " > threshold "
                                         << threshold << " (worst at " << worst << ": CUDA " << cuda[worst]
                                         << ", CPU " << ref[worst] << "; max|CPU| " << max_ref << ")";
  }
  return ::testing::AssertionSuccess() << what << ": normalized error " << normalized;
}

// ---- Fixtures ---------------------------------------------------------------------------------
class CudaTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    absl::StatusOr<std::unique_ptr<Backend>> cuda = MakeCudaBackend(0, act());
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    cuda_ = std::move(*cuda);
    cpu_ = MakeCpuBackend();
    ASSERT_NE(cpu_, nullptr);
    RecordProperty("cuda_backend", cuda_->Describe());
  }
  DType act() const { return GetParam(); }

  std::unique_ptr<Backend> cpu_;
  std::unique_ptr<Backend> cuda_;
};

// CUDA vs the CPU reference.
class CudaVsCpu : public CudaTest {
 protected:
  // Attention's options (AttentionOptions) as host values, and the range of the queries.
  struct AttentionFeatures {
    int64_t window = 0;
    float softcap = 0.0f;
    bool sinks = false;  // then query head h's sink is kSinks[h % 8]
    float q_range = 3.0f;
  };
  // Attention with `features` on both paths (one block per (token, head) and split over the keys)
  // against the CPU backend; the batch and its layouts are described at the definition.
  void CheckAttention(const AttentionFeatures& features);
  // A two-input element-wise op on [4, 1000] (SiluMul, GeluTanhMul, Add), run(backend, out, a, b),
  // on both backends from the same inputs (a in [-a_range, a_range), b in [-1, 1)) against the
  // CPU's, by `op`'s threshold; then on CUDA in place through a, which backend.h allows.
  using BinaryOp = std::function<absl::Status(Backend*, Tensor*, const Tensor&, const Tensor&)>;
  void CheckBinary(Op op, const char* name, float a_range, const BinaryOp& run);
};
// CUDA-only contracts: errors for bad shapes and bad device-side metadata.
class CudaChecks : public CudaTest {};

std::string DTypeParamName(const ::testing::TestParamInfo<DType>& info) { return DTypeName(info.param); }

// ---- Ops --------------------------------------------------------------------------------------

// The dummy weights' generator made in device memory (kernels/cuda/counter_uniform.cu) against the
// host generator the CPU path uses (FillCounterUniformOnHost): the same bytes, exactly, for a row
// range, a column range, a 1-D tensor and a tensor of ones (scale 0), each in the act dtype; and
// each launch counted once in kernel_launches().
TEST_P(CudaVsCpu, CounterUniform) {
  struct Case {
    const char* what;
    CounterUniformSlice s;
  };
  const uint64_t key = 0x1234567890ABCDEFull;
  const std::vector<Case> cases = {
      {"rows [3, 17) of [40, 333]", {key, 0.05f, 40, 333, 0, 3, 17}},
      {"columns [100, 301) of [29, 333]", {key ^ 1, 0.05f, 29, 333, 1, 100, 301}},
      {"a 1-D slice [5, 1005) of [4099]", {key ^ 2, 0.1f, 4099, 1, 0, 5, 1005}},
      {"ones (scale 0) [7, 64]", {key ^ 3, 0.0f, 7, 64, 0, 0, 7}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const int64_t rows = c.s.out_rows(), cols = c.s.out_cols();
    SS_ASSIGN_OR_FAIL(Guarded g_out, Output(cuda_.get(), act(), {rows, cols}));
    const uint64_t launches = cuda_->kernel_launches();
    SS_RUN_OP("CUDA", cuda_->FillCounterUniform(&g_out.t, c.s));
    EXPECT_EQ(cuda_->kernel_launches(), launches + 1);
    std::string guard_error;
    absl::StatusOr<std::vector<uint8_t>> got = ReadBytes(cuda_.get(), g_out, &guard_error);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_TRUE(guard_error.empty()) << "stray " << guard_error;
    std::vector<uint8_t> want(got->size());
    FillCounterUniformOnHost(want.data(), act(), c.s);
    size_t first_diff = want.size();
    for (size_t i = 0; i < want.size() && first_diff == want.size(); ++i) {
      if ((*got)[i] != want[i]) first_diff = i;
    }
    EXPECT_EQ(first_diff, want.size()) << "first differing byte " << first_diff << " of " << want.size();
  }
  // A slice outside the tensor is refused before any launch.
  SS_ASSIGN_OR_FAIL(Guarded g_bad, Output(cuda_.get(), act(), {2, 10}));
  CounterUniformSlice bad{key, 0.05f, 4, 10, 0, 3, 5};
  EXPECT_TRUE(absl::IsInvalidArgument(cuda_->FillCounterUniform(&g_bad.t, bad)));
}


TEST_P(CudaVsCpu, Embedding) {
  const int64_t vocab = 500, rows = 300, row_offset = 100, d = 200;
  const std::vector<float> table = RandomValues(rows * d, Seed(Op::kEmbedding, act()), act());
  // In-shard ids (first and last row included) and ids of other shards, which give zero rows.
  std::vector<int32_t> ids = {100, 399, 99, 400, 0, vocab - 1, 250, 101, 398};
  std::mt19937 rng(Seed(Op::kEmbedding, act(), 1));
  for (int i = 0; i < 7; ++i) ids.push_back(static_cast<int32_t>(rng() % vocab));
  const int64_t n = static_cast<int64_t>(ids.size());

  SS_ASSIGN_OR_FAIL(Guarded g_table, UploadF(cuda_.get(), table, act(), {rows, d}));
  SS_ASSIGN_OR_FAIL(Guarded g_ids, UploadI(cuda_.get(), ids, {n}));
  SS_ASSIGN_OR_FAIL(Guarded g_out, Output(cuda_.get(), act(), {n, d}));
  SS_RUN_OP("CUDA", cuda_->Embedding(&g_out.t, g_table.t, g_ids.t, row_offset));

  SS_ASSIGN_OR_FAIL(Guarded c_table, UploadF(cpu_.get(), table, DType::kF32, {rows, d}));
  SS_ASSIGN_OR_FAIL(Guarded c_ids, UploadI(cpu_.get(), ids, {n}));
  SS_ASSIGN_OR_FAIL(Guarded c_out, Output(cpu_.get(), DType::kF32, {n, d}));
  SS_RUN_OP("CPU", cpu_->Embedding(&c_out.t, c_table.t, c_ids.t, row_offset));

  SS_READ_F(got, cuda_.get(), g_out);
  SS_READ_F(want, cpu_.get(), c_out);
  EXPECT_TRUE(Close("Embedding", got, want, Threshold(Op::kEmbedding, act())));
}

// Rows of 1000 (one round of loads, kept in registers; not a multiple of the block size) and of
// 10000 (more than one round: the second pass reads x and w again).
TEST_P(CudaVsCpu, RmsNorm) {
  for (const int64_t d : {int64_t{1000}, int64_t{10000}}) {
    SCOPED_TRACE(::testing::Message() << "d " << d);
    const int64_t n = 5;
    const float eps = 1e-5f;
    const std::vector<float> x = RandomValues(n * d, Seed(Op::kRmsNorm, act()), act(), -2.0f, 2.0f);
    const std::vector<float> w = RandomValues(d, Seed(Op::kRmsNorm, act(), 1), act(), 0.5f, 1.5f);

    SS_ASSIGN_OR_FAIL(Guarded g_x, UploadF(cuda_.get(), x, act(), {n, d}));
    SS_ASSIGN_OR_FAIL(Guarded g_w, UploadF(cuda_.get(), w, act(), {d}));
    SS_ASSIGN_OR_FAIL(Guarded g_out, Output(cuda_.get(), act(), {n, d}));
    SS_RUN_OP("CUDA", cuda_->RmsNorm(&g_out.t, g_x.t, g_w.t, eps));

    SS_ASSIGN_OR_FAIL(Guarded c_x, UploadF(cpu_.get(), x, DType::kF32, {n, d}));
    SS_ASSIGN_OR_FAIL(Guarded c_w, UploadF(cpu_.get(), w, DType::kF32, {d}));
    SS_ASSIGN_OR_FAIL(Guarded c_out, Output(cpu_.get(), DType::kF32, {n, d}));
    SS_RUN_OP("CPU", cpu_->RmsNorm(&c_out.t, c_x.t, c_w.t, eps));

    SS_READ_F(got, cuda_.get(), g_out);
    SS_READ_F(want, cpu_.get(), c_out);
    EXPECT_TRUE(Close("RmsNorm", got, want, Threshold(Op::kRmsNorm, act())));
  }
}

// In place over the heads of q, as Qwen3's q_norm runs: rows of head_dim 128, out aliasing x.
TEST_P(CudaVsCpu, RmsNormInPlaceOverHeads) {
  const int64_t rows = 3 * 4, d = 128;
  const float eps = 1e-6f;
  const std::vector<float> x = RandomValues(rows * d, Seed(Op::kRmsNorm, act(), 2), act(), -2.0f, 2.0f);
  const std::vector<float> w = RandomValues(d, Seed(Op::kRmsNorm, act(), 3), act(), 0.5f, 1.5f);

  SS_ASSIGN_OR_FAIL(Guarded g_x, UploadF(cuda_.get(), x, act(), {rows, d}));
  SS_ASSIGN_OR_FAIL(Guarded g_w, UploadF(cuda_.get(), w, act(), {d}));
  SS_RUN_OP("CUDA", cuda_->RmsNorm(&g_x.t, g_x.t, g_w.t, eps));

  SS_ASSIGN_OR_FAIL(Guarded c_x, UploadF(cpu_.get(), x, DType::kF32, {rows, d}));
  SS_ASSIGN_OR_FAIL(Guarded c_w, UploadF(cpu_.get(), w, DType::kF32, {d}));
  SS_ASSIGN_OR_FAIL(Guarded c_out, Output(cpu_.get(), DType::kF32, {rows, d}));
  SS_RUN_OP("CPU", cpu_->RmsNorm(&c_out.t, c_x.t, c_w.t, eps));

  SS_READ_F(got, cuda_.get(), g_x);
  SS_READ_F(want, cpu_.get(), c_out);
  EXPECT_TRUE(Close("RmsNorm in place", got, want, Threshold(Op::kRmsNorm, act())));
}

// Decode (n = 1) and prefill-sized n; with and without bias; output in the act dtype and in F32
// (logits).
TEST_P(CudaVsCpu, MatMul) {
  const int64_t k = 384, m = 520;
  for (const int64_t n : {int64_t{1}, int64_t{7}}) {
    for (const bool with_bias : {false, true}) {
      for (const bool f32_out : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "n " << n << (with_bias ? ", bias" : ", no bias")
                                          << (f32_out ? ", F32 out" : ", act out"));
        const uint32_t salt = static_cast<uint32_t>(n * 4 + with_bias * 2 + f32_out);
        const std::vector<float> x = RandomValues(n * k, Seed(Op::kMatMul, act(), salt), act());
        const std::vector<float> w = RandomValues(m * k, Seed(Op::kMatMul, act(), salt + 100), act());
        const std::vector<float> b = RandomValues(m, Seed(Op::kMatMul, act(), salt + 200), act());
        const DType out_t = f32_out ? DType::kF32 : act();

        SS_ASSIGN_OR_FAIL(Guarded g_x, UploadF(cuda_.get(), x, act(), {n, k}));
        SS_ASSIGN_OR_FAIL(Guarded g_w, UploadF(cuda_.get(), w, act(), {m, k}));
        SS_ASSIGN_OR_FAIL(Guarded g_b, UploadF(cuda_.get(), b, act(), {m}));
        SS_ASSIGN_OR_FAIL(Guarded g_out, Output(cuda_.get(), out_t, {n, m}));
        SS_RUN_OP("CUDA", cuda_->MatMul(&g_out.t, g_x.t, g_w.t, with_bias ? &g_b.t : nullptr));

        SS_ASSIGN_OR_FAIL(Guarded c_x, UploadF(cpu_.get(), x, DType::kF32, {n, k}));
        SS_ASSIGN_OR_FAIL(Guarded c_w, UploadF(cpu_.get(), w, DType::kF32, {m, k}));
        SS_ASSIGN_OR_FAIL(Guarded c_b, UploadF(cpu_.get(), b, DType::kF32, {m}));
        SS_ASSIGN_OR_FAIL(Guarded c_out, Output(cpu_.get(), DType::kF32, {n, m}));
        SS_RUN_OP("CPU", cpu_->MatMul(&c_out.t, c_x.t, c_w.t, with_bias ? &c_b.t : nullptr));

        SS_READ_F(got, cuda_.get(), g_out);
        SS_READ_F(want, cpu_.get(), c_out);
        EXPECT_TRUE(Close("MatMul", got, want, Threshold(f32_out ? Op::kMatMulF32Out : Op::kMatMul, act())));
      }
    }
  }
}

// MXFP4 weights (gpt-oss's experts as published: kernels/quant.h Mxfp4RowsLayout; written without
// a GPU, not yet run on one): Mxfp4GemvKernel for decode rows (n = 1, 2, 3, 8: its 1-, 2-, 4- and
// 8-row instances) and DequantMxfp4Kernel + cuBLAS above kGemvMaxRows (n = 33, over several blocks
// of rows: a 64 KiB scratch), with and without bias, act and F32 out, against the CPU backend's
// MXFP4 panels on the same bytes (whose results are the float32 chains over DequantizeMxfp4Rows'
// weights, kernels_cpu_test), by MatMul's thresholds. Every code, scales 2^-10 .. 2^10 with blocks of
// byte 0 (2^-127) among them; m odd (a block's second row past m), k of 1, 12 and 90 blocks (2880,
// gpt-oss's width: a block's 128 threads take 90 blocks, some threads none). A scale byte of 255 is
// refused when stored.
TEST_P(CudaVsCpu, Mxfp4MatMul) {
  absl::StatusOr<std::unique_ptr<Backend>> made =
      MakeCudaBackend(0, act(), {.quantized_kernels = true, .quantized_scratch_bytes = 64 << 10});
  ASSERT_TRUE(made.ok()) << made.status();
  Backend* cuda = made->get();
  uint32_t salt = 0;
  for (const auto& [m, k] : {std::pair<int64_t, int64_t>{37, 32}, {520, 384}, {67, 2880}}) {
    const Mxfp4RowsLayout layout{m, k};
    std::vector<uint8_t> stored(static_cast<size_t>(layout.bytes()));
    std::mt19937 rng(Seed(Op::kMatMul, act(), 9000 + salt++));
    for (int64_t i = 0; i < layout.code_bytes(); ++i) stored[i] = static_cast<uint8_t>(rng() & 0xFF);
    for (int64_t b = 0; b < layout.scale_bytes(); ++b) {
      stored[layout.code_bytes() + b] = b % 11 == 5 ? 0 : static_cast<uint8_t>(117 + rng() % 21);
    }
    Tensor on_cuda, on_cpu;
    SS_ASSIGN_OR_FAIL(Buffer cuda_w, cuda->PackQuantizedWeight(WeightQuant::kMxfp4, stored.data(), m, k, &on_cuda));
    SS_ASSIGN_OR_FAIL(Buffer cpu_w, cpu_->PackQuantizedWeight(WeightQuant::kMxfp4, stored.data(), m, k, &on_cpu));
    ASSERT_EQ(on_cuda.bytes(), stored.size());
    const std::vector<float> b = RandomValues(m, Seed(Op::kMatMul, act(), 9100 + salt), act());
    for (const auto& [n, with_bias, f32_out] : std::vector<std::tuple<int64_t, bool, bool>>{
             {1, false, false}, {2, true, true}, {3, true, false}, {8, false, true}, {33, true, false}}) {
      SCOPED_TRACE(::testing::Message() << "mxfp4 m " << m << ", k " << k << ", n " << n << (with_bias ? ", bias" : "")
                                        << (f32_out ? ", F32 out" : ", act out"));
      const std::vector<float> x = RandomValues(n * k, Seed(Op::kMatMul, act(), 9200 + salt + static_cast<uint32_t>(n)), act());
      const DType out_t = f32_out ? DType::kF32 : act();
      SS_ASSIGN_OR_FAIL(Guarded g_x, UploadF(cuda, x, act(), {n, k}));
      SS_ASSIGN_OR_FAIL(Guarded g_b, UploadF(cuda, b, act(), {m}));
      SS_ASSIGN_OR_FAIL(Guarded g_out, Output(cuda, out_t, {n, m}));
      SS_RUN_OP("CUDA", cuda->MatMul(&g_out.t, g_x.t, on_cuda, with_bias ? &g_b.t : nullptr));
      SS_ASSIGN_OR_FAIL(Guarded c_x, UploadF(cpu_.get(), x, DType::kF32, {n, k}));
      SS_ASSIGN_OR_FAIL(Guarded c_b, UploadF(cpu_.get(), b, DType::kF32, {m}));
      SS_ASSIGN_OR_FAIL(Guarded c_out, Output(cpu_.get(), DType::kF32, {n, m}));
      SS_RUN_OP("CPU", cpu_->MatMul(&c_out.t, c_x.t, on_cpu, with_bias ? &c_b.t : nullptr));
      SS_READ_F(got, cuda, g_out);
      SS_READ_F(want, cpu_.get(), c_out);
      EXPECT_TRUE(Close("MatMul mxfp4", got, want, Threshold(f32_out ? Op::kMatMulF32Out : Op::kMatMul, act())));
    }
  }
  // A scale byte of 255 (NaN in E8M0) is refused when stored, as on the CPU.
  std::vector<uint8_t> bad(static_cast<size_t>(Mxfp4RowsLayout{2, 64}.bytes()), 0x11);
  bad.back() = 255;
  Tensor packed;
  EXPECT_TRUE(absl::IsInvalidArgument(cuda->PackQuantizedWeight(WeightQuant::kMxfp4, bad.data(), 2, 64, &packed).status()));
}

// The dense GEMV (CudaBackendOptions::dense_gemv; passed on an H200, 2026-11-28):
// decode-sized n (1, 2, 3, 8), k a multiple of 8 over one round of a thread's loads and not a
// whole number of them (1000), 14,336 (Llama-3-8B's down: the long-row instance, two rounds of
// eight runs, the second partial), m odd; with and without bias, act and F32 out; against the CPU's
// float32 product, as MatMul above. The GEMV is one launch where cuBLAS with a bias is two (the
// broadcast, then the GEMM), so the launch count says which path ran; a k off the multiple of 8
// takes cuBLAS. A row's result is the same bits whatever else is in the batch.
TEST_P(CudaVsCpu, DenseGemv) {
  SS_ASSIGN_OR_FAIL(std::unique_ptr<Backend> gemv, MakeCudaBackend(0, act(), {.dense_gemv = true}));
  const int64_t m = 131;
  for (const int64_t k : {int64_t{1000}, int64_t{4096}, int64_t{14336}, int64_t{12}}) {
    std::vector<float> first_row;  // row 0's outputs at n = 1, F32 out, with bias
    for (const int64_t n : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{8}}) {
      for (const bool with_bias : {false, true}) {
        for (const bool f32_out : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "k " << k << ", n " << n << (with_bias ? ", bias" : ", no bias")
                                            << (f32_out ? ", F32 out" : ", act out"));
          const uint32_t salt = static_cast<uint32_t>(k * 64 + n * 4 + with_bias * 2 + f32_out);
          // Row 0 of x is the same for every n, so that its outputs can be compared across n.
          std::vector<float> x = RandomValues(n * k, Seed(Op::kMatMul, act(), salt + 300), act());
          const std::vector<float> x0 = RandomValues(k, Seed(Op::kMatMul, act(), static_cast<uint32_t>(k)), act());
          std::copy(x0.begin(), x0.end(), x.begin());
          const std::vector<float> w = RandomValues(m * k, Seed(Op::kMatMul, act(), static_cast<uint32_t>(k) + 1), act());
          const std::vector<float> b = RandomValues(m, Seed(Op::kMatMul, act(), static_cast<uint32_t>(k) + 2), act());
          const DType out_t = f32_out ? DType::kF32 : act();

          SS_ASSIGN_OR_FAIL(Guarded g_x, UploadF(gemv.get(), x, act(), {n, k}));
          SS_ASSIGN_OR_FAIL(Guarded g_w, UploadF(gemv.get(), w, act(), {m, k}));
          SS_ASSIGN_OR_FAIL(Guarded g_b, UploadF(gemv.get(), b, act(), {m}));
          SS_ASSIGN_OR_FAIL(Guarded g_out, Output(gemv.get(), out_t, {n, m}));
          const uint64_t before = gemv->kernel_launches();
          SS_RUN_OP("CUDA", gemv->MatMul(&g_out.t, g_x.t, g_w.t, with_bias ? &g_b.t : nullptr));
          const uint64_t want_launches = k % 8 == 0 ? 1 : (with_bias ? 2 : 1);
          EXPECT_EQ(gemv->kernel_launches() - before, want_launches) << (k % 8 == 0 ? "the GEMV" : "cuBLAS");

          SS_ASSIGN_OR_FAIL(Guarded c_x, UploadF(cpu_.get(), x, DType::kF32, {n, k}));
          SS_ASSIGN_OR_FAIL(Guarded c_w, UploadF(cpu_.get(), w, DType::kF32, {m, k}));
          SS_ASSIGN_OR_FAIL(Guarded c_b, UploadF(cpu_.get(), b, DType::kF32, {m}));
          SS_ASSIGN_OR_FAIL(Guarded c_out, Output(cpu_.get(), DType::kF32, {n, m}));
          SS_RUN_OP("CPU", cpu_->MatMul(&c_out.t, c_x.t, c_w.t, with_bias ? &c_b.t : nullptr));

          SS_READ_F(got, gemv.get(), g_out);
          SS_READ_F(want, cpu_.get(), c_out);
          EXPECT_TRUE(Close("DenseGemv", got, want, Threshold(f32_out ? Op::kMatMulF32Out : Op::kMatMul, act())));
          if (with_bias && f32_out && k % 8 == 0) {
            const std::vector<float> row0(got.begin(), got.begin() + m);
            if (n == 1) {
              first_row = row0;
            } else {
              EXPECT_EQ(row0, first_row) << "row 0 changed with " << n << " rows in the batch";
            }
          }
        }
      }
    }
  }
}

// MatMuls with the dense GEMV: a layer's q, k, v (m 131, 40, 40, bias on two) as one launch, each
// output the bits MatMul gives it alone; F32 and act out; n 1, 3, 8; k 4096 and 1000. Products
// the GEMV does not take together (outputs of two dtypes; k off the multiple of 8) are MatMul's
// launches, one by one, with the same results. Against the CPU's float32 products as above.
// GateUpSilu with CudaBackendOptions::fused_kernels (passed on an H200, 2026-11-28): one
// launch of the dense GEMV whose blocks each compute a row of gate and of up and write silu x up,
// bit for bit what the base's MatMuls then SiluMul give on a backend without the option. k 4096
// (a row in one round), 14336 (the long-row steps) and 1000 (off the GEMV: the base's calls on
// both); n 1, 3, 8, and 12 (past the GEMV: cuBLAS, the base's calls).
TEST_P(CudaVsCpu, GateUpSiluFusedIsMatMulsThenSiluMul) {
  SS_ASSIGN_OR_FAIL(std::unique_ptr<Backend> fused, MakeCudaBackend(0, act(), {.fused_kernels = true, .dense_gemv = true}));
  SS_ASSIGN_OR_FAIL(std::unique_ptr<Backend> plain, MakeCudaBackend(0, act(), {.dense_gemv = true}));
  const int64_t f = 131;
  for (const int64_t k : {int64_t{4096}, int64_t{14336}, int64_t{1000}}) {
    for (const int64_t n : {int64_t{1}, int64_t{3}, int64_t{8}, int64_t{12}}) {
      SCOPED_TRACE(::testing::Message() << "k " << k << ", n " << n);
      const uint32_t salt = static_cast<uint32_t>(k * 16 + n);
      const std::vector<float> x = RandomValues(n * k, Seed(Op::kMatMul, act(), salt + 800), act());
      const std::vector<float> gw = RandomValues(f * k, Seed(Op::kMatMul, act(), salt + 801), act());
      const std::vector<float> uw = RandomValues(f * k, Seed(Op::kMatMul, act(), salt + 802), act());
      std::vector<float> results[2];
      for (int which = 0; which < 2; ++which) {
        Backend* be = which == 0 ? fused.get() : plain.get();
        SS_ASSIGN_OR_FAIL(Guarded g_x, UploadF(be, x, act(), {n, k}));
        SS_ASSIGN_OR_FAIL(Guarded g_gw, UploadF(be, gw, act(), {f, k}));
        SS_ASSIGN_OR_FAIL(Guarded g_uw, UploadF(be, uw, act(), {f, k}));
        SS_ASSIGN_OR_FAIL(Guarded g_gate, Output(be, act(), {n, f}));
        SS_ASSIGN_OR_FAIL(Guarded g_up, Output(be, act(), {n, f}));
        const uint64_t before = be->kernel_launches();
        const char* name = which == 0 ? "fused" : "plain";
        SS_RUN_OP(name, be->GateUpSilu(&g_gate.t, &g_up.t, g_x.t, g_gw.t, g_uw.t));
        if (which == 0 && k % 8 == 0 && n <= 8) {
          EXPECT_EQ(be->kernel_launches() - before, 1u) << "gate, up and SiLU x up in one launch";
        }
        SS_READ_F(got, be, g_gate);
        results[which] = got;
      }
      EXPECT_EQ(results[0], results[1]) << "the fused launch differs from MatMuls then SiluMul";
      bool finite = true;
      for (const float v : results[0]) finite = finite && std::isfinite(v);
      EXPECT_TRUE(finite);
    }
  }
}

TEST_P(CudaVsCpu, DenseGemvProductsInOneLaunch) {
  SS_ASSIGN_OR_FAIL(std::unique_ptr<Backend> gemv, MakeCudaBackend(0, act(), {.dense_gemv = true}));
  const int64_t ms[3] = {131, 40, 40};
  const bool biased[3] = {true, false, true};
  for (const int64_t k : {int64_t{4096}, int64_t{1000}, int64_t{12}}) {
    for (const int64_t n : {int64_t{1}, int64_t{3}, int64_t{8}}) {
      for (const int out_case : {0, 1, 2}) {  // act out, F32 out, mixed (F32 for k: the GEMV per product)
        SCOPED_TRACE(::testing::Message() << "k " << k << ", n " << n << ", out case " << out_case);
        const uint32_t salt = static_cast<uint32_t>(k * 64 + n * 4 + out_case);
        const std::vector<float> x = RandomValues(n * k, Seed(Op::kMatMul, act(), salt + 500), act());
        SS_ASSIGN_OR_FAIL(Guarded g_x, UploadF(gemv.get(), x, act(), {n, k}));
        SS_ASSIGN_OR_FAIL(Guarded c_x, UploadF(cpu_.get(), x, DType::kF32, {n, k}));
        std::vector<Guarded> g_w, g_b, g_out, g_alone, c_w, c_b, c_out;
        std::vector<MatMulProduct> products;
        for (int p = 0; p < 3; ++p) {
          const int64_t m = ms[p];
          const std::vector<float> w = RandomValues(m * k, Seed(Op::kMatMul, act(), salt + 600 + p), act());
          const std::vector<float> b = RandomValues(m, Seed(Op::kMatMul, act(), salt + 700 + p), act());
          const DType out_t = out_case == 1 || (out_case == 2 && p == 1) ? DType::kF32 : act();
          SS_ASSIGN_OR_FAIL(Guarded gw, UploadF(gemv.get(), w, act(), {m, k}));
          SS_ASSIGN_OR_FAIL(Guarded gb, UploadF(gemv.get(), b, act(), {m}));
          SS_ASSIGN_OR_FAIL(Guarded go, Output(gemv.get(), out_t, {n, m}));
          SS_ASSIGN_OR_FAIL(Guarded ga, Output(gemv.get(), out_t, {n, m}));
          SS_ASSIGN_OR_FAIL(Guarded cw, UploadF(cpu_.get(), w, DType::kF32, {m, k}));
          SS_ASSIGN_OR_FAIL(Guarded cb, UploadF(cpu_.get(), b, DType::kF32, {m}));
          SS_ASSIGN_OR_FAIL(Guarded co, Output(cpu_.get(), DType::kF32, {n, m}));
          g_w.push_back(std::move(gw)), g_b.push_back(std::move(gb)), g_out.push_back(std::move(go));
          g_alone.push_back(std::move(ga)), c_w.push_back(std::move(cw)), c_b.push_back(std::move(cb));
          c_out.push_back(std::move(co));
        }
        for (int p = 0; p < 3; ++p) products.push_back({&g_out[p].t, &g_w[p].t, biased[p] ? &g_b[p].t : nullptr});
        const uint64_t before = gemv->kernel_launches();
        SS_RUN_OP("CUDA", gemv->MatMuls(g_x.t, products));
        // The mixed case has two output dtypes but in float32 activations (all F32 then).
        const bool together = k % 8 == 0 && !(out_case == 2 && act() != DType::kF32);
        // Apart: the GEMV is one launch a product; cuBLAS is two with a bias (broadcast, GEMM).
        const uint64_t apart = k % 8 == 0 ? 3 : 5;
        EXPECT_EQ(gemv->kernel_launches() - before, together ? 1 : apart) << (together ? "one launch" : "apart");
        for (int p = 0; p < 3; ++p) {
          SCOPED_TRACE(::testing::Message() << "product " << p);
          SS_RUN_OP("CUDA", gemv->MatMul(&g_alone[p].t, g_x.t, g_w[p].t, biased[p] ? &g_b[p].t : nullptr));
          SS_RUN_OP("CPU", cpu_->MatMul(&c_out[p].t, c_x.t, c_w[p].t, biased[p] ? &c_b[p].t : nullptr));
          SS_READ_F(got, gemv.get(), g_out[p]);
          SS_READ_F(alone, gemv.get(), g_alone[p]);
          SS_READ_F(want, cpu_.get(), c_out[p]);
          EXPECT_EQ(got, alone) << "MatMuls and MatMul differ";
          const bool f32_out = g_out[p].t.dtype == DType::kF32;
          EXPECT_TRUE(Close("MatMuls", got, want, Threshold(f32_out ? Op::kMatMulF32Out : Op::kMatMul, act())));
        }
      }
    }
  }
}

// The rotary embeddings the worker runs: the whole head; and RopeOptions' partial rotary (48 of
// head_dim 64, the rest passed through), attention factor 1.2 on cos and sin, and LongRoPE's long
// frequencies from position 512 on (not yet run on a GPU).
struct RopeCase {
  const char* name;
  int rotary_dim;  // 0: the whole head
  float attention_factor;
  int64_t long_from;  // -1: no long frequencies
};
constexpr RopeCase kRopeCases[] = {{"whole head", 0, 1.0f, -1}, {"partial, factor, long", 48, 1.2f, 512}};

// inv_freq [rd / 2] of base `theta`, as transformers computes it in float32.
std::vector<float> RopeFreqs(int64_t rd, float theta) {
  std::vector<float> inv(rd / 2);
  for (int64_t i = 0; i < rd / 2; ++i) inv[i] = 1.0f / std::pow(theta, static_cast<float>(2 * i) / static_cast<float>(rd));
  return inv;
}

TEST_P(CudaVsCpu, Rope) {
  const int64_t n = 6, q_heads = 8, kv_heads = 2, hd = 64;
  const std::vector<float> q = RandomValues(n * q_heads * hd, Seed(Op::kRope, act()), act());
  const std::vector<float> k = RandomValues(n * kv_heads * hd, Seed(Op::kRope, act(), 1), act());
  // Position 0 (identity), small ones and long-context ones (angles of thousands of radians).
  const std::vector<int32_t> positions = {0, 1, 17, 511, 4095, 32767};
  for (const RopeCase& rc : kRopeCases) {
    SCOPED_TRACE(rc.name);
    const int64_t rd = rc.rotary_dim > 0 ? rc.rotary_dim : hd;
    const std::vector<float> inv_freq = RopeFreqs(rd, 10000.0f), long_freq = RopeFreqs(rd, 640000.0f);
    SS_ASSIGN_OR_FAIL(Guarded g_q, UploadF(cuda_.get(), q, act(), {n, q_heads * hd}));
    SS_ASSIGN_OR_FAIL(Guarded g_k, UploadF(cuda_.get(), k, act(), {n, kv_heads * hd}));
    SS_ASSIGN_OR_FAIL(Guarded g_pos, UploadI(cuda_.get(), positions, {n}));
    SS_ASSIGN_OR_FAIL(Guarded g_freq, UploadF(cuda_.get(), inv_freq, DType::kF32, {rd / 2}));
    SS_ASSIGN_OR_FAIL(Guarded g_long, UploadF(cuda_.get(), long_freq, DType::kF32, {rd / 2}));
    const RopeOptions g_opt{.rotary_dim = rc.rotary_dim, .attention_factor = rc.attention_factor,
                            .long_inv_freq = rc.long_from >= 0 ? &g_long.t : nullptr,
                            .long_from = std::max<int64_t>(rc.long_from, 0)};
    SS_RUN_OP("CUDA", cuda_->Rope(&g_q.t, &g_k.t, g_pos.t, g_freq.t, static_cast<int>(hd), g_opt));

    SS_ASSIGN_OR_FAIL(Guarded c_q, UploadF(cpu_.get(), q, DType::kF32, {n, q_heads * hd}));
    SS_ASSIGN_OR_FAIL(Guarded c_k, UploadF(cpu_.get(), k, DType::kF32, {n, kv_heads * hd}));
    SS_ASSIGN_OR_FAIL(Guarded c_pos, UploadI(cpu_.get(), positions, {n}));
    SS_ASSIGN_OR_FAIL(Guarded c_freq, UploadF(cpu_.get(), inv_freq, DType::kF32, {rd / 2}));
    SS_ASSIGN_OR_FAIL(Guarded c_long, UploadF(cpu_.get(), long_freq, DType::kF32, {rd / 2}));
    RopeOptions c_opt = g_opt;
    c_opt.long_inv_freq = rc.long_from >= 0 ? &c_long.t : nullptr;
    SS_RUN_OP("CPU", cpu_->Rope(&c_q.t, &c_k.t, c_pos.t, c_freq.t, static_cast<int>(hd), c_opt));

    SS_READ_F(got_q, cuda_.get(), g_q);
    SS_READ_F(want_q, cpu_.get(), c_q);
    EXPECT_TRUE(Close("Rope q", got_q, want_q, Threshold(Op::kRope, act())));
    SS_READ_F(got_k, cuda_.get(), g_k);
    SS_READ_F(want_k, cpu_.get(), c_k);
    EXPECT_TRUE(Close("Rope k", got_k, want_k, Threshold(Op::kRope, act())));
    // The passed-through dimensions are the input's, bit for bit (in the act dtype).
    const std::vector<float> q_act = RoundTo(q, act());
    for (int64_t row = 0; row < n * q_heads; ++row) {
      for (int64_t d = rd; d < hd; ++d) ASSERT_EQ(got_q[row * hd + d], q_act[row * hd + d]) << "row " << row << " dim " << d;
    }
  }
}

// RopeCacheWrite (CudaBackendOptions::fused_kernels: one kernel; passed on an H200, 2026-11-28, for
// the whole head; kRopeCases' partial rotary, factor and long frequencies not yet run on a GPU): q,
// k and both caches bit for bit
// those of Rope then CacheWrite on a backend without the option (the base's composition), one
// launch against two; GQA heads of 64, positions up to 32767, scattered slots. Then a bad slot
// (-1, one past the end): reported at the next sync naming CacheWrite, its token's k and v not
// written anywhere, the other tokens' written.
TEST_P(CudaVsCpu, RopeCacheWrite) {
  SS_ASSIGN_OR_FAIL(std::unique_ptr<Backend> fused, MakeCudaBackend(0, act(), {.fused_kernels = true}));
  const int64_t blocks = 10, bs = 16, q_heads = 8, kv_heads = 2, hd = 64, n = 6, row = kv_heads * hd;
  const std::vector<float> q = RandomValues(n * q_heads * hd, Seed(Op::kRope, act(), 20), act());
  const std::vector<float> k = RandomValues(n * row, Seed(Op::kRope, act(), 21), act());
  const std::vector<float> v = RandomValues(n * row, Seed(Op::kRope, act(), 22), act());
  const std::vector<float> cache = RandomValues(blocks * bs * row, Seed(Op::kCacheWrite, act(), 23), act());
  const std::vector<int32_t> positions = {0, 1, 17, 511, 4095, 32767};
  for (const RopeCase& rc : kRopeCases) {
    for (const bool bad : {false, true}) {
      SCOPED_TRACE(absl::StrCat(rc.name, bad ? ", a bad slot" : ", good slots"));
      const int64_t rd = rc.rotary_dim > 0 ? rc.rotary_dim : hd;
      const std::vector<float> inv_freq = RopeFreqs(rd, 10000.0f), long_freq = RopeFreqs(rd, 640000.0f);
      const std::vector<int32_t> slots =
          bad ? std::vector<int32_t>{0, -1, 16, 160, 77, 31} : std::vector<int32_t>{0, 159, 16, 17, 77, 31};
      std::vector<std::vector<float>> results[2];
      for (int which = 0; which < 2; ++which) {
        Backend* be = which == 0 ? cuda_.get() : fused.get();
        SS_ASSIGN_OR_FAIL(Guarded g_q, UploadF(be, q, act(), {n, q_heads * hd}));
        SS_ASSIGN_OR_FAIL(Guarded g_k, UploadF(be, k, act(), {n, row}));
        SS_ASSIGN_OR_FAIL(Guarded g_v, UploadF(be, v, act(), {n, row}));
        SS_ASSIGN_OR_FAIL(Guarded g_kc, UploadF(be, cache, act(), {blocks, bs, kv_heads, hd}));
        SS_ASSIGN_OR_FAIL(Guarded g_vc, UploadF(be, cache, act(), {blocks, bs, kv_heads, hd}));
        SS_ASSIGN_OR_FAIL(Guarded g_pos, UploadI(be, positions, {n}));
        SS_ASSIGN_OR_FAIL(Guarded g_slots, UploadI(be, slots, {n}));
        SS_ASSIGN_OR_FAIL(Guarded g_freq, UploadF(be, inv_freq, DType::kF32, {rd / 2}));
        SS_ASSIGN_OR_FAIL(Guarded g_long, UploadF(be, long_freq, DType::kF32, {rd / 2}));
        const RopeOptions opt{.rotary_dim = rc.rotary_dim, .attention_factor = rc.attention_factor,
                              .long_inv_freq = rc.long_from >= 0 ? &g_long.t : nullptr,
                              .long_from = std::max<int64_t>(rc.long_from, 0)};
        const uint64_t launches = be->kernel_launches();
        SS_ASSERT_OK(be->RopeCacheWrite(&g_q.t, &g_k.t, g_v.t, g_pos.t, g_freq.t, static_cast<int>(hd), opt, &g_kc.t,
                                        &g_vc.t, g_slots.t));
        EXPECT_EQ(be->kernel_launches() - launches, which == 1 ? 1u : 2u);
        const absl::Status sync = be->Synchronize();
        if (bad) {
          EXPECT_TRUE(absl::IsInvalidArgument(sync)) << sync;
          EXPECT_NE(std::string(sync.message()).find("CacheWrite"), std::string::npos) << sync;
        } else {
          SS_ASSERT_OK(sync);
        }
        for (Guarded* g : {&g_q, &g_k, &g_kc, &g_vc}) {
          SS_READ_F(got, be, *g);
          results[which].push_back(got);
        }
      }
      const char* names[] = {"q", "k", "k_cache", "v_cache"};
      for (int i = 0; i < 4; ++i) EXPECT_EQ(results[1][i], results[0][i]) << names[i] << " differs from Rope + CacheWrite";
      if (bad) {  // token 1 (slot -1) and token 3 (slot 160, past the end) wrote nothing
        std::vector<float> want = cache;
        for (const int t : {0, 2, 4, 5}) {
          std::copy(v.begin() + t * row, v.begin() + (t + 1) * row, want.begin() + slots[t] * row);
        }
        EXPECT_EQ(results[1][3], RoundTo(want, act())) << "v_cache: only the good slots written";
      }
    }
  }
}

TEST_P(CudaVsCpu, CacheWrite) {
  const int64_t blocks = 10, bs = 16, kv_heads = 2, hd = 64, n = 7, row = kv_heads * hd;
  const int64_t cache_numel = blocks * bs * row;
  // The caches start with the same random contents on both sides; slots the op does not write
  // must keep them.
  const std::vector<float> k_cache = RandomValues(cache_numel, Seed(Op::kCacheWrite, act()), act());
  const std::vector<float> v_cache = RandomValues(cache_numel, Seed(Op::kCacheWrite, act(), 1), act());
  const std::vector<float> k = RandomValues(n * row, Seed(Op::kCacheWrite, act(), 2), act());
  const std::vector<float> v = RandomValues(n * row, Seed(Op::kCacheWrite, act(), 3), act());
  const std::vector<int32_t> slots = {0, 159, 16, 17, 77, 31, 100};  // first and last slot included

  SS_ASSIGN_OR_FAIL(Guarded g_kc, UploadF(cuda_.get(), k_cache, act(), {blocks, bs, kv_heads, hd}));
  SS_ASSIGN_OR_FAIL(Guarded g_vc, UploadF(cuda_.get(), v_cache, act(), {blocks, bs, kv_heads, hd}));
  SS_ASSIGN_OR_FAIL(Guarded g_k, UploadF(cuda_.get(), k, act(), {n, row}));
  SS_ASSIGN_OR_FAIL(Guarded g_v, UploadF(cuda_.get(), v, act(), {n, row}));
  SS_ASSIGN_OR_FAIL(Guarded g_slots, UploadI(cuda_.get(), slots, {n}));
  SS_RUN_OP("CUDA", cuda_->CacheWrite(&g_kc.t, &g_vc.t, g_k.t, g_v.t, g_slots.t));

  SS_ASSIGN_OR_FAIL(Guarded c_kc, UploadF(cpu_.get(), k_cache, DType::kF32, {blocks, bs, kv_heads, hd}));
  SS_ASSIGN_OR_FAIL(Guarded c_vc, UploadF(cpu_.get(), v_cache, DType::kF32, {blocks, bs, kv_heads, hd}));
  SS_ASSIGN_OR_FAIL(Guarded c_k, UploadF(cpu_.get(), k, DType::kF32, {n, row}));
  SS_ASSIGN_OR_FAIL(Guarded c_v, UploadF(cpu_.get(), v, DType::kF32, {n, row}));
  SS_ASSIGN_OR_FAIL(Guarded c_slots, UploadI(cpu_.get(), slots, {n}));
  SS_RUN_OP("CPU", cpu_->CacheWrite(&c_kc.t, &c_vc.t, c_k.t, c_v.t, c_slots.t));

  SS_READ_F(got_k, cuda_.get(), g_kc);
  SS_READ_F(want_k, cpu_.get(), c_kc);
  EXPECT_TRUE(Close("CacheWrite k_cache", got_k, want_k, Threshold(Op::kCacheWrite, act())));
  SS_READ_F(got_v, cuda_.get(), g_vc);
  SS_READ_F(want_v, cpu_.get(), c_vc);
  EXPECT_TRUE(Close("CacheWrite v_cache", got_v, want_v, Threshold(Op::kCacheWrite, act())));
  SS_ASSERT_OK(cuda_->Synchronize());  // no bad-slot error was raised
}

// The batch mixes a decode token deep in its sequence (context 151: three 64-key chunks of the
// kernel's online softmax), a prefill of 20 tokens from position 0 and a chunked prefill at
// positions 37..44, with the tokens of different sequences interleaved and blocks scattered over
// the cache. Three head layouts: GQA (8 q heads on 2 kv heads, hd 128), plain MHA (hd 64) and a
// head dim of 30, off the 16-byte loads of keys and the 4-value loads of values (their scalar
// paths, the last lane's run cut at the head's end).
// Block tables [3, max_blocks] of three sequences needing 2, 10 and 3 blocks (positions up to 19,
// 150 and 44): a random permutation of the cache's `blocks` blocks dealt out to them. Unused entries
// point at block 0 (valid, never read).
std::vector<int32_t> ThreeSequenceTables(uint32_t seed, int64_t blocks, int64_t max_blocks) {
  std::vector<int32_t> perm(blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937 rng(seed);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> tables(3 * max_blocks, 0);
  const int64_t blocks_needed[3] = {2, 10, 3};
  int next = 0;
  for (int64_t s = 0; s < 3; ++s) {
    for (int64_t b = 0; b < blocks_needed[s]; ++b) tables[s * max_blocks + b] = perm[next++];
  }
  return tables;
}

void CudaVsCpu::CheckAttention(const AttentionFeatures& features) {
  // Sinks below, among and above the scores (~1-5 in magnitude), far below and far above.
  constexpr float kSinks[8] = {-40.0f, 0.5f, 3.0f, 40.0f, -2.0f, 1.0f, 6.0f, -0.5f};
  struct Layout {
    int64_t q_heads, kv_heads, hd;
  };
  for (const Layout& lay : {Layout{8, 2, 128}, Layout{4, 4, 64}, Layout{4, 2, 30}}) {
    SCOPED_TRACE(::testing::Message() << "q_heads " << lay.q_heads << ", kv_heads " << lay.kv_heads << ", hd "
                                      << lay.hd);
    const int64_t blocks = 40, bs = 16, max_blocks = 12, seqs = 3;
    const uint32_t salt = static_cast<uint32_t>(lay.hd);
    const std::vector<int32_t> tables = ThreeSequenceTables(Seed(Op::kAttention, act(), salt), blocks, max_blocks);
    // Tokens: (sequence, position), interleaved.
    std::vector<int32_t> token_seq, positions;
    token_seq.push_back(1);
    positions.push_back(150);
    for (int p = 0; p < 20; ++p) {
      token_seq.push_back(0);
      positions.push_back(p);
      if (p % 3 == 0 && 37 + p / 3 <= 44) {
        token_seq.push_back(2);
        positions.push_back(37 + p / 3);
      }
    }
    for (int p = 37 + 7; p <= 44; ++p) {
      token_seq.push_back(2);
      positions.push_back(p);
    }
    const int64_t n = static_cast<int64_t>(token_seq.size());
    const int64_t q_width = lay.q_heads * lay.hd;
    const int64_t cache_numel = blocks * bs * lay.kv_heads * lay.hd;
    // q in [-3, 3] gives scores of magnitude ~1-5 after scaling: peaked, not flat, softmaxes.
    const std::vector<float> q = RandomValues(n * q_width, Seed(Op::kAttention, act(), salt + 1), act(),
                                              -features.q_range, features.q_range);
    const std::vector<float> k_cache = RandomValues(cache_numel, Seed(Op::kAttention, act(), salt + 2), act());
    const std::vector<float> v_cache = RandomValues(cache_numel, Seed(Op::kAttention, act(), salt + 3), act());
    const float scale = 1.0f / std::sqrt(static_cast<float>(lay.hd));
    const std::initializer_list<int64_t> cache_dims = {blocks, bs, lay.kv_heads, lay.hd};
    std::vector<float> sinks;  // F32 on every backend, whatever the act dtype
    for (int64_t h = 0; features.sinks && h < lay.q_heads; ++h) sinks.push_back(kSinks[h % 8]);
    // The options on one backend: its own copy of the sinks, which `keep` holds.
    auto options_on = [&](Backend* be, std::optional<Guarded>* keep) -> absl::StatusOr<AttentionOptions> {
      AttentionOptions options{.window = features.window, .softcap = features.softcap};
      if (!sinks.empty()) {
        absl::StatusOr<Guarded> g = UploadF(be, sinks, DType::kF32, {lay.q_heads});
        if (!g.ok()) return g.status();
        keep->emplace(*std::move(g));
        options.sinks = &(*keep)->t;
      }
      return options;
    };

    SS_ASSIGN_OR_FAIL(Guarded g_q, UploadF(cuda_.get(), q, act(), {n, q_width}));
    SS_ASSIGN_OR_FAIL(Guarded g_kc, UploadF(cuda_.get(), k_cache, act(), cache_dims));
    SS_ASSIGN_OR_FAIL(Guarded g_vc, UploadF(cuda_.get(), v_cache, act(), cache_dims));
    SS_ASSIGN_OR_FAIL(Guarded g_pos, UploadI(cuda_.get(), positions, {n}));
    SS_ASSIGN_OR_FAIL(Guarded g_seq, UploadI(cuda_.get(), token_seq, {n}));
    SS_ASSIGN_OR_FAIL(Guarded g_tab, UploadI(cuda_.get(), tables, {seqs, max_blocks}));
    SS_ASSIGN_OR_FAIL(Guarded g_out, Output(cuda_.get(), act(), {n, q_width}));
    std::optional<Guarded> g_sinks, s_sinks, c_sinks;
    SS_ASSIGN_OR_FAIL(const AttentionOptions g_options, options_on(cuda_.get(), &g_sinks));
    SS_RUN_OP("CUDA", cuda_->Attention(&g_out.t, g_q.t, g_kc.t, g_vc.t, g_pos.t, g_seq.t, g_tab.t, scale, g_options));
    // Split-KV (CudaBackendOptions::split_attention_keys; passed on an H200): 32-key ranges, six
    // of them for the tables' 192 keys. Only steps of up to 8 tokens split: the first 8 tokens, on
    // a backend of their own, whose contexts (151, 1, 38, 2, 3, 4, 39, 5 keys) take five, one and
    // two ranges, the others past the context. With a window the ranges cover the window from its
    // first key, and a window of at most 32 keys is one range: the unsplit kernel.
    SS_ASSIGN_OR_FAIL(std::unique_ptr<Backend> split, MakeCudaBackend(0, act(), {.split_attention_keys = 32}));
    const int64_t ns = 8;
    SS_ASSIGN_OR_FAIL(Guarded s_q, UploadF(split.get(), std::vector<float>(q.begin(), q.begin() + ns * q_width), act(),
                                           {ns, q_width}));
    SS_ASSIGN_OR_FAIL(Guarded s_kc, UploadF(split.get(), k_cache, act(), cache_dims));
    SS_ASSIGN_OR_FAIL(Guarded s_vc, UploadF(split.get(), v_cache, act(), cache_dims));
    SS_ASSIGN_OR_FAIL(Guarded s_pos, UploadI(split.get(), {positions.begin(), positions.begin() + ns}, {ns}));
    SS_ASSIGN_OR_FAIL(Guarded s_seq, UploadI(split.get(), {token_seq.begin(), token_seq.begin() + ns}, {ns}));
    SS_ASSIGN_OR_FAIL(Guarded s_tab, UploadI(split.get(), tables, {seqs, max_blocks}));
    SS_ASSIGN_OR_FAIL(Guarded s_out, Output(split.get(), act(), {ns, q_width}));
    SS_ASSIGN_OR_FAIL(const AttentionOptions s_options, options_on(split.get(), &s_sinks));
    const uint64_t launches = split->kernel_launches();
    SS_RUN_OP("CUDA split",
              split->Attention(&s_out.t, s_q.t, s_kc.t, s_vc.t, s_pos.t, s_seq.t, s_tab.t, scale, s_options));
    const int64_t span = features.window > 0 ? std::min<int64_t>(features.window, max_blocks * bs) : max_blocks * bs;
    EXPECT_EQ(split->kernel_launches(), launches + (span > 32 ? 2 : 1)) << "the ranges' kernel and the combining one";

    SS_ASSIGN_OR_FAIL(Guarded c_q, UploadF(cpu_.get(), q, DType::kF32, {n, q_width}));
    SS_ASSIGN_OR_FAIL(Guarded c_kc, UploadF(cpu_.get(), k_cache, DType::kF32, cache_dims));
    SS_ASSIGN_OR_FAIL(Guarded c_vc, UploadF(cpu_.get(), v_cache, DType::kF32, cache_dims));
    SS_ASSIGN_OR_FAIL(Guarded c_pos, UploadI(cpu_.get(), positions, {n}));
    SS_ASSIGN_OR_FAIL(Guarded c_seq, UploadI(cpu_.get(), token_seq, {n}));
    SS_ASSIGN_OR_FAIL(Guarded c_tab, UploadI(cpu_.get(), tables, {seqs, max_blocks}));
    SS_ASSIGN_OR_FAIL(Guarded c_out, Output(cpu_.get(), DType::kF32, {n, q_width}));
    SS_ASSIGN_OR_FAIL(const AttentionOptions c_options, options_on(cpu_.get(), &c_sinks));
    SS_RUN_OP("CPU", cpu_->Attention(&c_out.t, c_q.t, c_kc.t, c_vc.t, c_pos.t, c_seq.t, c_tab.t, scale, c_options));

    SS_READ_F(got, cuda_.get(), g_out);
    SS_READ_F(want, cpu_.get(), c_out);
    EXPECT_TRUE(Close("Attention", got, want, Threshold(Op::kAttention, act())));
    SS_ASSERT_OK(cuda_->Synchronize());  // no bad-metadata error was raised
    SS_READ_F(got_split, split.get(), s_out);
    EXPECT_TRUE(Close("Attention split over the keys", got_split,
                      std::vector<float>(want.begin(), want.begin() + ns * q_width), Threshold(Op::kAttention, act())));
    SS_ASSERT_OK(split->Synchronize());
  }
}

TEST_P(CudaVsCpu, Attention) { CheckAttention({}); }

// Sliding windows (AttentionOptions::window) of 7 keys (within a 16-key block or across a
// boundary, one split range), 40 (across blocks; the decode's keys 111..150 in two ranges), 151
// (the decode's whole context), 1000 (longer than every context: no key masked).
TEST_P(CudaVsCpu, AttentionSlidingWindow) {
  for (int64_t window : {7, 40, 151, 1000}) {
    SCOPED_TRACE(::testing::Message() << "window " << window);
    CheckAttention({.window = window});
  }
}

// Soft-capping (AttentionOptions::softcap): queries in [-30, 30] give scores up to ~40, deep in
// tanh's saturation at softcap 5 (where the cap also shrinks the scores' rounding differences);
// at softcap 50, nearly linear, queries in [-12, 12] (scores up to ~16, each capped by ~3%), so that
// the float32 score differences between the backends' summation orders, which grow with the
// scores and pass unattenuated through a peaked softmax, stay well inside Attention's 2e-5.
TEST_P(CudaVsCpu, AttentionSoftcap) {
  CheckAttention({.softcap = 5.0f, .q_range = 30.0f});
  CheckAttention({.softcap = 50.0f, .q_range = 12.0f});
}

// Attention sinks (AttentionOptions::sinks), per head from far below to far above the scores.
TEST_P(CudaVsCpu, AttentionSinks) { CheckAttention({.sinks = true}); }

TEST_P(CudaVsCpu, AttentionAllOptions) { CheckAttention({.window = 40, .softcap = 5.0f, .sinks = true, .q_range = 8.0f}); }

// Multi-head latent attention (DeepSeek-V3's) against the CPU backend, which kernels_cpu_test and
// the DeepSeek-V3 parity fixtures check against transformers: three sequences over a cache of
// random rows whose block tables are a permutation of the blocks, the step's tokens (a prefill of
// 20 positions, one of 8 interleaved with it, a decode at position 150) written into their slots
// first, in a small shape and in one with DeepSeek-V3's head sizes and a latent width that is not a
// multiple of the block's threads. The caches afterwards must be identical.
TEST_P(CudaVsCpu, MlaAttention) {
  for (const MlaShape& shape : {MlaShape{.heads = 4, .nope = 32, .rope = 16, .v = 24, .latent = 64},
                                MlaShape{.heads = 2, .nope = 128, .rope = 64, .v = 128, .latent = 520}}) {
    SCOPED_TRACE(::testing::Message() << "heads " << shape.heads << ", nope " << shape.nope << ", rope " << shape.rope
                                      << ", v " << shape.v << ", latent " << shape.latent);
    const int64_t blocks = 40, bs = 16, max_blocks = 12, seqs = 3, row = shape.latent + shape.rope;
    const uint32_t salt = static_cast<uint32_t>(shape.latent);
    const std::vector<int32_t> tables = ThreeSequenceTables(Seed(Op::kMlaAttention, act(), salt), blocks, max_blocks);
    std::vector<int32_t> token_seq = {1}, positions = {150};
    for (int p = 0; p < 20; ++p) {
      token_seq.push_back(0);
      positions.push_back(p);
      if (p % 3 == 0) {
        token_seq.push_back(2);
        positions.push_back(37 + p / 3);
      }
    }
    const int64_t n = static_cast<int64_t>(token_seq.size());
    std::vector<int32_t> slots(n);
    for (int64_t t = 0; t < n; ++t) {
      slots[t] = tables[token_seq[t] * max_blocks + positions[t] / bs] * bs + positions[t] % bs;
    }
    const int64_t H = shape.heads;
    // Queries in [-3, 3] and kv_b in [-1/4, 1/4] give scores of magnitude ~1-5: peaked softmaxes.
    const std::vector<float> q_nope =
        RandomValues(n * H * shape.nope, Seed(Op::kMlaAttention, act(), salt + 1), act(), -3.0f, 3.0f);
    const std::vector<float> q_pe =
        RandomValues(n * H * shape.rope, Seed(Op::kMlaAttention, act(), salt + 2), act(), -3.0f, 3.0f);
    const std::vector<float> kv_c = RandomValues(n * shape.latent, Seed(Op::kMlaAttention, act(), salt + 3), act());
    const std::vector<float> k_pe = RandomValues(n * shape.rope, Seed(Op::kMlaAttention, act(), salt + 4), act());
    const std::vector<float> kv_b = RandomValues(H * (shape.nope + shape.v) * shape.latent,
                                                 Seed(Op::kMlaAttention, act(), salt + 5), act(), -0.25f, 0.25f);
    const std::vector<float> cache = RandomValues(blocks * bs * row, Seed(Op::kMlaAttention, act(), salt + 6), act());
    const float scale = 1.0f / std::sqrt(static_cast<float>(shape.nope + shape.rope));

    struct Inputs {
      Guarded out, q_nope, q_pe, kv_c, k_pe, kv_b, cache, slots, positions, token_seq, tables;
    };
    auto run = [&](Backend* be, DType t) -> absl::StatusOr<Inputs> {
      absl::StatusOr<Guarded> parts[11] = {
          Output(be, t, {n, H * shape.v}),
          UploadF(be, q_nope, t, {n, H * shape.nope}),
          UploadF(be, q_pe, t, {n, H * shape.rope}),
          UploadF(be, kv_c, t, {n, shape.latent}),
          UploadF(be, k_pe, t, {n, shape.rope}),
          UploadF(be, kv_b, t, {H * (shape.nope + shape.v), shape.latent}),
          UploadF(be, cache, t, {blocks, bs, 1, row}),
          UploadI(be, slots, {n}),
          UploadI(be, positions, {n}),
          UploadI(be, token_seq, {n}),
          UploadI(be, tables, {seqs, max_blocks}),
      };
      for (const auto& p : parts) {
        if (!p.ok()) return p.status();
      }
      Inputs in{*std::move(parts[0]), *std::move(parts[1]), *std::move(parts[2]), *std::move(parts[3]),
                *std::move(parts[4]), *std::move(parts[5]), *std::move(parts[6]), *std::move(parts[7]),
                *std::move(parts[8]), *std::move(parts[9]), *std::move(parts[10])};
      absl::Status s = be->MlaAttention(&in.out.t, in.q_nope.t, in.q_pe.t, in.kv_c.t, in.k_pe.t, in.kv_b.t,
                                        &in.cache.t, in.slots.t, in.positions.t, in.token_seq.t, in.tables.t, scale,
                                        shape);
      if (!s.ok()) return s;
      return in;
    };
    SS_ASSIGN_OR_FAIL(Inputs g, run(cuda_.get(), act()));
    SS_ASSIGN_OR_FAIL(Inputs c, run(cpu_.get(), DType::kF32));
    SS_ASSERT_OK(cuda_->Synchronize());  // no bad-metadata error was raised
    SS_READ_F(got, cuda_.get(), g.out);
    SS_READ_F(want, cpu_.get(), c.out);
    EXPECT_TRUE(Close("MlaAttention", got, want, Threshold(Op::kMlaAttention, act())));
    SS_READ_F(got_cache, cuda_.get(), g.cache);
    SS_READ_F(want_cache, cpu_.get(), c.cache);
    EXPECT_TRUE(Close("MlaAttention's cache rows", got_cache, want_cache, 0.0));
  }
}

void CudaVsCpu::CheckBinary(Op op, const char* name, float a_range, const BinaryOp& run) {
  const int64_t n = 4, d = 1000;
  const std::vector<float> a = RandomValues(n * d, Seed(op, act()), act(), -a_range, a_range);
  const std::vector<float> b = RandomValues(n * d, Seed(op, act(), 1), act());

  SS_ASSIGN_OR_FAIL(Guarded g_a, UploadF(cuda_.get(), a, act(), {n, d}));
  SS_ASSIGN_OR_FAIL(Guarded g_b, UploadF(cuda_.get(), b, act(), {n, d}));
  SS_ASSIGN_OR_FAIL(Guarded g_out, Output(cuda_.get(), act(), {n, d}));
  SS_RUN_OP("CUDA", run(cuda_.get(), &g_out.t, g_a.t, g_b.t));

  SS_ASSIGN_OR_FAIL(Guarded c_a, UploadF(cpu_.get(), a, DType::kF32, {n, d}));
  SS_ASSIGN_OR_FAIL(Guarded c_b, UploadF(cpu_.get(), b, DType::kF32, {n, d}));
  SS_ASSIGN_OR_FAIL(Guarded c_out, Output(cpu_.get(), DType::kF32, {n, d}));
  SS_RUN_OP("CPU", run(cpu_.get(), &c_out.t, c_a.t, c_b.t));

  SS_READ_F(want, cpu_.get(), c_out);
  SS_READ_F(got, cuda_.get(), g_out);
  EXPECT_TRUE(Close(name, got, want, Threshold(op, act())));

  SS_RUN_OP("CUDA", run(cuda_.get(), &g_a.t, g_a.t, g_b.t));  // in place
  SS_READ_F(got_in_place, cuda_.get(), g_a);
  EXPECT_TRUE(Close((std::string(name) + " in place").c_str(), got_in_place, want, Threshold(op, act())));
}

// gate over [-8, 8] covers both tails of silu.
TEST_P(CudaVsCpu, SiluMul) {
  CheckBinary(Op::kSiluMul, "SiluMul", 8.0f, [](Backend* be, Tensor* out, const Tensor& gate, const Tensor& up) {
    return be->SiluMul(out, gate, up);
  });
}

// gate over [-8, 8] covers GELU's tails and the region below -2 where 1 + tanh cancels.
TEST_P(CudaVsCpu, GeluTanhMul) {
  CheckBinary(Op::kGeluTanhMul, "GeluTanhMul", 8.0f,
              [](Backend* be, Tensor* out, const Tensor& gate, const Tensor& up) {
                return be->GeluTanhMul(out, gate, up);
              });
}

// gpt-oss's limit (7) inside gate's range [-8, 8], then a limit of 0.75 that clamps up too.
TEST_P(CudaVsCpu, ClampedSwiGlu) {
  for (const float limit : {7.0f, 0.75f}) {
    SCOPED_TRACE(::testing::Message() << "limit " << limit);
    CheckBinary(Op::kClampedSwiGlu, "ClampedSwiGlu", 8.0f,
                [limit](Backend* be, Tensor* out, const Tensor& gate, const Tensor& up) {
                  return be->ClampedSwiGlu(out, gate, up, 1.702f, limit);
                });
  }
}

TEST_P(CudaVsCpu, Add) {
  CheckBinary(Op::kAdd, "Add", 4.0f,
              [](Backend* be, Tensor* out, const Tensor& a, const Tensor& b) { return be->Add(out, a, b); });
}

// The factor is sqrt(3072) rounded to the act dtype, as the caller passes it (backend.h); separate
// output, then in place.
TEST_P(CudaVsCpu, Scale) {
  const int64_t n = 4, d = 1000;
  const std::vector<float> x = RandomValues(n * d, Seed(Op::kScale, act()), act(), -4.0f, 4.0f);
  const float factor = RoundTo({static_cast<float>(std::sqrt(3072.0))}, act())[0];

  SS_ASSIGN_OR_FAIL(Guarded g_x, UploadF(cuda_.get(), x, act(), {n, d}));
  SS_ASSIGN_OR_FAIL(Guarded g_out, Output(cuda_.get(), act(), {n, d}));
  SS_RUN_OP("CUDA", cuda_->Scale(&g_out.t, g_x.t, factor));

  SS_ASSIGN_OR_FAIL(Guarded c_x, UploadF(cpu_.get(), x, DType::kF32, {n, d}));
  SS_ASSIGN_OR_FAIL(Guarded c_out, Output(cpu_.get(), DType::kF32, {n, d}));
  SS_RUN_OP("CPU", cpu_->Scale(&c_out.t, c_x.t, factor));

  SS_READ_F(got, cuda_.get(), g_out);
  SS_READ_F(want, cpu_.get(), c_out);
  EXPECT_TRUE(Close("Scale", got, want, Threshold(Op::kScale, act())));

  SS_RUN_OP("CUDA", cuda_->Scale(&g_x.t, g_x.t, factor));  // in place
  SS_READ_F(got_in_place, cuda_.get(), g_x);
  EXPECT_TRUE(Close("Scale in place", got_in_place, want, Threshold(Op::kScale, act())));
}

// Float32 logits whatever the act dtype, over [-150, 150] (tanh saturated at both ends for cap 30),
// at Gemma 2's two caps (final logits 30, attention 50); cap <= 0, NaN and Inf refused.
TEST_P(CudaVsCpu, Softcap) {
  const int64_t m = 3, v = 5000;
  for (const float cap : {30.0f, 50.0f}) {
    SCOPED_TRACE(::testing::Message() << "cap " << cap);
    const std::vector<float> x = RandomValues(m * v, Seed(Op::kSoftcap, act()), DType::kF32, -150.0f, 150.0f);
    SS_ASSIGN_OR_FAIL(Guarded g_x, UploadF(cuda_.get(), x, DType::kF32, {m, v}));
    SS_RUN_OP("CUDA", cuda_->Softcap(&g_x.t, cap));
    SS_ASSIGN_OR_FAIL(Guarded c_x, UploadF(cpu_.get(), x, DType::kF32, {m, v}));
    SS_RUN_OP("CPU", cpu_->Softcap(&c_x.t, cap));
    SS_READ_F(got, cuda_.get(), g_x);
    SS_READ_F(want, cpu_.get(), c_x);
    EXPECT_TRUE(Close("Softcap", got, want, Threshold(Op::kSoftcap, act())));
  }
  SS_ASSIGN_OR_FAIL(Guarded g_x, UploadF(cuda_.get(), std::vector<float>(8, 1.0f), DType::kF32, {2, 4}));
  for (const float cap : {0.0f, -1.0f, std::nanf(""), std::numeric_limits<float>::infinity()}) {
    EXPECT_TRUE(absl::IsInvalidArgument(cuda_->Softcap(&g_x.t, cap))) << "cap " << cap;
  }
}

// AddRmsNorm (CudaBackendOptions::fused_kernels; passed on an H200, 2026-11-28): the fused
// kernel's x and normed bit for bit those of Add then RmsNorm on a backend without the option (the
// base's composition), rows of 1000 (not a multiple of the block's threads), 4096 (one round of
// loads) and 10000 (more than one), each within the CPU's Add and RmsNorm tolerances; normed may be
// y itself.
TEST_P(CudaVsCpu, AddRmsNorm) {
  SS_ASSIGN_OR_FAIL(std::unique_ptr<Backend> fused, MakeCudaBackend(0, act(), {.fused_kernels = true}));
  for (const int64_t d : {int64_t{1000}, int64_t{4096}, int64_t{10000}}) {
    SCOPED_TRACE(::testing::Message() << "d " << d);
    const int64_t n = 3;
    const std::vector<float> x = RandomValues(n * d, Seed(Op::kAdd, act(), 10), act(), -4.0f, 4.0f);
    const std::vector<float> y = RandomValues(n * d, Seed(Op::kAdd, act(), 11), act());
    const std::vector<float> w = RandomValues(d, Seed(Op::kRmsNorm, act(), 12), act(), 0.5f, 1.5f);
    const float eps = 1e-5f;
    std::vector<std::vector<float>> xs, normeds;
    for (Backend* be : {cuda_.get(), fused.get()}) {
      SS_ASSIGN_OR_FAIL(Guarded g_x, UploadF(be, x, act(), {n, d}));
      SS_ASSIGN_OR_FAIL(Guarded g_y, UploadF(be, y, act(), {n, d}));
      SS_ASSIGN_OR_FAIL(Guarded g_w, UploadF(be, w, act(), {d}));
      SS_ASSIGN_OR_FAIL(Guarded g_normed, Output(be, act(), {n, d}));
      const uint64_t launches = be->kernel_launches();
      SS_RUN_OP("CUDA", be->AddRmsNorm(&g_x.t, g_y.t, &g_normed.t, g_w.t, eps));
      EXPECT_EQ(be->kernel_launches() - launches, be == fused.get() ? 1u : 2u);
      SS_READ_F(got_x, be, g_x);
      SS_READ_F(got_normed, be, g_normed);
      xs.push_back(got_x);
      normeds.push_back(got_normed);
      // normed aliasing y: the same bits.
      SS_ASSIGN_OR_FAIL(Guarded a_x, UploadF(be, x, act(), {n, d}));
      SS_ASSIGN_OR_FAIL(Guarded a_y, UploadF(be, y, act(), {n, d}));
      SS_RUN_OP("CUDA", be->AddRmsNorm(&a_x.t, a_y.t, &a_y.t, g_w.t, eps));
      SS_READ_F(aliased, be, a_y);
      EXPECT_EQ(aliased, got_normed) << "normed written over y";
    }
    EXPECT_EQ(xs[1], xs[0]) << "the fused kernel's x differs from Add's";
    EXPECT_EQ(normeds[1], normeds[0]) << "the fused kernel's normed differs from RmsNorm's";

    // The CPU's: the sum as Add's tolerance allows, and the norm of the CUDA sum (rounded to act)
    // as RmsNorm's does.
    SS_ASSIGN_OR_FAIL(Guarded c_x, UploadF(cpu_.get(), x, DType::kF32, {n, d}));
    SS_ASSIGN_OR_FAIL(Guarded c_y, UploadF(cpu_.get(), y, DType::kF32, {n, d}));
    SS_RUN_OP("CPU", cpu_->Add(&c_x.t, c_x.t, c_y.t));
    SS_READ_F(want_x, cpu_.get(), c_x);
    EXPECT_TRUE(Close("AddRmsNorm's sum", xs[1], want_x, Threshold(Op::kAdd, act())));
    SS_ASSIGN_OR_FAIL(Guarded c_sum, UploadF(cpu_.get(), xs[1], DType::kF32, {n, d}));
    SS_ASSIGN_OR_FAIL(Guarded c_w, UploadF(cpu_.get(), w, DType::kF32, {d}));
    SS_ASSIGN_OR_FAIL(Guarded c_normed, Output(cpu_.get(), DType::kF32, {n, d}));
    SS_RUN_OP("CPU", cpu_->RmsNorm(&c_normed.t, c_sum.t, c_w.t, eps));
    SS_READ_F(want, cpu_.get(), c_normed);
    EXPECT_TRUE(Close("AddRmsNorm's norm", normeds[1], want, Threshold(Op::kRmsNorm, act())));
  }
}

// Softmax, Argmax and Sample take float32 logits whatever the act dtype; they run once per dtype
// anyway (the backend differs) and must give the same answers for each.
TEST_P(CudaVsCpu, Softmax) {
  const int64_t n = 4, v = 5000;
  const std::vector<float> x = RandomValues(n * v, Seed(Op::kSoftmax, act()), DType::kF32, -8.0f, 8.0f);
  for (const float temperature : {1.0f, 0.7f, 1.7f}) {
    SCOPED_TRACE(::testing::Message() << "temperature " << temperature);
    SS_ASSIGN_OR_FAIL(Guarded g_x, UploadF(cuda_.get(), x, DType::kF32, {n, v}));
    SS_ASSIGN_OR_FAIL(Guarded g_out, Output(cuda_.get(), DType::kF32, {n, v}));
    SS_RUN_OP("CUDA", cuda_->Softmax(&g_out.t, g_x.t, temperature));

    SS_ASSIGN_OR_FAIL(Guarded c_x, UploadF(cpu_.get(), x, DType::kF32, {n, v}));
    SS_ASSIGN_OR_FAIL(Guarded c_out, Output(cpu_.get(), DType::kF32, {n, v}));
    SS_RUN_OP("CPU", cpu_->Softmax(&c_out.t, c_x.t, temperature));

    SS_READ_F(got, cuda_.get(), g_out);
    SS_READ_F(want, cpu_.get(), c_out);
    EXPECT_TRUE(Close("Softmax", got, want, Threshold(Op::kSoftmax, act())));
  }
}

// Ids must match exactly, ties included (the first index wins). Output to device memory and,
// as backend.h allows, to host memory.
// The flags must match exactly: NaN, +inf and -inf anywhere in a row of a real vocabulary's size,
// the largest finite values, and clean rows. Output to device memory and to host memory.
TEST_P(CudaVsCpu, FiniteRows) {
  const int64_t n = 7, v = 32000;
  std::vector<float> x = RandomValues(n * v, Seed(Op::kSoftmax, act(), 11), DType::kF32, -10.0f, 10.0f);
  x[1 * v + 0] = std::numeric_limits<float>::quiet_NaN();
  x[2 * v + v - 1] = std::numeric_limits<float>::infinity();
  x[3 * v + 17001] = -std::numeric_limits<float>::infinity();
  x[4 * v + 5] = std::numeric_limits<float>::max();  // finite
  x[4 * v + 6] = -std::numeric_limits<float>::max();
  x[6 * v + 31999] = std::numeric_limits<float>::quiet_NaN();
  x[6 * v + 3] = std::numeric_limits<float>::infinity();

  SS_ASSIGN_OR_FAIL(Guarded g_x, UploadF(cuda_.get(), x, DType::kF32, {n, v}));
  SS_ASSIGN_OR_FAIL(Guarded g_out, Output(cuda_.get(), DType::kI32, {n}));
  SS_RUN_OP("CUDA", cuda_->FiniteRows(&g_out.t, g_x.t));
  std::vector<int32_t> host_out(n, -7);
  Tensor host_t(host_out.data(), DType::kI32, {n});
  SS_RUN_OP("CUDA", cuda_->FiniteRows(&host_t, g_x.t));

  SS_ASSIGN_OR_FAIL(Guarded c_x, UploadF(cpu_.get(), x, DType::kF32, {n, v}));
  SS_ASSIGN_OR_FAIL(Guarded c_out, Output(cpu_.get(), DType::kI32, {n}));
  SS_RUN_OP("CPU", cpu_->FiniteRows(&c_out.t, c_x.t));

  SS_READ_I(got, cuda_.get(), g_out);
  SS_READ_I(want, cpu_.get(), c_out);
  EXPECT_EQ(want, (std::vector<int32_t>{1, 0, 0, 0, 1, 1, 0}));
  EXPECT_EQ(got, want);
  EXPECT_EQ(host_out, want);
}

TEST_P(CudaVsCpu, Argmax) {
  const int64_t n = 6, v = 32000;
  std::vector<float> x = RandomValues(n * v, Seed(Op::kSoftmax, act(), 7), DType::kF32, -10.0f, 10.0f);
  x[1 * v + 31000] = 50.0f;  // row 1: the max twice; the first wins
  x[1 * v + 777] = 50.0f;
  std::fill(x.begin() + 2 * v, x.begin() + 3 * v, 1.25f);  // row 2: all equal -> 0
  x[3 * v + v - 1] = 60.0f;                                // row 3: the last element
  x[4 * v + 0] = 60.0f;                                    // row 4: the first element
  for (int64_t i = 0; i < v; ++i) x[5 * v + i] = -1e30f;   // row 5: all very negative, one tie pair
  x[5 * v + 4000] = -1.0f;
  x[5 * v + 4001] = -1.0f;

  SS_ASSIGN_OR_FAIL(Guarded g_x, UploadF(cuda_.get(), x, DType::kF32, {n, v}));
  SS_ASSIGN_OR_FAIL(Guarded g_out, Output(cuda_.get(), DType::kI32, {n}));
  SS_RUN_OP("CUDA", cuda_->Argmax(&g_out.t, g_x.t));
  std::vector<int32_t> host_out(n, -7);
  Tensor host_t(host_out.data(), DType::kI32, {n});
  SS_RUN_OP("CUDA", cuda_->Argmax(&host_t, g_x.t));

  SS_ASSIGN_OR_FAIL(Guarded c_x, UploadF(cpu_.get(), x, DType::kF32, {n, v}));
  SS_ASSIGN_OR_FAIL(Guarded c_out, Output(cpu_.get(), DType::kI32, {n}));
  SS_RUN_OP("CPU", cpu_->Argmax(&c_out.t, c_x.t));

  SS_READ_I(got, cuda_.get(), g_out);
  SS_READ_I(want, cpu_.get(), c_out);
  EXPECT_EQ(got, want);
  EXPECT_EQ(host_out, want);
  EXPECT_EQ(want[1], 777);
  EXPECT_EQ(want[2], 0);
  EXPECT_EQ(want[3], v - 1);
  EXPECT_EQ(want[4], 0);
  EXPECT_EQ(want[5], 4000);
}

// ---- Sampling ---------------------------------------------------------------------------------
// An independent float64 rendering of backend.h's definition, used only to decide when a CUDA/CPU
// disagreement is a rounding-level tie rather than a bug (see the Sample test).
struct RefSample {
  std::vector<int32_t> kept;  // kept token ids in vocabulary order
  std::vector<double> cum;    // their inclusive cumulative renormalized probabilities
  bool top_p_ambiguous = false;

  // The id chosen for draw u: the first kept token whose cumulative probability exceeds u (the
  // last kept one if rounding leaves none).
  int32_t Pick(double u) const {
    for (size_t j = 0; j < kept.size(); ++j) {
      if (cum[j] > u) return kept[j];
    }
    return kept.empty() ? -1 : kept.back();
  }
};

RefSample ReferenceSample(const float* logits, int64_t v, const SampleParams& p, double eps) {
  std::vector<float> s(v);
  for (int64_t i = 0; i < v; ++i) s[i] = logits[i] / p.temperature;  // float division, as both backends
  const float mx = *std::max_element(s.begin(), s.end());
  std::vector<double> e(v);
  for (int64_t i = 0; i < v; ++i) e[i] = std::exp(static_cast<double>(s[i]) - mx);
  std::vector<int64_t> order(v);  // token ids by decreasing s
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return s[a] > s[b]; });
  // top_k: s >= the k-th largest, ties included.
  float threshold = -INFINITY;
  if (p.top_k > 0 && p.top_k < v) threshold = s[order[p.top_k - 1]];
  RefSample r;
  // top_p: walk the kept tokens from the most likely, a whole tie group at a time, until the mass
  // reaches top_p of the kept mass; the last group's value is the new threshold.
  if (p.top_p < 1.0f) {
    double kept_mass = 0.0;
    for (int64_t i = 0; i < v; ++i) kept_mass += s[i] >= threshold ? e[i] : 0.0;
    const double target = static_cast<double>(p.top_p) * kept_mass;
    double mass = 0.0;
    size_t g = 0;
    while (g < order.size() && s[order[g]] >= threshold) {
      const float value = s[order[g]];
      const double before = mass;
      for (; g < order.size() && s[order[g]] == value; ++g) mass += e[order[g]];
      if (mass >= target) {
        r.top_p_ambiguous =
            std::fabs(mass - target) <= eps * kept_mass || std::fabs(before - target) <= eps * kept_mass;
        threshold = value;
        break;
      }
    }
  }
  double total = 0.0;
  for (int64_t i = 0; i < v; ++i) total += s[i] >= threshold ? e[i] : 0.0;
  double cum = 0.0;
  for (int64_t i = 0; i < v; ++i) {
    if (s[i] < threshold) continue;
    cum += e[i];
    r.kept.push_back(static_cast<int32_t>(i));
    r.cum.push_back(cum / total);
  }
  return r;
}

// Same logits and the same uniform draws on both backends must give the same ids. Floating point
// makes one exception unavoidable: the two backends compute exp and the running sums with
// different rounding and order (the CPU rounds each probability to float32 and sums in double;
// CUDA sums expf values in double in a tree order), so their cumulative probabilities differ in
// the last bits. When a draw u lies within eps of a cumulative boundary, the ids on either side
// of it are both correct picks. So a mismatch is accepted only when both ids are picks of the
// float64 reference for some draw in [u - eps, u + eps], i.e. the cumulative probability at the
// boundary between them is within eps of u. Each probability carries a relative error of a few
// float32 ulps (~2.4e-7) on either side, so cumulative probabilities agree to ~5e-7;
// eps = 1e-5 leaves a 20x margin and is still narrow: any other disagreement fails. For the same
// reason a row whose top_p boundary mass is within eps of the target (the kept set itself is a
// rounding-level tie) is not compared; the test counts such rows and requires them to be rare.
TEST_P(CudaVsCpu, Sample) {
  const int64_t v = 2000;
  const double eps = 1e-5;
  struct Combo {
    float temperature;
    int32_t top_k;
    float top_p;
    bool coarse;  // logits on a 0.5 grid: many exact ties at the top_k / top_p boundaries
  };
  const std::vector<Combo> combos = {
      {1.0f, 0, 1.0f, false},  {0.7f, 0, 1.0f, false},   {1.5f, 0, 1.0f, false},  {1.0f, 1, 1.0f, false},
      {1.0f, 20, 1.0f, false}, {1.0f, 1999, 1.0f, false}, {1.0f, 5000, 1.0f, false}, {1.0f, 0, 0.9f, false},
      {0.8f, 0, 0.5f, false},  {1.0f, 0, 0.05f, false},  {1.2f, 50, 0.8f, false}, {1.0f, 10, 1.0f, true},
      {1.0f, 0, 0.7f, true},   {0.9f, 30, 0.6f, true},
  };
  const int draws = 24;
  const int64_t n = static_cast<int64_t>(combos.size()) * draws;
  std::vector<float> logits(n * v);
  std::vector<SampleParams> params(n);
  std::mt19937 rng(Seed(Op::kSoftmax, act(), 99));
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (size_t c = 0; c < combos.size(); ++c) {
    std::vector<float> row(v);
    for (float& x : row) x = combos[c].coarse ? std::round(normal(rng) * 2.0f) / 2.0f : normal(rng);
    for (int d = 0; d < draws; ++d) {
      const int64_t r = static_cast<int64_t>(c) * draws + d;
      std::copy(row.begin(), row.end(), logits.begin() + r * v);
      params[r].temperature = combos[c].temperature;
      params[r].top_k = combos[c].top_k;
      params[r].top_p = combos[c].top_p;
      params[r].uniform = SampleUniform(/*seed=*/1234 + c, /*step=*/static_cast<uint64_t>(d));
    }
  }

  SS_ASSIGN_OR_FAIL(Guarded g_x, UploadF(cuda_.get(), logits, DType::kF32, {n, v}));
  SS_ASSIGN_OR_FAIL(Guarded g_out, Output(cuda_.get(), DType::kI32, {n}));
  SS_RUN_OP("CUDA", cuda_->Sample(&g_out.t, g_x.t, params));
  std::vector<int32_t> host_out(n, -7);
  Tensor host_t(host_out.data(), DType::kI32, {n});
  SS_RUN_OP("CUDA", cuda_->Sample(&host_t, g_x.t, params));

  SS_ASSIGN_OR_FAIL(Guarded c_x, UploadF(cpu_.get(), logits, DType::kF32, {n, v}));
  SS_ASSIGN_OR_FAIL(Guarded c_out, Output(cpu_.get(), DType::kI32, {n}));
  SS_RUN_OP("CPU", cpu_->Sample(&c_out.t, c_x.t, params));

  SS_READ_I(got, cuda_.get(), g_out);
  SS_READ_I(want, cpu_.get(), c_out);
  EXPECT_EQ(host_out, got) << "Sample to host memory differs from Sample to device memory";
  int tolerated = 0, ambiguous = 0;
  for (int64_t r = 0; r < n; ++r) {
    const RefSample ref = ReferenceSample(logits.data() + r * v, v, params[r], eps);
    if (ref.top_p_ambiguous) {
      ++ambiguous;
      continue;
    }
    if (got[r] == want[r]) continue;
    const double u = params[r].uniform;
    const int32_t lo = ref.Pick(u - eps), hi = ref.Pick(u + eps);
    const bool both_ok = got[r] >= lo && got[r] <= hi && want[r] >= lo && want[r] <= hi &&
                         std::binary_search(ref.kept.begin(), ref.kept.end(), got[r]);
    EXPECT_TRUE(both_ok) << "row " << r << " (temperature " << params[r].temperature << ", top_k " << params[r].top_k
                         << ", top_p " << params[r].top_p << ", uniform " << u << "): CUDA picked " << got[r]
                         << ", CPU " << want[r] << "; the float64 reference picks " << ref.Pick(u)
                         << " and only ids in [" << lo << ", " << hi << "] are within eps " << eps << " of the draw";
    tolerated += both_ok ? 1 : 0;
  }
  RecordProperty("tolerated_boundary_mismatches", tolerated);
  RecordProperty("ambiguous_top_p_rows", ambiguous);
  EXPECT_LE(ambiguous, n / 20) << "too many rows with a top_p boundary within eps: the test data needs changing";
}

// ---- CUDA-only checks -------------------------------------------------------------------------

// Bad block-table entries, sequence ids and positions live on the device: the kernel must skip
// them without touching memory outside the caches or the output, and the next Synchronize()
// reports them (once). Tokens with good metadata still get their normal result.
// Bad AttentionOptions are refused before any launch, naming the op and the option; the sinks'
// values live on the device and are not read on the host.
TEST_P(CudaChecks, AttentionRejectsBadOptions) {
  const int64_t bs = 16, heads = 2, hd = 64;
  SS_ASSIGN_OR_FAIL(Guarded g_q, UploadF(cuda_.get(), RandomValues(heads * hd, 1, act()), act(), {1, heads * hd}));
  SS_ASSIGN_OR_FAIL(Guarded g_kc, UploadF(cuda_.get(), RandomValues(bs * heads * hd, 2, act()), act(), {1, bs, heads, hd}));
  SS_ASSIGN_OR_FAIL(Guarded g_vc, UploadF(cuda_.get(), RandomValues(bs * heads * hd, 3, act()), act(), {1, bs, heads, hd}));
  SS_ASSIGN_OR_FAIL(Guarded g_pos, UploadI(cuda_.get(), {3}, {1}));
  SS_ASSIGN_OR_FAIL(Guarded g_seq, UploadI(cuda_.get(), {0}, {1}));
  SS_ASSIGN_OR_FAIL(Guarded g_tab, UploadI(cuda_.get(), {0}, {1, 1}));
  SS_ASSIGN_OR_FAIL(Guarded g_out, Output(cuda_.get(), act(), {1, heads * hd}));
  SS_ASSIGN_OR_FAIL(Guarded g_short, UploadF(cuda_.get(), {0.0f}, DType::kF32, {1}));
  SS_ASSIGN_OR_FAIL(Guarded g_i32, UploadI(cuda_.get(), {0, 0}, {2}));
  const uint64_t launches = cuda_->kernel_launches();
  const struct {
    AttentionOptions options;
    const char* names;
  } cases[] = {
      {{.window = -3}, "window"},
      {{.softcap = std::nanf("")}, "softcap"},
      {{.softcap = -2.0f}, "softcap"},
      {{.softcap = INFINITY}, "softcap"},
      {{.sinks = &g_short.t}, "sinks"},
      {{.sinks = &g_i32.t}, "sinks"},
  };
  for (const auto& c : cases) {
    const absl::Status s =
        cuda_->Attention(&g_out.t, g_q.t, g_kc.t, g_vc.t, g_pos.t, g_seq.t, g_tab.t, 0.125f, c.options);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << c.names << ": " << s;
    EXPECT_NE(std::string(s.message()).find("Attention"), std::string::npos) << s;
    EXPECT_NE(std::string(s.message()).find(c.names), std::string::npos) << s;
  }
  EXPECT_EQ(cuda_->kernel_launches(), launches);
  SS_ASSERT_OK(cuda_->Synchronize());
}

TEST_P(CudaChecks, AttentionBadMetadataIsReported) {
  const int64_t blocks = 4, bs = 16, kv_heads = 2, q_heads = 4, hd = 64, max_blocks = 3, seqs = 2;
  const std::vector<float> k_cache = RandomValues(blocks * bs * kv_heads * hd, 1, act());
  const std::vector<float> v_cache = RandomValues(blocks * bs * kv_heads * hd, 2, act());
  // Sequence 0 is fine; sequence 1's table holds a block past the end and a negative one.
  const std::vector<int32_t> tables = {0, 1, 2, 3, 1000000, -5};
  // Token 0 fine; 1 reads the bad blocks; 2 has sequence 7 (of 2); 3 a position past its table;
  // 4 a negative position.
  const std::vector<int32_t> token_seq = {0, 1, 7, 0, 0};
  const std::vector<int32_t> positions = {20, 40, 3, 48, -1};
  const int64_t n = 5;
  const std::vector<float> q = RandomValues(n * q_heads * hd, 3, act());

  SS_ASSIGN_OR_FAIL(Guarded g_q, UploadF(cuda_.get(), q, act(), {n, q_heads * hd}));
  SS_ASSIGN_OR_FAIL(Guarded g_kc, UploadF(cuda_.get(), k_cache, act(), {blocks, bs, kv_heads, hd}));
  SS_ASSIGN_OR_FAIL(Guarded g_vc, UploadF(cuda_.get(), v_cache, act(), {blocks, bs, kv_heads, hd}));
  SS_ASSIGN_OR_FAIL(Guarded g_pos, UploadI(cuda_.get(), positions, {n}));
  SS_ASSIGN_OR_FAIL(Guarded g_seq, UploadI(cuda_.get(), token_seq, {n}));
  SS_ASSIGN_OR_FAIL(Guarded g_tab, UploadI(cuda_.get(), tables, {seqs, max_blocks}));
  SS_ASSIGN_OR_FAIL(Guarded g_out, Output(cuda_.get(), act(), {n, q_heads * hd}));
  SS_ASSERT_OK(cuda_->Attention(&g_out.t, g_q.t, g_kc.t, g_vc.t, g_pos.t, g_seq.t, g_tab.t, 0.125f));
  const absl::Status sync = cuda_->Synchronize();
  EXPECT_TRUE(absl::IsInvalidArgument(sync)) << sync;
  EXPECT_NE(std::string(sync.message()).find("Attention"), std::string::npos) << sync;
  SS_ASSERT_OK(cuda_->Synchronize());  // reported once, then cleared

  SS_READ_F(out, cuda_.get(), g_out);  // also checks the guards
  for (size_t i = 0; i < out.size(); ++i) ASSERT_TRUE(std::isfinite(out[i])) << "element " << i;
  const int64_t row = q_heads * hd;
  for (int64_t t : {2, 3, 4}) {  // rows with unusable metadata are zero
    for (int64_t j = 0; j < row; ++j) ASSERT_EQ(out[t * row + j], 0.0f) << "token " << t;
  }
}

// MlaAttention's device-side metadata as Attention's and CacheWrite's: a bad slot is not written, a
// bad sequence or position zeroes the token's row, a bad block-table entry leaves its key out; the
// next Synchronize() names them once. Bad shapes are refused on the host, naming the op.
TEST_P(CudaChecks, MlaAttentionBadMetadataIsReported) {
  const MlaShape shape{.heads = 2, .nope = 16, .rope = 8, .v = 16, .latent = 32};
  const int64_t blocks = 4, bs = 16, max_blocks = 3, seqs = 2, row = shape.latent + shape.rope, n = 4;
  const std::vector<int32_t> tables = {0, 1, 2, 3, 1000000, -5};  // sequence 1: blocks past the end
  // Token 0 fine; 1 reads sequence 1's bad blocks; 2 has sequence 7 (of 2); 3 a negative position
  // and a slot past the cache.
  const std::vector<int32_t> token_seq = {0, 1, 7, 0}, positions = {20, 40, 3, -1}, slots = {20, 3, 5, 64};
  SS_ASSIGN_OR_FAIL(Guarded g_qn, UploadF(cuda_.get(), RandomValues(n * 2 * 16, 1, act()), act(), {n, 2 * 16}));
  SS_ASSIGN_OR_FAIL(Guarded g_qp, UploadF(cuda_.get(), RandomValues(n * 2 * 8, 2, act()), act(), {n, 2 * 8}));
  SS_ASSIGN_OR_FAIL(Guarded g_c, UploadF(cuda_.get(), RandomValues(n * 32, 3, act()), act(), {n, 32}));
  SS_ASSIGN_OR_FAIL(Guarded g_kp, UploadF(cuda_.get(), RandomValues(n * 8, 4, act()), act(), {n, 8}));
  SS_ASSIGN_OR_FAIL(Guarded g_b, UploadF(cuda_.get(), RandomValues(2 * 32 * 32, 5, act()), act(), {2 * 32, 32}));
  SS_ASSIGN_OR_FAIL(Guarded g_cache,
                    UploadF(cuda_.get(), RandomValues(blocks * bs * row, 6, act()), act(), {blocks, bs, 1, row}));
  SS_ASSIGN_OR_FAIL(Guarded g_slots, UploadI(cuda_.get(), slots, {n}));
  SS_ASSIGN_OR_FAIL(Guarded g_pos, UploadI(cuda_.get(), positions, {n}));
  SS_ASSIGN_OR_FAIL(Guarded g_seq, UploadI(cuda_.get(), token_seq, {n}));
  SS_ASSIGN_OR_FAIL(Guarded g_tab, UploadI(cuda_.get(), tables, {seqs, max_blocks}));
  SS_ASSIGN_OR_FAIL(Guarded g_out, Output(cuda_.get(), act(), {n, 2 * 16}));
  SS_ASSERT_OK(cuda_->MlaAttention(&g_out.t, g_qn.t, g_qp.t, g_c.t, g_kp.t, g_b.t, &g_cache.t, g_slots.t, g_pos.t,
                                   g_seq.t, g_tab.t, 0.2f, shape));
  const absl::Status sync = cuda_->Synchronize();
  EXPECT_TRUE(absl::IsInvalidArgument(sync)) << sync;
  EXPECT_NE(std::string(sync.message()).find("Attention"), std::string::npos) << sync;
  EXPECT_NE(std::string(sync.message()).find("CacheWrite"), std::string::npos) << sync;
  SS_ASSERT_OK(cuda_->Synchronize());  // reported once, then cleared
  SS_READ_F(out, cuda_.get(), g_out);  // also checks the guards
  for (size_t i = 0; i < out.size(); ++i) ASSERT_TRUE(std::isfinite(out[i])) << "element " << i;
  for (int64_t t : {2, 3}) {
    for (int64_t j = 0; j < 2 * 16; ++j) ASSERT_EQ(out[t * 2 * 16 + j], 0.0f) << "token " << t;
  }
  // q_nope one head short: refused before any launch, naming the op.
  const uint64_t launches = cuda_->kernel_launches();
  const absl::Status bad = cuda_->MlaAttention(&g_out.t, g_qp.t, g_qp.t, g_c.t, g_kp.t, g_b.t, &g_cache.t, g_slots.t,
                                               g_pos.t, g_seq.t, g_tab.t, 0.2f, shape);
  EXPECT_TRUE(absl::IsInvalidArgument(bad)) << bad;
  EXPECT_NE(std::string(bad.message()).find("MlaAttention"), std::string::npos) << bad;
  EXPECT_EQ(cuda_->kernel_launches(), launches);
}

TEST_P(CudaChecks, CacheWriteBadSlotIsReported) {
  const int64_t blocks = 2, bs = 16, kv_heads = 2, hd = 64, n = 3, row = kv_heads * hd;
  const std::vector<float> cache = RandomValues(blocks * bs * row, 1, act());
  const std::vector<float> k = RandomValues(n * row, 2, act());
  const std::vector<int32_t> slots = {-1, 5, 32};  // 32 = blocks * bs, one past the end

  SS_ASSIGN_OR_FAIL(Guarded g_kc, UploadF(cuda_.get(), cache, act(), {blocks, bs, kv_heads, hd}));
  SS_ASSIGN_OR_FAIL(Guarded g_vc, UploadF(cuda_.get(), cache, act(), {blocks, bs, kv_heads, hd}));
  SS_ASSIGN_OR_FAIL(Guarded g_k, UploadF(cuda_.get(), k, act(), {n, row}));
  SS_ASSIGN_OR_FAIL(Guarded g_slots, UploadI(cuda_.get(), slots, {n}));
  SS_ASSERT_OK(cuda_->CacheWrite(&g_kc.t, &g_vc.t, g_k.t, g_k.t, g_slots.t));
  const absl::Status sync = cuda_->Synchronize();
  EXPECT_TRUE(absl::IsInvalidArgument(sync)) << sync;
  EXPECT_NE(std::string(sync.message()).find("CacheWrite"), std::string::npos) << sync;

  SS_READ_F(got, cuda_.get(), g_kc);  // also checks the guards
  std::vector<float> want = cache;
  std::copy(k.begin() + 1 * row, k.begin() + 2 * row, want.begin() + 5 * row);  // only slot 5 written
  EXPECT_TRUE(Close("CacheWrite with bad slots", got, want, 0.0));
}

// Shape and parameter errors are found on the host and name the op and the shapes.
TEST_P(CudaChecks, BadShapesAreInvalidArgument) {
  SS_ASSIGN_OR_FAIL(Guarded x, Output(cuda_.get(), act(), {2, 8}));
  SS_ASSIGN_OR_FAIL(Guarded w7, Output(cuda_.get(), act(), {7}));
  SS_ASSIGN_OR_FAIL(Guarded w, Output(cuda_.get(), act(), {3, 9}));
  SS_ASSIGN_OR_FAIL(Guarded out, Output(cuda_.get(), act(), {2, 3}));
  SS_ASSIGN_OR_FAIL(Guarded logits, Output(cuda_.get(), DType::kF32, {2, 8}));
  SS_ASSIGN_OR_FAIL(Guarded ids, Output(cuda_.get(), DType::kI32, {2}));

  absl::Status s = cuda_->RmsNorm(&x.t, x.t, w7.t, 1e-5f);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(std::string(s.message()).find("RmsNorm"), std::string::npos) << s;
  EXPECT_NE(std::string(s.message()).find("[7]"), std::string::npos) << s;

  s = cuda_->MatMul(&out.t, x.t, w.t, nullptr);  // k 8 vs 9
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(std::string(s.message()).find("MatMul"), std::string::npos) << s;

  const DType wrong = act() == DType::kF32 ? DType::kF16 : DType::kF32;
  SS_ASSIGN_OR_FAIL(Guarded x_wrong, Output(cuda_.get(), wrong, {2, 8}));
  s = cuda_->Add(&x.t, x.t, x_wrong.t);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(std::string(s.message()).find("Add"), std::string::npos) << s;

  std::vector<SampleParams> params(2);
  params[1].top_p = 0.0f;
  s = cuda_->Sample(&ids.t, logits.t, params);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(std::string(s.message()).find("row 1"), std::string::npos) << s;
  params.resize(1);
  s = cuda_->Sample(&ids.t, logits.t, params);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  SS_ASSERT_OK(cuda_->Synchronize());
}

TEST_P(CudaChecks, FactoryRejectsBadArguments) {
  absl::StatusOr<std::unique_ptr<Backend>> b = MakeCudaBackend(CudaDeviceCount(), act());
  EXPECT_TRUE(absl::IsInvalidArgument(b.status())) << b.status();
  EXPECT_NE(std::string(b.status().message()).find(std::to_string(CudaDeviceCount())), std::string::npos)
      << b.status();
  b = MakeCudaBackend(-1, act());
  EXPECT_TRUE(absl::IsInvalidArgument(b.status())) << b.status();
  b = MakeCudaBackend(0, DType::kI32);
  EXPECT_TRUE(absl::IsInvalidArgument(b.status())) << b.status();
  EXPECT_NE(std::string(b.status().message()).find("I32"), std::string::npos) << b.status();
  EXPECT_EQ(cuda_->act_dtype(), act());
  EXPECT_EQ(cuda_->device_kind(), DeviceKind::kCuda);
}

// ---- Quantized weights (kernels/cuda/quant_matmul.cu; passed on an H200, 2026-11-27 and 28) ----
// MatMul by int8, fp8 and int4 weights on a backend made with CudaBackendOptions::quantized_kernels,
// against kernels/quant.h's dequantize reference on the host: x (rounded to the act dtype) @
// dequantized(w)^T + bias, in double. n covers the GEMV's instances (1, 2, 3 in the 4-row one, 8)
// and the dequantize + cuBLAS path (33, 128), the latter over several blocks of rows (a 64 KiB
// scratch); the shapes cover the GEMV's vector loads (k % 16 == 0), its byte loads (k odd) and an
// odd m (a block's second row past m), and for int4 a k that is not a multiple of 128 (a short
// last group: 1000 on the vector loads, 300 off them). Every element must be within
//   (2 u + 1e-5) x (sum_c |x_c w_c| + |bias|),
// u the act dtype's unit roundoff: the cuBLAS path rounds the dequantized weights to the act dtype
// (u each), the output is rounded once (u), and float32 sums in another order stay far below 1e-5
// of the sum of magnitudes. A wrong nibble, scale or group shifts whole rows by far more (F32,
// where the bound is 1e-5, catches a single wrong weight).
class CudaQuant : public ::testing::TestWithParam<std::tuple<WeightQuant, DType>> {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    absl::StatusOr<std::unique_ptr<Backend>> cuda =
        MakeCudaBackend(0, act(), {.quantized_kernels = true, .quantized_scratch_bytes = 64 << 10});
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    cuda_ = std::move(*cuda);
    RecordProperty("cuda_backend", cuda_->Describe());
  }
  WeightQuant quant() const { return std::get<0>(GetParam()); }
  DType act() const { return std::get<1>(GetParam()); }

  // kernels/quant.h's layout of w [m, k] for quant(), by its own quantizer. fp8 with group_ > 0:
  // input-group scales (an FP8 checkpoint's block scales), the row quantizer's codes with each
  // group's scale the row's times 1, 1.25, 1.5 or 1.75 by group (nothing quantizes into groups; the
  // reference is whatever they hold).
  std::vector<uint8_t> Quantize(const std::vector<float>& w, int64_t m, int64_t k) const {
    std::vector<uint8_t> stored(static_cast<size_t>(QuantizedWeightBytes(quant(), m, k, group_)));
    absl::Status s;
    if (quant() == WeightQuant::kFp8 && group_ > 0) {
      const Fp8RowsLayout layout{m, k, group_};
      const int64_t groups = layout.groups_per_row();
      std::vector<float> row_scale(static_cast<size_t>(m));
      s = QuantizeFp8Rows(row_scale.data(), stored.data() + layout.scale_bytes(), w.data(), m, k);
      auto* scale = reinterpret_cast<float*>(stored.data());
      for (int64_t r = 0; r < m; ++r) {
        for (int64_t g = 0; g < groups; ++g) scale[r * groups + g] = row_scale[r] * (1.0f + 0.25f * static_cast<float>(g % 4));
      }
    } else if (quant() == WeightQuant::kInt8) {
      s = QuantizeInt8Rows(reinterpret_cast<float*>(stored.data()),
                           reinterpret_cast<int8_t*>(stored.data() + Int8RowsLayout{m, k}.scale_bytes()), w.data(), m, k);
    } else if (quant() == WeightQuant::kFp8) {
      s = QuantizeFp8Rows(reinterpret_cast<float*>(stored.data()), stored.data() + Fp8RowsLayout{m, k}.scale_bytes(),
                          w.data(), m, k);
    } else {
      s = QuantizeInt4Groups(reinterpret_cast<Int4Group128*>(stored.data()), w.data(), m, k);
    }
    EXPECT_TRUE(s.ok()) << s;
    return stored;
  }
  // The reference dequantization of `stored`.
  std::vector<float> Dequantize(const std::vector<uint8_t>& stored, int64_t m, int64_t k) const {
    std::vector<float> w(static_cast<size_t>(m * k));
    if (quant() == WeightQuant::kFp8 && group_ > 0) {
      DequantizeFp8Groups(w.data(), reinterpret_cast<const float*>(stored.data()),
                          stored.data() + Fp8RowsLayout{m, k, group_}.scale_bytes(), m, k, group_);
    } else if (quant() == WeightQuant::kInt8) {
      DequantizeInt8Rows(w.data(), reinterpret_cast<const float*>(stored.data()),
                         reinterpret_cast<const int8_t*>(stored.data() + Int8RowsLayout{m, k}.scale_bytes()), m, k);
    } else if (quant() == WeightQuant::kFp8) {
      DequantizeFp8Rows(w.data(), reinterpret_cast<const float*>(stored.data()),
                        stored.data() + Fp8RowsLayout{m, k}.scale_bytes(), m, k);
    } else {
      DequantizeInt4Groups(w.data(), reinterpret_cast<const Int4Group128*>(stored.data()), m, k);
    }
    return w;
  }

  struct Shape {
    int64_t m, k;
  };
  // MatMul on `cuda` by each shape's weight for every n (and bias, output dtype) below against the
  // reference; each product's output is appended to *outputs when given. check_scratch: the
  // backend's dequantize scratch is the largest CudaDequantScratchBytes so far (a 64 KiB limit).
  void ExpectMatMulsMatchTheReference(Backend* cuda, const std::vector<Shape>& shapes, bool check_scratch,
                                      std::vector<std::vector<float>>* outputs = nullptr) const;
  // The same on `path` (a backend with an optional decode path on) and on cuda_ (the defaults), and
  // `path`'s outputs must differ from the defaults' somewhere, or the path (`what`) did not run.
  void ExpectThePathMatchesTheReferenceAndRan(Backend* path, const std::vector<Shape>& shapes, const char* what) const {
    std::vector<std::vector<float>> got_path, got_plain;
    ExpectMatMulsMatchTheReference(path, shapes, false, &got_path);
    ExpectMatMulsMatchTheReference(cuda_.get(), shapes, false, &got_plain);
    ASSERT_EQ(got_path.size(), got_plain.size());
    bool differs = false;
    for (size_t p = 0; p < got_path.size(); ++p) differs = differs || got_path[p] != got_plain[p];
    EXPECT_TRUE(differs) << "every output bitwise the plain GEMV's: " << what << " did not run";
  }

  std::unique_ptr<Backend> cuda_;
  int64_t group_ = 0;  // fp8: inputs per scale of the weights Quantize makes (0: one a row)
};

void CudaQuant::ExpectMatMulsMatchTheReference(Backend* cuda, const std::vector<Shape>& shapes, bool check_scratch,
                                               std::vector<std::vector<float>>* outputs) const {
  const double u = UnitRoundoff(act());
  uint32_t salt = 0;
  uint64_t scratch = 0;  // the largest CudaDequantScratchBytes so far: what the planner counts
  for (const Shape& sh : shapes) {
    const int64_t m = sh.m, k = sh.k;
    const std::vector<float> w = RandomValues(m * k, Seed(Op::kMatMul, act(), 7000 + salt++), DType::kF32);
    const std::vector<uint8_t> stored = Quantize(w, m, k);
    const std::vector<float> w_ref = Dequantize(stored, m, k);
    Tensor packed;
    SS_ASSIGN_OR_FAIL(Buffer w_buf, cuda->PackQuantizedWeight(quant(), stored.data(), m, k, &packed, group_));
    ASSERT_EQ(packed.quant, quant());
    ASSERT_EQ(packed.bytes(), stored.size());
    if (check_scratch) {
      scratch = std::max(scratch, CudaDequantScratchBytes(m, k, act(), 64 << 10));
      EXPECT_EQ(cuda->dequant_scratch_bytes(), scratch) << "the dequantize scratch, grown as the weight is stored";
    }
    const std::vector<float> b = RandomValues(m, Seed(Op::kMatMul, act(), 7100 + salt), act());
    // n: bias?, F32 out? (every combination on both paths)
    for (const auto& [n, with_bias, f32_out] : std::vector<std::tuple<int64_t, bool, bool>>{
             {1, false, false}, {2, true, true}, {3, true, false}, {8, true, true}, {33, true, false},
             {128, false, true}}) {
      SCOPED_TRACE(::testing::Message() << WeightQuantName(quant()) << " m " << m << ", k " << k << ", n " << n
                                        << (with_bias ? ", bias" : "") << (f32_out ? ", F32 out" : ", act out"));
      const std::vector<float> x = RandomValues(n * k, Seed(Op::kMatMul, act(), 7200 + salt + static_cast<uint32_t>(n)), act());
      SS_ASSIGN_OR_FAIL(Guarded g_x, UploadF(cuda, x, act(), {n, k}));
      SS_ASSIGN_OR_FAIL(Guarded g_b, UploadF(cuda, b, act(), {m}));
      SS_ASSIGN_OR_FAIL(Guarded g_out, Output(cuda, f32_out ? DType::kF32 : act(), {n, m}));
      SS_ASSERT_OK(cuda->MatMul(&g_out.t, g_x.t, packed, with_bias ? &g_b.t : nullptr));
      SS_READ_F(got, cuda, g_out);
      if (outputs != nullptr) outputs->push_back(got);
      double worst = 0.0;
      int64_t worst_at = -1;
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t r = 0; r < m; ++r) {
          double sum = with_bias ? b[r] : 0.0, mag = with_bias ? std::fabs(b[r]) : 0.0;
          for (int64_t c = 0; c < k; ++c) {
            const double p = static_cast<double>(x[i * k + c]) * w_ref[r * k + c];
            sum += p;
            mag += std::fabs(p);
          }
          const double g = got[i * m + r];
          ASSERT_TRUE(std::isfinite(g)) << "row " << i << ", column " << r << ": " << g;
          const double ratio = std::fabs(g - sum) / ((2.0 * u + 1e-5) * mag + 1e-30);
          if (ratio > worst) {
            worst = ratio;
            worst_at = i * m + r;
          }
        }
      }
      EXPECT_LE(worst, 1.0) << "worst at row " << worst_at / m << ", column " << worst_at % m
                            << " (error / bound)";
    }
  }
}

std::string QuantParamName(const ::testing::TestParamInfo<std::tuple<WeightQuant, DType>>& info) {
  return std::string(WeightQuantName(std::get<0>(info.param))) + "_" + DTypeName(std::get<1>(info.param));
}

TEST_P(CudaQuant, MatMulMatchesTheDequantizedReference) {
  ExpectMatMulsMatchTheReference(
      cuda_.get(),
      quant() == WeightQuant::kInt4
          ? std::vector<Shape>{{520, 384}, {37, 1024}, {67, 1000}, {130, 300}}  // last groups of 104, 44 inputs
          : std::vector<Shape>{{520, 384}, {37, 1000}, {301, 1001}},  // vector loads; byte loads of w; of w and x
      true);
}

// fp8 with input-group scales (an FP8 checkpoint's block scales: RowsGemvKernel's groups, and
// DequantRowsKernel's for the cuBLAS path; written without a GPU, not yet run on one): the same
// reference (DequantizeFp8Groups) and bound as above, for groups of 128 (DeepSeek-V3's and Qwen3's),
// 40 and 8 (the smallest the kernels take), on the GEMV's vector loads (k % 16 == 0: a run of 16
// inputs across two groups of 40 or 8) and its byte loads, with short last groups (1000, 1001).
// Groups of other sizes are refused when stored.
TEST_P(CudaQuant, Fp8GroupScalesMatchTheDequantizedReference) {
  if (quant() != WeightQuant::kFp8) GTEST_SKIP() << "input-group scales are fp8's";
  for (int64_t group : {128, 40, 8}) {
    SCOPED_TRACE(::testing::Message() << "groups of " << group);
    group_ = group;
    ExpectMatMulsMatchTheReference(cuda_.get(), {{520, 384}, {64, 1024}, {37, 1000}, {301, 1001}}, false);
  }
  group_ = 0;
  std::vector<uint8_t> stored(static_cast<size_t>(QuantizedWeightBytes(WeightQuant::kFp8, 4, 64, 12)));
  Tensor packed;
  EXPECT_TRUE(absl::IsInvalidArgument(
      cuda_->PackQuantizedWeight(WeightQuant::kFp8, stored.data(), 4, 64, &packed, 12).status()));
}

// The int4 GEMV on the tensor cores (CudaBackendOptions::int4_mma, quant_matmul.cu's
// Int4MmaGemvKernel; passed on an H200, 2026-11-28, but slower there than the GEMV, so off): 16-bit
// act dtypes, k a multiple of 128, up to 8 rows of x; the same reference and bound as above. Shapes:
// m not a multiple of 16 (a block's rows past m), 1 to 11 groups a row (a warp's share of the
// groups short, whole or several steps, and some warps with none). It must also differ somewhere
// from the GEMV it stands in for (float32 outputs: its sums in another order), or the tensor-core
// path did not run.
class CudaInt4Mma : public CudaQuant {};

TEST_P(CudaInt4Mma, MatMulMatchesTheDequantizedReference) {
  SS_ASSIGN_OR_FAIL(std::unique_ptr<Backend> mma, MakeCudaBackend(0, act(), {.quantized_kernels = true,
                                                                              .int4_mma = true,
                                                                              .quantized_scratch_bytes = 64 << 10}));
  ExpectThePathMatchesTheReferenceAndRan(mma.get(), {{520, 384}, {37, 1024}, {16, 128}, {75, 1408}, {8, 256}},
                                         "the tensor-core path");

  // A zero of 128 or more (no quantizer's, but the layout holds a byte) is not exact in bf16 as 128
  // + zero: such a weight keeps the plain GEMV, and its products stay right.
  const int64_t m = 16, k = 256;
  std::vector<uint8_t> stored = Quantize(RandomValues(m * k, 7400, DType::kF32), m, k);
  reinterpret_cast<Int4Group128*>(stored.data())[3].zero = 200;
  const std::vector<float> w_ref = Dequantize(stored, m, k);
  Tensor packed;
  SS_ASSIGN_OR_FAIL(Buffer w_buf, mma->PackQuantizedWeight(quant(), stored.data(), m, k, &packed));
  const std::vector<float> x = RandomValues(k, 7401, act());
  SS_ASSIGN_OR_FAIL(Guarded g_x, UploadF(mma.get(), x, act(), {1, k}));
  SS_ASSIGN_OR_FAIL(Guarded g_out, Output(mma.get(), DType::kF32, {1, m}));
  SS_ASSERT_OK(mma->MatMul(&g_out.t, g_x.t, packed, nullptr));
  SS_READ_F(got, mma.get(), g_out);
  for (int64_t r = 0; r < m; ++r) {
    double want = 0.0, mag = 0.0;
    for (int64_t c = 0; c < k; ++c) {
      want += static_cast<double>(x[c]) * w_ref[r * k + c];
      mag += std::fabs(static_cast<double>(x[c]) * w_ref[r * k + c]);
    }
    EXPECT_NEAR(got[r], want, 1e-5 * mag + 1e-30) << "row " << r << " (group 1 of row 1 has zero 200)";
  }
}

// The int4 GEMV with the zero point folded out of its loop (CudaBackendOptions::int4_folded,
// quant_matmul.cu's Int4FoldedGemvKernel; written 2026-11-29 without a GPU, off): 16-bit act
// dtypes, up to 8 rows of x; the same reference and bound as above (its extra rounding, about
// 2^-14 of the products' magnitude, is far inside them). Shapes: m not a multiple of its 4 rows a
// block (rows past m), k off 128 (a short last group: 1000 = 7 groups + 104 inputs), one group a
// row, and 14336 inputs (112 groups: three and a half of a thread's loops). It must also differ
// somewhere from the GEMV it stands in for (float32 outputs: other roundings), or it did not run;
// the worker log's backend line says it is on.
class CudaInt4Folded : public CudaQuant {};

TEST_P(CudaInt4Folded, MatMulMatchesTheDequantizedReference) {
  SS_ASSIGN_OR_FAIL(
      std::unique_ptr<Backend> folded,
      MakeCudaBackend(0, act(), {.quantized_kernels = true, .int4_folded = true, .quantized_scratch_bytes = 64 << 10}));
  EXPECT_NE(folded->Describe().find("int4 decode with the zero folded out"), std::string::npos) << folded->Describe();
  EXPECT_EQ(cuda_->Describe().find("folded"), std::string::npos) << cuda_->Describe();
  ExpectThePathMatchesTheReferenceAndRan(folded.get(), {{520, 384}, {37, 1024}, {67, 1000}, {6, 128}, {9, 14336}},
                                         "the folded GEMV");
}

// kernels/int4_folded.h, the folded GEMV's own arithmetic (its host build: the byte permute as a
// shift and a mask), run where no GPU is: each code as 0.5 + q / 256 exactly; then the eight
// threads' shares of every group of quantizer-made int4 rows (kernels/quant.h's layout: thread p
// takes bytes 8 p .. 8 p + 7, low nibbles inputs 8 p + [0, 8), high ones 64 + 8 p + [0, 8)),
// summed as the kernel sums them, against DequantizeInt4Groups's weights times x in double: within
// 2^-12 of the products' magnitude for bf16 and f16 inputs and for inputs all >= 0 (the fold's
// rounding grows with |sum x|: about 2^-14 at worst by its analysis, 3e-8 to 1.1e-7 measured here),
// also for a group whose zero is 200 (the layout holds any byte).
TEST(Int4FoldedArithmetic, EightThreadsGiveTheGroupsProducts) {
  for (uint32_t q = 0; q < 16; ++q) {
    for (int t = 0; t < 4; ++t) EXPECT_EQ(FoldedCode(q << (8 * t), t), 0.5f + static_cast<float>(q) / 256.0f) << q;
  }
  constexpr int64_t m = 48, k = 1024, groups = k / kInt4GroupSize;
  std::vector<float> w = RandomValues(m * k, 7800, DType::kF32);
  for (int64_t r = 0; r < m; ++r) {  // rows of different magnitudes and offsets (zeros away from 8)
    for (int64_t c = 0; c < k; ++c)
      w[r * k + c] = w[r * k + c] * std::ldexp(1.0f, static_cast<int>(r % 7) - 3) + 0.01f * (r % 5);
  }
  std::vector<Int4Group128> blocks(static_cast<size_t>(m * groups));
  SS_ASSERT_OK(QuantizeInt4Groups(blocks.data(), w.data(), m, k));
  blocks[5].zero = 200;  // not a quantizer's, but a valid byte
  std::vector<float> w_ref(static_cast<size_t>(m * k));
  DequantizeInt4Groups(w_ref.data(), blocks.data(), m, k);
  for (const auto& [dtype, same_sign] :
       std::vector<std::pair<DType, bool>>{{DType::kBF16, false}, {DType::kF16, false}, {DType::kBF16, true}}) {
    std::vector<float> x = RandomValues(k, 7801, dtype);
    if (same_sign) {  // every x >= 0: sum x, which d carries, as large as it gets
      for (float& v : x) v = std::fabs(v);
    }
    double worst = 0.0;
    for (int64_t r = 0; r < m; ++r) {
      float acc[8] = {};
      for (int64_t g = 0; g < groups; ++g) {
        const Int4Group128& b = blocks[r * groups + g];
        for (int p = 0; p < 8; ++p) {
          uint32_t lo, hi;
          std::memcpy(&lo, b.q + 8 * p, 4);
          std::memcpy(&hi, b.q + 8 * p + 4, 4);
          float wv[16], xv[16];
          FoldedCodes(lo, hi, wv);
          for (int j = 0; j < 8; ++j) {
            xv[j] = x[kInt4GroupSize * g + 8 * p + j];
            xv[8 + j] = x[kInt4GroupSize * g + 64 + 8 * p + j];
          }
          acc[p] = FoldedAccumulate(wv, xv, FoldedSumX(xv), FoldedScale(b.scale), FoldedZero(b.zero), acc[p]);
        }
      }
      const float got = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      double want = 0.0, mag = 0.0;
      for (int64_t c = 0; c < k; ++c) {
        want += static_cast<double>(x[c]) * w_ref[r * k + c];
        mag += std::fabs(static_cast<double>(x[c]) * w_ref[r * k + c]);
      }
      worst = std::max(worst, std::fabs(got - want) / mag);
    }
    const std::string name = std::string(DTypeName(dtype)) + (same_sign ? "_x_at_least_0" : "");
    EXPECT_LE(worst, std::ldexp(1.0, -12)) << name << ": error / magnitude of the products";
    std::ostringstream worst_text;
    worst_text << worst;
    RecordProperty("worst_" + name, worst_text.str());
  }
}

// cuBLASLt's fp8 GEMM (CudaBackendOptions::fp8_gemm, fp8_gemm.cu; written without a GPU, off):
// more than 8 rows of x by an fp8 weight, x's rows rounded to e4m3 with a scale each (max |x| /
// 448, as kernels/quant.h scales the weights' rows). Against the reference of the same rounding on
// the host (FloatToFp8E4m3 of x / scale), the bound of CudaQuant's reference: (2 u + 1e-5) x (sum
// of |products| + |bias|). Shapes: m and k multiples of 16 (what the GEMM takes); n = 300 with the
// tests' 64 KiB scratch is three blocks of x's rows. On a GPU of compute capability 8.9 or newer
// the outputs must differ from the default path's somewhere (x rounded to e4m3 moves them by far
// more than bf16 rounding), or the GEMM did not run; below 8.9 the option changes nothing (bitwise
// the default). A shape the GEMM does not take (m = 37) keeps the default path bitwise. A NaN in a
// row of x makes that row's outputs NaN and leaves the others as they were.
class CudaFp8Gemm : public CudaQuant {};

TEST_P(CudaFp8Gemm, MatMulMatchesTheE4m3RoundedReference) {
  SS_ASSIGN_OR_FAIL(
      std::unique_ptr<Backend> lt,
      MakeCudaBackend(0, act(), {.quantized_kernels = true, .fp8_gemm = true, .quantized_scratch_bytes = 64 << 10}));
  const int cc = CudaComputeCapability(0);
  ASSERT_GT(cc, 0);
  const bool fp8_cores = cc >= 89;
  RecordProperty("compute_capability", cc);
  EXPECT_EQ(lt->Describe().find("fp8 prefill by cuBLASLt") != std::string::npos, fp8_cores) << lt->Describe();
  EXPECT_EQ(cuda_->Describe().find("cuBLASLt"), std::string::npos) << cuda_->Describe();
  const double u = UnitRoundoff(act());
  uint32_t salt = 0;
  for (auto [m, k] : {std::pair<int64_t, int64_t>{512, 384}, {48, 1024}, {16, 4096}, {37, 256}}) {
    const std::vector<float> w = RandomValues(m * k, Seed(Op::kMatMul, act(), 7500 + salt++), DType::kF32);
    const std::vector<uint8_t> stored = Quantize(w, m, k);
    const std::vector<float> w_ref = Dequantize(stored, m, k);
    Tensor packed_lt, packed_plain;
    SS_ASSIGN_OR_FAIL(Buffer lt_buf, lt->PackQuantizedWeight(quant(), stored.data(), m, k, &packed_lt));
    SS_ASSIGN_OR_FAIL(Buffer plain_buf, cuda_->PackQuantizedWeight(quant(), stored.data(), m, k, &packed_plain));
    const bool takes = fp8_cores && m % 16 == 0;
    const std::vector<float> b = RandomValues(m, Seed(Op::kMatMul, act(), 7600 + salt), act());
    for (const auto& [n, with_bias, f32_out] :
         std::vector<std::tuple<int64_t, bool, bool>>{{9, false, false}, {33, true, true}, {300, true, false}}) {
      SCOPED_TRACE(::testing::Message() << "m " << m << ", k " << k << ", n " << n << (with_bias ? ", bias" : "")
                                        << (f32_out ? ", F32 out" : ", act out"));
      std::vector<float> x =
          RandomValues(n * k, Seed(Op::kMatMul, act(), 7700 + salt + static_cast<uint32_t>(n)), act());
      const DType out_dtype = f32_out ? DType::kF32 : act();
      const auto run = [&](Backend* backend, const Tensor& packed, const std::vector<float>& in) {
        std::vector<float> got;
        absl::StatusOr<Guarded> g_x = UploadF(backend, in, act(), {n, k});
        absl::StatusOr<Guarded> g_b = UploadF(backend, b, act(), {m});
        absl::StatusOr<Guarded> g_out = Output(backend, out_dtype, {n, m});
        EXPECT_TRUE(g_x.ok() && g_b.ok() && g_out.ok());
        if (!g_x.ok() || !g_b.ok() || !g_out.ok()) return got;
        const absl::Status s = backend->MatMul(&g_out->t, g_x->t, packed, with_bias ? &g_b->t : nullptr);
        EXPECT_TRUE(s.ok()) << s;
        std::string guard_error;
        absl::StatusOr<std::vector<uint8_t>> bytes = ReadBytes(backend, *g_out, &guard_error);
        EXPECT_TRUE(bytes.ok() && guard_error.empty()) << bytes.status() << guard_error;
        if (!bytes.ok() || !guard_error.empty()) return got;
        got.resize(static_cast<size_t>(n * m));
        EXPECT_TRUE(ConvertOnHost(got.data(), DType::kF32, bytes->data(), out_dtype, got.size()));
        return got;
      };
      const std::vector<float> got = run(lt.get(), packed_lt, x);
      const std::vector<float> plain = run(cuda_.get(), packed_plain, x);
      ASSERT_EQ(got.size(), static_cast<size_t>(n * m));
      ASSERT_EQ(plain.size(), got.size());
      if (!takes) {
        EXPECT_TRUE(got == plain) << "the GEMM does not take this shape / GPU: the default path's outputs";
        continue;
      }
      EXPECT_FALSE(got == plain) << "bitwise the default path's: the fp8 GEMM did not run";
      double worst = 0.0;
      for (int64_t i = 0; i < n; ++i) {
        float amax = 0.0f;
        for (int64_t c = 0; c < k; ++c) amax = std::max(amax, std::fabs(x[i * k + c]));
        const float xs = amax > 0.0f ? amax / kFp8E4m3Max : 1.0f;
        for (int64_t r = 0; r < m; ++r) {
          double sum = with_bias ? b[r] : 0.0, mag = with_bias ? std::fabs(b[r]) : 0.0;
          for (int64_t c = 0; c < k; ++c) {
            const double p =
                static_cast<double>(Fp8E4m3ToFloat(FloatToFp8E4m3(x[i * k + c] / xs))) * xs * w_ref[r * k + c];
            sum += p;
            mag += std::fabs(p);
          }
          const double g = got[i * m + r];
          ASSERT_TRUE(std::isfinite(g)) << "row " << i << ", column " << r << ": " << g;
          worst = std::max(worst, std::fabs(g - sum) / ((2.0 * u + 1e-5) * mag + 1e-30));
        }
      }
      EXPECT_LE(worst, 1.0) << "the worst output's error / bound";
      // A NaN in row 1 of x: that row's outputs NaN, the others unchanged.
      x[1 * k + k / 2] = std::numeric_limits<float>::quiet_NaN();
      const std::vector<float> bad = run(lt.get(), packed_lt, x);
      ASSERT_EQ(bad.size(), got.size());
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t r = 0; r < m; ++r) {
          if (i == 1) {
            ASSERT_TRUE(std::isnan(bad[i * m + r])) << "row 1 (a NaN input), column " << r << ": " << bad[i * m + r];
          } else {
            ASSERT_EQ(bad[i * m + r], got[i * m + r]) << "row " << i << ", column " << r << ": changed by row 1's NaN";
          }
        }
      }
    }
  }
}

// PackMatMulWeight quantizes an act-dtype weight on the device into exactly the bytes the host
// quantizer makes of the same (rounded) values, and MatMul refuses a view of part of a quantized
// weight and a quantized weight another backend made.
TEST_P(CudaQuant, PackMatMulWeightStoresTheHostQuantizersBytes) {
  const int64_t m = 45, k = 256;
  const std::vector<float> w = RandomValues(m * k, Seed(Op::kMatMul, act(), 7300), act());
  SS_ASSIGN_OR_FAIL(Guarded g_w, UploadF(cuda_.get(), w, act(), {m, k}));
  Tensor packed;
  SS_ASSIGN_OR_FAIL(Buffer w_buf, cuda_->PackMatMulWeight(g_w.t, &packed, quant()));
  ASSERT_EQ(packed.quant, quant());
  ASSERT_EQ(packed.dtype, DType::kI8);
  const std::vector<uint8_t> want = Quantize(w, m, k);
  std::vector<uint8_t> got(want.size());
  SS_ASSERT_OK(cuda_->CopyToHost(got.data(), packed.data, got.size()));
  EXPECT_TRUE(got == want) << "the device copy differs from kernels/quant.h's quantization";

  SS_ASSIGN_OR_FAIL(Guarded g_x, UploadF(cuda_.get(), RandomValues(k, 1, act()), act(), {1, k}));
  SS_ASSIGN_OR_FAIL(Guarded g_out, Output(cuda_.get(), act(), {1, m - 1}));
  Tensor part = packed;
  part.shape[0] = m - 1;
  EXPECT_TRUE(absl::IsInvalidArgument(cuda_->MatMul(&g_out.t, g_x.t, part, nullptr)));
  Tensor stranger = packed;
  stranger.data = g_w.t.data;  // device memory, but no quantized weight of this backend's
  SS_ASSIGN_OR_FAIL(Guarded g_out_m, Output(cuda_.get(), act(), {1, m}));
  EXPECT_TRUE(absl::IsInvalidArgument(cuda_->MatMul(&g_out_m.t, g_x.t, stranger, nullptr)));
}

// A backend made without the option (the worker's --no-cuda-quantized-kernels) refuses quantized
// weights, naming the switch, as it did before the kernels existed.
TEST_P(CudaQuant, OffByDefault) {
  SS_ASSIGN_OR_FAIL(std::unique_ptr<Backend> plain, MakeCudaBackend(0, act()));
  const int64_t m = 4, k = 128;
  const std::vector<uint8_t> stored = Quantize(std::vector<float>(m * k, 0.5f), m, k);
  Tensor packed;
  const absl::StatusOr<Buffer> refused = plain->PackQuantizedWeight(quant(), stored.data(), m, k, &packed);
  ASSERT_TRUE(absl::IsUnimplemented(refused.status())) << refused.status();
  EXPECT_NE(refused.status().message().find("--no-cuda-quantized-kernels"), std::string::npos) << refused.status();
  SS_ASSIGN_OR_FAIL(Guarded g_w, UploadF(plain.get(), std::vector<float>(m * k, 0.5f), act(), {m, k}));
  EXPECT_TRUE(absl::IsUnimplemented(plain->PackMatMulWeight(g_w.t, &packed, quant()).status()));
}

// The decode figure of issue 25 (tools/gpu/gpu-bench.sh steps quant-int4-b1, quant-int8-b1; excluded
// from cuda-ops): Llama-3-8B's linear layers (32 x q, k, v, o, gate, up, down: 4096 x 4096, 1024 x
// 4096 twice, 4096 x 4096, 14336 x 4096 twice, 4096 x 14336), each layer its own weights, multiplied
// by one bf16 token as a decode step would, on a backend with the opt-in
// (CudaBackendOptions::quantized_kernels). Writes SHARDSERVE_QUANT_BENCH_JSON: the packed bytes a
// token reads (bytes_per_decode_step), tokens/s and GB/s; gpu_bench_report.py puts them beside the
// streaming-read roofline of the same run. The weights' codes are random (the speed does not
// depend on them). Skipped unless SHARDSERVE_QUANT_BENCH names the format (int4, int8 or fp8);
// SHARDSERVE_QUANT_BENCH_INT4_MMA=1 adds CudaBackendOptions::int4_mma (step quant-int4-mma-b1),
// SHARDSERVE_QUANT_BENCH_PDL=1 CudaBackendOptions::pdl (step quant-int4-pdl-b1),
// SHARDSERVE_QUANT_BENCH_INT4_FOLDED=1 CudaBackendOptions::int4_folded (step quant-int4-folded-b1).
TEST(CudaQuantBench, Llama8bDecodeBatch1) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const char* format = std::getenv("SHARDSERVE_QUANT_BENCH");
  const char* json_path = std::getenv("SHARDSERVE_QUANT_BENCH_JSON");
  if (format == nullptr || json_path == nullptr) {
    GTEST_SKIP() << "a benchmark: set SHARDSERVE_QUANT_BENCH (int4, int8, fp8) and SHARDSERVE_QUANT_BENCH_JSON";
  }
  SS_ASSIGN_OR_FAIL(const WeightQuant quant, ParseWeightQuant(format));
  ASSERT_NE(quant, WeightQuant::kNone);
  const char* mma = std::getenv("SHARDSERVE_QUANT_BENCH_INT4_MMA");
  const bool int4_mma = mma != nullptr && std::string(mma) == "1";
  const char* pdl = std::getenv("SHARDSERVE_QUANT_BENCH_PDL");
  const char* folded = std::getenv("SHARDSERVE_QUANT_BENCH_INT4_FOLDED");
  const bool int4_folded = folded != nullptr && std::string(folded) == "1";
  SS_ASSIGN_OR_FAIL(std::unique_ptr<Backend> cuda, MakeCudaBackend(0, DType::kBF16,
                                                                   {.quantized_kernels = true,
                                                                    .int4_mma = int4_mma,
                                                                    .pdl = pdl != nullptr && std::string(pdl) == "1",
                                                                    .int4_folded = int4_folded}));
  constexpr int kLayers = 32, kWarmup = 3, kTokens = 20;
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{4096, 4096}, {1024, 4096},  {1024, 4096}, {4096, 4096},
                                                           {14336, 4096}, {14336, 4096}, {4096, 14336}};
  std::mt19937 rng(25);
  std::vector<Buffer> buffers;
  std::vector<Tensor> weights;
  int64_t bytes_per_token = 0;
  for (const auto& [m, k] : shapes) {
    // One host image per shape (valid headers: scale 2^-7, zero 8; random codes), copied per layer.
    std::vector<uint8_t> stored(static_cast<size_t>(QuantizedWeightBytes(quant, m, k)));
    for (uint8_t& b : stored) b = static_cast<uint8_t>(rng());
    if (quant == WeightQuant::kInt4) {
      auto* blocks = reinterpret_cast<Int4Group128*>(stored.data());
      for (int64_t g = 0; g < m * Int4GroupsLayout{m, k}.groups_per_row(); ++g) {
        blocks[g].scale = 1.0f / 128;
        blocks[g].zero = 8;
        blocks[g].pad[0] = blocks[g].pad[1] = blocks[g].pad[2] = 0;
      }
    } else {
      auto* scale = reinterpret_cast<float*>(stored.data());
      for (int64_t r = 0; r < m; ++r) scale[r] = 1.0f / 128;
      if (quant == WeightQuant::kFp8) {
        for (size_t i = static_cast<size_t>(4 * m); i < stored.size(); ++i) stored[i] &= 0xF7;  // no NaN bytes
      }
    }
    for (int l = 0; l < kLayers; ++l) {
      Tensor packed;
      SS_ASSIGN_OR_FAIL(Buffer b, cuda->PackQuantizedWeight(quant, stored.data(), m, k, &packed));
      buffers.push_back(std::move(b));
      weights.push_back(packed);
      bytes_per_token += static_cast<int64_t>(packed.bytes());
    }
  }
  SS_ASSIGN_OR_FAIL(Guarded g_x, UploadF(cuda.get(), RandomValues(14336, 26, DType::kBF16), DType::kBF16, {1, 14336}));
  SS_ASSIGN_OR_FAIL(Guarded g_out, Output(cuda.get(), DType::kBF16, {1, 14336}));
  auto token = [&]() -> absl::Status {
    for (int l = 0; l < kLayers; ++l) {
      for (size_t s = 0; s < shapes.size(); ++s) {
        const Tensor& w = weights[s * kLayers + l];
        Tensor x(g_x.t.data, DType::kBF16, {1, w.dim(1)});
        Tensor out(g_out.t.data, DType::kBF16, {1, w.dim(0)});
        absl::Status st = cuda->MatMul(&out, x, w, nullptr);
        if (!st.ok()) return st;
      }
    }
    return absl::OkStatus();
  };
  for (int i = 0; i < kWarmup; ++i) SS_ASSERT_OK(token());
  SS_ASSERT_OK(cuda->Synchronize());
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kTokens; ++i) SS_ASSERT_OK(token());
  SS_ASSERT_OK(cuda->Synchronize());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double tokens_per_s = kTokens / seconds;
  const double gbps = static_cast<double>(bytes_per_token) * tokens_per_s / 1e9;
  std::ostringstream json;
  json << "{\"format\": \"" << WeightQuantName(quant) << (int4_mma ? "\", \"int4_mma\": \"on" : "")
       << (int4_folded ? "\", \"int4_folded\": \"on" : "") << "\", \"device\": \"" << cuda->Describe()
       << "\", \"batch\": 1, \"layers\": " << kLayers << ", \"tokens\": " << kTokens
       << ", \"bytes_per_decode_step\": " << bytes_per_token << ", \"decode_tokens_per_s\": " << tokens_per_s
       << ", \"us_per_token\": " << 1e6 / tokens_per_s << ", \"weight_gbps\": " << gbps << "}\n";
  std::FILE* f = std::fopen(json_path, "w");
  ASSERT_NE(f, nullptr) << json_path;
  std::fputs(json.str().c_str(), f);
  std::fclose(f);
  std::printf("%s", json.str().c_str());
  RecordProperty("weight_gbps", std::to_string(gbps));
}

// ---- Step graphs (CudaBackendOptions::step_graphs; passed on an H200, 2026-11-28) ------------------
// A recording is a stream capture: the ops between BeginGraph and EndGraph do not run, RunGraph runs
// them on what their buffers hold then, and kernel_launches() counts them as they run. A product
// with a bias (a broadcast kernel, then cuBLAS's GEMM onto it) and an Add, recorded, replayed twice
// with new inputs uploaded between (H200, 2026-11-28: three launches a run, as counted); each replay
// must give the float32 products of its inputs (double reference, cuBLAS's float32 sums).
TEST(CudaGraphs, ARecordedStepRunsOnWhatItsBuffersHoldThen) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  SS_ASSIGN_OR_FAIL(std::unique_ptr<Backend> cuda, MakeCudaBackend(0, DType::kF32, {.step_graphs = true}));
  ASSERT_TRUE(cuda->records_graphs());
  const int64_t n = 3, k = 96, m = 40;
  const std::vector<float> w = RandomValues(m * k, 81, DType::kF32), b = RandomValues(m, 82, DType::kF32);
  SS_ASSIGN_OR_FAIL(Guarded g_x, UploadF(cuda.get(), RandomValues(n * k, 83, DType::kF32), DType::kF32, {n, k}));
  SS_ASSIGN_OR_FAIL(Guarded g_w, UploadF(cuda.get(), w, DType::kF32, {m, k}));
  SS_ASSIGN_OR_FAIL(Guarded g_b, UploadF(cuda.get(), b, DType::kF32, {m}));
  SS_ASSIGN_OR_FAIL(Guarded g_y, Output(cuda.get(), DType::kF32, {n, m}));
  SS_ASSIGN_OR_FAIL(Guarded g_sum, Output(cuda.get(), DType::kF32, {n, m}));
  // cuBLAS's first call (its workspace) outside the recording, as a worker's first step of a shape.
  SS_ASSERT_OK(cuda->MatMul(&g_y.t, g_x.t, g_w.t, &g_b.t));
  SS_ASSERT_OK(cuda->Synchronize());

  const uint64_t before = cuda->kernel_launches();
  SS_ASSERT_OK(cuda->BeginGraph());
  SS_ASSERT_OK(cuda->Fill0(g_y.t.data, g_y.payload));
  SS_ASSERT_OK(cuda->MatMul(&g_y.t, g_x.t, g_w.t, &g_b.t));
  SS_ASSERT_OK(cuda->Add(&g_sum.t, g_y.t, g_y.t));
  SS_ASSIGN_OR_FAIL(const int id, cuda->EndGraph());
  EXPECT_EQ(cuda->kernel_launches(), before) << "recorded launches count when they run";
  {
    SS_READ_F(unrun, cuda.get(), g_sum);
    EXPECT_TRUE(std::isnan(unrun[0])) << "a recorded op ran before RunGraph";
  }
  for (uint32_t round = 0; round < 2; ++round) {
    const std::vector<float> x = RandomValues(n * k, 90 + round, DType::kF32);
    SS_ASSERT_OK(cuda->CopyToDevice(g_x.t.data, x.data(), x.size() * sizeof(float)));
    SS_ASSERT_OK(cuda->RunGraph(id));
    EXPECT_EQ(cuda->kernel_launches(), before + 3 * (round + 1)) << "the bias broadcast, the product and the Add per run";
    SS_READ_F(got, cuda.get(), g_sum);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t r = 0; r < m; ++r) {
        double want = b[r], mag = std::fabs(b[r]);
        for (int64_t c = 0; c < k; ++c) {
          want += static_cast<double>(x[i * k + c]) * w[r * k + c];
          mag += std::fabs(static_cast<double>(x[i * k + c]) * w[r * k + c]);
        }
        EXPECT_NEAR(got[i * m + r], 2 * want, 2 * 1e-5 * mag + 1e-30)
            << "round " << round << ", [" << i << ", " << r << "]";
      }
    }
  }
  EXPECT_TRUE(absl::IsInvalidArgument(cuda->RunGraph(id + 1)));
}

// A call that waits for the device spoils a recording: it is refused, EndGraph says which, no graph
// is made, and the stream goes on working outside a recording.
TEST(CudaGraphs, ACallThatWaitsSpoilsTheRecording) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  SS_ASSIGN_OR_FAIL(std::unique_ptr<Backend> cuda, MakeCudaBackend(0, DType::kF32, {.step_graphs = true}));
  SS_ASSIGN_OR_FAIL(Guarded g_a, UploadF(cuda.get(), std::vector<float>(64, 1.5f), DType::kF32, {1, 64}));
  SS_ASSIGN_OR_FAIL(Guarded g_out, Output(cuda.get(), DType::kF32, {1, 64}));
  const float host[64] = {};
  SS_ASSERT_OK(cuda->BeginGraph());
  EXPECT_TRUE(absl::IsFailedPrecondition(cuda->BeginGraph())) << "one recording at a time";
  SS_ASSERT_OK(cuda->Add(&g_out.t, g_a.t, g_a.t));
  EXPECT_TRUE(absl::IsFailedPrecondition(cuda->CopyToDevice(g_a.t.data, host, sizeof(host))));
  const absl::StatusOr<int> id = cuda->EndGraph();
  ASSERT_FALSE(id.ok());
  EXPECT_NE(id.status().message().find("CopyToDevice"), std::string::npos) << id.status();
  SS_ASSERT_OK(cuda->Add(&g_out.t, g_a.t, g_a.t));
  SS_READ_F(got, cuda.get(), g_out);
  EXPECT_EQ(got[0], 3.0f);
  EXPECT_TRUE(absl::IsFailedPrecondition(cuda->EndGraph().status())) << "no recording under way";
}

// Off in a backend made without the option (the worker's --no-cuda-graphs): it records nothing and
// says which option.
TEST(CudaGraphs, OffByDefault) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  SS_ASSIGN_OR_FAIL(std::unique_ptr<Backend> cuda, MakeCudaBackend(0, DType::kF32));
  EXPECT_FALSE(cuda->records_graphs());
  const absl::Status s = cuda->BeginGraph();
  EXPECT_TRUE(absl::IsUnimplemented(s)) << s;
  EXPECT_NE(s.message().find("--no-cuda-graphs"), std::string::npos) << s;
}

INSTANTIATE_TEST_SUITE_P(Ops, CudaQuant,
                         ::testing::Combine(::testing::Values(WeightQuant::kInt8, WeightQuant::kInt4, WeightQuant::kFp8),
                                            ::testing::Values(DType::kF32, DType::kF16, DType::kBF16)),
                         QuantParamName);
INSTANTIATE_TEST_SUITE_P(Ops, CudaFp8Gemm,
                         ::testing::Combine(::testing::Values(WeightQuant::kFp8),
                                            ::testing::Values(DType::kF32, DType::kF16, DType::kBF16)),
                         QuantParamName);
INSTANTIATE_TEST_SUITE_P(Ops, CudaInt4Mma,
                         ::testing::Combine(::testing::Values(WeightQuant::kInt4),
                                            ::testing::Values(DType::kF16, DType::kBF16)),
                         QuantParamName);
INSTANTIATE_TEST_SUITE_P(Ops, CudaInt4Folded,
                         ::testing::Combine(::testing::Values(WeightQuant::kInt4),
                                            ::testing::Values(DType::kF16, DType::kBF16)),
                         QuantParamName);

INSTANTIATE_TEST_SUITE_P(Ops, CudaVsCpu, ::testing::Values(DType::kF32, DType::kF16, DType::kBF16), DTypeParamName);
INSTANTIATE_TEST_SUITE_P(Ops, CudaChecks, ::testing::Values(DType::kF32, DType::kF16, DType::kBF16), DTypeParamName);

#if SHARDSERVE_HAVE_CUDA
// Whether this process maps a file whose path contains `name` (/proc/self/maps).
bool ProcessMaps(const std::string& name) {
  FILE* maps = std::fopen("/proc/self/maps", "r");
  if (maps == nullptr) return false;
  char line[4096];
  bool found = false;
  while (!found && std::fgets(line, sizeof(line), maps) != nullptr) found = std::strstr(line, name.c_str()) != nullptr;
  std::fclose(maps);
  return found;
}

// cuBLAS and cuBLASLt are opened by the first CUDA backend, not with the program: no GPU is needed
// to open them and find every entry point.
TEST(CublasApi, OpensEveryEntryPointWithoutAGpu) {
  absl::StatusOr<const cuda::CublasApi*> api = cuda::LoadCublas();
  ASSERT_TRUE(api.ok()) << api.status();
  const cuda::CublasApi& b = **api;
  const void* entries[] = {
      reinterpret_cast<const void*>(b.create),
      reinterpret_cast<const void*>(b.destroy),
      reinterpret_cast<const void*>(b.set_stream),
      reinterpret_cast<const void*>(b.set_math_mode),
      reinterpret_cast<const void*>(b.gemm_ex),
      reinterpret_cast<const void*>(b.status_name),
      reinterpret_cast<const void*>(b.status_string),
      reinterpret_cast<const void*>(b.lt_create),
      reinterpret_cast<const void*>(b.lt_destroy),
      reinterpret_cast<const void*>(b.lt_matmul),
      reinterpret_cast<const void*>(b.lt_matmul_desc_create),
      reinterpret_cast<const void*>(b.lt_matmul_desc_destroy),
      reinterpret_cast<const void*>(b.lt_matmul_desc_set_attribute),
      reinterpret_cast<const void*>(b.lt_matrix_layout_create),
      reinterpret_cast<const void*>(b.lt_matrix_layout_destroy),
      reinterpret_cast<const void*>(b.lt_matmul_preference_create),
      reinterpret_cast<const void*>(b.lt_matmul_preference_destroy),
      reinterpret_cast<const void*>(b.lt_matmul_preference_set_attribute),
      reinterpret_cast<const void*>(b.lt_matmul_algo_get_heuristic),
  };
  static_assert(sizeof(entries) == sizeof(cuda::CublasApi), "every member of CublasApi is checked here");
  for (size_t i = 0; i < std::size(entries); ++i) EXPECT_NE(entries[i], nullptr) << "entry " << i;
  // Calls that need no device: the library answers through the table.
  EXPECT_STREQ(b.status_name(CUBLAS_STATUS_ALLOC_FAILED), "CUBLAS_STATUS_ALLOC_FAILED");
  EXPECT_EQ(cuda::LoadedCublas(), *api);
  absl::StatusOr<const cuda::CublasApi*> again = cuda::LoadCublas();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *api);  // opened once
  EXPECT_EQ(cuda::CublasLibraryPath(true, false), absl::StrCat("libcublasLt.so.", CUBLAS_VER_MAJOR));
  EXPECT_EQ(cuda::CublasLibraryPath(false, false), absl::StrCat("libcublas.so.", CUBLAS_VER_MAJOR));
}

// A program built with CUDA does not load cuBLAS until it asks: the libraries are absent from a
// fresh process (a re-run of this program, gtest's "threadsafe" death-test style), present after.
TEST(CublasApi, OpenedOnlyWhenAskedFor) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        if (ProcessMaps("libcublas") || cuda::LoadedCublas() != nullptr) {
          std::fprintf(stderr, "cuBLAS was loaded before LoadCublas\n");
          std::_Exit(1);
        }
        if (!cuda::LoadCublas().ok() || cuda::LoadedCublas() == nullptr) std::_Exit(2);
        if (!ProcessMaps("libcublasLt.so") || !ProcessMaps("libcublas.so")) std::_Exit(3);
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}
#endif  // SHARDSERVE_HAVE_CUDA

}  // namespace
}  // namespace shardserve
