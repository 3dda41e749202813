"""Structured outputs through the OpenAI HTTP API and the official `openai` Python client, against
real local clusters (`shardserve launch` on 127.0.0.1 serving the embedded demo model, whose
weights are not trained: the grammar's token masks alone make the outputs valid) in two layouts,
TP1 and TP2 x PP2: `chat.completions.parse` with a pydantic model, json_object, guided_json,
guided_regex, guided_choice, guided_grammar, structured_outputs, tool_choice "required" and named
(whole, and streamed: the arguments in several deltas as they are generated; tools whose
parameters refer to their own $defs), and a constraint the engine cannot compile (400 naming the field). Every JSON
output is validated with `jsonschema`. Always stops the clusters it started.

Run by CTest as: clients/python/setup-env.sh, then
    .venv-client/bin/python tests/openai_structured_test.py --bin <build>/bin
"""
import argparse
import json
import os
import sys
import tempfile
import unittest
from typing import Annotated, List, Literal, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from openai_api_test import ROOT, start_launch, stop_launch  # noqa: E402
import openai_api_test  # noqa: E402
from cli_check import free_ports  # noqa: E402

import jsonschema  # noqa: E402
import openai  # noqa: E402
import pydantic  # noqa: E402

MODEL = "demo"
# Each constraint below is bounded (lengths, ranges, enums), so that every output ends with the EOS
# within MAX_TOKENS tokens.
MAX_TOKENS = 120


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=120)
    pet: Literal["cat", "dog", "none"]
    scores: List[Annotated[int, pydantic.Field(ge=0, le=99)]] = pydantic.Field(max_length=3)
    nickname: Optional[str] = pydantic.Field(default=None, max_length=6)

    model_config = pydantic.ConfigDict(extra="forbid")


SCORES_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"]}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
# Parameters that refer to their own $defs, as pydantic writes nested models.
SEND_TOOL = {"type": "function", "function": {
    "name": "send", "parameters": {"type": "object", "properties": {
        "to": {"$ref": "#/$defs/Place"}, "cc": {"type": "array", "items": {"$ref": "#/$defs/Place"}, "maxItems": 2}},
        "required": ["to"], "additionalProperties": False,
        "$defs": {"Place": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}},
                            "required": ["city"], "additionalProperties": False}}}}}
MESSAGES = [{"role": "user", "content": "And God said, let there be light."}]


class StructuredTest:
    """The checks, run against one cluster per layout (the subclasses)."""
    LAYOUT: List[str] = []

    @classmethod
    def setUpClass(cls):
        grpc_port, http_port = free_ports(2)
        cls.base = f"http://127.0.0.1:{http_port}"
        cls.launch = start_launch(
            ["--model", os.path.join(ROOT, "models", MODEL), "--address", f"127.0.0.1:{grpc_port}",
             "--http-port", str(http_port)] + cls.LAYOUT, cls.base, tempfile.mkdtemp(prefix="shardserve-structured-"))
        cls.client = openai.OpenAI(base_url=cls.base + "/v1", api_key="unused", max_retries=0, timeout=120)

    @classmethod
    def tearDownClass(cls):
        stop_launch(cls.launch)

    def chat(self, max_tokens=MAX_TOKENS, **kw):
        return self.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens, **kw)

    def test_parse_with_a_pydantic_model(self):
        # parse() sends Person's schema as response_format json_schema (strict) and parses the answer;
        # create() with the schema written out checks the same without the client's help.
        parse = getattr(self.client.chat.completions, "parse", None) or self.client.beta.chat.completions.parse
        for seed in range(3):
            kw = dict(temperature=0) if seed == 0 else dict(temperature=1.0, seed=seed)
            r = self.client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "Person", "schema": Person.model_json_schema(), "strict": True}}, **kw)
            self.assertEqual(r.choices[0].finish_reason, "stop", r.choices[0].message.content)
            jsonschema.validate(json.loads(r.choices[0].message.content), Person.model_json_schema())
            p = parse(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, response_format=Person, **kw)
            self.assertEqual(p.choices[0].finish_reason, "stop", p.choices[0].message.content)
            self.assertIsInstance(p.choices[0].message.parsed, Person)
            jsonschema.validate(json.loads(p.choices[0].message.content), Person.model_json_schema())

    def test_json_object_and_guided_json(self):
        r = self.chat(response_format={"type": "json_object"}, temperature=0, max_tokens=24)
        text = r.choices[0].message.content
        if r.choices[0].finish_reason == "stop":
            json.loads(text)
        else:  # cut by max_tokens: still a prefix of JSON, which begins with a value
            self.assertRegex(text, r'^[\[{"\-0-9tfn]')
        for body in ({"guided_json": SCORES_SCHEMA}, {"guided_json": json.dumps(SCORES_SCHEMA)},
                     {"structured_outputs": {"json": SCORES_SCHEMA}}):
            for kw in (dict(temperature=0), dict(temperature=1.0, seed=7)):
                c = self.client.completions.create(model=MODEL, prompt="In the beginning", max_tokens=MAX_TOKENS,
                                                   extra_body=body, **kw)
                self.assertEqual(c.choices[0].finish_reason, "stop")
                jsonschema.validate(json.loads(c.choices[0].text), SCORES_SCHEMA)

    def test_guided_regex_choice_and_grammar(self):
        regex = r"[a-z]{2,8}( [a-z]{2,8}){0,2}\."
        for kw in (dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=1.0, seed=4)):
            r = self.chat(extra_body={"guided_regex": regex}, **kw)
            self.assertEqual(r.choices[0].finish_reason, "stop")
            self.assertRegex(r.choices[0].message.content, "^" + regex + "$")
            c = self.client.completions.create(model=MODEL, prompt="Is it good?", max_tokens=MAX_TOKENS,
                                               extra_body={"guided_choice": ["yes", "no", "it was so"]}, **kw)
            self.assertIn(c.choices[0].text, ["yes", "no", "it was so"])
            g = self.client.completions.create(
                model=MODEL, prompt="Count:", max_tokens=MAX_TOKENS,
                extra_body={"structured_outputs": {"grammar": 'root ::= "(" [0-9]{1,2} ("," [0-9]{1,2}){0,3} ")"'}}, **kw)
            self.assertRegex(g.choices[0].text, r"^\([0-9]{1,2}(,[0-9]{1,2}){0,3}\)$")
        # Streamed: the pieces join to a valid whole.
        text = "".join(ch.choices[0].delta.content or "" for ch in
                       self.chat(extra_body={"guided_regex": regex}, temperature=0, stream=True) if ch.choices)
        self.assertRegex(text, "^" + regex + "$")

    def test_tool_choice_named(self):
        for kw in (dict(temperature=0), dict(temperature=1.0, seed=5)):
            r = self.chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kw)
            choice = r.choices[0]
            self.assertEqual(choice.finish_reason, "tool_calls")
            self.assertIsNone(choice.message.content)
            self.assertEqual(len(choice.message.tool_calls), 1)
            call = choice.message.tool_calls[0]
            self.assertEqual(call.function.name, "get_weather")
            jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
        # Streamed: a delta with the call's name, then its arguments in pieces as they are generated;
        # finish_reason tool_calls.
        for name, tool in (("get_time", TIME_TOOL), ("get_weather", WEATHER_TOOL)):
            calls = self.streamed_calls(tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}},
                                        temperature=0)
            self.assertEqual([c["name"] for c in calls], [name])
            jsonschema.validate(json.loads(calls[0]["arguments"]), tool["function"]["parameters"])
            self.assertGreater(calls[0]["pieces"], 1, calls[0])

    def streamed_calls(self, **kw):
        """The calls of a streamed answer, each assembled from its deltas: name, id, arguments and the
        number of deltas its arguments came in; checks the deltas' order and the finish_reason."""
        chunks = list(self.chat(stream=True, **kw))
        calls = []
        for ch in chunks:
            if not ch.choices:
                continue
            for tc in ch.choices[0].delta.tool_calls or []:
                if tc.id is not None:  # a call's first delta: its index, id, type and name
                    self.assertEqual(tc.index, len(calls))
                    self.assertEqual(tc.type, "function")
                    calls.append({"name": tc.function.name, "id": tc.id, "arguments": "", "pieces": 0})
                    self.assertEqual(tc.function.arguments, "")
                    continue
                self.assertEqual(tc.index, len(calls) - 1, "arguments of a call that has not begun")
                self.assertIsNone(tc.function.name)
                calls[-1]["arguments"] += tc.function.arguments
                calls[-1]["pieces"] += 1
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        self.assertEqual(finish, ["tool_calls"])
        return calls

    def test_tool_choice_required(self):
        by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

        def check_calls(calls):
            self.assertGreaterEqual(len(calls), 1)
            for call in calls:
                self.assertIn(call.function.name, by_name)
                jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])

        # parallel_tool_calls false: one call at most, so the grammar (and the output) ends.
        for kw in (dict(temperature=0), dict(temperature=1.0, seed=6), dict(temperature=1.0, seed=8)):
            r = self.chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, **kw)
            choice = r.choices[0]
            self.assertEqual(choice.finish_reason, "tool_calls", choice.message.content)
            self.assertEqual(len(choice.message.tool_calls), 1)
            check_calls(choice.message.tool_calls)
        # Streamed: each call's name once complete, then its arguments in pieces.
        for kw in (dict(temperature=0), dict(temperature=1.0, seed=6)):
            calls = self.streamed_calls(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, **kw)
            self.assertEqual(len(calls), 1)
            self.assertIn(calls[0]["name"], by_name)
            jsonschema.validate(json.loads(calls[0]["arguments"]), by_name[calls[0]["name"]])
            self.assertGreater(calls[0]["pieces"], 1, calls[0])
        # Several calls may come; the untrained model may repeat calls until max_tokens, which
        # leaves the cut array as content (a prefix of the calls' grammar).
        for kw in (dict(temperature=0), dict(temperature=1.0, seed=9), dict(temperature=1.0, seed=10)):
            r = self.chat(tools=TOOLS, tool_choice="required", max_tokens=200, **kw)
            choice = r.choices[0]
            if choice.finish_reason == "tool_calls":
                self.assertIsNone(choice.message.content)
                check_calls(choice.message.tool_calls)
            else:
                self.assertEqual(choice.finish_reason, "length")
                self.assertFalse(choice.message.tool_calls)
                self.assertTrue(choice.message.content.startswith('[{"name":"get_'), choice.message.content)

    def test_tool_parameters_with_defs(self):
        # tool_choice "required" nests each tool's parameters in the calls' schema: their $refs still
        # resolve. Named: the tool's parameters are the schema.
        params = SEND_TOOL["function"]["parameters"]
        for kw in (dict(temperature=0), dict(temperature=1.0, seed=11), dict(temperature=1.0, seed=12)):
            for choice in ("required", {"type": "function", "function": {"name": "send"}}):
                r = self.chat(tools=[SEND_TOOL, TIME_TOOL], tool_choice=choice, parallel_tool_calls=False, **kw)
                c = r.choices[0]
                self.assertEqual(c.finish_reason, "tool_calls", c.message.content)
                self.assertEqual(len(c.message.tool_calls), 1)
                call = c.message.tool_calls[0]
                if call.function.name == "send":
                    jsonschema.validate(json.loads(call.function.arguments), params)
                else:
                    self.assertEqual(choice, "required")
                    jsonschema.validate(json.loads(call.function.arguments), TIME_TOOL["function"]["parameters"])

    def test_errors_name_the_field(self):
        cases = [
            (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "if": {}}}}),
             "response_format.json_schema.schema", "if"),
            (dict(extra_body={"guided_regex": "a(?=b)"}), "guided_regex", ""),
            (dict(extra_body={"guided_regex": "a", "guided_choice": ["b"]}), "guided_choice", "cannot be combined"),
            (dict(extra_body={"guided_grammar": "root ::= ("}), "guided_grammar", ""),
            (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
             "tool_choice.function.name", "not one of the tools"),
        ]
        for kw, param, words in cases:
            with self.assertRaises(openai.BadRequestError) as e:
                self.chat(**kw)
            self.assertEqual(e.exception.body.get("param"), param, e.exception.body)
            self.assertIn(words, e.exception.body.get("message"))


class TP1(StructuredTest, unittest.TestCase):
    LAYOUT = ["--nodes", "1", "--gpus-per-node", "1"]


class TP2_PP2(StructuredTest, unittest.TestCase):
    LAYOUT = ["--nodes", "2", "--gpus-per-node", "2"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", required=True)
    args, rest = parser.parse_known_args()
    openai_api_test.BIN = args.bin
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
