// Speculative decoding's proposers (docs/speculative-decoding.md): given a sequence's tokens
// (prompt, then every token generated), guess the next few. The scheduler feeds the guesses after
// the sequence's last sampled token in one step; the model scores them all at once and the
// coordinator keeps the longest prefix that the model, sampling as it always does, agrees with.
//
// A proposer here is deterministic (its proposal distribution is one-hot), which is what makes
// "sample y at each position with the request's own sampler and accept while y equals the
// proposal" exact (the proof is in scheduler.cc, Scheduler::Verify).
//
// Two kinds: a proposer that guesses on the coordinator from the tokens alone (n-gram), and one
// whose guesses the workers make within each step (a draft model on the worker that samples):
// the plans ask for them and the step results bring them back, and the engine hands them to the
// proposer (DraftProposer), which serves them at the sequence's next decode.
//
// Threading: Propose is const; the scheduler's thread calls it (and the engine's, which is the
// same thread, feeds a DraftProposer).
#ifndef SHARDSERVE_COORDINATOR_SCHEDULER_PROPOSER_H_
#define SHARDSERVE_COORDINATOR_SCHEDULER_PROPOSER_H_

#include <cstdint>
#include <map>
#include <vector>

namespace shardserve {

class Proposer {
 public:
  virtual ~Proposer() = default;
  // Sets *out to at most `k` tokens (k >= 1) expected after `tokens` (non-empty), sequence `seq`'s
  // tokens; empty: no guess.
  virtual void Propose(uint64_t seq, const std::vector<int32_t>& tokens, int k, std::vector<int32_t>* out) const = 0;
  // The workers make the guesses within each step (a draft model): every plan asks the worker that
  // samples for num_speculative_tokens guesses per sampling row (StepPlan.num_draft_tokens) while
  // speculation is on, and a new sequence carries the ids of its tokens the prefix cache holds
  // (NewSeq.cached_token_ids), which the draft must see.
  virtual bool proposes_in_step() const { return false; }
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
  void Propose(uint64_t seq, const std::vector<int32_t>& tokens, int k, std::vector<int32_t>* out) const override;

 private:
  const int min_n_;
  const int max_n_;
};

// A draft model's guesses (worker/draft_runner.h): the worker that samples runs the draft right
// after sampling and returns its greedy continuation of each sampled sequence
// (StepResult.draft_ids), made for the sequence's tokens as they are once the step is verified.
// The engine offers them here; Propose serves them for that token count only (a sequence that
// has grown or been cut since gets no guess). Greedy guesses are deterministic, so the
// verification stays exact (scheduler.cc, Scheduler::Verify).
//
// Memory: one entry per sequence offered and not forgotten (the engine forgets a sequence when it
// ends, and all of them when the group re-forms).
class DraftProposer : public Proposer {
 public:
  // Guesses made after `seq`'s first `num_tokens` tokens (replacing any earlier ones).
  void Offer(uint64_t seq, int64_t num_tokens, std::vector<int32_t> guesses);
  void Forget(uint64_t seq) { guesses_.erase(seq); }
  void Clear() { guesses_.clear(); }
  int64_t size() const { return static_cast<int64_t>(guesses_.size()); }

  void Propose(uint64_t seq, const std::vector<int32_t>& tokens, int k, std::vector<int32_t>* out) const override;
  bool proposes_in_step() const override { return true; }

 private:
  struct Guesses {
    int64_t num_tokens = 0;
    std::vector<int32_t> ids;
  };
  std::map<uint64_t, Guesses> guesses_;
};

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_SCHEDULER_PROPOSER_H_
