// The grammar engine's vocabulary (grammar/matcher.h's TokenizerInfo) from a checkpoint's
// tokenizer (coordinator/tokenizer), for the tools and tests; grammar/ itself takes the token
// bytes as input and does not depend on the coordinator.
#ifndef SHARDSERVE_TOOLS_BENCH_GRAMMAR_VOCAB_H_
#define SHARDSERVE_TOOLS_BENCH_GRAMMAR_VOCAB_H_

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/tokenizer/tokenizer.h"
#include "grammar/matcher.h"

namespace shardserve {

// Each token's raw bytes (Tokenizer::TokenBytes, the decoder's per-token steps); special tokens
// are never allowed; EOS from the tokenizer's files.
inline std::shared_ptr<const grammar::TokenizerInfo> GrammarVocab(const Tokenizer& tokenizer, int32_t vocab_size = 0) {
  std::vector<std::string> bytes(tokenizer.vocab_size());
  std::vector<bool> special(tokenizer.vocab_size(), false);
  for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
    special[id] = tokenizer.IsSpecial(id);
    std::optional<std::string> b = tokenizer.TokenBytes(id);
    if (b.has_value()) bytes[id] = *std::move(b);
  }
  return std::make_shared<const grammar::TokenizerInfo>(std::move(bytes), special, tokenizer.eos_ids(),
                                                        std::max(vocab_size, tokenizer.vocab_size()));
}

}  // namespace shardserve

#endif  // SHARDSERVE_TOOLS_BENCH_GRAMMAR_VOCAB_H_
