#include "coordinator/model/structured_output.h"

#include <algorithm>
#include <optional>
#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/field_error.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "grammar/grammar.h"
#include "grammar/json_schema.h"
#include "grammar/matcher.h"

namespace shardserve {
namespace {

// InvalidArgument "field: what", carrying the field (base/field_error.h).
absl::Status Invalid(const std::string& field, absl::string_view what) { return FieldErrorStatus(field, what); }

// The deepest nesting of objects and arrays in a JSON text (strings skipped); the text's
// well-formedness is the schema parser's to check.
int JsonDepth(const std::string& text) {
  int depth = 0, deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      deepest = std::max(deepest, ++depth);
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return deepest;
}

absl::Status CheckText(const std::string& field, const std::string& text) {
  if (text.empty() || text.size() > static_cast<size_t>(kMaxStructuredTextBytes)) {
    return Invalid(field, absl::StrCat("must be 1 to ", kMaxStructuredTextBytes, " bytes, got ", text.size()));
  }
  if (absl::Status utf8 = CheckUtf8(text); !utf8.ok()) return Invalid(field, utf8.message());
  return absl::OkStatus();
}

// The checked constraint as a grammar, and its cache key (kind, then text).
absl::StatusOr<grammar::Grammar> Lower(const v1::StructuredOutput& c, std::string* key) {
  const std::string field = StructuredOutputField(c);
  absl::StatusOr<grammar::Grammar> g;
  switch (c.kind_case()) {
    case v1::StructuredOutput::kJsonSchema:
      if (absl::Status s = CheckText(field, c.json_schema()); !s.ok()) return s;
      if (JsonDepth(c.json_schema()) > kMaxStructuredSchemaDepth) {
        return Invalid(field, absl::StrCat("nests objects and arrays deeper than ", kMaxStructuredSchemaDepth, " levels"));
      }
      *key = absl::StrCat("s", c.json_schema());
      g = grammar::GrammarFromJsonSchema(c.json_schema());
      break;
    case v1::StructuredOutput::kJsonObject:
      if (!c.json_object()) return Invalid(field, "must be true when set");
      *key = "o";
      g = grammar::GrammarForAnyJson();
      break;
    case v1::StructuredOutput::kRegex:
      if (absl::Status s = CheckText(field, c.regex()); !s.ok()) return s;
      *key = absl::StrCat("r", c.regex());
      g = grammar::GrammarFromRegex(c.regex());
      break;
    case v1::StructuredOutput::kChoices: {
      const auto& list = c.choices().choices();
      if (list.empty() || list.size() > kMaxStructuredChoices) {
        return Invalid(field, absl::StrCat("must hold 1 to ", kMaxStructuredChoices, " strings, got ", list.size()));
      }
      std::vector<std::string> choices;
      *key = "c";
      for (int i = 0; i < list.size(); ++i) {
        const std::string f = absl::StrCat(field, "[", i, "]");
        if (list[i].empty() || list[i].size() > static_cast<size_t>(kMaxStructuredChoiceBytes)) {
          return Invalid(f, absl::StrCat("must be 1 to ", kMaxStructuredChoiceBytes, " bytes, got ", list[i].size()));
        }
        if (absl::Status utf8 = CheckUtf8(list[i]); !utf8.ok()) return Invalid(f, utf8.message());
        choices.push_back(list[i]);
        absl::StrAppend(key, list[i].size(), ":", list[i]);  // length-prefixed: unambiguous
      }
      g = grammar::GrammarFromChoices(choices);
      break;
    }
    case v1::StructuredOutput::kGrammar:
      if (absl::Status s = CheckText(field, c.grammar()); !s.ok()) return s;
      *key = absl::StrCat("g", c.grammar());
      g = grammar::ParseGbnf(c.grammar());
      break;
    default:
      return Invalid("sampling.structured_output", "has no kind set (json_schema, json_object, regex, choices or grammar)");
  }
  if (!g.ok()) return Invalid(field, g.status().message());
  return g;
}

// A compile that runs on its own thread, so that the request waits at most the compile-time
// bound; a compile past it is cancelled (its thread stops at its next check) and dropped.
struct PendingCompile {
  std::atomic<bool> cancel{false};
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>> result ABSL_GUARDED_BY(mu);
};

}  // namespace

std::string StructuredOutputField(const v1::StructuredOutput& c) {
  switch (c.kind_case()) {
    case v1::StructuredOutput::kJsonSchema: return "sampling.structured_output.json_schema";
    case v1::StructuredOutput::kJsonObject: return "sampling.structured_output.json_object";
    case v1::StructuredOutput::kRegex: return "sampling.structured_output.regex";
    case v1::StructuredOutput::kChoices: return "sampling.structured_output.choices";
    case v1::StructuredOutput::kGrammar: return "sampling.structured_output.grammar";
    default: return "sampling.structured_output";
  }
}

StructuredOutputCompiler::StructuredOutputCompiler(const Tokenizer* tokenizer, int32_t vocab_size,
                                                   std::vector<int32_t> eos_ids, absl::Duration compile_timeout)
    : tokenizer_(tokenizer), vocab_size_(vocab_size), eos_ids_(std::move(eos_ids)), compile_timeout_(compile_timeout) {}

StructuredOutputCompiler::~StructuredOutputCompiler() = default;

int64_t StructuredOutputCompiler::compiles() const {
  absl::MutexLock lock(&mu_);
  return compiles_;
}

int64_t StructuredOutputCompiler::compiles_running() const { return in_flight_->load(); }

int64_t StructuredOutputCompiler::hits() const {
  absl::MutexLock lock(&mu_);
  return hits_;
}

std::shared_ptr<const grammar::TokenizerInfo> GrammarVocab(const Tokenizer& tokenizer, std::vector<int32_t> eos_ids,
                                                           int32_t vocab_size) {
  // The mask covers the model's ids; a tokenizer's ids past them (Kimi K2 has two) cannot be
  // sampled and are left out, as xgrammar's TokenizerInfo leaves them.
  const int32_t size = vocab_size > 0 ? vocab_size : tokenizer.vocab_size();
  const int32_t known = std::min(size, tokenizer.vocab_size());
  std::vector<std::string> bytes(known);
  std::vector<bool> special(known, false);
  for (int32_t id = 0; id < known; ++id) {
    special[id] = tokenizer.IsSpecial(id);
    std::optional<std::string> b = tokenizer.TokenBytes(id);
    if (b.has_value() && !special[id]) bytes[id] = *std::move(b);
  }
  eos_ids.erase(std::remove_if(eos_ids.begin(), eos_ids.end(), [&](int32_t id) { return id >= size; }), eos_ids.end());
  return std::make_shared<const grammar::TokenizerInfo>(std::move(bytes), special, std::move(eos_ids), size);
}

absl::StatusOr<std::shared_ptr<const grammar::TokenizerInfo>> StructuredOutputCompiler::Vocab() {
  absl::MutexLock lock(&mu_);
  if (vocab_made_) return vocab_;
  vocab_made_ = true;
  if (tokenizer_ == nullptr) {
    vocab_ = absl::FailedPreconditionError(
        absl::StrCat("structured outputs need the model's tokenizer (", kTokenizerFiles, "), and this model has none"));
    return vocab_;
  }
  vocab_ = GrammarVocab(*tokenizer_, eos_ids_, vocab_size_);
  return vocab_;
}

absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>> StructuredOutputCompiler::Get(
    const v1::StructuredOutput& constraint) {
  std::string key;
  absl::StatusOr<grammar::Grammar> g = Lower(constraint, &key);
  if (!g.ok()) return g.status();
  absl::StatusOr<std::shared_ptr<const grammar::TokenizerInfo>> vocab = Vocab();
  if (!vocab.ok()) return vocab.status();
  {
    absl::MutexLock lock(&mu_);
    if (auto it = index_.find(key); it != index_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second);
      ++hits_;
      return it->second->second;
    }
  }

  auto pending = std::make_shared<PendingCompile>();
  in_flight_->fetch_add(1);
  std::thread([pending, in_flight = in_flight_, lowered = *std::move(g), vocab = *vocab]() {
    absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>> r =
        grammar::CompiledGrammar::Compile(lowered, vocab, &pending->cancel);
    {
      absl::MutexLock lock(&pending->mu);
      pending->result = std::move(r);
      pending->done = true;
    }
    in_flight->fetch_sub(1);
  }).detach();
  absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>> compiled;
  {
    absl::MutexLock lock(&pending->mu);
    auto done = [&pending]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(pending->mu) { return pending->done; };
    if (!pending->mu.AwaitWithTimeout(absl::Condition(&done), compile_timeout_)) {
      pending->cancel.store(true);
      return Invalid(StructuredOutputField(constraint),
                     absl::StrCat("compiling it against the vocabulary took longer than the compile-time bound of ",
                                  absl::FormatDuration(compile_timeout_), "; simplify it"));
    }
    compiled = pending->result;
  }
  if (!compiled.ok()) return Invalid(StructuredOutputField(constraint), compiled.status().message());
  absl::MutexLock lock(&mu_);
  ++compiles_;
  if (index_.find(key) == index_.end()) {
    lru_.emplace_front(key, *compiled);
    index_[key] = lru_.begin();
    while (lru_.size() > kStructuredCacheEntries) {
      index_.erase(lru_.back().first);
      lru_.pop_back();
    }
  }
  return compiled;
}

}  // namespace shardserve
