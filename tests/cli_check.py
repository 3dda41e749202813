"""What the command-line tests share (stdlib only): run a command, and stop at the first failed check."""
import subprocess
import sys


def run(cmd, timeout=60):
    """(exit code, stdout, stderr) of `cmd`, a list."""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def check(cond, what, out=""):
    """Prints FAIL with `what` and `out`, and exits 1, unless `cond`."""
    if not cond:
        print(f"FAIL: {what}\n{out}")
        sys.exit(1)
