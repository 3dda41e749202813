// tokenizer.json, tokenizer_config.json and generation_config.json bytes (coordinator/tokenizer):
// Tokenizer::FromJson, which FromDirectory calls on the files' contents. The input is the three
// texts joined by kSeparator (the later ones may be absent, as the files may). An input that
// begins with kTiktoken holds tiktoken.model in place of tokenizer.json and goes to
// Tokenizer::FromTiktoken (Kimi K2's files). A bad file must be InvalidArgument or Unimplemented
// naming the field; Internal means an exception escaped a parser that should have checked types
// first, and counts as a bug. A tokenizer that loads must encode and decode a short text.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "coordinator/tokenizer/tokenizer.h"
#include "fuzz/utf8.h"

namespace {
constexpr std::string_view kSeparator = "\n#-#-#\n";
constexpr std::string_view kTiktoken = "#tiktoken.model\n";
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  const bool tiktoken = rest.substr(0, kTiktoken.size()) == kTiktoken;
  if (tiktoken) rest.remove_prefix(kTiktoken.size());
  std::string_view parts[3];
  for (int i = 0; i < 3; ++i) {
    const size_t cut = i < 2 ? rest.find(kSeparator) : std::string_view::npos;
    parts[i] = rest.substr(0, cut);
    if (cut == std::string_view::npos) break;
    rest.remove_prefix(cut + kSeparator.size());
  }
  absl::StatusOr<std::unique_ptr<shardserve::Tokenizer>> tokenizer =
      tiktoken ? shardserve::Tokenizer::FromTiktoken(parts[0], parts[1], parts[2])
               : shardserve::Tokenizer::FromJson(parts[0], parts[1], parts[2]);
  if (!tokenizer.ok()) {
    if (absl::IsInternal(tokenizer.status())) std::abort();
    return 0;
  }
  const shardserve::Tokenizer& t = **tokenizer;
  for (bool add_special : {false, true}) {
    absl::StatusOr<std::vector<int32_t>> ids = t.Encode("Hello, world! <s> 1234 \xc3\xa9t\xc3\xa9\n", add_special);
    if (!ids.ok()) continue;  // e.g. a vocabulary without the bytes of this text
    for (int32_t id : *ids) {
      if (id < 0 || id >= t.vocab_size()) std::abort();
    }
    if (!shardserve_fuzz::IsValidUtf8(t.Decode(*ids))) std::abort();
  }
  return 0;
}
