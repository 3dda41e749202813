#include "worker/mtp_runner.h"

#include <algorithm>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "model/families/registry.h"

namespace shardserve {

StepLimits MtpRunner::MtpLimits(const StepLimits& target) { return MtpStepLimits(target); }

absl::StatusOr<std::unique_ptr<MtpRunner>> MtpRunner::Load(const WeightSource& weights, const ModelConfig& config,
                                                           WeightQuant quant, const StepLimits& limits,
                                                           ModelShard* target) {
  if (config.num_nextn_predict_layers <= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--speculative mtp needs the model's multi-token-prediction layer, but config.json's "
        "num_nextn_predict_layers is ", config.num_nextn_predict_layers, " (", config.architecture_name, ")"));
  }
  Backend* backend = target->backend();
  std::unique_ptr<MtpRunner> r(new MtpRunner());
  r->target_ = target;
  r->backend_ = backend;
  r->limits_ = MtpLimits(limits);
  r->tp_ = std::make_unique<LocalCommunicator>(backend);
  const ShardSpec spec{.first_layer = config.num_hidden_layers, .end_layer = config.num_hidden_layers + 1,
                       .tp_rank = 0, .tp_size = 1, .weight_quant = quant, .expert_parallel = false, .mtp = true};
  absl::StatusOr<std::unique_ptr<ModelShard>> shard =
      ModelShard::Load(weights, config, spec, r->limits_, backend, r->tp_.get());
  if (!shard.ok()) {
    return absl::Status(shard.status().code(),
                        absl::StrCat("multi-token-prediction layer: ", shard.status().message()));
  }
  r->shard_ = std::move(*shard);
  r->context_ = r->limits_.max_blocks_per_seq() * r->limits_.block_size;
  if (config.max_position_embeddings > 0) r->context_ = std::min(r->context_, config.max_position_embeddings);
  // The hidden rows (one waiting row a sequence slot, then the step's rows), the rows a forward
  // gathers and the guesses, as registry.h MtpRunnerBuffers declares them.
  const int64_t m = limits.max_seqs_per_step, n = r->limits_.max_tokens_per_step;
  r->table_seqs_ = m;
  for (const StepBufferDecl& b : MtpRunnerBuffers(config, backend->act_dtype(), limits)) {
    const std::string_view name = b.name;
    auto [buffer, tensor] = name == "mtp_table"      ? std::pair{&r->table_buffer_, &r->table_}
                            : name == "mtp_src_rows" ? std::pair{&r->src_rows_buffer_, &r->src_rows_}
                            : name == "mtp_ids"      ? std::pair{&r->ids_buffer_, &r->ids_}
                                                     : std::pair<Buffer*, Tensor*>{nullptr, nullptr};
    if (buffer == nullptr) return absl::InternalError(absl::StrCat("MTP buffer \"", b.name, "\" has no slot"));
    Tensor t;
    t.dtype = b.dtype;
    for (int64_t d : b.dims) t.shape[t.ndim++] = d;
    SHARDSERVE_ASSIGN_OR_RETURN(*buffer, backend->Allocate(t.bytes()));
    t.data = buffer->data();
    *tensor = t;
    r->buffer_bytes_ += t.bytes();
  }
  r->slots_.resize(m);
  for (int64_t i = m - 1; i >= 0; --i) {
    r->slots_[i].slot = static_cast<int32_t>(i);
    r->free_slots_.push_back(static_cast<int32_t>(i));
  }
  r->index_.reserve(m);
  for (std::vector<int32_t>* v :
       {&r->batch_.token_ids, &r->batch_.positions, &r->batch_.token_seq, &r->batch_.slots, &r->src_rows_host_}) {
    v->reserve(n);
  }
  r->batch_.block_tables.reserve(m * r->limits_.max_blocks_per_seq());
  r->batch_.logit_rows.reserve(m);
  r->next_.reserve(m);
  r->guessing_.reserve(m);
  r->waits_.reserve(2 * m);
  return r;
}

void MtpRunner::Clear() {
  for (Seq& s : slots_) s.waiting = false;
  free_slots_.clear();
  for (int64_t i = static_cast<int64_t>(slots_.size()) - 1; i >= 0; --i) free_slots_.push_back(static_cast<int32_t>(i));
  index_.clear();
}

absl::Status MtpRunner::Apply(const v1::StepPlan& p) {
  if (p.num_draft_tokens() < 0 || p.num_draft_tokens() > kMaxSpeculativeTokens) {
    return absl::InvalidArgumentError(absl::StrCat("step ", p.step_id(), ": num_draft_tokens ", p.num_draft_tokens(),
                                                   " outside [0, ", kMaxSpeculativeTokens, "]"));
  }
  for (uint64_t id : p.freed_seq_ids()) {
    auto it = index_.find(id);
    if (it == index_.end()) continue;
    slots_[it->second].waiting = false;
    free_slots_.push_back(it->second);
    index_.erase(it);
  }
  for (int i = 0; i < p.new_seqs_size(); ++i) {
    const uint64_t id = p.new_seqs(i).seq_id();
    if (free_slots_.empty() || index_.contains(id)) {
      return absl::InvalidArgumentError(absl::StrCat("step ", p.step_id(), ": new_seqs[", i, "]: seq ", id,
                                                     " does not fit the multi-token-prediction layer's state"));
    }
    const int32_t slot = free_slots_.back();
    free_slots_.pop_back();
    slots_[slot].waiting = false;
    index_[id] = slot;
  }
  return absl::OkStatus();
}

void MtpRunner::ClearBatch() {
  batch_.token_ids.clear();
  batch_.positions.clear();
  batch_.token_seq.clear();
  batch_.slots.clear();
  batch_.block_tables.clear();
  batch_.logit_rows.clear();
  batch_.num_seqs = 0;
  src_rows_host_.clear();
}

void MtpRunner::Add(const Seq& s, int32_t id, int32_t pos, int32_t src, bool new_row) {
  const int64_t bs = limits_.block_size, width = limits_.max_blocks_per_seq();
  if (new_row) {
    ++batch_.num_seqs;
    for (int64_t j = 0; j < width; ++j) batch_.block_tables.push_back(static_cast<int32_t>(s.slot * width + j));
  }
  batch_.token_ids.push_back(id);
  batch_.positions.push_back(pos);
  batch_.token_seq.push_back(batch_.num_seqs - 1);
  // Slot `slot`'s blocks are [slot * width, (slot + 1) * width): position pos is cell slot * width * bs + pos.
  batch_.slots.push_back(static_cast<int32_t>(s.slot * width * bs + pos));
  src_rows_host_.push_back(src);
}

absl::Status MtpRunner::Run(const Tensor& table) {
  const int64_t n = static_cast<int64_t>(batch_.positions.size()), m = static_cast<int64_t>(batch_.logit_rows.size());
  // Each token's hidden state, gathered into the layer's input.
  SHARDSERVE_RETURN_IF_ERROR(
      backend_->CopyToDevice(src_rows_.data, src_rows_host_.data(), static_cast<size_t>(n) * sizeof(int32_t)));
  Tensor hidden = shard_->hidden(n);
  SHARDSERVE_RETURN_IF_ERROR(backend_->Embedding(&hidden, table, src_rows_.Rows(0, n), 0));
  SHARDSERVE_RETURN_IF_ERROR(shard_->Forward(batch_));
  ++forwards_;
  next_.resize(static_cast<size_t>(m));  // within the capacity reserved at Load
  if (m == 0) return absl::OkStatus();
  Tensor out = ids_.Rows(0, m);
  SHARDSERVE_RETURN_IF_ERROR(backend_->Argmax(&out, shard_->logits(m)));
  return backend_->CopyToHost(next_.data(), out.data, static_cast<size_t>(m) * sizeof(int32_t));
}

absl::Status MtpRunner::Propose(const v1::StepPlan& p, const google::protobuf::RepeatedField<int32_t>& sampled,
                                google::protobuf::RepeatedField<int32_t>* draft_ids) {
  const int k = p.num_draft_tokens();
  auto lost = [&p](int row) {
    return absl::InternalError(absl::StrCat("step ", p.step_id(), ": the multi-token-prediction layer's state lost row ", row));
  };
  int64_t n = 0;
  for (int row = 0; row < p.row_num_tokens_size(); ++row) n += p.row_num_tokens(row);
  if (n == 0 || n > p.token_ids_size() || n > table_.dim(0) - table_seqs_) return lost(0);
  // The model's hidden state of every fed row, final-normed, after the waiting rows.
  Tensor step_rows = table_.Rows(table_seqs_, table_seqs_ + n);
  SHARDSERVE_RETURN_IF_ERROR(target_->FinalNormed(&step_rows, n));

  // 1. The pairs (hidden state at a position, the token after it), sequence by sequence.
  ClearBatch();
  guessing_.clear();
  waits_.clear();
  // The layer's context: pairs past it are dropped, and a row whose guesses would pass it guesses
  // nothing (padding).
  const int64_t max_pos = context_;
  int64_t t = 0, logit = 0;
  for (int row = 0; row < p.row_seq_ids_size() && row < p.row_num_tokens_size(); ++row) {
    auto it = index_.find(p.row_seq_ids(row));
    const int64_t count = p.row_num_tokens(row), start = p.row_start_positions(row);
    if (it == index_.end() || count < 1 || t + count > n) return lost(row);
    Seq& s = slots_[it->second];
    const int32_t* toks = p.token_ids().data() + t;
    int64_t pairs = count - 1;  // rows of this step with their next token: all but the last one...
    int32_t after_last = -1;    // ... unless the row samples: then the last kept one's is the sample
    if (p.row_samples(row)) {
      const int64_t samples = p.row_num_sampled_size() == 0 ? 1 : p.row_num_sampled(row);
      if (samples < 1 || samples > count || logit + samples > sampled.size()) return lost(row);
      // Scheduler::Verify's rule: the fed guesses (the row's last samples - 1 tokens) are kept
      // while the sample at the position before each equals it; then the sample after them.
      const int64_t first_guess = count - (samples - 1);
      int64_t a = 0;
      while (a < samples - 1 && sampled[static_cast<int>(logit + a)] == toks[first_guess + a]) ++a;
      after_last = sampled[static_cast<int>(logit + a)];
      logit += samples;
      pairs = first_guess + a;
      if (k > 0) {
        guessing_.push_back({.out = draft_ids->size(), .slot = s.slot, .pos = static_cast<int32_t>(start + pairs - 1)});
        for (int j = 0; j < k; ++j) draft_ids->Add(after_last);  // padding until guessed
      }
    }
    bool new_row = true;
    if (s.waiting && s.waiting_pos == start - 1 && start - 1 < max_pos) {
      Add(s, toks[0], static_cast<int32_t>(start - 1), s.slot, true);  // its waiting row, now with its next token
      new_row = false;
    }
    for (int64_t i = 0; i < pairs && start + i < max_pos; ++i) {
      const int32_t next = i + 1 < count && (after_last < 0 || i + 1 < pairs) ? toks[i + 1] : after_last;
      Add(s, next, static_cast<int32_t>(start + i), static_cast<int32_t>(table_seqs_ + t + i), new_row);
      new_row = false;
    }
    s.waiting = after_last < 0;
    if (s.waiting) {
      s.waiting_pos = static_cast<int32_t>(start + count - 1);
      waits_.push_back(s.slot);
      waits_.push_back(static_cast<int32_t>(table_seqs_ + t + count - 1));
    }
    if (after_last >= 0 && k > 0) {
      // The first guess: the logits after the row's last pair (none past the layer's context).
      if (new_row || guessing_.back().pos + k - 1 >= max_pos) {
        guessing_.pop_back();
      } else {
        batch_.logit_rows.push_back(static_cast<int32_t>(batch_.positions.size() - 1));
      }
    }
    t += count;
  }
  if (!batch_.positions.empty()) SHARDSERVE_RETURN_IF_ERROR(Run(table_));
  // The waiting rows, kept for their sequences' next rows (after the gather read the old ones).
  const int64_t H = table_.dim(1);
  const size_t row_bytes = static_cast<size_t>(H) * DTypeSize(table_.dtype);
  for (size_t i = 0; i + 1 < waits_.size(); i += 2) {
    SHARDSERVE_RETURN_IF_ERROR(backend_->CopyOnDevice(table_.Rows(waits_[i], waits_[i] + 1).data,
                                                      table_.Rows(waits_[i + 1], waits_[i + 1] + 1).data, row_bytes));
  }
  if (k == 0 || guessing_.empty()) return absl::OkStatus();

  // 2. The first guesses, then k - 1 more forwards of one token a sampling row: the layer's own
  // output hidden state at its last token and the guess before.
  for (int j = 0; j < k; ++j) {
    const size_t rows = guessing_.size();
    if (next_.size() != rows) return absl::InternalError("the multi-token-prediction layer lost its logit rows");
    for (size_t r = 0; r < rows; ++r) {
      for (int g = j; g < k; ++g) draft_ids->Set(guessing_[r].out + g, next_[r]);  // the later ones padding until guessed
    }
    if (j + 1 == k) break;
    // The hidden states after the last logit rows, into the table's step rows (read no more).
    const int64_t m = static_cast<int64_t>(rows);
    SHARDSERVE_RETURN_IF_ERROR(backend_->CopyToDevice(src_rows_.data, batch_.logit_rows.data(),
                                                      static_cast<size_t>(m) * sizeof(int32_t)));
    Tensor last = table_.Rows(table_seqs_, table_seqs_ + m);
    SHARDSERVE_RETURN_IF_ERROR(
        backend_->Embedding(&last, shard_->hidden(static_cast<int64_t>(batch_.positions.size())), src_rows_.Rows(0, m), 0));
    ClearBatch();
    for (size_t r = 0; r < rows; ++r) {
      Guessing& q = guessing_[r];
      ++q.pos;
      Add(slots_[q.slot], next_[r], q.pos, static_cast<int32_t>(table_seqs_ + r), true);
      batch_.logit_rows.push_back(static_cast<int32_t>(r));
    }
    SHARDSERVE_RETURN_IF_ERROR(Run(table_));
  }
  return absl::OkStatus();
}

}  // namespace shardserve
