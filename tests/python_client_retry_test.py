"""The Python client's retry (clients/python/shardserve_client.py Client.generate): a request that
fails with UNAVAILABLE before its first streamed message is sent again (bounded, with backoff);
one that fails after a message, or with another code, is not. Against a fake InferenceService on
127.0.0.1 (grpcio's in-process server) that fails the first calls as a restarting coordinator
does; no cluster.

Run by CTest as: clients/python/setup-env.sh, then .venv-client/bin/python tests/python_client_retry_test.py
"""
import os
import sys
import threading
import unittest
from concurrent import futures

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))

import grpc  # noqa: E402
from shardserve_client import Client  # noqa: E402
from shardserve.v1 import inference_pb2, inference_pb2_grpc  # noqa: E402


class FakeService(inference_pb2_grpc.InferenceServiceServicer):
    """Generate fails the first `fail_first` calls with `code` before any message; then streams
    tokens 1, 2, 3 (and, with `fail_after_first`, fails after the first one)."""

    def __init__(self, fail_first, code=grpc.StatusCode.UNAVAILABLE, fail_after_first=False):
        self.fail_first = fail_first
        self.code = code
        self.fail_after_first = fail_after_first
        self.calls = 0
        self.lock = threading.Lock()

    def Generate(self, request, context):
        with self.lock:
            self.calls += 1
            call = self.calls
        if call <= self.fail_first:
            context.abort(self.code, "the coordinator is restarting (fake)")
        yield inference_pb2.GenerateResponse(token_ids=[1], text=b"a")
        if self.fail_after_first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the coordinator died mid-stream (fake)")
        yield inference_pb2.GenerateResponse(token_ids=[2, 3], text=b"bc",
                                             finish_reason=inference_pb2.FINISH_REASON_LENGTH)


class RetryTest(unittest.TestCase):
    def serve(self, service):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self.addCleanup(server.stop, None)
        return Client(f"127.0.0.1:{port}")

    def test_unavailable_before_the_first_token_is_retried(self):
        service = FakeService(fail_first=2)
        client = self.serve(service)
        deltas = list(client.generate("x", retries=3, retry_backoff=0.01, timeout=30))
        self.assertEqual([t for d in deltas for t in d.token_ids], [1, 2, 3])
        self.assertEqual(deltas[-1].finish_reason, "LENGTH")
        self.assertEqual(service.calls, 3)

    def test_retries_are_bounded(self):
        service = FakeService(fail_first=100)
        client = self.serve(service)
        with self.assertRaises(grpc.RpcError) as e:
            list(client.generate("x", retries=2, retry_backoff=0.01, timeout=30))
        self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(service.calls, 3)  # the first try and 2 retries

    def test_failure_after_a_token_is_not_retried(self):
        service = FakeService(fail_first=0, fail_after_first=True)
        client = self.serve(service)
        got = []
        with self.assertRaises(grpc.RpcError) as e:
            for d in client.generate("x", retries=3, retry_backoff=0.01, timeout=30):
                got += d.token_ids
        self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(got, [1])
        self.assertEqual(service.calls, 1)

    def test_other_codes_are_not_retried(self):
        service = FakeService(fail_first=1, code=grpc.StatusCode.INVALID_ARGUMENT)
        client = self.serve(service)
        with self.assertRaises(grpc.RpcError) as e:
            list(client.generate("x", retries=3, retry_backoff=0.01, timeout=30))
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertEqual(service.calls, 1)

    def test_no_server_is_retried_then_fails(self):
        client = Client("127.0.0.1:1")  # nothing listens: connection refused, UNAVAILABLE
        with self.assertRaises(grpc.RpcError) as e:
            list(client.generate("x", retries=2, retry_backoff=0.01, timeout=30))
        self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE)


if __name__ == "__main__":
    unittest.main()
