"""Loopback ports for the servers the Python tests and tools start and must name a port for
(`shardserve launch`'s --address, --http-port, where 0 means off, and --metrics-port-base block).
Where a server can bind port 0 and say which it got (the coordinator's --port-file and
--http-port-file, which the C++ tests' cluster harness and `bench --compare` use), that is better.

A port found by binding port 0 and releasing it comes from the kernel's ephemeral range
(net.ipv4.ip_local_port_range), the range every later bind to port 0 and every outgoing connection
takes its port from: a server told to listen on it may find it taken (seen in CI: a coordinator's
/metrics, bound to port 0, got the port a test had just picked for the same coordinator's HTTP API).
So the ports come from outside that range, where the kernel hands out none, drawn at random and
checked by binding, and each is claimed with a file in one directory under the temp dir (an
exclusive create), so that two processes picking at once never pick the same one. A claim older
than CLAIM_SECONDS is stale and may be taken again (tests/ports_test.py).

free_ports(n): n distinct ports. free_port(): one. free_port_block(n): a base port B with B..B+n-1
free and claimed.
"""
import errno
import os
import random
import socket
import tempfile
import time

CLAIM_SECONDS = 600
LOWEST = 10000  # below: ports that well-known services and our own defaults (8000, 9400...) use
CLAIM_DIR = os.path.join(tempfile.gettempdir(), "shardserve-ports")
_rng = random.SystemRandom()


def _ephemeral_range():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
            return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _candidate_ranges():
    """[first, last] ranges of ports the kernel never hands to a bind to port 0."""
    low, high = _ephemeral_range()
    ranges = [(a, b) for a, b in [(LOWEST, low - 1), (high + 1, 65535)] if b - a >= 1000]
    return ranges or [(LOWEST, 65535)]  # an ephemeral range over nearly all ports: the bind check alone


def _bindable(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _claim(port):
    """Whether this process now holds the claim on `port` (a fresh file, or a stale one renewed;
    True also where the directory cannot be written, another user's: the bind check alone)."""
    path = os.path.join(CLAIM_DIR, str(port))
    try:
        os.makedirs(CLAIM_DIR, mode=0o1777, exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except OSError as e:
        if e.errno != errno.EEXIST:
            return True
    try:
        if time.time() - os.stat(path).st_mtime < CLAIM_SECONDS:
            return False
        os.utime(path)  # stale: taken again
        return True
    except OSError:
        return False


def free_port_block(n):
    """A base port B with B..B+n-1 bindable on 127.0.0.1 now and claimed by this process."""
    ranges = _candidate_ranges()
    for _ in range(1000):
        first, last = _rng.choices(ranges, weights=[b - a + 1 for a, b in ranges])[0]
        if last - first + 1 < n:
            continue
        base = _rng.randint(first, last - n + 1)
        if all(_bindable(p) for p in range(base, base + n)) and all(_claim(p) for p in range(base, base + n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports on 127.0.0.1 outside the ephemeral range {_ephemeral_range()}")


def free_ports(n):
    """n distinct ports, each bindable on 127.0.0.1 now and claimed by this process."""
    return [free_port_block(1) for _ in range(n)]


def free_port():
    """One port, as free_ports(1)."""
    return free_port_block(1)
