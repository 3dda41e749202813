// The coordinator's request logic (coordinator/engine/generation.h, and its checks at the edge,
// coordinator/api/request_validation.h) without processes: the steps a request needs, the text it
// streams (stop strings held back, never streamed), finish reasons and usage. The fixtures have no
// tokenizer.json, so the text path is tested here with a tiny one.
#include "coordinator/engine/generation.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/field_error.h"
#include "coordinator/api/request_validation.h"
#include "gtest/gtest.h"
#include "tests/slow_schema.h"

namespace shardserve {
namespace {

// Characters as tokens, decoded by concatenation; id 9 is a special EOS.
constexpr char kTinyTokenizer[] = R"({
  "version": "1.0",
  "added_tokens": [{"id": 9, "content": "</s>", "special": true}],
  "normalizer": null, "pre_tokenizer": null, "post_processor": null,
  "decoder": {"type": "Fuse"},
  "model": {"type": "BPE", "vocab": {"h": 0, "e": 1, "l": 2, "o": 3, " ": 4, "S": 5, "T": 6, "P": 7, "!": 8},
            "merges": []}
})";
constexpr int32_t kH = 0, kE = 1, kL = 2, kO = 3, kSpace = 4, kS = 5, kT = 6, kP = 7, kBang = 8, kEos = 9;

std::unique_ptr<Tokenizer> TinyTokenizer() {
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::FromJson(kTinyTokenizer);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

// Feeds `ids` as the sampled tokens; returns the streamed text and the last response.
struct Fed {
  std::string text;
  std::vector<int32_t> tokens;
  v1::GenerateResponse last;
  int accepted = 0;
};
Fed Feed(Generation& g, const std::vector<int32_t>& ids) {
  Fed r;
  for (int32_t id : ids) {
    ++r.accepted;
    const bool done = g.Accept(id, &r.last);
    r.text += r.last.text();
    r.tokens.insert(r.tokens.end(), r.last.token_ids().begin(), r.last.token_ids().end());
    if (done) break;
  }
  return r;
}

TEST(StopStringFilterTest, HoldsBackWhatMayStartAStopStringAndCutsAtIt) {
  StopStringFilter f({"STOP", "!!"});
  bool stopped = false;
  EXPECT_EQ(f.Add("hello S", &stopped), "hello ");  // "S" may start "STOP"
  EXPECT_FALSE(stopped);
  EXPECT_EQ(f.Add("T", &stopped), "");  // "ST" still may
  EXPECT_EQ(f.Add("x", &stopped), "STx");  // it was not one after all
  EXPECT_EQ(f.Add("ab!", &stopped), "ab");
  EXPECT_EQ(f.Add("!tail", &stopped), "");  // "!!" appeared: nothing of it or after it
  EXPECT_TRUE(stopped);
}

TEST(StopStringFilterTest, FlushReleasesHeldTextAtTheEnd) {
  StopStringFilter f({"STOP"});
  bool stopped = false;
  EXPECT_EQ(f.Add("oh ST", &stopped), "oh ");
  EXPECT_EQ(f.Flush(), "ST");
}

TEST(StopStringFilterTest, EarliestStopStringWins) {
  StopStringFilter f({"lo", "hel"});
  bool stopped = false;
  EXPECT_EQ(f.Add("hello", &stopped), "");
  EXPECT_TRUE(stopped);
}

TEST(StopStringFilterTest, KeepingTheStopStringHoldsNothingBackAndCutsAfterIt) {
  StopStringFilter f({"STOP", "!!"}, /*keep=*/true);
  bool stopped = false;
  EXPECT_EQ(f.Add("hello S", &stopped), "hello S");  // handed out at once
  EXPECT_FALSE(stopped);
  EXPECT_EQ(f.Add("T", &stopped), "T");
  EXPECT_EQ(f.Add("OP and more", &stopped), "OP");  // "STOP" completed across three pieces
  EXPECT_TRUE(stopped);
  StopStringFilter g({"lo", "hel"}, /*keep=*/true);
  EXPECT_EQ(g.Add("xhello", &stopped), "xhel");  // the earliest one, up to its end
  EXPECT_TRUE(stopped);
  StopStringFilter h({"end"}, /*keep=*/true);
  EXPECT_EQ(h.Add("the en", &stopped), "the en");
  EXPECT_EQ(h.Add("d", &stopped), "d");
  EXPECT_TRUE(stopped);
  StopStringFilter none({}, /*keep=*/true);
  EXPECT_EQ(none.Add("abc", &stopped), "abc");
  EXPECT_EQ(none.Flush(), "");
  StopStringFilter flushed({"STOP"}, /*keep=*/true);
  EXPECT_EQ(flushed.Add("oh ST", &stopped), "oh ST");
  EXPECT_EQ(flushed.Flush(), "");  // nothing was held
}

GenerationParams Params(std::vector<int32_t> prompt, int max_tokens) {
  GenerationParams p;
  p.request_id = "test";
  p.prompt = std::move(prompt);
  p.max_tokens = max_tokens;
  return p;
}

TEST(GenerationTest, FinishesAtMaxTokensWithUsage) {
  const GenerationParams p = Params({1, 2, 3, 4, 5}, 3);
  const std::vector<int32_t> eos;
  Generation g(p, eos, nullptr);
  v1::GenerateResponse response;
  EXPECT_FALSE(g.Accept(42, &response));
  EXPECT_EQ(response.finish_reason(), v1::FINISH_REASON_UNSPECIFIED);
  EXPECT_FALSE(g.Accept(43, &response));
  EXPECT_TRUE(g.Accept(44, &response));
  EXPECT_EQ(std::vector<int32_t>(response.token_ids().begin(), response.token_ids().end()), (std::vector<int32_t>{44}));
  EXPECT_EQ(response.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(response.usage().prompt_tokens(), 5);
  EXPECT_EQ(response.usage().completion_tokens(), 3);
}

TEST(GenerationTest, StreamsTextAndNeverAStopString) {
  std::unique_ptr<Tokenizer> tok = TinyTokenizer();
  ASSERT_NE(tok, nullptr);
  GenerationParams p = Params({kH}, 20);
  p.stop = {"ST!"};
  const std::vector<int32_t> eos = {kEos};
  Generation g(p, eos, tok.get());
  const Fed r = Feed(g, {kE, kL, kL, kO, kSpace, kS, kT, kBang, kP, kBang});
  EXPECT_EQ(r.text, "ello ");
  EXPECT_EQ(r.accepted, 8) << "stops at the token that completes the stop string";
  EXPECT_EQ(r.last.finish_reason(), v1::FINISH_REASON_STOP_STRING);
  EXPECT_EQ(r.last.usage().completion_tokens(), 8);
}

TEST(GenerationTest, HeldTextThatIsNoStopStringIsStreamedAtTheEnd) {
  std::unique_ptr<Tokenizer> tok = TinyTokenizer();
  ASSERT_NE(tok, nullptr);
  GenerationParams p = Params({kH}, 3);
  p.stop = {"STOP"};
  const std::vector<int32_t> eos = {kEos};
  Generation g(p, eos, tok.get());
  const Fed r = Feed(g, {kO, kS, kT});
  EXPECT_EQ(r.text, "oST");
  EXPECT_EQ(r.last.text(), "ST");
  EXPECT_EQ(r.last.finish_reason(), v1::FINISH_REASON_LENGTH);
}

TEST(GenerationTest, EosStopsUnlessIgnoredAndIsNotStreamedAsText) {
  std::unique_ptr<Tokenizer> tok = TinyTokenizer();
  ASSERT_NE(tok, nullptr);
  const std::vector<int32_t> eos = {kEos};
  GenerationParams p = Params({kH}, 5);
  Generation stops(p, eos, tok.get());
  Fed r = Feed(stops, {kE, kEos, kL});
  EXPECT_EQ(r.tokens, (std::vector<int32_t>{kE, kEos}));
  EXPECT_EQ(r.text, "e");
  EXPECT_EQ(r.last.finish_reason(), v1::FINISH_REASON_STOP_TOKEN);

  p.ignore_eos = true;
  Generation ignores(p, eos, tok.get());
  r = Feed(ignores, {kE, kEos, kL, kL, kO});
  EXPECT_EQ(r.text, "ello");
  EXPECT_EQ(r.last.finish_reason(), v1::FINISH_REASON_LENGTH);
}

TEST(GenerationTest, SpecialTokensKeptWhenAskedButNeverTheEndingEos) {
  std::unique_ptr<Tokenizer> tok = TinyTokenizer();
  ASSERT_NE(tok, nullptr);
  const std::vector<int32_t> eos = {kEos};
  GenerationParams p = Params({kH}, 5);
  p.skip_special_tokens = false;  // a tool-call format whose markers are special tokens
  Generation stops(p, eos, tok.get());
  Fed r = Feed(stops, {kE, kEos});
  EXPECT_EQ(r.text, "e");  // the EOS that ends the output is not text
  EXPECT_EQ(r.last.finish_reason(), v1::FINISH_REASON_STOP_TOKEN);
  p.ignore_eos = true;
  Generation keeps(p, eos, tok.get());
  r = Feed(keeps, {kE, kEos, kL});
  EXPECT_EQ(r.text, "e</s>l");  // a special token that does not end it is
}

TEST(GenerationTest, StopTokenIdsStopAndAreReturned) {
  GenerationParams p = Params({1}, 10);
  p.stop_token_ids = {7};
  const std::vector<int32_t> eos;
  Generation g(p, eos, nullptr);
  const Fed r = Feed(g, {3, 7, 8});
  EXPECT_EQ(r.tokens, (std::vector<int32_t>{3, 7}));
  EXPECT_EQ(r.last.finish_reason(), v1::FINISH_REASON_STOP_TOKEN);
  EXPECT_EQ(r.last.usage().completion_tokens(), 2);
}

// ---- PrepareGeneration: the checks at the edge -----------------------------------------------

// The tiny tokenizer's model: 10 ids; `with_tokenizer` false is a checkpoint without tokenizer.json.
std::unique_ptr<ServedModel> TinyModel(bool with_tokenizer = true) {
  auto m = std::make_unique<ServedModel>();
  m->name = "tiny";
  m->config.vocab_size = 10;
  if (with_tokenizer) m->tokenizer = TinyTokenizer();
  return m;
}

// Checks that `request` is refused with InvalidArgument whose message has every one of `expected`,
// and that the refusal carries its field (base/field_error.h): the message is "field: message".
void ExpectRefused(const v1::GenerateRequest& request, const ServedModel& model, int64_t max_model_len,
                   const std::vector<std::string>& expected, const std::string& what) {
  absl::StatusOr<GenerationParams> p = PrepareGeneration(request, model, max_model_len, "req-1");
  ASSERT_FALSE(p.ok()) << what << " was accepted";
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << what;
  const std::optional<FieldError> field = FieldErrorOf(p.status());
  ASSERT_TRUE(field.has_value()) << what << ": no field in " << p.status();
  EXPECT_EQ(absl::StrCat(field->field, ": ", field->message), p.status().message()) << what;
  for (const std::string& e : expected) {
    EXPECT_NE(p.status().message().find(e), std::string::npos)
        << what << ": '" << p.status().message() << "' does not say '" << e << "'";
  }
}

TEST(PrepareGenerationTest, LogitBiasAndMinTokens) {
  const std::unique_ptr<ServedModel> model = TinyModel();
  v1::GenerateRequest r;
  r.mutable_token_ids()->add_ids(kH);
  r.mutable_sampling()->set_max_tokens(4);
  (*r.mutable_sampling()->mutable_logit_bias())[kL] = 100;
  (*r.mutable_sampling()->mutable_logit_bias())[kE] = -2.5f;
  r.mutable_sampling()->set_min_tokens(2);
  r.mutable_sampling()->add_stop_token_ids(kBang);
  absl::StatusOr<GenerationParams> p = PrepareGeneration(r, *model, 64, "req-1");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->logit_bias, (std::vector<std::pair<int32_t, float>>{{kE, -2.5f}, {kL, 100.0f}}));
  const v1::RowSampling rs = SamplingTemplate(*p);
  EXPECT_EQ(rs.min_tokens(), 2);
  ASSERT_EQ(rs.logit_bias_ids_size(), 2);
  // The ids banned before min_tokens: the model's EOS and the stop ids.
  std::vector<int32_t> banned(rs.min_tokens_banned_ids().begin(), rs.min_tokens_banned_ids().end());
  std::vector<int32_t> want = model->eos_ids;
  want.push_back(kBang);
  std::sort(want.begin(), want.end());
  EXPECT_EQ(banned, want);

  v1::GenerateRequest bad = r;
  (*bad.mutable_sampling()->mutable_logit_bias())[10] = 1;
  ExpectRefused(bad, *model, 64, {"sampling.logit_bias: token id 10 is outside the vocabulary [0, 10)"}, "id 10");
  bad = r;
  (*bad.mutable_sampling()->mutable_logit_bias())[kO] = -100.5f;
  ExpectRefused(bad, *model, 64, {"sampling.logit_bias: the bias of token id 3 must be in [-100, 100]"}, "bias");
  bad = r;
  bad.mutable_sampling()->set_min_tokens(5);
  ExpectRefused(bad, *model, 64, {"sampling.min_tokens: must be in [0, max_tokens 4], got 5"}, "min_tokens");
}

TEST(PrepareGenerationTest, InvalidUtf8InTextIsInvalidArgumentNamingTheFieldAndTheOffset) {
  const std::unique_ptr<ServedModel> model = TinyModel();
  const std::unique_ptr<ServedModel> no_tokenizer = TinyModel(/*with_tokenizer=*/false);
  v1::GenerateRequest r;
  r.set_text("hel\xFFlo");
  ExpectRefused(r, *model, 64, {"prompt.text: not valid UTF-8: byte 0xFF at offset 3"}, "text");
  // The text is checked whatever the model: the answer does not depend on tokenizer.json.
  ExpectRefused(r, *no_tokenizer, 64, {"prompt.text: not valid UTF-8: byte 0xFF at offset 3"}, "text, no tokenizer");
  r.set_text("he\xC3");  // a character cut short
  ExpectRefused(r, *model, 64, {"prompt.text", "byte 0xC3 at offset 2"}, "truncated character");

  r.set_text("hello");
  r.mutable_sampling()->add_stop("STOP");
  r.mutable_sampling()->add_stop("S\xED\xA0\x80");  // a UTF-16 surrogate: never in decoded text
  ExpectRefused(r, *model, 64, {"sampling.stop[1]: not valid UTF-8: byte 0xED at offset 1"}, "stop string");

  v1::GenerateRequest id;
  id.set_text("hello");
  id.set_request_id("req\xFF");
  ExpectRefused(id, *model, 64, {"request_id"}, "request_id");
  id.set_request_id("two\nlines");
  ExpectRefused(id, *model, 64, {"request_id"}, "request_id with a newline");
  EXPECT_FALSE(IsValidRequestId("req\xFF"));
  EXPECT_TRUE(IsValidRequestId("req-7"));

  // Valid UTF-8 text and stop strings pass.
  v1::GenerateRequest good;
  good.set_text("hello");
  good.mutable_sampling()->add_stop("lo");
  absl::StatusOr<GenerationParams> p = PrepareGeneration(good, *model, 64, "req-1");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->prompt, (std::vector<int32_t>{kH, kE, kL, kL, kO}));
  EXPECT_EQ(p->stop, (std::vector<std::string>{"lo"}));
}

TEST(PrepareGenerationTest, APromptThatFillsTheContextIsReportedAgainstThePrompt) {
  const std::unique_ptr<ServedModel> model = TinyModel();
  auto ids = [](int n, int max_tokens) {
    v1::GenerateRequest r;
    for (int i = 0; i < n; ++i) r.mutable_token_ids()->add_ids(i % 10);
    r.mutable_sampling()->set_max_tokens(max_tokens);
    return r;
  };
  // The prompt alone does not fit: the prompt is named, with both numbers, whatever max_tokens is.
  for (int n : {8, 9, 100}) {
    for (int max_tokens : {0, 1, 5}) {
      const std::string what = absl::StrCat(n, " prompt tokens, max_tokens ", max_tokens);
      ExpectRefused(ids(n, max_tokens), *model, 8,
                    {absl::StrCat("prompt: its ", n, " tokens do not fit max_model_len 8"), "at most 7 tokens"}, what);
      absl::StatusOr<GenerationParams> p = PrepareGeneration(ids(n, max_tokens), *model, 8, "req-1");
      EXPECT_EQ(p.status().message().find("max_tokens"), std::string::npos) << what << ": " << p.status();
    }
  }
  v1::GenerateRequest text;
  text.set_text("hellohello");  // 10 tokens
  ExpectRefused(text, *model, 10, {"prompt: its 10 tokens do not fit max_model_len 10"}, "text prompt");
  // The prompt fits but not with max_tokens: max_tokens is named, with the numbers.
  ExpectRefused(ids(7, 2), *model, 8,
                {"sampling.max_tokens: the prompt's 7 tokens + max_tokens 2 = 9 exceed max_model_len 8"}, "7 + 2");
  ExpectRefused(ids(1, 0), *model, 8, {"sampling.max_tokens", "+ max_tokens 16 = 17"}, "the default max_tokens");
  // Both fit.
  absl::StatusOr<GenerationParams> p = PrepareGeneration(ids(7, 1), *model, 8, "req-1");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->prompt.size(), 7u);
  EXPECT_EQ(p->max_tokens, 1);
}

// ---- Structured outputs: compiled on the coordinator, cached ---------------------------------

const std::string kDemoDir = std::string(SHARDSERVE_SOURCE_DIR) + "/models/demo";

v1::StructuredOutput Regex(const std::string& regex) {
  v1::StructuredOutput so;
  so.set_regex(regex);
  return so;
}

TEST(StructuredOutputCompilerTest, CompilesOnceAndCachesByKindAndText) {
  absl::StatusOr<std::unique_ptr<ServedModel>> model = ServedModel::Open(kDemoDir);
  ASSERT_TRUE(model.ok()) << model.status();
  StructuredOutputCompiler& c = *(*model)->structured;
  absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>> a = c.Get(Regex("[0-9]+"));
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>> again = c.Get(Regex("[0-9]+"));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(a->get(), again->get());
  EXPECT_EQ(c.compiles(), 1);
  EXPECT_EQ(c.hits(), 1);
  // The same text as another kind is another grammar.
  v1::StructuredOutput as_grammar;
  as_grammar.set_grammar("[0-9]+");
  EXPECT_FALSE(c.Get(as_grammar).ok());  // not GBNF
  v1::StructuredOutput choice;
  choice.mutable_choices()->add_choices("[0-9]+");
  absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>> literal = c.Get(choice);
  ASSERT_TRUE(literal.ok());
  EXPECT_NE(literal->get(), a->get());
  // The vocabulary is the model's: the mask is as wide as config.json's vocab_size, and the grammar's
  // first token is a digit.
  grammar::GrammarMatcher m(*a);
  EXPECT_EQ(m.mask_words(), ((*model)->config.vocab_size + 31) / 32);
  // PrepareGeneration hands the cached grammar to the request.
  v1::GenerateRequest r;
  r.mutable_token_ids()->add_ids(5);
  r.mutable_sampling()->set_max_tokens(4);
  *r.mutable_sampling()->mutable_structured_output() = Regex("[0-9]+");
  absl::StatusOr<GenerationParams> p = PrepareGeneration(r, **model, 512, "req-1");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->grammar.get(), a->get());
  // Past kStructuredCacheEntries other grammars, the first is compiled again.
  const int64_t before = c.compiles();
  for (size_t i = 0; i < kStructuredCacheEntries; ++i) ASSERT_TRUE(c.Get(Regex(absl::StrCat("a{", i + 1, "}"))).ok());
  EXPECT_EQ(c.compiles(), before + static_cast<int64_t>(kStructuredCacheEntries));
  ASSERT_TRUE(c.Get(Regex("[0-9]+")).ok());
  EXPECT_EQ(c.compiles(), before + static_cast<int64_t>(kStructuredCacheEntries) + 1);
}

TEST(StructuredOutputCompilerTest, RefusesWhatItCannotCompile) {
  absl::StatusOr<std::unique_ptr<ServedModel>> model = ServedModel::Open(kDemoDir);
  ASSERT_TRUE(model.ok()) << model.status();
  v1::GenerateRequest r;
  r.mutable_token_ids()->add_ids(5);
  r.mutable_sampling()->set_max_tokens(4);
  v1::StructuredOutput* so = r.mutable_sampling()->mutable_structured_output();
  so->set_json_schema(R"({"type": "object", "properties": {"a": {"type": "string", "contentEncoding": "base64"}}})");
  ExpectRefused(r, **model, 512, {"sampling.structured_output.json_schema", "contentEncoding"}, "an unsupported keyword");
  so->set_regex("(a)\\1");
  ExpectRefused(r, **model, 512, {"sampling.structured_output.regex"}, "a back-reference");

  // The compile-time bound: a compile that takes longer is refused, naming the bound.
  StructuredOutputCompiler hasty((*model)->tokenizer.get(), static_cast<int32_t>((*model)->config.vocab_size),
                                 (*model)->eos_ids, absl::Nanoseconds(1));
  v1::StructuredOutput schema;
  schema.set_json_schema(R"({"type": "array", "items": {"type": "string", "maxLength": 50}, "maxItems": 20})");
  absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>> late = hasty.Get(schema);
  ASSERT_FALSE(late.ok());
  EXPECT_EQ(late.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(late.status().message().find("compile-time bound"), std::string::npos) << late.status();

  // The compile past the bound is cancelled: its thread ends long before the compile would have
  // (a schema of many character classes, timed whole by a patient compiler first; its properties
  // doubled until it takes 300 ms, so that a fast machine shows the cancellation too).
  v1::StructuredOutput slow;
  absl::Duration whole;
  absl::Time start;
  for (int n = 150; n <= 600; n *= 2) {
    slow.set_json_schema(ManyClassesSchema(n));
    StructuredOutputCompiler patient((*model)->tokenizer.get(), static_cast<int32_t>((*model)->config.vocab_size),
                                     (*model)->eos_ids, absl::Seconds(120));
    start = absl::Now();
    ASSERT_TRUE(patient.Get(slow).ok()) << n << " properties";
    whole = absl::Now() - start;
    if (whole > absl::Milliseconds(300)) break;
  }
  ASSERT_GT(whole, absl::Milliseconds(300)) << "the schema compiles too fast to show a cancellation";
  ASSERT_FALSE(hasty.Get(slow).ok());
  start = absl::Now();
  while (hasty.compiles_running() > 0 && absl::Now() - start < whole) absl::SleepFor(absl::Milliseconds(2));
  EXPECT_EQ(hasty.compiles_running(), 0);
  EXPECT_LT(absl::Now() - start, whole / 2) << "whole compile " << whole;

  // A Metaspace (SentencePiece-style) tokenizer: its tokens' bytes come from its decoder's steps
  // (byte-fallback <0xXX> tokens, the Metaspace character as a space), so it is served too.
  absl::StatusOr<std::unique_ptr<Tokenizer>> metaspace =
      Tokenizer::FromDirectory(std::string(SHARDSERVE_SOURCE_DIR) + "/tests/fixtures/tokenizers/llama2");
  ASSERT_TRUE(metaspace.ok()) << metaspace.status();
  StructuredOutputCompiler llama((*metaspace).get(), (*metaspace)->vocab_size(), std::vector<int32_t>{2},
                                 kDefaultGrammarCompileTimeout);
  v1::StructuredOutput digits;
  digits.set_regex("[0-9]+");
  EXPECT_TRUE(llama.Get(digits).ok()) << llama.Get(digits).status();
  // No tokenizer: refused.
  so->set_regex("[0-9]+");
  const std::unique_ptr<ServedModel> bare = TinyModel(/*with_tokenizer=*/false);
  bare->structured = std::make_unique<StructuredOutputCompiler>(nullptr, 10, std::vector<int32_t>{}, kDefaultGrammarCompileTimeout);
  r.mutable_token_ids()->set_ids(0, 1);
  ExpectRefused(r, *bare, 512, {"sampling.structured_output.regex", "tokenizer"}, "no tokenizer");
}

}  // namespace
}  // namespace shardserve
