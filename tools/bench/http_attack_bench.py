#!/usr/bin/env python3
"""/health's latency while one client attacks the OpenAI HTTP API of a local cluster: the figure
that says whether one client can starve the API (and with it Kubernetes' probes, which restart a
pod that misses them).

Starts `shardserve launch` (a coordinator and one worker on 127.0.0.1, the given model), then for
each attack probes GET /health on a fresh connection from 127.0.0.1 every --probe-interval seconds
and records how long each answer took (or that none came within --probe-timeout). The attack comes
from another loopback address (--attacker-address): the server caps connections per address
(--http-max-connections-per-peer), and a probe from the attacker's own address would be refused with
them.

  slowloris   --slow connections that each send a request's head one byte a second, reopened when
              the server closes them (the server's head deadline), for --seconds;
  idle        --idle keep-alive connections that each send one GET /v1/models and then stay
              open without another request, reopened when closed, for --seconds;
  both        the two at once.

Prints one line per attack: probes answered, answered 200, median / p99 / max latency, and how the
attack's connections were answered (408, 503 too_many_connections, closed). With --check, exits 1
when a probe went unanswered or answered other than 200 (tests/CMakeLists.txt runs it so).

    .venv-client/bin/python tools/bench/http_attack_bench.py --bin build/bin --model models/demo
"""
import argparse
import os
import re
import selectors
import socket
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ci"))  # launch_process, ports
from launch_process import LaunchProcess, time_scale  # noqa: E402
from ports import free_port  # noqa: E402

HEAD = b"GET /v1/models HTTP/1.1\r\nHost: attacker\r\nUser-Agent: slow\r\nAccept: */*\r\n" + b"X-Pad: " + b"a" * 64 + b"\r\n\r\n"


class Attack:
    """Keeps `count` connections of one kind open until stop(), from one thread (a selector)."""

    def __init__(self, port, kind, count, source):
        self.port, self.kind, self.count, self.source = port, kind, count, source
        self.stopped = threading.Event()
        self.outcomes = {}  # "408", "503 too_many_connections", "closed", "refused" ... -> count
        self.thread = threading.Thread(target=self.run, daemon=True)

    def start(self):
        self.thread.start()

    def stop(self):
        self.stopped.set()
        self.thread.join(timeout=30)

    def note(self, data):
        """Counts how a connection the server closed was answered: the last status it sent, "closed
        idle" for a kept-alive connection closed after its answer, "closed" for none."""
        statuses = re.findall(rb"HTTP/1\.1 (\d+)", data)
        if not statuses:
            key = "closed"
        elif self.kind == "idle" and statuses[-1] == b"200":
            key = "closed idle"
        else:
            key = statuses[-1].decode() + (" too_many_connections" if b"too_many_connections" in data else "")
        self.outcomes[key] = self.outcomes.get(key, 0) + 1

    def open_one(self, sel):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.bind((self.source, 0))
            s.connect_ex(("127.0.0.1", self.port))
        except OSError:
            self.outcomes["refused"] = self.outcomes.get("refused", 0) + 1
            s.close()
            return
        state = {"sent": 0, "got": b"", "next": time.monotonic()}
        if self.kind == "idle":
            state["sent"] = None  # sends its one request once writable
        sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE, state)

    def run(self):
        sel = selectors.DefaultSelector()
        for _ in range(self.count):
            self.open_one(sel)
        while not self.stopped.is_set():
            for key, events in sel.select(timeout=0.05):
                s, st = key.fileobj, key.data
                if events & selectors.EVENT_WRITE:
                    try:
                        if self.kind == "idle" and st["sent"] is None:
                            s.send(b"GET /v1/models HTTP/1.1\r\nHost: attacker\r\n\r\n")
                            st["sent"] = 1
                        sel.modify(s, selectors.EVENT_READ, st)
                    except OSError:
                        pass
                if events & selectors.EVENT_READ:
                    try:
                        chunk = s.recv(65536)
                    except OSError:
                        chunk = b""
                    if chunk:
                        st["got"] += chunk  # an idle connection reads its one answer and stays open
                        continue
                    # Closed by the server: note how, reopen.
                    self.note(st["got"])
                    sel.unregister(s)
                    s.close()
                    self.open_one(sel)
            if self.kind == "slowloris":
                now = time.monotonic()
                for key in list(sel.get_map().values()):
                    st = key.data
                    if st["sent"] is not None and st["sent"] < len(HEAD) and now >= st["next"]:
                        try:
                            key.fileobj.send(HEAD[st["sent"]:st["sent"] + 1])
                            st["sent"] += 1
                        except OSError:
                            pass
                        st["next"] = now + 1.0
        for key in list(sel.get_map().values()):
            key.fileobj.close()


def probe(port, timeout):
    """(seconds, status) of GET /health on a fresh connection; status None when no answer came."""
    start = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n")
            got = b""
            while b"\r\n" not in got:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
    except OSError:
        return time.monotonic() - start, None
    m = re.match(rb"HTTP/1\.1 (\d+)", got)
    return time.monotonic() - start, int(m.group(1)) if m else None


def measure(port, attacks, seconds, interval, timeout):
    for a in attacks:
        a.start()
    time.sleep(min(2.0, seconds / 4))  # let the attack connections open
    results = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        results.append(probe(port, timeout))
        time.sleep(interval)
    for a in attacks:
        a.stop()
    return results


def summary(name, results, attacks):
    answered = [t for t, status in results if status is not None]
    ok = sum(1 for _, status in results if status == 200)
    lat = sorted(answered) or [float("nan")]
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    outcomes = {}
    for a in attacks:
        for k, v in a.outcomes.items():
            outcomes[f"{a.kind} {k}"] = outcomes.get(f"{a.kind} {k}", 0) + v
    print(f"{name:10s} probes {len(results):4d}  answered {len(answered):4d}  200 {ok:4d}  "
          f"median {statistics.median(lat) * 1000:7.1f} ms  p99 {p99 * 1000:7.1f} ms  max {lat[-1] * 1000:7.1f} ms  "
          f"attack answers {dict(sorted(outcomes.items()))}", flush=True)
    return len(results) > 0 and ok == len(results)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True, help="the build's bin/ (shardserve)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--slow", type=int, default=400, help="slowloris connections")
    ap.add_argument("--idle", type=int, default=500, help="idle keep-alive connections")
    ap.add_argument("--seconds", type=float, default=20, help="each attack's length")
    ap.add_argument("--probe-interval", type=float, default=0.1)
    ap.add_argument("--probe-timeout", type=float, default=10)
    ap.add_argument("--attacks", default="slowloris,idle,both")
    ap.add_argument("--attacker-address", default="127.0.0.2",
                    help="the attack's source address (loopback; the probes come from 127.0.0.1, as a "
                         "kubelet's come from its node, not from the client's address)")
    ap.add_argument("--launch-flag", action="append", default=[], help="one more flag for launch (repeatable)")
    ap.add_argument("--check", action="store_true", help="exit 1 unless every probe was answered 200")
    args = ap.parse_args()

    log_dir = tempfile.mkdtemp(prefix="shardserve-http-attack-")
    http_port = free_port()
    launch = LaunchProcess([os.path.join(args.bin, "shardserve"), "launch", "--model", args.model, "--nodes", "1",
                            "--gpus-per-node", "1", "--address", "127.0.0.1:0", "--http-port", str(http_port),
                            "--metrics-port-base", "0", "--log-dir", log_dir] + args.launch_flag, log_dir)
    all_ok = True
    try:
        launch.wait_ready(120 * time_scale())
        print(f"http_attack_bench: {args.model}, /health every {args.probe_interval} s for {args.seconds} s per "
              f"attack; {args.slow} slowloris, {args.idle} idle keep-alive connections", flush=True)
        baseline = measure(http_port, [], min(5.0, args.seconds), args.probe_interval, args.probe_timeout)
        all_ok &= summary("none", baseline, [])
        for name in args.attacks.split(","):
            attacks = []
            if name in ("slowloris", "both"):
                attacks.append(Attack(http_port, "slowloris", args.slow, args.attacker_address))
            if name in ("idle", "both"):
                attacks.append(Attack(http_port, "idle", args.idle, args.attacker_address))
            all_ok &= summary(name, measure(http_port, attacks, args.seconds, args.probe_interval, args.probe_timeout),
                              attacks)
        # Still answering after the attacks.
        result = probe(http_port, args.probe_timeout)
        all_ok &= result[1] == 200
    finally:
        launch.stop()
    if args.check and not all_ok:
        print("http_attack_bench: a /health probe went unanswered or was not 200", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
