// Pre-tokenization: the working state of one encode call (PieceList, Hugging Face's
// PreTokenizedString) and the "pre_tokenizer" of tokenizer.json, which cuts the text into the
// words that BPE then encodes one by one.
//
// Supported: Split (string or regex pattern; every delimiter behaviour; invert), ByteLevel
// (add_prefix_space, use_regex with the GPT-2 pattern), Metaspace (replacement, prepend_scheme
// first/always/never, split), and Sequence of those, with ByteLevel last if present. Other types
// (Whitespace, Digits, BertPreTokenizer, Punctuation, UnicodeScripts ...) are rejected at load
// time with an Unimplemented status naming them.
//
// Byte-level BPE: Hugging Face's ByteLevel maps every byte of a word to a printable character
// before BPE. We keep words as raw bytes and let the BPE model (bpe.h), whose vocabulary is
// converted back to bytes at load time, work on bytes directly; ByteLevel here only adds the
// prefix space and applies the GPT-2 split. byte_level() tells the model which mode to use.
//
// Thread-safety: PreTokenizer is immutable after FromJson() and may be used from many threads;
// a PieceList belongs to one call.
#ifndef SHARDSERVE_COORDINATOR_TOKENIZER_PRE_TOKENIZER_H_
#define SHARDSERVE_COORDINATOR_TOKENIZER_PRE_TOKENIZER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "coordinator/tokenizer/json_util.h"
#include "coordinator/tokenizer/pattern.h"

namespace shardserve::tokenizer_internal {

// A stretch [begin, end) of PieceList::text, or an added token already found.
struct Piece {
  size_t begin = 0;
  size_t end = 0;
  int32_t token_id = -1;  // >= 0: an added token; final, its text is no longer used
  // Begins at the start of the caller's input (Metaspace's prepend_scheme "first"). Hugging Face
  // asks whether the piece maps to original offset 0; the two differ only if a normalizer deletes
  // the first characters of the input (Strip), which the Llama and Mistral files never do.
  bool at_input_start = false;
};

// How a split treats the delimiters it finds (tokenizer.json "behavior").
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// The text being encoded and its pieces, in order. Each step (added-token extraction,
// normalization, pre-tokenization) replaces the pieces that are not tokens yet by smaller or
// rewritten ones; empty pieces are dropped, as Hugging Face drops empty splits.
class PieceList {
 public:
  // Starts with one piece holding all of `text` (none if it is empty).
  void Reset(std::string_view text);

  const std::string& text() const { return text_; }
  const std::vector<Piece>& pieces() const { return pieces_; }
  std::string_view PieceText(const Piece& p) const { return std::string_view(text_).substr(p.begin, p.end - p.begin); }

  // Replaces each piece that is not a token by the pieces that split_piece(piece, emit) emits
  // with emit(begin, end, token_id) in order, offsets into text(). Empty pieces are dropped.
  // A new piece is at the input start if its parent was and it starts where its parent did.
  using Emit = absl::FunctionRef<void(size_t begin, size_t end, int32_t token_id)>;
  absl::Status Split(absl::FunctionRef<absl::Status(const Piece&, Emit)> split_piece);

  // Splits each piece that is not a token around the matches of `pattern`.
  absl::Status SplitOnPattern(const Pattern& pattern, SplitBehavior behavior, bool invert);

  // Replaces the text of each piece that is not a token by rewrite(piece, old text, out), which
  // appends the new text to `out`. Empty results are dropped.
  absl::Status Rewrite(absl::FunctionRef<absl::Status(const Piece&, std::string_view, std::string*)> rewrite);

 private:
  struct Segment {
    size_t begin, end;
    bool is_match;
  };

  std::string text_;
  std::vector<Piece> pieces_;
  // Reused between steps so that one call allocates little.
  std::string next_text_;
  std::vector<Piece> next_pieces_;
  std::vector<Segment> segments_;
};

class PreTokenizer {
 public:
  // Builds the pre-tokenizer described by `config` (a non-null JSON object).
  static absl::StatusOr<std::unique_ptr<PreTokenizer>> FromJson(const Json& config);

  virtual ~PreTokenizer() = default;

  // Splits (and, for Metaspace and ByteLevel's prefix space, rewrites) every piece of `list`
  // that is not a token.
  virtual absl::Status PreTokenize(PieceList* list) const = 0;

  // True if the words are byte-level words (the pre-tokenizer is or ends with ByteLevel).
  virtual bool byte_level() const { return false; }
};

}  // namespace shardserve::tokenizer_internal

#endif  // SHARDSERVE_COORDINATOR_TOKENIZER_PRE_TOKENIZER_H_
