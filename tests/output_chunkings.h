// How the output parsers' tests cut a model's output to stream it: 200 random chunkings (pieces of
// 1 to 12 and of 1 to 3 bytes by turns, from `seed`), then two pieces split at every byte (inside
// every marker and UTF-8 character), then a byte at a time.
#ifndef SHARDSERVE_TESTS_OUTPUT_CHUNKINGS_H_
#define SHARDSERVE_TESTS_OUTPUT_CHUNKINGS_H_

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "absl/strings/string_view.h"

namespace shardserve {

// Each chunking's pieces, views into `text`.
inline std::vector<std::vector<absl::string_view>> OutputChunkings(absl::string_view text, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<absl::string_view>> all;
  for (int trial = 0; trial < 200 + static_cast<int>(text.size()) + 2; ++trial) {
    const int split = trial - 200;
    std::vector<absl::string_view> pieces;
    for (size_t pos = 0; pos < text.size();) {
      size_t n = std::min<size_t>(text.size() - pos, 1 + rng() % (trial % 2 ? 3 : 12));
      if (split >= 0) n = split > static_cast<int>(text.size()) ? 1 : (pos == 0 && split > 0 ? split : text.size() - pos);
      pieces.push_back(text.substr(pos, n));
      pos += n;
    }
    all.push_back(std::move(pieces));
  }
  return all;
}

}  // namespace shardserve

#endif  // SHARDSERVE_TESTS_OUTPUT_CHUNKINGS_H_
