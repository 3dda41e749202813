#!/usr/bin/env python3
"""`shardserve launch` shares the CPUs and the memory it may use (its affinity and the host's memory,
under its control group's limits) out among its CPU workers, and warns where a --worker-threads
given makes them run more threads than those CPUs (docs/cli.md).

Each case starts launch under `taskset -c 0` (one CPU: every machine has CPU 0 in its set) on the
tiny fixture model, plaintext, free ports and no HTTP API, waits until it serves, reads the
workers' --threads and --memory-gb in the commands launch wrote, and stops it:
  - one worker of --worker-threads 2: the warning naming 2 threads on 1 CPU and the share 1, and
    the cluster still serves; --worker-memory-gb 2 given, each worker's --memory-gb 2;
  - one worker, no --worker-threads: --threads 1 (the CPUs launch may use, not the machine's), no
    warning; --memory-gb the host's memory (or less, under a memory limit);
  - two workers of --worker-threads 1: 2 threads on 1 CPU, but none could take fewer: no warning;
    each --memory-gb half of what one worker had.

usage: launch_resources_test.py BIN_DIR
"""
import os
import re
import shlex
import sys
import unittest

from cli_check import run_unittests, scaled, work_dir  # SHARDSERVE_TEST_TIME_SCALE

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "ci"))
from launch_process import LaunchProcess  # noqa: E402

BIN_DIR = ""
MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "models", "llama3_rope")


HOST_GIB = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30


class LaunchResourcesTest(unittest.TestCase):
    one_worker_gib = 0.0  # case 2's worker's --memory-gb

    def launch(self, gpus, extra):
        """Starts launch on CPU 0 alone with `gpus` workers, waits until it serves; (its output, each
        worker's --threads, each worker's --memory-gb) from commands.sh."""
        log_dir = work_dir("launch_resources_test.")
        launch = LaunchProcess(
            ["taskset", "-c", "0", os.path.join(BIN_DIR, "shardserve"), "launch", "--model", MODEL, "--nodes", "1",
             "--gpus-per-node", str(gpus), "--address", "127.0.0.1:0", "--metrics-port-base", "0", "--log-dir",
             log_dir, "--http-port", "0", "--insecure"] + extra, log_dir)
        try:
            launch.wait_ready(scaled(240))
            output = launch.output()
        finally:
            launch.stop()
        threads, memory = [], []
        with open(os.path.join(log_dir, "commands.sh")) as f:
            for line in f:
                args = shlex.split(line)
                if args and args[0].endswith("shardserve-worker"):
                    self.assertIn("--threads", args, line)
                    self.assertIn("--memory-gb", args, line)
                    threads.append(int(args[args.index("--threads") + 1]))
                    memory.append(float(args[args.index("--memory-gb") + 1]))
        self.assertEqual(len(threads), gpus, f"worker command lines in {log_dir}/commands.sh")
        return output, threads, memory

    def test_1_more_threads_than_cpus_are_warned(self):
        output, threads, memory = self.launch(1, ["--worker-threads", "2", "--worker-memory-gb", "2"])
        self.assertEqual(threads, [2])
        self.assertEqual(memory, [2.0])
        self.assertRegex(output, r"shardserve launch: warning: 1 worker of 2 compute threads run 2 threads on the "
                                 r"1 CPU available here: .* --worker-threads 1 \(the CPUs shared out, the default\)")

    def test_2_the_default_shares_the_cpus_and_memory_launch_may_use(self):
        output, threads, memory = self.launch(1, [])
        self.assertEqual(threads, [1])
        self.assertNotIn("warning:", output)
        self.assertGreater(memory[0], 0)
        self.assertLessEqual(memory[0], HOST_GIB + 0.001)
        LaunchResourcesTest.one_worker_gib = memory[0]

    def test_3_no_warning_where_no_worker_could_take_fewer(self):
        output, threads, memory = self.launch(2, ["--worker-threads", "1"])
        self.assertEqual(threads, [1, 1])
        self.assertNotIn("warning:", output)
        self.assertEqual(memory[0], memory[1])
        self.assertLessEqual(memory[0], HOST_GIB / 2 + 0.001)
        if LaunchResourcesTest.one_worker_gib:  # case 2 ran first (unittest runs them by name)
            self.assertAlmostEqual(memory[0], LaunchResourcesTest.one_worker_gib / 2, delta=0.002)


if __name__ == "__main__":
    BIN_DIR = sys.argv[1]
    run_unittests(sys.argv[:1])
