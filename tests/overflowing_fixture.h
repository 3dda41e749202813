// A checkpoint whose weights are all finite (the load check passes it) but whose logits are not
// finite for the sequences that hold one token: a copy of tests/fixtures/models/gemma2_tf5 with
// that token's embedding row set to 1e38. Gemma multiplies embeddings by sqrt(hidden_size) = 8,
// which overflows float32 to +inf, and the first RMSNorm turns the infinity into NaN; attention
// spreads it to the sequence's later positions and to nothing else. Header-only, for the test
// programs (they define SHARDSERVE_SOURCE_DIR).
#ifndef SHARDSERVE_TESTS_OVERFLOWING_FIXTURE_H_
#define SHARDSERVE_TESTS_OVERFLOWING_FIXTURE_H_

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "model/checkpoint.h"

namespace shardserve {

// A token id that neither the gemma2_tf5 fixture's golden prompt nor its greedy continuation
// holds, so that requests built from the golden never feed it.
inline constexpr int32_t kOverflowingToken = 500;

// Writes the copy into `dir` (created; files already there are replaced), with `token`'s
// embedding row set to 1e38.
inline absl::Status WriteOverflowingGemma(const std::filesystem::path& dir, int32_t token = kOverflowingToken) {
  namespace fs = std::filesystem;
  const fs::path fixture = fs::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/models/gemma2_tf5";
  std::error_code ec;
  fs::create_directories(dir, ec);
  fs::copy(fixture, dir, fs::copy_options::overwrite_existing | fs::copy_options::recursive, ec);
  if (ec) return absl::InternalError(absl::StrCat("copying ", fixture.string(), ": ", ec.message()));
  const fs::path file = dir / "model.safetensors";
  std::vector<uint8_t> bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  std::vector<TensorInfo> tensors;
  if (absl::Status s = ParseSafetensorsHeader(bytes.data(), bytes.size(), file.string(), &tensors); !s.ok()) return s;
  for (const TensorInfo& t : tensors) {
    if (t.name != "model.embed_tokens.weight") continue;
    if (t.dtype != DType::kF32 || t.shape.size() != 2 || token < 0 || token >= t.shape[0]) {
      return absl::FailedPreconditionError("gemma2_tf5's embedding is not the F32 [vocab, hidden] this expects");
    }
    const float huge = 1e38f;
    for (int64_t i = 0; i < t.shape[1]; ++i) {
      std::memcpy(bytes.data() + t.offset + (static_cast<uint64_t>(token) * t.shape[1] + i) * 4, &huge, 4);
    }
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    return out.good() ? absl::OkStatus() : absl::InternalError(absl::StrCat("writing ", file.string()));
  }
  return absl::NotFoundError("gemma2_tf5 has no model.embed_tokens.weight");
}

}  // namespace shardserve

#endif  // SHARDSERVE_TESTS_OVERFLOWING_FIXTURE_H_
