// Speculative decoding in the scheduler (coordinator/scheduler/scheduler.h, proposer.h) and the
// workers' PersistentBatch (rollbacks, several sampled positions per row): a simulated cluster runs
// every plan through a worker's PersistentBatch and a fake KV cache whose cells remember the tokens
// they were computed from, and a fake model whose next-token distribution depends on the whole
// context. Checked: outputs identical to decoding without speculation (greedy and seeded sampling,
// proposers always right, always wrong, n-gram, random), every read of the KV cache sees the
// sequence's own accepted tokens (so rejected positions are never read and registered prefix
// blocks hold accepted tokens only), block accounting exact after every step (the workers' tables
// hold exactly the blocks in use), preemptions while speculative steps are in flight, and the
// output distribution of sampling with speculation equal to the model's (chi-square). The same with
// sliding windows (every layer sliding, or a sliding layers' pool beside full layers: reads stay
// in the window, and both tables' accounting is exact after rejections), and with constrained
// sequences (a grammar's masks at every sampled position, guesses cut where the grammar refuses
// them, the matcher over the accepted tokens only).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "coordinator/scheduler/proposer.h"
#include "coordinator/scheduler/scheduler.h"
#include "grammar/grammar.h"
#include "grammar/matcher.h"
#include "shardserve/v1/worker.pb.h"
#include "worker/draft_runner.h"
#include "worker/persistent_batch.h"
#include "worker/step_checks.h"

namespace shardserve {
namespace {

constexpr int32_t kVocab = 4;  // sampled ids: small, so guesses are often right by chance and the chi-square has few cells
// Ids the workers take: prompts may also hold ids above the sampled ones (a per-sequence marker).
constexpr int32_t kInputVocab = 1024;

uint64_t Mix(uint64_t h) {
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  h *= 0x94D049BB133111EBull;
  h ^= h >> 31;
  return h;
}

// The model's next-token distribution after `context` (its weights, 1..8 each).
std::vector<double> Probs(const std::vector<int32_t>& context) {
  uint64_t h = 1469598103934665603ull;
  for (int32_t t : context) h = (h ^ static_cast<uint32_t>(t)) * 1099511628211ull;
  std::vector<double> p(kVocab);
  double sum = 0;
  for (int v = 0; v < kVocab; ++v) sum += p[v] = 1 + static_cast<double>(Mix(h + v) % 8);
  for (double& x : p) x /= sum;
  return p;
}

// The sampler: greedy (temperature 0) or one uniform draw fixed by (seed, draw_index), as the
// workers' sampler draws (worker/sampler.cc); with a token mask (constrained decoding: bit v of
// mask[0] set: v allowed), over the allowed tokens only.
int32_t Sample(const std::vector<int32_t>& context, const v1::RowSampling& r, const uint32_t* mask = nullptr) {
  std::vector<double> p = Probs(context);
  if (mask != nullptr) {
    for (int v = 0; v < kVocab; ++v) {
      if (((mask[0] >> v) & 1u) == 0) p[v] = 0;
    }
  }
  if (r.temperature() == 0) return static_cast<int32_t>(std::max_element(p.begin(), p.end()) - p.begin());
  double sum = 0;
  for (double x : p) sum += x;
  const double u = static_cast<double>(Mix(r.seed() * 0x9E3779B97F4A7C15ull + r.draw_index()) >> 11) * 0x1.0p-53 * sum;
  double c = 0;
  int last = 0;
  for (int v = 0; v < kVocab; ++v) {
    if (p[v] == 0) continue;
    last = v;
    c += p[v];
    if (u < c) return v;
  }
  return last;
}

// Decoding alone, one token per step: the reference; with `grammar`, each token sampled under the
// mask of a matcher advanced token by token.
std::vector<int32_t> Reference(std::vector<int32_t> tokens, int64_t max_tokens, v1::RowSampling r,
                               std::shared_ptr<const grammar::CompiledGrammar> grammar = nullptr) {
  const int64_t prompt = static_cast<int64_t>(tokens.size());
  std::unique_ptr<grammar::GrammarMatcher> m;
  if (grammar != nullptr) m = std::make_unique<grammar::GrammarMatcher>(grammar);
  for (int64_t i = 0; i < max_tokens; ++i) {
    r.set_draw_index(static_cast<uint64_t>(i));  // the token's index in the completion
    uint32_t mask = 0;
    if (m != nullptr) m->FillNextTokenBitmask(&mask);
    tokens.push_back(Sample(tokens, r, m != nullptr ? &mask : nullptr));
    if (m != nullptr) {
      EXPECT_TRUE(m->AcceptToken(tokens.back()));
    }
  }
  return std::vector<int32_t>(tokens.begin() + prompt, tokens.end());
}

// The constrained sequences' language over the sampled ids, none of them EOS, so that it never
// ends: 0 "a", 1 "b", 2 "c", 3 "ab". After "a" only "b" or "c" may follow, after "ab" or "ac" one
// forced character: guesses are often refused, or right by force.
std::shared_ptr<const grammar::CompiledGrammar> AbcGrammar() {
  static const auto compiled = [] {
    auto vocab = std::make_shared<const grammar::TokenizerInfo>(
        grammar::TokenizerInfo({"a", "b", "c", "ab"}, {}, {}, kVocab));
    absl::StatusOr<grammar::Grammar> g = grammar::ParseGbnf(R"(root ::= ("abc" | "acb" | "bb")+)");
    EXPECT_TRUE(g.ok()) << g.status();
    absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>> c = grammar::CompiledGrammar::Compile(*g, vocab);
    EXPECT_TRUE(c.ok()) << c.status();
    return *c;
  }();
  return compiled;
}

// The mask after `tokens` of a fresh matcher advanced over them one by one.
std::vector<uint32_t> MaskTokenByToken(std::shared_ptr<const grammar::CompiledGrammar> g,
                                       const std::vector<int32_t>& tokens) {
  grammar::GrammarMatcher m(std::move(g));
  for (int32_t t : tokens) EXPECT_TRUE(m.AcceptToken(t));
  std::vector<uint32_t> mask(m.mask_words());
  m.FillNextTokenBitmask(mask.data());
  return mask;
}

// The engine's constrained speculation (coordinator/engine/engine.cc Allowed, AddTokenMasks and
// FinishOldest) for the sequences given a grammar: guesses cut by GuessMasks, its masks into the
// plan at every sampled position, and the matcher advanced over the accepted tokens.
class GrammarGuesses : public GuessFilter {
 public:
  void Constrain(uint64_t seq, std::shared_ptr<const grammar::CompiledGrammar> g) {
    matchers_[seq].grammar = g;
    matchers_[seq].matcher = std::make_unique<grammar::GrammarMatcher>(std::move(g));
  }
  bool Constrained(uint64_t seq) const { return matchers_.count(seq) > 0; }
  int Allowed(uint64_t seq, const std::vector<int32_t>& guesses) override {
    auto it = matchers_.find(seq);
    if (it == matchers_.end()) return static_cast<int>(guesses.size());
    State& st = it->second;
    const int kept = st.matcher->GuessMasks(guesses, &st.masks);
    EXPECT_EQ(st.masks.size(), static_cast<size_t>(kept + 1) * st.matcher->mask_words());
    cut_ += static_cast<int64_t>(guesses.size()) - kept;
    return kept;
  }
  void AddMasks(const MicroBatch& batch, v1::StepPlan* plan) {
    for (const MicroBatch::Entry& e : batch.entries) {
      auto it = matchers_.find(e.seq);
      if (e.logit_row < 0 || it == matchers_.end()) continue;
      State& st = it->second;
      const int words = st.matcher->mask_words();
      if (e.samples > 1) {
        ASSERT_GE(st.masks.size(), static_cast<size_t>(e.samples * words));
      } else {
        st.masks.assign(words, 0);
        st.matcher->FillNextTokenBitmask(st.masks.data());
      }
      for (int i = 0; i < e.samples; ++i) plan->add_mask_logit_rows(e.logit_row + i);
      plan->mutable_mask_words()->Add(st.masks.begin(), st.masks.begin() + e.samples * words);
      st.masks.clear();
    }
  }
  // A token the scheduler returned (accepted) for `seq`.
  void Accept(uint64_t seq, int32_t token) {
    auto it = matchers_.find(seq);
    if (it != matchers_.end()) {
      EXPECT_TRUE(it->second.matcher->AcceptToken(token)) << "seq " << seq << " token " << token;
    }
  }
  // `seq`'s matcher is the one advanced token by token over `output`: as many tokens, the same mask.
  void ExpectOver(uint64_t seq, const std::vector<int32_t>& output) {
    auto it = matchers_.find(seq);
    if (it == matchers_.end()) return;
    grammar::GrammarMatcher& m = *it->second.matcher;
    EXPECT_EQ(m.NumAccepted(), static_cast<int>(output.size())) << "seq " << seq;
    std::vector<uint32_t> mask(m.mask_words());
    m.FillNextTokenBitmask(mask.data());
    EXPECT_EQ(mask, MaskTokenByToken(it->second.grammar, output)) << "seq " << seq;
  }
  int64_t cut() const { return cut_; }

 private:
  struct State {
    std::shared_ptr<const grammar::CompiledGrammar> grammar;
    std::unique_ptr<grammar::GrammarMatcher> matcher;
    std::vector<uint32_t> masks;  // from Allowed, for AddMasks
  };
  std::map<uint64_t, State> matchers_;
  int64_t cut_ = 0;  // guesses cut
};

// The options every case starts from: blocks of 4 tokens, 64-token sequences, 32-token steps of
// at most 16 sequences, `k` guesses from `proposer` whatever the batch size (to exercise it).
SchedulerOptions SpecOptions(const Proposer* proposer, int k, int64_t num_kv_blocks) {
  SchedulerOptions o;
  o.limits.block_size = 4;
  o.limits.max_model_len = 64;
  o.limits.num_kv_blocks = num_kv_blocks;
  o.limits.max_tokens_per_step = 32;
  o.limits.max_seqs_per_step = 16;
  o.proposer = proposer;
  o.num_speculative_tokens = k;
  o.speculative_max_running = 0;
  return o;
}

// Test proposers. The oracle knows each sequence's reference continuation.
struct Oracle {
  std::map<std::vector<int32_t>, std::vector<int32_t>> full;  // prompt -> prompt + reference output
};

class RightProposer : public Proposer {
 public:
  explicit RightProposer(const Oracle* o) : o_(o) {}
  void Propose(uint64_t /*seq*/, const std::vector<int32_t>& tokens, int k, std::vector<int32_t>* out) const override {
    out->clear();
    for (const auto& [prompt, full] : o_->full) {
      if (full.size() <= tokens.size() || !std::equal(tokens.begin(), tokens.end(), full.begin())) continue;
      out->assign(full.begin() + tokens.size(), full.begin() + std::min(full.size(), tokens.size() + k));
      return;
    }
  }

 private:
  const Oracle* o_;
};

class WrongProposer : public Proposer {
 public:
  explicit WrongProposer(const Oracle* o) : right_(o) {}
  void Propose(uint64_t /*seq*/, const std::vector<int32_t>& tokens, int k, std::vector<int32_t>* out) const override {
    right_.Propose(0, tokens, k, out);
    if (out->empty()) out->assign(k, 0);
    for (int32_t& t : *out) t = (t + 1) % kVocab;  // the first guess is always wrong
  }

 private:
  RightProposer right_;
};

class RandomProposer : public Proposer {
 public:
  void Propose(uint64_t /*seq*/, const std::vector<int32_t>& tokens, int k, std::vector<int32_t>* out) const override {
    out->clear();
    uint64_t h = Mix(tokens.size() * 7919 + static_cast<uint64_t>(tokens.back()));
    const int n = static_cast<int>(h % (k + 1));
    for (int i = 0; i < n; ++i) out->push_back(static_cast<int32_t>(Mix(h + i) % kVocab));
  }
};

// A draft model (worker/draft_runner.h) over a fake KV cache like the simulated workers': each cell
// remembers the position and the tokens its KV was computed from, read back through the block
// table (a token's context is the cell before it plus the token itself), so the guesses depend on
// exactly what the draft's cache holds. `same`: its greedy choice is the target's (Probs); else a
// different model that agrees with it on about half the contexts.
class FakeDraftModel : public DraftModel {
 public:
  FakeDraftModel(const StepLimits& draft_limits, bool same)
      : limits_(draft_limits), same_(same),
        cache_(static_cast<size_t>(draft_limits.num_kv_blocks * draft_limits.block_size)) {}

  // The draft's greedy id after `context`.
  static int32_t Next(const std::vector<int32_t>& context, bool same) {
    std::vector<double> p = Probs(context);
    if (!same) {
      uint64_t h = 7;
      for (int32_t t : context) h = Mix(h * 31 + static_cast<uint64_t>(t));
      if (h % 2 == 0) p = Probs({static_cast<int32_t>(h % 1000), 9});  // another model's choice
    }
    return static_cast<int32_t>(std::max_element(p.begin(), p.end()) - p.begin());
  }
  // What a fresh draft fed `tokens` guesses next: k greedy ids.
  static std::vector<int32_t> Guesses(std::vector<int32_t> tokens, int k, bool same) {
    std::vector<int32_t> out;
    for (int i = 0; i < k; ++i) {
      out.push_back(Next(tokens, same));
      tokens.push_back(out.back());
    }
    return out;
  }

  absl::Status Forward(const StepBatch& b, std::vector<int32_t>* next) override {
    const int64_t bs = limits_.block_size, width = limits_.max_blocks_per_seq();
    EXPECT_EQ(b.block_tables.size(), static_cast<size_t>(b.num_seqs * width));
    std::vector<std::vector<int32_t>> contexts(b.positions.size());
    for (size_t t = 0; t < b.positions.size(); ++t) {
      const int64_t pos = b.positions[t];
      const int32_t* table = b.block_tables.data() + b.token_seq[t] * width;
      std::vector<int32_t> context;
      if (pos > 0) {  // the cell before, through the table: it must hold position pos - 1
        const Cell& c = cache_[table[(pos - 1) / bs] * bs + (pos - 1) % bs];
        EXPECT_EQ(c.pos, pos - 1) << "the draft reads a position it never wrote";
        context = c.context;
      }
      context.push_back(b.token_ids[t]);
      EXPECT_EQ(b.slots[t], table[pos / bs] * bs + pos % bs);
      cache_[b.slots[t]] = Cell{pos, context};
      contexts[t] = std::move(context);
    }
    next->clear();
    for (int32_t r : b.logit_rows) next->push_back(Next(contexts[r], same_));
    ++forwards_;
    return absl::OkStatus();
  }

 private:
  struct Cell {
    int64_t pos = -1;
    std::vector<int32_t> context;
  };
  const StepLimits limits_;
  const bool same_;
  std::vector<Cell> cache_;
  int64_t forwards_ = 0;
};

// Runs sequences through a Scheduler like the engine and through a worker's PersistentBatch and a
// fake KV cache, checking reads and block accounting at every step. With a sliding window the
// sliding layers read only the window before each position: every layer's cache where all slide,
// else a second cache of the sliding layers' pool beside the full one. With `guesses`, the
// sequences it constrains sample under their grammar's masks.
class SpecSim {
 public:
  // With `draft` (o.proposer), a draft model on the simulated worker makes the guesses in each step
  // (FakeDraftModel: `draft_same` or not), returned with the step's samples and offered to it, as
  // the engine does; its KV pool is sized for a model's cache of `draft_pool_for_blocks` blocks
  // (DraftStepLimits; -1: o.limits').
  explicit SpecSim(const SchedulerOptions& o, GrammarGuesses* guesses = nullptr, DraftProposer* draft = nullptr,
                   bool draft_same = true, int64_t draft_pool_for_blocks = -1)
      : o_(o), sched_(WithFilter(o, guesses)), worker_(o.limits, kInputVocab, /*keep_history=*/true),
        cache_(static_cast<size_t>(o.limits.num_kv_blocks * o.limits.block_size)),
        sliding_cache_(static_cast<size_t>(o.limits.num_sliding_kv_blocks * o.limits.block_size)),
        guesses_(guesses), draft_(draft), draft_same_(draft_same) {
    if (draft_ != nullptr) {
      StepLimits target = o.limits;
      if (draft_pool_for_blocks >= 0) target.num_kv_blocks = draft_pool_for_blocks;
      const StepLimits dl = DraftStepLimits(target);
      draft_runner_ = std::make_unique<DraftRunner>(std::make_unique<FakeDraftModel>(dl, draft_same), target,
                                                    kInputVocab, dl.max_model_len);
    }
  }

  Scheduler& sched() { return sched_; }

  void Add(uint64_t id, std::vector<int32_t> prompt, int64_t max_tokens, const v1::RowSampling& r) {
    Seq& s = seqs_[id];
    s.prompt_len = static_cast<int64_t>(prompt.size());
    s.max_tokens = max_tokens;
    SeqOptions so;
    so.max_len = s.prompt_len + max_tokens;
    sched_.Add(id, std::move(prompt), r, so);
  }

  // Schedules every free lane, completing the oldest step in flight when none is free; false when
  // nothing is left to run.
  bool Step() {
    for (int lane = 0; lane < sched_.lanes(); ++lane) {
      if (sched_.LaneBusy(lane)) continue;
      Flight f;
      f.lane = lane;
      const MicroBatch* b = sched_.Schedule(lane, next_step_++, &f.plan);
      if (b == nullptr) continue;
      f.entries = b->entries;
      EXPECT_LE(b->logit_rows, o_.limits.max_seqs_per_step);
      for (const MicroBatch::Entry& e : b->entries) {
        f.committed.push_back(sched_.tokens(e.seq));
        proposed_ += static_cast<int64_t>(e.draft.size());
      }
      if (guesses_ != nullptr) guesses_->AddMasks(*b, &f.plan);
      const absl::Status st = worker_.Apply(f.plan, &f.batch, &f.sampling);
      if (!st.ok()) {
        ADD_FAILURE() << "the worker refuses step " << f.plan.step_id() << ": " << st;
        return false;
      }
      for (uint64_t id : f.plan.freed_seq_ids()) fed_.erase(id);
      for (const v1::NewSeq& n : f.plan.new_seqs()) {
        const std::vector<int32_t> tokens = sched_.tokens(n.seq_id());
        fed_[n.seq_id()].assign(tokens.begin(), tokens.begin() + n.num_cached_tokens());
      }
      for (int i = 0; i < f.plan.rollback_seq_ids_size(); ++i) {
        fed_[f.plan.rollback_seq_ids(i)].resize(f.plan.rollback_num_tokens(i));
        ++rollbacks_;
      }
      CheckAccounting();
      in_flight_.push_back(std::move(f));
    }
    if (in_flight_.empty()) return false;
    CompleteOldest();
    return true;
  }

  std::vector<int32_t> Output(uint64_t id) const { return seqs_.at(id).output; }
  int64_t proposed() const { return proposed_; }
  int64_t rollbacks() const { return rollbacks_; }
  int64_t max_samples_in_a_row() const { return max_samples_; }
  int64_t draft_offers() const { return draft_offers_; }
  int64_t draft_forwards() const { return draft_runner_ != nullptr ? draft_runner_->forwards() : 0; }
  const DraftRunner* draft_runner() const { return draft_runner_.get(); }

 private:
  struct Seq {
    int64_t prompt_len = 0, max_tokens = 0;
    std::vector<int32_t> output;
    bool done = false;
  };
  struct Cell {
    int64_t pos = -1;
    std::vector<int32_t> context;  // the tokens at positions 0..pos this KV was computed from
  };
  struct Flight {
    int lane = 0;
    v1::StepPlan plan;
    StepBatch batch;
    google::protobuf::RepeatedPtrField<v1::RowSampling> sampling;
    std::vector<MicroBatch::Entry> entries;
    std::vector<std::vector<int32_t>> committed;  // each row's sequence tokens when scheduled
  };

  static SchedulerOptions WithFilter(SchedulerOptions o, GrammarGuesses* guesses) {
    o.guess_filter = guesses;
    return o;
  }

  // The workers' tables hold exactly the blocks in use, each as often as its reference count: in
  // every pool, the entries the coordinator's table still holds (the workers keep the ids of the
  // blocks let go behind a window; they read nothing there).
  void CheckAccounting() {
    auto check = [&](const BlockManager& bm, bool sliding) {
      std::map<int32_t, int> holders;
      for (const auto& [id, s] : seqs_) {
        if (!worker_.Holds(id)) continue;
        const std::vector<int32_t> want = sliding ? sched_.sliding_table(id) : sched_.table(id);
        const std::vector<int32_t> got = sliding ? worker_.sliding_blocks(id) : worker_.blocks(id);
        ASSERT_EQ(got.size(), want.size()) << "seq " << id << (sliding ? " (sliding)" : "");
        for (size_t i = 0; i < want.size(); ++i) {
          if (want[i] == BlockManager::kReleased) continue;
          ASSERT_EQ(got[i], want[i]) << "seq " << id << " block " << i << (sliding ? " (sliding)" : "");
          ++holders[got[i]];
        }
      }
      ASSERT_EQ(static_cast<int64_t>(holders.size()), bm.num_used()) << (sliding ? "sliding" : "");
      for (const auto& [b, k] : holders) ASSERT_EQ(bm.refcount(b), k) << "block " << b << (sliding ? " (sliding)" : "");
      ASSERT_EQ(bm.num_free() + bm.num_cached() + bm.num_used(), bm.num_blocks());
    };
    check(sched_.block_manager(), false);
    if (sched_.sliding_block_manager() != nullptr) check(*sched_.sliding_block_manager(), true);
  }

  // Every cell position `last` reads in `cache` through `tables` (row `row`) from `first` on must
  // hold this sequence's tokens.
  void CheckReads(const std::vector<Cell>& cache, const std::vector<int32_t>& tables, int row, int64_t first,
                  int64_t last, const std::vector<int32_t>& context, uint64_t id) {
    const int64_t bs = o_.limits.block_size, width = o_.limits.max_blocks_per_seq();
    for (int64_t pos = first; pos <= last; ++pos) {
      const Cell& c = cache[tables[row * width + pos / bs] * bs + pos % bs];
      ASSERT_EQ(c.pos, pos) << "seq " << id << " reads pos " << pos << " not written for it";
      ASSERT_TRUE(std::equal(c.context.begin(), c.context.end(), context.begin(), context.begin() + pos + 1))
          << "seq " << id << " reads pos " << pos << " written for other tokens";
    }
  }

  void CompleteOldest() {
    Flight f = std::move(in_flight_.front());
    in_flight_.pop_front();
    const StepBatch& sb = f.batch;
    const int64_t window = o_.sliding_window;
    const bool pool = window > 0 && o_.full_layers;
    // Write every token's KV: its context is what the worker was fed, guesses included.
    for (int i = 0; i < f.plan.token_ids_size(); ++i) {
      const uint64_t id = f.plan.row_seq_ids(sb.token_seq[i]);
      std::vector<int32_t>& fed = fed_[id];
      ASSERT_EQ(static_cast<int64_t>(fed.size()), sb.positions[i]) << "seq " << id;
      fed.push_back(f.plan.token_ids(i));
      cache_[sb.slots[i]] = Cell{sb.positions[i], fed};
      if (pool) sliding_cache_[sb.sliding_slots[i]] = Cell{sb.positions[i], fed};
    }
    std::vector<const uint32_t*> masks;
    ASSERT_TRUE(CheckTokenMasks(f.plan, static_cast<int64_t>(sb.logit_rows.size()), kVocab, &masks).ok());
    // Each sampled position reads its context back through the tables: every cell must hold this
    // sequence's tokens (accepted ones before the row, the row's own after).
    std::vector<int32_t> sampled;
    std::vector<int> per_row(f.entries.size(), 0);
    for (size_t k = 0; k < sb.logit_rows.size(); ++k) {
      const int t = sb.logit_rows[k];
      const int row = sb.token_seq[t];
      ++per_row[row];
      const uint64_t id = f.plan.row_seq_ids(row);
      const std::vector<int32_t>& fed = fed_[id];
      const int64_t last = sb.positions[t];
      const std::vector<int32_t> context(fed.begin(), fed.begin() + last + 1);
      const std::vector<int32_t>& committed = f.committed[row];
      const int64_t known = std::min<int64_t>(static_cast<int64_t>(committed.size()), last + 1);
      ASSERT_TRUE(std::equal(committed.begin(), committed.begin() + known, context.begin())) << "seq " << id;
      const int64_t in_window = std::max<int64_t>(0, last - window + 1);
      CheckReads(cache_, sb.block_tables, row, window > 0 && !pool ? in_window : 0, last, context, id);
      if (pool) CheckReads(sliding_cache_, sb.sliding_block_tables, row, in_window, last, context, id);
      if (::testing::Test::HasFatalFailure()) return;
      const v1::RowSampling& r = f.sampling[static_cast<int>(k)];
      ASSERT_EQ(r.draw_index(), static_cast<uint64_t>(last + 1 - seqs_.at(id).prompt_len)) << "seq " << id;
      ASSERT_EQ(masks[k] != nullptr, guesses_ != nullptr && guesses_->Constrained(id)) << "seq " << id;
      sampled.push_back(Sample(context, r, masks[k]));
    }
    for (int n : per_row) max_samples_ = std::max<int64_t>(max_samples_, n);
    // The draft model runs on the worker right after sampling (StepExecutor::Execute).
    google::protobuf::RepeatedField<int32_t> draft_ids;
    const int64_t starved = draft_runner_ != nullptr ? draft_runner_->starved() : 0;
    if (draft_runner_ != nullptr) {
      ASSERT_TRUE(draft_runner_->Apply(f.plan).ok());
      google::protobuf::RepeatedField<int32_t> samples(sampled.begin(), sampled.end());
      ASSERT_TRUE(draft_runner_->Propose(f.plan, samples, &draft_ids).ok());
    }
    const std::vector<SampledToken> returned = sched_.Complete(f.lane, sampled);
    if (draft_runner_ != nullptr) {
      // The engine's part: each sampling row's guesses for its sequence's token count now. Each must
      // be what a fresh draft fed exactly those tokens guesses: the draft's cache, cut back and fed
      // again after every verification, holds the sequence's own tokens.
      const int k = f.plan.num_draft_tokens();
      int i = 0;
      for (const MicroBatch::Entry& e : f.entries) {
        if (e.logit_row < 0 || k == 0) continue;
        ASSERT_LE((i + 1) * k, draft_ids.size());
        const std::vector<int32_t> guesses(draft_ids.begin() + i * k, draft_ids.begin() + (i + 1) * k);
        ++i;
        if (!sched_.Contains(e.seq)) continue;
        const std::vector<int32_t> tokens = sched_.tokens(e.seq);
        // A row the draft's pool had no blocks for this step gets padding: its last token.
        const bool padding = draft_runner_->starved() > starved &&
                             guesses == std::vector<int32_t>(static_cast<size_t>(k), tokens.back());
        if (!padding) {
          ASSERT_EQ(guesses, FakeDraftModel::Guesses(tokens, k, draft_same_)) << "seq " << e.seq;
        }
        // Its record of the fed tokens starts with the sequence's accepted ones (rejected guesses
        // after them until the next plan's rollback).
        const std::vector<int32_t> fed = draft_runner_->fed(e.seq);
        const size_t accepted = static_cast<size_t>(sched_.fed(e.seq));
        ASSERT_GE(fed.size(), accepted) << "seq " << e.seq;
        ASSERT_TRUE(std::equal(tokens.begin(), tokens.begin() + accepted, fed.begin())) << "seq " << e.seq;
        draft_->Offer(e.seq, sched_.num_tokens(e.seq), guesses);
        ++draft_offers_;
      }
      ASSERT_EQ(i * k, draft_ids.size());
    }
    for (const SampledToken& t : returned) {
      Seq& s = seqs_.at(t.seq);
      if (s.done) continue;  // the engine skips tokens after the one that ended the request
      s.output.push_back(t.token);
      if (guesses_ != nullptr) guesses_->Accept(t.seq, t.token);
      if (static_cast<int64_t>(s.output.size()) == s.max_tokens) {
        s.done = true;
        sched_.Remove(t.seq);
        if (draft_ != nullptr) draft_->Forget(t.seq);
      }
    }
    if (guesses_ != nullptr) {
      for (const MicroBatch::Entry& e : f.entries) guesses_->ExpectOver(e.seq, seqs_.at(e.seq).output);
    }
  }

  const SchedulerOptions o_;
  Scheduler sched_;
  PersistentBatch worker_;
  std::vector<Cell> cache_, sliding_cache_;
  GrammarGuesses* const guesses_;
  DraftProposer* const draft_;
  const bool draft_same_;
  std::unique_ptr<DraftRunner> draft_runner_;
  int64_t draft_offers_ = 0;
  std::map<uint64_t, Seq> seqs_;
  std::map<uint64_t, std::vector<int32_t>> fed_;  // what the worker was fed, by sequence
  std::deque<Flight> in_flight_;
  uint64_t next_step_ = 1;
  int64_t proposed_ = 0, rollbacks_ = 0, max_samples_ = 0;
};

// The proposers: an oracle always right or always wrong, n-gram, random; and a draft model on the
// simulated worker (guesses made in the step, through the step results) whose greedy choice is the
// target's, or one that agrees with it about half the time.
enum class Kind { kRight, kWrong, kNgram, kRandom, kDraftSame, kDraftOther };
// No sliding window; an 8-token window in every layer (Mistral); or in a sliding layers' pool of
// its own beside full-attention layers (Gemma 2 and 3), three quarters as large as the full pool.
enum class Window { kNone, kAll, kPool };

void WithWindow(Window w, SchedulerOptions* o) {
  if (w == Window::kNone) return;
  o->sliding_window = 8;
  o->full_layers = w == Window::kPool;
  if (w == Window::kPool) o->limits.num_sliding_kv_blocks = o->limits.num_kv_blocks * 3 / 4;
}

struct Param {
  Kind kind;
  int lanes;
  int64_t num_kv_blocks;
  bool prefix_caching;
  float temperature;
  Window window;
  bool grammar;  // every other sequence constrained (AbcGrammar)
  bool adaptive;  // adaptive_speculative_tokens
  std::string name;
};

void PrintTo(const Param& p, std::ostream* os) { *os << p.name; }

class SpeculationSimTest : public ::testing::TestWithParam<Param> {};

// Many sequences (repetitive prompts that share prefixes, and random ones), greedy or sampled,
// through the simulated cluster with speculation: every output equals decoding alone.
TEST_P(SpeculationSimTest, OutputsEqualDecodingAlone) {
  const Param& p = GetParam();
  std::mt19937_64 rng(99 + p.lanes * 10 + p.num_kv_blocks);
  constexpr int kSeqs = 24;
  struct Spec {
    std::vector<int32_t> prompt;
    int64_t max_tokens;
    v1::RowSampling r;
    std::shared_ptr<const grammar::CompiledGrammar> grammar;
    std::vector<int32_t> want;
  };
  std::vector<Spec> specs(kSeqs);
  Oracle oracle;
  const std::vector<int32_t> system = {1, 2, 3, 0, 1, 2, 3, 0, 2, 2, 1};
  for (int i = 0; i < kSeqs; ++i) {
    Spec& s = specs[i];
    if (i % 2 == 0) s.prompt = system;
    const int extra = 1 + static_cast<int>(rng() % 12);
    for (int j = 0; j < extra; ++j) s.prompt.push_back(static_cast<int32_t>(rng() % kVocab));
    // A marker no output holds: no sequence's tokens start like another's, so the oracle's
    // proposers know whose continuation to give.
    s.prompt.push_back(kVocab + i);
    s.max_tokens = 1 + static_cast<int64_t>(rng() % 24);
    s.r.set_seed(rng());
    s.r.set_temperature(p.temperature);
    if (i % 3 == 1) s.r.set_repetition_penalty(1.2f);  // the workers' penalty history must roll back
    if (p.grammar && i % 2 == 1) s.grammar = AbcGrammar();
    s.want = Reference(s.prompt, s.max_tokens, s.r, s.grammar);
    std::vector<int32_t> full = s.prompt;
    full.insert(full.end(), s.want.begin(), s.want.end());
    oracle.full[s.prompt] = full;
  }
  RightProposer right(&oracle);
  WrongProposer wrong(&oracle);
  NgramProposer ngram(1, 3);
  RandomProposer random;
  DraftProposer draft;
  const Proposer* proposers[] = {&right, &wrong, &ngram, &random, &draft, &draft};
  const bool drafted = p.kind == Kind::kDraftSame || p.kind == Kind::kDraftOther;

  SchedulerOptions o = SpecOptions(proposers[static_cast<int>(p.kind)], 4, p.num_kv_blocks);
  o.lanes = p.lanes;
  o.prefix_caching = p.prefix_caching;
  o.adaptive_speculative_tokens = p.adaptive;
  // A draft's guesses are asked for only while speculation is on: here it goes off and on as the
  // batch grows and shrinks, so the draft falls behind and must find where its cache and the
  // sequence's tokens part.
  if (drafted) o.speculative_max_running = 5;
  WithWindow(p.window, &o);
  GrammarGuesses guesses;
  SpecSim sim(o, p.grammar ? &guesses : nullptr, drafted ? &draft : nullptr, p.kind == Kind::kDraftSame);
  auto add = [&](int i) {
    if (specs[i].grammar != nullptr) guesses.Constrain(i + 1, specs[i].grammar);
    sim.Add(i + 1, specs[i].prompt, specs[i].max_tokens, specs[i].r);
  };
  int added = 0;
  for (; added < 6; ++added) add(added);
  for (int64_t iter = 0; iter < 20000; ++iter) {
    const bool busy = sim.Step();
    ASSERT_FALSE(HasFatalFailure()) << "iteration " << iter;
    if (added < kSeqs && (iter % 3 == 0 || !busy)) {
      add(added);
      ++added;
    } else if (!busy) {
      break;
    }
  }
  for (int i = 0; i < kSeqs; ++i) EXPECT_EQ(sim.Output(i + 1), specs[i].want) << "seq " << i + 1;
  Scheduler& s = sim.sched();
  EXPECT_EQ(s.num_running() + s.num_waiting(), 0);
  EXPECT_EQ(s.block_manager().num_used(), 0);
  EXPECT_EQ(s.num_free_blocks(), s.num_blocks());
  if (p.window == Window::kPool) {
    EXPECT_EQ(s.sliding_block_manager()->num_used(), 0);
  }
  const SpeculationStats& st = s.speculation();
  EXPECT_GT(st.proposed, 0);
  EXPECT_EQ(st.proposed, sim.proposed());
  EXPECT_LE(st.accepted, st.proposed);
  int64_t by_position = 0;
  for (size_t i = 0; i < st.accepted_by_position.size(); ++i) {
    by_position += st.accepted_by_position[i];
    if (i > 0) {
      EXPECT_LE(st.accepted_by_position[i], st.accepted_by_position[i - 1]);
    }
  }
  EXPECT_EQ(by_position, st.accepted);
  if (p.kind == Kind::kRight) {
    EXPECT_EQ(st.accepted, st.proposed) << "an always-right proposer is always accepted";
    EXPECT_GT(sim.max_samples_in_a_row(), 1);
  }
  if (p.kind == Kind::kWrong) {
    EXPECT_EQ(st.accepted, 0) << "an always-wrong proposer is never accepted";
    EXPECT_GT(sim.rollbacks(), 0);
  }
  if (drafted) {
    EXPECT_GT(sim.draft_offers(), 0);
    EXPECT_GT(sim.draft_forwards(), 0);
    EXPECT_GT(st.accepted, 0);
    // A draft whose greedy choice is the target's is always right when the target decodes greedily
    // (under a grammar too: the guesses kept are allowed, and an allowed argmax is the masked one).
    if (p.kind == Kind::kDraftSame && p.temperature == 0) {
      EXPECT_EQ(st.accepted, st.proposed);
    }
    if (p.kind == Kind::kDraftOther) {
      EXPECT_GT(sim.rollbacks(), 0);
    }
  }
  if (p.num_kv_blocks <= 24 && p.window == Window::kNone) {
    EXPECT_GT(s.preemptions(), 0) << "the small cache should preempt";
  }
  // A wrong guess is refused by the grammar as often as not: some are cut before they are fed.
  if (p.grammar && p.kind == Kind::kWrong) {
    EXPECT_GT(guesses.cut(), 0);
  }
  RecordProperty("proposed", static_cast<int>(st.proposed));
  RecordProperty("accepted", static_cast<int>(st.accepted));
}

// Every proposer, 1 or 2 lanes, a cache small enough to preempt or not, greedy or seeded: with
// prefix caching on or off and no window, unconstrained; with prefix caching on, each window
// (every layer, a pool of its own), constrained sequences without a window, and adaptive guesses.
std::vector<Param> Params() {
  std::vector<Param> out;
  const char* kinds[] = {"Right", "Wrong", "Ngram", "Random", "DraftSame", "DraftOther"};
  struct Variant {
    bool prefix_caching;
    Window window;
    bool grammar;
    bool adaptive;
    const char* name;
  };
  const Variant variants[] = {{true, Window::kNone, false, false, "_Prefix"},
                              {false, Window::kNone, false, false, "_NoPrefix"},
                              {true, Window::kAll, false, false, "_Prefix_WindowAll"},
                              {true, Window::kPool, false, false, "_Prefix_WindowPool"},
                              {true, Window::kNone, true, false, "_Prefix_Grammar"},
                              {true, Window::kNone, false, true, "_Prefix_Adaptive"}};
  for (int k = 0; k < 6; ++k) {
    for (int lanes : {1, 2}) {
      for (int64_t blocks : {int64_t{16}, int64_t{400}}) {
        for (const Variant& v : variants) {
          for (float temp : {0.0f, 1.0f}) {
            out.push_back(Param{static_cast<Kind>(k), lanes, blocks, v.prefix_caching, temp, v.window, v.grammar,
                                v.adaptive, std::string(kinds[k]) + "_Lanes" + std::to_string(lanes) +
                                    (blocks <= 24 ? "_SmallCache" : "_LargeCache") + v.name +
                                    (temp == 0 ? "_Greedy" : "_Sampled")});
          }
        }
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Sim, SpeculationSimTest, ::testing::ValuesIn(Params()),
                         [](const ::testing::TestParamInfo<Param>& i) { return i.param.name; });

// Rollback: a step whose guesses are all rejected gives back exactly the blocks it grew for them,
// registers none of them in the prefix cache, and rolls the workers back.
TEST(SpeculationTest, RejectedGuessesGiveTheirBlocksBackAndStayUncached) {
  Oracle oracle;
  WrongProposer wrong(&oracle);
  SchedulerOptions o = SpecOptions(&wrong, 6, 32);
  o.limits.max_seqs_per_step = 8;
  Scheduler s(o);
  PersistentBatch worker(o.limits, kVocab, true);
  StepBatch batch;
  google::protobuf::RepeatedPtrField<v1::RowSampling> sampling;
  v1::RowSampling r;
  s.Add(1, {1, 2, 3, 0, 1, 2, 3}, r);  // 7 tokens: 2 blocks
  v1::StepPlan plan;
  ASSERT_NE(s.Schedule(0, 1, &plan), nullptr);
  ASSERT_TRUE(worker.Apply(plan, &batch, &sampling).ok());
  s.Complete(0, {2});  // the prompt's sample: 8 tokens, 7 fed
  EXPECT_EQ(s.table_blocks(1), 2);
  const MicroBatch* b = s.Schedule(0, 2, &plan);
  ASSERT_NE(b, nullptr);
  ASSERT_EQ(b->entries.size(), 1u);
  ASSERT_EQ(b->entries[0].draft.size(), 6u);  // its last token and 6 guesses: positions 7..13
  EXPECT_EQ(b->logit_rows, 7);
  EXPECT_EQ(s.table_blocks(1), 4);
  EXPECT_EQ(plan.row_num_sampled_size(), 1);
  EXPECT_EQ(plan.row_num_sampled(0), 7);
  ASSERT_TRUE(worker.Apply(plan, &batch, &sampling).ok());
  ASSERT_EQ(sampling.size(), 7);
  for (int j = 0; j < 7; ++j) EXPECT_EQ(sampling[j].draw_index(), static_cast<uint64_t>(1 + j));
  const int64_t cached_before = s.num_cached_blocks();
  // Every guess wrong: the sample at position 7 is the one token accepted. (The 7th row's sample,
  // after the last guess, checks no guess: any token.)
  std::vector<int32_t> sampled(7, 0);
  for (size_t j = 0; j < b->entries[0].draft.size(); ++j) sampled[j] = (b->entries[0].draft[j] + 1) % kVocab;
  const std::vector<SampledToken> got = s.Complete(0, sampled);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].token, sampled[0]);
  EXPECT_EQ(s.fed(1), 8);             // the 8 tokens before the accepted one
  EXPECT_EQ(s.table_blocks(1), 3);    // 9 tokens: blocks 0..2; the 4th block went back
  EXPECT_EQ(s.block_manager().num_used(), 3);
  EXPECT_EQ(s.num_cached_blocks(), cached_before);
  EXPECT_EQ(s.speculation().proposed, 6);
  EXPECT_EQ(s.speculation().accepted, 0);
  // The next plan rolls the workers back to 8 tokens and 3 blocks, then feeds position 8.
  ASSERT_NE(s.Schedule(0, 3, &plan), nullptr);
  ASSERT_EQ(plan.rollback_seq_ids_size(), 1);
  EXPECT_EQ(plan.rollback_num_tokens(0), 8);
  EXPECT_EQ(plan.rollback_num_blocks(0), 3);
  EXPECT_EQ(plan.row_start_positions(0), 8);
  ASSERT_TRUE(worker.Apply(plan, &batch, &sampling).ok());
  EXPECT_EQ(worker.fed(1), 8 + plan.row_num_tokens(0));
  // Full blocks registered: the two of the 8 accepted tokens, not the rejected positions'.
  BlockManager::Chain chain;
  std::vector<int32_t> all = s.tokens(1);
  EXPECT_EQ(s.block_manager().FindCached(all, 16, &chain).size(), 2u);
}

// Sliding windows: a step whose guesses are all rejected gives back the blocks it grew for them in
// both tables (the sliding layers' pool beside the full one), the blocks behind the window stay
// let go, and the next plan cuts the workers' two tables to the same length.
TEST(SpeculationTest, RejectedGuessesGiveBackTheBlocksOfBothPoolsWithASlidingWindow) {
  Oracle oracle;
  WrongProposer wrong(&oracle);
  SchedulerOptions o = SpecOptions(&wrong, 6, 32);
  WithWindow(Window::kPool, &o);  // an 8-token window; 24 sliding blocks
  Scheduler s(o);
  PersistentBatch worker(o.limits, kVocab, true);
  StepBatch batch;
  google::protobuf::RepeatedPtrField<v1::RowSampling> sampling;
  s.Add(1, std::vector<int32_t>(19, 1), v1::RowSampling());  // 19 tokens: 5 blocks
  v1::StepPlan plan;
  ASSERT_NE(s.Schedule(0, 1, &plan), nullptr);
  ASSERT_TRUE(worker.Apply(plan, &batch, &sampling).ok());
  s.Complete(0, {2});  // 20 tokens, 19 fed: position 19 attends to 12..19, blocks 0..2 let go
  const BlockManager& full = s.block_manager();
  const BlockManager& sliding = *s.sliding_block_manager();
  EXPECT_EQ(full.num_used(), 5);
  EXPECT_EQ(sliding.num_used(), 2);
  const MicroBatch* b = s.Schedule(0, 2, &plan);
  ASSERT_NE(b, nullptr);
  ASSERT_EQ(b->entries[0].draft.size(), 6u);  // positions 19..25: 7 blocks in both tables
  EXPECT_EQ(s.table(1).size(), 7u);
  EXPECT_EQ(s.sliding_table(1).size(), 7u);
  ASSERT_TRUE(worker.Apply(plan, &batch, &sampling).ok());
  EXPECT_EQ(worker.sliding_blocks(1).size(), 7u);
  std::vector<int32_t> sampled(7, 0);  // every guess wrong; the 7th row's sample checks none
  for (size_t j = 0; j < b->entries[0].draft.size(); ++j) sampled[j] = (b->entries[0].draft[j] + 1) % kVocab;
  ASSERT_EQ(s.Complete(0, sampled).size(), 1u);
  // 21 tokens, 20 fed: blocks 0..5 in both tables; the sliding one holds 3..5 (window 13..20).
  EXPECT_EQ(s.table(1).size(), 6u);
  ASSERT_EQ(s.sliding_table(1).size(), 6u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(s.sliding_table(1)[i], BlockManager::kReleased) << i;
  EXPECT_EQ(full.num_used(), 6);
  EXPECT_EQ(sliding.num_used(), 3);
  EXPECT_EQ(full.num_used() + full.num_available(), full.num_blocks());
  EXPECT_EQ(sliding.num_used() + sliding.num_available(), sliding.num_blocks());
  ASSERT_NE(s.Schedule(0, 3, &plan), nullptr);
  ASSERT_EQ(plan.rollback_seq_ids_size(), 1);
  EXPECT_EQ(plan.rollback_num_tokens(0), 20);
  EXPECT_EQ(plan.rollback_num_blocks(0), 6);
  ASSERT_TRUE(worker.Apply(plan, &batch, &sampling).ok());
  EXPECT_EQ(worker.blocks(1).size(), s.table(1).size());
  EXPECT_EQ(worker.sliding_blocks(1).size(), s.sliding_table(1).size());
  const std::vector<int32_t> kept = s.sliding_table(1), held = worker.sliding_blocks(1);
  for (size_t i = 3; i < kept.size(); ++i) EXPECT_EQ(held[i], kept[i]) << i;
}

// A sequence in a speculative step in flight is never preempted; another sequence's need preempts
// one that is in no step, and the speculating one's accounting stays exact.
TEST(SpeculationTest, PreemptionWhileASpeculativeStepIsInFlight) {
  Oracle oracle;
  WrongProposer wrong(&oracle);
  SchedulerOptions o = SpecOptions(&wrong, 3, 9);
  o.lanes = 2;
  o.limits.block_size = 2;
  o.limits.max_model_len = 32;
  o.limits.max_seqs_per_step = 8;
  SpecSim sim(o);
  v1::RowSampling r;
  for (uint64_t id = 1; id <= 3; ++id) sim.Add(id, {1, 2, 3}, 12, r);
  int64_t steps = 0;
  while (sim.Step() && steps < 1000) {
    ASSERT_FALSE(HasFatalFailure());
    ++steps;
  }
  EXPECT_GT(sim.sched().preemptions(), 0);
  EXPECT_GT(sim.rollbacks(), 0);
  for (uint64_t id = 1; id <= 3; ++id) EXPECT_EQ(sim.Output(id), Reference({1, 2, 3}, 12, r));
  EXPECT_EQ(sim.sched().block_manager().num_used(), 0);
}

// The adaptive limit: no guesses while speculative_max_running sequences or more run.
TEST(SpeculationTest, NoGuessesInALargeBatch) {
  NgramProposer ngram(1, 3);
  SchedulerOptions o = SpecOptions(&ngram, 4, 64);
  o.limits.max_tokens_per_step = 64;
  o.speculative_max_running = 2;
  for (int n : {1, 2}) {
    Scheduler s(o);
    for (int i = 1; i <= n; ++i) s.Add(i, {1, 2, 1, 2, 1, 2}, v1::RowSampling());
    v1::StepPlan plan;
    ASSERT_NE(s.Schedule(0, 1, &plan), nullptr);
    s.Complete(0, std::vector<int32_t>(n, 1));
    const MicroBatch* b = s.Schedule(0, 2, &plan);
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(b->entries[0].draft.empty(), n == 2) << n << " running";
  }
}

// The draft's KV pool (DraftStepLimits) holds as many blocks as the model's cache and
// room for each sequence's guesses; sized here for a model's cache of none, it holds far fewer
// tokens than the running sequences: rows that find no free blocks get padding for guesses, the
// others guesses a fresh draft would make on their tokens (the blocks given back on every cut and
// free are reused without mixing sequences), and the outputs are those of decoding alone.
TEST(SpeculationTest, ADraftPoolTooSmallStarvesRowsButKeepsOutputsAndBlocks) {
  Oracle oracle;
  DraftProposer draft;
  SchedulerOptions o = SpecOptions(&draft, 4, 400);
  o.limits.max_seqs_per_step = 8;
  SpecSim sim(o, nullptr, &draft, /*draft_same=*/true, /*draft_pool_for_blocks=*/0);
  const StepLimits dl = DraftStepLimits(StepLimits{.max_tokens_per_step = 32, .max_seqs_per_step = 8,
                                                            .block_size = 4, .num_kv_blocks = 0, .max_model_len = 64});
  ASSERT_EQ(dl.num_kv_blocks, 8 * 5) << "room for 4 + 16 guessed tokens a sequence, and no more";
  ASSERT_EQ(sim.draft_runner()->free_blocks(), dl.num_kv_blocks);
  std::mt19937_64 rng(5);
  v1::RowSampling greedy;
  std::map<uint64_t, std::vector<int32_t>> want;
  for (uint64_t id = 1; id <= 12; ++id) {
    std::vector<int32_t> prompt;
    for (int j = 0; j < 20; ++j) prompt.push_back(static_cast<int32_t>(rng() % kVocab));
    prompt.push_back(kVocab + static_cast<int32_t>(id));
    want[id] = Reference(prompt, 24, greedy);
    sim.Add(id, prompt, 24, greedy);
  }
  int64_t steps = 0;
  while (sim.Step() && steps < 5000) {
    ASSERT_FALSE(HasFatalFailure());
    ++steps;
    ASSERT_GE(sim.draft_runner()->free_blocks(), 0);
  }
  for (const auto& [id, tokens] : want) EXPECT_EQ(sim.Output(id), tokens) << "seq " << id;
  EXPECT_GT(sim.draft_runner()->starved(), 0) << "the pool never ran short";
  EXPECT_GT(sim.sched().speculation().accepted, 0) << "no row ever got the draft's guesses";
}

// Adaptive guesses (adaptive_speculative_tokens): a sequence starts at num_speculative_tokens
// guesses; a verification that rejects any lowers its number by 1 (to 1 at least), one that
// accepts all it was fed raises it by 2 (to num_speculative_tokens at most). Without the option
// every decode is fed num_speculative_tokens.
TEST(SpeculationTest, AdaptiveGuessesFollowWhatTheSequenceAccepts) {
  // Guesses k copies of id 1: the samples decide what is accepted.
  class Ones : public Proposer {
   public:
    void Propose(uint64_t, const std::vector<int32_t>&, int k, std::vector<int32_t>* out) const override {
      out->assign(static_cast<size_t>(k), 1);
    }
  } ones;
  for (bool adaptive : {false, true}) {
    SchedulerOptions o = SpecOptions(&ones, 6, 64);
    o.limits.max_model_len = 256;
    o.adaptive_speculative_tokens = adaptive;
    Scheduler s(o);
    s.Add(1, {2, 3}, v1::RowSampling());
    v1::StepPlan plan;
    uint64_t step = 1;
    ASSERT_NE(s.Schedule(0, step++, &plan), nullptr);  // the prompt
    s.Complete(0, {1});
    // Rejected five times (the samples are 0), then accepted in full (all 1) four times.
    std::vector<size_t> fed;
    for (int i = 0; i < 9; ++i) {
      const MicroBatch* b = s.Schedule(0, step++, &plan);
      ASSERT_NE(b, nullptr);
      ASSERT_EQ(b->entries.size(), 1u);
      const size_t k = b->entries[0].draft.size();
      fed.push_back(k);
      s.Complete(0, std::vector<int32_t>(k + 1, i < 5 ? 0 : 1));
    }
    const std::vector<size_t> want = adaptive ? std::vector<size_t>{6, 5, 4, 3, 2, 1, 3, 5, 6}
                                              : std::vector<size_t>(9, 6);
    EXPECT_EQ(fed, want) << (adaptive ? "adaptive" : "fixed");
  }
}

// With a draft model on the workers, a plan asks the draft for as many guesses as any sequence that
// samples in it may be fed.
TEST(SpeculationTest, AdaptiveGuessesSizeTheDraftsWork) {
  DraftProposer draft;
  SchedulerOptions o = SpecOptions(&draft, 4, 64);
  o.limits.max_model_len = 256;
  o.adaptive_speculative_tokens = true;
  Scheduler s(o);
  s.Add(1, {2, 3}, v1::RowSampling());
  s.Add(2, {2, 3}, v1::RowSampling());
  v1::StepPlan plan;
  uint64_t step = 1;
  const MicroBatch* b = s.Schedule(0, step++, &plan);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->draft_tokens, 4);
  s.Complete(0, {1, 1});
  // Sequence 1's guesses are always wrong, sequence 2's always right: 2 stays at 4 guesses.
  for (int i = 0; i < 6; ++i) {
    for (uint64_t id : {1, 2}) draft.Offer(id, s.num_tokens(id), std::vector<int32_t>(4, 1));
    b = s.Schedule(0, step++, &plan);
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(b->draft_tokens, 4) << "step " << i;
    std::vector<int32_t> sampled;
    for (const MicroBatch::Entry& e : b->entries) {
      const size_t end = static_cast<size_t>(e.logit_row) + e.draft.size() + 1;
      if (sampled.size() < end) sampled.resize(end);
      for (size_t j = e.logit_row; j < end; ++j) sampled[j] = e.seq == 1 ? 0 : 1;
    }
    s.Complete(0, sampled);
  }
  // Sequence 2 ends: the draft is asked for sequence 1's number alone, down to 1.
  s.Remove(2);
  draft.Offer(1, s.num_tokens(1), std::vector<int32_t>(4, 1));
  b = s.Schedule(0, step++, &plan);
  ASSERT_NE(b, nullptr);
  ASSERT_EQ(b->entries.size(), 1u);
  EXPECT_EQ(b->entries[0].draft.size(), 1u);
  EXPECT_EQ(b->draft_tokens, 1);
}

// A constrained request's guesses (grammar/matcher.h GuessMasks): a grammar that forces the path
// "xyzzy" then EOS. A wrong first guess is cut and leaves the one mask of the sampled token; right
// guesses are all kept, with the mask after each (one-hot on the forced character), except the EOS
// (nothing may follow it); partly right guesses are kept up to the first wrong one. The matcher ends
// as it began every time: the mask and the count of tokens it has accepted are those of a matcher
// advanced token by token over the accepted tokens only.
TEST(GuessMasksTest, GuessesAreCutWhereTheGrammarRefusesThemAndRolledBack) {
  constexpr int32_t kX = 0, kY = 1, kZ = 2, kQ = 3, kEos = 4;
  auto vocab = std::make_shared<const grammar::TokenizerInfo>(
      grammar::TokenizerInfo({"x", "y", "z", "q", ""}, {}, {kEos}, 5));
  absl::StatusOr<grammar::Grammar> g = grammar::ParseGbnf(R"(root ::= "xyzzy")");
  ASSERT_TRUE(g.ok()) << g.status();
  absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>> compiled = grammar::CompiledGrammar::Compile(*g, vocab);
  ASSERT_TRUE(compiled.ok()) << compiled.status();
  const std::vector<int32_t> path = {kX, kY, kZ, kZ, kY};
  auto one_hot = [](int32_t id) { return std::vector<uint32_t>{1u << id}; };
  auto row = [](const std::vector<uint32_t>& masks, int i) { return std::vector<uint32_t>{masks[i]}; };
  grammar::GrammarMatcher m(*compiled);
  ASSERT_EQ(m.mask_words(), 1);
  std::vector<uint32_t> masks;
  // Wrong.
  EXPECT_EQ(m.GuessMasks({kQ, kY}, &masks), 0);
  ASSERT_EQ(masks.size(), 1u);
  EXPECT_EQ(row(masks, 0), one_hot(kX));
  EXPECT_EQ(m.NumAccepted(), 0);
  // Right, to the end: the EOS guess is cut.
  EXPECT_EQ(m.GuessMasks({kX, kY, kZ, kZ, kY, kEos}, &masks), 5);
  ASSERT_EQ(masks.size(), 6u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(row(masks, i), one_hot(path[i])) << i;
  EXPECT_EQ(row(masks, 5), one_hot(kEos));
  EXPECT_EQ(m.NumAccepted(), 0);
  // Partly right.
  EXPECT_EQ(m.GuessMasks({kX, kY, kQ, kZ}, &masks), 2);
  ASSERT_EQ(masks.size(), 3u);
  EXPECT_EQ(row(masks, 2), one_hot(kZ));
  EXPECT_EQ(m.NumAccepted(), 0);
  // From inside the path, after a verification accepted "x y": guesses "z z q" keep "z z".
  ASSERT_TRUE(m.AcceptToken(kX));
  ASSERT_TRUE(m.AcceptToken(kY));
  EXPECT_EQ(m.GuessMasks({kZ, kZ, kQ}, &masks), 2);
  ASSERT_EQ(masks.size(), 3u);
  EXPECT_EQ(row(masks, 0), one_hot(kZ));
  EXPECT_EQ(row(masks, 2), one_hot(kY));
  EXPECT_EQ(m.NumAccepted(), 2);
  std::vector<uint32_t> now(1);
  m.FillNextTokenBitmask(now.data());
  EXPECT_EQ(now, MaskTokenByToken(*compiled, {kX, kY}));
  // The accepted guesses then advance it as token by token.
  ASSERT_TRUE(m.AcceptToken(kZ));
  ASSERT_TRUE(m.AcceptToken(kZ));
  m.FillNextTokenBitmask(now.data());
  EXPECT_EQ(now, MaskTokenByToken(*compiled, {kX, kY, kZ, kZ}));
  // Guesses out of the vocabulary are refused like any other.
  EXPECT_EQ(m.GuessMasks({kY, -1}, &masks), 1);
  EXPECT_EQ(m.GuessMasks({99}, &masks), 0);
  EXPECT_EQ(m.NumAccepted(), 4);
  // Terminated: nothing allowed, no guess kept, one empty mask.
  ASSERT_TRUE(m.AcceptToken(kY));
  ASSERT_TRUE(m.AcceptToken(kEos));
  EXPECT_EQ(m.GuessMasks({kX}, &masks), 0);
  EXPECT_EQ(masks, std::vector<uint32_t>{0u});
}

// Through the scheduler: a constrained sequence whose proposer guesses wrong, right and partly
// right is fed only the guesses its grammar allows, its plan carries one mask per sampled position,
// and it ends with its constrained reference tokens and its matcher over exactly those.
TEST(SpeculationTest, ConstrainedSequenceIsFedTheGuessesItsGrammarAllows) {
  Oracle oracle;
  RightProposer right(&oracle);
  WrongProposer wrong(&oracle);
  RandomProposer random;
  for (const Proposer* proposer : std::vector<const Proposer*>{&right, &wrong, &random}) {
    v1::RowSampling r;
    const std::vector<int32_t> prompt = {1, 2, kVocab};
    const std::vector<int32_t> want = Reference(prompt, 24, r, AbcGrammar());
    oracle.full.clear();
    std::vector<int32_t> full = prompt;
    full.insert(full.end(), want.begin(), want.end());
    oracle.full[prompt] = full;
    GrammarGuesses guesses;
    guesses.Constrain(1, AbcGrammar());
    SpecSim sim(SpecOptions(proposer, 4, 32), &guesses);
    sim.Add(1, prompt, 24, r);
    while (sim.Step()) ASSERT_FALSE(HasFatalFailure());
    EXPECT_EQ(sim.Output(1), want);
    const SpeculationStats& st = sim.sched().speculation();
    if (proposer == &right) {
      EXPECT_GT(st.proposed, 0);
      EXPECT_EQ(st.accepted, st.proposed);
      EXPECT_EQ(guesses.cut(), 0) << "the reference path is the grammar's";
    } else {
      EXPECT_GT(guesses.cut(), 0);
    }
  }
}

TEST(NgramProposerTest, ProposesWhatFollowedTheLongestRecentMatch) {
  NgramProposer p(1, 3);
  std::vector<int32_t> out;
  // "5 6 7" occurred before, followed by 8 9: the 3-gram wins over the later 1-gram "7".
  p.Propose(1, {5, 6, 7, 8, 9, 7, 1, 5, 6, 7}, 2, &out);
  EXPECT_EQ(out, (std::vector<int32_t>{8, 9}));
  // Only a 1-gram matches: its latest occurrence.
  p.Propose(1, {4, 1, 3, 1, 2, 9, 1}, 3, &out);
  EXPECT_EQ(out, (std::vector<int32_t>{2, 9, 1}));
  // Nothing: no proposal.
  p.Propose(1, {1, 2, 3}, 3, &out);
  EXPECT_TRUE(out.empty());
  // Fewer than k tokens follow: what there is.
  p.Propose(1, {7, 8, 7}, 4, &out);
  EXPECT_EQ(out, (std::vector<int32_t>{8, 7}));
}

// A draft model's guesses are served for the sequence and token count they were made for only,
// cut to k, and not after the sequence is forgotten or the proposer cleared.
TEST(DraftProposerTest, ServesGuessesForTheirTokenCountOnly) {
  DraftProposer p;
  EXPECT_TRUE(p.proposes_in_step());
  std::vector<int32_t> out = {9};
  p.Propose(1, {1, 2, 3}, 4, &out);
  EXPECT_TRUE(out.empty()) << "nothing offered";
  p.Offer(1, 3, {7, 8, 9});
  p.Offer(2, 2, {5});
  p.Propose(1, {1, 2, 3}, 4, &out);
  EXPECT_EQ(out, (std::vector<int32_t>{7, 8, 9}));
  p.Propose(1, {1, 2, 3}, 2, &out);
  EXPECT_EQ(out, (std::vector<int32_t>{7, 8}));
  p.Propose(1, {1, 2, 3, 7}, 4, &out);
  EXPECT_TRUE(out.empty()) << "made for 3 tokens, not 4";
  p.Propose(3, {1, 2, 3}, 4, &out);
  EXPECT_TRUE(out.empty()) << "another sequence's";
  p.Offer(1, 4, {6});  // the next step's replace them
  p.Propose(1, {1, 2, 3}, 4, &out);
  EXPECT_TRUE(out.empty());
  p.Propose(1, {1, 2, 3, 7}, 4, &out);
  EXPECT_EQ(out, (std::vector<int32_t>{6}));
  p.Forget(1);
  p.Propose(1, {1, 2, 3, 7}, 4, &out);
  EXPECT_TRUE(out.empty());
  EXPECT_EQ(p.size(), 1);
  p.Clear();
  p.Propose(2, {1, 2}, 4, &out);
  EXPECT_TRUE(out.empty());
  EXPECT_EQ(p.size(), 0);
}

TEST(PersistentBatchSpeculationTest, BadRollbacksAndSampleCountsAreRefused) {
  StepLimits l;
  l.block_size = 4;
  l.max_model_len = 32;
  l.num_kv_blocks = 16;
  l.max_tokens_per_step = 16;
  l.max_seqs_per_step = 4;
  PersistentBatch w(l, kVocab, true);
  StepBatch b;
  google::protobuf::RepeatedPtrField<v1::RowSampling> s;
  v1::StepPlan p;
  p.set_step_id(1);
  v1::NewSeq* n = p.add_new_seqs();
  n->set_seq_id(1);
  n->add_block_ids(0);
  n->add_block_ids(1);
  n->set_prompt_len(3);
  for (int t : {1, 2, 3, 0, 1}) p.add_token_ids(t);
  p.add_row_seq_ids(1);
  p.add_row_start_positions(0);
  p.add_row_num_tokens(5);
  p.add_row_samples(true);
  p.add_row_num_sampled(3);  // positions 2, 3, 4
  ASSERT_TRUE(w.Apply(p, &b, &s).ok());
  ASSERT_EQ(b.logit_rows, (std::vector<int32_t>{2, 3, 4}));
  EXPECT_EQ(s[0].draw_index(), 0u);  // the completion's first token
  EXPECT_EQ(s[2].draw_index(), 2u);
  auto refused = [&](v1::StepPlan q, const std::string& what) {
    PersistentBatch w2(l, kVocab, true);
    ASSERT_TRUE(w2.Apply(p, &b, &s).ok());
    q.set_step_id(2);
    const absl::Status st = w2.Apply(q, &b, &s);
    EXPECT_FALSE(st.ok()) << what;
    EXPECT_NE(std::string(st.message()).find(what), std::string::npos) << st;
  };
  v1::StepPlan q;
  q.add_token_ids(1);
  q.add_row_seq_ids(1);
  q.add_row_start_positions(3);
  q.add_row_num_tokens(1);
  q.add_row_samples(true);
  q.add_rollback_seq_ids(1);
  q.add_rollback_num_tokens(3);
  q.add_rollback_num_blocks(1);
  {
    v1::StepPlan ok = q;
    PersistentBatch w2(l, kVocab, true);
    ASSERT_TRUE(w2.Apply(p, &b, &s).ok());
    ok.set_step_id(2);
    ASSERT_TRUE(w2.Apply(ok, &b, &s).ok());
    EXPECT_EQ(w2.fed(1), 4);
    EXPECT_EQ(w2.blocks(1).size(), 1u);
  }
  v1::StepPlan bad = q;
  bad.set_rollback_num_tokens(0, 2);
  refused(bad, "prompt_len");
  bad = q;
  bad.set_rollback_num_tokens(0, 6);
  refused(bad, "must lie in");
  bad = q;
  bad.set_rollback_num_blocks(0, 3);
  refused(bad, "blocks");
  bad = q;
  bad.add_rollback_num_blocks(1);
  refused(bad, "rollback lists");
  bad = q;
  bad.set_rollback_seq_ids(0, 9);
  refused(bad, "does not hold");
  bad = q;
  bad.add_row_num_sampled(2);  // more samples than the row's one token
  refused(bad, "samples at 2 positions");
}

// Sampling with speculation draws from the model's distribution: the first three tokens of
// 4000 sequences (different seeds), with a proposer whose guesses are right about half the time,
// against the exact probabilities of the 64 three-token outputs. Chi-square with 63 degrees of
// freedom; the threshold 110.6 is its 0.9999 quantile, so a correct implementation with random
// seeds would fail once in 10^4 runs; the seeds are fixed, so this run's outcome never changes.
TEST(SpeculationTest, SampledOutputsFollowTheModelsDistribution) {
  RandomProposer random;
  SchedulerOptions o = SpecOptions(&random, 3, 256);
  o.limits.max_model_len = 16;
  o.limits.max_tokens_per_step = 64;
  const std::vector<int32_t> prompt = {3, 1, 2};
  constexpr int kRuns = 4000;
  std::vector<int64_t> counts(64, 0);
  SpecSim sim(o);
  std::mt19937_64 rng(2024);
  for (int i = 0; i < kRuns; ++i) {
    v1::RowSampling r;
    r.set_temperature(1);
    r.set_seed(rng());
    sim.Add(i + 1, prompt, 3, r);
    if (i % 8 == 7 || i + 1 == kRuns) {
      while (sim.Step()) ASSERT_FALSE(HasFatalFailure());
    }
  }
  for (int i = 0; i < kRuns; ++i) {
    const std::vector<int32_t> out = sim.Output(i + 1);
    ASSERT_EQ(out.size(), 3u);
    ++counts[out[0] * 16 + out[1] * 4 + out[2]];
  }
  EXPECT_GT(sim.sched().speculation().accepted, 0);
  double chi2 = 0;
  for (int c = 0; c < 64; ++c) {
    std::vector<int32_t> ctx = prompt;
    double prob = 1;
    for (int32_t t : {c / 16, (c / 4) % 4, c % 4}) {
      prob *= Probs(ctx)[t];
      ctx.push_back(t);
    }
    const double expected = prob * kRuns;
    chi2 += (counts[c] - expected) * (counts[c] - expected) / expected;
  }
  RecordProperty("chi2", std::to_string(chi2));
  EXPECT_LT(chi2, 110.6);
}

}  // namespace
}  // namespace shardserve
