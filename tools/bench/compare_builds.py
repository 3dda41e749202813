#!/usr/bin/env python3
"""Two builds of shardserve side by side: the same CPU load on each, in alternating rounds.

For a change that should cost nothing (a refactor), or one that should gain: each round runs, for
every format, `shardserve bench --compare tp1` of build A and of build B (the one that goes first
alternates between rounds) at 1 stream and at 32 streams, on the same model with the same
token-id prompts, and the table gives each build's median output tokens/s over the rounds and the
ratio B / A. The load is docs/performance.md's: 128 tokens in, 64 out (ignore_eos), greedy; 8
requests one at a time, then 32 at once; both on 2 threads. Each build's `shardserve` starts its
own workers (its bin directory), so each side runs its own code end to end.

  tools/bench/compare_builds.py BIN_A BIN_B --model build/bench-model [--rounds 3]
      [--formats f32,bf16,int8,int4] [--json-out FILE]

BIN_A and BIN_B are bin directories (holding shardserve, shardserve-coordinator and
shardserve-worker), e.g. a worktree of the older commit built with
`cmake -S . -B build-cpu -G Ninja -DSHARDSERVE_WITH_CUDA=OFF -DSHARDSERVE_BUILD_TESTS=OFF &&
cmake --build build-cpu --target shardserve shardserve-coordinator shardserve-worker`.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

FORMATS = {  # the flags of each format, as docs/performance.md's tables name them
    "f32": ["--worker-matmul-dtype", "f32"],
    "bf16": ["--worker-matmul-dtype", "bf16"],
    "int8": ["--quantization", "int8"],
    "int4": ["--quantization", "int4"],
}
LOADS = {1: ["--concurrency", "1", "--num-requests", "8"], 32: ["--concurrency", "32", "--num-requests", "32"]}


def run(bin_dir, model, fmt, streams):
    """Output tokens/s of one `bench --compare tp1` of the build in BIN_DIR; exits on a failure."""
    cmd = [os.path.join(bin_dir, "shardserve"), "bench", "--compare", "tp1", "--model", model,
           "--input-len", "128", "--output-len", "64", "--worker-threads", "2", "--json"]
    cmd += FORMATS[fmt] + LOADS[streams]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    try:
        r = json.loads(done.stdout)["runs"][0]
    except (ValueError, KeyError, IndexError):
        sys.exit(f"compare_builds: {' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    if r["error"] or r["failed"] or r["completed"] != int(LOADS[streams][3]):
        sys.exit(f"compare_builds: {bin_dir} {fmt} {streams} streams: {r['error'] or r['errors']}")
    return r["output_tokens_per_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bin_a")
    ap.add_argument("bin_b")
    ap.add_argument("--model", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--formats", default="f32,bf16,int8,int4")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    formats = args.formats.split(",")
    for f in formats:
        if f not in FORMATS:
            sys.exit(f"compare_builds: unknown format {f!r} (known: {', '.join(FORMATS)})")
    got = {(f, s, b): [] for f in formats for s in LOADS for b in "AB"}
    for rnd in range(args.rounds):
        order = "AB" if rnd % 2 == 0 else "BA"
        for f in formats:
            for s in LOADS:
                for b in order:
                    tps = run(args.bin_a if b == "A" else args.bin_b, args.model, f, s)
                    got[(f, s, b)].append(tps)
                    print(f"round {rnd + 1} {f:5s} {s:2d} streams build {b}: {tps:8.1f} tokens/s", file=sys.stderr)
    print(f"| format | streams | A tokens/s | B tokens/s | B / A |")
    print(f"|---|---:|---:|---:|---:|")
    rows = []
    for f in formats:
        for s in LOADS:
            a, b = statistics.median(got[(f, s, "A")]), statistics.median(got[(f, s, "B")])
            rows.append({"format": f, "streams": s, "a": a, "b": b, "ratio": b / a,
                         "a_rounds": got[(f, s, "A")], "b_rounds": got[(f, s, "B")]})
            print(f"| {f} | {s} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump({"bin_a": args.bin_a, "bin_b": args.bin_b, "model": args.model, "rounds": args.rounds,
                       "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
