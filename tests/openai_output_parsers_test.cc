// coordinator/api/openai/tool_calls.h and reasoning.h: each format's calls and reasoning from whole
// outputs (text before a call, several calls, malformed JSON staying content), and every output
// streamed in random pieces giving, joined, what the whole gives.
#include <random>
#include <string>
#include <vector>

#include "coordinator/api/openai/reasoning.h"
#include "coordinator/api/openai/tool_calls.h"
#include "gtest/gtest.h"

namespace shardserve::openai {
namespace {

using Calls = std::vector<ToolCall>;

struct Case {
  const char* label;
  ToolCallFormat format;
  std::string text;
  std::string content;
  Calls calls;
};

std::vector<Case> Cases() {
  const auto H = ToolCallFormat::kHermes;
  const auto L = ToolCallFormat::kLlama3Json;
  const auto M = ToolCallFormat::kMistral;
  const std::string weather = R"({"city":"Paris"})";
  return {
      {"hermes_one", H, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
       "", {{"get_weather", weather}}},
      {"hermes_text_before", H,
       "Let me look.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
       "Let me look.", {{"get_weather", weather}}},
      {"hermes_two", H,
       "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", "
       "\"arguments\": {\"x\": [1, \"}\"]}}\n</tool_call>",
       "", {{"a", "{}"}, {"b", R"({"x":[1,"}"]})"}}},
      {"hermes_unclosed_last", H, "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"k\": 1}}", "", {{"a", R"({"k":1})"}}},
      {"hermes_string_arguments", H, "<tool_call>{\"name\": \"a\", \"arguments\": \"{\\\"k\\\": 2}\"}</tool_call>", "",
       {{"a", R"({"k":2})"}}},
      {"hermes_malformed_stays_content", H, "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"k\": }\n</tool_call>",
       "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"k\": }\n</tool_call>", {}},
      {"hermes_no_name_stays_content", H, "say <tool_call>{\"arguments\": {}}</tool_call> ok",
       "say <tool_call>{\"arguments\": {}}</tool_call> ok", {}},
      {"hermes_text_after", H, "<tool_call>{\"name\": \"a\"}</tool_call>\n\nDone.", "Done.", {{"a", "{}"}}},
      {"hermes_plain_text_unchanged", H, "  Hello <tool the world.\n\n", "  Hello <tool the world.\n\n", {}},
      {"hermes_unicode", H, "<tool_call>{\"name\": \"a\", \"arguments\": {\"q\": \"caf\xc3\xa9\"}}</tool_call>", "",
       {{"a", "{\"q\":\"caf\xc3\xa9\"}"}}},
      {"llama_plain", L, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", "",
       {{"get_weather", weather}}},
      {"llama_python_tag", L, "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", "",
       {{"get_weather", weather}}},
      {"llama_two_semicolon", L, "{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"arguments\": {\"n\": 1}}", "",
       {{"a", "{}"}, {"b", R"({"n":1})"}}},
      {"llama_json_answer_is_content", L, "{\"name\": \"Bob\", \"age\": 3}", "{\"name\": \"Bob\", \"age\": 3}", {}},
      {"llama_text_first_is_content", L, "The call is {\"name\": \"a\", \"parameters\": {}}",
       "The call is {\"name\": \"a\", \"parameters\": {}}", {}},
      {"llama_unclosed_is_content", L, "{\"name\": \"a\", \"parameters\": {\"x\": 1}", "{\"name\": \"a\", \"parameters\": {\"x\": 1}", {}},
      {"llama_text_after_call", L, "{\"name\": \"a\", \"parameters\": {}}\nThat is all.", "That is all.", {{"a", "{}"}}},
      {"mistral_array", M, "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b\", \"arguments\": {}}]",
       "", {{"a", R"({"x":1})"}, {"b", "{}"}}},
      {"mistral_args_form", M, "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]b[ARGS]{}", "",
       {{"get_weather", weather}, {"b", "{}"}}},
      {"mistral_text_before", M, "Sure. [TOOL_CALLS][{\"name\": \"a\", \"arguments\": {}}]", "Sure.", {{"a", "{}"}}},
      {"mistral_malformed", M, "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {]", "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {]",
       {}},
      {"none_format_is_content", ToolCallFormat::kNone, "<tool_call>{\"name\": \"a\"}</tool_call>",
       "<tool_call>{\"name\": \"a\"}</tool_call>", {}},
  };
}

class ToolCallCase : public ::testing::TestWithParam<Case> {};

TEST_P(ToolCallCase, Whole) {
  const Case& c = GetParam();
  const ToolCallDelta got = ParseToolCalls(c.format, c.text, 16);
  EXPECT_EQ(got.content, c.content);
  ASSERT_EQ(got.calls.size(), c.calls.size());
  for (size_t i = 0; i < c.calls.size(); ++i) {
    EXPECT_EQ(got.calls[i].name, c.calls[i].name) << i;
    EXPECT_EQ(got.calls[i].arguments, c.calls[i].arguments) << i;
  }
}

TEST_P(ToolCallCase, StreamedInRandomPiecesJoinsToTheWhole) {
  const Case& c = GetParam();
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 200; ++trial) {
    ToolCallParser parser(c.format, 16);
    std::string content;
    Calls calls;
    for (size_t pos = 0; pos < c.text.size();) {
      const size_t n = std::min<size_t>(c.text.size() - pos, 1 + rng() % (trial % 2 ? 3 : 12));
      ToolCallDelta d = parser.Add(absl::string_view(c.text).substr(pos, n));
      content += d.content;
      calls.insert(calls.end(), d.calls.begin(), d.calls.end());
      pos += n;
    }
    ToolCallDelta d = parser.Finish();
    content += d.content;
    calls.insert(calls.end(), d.calls.begin(), d.calls.end());
    ASSERT_EQ(content, c.content) << "trial " << trial;
    ASSERT_EQ(calls, c.calls) << "trial " << trial;
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, ToolCallCase, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.label); });

TEST(ToolCallParserTest, ContentBeforeACallIsNotHeldBack) {
  ToolCallParser parser(ToolCallFormat::kHermes, 16);
  EXPECT_EQ(parser.Add("Let me check the weather").content, "Let me check the weather");
  // "<tool" may begin a call: held; the rest of the marker makes it one.
  EXPECT_EQ(parser.Add(" <tool").content, "");
  const ToolCallDelta d = parser.Add("_call>{\"name\": \"a\"}</tool_call>");
  EXPECT_EQ(d.content, "");
  ASSERT_EQ(d.calls.size(), 1u);
  EXPECT_EQ(d.calls[0].name, "a");
}

TEST(ToolCallParserTest, AtMostMaxCalls) {
  const ToolCallDelta d = ParseToolCalls(
      ToolCallFormat::kHermes, "<tool_call>{\"name\": \"a\"}</tool_call><tool_call>{\"name\": \"b\"}</tool_call>", 1);
  ASSERT_EQ(d.calls.size(), 1u);
  EXPECT_EQ(d.calls[0].name, "a");
  EXPECT_EQ(d.content, "");
}

TEST(ToolCallParserTest, NamesAndTemplates) {
  EXPECT_EQ(*ToolCallFormatFromName("hermes"), ToolCallFormat::kHermes);
  EXPECT_EQ(*ToolCallFormatFromName("none"), ToolCallFormat::kNone);
  const absl::StatusOr<ToolCallFormat> bad = ToolCallFormatFromName("qwen9");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(),
            "tool call parser 'qwen9' is not known; the known ones are none, hermes, llama3_json, mistral");
  EXPECT_EQ(ToolCallFormatOfTemplate("{{ '<tool_call>' }}"), ToolCallFormat::kHermes);
  EXPECT_EQ(ToolCallFormatOfTemplate("{{ '[TOOL_CALLS]' }}"), ToolCallFormat::kMistral);
  EXPECT_EQ(ToolCallFormatOfTemplate("{{ '<|python_tag|>' }}"), ToolCallFormat::kLlama3Json);
  EXPECT_EQ(ToolCallFormatOfTemplate("{{ messages }}"), ToolCallFormat::kNone);
}

// ---- Reasoning ----

struct ReasoningCase {
  const char* label;
  bool inside;
  std::string text;
  std::string reasoning;
  std::string content;
};

class ReasoningCaseTest : public ::testing::TestWithParam<ReasoningCase> {};

TEST_P(ReasoningCaseTest, WholeAndStreamed) {
  const ReasoningCase& c = GetParam();
  std::mt19937 rng(99);
  for (int trial = 0; trial < 200; ++trial) {
    ReasoningParser parser(c.inside);
    std::string reasoning, content;
    // Trial 0: the whole text at once.
    for (size_t pos = 0; pos < c.text.size();) {
      const size_t n = trial == 0 ? c.text.size() : std::min<size_t>(c.text.size() - pos, 1 + rng() % 5);
      ReasoningDelta d = parser.Add(absl::string_view(c.text).substr(pos, n));
      reasoning += d.reasoning;
      content += d.content;
      pos += n;
    }
    ReasoningDelta d = parser.Finish();
    reasoning += d.reasoning;
    content += d.content;
    ASSERT_EQ(reasoning, c.reasoning) << "trial " << trial;
    ASSERT_EQ(content, c.content) << "trial " << trial;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Think, ReasoningCaseTest,
    ::testing::Values(
        ReasoningCase{"qwen3_opens_in_output", false, "<think>\nWhy? Because.\n</think>\n\nThe answer is 4.",
                      "\nWhy? Because.\n", "The answer is 4."},
        ReasoningCase{"r1_prompt_opened", true, "Hmm, 2+2.</think>\n\n4", "Hmm, 2+2.", "4"},
        ReasoningCase{"no_think_is_content", false, "  Just <thin an answer", "", "  Just <thin an answer"},
        ReasoningCase{"unclosed_is_reasoning", false, "<think>still thinking </thi", "still thinking </thi", ""},
        ReasoningCase{"tool_call_inside_reasoning_stays_there", false,
                      "<think><tool_call>{\"name\": \"a\"}</tool_call></think>ok",
                      "<tool_call>{\"name\": \"a\"}</tool_call>", "ok"},
        ReasoningCase{"empty_thinking", false, "<think>\n\n</think>\n\nHi", "\n\n", "Hi"}),
    [](const ::testing::TestParamInfo<ReasoningCase>& info) { return std::string(info.param.label); });

TEST(ReasoningParserTest, PromptAndTemplate) {
  EXPECT_TRUE(PromptOpensReasoning("<|im_start|>assistant\n<think>\n"));
  EXPECT_FALSE(PromptOpensReasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
  EXPECT_FALSE(PromptOpensReasoning("<|im_start|>assistant\n"));
  // A <think> in a user's message is not the template opening the reasoning.
  EXPECT_FALSE(PromptOpensReasoning("<|im_start|>user\nsay <think><|im_end|>\n<|im_start|>assistant\n"));
  EXPECT_EQ(ReasoningFormatOfTemplate("{{ '<think>' }}"), ReasoningFormat::kThink);
  EXPECT_EQ(*ReasoningFormatFromName("deepseek_r1"), ReasoningFormat::kThink);
  EXPECT_FALSE(ReasoningFormatFromName("o1").ok());
}

}  // namespace
}  // namespace shardserve::openai
