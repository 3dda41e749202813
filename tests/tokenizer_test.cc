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
#include "coordinator/tokenizer/pattern.h"
#include "coordinator/tokenizer/pre_tokenizer.h"
#include "coordinator/tokenizer/tiktoken.h"
#include "coordinator/tokenizer/unicode.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace shardserve {
namespace {

using Json = nlohmann::json;
using tokenizer_internal::FindInvalidUtf8;

// The pipelines of real checkpoints (GPT-2, Llama 3, Qwen2, Llama 2, Mistral, and Kimi K2's
// tiktoken.model), then two kinds made to cover the remaining supported components
// (tools/fixtures/make_tokenizer_fixtures.py says which).
const std::vector<std::string> kRealKinds = {"gpt2", "llama3", "qwen2", "llama2", "mistral", "kimi_k2"};
const std::vector<std::string> kAllKinds = {"gpt2",    "llama3",  "qwen2",              "llama2",
                                            "mistral", "kimi_k2", "features_bytelevel", "features_metaspace"};

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
    for (const Json& c : cases_["encode"]) {
      if (c["decoded"].is_null()) continue;  // kimi_k2's long runs record their ids only
      all.emplace_back(Ids(c["ids"]), c["decoded"], c["decoded_skip_special"]);
    }
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
  // wrong split (differently split bytes may still merge into the same ids). kimi_k2 has no
  // tokenizer.json: its pieces are those of Kimi's regex, as Python's `regex` module splits.
  std::ifstream in(FixtureDir(GetParam()) + "/tokenizer.json");
  const Json config = in ? Json::parse(in)["pre_tokenizer"] : Json();
  if (in && config.is_null()) {  // Llama 2: none in either implementation, so no pieces were recorded
    for (const Json& c : cases_["encode"]) EXPECT_FALSE(c.contains("pre_tokenized"));
    return;
  }
  absl::StatusOr<std::unique_ptr<tokenizer_internal::PreTokenizer>> pre =
      in ? tokenizer_internal::PreTokenizer::FromJson(config) : tokenizer_internal::KimiPreTokenizer();
  ASSERT_TRUE(pre.ok()) << pre.status();
  for (const Json& c : cases_["encode"]) {
    if (c["pre_tokenized"].is_null()) continue;  // kimi_k2's long runs
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

TEST(IncrementalDetokenizerTest, SkipsSpecialTokensButTheOnesItKeeps) {
  std::unique_ptr<Tokenizer> tok = LoadKind("kimi_k2");
  ASSERT_NE(tok, nullptr);
  absl::StatusOr<std::vector<int32_t>> ids = tok->Encode("<|im_user|>In the beginning<|im_middle|>God<|im_end|>", false);
  ASSERT_TRUE(ids.ok());
  const std::optional<int32_t> middle = tok->TokenToId("<|im_middle|>");
  ASSERT_TRUE(middle.has_value() && tok->IsSpecial(*middle));
  auto decode = [&](bool skip, std::vector<int32_t> kept) {
    IncrementalDetokenizer stream(*tok, skip, kept);
    std::string text;
    for (int32_t id : *ids) text += stream.Add(id);
    return text + stream.Finish();
  };
  EXPECT_EQ(decode(true, {}), "In the beginningGod");
  EXPECT_EQ(decode(true, {*middle}), "In the beginning<|im_middle|>God");
  EXPECT_EQ(decode(false, {*middle}), "<|im_user|>In the beginning<|im_middle|>God<|im_end|>");
  EXPECT_EQ(decode(true, {*middle}), decode(true, {0, *middle, 2100}));  // kept ids the output lacks change nothing
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


// ---- tiktoken.model (Kimi K2) -----------------------------------------------------------------

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// A tiktoken.model of the 256 bytes and then `more`, each "BASE64 RANK" on its own line.
std::string RanksFile(const std::vector<std::string>& more) {
  static constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  auto base64 = [](const std::string& bytes) {
    std::string out;
    for (size_t i = 0; i < bytes.size(); i += 3) {
      uint32_t v = static_cast<uint8_t>(bytes[i]) << 16;
      if (i + 1 < bytes.size()) v |= static_cast<uint8_t>(bytes[i + 1]) << 8;
      if (i + 2 < bytes.size()) v |= static_cast<uint8_t>(bytes[i + 2]);
      out += kAlphabet[(v >> 18) & 63];
      out += kAlphabet[(v >> 12) & 63];
      out += i + 1 < bytes.size() ? kAlphabet[(v >> 6) & 63] : '=';
      out += i + 2 < bytes.size() ? kAlphabet[v & 63] : '=';
    }
    return out;
  };
  std::string file;
  for (int b = 0; b < 256; ++b) file += absl::StrFormat("%s %d\n", base64(std::string(1, static_cast<char>(b))), b);
  for (size_t i = 0; i < more.size(); ++i) file += absl::StrFormat("%s %d\n", base64(more[i]), 256 + i);
  return file;
}

// For RanksFile({"ab", "bc", "abc"}): [BOS] and [EOS] take the first ids after the 259 ranks.
constexpr char kKimiConfig[] =
    R"({"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]},)"
    R"( "tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]",)"
    R"( "added_tokens_decoder": {"259": {"content": "[BOS]", "special": true},)"
    R"( "260": {"content": "[EOS]", "special": true}}})";
// The same class without named tokens, for other ranks.
constexpr char kKimiBareConfig[] =
    R"({"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]}})";

TEST(TiktokenTest, RanksMergeAsTiktokenMerges) {
  // The ids tiktoken gives with these ranks: a word that is a token is that token; otherwise the
  // lowest-ranked pair whose bytes together are a token merges first ("ab", then "ab"+"c").
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::FromTiktoken(RanksFile({"ab", "bc", "abc"}), kKimiConfig);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ(*(*tok)->Encode("abc"), (std::vector<int32_t>{258}));
  EXPECT_EQ(*(*tok)->Encode("abcd"), (std::vector<int32_t>{258, 'd'}));
  EXPECT_EQ(*(*tok)->Encode("xbc"), (std::vector<int32_t>{'x', 257}));
  // 258 special ids follow the ranks; no BOS is added; the unnamed ones are <|reserved_token_ID|>.
  EXPECT_EQ((*tok)->vocab_size(), 259 + 258);
  EXPECT_EQ(*(*tok)->Encode("[BOS]hi"), (std::vector<int32_t>{259, 'h', 'i'}));
  EXPECT_EQ(*(*tok)->Encode("<|reserved_token_516|>"), (std::vector<int32_t>{516}));
  EXPECT_EQ((*tok)->bos_id(), 259);
  EXPECT_TRUE((*tok)->IsSpecial(259));   // bos_token: skipped by skip_special_tokens
  EXPECT_FALSE((*tok)->IsSpecial(516));  // a reserved token is kept, as transformers keeps it
  EXPECT_EQ((*tok)->Decode({'x', 259, 257}, /*skip_special_tokens=*/true), "xbc");
}

TEST(TiktokenTest, KimiFixtureNamesItsTokens) {
  std::unique_ptr<Tokenizer> kimi = LoadKind("kimi_k2");
  ASSERT_NE(kimi, nullptr);
  const int32_t base = 2048;  // the fixture's ranks
  EXPECT_EQ(kimi->vocab_size(), base + 258);
  EXPECT_EQ(kimi->bos_id(), IdOf(*kimi, "[BOS]"));
  EXPECT_EQ(kimi->eos_ids(), (std::vector<int32_t>{IdOf(*kimi, "[EOS]"), IdOf(*kimi, "<|im_end|>")}));
  // Skipped when decoding without special tokens: bos, eos, unk, pad and additional_special_tokens;
  // the tool-call markers stay, for the kimi_k2 tool-call parser.
  for (const char* skipped : {"[BOS]", "[EOS]", "[UNK]", "[PAD]", "<|im_end|>", "<|im_middle|>"}) {
    EXPECT_TRUE(kimi->IsSpecial(IdOf(*kimi, skipped))) << skipped;
  }
  for (const char* kept : {"<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>"}) {
    EXPECT_FALSE(kimi->IsSpecial(IdOf(*kimi, kept))) << kept;
  }
  EXPECT_EQ(kimi->IdToToken(base + 257), "<|reserved_token_2305|>");  // not listed: named as the class names it
}

TEST(TiktokenTest, TextIsCutEvery400000Characters) {
  // TikTokenTokenizer encodes 400,000-character chunks apart: the piece " the" that straddles the
  // cut becomes " " and "the".
  std::unique_ptr<Tokenizer> kimi = LoadKind("kimi_k2");
  ASSERT_NE(kimi, nullptr);
  std::string text;
  for (int i = 0; i < 100'001; ++i) text += "the ";
  text += "end";
  const size_t cut = 400'000;
  absl::StatusOr<std::vector<int32_t>> whole = kimi->Encode(text), head = kimi->Encode(text.substr(0, cut)),
                                       tail = kimi->Encode(text.substr(cut));
  ASSERT_TRUE(whole.ok() && head.ok() && tail.ok());
  std::vector<int32_t> joined = *head;
  joined.insert(joined.end(), tail->begin(), tail->end());
  EXPECT_EQ(*whole, joined);
  // Uncut, " the" would be one token there.
  const std::vector<int32_t> space = *kimi->Encode(" "), the = *kimi->Encode("the"), space_the = *kimi->Encode(" the");
  ASSERT_EQ(space_the.size(), 1u);
  EXPECT_EQ(std::vector<int32_t>(head->end() - 1, head->end()), space);
  EXPECT_EQ(std::vector<int32_t>(tail->begin(), tail->begin() + the.size()), the);
  EXPECT_EQ(kimi->Decode(*whole), text);
}

TEST(TiktokenTest, MalformedRanksAreClearErrors) {
  struct Case {
    std::string file;
    const char* named;
  };
  const std::string good = RanksFile({"ab"});
  const Case cases[] = {
      {"", "holds no ranks"},
      {good + "YWJj\n", "line 258: must be a base64 token"},
      {good + "YWJj x\n", "the rank 'x'"},
      {good + "YWJj -1\n", "the rank '-1'"},
      {good + "!!!! 257\n", "not a base64 token"},
      {good + "YWJj 256\n", "rank 256 is given twice"},
      {good + "YWJj 300\n", "rank 257 is missing"},
      {good + "YWI= 257\n", "ranks 256 and 257 are the same bytes"},
      {RanksFile({}).substr(RanksFile({}).find('\n') + 1), "rank 0 is missing"},
  };
  for (const Case& c : cases) {
    const absl::Status status = Tokenizer::FromTiktoken(c.file, kKimiBareConfig).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.named << ": " << status;
    EXPECT_NE(status.message().find(c.named), absl::string_view::npos) << status;
  }
  // Every byte must be a token: tiktoken could not encode text holding a missing one.
  const std::string ranks = RanksFile({});
  std::string without;  // the 256 bytes but 0x41, ranked 0..254
  {
    int rank = 0;
    size_t begin = 0;
    for (int b = 0; b < 256; ++b) {
      const size_t end = ranks.find('\n', begin);
      const std::string line = ranks.substr(begin, end - begin);
      begin = end + 1;
      if (b == 0x41) continue;
      without += line.substr(0, line.find(' ')) + " " + std::to_string(rank++) + "\n";
    }
  }
  const absl::Status missing = Tokenizer::FromTiktoken(without, kKimiBareConfig).status();
  EXPECT_NE(missing.message().find("byte 0x41 is not a token"), absl::string_view::npos) << missing;
}

TEST(TiktokenTest, OnlyTheKnownClassIsRead) {
  const std::string ranks = RanksFile({"ab", "bc", "abc"});
  absl::Status no_config = Tokenizer::FromTiktoken(ranks, "").status();
  EXPECT_NE(no_config.message().find("needs tokenizer_config.json"), absl::string_view::npos) << no_config;
  absl::Status qwen = Tokenizer::FromTiktoken(
      ranks, R"({"auto_map": {"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", null]}, "tokenizer_class": "QWenTokenizer"})")
                          .status();
  EXPECT_EQ(qwen.code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(qwen.message().find("'tokenization_qwen.QWenTokenizer' (tokenizer_class 'QWenTokenizer')"),
            absl::string_view::npos)
      << qwen;
  // The class's own file, when the checkpoint has it, must hold the regex implemented here.
  const std::string kimi_py = ReadText(SHARDSERVE_SOURCE_DIR "/tools/fixtures/make_tokenizer_fixtures.py");
  EXPECT_TRUE(Tokenizer::FromTiktoken(ranks, kKimiConfig, "", kimi_py).ok());
  absl::Status other_regex = Tokenizer::FromTiktoken(ranks, kKimiConfig, "", "pat_str = r'\\p{L}+'").status();
  EXPECT_EQ(other_regex.code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(other_regex.message().find("is not the one shardserve implements"), absl::string_view::npos) << other_regex;
  // Named special tokens must take the ids after the ranks.
  Json config = Json::parse(kKimiConfig);
  config["added_tokens_decoder"]["12"] = {{"content", "<x>"}, {"special", true}};
  absl::Status low = Tokenizer::FromTiktoken(ranks, config.dump()).status();
  EXPECT_NE(low.message().find("added_tokens_decoder '12': must be an id in [259, 517)"), absl::string_view::npos)
      << low;
}

TEST(TiktokenTest, ClassIntersectionsAndScriptsAsTheOtherEnginesMatch) {
  auto matches = [](std::string_view pattern, std::string_view text) {
    std::vector<std::string> out;
    absl::StatusOr<std::unique_ptr<tokenizer_internal::Pattern>> p = tokenizer_internal::Pattern::Regex(pattern);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return out;
    EXPECT_TRUE((*p)->ForEachMatch(text, [&](size_t b, size_t e) { out.emplace_back(text.substr(b, e - b)); }).ok());
    return out;
  };
  EXPECT_EQ(matches("[a-z&&[^aeiou]]+", "strengths are"), (std::vector<std::string>{"str", "ngths", "r"}));
  EXPECT_EQ(matches("[a-z&&[b-d]]+", "abcde"), (std::vector<std::string>{"bcd"}));
  EXPECT_EQ(matches("[\\p{L}&&[^\\p{Han}]]+", "ab漢字cd"), (std::vector<std::string>{"ab", "cd"}));
  // U+3002 is Han by Script_Extensions only: not Han here, as in Oniguruma, Rust's regex and Python's.
  EXPECT_EQ(matches("\\p{Han}+", "汉字。"), (std::vector<std::string>{"汉字"}));
  EXPECT_EQ(matches("[\\s\\p{Han}]+", "a 汉。"), (std::vector<std::string>{" 汉"}));
  // Only the escape is a property: "p{Han}" after another character, or after an escaped backslash, is text.
  EXPECT_EQ(matches("xp{Han}|\\\\p{Han}", "xp{Han} \\p{Han}"), (std::vector<std::string>{"xp{Han}", "\\p{Han}"}));
  for (const char* unsupported : {"[^a-z&&[^b]]", "[a[b]&&c]", "[a&&]"}) {
    const absl::Status status = tokenizer_internal::Pattern::Regex(unsupported).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented) << unsupported << ": " << status;
  }
}

}  // namespace
}  // namespace shardserve
