#include "model/dummy_weights.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/backend.h"
#include "model/families/registry.h"

namespace shardserve {
namespace {

std::string ShapeString(const std::vector<int64_t>& shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

// FNV-1a, 64-bit: the tensor's name as a number.
uint64_t HashName(const std::string& name) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : name) h = (h ^ c) * 0x100000001B3ull;
  return h;
}

// The key of tensor `name`'s counter-based stream (kernels/counter_uniform.h).
uint64_t TensorKey(uint64_t seed, const std::string& name) {
  return SplitMix64Mix(seed ^ SplitMix64Mix(HashName(name)));
}

// Half-width of the uniform distribution of tensor `name`'s elements; 0 marks the norms (1.0).
//
// Why activations stay finite over any number of layers (checked with 80 in
// tests/dummy_weights_test.cc): every block of a Llama layer is pre-norm. It reads RMSNorm(h) x
// norm weight (1.0), whose RMS is 1 whatever the residual h holds, and adds its output to h. With
// a = 1/sqrt(in_features) an element has variance a^2 / 3 = 1 / (3 in), so a projection of a
// unit-RMS input has RMS about 1/sqrt(3) = 0.58: q and k give attention scores q.k / sqrt(d) of
// RMS ~0.33 (softmax far from saturating), attention averages v (RMS <= 0.58), o_proj brings it to
// ~0.33; silu(gate) x up is ~0.2 and down_proj ~0.1. So each layer adds an increment of bounded
// size (~0.4 RMS) that does not depend on h: the residual grows at most linearly in the layer
// count (about as sqrt(L), the increments being nearly independent), a few units after 80 layers,
// far inside float16's and bfloat16's range. The embedding rows are small (RMS 1/sqrt(3 hidden))
// but the first RMSNorm scales them to 1 (eps 1e-6 is well below their mean square 1/(3 hidden)
// for any hidden size up to ~10^5); the LM head of a unit-RMS vector gives logits of RMS ~0.58.
// Biases stay small (0.1) beside the q/k/v outputs they shift.
float ElementScale(const std::string& name, const std::vector<int64_t>& shape) {
  if (absl::EndsWith(name, "norm.weight")) return 0;
  if (absl::EndsWith(name, ".bias")) return 0.1f;
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(shape.back())));
}

// Every tensor of the model's checkpoint, with its full shape (a fused tensor once).
std::map<std::string, std::vector<int64_t>> TensorShapes(const ModelConfig& config) {
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const WeightDecl& w : ModelWeights(config)) shapes[w.name] = CheckpointShape(w);
  for (const WeightDecl& w : MtpWeights(config)) shapes[w.name] = CheckpointShape(w);
  return shapes;
}

}  // namespace

DummyWeights::DummyWeights(const ModelConfig& config, uint64_t seed, bool on_device)
    : seed_(seed), on_device_(on_device), shapes_(TensorShapes(config)) {}

absl::Status DummyWeights::CheckShape(const std::string& name, const std::vector<int64_t>& expected_shape) const {
  auto it = shapes_.find(name);
  if (it == shapes_.end()) {
    return absl::NotFoundError(
        absl::StrCat("dummy weights: tensor \"", name, "\" is not one config.json's model has"));
  }
  if (it->second != expected_shape) {
    return absl::InvalidArgumentError(absl::StrCat("dummy weights: tensor \"", name, "\" has shape ",
                                                   ShapeString(it->second), " from config.json, not ",
                                                   ShapeString(expected_shape)));
  }
  return absl::OkStatus();
}

float DummyWeights::Element(const std::string& name, int64_t flat_index) const {
  auto it = shapes_.find(name);
  const float a = it == shapes_.end() ? 0 : ElementScale(name, it->second);
  return CounterUniformValue(TensorKey(seed_, name), a, static_cast<uint64_t>(flat_index));
}

absl::StatusOr<CounterUniformSlice> DummyWeights::SliceOf(const std::string& name,
                                                          const std::vector<int64_t>& expected_shape,
                                                          const Slice& slice) const {
  if (absl::Status s = CheckShape(name, expected_shape); !s.ok()) return s;
  const std::vector<int64_t>& shape = shapes_.at(name);
  if (slice.dim < 0 || slice.dim >= static_cast<int>(shape.size()) || (shape.size() > 2 && slice.dim != 0)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor \"", name, "\": slice dimension ", slice.dim, " out of range"));
  }
  const int64_t extent = shape[slice.dim];
  const int64_t begin = slice.begin, end = slice.end < 0 ? extent : slice.end;
  if (begin < 0 || begin > end || end > extent) {
    return absl::InvalidArgumentError(absl::StrCat("tensor \"", name, "\": slice [", begin, ", ", end,
                                                   ") of dimension ", slice.dim, " outside [0, ", extent, ")"));
  }
  CounterUniformSlice s;
  s.key = TensorKey(seed_, name);
  s.scale = ElementScale(name, shape);
  s.rows = shape[0];
  s.cols = 1;  // a stacked tensor of 3 dimensions (gpt-oss's experts) as [shape[0], the rest]
  for (size_t d = 1; d < shape.size(); ++d) s.cols *= shape[d];
  s.dim = slice.dim;
  s.begin = begin;
  s.end = end;
  return s;
}

absl::Status DummyWeights::Read(const std::string& name, const std::vector<int64_t>& expected_shape,
                                const Slice& slice, DType dst_type, void* dst) const {
  absl::StatusOr<CounterUniformSlice> s = SliceOf(name, expected_shape, slice);
  if (!s.ok()) return s.status();
  if (dst_type != DType::kF32 && dst_type != DType::kF16 && dst_type != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat("dummy weights: tensor \"", name, "\" asked for as ",
                                                   DTypeName(dst_type), "; weights are F32, F16 or BF16"));
  }
  FillCounterUniformOnHost(dst, dst_type, *s);
  return absl::OkStatus();
}

absl::Status DummyWeights::ReadOnDevice(const std::string& name, const std::vector<int64_t>& expected_shape,
                                        const Slice& slice, Backend* backend, Tensor* dst) const {
  if (!on_device_) return WeightSource::ReadOnDevice(name, expected_shape, slice, backend, dst);
  absl::StatusOr<CounterUniformSlice> s = SliceOf(name, expected_shape, slice);
  if (!s.ok()) return s.status();
  if (absl::Status st = backend->FillCounterUniform(dst, *s); !st.ok()) {
    return absl::Status(st.code(), absl::StrCat("dummy weights: tensor \"", name, "\": ", st.message()));
  }
  return absl::OkStatus();
}

}  // namespace shardserve
