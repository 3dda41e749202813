#include "coordinator/scheduler/scheduler.h"

#include <algorithm>

namespace shardserve {

Scheduler::Scheduler(const SchedulerOptions& options)
    : options_(options),
      depth_(options.feed_samples && options.proposer == nullptr ? 2 : 1),
      blocks_(options.limits.num_kv_blocks, options.limits.block_size, options.prefix_caching, options.prefix_key_fn),
      blocks_window_(options.full_layers ? 0 : options.sliding_window),
      lanes_(std::max(1, options.lanes)) {
  spec_.accepted_by_position.assign(std::max(0, options.num_speculative_tokens), 0);
  if (options.sliding_window > 0 && options.full_layers) {
    sliding_.emplace(options.limits.num_sliding_kv_blocks, options.limits.block_size, options.prefix_caching,
                     options.prefix_key_fn);
  }
}

bool Scheduler::Grow(Seq& s, int64_t tokens) {
  const int64_t want = blocks_.BlocksFor(tokens) - static_cast<int64_t>(s.blocks.size());
  if (want > blocks_.num_available() || (sliding_ && want > sliding_->num_available())) return false;
  blocks_.Grow(&s.blocks, tokens);  // cannot fail: checked above
  if (sliding_) sliding_->Grow(&s.sliding_blocks, tokens);
  return true;
}

void Scheduler::FreeBlocks(Seq& s) {
  blocks_.Free(&s.blocks);  // its full blocks stay cached: it may find them again
  s.chain = BlockManager::Chain{};
  if (sliding_) sliding_->Free(&s.sliding_blocks);
  s.sliding_chain = BlockManager::Chain{};
}

void Scheduler::Register(Seq& s) {
  blocks_.Register(s.blocks, s.tokens, s.known_fed(), &s.chain);
  if (sliding_) sliding_->Register(s.sliding_blocks, s.tokens, s.known_fed(), &s.sliding_chain);
}

void Scheduler::Advance(Seq& s) {
  // The blocks this step fills are written before any later step reads them.
  Register(s);
  // The next token, at num_fed, attends to [num_fed - window + 1, num_fed]: every worker runs the
  // steps in the order sent, so the steps in flight read the blocks let go before a later step
  // that takes them writes them.
  if (blocks_window_ > 0) blocks_.Release(&s.blocks, s.num_fed - blocks_window_ + 1);
  if (sliding_) sliding_->Release(&s.sliding_blocks, s.num_fed - options_.sliding_window + 1);
}

void Scheduler::Add(uint64_t id, std::vector<int32_t> prompt, const v1::RowSampling& sampling, SeqOptions seq) {
  auto s = std::make_unique<Seq>();
  s->id = id;
  s->options = seq;
  s->prompt_len = static_cast<int64_t>(prompt.size());
  s->tokens = std::move(prompt);
  s->sampling = sampling;
  s->guesses = options_.num_speculative_tokens;
  s->penalized = (sampling.repetition_penalty() != 0 && sampling.repetition_penalty() != 1) ||
                 sampling.presence_penalty() != 0 || sampling.frequency_penalty() != 0 ||
                 sampling.bad_word_lengths_size() > 0;
  s->scores = sampling.has_prompt_logprobs();
  // Workers derive these per step (worker/persistent_batch.h); NewSeq carries them unset.
  s->sampling.clear_draw_index();
  s->sampling.clear_penalty_prompt_ids();
  s->sampling.clear_penalty_output_ids();
  seqs_[id] = std::move(s);
  waiting_.insert(id);
}

int64_t Scheduler::generated(uint64_t id) const {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return 0;
  return static_cast<int64_t>(it->second->tokens.size()) - it->second->prompt_len;
}

int64_t Scheduler::cached_prompt_tokens(uint64_t id) const {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return 0;
  return std::min(it->second->num_cached, it->second->prompt_len);
}

int64_t Scheduler::num_tokens(uint64_t id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? 0 : static_cast<int64_t>(it->second->tokens.size());
}

int64_t Scheduler::table_blocks(uint64_t id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? 0 : static_cast<int64_t>(it->second->blocks.size());
}

std::vector<int32_t> Scheduler::table(uint64_t id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? std::vector<int32_t>{} : it->second->blocks;
}

std::vector<int32_t> Scheduler::sliding_table(uint64_t id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? std::vector<int32_t>{} : it->second->sliding_blocks;
}

std::vector<int32_t> Scheduler::tokens(uint64_t id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? std::vector<int32_t>{} : it->second->tokens;
}

int64_t Scheduler::fed(uint64_t id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? 0 : it->second->num_fed;
}

void Scheduler::Forget(Seq& s) {
  rollbacks_.erase(std::remove_if(rollbacks_.begin(), rollbacks_.end(), [&](const Rollback& r) { return r.seq == s.id; }),
                   rollbacks_.end());
  if (!s.sent) return;
  freed_.push_back(s.id);
  s.sent = false;
  s.blocks_sent = 0;
}

void Scheduler::Preempt(Seq& s) {
  Forget(s);  // it comes back as a new sequence, with new blocks
  FreeBlocks(s);
  s.num_fed = 0;
  s.stalled = false;
  --lanes_[s.lane].running;
  s.lane = -1;
  running_.erase(s.id);
  waiting_.insert(s.id);
  ++preemptions_;
}

bool Scheduler::Reserve(Seq& s, int64_t tokens) {
  while (!Grow(s, tokens)) {
    // The newest running sequence that no step holds.
    Seq* victim = nullptr;
    bool newer_in_a_step = false;
    for (auto it = running_.rbegin(); it != running_.rend() && *it > s.id; ++it) {
      Seq& v = *seqs_.at(*it);
      if (v.in_batch || v.in_flight > 0) {
        newer_in_a_step = true;
      } else {
        victim = &v;
        break;
      }
    }
    if (victim != nullptr) {
      Preempt(*victim);
    } else if (newer_in_a_step || s.in_flight > 0) {
      s.stalled = true;
      return false;  // wait: a newer sequence in a step gives way when it next needs a block, or
                     // the step in flight that feeds `s` ends
    } else {
      Preempt(s);  // the newest of all gives way itself
      return false;
    }
  }
  s.stalled = false;
  return true;
}

bool Scheduler::Continues(const Seq& s) const {
  // Every known token fed and one step in flight: that step fed the last of them, so it samples (a
  // step that feeds a sequence up to its last token always does; one that stops short leaves it
  // unfed).
  if (depth_ < 2 || !s.options.feed_ahead || s.in_flight != 1 || s.unfed() != 0) return false;
  // Its continuation samples the token after the one in flight: both within max_len.
  const int64_t max_len = s.options.max_len > 0 ? std::min(s.options.max_len, options_.limits.max_model_len)
                                                : options_.limits.max_model_len;
  return static_cast<int64_t>(s.tokens.size()) + 2 <= max_len;
}

int64_t Scheduler::Scored(const Seq& s, int64_t chunk) const {
  // Until its first token is sampled: the positions of the chunk followed by a prompt token.
  if (!s.scores || static_cast<int64_t>(s.tokens.size()) != s.prompt_len) return 0;
  return std::max<int64_t>(0, std::min(s.num_fed + chunk, s.prompt_len - 1) - s.num_fed);
}

int64_t Scheduler::RowsFor(const Seq& s, int rows) const {
  // Every other sequence that may still join this step samples at most once in it (the guesses
  // come with the decodes, placed first).
  int64_t others = 0;
  for (uint64_t id : running_) {
    const Seq& o = *seqs_.at(id);
    if (o.id != s.id && !o.in_batch && !o.removed) ++others;
  }
  const int64_t waiting = num_waiting() - static_cast<int64_t>(waiting_.count(s.id));
  const int64_t places = options_.limits.max_seqs_per_step - num_running() - static_cast<int64_t>(waiting_.count(s.id));
  others += std::clamp<int64_t>(waiting, 0, std::max<int64_t>(0, places));
  return options_.limits.max_seqs_per_step - rows - others;
}

void Scheduler::Place(Seq& s, int64_t chunk, MicroBatch* batch, int* rows, std::vector<int32_t> draft,
                      bool continues) {
  MicroBatch::Entry e;
  e.seq = s.id;
  e.tokens = static_cast<int32_t>(chunk + static_cast<int64_t>(draft.size()));
  e.feeds_sample = continues;
  e.start = s.num_fed;
  e.scored = static_cast<int32_t>(Scored(s, chunk));
  if (e.scored > 0) {
    e.scored_row = *rows;
    *rows += e.scored;
  }
  if (chunk == s.unfed() || continues) {
    e.logit_row = *rows;
    e.samples = 1 + static_cast<int32_t>(draft.size());
    *rows += e.samples;
  }
  if (!s.started) {
    s.started = true;
    batch->started.push_back(s.id);
  }
  (chunk > 1 ? batch->prefill_tokens : batch->decode_tokens) += e.tokens;
  e.draft = std::move(draft);
  s.in_batch = true;
  batch->entries.push_back(e);
}

int64_t Scheduler::PrefillCap() const {
  if (lanes() == 1) return options_.limits.max_tokens_per_step;
  int64_t work = 0;
  for (const Lane& l : lanes_) {
    for (const MicroBatch& b : l.batches) work += b.prefill_tokens;
  }
  for (uint64_t id : running_) {
    const Seq& s = *seqs_.at(id);
    if (!s.decodes() && !s.removed) work += std::max<int64_t>(0, s.unfed());
  }
  int64_t admissible = options_.limits.max_seqs_per_step - num_running();
  for (auto it = waiting_.begin(); it != waiting_.end() && admissible > 0; ++it, --admissible) {
    work += static_cast<int64_t>(seqs_.at(*it)->tokens.size());
  }
  // Never below budget / lanes: a shorter prompt is not worth the split.
  return std::max<int64_t>({1, (work + lanes() - 1) / lanes(), options_.limits.max_tokens_per_step / lanes()});
}

const MicroBatch* Scheduler::Schedule(int lane, uint64_t step_id, v1::StepPlan* step) {
  if (LaneBusy(lane)) return nullptr;
  Lane& l = lanes_[lane];
  MicroBatch& batch = l.batches.emplace_back();
  batch.lane = lane;
  batch.step_id = step_id;
  int64_t budget = options_.limits.max_tokens_per_step;
  int64_t prefill_budget = PrefillCap();
  int rows = 0;
  // Speculation: logit rows to spare beyond one per sequence that may sample in this step.
  const bool speculate =
      options_.proposer != nullptr && options_.num_speculative_tokens > 0 &&
      (options_.speculative_max_running <= 0 || num_running() < options_.speculative_max_running);
  int64_t spare_samples =
      speculate ? options_.limits.max_seqs_per_step - num_running() - num_waiting() : 0;
  // The lanes' share of all sequences: admissions stop there, and a prompt's last chunk moves
  // its sequence into this lane only below it.
  const int64_t share = (num_running() + num_waiting() + lanes() - 1) / lanes();

  // 1 and 2: running sequences: the lane's decodes first, then prompt (and recompute) chunks of
  // any lane.
  const std::vector<uint64_t> running(running_.begin(), running_.end());
  for (const bool decodes : {true, false}) {
    for (uint64_t id : running) {
      if (budget == 0 || (!decodes && prefill_budget == 0)) break;
      if (!running_.count(id)) continue;  // preempted while this step was built
      Seq& s = *seqs_.at(id);
      const bool continues = Continues(s);
      const int64_t need = continues ? 1 : s.unfed();
      if (s.in_batch || s.removed || need <= 0) continue;  // removed: only waits for its step in flight
      const bool decode = continues || s.decodes();
      if (decode != decodes || (decode && s.lane != lane)) continue;
      int64_t chunk = std::min(need, decode ? budget : std::min(budget, prefill_budget));
      // A prompt scored takes a logit row a position.
      if (Scored(s, chunk) > 0) chunk = std::min(chunk, RowsFor(s, rows));
      if (chunk <= 0) continue;
      if (chunk == need && s.lane != lane && l.running >= share) {
        chunk = need - 1;  // the chunk that samples waits for the home lane
        if (chunk == 0) continue;
      }
      if (!Reserve(s, s.num_fed + chunk)) continue;
      if (chunk == need && s.lane != lane) {
        --lanes_[s.lane].running;
        s.lane = lane;
        ++l.running;
      }
      std::vector<int32_t> draft;
      if (decode && spare_samples > 0) draft = Propose(s, budget - chunk, spare_samples);
      spare_samples -= static_cast<int64_t>(draft.size());
      budget -= chunk + static_cast<int64_t>(draft.size());
      Place(s, chunk, &batch, &rows, std::move(draft), continues);
      if (!decode) prefill_budget -= chunk;
    }
  }

  // 3: admissions, while no running sequence waits for a block (the blocks freed next are its;
  // else a sequence that preempts itself is admitted again at once, and with lanes > 1 it can take
  // them back every step). A sequence joins this lane while it holds less than its share of all
  // sequences; past that, it joins another lane below its share that has a step in flight (it
  // cannot take the prompt now), and this step carries its first chunk, all but the last token,
  // which samples in its own lane.
  const bool stalled =
      std::any_of(running_.begin(), running_.end(), [&](uint64_t id) { return seqs_.at(id)->stalled; });
  while (!stalled && budget > 0 && prefill_budget > 0 && !waiting_.empty() &&
         num_running() < options_.limits.max_seqs_per_step) {
    int home = lane;
    for (int i = 0; home == lane && l.running >= share && i < lanes(); ++i) {
      if (i != lane && !lanes_[i].batches.empty() && lanes_[i].running < share) home = i;
    }
    if (lanes_[home].running >= share) break;
    Seq& s = *seqs_.at(*waiting_.begin());
    const int64_t bs = blocks_.block_size();
    // The cached blocks that hold its longest prefix, all but its last token at most, in every
    // pool.
    BlockManager::Chain chain, sliding_chain;
    std::vector<int32_t> hit, sliding_hit;
    if (!s.penalized && !s.scores) {
      hit = blocks_.FindCached(s.tokens, (static_cast<int64_t>(s.tokens.size()) - 1) / bs, &chain);
      if (sliding_) {
        const int64_t n = static_cast<int64_t>(hit.size());
        sliding_hit = sliding_->FindCached(s.tokens, n, &sliding_chain);
        if (static_cast<int64_t>(sliding_hit.size()) < n) {
          hit = blocks_.FindCached(s.tokens, static_cast<int64_t>(sliding_hit.size()), &chain);
        }
      }
    }
    const int64_t cached = static_cast<int64_t>(hit.size()) * bs;
    const int64_t need = static_cast<int64_t>(s.tokens.size()) - cached;
    int64_t chunk = std::min({need, budget, prefill_budget});
    if (Scored(s, chunk) > 0) chunk = std::min(chunk, RowsFor(s, rows));  // a logit row a position
    if (chunk <= 0) break;
    if (home != lane && chunk == need) chunk = need - 1;
    if (chunk == 0) break;
    // Of the blocks found, a sliding pool keeps those in the window of the first token fed (at
    // `cached`) and lets the others go at once: only those count against what it has left.
    const int64_t new_blocks = blocks_.BlocksFor(cached + chunk) - static_cast<int64_t>(hit.size());
    auto fits = [&](const BlockManager& pool, const std::vector<int32_t>& found, int64_t window) {
      const int64_t first_kept = window > 0 ? std::max<int64_t>(0, cached - window + 1) / bs : 0;
      const std::vector<int32_t> kept(found.begin() + std::min<int64_t>(first_kept, found.size()), found.end());
      return new_blocks <= pool.num_available() - pool.CountCached(kept);
    };
    if (!fits(blocks_, hit, blocks_window_)) break;
    if (sliding_ && !fits(*sliding_, sliding_hit, options_.sliding_window)) break;
    blocks_.Share(hit, &s.blocks);
    if (blocks_window_ > 0) blocks_.Release(&s.blocks, cached - blocks_window_ + 1);
    if (sliding_) {
      sliding_->Share(sliding_hit, &s.sliding_blocks);
      sliding_->Release(&s.sliding_blocks, cached - options_.sliding_window + 1);
    }
    s.found = std::move(hit);
    s.sliding_found = std::move(sliding_hit);
    Grow(s, cached + chunk);  // cannot fail: checked above
    s.num_fed = cached;
    s.num_cached = cached;
    s.chain = chain;
    s.sliding_chain = sliding_chain;
    if (blocks_.prefix_caching() && !s.penalized && !s.scores) {
      prefix_query_tokens_ += static_cast<int64_t>(s.tokens.size());
      prefix_hit_tokens_ += cached;
    }
    waiting_.erase(waiting_.begin());
    running_.insert(s.id);
    s.lane = home;
    ++lanes_[home].running;
    Place(s, chunk, &batch, &rows);
    budget -= chunk;
    prefill_budget -= chunk;
  }

  if (batch.entries.empty()) {
    l.batches.pop_back();
    return nullptr;
  }
  // A draft model on the workers guesses within the step, for the sequences' next decodes: as many
  // as any sequence that samples may be fed.
  if (speculate && options_.proposer->proposes_in_step()) {
    batch.draft_tokens = options_.num_speculative_tokens;
    if (options_.adaptive_speculative_tokens) {
      batch.draft_tokens = 1;
      for (const MicroBatch::Entry& e : batch.entries) {
        if (e.logit_row >= 0) batch.draft_tokens = std::max(batch.draft_tokens, seqs_.at(e.seq)->guesses);
      }
    }
  }
  WriteStep(batch, step);
  for (const MicroBatch::Entry& e : batch.entries) {
    Seq& s = *seqs_.at(e.seq);
    s.num_fed += e.tokens - static_cast<int64_t>(e.draft.size());  // the guesses once accepted (Verify)
    ++s.in_flight;
    s.in_batch = false;
    Advance(s);
  }
  return &batch;
}

void Scheduler::WriteStep(MicroBatch& batch, v1::StepPlan* step) {
  step->Clear();
  step->set_step_id(batch.step_id);
  // Freed first: a sequence preempted while this step was built may come back in it as new.
  step->mutable_freed_seq_ids()->Add(freed_.begin(), freed_.end());
  freed_.clear();
  // Rolled back next: guesses rejected since the last plan (Forget drops a freed sequence's).
  for (const Rollback& r : rollbacks_) {
    step->add_rollback_seq_ids(r.seq);
    step->add_rollback_num_tokens(static_cast<int32_t>(r.tokens));
    step->add_rollback_num_blocks(static_cast<int32_t>(r.blocks));
    seqs_.at(r.seq)->blocks_sent = r.blocks;  // its table may have grown again since, for this plan
  }
  rollbacks_.clear();
  step->set_num_draft_tokens(batch.draft_tokens);
  const bool speculative = std::any_of(batch.entries.begin(), batch.entries.end(),
                                       [](const MicroBatch::Entry& e) { return !e.draft.empty(); });
  const bool continuing = std::any_of(batch.entries.begin(), batch.entries.end(),
                                      [](const MicroBatch::Entry& e) { return e.feeds_sample; });
  const bool scoring = std::any_of(batch.entries.begin(), batch.entries.end(),
                                   [](const MicroBatch::Entry& e) { return e.scored > 0; });
  for (const MicroBatch::Entry& e : batch.entries) {
    Seq& s = *seqs_.at(e.seq);
    const int64_t num_blocks = static_cast<int64_t>(s.blocks.size());
    if (!s.sent) {
      v1::NewSeq* n = step->add_new_seqs();
      n->set_seq_id(s.id);
      // A table let go of the found blocks before its first token's window at once: the workers get
      // their ids all the same (they read nothing there), as they keep those a table lets go later.
      auto table = [](const std::vector<int32_t>& blocks, const std::vector<int32_t>& found,
                      google::protobuf::RepeatedField<int32_t>* out) {
        for (size_t i = 0; i < blocks.size(); ++i) {
          out->Add(blocks[i] == BlockManager::kReleased && i < found.size() ? found[i] : blocks[i]);
        }
      };
      table(s.blocks, s.found, n->mutable_block_ids());
      table(s.sliding_blocks, s.sliding_found, n->mutable_sliding_block_ids());
      s.found.clear();
      s.sliding_found.clear();
      *n->mutable_sampling() = s.sampling;
      n->set_prompt_len(static_cast<int32_t>(s.prompt_len));
      n->set_num_cached_tokens(static_cast<int32_t>(s.num_fed));  // its first row starts there
      // A draft model on the workers keeps a KV cache of its own: it needs the tokens no row feeds.
      if (options_.proposer != nullptr && options_.proposer->proposes_in_step()) {
        n->mutable_cached_token_ids()->Add(s.tokens.begin(), s.tokens.begin() + s.num_fed);
      }
      s.sent = true;
    } else if (num_blocks > s.blocks_sent) {
      v1::SeqBlocks* a = step->add_appended_blocks();
      a->set_seq_id(s.id);
      a->mutable_block_ids()->Add(s.blocks.begin() + s.blocks_sent, s.blocks.end());
      if (sliding_) a->mutable_sliding_block_ids()->Add(s.sliding_blocks.begin() + s.blocks_sent, s.sliding_blocks.end());
    }
    s.blocks_sent = num_blocks;
    const int64_t own = e.tokens - static_cast<int64_t>(e.draft.size());
    if (e.feeds_sample) {
      step->add_token_ids(0);  // the worker's sample, which it puts in itself
    } else {
      step->mutable_token_ids()->Add(s.tokens.begin() + s.num_fed, s.tokens.begin() + s.num_fed + own);
    }
    step->mutable_token_ids()->Add(e.draft.begin(), e.draft.end());
    step->add_row_seq_ids(s.id);
    step->add_row_start_positions(static_cast<int32_t>(s.num_fed));
    step->add_row_num_tokens(e.tokens);
    step->add_row_samples(e.logit_row >= 0);
    if (speculative) step->add_row_num_sampled(e.samples);
    if (continuing) step->add_row_feeds_sample(e.feeds_sample);
    if (scoring) step->add_row_num_scored(e.scored);
    if (e.scored > 0) {
      // Position p scores the prompt token at p + 1.
      step->mutable_scored_ids()->Add(s.tokens.begin() + e.start + 1, s.tokens.begin() + e.start + 1 + e.scored);
      batch.logit_rows += e.scored;
      batch.wants_logprobs = true;
    }
    if (e.logit_row >= 0) {
      batch.draft_ids += batch.draft_tokens;
      batch.logit_rows += e.samples;
      batch.wants_logprobs = batch.wants_logprobs || s.sampling.logprobs();
    }
  }
}

std::vector<SampledToken> Scheduler::Complete(int lane, const std::vector<int32_t>& sampled,
                                              std::vector<ScoredPositions>* scored) {
  Lane& l = lanes_[lane];
  std::vector<SampledToken> out;
  if (l.batches.empty()) return out;
  for (const MicroBatch::Entry& e : l.batches.front().entries) {
    auto it = seqs_.find(e.seq);
    if (it == seqs_.end()) continue;
    Seq& s = *it->second;
    --s.in_flight;
    if (s.removed) {
      if (s.in_flight == 0) Erase(s);
      continue;
    }
    if (e.scored > 0 && scored != nullptr) scored->push_back(ScoredPositions{s.id, e.start, e.scored_row, e.scored});
    if (!e.draft.empty()) {
      Verify(s, e, sampled, &out);
    } else if (e.logit_row >= 0 && e.logit_row < static_cast<int32_t>(sampled.size())) {
      s.tokens.push_back(sampled[e.logit_row]);
      out.push_back(SampledToken{s.id, sampled[e.logit_row], e.logit_row});
      // A continuation fed this token already: the block it completes can be registered now.
      if (s.num_fed >= static_cast<int64_t>(s.tokens.size())) Register(s);
    }
  }
  l.batches.pop_front();
  return out;
}

std::vector<int32_t> Scheduler::Propose(Seq& s, int64_t tokens, int64_t samples) {
  const int64_t len = static_cast<int64_t>(s.tokens.size());
  const int64_t max_len = s.options.max_len > 0 ? std::min(s.options.max_len, options_.limits.max_model_len)
                                                : options_.limits.max_model_len;
  // Accepting a guesses appends a + 1 tokens, within max_len; their positions lie below it.
  const int64_t most = options_.adaptive_speculative_tokens ? s.guesses : options_.num_speculative_tokens;
  const int64_t k = std::min<int64_t>({most, tokens, samples, max_len - len - 1});
  std::vector<int32_t> draft;
  if (k <= 0) return draft;
  options_.proposer->Propose(s.id, s.tokens, static_cast<int>(k), &draft);
  if (static_cast<int64_t>(draft.size()) > k) draft.resize(static_cast<size_t>(k));
  if (!draft.empty() && options_.guess_filter != nullptr) {
    draft.resize(static_cast<size_t>(std::clamp<int64_t>(options_.guess_filter->Allowed(s.id, draft), 0,
                                                         static_cast<int64_t>(draft.size()))));
  }
  // Guesses never preempt anyone, not even later in this step: they take free blocks, in every
  // pool, only while one stays available for every running sequence, else there are fewer of them.
  while (!draft.empty()) {
    const int64_t tokens = s.num_fed + 1 + static_cast<int64_t>(draft.size());
    const int64_t need = blocks_.BlocksFor(tokens) - static_cast<int64_t>(s.blocks.size());
    if (need <= blocks_.num_available() - num_running() &&
        (!sliding_ || need <= sliding_->num_available() - num_running()) && Grow(s, tokens)) {
      break;
    }
    draft.pop_back();
  }
  return draft;
}

// Why accepting "while the sample equals the guess" is exact (Leviathan et al., 2023, speculative
// sampling, for a proposal distribution q that is one-hot on the guess d). At a position whose
// target distribution is p, speculative sampling accepts d with probability min(1, p(d) / q(d)) =
// p(d), and on rejection draws from norm(max(0, p - q)), which is p with d removed and
// renormalized: p(y) / (1 - p(d)) for y != d. Drawing y ~ p and accepting iff y == d gives the
// same: y == d with probability p(d); otherwise y is a draw from p conditioned on y != d. So the
// first token emitted at each position has distribution p, the same as without speculation, and
// after k accepted guesses the sample at the last position is an ordinary draw from p there. By
// induction over positions the whole sequence has the distribution of plain decoding, provided
// the p at position i is the one plain decoding would use: the workers give each position its own
// draw index and count the guesses before it as generated (penalties, min_tokens), and the KV of
// the accepted guesses is what feeding them one by one would have written. Greedy is the case
// where p is one-hot on the argmax: outputs are identical.
void Scheduler::Verify(Seq& s, const MicroBatch::Entry& e, const std::vector<int32_t>& sampled,
                       std::vector<SampledToken>* out) {
  const int64_t k = static_cast<int64_t>(e.draft.size());
  if (e.logit_row < 0 || e.logit_row + k >= static_cast<int64_t>(sampled.size())) return;
  int64_t a = 0;
  while (a < k && sampled[e.logit_row + a] == e.draft[a]) ++a;
  for (int64_t i = 0; i <= a; ++i) {
    s.tokens.push_back(sampled[e.logit_row + i]);
    out->push_back(SampledToken{s.id, sampled[e.logit_row + i], static_cast<int32_t>(e.logit_row + i)});
  }
  // The accepted guesses' KV is written: they count as fed, and their full blocks are registered.
  s.num_fed += a;
  Advance(s);
  // The blocks past the last accepted token (the one sampled after the guesses, fed next) go back.
  const int64_t keep = blocks_.BlocksFor(s.num_fed + 1);
  const int64_t cut = blocks_.Truncate(&s.blocks, keep);
  if (sliding_) sliding_->Truncate(&s.sliding_blocks, keep);  // as long as the table
  if (a < k || cut > 0) rollbacks_.push_back(Rollback{s.id, s.num_fed, static_cast<int64_t>(s.blocks.size())});
  if (options_.adaptive_speculative_tokens) {
    s.guesses = a == k ? std::min(options_.num_speculative_tokens, s.guesses + 2) : std::max(1, s.guesses - 1);
  }
  spec_.proposed += k;
  spec_.accepted += a;
  ++spec_.verifications;
  for (int64_t i = 0; i < a && i < static_cast<int64_t>(spec_.accepted_by_position.size()); ++i) {
    ++spec_.accepted_by_position[i];
  }
}

void Scheduler::Erase(Seq& s) {
  Forget(s);
  FreeBlocks(s);
  if (running_.erase(s.id)) --lanes_[s.lane].running;
  waiting_.erase(s.id);
  seqs_.erase(s.id);  // destroys s
}

void Scheduler::Remove(uint64_t id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return;
  Seq& s = *it->second;
  if (s.in_flight > 0) {
    s.removed = true;  // freed when the last step in flight that feeds it comes back
    return;
  }
  Erase(s);
}

void Scheduler::RequeueAllForRegroup() {
  freed_.clear();  // the new group's workers start empty
  rollbacks_.clear();
  for (Lane& l : lanes_) l = Lane{};
  running_.clear();
  for (auto it = seqs_.begin(); it != seqs_.end();) {
    Seq& s = *it->second;
    FreeBlocks(s);
    if (s.removed) {
      waiting_.erase(s.id);
      it = seqs_.erase(it);
      continue;
    }
    s.num_fed = 0;
    s.num_cached = 0;
    s.lane = -1;
    s.in_flight = 0;
    s.in_batch = false;
    s.stalled = false;
    s.sent = false;
    s.blocks_sent = 0;
    waiting_.insert(s.id);
    ++it;
  }
  DropPrefixCache();  // the new group's workers hold no KV: no block may be found again
}

void Scheduler::DropPrefixCache() {
  blocks_.DropCache();
  if (sliding_) sliding_->DropCache();
}

void Scheduler::Clear() {
  for (auto& [id, s] : seqs_) FreeBlocks(*s);
  DropPrefixCache();
  seqs_.clear();
  freed_.clear();  // a new group's workers start empty
  rollbacks_.clear();
  running_.clear();
  waiting_.clear();
  for (Lane& l : lanes_) l = Lane{};
}

}  // namespace shardserve
