#!/usr/bin/env python3
"""`shardserve launch` restarts a dead coordinator, whose successor adopts the workers
(docs/healing.md "The coordinator restarts").

Starts `shardserve launch --nodes 1 --gpus-per-node 2` (CPU, the demo model, plaintext, free
ports), waits until it is ready and generates greedily once, then SIGKILLs the coordinator process
(found as a child of launch, by pid). Checks that launch logs the restart, that the same two worker
processes are still running, that `shardserve status` comes back to `state serving, epoch 2`, that
the new coordinator adopted both workers (its log, and shardserve_workers_adopted_total 2 on its
/metrics), that no worker loaded its shard twice, and that the same greedy request gives the same
text. Bounded in time; every process is stopped at the end.

usage: launch_adopt_test.py BIN_DIR
"""
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

from cli_check import remove_work_dirs, scaled, work_dir  # SHARDSERVE_TEST_TIME_SCALE

from launch_heal_test import cmdline  # noqa: E402 (this directory is on sys.path)
from launch_process import LaunchProcess, children  # noqa: E402 (tools/, which launch_heal_test puts on sys.path)


def fail(message):
    print(f"launch_adopt_test.py: FAIL: {message}")
    sys.exit(1)


def exe(pid):
    return (cmdline(pid) or [b""])[0]


def main(bin_dir):
    cli = os.path.join(bin_dir, "shardserve")
    log_dir = work_dir("launch_adopt_test.")
    env = dict(os.environ, SHARDSERVE_STATE_DIR=os.path.join(log_dir, "state"))
    launch = LaunchProcess(  # with the same SHARDSERVE_STATE_DIR as env's
        [cli, "launch", "--nodes", "1", "--gpus-per-node", "2", "--address", "127.0.0.1:0", "--metrics-port-base",
         "0", "--http-port", "0", "--log-dir", log_dir, "--worker-threads", "1", "--insecure"], log_dir)
    wait_for = lambda pattern, seconds: launch.wait_for(pattern, scaled(seconds))  # raises RuntimeError: `finally` stops launch, then __main__ fails the test

    def generate(address):
        r = subprocess.run([cli, "generate", "--address", address, "--prompt", "Hello", "--max-tokens", "8",
                            "--temperature", "0"], capture_output=True, text=True, timeout=120, env=env)
        if r.returncode != 0:
            fail(f"generate failed: {r.stdout}{r.stderr}\n{launch.output()}")
        return r.stdout

    try:
        address = wait_for(r"ready\. Connect to (\S+) ", 240).group(1)
        # SHARDSERVE_STATE_DIR did not exist and --insecure makes no certificates in it: launch makes it
        # for cluster.json, which the client commands read when they are given no --address.
        if not os.path.exists(os.path.join(log_dir, "state", "cluster.json")) or "cannot write" in launch.output():
            fail(f"launch did not write {log_dir}/state/cluster.json:\n{launch.output()}")
        before = generate(address)
        if not before.strip():
            fail("generate printed nothing before the restart")
        procs = children(launch.pid)
        coordinators = [p for p in procs if exe(p).endswith(b"shardserve-coordinator")]
        workers = sorted(p for p in procs if exe(p).endswith(b"shardserve-worker"))
        if len(coordinators) != 1 or len(workers) != 2:
            fail(f"expected 1 coordinator and 2 workers under launch, found {coordinators} and {workers}")
        os.kill(coordinators[0], signal.SIGKILL)
        wait_for(r"restarting the coordinator in 1 s \(restart 1 of at most 5\)", 60)
        wait_for(r"restarted the coordinator on ", 60)
        deadline = time.time() + scaled(180)
        status = ""
        while time.time() < deadline:
            r = subprocess.run([cli, "status", "--address", address], capture_output=True, text=True, timeout=30,
                               env=env)
            status = r.stdout + r.stderr
            if r.returncode == 0 and "state serving, epoch 2" in status:
                break
            time.sleep(0.5)
        else:
            fail(f"the cluster did not serve again under epoch 2:\n{status}\n{launch.output()}")
        now = sorted(p for p in children(launch.pid) if exe(p).endswith(b"shardserve-worker"))
        if now != workers:
            fail(f"the worker processes changed: {workers} -> {now}")
        after = generate(address)
        if after != before:
            fail(f"the greedy text changed after the restart: {before!r} -> {after!r}")
        with open(os.path.join(log_dir, "coordinator.log")) as f:
            log = f.read()
        if log.count("adopting into slot") != 2:
            fail(f"the new coordinator did not log 2 adoptions:\n{log[-3000:]}")
        metrics = re.findall(r"metrics on http://(\S+)/metrics", log)[-1]
        body = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
        m = re.search(r"^shardserve_workers_adopted_total\{[^}]*\} (\S+)$", body, re.M)
        if not m or float(m.group(1)) != 2:
            fail(f"shardserve_workers_adopted_total is not 2 on {metrics}: {m and m.group(0)}")
        for name in os.listdir(log_dir):
            if name.startswith("worker-"):
                with open(os.path.join(log_dir, name)) as f:
                    text = f.read()
                if text.count("loaded in") != 1 or "adopted by the coordinator" not in text:
                    fail(f"{name}: expected one load and one adoption:\n{text[-3000:]}")
        print("launch_adopt_test.py: OK (coordinator SIGKILLed, restarted by launch, both workers adopted without "
              "a reload, epoch 2, same greedy text)")
    finally:
        launch.stop()


if __name__ == "__main__":
    try:
        main(sys.argv[1])
        remove_work_dirs()  # passed: no logs to keep
    except RuntimeError as e:  # from LaunchProcess.wait_for: launch exited, or no such line in time
        fail(e)
