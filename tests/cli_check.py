"""What the command-line tests share (stdlib only): run a command, stop at the first failed check,
scale a deadline for slower (instrumented) binaries, and keep a test's work directories only when it
fails."""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

# SHARDSERVE_TEST_TIME_SCALE's rule has one home in Python, tools/ci/launch_process.py (the tools the tests
# run scale their deadlines by it too); re-exported here for the tests.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "ci"))
from launch_process import parse_time_scale, time_scale, time_scale_error  # noqa: E402,F401
# Ports for the servers a test must name one for: outside the kernel's ephemeral range, claimed (ports.py).
from ports import free_port, free_ports  # noqa: E402,F401


def _time_scale():
    try:
        return time_scale()
    except ValueError as e:
        sys.exit(str(e))  # exit status 1, the message on stderr


TIME_SCALE = _time_scale()


def scaled(seconds):
    """`seconds`, a deadline for waiting on a process of ours, times SHARDSERVE_TEST_TIME_SCALE (default
    1; tools/ci/sanitize.sh asan-all sets it for the ASan binaries, as tests/process_harness.h reads it)."""
    return seconds * TIME_SCALE


_work_dirs = []


def work_dir(prefix):
    """A new directory for a test's logs and files, under the temp dir; remove_work_dirs() removes it
    once the test has passed (a failed test's are kept, for its logs)."""
    path = tempfile.mkdtemp(prefix=prefix)
    _work_dirs.append(path)
    return path


def remove_work_dirs():
    """Removes every work_dir() of this process: call it when the test has passed."""
    while _work_dirs:
        shutil.rmtree(_work_dirs.pop(), ignore_errors=True)


def run_unittests(argv):
    """unittest.main over `argv`; the work dirs are removed when every case passed. Exits with its
    status."""
    result = unittest.main(argv=argv, verbosity=2, exit=False).result
    if result.wasSuccessful():
        remove_work_dirs()
    sys.exit(0 if result.wasSuccessful() else 1)


def run(cmd, timeout=60):
    """(exit code, stdout, stderr) of `cmd`, a list; `timeout` is scaled()."""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(timeout))
    return p.returncode, p.stdout, p.stderr


def check(cond, what, out=""):
    """Prints FAIL with `what` and `out`, and exits 1, unless `cond`."""
    if not cond:
        print(f"FAIL: {what}\n{out}")
        sys.exit(1)
