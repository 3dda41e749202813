// coordinator/chat: every fixture case of tests/fixtures/chat_templates/<family>/ (rendered by
// transformers' apply_chat_template, tools/fixtures/make_chat_template_fixtures.py) rendered by ChatTemplate and
// compared byte for byte, plus unit tests of the lexer, parser, runtime and their errors.
#include <atomic>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "coordinator/chat/chat_template.h"
#include "coordinator/chat/lexer.h"
#include "coordinator/chat/parser.h"
#include "coordinator/chat/budget.h"
#include "coordinator/chat/render.h"
#include "coordinator/chat/value.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace shardserve::chat {
namespace {

using json = nlohmann::ordered_json;

const std::filesystem::path kFixtures = std::filesystem::path(SHARDSERVE_SOURCE_DIR) / "tests/fixtures/chat_templates";

std::string ReadText(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// --- golden cases against transformers ---

// The date formats the fixtures' templates give strftime_now (gpt-oss's, Llama 3.2's).
constexpr const char* kDateFormats[] = {"%Y-%m-%d", "%d %b %Y"};

std::string Format(const std::tm& day, const char* format) {
  char buf[64];
  return std::string(buf, std::strftime(buf, sizeof(buf), format, &day));
}

// Today, as strftime_now reads the clock.
std::tm Today() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  return local;
}

// Renders case `c` of a fixture and its expected text. The fixtures were rendered on the day
// cases.json names ("today": transformers' clock pinned to it), and a template that writes the
// date (gpt-oss's system message, Llama 3.2's) writes today's here: the expected text has today's
// date in place of that day's, in each format of kDateFormats. (A render that runs across
// midnight is rendered again.)
struct Rendered {
  absl::StatusOr<std::string> out;
  std::string expected;
};
Rendered RenderCase(const ChatTemplate& tmpl, const json& cases, const json& c, const RenderBudget& budget = {}) {
  for (;;) {
    const std::tm before = Today();
    Rendered r{c.value("continue_final_message", false)
                   ? tmpl.RenderContinuing(c["messages"], c["tools"], c["extra"], budget)
                   : tmpl.Render(c["messages"], c["add_generation_prompt"].get<bool>(), c["tools"], c["extra"], budget),
               ""};
    if (Format(Today(), "%F") != Format(before, "%F")) continue;
    if (c.contains("expected")) {
      r.expected = c["expected"].get<std::string>();
      if (cases.contains("today")) {
        std::tm pinned{};
        EXPECT_NE(strptime(cases["today"].get<std::string>().c_str(), "%Y-%m-%d", &pinned), nullptr) << cases["today"];
        for (const char* format : kDateFormats) {
          r.expected = absl::StrReplaceAll(r.expected, {{Format(pinned, format), Format(before, format)}});
        }
      }
    }
    return r;
  }
}

class FixtureTest : public testing::TestWithParam<std::string> {};

TEST_P(FixtureTest, MatchesTransformers) {
  const std::filesystem::path dir = kFixtures / GetParam();
  absl::StatusOr<ChatTemplate> tmpl = ChatTemplate::FromDirectory(dir.string());
  ASSERT_TRUE(tmpl.ok()) << tmpl.status();
  const json cases = json::parse(ReadText(dir / "cases.json"));
  ASSERT_FALSE(cases["cases"].empty());
  int checked = 0;
  for (const json& c : cases["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    const Rendered r = RenderCase(*tmpl, cases, c);
    const absl::StatusOr<std::string>& out = r.out;
    if (c.contains("error")) {
      ASSERT_FALSE(out.ok()) << "expected the template to raise: " << c["error"];
      EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
      const std::string expected = c["error"].get<std::string>();
      EXPECT_EQ(std::string(out.status().message()).substr(0, expected.size()), expected) << out.status();
    } else {
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_EQ(*out, r.expected);
    }
    ++checked;
  }
  EXPECT_EQ(checked, static_cast<int>(cases["cases"].size()));
}

// Each family's template asked to continue a conversation's final message (continue_final_message),
// against transformers 5 (tests/fixtures/chat_template_continuations.json).
TEST(ContinuationTest, MatchesTransformers) {
  const json fixture = json::parse(ReadText(kFixtures.parent_path() / "chat_template_continuations.json"));
  int checked = 0;
  for (const auto& [family, cases] : fixture["families"].items()) {
    absl::StatusOr<ChatTemplate> tmpl = ChatTemplate::FromDirectory((kFixtures / family).string());
    ASSERT_TRUE(tmpl.ok()) << family << ": " << tmpl.status();
    for (const json& c : cases) {
      SCOPED_TRACE(absl::StrCat(family, " ", c["name"].get<std::string>()));
      ASSERT_TRUE(c["continue_final_message"].get<bool>());
      const Rendered r = RenderCase(*tmpl, fixture, c);
      if (c.contains("error")) {
        ASSERT_FALSE(r.out.ok()) << "expected transformers' error: " << c["error"];
        continue;
      }
      ASSERT_TRUE(r.out.ok()) << r.out.status();
      EXPECT_EQ(*r.out, r.expected);
      ++checked;
    }
  }
  EXPECT_GE(checked, 100);
}

std::vector<std::string> Families() {
  std::vector<std::string> out;
  for (const auto& entry : std::filesystem::directory_iterator(kFixtures)) {
    if (entry.is_directory()) out.push_back(entry.path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

INSTANTIATE_TEST_SUITE_P(Families, FixtureTest, testing::ValuesIn(Families()),
                         [](const testing::TestParamInfo<std::string>& info) { return info.param; });

TEST(FixtureTest, EveryFamilyIsPresent) {
  // The families tools/fixtures/make_chat_template_fixtures.py writes; a missing one is a failure, not a skip.
  for (const char* f : {"chatml", "llama2", "llama3", "llama3_1", "qwen2_5", "mistral", "gemma2", "phi3_5",
                        "deepseek_r1_distill", "hermes3", "mistral_small_3_1", "command_r7b", "qwen3", "gemma3",
                        "phi4", "phi4_mini", "gpt_oss", "qwen3_original", "deepseek_v3_1", "kimi_k2", "llama3_2",
                        "mistral_nemo", "glm4_6"}) {
    EXPECT_TRUE(std::filesystem::exists(kFixtures / f / "cases.json")) << f;
  }
}

// Small templates, one feature each, rendered by the jinja2 environment transformers compiles chat
// templates with (tests/fixtures/chat_template_snippets.json).
TEST(SnippetTest, MatchesTransformersJinja) {
  const json snippets = json::parse(ReadText(kFixtures.parent_path() / "chat_template_snippets.json"));
  ASSERT_GE(snippets["snippets"].size(), 60u);
  for (const json& s : snippets["snippets"]) {
    const std::string source = s["template"].get<std::string>();
    SCOPED_TRACE(source);
    absl::StatusOr<ChatTemplate> t = ChatTemplate::FromString(source);
    ASSERT_TRUE(t.ok()) << t.status();
    const json& vars = s["vars"];
    const json messages = vars.contains("messages") ? vars["messages"] : json::array();
    absl::StatusOr<std::string> out = t->Render(messages, false, nullptr, vars);
    if (s.contains("error")) {
      ASSERT_FALSE(out.ok()) << "expected an error: " << s["error"];
      EXPECT_NE(out.status().message().find(s["error"].get<std::string>()), std::string::npos) << out.status();
    } else {
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_EQ(*out, s["expected"].get<std::string>());
    }
  }
}

// --- helpers for unit tests ---

std::string R(const std::string& source, const json& vars = json::object()) {
  absl::StatusOr<ChatTemplate> t = ChatTemplate::FromString(source);
  if (!t.ok()) return "PARSE ERROR: " + std::string(t.status().message());
  absl::StatusOr<std::string> out = t->Render(json::array(), false, nullptr, vars);
  if (!out.ok()) return "ERROR: " + std::string(out.status().message());
  return *out;
}

// --- lexer ---

TEST(ChatLexerTest, TokensCarryLineAndColumn) {
  absl::StatusOr<std::vector<Token>> tokens = Lex("ab\n  {{ x + 1 }}");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  ASSERT_GE(tokens->size(), 6u);
  EXPECT_EQ((*tokens)[0].kind, TokenKind::kText);
  EXPECT_EQ((*tokens)[1].kind, TokenKind::kVarBegin);
  EXPECT_EQ((*tokens)[1].where.line, 2);
  EXPECT_EQ((*tokens)[1].where.column, 3);
  EXPECT_EQ((*tokens)[2].text, "x");
  EXPECT_EQ((*tokens)[2].where.column, 6);
  EXPECT_EQ((*tokens)[4].kind, TokenKind::kInt);
  EXPECT_EQ((*tokens)[4].int_value, 1);
}

TEST(ChatLexerTest, StringEscapes) {
  EXPECT_EQ(R("{{ 'a\\nb\\t\\'q\\' \\u00e9 \\x41' }}"), "a\nb\t'q' \xc3\xa9 A");
  EXPECT_EQ(R("{{ \"it's\" ~ 'x' 'y' }}"), "it'sxy");
  EXPECT_EQ(R("{{ '%}' }}{{ '}}' }}"), "%}}}");
}

TEST(ChatLexerTest, WhitespaceControlAsTransformers) {
  // trim_blocks: the newline after a block tag goes; lstrip_blocks: indentation before one goes.
  EXPECT_EQ(R("{% if true %}\n  yes\n  {% endif %}\nend"), "  yes\nend");
  // `-` strips all whitespace on its side, newlines included.
  EXPECT_EQ(R("a  \n {{- 'b' -}} \n c"), "abc");
  // Variable tags are not trimmed by trim_blocks.
  EXPECT_EQ(R("{{ 'a' }}\nb"), "a\nb");
  // `+` turns lstrip_blocks off for one tag.
  EXPECT_EQ(R("  {%+ if true %}x{% endif %}"), "  x");
  // One trailing newline of the template is dropped (keep_trailing_newline=False).
  EXPECT_EQ(R("x\n"), "x");
  EXPECT_EQ(R("x\n\n"), "x\n");
  // Comments vanish and trim like blocks.
  EXPECT_EQ(R("a{# note #}\nb"), "ab");
  EXPECT_EQ(R("{% raw %}{{ not }}{% endraw %}"), "{{ not }}");
}

TEST(ChatLexerTest, Errors) {
  absl::StatusOr<std::vector<Token>> t = Lex("ok\n{{ 'open");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message(), "chat template line 2, column 4: unterminated string literal");
  t = Lex("{{ a ? b }}");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("line 1, column 6"), std::string::npos) << t.status();
}

// --- parser ---

TEST(ChatParserTest, PrecedenceFollowsJinja) {
  EXPECT_EQ(R("{{ 1 + 2 * 3 }}"), "7");
  EXPECT_EQ(R("{{ 2 ** 3 ** 2 }}"), "64");  // jinja2's ** is left-associative
  EXPECT_EQ(R("{{ 'a' ~ 1 * 2 }}"), "a2");
  EXPECT_EQ(R("{{ 'a' ~ 1 + 2 }}").substr(0, 6), "ERROR:");  // ~ binds tighter than +: ('a' ~ 1) + 2
  EXPECT_EQ(R("{{ not 1 == 2 }}"), "True");
  EXPECT_EQ(R("{{ ' x ' | trim + 'y' }}"), "xy");
  EXPECT_EQ(R("{{ -3 | abs }}"), "3");
  EXPECT_EQ(R("{{ 'b' if false else 'c' }}"), "c");
  EXPECT_EQ(R("{{ [1, 2, 3] | length == 3 }}"), "True");
}

TEST(ChatParserTest, SyntaxErrorsCarryLineAndColumn) {
  absl::StatusOr<std::shared_ptr<const Template>> t = Parse("line one\n{% if x %}\nno end");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("chat template line 3"), std::string::npos) << t.status();
  EXPECT_NE(t.status().message().find("endif"), std::string::npos) << t.status();
  t = Parse("{{ a + }}");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message(), "chat template line 1, column 8: unexpected '}}'");
  t = Parse("\n\n  {% frobnicate %}");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message(), "chat template line 3, column 6: unknown or unsupported tag 'frobnicate'");
  t = Parse("{% for x in y %}{% endif %}");
  ASSERT_FALSE(t.ok());
}

// --- runtime ---

TEST(ChatRuntimeTest, LoopsAndLoopVariables) {
  EXPECT_EQ(R("{% for x in [1,2,3] %}{{ loop.index }}{{ loop.index0 }}{{ loop.first }}{{ loop.last }};{% endfor %}"),
            "10TrueFalse;21FalseFalse;32FalseTrue;");
  EXPECT_EQ(R("{% for x in [1,2,3,4] if x is even %}{{ x }}/{{ loop.length }} {% endfor %}"), "2/2 4/2 ");
  EXPECT_EQ(R("{% for x in [] %}a{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(R("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }},{% endfor %}"), "a=1,b=2,");
  EXPECT_EQ(R("{% for x in [1,2,3] %}{% if x == 2 %}{% continue %}{% endif %}{{ x }}{% endfor %}"), "13");
  EXPECT_EQ(R("{% for x in [1,2,3] %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% endfor %}"), "1");
  EXPECT_EQ(R("{% for x in 'ab' %}{{ loop.previtem is defined }}{{ loop.nextitem }}{% endfor %}"), "FalsebTrue");
}

TEST(ChatRuntimeTest, ScopingAndNamespaces) {
  // A set inside a loop does not leak; a namespace carries state out.
  EXPECT_EQ(R("{% set x = 1 %}{% for i in [1] %}{% set x = 2 %}{% endfor %}{{ x }}"), "1");
  EXPECT_EQ(R("{% set ns = namespace(x=1) %}{% for i in [1,2] %}{% set ns.x = ns.x + i %}{% endfor %}{{ ns.x }}"), "4");
  EXPECT_EQ(R("{% if true %}{% set y = 'in if' %}{% endif %}{{ y }}"), "in if");
  EXPECT_EQ(R("{% set a, b = 1, 2 %}{{ b }}{{ a }}"), "21");
  EXPECT_EQ(R("{% set s %}block {{ 1 }}{% endset %}[{{ s }}]"), "[block 1]");
  EXPECT_EQ(R("{% set ns = {} %}{% set ns.x = 1 %}").substr(0, 6), "ERROR:");
}

TEST(ChatRuntimeTest, Macros) {
  EXPECT_EQ(R("{% macro hi(name, p='!') %}hi {{ name }}{{ p }}{% endmacro %}{{ hi('a') }} {{ hi('b', p='?') }}"),
            "hi a! hi b?");
  EXPECT_EQ(R("{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(3) }}"), "321");
}

TEST(ChatRuntimeTest, StringMethodsAndFilters) {
  EXPECT_EQ(R("{{ '  a b  '.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ ' a '.lstrip() }}|{{ ' a '.rstrip() }}"),
            "a b|a|a | a");
  EXPECT_EQ(R("{{ 'a,b,,c'.split(',') }}{{ ' a  b '.split() }}{{ 'a b c'.split(' ', 1) }}"),
            "['a', 'b', '', 'c']['a', 'b']['a', 'b c']");
  EXPECT_EQ(R("{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith(('x', 'c')) }}{{ 'aXb'.upper() }}{{ 'aXb'.lower() }}"),
            "TrueTrueAXBaxb");
  EXPECT_EQ(R("{{ 'hello world'.title() }}|{{ 'hello world' | title }}|{{ 'hELLO' | capitalize }}"),
            "Hello World|Hello World|Hello");
  EXPECT_EQ(R("{{ 'aaa'.replace('a', 'b', 2) }}{{ 'x-y' | replace('-', '+') }}"), "bbax+y");
  EXPECT_EQ(R("{{ 'héllo'[1:3] }}{{ [1,2,3,4][::-1] }}{{ [1,2,3][-1] }}{{ 'abc'[-2:] }}"), "él[4, 3, 2, 1]3bc");
  EXPECT_EQ(R("{{ [3,1,2] | sort | join(',') }}{{ ['a','b'] | first }}{{ ['a','b'] | last }}{{ 'héllo' | length }}"),
            "1,2,3ab5");
  EXPECT_EQ(R("{{ x | default('d') }}{{ none | string }}{{ '7' | int + 1 }}{{ 1.5 | string }}"), "dNone81.5");
  EXPECT_EQ(R("{{ [{'a': 1}, {'a': 2}] | map(attribute='a') | list }}"), "[1, 2]");
  EXPECT_EQ(R("{{ [1, 2, 3] | select('odd') | list }}{{ ['a', 'code', 'b'] | reject('equalto', 'code') | join }}"),
            "[1, 3]ab");
  EXPECT_EQ(R("{{ [{'r': 'x'}, {'r': 'y'}] | selectattr('r', 'equalto', 'y') | list | length }}"), "1");
  EXPECT_EQ(R("{{ 'a\nb' | indent(2, true) }}"), "  a\n  b");
}

TEST(ChatRuntimeTest, TestsAndOperators) {
  EXPECT_EQ(R("{{ x is defined }}{{ x is not defined }}{{ none is none }}{{ 'a' is string }}{{ {} is mapping }}"),
            "FalseTrueTrueTrueTrue");
  EXPECT_EQ(R("{{ 'a' is iterable }}{{ 1 is iterable }}{{ 3 is divisibleby 3 }}{{ 2 is number }}"),
            "TrueFalseTrueTrue");
  EXPECT_EQ(R("{{ 'b' in 'abc' }}{{ 2 in [1, 2] }}{{ 'k' in {'k': 1} }}{{ 'z' not in 'abc' }}"), "TrueTrueTrueTrue");
  EXPECT_EQ(R("{{ 7 // 2 }}{{ -7 // 2 }}{{ 7 % 3 }}{{ -7 % 3 }}{{ 7 / 2 }}{{ 1 ~ 2 }}"), "3-4123.512");
  EXPECT_EQ(R("{{ 0 or 'x' }}{{ 1 and 'y' }}{{ [] or [] }}"), "xy[]");
  EXPECT_EQ(R("{{ 'a' < 'b' }}{{ 1 == 1.0 }}{{ 1 != '1' }}"), "TrueTrueTrue");
}

TEST(ChatRuntimeTest, ToJsonAsTransformers) {
  EXPECT_EQ(R("{{ x | tojson }}", {{"x", {{"b", 1}, {"a", {1.5, nullptr, true, "é\"\n"}}}}}),
            "{\"b\": 1, \"a\": [1.5, null, true, \"é\\\"\\n\"]}");
  EXPECT_EQ(R("{{ x | tojson(indent=2) }}", {{"x", {{"a", json::array({1, 2})}, {"e", json::object()}}}}),
            "{\n  \"a\": [\n    1,\n    2\n  ],\n  \"e\": {}\n}");
  EXPECT_EQ(R("{{ x | tojson(ensure_ascii=true) }}", {{"x", "é😀"}}), "\"\\u00e9\\ud83d\\ude00\"");
  EXPECT_EQ(R("{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}"), "{\"a\": 2, \"b\": 1}");
  EXPECT_EQ(R("{{ [1, 2] | tojson(separators=(',', ':')) }}"), "[1,2]");
  EXPECT_EQ(R("{{ 1e20 }} {{ 0.1 }} {{ 1e-05 }} {{ 100.0 }} {{ 1e16 }} {{ 123456789012345.6 }}"),
            "1e+20 0.1 1e-05 100.0 1e+16 123456789012345.6");
}

TEST(ChatRuntimeTest, Globals) {
  EXPECT_EQ(R("{{ range(3) | list }}{{ range(1, 6, 2) | join }}"), "[0, 1, 2]135");
  EXPECT_EQ(R("{{ dict(a=1).a }}"), "1");
  // strftime_now is today's date; only its shape is checked.
  const std::string year = R("{{ strftime_now('%Y') }}");
  ASSERT_EQ(year.size(), 4u);
  EXPECT_GE(year, "2024");
}

TEST(ChatRuntimeTest, RaiseExceptionCarriesTheTemplatesMessage) {
  absl::StatusOr<ChatTemplate> t = ChatTemplate::FromString("x\n{{ raise_exception('Roles must alternate!') }}");
  ASSERT_TRUE(t.ok());
  absl::StatusOr<std::string> out = t->Render(json::array(), true);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(out.status().message(), "Roles must alternate! (raised by the chat template at line 2, column 19)");
}

TEST(ChatRuntimeTest, RuntimeErrorsCarryLineAndColumn) {
  EXPECT_EQ(R("{{ 'a' + 1 }}"), "ERROR: chat template line 1, column 8: can only concatenate str (not \"int\") to str");
  EXPECT_EQ(R("\n{{ missing.attr }}"), "ERROR: chat template line 2, column 11: 'missing' is undefined");
  EXPECT_EQ(R("{{ 1 | nosuchfilter }}"), "ERROR: chat template line 1, column 8: no filter named 'nosuchfilter'");
  EXPECT_EQ(R("{{ missing }}|{{ missing | length }}|{% for x in missing %}{% endfor %}"), "|0|");
}

TEST(ChatRuntimeTest, HostileTemplatesAreErrorsNotCrashes) {
  // Nesting deeper than the parser allows.
  absl::StatusOr<std::shared_ptr<const Template>> t = Parse("{% set x = " + std::string(100000, '(') + "1" + std::string(100000, ')') + " %}");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("nested too deeply"), std::string::npos) << t.status();
  t = Parse("{{ " + [] { std::string s; for (int i = 0; i < 50000; ++i) s += "not "; return s; }() + "1 }}");
  ASSERT_FALSE(t.ok());
  std::string blocks;
  for (int i = 0; i < 50000; ++i) blocks += "{% if 1 %}";
  EXPECT_FALSE(Parse(blocks).ok());
  // Reference cycles (a namespace holding itself, a macro in its own scope) are still rendered;
  // the leak checker of the fuzz build (ASan) verifies that they are freed.
  EXPECT_EQ(R("{% set ns = namespace(a=1) %}{% set ns.me = ns %}{% set ns.l = [ns] %}{{ ns.me.me.a }}"), "1");
}

// --- the render budget (budget.h): hostile templates end in an error naming the budget ---

// The default budget without its deadline: these tests assert which budget a template exceeds,
// and on a slow or loaded machine the deadline could come first.
RenderBudget Untimed() {
  RenderBudget budget;
  budget.deadline = std::chrono::minutes(10);
  return budget;
}

// The status of rendering `source` (no messages) within `budget`.
absl::Status RenderStatus(const std::string& source, const RenderBudget& budget = Untimed()) {
  absl::StatusOr<ChatTemplate> t = ChatTemplate::FromString(source);
  if (!t.ok()) return t.status();
  return t->Render(json::array(), false, nullptr, nullptr, budget).status();
}

// Asserts that `status` is `code` with a message naming the budget `what`.
void ExpectBudget(const absl::Status& status, absl::StatusCode code, const std::string& what) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_NE(status.message().find("the chat template exceeded its budget of " + what), std::string::npos) << status;
}

const std::string kElements = "1000000 list and dict elements";
const std::string kBytes = "134217728 bytes of strings";

TEST(ChatBudgetTest, ListsGrownInALoopStopAtTheElementBudget) {
  // Concatenation 100,000 times: quadratic copying, minutes without a budget.
  ExpectBudget(RenderStatus("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
                            "{% set ns.l = ns.l + [i] %}{% endfor %}{{ ns.l | length }}"),
               absl::StatusCode::kResourceExhausted, kElements);
  // Doubling 40 times: refused before the list that does not fit is allocated.
  ExpectBudget(RenderStatus("{% set ns = namespace(l=[1]) %}{% for i in range(40) %}"
                            "{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l | length }}"),
               absl::StatusCode::kResourceExhausted, kElements);
  ExpectBudget(RenderStatus("{{ ([1, 2] * 10**10) | length }}"), absl::StatusCode::kResourceExhausted, kElements);
  // The error says where: the `+` of line 2.
  EXPECT_NE(RenderStatus("{% set ns = namespace(l=[1]) %}\n{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}{% endfor %}")
                .message()
                .find("(line 2, column 44)"),
            std::string::npos);
}

TEST(ChatBudgetTest, HugeRangesAreRefusedBeforeAllocating) {
  ExpectBudget(RenderStatus("{% for i in range(10**12) %}{% endfor %}"), absl::StatusCode::kResourceExhausted, kElements);
  ExpectBudget(RenderStatus("{{ range(0, 2**62, 3) | length }}"), absl::StatusCode::kResourceExhausted, kElements);
  ExpectBudget(RenderStatus("{% for c in 'x' * 10**7 %}{% endfor %}"), absl::StatusCode::kResourceExhausted, kElements);
  // What fits still renders as Python's range.
  EXPECT_EQ(R("{{ range(10, 0, -3) | list }}{{ range(-5) | list }}{{ range(0, 10, 3) | list }}{{ range(3, 3) | list }}"),
            "[10, 7, 4, 1][][0, 3, 6, 9][]");
}

TEST(ChatBudgetTest, StringsStopAtTheByteBudget) {
  ExpectBudget(RenderStatus("{{ 'x' * 10**10 }}"), absl::StatusCode::kResourceExhausted, kBytes);
  ExpectBudget(RenderStatus("{% set ns = namespace(s='xxxxxxxxxxxxxxxx') %}{% for i in range(64) %}"
                            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}"),
               absl::StatusCode::kResourceExhausted, kBytes);
  // The output itself, grown a kilobyte at a time.
  ExpectBudget(RenderStatus("{% for i in range(500000) %}{{ 'a' ~ 'b' * 1000 }}{% endfor %}"),
               absl::StatusCode::kResourceExhausted, kBytes);
  // One string held many times over, then joined, printed or indented.
  ExpectBudget(RenderStatus("{% set l = ['x' * 1000000] * 1000 %}{{ l | join(',') }}"),
               absl::StatusCode::kResourceExhausted, kBytes);
  ExpectBudget(RenderStatus("{% set l = ['x' * 1000000] * 1000 %}{{ ''.join(l) }}"),
               absl::StatusCode::kResourceExhausted, kBytes);
  ExpectBudget(RenderStatus("{% set l = ['x' * 1000000] * 1000 %}{{ l }}"), absl::StatusCode::kResourceExhausted, kBytes);
  ExpectBudget(RenderStatus("{% set l = ['x' * 1000000] * 1000 %}{{ l | tojson }}"),
               absl::StatusCode::kResourceExhausted, kBytes);
  ExpectBudget(RenderStatus("{{ ('x\n' * 1000) | indent(10**6) }}"), absl::StatusCode::kResourceExhausted, kBytes);
  ExpectBudget(RenderStatus("{{ ('x' * 1000) | replace('x', 'y' * 10**6) }}"), absl::StatusCode::kResourceExhausted, kBytes);
}

TEST(ChatBudgetTest, RecursionStopsAtTheDepthBudget) {
  const std::string levels = "200 levels of nesting";
  // A macro calling itself without end: an error, not a stack overflow.
  ExpectBudget(RenderStatus("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"),
               absl::StatusCode::kResourceExhausted, levels);
  // A list nested 100,000 deep: printing it is refused, and freeing it does not recurse.
  ExpectBudget(RenderStatus("{% set ns = namespace(l=[1]) %}{% for i in range(100000) %}{% set ns.l = [ns.l] %}"
                            "{% endfor %}{{ ns.l }}"),
               absl::StatusCode::kResourceExhausted, levels);
  // (Untimed: 100,000 iterations may take more than the deadline under a sanitizer on a loaded machine.)
  absl::StatusOr<ChatTemplate> deep = ChatTemplate::FromString(
      "{% set ns = namespace(l=[1]) %}{% for i in range(100000) %}{% set ns.l = [ns.l] %}{% endfor %}"
      "{% set ns.l = 0 %}freed");
  ASSERT_TRUE(deep.ok()) << deep.status();
  absl::StatusOr<std::string> freed = deep->Render(json::array(), false, nullptr, nullptr, Untimed());
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, "freed");
  // A namespace that holds itself, printed.
  ExpectBudget(RenderStatus("{% set ns = namespace(a=1) %}{% set ns.me = ns %}{{ ns }}"),
               absl::StatusCode::kResourceExhausted, levels);
  // The limit is the caller's: depth 4 fits in 5 levels, depth 6 does not.
  RenderBudget budget = Untimed();
  budget.max_depth = 5;
  const std::string nest = "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{% endif %}.{% endmacro %}";
  EXPECT_TRUE(RenderStatus(nest + "{{ f(4) }}", budget).ok());
  ExpectBudget(RenderStatus(nest + "{{ f(6) }}", budget), absl::StatusCode::kResourceExhausted, "5 levels of nesting");
}

TEST(ChatBudgetTest, LoopIterationsAndMacroCalls) {
  RenderBudget budget = Untimed();
  budget.max_iterations = 1000;
  const std::string loop = "{% for i in range(n) %}{% endfor %}";
  EXPECT_TRUE(RenderStatus("{% set n = 999 %}" + loop, budget).ok());
  ExpectBudget(RenderStatus("{% set n = 1001 %}" + loop, budget), absl::StatusCode::kResourceExhausted,
               "1000 loop iterations and macro calls");
  ExpectBudget(RenderStatus("{% macro f() %}{% endmacro %}{% for i in range(600) %}{{ f() }}{% endfor %}", budget),
               absl::StatusCode::kResourceExhausted, "1000 loop iterations and macro calls");
}

TEST(ChatBudgetTest, TheDeadlineStopsLongRenders) {
  RenderBudget budget;
  budget.deadline = std::chrono::milliseconds(100);
  budget.max_iterations = INT64_MAX;
  // A billion iterations that create nothing: only the deadline ends them.
  ExpectBudget(RenderStatus("{% set r = range(1000) %}{% for a in r %}{% for b in r %}{% for c in r %}"
                            "{% endfor %}{% endfor %}{% endfor %}",
                            budget),
               absl::StatusCode::kDeadlineExceeded, "100 ms of rendering time");
  // 2**40 comparisons of a list shared with itself, inside one expression.
  ExpectBudget(RenderStatus("{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = [ns.l, ns.l] %}"
                            "{% endfor %}{{ ns.l == ns.l }}",
                            budget),
               absl::StatusCode::kDeadlineExceeded, "100 ms of rendering time");
  // Integer powers take a time logarithmic in the exponent (64-bit, wrapping where Python grows).
  EXPECT_EQ(R("{{ 3 ** 4 }} {{ 2 ** 62 }} {{ 2 ** 64 }} {{ 3 ** 1000000000000000000 > 0 or true }}"),
            "81 4611686018427387904 0 True");
}

TEST(ChatBudgetTest, CancellationStopsARender) {
  RenderBudget budget;
  budget.deadline = std::chrono::minutes(10);  // only the cancellation can end it in time
  budget.max_iterations = INT64_MAX;
  int polls = 0;
  budget.cancelled = [&polls] { return ++polls == 3; };
  const std::string endless =
      "{% set r = range(1000) %}{% for a in r %}{% for b in r %}{% for c in r %}{% endfor %}{% endfor %}{% endfor %}";
  absl::Status s = RenderStatus(endless, budget);
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  EXPECT_NE(s.message().find("cancelled"), std::string::npos) << s;
  EXPECT_EQ(polls, 3);
  // From another thread, as the server does when the client goes away.
  std::atomic<bool> gone{false};
  budget.cancelled = [&gone] { return gone.load(std::memory_order_relaxed); };
  std::thread canceller([&gone] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    gone = true;
  });
  s = RenderStatus(endless, budget);
  canceller.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  // A render that is not cancelled is not disturbed by the polls.
  budget.cancelled = [] { return false; };
  EXPECT_TRUE(RenderStatus("{% for i in range(100000) %}{% endfor %}", budget).ok());
}

TEST(ChatBudgetTest, EveryFixtureRendersWithinATenthOfTheBudget) {
  // The defaults leave a wide margin: every fixture case renders with a tenth of each.
  RenderBudget tight;
  tight.max_elements /= 10;
  tight.max_iterations /= 10;
  tight.max_bytes /= 10;
  tight.max_depth /= 10;
  int rendered = 0;
  for (const std::string& family : Families()) {
    const std::filesystem::path dir = kFixtures / family;
    absl::StatusOr<ChatTemplate> tmpl = ChatTemplate::FromDirectory(dir.string());
    ASSERT_TRUE(tmpl.ok()) << tmpl.status();
    const json cases = json::parse(ReadText(dir / "cases.json"));
    for (const json& c : cases["cases"]) {
      if (c.contains("error")) continue;
      const Rendered r = RenderCase(*tmpl, cases, c, tight);
      ASSERT_TRUE(r.out.ok()) << family << " " << c["name"] << ": " << r.out.status();
      EXPECT_EQ(*r.out, r.expected) << family << " " << c["name"];
      ++rendered;
    }
  }
  EXPECT_GT(rendered, 13);
}

// --- loading ---

TEST(ChatTemplateTest, LoadsTemplateListAndPicksToolUse) {
  const std::string config = R"({"bos_token": {"content": "<B>", "lstrip": false}, "eos_token": "<E>",
    "chat_template": [{"name": "default", "template": "D{{ bos_token }}{{ eos_token }}"},
                      {"name": "tool_use", "template": "T{{ tools | length }}"}]})";
  absl::StatusOr<ChatTemplate> t = ChatTemplate::FromTokenizerConfig(config);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t->Render(json::array(), false), "D<B><E>");
  EXPECT_EQ(*t->Render(json::array(), false, json::array({json::object()})), "T1");
}

TEST(ChatTemplateTest, JinjaFileOverridesConfigAndInputsAreChecked) {
  const std::filesystem::path dir = std::filesystem::path(testing::TempDir()) / "chat_template_dir";
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "tokenizer_config.json") << R"({"eos_token": "</s>", "chat_template": "config"})";
  std::ofstream(dir / "chat_template.jinja") << "jinja{{ eos_token }}\n";
  absl::StatusOr<ChatTemplate> t = ChatTemplate::FromDirectory(dir.string());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t->Render(json::array(), false), "jinja</s>");
  EXPECT_EQ(t->Render(json::object(), false).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t->Render(json::array(), false, json::object()).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ChatTemplate::FromDirectory((dir / "nope").string()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ChatTemplate::FromTokenizerConfig("{}").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ChatTemplate::FromTokenizerConfig("[").status().code(), absl::StatusCode::kInvalidArgument);
}

// --- continue_final_message (the families' cases are in the fixtures) ---

TEST(ChatTemplateTest, ContinuingCutsWhereTheFinalTextEnds) {
  absl::StatusOr<ChatTemplate> t = ChatTemplate::FromString(
      "{% for m in messages %}[{{ m.role }}]{% if m.content is string %}{{ m.content }}{% else %}"
      "{% for p in m.content %}{{ p.text }}|{% endfor %}{% endif %}<end>{% endfor %}");
  ASSERT_TRUE(t.ok()) << t.status();
  const json user = {{"role", "user"}, {"content", "Hi"}};
  EXPECT_EQ(*t->RenderContinuing(json::array({user, {{"role", "assistant"}, {"content", "Hello "}}})),
            "[user]Hi<end>[assistant]Hello ");
  // A list's last text part is the one continued; what follows it is cut.
  const json parts = json::array({{{"type", "text"}, {"text", "A"}}, {{"type", "text"}, {"text", "B"}},
                                  {{"type", "image"}}});
  EXPECT_EQ(*t->RenderContinuing(json::array({user, {{"role", "assistant"}, {"content", parts}}})),
            "[user]Hi<end>[assistant]A|B");
  // The template's trimming: cut after the text's last non-space.
  absl::StatusOr<ChatTemplate> trims = ChatTemplate::FromString("{% for m in messages %}{{ m.content | trim }}!{% endfor %}");
  ASSERT_TRUE(trims.ok());
  EXPECT_EQ(*trims->RenderContinuing(json::array({{{"role", "assistant"}, {"content", "one two  "}}})), "one two");
}

TEST(ChatTemplateTest, ContinuingRefusesWhatCannotBeContinued) {
  absl::StatusOr<ChatTemplate> t = ChatTemplate::FromString("{% for m in messages %}{{ m.content }}{% endfor %}");
  ASSERT_TRUE(t.ok());
  auto message = [](const absl::StatusOr<std::string>& out) {
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(out.status().message());
  };
  EXPECT_THAT(message(t->RenderContinuing(json::array())), testing::HasSubstr("the conversation is empty"));
  EXPECT_THAT(message(t->RenderContinuing(json::array({{{"role", "assistant"}}}))),
              testing::HasSubstr("has no \"content\" to continue"));
  EXPECT_THAT(message(t->RenderContinuing(json::array({{{"role", "assistant"}, {"content", json::array({{{"type", "image"}}})}}}))),
              testing::HasSubstr("could not find any text"));
  EXPECT_THAT(message(t->RenderContinuing(json::array({{{"role", "assistant"}, {"content", 5}}}))),
              testing::HasSubstr("content is not text"));
  absl::StatusOr<ChatTemplate> blind = ChatTemplate::FromString("{% for m in messages %}{{ m.role }}{% endfor %}");
  ASSERT_TRUE(blind.ok());
  EXPECT_THAT(message(blind->RenderContinuing(json::array({{{"role", "assistant"}, {"content", "x"}}}))),
              testing::HasSubstr("not an accepted field"));
  // A template that rewrites the message: the text is not found.
  absl::StatusOr<ChatTemplate> upper = ChatTemplate::FromString("{% for m in messages %}{{ m.content | upper }}{% endfor %}");
  ASSERT_TRUE(upper.ok());
  EXPECT_THAT(message(upper->RenderContinuing(json::array({{{"role", "assistant"}, {"content", "quiet"}}}))),
              testing::HasSubstr("does not appear in the chat"));
}

}  // namespace
}  // namespace shardserve::chat
