// A test backend that is the CPU backend under another device kind (DeviceKind::kCuda): code that
// treats device memory apart (the sampler's host copies, ModelShard::Load's refusals of what only
// the CPU backend computes) takes its device path, on the CPU's ops.
#ifndef SHARDSERVE_TESTS_DEVICE_LIKE_BACKEND_H_
#define SHARDSERVE_TESTS_DEVICE_LIKE_BACKEND_H_

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"

namespace shardserve {

// The CPU backend under another device kind: the sampler then copies host rows with CopyToHost
// and samples them on a CPU backend of its own, as it does on CUDA.
class DeviceLikeBackend final : public Backend {
 public:
  DeviceKind device_kind() const override { return DeviceKind::kCuda; }
  DType act_dtype() const override { return cpu_->act_dtype(); }
  std::string Describe() const override { return "device-like " + cpu_->Describe(); }
  absl::StatusOr<Buffer> Allocate(size_t bytes) override { return cpu_->Allocate(bytes); }
  void Free(void* data) override { cpu_->Free(data); }
  absl::Status CopyToDevice(void* d, const void* s, size_t n) override { return cpu_->CopyToDevice(d, s, n); }
  absl::Status CopyToHost(void* d, const void* s, size_t n) override {
    ++copies_to_host;
    return cpu_->CopyToHost(d, s, n);
  }
  absl::Status CopyOnDevice(void* d, const void* s, size_t n) override { return cpu_->CopyOnDevice(d, s, n); }
  absl::Status Fill0(void* d, size_t n) override { return cpu_->Fill0(d, n); }
  absl::Status Synchronize() override { return cpu_->Synchronize(); }
  absl::Status Embedding(Tensor* o, const Tensor& t, const Tensor& i, int64_t r) override {
    return cpu_->Embedding(o, t, i, r);
  }
  absl::Status RmsNorm(Tensor* o, const Tensor& x, const Tensor& w, float e) override { return cpu_->RmsNorm(o, x, w, e); }
  absl::Status MatMul(Tensor* o, const Tensor& x, const Tensor& w, const Tensor* b) override {
    return cpu_->MatMul(o, x, w, b);
  }
  absl::Status Rope(Tensor* q, Tensor* k, const Tensor& p, const Tensor& f, int hd, const RopeOptions& o) override {
    return cpu_->Rope(q, k, p, f, hd, o);
  }
  absl::Status CacheWrite(Tensor* kc, Tensor* vc, const Tensor& k, const Tensor& v, const Tensor& s) override {
    return cpu_->CacheWrite(kc, vc, k, v, s);
  }
  absl::Status Attention(Tensor* o, const Tensor& q, const Tensor& kc, const Tensor& vc, const Tensor& p,
                         const Tensor& ts, const Tensor& bt, float sc, const AttentionOptions& ao) override {
    return cpu_->Attention(o, q, kc, vc, p, ts, bt, sc, ao);
  }
  absl::Status SiluMul(Tensor* o, const Tensor& g, const Tensor& u) override { return cpu_->SiluMul(o, g, u); }
  absl::Status ClampedSwiGlu(Tensor* o, const Tensor& g, const Tensor& u, float alpha, float limit) override {
    return cpu_->ClampedSwiGlu(o, g, u, alpha, limit);
  }
  absl::Status MlaAttention(Tensor* o, const Tensor& qn, const Tensor& qp, const Tensor& c, const Tensor& kp,
                            const Tensor& b, Tensor* cache, const Tensor& sl, const Tensor& p, const Tensor& ts,
                            const Tensor& bt, float sc, const MlaShape& shape) override {
    return cpu_->MlaAttention(o, qn, qp, c, kp, b, cache, sl, p, ts, bt, sc, shape);
  }
  absl::Status GeluTanhMul(Tensor* o, const Tensor& g, const Tensor& u) override {
    return cpu_->GeluTanhMul(o, g, u);
  }
  absl::Status Scale(Tensor* o, const Tensor& x, float f) override { return cpu_->Scale(o, x, f); }
  absl::Status Softcap(Tensor* x, float cap) override { return cpu_->Softcap(x, cap); }
  absl::Status Add(Tensor* o, const Tensor& a, const Tensor& b) override { return cpu_->Add(o, a, b); }
  absl::Status Softmax(Tensor* o, const Tensor& x, float t) override { return cpu_->Softmax(o, x, t); }
  absl::Status Argmax(Tensor* o, const Tensor& l) override { return cpu_->Argmax(o, l); }
  absl::Status FiniteRows(Tensor* o, const Tensor& l) override { return cpu_->FiniteRows(o, l); }
  absl::Status Sample(Tensor* o, const Tensor& l, const std::vector<SampleParams>& p) override {
    return cpu_->Sample(o, l, p);
  }

  // Weights already quantized (a checkpoint's codes): refused with Unimplemented (the base's, as a
  // device backend without quantized kernels) unless `quantized`, then stored by the CPU backend,
  // except the formats in `without` (a device backend without those formats' kernels).
  absl::StatusOr<Buffer> PackQuantizedWeight(WeightQuant q, const void* s, int64_t m, int64_t k, Tensor* p,
                                             int64_t g) override {
    if (!quantized || std::find(without.begin(), without.end(), q) != without.end()) {
      return Backend::PackQuantizedWeight(q, s, m, k, p, g);
    }
    return cpu_->PackQuantizedWeight(q, s, m, k, p, g);
  }

  int copies_to_host = 0;
  bool quantized = false;
  std::vector<WeightQuant> without;

 private:
  std::unique_ptr<Backend> cpu_ = MakeCpuBackend();
};

}  // namespace shardserve

#endif  // SHARDSERVE_TESTS_DEVICE_LIKE_BACKEND_H_
