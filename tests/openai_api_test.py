"""The OpenAI-compatible HTTP API (coordinator/api/openai) through the official `openai` Python client,
unchanged, against a real local cluster (`shardserve launch`: a coordinator and two worker
processes on 127.0.0.1, the embedded demo model, whose tokenizer_config.json has a chat template).

Checks chat and completions, streaming and not, usage, n, a batch of prompts, stop, logprobs, seeds, greedy output
equal to the gRPC API's for the same prompt ids, every error status (400 naming the field, 404,
413, 429, 503), and that a client that disconnects, mid-stream or while waiting for a whole
answer, has its request cancelled (its KV blocks freed, the request never finishing), and that one
keep-alive connection serves more than httplib's default 5 requests. logit_bias (+100 forces a token,
-100 bans one) and min_tokens in both APIs; the new fields' bounds; tool-call and reasoning parsing
(launched with --tool-call-parser llama3_json --reasoning-parser qwen3): the demo model writes no
tool call, so a forced '{' output checks that what is no call stays content (held back while it
might be one), a call a guided_regex makes it write streams its arguments in several deltas (tool_choice
auto), and a prompt that ends with <think> that the output comes as reasoning_content. Another, launched with
--tool-call-parser kimi_k2, returns a call with the id the model wrote; another serves a Kimi K2-shaped
checkpoint whose tokenizer is tiktoken.model (dummy weights), and another the same checkpoint with <think> and
</think> (and hermes' <tool_call> and </tool_call>) made special tokens, which the parsers still receive. A second, one-worker cluster on a test fixture
without tokenizer or chat template checks that chat is refused with a 400 saying so. Two more,
one speculating with the demo draft, give the same n = 2 seeded choices, streamed or not, with
logprobs and a stop string, and the same greedy chat. Always stops the clusters it started.

Run by CTest as: clients/python/setup-env.sh, then
    .venv-client/bin/python tests/openai_api_test.py --bin <build>/bin
"""
import argparse
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import unittest
import urllib.error
import urllib.request

from cli_check import free_ports, run_unittests, scaled, work_dir  # scaled: SHARDSERVE_TEST_TIME_SCALE
from launch_process import metric_sum  # noqa: E402 (tools/, on the path from cli_check)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))
sys.path.insert(0, os.path.join(ROOT, "clients", "python", "gen"))

import grpc  # noqa: E402
import openai  # noqa: E402
from shardserve_client import Client  # noqa: E402
from shardserve.v1 import inference_pb2  # noqa: E402

BIN = None  # set from --bin
MODEL = "demo"
MAX_NUM_SEQS = 4  # with --max-waiting-requests 0: n = 16 overflows the engine's queue (429)


def http_ok(base: str, path: str) -> bool:
    try:
        with urllib.request.urlopen(base + path, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start_launch(args, http_base: str, log_dir: str) -> subprocess.Popen:
    """`shardserve launch ARGS`, once it says it is ready (it then treats a lost worker as a heal,
    not as a cluster that failed to start) and its HTTP API answers /health with 200 (or raises,
    stopped). Its output goes to LOG_DIR/launch.out."""
    # launch's own state directory (its throw-away CA and cluster.json: grpc_client() reads them), so
    # that it never meets another test's.
    env = dict(os.environ, SHARDSERVE_STATE_DIR=os.path.join(log_dir, "state"))
    out_path = os.path.join(log_dir, "launch.out")
    with open(out_path, "w") as out:
        launch = subprocess.Popen([os.path.join(BIN, "shardserve"), "launch", "--metrics-port-base", "0",
                                   "--log-dir", log_dir] + args, env=env,
                                  stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    launch.out_path = out_path

    def ready():
        with open(out_path) as f:
            return "shardserve launch: ready" in f.read() and http_ok(http_base, "/health")

    deadline = time.monotonic() + scaled(120)
    while not ready():
        if launch.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"cluster did not become ready:\n{stop_launch(launch)}")
        time.sleep(0.25)
    return launch


def grpc_client(log_dir: str) -> Client:
    """A gRPC client of the cluster start_launch(..., log_dir) runs: mutual TLS with the
    certificates launch made (its cluster.json), as the shardserve commands connect."""
    with open(os.path.join(log_dir, "state", "cluster.json")) as f:
        c = json.load(f)
    return Client(c["address"], tls_ca=c["ca"], tls_cert=c["cert"], tls_key=c["key"])


def metrics_url(coordinator_log: str) -> str:
    """The coordinator's Prometheus address, as its log says it ("metrics on http://.../metrics")."""
    return re.search(r"metrics on (http://\S+/metrics)", coordinator_log).group(1)


def stop_launch(launch: subprocess.Popen) -> str:
    """SIGTERM (launch stops and reaps its processes), SIGKILL to the group past 30 s; its output
    (from start_launch's file, or from the pipe of a launch started with stdout=PIPE)."""
    if launch.poll() is None:
        launch.send_signal(signal.SIGTERM)
    try:
        out, _ = launch.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(launch.pid, signal.SIGKILL)
        out, _ = launch.communicate()
    if hasattr(launch, "out_path"):
        with open(launch.out_path) as f:
            out = f.read()
    return out or ""


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class OpenAIApiTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        grpc_port, cls.http_port = free_ports(2)
        cls.address = f"127.0.0.1:{grpc_port}"
        cls.base = f"http://127.0.0.1:{cls.http_port}"
        cls.launch = start_launch(
            ["--model", os.path.join(ROOT, "models", MODEL), "--nodes", "1", "--gpus-per-node", "2",
             "--address", cls.address, "--http-port", str(cls.http_port),
             "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", "0",
             # test_zz_lost_worker_is_503: no restart, so that a lost worker's heal times out.
             "--max-worker-restarts", "0", "--heal-timeout-seconds", "2",
             # The demo template writes neither tool calls nor <think>: the parsers are named
             # (they act only on chat requests with tools, and on outputs that open <think>).
             "--tool-call-parser", "llama3_json", "--reasoning-parser", "qwen3"],
            cls.base, work_dir("shardserve-openai-"))
        try:  # tearDownClass does not run when setUpClass fails
            cls.grpc = grpc_client(cls.launch.args[cls.launch.args.index("--log-dir") + 1])
            with open(os.path.join(cls.launch.args[cls.launch.args.index("--log-dir") + 1], "coordinator.log")) as f:
                cls.metrics_url = metrics_url(f.read())
        except BaseException:
            stop_launch(cls.launch)
            raise
        # No retries: a test must see the first answer (the client retries 429 and 5xx by default).
        cls.client = openai.OpenAI(base_url=cls.base + "/v1", api_key="unused", max_retries=0, timeout=120)

    @classmethod
    def tearDownClass(cls):
        stop_launch(cls.launch)
        assert cls.launch.returncode is not None

    def http_ok(self, path: str) -> bool:
        return http_ok(self.base, path)

    # ---- helpers ----
    def post_raw(self, path: str, body: bytes, headers=None):
        """(status, parsed JSON body) of a POST with `body` as it is, and `headers` besides Content-Type."""
        req = urllib.request.Request(self.base + path, data=body,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def metric(self, name: str, **labels) -> float:
        """The sum of the coordinator's series `name` whose labels include `labels`."""
        with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
            return metric_sum(r.read().decode(), name, **labels)

    def scheduler(self):
        return self.grpc._stub.GetClusterStatus(inference_pb2.GetClusterStatusRequest(), timeout=10).scheduler

    def grpc_greedy_ids(self, prompt_ids, max_tokens):
        request = inference_pb2.GenerateRequest(
            token_ids=inference_pb2.TokenIds(ids=prompt_ids),
            sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=0))
        text, ids = "", []
        for msg in self.grpc._stub.Generate(request, timeout=120):
            text += msg.text
            ids += list(msg.token_ids)
        return text, ids

    def chat_prompt_ids(self, messages):
        # The demo model's template (models/demo/tokenizer_config.json), rendered by hand: BOS once.
        text = "<|begin_of_text|>" + "".join(f"{m['role'].capitalize()}: {m['content'].strip()}\n\n"
                                             for m in messages) + "Assistant:"
        return self.grpc.tokenize(text, add_special_tokens=False)

    # ---- endpoints ----
    def test_models_and_health(self):
        models = self.client.models.list()
        self.assertEqual([m.id for m in models.data], [MODEL])
        self.assertTrue(self.http_ok("/health"))
        # The release, as `shardserve --version` says it: GET /version and the build_info metric.
        version = subprocess.run([os.path.join(BIN, "shardserve"), "--version"], capture_output=True, text=True,
                                 check=True, timeout=30).stdout.split()
        self.assertEqual(version[0], "shardserve")
        self.assertRegex(version[1], r"^\d+\.\d+\.\d+$")
        with urllib.request.urlopen(self.base + "/version", timeout=10) as r:
            self.assertEqual(json.loads(r.read()), {"version": version[1]})
        self.assertEqual(self.metric("shardserve_build_info", version=version[1]), 1)
        # Retrieve: the served model's object, as the list has it; another name is 404 naming both.
        model = self.client.models.retrieve(MODEL)
        self.assertEqual(model.id, MODEL)
        self.assertEqual(model.model_dump(), models.data[0].model_dump())
        with self.assertRaises(openai.NotFoundError) as ctx:
            self.client.models.retrieve("gpt-4")
        self.assertIn("'gpt-4' is not served here; this server serves 'demo'", ctx.exception.message)
        self.assertEqual(ctx.exception.body["param"], "model")
        self.assertGreaterEqual(self.metric("shardserve_http_requests_total", endpoint="/v1/models/{model}",
                                            status="404"), 1)

    def test_keep_alive_connection_serves_many_requests(self):
        # A long-lived client's connection is not closed every fifth request (httplib 0.11.4's
        # default keep-alive count): streamed completions and model lists, one connection.
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=60)
        try:
            body = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, "stream": True})
            for i in range(12):
                if i % 2:
                    conn.request("GET", "/v1/models")
                else:
                    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                r = conn.getresponse()
                data = r.read().decode()
                self.assertEqual(r.status, 200, data)
                self.assertFalse(r.will_close, f"request {i + 1}: the server closed the connection "
                                                f"(Connection: {r.getheader('Connection')})")
                if i % 2 == 0:
                    self.assertTrue(data.rstrip().endswith("data: [DONE]"), data)
        finally:
            conn.close()

    def test_completion_equals_grpc_for_the_same_prompt_ids(self):
        ids = self.grpc.tokenize("And God said")
        want_text, want_ids = self.grpc_greedy_ids(ids, 24)
        r = self.client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0)
        self.assertEqual(r.object, "text_completion")
        self.assertEqual(r.choices[0].text, want_text)
        self.assertTrue(want_text.strip())
        self.assertEqual(r.usage.prompt_tokens, len(ids))
        self.assertEqual(r.usage.completion_tokens, len(want_ids))
        self.assertEqual(r.usage.total_tokens, len(ids) + len(want_ids))
        self.assertEqual(r.usage.prompt_tokens_details.cached_tokens, 0)
        self.assertEqual(r.choices[0].finish_reason, "length" if len(want_ids) == 24 else "stop")
        # The same prompt as text: the server tokenizes it as the gRPC API does (with BOS).
        t = self.client.completions.create(model=MODEL, prompt="And God said", max_tokens=24, temperature=0)
        self.assertEqual(t.choices[0].text, want_text)
        self.assertEqual(t.usage.prompt_tokens, len(ids))

    def test_completion_streams(self):
        ids = self.grpc.tokenize("In the beginning")
        want_text, want_ids = self.grpc_greedy_ids(ids, 16)
        chunks = list(self.client.completions.create(model=MODEL, prompt="In the beginning", max_tokens=16,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        self.assertGreater(len(chunks), 2)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        self.assertEqual(text, want_text)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        self.assertEqual(finishes, ["length" if len(want_ids) == 16 else "stop"])
        self.assertEqual(chunks[-1].choices, [])  # include_usage: the usage chunk comes last
        self.assertEqual(chunks[-1].usage.completion_tokens, len(want_ids))
        self.assertEqual(chunks[-1].usage.prompt_tokens, len(ids))
        self.assertTrue(all(c.usage is None for c in chunks[:-1]))
        # vLLM's continuous_usage_stats: every chunk has its choice's usage so far, the last the whole.
        chunks = list(self.client.completions.create(
            model=MODEL, prompt="In the beginning", max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True}))
        counts = [c.usage.completion_tokens for c in chunks]
        self.assertEqual(counts, sorted(counts))
        self.assertEqual(counts[-1], len(want_ids))
        self.assertTrue(all(c.usage.prompt_tokens == len(ids) for c in chunks))
        self.assertEqual(chunks[-2].usage.completion_tokens, len(want_ids))  # the finishing chunk's

    def test_chat_equals_grpc_for_the_rendered_prompt(self):
        messages = [{"role": "system", "content": "You are a scribe."},
                    {"role": "user", "content": "Who made the heaven and the earth?"}]
        ids = self.chat_prompt_ids(messages)
        self.assertEqual(ids.count(0), 1, "BOS once: from the template, not added again")
        want_text, want_ids = self.grpc_greedy_ids(ids, 20)
        r = self.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
        self.assertEqual(r.object, "chat.completion")
        self.assertEqual(r.choices[0].message.role, "assistant")
        self.assertEqual(r.choices[0].message.content, want_text)
        self.assertEqual(r.usage.prompt_tokens, len(ids))
        self.assertEqual(r.usage.completion_tokens, len(want_ids))
        # Streaming: the role first, then the same text; max_completion_tokens as max_tokens.
        chunks = list(self.client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20,
                                                          temperature=0, stream=True))
        self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
        self.assertEqual("".join(c.choices[0].delta.content or "" for c in chunks), want_text)
        self.assertEqual(chunks[-1].choices[0].finish_reason, r.choices[0].finish_reason)
        self.assertTrue(all(c.usage is None for c in chunks))  # no include_usage: no usage chunk

    def test_chat_without_max_tokens_runs_to_eos_or_the_context(self):
        r = self.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                temperature=0, stop=["\n"])
        self.assertIn(r.choices[0].finish_reason, ("stop", "length"))
        self.assertNotIn("\n", r.choices[0].message.content)

    def test_stop_string(self):
        full = self.client.completions.create(model=MODEL, prompt="And God said", max_tokens=24, temperature=0)
        text = full.choices[0].text
        stop = text[6:10]  # a piece of the greedy text, past its start
        want = text[:text.find(stop)]
        for stops in (stop, [stop, "never-seen"]):
            r = self.client.completions.create(model=MODEL, prompt="And God said", max_tokens=24, temperature=0,
                                               stop=stops)
            self.assertEqual(r.choices[0].text, want)
            self.assertEqual(r.choices[0].finish_reason, "stop")
        # vLLM's include_stop_str_in_output: the text ends where the stop string ends, whole or streamed.
        kept = text[:text.find(stop) + len(stop)]
        kw = dict(model=MODEL, prompt="And God said", max_tokens=24, temperature=0, stop=stop,
                  extra_body={"include_stop_str_in_output": True})
        r = self.client.completions.create(**kw)
        self.assertEqual((r.choices[0].text, r.choices[0].finish_reason), (kept, "stop"))
        self.assertEqual("".join(c.choices[0].text for c in self.client.completions.create(stream=True, **kw)), kept)

    def test_output_controls_as_vllm_has_them(self):
        # truncate_prompt_tokens: a prompt longer than the context keeps its end, and is answered as
        # that end alone would be.
        kw = dict(model=MODEL, max_tokens=6, temperature=0)
        short = self.client.completions.create(prompt=[5] * 100, **kw)
        r = self.client.completions.create(prompt=[5] * 600, extra_body={"truncate_prompt_tokens": 100}, **kw)
        self.assertEqual(r.usage.prompt_tokens, 100)
        self.assertEqual(r.choices[0].text, short.choices[0].text)
        # With echo, the tokens kept are echoed (as vLLM does), text prompts too.
        r = self.client.completions.create(prompt=[5] * 600, echo=True, extra_body={"truncate_prompt_tokens": 100}, **kw)
        echoed = self.client.completions.create(prompt=[5] * 100, echo=True, **kw)
        self.assertEqual(r.choices[0].text, echoed.choices[0].text)
        words = " ".join(["light"] * 300)
        r = self.client.completions.create(prompt=words, echo=True, extra_body={"truncate_prompt_tokens": 10}, **kw)
        self.assertLess(len(r.choices[0].text), len(words))
        self.assertTrue(r.choices[0].text.startswith(" light light"), r.choices[0].text)  # 10 tokens of the middle
        # skip_special_tokens false: BOS stays in the text (here, the echoed prompt's).
        ids = self.grpc.tokenize("And God said")
        r = self.client.completions.create(prompt=ids, echo=True, extra_body={"skip_special_tokens": False}, **kw)
        self.assertTrue(r.choices[0].text.startswith("<|begin_of_text|>And God said"), r.choices[0].text)
        with self.assertRaises(openai.BadRequestError) as ctx:
            self.client.completions.create(prompt="x", extra_body={"truncate_prompt_tokens": -1}, **kw)
        self.assertEqual(ctx.exception.param, "truncate_prompt_tokens")

    def test_n_choices_and_seeds(self):
        kw = dict(model=MODEL, prompt="In the beginning", max_tokens=12, temperature=0.9)
        one = self.client.completions.create(n=1, seed=7, **kw)
        two = self.client.completions.create(n=2, seed=7, **kw)
        again = self.client.completions.create(n=2, seed=7, **kw)
        self.assertEqual([c.index for c in two.choices], [0, 1])
        # Choice 0 uses the seed itself, choice 1 one derived from it: reproducible, each its own.
        self.assertEqual(two.choices[0].text, one.choices[0].text)
        self.assertEqual([c.text for c in two.choices], [c.text for c in again.choices])
        # usage counts every choice's tokens (logprobs=0: one entry per token, no alternatives).
        counted = self.client.completions.create(n=2, seed=7, logprobs=0, **kw)
        self.assertEqual([c.text for c in counted.choices], [c.text for c in two.choices])
        self.assertEqual(counted.usage.completion_tokens, sum(len(c.logprobs.tokens) for c in counted.choices))
        chat = [self.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Sing"}], max_tokens=10, temperature=1.0, seed=11)
            .choices[0].message.content for _ in range(2)]
        self.assertEqual(chat[0], chat[1])
        # Streaming with n = 2: every chunk names its choice; each choice finishes once.
        chunks = list(self.client.completions.create(n=2, seed=7, stream=True, **kw))
        texts = {0: "", 1: ""}
        finished = []
        for c in chunks:
            texts[c.choices[0].index] += c.choices[0].text
            if c.choices[0].finish_reason:
                finished.append(c.choices[0].index)
        self.assertEqual(sorted(finished), [0, 1])
        self.assertEqual([texts[0], texts[1]], [c.text for c in two.choices])

    def test_a_batch_of_prompts_answers_each_as_alone(self):
        # --max-num-seqs 4 and no waiting: the 4 choices below fit only in an idle engine.
        wait_until(lambda: self.scheduler().running == 0 and self.scheduler().waiting == 0, 60, "an idle engine")
        ids = self.grpc.tokenize("And God said")
        want = [self.grpc_greedy_ids(self.grpc.tokenize("In the beginning"), 12), self.grpc_greedy_ids(ids, 12)]
        # Strings and token id lists mixed; prompt p's choice i is choice p * n + i.
        r = self.client.completions.create(model=MODEL, prompt=["In the beginning", ids], max_tokens=12,
                                           temperature=0)
        self.assertEqual([c.index for c in r.choices], [0, 1])
        self.assertEqual([c.text for c in r.choices], [text for text, _ in want])
        self.assertEqual(r.usage.prompt_tokens, len(self.grpc.tokenize("In the beginning")) + len(ids))
        self.assertEqual(r.usage.completion_tokens, sum(len(got) for _, got in want))
        # Seeded, n = 2: each prompt's choices are those it gets alone.
        kw = dict(model=MODEL, max_tokens=8, temperature=0.9, seed=7, n=2)
        prompts = ["In the beginning", "And God said"]
        alone = [[c.text for c in self.client.completions.create(prompt=p, **kw).choices] for p in prompts]
        batch = self.client.completions.create(prompt=prompts, **kw)
        self.assertEqual([c.index for c in batch.choices], [0, 1, 2, 3])
        self.assertEqual([c.text for c in batch.choices], alone[0] + alone[1])
        # Streamed: every chunk names its choice, each choice finishes once, with the same text.
        texts, finished = [""] * 4, []
        for c in self.client.completions.create(prompt=prompts, stream=True, **kw):
            texts[c.choices[0].index] += c.choices[0].text
            if c.choices[0].finish_reason:
                finished.append(c.choices[0].index)
        self.assertEqual(sorted(finished), [0, 1, 2, 3])
        self.assertEqual(texts, alone[0] + alone[1])
        # An error in one prompt names it, and nothing of the batch runs.
        status, body = self.post_raw("/v1/completions", json.dumps(
            {"model": MODEL, "prompt": ["x", [1, 999999]], "max_tokens": 2}).encode())
        self.assertEqual(status, 400, body)
        self.assertEqual(body["error"]["param"], "prompt[1][1]", body)
        self.assertTrue(body["error"]["message"].startswith("prompt[1][1]: "), body)

    def test_logprobs(self):
        r = self.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
        content = r.choices[0].logprobs.content
        self.assertEqual(len(content), r.usage.completion_tokens)
        self.assertEqual("".join(t.token for t in content), r.choices[0].message.content)
        for t in content:
            self.assertLessEqual(t.logprob, 0)
            self.assertEqual(len(t.top_logprobs), 3)
            # Greedy: the chosen token is the most likely one.
            self.assertEqual(t.top_logprobs[0].token, t.token)
            self.assertAlmostEqual(t.top_logprobs[0].logprob, t.logprob, places=5)
            self.assertEqual(bytes(t.bytes).decode(), t.token)
        c = self.client.completions.create(model=MODEL, prompt="And God said", max_tokens=8, temperature=0,
                                           logprobs=2)
        lp = c.choices[0].logprobs
        self.assertEqual(len(lp.tokens), c.usage.completion_tokens)
        self.assertEqual("".join(lp.tokens), c.choices[0].text)
        self.assertEqual(len(lp.token_logprobs), len(lp.tokens))
        self.assertTrue(all(len(alt) == 2 for alt in lp.top_logprobs))
        self.assertEqual(lp.text_offset[0], 0)
        self.assertEqual(lp.text_offset[1], len(lp.tokens[0].encode()))
        plain = self.client.completions.create(model=MODEL, prompt="And God said", max_tokens=8, temperature=0)
        self.assertIsNone(plain.choices[0].logprobs)
        # vLLM's return_tokens_as_token_ids: the generated ids themselves, as the gRPC API gives them.
        _, want_ids = self.grpc_greedy_ids(self.grpc.tokenize("And God said"), 8)
        c = self.client.completions.create(model=MODEL, prompt="And God said", max_tokens=8, temperature=0,
                                           logprobs=1, extra_body={"return_tokens_as_token_ids": True})
        self.assertEqual(c.choices[0].logprobs.tokens, [f"token_id:{i}" for i in want_ids])
        self.assertEqual(c.choices[0].logprobs.text_offset[1], len(lp.tokens[0].encode()))  # offsets in text
        r = self.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=8, temperature=0, logprobs=True,
                                                extra_body={"return_tokens_as_token_ids": True})
        self.assertTrue(all(re.fullmatch(r"token_id:\d+", t.token) for t in r.choices[0].logprobs.content))
        self.assertEqual(b"".join(bytes(t.bytes) for t in r.choices[0].logprobs.content).decode(),
                         r.choices[0].message.content)

    def test_continue_final_message_extends_the_answer_begun(self):
        # The demo template trims each message: the prompt ends at the begun answer's last letter.
        messages = [{"role": "user", "content": "Tell a story."}, {"role": "assistant", "content": "Once upon a "}]
        ids = self.grpc.tokenize("<|begin_of_text|>User: Tell a story.\n\nAssistant: Once upon a",
                                 add_special_tokens=False)
        text, _ = self.grpc_greedy_ids(ids, 12)
        r = self.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                extra_body={"continue_final_message": True,
                                                            "add_generation_prompt": False})
        self.assertEqual(r.usage.prompt_tokens, len(ids))
        self.assertEqual(r.choices[0].message.content, text)
        with self.assertRaises(openai.BadRequestError) as ctx:
            self.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                                extra_body={"continue_final_message": True,
                                                            "add_generation_prompt": True})
        self.assertEqual(ctx.exception.body["param"], "continue_final_message")

    def test_echo_begins_each_choice_with_the_prompt(self):
        kw = dict(model=MODEL, max_tokens=8, temperature=0)
        plain = self.client.completions.create(prompt="And God said", **kw)
        r = self.client.completions.create(prompt="And God said", echo=True, **kw)
        self.assertEqual(r.choices[0].text, "And God said" + plain.choices[0].text)
        self.assertEqual((r.usage.prompt_tokens, r.usage.completion_tokens),
                         (plain.usage.prompt_tokens, plain.usage.completion_tokens))
        ids = self.grpc.tokenize("And God said")  # BOS first: decoded without it, as the output is
        r = self.client.completions.create(prompt=[ids, "In the"], echo=True, **kw)
        self.assertEqual(r.choices[0].text, "And God said" + plain.choices[0].text)
        self.assertTrue(r.choices[1].text.startswith("In the"), r.choices[1].text)
        chunks = list(self.client.completions.create(prompt="And God said", echo=True, stream=True, **kw))
        self.assertEqual(chunks[0].choices[0].text, "And God said")
        self.assertEqual("".join(c.choices[0].text for c in chunks), "And God said" + plain.choices[0].text)
        # Chat: the answer begun (continue_final_message) and its continuation, whole and streamed.
        messages = [{"role": "user", "content": "Tell a story."}, {"role": "assistant", "content": "Once upon a"}]
        extra = {"continue_final_message": True, "add_generation_prompt": False}
        cont = self.client.chat.completions.create(messages=messages, extra_body=extra, **kw)
        r = self.client.chat.completions.create(messages=messages, extra_body=dict(extra, echo=True), **kw)
        self.assertEqual(r.choices[0].message.content, "Once upon a" + cont.choices[0].message.content)
        chunks = list(self.client.chat.completions.create(messages=messages, extra_body=dict(extra, echo=True),
                                                          stream=True, **kw))
        self.assertEqual(chunks[1].choices[0].delta.content, "Once upon a")
        self.assertEqual("".join(c.choices[0].delta.content or "" for c in chunks), r.choices[0].message.content)
        # A new answer after a user's message echoes nothing.
        r = self.client.chat.completions.create(messages=messages[:1], extra_body={"echo": True}, **kw)
        plain = self.client.chat.completions.create(messages=messages[:1], **kw)
        self.assertEqual(r.choices[0].message.content, plain.choices[0].message.content)

    def test_prompt_logprobs(self):
        # lm-evaluation-harness's loglikelihood: echo with logprobs and max_tokens 1. The prompt's
        # tokens come first (the first with nothing to be predicted from: null), then the output's.
        ids = self.grpc.tokenize("And God said, Let there be light: and there was light")
        kw = dict(model=MODEL, max_tokens=1, temperature=0)
        r = self.client.completions.create(prompt=ids, echo=True, logprobs=1, **kw)
        lp = r.choices[0].logprobs
        self.assertEqual(len(lp.tokens), len(ids) + 1)
        self.assertEqual(len(lp.token_logprobs), len(ids) + 1)
        self.assertIsNone(lp.token_logprobs[0])
        self.assertIsNone(lp.top_logprobs[0])
        self.assertEqual(lp.text_offset[0], 0)
        self.assertEqual(lp.text_offset, sorted(lp.text_offset))
        prompt_lp = r.model_dump()["choices"][0]["prompt_logprobs"]  # vLLM's field, there too
        self.assertEqual(len(prompt_lp), len(ids))
        self.assertIsNone(prompt_lp[0])
        for k in (1, 4, len(ids) - 1):
            # The same number by another path: the prefix decoded one token, forced to the prompt's
            # next by logit_bias (logprobs are the raw logits'), its logprob reported as sampled.
            forced = self.client.completions.create(prompt=ids[:k], logprobs=1, logit_bias={str(ids[k]): 100}, **kw)
            self.assertEqual(forced.choices[0].logprobs.tokens[0], lp.tokens[k])
            self.assertAlmostEqual(forced.choices[0].logprobs.token_logprobs[0], lp.token_logprobs[k], delta=1e-4)
            entry = prompt_lp[k][str(ids[k])]
            self.assertAlmostEqual(entry["logprob"], lp.token_logprobs[k], places=5)
            self.assertGreaterEqual(entry["rank"], 1)
            # The most likely alternative there is the prefix's greedy token.
            greedy = self.client.completions.create(prompt=ids[:k], logprobs=1, **kw)
            self.assertEqual(list(lp.top_logprobs[k]), [greedy.choices[0].logprobs.tokens[0]])
        # Chat: vLLM's prompt_logprobs beside the choices, one per prompt token.
        c = self.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=2, extra_body={"prompt_logprobs": 2})
        chat_lp = c.model_dump()["prompt_logprobs"]
        self.assertEqual(len(chat_lp), c.usage.prompt_tokens)
        self.assertTrue(all(len(p) in (2, 3) for p in chat_lp[1:]), chat_lp[1:])
        self.assertTrue(all(any(v["rank"] == 1 for v in p.values()) for p in chat_lp[1:]))
        c = self.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                                extra_body={"prompt_logprobs": 0, "return_tokens_as_token_ids": True})
        named = [(key, value["decoded_token"]) for p in c.model_dump()["prompt_logprobs"][1:] for key, value in p.items()]
        self.assertEqual([token for _, token in named], [f"token_id:{key}" for key, _ in named])
        with self.assertRaises(openai.BadRequestError) as ctx:  # a whole answer only
            self.client.completions.create(prompt="x", echo=True, logprobs=1, stream=True, **kw)
        self.assertEqual(ctx.exception.param, "echo")
        with self.assertRaises(openai.BadRequestError) as ctx:
            self.client.completions.create(prompt="x", extra_body={"prompt_logprobs": 21}, **kw)
        self.assertEqual(ctx.exception.param, "prompt_logprobs")

    def test_allowed_token_ids_and_bad_words(self):
        # vLLM's allowed_token_ids: only those ids come, here the greedy answer's 3rd to 6th ids (so
        # that its first ids are out of reach), on both routes and the gRPC API.
        prompt = self.grpc.tokenize("And God said")
        _, greedy = self.grpc_greedy_ids(prompt, 12)
        allowed = sorted(set(greedy[2:6]))
        kw = dict(model=MODEL, prompt="And God said", max_tokens=12, temperature=0.8, seed=3, logprobs=0,
                  extra_body={"return_tokens_as_token_ids": True, "allowed_token_ids": allowed})
        r = self.client.completions.create(**kw)
        got = [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]
        self.assertTrue(got and set(got) <= set(allowed), (got, allowed))
        c = self.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                                logprobs=True, extra_body={"return_tokens_as_token_ids": True,
                                                                           "allowed_token_ids": allowed})
        self.assertTrue(all(int(t.token.split(":")[1]) in allowed for t in c.choices[0].logprobs.content))
        request = inference_pb2.GenerateRequest(
            token_ids=inference_pb2.TokenIds(ids=prompt),
            sampling=inference_pb2.SamplingParams(max_tokens=8, temperature=0, allowed_token_ids=allowed))
        ids = [i for msg in self.grpc._stub.Generate(request, timeout=120) for i in msg.token_ids]
        self.assertTrue(ids and set(ids) <= set(allowed), (ids, allowed))
        # bad_words: a word of the greedy answer never comes again, as a whole word in the text.
        text = self.client.completions.create(model=MODEL, prompt="And God said", max_tokens=24, temperature=0)
        words = re.findall(r"[A-Za-z]+", text.choices[0].text)
        self.assertTrue(words, text.choices[0].text)
        word = max(words, key=len)
        r = self.client.completions.create(model=MODEL, prompt="And God said", max_tokens=24, temperature=0,
                                           extra_body={"bad_words": [word]})
        self.assertNotIn(word, re.findall(r"[A-Za-z]+", r.choices[0].text), r.choices[0].text)
        self.assertNotEqual(r.choices[0].text, text.choices[0].text)
        many = self.client.completions.create(model=MODEL, prompt="x", max_tokens=2,  # each word two ways
                                              extra_body={"bad_words": [f"word{i}" for i in range(64)]})
        self.assertEqual(many.usage.completion_tokens, 2)
        with self.assertRaises(openai.BadRequestError) as ctx:
            self.client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"allowed_token_ids": [-1]})
        self.assertEqual(ctx.exception.param, "allowed_token_ids[0]")
        with self.assertRaises(openai.BadRequestError) as ctx:
            self.client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"bad_words": ["a", ""]})
        self.assertEqual(ctx.exception.param, "bad_words[1]")

    def test_responses_api(self):
        # /v1/responses answers as chat completions do, in the Responses API's shape: instructions
        # a system message, the input's items the messages, output items the answer's parts.
        def respond(**body):
            return self.post_raw("/v1/responses", json.dumps(dict(model=MODEL, **body)).encode())

        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who made the heaven?"}]
        chat = self.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
        status, r = respond(instructions="Be brief.", input="Who made the heaven?", max_output_tokens=12, temperature=0)
        self.assertEqual(status, 200, r)
        self.assertEqual((r["object"], r["status"]), ("response", "incomplete"))
        self.assertEqual(r["incomplete_details"], {"reason": "max_output_tokens"})
        self.assertTrue(r["id"].startswith("resp_"), r["id"])
        [message] = [item for item in r["output"] if item["type"] == "message"]
        self.assertEqual(message["content"][0]["type"], "output_text")
        self.assertEqual(message["content"][0]["text"], chat.choices[0].message.content)
        self.assertEqual(r["usage"]["input_tokens"], chat.usage.prompt_tokens)
        self.assertEqual(r["usage"]["output_tokens"], 12)
        # Items: a message with content parts, as the same conversation.
        status, items = respond(input=[{"type": "message", "role": "developer", "content": "Be brief."},
                                       {"role": "user", "content": [{"type": "input_text", "text": "Who made "},
                                                                    {"type": "input_text", "text": "the heaven?"}]}],
                                max_output_tokens=12, temperature=0)
        self.assertEqual(status, 200, items)
        self.assertEqual([item["content"] for item in items["output"]], [item["content"] for item in r["output"]])
        # A function call and its output in the input are the chat API's tool call and tool message;
        # a forced call comes back as a function_call item.
        tool = {"type": "function", "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}
        status, called = respond(input="Weather in Paris?", tools=[tool], tool_choice="required", parallel_tool_calls=False,
                                 max_output_tokens=60, temperature=0)
        self.assertEqual(status, 200, called)
        calls = [item for item in called["output"] if item["type"] == "function_call"]
        self.assertEqual(len(calls), 1, called)
        call = calls[0]
        self.assertEqual(call["name"], "get_weather")
        self.assertIn("city", json.loads(call["arguments"]))
        status, after = respond(input=["Weather in Paris?", call, {"type": "function_call_output",
                                                                   "call_id": call["call_id"], "output": "Sunny"}],
                                tools=[tool], max_output_tokens=8, temperature=0)
        self.assertEqual(status, 400, after)  # the input string among items is no item
        status, after = respond(input=[{"role": "user", "content": "Weather in Paris?"}, call,
                                       {"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny"}],
                                tools=[tool], max_output_tokens=8, temperature=0)
        self.assertEqual(status, 200, after)
        self.assertGreater(after["usage"]["input_tokens"], called["usage"]["input_tokens"])
        # text.format json_schema constrains the output, as response_format does.
        schema = {"type": "object", "properties": {"light": {"type": "boolean"}}, "required": ["light"],
                  "additionalProperties": False}
        status, structured = respond(input="Was there light?", max_output_tokens=40, temperature=0,
                                     text={"format": {"type": "json_schema", "name": "light", "schema": schema}})
        self.assertEqual(status, 200, structured)
        [message] = [item for item in structured["output"] if item["type"] == "message"]
        self.assertIsInstance(json.loads(message["content"][0]["text"])["light"], bool)
        # Streamed: the Responses API's events, in order, whose deltas make the whole answer's.
        def stream(**body):
            req = urllib.request.Request(self.base + "/v1/responses", data=json.dumps(dict(model=MODEL, stream=True, **body)).encode(),
                                         headers={"Content-Type": "application/json"})
            events = []
            with urllib.request.urlopen(req, timeout=60) as response:
                for block in response.read().decode().split("\n\n"):
                    if block.strip():
                        kind, data = block.split("\n", 1)
                        event = json.loads(data[len("data: "):])
                        self.assertEqual(kind, "event: " + event["type"])
                        events.append(event)
            self.assertEqual([e["sequence_number"] for e in events], list(range(len(events))))
            return events

        events = stream(instructions="Be brief.", input="Who made the heaven?", max_output_tokens=12, temperature=0)
        types = [e["type"] for e in events]
        self.assertEqual(types[:4], ["response.created", "response.in_progress", "response.output_item.added",
                                     "response.content_part.added"])
        self.assertEqual(types[-4:], ["response.output_text.done", "response.content_part.done",
                                      "response.output_item.done", "response.incomplete"])
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        self.assertEqual(text, chat.choices[0].message.content)
        final = events[-1]["response"]
        self.assertEqual([item["content"] for item in final["output"]], [item["content"] for item in r["output"]])
        self.assertEqual(final["usage"]["output_tokens"], 12)
        events = stream(input="Weather in Paris?", tools=[tool], tool_choice="required", parallel_tool_calls=False,
                        max_output_tokens=60, temperature=0)
        added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
        self.assertEqual([item["type"] for item in added], ["function_call"])
        arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
        self.assertEqual(arguments, call["arguments"])
        self.assertEqual(events[-1]["type"], "response.completed")
        self.assertEqual(events[-1]["response"]["output"][0]["arguments"], call["arguments"])
        # The official client reads both: its typed Response (output_text), and its stream helper,
        # which checks the events' order and assembles the Response from them.
        sdk = self.client.responses.create(model=MODEL, instructions="Be brief.", input="Who made the heaven?",
                                           max_output_tokens=12, temperature=0)
        self.assertEqual((sdk.status, sdk.output_text), ("incomplete", chat.choices[0].message.content))
        with self.client.responses.stream(model=MODEL, input="Weather in Paris?", tools=[tool], tool_choice="required",
                                          parallel_tool_calls=False, max_output_tokens=60, temperature=0) as streamed:
            kinds = {event.type for event in streamed}
            assembled = streamed.get_final_response()
        self.assertIn("response.function_call_arguments.delta", kinds)
        self.assertEqual([(item.type, item.name, item.arguments) for item in assembled.output],
                         [("function_call", "get_weather", call["arguments"])])
        # include's message.output_text.logprobs (and top_logprobs) give the chat API's logprobs.
        chat = self.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                                   logprobs=True, top_logprobs=2)
        scored = self.client.responses.create(model=MODEL, instructions="Be brief.", input="Who made the heaven?",
                                              max_output_tokens=4, temperature=0, top_logprobs=2,
                                              include=["message.output_text.logprobs"])
        part = [item for item in scored.output if item.type == "message"][0].content[0]
        self.assertEqual([(t.token, round(t.logprob, 4), [a.token for a in t.top_logprobs]) for t in part.logprobs],
                         [(t.token, round(t.logprob, 4), [a.token for a in t.top_logprobs])
                          for t in chat.choices[0].logprobs.content])
        # reasoning.effort is the chat API's reasoning_effort (the template's variable).
        status, effort = respond(input="x", max_output_tokens=2, reasoning={"effort": "high"})
        self.assertEqual((status, effort["reasoning"]["effort"]), (200, "high"), effort)
        # Refusals name the Responses API's fields.
        for body, param in [(dict(input="x", previous_response_id="resp_1"), "previous_response_id"),
                            (dict(input="x", reasoning={"effort": "extreme"}), "reasoning.effort"),
                            (dict(input="x", max_output_tokens=-1), "max_output_tokens"),
                            (dict(input=[{"type": "input_image", "image_url": "x"}]), "input[0].type"),
                            (dict(input="x", tools=[{"type": "web_search"}]), "tools[0].type"),
                            (dict(), "input")]:
            status, error = respond(**body)
            self.assertEqual(status, 400, (body, error))
            self.assertEqual(error["error"]["param"], param, (body, error))
        self.assertGreater(self.metric("shardserve_http_requests_total", endpoint="/v1/responses", status="200"), 0)

    def test_stored_responses(self):
        # store (OpenAI's default) keeps a Response: retrieved, its input items listed, continued
        # with previous_response_id as the same conversation sent whole, and deleted.
        first = self.client.responses.create(model=MODEL, instructions="Be brief.", input="Who made the heaven?",
                                             max_output_tokens=8, temperature=0)
        self.assertTrue(first.store)
        self.assertEqual(self.client.responses.retrieve(first.id).model_dump(), first.model_dump())
        listed = self.client.responses.input_items.list(first.id)
        self.assertEqual([(item.type, item.role, item.content[0].text) for item in listed.data],
                         [("message", "user", "Who made the heaven?")])
        # Continued: the earlier input and output are read before the new input; the instructions are
        # the new request's (OpenAI's rule: they are not carried over).
        second = self.client.responses.create(model=MODEL, previous_response_id=first.id, input="And the earth?",
                                              max_output_tokens=8, temperature=0)
        self.assertEqual(second.previous_response_id, first.id)
        whole = self.client.responses.create(
            model=MODEL, store=False, max_output_tokens=8, temperature=0,
            input=[{"role": "user", "content": "Who made the heaven?"},
                   {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And the earth?"}])
        self.assertFalse(whole.store)
        self.assertEqual((second.output_text, second.usage.input_tokens), (whole.output_text, whole.usage.input_tokens))
        with self.assertRaises(openai.NotFoundError):
            self.client.responses.retrieve(whole.id)  # store: false
        # A stream is stored once whole, as its last event (here response.incomplete) has it.
        with self.client.responses.stream(model=MODEL, previous_response_id=second.id, input="And the light?",
                                          max_output_tokens=6, temperature=0) as streamed:
            last = list(streamed)[-1]
        self.assertEqual(last.type, "response.incomplete")
        final = last.response
        self.assertEqual(self.client.responses.retrieve(final.id).model_dump(), final.model_dump())
        # Input items page as OpenAI's: newest first by default, `after` the cursor (the client follows it).
        items = [{"role": "user", "content": f"Line {i}"} for i in range(3)]
        third = self.client.responses.create(model=MODEL, input=items, max_output_tokens=2, temperature=0)
        page = self.client.responses.input_items.list(third.id, limit=2)
        self.assertEqual([item.content[0].text for item in page.data], ["Line 2", "Line 1"])
        self.assertTrue(page.has_more)
        every = self.client.responses.input_items.list(third.id, limit=2, order="asc")
        self.assertEqual([item.content[0].text for item in every], ["Line 0", "Line 1", "Line 2"])
        req = urllib.request.Request(f"{self.base}/v1/responses/{third.id}/input_items?limit=0")
        with self.assertRaises(urllib.error.HTTPError) as ctx:
            urllib.request.urlopen(req, timeout=10)
        self.assertEqual((ctx.exception.code, json.loads(ctx.exception.read())["error"]["param"]), (400, "limit"))
        # A client-named id (a tracing id sent with every turn) cannot name a response the new one continues.
        traced = self.client.responses.create(model=MODEL, input="Hi", max_output_tokens=2,
                                              extra_headers={"X-Request-Id": "trace-turns"})
        with self.assertRaises(openai.BadRequestError) as ctx:
            self.client.responses.create(model=MODEL, previous_response_id=traced.id, input="x", max_output_tokens=2,
                                         extra_headers={"X-Request-Id": "trace-turns"})
        self.assertEqual(ctx.exception.param, "X-Request-Id")
        # The body's request_id names it where the header is empty.
        status, answer = self.post_raw("/v1/responses", json.dumps({"model": MODEL, "previous_response_id": traced.id,
                                                                     "input": "x", "request_id": "trace-turns"}).encode(),
                                       {"X-Request-Id": ""})
        self.assertEqual((status, answer["error"]["param"]), (400, "request_id"))
        # Deleted: gone, and a conversation through it can no longer be continued (named).
        self.assertIsNone(self.client.responses.delete(first.id))
        with self.assertRaises(openai.NotFoundError):
            self.client.responses.retrieve(first.id)
        with self.assertRaises(openai.NotFoundError):
            self.client.responses.delete(first.id)
        with self.assertRaises(openai.BadRequestError) as ctx:
            self.client.responses.create(model=MODEL, previous_response_id=final.id, input="x", max_output_tokens=2)
        self.assertEqual(ctx.exception.param, "previous_response_id")
        self.assertIn(first.id, ctx.exception.message)
        self.assertGreater(self.metric("shardserve_http_responses_stored"), 0)
        self.assertGreater(self.metric("shardserve_http_responses_stored_bytes"), 0)
        for endpoint in ("/v1/responses/{id}", "/v1/responses/{id}/input_items"):
            self.assertGreater(self.metric("shardserve_http_requests_total", endpoint=endpoint, status="200"), 0)

    def test_responses_truncation(self):
        # truncation "auto" drops the oldest turns until the prompt leaves room for the output;
        # "disabled" (the default) refuses a conversation longer than the context.
        with urllib.request.urlopen(self.base + "/v1/models", timeout=10) as r:
            max_len = json.loads(r.read())["data"][0]["max_model_len"]
        long = " ".join(["heaven"] * max_len)
        conversation = [{"role": "user", "content": long}, {"role": "assistant", "content": "Yes."},
                        {"role": "user", "content": "Who made the earth?"}]
        with self.assertRaises(openai.BadRequestError) as ctx:
            self.client.responses.create(model=MODEL, input=conversation, max_output_tokens=4, store=False)
        self.assertEqual(ctx.exception.param, "input")
        cut = self.client.responses.create(model=MODEL, input=conversation, max_output_tokens=4, temperature=0,
                                           truncation="auto", store=False)
        alone = self.client.responses.create(model=MODEL, input=conversation[-1:], max_output_tokens=4,
                                             temperature=0, store=False)
        self.assertEqual(cut.truncation, "auto")
        self.assertEqual((cut.usage.input_tokens, cut.output_text), (alone.usage.input_tokens, alone.output_text))
        # A last turn that cannot fit is still refused.
        with self.assertRaises(openai.BadRequestError) as ctx:
            self.client.responses.create(model=MODEL, input=long, max_output_tokens=4, truncation="auto", store=False)
        self.assertEqual(ctx.exception.param, "input")

    def test_the_client_names_the_request(self):
        # X-Request-Id (as a proxy sets it), else the body's request_id: the answer's id and header.
        raw = self.client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
            extra_headers={"X-Request-Id": "trace-42"})
        self.assertEqual((raw.headers["X-Request-Id"], raw.parse().id), ("trace-42", "chatcmpl-trace-42"))
        raw = self.client.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=2,
                                                               extra_body={"request_id": "batch-7"})
        self.assertEqual((raw.headers["X-Request-Id"], raw.parse().id), ("batch-7", "cmpl-batch-7"))
        raw = self.client.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=2)
        self.assertEqual(raw.headers["X-Request-Id"], raw.parse().id)  # one of the server's own
        with open(self.launch.args[self.launch.args.index("--log-dir") + 1] + "/coordinator.log") as f:
            self.assertIn("chatcmpl-trace-42", f.read())  # the log names it
        with self.assertRaises(openai.BadRequestError) as ctx:
            self.client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                           extra_headers={"X-Request-Id": "has space"})
        self.assertIn("X-Request-Id", ctx.exception.message)

    def test_tokenize_and_detokenize_as_vllm_does(self):
        text = "In the beginning God created the heaven"
        status, t = self.post_raw("/tokenize", json.dumps({"model": MODEL, "prompt": text}).encode())
        self.assertEqual(status, 200, t)
        self.assertEqual(t["tokens"], self.grpc.tokenize(text))
        self.assertEqual(t["count"], len(t["tokens"]))
        self.assertEqual(t["max_model_len"], self.client.models.retrieve(MODEL).model_extra["max_model_len"])
        self.assertIsNone(t["token_strs"])
        # No model named (vLLM's default), no special tokens, the vocabulary's strings.
        status, t = self.post_raw("/tokenize", json.dumps({"prompt": text, "add_special_tokens": False,
                                                           "return_token_strs": True}).encode())
        self.assertEqual(status, 200, t)
        self.assertEqual(t["tokens"], self.grpc.tokenize(text, add_special_tokens=False))
        self.assertEqual(len(t["token_strs"]), t["count"])
        status, d = self.post_raw("/detokenize", json.dumps({"model": MODEL, "tokens": t["tokens"]}).encode())
        self.assertEqual((status, d), (200, {"prompt": text}))
        # A chat: the prompt a chat completion of the same messages reads, token for token.
        messages = [{"role": "user", "content": "Hello there"}]
        status, t = self.post_raw("/tokenize", json.dumps({"model": MODEL, "messages": messages}).encode())
        self.assertEqual(status, 200, t)
        self.assertEqual(t["tokens"], self.chat_prompt_ids(messages))
        r = self.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
        self.assertEqual(r.usage.prompt_tokens, t["count"])
        status, d = self.post_raw("/detokenize", json.dumps({"tokens": t["tokens"]}).encode())
        self.assertEqual(status, 200, d)
        self.assertTrue(d["prompt"].startswith("<|begin_of_text|>User: Hello there"), d)  # special tokens kept
        # Bad requests name what is wrong.
        for path, body, code, param in (
                ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
                ("/tokenize", {"prompt": "x", "messages": messages}, 400, "prompt"),
                ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True,
                               "add_generation_prompt": True}, 400, "continue_final_message"),
                ("/detokenize", {"tokens": [1, 999999]}, 400, "tokens[1]"),
                ("/detokenize", {"tokens": "1 2"}, 400, "tokens")):
            status, e = self.post_raw(path, json.dumps(body).encode())
            self.assertEqual((status, e["error"]["param"]), (code, param), (path, body, e))
        self.assertGreaterEqual(self.metric("shardserve_http_requests_total", endpoint="/tokenize", status="200"), 3)

    # ---- errors ----
    def test_bad_requests_are_400_naming_the_field(self):
        cases = [
            (dict(prompt="x", temperature="hot"), "temperature"),
            (dict(prompt="x", temperature=-1), "temperature"),
            (dict(prompt="x", max_tokens=0), "max_tokens"),
            (dict(prompt="x", n=0), "n"),
            (dict(prompt="x", top_p=1.5), "top_p"),
            (dict(prompt="x", stop=[1]), "stop[0]"),
            (dict(prompt=[1, 2, 999999]), "prompt[2]"),
            (dict(prompt="x", extra_body={"top_k": "many"}), "top_k"),
        ]
        for kwargs, param in cases:
            with self.subTest(param=param), self.assertRaises(openai.BadRequestError) as ctx:
                self.client.completions.create(model=MODEL, **kwargs)
            self.assertEqual(ctx.exception.status_code, 400)
            self.assertEqual(ctx.exception.param, param)
            self.assertEqual(ctx.exception.type, "invalid_request_error")
            self.assertIn(param, ctx.exception.message)
        with self.assertRaises(openai.BadRequestError) as ctx:
            self.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": 5}])
        self.assertEqual(ctx.exception.param, "messages[0].content")
        # Malformed JSON, and a body that is not an object: 400 in OpenAI's error shape.
        for body in (b"{not json", b"[1, 2]"):
            status, err = self.post_raw("/v1/completions", body)
            self.assertEqual(status, 400)
            self.assertEqual(set(err["error"]), {"message", "type", "param", "code"})

    # ---- logit_bias, min_tokens, tool calls, reasoning ----
    def grpc_generate(self, prompt_ids, **sampling):
        request = inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=prompt_ids),
                                                sampling=inference_pb2.SamplingParams(**sampling))
        text, ids, finish = "", [], None
        for msg in self.grpc._stub.Generate(request, timeout=120):
            text += msg.text
            ids += list(msg.token_ids)
            finish = msg.finish_reason or finish
        return text, ids, finish

    def test_logit_bias_forces_and_bans_a_token_in_both_apis(self):
        prompt = self.grpc.tokenize("And God said")
        _, plain = self.grpc_greedy_ids(prompt, 4)
        forced = plain[0] + 1
        for sampling in (dict(temperature=0), dict(temperature=1.0, seed=5)):
            with self.subTest(**sampling):
                text, ids, _ = self.grpc_generate(prompt, max_tokens=4, logit_bias={forced: 100}, ignore_eos=True,
                                                  **sampling)
                self.assertEqual(ids, [forced] * 4)
                r = self.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                                   logit_bias={str(forced): 100},
                                                   extra_body={"ignore_eos": True}, **sampling)
                self.assertEqual(r.choices[0].text, text)
        # -100 on the greedy first token: another one comes first.
        text, ids, _ = self.grpc_generate(prompt, max_tokens=4, temperature=0, logit_bias={plain[0]: -100})
        self.assertNotEqual(ids[0], plain[0])
        r = self.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                           logit_bias={str(plain[0]): -100})
        self.assertEqual(r.choices[0].text, text)

    def test_min_tokens_holds_the_stop_ids_back(self):
        prompt = self.grpc.tokenize("And God said")
        _, plain = self.grpc_greedy_ids(prompt, 1)
        stop = plain[0]  # the greedy first token, made a stop id: without min_tokens it ends at once
        r = self.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                           extra_body={"stop_token_ids": [stop]})
        self.assertEqual((r.usage.completion_tokens, r.choices[0].finish_reason), (1, "stop"))
        r = self.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                           extra_body={"stop_token_ids": [stop], "min_tokens": 3})
        self.assertGreaterEqual(r.usage.completion_tokens, 3)
        _, ids, _ = self.grpc_generate(prompt, max_tokens=8, temperature=0, stop_token_ids=[stop], min_tokens=3)
        self.assertGreaterEqual(len(ids), 3)
        self.assertNotIn(stop, ids[:3])

    def test_new_fields_out_of_bounds_are_400_naming_them(self):
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
        chat = [{"role": "user", "content": "Hi"}]
        cases = [
            (lambda: self.client.completions.create(model=MODEL, prompt="x", logit_bias={"999999": 1}), "logit_bias"),
            (lambda: self.client.completions.create(model=MODEL, prompt="x", logit_bias={"5": 101}), "logit_bias"),
            (lambda: self.client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                                    extra_body={"min_tokens": 5}), "min_tokens"),
            # tool_choice "required" and named are grammars (tests/openai_structured_test.py): refused
            # without tools, or naming a function that is not one of them.
            (lambda: self.client.chat.completions.create(model=MODEL, messages=chat, tool_choice="required"),
             "tool_choice"),
            (lambda: self.client.chat.completions.create(
                model=MODEL, messages=chat, tools=[tool],
                tool_choice={"type": "function", "function": {"name": "get_time"}}), "tool_choice.function.name"),
            (lambda: self.client.chat.completions.create(
                model=MODEL, messages=chat, tools=[{"type": "function", "function": {"name": "get weather"}}]),
             "tools[0].function.name"),
            (lambda: self.client.chat.completions.create(model=MODEL, messages=chat, tools=[tool] * 129), "tools"),
        ]
        for call, param in cases:
            with self.subTest(param=param), self.assertRaises(openai.BadRequestError) as ctx:
                call()
            self.assertEqual(ctx.exception.param, param)
            self.assertIn(param, ctx.exception.message)
        with self.assertRaises(grpc.RpcError) as ctx:
            self.grpc_generate([1, 2], logit_bias={999999: 1.0})
        self.assertEqual(ctx.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("sampling.logit_bias", ctx.exception.details())

    def test_tool_call_parsing_keeps_an_output_that_is_no_call_as_content(self):
        # The demo model writes no tool calls; forcing '{' makes an output that llama3_json must
        # hold back (it may be a call) until it ends as something else: then it is all content.
        brace = self.grpc.tokenize("{", add_special_tokens=False)
        self.assertEqual(len(brace), 1, brace)
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
        text, _, _ = self.grpc_generate(self.chat_prompt_ids(messages), max_tokens=6, temperature=0,
                                        logit_bias={brace[0]: 100}, ignore_eos=True)
        self.assertTrue(text.startswith("{"), text)
        kw = dict(model=MODEL, messages=messages, tools=[tool], max_tokens=6, temperature=0,
                  logit_bias={str(brace[0]): 100}, extra_body={"ignore_eos": True})
        r = self.client.chat.completions.create(**kw)
        self.assertEqual(r.choices[0].message.content, text)
        self.assertIsNone(r.choices[0].message.tool_calls)
        self.assertEqual(r.choices[0].finish_reason, "length")
        for choice, content_chunks in (("auto", 1), ("none", 6)):
            with self.subTest(tool_choice=choice):
                chunks = list(self.client.chat.completions.create(stream=True, tool_choice=choice, **kw))
                contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
                self.assertEqual("".join(contents), text)
                self.assertFalse(any(c.choices[0].delta.tool_calls for c in chunks if c.choices))
                # auto: held back until the output ended as no call; none: streamed token by token.
                self.assertEqual(len(contents), content_chunks)
                self.assertEqual(chunks[-1].choices[0].finish_reason, "length")

    def test_auto_tool_call_streams_its_arguments(self):
        # A regex makes the demo model write a llama3_json call; with tool_choice auto the parser
        # finds it. Streamed, the call's first delta has its id, type and name, then its arguments
        # come in several deltas, which join to the arguments of the whole answer (same greedy output).
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
        regex = r'\{"name": "get_weather", "parameters": \{"city": "[a-z]{12,16}", "days": [1-9]\}\}'
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[tool],
                  tool_choice="auto", max_tokens=120, temperature=0, extra_body={"guided_regex": regex})
        whole = self.client.chat.completions.create(**kw)
        self.assertEqual(whole.choices[0].finish_reason, "tool_calls")
        calls = whole.choices[0].message.tool_calls
        self.assertEqual(len(calls), 1, whole)
        self.assertEqual(calls[0].function.name, "get_weather")
        arguments = json.loads(calls[0].function.arguments)
        self.assertEqual(sorted(arguments), ["city", "days"])

        chunks = list(self.client.chat.completions.create(stream=True, **kw))
        deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        self.assertTrue(deltas)
        first = deltas[0]
        self.assertEqual((first.index, first.type, first.function.name, first.function.arguments),
                         (0, "function", "get_weather", ""))
        self.assertTrue(first.id.startswith("call_"), first.id)
        pieces = [d.function.arguments for d in deltas[1:]]
        self.assertTrue(all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:]))
        self.assertGreater(len(pieces), 1, "the arguments came in one delta")
        self.assertEqual("".join(pieces), calls[0].function.arguments)
        self.assertEqual(json.loads("".join(pieces)), arguments)
        self.assertFalse(any(c.choices[0].delta.content for c in chunks if c.choices))
        self.assertEqual(chunks[-1].choices[0].finish_reason, "tool_calls")

    def test_reasoning_opened_by_the_prompt_is_reasoning_content(self):
        # A prompt that ends with <think> (as DeepSeek-R1's template ends its own): the output is
        # reasoning until </think>, which the demo model does not write.
        messages = [{"role": "user", "content": "Count <think>"}]
        prompt = self.grpc.tokenize("<|begin_of_text|>User: Count <think>\n\n", add_special_tokens=False)
        text, _, _ = self.grpc_generate(prompt, max_tokens=8, temperature=0, ignore_eos=True)
        self.assertNotIn("</think>", text)
        kw = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                  extra_body={"add_generation_prompt": False, "ignore_eos": True})
        message = self.client.chat.completions.create(**kw).choices[0].message
        self.assertEqual(message.model_extra.get("reasoning_content"), text)
        self.assertEqual(message.content, "")
        chunks = list(self.client.chat.completions.create(stream=True, **kw))
        reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or ""
                            for c in chunks if c.choices)
        self.assertEqual(reasoning, text)
        self.assertFalse(any(c.choices[0].delta.content for c in chunks if c.choices))
        # Without <think> at the end the same server returns plain content.
        plain = self.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count"}],
                                                    max_tokens=4, temperature=0).choices[0].message
        self.assertTrue(plain.content)
        self.assertIsNone(plain.model_extra.get("reasoning_content"))

    def test_prompt_too_long_is_400_with_both_numbers(self):
        with self.assertRaises(openai.BadRequestError) as ctx:
            self.client.completions.create(model=MODEL, prompt=[5] * 600, max_tokens=4)
        self.assertRegex(ctx.exception.message, r"600 tokens do not fit max_model_len 512")
        with self.assertRaises(openai.BadRequestError) as ctx:
            self.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a " * 700}])
        self.assertRegex(ctx.exception.message, r"its \d+ tokens do not fit max_model_len 512")
        self.assertEqual(ctx.exception.param, "messages")

    def test_unknown_model_is_404(self):
        with self.assertRaises(openai.NotFoundError) as ctx:
            self.client.completions.create(model="gpt-4", prompt="x")
        self.assertEqual(ctx.exception.code, "model_not_found")
        self.assertEqual(ctx.exception.param, "model")

    def test_body_over_the_limit_is_413(self):
        body = json.dumps({"model": MODEL, "prompt": "a" * (9 << 20)}).encode()  # over the 8 MiB default
        status, err = self.post_raw("/v1/completions", body)
        self.assertEqual(status, 413)
        self.assertIn("8388608", err["error"]["message"])

    def raw_exchange(self, data: bytes, seconds: float = 30, half_close: bool = False) -> bytes:
        """What the server answers to DATA written as it is on one connection, until it closes (at
        most SECONDS); with HALF_CLOSE the client then shuts its sending side (it sends no more)."""
        with socket.create_connection(("127.0.0.1", self.http_port), timeout=seconds) as s:
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
            got = b""
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
            return got

    def test_deeply_nested_body_is_400_and_the_server_lives(self):
        # 50,000 levels in chat_template_kwargs (100 KB) overflowed the stack of the thread that made
        # them template values: the coordinator died with every request in flight.
        depth = 50000
        body = ('{"model": "%s", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], '
                '"chat_template_kwargs": {"x": %s}}' % (MODEL, "[" * depth + "]" * depth)).encode()
        status, err = self.post_raw("/v1/chat/completions", body)
        self.assertEqual(status, 400, err)
        self.assertIn("deeper than 128 levels", err["error"]["message"])
        self.assertTrue(self.http_ok("/health"))
        self.assertEqual(len(self.client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices), 1)

    def test_form_encoded_body_over_8kb_is_served(self):
        # What `curl -d @file` sends: the JSON body typed as a form. httplib's own reading refused any
        # such body over 8 KB with a 413 that named the 8 MiB limit.
        body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1, "user": "u" * 9000}).encode()
        self.assertGreater(len(body), 8192)
        req = urllib.request.Request(self.base + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/x-www-form-urlencoded"})
        with urllib.request.urlopen(req, timeout=60) as r:
            self.assertEqual(r.status, 200)
            self.assertEqual(len(json.loads(r.read())["choices"]), 1)

    def test_content_length_that_is_not_a_count_is_400(self):
        start = time.monotonic()
        got = self.raw_exchange(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}")
        took = time.monotonic() - start
        self.assertTrue(got.startswith(b"HTTP/1.1 400"), got)
        self.assertIn(b"Content-Length: '-5' is not a number of bytes", got)
        # httplib read it as 2^64 - 5 and waited for those bytes until its read timeout (5 s).
        self.assertLess(took, 4.5, "answered before any read timeout")

    def test_body_shorter_than_its_content_length_is_400(self):
        got = self.raw_exchange(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\": ",
                                half_close=True)
        self.assertTrue(got.startswith(b"HTTP/1.1 400"), got)
        self.assertIn(b"ended before its Content-Length", got)

    def test_post_without_content_length_is_411(self):
        got = self.raw_exchange(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertTrue(got.startswith(b"HTTP/1.1 411"), got)
        self.assertIn(b"Content-Length", got)

    def test_pipelined_requests_are_all_answered_in_order(self):
        body = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}).encode()
        post = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body)) + body
        got = self.raw_exchange(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n" + post +
                                b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        self.assertEqual(got.count(b"HTTP/1.1 200"), 3, got)
        models, completion, health = got.find(b'"object":"list"'), got.find(b'"text_completion"'), got.find(b'"ok"')
        self.assertTrue(0 < models < completion < health, got)

    def test_headers_that_stop_arriving_are_408_at_the_deadline(self):
        # The request line, then one header and nothing more: answered once nothing has come for 5 s
        # (the head's deadline is 10 s), not held for as long as the client keeps the connection open.
        start = time.monotonic()
        got = self.raw_exchange(b"GET /health HTTP/1.1\r\nHost: x\r\n", seconds=40)
        self.assertTrue(got.startswith(b"HTTP/1.1 408"), got)
        self.assertIn(b"the request stalled: no byte of it arrived for 5s", got)
        self.assertLess(time.monotonic() - start, 40)

    def test_range_header_is_ignored(self):
        # httplib cut an answer to a request's byte ranges (206, multipart for several): a model list
        # or a completion's JSON came back in pieces. Whole documents, 200, whatever Range asks.
        body = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}).encode()
        for request in (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nRange: bytes=0-0,2-3\r\nConnection: close\r\n\r\n",
                        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Range: bytes=0-9\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body):
            got = self.raw_exchange(request)
            self.assertTrue(got.startswith(b"HTTP/1.1 200"), got)
            self.assertNotIn(b"Content-Range", got)
            _, _, answer = got.partition(b"\r\n\r\n")
            self.assertIn(json.loads(answer)["object"], ("list", "text_completion"), got)

    def test_malformed_request_says_why(self):
        got = self.raw_exchange(b"NOT HTTP AT ALL\r\n\r\n")
        self.assertTrue(got.startswith(b"HTTP/1.1 400"), got)
        self.assertIn(b"malformed HTTP/1.1 request", got)

    def test_malformed_request_closes_the_connection(self):
        # Where the next request would begin is not known after a head the server cannot read: one
        # 400 that says it closes, then the close; the lines after it are not read as requests (each
        # was answered 400 of its own, up to 100 answers for a few hundred bytes), nor is the GET.
        start = time.monotonic()
        got = self.raw_exchange(b"NOT HTTP AT ALL\r\n" + b"x\r\n" * 50 + b"\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertTrue(got.startswith(b"HTTP/1.1 400"), got)
        self.assertEqual(len(re.findall(rb"HTTP/1\.1 \d{3} ", got)), 1, got)  # status lines
        self.assertIn(b"Connection: close", got)
        self.assertNotIn(b'"ok"', got)
        self.assertLess(time.monotonic() - start, 10, "closed, not left to the idle timeout")

    def test_full_queue_is_429(self):
        # n = 16 submissions: at most max-num-seqs run and none may wait (--max-waiting-requests 0).
        with self.assertRaises(openai.RateLimitError) as ctx:
            self.client.completions.create(model=MODEL, prompt="x", max_tokens=4, n=16)
        self.assertEqual(ctx.exception.status_code, 429)
        self.assertIn("--max-waiting-requests", ctx.exception.message)
        # The choices already submitted were cancelled: nothing stays in the engine.
        wait_until(lambda: self.scheduler().running == 0 and self.scheduler().waiting == 0, 60, "an idle engine")

    def test_client_disconnect_cancels_the_request(self):
        wait_until(lambda: self.scheduler().running == 0, 60, "an idle engine")
        finished_before = self.metric("shardserve_requests_finished_total")
        generated_before = self.metric("shardserve_generated_tokens_total")
        gone_before = self.metric("shardserve_http_requests_total", endpoint="/v1/completions", status="499")
        max_tokens = 480
        stream = self.client.completions.create(model=MODEL, prompt="And God said", max_tokens=max_tokens,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})
        got = 0
        for _ in stream:
            got += 1
            if got == 3:
                break
        stream.close()  # closes the connection mid-stream
        s = wait_until(lambda: (lambda s: s if s.running == 0 and s.kv_blocks_free == s.kv_blocks_total else None)(
            self.scheduler()), 60, "the request to leave the engine and free its blocks")
        self.assertGreater(s.kv_blocks_total, 0)
        wait_until(lambda: self.metric("shardserve_http_requests_total", endpoint="/v1/completions",
                                       status="499") == gone_before + 1, 30, "the disconnect to be counted")
        # Cancelled, not finished: it never reached max_tokens.
        self.assertEqual(self.metric("shardserve_requests_finished_total"), finished_before)
        self.assertLess(self.metric("shardserve_generated_tokens_total") - generated_before, max_tokens)

    def test_client_disconnect_cancels_a_waiting_request(self):
        # Not streaming: the handler waits for the whole answer and writes nothing before it; the
        # server must still see the closed connection, cancel the request and free its blocks.
        max_tokens = 480
        for path, body in (("/v1/completions", {"prompt": "And God said"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "And God said"}]})):
            with self.subTest(path=path):
                wait_until(lambda: self.scheduler().running == 0, 60, "an idle engine")
                finished_before = self.metric("shardserve_requests_finished_total")
                generated_before = self.metric("shardserve_generated_tokens_total")
                gone_before = self.metric("shardserve_http_requests_total", endpoint=path, status="499")
                payload = json.dumps(dict(body, model=MODEL, max_tokens=max_tokens, temperature=0,
                                          ignore_eos=True)).encode()
                with socket.create_connection(("127.0.0.1", self.http_port), timeout=30) as s:
                    s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                              f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
                    wait_until(lambda: self.scheduler().running == 1, 60, "the request to run")
                # Closed: the request leaves the engine long before its 480 tokens.
                s = wait_until(lambda: (lambda s: s if s.running == 0 and s.kv_blocks_free == s.kv_blocks_total
                                        else None)(self.scheduler()), 60,
                               "the request to leave the engine and free its blocks")
                self.assertGreater(s.kv_blocks_total, 0)
                wait_until(lambda: self.metric("shardserve_http_requests_total", endpoint=path,
                                               status="499") == gone_before + 1, 30, "the disconnect to be counted")
                self.assertEqual(self.metric("shardserve_requests_finished_total"), finished_before)
                self.assertLess(self.metric("shardserve_generated_tokens_total") - generated_before, max_tokens)

    def test_zz_lost_worker_is_503(self):
        # Last (tests run in name order): a worker is killed and, with no restart (launch
        # --max-worker-restarts 0), the group cannot heal: a request waits for the heal
        # (--heal-timeout-seconds 2), then fails with 503.
        workers = subprocess.run(["pgrep", "-P", str(self.launch.pid), "-f", "shardserve-worker"],
                                 capture_output=True, text=True).stdout.split()
        self.assertTrue(workers, "no worker process found")
        os.kill(int(workers[0]), signal.SIGKILL)
        wait_until(lambda: not self.http_ok("/health"), 60, "/health to report the lost worker")
        with self.assertRaises(openai.InternalServerError) as ctx:
            self.client.completions.create(model=MODEL, prompt="x", max_tokens=4)
        self.assertEqual(ctx.exception.status_code, 503)
        self.assertEqual(ctx.exception.code, "not_serving")
        # The message names the lost worker's slot (the heal cannot finish), not a shutdown.
        self.assertRegex(str(ctx.exception), r"stage \d+, tp rank \d+")


class NoChatTemplateTest(unittest.TestCase):
    """A model without a chat template (a test fixture: config.json and weights, no tokenizer):
    chat is refused with a 400 that says so; completions of token ids work."""

    @classmethod
    def setUpClass(cls):
        cls.model_dir = os.path.join(ROOT, "tests", "fixtures", "models", "llama_gqa")
        cls.model = os.path.basename(cls.model_dir)
        http_port, grpc_port = free_ports(2)
        base = cls.base = f"http://127.0.0.1:{http_port}"
        cls.launch = start_launch(["--model", cls.model_dir, "--nodes", "1", "--gpus-per-node", "1",
                                   "--address", f"127.0.0.1:{grpc_port}", "--http-port", str(http_port)],
                                  base, work_dir("shardserve-openai-notemplate-"))
        cls.client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)

    @classmethod
    def tearDownClass(cls):
        stop_launch(cls.launch)
        assert cls.launch.returncode is not None

    def test_chat_is_400_saying_there_is_no_template(self):
        with self.assertRaises(openai.BadRequestError) as ctx:
            self.client.chat.completions.create(model=self.model, messages=[{"role": "user", "content": "Hi"}])
        self.assertIn("has no chat template", ctx.exception.message)
        self.assertEqual(ctx.exception.param, "messages")

    def test_token_id_completion_works(self):
        r = self.client.completions.create(model=self.model, prompt=[1, 2, 3], max_tokens=4, temperature=0,
                                           logprobs=1)
        self.assertEqual(r.usage.completion_tokens, 4)
        self.assertEqual(len(r.choices[0].logprobs.token_logprobs), 4)
        with self.assertRaises(openai.BadRequestError) as ctx:  # text needs a tokenizer
            self.client.completions.create(model=self.model, prompt="Hi")
        self.assertEqual(ctx.exception.param, "prompt")

    def test_tokenize_and_detokenize_say_there_is_no_tokenizer(self):
        for path, body, param, says in (("/tokenize", {"prompt": "Hi"}, "prompt", "has no tokenizer (tokenizer.json or tiktoken.model)"),
                                        ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}, "messages",
                                         "has no chat template"),
                                        ("/detokenize", {"tokens": [1, 2]}, "tokens", "has no tokenizer (tokenizer.json or tiktoken.model)")):
            req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with self.assertRaises(urllib.error.HTTPError) as ctx:
                urllib.request.urlopen(req, timeout=60)
            error = json.loads(ctx.exception.read())["error"]
            self.assertEqual((ctx.exception.code, error["param"]), (400, param), error)
            self.assertIn(says, error["message"])


def write_kimi_k2_dir(model_dir, edit_tokenizer_config=None):
    """A Kimi K2-shaped checkpoint directory (dummy weights): the kimi_k2 tokenizer fixture, Kimi K2's
    chat template, and config.json a small DeepSeek-V3 whose vocab_size, like Kimi K2's, ends two ids
    before the tokenizer's last special id. edit_tokenizer_config(config) may change the tokenizer's."""
    fixtures = os.path.join(ROOT, "tests", "fixtures")
    os.makedirs(model_dir)
    tokenizer = os.path.join(fixtures, "tokenizers", "kimi_k2")
    for name in ("tiktoken.model", "generation_config.json"):
        with open(os.path.join(tokenizer, name), "rb") as src, open(os.path.join(model_dir, name), "wb") as dst:
            dst.write(src.read())
    with open(os.path.join(tokenizer, "tokenizer_config.json")) as f:
        tokenizer_config = json.load(f)
    with open(os.path.join(fixtures, "chat_templates", "kimi_k2", "tokenizer_config.json")) as f:
        tokenizer_config["chat_template"] = json.load(f)["chat_template"]
    if edit_tokenizer_config is not None:
        edit_tokenizer_config(tokenizer_config)
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f)
    with open(os.path.join(fixtures, "models", "deepseek_v3_tf5", "config.json")) as f:
        config = json.load(f)
    config.update(model_type="kimi_k2", vocab_size=2048 + 256, bos_token_id=2048, eos_token_id=2049)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return model_dir


def start_dummy_cluster(cls, model_dir, log_dir, args):
    """A one-worker cluster of model_dir with dummy weights, launched with `args` more: sets cls.base,
    cls.launch (stop it with stop_launch) and cls.client."""
    http_port, grpc_port = free_ports(2)
    cls.base = f"http://127.0.0.1:{http_port}"
    cls.launch = start_launch(["--model", model_dir, "--nodes", "1", "--gpus-per-node", "1", "--load-format", "dummy",
                               "--address", f"127.0.0.1:{grpc_port}", "--http-port", str(http_port)] + args,
                              cls.base, log_dir)
    cls.client = openai.OpenAI(base_url=cls.base + "/v1", api_key="unused", max_retries=0, timeout=120)


class KimiTokenizerTest(unittest.TestCase):
    """A Kimi K2-shaped checkpoint as Moonshot ships it: no tokenizer.json, but tiktoken.model and a
    tokenizer_config.json naming tokenization_kimi.TikTokenTokenizer (the tokenizer fixture kimi_k2,
    whose ids tiktoken recorded), with Kimi K2's chat template, and config.json a small DeepSeek-V3
    (dummy weights) whose vocab_size, like Kimi K2's, ends two ids before the tokenizer's last
    special id. The text API, chat, structured outputs and the bounds of the vocabulary hold."""

    @classmethod
    def setUpClass(cls):
        log_dir = work_dir("shardserve-openai-tiktoken-")
        cls.model_dir = write_kimi_k2_dir(os.path.join(log_dir, "kimi_k2"))
        with open(os.path.join(ROOT, "tests", "fixtures", "tokenizers", "kimi_k2", "cases.json"), encoding="utf-8") as f:
            cls.cases = {c["text"]: c["ids"] for c in json.load(f)["encode"]}
        cls.model = "kimi_k2"
        start_dummy_cluster(cls, cls.model_dir, log_dir, ["--tool-call-parser", "kimi_k2"])

    @classmethod
    def tearDownClass(cls):
        stop_launch(cls.launch)

    def post(self, path, body):
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    def test_text_tokenizes_as_tiktoken_did(self):
        texts = [t for t in self.cases if "<|im_user|>" in t or "漢字" in t or t.startswith("I'M")]
        self.assertGreaterEqual(len(texts), 3)
        for text in texts:
            ids = self.post("/tokenize", {"model": self.model, "prompt": text})["tokens"]
            self.assertEqual(ids, self.cases[text], text)
            self.assertEqual(self.post("/detokenize", {"model": self.model, "tokens": ids})["prompt"], text)

    def test_chat_renders_kimis_template_and_answers(self):
        messages = [{"role": "user", "content": "你好，Kimi！"}]
        rendered = ("<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|><|im_user|>user<|im_middle|>"
                    "你好，Kimi！<|im_end|><|im_assistant|>assistant<|im_middle|>")
        chat_ids = self.post("/tokenize", {"model": self.model, "messages": messages})["tokens"]
        self.assertEqual(chat_ids, self.post("/tokenize", {"model": self.model, "prompt": rendered,
                                                           "add_special_tokens": False})["tokens"])
        self.assertIn(2050, chat_ids)  # <|im_end|>, one special token, not text
        r = self.client.chat.completions.create(model=self.model, messages=messages, max_tokens=4, temperature=0)
        self.assertEqual(r.usage.prompt_tokens, len(chat_ids))
        self.assertGreaterEqual(r.usage.completion_tokens, 1)

    def test_structured_output_masks_the_models_vocabulary(self):
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
                  "additionalProperties": False}
        r = self.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": "Where?"}], max_tokens=40, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}})
        self.assertEqual(r.choices[0].finish_reason, "stop", r.choices[0].message.content)
        self.assertEqual(list(json.loads(r.choices[0].message.content)), ["city"])

    def test_a_special_token_past_the_models_vocabulary_is_400(self):
        # Ids 2304 and 2305 are the tokenizer's (reserved tokens) but not the model's.
        for create, kwargs, param in (
                (self.client.completions.create, {"prompt": "hi <|reserved_token_2305|>"}, "prompt"),
                (self.client.chat.completions.create,
                 {"messages": [{"role": "user", "content": "<|reserved_token_2304|>"}]}, "messages")):
            with self.assertRaises(openai.BadRequestError) as ctx:
                create(model=self.model, max_tokens=2, **kwargs)
            self.assertEqual(ctx.exception.param, param)
            self.assertIn("2304)", ctx.exception.message)
        ok = self.client.completions.create(model=self.model, prompt="hi <|reserved_token_2303|>", max_tokens=2)
        self.assertEqual(ok.usage.prompt_tokens, len(self.post("/tokenize", {"model": self.model,
                                                                              "prompt": "hi <|reserved_token_2303|>"})["tokens"]))


class SpecialThinkingMarkersTest(unittest.TestCase):
    """A checkpoint whose tokenizer makes <think>, </think>, <tool_call> and </tool_call> special
    tokens (the Kimi K2-shaped one, four reserved ids renamed and listed among
    additional_special_tokens, so that transformers would skip them), served with --reasoning-parser
    deepseek_r1 and --tool-call-parser hermes: the markers stay in the output for the parsers while
    the other special tokens are still skipped, so the reasoning comes apart from the answer, whole
    and streamed, and a call is a call. A grammar makes the model write them (<[ID]>)."""

    THINK, END_THINK, TOOL_CALL, END_TOOL_CALL = 2066, 2067, 2068, 2069

    @classmethod
    def setUpClass(cls):
        def special_markers(config):
            for token_id, content in ((cls.THINK, "<think>"), (cls.END_THINK, "</think>"),
                                      (cls.TOOL_CALL, "<tool_call>"), (cls.END_TOOL_CALL, "</tool_call>")):
                config["added_tokens_decoder"][str(token_id)]["content"] = content
                config["additional_special_tokens"].append(content)
        log_dir = work_dir("shardserve-openai-think-")
        model_dir = write_kimi_k2_dir(os.path.join(log_dir, "kimi_k2"), special_markers)
        start_dummy_cluster(cls, model_dir, log_dir, ["--reasoning-parser", "deepseek_r1", "--tool-call-parser", "hermes"])

    @classmethod
    def tearDownClass(cls):
        stop_launch(cls.launch)

    def test_the_markers_reach_the_reasoning_parser(self):
        # <|im_middle|> (2065) is special and not a marker: skipped as before.
        grammar = f'root ::= <[{self.THINK}]> "Let us count" <[2065]> <[{self.END_THINK}]> "\n\nOne, two"'
        kw = dict(model="kimi_k2", messages=[{"role": "user", "content": "Count"}], max_tokens=40, temperature=0,
                  extra_body={"guided_grammar": grammar})
        whole = self.client.chat.completions.create(**kw)
        message = whole.choices[0].message
        self.assertEqual((message.model_extra.get("reasoning_content"), message.content), ("Let us count", "One, two"),
                         whole)
        chunks = list(self.client.chat.completions.create(stream=True, **kw))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        self.assertEqual("".join(d.model_extra.get("reasoning_content") or "" for d in deltas), "Let us count")
        self.assertEqual("".join(d.content or "" for d in deltas), "One, two")
        # The completions API parses nothing: special tokens are skipped there, the markers too.
        text = self.client.completions.create(model="kimi_k2", prompt="Count", max_tokens=40, temperature=0,
                                              extra_body={"guided_grammar": grammar}).choices[0].text
        self.assertEqual(text, "Let us count\n\nOne, two")

    def test_hermes_markers_reach_the_tool_call_parser(self):
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}
        call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
        grammar = f'root ::= <[{self.TOOL_CALL}]> {json.dumps(call)} <[{self.END_TOOL_CALL}]>'
        r = self.client.chat.completions.create(
            model="kimi_k2", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[tool], max_tokens=60,
            temperature=0, extra_body={"guided_grammar": grammar})
        self.assertEqual(r.choices[0].finish_reason, "tool_calls", r)
        calls = r.choices[0].message.tool_calls
        self.assertEqual([(c.function.name, json.loads(c.function.arguments)) for c in calls],
                         [("get_weather", {"city": "Paris"})])
        self.assertIsNone(r.choices[0].message.content)


class KimiToolCallTest(unittest.TestCase):
    """--tool-call-parser kimi_k2 (a one-worker cluster of the demo model, which a regex makes write
    Kimi K2's call format): the call keeps the id the model wrote, whole and streamed."""

    @classmethod
    def setUpClass(cls):
        http_port, grpc_port = free_ports(2)
        base = f"http://127.0.0.1:{http_port}"
        cls.launch = start_launch(
            ["--model", os.path.join(ROOT, "models", MODEL), "--nodes", "1", "--gpus-per-node", "1",
             "--address", f"127.0.0.1:{grpc_port}", "--http-port", str(http_port), "--tool-call-parser", "kimi_k2"],
            base, work_dir("shardserve-openai-kimi-"))
        cls.client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)

    @classmethod
    def tearDownClass(cls):
        stop_launch(cls.launch)

    def test_the_call_keeps_the_models_id(self):
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}
        regex = (r"<\|tool_calls_section_begin\|><\|tool_call_begin\|>functions\.get_weather:0"
                 r'<\|tool_call_argument_begin\|>\{"city": "[a-z]{4,8}"\}<\|tool_call_end\|><\|tool_calls_section_end\|>')
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[tool],
                  max_tokens=400, temperature=0, extra_body={"guided_regex": regex})  # the markers spelled out
        whole = self.client.chat.completions.create(**kw)
        self.assertEqual(whole.choices[0].finish_reason, "tool_calls", whole)
        calls = whole.choices[0].message.tool_calls
        self.assertEqual([(c.id, c.function.name) for c in calls], [("functions.get_weather:0", "get_weather")])
        self.assertEqual(sorted(json.loads(calls[0].function.arguments)), ["city"])
        self.assertFalse(whole.choices[0].message.content)
        chunks = list(self.client.chat.completions.create(stream=True, **kw))
        deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        self.assertEqual((deltas[0].id, deltas[0].function.name), ("functions.get_weather:0", "get_weather"))
        self.assertEqual("".join(d.function.arguments for d in deltas), calls[0].function.arguments)


class SpeculativeChoicesTest(unittest.TestCase):
    """The API over a cluster that speculates (--speculative draft with models/demo-draft): n = 2
    seeded choices, streamed and not, with logprobs and a stop string, and greedy chat, give what the
    same one-worker cluster without speculation gives, and guesses were accepted on the way."""

    @classmethod
    def setUpClass(cls):
        cls.clients, cls.launches, cls.metrics_urls = [], [], []
        try:  # tearDownClass does not run when setUpClass fails
            for flags in ([], ["--speculative", "draft", "--draft-model", os.path.join(ROOT, "models", "demo-draft"),
                               "--num-speculative-tokens", "4"]):
                http_port, grpc_port = free_ports(2)
                base = f"http://127.0.0.1:{http_port}"
                log_dir = work_dir("shardserve-openai-spec-")
                cls.launches.append(start_launch(
                    ["--model", os.path.join(ROOT, "models", MODEL), "--nodes", "1", "--gpus-per-node", "1",
                     "--address", f"127.0.0.1:{grpc_port}", "--http-port", str(http_port)] + flags, base, log_dir))
                with open(os.path.join(log_dir, "coordinator.log")) as f:
                    cls.metrics_urls.append(metrics_url(f.read()))
                cls.clients.append(openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120))
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        for launch in cls.launches:
            stop_launch(launch)

    def both(self, call):
        """call(client) on the plain cluster and on the speculating one."""
        return [call(c) for c in self.clients]

    def test_choices_are_those_without_speculation(self):
        kw = dict(model=MODEL, prompt="In the beginning", max_tokens=40, temperature=0.8, seed=5, n=2)
        plain, spec = self.both(lambda c: c.completions.create(logprobs=1, **kw))
        self.assertEqual([c.text for c in spec.choices], [c.text for c in plain.choices])
        self.assertNotEqual(plain.choices[0].text, plain.choices[1].text)
        for p, q in zip(plain.choices, spec.choices):
            self.assertEqual(q.logprobs.tokens, p.logprobs.tokens)
            for a, b in zip(p.logprobs.token_logprobs, q.logprobs.token_logprobs):
                self.assertAlmostEqual(a, b, places=4)
        self.assertEqual(spec.usage.completion_tokens, plain.usage.completion_tokens)

        def streamed(client):
            texts = {0: "", 1: ""}
            for chunk in client.completions.create(stream=True, **kw):
                texts[chunk.choices[0].index] += chunk.choices[0].text
            return [texts[0], texts[1]]
        self.assertEqual(self.both(streamed), [[c.text for c in plain.choices]] * 2)

        stop = plain.choices[1].text[8:12]  # inside choice 1's text, past its start
        plain_stop, spec_stop = self.both(lambda c: c.completions.create(stop=stop, **kw))
        self.assertEqual([c.text for c in spec_stop.choices], [c.text for c in plain_stop.choices])
        self.assertEqual(spec_stop.choices[1].finish_reason, "stop")

        chat = self.both(lambda c: c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Sing"}], max_tokens=32, temperature=0)
            .choices[0].message.content)
        self.assertEqual(chat[1], chat[0])

        with urllib.request.urlopen(self.metrics_urls[1], timeout=5) as r:
            text = r.read().decode()
        proposed = metric_sum(text, "shardserve_spec_proposed_tokens_total")
        accepted = metric_sum(text, "shardserve_spec_accepted_tokens_total")
        self.assertGreater(accepted, 0, f"no guess accepted of {proposed}")
        print(f"[ speculative ] {accepted:.0f} of {proposed:.0f} guesses accepted", file=sys.stderr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", required=True, help="directory holding shardserve, shardserve-coordinator, -worker")
    args, rest = parser.parse_known_args()
    BIN = args.bin
    run_unittests([sys.argv[0]] + rest)
