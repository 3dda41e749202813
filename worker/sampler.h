// The last stage's sampler: one token per logit row of a step, from the step's [m, vocab] F32
// logits (ModelShard::logits(m), on the backend's device), as each row's RowSampling asks.
//
// Each row takes one of three paths (greedy: temperature below 1e-5, as in vLLM, so that logits / T
// cannot overflow; 0 in practice):
//   greedy, no penalty, no logprobs              -> Backend::Argmax on the device
//   temperature > 0, no min_p/penalty/logprobs   -> Backend::Sample on the device, one draw
//                                                   SampleUniform(seed, draw_index)
//   anything else (min_p, a penalty, logprobs,   -> the row on the host (copied from the device;
//   logit_bias, min_tokens not yet reached,         read in place on the CPU backend):
//   a token mask)
//     0. a token mask (constrained decoding): the disallowed ids become -inf in the working row;
//        so do the ids outside allowed_ids, then the last id of each bad word whose other ids end
//        penalty_output_ids (unless that would leave no id finite: the bans then yield);
//     1. logprobs: log-softmax of the RAW logits (normalizer in double); the top_logprobs most
//        likely ids, most likely first, ties lower id first;
//     2. logit_bias added (the sum kept within +-1e30); before min_tokens tokens, the EOS and stop
//        ids (min_tokens_banned_ids) become -inf;
//        penalties (vLLM / Hugging Face): repetition_penalty r over every distinct id of
//        penalty_prompt_ids and penalty_output_ids (logit > 0: logit / r, else logit * r, kept
//        within +-1e30); then over penalty_output_ids, logit -= frequency_penalty * count, then
//        -= presence_penalty;
//     3. greedy: Argmax of the penalized row (first maximum, as on the device);
//        else min_p (vLLM v1: after temperature, before top-k/top-p): tokens whose probability
//        under softmax(logits / T) is below min_p x the largest become -inf; then the CPU
//        backend's Sample with the same draw, so top-k/top-p and the draw rule have exactly one
//        implementation and a row with neutral extras draws what the device path draws;
//     4. the chosen token's logprob, from step 1's normalizer, and its rank (1 + the ids whose raw
//        logit is larger).
//   a scored prompt position (RowSampling.scored_id, prompt log-probabilities) takes the host path
//   for step 1 only: its id is the scored one, its logprob and rank that id's.
// Runs of consecutive device-path rows of one kind go to the backend in one call.
//
// A row whose logits hold a NaN or an infinity (Backend::FiniteRows, one pass on the device before
// any choice) takes none of the paths: it is reported in StepResult.non_finite_rows, so that the
// coordinator fails that sequence's request while the other rows of the step are sampled as usual.
//
// A draw depends only on (seed, draw_index) and the row's logits, never on the other rows.
//
// Ownership: borrows the device backend (it must outlive the Sampler); owns the ids buffer on the
// device, the host scratch (reserved at Create for max_rows rows and one vocabulary row, so a
// step does not allocate except for the protobuf fields it fills) and, when the device is not
// the CPU, a CPU backend for the host rows. Threading: not thread-safe; one step at a time, on
// the thread that uses the backend.
#ifndef SHARDSERVE_WORKER_SAMPLER_H_
#define SHARDSERVE_WORKER_SAMPLER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "kernels/backend.h"
#include "shardserve/v1/worker.pb.h"

namespace shardserve {

class Sampler {
 public:
  // For steps of up to `max_rows` logit rows over a vocabulary of `vocab_size` ids, on `device`.
  static absl::StatusOr<std::unique_ptr<Sampler>> Create(Backend* device, int64_t max_rows, int64_t vocab_size);

  // Checks the rows (CheckRowSampling, worker/step_checks.h), then samples row i of `logits`
  // ([rows.size(), vocab_size] F32 on the device) with rows[i]. Replaces result->sampled_ids with
  // one id per row and result->logprobs with, when any row asked for logprobs, one RowLogprobs per
  // row (empty for the rows that did not ask), else nothing, and result->non_finite_rows with the
  // rows whose logits are not all finite (their id 0, their logprobs empty). The logits are not
  // modified.
  //
  // Constrained decoding: `masks` is empty, or holds one entry per row: null, or the row's token
  // mask (ceil(vocab_size / 32) words, checked by CheckTokenMasks; bit id % 32 of word id / 32 set:
  // id allowed). A masked row takes the host path, where the disallowed ids become -inf before
  // logit_bias, the penalties, min_p, top-k / top-p and greedy (ApplyTokenMask); its logprobs stay
  // those of the raw logits, as every row's.
  absl::Status Sample(uint64_t step_id, const Tensor& logits,
                      const google::protobuf::RepeatedPtrField<v1::RowSampling>& rows, v1::StepResult* result,
                      const std::vector<const uint32_t*>& masks = {});

  int64_t max_rows() const { return max_rows_; }
  int64_t vocab_size() const { return vocab_size_; }

 private:
  enum class Path : uint8_t { kArgmax, kSample, kHost, kNonFinite };

  Sampler() = default;
  // Runs the device paths over rows [begin, end), all of `path`, into ids_dev_.
  absl::Status RunOnDevice(Path path, const Tensor& logits, const google::protobuf::RepeatedPtrField<v1::RowSampling>& rows,
                           int begin, int end);
  // One host-path row: its id into *id and, when asked, its logprobs into *lp.
  absl::Status SampleOnHost(uint64_t step_id, int row, const float* device_row, const v1::RowSampling& rs,
                            const uint32_t* mask, int32_t* id, v1::RowLogprobs* lp);
  // allowed_ids and the bad words that apply (RowSampling) into the working row `w`: -inf for the
  // ids not allowed, then for the banned ones unless that would leave no id finite.
  void ApplyAllowedAndBadWords(const v1::RowSampling& r, float* w);
  // The logprob of `id` under the raw row (log_normalizer: log sum exp of it) and its rank.
  void SetChosen(const float* raw, int32_t id, double log_normalizer, v1::RowLogprobs* lp) const;

  // ---- Constant after Create ----
  Backend* device_ = nullptr;
  std::unique_ptr<Backend> owned_host_;  // a CPU backend when the device is not the CPU
  Backend* host_ = nullptr;              // the CPU backend host rows use (device_ or owned_host_)
  int64_t max_rows_ = 0;
  int64_t vocab_size_ = 0;

  // ---- Scratch, sized at Create ----
  Buffer ids_dev_;                         // [max_rows] I32 on the device: device-path ids
  std::vector<int32_t> ids_host_;          // [max_rows] device-path ids, copied back
  std::vector<int32_t> host_ids_;          // [max_rows] host-path ids
  std::vector<Path> paths_;                // [max_rows]
  std::vector<int32_t> finite_;            // [max_rows] Backend::FiniteRows of the step's rows
  std::vector<SampleParams> run_params_;   // capacity max_rows: one device Sample call's rows
  std::vector<SampleParams> one_params_;   // [1]: one host row's Sample
  std::vector<float> raw_;                 // [vocab] a row copied from the device
  std::vector<float> work_;                // [vocab] the row being penalized and masked
  std::vector<int32_t> output_counts_;     // [vocab] occurrences in penalty_output_ids; zero between rows
  std::vector<uint8_t> penalized_;         // [vocab] repetition penalty applied; zero between rows
  std::vector<int32_t> banned_;            // capacity kMaxBadWordSequences: a row's bad-word bans
};

}  // namespace shardserve

#endif  // SHARDSERVE_WORKER_SAMPLER_H_
