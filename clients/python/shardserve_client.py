"""A Python client for shardserve's gRPC API (shardserve.v1.InferenceService).

Set up once:   clients/python/setup-env.sh           (venv with grpcio + stubs generated from proto/)
               (grpc.health.v1 comes from grpcio-health-checking)
Use:           .venv-client/bin/python clients/python/shardserve_client.py --prompt "And God said"

As a library:
    client = Client("localhost:50051")                      # plaintext
    client = Client("host:50051", tls_ca="ca.pem", api_key="...")   # TLS, API key
    client = Client.from_local_cluster()                    # what `shardserve launch` wrote
    for delta in client.generate("And God said", max_tokens=32):
        print(delta.text, end="", flush=True)

TLS and keys as the `shardserve` client commands take them (docs/security.md): tls_ca verifies the
coordinator's certificate, tls_cert/tls_key present a client certificate, api_key is sent as
'authorization: Bearer <key>' (default: $SHARDSERVE_API_KEY).
"""
import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gen"))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from shardserve.v1 import inference_pb2, inference_pb2_grpc  # noqa: E402

DEFAULT_ADDRESS = "localhost:50051"
# generate(): how often a request that failed with UNAVAILABLE before its first streamed message is
# sent again (a coordinator restarting, a group healing), and the first wait (doubling, at most
# _MAX_RETRY_BACKOFF_S).
DEFAULT_RETRIES = 5
DEFAULT_RETRY_BACKOFF_S = 0.5
_MAX_RETRY_BACKOFF_S = 8.0


@dataclass
class Delta:
    """One streamed message: new token ids and the text they add."""
    token_ids: List[int]
    text: str
    finish_reason: Optional[str]  # set on the last message: "STOP_TOKEN", "STOP_STRING", "LENGTH"
    prompt_tokens: int
    completion_tokens: int
    # With logprobs=True: per token (token id, logprob, [(alternative id, logprob), ...]).
    logprobs: List[Tuple[int, float, List[Tuple[int, float]]]] = field(default_factory=list)


def state_dir() -> str:
    """Where `shardserve launch` writes cluster.json (as tools/cli/client.h StateDir)."""
    if os.environ.get("SHARDSERVE_STATE_DIR"):
        return os.environ["SHARDSERVE_STATE_DIR"]
    if os.environ.get("XDG_RUNTIME_DIR"):
        return os.path.join(os.environ["XDG_RUNTIME_DIR"], "shardserve")
    return os.path.join(os.path.expanduser("~"), ".shardserve", "local")


def _read(path: Optional[str]) -> Optional[bytes]:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


class Client:
    def __init__(self, address: str = DEFAULT_ADDRESS, tls_ca: Optional[str] = None, tls_cert: Optional[str] = None,
                 tls_key: Optional[str] = None, api_key: Optional[str] = None):
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if tls_ca or tls_cert:
            creds = grpc.ssl_channel_credentials(root_certificates=_read(tls_ca), private_key=_read(tls_key),
                                                 certificate_chain=_read(tls_cert))
            self._channel = grpc.secure_channel(address, creds)
        else:
            self._channel = grpc.insecure_channel(address)
        api_key = api_key if api_key is not None else os.environ.get("SHARDSERVE_API_KEY")
        self._metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
        self.address = address
        self._stub = inference_pb2_grpc.InferenceServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    @classmethod
    def from_local_cluster(cls, api_key: Optional[str] = None) -> "Client":
        """A client of the cluster `shardserve launch` runs, from its cluster.json (address, CA,
        client certificate); plaintext to localhost:50051 when there is none."""
        path = os.path.join(state_dir(), "cluster.json")
        if not os.path.exists(path):
            return cls(DEFAULT_ADDRESS, api_key=api_key)
        with open(path) as f:
            c = json.load(f)
        try:
            os.kill(int(c.get("pid", 0)), 0)
        except ProcessLookupError:  # left by a launch that was killed: no cluster there any more
            return cls(DEFAULT_ADDRESS, api_key=api_key)
        except (PermissionError, ValueError, OverflowError):
            pass
        return cls(c["address"], tls_ca=c.get("ca") or None, tls_cert=c.get("cert") or None,
                   tls_key=c.get("key") or None, api_key=api_key)

    def healthy(self, timeout: float = 2.0) -> bool:
        """True when the coordinator reports SERVING (the whole worker group is up)."""
        try:
            resp = self._health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def generate(self, prompt: str, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: Optional[int] = None, stop: Optional[List[str]] = None,
                 timeout: float = 300.0, retries: int = DEFAULT_RETRIES,
                 retry_backoff: float = DEFAULT_RETRY_BACKOFF_S, **sampling_fields) -> Iterator[Delta]:
        """Streams a completion. Raises grpc.RpcError (e.g. UNAVAILABLE when a worker is down,
        RESOURCE_EXHAUSTED when the server is full). `sampling_fields` sets any other SamplingParams
        field (min_p, repetition_penalty, presence_penalty, frequency_penalty, logprobs,
        top_logprobs, ignore_eos, stop_token_ids); docs/api.md lists them.

        A request that fails with UNAVAILABLE before its first streamed message (the coordinator
        restarting or not yet serving, a connection refused) is sent again, at most `retries`
        times, after `retry_backoff` seconds, doubling up to 8 s, within `timeout` in all. One that
        fails after a message came is not (its caller has seen tokens): the error is raised."""
        # text, stop and request_id are bytes on the wire (inference.proto): UTF-8 here.
        sampling = inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                                top_p=top_p, stop=[s.encode("utf-8") for s in stop or []],
                                                **sampling_fields)
        if seed is not None:
            sampling.seed = seed
        request = inference_pb2.GenerateRequest(text=prompt.encode("utf-8"), sampling=sampling)
        deadline = time.monotonic() + timeout
        attempt = 0
        while True:
            started = False
            try:
                for msg in self._stub.Generate(request, timeout=max(0.001, deadline - time.monotonic()),
                                               metadata=self._metadata):
                    started = True
                    yield _delta(msg)
                return
            except grpc.RpcError as e:
                wait = min(retry_backoff * (2 ** attempt), _MAX_RETRY_BACKOFF_S)
                if (started or e.code() != grpc.StatusCode.UNAVAILABLE or attempt >= retries
                        or time.monotonic() + wait >= deadline):
                    raise
                attempt += 1
                time.sleep(wait)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> List[int]:
        resp = self._stub.Tokenize(inference_pb2.TokenizeRequest(text=text.encode("utf-8"),
                                                                 add_special_tokens=add_special_tokens),
                                   timeout=10, metadata=self._metadata)
        return list(resp.ids)


def _delta(msg) -> Delta:
    finish = None
    if msg.finish_reason != inference_pb2.FINISH_REASON_UNSPECIFIED:
        finish = inference_pb2.FinishReason.Name(msg.finish_reason).replace("FINISH_REASON_", "")
    logprobs = [(l.token_id, l.logprob, [(t.token_id, t.logprob) for t in l.top_logprobs]) for l in msg.logprobs]
    return Delta(list(msg.token_ids), msg.text, finish, msg.usage.prompt_tokens, msg.usage.completion_tokens, logprobs)


def main() -> int:
    parser = argparse.ArgumentParser(description="Stream a completion from a shardserve coordinator.")
    parser.add_argument("--address", help=f"the coordinator (default: the local cluster's, else {DEFAULT_ADDRESS})")
    parser.add_argument("--tls-ca")
    parser.add_argument("--tls-cert")
    parser.add_argument("--tls-key")
    parser.add_argument("--api-key", help="default: $SHARDSERVE_API_KEY")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int)
    args = parser.parse_args()
    if args.address is None and not (args.tls_ca or args.tls_cert):
        client = Client.from_local_cluster(api_key=args.api_key)
    else:
        client = Client(args.address or DEFAULT_ADDRESS, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                        tls_key=args.tls_key, api_key=args.api_key)
    try:
        for delta in client.generate(args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                     seed=args.seed):
            print(delta.text, end="", flush=True)
            if delta.finish_reason:
                print(f"\n[finish: {delta.finish_reason}, prompt tokens {delta.prompt_tokens}, "
                      f"completion tokens {delta.completion_tokens}]", file=sys.stderr)
    except grpc.RpcError as e:
        print(f"\nshardserve: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
