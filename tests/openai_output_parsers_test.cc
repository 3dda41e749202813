// coordinator/api/openai/tool_calls.h and reasoning.h: each format's calls and reasoning from whole
// outputs (text before a call, several calls, malformed JSON staying content), and every output
// streamed in random pieces giving, joined, what the whole gives.
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "coordinator/api/openai/python_literal.h"
#include "coordinator/api/openai/reasoning.h"
#include "coordinator/api/openai/tool_calls.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/output_chunkings.h"

namespace shardserve::openai {
namespace {

using Calls = std::vector<ToolCall>;
using Json = nlohmann::ordered_json;

// The tools of the qwen3_coder cases: the types its parameters' values are converted by.
const Json& Tools() {
  static const Json* tools = new Json(Json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
      "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "typed", "parameters": {"type": "object", "properties": {
      "n": {"type": "number"}, "f": {"type": "number"}, "b": {"type": "boolean"}, "o": {"type": "object"},
      "a": {"type": "array"}, "s": {"type": "string"}, "i": {"type": "integer"}, "z": {"type": "integer"},
      "e": {"enum": ["x", "y"]}, "any": {"type": ["integer", "null"]}}}}}])"));
  return *tools;
}

// Kimi K2's tool tokens.
const std::string kKimiBegin = "<|tool_calls_section_begin|>";
const std::string kKimiEnd = "<|tool_calls_section_end|>";
const std::string kKimiCall = "<|tool_call_begin|>";
const std::string kKimiArgs = "<|tool_call_argument_begin|>";
const std::string kKimiCallEnd = "<|tool_call_end|>";

// DeepSeek's tool tokens.
const std::string kCallsBegin = "<｜tool▁calls▁begin｜>";
const std::string kCallsEnd = "<｜tool▁calls▁end｜>";
const std::string kCallBegin = "<｜tool▁call▁begin｜>";
const std::string kCallEnd = "<｜tool▁call▁end｜>";
const std::string kSep = "<｜tool▁sep｜>";

struct Case {
  const char* label;
  ToolCallFormat format;
  std::string text;
  std::string content;
  Calls calls;
  // With streamed arguments, where that differs: a call whose name was sent stays a call (its
  // arguments end with the rest of its block as written), a key written twice is sent twice.
  std::optional<Calls> streamed_calls = std::nullopt;
  std::optional<std::string> streamed_content = std::nullopt;
};

std::vector<Case> Cases() {
  const auto H = ToolCallFormat::kHermes;
  const auto L = ToolCallFormat::kLlama3Json;
  const auto M = ToolCallFormat::kMistral;
  const auto D = ToolCallFormat::kDeepSeekV3;
  const auto Q = ToolCallFormat::kQwen3Coder;
  const auto K = ToolCallFormat::kKimiK2;
  const auto G = ToolCallFormat::kGlm45;
  const std::string glm_weather =
      "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
      "<arg_value>3</arg_value>\n</tool_call>";
  const std::string kimi_weather = kKimiCall + "functions.get_weather:0" + kKimiArgs + "{\"city\": \"Paris\"}" + kKimiCallEnd;
  const std::string weather = R"({"city":"Paris"})";
  const std::string ds_weather = kCallBegin + "function" + kSep + "get_weather\n```json\n{\"city\": \"Paris\"}\n```" + kCallEnd;
  const std::string ds_malformed = kCallsBegin + kCallBegin + "function" + kSep + "a\n```json\n{\"k\": }\n```" + kCallEnd + kCallsEnd;
  const std::string qwen_weather =
      "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
      "</function>\n</tool_call>";
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
      {"hermes_arguments_before_name", H, "<tool_call>{\"arguments\": {\"k\": [1]}, \"name\": \"a\"}</tool_call>", "",
       {{"a", R"({"k":[1]})"}}},
      // A byte that is no UTF-8 inside a string: the string is sent up to it, whatever the cut.
      {"hermes_bad_utf8_in_a_string", H, "<tool_call>{\"name\": \"a\", \"arguments\": {\"s\": \"caf\\u00e9 \xd6x\"}}</tool_call>",
       "<tool_call>{\"name\": \"a\", \"arguments\": {\"s\": \"caf\\u00e9 \xd6x\"}}</tool_call>", {},
       Calls{{"a", "{\"s\":\"caf\xc3\xa9 \xd6x\"}}</tool_call>"}}, ""},
      {"hermes_malformed_stays_content", H, "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"k\": }\n</tool_call>",
       "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"k\": }\n</tool_call>", {},
       Calls{{"a", "{\"k\":}\n</tool_call>"}}, ""},
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
      {"llama_unclosed_is_content", L, "{\"name\": \"a\", \"parameters\": {\"x\": 1}", "{\"name\": \"a\", \"parameters\": {\"x\": 1}", {},
       Calls{{"a", R"({"x":1})"}}, ""},
      {"llama_text_after_call", L, "{\"name\": \"a\", \"parameters\": {}}\nThat is all.", "That is all.", {{"a", "{}"}}},
      {"mistral_array", M, "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b\", \"arguments\": {}}]",
       "", {{"a", R"({"x":1})"}, {"b", "{}"}}},
      {"mistral_args_form", M, "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]b[ARGS]{}", "",
       {{"get_weather", weather}, {"b", "{}"}}},
      {"mistral_text_before", M, "Sure. [TOOL_CALLS][{\"name\": \"a\", \"arguments\": {}}]", "Sure.", {{"a", "{}"}}},
      {"mistral_malformed", M, "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {]", "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {]",
       {}, Calls{{"a", "{]"}}, ""},
      // DeepSeek-V3 / R1: the calls' block, each call's type, name and ```json fence.
      {"deepseek_one", D, kCallsBegin + ds_weather + kCallsEnd, "", {{"get_weather", weather}}},
      {"deepseek_text_before_two_calls", D,
       "Let me check." + kCallsBegin + ds_weather + "\n" + kCallBegin + "function" + kSep +
           "b\n```json\n{\"x\": [1, \"```\"]}\n```" + kCallEnd + kCallsEnd,
       "Let me check.", {{"get_weather", weather}, {"b", R"({"x":[1,"```"]})"}}},
      {"deepseek_text_after", D, kCallsBegin + ds_weather + kCallsEnd + "\n\nDone.", "Done.", {{"get_weather", weather}}},
      {"deepseek_unclosed_last", D, kCallsBegin + kCallBegin + "function" + kSep + "a\n```json\n{\"k\": 1}\n```", "",
       {{"a", R"({"k":1})"}}},
      // V3.1: the name before the separator, the arguments right after it.
      {"deepseek_v3_1", D,
       kCallsBegin + kCallBegin + "get_weather" + kSep + "{\"city\": \"Paris\"}" + kCallEnd + kCallBegin + "b" + kSep +
           "{}" + kCallEnd + kCallsEnd,
       "", {{"get_weather", weather}, {"b", "{}"}}},
      {"deepseek_malformed_stays_content", D, ds_malformed, ds_malformed, {}, Calls{{"a", "{\"k\":}\n```" + kCallEnd}}, ""},
      {"deepseek_no_fence_stays_content", D, kCallsBegin + kCallBegin + "function" + kSep + "a\n{}" + kCallEnd,
       kCallsBegin + kCallBegin + "function" + kSep + "a\n{}" + kCallEnd, {}},
      {"deepseek_no_call_stays_content", D, "A " + kCallsBegin + " B " + kCallsEnd, "A " + kCallsBegin + " B " + kCallsEnd, {}},
      {"deepseek_plain_text_unchanged", D, "Hello <｜tool world\n", "Hello <｜tool world\n", {}},
      // Kimi K2: the section, each call's id (functions.NAME:INDEX, kept as the call's id) and arguments.
      {"kimi_one", K, kKimiBegin + kimi_weather + kKimiEnd, "", {{"get_weather", weather, "functions.get_weather:0"}}},
      {"kimi_text_before_two_calls", K,
       "Let me check." + kKimiBegin + kimi_weather + "\n" + kKimiCall + " functions.b:1 " + kKimiArgs +
           " {\"x\": [1, \"<|tool_call_end|\"]} " + kKimiCallEnd + kKimiEnd,
       "Let me check.", {{"get_weather", weather, "functions.get_weather:0"}, {"b", R"({"x":[1,"<|tool_call_end|"]})", "functions.b:1"}}},
      {"kimi_text_after", K, kKimiBegin + kimi_weather + kKimiEnd + "\n\nDone.", "Done.",
       {{"get_weather", weather, "functions.get_weather:0"}}},
      {"kimi_unclosed_last", K, kKimiBegin + kKimiCall + "functions.a:0" + kKimiArgs + "{\"k\": 1}", "",
       {{"a", R"({"k":1})", "functions.a:0"}}},
      {"kimi_name_without_namespace", K, kKimiBegin + kKimiCall + "a:3" + kKimiArgs + "{}" + kKimiCallEnd + kKimiEnd, "",
       {{"a", "{}", "a:3"}}},
      {"kimi_id_without_index_stays_content", K, kKimiBegin + kKimiCall + "functions.a" + kKimiArgs + "{}" + kKimiCallEnd,
       kKimiBegin + kKimiCall + "functions.a" + kKimiArgs + "{}" + kKimiCallEnd, {}},
      {"kimi_malformed_stays_content", K, kKimiBegin + kKimiCall + "functions.a:0" + kKimiArgs + "{\"k\": }" + kKimiCallEnd + kKimiEnd,
       kKimiBegin + kKimiCall + "functions.a:0" + kKimiArgs + "{\"k\": }" + kKimiCallEnd + kKimiEnd, {},
       Calls{{"a", "{\"k\":}" + kKimiCallEnd, "functions.a:0"}}, ""},
      {"kimi_no_call_stays_content", K, "A " + kKimiBegin + " B " + kKimiEnd, "A " + kKimiBegin + " B " + kKimiEnd, {}},
      {"kimi_plain_text_unchanged", K, "Hello <|tool world\n", "Hello <|tool world\n", {}},
      // Qwen3-Coder: parameters converted by the types of the tool's schema (Tools()).
      {"qwen3_coder_one", Q, qwen_weather, "", {{"get_weather", R"({"city":"Paris","days":3})"}}},
      {"qwen3_coder_types", Q,
       "<tool_call>\n<function=typed>\n<parameter=n>\n2.5\n</parameter>\n<parameter=f>\n3.0\n</parameter>\n"
       "<parameter=b>\nTrue\n</parameter>\n<parameter=o>\n{\"k\": [1, 2]}\n</parameter>\n<parameter=a>\n[1, \"x\"]\n"
       "</parameter>\n<parameter=s>\n042\n two lines\n</parameter>\n<parameter=i>\nabc\n</parameter>\n<parameter=z>\n"
       "null\n</parameter>\n<parameter=u>\n7\n</parameter>\n<parameter=e>\n5\n</parameter>\n<parameter=any>\n5\n"
       "</parameter>\n</function>\n</tool_call>",
       "",
       {{"typed", R"({"n":2.5,"f":3,"b":true,"o":{"k":[1,2]},"a":[1,"x"],"s":"042\n two lines","i":"abc","z":null,)"
                  R"("u":"7","e":"5","any":5})"}}},
      {"qwen3_coder_python_literals", Q,
       "<tool_call>\n<function=typed>\n<parameter=o>\n{'k': (1, 'x')}\n</parameter>\n<parameter=a>\n[True, None]\n"
       "</parameter>\n<parameter=any>\n'quoted'\n</parameter>\n<parameter=s>\n'kept'\n</parameter>\n</function>\n"
       "</tool_call>",
       "", {{"typed", R"({"o":{"k":[1,"x"]},"a":[true,null],"any":"quoted","s":"'kept'"})"}}},
      {"qwen3_coder_text_before_two_calls", Q,
       "I'll check both.\n<tool_call>\n<function=a>\n</function>\n</tool_call>\n<tool_call>\n<function=b>\n"
       "<parameter=x>\nline1\nline2\n</parameter>\n</function>\n</tool_call>",
       "I'll check both.", {{"a", "{}"}, {"b", R"({"x":"line1\nline2"})"}}},
      {"qwen3_coder_unclosed_last", Q, "<tool_call>\n<function=get_weather>\n<parameter=days>\n4\n", "",
       {{"get_weather", R"({"days":4})"}}},
      {"qwen3_coder_parameter_without_end", Q,
       "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n2\n</function>\n</tool_call>", "",
       {{"get_weather", R"({"city":"Rome","days":2})"}}},
      {"qwen3_coder_bare_function", Q, "<function=a>\n<parameter=x>\n1\n</parameter>\n</function>", "",
       {{"a", R"({"x":"1"})"}}},
      {"qwen3_coder_text_after", Q, qwen_weather + "\nDone.", "Done.", {{"get_weather", R"({"city":"Paris","days":3})"}}},
      {"qwen3_coder_json_call_stays_content", Q, "<tool_call>\n{\"name\": \"a\"}\n</tool_call>",
       "<tool_call>\n{\"name\": \"a\"}\n</tool_call>", {}},
      {"qwen3_coder_name_with_space_stays_content", Q, "<tool_call>\n<function=get weather>\n</function>\n</tool_call>",
       "<tool_call>\n<function=get weather>\n</function>\n</tool_call>", {}},
      {"qwen3_coder_parameter_without_name_end_stays_content", Q, "<tool_call><function=a><parameter=x</function></tool_call>",
       "<tool_call><function=a><parameter=x</function></tool_call>", {},
       Calls{{"a", "{<parameter=x</function></tool_call>"}}, ""},
      // The arguments written twice: the first, which a streamed call has sent by the time the second comes.
      {"hermes_arguments_twice", H, "<tool_call>{\"name\": \"a\", \"arguments\": {\"k\": 1}, \"arguments\": {\"k\": 2}}</tool_call>",
       "", {{"a", R"({"k":1})"}}},
      {"hermes_key_twice", H, "<tool_call>{\"name\": \"a\", \"arguments\": {\"k\": 1, \"k\": 2}}</tool_call>", "",
       {{"a", R"({"k":2})"}}, Calls{{"a", R"({"k":1,"k":2})"}}},
      {"qwen3_coder_parameter_twice", Q, "<function=get_weather>\n<parameter=days>\n1\n</parameter>\n<parameter=days>\n2\n"
       "</parameter>\n</function>", "", {{"get_weather", R"({"days":2})"}}, Calls{{"get_weather", R"({"days":1,"days":2})"}}},
      {"qwen3_coder_parameter_twice_unclosed", Q, "<function=get_weather>\n<parameter=days>\n1\n</parameter>\n"
       "<parameter=days>\n2\n", "", {{"get_weather", R"({"days":2})"}}, Calls{{"get_weather", R"({"days":1,"days":2})"}}},
      // Two names that are no UTF-8 and write alike (each bad byte as U+FFFD): one key, as a name
      // written twice (get_weather has no "d": its values stay strings).
      {"qwen3_coder_names_written_alike", Q, "<function=get_weather>\n<parameter=d\xff>\n1\n</parameter>\n"
       "<parameter=d\xfe>\n2\n</parameter>\n</function>", "", {{"get_weather", "{\"d\xEF\xBF\xBD\":\"2\"}"}},
       Calls{{"get_weather", "{\"d\xEF\xBF\xBD\":\"1\",\"d\xEF\xBF\xBD\":\"2\"}"}}},
      // GLM-4.5: values by the tool's schema (Tools()): text for "string", else JSON, a Python
      // literal, else text; GLM-4.7's calls without newlines.
      {"glm45_one", G, glm_weather, "", {{"get_weather", R"({"city":"Paris","days":3})"}}},
      {"glm45_types", G,
       "<tool_call>typed\n<arg_key>s</arg_key>\n<arg_value>042</arg_value>\n<arg_key>n</arg_key>\n<arg_value>2.5"
       "</arg_value>\n<arg_key>b</arg_key>\n<arg_value>True</arg_value>\n<arg_key>o</arg_key>\n<arg_value>{\"k\": [1, 2]}"
       "</arg_value>\n<arg_key>u</arg_key>\n<arg_value>hello world</arg_value>\n<arg_key>z</arg_key>\n<arg_value>None"
       "</arg_value>\n<arg_key>i</arg_key>\n<arg_value>\n7\n</arg_value>\n<arg_key>e</arg_key>\n<arg_value>\"x\""
       "</arg_value>\n</tool_call>",
       "", {{"typed", R"({"s":"042","n":2.5,"b":true,"o":{"k":[1,2]},"u":"hello world","z":null,"i":7,"e":"x"})"}}},
      // Values a model writes as Python literals, read as vLLM's ast.literal_eval reads them
      // (python_literal.h); a "string"-typed parameter keeps its text.
      {"glm45_python_literals", G,
       "<tool_call>typed\n<arg_key>o</arg_key>\n<arg_value>{'k': [1, 'two'], 'ok': True}</arg_value>\n<arg_key>t"
       "</arg_key>\n<arg_value>('a', None)</arg_value>\n<arg_key>q</arg_key>\n<arg_value>'quoted'</arg_value>\n"
       "<arg_key>s</arg_key>\n<arg_value>'kept'</arg_value>\n<arg_key>x</arg_key>\n<arg_value>{'a' 1}</arg_value>\n"
       "</tool_call>",
       "", {{"typed", R"({"o":{"k":[1,"two"],"ok":true},"t":["a",null],"q":"quoted","s":"'kept'","x":"{'a' 1}"})"}}},
      {"glm45_string_keeps_its_lines", G,
       "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>\nSan\nFrancisco \n</arg_value>\n</tool_call>", "",
       {{"get_weather", R"({"city":"San\nFrancisco"})"}}},
      {"glm47_without_newlines", G, "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>",
       "", {{"get_weather", R"({"city":"Paris"})"}}},
      {"glm45_text_before_two_calls", G,
       "Let me check both.\n<tool_call>list_files\n</tool_call>\n<tool_call>get_weather\n<arg_key>days</arg_key>"
       "\n<arg_value>2</arg_value>\n</tool_call>",
       "Let me check both.", {{"list_files", "{}"}, {"get_weather", R"({"days":2})"}}},
      {"glm45_name_only", G, "<tool_call>list_files</tool_call>", "", {{"list_files", "{}"}}},
      {"glm45_text_after", G, glm_weather + "\nDone.", "Done.", {{"get_weather", R"({"city":"Paris","days":3})"}}},
      {"glm45_json_call_stays_content", G, "<tool_call>{\"name\": \"a\"}</tool_call>",
       "<tool_call>{\"name\": \"a\"}</tool_call>", {}},
      {"glm45_name_with_space_stays_content", G, "<tool_call>get weather\n</tool_call>",
       "<tool_call>get weather\n</tool_call>", {}},
      {"glm45_text_among_arguments_stays_content", G,
       "<tool_call>a\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\nhello\n</tool_call>",
       "<tool_call>a\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\nhello\n</tool_call>", {},
       Calls{{"a", "{\"x\":1\nhello\n</tool_call>"}}, ""},
      {"glm45_unclosed_value_stays_content", G, "<tool_call>a\n<arg_key>x</arg_key>\n<arg_value>1",
       "<tool_call>a\n<arg_key>x</arg_key>\n<arg_value>1", {}, Calls{{"a", "{\n<arg_key>x</arg_key>\n<arg_value>1"}}, ""},
      {"glm45_key_twice", G,
       "<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>1</arg_value>\n<arg_key>days</arg_key>\n"
       "<arg_value>2</arg_value>\n</tool_call>",
       "", {{"get_weather", R"({"days":2})"}}, Calls{{"get_weather", R"({"days":1,"days":2})"}}},
      {"none_format_is_content", ToolCallFormat::kNone, "<tool_call>{\"name\": \"a\"}</tool_call>",
       "<tool_call>{\"name\": \"a\"}</tool_call>", {}},
  };
}

class ToolCallCase : public ::testing::TestWithParam<Case> {};

// The content and calls that streamed pieces make, joined; each piece checked to begin the next
// call (with a name) or add to one begun.
struct Joined {
  std::string content;
  Calls calls;
  void Add(const ToolCallDelta& d) {
    EXPECT_TRUE(d.calls.empty()) << "with streamed arguments calls come as pieces";
    content += d.content;
    for (const ToolCallPiece& p : d.pieces) {
      if (!p.name.empty()) {
        ASSERT_EQ(p.index, static_cast<int>(calls.size())) << "a call begun out of order";
        calls.push_back(ToolCall{p.name, p.arguments, p.id});
      } else {
        ASSERT_GE(p.index, 0);
        ASSERT_LT(p.index, static_cast<int>(calls.size())) << "arguments of a call not begun";
        calls[p.index].arguments += p.arguments;
      }
    }
  }
};

// With streamed arguments, in random pieces, at every split and a byte at a time: the pieces join
// to the whole output's calls (the arguments the non-streamed answer gives), the content unchanged.
TEST_P(ToolCallCase, StreamedArgumentsJoinToTheWhole) {
  const Case& c = GetParam();
  const Calls& want_calls = c.streamed_calls.has_value() ? *c.streamed_calls : c.calls;
  const std::string& want_content = c.streamed_content.has_value() ? *c.streamed_content : c.content;
  const std::vector<std::vector<absl::string_view>> chunkings = OutputChunkings(c.text, 4321);
  for (size_t trial = 0; trial < chunkings.size(); ++trial) {
    ToolCallParser parser(c.format, 16, Tools(), /*stream_arguments=*/true);
    Joined joined;
    for (absl::string_view piece : chunkings[trial]) joined.Add(parser.Add(piece));
    joined.Add(parser.Finish());
    ASSERT_EQ(joined.content, want_content) << "trial " << trial;
    ASSERT_EQ(joined.calls, want_calls) << "trial " << trial;
  }
}

TEST_P(ToolCallCase, Whole) {
  const Case& c = GetParam();
  const ToolCallDelta got = ParseToolCalls(c.format, c.text, 16, Tools());
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
    ToolCallParser parser(c.format, 16, Tools());
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

// The output in two pieces, split at every byte (inside every marker and every UTF-8 character),
// and one byte at a time.
TEST_P(ToolCallCase, SplitAtEveryByte) {
  const Case& c = GetParam();
  for (size_t split = 0; split <= c.text.size() + 1; ++split) {
    ToolCallParser parser(c.format, 16, Tools());
    std::string content;
    Calls calls;
    const auto add = [&](const ToolCallDelta& d) {
      content += d.content;
      calls.insert(calls.end(), d.calls.begin(), d.calls.end());
    };
    if (split <= c.text.size()) {
      add(parser.Add(absl::string_view(c.text).substr(0, split)));
      add(parser.Add(absl::string_view(c.text).substr(split)));
    } else {
      for (char ch : c.text) add(parser.Add(std::string(1, ch)));
    }
    add(parser.Finish());
    ASSERT_EQ(content, c.content) << "split at " << split;
    ASSERT_EQ(calls, c.calls) << "split at " << split;
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

// With streamed arguments a call's name comes as soon as it is complete and its arguments while
// they are written, long before the call's text ends, in every format; joined, they are the
// arguments the whole output gives.
TEST(ToolCallParserTest, ArgumentsArriveWhileTheCallIsWritten) {
  std::string words;
  for (int i = 0; i < 60; ++i) words += "word" + std::to_string(i) + " ";
  const std::string args = "{\"text\": \"" + words + "caf\xc3\xa9 \\\"q\\\" \\u00e9\\ud83d\\ude00\", \"n\": 12345, \"f\": 2.50, "
                           "\"items\": [1, true, null, {\"k\": \"v\"}, []], \"empty\": {}}";
  const std::string qwen_params = "<parameter=s>\n" + words + "\n</parameter>\n<parameter=i>\n7\n</parameter>\n"
                                  "<parameter=o>\n{\"k\": [1, 2]}\n</parameter>\n<parameter=b>\ntrue\n</parameter>\n"
                                  "<parameter=n>\n1.5\n</parameter>\n";
  const struct {
    const char* label;
    ToolCallFormat format;
    std::string text;
    int min_pieces;  // argument pieces at least, before the call's last 10 bytes
  } cases[] = {
      {"hermes", ToolCallFormat::kHermes, "<tool_call>\n{\"name\": \"f\", \"arguments\": " + args + "}\n</tool_call>", 100},
      {"llama3_json", ToolCallFormat::kLlama3Json, "<|python_tag|>{\"name\": \"f\", \"parameters\": " + args + "}", 100},
      {"mistral_list", ToolCallFormat::kMistral, "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": " + args + "}]", 100},
      {"mistral_args", ToolCallFormat::kMistral, "[TOOL_CALLS]f[ARGS]" + args, 100},
      {"deepseek_v3", ToolCallFormat::kDeepSeekV3,
       kCallsBegin + kCallBegin + "function" + kSep + "f\n```json\n" + args + "\n```" + kCallEnd + kCallsEnd, 100},
      {"deepseek_v3_1", ToolCallFormat::kDeepSeekV3, kCallsBegin + kCallBegin + "f" + kSep + args + kCallEnd + kCallsEnd, 100},
      // Parameters are sent once closed: one piece each.
      {"qwen3_coder", ToolCallFormat::kQwen3Coder,
       "<tool_call>\n<function=typed>\n" + qwen_params + "</function>\n</tool_call>", 5},
      {"glm45", ToolCallFormat::kGlm45,
       "<tool_call>typed\n<arg_key>s</arg_key>\n<arg_value>" + words + "</arg_value>\n<arg_key>i</arg_key>\n<arg_value>7"
       "</arg_value>\n<arg_key>o</arg_key>\n<arg_value>{\"k\": [1, 2]}</arg_value>\n<arg_key>b</arg_key>\n<arg_value>true"
       "</arg_value>\n<arg_key>n</arg_key>\n<arg_value>1.5</arg_value>\n</tool_call>",
       5},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.label);
    const ToolCallDelta whole = ParseToolCalls(c.format, c.text, 16, Tools());
    ASSERT_EQ(whole.calls.size(), 1u);
    ASSERT_EQ(whole.content, "");
    ToolCallParser parser(c.format, 16, Tools(), /*stream_arguments=*/true);
    Joined joined;
    size_t name_at = 0;
    int early_pieces = 0;
    for (size_t i = 0; i < c.text.size(); ++i) {
      const ToolCallDelta d = parser.Add(c.text.substr(i, 1));
      joined.Add(d);
      for (const ToolCallPiece& p : d.pieces) {
        if (!p.name.empty()) name_at = i + 1;
        if (p.name.empty() && !p.arguments.empty() && i + 10 < c.text.size()) ++early_pieces;
      }
    }
    joined.Add(parser.Finish());
    ASSERT_EQ(joined.calls.size(), 1u);
    EXPECT_EQ(joined.calls[0], whole.calls[0]);
    EXPECT_EQ(joined.content, "");
    EXPECT_GT(name_at, 0u);
    EXPECT_LT(name_at, c.text.size() / 4) << "the name came late";
    EXPECT_GE(early_pieces, c.min_pieces);
  }
}

TEST(ToolCallParserTest, StreamedArgumentsAtMostMaxCalls) {
  const std::string text = "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b\", \"arguments\": {}}] ok";
  ToolCallParser parser(ToolCallFormat::kMistral, 1, nullptr, /*stream_arguments=*/true);
  Joined joined;
  for (char ch : text) joined.Add(parser.Add(std::string(1, ch)));
  joined.Add(parser.Finish());
  EXPECT_EQ(joined.calls, (Calls{{"a", R"({"x":1})"}}));
  EXPECT_EQ(joined.content, "ok");
  EXPECT_EQ(parser.calls_found(), 2);
}

TEST(ToolCallParserTest, NamesAndTemplates) {
  EXPECT_EQ(*ToolCallFormatFromName("hermes"), ToolCallFormat::kHermes);
  EXPECT_EQ(*ToolCallFormatFromName("none"), ToolCallFormat::kNone);
  const absl::StatusOr<ToolCallFormat> bad = ToolCallFormatFromName("qwen9");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(),
            "tool call parser 'qwen9' is not known; the known ones are none, hermes, llama3_json, mistral, deepseek_v3, "
            "kimi_k2, qwen3_coder, glm45, openai");
  EXPECT_EQ(*ToolCallFormatFromName("kimi_k2"), ToolCallFormat::kKimiK2);
  EXPECT_EQ(*ToolCallFormatFromName("deepseek_v3"), ToolCallFormat::kDeepSeekV3);
  EXPECT_EQ(*ToolCallFormatFromName("qwen3_coder"), ToolCallFormat::kQwen3Coder);
  EXPECT_EQ(*ToolCallFormatFromName("glm45"), ToolCallFormat::kGlm45);
  EXPECT_EQ(ToolCallFormatOfTemplate("{{ '<tool_call>' }}"), ToolCallFormat::kHermes);
  EXPECT_EQ(ToolCallFormatOfTemplate("{{ '[TOOL_CALLS]' }}"), ToolCallFormat::kMistral);
  EXPECT_EQ(ToolCallFormatOfTemplate("{{ '<|python_tag|>' }}"), ToolCallFormat::kLlama3Json);
  EXPECT_EQ(ToolCallFormatOfTemplate("{{ messages }}"), ToolCallFormat::kNone);
  // The lines that write a call in the published templates (DeepSeek-R1 and its distills, whose
  // whole template tests/fixtures/chat_templates/deepseek_r1_distill holds, are in
  // openai_protocol_test).
  // DeepSeek-V3.1 (deepseek-ai/DeepSeek-V3.1 tokenizer_config.json):
  EXPECT_EQ(ToolCallFormatOfTemplate(
                "{%- if message['content'] is none -%}{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ "
                "tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}"),
            ToolCallFormat::kDeepSeekV3);
  // Kimi K2, whose whole template tests/fixtures/chat_templates/kimi_k2 holds:
  std::ifstream kimi(std::string(SHARDSERVE_SOURCE_DIR) + "/tests/fixtures/chat_templates/kimi_k2/tokenizer_config.json");
  ASSERT_TRUE(kimi.good());
  EXPECT_EQ(ToolCallFormatOfTemplate(nlohmann::json::parse(kimi).at("chat_template").get<std::string>()),
            ToolCallFormat::kKimiK2);
  EXPECT_TRUE(KeepsSpecialTokens(ToolCallFormat::kKimiK2));
  // Qwen3-Coder (Qwen/Qwen3-Coder-30B-A3B-Instruct tokenizer_config.json), which holds <tool_call>
  // as Hermes' does:
  EXPECT_EQ(ToolCallFormatOfTemplate("{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}\n"
                                     "{%- if tool_call.arguments is defined %}\n"
                                     "{%- for args_name, args_value in tool_call.arguments|items %}\n"
                                     "{{- '<parameter=' + args_name + '>\\n' }}"),
            ToolCallFormat::kQwen3Coder);
  // GLM-4.5 (zai-org/GLM-4.5's chat template, the lines that write a call), which holds <tool_call>
  // too; its markers are special tokens:
  EXPECT_EQ(ToolCallFormatOfTemplate("{{ '\\n<tool_call>' + tc.name }}\n{% set _args = tc.arguments %}\n"
                                     "{% for k, v in _args.items() %}\n<arg_key>{{ k }}</arg_key>\n"
                                     "<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>"),
            ToolCallFormat::kGlm45);
  EXPECT_TRUE(KeepsSpecialTokens(ToolCallFormat::kGlm45));
}

// Malformed DeepSeek, Kimi, Qwen3-Coder and GLM texts of every kind are content or calls, never a crash: every
// prefix of the well-formed cases, and each with bytes cut out of its middle.
TEST(ToolCallParserTest, TruncatedAndDamagedOutputs) {
  for (const Case& c : Cases()) {
    if (c.format != ToolCallFormat::kDeepSeekV3 && c.format != ToolCallFormat::kKimiK2 &&
        c.format != ToolCallFormat::kQwen3Coder && c.format != ToolCallFormat::kGlm45) {
      continue;
    }
    for (size_t n = 0; n <= c.text.size(); ++n) {
      for (const std::string& text : {c.text.substr(0, n), c.text.substr(0, n / 2) + c.text.substr(n)}) {
        const ToolCallDelta d = ParseToolCalls(c.format, text, 16, Tools());
        for (const ToolCall& call : d.calls) {
          EXPECT_FALSE(call.name.empty()) << text;
          EXPECT_TRUE(Json::parse(call.arguments, nullptr, false).is_object()) << text;
        }
        if (d.calls.empty()) {
          EXPECT_EQ(d.content, text);
        }
        // Streamed arguments: calls begun in order, arguments only for calls begun.
        ToolCallParser parser(c.format, 16, Tools(), /*stream_arguments=*/true);
        Joined joined;
        for (size_t pos = 0; pos < text.size(); pos += 5) joined.Add(parser.Add(text.substr(pos, 5)));
        joined.Add(parser.Finish());
        for (const ToolCall& call : joined.calls) EXPECT_FALSE(call.name.empty()) << text;
      }
    }
  }
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
  EXPECT_EQ(*ReasoningFormatFromName("glm45"), ReasoningFormat::kThink);  // vLLM's name for GLM-4.5's
  EXPECT_FALSE(ReasoningFormatFromName("o1").ok());
}

// Arguments written as Python literals, read as vLLM's parsers read them (ast.literal_eval, then
// json.dumps): tests/fixtures/python_literals.json, by tools/fixtures/make_python_literal_fixtures.py
// from Python itself (hand-written forms and near misses, 400 random values in every spelling, half
// of them damaged by one edit). The reader gives Python's JSON, and refuses where Python raises or
// the case says it refuses on purpose.
TEST(PythonLiteralTest, ReadsAsPythonDoes) {
  std::ifstream in(std::string(SHARDSERVE_SOURCE_DIR) + "/tests/fixtures/python_literals.json");
  ASSERT_TRUE(in.good());
  const Json fixture = Json::parse(in);
  int read = 0, refused = 0;
  for (const Json& c : fixture["cases"]) {
    const std::string text = c["text"].get<std::string>();
    const std::optional<Json> got = ReadPythonLiteral(text);
    if (c.contains("json") && !c.contains("refused")) {
      EXPECT_TRUE(got.has_value()) << text;
      if (got.has_value()) EXPECT_EQ(*got, Json::parse(c["json"].get<std::string>())) << text;
      ++read;
    } else {
      EXPECT_FALSE(got.has_value()) << text << " read as " << got.value_or(Json()).dump() << " ("
                                    << (c.contains("raises") ? c["raises"] : c["refused"]).get<std::string>() << ")";
      ++refused;
    }
  }
  EXPECT_GT(read, 350);
  EXPECT_GT(refused, 150);
}

}  // namespace
}  // namespace shardserve::openai
