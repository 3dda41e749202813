#include "worker/draft_runner.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shardserve {

DraftRunner::DraftRunner(std::unique_ptr<DraftModel> model, const StepLimits& target, int64_t vocab_size,
                         int64_t max_positions)
    : model_(std::move(model)), limits_(DraftStepLimits(target)), vocab_size_(vocab_size) {
  const int64_t m = std::max<int64_t>(0, limits_.max_seqs_per_step);
  const int64_t len = limits_.max_blocks_per_seq() * limits_.block_size;
  max_positions_ = std::min(max_positions, len);
  slots_.resize(m);
  work_.resize(m);
  for (int64_t i = m - 1; i >= 0; --i) {
    slots_[i].fed.reserve(len);
    slots_[i].held.reserve(len);
    slots_[i].blocks.reserve(limits_.max_blocks_per_seq());
    work_[i].pending.reserve(len);
  }
  pool_.Init(limits_.num_kv_blocks, limits_.block_size);
  Clear();
  index_.reserve(m);
  const int64_t n = limits_.max_tokens_per_step;
  for (std::vector<int32_t>* v : {&batch_.token_ids, &batch_.positions, &batch_.token_seq, &batch_.slots}) v->reserve(n);
  batch_.block_tables.reserve(m * limits_.max_blocks_per_seq());
  batch_.logit_rows.reserve(m);
  next_.reserve(m);
  batch_rows_.reserve(m);
}

void DraftRunner::Clear() {
  for (Seq& s : slots_) {
    s.fed.clear();
    s.held.clear();
    s.blocks.clear();
  }
  free_slots_.clear();
  for (int64_t i = static_cast<int64_t>(slots_.size()) - 1; i >= 0; --i) free_slots_.push_back(static_cast<int32_t>(i));
  pool_.Reset();
  index_.clear();
}

bool DraftRunner::Cover(Seq& s, int64_t tokens) { return pool_.Cover(&s.blocks, tokens); }

void DraftRunner::Cut(Seq& s, int64_t tokens) {
  s.held.resize(std::min(s.held.size(), static_cast<size_t>(tokens)));
  pool_.Cut(&s.blocks, tokens);
}

std::vector<int32_t> DraftRunner::fed(uint64_t seq) const {
  auto it = index_.find(seq);
  return it == index_.end() ? std::vector<int32_t>{} : slots_[it->second].fed;
}

std::vector<int32_t> DraftRunner::held(uint64_t seq) const {
  auto it = index_.find(seq);
  return it == index_.end() ? std::vector<int32_t>{} : slots_[it->second].held;
}

absl::Status DraftRunner::Apply(const v1::StepPlan& p) {
  auto bad = [&p](auto... parts) { return absl::InvalidArgumentError(absl::StrCat("step ", p.step_id(), ": ", parts...)); };
  if (p.num_draft_tokens() < 0 || p.num_draft_tokens() > kMaxSpeculativeTokens) {
    return bad("num_draft_tokens ", p.num_draft_tokens(), " outside [0, ", kMaxSpeculativeTokens, "]");
  }
  // As PersistentBatch::Apply, which checked the plan: freed, rolled back, new, then the rows.
  for (uint64_t id : p.freed_seq_ids()) {
    auto it = index_.find(id);
    if (it == index_.end()) continue;
    Seq& s = slots_[it->second];
    s.fed.clear();
    Cut(s, 0);
    free_slots_.push_back(it->second);
    index_.erase(it);
  }
  for (int i = 0; i < p.rollback_seq_ids_size() && i < p.rollback_num_tokens_size(); ++i) {
    auto it = index_.find(p.rollback_seq_ids(i));
    if (it == index_.end()) continue;
    std::vector<int32_t>& fed = slots_[it->second].fed;
    fed.resize(std::min<size_t>(fed.size(), static_cast<size_t>(std::max(0, p.rollback_num_tokens(i)))));
  }
  for (int i = 0; i < p.new_seqs_size(); ++i) {
    const v1::NewSeq& n = p.new_seqs(i);
    if (n.cached_token_ids_size() != n.num_cached_tokens()) {
      return bad("new_seqs[", i, "]: seq ", n.seq_id(), " has num_cached_tokens ", n.num_cached_tokens(), " but ",
                 n.cached_token_ids_size(), " cached_token_ids; the draft model needs every token of the sequence");
    }
    for (int32_t id : n.cached_token_ids()) {
      if (id < 0 || id >= vocab_size_) {
        return bad("new_seqs[", i, "]: seq ", n.seq_id(), " cached token id ", id, " outside the vocabulary [0, ",
                   vocab_size_, ")");
      }
    }
    if (free_slots_.empty() || index_.contains(n.seq_id()) ||
        n.num_cached_tokens() > static_cast<int64_t>(slots_[free_slots_.back()].fed.capacity())) {
      return bad("new_seqs[", i, "]: seq ", n.seq_id(), " does not fit the draft model's state");
    }
    const int32_t slot = free_slots_.back();
    free_slots_.pop_back();
    Seq& s = slots_[slot];
    s.fed.assign(n.cached_token_ids().begin(), n.cached_token_ids().end());
    Cut(s, 0);
    index_[n.seq_id()] = slot;
  }
  int64_t t = 0;
  for (int row = 0; row < p.row_seq_ids_size() && row < p.row_num_tokens_size(); ++row) {
    auto it = index_.find(p.row_seq_ids(row));
    const int64_t count = p.row_num_tokens(row);
    if (it == index_.end() || count < 0 || t + count > p.token_ids_size()) {
      return absl::InternalError(absl::StrCat("step ", p.step_id(), ": the draft model's state lost row ", row));
    }
    std::vector<int32_t>& fed = slots_[it->second].fed;
    if (static_cast<int64_t>(fed.size()) != p.row_start_positions(row) ||
        static_cast<int64_t>(fed.size()) + count > static_cast<int64_t>(fed.capacity())) {
      return absl::InternalError(absl::StrCat("step ", p.step_id(), ": row ", row, " starts at ",
                                              p.row_start_positions(row), " but the draft model's state has ",
                                              fed.size(), " tokens"));
    }
    fed.insert(fed.end(), p.token_ids().begin() + t, p.token_ids().begin() + t + count);
    t += count;
  }
  return absl::OkStatus();
}

void DraftRunner::ClearBatch() {
  batch_.Clear();
  batch_rows_.clear();
}

void DraftRunner::AddRow(Seq& s, const int32_t* ids, int64_t n, bool logit) {
  const int64_t bs = limits_.block_size, width = limits_.max_blocks_per_seq();
  const int32_t row = batch_.num_seqs++;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = static_cast<int64_t>(s.held.size());
    batch_.token_ids.push_back(ids[i]);
    batch_.positions.push_back(static_cast<int32_t>(pos));
    batch_.token_seq.push_back(row);
    batch_.slots.push_back(static_cast<int32_t>(s.blocks[pos / bs] * bs + pos % bs));  // Cover gave the block
    s.held.push_back(ids[i]);
  }
  batch_.block_tables.insert(batch_.block_tables.end(), s.blocks.begin(), s.blocks.end());
  batch_.block_tables.resize(static_cast<size_t>((row + 1) * width), 0);
  if (logit) batch_.logit_rows.push_back(static_cast<int32_t>(batch_.token_ids.size() - 1));
}

absl::Status DraftRunner::Propose(const v1::StepPlan& p, const google::protobuf::RepeatedField<int32_t>& sampled,
                                  google::protobuf::RepeatedField<int32_t>* draft_ids) {
  const int k = p.num_draft_tokens();
  if (k <= 0) return absl::OkStatus();
  // 1. Every row that samples: the sequence's tokens once the coordinator has verified this step
  // (Scheduler::Verify), and what the draft must feed to catch up with them.
  size_t rows = 0;
  int64_t logit = 0;
  for (int row = 0; row < p.row_seq_ids_size(); ++row) {
    if (!p.row_samples(row)) continue;
    const int64_t samples = p.row_num_sampled_size() == 0 ? 1 : p.row_num_sampled(row);
    auto it = index_.find(p.row_seq_ids(row));
    if (it == index_.end() || samples < 1 || logit + samples > sampled.size() || rows >= work_.size()) {
      return absl::InternalError(absl::StrCat("step ", p.step_id(), ": the draft model's state lost row ", row));
    }
    Seq& s = slots_[it->second];
    // The proposed tokens fed are the row's last samples - 1; each is kept while the sample at the
    // position before it equals it, and the sample after the last kept one follows.
    const int64_t first = static_cast<int64_t>(s.fed.size()) - (samples - 1);
    int64_t a = 0;
    while (a < samples - 1 && sampled[static_cast<int>(logit + a)] == s.fed[first + a]) ++a;
    const int32_t bonus = sampled[static_cast<int>(logit + a)];
    logit += samples;
    const int64_t kept = first + a;  // then bonus: kept + 1 tokens
    // The longest prefix of them whose KV the draft holds; the last token is always fed (its
    // logits give the first guess).
    int64_t common = 0;
    const int64_t most = std::min<int64_t>(static_cast<int64_t>(s.held.size()), kept);
    while (common < most && s.held[common] == s.fed[common]) ++common;
    Cut(s, common);
    Work& w = work_[rows++];
    w.seq = &s;
    w.pending.assign(s.fed.begin() + common, s.fed.begin() + kept);
    w.pending.push_back(bonus);
    w.from = 0;
    w.out = draft_ids->size();
    // Its blocks for the tokens and the guesses fed after them (k - 1), within the draft's context;
    // with too few free blocks (sequences that share a cached prefix in the model's cache each hold
    // their own copy here) it gets no guesses this step.
    w.active = kept + 1 <= max_positions_ && Cover(s, std::min<int64_t>(kept + k, max_positions_));
    if (!w.active) ++starved_;
    for (int j = 0; j < k; ++j) draft_ids->Add(bonus);  // padding until guessed
  }
  // 2. Catch up: while the missing tokens exceed a step, feed all but each row's last in chunks.
  const int64_t budget = limits_.max_tokens_per_step;
  for (;;) {
    int64_t total = 0;
    for (size_t r = 0; r < rows; ++r) {
      if (work_[r].active) total += static_cast<int64_t>(work_[r].pending.size()) - work_[r].from;
    }
    if (total <= budget) break;
    ClearBatch();
    int64_t left = budget;
    for (size_t r = 0; r < rows && left > 0; ++r) {
      Work& w = work_[r];
      const int64_t c = std::min<int64_t>(static_cast<int64_t>(w.pending.size()) - 1 - w.from, left);
      if (!w.active || c <= 0) continue;
      AddRow(*w.seq, w.pending.data() + w.from, c, false);
      w.from += c;
      left -= c;
    }
    next_.clear();
    absl::Status st = model_->Forward(batch_, &next_);
    ++forwards_;
    if (!st.ok()) return st;
  }
  // 3. k greedy forwards, every row at once: the first feeds each row's missing tokens, the others
  // the guess before; each gives every row its next guess.
  for (int j = 0; j < k; ++j) {
    ClearBatch();
    for (size_t r = 0; r < rows; ++r) {
      Work& w = work_[r];
      if (!w.active) continue;
      const int32_t* ids = j == 0 ? w.pending.data() + w.from : draft_ids->data() + w.out + j - 1;
      const int64_t n = j == 0 ? static_cast<int64_t>(w.pending.size()) - w.from : 1;
      if (static_cast<int64_t>(w.seq->held.size()) + n > max_positions_) {
        w.active = false;  // past the draft's context: the rest stays padding
        continue;
      }
      AddRow(*w.seq, ids, n, true);
      batch_rows_.push_back(static_cast<int32_t>(r));
    }
    if (batch_.num_seqs == 0) break;
    next_.clear();
    absl::Status st = model_->Forward(batch_, &next_);
    ++forwards_;
    if (!st.ok()) return st;
    if (next_.size() != batch_rows_.size()) {
      return absl::InternalError(absl::StrCat("the draft model gave ", next_.size(), " ids for ", batch_rows_.size(),
                                              " rows"));
    }
    for (size_t i = 0; i < batch_rows_.size(); ++i) {
      const Work& w = work_[batch_rows_[i]];
      for (int g = j; g < k; ++g) draft_ids->Set(w.out + g, next_[i]);  // the later ones are padding until guessed
    }
  }
  return absl::OkStatus();
}

}  // namespace shardserve
