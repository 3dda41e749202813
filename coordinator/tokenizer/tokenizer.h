// Text in, text out: a Hugging Face tokenizer.json, encoded and decoded in C++ with the same ids
// and the same text as the Hugging Face `tokenizers` library.
//
// Supported: BPE models with the pipelines Llama, Qwen2/2.5 and Mistral checkpoints use:
// byte-level BPE with the GPT-2, Llama 3 and Qwen2 pre-tokenizer regexes, and SentencePiece-style
// BPE with byte fallback (Metaspace pre-tokenizer, or Prepend + Replace normalizers), with the
// normalizers, decoders and TemplateProcessing post-processor those files use. See normalizer.h,
// pre_tokenizer.h, bpe.h and decoder.h for the exact list; a file that uses anything else fails
// to load with an Unimplemented status that names the component. A malformed file fails with
// InvalidArgument naming the field. Checkpoints with tiktoken.model instead (Kimi K2) load too,
// with the same ids as their tokenizer class computes (tiktoken.h).
//
// Encoding, as Hugging Face does it: added tokens (special or not) are found in the raw text
// first and never merged with their neighbours; each stretch between them is normalized, split
// by the pre-tokenizer and encoded by BPE; the post-processor then adds BOS/EOS when
// add_special_tokens is true. truncation and padding in tokenizer.json are ignored, as
// transformers' tokenizers ignore them unless a call asks for them.
//
// Invalid UTF-8: Hugging Face tokenizers only accepts valid Unicode text (a Rust &str; Python
// strings are converted to it), so there is no Hugging Face behaviour for invalid bytes to copy.
// Encode() rejects them with InvalidArgument naming the byte offset; a caller that wants
// replacement characters must clean the text first.
//
// Decoding matches `tokenizers`' Tokenizer.decode (not transformers' optional
// clean_up_tokenization_spaces). Ids that have no token are skipped, as Hugging Face does.
//
// Ownership and thread-safety: a Tokenizer is created once per model, is immutable afterwards
// (but for an internal, mutex-guarded cache of word encodings) and all its methods may be called
// from many threads at once. It must outlive the IncrementalDetokenizers that use it.
#ifndef SHARDSERVE_COORDINATOR_TOKENIZER_TOKENIZER_H_
#define SHARDSERVE_COORDINATOR_TOKENIZER_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "coordinator/tokenizer/string_util.h"
#include "nlohmann/json_fwd.hpp"

namespace shardserve {

namespace tokenizer_internal {
struct AddedToken;
class AddedVocabulary;
class BpeModel;
class Decoder;
class Normalizer;
class PreTokenizer;
}  // namespace tokenizer_internal

// The files a checkpoint's tokenizer is read from, as messages name them.
inline constexpr char kTokenizerFiles[] = "tokenizer.json or tiktoken.model";

// OK when `text` is valid UTF-8; otherwise InvalidArgument "not valid UTF-8: byte 0xFF at offset
// 3", naming the first byte that is not part of a well-formed sequence and its offset. Callers
// put the field's name in front. Thread-safe.
absl::Status CheckUtf8(std::string_view text);

class Tokenizer {
 public:
  // Loads tokenizer.json, tokenizer_config.json and generation_config.json (the last two
  // optional) from a checkpoint directory; without tokenizer.json, tiktoken.model with
  // tokenizer_config.json (and the class's Python file when there is one: tiktoken.h). NotFound
  // when the directory has neither.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromDirectory(const std::string& dir);
  // Builds a tokenizer from the contents of those files; empty strings stand for absent files.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(std::string_view tokenizer_json,
                                                             std::string_view tokenizer_config_json = "",
                                                             std::string_view generation_config_json = "");
  // The same from tiktoken.model's contents; `class_source` is the tokenizer class's Python file
  // (empty when absent).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromTiktoken(std::string_view tiktoken_model,
                                                                 std::string_view tokenizer_config_json,
                                                                 std::string_view generation_config_json = "",
                                                                 std::string_view class_source = "");

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // The ids of `text` (UTF-8). With add_special_tokens, the post-processor's special tokens
  // (BOS for Llama and Mistral) are added. Fails on invalid UTF-8 (see above) and, for
  // pathological inputs, if a pre-tokenizer regex exceeds PCRE2's resource limits.
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text, bool add_special_tokens = true) const;

  // The text of `ids`; with skip_special_tokens, special tokens (added tokens marked special)
  // are left out.
  std::string Decode(absl::Span<const int32_t> ids, bool skip_special_tokens = false) const;

  // One more than the largest id of the vocabulary and added tokens.
  int32_t vocab_size() const { return static_cast<int32_t>(id_to_token_.size()); }
  std::optional<int32_t> TokenToId(std::string_view token) const;
  // The token text of `id` as tokenizer.json spells it, or nullopt if `id` has none.
  std::optional<std::string_view> IdToToken(int32_t id) const;
  bool IsSpecial(int32_t id) const { return id >= 0 && id < vocab_size() && is_special_[id]; }
  // The id of `token` if the tokenizer has it as a special token (a marker a parser reads, such
  // as <think> or harmony's <|channel|>), else nullopt.
  std::optional<int32_t> SpecialTokenId(std::string_view token) const {
    const std::optional<int32_t> id = TokenToId(token);
    return id.has_value() && IsSpecial(*id) ? id : std::nullopt;
  }
  // The raw bytes token `id` adds to the decoded text in the middle of a sequence (the decoder's
  // per-token steps, decoder.h's Decoder::TokenBytes): byte-level tokens as their bytes, a byte
  // fallback token <0xXX> as its byte, so that a token may hold part of a UTF-8 character; the
  // vocabulary as constrained decoding (grammar/matcher.h's TokenizerInfo) reads it. nullopt if
  // `id` has no token; special tokens give their content.
  std::optional<std::string> TokenBytes(int32_t id) const;

  // From tokenizer_config.json's bos_token / eos_token and generation_config.json's
  // bos_token_id / eos_token_id (which may list several ids). nullopt / empty when unset.
  std::optional<int32_t> bos_id() const { return bos_id_; }
  const std::vector<int32_t>& eos_ids() const { return eos_ids_; }

 private:
  friend class IncrementalDetokenizer;

  Tokenizer();
  // FromTiktoken with tokenizer_config.json parsed (null: absent).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromTiktokenConfig(std::string_view tiktoken_model,
                                                                       const nlohmann::json& tokenizer_config,
                                                                       std::string_view generation_config_json,
                                                                       std::string_view class_source);
  // With the model, normalizer and post-processor set: makes the added vocabulary from
  // `added_tokens`, indexes the ids and reads BOS/EOS (the steps after the model, both formats).
  absl::Status AddTokensAndIndex(std::vector<tokenizer_internal::AddedToken> added_tokens,
                                 const nlohmann::json& tokenizer_config, std::string_view generation_config_json);
  // Fills the id tables below from the model and the added tokens; checks post-processor ids.
  absl::Status IndexTokens();
  // Sets bos_id_ and eos_ids_ from tokenizer_config.json (parsed; null: absent) and the contents
  // of generation_config.json (empty: absent).
  absl::Status ReadBosEos(const nlohmann::json& tokenizer_config, std::string_view generation_config_json);

  // Constant after construction.
  std::unique_ptr<tokenizer_internal::Normalizer> normalizer_;       // may be null
  std::unique_ptr<tokenizer_internal::PreTokenizer> pre_tokenizer_;  // may be null
  std::unique_ptr<tokenizer_internal::AddedVocabulary> added_;
  std::unique_ptr<tokenizer_internal::BpeModel> model_;
  std::unique_ptr<tokenizer_internal::Decoder> decoder_;
  std::vector<int32_t> prefix_ids_, suffix_ids_;  // post-processor: added around the ids
  std::vector<std::string> id_to_token_;
  std::vector<bool> has_token_;  // id_to_token_[id] is meaningful
  std::vector<bool> is_special_;
  tokenizer_internal::StringMap<int32_t> added_ids_;  // added tokens by content
  std::optional<int32_t> bos_id_;
  std::vector<int32_t> eos_ids_;
};

// Streaming decode: fed one id at a time, it returns the text that each id makes final. The
// concatenation of everything it returns, Finish() included, equals Tokenizer::Decode of the
// same ids. Text is never returned twice and never ends inside a UTF-8 character: a character
// split across tokens (byte-level BPE, byte fallback) is held back until it is complete.
//
// Not thread-safe: one per generated sequence. The Tokenizer must outlive it.
class IncrementalDetokenizer {
 public:
  // `kept`: special tokens decoded even when skip_special_tokens is true (sorted).
  IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens, absl::Span<const int32_t> kept = {});
  ~IncrementalDetokenizer();
  IncrementalDetokenizer(const IncrementalDetokenizer&) = delete;
  IncrementalDetokenizer& operator=(const IncrementalDetokenizer&) = delete;

  // Adds one id; returns the text it made final (often empty or one word).
  std::string Add(int32_t id);
  // Ends the sequence: returns what was held back (a trailing incomplete character decodes to
  // U+FFFD, as in Decode). Add() must not be called afterwards.
  std::string Finish();

 private:
  const Tokenizer& tokenizer_;
  const bool skip_special_tokens_;
  const std::vector<int32_t> kept_;  // sorted
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_TOKENIZER_TOKENIZER_H_
