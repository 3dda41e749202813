// The pushdown automaton over a Grammar, the per-position token split at compile time, and the
// per-step mask (grammar/grammar.h describes the design).
#include "grammar/matcher.h"

#include <algorithm>
#include <array>
#include <bit>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "grammar/utf8.h"

namespace shardserve::grammar {

std::optional<std::string> ByteLevelTokenBytes(std::string_view token) {
  // GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others (0-32, 127-160,
  // 173) for U+0100 upwards in order.
  static const std::array<int, 324> kInverse = [] {
    std::array<int, 324> inv;
    inv.fill(-1);
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      inv[printable ? b : next++] = b;
    }
    return inv;
  }();
  std::string out;
  for (size_t i = 0; i < token.size();) {
    size_t len = 0;
    std::optional<uint32_t> cp = DecodeUtf8(token, i, &len);
    if (!cp.has_value() || *cp >= kInverse.size() || kInverse[*cp] < 0) return std::nullopt;
    out.push_back(static_cast<char>(kInverse[*cp]));
    i += len;
  }
  return out;
}

TokenizerInfo::TokenizerInfo(std::vector<std::string> token_bytes, const std::vector<bool>& special,
                             std::vector<int32_t> eos_ids, int32_t vocab_size)
    : token_bytes_(std::move(token_bytes)),
      eos_ids_(std::move(eos_ids)),
      vocab_size_(std::max<int32_t>(vocab_size, static_cast<int32_t>(token_bytes_.size()))) {
  const int32_t n = static_cast<int32_t>(token_bytes_.size());
  allowed_ever_.assign(n, 0);
  std::vector<int32_t> order;
  for (int32_t id = 0; id < n; ++id) {
    const bool is_special = id < static_cast<int32_t>(special.size()) && special[id];
    const bool is_eos = std::find(eos_ids_.begin(), eos_ids_.end(), id) != eos_ids_.end();
    if (is_eos) continue;
    if (is_special) {
      // Read as its own "character" (utf8.h), which only a grammar naming it (<[id]>) allows.
      if (id > kMaxSpecialTokenId) continue;
      token_bytes_[id] = SpecialTokenBytes(id);
    } else if (token_bytes_[id].empty() ||
               std::any_of(token_bytes_[id].begin(), token_bytes_[id].end(),
                           [](char c) { return static_cast<uint8_t>(c) >= 0xF5; })) {
      continue;  // no valid UTF-8 holds such a byte; it would begin a special token's bytes
    }
    allowed_ever_[id] = 1;
    order.push_back(id);
  }
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return token_bytes_[a] != token_bytes_[b] ? token_bytes_[a] < token_bytes_[b] : a < b;
  });
  for (int32_t id : order) {
    if (sorted_.strings.empty() || sorted_.strings.back() != token_bytes_[id]) {
      sorted_.Add(token_bytes_[id]);
      ids_begin_.push_back(static_cast<int32_t>(ids_.size()));
    }
    ids_.push_back(id);
  }
  ids_begin_.push_back(static_cast<int32_t>(ids_.size()));
  sorted_.Finish();
  const std::vector<std::string>& sorted = sorted_.strings;
  first_byte_begin_.assign(257, static_cast<int32_t>(sorted.size()));
  for (int32_t i = static_cast<int32_t>(sorted.size()) - 1; i >= 0; --i) {
    first_byte_begin_[static_cast<uint8_t>(sorted[i][0])] = i;
  }
  for (int b = 255; b >= 0; --b) first_byte_begin_[b] = std::min(first_byte_begin_[b], first_byte_begin_[b + 1]);
}

namespace internal {

void SortedStrings::Add(std::string s) {
  int32_t common = 0;
  if (!strings.empty()) {
    const std::string& p = strings.back();
    while (common < static_cast<int32_t>(std::min(p.size(), s.size())) && p[common] == s[common]) ++common;
  }
  lcp.push_back(common);
  strings.push_back(std::move(s));
}

void SortedStrings::Finish() {
  const int32_t n = static_cast<int32_t>(strings.size());
  ends_begin.assign(n + 1, 0);
  for (int32_t i = 0; i < n; ++i) {
    ends_begin[i + 1] = ends_begin[i] + static_cast<int32_t>(strings[i].size()) - lcp[i];
  }
  ends.assign(ends_begin[n], n);
  // The prefixes still open (each an entry of ends), shortest first: string i closes those longer
  // than its common prefix with string i-1.
  std::vector<std::pair<int32_t, int32_t>> open;  // (length, entry)
  for (int32_t i = 0; i < n; ++i) {
    while (!open.empty() && open.back().first > lcp[i]) {
      ends[open.back().second] = i;
      open.pop_back();
    }
    for (int32_t k = lcp[i] + 1; k <= static_cast<int32_t>(strings[i].size()); ++k) {
      open.push_back({k, ends_begin[i] + k - lcp[i] - 1});
    }
  }
}

int32_t Arena::Intern(const Frame& f) {
  auto [it, inserted] = index_.try_emplace(f, base_ + static_cast<int32_t>(frames_.size()));
  if (inserted) frames_.push_back(f);
  return it->second;
}

// Partial UTF-8 character: value so far (21 bits), continuation bytes still to come, length.
constexpr uint32_t PackPartial(uint32_t value, uint32_t remaining, uint32_t length) {
  return value | (remaining << 21) | (length << 24);
}


// One round of expansion (a byte read, a frame resumed): the (slot, parent) pairs expanded so far,
// and whether a bound above was hit, dropping paths.
struct Round {
  absl::flat_hash_set<uint64_t> seen;
  std::vector<std::pair<int32_t, int32_t>> todo;  // (slot, parent) still to expand
  bool overflow = false;
  // Compile time: set by another thread to stop the walks (`cancelled` then says they stopped).
  const std::atomic<bool>* cancel = nullptr;
  bool cancelled = false;
};

struct Machine {
  using Bytes = std::array<uint64_t, 4>;  // a set of bytes as bits
  enum Kind : int8_t { kRule, kClass, kStar, kEnd };
  struct Slot {
    Kind kind;
    int32_t index;
  };
  std::vector<Slot> slots;                       // every sequence's elements, then a kEnd
  std::vector<std::vector<int32_t>> rule_starts;  // first slot of each alternative, per rule
  std::vector<CharClass> classes;
  std::vector<std::array<uint64_t, 2>> ascii;  // per class: its ASCII members as bits
  std::vector<Bytes> first_bytes;              // per class: the bytes that can start one of its characters
  int32_t root = 0;

  explicit Machine(const Grammar& g) : classes(g.classes), root(g.root) {
    for (const Rule& rule : g.rules) {
      std::vector<int32_t> starts;
      for (const Sequence& seq : rule.alternatives) {
        starts.push_back(static_cast<int32_t>(slots.size()));
        for (const Element& e : seq) {
          const Kind k = e.kind == Element::Kind::kRule ? kRule : e.kind == Element::Kind::kClass ? kClass : kStar;
          slots.push_back({k, e.index});
        }
        slots.push_back({kEnd, -1});
      }
      rule_starts.push_back(std::move(starts));
    }
    for (const CharClass& c : classes) {
      std::array<uint64_t, 2> bits = {0, 0};
      for (auto [lo, hi] : c.ranges) {
        for (uint32_t cp = lo; cp <= std::min<uint32_t>(hi, 127); ++cp) bits[cp >> 6] |= uint64_t{1} << (cp & 63);
      }
      ascii.push_back(bits);
    }
    for (size_t c = 0; c < classes.size(); ++c) {
      Bytes bytes = {0, 0, 0, 0};
      uint32_t unused;
      for (int b = 0; b < 256; ++b) {
        if (MatchByte(static_cast<int32_t>(c), 0, static_cast<uint8_t>(b), &unused) != Match::kFail) {
          bytes[b >> 6] |= uint64_t{1} << (b & 63);
        }
      }
      first_bytes.push_back(bytes);
    }
  }

  // The bytes some stack of `stacks` reads: a Step on any other byte leaves nothing.
  Bytes Readable(const Arena& arena, const std::vector<int32_t>& stacks) const {
    Bytes out = {0, 0, 0, 0};
    for (int32_t id : stacks) {
      const Frame& f = arena.Get(id);
      const int32_t cls = slots[f.slot].index;
      if (f.partial == 0) {
        for (int w = 0; w < 4; ++w) out[w] |= first_bytes[cls][w];
        continue;
      }
      uint32_t unused;
      for (int b = 0x80; b < 0xC0; ++b) {
        if (MatchByte(cls, f.partial, static_cast<uint8_t>(b), &unused) != Match::kFail) {
          out[b >> 6] |= uint64_t{1} << (b & 63);
        }
      }
    }
    return out;
  }

  // Adds to `out` the stacks with a character class on top that the frame (slot, parent) stands
  // for: rule references expanded, finished sequences returned from. `exited`: a path returned
  // past kBottom (the root finished, or at compile time the top frame).
  //
  // `seen` holds the (slot, parent) pairs of rule calls and returns already expanded in this round:
  // a pair expands to the same stacks every time, so each is expanded once (without it, a grammar
  // like `r1 ::= r0 r0`, `r2 ::= r1 r1`, ... over a nullable r0 takes exponential time).
  void Expand(Arena& arena, int32_t slot, int32_t parent, std::vector<int32_t>* out, bool* exited, Round& round) const {
    std::vector<std::pair<int32_t, int32_t>>& todo = round.todo;
    todo.clear();
    todo.push_back({slot, parent});
    size_t work = 0;
    while (!todo.empty()) {
      auto [at, up] = todo.back();
      todo.pop_back();
      if (++work > kMaxExpandWork || out->size() >= kMaxStacks) {
        round.overflow = true;
        return;
      }
      const Slot& s = slots[at];
      if (!round.seen.insert((static_cast<uint64_t>(at) << 32) | static_cast<uint32_t>(up)).second) {
        continue;
      }
      switch (s.kind) {
        case kEnd:
          if (up == kBottom) {
            *exited = true;
          } else {
            const Frame p = arena.Get(up);
            todo.push_back({p.slot, p.parent});
          }
          break;
        case kRule: {
          // A call in tail position returns straight to the caller's caller.
          const int32_t ret = slots[at + 1].kind == kEnd ? up : arena.Intern({at + 1, 0, up});
          for (int32_t start : rule_starts[s.index]) todo.push_back({start, ret});
          break;
        }
        case kClass:
          out->push_back(arena.Intern({at, 0, up}));
          break;
        case kStar:
          out->push_back(arena.Intern({at, 0, up}));
          todo.push_back({at + 1, up});
          break;
      }
    }
  }

  enum class Match { kFail, kPartial, kComplete };
  // Byte `b` read at a class with `partial` bytes of a character before it.
  Match MatchByte(int32_t cls, uint32_t partial, uint8_t b, uint32_t* next) const {
    uint32_t value, remaining, length;
    if (partial == 0) {
      if (b < 0x80) return (ascii[cls][b >> 6] >> (b & 63)) & 1 ? Match::kComplete : Match::kFail;
      if (b >= 0xC2 && b <= 0xDF) {
        value = b & 0x1F, remaining = 1, length = 2;
      } else if (b >= 0xE0 && b <= 0xEF) {
        value = b & 0x0F, remaining = 2, length = 3;
      } else if (b >= 0xF0 && b <= 0xF7) {  // 0xF5-0xF7: special tokens only (utf8.h)
        value = b & 0x07, remaining = 3, length = 4;
      } else {
        return Match::kFail;
      }
    } else {
      if ((b & 0xC0) != 0x80) return Match::kFail;
      value = ((partial & 0x1FFFFF) << 6) | (b & 0x3F);
      remaining = ((partial >> 21) & 7) - 1;
      length = partial >> 24;
    }
    // Code points this prefix can still become, within the ones its length encodes.
    static constexpr uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
    const uint32_t lo = std::max(value << (6 * remaining), kMin[length]);
    const uint32_t hi = std::min((value << (6 * remaining)) | ((1u << (6 * remaining)) - 1), kMaxEncodable);
    if (lo > hi || !classes[cls].Intersects(lo, hi)) return Match::kFail;
    if (remaining == 0) return Match::kComplete;
    *next = PackPartial(value, remaining, length);
    return Match::kPartial;
  }

  // The stacks after reading byte `b` from each of `in` (sorted, deduplicated).
  void Step(Arena& arena, const std::vector<int32_t>& in, uint8_t b, std::vector<int32_t>* out, bool* exited,
            Round& round) const {
    out->clear();
    *exited = false;
    bool fresh = false;  // round.seen cleared for this byte (most bytes fail at every stack, and clear nothing)
    for (int32_t id : in) {
      const Frame f = arena.Get(id);
      const Slot& s = slots[f.slot];
      uint32_t partial = 0;
      switch (MatchByte(s.index, f.partial, b, &partial)) {
        case Match::kFail:
          break;
        case Match::kPartial:
          out->push_back(arena.Intern({f.slot, partial, f.parent}));
          break;
        case Match::kComplete:
          if (!fresh) {
            round.seen.clear();
            fresh = true;
          }
          Expand(arena, s.kind == kStar ? f.slot : f.slot + 1, f.parent, out, exited, round);
          break;
      }
    }
    if (out->size() > 1) {
      std::sort(out->begin(), out->end());
      out->erase(std::unique(out->begin(), out->end()), out->end());
    }
  }

  // The stacks where a frame's caller resumes once the frame returns.
  void Resume(Arena& arena, int32_t parent, std::vector<int32_t>* out, bool* exited, Round& round) const {
    out->clear();
    *exited = false;
    if (parent == kBottom) {
      *exited = true;
      return;
    }
    const Frame p = arena.Get(parent);
    round.seen.clear();
    Expand(arena, p.slot, p.parent, out, exited, round);
    std::sort(out->begin(), out->end());
    out->erase(std::unique(out->begin(), out->end()), out->end());
  }
};

// The token split at one stack top (grammar.h): tokens accepted whatever lies below, and the
// context-dependent ones grouped by the bytes left over once the top frame has returned.
struct SlotCache {
  std::vector<int32_t> accepted_ids;  // sorted; or, when many, the bitmask below
  std::vector<uint32_t> accepted_bits;
  SortedStrings leftovers;
  std::vector<std::vector<int32_t>> leftover_tokens;
};

namespace {

// Walks `strings` from the stacks `start`, sharing the work of common prefixes and skipping a
// whole subtree at the first byte no stack reads. For each string read to its end,
// end(i, exited_at, alive): alive when a stack remains; exited_at[k] when a path returned past
// the bottom frame after k bytes. For strings [begin, end) whose first d bytes leave no stack,
// dead(begin, end, d, exited_at).
template <typename End, typename Dead>
void Walk(const Machine& m, Arena& arena, Round& round, const std::vector<int32_t>& start, const SortedStrings& strings,
          End&& end, Dead&& dead) {
  std::vector<std::vector<int32_t>> sets(1, start);
  std::vector<char> exited_at(1, 0);
  std::vector<int32_t> prefix_end(1, 0);  // prefix_end[k]: where the strings sharing the current first k bytes end
  // readable[k]: the bytes some stack of sets[k] reads, made when first needed (has_readable[k]),
  // so that the many siblings a set cannot read cost a bit test each, not a Step.
  std::vector<Machine::Bytes> readable(1);
  std::vector<char> has_readable(1, 0);
  size_t valid = 0;  // sets[0 .. valid] hold the stacks after the current string's first bytes
  const size_t n = strings.size();
  for (size_t i = 0; i < n;) {
    if (round.cancel != nullptr && round.cancel->load(std::memory_order_relaxed)) {
      round.cancelled = true;
      return;
    }
    const std::string& s = strings.strings[i];
    const size_t common = static_cast<size_t>(strings.lcp[i]);
    size_t d = std::min(common, valid);
    if (sets.size() < s.size() + 1) {
      sets.resize(s.size() + 1);
      exited_at.resize(s.size() + 1);
      prefix_end.resize(s.size() + 1);
      readable.resize(s.size() + 1);
      has_readable.resize(s.size() + 1);
    }
    for (size_t k = common + 1; k <= s.size(); ++k) prefix_end[k] = strings.PrefixEnd(i, k);
    bool is_dead = false;
    while (d < s.size()) {
      bool exited = false;
      const auto b = static_cast<uint8_t>(s[d]);
      if (!has_readable[d]) {
        readable[d] = m.Readable(arena, sets[d]);
        has_readable[d] = 1;
      }
      if ((readable[d][b >> 6] >> (b & 63)) & 1) {
        m.Step(arena, sets[d], b, &sets[d + 1], &exited, round);
      } else {
        sets[d + 1].clear();
      }
      has_readable[d + 1] = 0;
      exited_at[d + 1] = exited;
      ++d;
      if (sets[d].empty() && d < s.size()) {
        is_dead = true;
        break;
      }
    }
    valid = d;
    if (!is_dead) {
      end(i, exited_at, !sets[d].empty());
      // With no stack left, the strings that extend s die at its end too.
      const size_t j = sets[d].empty() ? static_cast<size_t>(prefix_end[d]) : i + 1;
      if (j > i + 1) dead(i + 1, j, d, exited_at);
      i = j;
      continue;
    }
    // Every string from i on that shares the prefix s[0 .. d) dies there too.
    const size_t j = static_cast<size_t>(prefix_end[d]);
    dead(i, j, d, exited_at);
    i = j;
  }
}

// Runtime: calls readable(i) for each string readable in full (a stack remains after its last
// byte, or the root ended exactly there).
template <typename F>
void WalkStrings(const Machine& m, Arena& arena, Round& round, const std::vector<int32_t>& start,
                 const SortedStrings& strings, F&& readable) {
  Walk(
      m, arena, round, start, strings,
      [&](size_t i, const std::vector<char>& exited_at, bool alive) {
        if (alive || exited_at[strings.strings[i].size()]) readable(i);
      },
      [](size_t, size_t, size_t, const std::vector<char>&) {});
}

// The compile-time split at `slot`: the walk of the whole vocabulary from the frame (slot, bottom)
// alone, with the returns past bottom recorded.
std::unique_ptr<SlotCache> SplitAt(const Machine& m, const TokenizerInfo& vocab, int32_t slot, uint32_t partial,
                                   Arena& arena, Round& round) {
  auto cache = std::make_unique<SlotCache>();
  const std::vector<std::string>& strings = vocab.sorted();
  const size_t words = (static_cast<size_t>(vocab.vocab_size()) + 31) / 32;
  std::vector<uint32_t> accepted(words, 0);
  size_t accepted_count = 0;
  // (string, k): the string returned past the bottom after k bytes with bytes left; the rest,
  // strings[i][k ..], depends on the stack below.
  std::vector<std::pair<int32_t, int32_t>> leftovers;
  auto record_leftovers = [&](size_t i, size_t upto, const std::vector<char>& exited_at) {
    for (size_t k = 1; k <= upto && k < strings[i].size(); ++k) {
      if (exited_at[k]) leftovers.push_back({static_cast<int32_t>(i), static_cast<int32_t>(k)});
    }
  };
  Walk(
      m, arena, round, {arena.Intern({slot, partial, kBottom})}, vocab.sorted_strings(),
      [&](size_t i, const std::vector<char>& exited_at, bool alive) {
        if (alive || exited_at[strings[i].size()]) {
          vocab.ForEachId(i, [&](int32_t id) {
            accepted[id >> 5] |= 1u << (id & 31);
            ++accepted_count;
          });
        } else {
          record_leftovers(i, strings[i].size(), exited_at);
        }
      },
      [&](size_t begin, size_t end, size_t d, const std::vector<char>& exited_at) {
        if (std::none_of(exited_at.begin() + 1, exited_at.begin() + d + 1, [](char e) { return e != 0; })) return;
        for (size_t t = begin; t < end; ++t) record_leftovers(t, d, exited_at);
      });
  if (accepted_count * 32 > static_cast<size_t>(vocab.vocab_size())) {
    cache->accepted_bits = std::move(accepted);
  } else {
    for (size_t w = 0; w < words; ++w) {
      for (uint32_t bits = accepted[w]; bits != 0; bits &= bits - 1) {
        cache->accepted_ids.push_back(static_cast<int32_t>(w * 32 + std::countr_zero(bits)));
      }
    }
  }
  auto rest = [&](const std::pair<int32_t, int32_t>& e) { return std::string_view(strings[e.first]).substr(e.second); };
  std::sort(leftovers.begin(), leftovers.end(), [&](const auto& a, const auto& b) { return rest(a) < rest(b); });
  for (size_t e = 0; e < leftovers.size();) {
    const std::string_view bytes = rest(leftovers[e]);
    std::vector<int32_t> ids;
    for (; e < leftovers.size() && rest(leftovers[e]) == bytes; ++e) {
      vocab.ForEachId(leftovers[e].first, [&](int32_t id) { ids.push_back(id); });
    }
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    cache->leftovers.Add(std::string(bytes));
    cache->leftover_tokens.push_back(std::move(ids));
  }
  cache->leftovers.Finish();
  return cache;
}

}  // namespace
}  // namespace internal

using internal::Arena;
using internal::Frame;
using internal::kBottom;
using internal::Machine;
using internal::SlotCache;

CompiledGrammar::~CompiledGrammar() = default;

const SlotCache* CompiledGrammar::cache(int32_t slot) const { return caches_[slot].get(); }

absl::StatusOr<std::shared_ptr<const CompiledGrammar>> CompiledGrammar::Compile(const Grammar& grammar,
                                                                                std::shared_ptr<const TokenizerInfo> vocab,
                                                                                const std::atomic<bool>* cancel) {
  SHARDSERVE_RETURN_IF_ERROR(ValidateGrammar(grammar));
  if (vocab == nullptr) return absl::InvalidArgumentError("no vocabulary");
  std::shared_ptr<CompiledGrammar> out(new CompiledGrammar());
  out->vocab_ = std::move(vocab);
  out->machine_ = std::make_unique<Machine>(grammar);
  const Machine& m = *out->machine_;
  out->caches_.resize(m.slots.size());
  // Only the rules reachable from the root can be on a stack.
  std::vector<char> reachable(m.rule_starts.size(), 0);
  std::vector<int32_t> todo = {m.root};
  reachable[m.root] = 1;
  while (!todo.empty()) {
    const int32_t r = todo.back();
    todo.pop_back();
    for (int32_t slot : m.rule_starts[r]) {
      for (; m.slots[slot].kind != Machine::kEnd; ++slot) {
        const int32_t callee = m.slots[slot].index;
        if (m.slots[slot].kind == Machine::kRule && !reachable[callee]) {
          reachable[callee] = 1;
          todo.push_back(callee);
        }
      }
    }
  }
  Arena arena;
  internal::Round round;
  round.cancel = cancel;
  for (size_t r = 0; r < m.rule_starts.size(); ++r) {
    if (!reachable[r]) continue;
    for (int32_t start : m.rule_starts[r]) {
      for (int32_t slot = start; m.slots[slot].kind != Machine::kEnd; ++slot) {
        if (m.slots[slot].kind == Machine::kRule) continue;
        arena.Clear();
        out->caches_[slot] = internal::SplitAt(m, *out->vocab_, slot, 0, arena, round);
        if (round.cancelled) return absl::CancelledError("the grammar's compile was cancelled");
        if (round.overflow) {
          return absl::ResourceExhaustedError(absl::StrCat(
              "the grammar is too ambiguous: a token is read by more than ", internal::kMaxStacks,
              " stacks at once, or expands more than ", internal::kMaxExpandWork, " rule calls for one byte"));
        }
        for (const auto& ids : out->caches_[slot]->leftover_tokens) out->context_dependent_ += static_cast<int64_t>(ids.size());
      }
    }
  }
  return std::shared_ptr<const CompiledGrammar>(std::move(out));
}

const SlotCache* CompiledGrammar::PartialCache(int32_t slot, uint32_t partial) const {
  const uint64_t key = (static_cast<uint64_t>(slot) << 32) | partial;
  {
    absl::MutexLock lock(&mu_);
    auto it = partial_caches_.find(key);
    if (it != partial_caches_.end()) return it->second.get();
  }
  Arena arena;
  internal::Round round;  // an overflow here was already met at compile time, from the same frame's start
  std::unique_ptr<SlotCache> cache = internal::SplitAt(*machine_, *vocab_, slot, partial, arena, round);
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = partial_caches_.try_emplace(key, std::move(cache));
  return it->second.get();
}


GrammarMatcher::~GrammarMatcher() = default;

GrammarMatcher::GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar)
    : grammar_(std::move(grammar)),
      scratch_(internal::kScratchBase, &arena_),
      round_holder_(std::make_unique<internal::Round>()),
      round_(*round_holder_) {
  const Machine& m = grammar_->machine();
  State start;
  for (int32_t s : m.rule_starts[m.root]) m.Expand(arena_, s, kBottom, &start.stacks, &start.can_end, round_);
  if (round_.overflow) error_ = absl::ResourceExhaustedError("the grammar is too ambiguous to start");
  std::sort(start.stacks.begin(), start.stacks.end());
  start.stacks.erase(std::unique(start.stacks.begin(), start.stacks.end()), start.stacks.end());
  states_.push_back(std::move(start));
}

bool GrammarMatcher::Advance(std::string_view bytes, State* out) {
  const Machine& m = grammar_->machine();
  std::vector<int32_t> cur = states_.back().stacks, next;
  bool ended = false;
  for (size_t i = 0; i < bytes.size(); ++i) {
    m.Step(arena_, cur, static_cast<uint8_t>(bytes[i]), &next, &ended, round_);
    if (round_.overflow) {
      error_ = absl::ResourceExhaustedError(
          absl::StrCat("the grammar is too ambiguous: more than ", internal::kMaxStacks, " stacks"));
      return false;
    }
    cur.swap(next);
    if (cur.empty() && !(ended && i + 1 == bytes.size())) return false;
  }
  out->stacks = std::move(cur);
  out->can_end = ended;
  return true;
}

bool GrammarMatcher::AcceptBytes(std::string_view bytes) {
  if (IsTerminated() || bytes.empty() || !error_.ok()) return false;
  State next;
  if (!Advance(bytes, &next)) return false;
  states_.push_back(std::move(next));
  return true;
}

bool GrammarMatcher::AcceptToken(int32_t token) {
  const TokenizerInfo& vocab = grammar_->vocab();
  if (IsTerminated() || token < 0 || token >= vocab.vocab_size()) return false;
  if (std::find(vocab.eos_ids().begin(), vocab.eos_ids().end(), token) != vocab.eos_ids().end()) {
    if (!CanEnd()) return false;
    State end = states_.back();
    end.terminated = true;
    states_.push_back(std::move(end));
    return true;
  }
  if (!vocab.allowed_ever(token)) return false;
  return AcceptBytes(vocab.token_bytes(token));
}

absl::Status GrammarMatcher::Rollback(int n) {
  if (n < 0 || n > NumAccepted()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot roll back ", n, " tokens: ", NumAccepted(), " accepted"));
  }
  states_.resize(states_.size() - n);
  return absl::OkStatus();
}

int GrammarMatcher::GuessMasks(const std::vector<int32_t>& guesses, std::vector<uint32_t>* masks) {
  const int32_t words = mask_words(), vocab_size = grammar_->vocab().vocab_size();
  const auto none = [words](const uint32_t* m) { return std::all_of(m, m + words, [](uint32_t w) { return w == 0; }); };
  masks->assign((guesses.size() + 1) * static_cast<size_t>(words), 0u);
  FillNextTokenBitmask(masks->data());
  int kept = 0, advanced = 0;
  for (size_t i = 0; i < guesses.size() && !none(masks->data()); ++i) {
    const int32_t g = guesses[i];
    const uint32_t* here = masks->data() + i * words;
    if (g < 0 || g >= vocab_size || ((here[g >> 5] >> (g & 31)) & 1u) == 0) break;
    if (!AcceptToken(g)) {
      // Allowed by its mask, so only ambiguity refuses it: forgotten with the guess.
      error_ = absl::OkStatus();
      round_.overflow = false;
      break;
    }
    ++advanced;
    uint32_t* next = masks->data() + (i + 1) * words;
    FillNextTokenBitmask(next);
    if (none(next)) break;
    kept = static_cast<int>(i) + 1;
  }
  states_.resize(states_.size() - advanced);
  masks->resize((kept + 1) * static_cast<size_t>(words));
  return kept;
}

void GrammarMatcher::FillNextTokenBitmask(uint32_t* mask) {
  const int32_t words = mask_words();
  std::fill(mask, mask + words, 0u);
  const State& state = states_.back();
  if (state.terminated || !error_.ok()) return;
  const Machine& m = grammar_->machine();
  const TokenizerInfo& vocab = grammar_->vocab();
  auto set = [mask](int32_t id) { mask[id >> 5] |= 1u << (id & 31); };
  if (state.can_end) {
    for (int32_t id : vocab.eos_ids()) set(id);
  }
  scratch_.Clear();
  seen_slots_.clear();
  std::vector<int32_t> resumed;
  for (int32_t top : state.stacks) {
    const Frame f = arena_.Get(top);
    // Inside a UTF-8 character the split is made on first use (grammar.h).
    const SlotCache* cache = f.partial == 0 ? grammar_->cache(f.slot) : grammar_->PartialCache(f.slot, f.partial);
    const uint64_t key = (static_cast<uint64_t>(f.slot) << 32) | f.partial;
    if (std::find(seen_slots_.begin(), seen_slots_.end(), key) == seen_slots_.end()) {
      seen_slots_.push_back(key);
      if (!cache->accepted_bits.empty()) {
        for (int32_t w = 0; w < static_cast<int32_t>(cache->accepted_bits.size()); ++w) mask[w] |= cache->accepted_bits[w];
      }
      for (int32_t id : cache->accepted_ids) set(id);
    }
    if (cache->leftovers.size() == 0 || f.parent == kBottom) continue;  // after the root's end no byte follows
    if (auto it = leftover_memo_.find(top); it != leftover_memo_.end()) {
      for (int32_t id : it->second) set(id);
      continue;
    }
    std::vector<int32_t> allowed;
    bool ended = false;
    m.Resume(scratch_, f.parent, &resumed, &ended, round_);
    if (!resumed.empty()) {
      internal::WalkStrings(m, scratch_, round_, resumed, cache->leftovers, [&](size_t i) {
        allowed.insert(allowed.end(), cache->leftover_tokens[i].begin(), cache->leftover_tokens[i].end());
      });
    }
    for (int32_t id : allowed) set(id);
    if (leftover_memo_ids_ + allowed.size() > kMaxMemoIds) {
      leftover_memo_.clear();
      leftover_memo_ids_ = 0;
    }
    leftover_memo_ids_ += allowed.size();
    leftover_memo_.emplace(top, std::move(allowed));
  }
}

}  // namespace shardserve::grammar
