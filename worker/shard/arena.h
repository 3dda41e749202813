// Every device allocation of one model shard, owned in one place: weights, KV cache and step
// buffers are views (Tensor) into these buffers, which live as long as the arena.
//
// Threading: not thread-safe; a shard allocates at load only.
#ifndef SHARDSERVE_WORKER_SHARD_ARENA_H_
#define SHARDSERVE_WORKER_SHARD_ARENA_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/backend.h"

namespace shardserve {

class DeviceArena {
 public:
  explicit DeviceArena(Backend* backend) : backend_(backend) {}

  // A new buffer of `dims` elements of `t` on the backend's device (uninitialized).
  absl::StatusOr<Tensor> Alloc(DType t, absl::Span<const int64_t> dims);
  // Keeps a buffer the backend made (a packed weight).
  void Keep(Buffer buffer) { buffers_.push_back(std::move(buffer)); }
  // Keeps `buffer` in place of the latest one, which is freed (a plain weight its packed copy replaces).
  void ReplaceLatest(Buffer buffer) { buffers_.back() = std::move(buffer); }

 private:
  Backend* backend_;
  std::vector<Buffer> buffers_;
};

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_SHARD_ARENA_H_
