"""`shardserve launch` as a child process in a session of its own, for the tools and tests that
start local clusters and drive them (tools/bench/chaos_bench.py, tools/gpu/gpu_layouts_check.py,
tests/launch_heal_test.py, tests/launch_adopt_test.py).

LaunchProcess(cmd, log_dir) starts `cmd` (a `shardserve launch ... --address 127.0.0.1:0` command
line) with its output in LOG_DIR/launch.out and a state directory of its own (launch writes
cluster.json there, not over the one of a cluster the user, or a test running beside this one, has
started). wait_for(pattern, seconds) returns the re.Match of the first line of its output that
matches `pattern`, waiting up to `seconds`; wait_ready(seconds) returns the address it serves on once
it says "ready. Connect to". Both raise RuntimeError, with the output's tail, if launch exits or the
time passes first. `pid` is launch's process id. stop() ends it and everything it started (SIGTERM, then SIGKILL of the session), whatever state it
is in. Not thread-safe.

metric_sum(text, name, **labels) reads a Prometheus /metrics page: the sum of the samples of `name` whose
labels include `labels`.

children(pid) lists a process's children (launch's coordinator and workers), for the tools and tests
that kill or watch one of them. scrape_heal_metrics(log_dir) reads the heal metrics off the /metrics
of the coordinator that logs to LOG_DIR/coordinator.log.

time_scale() is SHARDSERVE_TEST_TIME_SCALE, the factor every deadline waiting on a process of ours is
multiplied by (slow, instrumented builds: tools/ci/sanitize.sh sets it), by the one rule
(parse_time_scale; tests/process_harness.h's ParseTimeScale is its C++ twin): the tools these classes
serve scale their deadlines by it, and tests/cli_check.py's scaled() reads it from here.
"""
import os
import re
import signal
import subprocess
import time
import urllib.request


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


def time_scale():
    """SHARDSERVE_TEST_TIME_SCALE from the environment, read now (1 when unset); ValueError as above."""
    return parse_time_scale(os.environ.get("SHARDSERVE_TEST_TIME_SCALE", ""))


def metric_sum(text, name, **labels):
    """The sum of the samples of `name` in the Prometheus text `text` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def children(pid):
    """The pids of `pid`'s children (from /proc/PID/task/*/children); [] once `pid` has exited. A thread
    that exits while they are read is skipped."""
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return out


HEAL_METRICS = ("shardserve_heals_total", "shardserve_heal_duration_seconds_count",
                "shardserve_heal_requests_resumed_total", "shardserve_heal_requests_failed_total")
CLUSTER_STATES = ("starting", "serving", "healing", "degraded")


def scrape_heal_metrics(log_dir):
    """The coordinator's heal metrics ({name: value}, and "state": the one shardserve_cluster_state at
    1 with the others at 0, else what is wrong), from the /metrics address in its log."""
    with open(os.path.join(log_dir, "coordinator.log"), errors="replace") as f:
        urls = re.findall(r"metrics on (http://\S+/metrics)", f.read())
    if not urls:
        raise RuntimeError("the coordinator's log names no /metrics address")
    text = urllib.request.urlopen(urls[-1], timeout=10 * time_scale()).read().decode()
    out = {name: 0.0 for name in HEAL_METRICS}
    states = {}
    for line in text.splitlines():
        m = re.match(r"([a-z_]+)(\{[^}]*\})? (\S+)$", line)
        if not m:
            continue
        if m.group(1) in out:
            out[m.group(1)] += float(m.group(3))
        state = re.search(r'state="([a-z]+)"', m.group(2) or "")
        if m.group(1) == "shardserve_cluster_state" and state:
            states[state.group(1)] = float(m.group(3))
    ones = [s for s in CLUSTER_STATES if states.get(s) == 1]
    exact = set(states) == set(CLUSTER_STATES) and all(states[s] in (0, 1) for s in states) and len(ones) == 1
    out["state"] = ones[0] if exact else f"shardserve_cluster_state is {states}"
    return out


class LaunchProcess:
    def __init__(self, cmd, log_dir):
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self.command = cmd
        self.out_path = os.path.join(log_dir, "launch.out")
        self.out = open(self.out_path, "w")
        env = dict(os.environ, SHARDSERVE_STATE_DIR=os.path.join(log_dir, "state"))
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        self.pid = self.proc.pid

    def output(self):
        with open(self.out_path, errors="replace") as f:
            return f.read()

    def lines(self):
        return self.output().splitlines(keepends=True)

    def wait_for(self, pattern, seconds, timeout_message=None):
        deadline = time.time() + seconds
        while time.time() < deadline:
            for line in self.lines():
                m = re.search(pattern, line)
                if m:
                    return m
            if self.proc.poll() is not None:
                raise RuntimeError(f"launch exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            time.sleep(0.2)
        message = timeout_message or f"no line like {pattern!r} within {seconds} s"
        raise RuntimeError(f"{message}:\n{self.output()[-4000:]}")

    def wait_ready(self, seconds):
        return self.wait_for(r"ready\. Connect to (\S+) ", seconds,
                             timeout_message=f"launch not ready within {seconds:.0f} s").group(1)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything left in its session
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.out.close()
