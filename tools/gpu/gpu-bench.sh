#!/usr/bin/env bash
# The GPU run: the CUDA op tests, the parity tests and the benchmarks at real sizes, in one
# command of at most 10 minutes on a one-GPU machine with no network and no Debian packages
# (docs/gpu.md gives the exact `run` invocation). Packing and setup are tools/gpu/gpu-tests.sh's.
#
#   tools/gpu/gpu-bench.sh pack       here: packs the binaries of $BUILD_DIR (default build-cuda, a
#                                 CUDA build) into build/gpu-bundle.tar.xz with gpu-tests.sh pack,
#                                 then checks that the bundle plus the working tree that travels
#                                 with it stay under the 64 MiB a run carries, printing the sizes;
#                                 where they do not, splits the bundle into pieces that each do
#                                 (build/gpu-bundle.tar.xz.part1ofN ..., copied one at a time to
#                                 the same machine; `run` joins them)
#   tools/gpu/gpu-bench.sh dry-run    here, without a GPU: pack (BUILD_DIR=build will do for a rehearsal),
#                                 then every step of `run` with its command checked (the binary or
#                                 script there and executable, the configs written, the HF script's
#                                 --check) instead of run, and the results written as `run` writes
#                                 them (each step "skipped: dry run")
#   tools/gpu/gpu-bench.sh run [OUT]  there: every step, each bounded in time and the whole within
#                                 $BUDGET_S seconds (default 540); results in OUT (or $OUT when no
#                                 folder is given: one of them is needed): results.json, results.md (a table for
#                                 docs/performance.md) and logs.tar.gz. Exit 1 if a step failed.
#
# STEPS="gpu membw ..." (names below) runs only those steps, to split the run over several
# commands of 10 minutes (docs/gpu.md); unset: all of them. BENCH_FLAGS adds flags to every
# benchmark's `shardserve bench --compare` (e.g. "--worker-dummy-weights host": the weights made on
# the host and copied instead of made in GPU memory, the default); TP_LAYOUTS replaces
# tp-on-one-gpu's list.
#
# Steps, in order (cheapest and most needed first, so that a run cut short keeps them):
#   gpu            nvidia-smi's name, memory and driver; the card's datasheet bandwidth by name
#   membw          tools/gpu/bench_membw.cu built with the machine's nvcc: streaming-read GB/s (the roofline)
#   cuda-ops       kernels_cuda_test (but the CudaQuantBench benchmark); a skipped case is a failure
#                  on a GPU
#   quant-int4-b1, quant-int8-b1, quant-int4-mma-b1, quant-int4-pdl-b1, quant-int4-folded-b1
#                  kernels_cuda_test's CudaQuantBench: Llama-3-8B's linear layers in int4 / int8 at
#                  batch 1 with the CUDA quantized-weight GEMV (CudaBackendOptions::
#                  quantized_kernels): tokens/s and the weight GB/s, beside membw's roofline; the
#                  third int4 on the tensor cores (int4_mma: slower than the GEMV on the H200, off by
#                  default), the fourth with programmatic dependent launch (pdl: not yet run), the
#                  fifth the GEMV with the zero point folded out (int4_folded: not yet run)
#   ncu-gemv-int4, ncu-gemv-int4-mma, ncu-gemv-int4-folded, ncu-gemv-int4-stalls,
#   ncu-gemv-int4-mma-stalls
#                  Nsight Compute's SpeedOfLight on the int4 GEMV's seven shapes of one token (the
#                  second: the tensor-core one, the third: the folded one); the -stalls pair adds the Occupancy, LaunchStats,
#                  SchedulerStats and WarpStateStats sections (where the warps wait)
#   ncu-decode, ncu-decode-cublas, ncu-decode-unfused
#                  Nsight Compute: one 8B decode step's GPU time by kernel (tools/gpu/ncu_summary.py),
#                  the second with cuBLAS for the decode products (--no-cuda-dense-gemv), the third
#                  with the fused kernels off (--no-cuda-fused-kernels: add + RMSNorm, RoPE + cache
#                  write, gate + up + SiLU each as separate kernels)
#   nccl           communicator_test's NCCL cases that one GPU can run; the two-rank cases are
#                  listed as not run (needs 2 GPUs) by name
#   parity         llama_parity_test (skips allowed only for the CPU's own bf16 instructions)
#   llama8b-b1     Llama-3-8B shapes, dummy bf16 weights, TP=1: batch-1 decode (bench --compare tp1,
#                  128 in / 128 out); cold start (launch to SERVING) and planner vs measured memory
#                  from the workers' logs
#   llama8b-c64    the same, 64 streams of 512 in / 128 out
#   llama8b-b1-plain, llama8b-c64-plain
#                  the two above with the CUDA paths that are on by default turned off
#                  (--worker-no-cuda-graphs, --worker-no-cuda-split-attention, --worker-no-cuda-fused-kernels,
#                  --worker-no-cuda-dense-gemv): what step graphs, split-KV attention, the fused
#                  kernels and the dense GEMV gain
#   llama8b-b1-sync
#                  llama8b-b1 with each step sent once the one before is back (--no-async-scheduling):
#                  what asynchronous scheduling gains where the host's cores idle while the GPU works
#   llama8b-b1-cublas
#                  llama8b-b1 with cuBLAS for the decode products (--worker-no-cuda-dense-gemv): what
#                  the dense GEMV gains alone
#   llama8b-b1-unfused
#                  llama8b-b1 with the fused kernels off (--worker-no-cuda-fused-kernels): what the
#                  fused add + RMSNorm, RoPE + KV-cache write and gate + up + SiLU gain
#   llama8b-b1-pdl, llama8b-c64-pdl
#                  llama8b-b1 and llama8b-c64 with programmatic dependent launch (--worker-cuda-pdl:
#                  written without a GPU, off by default until this and its parity cases pass)
#   llama8b-eagle3-b1, llama8b-eagle3-c64
#                  llama8b-b1 and llama8b-c64 speculating with an EAGLE-3 head of the published
#                  head's shapes (tests/fixtures/configs/eagle3-llama-3.1-8b.json), dummy weights, 3
#                  guesses a step (at 64 streams too: --speculative-max-running 0): the machinery's cost
#   llama8b-b1-long, llama8b-b1-long-plain
#                  batch-1 decode after a 4096-token prompt, with the defaults and plain
#   llama8b-int4-b1, llama8b-int8-b1, llama8b-int4-mma-b1
#                  llama8b-b1 with the weights quantized at load (--quantization: the CUDA
#                  quantized-weight kernels): the batch-1 figure against the packed bytes; the
#                  third with int4 on the tensor cores (--worker-cuda-int4-mma)
#   llama8b-int4-pdl-b1, llama8b-int4-folded-b1
#                  llama8b-int4-b1 with programmatic dependent launch (--worker-cuda-pdl), with the
#                  int4 GEMV with the zero folded out (--worker-cuda-int4-folded)
#   qwen72b-int4-b1, qwen72b-int4-mma-b1
#                  the whole Qwen2.5-72B (80 layers) quantized to int4 at load on the one GPU, batch
#                  1 (beside the 12.3 tok/s published for bitsandbytes NF4 on two A100s); the
#                  second with --worker-cuda-int4-mma
#   llama8b-cold-safetensors
#                  the cold start from a real checkpoint: the 8B's 16 GB written as bf16 safetensors to
#                  the machine's disk (tools/fixtures/write_config_checkpoint.py), the page cache dropped if
#                  allowed, then bench --compare tp1 through the real load path: launch to SERVING
#                  (the target: < 20 s)
#   llama8b-fp8-c64, llama8b-fp8-gemm-c64
#                  llama8b-c64 with the weights in fp8 (--quantization fp8): the prefills' products
#                  by the weight dequantized to bf16 + cuBLAS, then by cuBLASLt's fp8 GEMM on x
#                  rounded to e4m3 (--worker-cuda-fp8-gemm: written without a GPU, off)
#   hf-b1-eager    Hugging Face transformers, same config, random bf16, static cache, eager decoding
#                  (--no-compile)
#   hf-b1, hf-c64  the same with torch.compile (1 and 64 streams)
#   qwen72b-stage-b1, qwen72b-stage-c64
#                  Qwen2.5-72B's first 40 layers (config with num_hidden_layers 40 and the embedding
#                  tied as the LM head, so the device holds what PP stage 0 holds), KV tokens beside
#                  the planner's figure
#   qwen3-8b-b1, qwen3-8b-c64, gemma3-12b-b1, gemma3-12b-c64
#                  Qwen3-8B's and Gemma-3-12B's shapes (from the 32B's and 27B's configs), dummy bf16
#                  weights, 1 stream 128/128 and 64 streams 512/128, against the roofline
#   qwen3-30b-a3b-b1, qwen3-30b-a3b-c64, gpt-oss-20b-b1, deepseek-v3-4-layers-b1
#                  mixtures of experts on the one GPU: Qwen3-30B-A3B whole, gpt-oss-20b's shape (24
#                  layers, 32 experts, from the 120b's config; plain bf16 experts), and DeepSeek-V3's
#                  shapes cut to 4 layers (1 dense, 3 of 256 experts; multi-head latent attention);
#                  the roofline counts the experts a step reads at its batch (the planner's)
#   qwen3-30b-a3b-grouped-b1, qwen3-30b-a3b-grouped-c64
#                  the same Qwen3-30B-A3B steps with the experts as one grouped GEMV and the decode
#                  steps as graphs (--worker-cuda-moe-grouped: not yet run on a GPU)
#   tp-on-one-gpu  tools/gpu/gpu_layouts_check.py: TP=2, PP=2 and TP2xPP2 as worker processes sharing the
#                  GPU (--worker-collectives gloo: host-staged), and TP=1 with the dummy weights made
#                  on the host (the others make them in GPU memory), each against generate-ids (one
#                  process, host-made weights): the same greedy tokens, in float32 (TP_LAYOUTS
#                  overrides the list); the workers' kernels per decode step
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=tools/gpu/gpu-tests.sh
source tools/gpu/gpu-tests.sh

BUNDLE=build/gpu-bundle
CARRY_LIMIT=$((64 << 20))
CARRY_MARGIN=$((256 << 10))  # files that appear in the tree before the copy (logs, caches)
REPORT=(python3 tools/gpu/gpu_bench_report.py)

usage() {
  sed -n '2,/^[^#]/{/^#/p}' "$0" >&2
  exit 2
}

# Bytes of the working tree a run carries: tracked and untracked-not-ignored files.
tree_bytes() {
  git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | awk 'END {print $1 + 0}'
}

# Packs, then checks the bundle against what one copy carries beside the working tree; where it does
# not fit, splits it into pieces that each do (split_bundle: carried one at a time, joined by setup).
pack_checked() {
  BUILD_DIR=${BUILD_DIR:-build-cuda} pack "$BUNDLE" || return 1
  local bundle tree room
  bundle=$(stat -c %s "$BUNDLE.tar.xz") || return 1
  tree=$(tree_bytes)
  room=$((CARRY_LIMIT - tree - CARRY_MARGIN))
  awk -v b="$bundle" -v t="$tree" -v l="$CARRY_LIMIT" 'BEGIN {
    printf "gpu-bench: bundle %.1f MiB + working tree %.1f MiB = %.1f MiB of the %.0f MiB a run carries\n",
           b / 1048576, t / 1048576, (b + t) / 1048576, l / 1048576 }'
  if [ "$room" -lt $((1 << 20)) ]; then
    echo "gpu-bench: the working tree alone leaves no room for the bundle: trim the tree" >&2
    return 1
  fi
  split_bundle "$BUNDLE.tar.xz" "$room" || return 1
  if [ ! -f "$BUNDLE.tar.xz" ]; then
    echo "gpu-bench: too large for one copy: split into pieces of at most $((room >> 10)) KiB, to be copied" \
      "one at a time beside the tree into build/ (setup joins them):"
    ls -l "$BUNDLE".tar.xz.part*of* | awk '{printf "  %s %.1f MiB\n", $NF, $5 / 1048576}'
  fi
}

# The card's datasheet memory bandwidth, GB/s, from nvidia-smi's name; 0 when unknown.
datasheet_gbps() {
  case "$1" in
    *H200*) echo 4800 ;;
    *H100*NVL*) echo 3900 ;;
    *H100*PCIe*) echo 2000 ;;
    *H100*) echo 3350 ;;  # SXM (HBM3)
    *A100*80GB*PCIe*) echo 1935 ;;
    *A100*80GB*) echo 2039 ;;
    *A100*) echo 1555 ;;
    *L40S*) echo 864 ;;
    *) echo 0 ;;
  esac
}

# The planner's cluster preset closest to the GPU (for `shardserve plan`).
plan_preset() {
  case "$1" in
    *H200*) echo 1x1xH200-141GB ;;
    *A100*80GB*) echo 1x1xA100-80GB ;;
    *A100*) echo 1x1xA100-40GB ;;
    *) echo 1x1xH100-80GB ;;
  esac
}

remaining() { echo $((BUDGET - (SECONDS - START))); }

# Whether step NAME is to run ($STEPS unset, or naming it).
want() { [ -z "${STEPS:-}" ] || [[ " $STEPS " == *" $1 "* ]]; }

# step NAME LIMIT CMD...: runs CMD (stdout and stderr to $LOGS/NAME.log) for at most LIMIT seconds
# and what is left of the budget; sets STEP_RC and STEP_S. Dry run: checks that CMD's program is
# there and executable (or a function of this script), and runs nothing (STEP_RC 0), unless
# DRY_RUN_RUNS=1 is set for the call (a command that is cheap and needs no GPU, e.g. --check).
step() {
  local name=$1 limit=$2 left
  shift 2
  STEP_S=0
  echo "== $name: $*"
  if [ "$DRY_RUN" = 1 ] && [ "${DRY_RUN_RUNS:-0}" != 1 ]; then
    if [ "$(type -t "$1")" = function ] || [ -x "$1" ] || command -v "$1" >/dev/null; then
      STEP_RC=0
    else
      echo "gpu-bench: dry run: $name: $1 is not there" >&2
      STEP_RC=127
    fi
    return
  fi
  left=$(($(remaining) - 15))
  [ "$DRY_RUN" = 1 ] && left=$limit
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    echo "== $name: not run, out of time"
    STEP_RC=124
    return
  fi
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  STEP_RC=$?
  STEP_S=$((SECONDS - t0))
  tail -n 15 "$LOGS/$name.log"
  echo "== $name: exit $STEP_RC in ${STEP_S}s"
}

# record NAME [ARGS...]: the step's record from STEP_RC (0 passed; 124/137 after a time-out, noted).
record() {
  local name=$1 status=passed note=""
  shift
  if [ "$DRY_RUN" = 1 ]; then
    [ "$STEP_RC" = 0 ] && status=skipped || status=failed
    note="dry run: command checked, not run"
    [ "$STEP_RC" = 0 ] || note="dry run: the command is not there or failed (exit $STEP_RC)"
  elif [ "$STEP_RC" = 124 ] || [ "$STEP_RC" = 137 ]; then
    status=failed
    note="stopped at its time limit (or not started: out of time)"
  elif [ "$STEP_RC" != 0 ]; then
    status=failed
    note="exit $STEP_RC; see logs/$name.log"
  fi
  "${REPORT[@]}" record "$RECORDS" "$(printf '%02d' "$STEP_NO")-$name" "$status" "$STEP_S" --note "$note" "$@" ||
    echo "gpu-bench: could not record $name" >&2
  STEP_NO=$((STEP_NO + 1))
}

# gtest_step NAME LIMIT [--allow-skip REGEX] BINARY [GTEST ARGS...]: runs a gtest binary with XML
# output and judges it by the XML (judge_gtest, tools/gpu/gpu-tests.sh: a skipped case fails on a GPU),
# not only by its exit code.
gtest_step() {
  local name=$1 limit=$2 allow=()
  want "$name" || return 0
  shift 2
  if [ "$1" = --allow-skip ]; then allow=(--allow-skip "$2"); shift 2; fi
  local xml=$LOGS/$name.xml
  step "$name" "$limit" "$@" --gtest_output="xml:$xml"
  local counts=""
  if [ "$DRY_RUN" != 1 ]; then
    local rc=$STEP_RC
    counts=$(judge_gtest "$xml" "${allow[@]}" 2>>"$LOGS/$name.log")
    [ $? -ne 0 ] && [ "$rc" = 0 ] && STEP_RC=1  # a skip on a GPU, or no XML
    echo "$counts" >"$LOGS/$name.counts.json"
  fi
  local metrics=()
  if [ -s "$LOGS/$name.counts.json" ]; then metrics=(--json "$LOGS/$name.counts.json"); fi
  record "$name" "${metrics[@]}"
}

# A --model directory holding only config.json (--load-format dummy needs nothing else).
config_dir() {  # config_dir NAME SOURCE_JSON [PYTHON EXPRESSION ON c]
  local dir=$WORK/models/$1
  mkdir -p "$dir" &&
    python3 - "$2" "$dir/config.json" "${3:-}" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
if sys.argv[3]:
    exec(sys.argv[3])
json.dump(c, open(sys.argv[2], "w"), indent=2)
EOF
  echo "$dir"
}

# kernels_metric LOG_DIR: "--metric kernels_per_decode_step=N", N the largest figure of the
# workers' "kernels per decode step: N" log lines under LOG_DIR (a CUDA worker logs it when it
# changes: worker/worker_service.cc; with TP = 1 the one worker's is the model's), or nothing.
kernels_metric() {
  local n
  n=$(grep -rhoE 'kernels per decode step: [0-9]+' "$1" 2>/dev/null | awk '{print $NF}' | sort -n | tail -1)
  [ -n "$n" ] && echo "--metric kernels_per_decode_step=$n"
}

# bench_step NAME MODEL_DIR PRESET CONCURRENCY REQUESTS INPUT OUTPUT [QUANT [FLAG ...]]: shardserve
# bench --compare tp1 with dummy weights on cuda (LOAD_FORMAT=auto: the checkpoint's; BENCH_LIMIT:
# seconds, default 240) (QUANT: quantized at load, --quantization QUANT, with
# the CUDA quantized-weight kernels; FLAGs: more bench flags), recorded with its figures, the bytes a
# decode step reads (from the plan: the weights, but the embedding table of an untied model, of which
# a step reads one row a token; + the mean context's KV cache) and the workers' memory lines.
bench_step() {
  local name=$1 model=$2 preset=$3 conc=$4 reqs=$5 in=$6 out=$7 quant=${8:-} extra=("${@:9}")
  want "$name" || return 0
  local json=$WORK/$name.json plan=$WORK/$name.plan.json qplan=() qbench=()
  if [ -n "$quant" ]; then
    qplan=(--quantization "$quant")
    qbench=(--quantization "$quant")
  fi
  "$BIN/shardserve" plan --config "$model/config.json" --cluster "$preset" --decode-batch "$conc" --json "${qplan[@]}" \
    >"$plan" 2>/dev/null
  step "$name" "${BENCH_LIMIT:-240}" "$BIN/shardserve" bench --compare tp1 --model "$model" --device cuda --load-format "${LOAD_FORMAT:-dummy}" \
    --concurrency "$conc" --num-requests "$reqs" --warmup 1 --input-len "$in" --output-len "$out" \
    --log-dir "$LOGS/$name" --json-out "$json" "${qbench[@]}" "${extra[@]}" ${BENCH_FLAGS:-}
  local derived=()
  if [ -s "$plan" ]; then
    derived=($(python3 - "$plan" "$model/config.json" "$conc" "$in" "$out" <<'EOF'
import json, sys
p = json.load(open(sys.argv[1])); c = json.load(open(sys.argv[2])); conc, i, o = map(int, sys.argv[3:6])
g = p["per_gpu"][0]
t = c.get("text_config", c)  # a multimodal checkpoint's text model
# One decode step reads the weights once, but an untied model's embedding table (one row a token:
# its LM head is a matrix of its own), and each stream's KV cache (its mean context: the prompt and
# half the output). The table stays in the checkpoint's dtype whatever the quantization. Of a
# mixture of experts' expert weights, a step reads those of the experts its batch chose: the
# planner's experts_read of the layer's experts at this batch (E (1 - (1 - k/E)^B) on average).
table = 0 if t.get("tie_word_embeddings", c.get("tie_word_embeddings")) else t["vocab_size"] * t["hidden_size"] * (4 if c.get("torch_dtype") == "float32" else 2)
experts = t.get("num_experts") or t.get("num_local_experts") or t.get("n_routed_experts") or 0
expert_bytes = g.get("expert_weight_bytes", 0)
unread = expert_bytes * (1 - p["decode_step"]["experts_read"] / experts) if experts and expert_bytes else 0
print(f"--metric bytes_per_decode_step={int(g['weight_bytes'] - table - unread + conc * g['kv_bytes_per_token'] * (i + o // 2))}")
print(f"--metric planned_kv_tokens={p['kv_cache_tokens']} --metric batch={conc}")
EOF
    ))
  fi
  local figures=()
  [ -s "$json" ] && figures=(--json "$json")
  record "$name" "${figures[@]}" "${derived[@]}" $(kernels_metric "$LOGS/$name") --memory "$LOGS/$name"
}

# ncu_decode NAME [FLAG ...]: Nsight Compute's GPU time of each kernel of generate-ids on the 8B
# (bf16, dummy weights, the default paths but the step graphs so that each kernel is its own launch,
# and FLAGs), tools/gpu/ncu_summary.py summing the last whole decode step by kernel (argmax to argmax:
# the dummy weights' kernels and the prefill come before).
ncu_decode() {
  local name=$1 dmodel
  shift
  want "$name" || return 0
  dmodel=$(config_dir llama-3-8b tests/fixtures/configs/llama-3-8b.json)
  step "$name" 200 bash -c "set -o pipefail; '$NCU' --metrics gpu__time_duration.sum --csv --print-units base \
      --launch-skip 1500 --launch-count 1200 '$BIN/shardserve' generate-ids --model '$dmodel' --device cuda:0 \
      --load-format dummy --no-cuda-graphs $* --max-new-tokens 8 $(seq -s ' ' 1000 1127) >'$WORK/$name.csv' &&
      python3 tools/gpu/ncu_summary.py step '$WORK/$name.csv' --json '$LOGS/$name.json'"
  local d=()
  [ -s "$LOGS/$name.json" ] && d=(--metric "step_gpu_us=$(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['step_gpu_us'], 1))" "$LOGS/$name.json")")
  record "$name" "${d[@]}"
}

run_steps() {
  STEP_NO=0 STEP_S=0 STEP_RC=0
  local name driver mem
  # ---- The GPU ----
  if [ "$DRY_RUN" = 1 ]; then
    name="(dry run: no GPU)"
  else
    IFS=, read -r name mem driver < <(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)
  fi
  GPU_NAME=$(echo "$name" | sed 's/^ *//;s/ *$//')
  STEP_RC=0
  [ -z "$GPU_NAME" ] && STEP_RC=1
  record gpu --metric "gpu=$GPU_NAME" --metric "memory=${mem:-}" --metric "driver=${driver:-}" \
    --metric "datasheet_gbps=$(datasheet_gbps "$GPU_NAME")" --metric "commit=$(git rev-parse --short HEAD 2>/dev/null)"

  # ---- The roofline: streaming-read bandwidth on this GPU ----
  command -v nvcc >/dev/null || PATH=$PATH:/usr/local/cuda/bin
  want membw && step membw-build 120 nvcc -O3 -arch=native -o "$WORK/bench_membw" tools/gpu/bench_membw.cu
  if ! want membw; then
    :
  elif [ "$STEP_RC" = 0 ]; then
    step membw 60 bash -c "set -o pipefail; '$WORK/bench_membw' 4 20 | tee '$WORK/membw.json'"
    local m=()
    [ -s "$WORK/membw.json" ] && m=(--json "$WORK/membw.json")
    record membw "${m[@]}" --metric "datasheet_gbps=$(datasheet_gbps "$GPU_NAME")"
  else
    record membw
  fi

  # ---- Tests ----
  gtest_step cuda-ops 180 "$BIN/kernels_cuda_test" --gtest_filter="$CUDA_OPS_FILTER"
  # The quantized-weight GEMV at the 8B's shapes, batch 1 (the target: >= 70% of the
  # roofline). Judged as a gtest (a skip fails on a GPU); the figures from the JSON it writes.
  local fmt qname mma pdl folded
  for fmt in int4 int8 int4-mma int4-pdl int4-folded; do
    qname=quant-$fmt-b1
    want "$qname" || continue
    mma=0 pdl=0 folded=0
    [ "$fmt" = int4-mma ] && fmt=int4 mma=1
    [ "$fmt" = int4-pdl ] && fmt=int4 pdl=1
    [ "$fmt" = int4-folded ] && fmt=int4 folded=1
    SHARDSERVE_QUANT_BENCH=$fmt SHARDSERVE_QUANT_BENCH_INT4_MMA=$mma SHARDSERVE_QUANT_BENCH_PDL=$pdl \
      SHARDSERVE_QUANT_BENCH_INT4_FOLDED=$folded \
      SHARDSERVE_QUANT_BENCH_JSON=$WORK/$qname.json \
      step "$qname" 150 "$BIN/kernels_cuda_test" --gtest_filter='CudaQuantBench.*' --gtest_output="xml:$LOGS/$qname.xml"
    if [ "$DRY_RUN" != 1 ] && [ "$STEP_RC" = 0 ] &&
      ! judge_gtest "$LOGS/$qname.xml" >/dev/null 2>>"$LOGS/$qname.log"; then
      STEP_RC=1
    fi
    local q=()
    [ -s "$WORK/$qname.json" ] && q=(--json "$WORK/$qname.json")
    record "$qname" "${q[@]}"
  done
  # ---- Nsight Compute: where the GPU time goes ----
  # ncu-gemv-int4: the int4 GEMV's seven shapes of one token (the bench's second token: its first
  # 224 launches skipped), SpeedOfLight (duration, DRAM and SM throughput) a launch.
  # ncu-decode, ncu-decode-cublas, ncu-decode-unfused: one decode step's kernels (ncu_decode
  # above), the second with cuBLAS for the decode products, the third with the fused kernels off.
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  # The -stalls steps add where the warps wait and how many fit (occupancy, launch, scheduler and
  # warp-state sections): what the int4 GEMVs' next design needs.
  local sections
  for qname in ncu-gemv-int4 ncu-gemv-int4-mma ncu-gemv-int4-folded ncu-gemv-int4-stalls ncu-gemv-int4-mma-stalls; do
    want "$qname" || continue
    mma=0 folded=0 sections="--section SpeedOfLight"
    [[ "$qname" == ncu-gemv-int4-mma* ]] && mma=1
    [[ "$qname" == ncu-gemv-int4-folded ]] && folded=1
    [[ "$qname" == *-stalls ]] &&
      sections="$sections --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats"
    SHARDSERVE_QUANT_BENCH=int4 SHARDSERVE_QUANT_BENCH_INT4_MMA=$mma SHARDSERVE_QUANT_BENCH_INT4_FOLDED=$folded \
      SHARDSERVE_QUANT_BENCH_JSON=$WORK/$qname.bench.json \
      step "$qname" 150 bash -c "set -o pipefail; '$NCU' $sections --kernel-name regex:Gemv \
        --launch-skip 224 --launch-count 7 --csv --print-units base '$BIN/kernels_cuda_test' \
        --gtest_filter='CudaQuantBench.*' >'$WORK/$qname.csv' &&
        python3 tools/gpu/ncu_summary.py kernels '$WORK/$qname.csv' --json '$LOGS/$qname.json'"
    record "$qname"
  done
  ncu_decode ncu-decode
  ncu_decode ncu-decode-cublas --no-cuda-dense-gemv
  ncu_decode ncu-decode-unfused --no-cuda-fused-kernels
  gtest_step nccl 120 "$BIN/communicator_test" --gtest_filter="$(nccl_filter "${GPUS:-0}")"
  if [ "${GPUS:-0}" -lt 2 ] && want nccl; then
    STEP_RC=0 STEP_S=0
    "${REPORT[@]}" record "$RECORDS" "$(printf '%02d' "$STEP_NO")-nccl-two-ranks" "not run" 0 \
      --note "not run (needs 2 GPUs): $NCCL_TWO_RANK_CASES"
    STEP_NO=$((STEP_NO + 1))
  fi
  gtest_step parity 180 --allow-skip "$PARITY_ALLOWED_SKIP" "$BIN/llama_parity_test"

  # ---- Benchmarks (dummy bf16 weights) ----
  local preset llama qwen
  preset=$(plan_preset "$GPU_NAME")
  llama=$(config_dir llama-3-8b tests/fixtures/configs/llama-3-8b.json)
  qwen=$(config_dir qwen2.5-72b-stage0 tests/fixtures/configs/qwen2.5-72b-instruct.json \
    'c["num_hidden_layers"] = 40; c["tie_word_embeddings"] = True')
  bench_step llama8b-b1 "$llama" "$preset" 1 4 128 128
  bench_step llama8b-c64 "$llama" "$preset" 64 128 512 128
  local plain=(--worker-no-cuda-graphs --worker-no-cuda-split-attention --worker-no-cuda-fused-kernels
    --worker-no-cuda-dense-gemv)
  bench_step llama8b-b1-plain "$llama" "$preset" 1 4 128 128 "" "${plain[@]}"
  bench_step llama8b-c64-plain "$llama" "$preset" 64 128 512 128 "" "${plain[@]}"
  bench_step llama8b-b1-sync "$llama" "$preset" 1 4 128 128 "" --no-async-scheduling
  bench_step llama8b-b1-cublas "$llama" "$preset" 1 4 128 128 "" --worker-no-cuda-dense-gemv
  bench_step llama8b-b1-unfused "$llama" "$preset" 1 4 128 128 "" --worker-no-cuda-fused-kernels
  bench_step llama8b-b1-pdl "$llama" "$preset" 1 4 128 128 "" --worker-cuda-pdl
  bench_step llama8b-c64-pdl "$llama" "$preset" 64 128 512 128 "" --worker-cuda-pdl
  bench_step llama8b-b1-long "$llama" "$preset" 1 2 4096 128
  bench_step llama8b-b1-long-plain "$llama" "$preset" 1 2 4096 128 "" "${plain[@]}"
  # The 8B with an EAGLE-3 head of its shapes (the published head's config), dummy weights: the
  # speed of the machinery (the kept hidden states, the head's forwards, verifying 3 guesses a step
  # that random weights seldom get right), against llama8b-b1 and -c64.
  local head
  head=$(config_dir eagle3-llama-3.1-8b tests/fixtures/configs/eagle3-llama-3.1-8b.json)
  bench_step llama8b-eagle3-b1 "$llama" "$preset" 1 4 128 128 "" --speculative eagle3 --draft-model "$head" \
    --num-speculative-tokens 3
  bench_step llama8b-eagle3-c64 "$llama" "$preset" 64 128 512 128 "" --speculative eagle3 --draft-model "$head" \
    --num-speculative-tokens 3 --speculative-max-running 0
  bench_step llama8b-int4-b1 "$llama" "$preset" 1 4 128 128 int4
  bench_step llama8b-int8-b1 "$llama" "$preset" 1 4 128 128 int8
  bench_step llama8b-int4-mma-b1 "$llama" "$preset" 1 4 128 128 int4 --worker-cuda-int4-mma
  bench_step llama8b-int4-pdl-b1 "$llama" "$preset" 1 4 128 128 int4 --worker-cuda-pdl
  bench_step llama8b-int4-folded-b1 "$llama" "$preset" 1 4 128 128 int4 --worker-cuda-int4-folded
  local qwen_all
  qwen_all=$(config_dir qwen2.5-72b tests/fixtures/configs/qwen2.5-72b-instruct.json)
  bench_step qwen72b-int4-b1 "$qwen_all" "$preset" 1 2 128 64 int4
  bench_step qwen72b-int4-mma-b1 "$qwen_all" "$preset" 1 2 128 64 int4 --worker-cuda-int4-mma
  # The cold start from a real checkpoint (the target: < 20 s): the 8B's 16 GB of bf16 written
  # to this machine's disk (tools/fixtures/write_config_checkpoint.py), the page cache dropped where the
  # machine lets us (else the file is still in memory: the note says which, and the file system),
  # then launch to SERVING through the real load path (mmap, slicing, host to device); the file
  # removed after. Bounded at 150 + 120 s (expected: about 10 + 30); the writer itself is checked on
  # the CPU by tests/gpu_bench_test.py.
  if want llama8b-cold-safetensors; then
    local ckpt=$WORK/models/llama-3-8b-safetensors cache_note fs
    step llama8b-cold-safetensors-write 150 python3 tools/fixtures/write_config_checkpoint.py \
      --config "$llama/config.json" --out "$ckpt" --json "$WORK/llama8b-cold-write.json"
    if [ "$DRY_RUN" = 1 ]; then
      cache_note="not tried: dry run"
    else
      fs=$(stat -f -c %T "$ckpt" 2>/dev/null || echo "file system unknown")
      cache_note="page cache not dropped ($fs): the start read the file from memory"
      if sync && { echo 3 >/proc/sys/vm/drop_caches; } 2>/dev/null; then
        cache_note="page cache dropped before the start ($fs): the file read from disk"
      fi
      [ "$fs" = tmpfs ] && cache_note="the file is in memory (tmpfs): not a cold read"
    fi
    local w=()
    [ -s "$WORK/llama8b-cold-write.json" ] && w=(--json "$WORK/llama8b-cold-write.json")
    record llama8b-cold-safetensors-write "${w[@]}" --metric "cache=$cache_note"
    LOAD_FORMAT=auto BENCH_LIMIT=120 bench_step llama8b-cold-safetensors "$ckpt" "$preset" 1 2 128 32
    rm -rf "$ckpt"
  fi
  # fp8 weights' prefills by the dequantize path, then by cuBLASLt's fp8 GEMM (not yet run on a GPU):
  # after the cold start, so that a budget cut falls on them.
  bench_step llama8b-fp8-c64 "$llama" "$preset" 64 128 512 128 fp8
  bench_step llama8b-fp8-gemm-c64 "$llama" "$preset" 64 128 512 128 fp8 --worker-cuda-fp8-gemm
  # NAME BATCH INPUT-LEN SECONDS [FLAG]: 300 s for torch.compile of the 8B, which did not finish in
  # 150 on an H200; the eager one (--no-compile) needs no compiling.
  for hf in "hf-b1-eager 1 128 150 --no-compile" "hf-b1 1 128 300" "hf-c64 64 512 300"; do
    set -- $hf
    want "$1" || continue
    DRY_RUN_RUNS=1 step "$1" "$4" python3 tools/bench/bench_hf_generate.py --config "$llama/config.json" --batch "$2" \
      --input-len "$3" --output-len 128 --out "$WORK/$1.json" ${5:-} $([ "$DRY_RUN" = 1 ] && echo --check)
    local h=()
    [ -s "$WORK/$1.json" ] && h=(--json "$WORK/$1.json")
    record "$1" "${h[@]}"
  done
  bench_step qwen72b-stage-b1 "$qwen" "$preset" 1 2 128 64
  bench_step qwen72b-stage-c64 "$qwen" "$preset" 64 64 512 128

  # ---- The 2026 families at their real shapes (dummy bf16 weights; their CUDA paths that have not
  # yet run on a GPU say so in the workers' logs) ----
  local qwen3 gemma3 qwen3moe gptoss deepseek
  qwen3=$(config_dir qwen3-8b tests/fixtures/configs/qwen3-32b.json \
    'c.update(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, max_window_layers=36)')
  gemma3=$(config_dir gemma-3-12b tests/fixtures/configs/gemma-3-27b-it.json \
    'c["text_config"].update(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256)')
  qwen3moe=$(config_dir qwen3-30b-a3b tests/fixtures/configs/qwen3-30b-a3b.json)
  gptoss=$(config_dir gpt-oss-20b tests/fixtures/configs/gpt-oss-120b.json \
    'c.update(num_hidden_layers=24, num_local_experts=32, layer_types=c["layer_types"][:24]); c.pop("quantization_config")')
  deepseek=$(config_dir deepseek-v3-4-layers tests/fixtures/configs/deepseek-v3.json \
    'c.update(num_hidden_layers=4, first_k_dense_replace=1); c.pop("quantization_config")')
  bench_step qwen3-8b-b1 "$qwen3" "$preset" 1 4 128 128
  bench_step qwen3-8b-c64 "$qwen3" "$preset" 64 128 512 128
  bench_step gemma3-12b-b1 "$gemma3" "$preset" 1 4 128 128
  bench_step gemma3-12b-c64 "$gemma3" "$preset" 64 128 512 128
  bench_step qwen3-30b-a3b-b1 "$qwen3moe" "$preset" 1 4 128 128
  bench_step qwen3-30b-a3b-c64 "$qwen3moe" "$preset" 64 128 512 128
  bench_step qwen3-30b-a3b-grouped-b1 "$qwen3moe" "$preset" 1 4 128 128 "" --worker-cuda-moe-grouped
  bench_step qwen3-30b-a3b-grouped-c64 "$qwen3moe" "$preset" 64 128 512 128 "" --worker-cuda-moe-grouped
  bench_step gpt-oss-20b-b1 "$gptoss" "$preset" 1 4 128 128
  bench_step deepseek-v3-4-layers-b1 "$deepseek" "$preset" 1 4 128 128

  # ---- TP and PP on one GPU ----
  # Worker processes sharing the GPU, their groups over Gloo staged through host memory
  # (--worker-collectives gloo), against one process (generate-ids, host-made weights): the same
  # greedy tokens. The workers make their weights in GPU memory (the default), but
  # tp1+--worker-dummy-weights=host's, made on the host.
  # The dry run rehearses it for real on the CPU with a small model (tests/fixtures/models/llama_gqa's
  # config: hidden 64, 4 heads, 2 KV heads, 5 layers).
  # In float32: with bf16 weights a row-parallel product rounds each rank's partial sums to bf16
  # before the all-reduce, where TP=1 rounds the whole sum once, so TP=2's logits differ from TP=1's
  # by bf16 rounding and a near-tie flips (on an H200: tp2 and tp2xpp2 left the reference at
  # the 9th of 16 tokens, pp2 did not). The check is of the plumbing, not of bf16's rounding.
  if want tp-on-one-gpu; then
    local lmodel ldev=cuda
    lmodel=$(config_dir llama-3-8b-f32 tests/fixtures/configs/llama-3-8b.json 'c["torch_dtype"] = "float32"')
    if [ "$DRY_RUN" = 1 ]; then
      lmodel=$(config_dir llama-gqa tests/fixtures/models/llama_gqa/config.json)
      ldev=cpu
    fi
    DRY_RUN_RUNS=1 step tp-on-one-gpu 420 python3 tools/gpu/gpu_layouts_check.py --bin "$BIN" --model "$lmodel" \
      --device "$ldev" --layouts "${TP_LAYOUTS:-tp1+--worker-dummy-weights=host,tp2,pp2,tp2xpp2}" \
      --launch-flag=--worker-collectives=gloo --launch-flag=--num-kv-blocks=256 --max-new-tokens 16 \
      --log-dir "$LOGS/tp-on-one-gpu" --out "$WORK/tp-on-one-gpu.json" --timeout-seconds 400
    record tp-on-one-gpu --metric "layouts=${TP_LAYOUTS:-tp1+--worker-dummy-weights=host,tp2,pp2,tp2xpp2}" \
      $(kernels_metric "$LOGS/tp-on-one-gpu")
  fi
}

main() {
  DRY_RUN=0
  case "${1:-}" in
    pack) pack_checked; return ;;
    dry-run) DRY_RUN=1; shift ;;
    run) shift ;;
    *) usage ;;
  esac
  [ $# -le 1 ] || usage
  local out=${1:-${OUT:-}}
  if [ -z "$out" ]; then
    [ "$DRY_RUN" = 1 ] && out=$BUNDLE-dry-run || { echo "gpu-bench: run needs OUT (or \$OUT)" >&2; return 2; }
  fi
  START=$SECONDS
  BUDGET=${BUDGET_S:-540}
  mkdir -p "$out" || return 1
  WORK=$(mktemp -d /tmp/gpu-bench.XXXXXX) || return 1
  RECORDS=$WORK/records
  LOGS=$WORK/logs
  mkdir -p "$RECORDS" "$LOGS"
  BIN=$BUNDLE/bin
  if [ "$DRY_RUN" = 1 ]; then
    BUILD_DIR=${BUILD_DIR:-build} pack_checked || return 1
    unpack "$BUNDLE" keep || return 1
    GPUS=""
  else
    setup "$BUNDLE" || return 1
    GPUS=$(gpu_count)
    [ "$GPUS" -ge 1 ] || { echo "gpu-bench: nvidia-smi lists no GPU" >&2; return 1; }
  fi
  run_steps
  "${REPORT[@]}" report "$RECORDS" "$out/results.json" "$out/results.md"
  local rc=$?
  tar -C "$WORK" -czf "$out/logs.tar.gz" logs records 2>/dev/null
  echo "gpu-bench: $(($SECONDS - START)) s; results in $out (results.json, results.md, logs.tar.gz)"
  return $rc
}

[[ "${BASH_SOURCE[0]}" == "$0" ]] && { main "$@"; exit $?; }
