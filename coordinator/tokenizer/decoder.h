// The "decoder" of tokenizer.json, run as a stream: token texts go in one at a time and text
// comes out as soon as it can no longer change. Decoding a whole sequence is the same stream fed
// every token and then finished, so streamed and whole decodes agree by construction.
//
// Supported steps (alone or in a Sequence): ByteLevel, Replace, ByteFallback, Fuse, Strip,
// Metaspace. Each behaves exactly as in Hugging Face tokenizers, including its quirks:
//  - ByteLevel maps each token's characters back to bytes (a token with a character outside the
//    alphabet contributes its UTF-8 as is) and decodes all bytes lossily (U+FFFD per maximal
//    ill-formed subpart). The stream holds back a trailing incomplete UTF-8 sequence.
//  - ByteFallback turns a run of <0xXX> tokens into its text if the run is valid UTF-8, else into
//    one U+FFFD per byte. The stream holds back the whole run until a non-byte token ends it.
//  - Metaspace turns the replacement character into a space, and drops it in the first token
//    unless prepend_scheme is "never".
//  - Strip after Fuse/ByteLevel strips the start of the whole text, so the stream strips until it
//    meets a character that is not stripped.
// Steps after the first Fuse or ByteLevel see one growing text rather than tokens; there only
// Strip with stop = 0 and Fuse are supported. Anything else, and the WordPiece, BPEDecoder and
// CTC decoders, are rejected at load time with an Unimplemented status naming them.
// Without a decoder, token texts are joined with single spaces (Hugging Face's fallback).
//
// Thread-safety: a Decoder is immutable after FromJson() and may be shared; a Stream belongs to
// one decoding and is not thread-safe.
#ifndef SHARDSERVE_COORDINATOR_TOKENIZER_DECODER_H_
#define SHARDSERVE_COORDINATOR_TOKENIZER_DECODER_H_

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/tokenizer/json_util.h"
#include "coordinator/tokenizer/pattern.h"

namespace shardserve::tokenizer_internal {

class Decoder {
 public:
  // `config` is tokenizer.json's "decoder": an object, or null for none.
  static absl::StatusOr<std::unique_ptr<Decoder>> FromJson(const Json& config);

  // What one decoding holds back between tokens.
  class Stream {
   public:
    explicit Stream(const Decoder& decoder) : states_(decoder.stages_.size()) {}

   private:
    friend class Decoder;
    struct StageState {
      std::string held;   // ByteLevel: incomplete UTF-8 tail; ByteFallback: bytes of the run
      size_t count = 0;   // Metaspace: tokens seen; fused Strip: characters stripped
      bool done = false;  // fused Strip: met a character it does not strip
    };
    std::vector<StageState> states_;
    bool first_token_ = true;  // no decoder: no space before the first token
  };

  // Decodes one token's text, appending what became final to *out.
  void Push(Stream* stream, std::string_view token, std::string* out) const;
  // Ends the stream: appends everything still held back.
  void Finish(Stream* stream, std::string* out) const;

  // The raw bytes `token` adds to the text when it is not the first token: the per-token steps
  // (Replace, ByteFallback's <0xXX> as its byte, Metaspace's character as a space, Strip of the
  // token) and ByteLevel's characters as bytes, without the UTF-8 decoding that a stream does
  // across tokens, so a token may hold part of a character. Steps on the start of the whole text
  // (Metaspace's dropped first space, a Strip after Fuse or ByteLevel) do not apply.
  std::string TokenBytes(std::string_view token) const;

 private:
  struct Stage {
    enum class Kind { kReplace, kByteFallback, kMetaspace, kStrip, kFuse, kByteLevel };
    Kind kind;
    bool fused = false;                // runs on the fused text, after Fuse/ByteLevel
    std::unique_ptr<Pattern> pattern;  // Replace
    std::string content;               // Replace: replacement; Metaspace: its character
    bool strip_first = false;          // Metaspace: drop the character in the first token
    char32_t strip_char = 0;           // Strip
    size_t strip_start = 0, strip_stop = 0;
  };

  static absl::Status AddStages(const Json& config, std::vector<Stage>* stages);
  // Runs `piece` through stages [index, end) and appends the result to *out.
  void Feed(Stream* stream, size_t index, std::string_view piece, std::string* out) const;
  // Sends what stage `index` holds back on to the next stages.
  void Flush(Stream* stream, size_t index, std::string* out) const;

  std::vector<Stage> stages_;
  bool join_with_spaces_ = false;  // no decoder at all
};

}  // namespace shardserve::tokenizer_internal

#endif  // SHARDSERVE_COORDINATOR_TOKENIZER_DECODER_H_
