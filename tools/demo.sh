#!/usr/bin/env bash
# The main job: installs what is missing, builds, starts a local TP=2 x PP=2 cluster on the CPU
# (a coordinator and 4 worker processes in 2 simulated nodes) serving the embedded demo model
# (models/demo), streams a completion, and shuts the cluster down.
#
#   tools/demo.sh ["prompt"]          (ADDRESS=localhost:50051 MAX_TOKENS=80 to change)
set -euo pipefail
cd "$(dirname "$0")/.."

PROMPT=${1:-"And the LORD said unto Moses,"}
ADDRESS=${ADDRESS:-localhost:50051}
MAX_TOKENS=${MAX_TOKENS:-80}
BUILD_DIR=${BUILD_DIR:-build}

tools/install-deps.sh
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
# shellcheck disable=SC2086
cmake -S . -B "$BUILD_DIR" -G Ninja ${CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)" --target shardserve shardserve-coordinator shardserve-worker

BIN="$BUILD_DIR/bin"
"$BIN/shardserve" launch --nodes 2 --gpus-per-node 2 --device cpu --address "$ADDRESS" &
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
