// coordinator/api/openai/harmony.h: gpt-oss's harmony output split into reasoning, content and tool
// calls, whole and streamed (in random pieces, split at every byte, a byte at a time, with calls
// whole or in pieces) giving the same; bad output (misplaced markers, unknown channels, a message
// cut short) defined and kept; the parser's names and its detection in a chat template.
#include <algorithm>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "coordinator/api/openai/harmony.h"
#include "coordinator/api/openai/protocol.h"
#include "coordinator/api/openai/reasoning.h"
#include "coordinator/api/openai/tool_calls.h"
#include "grammar/grammar.h"
#include "grammar/matcher.h"
#include "nlohmann/json.hpp"
#include "gtest/gtest.h"
#include "tests/output_chunkings.h"

namespace shardserve::openai {
namespace {

using Calls = std::vector<ToolCall>;

struct Case {
  const char* label;
  std::string text;
  std::string reasoning;
  std::string content;
  Calls calls;
  int max_calls = 16;
};

std::vector<Case> Cases() {
  const std::string next = "<|end|><|start|>assistant";
  return {
      {"analysis_then_final",
       "<|channel|>analysis<|message|>The user asks about the weather.<|end|><|start|>assistant<|channel|>final"
       "<|message|>It is sunny.",
       "The user asks about the weather.", "It is sunny.", {}},
      {"final_with_return", "<|channel|>final<|message|>Hi there<|return|>", "", "Hi there", {}},
      {"final_whitespace_kept", "<|channel|>final<|message|>  two\n\nlines  ", "", "  two\n\nlines  ", {}},
      {"call_recipient_after_channel",
       "<|channel|>analysis<|message|>Need the weather." + next +
           "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}",
       "Need the weather.", "", {{"get_weather", R"({"city":"Paris"})"}}},
      {"call_ended_by_call",
       "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>", "", "",
       {{"get_weather", R"({"city":"Paris"})"}}},
      {"call_recipient_before_channel",
       "<|channel|>analysis<|message|>x" + next +
           " to=functions.get_weather<|channel|>commentary json<|message|>{\"city\":\"Paris\", \"days\": 3}<|call|>",
       "x", "", {{"get_weather", R"({"city":"Paris","days":3})"}}},
      {"first_message_recipient", " to=functions.f<|channel|>commentary json<|message|>{}<|call|>", "", "", {{"f", "{}"}}},
      {"preamble_then_call",
       "<|channel|>commentary<|message|>Let me check." + next +
           "<|channel|>commentary to=functions.get_weather<|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>",
       "", "Let me check.", {{"get_weather", R"({"city":"Paris"})"}}},
      {"two_calls",
       "<|channel|>commentary to=functions.a json<|message|>{\"x\": 1}" + next +
           "<|channel|>commentary to=functions.b json<|message|>{\"y\": [1, 2.5, true, null], \"z\": {\"w\": \"\\n\"}}"
           "<|call|>",
       "", "", {{"a", R"({"x":1})"}, {"b", R"({"y":[1,2.5,true,null],"z":{"w":"\n"}})"}}},
      {"unicode_arguments", "<|channel|>commentary to=functions.f json<|message|>{\"city\": \"Zürich \\u00e9\"}<|call|>",
       "", "", {{"f", "{\"city\":\"Zürich é\"}"}}},
      {"call_in_analysis", "<|channel|>analysis to=functions.f code<|message|>{\"a\": 1}<|call|>", "", "",
       {{"f", R"({"a":1})"}}},
      {"builtin_recipient_is_its_channel",
       "<|channel|>analysis to=browser.search code<|message|>{\"query\": \"x\"}<|call|>", "{\"query\": \"x\"}", "", {}},
      {"calls_off_is_content", "<|channel|>commentary to=functions.f json<|message|>{\"a\": 1}<|call|>", "",
       "{\"a\": 1}", {}, 0},
      {"over_max_calls_dropped",
       "<|channel|>commentary to=functions.a json<|message|>{}" + next +
           "<|channel|>commentary to=functions.b json<|message|>{}<|call|>",
       "", "", {{"a", "{}"}}, 1},
      // Malformed arguments: the compact part of a well-formed start, then the rest as written.
      {"arguments_not_json", "<|channel|>commentary to=functions.f json<|message|>  hello world<|call|>", "", "",
       {{"f", "hello world"}}},
      {"arguments_bad_value", "<|channel|>commentary to=functions.f json<|message|>{\"a\": oops}<|call|>", "", "",
       {{"f", "{\"a\":oops}"}}},
      {"arguments_then_text", "<|channel|>commentary to=functions.f json<|message|>{\"a\": 1} extra <|call|>", "", "",
       {{"f", "{\"a\":1} extra "}}},
      {"arguments_then_whitespace", "<|channel|>commentary to=functions.f json<|message|>{\"a\": 1}\n<|call|>", "", "",
       {{"f", "{\"a\":1}"}}},
      {"arguments_empty", "<|channel|>commentary to=functions.f json<|message|><|call|>", "", "", {{"f", ""}}},
      {"functions_without_name", "<|channel|>commentary to=functions.<|message|>x<|call|>", "", "x", {}},
      // Cut short (max_tokens): what came is kept.
      {"truncated_call", "<|channel|>commentary to=functions.f json<|message|>{\"city\": \"Pa", "", "", {{"f", "{\"city\":\"Pa"}}},
      {"truncated_number", "<|channel|>commentary to=functions.f json<|message|>{\"n\": 12", "", "", {{"f", "{\"n\":12"}}},
      {"truncated_reasoning", "<|channel|>analysis<|message|>thinking about <|e", "thinking about <|e", "", {}},
      {"truncated_header", "<|channel|>analysis<|message|>r" + next + "<|channel|>fin", "r", "", {}},
      {"truncated_call_header", "<|channel|>commentary to=functions.get_wea", "", "", {}},
      // Markers in the wrong place, unknown channels, no harmony at all.
      {"unknown_channel", "<|channel|>notes<|message|>abc<|end|>", "", "abc", {}},
      {"no_channel", "<|message|>abc", "", "abc", {}},
      {"plain_text", "Hello world", "", "Hello world", {}},
      {"plain_text_prefix_of_recipient", "to", "", "to", {}},
      {"plain_text_then_message", "Hello <|channel|>final<|message|>Hi", "", "Hello Hi", {}},
      {"plain_lines", "Hi.\nto=me\n", "", "Hi.\nto=me\n", {}},
      {"markers_inside_body", "<|channel|>final<|message|>a<|message|>b<|constrain|>c<|x|>", "", "a<|message|>b<|constrain|>c<|x|>", {}},
      {"missing_end", "<|channel|>analysis<|message|>think<|start|>assistant<|channel|>final<|message|>ans", "think", "ans", {}},
      {"channel_without_start", "<|channel|>analysis<|message|>think<|channel|>final<|message|>ans", "think", "ans", {}},
      {"header_closed_by_end", "<|channel|>final<|end|><|channel|>final<|message|>ok", "", "ok", {}},
      {"stray_end_markers", "<|end|><|return|><|channel|>final<|message|>x<|end|><|end|>", "", "x", {}},
      {"text_after_end", "<|channel|>final<|message|>a<|end|>b c<|start|>assistant<|channel|>final<|message|>d", "", "ab cd", {}},
      {"empty", "", "", "", {}},
  };
}

// What a parser's deltas add up to: calls whole, or begun and grown by their pieces.
struct Joined {
  std::string reasoning, content;
  Calls calls;
  void Add(const HarmonyDelta& d) {
    reasoning += d.reasoning;
    content += d.content;
    calls.insert(calls.end(), d.calls.begin(), d.calls.end());
    for (const ToolCallPiece& p : d.pieces) {
      if (!p.name.empty()) {
        ASSERT_EQ(p.index, static_cast<int>(calls.size())) << "a call begun out of order";
        ASSERT_TRUE(p.arguments.empty()) << "a call's first piece has arguments";
        calls.push_back(ToolCall{p.name, ""});
      } else {
        ASSERT_GE(p.index, 0);
        ASSERT_LT(p.index, static_cast<int>(calls.size())) << "arguments of a call not begun";
        ASSERT_FALSE(p.arguments.empty()) << "an empty piece";
        calls[p.index].arguments += p.arguments;
      }
    }
  }
};

class HarmonyCase : public ::testing::TestWithParam<Case> {};

TEST_P(HarmonyCase, Whole) {
  const Case& c = GetParam();
  for (bool stream : {false, true}) {
    HarmonyParser parser(c.max_calls, stream);
    Joined joined;
    joined.Add(parser.Add(c.text));
    joined.Add(parser.Finish());
    EXPECT_EQ(joined.reasoning, c.reasoning) << "stream " << stream;
    EXPECT_EQ(joined.content, c.content) << "stream " << stream;
    EXPECT_EQ(joined.calls, c.calls) << "stream " << stream;
  }
}

// In 200 random chunkings, then two pieces split at every byte (inside every marker and UTF-8
// character), then a byte at a time; calls whole and in pieces: the same as the whole.
TEST_P(HarmonyCase, StreamedInPiecesJoinsToTheWhole) {
  const Case& c = GetParam();
  const std::vector<std::vector<absl::string_view>> chunkings = OutputChunkings(c.text, 2024);
  for (bool stream : {false, true}) {
    for (size_t trial = 0; trial < chunkings.size(); ++trial) {
      HarmonyParser parser(c.max_calls, stream);
      Joined joined;
      for (absl::string_view piece : chunkings[trial]) joined.Add(parser.Add(piece));
      joined.Add(parser.Finish());
      ASSERT_EQ(joined.reasoning, c.reasoning) << "trial " << trial << " stream " << stream;
      ASSERT_EQ(joined.content, c.content) << "trial " << trial << " stream " << stream;
      ASSERT_EQ(joined.calls, c.calls) << "trial " << trial << " stream " << stream;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Outputs, HarmonyCase, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.label); });

// Text is held back only while it may begin a marker; a call begins once its header is complete
// and its arguments come while they are written.
TEST(HarmonyParserTest, DeltasAsTheTextArrives) {
  HarmonyParser parser(16, /*stream_arguments=*/true);
  EXPECT_EQ(parser.Add("<|channel|>analysis<|mess").reasoning, "");
  EXPECT_EQ(parser.Add("age|>Thinking").reasoning, "Thinking");
  EXPECT_EQ(parser.Add(" hard <|").reasoning, " hard ");
  HarmonyDelta d = parser.Add("end|><|start|>assistant<|channel|>commentary to=functions.f json<|message|>");
  EXPECT_EQ(d.reasoning, "");
  ASSERT_EQ(d.pieces.size(), 1u);
  EXPECT_EQ(d.pieces[0], (ToolCallPiece{0, "f", ""}));
  d = parser.Add("{\"city\": \"Par");
  ASSERT_EQ(d.pieces.size(), 1u);
  EXPECT_EQ(d.pieces[0], (ToolCallPiece{0, "", "{\"city\":\"Par"}));
  d = parser.Add("is\"}");
  ASSERT_EQ(d.pieces.size(), 1u);
  EXPECT_EQ(d.pieces[0], (ToolCallPiece{0, "", "is\"}"}));
  d = parser.Finish();
  EXPECT_TRUE(d.pieces.empty());
  EXPECT_EQ(parser.calls_found(), 1);

  HarmonyParser content(16, false);
  EXPECT_EQ(content.Add("<|channel|>final<|message|>Hello").content, "Hello");
  EXPECT_EQ(content.Add(" wor<").content, " wor");
  EXPECT_EQ(content.Add("ld").content, "<ld");
}

TEST(HarmonyParserTest, ArgumentsOfAWholeBody) {
  EXPECT_EQ(HarmonyArguments(" {\"a\" : [1, {\"b\": null}]} "), R"({"a":[1,{"b":null}]})");
  EXPECT_EQ(HarmonyArguments("not json"), "not json");
  EXPECT_EQ(HarmonyArguments("{\"a\": 1"), R"({"a":1)");
  EXPECT_EQ(HarmonyArguments(""), "");
}

// The splitter the HTTP server uses: kHarmony parses the whole output, reasoning on.
TEST(HarmonyParserTest, OutputSplitter) {
  for (bool incremental : {false, true}) {
    OutputSplitter splitter(/*reasoning=*/false, /*reasoning_inside=*/false, ToolCallFormat::kHarmony, 4, nullptr,
                            incremental);
    EXPECT_TRUE(splitter.reasoning());
    OutputSplit a = splitter.Add("<|channel|>analysis<|message|>r<|end|><|start|>assistant<|channel|>final", false);
    OutputSplit b = splitter.Add("<|message|>done", true);
    EXPECT_EQ(a.reasoning + b.reasoning, "r");
    EXPECT_EQ(a.content + b.content, "done");
  }
  OutputSplitter calls(false, false, ToolCallFormat::kHarmony, 4);
  const OutputSplit s = calls.Add("<|channel|>commentary to=functions.f json<|message|>{\"a\": 1}", true);
  EXPECT_EQ(s.calls, (Calls{{"f", R"({"a":1})"}}));
  EXPECT_EQ(ChatFinishReason(v1::FINISH_REASON_STOP_TOKEN, !s.calls.empty()), std::string("tool_calls"));
}

// tool_choice "required" and named under harmony (HarmonyForcedToolConstraint): the grammar, over a
// vocabulary with harmony's markers as special tokens, first allows <|channel|> alone, and every
// random walk of it (a token drawn among those allowed until the end, <|call|> as EOS) is one call
// the harmony parser reads, to one of the request's tools, with arguments valid under its schema.
// A schema the grammar engine refuses is an error naming tool_choice.
TEST(HarmonyForcedCallTest, TheGrammarWritesOneCallTheParserReads) {
  std::vector<std::string> tokens;
  for (char c = ' '; c <= '~'; ++c) tokens.push_back(std::string(1, c));
  for (const char* t : {"commentary", " to", "=", "functions", ".", "get_weather", "json", "{\"", "\":", "\",\"", "city",
                        "days", "Paris", "\"}", "1", "7", "}", "<|channel|>", "<|constrain|>", "<|message|>", "<|end|>",
                        "<|call|>"}) {
    tokens.push_back(t);
  }
  const auto id_of = [&](const std::string& t) {
    return static_cast<int32_t>(std::find(tokens.begin(), tokens.end(), t) - tokens.begin());
  };
  std::vector<bool> special(tokens.size(), false);
  std::vector<std::string> bytes = tokens;
  for (const char* t : {"<|channel|>", "<|constrain|>", "<|message|>", "<|end|>", "<|call|>"}) {
    special[id_of(t)] = true;
    bytes[id_of(t)] = "";
  }
  const int32_t call = id_of("<|call|>");
  const auto vocab = std::make_shared<const grammar::TokenizerInfo>(bytes, special, std::vector<int32_t>{call},
                                                                    static_cast<int32_t>(tokens.size()));
  const HarmonyMarkers markers{.channel = id_of("<|channel|>"), .constrain = id_of("<|constrain|>"),
                               .message = id_of("<|message|>")};
  const std::string tools = R"("tools": [
      {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}},
      {"type": "function", "function": {"name": "now"}}])";
  for (const std::string choice : {R"("required")", R"({"type": "function", "function": {"name": "get_weather"}})"}) {
    SCOPED_TRACE(choice);
    absl::StatusOr<Request> r = ParseRequest(
        Endpoint::kChatCompletions,
        absl::StrCat(R"({"model": "m", "messages": [{"role": "user", "content": "hi"}], )", tools,
                     R"(, "tool_choice": )", choice, "}"));
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(HarmonyForcedToolConstraint(&*r, markers).ok());
    EXPECT_EQ(r->constraint_field, "tool_choice");
    ASSERT_TRUE(r->sampling.structured_output().has_grammar());
    absl::StatusOr<grammar::Grammar> g = grammar::ParseGbnf(r->sampling.structured_output().grammar());
    ASSERT_TRUE(g.ok()) << g.status() << "\n" << r->sampling.structured_output().grammar();
    absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>> compiled = grammar::CompiledGrammar::Compile(*g, vocab);
    ASSERT_TRUE(compiled.ok()) << compiled.status();
    std::set<std::string> names;
    for (uint32_t seed = 0; seed < 40; ++seed) {
      grammar::GrammarMatcher m(*compiled);
      std::mt19937 rng(seed);
      std::string text;
      std::vector<uint32_t> mask(m.mask_words());
      for (int step = 0; !m.IsTerminated(); ++step) {
        ASSERT_LT(step, 400) << "the walk did not end: " << text;
        m.FillNextTokenBitmask(mask.data());
        std::vector<int32_t> allowed;
        for (int32_t id = 0; id < static_cast<int32_t>(tokens.size()); ++id) {
          if ((mask[id / 32] >> (id % 32)) & 1) allowed.push_back(id);
        }
        ASSERT_FALSE(allowed.empty()) << text;
        if (step == 0) {
          EXPECT_EQ(allowed, std::vector<int32_t>{markers.channel});
        }
        // End as soon as the grammar allows it half the time; else any other allowed token.
        const bool end = std::find(allowed.begin(), allowed.end(), call) != allowed.end() && (allowed.size() == 1 || rng() % 2);
        std::erase(allowed, call);
        const int32_t pick = end ? call : allowed[rng() % allowed.size()];
        ASSERT_TRUE(m.AcceptToken(pick));
        text += tokens[pick];
      }
      OutputSplitter splitter(false, false, ToolCallFormat::kHarmony, 1);
      const OutputSplit split = splitter.Add(text, true);
      ASSERT_EQ(split.calls.size(), 1u) << text;
      EXPECT_EQ(split.content, "") << text;
      EXPECT_EQ(split.reasoning, "") << text;
      const ToolCall& c = split.calls[0];
      names.insert(c.name);
      if (c.name == "get_weather") {
        const nlohmann::json args = nlohmann::json::parse(c.arguments, nullptr, false);
        ASSERT_TRUE(args.is_object()) << text;
        ASSERT_TRUE(args.contains("city") && args["city"].is_string() && args["city"].get<std::string>().size() <= 8) << text;
        ASSERT_TRUE(args.contains("days") && args["days"].is_number_integer()) << text;
        EXPECT_GE(args["days"].get<int>(), 1);
        EXPECT_LE(args["days"].get<int>(), 7);
      } else {
        // any object ({"type": "object"}): its numbers may be past a double's range, which the
        // JSON grammar allows and nlohmann refuses, so only its shape is checked
        EXPECT_EQ(c.name, "now") << text;
        EXPECT_TRUE(c.arguments.starts_with("{") && c.arguments.ends_with("}")) << text;
      }
    }
    if (choice == R"("required")") {
      EXPECT_EQ(names, (std::set<std::string>{"get_weather", "now"}));
    } else {
      EXPECT_EQ(names, std::set<std::string>{"get_weather"});
    }
  }
  absl::StatusOr<Request> bad = ParseRequest(
      Endpoint::kChatCompletions,
      R"({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required", "tools": [
          {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]})");
  // Refused as the request is read, naming the tool's schema, under harmony as under any format.
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status())) << bad.status();
  EXPECT_EQ(ParamOf(bad.status()), "tools[0].function.parameters") << bad.status();
  // And by the harmony grammar itself, should a request reach it with such a schema.
  absl::StatusOr<Request> good = ParseRequest(
      Endpoint::kChatCompletions,
      R"({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required", "tools": [
          {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})");
  ASSERT_TRUE(good.ok()) << good.status();
  good->tools[0]["function"]["parameters"]["not"] = nlohmann::json::object();
  const absl::Status refused = HarmonyForcedToolConstraint(&*good, markers);
  EXPECT_TRUE(absl::IsInvalidArgument(refused)) << refused;
  EXPECT_EQ(ParamOf(refused), "tool_choice") << refused;
}

// vLLM's names for gpt-oss's parsers, and a chat template that writes harmony.
TEST(HarmonyParserTest, NamesAndTemplates) {
  EXPECT_EQ(*ToolCallFormatFromName("openai"), ToolCallFormat::kHarmony);
  EXPECT_STREQ(ToolCallFormatName(ToolCallFormat::kHarmony), "openai");
  EXPECT_EQ(*ReasoningFormatFromName("openai_gptoss"), ReasoningFormat::kHarmony);
  EXPECT_TRUE(KeepsSpecialTokens(ToolCallFormat::kHarmony));
  // The lines of gpt-oss's template that write an assistant's messages and the generation prompt.
  const std::string source =
      "{%- if message.thinking %}{{- \"<|start|>assistant<|channel|>analysis<|message|>\" + message.thinking + "
      "\"<|end|>\" }}{%- endif %}"
      "{{- \"<|start|>assistant to=\" + \"functions.\" + tool_call.name + \"<|channel|>commentary \" + "
      "(tool_call.content_type if tool_call.content_type is defined else \"json\") + \"<|message|>\" }}"
      "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}";
  EXPECT_EQ(ToolCallFormatOfTemplate(source), ToolCallFormat::kHarmony);
  EXPECT_EQ(ReasoningFormatOfTemplate(source), ReasoningFormat::kHarmony);
  EXPECT_TRUE(IsHarmonyTemplate(source));
  EXPECT_FALSE(IsHarmonyTemplate("{{ '<think>' }}<tool_call>"));
  // A ToolCallParser of the format passes the text through (harmony.h reads it).
  EXPECT_EQ(ParseToolCalls(ToolCallFormat::kHarmony, "<|channel|>final<|message|>x", 4).content,
            "<|channel|>final<|message|>x");
}

}  // namespace
}  // namespace shardserve::openai
