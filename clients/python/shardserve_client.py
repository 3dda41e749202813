"""A Python client for shardserve's gRPC API (shardserve.v1.InferenceService).

Set up once:   clients/python/setup-env.sh           (venv with grpcio + stubs generated from proto/)
               (grpc.health.v1 comes from grpcio-health-checking)
Use:           .venv-client/bin/python clients/python/shardserve_client.py --prompt "And God said"

As a library:
    client = Client("localhost:50051")
    for delta in client.generate("And God said", max_tokens=32):
        print(delta.text, end="", flush=True)
"""
import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gen"))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from shardserve.v1 import inference_pb2, inference_pb2_grpc  # noqa: E402

DEFAULT_ADDRESS = "localhost:50051"


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


class Client:
    def __init__(self, address: str = DEFAULT_ADDRESS):
        self._channel = grpc.insecure_channel(address)
        self._stub = inference_pb2_grpc.InferenceServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def healthy(self, timeout: float = 2.0) -> bool:
        """True when the coordinator reports SERVING (the whole worker group is up)."""
        try:
            resp = self._health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def generate(self, prompt: str, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: Optional[int] = None, stop: Optional[List[str]] = None,
                 timeout: float = 300.0, **sampling_fields) -> Iterator[Delta]:
        """Streams a completion. Raises grpc.RpcError (e.g. UNAVAILABLE when a worker is down,
        RESOURCE_EXHAUSTED when the server is full). `sampling_fields` sets any other SamplingParams
        field (min_p, repetition_penalty, presence_penalty, frequency_penalty, logprobs,
        top_logprobs, ignore_eos, stop_token_ids); the README lists them."""
        # text, stop and request_id are bytes on the wire (inference.proto): UTF-8 here.
        sampling = inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                                top_p=top_p, stop=[s.encode("utf-8") for s in stop or []],
                                                **sampling_fields)
        if seed is not None:
            sampling.seed = seed
        request = inference_pb2.GenerateRequest(text=prompt.encode("utf-8"), sampling=sampling)
        for msg in self._stub.Generate(request, timeout=timeout):
            finish = None
            if msg.finish_reason != inference_pb2.FINISH_REASON_UNSPECIFIED:
                finish = inference_pb2.FinishReason.Name(msg.finish_reason).replace("FINISH_REASON_", "")
            logprobs = [(l.token_id, l.logprob, [(t.token_id, t.logprob) for t in l.top_logprobs])
                        for l in msg.logprobs]
            yield Delta(list(msg.token_ids), msg.text, finish, msg.usage.prompt_tokens, msg.usage.completion_tokens,
                        logprobs)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> List[int]:
        resp = self._stub.Tokenize(inference_pb2.TokenizeRequest(text=text.encode("utf-8"),
                                                                 add_special_tokens=add_special_tokens),
                                   timeout=10)
        return list(resp.ids)


def main() -> int:
    parser = argparse.ArgumentParser(description="Stream a completion from a shardserve coordinator.")
    parser.add_argument("--address", default=DEFAULT_ADDRESS)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int)
    args = parser.parse_args()
    client = Client(args.address)
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
