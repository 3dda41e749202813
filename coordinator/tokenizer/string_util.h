// std::string_view glue. The library works with std::string_view, but Debian's Abseil is built
// with its own absl::string_view (ABSL_OPTION_USE_STD_STRING_VIEW 0), which StrCat and the
// default flat_hash_map<std::string, ...> lookups expect. These helpers bridge the two.
#ifndef SHARDSERVE_COORDINATOR_TOKENIZER_STRING_UTIL_H_
#define SHARDSERVE_COORDINATOR_TOKENIZER_STRING_UTIL_H_

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"
#include "absl/strings/string_view.h"

namespace shardserve::tokenizer_internal {

// For absl::StrCat and friends.
inline absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// Transparent hash and equality, so that maps keyed by std::string accept std::string_view.
struct StringViewHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return absl::Hash<absl::string_view>{}(Sv(s)); }
};
struct StringViewEq {
  using is_transparent = void;
  bool operator()(std::string_view a, std::string_view b) const { return a == b; }
};
template <typename Value>
using StringMap = absl::flat_hash_map<std::string, Value, StringViewHash, StringViewEq>;

}  // namespace shardserve::tokenizer_internal

#endif  // SHARDSERVE_COORDINATOR_TOKENIZER_STRING_UTIL_H_
