// Reading a Hugging Face checkpoint's weights: safetensors files through mmap, a single
// model.safetensors or shards listed in model.safetensors.index.json.
//
// Every header byte is checked before use: the header length, the JSON, each tensor's dtype,
// shape and data offsets (overflow-safe, inside the file, matching dtype x shape). A lying file is
// an error naming the file and the tensor, never a crash.
//
// Ownership and lifetime: a Checkpoint owns its mappings until destroyed; pointers it hands out
// are valid while it lives. Reads are const and thread-safe (the mapping is read-only).
#ifndef SHARDSERVE_MODEL_CHECKPOINT_H_
#define SHARDSERVE_MODEL_CHECKPOINT_H_

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/tensor.h"
#include "model/weight_source.h"

namespace shardserve {

struct TensorInfo {
  // Safetensors dtypes that kernels/tensor.h has no DType for, read only for published quantized
  // checkpoints (model/quantized_checkpoint.h): F8_E4M3 (`dtype` kI8 holds its bytes; read as
  // F32/F16/BF16, decoded, or as I8, the raw bytes) and I64 (`dtype` kI32 nominally; read as I32,
  // refused where a value does not fit); U8 (`dtype` kI8 holds its bytes; read raw as I8 only: the
  // codes and scales of MXFP4 experts, model/mxfp4.h); BOOL (as U8: an EAGLE-3 head's t2d, which
  // nothing reads, but a published head's checkpoint must open).
  enum class Extra : uint8_t { kNone, kF8E4M3, kI64, kU8, kBool };

  std::string name;
  DType dtype = DType::kF32;
  Extra extra = Extra::kNone;
  std::vector<int64_t> shape;
  std::string file;       // file name inside the checkpoint directory
  uint64_t offset = 0;    // byte offset of the data inside that file (after the header)
  uint64_t nbytes = 0;

  size_t element_size() const { return extra == Extra::kI64 ? 8 : DTypeSize(dtype); }
  // The safetensors name of the stored dtype ("F8_E4M3", "I64", or DTypeName's).
  const char* dtype_name() const;
};

class Checkpoint : public WeightSource {
 public:
  // Opens every safetensors file of the directory and validates their headers. No tensor data is
  // read (the planner uses this to count bytes without touching weights).
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::filesystem::path& dir);

  ~Checkpoint() override;
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  const std::filesystem::path& dir() const { return dir_; }
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  // NotFound naming the tensor and the checkpoint when absent.
  absl::StatusOr<const TensorInfo*> Find(const std::string& name) const;

  // OK when tensor `name` exists with shape `expected_shape` (what config.json implies); else
  // NotFound, or InvalidArgument naming the tensor, both shapes and config.json. Reads no data,
  // so callers check shapes before they allocate anything sized from config.json.
  absl::Status CheckShape(const std::string& name, const std::vector<int64_t>& expected_shape) const override;

  // Copies `slice` of tensor `name` into `dst`, converting to `dst_type` (F32/F16/BF16; an I32 or
  // I64 tensor is read only as I32, an F8_E4M3 one as a float type or raw as I8, a U8 one raw as I8:
  // TensorInfo), reading only the bytes of that slice. A tensor of 3 or 4 dimensions is read as the
  // 2-D [shape[0], the product of the rest] (rows only: a slice of dimension 0). `expected_shape` (full tensor) must match the stored shape;
  // a mismatch is an error naming the tensor, both shapes and config.json. dst holds
  // (slice length x other dimension) elements of dst_type, row-major.
  absl::Status Read(const std::string& name, const std::vector<int64_t>& expected_shape, const Slice& slice,
                    DType dst_type, void* dst) const override;

 private:
  struct Mapping;
  Checkpoint() = default;

  std::filesystem::path dir_;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::unique_ptr<Mapping>> files_;  // by file name
};

// Parses one safetensors header (the 8-byte length and the JSON that follows) from the first
// `file_size` bytes at `data`, appending the tensors. Every entry is checked (dtype, shape,
// data_offsets inside the file and matching the shape), and the entries' data_offsets must tile
// the data section exactly, as the format requires: no two tensors share a byte, and no byte
// belongs to no tensor. Exposed for tests and the planner.
absl::Status ParseSafetensorsHeader(const uint8_t* data, uint64_t file_size, const std::string& file_name,
                                    std::vector<TensorInfo>* out);

// Parses model.safetensors.index.json's text into its weight_map (tensor name -> file name),
// what Checkpoint::Open runs on the file. DataLoss naming `source` when the text is not JSON, has
// no "weight_map" object, or an entry is not a string naming a file inside the checkpoint
// directory (empty, ".", "..", or holding a '/' or a NUL byte). Exposed for tests and fuzz/.
absl::Status ParseSafetensorsIndex(std::string_view text, const std::string& source,
                                   std::map<std::string, std::string>* weight_map);

}  // namespace shardserve

#endif  // SHARDSERVE_MODEL_CHECKPOINT_H_
