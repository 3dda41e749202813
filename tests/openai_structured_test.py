"""Structured outputs through the OpenAI HTTP API and the official `openai` Python client, against
real local clusters (`shardserve launch` on 127.0.0.1 serving the embedded demo model, whose
weights are not trained: the grammar's token masks alone make the outputs valid) in two layouts,
TP1 and TP2 x PP2: `chat.completions.parse` with a pydantic model, json_object, guided_json,
guided_regex, guided_choice, guided_grammar, structured_outputs, tool_choice "required" and named
(whole, and streamed: the arguments in several deltas as they are generated; tools whose
parameters refer to their own $defs), and a constraint the engine cannot compile (400 naming the field).
Then tool_choice "required" and named with the demo model made to write gpt-oss's harmony format
(its tokenizer given harmony's markers as special tokens, a chat template writing <|channel|>):
one call as harmony writes it, read into tool_calls, whole and streamed. Every JSON
output is validated with `jsonschema`. Always stops the clusters it started.

Run by CTest as: clients/python/setup-env.sh, then
    .venv-client/bin/python tests/openai_structured_test.py --bin <build>/bin
"""
import argparse
import json
import os
import sys
import unittest
from typing import Annotated, List, Literal, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from openai_api_test import ROOT, start_launch, stop_launch  # noqa: E402
import openai_api_test  # noqa: E402
from cli_check import free_ports, run_unittests, work_dir  # noqa: E402

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
             "--http-port", str(http_port)] + cls.LAYOUT, cls.base, work_dir("shardserve-structured-"))
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


HARMONY_MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>"]


def harmony_demo_model(dest: str) -> str:
    """The demo model made to write gpt-oss's harmony format: the same weights, its tokenizer with
    seven of its tokens (the highest ids that no merge uses) given up to harmony's markers as
    special tokens, a chat template that writes <|channel|> (so the server reads harmony), and
    <|call|> and <|return|> among the end tokens, as gpt-oss's generation_config.json has them."""
    demo = os.path.join(ROOT, "models", MODEL)
    for name in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(demo, name), os.path.join(dest, name))
    with open(os.path.join(demo, "tokenizer.json")) as f:
        tok = json.load(f)
    model = tok["model"]
    merges = [m if isinstance(m, list) else m.split(" ") for m in model["merges"]]
    used = {part for m in merges for part in m}
    by_id = {i: t for t, i in model["vocab"].items()}
    leaves = [i for i in sorted(by_id, reverse=True) if by_id[i] not in used and len(by_id[i]) > 1][:len(HARMONY_MARKERS)]
    ids = {}
    for marker, i in zip(HARMONY_MARKERS, leaves):
        old = by_id[i]
        merges = [m for m in merges if "".join(m) != old]
        del model["vocab"][old]
        model["vocab"][marker] = i
        tok["added_tokens"].append({"id": i, "content": marker, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})
        ids[marker] = i
    model["merges"] = merges
    with open(os.path.join(dest, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    with open(os.path.join(demo, "tokenizer_config.json")) as f:
        config = json.load(f)
    for marker, i in ids.items():
        config["added_tokens_decoder"][str(i)] = {"content": marker, "lstrip": False, "normalized": False,
                                                  "rstrip": False, "single_word": False, "special": True}
    config["chat_template"] = (
        "{% for m in messages %}<|start|>{{ m['role'] }}{% if m['role'] == 'assistant' %}<|channel|>final{% endif %}"
        "<|message|>{{ m['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
    with open(os.path.join(dest, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(demo, "generation_config.json")) as f:
        generation = json.load(f)
    generation["eos_token_id"] = [1, ids["<|call|>"], ids["<|return|>"]]
    with open(os.path.join(dest, "generation_config.json"), "w") as f:
        json.dump(generation, f)
    return dest


class Harmony(unittest.TestCase):
    """tool_choice "required" and named with a model that writes gpt-oss's harmony format: the call
    comes as harmony writes calls, read by the harmony parser into tool_calls (whole and streamed),
    its arguments valid under the tool's schema, with the untrained demo weights."""

    @classmethod
    def setUpClass(cls):
        grpc_port, http_port = free_ports(2)
        cls.base = f"http://127.0.0.1:{http_port}"
        model = os.path.join(work_dir("shardserve-harmony-model-"), MODEL)  # served as MODEL
        os.mkdir(model)
        harmony_demo_model(model)
        cls.launch = start_launch(
            ["--model", model, "--address", f"127.0.0.1:{grpc_port}", "--http-port", str(http_port), "--nodes", "1",
             "--gpus-per-node", "1"], cls.base, work_dir("shardserve-harmony-"))
        cls.client = openai.OpenAI(base_url=cls.base + "/v1", api_key="unused", max_retries=0, timeout=120)

    @classmethod
    def tearDownClass(cls):
        stop_launch(cls.launch)

    def chat(self, **kw):
        return self.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, **kw)

    def test_forced_calls_are_written_and_read_as_harmony(self):
        by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for kw in (dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=1.0, seed=4)):
            for choice, names in (({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
                                  ("required", set(by_name))):
                r = self.chat(tools=TOOLS, tool_choice=choice, logprobs=True, **kw)
                c = r.choices[0]
                # harmony's layout, not the JSON array of the other formats
                tokens = [t.token for t in c.logprobs.content]
                self.assertEqual(tokens[0], "<|channel|>", tokens)
                self.assertIn("<|message|>", tokens)
                self.assertEqual(c.finish_reason, "tool_calls", c.message)
                self.assertIsNone(c.message.content)
                self.assertEqual(len(c.message.tool_calls), 1, c.message)
                call = c.message.tool_calls[0]
                self.assertIn(call.function.name, names)
                jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])
        # Streamed: the call begins once its header is complete, then its arguments.
        chunks = list(self.chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
                                temperature=0, stream=True))
        name, arguments = None, ""
        for ch in chunks:
            for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
                if tc.function.name:
                    self.assertIsNone(name, "a second call")
                    name = tc.function.name
                arguments += tc.function.arguments or ""
        self.assertEqual(name, "get_time")
        jsonschema.validate(json.loads(arguments), TIME_TOOL["function"]["parameters"])
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        self.assertEqual(finish, ["tool_calls"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", required=True)
    args, rest = parser.parse_known_args()
    openai_api_test.BIN = args.bin
    run_unittests([sys.argv[0]] + rest)
