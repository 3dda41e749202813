// Encode and decode of arbitrary bytes (invalid UTF-8 included) with the real tokenizers of
// tests/fixtures/tokenizers, loaded once. The first byte picks the tokenizer, the second the flags;
// the rest is both the text to encode and, read as little-endian int32s, ids to decode.
//
// Invariants checked (tokenizer.h states each):
// - Encode fails only with InvalidArgument on invalid UTF-8, or ResourceExhausted when a regex
//   exceeds PCRE2's limits; valid UTF-8 otherwise encodes, to ids inside the vocabulary.
// - Decode of any ids (negative, out of range, special) returns valid UTF-8.
// - IncrementalDetokenizer: the concatenation of Add() and Finish() equals Decode.
// - Round trip: for byte-level tokenizers without a normalizer (gpt2, llama3, kimi_k2), every byte of the
//   text is a token of the byte alphabet and nothing is normalized, so
//   Decode(Encode(text, no specials)) == text for valid UTF-8. Others normalize (NFC, NFKC,
//   lowercase, the Metaspace prefix) and do not promise it.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "coordinator/tokenizer/tokenizer.h"
#include "fuzz/utf8.h"

namespace {

struct Fixture {
  const char* name;
  bool round_trips;  // byte-level, no normalizer: see above
  std::unique_ptr<shardserve::Tokenizer> tokenizer;
};

std::vector<Fixture>& Fixtures() {
  static std::vector<Fixture>* fixtures = [] {
    auto* f = new std::vector<Fixture>();
    const std::pair<const char*, bool> names[] = {
        {"gpt2", true},     {"llama3", true},  {"llama2", false},           {"mistral", false},
        {"qwen2", false},   {"features_bytelevel", false}, {"features_metaspace", false}, {"kimi_k2", true}};
    for (const auto& [name, round_trips] : names) {
      absl::StatusOr<std::unique_ptr<shardserve::Tokenizer>> t = shardserve::Tokenizer::FromDirectory(
          std::string(SHARDSERVE_SOURCE_DIR) + "/tests/fixtures/tokenizers/" + name);
      if (!t.ok()) {
        std::fprintf(stderr, "tokenize_fuzzer: %s: %s\n", name, std::string(t.status().message()).c_str());
        std::abort();
      }
      f->push_back({name, round_trips, *std::move(t)});
    }
    return f;
  }();
  return *fixtures;
}

void Check(bool ok, const char* what, const Fixture& f) {
  if (ok) return;
  std::fprintf(stderr, "tokenize_fuzzer: %s: %s\n", f.name, what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  Fixtures();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const Fixture& f = Fixtures()[data[0] % Fixtures().size()];
  const shardserve::Tokenizer& t = *f.tokenizer;
  const bool add_special = data[1] & 1, skip_special = data[1] & 2;
  const std::string_view text(reinterpret_cast<const char*>(data + 2), size - 2);

  // Encode.
  const bool valid = shardserve_fuzz::IsValidUtf8(text);
  absl::StatusOr<std::vector<int32_t>> ids = t.Encode(text, add_special);
  if (!ids.ok()) {
    Check(absl::IsInvalidArgument(ids.status()) || absl::IsResourceExhausted(ids.status()), "unexpected error code", f);
    Check(!valid || absl::IsResourceExhausted(ids.status()), "valid UTF-8 refused", f);
  } else {
    Check(valid, "invalid UTF-8 accepted", f);
    for (int32_t id : *ids) Check(id >= 0 && id < t.vocab_size(), "id outside the vocabulary", f);
    const std::string decoded = t.Decode(*ids, skip_special);
    Check(shardserve_fuzz::IsValidUtf8(decoded), "Decode(Encode(text)) is not UTF-8", f);
    if (f.round_trips && !add_special && !skip_special) Check(decoded == text, "round trip differs", f);
  }

  // Decode arbitrary ids, in one piece and streamed.
  std::vector<int32_t> raw((size - 2) / 4);
  if (!raw.empty()) std::memcpy(raw.data(), data + 2, raw.size() * 4);
  const std::string decoded = t.Decode(raw, skip_special);
  Check(shardserve_fuzz::IsValidUtf8(decoded), "Decode is not UTF-8", f);
  shardserve::IncrementalDetokenizer stream(t, skip_special);
  std::string streamed;
  for (int32_t id : raw) streamed += stream.Add(id);
  streamed += stream.Finish();
  Check(streamed == decoded, "streamed decode differs from Decode", f);
  return 0;
}
