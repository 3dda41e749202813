// The "added_tokens" of tokenizer.json (special tokens such as <s> or <|im_start|>, and other
// added tokens), found in the input text before anything else happens to it, so that BPE never
// merges them with their neighbours.
//
// As in Hugging Face: tokens with normalized=false are matched in the raw text; the others are
// matched, in their normalized form, in each stretch of text after normalization. Matching is
// leftmost-longest over all tokens of a set, like the Aho-Corasick automaton Hugging Face uses;
// a match that fails its single_word condition is dropped without retrying shorter tokens at that
// place. lstrip/rstrip extend a match over the whitespace next to it.
//
// Thread-safety: immutable after Create(); Extract() may be called from many threads.
#ifndef SHARDSERVE_COORDINATOR_TOKENIZER_ADDED_VOCABULARY_H_
#define SHARDSERVE_COORDINATOR_TOKENIZER_ADDED_VOCABULARY_H_

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "coordinator/tokenizer/json_util.h"
#include "coordinator/tokenizer/normalizer.h"
#include "coordinator/tokenizer/pre_tokenizer.h"

namespace shardserve::tokenizer_internal {

// An added token: an entry of tokenizer.json's "added_tokens" (or of tokenizer_config.json's
// "added_tokens_decoder", for tiktoken.model checkpoints).
struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool single_word = false;  // match only where not inside a word
  bool lstrip = false;       // also take the whitespace on the left
  bool rstrip = false;       // also take the whitespace on the right
  bool normalized = false;   // match the normalized form in normalized text
  bool special = false;      // skipped by decode when skip_special_tokens
};

// An added token's object as tokenizer.json's added_tokens and tokenizer_config.json's
// added_tokens_decoder write it: reads 'content' and the matching flags (single_word, lstrip, rstrip,
// normalized; absent or null means false) into *token, `where` naming it in errors. The id and
// whether it is special are the caller's: the two files give them differently.
absl::Status ReadAddedToken(const Json& item, std::string_view where, AddedToken* token);

class AddedVocabulary {
 public:
  // `normalizer` (may be null) gives the form matched for tokens with normalized=true.
  static absl::StatusOr<AddedVocabulary> Create(std::vector<AddedToken> tokens, const Normalizer* normalizer);

  const std::vector<AddedToken>& tokens() const { return tokens_; }

  // Splits every piece of `list` that is not a token yet around the tokens of one set: the raw
  // set (normalized=false) or the normalized set.
  absl::Status Extract(PieceList* list, bool normalized_set) const;

 private:
  // A byte trie over the contents of one set of tokens.
  struct Trie {
    struct Node {
      std::vector<std::pair<uint8_t, int32_t>> children;  // sorted by byte
      int32_t token = -1;                                 // index into tokens_, if a token ends here
    };
    std::vector<Node> nodes{Node{}};
    std::array<bool, 256> first_byte{};  // bytes that start some token

    void Insert(std::string_view key, int32_t token);
    // Length of the longest token starting at text[at], or 0; sets *token to its index.
    size_t LongestAt(std::string_view text, size_t at, int32_t* token) const;
  };

  std::vector<AddedToken> tokens_;
  Trie raw_;         // tokens with normalized=false, by content
  Trie normalized_;  // tokens with normalized=true, by normalized content
};

}  // namespace shardserve::tokenizer_internal

#endif  // SHARDSERVE_COORDINATOR_TOKENIZER_ADDED_VOCABULARY_H_
