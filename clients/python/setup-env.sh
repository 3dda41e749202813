#!/usr/bin/env bash
# Creates the Python client's environment and its gRPC stubs. Safe to re-run.
#   clients/python/setup-env.sh        -> .venv-client/ (repo root) and clients/python/gen/
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${VENV:-$ROOT/.venv-client}"
# grpcio-health-checking carries the grpc.health.v1 stubs (as grpc_health.v1). openai: the official
# OpenAI client, which tests/openai_api_test.py drives the HTTP API with (httpx pinned with it: the
# client's HTTP library; a client with the Responses API). jsonschema: tests/openai_structured_test.py
# validates structured outputs.
OPENAI=1.109.1
PINS=(grpcio==1.66.2 grpcio-tools==1.66.2 grpcio-health-checking==1.66.2 protobuf==5.27.2 "openai==$OPENAI" httpx==0.28.1
      jsonschema==4.23.0)

# One setup at a time (CTest runs the Python tests in parallel): the others wait, then find it done.
exec 9>"$VENV.lock"
flock 9
if [ ! -x "$VENV/bin/python" ]; then python3 -m venv "$VENV"; fi
if ! "$VENV/bin/python" -c "import grpc, grpc_tools, grpc_health, openai, jsonschema; assert openai.__version__ == '$OPENAI'" \
    2>/dev/null; then
  "$VENV/bin/pip" install -q --disable-pip-version-check "${PINS[@]}"
fi
# Stubs from proto/, the single source of the wire format.
mkdir -p "$HERE/gen"
"$VENV/bin/python" -m grpc_tools.protoc -I "$ROOT/proto" --python_out="$HERE/gen" --grpc_python_out="$HERE/gen" \
  "$ROOT/proto/shardserve/v1/inference.proto"
echo "$VENV/bin/python"
