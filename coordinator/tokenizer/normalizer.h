// The "normalizer" of tokenizer.json: a text-to-text rewrite applied to each stretch of input
// between added tokens, before pre-tokenization.
//
// Supported: NFC, NFD, NFKC, NFKD (utf8proc), Lowercase, Replace (string or regex pattern),
// Prepend, Strip, and Sequence of those. Anything else (BertNormalizer, Precompiled, Nmt,
// StripAccents, ByteLevel ...) is rejected at load time with an Unimplemented status naming it.
//
// Thread-safety: immutable after FromJson(); Normalize() may be called from many threads.
#ifndef SHARDSERVE_COORDINATOR_TOKENIZER_NORMALIZER_H_
#define SHARDSERVE_COORDINATOR_TOKENIZER_NORMALIZER_H_

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "coordinator/tokenizer/json_util.h"

namespace shardserve::tokenizer_internal {

class Normalizer {
 public:
  // Builds the normalizer described by `config` (a non-null JSON object).
  static absl::StatusOr<std::unique_ptr<Normalizer>> FromJson(const Json& config);

  virtual ~Normalizer() = default;

  // Replaces *text (valid UTF-8) by its normalized form, which is valid UTF-8 too. `scratch` is
  // working space whose contents are unspecified afterwards.
  virtual absl::Status Normalize(std::string* text, std::string* scratch) const = 0;
};

}  // namespace shardserve::tokenizer_internal

#endif  // SHARDSERVE_COORDINATOR_TOKENIZER_NORMALIZER_H_
