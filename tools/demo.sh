#!/usr/bin/env bash
# The main job: installs what is missing, builds, starts a local TP=2 x PP=2 cluster on the CPU
# (a coordinator and 4 worker processes in 2 simulated nodes) serving the embedded demo model
# (models/demo), streams a completion, has a chat through the OpenAI-compatible HTTP API (curl),
# and shuts the cluster down.
#
#   tools/demo.sh ["prompt"]          (ADDRESS=localhost:50051 HTTP_PORT=8000 MAX_TOKENS=80 to change)
set -euo pipefail
cd "$(dirname "$0")/.."

PROMPT=${1:-"And the LORD said unto Moses,"}
ADDRESS=${ADDRESS:-localhost:50051}
HTTP_PORT=${HTTP_PORT:-8000}
MAX_TOKENS=${MAX_TOKENS:-80}
BUILD_DIR=${BUILD_DIR:-build}

tools/ci/install-deps.sh
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
# shellcheck disable=SC2086
cmake -S . -B "$BUILD_DIR" -G Ninja ${CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)" --target shardserve shardserve-coordinator shardserve-worker

BIN="$BUILD_DIR/bin"
"$BIN/shardserve" launch --nodes 2 --gpus-per-node 2 --device cpu --address "$ADDRESS" --http-port "$HTTP_PORT" &
LAUNCH=$!
# Whatever happens below, stop the cluster (launch stops every process it started).
trap 'kill -TERM $LAUNCH 2>/dev/null || true; wait $LAUNCH 2>/dev/null || true' EXIT

for _ in $(seq 1 240); do
  if "$BIN/shardserve" status --address "$ADDRESS" >/dev/null 2>&1; then break; fi
  if ! kill -0 $LAUNCH 2>/dev/null; then echo "demo: the cluster failed to start" >&2; exit 1; fi
  sleep 0.5
done
"$BIN/shardserve" status --address "$ADDRESS"
echo
echo "demo: prompt: $PROMPT"
# Sampled (seeded, so the demo is repeatable): greedy decoding of so small a model loops.
"$BIN/shardserve" generate --address "$ADDRESS" --prompt "$PROMPT" --max-tokens "$MAX_TOKENS" \
  --temperature 0.8 --top-k 40 --seed 7
echo
# The same cluster through the OpenAI API: the demo model's chat template (tokenizer_config.json)
# turns the conversation into its prompt.
echo "demo: chat through http://127.0.0.1:$HTTP_PORT/v1/chat/completions"
curl -sS --fail-with-body "http://127.0.0.1:$HTTP_PORT/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model": "demo", "max_tokens": 48, "temperature": 0.8, "seed": 7, "stop": ["\n"],
       "messages": [{"role": "system", "content": "You speak as the King James Bible."},
                    {"role": "user", "content": "Who made the heaven and the earth?"}]}' |
  python3 -c 'import json, sys; r = json.load(sys.stdin); print("assistant:", r["choices"][0]["message"]["content"].strip()); print("usage:", r["usage"])'
