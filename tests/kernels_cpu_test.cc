// Tests of the CPU backend (kernels/cpu/) and the host float conversions
// (kernels/tensor.cc).
//
// Each op runs on fresh random inputs from fixed seeds and is compared with a naive double-
// precision reference written here, by normalized error max|got - want| / max|want| against a
// per-op limit whose justification sits beside it. NaN or Inf in an output always fails. Every
// tensor lives between guard bytes, and outputs start as NaN (0xff bytes), so stray writes and
// missed writes both show. Bad metadata and mismatched shapes must give InvalidArgument naming
// the op, leave outputs untouched where the op promises to, and never crash.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/cpu/activation_rows.h"
#include "kernels/cpu/bf16_matmul.h"
#include "kernels/cpu/tanh_avx2.h"
#include "kernels/cpu/int4_matmul.h"
#include "kernels/cpu/int8_matmul.h"
#include "kernels/cpu/isa_cap.h"
#include "kernels/cpu/panel_matmul.h"
#include "kernels/cpu/quant_isa.h"
#include "kernels/quant.h"
#include "kernels/sampling.h"
#include "kernels/tensor.h"
#include "tests/bf16_products.h"

namespace shardserve {
namespace {

constexpr size_t kGuardBytes = 64;  // on each side; a multiple of 64 keeps the data aligned
constexpr uint8_t kGuardFill = 0xa5;
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- Helpers ---------------------------------------------------------------------------------

// A tensor in backend memory with guard bytes on both sides. Data moves through CopyToDevice /
// CopyToHost, as for any backend.
class DeviceTensor {
 public:
  DeviceTensor(Backend* backend, DType dtype, const std::vector<int64_t>& shape) : backend_(backend) {
    tensor_.dtype = dtype;
    for (int64_t s : shape) tensor_.shape[tensor_.ndim++] = s;
    buffer_ = backend->Allocate(tensor_.bytes() + 2 * kGuardBytes).value();
    tensor_.data = static_cast<char*>(buffer_.data()) + kGuardBytes;
    const std::vector<uint8_t> fill(buffer_.bytes(), kGuardFill);
    EXPECT_TRUE(backend->CopyToDevice(buffer_.data(), fill.data(), fill.size()).ok());
  }

  Tensor& t() { return tensor_; }
  Tensor* ptr() { return &tensor_; }

  template <typename T>
  void Upload(const std::vector<T>& values) {
    ASSERT_EQ(values.size() * sizeof(T), tensor_.bytes());
    ASSERT_TRUE(backend_->CopyToDevice(tensor_.data, values.data(), tensor_.bytes()).ok());
  }
  // Sets every byte to 0xff: NaN as F32, -1 as I32. Outputs start like this.
  void Poison() {
    const std::vector<uint8_t> ff(tensor_.bytes(), 0xff);
    EXPECT_TRUE(backend_->CopyToDevice(tensor_.data, ff.data(), ff.size()).ok());
  }
  template <typename T>
  std::vector<T> Download() const {
    std::vector<T> values(tensor_.bytes() / sizeof(T));
    EXPECT_TRUE(backend_->CopyToHost(values.data(), tensor_.data, tensor_.bytes()).ok());
    return values;
  }
  bool GuardsIntact() const {
    std::vector<uint8_t> bytes(buffer_.bytes());
    EXPECT_TRUE(backend_->CopyToHost(bytes.data(), buffer_.data(), bytes.size()).ok());
    const auto is_guard = [](uint8_t b) { return b == kGuardFill; };
    return std::all_of(bytes.begin(), bytes.begin() + kGuardBytes, is_guard) &&
           std::all_of(bytes.end() - kGuardBytes, bytes.end(), is_guard);
  }

 private:
  Backend* backend_;
  Buffer buffer_;
  Tensor tensor_;
};

std::vector<float> Random(std::mt19937& rng, size_t n, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// max|got - want| / max|want|; infinity if got holds a NaN or an Inf, so that any limit fails.
double NormalizedError(const std::vector<float>& got, const std::vector<double>& want) {
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  double max_diff = 0.0, max_want = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    max_diff = std::max(max_diff, std::abs(static_cast<double>(got[i]) - want[i]));
    max_want = std::max(max_want, std::abs(want[i]));
  }
  return max_want > 0.0 ? max_diff / max_want : max_diff;
}

// Checks the normalized error against `limit` and prints it, so that runs show how much headroom
// each op has.
void ExpectClose(const std::string& what, const std::vector<float>& got, const std::vector<double>& want,
                 double limit) {
  const double err = NormalizedError(got, want);
  std::printf("    %-44s normalized error %.2e (limit %.0e)\n", what.c_str(), err, limit);
  EXPECT_LE(err, limit) << what;
}

bool IsInvalidArgumentNaming(const absl::Status& s, const std::string& op) {
  return s.code() == absl::StatusCode::kInvalidArgument && s.message().find(op) != std::string::npos;
}

class CpuBackendTest : public ::testing::Test {
 protected:
  DeviceTensor F32(const std::vector<int64_t>& shape, const std::vector<float>& values) {
    DeviceTensor t(backend_.get(), DType::kF32, shape);
    t.Upload(values);
    return t;
  }
  DeviceTensor I32(const std::vector<int64_t>& shape, const std::vector<int32_t>& values) {
    DeviceTensor t(backend_.get(), DType::kI32, shape);
    t.Upload(values);
    return t;
  }
  DeviceTensor Output(DType dtype, const std::vector<int64_t>& shape) {
    DeviceTensor t(backend_.get(), dtype, shape);
    t.Poison();
    return t;
  }

  std::unique_ptr<Backend> backend_ = MakeCpuBackend();
  std::mt19937 rng_{20240611};
};

// ---- Float conversions -----------------------------------------------------------------------

// The value of a binary16 bit pattern, computed independently of F16ToF32.
double HalfValue(uint16_t h) {
  const int exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  double magnitude = std::ldexp(1024 + mantissa, exponent - 25);  // normal
  if (exponent == 0) magnitude = std::ldexp(mantissa, -24);     // zero, subnormal
  if (exponent == 0x1f) magnitude = mantissa == 0 ? HUGE_VAL : NAN;
  return (h & 0x8000) ? -magnitude : magnitude;
}

TEST(F16Test, KnownValues) {
  const std::pair<float, uint16_t> cases[] = {
      {1.0f, 0x3c00},          {-2.0f, 0xc000},       {0.0f, 0x0000},         {-0.0f, 0x8000},
      {65504.0f, 0x7bff},      {65519.0f, 0x7bff},    {65520.0f, 0x7c00},     {1e6f, 0x7c00},
      {kInf, 0x7c00},          {-kInf, 0xfc00},       {0x1p-14f, 0x0400},     {0x1p-24f, 0x0001},
      {1023 * 0x1p-24f, 0x03ff},
      {0x1p-25f, 0x0000},      // halfway between 0 and the smallest subnormal: ties to even 0
      {0x1.8p-25f, 0x0001},    // above halfway
      {3 * 0x1p-25f, 0x0002},  // halfway between subnormals 1 and 2: ties to even 2
      {1.0f + 0x1p-11f, 0x3c00},      // halfway between 1 and 1 + 2^-10: ties to even 1
      {1.0f + 3 * 0x1p-11f, 0x3c02},  // halfway between 1 + 2^-10 and 1 + 2^-9: ties to even
      {0.1f, 0x2e66},
  };
  for (const auto& [f, h] : cases) {
    EXPECT_EQ(F32ToF16(f), h) << f;
    EXPECT_EQ(F16ToF32(h), static_cast<float>(HalfValue(h))) << f;
  }
  EXPECT_TRUE(std::signbit(F16ToF32(0x8000)));
  const uint16_t nan = F32ToF16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7c00, 0x7c00);
  EXPECT_NE(nan & 0x03ff, 0);
  EXPECT_TRUE(std::isnan(F16ToF32(0x7e00)));
  EXPECT_TRUE(std::isnan(F16ToF32(0xfc01)));
  EXPECT_EQ(F16ToF32(0x7c00), kInf);
  EXPECT_EQ(F16ToF32(0xfc00), -kInf);
}

// Every one of the 65536 patterns converts exactly to float32 and back.
TEST(F16Test, AllValuesRoundTrip) {
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const auto h = static_cast<uint16_t>(bits);
    const float f = F16ToF32(h);
    if ((h & 0x7c00) == 0x7c00 && (h & 0x03ff) != 0) {
      ASSERT_TRUE(std::isnan(f)) << bits;
      ASSERT_TRUE(std::isnan(F16ToF32(F32ToF16(f)))) << bits;
      continue;
    }
    ASSERT_EQ(f, static_cast<float>(HalfValue(h))) << bits;
    ASSERT_EQ(F32ToF16(f), h) << bits;
  }
}

// Round to nearest even at every boundary: for each pair of adjacent non-negative halves (the
// last pair being 65504 and 2^16, which rounds to inf), the float32 midpoint goes to the even
// one and its float32 neighbours go to the nearer one. This covers subnormals and the carry into
// the exponent. Negative values mirror this through the sign bit.
TEST(F16Test, RoundsToNearestEvenAtEveryMidpoint) {
  for (uint32_t lo = 0; lo < 0x7c00; ++lo) {
    const uint32_t hi = lo + 1;
    const double a = HalfValue(static_cast<uint16_t>(lo));
    const double b = hi == 0x7c00 ? 65536.0 : HalfValue(static_cast<uint16_t>(hi));  // 2^16 would be next
    const float mid = static_cast<float>((a + b) / 2);  // exact: halves have 11 significant bits
    ASSERT_EQ(F32ToF16(mid), (lo % 2 == 0) ? lo : hi) << lo;
    ASSERT_EQ(F32ToF16(std::nextafter(mid, 0.0f)), lo) << lo;
    ASSERT_EQ(F32ToF16(std::nextafter(mid, kInf)), hi) << lo;
    ASSERT_EQ(F32ToF16(-mid), ((lo % 2 == 0) ? lo : hi) | 0x8000) << lo;
  }
}

TEST(Bf16Test, KnownValuesAndRoundTrip) {
  EXPECT_EQ(F32ToBf16(1.0f), 0x3f80);
  EXPECT_EQ(F32ToBf16(1.0f + 0x1p-8f), 0x3f80);      // halfway: ties to even
  EXPECT_EQ(F32ToBf16(1.0f + 3 * 0x1p-8f), 0x3f82);  // halfway: ties to even
  EXPECT_EQ(F32ToBf16(1.0f + 0x1.8p-8f), 0x3f81);    // above halfway
  EXPECT_EQ(F32ToBf16(-kInf), 0xff80);
  EXPECT_EQ(F32ToBf16(std::numeric_limits<float>::max()), 0x7f80);  // above the largest bf16's midpoint
  EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload lives only in the low 16 bits must not become inf.
  uint32_t low_payload_nan = 0x7f800001;
  float f;
  std::memcpy(&f, &low_payload_nan, 4);
  EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16(f))));
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const auto h = static_cast<uint16_t>(bits);
    const float x = Bf16ToF32(h);
    if (std::isnan(x)) continue;
    ASSERT_EQ(F32ToBf16(x), h) << bits;
  }
}

TEST(ConvertOnHostTest, ConvertsBetweenFloatTypes) {
  const std::vector<float> src = {1.0f, -2.5f, 65504.0f, 0x1p-24f, 0.1f};
  std::vector<uint16_t> half(src.size()), bf16(src.size());
  std::vector<float> back(src.size());
  ASSERT_TRUE(ConvertOnHost(half.data(), DType::kF16, src.data(), DType::kF32, src.size()));
  for (size_t i = 0; i < src.size(); ++i) EXPECT_EQ(half[i], F32ToF16(src[i]));
  ASSERT_TRUE(ConvertOnHost(bf16.data(), DType::kBF16, half.data(), DType::kF16, src.size()));
  for (size_t i = 0; i < src.size(); ++i) EXPECT_EQ(bf16[i], F32ToBf16(F16ToF32(half[i])));
  ASSERT_TRUE(ConvertOnHost(back.data(), DType::kF32, half.data(), DType::kF16, src.size()));
  for (size_t i = 0; i < src.size(); ++i) EXPECT_EQ(back[i], F16ToF32(half[i]));
  std::vector<float> copy(src.size());
  ASSERT_TRUE(ConvertOnHost(copy.data(), DType::kF32, src.data(), DType::kF32, src.size()));
  EXPECT_EQ(copy, src);
  EXPECT_FALSE(ConvertOnHost(back.data(), DType::kF32, src.data(), DType::kI32, src.size()));
  EXPECT_FALSE(ConvertOnHost(back.data(), DType::kI32, src.data(), DType::kF32, src.size()));
}

// safetensors does not align tensor data: a checkpoint's F32 tensor can start at an odd offset of
// the mapped file. Reading it through a float* was undefined behaviour (UBSan, tools/ci/sanitize.sh).
TEST(ConvertOnHostTest, AcceptsMisalignedPointers) {
  const std::vector<float> src = {1.0f, -2.5f, 0.1f};
  for (DType from : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (DType to : {DType::kF32, DType::kF16, DType::kBF16}) {
      std::vector<uint8_t> in(1 + src.size() * 4), out(1 + src.size() * 4);
      std::vector<uint8_t> packed(src.size() * DTypeSize(from));
      ASSERT_TRUE(ConvertOnHost(packed.data(), from, src.data(), DType::kF32, src.size()));
      std::memcpy(in.data() + 1, packed.data(), packed.size());
      ASSERT_TRUE(ConvertOnHost(out.data() + 1, to, in.data() + 1, from, src.size()));
      std::vector<uint8_t> expected(src.size() * DTypeSize(to));
      ASSERT_TRUE(ConvertOnHost(expected.data(), to, packed.data(), from, src.size()));
      EXPECT_EQ(0, std::memcmp(out.data() + 1, expected.data(), expected.size()))
          << DTypeName(from) << " -> " << DTypeName(to);
    }
  }
}

// ---- Backend basics --------------------------------------------------------------------------

TEST_F(CpuBackendTest, DescribesItselfAndAllocatesAligned) {
  EXPECT_EQ(backend_->device_kind(), DeviceKind::kCpu);
  EXPECT_EQ(backend_->act_dtype(), DType::kF32);
  EXPECT_NE(backend_->Describe().find("f32 products"), std::string::npos) << backend_->Describe();
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{100}, size_t{4096}}) {
    absl::StatusOr<Buffer> b = backend_->Allocate(bytes);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_NE(b->data(), nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % 64, 0u) << bytes;
    EXPECT_EQ(b->bytes(), bytes);
  }
}

// A buffer of 2 MiB or more starts on a 2 MiB boundary and is marked for transparent huge pages
// (MADV_HUGEPAGE): where the kernel's THP mode is "always" or "madvise", /proc/self/smaps shows the
// mapping that holds it as THPeligible (whether the pages are huge then depends on free memory; the
// flag does not). Its bytes are all usable and kept.
TEST_F(CpuBackendTest, LargeBuffersAskForHugePages) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t bytes = 3 * kHuge + 1000;
  absl::StatusOr<Buffer> b = backend_->Allocate(bytes);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % kHuge, 0u);
  auto* p = static_cast<unsigned char*>(b->data());
  for (size_t i = 0; i < bytes; i += 4096) p[i] = static_cast<unsigned char>(i / 4096);
  p[bytes - 1] = 7;
  for (size_t i = 0; i < bytes; i += 4096) ASSERT_EQ(p[i], static_cast<unsigned char>(i / 4096)) << i;
  ASSERT_EQ(p[bytes - 1], 7);
  std::ifstream mode_file("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string mode((std::istreambuf_iterator<char>(mode_file)), std::istreambuf_iterator<char>());
  if (mode.find("[always]") == std::string::npos && mode.find("[madvise]") == std::string::npos) {
    GTEST_SKIP() << "transparent huge pages are off on this machine (" << mode << ")";
  }
  std::ifstream smaps("/proc/self/smaps");
  ASSERT_TRUE(smaps.is_open());
  const auto at = reinterpret_cast<uintptr_t>(b->data());
  std::string line;
  bool inside = false, found = false;
  while (std::getline(smaps, line)) {
    uintptr_t start = 0, end = 0;
    char dash = 0;
    std::istringstream header(line);
    if (header >> std::hex >> start >> dash >> end && dash == '-' && line.find(':') > line.find(' ')) {
      inside = start <= at && at < end;  // a mapping's first line: "start-end perms offset ..."
      continue;
    }
    if (inside && line.rfind("THPeligible:", 0) == 0) {
      found = true;
      EXPECT_NE(line.find('1'), std::string::npos) << line;
    }
  }
  EXPECT_TRUE(found) << "no THPeligible line for the buffer's mapping in /proc/self/smaps";
}

// ---- MatMul ----------------------------------------------------------------------------------

// MakeCpuBackend(threads) sets how many threads that backend's matrix products use (OpenMP's,
// per backend); 0 takes OpenMP's default. Describe() reports it, as the worker's load log shows.
TEST_F(CpuBackendTest, ThreadsOptionSetsTheMatMulThreads) {
  const auto threads_of = [](const Backend& b) {  // "cpu (<products>, N threads)"
    const std::string d = b.Describe();
    const size_t comma = d.rfind(", ");
    return comma == std::string::npos ? -1 : std::atoi(d.c_str() + comma + 2);
  };
  const int original = threads_of(*backend_);
  EXPECT_GT(original, 0) << backend_->Describe();
  EXPECT_EQ(threads_of(*MakeCpuBackend(1)), 1);
  EXPECT_EQ(threads_of(*MakeCpuBackend(3)), 3);
  EXPECT_EQ(threads_of(*MakeCpuBackend(0)), original);
  EXPECT_EQ(threads_of(*backend_), original);  // others' settings do not change this one's
}

// x [n, k] @ w[m, k]^T (+ b) in double.
std::vector<double> MatMulReference(const std::vector<float>& x, const std::vector<float>& w,
                                    const std::vector<float>* b, int64_t n, int64_t k, int64_t m) {
  std::vector<double> want(n * m);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < m; ++j) {
      double s = b != nullptr ? (*b)[j] : 0.0;
      for (int64_t l = 0; l < k; ++l) s += static_cast<double>(x[i * k + l]) * w[j * k + l];
      want[i * m + j] = s;
    }
  }
  return want;
}

TEST_F(CpuBackendTest, MatMul) {
  struct Case {
    int64_t n, k, m;
    bool bias;
  };
  const Case cases[] = {{1, 64, 1, false},  {3, 64, 5, true},    {7, 129, 33, true},
                        {16, 16, 16, false}, {5, 17, 300, true}, {33, 300, 7, false}};
  for (const Case& c : cases) {
    const std::string what = absl::StrCat("MatMul n=", c.n, " k=", c.k, " m=", c.m, c.bias ? " +bias" : "");
    const std::vector<float> x = Random(rng_, c.n * c.k), w = Random(rng_, c.m * c.k), b = Random(rng_, c.m);
    DeviceTensor dx = F32({c.n, c.k}, x), dw = F32({c.m, c.k}, w), db = F32({c.m}, b);
    DeviceTensor out = Output(DType::kF32, {c.n, c.m});
    ASSERT_TRUE(backend_->MatMul(out.ptr(), dx.t(), dw.t(), c.bias ? &db.t() : nullptr).ok()) << what;

    const std::vector<double> want = MatMulReference(x, w, c.bias ? &b : nullptr, c.n, c.k, c.m);
    // A float32 sum of k <= 300 products of values in [-1, 1] rounds each partial sum (size
    // ~sqrt(k)/3) by up to 2^-24 of itself; as a random walk over k additions that is
    // ~k * 2^-24 / 3 = 6e-6 absolute, against max|out| ~ sqrt(k) = 17: a few 1e-7 normalized.
    // (The worst case, all roundings aligned, is ~8e-5.) 1e-5 leaves a wide margin and still
    // catches any indexing bug, whose error is O(1).
    ExpectClose(what, out.Download<float>(), want, 1e-5);
    EXPECT_TRUE(out.GuardsIntact()) << what;
  }
}

// Backend::MatMuls (the base, which the CPU backend keeps): each product as MatMul gives it, bit
// for bit, in order; a bad product is MatMul's error, and the products before it are done.
TEST_F(CpuBackendTest, MatMulsGiveEachProductAsMatMulDoes) {
  const int64_t n = 3, k = 40;
  const std::vector<float> x = Random(rng_, n * k);
  DeviceTensor dx = F32({n, k}, x);
  const int64_t ms[] = {17, 5, 5};
  std::vector<DeviceTensor> ws, bs, outs, singles;
  for (const int64_t m : ms) {
    ws.push_back(F32({m, k}, Random(rng_, m * k)));
    bs.push_back(F32({m}, Random(rng_, m)));
    outs.push_back(Output(DType::kF32, {n, m}));
    singles.push_back(Output(DType::kF32, {n, m}));
  }
  const MatMulProduct products[] = {{outs[0].ptr(), &ws[0].t(), &bs[0].t()},
                                    {outs[1].ptr(), &ws[1].t(), nullptr},
                                    {outs[2].ptr(), &ws[2].t(), &bs[2].t()}};
  ASSERT_TRUE(backend_->MatMuls(dx.t(), products).ok());
  for (size_t p = 0; p < 3; ++p) {
    ASSERT_TRUE(backend_->MatMul(singles[p].ptr(), dx.t(), ws[p].t(), products[p].bias).ok());
    EXPECT_EQ(outs[p].Download<float>(), singles[p].Download<float>()) << "product " << p;
  }
  // The second product's weight has the wrong k: MatMul's error; the first was computed, the third not.
  DeviceTensor bad_w = F32({5, k + 1}, Random(rng_, 5 * (k + 1)));
  DeviceTensor first = Output(DType::kF32, {n, 17}), third = Output(DType::kF32, {n, 5});
  const std::vector<uint32_t> third_before = third.Download<uint32_t>();  // the poison (NaN) bits
  const MatMulProduct bad[] = {{first.ptr(), &ws[0].t(), &bs[0].t()}, {outs[1].ptr(), &bad_w.t(), nullptr},
                               {third.ptr(), &ws[2].t(), nullptr}};
  const absl::Status st = backend_->MatMuls(dx.t(), bad);
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_EQ(first.Download<float>(), singles[0].Download<float>());
  EXPECT_EQ(third.Download<uint32_t>(), third_before);
  const MatMulProduct null_w[] = {{first.ptr(), nullptr, nullptr}};
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->MatMuls(dx.t(), null_w)));
}

// GateUpSilu (the base: MatMuls into gate and up, then SiluMul into gate) gives gate the bits of
// those calls; a product's error is MatMul's, and null outputs are refused.
TEST_F(CpuBackendTest, GateUpSiluIsMatMulsThenSiluMul) {
  const int64_t n = 3, k = 40, f = 13;
  DeviceTensor dx = F32({n, k}, Random(rng_, n * k));
  DeviceTensor gw = F32({f, k}, Random(rng_, f * k)), uw = F32({f, k}, Random(rng_, f * k));
  DeviceTensor gate = Output(DType::kF32, {n, f}), up = Output(DType::kF32, {n, f});
  ASSERT_TRUE(backend_->GateUpSilu(gate.ptr(), up.ptr(), dx.t(), gw.t(), uw.t()).ok());
  DeviceTensor want_gate = Output(DType::kF32, {n, f}), want_up = Output(DType::kF32, {n, f});
  ASSERT_TRUE(backend_->MatMul(want_gate.ptr(), dx.t(), gw.t(), nullptr).ok());
  ASSERT_TRUE(backend_->MatMul(want_up.ptr(), dx.t(), uw.t(), nullptr).ok());
  EXPECT_NE(gate.Download<float>(), want_gate.Download<float>()) << "SiluMul did not run";
  ASSERT_TRUE(backend_->SiluMul(want_gate.ptr(), want_gate.t(), want_up.t()).ok());
  EXPECT_EQ(gate.Download<float>(), want_gate.Download<float>());
  DeviceTensor bad_w = F32({f, k + 1}, Random(rng_, f * (k + 1)));
  const absl::Status st = backend_->GateUpSilu(gate.ptr(), up.ptr(), dx.t(), gw.t(), bad_w.t());
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->GateUpSilu(nullptr, up.ptr(), dx.t(), gw.t(), uw.t())));
}

float RoundToBf16(float f) { return Bf16ToF32(F32ToBf16(f)); }

// The tests below run once per CpuMatMul (named F32 and BF16); the BF16 ones report themselves
// skipped only where CPUID shows no AVX-512 and the backend refuses bf16 as documented; where the
// CPU has AVX-512, a refusal fails them (bf16_products.h).
class CpuProductsTest : public CpuBackendTest, public ::testing::WithParamInterface<CpuMatMul> {
 protected:
  void SetUp() override {
    if (GetParam() == CpuMatMul::kBF16 && !CpuRunsBf16Products()) GTEST_SKIP() << kNoBf16Products;
  }
  bool bf16() const { return GetParam() == CpuMatMul::kBF16; }
};

// PackMatMulWeight repacks (a different copy, not a view of w: float32 panels, or oneDNN's
// blocked bf16 layout), and MatMul with the packed weight gives the same products for any row
// count, bias or not, after the plain weight is gone. With bf16 products the weight is stored in
// bf16 (a BF16 tensor, half the bytes) and each product is the float32 sum of the bf16-rounded
// inputs' products: the same check, against the reference of the rounded inputs.
TEST_P(CpuProductsTest, MatMulWithPackedWeight) {
  struct Case {
    int64_t k, m;
  };
  const bool bf16 = this->bf16();
  std::unique_ptr<Backend> backend = MakeCpuBackend(0, GetParam());
  auto rounded = [bf16](std::vector<float> v) {
    if (bf16) std::transform(v.begin(), v.end(), v.begin(), RoundToBf16);
    return v;
  };
  for (const Case& c : {Case{64, 1}, Case{129, 33}, Case{17, 300}, Case{300, 7}, Case{768, 256}}) {
    const std::vector<float> w = Random(rng_, c.m * c.k), b = Random(rng_, c.m);
    Tensor packed;
    Buffer packed_buffer;
    {
      DeviceTensor dw(backend.get(), DType::kF32, {c.m, c.k});
      dw.Upload(w);
      absl::StatusOr<Buffer> buffer = backend->PackMatMulWeight(dw.t(), &packed);
      ASSERT_TRUE(buffer.ok()) << buffer.status();
      ASSERT_NE(buffer->data(), nullptr);
      EXPECT_EQ(packed.data, buffer->data());
      EXPECT_EQ(packed.dtype, bf16 ? DType::kBF16 : DType::kF32);
      EXPECT_EQ(packed.dim(0), c.m);
      EXPECT_EQ(packed.dim(1), c.k);
      if (c.m % 64 == 0 && c.k % 64 == 0) {  // else padded to whole panels or blocks
        EXPECT_EQ(buffer->bytes(), static_cast<size_t>(c.m * c.k) * (bf16 ? 2 : 4));
      }
      packed_buffer = std::move(*buffer);
      dw.Poison();  // and then freed: MatMul must read only the packed copy
    }
    DeviceTensor db(backend.get(), DType::kF32, {c.m});
    db.Upload(b);
    const std::vector<float> w_used = rounded(w);
    for (int64_t n : {1, 3, 16, 17, 64, 300}) {
      for (bool bias : {false, true}) {
        const std::string what = absl::StrCat(bf16 ? "bf16" : "packed", " MatMul n=", n, " k=", c.k, " m=", c.m,
                                              bias ? " +bias" : "");
        const std::vector<float> x = Random(rng_, n * c.k);
        DeviceTensor dx(backend.get(), DType::kF32, {n, c.k});
        dx.Upload(x);
        DeviceTensor out(backend.get(), DType::kF32, {n, c.m});
        out.Poison();
        ASSERT_TRUE(backend->MatMul(out.ptr(), dx.t(), packed, bias ? &db.t() : nullptr).ok()) << what;
        // As for plain MatMul (above): k <= 768 terms in [-1, 1], float accumulation.
        ExpectClose(what, out.Download<float>(), MatMulReference(rounded(x), w_used, bias ? &b : nullptr, n, c.k, c.m),
                    1e-5);
        EXPECT_TRUE(out.GuardsIntact()) << what;
      }
    }
  }
}

// Continuous batching relies on this (tests/batching_test.cc): a row's product is bitwise the
// same whatever other rows share the call, for any row count and on any number of threads, by a
// packed weight and (float32 products) by a plain one, which also gives bitwise the packed
// weight's results. The shapes: a mid-sized one, a small one (oneDNN's bf16 kernels for few rows
// of it summed differently), a long sum (k = 4096: its AMX kernel split k differently by row
// count), as the demo model's TP=2 slices and large models' down projections have, and one off
// every tile (m = 37: a part panel; k = 131: not whole 8 x 8 blocks of a plain w). oneDNN's own
// float32 matmul on AVX2 failed this at every row count tried, which is why panel_matmul.h exists.
TEST_P(CpuProductsTest, MatMulRowsDoNotDependOnTheBatch) {
  const int64_t rows = 300;
  for (auto [m, k] : {std::pair<int64_t, int64_t>{256, 768}, {32, 192}, {256, 4096}, {37, 131}}) {
    const std::vector<float> w = Random(rng_, m * k), x = Random(rng_, rows * k);
    for (int threads : {1, 2}) {
      std::unique_ptr<Backend> backend = MakeCpuBackend(threads, GetParam());
      DeviceTensor dw(backend.get(), DType::kF32, {m, k});
      dw.Upload(w);
      Tensor packed;
      absl::StatusOr<Buffer> buffer = backend->PackMatMulWeight(dw.t(), &packed);
      ASSERT_TRUE(buffer.ok()) << buffer.status();
      DeviceTensor all_x(backend.get(), DType::kF32, {rows, k});
      all_x.Upload(x);
      DeviceTensor all_out(backend.get(), DType::kF32, {rows, m});
      ASSERT_TRUE(backend->MatMul(all_out.ptr(), all_x.t(), packed, nullptr).ok());
      const std::vector<float> want = all_out.Download<float>();
      std::vector<std::pair<const char*, const Tensor*>> weights = {{"packed", &packed}};
      if (!bf16()) {  // bf16 products need a packed weight; float32 ones also take a plain one
        weights.push_back({"plain", &dw.t()});
        DeviceTensor plain_out(backend.get(), DType::kF32, {rows, m});
        ASSERT_TRUE(backend->MatMul(plain_out.ptr(), all_x.t(), dw.t(), nullptr).ok());
        EXPECT_TRUE(plain_out.Download<float>() == want)
            << "a plain w [" << m << ", " << k << "] gives other products than the packed one (" << threads
            << " threads)";
      }
      for (auto [layout, weight] : weights) {
        for (int64_t n : {1, 2, 5, 7, 16, 31, 64, 129}) {
          for (int64_t first : {int64_t{0}, rows - n}) {  // rows [first, first + n) alone
            DeviceTensor part_out(backend.get(), DType::kF32, {n, m});
            ASSERT_TRUE(backend->MatMul(part_out.ptr(), all_x.t().Rows(first, first + n), *weight, nullptr).ok());
            const std::vector<float> got = part_out.Download<float>();
            EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin() + first * m))
                << "rows " << first << ".." << first + n << " alone differ from the same rows in a batch of " << rows
                << " (" << layout << " w [" << m << ", " << k << "], " << threads << " threads, "
                << (bf16() ? "bf16" : "f32") << " products)";
          }
        }
      }
    }
  }
}

// The float32 panels' two tile families (kernels/cpu/panel_matmul.h): the AVX-512 tiles (from 4
// rows, one zmm per panel per row, 2 to 4 panels at a time; and up to 3 rows by a plain w, read
// as it is, 16 x 16 blocks transposed in registers) give bitwise what the 8-float ones give, on
// the same inputs, for every row count 1..64 (every tile shape and split of rows into tiles, with
// and without the one-thread prefetch), by a packed and a plain w, bias or not, at shapes off every
// tile (m not a multiple of 16 nor of a group of panels, k odd, k = 1, k not whole 16 x 16
// blocks), and write nothing past y. Skipped (and reported so) where the CPU has no AVX-512.
TEST(PanelTilesTest, Avx512TilesGiveTheVec8TilesResultsBitwise) {
  if (!cpu::PanelTilesSupported(cpu::PanelTiles::kAvx512)) GTEST_SKIP() << "this CPU lacks AVX-512F";
  std::mt19937 rng(41);
  constexpr size_t kGuard = 64;
  constexpr float kSentinel = -12345.0f;
  std::vector<float> scratch;
  for (auto [m, k] : {std::pair<int64_t, int64_t>{37, 131}, {100, 1}, {16, 7}, {300, 64}, {5, 33}}) {
    const std::vector<float> w = Random(rng, m * k), b = Random(rng, m), x = Random(rng, 64 * k);
    std::vector<float> packed(cpu::PanelMatMulFloats(m, k));
    cpu::PackPanels(packed.data(), w.data(), m, k);
    for (int threads : {1, 2}) {
      for (bool plain : {false, true}) {
        for (bool bias : {false, true}) {
          for (int64_t n = 1; n <= 64; ++n) {
            std::vector<float> got[2];
            for (cpu::PanelTiles tiles : {cpu::PanelTiles::kVec8, cpu::PanelTiles::kAvx512}) {
              std::vector<float>& y = got[static_cast<int>(tiles)];
              y.assign(n * m + kGuard, kSentinel);
              cpu::SetPanelTilesOverride(tiles);
              cpu::PanelMatMul(y.data(), x.data(), n, m, k, plain ? w.data() : packed.data(), plain,
                               bias ? b.data() : nullptr, threads, &scratch);
            }
            cpu::SetPanelTilesOverride(std::nullopt);
            const std::string what = absl::StrCat("n=", n, " m=", m, " k=", k, plain ? " plain" : " packed",
                                                  bias ? " +bias" : "", " threads=", threads);
            EXPECT_TRUE(std::all_of(got[1].end() - kGuard, got[1].end(), [&](float v) { return v == kSentinel; }))
                << what << ": the AVX-512 tiles wrote past y";
            EXPECT_TRUE(std::none_of(got[1].begin(), got[1].end() - kGuard, [&](float v) { return v == kSentinel; }))
                << what << ": the AVX-512 tiles left outputs unwritten";
            EXPECT_EQ(std::memcmp(got[0].data(), got[1].data(), got[0].size() * sizeof(float)), 0)
                << what << ": the AVX-512 tiles' products differ from the 8-float tiles'";
          }
        }
      }
    }
  }
}

// A product on narrow panels against the float32 panels, bitwise: for shapes off every tile (m not a
// multiple of 16 nor of 4 panels, k odd, k = 1), 1 and 2 threads, bias or not, every row count
// 1..40 (the few-rows tiles of 1 to 3 rows, the tiles of up to 6, the one-thread prefetch from 7 to
// 24 rows), `got` writes y [n, m] and nothing past it, and equals `want`. `pack(m, k)` is called
// first for each shape and packs the weights that both read.
using PanelProductFn = std::function<void(float* y, const float* x, int64_t n, int64_t m, int64_t k,
                                          const float* bias, int threads)>;
void ExpectPanelsBitwise(std::mt19937& rng, const char* panels, const std::function<void(int64_t, int64_t)>& pack,
                         const PanelProductFn& want, const PanelProductFn& got) {
  constexpr size_t kGuard = 64;
  constexpr float kSentinel = -12345.0f;
  for (auto [m, k] : {std::pair<int64_t, int64_t>{37, 131}, {100, 1}, {16, 7}, {300, 64}, {5, 33}, {72, 768}}) {
    pack(m, k);
    const std::vector<float> b = Random(rng, m), x = Random(rng, 40 * k);
    for (int threads : {1, 2}) {
      for (bool bias : {false, true}) {
        for (int64_t n = 1; n <= 40; ++n) {
          std::vector<float> y_want(n * m), y_got(n * m + kGuard, kSentinel);
          want(y_want.data(), x.data(), n, m, k, bias ? b.data() : nullptr, threads);
          got(y_got.data(), x.data(), n, m, k, bias ? b.data() : nullptr, threads);
          const std::string what =
              absl::StrCat(panels, " n=", n, " m=", m, " k=", k, bias ? " +bias" : "", " threads=", threads);
          EXPECT_TRUE(std::all_of(y_got.end() - kGuard, y_got.end(), [&](float v) { return v == kSentinel; }))
              << what << ": wrote past y";
          EXPECT_EQ(std::memcmp(y_want.data(), y_got.data(), y_want.size() * sizeof(float)), 0)
              << what << ": differ from the float32 panels'";
        }
      }
    }
  }
}

// The bf16 panels (kernels/cpu/panel_matmul.h's PackPanelsBf16 / PanelMatMulBf16, the CPU
// backend's bf16 products where oneDNN has none): bitwise the float32 panels' products by the
// weight rounded to bf16 (to nearest even), and half their bytes. Runs on every CPU.
TEST(PanelTilesTest, Bf16PanelsGiveTheF32PanelsResultsOnTheRoundedWeight) {
  std::mt19937 rng(43);
  std::vector<float> packed, scratch;
  std::vector<uint16_t> packed_bf16;  // half the float32 panels' bytes
  ExpectPanelsBitwise(
      rng, "bf16 panels",
      [&](int64_t m, int64_t k) {
        const std::vector<float> w = Random(rng, m * k);
        std::vector<float> rounded(w.size());
        std::transform(w.begin(), w.end(), rounded.begin(), [](float v) { return Bf16ToF32(F32ToBf16(v)); });
        packed.assign(cpu::PanelMatMulFloats(m, k), 0);
        cpu::PackPanels(packed.data(), rounded.data(), m, k);
        packed_bf16.assign(cpu::PanelMatMulFloats(m, k), 0);
        cpu::PackPanelsBf16(packed_bf16.data(), w.data(), m, k);
      },
      [&](float* y, const float* x, int64_t n, int64_t m, int64_t k, const float* bias, int threads) {
        cpu::PanelMatMul(y, x, n, m, k, packed.data(), /*plain=*/false, bias, threads, &scratch);
      },
      [&](float* y, const float* x, int64_t n, int64_t m, int64_t k, const float* bias, int threads) {
        cpu::PanelMatMulBf16(y, x, n, m, k, packed_bf16.data(), bias, threads);
      });
}

// The one-byte panels (PackPanelsBytes; PanelMatMulInt8 and PanelMatMulFp8, the CPU backend's int8
// products on AVX2 and AVX-512 CPUs and its fp8 ones on AVX-512 CPUs), each instance (int8: the
// 8-float tiles, and the 16-float ones where the CPU has AVX-512; fp8: the 16-float ones): bitwise
// the float32 panels' sums by the codes' values as floats (every int8; every e4m3 byte but the NaN
// ones, which loaders refuse, subnormals included), each times its column's scale (+ bias, one fused
// multiply-add), at 1 to 40 rows (every tile shape) and panels left over. Skipped (and reported so)
// where the CPU lacks AVX2 and FMA.
TEST(PanelTilesTest, BytePanelsGiveTheF32PanelsSumsOfTheCodesScaled) {
  if (!cpu::QuantIsaSupported(cpu::QuantIsa::kAvx2)) GTEST_SKIP() << "this CPU lacks AVX2 and FMA";
  for (bool fp8 : {false, true}) {
    for (cpu::PanelTiles tiles : {cpu::PanelTiles::kVec8, cpu::PanelTiles::kAvx512}) {
      if (!cpu::PanelTilesSupported(tiles) || (fp8 && tiles != cpu::PanelTiles::kAvx512)) continue;
      std::mt19937 rng(47);
      std::vector<float> packed, scale, scratch;
      std::vector<uint8_t> packed_bytes;  // a quarter of the float32 panels' bytes
      const std::string name = absl::StrCat(fp8 ? "fp8" : "int8", " panels, ",
                                            tiles == cpu::PanelTiles::kAvx512 ? "16" : "8", "-float tiles");
      ExpectPanelsBitwise(
          rng, name.c_str(),
          [&](int64_t m, int64_t k) {
            std::vector<uint8_t> q(m * k);
            std::vector<float> values(m * k);
            std::uniform_int_distribution<int> byte(0, 255);
            for (int64_t i = 0; i < m * k; ++i) {
              do {
                q[i] = static_cast<uint8_t>(byte(rng));
              } while (fp8 && Fp8E4m3IsNan(q[i]));
              values[i] = fp8 ? Fp8E4m3ToFloat(q[i]) : static_cast<float>(static_cast<int8_t>(q[i]));
            }
            scale = Random(rng, m);
            packed.assign(cpu::PanelMatMulFloats(m, k), 0);
            cpu::PackPanels(packed.data(), values.data(), m, k);
            packed_bytes.assign(cpu::PanelMatMulFloats(m, k), 0);
            cpu::PackPanelsBytes(packed_bytes.data(), q.data(), m, k);
          },
          [&](float* y, const float* x, int64_t n, int64_t m, int64_t k, const float* bias, int threads) {
            cpu::PanelMatMul(y, x, n, m, k, packed.data(), /*plain=*/false, nullptr, threads, &scratch);
            for (int64_t i = 0; i < n * m; ++i) {
              y[i] = bias != nullptr ? std::fma(y[i], scale[i % m], bias[i % m]) : y[i] * scale[i % m];
            }
          },
          [&](float* y, const float* x, int64_t n, int64_t m, int64_t k, const float* bias, int threads) {
            if (fp8) {
              cpu::PanelMatMulFp8(y, x, n, m, k, packed_bytes.data(), scale.data(), bias, threads);
            } else {
              cpu::PanelMatMulInt8(y, x, n, m, k, packed_bytes.data(), scale.data(), bias, threads, tiles);
            }
          });
    }
  }
}

// Random e4m3 codes (no NaN bytes, which loaders refuse; subnormals and +-448 included) with
// input-group scales [m, G] (G = Fp8RowsLayout{m, k, group}.groups_per_row()), positive and
// negative, of several magnitudes; and their reference weights (DequantizeFp8Groups).
struct Fp8GroupWeight {
  std::vector<uint8_t> q;
  std::vector<float> scale, dequantized;
};
Fp8GroupWeight RandomFp8GroupWeight(std::mt19937& rng, int64_t m, int64_t k, int64_t group) {
  Fp8GroupWeight w;
  const int64_t groups = Fp8RowsLayout{m, k, group}.groups_per_row();
  std::uniform_int_distribution<int> byte(0, 255);
  w.q.resize(m * k);
  for (uint8_t& v : w.q) {
    do {
      v = static_cast<uint8_t>(byte(rng));
    } while (Fp8E4m3IsNan(v));
  }
  w.scale = Random(rng, m * groups, 1e-4f, 2e-2f);
  for (size_t i = 0; i < w.scale.size(); i += 3) w.scale[i] = -w.scale[i];
  w.dequantized.resize(m * k);
  DequantizeFp8Groups(w.dequantized.data(), w.scale.data(), w.q.data(), m, k, group);
  return w;
}

// Random MXFP4 weights (kernels/quant.h Mxfp4RowsLayout): every code (both nibbles), scale bytes
// around 127 (2^-10 .. 2^10), and edge blocks: byte 0 (2^-127, a float32 subnormal), 1, and with
// `large` 252 and 253 / 254 on codes they keep finite (magnitude below 4 / 2; sums by such weights
// overflow to infinities, the same ones in the reference); and their reference weights
// (DequantizeMxfp4Rows).
struct Mxfp4Weight {
  std::vector<uint8_t> stored;
  std::vector<float> dequantized;
};
Mxfp4Weight RandomMxfp4Weight(std::mt19937& rng, int64_t m, int64_t k, bool large = true) {
  const Mxfp4RowsLayout layout{m, k};
  Mxfp4Weight w;
  w.stored.resize(static_cast<size_t>(layout.bytes()));
  std::uniform_int_distribution<int> byte(0, 255), near(117, 137);
  for (int64_t i = 0; i < layout.code_bytes(); ++i) w.stored[i] = static_cast<uint8_t>(byte(rng));
  uint8_t* scales = w.stored.data() + layout.code_bytes();
  const uint8_t edges[] = {0, 1, 252, 253, 254};
  for (int64_t b = 0; b < layout.scale_bytes(); ++b) {
    scales[b] = b % 7 == 3 ? edges[(b / 7) % (large ? 5 : 2)] : static_cast<uint8_t>(near(rng));
    uint8_t* codes = w.stored.data() + b * kMxfp4BlockBytes;
    if (scales[b] >= 253) {  // keep the block's magnitudes below what its scale carries past float32
      for (int64_t j = 0; j < kMxfp4BlockBytes; ++j) codes[j] &= scales[b] == 254 ? 0xBB : 0xDD;
    }
  }
  w.dequantized.resize(static_cast<size_t>(m * k));
  DequantizeMxfp4Rows(w.dequantized.data(), w.stored.data(), m, k);
  return w;
}

// Each output of a product by dequantized weights as the float32 panels sum it (panel_matmul.h):
// one chain over k in order from zero, a fused multiply-add per input (`fused`; else a multiply
// and an add, baseline x86-64's), the bias added to the finished sum.
std::vector<float> PanelChains(const std::vector<float>& x, const std::vector<float>& w, const float* bias, int64_t n,
                               int64_t k, int64_t m, bool fused) {
  std::vector<float> y(static_cast<size_t>(n * m));
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t r = 0; r < m; ++r) {
      float acc = 0.0f;
      for (int64_t c = 0; c < k; ++c) {
        if (fused) {
          acc = std::fma(w[r * k + c], x[i * k + c], acc);
        } else {
          const float p = w[r * k + c] * x[i * k + c];
          acc = acc + p;
        }
      }
      y[i * m + r] = bias != nullptr ? acc + bias[r] : acc;
    }
  }
  return y;
}

// fp8 with input-group scales on the one-byte panels (PackPanelScales, PanelMatMulFp8Groups: an FP8
// checkpoint's block scales on an AVX-512 CPU): bitwise the float32 panels' products by the weights
// DequantizeFp8Groups gives (each code times its group's scale, rounded once, then the same chains,
// the bias added to the finished sum), for groups that are multiples of 8 and 16 (8, 16, 40, 128),
// one that is neither (3: supported by the kernel, not mapped by loaders) and one wider than some
// rows (k = 1, 7, 33 with group 40: one scale a row), at 1 to 40 rows. Skipped where the CPU lacks
// AVX-512F.
TEST(PanelTilesTest, Fp8GroupPanelsGiveTheF32PanelsResultsOnTheDequantizedWeights) {
  if (!cpu::PanelTilesSupported(cpu::PanelTiles::kAvx512)) GTEST_SKIP() << "this CPU lacks AVX-512F";
  for (int64_t group : {8, 16, 40, 128, 3}) {
    std::mt19937 rng(53 + static_cast<int>(group));
    std::vector<float> packed, scales, scratch;
    std::vector<uint8_t> packed_bytes;
    const std::string name = absl::StrCat("fp8 panels, groups of ", group);
    ExpectPanelsBitwise(
        rng, name.c_str(),
        [&](int64_t m, int64_t k) {
          const Fp8GroupWeight w = RandomFp8GroupWeight(rng, m, k, group);
          const int64_t groups = (k + group - 1) / group;
          packed.assign(cpu::PanelMatMulFloats(m, k), 0);
          cpu::PackPanels(packed.data(), w.dequantized.data(), m, k);
          packed_bytes.assign(cpu::PanelMatMulFloats(m, k), 0);
          cpu::PackPanelsBytes(packed_bytes.data(), w.q.data(), m, k);
          scales.assign(cpu::PanelScaleFloats(m, groups), 0);
          cpu::PackPanelScales(scales.data(), w.scale.data(), m, groups);
        },
        [&](float* y, const float* x, int64_t n, int64_t m, int64_t k, const float* bias, int threads) {
          cpu::PanelMatMul(y, x, n, m, k, packed.data(), /*plain=*/false, bias, threads, &scratch);
        },
        [&](float* y, const float* x, int64_t n, int64_t m, int64_t k, const float* bias, int threads) {
          cpu::PanelMatMulFp8Groups(y, x, n, m, k, packed_bytes.data(), scales.data(), group, bias, threads);
        });
  }
}

// w [m, k] in bf16_matmul.h's layout (oneDNN's "BA16a64b2a" of the [k, m] weights), rounded to bf16
// to nearest even as oneDNN's reorder rounds: what oneDNN packs on AVX-512 BF16 without AMX, written
// here so that the kernel is checked on every CPU that runs it, whatever layout oneDNN picks there
// (with AMX, 48 columns a block at m = 77, say).
std::vector<uint16_t> PackBf16Blocked(const std::vector<float>& w, int64_t m, int64_t k) {
  const int64_t padded_k = (k + cpu::kBf16BlockInputs - 1) / cpu::kBf16BlockInputs * cpu::kBf16BlockInputs;
  const int64_t blocks = (m + cpu::kBf16BlockColumns - 1) / cpu::kBf16BlockColumns;
  std::vector<uint16_t> packed(static_cast<size_t>(blocks * padded_k * cpu::kBf16BlockColumns), 0);
  for (int64_t col = 0; col < m; ++col) {
    const int64_t b = col / cpu::kBf16BlockColumns, c = col % cpu::kBf16BlockColumns;
    for (int64_t i = 0; i < k; ++i) {
      packed[static_cast<size_t>(b * cpu::kBf16BlockColumns * padded_k + (i / 2) * 2 * cpu::kBf16BlockColumns +
                                 2 * c + i % 2)] = F32ToBf16(w[static_cast<size_t>(col * k + i)]);
    }
  }
  return packed;
}

// The backend's bf16 products (oneDNN's, and bf16_matmul.h's for few rows without AMX) against the
// float32 sum of the bf16-rounded operands' products, on backends of 1 and 2 threads, with two
// weights of each shape packed on threads whose OpenMP counts differ (1 and 2: a worker's loading
// thread holds whatever count it last set, and oneDNN's layout for a shape depends on it) and
// multiplied on yet another thread: every weight in whatever layout it got, a model's small shapes
// and others, 1 to 33 rows. (Once, a product made for one weight's layout served every weight of
// its shape: on an Intel Xeon with AMX the second layout's products were wrong.)
TEST_F(CpuBackendTest, Bf16ProductsEqualTheReferenceWhateverThreadPackedThem) {
  for (int threads : {1, 2}) {
    std::unique_ptr<Backend> backend = MakeCpuBackend(threads, CpuMatMul::kBF16);
    for (auto [m, k] : {std::pair<int64_t, int64_t>{64, 64}, {128, 64}, {64, 128}, {512, 64}, {200, 100}, {77, 300}}) {
      for (int packing_threads : {2, 1}) {
        const std::vector<float> w = Random(rng_, m * k);
        DeviceTensor dw(backend.get(), DType::kF32, {m, k});
        dw.Upload(w);
        Tensor packed;
        absl::StatusOr<Buffer> buffer;
        std::thread([&] {
          omp_set_num_threads(packing_threads);
          buffer = backend->PackMatMulWeight(dw.t(), &packed);
        }).join();
        ASSERT_TRUE(buffer.ok()) << buffer.status();
        std::vector<float> w_used = w;
        std::transform(w_used.begin(), w_used.end(), w_used.begin(), RoundToBf16);
        for (int64_t n : {1, 2, 5, 16, 17, 33}) {
          const std::string what = absl::StrCat("bf16 n=", n, " k=", k, " m=", m, ", ", threads,
                                                " threads, packed under an OpenMP count of ", packing_threads);
          std::vector<float> x = Random(rng_, n * k);
          std::vector<float> x_used = x;
          std::transform(x_used.begin(), x_used.end(), x_used.begin(), RoundToBf16);
          DeviceTensor dx(backend.get(), DType::kF32, {n, k});
          dx.Upload(x);
          DeviceTensor out(backend.get(), DType::kF32, {n, m});
          absl::Status st;
          std::thread([&] { st = backend->MatMul(out.ptr(), dx.t(), packed, nullptr); }).join();
          ASSERT_TRUE(st.ok()) << what << ": " << st;
          ExpectClose(what, out.Download<float>(), MatMulReference(x_used, w_used, nullptr, n, k, m), 1e-5);
        }
      }
    }
  }
}

// The bf16 product for few rows (kernels/cpu/bf16_matmul.h), which reads the weight in the blocked
// layout oneDNN picks for it without AMX, called directly on that layout (PackBf16Blocked) at every
// row count (so that it is checked beyond the rows the backend gives it), summing all inputs at once
// and in chunks of 64: the float32 sum of the bf16-rounded inputs' products (the reference, as
// MatMulWithPackedWeight).
// Through the backend, its default dispatch (that product up to Bf16BlockedRows rows, with the
// chunk it found for the weight) gives bitwise what oneDNN alone gives (Bf16BlockedRows 0), which
// MatMulRowsDoNotDependOnTheBatch relies on; for k <= 512 without AMX that is one chunk, the direct
// product's (with AMX the backend keeps every weight on oneDNN).
// Shapes whose m and k are not multiples of the layout's blocks (64 columns, 32 inputs), nor of the
// kernel's tiles (2 blocks, 4 rows), and a model's, on 1 and 2 threads.
TEST_F(CpuBackendTest, Bf16BlockedProductMatchesOneDnn) {
  if (!CpuHasBf16Instructions() || !cpu::CpuHasAvx512Bf16()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  struct Case {
    int64_t k, m;
  };
  for (int threads : {1, 2}) {
    std::unique_ptr<Backend> backend = MakeCpuBackend(threads, CpuMatMul::kBF16);
    EXPECT_NE(backend->Describe().find(cpu::OneDnnBf16UsesAmx() ? "amx" : "avx512-bf16"), std::string::npos)
        << backend->Describe();
    for (const Case& c : {Case{100, 200}, Case{300, 77}, Case{17, 129}, Case{768, 256}, Case{33, 1}}) {
      const std::vector<float> w = Random(rng_, c.m * c.k), b = Random(rng_, c.m);
      DeviceTensor dw(backend.get(), DType::kF32, {c.m, c.k});
      dw.Upload(w);
      Tensor packed;
      absl::StatusOr<Buffer> buffer = backend->PackMatMulWeight(dw.t(), &packed);
      ASSERT_TRUE(buffer.ok()) << buffer.status();
      DeviceTensor db(backend.get(), DType::kF32, {c.m});
      db.Upload(b);
      std::vector<float> w_used = w;
      std::transform(w_used.begin(), w_used.end(), w_used.begin(), RoundToBf16);
      const std::vector<uint16_t> blocked = PackBf16Blocked(w, c.m, c.k);
      for (int64_t n : {1, 2, 3, 4, 5, 16, 17}) {
        for (bool bias : {false, true}) {
          const std::string what = absl::StrCat("bf16 blocked n=", n, " k=", c.k, " m=", c.m, bias ? " +bias" : "",
                                                ", ", threads, " threads");
          const std::vector<float> x = Random(rng_, n * c.k);
          std::vector<float> x_used = x;
          std::transform(x_used.begin(), x_used.end(), x_used.begin(), RoundToBf16);
          const std::vector<double> want = MatMulReference(x_used, w_used, bias ? &b : nullptr, n, c.k, c.m);
          std::vector<float> one_chunk;
          for (int64_t chunk : {0, 64}) {
            std::vector<float> direct(static_cast<size_t>(n * c.m) + 16, -7.0f);  // 16 guards past the end
            cpu::Bf16BlockedMatMul(direct.data(), x.data(), n, c.m, c.k, blocked.data(), bias ? b.data() : nullptr,
                                   chunk, threads);
            EXPECT_TRUE(std::all_of(direct.end() - 16, direct.end(), [](float v) { return v == -7.0f; })) << what;
            direct.resize(static_cast<size_t>(n * c.m));
            // As MatMulWithPackedWeight: k <= 768 terms in [-1, 1], float accumulation.
            ExpectClose(absl::StrCat(what, " chunk ", chunk), direct, want, 1e-5);
            if (chunk == 0) one_chunk = direct;
          }
          DeviceTensor dx(backend.get(), DType::kF32, {n, c.k});
          dx.Upload(x);
          std::vector<std::vector<float>> outs;
          for (std::optional<int64_t> rows : {std::optional<int64_t>(0), std::optional<int64_t>(std::nullopt)}) {
            cpu::SetBf16BlockedRowsOverride(rows);
            DeviceTensor out(backend.get(), DType::kF32, {n, c.m});
            out.Poison();
            const absl::Status s = backend->MatMul(out.ptr(), dx.t(), packed, bias ? &db.t() : nullptr);
            cpu::SetBf16BlockedRowsOverride(std::nullopt);
            ASSERT_TRUE(s.ok()) << what << ": " << s;
            EXPECT_TRUE(out.GuardsIntact()) << what;
            outs.push_back(out.Download<float>());
          }
          EXPECT_TRUE(outs[0] == outs[1]) << what << ": the backend's default product differs from oneDNN's";
          // Without AMX, oneDNN's kernel sums all of k <= 512 at once, as the blocked product's one
          // chunk does; with AMX its tiles sum in their own order, and the backend keeps every
          // weight on oneDNN (outs[0] == outs[1] above).
          if (c.k <= 512 && !cpu::OneDnnBf16UsesAmx()) {
            EXPECT_TRUE(outs[0] == one_chunk) << what << ": oneDNN's product differs from the blocked one";
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Products, CpuProductsTest, ::testing::Values(CpuMatMul::kF32, CpuMatMul::kBF16),
                         [](const ::testing::TestParamInfo<CpuMatMul>& info) {
                           return info.param == CpuMatMul::kBF16 ? "BF16" : "F32";
                         });

// ---- int8 weights (kernels/quant.h, kernels/cpu/int8_matmul.h) ------------------------------

// The int8 and int4 quantizers' definitions (kernels/quant.h) written out one weight at a time with
// libm's rounding: the library's quantizers (8 weights at a time where they can, an inline rounding)
// must give exactly these bytes, on weights that reach every case: ties at half a step, subnormal
// and near-overflow magnitudes, all-zero and all-equal rows, signed zeros, row lengths that are and
// are not multiples of 8 and of 128.
std::vector<std::vector<float>> QuantizerCases() {
  std::mt19937 rng(41);
  std::vector<std::vector<float>> rows;
  for (float sigma : {1e-41f, 1e-30f, 1e-3f, 1.0f, 3e3f, 1e36f}) {
    std::normal_distribution<float> dist(0.0f, sigma);
    for (int64_t k : {1, 7, 8, 128, 200, 256, 300}) {
      std::vector<float> row(k);
      for (float& v : row) v = dist(rng);
      rows.push_back(row);
      for (float& v : row) v = std::fabs(v);  // all >= 0: int4's zero point 0
      rows.push_back(row);
    }
  }
  // Ties: int8 scale 15.875 / 127 = 2^-3 and int4 scale 1.875 / 15 = 2^-3 exactly, values j x 2^-4
  // (quotients j / 2), negated every third.
  for (float top : {15.875f, 1.875f}) {
    std::vector<float> row(256);
    for (int j = 0; j < 256; ++j) row[j] = static_cast<float>(j % 31) * 0.0625f * (j % 3 == 0 ? -1.0f : 1.0f);
    row[5] = top;
    if (top == 1.875f) {  // int4: keep the range [0, 1.875] in the first group
      for (float& v : row) v = std::fabs(v);
    }
    rows.push_back(row);
  }
  rows.push_back(std::vector<float>(256, 0.0f));
  rows.push_back(std::vector<float>(256, -0.0f));
  rows.push_back(std::vector<float>(200, 0.3f));
  rows.push_back(std::vector<float>(200, -2.5f));
  std::vector<float> extremes(128, 3.4e38f);
  for (size_t j = 0; j < extremes.size(); j += 2) extremes[j] = -3.4e38f;
  rows.push_back(extremes);
  return rows;
}

TEST(QuantizersTest, BytesEqualTheDefinitionWeightByWeight) {
  for (const std::vector<float>& row : QuantizerCases()) {
    const auto k = static_cast<int64_t>(row.size());
    // int8: scale max |w| / 127, q = clamp(round(w / scale), -127, 127), 0 where the scale is.
    float max_abs = 0;
    for (float v : row) max_abs = std::fmax(max_abs, std::fabs(v));
    const float scale8 = max_abs / 127.0f;
    std::vector<int8_t> want8(k);
    for (int64_t c = 0; c < k; ++c) {
      want8[c] = scale8 == 0 ? 0
                             : static_cast<int8_t>(std::fmax(-127.0f, std::fmin(127.0f, std::round(row[c] / scale8))));
    }
    float got_scale8 = -1;
    std::vector<int8_t> got8(k, 99);
    ASSERT_TRUE(QuantizeInt8Rows(&got_scale8, got8.data(), row.data(), 1, k).ok());
    EXPECT_EQ(got_scale8, scale8) << "k " << k << ", w[0] " << row[0];
    EXPECT_EQ(got8, want8) << "k " << k << ", w[0] " << row[0];
    // int4, per group of 128: the range widened to hold 0, scale hi / 15 - lo / 15, zero
    // clamp(round(-lo / scale), 0, 15), q = clamp(round(w / scale) + zero, 0, 15), nibbles as declared.
    const Int4GroupsLayout layout{1, k};
    std::vector<Int4Group128> want4(layout.groups_per_row()), got4(layout.groups_per_row());
    for (int64_t g = 0; g < layout.groups_per_row(); ++g) {
      const int64_t begin = g * kInt4GroupSize, end = std::min(k, begin + kInt4GroupSize);
      float lo = 0, hi = 0;
      for (int64_t c = begin; c < end; ++c) {
        lo = std::fmin(lo, row[c]);
        hi = std::fmax(hi, row[c]);
      }
      Int4Group128& b = want4[g];
      b = Int4Group128{};
      const float scale = hi / 15.0f - lo / 15.0f;
      if (!(scale > 0)) continue;
      b.scale = scale;
      b.zero = static_cast<uint8_t>(std::fmin(15.0f, std::fmax(0.0f, std::round(-lo / scale))));
      for (int64_t c = begin; c < end; ++c) {
        const auto q = static_cast<uint8_t>(std::fmin(15.0f, std::fmax(0.0f, std::round(row[c] / scale) + b.zero)));
        const int64_t j = c - begin;
        b.q[j % 64] |= static_cast<uint8_t>(j < 64 ? q : q << 4);
      }
    }
    std::memset(got4.data(), 0xA5, got4.size() * sizeof(Int4Group128));
    ASSERT_TRUE(QuantizeInt4Groups(got4.data(), row.data(), 1, k).ok());
    EXPECT_EQ(std::memcmp(got4.data(), want4.data(), want4.size() * sizeof(Int4Group128)), 0)
        << "k " << k << ", w[0] " << row[0] << ": scale " << got4[0].scale << " / " << want4[0].scale << ", zero "
        << int{got4[0].zero} << " / " << int{want4[0].zero};
  }
}

// The layout's reference: each value within half a step (scale / 2) of the weight, the largest
// magnitude of a row exactly +-127 steps, an all-zero row scale 0, a non-finite weight refused
// with its place named.
TEST(Int8QuantTest, QuantizeIsWithinHalfAStepAndDequantizeInverts) {
  std::mt19937 rng(11);
  const int64_t m = 5, k = 37;
  std::vector<float> w = Random(rng, m * k, -3.0f, 3.0f);
  std::fill(w.begin() + 2 * k, w.begin() + 3 * k, 0.0f);  // row 2: all zero
  std::vector<float> scale(m);
  std::vector<int8_t> q(m * k);
  ASSERT_TRUE(QuantizeInt8Rows(scale.data(), q.data(), w.data(), m, k).ok());
  std::vector<float> back(m * k);
  DequantizeInt8Rows(back.data(), scale.data(), q.data(), m, k);
  for (int64_t r = 0; r < m; ++r) {
    float max_abs = 0;
    int max_q = 0;
    for (int64_t c = 0; c < k; ++c) {
      max_abs = std::max(max_abs, std::fabs(w[r * k + c]));
      max_q = std::max(max_q, std::abs(static_cast<int>(q[r * k + c])));
      EXPECT_LE(std::fabs(back[r * k + c] - w[r * k + c]), scale[r] / 2 * (1 + 1e-6f)) << r << ", " << c;
      EXPECT_EQ(back[r * k + c], static_cast<float>(q[r * k + c]) * scale[r]);
    }
    EXPECT_FLOAT_EQ(scale[r], max_abs / 127) << "row " << r;
    EXPECT_EQ(max_q, r == 2 ? 0 : 127) << "row " << r;
  }
  w[3 * k + 4] = std::numeric_limits<float>::quiet_NaN();
  const absl::Status s = QuantizeInt8Rows(scale.data(), q.data(), w.data(), m, k);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("[3, 4]"), std::string::npos) << s;
  EXPECT_EQ(ParseWeightQuant("int8").value(), WeightQuant::kInt8);
  EXPECT_EQ(ParseWeightQuant("none").value(), WeightQuant::kNone);
  EXPECT_FALSE(ParseWeightQuant("int3").ok());
}

// The test parameter's name: "int8", "fp8", "int4".
std::string QuantParamName(const ::testing::TestParamInfo<WeightQuant>& info) { return WeightQuantName(info.param); }

// The quantized products' check through the backend: for each n in `batches`, with and without
// the bias b [m], MatMul by `packed` (a weight [m, k] in `quant`'s format) against the product by
// `dequantized` (the reference) within `limit`, on fresh inputs from `rng`; outputs start as NaN
// and their guards are checked. Reports through gtest: call it in ASSERT_NO_FATAL_FAILURE.
void ExpectQuantizedProducts(Backend* backend, std::mt19937& rng, WeightQuant quant, const Tensor& packed,
                             const std::vector<float>& dequantized, const std::vector<float>& b, int64_t k, int64_t m,
                             std::initializer_list<int64_t> batches, double limit) {
  DeviceTensor db(backend, DType::kF32, {m});
  db.Upload(b);
  for (int64_t n : batches) {
    for (bool bias : {false, true}) {
      const std::string what =
          absl::StrCat(WeightQuantName(quant), " MatMul n=", n, " k=", k, " m=", m, bias ? " +bias" : "");
      const std::vector<float> x = Random(rng, n * k);
      DeviceTensor dx(backend, DType::kF32, {n, k});
      dx.Upload(x);
      DeviceTensor out(backend, DType::kF32, {n, m});
      out.Poison();
      ASSERT_TRUE(backend->MatMul(out.ptr(), dx.t(), packed, bias ? &db.t() : nullptr).ok()) << what;
      ExpectClose(what, out.Download<float>(), MatMulReference(x, dequantized, bias ? &b : nullptr, n, k, m), limit);
      EXPECT_TRUE(out.GuardsIntact()) << what;
    }
  }
}

// A product by an int8 or fp8 weight equals the product by its dequantized weight (the
// reference): the kernel sums x x q (q an int8 or e4m3 code) in float32 and scales once, so it
// differs from the reference only by float32 rounding over k <= 768 terms (as the float32
// products: 1e-5). Tails of every size (k not a multiple of 8, m not of 4, odd n) and the bias are
// covered; outputs start as NaN and guards are checked. The packed weight is I8 with the format's
// quant, holds exactly the reference's scales and codes, and its bytes() are the layout's
// (Int8RowsLayout, Fp8RowsLayout: scales included).
class RowsQuantMatMulTest : public CpuBackendTest, public ::testing::WithParamInterface<WeightQuant> {};

TEST_P(RowsQuantMatMulTest, EqualsTheDequantizedProduct) {
  const WeightQuant quant = GetParam();
  const bool fp8 = quant == WeightQuant::kFp8;
  for (auto [k, m] : {std::pair<int64_t, int64_t>{64, 1}, {129, 33}, {17, 300}, {300, 7}, {768, 256}, {7, 5}}) {
    const std::vector<float> w = Random(rng_, m * k), b = Random(rng_, m);
    std::vector<float> scale(m);
    std::vector<uint8_t> q(m * k);  // int8 codes, or e4m3 ones
    std::vector<float> dequantized(m * k);
    if (fp8) {
      ASSERT_TRUE(QuantizeFp8Rows(scale.data(), q.data(), w.data(), m, k).ok());
      DequantizeFp8Rows(dequantized.data(), scale.data(), q.data(), m, k);
    } else {
      ASSERT_TRUE(QuantizeInt8Rows(scale.data(), reinterpret_cast<int8_t*>(q.data()), w.data(), m, k).ok());
      DequantizeInt8Rows(dequantized.data(), scale.data(), reinterpret_cast<const int8_t*>(q.data()), m, k);
    }
    Tensor packed;
    Buffer packed_buffer;
    {
      DeviceTensor dw(backend_.get(), DType::kF32, {m, k});
      dw.Upload(w);
      absl::StatusOr<Buffer> buffer = backend_->PackMatMulWeight(dw.t(), &packed, quant);
      ASSERT_TRUE(buffer.ok()) << buffer.status();
      EXPECT_EQ(packed.dtype, DType::kI8);
      EXPECT_EQ(packed.quant, quant);
      EXPECT_EQ(std::memcmp(buffer->data(), scale.data(), m * sizeof(float)), 0);
      const char* codes = static_cast<char*>(buffer->data()) + m * sizeof(float);
      if (fp8 ? cpu::Fp8OnPanels(cpu::ActiveQuantIsa()) : cpu::IntOnPanels(cpu::ActiveQuantIsa())) {
        // The codes as panels (kernels/cpu/panel_matmul.h), the last one padded to 16 rows.
        std::vector<uint8_t> panels(cpu::PanelMatMulFloats(m, k));
        cpu::PackPanelsBytes(panels.data(), q.data(), m, k);
        EXPECT_EQ(buffer->bytes(), m * sizeof(float) + panels.size());
        EXPECT_EQ(packed.bytes(), static_cast<size_t>(Int8RowsLayout{m, k}.bytes()));
        EXPECT_EQ(std::memcmp(codes, panels.data(), panels.size()), 0);
      } else {
        EXPECT_EQ(buffer->bytes(), static_cast<size_t>(fp8 ? Fp8RowsLayout{m, k}.bytes() : Int8RowsLayout{m, k}.bytes()));
        EXPECT_EQ(packed.bytes(), buffer->bytes());
        EXPECT_EQ(std::memcmp(codes, q.data(), m * k), 0);
      }
      packed_buffer = std::move(*buffer);
      dw.Poison();  // MatMul must read only the packed copy
    }
    ASSERT_NO_FATAL_FAILURE(
        ExpectQuantizedProducts(backend_.get(), rng_, quant, packed, dequantized, b, k, m, {1, 2, 3, 16, 17}, 1e-5));
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, RowsQuantMatMulTest, ::testing::Values(WeightQuant::kInt8, WeightQuant::kFp8),
                         QuantParamName);

// fp8 with input-group scales through the backend (PackQuantizedWeight with a group, as the loader
// stores an FP8 checkpoint's block scales; MatMul: the panels on AVX-512 CPUs, else the rows): the
// packed weight says its group, its bytes() are Fp8RowsLayout{m, k, group}'s (1 byte a weight, 4 a
// group), and its products equal the reference's within float32 rounding (the weights summed are
// the reference's bit for bit: 1e-5, as the per-row products). A group of k or more is one scale a
// row (the layout without groups, byte for byte); a group on another format is refused. Both ways
// the backend may hold them: as the CPU picks (panels on AVX-512), and the rows' instance under
// an AVX2 override where the CPU has AVX2.
TEST_F(CpuBackendTest, Fp8GroupScalesEqualTheDequantizedProduct) {
  for (std::optional<cpu::QuantIsa> isa : {std::optional<cpu::QuantIsa>(), std::optional(cpu::QuantIsa::kAvx2)}) {
    if (isa.has_value() && !cpu::QuantIsaSupported(*isa)) continue;
    cpu::SetQuantIsaOverride(isa);
    for (auto [k, m, group] : {std::tuple<int64_t, int64_t, int64_t>{256, 40, 128}, {200, 17, 40}, {300, 33, 128},
                               {64, 7, 8}, {24, 5, 40}}) {
      const Fp8GroupWeight w = RandomFp8GroupWeight(rng_, m, k, group);
      const Fp8RowsLayout layout{m, k, group};
      std::vector<uint8_t> stored(layout.bytes());
      std::memcpy(stored.data(), w.scale.data(), layout.scale_bytes());
      std::memcpy(stored.data() + layout.scale_bytes(), w.q.data(), m * k);
      Tensor packed;
      absl::StatusOr<Buffer> buffer = backend_->PackQuantizedWeight(WeightQuant::kFp8, stored.data(), m, k, &packed, group);
      ASSERT_TRUE(buffer.ok()) << buffer.status();
      EXPECT_EQ(packed.quant, WeightQuant::kFp8);
      EXPECT_EQ(packed.quant_group, k > group ? group : 0) << "a group of k or more is one scale a row";
      EXPECT_EQ(packed.bytes(), static_cast<size_t>(layout.bytes()));
      EXPECT_EQ(packed.bytes(), static_cast<size_t>(m * k + m * ((k + group - 1) / group) * 4));
      stored.assign(stored.size(), 0xFF);  // MatMul must read only the packed copy
      const std::vector<float> b = Random(rng_, m);
      ASSERT_NO_FATAL_FAILURE(ExpectQuantizedProducts(backend_.get(), rng_, WeightQuant::kFp8, packed, w.dequantized, b, k,
                                                      m, {1, 2, 3, 16, 17}, 1e-5));
    }
  }
  cpu::SetQuantIsaOverride(std::nullopt);
  Tensor packed;
  std::vector<uint8_t> stored(Int8RowsLayout{4, 16}.bytes());
  EXPECT_TRUE(absl::IsInvalidArgument(
      backend_->PackQuantizedWeight(WeightQuant::kInt8, stored.data(), 4, 16, &packed, 8).status()));
}

// MXFP4 weights through the backend (PackQuantizedWeight of a checkpoint's codes and scales, then
// MatMul): the packed weight is I8 with quant kMxfp4, its bytes() Mxfp4RowsLayout's (4.25 bits a
// weight), MatMul reads only its packed copy and equals the reference's product (the weights summed
// are the reference's bit for bit: 1e-5, as the other formats), under the CPU's own instance and
// an AVX2 override. Refused, naming why: k not a whole number of blocks, a scale byte of 255, 254
// on a code of magnitude 2 (2^128), 253 on one of 4, input groups; and quantizing into mxfp4 at load.
TEST_F(CpuBackendTest, Mxfp4WeightsEqualTheDequantizedProduct) {
  for (std::optional<cpu::QuantIsa> isa : {std::optional<cpu::QuantIsa>(), std::optional(cpu::QuantIsa::kAvx2)}) {
    if (isa.has_value() && !cpu::QuantIsaSupported(*isa)) continue;
    cpu::SetQuantIsaOverride(isa);
    for (auto [k, m] : {std::pair<int64_t, int64_t>{2880 / 10, 33}, {64, 7}, {32, 16}}) {
      Mxfp4Weight w = RandomMxfp4Weight(rng_, m, k, /*large=*/false);
      Tensor packed;
      absl::StatusOr<Buffer> buffer = backend_->PackQuantizedWeight(WeightQuant::kMxfp4, w.stored.data(), m, k, &packed);
      ASSERT_TRUE(buffer.ok()) << buffer.status();
      EXPECT_EQ(packed.quant, WeightQuant::kMxfp4);
      EXPECT_EQ(packed.dtype, DType::kI8);
      EXPECT_EQ(packed.bytes(), static_cast<size_t>(m * k / 2 + m * k / 32));
      w.stored.assign(w.stored.size(), 0xFF);  // MatMul must read only the packed copy
      const std::vector<float> b = Random(rng_, m);
      ASSERT_NO_FATAL_FAILURE(ExpectQuantizedProducts(backend_.get(), rng_, WeightQuant::kMxfp4, packed, w.dequantized, b,
                                                      k, m, {1, 2, 3, 16, 17}, 1e-5));
    }
  }
  cpu::SetQuantIsaOverride(std::nullopt);
  Tensor packed;
  std::vector<uint8_t> stored(static_cast<size_t>(Mxfp4RowsLayout{4, 64}.bytes()), 0x11);
  uint8_t* scales = stored.data() + Mxfp4RowsLayout{4, 64}.code_bytes();
  EXPECT_TRUE(backend_->PackQuantizedWeight(WeightQuant::kMxfp4, stored.data(), 4, 64, &packed).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->PackQuantizedWeight(WeightQuant::kMxfp4, stored.data(), 4, 48, &packed).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->PackQuantizedWeight(WeightQuant::kMxfp4, stored.data(), 4, 64, &packed, 32).status()));
  scales[5] = 254;  // codes 0x11: 0.5 x 2^127, finite
  EXPECT_TRUE(backend_->PackQuantizedWeight(WeightQuant::kMxfp4, stored.data(), 4, 64, &packed).ok());
  stored[5 * kMxfp4BlockBytes + 3] = 0x14;  // a code of 2 under 2^127: 2^128
  absl::Status s = backend_->PackQuantizedWeight(WeightQuant::kMxfp4, stored.data(), 4, 64, &packed).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("past float32"), std::string::npos) << s;
  scales[5] = 253;  // 2 x 2^126: finite
  EXPECT_TRUE(backend_->PackQuantizedWeight(WeightQuant::kMxfp4, stored.data(), 4, 64, &packed).ok());
  stored[5 * kMxfp4BlockBytes + 3] = 0x16;  // 4 x 2^126
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->PackQuantizedWeight(WeightQuant::kMxfp4, stored.data(), 4, 64, &packed).status()));
  stored[5 * kMxfp4BlockBytes + 3] = 0x11;
  scales[7] = 255;  // NaN in E8M0
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->PackQuantizedWeight(WeightQuant::kMxfp4, stored.data(), 4, 64, &packed).status()));
  DeviceTensor plain = F32({4, 64}, std::vector<float>(256, 0.5f));
  EXPECT_FALSE(backend_->PackMatMulWeight(plain.t(), &packed, WeightQuant::kMxfp4).ok());
  EXPECT_FALSE(ParseWeightQuant("mxfp4").ok()) << "not a --quantization: only a checkpoint stores it";
}

// As for the float32 products: a row's product by an int8 or int4 weight is bitwise the same
// whatever other rows share the call, on 1 or 2 threads; with --activation-quantization int8 and
// int16 too where the CPU has VNNI (int8's one-row 8 x 1 tiles against its 4 x 4 ones, int16's
// tiles of 1 to 12 rows: the same integer sums and the same float32 steps).
class QuantMatMulRowsTest : public ::testing::TestWithParam<WeightQuant> {};

TEST_P(QuantMatMulRowsTest, RowsDoNotDependOnTheBatch) {
  const WeightQuant quant = GetParam();
  std::mt19937 rng(quant == WeightQuant::kInt8 ? 5 : 7);
  const int64_t rows = 67, m = 70, k = 203;
  const std::vector<float> w = Random(rng, m * k), x = Random(rng, rows * k);
  std::vector<CpuActivationQuant> acts = {CpuActivationQuant::kNone};
  if (cpu::QuantIsaSupported(cpu::QuantIsa::kAvx512Vnni)) {
    acts.push_back(CpuActivationQuant::kInt8);
    acts.push_back(CpuActivationQuant::kInt16);
  }
  // The CPU's own instance, and on an AVX-512 CPU also the AVX2 CPUs' (their int8 and int4 panels).
  std::vector<std::optional<cpu::QuantIsa>> isas = {std::nullopt};
  if (cpu::ActiveQuantIsa() == cpu::QuantIsa::kAvx512) isas.push_back(cpu::QuantIsa::kAvx2);
  for (const std::optional<cpu::QuantIsa>& isa : isas) {
    cpu::SetQuantIsaOverride(isa);
    std::vector<std::pair<int, CpuActivationQuant>> runs;
    for (CpuActivationQuant act : acts) runs.insert(runs.end(), {{1, act}, {2, act}});
    for (auto [threads, act] : runs) {
      absl::StatusOr<std::unique_ptr<Backend>> made = MakeCpuBackend(threads, CpuMatMul::kF32, act);
      ASSERT_TRUE(made.ok()) << made.status();
      std::unique_ptr<Backend> backend = std::move(*made);
      DeviceTensor dw(backend.get(), DType::kF32, {m, k});
      dw.Upload(w);
      Tensor packed;
      absl::StatusOr<Buffer> buffer = backend->PackMatMulWeight(dw.t(), &packed, quant);
      ASSERT_TRUE(buffer.ok()) << buffer.status();
      DeviceTensor all_x(backend.get(), DType::kF32, {rows, k});
      all_x.Upload(x);
      DeviceTensor all_out(backend.get(), DType::kF32, {rows, m});
      ASSERT_TRUE(backend->MatMul(all_out.ptr(), all_x.t(), packed, nullptr).ok());
      const std::vector<float> want = all_out.Download<float>();
      // (From 8 rows the AVX2 int4 panels widen each group's codes once for all tiles of rows.)
      for (int64_t n : {1, 2, 3, 5, 8, 16}) {
        for (int64_t first : {int64_t{0}, int64_t{1}, rows - n}) {
          DeviceTensor part_out(backend.get(), DType::kF32, {n, m});
          ASSERT_TRUE(backend->MatMul(part_out.ptr(), all_x.t().Rows(first, first + n), packed, nullptr).ok());
          const std::vector<float> got = part_out.Download<float>();
          EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin() + first * m))
              << "rows " << first << ".." << first + n << " alone differ (" << threads << " threads, activations "
              << CpuActivationQuantName(act) << ", " << cpu::QuantIsaName(cpu::ActiveQuantIsa()) << ")";
        }
      }
    }
  }
  cpu::SetQuantIsaOverride(std::nullopt);
}

INSTANTIATE_TEST_SUITE_P(Formats, QuantMatMulRowsTest, ::testing::Values(WeightQuant::kInt8, WeightQuant::kInt4),
                         QuantParamName);

// ---- fp8 e4m3 weights (kernels/quant.h Fp8RowsLayout) ---------------------------------------

// Every one of the 256 codes against the E4M3FN definition (sign, exponent bias 7, 3 mantissa
// bits, subnormals below 2^-6, 0x7F / 0xFF NaN, no infinity), computed here independently by
// bits; every non-NaN code survives FloatToFp8E4m3(Fp8E4m3ToFloat(c)); values between two
// neighbours go to the nearer one and halfway ones to the even mantissa; beyond 448 saturates.
TEST(Fp8QuantTest, E4m3CodesRoundTripAndRoundToNearestEven) {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    const float v = Fp8E4m3ToFloat(code);
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v)) << c;
      EXPECT_TRUE(Fp8E4m3IsNan(code));
      continue;
    }
    const int e = (c >> 3) & 15, mant = c & 7;
    const double want = (c & 0x80 ? -1.0 : 1.0) * (e == 0 ? mant / 8.0 * std::pow(2.0, -6) : (1 + mant / 8.0) * std::pow(2.0, e - 7));
    EXPECT_EQ(v, static_cast<float>(want)) << "code " << c;
    EXPECT_EQ(FloatToFp8E4m3(v), c == 0x80 ? 0x80 : code) << "code " << c << " = " << v;
  }
  EXPECT_EQ(Fp8E4m3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(Fp8E4m3ToFloat(0x38), 1.0f);
  EXPECT_EQ(Fp8E4m3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(FloatToFp8E4m3(1000.0f), 0x7E);
  EXPECT_EQ(FloatToFp8E4m3(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(FloatToFp8E4m3(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  // Neighbours 1 (0x38) and 1.125 (0x39): 1.0625 is halfway (to even: 1), just above goes up.
  EXPECT_EQ(FloatToFp8E4m3(1.0625f), 0x38);
  EXPECT_EQ(FloatToFp8E4m3(std::nextafter(1.0625f, 2.0f)), 0x39);
  EXPECT_EQ(FloatToFp8E4m3(1.1875f), 0x3A);  // halfway between 1.125 (odd) and 1.25 (even)
  // Subnormals are m x 2^-9 (m < 8); 7.5 x 2^-9 rounds to the even 8 x 2^-9, the first normal.
  EXPECT_EQ(FloatToFp8E4m3(7.5f * std::ldexp(1.0f, -9)), 0x08);  // halfway 7 (odd) / 8 (even)
  EXPECT_EQ(FloatToFp8E4m3(6.5f * std::ldexp(1.0f, -9)), 0x06);  // halfway 6 (even) / 7
  EXPECT_EQ(FloatToFp8E4m3(0.2f * std::ldexp(1.0f, -9)), 0x00);
  EXPECT_EQ(FloatToFp8E4m3(-0.7f * std::ldexp(1.0f, -9)), 0x81);
}

// FloatToFp8E4m3 (bit arithmetic, no libm) against its definition in libm's terms: the step at the
// value's binade from frexp, the value over it by ldexp, rounded to even by nearbyint. Every 251st
// float bit pattern of either sign, and each halfway point between neighbouring codes with the
// floats just below and above it.
TEST(Fp8QuantTest, CodesEqualTheLibmDefinition) {
  const auto definition = [](float v) -> uint8_t {
    if (std::isnan(v)) return 0x7F;
    const uint8_t sign = std::signbit(v) ? 0x80 : 0;
    const float a = std::fmin(std::fabs(v), kFp8E4m3Max);
    if (a == 0) return sign;
    int e;
    std::frexp(a, &e);
    const int binade = std::max(e - 1, -6);
    const float steps = std::nearbyint(std::ldexp(a, 3 - binade));
    const int code = binade == -6 && steps < 8 ? static_cast<int>(steps) : ((binade + 7) << 3) + static_cast<int>(steps) - 8;
    return static_cast<uint8_t>(sign | std::min(code, 0x7E));
  };
  int64_t checked = 0;
  for (uint64_t bits = 0; bits <= 0xFFFFFFFFu; bits += 251) {
    float v;
    const auto b = static_cast<uint32_t>(bits);
    std::memcpy(&v, &b, sizeof v);
    ASSERT_EQ(FloatToFp8E4m3(v), definition(v)) << "bits 0x" << std::hex << b << " = " << v;
    ++checked;
  }
  for (int c = 0; c < 0x7E; ++c) {
    const float mid = (Fp8E4m3ToFloat(static_cast<uint8_t>(c)) + Fp8E4m3ToFloat(static_cast<uint8_t>(c + 1))) / 2;
    for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1000.0f)}) {
      ASSERT_EQ(FloatToFp8E4m3(v), definition(v)) << "near the halfway point after code " << c << ": " << v;
      ASSERT_EQ(FloatToFp8E4m3(-v), definition(-v)) << "near the halfway point after code " << c << ": " << -v;
    }
  }
  EXPECT_GT(checked, 17'000'000);
}

// The layout's reference: the largest magnitude of a row is exactly +-448 x scale, every weight
// within 2^-4 of its magnitude (half of e4m3's relative step) or, below e4m3's normal range,
// within half a subnormal step (2^-10 x scale); an all-zero row scale 0; a non-finite weight
// refused with its place named.
TEST(Fp8QuantTest, QuantizeIsWithinHalfAStepAndDequantizeInverts) {
  std::mt19937 rng(17);
  const int64_t m = 5, k = 301;
  std::vector<float> w = Random(rng, m * k, -3.0f, 3.0f);
  std::fill(w.begin() + 2 * k, w.begin() + 3 * k, 0.0f);  // row 2: all zero
  for (int64_t c = 0; c < k; c += 7) w[4 * k + c] *= 1e-4f;  // row 4: some values in e4m3's subnormal range
  std::vector<float> scale(m);
  std::vector<uint8_t> q(m * k);
  ASSERT_TRUE(QuantizeFp8Rows(scale.data(), q.data(), w.data(), m, k).ok());
  std::vector<float> back(m * k);
  DequantizeFp8Rows(back.data(), scale.data(), q.data(), m, k);
  for (int64_t r = 0; r < m; ++r) {
    float max_abs = 0, max_back = 0;
    for (int64_t c = 0; c < k; ++c) {
      const float v = w[r * k + c];
      max_abs = std::max(max_abs, std::fabs(v));
      max_back = std::max(max_back, std::fabs(back[r * k + c]));
      EXPECT_FALSE(Fp8E4m3IsNan(q[r * k + c]));
      const float bound = std::max(std::fabs(v) * 0x1p-4f, scale[r] * 0x1p-10f) * (1 + 1e-6f);
      EXPECT_LE(std::fabs(back[r * k + c] - v), bound) << r << ", " << c << ": " << v;
      EXPECT_EQ(back[r * k + c], Fp8E4m3ToFloat(q[r * k + c]) * scale[r]);
    }
    EXPECT_FLOAT_EQ(scale[r], max_abs / 448) << "row " << r;
    EXPECT_FLOAT_EQ(max_back, max_abs) << "row " << r;
  }
  w[3 * k + 4] = -std::numeric_limits<float>::infinity();
  const absl::Status s = QuantizeFp8Rows(scale.data(), q.data(), w.data(), m, k);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("[3, 4]"), std::string::npos) << s;
  EXPECT_STREQ(WeightQuantName(WeightQuant::kFp8), "fp8");
  EXPECT_EQ((Fp8RowsLayout{3, 10}.bytes()), 3 * 4 + 30);
}

// A quantized weight's bytes() are its layout's (values, scales, zeros), for every format, through
// PackMatMulWeight and by hand, and survive copying the view; a plain view keeps numel x size.
// (Before, an I8 [m, k] view said m x k bytes, which the worker's weight count had to work around.)
TEST_F(CpuBackendTest, QuantizedWeightBytesAreTheLayouts) {
  const int64_t m = 6, k = 300;
  const std::vector<float> w = Random(rng_, m * k);
  DeviceTensor dw(backend_.get(), DType::kF32, {m, k});
  dw.Upload(w);
  for (WeightQuant quant : {WeightQuant::kInt8, WeightQuant::kInt4, WeightQuant::kFp8}) {
    Tensor packed;
    absl::StatusOr<Buffer> buffer = backend_->PackMatMulWeight(dw.t(), &packed, quant);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    const Tensor copy = packed;
    EXPECT_EQ(copy.quant, quant);
    EXPECT_EQ(copy.bytes(), static_cast<size_t>(QuantizedWeightBytes(quant, m, k))) << WeightQuantName(quant);
    const cpu::QuantIsa isa = cpu::ActiveQuantIsa();
    if ((quant == WeightQuant::kInt8 && cpu::IntOnPanels(isa)) ||
        (quant == WeightQuant::kFp8 && cpu::Fp8OnPanels(isa))) {
      // The codes as panels: the last one padded to 16 rows (kernels/cpu/panel_matmul.h).
      EXPECT_EQ(buffer->bytes(), static_cast<size_t>(m * 4 + cpu::PanelMatMulFloats(m, k)));
    } else if (quant == WeightQuant::kInt4 && cpu::IntOnPanels(cpu::ActiveQuantIsa())) {
      // The groups as panels: the last block of 4 padded to 64 rows (kernels/cpu/panel_matmul.h).
      EXPECT_EQ(buffer->bytes(), cpu::Int4PanelGroupCount(m, k) * sizeof(cpu::Int4PanelGroup));
    } else {
      EXPECT_EQ(copy.bytes(), buffer->bytes()) << WeightQuantName(quant);
    }
    // An output placed in the weight's last bytes (for int8 and fp8 past the m x k bytes an I8
    // view used to claim; for int8 panels, in the padding) overlaps it.
    Tensor inside(static_cast<char*>(buffer->data()) + buffer->bytes() - m * sizeof(float), DType::kF32, {1, m});
    DeviceTensor x(backend_.get(), DType::kF32, {1, k});
    x.Upload(Random(rng_, k));
    EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MatMul(&inside, x.t(), packed, nullptr), "MatMul"))
        << WeightQuantName(quant);
    // A view that lies about its format is refused.
    Tensor lying = packed;
    lying.quant = quant == WeightQuant::kInt8 ? WeightQuant::kFp8 : WeightQuant::kInt8;
    DeviceTensor out(backend_.get(), DType::kF32, {1, m});
    EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MatMul(out.ptr(), x.t(), lying, nullptr), "MatMul"));
  }
  EXPECT_EQ((Int8RowsLayout{m, k}.bytes()), m * 4 + m * k);
  EXPECT_EQ((Int4GroupsLayout{m, k}.bytes()), m * 3 * 72);
  Tensor plain(nullptr, DType::kI8, {m, k});
  EXPECT_EQ(plain.bytes(), static_cast<size_t>(m * k));
  plain.quant = WeightQuant::kInt4;
  EXPECT_EQ(plain.bytes(), static_cast<size_t>(m * 3 * 72));
}

// ---- every instance of the quantized products (kernels/cpu/quant_isa.h) ---------------------

// Each instruction set's instance (baseline x86-64, AVX2 + FMA, AVX-512) of the int8, fp8 and int4
// products, called directly, against the dequantize-then-multiply reference at 1, 4, 32 and 64
// input rows and others (2, 3, 65: the VNNI int4 tiles of 2 and 3 input rows, odd ones), k and m
// with tails (k not a multiple of 8 / 16 / 128, m not of the 8-row tiles), with bias. Outputs
// start NaN between guard bytes (a missed or stray write fails). Limits as the backend tests':
// 1e-5 for int8 / fp8 (float32 rounding of k <= 1024 terms, lane sums in a fixed order), 1e-4
// for int4 on the 8-lane instances (their two sums per group, see
// Int4MatMulEqualsTheDequantizedProduct), 1e-5 for int4 on AVX-512 (it sums x x w over the
// dequantized weights themselves, as int8's products: measured up to 2.1e-7). A NaN in one input row makes that row's outputs NaN
// and no other's; an Inf row gives +-Inf or NaN there and leaves the others exact. An instance
// this CPU lacks is skipped, saying so. Every fifth int8 code is -128 (a checkpoint's, not the
// quantizer's).
// The VNNI instances' int8 and int4 products round each activation to int8 (scale max |x| / 127): an error
// of up to 1/254 of the row's largest per activation, uniform, so an output moves by ~(1/127) /
// sqrt(12) x |w| rms against outputs of ~|x||w| / sqrt(3): about 4e-3 normalized on these uniform
// inputs (measured 2e-4 to 9.2e-3, the largest at k = 64, AMD EPYC, 2026-11-24). kVnniLimit =
// 2e-2 leaves room for the maximum over many outputs; a wrong sign mask or scale gives ~1. (With
// few outputs, m = 1, n = 2, their maximum can be small and the normalized error larger: so
// QuantIsaTest holds the VNNI instances to the reference on the rounded activations instead, where
// the integer sums are exact and only float32 rounding is left: < 1e-6 measured, limit 1e-5.)
constexpr double kVnniLimit = 2e-2;

// x [n, k] with each row rounded as activation_rows.h rounds it (scale max |x| / 127, round(x /
// scale) to nearest even, times scale): the input the VNNI products multiply exactly.
std::vector<float> RoundedAsInt8Rows(const std::vector<float>& x, int64_t n, int64_t k) {
  std::vector<float> out(x.size());
  for (int64_t i = 0; i < n; ++i) {
    float amax = 0;
    for (int64_t c = 0; c < k; ++c) amax = std::max(amax, std::fabs(x[i * k + c]));
    const float s = amax / 127.0f;
    for (int64_t c = 0; c < k; ++c) out[i * k + c] = amax == 0 ? 0.0f : std::nearbyint(x[i * k + c] / s) * s;
  }
  return out;
}
// activation_rows.h's two quantizers (AVX2's and AVX-512's) against a scalar loop: scale max |x| /
// 127 (0 for a zero row, NaN for a row with NaN or Inf, whose values stay 0), each value
// nearbyint(x / scale) (to nearest even) in [-127, 127], zero padding to whole blocks, and the
// block and row sums, for widths that end inside a 16-value step and blocks of 64 and 128.
TEST(ActivationRowsTest, BothQuantizersEqualTheScalarRounding) {
  std::mt19937 rng(17);
  for (int64_t block : {64, 128}) {
    for (int64_t k : {1, 7, 8, 9, 23, 64, 129, 300}) {
      const int64_t n = 5;
      std::vector<float> x = Random(rng, n * k);
      for (int64_t c = 0; c < k; ++c) x[1 * k + c] = 0.0f;                  // row 1: all zero
      x[2 * k + k / 2] = std::numeric_limits<float>::quiet_NaN();             // row 2: NaN
      x[3 * k + k - 1] = -std::numeric_limits<float>::infinity();             // row 3: -Inf
      if (k > 2) x[4 * k + 2] = 100.0f;                                     // row 4: one large value
      const int64_t blocks = (k + block - 1) / block, width = blocks * block;
      std::vector<int8_t> values(n * width, 0);
      std::vector<int32_t> block_sum(n * blocks, 0), sum(n, 0);
      std::vector<float> scale(n, 0.0f);
      for (int64_t i = 0; i < n; ++i) {
        float amax = 0;
        bool bad = false;
        for (int64_t c = 0; c < k; ++c) {
          bad = bad || !std::isfinite(x[i * k + c]);
          amax = std::max(amax, std::fabs(x[i * k + c]));
        }
        if (bad) {
          scale[i] = std::numeric_limits<float>::quiet_NaN();
          continue;
        }
        if (amax == 0) continue;
        scale[i] = amax / 127.0f;
        for (int64_t c = 0; c < k; ++c) {
          const auto v = static_cast<int32_t>(std::nearbyint(std::clamp(x[i * k + c] / scale[i], -127.0f, 127.0f)));
          values[i * width + c] = static_cast<int8_t>(v);
          block_sum[i * blocks + c / block] += v;
          sum[i] += v;
        }
      }
      for (int avx512 = 0; avx512 < 2; ++avx512) {
        const cpu::QuantIsa isa = avx512 ? cpu::QuantIsa::kAvx512Vnni : cpu::QuantIsa::kAvx2Int8;
        if (!cpu::QuantIsaSupported(isa)) continue;
        const std::string what = absl::StrCat(cpu::QuantIsaName(isa), " block ", block, " k ", k);
        cpu::ActivationRows rows;
        rows.values.assign(7, 99);  // stale contents are replaced
        cpu::QuantizeActivationRows(&rows, x.data(), n, k, block, isa);
        EXPECT_EQ(rows.block, block) << what;
        EXPECT_EQ(rows.blocks, blocks) << what;
        EXPECT_EQ(rows.values, values) << what;
        EXPECT_EQ(rows.block_sum, block_sum) << what;
        EXPECT_EQ(rows.sum, sum) << what;
        ASSERT_EQ(rows.scale.size(), scale.size()) << what;
        for (int64_t i = 0; i < n; ++i) {
          if (std::isnan(scale[i])) {
            EXPECT_TRUE(std::isnan(rows.scale[i])) << what << " row " << i;
          } else {
            EXPECT_EQ(rows.scale[i], scale[i]) << what << " row " << i;
          }
        }
      }
    }
  }
  if (!cpu::QuantIsaSupported(cpu::QuantIsa::kAvx2Int8)) GTEST_SKIP() << "this CPU lacks AVX2 and FMA";
}

// The two int8 products on int8-rounded activations compute the same exact integer sums and scale
// them the same way: bitwise equal outputs (int4's float sums run over 8 lanes on AVX2 and 16 on
// AVX-512, so only QuantIsaTest's bound holds there). Needs both instances: a CPU with AVX-512 VNNI.
TEST(ActivationRowsTest, Avx2Int8ProductIsTheVnniOneBitForBit) {
  if (!cpu::QuantIsaSupported(cpu::QuantIsa::kAvx512Vnni)) GTEST_SKIP() << "this CPU lacks AVX-512 VNNI";
  std::mt19937 rng(19);
  for (auto [n, m, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 33, 300}, {2, 17, 64}, {5, 40, 1024}, {65, 9, 23}}) {
    const std::vector<float> w = Random(rng, m * k), x = Random(rng, n * k), b = Random(rng, m);
    std::vector<float> s8(m);
    std::vector<int8_t> q8(m * k);
    ASSERT_TRUE(QuantizeInt8Rows(s8.data(), q8.data(), w.data(), m, k).ok());
    for (int64_t i = 0; i < m * k; i += 5) q8[i] = -128;
    std::vector<float> y_vnni(n * m), y_avx2(n * m);
    cpu::Int8MatMul(y_vnni.data(), x.data(), n, m, k, q8.data(), s8.data(), b.data(), 2, cpu::QuantIsa::kAvx512Vnni);
    cpu::Int8MatMul(y_avx2.data(), x.data(), n, m, k, q8.data(), s8.data(), b.data(), 2, cpu::QuantIsa::kAvx2Int8);
    EXPECT_EQ(y_avx2, y_vnni) << "n=" << n << " m=" << m << " k=" << k;
  }
}

// The int4 panels' two instances (kernels/cpu/panel_matmul.h PanelMatMulInt4: AVX-512's 16-float
// vectors, AVX2's 8-float ones, with tiles of other shapes) run the same operations on every
// output: bitwise equal results, bias or not, short last groups of odd and even length, block
// tails, one row to many. Needs both: a CPU with AVX-512.
TEST(Int4PanelsTest, Avx2InstanceIsTheAvx512OneBitForBit) {
  if (!cpu::PanelTilesSupported(cpu::PanelTiles::kAvx512)) GTEST_SKIP() << "this CPU lacks AVX-512";
  std::mt19937 rng(29);
  for (auto [n, m, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 70, 300}, {2, 64, 128}, {3, 17, 129}, {7, 130, 256},
                         {13, 40, 1023}, {65, 9, 23}}) {
    const std::vector<float> w = Random(rng, m * k), x = Random(rng, n * k), b = Random(rng, m);
    std::vector<Int4Group128> blocks(m * Int4GroupsLayout{m, k}.groups_per_row());
    ASSERT_TRUE(QuantizeInt4Groups(blocks.data(), w.data(), m, k).ok());
    std::vector<cpu::Int4PanelGroup> panels(cpu::Int4PanelGroupCount(m, k));
    cpu::PackPanelsInt4(panels.data(), blocks.data(), m, k);
    for (const float* bias : {static_cast<const float*>(nullptr), b.data()}) {
      std::vector<float> wide(n * m), narrow(n * m);
      cpu::PanelMatMulInt4(wide.data(), x.data(), n, m, k, panels.data(), bias, 2, cpu::PanelTiles::kAvx512);
      cpu::PanelMatMulInt4(narrow.data(), x.data(), n, m, k, panels.data(), bias, 2, cpu::PanelTiles::kVec8);
      EXPECT_EQ(narrow, wide) << "n=" << n << " m=" << m << " k=" << k << (bias != nullptr ? " +bias" : "");
    }
  }
}

// ---- int4 on int16 activations (--activation-quantization int16: PanelMatMulInt4Act16) -------

// Int16ActivationGroups against a scalar loop: per group of 128 of each row, scale max |x| / 32767
// (0 for an all-zero group, NaN for one with a NaN or an infinity, whose values stay 0), each value
// nearbyint(x * (32767 / max |x|)) (to nearest even), zero padding to whole groups, and each group's
// sum; rows whose width ends inside a 16-value step, one group or several.
TEST(Int16ActivationsTest, QuantizerEqualsTheScalarRounding) {
  if (!cpu::QuantIsaSupported(cpu::QuantIsa::kAvx512Vnni)) GTEST_SKIP() << "this CPU lacks AVX-512 VNNI";
  std::mt19937 rng(43);
  for (int64_t k : {1, 7, 16, 17, 128, 129, 300}) {
    const int64_t n = 5, groups = (k + 127) / 128;
    std::vector<float> x = Random(rng, n * k, -3.0f, 3.0f);
    for (int64_t c = 0; c < k; ++c) x[1 * k + c] = 0.0f;                 // row 1: all zero
    x[2 * k + k / 2] = std::numeric_limits<float>::quiet_NaN();            // row 2: NaN in one group
    x[3 * k + k - 1] = -std::numeric_limits<float>::infinity();            // row 3: -Inf in the last
    if (k > 2) x[4 * k + 2] = 1000.0f;                                   // row 4: one large value
    std::vector<int16_t> v(n * groups * 128, 0);
    std::vector<float> scale(n * groups, 0.0f), sum(n * groups, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t begin = g * 128, end = std::min(k, begin + 128), at = i * groups + g;
        float amax = 0;
        bool bad = false;
        for (int64_t c = begin; c < end; ++c) {
          bad = bad || !std::isfinite(x[i * k + c]);
          amax = std::max(amax, std::fabs(x[i * k + c]));
        }
        if (bad) {
          scale[at] = std::numeric_limits<float>::quiet_NaN();
          continue;
        }
        if (amax == 0) continue;
        scale[at] = amax / 32767.0f;
        const float inv = 32767.0f / amax;
        int64_t total = 0;
        for (int64_t c = begin; c < end; ++c) {
          const auto q = static_cast<int32_t>(std::nearbyint(x[i * k + c] * inv));
          ASSERT_LE(std::abs(q), 32767);
          v[at * 128 + (c - begin)] = static_cast<int16_t>(q);
          total += q;
        }
        sum[at] = static_cast<float>(total);
      }
    }
    std::vector<int16_t> got_v(v.size(), 99);
    std::vector<float> got_scale(scale.size(), 99.0f), got_sum(sum.size(), 99.0f);
    cpu::Int16ActivationGroups(got_v.data(), got_scale.data(), got_sum.data(), x.data(), n, k);
    EXPECT_EQ(got_v, v) << "k=" << k;
    EXPECT_EQ(got_sum, sum) << "k=" << k;
    for (size_t at = 0; at < scale.size(); ++at) {
      if (std::isnan(scale[at])) {
        EXPECT_TRUE(std::isnan(got_scale[at])) << "k=" << k << " group " << at;
      } else {
        EXPECT_EQ(got_scale[at], scale[at]) << "k=" << k << " group " << at;
      }
    }
  }
}

// x [n, k] @ w^T (+ b) in double, each input as Int16ActivationGroups rounds it (v x scale, finite
// inputs): what PanelMatMulInt4Act16 computes up to float32 rounding, its integer sums being exact.
std::vector<double> Int16GroupsReference(const std::vector<float>& x, const std::vector<float>& w,
                                         const std::vector<float>* b, int64_t n, int64_t k, int64_t m) {
  const int64_t groups = (k + 127) / 128;
  std::vector<int16_t> v(n * groups * 128);
  std::vector<float> scale(n * groups), sum(n * groups);
  cpu::Int16ActivationGroups(v.data(), scale.data(), sum.data(), x.data(), n, k);
  std::vector<double> want(n * m);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < m; ++j) {
      double s = b != nullptr ? (*b)[j] : 0.0;
      for (int64_t l = 0; l < k; ++l) {
        const int64_t at = i * groups + l / 128;
        s += static_cast<double>(v[at * 128 + l % 128]) * scale[at] * w[j * k + l];
      }
      want[i * m + j] = s;
    }
  }
  return want;
}

// The int16 rounding moves each activation by up to max |x| / 65534 of its group, uniform: an output
// moves by ~(1 / 32767) / sqrt(12) x |w| rms, 258 times less than int8's (kVnniLimit's reasoning):
// ~2e-5 normalized on these inputs over many outputs. kInt16Limit = 1e-4; a wrong nibble, sign or
// scale gives 1e-2 to 1.
constexpr double kInt16Limit = 1e-4;

// Each output of PanelMatMulInt4Act16 against the exact product by the dequantized weights w: within
// the most the rounding can move it, sum over inputs of |w| x (its group's max |x|) / 65534, plus
// float32 rounding (1e-6 of sum |x w|). Holds for any number of outputs (a normalized error over one
// or two outputs can exceed kInt16Limit by chance).
void ExpectWithinInt16Rounding(const std::string& what, const std::vector<float>& got, const std::vector<float>& x,
                               const std::vector<float>& w, const std::vector<float>* b, int64_t n, int64_t k,
                               int64_t m) {
  const std::vector<double> exact = MatMulReference(x, w, b, n, k, m);
  double worst = 0;  // the largest |got - exact| / bound
  for (int64_t i = 0; i < n; ++i) {
    std::vector<double> group_max((k + 127) / 128, 0.0);
    for (int64_t l = 0; l < k; ++l) group_max[l / 128] = std::max<double>(group_max[l / 128], std::fabs(x[i * k + l]));
    for (int64_t j = 0; j < m; ++j) {
      double bound = 0, magnitude = 0;
      for (int64_t l = 0; l < k; ++l) {
        bound += std::fabs(w[j * k + l]) * group_max[l / 128] / 65534.0;
        magnitude += std::fabs(static_cast<double>(w[j * k + l]) * x[i * k + l]);
      }
      bound += 1e-6 * magnitude;
      const double diff = std::fabs(got[i * m + j] - exact[i * m + j]);
      worst = std::max(worst, diff / bound);
      ASSERT_LE(diff, bound) << what << ": row " << i << ", column " << j << " is " << got[i * m + j]
                             << ", the exact product " << exact[i * m + j];
    }
  }
  std::printf("    %-44s worst |error| / rounding bound %.2f\n", what.c_str(), worst);
  if (n * m >= 64) ExpectClose(what + " (exact)", got, exact, kInt16Limit);
}

// PanelMatMulInt4Act16 on the int4 panels: against the reference on the rounded activations (only
// float32 rounding left: 1e-5) and against the exact product on the activations as they are
// (ExpectWithinInt16Rounding), for m on and off the 64-output blocks, k with short last groups of odd and even
// length, 1 row to 65 (every tile shape: 4 panels up to 5 rows, 2 from 6, balanced tiles of up to
// 8), with and without bias, GPTQ v1's zero point 16 on some groups; guards around the output; a
// NaN or Inf row is NaN and leaves the other rows as they were; 1 or 3 threads give the same bits.
TEST(Int16ActivationsTest, Int4PanelsProductEqualsTheReference) {
  if (!cpu::QuantIsaSupported(cpu::QuantIsa::kAvx512Vnni)) GTEST_SKIP() << "this CPU lacks AVX-512 VNNI";
  std::mt19937 rng(47);
  constexpr size_t kGuard = 64;
  for (auto [m, k] : {std::pair<int64_t, int64_t>{70, 300}, {64, 128}, {17, 129}, {130, 256}, {40, 1023}, {9, 23},
                      {1, 64}}) {
    const std::vector<float> w = Random(rng, m * k), b = Random(rng, m);
    std::vector<Int4Group128> blocks(m * Int4GroupsLayout{m, k}.groups_per_row());
    ASSERT_TRUE(QuantizeInt4Groups(blocks.data(), w.data(), m, k).ok());
    for (size_t i = 0; i < blocks.size(); i += 7) blocks[i].zero = 16;
    std::vector<float> ref4(m * k);
    DequantizeInt4Groups(ref4.data(), blocks.data(), m, k);
    std::vector<cpu::Int4PanelGroup> panels(cpu::Int4PanelGroupCount(m, k));
    cpu::PackPanelsInt4(panels.data(), blocks.data(), m, k, cpu::Int4CodeOrder::kOctets);
    for (int64_t n : {1, 2, 3, 5, 6, 12, 13, 32, 65}) {
      for (const std::vector<float>* bias : {static_cast<const std::vector<float>*>(nullptr), &b}) {
        const std::vector<float> x = Random(rng, n * k);
        const std::string what = absl::StrCat("int4 on int16 n=", n, " m=", m, " k=", k, bias ? " +bias" : "");
        std::vector<float> y(kGuard + n * m + kGuard, std::numeric_limits<float>::quiet_NaN());
        std::fill(y.begin(), y.begin() + kGuard, 7.0f);
        std::fill(y.end() - kGuard, y.end(), 7.0f);
        float* out = y.data() + kGuard;
        const float* bp = bias != nullptr ? bias->data() : nullptr;
        const auto run = [&](const std::vector<float>& in, int threads) {
          cpu::PanelMatMulInt4Act16(out, in.data(), n, m, k, panels.data(), bp, threads);
          return std::vector<float>(out, out + n * m);
        };
        const std::vector<float> got = run(x, 2);
        ExpectClose(what + " (rounded)", got, Int16GroupsReference(x, ref4, bias, n, k, m), 1e-5);
        ExpectWithinInt16Rounding(what, got, x, ref4, bias, n, k, m);
        for (size_t g = 0; g < kGuard; ++g) {
          ASSERT_EQ(y[g], 7.0f) << what << ": guard before";
          ASSERT_EQ(y[kGuard + n * m + g], 7.0f) << what << ": guard after";
        }
        EXPECT_EQ(run(x, 1), got) << what << ": 1 thread";
        EXPECT_EQ(run(x, 3), got) << what << ": 3 threads";
        if (n < 3) continue;
        std::vector<float> bad = x;
        bad[1 * k + k / 2] = std::numeric_limits<float>::quiet_NaN();
        bad[2 * k] = std::numeric_limits<float>::infinity();
        const std::vector<float> dirty = run(bad, 2);
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t r = 0; r < m; ++r) {
            const float v = dirty[i * m + r];
            if (i == 1 || i == 2) {
              EXPECT_TRUE(std::isnan(v)) << what << ": row " << i << " (NaN / Inf), column " << r;
            } else {
              ASSERT_EQ(v, got[i * m + r]) << what << ": row " << i << " changed by another row's NaN / Inf";
            }
          }
        }
      }
    }
  }
}

class QuantIsaTest : public ::testing::TestWithParam<cpu::QuantIsa> {};

TEST_P(QuantIsaTest, ProductsEqualTheDequantizedReference) {
  const cpu::QuantIsa isa = GetParam();
  if (!cpu::QuantIsaSupported(isa)) GTEST_SKIP() << "this CPU lacks " << cpu::QuantIsaName(isa);
  std::mt19937 rng(23 + static_cast<int>(isa));
  constexpr size_t kGuard = 64;
  for (auto [k, m] : {std::pair<int64_t, int64_t>{64, 1}, {129, 33}, {300, 7}, {1024, 40}, {23, 17}}) {
    const std::vector<float> w = Random(rng, m * k), b = Random(rng, m);
    // The three formats' stored weights and their references.
    std::vector<float> s8(m), sf8(m), ref8(m * k), reff8(m * k), ref4(m * k);
    std::vector<int8_t> q8(m * k);
    std::vector<uint8_t> qf8(m * k);
    std::vector<Int4Group128> blocks(m * Int4GroupsLayout{m, k}.groups_per_row());
    ASSERT_TRUE(QuantizeInt8Rows(s8.data(), q8.data(), w.data(), m, k).ok());
    // A published checkpoint's symmetric codes reach -128 (kernels/quant.h), which the quantizer
    // never writes: every instance must read it (the VNNI one's unsigned offset, not a negation).
    for (int64_t i = 0; i < m * k; i += 5) q8[i] = -128;
    ASSERT_TRUE(QuantizeFp8Rows(sf8.data(), qf8.data(), w.data(), m, k).ok());
    ASSERT_TRUE(QuantizeInt4Groups(blocks.data(), w.data(), m, k).ok());
    // A GPTQ v1 checkpoint's int4 zero points reach 16 (model/quantized_checkpoint.cc), which the
    // quantizer never writes: every instance must read it (the panels hold it as a float).
    for (size_t i = 0; i < blocks.size(); i += 7) blocks[i].zero = 16;
    DequantizeInt8Rows(ref8.data(), s8.data(), q8.data(), m, k);
    DequantizeFp8Rows(reff8.data(), sf8.data(), qf8.data(), m, k);
    DequantizeInt4Groups(ref4.data(), blocks.data(), m, k);
    std::vector<cpu::Int4PanelGroup> int4_panels(cpu::Int4PanelGroupCount(m, k));
    cpu::PackPanelsInt4(int4_panels.data(), blocks.data(), m, k);
    for (int64_t n : {1, 2, 3, 4, 32, 64, 65}) {
      std::vector<float> x = Random(rng, n * k);
      // format 2: int4 as the backend multiplies it on this instance's CPUs (the panels for kAvx2
      // and kAvx512, kernels/cpu/quant_isa.h IntOnPanels); 3: int4 by Int4MatMul's blocks.
      for (int format = 0; format < 4; ++format) {
        const char* name = format == 0 ? "int8" : format == 1 ? "fp8" : format == 2 ? "int4" : "int4 blocks";
        const std::string what =
            absl::StrCat(cpu::QuantIsaName(isa), " ", name, " n=", n, " k=", k, " m=", m);
        std::vector<float> y(kGuard + n * m + kGuard, std::numeric_limits<float>::quiet_NaN());
        std::fill(y.begin(), y.begin() + kGuard, 7.0f);
        std::fill(y.end() - kGuard, y.end(), 7.0f);
        float* out = y.data() + kGuard;
        const auto run = [&](const std::vector<float>& in) {
          if (format == 0) cpu::Int8MatMul(out, in.data(), n, m, k, q8.data(), s8.data(), b.data(), 2, isa);
          if (format == 1) cpu::Fp8MatMul(out, in.data(), n, m, k, qf8.data(), sf8.data(), b.data(), 2, isa);
          if (format == 2 && cpu::IntOnPanels(isa)) {
            cpu::PanelMatMulInt4(out, in.data(), n, m, k, int4_panels.data(), b.data(), 2, cpu::PanelTilesFor(isa));
          } else if (format >= 2) {
            cpu::Int4MatMul(out, in.data(), n, m, k, blocks.data(), b.data(), 2, isa);
          }
        };
        run(x);
        const std::vector<float>& ref = format == 0 ? ref8 : format == 1 ? reff8 : ref4;
        // int8 and int4 on int8-rounded activations.
        const bool vnni = (isa == cpu::QuantIsa::kAvx512Vnni || isa == cpu::QuantIsa::kAvx2Int8) && format != 1;
        ExpectClose(what, std::vector<float>(out, out + n * m),
                    MatMulReference(vnni ? RoundedAsInt8Rows(x, n, k) : x, ref, &b, n, k, m),
                    format >= 2 && !vnni ? 1e-4 : 1e-5);
        for (size_t g = 0; g < kGuard; ++g) {
          ASSERT_EQ(y[g], 7.0f) << what << ": guard before";
          ASSERT_EQ(y[kGuard + n * m + g], 7.0f) << what << ": guard after";
        }
        if (n < 3) continue;
        // Non-finite inputs stay in their row.
        const std::vector<float> clean(out, out + n * m);
        std::vector<float> bad = x;
        bad[1 * k + k / 2] = std::numeric_limits<float>::quiet_NaN();
        bad[2 * k] = std::numeric_limits<float>::infinity();
        run(bad);
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t r = 0; r < m; ++r) {
            const float v = out[i * m + r];
            if (i == 1) {
              EXPECT_TRUE(std::isnan(v)) << what << ": NaN row, column " << r;
            } else if (i == 2) {
              EXPECT_FALSE(std::isfinite(v)) << what << ": Inf row, column " << r;
            } else {
              ASSERT_EQ(v, clean[i * m + r]) << what << ": row " << i << " changed by another row's NaN / Inf";
            }
          }
        }
      }
    }
  }
}

// fp8 with input-group scales (Fp8GroupMatMul, an FP8 checkpoint's block scales on the rows'
// instances: baseline x86-64, AVX2 + FMA, AVX-512; the integer instances run the exact fp8 ones)
// against the dequantize-then-multiply reference (DequantizeFp8Groups), called directly: groups of 8
// and 16 (whole vectors), 40 and 24 (16-lane vectors across two groups), 128 and 3 (not a multiple
// of 8: correct, lane by lane, though loaders keep it dequantized), k with tails and shorter last
// groups, m off the 8-row tiles, 1 to 65 input rows, with bias, guards around the output. The
// weights summed are the reference's bit for bit (each widened vector times its scales), so only
// the order of the float32 additions differs: 1e-5 as for the per-row products.
TEST_P(QuantIsaTest, Fp8GroupScalesEqualTheDequantizedReference) {
  const cpu::QuantIsa isa = GetParam();
  if (!cpu::QuantIsaSupported(isa)) GTEST_SKIP() << "this CPU lacks " << cpu::QuantIsaName(isa);
  std::mt19937 rng(31 + static_cast<int>(isa));
  constexpr size_t kGuard = 64;
  for (auto [k, m, group] : {std::tuple<int64_t, int64_t, int64_t>{256, 9, 128}, {300, 17, 128}, {200, 8, 40},
                             {96, 33, 24}, {64, 5, 8}, {77, 3, 16}, {50, 11, 3}, {129, 4, 8}}) {
    const Fp8GroupWeight w = RandomFp8GroupWeight(rng, m, k, group);
    const std::vector<float> b = Random(rng, m);
    for (int64_t n : {1, 2, 3, 4, 17, 65}) {
      const std::vector<float> x = Random(rng, n * k);
      const std::string what =
          absl::StrCat(cpu::QuantIsaName(isa), " fp8 groups of ", group, " n=", n, " k=", k, " m=", m);
      std::vector<float> y(kGuard + n * m + kGuard, std::numeric_limits<float>::quiet_NaN());
      std::fill(y.begin(), y.begin() + kGuard, 7.0f);
      std::fill(y.end() - kGuard, y.end(), 7.0f);
      float* out = y.data() + kGuard;
      cpu::Fp8GroupMatMul(out, x.data(), n, m, k, w.q.data(), w.scale.data(), group, b.data(), 2, isa);
      ExpectClose(what, std::vector<float>(out, out + n * m), MatMulReference(x, w.dequantized, &b, n, k, m), 1e-5);
      for (size_t g = 0; g < kGuard; ++g) {
        ASSERT_EQ(y[g], 7.0f) << what << ": guard before";
        ASSERT_EQ(y[kGuard + n * m + g], 7.0f) << what << ": guard after";
      }
    }
  }
}

// MXFP4 on its panels (PackPanelsMxfp4, PanelMatMulMxfp4: gpt-oss's experts on every CPU), each
// instance: bitwise the chains of the float32 panels over DequantizeMxfp4Rows' weights (fused
// multiply-adds on AVX2 and AVX-512, a multiply and an add on baseline x86-64), and where the CPU
// runs PanelMatMul's fused clones bitwise PanelMatMul itself on the dequantized weights packed as
// float32 panels. k of 1, 2, 3, 10 and 12 blocks, m on and off the 16-column panels (1, 5, 16, 17,
// 40), n from 1 to 33 (the decoding tiles of several panels up to 7 rows, balanced tiles of odd
// rows; from 8 rows each panel dequantized once for the float32 tiles), with and without bias, 2
// threads; guards around the output; scales of 2^-127 (subnormal) to 2^127.
TEST_P(QuantIsaTest, Mxfp4PanelsAreTheDequantizedChainsBitForBit) {
  const cpu::QuantIsa isa = GetParam();
  if (!cpu::QuantIsaSupported(isa)) GTEST_SKIP() << "this CPU lacks " << cpu::QuantIsaName(isa);
  const bool fused = isa != cpu::QuantIsa::kPortable;
  std::mt19937 rng(71 + static_cast<int>(isa));
  constexpr size_t kGuard = 64;
  for (auto [k, m] : {std::pair<int64_t, int64_t>{32, 5}, {96, 17}, {320, 40}, {384, 16}, {64, 1}}) {
    const Mxfp4Weight w = RandomMxfp4Weight(rng, m, k);
    std::vector<uint8_t> packed(static_cast<size_t>(cpu::Mxfp4PanelBytes(m, k)));
    cpu::PackPanelsMxfp4(packed.data(), w.stored.data(), m, k);
    std::vector<float> f32_panels(static_cast<size_t>(cpu::PanelMatMulFloats(m, k))), scratch;
    cpu::PackPanels(f32_panels.data(), w.dequantized.data(), m, k);
    const std::vector<float> b = Random(rng, m);
    for (int64_t n : {1, 2, 3, 4, 5, 7, 8, 9, 17, 33}) {
      for (bool bias : {false, true}) {
        const std::vector<float> x = Random(rng, n * k);
        const std::string what = absl::StrCat(cpu::QuantIsaName(isa), " mxfp4 n=", n, " k=", k, " m=", m, bias ? " +bias" : "");
        std::vector<float> y(kGuard + n * m + kGuard, std::numeric_limits<float>::quiet_NaN());
        std::fill(y.begin(), y.begin() + kGuard, 7.0f);
        std::fill(y.end() - kGuard, y.end(), 7.0f);
        float* out = y.data() + kGuard;
        cpu::PanelMatMulMxfp4(out, x.data(), n, m, k, packed.data(), bias ? b.data() : nullptr, 2, isa);
        const std::vector<float> want = PanelChains(x, w.dequantized, bias ? b.data() : nullptr, n, k, m, fused);
        for (int64_t i = 0; i < n * m; ++i) {
          ASSERT_EQ(std::bit_cast<uint32_t>(out[i]), std::bit_cast<uint32_t>(want[i]))
              << what << ": row " << i / m << ", column " << i % m << ": " << out[i] << " vs " << want[i];
        }
        if (fused) {
          std::vector<float> panels(static_cast<size_t>(n * m));
          cpu::PanelMatMul(panels.data(), x.data(), n, m, k, f32_panels.data(), /*plain=*/false,
                           bias ? b.data() : nullptr, 2, &scratch);
          for (int64_t i = 0; i < n * m; ++i) {
            ASSERT_EQ(std::bit_cast<uint32_t>(out[i]), std::bit_cast<uint32_t>(panels[i]))
                << what << ": PanelMatMul's, row " << i / m << ", column " << i % m;
          }
        }
        for (size_t g = 0; g < kGuard; ++g) {
          ASSERT_EQ(y[g], 7.0f) << what << ": guard before";
          ASSERT_EQ(y[kGuard + n * m + g], 7.0f) << what << ": guard after";
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Isa, QuantIsaTest,
                         ::testing::Values(cpu::QuantIsa::kPortable, cpu::QuantIsa::kAvx2, cpu::QuantIsa::kAvx512,
                                           cpu::QuantIsa::kAvx512Vnni, cpu::QuantIsa::kAvx2Int8),
                         [](const ::testing::TestParamInfo<cpu::QuantIsa>& info) {
                           return std::string(cpu::QuantIsaName(info.param));
                         });

// A product by w [m, k] quantized as `quant` on x [n, k], by `act` (a backend made with an
// activation quantization) and by `exact`: both outputs, and act's packed weight (its buffer kept).
struct BothProducts {
  std::vector<float> act, exact;
  Buffer buffer;
  Tensor packed;
};
void RunBoth(Backend& act, Backend& exact, WeightQuant quant, std::vector<float>& w, std::vector<float>& x, int64_t n,
             int64_t m, int64_t k, BothProducts* out) {
  const std::string what = absl::StrCat(WeightQuantName(quant), " weights");
  out->act.assign(n * m, 0.0f);
  out->exact.assign(n * m, 0.0f);
  Tensor packed_exact;
  absl::StatusOr<Buffer> b_act = act.PackMatMulWeight(Tensor(w.data(), DType::kF32, {m, k}), &out->packed, quant);
  absl::StatusOr<Buffer> b_exact = exact.PackMatMulWeight(Tensor(w.data(), DType::kF32, {m, k}), &packed_exact, quant);
  ASSERT_TRUE(b_act.ok() && b_exact.ok()) << what;
  out->buffer = std::move(*b_act);
  const Tensor tx(x.data(), DType::kF32, {n, k});
  Tensor ty_act(out->act.data(), DType::kF32, {n, m}), ty_exact(out->exact.data(), DType::kF32, {n, m});
  ASSERT_TRUE(act.MatMul(&ty_act, tx, out->packed, nullptr).ok()) << what;
  ASSERT_TRUE(exact.MatMul(&ty_exact, tx, packed_exact, nullptr).ok()) << what;
}

// --activation-quantization int8 (CpuActivationQuant::kInt8): the backend's products by int8 and
// int4 weights are the instance Int8ActivationsIsa names (VNNI where the CPU has it, else AVX2's):
// bitwise the same as cpu::Int8MatMul / Int4MatMul called with it on the packed buffer, so within
// kVnniLimit of the exact backend's and not equal to them; fp8's stay the exact instance's, bit for
// bit. Describe says which runs. On a CPU with neither, MakeCpuBackend refuses, naming both. The
// names parse both ways.
TEST(CpuActivationQuantTest, IntWeightsRunTheInt8ActivationsInstance) {
  EXPECT_EQ(*ParseCpuActivationQuant("none"), CpuActivationQuant::kNone);
  EXPECT_EQ(*ParseCpuActivationQuant("int8"), CpuActivationQuant::kInt8);
  EXPECT_STREQ(CpuActivationQuantName(CpuActivationQuant::kInt8), "int8");
  const absl::StatusOr<CpuActivationQuant> bad = ParseCpuActivationQuant("int4");
  EXPECT_TRUE(IsInvalidArgumentNaming(bad.status(), "'int4'")) << bad.status();
  EXPECT_NE(bad.status().message().find("auto, none, int8 or int16"), std::string::npos) << bad.status();
  absl::StatusOr<std::unique_ptr<Backend>> act = MakeCpuBackend(2, CpuMatMul::kF32, CpuActivationQuant::kInt8);
  const std::optional<cpu::QuantIsa> isa = cpu::Int8ActivationsIsa();
  if (!isa.has_value()) {
    EXPECT_EQ(act.status().code(), absl::StatusCode::kFailedPrecondition) << act.status();
    EXPECT_NE(act.status().message().find("VNNI or AVX2"), std::string::npos) << act.status();
    GTEST_SKIP() << "this CPU lacks AVX-512 VNNI and AVX2: refused, as it must be";
  }
  EXPECT_EQ(*isa, cpu::QuantIsaSupported(cpu::QuantIsa::kAvx512Vnni) ? cpu::QuantIsa::kAvx512Vnni
                                                                     : cpu::QuantIsa::kAvx2Int8);
  ASSERT_TRUE(act.ok()) << act.status();
  EXPECT_NE((*act)->Describe().find(absl::StrCat("int8/int4 products on ", cpu::QuantIsaName(*isa))), std::string::npos)
      << (*act)->Describe();
  std::unique_ptr<Backend> exact = MakeCpuBackend(2);
  std::mt19937 rng(41);
  const int64_t n = 5, m = 33, k = 300;
  std::vector<float> w = Random(rng, m * k), x = Random(rng, n * k);
  for (WeightQuant quant : {WeightQuant::kInt8, WeightQuant::kInt4, WeightQuant::kFp8}) {
    const std::string what = absl::StrCat(WeightQuantName(quant), " weights");
    BothProducts both;
    ASSERT_NO_FATAL_FAILURE(RunBoth(**act, *exact, quant, w, x, n, m, k, &both));
    const std::vector<float>& y_act = both.act, &y_exact = both.exact;
    const Tensor& packed_act = both.packed;
    std::vector<float> y_direct(n * m);
    if (quant == WeightQuant::kFp8) {
      EXPECT_EQ(y_act, y_exact) << what << ": fp8 has no integer instance and must stay exact";
      continue;
    }
    if (quant == WeightQuant::kInt8) {
      const auto* scale = static_cast<const float*>(packed_act.data);
      const auto* q = static_cast<const int8_t*>(packed_act.data) + Int8RowsLayout{m, k}.scale_bytes();
      cpu::Int8MatMul(y_direct.data(), x.data(), n, m, k, q, scale, nullptr, 1, *isa);
    } else {
      cpu::Int4MatMul(y_direct.data(), x.data(), n, m, k, static_cast<const Int4Group128*>(packed_act.data), nullptr,
                      1, *isa);
    }
    EXPECT_EQ(y_act, y_direct) << what << ": the backend's product is not the " << cpu::QuantIsaName(*isa)
                               << " instance's";
    EXPECT_NE(y_act, y_exact) << what << ": int8 activations gave the exact products bit for bit";
    ExpectClose(what + " with int8 activations", y_act, std::vector<double>(y_exact.begin(), y_exact.end()),
                kVnniLimit);
  }
}

// --activation-quantization int16 (CpuActivationQuant::kInt16): the backend's products by int4
// weights are PanelMatMulInt4Act16's on the packed panels, bit for bit, so within kInt16Limit of the
// exact backend's and not equal to them; int8 and fp8 weights' stay exact, bit for bit. Describe
// says so. On a CPU without AVX-512 VNNI, MakeCpuBackend refuses, naming it. The name parses both
// ways, and auto (the default) is int16 exactly where the CPU has AVX-512 VNNI.
TEST(CpuActivationQuantTest, Int4WeightsRunOnInt16Activations) {
  EXPECT_EQ(*ParseCpuActivationQuant("int16"), CpuActivationQuant::kInt16);
  EXPECT_STREQ(CpuActivationQuantName(CpuActivationQuant::kInt16), "int16");
  // auto, the workers' default: int16 where the CPU has AVX-512 VNNI, else the exact products.
  const CpuActivationQuant by_default =
      cpu::QuantIsaSupported(cpu::QuantIsa::kAvx512Vnni) ? CpuActivationQuant::kInt16 : CpuActivationQuant::kNone;
  EXPECT_EQ(DefaultCpuActivationQuant(), by_default);
  EXPECT_EQ(*ParseCpuActivationQuant("auto"), by_default);
  absl::StatusOr<std::unique_ptr<Backend>> act = MakeCpuBackend(2, CpuMatMul::kF32, CpuActivationQuant::kInt16);
  if (!cpu::QuantIsaSupported(cpu::QuantIsa::kAvx512Vnni)) {
    EXPECT_EQ(act.status().code(), absl::StatusCode::kFailedPrecondition) << act.status();
    EXPECT_NE(act.status().message().find("AVX-512 VNNI"), std::string::npos) << act.status();
    GTEST_SKIP() << "this CPU lacks AVX-512 VNNI: refused, as it must be";
  }
  ASSERT_TRUE(act.ok()) << act.status();
  EXPECT_NE((*act)->Describe().find("int4 products on avx512vnni panels (activations rounded to int16"),
            std::string::npos)
      << (*act)->Describe();
  std::unique_ptr<Backend> exact = MakeCpuBackend(2);
  std::mt19937 rng(53);
  const int64_t n = 5, m = 70, k = 300;
  std::vector<float> w = Random(rng, m * k), x = Random(rng, n * k);
  for (WeightQuant quant : {WeightQuant::kInt8, WeightQuant::kInt4, WeightQuant::kFp8}) {
    const std::string what = absl::StrCat(WeightQuantName(quant), " weights");
    BothProducts both;
    ASSERT_NO_FATAL_FAILURE(RunBoth(**act, *exact, quant, w, x, n, m, k, &both));
    const std::vector<float>& y_act = both.act, &y_exact = both.exact;
    const Tensor& packed_act = both.packed;
    std::vector<float> y_direct(n * m);
    if (quant != WeightQuant::kInt4) {
      EXPECT_EQ(y_act, y_exact) << what << ": only int4 weights run on int16 activations";
      continue;
    }
    cpu::PanelMatMulInt4Act16(y_direct.data(), x.data(), n, m, k,
                              static_cast<const cpu::Int4PanelGroup*>(packed_act.data), nullptr, 1);
    EXPECT_EQ(y_act, y_direct) << what << ": the backend's product is not PanelMatMulInt4Act16's";
    EXPECT_NE(y_act, y_exact) << what << ": int16 activations gave the exact products bit for bit";
    ExpectClose(what + " with int16 activations", y_act, std::vector<double>(y_exact.begin(), y_exact.end()),
                kInt16Limit);
  }
}

// ---- int4 weights (kernels/quant.h Int4Group128, kernels/cpu/int4_matmul.h) ------------------

// QuantizeWeight, what both backends quantize a weight with at load: with the rows shared among
// 1, 3 or 7 threads, the bytes of each format's own quantizer in one call, for rows that split
// unevenly and an int4 k off 128; a non-finite weight is refused naming its row and column in the
// whole weight (not in a thread's rows) before anything is written; kNone is refused.
// oneDNN's cap (ONEDNN_MAX_CPU_ISA, kernels/cpu/isa_cap.h) caps our own products' dispatch too: each
// "supported" answer is the CPU's own bits and what the cap allows, whatever the environment. ctest
// runs this program's IsaCap cases twice: as every case (no cap), and as kernels_cpu_avx2_cap with
// ONEDNN_MAX_CPU_ISA=AVX2 and SHARDSERVE_TEST_EXPECT_AVX2_CAP=1, where on an AVX-512 CPU every
// product must pick its AVX2 instance.
TEST(IsaCap, EveryDispatchFollowsTheCap) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  const bool allow512 = cpu::IsaCapAllows(cpu::IsaLevel::kAvx512);
  EXPECT_EQ(cpu::QuantIsaSupported(cpu::QuantIsa::kAvx2), avx2 && cpu::IsaCapAllows(cpu::IsaLevel::kAvx2));
  EXPECT_EQ(cpu::QuantIsaSupported(cpu::QuantIsa::kAvx512), avx512 && allow512);
  EXPECT_EQ(cpu::QuantIsaSupported(cpu::QuantIsa::kAvx512Vnni),
            avx512 && __builtin_cpu_supports("avx512vnni") && cpu::IsaCapAllows(cpu::IsaLevel::kAvx512Vnni));
  EXPECT_EQ(cpu::PanelTilesSupported(cpu::PanelTiles::kAvx512), __builtin_cpu_supports("avx512f") && allow512);
  EXPECT_EQ(cpu::CpuHasAvx512Bf16(),
            avx512 && __builtin_cpu_supports("avx512bf16") && cpu::IsaCapAllows(cpu::IsaLevel::kAvx512Bf16));
  // The levels nest: a cap that allows one allows those below it.
  EXPECT_LE(cpu::IsaCapAllows(cpu::IsaLevel::kAvx512Bf16), cpu::IsaCapAllows(cpu::IsaLevel::kAvx512Vnni));
  EXPECT_LE(cpu::IsaCapAllows(cpu::IsaLevel::kAvx512Vnni), allow512);
  EXPECT_LE(allow512, cpu::IsaCapAllows(cpu::IsaLevel::kAvx2));
  const char* expect = std::getenv("SHARDSERVE_TEST_EXPECT_AVX2_CAP");
  if (expect == nullptr || std::string(expect) != "1") return;
  // Under ONEDNN_MAX_CPU_ISA=AVX2 (ctest kernels_cpu_avx2_cap): nothing above AVX2, on any CPU.
  ASSERT_FALSE(allow512) << "ONEDNN_MAX_CPU_ISA=" << (std::getenv("ONEDNN_MAX_CPU_ISA") ?: "(unset)")
                         << " did not cap oneDNN at AVX2";
  EXPECT_EQ(cpu::IsaCapAllows(cpu::IsaLevel::kAvx2), avx2);
  EXPECT_EQ(cpu::ActivePanelTiles(), cpu::PanelTiles::kVec8);
  EXPECT_FALSE(cpu::CpuHasAvx512Bf16());
  EXPECT_FALSE(cpu::OneDnnHasBf16MatMul());
  EXPECT_FALSE(CpuHasNativeBf16MatMul());
  if (!avx2) return;
  EXPECT_EQ(cpu::ActiveQuantIsa(), cpu::QuantIsa::kAvx2);
  EXPECT_EQ(cpu::Int8ActivationsIsa(), cpu::QuantIsa::kAvx2Int8);
  const std::string f32 = MakeCpuBackend(1, CpuMatMul::kF32)->Describe();
  EXPECT_NE(f32.find("int8/int4 products on 8-float panels"), std::string::npos) << f32;
  EXPECT_NE(f32.find(", within ONEDNN_MAX_CPU_ISA=AVX2: AVX2]"), std::string::npos) << f32;
  EXPECT_EQ(f32.find("avx512 tiles"), std::string::npos) << f32;
  const std::string bf16 = MakeCpuBackend(1, CpuMatMul::kBF16)->Describe();
  EXPECT_NE(bf16.find("bf16 products on 8-float panels"), std::string::npos) << bf16;
}

TEST(IsaCap, AValueOneDnnWouldIgnoreIsRefusedByName) {
  const char* before = std::getenv("ONEDNN_MAX_CPU_ISA");
  const std::string saved = before != nullptr ? before : "";
  const auto restore = [&] {
    if (before != nullptr) {
      setenv("ONEDNN_MAX_CPU_ISA", saved.c_str(), 1);
    } else {
      unsetenv("ONEDNN_MAX_CPU_ISA");
    }
  };
  // oneDNN fixed its cap at its first query: these change only what the check reads.
  setenv("ONEDNN_MAX_CPU_ISA", "avx2", 1);  // oneDNN's names, any case
  EXPECT_TRUE(cpu::CheckIsaCapSetting().ok()) << cpu::CheckIsaCapSetting();
  setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16", 1);
  EXPECT_TRUE(cpu::CheckIsaCapSetting().ok()) << cpu::CheckIsaCapSetting();
  setenv("ONEDNN_MAX_CPU_ISA", "avx-512", 1);
  const absl::Status bad = cpu::CheckIsaCapSetting();
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeCpuBackend(1, CpuMatMul::kF32, CpuActivationQuant::kNone);
  restore();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
  EXPECT_NE(bad.message().find("ONEDNN_MAX_CPU_ISA='avx-512'"), std::string::npos) << bad;
  EXPECT_NE(bad.message().find("AVX512_CORE"), std::string::npos) << bad;  // what it would take
  EXPECT_EQ(backend.status(), bad);
}

TEST(QuantizeWeightTest, ThreadsGiveTheQuantizersBytesAndRefuseWithTheWholeWeightsPlace) {
  std::mt19937 rng(29);
  const int64_t m = 101, k = 300;
  std::vector<float> w = Random(rng, m * k, -2.0f, 3.0f);
  std::fill(w.begin() + 40 * k, w.begin() + 41 * k, 0.0f);  // an all-zero row
  for (WeightQuant quant : {WeightQuant::kInt8, WeightQuant::kFp8, WeightQuant::kInt4}) {
    SCOPED_TRACE(WeightQuantName(quant));
    const auto bytes = static_cast<size_t>(QuantizedWeightBytes(quant, m, k));
    std::vector<uint8_t> want(bytes);
    absl::Status s;
    if (quant == WeightQuant::kInt4) {
      s = QuantizeInt4Groups(reinterpret_cast<Int4Group128*>(want.data()), w.data(), m, k);
    } else if (quant == WeightQuant::kInt8) {
      s = QuantizeInt8Rows(reinterpret_cast<float*>(want.data()),
                           reinterpret_cast<int8_t*>(want.data() + Int8RowsLayout{m, k}.scale_bytes()), w.data(), m, k);
    } else {
      s = QuantizeFp8Rows(reinterpret_cast<float*>(want.data()), want.data() + Fp8RowsLayout{m, k}.scale_bytes(),
                          w.data(), m, k);
    }
    ASSERT_TRUE(s.ok()) << s;
    for (int threads : {1, 3, 7}) {
      std::vector<uint8_t> got(bytes, 0xAB);
      ASSERT_TRUE(QuantizeWeight(quant, got.data(), w.data(), m, k, threads).ok());
      EXPECT_TRUE(got == want) << threads << " threads";
    }
    std::vector<float> bad = w;
    bad[97 * k + 5] = std::numeric_limits<float>::quiet_NaN();
    std::vector<uint8_t> untouched(bytes, 0xAB);
    s = QuantizeWeight(quant, untouched.data(), bad.data(), m, k, 7);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(s.message()).find("[97, 5]"), std::string::npos) << s;
    EXPECT_TRUE(std::all_of(untouched.begin(), untouched.end(), [](uint8_t b) { return b == 0xAB; }));
  }
  std::vector<uint8_t> none(16);
  EXPECT_EQ(QuantizeWeight(WeightQuant::kNone, none.data(), w.data(), 1, 4).code(), absl::StatusCode::kInvalidArgument);
}

// The same from 16-bit weights (what the CUDA backend quantizes its act-dtype weights with): the
// bytes of widening the whole weight to float32 first, for bf16 and f16, 1, 3 or 7 threads, one
// chunk of rows a thread and many (k = 70,000: 3 rows a chunk); an Inf or NaN named at its place
// in the whole weight with nothing written; a dtype no quantizer takes refused.
TEST(QuantizeWeightTest, SixteenBitWeightsGiveTheBytesOfTheirFloat32Values) {
  std::mt19937 rng(31);
  for (const auto& [m, k] : {std::pair<int64_t, int64_t>{101, 300}, std::pair<int64_t, int64_t>{40, 70000}}) {
    const std::vector<float> wide = Random(rng, m * k, -2.0f, 3.0f);
    for (const DType dtype : {DType::kBF16, DType::kF16}) {
      std::vector<uint16_t> w16(static_cast<size_t>(m * k));
      ASSERT_TRUE(ConvertOnHost(w16.data(), dtype, wide.data(), DType::kF32, w16.size()));
      std::vector<float> w(w16.size());
      ASSERT_TRUE(ConvertOnHost(w.data(), DType::kF32, w16.data(), dtype, w.size()));
      for (WeightQuant quant : {WeightQuant::kInt8, WeightQuant::kFp8, WeightQuant::kInt4}) {
        SCOPED_TRACE(::testing::Message() << WeightQuantName(quant) << " from " << DTypeName(dtype) << ", k " << k);
        const auto bytes = static_cast<size_t>(QuantizedWeightBytes(quant, m, k));
        std::vector<uint8_t> want(bytes);
        ASSERT_TRUE(QuantizeWeight(quant, want.data(), w.data(), m, k, 1).ok());
        for (int threads : {1, 3, 7}) {
          std::vector<uint8_t> got(bytes, 0xAB);
          ASSERT_TRUE(QuantizeWeight(quant, got.data(), w16.data(), dtype, m, k, threads).ok());
          EXPECT_TRUE(got == want) << threads << " threads";
        }
        for (const float bad_value : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
          std::vector<uint16_t> bad = w16;
          ASSERT_TRUE(ConvertOnHost(&bad[(m - 3) * k + 5], dtype, &bad_value, DType::kF32, 1));
          std::vector<uint8_t> untouched(bytes, 0xAB);
          const absl::Status s = QuantizeWeight(quant, untouched.data(), bad.data(), dtype, m, k, 7);
          EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
          EXPECT_NE(std::string(s.message()).find(absl::StrCat("[", m - 3, ", 5]")), std::string::npos) << s;
          EXPECT_TRUE(std::all_of(untouched.begin(), untouched.end(), [](uint8_t b) { return b == 0xAB; }));
        }
      }
    }
  }
  std::vector<uint8_t> out(16);
  const std::vector<int32_t> ints(4);
  EXPECT_EQ(QuantizeWeight(WeightQuant::kInt8, out.data(), ints.data(), DType::kI32, 1, 4).code(),
            absl::StatusCode::kInvalidArgument);
}

// The block format's reference: every weight within one step (scale) of its value (half a step
// from its own rounding, up to half more where the zero point's rounding clamps it at 0 or 15),
// the zero point in [0, 15], an all-zero group scale 0, a short last group when k is not a
// multiple of 128, a non-finite weight refused with its place named. Rows of k = 64, 128, 300 and
// one 0..127 ramp whose packing is checked nibble by nibble against the declared layout.
TEST(Int4QuantTest, QuantizeIsWithinAStepAndDequantizeInverts) {
  static_assert(sizeof(Int4Group128) == 72);
  std::mt19937 rng(13);
  for (int64_t k : {64, 128, 300}) {
    const int64_t m = 5;
    const Int4GroupsLayout layout{m, k};
    std::vector<float> w = Random(rng, m * k, -3.0f, 2.0f);
    std::fill(w.begin() + 2 * k, w.begin() + 3 * k, 0.0f);  // row 2: all zero
    for (int64_t c = 0; c < k; ++c) w[4 * k + c] = std::fabs(w[4 * k + c]);  // row 4: all >= 0, so zero 0
    std::vector<Int4Group128> blocks(m * layout.groups_per_row());
    ASSERT_TRUE(QuantizeInt4Groups(blocks.data(), w.data(), m, k).ok());
    std::vector<float> back(m * k);
    DequantizeInt4Groups(back.data(), blocks.data(), m, k);
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t c = 0; c < k; ++c) {
        const Int4Group128& b = blocks[r * layout.groups_per_row() + c / kInt4GroupSize];
        EXPECT_LE(b.zero, 15);
        EXPECT_LE(std::fabs(back[r * k + c] - w[r * k + c]), b.scale * (1 + 1e-5f)) << k << ": " << r << ", " << c;
        if (r == 2) {
          EXPECT_EQ(b.scale, 0.0f);
        }
        if (r == 4) {
          EXPECT_EQ(b.zero, 0);
        }
      }
    }
    // The short last group's unused nibbles are 0.
    if (k % kInt4GroupSize != 0) {
      const Int4Group128& last = blocks[layout.groups_per_row() - 1];
      for (int64_t j = k % kInt4GroupSize; j < kInt4GroupSize; ++j) {
        EXPECT_EQ(j < 64 ? (last.q[j] & 15) : (last.q[j - 64] >> 4), 0) << "unused value " << j;
      }
    }
    w[3 * k + 4] = std::numeric_limits<float>::infinity();
    const absl::Status s = QuantizeInt4Groups(blocks.data(), w.data(), m, k);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(s.message()).find("[3, 4]"), std::string::npos) << s;
  }
  // A ramp 0..127: lo 0, hi 127, scale 127 / 15, zero 0, value j -> round(15 j / 127), value j in
  // the low nibble of byte j and value j + 64 in the high nibble of byte j.
  std::vector<float> ramp(128);
  for (int j = 0; j < 128; ++j) ramp[j] = static_cast<float>(j);
  Int4Group128 b;
  ASSERT_TRUE(QuantizeInt4Groups(&b, ramp.data(), 1, 128).ok());
  EXPECT_FLOAT_EQ(b.scale, 127.0f / 15);
  EXPECT_EQ(b.zero, 0);
  for (int j = 0; j < 64; ++j) {
    EXPECT_EQ(b.q[j] & 15, static_cast<int>(std::round(j / b.scale))) << j;
    EXPECT_EQ(b.q[j] >> 4, static_cast<int>(std::round((j + 64) / b.scale))) << j + 64;
  }
  EXPECT_EQ(ParseWeightQuant("int4").value(), WeightQuant::kInt4);
  EXPECT_STREQ(WeightQuantName(WeightQuant::kInt4), "int4");
}

// A product by an int4 weight equals the product by its dequantized weight (the reference). The
// kernel sums x x q and x per group and applies scale x (sum x q - zero x sum x): the two sums
// (q in [0, 15], not centred) are up to ~8x larger than their difference, so float32 rounding costs
// ~10x the int8 products' 1e-5: 1e-4 normalized (measured up to 2.5e-5 on one output; a wrong
// nibble, zero or scale gives > 1e-2). The int4 panels of AVX-512 CPUs (kernels/cpu/panel_matmul.h)
// sum the same way, one chain per output and group. k with and without a short last group (odd
// and even), m with tile and block tails, n = 1, 3, 4 (4-panel tiles), 6, 32 (2-panel tiles)
// with and without bias; outputs start as NaN (a skipped output fails) and guards are checked. The
// packed weight is I8 and holds exactly the reference's blocks (as panels where the CPU
// multiplies them so).
TEST_F(CpuBackendTest, Int4MatMulEqualsTheDequantizedProduct) {
  for (auto [k, m] : {std::pair<int64_t, int64_t>{128, 1}, {256, 33}, {64, 7}, {300, 13}, {1024, 257}, {129, 5}}) {
    const std::vector<float> w = Random(rng_, m * k), b = Random(rng_, m);
    const Int4GroupsLayout layout{m, k};
    std::vector<Int4Group128> blocks(m * layout.groups_per_row());
    ASSERT_TRUE(QuantizeInt4Groups(blocks.data(), w.data(), m, k).ok());
    std::vector<float> dequantized(m * k);
    DequantizeInt4Groups(dequantized.data(), blocks.data(), m, k);
    Tensor packed;
    Buffer packed_buffer;
    {
      DeviceTensor dw(backend_.get(), DType::kF32, {m, k});
      dw.Upload(w);
      absl::StatusOr<Buffer> buffer = backend_->PackMatMulWeight(dw.t(), &packed, WeightQuant::kInt4);
      ASSERT_TRUE(buffer.ok()) << buffer.status();
      EXPECT_EQ(packed.dtype, DType::kI8);
      EXPECT_EQ(packed.bytes(), static_cast<size_t>(layout.bytes()));
      if (cpu::IntOnPanels(cpu::ActiveQuantIsa())) {  // the blocks as panels (kernels/cpu/panel_matmul.h)
        std::vector<cpu::Int4PanelGroup> panels(cpu::Int4PanelGroupCount(m, k));
        cpu::PackPanelsInt4(panels.data(), blocks.data(), m, k);
        ASSERT_EQ(buffer->bytes(), panels.size() * sizeof(cpu::Int4PanelGroup));
        EXPECT_EQ(std::memcmp(buffer->data(), panels.data(), buffer->bytes()), 0);
      } else {
        ASSERT_EQ(buffer->bytes(), static_cast<size_t>(layout.bytes()));
        EXPECT_EQ(std::memcmp(buffer->data(), blocks.data(), layout.bytes()), 0);
      }
      packed_buffer = std::move(*buffer);
      dw.Poison();  // MatMul must read only the packed copy
    }
    ASSERT_NO_FATAL_FAILURE(ExpectQuantizedProducts(backend_.get(), rng_, WeightQuant::kInt4, packed, dequantized, b,
                                                    k, m, {1, 3, 4, 6, 32}, 1e-4));
  }
  // The backend says which instance runs and what the CPU has.
  const cpu::QuantIsa isa = cpu::ActiveQuantIsa();
  EXPECT_NE(
      backend_->Describe().find(!cpu::IntOnPanels(isa) ? "int8/fp8/int4 products on "
                                : isa == cpu::QuantIsa::kAvx512
                                    ? "int8/fp8/int4 products on 16-float panels (codes widened in registers)"
                                    : "int8/int4 products on 8-float panels (codes widened in registers), fp8 on avx2"),
      std::string::npos)
      << backend_->Describe();
}

// bf16 products really round (MatMulWithPackedWeight above checks them against the rounded
// inputs' products), and a BF16 tensor is only a weight when PackMatMulWeight made it.
TEST_F(CpuBackendTest, Bf16ProductsRoundTheirInputs) {
  if (!CpuRunsBf16Products()) GTEST_SKIP() << kNoBf16Products;
  std::unique_ptr<Backend> backend = MakeCpuBackend(2, CpuMatMul::kBF16);
  EXPECT_NE(backend->Describe().find("bf16"), std::string::npos) << backend->Describe();
  // Where oneDNN has no bf16 product (CPUID shows no AVX-512) the backend's bf16 panels run them.
  EXPECT_EQ(backend->Describe().find("bf16 products on 8-float panels") != std::string::npos, !CpuHasAvx512Core())
      << backend->Describe() << OneDnnIsaCap();
  // 1 + 2^-10 rounds to 1 in bf16: sixteen of them times ones is exactly 16, not 16.015625.
  const int64_t k = 16, m = 16;
  DeviceTensor dw(backend.get(), DType::kF32, {m, k});
  dw.Upload(std::vector<float>(m * k, 1.0f));
  Tensor packed;
  absl::StatusOr<Buffer> buffer = backend->PackMatMulWeight(dw.t(), &packed);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  DeviceTensor dx(backend.get(), DType::kF32, {1, k});
  dx.Upload(std::vector<float>(k, 1.0f + 1.0f / 1024));
  DeviceTensor out(backend.get(), DType::kF32, {1, m});
  ASSERT_TRUE(backend->MatMul(out.ptr(), dx.t(), packed, nullptr).ok());
  for (float y : out.Download<float>()) EXPECT_EQ(y, 16.0f);
  // A BF16 tensor that PackMatMulWeight did not make is not a weight MatMul can read.
  DeviceTensor stray(backend.get(), DType::kBF16, {m, k});
  const absl::Status s = backend->MatMul(out.ptr(), dx.t(), stray.t(), nullptr);
  EXPECT_TRUE(IsInvalidArgumentNaming(s, "MatMul")) << s;
}

// A packed weight is used whole: a view of some of its rows is refused (its bytes are in
// oneDNN's layout, not rows), and so is packing something that is not an F32 matrix.
TEST_F(CpuBackendTest, PackedWeightRefusesPartsAndBadInput) {
  const int64_t k = 32, m = 48;
  DeviceTensor dw = F32({m, k}, Random(rng_, m * k));
  Tensor packed;
  absl::StatusOr<Buffer> buffer = backend_->PackMatMulWeight(dw.t(), &packed);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  DeviceTensor x = F32({2, k}, Random(rng_, 2 * k));
  DeviceTensor out = Output(DType::kF32, {2, m - 16});
  const absl::Status s = backend_->MatMul(out.ptr(), x.t(), packed.Rows(16, m), nullptr);
  EXPECT_TRUE(IsInvalidArgumentNaming(s, "MatMul")) << s;
  EXPECT_NE(s.message().find("packed"), std::string::npos) << s;

  DeviceTensor ids = I32({2, 2}, {1, 2, 3, 4});
  DeviceTensor vec = F32({k}, Random(rng_, k));
  Tensor unused;
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->PackMatMulWeight(ids.t(), &unused).status(), "PackMatMulWeight"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->PackMatMulWeight(vec.t(), &unused).status(), "PackMatMulWeight"));
}

// ---- RmsNorm ---------------------------------------------------------------------------------

TEST_F(CpuBackendTest, RmsNorm) {
  const int64_t n = 4, d = 1003;
  for (float eps : {1e-5f, 1e-6f}) {
    const std::vector<float> x = Random(rng_, n * d, -3.0f, 3.0f), w = Random(rng_, d, 0.5f, 1.5f);
    DeviceTensor dx = F32({n, d}, x), dw = F32({d}, w);
    DeviceTensor out = Output(DType::kF32, {n, d});
    ASSERT_TRUE(backend_->RmsNorm(out.ptr(), dx.t(), dw.t(), eps).ok());

    std::vector<double> want(n * d);
    for (int64_t t = 0; t < n; ++t) {
      double ss = 0.0;
      for (int64_t i = 0; i < d; ++i) ss += static_cast<double>(x[t * d + i]) * x[t * d + i];
      const double inv_rms = 1.0 / std::sqrt(ss / d + eps);
      for (int64_t i = 0; i < d; ++i) want[t * d + i] = w[i] * (x[t * d + i] * inv_rms);
    }
    // Each output is a handful of float32 roundings (variance, sqrt, reciprocal, two products):
    // under 5 ulp, i.e. below 3e-7 relative to itself. 1e-6 gives headroom.
    ExpectClose(absl::StrCat("RmsNorm eps=", eps), out.Download<float>(), want, 1e-6);
    EXPECT_TRUE(out.GuardsIntact());
  }
}

// In place over the heads of q, as Qwen3's q_norm runs: [tokens * heads, head_dim] viewed on
// [tokens, heads * head_dim]; the same bits as into another buffer.
TEST_F(CpuBackendTest, RmsNormInPlaceOverHeads) {
  const int64_t tokens = 3, heads = 4, head_dim = 128;
  const std::vector<float> x = Random(rng_, tokens * heads * head_dim, -3.0f, 3.0f), w = Random(rng_, head_dim, 0.5f, 1.5f);
  DeviceTensor in_place = F32({tokens, heads * head_dim}, x), src = F32({tokens * heads, head_dim}, x),
               dw = F32({head_dim}, w);
  DeviceTensor out = Output(DType::kF32, {tokens * heads, head_dim});
  ASSERT_TRUE(backend_->RmsNorm(out.ptr(), src.t(), dw.t(), 1e-6f).ok());
  Tensor heads_view(in_place.t().data, DType::kF32, {tokens * heads, head_dim});
  ASSERT_TRUE(backend_->RmsNorm(&heads_view, heads_view, dw.t(), 1e-6f).ok());
  EXPECT_EQ(in_place.Download<float>(), out.Download<float>());
  EXPECT_NE(in_place.Download<float>(), x);
  EXPECT_TRUE(in_place.GuardsIntact());
}

// ---- Rope ------------------------------------------------------------------------------------

// inv_freq as transformers computes it, in float32: 1 / base^(2i / head_dim).
std::vector<float> InvFreq(int head_dim, float base) {
  std::vector<float> inv(head_dim / 2);
  for (int i = 0; i < head_dim / 2; ++i) {
    inv[i] = 1.0f / std::pow(base, static_cast<float>(2 * i) / static_cast<float>(head_dim));
  }
  return inv;
}

TEST_F(CpuBackendTest, RopeMatchesReference) {
  const int hd = 64, half = hd / 2;
  const int64_t q_heads = 4, kv_heads = 2;
  const std::vector<int32_t> positions = {0, 1, 7, 100, 4095};
  const int64_t n = static_cast<int64_t>(positions.size());
  const std::vector<float> inv_freq = InvFreq(hd, 10000.0f);
  const std::vector<float> q = Random(rng_, n * q_heads * hd), k = Random(rng_, n * kv_heads * hd);
  DeviceTensor dq = F32({n, q_heads * hd}, q), dk = F32({n, kv_heads * hd}, k);
  DeviceTensor dpos = I32({n}, positions), dfreq = F32({half}, inv_freq);
  ASSERT_TRUE(backend_->Rope(dq.ptr(), dk.ptr(), dpos.t(), dfreq.t(), hd, {}).ok());

  // Reference: the angle is float32 (position * inv_freq, as transformers computes freqs); the
  // rotation is done in double.
  const auto reference = [&](const std::vector<float>& x, int64_t heads) {
    std::vector<double> y(x.size());
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const float* xh = x.data() + (t * heads + h) * hd;
        double* yh = y.data() + (t * heads + h) * hd;
        for (int i = 0; i < half; ++i) {
          const float angle = static_cast<float>(positions[t]) * inv_freq[i];
          const double c = std::cos(static_cast<double>(angle)), s = std::sin(static_cast<double>(angle));
          yh[i] = xh[i] * c - xh[i + half] * s;
          yh[i + half] = xh[i + half] * c + xh[i] * s;
        }
      }
    }
    return y;
  };
  // float32 cos/sin are within an ulp, and each output adds two rounded products: a few ulp of
  // values ~1, so ~3e-7. 1e-6 gives headroom; a wrong pairing or angle is O(1).
  ExpectClose("Rope q", dq.Download<float>(), reference(q, q_heads), 1e-6);
  ExpectClose("Rope k", dk.Download<float>(), reference(k, kv_heads), 1e-6);
  EXPECT_TRUE(dq.GuardsIntact());
  EXPECT_TRUE(dk.GuardsIntact());
}

// RopeOptions: the first rotary_dim dimensions of each head rotated as pairs (i, i + rotary_dim / 2),
// the rest passed through bit for bit; cos and sin times attention_factor; the positions from
// long_from on with long_inv_freq (LongRoPE). As transformers' Phi3 apply_rotary_pos_emb with
// cos = emb.cos() * attention_scaling.
TEST_F(CpuBackendTest, RopeWithPartialRotaryAttentionFactorAndLongFrequencies) {
  const int hd = 16, rd = 12, half = rd / 2;
  const int64_t q_heads = 2, kv_heads = 1;
  const std::vector<int32_t> positions = {0, 3, 31, 32, 77};
  const int64_t n = static_cast<int64_t>(positions.size()), long_from = 32;
  const float factor = 1.25f;
  const std::vector<float> short_freq = InvFreq(rd, 10000.0f), long_freq = InvFreq(rd, 160000.0f);
  const std::vector<float> q = Random(rng_, n * q_heads * hd), k = Random(rng_, n * kv_heads * hd);
  DeviceTensor dq = F32({n, q_heads * hd}, q), dk = F32({n, kv_heads * hd}, k);
  DeviceTensor dpos = I32({n}, positions), dfreq = F32({half}, short_freq), dlong = F32({half}, long_freq);
  const RopeOptions options{.rotary_dim = rd, .attention_factor = factor, .long_inv_freq = &dlong.t(),
                            .long_from = long_from};
  ASSERT_TRUE(backend_->Rope(dq.ptr(), dk.ptr(), dpos.t(), dfreq.t(), hd, options).ok());

  const auto reference = [&](const std::vector<float>& x, int64_t heads) {
    std::vector<double> y(x.begin(), x.end());
    for (int64_t t = 0; t < n; ++t) {
      const std::vector<float>& freq = positions[t] >= long_from ? long_freq : short_freq;
      for (int64_t h = 0; h < heads; ++h) {
        const float* xh = x.data() + (t * heads + h) * hd;
        double* yh = y.data() + (t * heads + h) * hd;
        for (int i = 0; i < half; ++i) {
          const float angle = static_cast<float>(positions[t]) * freq[i];
          const double c = std::cos(static_cast<double>(angle)) * factor;
          const double s = std::sin(static_cast<double>(angle)) * factor;
          yh[i] = xh[i] * c - xh[i + half] * s;
          yh[i + half] = xh[i + half] * c + xh[i] * s;
        }
      }
    }
    return y;
  };
  // As RopeMatchesReference, the values scaled by 1.25.
  ExpectClose("Rope q", dq.Download<float>(), reference(q, q_heads), 1.5e-6);
  ExpectClose("Rope k", dk.Download<float>(), reference(k, kv_heads), 1.5e-6);
  // The pass-through dimensions are the input's bits.
  const std::vector<float> got = dq.Download<float>();
  for (int64_t row = 0; row < n * q_heads; ++row) {
    for (int d = rd; d < hd; ++d) EXPECT_EQ(got[row * hd + d], q[row * hd + d]) << "row " << row << " dim " << d;
  }
  EXPECT_TRUE(dq.GuardsIntact());
  EXPECT_TRUE(dk.GuardsIntact());
}

// Options that do not fit the heads are refused, naming what is wrong, and nothing is written.
TEST_F(CpuBackendTest, RopeRefusesBadOptions) {
  const int hd = 8;
  const std::vector<float> q = Random(rng_, 2 * hd);
  DeviceTensor dq = F32({1, 2 * hd}, q), dk = F32({1, hd}, Random(rng_, hd)), dpos = I32({1}, {5});
  DeviceTensor dfreq = F32({hd / 2}, InvFreq(hd, 10000.0f)), dhalf = F32({2}, {1.0f, 0.5f});
  DeviceTensor dwrong = F32({3}, {1.0f, 0.5f, 0.25f});
  struct Case {
    RopeOptions options;
    const Tensor* inv_freq;
    const char* says;
  };
  const Case cases[] = {
      {{.rotary_dim = 3}, &dhalf.t(), "rotary_dim 3 must be even"},
      {{.rotary_dim = 10}, &dfreq.t(), "rotary_dim 10 must be even and in [2, head_dim 8]"},
      {{.rotary_dim = 4}, &dfreq.t(), "inv_freq [2] (rotary_dim / 2)"},
      {{.attention_factor = 0.0f}, &dfreq.t(), "attention_factor 0 is not a finite number > 0"},
      {{.attention_factor = std::nanf("")}, &dfreq.t(), "attention_factor nan"},
      {{.long_inv_freq = &dwrong.t()}, &dfreq.t(), "long_inv_freq must be F32 [rotary_dim / 2] = [4]"},
      {{.long_inv_freq = &dfreq.t(), .long_from = -1}, &dfreq.t(), "long_from -1 is negative"},
  };
  for (const Case& c : cases) {
    const absl::Status st = backend_->Rope(dq.ptr(), dk.ptr(), dpos.t(), *c.inv_freq, hd, c.options);
    EXPECT_TRUE(IsInvalidArgumentNaming(st, "Rope")) << st;
    EXPECT_NE(std::string(st.message()).find(c.says), std::string::npos) << st;
  }
  EXPECT_EQ(dq.Download<float>(), q);
}

// Backend::RopeCacheWrite (the base, which the CPU backend keeps): Rope, then CacheWrite of the
// rotated k and of v, the same bits as the two calls; a bad slot is CacheWrite's error.
TEST_F(CpuBackendTest, RopeCacheWriteIsRopeThenCacheWrite) {
  const int hd = 8;
  const int64_t q_heads = 2, kv_heads = 1, n = 3, blocks = 2, bs = 4, row = kv_heads * hd;
  const std::vector<int32_t> positions = {0, 5, 9}, slots = {6, 1, 3};
  const std::vector<float> inv_freq = InvFreq(hd, 10000.0f);
  const std::vector<float> q = Random(rng_, n * q_heads * hd), k = Random(rng_, n * row), v = Random(rng_, n * row);
  const std::vector<float> cache = Random(rng_, blocks * bs * row);
  DeviceTensor dpos = I32({n}, positions), dfreq = F32({hd / 2}, inv_freq), dslots = I32({n}, slots);
  DeviceTensor dv = F32({n, row}, v);
  // Fused call.
  DeviceTensor fq = F32({n, q_heads * hd}, q), fk = F32({n, row}, k);
  DeviceTensor fkc = F32({blocks, bs, kv_heads, hd}, cache), fvc = F32({blocks, bs, kv_heads, hd}, cache);
  ASSERT_TRUE(backend_->RopeCacheWrite(fq.ptr(), fk.ptr(), dv.t(), dpos.t(), dfreq.t(), hd, {}, fkc.ptr(), fvc.ptr(),
                                       dslots.t())
                  .ok());
  // The two calls.
  DeviceTensor tq = F32({n, q_heads * hd}, q), tk = F32({n, row}, k);
  DeviceTensor tkc = F32({blocks, bs, kv_heads, hd}, cache), tvc = F32({blocks, bs, kv_heads, hd}, cache);
  ASSERT_TRUE(backend_->Rope(tq.ptr(), tk.ptr(), dpos.t(), dfreq.t(), hd, {}).ok());
  ASSERT_TRUE(backend_->CacheWrite(tkc.ptr(), tvc.ptr(), tk.t(), dv.t(), dslots.t()).ok());
  EXPECT_EQ(fq.Download<float>(), tq.Download<float>());
  EXPECT_EQ(fk.Download<float>(), tk.Download<float>());
  EXPECT_EQ(fkc.Download<float>(), tkc.Download<float>());
  EXPECT_EQ(fvc.Download<float>(), tvc.Download<float>());
  EXPECT_NE(fkc.Download<float>(), cache) << "nothing was written";
  const std::vector<int32_t> bad_slots = {6, 8, 3};  // 8 = blocks * bs, one past the end
  DeviceTensor dbad = I32({n}, bad_slots);
  const absl::Status st = backend_->RopeCacheWrite(fq.ptr(), fk.ptr(), dv.t(), dpos.t(), dfreq.t(), hd, {}, fkc.ptr(),
                                                   fvc.ptr(), dbad.t());
  EXPECT_FALSE(st.ok());
  EXPECT_NE(std::string(st.message()).find("CacheWrite"), std::string::npos) << st;
}

TEST_F(CpuBackendTest, RopeAtPositionZeroIsIdentity) {
  const int hd = 16;
  const int64_t n = 3, heads = 2;
  const std::vector<float> q = Random(rng_, n * heads * hd), k = Random(rng_, n * hd);
  DeviceTensor dq = F32({n, heads * hd}, q), dk = F32({n, hd}, k);
  DeviceTensor dpos = I32({n}, {0, 0, 0}), dfreq = F32({hd / 2}, InvFreq(hd, 10000.0f));
  ASSERT_TRUE(backend_->Rope(dq.ptr(), dk.ptr(), dpos.t(), dfreq.t(), hd, {}).ok());
  // cos 0 = 1 and sin 0 = 0 exactly, so the rotation is the identity bit for bit.
  EXPECT_EQ(dq.Download<float>(), q);
  EXPECT_EQ(dk.Download<float>(), k);
}

TEST_F(CpuBackendTest, RopeRotatesHandComputedPair) {
  // head_dim 2, inv_freq 1, position 1: (x1, x2) turns by 1 radian.
  DeviceTensor dq = F32({1, 2}, {1.0f, 0.0f}), dk = F32({1, 2}, {0.0f, 1.0f});
  DeviceTensor dpos = I32({1}, {1}), dfreq = F32({1}, {1.0f});
  ASSERT_TRUE(backend_->Rope(dq.ptr(), dk.ptr(), dpos.t(), dfreq.t(), 2, {}).ok());
  const std::vector<float> q = dq.Download<float>(), k = dk.Download<float>();
  EXPECT_NEAR(q[0], std::cos(1.0), 1e-7);
  EXPECT_NEAR(q[1], std::sin(1.0), 1e-7);
  EXPECT_NEAR(k[0], -std::sin(1.0), 1e-7);
  EXPECT_NEAR(k[1], std::cos(1.0), 1e-7);
}

// ---- CacheWrite and Attention ----------------------------------------------------------------

TEST_F(CpuBackendTest, CacheWriteFillsExactlyTheNamedSlots) {
  const int64_t blocks = 6, bs = 4, kv_heads = 2, hd = 8, row = kv_heads * hd;
  const std::vector<int32_t> slots = {0, 5, 23, 10, 11};
  const int64_t n = static_cast<int64_t>(slots.size());
  const std::vector<float> k = Random(rng_, n * row), v = Random(rng_, n * row);
  DeviceTensor kc = Output(DType::kF32, {blocks, bs, kv_heads, hd}), vc = Output(DType::kF32, {blocks, bs, kv_heads, hd});
  ASSERT_TRUE(backend_->Fill0(kc.t().data, kc.t().bytes()).ok());
  ASSERT_TRUE(backend_->Fill0(vc.t().data, vc.t().bytes()).ok());
  DeviceTensor dk = F32({n, row}, k), dv = F32({n, row}, v), ds = I32({n}, slots);
  ASSERT_TRUE(backend_->CacheWrite(kc.ptr(), vc.ptr(), dk.t(), dv.t(), ds.t()).ok());

  std::vector<float> want_k(blocks * bs * row, 0.0f), want_v(blocks * bs * row, 0.0f);
  for (int64_t t = 0; t < n; ++t) {
    std::copy_n(k.begin() + t * row, row, want_k.begin() + slots[t] * row);
    std::copy_n(v.begin() + t * row, row, want_v.begin() + slots[t] * row);
  }
  EXPECT_EQ(kc.Download<float>(), want_k);
  EXPECT_EQ(vc.Download<float>(), want_v);
  EXPECT_TRUE(kc.GuardsIntact());
  EXPECT_TRUE(vc.GuardsIntact());

  // A slot past the end is an error, and nothing is written (the check precedes the copies).
  DeviceTensor bad = I32({n}, {1, 2, 3, 4, static_cast<int32_t>(blocks * bs)});
  const absl::Status s = backend_->CacheWrite(kc.ptr(), vc.ptr(), dk.t(), dv.t(), bad.t());
  EXPECT_TRUE(IsInvalidArgumentNaming(s, "CacheWrite")) << s;
  EXPECT_EQ(kc.Download<float>(), want_k);
}

struct AttentionParam {
  int64_t q_heads, kv_heads;
  const char* name;
  // 20: one 16-float step of the dot products plus a tail of 4. 72: four steps plus a tail of 8,
  // and the weighted sums' 64-float path (8 chains) plus a tail of 8.
  int64_t head_dim = 20;
};
void PrintTo(const AttentionParam& p, std::ostream* os) { *os << p.name; }

class AttentionTest : public CpuBackendTest, public ::testing::WithParamInterface<AttentionParam> {
 protected:
  static constexpr int64_t kBlocks = 16, kBlockSize = 4;

  // One sequence of the batch: `length` positions are in the cache; the last `new_tokens` of
  // them are queries in this call. `blocks` is its block table.
  struct Seq {
    int64_t length, new_tokens;
    std::vector<int32_t> blocks;
  };

  // AttentionOptions as plain values, and how the test exercises them.
  struct Features {
    int64_t window = 0;
    float softcap = 0.0f;
    std::vector<float> sinks = {};  // [q_heads], or empty for none
    float q_gain = 1.0f;       // queries are uniform in [-q_gain, q_gain]: large scores for softcap
    // Block-table entries of blocks wholly before every query's window become -1, so that reading
    // one is an error: the window's keys are all that is read.
    bool drop_blocks_before_window = false;
  };

  // Sequences for the options' tests, blocks out of order: a 20-token prefill in two chunks (this
  // call the second, positions 14..19), a decode at position 9, a decode at 2 (a context shorter
  // than most windows) and a whole 6-token prefill. 14 queries; 39 of the 64 cache slots.
  static std::vector<Seq> MixedSeqs() {
    return {{20, 6, {9, 2, 14, 0, 11}}, {10, 1, {7, 4, 12}}, {3, 1, {5}}, {6, 6, {1, 15}}};
  }

  // Writes each sequence's dense k/v into the paged cache with CacheWrite, runs Attention for the
  // new tokens of all sequences in one call, and compares it with attention computed in double
  // from the dense k/v, written from transformers' eager attention: scores (q . k) * scale,
  // softcap * tanh(score / softcap) (modeling_gemma2.py), the causal and sliding-window mask
  // (masking_utils.py: kv_idx <= q_idx and kv_idx > q_idx - window), the sink appended, max
  // subtracted, softmax, sink dropped (modeling_gpt_oss.py).
  void Run(const std::string& what, const std::vector<Seq>& seqs) { Run(what, seqs, Features{}); }
  void Run(const std::string& what, const std::vector<Seq>& seqs, const Features& features) {
    const int64_t qh = GetParam().q_heads, kvh = GetParam().kv_heads, hd = GetParam().head_dim;
    const int64_t kv_row = kvh * hd, q_row = qh * hd;
    int64_t max_blocks = 0;
    for (const Seq& s : seqs) max_blocks = std::max<int64_t>(max_blocks, s.blocks.size());
    max_blocks += 1;  // an unused trailing entry of -1 that must never be read

    // Dense k/v per sequence, their cache slots, and the block tables.
    std::vector<std::vector<float>> dense_k, dense_v;
    std::vector<float> all_k, all_v;
    std::vector<int32_t> slots, tables(seqs.size() * max_blocks, -1);
    for (size_t s = 0; s < seqs.size(); ++s) {
      dense_k.push_back(Random(rng_, seqs[s].length * kv_row));
      dense_v.push_back(Random(rng_, seqs[s].length * kv_row));
      all_k.insert(all_k.end(), dense_k[s].begin(), dense_k[s].end());
      all_v.insert(all_v.end(), dense_v[s].begin(), dense_v[s].end());
      std::copy(seqs[s].blocks.begin(), seqs[s].blocks.end(), tables.begin() + s * max_blocks);
      for (int64_t p = 0; p < seqs[s].length; ++p) {
        slots.push_back(static_cast<int32_t>(seqs[s].blocks[p / kBlockSize] * kBlockSize + p % kBlockSize));
      }
    }
    DeviceTensor kc = Output(DType::kF32, {kBlocks, kBlockSize, kvh, hd});
    DeviceTensor vc = Output(DType::kF32, {kBlocks, kBlockSize, kvh, hd});  // unwritten slots stay NaN
    const int64_t written = static_cast<int64_t>(slots.size());
    DeviceTensor dk = F32({written, kv_row}, all_k), dv = F32({written, kv_row}, all_v);
    DeviceTensor dslots = I32({written}, slots);
    ASSERT_TRUE(backend_->CacheWrite(kc.ptr(), vc.ptr(), dk.t(), dv.t(), dslots.t()).ok());

    // The queries: the new tokens of every sequence.
    std::vector<int32_t> positions, token_seq;
    for (size_t s = 0; s < seqs.size(); ++s) {
      for (int64_t p = seqs[s].length - seqs[s].new_tokens; p < seqs[s].length; ++p) {
        positions.push_back(static_cast<int32_t>(p));
        token_seq.push_back(static_cast<int32_t>(s));
      }
    }
    const int64_t n = static_cast<int64_t>(positions.size());
    const std::vector<float> q = Random(rng_, n * q_row, -features.q_gain, features.q_gain);
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    if (features.drop_blocks_before_window) {
      for (size_t s = 0; s < seqs.size(); ++s) {
        const int64_t first_query = seqs[s].length - seqs[s].new_tokens;
        const int64_t first_key = std::max<int64_t>(0, first_query - features.window + 1);
        for (int64_t b = 0; b < first_key / kBlockSize; ++b) tables[s * max_blocks + b] = -1;
      }
    }
    DeviceTensor dq = F32({n, q_row}, q), dpos = I32({n}, positions), dseq = I32({n}, token_seq);
    DeviceTensor dtables = I32({static_cast<int64_t>(seqs.size()), max_blocks}, tables);
    DeviceTensor out = Output(DType::kF32, {n, q_row});
    std::optional<DeviceTensor> dsinks;
    AttentionOptions options{.window = features.window, .softcap = features.softcap};
    if (!features.sinks.empty()) {
      dsinks.emplace(F32({qh}, features.sinks));
      options.sinks = &dsinks->t();
    }
    const absl::Status status =
        backend_->Attention(out.ptr(), dq.t(), kc.t(), vc.t(), dpos.t(), dseq.t(), dtables.t(), scale, options);
    ASSERT_TRUE(status.ok()) << status;

    std::vector<double> want(n * q_row);
    for (int64_t t = 0; t < n; ++t) {
      const std::vector<float>& k = dense_k[token_seq[t]];
      const std::vector<float>& v = dense_v[token_seq[t]];
      const int64_t context = positions[t] + 1;
      for (int64_t h = 0; h < qh; ++h) {
        const int64_t g = h / (qh / kvh);
        // Every key of the sequence so far, then the sink; masked ones are -inf.
        std::vector<double> score(context + 1, -std::numeric_limits<double>::infinity());
        for (int64_t j = 0; j < context; ++j) {
          if (features.window > 0 && !(j > positions[t] - features.window)) continue;
          double dot = 0.0;
          for (int64_t d = 0; d < hd; ++d) dot += static_cast<double>(q[t * q_row + h * hd + d]) * k[j * kv_row + g * hd + d];
          score[j] = dot * scale;
          if (features.softcap > 0.0f) score[j] = features.softcap * std::tanh(score[j] / features.softcap);
        }
        if (!features.sinks.empty()) score[context] = features.sinks[h];
        const double max = *std::max_element(score.begin(), score.end());
        double sum = 0.0;
        for (double& sc : score) sum += (sc = std::exp(sc - max));
        for (int64_t d = 0; d < hd; ++d) {
          double acc = 0.0;
          for (int64_t j = 0; j < context; ++j) acc += score[j] / sum * v[j * kv_row + g * hd + d];
          want[t * q_row + h * hd + d] = acc;
        }
      }
    }
    // Float32 dot products of 20 (72) terms, a float32 softmax over <= 21 positions and a float32
    // weighted sum of <= 20 rows: each a few ulp, so ~5e-7 of outputs ~0.5. 2e-6 gives headroom;
    // a wrong slot, head, mask, cap or sink changes outputs by O(0.1). With q_gain the scores grow
    // (to ~30 at 20) and so do their float32 roundings (a few 1e-6 absolute, which the cap's tanh,
    // of slope <= 1, does not enlarge and a peaked softmax passes on to the outputs): 1e-5.
    const double limit = features.q_gain > 1.0f ? 1e-5 : 2e-6;
    ExpectClose(std::string(GetParam().name) + " " + what, out.Download<float>(), want, limit);
    EXPECT_TRUE(out.GuardsIntact());
  }
};

// Blocks are deliberately out of order and not adjacent, so the block table must be honored.
TEST_P(AttentionTest, PrefillSevenTokensOverTwoBlocks) { Run("prefill 7", {{7, 7, {5, 2}}}); }

TEST_P(AttentionTest, DecodeOneToken) { Run("decode at position 7", {{8, 1, {5, 2}}}); }

TEST_P(AttentionTest, PrefillAndDecodeBatched) {
  Run("prefill 7 + decode at 9", {{7, 7, {5, 2}}, {10, 1, {7, 0, 3}}});
}

TEST_P(AttentionTest, SlidingWindow) {
  // 1: only the token itself. 3: within a block or across a block boundary, depending on the
  // position. 5: always across a boundary (blocks of 4). 6: equal to the last sequence's context.
  // 20: equal to the longest context (no key masked). 100: larger than any context.
  for (int64_t window : {1, 3, 5, 6, 20, 100}) {
    Run(absl::StrCat("window ", window), MixedSeqs(), {.window = window});
  }
}

TEST_P(AttentionTest, SlidingWindowReadsNoBlockBeforeIt) {
  // With window 5 the chunk at positions 14..19 starts at key 10 (block 2) and the decode at 9 at
  // key 5 (block 1): the entries before are -1, which Attention refuses if it reads them.
  Run("window 5, earlier blocks -1", MixedSeqs(), {.window = 5, .drop_blocks_before_window = true});
}

TEST_P(AttentionTest, SoftcapWithLargeScores) {
  // Queries up to 20 in magnitude: scores up to ~50, well into tanh's saturation at softcap 5 (Gemma
  // 2 caps at 50 with scores of its own scale); 50: nearly linear.
  Run("softcap 5", MixedSeqs(), {.softcap = 5.0f, .q_gain = 20.0f});
  Run("softcap 50", MixedSeqs(), {.softcap = 50.0f, .q_gain = 20.0f});
}

TEST_P(AttentionTest, Sinks) {
  // Per head: a sink far below every score (no effect), one among them, one above them, and one far
  // above (it takes nearly all the weight; the max subtracted is the sink's).
  Run("sinks", MixedSeqs(), {.sinks = {-60.0f, 0.3f, 2.5f, 60.0f}});
}

TEST_P(AttentionTest, AllOptionsTogether) {
  Run("window 5, softcap 5, sinks", MixedSeqs(),
      {.window = 5, .softcap = 5.0f, .sinks = {1.0f, -2.0f, 4.0f, 0.0f}, .q_gain = 8.0f});
}

INSTANTIATE_TEST_SUITE_P(Heads, AttentionTest,
                         ::testing::Values(AttentionParam{4, 4, "MHA_Q4_KV4"}, AttentionParam{4, 2, "GQA_Q4_KV2"},
                                           AttentionParam{4, 1, "MQA_Q4_KV1"},
                                           AttentionParam{4, 2, "GQA_Q4_KV2_HeadDim72", 72}),
                         [](const ::testing::TestParamInfo<AttentionParam>& info) { return info.param.name; });

// Bad metadata is InvalidArgument, never a read outside the cache, and out is left as it was
// (the checks precede any write).
// MlaAttention against transformers' math on decompressed keys and values, in double on the host:
// k_h,j = [W_UK_h c_j | k_pe_j], v_h,j = W_UV_h c_j, softmax((q_h . k_h,j) * scale) over the
// sequence's positions. A prefill of two sequences (one of them through a block table out of
// order), then a decode token of the second reading what the first call cached; guard bytes intact.
TEST_F(CpuBackendTest, MlaAttentionIsAttentionOverTheDecompressedLatents) {
  const int64_t H = 3, nope = 4, rope = 2, v = 5, L = 6, bs = 2, blocks = 8;
  const MlaShape shape{.heads = H, .nope = nope, .rope = rope, .v = v, .latent = L};
  const float scale = 0.37f;
  const std::vector<float> kv_b = Random(rng_, H * (nope + v) * L);
  DeviceTensor kv_b_t = F32({H * (nope + v), L}, kv_b);
  DeviceTensor cache = Output(DType::kF32, {blocks, bs, 1, L + rope});
  const std::vector<int32_t> tables = {0, 1, 2, 5, 3, 6};  // [2 seqs, 3 blocks]
  DeviceTensor tables_t = I32({2, 3}, tables);
  std::vector<std::vector<float>> latents(2);  // per sequence, [position][c | k_pe] as written
  auto step = [&](const std::vector<int32_t>& seq, const std::vector<int32_t>& pos) {
    const int64_t n = static_cast<int64_t>(seq.size());
    const std::vector<float> q_nope = Random(rng_, n * H * nope), q_pe = Random(rng_, n * H * rope),
                             kv_c = Random(rng_, n * L), k_pe = Random(rng_, n * rope);
    std::vector<int32_t> slots(n);
    for (int64_t t = 0; t < n; ++t) {
      slots[t] = tables[seq[t] * 3 + pos[t] / bs] * bs + pos[t] % bs;
      std::vector<float>& lat = latents[seq[t]];
      lat.resize(std::max<size_t>(lat.size(), (pos[t] + 1) * (L + rope)));
      std::copy(kv_c.begin() + t * L, kv_c.begin() + (t + 1) * L, lat.begin() + pos[t] * (L + rope));
      std::copy(k_pe.begin() + t * rope, k_pe.begin() + (t + 1) * rope, lat.begin() + pos[t] * (L + rope) + L);
    }
    DeviceTensor qn = F32({n, H * nope}, q_nope), qp = F32({n, H * rope}, q_pe), c = F32({n, L}, kv_c),
                 kp = F32({n, rope}, k_pe), slots_t = I32({n}, slots), pos_t = I32({n}, pos), seq_t = I32({n}, seq);
    DeviceTensor out = Output(DType::kF32, {n, H * v});
    ASSERT_TRUE(backend_->MlaAttention(out.ptr(), qn.t(), qp.t(), c.t(), kp.t(), kv_b_t.t(), cache.ptr(), slots_t.t(),
                                       pos_t.t(), seq_t.t(), tables_t.t(), scale, shape)
                    .ok());
    const std::vector<float> got = out.Download<float>();
    for (int64_t t = 0; t < n; ++t) {
      const std::vector<float>& lat = latents[seq[t]];
      for (int64_t h = 0; h < H; ++h) {
        const float* w_uk = kv_b.data() + h * (nope + v) * L;
        const float* w_uv = w_uk + nope * L;
        std::vector<double> scores(pos[t] + 1);
        double max_score = -1e300, sum = 0;
        for (int64_t j = 0; j <= pos[t]; ++j) {
          const float* cj = lat.data() + j * (L + rope);
          double s = 0;
          for (int64_t d = 0; d < nope; ++d) {
            double k = 0;
            for (int64_t l = 0; l < L; ++l) k += double{w_uk[d * L + l]} * cj[l];
            s += q_nope[(t * H + h) * nope + d] * k;
          }
          for (int64_t d = 0; d < rope; ++d) s += double{q_pe[(t * H + h) * rope + d]} * cj[L + d];
          scores[j] = s * scale;
          max_score = std::max(max_score, scores[j]);
        }
        for (double& s : scores) sum += (s = std::exp(s - max_score));
        for (int64_t d = 0; d < v; ++d) {
          double want = 0;
          for (int64_t j = 0; j <= pos[t]; ++j) {
            double vj = 0;
            for (int64_t l = 0; l < L; ++l) vj += double{w_uv[d * L + l]} * lat[j * (L + rope) + l];
            want += scores[j] / sum * vj;
          }
          EXPECT_NEAR(got[(t * H + h) * v + d], want, 1e-5) << "token " << t << " head " << h << " dim " << d;
        }
      }
    }
    EXPECT_TRUE(out.GuardsIntact());
  };
  step({0, 0, 0, 0, 0, 1, 1, 1}, {0, 1, 2, 3, 4, 0, 1, 2});
  step({1}, {3});
  EXPECT_TRUE(cache.GuardsIntact());
  // Bad metadata is refused before the cache is touched.
  DeviceTensor one = F32({1, H * nope}, Random(rng_, H * nope)), one_pe = F32({1, H * rope}, Random(rng_, H * rope)),
               one_c = F32({1, L}, Random(rng_, L)), one_k = F32({1, rope}, Random(rng_, rope));
  DeviceTensor out = Output(DType::kF32, {1, H * v});
  DeviceTensor bad_slot = I32({1}, {blocks * bs}), pos = I32({1}, {0}), seq = I32({1}, {0});
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MlaAttention(out.ptr(), one.t(), one_pe.t(), one_c.t(), one_k.t(), kv_b_t.t(),
                                                       cache.ptr(), bad_slot.t(), pos.t(), seq.t(), tables_t.t(), scale,
                                                       shape),
                                "MlaAttention"));
}

TEST_F(CpuBackendTest, AttentionRejectsBadMetadata) {
  const int64_t blocks = 4, bs = 4, heads = 2, hd = 8, row = heads * hd;
  DeviceTensor kc = F32({blocks, bs, heads, hd}, Random(rng_, blocks * bs * row));
  DeviceTensor vc = F32({blocks, bs, heads, hd}, Random(rng_, blocks * bs * row));
  DeviceTensor q = F32({1, row}, Random(rng_, row));
  DeviceTensor out = Output(DType::kF32, {1, row});
  struct Case {
    const char* what;
    int32_t position, seq;
    std::vector<int32_t> table;  // one sequence, two entries
  };
  const Case cases[] = {
      {"block index past the cache", 5, 0, {1, 16}},
      {"negative block index", 2, 0, {-1, 0}},
      {"position past the block table", 8, 0, {1, 2}},
      {"negative position", -1, 0, {1, 2}},
      {"sequence past the block tables", 1, 1, {1, 2}},
  };
  for (const Case& c : cases) {
    DeviceTensor pos = I32({1}, {c.position}), seq = I32({1}, {c.seq}), table = I32({1, 2}, c.table);
    const absl::Status s = backend_->Attention(out.ptr(), q.t(), kc.t(), vc.t(), pos.t(), seq.t(), table.t(), 1.0f);
    EXPECT_TRUE(IsInvalidArgumentNaming(s, "Attention")) << c.what << ": " << s;
    const std::vector<float> untouched = out.Download<float>();
    EXPECT_TRUE(std::all_of(untouched.begin(), untouched.end(), [](float x) { return std::isnan(x); })) << c.what;
    EXPECT_TRUE(out.GuardsIntact()) << c.what;
  }

  // Shapes: 3 query heads cannot share 2 kv heads; out must match q.
  DeviceTensor pos = I32({1}, {0}), seq = I32({1}, {0}), table = I32({1, 1}, {0});
  DeviceTensor q3 = F32({1, 3 * hd}, Random(rng_, 3 * hd)), out3 = Output(DType::kF32, {1, 3 * hd});
  EXPECT_TRUE(IsInvalidArgumentNaming(
      backend_->Attention(out3.ptr(), q3.t(), kc.t(), vc.t(), pos.t(), seq.t(), table.t(), 1.0f), "Attention"));
  DeviceTensor out_wide = Output(DType::kF32, {1, 2 * row});
  EXPECT_TRUE(IsInvalidArgumentNaming(
      backend_->Attention(out_wide.ptr(), q.t(), kc.t(), vc.t(), pos.t(), seq.t(), table.t(), 1.0f), "Attention"));
}

// Bad options are InvalidArgument naming the op and the option, and out is left as it was.
TEST_F(CpuBackendTest, AttentionRejectsBadOptions) {
  const int64_t blocks = 2, bs = 4, heads = 2, hd = 8, row = heads * hd;
  DeviceTensor kc = F32({blocks, bs, heads, hd}, Random(rng_, blocks * bs * row));
  DeviceTensor vc = F32({blocks, bs, heads, hd}, Random(rng_, blocks * bs * row));
  DeviceTensor q = F32({1, row}, Random(rng_, row)), out = Output(DType::kF32, {1, row});
  DeviceTensor pos = I32({1}, {5}), seq = I32({1}, {0}), table = I32({1, 2}, {1, 0});
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  DeviceTensor sinks_short = F32({1}, {0.0f}), sinks_2d = F32({1, 2}, {0.0f, 0.0f});
  DeviceTensor sinks_i32 = I32({2}, {0, 0}), sinks_nan = F32({2}, {0.0f, nan}), sinks_inf = F32({2}, {-inf, 0.0f});
  struct Case {
    const char* what;
    AttentionOptions options;
    const char* names;  // what the message must name
  };
  const Case cases[] = {
      {"negative window", {.window = -1}, "window"},
      {"NaN softcap", {.softcap = nan}, "softcap"},
      {"negative softcap", {.softcap = -1.0f}, "softcap"},
      {"infinite softcap", {.softcap = inf}, "softcap"},
      {"sinks of one head for two", {.sinks = &sinks_short.t()}, "sinks"},
      {"sinks of two dimensions", {.sinks = &sinks_2d.t()}, "sinks"},
      {"I32 sinks", {.sinks = &sinks_i32.t()}, "sinks"},
      {"a NaN sink", {.sinks = &sinks_nan.t()}, "sinks"},
      {"an infinite sink", {.sinks = &sinks_inf.t()}, "sinks"},
  };
  for (const Case& c : cases) {
    const absl::Status s =
        backend_->Attention(out.ptr(), q.t(), kc.t(), vc.t(), pos.t(), seq.t(), table.t(), 1.0f, c.options);
    EXPECT_TRUE(IsInvalidArgumentNaming(s, "Attention")) << c.what << ": " << s;
    EXPECT_NE(s.message().find(c.names), std::string::npos) << c.what << ": " << s;
    const std::vector<float> untouched = out.Download<float>();
    EXPECT_TRUE(std::all_of(untouched.begin(), untouched.end(), [](float x) { return std::isnan(x); })) << c.what;
    EXPECT_TRUE(out.GuardsIntact()) << c.what;
  }
  // Within the window the block table must still be valid: window 2 at position 5 reads block 1.
  DeviceTensor bad_table = I32({1, 2}, {-1, 7});
  EXPECT_TRUE(IsInvalidArgumentNaming(
      backend_->Attention(out.ptr(), q.t(), kc.t(), vc.t(), pos.t(), seq.t(), bad_table.t(), 1.0f, {.window = 2}),
      "Attention"));
}

// ---- Element-wise ops ------------------------------------------------------------------------

TEST_F(CpuBackendTest, EmbeddingWithRowOffset) {
  // This shard holds rows [10, 16) of the vocabulary.
  const int64_t rows = 6, d = 12, row_offset = 10;
  const std::vector<int32_t> ids = {10, 15, 9, 16, 12, 0, 100};
  const int64_t n = static_cast<int64_t>(ids.size());
  const std::vector<float> table = Random(rng_, rows * d);
  DeviceTensor dt = F32({rows, d}, table), di = I32({n}, ids);
  DeviceTensor out = Output(DType::kF32, {n, d});
  ASSERT_TRUE(backend_->Embedding(out.ptr(), dt.t(), di.t(), row_offset).ok());

  std::vector<float> want(n * d, 0.0f);  // ids of other shards give zero rows
  for (int64_t t = 0; t < n; ++t) {
    const int64_t r = ids[t] - row_offset;
    if (r >= 0 && r < rows) std::copy_n(table.begin() + r * d, d, want.begin() + t * d);
  }
  EXPECT_EQ(out.Download<float>(), want);  // a copy: exact
  EXPECT_TRUE(out.GuardsIntact());
}

// A tied table stored once as the LM head's packed weight (Backend::PackTiedTable: float32 panels,
// on a CpuMatMul::kF32 backend and on a bf16 one alike): Embedding gathers each row from its panel
// and gives the plain table's rows exactly, with the row offset and the zero rows of other shards,
// for a row count that ends inside a panel; the LM head's product by it is bitwise the product by
// the plain table, for 1 to 9 rows (the few-rows tiles, the plain ones, the repacking ones).
// A quantized packed weight is refused, naming what it is.
TEST_F(CpuBackendTest, EmbeddingFromTheLmHeadsPackedTable) {
  const int64_t rows = 37, d = 20, row_offset = 3;  // 3 panels, the last holding 5 rows
  std::vector<float> table = Random(rng_, rows * d);
  const Tensor plain_table(table.data(), DType::kF32, {rows, d});
  const std::vector<int32_t> ids = {3, 39, 2, 40, 18, 19, 34, 35, 100};
  const int64_t n = static_cast<int64_t>(ids.size());
  std::vector<int32_t> ids_copy = ids;
  const Tensor ti(ids_copy.data(), DType::kI32, {n});
  const std::vector<float> x = Random(rng_, 9 * d);
  for (CpuMatMul matmul : {CpuMatMul::kF32, CpuMatMul::kBF16}) {
    std::unique_ptr<Backend> backend = MakeCpuBackend(2, matmul);
    SCOPED_TRACE(matmul == CpuMatMul::kF32 ? "f32 products" : "bf16 products");
    Tensor packed;
    absl::StatusOr<Buffer> buffer = backend->PackTiedTable(plain_table, &packed);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    ASSERT_NE(packed.data, static_cast<void*>(table.data()));
    EXPECT_EQ(packed.dtype, DType::kF32);
    std::vector<float> from_packed(n * d, 7.0f), from_plain(n * d, 7.0f);
    Tensor out_packed(from_packed.data(), DType::kF32, {n, d}), out_plain(from_plain.data(), DType::kF32, {n, d});
    ASSERT_TRUE(backend->Embedding(&out_packed, packed, ti, row_offset).ok());
    ASSERT_TRUE(backend->Embedding(&out_plain, plain_table, ti, row_offset).ok());
    EXPECT_EQ(from_packed, from_plain);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t r = ids[t] - row_offset;
      for (int64_t c = 0; c < d; ++c) {
        ASSERT_EQ(from_packed[t * d + c], r >= 0 && r < rows ? table[r * d + c] : 0.0f) << "id " << ids[t] << " col " << c;
      }
    }
    for (int64_t m = 1; m <= 9; ++m) {
      std::vector<float> by_packed(m * rows), by_plain(m * rows);
      Tensor y_packed(by_packed.data(), DType::kF32, {m, rows}), y_plain(by_plain.data(), DType::kF32, {m, rows});
      const Tensor tx(const_cast<float*>(x.data()), DType::kF32, {m, d});
      ASSERT_TRUE(backend->MatMul(&y_packed, tx, packed, nullptr).ok());
      ASSERT_TRUE(backend->MatMul(&y_plain, tx, plain_table, nullptr).ok());
      EXPECT_EQ(std::memcmp(by_packed.data(), by_plain.data(), by_packed.size() * sizeof(float)), 0) << m << " rows";
    }
  }
  Tensor quantized;
  absl::StatusOr<Buffer> q = backend_->PackMatMulWeight(Tensor(table.data(), DType::kF32, {rows, d}), &quantized,
                                                        WeightQuant::kInt8);
  ASSERT_TRUE(q.ok()) << q.status();
  const Tensor as_f32(quantized.data, DType::kF32, {rows, d});
  std::vector<float> from_quantized(n * d);
  Tensor out(from_quantized.data(), DType::kF32, {n, d});
  const absl::Status refused = backend_->Embedding(&out, as_f32, ti, row_offset);
  EXPECT_TRUE(IsInvalidArgumentNaming(refused, "quantized")) << refused;
}

TEST_F(CpuBackendTest, SiluMul) {
  const int64_t n = 3, f = 1000;
  std::vector<float> gate = Random(rng_, n * f, -10.0f, 10.0f);
  gate[0] = -100.0f;  // exp(100) overflows float; silu must still give -0
  gate[1] = 100.0f;
  const std::vector<float> up = Random(rng_, n * f);
  DeviceTensor dg = F32({n, f}, gate), du = F32({n, f}, up);
  DeviceTensor out = Output(DType::kF32, {n, f});
  ASSERT_TRUE(backend_->SiluMul(out.ptr(), dg.t(), du.t()).ok());

  std::vector<double> want(n * f);
  for (int64_t i = 0; i < n * f; ++i) want[i] = gate[i] / (1.0 + std::exp(-static_cast<double>(gate[i]))) * up[i];
  // exp, an add, a division and a product: within ~4 ulp of each output. 1e-6 gives headroom.
  ExpectClose("SiluMul", out.Download<float>(), want, 1e-6);
  EXPECT_TRUE(out.GuardsIntact());
}

// gpt-oss's clamped SwiGLU against GptOssExperts._apply_gate computed in double: gate clamped from
// above only, up from both sides, (up + 1) * gate * sigmoid(alpha * gate). Gate and up span [-10,
// 10] around a limit of 3, so both clamps act on many elements (and not on many others), with a
// gate far below the limit where sigmoid underflows; in place through either operand; bad alpha and
// limit refused by name.
TEST_F(CpuBackendTest, ClampedSwiGlu) {
  const int64_t n = 3, f = 1000;
  const float alpha = 1.702f, limit = 3.0f;
  std::vector<float> gate = Random(rng_, n * f, -10.0f, 10.0f), up = Random(rng_, n * f, -10.0f, 10.0f);
  gate[0] = -200.0f;  // sigmoid(-340) is 0 in float32: the output is -0 times (up + 1)
  int clamped_gate = 0, clamped_up_low = 0, clamped_up_high = 0;
  std::vector<double> want(n * f);
  for (int64_t i = 0; i < n * f; ++i) {
    const double g = std::min<double>(gate[i], limit), u = std::clamp<double>(up[i], -limit, limit);
    clamped_gate += gate[i] > limit;
    clamped_up_low += up[i] < -limit;
    clamped_up_high += up[i] > limit;
    want[i] = (u + 1.0) * (g / (1.0 + std::exp(-alpha * g)));
  }
  ASSERT_GT(clamped_gate, 100);
  ASSERT_GT(clamped_up_low, 100);
  ASSERT_GT(clamped_up_high, 100);
  DeviceTensor dg = F32({n, f}, gate), du = F32({n, f}, up);
  DeviceTensor out = Output(DType::kF32, {n, f});
  ASSERT_TRUE(backend_->ClampedSwiGlu(out.ptr(), dg.t(), du.t(), alpha, limit).ok());
  const std::vector<float> got = out.Download<float>();
  // A product, exp, an add, a division and two products: a few ulp of the largest output (~12).
  ExpectClose("ClampedSwiGlu", got, want, 1e-6);
  EXPECT_EQ(got[0], 0.0f);
  EXPECT_TRUE(out.GuardsIntact());
  // A plain SwiGLU (no clamp, no +1, no alpha) differs: the op is not SiluMul.
  DeviceTensor silu = Output(DType::kF32, {n, f});
  ASSERT_TRUE(backend_->SiluMul(silu.ptr(), dg.t(), du.t()).ok());
  EXPECT_NE(silu.Download<float>(), got);

  ASSERT_TRUE(backend_->ClampedSwiGlu(dg.ptr(), dg.t(), du.t(), alpha, limit).ok());
  EXPECT_EQ(dg.Download<float>(), got) << "out = gate";
  DeviceTensor dg2 = F32({n, f}, gate);
  ASSERT_TRUE(backend_->ClampedSwiGlu(du.ptr(), dg2.t(), du.t(), alpha, limit).ok());
  EXPECT_EQ(du.Download<float>(), got) << "out = up";

  DeviceTensor a = F32({1, 4}, {0, 0, 0, 0}), b = F32({1, 4}, {0, 0, 0, 0}), o = Output(DType::kF32, {1, 4});
  for (auto [bad_alpha, bad_limit] : {std::pair{0.0f, 7.0f}, {1.702f, -1.0f}, {1.702f, INFINITY}, {NAN, 7.0f}}) {
    const absl::Status s = backend_->ClampedSwiGlu(o.ptr(), a.t(), b.t(), bad_alpha, bad_limit);
    EXPECT_TRUE(IsInvalidArgumentNaming(s, "ClampedSwiGlu")) << s;
    EXPECT_NE(std::string(s.message()).find("alpha"), std::string::npos) << s;
  }
  DeviceTensor wide = Output(DType::kF32, {1, 5});
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->ClampedSwiGlu(wide.ptr(), a.t(), b.t(), alpha, limit), "[n, f]"));
}

// gelu_tanh(x) * u in double: transformers' gelu_pytorch_tanh, then "* up".
double GeluTanhTimes(double x, double u) {
  const double kBeta = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(kBeta * (x + 0.044715 * x * x * x))) * u;
}

// How many float32 values lie between a and b (0: equal; +0 and -0 are equal).
int64_t UlpsApart(float a, float b) {
  const auto key = [](float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    return (bits & 0x80000000u) ? -static_cast<int64_t>(bits & 0x7fffffffu) : static_cast<int64_t>(bits);
  };
  return std::abs(key(a) - key(b));
}

TEST_F(CpuBackendTest, GeluTanhMul) {
  const int64_t n = 3, f = 1000;
  std::vector<float> gate = Random(rng_, n * f, -10.0f, 10.0f);
  gate[0] = -100.0f;  // x^3 and tanh saturate: gelu is -0
  gate[1] = 100.0f;   // gelu is x (with up scaled down, so as not to dominate max|want|)
  gate[2] = 0.0f;
  std::vector<float> up = Random(rng_, n * f, -2.0f, 2.0f);
  up[1] = 0.125f;
  std::vector<double> want(n * f);
  for (int64_t i = 0; i < n * f; ++i) want[i] = GeluTanhTimes(gate[i], up[i]);

  DeviceTensor dg = F32({n, f}, gate), du = F32({n, f}, up);
  DeviceTensor out = Output(DType::kF32, {n, f});
  ASSERT_TRUE(backend_->GeluTanhMul(out.ptr(), dg.t(), du.t()).ok());
  const std::vector<float> got = out.Download<float>();
  // Each output's error is a few float32 roundings of |gate * up| / 2, not of itself: inner (a
  // cube, a fused multiply-add and a product: ~3 ulp, which inner * tanh'(inner) <= 0.45 shrinks
  // in tanh), tanh (half an ulp, an ulp at its cutoff), then 1 + tanh, 0.5 * x and the two
  // products (half an ulp each). Where gate < -2, 1 + tanh cancels and those absolute errors
  // become large relative to the tiny output, so the error is normalized by max|want| (~ max|gate
  // * up| ~ 20 here): about 2 ulp of it at most, 1.2e-7 (5e-8 measured). 4 ulp, 2.4e-7, allowed.
  ExpectClose("GeluTanhMul", got, want, 4 * 0x1p-24);
  EXPECT_EQ(got[0], 0.0f);
  EXPECT_EQ(got[1], 100.0f * 0.125f);
  EXPECT_TRUE(out.GuardsIntact());

  // In place through either operand: element by element, the same bits.
  ASSERT_TRUE(backend_->GeluTanhMul(dg.ptr(), dg.t(), du.t()).ok());
  EXPECT_EQ(dg.Download<float>(), got) << "out = gate";
  EXPECT_TRUE(dg.GuardsIntact());
  DeviceTensor dg2 = F32({n, f}, gate);
  ASSERT_TRUE(backend_->GeluTanhMul(du.ptr(), dg2.t(), du.t()).ok());
  EXPECT_EQ(du.Download<float>(), got) << "out = up";
  EXPECT_TRUE(du.GuardsIntact());
}

// PyTorch's own float32 values, from
//   /work/venv-hf5/bin/python -c "import torch; x = torch.tensor([-8.0, -5.1578517, -5.0, -3.5, -2.2226877, -1.0, -0.5, -1e-3, 0.0, 1e-3, 0.5, 1.0, 2.5, 4.0, 9.5, 30.0]).repeat(4); print([v.hex() for v in torch.nn.functional.gelu(x, approximate='tanh')[:16].tolist()])"
// (torch 2.15, AVX512 kernels). The inputs repeated to 64, so that all go through the vectorized
// loop (Sleef's tanhf) and none through the scalar tail, which calls libm's tanhf: that one gives
// a non-zero gelu(-5.1578517) where the vectorized loop gives 0, and transformers' [n, f] gate
// tensors go through the vectorized loop. With up = 1 each output is gelu(gate) itself.
// Where the CPU has AVX2 + FMA the backend calls the same Sleef tanhf: every output equal, gelu(-2.2226877)
// included, where Sleef's tanhf is an ulp from tanh rounded (as on 63 of 2 million points of
// [-12, 12], all with gate in [-2.3, 0.6]) and 1 + tanh ~ 0.03 magnifies that to 35 ulp of the
// output (2e-9 absolute): the bound without AVX2, where tanh is computed in double and rounded.
TEST_F(CpuBackendTest, GeluTanhMulMatchesPyTorch) {
  const std::vector<float> gate = {-8.0f, -5.1578517f, -5.0f, -3.5f, -2.2226877f, -1.0f, -0.5f, -1e-3f,
                                   0.0f,  1e-3f,       0.5f,  1.0f,  2.5f,        4.0f,  9.5f,  30.0f};
  const std::vector<float> torch = {-0x0.0p+0f,       -0x0.0p+0f,       -0x1.4p-22f,      -0x1.430ap-11f,
                                    -0x1.d9154p-6f,   -0x1.453d2p-3f,   -0x1.3bfa4cp-3f,  -0x1.05ef52p-11f,
                                    0x0.0p+0f,        0x1.065a6ap-11f,  0x1.6202dap-2f,   0x1.aeb0b8p-1f,
                                    0x1.3e11b8p+1f,   0x1.fffdb4p+1f,   0x1.3p+3f,        0x1.ep+4f};
  const auto count = static_cast<int64_t>(gate.size());
  DeviceTensor dg = F32({1, count}, gate), ones = F32({1, count}, std::vector<float>(gate.size(), 1.0f));
  DeviceTensor out = Output(DType::kF32, {1, count});
  ASSERT_TRUE(backend_->GeluTanhMul(out.ptr(), dg.t(), ones.t()).ok());
  const std::vector<float> got = out.Download<float>();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t limit = cpu::TanhHasAvx2() ? 0 : gate[i] == -2.2226877f ? 35 : 1;
    EXPECT_LE(UlpsApart(got[i], torch[i]), limit) << "gelu(" << gate[i] << "): got " << got[i] << ", torch " << torch[i];
  }
}

TEST_F(CpuBackendTest, ScaleInPlaceAndNot) {
  const int64_t n = 4, d = 300;
  const std::vector<float> x = Random(rng_, n * d, -3.0f, 3.0f);
  const float factor = static_cast<float>(std::sqrt(3072.0));  // Gemma 2 9B's sqrt(hidden) in float32
  std::vector<double> want(n * d);
  for (int64_t i = 0; i < n * d; ++i) want[i] = static_cast<double>(x[i]) * factor;

  // One float32 product, correctly rounded: within half an ulp, 2^-24 of max|want|.
  constexpr double kLimit = 0x1p-24;
  DeviceTensor dx = F32({n, d}, x);
  DeviceTensor out = Output(DType::kF32, {n, d});
  ASSERT_TRUE(backend_->Scale(out.ptr(), dx.t(), factor).ok());
  const std::vector<float> got = out.Download<float>();
  ExpectClose("Scale", got, want, kLimit);
  EXPECT_TRUE(out.GuardsIntact());
  ASSERT_TRUE(backend_->Scale(dx.ptr(), dx.t(), factor).ok());  // out aliases x
  EXPECT_EQ(dx.Download<float>(), got);
  EXPECT_TRUE(dx.GuardsIntact());
}

TEST_F(CpuBackendTest, SoftcapInPlace) {
  const int64_t m = 3, v = 2000;
  // 30: Gemma 2's final_logit_softcapping; 50: its attn_logit_softcapping.
  for (const float cap : {30.0f, 50.0f}) {
    std::vector<float> logits = Random(rng_, m * v, -150.0f, 150.0f);
    logits[0] = 1e30f;  // saturates to cap
    logits[1] = -1e30f;
    logits[2] = 0.0f;
    std::vector<double> want(m * v);
    for (int64_t i = 0; i < m * v; ++i) want[i] = cap * std::tanh(static_cast<double>(logits[i]) / cap);
    DeviceTensor x = F32({m, v}, logits);
    ASSERT_TRUE(backend_->Softcap(x.ptr(), cap).ok());
    const std::vector<float> got = x.Download<float>();
    // Relative to cap (max|want| is within 1% of it): x / cap rounded (half an ulp of y = x / cap,
    // which tanh' = sech^2 shrinks to y sech^2(y) <= 0.45 of it), tanh rounded (half an ulp; an
    // ulp past its cutoff), the product rounded (half an ulp): under 2 ulp, 1.2e-7. 2e-7 gives
    // headroom.
    ExpectClose(absl::StrCat("Softcap cap=", cap), got, want, 2e-7);
    EXPECT_EQ(got[0], cap);
    EXPECT_EQ(got[1], -cap);
    EXPECT_EQ(got[2], 0.0f);
    EXPECT_TRUE(x.GuardsIntact());
  }
}

TEST_F(CpuBackendTest, GeluTanhMulScaleSoftcapRefuseBadArguments) {
  DeviceTensor x = F32({2, 8}, Random(rng_, 16)), y = F32({2, 7}, Random(rng_, 14));
  DeviceTensor out = Output(DType::kF32, {2, 8});
  DeviceTensor x16(backend_.get(), DType::kF16, {2, 8});
  DeviceTensor ids = I32({2, 8}, std::vector<int32_t>(16, 1));
  DeviceTensor row = F32({16}, Random(rng_, 16));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->GeluTanhMul(out.ptr(), x.t(), y.t()), "GeluTanhMul"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->GeluTanhMul(out.ptr(), x16.t(), x.t()), "GeluTanhMul"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->GeluTanhMul(nullptr, x.t(), x.t()), "GeluTanhMul"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->Scale(out.ptr(), y.t(), 2.0f), "Scale"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->Scale(out.ptr(), x16.t(), 2.0f), "Scale"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->Scale(nullptr, x.t(), 2.0f), "Scale"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->Softcap(ids.ptr(), 30.0f), "Softcap"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->Softcap(&x16.t(), 30.0f), "Softcap"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->Softcap(row.ptr(), 30.0f), "Softcap"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->Softcap(nullptr, 30.0f), "Softcap"));
  DeviceTensor logits = F32({2, 8}, Random(rng_, 16));
  const std::vector<float> logits_before = logits.Download<float>();
  for (const float cap : {0.0f, -0.0f, -30.0f, std::numeric_limits<float>::quiet_NaN(), kInf, -kInf}) {
    const absl::Status s = backend_->Softcap(logits.ptr(), cap);
    EXPECT_TRUE(IsInvalidArgumentNaming(s, "Softcap")) << "cap " << cap << ": " << s;
  }
  EXPECT_EQ(logits.Download<float>(), logits_before) << "a refused Softcap wrote";
  for (DeviceTensor* t : {&out, &logits, &ids, &row}) EXPECT_TRUE(t->GuardsIntact());
}

TEST_F(CpuBackendTest, AddInPlaceThroughEitherOperand) {
  const int64_t n = 5, d = 77;
  const std::vector<float> a = Random(rng_, n * d), b = Random(rng_, n * d);
  std::vector<double> want(n * d);
  for (int64_t i = 0; i < n * d; ++i) want[i] = static_cast<double>(a[i]) + b[i];

  // A float32 sum of two floats is correctly rounded: within half an ulp, 2^-24 of max|want|.
  constexpr double kLimit = 0x1p-24;
  DeviceTensor da = F32({n, d}, a), db = F32({n, d}, b);
  ASSERT_TRUE(backend_->Add(da.ptr(), da.t(), db.t()).ok());  // out aliases a
  ExpectClose("Add out=a", da.Download<float>(), want, kLimit);
  EXPECT_TRUE(da.GuardsIntact());

  DeviceTensor da2 = F32({n, d}, a), db2 = F32({n, d}, b);
  ASSERT_TRUE(backend_->Add(db2.ptr(), da2.t(), db2.t()).ok());  // out aliases b
  ExpectClose("Add out=b", db2.Download<float>(), want, kLimit);
  EXPECT_TRUE(db2.GuardsIntact());
}

TEST_F(CpuBackendTest, SoftmaxWithTemperature) {
  const int64_t n = 3, v = 1000;
  for (float temperature : {1.0f, 0.7f, 2.5f}) {
    const std::vector<float> x = Random(rng_, n * v, -10.0f, 10.0f);
    DeviceTensor dx = F32({n, v}, x);
    DeviceTensor out = Output(DType::kF32, {n, v});
    ASSERT_TRUE(backend_->Softmax(out.ptr(), dx.t(), temperature).ok());

    std::vector<double> want(n * v);
    for (int64_t r = 0; r < n; ++r) {
      double max = -INFINITY, sum = 0.0;
      for (int64_t i = 0; i < v; ++i) max = std::max(max, static_cast<double>(x[r * v + i]) / temperature);
      for (int64_t i = 0; i < v; ++i) sum += std::exp(static_cast<double>(x[r * v + i]) / temperature - max);
      for (int64_t i = 0; i < v; ++i) want[r * v + i] = std::exp(static_cast<double>(x[r * v + i]) / temperature - max) / sum;
    }
    // x / t and x - max round to half an ulp of values up to ~14, which exp turns into a relative
    // error of ~1e-6 at most; exp, the normalizer and the product add a few ulp. 4e-6 gives
    // headroom; a wrong temperature or normalizer is off by far more.
    ExpectClose(absl::StrCat("Softmax t=", temperature), out.Download<float>(), want, 4e-6);
    EXPECT_TRUE(out.GuardsIntact());
  }
}

TEST_F(CpuBackendTest, ArgmaxTakesTheFirstOnTies) {
  const int64_t v = 5;
  const std::vector<float> logits = {
      1.0f,  5.0f,  5.0f,  2.0f,  -1.0f,  // tie: the first, 1
      -kInf, -kInf, -3.0f, -kInf, -kInf,  // 2
      0.0f,  0.0f,  0.0f,  0.0f,  0.0f,   // all equal: 0
      1.0f,  2.0f,  3.0f,  4.0f,  4.5f,   // the last, 4
      7.0f,  -7.0f, 7.0f,  6.9f,  7.0f,   // tie at the front: 0
  };
  const int64_t n = static_cast<int64_t>(logits.size()) / v;
  DeviceTensor dl = F32({n, v}, logits);
  DeviceTensor out = Output(DType::kI32, {n});
  ASSERT_TRUE(backend_->Argmax(out.ptr(), dl.t()).ok());
  EXPECT_EQ(out.Download<int32_t>(), (std::vector<int32_t>{1, 2, 0, 4, 0}));
  EXPECT_TRUE(out.GuardsIntact());
}

// Every non-finite kind (NaN, +inf, -inf), first, last and in the middle of a row, and the largest
// finite values, in a row longer than a vector so that the vector loop and its tail both count.
TEST_F(CpuBackendTest, FiniteRowsFlagsEveryRowWithANaNOrAnInfinity) {
  const int64_t v = 37;
  const float kMax = std::numeric_limits<float>::max(), kNaN = std::numeric_limits<float>::quiet_NaN();
  const std::vector<std::pair<int64_t, float>> cases = {
      {-1, 0.0f}, {0, kNaN}, {v - 1, kInf}, {18, -kInf}, {5, kMax}, {36, -kMax}, {33, kNaN}, {-1, 0.0f}};
  const int64_t n = static_cast<int64_t>(cases.size());
  std::vector<float> logits(n * v);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < v; ++i) logits[r * v + i] = static_cast<float>(i - 20) * 0.5f;
    if (cases[r].first >= 0) logits[r * v + cases[r].first] = cases[r].second;
  }
  DeviceTensor dl = F32({n, v}, logits);
  DeviceTensor out = Output(DType::kI32, {n});
  ASSERT_TRUE(backend_->FiniteRows(out.ptr(), dl.t()).ok());
  EXPECT_EQ(out.Download<int32_t>(), (std::vector<int32_t>{1, 0, 0, 0, 1, 1, 0, 1}));
  EXPECT_TRUE(out.GuardsIntact());
  DeviceTensor wrong = Output(DType::kI32, {n - 1});
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->FiniteRows(wrong.ptr(), dl.t()), "FiniteRows"));
}

// ---- Sample ----------------------------------------------------------------------------------

// The distribution Sample draws from, per backend.h, computed in double: softmax(logits / t),
// then top_k (ties with the k-th kept), then top_p over what top_k kept, renormalized (ties with
// the last taken kept), renormalized again.
std::vector<double> ReferenceDistribution(const std::vector<float>& logits, const SampleParams& p) {
  const size_t v = logits.size();
  std::vector<double> prob(v);
  const double max = *std::max_element(logits.begin(), logits.end()) / static_cast<double>(p.temperature);
  double sum = 0.0;
  for (size_t i = 0; i < v; ++i) sum += (prob[i] = std::exp(logits[i] / static_cast<double>(p.temperature) - max));
  for (double& x : prob) x /= sum;

  double keep_from = 0.0;
  if (p.top_k > 0 && static_cast<size_t>(p.top_k) < v) {
    std::vector<double> sorted = prob;
    std::sort(sorted.begin(), sorted.end(), std::greater<double>());
    keep_from = sorted[p.top_k - 1];
  }
  if (p.top_p < 1.0f) {
    std::vector<double> sorted;
    for (double x : prob) {
      if (x >= keep_from) sorted.push_back(x);
    }
    std::sort(sorted.begin(), sorted.end(), std::greater<double>());
    const double kept_mass = std::accumulate(sorted.begin(), sorted.end(), 0.0);
    double mass = 0.0;
    for (double x : sorted) {
      mass += x;
      keep_from = x;
      if (mass >= p.top_p * kept_mass) break;
    }
  }
  double kept_mass = 0.0;
  for (double& x : prob) kept_mass += (x = x >= keep_from ? x : 0.0);
  for (double& x : prob) x /= kept_mass;
  return prob;
}

class SampleTest : public CpuBackendTest {
 protected:
  // Samples each row of `logits` ([rows, v]) with its params.
  std::vector<int32_t> Sample(const std::vector<float>& logits, int64_t v, const std::vector<SampleParams>& params) {
    const int64_t n = static_cast<int64_t>(params.size());
    DeviceTensor dl = F32({n, v}, logits);
    DeviceTensor out = Output(DType::kI32, {n});
    const absl::Status s = backend_->Sample(out.ptr(), dl.t(), params);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_TRUE(out.GuardsIntact());
    return out.Download<int32_t>();
  }
  // One row of logits log(probs), so that softmax gives back probs, sampled with one draw.
  int32_t SampleProbs(const std::vector<double>& probs, SampleParams p) {
    std::vector<float> logits;
    for (double x : probs) logits.push_back(static_cast<float>(std::log(x)));
    return Sample(logits, static_cast<int64_t>(probs.size()), {p})[0];
  }
};

TEST_F(SampleTest, TopKOneIsArgmax) {
  const int64_t n = 64, v = 1000;
  const std::vector<float> logits = Random(rng_, n * v, -5.0f, 5.0f);
  std::vector<SampleParams> params(n);
  for (int64_t r = 0; r < n; ++r) {
    params[r] = {.temperature = 0.5f + r % 4 * 0.5f, .top_k = 1, .top_p = 1.0f, .uniform = SampleUniform(7, r)};
  }
  DeviceTensor dl = F32({n, v}, logits);
  DeviceTensor argmax = Output(DType::kI32, {n});
  ASSERT_TRUE(backend_->Argmax(argmax.ptr(), dl.t()).ok());
  EXPECT_EQ(Sample(logits, v, params), argmax.Download<int32_t>());
}

// Hand-computed: probs (0.1, 0.4, 0.2, 0.3).
TEST_F(SampleTest, TopPHandExample) {
  const std::vector<double> probs = {0.1, 0.4, 0.2, 0.3};
  // top_p 0.6: take 0.4 (mass 0.4), then 0.3 (0.7 >= 0.6). Kept {1, 3}, renormalized 4/7, 3/7;
  // in vocabulary order the cumulative is 0.571 at token 1, 1 at token 3.
  EXPECT_EQ(SampleProbs(probs, {.top_p = 0.6f, .uniform = 0.0f}), 1);
  EXPECT_EQ(SampleProbs(probs, {.top_p = 0.6f, .uniform = 0.5f}), 1);
  EXPECT_EQ(SampleProbs(probs, {.top_p = 0.6f, .uniform = 0.6f}), 3);
  EXPECT_EQ(SampleProbs(probs, {.top_p = 0.6f, .uniform = 0.99f}), 3);
  // top_p 0.35: 0.4 alone suffices.
  EXPECT_EQ(SampleProbs(probs, {.top_p = 0.35f, .uniform = 0.99f}), 1);
  // No limits: cumulative 0.1, 0.5, 0.7, 1.
  EXPECT_EQ(SampleProbs(probs, {.uniform = 0.05f}), 0);
  EXPECT_EQ(SampleProbs(probs, {.uniform = 0.45f}), 1);
  EXPECT_EQ(SampleProbs(probs, {.uniform = 0.65f}), 2);
  EXPECT_EQ(SampleProbs(probs, {.uniform = 0.75f}), 3);
}

TEST_F(SampleTest, TopPKeepsTiesWithTheLastTaken) {
  // top_p 0.5 over (0.4, 0.2, 0.2, 0.2): 0.4, then one 0.2 reaches 0.6; the other two 0.2s tie
  // with it and stay, so all four are kept and uniform 0.95 lands on token 3 (cumulative 0.4,
  // 0.6, 0.8, 1). Without ties kept it would be {0, 1} and token 1.
  EXPECT_EQ(SampleProbs({0.4, 0.2, 0.2, 0.2}, {.top_p = 0.5f, .uniform = 0.95f}), 3);
}

TEST_F(SampleTest, TopKHandExample) {
  const std::vector<double> probs = {0.1, 0.4, 0.2, 0.3};
  // top_k 3 keeps {1, 2, 3}, mass 0.9; cumulative 0.444, 0.667, 1 in vocabulary order.
  EXPECT_EQ(SampleProbs(probs, {.top_k = 3, .uniform = 0.0f}), 1);
  EXPECT_EQ(SampleProbs(probs, {.top_k = 3, .uniform = 0.4f}), 1);
  EXPECT_EQ(SampleProbs(probs, {.top_k = 3, .uniform = 0.5f}), 2);
  EXPECT_EQ(SampleProbs(probs, {.top_k = 3, .uniform = 0.7f}), 3);
  // top_k 2 over (0.25, 0.25, 0.5): the 2nd largest is 0.25, so both 0.25s stay; cumulative
  // 0.25, 0.5, 1 puts 0.3 on token 1 (with only {0, 2} kept it would be token 0).
  EXPECT_EQ(SampleProbs({0.25, 0.25, 0.5}, {.top_k = 2, .uniform = 0.3f}), 1);
}

TEST_F(SampleTest, TopPAppliesToWhatTopKKept) {
  // top_k 2 keeps {1: 0.4, 3: 0.3}, renormalized to 0.571 and 0.429; top_p 0.5 then needs only
  // token 1. (Measured against the unrenormalized mass, 0.4 < 0.5 would also keep token 3, and
  // uniform 0.9 would pick it.) This is how transformers and vLLM chain the two.
  EXPECT_EQ(SampleProbs({0.1, 0.4, 0.2, 0.3}, {.top_k = 2, .top_p = 0.5f, .uniform = 0.9f}), 1);
}

TEST_F(SampleTest, UniformOnACumulativeBoundaryGoesToTheNextToken) {
  // Equal logits give exactly (0.5, 0.5); the first token whose cumulative *exceeds* 0.5 is 1.
  EXPECT_EQ(Sample({0.0f, 0.0f}, 2, {{.uniform = 0.5f}})[0], 1);
  EXPECT_EQ(Sample({0.0f, 0.0f}, 2, {{.uniform = 0.4999f}})[0], 0);
}

TEST_F(SampleTest, TemperatureSharpens) {
  // logits (0, ln 3): probs (1/4, 3/4) at t = 1; at t = 0.5 the logits double: (1/10, 9/10).
  const std::vector<float> logits = {0.0f, static_cast<float>(std::log(3.0))};
  EXPECT_EQ(Sample(logits, 2, {{.temperature = 1.0f, .uniform = 0.2f}})[0], 0);
  EXPECT_EQ(Sample(logits, 2, {{.temperature = 0.5f, .uniform = 0.2f}})[0], 1);
  EXPECT_EQ(Sample(logits, 2, {{.temperature = 0.5f, .uniform = 0.05f}})[0], 0);
}

// -inf logits are masked tokens (worker/sampler.cc masks min_p this way): probability 0, never
// drawn, whatever top_k, top_p and the draw, and the other tokens renormalized among themselves.
TEST_F(SampleTest, MaskedTokensAreNeverDrawn) {
  // Every uniform of a fine grid, the last one just below 1 (the "last kept token" fallback).
  std::vector<float> uniforms;
  for (int i = 0; i < 100; ++i) uniforms.push_back(i / 100.0f);
  uniforms.push_back(std::nextafter(1.0f, 0.0f));
  const SampleParams limits[] = {{}, {.top_k = 1}, {.top_k = 3}, {.top_k = 10}, {.top_p = 0.5f},
                                 {.temperature = 0.3f, .top_k = 2, .top_p = 0.9f}};
  struct Case {
    std::vector<float> logits;
    std::vector<int32_t> allowed;
  };
  const Case cases[] = {
      {{-kInf, -kInf, 2.0f, -kInf, -kInf}, {2}},               // all but one masked
      {{-kInf, 0.0f, -kInf, 0.0f, -kInf, 0.0f}, {1, 3, 5}},   // ties between masked neighbours
      {{1.0f, 3.0f, -kInf, 2.0f, -kInf}, {0, 1, 3}},          // masked last token
      {{-kInf, -1.0f, 5.0f, -kInf, 4.0f, -kInf}, {1, 2, 4}},  // top_k 10 > the 3 finite tokens
  };
  for (const Case& c : cases) {
    const int64_t v = static_cast<int64_t>(c.logits.size());
    for (const SampleParams& limit : limits) {
      std::vector<float> logits;
      std::vector<SampleParams> params;
      for (float u : uniforms) {
        logits.insert(logits.end(), c.logits.begin(), c.logits.end());
        params.push_back(limit);
        params.back().uniform = u;
      }
      const std::vector<int32_t> got = Sample(logits, v, params);
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_NE(std::find(c.allowed.begin(), c.allowed.end(), got[i]), c.allowed.end())
            << "drew masked or invalid token " << got[i] << " with uniform " << params[i].uniform
            << " top_k " << limit.top_k << " top_p " << limit.top_p;
      }
    }
  }
  // Three equal finite logits among masked ones share the mass in thirds, in vocabulary order.
  const std::vector<float> ties = {-kInf, 0.0f, -kInf, 0.0f, -kInf, 0.0f};
  EXPECT_EQ(Sample(ties, 6, {{.uniform = 0.0f}})[0], 1);
  EXPECT_EQ(Sample(ties, 6, {{.uniform = 0.34f}})[0], 3);
  EXPECT_EQ(Sample(ties, 6, {{.uniform = 0.67f}})[0], 5);
  // The masked tokens take no mass: with (1, 3, -inf, 2, -inf) the kept probabilities are
  // softmax(1, 3, 2) = (0.090, 0.665, 0.245), so uniform 0.5 lands on token 1 and 0.8 on token 3.
  EXPECT_EQ(Sample({1.0f, 3.0f, -kInf, 2.0f, -kInf}, 5, {{.uniform = 0.5f}})[0], 1);
  EXPECT_EQ(Sample({1.0f, 3.0f, -kInf, 2.0f, -kInf}, 5, {{.uniform = 0.8f}})[0], 3);
}

// Many seeded draws (SampleUniform, as workers make them) from one row of logits: the
// frequencies must match ReferenceDistribution and every draw must land where the inverse CDF
// of that distribution puts it. The 1000-token rows (logits in [-8, 8]) need more than the
// first 64 candidates for top_p, so Sample's candidate set has to grow.
TEST_F(SampleTest, DrawsFollowTheRenormalizedDistribution) {
  constexpr int64_t kBatch = 1000;
  struct Setting {
    int64_t v;
    float logit_range;
    int64_t draws;
    SampleParams params;
  };
  const Setting settings[] = {
      {12, 2.0f, 50 * kBatch, {.temperature = 0.8f}},
      {12, 2.0f, 50 * kBatch, {.temperature = 1.2f, .top_k = 5}},
      {12, 2.0f, 50 * kBatch, {.temperature = 1.0f, .top_p = 0.7f}},
      {12, 2.0f, 50 * kBatch, {.temperature = 0.7f, .top_k = 8, .top_p = 0.8f}},
      {1000, 8.0f, 10 * kBatch, {.temperature = 1.0f, .top_p = 0.9f}},
      {1000, 8.0f, 10 * kBatch, {.temperature = 1.5f, .top_k = 600, .top_p = 0.5f}},
  };
  for (const Setting& setting : settings) {
    const int64_t v = setting.v;
    const std::string what = absl::StrCat("v=", v, " t=", setting.params.temperature, " top_k=",
                                          setting.params.top_k, " top_p=", setting.params.top_p);
    const std::vector<float> row = Random(rng_, v, -setting.logit_range, setting.logit_range);
    std::vector<float> logits;
    for (int64_t r = 0; r < kBatch; ++r) logits.insert(logits.end(), row.begin(), row.end());

    const std::vector<double> want = ReferenceDistribution(row, setting.params);
    std::vector<double> cdf(v);
    std::partial_sum(want.begin(), want.end(), cdf.begin());
    std::vector<int64_t> count(v, 0);
    int64_t disagreements = 0;
    std::vector<SampleParams> params(kBatch, setting.params);
    for (int64_t step = 0; step < setting.draws; step += kBatch) {
      for (int64_t r = 0; r < kBatch; ++r) params[r].uniform = SampleUniform(/*seed=*/42, step + r);
      const std::vector<int32_t> got = Sample(logits, v, params);
      for (int64_t r = 0; r < kBatch; ++r) {
        ASSERT_GE(got[r], 0) << what;
        ASSERT_LT(got[r], v) << what;
        ++count[got[r]];
        // The reference token is the first whose cumulative exceeds u (never one of probability
        // 0, whose cumulative equals its predecessor's). Draws within 1e-5 of a cumulative
        // boundary may go either way through float rounding.
        const double u = params[r].uniform;
        const int64_t ref = std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin();
        const bool near_boundary =
            ref == v || std::abs(cdf[ref] - u) < 1e-5 || (ref > 0 && std::abs(cdf[ref - 1] - u) < 1e-5);
        if (got[r] != ref && !near_boundary) ++disagreements;
      }
    }
    EXPECT_EQ(disagreements, 0) << what;
    for (int64_t i = 0; i < v; ++i) {
      // Each count is binomial(draws, p): 5 standard deviations plus one draw, so a correct
      // sampler strays past it with probability < 1e-6 per token (and the seeds are fixed).
      // Excluded tokens (p = 0) must never be drawn.
      const double freq = static_cast<double>(count[i]) / setting.draws;
      const double tolerance = 5.0 * std::sqrt(want[i] * (1.0 - want[i]) / setting.draws) + 1.0 / setting.draws;
      if (want[i] == 0.0) {
        EXPECT_EQ(count[i], 0) << what << " token " << i;
      } else {
        EXPECT_NEAR(freq, want[i], tolerance) << what << " token " << i;
      }
    }
  }
}

// ---- Bad input -------------------------------------------------------------------------------

TEST_F(CpuBackendTest, MismatchedShapesAndDtypesAreInvalidArgument) {
  DeviceTensor x = F32({2, 8}, Random(rng_, 16)), w7 = F32({7}, Random(rng_, 7)), w8 = F32({8}, Random(rng_, 8));
  DeviceTensor out = Output(DType::kF32, {2, 8});
  const absl::Status rms = backend_->RmsNorm(out.ptr(), x.t(), w7.t(), 1e-6f);
  EXPECT_TRUE(IsInvalidArgumentNaming(rms, "RmsNorm"));
  EXPECT_NE(rms.message().find("w F32 [7]"), std::string::npos) << rms;  // the message shows the shapes

  // F16 activations: the CPU backend computes in float32 only.
  DeviceTensor x16(backend_.get(), DType::kF16, {2, 8});
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->RmsNorm(out.ptr(), x16.t(), w8.t(), 1e-6f), "RmsNorm"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->RmsNorm(nullptr, x.t(), w8.t(), 1e-6f), "RmsNorm"));

  DeviceTensor w_bad = F32({3, 7}, Random(rng_, 21)), mm_out = Output(DType::kF32, {2, 3});
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MatMul(mm_out.ptr(), x.t(), w_bad.t(), nullptr), "MatMul"));
  DeviceTensor w_ok = F32({3, 8}, Random(rng_, 24)), bias_bad = F32({4}, Random(rng_, 4));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MatMul(mm_out.ptr(), x.t(), w_ok.t(), &bias_bad.t()), "MatMul"));
  DeviceTensor square = F32({3, 3}, Random(rng_, 9));  // out = x: GEMM cannot write over its input
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->MatMul(square.ptr(), square.t(), square.t(), nullptr), "MatMul"));

  DeviceTensor y = F32({2, 7}, Random(rng_, 14));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->Add(out.ptr(), x.t(), y.t()), "Add"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->SiluMul(out.ptr(), x.t(), y.t()), "SiluMul"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->Softmax(out.ptr(), x.t(), 0.0f), "Softmax"));

  DeviceTensor ids_f32 = F32({2}, {1.0f, 2.0f});
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->Embedding(out.ptr(), x.t(), ids_f32.t(), 0), "Embedding"));

  DeviceTensor q = F32({2, 8}, Random(rng_, 16)), pos = I32({2}, {0, 1}), freq = F32({3}, {1.0f, 0.5f, 0.25f});
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->Rope(q.ptr(), out.ptr(), pos.t(), freq.t(), 8, {}), "Rope"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->Rope(q.ptr(), out.ptr(), pos.t(), freq.t(), 7, {}), "Rope"));

  DeviceTensor ids = Output(DType::kI32, {2});
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->Argmax(ids.ptr(), w8.t()), "Argmax"));
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->Sample(ids.ptr(), x.t(), {SampleParams{}}), "Sample"));
  EXPECT_TRUE(IsInvalidArgumentNaming(
      backend_->Sample(ids.ptr(), x.t(), {SampleParams{}, SampleParams{.uniform = 1.0f}}), "Sample"));
  EXPECT_TRUE(IsInvalidArgumentNaming(
      backend_->Sample(ids.ptr(), x.t(), {SampleParams{}, SampleParams{.top_k = -1}}), "Sample"));

  // Guards around every output survived the rejected calls.
  for (DeviceTensor* t : {&out, &mm_out, &ids}) EXPECT_TRUE(t->GuardsIntact());
}

TEST_F(SampleTest, NonFiniteLogitsAreAnError) {
  DeviceTensor logits = F32({1, 3}, {0.0f, std::numeric_limits<float>::quiet_NaN(), 1.0f});
  DeviceTensor out = Output(DType::kI32, {1});
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->Sample(out.ptr(), logits.t(), {SampleParams{}}), "Sample"));
  DeviceTensor masked = F32({1, 3}, {-kInf, -kInf, -kInf});
  EXPECT_TRUE(IsInvalidArgumentNaming(backend_->Sample(out.ptr(), masked.t(), {SampleParams{}}), "Sample"));
}

}  // namespace
}  // namespace shardserve
