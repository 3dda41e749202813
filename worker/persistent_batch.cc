#include "worker/persistent_batch.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace shardserve {
namespace {

bool RepetitionOn(const v1::RowSampling& r) { return r.repetition_penalty() != 0 && r.repetition_penalty() != 1; }

// The sampler reads the generated tokens (penalty_output_ids): a penalty, or bad words to match.
bool PenaltyOn(const v1::RowSampling& r) {
  return RepetitionOn(r) || r.presence_penalty() != 0 || r.frequency_penalty() != 0 || r.bad_word_lengths_size() > 0;
}

}  // namespace

PersistentBatch::PersistentBatch(const StepLimits& limits, int64_t vocab_size, bool keep_history, bool feeds_samples)
    : limits_(limits), vocab_size_(vocab_size), keep_history_(keep_history), feeds_samples_(feeds_samples) {
  const int64_t m = std::max<int64_t>(0, limits.max_seqs_per_step);
  slots_.resize(m);
  free_slots_.reserve(m);
  for (int64_t i = m - 1; i >= 0; --i) {
    slots_[i].blocks.reserve(limits.max_blocks_per_seq());
    if (limits.num_sliding_kv_blocks > 0) slots_[i].sliding_blocks.reserve(limits.max_blocks_per_seq());
    free_slots_.push_back(static_cast<int32_t>(i));
  }
  index_.reserve(m);
  sampled_slots_.reserve(m);
}

void PersistentBatch::Clear() {
  free_slots_.clear();
  for (int64_t i = static_cast<int64_t>(slots_.size()) - 1; i >= 0; --i) {
    slots_[i] = Seq{};
    slots_[i].blocks.reserve(limits_.max_blocks_per_seq());
    if (limits_.num_sliding_kv_blocks > 0) slots_[i].sliding_blocks.reserve(limits_.max_blocks_per_seq());
    free_slots_.push_back(static_cast<int32_t>(i));
  }
  index_.clear();
  sampled_slots_.clear();
}

void PersistentBatch::RecordSamples(const google::protobuf::RepeatedField<int32_t>& sampled) {
  const int n = std::min(sampled.size(), static_cast<int>(sampled_slots_.size()));
  for (int i = 0; i < n; ++i) {
    const int32_t slot = sampled_slots_[i];
    if (slot < 0) continue;
    slots_[slot].sample = sampled[i];
    slots_[slot].sample_at = slots_[slot].fed;  // the position after the last token the row fed
  }
  sampled_slots_.clear();  // each sample is kept once
}

void PersistentBatch::Reserve(StepBatch* b) const {
  const int64_t n = limits_.max_tokens_per_step, m = limits_.max_seqs_per_step;
  for (std::vector<int32_t>* v : {&b->token_ids, &b->positions, &b->token_seq, &b->slots}) v->reserve(n);
  b->block_tables.reserve(m * limits_.max_blocks_per_seq());
  if (limits_.num_sliding_kv_blocks > 0) {
    b->sliding_slots.reserve(n);
    b->sliding_block_tables.reserve(m * limits_.max_blocks_per_seq());
  }
  b->logit_rows.reserve(m);
}

int64_t PersistentBatch::fed(uint64_t seq_id) const {
  auto it = index_.find(seq_id);
  return it == index_.end() ? -1 : slots_[it->second].fed;
}

std::vector<int32_t> PersistentBatch::blocks(uint64_t seq_id) const {
  auto it = index_.find(seq_id);
  return it == index_.end() ? std::vector<int32_t>{} : slots_[it->second].blocks;
}

std::vector<int32_t> PersistentBatch::sliding_blocks(uint64_t seq_id) const {
  auto it = index_.find(seq_id);
  return it == index_.end() ? std::vector<int32_t>{} : slots_[it->second].sliding_blocks;
}

absl::Status PersistentBatch::AppendBlocks(uint64_t step_id, Seq& s, const google::protobuf::RepeatedField<int32_t>& ids,
                                           const google::protobuf::RepeatedField<int32_t>& sliding_ids,
                                           const char* what) {
  const int64_t width = limits_.max_blocks_per_seq(), sliding_pool = limits_.num_sliding_kv_blocks;
  if (sliding_pool == 0 && !sliding_ids.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("step ", step_id, ": ", what, " gives seq ", s.id, " ",
                                                   sliding_ids.size(), " sliding_block_ids; this worker holds no "
                                                   "sliding layers' pool (num_sliding_kv_blocks 0)"));
  }
  if (sliding_pool > 0 && sliding_ids.size() != ids.size()) {
    return absl::InvalidArgumentError(absl::StrCat("step ", step_id, ": ", what, " gives seq ", s.id, " ", ids.size(),
                                                   " block_ids but ", sliding_ids.size(),
                                                   " sliding_block_ids; the sliding table must be as long"));
  }
  if (static_cast<int64_t>(s.blocks.size()) + ids.size() > width) {
    return absl::InvalidArgumentError(absl::StrCat("step ", step_id, ": ", what, " gives seq ", s.id, " ",
                                                   s.blocks.size() + ids.size(), " blocks; a table holds at most ",
                                                   width));
  }
  for (int32_t b : ids) {
    if (b < 0 || b >= limits_.num_kv_blocks) {
      return absl::InvalidArgumentError(absl::StrCat("step ", step_id, ": ", what, " gives seq ", s.id, " block ", b,
                                                     " outside [0, ", limits_.num_kv_blocks, ")"));
    }
    s.blocks.push_back(b);  // within the capacity reserved at construction
  }
  for (int32_t b : sliding_ids) {
    if (b < 0 || b >= sliding_pool) {
      return absl::InvalidArgumentError(absl::StrCat("step ", step_id, ": ", what, " gives seq ", s.id,
                                                     " sliding block ", b, " outside [0, ", sliding_pool, ")"));
    }
    s.sliding_blocks.push_back(b);  // likewise
  }
  return absl::OkStatus();
}

absl::Status PersistentBatch::Rollback(const v1::StepPlan& p) {
  const int n = p.rollback_seq_ids_size();
  auto bad = [&p](auto... parts) {
    return absl::InvalidArgumentError(absl::StrCat("step ", p.step_id(), ": ", parts...));
  };
  if (p.rollback_num_tokens_size() != n || p.rollback_num_blocks_size() != n) {
    return bad("rollback lists have ", n, " seq ids, ", p.rollback_num_tokens_size(), " token counts and ",
               p.rollback_num_blocks_size(), " block counts; they must match");
  }
  const int64_t bs = limits_.block_size;
  for (int i = 0; i < n; ++i) {
    const uint64_t id = p.rollback_seq_ids(i);
    auto it = index_.find(id);
    if (it == index_.end()) return bad("rollback_seq_ids names seq ", id, ", which this worker does not hold");
    Seq& s = slots_[it->second];
    const int64_t tokens = p.rollback_num_tokens(i), blocks = p.rollback_num_blocks(i);
    if (tokens < s.prompt_len || tokens > s.fed) {
      return bad("rollback of seq ", id, " to ", tokens, " tokens; it must lie in [prompt_len ", s.prompt_len,
                 ", fed ", s.fed, "]");
    }
    if (blocks > static_cast<int64_t>(s.blocks.size()) || blocks * bs < tokens) {
      return bad("rollback of seq ", id, " to ", blocks, " blocks; it holds ", s.blocks.size(), " and ", tokens,
                 " tokens need ", (tokens + bs - 1) / bs);
    }
    s.fed = tokens;
    s.sample_at = -1;  // its samples past `tokens` were rejected
    s.blocks.resize(static_cast<size_t>(blocks));
    if (limits_.num_sliding_kv_blocks > 0) s.sliding_blocks.resize(static_cast<size_t>(blocks));  // as long as the table
    const int64_t kept = tokens - s.prompt_len;
    if (s.sampling.penalty_output_ids_size() > kept) {
      s.sampling.mutable_penalty_output_ids()->Truncate(static_cast<int>(kept));
    }
  }
  return absl::OkStatus();
}

absl::Status PersistentBatch::Apply(const v1::StepPlan& p, StepBatch* batch,
                                    google::protobuf::RepeatedPtrField<v1::RowSampling>* sampling) {
  const uint64_t step = p.step_id();
  auto bad = [step](auto... parts) { return absl::InvalidArgumentError(absl::StrCat("step ", step, ": ", parts...)); };
  ++applied_;

  // 1. Freed sequences.
  for (uint64_t id : p.freed_seq_ids()) {
    auto it = index_.find(id);
    if (it == index_.end()) return bad("freed_seq_ids names seq ", id, ", which this worker does not hold");
    Seq& s = slots_[it->second];
    s.blocks.clear();
    s.sliding_blocks.clear();
    s.sampling.Clear();  // keeps the penalty ids' capacity
    free_slots_.push_back(it->second);
    index_.erase(it);
  }

  // 1b. Rolled back sequences (speculative decoding: proposed tokens rejected).
  SHARDSERVE_RETURN_IF_ERROR(Rollback(p));

  // 2. New sequences.
  for (int i = 0; i < p.new_seqs_size(); ++i) {
    const v1::NewSeq& n = p.new_seqs(i);
    if (index_.contains(n.seq_id())) return bad("new_seqs[", i, "]: seq ", n.seq_id(), " is already held");
    if (free_slots_.empty()) {
      return bad("new_seqs[", i, "]: seq ", n.seq_id(), " would be the ", size() + 1,
                 "th sequence held; at most max_seqs_per_step = ", limits_.max_seqs_per_step);
    }
    if (n.prompt_len() < 1 || n.prompt_len() > limits_.max_model_len) {
      return bad("new_seqs[", i, "]: seq ", n.seq_id(), " prompt_len ", n.prompt_len(), " outside [1, ",
                 limits_.max_model_len, "]");
    }
    const v1::RowSampling& r = n.sampling();
    if (r.draw_index() != 0 || r.penalty_prompt_ids_size() > 0 || r.penalty_output_ids_size() > 0 ||
        r.has_scored_id()) {
      return bad("new_seqs[", i, "]: seq ", n.seq_id(),
                 " sampling carries draw_index, penalty ids or a scored id; workers derive them");
    }
    const int32_t slot = free_slots_.back();
    Seq& s = slots_[slot];
    s.id = n.seq_id();
    s.blocks.clear();
    s.sliding_blocks.clear();
    s.fed = 0;
    s.prompt_len = n.prompt_len();
    s.repetition = RepetitionOn(r);
    s.penalty = PenaltyOn(r);
    s.last_step = 0;
    s.sample = -1;
    s.sample_at = -1;
    s.sampling.CopyFrom(r);
    absl::Status st = AppendBlocks(step, s, n.block_ids(), n.sliding_block_ids(), "new_seqs");
    if (!st.ok()) return st;
    // Its first row starts after the tokens whose KV its shared blocks hold.
    const int64_t cached = n.num_cached_tokens(), bs = limits_.block_size;
    if (cached < 0 || cached % bs != 0 || cached >= static_cast<int64_t>(s.blocks.size()) * bs) {
      return bad("new_seqs[", i, "]: seq ", n.seq_id(), " num_cached_tokens ", cached,
                 " is not a multiple of the block size ", bs, " below the ", s.blocks.size() * bs,
                 " tokens its blocks hold");
    }
    if (cached > 0 && s.penalty) {
      return bad("new_seqs[", i, "]: seq ", n.seq_id(), " has a sampling penalty on and num_cached_tokens ", cached,
                 "; the penalties need every token fed");
    }
    s.fed = cached;
    free_slots_.pop_back();
    index_[s.id] = slot;
  }

  // 3. Appended blocks.
  for (int i = 0; i < p.appended_blocks_size(); ++i) {
    const v1::SeqBlocks& a = p.appended_blocks(i);
    auto it = index_.find(a.seq_id());
    if (it == index_.end()) return bad("appended_blocks[", i, "] names seq ", a.seq_id(), ", which this worker does not hold");
    absl::Status st = AppendBlocks(step, slots_[it->second], a.block_ids(), a.sliding_block_ids(), "appended_blocks");
    if (!st.ok()) return st;
  }

  // 4. Rows.
  const int rows = p.row_seq_ids_size();
  if (p.row_start_positions_size() != rows || p.row_num_tokens_size() != rows || p.row_samples_size() != rows) {
    return bad("row lists have ", rows, " seq ids, ", p.row_start_positions_size(), " start positions, ",
               p.row_num_tokens_size(), " token counts and ", p.row_samples_size(), " sample flags; they must match");
  }
  if (p.row_num_sampled_size() != 0 && p.row_num_sampled_size() != rows) {
    return bad("row_num_sampled has ", p.row_num_sampled_size(), " counts for ", rows, " rows; one per row, or none");
  }
  if (p.row_num_scored_size() != 0 && p.row_num_scored_size() != rows) {
    return bad("row_num_scored has ", p.row_num_scored_size(), " counts for ", rows, " rows; one per row, or none");
  }
  if (p.row_feeds_sample_size() != 0 && p.row_feeds_sample_size() != rows) {
    return bad("row_feeds_sample has ", p.row_feeds_sample_size(), " flags for ", rows, " rows; one per row, or none");
  }
  if (rows < 1 || rows > limits_.max_seqs_per_step) {
    return bad(rows, " rows; a step takes 1 to ", limits_.max_seqs_per_step);
  }
  const int64_t n = p.token_ids_size();
  if (n < 1 || n > limits_.max_tokens_per_step) {
    return bad(n, " token ids; a step takes 1 to ", limits_.max_tokens_per_step);
  }
  for (int t = 0; t < n; ++t) {
    if (p.token_ids(t) < 0 || p.token_ids(t) >= vocab_size_) {
      return bad("token id ", p.token_ids(t), " outside the vocabulary [0, ", vocab_size_, ")");
    }
  }
  const int64_t width = limits_.max_blocks_per_seq(), bs = limits_.block_size;
  batch->Clear();
  batch->token_ids.assign(p.token_ids().begin(), p.token_ids().end());  // within the reserved capacity
  const bool sliding = limits_.num_sliding_kv_blocks > 0;
  batch->num_seqs = rows;
  sampling->Clear();  // keeps the elements for reuse
  sampled_slots_.clear();
  int64_t t = 0;       // the row's first token in token_ids
  int scored_at = 0;   // the row's first entry in scored_ids
  for (int row = 0; row < rows; ++row) {
    const uint64_t id = p.row_seq_ids(row);
    auto it = index_.find(id);
    if (it == index_.end()) return bad("row ", row, " names seq ", id, ", which this worker does not hold");
    Seq& s = slots_[it->second];
    if (s.last_step == applied_) return bad("row ", row, " names seq ", id, " a second time");
    s.last_step = applied_;
    const int64_t start = p.row_start_positions(row), count = p.row_num_tokens(row);
    if (start != s.fed) {
      return bad("row ", row, " starts seq ", id, " at position ", start, "; it was fed ", s.fed,
                 " tokens, so its next position is ", s.fed);
    }
    if (count < 1 || count > n - t) {
      return bad("row ", row, " feeds seq ", id, " ", count, " tokens; the step's token_ids have ", n - t,
                 " left (each row takes at least 1)");
    }
    const int64_t end = start + count;
    if (end > static_cast<int64_t>(s.blocks.size()) * bs) {
      return bad("row ", row, " feeds seq ", id, " positions up to ", end - 1, ", beyond its table of ",
                 s.blocks.size(), " blocks of ", bs, " tokens");
    }
    if (p.row_feeds_sample_size() > 0 && p.row_feeds_sample(row)) {
      if (!feeds_samples_) {
        return bad("row ", row, " feeds seq ", id, " its last sample; only the workers of a group of one stage "
                   "(which embed, and are given the samples) hold it");
      }
      if (count != 1) {
        return bad("row ", row, " feeds seq ", id, " its last sample and ", count - 1, " more tokens; such a row feeds 1");
      }
      if (s.sample_at != start) {
        return bad("row ", row, " feeds seq ", id, " its last sample at position ", start,
                   s.sample_at < 0 ? absl::StrCat("; this worker holds none for it")
                                   : absl::StrCat("; that sample is the token at position ", s.sample_at));
      }
      batch->token_ids[static_cast<size_t>(t)] = s.sample;
    }
    for (int64_t pos = start; pos < end; ++pos, ++t) {
      batch->positions.push_back(static_cast<int32_t>(pos));
      batch->token_seq.push_back(row);
      batch->slots.push_back(static_cast<int32_t>(s.blocks[pos / bs] * bs + pos % bs));
      if (sliding) batch->sliding_slots.push_back(static_cast<int32_t>(s.sliding_blocks[pos / bs] * bs + pos % bs));
      if (keep_history_) {
        if (pos < s.prompt_len) {
          if (s.repetition) s.sampling.add_penalty_prompt_ids(batch->token_ids[static_cast<size_t>(t)]);
        } else if (s.penalty) {
          s.sampling.add_penalty_output_ids(batch->token_ids[static_cast<size_t>(t)]);
        }
      }
    }
    s.fed = end;
    batch->block_tables.insert(batch->block_tables.end(), s.blocks.begin(), s.blocks.end());
    batch->block_tables.resize(static_cast<size_t>((row + 1) * width), 0);
    if (sliding) {
      batch->sliding_block_tables.insert(batch->sliding_block_tables.end(), s.sliding_blocks.begin(),
                                         s.sliding_blocks.end());
      batch->sliding_block_tables.resize(static_cast<size_t>((row + 1) * width), 0);
    }
    const int64_t sampled = p.row_num_sampled_size() == 0 ? (p.row_samples(row) ? 1 : 0) : p.row_num_sampled(row);
    if (sampled != (p.row_samples(row) ? std::max<int64_t>(sampled, 1) : 0) || sampled > count) {
      return bad("row ", row, " of seq ", id, " samples at ", sampled, " positions; a row that samples does so at 1 to ",
                 "its ", count, " tokens, one that does not at 0");
    }
    // Scored positions (prompt log-probabilities): the `scored` before the sampled ones, each
    // predicting the prompt's next token.
    const int64_t scored = p.row_num_scored_size() == 0 ? 0 : p.row_num_scored(row);
    if (scored != 0) {
      const int64_t first = end - sampled - scored;
      if (!s.sampling.has_prompt_logprobs()) {
        return bad("row ", row, " scores ", scored, " positions of seq ", id, ", which asked for no prompt logprobs");
      }
      if (scored < 0 || first < start || first + scored >= s.prompt_len) {
        return bad("row ", row, " scores ", scored, " positions of seq ", id, " before its ", sampled,
                   " sampled ones; they must lie among its ", count, " positions and each be followed by a token of "
                   "its prompt of ", s.prompt_len);
      }
      if (scored > p.scored_ids_size() - scored_at) {
        return bad("row ", row, " scores ", scored, " positions; scored_ids has ", p.scored_ids_size() - scored_at,
                   " ids left");
      }
    }
    if (static_cast<int64_t>(batch->logit_rows.size()) + scored + sampled > limits_.max_seqs_per_step) {
      return bad("the rows sample and score at more than max_seqs_per_step = ", limits_.max_seqs_per_step,
                 " positions");
    }
    for (int64_t j = 0; j < scored; ++j, ++scored_at) {
      const int32_t next = p.scored_ids(scored_at);
      if (next < 0 || next >= vocab_size_) {
        return bad("scored_ids[", scored_at, "] ", next, " is outside the vocabulary [0, ", vocab_size_, ")");
      }
      batch->logit_rows.push_back(static_cast<int32_t>(t - sampled - scored + j));
      sampled_slots_.push_back(-1);
      v1::RowSampling* r = sampling->Add();
      r->Clear();
      r->set_logprobs(true);
      r->set_top_logprobs(s.sampling.prompt_logprobs());
      r->set_scored_id(next);
    }
    for (int64_t j = 0; j < sampled; ++j) {
      // Position end - sampled + j: the tokens fed up to it count as generated (a proposal before
      // it is what the sequence would have sampled), the proposals after it do not.
      const int64_t upto = end - sampled + j + 1;
      if (upto < s.prompt_len) {
        return bad("row ", row, " samples seq ", id, " after ", upto, " tokens, inside its prompt of ", s.prompt_len);
      }
      batch->logit_rows.push_back(static_cast<int32_t>(t - sampled + j));
      sampled_slots_.push_back(j + 1 == sampled ? it->second : -1);
      v1::RowSampling* r = sampling->Add();
      r->CopyFrom(s.sampling);
      r->set_draw_index(static_cast<uint64_t>(upto - s.prompt_len));
      const int later = static_cast<int>(sampled - 1 - j);
      if (later > 0 && r->penalty_output_ids_size() >= later) {
        r->mutable_penalty_output_ids()->Truncate(r->penalty_output_ids_size() - later);
      }
    }
  }
  if (t != n) return bad("the rows feed ", t, " tokens but token_ids has ", n);
  if (scored_at != p.scored_ids_size()) {
    return bad("the rows score ", scored_at, " positions but scored_ids has ", p.scored_ids_size(), " ids");
  }
  return absl::OkStatus();
}

}  // namespace shardserve
