#!/usr/bin/env python3
"""`shardserve launch` supervision and spares (docs/healing.md).

1. A worker SIGKILLed while the cluster serves is restarted by launch, takes its slot back, the
   group heals under a new epoch and serves again. Killed again 12 s later, it is restarted after
   1 s again (not 2: it was not crash-looping), and the group heals under epoch 3.
2. With --spare-workers 1 and --max-worker-restarts 1, the spare takes the killed worker's slot at
   once, and launch restarts the killed worker with its own command line (no --spare): the
   coordinator, finding every slot of its node held, makes it a spare; the group heals and has a
   spare again.

Each starts `shardserve launch --nodes 1 --gpus-per-node 2` (CPU, the demo model) on free ports,
waits until it is ready, SIGKILLs one of its worker processes (found as a child of launch, by pid,
not a spare), then checks the launch log, that `shardserve status` comes back to `state serving,
epoch 2`, that a greedy generation gives the token ids it gave before the kill, and the coordinator's
heal metrics by value (one heal and one duration per kill, nothing resumed or failed: no request was in
flight; cluster_state serving), after each heal.
Bounded in time; every process is stopped at the end.

usage: launch_heal_test.py BIN_DIR
"""
import os
import re
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "ci"))
from launch_process import LaunchProcess, children, scrape_heal_metrics  # noqa: E402
from cli_check import remove_work_dirs, scaled, work_dir  # noqa: E402 SHARDSERVE_TEST_TIME_SCALE


def fail(message):
    print(f"launch_heal_test.py: FAIL: {message}")
    sys.exit(1)


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


GREEDY_TOKENS = 16


def greedy_ids(cli, address, env):
    """The token ids of a greedy generation of GREEDY_TOKENS tokens (ignore_eos), from `shardserve generate
    --show-ids`; fails the test unless it succeeds with that many."""
    r = subprocess.run([cli, "generate", "--address", address, "--prompt", "Hello", "--max-tokens", str(GREEDY_TOKENS),
                        "--temperature", "0", "--ignore-eos", "--show-ids"], capture_output=True, text=True, env=env,
                       timeout=120)
    ids = [int(i) for i in re.findall(r"\[(\d+)\]", r.stdout)]
    if r.returncode != 0 or len(ids) != GREEDY_TOKENS:
        fail(f"generate failed or gave {len(ids)} of {GREEDY_TOKENS} tokens: {r.stdout}{r.stderr}")
    return ids


def expect_heal_metrics(log_dir, heals):
    """The coordinator's heal metrics, by value, after `heals` heals of kills with no request in flight."""
    m = scrape_heal_metrics(log_dir)
    want = {"shardserve_heals_total": heals, "shardserve_heal_duration_seconds_count": heals,
            "shardserve_heal_requests_resumed_total": 0, "shardserve_heal_requests_failed_total": 0,
            "state": "serving"}
    if m != want:
        fail(f"the coordinator's heal metrics after {heals} heal(s) are {m}, expected {want}")


def run(bin_dir, spare):
    cli = os.path.join(bin_dir, "shardserve")
    log_dir = work_dir("launch_heal_test.")
    # A state directory of its own: launch's cluster.json (address, TLS files), which the client
    # commands below read, is not overwritten or removed by another launch running beside this test
    # (LaunchProcess starts launch with this SHARDSERVE_STATE_DIR).
    env = dict(os.environ, SHARDSERVE_STATE_DIR=os.path.join(log_dir, "state"))
    extra = ["--spare-workers", "1", "--max-worker-restarts", "1"] if spare else []
    launch = LaunchProcess(
        [cli, "launch", "--nodes", "1", "--gpus-per-node", "2", "--address", "127.0.0.1:0", "--metrics-port-base",
         "0", "--log-dir", log_dir, "--worker-threads", "1", "--heal-timeout-seconds", "120"] + extra, log_dir)
    wait_for = lambda pattern, seconds: launch.wait_for(pattern, scaled(seconds))  # raises RuntimeError: `finally` stops launch, then __main__ fails the test

    try:
        address = wait_for(r"ready\. Connect to (\S+) ", 240).group(1)
        # The undisturbed run's greedy tokens: each healed group must give the same.
        reference = greedy_ids(cli, address, env)
        workers = [p for p in children(launch.pid)
                   if cmdline(p)[:1] and cmdline(p)[0].endswith(b"shardserve-worker") and b"--spare" not in cmdline(p)]
        if len(workers) != 2:
            fail(f"expected 2 worker processes (not spares) under launch, found {workers}")
        victim = workers[1]
        os.kill(victim, signal.SIGKILL)
        if spare:
            wait_for(r"restarted worker node0/\d$", 60)
        else:
            wait_for(r"restarting worker node0/\d in 1 s \(restart 1 of at most 5\)", 60)
            wait_for(r"restarted worker node0/\d", 60)
        deadline = time.time() + scaled(180)
        status = ""
        while time.time() < deadline:
            r = subprocess.run([cli, "status", "--address", address], capture_output=True, text=True, env=env, timeout=30)
            status = r.stdout + r.stderr
            if r.returncode == 0 and "state serving, epoch 2" in status:
                break
            time.sleep(0.5)
        else:
            fail(f"the cluster did not serve again under epoch 2:\n{status}\n{launch.output()}")
        healed = greedy_ids(cli, address, env)
        if healed != reference:
            fail(f"the greedy tokens changed with the heal (epoch 2): {reference} -> {healed}")
        expect_heal_metrics(log_dir, 1)
        if not spare:
            # Killed again well after its restart (it was not crash-looping): restarted after 1 s
            # again, not 2 (the backoff doubles only for a worker that dies within 10 s of its restart).
            time.sleep(12)
            again = [p for p in children(launch.pid)
                     if cmdline(p)[:1] and cmdline(p)[0].endswith(b"shardserve-worker") and p not in workers]
            if len(again) != 1:
                fail(f"expected the one restarted worker process under launch, found {again}")
            os.kill(again[0], signal.SIGKILL)
            wait_for(r"restarting worker node0/\d in 1 s \(restart 2 of at most 5\)", 60)
            deadline = time.time() + scaled(60)
            while sum("restarted worker node0/" in l for l in launch.lines()) < 2 and time.time() < deadline:
                time.sleep(0.1)
            deadline = time.time() + scaled(180)
            while time.time() < deadline:
                r = subprocess.run([cli, "status", "--address", address], capture_output=True, text=True, env=env, timeout=30)
                if r.returncode == 0 and "state serving, epoch 3" in r.stdout + r.stderr:
                    break
                time.sleep(0.5)
            else:
                fail(f"the cluster did not serve again under epoch 3:\n{r.stdout}{r.stderr}\n{launch.output()}")
            healed = greedy_ids(cli, address, env)
            if healed != reference:
                fail(f"the greedy tokens changed with the second heal (epoch 3): {reference} -> {healed}")
            expect_heal_metrics(log_dir, 2)
        if spare:
            coordinator_log = open(os.path.join(log_dir, "coordinator.log")).read()
            if "spare takes slot" not in coordinator_log:
                fail("the coordinator's log does not say that the spare took the slot")
            # The restarted worker, a plain worker again, is made the next spare by the coordinator
            # (bounded wait: it may still be starting).
            restarted = [p for p in children(launch.pid)
                         if cmdline(p)[:1] and cmdline(p)[0].endswith(b"shardserve-worker") and p not in workers
                         and b"--spare" not in cmdline(p)]
            if len(restarted) != 1:
                fail(f"expected the restarted worker under launch without --spare, found {restarted}")
            deadline = time.time() + 120
            made_spare = "as a spare: every slot of node node0 has a worker"
            while made_spare not in coordinator_log and time.time() < deadline:
                time.sleep(0.5)
                coordinator_log = open(os.path.join(log_dir, "coordinator.log")).read()
            if made_spare not in coordinator_log or coordinator_log.count("as a spare:") < 2:
                fail(f"the restarted worker did not register as a spare:\n{coordinator_log[-3000:]}")
        print(f"launch_heal_test.py: OK ({'a spare took the slot, the worker came back as a spare' if spare else 'worker restarted by launch'}, "
              "group healed under epoch 2, the same greedy tokens after each heal)")
    finally:
        launch.stop()


if __name__ == "__main__":
    try:
        run(sys.argv[1], spare=False)
        run(sys.argv[1], spare=True)
        remove_work_dirs()  # passed: no logs to keep
    except RuntimeError as e:  # from LaunchProcess.wait_for: launch exited, or no such line in time
        fail(e)
