// Speculative decoding's proposers (docs/speculative-decoding.md): given a sequence's tokens
// (prompt, then every token generated), guess the next few. The scheduler feeds the guesses after
// the sequence's last sampled token in one step; the model scores them all at once and the
// coordinator keeps the longest prefix that the model, sampling as it always does, agrees with.
//
// A proposer here is deterministic (its proposal distribution is one-hot), which is what makes
// "sample y at each position with the request's own sampler and accept while y equals the
// proposal" exact (the proof is in scheduler.cc, Scheduler::Verify).
//
// Threading: Propose is const and keeps no state; the scheduler's thread calls it.
#ifndef SHARDSERVE_COORDINATOR_SCHEDULER_PROPOSER_H_
#define SHARDSERVE_COORDINATOR_SCHEDULER_PROPOSER_H_

#include <cstdint>
#include <vector>

namespace shardserve {

class Proposer {
 public:
  virtual ~Proposer() = default;
  // Sets *out to at most `k` tokens (k >= 1) expected after `tokens` (non-empty); empty: no guess.
  virtual void Propose(const std::vector<int32_t>& tokens, int k, std::vector<int32_t>* out) const = 0;
};

// Cuts a sequence's guesses to those its constraint allows: a request whose tokens a grammar
// restricts (structured outputs) is fed only guesses its grammar accepts, each followed by a
// position where some token is allowed (the engine; grammar/matcher.h GuessMasks). The scheduler
// calls it after the proposer, on the scheduler's thread.
class GuessFilter {
 public:
  virtual ~GuessFilter() = default;
  // How many leading tokens of `guesses` (non-empty; proposed after sequence `seq`'s tokens) it
  // may be fed: 0 to guesses.size().
  virtual int Allowed(uint64_t seq, const std::vector<int32_t>& guesses) = 0;
};

// Prompt lookup (n-gram): the sequence's last n tokens, for n from max_n down to min_n, are looked
// for earlier in the sequence (its prompt or its output), latest occurrence first; the first found
// proposes the (up to) k tokens that followed it. A text that repeats itself (code edits, quoting
// the prompt, lists) gets long accepted runs; free text gets few.
class NgramProposer : public Proposer {
 public:
  // 1 <= min_n <= max_n <= kMaxN.
  static constexpr int kMaxN = 8;
  NgramProposer(int min_n, int max_n) : min_n_(min_n), max_n_(max_n) {}
  void Propose(const std::vector<int32_t>& tokens, int k, std::vector<int32_t>* out) const override;

 private:
  const int min_n_;
  const int max_n_;
};

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_SCHEDULER_PROPOSER_H_
