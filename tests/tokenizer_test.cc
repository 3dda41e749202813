// Tests of coordinator/tokenizer.
//
// Parity: for each fixture kind under tests/fixtures/tokenizers/ (made by
// tools/fixtures/make_tokenizer_fixtures.py with Hugging Face tokenizers), every recorded string must
// encode to the same ids, with and without special tokens, and every recorded id sequence must
// decode to the same text, with and without special tokens. There is no tolerance: tokenization
// is exact. The streaming detokenizer must return deltas that are valid UTF-8 and concatenate to
// Hugging Face's decode.
//
// The other tests cover what the fixtures cannot: invalid UTF-8, unsupported or malformed
// tokenizer.json files, BOS/EOS metadata, concurrency and long inputs.
#include "coordinator/tokenizer/tokenizer.h"

#include <algorithm>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "coordinator/tokenizer/pre_tokenizer.h"
#include "coordinator/tokenizer/unicode.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace shardserve {
namespace {

using Json = nlohmann::json;
using tokenizer_internal::FindInvalidUtf8;

// The pipelines of real checkpoints (GPT-2, Llama 3, Qwen2, Llama 2, Mistral), then two kinds made
// to cover the remaining supported components (tools/fixtures/make_tokenizer_fixtures.py says which).
const std::vector<std::string> kRealKinds = {"gpt2", "llama3", "qwen2", "llama2", "mistral"};
const std::vector<std::string> kAllKinds = {
    "gpt2", "llama3", "qwen2", "llama2", "mistral", "features_bytelevel", "features_metaspace"};

std::string FixtureDir(const std::string& kind) {
  return std::string(SHARDSERVE_SOURCE_DIR) + "/tests/fixtures/tokenizers/" + kind;
}

// Escapes text for failure messages: control characters and non-ASCII as \x.. / \u{...}.
std::string Escape(std::string_view text) {
  std::string out;
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<uint8_t>(text[i]);
    if (c >= 0x20 && c < 0x7F) {
      out.push_back(static_cast<char>(c));
      ++i;
    } else if (c < 0x80 ||
               FindInvalidUtf8(text.substr(i, tokenizer_internal::Utf8Length(c))) != std::string_view::npos) {
      out += absl::StrFormat("\\x%02X", c);
      ++i;
    } else {
      size_t len;
      out += absl::StrFormat("\\u{%X}", static_cast<uint32_t>(tokenizer_internal::DecodeUtf8(text, i, &len)));
      i += len;
    }
  }
  return out;
}

std::vector<int32_t> Ids(const Json& j) { return j.get<std::vector<int32_t>>(); }

class TokenizerParityTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromDirectory(FixtureDir(GetParam()));
    ASSERT_TRUE(tok.ok()) << tok.status();
    tokenizer_ = *std::move(tok);
    std::ifstream in(FixtureDir(GetParam()) + "/cases.json");
    ASSERT_TRUE(in) << "missing cases.json for " << GetParam();
    cases_ = Json::parse(in);
  }

  // Every id sequence of the fixture with Hugging Face's decodes: [ids, text, text without specials].
  std::vector<std::tuple<std::vector<int32_t>, std::string, std::string>> DecodeCases() const {
    std::vector<std::tuple<std::vector<int32_t>, std::string, std::string>> all;
    for (const Json& c : cases_["encode"]) all.emplace_back(Ids(c["ids"]), c["decoded"], c["decoded_skip_special"]);
    for (const Json& c : cases_["decode"]) all.emplace_back(Ids(c["ids"]), c["text"], c["text_skip_special"]);
    return all;
  }

  std::unique_ptr<Tokenizer> tokenizer_;
  Json cases_;
};

TEST_P(TokenizerParityTest, EncodeMatchesHuggingFace) {
  ASSERT_GE(cases_["encode"].size(), 70u);
  for (const Json& c : cases_["encode"]) {
    const std::string text = c["text"];
    SCOPED_TRACE("text: \"" + Escape(text) + "\"");
    absl::StatusOr<std::vector<int32_t>> with_special = tokenizer_->Encode(text, /*add_special_tokens=*/true);
    ASSERT_TRUE(with_special.ok()) << with_special.status();
    EXPECT_EQ(*with_special, Ids(c["ids"]));
    absl::StatusOr<std::vector<int32_t>> without = tokenizer_->Encode(text, /*add_special_tokens=*/false);
    ASSERT_TRUE(without.ok()) << without.status();
    EXPECT_EQ(*without, Ids(c["ids_no_special"]));
  }
}

TEST_P(TokenizerParityTest, PreTokenizerMatchesHuggingFace) {
  // The regex splits on their own, as pre_tokenize_str gives them: a small vocabulary can hide a
  // wrong split (differently split bytes may still merge into the same ids).
  std::ifstream in(FixtureDir(GetParam()) + "/tokenizer.json");
  const Json config = Json::parse(in)["pre_tokenizer"];
  if (config.is_null()) {  // Llama 2: none in either implementation, so no pieces were recorded
    for (const Json& c : cases_["encode"]) EXPECT_FALSE(c.contains("pre_tokenized"));
    return;
  }
  absl::StatusOr<std::unique_ptr<tokenizer_internal::PreTokenizer>> pre =
      tokenizer_internal::PreTokenizer::FromJson(config);
  ASSERT_TRUE(pre.ok()) << pre.status();
  for (const Json& c : cases_["encode"]) {
    const std::string text = c["text"];
    SCOPED_TRACE("text: \"" + Escape(text) + "\"");
    tokenizer_internal::PieceList list;
    list.Reset(text);
    ASSERT_TRUE((*pre)->PreTokenize(&list).ok());
    std::vector<std::string> pieces;
    for (const tokenizer_internal::Piece& p : list.pieces()) {
      std::string piece;
      if ((*pre)->byte_level()) {  // Hugging Face shows byte-level pieces in GPT-2's alphabet
        for (char b : list.PieceText(p))
          tokenizer_internal::AppendUtf8(tokenizer_internal::ByteToChar()[static_cast<uint8_t>(b)], &piece);
      } else {
        piece = list.PieceText(p);
      }
      pieces.push_back(Escape(piece));
    }
    std::vector<std::string> expected;
    for (const Json& piece : c["pre_tokenized"]) expected.push_back(Escape(piece.get<std::string>()));
    EXPECT_EQ(pieces, expected);
  }
}

TEST_P(TokenizerParityTest, DecodeMatchesHuggingFace) {
  for (const auto& [ids, text, text_skip_special] : DecodeCases()) {
    SCOPED_TRACE(::testing::PrintToString(ids));
    EXPECT_EQ(Escape(tokenizer_->Decode(ids, /*skip_special_tokens=*/false)), Escape(text));
    EXPECT_EQ(Escape(tokenizer_->Decode(ids, /*skip_special_tokens=*/true)), Escape(text_skip_special));
  }
}

TEST_P(TokenizerParityTest, StreamingDeltasConcatenateToHuggingFaceDecode) {
  for (const auto& [ids, text, text_skip_special] : DecodeCases()) {
    SCOPED_TRACE(::testing::PrintToString(ids));
    for (const bool skip : {false, true}) {
      IncrementalDetokenizer stream(*tokenizer_, skip);
      std::string concatenated;
      for (int32_t id : ids) {
        const std::string delta = stream.Add(id);
        EXPECT_EQ(FindInvalidUtf8(delta), std::string_view::npos) << "broken UTF-8 in delta " << Escape(delta);
        concatenated += delta;
      }
      const std::string rest = stream.Finish();
      EXPECT_EQ(FindInvalidUtf8(rest), std::string_view::npos);
      concatenated += rest;
      EXPECT_EQ(Escape(concatenated), Escape(skip ? text_skip_special : text));
    }
  }
}

// Token by token, the raw bytes concatenate to Hugging Face's decode wherever that decode is valid
// UTF-8 throughout (no replacement characters), but for the space a Metaspace or Strip decoder
// drops at the start of the text.
TEST_P(TokenizerParityTest, TokenBytesConcatenateToHuggingFaceDecode) {
  int checked = 0;
  for (const auto& [ids, text, text_skip_special] : DecodeCases()) {
    SCOPED_TRACE(::testing::PrintToString(ids));
    if (text.find("\xEF\xBF\xBD") != std::string::npos) continue;  // lossy: bytes were replaced
    std::string bytes;
    bool known = true;
    for (int32_t id : ids) {
      const std::optional<std::string> b = tokenizer_->TokenBytes(id);
      known = known && b.has_value();
      if (b.has_value()) bytes += *b;
    }
    if (!known) continue;  // Hugging Face skips ids without a token, as Decode does
    const bool dropped_space = bytes.size() == text.size() + 1 && bytes[0] == ' ';
    EXPECT_EQ(Escape(dropped_space ? bytes.substr(1) : bytes), Escape(text));
    ++checked;
  }
  EXPECT_GT(checked, 10);
  EXPECT_EQ(tokenizer_->TokenBytes(-1), std::nullopt);
  EXPECT_EQ(tokenizer_->TokenBytes(tokenizer_->vocab_size()), std::nullopt);
}

TEST_P(TokenizerParityTest, ConcurrentEncodesAgree) {
  // Many threads share one Tokenizer (and its word cache).
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (size_t t = 0; t < mismatches.size(); ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 5; ++round) {
        for (const Json& c : cases_["encode"]) {
          absl::StatusOr<std::vector<int32_t>> ids = tokenizer_->Encode(c["text"].get<std::string>());
          if (!ids.ok() || *ids != Ids(c["ids"])) ++mismatches[t];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches, std::vector<int>(mismatches.size(), 0));
}

// Round trips hold for the real pipelines only: the features kinds lowercase, normalize and drop
// whitespace on purpose.
class TokenizerRoundTripTest : public TokenizerParityTest {};

TEST_P(TokenizerRoundTripTest, LongInputsRoundTrip) {
  // Runs longer than any cache or JIT stack default: whitespace, one huge word, repeated text.
  // (None starts with a space: SentencePiece-style decoders drop a leading space, so " x" does
  // not round-trip there, in Hugging Face either.)
  const std::string inputs[] = {"x" + std::string(100000, ' ') + "x", std::string(200000, 'a'),
                                std::string(50000, '\n'), [] {
                                  std::string s;
                                  for (int i = 0; i < 2000; ++i) s += "In the beginning 你好 👍🏽 ";
                                  return s;
                                }()};
  for (const std::string& text : inputs) {
    absl::StatusOr<std::vector<int32_t>> ids = tokenizer_->Encode(text, /*add_special_tokens=*/false);
    ASSERT_TRUE(ids.ok()) << ids.status();
    const std::string decoded = tokenizer_->Decode(*ids);
    EXPECT_TRUE(decoded == text) << GetParam() << ": round trip differs for an input of " << text.size() << " bytes";
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, TokenizerParityTest, ::testing::ValuesIn(kAllKinds),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });
INSTANTIATE_TEST_SUITE_P(Kinds, TokenizerRoundTripTest, ::testing::ValuesIn(kRealKinds),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// ---- Streaming -------------------------------------------------------------------------------

std::unique_ptr<Tokenizer> LoadKind(const std::string& kind) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromDirectory(FixtureDir(kind));
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? *std::move(tok) : nullptr;
}

// The deltas of streaming `ids`, Finish() last.
std::vector<std::string> Deltas(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  IncrementalDetokenizer stream(tok, /*skip_special_tokens=*/false);
  std::vector<std::string> deltas;
  for (int32_t id : ids) deltas.push_back(stream.Add(id));
  deltas.push_back(stream.Finish());
  return deltas;
}

TEST(IncrementalDetokenizerTest, HoldsBackACharacterSplitAcrossByteLevelTokens) {
  std::unique_ptr<Tokenizer> tok = LoadKind("gpt2");
  ASSERT_NE(tok, nullptr);
  absl::StatusOr<std::vector<int32_t>> ids = tok->Encode("a👍b", false);
  ASSERT_TRUE(ids.ok());
  ASSERT_GE(ids->size(), 3u);  // the emoji's four bytes are not one token in this small vocabulary
  const std::vector<std::string> deltas = Deltas(*tok, *ids);
  std::string text;
  for (size_t i = 0; i < deltas.size(); ++i) {
    text += deltas[i];
    // After each token the text so far is a prefix of the whole and never ends mid-character.
    EXPECT_EQ(std::string("a👍b").rfind(text, 0), 0u) << "after token " << i << ": " << Escape(text);
  }
  EXPECT_EQ(text, "a👍b");
  EXPECT_EQ(deltas.back(), "");  // nothing was left to flush: b completed the text
}

TEST(IncrementalDetokenizerTest, IncompleteCharacterAtTheEndBecomesReplacementCharacter) {
  std::unique_ptr<Tokenizer> tok = LoadKind("gpt2");
  ASSERT_NE(tok, nullptr);
  absl::StatusOr<std::vector<int32_t>> ids = tok->Encode("👍", false);
  ASSERT_TRUE(ids.ok());
  std::vector<int32_t> truncated(ids->begin(), ids->end() - 1);
  const std::vector<std::string> deltas = Deltas(*tok, truncated);
  for (size_t i = 0; i + 1 < deltas.size(); ++i) EXPECT_EQ(deltas[i], "") << i;
  EXPECT_EQ(deltas.back(), "\xEF\xBF\xBD");  // as Hugging Face's lossy decode
  EXPECT_EQ(tok->Decode(truncated), "\xEF\xBF\xBD");
}

TEST(IncrementalDetokenizerTest, ByteFallbackRunIsHeldUntilItEnds) {
  std::unique_ptr<Tokenizer> tok = LoadKind("llama2");
  ASSERT_NE(tok, nullptr);
  absl::StatusOr<std::vector<int32_t>> ids = tok->Encode("I 👍 it", false);
  ASSERT_TRUE(ids.ok());
  const std::vector<std::string> deltas = Deltas(*tok, *ids);
  std::string text;
  for (const std::string& d : deltas) text += d;
  EXPECT_EQ(text, "I 👍 it");
  // The emoji comes out whole, in the delta of the token after its four byte tokens.
  EXPECT_EQ(std::count_if(deltas.begin(), deltas.end(),
                          [](const std::string& d) { return d.find("👍") != std::string::npos; }),
            1);
}

// ---- Bad input -------------------------------------------------------------------------------

// A token may hold part of a character: the bytes are raw, not a lossy decode.
TEST(TokenizerTest, TokenBytesKeepPartialCharacters) {
  std::unique_ptr<Tokenizer> gpt2 = LoadKind("gpt2");
  ASSERT_NE(gpt2, nullptr);
  absl::StatusOr<std::vector<int32_t>> ids = gpt2->Encode("a\xF0\x9F\x91\x8D", false);
  ASSERT_TRUE(ids.ok());
  std::string bytes;
  for (int32_t id : *ids) {
    const std::optional<std::string> b = gpt2->TokenBytes(id);
    ASSERT_TRUE(b.has_value());
    EXPECT_EQ(FindInvalidUtf8(*b) == std::string_view::npos, *b == "a") << Escape(*b);
    bytes += *b;
  }
  EXPECT_EQ(bytes, "a\xF0\x9F\x91\x8D");
  std::unique_ptr<Tokenizer> llama2 = LoadKind("llama2");
  ASSERT_NE(llama2, nullptr);
  const std::optional<int32_t> byte_token = llama2->TokenToId("<0xF0>");
  ASSERT_TRUE(byte_token.has_value());
  EXPECT_EQ(llama2->TokenBytes(*byte_token), "\xF0");
  const std::optional<int32_t> word = llama2->TokenToId("\xE2\x96\x81the");  // Metaspace's U+2581
  ASSERT_TRUE(word.has_value());
  EXPECT_EQ(llama2->TokenBytes(*word), " the");
}

TEST(TokenizerTest, InvalidUtf8IsRejectedWithItsOffset) {
  std::unique_ptr<Tokenizer> tok = LoadKind("llama3");
  ASSERT_NE(tok, nullptr);
  const std::pair<std::string, std::string> cases[] = {
      {"abc\xFF", "offset 3"},              // never valid
      {"ab\xE4\xBD", "offset 2"},           // truncated character
      {"\xC0\xAF", "offset 0"},             // overlong '/'
      {"x\xED\xA0\x80y", "offset 1"},       // UTF-16 surrogate
      {"ok \xF4\x90\x80\x80", "offset 3"},  // above U+10FFFF
  };
  for (const auto& [text, where] : cases) {
    absl::StatusOr<std::vector<int32_t>> ids = tok->Encode(text);
    ASSERT_FALSE(ids.ok()) << Escape(text);
    EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(ids.status().message().find(where), absl::string_view::npos) << ids.status();
  }
}

// A minimal valid tokenizer.json, to be broken by the tests below.
Json MinimalTokenizerJson() {
  return Json::parse(R"({
    "version": "1.0", "added_tokens": [], "normalizer": null, "pre_tokenizer": null,
    "post_processor": null, "decoder": null,
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}
  })");
}

absl::Status LoadStatus(const Json& tokenizer_json) { return Tokenizer::FromJson(tokenizer_json.dump()).status(); }

TEST(TokenizerTest, MinimalTokenizerWorks) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromJson(MinimalTokenizerJson().dump());
  ASSERT_TRUE(tok.ok()) << tok.status();
  absl::StatusOr<std::vector<int32_t>> ids = (*tok)->Encode("abba");
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, (std::vector<int32_t>{2, 1, 0}));
  EXPECT_EQ((*tok)->Decode(*ids), "ab b a");  // no decoder: tokens joined with spaces
}

TEST(TokenizerTest, MergesAcrossMetaspaceAreKept) {
  // bpe.h cuts SentencePiece-style words before each "▁" only when no merge makes a token with a
  // "▁" inside; here one does ("a▁"), so the word must be merged whole.
  Json j = MinimalTokenizerJson();
  j["model"] = Json::parse(R"({"type": "BPE", "vocab": {"a": 0, "\u2581": 1, "a\u2581": 2}, "merges": ["a \u2581"]})");
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromJson(j.dump());
  ASSERT_TRUE(tok.ok()) << tok.status();
  absl::StatusOr<std::vector<int32_t>> ids = (*tok)->Encode("a\u2581a");
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, (std::vector<int32_t>{2, 0}));
}

TEST(TokenizerTest, UnsupportedComponentsAreNamed) {
  struct Case {
    const char* pointer;
    const char* value;
    const char* named;
  };
  const Case cases[] = {
      {"/model/type", R"("Unigram")", "Unigram"},
      {"/model/dropout", "0.1", "dropout"},
      {"/model/continuing_subword_prefix", R"("##")", "continuing_subword_prefix"},
      {"/normalizer", R"({"type": "BertNormalizer"})", "BertNormalizer"},
      {"/normalizer", R"({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Precompiled"}]})",
       "Precompiled"},
      {"/pre_tokenizer", R"({"type": "Whitespace"})", "Whitespace"},
      {"/pre_tokenizer", R"({"type": "Sequence", "pretokenizers": [{"type": "ByteLevel"}, {"type": "Digits"}]})",
       "after ByteLevel"},
      {"/pre_tokenizer", R"({"type": "Split", "pattern": {"Regex": "[\\S]"}, "behavior": "Isolated", "invert": false})",
       "\\S inside"},
      {"/decoder", R"({"type": "WordPiece", "prefix": "##"})", "WordPiece"},
      {"/decoder", R"({"type": "Sequence", "decoders": [{"type": "Fuse"}, {"type": "ByteFallback"}]})", "after Fuse"},
      {"/post_processor", R"({"type": "RobertaProcessing"})", "RobertaProcessing"},
  };
  for (const Case& c : cases) {
    Json j = MinimalTokenizerJson();
    j[Json::json_pointer(c.pointer)] = Json::parse(c.value);
    const absl::Status status = LoadStatus(j);
    EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented) << c.pointer << " = " << c.value << ": " << status;
    EXPECT_NE(status.message().find(c.named), absl::string_view::npos) << status;
  }
}

TEST(TokenizerTest, MalformedFilesAreClearErrors) {
  EXPECT_EQ(Tokenizer::FromJson("{not json").status().code(), absl::StatusCode::kInvalidArgument);
  struct Case {
    const char* pointer;
    const char* value;
    const char* named;
  };
  const Case cases[] = {
      {"/model/merges", R"(["a c"])", "not in the vocab"},
      {"/model/merges", R"(["a b c"])", "one space"},
      {"/model/vocab/a", "-1", "vocab id"},
      {"/model/vocab", "[]", "'vocab'"},
      {"/model/unk_token", R"("<unk>")", "unk_token"},
      {"/added_tokens", R"([{"id": 5}])", "content"},
      {"/normalizer", R"({"type": "Replace", "pattern": {"Regex": "("}, "content": ""})", "does not compile"},
      {"/pre_tokenizer", R"({"type": "Split", "pattern": {"String": " "}, "behavior": "Sideways", "invert": false})",
       "Sideways"},
      {"/post_processor",
       R"({"type": "TemplateProcessing", "special_tokens": {},)"
       R"( "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]})",
       "<s>"},
  };
  for (const Case& c : cases) {
    Json j = MinimalTokenizerJson();
    j[Json::json_pointer(c.pointer)] = Json::parse(c.value);
    const absl::Status status = LoadStatus(j);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.pointer << " = " << c.value << ": " << status;
    EXPECT_NE(status.message().find(c.named), absl::string_view::npos) << status;
  }
  Json no_model = MinimalTokenizerJson();
  no_model.erase("model");
  EXPECT_EQ(LoadStatus(no_model).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Tokenizer::FromDirectory("/nonexistent").status().code(), absl::StatusCode::kNotFound);
}

// ---- Metadata --------------------------------------------------------------------------------

// The id of `token`, which must be in the tokenizer's vocabulary: where it is not, a failure (and -1).
int32_t IdOf(const Tokenizer& tok, std::string_view token) {
  const std::optional<int32_t> id = tok.TokenToId(token);
  EXPECT_TRUE(id.has_value()) << "'" << token << "' is not in the vocabulary";
  return id.value_or(-1);
}

TEST(TokenizerTest, BosAndEosComeFromTheConfigFiles) {
  std::unique_ptr<Tokenizer> llama3 = LoadKind("llama3");
  ASSERT_NE(llama3, nullptr);
  ASSERT_TRUE(llama3->bos_id().has_value()) << "llama3 has no bos id";
  EXPECT_EQ(*llama3->bos_id(), IdOf(*llama3, "<|begin_of_text|>"));
  // tokenizer_config.json's eos_token first, then generation_config.json's other ids.
  EXPECT_EQ(llama3->eos_ids(), (std::vector<int32_t>{IdOf(*llama3, "<|eot_id|>"), IdOf(*llama3, "<|end_of_text|>"),
                                                     IdOf(*llama3, "<|eom_id|>")}));
  EXPECT_TRUE(llama3->IsSpecial(IdOf(*llama3, "<|eot_id|>")));

  std::unique_ptr<Tokenizer> qwen2 = LoadKind("qwen2");
  ASSERT_NE(qwen2, nullptr);
  // bos_token is null in tokenizer_config.json; generation_config.json names <|endoftext|>.
  ASSERT_TRUE(qwen2->bos_id().has_value()) << "qwen2 has no bos id";
  EXPECT_EQ(*qwen2->bos_id(), IdOf(*qwen2, "<|endoftext|>"));
  EXPECT_EQ(qwen2->eos_ids(), (std::vector<int32_t>{IdOf(*qwen2, "<|im_end|>"), IdOf(*qwen2, "<|endoftext|>")}));
  const int32_t tool_call = IdOf(*qwen2, "<tool_call>");
  ASSERT_GE(tool_call, 0);
  EXPECT_FALSE(qwen2->IsSpecial(tool_call));  // added, not special

  std::unique_ptr<Tokenizer> llama2 = LoadKind("llama2");
  ASSERT_NE(llama2, nullptr);
  EXPECT_EQ(llama2->bos_id(), 1);
  EXPECT_EQ(llama2->eos_ids(), std::vector<int32_t>{2});
  EXPECT_EQ(llama2->IdToToken(3), "<0x00>");
  EXPECT_EQ(llama2->IdToToken(llama2->vocab_size()), std::nullopt);
}

}  // namespace
}  // namespace shardserve
