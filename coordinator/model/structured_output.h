// Structured outputs on the coordinator: a request's constraint (inference.proto StructuredOutput)
// checked, lowered to a grammar and compiled against the served model's vocabulary, in the
// request's handler (never on the engine's loop), with a bounded cache of compiled grammars keyed
// on (kind, text), since clients resend the same schema with every request.
//
// The vocabulary is the byte string of every token id (grammar/matcher.h TokenizerInfo), as the
// tokenizer's decoder writes it (Tokenizer::TokenBytes: byte-level BPE tokens, <0xXX> byte-fallback
// tokens, Metaspace's space); a model that has no tokenizer refuses constraints with
// FailedPrecondition saying so.
//
// Threading: StructuredOutputCompiler is thread-safe; compiled grammars are immutable and shared.
#ifndef SHARDSERVE_COORDINATOR_MODEL_STRUCTURED_OUTPUT_H_
#define SHARDSERVE_COORDINATOR_MODEL_STRUCTURED_OUTPUT_H_

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "shardserve/v1/inference.pb.h"

namespace shardserve {

class Tokenizer;
namespace grammar {
class CompiledGrammar;
class TokenizerInfo;
}  // namespace grammar

// Bounds on a constraint (both APIs): the longest text (a schema's JSON, a regex, a grammar), the
// most choices and the longest choice, the deepest nesting of a JSON Schema's objects and arrays.
inline constexpr int kMaxStructuredTextBytes = 64 * 1024;
inline constexpr int kMaxStructuredChoices = 256;
inline constexpr int kMaxStructuredChoiceBytes = 4096;
inline constexpr int kMaxStructuredSchemaDepth = 32;
// Compiled grammars kept (least recently used dropped first).
inline constexpr size_t kStructuredCacheEntries = 64;
// How long a request waits for its grammar to compile (the compile-time bound of ServedModel's).
inline constexpr absl::Duration kDefaultGrammarCompileTimeout = absl::Seconds(30);

// The grammar engine's vocabulary from `tokenizer`: each token's raw bytes (Tokenizer::TokenBytes);
// special tokens allowed only where a grammar names them (<[id]>); `eos_ids` allowed where a grammar may end; ids up to `vocab_size`
// (the logits' width; 0: the tokenizer's), of which those past the tokenizer's are never allowed and
// the tokenizer's past it (ids the model cannot sample) are left out.
std::shared_ptr<const grammar::TokenizerInfo> GrammarVocab(const Tokenizer& tokenizer, std::vector<int32_t> eos_ids,
                                                           int32_t vocab_size);

class StructuredOutputCompiler {
 public:
  // `tokenizer` (may be null) is borrowed and must outlive this; `vocab_size` is the model's
  // (config.json's: the logits' width); `eos_ids` the ids that end a generation (allowed only where
  // the grammar may end).
  StructuredOutputCompiler(const Tokenizer* tokenizer, int32_t vocab_size, std::vector<int32_t> eos_ids,
                           absl::Duration compile_timeout);
  ~StructuredOutputCompiler();

  // The compiled grammar of `constraint` (which must have a kind set), from the cache or compiled
  // now. InvalidArgument naming `field` ("sampling.structured_output.json_schema", ...) and what
  // is wrong (bounds, invalid UTF-8, the grammar engine's own message naming the keyword or the
  // position, the compile-time bound); FailedPrecondition when the model's token bytes are unknown.
  absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>> Get(const v1::StructuredOutput& constraint);

  // Counters, for tests and the log.
  int64_t compiles() const;
  int64_t hits() const;
  // Compile threads still running (a compile past the bound is cancelled and soon ends).
  int64_t compiles_running() const;

 private:
  absl::StatusOr<std::shared_ptr<const grammar::TokenizerInfo>> Vocab();

  // ---- Constant after construction ----
  const Tokenizer* const tokenizer_;
  const int32_t vocab_size_;
  const std::vector<int32_t> eos_ids_;
  const absl::Duration compile_timeout_;
  // Compile threads running; shared with them, since one may outlive this.
  const std::shared_ptr<std::atomic<int64_t>> in_flight_ = std::make_shared<std::atomic<int64_t>>(0);

  // ---- Guarded by mu_ ----
  mutable absl::Mutex mu_;
  bool vocab_made_ ABSL_GUARDED_BY(mu_) = false;
  absl::StatusOr<std::shared_ptr<const grammar::TokenizerInfo>> vocab_ ABSL_GUARDED_BY(mu_);
  // Most recently used first; the map points into the list.
  using Entry = std::pair<std::string, std::shared_ptr<const grammar::CompiledGrammar>>;
  std::list<Entry> lru_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::list<Entry>::iterator> index_ ABSL_GUARDED_BY(mu_);
  int64_t compiles_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t hits_ ABSL_GUARDED_BY(mu_) = 0;
};

// The field of `constraint`'s kind as errors name it: "sampling.structured_output.json_schema", ...
std::string StructuredOutputField(const v1::StructuredOutput& constraint);

}  // namespace shardserve

#endif  // SHARDSERVE_COORDINATOR_MODEL_STRUCTURED_OUTPUT_H_
