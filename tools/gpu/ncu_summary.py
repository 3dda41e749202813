#!/usr/bin/env python3
"""Summarizes an Nsight Compute CSV (`ncu --csv --print-units base ...` on stdout) for docs/gpu.md.

  ncu_summary.py step CSV [--marker ArgmaxKernel] [--json OUT]
      One decode step's kernels from `ncu --metrics gpu__time_duration.sum`: the launches after
      the last but one launch of MARKER (a step's last kernel: greedy decoding's argmax) up to the
      last (the last whole step, so that what came before the decode steps, e.g. the prefill, is
      passed over), their GPU time summed by kernel
      name, largest first, and the step's total (what the step would take with no gaps between
      kernels: against the wall time a token takes, the launch and host overhead).
  ncu_summary.py kernels CSV [--json OUT]
      Each profiled launch's metrics (e.g. `--section SpeedOfLight`: duration, DRAM and SM
      throughput), one row a launch.

Standard library only: a GPU host may have Python but no network.
"""
import argparse
import csv
import io
import json
import re
import sys

# Base units ncu prints with --print-units base, to seconds / plain numbers.
_SCALE = {"nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0}


def read_rows(path):
    """The CSV's rows as dicts; ncu's own lines (==PROF==, the program's output) before the header
    are skipped. A file with no header is an error naming the file."""
    text = open(path, encoding="utf-8", errors="replace").read()
    start = text.find('"ID",')
    if start < 0:
        raise SystemExit(f"ncu_summary: {path}: no ncu CSV header (\"ID\",...): did ncu profile any kernel?")
    rows = []
    for row in csv.DictReader(io.StringIO(text[start:])):
        if row.get("ID", "").strip().isdigit():
            rows.append(row)
    return rows


def launches(rows):
    """[(id, kernel name, {metric: (value, unit)})] in launch order."""
    by_id = {}
    for r in rows:
        i = int(r["ID"])
        entry = by_id.setdefault(i, (r.get("Kernel Name", "?"), {}))
        value = r.get("Metric Value", "").replace(",", "")
        try:
            v = float(value)
        except ValueError:
            continue
        entry[1][r.get("Metric Name", "?")] = (v, r.get("Metric Unit", ""))
    return [(i, name, m) for i, (name, m) in sorted(by_id.items())]


def short_name(name):
    """A kernel's name without its template arguments (which may hold casts such as "(int)1") and
    its parameter list."""
    depth, out = 0, []
    for ch in name.replace("(anonymous namespace)", ""):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(depth - 1, 0)  # ncu writes the anonymous namespace as "unnamed>"
        elif depth == 0:
            out.append(ch)
    bare = re.sub(r"\(.*$", "", "".join(out))
    return bare.split("::")[-1].split(" ")[-1].strip() or name


def seconds(metrics, name):
    v, unit = metrics.get(name, (None, ""))
    if v is None:
        return None
    return v * _SCALE.get(unit, 1e-9)


def step_summary(rows, marker):
    ls = launches(rows)
    marks = [k for k, (_, name, _) in enumerate(ls) if marker in name]
    if len(marks) < 2:
        raise SystemExit(f"ncu_summary: fewer than two launches of {marker} among {len(ls)}: no whole step profiled")
    step = ls[marks[-2] + 1:marks[-1] + 1]
    groups = {}
    total = 0.0
    for _, name, m in step:
        t = seconds(m, "gpu__time_duration.sum")
        if t is None:
            raise SystemExit(f"ncu_summary: launch of {short_name(name)} has no gpu__time_duration.sum")
        g = groups.setdefault(short_name(name), [0, 0.0])
        g[0] += 1
        g[1] += t
        total += t
    table = sorted(({"kernel": k, "launches": c, "us": t * 1e6, "share": t / total} for k, (c, t) in groups.items()),
                   key=lambda r: -r["us"])
    return {"launches": len(step), "step_gpu_us": total * 1e6, "by_kernel": table}


def print_step(s):
    print(f"one decode step: {s['launches']} launches, {s['step_gpu_us']:.1f} us of GPU time (no gaps)")
    print("| kernel | launches | us | share |\n|---|---:|---:|---:|")
    for r in s["by_kernel"]:
        print(f"| {r['kernel']} | {r['launches']} | {r['us']:.1f} | {100 * r['share']:.1f}% |")


def kernel_rows(rows):
    out = []
    for i, name, m in launches(rows):
        out.append({"id": i, "kernel": short_name(name), "metrics": {k: v for k, (v, _) in m.items()},
                    "units": {k: u for k, (_, u) in m.items()}})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["step", "kernels"])
    ap.add_argument("csv")
    ap.add_argument("--marker", default="ArgmaxKernel")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    rows = read_rows(a.csv)
    if a.mode == "step":
        result = step_summary(rows, a.marker)
        print_step(result)
    else:
        result = kernel_rows(rows)
        for r in result:
            print(r["kernel"], json.dumps(r["metrics"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
