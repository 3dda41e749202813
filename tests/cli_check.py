"""What the command-line tests share (stdlib only): run a command, stop at the first failed check,
and scale a deadline for slower (instrumented) binaries."""
import os
import re
import subprocess
import sys


def time_scale_error(text):
    """The error for a refused SHARDSERVE_TEST_TIME_SCALE, word for word tests/process_harness.h's."""
    return f"SHARDSERVE_TEST_TIME_SCALE='{text}': expected a number from 1 to 1000 (1 = unscaled)"


def parse_time_scale(text):
    """SHARDSERVE_TEST_TIME_SCALE's value `text`: a decimal number (digits, optionally a point and digits)
    from 1 to 1000; 1 when empty. Anything else raises ValueError(time_scale_error(text)): a scale below 1
    would shorten every deadline, a typo must not do that silently. The rule of tests/process_harness.h's
    ParseTimeScale (not Python's float(), which takes "1_000", " 3" and "inf")."""
    if not text:
        return 1.0
    if not re.fullmatch(r"[0-9]+(\.[0-9]+)?", text) or not 1.0 <= float(text) <= 1000.0:
        raise ValueError(time_scale_error(text))
    return float(text)


def _time_scale():
    try:
        return parse_time_scale(os.environ.get("SHARDSERVE_TEST_TIME_SCALE", ""))
    except ValueError as e:
        sys.exit(str(e))  # exit status 1, the message on stderr


TIME_SCALE = _time_scale()


def scaled(seconds):
    """`seconds`, a deadline for waiting on a process of ours, times SHARDSERVE_TEST_TIME_SCALE (default
    1; tools/sanitize.sh asan-all sets it for the ASan binaries, as tests/process_harness.h reads it)."""
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
