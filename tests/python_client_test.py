"""Integration test of the Python client: starts a real local cluster (`shardserve launch`, a
coordinator and two worker processes on 127.0.0.1) on the embedded demo model and streams a
completion through clients/python/shardserve_client.py. Always stops the cluster it started.

Run by CTest as: clients/python/setup-env.sh, then
    .venv-client/bin/python tests/python_client_test.py --bin <build>/bin
"""
import argparse
import os
import signal
import subprocess
import sys
import time
import unittest

from cli_check import free_port, run_unittests, scaled, work_dir  # scaled: SHARDSERVE_TEST_TIME_SCALE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))

import grpc  # noqa: E402
from shardserve_client import Client  # noqa: E402

BIN = None  # set from --bin


class PythonClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.address = f"127.0.0.1:{free_port()}"
        cls.logs = work_dir("shardserve-pyclient-")
        # launch's default: mutual TLS inside the cluster, its CA and a client certificate named in
        # cluster.json in this state directory (our own: tests run in parallel).
        os.environ["SHARDSERVE_STATE_DIR"] = os.path.join(cls.logs, "state")
        cls.launch = subprocess.Popen(
            [os.path.join(BIN, "shardserve"), "launch", "--model", os.path.join(ROOT, "models", "demo"),
             "--nodes", "1", "--gpus-per-node", "2", "--address", cls.address, "--log-dir", cls.logs,
             "--metrics-port-base", "0", "--http-port", "0"],  # free metrics ports, no HTTP: tests run in parallel
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + scaled(120)
        cluster_file = os.path.join(cls.logs, "state", "cluster.json")
        while not os.path.exists(cluster_file):
            if cls.launch.poll() is not None or time.monotonic() > deadline:
                out = cls.stop_cluster()
                raise RuntimeError(f"launch wrote no {cluster_file}:\n{out}")
            time.sleep(0.1)
        cls.client = Client.from_local_cluster()
        while not cls.client.healthy():
            if cls.launch.poll() is not None or time.monotonic() > deadline:
                out = cls.stop_cluster()
                raise RuntimeError(f"cluster did not become ready:\n{out}")
            time.sleep(0.25)

    @classmethod
    def stop_cluster(cls) -> str:
        if cls.launch.poll() is None:
            cls.launch.send_signal(signal.SIGTERM)
        try:
            out, _ = cls.launch.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            cls.launch.kill()
            out, _ = cls.launch.communicate()
        return out or ""

    @classmethod
    def tearDownClass(cls):
        cls.stop_cluster()
        assert cls.launch.returncode is not None

    def test_generate_streams_text(self):
        deltas = list(self.client.generate("And God said", max_tokens=24))
        self.assertGreater(len(deltas), 1, "expected a stream of messages")
        last = deltas[-1]
        self.assertIn(last.finish_reason, ("STOP_TOKEN", "LENGTH", "STOP_STRING"))
        completion_ids = [i for d in deltas for i in d.token_ids]
        self.assertEqual(last.completion_tokens, len(completion_ids))
        self.assertEqual(last.prompt_tokens, len(self.client.tokenize("And God said")))
        text = "".join(d.text for d in deltas)
        self.assertTrue(text.strip(), "the completion has no text")
        self.assertTrue(any(c.isalpha() for c in text))
        print(f"completion: {text!r}")

    def test_seeded_sampling_reproduces(self):
        # The same seed twice: the same non-empty token ids, and so the same text.
        a = list(self.client.generate("In the beginning", max_tokens=16, temperature=0.8, seed=7))
        b = list(self.client.generate("In the beginning", max_tokens=16, temperature=0.8, seed=7))
        ids_a = [i for d in a for i in d.token_ids]
        ids_b = [i for d in b for i in d.token_ids]
        self.assertTrue(ids_a, "the first seeded stream has no tokens")
        self.assertTrue(ids_b, "the second seeded stream has no tokens")
        self.assertEqual(ids_a, ids_b)
        self.assertEqual("".join(d.text for d in a), "".join(d.text for d in b))

    def test_bad_request_is_invalid_argument(self):
        with self.assertRaises(grpc.RpcError) as ctx:
            list(self.client.generate("hello", max_tokens=-5))
        self.assertEqual(ctx.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)

    def test_launch_serves_tls(self):
        # The client above speaks TLS with the CA launch made; a plaintext client gets no answer.
        self.assertTrue(self.client.address == self.address)
        plaintext = Client(self.address)
        self.assertFalse(plaintext.healthy(timeout=5))
        with self.assertRaises(grpc.RpcError) as ctx:
            list(plaintext.generate("hello", max_tokens=2, timeout=10))
        self.assertEqual(ctx.exception.code(), grpc.StatusCode.UNAVAILABLE)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", required=True, help="directory holding shardserve, shardserve-coordinator, -worker")
    args, rest = parser.parse_known_args()
    BIN = args.bin
    run_unittests([sys.argv[0]] + rest)
