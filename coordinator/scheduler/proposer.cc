#include "coordinator/scheduler/proposer.h"

#include <algorithm>
#include <utility>

namespace shardserve {

void NgramProposer::Propose(uint64_t /*seq*/, const std::vector<int32_t>& tokens, int k,
                            std::vector<int32_t>* out) const {
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

void DraftProposer::Offer(uint64_t seq, int64_t num_tokens, std::vector<int32_t> guesses) {
  Guesses& g = guesses_[seq];
  g.num_tokens = num_tokens;
  g.ids = std::move(guesses);
}

void DraftProposer::Propose(uint64_t seq, const std::vector<int32_t>& tokens, int k, std::vector<int32_t>* out) const {
  out->clear();
  auto it = guesses_.find(seq);
  if (it == guesses_.end() || it->second.num_tokens != static_cast<int64_t>(tokens.size())) return;
  const std::vector<int32_t>& ids = it->second.ids;
  out->assign(ids.begin(), ids.begin() + std::min<int64_t>(k, static_cast<int64_t>(ids.size())));
}

}  // namespace shardserve
