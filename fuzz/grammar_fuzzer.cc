// grammar/: JSON Schema, GBNF and regular expressions from a request, through the same entry
// points the server calls (GrammarFromJsonSchema, ParseGbnf, GrammarFromRegex), then compiled
// against a small fixed vocabulary (two special tokens among it, which GBNF's <[id]> names) and
// matched for a few steps. Byte 0 picks the front end
// (0: JSON Schema, 1: GBNF, 2: regex), byte 1 seeds the walk, the rest is the text.
// Errors must be InvalidArgument; an accepted grammar must compile; every token a mask allows
// must be accepted, and a token it leaves out refused.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "grammar/grammar.h"
#include "grammar/json_schema.h"
#include "grammar/matcher.h"

namespace {

std::shared_ptr<const shardserve::grammar::TokenizerInfo> Vocab() {
  static const auto vocab = [] {
    std::vector<std::string> tokens;
    const std::string alphabet = "{}[]\",:0123456789-.eabflnrstuTZ _\\";
    for (char a : alphabet) tokens.push_back(std::string(1, a));
    for (const char* t : {"true", "false", "null", "\":\"", "\",\"", "{\"", "\"}", "\xC3\xA9", "\xC3", "\xA9",
                          "\xE6\x97\xA5", "\xE6\x97", "\xFF", "\xF5\x80\x80\x80", "\\n", "\\u00", "12", "-0.5", "e+", "ab\",",
                          "<s1>", "<s2>", "<eos>"}) {
      tokens.push_back(t);
    }
    // Two special tokens, the last ids before EOS (a grammar names them <[id]>).
    std::vector<bool> special(tokens.size(), false);
    special[tokens.size() - 3] = special[tokens.size() - 2] = true;
    const int32_t eos = static_cast<int32_t>(tokens.size()) - 1;
    return std::make_shared<const shardserve::grammar::TokenizerInfo>(tokens, special, std::vector<int32_t>{eos},
                                                                      static_cast<int32_t>(tokens.size()));
  }();
  return vocab;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace shardserve::grammar;
  if (size < 2) return 0;
  const std::string text(reinterpret_cast<const char*>(data + 2), size - 2);
  absl::StatusOr<Grammar> g = data[0] % 3 == 0   ? GrammarFromJsonSchema(text)
                              : data[0] % 3 == 1 ? ParseGbnf(text)
                                                 : GrammarFromRegex(text);
  if (!g.ok()) {
    if (g.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  absl::StatusOr<std::shared_ptr<const CompiledGrammar>> compiled = CompiledGrammar::Compile(*g, Vocab());
  if (!compiled.ok()) std::abort();  // ParseGbnf and the writers validate what Compile checks
  GrammarMatcher m(*compiled);
  std::vector<uint32_t> mask(m.mask_words());
  uint32_t seed = data[1];
  const int32_t n = Vocab()->vocab_size();
  for (int step = 0; step < 8 && !m.IsTerminated(); ++step) {
    m.FillNextTokenBitmask(mask.data());
    std::vector<int32_t> allowed;
    for (int32_t id = 0; id < n; ++id) {
      const bool bit = (mask[id >> 5] >> (id & 31)) & 1;
      const bool accepted = m.AcceptToken(id);
      if (accepted != bit) std::abort();
      if (accepted) {
        allowed.push_back(id);
        if (!m.Rollback(1).ok()) std::abort();
      }
    }
    if (allowed.empty()) break;
    seed = seed * 1103515245u + 12345u;
    if (!m.AcceptToken(allowed[(seed >> 8) % allowed.size()])) std::abort();
  }
  return 0;
}
