#!/usr/bin/env bash
# Runs the GPU tests on a machine that has a GPU, the CUDA 13 runtime, cuBLAS and NCCL, but not
# the Debian packages the project builds with (a cloud GPU box, a CUDA container): build here,
# pack, copy the bundle over, run there.
#
#   tools/gpu/gpu-tests.sh pack [BUNDLE]     here: copies the GPU test binaries, the shardserve CLI and
#                                        services, and every shared library they need except the C
#                                        runtime and CUDA's own (libcudart, libcublas(Lt), libnccl)
#                                        into BUNDLE (default build/gpu-bundle), debug info stripped
#                                        (KEEP_DEBUG=1 keeps it), as one .tar.xz
#   tools/gpu/gpu-tests.sh run [BUNDLE]      there, from a checkout of the same commit: unpacks if
#                                        needed, finds CUDA's libraries, and runs
#                                          kernels_cuda_test    every CUDA op against the CPU backend
#                                                               (not the CudaQuantBench benchmark)
#                                          kernels_moe_test     the mixture-of-experts ops, CPU and CUDA
#                                          communicator_test    the NCCL tests one GPU can run (all
#                                                               with two GPUs; else the two-rank cases
#                                                               are reported as not run, by name)
#                                          llama_parity_test    Hugging Face parity on the CUDA backend
#                                        each judged by its gtest XML (judge_gtest below): a failed
#                                        or a skipped case fails it (a GPU machine skips nothing but
#                                        the CPU's own AVX-512 bf16 cases), not only its exit code;
#                                        then the demo model: `generate-ids` on cuda:0 beside
#                                        cpu (agreement reported), and `launch --device cuda` streaming
#                                        a completion. Logs and the tests' XML go to $LOG_DIR
#                                        (default BUNDLE/logs); each step is stopped after
#                                        $STEP_TIMEOUT s (default 300). Exits non-zero if any
#                                        step failed.
#   tools/gpu/gpu-tests.sh exec CMD [ARG...] there: runs CMD with build/gpu-bundle's libraries, e.g.
#                                        build/gpu-bundle/bin/shardserve bench --device cuda ...
#
# The tests find their fixtures under the source directory compiled into them; where that path is
# absent on the GPU machine, `run` links it to this checkout.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

BINARIES=(kernels_cuda_test kernels_moe_test communicator_test llama_parity_test shardserve shardserve-coordinator shardserve-worker)
# Left to the GPU machine: the C runtime, and CUDA's libraries, which must match its driver.
SYSTEM_LIBS='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|libpthread\.|librt\.|libstdc\+\+|libgcc_s|libcuda\.|libcudart|libcublas|libnccl)'

# The gtest judgement of both GPU scripts (this one's run, tools/gpu/gpu-bench.sh's steps), one home:
# judge_gtest XML [--allow-skip REGEX] prints the XML's case counts as JSON (tools/gpu/gpu_bench_report.py
# junit) and fails when a case failed, when the XML holds no case, or, with $GPUS set (the number of
# GPUs; unset or empty where there is none, as in gpu-bench's dry run), when a case was skipped whose
# message does not match REGEX: on a GPU machine a CUDA case that skips (a driver problem, a missing
# library) is a failure, not a pass.
judge_gtest() {
  python3 "$(dirname "${BASH_SOURCE[0]}")/gpu_bench_report.py" junit "$@" ${GPUS:+--gpu}
}
# kernels_cuda_test's op tests: all but CudaQuantBench, a benchmark that skips unless asked for
# (SHARDSERVE_QUANT_BENCH; gpu-bench.sh's quant-* steps run it).
CUDA_OPS_FILTER='-CudaQuantBench.*'
# The GPUs nvidia-smi lists (0 without it).
gpu_count() { nvidia-smi -L 2>/dev/null | grep -c '^GPU'; }
# The skips llama_parity_test may make on a GPU machine: the CPU's own bf16 cases on a CPU without
# AVX-512 BF16.
PARITY_ALLOWED_SKIP='no AVX-512'
# communicator_test's NCCL cases for a machine with N GPUs (nccl_filter N): all of them with two or
# more; on one GPU those one rank can run (NCCL refuses two ranks on one GPU), the others,
# NCCL_TWO_RANK_CASES, reported as not run by name.
NCCL_TWO_RANK_CASES="CommunicatorTest.NcclTwoRanks, CommunicatorTest.NcclRankThatSkipsAnAllReduceIsATimeout"
nccl_filter() {
  if [ "${1:-0}" -ge 2 ]; then echo '*Nccl*'; else echo '*NcclGroupOfOne*:*NcclRankThatNeverJoinsTimesOut*'; fi
}

pack() {
  local bundle=${1:-build/gpu-bundle} bin=${BUILD_DIR:-build}/bin
  rm -rf "$bundle" "$bundle".tar.xz.part*of* && mkdir -p "$bundle/bin" "$bundle/lib" || return 1
  for b in "${BINARIES[@]}"; do
    [ -x "$bin/$b" ] || { echo "gpu-tests: $bin/$b is missing; build it first" >&2; return 1; }
    cp "$bin/$b" "$bundle/bin/"
  done
  ldd "${BINARIES[@]/#/$bin/}" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
    while read -r name path; do
      [[ $name =~ $SYSTEM_LIBS ]] || cp -L "$path" "$bundle/lib/$name"
    done
  # Debug info is most of a RelWithDebInfo binary's size and of no use there: stripped, the bundle
  # fits in what a device run carries (KEEP_DEBUG=1 keeps it).
  if [ "${KEEP_DEBUG:-0}" != 1 ]; then strip --strip-debug "$bundle"/bin/* "$bundle"/lib/* || return 1; fi
  pwd >"$bundle/source-dir"
  # xz -9's 64 MiB window holds a binary and the next: their CUDA kernels (the same 15.7 MiB fatbin
  # in each of them) are then stored once, and the bundle is 22 MiB instead of 48.
  XZ_OPT=${XZ_OPT:--9} tar -C "$bundle" -cJf "$bundle.tar.xz" bin lib source-dir && rm -rf "$bundle" || return 1
  echo "gpu-tests: packed $(du -h "$bundle.tar.xz" | cut -f1) into $bundle.tar.xz"
}

# The directories holding CUDA's libraries on this machine (toolkit or pip wheels).
cuda_lib_dirs() {
  local dirs=() lib found
  for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
    found=$(find /usr/local /usr/lib /opt -name "$lib" 2>/dev/null | head -1)
    [ -n "$found" ] || { echo "gpu-tests: $lib not found on this machine" >&2; return 1; }
    dirs+=("$(dirname "$found")")
  done
  printf '%s\n' "${dirs[@]}" | awk '!seen[$0]++' | paste -sd:
}

# A bundle larger than one copy may carry travels as pieces: split_bundle FILE MAX_BYTES splits FILE
# into FILE.part1ofN .. FILE.partNofN of at most MAX_BYTES each (N the fewest that do; FILE removed;
# nothing done where FILE fits), and unpack joins them.
split_bundle() {
  local file=$1 max=$2 size n k
  size=$(stat -c %s "$file") || return 1
  rm -f "$file".part*of*
  n=$(((size + max - 1) / max))
  [ "$n" -gt 1 ] || return 0
  split -n "$n" -d -a 4 "$file" "$file.split." || return 1
  for k in $(seq 1 "$n"); do
    mv "$file.split.$(printf %04d $((k - 1)))" "$file.part${k}of$n" || return 1
  done
  rm -f "$file"
}

# The pieces of FILE in order, one a line; exit 1 (quietly) where there are none, 2 (saying what)
# where one is missing or pieces of two packs lie there.
bundle_pieces() {
  local file=$1 n k pieces=("$1".part*of*)
  [ -e "${pieces[0]}" ] || return 1
  n=${pieces[0]##*of}
  for k in $(seq 1 "$n"); do
    [ -f "$file.part${k}of$n" ] || { echo "gpu-tests: $file.part${k}of$n is missing: copy every piece pack wrote" >&2; return 2; }
  done
  [ "${#pieces[@]}" -eq "$n" ] || { echo "gpu-tests: pieces of more than one pack: ${pieces[*]}" >&2; return 2; }
  for k in $(seq 1 "$n"); do echo "$file.part${k}of$n"; done
}

# unpack BUNDLE [keep]: unpacks the bundle afresh (so that no earlier bundle's binaries stay) from
# its pieces where there are any, else from BUNDLE.tar.xz where present; nothing where neither is.
# The pieces are removed once unpacked (kept with `keep`), so that no piece of this pack can mix
# with the next one's.
unpack() {
  local bundle=$1 keep=${2:-} listed rc pieces
  listed=$(bundle_pieces "$bundle.tar.xz")
  rc=$?
  if [ $rc -eq 0 ]; then
    mapfile -t pieces <<<"$listed"
    rm -rf "$bundle" && mkdir -p "$bundle" || return 1
    if ! cat "${pieces[@]}" | tar -C "$bundle" -xJ; then
      echo "gpu-tests: the pieces at $bundle.tar.xz.part* do not join into one bundle (pieces of different packs?): pack again and copy every piece" >&2
      return 1
    fi
    [ "$keep" = keep ] || rm -f "${pieces[@]}"
  elif [ $rc -eq 2 ]; then
    return 1
  elif [ -f "$bundle.tar.xz" ]; then
    rm -rf "$bundle" && mkdir -p "$bundle" && tar -C "$bundle" -xJf "$bundle.tar.xz" || return 1
  fi
}

# Unpacks the bundle (unpack), links the compiled-in source directory to this checkout where it is
# absent, and points LD_LIBRARY_PATH at the bundle's and CUDA's libraries.
setup() {
  local bundle=$1 src cuda_dirs
  unpack "$bundle" || return 1
  [ -f "$bundle/source-dir" ] || { echo "gpu-tests: no bundle at $bundle(.tar.xz or its pieces); run pack first" >&2; return 1; }
  src=$(cat "$bundle/source-dir")
  if [ ! -e "$src" ]; then mkdir -p "$(dirname "$src")" && ln -s "$PWD" "$src"; fi
  cuda_dirs=$(cuda_lib_dirs) || return 1
  export LD_LIBRARY_PATH=$PWD/$bundle/lib:$cuda_dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}

# run's steps. run_step NAME COMMAND...: runs COMMAND for at most $STEP_TIMEOUT s, its output in
# $logs/NAME.log (the last lines echoed), and sets failed=1 unless it exits 0. run_gtest NAME
# [--allow-skip REGEX] BINARY [ARGS...]: run_step with gtest's XML output, then judge_gtest on the XML
# (its counts in $logs/NAME.counts.json): a failed or, on a GPU, skipped case sets failed=1 too (a
# run with skipped cases exits 77, tests/gtest_main.cc: the XML says whether they were allowed). Both
# use the caller's $logs and $failed (run's locals); run_step leaves the exit status in $step_rc.
run_step() {
  local name=$1 rc
  shift
  echo "== $name: $*"
  timeout "${STEP_TIMEOUT:-300}" "$@" >"$logs/$name.log" 2>&1
  rc=$?
  step_rc=$rc
  tail -n 25 "$logs/$name.log"
  echo "== $name: exit $rc"
  [ $rc -eq 0 ] || failed=1
}
run_gtest() {
  local name=$1 allow=()
  shift
  if [ "$1" = --allow-skip ]; then allow=(--allow-skip "$2"); shift 2; fi
  local failed_before=$failed
  run_step "$name" "$@" --gtest_output="xml:$logs/$name.xml"
  [ "$step_rc" = 77 ] && failed=$failed_before  # skips: judged on the XML below
  if ! judge_gtest "$logs/$name.xml" "${allow[@]}" >"$logs/$name.counts.json" 2>>"$logs/$name.log"; then
    echo "== $name: FAILED by its XML: $(tail -n 1 "$logs/$name.log")"
    failed=1
  fi
}

run() {
  local bundle=${1:-build/gpu-bundle} failed=0
  setup "$bundle" || return 1
  local logs=${LOG_DIR:-$bundle/logs} bin=$bundle/bin
  mkdir -p "$logs"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$logs/gpu.txt"
  local GPUS
  GPUS=$(gpu_count)
  [ "$GPUS" -ge 1 ] || { echo "gpu-tests: nvidia-smi lists no GPU" >&2; return 1; }

  run_gtest kernels_cuda_test "$bin/kernels_cuda_test" --gtest_filter="$CUDA_OPS_FILTER"
  run_gtest kernels_moe_test "$bin/kernels_moe_test"
  run_gtest communicator_nccl "$bin/communicator_test" --gtest_filter="$(nccl_filter "$GPUS")"
  [ "$GPUS" -ge 2 ] || echo "gpu-tests: not run (needs 2 GPUs): $NCCL_TWO_RANK_CASES"
  run_gtest llama_parity_test --allow-skip "$PARITY_ALLOWED_SKIP" "$bin/llama_parity_test"

  # The demo model (a bf16 checkpoint) in one process: cuda:0 computes in bf16, the CPU in
  # float32, so greedy ids may part at a near-tie; how many agree is reported, not checked (the
  # parity suite above checks the arithmetic).
  local prompt_ids=(1 450 3681 310 278 3186 338)
  run_step generate_ids_cpu "$bin/shardserve" generate-ids --model models/demo --max-new-tokens 32 --device cpu "${prompt_ids[@]}"
  run_step generate_ids_cuda "$bin/shardserve" generate-ids --model models/demo --max-new-tokens 32 --device cuda:0 "${prompt_ids[@]}"
  paste -d'\n' <(tail -n 1 "$logs/generate_ids_cpu.log") <(tail -n 1 "$logs/generate_ids_cuda.log") |
    awk 'NR == 1 {n = split($0, a)} NR == 2 {split($0, b); k = 0; while (k < n && a[k + 1] == b[k + 1]) ++k;
         print "gpu-tests: the first " k " of " n " greedy ids on cuda:0 (bf16) equal the CPU'"'"'s (float32)"}'

  # A one-GPU cluster (coordinator + one CUDA worker) streaming a completion.
  local address=127.0.0.1:50071
  "$bin/shardserve" launch --model models/demo --device cuda --nodes 1 --gpus-per-node 1 --address "$address" \
    --http-port 0 >"$logs/launch.log" 2>&1 &
  local launch=$!
  local ready=0
  for _ in $(seq 1 120); do
    if "$bin/shardserve" status --address "$address" >"$logs/status.log" 2>&1; then ready=1; break; fi
    kill -0 $launch 2>/dev/null || break
    sleep 0.5
  done
  if [ $ready -eq 1 ]; then
    cat "$logs/status.log"
    run_step generate_stream "$bin/shardserve" generate --address "$address" --prompt "And the LORD said unto Moses," \
      --max-tokens 48 --temperature 0.8 --top-k 40 --seed 7
  else
    echo "gpu-tests: the one-GPU cluster did not become ready"; tail -n 30 "$logs/launch.log"; failed=1
  fi
  kill -TERM $launch 2>/dev/null; wait $launch 2>/dev/null
  tail -n 5 "$logs/launch.log"
  return $failed
}

# Sourced (tools/gpu/gpu-bench.sh uses pack and setup): define the functions only.
[[ "${BASH_SOURCE[0]}" == "$0" ]] || return 0

case "${1:-}" in
  pack) shift; pack "$@" ;;
  run) shift; run "$@" ;;
  exec) shift; setup build/gpu-bundle && exec "$@" ;;
  *) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 2 ;;  # the header comment
esac
