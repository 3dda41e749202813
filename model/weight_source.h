// Where a shard's weights come from: a checkpoint on disk (model/checkpoint.h) or weights made from
// config.json alone (model/dummy_weights.h, --load-format dummy). ModelShard::Load reads every
// tensor through this interface and never knows which.
//
// Ownership and lifetime: whoever opened a source owns it; Load only reads during the call.
// Thread-safety: implementations' methods are const and thread-safe.
#ifndef SHARDSERVE_MODEL_WEIGHT_SOURCE_H_
#define SHARDSERVE_MODEL_WEIGHT_SOURCE_H_

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"
#include "kernels/tensor.h"
#include "model/config.h"

namespace shardserve {

// A contiguous range of one dimension of a 2-D tensor (or of the only dimension of a 1-D one).
struct Slice {
  int dim = 0;        // 0: rows, 1: columns
  int64_t begin = 0;
  int64_t end = -1;   // -1: to the end
};

class WeightSource {
 public:
  virtual ~WeightSource() = default;

  // OK when tensor `name` exists with shape `expected_shape` (what config.json implies); else
  // NotFound, or InvalidArgument naming the tensor and both shapes. Reads no data, so callers check
  // shapes before they allocate anything sized from config.json.
  virtual absl::Status CheckShape(const std::string& name, const std::vector<int64_t>& expected_shape) const = 0;

  // Writes `slice` of tensor `name` into `dst`, converted to `dst_type` (F32/F16/BF16; I32 / I64
  // tensors as I32 only and F8_E4M3 ones as a float type or raw as I8, where the source has them:
  // published quantized checkpoints, model/quantized_checkpoint.h; U8 ones raw as I8, MXFP4 experts,
  // model/mxfp4.h; a tensor of 3 or 4 dimensions as [shape[0], the rest], rows only): dst holds
  // (slice length x other dimension) elements of dst_type, row-major. `expected_shape` (the full
  // tensor) must match, as CheckShape says.
  virtual absl::Status Read(const std::string& name, const std::vector<int64_t>& expected_shape, const Slice& slice,
                            DType dst_type, void* dst) const = 0;

  // Makes `slice` of tensor `name` directly in `backend`'s memory: `dst` (allocated by `backend`,
  // of its act dtype and the slice's shape). Sources that can (DummyWeights with on_device) save
  // the host copy; the base refuses with Unimplemented and the caller reads on the host instead.
  virtual absl::Status ReadOnDevice(const std::string& name, const std::vector<int64_t>& expected_shape,
                                    const Slice& slice, Backend* backend, Tensor* dst) const;

  // Whether this source makes every tensor as a plain float one whatever the checkpoint would store
  // (DummyWeights): MXFP4 experts (ModelConfig::mxfp4_experts) are then read as their plain stacked
  // tensors, not as blocks and scales. False for a checkpoint.
  virtual bool MakesPlainWeights() const { return false; }
};

// --load-format: auto reads the checkpoint's safetensors; dummy makes the weights from config.json
// and a seed (as vLLM's --load-format dummy), for benchmarks and tests without a checkpoint.
enum class LoadFormat { kAuto, kDummy };

// "auto" or "dummy"; InvalidArgument naming the value otherwise.
absl::StatusOr<LoadFormat> ParseLoadFormat(absl::string_view name);

// The weights of the model at `dir` (whose config.json is `config`): its checkpoint (kAuto), or
// DummyWeights(config, dummy_seed, dummy_on_device) (kDummy: no safetensors needed, nothing under
// `dir` is read).
absl::StatusOr<std::unique_ptr<WeightSource>> OpenWeightSource(const std::filesystem::path& dir,
                                                               const ModelConfig& config, LoadFormat format,
                                                               uint64_t dummy_seed, bool dummy_on_device = false);

// Sets the EAGLE-3 head `head`'s Eagle3::embedding_in_checkpoint from `weights`, its tensors: whether
// they hold embed_tokens.weight (the published heads do not; dummy weights hold every tensor).
void NoteEagle3Embedding(const WeightSource& weights, ModelConfig* head);

}  // namespace shardserve

#endif  // SHARDSERVE_MODEL_WEIGHT_SOURCE_H_
