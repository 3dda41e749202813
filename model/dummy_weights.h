// Weights without a checkpoint (--load-format dummy, as vLLM's): every tensor the family's
// declaration (model/families/) lists for this config.json, with values made from a seed. For benchmarks of models one does not
// have (a 72B planned and run from its config.json alone) and tests of layouts without fixtures.
//
// Element (r, c) of tensor `name` (shape [rows, cols]; 1-D tensors are [rows]) is a function of
// (seed, name, r * cols + c) only, never of which slice is asked for: any rank's slice of any
// tensor equals the same elements of the whole tensor, so every TP x PP layout runs the same model
// as one process, each rank making only its own slice. The function is kernels/counter_uniform.h's
// counter-based generator (SplitMix64 of the element index, keyed by the seed and a hash of the
// name), so a slice can also be made directly in device memory (ReadOnDevice: the CUDA backend's
// kernel writes the same bits; no host copy of the weights).
//
// Values (chosen so activations stay finite however many layers; see ElementScale in the .cc):
//   norms (input_layernorm, post_attention_layernorm, Qwen3's q_norm and k_norm, model.norm): 1.0 exactly;
//   2-D weights (q/k/v/o, gate/up/down, embed_tokens, lm_head): uniform in (-a, a), a = 1/sqrt(cols);
//   biases (Qwen2's q/k/v): uniform in (-0.1, 0.1).
//
// Thread-safety: immutable after construction; Read and CheckShape are const and thread-safe.
#ifndef SHARDSERVE_MODEL_DUMMY_WEIGHTS_H_
#define SHARDSERVE_MODEL_DUMMY_WEIGHTS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kernels/counter_uniform.h"
#include "model/config.h"
#include "model/weight_source.h"

namespace shardserve {

class DummyWeights : public WeightSource {
 public:
  // on_device: ReadOnDevice makes each slice in the backend's memory (Backend::FillCounterUniform)
  // instead of refusing (the loader then reads on the host and copies). The worker's default
  // (--dummy-weights device) since the CUDA kernel passed on a GPU (docs/gpu.md).
  DummyWeights(const ModelConfig& config, uint64_t seed, bool on_device = false);

  // NotFound for a name the model has no tensor of; InvalidArgument naming both shapes for another
  // shape (as Checkpoint does).
  absl::Status CheckShape(const std::string& name, const std::vector<int64_t>& expected_shape) const override;
  absl::Status Read(const std::string& name, const std::vector<int64_t>& expected_shape, const Slice& slice,
                    DType dst_type, void* dst) const override;
  absl::Status ReadOnDevice(const std::string& name, const std::vector<int64_t>& expected_shape, const Slice& slice,
                            Backend* backend, Tensor* dst) const override;
  // Every tensor plain, MXFP4 experts included (their stacked float tensors).
  bool MakesPlainWeights() const override { return true; }

  // The counter-generated slice Read and ReadOnDevice write: CheckShape's errors, or
  // InvalidArgument naming the tensor for a slice outside it.
  absl::StatusOr<CounterUniformSlice> SliceOf(const std::string& name, const std::vector<int64_t>& expected_shape,
                                              const Slice& slice) const;

  // The value Read writes (before conversion to dst_type) for element `flat_index` (r * cols + c)
  // of tensor `name`. No check of the name or the index: for tests.
  float Element(const std::string& name, int64_t flat_index) const;

  uint64_t seed() const { return seed_; }

 private:
  const uint64_t seed_;
  const bool on_device_;
  const std::map<std::string, std::vector<int64_t>> shapes_;
};

}  // namespace shardserve

#endif  // SHARDSERVE_MODEL_DUMMY_WEIGHTS_H_
