// A safetensors file's header and tensor table (model/checkpoint.h), from arbitrary bytes: the
// same ParseSafetensorsHeader that Checkpoint::Open runs on each mmap-ed file. Errors must be a
// Status; a header that parses must describe tensors that lie inside the file, with a size that
// matches dtype x shape (what Checkpoint::Read relies on without checking again), and that tile the
// data section (after the 8-byte length and the header) exactly: sorted by offset, the first
// begins where the data section does, each begins where the previous ends (no overlap, no gap) and
// the last ends at the end of the file.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "fuzz/check.h"
#include "kernels/tensor.h"
#include "model/checkpoint.h"

using shardserve_fuzz::Check;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<shardserve::TensorInfo> tensors;
  const absl::Status status = shardserve::ParseSafetensorsHeader(data, size, "fuzz.safetensors", &tensors);
  if (!status.ok()) return 0;
  Check(size >= 8, "a file shorter than its 8-byte header length accepted");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | data[i];  // little-endian u64
  Check(header_len <= size - 8, "a header longer than the file accepted");
  const uint64_t data_start = 8 + header_len;
  for (const shardserve::TensorInfo& t : tensors) {
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      Check(d >= 0, "a negative dimension");
      numel *= static_cast<uint64_t>(d);  // checked by the parser: no overflow
    }
    Check(t.nbytes == numel * t.element_size(), "a tensor whose bytes are not dtype x shape");
    Check(t.offset >= data_start && t.offset <= size && t.nbytes <= size - t.offset,
          "a tensor outside the data section");
  }
  // The tiling: by offset (zero-byte tensors first at an offset), each tensor begins where the
  // bytes covered so far end.
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const shardserve::TensorInfo& t : tensors) ranges.emplace_back(t.offset, t.offset + t.nbytes);
  std::sort(ranges.begin(), ranges.end());
  uint64_t covered = data_start;
  for (const auto& [begin, end] : ranges) {
    Check(begin >= covered, "two tensors overlap");
    Check(begin <= covered, "data bytes between two tensors belong to none");
    covered = end;
  }
  Check(covered == size, "data bytes after the last tensor belong to none");
  return 0;
}
