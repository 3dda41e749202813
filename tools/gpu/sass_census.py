#!/usr/bin/env python3
"""Counts the SASS instructions of CUDA kernels, and of each loop in them, without a GPU.

Compiles one .cu file of this tree to a cubin for one architecture (nvcc -cubin, the build's
optimisation and defines), disassembles it with nvdisasm and, for every kernel whose mangled name
matches --kernel, prints its instruction count and each loop (a backward branch: the instructions
from its target to it) with the most frequent opcodes. A kernel that is bound by the instructions
it issues a weight (the int4 GEMVs on the H200: docs/gpu.md) can so be compared with another
version here, before any GPU time is spent: divide a loop's length by the weights it handles.

nvdisasm is not in the CUDA toolkit Debian-style installs here carry; it comes from PyPI's
nvidia-cuda-nvdisasm (tools/gpu/sass_census.py --setup installs it, pinned, into .venv-sass), or from
$NVDISASM / PATH / /usr/local/cuda/bin.

Usage: tools/gpu/sass_census.py --setup
       tools/gpu/sass_census.py kernels/cuda/quant_matmul.cu --kernel 'Int4(Folded)?GemvKernelI13__nv_bfloat16S3_Li1E'
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV = os.path.join(ROOT, ".venv-sass")
PIN = "nvidia-cuda-nvdisasm==13.5.37"


def find_nvdisasm():
    candidates = [os.environ.get("NVDISASM"), shutil.which("nvdisasm"), "/usr/local/cuda/bin/nvdisasm"]
    for root, _, files in os.walk(os.path.join(VENV, "lib")):
        if "nvdisasm" in files:
            candidates.append(os.path.join(root, "nvdisasm"))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def setup():
    if not os.path.exists(os.path.join(VENV, "bin", "python")):
        subprocess.run([sys.executable, "-m", "venv", VENV], check=True)
    subprocess.run([os.path.join(VENV, "bin", "pip"), "install", "-q", "--disable-pip-version-check", PIN],
                   check=True)
    for root, _, files in os.walk(os.path.join(VENV, "lib")):
        if "nvdisasm" in files:
            os.chmod(os.path.join(root, "nvdisasm"), 0o755)
    print("sass_census: nvdisasm at", find_nvdisasm())


def functions(sass):
    """{mangled name: [instruction or '.L_x_N' label, ...]} from `nvdisasm -c` text."""
    out, cur = {}, None
    for line in sass.splitlines():
        m = re.match(r"\s*\.text\.(\S+):", line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        if cur is None:
            continue
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            cur.append(m.group(1))
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            cur.append(m.group(1))
    return out


def opcode(ins):
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0]


def census(lines):
    labels, ins = {}, []
    for item in lines:
        if item.startswith(".L_x_"):
            labels[item] = len(ins)
        else:
            ins.append(item)
    loops = []
    for i, op in enumerate(ins):
        m = re.search(r"BRA.*?(\.L_x_\d+)", op)
        if m and labels.get(m.group(1), len(ins)) < i:  # a backward branch: a loop (not a branch to itself)
            body = ins[labels[m.group(1)]:i + 1]
            loops.append((labels[m.group(1)], len(body), collections.Counter(opcode(o) for o in body)))
    return len(ins), loops


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cu", nargs="?", help="a .cu file of this tree")
    ap.add_argument("--kernel", default=".", help="regex on the kernels' mangled names")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--top", type=int, default=12, help="opcodes shown a loop")
    ap.add_argument("--setup", action="store_true", help="install nvdisasm from PyPI into .venv-sass")
    args = ap.parse_args()
    if args.setup:
        setup()
        if not args.cu:
            return 0
    if not args.cu:
        ap.error("a .cu file is needed")
    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        sys.exit("sass_census: no nvdisasm (tools/gpu/sass_census.py --setup installs " + PIN + ")")
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        subprocess.run([nvcc, "-O2", "-DNDEBUG", "-DSHARDSERVE_HAVE_CUDA=1", "-I" + ROOT, "-std=c++17", "-cubin",
                        "-arch=" + args.arch, args.cu, "-o", cubin], check=True)
        sass = subprocess.run([nvdisasm, "-c", cubin], check=True, capture_output=True, text=True).stdout
    found = 0
    for name, lines in functions(sass).items():
        if not re.search(args.kernel, name):
            continue
        found += 1
        total, loops = census(lines)
        print(f"{name}: {total} instructions")
        for start, length, ops in loops:
            top = ", ".join(f"{k} {v}" for k, v in ops.most_common(args.top))
            print(f"  loop at {start}: {length} instructions ({top})")
    if not found:
        sys.exit(f"sass_census: no kernel matches {args.kernel!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
