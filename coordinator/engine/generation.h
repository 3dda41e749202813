// One generation request, apart from gRPC, the scheduler and the workers: its parameters, checked
// at the edge (coordinator/api/request_validation.h), and what each sampled token adds to the
// stream (its text, held back while it may be the start of a stop string; the finish reason).
//
// Threading: plain values and single-threaded objects; one Generation per request.
#ifndef SHARDSERVE_COORDINATOR_ENGINE_GENERATION_H_
#define SHARDSERVE_COORDINATOR_ENGINE_GENERATION_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "grammar/matcher.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "shardserve/v1/inference.pb.h"
#include "shardserve/v1/worker.pb.h"

namespace shardserve {

// A GenerateRequest, checked and resolved (defaults applied, text tokenized, a seed drawn) by
// PrepareGeneration (coordinator/api/request_validation.h).
struct GenerationParams {
  std::string request_id;
  std::vector<int32_t> prompt;
  int32_t max_tokens = 16;
  float temperature = 0;  // 0: greedy
  int32_t top_k = 0;
  float top_p = 1;
  float min_p = 0;               // 0: off
  float repetition_penalty = 1;  // 1: off
  float presence_penalty = 0;
  float frequency_penalty = 0;
  bool logprobs = false;
  int32_t top_logprobs = 0;
  int32_t prompt_logprobs = -1;  // -1: none; else the alternatives per prompt token (0 to 20)
  std::vector<int32_t> allowed_token_ids;          // sorted, distinct; empty: all
  std::vector<std::vector<int32_t>> bad_word_ids;  // each bad word's token sequences
  uint64_t seed = 0;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  std::vector<std::pair<int32_t, float>> logit_bias;  // (id, bias), sorted by id
  int32_t min_tokens = 0;
  std::vector<int32_t> min_tokens_banned_ids;  // with min_tokens: the EOS and stop ids, sorted
  // false: special tokens stay in the text (asked, or a tool-call format whose markers are special
  // tokens); the EOS that ends the output is never text.
  bool skip_special_tokens = true;
  // Special tokens decoded even when skip_special_tokens is true: the markers the output's parsers
  // read (a checkpoint that makes <think> a special token), sorted.
  std::vector<int32_t> kept_special_ids;
  // The stop string that ends the output is part of its text.
  bool include_stop_str_in_output = false;
  // The structured-output constraint compiled against the model's vocabulary (null: none); each
  // sequence of the request runs its own matcher over it (the engine's).
  std::shared_ptr<const grammar::CompiledGrammar> grammar;
};

// The per-row sampling parameters of every step that samples for this request (the scheduler
// fills draw_index and the penalty ids).
v1::RowSampling SamplingTemplate(const GenerationParams& params);

// Holds back the end of the streamed text while it may be the start of a stop string, and cuts
// the text where a stop string begins. Text handed out is never taken back: a stop string that
// completes later begins at or after the held text, because the longest end of the text that
// could begin one is always held. With `keep` (vLLM's include_stop_str_in_output) the stop string
// is part of the text, which is then cut where the stop string ends and held back not at all (the
// end of the text handed out is kept only to find a stop string that completes later).
class StopStringFilter {
 public:
  explicit StopStringFilter(std::vector<std::string> stops, bool keep = false);

  // Adds `text` and returns what may be streamed now. When a stop string appears, returns the
  // text before it (with `keep`, up to its end), sets *stopped, and drops the rest; add nothing
  // more then. Of stop strings that begin at once, the first listed is the one.
  std::string Add(absl::string_view text, bool* stopped);
  // The held text, at the end of a generation that did not stop on a stop string.
  std::string Flush();

 private:
  const std::vector<std::string> stops_;
  const bool keep_;
  size_t longest_ = 0;  // the longest stop string's bytes
  std::string held_;
  size_t sent_ = 0;  // with keep_: held_'s bytes already handed out
};

class Generation {
 public:
  // `params`, `eos_ids` and `tokenizer` (may be null: token ids are then streamed with empty
  // text) are borrowed and must outlive this.
  Generation(const GenerationParams& params, const std::vector<int32_t>& eos_ids, const Tokenizer* tokenizer);

  // Takes the token a sampling step produced and fills `response` (cleared first) with it, the
  // text it adds and, when it ends the generation, the finish reason and the usage. Returns true
  // when the generation is finished.
  bool Accept(int32_t id, v1::GenerateResponse* response);

  int32_t completion_tokens() const { return static_cast<int32_t>(generated_); }

 private:
  const GenerationParams& params_;
  const std::vector<int32_t>& eos_ids_;
  std::unique_ptr<IncrementalDetokenizer> detokenizer_;  // null without a tokenizer
  StopStringFilter filter_;
  int64_t generated_ = 0;  // completion tokens so far
};

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_ENGINE_GENERATION_H_
