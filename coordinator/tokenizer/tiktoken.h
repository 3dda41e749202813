// Tokenizers shipped as tiktoken.model instead of tokenizer.json: Kimi K2 (and Moonshot's other
// models, whose tokenization_kimi.TikTokenTokenizer reads the same files). tiktoken.model holds
// the byte-level BPE ranks, one "BASE64 RANK" line per token; tokenizer_config.json names the
// tokenizer class and the special tokens. What the class computes beyond the files (its
// pre-tokenizer regex, the ids of its special tokens, its cutting of long text) is written in
// its Python source, so each supported class is described here, and a tiktoken.model whose
// tokenizer_config.json names another class is refused, naming it.
//
// Kimi's TikTokenTokenizer, as transformers runs it: the added tokens are found in the text
// first; each stretch between them is cut into 400,000-character chunks, each chunk where a run
// of whitespace or of other characters (Python's str.isspace) passes 25,000 characters; tiktoken
// then splits each cut with the class's regex and encodes the pieces by rank (bpe.h FromRanks).
// The 258 ids after the ranks are special tokens, named by added_tokens_decoder or else
// <|reserved_token_ID|>. No BOS is added. Decoding is tiktoken's (the tokens' bytes, invalid
// UTF-8 replaced); skip_special_tokens skips what transformers counts as special: the bos, eos,
// unk and pad tokens and additional_special_tokens (so the tool-call markers stay in the text).
#ifndef SHARDSERVE_COORDINATOR_TOKENIZER_TIKTOKEN_H_
#define SHARDSERVE_COORDINATOR_TOKENIZER_TIKTOKEN_H_

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/tokenizer/added_vocabulary.h"
#include "coordinator/tokenizer/json_util.h"
#include "coordinator/tokenizer/pre_tokenizer.h"

namespace shardserve::tokenizer_internal {

// The tokens of tiktoken.model by rank: every rank from 0 to n-1 once, each a non-empty token.
// Malformed lines fail with InvalidArgument naming the line.
absl::StatusOr<std::vector<std::string>> ParseTiktokenRanks(std::string_view file);

// What a tiktoken tokenizer class adds to its ranks.
struct TiktokenClass {
  std::unique_ptr<PreTokenizer> pre_tokenizer;
  std::vector<AddedToken> special_tokens;
};

// The class that tokenizer_config.json names (tokenizer_class and auto_map's AutoTokenizer), for
// `num_ranks` ranks. `class_source` is the class's Python file when the checkpoint has it (empty
// otherwise): its regex must be the one implemented here, else the load fails rather than
// tokenize differently.
absl::StatusOr<TiktokenClass> ReadTiktokenClass(const Json& tokenizer_config, int32_t num_ranks,
                                                std::string_view class_source);

// The Python file of the class tokenizer_config.json names ("tokenization_kimi.py"), or empty
// when it names none.
std::string TiktokenClassFile(const Json& tokenizer_config);

// Kimi's pre-tokenizer alone (the cutting of long text, then its regex), for tests.
absl::StatusOr<std::unique_ptr<PreTokenizer>> KimiPreTokenizer();

}  // namespace shardserve::tokenizer_internal

#endif  // SHARDSERVE_COORDINATOR_TOKENIZER_TIKTOKEN_H_
