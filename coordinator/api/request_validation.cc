#include "coordinator/api/request_validation.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "base/field_error.h"
#include "base/status_macros.h"
#include "model/sampling_bounds.h"

namespace shardserve {
namespace {

constexpr int32_t kDefaultMaxTokens = 16;
// Bounds on a request's stop conditions and id: far above any real use, low enough that a
// request cannot make each token's checks expensive.
constexpr int kMaxStops = 16;
constexpr size_t kMaxStopBytes = 256;
constexpr int kMaxStopTokenIds = 256;
constexpr size_t kMaxRequestIdBytes = 128;

// InvalidArgument "field: what", carrying the field (base/field_error.h).
absl::Status Invalid(absl::string_view field, absl::string_view what) { return FieldErrorStatus(field, what); }

// At most `most` ids, each inside the vocabulary, appended to `out`; else InvalidArgument naming
// `field` (and the id's index).
absl::Status TakeTokenIds(const google::protobuf::RepeatedField<int32_t>& ids, absl::string_view field, int64_t most,
                          int64_t vocab, std::vector<int32_t>* out) {
  if (ids.size() > most) return Invalid(field, absl::StrCat("at most ", most, " ids, got ", ids.size()));
  for (int i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab) {
      return Invalid(absl::StrCat(field, "[", i, "]"),
                     absl::StrCat(ids[i], " is outside the vocabulary [0, ", vocab, ")"));
    }
    out->push_back(ids[i]);
  }
  return absl::OkStatus();
}

}  // namespace

bool IsValidRequestId(absl::string_view id) {
  return id.size() <= kMaxRequestIdBytes && std::all_of(id.begin(), id.end(), [](char c) { return c > ' ' && c < 127; });
}

absl::Status CheckRequestId(absl::string_view field, absl::string_view id) {
  if (IsValidRequestId(id)) return absl::OkStatus();
  return Invalid(field, absl::StrCat("at most ", kMaxRequestIdBytes, " printable characters without spaces"));
}

absl::Status CheckTokenizedPrompt(absl::string_view field, const std::vector<int32_t>& ids, const ServedModel& model) {
  const int64_t vocab = model.config.vocab_size;
  for (int32_t id : ids) {
    if (id >= vocab) {
      const std::string token(model.tokenizer == nullptr ? "" : model.tokenizer->IdToToken(id).value_or(""));
      return Invalid(field, absl::StrCat("it holds the token '", token, "' (id ", id,
                                         "), outside the model's vocabulary [0, ", vocab, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<GenerationParams> PrepareGeneration(const v1::GenerateRequest& request, const ServedModel& model,
                                                   int64_t max_model_len, const std::string& default_request_id) {
  GenerationParams p;
  const int64_t vocab = model.config.vocab_size;

  if (absl::Status s = CheckRequestId("request_id", request.request_id()); !s.ok()) return s;
  p.request_id = request.request_id().empty() ? default_request_id : request.request_id();

  switch (request.prompt_case()) {
    case v1::GenerateRequest::kText: {
      // The text is bytes on the wire (a proto3 string would fail to parse, and gRPC would answer
      // INTERNAL with no message): checked here, whatever the model, naming the offending byte.
      if (absl::Status utf8 = CheckUtf8(request.text()); !utf8.ok()) return Invalid("prompt.text", utf8.message());
      if (model.tokenizer == nullptr) {
        return Invalid("prompt.text", absl::StrCat(model.NoTokenizer(),
                                                   ", so it takes token ids only: send prompt.token_ids"));
      }
      absl::StatusOr<std::vector<int32_t>> ids = model.tokenizer->Encode(request.text(), /*add_special_tokens=*/true);
      if (!ids.ok()) return Invalid("prompt.text", ids.status().message());
      SHARDSERVE_RETURN_IF_ERROR(CheckTokenizedPrompt("prompt.text", *ids, model));
      p.prompt = std::move(*ids);
      break;
    }
    case v1::GenerateRequest::kTokenIds:
      p.prompt.assign(request.token_ids().ids().begin(), request.token_ids().ids().end());
      for (int i = 0; i < request.token_ids().ids_size(); ++i) {
        const int32_t id = request.token_ids().ids(i);
        if (id < 0 || id >= vocab) {
          return Invalid(absl::StrCat("prompt.token_ids.ids[", i, "]"),
                         absl::StrCat(id, " is outside the vocabulary [0, ", vocab, ")"));
        }
      }
      break;
    case v1::GenerateRequest::PROMPT_NOT_SET:
      return Invalid("prompt", "set text or token_ids");
  }
  if (p.prompt.empty()) return Invalid("prompt", "it has no tokens");
  const v1::SamplingParams& s = request.sampling();
  if (s.truncate_prompt_tokens() < 0) {
    return Invalid("sampling.truncate_prompt_tokens",
                   absl::StrCat("must be >= 1 (0 means off), got ", s.truncate_prompt_tokens()));
  }
  if (s.truncate_prompt_tokens() > 0 && p.prompt.size() > static_cast<size_t>(s.truncate_prompt_tokens())) {
    p.prompt.erase(p.prompt.begin(), p.prompt.end() - s.truncate_prompt_tokens());
  }
  // A prompt that alone fills the context leaves no room for a generated token, whatever
  // max_tokens says: the prompt is what must change.
  const int64_t prompt_tokens = static_cast<int64_t>(p.prompt.size());
  if (prompt_tokens >= max_model_len) {
    return Invalid("prompt", absl::StrCat("its ", prompt_tokens, " tokens do not fit max_model_len ", max_model_len,
                                          ": a prompt may have at most ", max_model_len - 1,
                                          " tokens, leaving room for one generated token"));
  }

  if (s.max_tokens() < 0) return Invalid("sampling.max_tokens", absl::StrCat("must be >= 0, got ", s.max_tokens()));
  p.max_tokens = s.max_tokens() == 0 ? kDefaultMaxTokens : s.max_tokens();
  const int64_t total = prompt_tokens + p.max_tokens;
  if (total > max_model_len) {
    return Invalid("sampling.max_tokens", absl::StrCat("the prompt's ", p.prompt.size(), " tokens + max_tokens ",
                                                       p.max_tokens, " = ", total, " exceed max_model_len ",
                                                       max_model_len));
  }
  if (!(std::isfinite(s.temperature()) && s.temperature() >= 0)) {
    return Invalid("sampling.temperature", absl::StrCat("must be >= 0, got ", s.temperature()));
  }
  if (s.top_k() < 0) return Invalid("sampling.top_k", absl::StrCat("must be >= 0, got ", s.top_k()));
  if (!(std::isfinite(s.top_p()) && s.top_p() >= 0 && s.top_p() <= 1)) {
    return Invalid("sampling.top_p", absl::StrCat("must be in [0, 1], got ", s.top_p()));
  }
  if (!(std::isfinite(s.min_p()) && s.min_p() >= 0 && s.min_p() <= 1)) {
    return Invalid("sampling.min_p", absl::StrCat("must be in [0, 1], got ", s.min_p()));
  }
  if (!(std::isfinite(s.repetition_penalty()) && s.repetition_penalty() >= 0 &&
        s.repetition_penalty() <= kMaxRepetitionPenalty)) {
    return Invalid("sampling.repetition_penalty",
                   absl::StrCat("must be in (0, ", kMaxRepetitionPenalty, "] (0 means off), got ", s.repetition_penalty()));
  }
  for (auto [field, value] : {std::pair{"sampling.presence_penalty", s.presence_penalty()},
                              {"sampling.frequency_penalty", s.frequency_penalty()}}) {
    if (!(std::isfinite(value) && value >= -kMaxAbsPresenceFrequencyPenalty &&
          value <= kMaxAbsPresenceFrequencyPenalty)) {
      return Invalid(field, absl::StrCat("must be in [", -kMaxAbsPresenceFrequencyPenalty, ", ",
                                         kMaxAbsPresenceFrequencyPenalty, "], got ", value));
    }
  }
  if (s.top_logprobs() < 0 || s.top_logprobs() > kMaxTopLogprobs) {
    return Invalid("sampling.top_logprobs", absl::StrCat("must be in [0, ", kMaxTopLogprobs, "], got ", s.top_logprobs()));
  }
  if (s.top_logprobs() > 0 && !s.logprobs()) {
    return Invalid("sampling.top_logprobs", "needs sampling.logprobs");
  }
  if (s.has_prompt_logprobs() && (s.prompt_logprobs() < 0 || s.prompt_logprobs() > kMaxTopLogprobs)) {
    return Invalid("sampling.prompt_logprobs",
                   absl::StrCat("must be in [0, ", kMaxTopLogprobs, "], got ", s.prompt_logprobs()));
  }
  p.prompt_logprobs = s.has_prompt_logprobs() ? s.prompt_logprobs() : -1;
  p.temperature = s.temperature();
  p.top_k = s.top_k();
  p.top_p = s.top_p() == 0 ? 1.0f : s.top_p();
  p.min_p = s.min_p();
  p.repetition_penalty = s.repetition_penalty() == 0 ? 1.0f : s.repetition_penalty();
  p.presence_penalty = s.presence_penalty();
  p.frequency_penalty = s.frequency_penalty();
  p.logprobs = s.logprobs();
  p.top_logprobs = s.top_logprobs();
  p.seed = s.has_seed() ? s.seed() : absl::Uniform<uint64_t>(absl::BitGen());

  if (s.stop_size() > kMaxStops) return Invalid("sampling.stop", absl::StrCat("at most ", kMaxStops, " strings"));
  if (s.stop_size() > 0 && model.tokenizer == nullptr) {
    return Invalid("sampling.stop", absl::StrCat(model.NoTokenizer(),
                                                 ", so there is no text to match; use stop_token_ids"));
  }
  for (int i = 0; i < s.stop_size(); ++i) {
    if (s.stop(i).empty() || s.stop(i).size() > kMaxStopBytes) {
      return Invalid(absl::StrCat("sampling.stop[", i, "]"), absl::StrCat("must be 1 to ", kMaxStopBytes, " bytes"));
    }
    // Matched against the decoded text, which is valid UTF-8: invalid bytes could never match.
    if (absl::Status utf8 = CheckUtf8(s.stop(i)); !utf8.ok()) {
      return Invalid(absl::StrCat("sampling.stop[", i, "]"), utf8.message());
    }
    p.stop.push_back(s.stop(i));
  }
  SHARDSERVE_RETURN_IF_ERROR(
      TakeTokenIds(s.stop_token_ids(), "sampling.stop_token_ids", kMaxStopTokenIds, vocab, &p.stop_token_ids));
  p.ignore_eos = s.ignore_eos();
  p.include_stop_str_in_output = s.include_stop_str_in_output();
  p.skip_special_tokens = !s.has_skip_special_tokens() || s.skip_special_tokens();

  if (s.logit_bias_size() > kMaxLogitBiasEntries) {
    return Invalid("sampling.logit_bias",
                   absl::StrCat("at most ", kMaxLogitBiasEntries, " token ids, got ", s.logit_bias_size()));
  }
  for (const auto& [id, bias] : s.logit_bias()) {
    if (id < 0 || id >= vocab) {
      return Invalid("sampling.logit_bias", absl::StrCat("token id ", id, " is outside the vocabulary [0, ", vocab, ")"));
    }
    if (!(std::isfinite(bias) && bias >= -kMaxAbsLogitBias && bias <= kMaxAbsLogitBias)) {
      return Invalid("sampling.logit_bias", absl::StrCat("the bias of token id ", id, " must be in [", -kMaxAbsLogitBias,
                                                         ", ", kMaxAbsLogitBias, "], got ", bias));
    }
    p.logit_bias.emplace_back(id, bias);
  }
  std::sort(p.logit_bias.begin(), p.logit_bias.end());  // the map's order is not the wire's
  if (s.min_tokens() < 0 || s.min_tokens() > p.max_tokens) {
    return Invalid("sampling.min_tokens",
                   absl::StrCat("must be in [0, max_tokens ", p.max_tokens, "], got ", s.min_tokens()));
  }
  p.min_tokens = s.min_tokens();
  if (p.min_tokens > 0) {
    // What ends a generation cannot be sampled before min_tokens: the EOS ids and stop ids.
    if (!p.ignore_eos) p.min_tokens_banned_ids = model.eos_ids;
    p.min_tokens_banned_ids.insert(p.min_tokens_banned_ids.end(), p.stop_token_ids.begin(), p.stop_token_ids.end());
    std::sort(p.min_tokens_banned_ids.begin(), p.min_tokens_banned_ids.end());
    p.min_tokens_banned_ids.erase(std::unique(p.min_tokens_banned_ids.begin(), p.min_tokens_banned_ids.end()),
                                  p.min_tokens_banned_ids.end());
  }
  SHARDSERVE_RETURN_IF_ERROR(TakeTokenIds(s.allowed_token_ids(), "sampling.allowed_token_ids", kMaxAllowedTokenIds,
                                          vocab, &p.allowed_token_ids));
  std::sort(p.allowed_token_ids.begin(), p.allowed_token_ids.end());
  p.allowed_token_ids.erase(std::unique(p.allowed_token_ids.begin(), p.allowed_token_ids.end()),
                            p.allowed_token_ids.end());
  // min_tokens must leave an id to choose until it is reached.
  if (!p.allowed_token_ids.empty() &&
      std::includes(p.min_tokens_banned_ids.begin(), p.min_tokens_banned_ids.end(), p.allowed_token_ids.begin(),
                    p.allowed_token_ids.end())) {
    return Invalid("sampling.allowed_token_ids", "allows only ids that min_tokens bans (the EOS and stop ids)");
  }
  if (s.bad_words_size() > kMaxBadWords) {
    return Invalid("sampling.bad_words", absl::StrCat("at most ", kMaxBadWords, " words, got ", s.bad_words_size()));
  }
  if (s.bad_words_size() > 0 && model.tokenizer == nullptr) {
    return Invalid("sampling.bad_words",
                   absl::StrCat(model.NoTokenizer(), " to tokenize them"));
  }
  for (int i = 0; i < s.bad_words_size(); ++i) {
    const std::string field = absl::StrCat("sampling.bad_words[", i, "]");
    const std::string& word = s.bad_words(i);
    if (word.empty() || word.size() > static_cast<size_t>(kMaxBadWordBytes)) {
      return Invalid(field, absl::StrCat("must be 1 to ", kMaxBadWordBytes, " bytes"));
    }
    if (absl::Status utf8 = CheckUtf8(word); !utf8.ok()) return Invalid(field, utf8.message());
    // The word as it stands (leading spaces dropped) and after a space (a word inside text), the
    // second where its tokens differ. vLLM keeps the second only when it has as many tokens as the
    // first: "house" as two tokens would then leave " house" (one) allowed.
    const std::string bare(absl::StripLeadingAsciiWhitespace(word));
    std::vector<int32_t> first;
    for (const bool space : {false, true}) {
      absl::StatusOr<std::vector<int32_t>> ids = model.tokenizer->Encode(space ? " " + bare : bare, false);
      if (!ids.ok()) return Invalid(field, ids.status().message());
      if (ids->empty()) {
        if (space) break;
        return Invalid(field, "it has no tokens");
      }
      if (ids->size() > static_cast<size_t>(kMaxBadWordTokens)) {
        return Invalid(field, absl::StrCat("it has ", ids->size(), " tokens; at most ", kMaxBadWordTokens));
      }
      if (!space) {
        first = *ids;
      } else if (*ids == first) {
        break;
      }
      p.bad_word_ids.push_back(*std::move(ids));
    }
  }
  if (s.has_structured_output()) {
    const std::string field = StructuredOutputField(s.structured_output());
    if (!p.allowed_token_ids.empty()) {
      return Invalid("sampling.allowed_token_ids", "cannot be combined with a structured output constraint");
    }
    // The grammar decides where the output ends (an EOS where it may end): nothing may forbid that.
    if (p.ignore_eos) return Invalid("sampling.ignore_eos", "cannot be combined with a structured output constraint");
    if (p.min_tokens > 0) return Invalid("sampling.min_tokens", "cannot be combined with a structured output constraint");
    if (model.structured == nullptr) return Invalid(field, "structured outputs are not available for this model");
    absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>> compiled = model.structured->Get(s.structured_output());
    if (!compiled.ok()) {
      if (compiled.status().code() == absl::StatusCode::kInvalidArgument) return compiled.status();
      return Invalid(field, compiled.status().message());
    }
    p.grammar = *std::move(compiled);
  }
  return p;
}

}  // namespace shardserve
