#!/usr/bin/env bash
# The serving benchmarks: `shardserve bench` against local CPU clusters of the benchmark model
# (tools/fixtures/make_bench_model.py: a random-weights 78.7M-parameter Llama, vocabulary 4096).
#
#   (1) TP=1: one stream, then 32 concurrent streams (closed loop): what batching buys.
#   (2) PP=2: micro-batched pipeline vs one micro-batch in flight (pp2/serial), 16 streams.
#   (3) (2) again with 512-token prompts and 32-token outputs.
# Each with the workers' default products (--matmul-dtype auto: bf16 for this bf16 checkpoint on a
# CPU with bf16 instructions, else float32), then with float32 products (--worker-matmul-dtype f32).
#
# Every run: random prompts of 128 token ids (seed 0), 128 output tokens each (ignore_eos), greedy.
# Request counts are chosen so that each measured run lasts at least ~15 s on a 2-core machine and
# the whole script stays well under 15 minutes (about 6). Tables go to stdout; each run's JSON to $OUT_DIR.
#
#   tools/bench/bench_serving.sh                       # builds build/ if needed, makes the model if absent
#   BIN_DIR=/other/bin tools/bench/bench_serving.sh    # use these binaries, build nothing
#   QUICK=1 tools/bench/bench_serving.sh               # a smoke test of the script: tiny runs, seconds
#   BENCH_FLAGS="--worker-threads 0" ...         # extra flags for every bench invocation
#
# Environment: BUILD_DIR (default build), BIN_DIR (default $BUILD_DIR/bin), MODEL_DIR (default
# build/bench-model), OUT_DIR (default /tmp/shardserve-bench-serving-<pid>).
set -euo pipefail
cd "$(dirname "$0")/../.."

BUILD_DIR=${BUILD_DIR:-build}
MODEL_DIR=${MODEL_DIR:-build/bench-model}
OUT_DIR=${OUT_DIR:-/tmp/shardserve-bench-serving-$$}
QUICK=${QUICK:-0}
# shellcheck disable=SC2206
EXTRA=(${BENCH_FLAGS:-})
start=$(date +%s)

if [ -z "${BIN_DIR:-}" ]; then
  BIN_DIR=$BUILD_DIR/bin
  if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
    cuda_flag=""
    command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] || cuda_flag=-DSHARDSERVE_WITH_CUDA=OFF
    # shellcheck disable=SC2086
    cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release $cuda_flag
  fi
  cmake --build "$BUILD_DIR" -j "$(nproc)" --target shardserve shardserve-coordinator shardserve-worker
fi
for b in shardserve shardserve-coordinator shardserve-worker; do
  [ -x "$BIN_DIR/$b" ] || { echo "bench_serving.sh: no $BIN_DIR/$b"; exit 1; }
done

if [ ! -f "$MODEL_DIR/model.safetensors" ] || [ ! -f "$MODEL_DIR/config.json" ]; then
  python3 tools/fixtures/make_bench_model.py "$MODEL_DIR"  # about a minute, standard library only
fi
mkdir -p "$OUT_DIR"

if [ "$QUICK" = 1 ]; then
  LEN=(--input-len 16 --output-len 8)
  N_SINGLE=2 N_BATCH=8 N_BATCH_F32=8 N_PP=4
else
  LEN=(--input-len 128 --output-len 128)
  # Measured on 2-core CI machines (shared, so +-30%): one stream 40-60 output tokens/s, so 5
  # requests take ~12 s. An Intel Xeon with AMX: 32 streams on TP=1 ~450 tokens/s with bf16
  # products (96 requests ~27 s), ~300 with float32 (64 requests ~27 s); PP=2 at 16 streams
  # 150-200 tokens/s; the whole script about 6 minutes. An AMD EPYC with AVX2 only (no bf16
  # products, so both blocks run float32): 32 streams 270-360 tokens/s (96 requests 35-45 s), PP=2
  # 145-240 tokens/s (~20-30 s per layout); the whole script roughly 10 minutes (not timed end to end).
  N_SINGLE=5 N_BATCH=96 N_BATCH_F32=64 N_PP=32
fi
if [ "$QUICK" = 1 ]; then LONG=(--input-len 32 --output-len 4); else LONG=(--input-len 512 --output-len 32); fi

bench() {  # bench NAME FLAGS...
  local name=$1
  shift
  echo
  echo "==== $name: shardserve bench $* ===="
  "$BIN_DIR/shardserve" bench --model "$MODEL_DIR" --log-dir "$OUT_DIR/logs-$name" --json-out "$OUT_DIR/$name.json" \
    "${LEN[@]}" "$@" "${EXTRA[@]}"
}

status=0
# Each block twice: the workers' default products ("" below), then float32 ones.
for products in "" f32; do
  P=() tag="" n_batch=$N_BATCH
  if [ -n "$products" ]; then P=(--worker-matmul-dtype "$products") tag="-$products" n_batch=$N_BATCH_F32; fi
  # (1) TP=1, one stream (one warm-up request), then 32 streams.
  bench "tp1$tag-c1" --compare tp1 "${P[@]}" --concurrency 1 --num-requests "$N_SINGLE" --warmup 1 || status=1
  bench "tp1$tag-c32" --compare tp1 "${P[@]}" --concurrency 32 --num-requests "$n_batch" --warmup 1 || status=1
  # (2) PP=2, micro-batches in flight (the coordinator's default: PP of them) vs one, 16 streams.
  bench "pp2$tag-c16" --compare pp2,pp2/serial "${P[@]}" --concurrency 16 --num-requests "$N_PP" --warmup 1 || status=1
  # (3) The same with long prompts and short outputs (512 in, 32 out): the stages are compute-bound.
  bench "pp2$tag-c16-long" --compare pp2,pp2/serial "${P[@]}" --concurrency 16 --num-requests "$N_PP" --warmup 1 \
    "${LONG[@]}" || status=1
done

echo
echo "bench_serving.sh: done in $(( $(date +%s) - start )) s; JSON and logs in $OUT_DIR"
exit $status
