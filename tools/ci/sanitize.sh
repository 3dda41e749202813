#!/usr/bin/env bash
# The test programs built and run under sanitizers (docs/security.md, "Sanitizers"): no CUDA.
#
#   tools/ci/sanitize.sh asan [PROGRAM...]   # build-asan/: GCC, AddressSanitizer + UndefinedBehaviorSanitizer
#   tools/ci/sanitize.sh asan-all            # build-asan/: every target, the WHOLE CTest suite
#   tools/ci/sanitize.sh ci                  # CI's list (tools/test.sh runs it), built by clang in the
#                                            # fuzz targets' tree, build-fuzz/ (ASan + UBSan there too)
#   tools/ci/sanitize.sh tsan [PROGRAM...]   # build-tsan/: ThreadSanitizer (not in CI: docs/security.md)
#
# PROGRAM is a test program of tests/CMakeLists.txt (kernels_cpu_test, scheduler_test, ...); only
# those are built, and CTest runs their cases (each case is labelled with its program's name).
# Without PROGRAMs, each mode builds and runs its default list below.
#
# Where a sanitizer report goes, and what fails on it (every mode; halt_on_error everywhere, and
# -fno-sanitize-recover=undefined, so the first report ends its process):
# - In a test program itself: its case fails on the exit status (ASan and UBSan 1, TSan 66).
# - In a process tests/process_harness.h starts (the coordinators and workers of the multi-process
#   C++ tests): on that child's stderr, its log (the harness appends log_path=stderr to the
#   *SAN_OPTIONS it passes on); the harness scans the log when it reaps the child and fails the
#   test that started it, however the child ended. Per test, with the child's log kept.
# - In any other process (asan-all: those the Python, deploy and launch tests start, through
#   `shardserve launch` or directly, and the test programs themselves): ASan and LeakSanitizer
#   write it to build-asan/sanitizer-reports/report.<program>.<pid> (log_path), which nobody
#   deletes; asan-all prints those files at the end and fails if there is one. GCC's libubsan,
#   linked beside libasan, ignores log_path: a UBSan report there stays on that process's stderr
#   and ends it (exit status 1), which its test sees only as that process's failure.
# No sanitizer runs with abort_on_error, so a SIGABRT is our code's own abort (a failed CHECK),
# which the harness also fails a test on.
#
# tools/test.sh runs `ci`: ASan + UBSan on the programs that test the parsers of untrusted bytes
# and the newest memory-heavy code (CI_PROGRAMS below), which fit CI's budget; the full default
# list took 10 minutes to build on a 2-core machine (then 35 s of tests), beyond it. `ci` builds
# them in the fuzz targets' tree (tools/ci/fuzz.sh configure: clang, ASan + UBSan and the fuzzers'
# coverage instrumentation, which a test program links without libFuzzer), which tools/test.sh has
# just built for its fuzz step, so the libraries both link compile once. Run `asan` and
# `tsan` by hand after touching memory or threading code; docs/security.md ("Sanitizers") says what
# each covers and what it found.
#
# asan-all builds every target of the project in build-asan/ (shardserve, shardserve-coordinator,
# shardserve-worker, the tools, every test program) and runs every CTest case: the multi-process
# C++ tests and the Python tests start the instrumented binaries of build-asan/bin. Their deadlines
# are multiplied by SHARDSERVE_TEST_TIME_SCALE (default here 3; tests/process_harness.h and
# tests/cli_check.py read it). Not in CI: far beyond its budget (docs/security.md, "Sanitizers").
set -euo pipefail
cd "$(dirname "$0")/../.."

MODE=${1:?usage: tools/ci/sanitize.sh asan|tsan [PROGRAM...] | asan-all | ci}
shift
JOBS=${JOBS:-$(nproc)}
# Multi-process test programs built beside the default list, and the regex (ctest -R) of their
# cases that run after it, one at a time (tsan only).
PROCESS_PROGRAMS=()
PROCESS_CASES=

# CI's ASan + UBSan set: the OpenAI request and chat template parsers, the TLS/HTTPS/API-key code
# and the HTTP ports' connection loop, outside JSON, checkpoint and GPTQ loading (safetensors
# headers, config.json, packed weights), the tokenizer.
CI_PROGRAMS=(openai_protocol_test chat_template_test security_test https_test http_connection_test json_test checkpoint_test
             quantized_checkpoint_test tokenizer_test)

ALL=0
CI_MODE=0
if [ "$MODE" = ci ]; then
  MODE=asan
  CI_MODE=1
  BUILD_DIR=${FUZZ_BUILD_DIR:-build-fuzz}
  set -- "${CI_PROGRAMS[@]}"
elif [ "$MODE" = asan-all ]; then
  [ $# -eq 0 ] || { echo "tools/ci/sanitize.sh asan-all takes no PROGRAM (it runs the whole suite)" >&2; exit 2; }
  MODE=asan
  ALL=1
fi

case "$MODE" in
  asan)
    BUILD_DIR=${BUILD_DIR:-build-asan}
    SANITIZE=address,undefined
    # The test programs that start no processes. The multi-process ones (cluster_test,
    # batching_test, ...) and the Python tests need every binary built: asan-all runs them.
    DEFAULT=(kernels_cpu_test checkpoint_test tokenizer_test planner_test scheduler_test
             step_limits_test group_test persistent_batch_test sampler_test generation_test
             chat_template_test dummy_weights_test llama_parity_test communicator_test worker_pool_test)
    # halt_on_error: the first report ends the program, so a test cannot pass over it.
    # detect_leaks=1 stays on (the default): leak reports are findings like any other, except the
    # few in third-party code that tools/ci/lsan.supp lists, each with its reason.
    export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:detect_stack_use_after_return=1}
    export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
    export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$PWD/tools/ci/lsan.supp:print_suppressions=0}
    if [ "$ALL" = 1 ]; then
      # The processes the tests start inherit these. log_path: the reports of a process that no
      # harness watches go to REPORTS/report.<program>.<pid> (the header above).
      REPORTS=$PWD/$BUILD_DIR/sanitizer-reports
      rm -rf "$REPORTS" && mkdir -p "$REPORTS"
      export ASAN_OPTIONS="$ASAN_OPTIONS:log_path=$REPORTS/report:log_exe_name=1"
      export SHARDSERVE_TEST_TIME_SCALE=${SHARDSERVE_TEST_TIME_SCALE:-3}
    fi
    ;;
  tsan)
    BUILD_DIR=${BUILD_DIR:-build-tsan}
    SANITIZE=thread
    # The programs that run threads of ours in-process: the communicators (ranks as threads over
    # Gloo), the rendezvous service (gRPC's threads, the table, the grants), the worker pool (its
    # monitor thread), the HTTPS server, the tokenizer (concurrent encodes); then the scheduler,
    # batch, generation and group logic they call. tsan_absl_mutex_test checks
    # tools/ci/tsan_absl_mutex.cc, which every program of this build links (docs/security.md);
    # tsan_grpc_test that tools/ci/tsan.supp hides no race of ours in a gRPC handler.
    DEFAULT=(tsan_absl_mutex_test tsan_grpc_test communicator_test rendezvous_test worker_pool_test https_test
             tokenizer_test scheduler_test persistent_batch_test generation_test group_test)
    # Then the engine, the scheduler's loop, the worker service and the step executor, which run
    # only in the coordinator and worker processes: a subset of the multi-process tests (TP2, PP2,
    # TP2xPP2 parity; TP2xPP2 streaming, concurrent streams and a killed worker; a heal; expert
    # parallelism; continuous batching, preemption and cancellation) against the TSan-built
    # services, with every deadline the harness waits for a process scaled by
    # SHARDSERVE_TEST_TIME_SCALE. A report in a child process fails its test
    # (tests/process_harness.h reads the child's log when it reaps it).
    PROCESS_PROGRAMS=(cluster_test heal_test batching_test)
    PROCESS_CASES='ClusterParityTest[.]GreedyTokensMatchHuggingFace/TP(2_PP1|1_PP2|2_PP2)_llama3_rope( |$)'
    PROCESS_CASES+='|ClusterApiTest[.](StreamsOneTokenPerMessageWithUsageOnTheLast|ConcurrentRequestsEachGetTheirOwnStream)$'
    PROCESS_CASES+='|ClusterFailureTest[.]KilledWorkerEndsTheStreamWithUnavailable$'
    PROCESS_CASES+='|HealTest[.]SeededSamplingGivesTheSameTokensAcrossAHeal$'
    # Expert parallelism's all-to-all through shared memory across TP 2 x PP 2; the host CPU check's
    # gather when the TP group joins.
    PROCESS_CASES+='|ClusterExpertParallelTest[.]GreedyTokensMatchHuggingFace/TP2_PP2_qwen3_moe_tf5( |$)'
    PROCESS_CASES+='|WorkerFlagsTest[.]ATpGroupWithMoreThreadsThanCpusWarnsOnEveryRank$'
    # Not the one-worker (TP1_PP1) batching layouts: that worker runs 2 compute threads, whose
    # OpenMP loops crawl under TSan (0.3 tokens/s; 64 streams twice), and libgomp is not checked.
    PROCESS_CASES+='|^Layouts/(BatchingTest|PreemptionTest|BatchingCancelTest)[.].*/TP(1_PP2|2_PP2)( |$)'
    export SHARDSERVE_TEST_TIME_SCALE=${SHARDSERVE_TEST_TIME_SCALE:-10}
    # halt_on_error: the first report ends the program (the case fails). tools/ci/tsan.supp lists what
    # is not ours, each entry with its reason. history_size=7 (the most): the earlier access's stack
    # is restored more often, which the entries that match a library's frames (libgomp's threads)
    # need; a stack that still fails to restore leaves the report standing (a failure, not a hidden race).
    export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:history_size=7:suppressions=$PWD/tools/ci/tsan.supp}
    ;;
  *)
    echo "usage: tools/ci/sanitize.sh asan|tsan [PROGRAM...] | asan-all | ci" >&2
    exit 2
    ;;
esac

PROGRAMS=("$@")
if [ ${#PROGRAMS[@]} -eq 0 ]; then
  PROGRAMS=("${DEFAULT[@]}")
else
  PROCESS_PROGRAMS=()  # the PROGRAMs named, each with all its cases
fi

if [ "$ALL" = 1 ]; then
  echo "sanitize.sh: asan-all at $(git rev-parse --short HEAD), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)," \
       "SHARDSERVE_TEST_TIME_SCALE=$SHARDSERVE_TEST_TIME_SCALE"
  start=$(date +%s)
  cmake -S . -B "$BUILD_DIR" -G Ninja -DSHARDSERVE_WITH_CUDA=OFF -DSHARDSERVE_SANITIZE="$SANITIZE" >/dev/null
  cmake --build "$BUILD_DIR" -j "$JOBS"
  echo "sanitize.sh: asan-all build took $(( $(date +%s) - start )) s"
  start=$(date +%s)
  rc=0
  (cd "$BUILD_DIR" && ctest --output-on-failure -j "$JOBS" --timeout 900) || rc=$?
  echo "sanitize.sh: asan-all tests took $(( $(date +%s) - start )) s, load $(cut -d' ' -f1-3 /proc/loadavg)"
  reports=("$REPORTS"/report.*)
  if [ -e "${reports[0]}" ]; then
    for f in "${reports[@]}"; do echo "==== $f"; cat "$f"; done
    echo "sanitize.sh: ${#reports[@]} sanitizer report(s) under $REPORTS (above)" >&2
    rc=1
  fi
  exit "$rc"
fi

start=$(date +%s)
if [ "$CI_MODE" = 1 ]; then
  FUZZ_BUILD_DIR=$BUILD_DIR tools/ci/fuzz.sh configure
else
  cmake -S . -B "$BUILD_DIR" -G Ninja -DSHARDSERVE_WITH_CUDA=OFF -DSHARDSERVE_SANITIZE="$SANITIZE" >/dev/null
fi
cmake --build "$BUILD_DIR" -j "$JOBS" --target "${PROGRAMS[@]}" "${PROCESS_PROGRAMS[@]}"
echo "sanitize.sh: $MODE build took $(( $(date +%s) - start )) s"

labels=$(IFS='|'; echo "${PROGRAMS[*]}")
start=$(date +%s)
(cd "$BUILD_DIR" && ctest --output-on-failure -j "$JOBS" --timeout 900 -L "^($labels)\$")
if [ ${#PROCESS_PROGRAMS[@]} -gt 0 ]; then
  # One case at a time: each starts a coordinator and up to four workers.
  (cd "$BUILD_DIR" && ctest --output-on-failure -j 1 --timeout 1800 -R "$PROCESS_CASES")
fi
echo "sanitize.sh: $MODE tests took $(( $(date +%s) - start )) s"
