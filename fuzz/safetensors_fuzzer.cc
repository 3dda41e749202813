// A safetensors file's header and tensor table (model/checkpoint.h), from arbitrary bytes: the
// same ParseSafetensorsHeader that Checkpoint::Open runs on each mmap-ed file. Errors must be a
// Status; a header that parses must describe tensors that lie inside the file, with a size that
// matches dtype x shape (what Checkpoint::Read relies on without checking again).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/tensor.h"
#include "model/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<shardserve::TensorInfo> tensors;
  const absl::Status status = shardserve::ParseSafetensorsHeader(data, size, "fuzz.safetensors", &tensors);
  if (!status.ok()) return 0;
  for (const shardserve::TensorInfo& t : tensors) {
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0) std::abort();
      numel *= static_cast<uint64_t>(d);  // checked by the parser: no overflow
    }
    if (t.nbytes != numel * shardserve::DTypeSize(t.dtype)) std::abort();
    if (t.offset < 8 || t.offset > size || t.nbytes > size - t.offset) std::abort();
  }
  return 0;
}
