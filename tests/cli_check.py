"""What the command-line tests share (stdlib only): run a command, stop at the first failed check,
and scale a deadline for slower (instrumented) binaries."""
import os
import subprocess
import sys


def _time_scale():
    text = os.environ.get("SHARDSERVE_TEST_TIME_SCALE", "")
    if not text:
        return 1.0
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 1.0 <= value <= 1000.0:  # a typo must not shorten every deadline silently
        sys.exit(f"SHARDSERVE_TEST_TIME_SCALE={text}: expected a number from 1 to 1000")
    return value


TIME_SCALE = _time_scale()


def scaled(seconds):
    """`seconds`, a deadline for waiting on a process of ours, times SHARDSERVE_TEST_TIME_SCALE (default
    1; tools/sanitize.sh asan-all sets it for the ASan binaries, as tests/cluster_harness.h reads it)."""
    return seconds * TIME_SCALE


def run(cmd, timeout=60):
    """(exit code, stdout, stderr) of `cmd`, a list; `timeout` is scaled()."""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(timeout))
    return p.returncode, p.stdout, p.stderr


def check(cond, what, out=""):
    """Prints FAIL with `what` and `out`, and exits 1, unless `cond`."""
    if not cond:
        print(f"FAIL: {what}\n{out}")
        sys.exit(1)
