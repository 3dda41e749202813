#!/usr/bin/env bash
# The libFuzzer targets of fuzz/ (docs/security.md, "Fuzzing"): build them with clang, ASan and
# UBSan in build-fuzz/, and run each over a copy of its seed corpus for a bounded time.
#
#   tools/ci/fuzz.sh configure             # configure build-fuzz/ (clang, ASan + UBSan, no CUDA)
#   tools/ci/fuzz.sh build                 # configure it and build the targets
#   tools/ci/fuzz.sh run [SECONDS [TARGET...]]  # each target for SECONDS (default 60); fails on any crash
#   tools/ci/fuzz.sh seeds [write]         # the seeds the targets write themselves (SEED_WRITERS) are
#                                       # the committed ones, else fail naming them; write: rewrite them
#   tools/ci/fuzz.sh ci                    # build, check the written seeds, then run each target a
#                                       # fixed number of times (CI)
#   tools/ci/fuzz.sh runs N [TARGET...]    # each target for N executions (-runs=N), e.g. 1000000; with
#                                       # FUZZ_MAX_SECONDS=S, or S seconds if that comes first
#
# Runs use a scratch copy of fuzz/corpus/NAME (under build-fuzz/corpus/) so that the committed seeds
# only change by hand; a crashing input is left in build-fuzz/crashes/NAME/ and the script fails.
# Each run prints its executions, exec/s and the corpus size it ended with.
set -euo pipefail
cd "$(dirname "$0")/../.."

BUILD_DIR=${FUZZ_BUILD_DIR:-build-fuzz}
JOBS=${JOBS:-$(nproc)}
TARGETS=(safetensors config tokenizer_json tokenize request chat_template openai_request coordinator_message worker_message
         safetensors_index quantized_linear mxfp4_experts generation_config tokenizer_config http_request grammar chat_output)
# Longest input each target is given: safetensors and tokenizer.json seeds are a few KB to 43 KB, gpt-oss's
# chat template 16.4 KiB (17.2 KiB as tokenizer_config.json).
declare -A MAX_LEN=([safetensors]=8192 [config]=4096 [tokenizer_json]=65536 [tokenize]=4096 [request]=4096 [chat_template]=20480
                       [openai_request]=8192 [coordinator_message]=8192 [worker_message]=4096
                       [safetensors_index]=8192 [quantized_linear]=16384 [mxfp4_experts]=8192 [generation_config]=1024
                       [tokenizer_config]=20480 [http_request]=8192 [grammar]=4096 [chat_output]=4096)
# CI runs each target a fixed number of executions from a fixed seed (a time bound would test more
# or less on a faster or slower machine), JOBS targets side by side. The runs still differ from one
# clone to another (docs/security.md, "In CI"): a crash they find is a defect to fix. Sized from the runs' times in one
# CI run on a 2-core AMD EPYC (Zen 4), one target after the other: 7 s (grammar) to 101 s (config),
# 980 s in all; safetensors_index (259 exec/s: each input is a whole index and its shards to check)
# runs 20,000 times, about 80 s; chat_output (seven formats, each output parsed whole and in pieces,
# calls whole and streamed) 150,000 times, 1,800 exec/s on a quiet machine. request's inputs may
# carry a structured output, compiled over the demo vocabulary, hence its 100,000.
declare -A CI_RUNS=([safetensors]=500000 [config]=600000 [tokenizer_json]=50000 [tokenize]=400000 [request]=100000
                    [chat_template]=60000 [openai_request]=200000 [coordinator_message]=500000 [worker_message]=300000
                    [safetensors_index]=20000 [quantized_linear]=10000 [mxfp4_experts]=20000 [generation_config]=600000
                    [tokenizer_config]=20000 [http_request]=20000 [grammar]=10000 [chat_output]=150000)

# The targets that write their own seeds (SHARDSERVE_FUZZ_WRITE_SEEDS=DIR, fuzz/seeds.h) from the code
# that builds valid inputs: a seed written before a message or format changed (a protocol version
# bumped) would be refused at its first message and fuzz nothing past it, so CI checks them.
SEED_WRITERS=(coordinator_message worker_message quantized_linear mxfp4_experts)

# The tree also holds the test programs (not built here): CI's ASan + UBSan programs are built in
# it (tools/ci/sanitize.sh ci), so that the libraries both link compile once.
configure() {
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DSHARDSERVE_WITH_CUDA=OFF -DSHARDSERVE_FUZZ=ON -DSHARDSERVE_BUILD_TESTS=ON >/dev/null
}

build() {
  local start
  start=$(date +%s)
  configure
  cmake --build "$BUILD_DIR" -j "$JOBS" --target "${TARGETS[@]/%/_fuzzer}"
  echo "fuzz.sh: build took $(( $(date +%s) - start )) s"
}

# run_one NAME LIBFUZZER_ARGS...: one target over a scratch copy of its corpus. Given -runs=N, it
# fails unless the target made its N executions: libFuzzer exits 0 when -max_total_time ends a run
# first, so a slow machine would otherwise pass a run that fuzzed less than it says.
run_one() {
  local name=$1; shift
  local bin=$BUILD_DIR/bin/${name}_fuzzer corpus=$BUILD_DIR/corpus/$name crashes=$BUILD_DIR/crashes/$name
  local log=$BUILD_DIR/logs/$name.log
  [ -x "$bin" ] || { echo "fuzz.sh: $bin is not built (tools/ci/fuzz.sh build)"; return 1; }
  rm -rf "$corpus" && mkdir -p "$corpus" "$crashes" "$(dirname "$log")"
  cp fuzz/corpus/"$name"/* "$corpus"/
  local start rc=0
  start=$(date +%s%N)
  # -print_final_stats: the number of runs and exec/s; -artifact_prefix: where a crash goes.
  # fuzz/NAME.dict, when there is one: the tokens of its format (JSON keys, markers).
  local dict=()
  [ -f fuzz/"$name".dict ] && dict=(-dict=fuzz/"$name".dict)
  "$bin" "$@" "${dict[@]}" -max_len="${MAX_LEN[$name]}" -rss_limit_mb=2048 -timeout=25 -print_final_stats=1 \
    -artifact_prefix="$crashes/" "$corpus" >"$log" 2>&1 || rc=$?
  local secs runs speed files
  secs=$(( ($(date +%s%N) - start) / 1000000000 ))
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  files=$(find "$corpus" -type f | wc -l)
  printf 'fuzz.sh: %-15s %10s executions %8s exec/s %6s s corpus %4s files  %s\n' \
    "$name" "${runs:-?}" "${speed:-?}" "$secs" "$files" "$([ $rc -eq 0 ] && echo 'no crash' || echo "CRASH (rc $rc): $log")"
  if [ $rc -ne 0 ]; then
    grep -E "ERROR|SUMMARY|fuzzer:|Test unit written" "$log" | head -20
    return 1
  fi
  local arg
  for arg in "$@"; do
    if [[ $arg == -runs=* ]] && [ "${runs:-0}" -lt "${arg#-runs=}" ]; then
      echo "fuzz.sh: $name made ${runs:-0} of its ${arg#-runs=} executions before -max_total_time ended it"
      return 1
    fi
  done
}

# seeds [write]: each SEED_WRITERS target writes its seeds into a scratch folder; each must be in
# fuzz/corpus/NAME byte for byte (other files there, inputs fuzzing found, are left alone). With
# `write`, the written ones replace the committed ones.
seeds() {
  local mode=${1:-check} stale=0 name file
  for name in "${SEED_WRITERS[@]}"; do
    local bin=$BUILD_DIR/bin/${name}_fuzzer out=$BUILD_DIR/written-seeds/$name
    [ -x "$bin" ] || { echo "fuzz.sh: $bin is not built (tools/ci/fuzz.sh build)"; return 1; }
    rm -rf "$out" && mkdir -p "$out"
    SHARDSERVE_FUZZ_WRITE_SEEDS=$out "$bin" >"$out.log" 2>&1 || { echo "fuzz.sh: $name's seed writer failed:"; cat "$out.log"; return 1; }
    [ -n "$(ls -A "$out")" ] || { echo "fuzz.sh: $name wrote no seed"; return 1; }
    for file in "$out"/*; do
      if [ "$mode" = write ]; then
        cp "$file" fuzz/corpus/"$name"/
      elif ! cmp -s "$file" fuzz/corpus/"$name"/"$(basename "$file")"; then
        echo "fuzz.sh: fuzz/corpus/$name/$(basename "$file") is not what $name writes today"
        stale=1
      fi
    done
  done
  if [ "$stale" -ne 0 ]; then
    echo "fuzz.sh: rewrite them with tools/ci/fuzz.sh seeds write (docs/security.md, \"Fuzzing\")"
    return 1
  fi
  echo "fuzz.sh: the written seeds of ${SEED_WRITERS[*]} are current"
}

run_all() {
  local failed=0 name
  for name in "$@"; do run_one "$name" "${EXTRA_ARGS[@]}" || failed=1; done
  return $failed
}

cmd=${1:-}
case "$cmd" in
  configure) configure ;;
  build) build ;;
  run)
    EXTRA_ARGS=(-max_total_time="${2:-60}")
    shift $(( $# < 2 ? $# : 2 ))
    if [ $# -gt 0 ]; then run_all "$@"; else run_all "${TARGETS[@]}"; fi ;;
  runs)
    # -max_total_time=0: no time bound.
    EXTRA_ARGS=(-runs="${2:?tools/ci/fuzz.sh runs N [TARGET...]}" -max_total_time="${FUZZ_MAX_SECONDS:-0}")
    shift 2
    if [ $# -gt 0 ]; then run_all "$@"; else run_all "${TARGETS[@]}"; fi ;;
  seeds) seeds "${2:-check}" ;;
  ci)
    build
    seeds || exit 1
    # JOBS targets at a time: a libFuzzer run is one process on one core, and each run is its own
    # (its corpus copy, log and crash folder), so running them side by side changes no run.
    failed=0 running=0
    for name in "${TARGETS[@]}"; do
      if [ "$running" -ge "$JOBS" ]; then
        wait -n || failed=1
        running=$((running - 1))
      fi
      # -max_total_time only guards against a hang; the run count ends each run.
      run_one "$name" -seed=1 -runs="${CI_RUNS[$name]}" -max_total_time=600 &
      running=$((running + 1))
    done
    while [ "$running" -gt 0 ]; do
      wait -n || failed=1
      running=$((running - 1))
    done
    exit $failed ;;
  *)
    sed -n '2,17p' "$0"
    exit 2 ;;
esac
