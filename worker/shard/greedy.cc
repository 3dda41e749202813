#include "worker/shard/greedy.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace shardserve {

absl::StatusOr<std::vector<int32_t>> GreedyGenerate(ModelShard* model, const std::vector<int32_t>& prompt,
                                                    int64_t max_new_tokens,
                                                    std::vector<std::vector<float>>* step_logits) {
  const StepLimits& opt = model->limits();
  if (prompt.empty()) return absl::InvalidArgumentError("the prompt is empty");
  if (!model->is_first_stage() || !model->is_last_stage()) {
    return absl::FailedPreconditionError("GreedyGenerate needs the whole model in this process");
  }
  const int64_t total = static_cast<int64_t>(prompt.size()) + max_new_tokens;
  const int64_t blocks = (total + opt.block_size - 1) / opt.block_size;
  if (blocks > opt.max_blocks_per_seq() || blocks > opt.num_kv_blocks) {
    return absl::InvalidArgumentError(absl::StrCat(total, " tokens need ", blocks, " KV blocks of ", opt.block_size,
                                                   "; this runtime has ", std::min(opt.max_blocks_per_seq(), opt.num_kv_blocks)));
  }
  Backend* be = model->backend();
  absl::StatusOr<Buffer> next_buf = be->Allocate(sizeof(int32_t));
  if (!next_buf.ok()) return next_buf.status();
  Tensor next(next_buf->data(), DType::kI32, {1});
  const int64_t V = model->config().vocab_size;

  StepBatch b;
  b.num_seqs = 1;
  b.block_tables.assign(opt.max_blocks_per_seq(), 0);
  for (int64_t i = 0; i < blocks; ++i) b.block_tables[i] = static_cast<int32_t>(i);  // slot == position
  // The sliding layers' own pool, where the shard has one, as a ring: block i of the sequence in
  // block i % num_sliding_kv_blocks, which overwrites blocks only once they lie wholly before the
  // window, when the pool holds the window and a step (model/kv_blocks.h KvBlocksHeld).
  const int64_t ring = opt.num_sliding_kv_blocks;
  if (ring > 0) {
    b.sliding_block_tables.assign(opt.max_blocks_per_seq(), 0);
    for (int64_t i = 0; i < blocks; ++i) b.sliding_block_tables[i] = static_cast<int32_t>(i % ring);
  }

  std::vector<int32_t> out;
  std::vector<int32_t> pending(prompt);  // tokens not yet in the cache
  int64_t pos = 0;
  while (static_cast<int64_t>(out.size()) < max_new_tokens) {
    // Feed pending tokens in chunks; the last chunk asks for logits of its last token.
    const int64_t chunk = std::min<int64_t>(static_cast<int64_t>(pending.size()), opt.max_tokens_per_step);
    const bool final_chunk = chunk == static_cast<int64_t>(pending.size());
    b.token_ids.assign(pending.begin(), pending.begin() + chunk);
    b.positions.resize(chunk);
    b.slots.resize(chunk);
    for (int64_t t = 0; t < chunk; ++t) b.positions[t] = b.slots[t] = static_cast<int32_t>(pos + t);
    if (ring > 0) {
      b.sliding_slots.resize(chunk);
      for (int64_t t = 0; t < chunk; ++t) {
        b.sliding_slots[t] = static_cast<int32_t>((pos + t) % (ring * opt.block_size));
      }
    }
    b.token_seq.assign(chunk, 0);
    b.logit_rows.clear();
    if (final_chunk) b.logit_rows.push_back(static_cast<int32_t>(chunk - 1));
    SHARDSERVE_RETURN_IF_ERROR(model->Forward(b));
    pos += chunk;
    pending.erase(pending.begin(), pending.begin() + chunk);
    if (!final_chunk) continue;

    Tensor logits = model->logits(1);
    // A NaN or an infinity among the logits is the model overflowing on this input: an error, not a token.
    int32_t finite = 0;
    SHARDSERVE_RETURN_IF_ERROR(be->FiniteRows(&next, logits));
    SHARDSERVE_RETURN_IF_ERROR(be->CopyToHost(&finite, next.data, sizeof(finite)));
    if (finite == 0) {
      return absl::InternalError(absl::StrCat("the model's logits after ", pos, " tokens (", out.size(),
                                              " generated) are not finite (NaN or infinity): its arithmetic overflowed "
                                              "on this input"));
    }
    SHARDSERVE_RETURN_IF_ERROR(be->Argmax(&next, logits));
    int32_t id = 0;
    SHARDSERVE_RETURN_IF_ERROR(be->CopyToHost(&id, next.data, sizeof(id)));
    if (step_logits != nullptr) {
      step_logits->emplace_back(V);
      SHARDSERVE_RETURN_IF_ERROR(be->CopyToHost(step_logits->back().data(), logits.data, V * sizeof(float)));
    }
    out.push_back(id);
    pending.push_back(id);
  }
  return out;
}

}  // namespace shardserve
