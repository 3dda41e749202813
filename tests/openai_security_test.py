"""API keys, HTTPS and the loopback rule on the OpenAI HTTP API (coordinator/api/openai/http_server.h,
docs/security.md), with real processes on 127.0.0.1.

One `shardserve launch` cluster (a coordinator and one worker, the embedded demo model) with a CA
and a certificate made here (the `openssl` command: an EC P-256 CA and a 127.0.0.1 certificate
from it) and --api-keys-file: the official openai client over https (an httpx client verifying
with the CA) works with the right key and gets 401 (openai.AuthenticationError, invalid_api_key) without
one or with a wrong one, each counted in shardserve_auth_failures_total; /health stays open; plain
http to the https port gets no answer. Then the coordinator alone: --http-host 0.0.0.0 without
HTTPS and keys is a start error naming the flags, and starts with --insecure. Always stops what it
started.

Run by CTest as: clients/python/setup-env.sh, then
    .venv-client/bin/python tests/openai_security_test.py --bin <build>/bin
"""
import argparse
import os
import re
import signal
import ssl
import subprocess
import sys
import time
import unittest
import urllib.request

from cli_check import free_port, free_ports, run_unittests, scaled, work_dir  # scaled: SHARDSERVE_TEST_TIME_SCALE

import httpx
import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from openai_api_test import stop_launch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = None  # set from --bin
MODEL = "demo"
KEY = "sk-test-" + "7" * 24


def make_certificates(d: str):
    """A CA and a certificate for 127.0.0.1/localhost signed by it (no extended key usage: the
    worker presents it as a client certificate too). Returns (ca, cert, key) paths."""
    def openssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)
    ca, ca_key = os.path.join(d, "ca.pem"), os.path.join(d, "ca.key")
    cert, key, csr = os.path.join(d, "server.pem"), os.path.join(d, "server.key"), os.path.join(d, "server.csr")
    ext = os.path.join(d, "server.ext")
    with open(ext, "w") as f:
        f.write("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n")
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", ca_key,
            "-out", ca, "-days", "2", "-subj", "/CN=shardserve openai_security_test CA",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", key, "-out", csr,
            "-subj", "/CN=127.0.0.1")
    openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert, "-days", "2",
            "-extfile", ext)
    return ca, cert, key


class HttpsAndKeysTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = work_dir("shardserve-openai-sec-")
        cls.ca, cert, key = make_certificates(cls.dir)
        keys = os.path.join(cls.dir, "keys")
        with open(keys, "w") as f:
            f.write("# test keys\nsk-other-key\n" + KEY + "\n")
        cls.http_port, grpc_port = free_ports(2)
        cls.base = f"https://127.0.0.1:{cls.http_port}"
        log_dir = os.path.join(cls.dir, "logs")
        env = dict(os.environ, SHARDSERVE_STATE_DIR=os.path.join(cls.dir, "state"))
        cls.launch = subprocess.Popen(
            [os.path.join(BIN, "shardserve"), "launch", "--metrics-port-base", "0", "--log-dir", log_dir,
             "--model", os.path.join(ROOT, "models", MODEL), "--nodes", "1", "--gpus-per-node", "1",
             "--address", f"127.0.0.1:{grpc_port}", "--http-port", str(cls.http_port),
             "--tls-cert", cert, "--tls-key", key, "--tls-ca", cls.ca, "--api-keys-file", keys],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            cls.https = httpx.Client(verify=ssl.create_default_context(cafile=cls.ca), timeout=10)
            deadline = time.monotonic() + scaled(120)
            while not cls.health_ok():
                if cls.launch.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"cluster did not become ready:\n{stop_launch(cls.launch)}")
                time.sleep(0.25)
            with open(os.path.join(log_dir, "coordinator.log")) as f:
                # launch given certificates serves /metrics over HTTPS with them too.
                cls.metrics_url = re.search(r"metrics on (https://\S+/metrics)", f.read()).group(1)
        except BaseException:
            stop_launch(cls.launch)
            raise

    @classmethod
    def tearDownClass(cls):
        cls.https.close()
        stop_launch(cls.launch)
        assert cls.launch.returncode is not None

    @classmethod
    def health_ok(cls) -> bool:
        try:
            return cls.https.get(cls.base + "/health").status_code == 200  # no key: /health is open
        except httpx.HTTPError:
            return False

    def client(self, api_key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=api_key, max_retries=0,
                             http_client=httpx.Client(verify=ssl.create_default_context(cafile=self.ca),
                                                         timeout=30))

    def auth_failures(self, reason: str) -> float:
        with urllib.request.urlopen(self.metrics_url, timeout=5,
                                    context=ssl.create_default_context(cafile=self.ca)) as r:
            text = r.read().decode()
        m = re.search(r'^shardserve_auth_failures_total\{[^}]*reason="%s"[^}]*\} (\S+)$' % reason, text, re.M)
        return float(m.group(1)) if m else 0.0

    def test_right_key_over_https_works(self):
        c = self.client(KEY)
        r = c.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
        self.assertEqual(r.usage.completion_tokens, 3)
        chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        self.assertEqual(chat.usage.completion_tokens, 2)
        self.assertEqual([m.id for m in c.models.list().data], [MODEL])

    def test_missing_or_wrong_key_is_401_and_counted(self):
        missing, invalid = self.auth_failures("missing_key"), self.auth_failures("invalid_key")
        with self.assertRaises(openai.AuthenticationError) as ctx:
            self.client("sk-wrong").completions.create(model=MODEL, prompt="Hello", max_tokens=1)
        self.assertEqual(ctx.exception.status_code, 401)
        self.assertEqual(ctx.exception.code, "invalid_api_key")
        self.assertEqual(ctx.exception.body["type"], "invalid_request_error")
        # No header at all (the openai client always sends one): the raw shape, and nothing echoed.
        r = self.https.post(self.base + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
        self.assertEqual(r.status_code, 401)
        error = r.json()["error"]
        self.assertEqual((error["type"], error["code"]), ("invalid_request_error", "invalid_api_key"))
        self.assertIn("Authorization: Bearer", error["message"])
        # On the same kept-alive connection: the refused POST's body was read, not left to be taken
        # for the next request.
        r = self.https.get(self.base + "/v1/models", headers={"Authorization": "Bearer " + KEY[:-1]})
        self.assertEqual(r.status_code, 401)
        self.assertNotIn(KEY[:-1], r.text)
        self.assertEqual(self.auth_failures("missing_key"), missing + 1)
        self.assertEqual(self.auth_failures("invalid_key"), invalid + 2)
        # The key is never logged.
        for name in os.listdir(os.path.join(self.dir, "logs")):
            with open(os.path.join(self.dir, "logs", name), errors="replace") as f:
                self.assertNotIn(KEY[:-1], f.read(), name)

    def test_stored_responses_are_their_keys(self):
        # A stored response is found only with the key that made it: to another key it is unknown.
        with self.client(KEY) as mine, self.client("sk-other-key") as other:
            r = mine.responses.create(model=MODEL, input="Hi", max_output_tokens=2, temperature=0,
                                      extra_headers={"X-Request-Id": "sec-stored-1"})
            self.assertEqual(r.id, "resp_sec-stored-1")
            self.assertEqual(mine.responses.retrieve(r.id).id, r.id)
            with self.assertRaises(openai.NotFoundError):
                other.responses.retrieve(r.id)
            with self.assertRaises(openai.NotFoundError):
                other.responses.input_items.list(r.id)
            with self.assertRaises(openai.NotFoundError):
                other.responses.delete(r.id)
            with self.assertRaises(openai.BadRequestError) as ctx:
                other.responses.create(model=MODEL, previous_response_id=r.id, input="x", max_output_tokens=2)
            self.assertEqual(ctx.exception.param, "previous_response_id")
            # Nor can another key take its id.
            with self.assertRaises(openai.BadRequestError) as ctx:
                other.responses.create(model=MODEL, input="x", max_output_tokens=2,
                                       extra_headers={"X-Request-Id": "sec-stored-1"})
            self.assertEqual(ctx.exception.param, "X-Request-Id")
            # Its own key continues it.
            after = mine.responses.create(model=MODEL, previous_response_id=r.id, input="x", max_output_tokens=2)
            self.assertGreater(after.usage.input_tokens, r.usage.input_tokens)

    def test_health_is_open(self):
        r = self.https.get(self.base + "/health")
        self.assertEqual(r.status_code, 200)
        self.assertEqual(r.json(), {"status": "ok"})
        # /version is not: it needs the key, as every route but /health.
        self.assertEqual(self.https.get(self.base + "/version").status_code, 401)
        r = self.https.get(self.base + "/version", headers={"Authorization": "Bearer " + KEY})
        self.assertEqual(r.status_code, 200)
        self.assertIn("version", r.json())

    def test_plain_http_to_the_https_port_fails(self):
        with self.assertRaises(openai.APIConnectionError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{self.http_port}/v1", api_key=KEY, max_retries=0,
                          timeout=10).models.list()
        # And https with a CA that did not sign the certificate: refused by the client.
        with self.assertRaises(httpx.ConnectError):
            httpx.get(self.base + "/health", timeout=10)  # the system's roots


class LoopbackRuleTest(unittest.TestCase):
    def coordinator(self, *flags):
        return subprocess.Popen(
            [os.path.join(BIN, "shardserve-coordinator"), "--model", os.path.join(ROOT, "models", MODEL),
             "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--http-port", str(free_port()), *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def test_every_interface_without_tls_and_keys_is_a_start_error(self):
        p = self.coordinator("--http-host", "0.0.0.0")
        out, _ = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 2, out)
        first = out.splitlines()[0]
        for flag in ("--http-host 0.0.0.0", "--tls-cert", "--api-keys-file", "--insecure"):
            self.assertIn(flag, first)

    def test_insecure_allows_it(self):
        p = self.coordinator("--http-host", "0.0.0.0", "--insecure")
        try:
            deadline = time.monotonic() + scaled(60)
            lines = []
            while time.monotonic() < deadline:
                line = p.stdout.readline()
                if not line:
                    break
                lines.append(line)
                if "OpenAI API on http://0.0.0.0:" in line:
                    break
            self.assertIn("OpenAI API on http://0.0.0.0:", "".join(lines))
        finally:
            p.send_signal(signal.SIGTERM)
            try:
                p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", required=True, help="directory holding shardserve, shardserve-coordinator, -worker")
    args, rest = parser.parse_known_args()
    BIN = args.bin
    run_unittests([sys.argv[0]] + rest)
