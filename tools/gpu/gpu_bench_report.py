#!/usr/bin/env python3
"""The results of tools/gpu/gpu-bench.sh: one record per step, then one JSON file and one markdown table.

Standard library only (it runs on the GPU machine's python3 and in CI).

  gpu_bench_report.py record DIR STEP STATUS SECONDS [--json FILE] [--note TEXT] [--metric KEY=VALUE ...]
                                                    [--memory LOG_DIR]
      Writes DIR/STEP.json: the step's status (passed, failed, skipped, not run), its seconds, its
      figures (--metric, numbers where they parse; --json: a JSON file whose fields are taken as
      they are, e.g. a `shardserve bench --json-out` file's first run), a note, and with --memory
      the memory lines of every worker log under LOG_DIR (as the memory command reads them). Steps
      are listed in the order of their names (gpu-bench.sh numbers them).
  gpu_bench_report.py junit XML [--gpu] [--allow-skip REGEX]
      Counts a gtest XML's tests, failures, errors and skipped cases; prints them as JSON. With
      --gpu (a GPU is present) a skipped case is a failure, unless its skip message matches REGEX
      (a skip that has nothing to do with the GPU, e.g. the CPU's own bf16 instructions): exit 1
      if any case failed or skipped, naming them; also if the file holds no case.
  gpu_bench_report.py memory LOG [LOG ...]
      The workers' "memory ITEM: planned N B ..., measured M B" lines (worker/step_executor.h), as
      JSON: per worker log, per item, planned, measured and measured/planned.
  gpu_bench_report.py report DIR OUT_JSON OUT_MD
      Merges DIR/*.json into OUT_JSON and writes OUT_MD: a markdown table of the steps (ready for
      docs/performance.md), the roofline fractions where the figures are there, and the planner
      against the measured memory. Exit 1 if a step failed.
"""
import glob
import json
import os
import re
import sys
import xml.etree.ElementTree as ET

STATUSES = ("passed", "failed", "skipped", "not run")


def usage(msg):
    print(f"gpu_bench_report.py: {msg}\n{__doc__}", file=sys.stderr)
    sys.exit(2)


def number(text):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def record(args):
    if len(args) < 4:
        usage("record needs DIR STEP STATUS SECONDS")
    out_dir, step, status, seconds = args[:4]
    if status not in STATUSES:
        usage(f"status {status!r} is not one of {', '.join(STATUSES)}")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", step):
        usage(f"step name {step!r}: letters, digits, '.', '_' and '-' only")
    try:
        seconds = float(seconds)
    except ValueError:
        usage(f"seconds {seconds!r} is not a number")
    rec = {"step": step, "status": status, "seconds": round(seconds, 2), "metrics": {}, "note": ""}
    rest = args[4:]
    i = 0
    while i < len(rest):
        flag = rest[i]
        if i + 1 >= len(rest):
            usage(f"{flag} needs a value")
        value = rest[i + 1]
        if flag == "--note":
            rec["note"] = value
        elif flag == "--metric":
            if "=" not in value:
                usage(f"--metric {value!r} is not KEY=VALUE")
            key, v = value.split("=", 1)
            rec["metrics"][key] = number(v)
        elif flag == "--memory":
            logs = sorted(p for p in glob.glob(os.path.join(value, "**", "*.log"), recursive=True)
                          if "worker" in os.path.basename(p))
            rec["memory"] = memory_items(logs)
        elif flag == "--json":
            try:
                with open(value) as f:
                    data = json.load(f)
            except (OSError, ValueError) as e:
                rec["status"] = "failed" if status == "passed" else status
                rec["note"] = (rec["note"] + "; " if rec["note"] else "") + f"no figures: {value}: {e}"
                data = {}
            if isinstance(data, dict) and isinstance(data.get("runs"), list) and data["runs"]:
                data = data["runs"][0]  # shardserve bench --compare: its one layout
            if isinstance(data, dict):
                rec["metrics"].update({k: v for k, v in data.items() if isinstance(v, (int, float, str)) or v is None})
        else:
            usage(f"unknown flag {flag}")
        i += 2
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, step + ".json"), "w") as f:
        json.dump(rec, f, indent=2)
    return 0


def junit_counts(path, allow_skip=None):
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "failed_cases": [], "skipped_cases": []}
    for suite in suites:
        for case in suite.iter("testcase"):
            name = f"{case.get('classname')}.{case.get('name')}"
            counts["tests"] += 1
            # gtest marks a skipped case with <skipped/> (and result="skipped"); a failure with <failure>.
            if case.find("failure") is not None:
                counts["failures"] += 1
                counts["failed_cases"].append(name)
            elif case.find("error") is not None:
                counts["errors"] += 1
                counts["failed_cases"].append(name)
            elif case.find("skipped") is not None or case.get("result") == "skipped" or case.get("status") == "notrun":
                skipped = case.find("skipped")
                message = (skipped.get("message", "") + (skipped.text or "")) if skipped is not None else ""
                if allow_skip and re.search(allow_skip, message):
                    counts.setdefault("allowed_skips", []).append(name)
                    continue
                counts["skipped"] += 1
                counts["skipped_cases"].append(name)
    return counts


def junit(args):
    if not args:
        usage("junit needs an XML file")
    gpu = "--gpu" in args[1:]
    allow_skip = None
    if "--allow-skip" in args[1:]:
        i = args.index("--allow-skip")
        if i + 1 >= len(args):
            usage("--allow-skip needs a REGEX")
        allow_skip = args[i + 1]
    try:
        counts = junit_counts(args[0], allow_skip)
    except (OSError, ET.ParseError) as e:
        print(json.dumps({"error": f"{args[0]}: {e}"}))
        return 1
    print(json.dumps(counts))
    bad = counts["failures"] + counts["errors"] + (counts["skipped"] if gpu else 0)
    if counts["tests"] == 0:
        print(f"gpu_bench_report.py: {args[0]} holds no test case", file=sys.stderr)
        return 1
    if bad:
        what = counts["failed_cases"] + (counts["skipped_cases"] if gpu else [])
        print(f"gpu_bench_report.py: {args[0]}: {bad} case(s) failed{' or skipped on a GPU' if gpu else ''}: "
              + ", ".join(what), file=sys.stderr)
        return 1
    return 0


MEMORY_LINE = re.compile(r"memory (\w+): planned (-?\d+) B [^,]*, measured (?:(-?\d+) B \([^)]*\))?(.*)$")


def memory_items(paths):
    out = {}
    for path in paths:
        items = {}
        with open(path, errors="replace") as f:
            for line in f:
                m = MEMORY_LINE.search(line)
                if not m:
                    continue
                name, planned = m.group(1), int(m.group(2))
                measured = int(m.group(3)) if m.group(3) is not None else None
                ratio = round(measured / planned, 4) if measured is not None and planned > 0 else None
                items[name] = {"planned": planned, "measured": measured, "ratio": ratio,
                               "how": m.group(4).strip(" ,")}
        # What cudaMemGetInfo should find free once the worker has loaded: the plan's free bytes, what
        # gpu_memory_utilization holds back (never allocated), cuBLAS's workspace while it is still to
        # come (allocated at the first product) and the runtime slack (kernel modules load at their
        # first launch). Compared with the measured free bytes, it checks the plan's items taken
        # together, the CUDA context's share included. The worker's after_steps line (logged with
        # the kernels per decode step) measures what those later items took.
        free, held, ws = items.get("free"), items.get("held_back"), items.get("cublas_workspace")
        slack = items.get("runtime_slack")
        if free and held and free["measured"] is not None:
            planned = free["planned"] + held["planned"] + (ws["planned"] if ws and ws["measured"] is None else 0)
            planned += slack["planned"] if slack else 0
            items["free_after_load"] = {
                "planned": planned, "measured": free["measured"],
                "ratio": round(free["measured"] / planned, 4) if planned > 0 else None,
                "how": "derived: free + held_back + cublas_workspace not yet allocated + runtime_slack, "
                       "against free after loading"}
        if items:
            out[os.path.basename(path)] = items
    return out


def memory(args):
    if not args:
        usage("memory needs worker logs")
    print(json.dumps(memory_items(args), indent=2))
    return 0


def gib(n):
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def figure(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# Figures shown in the table, by step field: (metric key, label).
SHOWN = [
    ("best_gbps", "GB/s best"), ("datasheet_gbps", "GB/s datasheet"),
    ("decode_tokens_per_s", "decode tok/s"), ("output_tokens_per_s", "output tok/s"),
    ("roofline_tokens_per_s", "roofline tok/s"), ("roofline_fraction", "of roofline"),
    ("cluster_start_s", "start s"), ("kv_blocks_total", "KV blocks"), ("planned_kv_tokens", "planned KV tokens"),
    ("tests", "tests"), ("failures", "failures"), ("skipped", "skipped"),
    ("kernels_per_decode_step", "kernels/decode step"), ("layouts", "layouts"),
    ("checkpoint_bytes", "checkpoint bytes"), ("write_s", "written in s"), ("cache", "cache"),
]


def report(args):
    if len(args) != 3:
        usage("report needs DIR OUT_JSON OUT_MD")
    in_dir, out_json, out_md = args
    steps = []
    for path in sorted(glob.glob(os.path.join(in_dir, "*.json"))):
        try:
            with open(path) as f:
                rec = json.load(f)
        except (OSError, ValueError) as e:
            rec = {"step": os.path.basename(path), "status": "failed", "seconds": 0, "metrics": {},
                   "note": f"unreadable record: {e}"}
        if isinstance(rec, dict) and "step" in rec and "status" in rec:
            steps.append(rec)
    # The roofline: tokens/s if a decode step only read the weights and the KV cache once, at the
    # streaming read bandwidth measured in the same run (the step named membw, numbered or not).
    membw = [r for r in steps if re.fullmatch(r"(\d+-)?membw", r["step"])]
    bw = membw[0].get("metrics", {}).get("best_gbps") if membw else None
    for r in steps:
        m = r.get("metrics", {})
        # shardserve bench gives the inter-token latency: each of `batch` streams gets a token per
        # step, so batch / ITL is the decode rate (HF's script reports decode_tokens_per_s itself).
        itl = m.get("itl_p50_s")
        if "decode_tokens_per_s" not in m and isinstance(itl, (int, float)) and itl > 0:
            m["decode_tokens_per_s"] = round(m.get("batch", 1) / itl, 2)
        bytes_per_step = m.get("bytes_per_decode_step")
        if bw and isinstance(bytes_per_step, (int, float)) and bytes_per_step > 0:
            m["roofline_tokens_per_s"] = round(bw * 1e9 / bytes_per_step * m.get("batch", 1), 1)
            got = m.get("decode_tokens_per_s")
            if isinstance(got, (int, float)) and got > 0:
                m["roofline_fraction"] = round(got / m["roofline_tokens_per_s"], 3)
    failed = [r["step"] for r in steps if r["status"] == "failed"]
    result = {"steps": steps, "failed": failed}
    with open(out_json, "w") as f:
        json.dump(result, f, indent=2)

    lines = ["| step | status | s | figures | note |", "|---|---|---|---|---|"]
    for r in steps:
        m = r.get("metrics", {})
        figs = [f"{label} {figure(m[k])}" for k, label in SHOWN if k in m and m[k] is not None]
        note = str(r.get("note", "")).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['step']} | {r['status']} | {r.get('seconds', '')} | {'; '.join(figs)} | {note} |")
    mem_rows = []
    for r in steps:
        for worker, items in (r.get("memory") or {}).items():
            for name, it in items.items():
                mem_rows.append(f"| {r['step']} | {worker} | {name} | {gib(it['planned'])} | "
                                f"{gib(it['measured'])} | {'-' if it['ratio'] is None else it['ratio']} | "
                                f"{it['how'].replace('|', '/')} |")
    if mem_rows:
        lines += ["", "Planner against measured memory, per item (target: within 5% each):", "",
                  "| step | worker log | item | planned | measured | measured/planned | how measured |",
                  "|---|---|---|---|---|---|---|"] + mem_rows
    with open(out_md, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    if failed:
        print(f"gpu_bench_report.py: failed steps: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def main():
    if len(sys.argv) < 2:
        usage("no command")
    cmd, args = sys.argv[1], sys.argv[2:]
    commands = {"record": record, "junit": junit, "memory": memory, "report": report}
    if cmd not in commands:
        usage(f"unknown command {cmd!r}")
    sys.exit(commands[cmd](args))


if __name__ == "__main__":
    main()
