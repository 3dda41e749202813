// The OpenAI API's request checks and response JSON (coordinator/api/openai/protocol.h), without HTTP
// or processes: every field's error names the field (and sets the error's param), accepted
// requests become the GenerateRequest the gRPC API takes, PrepareGeneration's errors are renamed
// to the OpenAI fields (and the bounds only it checks reach a client so), statuses map to HTTP's.
#include "coordinator/api/openai/protocol.h"
#include "coordinator/api/openai/responses.h"
#include "coordinator/api/openai/responses_store.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "coordinator/chat/chat_template.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/field_error.h"
#include "coordinator/api/request_validation.h"
#include "grammar/json_schema.h"
#include "grammar/matcher.h"
#include "model/sampling_bounds.h"

namespace shardserve::openai {
namespace {

using Json = nlohmann::ordered_json;

struct BadCase {
  const char* name;
  Endpoint endpoint;
  const char* body;
  const char* param;  // "" when the error names no field
  const char* says;   // a piece of the message
};

void PrintTo(const BadCase& c, std::ostream* os) { *os << c.name; }

constexpr Endpoint kChat = Endpoint::kChatCompletions;
constexpr Endpoint kCompl = Endpoint::kCompletions;

class BadRequestTest : public testing::TestWithParam<BadCase> {};

TEST_P(BadRequestTest, IsInvalidArgumentNamingTheField) {
  const BadCase& c = GetParam();
  absl::StatusOr<Request> r = ParseRequest(c.endpoint, c.body);
  ASSERT_FALSE(r.ok()) << c.body;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParamOf(r.status()), c.param) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), c.says)) << r.status();
  if (*c.param != '\0') {
    EXPECT_TRUE(absl::StartsWith(r.status().message(), c.param)) << r.status();
  }
  const ApiError e = ErrorFromStatus(r.status());
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.type, "invalid_request_error");
}

INSTANTIATE_TEST_SUITE_P(
    EveryField, BadRequestTest,
    testing::Values(
        BadCase{"NotJson", kCompl, "{\"model\": ", "", "not valid JSON"},
        // A number nlohmann cannot hold is an out_of_range exception, not a parse_error (found by
        // fuzz/openai_request_fuzzer; its input is in the seed corpus as number_overflow).
        BadCase{"NumberOverflow", kCompl, R"({"model": "m", "prompt": "x", "max_tokens": 1e1111})", "",
                "number overflow"},
        BadCase{"NotAnObject", kCompl, "[1]", "", "must be a JSON object"},
        BadCase{"ModelMissing", kCompl, R"({"prompt": "x"})", "model", "is required"},
        BadCase{"ModelNotString", kCompl, R"({"model": 3, "prompt": "x"})", "model", "must be a string"},
        BadCase{"PromptMissing", kCompl, R"({"model": "m"})", "prompt", "is required"},
        BadCase{"PromptWrongType", kCompl, R"({"model": "m", "prompt": {}})", "prompt", "a string or an array"},
        BadCase{"PromptBatchMixed", kCompl, R"({"model": "m", "prompt": ["a", 5]})", "prompt[1]",
                "a string or an array of token ids"},
        BadCase{"PromptBatchIdNotInt", kCompl, R"({"model": "m", "prompt": [[1], [2, "x"]]})", "prompt[1][1]",
                "integer token id"},
        BadCase{"PromptBatchNested", kCompl, R"({"model": "m", "prompt": [[[1]]]})", "prompt[0][0]",
                "integer token id"},
        BadCase{"PromptIdsThenText", kCompl, R"({"model": "m", "prompt": [1, "a"]})", "prompt[1]",
                "integer token id"},
        BadCase{"PromptBatchTooManyChoices", kCompl, R"({"model": "m", "prompt": ["a", "b", "c", "d", "e", "f", "g",
                "h", "i", "j", "k", "l", "m", "n", "o", "p", "q"], "n": 16})", "n",
                "17 prompts of 16 choices each are 272 choices; at most 256 a request"},
        BadCase{"PromptIdNotInt", kCompl, R"({"model": "m", "prompt": [1, 2.5]})", "prompt[1]", "integer token id"},
        BadCase{"PromptIdNegative", kCompl, R"({"model": "m", "prompt": [-1]})", "prompt[0]", "not a token id"},
        BadCase{"MessagesMissing", kChat, R"({"model": "m"})", "messages", "is required"},
        BadCase{"MessagesNotArray", kChat, R"({"model": "m", "messages": "hi"})", "messages", "an array"},
        BadCase{"MessagesEmpty", kChat, R"({"model": "m", "messages": []})", "messages", "at least one"},
        BadCase{"MessageNotObject", kChat, R"({"model": "m", "messages": [1]})", "messages[0]", "an object"},
        BadCase{"RoleMissing", kChat, R"({"model": "m", "messages": [{"content": "x"}]})", "messages[0].role",
                "must be a string"},
        BadCase{"ContentNumber", kChat, R"({"model": "m", "messages": [{"role": "user", "content": 5}]})",
                "messages[0].content", "a string, an array of content parts or null"},
        BadCase{"ContentImage", kChat,
                R"({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})",
                "messages[0].content[0].type", "text only"},
        BadCase{"ContentPartNoText", kChat,
                R"({"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]})",
                "messages[0].content[0].text", "must be a string"},
        BadCase{"ToolsNotArray", kChat, R"({"model": "m", "messages": [{"role": "user"}], "tools": {}})", "tools",
                "an array"},
        BadCase{"ToolNotObject", kChat, R"({"model": "m", "messages": [{"role": "user"}], "tools": [1]})",
                "tools[0]", "an object"},
        BadCase{"KwargsNotObject", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "chat_template_kwargs": []})",
                "chat_template_kwargs", "an object"},
        BadCase{"AddGenerationPromptNotBool", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "add_generation_prompt": 1})",
                "add_generation_prompt", "a boolean"},
        BadCase{"ContinueFinalMessageNotBool", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "continue_final_message": "yes"})",
                "continue_final_message", "a boolean"},
        BadCase{"ContinueFinalMessageWithGenerationPrompt", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "continue_final_message": true,
                    "add_generation_prompt": true})",
                "continue_final_message", "cannot be used with add_generation_prompt true"},
        BadCase{"ReasoningEffortUnknown", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "reasoning_effort": "max"})", "reasoning_effort",
                "must be \"low\", \"medium\" or \"high\", got \"max\""},
        BadCase{"ReasoningEffortNotString", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "reasoning_effort": 2})", "reasoning_effort",
                "must be a string"},
        BadCase{"ReasoningEffortTwice", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "reasoning_effort": "low",
                    "chat_template_kwargs": {"reasoning_effort": "high"}})",
                "reasoning_effort", "\"low\" where chat_template_kwargs.reasoning_effort is \"high\": send one"},
        BadCase{"NZero", kCompl, R"({"model": "m", "prompt": "x", "n": 0})", "n", "must be in [1, 16]"},
        BadCase{"NTooMany", kCompl, R"({"model": "m", "prompt": "x", "n": 17})", "n", "must be in [1, 16]"},
        BadCase{"NFloat", kCompl, R"({"model": "m", "prompt": "x", "n": 1.5})", "n", "an integer"},
        BadCase{"StreamNotBool", kCompl, R"({"model": "m", "prompt": "x", "stream": "yes"})", "stream", "a boolean"},
        BadCase{"StreamOptionsWithoutStream", kCompl,
                R"({"model": "m", "prompt": "x", "stream_options": {"include_usage": true}})", "stream_options",
                "stream: true"},
        BadCase{"IncludeUsageNotBool", kCompl,
                R"({"model": "m", "prompt": "x", "stream": true, "stream_options": {"include_usage": 1}})",
                "stream_options.include_usage", "a boolean"},
        BadCase{"ContinuousUsageNotBool", kCompl,
                R"({"model": "m", "prompt": "x", "stream": true, "stream_options": {"continuous_usage_stats": 1}})",
                "stream_options.continuous_usage_stats", "a boolean"},
        BadCase{"TokenIdsNotBool", kCompl, R"({"model": "m", "prompt": "x", "return_tokens_as_token_ids": "y"})",
                "return_tokens_as_token_ids", "a boolean"},
        // One wording for every out-of-range integer: the range, then what was sent.
        BadCase{"MaxTokensZero", kCompl, R"({"model": "m", "prompt": "x", "max_tokens": 0})", "max_tokens",
                "must be in [1, 2147483647], got 0"},
        BadCase{"MaxTokensNegative", kCompl, R"({"model": "m", "prompt": "x", "max_tokens": -1})", "max_tokens",
                "must be in [1, 2147483647], got -1"},
        BadCase{"MaxTokensHuge", kCompl, R"({"model": "m", "prompt": "x", "max_tokens": 99999999999})", "max_tokens",
                "must be in [1, 2147483647], got 99999999999"},
        BadCase{"MaxCompletionTokensZero", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "max_completion_tokens": 0})",
                "max_completion_tokens", "must be in [1, 2147483647], got 0"},
        BadCase{"MaxTokensString", kCompl, R"({"model": "m", "prompt": "x", "max_tokens": "10"})", "max_tokens",
                "an integer"},
        BadCase{"MaxCompletionTokensDiffers", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "max_tokens": 4, "max_completion_tokens": 5})",
                "max_completion_tokens", "send one"},
        BadCase{"TemperatureString", kCompl, R"({"model": "m", "prompt": "x", "temperature": "hot"})", "temperature",
                "a number, got a string"},
        BadCase{"TopPString", kCompl, R"({"model": "m", "prompt": "x", "top_p": []})", "top_p", "a number"},
        BadCase{"TopPZero", kCompl, R"({"model": "m", "prompt": "x", "top_p": 0})", "top_p", "must be in (0, 1], got 0"},
        BadCase{"TopPAboveOne", kCompl, R"({"model": "m", "prompt": "x", "top_p": 1.5})", "top_p",
                "must be in (0, 1], got 1.5"},
        BadCase{"TemperatureOverflowsFloat32", kCompl, R"({"model": "m", "prompt": "x", "temperature": 1e308})",
                "temperature", "magnitude at most 1e30 (a float32), got 1e+308"},
        BadCase{"MinPBool", kCompl, R"({"model": "m", "prompt": "x", "min_p": true})", "min_p", "a number"},
        BadCase{"TopKFloat", kCompl, R"({"model": "m", "prompt": "x", "top_k": 2.5})", "top_k", "an integer"},
        BadCase{"TopKBelowMinusOne", kCompl, R"({"model": "m", "prompt": "x", "top_k": -2})", "top_k", "must be in"},
        BadCase{"SeedString", kCompl, R"({"model": "m", "prompt": "x", "seed": "7"})", "seed", "an integer"},
        BadCase{"PresencePenaltyString", kCompl, R"({"model": "m", "prompt": "x", "presence_penalty": "1"})",
                "presence_penalty", "a number"},
        BadCase{"FrequencyPenaltyObject", kCompl, R"({"model": "m", "prompt": "x", "frequency_penalty": {}})",
                "frequency_penalty", "a number"},
        BadCase{"RepetitionPenaltyString", kCompl, R"({"model": "m", "prompt": "x", "repetition_penalty": "x"})",
                "repetition_penalty", "a number"},
        BadCase{"StopNumber", kCompl, R"({"model": "m", "prompt": "x", "stop": 3})", "stop",
                "a string or an array of strings"},
        BadCase{"StopListItem", kCompl, R"({"model": "m", "prompt": "x", "stop": ["a", 1]})", "stop[1]", "a string"},
        BadCase{"StopTokenIds", kCompl, R"({"model": "m", "prompt": "x", "stop_token_ids": [1, -1]})",
                "stop_token_ids[1]", "a token id"},
        BadCase{"IgnoreEosString", kCompl, R"({"model": "m", "prompt": "x", "ignore_eos": "true"})", "ignore_eos",
                "a boolean"},
        BadCase{"ChatLogprobsInt", kChat, R"({"model": "m", "messages": [{"role": "user"}], "logprobs": 2})",
                "logprobs", "a boolean"},
        BadCase{"ChatTopLogprobsWithoutLogprobs", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "top_logprobs": 2})", "top_logprobs",
                "needs logprobs: true"},
        BadCase{"ChatTopLogprobsNegative", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "logprobs": true, "top_logprobs": -1})",
                "top_logprobs", "must be in"},
        BadCase{"CompletionLogprobsBool", kCompl, R"({"model": "m", "prompt": "x", "logprobs": true})", "logprobs",
                "an integer"},
        BadCase{"UserNotString", kCompl, R"({"model": "m", "prompt": "x", "user": 5})", "user", "a string"},
        BadCase{"SkipSpecialTokensNotBool", kCompl, R"({"model": "m", "prompt": "x", "skip_special_tokens": 0})",
                "skip_special_tokens", "a boolean"},
        BadCase{"IncludeStopNotBool", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "include_stop_str_in_output": "yes"})",
                "include_stop_str_in_output", "a boolean"},
        BadCase{"TruncateZero", kCompl, R"({"model": "m", "prompt": "x", "truncate_prompt_tokens": 0})",
                "truncate_prompt_tokens", "must be in [1, "},
        BadCase{"RequestIdWithSpace", kCompl, R"({"model": "m", "prompt": "x", "request_id": "a b"})", "request_id",
                "printable characters without spaces"},
        BadCase{"EchoWithLogprobsStreamed", kCompl,
                R"({"model": "m", "prompt": "x", "echo": true, "logprobs": 1, "stream": true})", "echo",
                "send stream: false"},
        BadCase{"PromptLogprobsStreamed", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "prompt_logprobs": 0, "stream": true})",
                "prompt_logprobs", "send stream: false"},
        BadCase{"PromptLogprobsNegative", kCompl, R"({"model": "m", "prompt": "x", "prompt_logprobs": -1})",
                "prompt_logprobs", "must be in [0, "},
        BadCase{"AllowedTokenIdsNotArray", kCompl, R"({"model": "m", "prompt": "x", "allowed_token_ids": 5})",
                "allowed_token_ids", "an array of token ids"},
        BadCase{"AllowedTokenIdNegative", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "allowed_token_ids": [1, -2]})",
                "allowed_token_ids[1]", "must be a token id"},
        BadCase{"BadWordNotString", kChat, R"({"model": "m", "messages": [{"role": "user"}], "bad_words": ["a", 1]})",
                "bad_words[1]", "a string"},
        BadCase{"PromptLogprobsNotInt", kCompl, R"({"model": "m", "prompt": "x", "prompt_logprobs": true})",
                "prompt_logprobs", "an integer"},
        BadCase{"EchoNotBool", kChat, R"({"model": "m", "messages": [{"role": "user"}], "echo": 1})", "echo",
                "a boolean"},
        BadCase{"Suffix", kCompl, R"({"model": "m", "prompt": "x", "suffix": "end"})", "suffix", "not supported"},
        BadCase{"BestOf", kCompl, R"({"model": "m", "prompt": "x", "best_of": 3})", "best_of", "only 1"},
        BadCase{"LogitBiasNotObject", kCompl, R"({"model": "m", "prompt": "x", "logit_bias": [5]})", "logit_bias",
                "an object of token id to bias"},
        BadCase{"LogitBiasKeyNotId", kCompl, R"({"model": "m", "prompt": "x", "logit_bias": {"hello": 10}})",
                "logit_bias", "key 'hello' is not a token id"},
        BadCase{"LogitBiasKeyNegative", kCompl, R"({"model": "m", "prompt": "x", "logit_bias": {"-5": 10}})",
                "logit_bias", "key '-5' is not a token id"},
        BadCase{"LogitBiasKeyHuge", kCompl, R"({"model": "m", "prompt": "x", "logit_bias": {"99999999999": 1}})",
                "logit_bias", "is not a token id"},
        BadCase{"LogitBiasValueString", kCompl, R"({"model": "m", "prompt": "x", "logit_bias": {"5": "up"}})",
                "logit_bias[5]", "a number"},
        BadCase{"LogitBiasValueOverflowsFloat32", kCompl, R"({"model": "m", "prompt": "x", "logit_bias": {"5": 1e39}})",
                "logit_bias[5]", "magnitude at most 1e30 (a float32), got 1e+39"},
        BadCase{"MinTokensNegative", kCompl, R"({"model": "m", "prompt": "x", "min_tokens": -1})", "min_tokens",
                "must be in [0, 2147483647], got -1"},
        BadCase{"ToolChoiceRequiredWithoutTools", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "tool_choice": "required"})",
                "tool_choice", "\"required\" needs tools"},
        BadCase{"ToolChoiceNamedUnknown", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "tools": [{"type": "function", "function": {"name": "g"}}], "tool_choice": {"type": "function", "function": {"name": "f"}}})",
                "tool_choice.function.name", "'f' is not one of the tools"},
        BadCase{"ToolChoiceNamedNoType", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"function": {"name": "f"}}})",
                "tool_choice.type", "must be \"function\""},
        BadCase{"ToolChoiceRequiredAndGuided", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "guided_regex": "a"})",
                "tool_choice", "cannot be combined with guided_regex"},
        BadCase{"ToolChoiceUnknown", kChat, R"({"model": "m", "messages": [{"role": "user"}], "tool_choice": "any"})",
                "tool_choice", "'any' is not one of"},
        BadCase{"ToolChoiceNumber", kChat, R"({"model": "m", "messages": [{"role": "user"}], "tool_choice": 1})",
                "tool_choice", "a string or an object"},
        // Structured outputs: each field's shape and bounds, and one constraint per request.
        BadCase{"ResponseFormatNotObject", kChat, R"({"model": "m", "messages": [{"role": "user"}], "response_format": "json"})",
                "response_format", "an object"},
        BadCase{"ResponseFormatUnknownType", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "response_format": {"type": "yaml"}})",
                "response_format.type", "'yaml' is not one of"},
        BadCase{"ResponseFormatSchemaMissing", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})",
                "response_format.json_schema.schema", "is required"},
        BadCase{"ResponseFormatNoJsonSchema", kCompl,
                R"({"model": "m", "prompt": "x", "response_format": {"type": "json_schema"}})",
                "response_format.json_schema", "must be an object"},
        BadCase{"ResponseFormatSchemaString", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}})",
                "response_format.json_schema.schema", "a JSON Schema object"},
        BadCase{"ResponseFormatStrictNotBool", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": 1}}})",
                "response_format.json_schema.strict", "a boolean"},
        BadCase{"GuidedJsonNumber", kCompl, R"({"model": "m", "prompt": "x", "guided_json": 3})", "guided_json",
                "a JSON Schema (an object, or its text)"},
        BadCase{"GuidedRegexNotString", kCompl, R"({"model": "m", "prompt": "x", "guided_regex": ["a"]})",
                "guided_regex", "a string"},
        BadCase{"GuidedRegexEmpty", kCompl, R"({"model": "m", "prompt": "x", "guided_regex": ""})", "guided_regex",
                "must be 1 to 65536 bytes"},
        BadCase{"GuidedChoiceEmpty", kCompl, R"({"model": "m", "prompt": "x", "guided_choice": []})", "guided_choice",
                "1 to 256 strings"},
        BadCase{"GuidedChoiceNotString", kCompl, R"({"model": "m", "prompt": "x", "guided_choice": ["a", 2]})",
                "guided_choice[1]", "a string"},
        BadCase{"GuidedChoiceEmptyString", kCompl, R"({"model": "m", "prompt": "x", "guided_choice": [""]})",
                "guided_choice[0]", "1 to 4096 bytes"},
        BadCase{"GuidedGrammarNotString", kCompl, R"({"model": "m", "prompt": "x", "guided_grammar": {}})",
                "guided_grammar", "a string"},
        BadCase{"StructuredOutputsNotObject", kCompl, R"({"model": "m", "prompt": "x", "structured_outputs": "json"})",
                "structured_outputs", "an object"},
        BadCase{"StructuredOutputsTwoKinds", kCompl,
                R"({"model": "m", "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}})",
                "structured_outputs.choice", "cannot be combined with structured_outputs.regex"},
        BadCase{"TwoConstraints", kCompl, R"({"model": "m", "prompt": "x", "guided_regex": "a", "guided_choice": ["b"]})",
                "guided_choice", "cannot be combined with guided_regex: one constraint per request"},
        BadCase{"ResponseFormatAndGuided", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "response_format": {"type": "json_object"}, "guided_json": {}})",
                "guided_json", "cannot be combined with response_format"},
        BadCase{"ParallelToolCallsNotBool", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "parallel_tool_calls": "yes"})", "parallel_tool_calls",
                "a boolean"},
        BadCase{"ToolTypeNotFunction", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "tools": [{"type": "code_interpreter"}]})",
                "tools[0].type", "must be \"function\""},
        BadCase{"ToolFunctionMissing", kChat, R"({"model": "m", "messages": [{"role": "user"}], "tools": [{"type": "function"}]})",
                "tools[0].function", "must be an object"},
        BadCase{"ToolNameBadCharacters", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "tools": [{"type": "function", "function": {"name": "get weather"}}]})",
                "tools[0].function.name", "may hold only letters, digits, '_' and '-'"},
        BadCase{"ToolNameTooLong", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "tools": [{"type": "function", "function": {"name": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"}}]})",
                "tools[0].function.name", "must be 1 to 64 characters, got 65"},
        BadCase{"ToolNameTwice", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]})",
                "tools[1].function.name", "'f' names another tool too"},
        BadCase{"ToolParametersNotObject", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]})",
                "tools[0].function.parameters", "a JSON Schema object"},
        // A forced call's schema the grammar cannot take names the tool's parameters, not a path
        // in the calls' combined schema; tools the call may not name are not converted.
        BadCase{"RequiredToolParametersBadPattern", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {"a": {"type": "string", "pattern": "["}}}}}]})",
                "tools[1].function.parameters", "JSON Schema at /properties/a/pattern: regular expression"},
        BadCase{"NamedToolParametersBadPattern", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"minLength": -1}}}, {"type": "function", "function": {"name": "g", "parameters": {"type": "string", "minLength": 1000000}}}]})",
                "tools[1].function.parameters", "JSON Schema at /minLength: must be an integer from 0 to 1000"},
        BadCase{"ToolCallArgumentsNotJson", kChat,
                R"({"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]})",
                "messages[0].tool_calls[0].function.arguments", "the text of a JSON object"},
        BadCase{"ToolCallFunctionMissing", kChat,
                R"({"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]})",
                "messages[0].tool_calls[0].function", "must be an object"},
        BadCase{"ToolCallsNotArray", kChat,
                R"({"model": "m", "messages": [{"role": "assistant", "tool_calls": {}}]})", "messages[0].tool_calls",
                "an array"},
        BadCase{"ResponseFormatTypeMissing", kChat,
                R"({"model": "m", "messages": [{"role": "user"}], "response_format": {}})", "response_format.type",
                "must be a string"}),
    [](const testing::TestParamInfo<BadCase>& info) { return std::string(info.param.name); });

TEST(ParseRequestTest, CompletionWithEveryField) {
  absl::StatusOr<Request> r = ParseRequest(kCompl, R"({
    "model": "demo", "prompt": "And God said", "n": 2, "stream": true,
    "stream_options": {"include_usage": true}, "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
    "top_k": 40, "min_p": 0.05, "seed": 11, "stop": ["\n", "Amen"], "presence_penalty": 0.5,
    "frequency_penalty": -0.5, "logprobs": 3, "ignore_eos": true, "user": "u1", "unknown_field": [1],
    "echo": false, "best_of": 1, "logit_bias": {}, "suffix": null})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->model, "demo");
  ASSERT_EQ(r->prompts.size(), 1u);
  EXPECT_EQ(r->prompts[0].text, "And God said");
  EXPECT_FALSE(r->prompts[0].is_ids);
  EXPECT_EQ(r->n, 2);
  EXPECT_TRUE(r->stream);
  EXPECT_TRUE(r->include_usage);
  EXPECT_EQ(r->max_tokens, 7);
  EXPECT_EQ(r->user, "u1");
  const v1::SamplingParams& s = r->sampling;
  EXPECT_FLOAT_EQ(s.temperature(), 0.5f);
  EXPECT_FLOAT_EQ(s.top_p(), 0.9f);
  EXPECT_EQ(s.top_k(), 40);
  EXPECT_FLOAT_EQ(s.min_p(), 0.05f);
  EXPECT_EQ(s.seed(), 11u);
  ASSERT_EQ(s.stop_size(), 2);
  EXPECT_EQ(s.stop(1), "Amen");
  EXPECT_FLOAT_EQ(s.presence_penalty(), 0.5f);
  EXPECT_FLOAT_EQ(s.frequency_penalty(), -0.5f);
  EXPECT_TRUE(s.logprobs());
  EXPECT_EQ(s.top_logprobs(), 3);
  EXPECT_TRUE(s.ignore_eos());

  // Choice 1 of 2: seed + 1; the prompt as text for PrepareGeneration to tokenize.
  const v1::GenerateRequest g = ToGenerateRequest(*r, 0, 1, 7, nullptr);
  EXPECT_EQ(g.text(), "And God said");
  EXPECT_EQ(g.sampling().max_tokens(), 7);
  EXPECT_EQ(g.sampling().seed(), 12u);
  EXPECT_EQ(g.sampling().stop_size(), 2);
}

TEST(ParseRequestTest, DefaultsFollowOpenAI) {
  absl::StatusOr<Request> r = ParseRequest(kCompl, R"({"model": "m", "prompt": [[3, 4, 5]], "top_k": -1})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->prompts.size(), 1u);  // a list of one prompt is that prompt
  EXPECT_TRUE(r->prompts[0].is_ids);
  EXPECT_EQ(r->prompts[0].ids, (std::vector<int32_t>{3, 4, 5}));
  EXPECT_EQ(r->n, 1);
  EXPECT_FALSE(r->stream);
  EXPECT_FALSE(r->max_tokens.has_value());
  EXPECT_FLOAT_EQ(r->sampling.temperature(), 1.0f);  // OpenAI's default: sampling
  EXPECT_EQ(r->sampling.top_k(), 0);                 // -1: no limit
  EXPECT_FALSE(r->sampling.has_seed());
  EXPECT_FALSE(r->sampling.logprobs());
  const std::vector<int32_t> ids = {3, 4, 5};
  const v1::GenerateRequest g = ToGenerateRequest(*r, 0, 3, 16, &ids);
  EXPECT_EQ(g.token_ids().ids_size(), 3);
  EXPECT_FALSE(g.sampling().has_seed());  // unseeded choices stay unseeded: each draws its own
}

// A batch of prompts (strings and token id lists mixed, as OpenAI's API takes them): each its own
// GenerateRequest, every one with the request's sampling and the same seeds as when sent alone.
TEST(ParseRequestTest, ABatchOfPromptsIsEachItsOwnRequest) {
  absl::StatusOr<Request> r =
      ParseRequest(kCompl, R"({"model": "m", "prompt": ["And God said", [3, 4], ""], "n": 2, "seed": 5})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->prompts.size(), 3u);
  EXPECT_EQ(r->prompts[0].text, "And God said");
  EXPECT_FALSE(r->prompts[0].is_ids);
  EXPECT_TRUE(r->prompts[1].is_ids);
  EXPECT_EQ(r->prompts[1].ids, (std::vector<int32_t>{3, 4}));
  EXPECT_EQ(r->prompts[2].text, "");
  EXPECT_EQ(ToGenerateRequest(*r, 0, 1, 8, nullptr).text(), "And God said");
  EXPECT_EQ(ToGenerateRequest(*r, 2, 0, 8, nullptr).text(), "");
  EXPECT_EQ(ToGenerateRequest(*r, 2, 0, 8, nullptr).sampling().seed(), 5u);
  EXPECT_EQ(ToGenerateRequest(*r, 2, 1, 8, nullptr).sampling().seed(), 6u);

  std::string many = R"({"model": "m", "prompt": [)";
  for (int i = 0; i <= kMaxPrompts; ++i) many += absl::StrCat(i ? ", " : "", "\"p\"");
  many += "]}";
  absl::StatusOr<Request> over = ParseRequest(kCompl, many);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(ParamOf(over.status()), "prompt");
  EXPECT_TRUE(absl::StrContains(over.status().message(), "a batch of 257 prompts; at most 256")) << over.status();
}

// An error PrepareGeneration finds in one prompt of a batch names that prompt.
TEST(SharedValidationTest, AnErrorInABatchNamesItsPrompt) {
  ServedModel model;
  model.name = "m";
  model.config.vocab_size = 4096;
  absl::StatusOr<Request> r = ParseRequest(kCompl, R"({"model": "m", "prompt": [[1, 2], [3, 9999], []]})");
  ASSERT_TRUE(r.ok()) << r.status();
  for (int p : {1, 2}) {
    absl::StatusOr<GenerationParams> g =
        PrepareGeneration(ToGenerateRequest(*r, p, 0, 8, &r->prompts[p].ids), model, 512, "req-1");
    ASSERT_FALSE(g.ok()) << p;
    const absl::Status s = RenameGenerationError(g.status(), kCompl, r->constraint_field, p);
    EXPECT_EQ(ParamOf(s), p == 1 ? "prompt[1][1]" : "prompt[2]") << s;
    EXPECT_TRUE(absl::StartsWith(s.message(), absl::StrCat(ParamOf(s), ": "))) << s;
  }
  // Not a batch: the index of the id alone, as before.
  absl::StatusOr<GenerationParams> g = PrepareGeneration(ToGenerateRequest(*r, 1, 0, 8, &r->prompts[1].ids), model, 512, "r");
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(ParamOf(RenameGenerationError(g.status(), kCompl)), "prompt[1]");
}

TEST(ParseRequestTest, ChatMessagesToolsAndKwargs) {
  absl::StatusOr<Request> r = ParseRequest(kChat, R"({
    "model": "m", "messages": [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
      {"role": "assistant", "content": null,
       "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": [1, 2]}"}}]}],
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "chat_template_kwargs": {"enable_thinking": false}, "add_generation_prompt": false,
    "max_completion_tokens": 9, "logprobs": true, "top_logprobs": 2, "response_format": {"type": "text"}})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->messages.size(), 3u);
  EXPECT_EQ(r->messages[1]["content"], "one\ntwo");  // text parts joined
  EXPECT_TRUE(r->messages[2]["content"].is_null());
  EXPECT_EQ(r->messages[2]["tool_calls"][0]["id"], "c1");  // other keys kept for the template
  // The arguments' text parsed into the object templates render.
  EXPECT_EQ(r->messages[2]["tool_calls"][0]["function"]["arguments"], Json::parse(R"({"x": [1, 2]})"));
  EXPECT_EQ(r->tool_choice, ToolChoice::kAuto);
  EXPECT_TRUE(r->parallel_tool_calls);
  EXPECT_EQ(r->tools.size(), 1u);
  EXPECT_EQ(r->chat_template_kwargs["enable_thinking"], false);
  EXPECT_FALSE(r->add_generation_prompt);
  EXPECT_EQ(r->max_tokens, 9);
  EXPECT_TRUE(r->sampling.logprobs());
  EXPECT_EQ(r->sampling.top_logprobs(), 2);
}

// reasoning_effort reaches the chat template as its variable of that name (gpt-oss's writes it);
// the same value in chat_template_kwargs too is accepted.
TEST(ParseRequestTest, ContinueFinalMessageTurnsTheGenerationPromptOff) {
  absl::StatusOr<Request> r = ParseRequest(
      kChat, R"({"model": "m", "messages": [{"role": "assistant", "content": "Once"}], "continue_final_message": true})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->continue_final_message);
  EXPECT_FALSE(r->add_generation_prompt);
  r = ParseRequest(kChat, R"({"model": "m", "messages": [{"role": "user"}], "continue_final_message": false})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->continue_final_message);
  EXPECT_TRUE(r->add_generation_prompt);
}

// vLLM's /tokenize and /detokenize bodies.
TEST(TokenizeRequestTest, APromptOrMessages) {
  absl::StatusOr<TokenizeRequest> t = ParseTokenizeRequest(R"({"prompt": "Hello"})");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_FALSE(t->chat);
  EXPECT_EQ(t->prompt, "Hello");
  EXPECT_TRUE(t->add_special_tokens);
  EXPECT_FALSE(t->return_token_strs);
  EXPECT_TRUE(t->model.empty());
  t = ParseTokenizeRequest(R"({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
    "add_generation_prompt": false, "continue_final_message": true, "return_token_strs": true,
    "chat_template_kwargs": {"enable_thinking": false}})");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(t->chat);
  EXPECT_EQ(t->model, "m");
  EXPECT_FALSE(t->add_special_tokens);  // the template writes them
  EXPECT_TRUE(t->return_token_strs);
  EXPECT_TRUE(t->messages.continue_final_message);
  EXPECT_EQ(t->messages.messages[0]["content"], "a");  // parts joined, as for a chat completion
  EXPECT_EQ(t->messages.chat_template_kwargs, Json::parse(R"({"enable_thinking": false})"));
  t = ParseTokenizeRequest(R"({"messages": [{"role": "user", "content": "a"}], "add_special_tokens": true})");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(t->add_special_tokens);

  struct Bad {
    const char* body;
    const char* param;
    const char* says;
  };
  for (const Bad& b : {Bad{R"({})", "messages", "is required (or a prompt)"},
                       Bad{R"({"prompt": "a", "messages": []})", "prompt", "not both"},
                       Bad{R"({"prompt": [1, 2]})", "prompt", "a string"},
                       Bad{R"({"messages": [{"role": 1}]})", "messages[0].role", "a string"},
                       Bad{R"({"prompt": "a", "model": 3})", "model", "a string"},
                       Bad{R"({"prompt": "a", "return_token_strs": "yes"})", "return_token_strs", "a boolean"},
                       Bad{R"([1])", "", "a JSON object"}}) {
    absl::StatusOr<TokenizeRequest> r = ParseTokenizeRequest(b.body);
    ASSERT_FALSE(r.ok()) << b.body;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << b.body;
    EXPECT_EQ(ParamOf(r.status()), b.param) << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), b.says)) << r.status();
  }
}

TEST(TokenizeRequestTest, DetokenizeTakesTokenIds) {
  absl::StatusOr<DetokenizeRequest> d = ParseDetokenizeRequest(R"({"model": "m", "tokens": [1, 2, 2147483647]})");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->model, "m");
  EXPECT_EQ(d->tokens, (std::vector<int32_t>{1, 2, 2147483647}));
  d = ParseDetokenizeRequest(R"({"tokens": []})");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(d->tokens.empty());
  for (const auto& [body, param] : std::vector<std::pair<const char*, const char*>>{
           {R"({})", "tokens"}, {R"({"tokens": "1 2"})", "tokens"}, {R"({"tokens": [1, -1]})", "tokens[1]"},
           {R"({"tokens": [1, 2147483648]})", "tokens[1]"}, {R"({"tokens": [1.5]})", "tokens[0]"}}) {
    absl::StatusOr<DetokenizeRequest> r = ParseDetokenizeRequest(body);
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_EQ(ParamOf(r.status()), param) << r.status();
  }
}

TEST(ParseRequestTest, ReasoningEffortIsATemplateVariable) {
  absl::StatusOr<Request> r =
      ParseRequest(kChat, R"({"model": "m", "messages": [{"role": "user"}], "reasoning_effort": "high"})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->chat_template_kwargs, Json::parse(R"({"reasoning_effort": "high"})"));
  r = ParseRequest(kChat, R"({"model": "m", "messages": [{"role": "user"}], "reasoning_effort": "low",
    "chat_template_kwargs": {"reasoning_effort": "low", "x": 1}})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->chat_template_kwargs, Json::parse(R"({"reasoning_effort": "low", "x": 1})"));
  r = ParseRequest(kChat, R"({"model": "m", "messages": [{"role": "user"}], "reasoning_effort": null})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->chat_template_kwargs.is_null());
}

TEST(ParseRequestTest, ToolChoiceNoneAndOneCall) {
  absl::StatusOr<Request> r = ParseRequest(kChat, R"({"model": "m", "messages": [{"role": "user"}],
    "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}],
    "tool_choice": "none", "parallel_tool_calls": false})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tool_choice, ToolChoice::kNone);
  EXPECT_FALSE(r->parallel_tool_calls);
}

TEST(ParseRequestTest, LogitBiasAndMinTokensReachTheSamplingParams) {
  absl::StatusOr<Request> r = ParseRequest(
      kCompl, R"({"model": "m", "prompt": "x", "logit_bias": {"5": 100, "17": -100, "3": 0.5}, "min_tokens": 4})");
  ASSERT_TRUE(r.ok()) << r.status();
  const v1::GenerateRequest g = ToGenerateRequest(*r, 0, 0, 8, nullptr);
  ASSERT_EQ(g.sampling().logit_bias_size(), 3);
  EXPECT_EQ(g.sampling().logit_bias().at(5), 100.0f);
  EXPECT_EQ(g.sampling().logit_bias().at(17), -100.0f);
  EXPECT_EQ(g.sampling().logit_bias().at(3), 0.5f);
  EXPECT_EQ(g.sampling().min_tokens(), 4);
}

// logit_bias's bounds (how many ids, the ids against the vocabulary, each bias's range) are checked
// once, by the validation both APIs share (PrepareGeneration): the body parses, and the request is
// refused there, its error renamed to the OpenAI field as the server does.
// vLLM's output controls reach the generation: special tokens kept, the stop string kept, the
// prompt's start dropped.
TEST(SharedValidationTest, OutputControlsReachTheGeneration) {
  ServedModel model;
  model.name = "m";
  model.config.vocab_size = 4096;
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5};
  absl::StatusOr<Request> r = ParseRequest(kCompl, R"({"model": "m", "prompt": [1, 2, 3, 4, 5],
    "skip_special_tokens": false, "include_stop_str_in_output": true, "truncate_prompt_tokens": 2})");
  ASSERT_TRUE(r.ok()) << r.status();
  absl::StatusOr<GenerationParams> g = PrepareGeneration(ToGenerateRequest(*r, 0, 0, 8, &prompt), model, 512, "req");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_FALSE(g->skip_special_tokens);
  EXPECT_TRUE(g->include_stop_str_in_output);
  EXPECT_EQ(g->prompt, (std::vector<int32_t>{4, 5}));
  // Defaults: special tokens skipped, the stop string left out, the whole prompt.
  r = ParseRequest(kCompl, R"({"model": "m", "prompt": [1, 2, 3, 4, 5], "truncate_prompt_tokens": 9})");
  ASSERT_TRUE(r.ok()) << r.status();
  g = PrepareGeneration(ToGenerateRequest(*r, 0, 0, 8, &prompt), model, 512, "req");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_TRUE(g->skip_special_tokens);
  EXPECT_FALSE(g->include_stop_str_in_output);
  EXPECT_EQ(g->prompt, prompt);
  // A prompt too long for the context fits once truncated.
  const std::vector<int32_t> long_prompt(600, 7);
  r = ParseRequest(kChat, R"({"model": "m", "messages": [{"role": "user"}], "truncate_prompt_tokens": 500})");
  ASSERT_TRUE(r.ok()) << r.status();
  g = PrepareGeneration(ToGenerateRequest(*r, 0, 0, 8, &long_prompt), model, 512, "req");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->prompt.size(), 500u);
  // The gRPC API's negative count names its field, as the OpenAI API spells it.
  v1::GenerateRequest grpc = ToGenerateRequest(*r, 0, 0, 8, &long_prompt);
  grpc.mutable_sampling()->set_truncate_prompt_tokens(-1);
  g = PrepareGeneration(grpc, model, 512, "req");
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(ParamOf(g.status()), "sampling.truncate_prompt_tokens");
  EXPECT_EQ(ParamOf(RenameGenerationError(g.status(), kChat)), "truncate_prompt_tokens");
}

TEST(SharedValidationTest, LogitBiasBoundsAreCheckedOnceForBothAPIs) {
  ServedModel model;
  model.name = "m";
  model.config.vocab_size = 4096;
  const std::vector<int32_t> prompt = {1};  // the prompt as the chat template and tokenizer make it
  std::string many = R"({"model": "m", "prompt": "x", "logit_bias": {)";
  for (int i = 0; i <= shardserve::kMaxLogitBiasEntries; ++i) many += absl::StrCat(i ? ", " : "", "\"", i, "\": 1");
  many += "}}";
  struct Case {
    Endpoint endpoint;
    std::string body;
    const char* says;
  };
  for (const Case& c : {
           Case{kChat, R"({"model": "m", "messages": [{"role": "user"}], "logit_bias": {"5": 100.5}})",
                "the bias of token id 5 must be in [-100, 100], got 100.5"},
           Case{kCompl, many, "at most 1024 token ids, got 1025"},
           Case{kCompl, R"({"model": "m", "prompt": "x", "logit_bias": {"9999": 1}})",
                "token id 9999 is outside the vocabulary [0, 4096)"},
       }) {
    absl::StatusOr<Request> r = ParseRequest(c.endpoint, c.body);
    ASSERT_TRUE(r.ok()) << c.says << ": " << r.status();
    absl::StatusOr<GenerationParams> p = PrepareGeneration(ToGenerateRequest(*r, 0, 0, 8, &prompt), model, 512, "req-1");
    ASSERT_FALSE(p.ok()) << c.says;
    const absl::Status s = RenameGenerationError(p.status(), c.endpoint, r->constraint_field);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(ParamOf(s), "logit_bias") << s;
    EXPECT_TRUE(absl::StartsWith(s.message(), "logit_bias: ")) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), c.says)) << s;
    const ApiError e = ErrorFromStatus(s);
    EXPECT_EQ(e.http_status, 400);
    EXPECT_EQ(e.type, "invalid_request_error");
  }
}

TEST(ParseRequestTest, ToolsOverTheBoundAreRefused) {
  std::string body = R"({"model": "m", "messages": [{"role": "user"}], "tools": [)";
  for (int i = 0; i <= kMaxTools; ++i) {
    body += absl::StrCat(i ? ", " : "", R"({"type": "function", "function": {"name": "f)", i, R"("}})");
  }
  body += "]}";
  absl::StatusOr<Request> r = ParseRequest(kChat, body);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(ParamOf(r.status()), "tools");
  EXPECT_TRUE(absl::StrContains(r.status().message(), "at most 128 tools, got 129")) << r.status();
}

TEST(ResponseJsonTest, ToolCallsAndReasoningInTheMessageAndTheDeltas) {
  OutputSplit whole;
  whole.reasoning = "think";
  whole.calls = {{"get_weather", R"({"city":"Paris"})"}, {"f", "{}"}};
  const Json message = ChatMessage(whole, /*reasoning=*/true, {"call_a", "call_b"});
  EXPECT_EQ(message, Json::parse(R"({"role": "assistant", "content": null, "reasoning_content": "think",
    "tool_calls": [{"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
                   {"id": "call_b", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})"));
  // Without calls or reasoning: the plain message.
  OutputSplit text;
  text.content = "hi";
  EXPECT_EQ(ChatMessage(text, false, {}), Json::parse(R"({"role": "assistant", "content": "hi"})"));

  OutputSplit piece;
  piece.content = "Sure.";
  piece.calls = {{"f", R"({"a":1})"}};
  const std::vector<Json> deltas = ChatDeltas(piece, /*first_call=*/1, {"call_a", "call_b"});
  ASSERT_EQ(deltas.size(), 3u);
  EXPECT_EQ(deltas[0], Json::parse(R"({"content": "Sure."})"));
  EXPECT_EQ(deltas[1], Json::parse(
      R"({"tool_calls": [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "f", "arguments": ""}}]})"));
  EXPECT_EQ(deltas[2], Json::parse(R"({"tool_calls": [{"index": 1, "function": {"arguments": "{\"a\":1}"}}]})"));
  EXPECT_TRUE(ChatDeltas(OutputSplit(), 0, {}).empty());

  EXPECT_STREQ(ChatFinishReason(v1::FINISH_REASON_STOP_TOKEN, true), "tool_calls");
  EXPECT_STREQ(ChatFinishReason(v1::FINISH_REASON_LENGTH, true), "length");
  EXPECT_STREQ(ChatFinishReason(v1::FINISH_REASON_STOP_TOKEN, false), "stop");
}

TEST(OutputSplitterTest, ReasoningThenToolCallsOutsideIt) {
  OutputSplitter splitter(/*reasoning=*/true, /*reasoning_inside=*/false, ToolCallFormat::kHermes, 8);
  const std::string text =
      "<think>maybe <tool_call>{\"name\": \"no\"}</tool_call></think>\n\nOK <tool_call>{\"name\": \"yes\"}</tool_call>";
  OutputSplit all;
  for (size_t i = 0; i < text.size(); i += 3) {
    OutputSplit d = splitter.Add(text.substr(i, 3), i + 3 >= text.size());
    all.reasoning += d.reasoning;
    all.content += d.content;
    all.calls.insert(all.calls.end(), d.calls.begin(), d.calls.end());
  }
  EXPECT_EQ(all.reasoning, "maybe <tool_call>{\"name\": \"no\"}</tool_call>");
  EXPECT_EQ(all.content, "OK");
  ASSERT_EQ(all.calls.size(), 1u);
  EXPECT_EQ(all.calls[0].name, "yes");
}

// A streamed answer (incremental): reasoning, content, then the call as pieces while it is written,
// whose deltas are the call's name first and then its arguments, joining to the whole answer's.
TEST(OutputSplitterTest, StreamedAutoCallsComeInPieces) {
  const std::string text =
      "<think>hm</think>\n\nLet me look. <tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
      "{\"city\": \"Paris, France\", \"days\": 3}}\n</tool_call>";
  OutputSplitter whole_splitter(/*reasoning=*/true, /*reasoning_inside=*/false, ToolCallFormat::kHermes, 8);
  const OutputSplit whole = whole_splitter.Add(text, true);
  ASSERT_EQ(whole.calls.size(), 1u);
  EXPECT_TRUE(whole.pieces.empty());

  OutputSplitter splitter(true, false, ToolCallFormat::kHermes, 8, nullptr, /*incremental=*/true);
  OutputSplit all;
  std::vector<Json> deltas;
  int argument_deltas = 0;
  for (size_t i = 0; i < text.size(); i += 4) {
    const OutputSplit d = splitter.Add(text.substr(i, 4), i + 4 >= text.size());
    EXPECT_TRUE(d.calls.empty());
    all.reasoning += d.reasoning;
    all.content += d.content;
    for (const ToolCallPiece& p : d.pieces) {
      if (!p.name.empty()) all.calls.push_back(ToolCall{p.name, ""});
      ASSERT_EQ(p.index, 0);
      all.calls.back().arguments += p.arguments;
    }
    for (const Json& delta : ChatDeltas(d, 0, {"call_1"})) {
      deltas.push_back(delta);
      if (delta.contains("tool_calls") && !delta["tool_calls"][0].contains("id")) ++argument_deltas;
    }
  }
  EXPECT_EQ(all.reasoning, whole.reasoning);
  EXPECT_EQ(all.content, "Let me look.");
  EXPECT_EQ(all.calls, whole.calls);
  EXPECT_EQ(all.calls[0].arguments, R"({"city":"Paris, France","days":3})");
  EXPECT_GT(argument_deltas, 3);
  // The call's first delta: index, id, type, name, arguments "".
  const auto first = std::find_if(deltas.begin(), deltas.end(), [](const Json& d) { return d.contains("tool_calls"); });
  ASSERT_NE(first, deltas.end());
  EXPECT_EQ(first->dump(),
            R"({"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"get_weather","arguments":""}}]})");
}

// An OpenAI-shaped conversation with tool calls (arguments as JSON text) renders through each
// family's template exactly as transformers rendered the fixture (arguments as objects); each
// template names its family's tool-call and reasoning formats.
TEST(ChatTemplateFixturesTest, ToolCallHistoryRendersAsTransformersDoes) {
  const std::filesystem::path fixtures = std::filesystem::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/chat_templates";
  struct Family {
    const char* dir;
    ToolCallFormat tools;
    ReasoningFormat reasoning;
  };
  int rendered = 0;
  for (const Family& family : {Family{"qwen3", ToolCallFormat::kHermes, ReasoningFormat::kThink},
                               Family{"qwen2_5", ToolCallFormat::kHermes, ReasoningFormat::kNone},
                               Family{"hermes3", ToolCallFormat::kHermes, ReasoningFormat::kNone},
                               Family{"llama3_1", ToolCallFormat::kLlama3Json, ReasoningFormat::kNone},
                               Family{"mistral_small_3_1", ToolCallFormat::kMistral, ReasoningFormat::kNone},
                               Family{"deepseek_r1_distill", ToolCallFormat::kDeepSeekV3, ReasoningFormat::kThink},
                               Family{"deepseek_v3_1", ToolCallFormat::kDeepSeekV3, ReasoningFormat::kThink},
                               Family{"kimi_k2", ToolCallFormat::kKimiK2, ReasoningFormat::kNone},
                               Family{"mistral_nemo", ToolCallFormat::kMistral, ReasoningFormat::kNone},
                               Family{"glm4_6", ToolCallFormat::kGlm45, ReasoningFormat::kThink},
                               Family{"phi4_mini", ToolCallFormat::kNone, ReasoningFormat::kNone}}) {
    SCOPED_TRACE(family.dir);
    absl::StatusOr<chat::ChatTemplate> tmpl = chat::ChatTemplate::FromDirectory((fixtures / family.dir).string());
    ASSERT_TRUE(tmpl.ok()) << tmpl.status();
    EXPECT_EQ(ToolCallFormatOfTemplate(tmpl->source()), family.tools);
    EXPECT_EQ(ReasoningFormatOfTemplate(tmpl->source()), family.reasoning);
    std::ifstream in(fixtures / family.dir / "cases.json");
    const Json cases = Json::parse(in);
    for (const Json& c : cases["cases"]) {
      if (c.contains("error")) continue;  // (a history the template refuses: chat_template_test's)
      Json messages = c["messages"];
      bool has_calls = false;
      for (Json& m : messages) {
        if (!m.contains("tool_calls")) continue;
        has_calls = true;
        for (Json& call : m["tool_calls"]) {
          Json& arguments = call["function"]["arguments"];
          if (arguments.is_object()) arguments = arguments.dump();  // as OpenAI sends them
        }
      }
      if (!has_calls) continue;
      Json body = {{"model", "m"}, {"messages", messages}, {"tools", c["tools"]},
                   {"add_generation_prompt", c["add_generation_prompt"]}, {"chat_template_kwargs", c["extra"]}};
      absl::StatusOr<Request> r = ParseRequest(kChat, body.dump());
      ASSERT_TRUE(r.ok()) << c["name"] << ": " << r.status();
      absl::StatusOr<std::string> prompt =
          tmpl->Render(r->messages, r->add_generation_prompt, r->tools, r->chat_template_kwargs);
      if (!prompt.ok()) {  // as the server does: the arguments' text, for templates that write it
        ASSERT_FALSE(r->messages_with_argument_text.is_null());
        prompt = tmpl->Render(r->messages_with_argument_text, r->add_generation_prompt, r->tools,
                              r->chat_template_kwargs);
      }
      ASSERT_TRUE(prompt.ok()) << c["name"] << ": " << prompt.status();
      EXPECT_EQ(*prompt, c["expected"].get<std::string>()) << c["name"];
      ++rendered;
    }
  }
  // qwen3 5, qwen2_5 2, hermes3 2, llama3_1 2, mistral_small_3_1 2, deepseek_v3_1 2, kimi_k2 2, mistral_nemo 1,
  // glm4_6 5
  EXPECT_GE(rendered, 23);
}

// documents (vLLM's field) reach the template as transformers' apply_chat_template(documents=...)
// passes them: Command R7B's retrieval prompt, byte for byte.
TEST(ChatTemplateFixturesTest, DocumentsRenderAsTransformersDoes) {
  const std::filesystem::path dir = std::filesystem::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/chat_templates";
  int rendered = 0;
  for (const char* family : {"command_r7b", "chatml"}) {
    absl::StatusOr<chat::ChatTemplate> tmpl = chat::ChatTemplate::FromDirectory((dir / family).string());
    ASSERT_TRUE(tmpl.ok()) << tmpl.status();
    std::ifstream in(dir / family / "cases.json");
    const Json cases = Json::parse(in);
    for (const Json& c : cases["cases"]) {
      if (!c["extra"].contains("documents")) continue;
      SCOPED_TRACE(absl::StrCat(family, " ", c["name"].get<std::string>()));
      const Json body = {{"model", "m"}, {"messages", c["messages"]}, {"tools", c["tools"]},
                         {"documents", c["extra"]["documents"]}};
      absl::StatusOr<Request> r = ParseRequest(kChat, body.dump());
      ASSERT_TRUE(r.ok()) << r.status();
      absl::StatusOr<std::string> prompt =
          tmpl->Render(r->messages, r->add_generation_prompt, r->tools, r->chat_template_kwargs);
      if (c.contains("error")) {
        EXPECT_FALSE(prompt.ok());
        continue;
      }
      ASSERT_TRUE(prompt.ok()) << prompt.status();
      EXPECT_EQ(*prompt, c["expected"].get<std::string>());
      ++rendered;
    }
  }
  EXPECT_EQ(rendered, 4);  // command_r7b's empty and with tools, chatml's two
  for (const auto& [body, param] : std::vector<std::pair<const char*, const char*>>{
           {R"({"model": "m", "messages": [{"role": "user"}], "documents": {"title": "x"}})", "documents"},
           {R"({"model": "m", "messages": [{"role": "user"}], "documents": [{"title": "x"}, "text"]})", "documents[1]"},
           {R"({"model": "m", "messages": [{"role": "user"}], "documents": [],
                "chat_template_kwargs": {"documents": []}})", "documents"}}) {
    absl::StatusOr<Request> r = ParseRequest(kChat, body);
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_EQ(ParamOf(r.status()), param) << r.status();
  }
}

TEST(ParseRequestTest, NullIsAbsent) {
  absl::StatusOr<Request> r =
      ParseRequest(kCompl, R"({"model": "m", "prompt": "x", "temperature": null, "stop": null, "n": null})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FLOAT_EQ(r->sampling.temperature(), 1.0f);
  EXPECT_EQ(r->sampling.stop_size(), 0);
  EXPECT_EQ(r->n, 1);
}

// 50,000 levels of arrays in chat_template_kwargs (a 100 KB body) overflowed the stack of the
// thread that turned them into template values, and killed the coordinator: refused at parsing.
TEST(ParseRequestTest, NestingPastTheBoundIsRefused) {
  const int depth = 50000;
  const std::string body = R"({"model": "m", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": )" +
                           std::string(depth, '[') + std::string(depth, ']') + "}}";
  absl::StatusOr<Request> r = ParseRequest(kChat, body);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "the body nests arrays and objects deeper than 128 levels");
  EXPECT_EQ(ErrorFromStatus(r.status()).http_status, 400);
}

TEST(RenameGenerationErrorTest, UsesTheOpenAIFieldNames) {
  struct Case {
    Endpoint endpoint;
    const char* field;  // the gRPC API's, as PrepareGeneration's error carries it
    const char* what;
    const char* param;
    const char* out;
  };
  for (const Case& c : {
           Case{kCompl, "sampling.temperature", "must be >= 0, got -1", "temperature",
                "temperature: must be >= 0, got -1"},
           Case{kCompl, "sampling.stop[2]", "must be 1 to 256 bytes", "stop[2]", "stop[2]: must be 1 to 256 bytes"},
           Case{kCompl, "sampling.top_logprobs", "must be in [0, 20], got 30", "logprobs",
                "logprobs: must be in [0, 20], got 30"},
           Case{kChat, "sampling.top_logprobs", "must be in [0, 20], got 30", "top_logprobs",
                "top_logprobs: must be in [0, 20], got 30"},
           Case{kCompl, "prompt.token_ids.ids[4]", "9999 is outside the vocabulary [0, 4096)", "prompt[4]",
                "prompt[4]: 9999 is outside the vocabulary [0, 4096)"},
           Case{kCompl, "prompt.text", "invalid UTF-8", "prompt", "prompt: invalid UTF-8"},
           Case{kChat, "sampling.logit_bias", "token id 9999 is outside the vocabulary [0, 4096)", "logit_bias",
                "logit_bias: token id 9999 is outside the vocabulary [0, 4096)"},
           Case{kCompl, "sampling.min_tokens", "must be in [0, max_tokens 8], got 9", "min_tokens",
                "min_tokens: must be in [0, max_tokens 8], got 9"},
           Case{kChat, "prompt", "its 600 tokens do not fit max_model_len 512", "messages",
                "messages: its 600 tokens do not fit max_model_len 512"},
           Case{kCompl, "prompt", "its 600 tokens do not fit max_model_len 512", "prompt",
                "prompt: its 600 tokens do not fit max_model_len 512"},
       }) {
    const absl::Status s = RenameGenerationError(FieldErrorStatus(c.field, c.what), c.endpoint);
    EXPECT_EQ(s.message(), c.out);
    EXPECT_EQ(ParamOf(s), c.param) << c.field;
  }
  // Other codes pass through, and so does an error that carries no field: its text is not read.
  const absl::Status unavailable = absl::UnavailableError("x: y");
  EXPECT_EQ(RenameGenerationError(unavailable, kCompl), unavailable);
  const absl::Status no_field = absl::InvalidArgumentError("sampling.temperature: must be >= 0, got -1");
  EXPECT_EQ(RenameGenerationError(no_field, kCompl), no_field);
  EXPECT_EQ(ParamOf(no_field), "");
}

TEST(ErrorTest, StatusesMapToHttpAndOpenAIShape) {
  EXPECT_EQ(ErrorFromStatus(absl::NotFoundError("model: no")).http_status, 404);
  EXPECT_EQ(ErrorFromStatus(absl::NotFoundError("model: no")).code, "model_not_found");
  EXPECT_EQ(ErrorFromStatus(absl::ResourceExhaustedError("full")).http_status, 429);
  EXPECT_EQ(ErrorFromStatus(absl::UnavailableError("lost")).http_status, 503);
  EXPECT_EQ(ErrorFromStatus(absl::InternalError("bug")).http_status, 500);
  EXPECT_EQ(ErrorFromStatus(absl::InternalError("bug")).type, "server_error");
  const Json body = Json::parse(ErrorBody(ErrorFromStatus(InvalidField("top_p", "must be in (0, 1]"))));
  EXPECT_EQ(body, Json::parse(R"({"error": {"message": "top_p: must be in (0, 1]", "type": "invalid_request_error",
                                            "param": "top_p", "code": null}})"));
}

TEST(ResponseJsonTest, UsageAndLogprobs) {
  EXPECT_EQ(UsageJson(5, 3, 2), Json::parse(R"({"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                                                "prompt_tokens_details": {"cached_tokens": 2}})"));
  EXPECT_STREQ(FinishReasonName(v1::FINISH_REASON_LENGTH), "length");
  EXPECT_STREQ(FinishReasonName(v1::FINISH_REASON_STOP_TOKEN), "stop");
  EXPECT_STREQ(FinishReasonName(v1::FINISH_REASON_STOP_STRING), "stop");

  std::vector<v1::TokenLogprobs> entries(2);
  entries[0].set_token_id(7);
  entries[0].set_logprob(-0.5f);
  v1::TopLogprob* top = entries[0].add_top_logprobs();
  top->set_token_id(7);
  top->set_logprob(-0.5f);
  entries[1].set_token_id(8);
  entries[1].set_logprob(-1.5f);
  // Without a tokenizer the token strings are empty; the numbers and the shape stay.
  const Json chat = ChatLogprobsContent(entries, nullptr);
  ASSERT_EQ(chat.size(), 2u);
  EXPECT_EQ(chat[0]["logprob"], -0.5);
  EXPECT_EQ(chat[0]["top_logprobs"].size(), 1u);
  EXPECT_EQ(chat[0]["bytes"], Json::array());
  const Json completion = CompletionLogprobs(entries, nullptr, 10);
  EXPECT_EQ(completion["token_logprobs"], Json::parse("[-0.5, -1.5]"));
  EXPECT_EQ(completion["text_offset"], Json::parse("[10, 10]"));
  EXPECT_EQ(completion["top_logprobs"][1], Json::object());
  // return_tokens_as_token_ids: the ids named, the bytes and offsets still the text's.
  const Json chat_ids = ChatLogprobsContent(entries, nullptr, /*token_ids=*/true);
  EXPECT_EQ(chat_ids[0]["token"], "token_id:7");
  EXPECT_EQ(chat_ids[0]["top_logprobs"][0]["token"], "token_id:7");
  EXPECT_EQ(chat_ids[0]["bytes"], Json::array());
  const Json completion_ids = CompletionLogprobs(entries, nullptr, 10, /*token_ids=*/true);
  EXPECT_EQ(completion_ids["tokens"], Json::parse(R"(["token_id:7", "token_id:8"])"));
  EXPECT_EQ(completion_ids["top_logprobs"][0], Json::parse(R"({"token_id:7": -0.5})"));
  EXPECT_EQ(completion_ids["text_offset"], Json::parse("[10, 10]"));
}

TEST(StructuredOutputTest, EveryFieldSetsTheConstraint) {
  struct Case {
    Endpoint endpoint;
    std::string extra;  // the fields added to a minimal body
    v1::StructuredOutput::KindCase kind;
    std::string text;   // json_schema / regex / grammar, or the choices joined by "|"
    std::string field;  // Request::constraint_field
  };
  const std::vector<Case> cases = {
      {kChat, R"("response_format": {"type": "json_object"})", v1::StructuredOutput::kJsonObject, "", "response_format"},
      {kChat, R"("response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "integer"}, "strict": true}})",
       v1::StructuredOutput::kJsonSchema, R"({"type":"integer"})", "response_format.json_schema.schema"},
      {kCompl, R"("response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string"}}})",
       v1::StructuredOutput::kJsonSchema, R"({"type":"string"})", "response_format.json_schema.schema"},
      {kCompl, R"("guided_json": {"type": "boolean"})", v1::StructuredOutput::kJsonSchema, R"({"type":"boolean"})", "guided_json"},
      {kCompl, R"("guided_json": "{\"type\": \"null\"}")", v1::StructuredOutput::kJsonSchema, R"({"type": "null"})", "guided_json"},
      {kChat, R"("guided_regex": "[a-z]+")", v1::StructuredOutput::kRegex, "[a-z]+", "guided_regex"},
      {kCompl, R"("guided_choice": ["yes", "no"])", v1::StructuredOutput::kChoices, "yes|no", "guided_choice"},
      {kCompl, R"("guided_grammar": "root ::= \"a\"")", v1::StructuredOutput::kGrammar, "root ::= \"a\"", "guided_grammar"},
      {kCompl, R"("structured_outputs": {"json": {"type": "integer"}})", v1::StructuredOutput::kJsonSchema,
       R"({"type":"integer"})", "structured_outputs.json"},
      {kCompl, R"("structured_outputs": {"regex": "\\d+"})", v1::StructuredOutput::kRegex, "\\d+", "structured_outputs.regex"},
      {kChat, R"("structured_outputs": {"choice": ["a"]})", v1::StructuredOutput::kChoices, "a", "structured_outputs.choice"},
      {kCompl, R"("structured_outputs": {"grammar": "root ::= [0-9]"})", v1::StructuredOutput::kGrammar, "root ::= [0-9]",
       "structured_outputs.grammar"},
      {kCompl, R"("structured_outputs": {"json_object": true})", v1::StructuredOutput::kJsonObject, "", "structured_outputs.json_object"},
      // No constraint: text format, and a response_format text beside a guided field is one constraint.
      {kChat, R"("response_format": {"type": "text"})", v1::StructuredOutput::KIND_NOT_SET, "", ""},
      {kChat, R"("response_format": {"type": "text"}, "guided_regex": "a")", v1::StructuredOutput::kRegex, "a", "guided_regex"},
  };
  for (const Case& c : cases) {
    const std::string body = c.endpoint == kChat
                                 ? absl::StrCat(R"({"model": "m", "messages": [{"role": "user", "content": "x"}], )", c.extra, "}")
                                 : absl::StrCat(R"({"model": "m", "prompt": "x", )", c.extra, "}");
    absl::StatusOr<Request> r = ParseRequest(c.endpoint, body);
    ASSERT_TRUE(r.ok()) << body << ": " << r.status();
    const v1::StructuredOutput& so = r->sampling.structured_output();
    EXPECT_EQ(so.kind_case(), c.kind) << body;
    EXPECT_EQ(r->constraint_field, c.field) << body;
    std::string text;
    switch (so.kind_case()) {
      case v1::StructuredOutput::kJsonSchema: text = so.json_schema(); break;
      case v1::StructuredOutput::kRegex: text = so.regex(); break;
      case v1::StructuredOutput::kGrammar: text = so.grammar(); break;
      case v1::StructuredOutput::kChoices: text = absl::StrJoin(so.choices().choices(), "|"); break;
      case v1::StructuredOutput::kJsonObject: EXPECT_TRUE(so.json_object()); break;
      default: break;
    }
    EXPECT_EQ(text, c.text) << body;
    // The constraint travels to the gRPC request of every choice.
    EXPECT_EQ(ToGenerateRequest(*r, 0, 1, 8, nullptr).sampling().structured_output().SerializeAsString(),
              so.SerializeAsString());
  }
}

TEST(StructuredOutputTest, CompileErrorsNameTheClientsField) {
  const absl::Status s = RenameGenerationError(
      FieldErrorStatus("sampling.structured_output.json_schema", "unsupported keyword 'if' at /properties/a"), kChat,
      "response_format.json_schema.schema");
  EXPECT_EQ(s.message(), "response_format.json_schema.schema: unsupported keyword 'if' at /properties/a");
  EXPECT_EQ(ParamOf(s), "response_format.json_schema.schema");
}

TEST(StructuredOutputTest, ToolChoiceRequiredAndNamedAreGrammars) {
  const std::string tools =
      R"("tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},)"
      R"( {"type": "function", "function": {"name": "now"}}])";
  absl::StatusOr<Request> named = ParseRequest(
      kChat, absl::StrCat(R"({"model": "m", "messages": [{"role": "user", "content": "x"}], )", tools,
                          R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})"));
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ(named->tool_choice, ToolChoice::kNamed);
  EXPECT_EQ(named->named_tool, "get_weather");
  EXPECT_EQ(named->constraint_field, "tool_choice");
  EXPECT_EQ(named->sampling.structured_output().json_schema(),
            R"({"type":"object","properties":{"city":{"type":"string"}},"required":["city"]})");

  absl::StatusOr<Request> required = ParseRequest(
      kChat, absl::StrCat(R"({"model": "m", "messages": [{"role": "user", "content": "x"}], )", tools,
                          R"(, "tool_choice": "required", "parallel_tool_calls": false})"));
  ASSERT_TRUE(required.ok()) << required.status();
  EXPECT_EQ(required->tool_choice, ToolChoice::kRequired);
  EXPECT_EQ(required->sampling.structured_output().json_schema(),
            R"({"type":"array","minItems":1,"items":{"anyOf":[)"
            R"({"type":"object","properties":{"name":{"const":"get_weather"},"parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}},"required":["name","parameters"]},)"
            R"({"type":"object","properties":{"name":{"const":"now"},"parameters":{"type":"object"}},"required":["name","parameters"]}]},"maxItems":1})");

  // The output, held until it ends, becomes the calls; an output cut short stays content.
  OutputSplitter named_split(ToolChoice::kNamed, "get_weather");
  EXPECT_TRUE(named_split.Add(R"({"city":)", false).calls.empty());
  OutputSplit whole = named_split.Add(R"("Paris"})", true);
  ASSERT_EQ(whole.calls.size(), 1u);
  EXPECT_EQ(whole.calls[0], (ToolCall{"get_weather", R"({"city":"Paris"})"}));
  EXPECT_EQ(whole.content, "");
  OutputSplitter required_split(ToolChoice::kRequired, "");
  whole = required_split.Add(R"([{"name":"now","parameters":{}},{"name":"get_weather","parameters":{"city":"Oslo"}}])", true);
  ASSERT_EQ(whole.calls.size(), 2u);
  EXPECT_EQ(whole.calls[0], (ToolCall{"now", "{}"}));
  EXPECT_EQ(whole.calls[1], (ToolCall{"get_weather", R"({"city":"Oslo"})"}));
  OutputSplitter cut(ToolChoice::kRequired, "");
  whole = cut.Add(R"([{"name":"now","para)", true);
  EXPECT_TRUE(whole.calls.empty());
  EXPECT_EQ(whole.content, R"([{"name":"now","para)");
  EXPECT_STREQ(ChatFinishReason(v1::FINISH_REASON_STOP_TOKEN, true), "tool_calls");
}

// Streamed forced calls: the pieces of each call, joined, are its name and the "parameters"
// value's text, however the output is split; the arguments come in several pieces while they are
// generated, not at the end.
struct StreamedCall {
  std::string name;
  std::string arguments;
  int pieces = 0;
  bool operator==(const StreamedCall& o) const { return name == o.name && arguments == o.arguments; }
};

std::vector<StreamedCall> Join(const std::vector<ToolCallPiece>& pieces) {
  std::vector<StreamedCall> calls;
  for (const ToolCallPiece& p : pieces) {
    if (!p.name.empty()) {
      EXPECT_EQ(p.index, static_cast<int>(calls.size()));
      calls.push_back(StreamedCall{p.name, "", 0});
    }
    EXPECT_EQ(p.index + 1, static_cast<int>(calls.size())) << "a piece of a call that has not begun";
    if (calls.empty()) continue;
    calls.back().arguments += p.arguments;
    if (!p.arguments.empty()) ++calls.back().pieces;
  }
  return calls;
}

TEST(ForcedCallStreamTest, PiecesJoinToTheCallsAtEverySplit) {
  struct Case {
    ToolChoice forced;
    std::string text;
    std::vector<StreamedCall> calls;
  };
  const std::vector<Case> cases = {
      {ToolChoice::kRequired,
       R"([{"name":"now","parameters":{}},{"name":"get_weather","parameters":{"city":"O\"s}lo","n":[1,{"a":"}"}]}}])",
       {{"now", "{}"}, {"get_weather", R"({"city":"O\"s}lo","n":[1,{"a":"}"}]})"}}},
      {ToolChoice::kRequired, "[ {\"name\": \"a\", \"parameters\": {\"x\": \"y\"} } ]", {{"a", R"({"x": "y"})"}}},
      // The name after the arguments: they wait for it.
      {ToolChoice::kRequired, R"([{"parameters":{"k":[1,2]},"name":"b"}])", {{"b", R"({"k":[1,2]})"}}},
      {ToolChoice::kRequired, R"([{"name":"c","parameters":5},{"name":"d","parameters":"s"}])", {{"c", "5"}, {"d", R"("s")"}}},
      {ToolChoice::kNamed, R"({"city":"Paris","days":[1,2]})", {{"get_weather", R"({"city":"Paris","days":[1,2]})"}}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    for (size_t split = 0; split <= c.text.size() + 1; ++split) {
      ForcedCallStream stream(c.forced, "get_weather");
      std::vector<ToolCallPiece> pieces;
      const auto add = [&](absl::string_view t) {
        for (ToolCallPiece& p : stream.Add(t)) pieces.push_back(std::move(p));
      };
      if (split <= c.text.size()) {
        add(absl::string_view(c.text).substr(0, split));
        add(absl::string_view(c.text).substr(split));
      } else {
        for (char ch : c.text) add(std::string(1, ch));
      }
      const std::vector<StreamedCall> calls = Join(pieces);
      ASSERT_EQ(calls, c.calls) << "split at " << split;
      EXPECT_EQ(stream.calls(), static_cast<int>(c.calls.size()));
      if (split > c.text.size()) {  // byte by byte: each call's arguments in as many pieces as bytes
        for (const StreamedCall& call : calls) {
          if (call.arguments.size() > 2 && call.name != "b") {
            EXPECT_GT(call.pieces, 2) << call.name;
          }
        }
      }
    }
  }
}

TEST(ForcedCallStreamTest, SplitterStreamsCallsAndKeepsAnEarlyCutAsContent) {
  OutputSplitter named(ToolChoice::kNamed, "get_weather", /*incremental=*/true);
  OutputSplit first = named.Add(R"({"city":)", false);
  ASSERT_EQ(first.pieces.size(), 1u);
  EXPECT_EQ(first.pieces[0], (ToolCallPiece{0, "get_weather", R"({"city":)"}));
  OutputSplit last = named.Add(R"("Paris"})", true);
  ASSERT_EQ(last.pieces.size(), 1u);
  EXPECT_EQ(last.pieces[0], (ToolCallPiece{0, "", R"("Paris"})"}));
  EXPECT_TRUE(last.calls.empty());
  EXPECT_EQ(last.content, "");
  // As deltas: the call's name (arguments ""), then its arguments; then more arguments.
  const std::vector<Json> deltas = ChatDeltas(first, 0, {"call_1"});
  ASSERT_EQ(deltas.size(), 2u);
  EXPECT_EQ(deltas[0].dump(),
            R"({"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"get_weather","arguments":""}}]})");
  EXPECT_EQ(deltas[1].dump(), R"({"tool_calls":[{"index":0,"function":{"arguments":"{\"city\":"}}]})");
  EXPECT_EQ(ChatDeltas(last, 0, {"call_1"}).at(0).dump(),
            R"({"tool_calls":[{"index":0,"function":{"arguments":"\"Paris\"}"}}]})");

  // Cut before a call's name: content, as when held whole; cut inside one: the call as it came.
  OutputSplitter early(ToolChoice::kRequired, "", true);
  EXPECT_TRUE(early.Add(R"([{"na)", false).pieces.empty());
  EXPECT_EQ(early.Add(R"(me":"no)", true).content, R"([{"name":"no)");
  OutputSplitter late(ToolChoice::kRequired, "", true);
  const OutputSplit cut = late.Add(R"([{"name":"now","parameters":{"a)", true);
  EXPECT_EQ(cut.content, "");
  ASSERT_EQ(cut.pieces.size(), 1u);
  EXPECT_EQ(cut.pieces[0], (ToolCallPiece{0, "now", R"({"a)"}));
}

// Whether `text` is a whole sentence of the JSON Schema `schema` (the grammar engine the server
// compiles constraints with, over a vocabulary of single ASCII characters).
bool SchemaAccepts(const std::string& schema, const std::string& text) {
  absl::StatusOr<grammar::Grammar> g = grammar::GrammarFromJsonSchema(schema);
  EXPECT_TRUE(g.ok()) << g.status();
  if (!g.ok()) return false;
  std::vector<std::string> tokens;
  for (int c = 32; c < 127; ++c) tokens.push_back(std::string(1, static_cast<char>(c)));
  tokens.push_back("");  // EOS
  const std::vector<bool> special(tokens.size(), false);
  auto vocab = std::make_shared<const grammar::TokenizerInfo>(
      tokens, special, std::vector<int32_t>{static_cast<int32_t>(tokens.size()) - 1}, static_cast<int32_t>(tokens.size()));
  auto compiled = grammar::CompiledGrammar::Compile(*g, vocab);
  EXPECT_TRUE(compiled.ok()) << compiled.status();
  if (!compiled.ok()) return false;
  grammar::GrammarMatcher m(*compiled);
  return m.AcceptBytes(text) && m.CanEnd();
}

// $ref inside a tool's parameters resolves under tool_choice "required" (the tools' definitions
// moved to the calls' schema's root, renamed per tool; a reference to a tool's own root too) and
// named (the tool's schema is the root).
TEST(ForcedToolConstraintTest, RefsInToolParametersResolve) {
  const std::string tools = R"("tools": [
    {"type": "function", "function": {"name": "send", "parameters": {"type": "object",
      "properties": {"to": {"$ref": "#/$defs/Address"}, "cc": {"type": "array", "items": {"$ref": "#/definitions/Cc"}}},
      "required": ["to"], "additionalProperties": false,
      "$defs": {"Address": {"type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"],
                            "additionalProperties": false},
                "City": {"enum": ["Oslo", "Rome"]}},
      "definitions": {"Address": {"type": "string"}, "Cc": {"$ref": "#/$defs/Address"}}}}},
    {"type": "function", "function": {"name": "tree", "parameters": {"type": "object",
      "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
                     "city": {"$ref": "#/$defs/City"}},
      "required": ["v"], "additionalProperties": false,
      "$defs": {"City": {"const": "Paris"}}}}}])";
  absl::StatusOr<Request> required = ParseRequest(
      kChat, absl::StrCat(R"({"model": "m", "messages": [{"role": "user", "content": "x"}], )", tools,
                          R"(, "tool_choice": "required"})"));
  ASSERT_TRUE(required.ok()) << required.status();
  const std::string schema = required->sampling.structured_output().json_schema();
  const Json j = Json::parse(schema);
  // Each tool's definitions under its own name: "City" of one is not "City" of the other, nor
  // "Address" of $defs that of definitions.
  EXPECT_EQ(j["$defs"]["send.$defs.City"], Json::parse(R"({"enum": ["Oslo", "Rome"]})"));
  EXPECT_EQ(j["$defs"]["tree.$defs.City"], Json::parse(R"({"const": "Paris"})"));
  EXPECT_EQ(j["$defs"]["send.definitions.Address"], Json::parse(R"({"type": "string"})"));
  EXPECT_EQ(j["$defs"]["send.definitions.Cc"], Json::parse(R"({"$ref": "#/$defs/send.$defs.Address"})"));
  EXPECT_EQ(j["items"]["anyOf"][1]["properties"]["parameters"], Json::parse(R"({"$ref": "#/$defs/tree"})"));
  EXPECT_TRUE(SchemaAccepts(schema, R"([{"name":"send","parameters":{"to":{"city":"Oslo"},"cc":[{"city":"Rome"}]}}])"));
  EXPECT_FALSE(SchemaAccepts(schema, R"([{"name":"send","parameters":{"to":{"city":"Paris"}}}])"));
  EXPECT_TRUE(SchemaAccepts(schema, R"([{"name":"tree","parameters":{"v":1,"kids":[{"v":2,"kids":[{"v":3}]}],"city":"Paris"}}])"));
  EXPECT_FALSE(SchemaAccepts(schema, R"([{"name":"tree","parameters":{"v":1,"city":"Oslo"}}])"));

  // Before: the same tool nested without moving its definitions names what the root lacks.
  Json nested = Json::parse(R"({"type": "array", "items": {"anyOf": [{"type": "object", "properties": {
    "parameters": {"type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}},
                   "$defs": {"Address": {"type": "string"}}}}}]}})");
  EXPECT_FALSE(grammar::GrammarFromJsonSchema(nested.dump()).ok());

  absl::StatusOr<Request> named = ParseRequest(
      kChat, absl::StrCat(R"({"model": "m", "messages": [{"role": "user", "content": "x"}], )", tools,
                          R"(, "tool_choice": {"type": "function", "function": {"name": "tree"}}})"));
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_TRUE(SchemaAccepts(named->sampling.structured_output().json_schema(), R"({"v":1,"kids":[{"v":2}],"city":"Paris"})"));
}


// ---- The Responses API ----------------------------------------------------------------------------

// Its body as a chat completion's: instructions first, a developer message a system one, content
// parts joined, consecutive function calls one assistant message's tool_calls, their outputs tool
// messages, earlier reasoning dropped; function tools and a named tool_choice in the chat shape;
// max_output_tokens and text.format renamed; what is not served refused naming the field.
TEST(ResponsesTest, ABodyBecomesAChatCompletionsBody) {
  const nlohmann::ordered_json body = nlohmann::ordered_json::parse(R"({
    "model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0.5, "store": true,
    "reasoning": {"effort": "high", "summary": "auto"},
    "input": [
      {"type": "message", "role": "developer", "content": "Use tools."},
      {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}]},
      {"type": "reasoning", "id": "rs_1", "summary": []},
      {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
      {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
      {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
      {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]}],
    "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": null}],
    "tool_choice": {"type": "function", "name": "get_weather"},
    "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": true}}})");
  absl::StatusOr<nlohmann::ordered_json> chat = ResponsesToChat(body);
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_EQ((*chat)["messages"], nlohmann::ordered_json::parse(R"([
    {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": null, "tool_calls": [
      {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
      {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "noon"}])"));
  EXPECT_EQ((*chat)["tools"], nlohmann::ordered_json::parse(
                                  R"([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}])"));
  EXPECT_EQ((*chat)["tool_choice"], nlohmann::ordered_json::parse(R"({"type": "function", "function": {"name": "get_weather"}})"));
  EXPECT_EQ((*chat)["max_tokens"], 9);
  EXPECT_EQ((*chat)["temperature"], 0.5);
  EXPECT_EQ((*chat)["response_format"]["json_schema"]["name"], "w");
  EXPECT_FALSE(chat->contains("store"));
  EXPECT_EQ((*chat)["reasoning_effort"], "high");
  EXPECT_FALSE(chat->contains("reasoning"));
  EXPECT_FALSE(chat->contains("input"));
  // And the chat body parses as a chat completion (but for its two constraints: one a request).
  nlohmann::ordered_json one = *chat;
  one.erase("response_format");
  absl::StatusOr<Request> request = ParseRequest(Endpoint::kChatCompletions, one.dump());
  ASSERT_TRUE(request.ok()) << request.status().message();
  EXPECT_EQ(request->tool_choice, ToolChoice::kNamed);

  for (const auto& [json, param] : std::vector<std::pair<std::string, std::string>>{
           {R"({"model": "m", "input": "x", "previous_response_id": "resp_1"})", "previous_response_id"},
           {R"({"model": "m"})", "input"},
           {R"({"input": "x"})", "model"},
           {R"({"model": "m", "input": 5})", "input"},
           {R"({"model": "m", "input": []})", "input"},
           {R"({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image"}]}]})", "input[0].content[0].type"},
           {R"({"model": "m", "input": [{"role": "critic", "content": "x"}]})", "input[0].role"},
           {R"({"model": "m", "input": [{"type": "function_call", "name": "f"}]})", "input[0].call_id"},
           {R"({"model": "m", "input": "x", "tools": [{"type": "file_search"}]})", "tools[0].type"},
           {R"({"model": "m", "input": "x", "text": {"format": {"type": "xml"}}})", "text.format.type"},
           {R"({"model": "m", "input": "x", "reasoning": "high"})", "reasoning"}}) {
    absl::StatusOr<nlohmann::ordered_json> refused = ResponsesToChat(nlohmann::ordered_json::parse(json));
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << json;
    EXPECT_EQ(ParamOf(refused.status()), param) << json << ": " << refused.status();
  }
  // A schema name that is no string is the chat parser's to refuse (it was read as a string here, and threw).
  absl::StatusOr<Json> named = ResponsesToChat(Json::parse(
      R"({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": 5, "schema": {}}}})"));
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ((*named)["response_format"]["json_schema"]["name"], 5);
  EXPECT_EQ(ParamOf(ParseRequest(Endpoint::kChatCompletions, named->dump()).status()).rfind("response_format", 0), 0u);
  // Input items with a role that is no string are stored as they are (NormalizedInputItems never throws).
  EXPECT_EQ(NormalizedInputItems(Json::parse(R"([{"role": 5, "content": "x"}])"), "resp_z")[0]["content"][0]["type"],
            "input_text");
  EXPECT_EQ(ResponsesParam("max_tokens"), "max_output_tokens");
  EXPECT_EQ(ResponsesParam("reasoning_effort"), "reasoning.effort");
  EXPECT_EQ(ResponsesParam("messages[2].content"), "input");
  EXPECT_EQ(ResponsesParam("tools[1].function.name"), "tools[1]");
  EXPECT_EQ(ResponsesParam("temperature"), "temperature");
}

// A chat answer as a Response: reasoning, the message and each call as output items in that
// order, a length finish incomplete, the usage renamed.
TEST(ResponsesTest, AChatAnswerBecomesAResponse) {
  const nlohmann::ordered_json chat = nlohmann::ordered_json::parse(R"({
    "id": "chatcmpl-abc", "object": "chat.completion", "created": 7, "model": "m",
    "choices": [{"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "Hi",
      "reasoning_content": "think", "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "f", "arguments": "{}"}}]}}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 4}}})");
  const nlohmann::ordered_json request = nlohmann::ordered_json::parse(R"({"model": "m", "input": "x", "max_output_tokens": 3})");
  const nlohmann::ordered_json r = ChatToResponse(chat, request);
  EXPECT_EQ(r["id"], "resp_abc");
  EXPECT_EQ(r["object"], "response");
  EXPECT_EQ(r["created_at"], 7);
  EXPECT_EQ(r["status"], "incomplete");
  EXPECT_EQ(r["incomplete_details"]["reason"], "max_output_tokens");
  EXPECT_EQ(r["max_output_tokens"], 3);
  ASSERT_EQ(r["output"].size(), 3u);
  EXPECT_EQ(r["output"][0]["type"], "reasoning");
  EXPECT_EQ(r["output"][0]["content"][0]["text"], "think");
  EXPECT_EQ(r["output"][1]["type"], "message");
  EXPECT_EQ(r["output"][1]["content"][0], nlohmann::ordered_json::parse(R"({"type": "output_text", "text": "Hi", "annotations": []})"));
  EXPECT_EQ(r["output"][2]["type"], "function_call");
  EXPECT_EQ(r["output"][2]["call_id"], "call_1");
  EXPECT_EQ(r["output"][2]["name"], "f");
  EXPECT_EQ(r["output"][2]["arguments"], "{}");
  EXPECT_EQ(r["usage"]["input_tokens"], 5);
  EXPECT_EQ(r["usage"]["output_tokens"], 3);
  EXPECT_EQ(r["usage"]["total_tokens"], 8);
  EXPECT_EQ(r["usage"]["input_tokens_details"]["cached_tokens"], 4);
  EXPECT_EQ(r["reasoning"], Json::parse(R"({"effort": null, "summary": null})"));
  EXPECT_EQ(r["store"], false);
  const Json low = ChatToResponse(chat, Json::parse(R"({"reasoning": {"effort": "low"}, "store": true})"));
  EXPECT_EQ(low["reasoning"]["effort"], "low");
  EXPECT_EQ(low["store"], true);
}


// A chat stream's chunks as Responses events: created and in_progress, then per item (reasoning,
// message, call) its added, delta and done events, closed as the next begins, then completed with
// the whole Response, whose items have the streamed ids; an error ends the stream as an error event.
TEST(ResponsesTest, AChatStreamBecomesResponsesEvents) {
  ResponsesView events(nlohmann::ordered_json::parse(R"({"model": "m", "input": "x", "stream": true})"));
  std::string out;
  for (const char* chunk : {
           R"({"id": "chatcmpl-s", "created": 3, "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})",
           R"({"id": "chatcmpl-s", "choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]})",
           R"({"id": "chatcmpl-s", "choices": [{"index": 0, "delta": {"content": "He"}}]})",
           R"({"id": "chatcmpl-s", "choices": [{"index": 0, "delta": {"content": "llo"}}]})",
           R"({"id": "chatcmpl-s", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_9",
               "type": "function", "function": {"name": "f", "arguments": ""}}]}}]})",
           R"({"id": "chatcmpl-s", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\""}}]}}]})",
           R"({"id": "chatcmpl-s", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, "finish_reason": "tool_calls"}]})",
           R"({"id": "chatcmpl-s", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}})"}) {
    out += events.Chunk(nlohmann::ordered_json::parse(chunk));
  }
  out += events.End();
  std::vector<nlohmann::ordered_json> parsed;
  std::vector<std::string> types;
  for (absl::string_view block : absl::StrSplit(out, "\n\n", absl::SkipEmpty())) {
    const std::vector<std::string> lines = absl::StrSplit(block, '\n');
    ASSERT_EQ(lines.size(), 2u) << block;
    parsed.push_back(nlohmann::ordered_json::parse(lines[1].substr(6)));
    EXPECT_EQ(lines[0], "event: " + parsed.back()["type"].get<std::string>());
    EXPECT_EQ(parsed.back()["sequence_number"], parsed.size() - 1);
    types.push_back(parsed.back()["type"]);
  }
  EXPECT_EQ(types, (std::vector<std::string>{
                       "response.created", "response.in_progress",
                       "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.done",
                       "response.output_item.done",
                       "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                       "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                       "response.output_item.done",
                       "response.output_item.added", "response.function_call_arguments.delta",
                       "response.function_call_arguments.delta", "response.function_call_arguments.done",
                       "response.output_item.done", "response.completed"}));
  const nlohmann::ordered_json& whole = parsed.back()["response"];
  EXPECT_EQ(whole["id"], "resp_s");
  EXPECT_EQ(whole["status"], "completed");
  ASSERT_EQ(whole["output"].size(), 3u);
  EXPECT_EQ(whole["output"][0]["id"], parsed[2]["item"]["id"]);
  EXPECT_EQ(whole["output"][1]["content"][0]["text"], "Hello");
  EXPECT_EQ(whole["output"][1]["id"], parsed[6]["item"]["id"]);
  EXPECT_EQ(whole["output"][2]["arguments"], "{\"a\": 1}");
  EXPECT_EQ(whole["output"][2]["call_id"], "call_9");
  EXPECT_EQ(whole["output"][2]["id"], parsed[13]["item"]["id"]);
  EXPECT_EQ(whole["usage"]["output_tokens"], 6);
  EXPECT_EQ(parsed[0]["response"]["status"], "in_progress");

  ResponsesView failing(nlohmann::ordered_json::parse(R"({"model": "m", "input": "x"})"));
  const nlohmann::ordered_json error = nlohmann::ordered_json::parse(R"({"error": {"message": "boom", "code": null, "param": null}})");
  const std::string ended = failing.End(&error);
  EXPECT_TRUE(absl::StartsWith(ended, "event: error\ndata: ")) << ended;
  EXPECT_NE(ended.find("boom"), std::string::npos) << ended;
}

// previous_response_id: the stored conversation is read after the instructions and before the
// input (an earlier answer's message and its calls one assistant message); without one, refused.
TEST(ResponsesTest, AStoredConversationIsReadBeforeTheInput) {
  const Json earlier = Json::parse(R"([
    {"id": "msg_a_in0", "type": "message", "role": "user", "status": "completed",
     "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
    {"id": "rs_a", "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
    {"id": "msg_a", "type": "message", "role": "assistant", "status": "completed",
     "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
    {"id": "fc_a_0", "type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}",
     "status": "completed"}])");
  const Json body = Json::parse(R"({"model": "m", "instructions": "Be brief.", "previous_response_id": "resp_a",
    "input": [{"type": "function_call_output", "call_id": "c1", "output": "Sunny"}]})");
  absl::StatusOr<Json> chat = ResponsesToChat(body, &earlier);
  ASSERT_TRUE(chat.ok()) << chat.status();
  EXPECT_EQ((*chat)["messages"], Json::parse(R"([
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [
      {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}])"));
  EXPECT_FALSE(chat->contains("previous_response_id"));
  absl::StatusOr<Json> refused = ResponsesToChat(body);
  EXPECT_EQ(ParamOf(refused.status()), "previous_response_id") << refused.status();
  // A bad item of the conversation is named as previous_response_id's, the input's as input's.
  const Json bad = Json::parse(R"([{"type": "web_search_call"}])");
  EXPECT_EQ(ParamOf(ResponsesToChat(body, &bad).status()), "previous_response_id[0].type");
  const Json empty = Json::array();
  EXPECT_TRUE(ResponsesToChat(body, &empty).ok());
}

// The input as stored: a string a user message, string contents as parts, and every item an id.
TEST(ResponsesTest, InputItemsAreNormalizedForTheStore) {
  EXPECT_EQ(NormalizedInputItems(Json("Hi"), "resp_x"), Json::parse(R"([{"id": "msg_x_in0", "type": "message",
    "role": "user", "status": "completed", "content": [{"type": "input_text", "text": "Hi"}]}])"));
  const Json items = NormalizedInputItems(Json::parse(R"([
    {"role": "developer", "content": "Be brief."},
    {"role": "assistant", "content": "Sure."},
    {"type": "function_call", "id": "fc_mine", "call_id": "c1", "name": "f", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "ok"}])"), "resp_x");
  EXPECT_EQ(items, Json::parse(R"([
    {"id": "msg_x_in0", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}],
     "type": "message"},
    {"id": "msg_x_in1", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}],
     "type": "message"},
    {"type": "function_call", "id": "fc_mine", "call_id": "c1", "name": "f", "arguments": "{}"},
    {"id": "fco_x_in3", "type": "function_call_output", "call_id": "c1", "output": "ok"}])"));
  // Read back, they make the same chat messages as the input did.
  const Json input = Json::parse(R"([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])");
  absl::StatusOr<Json> direct = ResponsesToChat(Json{{"model", "m"}, {"input", input}});
  absl::StatusOr<Json> stored = ResponsesToChat(Json{{"model", "m"}, {"input", NormalizedInputItems(input, "resp_y")}});
  ASSERT_TRUE(direct.ok() && stored.ok());
  EXPECT_EQ((*direct)["messages"], (*stored)["messages"]);
}

// truncation "auto": the oldest turn (after the system messages, up to the next user message) goes,
// from both forms of the list, until one turn is left; null fields of a request take their defaults.
TEST(ResponsesTest, TruncationDropsTheOldestTurns) {
  Json messages = Json::parse(R"([{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
    {"role": "assistant", "content": null, "tool_calls": []}, {"role": "tool", "content": "t"},
    {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"}])");
  Json twin = messages;
  Json contents = Json::array();
  ASSERT_TRUE(DropOldestTurn(&messages, &twin));
  EXPECT_EQ(messages, twin);
  for (const Json& m : messages) contents.push_back(m["content"]);
  EXPECT_EQ(contents, Json::parse(R"(["s", "c", "d", "e"])"));
  ASSERT_TRUE(DropOldestTurn(&messages, nullptr));
  EXPECT_EQ(messages.size(), 2u);
  EXPECT_EQ(messages[1]["content"], "e");
  EXPECT_FALSE(DropOldestTurn(&messages, nullptr));
  EXPECT_EQ(messages.size(), 2u);
  Json from_assistant = Json::parse(R"([{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}])");
  ASSERT_TRUE(DropOldestTurn(&from_assistant, nullptr));
  EXPECT_EQ(from_assistant, Json::parse(R"([{"role": "user", "content": "y"}])"));

  EXPECT_EQ(ParamOf(ResponsesToChat(Json::parse(R"({"model": "m", "input": "x", "truncation": "middle"})")).status()),
            "truncation");
  EXPECT_TRUE(ResponsesToChat(Json::parse(R"({"model": "m", "input": "x", "truncation": "auto"})")).ok());
  EXPECT_TRUE(ResponsesView(Json::parse(R"({"truncation": "auto"})")).truncates());
  EXPECT_FALSE(ResponsesView(Json::parse(R"({"truncation": null})")).truncates());
  const Json chat = Json::parse(R"({"id": "chatcmpl-n", "created": 1, "model": "m", "usage": {},
    "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Hi"}}]})");
  const Json r = ChatToResponse(chat, Json::parse(R"({"parallel_tool_calls": null, "temperature": null,
    "tools": null, "truncation": null, "store": null, "reasoning": {"effort": null}, "metadata": null})"));
  EXPECT_EQ(r["parallel_tool_calls"], true);
  EXPECT_EQ(r["temperature"], 1.0);
  EXPECT_EQ(r["tools"], Json::array());
  EXPECT_EQ(r["truncation"], "disabled");
  EXPECT_EQ(r["store"], false);
  EXPECT_EQ(r["metadata"], Json::object());
}

// Log-probabilities: include's "message.output_text.logprobs" or top_logprobs > 0 ask the chat API
// for them, and the message's output_text part has them, whole and streamed.
TEST(ResponsesTest, LogprobsReachTheOutputText) {
  auto chat_of = [](const char* body) { return ResponsesToChat(Json::parse(body)); };
  absl::StatusOr<Json> included =
      chat_of(R"({"model": "m", "input": "x", "include": ["message.output_text.logprobs"]})");
  ASSERT_TRUE(included.ok()) << included.status();
  EXPECT_EQ((*included)["logprobs"], true);
  EXPECT_FALSE(included->contains("top_logprobs"));
  absl::StatusOr<Json> top = chat_of(R"({"model": "m", "input": "x", "top_logprobs": 3})");
  ASSERT_TRUE(top.ok()) << top.status();
  EXPECT_EQ((*top)["top_logprobs"], 3);
  EXPECT_EQ((*top)["logprobs"], true);
  absl::StatusOr<Json> none = chat_of(R"({"model": "m", "input": "x", "top_logprobs": 0, "include": ["x.y"]})");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->contains("logprobs"));
  EXPECT_EQ(ParamOf(chat_of(R"({"model": "m", "input": "x", "include": "all"})").status()), "include");
  EXPECT_EQ(ParamOf(chat_of(R"({"model": "m", "input": "x", "top_logprobs": "2"})").status()), "top_logprobs");

  const Json tokens = Json::parse(R"([{"token": "H", "logprob": -0.5, "bytes": [72], "top_logprobs": []},
                                      {"token": "i", "logprob": -1.5, "bytes": [105], "top_logprobs": []}])");
  Json chat = Json::parse(R"({"id": "chatcmpl-l", "created": 1, "model": "m", "usage": {},
    "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Hi"}}]})");
  chat["choices"][0]["logprobs"] = {{"content", tokens}};
  const Json request = Json::parse(R"({"model": "m", "input": "x", "include": ["message.output_text.logprobs"]})");
  EXPECT_EQ(ChatToResponse(chat, request)["output"][0]["content"][0]["logprobs"], tokens);

  ResponsesView view(request);
  std::string events;
  for (int i = 0; i < 2; ++i) {
    Json chunk = {{"id", "chatcmpl-l"}, {"created", 1}, {"model", "m"},
                  {"choices", Json::array({{{"index", 0},
                                            {"delta", {{"content", tokens[i]["token"]}}},
                                            {"logprobs", {{"content", Json::array({tokens[i]})}}}}})}};
    events += view.Chunk(chunk);
  }
  events += view.End();
  Json completed;
  int deltas_with_logprobs = 0;
  for (absl::string_view block : absl::StrSplit(events, "\n\n", absl::SkipEmpty())) {
    const Json event = Json::parse(block.substr(block.find("data: ") + 6));
    if (event["type"] == "response.output_text.delta" && event["logprobs"].size() == 1) ++deltas_with_logprobs;
    if (event["type"] == "response.completed") completed = event["response"];
  }
  EXPECT_EQ(deltas_with_logprobs, 2);
  EXPECT_EQ(completed["output"][0]["content"][0]["logprobs"], tokens);
}

StoredResponse Stored(const std::string& id, const std::string& owner, const std::string& previous,
                      const std::string& text) {
  return StoredResponse{
      owner, previous, NormalizedInputItems(Json(text), id),
      Json{{"id", id},
           {"object", "response"},
           {"output", Json::array({{{"id", "msg_" + id},
                                    {"type", "message"},
                                    {"role", "assistant"},
                                    {"content", Json::array({{{"type", "output_text"}, {"text", text + "!"}}})}}})}}};
}

std::vector<std::string> Texts(const Json& items) {
  std::vector<std::string> texts;
  for (const Json& item : items) texts.push_back(item["content"][0]["text"]);
  return texts;
}

// The store: a chain read oldest first, owners apart, deletes, and the least recently used dropped
// beyond the budget (a continued conversation counts as used, all of it).
TEST(ResponsesStoreTest, ChainsOwnersAndTheBudget) {
  ResponsesStore store(1 << 20);
  ASSERT_TRUE(store.Put(Stored("resp_1", "k", "", "a")));
  ASSERT_TRUE(store.Put(Stored("resp_2", "k", "resp_1", "b")));
  absl::StatusOr<Json> conversation = store.Conversation("resp_2", "k");
  ASSERT_TRUE(conversation.ok()) << conversation.status();
  EXPECT_EQ(Texts(*conversation), (std::vector<std::string>{"a", "a!", "b", "b!"}));
  // Another owner sees nothing, and cannot take the id.
  EXPECT_EQ(store.Conversation("resp_2", "other").status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(store.Get("resp_1", "other").has_value());
  EXPECT_FALSE(store.Delete("resp_1", "other"));
  EXPECT_TRUE(store.Taken("resp_1", "other"));
  EXPECT_FALSE(store.Taken("resp_1", "k"));
  EXPECT_FALSE(store.Put(Stored("resp_1", "other", "", "z")));
  // The same owner replaces its own.
  ASSERT_TRUE(store.Put(Stored("resp_1", "k", "", "c")));
  EXPECT_EQ(Texts(*store.Conversation("resp_2", "k")), (std::vector<std::string>{"c", "c!", "b", "b!"}));
  EXPECT_EQ((*store.InputItems("resp_2", "k"))[0]["id"], "msg_2_in0");
  // Ids in a conversation: storing under one of them would make it loop.
  EXPECT_TRUE(store.InChain("resp_1", "resp_2", "k"));
  EXPECT_TRUE(store.InChain("resp_2", "resp_2", "k"));
  EXPECT_FALSE(store.InChain("resp_3", "resp_2", "k"));
  EXPECT_FALSE(store.InChain("resp_1", "resp_2", "other"));
  // A deleted response breaks the chains through it, naming it.
  EXPECT_TRUE(store.Delete("resp_1", "k"));
  EXPECT_FALSE(store.Get("resp_1", "k").has_value());
  absl::Status broken = store.Conversation("resp_2", "k").status();
  EXPECT_EQ(broken.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(broken.message(), "'resp_1'")) << broken;
  EXPECT_EQ(store.size(), 1u);

  // The budget: room for three such entries; continuing resp_a (and so using it) keeps it over resp_b.
  ResponsesStore probe(1 << 20);
  ASSERT_TRUE(probe.Put(Stored("resp_a", "", "", "x")));
  const int64_t entry = probe.bytes();
  ResponsesStore small(3 * entry + entry / 2);
  ASSERT_TRUE(small.Put(Stored("resp_a", "", "", "x")));
  ASSERT_TRUE(small.Put(Stored("resp_b", "", "", "y")));
  ASSERT_TRUE(small.Conversation("resp_a", "").ok());
  ASSERT_TRUE(small.Put(Stored("resp_c", "", "", "z")));
  ASSERT_TRUE(small.Put(Stored("resp_d", "", "", "w")));
  EXPECT_FALSE(small.Get("resp_b", "").has_value());
  EXPECT_TRUE(small.Get("resp_a", "").has_value());
  EXPECT_EQ(small.size(), 3u);
  EXPECT_LE(small.bytes(), small.max_bytes());
  // An entry over the whole budget is not stored; a store of 0 bytes stores nothing.
  EXPECT_FALSE(small.Put(Stored("resp_e", "", "", std::string(4 * entry, 'x'))));
  EXPECT_EQ(small.size(), 3u);
  EXPECT_FALSE(ResponsesStore(0).Put(Stored("resp_f", "", "", "x")));
}

}  // namespace
}  // namespace shardserve::openai
