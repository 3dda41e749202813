// A grammar bound to a tokenizer's vocabulary (CompiledGrammar) and one sequence's state in it
// (GrammarMatcher): the allowed-token bitmask of each step, the step's token accepted, rollback.
// grammar/grammar.h describes the design.
//
//   SHARDSERVE_ASSIGN_OR_RETURN(Grammar g, GrammarFromJsonSchema(schema_text));
//   auto vocab = std::make_shared<const TokenizerInfo>(TokenizerInfo(token_bytes, special, eos_ids, vocab_size));
//   SHARDSERVE_ASSIGN_OR_RETURN(std::shared_ptr<const CompiledGrammar> compiled, CompiledGrammar::Compile(g, vocab));
//   GrammarMatcher m(compiled);
//   std::vector<uint32_t> mask(m.mask_words());
//   m.FillNextTokenBitmask(mask.data());   // bit id % 32 of word id / 32: token `id` allowed
//   ... sample under the mask ...
//   m.AcceptToken(id);
//
// The vocabulary is the byte string of every token id, supplied by the caller (the tokenizer
// lives with the coordinator; ByteLevelTokenBytes below turns a byte-level BPE token's text into
// its bytes). Ownership: a CompiledGrammar holds its TokenizerInfo by shared_ptr; a GrammarMatcher
// holds its CompiledGrammar the same way. Threading: TokenizerInfo and CompiledGrammar are
// immutable and thread-safe; a GrammarMatcher is used by one thread at a time.
#ifndef SHARDSERVE_GRAMMAR_MATCHER_H_
#define SHARDSERVE_GRAMMAR_MATCHER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grammar/grammar.h"

namespace shardserve::grammar {

// The bytes of a byte-level BPE token (GPT-2's byte-to-unicode alphabet, as Llama 3, Qwen and
// GPT-2 spell tokens in tokenizer.json); nullopt if `token` has a character outside the alphabet.
std::optional<std::string> ByteLevelTokenBytes(std::string_view token);

namespace internal {
// Distinct byte strings, sorted, read as a trie laid out flat: lcp[i] is the common prefix of
// strings i-1 and i (lcp[0] = 0); the strings that start with strings[i][0 .. k), for k in
// (lcp[i], size of string i], are i .. PrefixEnd(i, k) - 1, so that a walk that fails after k
// bytes skips them all at once.
struct SortedStrings {
  std::vector<std::string> strings;
  std::vector<int32_t> lcp;
  std::vector<int32_t> ends_begin;  // per string, its first entry in ends (one more at the end)
  std::vector<int32_t> ends;

  // Appends `s`, which sorts after the last string added.
  void Add(std::string s);
  // Computes ends once every string is added.
  void Finish();
  int32_t PrefixEnd(size_t i, size_t k) const { return ends[ends_begin[i] + k - lcp[i] - 1]; }
  size_t size() const { return strings.size(); }
};
}  // namespace internal

// A tokenizer's vocabulary as the grammar engine needs it: the bytes of each token, sorted once.
class TokenizerInfo {
 public:
  // token_bytes[id]: the bytes token `id` adds to the text. special[id]: a special token, allowed
  // only where the grammar names it (<[id]>; its bytes are then SpecialTokenBytes(id), grammar/utf8.h).
  // A token of text with an empty byte string or a byte of 0xF5 or more (no valid UTF-8 holds one)
  // is never allowed. eos_ids: the tokens allowed where the grammar may end.
  // vocab_size >= token_bytes.size(): the model's vocabulary (ids past the tokenizer's never allowed).
  TokenizerInfo(std::vector<std::string> token_bytes, const std::vector<bool>& special, std::vector<int32_t> eos_ids,
                int32_t vocab_size);

  int32_t vocab_size() const { return vocab_size_; }
  const std::vector<int32_t>& eos_ids() const { return eos_ids_; }
  const std::string& token_bytes(int32_t id) const { return token_bytes_[id]; }
  bool allowed_ever(int32_t id) const { return id >= 0 && id < static_cast<int32_t>(allowed_ever_.size()) && allowed_ever_[id]; }

  // Distinct byte strings of the allowed tokens, sorted; lcp[i] is the common prefix of strings i-1 and i.
  const std::vector<std::string>& sorted() const { return sorted_.strings; }
  const std::vector<int32_t>& lcp() const { return sorted_.lcp; }
  const internal::SortedStrings& sorted_strings() const { return sorted_; }
  // first_byte_begin()[b]: the index in sorted() of the first string whose first byte is >= b
  // (b in 0..256), so that a walk skips all strings of a first byte at once.
  const std::vector<int32_t>& first_byte_begin() const { return first_byte_begin_; }
  // The token ids of sorted()[i]: ids_[ids_begin_[i] .. ids_begin_[i+1]).
  template <typename F>
  void ForEachId(size_t i, F&& f) const {
    for (int32_t k = ids_begin_[i]; k < ids_begin_[i + 1]; ++k) f(ids_[k]);
  }

 private:
  std::vector<std::string> token_bytes_;
  std::vector<char> allowed_ever_;
  std::vector<int32_t> eos_ids_;
  int32_t vocab_size_;
  internal::SortedStrings sorted_;
  std::vector<int32_t> first_byte_begin_;
  std::vector<int32_t> ids_begin_, ids_;
};

namespace internal {
struct Machine;  // the flattened grammar (matcher.cc)
struct SlotCache;
}  // namespace internal

class CompiledGrammar {
 public:
  // `cancel` (may be null; read from this thread while another sets it): once true, the compile
  // stops within one pass over the vocabulary's strings and returns Cancelled.
  static absl::StatusOr<std::shared_ptr<const CompiledGrammar>> Compile(const Grammar& grammar,
                                                                         std::shared_ptr<const TokenizerInfo> vocab,
                                                                         const std::atomic<bool>* cancel = nullptr);
  ~CompiledGrammar();

  const TokenizerInfo& vocab() const { return *vocab_; }
  const internal::Machine& machine() const { return *machine_; }
  // The precomputed split of the vocabulary at a stack top (see grammar.h); null where the slot
  // holds no character class.
  const internal::SlotCache* cache(int32_t slot) const;
  // The same for a stack top inside a UTF-8 character (`partial` bytes read), made on first use
  // and kept. Thread-safe.
  const internal::SlotCache* PartialCache(int32_t slot, uint32_t partial) const;
  // Tokens decided without the stack, over all positions (statistics for the benchmark).
  int64_t context_dependent_tokens() const { return context_dependent_; }

 private:
  CompiledGrammar() = default;
  std::shared_ptr<const TokenizerInfo> vocab_;
  std::unique_ptr<internal::Machine> machine_;
  std::vector<std::unique_ptr<internal::SlotCache>> caches_;
  int64_t context_dependent_ = 0;
  mutable absl::Mutex mu_;
  mutable absl::flat_hash_map<uint64_t, std::unique_ptr<internal::SlotCache>> partial_caches_ ABSL_GUARDED_BY(mu_);
};

// Node arena: hash-consed stack frames. A stack is the id of its top frame.
namespace internal {
struct Frame {
  int32_t slot;
  uint32_t partial;  // bytes read of a UTF-8 character not yet complete (0: none)
  int32_t parent;    // kBottom: the root's frame
  bool operator==(const Frame&) const = default;
  template <typename H>
  friend H AbslHashValue(H h, const Frame& f) {
    return H::combine(std::move(h), f.slot, f.partial, f.parent);
  }
};
inline constexpr int32_t kBottom = -1;
// A state of more stacks than this, or an expansion of more (slot, parent) pairs in one byte, is
// not followed: Compile refuses such a grammar (ResourceExhausted), and a matcher that meets one
// stops (GrammarMatcher::status).
inline constexpr size_t kMaxStacks = 10000;
inline constexpr size_t kMaxExpandWork = 200000;
struct Round;
inline constexpr int32_t kScratchBase = 1 << 30;

class Arena {
 public:
  // Ids from `base`; frames with smaller ids are looked up in `under`.
  explicit Arena(int32_t base = 0, const Arena* under = nullptr) : base_(base), under_(under) {}
  int32_t Intern(const Frame& f);
  const Frame& Get(int32_t id) const { return id >= base_ ? frames_[id - base_] : under_->Get(id); }
  void Clear() {
    frames_.clear();
    index_.clear();
  }
  size_t size() const { return frames_.size(); }

 private:
  int32_t base_;
  const Arena* under_;
  std::vector<Frame> frames_;
  absl::flat_hash_map<Frame, int32_t> index_;
};
}  // namespace internal

class GrammarMatcher {
 public:
  explicit GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar);
  ~GrammarMatcher();
  // Not copyable or movable: its scratch arena points into its own arena.
  GrammarMatcher(const GrammarMatcher&) = delete;
  GrammarMatcher& operator=(const GrammarMatcher&) = delete;

  // Words of the bitmask: ceil(vocab_size / 32).
  int32_t mask_words() const { return (grammar_->vocab().vocab_size() + 31) / 32; }
  // Writes the allowed tokens of the next step into mask[0 .. mask_words()): bit (id % 32) of word
  // (id / 32). After termination nothing is allowed.
  void FillNextTokenBitmask(uint32_t* mask);
  // Advances by `token`; false (state unchanged) if the token is not allowed here.
  bool AcceptToken(int32_t token);
  // Advances by raw bytes (tests, and text forced by the caller); false (state unchanged) if they
  // do not continue a valid prefix.
  bool AcceptBytes(std::string_view bytes);
  // Whether the text so far is a complete sentence of the grammar (EOS would be allowed).
  bool CanEnd() const { return states_.back().can_end; }
  // Whether an EOS token was accepted.
  bool IsTerminated() const { return states_.back().terminated; }
  // Undoes the last n accepted tokens (or AcceptBytes calls); n <= NumAccepted().
  absl::Status Rollback(int n);
  int NumAccepted() const { return static_cast<int>(states_.size()) - 1; }
  // Speculative decoding: the masks of a row that samples after each of `guesses` (tokens proposed
  // to follow the text so far), one per position: masks[i * mask_words() ..] is the mask after the
  // first i guesses. The guesses are cut before the first one that its position's mask does not
  // allow, and before one after which nothing is allowed (EOS, or the end of a grammar that has no
  // EOS there); returns how many are kept, k, with (k + 1) * mask_words() words in *masks. The
  // matcher ends as it began: it advances over the guesses and rolls them back, and a guess past
  // which the grammar is too ambiguous to follow is cut, its error forgotten (a guess is no token
  // of the text until accepted). 0 with one empty mask when nothing is allowed now.
  int GuessMasks(const std::vector<int32_t>& guesses, std::vector<uint32_t>* masks);
  // ResourceExhausted once the grammar proved too ambiguous to follow (kMaxStacks); from then on
  // nothing is allowed or accepted.
  const absl::Status& status() const { return error_; }

 private:
  struct State {
    std::vector<int32_t> stacks;
    bool can_end = false;
    bool terminated = false;
  };
  bool Advance(std::string_view bytes, State* out);

  std::shared_ptr<const CompiledGrammar> grammar_;
  internal::Arena arena_;
  internal::Arena scratch_;
  std::unique_ptr<internal::Round> round_holder_;
  internal::Round& round_;
  absl::Status error_;
  std::vector<State> states_;  // states_[0]: the start; back(): now
  std::vector<uint64_t> seen_slots_;  // (slot, partial) of the stack tops already OR'd in, this step
  // The context-dependent tokens a stack top allows, by the top's frame id in arena_: a frame's
  // chain never changes, so the walk of its leftovers is made once per sequence. Emptied when it
  // holds more than kMaxMemoIds ids (4 MiB).
  static constexpr size_t kMaxMemoIds = size_t{1} << 20;
  absl::flat_hash_map<int32_t, std::vector<int32_t>> leftover_memo_;
  size_t leftover_memo_ids_ = 0;
};

}  // namespace shardserve::grammar

#endif  // SHARDSERVE_GRAMMAR_MATCHER_H_
