#include "coordinator/scheduler/proposer.h"

#include <algorithm>

namespace shardserve {

void NgramProposer::Propose(const std::vector<int32_t>& tokens, int k, std::vector<int32_t>* out) const {
  out->clear();
  const int64_t len = static_cast<int64_t>(tokens.size());
  for (int n = std::min<int64_t>(max_n_, len - 1); n >= min_n_; --n) {
    const int32_t* suffix = tokens.data() + len - n;
    // An occurrence [start, start + n) ending before the suffix's end, the latest first.
    for (int64_t start = len - n - 1; start >= 0; --start) {
      if (!std::equal(suffix, suffix + n, tokens.data() + start)) continue;
      const int64_t from = start + n, to = std::min<int64_t>(len, from + k);
      out->assign(tokens.begin() + from, tokens.begin() + to);
      return;
    }
  }
}

}  // namespace shardserve
