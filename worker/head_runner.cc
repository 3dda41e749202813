#include "worker/head_runner.h"

#include <algorithm>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "model/families/registry.h"

namespace shardserve {

StepLimits HeadRunner::HeadLimits(const StepLimits& target) { return HeadStepLimits(target); }

absl::StatusOr<std::unique_ptr<HeadRunner>> HeadRunner::Load(const WeightSource& weights, const ModelConfig& config,
                                                           WeightQuant quant, const StepLimits& limits,
                                                           ModelShard* target) {
  if (config.num_nextn_predict_layers <= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--speculative mtp needs the model's multi-token-prediction layer, but config.json's "
        "num_nextn_predict_layers is ", config.num_nextn_predict_layers, " (", config.architecture_name, ")"));
  }
  std::unique_ptr<HeadRunner> r(new HeadRunner());
  r->limits_ = HeadLimits(limits);
  r->tp_ = std::make_unique<LocalCommunicator>(target->backend());
  const ShardSpec spec{.first_layer = config.num_hidden_layers, .end_layer = config.num_hidden_layers + 1,
                       .tp_rank = 0, .tp_size = 1, .weight_quant = quant, .expert_parallel = false, .mtp = true,
                       .eagle3 = false, .aux_hidden_layers = {}};
  absl::StatusOr<std::unique_ptr<ModelShard>> shard =
      ModelShard::Load(weights, config, spec, r->limits_, target->backend(), r->tp_.get());
  if (!shard.ok()) {
    return absl::Status(shard.status().code(),
                        absl::StrCat("multi-token-prediction layer: ", shard.status().message()));
  }
  r->shard_ = std::move(*shard);
  SHARDSERVE_RETURN_IF_ERROR(r->Init(config, limits, target));
  return r;
}

namespace {

// An EAGLE-3 head's tensors, with the served model's embedding where the head has none (the
// published heads share it, as vLLM and SGLang load them).
class Eagle3HeadWeights : public WeightSource {
 public:
  Eagle3HeadWeights(const WeightSource& head, const WeightSource& model, std::string model_embedding)
      : head_(head), model_(model), model_embedding_(std::move(model_embedding)) {}
  absl::Status CheckShape(const std::string& name, const std::vector<int64_t>& shape) const override {
    return Source(name, shape).CheckShape(Name(name, shape), shape);
  }
  absl::Status Read(const std::string& name, const std::vector<int64_t>& shape, const Slice& slice, DType dst_type,
                    void* dst) const override {
    return Source(name, shape).Read(Name(name, shape), shape, slice, dst_type, dst);
  }
  absl::Status ReadOnDevice(const std::string& name, const std::vector<int64_t>& shape, const Slice& slice,
                            Backend* backend, Tensor* dst) const override {
    return Source(name, shape).ReadOnDevice(Name(name, shape), shape, slice, backend, dst);
  }
  bool MakesPlainWeights() const override { return head_.MakesPlainWeights(); }

 private:
  bool FromModel(const std::string& name, const std::vector<int64_t>& shape) const {
    return name == "embed_tokens.weight" && absl::IsNotFound(head_.CheckShape(name, shape));
  }
  const WeightSource& Source(const std::string& name, const std::vector<int64_t>& shape) const {
    return FromModel(name, shape) ? model_ : head_;
  }
  std::string Name(const std::string& name, const std::vector<int64_t>& shape) const {
    return FromModel(name, shape) ? model_embedding_ : name;
  }
  const WeightSource& head_;
  const WeightSource& model_;
  const std::string model_embedding_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<HeadRunner>> HeadRunner::LoadEagle3(const std::string& head_dir, LoadFormat format,
                                                                 uint64_t dummy_seed, const WeightSource& model_weights,
                                                                 const ModelConfig& model_config, WeightQuant quant,
                                                                 const StepLimits& limits, ModelShard* target) {
  auto refuse = [&head_dir](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat("EAGLE-3 head at ", head_dir, ": ", s.message()));
  };
  absl::StatusOr<ModelConfig> config = LoadModelConfig(head_dir);
  if (!config.ok()) return refuse(config.status());
  if (!config->eagle3.has_value()) {
    return refuse(absl::FailedPreconditionError(absl::StrCat(
        "config.json's architecture is ", config->architecture_name,
        "; --speculative eagle3 takes an EAGLE-3 head (LlamaForCausalLMEagle3)")));
  }
  absl::StatusOr<std::vector<int64_t>> aux = Eagle3AuxLayers(*config, model_config);
  if (!aux.ok()) return refuse(aux.status());
  const std::vector<int64_t>& kept = target->aux_hidden_layers();
  if (*aux != kept) {
    return refuse(absl::InvalidArgumentError(absl::StrCat(
        "it reads the model's hidden states at layers ", absl::StrJoin(*aux, ", "), " but the workers keep layers ",
        absl::StrJoin(kept, ", "), " (the assignment's aux_hidden_layers)")));
  }
  absl::StatusOr<std::unique_ptr<WeightSource>> head = OpenWeightSource(head_dir, *config, format, dummy_seed);
  if (!head.ok()) return refuse(head.status());
  NoteEagle3Embedding(**head, &*config);
  const Eagle3HeadWeights weights(**head, model_weights, model_config.weight_prefix + "embed_tokens.weight");

  std::unique_ptr<HeadRunner> r(new HeadRunner());
  r->limits_ = HeadLimits(limits);
  r->tp_ = std::make_unique<LocalCommunicator>(target->backend());
  // Its embedding: the model's own table where this worker holds it whole, else a copy (or its own).
  const Tensor* shared = Eagle3SharesEmbedding(*config, target->whole_embedding() != nullptr) ? target->whole_embedding()
                                                                                              : nullptr;
  const ShardSpec spec{.first_layer = 0, .end_layer = 1, .tp_rank = 0, .tp_size = 1, .weight_quant = quant,
                       .expert_parallel = false, .mtp = false, .eagle3 = true, .aux_hidden_layers = {},
                       .embedding = shared};
  absl::StatusOr<std::unique_ptr<ModelShard>> shard =
      ModelShard::Load(weights, *config, spec, r->limits_, target->backend(), r->tp_.get());
  if (!shard.ok()) return refuse(shard.status());
  r->shard_ = std::move(*shard);
  r->eagle3_ = true;
  r->shares_embedding_ = shared != nullptr;

  // d2t: the head's id d is the model's d + d2t[d] (none: the same ids, a head over the whole vocabulary).
  const int64_t draft_vocab = config->vocab_size, vocab = model_config.vocab_size;
  r->d2t_.assign(static_cast<size_t>(draft_vocab), 0);
  if (const absl::Status has = (*head)->CheckShape("d2t", {draft_vocab}); has.ok() && !(*head)->MakesPlainWeights()) {
    SHARDSERVE_RETURN_IF_ERROR((*head)->Read("d2t", {draft_vocab}, Slice{}, DType::kI32, r->d2t_.data()));
    for (int64_t d = 0; d < draft_vocab; ++d) {
      const int64_t id = d + r->d2t_[d];
      if (id < 0 || id >= vocab) {
        return refuse(absl::InvalidArgumentError(absl::StrCat("d2t maps its id ", d, " to ", id,
                                                              ", outside the model's vocabulary of ", vocab)));
      }
    }
  } else if (!absl::IsNotFound(has) && !has.ok()) {
    return refuse(has);
  } else if (draft_vocab != vocab && !(*head)->MakesPlainWeights()) {
    return refuse(absl::FailedPreconditionError(absl::StrCat("its draft_vocab_size is ", draft_vocab, " of the model's ",
                                                             vocab, " ids but it has no d2t tensor to map them")));
  }
  SHARDSERVE_RETURN_IF_ERROR(r->Init(*config, limits, target));
  return r;
}

absl::Status HeadRunner::Init(const ModelConfig& config, const StepLimits& limits, ModelShard* target) {
  target_ = target;
  backend_ = target->backend();
  Backend* backend = backend_;
  context_ = limits_.max_blocks_per_seq() * limits_.block_size;
  // (an EAGLE-3 head follows the model's context whatever its config.json says: the published ones
  // give 2048, and vLLM runs them at the model's length)
  if (config.max_position_embeddings > 0 && !eagle3_) context_ = std::min(context_, config.max_position_embeddings);
  // The hidden rows (one waiting row a sequence slot, then the step's rows), the rows a forward
  // gathers and the guesses, as registry.h HeadRunnerBuffers declares them.
  const int64_t m = limits.max_seqs_per_step, n = limits_.max_tokens_per_step;
  table_seqs_ = m;
  for (const StepBufferDecl& b : HeadRunnerBuffers(config, backend->act_dtype(), limits)) {
    const std::string_view name = b.name;
    auto [buffer, tensor] = name == "head_table"      ? std::pair{&table_buffer_, &table_}
                            : name == "head_src_rows" ? std::pair{&src_rows_buffer_, &src_rows_}
                            : name == "head_ids"      ? std::pair{&ids_buffer_, &ids_}
                                                     : std::pair<Buffer*, Tensor*>{nullptr, nullptr};
    if (buffer == nullptr) return absl::InternalError(absl::StrCat("head buffer \"", b.name, "\" has no slot"));
    Tensor t;
    t.dtype = b.dtype;
    for (int64_t d : b.dims) t.shape[t.ndim++] = d;
    SHARDSERVE_ASSIGN_OR_RETURN(*buffer, backend->Allocate(t.bytes()));
    t.data = buffer->data();
    *tensor = t;
    buffer_bytes_ += t.bytes();
  }
  slots_.resize(m);
  for (int64_t i = m - 1; i >= 0; --i) {
    slots_[i].slot = static_cast<int32_t>(i);
    slots_[i].blocks.reserve(limits_.max_blocks_per_seq());
    free_slots_.push_back(static_cast<int32_t>(i));
  }
  pool_.Init(limits_.num_kv_blocks, limits_.block_size);
  index_.reserve(m);
  for (std::vector<int32_t>* v : {&batch_.token_ids, &batch_.positions, &batch_.token_seq, &batch_.slots, &src_rows_host_}) {
    v->reserve(n);
  }
  batch_.block_tables.reserve(m * limits_.max_blocks_per_seq());
  batch_.logit_rows.reserve(m);
  next_.reserve(m);
  guessing_.reserve(m);
  waits_.reserve(2 * m);
  return absl::OkStatus();
}

void HeadRunner::Release(Seq& s) {
  s.waiting = false;
  pool_.Cut(&s.blocks, 0);
}

void HeadRunner::Clear() {
  for (Seq& s : slots_) Release(s);
  free_slots_.clear();
  for (int64_t i = static_cast<int64_t>(slots_.size()) - 1; i >= 0; --i) free_slots_.push_back(static_cast<int32_t>(i));
  index_.clear();
}

absl::Status HeadRunner::Apply(const v1::StepPlan& p) {
  if (p.num_draft_tokens() < 0 || p.num_draft_tokens() > kMaxSpeculativeTokens) {
    return absl::InvalidArgumentError(absl::StrCat("step ", p.step_id(), ": num_draft_tokens ", p.num_draft_tokens(),
                                                   " outside [0, ", kMaxSpeculativeTokens, "]"));
  }
  for (uint64_t id : p.freed_seq_ids()) {
    auto it = index_.find(id);
    if (it == index_.end()) continue;
    Release(slots_[it->second]);
    free_slots_.push_back(it->second);
    index_.erase(it);
  }
  for (int i = 0; i < p.new_seqs_size(); ++i) {
    const uint64_t id = p.new_seqs(i).seq_id();
    if (free_slots_.empty() || index_.contains(id)) {
      return absl::InvalidArgumentError(absl::StrCat("step ", p.step_id(), ": new_seqs[", i, "]: seq ", id,
                                                     " does not fit the head's state"));
    }
    const int32_t slot = free_slots_.back();
    free_slots_.pop_back();
    Release(slots_[slot]);
    index_[id] = slot;
  }
  return absl::OkStatus();
}

void HeadRunner::ClearBatch() {
  batch_.Clear();
  src_rows_host_.clear();
}

void HeadRunner::Add(const Seq& s, int32_t id, int32_t pos, int32_t src, bool new_row) {
  const int64_t bs = limits_.block_size, width = limits_.max_blocks_per_seq();
  if (new_row) {
    ++batch_.num_seqs;
    // (the table past the sequence's blocks is never read: no position reaches it)
    for (int64_t j = 0; j < width; ++j) {
      batch_.block_tables.push_back(j < static_cast<int64_t>(s.blocks.size()) ? s.blocks[j] : 0);
    }
  }
  batch_.token_ids.push_back(id);
  batch_.positions.push_back(pos);
  batch_.token_seq.push_back(batch_.num_seqs - 1);
  batch_.slots.push_back(static_cast<int32_t>(s.blocks[pos / bs] * bs + pos % bs));
  src_rows_host_.push_back(src);
}

absl::Status HeadRunner::Run(const Tensor& table) {
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
  SHARDSERVE_RETURN_IF_ERROR(backend_->CopyToHost(next_.data(), out.data, static_cast<size_t>(m) * sizeof(int32_t)));
  // An EAGLE-3 head's ids are its own vocabulary's: the model's id is d + d2t[d].
  for (int32_t& id : next_) {
    if (eagle3_ && id >= 0 && id < static_cast<int32_t>(d2t_.size())) id += d2t_[id];
  }
  return absl::OkStatus();
}

absl::Status HeadRunner::Propose(const v1::StepPlan& p, const google::protobuf::RepeatedField<int32_t>& sampled,
                                google::protobuf::RepeatedField<int32_t>* draft_ids) {
  const int k = p.num_draft_tokens();
  auto lost = [&p](int row) {
    return absl::InternalError(absl::StrCat("step ", p.step_id(), ": the head's state lost row ", row));
  };
  if (k == 0) {
    // No guesses asked: the step's positions are holes in the head's cache, and a waiting row's
    // next token was never paired.
    for (int row = 0; row < p.row_seq_ids_size(); ++row) {
      auto it = index_.find(p.row_seq_ids(row));
      if (it == index_.end()) return lost(row);
      slots_[it->second].waiting = false;
    }
    ++idle_steps_;
    return absl::OkStatus();
  }
  int64_t n = 0;
  for (int row = 0; row < p.row_num_tokens_size(); ++row) n += p.row_num_tokens(row);
  if (n == 0 || n > p.token_ids_size() || n > table_.dim(0) - table_seqs_) return lost(0);
  // The model's hidden state of every fed row after the waiting rows: final-normed (the MTP layer's),
  // or its hidden states at the aux layers through the head's fc (an EAGLE-3 head's).
  Tensor step_rows = table_.Rows(table_seqs_, table_seqs_ + n);
  if (!eagle3_) {
    SHARDSERVE_RETURN_IF_ERROR(target_->FinalNormed(&step_rows, n));
  } else {
    SHARDSERVE_RETURN_IF_ERROR(shard_->Eagle3Input(&step_rows, target_->aux_hidden(n), n));
  }

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
      guessing_.push_back({.out = draft_ids->size(), .slot = s.slot, .pos = static_cast<int32_t>(start + pairs - 1)});
      for (int j = 0; j < k; ++j) draft_ids->Add(after_last);  // padding until guessed
    }
    // The blocks of the positions the row writes: its pairs' and, when it guesses, its guesses'. Too
    // few free (the model's cache shares prefixes this cache holds a copy of per sequence): the row
    // is skipped, which leaves a hole in this cache and the row without guesses (its padding).
    int64_t last = start + pairs - 1;
    if (after_last >= 0) last += k - 1;
    if (!pool_.Cover(&s.blocks, std::min(max_pos, last + 1))) {
      ++starved_;
      s.waiting = false;
      if (after_last >= 0) guessing_.pop_back();
      t += count;
      continue;
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
    if (after_last >= 0) {
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
  if (guessing_.empty()) return absl::OkStatus();

  // 2. The first guesses, then k - 1 more forwards of one token a sampling row: the layer's own
  // output hidden state at its last token and the guess before.
  for (int j = 0; j < k; ++j) {
    const size_t rows = guessing_.size();
    if (next_.size() != rows) return absl::InternalError("the head lost its logit rows");
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
