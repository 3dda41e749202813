#!/usr/bin/env python3
"""Greedy tokens of several TP x PP layouts against one process, with dummy weights (issue 29 part 6).

The reference is `shardserve generate-ids --load-format dummy` (one process, TP = 1). Each layout
(tp1, tpN, ppM, tpNxppM) is a `shardserve launch` cluster of real worker processes serving the same
dummy weights, asked for the same greedy continuation with `shardserve generate --prompt-ids`; every
layout must give exactly the reference's tokens. On the GPU machine (tools/gpu/gpu-bench.sh step
tp-on-one-gpu) the workers share the one GPU with --worker-collectives gloo (staged through host
memory: NCCL refuses two ranks on one GPU); tools/gpu/gpu-bench.sh dry-run and ctest gpu_layouts_cpu
rehearse it on the CPU with a small model.

A layout may carry extra launch flags after '+': tp1+--worker-dummy-weights=host runs TP = 1 with
the weights made on the host and copied (CUDA workers make them in GPU memory by default; the
reference makes them on the host).

Every cluster runs in a session of its own and is stopped (SIGTERM, then SIGKILL of the session)
before the next starts, whatever happens. Writes a JSON summary to --out; exit 0 when every
layout's tokens equal the reference's, 1 otherwise, 2 on bad arguments.

usage: gpu_layouts_check.py --bin DIR --model DIR [--device cpu|cuda] [--layouts tp2,pp2,tp2xpp2]
                            [--prompt-ids 1,2,3] [--max-new-tokens N] [--dummy-seed S]
                            [--launch-flag=--X=V ...] [--log-dir DIR] [--out FILE] [--timeout-seconds S]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ci"))  # launch_process
from launch_process import LaunchProcess, time_scale  # noqa: E402

LAYOUT = re.compile(r"^(?:tp(\d+))?(?:x?pp(\d+))?$")


def parse_layout(text):
    name, _, extra = text.partition("+")
    m = LAYOUT.match(name)
    if not name or not m or not (m.group(1) or m.group(2)):
        raise ValueError(f"layout '{text}' is not tpN, ppM or tpNxppM (with optional +--flag=value launch flags)")
    tp, pp = int(m.group(1) or 1), int(m.group(2) or 1)
    if not (1 <= tp <= 8 and 1 <= pp <= 8):
        raise ValueError(f"layout '{text}': TP and PP must be 1 to 8")
    flags = []
    for f in filter(None, extra.split("+")):
        flags += f.split("=", 1)
    return {"name": text, "tp": tp, "pp": pp, "flags": flags}


def ids_of(text):
    return [int(x) for x in re.findall(r"-?\d+", text)]


def run(cmd, timeout, env=None):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return p.returncode, p.stdout, p.stderr


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="directory of shardserve, shardserve-coordinator, shardserve-worker")
    ap.add_argument("--model", required=True, help="a directory with config.json (dummy weights need nothing else)")
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--layouts", default="tp2,pp2,tp2xpp2")
    ap.add_argument("--prompt-ids", default="1,15,27,300,4,88,9,100")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--dummy-seed", type=int, default=1)
    ap.add_argument("--launch-flag", action="append", default=[],
                    help="a flag for every launch, e.g. --launch-flag=--worker-collectives=gloo")
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout-seconds", type=float, default=540,
                    help="for the whole check, times SHARDSERVE_TEST_TIME_SCALE (tools/ci/launch_process.py)")
    args = ap.parse_args()
    try:
        scale = time_scale()
    except ValueError as e:
        print(f"gpu_layouts_check: {e}", file=sys.stderr)
        return 2
    try:
        layouts = [parse_layout(x) for x in args.layouts.split(",") if x]
        prompt = [int(x) for x in args.prompt_ids.split(",") if x]
    except ValueError as e:
        print(f"gpu_layouts_check: {e}", file=sys.stderr)
        return 2
    if not layouts or not prompt or not 1 <= args.max_new_tokens <= 1024:
        print("gpu_layouts_check: needs a layout, a prompt and --max-new-tokens in [1, 1024]", file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        print(f"gpu_layouts_check: {args.model} has no config.json", file=sys.stderr)
        return 2
    shardserve = os.path.join(args.bin, "shardserve")
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="gpu-layouts-")
    deadline = time.time() + args.timeout_seconds * scale
    launch_flags = []
    for f in args.launch_flag:
        launch_flags += f.split("=", 1)
    summary = {"model": args.model, "device": args.device, "prompt_ids": prompt,
               "max_new_tokens": args.max_new_tokens, "dummy_seed": args.dummy_seed, "launch_flags": launch_flags,
               "time_scale": scale, "layouts": []}

    def left():
        return max(1.0, deadline - time.time())

    # The reference: one process, TP = 1.
    t0 = time.time()
    ref_cmd = [shardserve, "generate-ids", "--model", args.model, "--device",
               "cpu" if args.device == "cpu" else "cuda:0", "--load-format", "dummy", "--dummy-seed",
               str(args.dummy_seed), "--max-new-tokens", str(args.max_new_tokens), ",".join(map(str, prompt))]
    try:
        rc, out, err = run(ref_cmd, left())
    except subprocess.TimeoutExpired:
        rc, out, err = 124, "", "timed out"
    reference = ids_of(out) if rc == 0 else None
    summary["reference"] = {"command": ref_cmd, "tokens": reference, "seconds": round(time.time() - t0, 1),
                            "error": None if rc == 0 else f"exit {rc}: {err[-2000:]}"}
    print(f"reference (generate-ids, one process): {reference if rc == 0 else 'FAILED: ' + err[-500:]}")
    ok = reference is not None and len(reference) == args.max_new_tokens

    for layout in layouts:
        t0 = time.time()
        ldir = os.path.join(log_dir, re.sub(r"[^A-Za-z0-9_.-]", "_", layout["name"]))
        cmd = [shardserve, "launch", "--model", args.model, "--device", args.device, "--nodes", str(layout["pp"]),
               "--gpus-per-node", str(layout["tp"]), "--address", "127.0.0.1:0", "--metrics-port-base", "0",
               "--http-port", "0", "--insecure", "--log-dir", ldir, "--load-format", "dummy", "--dummy-seed",
               str(args.dummy_seed), "--max-worker-restarts", "0", "--max-coordinator-restarts", "0"]
        cmd += launch_flags + layout["flags"]
        record = {"layout": layout["name"], "tp": layout["tp"], "pp": layout["pp"], "command": cmd}
        launch = LaunchProcess(cmd, ldir)
        try:
            address = launch.wait_ready(left())
            record["start_seconds"] = round(time.time() - t0, 1)
            gen = [shardserve, "generate", "--address", address, "--insecure", "--prompt-ids",
                   ",".join(map(str, prompt)), "--max-tokens", str(args.max_new_tokens), "--temperature", "0",
                   "--ignore-eos", "--show-ids"]
            rc, out, err = run(gen, left())
            if rc != 0:
                raise RuntimeError(f"generate exited with {rc}: {err[-2000:]}")
            tokens = [int(x) for x in re.findall(r"\[(-?\d+)\]", out)]
            record["tokens"] = tokens
            record["equal"] = tokens == reference
            # Where they part, when they do: a bf16 near-tie flipped by another summation order
            # parts late; a wrong shard or a broken collective parts at once.
            record["common_prefix"] = next((i for i, (a, b) in enumerate(zip(tokens, reference or [])) if a != b),
                                           min(len(tokens), len(reference or [])))
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            record["error"] = str(e)[-3000:]
            record["equal"] = False
        finally:
            launch.stop()
        record["seconds"] = round(time.time() - t0, 1)
        summary["layouts"].append(record)
        ok = ok and record["equal"]
        print(f"{layout['name']}: {'equal' if record['equal'] else 'DIFFERENT'} "
              f"{record.get('tokens', record.get('error', ''))} ({record['seconds']} s)", flush=True)

    summary["passed"] = ok
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    print(f"gpu_layouts_check: {'every layout gives the reference tokens' if ok else 'FAILED'} (logs in {log_dir})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
