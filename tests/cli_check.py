"""What the command-line tests share (stdlib only): run a command, stop at the first failed check,
and scale a deadline for slower (instrumented) binaries."""
import os
import socket
import subprocess
import sys

# SHARDSERVE_TEST_TIME_SCALE's rule has one home in Python, tools/ci/launch_process.py (the tools the tests
# run scale their deadlines by it too); re-exported here for the tests.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "ci"))
from launch_process import parse_time_scale, time_scale, time_scale_error  # noqa: E402,F401


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


def free_ports(n):
    """n distinct loopback ports that were free a moment ago: all bound at once, then released, so
    that no two are the same (one port picked, released and picked again was a launch's HTTP port
    and its gRPC port both). Another process may still take one before the server binds it; the
    servers then refuse to start, naming the port (they do not share a port: SO_REUSEPORT is off)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port():
    """One loopback port that was free a moment ago (free_ports(1))."""
    return free_ports(1)[0]


def run(cmd, timeout=60):
    """(exit code, stdout, stderr) of `cmd`, a list; `timeout` is scaled()."""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=scaled(timeout))
    return p.returncode, p.stdout, p.stderr


def check(cond, what, out=""):
    """Prints FAIL with `what` and `out`, and exits 1, unless `cond`."""
    if not cond:
        print(f"FAIL: {what}\n{out}")
        sys.exit(1)
